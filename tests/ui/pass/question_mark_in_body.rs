#![deny(warnings)]

use axum::{http::StatusCode, routing::post, Json, Router};
use idem::idempotent;

#[derive(serde::Deserialize, serde::Serialize)]
struct PaymentIn {
    amount: i64,
}

fn parse(amount: i64) -> Result<u64, StatusCode> {
    u64::try_from(amount).map_err(|_| StatusCode::UNPROCESSABLE_ENTITY)
}

#[idempotent(scope = "payment.create", fields(amount))]
async fn create(Json(p): Json<PaymentIn>) -> Result<String, StatusCode> {
    let amount = parse(p.amount)?;
    if amount == 0 {
        return Err(StatusCode::BAD_REQUEST);
    }
    Ok(amount.to_string())
}

fn main() {
    let _app: Router = Router::new().route("/payments", post(create));
}
