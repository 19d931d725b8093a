use idem::idempotent;

#[idempotent(scope = "payment.create", scope = "payment.update")]
async fn create() {}

fn main() {}
