//! Expands `#[idempotent(...)]`: the handler rewritten around one runtime
//! call, or the handler as written with every error found.

use crate::args::{DurationLit, FieldPath, IdempotentArgs};
use crate::handler::{BodyKind, Handler, Keying, RequiredOperation};
use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned, ToTokens as _};
use syn::ext::IdentExt as _;
use syn::spanned::Spanned;
use syn::{FnArg, Generics, Ident, LitStr, ReturnType, Type};

// Input:  the item as written and the errors found.
// Output: the same item followed by one `::core::compile_error! { ".." }`
//         per error: the handler still exists, so the only errors shown
//         are ours.
fn with_error(item: TokenStream, err: syn::Error) -> TokenStream {
    let mut out = item;
    out.extend(err.into_compile_error());
    out
}

// Input:  `scope = "payment.create", fields(amount)` and
//         `async fn create(State(s): State<App>, Json(p): Json<In>) -> R { .. }`
// Output: the generated handler (see `generate`), or the handler as written
//         plus every error found.
pub(crate) fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    let mut args: IdempotentArgs = match syn::parse2(args) {
        Ok(args) => args,
        Err(e) => return with_error(item, e),
    };
    let func: syn::ItemFn = match syn::parse2(item.clone()) {
        Ok(f) => f,
        Err(e) => {
            let e = not_a_function(&item).unwrap_or(e);
            return with_error(item, e);
        }
    };
    let mut errors = std::mem::take(&mut args.errors);
    let handler = errors.ok(Handler::analyze(
        func,
        args.optional.is_some(),
        args.no_body.is_some(),
    ));
    if let (Some((fields_kw, _)), Some(h)) = (&args.fields, &handler) {
        if !matches!(h.body, Some((_, BodyKind::Extracted))) {
            errors.push(syn::Error::new(
                fields_kw.span,
                "`fields(...)` names fields of a JSON request body, but this handler does not read its body as `Json<T>`",
            ));
        }
    }
    match (errors.finish(), handler) {
        (Ok(()), Some(handler)) => generate(&args, &handler),
        (Err(e), _) => with_error(item, e),
        // `analyze` fails only with an error, so this arm is never taken.
        (Ok(()), None) => item,
    }
}

// Input:  an item that is not a function, such as `struct S;`
// Output: the error that says where the attribute goes, at the item's
//         keyword (at its first token for a kind without one); `None` for
//         a function, or anything syn reads only as tokens, such as a
//         function without a body (syn's own error says more).
fn not_a_function(item: &TokenStream) -> Option<syn::Error> {
    use syn::Item;
    let parsed = syn::parse2::<Item>(item.clone()).ok()?;
    let at = match &parsed {
        Item::Fn(_) | Item::Verbatim(_) => return None,
        Item::Struct(i) => i.struct_token.span,
        Item::Enum(i) => i.enum_token.span,
        Item::Union(i) => i.union_token.span,
        Item::Const(i) => i.const_token.span,
        Item::Static(i) => i.static_token.span,
        Item::Type(i) => i.type_token.span,
        Item::Trait(i) => i.trait_token.span,
        Item::TraitAlias(i) => i.trait_token.span,
        Item::Impl(i) => i.impl_token.span,
        Item::Mod(i) => i.mod_token.span,
        Item::Use(i) => i.use_token.span,
        Item::ExternCrate(i) => i.extern_token.span,
        Item::ForeignMod(i) => i.abi.extern_token.span,
        Item::Macro(i) => i.mac.path.span(),
        other => other.to_token_stream().into_iter().next()?.span(),
    };
    Some(syn::Error::new(
        at,
        "`#[idempotent]` goes on an `async fn` handler",
    ))
}

fn mixed(name: &str) -> Ident {
    Ident::new(name, Span::mixed_site())
}

/// The path every emitted item goes through, and the names of the
/// generated bindings: `__idem_*` at the mixed site, so that the handler's
/// own code can neither name nor shadow them.
struct Names {
    /// `::idem::__private`, or `<crate>::__private` with `crate = ".."`.
    private: TokenStream,
    /// `private` at the attribute's own span, for the glob imports that
    /// bring idem's probe traits into scope: a path given as a string
    /// carries the string's span, and in a handler a `macro_rules!` writes,
    /// rustc then counted the import unused (an error under
    /// `deny(warnings)`), though the calls beside it use it.
    private_here: TokenStream,
    ctx: Ident,
    body: Ident,
    op: Ident,
    spec: Ident,
    read: Ident,
    fp: Ident,
    out: Ident,
    ret: Ident,
    class: Ident,
}

impl Names {
    // Input:  `crate = "my::idem"`, or no `crate`.
    // Output: `my::idem::__private` (`::idem::__private`), and `__idem_ctx`,
    //         `__idem_body`, .. for the bindings.
    fn new(args: &IdempotentArgs) -> Self {
        // With `crate = ".."`, `__private` carries the string's span: a
        // path that is not idem's is refused at the string.
        let private = match &args.krate {
            Some((_, path)) => {
                let span = syn::spanned::Spanned::span(path);
                quote::quote_spanned!(span=> #path::__private)
            }
            None => quote!(::idem::__private),
        };
        Names {
            private_here: respanned(&private, Span::call_site()),
            private,
            ctx: mixed("__idem_ctx"),
            body: mixed("__idem_body"),
            op: mixed("__idem_op"),
            spec: mixed("__idem_spec"),
            read: mixed("__idem_read"),
            fp: mixed("__idem_fp"),
            out: mixed("__idem_out"),
            ret: mixed("__idem_ret"),
            class: mixed("__idem_class"),
        }
    }
}

// Input:  the body extractor's type, `Json<In>` (or `Form<In>`, or the
//         application's own).
// Output: `::idem::__private::Raw<Json<In>>`, the extractor under idem's,
//         which keeps the bytes: its own tokens at the type's location
//         (where diagnostics point) but the macro's (mixed-site), so that
//         lints judge the handler's type as written (clippy's
//         `type_complexity` counted the wrapper's nesting as the user's).
fn raw_extractor(private: &TokenStream, ty: &Type) -> TokenStream {
    let span = Span::mixed_site().located_at(ty.span());
    let private = respanned(private, span);
    quote_spanned!(span=> #private::Raw<#ty>)
}

// Input:  a path such as `::idem::__private`, and a span of the handler's.
// Output: the same path at that span, so that a diagnostic that points at
//         the type it begins (axum's `debug_handler` points at a type's
//         first token) lands on the handler's own code, not the attribute.
fn respanned(path: &TokenStream, span: Span) -> TokenStream {
    path.clone()
        .into_iter()
        .map(|mut token| {
            token.set_span(span);
            token
        })
        .collect()
}

/// The body parameter once it is read through idem's extractor.
struct BodyParam {
    /// Recreates the handler's pattern inside the handler future.
    binding: TokenStream,
    /// What the fingerprint reads of the body.
    print: TokenStream,
    /// The type as declared.
    ty: Type,
}

// Input:  `State(s): State<App>, op: Operation, Json(p): Json<In>`
// Output: the parameters axum extracts, the context first and the body
//         through idem's extractor (the runtime hands over the `Operation`):
//             __idem_ctx: ::idem::__private::Context, State(s): State<App>,
//             __idem_body: ::idem::__private::Raw<Json<In>>
//         (`Tail<String>` for a body read whole, which keeps only the
//         tenant; `NoBody` last when there is no body)
//         and, for the body, its binding `let Json(p) = __idem_body.value;`,
//         its print `::idem::__private::print_body::<Json<In>>(&__idem_body)`
//         and its type `Json<In>`.
fn parameters(names: &Names, handler: &Handler) -> (Vec<TokenStream>, Option<BodyParam>) {
    let Names {
        private,
        ctx,
        body: body_ident,
        ..
    } = names;
    let mut params: Vec<TokenStream> = vec![quote!(#ctx: #private::Context)];
    let mut body = None;
    for (i, input) in handler.item.sig.inputs.iter().enumerate() {
        let FnArg::Typed(pt) = input else { continue };
        if handler.keying.operation_at() == Some(i) {
            continue;
        }
        match handler.body {
            Some((at, kind)) if at == i => {
                let (pat, ty, attrs) = (&pt.pat, &pt.ty, &pt.attrs);
                let (param_ty, value, print) = match kind {
                    BodyKind::Extracted => (
                        raw_extractor(private, ty),
                        quote!(#body_ident.value),
                        quote_spanned!(ty.span()=> #private::print_body::<#ty>(&#body_ident)),
                    ),
                    BodyKind::Raw => (
                        {
                            let private = respanned(private, ty.span());
                            quote_spanned!(ty.span()=> #private::Tail<#ty>)
                        },
                        quote!(#body_ident.value),
                        quote!(#private::raw(&#body_ident.value)),
                    ),
                };
                // Its `cfg`s on the parameter as well; its lints only on
                // the binding, where they can fire (an `expect` on both
                // would go unfulfilled on one).
                let cfgs = attrs.iter().filter(|a| {
                    crate::handler::is_attr(a.path(), "cfg") || crate::handler::is_attr(a.path(), "cfg_attr")
                });
                params.push(quote!(#(#cfgs)* mut #body_ident: #param_ty));
                body = Some(BodyParam {
                    // The parameter's attributes (lints such as
                    // `#[allow(unused_mut)]`) hold for its binding too.
                    binding: quote!(#(#attrs)* let #pat = #value;),
                    print,
                    ty: (**ty).clone(),
                });
            }
            _ => params.push(quote!(#input)),
        }
    }
    (params, body)
}

// Input:  the keying and its `Operation` parameter, such as
//         `op: Option<Operation>` with a required key.
// Output: the binding that gives the parameter the runtime's value, with
//         the user's pattern and type:
//             let op: Option<Operation> = ::core::option::Option::Some(__idem_op);
//         or `let _ = __idem_op;` when the handler asks for none.
fn operation_binding(names: &Names, keying: &Keying) -> TokenStream {
    let (op, private) = (&names.op, &names.private);
    let (param, value) = match keying {
        Keying::Required(Some(RequiredOperation::Bare(p))) | Keying::Optional(Some(p)) => (p, quote!(#op)),
        Keying::Required(Some(RequiredOperation::InSome(p))) => {
            (p, quote!(::core::option::Option::Some(#op)))
        }
        Keying::Required(None) | Keying::Optional(None) => return quote!(let _ = #op;),
    };
    let (pat, ty, attrs) = (&param.param.pat, &param.param.ty, &param.param.attrs);
    // Known by its type's name: another type named `Operation` is an error
    // at that type, which says so.
    let check = quote_spanned!(ty.span()=> #private::operation_param::<#ty>(););
    quote!(#check #(#attrs)* let #pat: #ty = #value;)
}

// Input:  the arguments and the keying.
// Output: the handler's settings, in a block of its own so that no item of
//         the user's can meet it:
//             let __idem_spec: &'static ::idem::__private::Spec = {
//                 static SPEC: ::idem::__private::Spec = ::idem::__private::Spec {
//                     scope: "payment.create", header: "idempotency-key", optional: false,
//                     ttl: ::core::option::Option::None, ..,
//                     fields: ::core::option::Option::Some(&["amount"]), ignore: &[],
//                     handler: "create_payment", at: concat!(file!(), ":", line!()),
//                     scope_noted: ScopeNoted::new(),
//                 };
//                 &SPEC
//             };
fn spec_block(names: &Names, args: &IdempotentArgs, keying: &Keying, name: &syn::Ident) -> TokenStream {
    let Names { private, spec, .. } = names;
    let handler = name.unraw().to_string();
    let scope = args
        .scope
        .as_ref()
        .map(|(_, lit)| lit.value())
        .unwrap_or_default();
    let header = args
        .header
        .as_ref()
        .map(|(_, lit)| lit.value().to_ascii_lowercase())
        .unwrap_or_else(|| "idempotency-key".to_owned());
    let optional = matches!(keying, Keying::Optional(_));
    let millis = |d: Option<&DurationLit>| match d {
        Some(d) => {
            let ms = d.millis;
            quote!(::core::option::Option::Some(#private::Duration::from_millis(#ms)))
        }
        None => quote!(::core::option::Option::None),
    };
    let ttl = millis(args.ttl.as_ref().map(|(_, d)| d));
    let lock_timeout = millis(args.lock_timeout.as_ref().map(|(_, d)| d));
    let wait = millis(args.wait.as_ref().map(|(_, d)| d));
    let fields = match &args.fields {
        Some((_, list)) => {
            let wires = list.iter().map(FieldPath::wire);
            quote!(::core::option::Option::Some(&[#(#wires),*]))
        }
        None => quote!(::core::option::Option::None),
    };
    let ignore: Vec<String> = args
        .ignore
        .as_ref()
        .map(|(_, list)| list.iter().map(LitStr::value).collect())
        .unwrap_or_default();
    quote! {
        let #spec: &'static #private::Spec = {
            static SPEC: #private::Spec = #private::Spec {
                scope: #scope,
                header: #header,
                optional: #optional,
                ttl: #ttl,
                lock_timeout: #lock_timeout,
                wait: #wait,
                fields: #fields,
                ignore: &[#(#ignore),*],
                handler: #handler,
                at: ::core::concat!(::core::file!(), ":", ::core::line!()),
                scope_noted: #private::ScopeNoted::new(),
            };
            &SPEC
        };
    }
}

// Input:  `fields(...)` and the body type, such as `Form<In>`.
// Output: a check, spanned at `fields`, that the body reads JSON, whose
//         members the fields name:
//             const _: () = ::core::assert!(::idem::__private::is_json::<Form<In>>(), "..");
//         In a generic handler, or where the body type has generic
//         arguments of its own (which may be an `impl` block's parameters,
//         unseen here), an inline `const { .. };`: an item is checked at
//         once but cannot name generic parameters from outside it, an
//         inline const is checked when the handler is instantiated.
//         Nothing without `fields(...)`.
fn json_check(
    names: &Names,
    args: &IdempotentArgs,
    body: Option<&BodyParam>,
    generics: &Generics,
) -> TokenStream {
    let private = &names.private;
    // `Self` (a handler in an `impl` block) cannot be named by an item
    // either.
    let names_self = body.is_some_and(|b| {
        fn has_self(tokens: TokenStream) -> bool {
            tokens.into_iter().any(|t| match t {
                proc_macro2::TokenTree::Ident(i) => i == "Self",
                proc_macro2::TokenTree::Group(g) => has_self(g.stream()),
                _ => false,
            })
        }
        has_self(b.ty.to_token_stream())
    });
    // Nor can it name an `impl` block's parameters, which the attribute
    // does not see: a body type with generic arguments of its own
    // (`Json<Envelope<T>>`) may name them, and is checked inline.
    let nested_arguments = body.is_some_and(|b| {
        fn angles(tokens: TokenStream) -> usize {
            tokens
                .into_iter()
                .map(|t| match t {
                    proc_macro2::TokenTree::Punct(p) if p.as_char() == '<' => 1,
                    proc_macro2::TokenTree::Group(g) => angles(g.stream()),
                    _ => 0,
                })
                .sum()
        }
        angles(b.ty.to_token_stream()) > 1
    });
    match (&args.fields, body) {
        (Some((kw, _)), Some(BodyParam { ty, .. }))
            if generics.params.is_empty() && !names_self && !nested_arguments =>
        {
            quote_spanned!(kw.span=>
                const _: () = ::core::assert!(
                    #private::is_json::<#ty>(),
                    "`fields(...)` names members of a JSON body, but this body extractor does not read JSON"
                );
            )
        }
        (Some((kw, _)), Some(BodyParam { ty, .. })) => quote_spanned!(kw.span=>
            const {
                ::core::assert!(
                    #private::is_json::<#ty>(),
                    "`fields(...)` names members of a JSON body, but this body extractor does not read JSON"
                )
            };
        ),
        _ => quote!(),
    }
}

// Input:  `fields(amount, recipient.account)`.
// Output: what the body holds at each field, for the fingerprint, which
//         counts a field by its wire path only where the JSON there is that
//         value:
//             let __idem_read: [::idem::__private::FieldJson; 2] = {
//                 use ::idem::__private::reading::*;
//                 [(&&&::idem::__private::FieldProbe(&__idem_body.value.0.amount)).__idem_json(), ..]
//             };
//         and, for the fingerprint, all of them: `&__idem_read`.
//         Each access is spanned at the field's name in the attribute, so
//         that rustc reports a field the body type lacks there.
fn field_reads(names: &Names, args: &IdempotentArgs) -> (TokenStream, TokenStream) {
    let Names {
        private,
        private_here,
        read,
        ..
    } = names;
    let reads = args.fields.iter().flat_map(|(_, list)| list).map(|field| {
        let segments = field.segments.iter();
        let body = Ident::new("__idem_body", Span::mixed_site().located_at(field.span()));
        quote_spanned!(field.span()=>
            (&&&#private::FieldProbe(&#body.value.0 #(.#segments)*)).__idem_json()
        )
    });
    let count = args.fields.iter().flat_map(|(_, list)| list).count();
    let reading = quote! {
        let #read: [#private::FieldJson; #count] = {
            use #private_here::reading::*;
            [#(#reads),*]
        };
    };
    (reading, quote!(&#read))
}

// Input:  `-> Result<impl IntoResponse, E>` and the handler's block `{ .. }`.
// Output: the block as a future whose value is typed as declared, so that
//         `?` and an early `return` infer, with its classification:
//             async move {
//                 let __idem_ret = __private::returning::<Result<_, E>, _>(async move { .. }).await;
//                 let __idem_class = {
//                     use ::idem::__private::classifying::*;
//                     (&&&::idem::__private::Probe(&__idem_ret)).__idem_classify()
//                 };
//                 ({
//                     fn __idem_check<__IdemPart0, __IdemImpl0: IntoResponse>(
//                         value: Result<__IdemImpl0, __IdemPart0>,
//                     ) -> Result<impl IntoResponse, __IdemPart0> { value }
//                     __idem_check::<E, _>(__idem_ret)
//                 }, __idem_class)
//             }
//         The checking fn, an item, cannot name the handler's parameters,
//         the `impl` block's or `Self`: each part of the declared type
//         without an `impl Trait` is its parameter, named by the call.
//         The value is classified before the check, with its own type:
//         behind the declared `impl Trait` a `Classify` impl is hidden.
//         The block is an async block of its own, so that a `return` in it
//         ends that block, with the value's own type, as it ends the
//         handler without the attribute: ending the outer block, it would
//         have to be the checking fn's opaque type. Each `impl Trait` is
//         left to inference there and is a
//         generic parameter of the checking fn, whose return type is the
//         declared one, so that its bounds hold (and the names they use
//         count as used). Without an `impl Trait` it is
//         `__private::returning::<R, _>(async move { .. })`: the block is
//         the async block's own body, so a body that never returns leaves no
//         generated code unreachable (no warning on a `todo!()` stub).
fn pinned_block(names: &Names, output: &ReturnType, generics: &syn::Generics, block: &syn::Block) -> Pinned {
    let private_here = &names.private_here;
    let ret_ident = &names.ret;
    let private = &names.private;
    let class = &names.class;
    let (ret, check) = match output {
        // The block is the async block's own body, with nothing after it:
        // a body that never returns (`todo!()`) leaves no code unreachable.
        ReturnType::Default => return Pinned::Value(quote!(#private::returning::<(), _>(async move #block))),
        ReturnType::Type(_, ty) => {
            let (inferred, _, params, _) = split_return_type(ty);
            if params.is_empty() {
                return Pinned::Value(quote!(#private::returning::<#ty, _>(async move #block)));
            } else {
                // A fn item cannot name the handler's parameters, the
                // `impl` block's, nor `Self`: each part of the declared
                // type without an `impl Trait` in it (in the bounds too)
                // is a parameter of its own, and the call, inside the
                // handler, names it as declared.
                let mut abstracted = (**ty).clone();
                let mut parts = Vec::new();
                abstract_named_parts(&mut abstracted, &mut parts);
                let (_, generic, params, declared) = split_return_type(&abstracted);
                let (impl_params, bounds): (Vec<_>, Vec<_>) = params.into_iter().unzip();
                let placeholders = impl_params.iter().map(|_| quote_spanned!(ty.span()=> _));
                let (part_params, part_types): (Vec<_>, Vec<_>) = parts.into_iter().unzip();
                // Lifetimes as the fn's own, left to inference: the
                // handler's, with their bounds (`'b: 'a`), and those of the
                // `impl` block that the declared type or those bounds name
                // (`impl IntoResponse + 'a`), whose bounds it cannot see.
                let own: Vec<&syn::LifetimeParam> = generics.lifetimes().collect();
                let mut outer: Vec<syn::Lifetime> = Vec::new();
                let named = own
                    .iter()
                    .flat_map(|l| l.bounds.iter().cloned())
                    .filter(|l| l.ident != "static")
                    .chain(lifetimes_in(declared.to_token_stream()));
                for named in named {
                    let same = |l: &syn::Lifetime| l.ident.unraw() == named.ident.unraw();
                    if !own.iter().any(|o| same(&o.lifetime)) && !outer.iter().any(same) {
                        outer.push(named);
                    }
                }
                let lifetimes = own
                    .iter()
                    .map(|l| {
                        let (lifetime, bounds) = (&l.lifetime, l.bounds.iter());
                        if l.bounds.is_empty() {
                            quote!(#lifetime)
                        } else {
                            quote!(#lifetime: #(#bounds)+*)
                        }
                    })
                    .chain(outer.iter().map(|l| quote!(#l)));
                let check_fn = mixed("__idem_check");
                // A bound the value does not meet is reported at the
                // declared type, as without the attribute, not at it.
                let ret_at_type =
                    Ident::new(&ret_ident.to_string(), Span::mixed_site().located_at(ty.span()));
                let call = quote_spanned!(ty.span()=> #check_fn::<#(#part_types,)* #(#placeholders),*>(#ret_at_type));
                (
                    quote!(#inferred),
                    quote!({
                        fn #check_fn<#(#lifetimes,)* #(#part_params,)* #(#impl_params: #bounds),*>(
                            value: #generic,
                        ) -> #declared {
                            value
                        }
                        #call
                    }),
                )
            }
        }
    };
    // Classified here, where the value still has its own type: behind the
    // `impl Trait` only the bounds can be seen, and a `Classify` impl of
    // the type behind them would be ignored.
    Pinned::Classified(quote! {
        async move {
            let #ret_ident = #private::returning::<#ret, _>(async move #block).await;
            let #class = {
                use #private_here::classifying::*;
                (&&&#private::Probe(&#ret_ident)).__idem_classify()
            };
            (#check, #class)
        }
    })
}

/// Replaces each part of `ty` that has no `impl Trait` in it (a whole
/// generic argument, tuple element or referenced type; a type in an `impl
/// Trait`'s bounds) with a new type parameter, and pushes its name with
/// the part: `Result<impl Into<T>, Wrap<G>>` becomes `Result<impl
/// Into<__IdemPart0>, __IdemPart1>`, `T` and `Wrap<G>` pushed.
fn abstract_named_parts(ty: &mut Type, parts: &mut Vec<(Ident, Type)>) {
    visit_types(ty, &mut |t| {
        if has_impl_trait(t) {
            return true;
        }
        let name = Ident::new(&format!("__IdemPart{}", parts.len()), Span::mixed_site());
        parts.push((name.clone(), std::mem::replace(t, syn::parse_quote!(#name))));
        false
    });
}

/// The lifetimes named in `tokens` (a type), in order, but `'static`,
/// `'_` and those a `for<..>` binds, which no generic parameter declares.
fn lifetimes_in(tokens: TokenStream) -> Vec<syn::Lifetime> {
    let (mut named, mut bound) = (Vec::new(), Vec::new());
    collect_lifetimes(tokens, &mut named, &mut bound);
    named.retain(|l| !bound.iter().any(|b| b.ident.unraw() == l.ident.unraw()));
    named
}

/// Pushes each lifetime of `tokens` to `named` once, and those a
/// `for<..>` declares to `bound` too.
fn collect_lifetimes(tokens: TokenStream, named: &mut Vec<syn::Lifetime>, bound: &mut Vec<syn::Lifetime>) {
    use proc_macro2::TokenTree;
    let mut tokens = tokens.into_iter().peekable();
    // Inside a `for<..>`: how many `<` are open.
    let mut binder = 0usize;
    let mut after_for = false;
    while let Some(token) = tokens.next() {
        match token {
            TokenTree::Group(group) => collect_lifetimes(group.stream(), named, bound),
            TokenTree::Ident(ident) => {
                after_for = ident == "for";
                continue;
            }
            TokenTree::Punct(p) if p.as_char() == '<' && (after_for || binder > 0) => binder += 1,
            TokenTree::Punct(p) if p.as_char() == '>' && binder > 0 => binder -= 1,
            TokenTree::Punct(p) if p.as_char() == '\'' => {
                if let Some(TokenTree::Ident(ident)) = tokens.peek() {
                    let lifetime = syn::Lifetime {
                        apostrophe: p.span(),
                        ident: ident.clone(),
                    };
                    tokens.next();
                    if binder > 0 && !bound.iter().any(|l| l.ident.unraw() == lifetime.ident.unraw()) {
                        bound.push(lifetime.clone());
                    }
                    let name = lifetime.ident.unraw();
                    if name != "static" && name != "_" && !named.iter().any(|l| l.ident.unraw() == name) {
                        named.push(lifetime);
                    }
                }
            }
            _ => {}
        }
        after_for = false;
    }
}

/// Whether `ty` has an `impl Trait` in it.
fn has_impl_trait(ty: &Type) -> bool {
    let mut found = false;
    visit_types(&mut ty.clone(), &mut |t| {
        found |= matches!(t, Type::ImplTrait(_));
        !found
    });
    found
}

/// The handler's block as a future: of its value, or (where the declared
/// type hides the value's own behind an `impl Trait`) of the value and how
/// it is classified.
enum Pinned {
    Value(TokenStream),
    Classified(TokenStream),
}

/// Whether `ty` is a path whose last segment is `Result`.
fn is_named_result(ty: &Type) -> bool {
    let mut inner = ty;
    while let Type::Paren(syn::TypeParen { elem, .. }) | Type::Group(syn::TypeGroup { elem, .. }) = inner {
        inner = elem;
    }
    matches!(inner, Type::Path(p) if p.path.segments.last().is_some_and(|s| s.ident == "Result"))
}

/// Calls `f` on `ty` and, where `f` says to go on, on every type nested in
/// it (generic arguments and associated type bindings, a qualified path's
/// type, the bounds of `dyn` and `impl` types, tuples, references,
/// pointers, arrays, slices).
pub(crate) fn visit_types(ty: &mut Type, f: &mut dyn FnMut(&mut Type) -> bool) {
    if !f(ty) {
        return;
    }
    match ty {
        Type::Path(p) => {
            if let Some(q) = &mut p.qself {
                visit_types(&mut q.ty, f);
            }
            visit_path(&mut p.path, f);
        }
        Type::TraitObject(syn::TypeTraitObject { bounds, .. })
        | Type::ImplTrait(syn::TypeImplTrait { bounds, .. }) => {
            for bound in bounds.iter_mut() {
                if let syn::TypeParamBound::Trait(t) = bound {
                    visit_path(&mut t.path, f);
                }
            }
        }
        Type::Tuple(t) => t.elems.iter_mut().for_each(|t| visit_types(t, f)),
        Type::Paren(syn::TypeParen { elem, .. })
        | Type::Group(syn::TypeGroup { elem, .. })
        | Type::Array(syn::TypeArray { elem, .. })
        | Type::Slice(syn::TypeSlice { elem, .. })
        | Type::Ptr(syn::TypePtr { elem, .. })
        | Type::Reference(syn::TypeReference { elem, .. }) => visit_types(elem, f),
        _ => {}
    }
}

/// [`visit_types`] on the types among `path`'s arguments.
fn visit_path(path: &mut syn::Path, f: &mut dyn FnMut(&mut Type) -> bool) {
    for seg in path.segments.iter_mut() {
        match &mut seg.arguments {
            syn::PathArguments::AngleBracketed(args) => {
                for arg in args.args.iter_mut() {
                    match arg {
                        syn::GenericArgument::Type(t) => visit_types(t, f),
                        syn::GenericArgument::AssocType(binding) => visit_types(&mut binding.ty, f),
                        _ => {}
                    }
                }
            }
            syn::PathArguments::Parenthesized(args) => {
                args.inputs.iter_mut().for_each(|t| visit_types(t, f));
                if let ReturnType::Type(_, t) = &mut args.output {
                    visit_types(t, f);
                }
            }
            syn::PathArguments::None => {}
        }
    }
}

fn not_precise_capture(b: &syn::TypeParamBound) -> bool {
    !matches!(b, syn::TypeParamBound::PreciseCapture(_))
}

// Input:  a declared return type, `Result<impl IntoResponse + use<>, E>`.
// Output: that type taken apart for `pinned_block`:
//         - the binding's type, each `impl Trait` left to inference:
//           `Result<_, E>`;
//         - a checking fn's parameter type, each `impl Trait` a generic
//           parameter: `Result<__IdemImpl0, E>`;
//         - those parameters with their bounds: `[(__IdemImpl0, IntoResponse)]`;
//         - the checking fn's return type, the declared one without
//           `use<..>`, which only the handler's own signature may carry:
//           `Result<impl IntoResponse, E>`.
fn split_return_type(ty: &Type) -> (Type, Type, Vec<(syn::Ident, TokenStream)>, Type) {
    let (mut inferred, mut generic, mut declared) = (ty.clone(), ty.clone(), ty.clone());
    visit_types(&mut inferred, &mut |t| {
        if matches!(t, Type::ImplTrait(_)) {
            *t = syn::parse_quote!(_);
            return false;
        }
        true
    });
    let mut params = Vec::new();
    visit_types(&mut generic, &mut |t| {
        let Type::ImplTrait(it) = t else { return true };
        let name = syn::Ident::new(&format!("__IdemImpl{}", params.len()), Span::mixed_site());
        let bounds = it.bounds.iter().filter(|b| not_precise_capture(b));
        params.push((name.clone(), quote!(#(#bounds)+*)));
        *t = syn::parse_quote!(#name);
        false
    });
    visit_types(&mut declared, &mut |t| {
        if let Type::ImplTrait(it) = t {
            it.bounds = std::mem::take(&mut it.bounds)
                .into_iter()
                .filter(not_precise_capture)
                .collect();
        }
        true
    });
    (inferred, generic, params, declared)
}

// Input:  the keying, the body's binding and the pinned block.
// Output: the one runtime call, `run_optional` for an optional key:
//             ::idem::__private::run(__idem_ctx, __idem_spec, __idem_fp, move |__idem_op| async move {
//                 let op: Operation = __idem_op;
//                 let Json(p) = __idem_body.value;
//                 let __idem_out = async move { .. }.await;
//                 let __idem_class = {
//                     use ::idem::__private::classifying::*;
//                     (&&&::idem::__private::Probe(&__idem_out)).__idem_classify()
//                 };
//                 (::idem::__private::IntoResponse::into_response(__idem_out), __idem_class)
//             })
//             .await
fn run_call(
    names: &Names,
    keying: &Keying,
    body_binding: Option<&TokenStream>,
    block: Pinned,
    output: &ReturnType,
) -> TokenStream {
    let Names {
        private,
        private_here,
        ctx,
        op,
        spec,
        fp,
        out,
        class,
        ..
    } = names;
    let run = match keying {
        Keying::Required(_) => quote!(run),
        Keying::Optional(_) => quote!(run_optional),
    };
    let operation_binding = operation_binding(names, keying);
    // A return type that is no answer is an error at that type: the
    // argument, the output's own name located there, is what the error
    // points at.
    let span = match output {
        ReturnType::Type(_, ty) => ty.span(),
        ReturnType::Default => Span::call_site(),
    };
    let out_at_type = Ident::new(&out.to_string(), Span::mixed_site().located_at(span));
    let response = quote_spanned!(span=> #private::IntoResponse::into_response(#out_at_type));
    // A return type named `Result` is read as the standard library's (its
    // error type decides): one of another crate's under that name is an
    // error, not an ignored `Classify` impl.
    let named_result = match output {
        ReturnType::Type(_, ty) if is_named_result(ty) => {
            quote_spanned!(span=> #private::named_result(&#out_at_type);)
        }
        _ => quote!(),
    };
    let outcome = match block {
        Pinned::Value(block) => quote! {
            let #out = #block.await;
            let #class = {
                use #private_here::classifying::*;
                (&&&#private::Probe(&#out)).__idem_classify()
            };
        },
        Pinned::Classified(block) => quote!(let (#out, #class) = #block.await;),
    };
    quote! {
        #private::#run(#ctx, #spec, #fp, move |#op| async move {
            #operation_binding
            #body_binding
            #outcome
            #named_result
            (#response, #class)
        })
        .await
    }
}

// Input:  the checked arguments and handler.
// Output: the handler as axum sees it, with the same attributes, visibility
//         and generics, whose body is one runtime call:
//             #[attrs] vis async fn create(__idem_ctx: ::idem::__private::Context,
//                     State(s): State<App>, mut __idem_body: ::idem::__private::Raw<Json<In>>)
//                     -> ::idem::__private::Response {
//                 let __idem_spec = ..;   // `spec_block`
//                 const _: () = ..;       // `json_check`
//                 let __idem_fp = {
//                     let __idem_read = ..;   // `field_reads`
//                     ::idem::__private::fingerprint_request(&__idem_ctx, __idem_spec,
//                         ::idem::__private::print_body::<Json<In>>(&__idem_body), &__idem_read)
//                 };
//                 let __idem_ctx = __idem_ctx.seen_last(__idem_body.tenant.take());
//                 ::idem::__private::run(__idem_ctx, __idem_spec, __idem_fp, ..).await // `run_call`
//             }
fn generate(args: &IdempotentArgs, handler: &Handler) -> TokenStream {
    let names = Names::new(args);
    let Names {
        private,
        ctx,
        spec,
        fp,
        ..
    } = &names;
    let (mut params, body) = parameters(&names, handler);
    let syn::ItemFn {
        attrs,
        vis,
        sig,
        block,
        ..
    } = &handler.item;
    let spec_block = spec_block(&names, args, &handler.keying, &sig.ident);
    let json_check = json_check(&names, args, body.as_ref(), &sig.generics);
    let (reads, read_bytes) = field_reads(&names, args);
    let print = match &body {
        Some(body) => body.print.clone(),
        None => quote!(#private::BodyPrint::None),
    };
    let run = run_call(
        &names,
        &handler.keying,
        body.as_ref().map(|body| &body.binding),
        pinned_block(&names, &sig.output, &sig.generics, block),
        &sig.output,
    );
    let syn::Signature {
        constness,
        unsafety,
        abi,
        fn_token,
        ident,
        generics,
        ..
    } = sig;
    let where_clause = &generics.where_clause;
    // A header of its own: the context keeps the header map to read it
    // (the default header's values alone are kept otherwise). No item is
    // emitted, so a handler in an `impl` block works the same.
    if args.header.is_some() {
        params[0] = quote!(#ctx: #private::Context<#private::CustomKeyHeader>);
    }
    // No body fingerprinted (`body = "none"`, or a last parameter taken
    // for a head extractor by its name): every parameter stands before
    // idem's last one, which reads nothing, so axum refuses one that reads
    // the body (a type alias of `Json<T>`, whatever its name).
    let body_ident = &names.body;
    if body.is_none() {
        params.push(quote!(mut #body_ident: #private::NoBody));
    }
    quote! {
        #(#attrs)*
        #vis #constness async #unsafety #abi #fn_token #ident #generics (#(#params),*) -> #private::Response
        #where_clause
        {
            #spec_block
            #json_check
            // In a block: what was read is gone before the first await.
            let #fp = {
                #reads
                #private::fingerprint_request(&#ctx, #spec, #print, #read_bytes)
            };
            // The tenant as the last extractor saw it: one of the
            // handler's own extractors may have established it.
            let #ctx = #ctx.seen_last(#body_ident.tenant.take());
            #run
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expand(args: TokenStream, item: TokenStream) -> String {
        idempotent(args, item).to_string()
    }

    #[test]
    fn renames_the_body_and_injects_the_context_first() {
        let out = expand(
            quote!(scope = "payment.create", fields(amount)),
            quote!(
                async fn create(State(s): State<App>, Json(p): Json<In>) -> Result<Out, Err> {
                    todo!()
                }
            ),
        );
        let ctx = out.find("__idem_ctx : :: idem :: __private :: Context").unwrap();
        let state = out.find("State (s) : State < App >").unwrap();
        let body = out
            .find("__idem_body : :: idem :: __private :: Raw < Json < In > >")
            .unwrap();
        assert!(ctx < state && state < body, "{out}");
        assert!(out.contains("\"amount\""), "{out}");
        assert!(out.contains("let Json (p) = __idem_body . value ;"), "{out}");
        assert!(out.contains("-> :: idem :: __private :: Response"), "{out}");
    }

    #[test]
    fn names_the_lifetimes_of_a_type_but_static_elided_and_bound() {
        let names = |ty: TokenStream| {
            lifetimes_in(ty)
                .iter()
                .map(|l| l.ident.to_string())
                .collect::<Vec<_>>()
        };
        assert_eq!(names(quote!(impl IntoResponse + 'a)), ["a"]);
        assert_eq!(
            names(quote!(Result<impl IntoResponse + 'a + 'b, Wrap<'a, 'static, '_>>)),
            ["a", "b"]
        );
        assert_eq!(
            names(quote!(impl for<'x, 'y> Tr<'x, &'y u8> + Into<Vec<&'c str>>)),
            ["c"]
        );
    }

    #[test]
    fn uses_the_crate_override_everywhere() {
        let out = expand(
            quote!(scope = "a", crate = "my::idem"),
            quote!(
                async fn f() {}
            ),
        );
        assert_eq!(
            out.matches(":: idem ::").count(),
            out.matches("my :: idem ::").count(),
            "{out}"
        );
        assert!(out.contains("my :: idem :: __private :: run"), "{out}");
    }

    #[test]
    fn optional_handlers_use_the_optional_runner() {
        let out = expand(
            quote!(scope = "a", optional),
            quote!(
                async fn f() {}
            ),
        );
        assert!(out.contains("run_optional"), "{out}");
    }

    #[test]
    fn a_required_key_fills_an_option_of_operation_with_some() {
        let out = expand(
            quote!(scope = "a"),
            quote!(
                async fn f(op: Option<Operation>) {}
            ),
        );
        assert!(
            out.contains("let op : Option < Operation > = :: core :: option :: Option :: Some (__idem_op) ;"),
            "{out}"
        );
        assert!(out.contains("optional : false"), "{out}");
        assert!(out.contains(":: idem :: __private :: run (__idem_ctx"), "{out}");
    }

    #[test]
    fn an_optional_key_hands_the_option_of_operation_over_as_is() {
        let out = expand(
            quote!(scope = "a", optional),
            quote!(
                async fn f(op: Option<Operation>) {}
            ),
        );
        assert!(
            out.contains("let op : Option < Operation > = __idem_op ;"),
            "{out}"
        );
        assert!(out.contains("optional : true"), "{out}");
        assert!(
            out.contains(":: idem :: __private :: run_optional (__idem_ctx"),
            "{out}"
        );
    }

    #[test]
    fn an_optional_key_refuses_a_bare_operation() {
        let out = expand(
            quote!(scope = "a", optional),
            quote!(
                async fn f(op: Operation) {}
            ),
        );
        assert!(out.starts_with("async fn f (op : Operation) { }"), "{out}");
        assert!(out.contains("ask for `Option<Operation>`"), "{out}");
    }

    #[test]
    fn errors_keep_the_handler_as_written() {
        let out = expand(
            quote!(scope = "A"),
            quote!(
                async fn f() -> u8 {
                    1
                }
            ),
        );
        assert!(out.starts_with("async fn f () -> u8 { 1 }"), "{out}");
        assert!(out.contains("compile_error"), "{out}");
    }

    #[test]
    fn unparsable_items_are_passed_through_with_the_error() {
        let out = expand(
            quote!(scope = "a"),
            quote!(
                struct S;
            ),
        );
        assert!(out.starts_with("struct S ;"), "{out}");
        assert!(out.contains("compile_error"), "{out}");
    }

    /// The JSON check is an item, checked at once, unless the body type
    /// has generic arguments of its own, which may be an `impl` block's
    /// parameters (unseen here, and no item can name them): then it is an
    /// inline const, checked when the handler is instantiated.
    #[test]
    fn the_json_check_is_inline_where_the_body_may_name_outer_parameters() {
        let check = |body: TokenStream| {
            expand(
                quote!(scope = "payment.create", fields(amount)),
                quote!(async fn f(Json(p): #body) -> u8 { 1 }),
            )
        };
        let plain = check(quote!(Json<In>));
        assert!(plain.contains("const _ : () = :: core :: assert !"), "{plain}");
        let nested = check(quote!(Json<Envelope<T>>));
        assert!(!nested.contains("const _ : ()"), "{nested}");
        assert!(nested.contains("const { :: core :: assert !"), "{nested}");
    }
}
