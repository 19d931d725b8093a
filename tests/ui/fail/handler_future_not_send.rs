// A handler whose future is not `Send` (an `Rc` held across an await): the
// error points at the value held and the await.
use axum::{routing::post, Json, Router};
use idem::idempotent;
use std::rc::Rc;

#[derive(serde::Deserialize)]
struct PaymentIn {
    amount: i64,
}

#[idempotent(scope = "payment.create", fields(amount))]
async fn create(Json(p): Json<PaymentIn>) -> String {
    let shared = Rc::new(p.amount);
    tokio::task::yield_now().await;
    shared.to_string()
}

fn main() {
    let _app: Router = Router::new().route("/pay", post(create));
}
