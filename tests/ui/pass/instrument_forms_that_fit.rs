#![deny(warnings)]

use axum::{routing::post, Json, Router};
use idem::idempotent;
use tracing::instrument;

#[derive(Debug, serde::Deserialize, serde::Serialize)]
struct In {
    sku: String,
}

#[idempotent(scope = "a.a", fields(sku))]
#[::tracing::instrument(skip_all)]
async fn a(Json(o): Json<In>) -> String {
    o.sku
}

#[idempotent(scope = "a.b", fields(sku))]
#[instrument(skip_all, fields(x = 1))]
async fn b(Json(o): Json<In>) -> String {
    o.sku
}

#[idempotent(scope = "a.c", fields(sku))]
#[tracing::instrument(level = "info", name = "c", skip_all)]
async fn c(Json(o): Json<In>) -> String {
    o.sku
}

#[idempotent(scope = "a.d", fields(sku))]
#[cfg_attr(all(), tracing::instrument(skip_all))]
async fn d(Json(o): Json<In>) -> String {
    o.sku
}

#[idempotent(scope = "a.e", fields(sku))]
#[cfg_attr(any(), tracing::instrument)]
async fn e(Json(o): Json<In>) -> String {
    o.sku
}

#[tracing::instrument]
#[idempotent(scope = "a.f", fields(sku))]
async fn f(Json(o): Json<In>) -> String {
    o.sku
}

#[instrument(fields(extra = 1))]
#[idempotent(scope = "a.g", fields(sku))]
async fn g(Json(o): Json<In>) -> String {
    o.sku
}

fn main() {
    let _app: Router = Router::new()
        .route("/a", post(a))
        .route("/b", post(b))
        .route("/c", post(c))
        .route("/d", post(d))
        .route("/e", post(e))
        .route("/f", post(f))
        .route("/g", post(g));
}
