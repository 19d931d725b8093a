#![deny(warnings)]

use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::{routing::post, Extension, Json, Router};
use idem::{idempotent, Operation};

#[derive(Clone)]
struct App;

#[derive(serde::Deserialize, serde::Serialize)]
struct Recipient {
    account: String,
}

#[derive(serde::Deserialize, serde::Serialize)]
struct RefundIn {
    amount: i64,
    recipient: Recipient,
    comment: Option<String>,
}

#[derive(serde::Deserialize)]
struct Opts {
    dry_run: Option<bool>,
}

/// Refunds a payment.
///
/// Doc comments stay on the generated handler.
#[idempotent(scope = "refund.create", fields(amount, recipient.account), ttl = "2h", lock_timeout = "30s", wait = "1s")]
pub async fn refund(
    State(_app): State<App>,
    Path(payment_id): Path<String>,
    Query(opts): Query<Opts>,
    Extension(region): Extension<String>,
    _headers: HeaderMap,
    op: Operation,
    Json(body): Json<RefundIn>,
) -> Json<serde_json::Value> {
    Json(serde_json::json!({
        "payment": payment_id,
        "amount": body.amount,
        "dry_run": opts.dry_run,
        "region": region,
        "attempt": op.attempt(),
        "comment": body.comment,
    }))
}

fn main() {
    let _app: Router = Router::new()
        .route("/payments/{id}/refunds", post(refund))
        .with_state(App);
}
