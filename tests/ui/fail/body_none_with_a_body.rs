use axum::Json;
use idem::idempotent;

#[idempotent(scope = "payment.create", body = "none")]
async fn create(Json(_p): Json<serde_json::Value>) {}

fn main() {}
