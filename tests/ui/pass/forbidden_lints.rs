// A crate that forbids the unused lints (no `#[allow]` can lift them): the
// expansion allows none, so every handler shape still compiles.
#![deny(warnings)]
#![forbid(unused_imports, unused_braces, unused_mut, unused_variables)]

use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::Json;
use idem::{idempotent, Classification, Classify, Operation};

struct Money(i64);

impl<'de> serde::Deserialize<'de> for Money {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        i64::deserialize(d).map(Money)
    }
}

#[derive(serde::Deserialize)]
struct PaymentIn {
    amount: Money,
    currency: String,
}

enum PaymentError {
    Declined,
}

impl IntoResponse for PaymentError {
    fn into_response(self) -> axum::response::Response {
        StatusCode::PAYMENT_REQUIRED.into_response()
    }
}

impl Classify for PaymentError {
    fn classify(&self) -> Classification {
        Classification::Reject
    }
}

// Fields of both kinds (`Serialize` and not), a `Result` whose error
// classifies itself.
#[idempotent(scope = "payment.create", fields(amount, currency))]
async fn create(op: Operation, Json(p): Json<PaymentIn>) -> Result<String, PaymentError> {
    if p.amount.0 < 0 {
        return Err(PaymentError::Declined);
    }
    Ok(format!("{} {} {}", op.attempt(), p.amount.0, p.currency))
}

// No key needed, a type classified by its status, an `impl Trait` answer.
#[idempotent(scope = "payment.list", optional)]
async fn list(op: Option<Operation>) -> impl IntoResponse {
    (StatusCode::OK, format!("{}", op.is_some()))
}

fn main() {
    let _app: axum::Router = axum::Router::new()
        .route("/", axum::routing::post(create))
        .route("/list", axum::routing::post(list));
}
