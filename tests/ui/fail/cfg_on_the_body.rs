use axum::Json;
use idem::idempotent;

#[derive(serde::Deserialize)]
struct PaymentIn {
    amount: u64,
}

#[idempotent(scope = "payment.create")]
async fn create(#[cfg(any())] axum::extract::State(s): axum::extract::State<u64>, Json(p): Json<PaymentIn>) -> String {
    p.amount.to_string()
}

fn main() {}
