use axum::Json;
use idem::idempotent;

#[derive(serde::Deserialize)]
struct PaymentIn {
    amount: u64,
}

#[idempotent(scope = "payment.create", fields(amount))]
#[idempotent(scope = "payment.charge", fields(amount))]
async fn create(Json(p): Json<PaymentIn>) -> String {
    p.amount.to_string()
}

fn main() {}
