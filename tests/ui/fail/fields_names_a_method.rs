use axum::Json;
use idem::idempotent;

#[derive(serde::Deserialize, serde::Serialize)]
struct Payment {
    amount_minor: i64,
}

impl Payment {
    fn amount(&self) -> i64 {
        self.amount_minor
    }
}

// A method is not what the JSON carries: the error points at the name.
#[idempotent(scope = "payment.create", fields(amount))]
async fn create(Json(p): Json<Payment>) -> String {
    p.amount().to_string()
}

// What rustc's help suggests for the one above: refused with the fix.
#[idempotent(scope = "payment.update", fields(amount()))]
async fn update(Json(p): Json<Payment>) -> String {
    p.amount().to_string()
}

fn main() {}
