// The error type is a struct whose parameter is bounded (it holds G::Error).
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
fn main() {
    let _app: Router = Router::new().route("/a", post(create::<Stripe>)).with_state(Stripe);
}
