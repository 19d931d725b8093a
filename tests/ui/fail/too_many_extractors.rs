//! axum takes 16 extractors, and idem adds its context: 16 of the
//! handler's own are one too many, refused at the sixteenth.
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
    _k: Uri, _l: HeaderMap, _m: Method, _n: Uri, _o: HeaderMap,
    Json(p): Json<In>,
) -> String {
    p.amount.to_string()
}

fn main() {
    let _: Router = Router::new().route("/", post(create));
}
