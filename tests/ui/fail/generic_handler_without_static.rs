// A generic handler whose type parameter is not bounded `'static`: the
// execution runs in a task of its own, detached from the connection, so
// the handler's future must not borrow; the error says which bound is
// missing and where to add it (the same handler without the attribute
// compiles, as axum asks for `'static` only where it is routed).
use axum::extract::State;
use axum::{routing::post, Router};
use idem::idempotent;

#[idempotent(scope = "state.read", body = "none")]
async fn read<S: Clone + Send + Sync + std::fmt::Debug>(State(s): State<S>) -> String {
    format!("{s:?}")
}

fn main() {
    let _app: Router = Router::new().route("/r", post(read::<u8>)).with_state(1u8);
}
