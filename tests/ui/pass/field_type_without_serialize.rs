#![deny(warnings)]

// A declared field's type need not be `Serialize`: the fingerprint reads the
// JSON the client sent, not the typed value.
use axum::Json;
use idem::idempotent;

#[allow(dead_code)]
struct Money(i64);

impl<'de> serde::Deserialize<'de> for Money {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        i64::deserialize(d).map(Money)
    }
}

#[derive(serde::Deserialize)]
struct PaymentIn {
    amount: Money,
}

#[idempotent(scope = "payment.create", fields(amount))]
async fn create(Json(p): Json<PaymentIn>) -> &'static str {
    let _ = p.amount;
    "created"
}

fn main() {
    let _app: axum::Router = axum::Router::new().route("/", axum::routing::post(create));
}
