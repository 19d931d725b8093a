use axum::Json;
use idem::idempotent;

#[derive(serde::Deserialize)]
struct PaymentIn {
    amount: i64,
}

#[idempotent(scope = "payment.create", fields = "amount")]
async fn create(Json(p): Json<PaymentIn>) -> String {
    p.amount.to_string()
}

#[idempotent(scope = "payment.list", ignore = "page")]
async fn list() -> String {
    String::new()
}

fn main() {}
