use idem::idempotent;

#[idempotent(scope = "payment.create", optional = true)]
async fn create(op: Option<idem::Operation>) -> String {
    format!("{}", op.is_some())
}

fn main() {}
