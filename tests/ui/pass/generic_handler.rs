#![deny(warnings)]

// A generic handler, with and without `fields(...)`.
use axum::{routing::post, Json, Router};
use idem::idempotent;
use serde::de::DeserializeOwned;

#[derive(serde::Deserialize)]
struct PaymentIn<M> {
    amount: i64,
    metadata: M,
}

#[idempotent(scope = "payment.create", fields(amount))]
async fn create<M: DeserializeOwned + Send + 'static>(Json(p): Json<PaymentIn<M>>) -> String {
    let _ = p.metadata;
    p.amount.to_string()
}

#[idempotent(scope = "payment.whole")]
async fn whole<M: DeserializeOwned + Send + 'static>(Json(p): Json<PaymentIn<M>>) -> String {
    let _ = p.metadata;
    p.amount.to_string()
}

fn main() {
    let _app: Router = Router::new()
        .route("/c", post(create::<serde_json::Value>))
        .route("/w", post(whole::<serde_json::Value>));
}
