#![deny(warnings)]

// An error type behind `impl Trait` bounded by a trait of the
// application's that has `idem::Classify` as a supertrait: the bounds carry
// `Classify`, which the macro cannot see, so it is let through.
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{routing::post, Router};
use idem::{idempotent, Classification, Classify};

pub trait AppError: IntoResponse + Classify {}

struct Declined;

impl IntoResponse for Declined {
    fn into_response(self) -> Response {
        StatusCode::BAD_GATEWAY.into_response()
    }
}

impl Classify for Declined {
    fn classify(&self) -> Classification {
        Classification::Store
    }
}

impl AppError for Declined {}

#[idempotent(scope = "payment.create")]
async fn create(_body: String) -> Result<String, impl AppError> {
    Err::<String, _>(Declined)
}

fn main() {
    let _app: Router = Router::new().route("/a", post(create));
}
