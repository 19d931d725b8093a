//! Handlers that are associated functions, with the default key header and
//! with one of their own: the attribute emits no item beside the handler,
//! so both compile inside an `impl` block.
use axum::http::StatusCode;
use axum::routing::post;
use idem::idempotent;

struct Payments;

impl Payments {
    #[idempotent(scope = "p.impl")]
    async fn create(body: String) -> (StatusCode, String) {
        (StatusCode::CREATED, body)
    }

    #[idempotent(scope = "p.impl.custom", header = "X-Key")]
    async fn create_with_own_header(body: String) -> (StatusCode, String) {
        (StatusCode::CREATED, body)
    }
}

fn main() {
    let _ = axum::Router::<()>::new()
        .route("/p", post(Payments::create))
        .route("/q", post(Payments::create_with_own_header));
}
