#![deny(warnings)]

use axum::{response::IntoResponse, routing::post, Router};
use idem::idempotent;

#[idempotent(scope = "ping.create")]
async fn ping() -> impl IntoResponse {
    "pong"
}

#[idempotent(scope = "nothing.create")]
async fn nothing() {}

fn main() {
    let _app: Router = Router::new().route("/ping", post(ping)).route("/nothing", post(nothing));
}
