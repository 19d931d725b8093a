use idem::idempotent;

#[idempotent(scope = "")]
async fn create() {}

fn main() {}
