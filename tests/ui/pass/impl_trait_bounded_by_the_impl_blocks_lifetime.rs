#![deny(warnings)]

// A returned `impl Trait` bounded by a lifetime of the `impl` block (not
// the handler's own), alone and inside a `Result`, beside one of the
// handler's own.
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::{routing::post, Router};
use idem::idempotent;
use std::marker::PhantomData;

struct Api<'a>(PhantomData<&'a ()>);

impl<'a> Api<'a> {
    #[idempotent(scope = "api.bounded", body = "none")]
    async fn bounded() -> impl IntoResponse + 'a {
        "bounded"
    }

    #[idempotent(scope = "api.result", body = "none")]
    async fn result() -> Result<impl IntoResponse + 'a, StatusCode> {
        Ok("result")
    }

    #[idempotent(scope = "api.both", body = "none")]
    async fn both<'b>() -> impl IntoResponse + 'a + 'b {
        "both"
    }
}

fn main() {
    let _app: Router = Router::new()
        .route("/bounded", post(Api::<'static>::bounded))
        .route("/result", post(Api::<'static>::result))
        .route("/both", post(Api::<'static>::both));
}
