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

// Without an `X-` in front, and `X-Authorization`, `X-Consul-Token`.
#[idempotent(scope = "payment.bare_token", header = "Auth-Token")]
async fn bare_token() {}

#[idempotent(scope = "payment.api_token", header = "X-Api-Token")]
async fn api_token() {}

#[idempotent(scope = "payment.x_authorization", header = "X-Authorization")]
async fn x_authorization() {}

#[idempotent(scope = "payment.consul", header = "X-Consul-Token")]
async fn consul() {}

fn main() {}
