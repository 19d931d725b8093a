//! One `Idem` used from two Tokio runtimes, one after the other: a lease
//! started on the second is kept (its lock extended) whether the first
//! runtime has ended or idles undriven. The lease keeper is a thread of the
//! process that spawns each extension on the execution's own runtime; a
//! keeper task on the first runtime (as once) left the second's leases
//! unextended: a retry ran the handler a second time. And the limit that
//! follows: work that blocks a runtime's only thread stops its extensions.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::Router;
use idem::{idempotent, Idem, Operation};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::Duration;
use tower::ServiceExt as _;

static RUNS: AtomicU32 = AtomicU32::new(0);
static LOST_SEEN: AtomicU32 = AtomicU32::new(0);

#[idempotent(scope = "probe.quick", lock_timeout = "300ms")]
async fn quick() -> StatusCode {
    StatusCode::CREATED
}

/// Lasts four lock timeouts: its lease must be extended all along.
#[idempotent(scope = "probe.slow", lock_timeout = "300ms")]
async fn slow(op: Operation) -> (StatusCode, String) {
    let n = RUNS.fetch_add(1, Ordering::SeqCst) + 1;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    if op.is_lease_lost() {
        LOST_SEEN.fetch_add(1, Ordering::SeqCst);
    }
    (StatusCode::CREATED, format!("run {n}"))
}

fn app() -> Router {
    static IDEM: OnceLock<Idem> = OnceLock::new();
    let idem = IDEM
        .get_or_init(|| Idem::new(idem::MemoryStore::new()).single_tenant())
        .clone();
    Router::new()
        .route("/quick", post(quick))
        .route("/slow", post(slow))
        .layer(idem.layer())
}

fn req(path: &str, key: &str) -> Request<Body> {
    Request::post(path)
        .header("idempotency-key", key)
        .body(Body::empty())
        .unwrap()
}

#[test]
fn a_lease_of_a_second_runtime_is_kept_after_the_first_runtime_ends() {
    let (started_tx, started_rx) = std::sync::mpsc::channel::<()>();
    // "Test 1": its own runtime; its request starts the keeper there. The
    // runtime lives on a little while (the test is still running), then ends.
    let first = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let r = app().oneshot(req("/quick", "quick-1")).await.unwrap();
            assert_eq!(r.status(), StatusCode::CREATED);
            started_tx.send(()).unwrap();
            // Test 1 is still doing something while test 2 starts.
            tokio::time::sleep(Duration::from_millis(200)).await;
        });
        drop(rt); // test 1 ends
    });
    started_rx.recv().unwrap();
    // "Test 2": another runtime, a long execution with a 300 ms lock.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let long = tokio::spawn(app().oneshot(req("/slow", "slow-1")));
        // Well past the first runtime's end and two lock timeouts, while the
        // first execution still runs: its lock must still be held.
        tokio::time::sleep(Duration::from_millis(800)).await;
        let retry = app().oneshot(req("/slow", "slow-1")).await.unwrap();
        let retry_status = retry.status();
        let first = long.await.unwrap().unwrap();
        let first_status = first.status();
        first_thread_join(first_status, retry_status);
    });
    first.join().unwrap();
}

fn first_thread_join(first: StatusCode, retry: StatusCode) {
    let runs = RUNS.load(Ordering::SeqCst);
    let lost = LOST_SEEN.load(Ordering::SeqCst);
    eprintln!("first execution: {first}; retry at 800 ms: {retry}; handler runs: {runs}; lease lost seen by handler: {lost}");
    assert_eq!(
        retry,
        StatusCode::CONFLICT,
        "the retry during the first execution must get 409"
    );
    assert_eq!(first, StatusCode::CREATED, "the first execution keeps its lease");
    assert_eq!(runs, 1, "one execution");
}

/// The first runtime is not dropped but no longer driven (its block_on
/// returned): a lease of a second runtime, started afterwards, is kept.
#[test]
fn a_lease_of_a_second_runtime_is_kept_while_the_first_runtime_idles() {
    static IDEM2: OnceLock<Idem> = OnceLock::new();
    let idem = || {
        IDEM2
            .get_or_init(|| Idem::new(idem::MemoryStore::new()).single_tenant())
            .clone()
    };
    let app = move || {
        Router::new()
            .route("/quick", post(quick))
            .route("/slow", post(slow2))
            .layer(idem().layer())
    };
    let rt1 = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt1.block_on(async {
        assert_eq!(
            app().oneshot(req("/quick", "q")).await.unwrap().status(),
            StatusCode::CREATED
        );
    });
    // rt1 lives on, idle.
    let rt2 = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let runs_before = RUNS2.load(Ordering::SeqCst);
    rt2.block_on(async {
        let long = tokio::spawn(app().oneshot(req("/slow", "slow-2")));
        tokio::time::sleep(Duration::from_millis(800)).await;
        let retry = app().oneshot(req("/slow", "slow-2")).await.unwrap().status();
        let first = long.await.unwrap().unwrap().status();
        let runs = RUNS2.load(Ordering::SeqCst) - runs_before;
        eprintln!("idle first runtime: first {first}; retry at 800 ms {retry}; handler runs {runs}");
        assert_eq!(
            (first, retry, runs),
            (StatusCode::CREATED, StatusCode::CONFLICT, 1)
        );
    });
    drop(rt1);
}

static RUNS2: AtomicU32 = AtomicU32::new(0);

#[idempotent(scope = "probe.slow_two", lock_timeout = "300ms")]
async fn slow2() -> StatusCode {
    RUNS2.fetch_add(1, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    StatusCode::CREATED
}

/// The runs of `hog`, and the gate its first run blocks its thread on.
static HOG_RUNS: AtomicU32 = AtomicU32::new(0);
static HOG_GATE: (std::sync::Mutex<bool>, std::sync::Condvar) =
    (std::sync::Mutex::new(false), std::sync::Condvar::new());

/// Whether the first run of `hog` was told its lease is lost, once its
/// thread was free again.
static HOG_TOLD: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Its first run blocks its thread (neither `block_in_place` nor
/// `spawn_blocking`) until the test opens the gate, then asks whether its
/// lease holds, as a handler does before its next effect.
#[idempotent(scope = "probe.hog", lock_timeout = "300ms")]
async fn hog(op: Operation) -> (StatusCode, String) {
    let n = HOG_RUNS.fetch_add(1, Ordering::SeqCst) + 1;
    if n == 1 {
        {
            let (open, opened) = &HOG_GATE;
            let mut open = open.lock().unwrap();
            while !*open {
                open = opened.wait(open).unwrap();
            }
        }
        HOG_TOLD.store(op.is_lease_lost(), Ordering::SeqCst);
    }
    (StatusCode::CREATED, format!("run {n}"))
}

/// What the README says of work that blocks a runtime's every worker: the
/// keeper runs each extension on the execution's own runtime, so none runs
/// while the runtime's only thread is blocked, and the lock runs out; the
/// handler is told its lease is lost once it asks. A
/// retry meanwhile (from another runtime) takes the key over and runs the
/// handler again; the blocked execution's late completion is fenced off by
/// its token, never stored over the takeover's answer, and its client is
/// not told it succeeded.
#[test]
fn work_that_blocks_a_runtimes_only_thread_stops_its_extensions() {
    static IDEM3: OnceLock<Idem> = OnceLock::new();
    let app = || {
        let idem = IDEM3
            .get_or_init(|| Idem::new(idem::MemoryStore::new()).single_tenant())
            .clone();
        Router::new().route("/hog", post(hog)).layer(idem.layer())
    };
    let first = std::thread::spawn(move || answer_on(&current_thread(), app(), "/hog", "hog-1"));
    while HOG_RUNS.load(Ordering::SeqCst) == 0 {
        std::thread::sleep(Duration::from_millis(5));
    }
    // At least two lock timeouts while the first run blocks its thread.
    std::thread::sleep(Duration::from_millis(700));
    let rt = current_thread();
    let send = || answer_on(&rt, app(), "/hog", "hog-1");
    let retry = send();
    assert_eq!(
        (retry.0, &retry.1[..]),
        (StatusCode::CREATED, &b"run 2"[..]),
        "taken over"
    );
    let (open, opened) = &HOG_GATE;
    *open.lock().unwrap() = true;
    opened.notify_all();
    let (first_status, first_body) = first.join().unwrap();
    eprintln!("blocked execution answered {first_status} {first_body:?}");
    assert_ne!(first_status, StatusCode::CREATED, "its completion was fenced off");
    // The keeper, a thread of its own, counted the deadline that passed
    // although the extension it started could not run.
    assert!(
        HOG_TOLD.load(Ordering::SeqCst),
        "the blocked run was not told its lease is lost"
    );
    let replay = send();
    assert_eq!(
        (replay.0, &replay.1[..]),
        (StatusCode::CREATED, &b"run 2"[..]),
        "the takeover's answer stays"
    );
    assert_eq!(HOG_RUNS.load(Ordering::SeqCst), 2);
}

fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// The status and body `app` answers to a keyed POST, on `rt`.
fn answer_on(
    rt: &tokio::runtime::Runtime,
    app: Router,
    path: &str,
    key: &str,
) -> (StatusCode, axum::body::Bytes) {
    rt.block_on(async {
        let response = app.oneshot(req(path, key)).await.unwrap();
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        (status, body)
    })
}

/// A runtime that ends (as `#[tokio::main]` does when `main` returns after
/// a drain that ran out, or on a second signal) while a handler's blocking
/// work, handed a clone of `op` in `spawn_blocking` as the README advises,
/// still runs: the runtime's drop waits for that work, and drops the
/// execution (its lease with it) at once. The work is told its lease is
/// lost, so that it stops before its next effect: the lock lapses, and the
/// next process takes the operation over and runs it.
mod runtime_ended {
    use super::*;
    use idem::SqliteStore;
    use std::sync::{mpsc, Mutex};
    use std::time::Instant;

    /// Effects made (a card charged, say): once per execution that went ahead.
    static EFFECTS: AtomicU32 = AtomicU32::new(0);
    /// The first execution's blocking work: tells it started, waits for the gate.
    static STARTED: Mutex<Option<mpsc::Sender<()>>> = Mutex::new(None);
    static GATE: Mutex<Option<mpsc::Receiver<()>>> = Mutex::new(None);
    /// What the first execution's blocking work saw at its effect: its lease lost?
    static SEEN: Mutex<Option<mpsc::Sender<bool>>> = Mutex::new(None);

    #[idempotent(scope = "lease.runtime_ended", lock_timeout = "300ms")]
    async fn charge(op: Operation) -> (StatusCode, String) {
        let attempt = op.attempt();
        if attempt == 1 {
            let op2 = op.clone();
            let _ = tokio::task::spawn_blocking(move || {
                let started = STARTED.lock().unwrap().take().unwrap();
                let gate = GATE.lock().unwrap().take().unwrap();
                let seen = SEEN.lock().unwrap().take().unwrap();
                started.send(()).unwrap();
                // Long blocking work (a slow legacy call), longer than the drain.
                let _ = gate.recv();
                // The README: stop before the next external effect once told.
                let lost = op2.is_lease_lost();
                if !lost {
                    EFFECTS.fetch_add(1, Ordering::SeqCst);
                }
                let _ = seen.send(lost);
            })
            .await;
        } else {
            EFFECTS.fetch_add(1, Ordering::SeqCst);
        }
        (StatusCode::CREATED, format!("attempt {attempt}"))
    }

    fn app_on(store: impl idem::IdempotencyStore) -> Router {
        Router::new()
            .route("/charge", post(charge))
            .layer(Idem::new(store).single_tenant().layer())
    }

    fn req_of(key: &str) -> Request<Body> {
        Request::post("/charge")
            .header("idempotency-key", key)
            .body(Body::empty())
            .unwrap()
    }

    fn multi_thread() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
    }

    /// One scenario at a time: they share the handler's statics.
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

    /// The old process serves the first attempt on a store `open` makes on its
    /// runtime; its runtime ends while the blocking work runs; the new process,
    /// a store of its own from `open`, takes the operation over once the lock
    /// lapsed; then the old blocking work reaches its next effect.
    fn scenario<S, F>(open: impl Fn() -> F, key: &str)
    where
        S: idem::IdempotencyStore,
        F: std::future::Future<Output = S>,
    {
        let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        EFFECTS.store(0, Ordering::SeqCst);
        let (started_tx, started_rx) = mpsc::channel();
        let (gate_tx, gate_rx) = mpsc::channel::<()>();
        let (seen_tx, seen_rx) = mpsc::channel();
        *STARTED.lock().unwrap() = Some(started_tx);
        *GATE.lock().unwrap() = Some(gate_rx);
        *SEEN.lock().unwrap() = Some(seen_tx);

        // The old process: its runtime serves the first attempt.
        let old = multi_thread();
        let old_app = app_on(old.block_on(open()));
        let first = req_of(key);
        drop(old.spawn(async move { old_app.oneshot(first).await }));
        started_rx.recv().unwrap();
        // `main` returns: the runtime is dropped, which waits for the blocking
        // work (tokio's documented drop), on a thread of its own here.
        let ending = std::thread::spawn(move || drop(old));

        // The new process (a rolling deploy): a store of its own.
        let new = multi_thread();
        let (status, body) = new.block_on(async {
            let app = app_on(open().await);
            let began = Instant::now();
            loop {
                let r = app.clone().oneshot(req_of(key)).await.unwrap();
                let status = r.status();
                let body = axum::body::to_bytes(r.into_body(), usize::MAX).await.unwrap();
                if status != StatusCode::CONFLICT {
                    break (status, body);
                }
                assert!(began.elapsed() < Duration::from_secs(10), "never taken over");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        // The takeover ran: the old lock lapsed, nobody extends it any more.
        assert_eq!((status, &body[..]), (StatusCode::CREATED, &b"attempt 2"[..]));
        assert_eq!(EFFECTS.load(Ordering::SeqCst), 1);

        // The old execution's blocking work goes on to its next effect.
        gate_tx.send(()).unwrap();
        let lost = seen_rx.recv().unwrap();
        ending.join().unwrap();
        eprintln!(
            "old execution's blocking work: is_lease_lost() = {lost}; effects = {}",
            EFFECTS.load(Ordering::SeqCst)
        );
        assert!(
            lost,
            "the operation was taken over by another process, yet the old execution's op says its lease holds"
        );
        assert_eq!(EFFECTS.load(Ordering::SeqCst), 1, "the effect ran twice");
    }

    #[test]
    fn blocking_work_of_an_execution_whose_runtime_ended_is_told_its_lease_is_lost() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("idem.db");
        scenario(
            || async {
                let s = SqliteStore::open(&path).await.unwrap();
                s.migrate().await.unwrap();
                s
            },
            "k1",
        );
    }

    #[test]
    fn postgres_blocking_work_of_an_execution_whose_runtime_ended_is_told_its_lease_is_lost() {
        let Some(url) = idem_testkit::pg_url() else { return };
        let schema = multi_thread().block_on(idem_testkit::pg_schema(&url));
        scenario(|| idem_testkit::pg_store_in(&url, &schema, 5), "k1");
    }
}

static GONE_RUNS: AtomicU32 = AtomicU32::new(0);

#[idempotent(scope = "probe.gone", lock_timeout = "300ms")]
async fn gone(op: Operation) -> (StatusCode, String) {
    let n = GONE_RUNS.fetch_add(1, Ordering::SeqCst) + 1;
    (
        StatusCode::CREATED,
        format!("run {n}, attempt {}, takeover {}", op.attempt(), op.is_takeover()),
    )
}

/// README, "Where idem departs from the contract": on PostgreSQL as on
/// SQLite, a client that goes away during its reservation, on a
/// current-thread runtime that is then no longer driven, leaves its key
/// locked until its lock timeout (the rest of the request is the task of
/// that runtime, which never runs it). Nothing runs under that lock: the
/// retry from another runtime gets 409, then takes the operation over, and
/// the handler runs once.
#[test]
fn postgres_a_client_gone_during_its_reservation_on_a_runtime_no_longer_driven() {
    use idem_runtime::pause;
    let Some(url) = idem_testkit::pg_url() else { return };
    let key = idem_testkit::unique("gone");
    let idle = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let schema = idle.block_on(idem_testkit::pg_schema(&url));
    let app = |store: idem::PgStore| {
        Router::new()
            .route("/gone", post(gone))
            .layer(Idem::new(store).single_tenant().layer())
    };
    idle.block_on(async {
        let app = app(idem_testkit::pg_store_in(&url, &schema, 4).await);
        let mut armed = pause::arm(pause::RESERVE_AFTER, &key);
        let mut request = Box::pin(app.oneshot(req("/gone", &key)));
        tokio::select! {
            _ = &mut request => panic!("answered before its reservation's pause"),
            () = armed.reached() => {}
        }
        // The client goes away with its reservation committed.
        drop(request);
        armed.resume();
    });
    // `idle` lives on, not driven.
    let other = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    other.block_on(async {
        let app = app(idem_testkit::pg_store_in(&url, &schema, 4).await);
        let first = app.clone().oneshot(req("/gone", &key)).await.unwrap();
        assert_eq!(first.status(), StatusCode::CONFLICT, "the key is locked");
        let until = std::time::Instant::now() + Duration::from_secs(10);
        let answer = loop {
            let r = app.clone().oneshot(req("/gone", &key)).await.unwrap();
            if r.status() != StatusCode::CONFLICT || std::time::Instant::now() > until {
                break r;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let status = answer.status();
        let body = axum::body::to_bytes(answer.into_body(), 1 << 16).await.unwrap();
        assert_eq!(
            (status, String::from_utf8_lossy(&body).into_owned()),
            (StatusCode::CREATED, "run 1, attempt 2, takeover true".to_owned())
        );
    });
    assert_eq!(GONE_RUNS.load(Ordering::SeqCst), 1);
    drop(idle);
}
