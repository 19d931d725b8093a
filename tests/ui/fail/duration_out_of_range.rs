use idem::idempotent;

#[idempotent(scope = "payment.create", lock_timeout = "10ms", ttl = "400d", wait = "2h")]
async fn create() {}

fn main() {}
