// Return types beside an `impl Trait` that the checking of the declared
// type must accept: each compiles without the attribute. The checking fn,
// an item of its own, names none of the handler's parameters, the `impl`
// block's or `Self`: the call inside the handler does.


use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{routing::post, Json, Router};
use idem::{idempotent, Classification, Classify};
use std::marker::PhantomData;

/// A 402 that classifies itself as stored.
struct PayErr;
impl IntoResponse for PayErr {
    fn into_response(self) -> Response {
        StatusCode::PAYMENT_REQUIRED.into_response()
    }
}
impl Classify for PayErr {
    fn classify(&self) -> Classification {
        Classification::Store
    }
}

/// A 502 of any `T` that classifies itself as stored.
struct Wrap<T>(PhantomData<T>);
impl<T> IntoResponse for Wrap<T> {
    fn into_response(self) -> Response {
        StatusCode::BAD_GATEWAY.into_response()
    }
}
impl<T> Classify for Wrap<T> {
    fn classify(&self) -> Classification {
        Classification::Store
    }
}

// A generic error type named by a `where` bound, as the README asks, beside
// an `impl IntoResponse` success type.
mod generic_error_named_by_a_where_bound_beside_an_impl_trait {
    use super::*;

    #[idempotent(scope = "payment.create")]
    async fn create<T: Send + 'static>(body: String) -> Result<impl IntoResponse, Wrap<T>>
    where
        Wrap<T>: Classify,
    {
        if body.is_empty() {
            return Err(Wrap(PhantomData));
        }
        Ok("ok")
    }

    pub fn main() {
        let _app: Router = Router::new().route("/a", post(create::<u8>));
    }
}

// A generic handler whose answer names `T` on the success side and hides
// its error behind `impl IntoResponse + Classify`, as the
// README asks of generic handlers.
mod generic_success_type_beside_a_classified_impl_trait {
    use super::*;

    struct Declined;
    impl IntoResponse for Declined {
        fn into_response(self) -> Response {
            StatusCode::PAYMENT_REQUIRED.into_response()
        }
    }
    impl Classify for Declined {
        fn classify(&self) -> Classification {
            Classification::Store
        }
    }

    #[idempotent(scope = "payment.list")]
    async fn list<T: serde::Serialize + Default + Send + 'static>(
        body: String,
    ) -> Result<Json<Vec<T>>, impl IntoResponse + Classify> {
        if body.is_empty() {
            return Err(Declined);
        }
        Ok(Json(vec![T::default()]))
    }

    pub fn main() {
        let _app: Router = Router::new().route("/a", post(list::<u8>));
    }
}

// A handler in an `impl` block whose return type names `Self` next to an
// `impl Trait`.
mod self_beside_an_impl_trait_in_an_impl_block {
    use super::*;

    #[derive(serde::Deserialize, serde::Serialize)]
    struct Payment {
        amount: i64,
    }

    impl Payment {
        #[idempotent(scope = "payment.create", fields(amount))]
        async fn create(Json(p): Json<Self>) -> Result<Json<Self>, impl IntoResponse> {
            if p.amount < 0 {
                return Err(PayErr);
            }
            Ok(Json(p))
        }
    }

    impl PayErr {
        #[idempotent(scope = "payment.update")]
        async fn update(body: String) -> Result<impl IntoResponse, Self> {
            if body.is_empty() {
                return Err(PayErr);
            }
            Ok("ok")
        }
    }

    pub fn main() {
        let _app: Router = Router::new()
            .route("/a", post(Payment::create))
            .route("/b", post(PayErr::update));
    }
}

// A handler in `impl<T> Svc<T>` with a `where` clause naming the impl's `T`,
// and an `impl Trait` success type with a concrete error. Compiles without
// the attribute.
mod where_clause_naming_the_impl_blocks_parameter {
    use super::*;

    struct Svc<T>(PhantomData<T>);

    impl<T: Send + Sync + 'static> Svc<T> {
        #[idempotent(scope = "payment.create")]
        async fn create(body: String) -> Result<impl IntoResponse, PayErr>
        where
            T: Clone,
        {
            if body.is_empty() {
                return Err(PayErr);
            }
            Ok("ok")
        }
    }

    pub fn main() {
        let _app: Router = Router::new().route("/a", post(Svc::<u8>::create));
    }
}

// A generic handler in `impl<T> Svc<T>` whose own parameter's bound names
// the impl's `T`; the answer hides its success type.
mod parameter_bound_naming_the_impl_blocks_parameter {
    use super::*;

    struct Svc<T>(PhantomData<T>);

    impl<T: Send + Sync + 'static> Svc<T> {
        #[idempotent(scope = "payment.create")]
        async fn create<G: From<T> + Send + 'static>(body: String) -> Result<impl IntoResponse, PayErr> {
            if body.is_empty() {
                return Err(PayErr);
            }
            Ok("ok")
        }
    }

    pub fn main() {
        let _app: Router = Router::new().route("/a", post(Svc::<u8>::create::<u16>));
    }
}

// `<Self as Gateway>::Error` beside an `impl Trait` in an inherent impl of a
// concrete type: a concrete error type.
mod qualified_self_error_beside_an_impl_trait {
    use super::*;

    trait Gateway {
        type Error;
    }

    struct Stripe;
    impl Gateway for Stripe {
        type Error = PayErr;
    }

    impl Stripe {
        #[idempotent(scope = "payment.create")]
        async fn create(body: String) -> Result<impl IntoResponse, <Self as Gateway>::Error> {
            if body.is_empty() {
                return Err(PayErr);
            }
            Ok("ok")
        }
    }

    pub fn main() {
        let _app: Router = Router::new().route("/a", post(Stripe::create));
    }
}

// `Self` in a generic parameter's bound and in the `where` clause of a
// handler in a generic impl, beside an `impl Trait`.
mod self_in_a_bound_and_where_clause_beside_an_impl_trait {
    use super::*;

    #[derive(Clone)]
    struct Svc(PhantomData<u8>);
    impl From<u8> for Svc {
        fn from(_: u8) -> Self {
            Svc(PhantomData)
        }
    }

    impl Svc {
        #[idempotent(scope = "payment.create")]
        async fn create<G: Into<Self> + Send + 'static>(body: String) -> Result<impl IntoResponse, PayErr>
        where
            Self: Clone,
        {
            if body.is_empty() {
                return Err(PayErr);
            }
            Ok("ok")
        }
    }

    pub fn main() {
        let _app: Router = Router::new().route("/a", post(Svc::create::<u8>));
    }
}

// A lifetime parameter beside a type parameter, the README's form.
mod lifetime_and_type_parameters_beside_an_impl_trait {
    use super::*;

    #[idempotent(scope = "payment.create")]
    async fn create<'a, T: Send + 'static>(body: String) -> Result<impl IntoResponse + 'a, Wrap<T>>
    where
        Wrap<T>: Classify,
        T: 'a,
    {
        if body.is_empty() {
            return Err(Wrap(PhantomData));
        }
        Ok("ok")
    }

    pub fn main() {
        let _app: Router = Router::new().route("/a", post(create::<u8>));
    }
}

// `Self::CODE` in a const argument of the error type, beside an `impl Trait`.
mod self_in_a_const_argument_beside_an_impl_trait {
    use super::*;

    struct Code<const N: u16>;
    impl<const N: u16> IntoResponse for Code<N> {
        fn into_response(self) -> Response {
            StatusCode::from_u16(N).unwrap().into_response()
        }
    }

    struct Svc;
    impl Svc {
        const CODE: u16 = 402;

        #[idempotent(scope = "payment.create")]
        async fn create(body: String) -> Result<impl IntoResponse, Code<{ Self::CODE }>> {
            if body.is_empty() {
                return Err(Code);
            }
            Ok("ok")
        }
    }

    pub fn main() {
        let _app: Router = Router::new().route("/a", post(Svc::create));
    }
}

// The error type is a struct whose parameter is bounded (it holds G::Error).
mod error_struct_with_a_bounded_parameter_beside_an_impl_trait {
    use super::*;

    trait Gateway: Clone + Send + Sync + 'static {
        type Error: Send;
    }
    #[derive(Clone)]
    struct Stripe;
    impl Gateway for Stripe {
        type Error = PayErr;
    }
    struct GwError<G: Gateway>(G::Error);
    impl<G: Gateway> IntoResponse for GwError<G> {
        fn into_response(self) -> Response {
            StatusCode::BAD_GATEWAY.into_response()
        }
    }
    impl<G: Gateway> Classify for GwError<G> {
        fn classify(&self) -> Classification {
            Classification::Store
        }
    }
    #[idempotent(scope = "payment.create")]
    async fn create<G: Gateway>(State(_g): State<G>, body: String) -> Result<impl IntoResponse, GwError<G>>
    where
        GwError<G>: Classify,
    {
        if body.is_empty() {
            return Err(GwError(todo!()));
        }
        Ok("ok")
    }
    pub fn main() {
        let _app: Router = Router::new().route("/a", post(create::<Stripe>)).with_state(Stripe);
    }
}

// G::Error where G: Store<Self>, in an inherent impl of a concrete type.
mod projected_parameter_bound_naming_self {
    use super::*;

    trait Store<Owner>: Clone + Send + Sync + 'static {
        type Error: IntoResponse + Send;
    }
    #[derive(Clone)]
    struct Mem;
    struct Svc;
    impl Store<Svc> for Mem {
        type Error = PayErr;
    }
    impl Svc {
        #[idempotent(scope = "payment.create")]
        async fn create<G: Store<Self>>(State(_g): State<G>, body: String) -> Result<impl IntoResponse, G::Error>
        where
            G::Error: Classify,
        {
            if body.is_empty() {
                return Err(todo!());
            }
            Ok("ok")
        }
    }
    pub fn main() {
        let _app: Router = Router::new().route("/a", post(Svc::create::<Mem>)).with_state(Mem);
    }
}

// G::Error where G: Gateway<T> and T is the impl block's parameter.
mod projected_parameter_bound_naming_the_impl_blocks_parameter {
    use super::*;

    trait Gateway<T>: Clone + Send + Sync + 'static {
        type Error: IntoResponse + Send;
    }
    #[derive(Clone)]
    struct Stripe;
    impl Gateway<u8> for Stripe {
        type Error = PayErr;
    }
    struct Svc<T>(PhantomData<T>);
    impl<T: Send + Sync + 'static> Svc<T> {
        #[idempotent(scope = "payment.create")]
        async fn create<G: Gateway<T>>(State(_g): State<G>, body: String) -> Result<impl IntoResponse, G::Error>
        where
            G::Error: Classify,
        {
            if body.is_empty() {
                return Err(todo!());
            }
            Ok("ok")
        }
    }
    pub fn main() {
        let _app: Router = Router::new().route("/a", post(Svc::<u8>::create::<Stripe>)).with_state(Stripe);
    }
}

// G::Error where G: Gateway<C> and Gateway's parameter is bounded (C: Currency).
mod projected_parameter_whose_trait_bounds_another {
    use super::*;

    trait Currency: Send + Sync + 'static {}
    impl Currency for u8 {}
    trait Gateway<C: Currency>: Clone + Send + Sync + 'static {
        type Error: IntoResponse + Send;
    }
    #[derive(Clone)]
    struct Stripe;
    impl Gateway<u8> for Stripe {
        type Error = PayErr;
    }
    #[idempotent(scope = "payment.create")]
    async fn create<C: Currency, G: Gateway<C>>(State(_g): State<G>, body: String) -> Result<impl IntoResponse, G::Error>
    where
        G::Error: Classify,
    {
        if body.is_empty() {
            return Err(todo!());
        }
        Ok("ok")
    }
    pub fn main() {
        let _app: Router = Router::new().route("/a", post(create::<u8, Stripe>)).with_state(Stripe);
    }
}

// `<Self as Handles<Self>>::Error` beside an `impl Trait`.
mod qualified_self_with_self_as_trait_argument {
    use super::*;

    trait Handles<T> {
        type Error;
    }
    struct Svc;
    impl Handles<Svc> for Svc {
        type Error = PayErr;
    }
    impl Svc {
        #[idempotent(scope = "payment.create")]
        async fn create(body: String) -> Result<impl IntoResponse, <Self as Handles<Self>>::Error> {
            if body.is_empty() {
                return Err(PayErr);
            }
            Ok("ok")
        }
    }
    pub fn main() {
        let _app: Router = Router::new().route("/a", post(Svc::create));
    }
}

fn main() {
    generic_error_named_by_a_where_bound_beside_an_impl_trait::main();
    generic_success_type_beside_a_classified_impl_trait::main();
    self_beside_an_impl_trait_in_an_impl_block::main();
    where_clause_naming_the_impl_blocks_parameter::main();
    parameter_bound_naming_the_impl_blocks_parameter::main();
    qualified_self_error_beside_an_impl_trait::main();
    self_in_a_bound_and_where_clause_beside_an_impl_trait::main();
    lifetime_and_type_parameters_beside_an_impl_trait::main();
    self_in_a_const_argument_beside_an_impl_trait::main();
    error_struct_with_a_bounded_parameter_beside_an_impl_trait::main();
    projected_parameter_bound_naming_self::main();
    projected_parameter_bound_naming_the_impl_blocks_parameter::main();
    projected_parameter_whose_trait_bounds_another::main();
    qualified_self_with_self_as_trait_argument::main();
}
