use idem::idempotent;

#[idempotent(scope = "payment.create", header = "Authorization")]
async fn create() {}

#[idempotent(scope = "payment.update", header = "cookie")]
async fn update() {}

#[idempotent(scope = "payment.cancel", header = "X-API-Key")]
async fn cancel() {}

#[idempotent(scope = "payment.refund", header = "X-Auth-Token")]
async fn refund() {}

#[idempotent(scope = "payment.signed", header = "X-Amz-Security-Token")]
async fn signed() {}

#[idempotent(scope = "payment.keyed", header = "Api-Key")]
async fn keyed() {}

fn main() {}
