use idem::idempotent;

#[idempotent(scope = "payment.create", crate = "not a path")]
async fn create() {}

fn main() {}
