#![deny(warnings)]

// Every body idem can see, wire names for declared fields, ignored query
// names, and a last parameter that reads no body.
use axum::extract::{FromRequestParts, Path};
use axum::http::request::Parts;
use axum::{body::Bytes, routing::post, Form, Json, Router};
use idem::idempotent;

#[derive(serde::Deserialize)]
struct PaymentIn {
    #[serde(rename = "amount")]
    amount_minor: i64,
    r#type: String,
}

#[idempotent(scope = "payment.create", fields(amount_minor = "amount", r#type), ignore("utm_source"))]
async fn wire_names(Path(id): Path<String>, Json(p): Json<PaymentIn>) -> String {
    format!("{id} {} {}", p.amount_minor, p.r#type)
}

#[idempotent(scope = "payment.whole")]
async fn whole(Json(p): Json<serde_json::Value>) -> String {
    p.to_string()
}

#[idempotent(scope = "message.text")]
async fn text(body: String) -> String {
    body
}

#[idempotent(scope = "message.bytes")]
async fn bytes(body: Bytes) -> Vec<u8> {
    body.to_vec()
}

#[derive(serde::Deserialize)]
struct Signup {
    email: String,
}

#[idempotent(scope = "signup.create")]
async fn form(Form(s): Form<Signup>) -> String {
    s.email
}

/// An extractor of the application's own that reads only the request head.
struct Caller(String);

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = std::convert::Infallible;
    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(Caller(parts.uri.path().to_owned()))
    }
}

#[idempotent(scope = "ping.create", body = "none")]
async fn head_only(Caller(who): Caller) -> String {
    who
}

fn main() {
    let _app: Router = Router::new()
        .route("/p/{id}", post(wire_names))
        .route("/w", post(whole))
        .route("/t", post(text))
        .route("/b", post(bytes))
        .route("/f", post(form))
        .route("/h", post(head_only));
}
