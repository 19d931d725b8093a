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

// The client's address, trace context and the request's target, as
// proxies and tracers name them.
#[idempotent(scope = "payment.forwarded_for", header = "X-Original-Forwarded-For")]
async fn forwarded_for() {}

#[idempotent(scope = "payment.x_forwarded", header = "X-Forwarded")]
async fn x_forwarded() {}

#[idempotent(scope = "payment.envoy", header = "X-Envoy-External-Address")]
async fn envoy() {}

#[idempotent(scope = "payment.datadog", header = "X-Datadog-Trace-Id")]
async fn datadog() {}

#[idempotent(scope = "payment.ot", header = "Ot-Tracer-Traceid")]
async fn ot() {}

#[idempotent(scope = "payment.original_url", header = "X-Original-URL")]
async fn original_url() {}

fn main() {}
