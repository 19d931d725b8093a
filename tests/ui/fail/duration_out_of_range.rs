use idem::idempotent;

#[idempotent(scope = "payment.create", lock_timeout = "10ms", ttl = "400d")]
async fn create() {}

fn main() {}
