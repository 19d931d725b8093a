use axum::Json;
use idem::idempotent;

#[derive(serde::Deserialize, serde::Serialize)]
struct PaymentIn {
    amount: i64,
}

#[idempotent(scope = "payment.create", fields())]
async fn create(Json(_p): Json<PaymentIn>) {}

fn main() {}
