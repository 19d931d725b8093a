use axum::http::StatusCode;
use idem::idempotent;

// `err` below reads the generated function's answer, an HTTP response.
#[idempotent(scope = "payment.create")]
#[tracing::instrument(skip_all, err)]
async fn create() -> Result<String, StatusCode> {
    Ok(String::new())
}

fn main() {}
