use idem::idempotent;

type Body = axum::Json<serde_json::Value>;

#[idempotent(scope = "payment.create")]
async fn create(axum::Json(_p): Body) {}

fn main() {}
