// `<Self as Handles<Self>>::Error` beside an `impl Trait`.
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{routing::post, Router};
use idem::{idempotent, Classification, Classify};
use std::marker::PhantomData;

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
fn main() {
    let _app: Router = Router::new().route("/a", post(Svc::create));
}
