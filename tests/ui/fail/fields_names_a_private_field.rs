use axum::Json;
use idem::idempotent;

mod dto {
    #[derive(serde::Deserialize, serde::Serialize)]
    pub struct Payment {
        amount: i64,
    }

    impl Payment {
        pub fn amount(&self) -> i64 {
            self.amount
        }
    }
}

// The handler reads what it can see: a private field cannot be declared.
#[idempotent(scope = "payment.create", fields(amount))]
async fn create(Json(p): Json<dto::Payment>) -> String {
    p.amount().to_string()
}

fn main() {}
