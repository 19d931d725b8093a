// idem knows its `Operation` by that name: renamed, it is taken for the
// body, and the error says what to write.
use idem::idempotent;
use idem::Operation as Op;

#[idempotent(scope = "payment.create")]
async fn create(op: Op) -> String {
    op.attempt().to_string()
}

fn main() {}
