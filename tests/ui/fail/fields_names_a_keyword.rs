use idem::idempotent;

#[derive(serde::Deserialize, serde::Serialize)]
struct In {
    r#type: String,
}

// A field named by a keyword is written as Rust writes it, `r#type`.
#[idempotent(scope = "payment.create", fields(type))]
async fn create(axum::Json(_b): axum::Json<In>) {}

fn main() {}
