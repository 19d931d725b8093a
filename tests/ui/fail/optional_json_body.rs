use axum::Json;
use idem::idempotent;

#[idempotent(scope = "payment.create")]
async fn create(_p: Option<Json<serde_json::Value>>) {}

fn main() {}
