//! The expansion of `#[idempotent(...)]`.

use crate::args::IdempotentArgs;
use crate::handler::{Handler, OperationParam};
use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{FnArg, ReturnType, Type};

fn combine(errors: &mut Option<syn::Error>, err: syn::Error) {
    match errors {
        Some(all) => all.combine(err),
        None => *errors = Some(err),
    }
}

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
    let args: IdempotentArgs = match syn::parse2(args) {
        Ok(args) => args,
        Err(e) => return with_error(item, e),
    };
    let func: syn::ItemFn = match syn::parse2(item.clone()) {
        Ok(f) => f,
        Err(e) => return with_error(item, e),
    };
    let mut errors = args.errors.clone();
    let handler = match Handler::analyze(func, args.optional.is_some()) {
        Ok(h) => Some(h),
        Err(e) => {
            combine(&mut errors, e);
            None
        }
    };
    if let (Some((fields_kw, _)), Some(h)) = (&args.fields, &handler) {
        if h.body.is_none() {
            combine(
                &mut errors,
                syn::Error::new(
                    fields_kw.span,
                    "`fields(...)` names fields of the request body, but this handler has no `Json<T>` parameter",
                ),
            );
        }
    }
    match (errors, handler) {
        (None, Some(handler)) => generate(&args, handler),
        (Some(e), _) => with_error(item, e),
        // `analyze` fails only with an error, so this arm is never taken.
        (None, None) => item,
    }
}

fn mixed(name: &str) -> syn::Ident {
    syn::Ident::new(name, Span::mixed_site())
}

// Input:  a checked handler and its arguments.
// Output:
//     #[attrs] vis async fn create(__idem_ctx: ::idem::__private::Context,
//             State(s): State<App>, __idem_body: Json<In>) -> ::idem::__private::Response {
//         static __IDEM_SPEC: Spec = Spec { scope: "payment.create", .. };
//         let __idem_fp = fingerprint("payment.create", &[("amount", &__idem_body.0.amount as &dyn Fingerprint)]);
//         run(__idem_ctx, &__IDEM_SPEC, __idem_fp, move |__idem_op| async move {
//             let Json(p) = __idem_body;
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
    let spec_ident = mixed("__IDEM_SPEC");

    let Handler {
        item,
        body,
        operation,
    } = handler;
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
    let mut body_type: Option<Type> = None;
    for (i, input) in sig.inputs.iter().enumerate() {
        let FnArg::Typed(pt) = input else { continue };
        if operation.as_ref().is_some_and(|(at, _)| *at == i) {
            continue;
        }
        if body == Some(i) {
            let (pat, ty) = (&pt.pat, &pt.ty);
            let attrs = &pt.attrs;
            params.push(quote!(#(#attrs)* #body_ident: #ty));
            bindings.push(quote!(let #pat = #body_ident;));
            body_type = Some((*pt.ty).clone());
        } else {
            params.push(quote!(#input));
        }
    }
    let optional = args.optional.is_some();
    // The `Operation` is handed over by the runtime after the reservation;
    // the binding keeps the user's pattern and type.
    match &operation {
        Some((_, OperationParam::Required(pt))) => {
            let (pat, ty) = (&pt.pat, &pt.ty);
            bindings.insert(0, quote!(let #pat: #ty = #op_ident;));
        }
        Some((_, OperationParam::Optional(pt))) => {
            let (pat, ty) = (&pt.pat, &pt.ty);
            let value = if optional {
                quote!(#op_ident)
            } else {
                quote!(::core::option::Option::Some(#op_ident))
            };
            bindings.insert(0, quote!(let #pat: #ty = #value;));
        }
        None => bindings.insert(0, quote!(let _ = #op_ident;)),
    }

    // The fingerprinted fields, each spanned at its name in the attribute so
    // that an unknown field or a type that cannot be fingerprinted is
    // reported there.
    let fields: Vec<TokenStream> = match (&args.fields, &body_type) {
        (Some((_, list)), Some(_)) => list
            .iter()
            .map(|field| {
                let name = field.name();
                let segments = field.segments.iter();
                // Resolved like the other generated names, located at the
                // field: rustc then reports the field's errors there.
                let body = syn::Ident::new("__idem_body", Span::mixed_site().located_at(field.span()));
                quote_spanned!(field.span()=> (#name, #private::field(&#body.0 #(.#segments)*)))
            })
            .collect(),
        (None, Some(ty)) => {
            let body = syn::Ident::new("__idem_body", Span::mixed_site().located_at(ty.span()));
            vec![quote_spanned!(ty.span()=> ("", #private::field(&#body.0)))]
        }
        _ => Vec::new(),
    };

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

    // The body's value is pinned to the declared type, so that `?` and an
    // early `return` infer; an `impl Trait` is checked through a generic
    // identity fn with the same bounds.
    let pin_ident = mixed("__idem_pin");
    let (ret, pin_fn): (TokenStream, TokenStream) = match &sig.output {
        ReturnType::Default => (quote!(()), quote!()),
        ReturnType::Type(_, ty) => match &**ty {
            Type::ImplTrait(it) => {
                let bounds = &it.bounds;
                (
                    quote!(_),
                    quote!(fn #pin_ident<T: #bounds>(value: T) -> T { value }),
                )
            }
            ty => (quote!(#ty), quote!()),
        },
    };
    let pinned_block = if pin_fn.is_empty() {
        quote!(#block)
    } else {
        quote!(#pin_ident(#block))
    };
    let run = if optional {
        quote!(run_optional)
    } else {
        quote!(run)
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
            static #spec_ident: #private::Spec = #private::Spec {
                scope: #scope,
                header: #header,
                optional: #optional,
                ttl: #ttl,
                lock_timeout: #lock_timeout,
                wait: #wait,
            };
            let #fp_ident = #private::fingerprint(#scope, &[#(#fields),*]);
            #private::#run(#ctx, &#spec_ident, #fp_ident, move |#op_ident| async move {
                #(#bindings)*
                #pin_fn
                let #out_ident = async move {
                    let #ret_ident: #ret = #pinned_block;
                    #ret_ident
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
        let body = out.find("__idem_body : Json < In >").unwrap();
        assert!(ctx < state && state < body, "{out}");
        assert!(out.contains("\"amount\""), "{out}");
        assert!(out.contains("let Json (p) = __idem_body ;"), "{out}");
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
