// An error type behind `impl Trait`: a `Classify` impl of the type behind
// it could not be seen, so its bounds must name `Classify`.
use axum::http::StatusCode;
use axum::response::IntoResponse;
use idem::idempotent;

#[idempotent(scope = "payment.create")]
async fn create(_body: String) -> Result<String, impl IntoResponse> {
    Err::<String, _>(StatusCode::BAD_GATEWAY)
}

#[idempotent(scope = "payment.update")]
async fn update(_body: String) -> axum::response::Result<String, impl IntoResponse + Send> {
    Err::<String, _>(StatusCode::BAD_GATEWAY)
}

fn main() {}
