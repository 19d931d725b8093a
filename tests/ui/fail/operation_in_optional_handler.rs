use idem::{idempotent, Operation};

#[idempotent(scope = "payment.create", optional)]
async fn create(op: Operation) -> String {
    op.key().to_owned()
}

fn main() {}
