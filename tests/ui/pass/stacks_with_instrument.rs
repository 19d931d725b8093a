#![deny(warnings)]

use axum::{routing::post, Json, Router};
use idem::idempotent;

#[derive(Debug, serde::Deserialize, serde::Serialize)]
struct OrderIn {
    sku: String,
}

#[tracing::instrument(skip_all)]
#[idempotent(scope = "order.create", fields(sku))]
async fn outer_instrument(Json(order): Json<OrderIn>) -> String {
    order.sku
}

#[idempotent(scope = "order.update", fields(sku))]
#[tracing::instrument(skip_all)]
async fn inner_instrument(Json(order): Json<OrderIn>) -> String {
    order.sku
}

// `ret` records the answer: below the attribute it sees the function the
// attribute generates (its parameters are idem's, it returns a `Response`),
// so only `skip_all` fits there (README).
#[idempotent(scope = "order.replace", fields(sku))]
#[tracing::instrument(skip_all, ret)]
async fn inner_instrument_ret(Json(order): Json<OrderIn>) -> String {
    order.sku
}

#[tracing::instrument(skip_all, ret)]
#[idempotent(scope = "order.delete", fields(sku))]
async fn outer_instrument_ret(Json(order): Json<OrderIn>) -> String {
    order.sku
}

fn main() {
    let _app: Router = Router::new()
        .route("/a", post(outer_instrument))
        .route("/b", post(inner_instrument))
        .route("/c", post(inner_instrument_ret))
        .route("/d", post(outer_instrument_ret));
}
