use idem::idempotent;

#[idempotent = "payment.create"]
async fn create() {}

fn main() {}
