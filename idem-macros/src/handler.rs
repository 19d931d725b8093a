//! Takes apart the handler `#[idempotent]` wraps: checks its shape and finds
//! its body and `Operation` parameters.

use crate::errors::Errors;
use syn::spanned::Spanned;
use syn::{FnArg, GenericArgument, ItemFn, PathArguments, Type};

/// Whether a request must carry the key, chosen once from `optional`, with
/// the `Operation` parameter each choice allows.
pub(crate) enum Keying {
    /// A request without the key is refused, so the runner (`run`) always
    /// hands over an `Operation`.
    Required(Option<RequiredOperation>),
    /// `optional`: a request without the key runs unprotected, so the runner
    /// (`run_optional`) hands over an `Option<Operation>`, and that is all
    /// the handler may ask for.
    Optional(Option<OperationParam>),
}

/// How a handler whose key is required asks for its `Operation`.
pub(crate) enum RequiredOperation {
    /// `op: Operation`
    Bare(OperationParam),
    /// `op: Option<Operation>`: always `Some`.
    InSome(OperationParam),
}

/// The parameter that asks for the `Operation`.
pub(crate) struct OperationParam {
    /// Its index in `item.sig.inputs`.
    pub(crate) at: usize,
    /// The parameter as written: the runtime hands the value over, so its
    /// pattern and type are kept for a binding.
    pub(crate) param: syn::PatType,
}

impl Keying {
    /// The index of the `Operation` parameter, if the handler has one.
    pub(crate) fn operation_at(&self) -> Option<usize> {
        match self {
            Keying::Required(Some(RequiredOperation::Bare(p) | RequiredOperation::InSome(p)))
            | Keying::Optional(Some(p)) => Some(p.at),
            Keying::Required(None) | Keying::Optional(None) => None,
        }
    }
}

/// How a parameter's type asks for the `Operation`.
enum AsksFor {
    /// `Operation`
    Operation,
    /// `Option<Operation>`
    OptionOfOperation,
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

/// The error type of a `Result<T, E>` return type that names one of the
/// handler's type parameters, and that parameter, unless a bound of the
/// handler names `Classify`. Whether an error type implements `Classify`
/// is decided where the handler is compiled, before its parameters are
/// known: without such a bound (on that type) an impl would be ignored, and the outcome
/// recorded by its status code instead.
fn generic_error_type(sig: &syn::Signature) -> Option<(&Type, proc_macro2::Ident, bool)> {
    use quote::ToTokens as _;
    // Const parameters too: `CErr<N>` may implement `Classify` for one `N`.
    let params: Vec<&proc_macro2::Ident> = sig
        .generics
        .type_params()
        .map(|p| &p.ident)
        .chain(sig.generics.const_params().map(|p| &p.ident))
        .collect();
    if params.is_empty() {
        return None;
    }
    let (error, is_error) = match result_error_type(sig) {
        Some(error) => (error, true),
        None => (generic_return_type(sig, &params)?, false),
    };
    let named = first_ident(error.to_token_stream(), &|i| params.contains(&i))?;
    // A bound that names `Classify` on the error type itself: in the
    // `where` clause, or on the type parameter that is the error type.
    let error_text = error.to_token_stream().to_string();
    let classify = |bounds: &syn::punctuated::Punctuated<syn::TypeParamBound, syn::Token![+]>| {
        bounds.iter().any(|b| {
            matches!(b, syn::TypeParamBound::Trait(t)
                if t.path.segments.last().is_some_and(|s| s.ident == "Classify"))
        })
    };
    let in_where = sig
        .generics
        .where_clause
        .iter()
        .flat_map(|w| &w.predicates)
        .any(|p| {
            matches!(p, syn::WherePredicate::Type(t)
            if t.bounded_ty.to_token_stream().to_string() == error_text && classify(&t.bounds))
        });
    let on_param = sig
        .generics
        .type_params()
        .any(|p| p.ident == error_text && classify(&p.bounds));
    if in_where || on_param {
        return None;
    }
    Some((error, named, is_error))
}

/// A type as it is written, for a message: `G::Error`, `Code<N>`.
fn written(ty: &Type) -> String {
    use quote::ToTokens as _;
    let mut text = ty.to_token_stream().to_string();
    for (spaced, tight) in [
        (" :: ", "::"),
        (":: ", "::"),
        (" ::", "::"),
        (" <", "<"),
        ("< ", "<"),
        (" >", ">"),
        (" ,", ","),
    ] {
        text = text.replace(spaced, tight);
    }
    text
}

/// In a handler with type parameters, the `impl Trait` that stands for its
/// error type (`Result<T, impl IntoResponse>`) or its whole return type
/// (`-> impl IntoResponse`), unless a bound of it names `Classify`. The
/// value is classified with its own type, but in a generic handler that
/// type may be a parameter (`E`, `R`), whose `Classify` impl is decided
/// before it is known: it would be ignored.
fn generic_opaque_type(sig: &syn::Signature) -> Option<&Type> {
    if !is_generic(sig) {
        return None;
    }
    let classified = match result_error_type(sig) {
        Some(error) => error,
        None => match &sig.output {
            syn::ReturnType::Type(_, ty) => ty,
            syn::ReturnType::Default => return None,
        },
    };
    let mut inner = classified;
    while let Type::Paren(syn::TypeParen { elem, .. }) | Type::Group(syn::TypeGroup { elem, .. }) = inner {
        inner = elem;
    }
    let Type::ImplTrait(opaque) = inner else {
        return None;
    };
    let names_classify = opaque.bounds.iter().any(|b| {
        matches!(b, syn::TypeParamBound::Trait(t)
            if t.path.segments.last().is_some_and(|s| s.ident == "Classify"))
    });
    (!names_classify).then_some(classified)
}

/// Whether the handler has type or const parameters, declared or made by
/// an `impl Trait` among its parameters' types (`State<impl Gateway>`, or
/// a macro there, which may write one).
fn is_generic(sig: &syn::Signature) -> bool {
    let mut argument_impl = false;
    for input in &sig.inputs {
        if let syn::FnArg::Typed(pt) = input {
            let mut ty = (*pt.ty).clone();
            crate::expand::visit_types(&mut ty, &mut |t| {
                // A macro there may write one.
                argument_impl |= matches!(t, Type::ImplTrait(_) | Type::Macro(_));
                !argument_impl
            });
        }
    }
    argument_impl
        || sig.generics.type_params().next().is_some()
        || sig.generics.const_params().next().is_some()
}

/// The first macro in the return type (`answer!(E)`): what it stands for
/// cannot be seen where the attribute reads the handler.
fn macro_in_return_type(sig: &syn::Signature) -> Option<Type> {
    let syn::ReturnType::Type(_, ty) = &sig.output else {
        return None;
    };
    let mut found = None;
    let mut ty = (**ty).clone();
    crate::expand::visit_types(&mut ty, &mut |t| {
        if found.is_none() && matches!(t, Type::Macro(_)) {
            found = Some(t.clone());
        }
        found.is_none()
    });
    found
}

/// A whole return type (no `Result`) that is one of the handler's type
/// parameters, or a type reached from one (`R`, `G::Answer`, `<G as
/// Gateway>::Answer`): its `Classify` impl would be ignored the same way.
/// A type that only has one among its arguments (`Json<T>`) is let
/// through: it cannot implement `Classify` for some `T` and not others
/// unless its own crate says so.
fn generic_return_type<'a>(sig: &'a syn::Signature, params: &[&proc_macro2::Ident]) -> Option<&'a Type> {
    let syn::ReturnType::Type(_, ty) = &sig.output else {
        return None;
    };
    let mut inner: &Type = ty;
    while let Type::Paren(syn::TypeParen { elem, .. }) | Type::Group(syn::TypeGroup { elem, .. }) = inner {
        inner = elem;
    }
    let Type::Path(path) = inner else { return None };
    let leading = match &path.qself {
        Some(qself) => match &*qself.ty {
            Type::Path(q) => q.path.segments.first()?,
            _ => return None,
        },
        None => path.path.segments.first()?,
    };
    params.contains(&&leading.ident).then_some(&**ty)
}

/// The error type `E` of a return type written `Result<T, E>` (any path
/// ending in `Result`).
fn result_error_type(sig: &syn::Signature) -> Option<&Type> {
    let syn::ReturnType::Type(_, ty) = &sig.output else {
        return None;
    };
    let seg = last_segment(ty)?;
    if seg.ident != "Result" {
        return None;
    }
    let PathArguments::AngleBracketed(args) = &seg.arguments else {
        return None;
    };
    match args.args.iter().nth(1) {
        Some(GenericArgument::Type(error)) => Some(error),
        _ => None,
    }
}

/// The first identifier in `tokens` (groups included) that `wanted` accepts.
fn first_ident(
    tokens: proc_macro2::TokenStream,
    wanted: &dyn Fn(&proc_macro2::Ident) -> bool,
) -> Option<proc_macro2::Ident> {
    tokens.into_iter().find_map(|tree| match tree {
        proc_macro2::TokenTree::Ident(i) if wanted(&i) => Some(i),
        proc_macro2::TokenTree::Group(g) => first_ident(g.stream(), wanted),
        _ => None,
    })
}

/// The handler, taken apart.
pub(crate) struct Handler {
    pub(crate) item: ItemFn,
    /// The index in `item.sig.inputs` of the body parameter, and its kind.
    pub(crate) body: Option<(usize, BodyKind)>,

    /// Whether the key is required, and the `Operation` parameter.
    pub(crate) keying: Keying,
}

fn last_segment(ty: &Type) -> Option<&syn::PathSegment> {
    match ty {
        Type::Path(p) if p.qself.is_none() => p.path.segments.last(),
        Type::Paren(p) => last_segment(&p.elem),
        Type::Group(g) => last_segment(&g.elem),
        _ => None,
    }
}

/// Whether `path` is the one-segment name `name`, raw (`r#cfg`) or not:
/// rustc reads both as the same attribute.
pub(crate) fn is_attr(path: &syn::Path, name: &str) -> bool {
    use syn::ext::IdentExt as _;
    path.get_ident().is_some_and(|ident| ident.unraw() == name)
}

/// `#[cfg(..)]`, or a `#[cfg_attr(..)]` that may give one: what may
/// remove the parameter it stands on.
fn removes_under_cfg(attr: &syn::Attribute) -> bool {
    match &attr.meta {
        syn::Meta::List(list) if is_attr(&list.path, "cfg_attr") => cfg_attr_gives_cfg(list),
        meta => is_attr(meta.path(), "cfg"),
    }
}

/// `cfg_attr(predicate, attr, ..)`: whether one of the attributes is a
/// `cfg`, or a `cfg_attr` that gives one. The predicate is skipped as
/// tokens (`true` is one, and no `Meta`); an attribute that does not
/// parse is rustc's to report.
fn cfg_attr_gives_cfg(list: &syn::MetaList) -> bool {
    let (mut parts, mut part) = (Vec::new(), proc_macro2::TokenStream::new());
    for tree in list.tokens.clone() {
        match &tree {
            proc_macro2::TokenTree::Punct(p) if p.as_char() == ',' => parts.push(std::mem::take(&mut part)),
            _ => part.extend([tree]),
        }
    }
    parts.push(part);
    parts
        .into_iter()
        .skip(1)
        .any(|part| match syn::parse2::<syn::Meta>(part) {
            Ok(syn::Meta::List(inner)) if is_attr(&inner.path, "cfg_attr") => cfg_attr_gives_cfg(&inner),
            Ok(meta) => is_attr(meta.path(), "cfg"),
            Err(_) => false,
        })
}

fn is_named(ty: &Type, name: &str) -> bool {
    last_segment(ty).is_some_and(|s| s.ident == name)
}

/// `Operation` or `Option<Operation>`, the parameters the runtime fills.
fn asks_for(ty: &Type) -> Option<AsksFor> {
    let seg = last_segment(ty)?;
    if seg.ident == "Operation" {
        return Some(AsksFor::Operation);
    }
    let PathArguments::AngleBracketed(args) = &seg.arguments else {
        return None;
    };
    match args.args.first() {
        Some(GenericArgument::Type(inner)) if seg.ident == "Option" && is_named(inner, "Operation") => {
            Some(AsksFor::OptionOfOperation)
        }
        _ => None,
    }
}

/// What is wrong with an `#[instrument]` or `#[tracing::instrument]` (any
/// path ending so) below the attribute, if anything: its arguments lack
/// `skip_all`, or include `err`.
fn unfit_instrument(attr: &syn::Attribute) -> Option<&'static str> {
    if !is_instrument(attr) {
        return None;
    }
    let idents = |name: &str| match &attr.meta {
        syn::Meta::List(list) => list
            .tokens
            .clone()
            .into_iter()
            .any(|t| matches!(t, proc_macro2::TokenTree::Ident(i) if i == name)),
        _ => false,
    };
    if matches!(attr.meta, syn::Meta::NameValue(_)) {
        None
    } else if !idents("skip_all") {
        Some(
            "`#[instrument]` below `#[idempotent]` instruments the function the attribute \
             generates, whose parameters are idem's own: put it above `#[idempotent]`, where it \
             sees your parameters, or add `skip_all`",
        )
    } else if idents("err") {
        Some(
            "`err` in `#[instrument]` below `#[idempotent]` reads what the function the attribute \
             generates returns, an HTTP response, not your `Result`: put `#[instrument]` above \
             `#[idempotent]`, or log the error in the handler",
        )
    } else {
        None
    }
}

/// Whether `attr` is `#[instrument]` or `#[tracing::instrument]` (any path
/// ending so).
fn is_instrument(attr: &syn::Attribute) -> bool {
    let path = attr.path();
    path.segments.last().is_some_and(|s| s.ident == "instrument")
        && (path.segments.len() == 1
            || path
                .segments
                .iter()
                .rev()
                .nth(1)
                .is_some_and(|s| s.ident == "tracing"))
}

/// The most extractors axum's `Handler` is implemented for.
const AXUM_EXTRACTORS_MAX: usize = 16;

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
        // axum calls a handler as a plain, safe Rust function, which a
        // `const`, `unsafe` or `extern "C"` one is not (and `const` cannot be
        // `async`): said at the qualifier, not at the attribute or the route.
        if let Some(token) = &item.sig.constness {
            errors.push(syn::Error::new(
                token.span,
                "`#[idempotent]` handlers cannot be `const`: remove `const`",
            ));
        }
        if let Some(token) = &item.sig.unsafety {
            errors.push(syn::Error::new(
                token.span,
                "`#[idempotent]` handlers cannot be `unsafe fn`: axum calls a handler as a safe function; \
                 remove `unsafe` and put the unsafe code in an `unsafe` block inside",
            ));
        }
        // `extern "Rust"` is the Rust ABI written out: axum takes it.
        if let Some(abi) = item
            .sig
            .abi
            .as_ref()
            .filter(|abi| abi.name.as_ref().is_none_or(|n| n.value() != "Rust"))
        {
            errors.push(syn::Error::new_spanned(
                abi,
                "`#[idempotent]` handlers cannot be `extern`: axum calls a handler as a Rust function; \
                 remove the ABI",
            ));
        }
        // The attribute given twice: the outer one sees the inner one among
        // the handler's attributes, not yet expanded.
        for attr in &item.attrs {
            if attr
                .path()
                .segments
                .last()
                .is_some_and(|s| s.ident == "idempotent")
            {
                errors.push(syn::Error::new_spanned(
                    attr,
                    "`#[idempotent]` is given twice: a handler is one operation, with one scope; keep one",
                ));
            }
            // `#[tracing::instrument]` below the attribute instruments the
            // function it generates, whose parameters are idem's own (not
            // `Debug`) and whose answer is a `Response`: only `skip_all`
            // (without `err`) fits there.
            if let Some(message) = unfit_instrument(attr) {
                errors.push(syn::Error::new_spanned(attr, message));
            }
        }
        let mut body = None;
        let mut keying = if optional {
            Keying::Optional(None)
        } else {
            Keying::Required(None)
        };
        // The last parameter that asks for the `Operation`, even one the
        // keying refuses: the runtime hands it over, so axum must not
        // extract it.
        let mut operation_at = None;
        for (i, input) in item.sig.inputs.iter().enumerate() {
            let pt = match input {
                FnArg::Receiver(r) => {
                    errors.push(syn::Error::new(
                        r.self_token.span,
                        "`#[idempotent]` works on free `async fn` handlers, not on methods with `self`",
                    ));
                    continue;
                }
                FnArg::Typed(pt) => pt,
            };
            if let Type::Reference(r) = &*pt.ty {
                if asks_for(&r.elem).is_some() {
                    errors.push(syn::Error::new(
                        pt.ty.span(),
                        "the handler owns its `Operation`: take it by value (`op: Operation`, or \
                         `Option<Operation>`), not by reference",
                    ));
                    continue;
                }
            }
            let Some(asks) = asks_for(&pt.ty) else { continue };
            let param = OperationParam {
                at: i,
                param: pt.clone(),
            };
            match (&mut keying, asks) {
                (Keying::Required(slot), AsksFor::Operation) => *slot = Some(RequiredOperation::Bare(param)),
                (Keying::Required(slot), AsksFor::OptionOfOperation) => {
                    *slot = Some(RequiredOperation::InSome(param));
                }
                (Keying::Optional(slot), AsksFor::OptionOfOperation) => *slot = Some(param),
                (Keying::Optional(_), AsksFor::Operation) => errors.push(syn::Error::new(
                    pt.ty.span(),
                    "an `optional` handler may run without a key: ask for `Option<Operation>`",
                )),
            }
            if operation_at.is_some() {
                errors.push(syn::Error::new(pt.ty.span(), "`Operation` is asked for twice"));
            }
            operation_at = Some(i);
        }
        // The body: axum extracts it last, so it is the last parameter
        // (the `Operation` is not extracted and may stand anywhere).
        let extracted: Vec<(usize, &syn::PatType)> = item
            .sig
            .inputs
            .iter()
            .enumerate()
            .filter_map(|(i, input)| match input {
                FnArg::Typed(pt) if operation_at != Some(i) => Some((i, pt)),
                _ => None,
            })
            .collect();
        // The body under `#[cfg]` (or a parameter that `cfg` may make the
        // last, or not): which parameter is the body, which this reads
        // before `cfg` is evaluated, is then not known. The others may
        // come and go under `cfg`.
        let mut body_under_cfg = false;
        for (n, (_, pt)) in extracted.iter().enumerate() {
            let last = n + 1 == extracted.len();
            if !(last && !no_body || body_kind(&pt.ty).is_some() || wrapped_body(&pt.ty)) {
                continue;
            }
            for attr in pt.attrs.iter().filter(|a| removes_under_cfg(a)) {
                body_under_cfg = true;
                errors.push(syn::Error::new_spanned(
                    attr,
                    "`#[idempotent]` reads the handler's parameters before `#[cfg]` is evaluated, and \
                     this one decides which parameter is the request body, which it fingerprints: put \
                     `#[cfg]` on whole handlers, one per configuration (the parameters before the body \
                     may have it)",
                ));
            }
        }
        for (n, (i, pt)) in extracted.iter().enumerate() {
            if body_under_cfg {
                break;
            }
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
        // axum implements `Handler` for at most 16 extractors, and idem
        // adds its context first and, without a body, an extractor that
        // reads nothing last: past that, axum's error would name a function
        // the user never wrote. Parameters under `cfg` may go: not counted.
        let injected = if body.is_some() || body_under_cfg { 1 } else { 2 };
        let counted: Vec<&syn::PatType> = extracted
            .iter()
            .map(|(_, pt)| *pt)
            .filter(|pt| !pt.attrs.iter().any(removes_under_cfg))
            .collect();
        if let Some(first_too_many) = counted.get(AXUM_EXTRACTORS_MAX - injected) {
            errors.push(syn::Error::new(
                first_too_many.span(),
                format!(
                    "an `#[idempotent]` handler takes at most {} extractors here: axum takes {AXUM_EXTRACTORS_MAX}, \
                     and idem adds its own context{}; group some into one extractor of your own (a struct \
                     that implements `FromRequestParts`)",
                    AXUM_EXTRACTORS_MAX - injected,
                    if injected == 2 {
                        " and, as it fingerprints no body, an extractor that reads nothing"
                    } else {
                        ""
                    }
                ),
            ));
        }
        if let Some((ty, param, is_error)) = generic_error_type(&item.sig) {
            let why = format!(
                "whether it implements `idem::Classify` is decided where the handler is compiled, before \
                 `{param}` is known, so an impl would be ignored"
            );
            errors.push(if is_error {
                syn::Error::new(
                    ty.span(),
                    format!(
                        "this error type names the generic parameter `{param}`: {why}; say so in a bound on \
                         this type (`where {}: idem::Classify`), or return a concrete error type",
                        written(ty)
                    ),
                )
            } else {
                let bound = match ty {
                    Type::Path(p) if p.qself.is_none() && p.path.is_ident(&param) => {
                        format!("`where {param}: idem::Classify`")
                    }
                    _ => "a `where` clause on this very type".to_owned(),
                };
                syn::Error::new_spanned(
                    ty,
                    format!(
                        "this return type comes from the generic parameter `{param}`: {why}; say so in a \
                         bound on this type ({bound}), or return a concrete type"
                    ),
                )
            });
        }
        if let Some(written_by_macro) = macro_in_return_type(&item.sig) {
            errors.push(syn::Error::new_spanned(
                written_by_macro,
                "idem reads the return type to classify the answer (its `Result`, its error type, an \
                 `impl Trait`), and cannot see what a macro here stands for: write the type out, or name \
                 it with a type alias",
            ));
        }
        if let Some(opaque) = generic_opaque_type(&item.sig) {
            errors.push(syn::Error::new_spanned(
                opaque,
                "in a handler with type parameters (declared, or an `impl Trait` among its parameters' \
                 types, or a macro there), this `impl Trait` may stand for one of them, whose `idem::Classify` impl is decided where the handler is compiled, before it is known, so it \
                 would be ignored: add `+ idem::Classify` to its bounds, or return a concrete type",
            ));
        }
        errors.finish()?;
        Ok(Handler { item, body, keying })
    }
}
