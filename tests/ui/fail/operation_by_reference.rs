//! The `Operation` is handed over to the handler: a reference to it is
//! refused at its type.
use axum::{routing::post, Json, Router};
use idem::{idempotent, Operation};

#[derive(serde::Deserialize)]
struct In {
    amount: i64,
}

#[idempotent(scope = "payment.create")]
async fn create(op: &Operation, Json(p): Json<In>) -> String {
    format!("{} {}", op.key(), p.amount)
}

fn main() {
    let _: Router = Router::new().route("/", post(create));
}
