// A nested field path through an `Option` member: a path names fields of
// structs only. Declare the `Option` member itself (`fields(recipient)`):
// its value, `null` or the object, is fingerprinted whole.
use axum::{routing::post, Json, Router};
use idem::idempotent;

#[derive(serde::Deserialize, serde::Serialize)]
struct Recipient {
    account: String,
}

#[derive(serde::Deserialize)]
struct PaymentIn {
    amount: i64,
    recipient: Option<Recipient>,
}

#[idempotent(scope = "payment.create", fields(amount, recipient.account))]
async fn create(Json(p): Json<PaymentIn>) -> String {
    p.amount.to_string()
}

fn main() {
    let _app: Router = Router::new().route("/c", post(create));
}
