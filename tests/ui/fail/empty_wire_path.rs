use axum::Json;
use idem::idempotent;

#[derive(serde::Deserialize)]
struct PaymentIn {
    amount: i64,
}

#[idempotent(scope = "payment.create", fields(amount = "recipient..acct"))]
async fn create(Json(p): Json<PaymentIn>) -> String {
    p.amount.to_string()
}

fn main() {}
