// G::Error where G: Gateway<T> and T is the impl block's parameter.
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
fn main() {
    let _app: Router = Router::new().route("/a", post(Svc::<u8>::create::<Stripe>)).with_state(Stripe);
}
