use idem::idempotent;

// A path that is not idem's: refused at the string.
#[idempotent(scope = "payment.create", crate = "std")]
async fn create() {}

fn main() {}
