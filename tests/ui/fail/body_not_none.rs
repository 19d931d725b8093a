use idem::idempotent;

#[idempotent(scope = "payment.create", body = "raw")]
async fn create() {}

fn main() {}
