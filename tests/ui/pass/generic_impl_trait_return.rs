#![deny(warnings)]

// An `impl Trait` return type beside an error type that names the
// handler's generic parameter.
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{routing::post, Router};
use idem::{idempotent, Classification, Classify};

pub trait Repo: Send + Sync + 'static {
    type Error: IntoResponse + Send;
}

pub struct Unavailable;

impl IntoResponse for Unavailable {
    fn into_response(self) -> Response {
        StatusCode::SERVICE_UNAVAILABLE.into_response()
    }
}

impl Classify for Unavailable {
    fn classify(&self) -> Classification {
        Classification::Release
    }
}

pub struct Memory;

impl Repo for Memory {
    type Error = Unavailable;
}

#[idempotent(scope = "order.create")]
async fn create<R: Repo>(_body: String) -> Result<impl IntoResponse, R::Error>
where
    R::Error: Classify,
{
    Ok("saved")
}

fn main() {
    let _app: Router = Router::new().route("/orders", post(create::<Memory>));
}
