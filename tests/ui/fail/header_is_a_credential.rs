use idem::idempotent;

#[idempotent(scope = "payment.create", header = "Authorization")]
async fn create() {}

#[idempotent(scope = "payment.update", header = "cookie")]
async fn update() {}

#[idempotent(scope = "payment.cancel", header = "X-API-Key")]
async fn cancel() {}

fn main() {}
