#![deny(warnings)]

// An early `return` of a value under an `impl Trait` return type, bare or
// in a `Result`, as without the attribute: the `return` ends the handler's
// own block, with the value's own type.
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::{routing::post, Json, Router};
use idem::idempotent;

#[derive(serde::Deserialize)]
struct In {
    amount: i64,
}

#[idempotent(scope = "a.create")]
async fn early_return(Json(p): Json<In>) -> impl IntoResponse {
    if p.amount <= 0 {
        return (StatusCode::UNPROCESSABLE_ENTITY, "bad amount");
    }
    (StatusCode::CREATED, "created")
}

#[idempotent(scope = "b.create")]
async fn early_ok(Json(p): Json<In>) -> Result<impl IntoResponse, StatusCode> {
    if p.amount == 0 {
        return Ok("nothing to do");
    }
    if p.amount < 0 {
        return Err(StatusCode::BAD_REQUEST);
    }
    let parsed: i64 = "7".parse().map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    Ok(if parsed == p.amount { "seven" } else { "created" })
}

fn main() {
    let _app: Router = Router::new()
        .route("/a", post(early_return))
        .route("/b", post(early_ok));
}
