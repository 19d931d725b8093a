use axum::extract::State;
use axum::Json;
use idem::idempotent;

#[idempotent(scope = "payment.create")]
async fn create(Json(_p): Json<serde_json::Value>, State(_s): State<()>) {}

fn main() {}
