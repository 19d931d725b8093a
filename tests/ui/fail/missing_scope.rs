use idem::idempotent;

#[idempotent(fields(amount))]
async fn create(axum::Json(_p): axum::Json<serde_json::Value>) {}

fn main() {}
