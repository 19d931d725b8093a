use idem::idempotent;

// Two orders of the same coffee carry one digest: the second would be
// answered the first's replay.
#[idempotent(scope = "order.create", header = "Content-Digest")]
async fn create() {}

#[idempotent(scope = "order.update", header = "Repr-Digest")]
async fn update() {}

#[idempotent(scope = "order.cancel", header = "Content-MD5")]
async fn cancel() {}

#[idempotent(scope = "order.signed", header = "X-Amz-Content-Sha256")]
async fn signed() {}

fn main() {}
