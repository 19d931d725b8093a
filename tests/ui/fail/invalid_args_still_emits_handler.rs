use axum::{routing::post, Router};
use idem::idempotent;

#[idempotent(scope = "payment.create", ttl = "forever")]
async fn create() -> &'static str {
    "created"
}

fn main() {
    // The handler still exists, so this line adds no second error.
    let _app: Router = Router::new().route("/payments", post(create));
}
