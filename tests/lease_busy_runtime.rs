//! A healthy execution whose extension the store answered in time is not
//! told its lease is lost, however late its busy runtime polls that
//! answer: its lock is live, with its own token, and nobody took over. (An
//! extension its runtime never ran is another matter: lease_runtimes.rs.)
//!
//! PostgreSQL: a row lock holds the keeper's extension until the test lets
//! it go, while a gate keeps every worker of the server's runtime busy past
//! the lease's local deadline; no sleep decides an ordering (sleeps only
//! pace polls of conditions).

use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use idem::{idempotent, Idem, Operation};
use idem_testkit::http::post as post_req;
use sqlx::Connection as _;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

const LOCK: Duration = Duration::from_secs(6);

/// What one test shares with its handler.
struct Probe {
    runs: AtomicU32,
    /// The first run hands its `Operation` (and when it started) to the test.
    hand_over: Mutex<Option<tokio::sync::oneshot::Sender<(Operation, Instant)>>>,
    /// The first run waits (asynchronously) for this before it blocks its thread.
    block_now: Mutex<Option<tokio::sync::oneshot::Receiver<()>>>,
    /// The gate the server's workers block on, and how many are blocked.
    gate: (Mutex<bool>, Condvar),
    blocked: AtomicU32,
}

impl Probe {
    const fn new() -> Self {
        Probe {
            runs: AtomicU32::new(0),
            hand_over: Mutex::new(None),
            block_now: Mutex::new(None),
            gate: (Mutex::new(false), Condvar::new()),
            blocked: AtomicU32::new(0),
        }
    }

    /// Blocks this thread until the test opens the gate (30 s at most).
    fn block_thread(&self) {
        self.blocked.fetch_add(1, Ordering::SeqCst);
        let (open, opened) = &self.gate;
        let mut open = open.lock().unwrap();
        let until = Instant::now() + Duration::from_secs(30);
        while !*open && Instant::now() < until {
            open = opened.wait_timeout(open, Duration::from_millis(100)).unwrap().0;
        }
    }

    fn open_gate(&self) {
        let (open, opened) = &self.gate;
        *open.lock().unwrap() = true;
        opened.notify_all();
    }

    async fn first_run(&'static self, op: &Operation) -> u32 {
        let n = self.runs.fetch_add(1, Ordering::SeqCst) + 1;
        if n == 1 {
            let tx = self.hand_over.lock().unwrap().take().unwrap();
            tx.send((op.clone(), Instant::now())).unwrap();
            let rx = self.block_now.lock().unwrap().take().unwrap();
            rx.await.unwrap();
            // Work that keeps this worker busy for a while (as does the
            // other worker's): the runtime is busy, not dead.
            self.block_thread();
        }
        n
    }
}

static LONG: Probe = Probe::new();

#[idempotent(scope = "lease.busy_runtime", lock_timeout = "6s")]
async fn held(op: Operation) -> (StatusCode, String) {
    let n = LONG.first_run(&op).await;
    (StatusCode::CREATED, format!("run {n}"))
}

/// An extension that the store committed well before the lease's local
/// deadline (its answer already on the wire) is a lease that holds: the
/// handler is not told its lease is lost, and its answer is given. (A
/// keeper that counted the deadline past an extension still under way
/// answered 503 `idempotency-lease-lost` here, and its retry ran the
/// handler a second time.)
#[test]
fn postgres_an_extension_committed_before_the_deadline_is_not_a_lost_lease() {
    scenario(&LONG, "/held", "busy-runtime");
}

/// The first request to `path` with `key`, its extension held, then let go
/// while every worker is busy; then the lease, the answer and the runs.
fn scenario(probe: &'static Probe, path: &'static str, key: &'static str) {
    let Some(url) = idem_testkit::pg_url() else {
        return;
    };
    let server = idem_testkit::multi_thread(2);
    let (addr, table) = server.block_on(async {
        let schema = idem_testkit::pg_schema(&url).await;
        let store = idem_testkit::pg_store_in(&url, &schema, 4).await;
        let table = idem_testkit::records::pg_table(&store);
        let router = Router::new()
            .route("/held", post(held))
            .layer(Idem::new(store).single_tenant().layer());
        (idem_testkit::http::serve(router).await, table)
    });
    let (op_tx, op_rx) = tokio::sync::oneshot::channel();
    *probe.hand_over.lock().unwrap() = Some(op_tx);
    let (block_tx, block_rx) = tokio::sync::oneshot::channel();
    *probe.block_now.lock().unwrap() = Some(block_rx);

    let client = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    client.block_on(async {
        let t0 = Instant::now();
        let first = tokio::spawn(async move { post_req(path, "").key(key).send(addr).await });
        let (op, started) = op_rx.await.unwrap();
        let pool = sqlx::PgPool::connect(&url).await.unwrap();
        let row = || {
            sqlx::query_as::<_, (Option<String>, i64, i64, bool)>(sqlx::AssertSqlSafe(format!(
                "SELECT lock_token, attempt::bigint, \
                 (extract(epoch FROM lock_expires_at) * 1000000)::bigint, \
                 lock_expires_at > clock_timestamp() FROM {table} WHERE key = $1"
            )))
            .bind(key)
            .fetch_one(&pool)
        };
        let (token0, _, expires0, _) = row().await.unwrap();
        assert!(token0.is_some());

        // The record's row is held: the keeper's first extension (due a
        // third of the lock timeout in) waits behind it.
        let mut holder = sqlx::PgConnection::connect(&url).await.unwrap();
        sqlx::query("BEGIN").execute(&mut holder).await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT 1 FROM {table} WHERE key = $1 FOR UPDATE"
        )))
        .bind(key)
        .execute(&mut holder)
        .await
        .unwrap();
        let schema_part = table.split('.').next().unwrap().trim_matches('"').to_owned();
        let waiting_until = Instant::now() + Duration::from_secs(20);
        loop {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
                 AND query LIKE '%lock_expires_at%' AND query LIKE $1 AND query LIKE 'UPDATE%'",
            )
            .bind(format!("%{schema_part}%"))
            .fetch_one(&pool)
            .await
            .unwrap();
            if waiting == 1 {
                break;
            }
            assert!(Instant::now() < waiting_until, "the extension never came");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }

        // Every worker of the server's runtime is busy: the handler's and
        // one more task's work.
        block_tx.send(()).unwrap();
        server.spawn(async { probe.block_thread() });
        let busy_until = Instant::now() + Duration::from_secs(20);
        while probe.blocked.load(Ordering::SeqCst) < 2 {
            assert!(Instant::now() < busy_until, "the workers never got busy");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }

        // The row is let go: the extension commits, with the execution's
        // token, well before the lease's local deadline.
        let busy_since = Instant::now();
        sqlx::query("COMMIT").execute(&mut holder).await.unwrap();
        let ext_until = Instant::now() + Duration::from_secs(20);
        let extended_at = loop {
            let (token, _, expires, _) = row().await.unwrap();
            assert_eq!(token, token0);
            if expires > expires0 {
                break Instant::now();
            }
            assert!(Instant::now() < ext_until, "the extension never committed");
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        // The local deadline is no earlier than t0 + LOCK (the reservation
        // asked after t0).
        assert!(
            extended_at < t0 + LOCK,
            "the extension committed {:?} after the request, not before the lock timeout",
            extended_at - t0
        );
        eprintln!(
            "extension committed {:?} after the request; lease deadline no earlier than {:?}",
            extended_at - t0,
            LOCK
        );

        // Past the lease's local deadline (no later than the handler's
        // start + LOCK), and well before the extended lock runs out
        // (no earlier than the commit + LOCK).
        let look_until = started + LOCK + Duration::from_millis(1500);
        assert!(look_until < extended_at + LOCK);
        while !op.is_lease_lost() && Instant::now() < look_until {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let told_lost = op.is_lease_lost();
        let (token, attempt, _, live) = row().await.unwrap();
        eprintln!(
            "{:?} after the request: told lost {told_lost}; the record: token ours {}, attempt {attempt}, lock live {live}",
            Instant::now() - t0,
            token == token0
        );
        assert_eq!((token, attempt, live), (token0.clone(), 1, true), "nobody took over");

        probe.open_gate();
        eprintln!("the server's workers were busy for {:?}", busy_since.elapsed());
        let first = first.await.unwrap();
        drop(op);
        let retry = post_req(path, "").key(key).send(addr).await;
        eprintln!(
            "first answer: {} {:?}; retry: {} {:?}; handler runs {}",
            first.status,
            String::from_utf8_lossy(&first.body),
            retry.status,
            String::from_utf8_lossy(&retry.body),
            probe.runs.load(Ordering::SeqCst)
        );
        assert!(
            !told_lost,
            "the handler was told its lease is lost while its lock was live, extended with its own token"
        );
        assert_eq!(first.status, 201, "{first:?}");
        assert_eq!(probe.runs.load(Ordering::SeqCst), 1, "the handler ran twice");
    });
    drop(client);
    drop(server);
}
