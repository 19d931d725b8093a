use idem::idempotent;

#[idempotent(scope = "payment.create", header = "Idempotency Key")]
async fn create() {}

fn main() {}
