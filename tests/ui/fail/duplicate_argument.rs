use idem::idempotent;

#[idempotent(scope = "payment.create", scope = "payment.update")]
async fn create() {}

#[idempotent(scope = "payment.refund", optional, ttl = "1d", optional, ttl = "2d")]
async fn refund(_op: Option<idem::Operation>) {}

fn main() {}
