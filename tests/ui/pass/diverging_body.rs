#![deny(warnings)]

// A handler whose body never returns (a stub being written, a deliberate
// panic) compiles without warnings, as it would without the attribute.
use axum::{routing::post, Json, Router};
use idem::idempotent;

#[derive(serde::Deserialize, serde::Serialize)]
struct In {
    amount: i64,
}

#[idempotent(scope = "stub.create", fields(amount))]
async fn stub(Json(_p): Json<In>) -> String {
    todo!("not written yet")
}

#[idempotent(scope = "stub.panic")]
async fn panics() -> Result<String, String> {
    panic!("always")
}

#[idempotent(scope = "stub.unit")]
async fn unit() {
    unimplemented!()
}

fn main() {
    let _: Router = Router::new()
        .route("/a", post(stub))
        .route("/b", post(panics))
        .route("/c", post(unit));
}
