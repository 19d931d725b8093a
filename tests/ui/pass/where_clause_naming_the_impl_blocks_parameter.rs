// A handler in `impl<T> Svc<T>` with a `where` clause naming the impl's `T`,
// and an `impl Trait` success type with a concrete error. Compiles without
// the attribute.
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{routing::post, Router};
use idem::idempotent;
use std::marker::PhantomData;

struct PayErr;
impl IntoResponse for PayErr {
    fn into_response(self) -> Response {
        StatusCode::PAYMENT_REQUIRED.into_response()
    }
}

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

fn main() {
    let _app: Router = Router::new().route("/a", post(Svc::<u8>::create));
}
