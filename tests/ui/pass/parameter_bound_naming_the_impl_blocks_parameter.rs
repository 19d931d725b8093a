// A generic handler in `impl<T> Svc<T>` whose own parameter's bound names
// the impl's `T`; the answer hides its success type.
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
    async fn create<G: From<T> + Send + 'static>(body: String) -> Result<impl IntoResponse, PayErr> {
        if body.is_empty() {
            return Err(PayErr);
        }
        Ok("ok")
    }
}

fn main() {
    let _app: Router = Router::new().route("/a", post(Svc::<u8>::create::<u16>));
}
