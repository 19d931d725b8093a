#![deny(warnings)]

// Lint attributes on parameters hold as they do without the attribute.
use axum::{routing::post, Router};
use idem::{idempotent, Operation};

#[idempotent(scope = "payment.create")]
async fn create(#[allow(unused_variables)] op: Operation, #[allow(unused_mut)] mut body: String) -> String {
    body
}

fn main() {
    let _app: Router = Router::new().route("/payments", post(create));
}
