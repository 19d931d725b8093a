#![deny(warnings)]

use axum::{routing::post, Json, Router};
use idem::{idempotent, Operation};

#[derive(serde::Deserialize, serde::Serialize)]
struct MessageIn {
    to: String,
    text: String,
}

// No `fields(...)`: the whole body counts. Without a key it runs unprotected.
#[idempotent(scope = "message.send", optional, header = "X-Request-Id")]
async fn send(op: Option<Operation>, Json(m): Json<MessageIn>) -> String {
    format!("{} {} {}", m.to, m.text, op.map_or(0, |op| op.attempt()))
}

fn main() {
    let _app: Router = Router::new().route("/messages", post(send));
}
