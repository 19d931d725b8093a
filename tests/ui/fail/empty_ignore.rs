use idem::idempotent;

#[idempotent(scope = "payment.create", ignore(""))]
async fn create() {}

fn main() {}
