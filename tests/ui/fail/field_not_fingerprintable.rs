use axum::Json;
use idem::idempotent;

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
async fn create(Json(_p): Json<PaymentIn>) {}

fn main() {}
