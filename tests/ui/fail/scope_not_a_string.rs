use idem::idempotent;

#[idempotent(scope = payment.create)]
async fn create() {}

fn main() {}
