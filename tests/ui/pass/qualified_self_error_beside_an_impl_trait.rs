// `<Self as Gateway>::Error` beside an `impl Trait` in an inherent impl of a
// concrete type: a concrete error type.
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{routing::post, Router};
use idem::idempotent;

struct PayErr;
impl IntoResponse for PayErr {
    fn into_response(self) -> Response {
        StatusCode::PAYMENT_REQUIRED.into_response()
    }
}

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

fn main() {
    let _app: Router = Router::new().route("/a", post(Stripe::create));
}
