//! Without a body idem also adds, last, an extractor that reads nothing:
//! 15 head extractors are one too many.
use axum::http::{HeaderMap, Method, Uri};
use axum::{routing::post, Router};
use idem::idempotent;

#[idempotent(scope = "payment.cancel", body = "none")]
async fn cancel(
    _a: Method, _b: Uri, _c: HeaderMap, _d: Method, _e: Uri,
    _f: HeaderMap, _g: Method, _h: Uri, _i: HeaderMap, _j: Method,
    _k: Uri, _l: HeaderMap, _m: Method, _n: Uri, _o: HeaderMap,
) -> String {
    String::new()
}

fn main() {
    let _: Router = Router::new().route("/", post(cancel));
}
