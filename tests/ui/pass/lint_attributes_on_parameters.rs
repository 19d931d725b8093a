#![deny(warnings)]

// Lint attributes on parameters hold as they do without the attribute.
use axum::http::{HeaderMap, Method, Uri};
use axum::{routing::post, Router};
use idem::{idempotent, Operation};

#[idempotent(scope = "payment.create")]
async fn create(#[allow(unused_variables)] op: Operation, #[allow(unused_mut)] mut body: String) -> String {
    body
}

#[idempotent(scope = "payment.update")]
async fn update(#[expect(unused_mut)] mut body: String) -> String {
    body
}

// A handler without a body with as many head extractors as axum takes
// beside idem's two (its context first, and last the extractor that reads
// nothing).
#[idempotent(scope = "payment.head", body = "none")]
#[allow(clippy::too_many_arguments)]
async fn head(
    _a: HeaderMap, _b: Method, _c: Uri, _d: HeaderMap, _e: Method, _f: Uri, _g: HeaderMap, _h: Method,
    _i: Uri, _j: HeaderMap, _k: Method, _l: Uri, _m: HeaderMap, _n: Method,
) -> &'static str {
    "ok"
}

fn main() {
    let _app: Router = Router::new()
        .route("/payments", post(create))
        .route("/update", post(update))
        .route("/head", post(head));
}
