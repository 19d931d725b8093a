#![deny(warnings)]
// `extern "Rust"` is the Rust ABI written out: a plain, safe Rust function.
use axum::{routing::post, Router};
use idem::idempotent;

#[idempotent(scope = "abi.rust")]
async extern "Rust" fn rust_abi(body: String) -> String {
    body
}

fn main() {
    let _app: Router = Router::new().route("/r", post(rust_abi));
}
