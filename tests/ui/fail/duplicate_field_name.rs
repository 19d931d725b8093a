use axum::Json;
use idem::idempotent;

#[derive(serde::Deserialize, serde::Serialize)]
struct PaymentIn {
    amount: i64,
    currency: String,
}

#[idempotent(scope = "payment.create", fields(amount, currency, amount))]
async fn create(Json(_p): Json<PaymentIn>) {}

fn main() {}
