//! Hostile input over real HTTP on a real store: each is refused with a 4xx,
//! the handler does not run, nothing is stored, and the server keeps
//! serving. (Slow headers are the HTTP server's to time out: see
//! RELIABILITY.md.)

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::Response;
use axum::routing::post;
use axum::{Form, Json, RequestExt as _, Router};
use idem::{idempotent, Idem, MemoryStore, SqliteStore};
use idem_testkit::http::{post as req, serve};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

#[derive(Clone, Default)]
struct App {
    runs: Arc<AtomicUsize>,
}

#[derive(serde::Deserialize, serde::Serialize)]
struct Pay {
    amount: i64,
}

#[idempotent(scope = "hostile.pay", fields(amount))]
async fn pay(State(app): State<App>, Json(p): Json<Pay>) -> (StatusCode, String) {
    app.runs.fetch_add(1, Ordering::SeqCst);
    (StatusCode::CREATED, format!("paid {}", p.amount))
}

#[idempotent(scope = "hostile.any")]
async fn any(State(app): State<App>, Json(v): Json<serde_json::Value>) -> String {
    app.runs.fetch_add(1, Ordering::SeqCst);
    format!("got {}", v.to_string().len())
}

#[idempotent(scope = "hostile.text")]
async fn text(State(app): State<App>, body: String) -> String {
    app.runs.fetch_add(1, Ordering::SeqCst);
    format!("got {}", body.len())
}

struct Server {
    addr: SocketAddr,
    app: App,
    store: SqliteStore,
    _dir: tempfile::TempDir,
}

impl Server {
    async fn start() -> Server {
        let (store, dir) = idem_testkit::sqlite_store().await;
        let app = App::default();
        let router = Router::new()
            .route("/pay", post(pay))
            .route("/any", post(any))
            .route("/text", post(text))
            .layer(Idem::new(store.clone()).single_tenant().layer())
            .with_state(app.clone());
        Server {
            addr: serve(router).await,
            app,
            store,
            _dir: dir,
        }
    }

    /// A JSON POST of `body` to `path` with `key`, read whole.
    async fn send(&self, path: &str, body: &str, key: &str) -> idem_testkit::http::Reply {
        req(path, body).key(key).send(self.addr).await
    }

    fn runs(&self) -> usize {
        self.app.runs.load(Ordering::SeqCst)
    }

    async fn records(&self) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM idempotency_keys")
            .fetch_one(self.store.pool())
            .await
            .unwrap()
    }

    /// Refused, not run, nothing stored, and the next request is served.
    async fn refused_cleanly(&self, status: u16, what: &str) {
        eprintln!("{what}: {status}");
        assert!((400..500).contains(&status), "{what}: {status}");
        assert_eq!(self.runs(), 0, "{what}: the handler ran");
        assert_eq!(self.records().await, 0, "{what}: a record was stored");
        let ok = req("/pay", r#"{"amount":1}"#)
            .key(&format!("after-{}", idem_testkit::unique("k")))
            .send(self.addr)
            .await;
        assert_eq!(ok.status, 201, "{what}: the server no longer serves");
        self.app.runs.store(0, Ordering::SeqCst);
        sqlx::query("DELETE FROM idempotency_keys")
            .execute(self.store.pool())
            .await
            .unwrap();
    }
}

fn status_of(raw: &[u8]) -> u16 {
    std::str::from_utf8(&raw[..raw.len().min(12)])
        .ok()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            panic!(
                "no status line in {:?}",
                String::from_utf8_lossy(&raw[..raw.len().min(80)])
            )
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_mebibyte_header_is_refused() {
    let s = Server::start().await;
    let big = "a".repeat(1 << 20);
    for (name, value) in [("x-padding", big.as_str()), ("idempotency-key", big.as_str())] {
        let raw = req("/pay", r#"{"amount":1}"#)
            .key("k-big")
            .header(name, value)
            .send_raw(s.addr)
            .await;
        s.refused_cleanly(status_of(&raw), name).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_past_the_limit_is_refused() {
    let s = Server::start().await;
    // axum's default body limit is 2 MiB.
    let body = format!(r#"{{"amount":1,"pad":"{}"}}"#, "x".repeat(3 << 20));
    let r = s.send("/pay", &body, "k-huge").await;
    assert_eq!(r.status, 413);
    s.refused_cleanly(r.status, "body past the limit").await;
}

/// The request as axum alone reads it, for a body idem reads beside its
/// extractor (`Json`, `Form`) and for one it passes on (`String`).
async fn plain(Json(p): Json<Pay>) -> (StatusCode, String) {
    (StatusCode::CREATED, format!("paid {}", p.amount))
}

#[idempotent(scope = "hostile.form")]
async fn form(State(app): State<App>, Form(p): Form<Pay>) -> (StatusCode, String) {
    app.runs.fetch_add(1, Ordering::SeqCst);
    (StatusCode::CREATED, format!("paid {}", p.amount))
}

/// A body-limit layer of the application's own in front of the routes, as
/// tower-http's `RequestBodyLimitLayer` is one (the body wrapped in
/// `http_body_util::Limited`), axum's default limit disabled on the routes
/// as axum's docs say: a body past it gets the extractor's 413, as without
/// idem, not a 400 for a body idem reads beside the extractor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_past_a_limit_layer_of_the_apps_own_is_the_extractors_413() {
    async fn limited(req: Request, next: Next) -> Response {
        next.run(req.with_limited_body()).await
    }
    let store = Arc::new(MemoryStore::new());
    let app = App::default();
    let router = Router::new()
        .route("/plain", post(plain))
        .route("/pay", post(pay))
        .route("/form", post(form))
        .route("/text", post(text))
        .layer(DefaultBodyLimit::disable())
        .layer(axum::middleware::from_fn(limited))
        .layer(DefaultBodyLimit::max(256))
        .layer(Idem::from_arc(store.clone()).single_tenant().layer())
        .with_state(app.clone());
    let addr = serve(router).await;
    let pad = "x".repeat(1000);
    let json = format!(r#"{{"amount":1,"pad":"{pad}"}}"#);
    let without = req("/plain", &json).key("k-plain").send(addr).await;
    let text = |r: &idem_testkit::http::Reply| String::from_utf8_lossy(&r.body).into_owned();
    assert_eq!(without.status, 413, "axum alone: {:?}", text(&without));
    for (path, body, content_type) in [
        ("/pay", json.as_str(), "application/json"),
        (
            "/form",
            &format!("amount=1&pad={pad}"),
            "application/x-www-form-urlencoded",
        ),
        ("/text", json.as_str(), "text/plain"),
    ] {
        let r = req(path, body)
            .content_type(content_type)
            .key(&format!("k-limit{path}"))
            .send(addr)
            .await;
        assert_eq!((r.status, text(&r)), (413, text(&without)), "{path}");
    }
    assert_eq!(app.runs.load(Ordering::SeqCst), 0, "a handler ran");
    assert_eq!(store.len(), 0, "a record was stored");
    // Under the limit, the same routes serve.
    let r = req("/pay", r#"{"amount":1}"#).key("k-small").send(addr).await;
    assert_eq!(r.status, 201, "{:?}", text(&r));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deep_nesting_is_refused_without_overflowing_the_stack() {
    let s = Server::start().await;
    for open in ["[", "{\"a\":"] {
        let r = s.send("/any", &open.repeat(100_000), "k-deep").await;
        s.refused_cleanly(r.status, open).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_utf8_is_refused() {
    let s = Server::start().await;
    for path in ["/any", "/text", "/pay"] {
        let r = req(path, "")
            .key("k-utf8")
            .body_bytes(b"{\"amount\":1,\"x\":\"\xff\xfe\"}".to_vec())
            .send(s.addr)
            .await;
        s.refused_cleanly(r.status, path).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_members_are_a_problem_not_a_guess() {
    let s = Server::start().await;
    // serde_json's `Value` keeps the last value; the fingerprint would have
    // to pick one: the request is refused instead.
    let r = s.send("/any", r#"{"amount":1,"amount":2}"#, "k-dup").await;
    assert_eq!(
        (r.status, r.problem().as_str()),
        (400, "idempotency-body-invalid")
    );
    s.refused_cleanly(r.status, "duplicate members").await;
    // A typed handler's own extractor refuses a field sent twice first,
    // with its own answer, as without the attribute (the attribute's docs
    // say so).
    let r = s.send("/pay", r#"{"amount":1,"amount":2}"#, "k-dup-typed").await;
    assert_eq!(r.status, 422);
    assert_eq!(r.header("content-type"), Some("text/plain; charset=utf-8"));
    s.refused_cleanly(r.status, "a typed field sent twice").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn numbers_past_i64_and_f64_are_refused_or_kept_exact() {
    let s = Server::start().await;
    // Past i64 for a typed field: the extractor refuses it.
    let r = s.send("/pay", r#"{"amount":9223372036854775808}"#, "k-i64").await;
    s.refused_cleanly(r.status, "past i64").await;
    // Past f64: refused.
    let r = s.send("/any", r#"{"n":1e400}"#, "k-f64").await;
    s.refused_cleanly(r.status, "past f64").await;
    // Past u64 into a `Value`: the fingerprint keeps every digit, so two
    // numbers one apart are two requests.
    let first = s.send("/any", r#"{"n":18446744073709551616}"#, "k-u64").await;
    assert_eq!(first.status, 200);
    let other = s.send("/any", r#"{"n":18446744073709551617}"#, "k-u64").await;
    assert_eq!(
        (other.status, other.problem().as_str()),
        (422, "idempotency-key-reused")
    );
    assert_eq!(s.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_body_holds_no_key_while_it_trickles() {
    let s = Server::start().await;
    let body = br#"{"amount":7}"#;
    // The slow client sends its head and half its body, then waits.
    let mut slow = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    let head = format!(
        "POST /pay HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\n\
         idempotency-key: k-slow\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    slow.write_all(head.as_bytes()).await.unwrap();
    slow.write_all(&body[..5]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Meanwhile the same request, whole, runs: the key was never taken.
    let fast = s.send("/pay", std::str::from_utf8(body).unwrap(), "k-slow").await;
    assert_eq!(fast.status, 201);
    // The slow one, once whole, is a replay.
    slow.write_all(&body[5..]).await.unwrap();
    let mut raw = Vec::new();
    slow.read_to_end(&mut raw).await.unwrap();
    let text = String::from_utf8_lossy(&raw);
    assert!(text.starts_with("HTTP/1.1 201"), "{text}");
    assert!(
        text.to_ascii_lowercase().contains("idempotent-replayed: true"),
        "{text}"
    );
    assert_eq!(s.runs(), 1);
}
