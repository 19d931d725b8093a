// A generic handler whose type parameter is not bounded `Send`: its future
// may not be sent between threads, and the error says which bound is
// missing and where to add it.
use axum::{routing::post, Json, Router};
use idem::idempotent;
use serde::de::DeserializeOwned;

#[derive(serde::Deserialize)]
struct PaymentIn<M> {
    amount: i64,
    metadata: M,
}

#[idempotent(scope = "payment.create", fields(amount))]
async fn create<M: DeserializeOwned + 'static>(Json(p): Json<PaymentIn<M>>) -> String {
    let _ = p.metadata;
    p.amount.to_string()
}

fn main() {
    let _app: Router = Router::new().route("/c", post(create::<serde_json::Value>));
}
