use idem::idempotent;

#[idempotent(scope = "payment.create")]
struct Payment;

#[idempotent(scope = "payment.refund")]
const REFUND: u32 = 1;

fn main() {}
