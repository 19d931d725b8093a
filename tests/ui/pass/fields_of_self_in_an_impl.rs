#![deny(warnings)]

// `fields(...)` on a handler in an `impl` block whose body type is `Self`.
use axum::{routing::post, Json, Router};
use idem::idempotent;

#[derive(serde::Deserialize, serde::Serialize)]
struct Payment {
    amount: i64,
}

impl Payment {
    #[idempotent(scope = "payment.create", fields(amount))]
    async fn create(Json(p): Json<Self>) -> String {
        p.amount.to_string()
    }
}

fn main() {
    let _app: Router = Router::new().route("/payments", post(Payment::create));
}
