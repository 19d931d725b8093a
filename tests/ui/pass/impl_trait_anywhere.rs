#![deny(warnings)]

// `impl Trait` anywhere in the return type, as axum handlers write it.
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::{routing::post, Json, Router};
use idem::idempotent;

#[idempotent(scope = "a.create")]
async fn in_result(ok: axum::extract::Query<std::collections::HashMap<String, String>>) -> Result<impl IntoResponse, StatusCode> {
    if ok.is_empty() {
        return Err(StatusCode::BAD_REQUEST);
    }
    Ok("created")
}

#[idempotent(scope = "b.create")]
async fn in_json() -> Json<impl serde::Serialize> {
    Json(serde_json::json!({"id": 1}))
}

#[idempotent(scope = "c.create")]
async fn in_tuple() -> (StatusCode, impl IntoResponse) {
    (StatusCode::CREATED, "created")
}

#[idempotent(scope = "d.create")]
async fn in_axum_result() -> axum::response::Result<impl IntoResponse> {
    let n: u8 = "7".parse().map_err(|_| StatusCode::BAD_REQUEST)?;
    Ok(n.to_string())
}

#[idempotent(scope = "e.create")]
async fn with_use_bound() -> impl IntoResponse + use<> {
    "created"
}

fn main() {
    let _app: Router = Router::new()
        .route("/a", post(in_result))
        .route("/b", post(in_json))
        .route("/c", post(in_tuple))
        .route("/d", post(in_axum_result))
        .route("/e", post(with_use_bound));
}
