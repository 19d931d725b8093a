//! The expansion of `#[idempotent(...)]`.

use crate::args::IdempotentArgs;
use crate::handler::{BodyKind, Handler, Keying, RequiredOperation};
use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{FnArg, LitStr, ReturnType, Type};

/// The handler as written, followed by `err`: the handler still exists, so
/// the only errors shown are ours.
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
        Err(e) => return with_error(item, e),
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
                "`fields(...)` names fields of the request body, but this handler has no `Json<T>` parameter",
            ));
        }
    }
    match (errors.finish(), handler) {
        (Ok(()), Some(handler)) => generate(&args, handler),
        (Err(e), _) => with_error(item, e),
        // `analyze` fails only with an error, so this arm is never taken.
        (Ok(()), None) => item,
    }
}

fn mixed(name: &str) -> syn::Ident {
    syn::Ident::new(name, Span::mixed_site())
}

/// Calls `f` on `ty` and, where `f` says to go on, on every type nested in
/// it (generic arguments, tuples, references, arrays).
fn visit_types(ty: &mut Type, f: &mut dyn FnMut(&mut Type) -> bool) {
    if !f(ty) {
        return;
    }
    match ty {
        Type::Path(p) => {
            for seg in p.path.segments.iter_mut() {
                if let syn::PathArguments::AngleBracketed(args) = &mut seg.arguments {
                    for arg in args.args.iter_mut() {
                        if let syn::GenericArgument::Type(t) = arg {
                            visit_types(t, f);
                        }
                    }
                }
            }
        }
        Type::Tuple(t) => t.elems.iter_mut().for_each(|t| visit_types(t, f)),
        Type::Paren(syn::TypeParen { elem, .. })
        | Type::Group(syn::TypeGroup { elem, .. })
        | Type::Array(syn::TypeArray { elem, .. })
        | Type::Slice(syn::TypeSlice { elem, .. })
        | Type::Reference(syn::TypeReference { elem, .. }) => visit_types(elem, f),
        _ => {}
    }
}

fn not_precise_capture(b: &syn::TypeParamBound) -> bool {
    !matches!(b, syn::TypeParamBound::PreciseCapture(_))
}

/// The return type `ty` taken apart for the handler's body: the type of the
/// binding (each `impl Trait` left to inference), a checking fn's parameter
/// type (each `impl Trait` a generic parameter), those parameters with their
/// bounds, and the checking fn's return type (`ty` without `use<..>`, which
/// only the handler's own signature may carry).
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

/// `Json<T>` as `Raw<Json<T>>` (or `Form<T>` as `Raw<Form<T>>`): the body
/// extractor under idem's, which keeps the bytes.
fn raw_extractor(private: &TokenStream, ty: &Type) -> TokenStream {
    quote_spanned!(ty.span()=> #private::Raw<#ty>)
}

// Input:  a checked handler and its arguments.
// Output:
//     #[attrs] vis async fn create(__idem_ctx: ::idem::__private::Context,
//             State(s): State<App>, __idem_body: ::idem::__private::Raw<Json<In>>)
//             -> ::idem::__private::Response {
//         let __idem_spec: &'static Spec = { static SPEC: Spec = Spec { scope: "payment.create", .. }; &SPEC };
//         let _ = &__idem_body.value.0.amount; // each declared field exists
//         let __idem_fp = fingerprint_request(&__idem_ctx, __idem_spec, print_body::<Json<In>>(&__idem_body));
//         run(__idem_ctx, __idem_spec, __idem_fp, move |__idem_op| async move {
//             let Json(p) = __idem_body.value;
//             let __idem_out = async move { let __idem_ret: R = { .. }; __idem_ret }.await;
//             let __idem_class = (&&&Probe(&__idem_out)).__idem_classify();
//             (IntoResponse::into_response(__idem_out), __idem_class)
//         }).await
//     }
fn generate(args: &IdempotentArgs, handler: Handler) -> TokenStream {
    let krate = match &args.krate {
        Some((_, path)) => quote!(#path),
        None => quote!(::idem),
    };
    let private = quote!(#krate::__private);
    let ctx = mixed("__idem_ctx");
    let body_ident = mixed("__idem_body");
    let op_ident = mixed("__idem_op");
    let fp_ident = mixed("__idem_fp");
    let out_ident = mixed("__idem_out");
    let ret_ident = mixed("__idem_ret");
    let class_ident = mixed("__idem_class");
    let spec_ident = mixed("__idem_spec");

    let Handler { item, body, keying } = handler;
    let syn::ItemFn {
        attrs,
        vis,
        sig,
        block,
    } = item;

    // The parameters the generated fn keeps (axum extracts them), and the
    // bindings that recreate the user's patterns inside the handler future.
    let mut params: Vec<TokenStream> = vec![quote!(#ctx: #private::Context)];
    let mut bindings: Vec<TokenStream> = Vec::new();
    let mut print = quote!(#private::BodyPrint::None);
    let mut body_type: Option<Type> = None;
    for (i, input) in sig.inputs.iter().enumerate() {
        let FnArg::Typed(pt) = input else { continue };
        if keying.operation_at() == Some(i) {
            continue;
        }
        match body {
            Some((at, kind)) if at == i => {
                let (pat, ty, attrs) = (&pt.pat, &pt.ty, &pt.attrs);
                let (param_ty, value, body_print) = match kind {
                    BodyKind::Extracted => (
                        raw_extractor(&private, ty),
                        quote!(#body_ident.value),
                        quote_spanned!(ty.span()=> #private::print_body::<#ty>(&#body_ident)),
                    ),
                    BodyKind::Raw => (
                        quote!(#ty),
                        quote!(#body_ident),
                        quote!(#private::raw(&#body_ident)),
                    ),
                };
                params.push(quote!(#(#attrs)* #body_ident: #param_ty));
                body_type = Some((**ty).clone());
                bindings.push(quote!(let #pat = #value;));
                print = body_print;
            }
            _ => params.push(quote!(#input)),
        }
    }
    // The `Operation` is handed over by the runtime after the reservation;
    // the binding keeps the user's pattern and type.
    let operation = match &keying {
        Keying::Required(Some(RequiredOperation::Bare(p))) | Keying::Optional(Some(p)) => {
            Some((p, quote!(#op_ident)))
        }
        Keying::Required(Some(RequiredOperation::InSome(p))) => {
            Some((p, quote!(::core::option::Option::Some(#op_ident))))
        }
        Keying::Required(None) | Keying::Optional(None) => None,
    };
    match operation {
        Some((p, value)) => {
            let (pat, ty) = (&p.param.pat, &p.param.ty);
            bindings.insert(0, quote!(let #pat: #ty = #value;));
        }
        None => bindings.insert(0, quote!(let _ = #op_ident;)),
    }

    // Each declared field must exist on the body type: an access spanned at
    // its name in the attribute, so that rustc reports a missing one there.
    // What the handler reads of each: the fingerprint counts a field by its
    // wire path only where the JSON there is that value.
    let (reads, wires): (Vec<TokenStream>, Vec<String>) = match &args.fields {
        Some((_, list)) => list
            .iter()
            .map(|field| {
                let segments = field.segments.iter();
                let body = syn::Ident::new("__idem_body", Span::mixed_site().located_at(field.span()));
                (
                    quote_spanned!(field.span()=>
                        (&&#private::FieldProbe(&#body.value.0 #(.#segments)*)).__idem_json()
                    ),
                    field.wire(),
                )
            })
            .unzip(),
        None => (Vec::new(), Vec::new()),
    };
    let read_ident = mixed("__idem_read");
    // `fields(...)` names JSON members: the body must read JSON.
    let json_check = match (&args.fields, &body_type) {
        // An item is checked at once, but cannot name the handler's generic
        // parameters; a generic handler gets an inline const, checked when
        // it is instantiated.
        (Some((kw, _)), Some(ty)) if sig.generics.params.is_empty() => quote_spanned!(kw.span=>
            const _: () = ::core::assert!(
                #private::is_json::<#ty>(),
                "`fields(...)` names members of a JSON body, but this body extractor does not read JSON"
            );
        ),
        (Some((kw, _)), Some(ty)) => quote_spanned!(kw.span=>
            const {
                ::core::assert!(
                    #private::is_json::<#ty>(),
                    "`fields(...)` names members of a JSON body, but this body extractor does not read JSON"
                )
            };
        ),
        _ => quote!(),
    };
    let fields = if args.fields.is_some() {
        quote!(::core::option::Option::Some(&[#(#wires),*]))
    } else {
        quote!(::core::option::Option::None)
    };
    let ignore: Vec<String> = args
        .ignore
        .as_ref()
        .map(|(_, list)| list.iter().map(LitStr::value).collect())
        .unwrap_or_default();

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
    let millis = |d: Option<&crate::args::DurationLit>| match d {
        Some(d) => {
            let ms = d.millis;
            quote!(::core::option::Option::Some(#private::Duration::from_millis(#ms)))
        }
        None => quote!(::core::option::Option::None),
    };
    let ttl = millis(args.ttl.as_ref().map(|(_, d)| d));
    let lock_timeout = millis(args.lock_timeout.as_ref().map(|(_, d)| d));
    let wait = millis(args.wait.as_ref().map(|(_, d)| d));

    // The body's value is typed as declared, so that `?` and an early
    // `return` infer; each `impl Trait` in it is a generic parameter of a
    // checking fn whose return type is the declared one, so that its bounds
    // hold (and the names it uses count as used).
    let (ret, check) = match &sig.output {
        ReturnType::Default => (quote!(()), quote!(#ret_ident)),
        ReturnType::Type(_, ty) => {
            let (inferred, generic, params, declared) = split_return_type(ty);
            if params.is_empty() {
                (quote!(#ty), quote!(#ret_ident))
            } else {
                let (names, bounds): (Vec<_>, Vec<_>) = params.into_iter().unzip();
                let placeholders = names.iter().map(|_| quote!(_));
                let check_fn = mixed("__idem_check");
                (
                    quote!(#inferred),
                    quote!({
                        fn #check_fn<#(#names: #bounds),*>(value: #generic) -> #declared {
                            value
                        }
                        #check_fn::<#(#placeholders),*>(#ret_ident)
                    }),
                )
            }
        }
    };
    let (run, optional) = match &keying {
        Keying::Required(_) => (quote!(run), false),
        Keying::Optional(_) => (quote!(run_optional), true),
    };
    let syn::Signature {
        constness,
        unsafety,
        abi,
        fn_token,
        ident,
        generics,
        ..
    } = &sig;
    let where_clause = &generics.where_clause;

    quote! {
        #(#attrs)*
        #vis #constness async #unsafety #abi #fn_token #ident #generics (#(#params),*) -> #private::Response
        #where_clause
        {
            // In a block of its own: no item of the user's can meet it.
            let #spec_ident: &'static #private::Spec = {
                static SPEC: #private::Spec = #private::Spec {
                    scope: #scope,
                    header: #header,
                    optional: #optional,
                    ttl: #ttl,
                    lock_timeout: #lock_timeout,
                    wait: #wait,
                    fields: #fields,
                    ignore: &[#(#ignore),*],
                };
                &SPEC
            };
            #json_check
            let #read_ident: &[::core::option::Option<::std::vec::Vec<u8>>] = {
                #[allow(unused_imports)]
                use #private::{ViaNothing as _, ViaSerialize as _};
                &[#(#reads),*]
            };
            let #fp_ident = #private::fingerprint_request(&#ctx, #spec_ident, #print, #read_ident);
            #private::#run(#ctx, #spec_ident, #fp_ident, move |#op_ident| async move {
                #(#bindings)*
                let #out_ident = async move {
                    let #ret_ident: #ret = #block;
                    #check
                }
                .await;
                let #class_ident = {
                    #[allow(unused_imports)]
                    use #private::{ViaErr as _, ViaSelf as _, ViaStatus as _};
                    (&&&#private::Probe(&#out_ident)).__idem_classify()
                };
                (#private::IntoResponse::into_response(#out_ident), #class_ident)
            })
            .await
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
}
