use axum::Json;
use idem::idempotent;

#[derive(serde::Deserialize, serde::Serialize)]
struct TransferIn {
    amount: i64,
    total: i64,
}

// The second field's own name is the first one's wire path.
#[idempotent(scope = "transfer.create", fields(total = "amount", amount))]
async fn create(Json(_t): Json<TransferIn>) {}

// The same, the other way round.
#[idempotent(scope = "transfer.update", fields(amount, total = "amount"))]
async fn update(Json(_t): Json<TransferIn>) {}

fn main() {}
