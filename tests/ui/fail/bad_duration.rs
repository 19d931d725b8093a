use idem::idempotent;

#[idempotent(scope = "payment.create", lock_timeout = "30 seconds")]
async fn create() {}

fn main() {}
