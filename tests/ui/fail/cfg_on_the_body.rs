// Which parameter is the body, which the fingerprint reads, depends on
// `cfg`, which is evaluated after the attribute reads the parameters:
// `#[cfg]` on the body, directly or through `cfg_attr` (nested too, with a
// `true` predicate, raw names), or on the last parameter, which is the
// body's place, is an error at it.
use axum::Json;
use idem::idempotent;

#[derive(serde::Deserialize)]
struct PaymentIn {
    amount: u64,
}

#[idempotent(scope = "payment.create")]
async fn create(#[cfg(not(test))] Json(p): Json<PaymentIn>) -> String {
    p.amount.to_string()
}

#[idempotent(scope = "payment.update")]
async fn update(s: String, #[cfg_attr(all(), cfg(any()))] Json(p): Json<PaymentIn>) -> String {
    format!("{s}{}", p.amount)
}

#[idempotent(scope = "payment.refund")]
async fn refund(#[cfg_attr(all(), cfg_attr(all(), cfg(any())))] Json(p): Json<PaymentIn>) -> String {
    p.amount.to_string()
}

#[idempotent(scope = "payment.cancel")]
async fn cancel(Json(p): Json<PaymentIn>, #[cfg(any())] axum::extract::Query(q): axum::extract::Query<Vec<(String, String)>>) -> String {
    format!("{}{}", p.amount, q.len())
}

#[idempotent(scope = "payment.capture")]
async fn capture(s: String, #[cfg_attr(true, cfg(false))] Json(p): Json<PaymentIn>) -> String {
    format!("{s}{}", p.amount)
}

#[idempotent(scope = "payment.void")]
async fn void(#[r#cfg(not(all()))] Json(p): Json<PaymentIn>) -> String {
    p.amount.to_string()
}

#[idempotent(scope = "payment.settle")]
async fn settle(#[r#cfg_attr(all(), r#cfg(any()))] Json(p): Json<PaymentIn>) -> String {
    p.amount.to_string()
}

fn main() {}
