//! As many extractors as axum takes beside idem's own: 15 with a body, 14
//! without one.
use axum::http::{HeaderMap, Method, Uri};
use axum::{routing::post, Json, Router};
use idem::idempotent;

#[derive(serde::Deserialize)]
struct In {
    amount: i64,
}

#[idempotent(scope = "payment.create")]
async fn create(
    _a: Method, _b: Uri, _c: HeaderMap, _d: Method, _e: Uri,
    _f: HeaderMap, _g: Method, _h: Uri, _i: HeaderMap, _j: Method,
    _k: Uri, _l: HeaderMap, _m: Method, _n: Uri,
    Json(p): Json<In>,
) -> String {
    p.amount.to_string()
}

#[idempotent(scope = "payment.cancel", body = "none")]
async fn cancel(
    _a: Method, _b: Uri, _c: HeaderMap, _d: Method, _e: Uri,
    _f: HeaderMap, _g: Method, _h: Uri, _i: HeaderMap, _j: Method,
    _k: Uri, _l: HeaderMap, _m: Method, _n: Uri,
) -> String {
    String::new()
}

fn main() {
    let _: Router = Router::new().route("/", post(create)).route("/cancel", post(cancel));
}
