use idem::idempotent;

#[idempotent(scope = "transfer.create", header = "Content-Type")]
async fn create() {}

#[idempotent(scope = "transfer.update", header = "user-agent")]
async fn update() {}

fn main() {}
