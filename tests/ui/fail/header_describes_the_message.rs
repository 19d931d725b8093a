use idem::idempotent;

#[idempotent(scope = "transfer.create", header = "Content-Type")]
async fn create() {}

#[idempotent(scope = "transfer.update", header = "user-agent")]
async fn update() {}

#[idempotent(scope = "transfer.cancel", header = "X-Forwarded-Port")]
async fn cancel() {}

#[idempotent(scope = "transfer.retry", header = "If-Match")]
async fn retry() {}

#[idempotent(scope = "transfer.proxied", header = "True-Client-IP")]
async fn proxied() {}

#[idempotent(scope = "transfer.hinted", header = "Sec-CH-UA-Platform")]
async fn hinted() {}

#[idempotent(scope = "transfer.located", header = "Content-Location")]
async fn located() {}

#[idempotent(scope = "transfer.private", header = "Sec-GPC")]
async fn private() {}

#[idempotent(scope = "transfer.cdn", header = "Fastly-Client-IP")]
async fn cdn() {}

#[idempotent(scope = "transfer.traced", header = "traceparent")]
async fn traced() {}

#[idempotent(scope = "transfer.urgent", header = "Priority")]
async fn urgent() {}

fn main() {}
