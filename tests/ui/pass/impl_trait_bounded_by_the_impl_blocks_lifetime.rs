#![deny(warnings)]

// A returned `impl Trait` bounded by a lifetime of the `impl` block (not
// the handler's own), alone and inside a `Result`, beside one of the
// handler's own; the handler's own lifetimes with their bounds; a raw
// lifetime naming one of them.
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

trait Two<'a, 'b: 'a> {}
impl<'a, 'b: 'a> Two<'a, 'b> for &'static str {}

#[idempotent(scope = "api.own_bounded", body = "none")]
async fn own_bounded<'a, 'b: 'a + 'static>() -> impl IntoResponse + Two<'a, 'b> {
    "own"
}

#[idempotent(scope = "api.raw", body = "none")]
async fn raw<'a>() -> impl IntoResponse + 'r#a {
    "raw"
}

fn main() {
    let _app: Router = Router::new()
        .route("/bounded", post(Api::<'static>::bounded))
        .route("/result", post(Api::<'static>::result))
        .route("/both", post(Api::<'static>::both))
        .route("/own", post(own_bounded))
        .route("/raw", post(raw));
}
