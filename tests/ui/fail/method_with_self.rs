use idem::idempotent;

struct Service;

impl Service {
    #[idempotent(scope = "payment.create")]
    async fn create(&self) {}
}

fn main() {}
