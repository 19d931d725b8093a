//! Clients that cannot tell a broken body from a whole one: a `HEAD`
//! request (axum answers it from the GET handler and sends no body), and an
//! HTTP/1.0 client, whose body without a `Content-Length` ends when the
//! connection closes, broken or whole. An answer larger than
//! `max_stored_body` streams to other clients with its last bytes held back
//! until it is recorded, so that a failure breaks their body; these get their
//! answer only once it is recorded (the body read to its end under the
//! lease; past the 64 MiB held for an HTTP/1.0 client, what its replay
//! gets), and a failure is a whole problem response, never a whole-looking
//! 2xx of an execution that is released or taken over.

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures_util::StreamExt as _;
use idem::{idempotent, Idem, IdempotencyStore, Operation};
use idem_testkit::http::{exchange, head_request, http10_request, parse, post as post_req, split, Reply};
use idem_testkit::StoreKind;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::{mpsc, Notify};

/// The stored limit of every route here: 80-byte answers stream.
const LIMIT: usize = 64;

#[derive(Clone)]
struct App {
    runs: idem_testkit::Runs,
    gates: idem_testkit::Gates,
    events: mpsc::UnboundedSender<String>,
}

impl App {
    fn gate(&self, key: &str) -> Arc<Notify> {
        self.gates.gate(key)
    }
}

fn chunk(c: &str, n: usize) -> Result<Bytes, std::io::Error> {
    Ok(Bytes::from(c.repeat(n)))
}

/// 80 bytes at once (past the limit), then, on its first run, a failure.
async fn breaking(app: &App, key: &str) -> Response {
    let n = app.runs.ran(key);
    let tail = if n == 1 {
        Err(std::io::Error::other("broken"))
    } else {
        chunk("c", 10)
    };
    let body = futures_util::stream::iter([chunk("a", 40), chunk("b", 40), tail]);
    (StatusCode::CREATED, Body::from_stream(body)).into_response()
}

#[idempotent(scope = "unframed.breaks")]
async fn breaks(State(app): State<App>, op: Operation) -> Response {
    breaking(&app, op.key()).await
}

#[idempotent(scope = "unframed.breaks_get")]
async fn breaks_get(State(app): State<App>, op: Operation) -> Response {
    breaking(&app, op.key()).await
}

/// 10 bytes (well within the limit), then, on its first run, a failure.
#[idempotent(scope = "unframed.breaks_small_get")]
async fn breaks_small_get(State(app): State<App>, op: Operation) -> Response {
    let n = app.runs.ran(op.key());
    let tail = if n == 1 {
        Err(std::io::Error::other("broken"))
    } else {
        chunk("c", 10)
    };
    let body = futures_util::stream::iter([chunk("a", 10), tail]);
    (StatusCode::CREATED, Body::from_stream(body)).into_response()
}

/// 80 bytes at once, then 10 more once the test opens the key's gate;
/// says when it has run. With `length`, the answer declares its 90 bytes.
async fn gated_answer(app: &App, key: &str, length: bool) -> Response {
    app.runs.ran(key);
    let gate = app.gate(key);
    let _ = app.events.send(format!("gated {key}"));
    let last = async move {
        gate.notified().await;
        chunk("c", 10)
    };
    let body =
        futures_util::stream::iter([chunk("a", 40), chunk("b", 40)]).chain(futures_util::stream::once(last));
    let mut r = (StatusCode::CREATED, Body::from_stream(body)).into_response();
    if length {
        r.headers_mut().insert(header::CONTENT_LENGTH, 90.into());
    }
    r
}

#[idempotent(scope = "unframed.gated")]
async fn gated(State(app): State<App>, op: Operation) -> Response {
    gated_answer(&app, op.key(), false).await
}

#[idempotent(scope = "unframed.gated_get")]
async fn gated_get(State(app): State<App>, op: Operation) -> Response {
    gated_answer(&app, op.key(), false).await
}

#[idempotent(scope = "unframed.gated_length")]
async fn gated_length(State(app): State<App>, op: Operation) -> Response {
    gated_answer(&app, op.key(), true).await
}

/// 65 MiB (past the 64 MiB held for an HTTP/1.0 client) at once, then 10
/// bytes once the test opens the key's gate, or, with `fail`, a failure on
/// the first run.
fn huge_answer(app: &App, key: &str, fail: bool) -> Response {
    let n = app.runs.ran(key);
    let gate = app.gate(key);
    let _ = app.events.send(format!("gated {key}"));
    let mib = Bytes::from(vec![b'x'; 1 << 20]);
    let chunks = futures_util::stream::iter((0..65).map(move |_| Ok::<_, std::io::Error>(mib.clone())));
    let last = async move {
        if fail && n == 1 {
            return Err(std::io::Error::other("broken past 64 MiB"));
        }
        if !fail {
            gate.notified().await;
        }
        chunk("c", 10)
    };
    let mut r = (
        StatusCode::CREATED,
        Body::from_stream(chunks.chain(futures_util::stream::once(last))),
    )
        .into_response();
    r.headers_mut()
        .insert(header::CONTENT_TYPE, "application/octet-stream".parse().unwrap());
    r
}

#[idempotent(scope = "unframed.huge")]
async fn huge(State(app): State<App>, op: Operation) -> Response {
    huge_answer(&app, op.key(), false)
}

#[idempotent(scope = "unframed.huge_breaks")]
async fn huge_breaks(State(app): State<App>, op: Operation) -> Response {
    huge_answer(&app, op.key(), true)
}

type Chunks = std::pin::Pin<Box<dyn futures_util::Stream<Item = Result<Bytes, std::io::Error>> + Send>>;

/// 90 bytes whose stream, on the first run, panics while polled after 80
/// (`in_poll`), or ends whole and then panics when dropped.
struct Panicking {
    inner: Chunks,
    in_drop: bool,
}

impl futures_util::Stream for Panicking {
    type Item = Result<Bytes, std::io::Error>;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        self.inner.as_mut().poll_next(cx)
    }
}

impl Drop for Panicking {
    fn drop(&mut self) {
        if self.in_drop && !std::thread::panicking() {
            panic!("the body's drop panics");
        }
    }
}

fn panicking(app: &App, key: &str, in_poll: bool) -> Response {
    let first = app.runs.ran(key) == 1;
    let last = async move {
        if first && in_poll {
            panic!("the body panics while polled");
        }
        chunk("c", 10)
    };
    let inner: Chunks = Box::pin(
        futures_util::stream::iter([chunk("a", 40), chunk("b", 40)]).chain(futures_util::stream::once(last)),
    );
    let body = Panicking {
        inner,
        in_drop: first && !in_poll,
    };
    (StatusCode::CREATED, Body::from_stream(body)).into_response()
}

#[idempotent(scope = "unframed.poll_panics")]
async fn poll_panics(State(app): State<App>, op: Operation) -> Response {
    panicking(&app, op.key(), true)
}

#[idempotent(scope = "unframed.drop_panics")]
async fn drop_panics(State(app): State<App>, op: Operation) -> Response {
    panicking(&app, op.key(), false)
}

enum Db {
    Pg(String),
    Sqlite(sqlx::SqlitePool),
    Memory,
}

struct H {
    addr: SocketAddr,
    app: App,
    events: mpsc::UnboundedReceiver<String>,
    db: Db,
    _store: Arc<dyn IdempotencyStore>,
    _dir: Option<tempfile::TempDir>,
}

impl H {
    async fn ran(&mut self, key: &str) {
        let what = format!("gated {key}");
        loop {
            let got = tokio::time::timeout(Duration::from_secs(20), self.events.recv())
                .await
                .unwrap_or_else(|_| panic!("not told `{what}` within 20 s"))
                .unwrap();
            if got == what {
                return;
            }
        }
    }

    /// Plays another execution that takes the record of `key` over behind
    /// the running one's back (its lock token changed).
    async fn take_over_behind_its_back(&self, key: &str) {
        let sql = "UPDATE {t} SET lock_token = 'intruder', attempt = attempt + 1, taken_over = 1 \
                   WHERE key = {k} AND state = 'in_progress'";
        let done = match &self.db {
            Db::Pg(schema) => {
                let pool = sqlx::PgPool::connect(&idem_testkit::pg_url().unwrap())
                    .await
                    .unwrap();
                sqlx::query(sqlx::AssertSqlSafe(
                    sql.replace("{t}", &format!("\"{schema}\".idempotency_keys"))
                        .replace("{k}", "$1"),
                ))
                .bind(key)
                .execute(&pool)
                .await
                .unwrap()
                .rows_affected()
            }
            Db::Sqlite(pool) => sqlx::query(sqlx::AssertSqlSafe(
                sql.replace("{t}", "idempotency_keys").replace("{k}", "?1"),
            ))
            .bind(key)
            .execute(pool)
            .await
            .unwrap()
            .rows_affected(),
            Db::Memory => unreachable!("the memory store has no table"),
        };
        assert_eq!(done, 1, "the record of {key} was not in progress");
    }
}

async fn start(kind: StoreKind) -> Option<H> {
    let (store, db, dir): (Arc<dyn IdempotencyStore>, Db, _) = match kind {
        StoreKind::Postgres => {
            let url = idem_testkit::pg_url()?;
            let schema = idem_testkit::pg_schema(&url).await;
            let store = idem_testkit::pg_store_in(&url, &schema, 8).await;
            (Arc::new(store), Db::Pg(schema), None)
        }
        StoreKind::Sqlite => {
            let (store, dir) = idem_testkit::sqlite_store().await;
            let pool = store.pool().clone();
            (Arc::new(store), Db::Sqlite(pool), Some(dir))
        }
        StoreKind::Memory => (Arc::new(idem::MemoryStore::new()), Db::Memory, None),
    };
    let (tx, events) = mpsc::unbounded_channel();
    let app = App {
        runs: idem_testkit::Runs::default(),
        gates: idem_testkit::Gates::default(),
        events: tx,
    };
    let idem = Idem::from_arc(store.clone())
        .single_tenant()
        .max_stored_body(LIMIT)
        .unwrap();
    let router = Router::new()
        .route("/breaks", post(breaks))
        .route("/breaks-get", get(breaks_get))
        .route("/breaks-small-get", get(breaks_small_get))
        .route("/gated", post(gated))
        .route("/gated-get", get(gated_get))
        .route("/gated-length", post(gated_length))
        .route("/huge", post(huge))
        .route("/poll-panics", get(poll_panics).post(poll_panics))
        .route("/drop-panics", get(drop_panics).post(drop_panics))
        .route("/huge-breaks", post(huge_breaks))
        .layer(idem.layer())
        .with_state(app.clone());
    let addr = idem_testkit::http::serve(router).await;
    Some(H {
        addr,
        app,
        events,
        db,
        _store: store,
        _dir: dir,
    })
}

fn replayed(r: &Reply) -> bool {
    r.header("idempotent-replayed") == Some("true")
}

/// Sends GET `path` with `key` until it is no longer a 409 (the first
/// execution's record still in progress), as a client's retry would.
async fn get_after(addr: SocketAddr, path: &str, key: &str) -> Reply {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let request =
            format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\nidempotency-key: {key}\r\n\r\n");
        let r = parse(&exchange(addr, request).await.0);
        if r.status != 409 || std::time::Instant::now() > deadline {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sends `request` for `key`, waits until its handler ran (its last bytes
/// wait for the key's gate), checks that nothing goes out meanwhile (the
/// answer is not recorded: a read waits), opens the gate, and reads the
/// answer to the server's clean close.
async fn answered_once_recorded(h: &mut H, key: &str, request: String) -> Vec<u8> {
    let mut s = tokio::net::TcpStream::connect(h.addr).await.unwrap();
    s.write_all(request.as_bytes()).await.unwrap();
    h.ran(key).await;
    let mut first = [0u8; 1];
    let early = tokio::time::timeout(Duration::from_millis(300), s.read(&mut first)).await;
    assert!(
        early.is_err(),
        "{key}: bytes went out before the answer was recorded"
    );
    h.app.gate(key).notify_one();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut out))
        .await
        .expect("the answer")
        .expect("a clean close");
    out
}

/// HEAD: the body fails past the limit. Its client is told the handler
/// failed (500), not a whole 201, and the key is released: the GET runs
/// the handler again.
async fn head_of_a_large_answer_that_fails_is_a_500(h: H) {
    let (out, _) = exchange(h.addr, head_request("/breaks-get", "k-head-fails")).await;
    let (status, body) = split(&out);
    assert_eq!(
        (status, body),
        (500, &b""[..]),
        "{:?}",
        String::from_utf8_lossy(&out)
    );
    let g = get_after(h.addr, "/breaks-get", "k-head-fails").await;
    assert_eq!((g.status, replayed(&g)), (201, false), "{g:?}");
    assert_eq!(h.app.runs.of("k-head-fails"), 2);
}

/// HEAD: a body within the limit fails while read. Its client could not
/// tell a broken body from a whole one: 500, as past the limit, and the
/// key is released (docs/PROTOCOL.md, "Classification").
async fn head_of_a_small_answer_that_fails_is_a_500(h: H) {
    let (out, _) = exchange(h.addr, head_request("/breaks-small-get", "k-head-small")).await;
    assert_eq!(split(&out).0, 500, "{:?}", String::from_utf8_lossy(&out));
    let g = get_after(h.addr, "/breaks-small-get", "k-head-small").await;
    assert_eq!((g.status, replayed(&g)), (201, false), "{g:?}");
    assert_eq!(h.app.runs.of("k-head-small"), 2);
}

/// HEAD: the answer is recorded before its status goes out; the GET
/// replays it (status and headers: the body was past the limit).
async fn head_of_a_large_answer_is_answered_once_recorded(mut h: H) {
    let key = "k-head-whole";
    let out = answered_once_recorded(&mut h, key, head_request("/gated-get", key)).await;
    assert_eq!(
        split(&out),
        (201, &b""[..]),
        "{:?}",
        String::from_utf8_lossy(&out)
    );
    let g = get_after(h.addr, "/gated-get", key).await;
    assert_eq!((g.status, replayed(&g)), (201, true), "{g:?}");
    assert_eq!(g.header("idempotent-replay-body-omitted"), Some("true"));
    assert_eq!(h.app.runs.of(key), 1);
}

/// HTTP/1.0: the body fails past the limit. Its client is told the
/// handler failed (500), not a clean close after the first 80 bytes, and
/// the retry runs again.
async fn http10_large_answer_that_fails_is_a_500(h: H) {
    let (out, _) = exchange(h.addr, http10_request("/breaks", "k-10-fails")).await;
    let (status, body) = split(&out);
    assert_eq!(status, 500, "{:?}", String::from_utf8_lossy(&out));
    assert!(!body.starts_with(b"aaaa"), "{:?}", String::from_utf8_lossy(&out));
    let retry = post_req("/breaks", "").key("k-10-fails").send(h.addr).await;
    assert_eq!((retry.status, replayed(&retry)), (201, false), "{retry:?}");
    assert_eq!(h.app.runs.of("k-10-fails"), 2);
}

/// HTTP/1.0: nothing of a large answer goes out before it is recorded, and
/// then all of it.
async fn http10_large_answer_is_whole_once_recorded(mut h: H) {
    let key = "k-10-whole";
    let out = answered_once_recorded(&mut h, key, http10_request("/gated", key)).await;
    let (status, body) = split(&out);
    assert_eq!(status, 201, "{:?}", String::from_utf8_lossy(&out));
    assert_eq!(
        body,
        format!("{}{}{}", "a".repeat(40), "b".repeat(40), "c".repeat(10)).as_bytes()
    );
    // With its length, which the client can check.
    let text = String::from_utf8_lossy(&out).to_ascii_lowercase();
    assert!(text.contains("content-length: 90\r\n"), "{text:?}");
    let again = post_req("/gated", "").key(key).send(h.addr).await;
    assert_eq!((again.status, replayed(&again)), (201, true), "{again:?}");
}

/// HTTP/1.0 with a `Content-Length` the answer declares: a broken body
/// shows (fewer bytes than declared), so it streams as to any client: its
/// first bytes go out before the last are produced.
async fn http10_large_answer_with_a_length_streams(mut h: H) {
    let key = "k-10-length";
    let mut s = tokio::net::TcpStream::connect(h.addr).await.unwrap();
    s.write_all(http10_request("/gated-length", key).as_bytes())
        .await
        .unwrap();
    h.ran(key).await;
    let mut out = Vec::new();
    let mut buf = [0u8; 1024];
    while !out.windows(4).any(|w| w == b"aaaa") {
        let n = tokio::time::timeout(Duration::from_secs(20), s.read(&mut buf))
            .await
            .expect("the first bytes before the last are produced")
            .unwrap();
        assert!(n > 0, "closed early: {:?}", String::from_utf8_lossy(&out));
        out.extend_from_slice(&buf[..n]);
    }
    h.app.gate(key).notify_one();
    s.read_to_end(&mut out).await.unwrap();
    let (status, body) = split(&out);
    assert_eq!(
        (status, body.len()),
        (201, 90),
        "{:?}",
        String::from_utf8_lossy(&out)
    );
}

/// HTTP/1.0, an answer past the 64 MiB held for it: nothing goes out
/// before it is recorded, and then what its replay answers, the status and
/// headers with `Idempotent-Replay-Body-Omitted`, no body and a length of 0
/// (never a clean close after some of it).
async fn http10_answer_past_what_is_held_is_answered_as_its_replay(mut h: H) {
    let key = "k-10-huge";
    let out = answered_once_recorded(&mut h, key, http10_request("/huge", key)).await;
    let text = String::from_utf8_lossy(&out).to_ascii_lowercase();
    assert_eq!(split(&out), (201, &b""[..]), "{text:?}");
    assert!(text.contains("content-length: 0\r\n"), "{text:?}");
    assert!(
        text.contains("idempotent-replay-body-omitted: true\r\n"),
        "{text:?}"
    );
    assert!(!text.contains("content-type"), "{text:?}");
    let again = post_req("/huge", "").key(key).send(h.addr).await;
    assert_eq!((again.status, replayed(&again)), (201, true), "{again:?}");
    assert_eq!(again.header("idempotent-replay-body-omitted"), Some("true"));
    assert_eq!(h.app.runs.of(key), 1);
}

/// HTTP/1.0, an answer past the 64 MiB held for it that then fails: a 500,
/// and the retry runs again.
async fn http10_answer_past_what_is_held_that_fails_is_a_500(h: H) {
    let (out, _) = exchange(h.addr, http10_request("/huge-breaks", "k-10-huge-fails")).await;
    assert_eq!(
        split(&out).0,
        500,
        "{:?}",
        String::from_utf8_lossy(&out[..out.len().min(300)])
    );
    let retry = post_req("/huge-breaks", "")
        .key("k-10-huge-fails")
        .send(h.addr)
        .await;
    assert_eq!((retry.status, replayed(&retry)), (201, false));
    assert_eq!(h.app.runs.of("k-10-huge-fails"), 2);
}

/// A large body that panics while it is read to its end: the HEAD and
/// the HTTP/1.0 client get a whole 500 `handler-failed`, nothing is
/// stored, and the retry runs again.
async fn a_large_body_that_panics_while_read_is_a_500(h: H) {
    for (key, request, method) in [
        (
            "k-head-panics",
            head_request("/poll-panics", "k-head-panics"),
            "GET",
        ),
        (
            "k-10-panics",
            http10_request("/poll-panics", "k-10-panics"),
            "POST",
        ),
    ] {
        let (out, _) = exchange(h.addr, request).await;
        let text = String::from_utf8_lossy(&out).to_ascii_lowercase();
        assert_eq!(split(&out).0, 500, "{key}: {text:?}");
        assert!(text.contains("application/problem+json"), "{key}: {text:?}");
        let retry = if method == "GET" {
            get_after(h.addr, "/poll-panics", key).await
        } else {
            post_req("/poll-panics", "").key(key).send(h.addr).await
        };
        assert_eq!(
            (retry.status, replayed(&retry), retry.body.len()),
            (201, false, 90),
            "{key}: {retry:?}"
        );
        assert_eq!(h.app.runs.of(key), 2, "{key}");
    }
}

/// A large body that ended whole and then panics when dropped: its answer
/// stands (recorded, then given whole: 90 bytes to the HTTP/1.0 client),
/// and the retry replays it.
async fn a_large_body_whose_drop_panics_is_recorded(h: H) {
    for (key, request, method) in [
        ("k-head-drop", head_request("/drop-panics", "k-head-drop"), "GET"),
        ("k-10-drop", http10_request("/drop-panics", "k-10-drop"), "POST"),
    ] {
        let (out, _) = exchange(h.addr, request).await;
        let (status, body) = split(&out);
        let expected = if method == "GET" { 0 } else { 90 };
        assert_eq!(
            (status, body.len()),
            (201, expected),
            "{key}: {:?}",
            String::from_utf8_lossy(&out)
        );
        let retry = if method == "GET" {
            get_after(h.addr, "/drop-panics", key).await
        } else {
            post_req("/drop-panics", "").key(key).send(h.addr).await
        };
        assert_eq!((retry.status, replayed(&retry)), (201, true), "{key}: {retry:?}");
        assert_eq!(h.app.runs.of(key), 1, "{key}");
    }
}

/// The HEAD client leaves while its answer is read to its end: the
/// execution goes on and records it; the GET replays it.
async fn a_head_client_that_leaves_cancels_nothing(mut h: H) {
    let key = "k-head-leaves";
    let mut s = tokio::net::TcpStream::connect(h.addr).await.unwrap();
    s.write_all(head_request("/gated-get", key).as_bytes())
        .await
        .unwrap();
    h.ran(key).await;
    drop(s);
    h.app.gate(key).notify_one();
    let g = get_after(h.addr, "/gated-get", key).await;
    assert_eq!((g.status, replayed(&g)), (201, true), "{g:?}");
    assert_eq!(g.header("idempotent-replay-body-omitted"), Some("true"));
    assert_eq!(h.app.runs.of(key), 1);
}

/// Taken over while its body is produced (its lock token changed behind
/// its back): the HEAD and the HTTP/1.0 client are told 503 with
/// `Retry-After`, not a whole 201 of an answer that is never recorded.
async fn a_large_answer_taken_over_is_a_503_to_both(mut h: H) {
    for (key, request) in [
        ("k-head-taken", head_request("/gated-get", "k-head-taken")),
        ("k-10-taken", http10_request("/gated", "k-10-taken")),
        ("k-10-huge-taken", http10_request("/huge", "k-10-huge-taken")),
    ] {
        let client = tokio::spawn(exchange(h.addr, request));
        h.ran(key).await;
        h.take_over_behind_its_back(key).await;
        h.app.gate(key).notify_one();
        let (out, _) = client.await.unwrap();
        let text = String::from_utf8_lossy(&out).to_ascii_lowercase();
        assert_eq!(split(&out).0, 503, "{key}: {text:?}");
        assert!(text.contains("retry-after:"), "{key}: {text:?}");
    }
}

mod each {
    use super::*;
    idem_testkit::for_each_store! {
        stores: [memory, sqlite, postgres],
        setup: |kind| start(kind).await,
        worker_threads: 4,
        cases: [
            head_of_a_large_answer_that_fails_is_a_500,
            head_of_a_small_answer_that_fails_is_a_500,
            head_of_a_large_answer_is_answered_once_recorded,
            http10_large_answer_that_fails_is_a_500,
            http10_large_answer_is_whole_once_recorded,
            http10_large_answer_with_a_length_streams,
            http10_answer_past_what_is_held_is_answered_as_its_replay,
            http10_answer_past_what_is_held_that_fails_is_a_500,
            a_large_body_that_panics_while_read_is_a_500,
            a_large_body_whose_drop_panics_is_recorded,
            a_head_client_that_leaves_cancels_nothing,
        ],
    }
}

mod taken_over {
    use super::*;
    idem_testkit::for_each_store! {
        stores: [sqlite, postgres],
        setup: |kind| start(kind).await,
        worker_threads: 4,
        cases: [a_large_answer_taken_over_is_a_503_to_both],
    }
}
