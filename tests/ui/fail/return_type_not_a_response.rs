use idem::idempotent;

struct Receipt;

#[idempotent(scope = "payment.create")]
async fn create() -> Receipt {
    Receipt
}

fn main() {}
