use idem::idempotent;

/// A payment, documented: the error is at `struct`, not at the comment.
#[idempotent(scope = "payment.create")]
struct Payment;

#[idempotent(scope = "payment.refund")]
const REFUND: u32 = 1;

// A function without a body is a function: the parser's own error says
// what is missing.
trait Payments {
    #[idempotent(scope = "payment.capture")]
    async fn capture();
}

fn main() {}
