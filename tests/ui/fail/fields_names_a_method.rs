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
// (rustc's help to add `()` leads to `fields_calls_a_method.rs`'s error,
// which names the fix.)
#[idempotent(scope = "payment.create", fields(amount))]
async fn create(Json(p): Json<Payment>) -> String {
    p.amount().to_string()
}

fn main() {}
