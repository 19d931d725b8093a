//! End-to-end tests of the payments example: the real binary, started as
//! separate processes on SQLite and PostgreSQL, driven over HTTP, killed
//! with SIGKILL mid-payment and restarted.

use idem_testkit::http::{get, post, Reply};
use idem_testkit::StoreKind;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The example binary that `cargo test` builds next to the tests.
fn example_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(|deps| deps.parent()).unwrap();
    let bin = dir.join("examples").join("payments");
    assert!(
        bin.exists(),
        "{} is missing: `cargo test --all-features` builds it",
        bin.display()
    );
    bin
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One running service process; killed when dropped.
struct Service {
    child: Child,
    addr: SocketAddr,
}

impl Service {
    async fn start(database_url: &str, env: &[(&str, &str)]) -> Service {
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let mut cmd = Command::new(example_binary());
        cmd.env("PAYMENTS_ADDR", addr.to_string())
            .env("DATABASE_URL", database_url)
            .env("RUST_LOG", "warn")
            .env("RUST_BACKTRACE", "0")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().unwrap();
        let started = Instant::now();
        while tokio::net::TcpStream::connect(addr).await.is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the service did not start"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Service { child, addr }
    }

    /// SIGKILL: no destructor, no graceful shutdown, like a crash.
    fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn payment(amount: i64) -> String {
    format!(r#"{{"amount": {amount}, "currency": "EUR", "recipient": "acct_bob"}}"#)
}

async fn pay(addr: SocketAddr, tenant: &str, key: &str, amount: i64) -> Reply {
    post("/v1/payments", &payment(amount))
        .bearer(tenant)
        .key(key)
        .send(addr)
        .await
}

async fn ledger(addr: SocketAddr, tenant: &str) -> (i64, i64, i64) {
    let l = get("/v1/ledger").bearer(tenant).send(addr).await.json();
    (
        l["charges"].as_i64().unwrap(),
        l["gateway_calls"].as_i64().unwrap(),
        l["balance"].as_i64().unwrap(),
    )
}

/// Where a test's service keeps its data.
enum Store {
    Sqlite(tempfile::TempDir),
    Postgres(String),
}

impl Store {
    fn sqlite() -> Store {
        Store::Sqlite(tempfile::tempdir().unwrap())
    }

    /// The test database, in a schema of its own (through `search_path`),
    /// so that tests run in parallel and never meet an older run's tables.
    async fn postgres() -> Option<Store> {
        let url = idem_testkit::pg_url()?;
        let schema = idem_testkit::pg_schema(&url).await;
        let sep = if url.contains('?') { '&' } else { '?' };
        Some(Store::Postgres(format!(
            "{url}{sep}options=-c%20search_path%3D{schema}"
        )))
    }

    /// A fresh store of `kind`; `None` for PostgreSQL without `DATABASE_URL`.
    async fn of(kind: StoreKind) -> Option<Store> {
        match kind {
            StoreKind::Sqlite => Some(Store::sqlite()),
            StoreKind::Postgres => Store::postgres().await,
            StoreKind::Memory => unreachable!("the example keeps its data in a database"),
        }
    }

    fn url(&self) -> String {
        match self {
            Store::Sqlite(dir) => format!("sqlite://{}", dir.path().join("payments.db").display()),
            Store::Postgres(url) => url.clone(),
        }
    }

    /// (payments rows, record state, record attempt) of a tenant, read
    /// straight from the database.
    async fn inspect(&self, tenant: &str) -> (i64, Option<String>, Option<i32>) {
        let payments = "SELECT COUNT(*) FROM payments WHERE tenant = $1";
        let record = "SELECT state, attempt FROM idempotency_keys WHERE tenant = $1";
        match self {
            Store::Sqlite(_) => {
                let pool = sqlx::SqlitePool::connect(&self.url()).await.unwrap();
                let n = sqlx::query_scalar(sqlx::AssertSqlSafe(payments.replace('$', "?")))
                    .bind(tenant)
                    .fetch_one(&pool)
                    .await
                    .unwrap();
                let r: Option<(String, i32)> = sqlx::query_as(sqlx::AssertSqlSafe(record.replace('$', "?")))
                    .bind(tenant)
                    .fetch_optional(&pool)
                    .await
                    .unwrap();
                (n, r.as_ref().map(|r| r.0.clone()), r.map(|r| r.1))
            }
            Store::Postgres(url) => {
                let pool = sqlx::PgPool::connect(url).await.unwrap();
                let n = sqlx::query_scalar(payments)
                    .bind(tenant)
                    .fetch_one(&pool)
                    .await
                    .unwrap();
                let r: Option<(String, i32)> = sqlx::query_as(record)
                    .bind(tenant)
                    .fetch_optional(&pool)
                    .await
                    .unwrap();
                (n, r.as_ref().map(|r| r.0.clone()), r.map(|r| r.1))
            }
        }
    }
}

/// `n` same-key requests at once, spread over `addrs`: (201s that executed,
/// 201s that replayed, 409s, others).
async fn storm(addrs: &[SocketAddr], tenant: &str, n: usize) -> (usize, usize, usize, Vec<u16>) {
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(n));
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let (addr, tenant, barrier) = (addrs[i % addrs.len()], tenant.to_owned(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                pay(addr, &tenant, "storm-key", 4990).await
            })
        })
        .collect();
    let (mut executed, mut replayed, mut conflicts, mut others) = (0, 0, 0, Vec::new());
    for t in tasks {
        let r = t.await.unwrap();
        match (r.status, r.header("idempotent-replayed")) {
            (201, None) => executed += 1,
            (201, Some(_)) => replayed += 1,
            (409, _) => conflicts += 1,
            (s, _) => others.push(s),
        }
    }
    (executed, replayed, conflicts, others)
}

async fn twenty_concurrent_requests_make_one_charge(store: Store) {
    let svc = Service::start(&store.url(), &[("PAYMENTS_GATEWAY_DELAY_MS", "800")]).await;
    let tenant = idem_testkit::unique("storm");
    let (executed, replayed, conflicts, others) = storm(&[svc.addr], &tenant, 20).await;
    assert_eq!((executed, replayed, conflicts, others), (1, 0, 19, vec![]));
    let (charges, calls, balance) = ledger(svc.addr, &tenant).await;
    assert_eq!((charges, calls, balance), (1, 1, 1_000_000 - 4990));
}

/// A retried failure stays bound to its request: after the ledger failed
/// behind a gateway charge, the same key with another amount gets 422, the
/// same request continues the operation, and the ledger shows one charge.
async fn a_failed_payment_retried_with_another_amount_gets_422_and_one_charge(store: Store) {
    let svc = Service::start(&store.url(), &[("PAYMENTS_FAULT_LEDGER_ONCE", "1")]).await;
    let tenant = idem_testkit::unique("bound");
    let failed = pay(svc.addr, &tenant, "k-bound", 4990).await;
    assert_eq!(failed.status, 503, "{failed:?}");
    let other = pay(svc.addr, &tenant, "k-bound", 9990).await;
    assert_eq!(other.status, 422, "{other:?}");
    assert_eq!(other.problem(), "idempotency-key-reused");
    let retried = pay(svc.addr, &tenant, "k-bound", 4990).await;
    assert_eq!(retried.status, 201, "{retried:?}");
    let (charges, calls, balance) = ledger(svc.addr, &tenant).await;
    assert_eq!((charges, calls, balance), (1, 2, 1_000_000 - 4990));
}

/// The key of a refund names the refund of one payment: the same key on
/// another payment's refund is another request (422), never a replay.
async fn a_refund_key_reused_on_another_payment_gets_422(store: Store) {
    let svc = Service::start(&store.url(), &[]).await;
    let tenant = idem_testkit::unique("refund");
    let a = pay(svc.addr, &tenant, "pay-a", 1000).await.json()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let b = pay(svc.addr, &tenant, "pay-b", 1000).await.json()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let refund = |payment: &str| post(&format!("/v1/payments/{payment}/refunds"), r#"{"amount": 100}"#);
    let first = refund(&a).bearer(&tenant).key("r-1").send(svc.addr).await;
    assert_eq!(first.status, 201, "{first:?}");
    let other = refund(&b).bearer(&tenant).key("r-1").send(svc.addr).await;
    assert_eq!(other.status, 422, "{other:?}");
    assert_eq!(other.problem(), "idempotency-key-reused");
    let replay = refund(&a).bearer(&tenant).key("r-1").send(svc.addr).await;
    assert_eq!(
        (replay.status, replay.header("idempotent-replayed")),
        (201, Some("true"))
    );
}

/// Payments that race near the balance: the balance is held before the
/// gateway is called, so every gateway charge is a payment, and the balance
/// never goes below zero.
async fn payments_near_the_balance_never_charge_without_a_payment(store: Store) {
    let svc = Service::start(&store.url(), &[]).await;
    let tenant = idem_testkit::unique("near");
    let replies = futures_util::future::join_all((0..15).map(|i| {
        let (addr, tenant) = (svc.addr, tenant.clone());
        async move { pay(addr, &tenant, &format!("near-{i}"), 100_000).await }
    }))
    .await;
    let created = replies.iter().filter(|r| r.status == 201).count();
    let poor = replies
        .iter()
        .filter(|r| r.status == 402 && r.json()["error"] == "insufficient_funds")
        .count();
    assert_eq!(
        (created, poor),
        (10, 5),
        "{:?}",
        replies.iter().map(|r| r.status).collect::<Vec<_>>()
    );
    let l = get("/v1/ledger").bearer(&tenant).send(svc.addr).await.json();
    assert_eq!(l["charges"], l["payments"], "{l}");
    assert_eq!(
        (l["payments"].as_i64(), l["balance"].as_i64()),
        (Some(10), Some(0)),
        "{l}"
    );
}

/// A declined card is the gateway's answer: the gateway was called once,
/// the balance is given back, and the retry replays without calling it.
async fn a_declined_retry_never_calls_the_gateway_again(store: Store) {
    let svc = Service::start(&store.url(), &[]).await;
    let tenant = idem_testkit::unique("declined");
    let body = r#"{"amount": 500, "currency": "EUR", "recipient": "acct_declined"}"#;
    let first = post("/v1/payments", body)
        .bearer(&tenant)
        .key("k-dec")
        .send(svc.addr)
        .await;
    assert_eq!(
        (first.status, first.json()["error"].as_str()),
        (402, Some("card_declined"))
    );
    let retry = post("/v1/payments", body)
        .bearer(&tenant)
        .key("k-dec")
        .send(svc.addr)
        .await;
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(ledger(svc.addr, &tenant).await, (0, 1, 1_000_000));
}

/// Every input error is a 4xx on every store (an overflowing refund too),
/// every 503 carries `Retry-After`, the scheme of `Authorization` is
/// case-insensitive, and `GET /health` answers without credentials.
async fn the_example_answers_input_errors_and_outages_alike_on_every_store(store: Store) {
    let svc = Service::start(&store.url(), &[]).await;
    let tenant = idem_testkit::unique("edges");
    let paid = post("/v1/payments", &payment(1000))
        .header("authorization", format!("bearer {tenant}"))
        .key("k-lower")
        .send(svc.addr)
        .await;
    assert_eq!(paid.status, 201, "a lower-case scheme: {paid:?}");
    let id = paid.json()["id"].as_str().unwrap().to_owned();
    let refund = |amount: &str, key: &str| {
        post(
            &format!("/v1/payments/{id}/refunds"),
            &format!(r#"{{"amount": {amount}}}"#),
        )
        .bearer(&tenant)
        .key(key)
    };
    let huge = refund("9223372036854775807", "k-huge").send(svc.addr).await;
    assert_eq!(huge.status, 422, "{huge:?}");
    // A body of the wrong shape, or not JSON: a problem, as every refusal.
    for (body, status) in [
        (
            r#"{"amount": "5", "currency": "EUR", "recipient": "acct_bob"}"#,
            422,
        ),
        (r#"{"amount": 5, "currency": "EUR"}"#, 422),
        (r#"{"amount": 5,"#, 400),
    ] {
        let refused = post("/v1/payments", body)
            .bearer(&tenant)
            .key(&idem_testkit::unique("k-shape"))
            .send(svc.addr)
            .await;
        assert_eq!(
            (refused.status, refused.header("content-type")),
            (status, Some("application/problem+json")),
            "{refused:?}"
        );
        assert_eq!(refused.json()["type"], "urn:payments:problem:invalid-body");
    }
    let down = post(
        "/v1/payments",
        r#"{"amount": 5, "currency": "EUR", "recipient": "acct_unavailable"}"#,
    )
    .bearer(&tenant)
    .key("k-down")
    .send(svc.addr)
    .await;
    assert_eq!((down.status, down.header("retry-after")), (503, Some("2")));
    assert_eq!(
        ledger(svc.addr, &tenant).await.2,
        1_000_000 - 1000,
        "the failed payment's hold is given back"
    );
    let health = get("/health").send(svc.addr).await;
    assert_eq!(
        (health.status, health.json()["status"].as_str()),
        (200, Some("ok"))
    );
}

/// Text a database cannot hold is refused before anything happens: a
/// recipient with a NUL (PostgreSQL's `text` refuses U+0000, so the payment
/// could never be written after its charge) or another control character
/// gets 422 with nothing held or charged, and a payment id with one reads
/// as no payment (404), never as the database being down.
async fn text_no_database_can_hold_is_refused_before_any_charge(store: Store) {
    let svc = Service::start(&store.url(), &[]).await;
    let tenant = idem_testkit::unique("nul");
    for (n, recipient) in [r"bob\u0000", r"bob\u001b[31m", r"bob\u0085"].iter().enumerate() {
        let body = format!(r#"{{"amount": 100, "currency": "EUR", "recipient": "{recipient}"}}"#);
        let key = format!("k-nul-{n}");
        for _ in 0..2 {
            let r = post("/v1/payments", &body)
                .bearer(&tenant)
                .key(&key)
                .send(svc.addr)
                .await;
            assert_eq!(
                (r.status, r.json()["type"].as_str()),
                (422, Some("urn:payments:problem:invalid-request")),
                "{recipient}: {r:?}"
            );
        }
    }
    assert_eq!(ledger(svc.addr, &tenant).await, (0, 0, 1_000_000));
    let read = get("/v1/payments/pay_%00").bearer(&tenant).send(svc.addr).await;
    assert_eq!(read.status, 404, "{read:?}");
    for _ in 0..2 {
        let refund = post("/v1/payments/pay_%00/refunds", r#"{"amount": 1}"#)
            .bearer(&tenant)
            .key("k-nul-refund")
            .send(svc.addr)
            .await;
        assert_eq!(refund.status, 404, "{refund:?}");
    }
    // An id that is not UTF-8 once decoded is an id the service never
    // makes: its 404 problem, not the router's plain-text 400.
    let not_found = |r: &Reply| {
        assert_eq!(
            (r.status, r.json()["type"].as_str()),
            (404, Some("urn:payments:problem:payment-not-found")),
            "{r:?}"
        );
    };
    for path in ["/v1/payments/%FF", "/v1/payments/pay_%C3%28"] {
        not_found(&get(path).bearer(&tenant).send(svc.addr).await);
    }
    let (tenant, addr) = (&tenant, svc.addr);
    let refund = |payment: &str| {
        let path = format!("/v1/payments/{payment}/refunds");
        async move {
            post(&path, r#"{"amount": 1}"#)
                .bearer(tenant)
                .key("k-not-utf8-refund")
                .send(addr)
                .await
        }
    };
    for _ in 0..2 {
        not_found(&refund("%FF").await);
    }
    let replayed = refund("%FF").await;
    assert_eq!(
        replayed.header("idempotent-replayed"),
        Some("true"),
        "stored: {replayed:?}"
    );
    let other = refund("%FE").await;
    assert_eq!(other.status, 422, "another path under the key: {other:?}");
}

// Each scenario on a temporary SQLite file and on PostgreSQL.
idem_testkit::for_each_store! {
    stores: [sqlite, postgres],
    setup: |kind| Store::of(kind).await,
    worker_threads: 4,
    cases: [
        twenty_concurrent_requests_make_one_charge,
        a_failed_payment_retried_with_another_amount_gets_422_and_one_charge,
        a_refund_key_reused_on_another_payment_gets_422,
        payments_near_the_balance_never_charge_without_a_payment,
        a_declined_retry_never_calls_the_gateway_again,
        the_example_answers_input_errors_and_outages_alike_on_every_store,
        a_crash_after_the_charge_is_taken_over_without_a_second_charge,
        a_crash_before_the_commit_leaves_nothing_behind,
        a_stop_signal_mid_payment_lets_it_finish_and_answer,
        a_stop_signal_after_the_client_left_lets_the_payment_finish,
        slow_headers_are_cut_off_and_a_slow_body_takes_no_key,
        text_no_database_can_hold_is_refused_before_any_charge,
    ],
}

/// Slowloris: a client that never finishes its request head is
/// disconnected after `PAYMENTS_HEADER_TIMEOUT`; one whose body trickles
/// gets 408 after `PAYMENTS_BODY_TIMEOUT`, and its key was never taken (the
/// same request, whole, runs at once). The service serves throughout.
async fn slow_headers_are_cut_off_and_a_slow_body_takes_no_key(store: Store) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let env = [("PAYMENTS_HEADER_TIMEOUT", "1s"), ("PAYMENTS_BODY_TIMEOUT", "1s")];
    let svc = Service::start(&store.url(), &env).await;
    let mut slow_head = tokio::net::TcpStream::connect(svc.addr).await.unwrap();
    slow_head
        .write_all(b"POST /v1/payments HTTP/1.1\r\nhost: x\r\nauthorization: Bearer acct_slow\r\n")
        .await
        .unwrap();
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(10), slow_head.read_to_end(&mut rest)).await;
    assert!(closed.is_ok(), "a head that never ends holds its connection");

    let body = payment(700);
    let mut slow_body = tokio::net::TcpStream::connect(svc.addr).await.unwrap();
    let head = format!(
        "POST /v1/payments HTTP/1.1\r\nhost: x\r\nconnection: close\r\nauthorization: Bearer acct_slow\r\n\
         idempotency-key: k-slow-body\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    slow_body.write_all(head.as_bytes()).await.unwrap();
    slow_body.write_all(&body.as_bytes()[..10]).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), slow_body.read_to_end(&mut answer))
        .await
        .expect("a trickling body is answered")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(
        answer.contains("retry-after") || answer.contains("body-timeout"),
        "{answer}"
    );

    let whole = pay(svc.addr, "acct_slow", "k-slow-body", 700).await;
    assert_eq!(whole.status, 201, "the key was never taken: {whole:?}");
    assert_eq!(ledger(svc.addr, "acct_slow").await.0, 1);
}

/// Two service processes on one PostgreSQL behave as one service.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_two_instances_split_forty_requests_and_make_one_charge() {
    let Some(store) = Store::postgres().await else {
        return;
    };
    let env = [("PAYMENTS_GATEWAY_DELAY_MS", "800")];
    let url = store.url();
    let (a, b) = tokio::join!(Service::start(&url, &env), Service::start(&url, &env));
    let tenant = idem_testkit::unique("two_instances");
    let (executed, replayed, conflicts, others) = storm(&[a.addr, b.addr], &tenant, 40).await;
    assert_eq!(executed, 1);
    assert_eq!(replayed + conflicts, 39, "others: {others:?}");
    assert_eq!(ledger(a.addr, &tenant).await.0, 1);
    assert_eq!(ledger(b.addr, &tenant).await.0, 1);
}

/// A payment stuck behind its tenant's account row, which another
/// transaction holds, is answered 503 within the service's lock timeout
/// (5 s) and its key released: it does not hold its key, every retry
/// answered 409, for as long as the row is held. Once the row is free, the
/// retry with the same key pays, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_a_payment_stuck_on_a_held_row_is_released_within_the_lock_timeout() {
    let Some(store) = Store::postgres().await else {
        return;
    };
    let answered = stuck_on_a_held_row(&store.url()).await;
    assert!(
        answered > Duration::from_secs(4) && answered < Duration::from_secs(12),
        "answered after {answered:?}, not at the service's 5 s lock timeout"
    );
}

/// The operator's own lock timeout (in `DATABASE_URL`'s `options`) is the
/// one a stuck payment waits for: one shorter than the service's (1 s), and
/// one longer than the service's statement timeout (12 s against 10 s),
/// which the service then does not add to cut it short.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_the_operators_lock_timeout_is_kept() {
    let Some(store) = Store::postgres().await else {
        return;
    };
    let url = store.url();
    let (short_url, long_url) = (
        format!("{url}%20-c%20lock_timeout%3D1s"),
        format!("{url}%20-c%20lock_timeout%3D12s"),
    );
    let (short, long) = tokio::join!(stuck_on_a_held_row(&short_url), stuck_on_a_held_row(&long_url));
    assert!(
        short < Duration::from_secs(4),
        "answered after {short:?}, not at the operator's 1 s"
    );
    assert!(
        long > Duration::from_millis(11_500),
        "answered after {long:?}, before the operator's 12 s"
    );
}

/// Pays once for a fresh tenant, then again with its account row held by a
/// test transaction: the stuck payment must be answered 503 while the row
/// is still held; the retry with its key, once the row is free, pays once.
/// Returns how long the stuck payment took to be answered.
async fn stuck_on_a_held_row(url: &str) -> Duration {
    let url = url.to_owned();
    let svc = Service::start(&url, &[]).await;
    let tenant = idem_testkit::unique("held_row");
    assert_eq!(pay(svc.addr, &tenant, "opens-the-account", 100).await.status, 201);

    let holder = sqlx::PgPool::connect(&url).await.unwrap();
    let mut held = holder.begin().await.unwrap();
    sqlx::query("SELECT balance FROM accounts WHERE tenant = $1 FOR UPDATE")
        .bind(&tenant)
        .fetch_one(&mut *held)
        .await
        .unwrap();
    let started = Instant::now();
    let stuck = tokio::time::timeout(Duration::from_secs(20), pay(svc.addr, &tenant, "stuck", 200))
        .await
        .expect("the payment waited for the row as long as it was held");
    let answered = started.elapsed();
    assert_eq!(stuck.status, 503, "{stuck:?}");
    held.rollback().await.unwrap();

    let retried = pay(svc.addr, &tenant, "stuck", 200).await;
    assert_eq!(retried.status, 201, "the key was released: {retried:?}");
    assert_eq!(retried.header("idempotent-replayed"), None);
    let (charges, _, balance) = ledger(svc.addr, &tenant).await;
    assert_eq!((charges, balance), (2, 1_000_000 - 300));
    answered
}

/// Both instances replay what the other stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_two_processes_on_one_file_share_their_records() {
    let store = Store::sqlite();
    let url = store.url();
    let (a, b) = tokio::join!(Service::start(&url, &[]), Service::start(&url, &[]));
    let tenant = idem_testkit::unique("two_files");
    let first = pay(a.addr, &tenant, "k", 100).await;
    let again = pay(b.addr, &tenant, "k", 100).await;
    assert_eq!((first.status, again.status), (201, 201));
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.body, first.body);
    assert_eq!(ledger(b.addr, &tenant).await.0, 1);
}

async fn wait_for_charge(addr: SocketAddr, tenant: &str) {
    let started = Instant::now();
    while ledger(addr, tenant).await.0 < 1 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the gateway never charged"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// SIGTERM (a deploy, a restart) while a payment is between the gateway's
/// charge and its completion: the service stops accepting, lets the
/// payment finish, answers it, and exits 0; the restarted service replays
/// it. Nothing is lost and no lock is left, where a crash leaves the key
/// locked until its deadline.
async fn a_stop_signal_mid_payment_lets_it_finish_and_answer(store: Store) {
    let url = store.url();
    let tenant = idem_testkit::unique("stop_signal");
    let mut svc = Service::start(&url, &[("PAYMENTS_FAULT_AFTER_CHARGE_MS", "1500")]).await;
    let addr = svc.addr;
    let t = tenant.clone();
    let pending = tokio::spawn(async move { pay(addr, &t, "stop-key", 2500).await });
    wait_for_charge(svc.addr, &tenant).await;
    let signalled = Command::new("kill")
        .args(["-TERM", &svc.child.id().to_string()])
        .status()
        .unwrap();
    assert!(signalled.success());
    let answered = pending.await.unwrap();
    assert_eq!(answered.status, 201, "{answered:?}");
    let exited = svc.child.wait().unwrap();
    assert!(exited.success(), "{exited:?}");

    let svc = Service::start(&url, &[]).await;
    let replay = pay(svc.addr, &tenant, "stop-key", 2500).await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"), "{replay:?}");
    assert_eq!(replay.body, answered.body);
    let (charges, calls, balance) = ledger(svc.addr, &tenant).await;
    assert_eq!((charges, calls, balance), (1, 1, 1_000_000 - 2500));
}

/// The same, once the payment's client has gone away (its execution goes on
/// in a task of idem's, which no connection waits for): the service waits
/// for it (`Idem::idle`) before it exits, and the restarted service
/// replays it rather than answering 409 until the lock's deadline.
async fn a_stop_signal_after_the_client_left_lets_the_payment_finish(store: Store) {
    use tokio::io::AsyncWriteExt as _;
    let url = store.url();
    let tenant = idem_testkit::unique("stop_gone");
    let mut svc = Service::start(&url, &[("PAYMENTS_FAULT_AFTER_CHARGE_MS", "3000")]).await;
    let body = payment(2500);
    let mut client = tokio::net::TcpStream::connect(svc.addr).await.unwrap();
    let request = format!(
        "POST /v1/payments HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {tenant}\r\n\
         idempotency-key: gone-key\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    client.write_all(request.as_bytes()).await.unwrap();
    wait_for_charge(svc.addr, &tenant).await;
    drop(client);
    // Time for the server to see the client gone (either way the payment
    // must finish: this only makes the detached path the one taken).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let signalled = Command::new("kill")
        .args(["-TERM", &svc.child.id().to_string()])
        .status()
        .unwrap();
    assert!(signalled.success());
    let exited = svc.child.wait().unwrap();
    assert!(exited.success(), "{exited:?}");

    let svc = Service::start(&url, &[]).await;
    let replay = pay(svc.addr, &tenant, "gone-key", 2500).await;
    assert_eq!(
        (replay.status, replay.header("idempotent-replayed")),
        (201, Some("true")),
        "{replay:?}"
    );
    let (charges, calls, balance) = ledger(svc.addr, &tenant).await;
    assert_eq!((charges, calls, balance), (1, 1, 1_000_000 - 2500));
}

/// SIGKILL between the gateway call and the completion: the key stays
/// locked (409) until its deadline, then a takeover (attempt 2) resumes
/// from the recovery point, reuses the derived key, and completes.
async fn a_crash_after_the_charge_is_taken_over_without_a_second_charge(store: Store) {
    let url = store.url();
    let tenant = idem_testkit::unique("crash_charge");
    // Long enough that the lock the dead owner leaves (at least two thirds
    // of it: the keeper extends it every third) outlasts the restart.
    let lock = [("IDEM_LOCK_TIMEOUT", "5s")];
    let svc = Service::start(&url, &[lock[0], ("PAYMENTS_FAULT_AFTER_CHARGE_MS", "60000")]).await;
    let addr = svc.addr;
    let t = tenant.clone();
    let pending = tokio::spawn(async move { pay(addr, &t, "crash-key", 2500).await });
    wait_for_charge(svc.addr, &tenant).await;
    svc.kill();
    let _ = pending.await; // the connection died with the process

    let svc = Service::start(&url, &lock).await;
    let early = pay(svc.addr, &tenant, "crash-key", 2500).await;
    assert_eq!(
        early.status, 409,
        "the dead owner's lock holds until its deadline"
    );
    let retry_after: u64 = early.header("retry-after").unwrap().parse().unwrap();
    assert!(retry_after <= 5, "{retry_after}");
    tokio::time::sleep(Duration::from_millis(5300)).await;

    let taken = pay(svc.addr, &tenant, "crash-key", 2500).await;
    assert_eq!(taken.status, 201, "{taken:?}");
    assert_eq!(taken.header("idempotent-replayed"), None);
    let (payments, state, attempt) = store.inspect(&tenant).await;
    assert_eq!(
        (payments, state.as_deref(), attempt),
        (1, Some("completed"), Some(2))
    );
    let (charges, calls, balance) = ledger(svc.addr, &tenant).await;
    assert_eq!(
        (charges, calls, balance),
        (1, 2, 1_000_000 - 2500),
        "one charge; the gateway saw the key twice"
    );
    let replay = pay(svc.addr, &tenant, "crash-key", 2500).await;
    assert_eq!(replay.body, taken.body);
}

/// SIGKILL after the payment row is written and before it commits: neither
/// the row nor the completion exists; the retry executes once.
async fn a_crash_before_the_commit_leaves_nothing_behind(store: Store) {
    let url = store.url();
    let tenant = idem_testkit::unique("crash_commit");
    let lock = ("IDEM_LOCK_TIMEOUT", "2s");
    let svc = Service::start(&url, &[lock, ("PAYMENTS_FAULT_BEFORE_COMMIT_MS", "60000")]).await;
    let addr = svc.addr;
    let t = tenant.clone();
    let pending = tokio::spawn(async move { pay(addr, &t, "commit-key", 700).await });
    wait_for_charge(svc.addr, &tenant).await;
    // The payment is written inside the open transaction by now.
    tokio::time::sleep(Duration::from_millis(500)).await;
    svc.kill();
    let _ = pending.await;

    let (payments, state, _) = store.inspect(&tenant).await;
    assert_eq!(payments, 0, "the uncommitted payment row must not exist");
    assert_eq!(state.as_deref(), Some("in_progress"), "no completion was stored");

    let svc = Service::start(&url, &[lock]).await;
    tokio::time::sleep(Duration::from_millis(2300)).await;
    let retry = pay(svc.addr, &tenant, "commit-key", 700).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    let again = pay(svc.addr, &tenant, "commit-key", 700).await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    let (payments, state, attempt) = store.inspect(&tenant).await;
    assert_eq!(
        (payments, state.as_deref(), attempt),
        (1, Some("completed"), Some(2))
    );
    let (charges, _, balance) = ledger(svc.addr, &tenant).await;
    assert_eq!((charges, balance), (1, 1_000_000 - 700));
}

/// The README's contract for clients of the example: auth, validation,
/// stored declines, released outages and panics, refunds, lookups.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_the_example_answers_as_its_readme_says() {
    let store = Store::sqlite();
    let svc = Service::start(&store.url(), &[]).await;
    let addr = svc.addr;
    let t = idem_testkit::unique("contract");

    let anon = post("/v1/payments", &payment(1)).key("k").send(addr).await;
    assert_eq!(anon.status, 401);
    assert_eq!(anon.header("content-type"), Some("application/problem+json"));
    let bad = post("/v1/payments", &payment(1))
        .bearer("not a token!")
        .key("k")
        .send(addr)
        .await;
    assert_eq!(bad.status, 401);
    // Two credentials are ambiguous: refused before anything is held or
    // charged, whichever comes first.
    let two = post("/v1/payments", &payment(1))
        .bearer(&t)
        .header("authorization", format!("Bearer {t}-other"))
        .key("k-two")
        .send(addr)
        .await;
    assert_eq!(two.status, 401, "{two:?}");
    assert_eq!(two.header("www-authenticate"), Some("Bearer"));

    let created = pay(addr, &t, "p1", 4990).await;
    assert_eq!(created.status, 201);
    let id = created.json()["id"].as_str().unwrap().to_owned();
    assert_eq!(
        created.header("location"),
        Some(format!("/v1/payments/{id}").as_str())
    );
    assert_eq!(created.json()["status"], "succeeded");
    assert_eq!(
        get(&format!("/v1/payments/{id}"))
            .bearer(&t)
            .send(addr)
            .await
            .status,
        200
    );
    assert_eq!(
        get(&format!("/v1/payments/{id}"))
            .bearer("someone_else")
            .send(addr)
            .await
            .status,
        404
    );

    let invalid = post(
        "/v1/payments",
        r#"{"amount": 5, "currency": "eur", "recipient": "x"}"#,
    )
    .bearer(&t)
    .key("p2")
    .send(addr)
    .await;
    assert_eq!(invalid.status, 422);
    let fixed = post(
        "/v1/payments",
        r#"{"amount": 5, "currency": "EUR", "recipient": "x"}"#,
    )
    .bearer(&t)
    .key("p2")
    .send(addr)
    .await;
    assert_eq!(fixed.status, 201, "a 422 releases the key for the fixed request");

    let poor = pay(addr, &t, "p3", 2_000_000).await;
    assert_eq!(
        (poor.status, poor.json()["error"].as_str()),
        (402, Some("insufficient_funds"))
    );
    let declined = post(
        "/v1/payments",
        r#"{"amount": 5, "currency": "EUR", "recipient": "acct_declined"}"#,
    )
    .bearer(&t)
    .key("p4")
    .send(addr)
    .await;
    assert_eq!(
        (declined.status, declined.json()["error"].as_str()),
        (402, Some("card_declined"))
    );

    let panic_body = r#"{"amount": 5, "currency": "EUR", "recipient": "acct_panic"}"#;
    assert_eq!(
        post("/v1/payments", panic_body)
            .bearer(&t)
            .key("p5")
            .send(addr)
            .await
            .status,
        500
    );
    assert_eq!(
        post("/v1/payments", panic_body)
            .bearer(&t)
            .key("p5")
            .send(addr)
            .await
            .status,
        500
    );

    let path = format!("/v1/payments/{id}/refunds");
    let refund = |amount: i64| post(&path, &format!(r#"{{"amount": {amount}}}"#)).bearer(&t);
    assert_eq!(refund(4000).key("r1").send(addr).await.status, 201);
    assert_eq!(
        refund(4000)
            .key("r1")
            .send(addr)
            .await
            .header("idempotent-replayed"),
        Some("true")
    );
    assert_eq!(
        refund(1000).key("r2").send(addr).await.status,
        422,
        "more than the payment"
    );
    let (_, _, balance) = ledger(addr, &t).await;
    assert_eq!(balance, 1_000_000 - 4990 - 5 + 4000);
}

/// Runs the example with `env` until it exits by itself (within 20 s), and
/// returns its exit status and everything it wrote.
fn run_to_exit(env: &[(&str, &str)]) -> (std::process::ExitStatus, String) {
    let mut cmd = Command::new(example_binary());
    cmd.env("PAYMENTS_ADDR", format!("127.0.0.1:{}", free_port()))
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let child = cmd.spawn().unwrap();
    let started = Instant::now();
    let out = child.wait_with_output().unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "the example did not give up in time"
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status, text)
}

/// `--help` lists the settings and starts nothing (no database file is
/// made where it runs); another argument is refused, a setting that is not
/// UTF-8 too, and an address that is not an IP address and a port says
/// what it needs.
#[test]
fn help_lists_the_settings_and_bad_starts_say_what_is_needed() {
    // Run with `arg` in `dir`, killed (and failed) if it does not exit by
    // itself within 20 s: an example binary built before `--help` existed
    // would serve.
    let run = |arg: &str, dir: &std::path::Path| {
        let mut cmd = Command::new(example_binary());
        if arg.starts_with('-') {
            cmd.arg(arg);
        } else {
            // `NAME`: that setting, not UTF-8.
            use std::os::unix::ffi::OsStrExt as _;
            cmd.env("PAYMENTS_ADDR", format!("127.0.0.1:{}", free_port()))
                .env(
                    arg,
                    std::ffi::OsStr::from_bytes(b"postgres://app:\xff@127.0.0.1/payments"),
                );
        }
        let mut child = cmd
            .current_dir(dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                child.kill().unwrap();
                panic!(
                    "`payments {arg}` did not exit within 20 s: it serves (a stale example binary? cargo build --example payments)"
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        child.wait_with_output().unwrap()
    };
    let dir = tempfile::tempdir().unwrap();
    let out = run("--help", dir.path());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        text.contains("PAYMENTS_ADDR") && text.contains("DATABASE_URL"),
        "{text}"
    );
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "nothing made");
    let out = run("--port=9000", dir.path());
    let text = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(
        text.contains("takes no arguments") && text.contains("--help"),
        "{text}"
    );
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "nothing made");
    // A setting that is not UTF-8 is refused, not taken for unset (a
    // `DATABASE_URL` fell back to a local SQLite file).
    for name in ["DATABASE_URL", "IDEM_TTL", "RUST_LOG"] {
        let out = run(name, dir.path());
        let text = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{name}: {text}");
        assert!(
            text.contains(&format!("{name}: its value is not UTF-8")),
            "{text}"
        );
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "{name}: nothing made"
        );
    }
    // So does the demo, which ran its scenarios on a temporary SQLite
    // file instead.
    {
        use std::os::unix::ffi::OsStrExt as _;
        let demo = example_binary().with_file_name("demo");
        let out = Command::new(demo)
            .env(
                "DATABASE_URL",
                std::ffi::OsStr::from_bytes(b"postgres://app:\xff@127.0.0.1/payments"),
            )
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "demo: {text}");
        assert!(text.contains("DATABASE_URL: its value is not UTF-8"), "{text}");
    }
    // A log filter that does not parse is refused, not taken for `info`.
    let (status, text) = run_to_exit(&[("RUST_LOG", "[[[")]);
    assert_eq!(status.code(), Some(2), "{text}");
    assert!(text.contains("RUST_LOG: "), "{text}");
    let (status, text) = run_to_exit(&[("PAYMENTS_ADDR", "localhost:8081")]);
    assert_eq!(status.code(), Some(2), "{text}");
    assert!(
        text.contains("such as 127.0.0.1:8080, got `localhost:8081`"),
        "{text}"
    );
}

/// A start that cannot reach its database fails, says why, and never logs
/// the password, in the user info or as a query parameter.
#[test]
fn a_failed_start_says_why_and_logs_no_password() {
    let closed = free_port();
    for url in [
        format!("postgres://idem:s3cret-pw@127.0.0.1:{closed}/payments"),
        format!("postgres://idem@127.0.0.1:{closed}/payments?password=s3cret-pw&sslmode=disable"),
        format!("postgres://idem@127.0.0.1:{closed}/payments?pass%77ord=s3cret-pw"),
    ] {
        let (status, text) = run_to_exit(&[("DATABASE_URL", &url)]);
        assert!(!status.success(), "{text}");
        assert!(!text.contains("s3cret-pw"), "the password was logged: {text}");
        assert!(
            text.to_lowercase().contains("refused"),
            "the cause is named: {text}"
        );
    }
    for url in [
        "mysql://root:s3cret-pw@127.0.0.1/x",
        "host=127.0.0.1 user=postgres password=s3cret-pw dbname=test",
        "postgres:postgres:s3cret-pw@127.0.0.1:1/test",
        "postgres://postgres:abc/s3cret-pw@127.0.0.1:5432/test",
        "postgres://idem:s3cret-pw?x@127.0.0.1:1/payments",
    ] {
        let (status, text) = run_to_exit(&[("DATABASE_URL", url)]);
        assert!(!status.success() && !text.contains("s3cret-pw"), "{url}: {text}");
    }
    // Settings that would turn the protection off are refused before anything opens.
    for (name, value) in [
        ("IDEM_TTL", "0s"),
        ("IDEM_LOCK_TIMEOUT", "0s"),
        ("IDEM_TTL", "99999999999999999d"),
    ] {
        let (status, text) = run_to_exit(&[
            ("DATABASE_URL", "sqlite:///nonexistent-dir/x/p.db"),
            (name, value),
        ]);
        assert!(!status.success() && text.contains(name), "{name}={value}: {text}");
        assert!(
            !text.contains("unable to open"),
            "{name}={value} is checked first: {text}"
        );
    }
}

/// What the example logs, to a pipe, from its start until it listens on
/// `url`'s database; then it is stopped.
async fn logs_until_listening(url: &str) -> String {
    let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let mut child = tokio::process::Command::new(example_binary())
        .env("PAYMENTS_ADDR", addr.to_string())
        .env("DATABASE_URL", url)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    tokio::time::timeout(Duration::from_secs(30), async {
        use tokio::io::AsyncReadExt as _;
        while !String::from_utf8_lossy(&seen).contains("listening") {
            let n = stderr.read(&mut buf).await.unwrap();
            assert!(n > 0, "the example ended: {}", String::from_utf8_lossy(&seen));
            seen.extend_from_slice(&buf[..n]);
        }
    })
    .await
    .expect("the example logs that it listens");
    child.kill().await.unwrap();
    String::from_utf8_lossy(&seen).into_owned()
}

/// Logs written to a pipe carry no terminal colour codes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_to_a_pipe_are_plain_text() {
    let dir = tempfile::tempdir().unwrap();
    let seen = logs_until_listening(&format!("sqlite://{}", dir.path().join("p.db").display())).await;
    assert!(!seen.contains('\x1b'), "colour codes in a pipe: {seen:?}");
}

/// A start on PostgreSQL logs no notice of idem's migrations or of the
/// service's own tables ("relation ... already exists, skipping"): not the
/// first, which makes them, nor one on tables that are there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starts_on_postgres_log_no_notices() {
    let Some(store) = Store::postgres().await else {
        return;
    };
    let first = logs_until_listening(&store.url()).await;
    assert!(!first.contains("notice"), "{first}");
    let second = logs_until_listening(&store.url()).await;
    assert!(!second.contains("notice"), "{second}");
}
