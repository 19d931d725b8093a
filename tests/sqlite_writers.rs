//! SQLite writers of one process queue for one write permit, first come
//! first served, instead of racing into SQLite's busy handler; writers of
//! other processes are still waited for by the busy timeout.

use idem::store::{RecordId, Reservation, ReserveRequest, StoredResponse};
use idem::{IdempotencyStore, SqliteStore};
use idem_runtime::pause;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::Connection as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

const LONG: Duration = Duration::from_secs(3600);

fn id(key: &str) -> RecordId {
    RecordId::new("t", "writers", key)
}

fn req<'a>(id: &'a RecordId, token: &'a str) -> ReserveRequest<'a> {
    ReserveRequest {
        id,
        fingerprint: "F",
        token,
        ttl: LONG,
        lock_timeout: LONG,
    }
}

fn answer(tag: &str) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![],
        body: Some(tag.as_bytes().to_vec()),
    }
}

/// The answer stored for `key` (its own name) is replayed.
async fn assert_replays(store: &SqliteStore, key: &str) {
    match store.reserve(req(&id(key), idem_testkit::token())).await.unwrap() {
        Reservation::Completed(r) => assert_eq!(r.body.as_deref(), Some(key.as_bytes())),
        other => panic!("{key} is not replayed: {other:?}"),
    }
}

/// Takes a fresh key and says its lock token.
async fn reserved(store: &SqliteStore, key: &str) -> &'static str {
    let token = idem_testkit::token();
    match store.reserve(req(&id(key), token)).await.unwrap() {
        Reservation::Reserved(_) => token,
        other => panic!("{key} not taken: {other:?}"),
    }
}

/// The in-memory database of `SqliteStore::new`'s documentation.
async fn in_memory_store() -> SqliteStore {
    idem_testkit::sqlite_in_memory_store().await
}

/// A fresh key reserved, then completed, within `bound` in all.
async fn served_within(store: &SqliteStore, bound: Duration) {
    let started = Instant::now();
    let key = idem_testkit::unique("after");
    let token = reserved(store, &key).await;
    store.complete(&id(&key), token, &answer(&key)).await.unwrap();
    assert!(
        started.elapsed() < bound,
        "the write waited {:?}",
        started.elapsed()
    );
}

/// A reservation of a fresh key stopped with the write permit (and SQLite's
/// write lock) held, before its commit.
async fn hold_the_permit(store: &SqliteStore) -> (pause::Pause, tokio::task::JoinHandle<()>) {
    let key = idem_testkit::unique("holder");
    let mut paused = pause::arm(pause::SQLITE_RESERVE_BEFORE_COMMIT, &key);
    let holder = {
        let store = store.clone();
        tokio::spawn(async move {
            let _ = store.reserve(req(&id(&key), idem_testkit::token())).await;
        })
    };
    tokio::time::timeout(Duration::from_secs(20), paused.reached())
        .await
        .expect("the holder reaches its commit");
    (paused, holder)
}

/// With no busy timeout at all, a writer of this process that met SQLite's
/// write lock taken would fail at once (`SQLITE_BUSY`, a 503): 32 concurrent
/// first requests only pass if this process's writers never meet it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_first_requests_queue_instead_of_meeting_the_write_lock() {
    let dir = tempfile::tempdir().unwrap();
    let options = SqliteConnectOptions::new()
        .filename(dir.path().join("idem.db"))
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::ZERO);
    let pool = SqlitePoolOptions::new()
        .max_connections(8)
        .connect_with(options)
        .await
        .unwrap();
    let store = SqliteStore::new(pool);
    store.migrate().await.unwrap();

    for round in 0..3 {
        let tasks: Vec<_> = (0..32)
            .map(|i| {
                let store = store.clone();
                tokio::spawn(async move {
                    let key = idem_testkit::unique(&format!("k{round}_{i}"));
                    let (id, token) = (id(&key), idem_testkit::token());
                    match store.reserve(req(&id, token)).await? {
                        Reservation::Reserved(_) => {}
                        other => panic!("a fresh key not taken: {other:?}"),
                    };
                    store.complete(&id, token, &answer(&key)).await?;
                    match store.reserve(req(&id, idem_testkit::token())).await? {
                        Reservation::Completed(r) => assert_eq!(r.body.as_deref(), Some(key.as_bytes())),
                        other => panic!("not replayed: {other:?}"),
                    }
                    Ok::<_, idem::StoreError>(())
                })
            })
            .collect();
        for task in tasks {
            let result = task.await.unwrap();
            assert!(result.is_ok(), "round {round}: a writer failed: {result:?}");
        }
    }
}

/// Writers take the permit in the order they asked for it: with the permit
/// held, A asks, then B; once it is free, A's write commits before B's
/// (SQLite's busy handler would favour B, which sleeps in shorter steps).
#[tokio::test]
async fn writers_take_the_write_lock_first_come_first_served() {
    let (store, _dir) = idem_testkit::sqlite_store().await;
    // Every update of a record, in commit order.
    sqlx::raw_sql(
        "CREATE TABLE write_log (n INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT NOT NULL); \
         CREATE TRIGGER log_writes AFTER UPDATE ON idempotency_keys \
         BEGIN INSERT INTO write_log (key) VALUES (NEW.key); END;",
    )
    .execute(store.pool())
    .await
    .unwrap();
    let (ka, kb) = (idem_testkit::unique("a"), idem_testkit::unique("b"));
    let (ta, tb) = (reserved(&store, &ka).await, reserved(&store, &kb).await);

    let (paused, holder) = hold_the_permit(&store).await;
    let write = |key: String, token: &'static str| {
        let store = store.clone();
        tokio::spawn(async move { store.complete(&id(&key), token, &answer(&key)).await })
    };
    let a = write(ka.clone(), ta);
    // This runtime has one thread: A has run up to its wait while this
    // task sleeps, and is in line before B asks.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!a.is_finished(), "A wrote while the permit was held");
    let b = write(kb.clone(), tb);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!b.is_finished(), "B wrote while the permit was held");

    paused.resume();
    holder.await.unwrap();
    a.await.unwrap().unwrap();
    b.await.unwrap().unwrap();
    let order: Vec<String> = sqlx::query_scalar("SELECT key FROM write_log WHERE key IN (?, ?) ORDER BY n")
        .bind(&ka)
        .bind(&kb)
        .fetch_all(store.pool())
        .await
        .unwrap();
    assert_eq!(order, [ka, kb], "B's write committed before A's");
}

/// A writer given up on while in line (the operation's timeout) fails with
/// `Unavailable`, a 503, and does not keep the permit.
#[tokio::test]
async fn a_writer_in_line_past_its_timeout_is_unavailable_and_the_line_moves_on() {
    let (store, _dir) = idem_testkit::sqlite_store().await;
    let key = idem_testkit::unique("late");
    let token = reserved(&store, &key).await;
    let impatient = store.clone().with_timeout(Duration::from_millis(300));

    let (paused, holder) = hold_the_permit(&store).await;
    let started = Instant::now();
    let err = impatient
        .complete(&id(&key), token, &answer("late"))
        .await
        .unwrap_err();
    assert!(err.is_unavailable(), "{err:?}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "waited {:?}",
        started.elapsed()
    );

    paused.resume();
    holder.await.unwrap();
    impatient
        .complete(&id(&key), token, &answer("late"))
        .await
        .unwrap();
    match store
        .reserve(req(&id(&key), idem_testkit::token()))
        .await
        .unwrap()
    {
        Reservation::Completed(r) => assert_eq!(r.body.as_deref(), Some(&b"late"[..])),
        other => panic!("not completed: {other:?}"),
    }
}

/// Another process's writer (here another pool on the same file, outside
/// this store's line) is not failed against but waited for, by SQLite's
/// busy timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_of_another_process_is_waited_for() {
    let (store, dir) = idem_testkit::sqlite_store().await;
    let options = SqliteConnectOptions::new()
        .filename(dir.path().join("idem.db"))
        .journal_mode(SqliteJournalMode::Wal);
    let mut other = sqlx::SqliteConnection::connect_with(&options).await.unwrap();
    sqlx::raw_sql("BEGIN IMMEDIATE")
        .execute(&mut other)
        .await
        .unwrap();

    let key = idem_testkit::unique("waits");
    let first = {
        let store = store.clone();
        let key = key.clone();
        tokio::spawn(async move {
            let (id, token) = (id(&key), idem_testkit::token());
            let started = Instant::now();
            let taken = store.reserve(req(&id, token)).await;
            let waited = started.elapsed();
            assert!(matches!(taken, Ok(Reservation::Reserved(_))), "{taken:?}");
            store.complete(&id, token, &answer(&key)).await.unwrap();
            waited
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !first.is_finished(),
        "took the key while another process held the write lock"
    );
    sqlx::raw_sql("COMMIT").execute(&mut other).await.unwrap();

    let waited = first.await.unwrap();
    assert!(waited >= Duration::from_millis(250), "waited only {waited:?}");
    assert_replays(&store, &key).await;
}

/// The in-memory database of `SqliteStore::new`'s documentation (a pool of
/// one connection): 20 concurrent reservations of one key get one lock and
/// 19 answers "in progress", never a store error.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_in_memory_database_of_one_connection_serves_concurrent_reservations() {
    let store = std::sync::Arc::new(in_memory_store().await);
    for round in 0..5 {
        let tasks: Vec<_> = (0..20)
            .map(|_| {
                let store = store.clone();
                tokio::spawn(async move {
                    let id = RecordId::new("t", "s", format!("k{round}"));
                    store
                        .reserve(ReserveRequest {
                            id: &id,
                            fingerprint: "F",
                            token: idem_testkit::token(),
                            ttl: Duration::from_secs(3600),
                            lock_timeout: Duration::from_secs(3600),
                        })
                        .await
                })
            })
            .collect();
        let (mut reserved, mut in_progress, mut other) = (0, 0, Vec::new());
        for t in tasks {
            match t.await.unwrap() {
                Ok(Reservation::Reserved(_)) => reserved += 1,
                Ok(Reservation::InProgress { .. }) => in_progress += 1,
                answer => other.push(format!("{answer:?}")),
            }
        }
        assert_eq!((reserved, in_progress), (1, 19), "round {round}: {other:?}");
    }
}

/// Completions that queue while the write lock is held are written in one
/// transaction when it is free. A completion whose statement fails ends its
/// group's transaction where it fails: those before it are answered only
/// with that transaction's outcome (never "done" for a write rolled back),
/// and those after it go on in a transaction of their own. After a
/// transaction that SQLite rolled back by itself, sqlx would still count it
/// open on its connection (and every `BEGIN` there would fail); closing
/// that connection instead would lose a database in memory. On the
/// documented in-memory store of one connection, everything recorded
/// before stays, and the store keeps serving.
#[tokio::test]
async fn a_failed_write_in_a_group_fails_only_what_its_transaction_held() {
    for (raise, before_committed) in [("ROLLBACK", false), ("ABORT", true)] {
        let store = in_memory_store().await;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE TRIGGER poison BEFORE UPDATE ON idempotency_keys \
             WHEN NEW.key LIKE 'poison%' AND NEW.state = 'completed' \
             BEGIN SELECT RAISE({raise}, 'poisoned'); END;"
        )))
        .execute(store.pool())
        .await
        .unwrap();
        let recorded = idem_testkit::unique("recorded");
        let recorded_token = reserved(&store, &recorded).await;
        store
            .complete(&id(&recorded), recorded_token, &answer(&recorded))
            .await
            .unwrap();
        let keys = [
            idem_testkit::unique("before"),
            idem_testkit::unique("poison"),
            idem_testkit::unique("after"),
        ];
        let mut tokens = Vec::new();
        for key in &keys {
            tokens.push(reserved(&store, key).await);
        }
        let ids: Vec<RecordId> = keys.iter().map(|k| id(k)).collect();
        let bodies: Vec<StoredResponse> = keys.iter().map(|k| answer(k)).collect();

        // The three queue, in this order, while the lock is held.
        let (paused, holder) = hold_the_permit(&store).await;
        let mut writes: Vec<_> = (0..3)
            .map(|i| store.complete(&ids[i], tokens[i], &bodies[i]))
            .collect();
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        for write in &mut writes {
            assert!(write.as_mut().poll(&mut cx).is_pending());
        }
        paused.resume();
        holder.await.unwrap();
        let mut outcomes = Vec::new();
        for write in writes {
            outcomes.push(write.await);
        }
        assert_eq!(outcomes[0].is_ok(), before_committed, "{raise}: {outcomes:?}");
        assert!(outcomes[1].is_err(), "{raise}: {outcomes:?}");
        assert!(outcomes[2].is_ok(), "{raise}: {outcomes:?}");

        // What each was answered is what the table holds.
        for (i, key) in keys.iter().enumerate() {
            let state: String = sqlx::query_scalar("SELECT state FROM idempotency_keys WHERE key = ?")
                .bind(key)
                .fetch_one(store.pool())
                .await
                .unwrap();
            let completed = state == "completed";
            assert_eq!(completed, outcomes[i].is_ok(), "{raise}: {key} is {state}");
        }
        // What was recorded before is still replayed, and the one
        // connection still serves writes.
        assert_replays(&store, &recorded).await;
        let key = idem_testkit::unique("later");
        let token = reserved(&store, &key).await;
        store.complete(&id(&key), token, &answer(&key)).await.unwrap();
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A multi-thread runtime, whose workers drive its tasks whatever its
/// callers do.
fn two_workers() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// A store outlives the runtime of a write that started a group (here its
/// future polled once, then the runtime dropped): the group's leader was
/// not on that runtime, and the writes queued later, from another runtime,
/// are served at once rather than at their timeout. (The write permit is
/// held meanwhile, by a reservation paused before its commit, so that the
/// group is still under way when the runtime goes: unheld, its leader on
/// the writers' thread could finish it within that first poll.)
#[test]
fn a_write_whose_runtime_went_holds_no_later_write_back() {
    let setup = runtime();
    let (store, _dir) = setup.block_on(idem_testkit::sqlite_store());
    let store = store.with_timeout(Duration::from_secs(30));
    let (paused, holder) = setup.block_on(hold_the_permit(&store));
    let first = runtime();
    first.block_on(async {
        let (never, body) = (id("never-reserved"), answer("x"));
        let mut write = store.complete(&never, "token", &body);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(write.as_mut().poll(&mut cx).is_pending());
    });
    drop(first);
    drop(paused);
    setup.block_on(holder).unwrap();
    runtime().block_on(served_within(&store, Duration::from_secs(5)));
}

/// A write from another runtime queued behind a group that a write from
/// `first` started, paused before its commit; then `first` shuts down and
/// the group goes on. The queued write's answer, within 5 s (not at its
/// timeout), and the store, its key and token.
fn queued_behind_a_group_whose_runtime_shuts_down(
    first: tokio::runtime::Runtime,
) -> (
    Result<(), idem::StoreError>,
    SqliteStore,
    tempfile::TempDir,
    String,
    &'static str,
) {
    let setup = runtime();
    let (store, dir) = setup.block_on(idem_testkit::sqlite_store());
    let store = store.with_timeout(Duration::from_secs(30));
    let key = idem_testkit::unique("queued");
    let token = setup.block_on(reserved(&store, &key));
    let (paused, _holder) = first.block_on(hold_the_permit(&store));
    let queued = runtime().block_on(async {
        let (queued, body) = (id(&key), answer(&key));
        let mut write = store.complete(&queued, token, &body);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(write.as_mut().poll(&mut cx).is_pending());
        first.shutdown_background();
        drop(paused);
        let started = Instant::now();
        let written = write.await;
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "waited {:?}",
            started.elapsed()
        );
        written
    });
    (queued, store, dir, key, token)
}

/// A leader that goes with its (multi-thread) runtime while a group runs
/// answers the writes queued behind it, from another runtime, at once with
/// an error, not at their timeout; the next write starts a leader of its
/// own.
#[test]
fn a_leader_lost_with_its_runtime_answers_the_writes_queued_behind_it() {
    let first = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (queued, store, _dir, key, token) = queued_behind_a_group_whose_runtime_shuts_down(first);
    assert!(queued.is_err(), "answered as done though never written");
    runtime().block_on(async {
        store.complete(&id(&key), token, &answer(&key)).await.unwrap();
        assert_replays(&store, &key).await;
    });
}

/// A group started from a current-thread runtime is led from the writers'
/// thread, not from that runtime: it outlives it, and the write queued
/// behind it is written.
#[test]
fn a_group_outlives_the_current_thread_runtime_of_the_write_that_started_it() {
    let (queued, store, _dir, key, _) = queued_behind_a_group_whose_runtime_shuts_down(runtime());
    queued.unwrap();
    runtime().block_on(assert_replays(&store, &key));
}

/// A write from a current-thread runtime that is driven only while one of
/// its calls waits (`block_on`), then left idle: once its caller is
/// answered, no leader of the store's groups stays on that runtime waiting
/// for the write permit (it would get the permit in its turn and keep it,
/// and every other writer would wait for its timeout). Here another
/// writer holds the permit for a moment (a trigger makes its update slow)
/// right when the idle runtime's group is done.
#[test]
fn no_leader_waits_on_a_runtime_that_is_no_longer_driven() {
    let main = two_workers();
    let (store, _dir) = main.block_on(idem_testkit::sqlite_store());
    let store = store.with_timeout(Duration::from_secs(3));
    let beating = idem_testkit::unique("beating");
    let beating_token = main.block_on(reserved(&store, &beating));
    main.block_on(
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE TRIGGER slow BEFORE UPDATE ON idempotency_keys WHEN NEW.key = '{beating}' \
             BEGIN SELECT count(*) FROM (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL \
             SELECT x + 1 FROM c WHERE x < 300000) SELECT x FROM c); END;"
        )))
        .execute(store.pool()),
    )
    .unwrap();

    let key = idem_testkit::unique("sync");
    let mut paused = pause::arm(pause::SQLITE_RESERVE_BEFORE_COMMIT, &key);
    let sync = {
        let store = store.clone();
        let key = key.clone();
        std::thread::spawn(move || {
            let idle = runtime();
            let answer = idle.block_on(store.reserve(req(&id(&key), idem_testkit::token())));
            // Kept, and not driven, until the end.
            (idle, answer)
        })
    };
    // It yields the heartbeat's task, which runs on while the thread of the
    // idle runtime is joined.
    #[allow(clippy::async_yields_async)]
    let heartbeat = main.block_on(async {
        paused.reached().await;
        // A heartbeat of another request, in line for the permit (its
        // first poll queues it) behind the paused group.
        let mut heartbeat = Box::pin({
            let store = store.clone();
            let beating = beating.clone();
            async move { store.extend_lock(&id(&beating), beating_token, LONG).await }
        });
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(std::future::Future::poll(heartbeat.as_mut(), &mut cx).is_pending());
        let heartbeat = tokio::spawn(heartbeat);
        paused.resume();
        heartbeat
    });
    let (idle, answer) = sync.join().unwrap();
    assert!(matches!(answer, Ok(Reservation::Reserved(_))), "{answer:?}");
    main.block_on(async {
        heartbeat.await.unwrap().unwrap();
        let started = Instant::now();
        let later = idem_testkit::unique("later");
        let token = reserved(&store, &later).await;
        store.extend_lock(&id(&later), token, LONG).await.unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "the store's writers waited {:?}",
            started.elapsed()
        );
    });
    drop(idle);
}

/// A write from a current-thread runtime whose caller gave up on it (its
/// timeout) while it waited in line, the runtime then left idle, is first
/// in line when the write lock frees: the writes behind it are served all
/// the same, well within their bound. (A leader of the store's groups on
/// that runtime would never run, and every writer behind it would wait for
/// its timeout.)
#[test]
fn a_write_given_up_in_line_on_an_idle_runtime_holds_no_writer_back() {
    let main = two_workers();
    let (store, _dir) = main.block_on(idem_testkit::sqlite_store());
    let patient = store.clone().with_timeout(Duration::from_secs(10));
    let hasty = store.with_timeout(Duration::from_millis(300));
    let key = idem_testkit::unique("behind");
    let token = main.block_on(reserved(&patient, &key));
    let (paused, _holder) = main.block_on(hold_the_permit(&patient));
    let gave_up = {
        let hasty = hasty.clone();
        std::thread::spawn(move || {
            let idle = runtime();
            let gone = id(&idem_testkit::unique("gone"));
            let answer = idle.block_on(hasty.complete(&gone, "token", &answer("gone")));
            // Kept, and not driven, until the end.
            (idle, answer)
        })
    };
    let (idle, gave_up) = gave_up.join().unwrap();
    assert!(gave_up.is_err(), "{gave_up:?}");
    main.block_on(async {
        let (behind, body) = (id(&key), answer(&key));
        let mut write = patient.complete(&behind, token, &body);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        // Its first poll queues it, behind the write given up on.
        assert!(write.as_mut().poll(&mut cx).is_pending());
        drop(paused);
        let started = Instant::now();
        write.await.unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "the write behind waited {:?}",
            started.elapsed()
        );
        assert_replays(&patient, &key).await;
    });
    drop(idle);
}

/// The record of `key`, as its state and lock token.
async fn row(store: &SqliteStore, key: &str) -> Option<(String, Option<String>)> {
    sqlx::query_as("SELECT state, lock_token FROM idempotency_keys WHERE key = ?")
        .bind(key)
        .fetch_optional(store.pool())
        .await
        .unwrap()
}

/// A reservation given up on in line (its 300 ms bound, the write permit
/// held) by a caller on a current-thread runtime, which is then kept but
/// no longer driven; that caller runs on a thread of its own, or, with
/// `via_blocking_pool`, on a multi-thread runtime's blocking pool (where
/// its future is made in that runtime's context). Once the write lock
/// frees, the key it took anyway is given back (undone on the writers'
/// thread, not on the idle runtime), so the client's retry takes it,
/// rather than meeting a lock that no execution holds until its lock
/// timeout.
fn given_up_in_line_on_an_idle_runtime_leaves_no_lock(via_blocking_pool: bool) {
    let main = two_workers();
    let (store, _dir) = main.block_on(idem_testkit::sqlite_store());
    let patient = store.clone().with_timeout(Duration::from_secs(10));
    let hasty = store.with_timeout(Duration::from_millis(300));
    let (paused, _holder) = main.block_on(hold_the_permit(&patient));
    let gone = idem_testkit::unique("gone");
    let caller = {
        let (hasty, gone) = (hasty.clone(), gone.clone());
        move || {
            let idle = runtime();
            let answer = idle.block_on(hasty.reserve(req(&id(&gone), "hasty-token")));
            // Kept, and not driven, until the end.
            (idle, answer)
        }
    };
    let (idle, answer) = if via_blocking_pool {
        main.block_on(main.spawn_blocking(caller)).unwrap()
    } else {
        std::thread::spawn(caller).join().unwrap()
    };
    assert!(answer.is_err(), "{answer:?}");
    main.block_on(async {
        drop(paused);
        // A write queued after it: once it is answered, the reservation's
        // group has committed (it took the key: its undo still waited for
        // its answer), and the key is being given back.
        let after = idem_testkit::unique("after");
        reserved(&patient, &after).await;
        let until = Instant::now() + Duration::from_secs(10);
        while row(&patient, &gone).await.is_some() && Instant::now() < until {
            tokio::task::yield_now().await;
        }
        assert_eq!(row(&patient, &gone).await, None, "a lock nobody holds stayed");
        let retry = patient.reserve(req(&id(&gone), "retry-token")).await;
        assert!(matches!(retry, Ok(Reservation::Reserved(_))), "{retry:?}");
    });
    drop(idle);
}

#[test]
fn a_reservation_given_up_in_line_on_an_idle_runtime_leaves_no_lock() {
    given_up_in_line_on_an_idle_runtime_leaves_no_lock(false);
}

/// Where its undo runs is decided where the reservation is polled, not
/// where its future is made.
#[test]
fn a_reservation_made_on_one_runtime_and_driven_on_another_leaves_no_lock() {
    given_up_in_line_on_an_idle_runtime_leaves_no_lock(true);
}

/// A release (as an execution's task runs it) waiting in line for the write
/// permit on a current-thread runtime that is then left idle: it runs on
/// the writers' thread, so it does not get the permit there and keep it;
/// the writes after it are served at once.
#[test]
fn a_release_in_line_on_an_idle_runtime_holds_no_writer_back() {
    let main = two_workers();
    let (store, _dir) = main.block_on(idem_testkit::sqlite_store());
    let store = store.with_timeout(Duration::from_secs(5));
    let released = idem_testkit::unique("released");
    let token = main.block_on(reserved(&store, &released));
    let (paused, _holder) = main.block_on(hold_the_permit(&store));
    let idle = {
        let (store, released) = (store.clone(), released.clone());
        std::thread::spawn(move || {
            let idle = runtime();
            idle.block_on(async move {
                let task = tokio::spawn(async move { store.release(&id(&released), token).await });
                // The spawned release runs (and queues) at the first yield.
                for _ in 0..3 {
                    tokio::task::yield_now().await;
                }
                assert!(!task.is_finished());
            });
            // Kept, and not driven, until the end.
            idle
        })
        .join()
        .unwrap()
    };
    main.block_on(async {
        drop(paused);
        served_within(&store, Duration::from_secs(2)).await;
        served_within(&store, Duration::from_secs(2)).await;
        // The release itself ran to its end.
        let until = Instant::now() + Duration::from_secs(10);
        while row(&store, &released).await.and_then(|r| r.1).is_some() && Instant::now() < until {
            tokio::task::yield_now().await;
        }
        assert_eq!(row(&store, &released).await.map(|r| r.1), Some(None));
    });
    drop(idle);
}

/// A reservation answered from its read (here a conflict) on a
/// current-thread runtime then left idle, on the documented one-connection
/// database in memory: the connection goes back to its pool all the same
/// (sqlx gives it back from a task, which runs on the writers' thread), and
/// the next write is served at once.
#[test]
fn a_read_on_an_idle_runtime_gives_its_connection_back() {
    let main = two_workers();
    let store = main
        .block_on(in_memory_store())
        .with_timeout(Duration::from_secs(3));
    let key = idem_testkit::unique("held");
    main.block_on(reserved(&store, &key));
    let idle = {
        let (store, key) = (store.clone(), key.clone());
        std::thread::spawn(move || {
            let idle = runtime();
            let read = idle.block_on(store.reserve(req(&id(&key), idem_testkit::token())));
            assert!(matches!(read, Ok(Reservation::InProgress { .. })), "{read:?}");
            // Kept, and not driven, until the end.
            idle
        })
        .join()
        .unwrap()
    };
    main.block_on(served_within(&store, Duration::from_secs(2)));
    drop(idle);
}

/// A multi-thread runtime that leads a group shuts down while the group
/// runs (paused before its commit), on the documented one-connection
/// database in memory: the group's connection goes back to the pool (from
/// the writers' thread), not closed with that runtime's tasks, so the
/// database and its answers live on.
#[test]
fn a_leaders_runtime_shutting_down_loses_no_database_in_memory() {
    let setup = runtime();
    let store = setup
        .block_on(in_memory_store())
        .with_timeout(Duration::from_secs(5));
    let key = idem_testkit::unique("paid");
    setup.block_on(async {
        let token = reserved(&store, &key).await;
        store.complete(&id(&key), token, &answer(&key)).await.unwrap();
    });
    let first = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (paused, _holder) = first.block_on(hold_the_permit(&store));
    // Its tasks dropped, the paused leader among them, before it goes on.
    first.shutdown_timeout(Duration::from_secs(10));
    drop(paused);
    runtime().block_on(async {
        assert_replays(&store, &key).await;
        served_within(&store, Duration::from_secs(2)).await;
    });
}

/// A handler's own SQLite transaction, on a current-thread runtime left idle
/// once it answered, on the documented one-connection database in memory:
/// the transaction's connection goes back to the pool (from the writers'
/// thread), so other callers are served, and the answer is replayed.
mod handler_transaction_on_an_idle_runtime {
    use super::*;
    use axum::http::{Request, StatusCode};
    use axum::routing::post;
    use axum::Router;
    use idem::{idempotent, Idem, Operation};
    use tower::ServiceExt as _;

    #[idempotent(scope = "writers.tx")]
    async fn pay(op: Operation) -> Result<StatusCode, StatusCode> {
        let mut conn = op
            .sqlite_transaction()
            .await
            .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
        sqlx::query("INSERT INTO effects (id) VALUES (?1)")
            .bind(op.derived_key("effect"))
            .execute(&mut *conn)
            .await
            .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
        Ok(StatusCode::CREATED)
    }

    fn paid(key: &str) -> Request<axum::body::Body> {
        Request::post("/pay")
            .header("idempotency-key", key)
            .body(axum::body::Body::empty())
            .unwrap()
    }

    #[test]
    fn gives_its_connection_back() {
        let main = two_workers();
        let store = main
            .block_on(in_memory_store())
            .with_timeout(Duration::from_secs(3));
        main.block_on(sqlx::query("CREATE TABLE effects (id TEXT PRIMARY KEY)").execute(store.pool()))
            .unwrap();
        let app = Router::new()
            .route("/pay", post(pay))
            .layer(Idem::new(store.clone()).single_tenant().layer());
        let key = idem_testkit::unique("pay");
        let idle = {
            let (app, key) = (app.clone(), key.clone());
            std::thread::spawn(move || {
                let idle = runtime();
                let response = idle.block_on(app.oneshot(paid(&key))).unwrap();
                assert_eq!(response.status(), StatusCode::CREATED);
                // Kept, and not driven, until the end.
                idle
            })
            .join()
            .unwrap()
        };
        main.block_on(served_within(&store, Duration::from_secs(2)));
        drop(idle);
        main.block_on(async {
            let replay = app.oneshot(paid(&key)).await.unwrap();
            assert_eq!(replay.status(), StatusCode::CREATED);
            assert!(replay.headers().contains_key("idempotent-replayed"));
            let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
                .fetch_one(store.pool())
                .await
                .unwrap();
            assert_eq!(effects, 1);
        });
    }
}

/// Where a failed group's leader is held when its runtime shuts down: the
/// `k`-th of SQLite's progress calls after SQLite ended the group's
/// transaction by itself (a trigger's `RAISE(ROLLBACK)` here, a full disk
/// or an I/O error in life), counted until the rollback that puts the
/// connection right (`settle`) is done.
#[derive(Default)]
struct Cut {
    /// 1: armed; 2: SQLite ended the transaction, counting; 3: the
    /// connection's final rollback came.
    phase: AtomicUsize,
    calls: AtomicUsize,
    calls_to_the_final_rollback: AtomicUsize,
    hold_at: AtomicUsize,
    reached: Mutex<Option<mpsc::Sender<()>>>,
    released: Mutex<Option<mpsc::Receiver<()>>>,
}

/// A failed group whose leader's runtime shuts down with sqlx's worker
/// held at `cut`'s point (`hold_at` 0: never held, the group ends), then
/// the pool's one connection checked: no transaction left open, a dropped
/// transaction rolled back, a write outside a transaction and the store's
/// next reservation committed (seen from another connection). Not held,
/// it answers how many progress calls came up to the final rollback.
async fn a_failed_group_cut_at(hold_at: usize) -> Result<usize, String> {
    use sqlx::sqlite::SqlitePool;
    let dir = tempfile::tempdir().unwrap();
    let file = SqliteConnectOptions::new()
        .filename(dir.path().join("groups.db"))
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(30));
    let cut = Arc::new(Cut::default());
    cut.hold_at.store(hold_at, Ordering::SeqCst);
    let (reached, held) = mpsc::channel::<()>();
    let (release, released) = mpsc::channel::<()>();
    *cut.reached.lock().unwrap() = Some(reached);
    *cut.released.lock().unwrap() = Some(released);
    let hooks = cut.clone();
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .after_connect(move |conn, _| {
            let cut = hooks.clone();
            Box::pin(async move {
                let mut handle = conn.lock_handle().await?;
                let on_rollback = cut.clone();
                handle.set_rollback_hook(move || match on_rollback.phase.load(Ordering::SeqCst) {
                    1 => on_rollback.phase.store(2, Ordering::SeqCst),
                    2 => {
                        let calls = on_rollback.calls.load(Ordering::SeqCst);
                        on_rollback
                            .calls_to_the_final_rollback
                            .store(calls, Ordering::SeqCst);
                        on_rollback.phase.store(3, Ordering::SeqCst);
                    }
                    _ => {}
                });
                handle.set_progress_handler(1, move || {
                    if cut.phase.load(Ordering::SeqCst) == 2
                        && cut.calls.fetch_add(1, Ordering::SeqCst) + 1 == cut.hold_at.load(Ordering::SeqCst)
                    {
                        let reached = cut.reached.lock().unwrap().take();
                        let released = cut.released.lock().unwrap().take();
                        let _ = reached.map(|r| r.send(()));
                        let _ = released.map(|r| r.recv_timeout(Duration::from_secs(30)));
                    }
                    true
                });
                Ok(())
            })
        })
        .connect_with(file.clone())
        .await
        .unwrap();
    let store = SqliteStore::new(pool.clone()).with_timeout(Duration::from_secs(1));
    store.migrate().await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE audit (note TEXT NOT NULL); \
         CREATE TRIGGER boom BEFORE INSERT ON idempotency_keys WHEN NEW.key LIKE 'boom%' \
         BEGIN SELECT RAISE(ROLLBACK, 'boom'); END",
    )
    .execute(&pool)
    .await
    .unwrap();

    cut.phase.store(1, Ordering::SeqCst);
    // The group's leader runs on a runtime of its own.
    let doomed = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (done, answered) = mpsc::channel::<()>();
    let boom = store.clone();
    doomed.spawn(async move {
        let id = id("boom-1");
        let _ = boom.reserve(req(&id, "tok-boom")).await;
        let _ = done.send(());
    });
    let waited = if hold_at == 0 { answered } else { held };
    tokio::task::spawn_blocking(move || waited.recv_timeout(Duration::from_secs(20)))
        .await
        .unwrap()
        .map_err(|_| format!("not held at {hold_at}, nor answered"))?;
    tokio::task::spawn_blocking(move || doomed.shutdown_timeout(Duration::from_secs(10)))
        .await
        .unwrap();
    if hold_at == 0 {
        return Ok(cut.calls_to_the_final_rollback.load(Ordering::SeqCst));
    }
    release.send(()).unwrap();

    let seen_elsewhere = |sql: &'static str| {
        let file = file.clone();
        async move {
            let mut other = sqlx::SqliteConnection::connect_with(&file).await.unwrap();
            let n: i64 = sqlx::query_scalar(sql).fetch_one(&mut other).await.unwrap();
            n
        }
    };
    let open = |pool: SqlitePool| async move {
        let mut conn = pool.acquire().await.unwrap();
        let began = sqlx::raw_sql("BEGIN").execute(&mut *conn).await.is_ok();
        if began {
            sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await.unwrap();
        }
        !began
    };
    let mut wrong = Vec::new();
    if open(pool.clone()).await {
        wrong.push("a transaction was left open");
    }
    if !idem_testkit::dropped_transaction_rolls_back(&pool).await {
        wrong.push("a dropped transaction was not rolled back");
    }
    sqlx::query("INSERT INTO audit (note) VALUES ('kept')")
        .execute(&pool)
        .await
        .unwrap();
    if seen_elsewhere("SELECT count(*) FROM audit").await != 1 {
        wrong.push("a write outside a transaction did not commit");
    }
    let after = id("after");
    let reserved =
        tokio::time::timeout(Duration::from_secs(5), store.reserve(req(&after, "tok-after"))).await;
    if !matches!(reserved, Ok(Ok(Reservation::Reserved(_))))
        || seen_elsewhere("SELECT count(*) FROM idempotency_keys WHERE key = 'after'").await != 1
    {
        wrong.push("the store's next reservation did not commit");
    }
    pool.close().await;
    if wrong.is_empty() {
        Ok(hold_at)
    } else {
        Err(format!("held at {hold_at}: {wrong:?}"))
    }
}

/// A group whose commit fails is rolled back on its connection; when the
/// leader's runtime shuts down at any point from SQLite's own end of the
/// transaction to the final rollback (the job's statement, the failed
/// commit, the transaction's rollback on drop, each statement that puts
/// sqlx's count right), the connection still goes back to the pool sound.
/// (Cut before the final rollback, it went back counted inside a
/// transaction: every `BEGIN` on it failed, and what was written on it
/// outside a transaction never committed; cut during that rollback, sqlx's
/// worker skipped the rollback of the application's next dropped
/// transaction.) Each point is one run, the worker held there by a
/// progress handler while the runtime shuts down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_group_cut_by_its_runtime_shutting_down_leaves_the_connection_sound() {
    let calls = a_failed_group_cut_at(0).await.unwrap();
    assert!(calls > 14, "{calls} progress calls up to the final rollback");
    let wrong: Vec<String> = {
        let mut wrong = Vec::new();
        for hold_at in 1..=calls {
            if let Err(e) = a_failed_group_cut_at(hold_at).await {
                wrong.push(e);
            }
        }
        wrong
    };
    assert!(wrong.is_empty(), "{wrong:#?}");
}
