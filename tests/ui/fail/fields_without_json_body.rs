use idem::idempotent;

#[idempotent(scope = "payment.create", fields(amount))]
async fn create(body: String) -> String {
    body
}

fn main() {}
