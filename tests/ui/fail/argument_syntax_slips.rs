use idem::idempotent;

#[idempotent("payment.create")]
async fn positional() {}

#[idempotent(scope = "payment.strs", fields("amount"))]
async fn string_fields(axum::Json(_p): axum::Json<serde_json::Value>) {}

#[idempotent(scope = "payment.ign", ignore(page))]
async fn ident_ignore() {}

#[idempotent(scope = "payment.body", body = none)]
async fn body_ident() {}

#[idempotent(scope = "payment.path", fields(recipient::account))]
async fn colon_path(axum::Json(_p): axum::Json<serde_json::Value>) {}

#[idempotent(scope = "payment.opt", optional())]
async fn optional_parens() {}

#[idempotent(scope = "payment.ttl", ttl = 30)]
async fn ttl_number() {}

fn main() {}
