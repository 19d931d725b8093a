use axum::{routing::post, Json, Router};
use idem::idempotent;

#[derive(serde::Deserialize, serde::Serialize)]
struct In {
    amount: i64,
}

#[axum::debug_handler]
#[idempotent(scope = "payment.create", fields(amount))]
async fn create(Json(p): Json<In>) -> String {
    p.amount.to_string()
}

fn main() {
    let _app: Router = Router::new().route("/", post(create));
}
