use axum::extract::rejection::JsonRejection;
use axum::Json;
use idem::idempotent;

#[idempotent(scope = "payment.create")]
async fn create(_p: Result<Json<serde_json::Value>, JsonRejection>) {}

fn main() {}
