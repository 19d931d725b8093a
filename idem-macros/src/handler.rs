//! What the attribute needs to know of the handler it wraps.

use syn::spanned::Spanned;
use syn::{FnArg, GenericArgument, ItemFn, PathArguments, Type};

/// How the handler asks for its `Operation`.
pub(crate) enum OperationParam {
    /// `op: Operation`
    Required(syn::PatType),
    /// `op: Option<Operation>`
    Optional(syn::PatType),
}

/// The handler, taken apart.
pub(crate) struct Handler {
    pub(crate) item: ItemFn,
    /// The index in `item.sig.inputs` of the last `Json<T>` parameter.
    pub(crate) body: Option<usize>,
    /// The index and kind of the `Operation` parameter.
    pub(crate) operation: Option<(usize, OperationParam)>,
}

fn last_segment(ty: &Type) -> Option<&syn::PathSegment> {
    match ty {
        Type::Path(p) if p.qself.is_none() => p.path.segments.last(),
        Type::Paren(p) => last_segment(&p.elem),
        Type::Group(g) => last_segment(&g.elem),
        _ => None,
    }
}

fn is_named(ty: &Type, name: &str) -> bool {
    last_segment(ty).is_some_and(|s| s.ident == name)
}

/// `Option<Operation>`: the inner type is `Operation`.
fn is_option_of_operation(ty: &Type) -> bool {
    let Some(seg) = last_segment(ty) else { return false };
    if seg.ident != "Option" {
        return false;
    }
    let PathArguments::AngleBracketed(args) = &seg.arguments else {
        return false;
    };
    matches!(args.args.first(), Some(GenericArgument::Type(inner)) if is_named(inner, "Operation"))
}

impl Handler {
    /// Checks the handler's shape; every problem is reported, combined.
    pub(crate) fn analyze(item: ItemFn, optional: bool) -> Result<Self, syn::Error> {
        let mut errors: Option<syn::Error> = None;
        let mut push = |e: syn::Error| match &mut errors {
            Some(all) => all.combine(e),
            None => errors = Some(e),
        };
        if item.sig.asyncness.is_none() {
            push(syn::Error::new(
                item.sig.fn_token.span,
                "`#[idempotent]` handlers must be `async fn`",
            ));
        }
        let mut body = None;
        let mut operation = None;
        for (i, input) in item.sig.inputs.iter().enumerate() {
            match input {
                FnArg::Receiver(r) => push(syn::Error::new(
                    r.self_token.span,
                    "`#[idempotent]` works on free `async fn` handlers, not on methods with `self`",
                )),
                FnArg::Typed(pt) => {
                    let kind = if is_named(&pt.ty, "Operation") {
                        if optional {
                            push(syn::Error::new(
                                pt.ty.span(),
                                "an `optional` handler may run without a key: ask for `Option<Operation>`",
                            ));
                        }
                        Some(OperationParam::Required(pt.clone()))
                    } else if is_option_of_operation(&pt.ty) {
                        Some(OperationParam::Optional(pt.clone()))
                    } else {
                        if is_named(&pt.ty, "Json") {
                            body = Some(i);
                        }
                        None
                    };
                    if let Some(kind) = kind {
                        if operation.is_some() {
                            push(syn::Error::new(pt.ty.span(), "`Operation` is asked for twice"));
                        }
                        operation = Some((i, kind));
                    }
                }
            }
        }
        match errors {
            Some(e) => Err(e),
            None => Ok(Handler {
                item,
                body,
                operation,
            }),
        }
    }
}
