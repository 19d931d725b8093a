use idem::idempotent;

#[derive(serde::Deserialize, serde::Serialize)]
struct In {
    amount: u64,
}

// rustc refuses a suffix on a string literal everywhere else; its value
// would drop it.
#[idempotent(scope = "payment.create"suffix, ttl = "5s"ms, header = "X-Key"h)]
async fn create() {}

#[idempotent(scope = "payment.wire", fields(amount = "amt"x), ignore("page"p))]
async fn wire(axum::Json(_b): axum::Json<In>) {}

fn main() {}
