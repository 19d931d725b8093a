// `#[axum::debug_handler]` below `#[idempotent]` checks the handler the
// attribute generates, whose body parameter is idem's extractor around the
// handler's own: a body type that is not `Deserialize` is reported at that
// type (as `Raw<Json<In>>` not being an extractor), not at the attribute.
use axum::{routing::post, Json, Router};
use idem::idempotent;

struct In {
    amount: i64,
}

#[idempotent(scope = "payment.create")]
#[axum::debug_handler]
async fn create(Json(p): Json<In>) -> String {
    p.amount.to_string()
}

fn main() {
    let _app: Router = Router::new().route("/", post(create));
}
