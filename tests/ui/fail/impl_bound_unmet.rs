// An answer that does not meet a bound of the declared `impl Trait`: the
// error points at the declared type, as without the attribute.
use axum::response::{IntoResponse, Response};
use idem::idempotent;

#[idempotent(scope = "payment.create")]
async fn create(_body: String) -> impl IntoResponse + Clone {
    Response::new(axum::body::Body::empty())
}

fn main() {}
