use idem::idempotent;

/// A payment, documented: the error is at `struct`, not at the comment.
#[idempotent(scope = "payment.create")]
pub(crate) struct Payment;

#[idempotent(scope = "payment.refund")]
const REFUND: u32 = 1;

#[idempotent(scope = "payment.crate")]
extern crate core as core2;

#[idempotent(scope = "payment.macro")]
macro_rules! m {
    () => {};
}

#[idempotent(scope = "payment.foreign")]
extern "C" {
    fn x();
}

// A function without a body is a function: the parser's own error says
// what is missing.
trait Payments {
    #[idempotent(scope = "payment.capture")]
    async fn capture();
}

fn main() {}
