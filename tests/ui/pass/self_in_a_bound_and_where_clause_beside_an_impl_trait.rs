// `Self` in a generic parameter's bound and in the `where` clause of a
// handler in a generic impl, beside an `impl Trait`.
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

fn main() {
    let _app: Router = Router::new().route("/a", post(Svc::create::<u8>));
}
