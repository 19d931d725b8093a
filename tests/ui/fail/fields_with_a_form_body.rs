use axum::Form;
use idem::idempotent;

#[derive(serde::Deserialize)]
struct Signup {
    email: String,
}

#[idempotent(scope = "signup.create", fields(email))]
async fn signup(Form(s): Form<Signup>) -> String {
    s.email
}

fn main() {}
