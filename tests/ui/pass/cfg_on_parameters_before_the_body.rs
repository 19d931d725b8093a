// Parameters before the body may come and go under `cfg` (directly or
// through `cfg_attr`): the body stays the body. The `Operation` too.
use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Operation};

#[derive(serde::Deserialize)]
struct PaymentIn {
    amount: u64,
}

#[idempotent(scope = "payment.create", fields(amount))]
async fn create(
    #[cfg(any())] State(s): State<u64>,
    #[cfg_attr(all(), cfg(any()))] op: Operation,
    #[cfg(all())] State(t): State<u64>,
    Json(p): Json<PaymentIn>,
) -> String {
    format!("{t} {}", p.amount)
}

fn main() {
    let _: Router = Router::new().route("/payments", post(create)).with_state(1u64);
}
