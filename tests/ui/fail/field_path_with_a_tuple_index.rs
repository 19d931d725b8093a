use axum::Json;
use idem::idempotent;

#[derive(serde::Deserialize)]
struct PaymentIn {
    legs: (i64, i64),
}

#[idempotent(scope = "payment.create", fields(legs.0))]
async fn create(Json(p): Json<PaymentIn>) -> String {
    p.legs.0.to_string()
}

fn main() {}
