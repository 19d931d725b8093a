#![deny(warnings)]

use axum::extract::State;
use axum::{routing::post, Json, Router};
use idem::{idempotent, Operation};

#[derive(serde::Deserialize, serde::Serialize)]
struct PaymentIn {
    amount: u64,
}

#[derive(Clone)]
struct App;

// `#[axum::debug_handler]` goes below the attribute, where it checks the
// handler the attribute generates (see
// tests/ui/fail/debug_handler_body_not_deserialize.rs); above it, it would
// check a signature the attribute then rewrites (README).
#[idempotent(scope = "payment.create", fields(amount))]
#[axum::debug_handler]
async fn create(State(_app): State<App>, op: Operation, Json(p): Json<PaymentIn>) -> String {
    format!("{} {}", op.attempt(), p.amount)
}

#[idempotent(scope = "payment.refresh")]
#[axum::debug_handler]
async fn refresh(State(_app): State<App>) -> &'static str {
    "refreshed"
}

fn main() {
    let _app: Router = Router::new()
        .route("/payments", post(create))
        .route("/refresh", post(refresh))
        .with_state(App);
}
