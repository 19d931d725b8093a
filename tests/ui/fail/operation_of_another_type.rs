// An extractor of the application's own named `Operation`: idem fills a
// parameter of a type of that name with its own, so it says so at the type.
use axum::Json;
use idem::idempotent;

mod audit {
    pub struct Operation(pub String);
    impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Operation {
        type Rejection = std::convert::Infallible;
        async fn from_request_parts(p: &mut axum::http::request::Parts, _: &S) -> Result<Self, Self::Rejection> {
            Ok(Operation(p.headers.get("x-op").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned()))
        }
    }
}

#[derive(serde::Deserialize, serde::Serialize)]
struct PaymentIn { amount: i64 }

#[idempotent(scope = "payment.create", fields(amount))]
async fn create(audit_op: audit::Operation, Json(p): Json<PaymentIn>) -> String { format!("{} {}", audit_op.0, p.amount) }

fn main() {
    let _app: axum::Router = axum::Router::new().route("/", axum::routing::post(create));
}
