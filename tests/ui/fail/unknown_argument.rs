use idem::idempotent;

#[idempotent(scope = "payment.create", retries = 3)]
async fn create() {}

fn main() {}
