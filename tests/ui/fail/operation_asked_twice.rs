use idem::{idempotent, Operation};

#[idempotent(scope = "payment.create")]
async fn create(_first: Operation, _second: Operation) {}

fn main() {}
