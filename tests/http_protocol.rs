//! The HTTP protocol of `#[idempotent]` over real HTTP (a server on a
//! loopback port, a client on a raw socket), on every store: every row of
//! contract sections 2, 5 and 6.

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Classification, Classify, Idem, IdempotencyStore, Operation, Tenant};
use idem_testkit::http::{post as post_req, serve, Reply};
use idem_testkit::{Fixture, StoreKind};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Clone, Default)]
struct App {
    /// How many times the handler body ran, per recipient.
    runs: Arc<Mutex<HashMap<String, usize>>>,
    /// The downstream keys the flaky handler used, in order.
    charge_keys: Arc<Mutex<Vec<String>>>,
    /// Told when the slow handler starts (it waits for `slow_release`), and
    /// when a payment to "slow" starts (it takes 600 ms).
    slow_started: Arc<tokio::sync::Notify>,
    slow_release: Arc<tokio::sync::Notify>,
}

impl App {
    fn ran(&self, recipient: &str) -> usize {
        self.runs.lock().unwrap().get(recipient).copied().unwrap_or(0)
    }

    /// Once a slow handler has started.
    async fn started(&self) {
        tokio::time::timeout(Duration::from_secs(30), self.slow_started.notified())
            .await
            .expect("the handler starts within 30 s");
    }
}

#[derive(Deserialize, Serialize)]
struct PaymentIn {
    amount: i64,
    currency: String,
    recipient: String,
    comment: Option<String>,
}

enum PaymentError {
    Declined,
    GatewayDown,
    Invalid,
    /// A 402 that the error type itself says to release.
    RetryableDecline,
}

impl IntoResponse for PaymentError {
    fn into_response(self) -> Response {
        match self {
            PaymentError::Declined => (
                StatusCode::PAYMENT_REQUIRED,
                Json(serde_json::json!({"error": "card_declined"})),
            )
                .into_response(),
            PaymentError::RetryableDecline => (
                StatusCode::PAYMENT_REQUIRED,
                Json(serde_json::json!({"error": "try_again"})),
            )
                .into_response(),
            PaymentError::GatewayDown => (StatusCode::SERVICE_UNAVAILABLE, "gateway down").into_response(),
            PaymentError::Invalid => (StatusCode::UNPROCESSABLE_ENTITY, "invalid amount").into_response(),
        }
    }
}

impl Classify for PaymentError {
    fn classify(&self) -> Classification {
        match self {
            PaymentError::RetryableDecline => Classification::Release,
            other => Classification::from_status(match other {
                PaymentError::Declined => StatusCode::PAYMENT_REQUIRED,
                PaymentError::GatewayDown => StatusCode::SERVICE_UNAVAILABLE,
                _ => StatusCode::UNPROCESSABLE_ENTITY,
            }),
        }
    }
}

type Created = (StatusCode, HeaderMap, JsonText);

/// A JSON answer whose bytes are exactly the handler's: odd spacing, keys
/// out of order, `4.50`, escapes. Parsing and writing it again would give
/// other bytes, so a replay that is not the stored bytes shows.
struct JsonText(String);

impl IntoResponse for JsonText {
    fn into_response(self) -> Response {
        ([(header::CONTENT_TYPE, "application/json")], self.0).into_response()
    }
}

async fn pay(app: &App, p: PaymentIn, attempt: u32) -> Result<Created, PaymentError> {
    let n = {
        let mut runs = app.runs.lock().unwrap();
        let n = runs.entry(p.recipient.clone()).or_default();
        *n += 1;
        *n
    };
    match p.recipient.as_str() {
        "slow" => {
            app.slow_started.notify_one();
            tokio::time::sleep(Duration::from_millis(600)).await
        }
        "declined" => return Err(PaymentError::Declined),
        "retryable" => return Err(PaymentError::RetryableDecline),
        "down" => return Err(PaymentError::GatewayDown),
        "panic" => panic!("the handler panicked"),
        _ => {}
    }
    if p.amount <= 0 {
        return Err(PaymentError::Invalid);
    }
    let mut headers = HeaderMap::new();
    headers.insert(
        header::LOCATION,
        HeaderValue::from_str(&format!("/v1/payments/pay_{n}")).unwrap(),
    );
    headers.insert(header::SET_COOKIE, HeaderValue::from_static("session=secret"));
    headers.insert("x-not-stored", HeaderValue::from_static("1"));
    headers.insert(header::ETAG, HeaderValue::from_str(&format!("\"v{n}\"")).unwrap());
    let body = if p.recipient == "big" {
        format!(r#"{{"blob":"{}"}}"#, "x".repeat(4096))
    } else {
        format!(
            "{{ \"status\" :\"succeeded\",\"id\":  \"pay_{n}\",\n  \"amount\": {}, \"attempt\":{attempt}, \"fee\": 4.50, \"note\":\"caf\\u00e9\" }}",
            p.amount
        )
    };
    Ok((StatusCode::CREATED, headers, JsonText(body)))
}

#[idempotent(scope = "payment.create", fields(amount, currency, recipient))]
async fn create_payment(
    State(app): State<App>,
    op: Operation,
    Json(p): Json<PaymentIn>,
) -> Result<Created, PaymentError> {
    pay(&app, p, op.attempt()).await
}

#[idempotent(scope = "refund.create", fields(amount))]
async fn create_refund(State(app): State<App>, Json(p): Json<PaymentIn>) -> Result<Created, PaymentError> {
    pay(&app, p, 1).await
}

#[idempotent(scope = "payment.wait", fields(amount), wait = "3s")]
async fn create_waiting(State(app): State<App>, Json(p): Json<PaymentIn>) -> Result<Created, PaymentError> {
    pay(&app, p, 1).await
}

#[idempotent(scope = "payment.optional", fields(amount), optional)]
async fn create_optional(
    State(app): State<App>,
    op: Option<Operation>,
    Json(p): Json<PaymentIn>,
) -> Result<Created, PaymentError> {
    pay(&app, p, op.map_or(0, |op| op.attempt())).await
}

#[idempotent(scope = "payment.slow", fields(amount), lock_timeout = "1s")]
async fn create_slow(State(app): State<App>, Json(p): Json<PaymentIn>) -> Result<Created, PaymentError> {
    // Until the test lets it go (or 20 s have passed, for a second
    // execution that took it over), far longer than its lock timeout:
    // only the lease keeps it owned.
    app.slow_started.notify_one();
    let _ = tokio::time::timeout(Duration::from_secs(20), app.slow_release.notified()).await;
    pay(&app, p, 1).await
}

/// Refuses with 401 a request that carries `x-deny`: an extractor that
/// fails before the key is reserved.
struct Allowed;

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Allowed {
    type Rejection = (StatusCode, &'static str);

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _: &S,
    ) -> Result<Self, Self::Rejection> {
        if parts.headers.contains_key("x-deny") {
            return Err((StatusCode::UNAUTHORIZED, "denied"));
        }
        Ok(Allowed)
    }
}

#[idempotent(scope = "payment.guarded", fields(amount))]
async fn create_guarded(
    State(app): State<App>,
    _: Allowed,
    op: Operation,
    Json(p): Json<PaymentIn>,
) -> Result<Created, PaymentError> {
    pay(&app, p, op.attempt()).await
}

/// Held until the test lets it go, like `create_slow`; a retry waits 300 ms.
#[idempotent(scope = "payment.wait_briefly", fields(amount), wait = "300ms")]
async fn create_waiting_briefly(
    State(app): State<App>,
    Json(p): Json<PaymentIn>,
) -> Result<Created, PaymentError> {
    app.slow_started.notify_one();
    let _ = tokio::time::timeout(Duration::from_secs(20), app.slow_release.notified()).await;
    pay(&app, p, 1).await
}

/// Charges downstream under the derived key, then fails once with a 503
/// (the key is released after the effect), then succeeds.
#[idempotent(scope = "payment.flaky", fields(amount))]
async fn create_flaky(
    State(app): State<App>,
    op: Operation,
    Json(p): Json<PaymentIn>,
) -> (StatusCode, String) {
    let mut keys = app.charge_keys.lock().unwrap();
    keys.push(op.derived_key("charge"));
    if keys.len() == 1 {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "ledger down after the charge".into(),
        );
    }
    (
        StatusCode::CREATED,
        format!("{{\"amount\":{},\"attempt\":{}}}", p.amount, op.attempt()),
    )
}

#[derive(Deserialize, Serialize)]
struct Progress {
    checkpoint: String,
}

/// Saves the checkpoint the body names: 201 with the recovery point, or
/// 400 with the error the checkpoint gave.
#[idempotent(scope = "progress.save", fields(checkpoint))]
async fn save_progress(op: Operation, Json(p): Json<Progress>) -> (StatusCode, String) {
    match op.checkpoint(&p.checkpoint).await {
        Ok(()) => (StatusCode::CREATED, op.recovery_point().unwrap_or_default()),
        Err(e) => (StatusCode::BAD_REQUEST, e.to_string()),
    }
}

#[idempotent(scope = "payment.custom", header = "X-Request-Id")]
async fn create_custom_header(
    State(app): State<App>,
    Json(p): Json<PaymentIn>,
) -> Result<Created, PaymentError> {
    pay(&app, p, 1).await
}

/// Demo auth: the bearer token is the tenant.
async fn auth(mut req: Request, next: Next) -> Response {
    let tenant = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(Tenant::new);
    if let Some(t) = tenant {
        req.extensions_mut().insert(t);
    }
    next.run(req).await
}

fn router(app: App, idem: Idem) -> Router {
    Router::new()
        .route("/payments", post(create_payment))
        .route("/refunds", post(create_refund))
        .route("/waiting", post(create_waiting))
        .route("/optional", post(create_optional))
        .route("/custom", post(create_custom_header))
        .route("/slow", post(create_slow))
        .route("/flaky", post(create_flaky))
        .route("/guarded", post(create_guarded))
        .route("/wait-briefly", post(create_waiting_briefly))
        .route("/progress", post(save_progress))
        .layer(idem.layer())
        .layer(middleware::from_fn(auth))
        .with_state(app)
}

struct Harness {
    addr: SocketAddr,
    app: App,
    store: Arc<dyn IdempotencyStore>,
    _dir: Option<tempfile::TempDir>,
}

async fn start(Fixture { store, dir }: Fixture) -> Harness {
    let app = App::default();
    // `set-cookie` is never stored: naming it is refused.
    assert!(Idem::from_arc(store.clone())
        .replay_headers(["set-cookie"])
        .is_err());
    let idem = Idem::from_arc(store.clone())
        .max_stored_body(1024)
        .unwrap()
        .replay_headers(["etag"])
        .unwrap();
    let addr = serve(router(app.clone(), idem)).await;
    Harness {
        addr,
        app,
        store,
        _dir: dir,
    }
}

/// The harness on a fresh store of `kind`.
async fn harness(kind: StoreKind) -> Option<Harness> {
    Some(start(kind.fixture().await?).await)
}

fn body(amount: i64, recipient: &str) -> String {
    format!(r#"{{"amount": {amount}, "currency": "EUR", "recipient": "{recipient}"}}"#)
}

async fn pay_req(h: &Harness, key: &str, amount: i64, recipient: &str) -> Reply {
    post_req("/payments", &body(amount, recipient))
        .bearer("acct_1")
        .key(key)
        .send(h.addr)
        .await
}

async fn missing_key_is_400_and_the_handler_does_not_run(h: Harness) {
    let r = post_req("/payments", &body(100, "alice"))
        .bearer("acct_1")
        .send(h.addr)
        .await;
    assert_eq!(r.status, 400);
    assert_eq!(r.problem(), "idempotency-key-missing");
    assert_eq!(h.app.ran("alice"), 0);
}

async fn invalid_keys_are_400_and_the_handler_does_not_run(h: Harness) {
    let long = "k".repeat(256);
    let cases: Vec<(&str, Vec<&[u8]>)> = vec![
        ("empty", vec![b""]),
        ("too long", vec![long.as_bytes()]),
        ("comma", vec![b"a,b"]),
        ("tab", vec![b"a\tb"]),
        ("space", vec![b"a b"]),
        ("non-ascii", vec!["caf\u{e9}".as_bytes()]),
        ("bad quoting", vec![b"\"open"]),
        ("sent twice", vec![b"k1", b"k1"]),
    ];
    for (what, values) in cases {
        let mut req = post_req("/payments", &body(100, "alice")).bearer("acct_1");
        for v in values {
            req = req.header("Idempotency-Key", v);
        }
        let r = req.send(h.addr).await;
        assert_eq!(r.status, 400, "{what}: {r:?}");
        assert_eq!(r.problem(), "idempotency-key-invalid", "{what}");
        let detail = r.json()["detail"].as_str().unwrap().to_owned();
        assert!(!detail.is_empty(), "{what}");
    }
    // Other control bytes never reach the application: the HTTP server
    // itself refuses the request with its own 400.
    let r = post_req("/payments", &body(100, "alice"))
        .bearer("acct_1")
        .key("a\x01b")
        .send(h.addr)
        .await;
    assert_eq!(r.status, 400);
    assert_eq!(h.app.ran("alice"), 0);
}

async fn a_quoted_key_is_the_same_key(h: Harness) {
    let first = pay_req(&h, "order-1", 100, "alice").await;
    assert_eq!(first.status, 201);
    let again = post_req("/payments", &body(100, "alice"))
        .bearer("acct_1")
        .key("\"order-1\"")
        .send(h.addr)
        .await;
    assert_eq!(again.status, 201);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(h.app.ran("alice"), 1);
}

async fn replays_the_stored_response_byte_for_byte(h: Harness) {
    let first = pay_req(&h, "k-replay", 4990, "alice").await;
    assert_eq!(first.status, 201);
    assert_eq!(first.header("idempotent-replayed"), None);
    assert_eq!(first.header("set-cookie"), Some("session=secret"));
    // The handler's own bytes, which no JSON writer would give again.
    let written = String::from_utf8_lossy(&first.body).into_owned();
    assert!(
        written.contains("\"id\":  \"pay_1\",\n")
            && written.contains("\"fee\": 4.50, \"note\":\"caf\\u00e9\" }"),
        "{written}"
    );
    let replay = pay_req(&h, "k-replay", 4990, "alice").await;
    assert_eq!(replay.status, 201);
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.header("location"), first.header("location"));
    assert_eq!(replay.header("content-type"), Some("application/json"));
    assert_eq!(
        replay.header("etag"),
        first.header("etag"),
        "a named header is replayed"
    );
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    // Never stored: cookies and headers nobody asked to replay.
    assert_eq!(replay.header("set-cookie"), None);
    assert_eq!(replay.header("x-not-stored"), None);
    assert_eq!(h.app.ran("alice"), 1);
}

async fn rejects_a_reused_key_with_a_different_body(h: Harness) {
    assert_eq!(pay_req(&h, "k-reuse", 100, "alice").await.status, 201);
    let r = pay_req(&h, "k-reuse", 200, "alice").await;
    assert_eq!(r.status, 422);
    assert_eq!(r.problem(), "idempotency-key-reused");
    // The detail never echoes the other request's data.
    assert!(!String::from_utf8_lossy(&r.body).contains("100"));
    assert_eq!(h.app.ran("alice"), 1);
}

async fn an_undeclared_field_change_still_replays(h: Harness) {
    let first = pay_req(&h, "k-comment", 100, "alice").await;
    let with_comment = r#"{"recipient":"alice", "amount":100,"currency":"\u0045UR","comment":"second try"}"#;
    let again = post_req("/payments", with_comment)
        .bearer("acct_1")
        .key("k-comment")
        .send(h.addr)
        .await;
    assert_eq!(again.status, 201);
    assert_eq!(again.body, first.body);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
}

/// A first request to `path` under `key`, sent in a task of its own, once
/// its handler has started.
async fn first_in_flight(
    h: &Harness,
    path: &'static str,
    key: &'static str,
    recipient: &'static str,
) -> tokio::task::JoinHandle<Reply> {
    let addr = h.addr;
    let first = tokio::spawn(async move {
        post_req(path, &body(100, recipient))
            .bearer("acct_1")
            .key(key)
            .send(addr)
            .await
    });
    h.app.started().await;
    first
}

async fn a_request_in_progress_is_409_with_retry_after(h: Harness) {
    let first = first_in_flight(&h, "/payments", "k-409", "slow").await;
    let second = pay_req(&h, "k-409", 100, "slow").await;
    assert_eq!(second.status, 409);
    assert_eq!(second.problem(), "idempotency-request-in-progress");
    let retry: u64 = second.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=2).contains(&retry), "{retry}");
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(h.app.ran("slow"), 1);
}

async fn wait_replays_the_first_execution_once_it_completes(h: Harness) {
    let first = first_in_flight(&h, "/waiting", "k-wait", "slow").await;
    let second = post_req("/waiting", &body(100, "slow"))
        .bearer("acct_1")
        .key("k-wait")
        .send(h.addr)
        .await;
    let first = first.await.unwrap();
    assert_eq!(first.status, 201);
    assert_eq!(second.status, 201);
    assert_eq!(second.header("idempotent-replayed"), Some("true"));
    assert_eq!(second.body, first.body);
    assert_eq!(h.app.ran("slow"), 1);
}

async fn a_wait_that_runs_out_answers_409_with_retry_after(h: Harness) {
    let first = first_in_flight(&h, "/wait-briefly", "k-wait-out", "alice").await;
    let asked = std::time::Instant::now();
    let second = post_req("/wait-briefly", &body(100, "alice"))
        .bearer("acct_1")
        .key("k-wait-out")
        .send(h.addr)
        .await;
    let waited = asked.elapsed();
    assert_eq!(second.status, 409, "{second:?}");
    assert_eq!(second.problem(), "idempotency-request-in-progress");
    assert!(second.header("retry-after").is_some());
    // It waited its 300 ms, and then not much longer (ten times as long
    // is this bound, for a loaded machine): the wait ran out, the first
    // execution (held 20 s) did not end it.
    assert!(waited >= Duration::from_millis(300), "{waited:?}");
    assert!(waited < Duration::from_secs(3), "{waited:?}");
    h.app.slow_release.notify_one();
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(h.app.ran("alice"), 1);
}

async fn a_failed_extractor_stores_nothing(h: Harness) {
    let denied = post_req("/guarded", &body(100, "alice"))
        .bearer("acct_1")
        .key("k-denied")
        .header("x-deny", "1")
        .send(h.addr)
        .await;
    assert_eq!(denied.status, 401, "{denied:?}");
    assert_eq!(h.app.ran("alice"), 0);
    // Nothing was reserved: another body may use the key, as its first
    // attempt, and its answer is its own, not a replay.
    let allowed = post_req("/guarded", &body(200, "alice"))
        .bearer("acct_1")
        .key("k-denied")
        .send(h.addr)
        .await;
    assert_eq!(allowed.status, 201, "{allowed:?}");
    assert_eq!(allowed.header("idempotent-replayed"), None);
    assert_eq!(allowed.json()["attempt"], 1);
    assert_eq!(allowed.json()["amount"], 200);
    assert_eq!(h.app.ran("alice"), 1);
}

async fn tenants_and_scopes_with_the_same_key_are_isolated(h: Harness) {
    let a = post_req("/payments", &body(100, "alice"))
        .bearer("acct_a")
        .key("shared")
        .send(h.addr)
        .await;
    let b = post_req("/payments", &body(999, "alice"))
        .bearer("acct_b")
        .key("shared")
        .send(h.addr)
        .await;
    let refund = post_req("/refunds", &body(5, "alice"))
        .bearer("acct_a")
        .key("shared")
        .send(h.addr)
        .await;
    assert_eq!((a.status, b.status, refund.status), (201, 201, 201));
    assert_eq!(h.app.ran("alice"), 3);
    let a2 = post_req("/payments", &body(100, "alice"))
        .bearer("acct_a")
        .key("shared")
        .send(h.addr)
        .await;
    assert_eq!(a2.body, a.body);
    assert_ne!(a2.body, b.body);
}

async fn a_business_rejection_is_stored(h: Harness) {
    let first = pay_req(&h, "k-402", 100, "declined").await;
    assert_eq!(first.status, 402);
    let again = pay_req(&h, "k-402", 100, "declined").await;
    assert_eq!(again.status, 402);
    assert_eq!(again.body, first.body);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(h.app.ran("declined"), 1);
}

async fn the_error_type_can_override_the_classification(h: Harness) {
    assert_eq!(pay_req(&h, "k-typed", 100, "retryable").await.status, 402);
    let again = pay_req(&h, "k-typed", 100, "retryable").await;
    assert_eq!(again.status, 402);
    assert_eq!(again.header("idempotent-replayed"), None);
    assert_eq!(h.app.ran("retryable"), 2);
}

async fn a_server_error_is_released_so_the_retry_really_retries(h: Harness) {
    assert_eq!(pay_req(&h, "k-503", 100, "down").await.status, 503);
    let again = pay_req(&h, "k-503", 100, "down").await;
    assert_eq!(again.status, 503);
    assert_eq!(again.header("idempotent-replayed"), None);
    assert_eq!(h.app.ran("down"), 2);
}

async fn a_validation_error_is_released_and_the_fixed_request_may_use_the_key(h: Harness) {
    assert_eq!(pay_req(&h, "k-422", -5, "alice").await.status, 422);
    // The fixed request, another body, same key: it runs.
    assert_eq!(pay_req(&h, "k-422", 5, "alice").await.status, 201);
    assert_eq!(h.app.ran("alice"), 2);
}

async fn a_panic_is_released_and_the_server_keeps_serving(h: Harness) {
    let r = pay_req(&h, "k-panic", 100, "panic").await;
    assert_eq!(r.status, 500);
    // Released as failed, not as rejected: the key stays bound to its body.
    let changed = pay_req(&h, "k-panic", 101, "panic").await;
    assert_eq!(changed.status, 422, "{changed:?}");
    assert_eq!(changed.problem(), "idempotency-key-reused");
    assert_eq!(h.app.ran("panic"), 1);
    let again = pay_req(&h, "k-panic", 100, "panic").await;
    assert_eq!(again.status, 500);
    assert_eq!(h.app.ran("panic"), 2);
    assert_eq!(pay_req(&h, "k-after-panic", 100, "alice").await.status, 201);
}

async fn a_client_disconnect_does_not_cancel_the_execution(h: Harness) {
    let client = post_req("/payments", &body(100, "slow"))
        .bearer("acct_1")
        .key("k-gone")
        .start(h.addr)
        .await;
    // The client leaves while the handler runs.
    h.app.started().await;
    drop(client);
    // The execution goes on without its client and records its answer:
    // the retry is told 409 until then, and replays it after.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let retry = loop {
        let r = pay_req(&h, "k-gone", 100, "slow").await;
        if r.status != 409 || tokio::time::Instant::now() > deadline {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(retry.status, 201);
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(h.app.ran("slow"), 1);
}

async fn twenty_concurrent_requests_run_the_handler_once(h: Harness) {
    let addr = h.addr;
    let barrier = Arc::new(tokio::sync::Barrier::new(20));
    let tasks: Vec<_> = (0..20)
        .map(|_| {
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                post_req("/payments", &body(100, "slow"))
                    .bearer("acct_1")
                    .key("k-race")
                    .send(addr)
                    .await
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await.unwrap().status);
    }
    statuses.sort();
    let created = statuses.iter().filter(|s| **s == 201).count();
    let conflicts = statuses.iter().filter(|s| **s == 409).count();
    assert_eq!((created, conflicts), (1, 19), "{statuses:?}");
    assert_eq!(h.app.ran("slow"), 1);
}

async fn an_oversized_answer_is_never_run_twice(h: Harness) {
    let first = pay_req(&h, "k-big", 100, "big").await;
    assert_eq!(first.status, 201);
    assert!(first.body.len() > 4096);
    let replay = pay_req(&h, "k-big", 100, "big").await;
    assert_eq!(replay.status, 201);
    assert_eq!(replay.header("idempotent-replay-body-omitted"), Some("true"));
    assert_eq!(replay.header("location"), first.header("location"));
    assert!(replay.body.is_empty());
    assert_eq!(h.app.ran("big"), 1);
}

async fn an_optional_handler_runs_unprotected_without_a_key(h: Harness) {
    for _ in 0..2 {
        let r = post_req("/optional", &body(100, "opt"))
            .bearer("acct_1")
            .send(h.addr)
            .await;
        assert_eq!(r.status, 201);
        assert_eq!(r.json()["attempt"], 0, "no operation without a key");
    }
    assert_eq!(h.app.ran("opt"), 2);
    for _ in 0..2 {
        let r = post_req("/optional", &body(100, "opt"))
            .bearer("acct_1")
            .key("k-opt")
            .send(h.addr)
            .await;
        assert_eq!(r.status, 201);
    }
    assert_eq!(h.app.ran("opt"), 3);
}

async fn a_custom_key_header_is_used(h: Harness) {
    let first = post_req("/custom", &body(1, "custom"))
        .bearer("acct_1")
        .header("X-Request-Id", "r1")
        .send(h.addr)
        .await;
    let again = post_req("/custom", &body(1, "custom"))
        .bearer("acct_1")
        .header("X-Request-Id", "r1")
        .send(h.addr)
        .await;
    assert_eq!((first.status, again.status), (201, 201));
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    let missing = post_req("/custom", &body(1, "custom"))
        .bearer("acct_1")
        .key("r1")
        .send(h.addr)
        .await;
    assert_eq!(missing.status, 400);
    assert!(missing.json()["detail"]
        .as_str()
        .unwrap()
        .contains("x-request-id"));
    assert_eq!(h.app.ran("custom"), 1);
}

async fn a_stale_lock_is_taken_over_with_the_next_attempt(h: Harness) {
    // An execution that died: it reserved the key, checkpointed, and never
    // finished. Its fingerprint is the one the HTTP request will have.
    let fp = idem::fingerprint::fingerprint(&idem::fingerprint::RequestPrint {
        scope: "payment.create",
        path: &[],
        query: None,
        body: idem::fingerprint::BodyPrint::Json {
            text: body(100, "alice").as_bytes(),
            fields: Some(&["amount", "currency", "recipient"]),
            read: None,
        },
        ignore: &[],
    })
    .unwrap();
    let id = idem::store::RecordId::new("acct_1", "payment.create", "k-stale");
    let req = idem::store::ReserveRequest {
        id: &id,
        fingerprint: &fp,
        token: idem_testkit::token(),
        ttl: Duration::from_secs(3600),
        lock_timeout: Duration::from_secs(60),
    };
    let idem::store::Reservation::Reserved(dead) = h.store.reserve(req).await.unwrap() else {
        panic!()
    };
    h.store.checkpoint(&id, &dead.token, "charged").await.unwrap();

    let early = pay_req(&h, "k-stale", 100, "alice").await;
    assert_eq!(early.status, 409);
    // Its lock runs out now: its last heartbeat set the deadline 1 ms on,
    // and the next request comes at least 50 ms later.
    h.store
        .extend_lock(&id, &dead.token, Duration::from_millis(1))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let taken = pay_req(&h, "k-stale", 100, "alice").await;
    assert_eq!(taken.status, 201);
    assert_eq!(taken.json()["attempt"], 2);
    // The dead owner can no longer write.
    assert_eq!(
        h.store.release(&id, &dead.token).await,
        Err(idem::StoreError::LockLost)
    );
    let replay = pay_req(&h, "k-stale", 100, "alice").await;
    assert_eq!(replay.body, taken.body);
    assert_eq!(h.app.ran("alice"), 1);
}

async fn a_slow_handler_keeps_its_lock_while_it_runs(h: Harness) {
    let addr = h.addr;
    let first = tokio::spawn(async move {
        post_req("/slow", &body(7, "lease"))
            .bearer("acct_1")
            .key("k-lease")
            .send(addr)
            .await
    });
    // Counted from the handler's start (the first request may take a while
    // to reach it): two and a half lock timeouts later it still runs, and
    // its lock is still its own.
    h.app.started().await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let second = post_req("/slow", &body(7, "lease"))
        .bearer("acct_1")
        .key("k-lease")
        .send(h.addr)
        .await;
    assert_eq!(second.status, 409, "{second:?}");
    h.app.slow_release.notify_one();
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(h.app.ran("lease"), 1);
}

async fn a_new_key_with_the_same_body_is_a_new_operation(h: Harness) {
    // The same coffee, bought twice: the key identifies the operation, the
    // body only checks it.
    let a = pay_req(&h, "coffee-1", 350, "cafe").await;
    let b = pay_req(&h, "coffee-2", 350, "cafe").await;
    assert_eq!((a.status, b.status), (201, 201));
    assert_eq!(b.header("idempotent-replayed"), None);
    assert_ne!(a.body, b.body);
    assert_eq!(h.app.ran("cafe"), 2);
}

/// A failure after an external effect keeps the key bound to its request:
/// the same key with another body gets 422 (it cannot start a second
/// operation, with new derived keys, that would charge again); the same
/// request retried continues the operation.
async fn a_failed_request_stays_bound_to_its_body(h: Harness) {
    let first = post_req("/flaky", &body(10, "flaky"))
        .bearer("acct_1")
        .key("k-bound")
        .send(h.addr)
        .await;
    assert_eq!(first.status, 503);
    let changed = post_req("/flaky", &body(11, "flaky"))
        .bearer("acct_1")
        .key("k-bound")
        .send(h.addr)
        .await;
    assert_eq!(changed.status, 422, "{changed:?}");
    assert_eq!(changed.problem(), "idempotency-key-reused");
    let retry = post_req("/flaky", &body(10, "flaky"))
        .bearer("acct_1")
        .key("k-bound")
        .send(h.addr)
        .await;
    assert_eq!(retry.status, 201);
    assert_eq!(retry.json()["attempt"], 2);
    let keys = h.app.charge_keys.lock().unwrap().clone();
    assert_eq!(keys.len(), 2);
    assert_eq!(keys[0], keys[1], "one operation, one downstream key");
}

async fn a_retry_after_a_release_keeps_the_derived_keys(h: Harness) {
    // Released after its downstream effect: the retry must present the same
    // key downstream, so the other system's idempotency can deduplicate.
    let first = post_req("/flaky", &body(10, "flaky"))
        .bearer("acct_1")
        .key("k-flaky")
        .send(h.addr)
        .await;
    assert_eq!(first.status, 503);
    let retry = post_req("/flaky", &body(10, "flaky"))
        .bearer("acct_1")
        .key("k-flaky")
        .send(h.addr)
        .await;
    assert_eq!(retry.status, 201);
    assert_eq!(retry.json()["attempt"], 2);
    let keys = h.app.charge_keys.lock().unwrap().clone();
    assert_eq!(keys.len(), 2);
    assert_eq!(keys[0], keys[1]);
    // A new key is a new operation, with new derived keys.
    let other = post_req("/flaky", &body(10, "flaky"))
        .bearer("acct_1")
        .key("k-flaky-2")
        .send(h.addr)
        .await;
    assert_eq!(other.status, 201);
    assert_ne!(h.app.charge_keys.lock().unwrap()[2], keys[0]);
}

/// A request body sent in chunks, as `transfer-encoding: chunked`, the
/// server reading each chunk as it comes.
async fn pay_chunked(h: &Harness, key: &str, chunks: &[&str]) -> Reply {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(h.addr).await.unwrap();
    let head = format!(
        "POST /payments HTTP/1.1\r\nhost: {}\r\nconnection: close\r\ncontent-type: application/json\r\n\
         authorization: Bearer acct_1\r\nidempotency-key: {key}\r\ntransfer-encoding: chunked\r\n\r\n",
        h.addr
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    for chunk in chunks {
        let framed = format!("{:x}\r\n{chunk}\r\n", chunk.len());
        stream.write_all(framed.as_bytes()).await.unwrap();
        stream.flush().await.unwrap();
    }
    stream.write_all(b"0\r\n\r\n").await.unwrap();
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut raw))
        .await
        .expect("an answer within 30 s")
        .unwrap();
    idem_testkit::http::parse(&raw)
}

async fn a_body_sent_in_chunks_is_the_same_request_as_in_one_piece(h: Harness) {
    let parts = [
        r#"{"amount": 100, "#,
        r#""currency": "EUR", "#,
        r#""recipient": "carol"}"#,
    ];
    let first = pay_chunked(&h, "k-chunked", &parts).await;
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!(h.app.ran("carol"), 1);
    // The same body in one piece: the same request, replayed.
    let whole = pay_req(&h, "k-chunked", 100, "carol").await;
    assert_eq!(whole.status, 201);
    assert_eq!(whole.header("idempotent-replayed"), Some("true"));
    assert_eq!(whole.body, first.body);
    // In chunks again, split elsewhere: replayed; another amount, in
    // chunks: another request.
    for (rest, status, replayed) in [
        (
            r#"00, "currency": "EUR", "recipient": "carol"}"#,
            201,
            Some("true"),
        ),
        (r#"01, "currency": "EUR", "recipient": "carol"}"#, 422, None),
    ] {
        let r = pay_chunked(&h, "k-chunked", &[r#"{"amount": 1"#, rest]).await;
        assert_eq!(
            (r.status, r.header("idempotent-replayed")),
            (status, replayed),
            "{r:?}"
        );
    }
    assert_eq!(h.app.ran("carol"), 1);
}

/// A checkpoint name is any text but U+0000, which PostgreSQL's `text`
/// cannot hold: refused with the same clear error on every store, before
/// the store is asked (the handler may pass it on, or answer otherwise).
async fn a_checkpoint_holding_a_nul_is_refused_alike_on_every_store(h: Harness) {
    let save = |name: &str, key: &str| {
        post_req("/progress", &format!(r#"{{"checkpoint": "{name}"}}"#))
            .bearer("acct_1")
            .key(key)
    };
    let r = save(r"charged \u0001 \u00e9 \u2028", "k-odd").send(h.addr).await;
    assert_eq!(
        (r.status, String::from_utf8_lossy(&r.body)),
        (201, "charged \u{1} \u{e9} \u{2028}".into())
    );
    let r = save(r"charged\u0000", "k-nul").send(h.addr).await;
    assert_eq!(r.status, 400, "{r:?}");
    assert!(String::from_utf8_lossy(&r.body).contains("U+0000"), "{r:?}");
}

idem_testkit::for_each_store! {
    stores: [memory, sqlite, postgres],
    setup: |kind| harness(kind).await,
    worker_threads: 4,
    cases: [
        missing_key_is_400_and_the_handler_does_not_run,
        invalid_keys_are_400_and_the_handler_does_not_run,
        a_quoted_key_is_the_same_key,
        replays_the_stored_response_byte_for_byte,
        rejects_a_reused_key_with_a_different_body,
        an_undeclared_field_change_still_replays,
        a_request_in_progress_is_409_with_retry_after,
        wait_replays_the_first_execution_once_it_completes,
        a_wait_that_runs_out_answers_409_with_retry_after,
        a_failed_extractor_stores_nothing,
        tenants_and_scopes_with_the_same_key_are_isolated,
        a_business_rejection_is_stored,
        the_error_type_can_override_the_classification,
        a_server_error_is_released_so_the_retry_really_retries,
        a_validation_error_is_released_and_the_fixed_request_may_use_the_key,
        a_panic_is_released_and_the_server_keeps_serving,
        a_client_disconnect_does_not_cancel_the_execution,
        twenty_concurrent_requests_run_the_handler_once,
        an_oversized_answer_is_never_run_twice,
        an_optional_handler_runs_unprotected_without_a_key,
        a_custom_key_header_is_used,
        a_stale_lock_is_taken_over_with_the_next_attempt,
        a_slow_handler_keeps_its_lock_while_it_runs,
        a_new_key_with_the_same_body_is_a_new_operation,
        a_retry_after_a_release_keeps_the_derived_keys,
        a_failed_request_stays_bound_to_its_body,
        a_body_sent_in_chunks_is_the_same_request_as_in_one_piece,
        a_checkpoint_holding_a_nul_is_refused_alike_on_every_store,
    ],
}

#[tokio::test]
async fn a_store_that_is_down_answers_503_and_the_handler_does_not_run() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let store = idem::PgStore::connect(&format!("postgres://postgres@127.0.0.1:{port}/test"))
        .unwrap()
        .with_timeout(Duration::from_millis(300));
    let h = start(Fixture {
        store: Arc::new(store),
        dir: None,
    })
    .await;
    let r = pay_req(&h, "k-down", 100, "alice").await;
    assert_eq!(r.status, 503);
    assert_eq!(r.problem(), "idempotency-store-unavailable");
    assert!(r.header("retry-after").is_some());
    assert_eq!(h.app.ran("alice"), 0);
}

/// Once the lock that held up the store is gone, the same request runs:
/// after a moment of 409 while a reservation that committed past its
/// timeout is given back in the background, never a lock timeout's.
async fn runs_once_the_store_is_back(h: &Harness, key: &str, recipient: &str) -> Reply {
    let freed = std::time::Instant::now();
    loop {
        let r = pay_req(h, key, 100, recipient).await;
        if r.status != 409 {
            return r;
        }
        assert!(
            freed.elapsed() < Duration::from_secs(10),
            "the key stayed locked for {:?} after the store was back: {r:?}",
            freed.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The harness on PostgreSQL, in a fresh schema, with a store timeout of
/// 400 ms; `None` without `DATABASE_URL`.
async fn pg_harness_of_short_timeout() -> Option<(String, String, Harness)> {
    let url = idem_testkit::pg_url()?;
    let schema = idem_testkit::pg_schema(&url).await;
    let store = idem_testkit::pg_store_in(&url, &schema, 4)
        .await
        .with_timeout(Duration::from_millis(400));
    let h = start(Fixture {
        store: Arc::new(store),
        dir: None,
    })
    .await;
    Some((url, schema, h))
}

/// A connection in a transaction that holds `schema`'s table, every
/// statement on it waiting, until it ends (`ROLLBACK`).
async fn table_locked(url: &str, schema: &str) -> sqlx::PgConnection {
    use sqlx::Connection as _;
    let mut locker = sqlx::PgConnection::connect(url).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "BEGIN; LOCK TABLE \"{schema}\".idempotency_keys IN ACCESS EXCLUSIVE MODE"
    )))
    .execute(&mut locker)
    .await
    .unwrap();
    locker
}

/// A request while something holds the store: 503 with `Retry-After`, the
/// handler not run; then, once `let_go` frees it, the same request runs,
/// once.
async fn refused_while_held_then_run(h: &Harness, let_go: impl std::future::Future<Output = ()>) {
    let r = pay_req(h, "k-locked", 100, "alice").await;
    assert_eq!(r.status, 503, "{r:?}");
    assert_eq!(r.problem(), "idempotency-store-unavailable");
    assert!(r.header("retry-after").is_some());
    assert_eq!(h.app.ran("alice"), 0);
    let_go.await;
    let r = runs_once_the_store_is_back(h, "k-locked", "alice").await;
    assert_eq!(r.status, 201, "{r:?}");
    assert_eq!(h.app.ran("alice"), 1);
}

/// A store that is up but cannot answer in time (another connection holds
/// the table): 503 with `Retry-After`, the handler not run; once it is
/// free, the request runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_a_table_locked_elsewhere_answers_503_and_runs_nothing() {
    let Some((url, schema, h)) = pg_harness_of_short_timeout().await else {
        return;
    };
    let mut locker = table_locked(&url, &schema).await;
    refused_while_held_then_run(&h, async {
        sqlx::raw_sql("ROLLBACK").execute(&mut locker).await.unwrap();
    })
    .await;
}

/// The same on SQLite, whose write lock another connection holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_a_write_lock_held_elsewhere_answers_503_and_runs_nothing() {
    use sqlx::Connection as _;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    let store = idem::SqliteStore::open(&path)
        .await
        .unwrap()
        .with_timeout(Duration::from_millis(400));
    store.migrate().await.unwrap();
    let h = start(Fixture {
        store: Arc::new(store),
        dir: None,
    })
    .await;
    let mut other = sqlx::SqliteConnection::connect(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    sqlx::raw_sql("BEGIN EXCLUSIVE")
        .execute(&mut other)
        .await
        .unwrap();
    refused_while_held_then_run(&h, async {
        sqlx::raw_sql("ROLLBACK").execute(&mut other).await.unwrap();
    })
    .await;
}

/// The handler answered, and its completion cannot be written (another
/// connection holds the table past the store's timeout): the answer, which
/// would never be replayed, is not given (503), and the key goes back as
/// after a failure: the retry runs again as the operation's next attempt,
/// which the handler is told (for its derived keys downstream).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_an_answer_whose_completion_cannot_be_written_is_not_given() {
    let Some((url, schema, h)) = pg_harness_of_short_timeout().await else {
        return;
    };
    let key = idem_testkit::unique("k-unwritten");
    let mut returned = idem_runtime::pause::arm(idem_runtime::pause::HANDLER_RETURNED, &key);
    let first = {
        let (addr, key) = (h.addr, key.clone());
        tokio::spawn(async move {
            post_req("/payments", &body(100, "alice"))
                .bearer("acct_1")
                .key(&key)
                .send(addr)
                .await
        })
    };
    returned.reached().await;
    let mut locker = table_locked(&url, &schema).await;
    returned.resume();
    let r = first.await.unwrap();
    assert_eq!(r.status, 503, "an answer that was never recorded: {r:?}");
    assert_eq!(r.problem(), "idempotency-store-unavailable");
    sqlx::raw_sql("ROLLBACK").execute(&mut locker).await.unwrap();
    let retry = runs_once_the_store_is_back(&h, &key, "alice").await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert_eq!(retry.header("idempotent-replayed"), None);
    assert!(
        String::from_utf8_lossy(&retry.body).contains("\"attempt\":2"),
        "{retry:?}"
    );
    assert_eq!(h.app.ran("alice"), 2);
}

#[tokio::test]
async fn a_router_without_the_layer_answers_500_and_never_runs_unprotected() {
    let app = App::default();
    let router = Router::new()
        .route("/payments", post(create_payment))
        .with_state(app.clone());
    let addr = serve(router).await;
    let r = post_req("/payments", &body(100, "alice"))
        .key("k")
        .send(addr)
        .await;
    assert_eq!(r.status, 500);
    assert_eq!(r.problem(), "idempotency-misconfigured");
    assert_eq!(app.ran("alice"), 0);
}

#[tokio::test]
async fn a_request_without_a_tenant_is_refused_unless_single_tenant() {
    let h = start(Fixture::memory()).await;
    let r = post_req("/payments", &body(100, "alice"))
        .key("k")
        .send(h.addr)
        .await;
    assert_eq!(r.status, 500);
    assert_eq!(h.app.ran("alice"), 0);
    // Without a key, an optional handler stores nothing, but the request is
    // refused all the same: the misconfiguration shows before a key comes,
    // logged with the handler's scope.
    let logs = idem_testkit::logs();
    let r = post_req("/optional", &body(100, "opt")).send(h.addr).await;
    assert_eq!(
        (r.status, r.problem()),
        (500, "idempotency-misconfigured".to_owned())
    );
    assert_eq!(h.app.ran("opt"), 0);
    assert!(
        logs.text()
            .lines()
            .any(|l| l.contains("scope=\"payment.optional\"") && l.contains("no tenant for this request")),
        "the refusal is not logged with its scope"
    );

    let app = App::default();
    let idem = Idem::new(idem::MemoryStore::new()).single_tenant();
    let addr = serve(router(app.clone(), idem)).await;
    let r = post_req("/optional", &body(100, "opt")).send(addr).await;
    assert_eq!(r.status, 201, "{r:?}");
    assert_eq!(app.ran("opt"), 1);
    let r = post_req("/payments", &body(100, "alice"))
        .key("k")
        .send(addr)
        .await;
    assert_eq!(r.status, 201);
    let r = post_req("/payments", &body(100, "alice"))
        .key("k")
        .send(addr)
        .await;
    assert_eq!(r.header("idempotent-replayed"), Some("true"));
    assert_eq!(app.ran("alice"), 1);
}

/// A generic handler whose error type's (or whole return type's)
/// `Classify` impl a bound names, or an answer behind `impl Trait`: it
/// decides as it does in a concrete handler (a gateway timeout that may
/// have charged is stored, so the retry is replayed, not charged again).
mod generic_classification {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct Timeout;

    impl IntoResponse for Timeout {
        fn into_response(self) -> Response {
            StatusCode::GATEWAY_TIMEOUT.into_response()
        }
    }

    impl Classify for Timeout {
        fn classify(&self) -> Classification {
            Classification::Store
        }
    }

    trait Gateway: Send + Sync + 'static {
        type Error: IntoResponse + Send;
        fn charge(&self) -> Result<String, Self::Error>;
    }

    struct TimesOut(AtomicUsize);

    impl Gateway for TimesOut {
        type Error = Timeout;
        fn charge(&self) -> Result<String, Timeout> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Err(Timeout)
        }
    }

    #[idempotent(scope = "payment.generic")]
    async fn generic<G: Gateway>(State(g): State<Arc<G>>, _body: String) -> Result<String, G::Error>
    where
        G::Error: Classify,
    {
        g.charge()
    }

    #[idempotent(scope = "payment.concrete")]
    async fn concrete(State(g): State<Arc<TimesOut>>, _body: String) -> Result<String, Timeout> {
        g.charge()
    }

    /// Behind `impl Trait`, a bound that names `Classify`.
    #[idempotent(scope = "payment.opaque")]
    async fn opaque(
        State(g): State<Arc<TimesOut>>,
        _body: String,
    ) -> Result<String, impl IntoResponse + Classify> {
        g.charge()
    }

    /// An error trait of the application's, with `Classify` as a supertrait.
    trait GatewayError: IntoResponse + Classify {}

    impl GatewayError for Timeout {}

    /// Behind `impl Trait`, a bound that implies `Classify`.
    #[idempotent(scope = "payment.supertrait")]
    async fn supertrait(State(g): State<Arc<TimesOut>>, _body: String) -> Result<String, impl GatewayError> {
        g.charge()
    }

    /// Behind `impl Trait` whose bounds do not name `Classify` (they once
    /// hid the impl, and the 504 was released as failed: charged twice).
    #[idempotent(scope = "payment.hidden")]
    async fn hidden(State(g): State<Arc<TimesOut>>, _body: String) -> Result<String, impl IntoResponse> {
        g.charge()
    }

    #[idempotent(scope = "payment.hidden_std")]
    async fn hidden_std(
        State(g): State<Arc<TimesOut>>,
        _body: String,
    ) -> Result<String, impl IntoResponse + Send + 'static> {
        g.charge()
    }

    /// The whole return type behind `impl IntoResponse`.
    #[idempotent(scope = "payment.hidden_whole")]
    async fn hidden_whole(State(g): State<Arc<TimesOut>>, _body: String) -> impl IntoResponse {
        match g.charge() {
            Ok(_) => unreachable!("the gateway times out"),
            Err(e) => e,
        }
    }

    /// A generic whole return type whose bound names `Classify` (without
    /// it the macro refuses: `tests/ui/fail/generic_return_type_without_classify.rs`).
    #[idempotent(scope = "payment.generic_whole")]
    async fn generic_whole<G: Gateway>(State(g): State<Arc<G>>, _body: String) -> G::Error
    where
        G::Error: Classify,
    {
        match g.charge() {
            Ok(_) => unreachable!("the gateway times out"),
            Err(e) => e,
        }
    }

    /// In a generic handler, behind `impl Trait` whose bounds name
    /// `Classify` (without, the macro refuses:
    /// `tests/ui/fail/generic_handler_opaque_without_classify.rs`).
    #[idempotent(scope = "payment.generic_opaque")]
    async fn generic_opaque<G: Gateway>(
        State(g): State<Arc<G>>,
        _body: String,
    ) -> Result<String, impl IntoResponse + Classify>
    where
        G::Error: Classify,
    {
        g.charge()
    }

    #[tokio::test]
    async fn a_bound_classify_impl_decides_in_a_generic_handler() {
        let paths = [
            "/concrete",
            "/generic",
            "/opaque",
            "/supertrait",
            "/hidden",
            "/hidden_std",
            "/hidden_whole",
            "/generic_whole",
            "/generic_opaque",
        ];
        for path in paths {
            let gateway = Arc::new(TimesOut(AtomicUsize::new(0)));
            let app = Router::new()
                .route("/generic", post(generic::<TimesOut>))
                .route("/concrete", post(concrete))
                .route("/opaque", post(opaque))
                .route("/supertrait", post(supertrait))
                .route("/hidden", post(hidden))
                .route("/hidden_std", post(hidden_std))
                .route("/hidden_whole", post(hidden_whole))
                .route("/generic_whole", post(generic_whole::<TimesOut>))
                .route("/generic_opaque", post(generic_opaque::<TimesOut>))
                .with_state(gateway.clone())
                .layer(Idem::new(idem::MemoryStore::new()).single_tenant().layer());
            let addr = serve(app).await;
            let mut answers = Vec::new();
            for _ in 0..2 {
                let r = post_req(path, "pay").key("k").send(addr).await;
                answers.push((r.status, r.header("idempotent-replayed") == Some("true")));
            }
            assert_eq!(
                answers,
                [(504, false), (504, true)],
                "{path}: stored, then replayed"
            );
            assert_eq!(gateway.0.load(Ordering::SeqCst), 1, "{path}: charged once");
        }
    }
}

/// `Idem` layers at two levels (the router's, and one route's own): the
/// innermost, the last to run before the handler, configures it, as with
/// any axum `Extension`: its settings apply and its store holds the record.
#[tokio::test]
async fn the_innermost_idem_layer_configures_its_routes() {
    let app = App::default();
    let (outer, inner) = (
        Arc::new(idem::MemoryStore::new()),
        Arc::new(idem::MemoryStore::new()),
    );
    let router = Router::new()
        .route(
            "/payments",
            post(create_payment).layer(Idem::from_arc(inner.clone()).single_tenant().layer()),
        )
        .route("/refunds", post(create_refund))
        .layer(Idem::from_arc(outer.clone()).layer())
        .with_state(app.clone());
    let addr = serve(router).await;
    // The route's own layer is single-tenant: a request with no tenant runs,
    // recorded in its store alone, and is replayed from it.
    for _ in 0..2 {
        let r = post_req("/payments", &body(100, "alice"))
            .key("k")
            .send(addr)
            .await;
        assert_eq!(r.status, 201, "{r:?}");
    }
    assert_eq!(app.ran("alice"), 1);
    assert_eq!((inner.len(), outer.len()), (1, 0));
    // The router's layer, which the other route has, is not: refused.
    let r = post_req("/refunds", &body(100, "bob")).key("k").send(addr).await;
    assert_eq!(
        (r.status, r.problem()),
        (500, "idempotency-misconfigured".to_owned())
    );
    assert_eq!(app.ran("bob"), 0);
    assert_eq!((inner.len(), outer.len()), (1, 0));
}

/// The longest scope the attribute takes (255 bytes, not compressible),
/// with the longest tenant (255 bytes of three-byte characters) and key
/// (255 characters): a record every store keys, PostgreSQL's primary-key
/// index included (2,704 bytes a row), taken, then replayed.
mod the_longest_id {
    use super::*;

    #[idempotent(
        scope = "kzde8gxd6.gf10epf.rd_hod_zdoc9i.jj8h_t9lg_mxg.re_dn581u33xtplpf_.j5v2seh60kvj50c.v9_uvw53.cfr4edt_2sywb3wkh5dn.yipzz5fk2z9.ii19r0wyojfljooa5lqsa.e8x_ui6d39zzz.m4zdmen2.fvdga_j8.dbenyjqwx4hh.p44tfjgvq4k7bn.qj8b7tfq7xkw.y886vompzo.g5wbbr4qmw2wxfo.d4mvn4a4wf"
    )]
    async fn longest(Json(p): Json<PaymentIn>) -> (StatusCode, String) {
        (StatusCode::CREATED, p.recipient)
    }

    /// The tenant is the `x-tenant` header's bytes, read as UTF-8.
    async fn tenant_from_header(mut req: Request, next: Next) -> Response {
        let tenant = req
            .headers()
            .get("x-tenant")
            .and_then(|v| String::from_utf8(v.as_bytes().to_vec()).ok());
        if let Some(t) = tenant {
            req.extensions_mut().insert(Tenant::new(t));
        }
        next.run(req).await
    }

    async fn taken_and_replayed(h: Harness) {
        let router = Router::new()
            .route("/longest", post(longest))
            .layer(Idem::from_arc(h.store.clone()).layer())
            .layer(middleware::from_fn(tenant_from_header));
        let addr = serve(router).await;
        // Three-byte characters spread over the CJK block: nothing repeats.
        let tenant: String = (0..85u32)
            .map(|i| char::from_u32(0x4e00 + (i * 7919) % 0x5000).unwrap())
            .collect();
        let key: String = (0..255u32)
            .map(|i| {
                char::from(
                    b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"[(i * 37 % 62) as usize],
                )
            })
            .collect();
        assert_eq!((tenant.len(), key.len()), (255, 255));
        for replayed in [None, Some("true")] {
            let r = post_req("/longest", &body(100, "alice"))
                .header("x-tenant", &tenant)
                .key(&key)
                .send(addr)
                .await;
            assert_eq!(
                (r.status, r.header("idempotent-replayed")),
                (201, replayed),
                "{r:?}"
            );
        }
    }

    idem_testkit::for_each_store! {
        stores: [memory, sqlite, postgres],
        setup: |kind| harness(kind).await,
        worker_threads: 2,
        cases: [taken_and_replayed],
    }
}
