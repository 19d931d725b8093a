use idem::idempotent;

#[idempotent(scope = "payment.create")]
async unsafe fn create(body: String) -> String {
    body
}

#[idempotent(scope = "payment.constant")]
const async fn constant() {}

#[idempotent(scope = "payment.foreign")]
async extern "C" fn foreign() {}

fn main() {}
