use idem::idempotent;

#[idempotent(scope = "payment.create")]
fn create() {}

fn main() {}
