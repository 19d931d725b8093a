use idem::idempotent;

#[idempotent(scope = "Payment Create")]
async fn create() {}

fn main() {}
