#![deny(warnings)]

// A crate that re-exports idem under another name.
mod reexport {
    pub use idem as engine;
}

use axum::{routing::post, Router};

#[idem::idempotent(scope = "payment.create", crate = "crate::reexport::engine")]
async fn create() -> &'static str {
    "created"
}

fn main() {
    let _app: Router = Router::new().route("/payments", post(create));
}
