//! What the attribute needs to know of the handler it wraps.

use crate::errors::Errors;
use syn::spanned::Spanned;
use syn::{FnArg, GenericArgument, ItemFn, PathArguments, Type};

/// How the handler asks for its `Operation`.
pub(crate) enum OperationParam {
    /// `op: Operation`
    Required(syn::PatType),
    /// `op: Option<Operation>`
    Optional(syn::PatType),
}

/// How the handler reads the request body, which the fingerprint must see.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum BodyKind {
    /// A body extractor (`Json<T>`, `Form<T>`, one of the application's
    /// own): read through idem's, which keeps the bytes, and fingerprinted
    /// as its `FingerprintBody` impl says.
    Extracted,
    /// `String` or `Bytes`: the bytes themselves.
    Raw,
}

/// The extractors that read only the request head (`FromRequestParts`), by
/// name: a handler whose last parameter is one of them reads no body.
const HEAD_ONLY: &[&str] = &[
    "State",
    "Path",
    "Query",
    "Extension",
    "HeaderMap",
    "Method",
    "Uri",
    "Version",
    "OriginalUri",
    "MatchedPath",
    "RawQuery",
    "RawPathParams",
    "ConnectInfo",
    "TypedHeader",
    "Host",
    "CookieJar",
    "SignedCookieJar",
    "PrivateCookieJar",
    "Extensions",
    "NestedPath",
    "Parts",
    "Tenant",
];

/// The body types idem knows by name: they must come last.
fn body_kind(ty: &Type) -> Option<BodyKind> {
    let seg = last_segment(ty)?;
    match seg.ident.to_string().as_str() {
        "Json" | "Form" => Some(BodyKind::Extracted),
        "String" | "Bytes" => Some(BodyKind::Raw),
        _ => None,
    }
}

/// A head-only extractor, or one wrapped in `Option` or `Result`.
fn head_only(ty: &Type) -> bool {
    let Some(seg) = last_segment(ty) else { return false };
    let name = seg.ident.to_string();
    if HEAD_ONLY.contains(&name.as_str()) {
        return true;
    }
    if name != "Option" && name != "Result" {
        return false;
    }
    let PathArguments::AngleBracketed(args) = &seg.arguments else {
        return false;
    };
    matches!(args.args.first(), Some(GenericArgument::Type(inner)) if head_only(inner))
}

/// `Option<Json<T>>`, `Result<Form<T>, _>`: a body wrapped so that idem
/// cannot see it.
fn wrapped_body(ty: &Type) -> bool {
    let Some(seg) = last_segment(ty) else { return false };
    if seg.ident != "Option" && seg.ident != "Result" {
        return false;
    }
    let PathArguments::AngleBracketed(args) = &seg.arguments else {
        return false;
    };
    matches!(args.args.first(), Some(GenericArgument::Type(inner)) if body_kind(inner).is_some())
}

/// The handler, taken apart.
pub(crate) struct Handler {
    pub(crate) item: ItemFn,
    /// The index in `item.sig.inputs` of the body parameter, and its kind.
    pub(crate) body: Option<(usize, BodyKind)>,
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
    pub(crate) fn analyze(item: ItemFn, optional: bool, no_body: bool) -> Result<Self, syn::Error> {
        let mut errors = Errors::default();
        if item.sig.asyncness.is_none() {
            errors.push(syn::Error::new(
                item.sig.fn_token.span,
                "`#[idempotent]` handlers must be `async fn`",
            ));
        }
        let mut body = None;
        let mut operation = None;
        for (i, input) in item.sig.inputs.iter().enumerate() {
            match input {
                FnArg::Receiver(r) => errors.push(syn::Error::new(
                    r.self_token.span,
                    "`#[idempotent]` works on free `async fn` handlers, not on methods with `self`",
                )),
                FnArg::Typed(pt) => {
                    let kind = if is_named(&pt.ty, "Operation") {
                        if optional {
                            errors.push(syn::Error::new(
                                pt.ty.span(),
                                "an `optional` handler may run without a key: ask for `Option<Operation>`",
                            ));
                        }
                        Some(OperationParam::Required(pt.clone()))
                    } else if is_option_of_operation(&pt.ty) {
                        Some(OperationParam::Optional(pt.clone()))
                    } else {
                        None
                    };
                    if let Some(kind) = kind {
                        if operation.is_some() {
                            errors.push(syn::Error::new(pt.ty.span(), "`Operation` is asked for twice"));
                        }
                        operation = Some((i, kind));
                    }
                }
            }
        }
        // The body: axum extracts it last, so it is the last parameter
        // (the `Operation` is not extracted and may stand anywhere).
        let extracted: Vec<(usize, &syn::PatType)> = item
            .sig
            .inputs
            .iter()
            .enumerate()
            .filter_map(|(i, input)| match input {
                FnArg::Typed(pt) if operation.as_ref().is_none_or(|(at, _)| *at != i) => Some((i, pt)),
                _ => None,
            })
            .collect();
        for (n, (i, pt)) in extracted.iter().enumerate() {
            let last = n + 1 == extracted.len();
            if wrapped_body(&pt.ty) {
                errors.push(syn::Error::new(
                    pt.ty.span(),
                    "`#[idempotent]` fingerprints the request body, so it must see it: take the body as \
                     `Json<T>`, `Form<T>`, `String` or `Bytes` itself, not wrapped in `Option` or `Result`",
                ));
            } else if let Some(kind) = body_kind(&pt.ty) {
                if !last {
                    errors.push(syn::Error::new(
                        pt.ty.span(),
                        "the request body must be the last parameter: axum extracts the body last, so move it after the others",
                    ));
                } else if no_body {
                    errors.push(syn::Error::new(
                        pt.ty.span(),
                        "this handler reads the request body, yet the attribute says `body = \"none\"`: remove `body = \"none\"`",
                    ));
                } else {
                    body = Some((*i, kind));
                }
            } else if last && !no_body && !head_only(&pt.ty) {
                // An extractor idem does not know by name: read through
                // idem's, whose `FingerprintBody` bound says what to do if it
                // cannot be fingerprinted.
                body = Some((*i, BodyKind::Extracted));
            }
        }
        errors.finish()?;
        Ok(Handler {
            item,
            body,
            operation,
        })
    }
}
