//! Measures the store paths and the HTTP overhead of `#[idempotent]`, as
//! ratios against baselines measured in the same run.
//!
//! ```text
//! cargo run --release --all-features --example bench                  # SQLite
//! DATABASE_URL=postgres://postgres@127.0.0.1/test cargo run --release --all-features --example bench
//! ```
//!
//! Store paths are compared with `SELECT 1` on the same pool (one round
//! trip), so on PostgreSQL the ratio reads as round trips plus the server's
//! work. The HTTP figures compare a protected handler with the same handler
//! unprotected, over loopback. `IDEM_BENCH_GROWTH=1200000` measures only the
//! memory store growing past a million records (the slowest reservation
//! while its maps grow).

use axum::{routing::post, Json, Router};
use idem::store::{RecordId, Reservation, ReserveRequest, StoredResponse};
use idem::{idempotent, Idem, IdempotencyStore};
use idem_testkit::http;
use std::sync::Arc;
use std::time::{Duration, Instant};

const N: usize = 300;
const LONG: Duration = Duration::from_secs(3600);

fn id(run: &str, path: &str, i: usize) -> RecordId {
    RecordId::new("bench", format!("bench.{path}"), format!("{run}-{i}"))
}

fn answer() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), "application/json".into())],
        body: Some(br#"{"id":"pay_1","status":"succeeded"}"#.to_vec()),
    }
}

async fn reserve(store: &dyn IdempotencyStore, id: &RecordId, fp: &str, lock: Duration) -> Reservation {
    // Any unique string: the token this execution would hold.
    let token = format!("{}-{:?}", id.key, std::time::Instant::now());
    let req = ReserveRequest {
        id,
        fingerprint: fp,
        token: &token,
        ttl: LONG,
        lock_timeout: lock,
    };
    store.reserve(req).await.expect("reserve")
}

/// Mean time of `f` over N runs.
async fn mean<F, Fut>(mut f: F) -> Duration
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let started = Instant::now();
    for i in 0..N {
        f(i).await;
    }
    started.elapsed() / N as u32
}

async fn store_paths(store: Arc<dyn IdempotencyStore>, baseline: Duration) {
    let run = format!(
        "{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    );
    let s = &*store;
    let first = mean(|i| {
        let id = id(&run, "first", i);
        async move {
            let Reservation::Reserved(l) = reserve(s, &id, "fp", LONG).await else {
                panic!("not reserved")
            };
            s.complete(&id, &l.token, &answer()).await.expect("complete");
        }
    })
    .await;
    let replay = mean(|i| {
        let id = id(&run, "first", i);
        async move {
            assert!(matches!(
                reserve(s, &id, "fp", LONG).await,
                Reservation::Completed(_)
            ))
        }
    })
    .await;
    let mismatch = mean(|i| {
        let id = id(&run, "first", i);
        async move { assert_eq!(reserve(s, &id, "other", LONG).await, Reservation::Mismatch) }
    })
    .await;
    for i in 0..N {
        reserve(s, &id(&run, "busy", i), "fp", LONG).await;
    }
    let conflict = mean(|i| {
        let id = id(&run, "busy", i);
        async move {
            assert!(matches!(
                reserve(s, &id, "fp", LONG).await,
                Reservation::InProgress { .. }
            ))
        }
    })
    .await;
    for i in 0..N {
        reserve(s, &id(&run, "stale", i), "fp", Duration::from_millis(1)).await;
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    let takeover = mean(|i| {
        let id = id(&run, "stale", i);
        async move {
            let Reservation::Reserved(l) = reserve(s, &id, "fp", LONG).await else {
                panic!("not taken over")
            };
            assert_eq!(l.attempt, 2);
            s.complete(&id, &l.token, &answer()).await.expect("complete");
        }
    })
    .await;
    println!("{:<44} {:>10} {:>8}", "store path (mean of 300)", "time", "ratio");
    println!(
        "{:<44} {:>8.1}us {:>8.2}",
        "baseline: SELECT 1 (one round trip)",
        us(baseline),
        1.0
    );
    for (name, t) in [
        ("first request: reserve + complete", first),
        ("replay: reserve of a completed record", replay),
        ("mismatch: reserve with another fingerprint", mismatch),
        ("conflict: reserve of a record in progress", conflict),
        ("takeover: reserve of a stale lock + complete", takeover),
    ] {
        println!("{name:<44} {:>8.1}us {:>8.2}", us(t), ratio(t, baseline));
    }
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn ratio(a: Duration, b: Duration) -> f64 {
    a.as_secs_f64() / b.as_secs_f64()
}

#[derive(serde::Deserialize, serde::Serialize)]
struct PaymentIn {
    amount: i64,
    currency: String,
    recipient: String,
}

async fn plain(Json(p): Json<PaymentIn>) -> (axum::http::StatusCode, String) {
    (
        axum::http::StatusCode::CREATED,
        format!("{{\"amount\":{}}}", p.amount),
    )
}

#[idempotent(scope = "payment.create", fields(amount, currency, recipient))]
async fn protected(Json(p): Json<PaymentIn>) -> (axum::http::StatusCode, String) {
    (
        axum::http::StatusCode::CREATED,
        format!("{{\"amount\":{}}}", p.amount),
    )
}

async fn http_overhead(store: Arc<dyn IdempotencyStore>) {
    let app = Router::new()
        .route("/plain", post(plain))
        .route("/protected", post(protected))
        .layer(Idem::from_arc(store).single_tenant().layer());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a port");
    let addr = listener.local_addr().expect("an address");
    tokio::spawn(async move { axum::serve(listener, app).await });
    let body = r#"{"amount": 4990, "currency": "EUR", "recipient": "acct_bob"}"#;
    let run = format!(
        "{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    );
    let baseline =
        mean(|_| async { assert_eq!(http::post("/plain", body).send(addr).await.status, 201) }).await;
    let first = mean(|i| {
        let key = format!("{run}-{i}");
        async move {
            assert_eq!(
                http::post("/protected", body).key(&key).send(addr).await.status,
                201
            )
        }
    })
    .await;
    let replay = mean(|i| {
        let key = format!("{run}-{i}");
        async move {
            let r = http::post("/protected", body).key(&key).send(addr).await;
            assert_eq!(r.header("idempotent-replayed"), Some("true"));
        }
    })
    .await;
    println!(
        "\n{:<44} {:>10} {:>8}",
        "HTTP request over loopback (mean of 300)", "time", "ratio"
    );
    println!(
        "{:<44} {:>8.1}us {:>8.2}",
        "baseline: the same handler, unprotected",
        us(baseline),
        1.0
    );
    println!(
        "{:<44} {:>8.1}us {:>8.2}",
        "protected, first request",
        us(first),
        ratio(first, baseline)
    );
    println!(
        "{:<44} {:>8.1}us {:>8.2}",
        "protected, replay",
        us(replay),
        ratio(replay, baseline)
    );
}

/// The baseline: the mean time of one `SELECT 1` round trip on `pool`
/// (a macro, as the two stores' pools are different types).
macro_rules! select_one {
    ($pool:expr) => {{
        let pool = $pool;
        mean(|_| {
            let pool = pool.clone();
            async move {
                sqlx::query("SELECT 1").execute(&pool).await.expect("select");
            }
        })
        .await
    }};
}

/// The memory store growing to `records` records from 8 concurrent writers:
/// the slowest reservation and the 99th percentile, against the same writes
/// into one `HashMap` behind one lock (how the store kept its records
/// before it was sharded), measured back to back in this run.
async fn memory_growth(records: usize) {
    const WRITERS: usize = 8;
    async fn grow<F, Fut>(records: usize, write: F) -> (Duration, Duration, Duration)
    where
        F: Fn(usize) -> Fut + Clone + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        let started = Instant::now();
        let tasks: Vec<_> = (0..WRITERS)
            .map(|w| {
                let write = write.clone();
                tokio::spawn(async move {
                    let mut times = Vec::with_capacity(records / WRITERS);
                    for i in (w..records).step_by(WRITERS) {
                        let t = Instant::now();
                        write(i).await;
                        times.push(t.elapsed());
                    }
                    times
                })
            })
            .collect();
        let mut times = Vec::with_capacity(records);
        for t in tasks {
            times.extend(t.await.expect("writer"));
        }
        times.sort();
        let p99 = times[times.len() * 99 / 100];
        (started.elapsed(), p99, *times.last().expect("a time"))
    }
    let body = vec![b'x'; 200];
    let store = Arc::new(idem::MemoryStore::new());
    let sharded = {
        let (store, body) = (store.clone(), body.clone());
        grow(records, move |i| {
            let (store, body) = (store.clone(), body.clone());
            async move {
                let id = RecordId::new("bench", "bench.grow", format!("k-{i}"));
                let Reservation::Reserved(l) = reserve(&*store, &id, "fp", LONG).await else {
                    panic!("not reserved")
                };
                let answer = StoredResponse {
                    status: 201,
                    headers: vec![],
                    body: Some(body),
                };
                store.complete(&id, &l.token, &answer).await.expect("complete");
            }
        })
        .await
    };
    drop(store);
    let one_lock: Arc<std::sync::Mutex<std::collections::HashMap<RecordId, Vec<u8>>>> = Arc::default();
    let single = grow(records, move |i| {
        let (map, body) = (one_lock.clone(), body.clone());
        async move {
            let id = RecordId::new("bench", "bench.grow", format!("k-{i}"));
            map.lock().expect("lock").insert(id, body);
        }
    })
    .await;
    println!(
        "\n{:<44} {:>10} {:>10} {:>10}",
        format!("growing to {records} records, {WRITERS} writers"),
        "total",
        "p99",
        "max"
    );
    for (name, (total, p99, max)) in [
        ("MemoryStore (256 shards): reserve + complete", sharded),
        ("baseline: insert into one locked HashMap", single),
    ] {
        println!(
            "{name:<44} {:>9.2}s {:>8.1}us {:>8.2}ms",
            total.as_secs_f64(),
            us(p99),
            max.as_secs_f64() * 1000.0
        );
    }
}

#[tokio::main]
async fn main() {
    // `IDEM_BENCH_GROWTH=<records>`: only the memory store's growth.
    if let Some(records) = std::env::var("IDEM_BENCH_GROWTH")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        memory_growth(records).await;
        return;
    }
    let url = std::env::var("DATABASE_URL")
        .ok()
        .filter(|u| u.starts_with("postgres"));
    let tmp = tempfile::tempdir().expect("a temporary directory");
    let (store, baseline): (Arc<dyn IdempotencyStore>, Duration) = match url {
        Some(url) => {
            let pool = sqlx::PgPool::connect(&url).await.expect("DATABASE_URL connects");
            let schema = format!("idem_bench_{}", std::process::id());
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "CREATE SCHEMA IF NOT EXISTS {schema}"
            )))
            .execute(&pool)
            .await
            .expect("create schema");
            let store = idem::PgStore::new(pool.clone())
                .with_table(Some(&schema), "idempotency_keys")
                .expect("names");
            store.migrate().await.expect("migrate");
            let baseline = select_one!(pool);
            println!("store: PostgreSQL\n");
            (Arc::new(store), baseline)
        }
        None => {
            let store = idem::SqliteStore::open(tmp.path().join("bench.db"))
                .await
                .expect("open");
            store.migrate().await.expect("migrate");
            let baseline = select_one!(store.pool().clone());
            println!("store: SQLite (temporary file); set DATABASE_URL=postgres://... for PostgreSQL\n");
            (Arc::new(store), baseline)
        }
    };
    store_paths(store.clone(), baseline).await;
    http_overhead(store).await;
}
