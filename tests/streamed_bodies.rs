//! Answers larger than `max_stored_body`, streamed under the lease: a body
//! fed by the transaction's holder until it is gone, and bodies always ready
//! on a runtime that nothing else drives (PostgreSQL: a second server on the
//! same schema tries to take the execution over).

use axum::extract::State;
use axum::response::IntoResponse as _;
use axum::routing::post;
use axum::{Json, Router};
use futures_util::StreamExt as _;
use idem::{idempotent, Idem, IdempotencyStore, Operation};
use idem_testkit::http::{post as post_req, serve};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[derive(Clone)]
struct H {
    pool: sqlx::PgPool,
    schema: String,
}

impl H {
    fn effects(&self) -> String {
        format!("\"{}\".effects", self.schema)
    }
    async fn create_table(&self) {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE IF NOT EXISTS {} (id TEXT PRIMARY KEY, note TEXT NOT NULL)",
            self.effects()
        )))
        .execute(&self.pool)
        .await
        .unwrap();
    }
    async fn count(&self) -> i64 {
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT COUNT(*) FROM {}",
            self.effects()
        )))
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }
}

static ROW: AtomicU64 = AtomicU64::new(0);
static RUNS: std::sync::Mutex<Vec<(String, u32)>> = std::sync::Mutex::new(Vec::new());
/// Keys whose attempt 1 body is spinning.
static SPINNING: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

fn runs(key: &str) -> Vec<u32> {
    RUNS.lock()
        .unwrap()
        .iter()
        .filter(|(k, _)| k == key)
        .map(|(_, a)| *a)
        .collect()
}

#[derive(serde::Deserialize, serde::Serialize)]
struct In {
    /// `take-two`: a task opens the transaction, writes a row and feeds a
    /// line for each of four, into a channel of capacity 1, until the body
    /// is gone (send fails); then lets go. Body: the first two lines.
    /// `spin-empty` / `spin-data`: first chunk "12345", then always-ready
    /// chunks (empty / "x") for 6 s; attempt > 1 answers 201 "fine".
    then: String,
}

#[idempotent(scope = "streamed", fields(then))]
async fn handler(State(h): State<H>, op: Operation, Json(input): Json<In>) -> axum::response::Response {
    RUNS.lock().unwrap().push((op.key().to_owned(), op.attempt()));
    if input.then.starts_with("spin") {
        if op.attempt() > 1 {
            return (axum::http::StatusCode::CREATED, "fine").into_response();
        }
        let chunk: &'static [u8] = if input.then == "spin-data" { b"x" } else { b"" };
        let until = std::time::Instant::now() + Duration::from_secs(6);
        let key = op.key().to_owned();
        let first = futures_util::stream::once(async {
            Ok::<_, std::io::Error>(axum::body::Bytes::from_static(b"12345"))
        });
        let spin = futures_util::stream::poll_fn(move |_| {
            let mut s = SPINNING.lock().unwrap();
            if !s.contains(&key) {
                s.push(key.clone());
            }
            std::task::Poll::Ready(
                (std::time::Instant::now() < until)
                    .then(|| Ok::<_, std::io::Error>(axum::body::Bytes::from_static(chunk))),
            )
        });
        return (
            axum::http::StatusCode::CREATED,
            axum::body::Body::from_stream(first.chain(spin)),
        )
            .into_response();
    }
    let (line, lines) = tokio::sync::mpsc::channel::<Result<String, std::io::Error>>(1);
    let (holding, is_held) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let mut conn = op.pg_transaction().await.expect("the transaction opens");
        let _ = holding.send(());
        for row in ["one", "two", "three", "four"] {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {} (id, note) VALUES ($1, '{row}')",
                h.effects()
            )))
            .bind(format!("r-{}", ROW.fetch_add(1, Ordering::SeqCst)))
            .execute(&mut *conn)
            .await
            .expect("the write");
            if line.send(Ok(format!("{row}\n"))).await.is_err() {
                break;
            }
        }
        drop(conn);
    });
    is_held.await.unwrap();
    let body = futures_util::stream::unfold(lines, |mut lines| async move {
        lines.recv().await.map(|l| (l, lines))
    })
    .take(2);
    (
        axum::http::StatusCode::CREATED,
        axum::body::Body::from_stream(body),
    )
        .into_response()
}

/// `/whole`: default max_stored_body; `/big`: 4 bytes. Lock timeout 1 s.
async fn app(store: Arc<dyn IdempotencyStore>, h: &H) -> std::net::SocketAddr {
    h.create_table().await;
    app_on(store, h).await
}

async fn app_on(store: Arc<dyn IdempotencyStore>, h: &H) -> std::net::SocketAddr {
    let idem = Idem::from_arc(store)
        .single_tenant()
        .lock_timeout(Duration::from_secs(1))
        .unwrap();
    let app = Router::new()
        .route("/whole", post(handler))
        .layer(idem.clone().layer())
        .merge(
            Router::new()
                .route("/big", post(handler))
                .layer(idem.max_stored_body(4).unwrap().layer()),
        )
        .with_state(h.clone());
    serve(app).await
}

async fn setup() -> Option<(String, String, Arc<dyn IdempotencyStore>, H)> {
    let url = idem_testkit::pg_url()?;
    let schema = idem_testkit::pg_schema(&url).await;
    let store = idem_testkit::pg_store_in(&url, &schema, 10).await;
    let h = H {
        pool: store.pool().clone(),
        schema: schema.clone(),
    };
    Some((url, schema, Arc::new(store), h))
}

fn req(path: &str, then: &str, key: &str) -> idem_testkit::http::Request {
    post_req(path, &format!(r#"{{"then":"{then}"}}"#)).key(key)
}

/// A body too large to store, fed by the transaction's holder until the
/// body is gone; the body ends on its own (`take(2)`). It is dropped once it
/// ended, before the transaction is taken, as on `/whole` (where `collect`
/// drops it): the holder lets go, the rows commit with the answer, and the
/// client gets the whole 201; the handler runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_streamed_body_is_dropped_so_its_feeder_lets_go() {
    let Some((_, _, store, h)) = setup().await else {
        return;
    };
    let addr = app(store, &h).await;
    let answer = |path: &'static str, key: String| async move {
        let r = tokio::time::timeout(Duration::from_secs(20), req(path, "take-two", &key).send(addr))
            .await
            .expect("answered");
        (r.status, String::from_utf8_lossy(&r.body).into_owned())
    };
    let whole = answer("/whole", idem_testkit::unique("fed-whole")).await;
    assert_eq!(whole, (201, "one\ntwo\n".to_owned()));
    // The feeder writes a row before each line: the two lines read, and one
    // or two more before it finds the body gone (as the channel's one slot
    // was free or not).
    let fed = 3..=4;
    let whole_rows = h.count().await;
    assert!(
        fed.contains(&whole_rows),
        "the rows written while feeding commit: {whole_rows}"
    );

    let key = idem_testkit::unique("fed-big");
    let started = std::time::Instant::now();
    let big = answer("/big", key.clone()).await;
    assert_eq!(
        big,
        (201, "one\ntwo\n".to_owned()),
        "after {:?}",
        started.elapsed()
    );
    let big_rows = h.count().await - whole_rows;
    assert!(
        fed.contains(&big_rows),
        "its rows commit with the answer: {big_rows}"
    );
    let retry = tokio::time::timeout(Duration::from_secs(20), req("/big", "take-two", &key).send(addr))
        .await
        .expect("answered");
    assert_eq!(
        (retry.status, retry.header("idempotent-replayed")),
        (201, Some("true")),
        "the answer was recorded: {retry:?}"
    );
    assert_eq!(runs(&key), [1], "the handler ran once");
}

/// On a current-thread runtime, a body too large to store whose rest is
/// always ready for 6 s (lock timeout 1 s): the streamer gives the runtime
/// its turn after each chunk, even one it sends nowhere (empty, or its
/// client gone), so the lease's extensions (on this runtime) go on and a
/// second server asking again and again gets 409: the handler runs once.
fn always_ready(then: &'static str, hang_up: bool) {
    always_ready_on(
        then,
        hang_up,
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap(),
    )
}

fn always_ready_on(then: &'static str, hang_up: bool, rt: tokio::runtime::Runtime) {
    let Some(url) = idem_testkit::pg_url() else { return };
    rt.block_on(async {
        let Some((_, schema, store, h)) = setup().await else { return };
        let addr = app(store, &h).await;
        let key = idem_testkit::unique("always-ready");
        let first_done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let other = {
            let (url, schema, key, first_done) = (url.clone(), schema.clone(), key.clone(), first_done.clone());
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
                rt.block_on(async move {
                    let store = idem_testkit::pg_store_in(&url, &schema, 10).await;
                    // Its own pool: the first's belongs to the first runtime.
                    let h2 = H { pool: store.pool().clone(), schema: schema.clone() };
                    let addr2 = app_on(Arc::new(store), &h2).await;
                    let mut asks = 0u32;
                    while !SPINNING.lock().unwrap().contains(&key) {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    loop {
                        let r = tokio::time::timeout(Duration::from_secs(20), req("/big", then, &key).send(addr2)).await.unwrap();
                        asks += 1;
                        if r.status != 409 || first_done.load(Ordering::SeqCst) {
                            break (asks, r.status, String::from_utf8_lossy(&r.body).into_owned(), first_done.load(Ordering::SeqCst));
                        }
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                })
            })
        };
        let started = std::time::Instant::now();
        let first = if hang_up {
            use tokio::io::AsyncReadExt as _;
            let mut s = req("/big", then, &key).start(addr).await;
            let mut got = Vec::new();
            let mut buf = [0u8; 4096];
            while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = s.read(&mut buf).await.unwrap();
                assert!(n > 0);
                got.extend_from_slice(&buf[..n]);
            }
            drop(s);
            // The execution goes on without its client: wait for its end by
            // the second server's answer.
            String::from_utf8_lossy(&got[..got.windows(4).position(|w| w == b"\r\n\r\n").unwrap()]).into_owned()
        } else {
            let raw = tokio::time::timeout(Duration::from_secs(20), req("/big", then, &key).send_raw(addr)).await.unwrap();
            first_done.store(true, Ordering::SeqCst);
            let raw = String::from_utf8_lossy(&raw).into_owned();
            raw.chars().take(200).collect::<String>() + &format!(" ... (len {})", raw.len())
        };
        let took = started.elapsed();
        let second = tokio::task::spawn_blocking(move || other.join().unwrap()).await.unwrap();
        let runs = runs(&key);
        assert_eq!(
            runs,
            [1],
            "the handler ran once; the first client got {first:?} after {took:?}, the second server {second:?}"
        );
    });
}

#[test]
fn empty_chunks_on_a_current_thread_runtime() {
    always_ready("spin-empty", false)
}

#[test]
fn chunks_for_a_client_gone_on_a_current_thread_runtime() {
    always_ready("spin-data", true)
}

#[test]
fn chunks_for_a_reading_client_on_a_current_thread_runtime() {
    always_ready("spin-data", false)
}

/// The same on a multi-thread runtime of one worker.
#[test]
fn empty_chunks_on_a_one_worker_runtime() {
    always_ready_on(
        "spin-empty",
        false,
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap(),
    )
}
