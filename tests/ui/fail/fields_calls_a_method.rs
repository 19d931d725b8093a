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

// What rustc's help suggests for `fields(amount)` when `amount` is a method
// (see `fields_names_a_method.rs`): refused with the fix.
#[idempotent(scope = "payment.create", fields(amount()))]
async fn create(Json(p): Json<Payment>) -> String {
    p.amount().to_string()
}

fn main() {}
