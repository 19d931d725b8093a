//! The lease over real HTTP: it covers the handler, the production of its
//! answer and the recording of the completion; a reservation runs to its end
//! or is undone; a fenced-out execution never answers with a result that
//! will not be replayed. Races are pinned with pause points and row locks,
//! never with sleeps that hope for an ordering.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use futures_util::StreamExt as _;
use idem::store::{RecordId, StoredResponse};
use idem::{idempotent, Idem, IdempotencyStore, Operation, StoreError};
use idem_runtime::pause;
use idem_testkit::http::post as post_req;
use idem_testkit::StoreKind;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::AsyncReadExt;
use tokio::sync::{mpsc, Notify};

#[derive(Clone)]
struct App {
    /// How many times each handler ran.
    runs: Arc<Mutex<HashMap<&'static str, u32>>>,
    /// What handlers report while they run.
    events: mpsc::UnboundedSender<&'static str>,
    /// Lets a waiting handler (or its body) go on.
    gate: Arc<Notify>,
    /// Told when the server dropped a request before answering it.
    dropped: Arc<Notify>,
    /// The PostgreSQL schema of the test, for the transaction handler.
    schema: Option<String>,
}

impl App {
    fn ran(&self, name: &'static str) -> u32 {
        let mut runs = self.runs.lock().unwrap();
        let n = runs.entry(name).or_default();
        *n += 1;
        *n
    }

    fn runs(&self, name: &'static str) -> u32 {
        self.runs.lock().unwrap().get(name).copied().unwrap_or(0)
    }
}

fn chunk(s: &'static str) -> Result<axum::body::Bytes, std::io::Error> {
    Ok(axum::body::Bytes::from_static(s.as_bytes()))
}

/// Its body takes as long as the test wants: far past the lock timeout.
#[idempotent(scope = "lease.slow_body", lock_timeout = "1s")]
async fn slow_body(State(app): State<App>) -> Response {
    app.ran("slow_body");
    app.events.send("slow_body").unwrap();
    let gate = app.gate.clone();
    let rest = async move {
        gate.notified().await;
        chunk("part2")
    };
    let body = futures_util::stream::iter([chunk("part1,")]).chain(futures_util::stream::once(rest));
    (StatusCode::CREATED, Body::from_stream(body)).into_response()
}

/// A server-sent event stream that never ends.
#[idempotent(scope = "lease.events")]
async fn event_stream(State(app): State<App>) -> Response {
    app.ran("events");
    let body = futures_util::stream::iter([chunk("data: hello\n\n")]).chain(futures_util::stream::pending());
    (
        [(header::CONTENT_TYPE, "text/event-stream")],
        Body::from_stream(body),
    )
        .into_response()
}

/// Its first body breaks after one chunk; later ones are whole.
#[idempotent(scope = "lease.broken_body")]
async fn broken_body(State(app): State<App>, op: Operation) -> Response {
    let n = app.ran("broken_body");
    let end = if n == 1 {
        Err(std::io::Error::other("the disk went away"))
    } else {
        chunk("}")
    };
    let body = futures_util::stream::iter([Ok(format!("{{\"attempt\":{}", op.attempt()).into()), end]);
    (StatusCode::CREATED, Body::from_stream(body)).into_response()
}

/// Its first body panics while it is produced.
#[idempotent(scope = "lease.panicky_body")]
async fn panicky_body(State(app): State<App>, op: Operation) -> Response {
    let n = app.ran("panicky_body");
    let attempt = op.attempt();
    let body = futures_util::stream::once(async move {
        assert!(n > 1, "the body panics");
        Ok::<_, std::io::Error>(format!("attempt {attempt}"))
    });
    (StatusCode::CREATED, Body::from_stream(body)).into_response()
}

/// Waits until its lease is lost, then checks that checkpoints are refused.
#[idempotent(scope = "lease.lost", lock_timeout = "300ms")]
async fn loses_its_lease(State(app): State<App>, op: Operation) -> (StatusCode, &'static str) {
    app.ran("lease_lost");
    app.events.send("lease_lost").unwrap();
    op.lease_lost().await;
    assert!(op.is_lease_lost());
    if op.checkpoint("late").await == Err(StoreError::LockLost) {
        app.events.send("checkpoint_refused").unwrap();
    }
    (StatusCode::CREATED, "first")
}

/// Waits for the test, then checkpoints (which another execution's token
/// on the record refuses) and says whether it was told its lease is lost.
/// Its lock runs for 10 s: only the checkpoint's refusal can tell it.
#[idempotent(scope = "lease.checkpointed", lock_timeout = "10s")]
async fn checkpoints_after_a_takeover(State(app): State<App>, op: Operation) -> StatusCode {
    app.ran("checkpointed");
    let go = app.gate.notified();
    app.events.send("checkpointing").unwrap();
    go.await;
    assert_eq!(op.checkpoint("late").await, Err(StoreError::LockLost));
    let told = op.is_lease_lost() && futures_util::FutureExt::now_or_never(op.lease_lost()).is_some();
    app.events
        .send(if told { "told_lost" } else { "not_told" })
        .unwrap();
    StatusCode::CREATED
}

/// A plain handler; a retry waits for a first execution in progress.
#[idempotent(scope = "lease.plain", wait = "10s")]
async fn plain(State(app): State<App>) -> (StatusCode, String) {
    let n = app.ran("plain");
    (StatusCode::CREATED, format!("run {n}"))
}

/// Writes a row in its transaction, then waits for the test.
#[idempotent(scope = "lease.tx")]
async fn in_transaction(
    State(app): State<App>,
    op: Operation,
) -> Result<(StatusCode, &'static str), StoreError> {
    app.ran("tx");
    let schema = app.schema.clone().unwrap();
    let mut conn = op.pg_transaction().await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{schema}\".side (id) VALUES ('written')"
    )))
    .execute(&mut *conn)
    .await
    .map_err(|e| StoreError::backend(e.to_string()))?;
    drop(conn);
    app.events.send("in_tx").unwrap();
    app.gate.notified().await;
    Ok((StatusCode::CREATED, "committed"))
}

/// Blocks its thread (the sanctioned way, `block_in_place`) for two and a
/// half lock timeouts: the lease must hold all the same.
#[idempotent(scope = "lease.blocking", lock_timeout = "1s")]
async fn blocking(State(app): State<App>) -> (StatusCode, String) {
    let n = app.ran("blocking");
    app.events.send("blocking").unwrap();
    tokio::task::block_in_place(|| std::thread::sleep(Duration::from_millis(2500)));
    (StatusCode::CREATED, format!("run {n}"))
}

/// Stops early when told its lease is lost, as `Operation::lease_lost`
/// teaches: that early answer must never be given or stored.
#[idempotent(scope = "lease.stops", lock_timeout = "300ms")]
async fn stops_when_its_lease_is_lost(State(app): State<App>, op: Operation) -> &'static str {
    let n = app.ran("stops");
    app.events.send("stops").unwrap();
    if n > 1 {
        return "done";
    }
    tokio::select! {
        () = app.gate.notified() => "done",
        () = op.lease_lost() => "stopped",
    }
}

/// First run: a first request fails (released); later ones succeed.
#[idempotent(scope = "lease.flaky", lock_timeout = "5s")]
async fn flaky(State(app): State<App>) -> (StatusCode, String) {
    let n = app.ran("flaky");
    if n == 1 {
        (StatusCode::SERVICE_UNAVAILABLE, "gateway down".into())
    } else {
        (StatusCode::CREATED, format!("run {n}"))
    }
}

fn filler(n: usize) -> Result<axum::body::Bytes, std::io::Error> {
    Ok(axum::body::Bytes::from(vec![b'x'; n]))
}

/// A body past the stored limit (1024 bytes) that fails once it is past it.
#[idempotent(scope = "lease.big_broken")]
async fn big_broken(State(app): State<App>) -> Response {
    let n = app.ran("big_broken");
    let end = if n == 1 {
        Err(std::io::Error::other("the disk went away"))
    } else {
        filler(10)
    };
    let body = futures_util::stream::iter([filler(800), filler(800), end]);
    (StatusCode::CREATED, Body::from_stream(body)).into_response()
}

/// A body past the stored limit whose end waits for the test.
#[idempotent(scope = "lease.big_slow")]
async fn big_slow(State(app): State<App>) -> Response {
    app.ran("big_slow");
    let gate = app.gate.clone();
    let events = app.events.clone();
    let last = async move {
        events.send("big_slow_waits").unwrap();
        gate.notified().await;
        filler(10)
    };
    let body = futures_util::stream::iter([filler(800), filler(800)]).chain(futures_util::stream::once(last));
    (StatusCode::CREATED, Body::from_stream(body)).into_response()
}

/// A body past the limit with its Content-Length set, whose stream ends with
/// an empty chunk; its end waits for the test.
#[idempotent(scope = "lease.sized_tail")]
async fn sized_with_empty_tail(State(app): State<App>) -> Response {
    app.ran("sized_tail");
    let (gate, events) = (app.gate.clone(), app.events.clone());
    let end = futures_util::stream::once(async move {
        events.send("sized_tail_waits").unwrap();
        gate.notified().await;
    })
    .filter_map(|()| async { None::<Result<axum::body::Bytes, std::io::Error>> });
    let body = futures_util::stream::iter([filler(2000), Ok(axum::body::Bytes::new())]).chain(end);
    (
        StatusCode::CREATED,
        [(header::CONTENT_LENGTH, "2000")],
        Body::from_stream(body),
    )
        .into_response()
}

/// 8 MiB in 64 KiB chunks, far past the limit and any socket buffer.
#[idempotent(scope = "lease.huge", lock_timeout = "1s")]
async fn huge(State(app): State<App>) -> Response {
    app.ran("huge");
    app.events.send("huge").unwrap();
    let body = futures_util::stream::iter((0..128).map(|_| filler(65536)));
    (StatusCode::CREATED, Body::from_stream(body)).into_response()
}

/// An event stream whose media type is written in upper case.
#[idempotent(scope = "lease.upper_events")]
async fn upper_event_stream(State(app): State<App>) -> Response {
    app.ran("upper_events");
    let body = futures_util::stream::iter([chunk("data: hello\n\n")]).chain(futures_util::stream::pending());
    (
        [(header::CONTENT_TYPE, "Text/Event-Stream")],
        Body::from_stream(body),
    )
        .into_response()
}

/// A body of `n` bytes.
#[idempotent(scope = "lease.sized")]
async fn sized(
    State(app): State<App>,
    axum::extract::Query(q): axum::extract::Query<HashMap<String, usize>>,
) -> (StatusCode, Vec<u8>) {
    app.ran("sized");
    (StatusCode::CREATED, vec![b'y'; q["n"]])
}

/// A header value with bytes beyond ASCII (obs-text, which HTTP allows).
#[idempotent(scope = "lease.obs_text")]
async fn obs_text(State(app): State<App>) -> Response {
    app.ran("obs_text");
    let mut r = (StatusCode::CREATED, "noted").into_response();
    r.headers_mut().insert(
        "x-note",
        axum::http::HeaderValue::from_bytes(b"caf\xe9 \xff").unwrap(),
    );
    r
}

/// Slower than its TTL, in a transaction: its answer is still kept a TTL
/// from its completion.
#[idempotent(scope = "lease.slow_tx", ttl = "1s")]
async fn slow_in_transaction(
    State(app): State<App>,
    op: Operation,
) -> Result<(StatusCode, String), StoreError> {
    let n = app.ran("slow_tx");
    let _conn = op.pg_transaction().await?;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    Ok((StatusCode::CREATED, format!("run {n}")))
}

/// Tells the test when the server drops a request it has not answered.
async fn watch_drops(State(app): State<App>, req: Request, next: Next) -> Response {
    struct Dropped(Option<Arc<Notify>>);
    impl Drop for Dropped {
        fn drop(&mut self) {
            if let Some(n) = self.0.take() {
                n.notify_one();
            }
        }
    }
    let mut guard = Dropped(Some(app.dropped.clone()));
    let response = next.run(req).await;
    guard.0 = None;
    response
}

enum Db {
    Pg(sqlx::PgPool, String),
    Sqlite(sqlx::SqlitePool),
    Memory(Arc<idem::MemoryStore>),
}

struct Harness {
    addr: SocketAddr,
    app: App,
    /// The layer, whose requests under way `Idem::idle` waits for.
    idem: Idem,
    events: mpsc::UnboundedReceiver<&'static str>,
    store: Arc<dyn IdempotencyStore>,
    db: Db,
    _dir: Option<tempfile::TempDir>,
}

impl Harness {
    /// Waits until a handler reports `what`.
    async fn told(&mut self, what: &'static str) {
        loop {
            let got = tokio::time::timeout(Duration::from_secs(20), self.events.recv())
                .await
                .expect("the handler reports within 20 s")
                .unwrap();
            if got == what {
                return;
            }
        }
    }

    /// Plays another execution that took the record over: its lock token
    /// changes under the running one.
    /// Another execution takes the record of `key` (in `scope`) over, its
    /// lock live, behind the back of the one that holds it.
    async fn take_over_behind_its_back(&self, scope: &str, key: &str) {
        if let Db::Memory(store) = &self.db {
            let id = id(scope, key);
            let mut record = store.view(&id).expect("a record to take over");
            assert!(record.lock_live && record.body.is_none(), "{record:?}");
            record.token = Some("intruder".into());
            record.attempt += 1;
            store.set(&id, Some(record));
            return;
        }
        let sql = "UPDATE {t} SET lock_token = 'intruder', attempt = attempt + 1, taken_over = 1 \
                   WHERE key = {k} AND state = 'in_progress'";
        let done = match &self.db {
            Db::Pg(pool, schema) => sqlx::query(sqlx::AssertSqlSafe(
                sql.replace("{t}", &format!("\"{schema}\".idempotency_keys"))
                    .replace("{k}", "$1"),
            ))
            .bind(key)
            .execute(pool)
            .await
            .unwrap()
            .rows_affected(),
            Db::Sqlite(pool) => sqlx::query(sqlx::AssertSqlSafe(
                sql.replace("{t}", "idempotency_keys").replace("{k}", "?1"),
            ))
            .bind(key)
            .execute(pool)
            .await
            .unwrap()
            .rows_affected(),
            Db::Memory(_) => unreachable!("taken over above"),
        };
        assert_eq!(done, 1);
    }
}

/// Something else holds the record: a row lock on PostgreSQL, the write
/// lock on SQLite. Let go by committing.
enum Holder {
    Pg(sqlx::PgConnection),
    Sqlite(sqlx::SqliteConnection),
}

impl Harness {
    async fn hold(&self, key: &str) -> Holder {
        use sqlx::Connection as _;
        match &self.db {
            Db::Pg(_, schema) => {
                let mut c = sqlx::PgConnection::connect(&idem_testkit::pg_url().unwrap())
                    .await
                    .unwrap();
                sqlx::query("BEGIN").execute(&mut c).await.unwrap();
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "SELECT 1 FROM \"{schema}\".idempotency_keys WHERE key = $1 FOR UPDATE"
                )))
                .bind(key)
                .execute(&mut c)
                .await
                .unwrap();
                Holder::Pg(c)
            }
            Db::Sqlite(pool) => {
                let mut c = pool.acquire().await.unwrap().detach();
                sqlx::query("BEGIN IMMEDIATE").execute(&mut c).await.unwrap();
                Holder::Sqlite(c)
            }
            Db::Memory(_) => unreachable!("nothing holds the memory store"),
        }
    }

    /// Waits until the record's attempt is `attempt` and nobody holds its
    /// lock (fails after 20 s).
    async fn until_released_at(&self, key: &str, attempt: i64) {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let seen: (i64, Option<String>) = match &self.db {
                Db::Pg(pool, schema) => sqlx::query_as(sqlx::AssertSqlSafe(format!(
                    "SELECT attempt::bigint, lock_token FROM \"{schema}\".idempotency_keys WHERE key = $1"
                )))
                .bind(key)
                .fetch_one(pool)
                .await
                .unwrap(),
                Db::Sqlite(pool) => {
                    sqlx::query_as("SELECT attempt, lock_token FROM idempotency_keys WHERE key = ?1")
                        .bind(key)
                        .fetch_one(pool)
                        .await
                        .unwrap()
                }
                Db::Memory(_) => unreachable!(),
            };
            if seen == (attempt, None) {
                return;
            }
            assert!(std::time::Instant::now() < deadline, "the record stayed {seen:?}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Holder {
    async fn let_go(self) {
        match self {
            Holder::Pg(mut c) => sqlx::query("COMMIT").execute(&mut c).await.map(|_| ()),
            Holder::Sqlite(mut c) => sqlx::query("COMMIT").execute(&mut c).await.map(|_| ()),
        }
        .unwrap();
    }
}

async fn start(store_timeout: Duration, kind: StoreKind) -> Option<Harness> {
    let (store, db, dir): (Arc<dyn IdempotencyStore>, Db, _) = match kind {
        StoreKind::Postgres => {
            let url = idem_testkit::pg_url()?;
            let schema = idem_testkit::pg_schema(&url).await;
            let store = idem_testkit::pg_store_in(&url, &schema, 8)
                .await
                .with_timeout(store_timeout);
            let pool = store.pool().clone();
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "CREATE TABLE \"{schema}\".side (id TEXT)"
            )))
            .execute(&pool)
            .await
            .unwrap();
            (Arc::new(store), Db::Pg(pool, schema), None)
        }
        StoreKind::Sqlite => {
            let (store, dir) = idem_testkit::sqlite_store().await;
            let store = store.with_timeout(store_timeout);
            let pool = store.pool().clone();
            (Arc::new(store), Db::Sqlite(pool), Some(dir))
        }
        StoreKind::Memory => {
            let store = Arc::new(idem::MemoryStore::new());
            (store.clone(), Db::Memory(store), None)
        }
    };
    let (tx, events) = mpsc::unbounded_channel();
    let app = App {
        runs: Arc::default(),
        events: tx,
        gate: Arc::default(),
        dropped: Arc::default(),
        schema: match &db {
            Db::Pg(_, schema) => Some(schema.clone()),
            _ => None,
        },
    };
    let idem = Idem::from_arc(store.clone())
        .single_tenant()
        .max_stored_body(1024)
        .unwrap()
        .replay_headers(["x-note"])
        .unwrap();
    let router = Router::new()
        .route("/slow-body", post(slow_body))
        .route("/events", post(event_stream))
        .route("/broken-body", post(broken_body))
        .route("/panicky-body", post(panicky_body))
        .route("/lease-lost", post(loses_its_lease))
        .route("/checkpointed", post(checkpoints_after_a_takeover))
        .route("/plain", post(plain))
        .route("/tx", post(in_transaction))
        .route("/blocking", post(blocking))
        .route("/stops", post(stops_when_its_lease_is_lost))
        .route("/flaky", post(flaky))
        .route("/big-broken", post(big_broken))
        .route("/big-slow", post(big_slow))
        .route("/upper-events", post(upper_event_stream))
        .route("/sized", post(sized))
        .route("/sized-tail", post(sized_with_empty_tail))
        .route("/huge", post(huge))
        .route("/obs-text", post(obs_text))
        .route("/slow-tx", post(slow_in_transaction))
        .route("/validated", post(validated))
        .layer(idem.clone().layer())
        .layer(middleware::from_fn_with_state(app.clone(), watch_drops))
        .with_state(app.clone());
    let addr = idem_testkit::http::serve(router).await;
    Some(Harness {
        addr,
        app,
        idem,
        events,
        store,
        db,
        _dir: dir,
    })
}

fn id(scope: &str, key: &str) -> RecordId {
    RecordId::new("", scope, key)
}

/// A body produced long after the lock timeout is still produced under the
/// lease: a retry meanwhile gets 409, never a second execution.
async fn a_slow_body_is_produced_under_the_lease(mut h: Harness) {
    let first = {
        let addr = h.addr;
        tokio::spawn(async move { post_req("/slow-body", "").key("k-slow").send(addr).await })
    };
    h.told("slow_body").await;
    // Past the lock timeout: without the lease the lock would be stale now.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let retry = post_req("/slow-body", "").key("k-slow").send(h.addr).await;
    assert_eq!(retry.status, 409, "{retry:?}");
    assert_eq!(retry.problem(), "idempotency-request-in-progress");

    h.app.gate.notify_one();
    let first = first.await.unwrap();
    assert_eq!((first.status, first.body.as_slice()), (201, &b"part1,part2"[..]));
    let replay = post_req("/slow-body", "").key("k-slow").send(h.addr).await;
    assert_eq!((replay.status, &replay.body), (201, &first.body));
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(h.app.runs("slow_body"), 1);
}

/// Reads the event stream on `conn` until its first event, while the
/// stream goes on, and hands the connection back.
async fn first_event(mut conn: tokio::net::TcpStream) -> tokio::net::TcpStream {
    let mut seen = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), async {
        let mut buf = [0u8; 1024];
        while !String::from_utf8_lossy(&seen).contains("data: hello") {
            let n = conn.read(&mut buf).await.unwrap();
            assert!(n > 0, "the stream ended");
            seen.extend_from_slice(&buf[..n]);
        }
    })
    .await
    .expect("the first event arrives while the stream goes on");
    conn
}

/// A never-ending event stream completes once its headers are known, and
/// streams to the client; a retry gets status and headers only.
async fn an_event_stream_completes_at_its_headers_and_streams(h: Harness) {
    let conn = post_req("/events", "").key("k-events").start(h.addr).await;
    drop(first_event(conn).await);

    let replay = post_req("/events", "").key("k-events").send(h.addr).await;
    assert_eq!(replay.status, 200);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.header("idempotent-replay-body-omitted"), Some("true"));
    assert!(replay.body.is_empty());
    assert_eq!(h.app.runs("events"), 1);
}

/// A body that fails while it is produced is a failed execution: the
/// client's connection breaks as it would without idem, nothing is stored,
/// and the retry runs again (attempt 2).
async fn a_body_that_fails_midway_is_released_never_stored(h: Harness) {
    let raw = post_req("/broken-body", "")
        .key("k-broken")
        .send_raw(h.addr)
        .await;
    let text = String::from_utf8_lossy(&raw);
    assert!(!text.ends_with("0\r\n\r\n"), "a complete answer: {text}");
    assert!(!text.contains("content-length"), "a complete answer: {text}");

    let retry = post_req("/broken-body", "").key("k-broken").send(h.addr).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert_eq!(retry.header("idempotent-replayed"), None);
    assert_eq!(retry.json()["attempt"], 2);
    assert_eq!(h.app.runs("broken_body"), 2);
}

/// A body that panics while it is produced releases the key (500), so the
/// retry runs again instead of waiting for a lock nobody holds.
async fn a_body_that_panics_is_released(h: Harness) {
    let first = post_req("/panicky-body", "").key("k-panic").send(h.addr).await;
    assert_eq!(first.status, 500);
    assert_eq!(first.problem(), "handler-failed");
    let retry = post_req("/panicky-body", "").key("k-panic").send(h.addr).await;
    assert_eq!((retry.status, retry.body.as_slice()), (201, &b"attempt 2"[..]));
    assert_eq!(h.app.runs("panicky_body"), 2);
}

/// An execution whose lock another took over is told (`lease_lost`,
/// checkpoints refused), and its client gets 503 with `Retry-After`, never
/// its answer: the answer that counts is the other execution's.
async fn a_lost_lease_is_told_and_never_answered(mut h: Harness) {
    let first = {
        let addr = h.addr;
        tokio::spawn(async move { post_req("/lease-lost", "").key("k-lost").send(addr).await })
    };
    h.told("lease_lost").await;
    h.take_over_behind_its_back("lease.lost", "k-lost").await;
    h.told("checkpoint_refused").await;
    let first = first.await.unwrap();
    assert_eq!(first.status, 503, "{first:?}");
    assert_eq!(first.problem(), "idempotency-lease-lost");
    assert!(first.header("retry-after").is_some());

    let theirs = StoredResponse {
        status: 201,
        headers: vec![],
        body: Some(b"the other execution".to_vec()),
    };
    h.store
        .complete(&id("lease.lost", "k-lost"), "intruder", &theirs)
        .await
        .unwrap();
    let retry = post_req("/lease-lost", "").key("k-lost").send(h.addr).await;
    assert_eq!(
        (retry.status, retry.body.as_slice()),
        (201, &b"the other execution"[..])
    );
    assert_eq!(h.app.runs("lease_lost"), 1);
}

/// A checkpoint that the store refuses (another execution's token holds
/// the record) tells the handler its lease is lost, as the keeper would:
/// `is_lease_lost` and `lease_lost` agree with the refusal, and the answer
/// is not given.
async fn a_refused_checkpoint_tells_the_lease_lost(mut h: Harness) {
    let first = {
        let addr = h.addr;
        tokio::spawn(async move {
            post_req("/checkpointed", "")
                .key("k-checkpointed")
                .send(addr)
                .await
        })
    };
    h.told("checkpointing").await;
    h.take_over_behind_its_back("lease.checkpointed", "k-checkpointed")
        .await;
    h.app.gate.notify_one();
    h.told("told_lost").await;
    let first = first.await.unwrap();
    assert_eq!(first.problem(), "idempotency-lease-lost", "{first:?}");
}

/// A client that leaves while its key is being reserved cancels nothing:
/// the reservation runs to its end, the execution too, and the retry gets
/// its answer instead of a lock that nobody holds.
async fn a_client_that_leaves_during_the_reservation_leaves_no_lock(h: Harness) {
    // Pause points are process-wide and this case runs on every store at
    // once: the key is this run's own.
    let key = idem_testkit::unique("k-leave");
    let mut paused = pause::arm(pause::RESERVE_AFTER, &key);
    let conn = post_req("/plain", "").key(&key).start(h.addr).await;
    paused.reached().await;
    let dropped = h.app.dropped.notified();
    drop(conn);
    dropped.await; // the server dropped the request
    paused.resume();

    let retry = post_req("/plain", "").key(&key).send(h.addr).await;
    assert_eq!((retry.status, retry.body.as_slice()), (201, &b"run 1"[..]));
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(h.app.runs("plain"), 1);
}

/// A client that leaves while its handler runs cancels nothing: the
/// execution goes on from where it was, records its answer, and the retry
/// gets that answer.
async fn a_client_that_leaves_while_the_handler_runs_cancels_nothing(h: Harness) {
    // The key is this run's own (see above).
    let key = idem_testkit::unique("k-leave-handler");
    let mut paused = pause::arm(pause::HANDLER_RETURNED, &key);
    let conn = post_req("/plain", "").key(&key).start(h.addr).await;
    paused.reached().await;
    let dropped = h.app.dropped.notified();
    drop(conn);
    dropped.await;
    paused.resume();

    let retry = post_req("/plain", "").key(&key).send(h.addr).await;
    assert_eq!((retry.status, retry.body.as_slice()), (201, &b"run 1"[..]));
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(h.app.runs("plain"), 1);
}

/// `Idem::idle` (a graceful shutdown's wait) waits for an execution whose
/// client left, which no connection waits for any more, until its answer
/// is recorded; then it returns, and the retry replays that answer.
async fn idle_waits_for_an_execution_whose_client_left(h: Harness) {
    use futures_util::FutureExt as _;
    // The key is this run's own (see above).
    let key = idem_testkit::unique("k-idle");
    let mut paused = pause::arm(pause::HANDLER_RETURNED, &key);
    assert!(h.idem.idle().now_or_never().is_some(), "idle before any request");
    let conn = post_req("/plain", "").key(&key).start(h.addr).await;
    paused.reached().await;
    let dropped = h.app.dropped.notified();
    drop(conn);
    dropped.await;
    assert!(h.idem.under_way() > 0);
    let mut idle = std::pin::pin!(h.idem.idle());
    assert!(
        (&mut idle).now_or_never().is_none(),
        "idle while the execution runs"
    );
    paused.resume();
    tokio::time::timeout(Duration::from_secs(20), idle)
        .await
        .expect("idle once the execution ended");
    assert_eq!(h.idem.under_way(), 0);
    let retry = post_req("/plain", "").key(&key).send(h.addr).await;
    assert_eq!(
        (retry.status, retry.header("idempotent-replayed")),
        (201, Some("true"))
    );
}

/// A reservation given up on at the store's timeout (its write held at a
/// pause point: on PostgreSQL committed, on SQLite before its commit) is
/// still work of the store's, whose key may yet be taken and given back:
/// `Idem::idle` waits for it, and returns once it is done.
async fn idle_waits_for_a_reservation_given_up_at_its_timeout(h: Harness) {
    use futures_util::FutureExt as _;
    // The key is this run's own (see above).
    let key = idem_testkit::unique("k-idle-given-up");
    let point = match h.db {
        Db::Sqlite(_) => pause::SQLITE_RESERVE_BEFORE_COMMIT,
        _ => pause::RESERVE_AFTER,
    };
    let mut paused = pause::arm(point, &key);
    let first = {
        let (addr, key) = (h.addr, key.clone());
        tokio::spawn(async move { post_req("/plain", "").key(&key).send(addr).await })
    };
    paused.reached().await;
    let first = first.await.unwrap();
    assert_eq!(first.problem(), "idempotency-store-unavailable");
    assert!(
        h.idem.idle().now_or_never().is_none(),
        "idle while the given-up reservation is still to end"
    );
    paused.resume();
    tokio::time::timeout(Duration::from_secs(20), h.idem.idle())
        .await
        .expect("idle once the given-up reservation ended");
    let retry = post_req("/plain", "").key(&key).send(h.addr).await;
    assert_eq!((retry.status, retry.body.as_slice()), (201, &b"run 1"[..]));
}

/// A reservation that committed but whose answer came after the store
/// timeout is undone before the 503: the retry runs at once.
async fn a_reservation_that_times_out_after_committing_is_undone(h: Harness) {
    // The key is this run's own (see above).
    let key = idem_testkit::unique("k-timeout");
    let paused = pause::arm(pause::RESERVE_AFTER, &key);
    let first = post_req("/plain", "").key(&key).send(h.addr).await;
    assert_eq!(first.status, 503, "{first:?}");
    assert_eq!(first.problem(), "idempotency-store-unavailable");
    assert!(first.json()["detail"].as_str().unwrap().contains("not processed"));
    drop(paused);
    assert_eq!(h.app.runs("plain"), 0);

    let retry = post_req("/plain", "").key(&key).send(h.addr).await;
    assert_eq!((retry.status, retry.body.as_slice()), (201, &b"run 1"[..]));
    assert_eq!(retry.header("idempotent-replayed"), None);
}

/// A reservation of a fresh key that committed but whose answer came after
/// the store timeout leaves the key as it was found, absent: nothing ran,
/// so it counts as no attempt, and a validation failure of the retry frees
/// the key for the corrected request.
async fn a_fresh_reservation_undone_after_its_timeout_is_as_it_was_found(h: Harness) {
    let key = idem_testkit::unique("k-timeout-fresh");
    let paused = pause::arm(pause::RESERVE_AFTER, &key);
    let first = post_req("/validated?amount=-1", "").key(&key).send(h.addr).await;
    assert_eq!(first.status, 503, "{first:?}");
    drop(paused);
    assert_fresh_as_found(|amount| {
        let request = post_req(&format!("/validated?amount={amount}"), "").key(&key);
        async move {
            let r = request.send(h.addr).await;
            (r.status, String::from_utf8_lossy(&r.body).into_owned())
        }
    })
    .await;
}

/// A first run that failed (released as failed: it may have had effects),
/// then a retry whose reservation committed but whose answer was lost: the
/// hand-backs keep the record, so another body still gets 422 and the same
/// body continues the operation.
async fn a_lost_retry_of_a_failed_run_keeps_the_key_bound(h: Harness) {
    let key = idem_testkit::unique("k-failed-then-lost");
    let first = post_req("/flaky", "A").key(&key).send(h.addr).await;
    assert_eq!(first.status, 503, "{first:?}");
    assert_eq!(first.body, b"gateway down");
    let paused = pause::arm(pause::RESERVE_AFTER, &key);
    let lost = post_req("/flaky", "A").key(&key).send(h.addr).await;
    assert_eq!(lost.problem(), "idempotency-store-unavailable");
    drop(paused);
    // Another request: the query counts in the fingerprint (the handler
    // reads no body).
    let other = post_req("/flaky?other=1", "A").key(&key).send(h.addr).await;
    assert_eq!(
        (other.status, other.problem()),
        (422, "idempotency-key-reused".to_owned())
    );
    let retry = post_req("/flaky", "A").key(&key).send(h.addr).await;
    assert_eq!((retry.status, retry.body.as_slice()), (201, &b"run 2"[..]));
    assert_eq!(h.app.runs("flaky"), 2);
}

/// A handler that blocks its thread keeps its lease: a retry meanwhile gets
/// 409, never a second execution.
async fn a_handler_that_blocks_its_thread_keeps_its_lease(mut h: Harness) {
    let first = {
        let addr = h.addr;
        tokio::spawn(async move { post_req("/blocking", "").key("k-block").send(addr).await })
    };
    h.told("blocking").await;
    // Past the lock timeout (1 s), while the handler blocks its thread.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let retry = post_req("/blocking", "").key("k-block").send(h.addr).await;
    let first = first.await.unwrap();
    assert_eq!((first.status, first.body.as_slice()), (201, &b"run 1"[..]));
    // In progress, or (on a machine slow enough) already the replay.
    match retry.status {
        409 => {}
        _ => assert_eq!(
            (retry.status, retry.body.as_slice()),
            (201, &b"run 1"[..]),
            "{retry:?}"
        ),
    }
    assert_eq!(h.app.runs("blocking"), 1);
}

/// A handler told its lease is lost (the lock could not be extended before
/// its deadline) and answering early never has that answer given or stored:
/// its client gets 503, and the retry continues the operation.
async fn an_answer_given_after_the_lease_was_lost_is_never_stored(mut h: Harness) {
    let first = {
        let addr = h.addr;
        tokio::spawn(async move { post_req("/stops", "").key("k-stops").send(addr).await })
    };
    h.told("stops").await;
    let holder = h.hold("k-stops").await;
    let first = tokio::time::timeout(Duration::from_secs(20), first)
        .await
        .unwrap()
        .unwrap();
    holder.let_go().await;
    assert_eq!(first.status, 503, "{first:?}");
    assert_eq!(first.problem(), "idempotency-lease-lost");
    h.until_released_at("k-stops", 1).await;
    let retry = post_req("/stops", "").key("k-stops").send(h.addr).await;
    assert_eq!(
        (retry.status, retry.body.as_slice()),
        (200, &b"done"[..]),
        "{retry:?}"
    );
    assert_eq!(retry.header("idempotent-replayed"), None);
}

/// A reservation held up past the store timeout leaves no lock that no
/// execution holds: on PostgreSQL, whose statement was sent and is slow
/// (a trigger of the application's that sleeps; a wait for a lock would
/// end at the store's timeout on the server too), it commits later and is
/// given back when it commits; on SQLite, whose write waits in this
/// process for the write lock, it writes nothing once its caller is gone.
async fn a_reservation_that_commits_after_its_timeout_is_given_back(h: Harness) {
    let first = post_req("/flaky", "").key("k-late").send(h.addr).await;
    assert_eq!(first.status, 503);
    let (holder, slow) = match &h.db {
        Db::Pg(pool, schema) => {
            // The retry's takeover (attempt 1 to 2) sleeps twice the
            // store's timeout in the database.
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "CREATE FUNCTION \"{schema}\".slow_takeover() RETURNS trigger LANGUAGE plpgsql AS $$ \
                 BEGIN IF OLD.attempt = 1 AND NEW.attempt = 2 THEN PERFORM pg_sleep(0.6); END IF; \
                 RETURN NEW; END $$; \
                 CREATE TRIGGER slow_takeover BEFORE UPDATE ON \"{schema}\".idempotency_keys \
                 FOR EACH ROW EXECUTE FUNCTION \"{schema}\".slow_takeover()"
            )))
            .execute(pool)
            .await
            .unwrap();
            (None, Some((pool.clone(), schema.clone())))
        }
        _ => (Some(h.hold("k-late").await), None),
    };
    let retry = post_req("/flaky", "").key("k-late").send(h.addr).await;
    assert_eq!(retry.status, 503, "{retry:?}");
    assert_eq!(retry.problem(), "idempotency-store-unavailable");
    if let Some(holder) = holder {
        holder.let_go().await;
    }
    // The slow reservation commits (attempt 2), then is given back; on
    // SQLite it never writes (attempt 1, as the first run left it).
    let found = if matches!(h.db, Db::Sqlite(_)) { 1 } else { 2 };
    h.until_released_at("k-late", found).await;
    if let Some((pool, schema)) = slow {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP TRIGGER slow_takeover ON \"{schema}\".idempotency_keys"
        )))
        .execute(&pool)
        .await
        .unwrap();
    }
    let again = post_req("/flaky", "").key("k-late").send(h.addr).await;
    assert_eq!(
        (again.status, again.body.as_slice()),
        (201, &b"run 2"[..]),
        "{again:?}"
    );
    assert_eq!(h.app.runs("flaky"), 2);
}

/// A body past the stored limit that fails once past it is a failed
/// execution: never completed, the client's connection broken, the retry
/// runs again.
async fn a_large_body_that_fails_past_the_limit_is_released(h: Harness) {
    let raw = post_req("/big-broken", "")
        .key("k-big-broken")
        .send_raw(h.addr)
        .await;
    let text = String::from_utf8_lossy(&raw);
    assert!(!text.ends_with("0\r\n\r\n"), "a complete answer: {text}");
    let retry = post_req("/big-broken", "").key("k-big-broken").send(h.addr).await;
    assert_eq!(retry.status, 201);
    assert_eq!(retry.header("idempotent-replayed"), None);
    assert_eq!(retry.body.len(), 1610);
    assert_eq!(h.app.runs("big_broken"), 2);
}

/// A body past the stored limit streams to the client under the lease; the
/// record completes when the body ends (a retry meanwhile gets 409), and
/// its replay is status and headers only.
async fn a_large_body_streams_and_completes_when_it_ends(mut h: Harness) {
    let mut conn = post_req("/big-slow", "").key("k-big-slow").start(h.addr).await;
    h.told("big_slow_waits").await;
    let retry = post_req("/big-slow", "").key("k-big-slow").send(h.addr).await;
    assert_eq!(retry.status, 409, "{retry:?}");
    h.app.gate.notify_one();
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), conn.read_to_end(&mut raw))
        .await
        .unwrap()
        .unwrap();
    let text = String::from_utf8_lossy(&raw);
    assert!(
        text.starts_with("HTTP/1.1 201") && text.ends_with("0\r\n\r\n"),
        "{text}"
    );
    assert_eq!(text.matches('x').count(), 1610);
    let replay = post_req("/big-slow", "").key("k-big-slow").send(h.addr).await;
    assert_eq!(replay.status, 201);
    assert_eq!(replay.header("idempotent-replay-body-omitted"), Some("true"));
    assert_eq!(h.app.runs("big_slow"), 1);
}

/// A client that leaves while a large body streams cancels nothing: the
/// body is produced to its end and the outcome recorded.
async fn a_client_that_leaves_a_large_body_midway_cancels_nothing(mut h: Harness) {
    let conn = post_req("/big-slow", "").key("k-big-leave").start(h.addr).await;
    h.told("big_slow_waits").await;
    drop(conn);
    h.app.gate.notify_one();
    let retry = post_req("/big-slow", "")
        .key("k-big-leave")
        .wait_for_replay(h.addr)
        .await;
    assert_eq!(retry.status, 201);
    assert_eq!(retry.header("idempotent-replay-body-omitted"), Some("true"));
    assert_eq!(h.app.runs("big_slow"), 1);
}

/// The last bytes wait for the completion, whatever the framing: with a
/// Content-Length and an empty last chunk, a client still cannot hold the
/// whole body before the answer is recorded. Here it never is (the lease is
/// lost), so the client's answer breaks off.
async fn a_whole_body_never_arrives_before_its_answer_is_recorded(mut h: Harness) {
    let mut conn = post_req("/sized-tail", "").key("k-tail").start(h.addr).await;
    h.told("sized_tail_waits").await;
    h.take_over_behind_its_back("lease.sized_tail", "k-tail").await;
    h.app.gate.notify_one();
    let mut raw = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(20), conn.read_to_end(&mut raw))
        .await
        .expect("the connection ends");
    let body = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(0, |at| raw.len() - at - 4);
    assert!(body < 2000, "a whole body that was never recorded: {body} bytes");
    assert_eq!(h.app.runs("sized_tail"), 1);
}

/// A client that stops reading a large answer is cut off after a lock
/// timeout: the body is read to its end and the answer recorded, so the key
/// is not held for as long as the client keeps its connection open.
async fn a_client_that_stops_reading_is_cut_off_and_the_answer_recorded(mut h: Harness) {
    let conn = post_req("/huge", "").key("k-stall").start(h.addr).await;
    h.told("huge").await;
    let replay = post_req("/huge", "").key("k-stall").wait_for_replay(h.addr).await;
    assert_eq!(replay.status, 201, "{replay:?}");
    assert_eq!(replay.header("idempotent-replay-body-omitted"), Some("true"));
    drop(conn);
    assert_eq!(h.app.runs("huge"), 1);
}

/// The problem `type` can point to the application's documentation.
#[tokio::test]
async fn problem_types_can_point_to_the_applications_documentation() {
    let idem = Idem::new(idem::MemoryStore::new())
        .single_tenant()
        .problem_type_base("https://docs.example.com/errors/")
        .unwrap();
    let router = Router::new()
        .route("/plain", post(plain_for_problems))
        .layer(idem.layer());
    let addr = idem_testkit::http::serve(router).await;
    let missing = post_req("/plain", "").send(addr).await;
    assert_eq!(missing.status, 400);
    assert_eq!(
        missing.json()["type"],
        "https://docs.example.com/errors/idempotency-key-missing"
    );
    assert_eq!(missing.header("content-type"), Some("application/problem+json"));
    let first = post_req("/plain", "a").key("k").send(addr).await;
    assert_eq!(first.status, 201);
    let reused = post_req("/plain", "b").key("k").send(addr).await;
    assert_eq!(reused.status, 422);
    assert_eq!(
        reused.json()["type"],
        "https://docs.example.com/errors/idempotency-key-reused"
    );
    assert_eq!(reused.json()["title"], "Idempotency key reused");
}

#[idempotent(scope = "lease.problems")]
async fn plain_for_problems(body: String) -> (StatusCode, String) {
    (StatusCode::CREATED, body)
}

/// A handler's own problem that is stored (a 402 is a business answer) is
/// stored as its client first got it, under the configured base: its
/// replay is the same bytes.
#[tokio::test]
async fn a_stored_problem_is_replayed_as_its_client_first_got_it() {
    let idem = Idem::new(idem::MemoryStore::new())
        .single_tenant()
        .problem_type_base("https://docs.example.com/errors/")
        .unwrap();
    let router = Router::new()
        .route("/declined", post(declined))
        .layer(idem.layer());
    let addr = idem_testkit::http::serve(router).await;
    let first = post_req("/declined", "a").key("k-declined").send(addr).await;
    assert_eq!(first.status, 402);
    assert_eq!(
        first.json()["type"],
        "https://docs.example.com/errors/card-declined"
    );
    let replay = post_req("/declined", "a").key("k-declined").send(addr).await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.status, 402);
    assert_eq!(
        String::from_utf8_lossy(&replay.body),
        String::from_utf8_lossy(&first.body)
    );
    assert_eq!(replay.header("content-type"), Some("application/problem+json"));
}

#[idempotent(scope = "lease.declined")]
async fn declined(_body: String) -> axum::response::Response {
    idem::problem(
        StatusCode::PAYMENT_REQUIRED,
        "card-declined",
        "Card declined",
        "insufficient funds",
    )
}

/// `idem::problem(...)`, then a body of the handler's own in its place.
#[idempotent(scope = "lease.own_body")]
async fn problem_with_own_body(
    axum::extract::Query(q): axum::extract::Query<HashMap<String, String>>,
) -> axum::response::Response {
    let status = if q.contains_key("reject") {
        StatusCode::CONFLICT
    } else {
        StatusCode::PAYMENT_REQUIRED
    };
    let mut r = idem::problem(status, "card-declined", "Card declined", "insufficient funds");
    if q.contains_key("own") {
        *r.body_mut() = axum::body::Body::from(r#"{"type":"x","balance":3}"#);
        r.headers_mut().insert(
            axum::http::header::CONTENT_TYPE,
            axum::http::HeaderValue::from_static("application/json"),
        );
    }
    r
}

/// A body the handler put in place of its problem's own is answered as
/// written, under a problem base too (the base used to write the problem's
/// body over it, and that was stored and replayed): stored (402) or
/// rejected (409), first answer and replay. A problem's own body still
/// gets the base, at its right length.
#[tokio::test]
async fn a_body_put_in_place_of_a_problems_own_is_answered_as_written() {
    for base in [None, Some("https://docs.example.com/errors/")] {
        let mut idem = Idem::new(idem::MemoryStore::new()).single_tenant();
        if let Some(base) = base {
            idem = idem.problem_type_base(base).unwrap();
        }
        let router = Router::new()
            .route("/own", post(problem_with_own_body))
            .layer(idem.layer());
        let addr = idem_testkit::http::serve(router).await;
        for (query, status) in [("?own", 402), ("?own&reject", 409)] {
            let key = format!("k{query}");
            for attempt in ["first", "again"] {
                let r = post_req(&format!("/own{query}"), "").key(&key).send(addr).await;
                assert_eq!(r.status, status, "{base:?} {query} {attempt}: {r:?}");
                assert_eq!(
                    String::from_utf8_lossy(&r.body),
                    r#"{"type":"x","balance":3}"#,
                    "{base:?} {query} {attempt}"
                );
                assert_eq!(r.header("content-type"), Some("application/json"));
            }
        }
        for (query, status) in [("", 402), ("?reject", 409)] {
            let r = post_req(&format!("/own{query}"), "")
                .key(&format!("kept{query}"))
                .send(addr)
                .await;
            assert_eq!(r.status, status);
            assert_eq!(
                r.json()["type"],
                format!("{}card-declined", base.unwrap_or("urn:idem:problem:")),
                "{query}"
            );
            assert_eq!(
                r.header("content-length"),
                Some(r.body.len().to_string().as_str())
            );
        }
    }
}

/// A replayed header keeps its bytes, obs-text included.
async fn a_replayed_header_keeps_every_byte(h: Harness) {
    let first = post_req("/obs-text", "").key("k-obs").send_raw(h.addr).await;
    let replay = post_req("/obs-text", "").key("k-obs").send_raw(h.addr).await;
    for raw in [&first, &replay] {
        assert!(
            raw.windows(12).any(|w| w == b"x-note: caf\xe9"),
            "{}",
            String::from_utf8_lossy(raw)
        );
    }
    assert!(String::from_utf8_lossy(&replay).contains("idempotent-replayed: true"));
    assert_eq!(h.app.runs("obs_text"), 1);
}

/// Media types are compared without regard to case.
async fn an_upper_case_event_stream_is_an_event_stream(h: Harness) {
    let conn = post_req("/upper-events", "").key("k-upper").start(h.addr).await;
    first_event(conn).await;
    assert_eq!(h.app.runs("upper_events"), 1);
}

/// Bodies at the limit are stored whole; one byte more is streamed and its
/// replay omits the body.
async fn bodies_at_the_limit_are_stored_and_one_byte_more_is_not(h: Harness) {
    for n in [0usize, 1024, 1025] {
        let key = format!("k-size-{n}");
        let first = post_req(&format!("/sized?n={n}"), "")
            .key(&key)
            .send(h.addr)
            .await;
        let replay = post_req(&format!("/sized?n={n}"), "")
            .key(&key)
            .send(h.addr)
            .await;
        assert_eq!(first.body.len(), n);
        assert_eq!(replay.header("idempotent-replayed"), Some("true"));
        if n <= 1024 {
            assert_eq!(replay.body, first.body);
        } else {
            assert_eq!(replay.header("idempotent-replay-body-omitted"), Some("true"));
        }
    }
    assert_eq!(h.app.runs("sized"), 3);
}

mod every_store {
    use super::*;
    idem_testkit::for_each_store! {
        stores: [memory, sqlite, postgres],
        setup: |kind| start(Duration::from_secs(10), kind).await,
        worker_threads: 4,
        cases: [
            a_slow_body_is_produced_under_the_lease,
            an_event_stream_completes_at_its_headers_and_streams,
            a_body_that_fails_midway_is_released_never_stored,
            a_body_that_panics_is_released,
            a_client_that_leaves_during_the_reservation_leaves_no_lock,
            a_client_that_leaves_while_the_handler_runs_cancels_nothing,
            idle_waits_for_an_execution_whose_client_left,
            a_handler_that_blocks_its_thread_keeps_its_lease,
            a_large_body_that_fails_past_the_limit_is_released,
            a_large_body_streams_and_completes_when_it_ends,
            a_client_that_leaves_a_large_body_midway_cancels_nothing,
            an_upper_case_event_stream_is_an_event_stream,
            bodies_at_the_limit_are_stored_and_one_byte_more_is_not,
            a_client_that_stops_reading_is_cut_off_and_the_answer_recorded,
            a_replayed_header_keeps_every_byte,
        ],
    }
}

mod sql_stores {
    use super::*;
    idem_testkit::for_each_store! {
        stores: [sqlite, postgres],
        setup: |kind| start(Duration::from_secs(10), kind).await,
        worker_threads: 4,
        cases: [
            an_answer_given_after_the_lease_was_lost_is_never_stored,
        ],
    }
}

/// Taken over behind the execution's back: with SQL on the SQL stores,
/// through the memory store's test API on it.
mod taken_over {
    use super::*;
    idem_testkit::for_each_store! {
        stores: [memory, sqlite, postgres],
        setup: |kind| start(Duration::from_secs(10), kind).await,
        worker_threads: 4,
        cases: [
            a_lost_lease_is_told_and_never_answered,
            a_whole_body_never_arrives_before_its_answer_is_recorded,
            a_refused_checkpoint_tells_the_lease_lost,
        ],
    }
}

mod short_timeout {
    use super::*;
    idem_testkit::for_each_store! {
        stores: [sqlite, postgres],
        setup: |kind| start(Duration::from_millis(300), kind).await,
        worker_threads: 4,
        cases: [
            a_reservation_that_times_out_after_committing_is_undone,
            a_reservation_that_commits_after_its_timeout_is_given_back,
            a_fresh_reservation_undone_after_its_timeout_is_as_it_was_found,
            a_lost_retry_of_a_failed_run_keeps_the_key_bound,
            idle_waits_for_a_reservation_given_up_at_its_timeout,
        ],
    }
}

/// The completion in the handler's transaction is bounded by the store
/// timeout like every store call: a row lock that holds it answers 503 in
/// time, and the handler's writes are rolled back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_a_blocked_transactional_completion_answers_503_in_time() {
    use sqlx::Connection as _;
    let Some(mut h) = start(Duration::from_millis(500), StoreKind::Postgres).await else {
        return;
    };
    let Db::Pg(pool, schema) = &h.db else {
        unreachable!()
    };
    let (pool, schema) = (pool.clone(), schema.clone());
    let first = {
        let addr = h.addr;
        tokio::spawn(async move { post_req("/tx", "").key("k-tx").send(addr).await })
    };
    h.told("in_tx").await;
    let mut locker = sqlx::PgConnection::connect(&idem_testkit::pg_url().unwrap())
        .await
        .unwrap();
    sqlx::query("BEGIN").execute(&mut locker).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT 1 FROM \"{schema}\".idempotency_keys WHERE key = 'k-tx' FOR UPDATE"
    )))
    .execute(&mut locker)
    .await
    .unwrap();
    h.app.gate.notify_one();

    let first = tokio::time::timeout(Duration::from_secs(15), first)
        .await
        .expect("answered while the row is still locked")
        .unwrap();
    assert_eq!(first.status, 503, "{first:?}");
    assert_eq!(first.problem(), "idempotency-store-unavailable");
    assert!(first.json()["detail"].as_str().unwrap().contains("rolled back"));
    sqlx::query("COMMIT").execute(&mut locker).await.unwrap();
    let written: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM \"{schema}\".side"
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(written, 0, "the handler's writes were rolled back");
}

/// An answer completed in the handler's transaction is kept a TTL from its
/// completion, not from when the transaction opened.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_a_slow_transactional_answer_is_kept_a_ttl_from_its_completion() {
    let Some(h) = start(Duration::from_secs(10), StoreKind::Postgres).await else {
        return;
    };
    let first = post_req("/slow-tx", "").key("k-slow-tx").send(h.addr).await;
    assert_eq!((first.status, first.body.as_slice()), (201, &b"run 1"[..]));
    let retry = post_req("/slow-tx", "").key("k-slow-tx").send(h.addr).await;
    assert_eq!(retry.header("idempotent-replayed"), Some("true"), "{retry:?}");
    assert_eq!(h.app.runs("slow_tx"), 1);
}

/// Held by `held_forever` until the test lets it go.
static HELD: std::sync::LazyLock<(tokio::sync::Semaphore, Notify)> =
    std::sync::LazyLock::new(|| (tokio::sync::Semaphore::new(0), Notify::new()));

#[idempotent(scope = "lease.held")]
async fn held_forever() -> StatusCode {
    // Waiting before it says so: `notify_waiters` wakes only those waiting.
    let let_go = HELD.1.notified();
    tokio::pin!(let_go);
    let_go.as_mut().enable();
    HELD.0.add_permits(1);
    let_go.await;
    StatusCode::CREATED
}

/// An execution's lease spawns no task of its own: ten executions under way
/// are their ten requests' tasks and the ten executions' (there was a
/// heartbeat task per execution too before; the lease keeper is a thread),
/// and nothing is left once they end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_executions_share_one_lease_keeper() {
    use tower::ServiceExt as _;
    let app = Router::new()
        .route("/held", post(held_forever))
        .layer(Idem::new(idem::MemoryStore::new()).single_tenant().layer());
    let metrics = tokio::runtime::Handle::current().metrics();
    let before = metrics.num_alive_tasks();
    let requests: Vec<_> = (0..10)
        .map(|i| {
            let request = axum::http::Request::post("/held")
                .header("idempotency-key", format!("held-{i}"))
                .body(Body::empty())
                .unwrap();
            tokio::spawn(app.clone().oneshot(request))
        })
        .collect();
    let _all_in = HELD.0.acquire_many(10).await.unwrap();
    // The default lock timeout (60 s): no extension is due yet.
    assert_eq!(
        metrics.num_alive_tasks() - before,
        10 + 10,
        "the ten requests and their ten executions"
    );
    HELD.1.notify_waiters();
    for r in requests {
        assert_eq!(r.await.unwrap().unwrap().status(), StatusCode::CREATED);
    }
    let until = tokio::time::Instant::now() + Duration::from_secs(5);
    while metrics.num_alive_tasks() > before + 1 && tokio::time::Instant::now() < until {
        tokio::task::yield_now().await;
    }
    assert!(metrics.num_alive_tasks() <= before + 1, "only the keeper is left");
}

static SLOW_RUNS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// One second of work under a 1.5 s lock.
#[idempotent(scope = "lease.slow_reservation", lock_timeout = "1500ms")]
async fn one_second(op: Operation) -> (StatusCode, String) {
    SLOW_RUNS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let lost = op.is_lease_lost();
    (StatusCode::CREATED, format!("lost: {lost}"))
}

/// A reservation that took most of the lock timeout (a queue, a slow
/// database): the lease's deadline is counted from before it, so its first
/// extension must come before that deadline, not a third of the lock
/// timeout after the handler starts. Otherwise the lease counts as lost
/// without a single try, the answer is thrown away and a retry runs the
/// handler again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_reservation_keeps_its_lease() {
    use tower::ServiceExt as _;
    let app = Router::new()
        .route("/slow", post(one_second))
        .layer(Idem::new(idem::MemoryStore::new()).single_tenant().layer());
    let key = idem_testkit::unique("slow-reservation");
    let request = || {
        axum::http::Request::post("/slow")
            .header("idempotency-key", key.as_str())
            .body(Body::empty())
            .unwrap()
    };
    // Reserved, but held 1.1 s before the answer reaches the protocol: the
    // first request has 0.4 s of its lease left when the handler starts.
    let mut reserved = pause::arm(pause::RESERVE_AFTER, &key);
    let first = tokio::spawn(app.clone().oneshot(request()));
    reserved.reached().await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    reserved.resume();
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    let body = axum::body::to_bytes(first.into_body(), 1 << 10).await.unwrap();
    assert_eq!(&body[..], b"lost: false");
    let retry = app.oneshot(request()).await.unwrap();
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(SLOW_RUNS.load(std::sync::atomic::Ordering::SeqCst), 1);
}

/// In a test store's `impl IdempotencyStore`: the named methods, each
/// handed unchanged to the `store` field.
macro_rules! forward_to_store {
    ($($method:ident),* $(,)?) => { $(forward_to_store!(@one $method);)* };
    (@one reserve) => {
        fn reserve<'a>(
            &'a self,
            req: idem::store::ReserveRequest<'a>,
        ) -> futures_util::future::BoxFuture<'a, Result<idem::store::Reservation, StoreError>> {
            self.store.reserve(req)
        }
    };
    (@one complete) => {
        fn complete<'a>(
            &'a self,
            id: &'a RecordId,
            token: &'a str,
            response: &'a StoredResponse,
        ) -> futures_util::future::BoxFuture<'a, Result<(), StoreError>> {
            self.store.complete(id, token, response)
        }
    };
    (@one release) => {
        fn release<'a>(
            &'a self,
            id: &'a RecordId,
            token: &'a str,
        ) -> futures_util::future::BoxFuture<'a, Result<(), StoreError>> {
            self.store.release(id, token)
        }
    };
    (@one reject) => {
        fn reject<'a>(
            &'a self,
            id: &'a RecordId,
            token: &'a str,
        ) -> futures_util::future::BoxFuture<'a, Result<(), StoreError>> {
            self.store.reject(id, token)
        }
    };
    (@one checkpoint) => {
        fn checkpoint<'a>(
            &'a self,
            id: &'a RecordId,
            token: &'a str,
            recovery_point: &'a str,
        ) -> futures_util::future::BoxFuture<'a, Result<(), StoreError>> {
            self.store.checkpoint(id, token, recovery_point)
        }
    };
    (@one extend_lock) => {
        fn extend_lock<'a>(
            &'a self,
            id: &'a RecordId,
            token: &'a str,
            lock_timeout: Duration,
        ) -> futures_util::future::BoxFuture<'a, Result<(), StoreError>> {
            self.store.extend_lock(id, token, lock_timeout)
        }
    };
    (@one purge_expired) => {
        fn purge_expired(&self, batch: u32) -> futures_util::future::BoxFuture<'_, Result<u64, StoreError>> {
            self.store.purge_expired(batch)
        }
    };
    (@one hand_back) => {
        fn hand_back<'a>(
            &'a self,
            id: &'a RecordId,
            token: &'a str,
            taken_over: bool,
        ) -> futures_util::future::BoxFuture<'a, Result<(), StoreError>> {
            self.store.hand_back(id, token, taken_over)
        }
    };
}

/// A memory store with faults: it panics when it reserves the key `boom`
/// (a panic outside the handler, where no guard of the handler's catches
/// it); when told, it fails every heartbeat (a lock extension by a lock
/// timeout), as the store of a process that crashed: its locks run out;
/// and, while `answers_lost` is set, a reservation takes effect but its
/// answer is an error (a timeout after the commit). It keeps the TTL and
/// the lock timeout of the last reservation asked of it.
struct Faulty {
    store: idem::MemoryStore,
    heartbeats_fail: bool,
    answers_lost: Arc<std::sync::atomic::AtomicBool>,
    asked: Arc<Mutex<Option<(Duration, Duration)>>>,
}

impl Faulty {
    fn new(heartbeats_fail: bool) -> Self {
        Faulty {
            store: idem::MemoryStore::new(),
            heartbeats_fail,
            answers_lost: Arc::default(),
            asked: Arc::default(),
        }
    }
}

impl IdempotencyStore for Faulty {
    fn reserve<'a>(
        &'a self,
        req: idem::store::ReserveRequest<'a>,
    ) -> futures_util::future::BoxFuture<'a, Result<idem::store::Reservation, StoreError>> {
        assert_ne!(req.id.key, "boom", "the store panicked");
        *self.asked.lock().unwrap() = Some((req.ttl, req.lock_timeout));
        let lost = self.answers_lost.load(std::sync::atomic::Ordering::SeqCst);
        Box::pin(async move {
            if req.id.key == "refused" {
                return Err(StoreError::backend("the store refused the record"));
            }
            let answer = self.store.reserve(req).await;
            if lost {
                return Err(StoreError::unavailable("the answer was lost after the commit"));
            }
            answer
        })
    }
    fn extend_lock<'a>(
        &'a self,
        id: &'a RecordId,
        token: &'a str,
        lock_timeout: Duration,
    ) -> futures_util::future::BoxFuture<'a, Result<(), StoreError>> {
        if self.heartbeats_fail && !lock_timeout.is_zero() {
            return Box::pin(async { Err(StoreError::unavailable("the crashed process's store")) });
        }
        self.store.extend_lock(id, token, lock_timeout)
    }
    forward_to_store!(complete, release, reject, checkpoint, purge_expired, hand_back);
}

/// A store whose completions never get through, and whose first release
/// takes 1.5 s and fails; later releases fail until 0.5 s after that, then
/// get through. Counts the releases that got through.
struct SlowToRelease {
    store: Arc<idem::MemoryStore>,
    releases: std::sync::atomic::AtomicUsize,
    open_at: Mutex<Option<std::time::Instant>>,
    released: Arc<std::sync::atomic::AtomicUsize>,
}

impl IdempotencyStore for SlowToRelease {
    fn complete<'a>(
        &'a self,
        _: &'a RecordId,
        _: &'a str,
        _: &'a StoredResponse,
    ) -> futures_util::future::BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async { Err(StoreError::unavailable("the completion's answer was lost")) })
    }
    fn release<'a>(
        &'a self,
        id: &'a RecordId,
        token: &'a str,
    ) -> futures_util::future::BoxFuture<'a, Result<(), StoreError>> {
        use std::sync::atomic::Ordering::SeqCst;
        Box::pin(async move {
            if self.releases.fetch_add(1, SeqCst) == 0 {
                tokio::time::sleep(Duration::from_millis(1500)).await;
                *self.open_at.lock().unwrap() = Some(std::time::Instant::now() + Duration::from_millis(500));
                return Err(StoreError::unavailable("the first release timed out"));
            }
            if self
                .open_at
                .lock()
                .unwrap()
                .is_some_and(|at| std::time::Instant::now() < at)
            {
                return Err(StoreError::unavailable("still down"));
            }
            let released = self.store.release(id, token).await;
            if released.is_ok() {
                self.released.fetch_add(1, SeqCst);
            }
            released
        })
    }
    forward_to_store!(reserve, checkpoint, extend_lock, purge_expired);
}

/// A SQLite store whose purges fail from the `fails_from`-th batch on
/// (counting from 1), as when the database goes away in the middle of a
/// janitor's round.
struct PurgeFailsFrom {
    store: idem::SqliteStore,
    batches: std::sync::atomic::AtomicU64,
    fails_from: u64,
}

impl IdempotencyStore for PurgeFailsFrom {
    fn purge_expired(&self, batch: u32) -> futures_util::future::BoxFuture<'_, Result<u64, StoreError>> {
        let n = self.batches.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        if n >= self.fails_from {
            return Box::pin(async { Err(StoreError::unavailable("the database went away")) });
        }
        self.store.purge_expired(batch)
    }
    forward_to_store!(
        reserve,
        complete,
        release,
        reject,
        checkpoint,
        extend_lock,
        hand_back
    );
}

/// A janitor's round that fails after two batches committed: what they
/// deleted is gone from the table and counted in `removed()` (the round's
/// total was counted only when the whole round succeeded), and
/// `purge_expired` says the batch's error.
#[tokio::test]
async fn a_janitor_round_that_fails_midway_counts_the_batches_it_committed() {
    use idem_testkit::records::take;
    let (sqlite, _dir) = idem_testkit::sqlite_store().await;
    let short = Duration::from_millis(1);
    for i in 0..250 {
        let id = RecordId::new("t", "janitor", format!("k{i}"));
        let lease = take(&sqlite, &id, "f", short, Duration::from_secs(30)).await;
        let done = StoredResponse {
            status: 201,
            headers: vec![],
            body: Some(vec![]),
        };
        sqlite.complete(&id, &lease.token, &done).await.unwrap();
    }
    // Past their TTL.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let left = |pool: sqlx::SqlitePool| async move {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_keys")
            .fetch_one(&pool)
            .await
            .unwrap();
        n
    };
    let store = Arc::new(PurgeFailsFrom {
        store: sqlite.clone(),
        batches: Default::default(),
        fails_from: 3,
    });
    let janitor = idem::Janitor::start(store.clone(), Duration::from_secs(3600), 100);
    for _ in 0..500 {
        if store.batches.load(std::sync::atomic::Ordering::SeqCst) >= 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        store.batches.load(std::sync::atomic::Ordering::SeqCst),
        3,
        "the round's third batch"
    );
    assert_eq!(left(sqlite.pool().clone()).await, 50);
    assert_eq!(janitor.removed(), 200);
    janitor.stop();
    // Called directly, the batch's error, and what came before it deleted.
    let direct = PurgeFailsFrom {
        store: sqlite.clone(),
        batches: Default::default(),
        fails_from: 2,
    };
    assert!(matches!(
        idem::purge_expired(&direct, 30).await,
        Err(StoreError::Unavailable { .. })
    ));
    assert_eq!(left(sqlite.pool().clone()).await, 20);
}

/// A give-back that fails after a long first try goes on in the background
/// for a lock timeout counted from that failure, not from before the try:
/// the lease kept extending the lock meanwhile. Here the store recovers
/// 0.5 s after the failed first try (the lock timeout is 1 s): the key is
/// given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_give_back_whose_first_try_was_slow_goes_on_for_a_lock_timeout_after_it() {
    use tower::ServiceExt as _;
    #[idempotent(scope = "lease.slow_release", lock_timeout = "1s")]
    async fn answered() -> StatusCode {
        StatusCode::CREATED
    }
    let released = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let store = SlowToRelease {
        store: Arc::new(idem::MemoryStore::new()),
        releases: std::sync::atomic::AtomicUsize::new(0),
        open_at: Mutex::new(None),
        released: released.clone(),
    };
    let idem = Idem::new(store).single_tenant();
    let app = Router::new()
        .route("/answered", post(answered))
        .layer(idem.clone().layer());
    let key = idem_testkit::unique("k-slow-release");
    let request = axum::http::Request::post("/answered")
        .header("idempotency-key", &key)
        .body(Body::empty())
        .unwrap();
    let answer = app.oneshot(request).await.unwrap();
    assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
    // The background tries come 0.1, 0.3 and 0.7 s after the failed one,
    // and a graceful shutdown waits for them (`Idem::idle`).
    tokio::time::timeout(Duration::from_secs(5), idem.idle())
        .await
        .expect("the give-back stopped while the lock it gives back was still live");
    assert_eq!(
        released.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "idle before the key was given back"
    );
}

/// A panic in the protocol outside the handler (here, the store's) is that
/// request's 500 `handler-failed`, on a connection that goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_outside_the_handler_is_the_requests_500() {
    #[idempotent(scope = "lease.boom")]
    async fn boom() -> StatusCode {
        StatusCode::CREATED
    }
    let app = Router::new()
        .route("/boom", post(boom))
        .layer(Idem::new(Faulty::new(false)).single_tenant().layer());
    let addr = idem_testkit::http::serve(app).await;
    let r = post_req("/boom", "").key("boom").send(addr).await;
    assert_eq!(r.status, 500, "{r:?}");
    assert_eq!(r.problem(), "handler-failed");
    let r = post_req("/boom", "").key("fine").send(addr).await;
    assert_eq!(r.status, 201, "{r:?}");
}

/// A store error that is not a connection's (the store answered, and
/// refused) is refused the same way as one that is: 503, handler not run,
/// never run unprotected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_refuses_the_reservation_answers_503_and_runs_nothing() {
    static RAN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    #[idempotent(scope = "lease.refused")]
    async fn refused() -> StatusCode {
        RAN.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        StatusCode::CREATED
    }
    let app = Router::new()
        .route("/refused", post(refused))
        .layer(Idem::new(Faulty::new(false)).single_tenant().layer());
    let addr = idem_testkit::http::serve(app).await;
    let r = post_req("/refused", "").key("refused").send(addr).await;
    assert_eq!(r.status, 503, "{r:?}");
    assert_eq!(r.problem(), "idempotency-store-unavailable");
    assert!(r.header("retry-after").is_some(), "{r:?}");
    assert_eq!(RAN.load(std::sync::atomic::Ordering::SeqCst), 0);
    let r = post_req("/refused", "").key("fine").send(addr).await;
    assert_eq!(r.status, 201, "{r:?}");
    assert_eq!(RAN.load(std::sync::atomic::Ordering::SeqCst), 1);
}

/// What a handler without settings asks the store for: the defaults the
/// README names, a retention of 24 hours and a lock of 60 seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_without_settings_keeps_24_hours_under_a_lock_of_60_seconds() {
    #[idempotent(scope = "lease.defaults")]
    async fn defaults() -> StatusCode {
        StatusCode::CREATED
    }
    let store = Faulty::new(false);
    let asked = store.asked.clone();
    let app = Router::new()
        .route("/defaults", post(defaults))
        .layer(Idem::new(store).single_tenant().layer());
    let addr = idem_testkit::http::serve(app).await;
    let r = post_req("/defaults", "").key("k-defaults").send(addr).await;
    assert_eq!(r.status, 201, "{r:?}");
    assert_eq!(
        *asked.lock().unwrap(),
        Some((Duration::from_secs(24 * 3600), Duration::from_secs(60)))
    );
}

/// Runs of `counted`, by key.
static COUNTED_RUNS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Counts its runs by key, under a lock of 300 ms.
#[idempotent(scope = "lease.counted", lock_timeout = "300ms")]
async fn counted(op: Operation) -> (StatusCode, String) {
    let mut runs = COUNTED_RUNS.lock().unwrap();
    runs.push(op.key().to_owned());
    let n = runs.iter().filter(|k| *k == op.key()).count();
    (StatusCode::CREATED, format!("run {n}"))
}

/// A validation: a negative `amount` in the query is refused with 400
/// (released as rejected, so the corrected request may use the key). The
/// answer tells the attempt and whether it took over. Lock 300 ms; a retry
/// waits for an execution in progress.
#[idempotent(scope = "lease.validated", lock_timeout = "300ms", wait = "10s")]
async fn validated(
    op: Operation,
    axum::extract::Query(q): axum::extract::Query<HashMap<String, i64>>,
) -> (StatusCode, String) {
    let told = format!("attempt {} takeover {}", op.attempt(), op.is_takeover());
    if q.get("amount").copied().unwrap_or(0) < 0 {
        (StatusCode::BAD_REQUEST, told)
    } else {
        (StatusCode::CREATED, told)
    }
}

fn validated_request(key: &str, amount: i64) -> axum::http::Request<Body> {
    axum::http::Request::post(format!("/validated?amount={amount}"))
        .header("idempotency-key", key)
        .body(Body::empty())
        .unwrap()
}

/// After a reservation of `key` that took a fresh key and never ran: the
/// key is as it was found. The next request is the operation's first
/// attempt, not a takeover; its validation failure frees the key, and the
/// corrected request runs (attempt 1 again: a new operation).
async fn assert_the_fresh_key_is_as_it_was_found(app: &Router, key: &str) {
    use tower::ServiceExt as _;
    assert_fresh_as_found(|amount| async move {
        let r = app.clone().oneshot(validated_request(key, amount)).await.unwrap();
        let status = r.status().as_u16();
        let body = axum::body::to_bytes(r.into_body(), usize::MAX).await.unwrap();
        (status, String::from_utf8_lossy(&body).into_owned())
    })
    .await;
}

/// [`assert_the_fresh_key_is_as_it_was_found`], with `send(amount)` sending
/// the `validated` request and saying its status and body.
async fn assert_fresh_as_found<F, Fut>(send: F)
where
    F: Fn(i64) -> Fut,
    Fut: std::future::Future<Output = (u16, String)>,
{
    assert_eq!(
        send(-1).await,
        (400, "attempt 1 takeover false".to_owned()),
        "the reservation that never ran counted as an attempt"
    );
    assert_eq!(
        send(5).await,
        (201, "attempt 1 takeover false".to_owned()),
        "the validation failure did not free the key"
    );
}

/// Runs of `counted` by key so far.
fn counted_runs(key: &str) -> usize {
    COUNTED_RUNS.lock().unwrap().iter().filter(|k| *k == key).count()
}

fn counting_router() -> Router {
    counting_router_on(idem::MemoryStore::new())
}

fn counting_router_on(store: impl IdempotencyStore) -> Router {
    Router::new()
        .route("/counted", post(counted))
        .route("/validated", post(validated))
        .layer(Idem::new(store).single_tenant().layer())
}

fn counted_request(key: &str) -> axum::http::Request<Body> {
    axum::http::Request::post("/counted")
        .header("idempotency-key", key)
        .body(Body::empty())
        .unwrap()
}

type RequestFuture = std::pin::Pin<Box<tower::util::Oneshot<Router, axum::http::Request<Body>>>>;

/// Polls a request for `key` until it stops at `point`; hands the request's
/// future back.
async fn request_paused_at(app: &Router, key: &str, point: &'static str) -> (RequestFuture, pause::Pause) {
    use tower::ServiceExt as _;
    let mut paused = pause::arm(point, key);
    let mut first = Box::pin(app.clone().oneshot(counted_request(key)));
    tokio::select! {
        _ = &mut first => panic!("answered while paused"),
        () = paused.reached() => {}
    }
    (first, paused)
}

/// Asks for `key` again until the answer is not 409 (for 5 s at most), and
/// checks that it is the replay of the one run.
async fn assert_replays_the_one_run(app: &Router, key: &str) {
    use tower::ServiceExt as _;
    let until = tokio::time::Instant::now() + Duration::from_secs(5);
    let retry = loop {
        let r = app.clone().oneshot(counted_request(key)).await.unwrap();
        if r.status() != StatusCode::CONFLICT || tokio::time::Instant::now() > until {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    let body = axum::body::to_bytes(retry.into_body(), usize::MAX).await.unwrap();
    assert_eq!(&body[..], b"run 1");
    assert_eq!(counted_runs(key), 1);
}

/// A request dropped on a thread of no runtime's (a service that moves its
/// futures around) still finishes its protocol, on the runtime it started
/// on: its retry replays the one execution.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_dropped_off_the_runtime_finishes_on_its_runtime() {
    let app = counting_router();
    let key = idem_testkit::unique("k-off-runtime");
    let (first, paused) = request_paused_at(&app, &key, pause::HANDLER_RETURNED).await;
    std::thread::spawn(move || drop(first)).join().unwrap();
    paused.resume();
    assert_replays_the_one_run(&app, &key).await;
}

tokio::task_local! {
    /// Scoped over each request by an application's middleware.
    static REQUEST_ID: u64;
}

/// What `reads_request_id` saw, in the order it ran.
static SEEN_IDS: Mutex<Vec<Option<u64>>> = Mutex::new(Vec::new());

/// Reads its middleware's task-local once its client may have left.
#[idempotent(scope = "lease.task_local")]
async fn reads_request_id(State(app): State<App>) -> StatusCode {
    let let_go = app.gate.notified();
    app.events.send("reading").unwrap();
    let_go.await;
    SEEN_IDS.lock().unwrap().push(REQUEST_ID.try_with(|id| *id).ok());
    StatusCode::CREATED
}

/// A handler runs the same way whether its client stays or leaves: in a
/// task of its own, where the request task's task-locals are not set. (Were
/// it run in the request's task while the client stays, it would see them,
/// and the same handler would fail only after a disconnect, when its retry
/// would run it again.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_runs_the_same_way_whether_its_client_stays_or_leaves() {
    async fn with_request_id(req: Request, next: Next) -> Response {
        REQUEST_ID.scope(7, next.run(req)).await
    }
    let mut h = start(Duration::from_secs(10), StoreKind::Memory)
        .await
        .expect("the memory store needs nothing");
    let app = Router::new()
        .route("/request-id", post(reads_request_id))
        .layer(Idem::from_arc(h.store.clone()).single_tenant().layer())
        .layer(middleware::from_fn(with_request_id))
        .layer(middleware::from_fn_with_state(h.app.clone(), watch_drops))
        .with_state(h.app.clone());
    let addr = idem_testkit::http::serve(app).await;

    let stays = tokio::spawn(async move { post_req("/request-id", "").key("k-stays").send(addr).await });
    h.told("reading").await;
    h.app.gate.notify_one();
    assert_eq!(stays.await.unwrap().status, 201);

    let leaves = post_req("/request-id", "").key("k-leaves").start(addr).await;
    h.told("reading").await;
    let dropped = h.app.dropped.notified();
    drop(leaves);
    dropped.await;
    h.app.gate.notify_one();
    let retry = post_req("/request-id", "")
        .key("k-leaves")
        .wait_for_replay(addr)
        .await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert_eq!(*SEEN_IDS.lock().unwrap(), [None, None]);
}

/// A request whose future is polled until its handler runs, then kept but
/// no longer polled (its caller went on to other work), does not hold its
/// key: the execution runs to its end by itself, and the retry replays it.
/// (Without an execution of its own, the key would stay in progress for as
/// long as the future is kept, the lease keeper extending its lock past the
/// 300 ms lock timeout: the retries would run out.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_execution_whose_request_is_no_longer_polled_still_ends() {
    let app = counting_router();
    let key = idem_testkit::unique("k-kept");
    let (first, paused) = request_paused_at(&app, &key, pause::HANDLER_RETURNED).await;
    paused.resume();
    assert_replays_the_one_run(&app, &key).await;
    drop(first);
}

/// Polls `first` (whose reservation was answered and resumed, and which
/// was then kept unpolled past its 300 ms lock) while a retry's takeover of
/// the key runs: its own execution must not start on a lock that ran out,
/// so the handler runs once, for the retry.
async fn assert_a_late_reservation_does_not_run(app: &Router, key: &str, first: RequestFuture) {
    use tower::ServiceExt as _;
    let retry = tokio::spawn(app.clone().oneshot(counted_request(key)));
    let until = tokio::time::Instant::now() + Duration::from_secs(5);
    while counted_runs(key) == 0 && tokio::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let first = first.await.unwrap();
    let retry = retry.await.unwrap().unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(first.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body = axum::body::to_bytes(first.into_body(), usize::MAX).await.unwrap();
    assert!(
        String::from_utf8_lossy(&body).contains("idempotency-store-unavailable"),
        "{body:?}"
    );
    assert_eq!(
        counted_runs(key),
        1,
        "the handler ran for the late reservation too"
    );
}

/// A reservation answered after its lock could have run out (here its
/// request was kept unpolled for twice the lock timeout) does not run its
/// handler: another request may have taken the key over meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_answered_after_its_lock_ran_out_does_not_run() {
    let app = counting_router();
    let key = idem_testkit::unique("k-late");
    let (first, paused) = request_paused_at(&app, &key, pause::RESERVE_AFTER).await;
    paused.resume();
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(counted_runs(&key), 0);
    assert_a_late_reservation_does_not_run(&app, &key, first).await;
}

/// The same on PostgreSQL, without a pause point: a test connection holds
/// the key's row uncommitted, the request is polled until its reservation
/// waits on that row lock, then no more; the row is rolled back, the
/// reservation takes the key on the server, and its answer waits, unread,
/// for twice the lock timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_reservation_answered_after_its_lock_ran_out_does_not_run() {
    use sqlx::Connection as _;
    use std::future::Future as _;
    use tower::ServiceExt as _;
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let store = idem_testkit::pg_store_in(&url, &schema, 8).await;
    let pool = store.pool().clone();
    let app = counting_router_on(store);
    let key = idem_testkit::unique("k-late-pg");
    let table = format!("\"{schema}\".idempotency_keys");

    let mut holder = sqlx::PgConnection::connect(&url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut holder).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {table} (tenant, scope, key, fingerprint, state, operation_id, attempt, \
         lock_expires_at, created_at, expires_at) \
         VALUES ('', 'lease.counted', $1, 'held', 'in_progress', 'op', 1, now(), now(), now())"
    )))
    .bind(&key)
    .execute(&mut holder)
    .await
    .unwrap();
    let mut first = Box::pin(app.clone().oneshot(counted_request(&key)));
    let waker = futures_util::task::noop_waker();
    let mut cx = std::task::Context::from_waker(&waker);
    let mut watcher = sqlx::PgConnection::connect(&url).await.unwrap();
    let until = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        // Polled only while its statement cannot finish.
        assert!(first.as_mut().poll(&mut cx).is_pending());
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
             AND query LIKE 'SELECT p.fingerprint%' AND query LIKE $1",
        )
        .bind(format!("%{schema}%"))
        .fetch_one(&mut watcher)
        .await
        .unwrap();
        if waiting > 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "the reservation never waited on the row"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    sqlx::query("ROLLBACK").execute(&mut holder).await.unwrap();
    let until = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let taken: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM {table} WHERE key = $1 AND lock_token IS NOT NULL"
        )))
        .bind(&key)
        .fetch_one(&pool)
        .await
        .unwrap();
        if taken == 1 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "the reservation never took the key"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(counted_runs(&key), 0);
    assert_a_late_reservation_does_not_run(&app, &key, first).await;
}

/// A SQLite reservation whose request is kept unpolled inside its write
/// transaction does not hold the process's turn at the write lock: the
/// write runs to its commit by itself, and a request on another key is
/// served meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_an_unpolled_reservation_holds_no_other_key_back() {
    use tower::ServiceExt as _;
    let (store, _dir) = idem_testkit::sqlite_store().await;
    let app = counting_router_on(store.with_timeout(Duration::from_secs(1)));
    let (a, b) = (
        idem_testkit::unique("k-unpolled-a"),
        idem_testkit::unique("k-unpolled-b"),
    );
    let (first, paused) = request_paused_at(&app, &a, pause::SQLITE_RESERVE_BEFORE_COMMIT).await;
    paused.resume();
    let other = app.clone().oneshot(counted_request(&b)).await.unwrap();
    assert_eq!(other.status(), StatusCode::CREATED);
    drop(first);
}

/// A reservation answered with less of its lock left than its first
/// extension needs (here at most 20 ms of a 300 ms lock: the keeper extends
/// a fresh lease halfway to its deadline, never sooner than 10 ms) does not
/// run: started, its lease would be lost before any extension, and a retry
/// would take the key over while its handler runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_answered_too_close_to_its_lock_deadline_does_not_run() {
    use tower::ServiceExt as _;
    let app = counting_router();
    let key = idem_testkit::unique("k-close");
    let mut reserved = pause::arm(pause::RESERVE_AFTER, &key);
    let first = tokio::spawn(app.clone().oneshot(counted_request(&key)));
    reserved.reached().await;
    tokio::time::sleep(Duration::from_millis(280)).await;
    reserved.resume();
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(counted_runs(&key), 0);
    // The key was given back: the retry runs at once.
    let retry = app.oneshot(counted_request(&key)).await.unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(counted_runs(&key), 1);
}

/// The key's row's history, as triggers on the record table write it: one
/// line per insert, update or delete.
async fn watch_rows(conn: &mut sqlx::SqliteConnection) {
    for statement in [
        "CREATE TABLE seen (what TEXT NOT NULL)",
        "CREATE TRIGGER seen_insert AFTER INSERT ON idempotency_keys BEGIN INSERT INTO seen VALUES ('inserted'); END",
        "CREATE TRIGGER seen_delete AFTER DELETE ON idempotency_keys BEGIN INSERT INTO seen VALUES ('deleted'); END",
        "CREATE TRIGGER seen_update AFTER UPDATE ON idempotency_keys BEGIN INSERT INTO seen VALUES ('updated'); END",
    ] {
        sqlx::query(statement).execute(&mut *conn).await.unwrap();
    }
}

/// A SQLite store whose operations time out after 100 ms (the undo of a
/// reservation then waits its lock timeout, 300 ms), its router, its pool,
/// another connection to its file whose row history `seen` keeps
/// ([`watch_rows`]), a fresh key, and the directory that holds the file.
async fn gave_up_setup() -> (
    Router,
    sqlx::SqlitePool,
    sqlx::SqliteConnection,
    String,
    tempfile::TempDir,
) {
    use sqlx::Connection as _;
    let (store, dir) = idem_testkit::sqlite_store().await;
    let pool = store.pool().clone();
    let app = counting_router_on(store.with_timeout(Duration::from_millis(100)));
    let url = format!("sqlite://{}", dir.path().join("idem.db").display());
    let mut other = sqlx::SqliteConnection::connect(&url).await.unwrap();
    watch_rows(&mut other).await;
    (app, pool, other, idem_testkit::unique("k-gave-up"), dir)
}

async fn rows_seen(pool: &sqlx::SqlitePool) -> Vec<String> {
    sqlx::query_scalar("SELECT what FROM seen ORDER BY rowid")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// A SQLite reservation whose caller gave up on it (the store timed out,
/// and the undo's own wait ran out too) while another connection held the
/// database's write lock is not written when its turn finally comes: no
/// lock is taken that nobody would hold, and nothing counts as an attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_reservation_given_up_on_before_its_turn_takes_nothing() {
    use tower::ServiceExt as _;
    let (app, pool, mut other, key, _dir) = gave_up_setup().await;
    sqlx::query("BEGIN IMMEDIATE").execute(&mut other).await.unwrap();
    let first = app.clone().oneshot(validated_request(&key, 5)).await.unwrap();
    assert_eq!(first.status(), StatusCode::SERVICE_UNAVAILABLE);
    // Past the store timeout and the undo's wait; then the line moves on.
    tokio::time::sleep(Duration::from_millis(800)).await;
    sqlx::query("ROLLBACK").execute(&mut other).await.unwrap();
    // The requests after it queue behind it: once they are answered, its
    // turn has come and gone.
    assert_the_fresh_key_is_as_it_was_found(&app, &key).await;
    // Only those requests wrote: the rejected attempt (taken, then
    // removed) and the one that ran (taken, then completed).
    assert_eq!(
        rows_seen(&pool).await,
        ["inserted", "deleted", "inserted", "updated"],
        "the reservation given up on wrote"
    );
}

/// A SQLite reservation whose write took its key, and whose caller gave up
/// on it before the commit (the store timed out, and the undo's own wait
/// ran out too): once committed, it gives the key back itself, as it found
/// it (here absent), so no lock stays that nobody holds and nothing counts
/// as an attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_reservation_that_takes_its_key_after_its_caller_gave_up_gives_it_back() {
    use tower::ServiceExt as _;
    let (app, pool, other, key, _dir) = gave_up_setup().await;
    drop(other);
    let mut before_commit = pause::arm(pause::SQLITE_RESERVE_BEFORE_COMMIT, &key);
    let first = tokio::spawn(app.clone().oneshot(validated_request(&key, 5)));
    before_commit.reached().await;
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.status(), StatusCode::SERVICE_UNAVAILABLE);
    // Past the undo's wait; then the write commits.
    tokio::time::sleep(Duration::from_millis(800)).await;
    before_commit.resume();
    // The write took the key, then gives it back as it found it: absent.
    let until = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let seen = rows_seen(&pool).await;
        if seen.len() >= 2 {
            assert_eq!(seen, ["inserted", "deleted"]);
            break;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "a lock that nobody holds: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_the_fresh_key_is_as_it_was_found(&app, &key).await;
}

/// What a run of `charge` was told: attempt, takeover, recovery point.
type Told = (u32, bool, Option<String>);

/// Each run of `charge`: its key, and what it was told.
static CHARGES: Mutex<Vec<(String, Told)>> = Mutex::new(Vec::new());

/// Attempt 1 charges, checkpoints, then never ends (its process crashed).
#[idempotent(scope = "lease.charge", lock_timeout = "300ms")]
async fn charge(op: Operation) -> (StatusCode, String) {
    if op.attempt() == 1 {
        op.checkpoint("charged").await.unwrap();
    }
    CHARGES.lock().unwrap().push((
        op.key().to_owned(),
        (op.attempt(), op.is_takeover(), op.recovery_point()),
    ));
    if op.attempt() == 1 {
        std::future::pending::<()>().await;
    }
    (StatusCode::CREATED, "charged".to_owned())
}

fn charges(key: &str) -> Vec<Told> {
    CHARGES
        .lock()
        .unwrap()
        .iter()
        .filter(|(k, _)| k == key)
        .map(|(_, told)| told.clone())
        .collect()
}

/// The first execution of `key` on `app` charges and hangs; its
/// heartbeats fail, so its lock runs out (300 ms) as a crashed process's
/// does.
async fn crash_the_first_execution(app: &Router, key: &str) {
    use tower::ServiceExt as _;
    drop(tokio::spawn(app.clone().oneshot(charge_request(key))));
    while charges(key).is_empty() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
}

fn charge_request(key: &str) -> axum::http::Request<Body> {
    axum::http::Request::post("/charge")
        .header("idempotency-key", key)
        .body(Body::empty())
        .unwrap()
}

/// A takeover whose reservation took effect but whose answer was lost (a
/// store timeout after the commit) is handed back as a stale lock, not
/// released: the next request is told that it takes over from the
/// execution that never ended, and sees its recovery point.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_whose_answer_was_lost_leaves_the_next_request_a_takeover() {
    use tower::ServiceExt as _;
    let store = Faulty::new(true);
    let answers_lost = store.answers_lost.clone();
    let app = Router::new()
        .route("/charge", post(charge))
        .layer(Idem::new(store).single_tenant().layer());
    let key = idem_testkit::unique("k-lost-takeover");
    crash_the_first_execution(&app, &key).await;
    answers_lost.store(true, std::sync::atomic::Ordering::SeqCst);
    let lost = app.clone().oneshot(charge_request(&key)).await.unwrap();
    assert_eq!(lost.status(), StatusCode::SERVICE_UNAVAILABLE);
    answers_lost.store(false, std::sync::atomic::Ordering::SeqCst);
    let retry = app.oneshot(charge_request(&key)).await.unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(charges(&key).len(), 2);
    assert_eq!(charges(&key)[1], (3, true, Some("charged".to_owned())));
}

/// A reservation of a fresh key that took effect but whose answer was lost
/// (a store timeout after the commit) leaves the key as it was found:
/// absent. Nothing ran, so it is no attempt: the next request is attempt 1,
/// not told it takes over, and a validation failure then frees the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_key_whose_answer_was_lost_is_as_it_was_found() {
    use tower::ServiceExt as _;
    let store = Faulty::new(false);
    let answers_lost = store.answers_lost.clone();
    let app = counting_router_on(store);
    let key = idem_testkit::unique("k-lost-fresh");
    answers_lost.store(true, std::sync::atomic::Ordering::SeqCst);
    let lost = app.clone().oneshot(validated_request(&key, -1)).await.unwrap();
    assert_eq!(lost.status(), StatusCode::SERVICE_UNAVAILABLE);
    answers_lost.store(false, std::sync::atomic::Ordering::SeqCst);
    assert_the_fresh_key_is_as_it_was_found(&app, &key).await;
}

/// A reservation of a fresh key refused before it ran (answered too close
/// to its lock deadline) leaves the key as it was found: absent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_reservation_refused_before_it_ran_is_as_it_was_found() {
    use tower::ServiceExt as _;
    let app = counting_router();
    let key = idem_testkit::unique("k-refused-fresh");
    let mut reserved = pause::arm(pause::RESERVE_AFTER, &key);
    let refused = tokio::spawn(app.clone().oneshot(validated_request(&key, -1)));
    reserved.reached().await;
    tokio::time::sleep(Duration::from_millis(285)).await;
    reserved.resume();
    assert_eq!(
        refused.await.unwrap().unwrap().status(),
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_the_fresh_key_is_as_it_was_found(&app, &key).await;
}

/// A takeover refused before it ran (answered too close to its deadline)
/// hands the key back as it found it, a stale lock: the next request is
/// told that it takes over from the execution that never ended, and sees
/// its recovery point. (Released instead, the key would read as let go,
/// and the next request would not be told.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_takeover_leaves_the_next_request_a_takeover() {
    use tower::ServiceExt as _;
    let app = Router::new()
        .route("/charge", post(charge))
        .layer(Idem::new(Faulty::new(true)).single_tenant().layer());
    let key = idem_testkit::unique("k-refused-takeover");
    let request = || charge_request(&key);
    crash_the_first_execution(&app, &key).await;
    // A takeover answered with at most 15 ms of its lock left: refused.
    let mut reserved = pause::arm(pause::RESERVE_AFTER, &key);
    let refused = tokio::spawn(app.clone().oneshot(request()));
    reserved.reached().await;
    tokio::time::sleep(Duration::from_millis(285)).await;
    reserved.resume();
    assert_eq!(
        refused.await.unwrap().unwrap().status(),
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(charges(&key).len(), 1, "the refused takeover ran nothing");
    let retry = app.oneshot(request()).await.unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED);
    // Attempt 3: the refused takeover counted as one.
    assert_eq!(charges(&key)[1], (3, true, Some("charged".to_owned())));
}

/// A request's protocol dropped before its first poll runs nothing: no
/// task is left to finish it, no key is taken, the handler never runs.
/// (Once polled, it goes on without its client; see the tests above.)
#[tokio::test(flavor = "current_thread")]
async fn a_protocol_dropped_before_its_first_poll_runs_nothing() {
    use axum::extract::FromRequestParts as _;
    use std::sync::atomic::{AtomicUsize, Ordering};
    static SPEC: idem::__private::Spec = idem::__private::Spec {
        scope: "lease.unpolled",
        header: "idempotency-key",
        optional: false,
        ttl: None,
        lock_timeout: None,
        wait: None,
        fields: None,
        ignore: &[],
        handler: "unpolled",
        at: "tests/lease.rs",
        scope_noted: idem::__private::ScopeNoted::new(),
    };
    static RAN: AtomicUsize = AtomicUsize::new(0);
    let store = Arc::new(idem::MemoryStore::new());
    let request = axum::http::Request::post("/unpolled")
        .header("idempotency-key", "k-unpolled")
        .body(())
        .unwrap();
    let (mut parts, ()) = request.into_parts();
    parts
        .extensions
        .insert(Idem::from_arc(store.clone()).single_tenant());
    let ctx: idem::__private::Context = idem::__private::Context::from_request_parts(&mut parts, &())
        .await
        .unwrap();
    let alive = tokio::runtime::Handle::current().metrics().num_alive_tasks();
    let protocol = idem::__private::run(
        ctx,
        &SPEC,
        Ok(idem::fingerprint::HexStr::of(b"fp")),
        |_op| async {
            RAN.fetch_add(1, Ordering::SeqCst);
            (StatusCode::CREATED.into_response(), None)
        },
    );
    drop(protocol);
    assert_eq!(
        tokio::runtime::Handle::current().metrics().num_alive_tasks(),
        alive,
        "nothing was left to run"
    );
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
    assert_eq!(RAN.load(Ordering::SeqCst), 0);
    assert_eq!(store.len(), 0, "no key was taken");
}

/// Extends the lock in `store`, counting a refusal (`LockLost`) in `refused`.
async fn extend_counting_refusals(
    store: &dyn IdempotencyStore,
    refused: &std::sync::atomic::AtomicUsize,
    id: &RecordId,
    token: &str,
    lock_timeout: Duration,
) -> Result<(), StoreError> {
    let extended = store.extend_lock(id, token, lock_timeout).await;
    if extended == Err(StoreError::LockLost) {
        refused.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
    extended
}

/// A memory store that counts the lock extensions refused as `LockLost`
/// (every one of an execution whose record was completed or let go).
struct CountsRefusedExtensions {
    store: idem::MemoryStore,
    refused: Arc<std::sync::atomic::AtomicUsize>,
}

impl IdempotencyStore for CountsRefusedExtensions {
    fn extend_lock<'a>(
        &'a self,
        id: &'a RecordId,
        token: &'a str,
        lock_timeout: Duration,
    ) -> futures_util::future::BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(extend_counting_refusals(
            &self.store,
            &self.refused,
            id,
            token,
            lock_timeout,
        ))
    }
    forward_to_store!(
        reserve,
        complete,
        release,
        reject,
        checkpoint,
        purge_expired,
        hand_back
    );
}

/// A POST of `body` to `path` under the idempotency key `key`.
fn keyed_post(path: &str, key: &str, body: &'static str) -> axum::http::Request<Body> {
    axum::http::Request::post(path)
        .header("idempotency-key", key)
        .body(Body::from(body))
        .unwrap()
}

/// 201 with a 1,600-byte body in two chunks: over a stored limit of 1,024.
fn large_answer() -> Response {
    let chunk = || Ok::<_, std::io::Error>(axum::body::Bytes::from(vec![b'x'; 800]));
    let body = futures_util::stream::iter([chunk(), chunk()]);
    (StatusCode::CREATED, Body::from_stream(body)).into_response()
}

/// The `Operation`s of the handlers below, by key, for the tests to ask
/// after the execution ended.
static KEPT_OPS: Mutex<Vec<(String, Operation)>> = Mutex::new(Vec::new());

/// Keeps `op`, and answers 503 (released as failed) for the body `fail`,
/// 201 otherwise.
fn keep_and_answer(op: &Operation, body: &str) -> StatusCode {
    KEPT_OPS.lock().unwrap().push((op.key().to_owned(), op.clone()));
    if body == "fail" {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::CREATED
    }
}

/// The `Operation` that `keep_and_answer` kept for `key`.
fn kept_op(key: &str) -> Operation {
    let ops = KEPT_OPS.lock().unwrap();
    ops.iter()
        .find(|(k, _)| k == key)
        .map(|(_, op)| op.clone())
        .unwrap()
}

#[idempotent(scope = "lease.settles", lock_timeout = "150ms")]
async fn settles(op: Operation, body: String) -> StatusCode {
    keep_and_answer(&op, &body)
}

/// An execution whose answer is recorded (or whose key is let go) is never
/// told its lease is lost, though its lease keeper still beats until the
/// execution ends and finds the lock gone: the execution's own completion
/// cleared it. Held right after the completion (and the release) committed,
/// while a lock extension is refused; on a one-thread runtime the keeper's
/// handling of the refusal is done by the time the test sees it counted.
#[tokio::test]
async fn a_settled_execution_is_not_told_its_lease_is_lost() {
    use tower::ServiceExt as _;
    let refused = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let store = CountsRefusedExtensions {
        store: idem::MemoryStore::new(),
        refused: refused.clone(),
    };
    let app = Router::new()
        .route("/settles", post(settles))
        .layer(Idem::new(store).single_tenant().layer());
    for (body, point, status) in [
        ("ok", pause::COMPLETE_AFTER, StatusCode::CREATED),
        ("fail", pause::RELEASE_AFTER, StatusCode::SERVICE_UNAVAILABLE),
    ] {
        let key = idem_testkit::unique("settles");
        let request = || keyed_post("/settles", &key, body);
        let mut settled = pause::arm(point, &key);
        let first = tokio::spawn(app.clone().oneshot(request()));
        settled.reached().await;
        let before = refused.load(std::sync::atomic::Ordering::SeqCst);
        let waited = tokio::time::timeout(Duration::from_secs(10), async {
            while refused.load(std::sync::atomic::Ordering::SeqCst) == before {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await;
        assert!(
            waited.is_ok(),
            "{body}: no lock extension was refused after the execution settled"
        );
        let op = kept_op(&key);
        assert!(
            !op.is_lease_lost(),
            "{body}: told its lease is lost once its own outcome was recorded"
        );
        settled.resume();
        assert_eq!(first.await.unwrap().unwrap().status(), status, "{body}");
        assert!(
            !op.is_lease_lost(),
            "{body}: told its lease is lost after it ended"
        );
        let lost = tokio::time::timeout(Duration::from_millis(100), op.lease_lost()).await;
        assert!(
            lost.is_err(),
            "{body}: lease_lost resolved for a settled execution"
        );
    }
}

/// A memory store on which every completion and release is refused as
/// `LockLost`: another execution took the operation over just before.
struct TakenOverAtTheEnd {
    store: idem::MemoryStore,
}

impl IdempotencyStore for TakenOverAtTheEnd {
    fn complete<'a>(
        &'a self,
        _: &'a RecordId,
        _: &'a str,
        _: &'a StoredResponse,
    ) -> futures_util::future::BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async { Err(StoreError::LockLost) })
    }
    fn release<'a>(
        &'a self,
        _: &'a RecordId,
        _: &'a str,
    ) -> futures_util::future::BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async { Err(StoreError::LockLost) })
    }
    forward_to_store!(reserve, reject, checkpoint, extend_lock, purge_expired, hand_back);
}

/// An execution whose completion (or release) finds the operation taken
/// over is told its lease is lost, whether or not a lock extension saw it
/// first (here none runs: the lock timeout is long), and its client gets
/// 503 `idempotency-lease-lost`.
#[tokio::test]
async fn an_execution_whose_outcome_finds_a_takeover_is_told_its_lease_is_lost() {
    use tower::ServiceExt as _;
    #[idempotent(scope = "lease.overtaken", lock_timeout = "1h")]
    async fn overtaken(op: Operation, body: String) -> StatusCode {
        keep_and_answer(&op, &body)
    }
    let store = TakenOverAtTheEnd {
        store: idem::MemoryStore::new(),
    };
    let app = Router::new()
        .route("/overtaken", post(overtaken))
        .layer(Idem::new(store).single_tenant().layer());
    for body in ["ok", "fail"] {
        let key = idem_testkit::unique("overtaken");
        let request = axum::http::Request::post("/overtaken")
            .header("idempotency-key", &key)
            .body(Body::from(body))
            .unwrap();
        let answer = app.clone().oneshot(request).await.unwrap();
        assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert_eq!(
            answer.headers()[header::CONTENT_TYPE],
            "application/problem+json",
            "{body}"
        );
        let op = kept_op(&key);
        assert!(op.is_lease_lost(), "{body}: not told of the takeover");
        tokio::time::timeout(Duration::from_secs(5), op.lease_lost())
            .await
            .unwrap_or_else(|_| panic!("{body}: lease_lost did not resolve"));
    }
}

/// A memory store whose completions are not confirmed: each answers that
/// the store is unavailable; with `first_commits`, the first one takes
/// effect before it answers so (an answer lost after its commit).
struct UnconfirmedCompletions {
    store: idem::MemoryStore,
    first_commits: bool,
    completions: std::sync::atomic::AtomicUsize,
}

impl IdempotencyStore for UnconfirmedCompletions {
    fn complete<'a>(
        &'a self,
        id: &'a RecordId,
        token: &'a str,
        response: &'a StoredResponse,
    ) -> futures_util::future::BoxFuture<'a, Result<(), StoreError>> {
        let first = self.completions.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0;
        Box::pin(async move {
            if first && self.first_commits {
                self.store.complete(id, token, response).await?;
            }
            Err(StoreError::unavailable("no answer from the store"))
        })
    }
    forward_to_store!(
        reserve,
        release,
        reject,
        checkpoint,
        extend_lock,
        purge_expired,
        hand_back
    );
}

/// An execution whose completion the store never confirms is told its
/// lease is lost: another execution may take the operation over, and
/// whether its own write took effect is not known. Its client gets 503.
/// When nothing took effect, the key was given back and the retry runs
/// the operation again (attempt 2); when the first write did take effect,
/// the retry replays that answer. The execution is told either way, as
/// the README says: only a confirmed outcome is never a loss.
#[tokio::test]
async fn an_execution_whose_outcome_is_not_confirmed_is_told_its_lease_is_lost() {
    use tower::ServiceExt as _;
    #[idempotent(scope = "lease.unconfirmed", lock_timeout = "1h")]
    async fn unconfirmed(op: Operation) -> String {
        keep_and_answer(&op, "ok");
        format!("attempt {}", op.attempt())
    }
    for first_commits in [false, true] {
        let store = UnconfirmedCompletions {
            store: idem::MemoryStore::new(),
            first_commits,
            completions: std::sync::atomic::AtomicUsize::new(0),
        };
        let app = Router::new()
            .route("/unconfirmed", post(unconfirmed))
            .layer(Idem::new(store).single_tenant().layer());
        let key = idem_testkit::unique("unconfirmed");
        let request = || keyed_post("/unconfirmed", &key, "");
        let first = app.clone().oneshot(request()).await.unwrap();
        assert_eq!(first.status(), StatusCode::SERVICE_UNAVAILABLE, "{first_commits}");
        assert!(kept_op(&key).is_lease_lost(), "{first_commits}: not told");
        let retry = app.clone().oneshot(request()).await.unwrap();
        let replayed = retry.headers().contains_key("idempotent-replayed");
        let body = axum::body::to_bytes(retry.into_body(), 1 << 10).await.unwrap();
        if first_commits {
            assert!(replayed && &body[..] == b"attempt 1", "{body:?}");
        } else {
            // Run again (its completion unconfirmed too), as attempt 2.
            assert!(!replayed, "{body:?}");
            let ops = KEPT_OPS.lock().unwrap();
            let attempts: Vec<u32> = ops
                .iter()
                .filter(|(k, _)| *k == key)
                .map(|(_, op)| op.attempt())
                .collect();
            assert_eq!(attempts, [1, 2]);
        }
    }
}

/// An execution told its lease is lost before it answered never gives its
/// answer, a large one included: one over the stored limit streams to its
/// client while it completes, so its status and first bytes would go out
/// before the completion refused it. Its client gets 503
/// `idempotency-lease-lost`, and the retry runs the operation again. The
/// lease ends at its deadline: every extension fails (a store that cannot
/// be reached).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_answer_after_the_lease_was_lost_is_never_given() {
    use tower::ServiceExt as _;
    #[idempotent(scope = "lease.large_after_loss", lock_timeout = "300ms")]
    async fn large_after_loss(op: Operation) -> Response {
        keep_and_answer(&op, "ok");
        if op.attempt() == 1 {
            tokio::time::timeout(Duration::from_secs(20), op.lease_lost())
                .await
                .expect("the lease is lost within 20 s");
        }
        large_answer()
    }
    let app = Router::new().route("/large", post(large_after_loss)).layer(
        Idem::new(Faulty::new(true))
            .single_tenant()
            .max_stored_body(1024)
            .unwrap()
            .layer(),
    );
    let key = idem_testkit::unique("large-after-loss");
    let request = || keyed_post("/large", &key, "");
    let first = app.clone().oneshot(request()).await.unwrap();
    assert!(kept_op(&key).is_lease_lost());
    assert_eq!(first.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body = axum::body::to_bytes(first.into_body(), 1 << 20).await.unwrap();
    assert!(
        String::from_utf8_lossy(&body).contains("idempotency-lease-lost"),
        "{body:?}"
    );
    let retry = app.oneshot(request()).await.unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert!(!retry.headers().contains_key("idempotent-replayed"));
    let attempts: Vec<u32> = KEPT_OPS
        .lock()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k == key)
        .map(|(_, op)| op.attempt())
        .collect();
    assert_eq!(attempts, [1, 2], "the operation ran again");
}

/// An answer over the stored limit whose handler writes in its SQLite
/// transaction goes out at once: nothing before it waits for the store
/// (the transaction holds the database's write lock until the completion,
/// so a store write first would wait SQLite's busy timeout, 5 s).
#[tokio::test]
async fn a_large_answer_of_a_sqlite_transaction_is_not_held_up() {
    use tower::ServiceExt as _;
    #[idempotent(scope = "lease.large_tx", lock_timeout = "30s")]
    async fn large_tx(op: Operation) -> Result<Response, StatusCode> {
        let mut conn = op
            .sqlite_transaction()
            .await
            .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
        sqlx::query("CREATE TABLE IF NOT EXISTS large_tx_effects (key TEXT)")
            .execute(&mut *conn)
            .await
            .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
        drop(conn);
        Ok(large_answer())
    }
    let (store, _dir) = idem_testkit::sqlite_store().await;
    let store = store.with_timeout(Duration::from_secs(20));
    let app = Router::new().route("/large-tx", post(large_tx)).layer(
        Idem::new(store)
            .single_tenant()
            .max_stored_body(1024)
            .unwrap()
            .layer(),
    );
    let key = idem_testkit::unique("large-tx");
    let request = || keyed_post("/large-tx", &key, "");
    let answered = tokio::time::timeout(Duration::from_secs(3), async {
        let first = app.clone().oneshot(request()).await.unwrap();
        let status = first.status();
        (
            status,
            axum::body::to_bytes(first.into_body(), 1 << 20).await.unwrap(),
        )
    })
    .await
    .expect("answered well within the store's timeout");
    assert_eq!((answered.0, answered.1.len()), (StatusCode::CREATED, 1600));
    let replay = app.oneshot(request()).await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
}

/// The lease while an execution records its outcome, on PostgreSQL, with
/// row locks held by a test connection: a takeover met by a completion or
/// a release that fails is told; a completion that waits past the lease's
/// deadline and then commits is answered and not told a loss.
mod settling {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use tower::ServiceExt as _;

    #[idempotent(scope = "lease.settle_completes", lock_timeout = "6s")]
    async fn completes(op: Operation) -> StatusCode {
        keep_and_answer(&op, "ok")
    }

    #[idempotent(scope = "lease.settle_fails", lock_timeout = "6s")]
    async fn fails(op: Operation) -> StatusCode {
        keep_and_answer(&op, "fail")
    }

    #[idempotent(scope = "lease.settle_short", lock_timeout = "300ms")]
    async fn short(op: Operation) -> StatusCode {
        keep_and_answer(&op, "ok")
    }

    /// Fails (503: released as failed) with its transaction's connection
    /// busy for 3 s: the statement whose future it drops runs on at the
    /// server, so the rollback of its transaction waits for it.
    #[idempotent(scope = "lease.settle_slow_rollback", lock_timeout = "300ms")]
    async fn slow_rollback(op: Operation) -> StatusCode {
        let mut conn = op.pg_transaction().await.unwrap();
        let busy = sqlx::query("SELECT pg_sleep(3)").execute(&mut *conn);
        let _ = tokio::time::timeout(Duration::from_millis(50), busy).await;
        drop(conn);
        keep_and_answer(&op, "fail")
    }

    /// A PostgreSQL store that counts the lock extensions refused as
    /// `LockLost`, and the extensions dropped before they answered (the
    /// keeper's deadline); and, at its first release, tells the test,
    /// waits for its go-ahead and then for a refused extension, before
    /// (or, `release_first`, after) handing the release to PostgreSQL.
    struct Pinned {
        store: idem::PgStore,
        refused: Arc<AtomicUsize>,
        abandoned: Arc<AtomicUsize>,
        release_first: bool,
        at_release: Mutex<
            Option<(
                tokio::sync::oneshot::Sender<()>,
                tokio::sync::oneshot::Receiver<()>,
            )>,
        >,
    }

    /// Counts its extension as abandoned unless it answered.
    struct Unanswered(Arc<AtomicUsize>, bool);

    impl Drop for Unanswered {
        fn drop(&mut self) {
            if !self.1 {
                self.0.fetch_add(1, SeqCst);
            }
        }
    }

    impl IdempotencyStore for Pinned {
        fn extend_lock<'a>(
            &'a self,
            id: &'a RecordId,
            token: &'a str,
            lock_timeout: Duration,
        ) -> futures_util::future::BoxFuture<'a, Result<(), StoreError>> {
            Box::pin(async move {
                let mut unanswered = Unanswered(self.abandoned.clone(), false);
                let extended =
                    extend_counting_refusals(&self.store, &self.refused, id, token, lock_timeout).await;
                unanswered.1 = true;
                extended
            })
        }
        fn release<'a>(
            &'a self,
            id: &'a RecordId,
            token: &'a str,
        ) -> futures_util::future::BoxFuture<'a, Result<(), StoreError>> {
            Box::pin(async move {
                let hook = self.at_release.lock().unwrap().take();
                let Some((reached, go)) = hook else {
                    return self.store.release(id, token).await;
                };
                let first = if self.release_first {
                    Some(self.store.release(id, token).await)
                } else {
                    None
                };
                let _ = reached.send(());
                let _ = go.await;
                until(&self.refused, "an extension is refused").await;
                match first {
                    Some(first) => first,
                    None => self.store.release(id, token).await,
                }
            })
        }
        forward_to_store!(reserve, complete, reject, checkpoint, purge_expired, hand_back);
    }

    /// Waits (bounded) until `count` is above 0.
    async fn until(count: &AtomicUsize, what: &str) {
        tokio::time::timeout(Duration::from_secs(20), async {
            while count.load(SeqCst) == 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{what} within 20 s"));
    }

    struct Db {
        url: String,
        schema: String,
        pool: sqlx::PgPool,
    }

    /// A pinned store in a fresh schema, bounded by `timeout`, its
    /// release hook's ends, and the database.
    #[allow(clippy::type_complexity)]
    async fn pinned(
        timeout: Duration,
        release_first: bool,
    ) -> Option<(
        Pinned,
        tokio::sync::oneshot::Receiver<()>,
        tokio::sync::oneshot::Sender<()>,
        Db,
    )> {
        let url = idem_testkit::pg_url()?;
        let schema = idem_testkit::pg_schema(&url).await;
        let store = idem_testkit::pg_store_in(&url, &schema, 8)
            .await
            .with_timeout(timeout);
        let pool = store.pool().clone();
        let (reached_tx, reached_rx) = tokio::sync::oneshot::channel();
        let (go_tx, go_rx) = tokio::sync::oneshot::channel();
        let pinned = Pinned {
            store,
            refused: Arc::default(),
            abandoned: Arc::default(),
            release_first,
            at_release: Mutex::new(Some((reached_tx, go_rx))),
        };
        Some((pinned, reached_rx, go_tx, Db { url, schema, pool }))
    }

    impl Db {
        /// A test connection in an open transaction.
        async fn begin(&self) -> sqlx::PgConnection {
            use sqlx::Connection as _;
            let mut c = sqlx::PgConnection::connect(&self.url).await.unwrap();
            sqlx::query("BEGIN").execute(&mut c).await.unwrap();
            c
        }

        /// Another execution takes the record over in `c`'s transaction,
        /// whose row lock stays until `c` commits.
        async fn take_over_in(&self, c: &mut sqlx::PgConnection, key: &str) {
            let sql = format!(
                "UPDATE \"{}\".idempotency_keys SET lock_token = 'intruder', attempt = attempt + 1, \
                 taken_over = 1 WHERE key = $1 AND state = 'in_progress'",
                self.schema
            );
            let done = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(key)
                .execute(&mut *c)
                .await
                .unwrap();
            assert_eq!(done.rows_affected(), 1);
        }

        async fn hold_row(&self, c: &mut sqlx::PgConnection, key: &str) {
            let sql = format!(
                "SELECT 1 FROM \"{}\".idempotency_keys WHERE key = $1 FOR UPDATE",
                self.schema
            );
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(key)
                .execute(&mut *c)
                .await
                .unwrap();
        }

        /// The record's state and lock token.
        async fn row(&self, key: &str) -> (String, Option<String>) {
            let sql = format!(
                "SELECT state, lock_token FROM \"{}\".idempotency_keys WHERE key = $1",
                self.schema
            );
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind(key)
                .fetch_one(&self.pool)
                .await
                .unwrap()
        }
    }

    async fn commit(mut c: sqlx::PgConnection) {
        sqlx::query("COMMIT").execute(&mut c).await.unwrap();
    }

    /// Right after the handler returned, another execution takes the
    /// record over in a transaction that holds the row, so that the
    /// execution's outcome write (at `path`) times out on it; then the
    /// takeover commits, and the keeper's next extension is refused while
    /// the execution settles. Its answer is not given, and it is told its
    /// lease is lost. Answers the client's status.
    async fn takeover_met_by_a_failing_write(
        path: &str,
        handler: axum::routing::MethodRouter,
        release_first: bool,
    ) -> Option<StatusCode> {
        let (store, reached, go, db) = pinned(Duration::from_millis(200), release_first).await?;
        let refused = store.refused.clone();
        let app = Router::new()
            .route(path, handler)
            .layer(Idem::new(store).single_tenant().layer());
        let key = idem_testkit::unique("settle-takeover");
        let mut returned = pause::arm(pause::HANDLER_RETURNED, &key);
        let first = tokio::spawn(app.clone().oneshot(keyed_post(path, &key, "")));
        returned.reached().await;
        let mut intruder = db.begin().await;
        db.take_over_in(&mut intruder, &key).await;
        returned.resume();
        // The write timed out (every completion attempt, or the release's
        // first); the release hook holds it.
        tokio::time::timeout(Duration::from_secs(20), reached)
            .await
            .expect("the write was tried within 20 s")
            .unwrap();
        commit(intruder).await;
        go.send(()).unwrap();
        let status = first.await.unwrap().unwrap().status();
        assert_eq!(db.row(&key).await.1.as_deref(), Some("intruder"), "{path}");
        assert!(refused.load(SeqCst) >= 1, "{path}");
        assert!(kept_op(&key).is_lease_lost(), "{path}: taken over, and not told");
        Some(status)
    }

    /// A completion that fails after a takeover: its client gets 503.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_a_takeover_met_by_a_failing_completion_is_told() {
        let status = takeover_met_by_a_failing_write("/completes", post(completes), false).await;
        assert!(
            status.is_none_or(|s| s == StatusCode::SERVICE_UNAVAILABLE),
            "{status:?}"
        );
    }

    /// A handler that failed (503, released as failed) and whose release
    /// fails after a takeover.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_a_takeover_met_by_a_failing_release_is_told() {
        takeover_met_by_a_failing_write("/fails", post(fails), true).await;
    }

    /// A failed execution settles before its transaction's rollback, not
    /// after it: the lease's deadline that passes while the rollback waits
    /// is not a loss, when the release that follows is confirmed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_a_release_confirmed_after_a_slow_rollback_is_not_a_loss() {
        // The handler's transaction needs the `PgStore` itself.
        let Some(url) = idem_testkit::pg_url() else { return };
        let schema = idem_testkit::pg_schema(&url).await;
        let store = idem_testkit::pg_store_in(&url, &schema, 8)
            .await
            .with_timeout(Duration::from_secs(20));
        let pool = store.pool().clone();
        let db = Db { url, schema, pool };
        let app = Router::new()
            .route("/slow-rollback", post(slow_rollback))
            .layer(Idem::new(store).single_tenant().layer());
        let key = idem_testkit::unique("settle-rollback");
        let mut returned = pause::arm(pause::HANDLER_RETURNED, &key);
        let first = tokio::spawn(app.oneshot(keyed_post("/slow-rollback", &key, "")));
        returned.reached().await;
        let mut holder = db.begin().await;
        db.hold_row(&mut holder, &key).await;
        returned.resume();
        // The keeper's extensions wait on the row: its deadline (300 ms)
        // passes while the rollback still waits (3 s).
        tokio::time::sleep(Duration::from_secs(1)).await;
        let op = kept_op(&key);
        assert!(!op.is_lease_lost(), "told a loss while its rollback waits");
        commit(holder).await;
        let first = first.await.unwrap().unwrap();
        assert_eq!(first.status(), StatusCode::SERVICE_UNAVAILABLE);
        let body = axum::body::to_bytes(first.into_body(), 1 << 16).await.unwrap();
        assert!(body.is_empty(), "the handler's own answer: {body:?}");
        assert_eq!(db.row(&key).await, ("in_progress".to_owned(), None), "released");
        assert!(
            !op.is_lease_lost(),
            "told a loss for a release the store confirmed"
        );
    }

    /// A completion that waits on a row lock past the lease's deadline
    /// (the keeper's extension, waiting on the same row, is abandoned at
    /// the deadline) and then commits: nobody took over, the answer is
    /// given and replayed, and the execution is never told a loss. On a
    /// one-thread runtime the keeper has handled the abandoned extension
    /// by the time the test sees it counted.
    #[tokio::test]
    async fn postgres_a_completion_that_commits_after_the_deadline_is_not_a_loss() {
        let Some((store, _reached, _go, db)) = pinned(Duration::from_secs(20), false).await else {
            return;
        };
        let abandoned = store.abandoned.clone();
        let app = Router::new()
            .route("/short", post(short))
            .layer(Idem::new(store).single_tenant().layer());
        let key = idem_testkit::unique("settle-deadline");
        let mut returned = pause::arm(pause::HANDLER_RETURNED, &key);
        let first = tokio::spawn(app.clone().oneshot(keyed_post("/short", &key, "")));
        returned.reached().await;
        let mut holder = db.begin().await;
        db.hold_row(&mut holder, &key).await;
        returned.resume();
        until(&abandoned, "the lease's deadline passes").await;
        let op = kept_op(&key);
        assert!(!op.is_lease_lost(), "told a loss while its completion waits");
        commit(holder).await;
        let first = first.await.unwrap().unwrap();
        assert_eq!(first.status(), StatusCode::CREATED);
        assert_eq!(db.row(&key).await, ("completed".to_owned(), None));
        let retry = app.oneshot(keyed_post("/short", &key, "")).await.unwrap();
        assert_eq!(retry.headers()["idempotent-replayed"], "true");
        assert!(
            !op.is_lease_lost(),
            "told a loss for an answer given and replayed"
        );
    }
}

/// An order, refused (422) when it is for nothing.
#[derive(serde::Deserialize, serde::Serialize)]
struct Order {
    quantity: u32,
}

/// 422 for an order of nothing, else 201.
#[idempotent(scope = "lease.order")]
async fn order(axum::Json(o): axum::Json<Order>) -> StatusCode {
    if o.quantity == 0 {
        StatusCode::UNPROCESSABLE_ENTITY
    } else {
        StatusCode::CREATED
    }
}

/// A memory store whose first rejection fails (the database unreachable
/// for that one statement); every other call goes through.
struct RejectFailsOnce {
    store: idem::MemoryStore,
    rejects: std::sync::atomic::AtomicUsize,
}

impl IdempotencyStore for RejectFailsOnce {
    fn reject<'a>(
        &'a self,
        id: &'a RecordId,
        token: &'a str,
    ) -> futures_util::future::BoxFuture<'a, Result<(), StoreError>> {
        if self.rejects.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
            return Box::pin(async { Err(StoreError::unavailable("the rejection did not get through")) });
        }
        self.store.reject(id, token)
    }
    forward_to_store!(
        reserve,
        complete,
        release,
        checkpoint,
        extend_lock,
        purge_expired,
        hand_back
    );
}

/// A rejection (the handler's 422) whose write to the store fails is tried
/// again as a rejection: the key is freed, so the client's corrected
/// request runs. Released as failed instead, the key stayed bound to the
/// refused request, and the corrected one got 422 `idempotency-key-reused`
/// until the record expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejection_whose_write_fails_still_frees_the_key() {
    use tower::ServiceExt as _;
    let store = RejectFailsOnce {
        store: idem::MemoryStore::new(),
        rejects: std::sync::atomic::AtomicUsize::new(0),
    };
    let app = Router::new()
        .route("/order", post(order))
        .layer(Idem::new(store).single_tenant().layer());
    let key = idem_testkit::unique("k-reject-fails-once");
    let request = |body: &'static str| json_post("/order", &key, body);
    let refused = app.clone().oneshot(request(r#"{"quantity": 0}"#)).await.unwrap();
    assert_eq!(refused.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert!(refused.headers().get("idempotent-replayed").is_none());
    let corrected = app.oneshot(request(r#"{"quantity": 2}"#)).await.unwrap();
    assert_eq!(
        corrected.status(),
        StatusCode::CREATED,
        "the corrected request with the rejected request's key did not run"
    );
}

/// A rejection whose write commits but whose answer is lost (the store's
/// timeout runs out just after the commit) is tried again, and that try
/// finds the record gone: the rejection it asked for is done. The client
/// gets the handler's answer, not 503 `idempotency-lease-lost` (nobody took
/// the operation over), and the corrected request with the same key runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejection_committed_but_unanswered_still_answers_the_rejection() {
    use tower::ServiceExt as _;
    for kind in [StoreKind::Sqlite, StoreKind::Postgres] {
        let timeout = Duration::from_millis(300);
        let Some((app, _dir)) = sql_app(kind, timeout, "/order", post(order)).await else {
            return;
        };
        let key = idem_testkit::unique("k-reject-unanswered");
        let request = |body: &'static str| json_post("/order", &key, body);
        // Held past the store's timeout right after the rejection
        // committed: the store answers with a timeout, and the runtime
        // tries the rejection again.
        let mut committed = pause::arm(pause::REJECT_AFTER, &key);
        let refused = tokio::spawn(app.clone().oneshot(request(r#"{"quantity": 0}"#)));
        committed.reached().await;
        let refused = refused.await.unwrap().unwrap();
        drop(committed);
        let problem = refused
            .headers()
            .get(header::CONTENT_TYPE)
            .map(|v| v.to_str().unwrap().to_owned());
        assert_eq!(
            refused.status(),
            StatusCode::UNPROCESSABLE_ENTITY,
            "{kind:?}: the rejection was recorded, and its answer not given ({problem:?})"
        );
        assert!(refused.headers().get("idempotent-replayed").is_none());
        let corrected = app.oneshot(request(r#"{"quantity": 2}"#)).await.unwrap();
        assert_eq!(corrected.status(), StatusCode::CREATED, "{kind:?}");
    }
}

/// A SQLite store on a temporary file or a PostgreSQL store in a schema of
/// its own, with the given store timeout; `None` without `DATABASE_URL`.
async fn sql_store(
    kind: StoreKind,
    timeout: Duration,
) -> Option<(Arc<dyn IdempotencyStore>, Option<tempfile::TempDir>)> {
    Some(match kind {
        StoreKind::Sqlite => {
            let (store, dir) = idem_testkit::sqlite_store().await;
            (Arc::new(store.with_timeout(timeout)), Some(dir))
        }
        _ => {
            let url = idem_testkit::pg_url()?;
            let schema = idem_testkit::pg_schema(&url).await;
            let store = idem_testkit::pg_store_in(&url, &schema, 4).await;
            (Arc::new(store.with_timeout(timeout)), None)
        }
    })
}

/// `route` at `path`, alone under an `Idem` layer on a [`sql_store`].
async fn sql_app(
    kind: StoreKind,
    timeout: Duration,
    path: &str,
    route: axum::routing::MethodRouter,
) -> Option<(Router, Option<tempfile::TempDir>)> {
    let (store, dir) = sql_store(kind, timeout).await?;
    Some((one_route(Idem::from_arc(store), path, route), dir))
}

/// `route` at `path`, alone under `idem`'s layer, for a single tenant.
fn one_route(idem: Idem, path: &str, route: axum::routing::MethodRouter) -> Router {
    Router::new()
        .route(path, route)
        .layer(idem.single_tenant().layer())
}

/// A keyed JSON POST.
fn json_post(path: &str, key: &str, body: &'static str) -> axum::http::Request<Body> {
    axum::http::Request::post(path)
        .header("idempotency-key", key)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body))
        .unwrap()
}

/// The `type` of a problem answer, read from its body.
async fn problem_type(response: Response) -> (StatusCode, String) {
    let status = response.status();
    let body = axum::body::to_bytes(response.into_body(), 1 << 16).await.unwrap();
    let value: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    (status, value["type"].as_str().unwrap_or_default().to_owned())
}

/// A rejection whose first try failed with its effect unknown, and whose
/// second try finds the token holding nothing while a record is still
/// there, cannot tell whether its first try took effect or another
/// execution took the operation over. Its client gets 503
/// `idempotency-store-unavailable` (retry with the same key), not 503
/// `idempotency-lease-lost`, which says a takeover happened.
/// - Checkpointed, then refused: the first try's release commits (a
///   recovery point keeps the key bound) and its answer is lost. The retry
///   runs again and gets the rejection.
/// - Refused, its DELETE committed and its answer lost while the corrected
///   request takes the freed key: that record is left alone, and answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejection_that_cannot_tell_whether_it_took_effect_is_not_called_a_takeover() {
    use tower::ServiceExt as _;
    #[derive(serde::Deserialize, serde::Serialize)]
    struct Order {
        quantity: u32,
        checkpoint: bool,
    }
    #[idempotent(scope = "lease.reject_unclear")]
    async fn order(op: Operation, axum::Json(o): axum::Json<Order>) -> StatusCode {
        if o.checkpoint {
            op.checkpoint("validated").await.unwrap();
        }
        if o.quantity == 0 {
            StatusCode::UNPROCESSABLE_ENTITY
        } else {
            StatusCode::CREATED
        }
    }
    const UNAVAILABLE: &str = "urn:idem:problem:idempotency-store-unavailable";
    for kind in [StoreKind::Sqlite, StoreKind::Postgres] {
        // Long enough for the corrected request to reserve and run while
        // the first rejection's answer is held.
        let timeout = Duration::from_secs(2);
        let Some((app, _dir)) = sql_app(kind, timeout, "/order", post(order)).await else {
            return;
        };
        let request = |key: &str, body: &'static str| json_post("/order", key, body);

        // Checkpointed, then refused: released as failed, answer lost.
        let key = idem_testkit::unique("k-reject-unclear-released");
        let refused_body = r#"{"quantity": 0, "checkpoint": true}"#;
        let committed = {
            let mut committed = pause::arm(pause::REJECT_AFTER, &key);
            let refused = tokio::spawn(app.clone().oneshot(request(&key, refused_body)));
            committed.reached().await;
            // Held past the store's timeout: the first try answers with a
            // timeout after its release committed.
            let refused = refused.await.unwrap().unwrap();
            drop(committed);
            problem_type(refused).await
        };
        assert_eq!(
            committed,
            (StatusCode::SERVICE_UNAVAILABLE, UNAVAILABLE.to_owned()),
            "{kind:?}: released"
        );
        let retry = app.clone().oneshot(request(&key, refused_body)).await.unwrap();
        assert_eq!(retry.status(), StatusCode::UNPROCESSABLE_ENTITY, "{kind:?}");
        assert!(retry.headers().get("idempotent-replayed").is_none());

        // Refused, then the corrected request takes the key before the
        // rejection's second try.
        let key = idem_testkit::unique("k-reject-unclear-retaken");
        let mut committed = pause::arm(pause::REJECT_AFTER, &key);
        let refused = tokio::spawn(
            app.clone()
                .oneshot(request(&key, r#"{"quantity": 0, "checkpoint": false}"#)),
        );
        committed.reached().await;
        let corrected_body = r#"{"quantity": 2, "checkpoint": false}"#;
        let mut returned = pause::arm(pause::HANDLER_RETURNED, &key);
        let corrected = tokio::spawn(app.clone().oneshot(request(&key, corrected_body)));
        returned.reached().await;
        assert!(
            !refused.is_finished(),
            "{kind:?}: answered before the key was taken again"
        );
        let refused = refused.await.unwrap().unwrap();
        drop(committed);
        assert_eq!(
            problem_type(refused).await,
            (StatusCode::SERVICE_UNAVAILABLE, UNAVAILABLE.to_owned()),
            "{kind:?}: retaken"
        );
        returned.resume();
        assert_eq!(
            corrected.await.unwrap().unwrap().status(),
            StatusCode::CREATED,
            "{kind:?}"
        );
        let replay = app.clone().oneshot(request(&key, corrected_body)).await.unwrap();
        assert_eq!(replay.headers()["idempotent-replayed"], "true", "{kind:?}");
    }
}

/// A completion whose first try committed and whose answer was lost (the
/// store's timeout ran out just after the commit) is tried again, and that
/// try finds the lock no longer held: the record may be completed with
/// this very answer, or taken over. Its client gets 503
/// `idempotency-store-unavailable`, not `idempotency-lease-lost` (nobody
/// took over), and its retry replays the answer the first try stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_committed_but_unanswered_is_not_called_a_takeover() {
    use tower::ServiceExt as _;
    #[idempotent(scope = "lease.complete_unanswered")]
    async fn pay() -> (StatusCode, &'static str) {
        (StatusCode::CREATED, "paid")
    }
    for kind in [StoreKind::Sqlite, StoreKind::Postgres] {
        let timeout = Duration::from_millis(300);
        let Some((app, _dir)) = sql_app(kind, timeout, "/pay", post(pay)).await else {
            return;
        };
        let key = idem_testkit::unique("k-complete-unanswered");
        let mut committed = pause::arm(pause::COMPLETE_AFTER, &key);
        let first = tokio::spawn(app.clone().oneshot(keyed_post("/pay", &key, "")));
        committed.reached().await;
        let first = first.await.unwrap().unwrap();
        drop(committed);
        assert_eq!(
            problem_type(first).await,
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "urn:idem:problem:idempotency-store-unavailable".to_owned()
            ),
            "{kind:?}"
        );
        let retry = app.oneshot(keyed_post("/pay", &key, "")).await.unwrap();
        assert_eq!(retry.status(), StatusCode::CREATED, "{kind:?}");
        assert_eq!(retry.headers()["idempotent-replayed"], "true", "{kind:?}");
        let body = axum::body::to_bytes(retry.into_body(), 1 << 16).await.unwrap();
        assert_eq!(&body[..], b"paid", "{kind:?}");
    }
}

/// A PostgreSQL store whose lock extensions all fail (a store that cannot
/// extend), and whose first rejection waits for the test, then fails
/// without effect, as does the second at once; later ones go through.
struct RejectsHeld {
    store: idem::PgStore,
    rejects: std::sync::atomic::AtomicUsize,
    reached: Notify,
    gate: Notify,
}

impl IdempotencyStore for RejectsHeld {
    fn reject<'a>(
        &'a self,
        id: &'a RecordId,
        token: &'a str,
    ) -> futures_util::future::BoxFuture<'a, Result<(), StoreError>> {
        match self.rejects.fetch_add(1, std::sync::atomic::Ordering::SeqCst) {
            0 => Box::pin(async move {
                self.reached.notify_one();
                self.gate.notified().await;
                Err(StoreError::unavailable("the first rejection did not get through"))
            }),
            1 => Box::pin(async {
                Err(StoreError::unavailable(
                    "the second rejection did not get through",
                ))
            }),
            _ => self.store.reject(id, token),
        }
    }
    fn extend_lock<'a>(
        &'a self,
        _: &'a RecordId,
        _: &'a str,
        _: Duration,
    ) -> futures_util::future::BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async { Err(StoreError::unavailable("extensions do not get through")) })
    }
    forward_to_store!(reserve, complete, release, checkpoint, purge_expired, hand_back);
}

/// A rejection the store never confirms is not given: its execution's lock
/// may have run out meanwhile (its extensions failed too) and another
/// execution taken the operation over, for which the conflict need not
/// hold. Here it did: the first execution answers 409 (out of stock), its
/// lock runs out while its rejection's writes fail, and the retry takes
/// over and answers 201 (stock arrived). The first client gets 503
/// `idempotency-store-unavailable`, never the 409 that contradicts the
/// operation's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_an_unconfirmed_rejection_is_not_given() {
    use tower::ServiceExt as _;
    #[idempotent(scope = "lease.reject_unconfirmed", lock_timeout = "2s")]
    async fn reserve_stock(op: Operation) -> (StatusCode, &'static str) {
        if op.attempt() == 1 {
            (StatusCode::CONFLICT, "out of stock")
        } else {
            (StatusCode::CREATED, "reserved")
        }
    }
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    // The lock runs out by hand below, which no process can see: a store
    // that keeps nothing in memory (its own execution would be answered
    // 409 for up to a second).
    let store = idem_testkit::pg_store_in(&url, &schema, 8)
        .await
        .with_timeout(Duration::from_secs(1))
        .with_replay_cache(Duration::ZERO);
    let pool = store.pool().clone();
    let held = Arc::new(RejectsHeld {
        store,
        rejects: std::sync::atomic::AtomicUsize::new(0),
        reached: Notify::new(),
        gate: Notify::new(),
    });
    let app = one_route(Idem::from_arc(held.clone()), "/stock", post(reserve_stock));
    let key = idem_testkit::unique("k-reject-unconfirmed");
    let reached = held.reached.notified();
    let first = tokio::spawn(app.clone().oneshot(keyed_post("/stock", &key, "")));
    reached.await;
    // The first execution's lock runs out (nothing extends it).
    let expired = sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE \"{schema}\".idempotency_keys SET lock_expires_at = now() - interval '1 second' \
         WHERE key = $1"
    )))
    .bind(&key)
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(expired.rows_affected(), 1);
    let mut returned = pause::arm(pause::HANDLER_RETURNED, &key);
    let second = tokio::spawn(app.clone().oneshot(keyed_post("/stock", &key, "")));
    returned.reached().await;
    // Taken over: now the first execution's rejection fails, twice.
    held.gate.notify_one();
    let first = first.await.unwrap().unwrap();
    assert_eq!(
        problem_type(first).await,
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "urn:idem:problem:idempotency-store-unavailable".to_owned()
        )
    );
    returned.resume();
    assert_eq!(second.await.unwrap().unwrap().status(), StatusCode::CREATED);
    let retry = app.oneshot(keyed_post("/stock", &key, "")).await.unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
}

/// A handler told its lease is lost (its lock could not be extended before
/// the deadline, so another execution may take over) has what it answers
/// then neither given nor stored, a rejection or a failure as much as a
/// success: its client gets 503 `idempotency-lease-lost`. Nobody took over
/// here, so its key is let go as it answered, and the retry runs.
#[tokio::test]
async fn a_handler_told_its_lease_is_lost_has_no_answer_given() {
    use tower::ServiceExt as _;
    #[idempotent(scope = "lease.told_then_answers", lock_timeout = "150ms")]
    async fn told(op: Operation, body: String) -> (StatusCode, &'static str) {
        op.lease_lost().await;
        match body.as_str() {
            "reject" => (StatusCode::CONFLICT, "stopped: lease lost"),
            _ => (StatusCode::SERVICE_UNAVAILABLE, "stopped: lease lost"),
        }
    }
    let store = FailsExtensions {
        store: idem::MemoryStore::new(),
    };
    let app = one_route(Idem::new(store), "/told", post(told));
    for body in ["reject", "fail"] {
        let key = idem_testkit::unique("k-told-then-answers");
        let first = app
            .clone()
            .oneshot(keyed_post("/told", &key, body))
            .await
            .unwrap();
        assert_eq!(
            problem_type(first).await,
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "urn:idem:problem:idempotency-lease-lost".to_owned()
            ),
            "{body}"
        );
    }
}

/// A memory store whose lock extensions all fail.
struct FailsExtensions {
    store: idem::MemoryStore,
}

impl IdempotencyStore for FailsExtensions {
    fn extend_lock<'a>(
        &'a self,
        _: &'a RecordId,
        _: &'a str,
        _: Duration,
    ) -> futures_util::future::BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async { Err(StoreError::unavailable("extensions do not get through")) })
    }
    forward_to_store!(
        reserve,
        complete,
        release,
        reject,
        checkpoint,
        purge_expired,
        hand_back
    );
}

/// A handler's panic releases its key before anything else happens to
/// the panic: its payload is dropped only after the release. A payload
/// whose drop panics in turn (it answers 500 all the same) must not leave
/// the key locked, so the retry runs.
#[tokio::test]
async fn a_panic_payload_is_dropped_after_the_key_is_released() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use tower::ServiceExt as _;
    static PANICKED: AtomicBool = AtomicBool::new(false);
    /// A panic payload whose drop panics.
    struct DropPanics;
    impl Drop for DropPanics {
        fn drop(&mut self) {
            panic!("the panic payload's drop panicked");
        }
    }
    #[idempotent(scope = "lease.payload_drop_panics", lock_timeout = "30s")]
    async fn panics_once() -> StatusCode {
        if !PANICKED.swap(true, Ordering::SeqCst) {
            std::panic::panic_any(DropPanics);
        }
        StatusCode::CREATED
    }
    let app = one_route(Idem::new(idem::MemoryStore::new()), "/panics", post(panics_once));
    let key = idem_testkit::unique("k-payload-drop-panics");
    let first = app
        .clone()
        .oneshot(keyed_post("/panics", &key, ""))
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let retry = app.oneshot(keyed_post("/panics", &key, "")).await.unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED, "the key was released");
}

/// A response body whose drop panics once it has produced its whole answer
/// leaves no key locked, and does not undo that answer: the handler ran
/// and its answer is whole, so a retry that ran it again could charge
/// twice. Stored whole (small) or streamed (larger than `max_stored_body`),
/// the body is dropped once it ended, its panic caught, and its completion
/// recorded: 201, and the retry is its replay (the small body in full; the
/// large one status and headers, since it is too large to keep).
#[tokio::test]
async fn a_body_whose_drop_panics_leaves_no_key_locked() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use tower::ServiceExt as _;
    /// Yields its bytes once, then ends; its first drop panics.
    struct Chunks {
        left: Option<axum::body::Bytes>,
        panicked: &'static AtomicBool,
    }
    impl futures_util::Stream for Chunks {
        type Item = Result<axum::body::Bytes, std::convert::Infallible>;
        fn poll_next(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Self::Item>> {
            std::task::Poll::Ready(self.left.take().map(Ok))
        }
    }
    impl Drop for Chunks {
        fn drop(&mut self) {
            if !self.panicked.swap(true, Ordering::SeqCst) {
                panic!("the body's drop panicked");
            }
        }
    }
    static SMALL: AtomicBool = AtomicBool::new(false);
    static LARGE: AtomicBool = AtomicBool::new(false);
    #[idempotent(scope = "lease.body_drop_panics_small", lock_timeout = "30s")]
    async fn small() -> Response {
        let body = Chunks {
            left: Some(axum::body::Bytes::from_static(b"small")),
            panicked: &SMALL,
        };
        (StatusCode::CREATED, Body::from_stream(body)).into_response()
    }
    #[idempotent(scope = "lease.body_drop_panics_large", lock_timeout = "30s")]
    async fn large() -> Response {
        let body = Chunks {
            left: Some(axum::body::Bytes::from(vec![b'x'; 4096])),
            panicked: &LARGE,
        };
        (StatusCode::CREATED, Body::from_stream(body)).into_response()
    }
    let idem = Idem::new(idem::MemoryStore::new()).max_stored_body(1024).unwrap();
    let app = Router::new()
        .route("/small", post(small))
        .route("/large", post(large))
        .layer(idem.single_tenant().layer());
    let send = |path: &'static str, key: String| {
        let app = app.clone();
        async move {
            let response = app.oneshot(keyed_post(path, &key, "")).await.unwrap();
            let status = response.status();
            let replayed = response.headers().contains_key("idempotent-replayed");
            let body = axum::body::to_bytes(response.into_body(), usize::MAX).await;
            (status, replayed, body.map(|b| b.len()).ok())
        }
    };
    let key = idem_testkit::unique("k-body-drop-panics-small");
    assert_eq!(
        send("/small", key.clone()).await,
        (StatusCode::CREATED, false, Some(5))
    );
    assert!(SMALL.load(Ordering::SeqCst), "the body was dropped");
    assert_eq!(
        send("/small", key).await,
        (StatusCode::CREATED, true, Some(5)),
        "recorded: a replay of the whole answer"
    );
    let key = idem_testkit::unique("k-body-drop-panics-large");
    assert_eq!(
        send("/large", key.clone()).await,
        (StatusCode::CREATED, false, Some(4096))
    );
    assert!(LARGE.load(Ordering::SeqCst), "the body was dropped");
    // A replay of an answer too large to keep: its status, no body.
    assert_eq!(
        send("/large", key).await,
        (StatusCode::CREATED, true, Some(0)),
        "recorded: a replay"
    );
}

/// A body that ended whole and panics when dropped, in each shape `collect`
/// reads: empty, one buffer that says it is the end, and several chunks;
/// and one whose panic's payload panics too when dropped. Its answer is
/// recorded on every store: 201 once, then its replay in full; the handler
/// ran once.
#[tokio::test]
async fn a_whole_body_whose_drop_panics_is_recorded_in_every_shape() {
    use std::collections::VecDeque;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use tower::ServiceExt as _;
    /// Its frames, then its end; `is_end_stream` tells the end only when
    /// `says_end`. Its first drop panics, with a payload whose own drop
    /// panics when `payload_panics`.
    struct Frames {
        left: VecDeque<axum::body::Bytes>,
        says_end: bool,
        payload_panics: bool,
        panicked: Arc<AtomicBool>,
    }
    struct PayloadPanics;
    impl Drop for PayloadPanics {
        fn drop(&mut self) {
            panic!("the panic payload's drop panicked");
        }
    }
    impl hyper::body::Body for Frames {
        type Data = axum::body::Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
            std::task::Poll::Ready(self.left.pop_front().map(|b| Ok(hyper::body::Frame::data(b))))
        }
        fn is_end_stream(&self) -> bool {
            self.says_end && self.left.is_empty()
        }
    }
    impl Drop for Frames {
        fn drop(&mut self) {
            if !self.panicked.swap(true, Ordering::SeqCst) {
                if self.payload_panics {
                    std::panic::panic_any(PayloadPanics);
                }
                panic!("the body's drop panicked");
            }
        }
    }
    #[derive(Clone)]
    struct Shape {
        parts: &'static [&'static str],
        says_end: bool,
        payload_panics: bool,
        ran: Arc<AtomicUsize>,
        panicked: Arc<AtomicBool>,
    }
    #[idempotent(scope = "lease.whole_body_drop_panics", lock_timeout = "30s")]
    async fn answer(State(shape): State<Shape>) -> Response {
        shape.ran.fetch_add(1, Ordering::SeqCst);
        let body = Frames {
            left: shape
                .parts
                .iter()
                .map(|p| axum::body::Bytes::from_static(p.as_bytes()))
                .collect(),
            says_end: shape.says_end,
            payload_panics: shape.payload_panics,
            panicked: shape.panicked.clone(),
        };
        (StatusCode::CREATED, Body::new(body)).into_response()
    }
    for kind in [StoreKind::Memory, StoreKind::Sqlite, StoreKind::Postgres] {
        let Some(fixture) = kind.fixture().await else {
            return;
        };
        for (parts, says_end, payload_panics) in [
            (&[][..], false, false),
            (&["whole"][..], true, false),
            (&["who", "", "le"][..], false, false),
            (&["whole"][..], true, true),
        ] {
            let shape = Shape {
                parts,
                says_end,
                payload_panics,
                ran: Arc::new(AtomicUsize::new(0)),
                panicked: Arc::new(AtomicBool::new(false)),
            };
            let app = Router::new()
                .route("/answer", post(answer))
                .with_state(shape.clone())
                .layer(Idem::from_arc(fixture.store.clone()).single_tenant().layer());
            let key = idem_testkit::unique("k-whole-body-drop-panics");
            let whole = parts.concat();
            for replayed in [false, true] {
                let response = app
                    .clone()
                    .oneshot(keyed_post("/answer", &key, ""))
                    .await
                    .unwrap();
                let status = response.status();
                let was_replayed = response.headers().contains_key("idempotent-replayed");
                let body = axum::body::to_bytes(response.into_body(), usize::MAX)
                    .await
                    .unwrap();
                assert_eq!(
                    (status, was_replayed, &body[..]),
                    (StatusCode::CREATED, replayed, whole.as_bytes()),
                    "{kind:?} {parts:?}: the answer is recorded, then replayed"
                );
            }
            assert!(
                shape.panicked.load(Ordering::SeqCst),
                "{kind:?} {parts:?}: dropped"
            );
            assert_eq!(
                shape.ran.load(Ordering::SeqCst),
                1,
                "{kind:?} {parts:?}: ran once"
            );
        }
    }
}
