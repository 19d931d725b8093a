use idem::idempotent;

#[idempotent(scope = "payment.create", header = "Authorization")]
async fn create() {}

#[idempotent(scope = "payment.update", header = "cookie")]
async fn update() {}

fn main() {}
