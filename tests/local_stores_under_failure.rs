//! The local stores when something fails: SQLite's grouped writes with a
//! member fenced out, rolled back or refused, a commit that fails, a write
//! lock another process holds past the busy timeout, a caller that gives up
//! mid-group and a leader whose runtime goes; the memory store's eviction
//! against live locks, late completions and replays. Each test checks that
//! what a caller was told is what the store holds, read from a connection
//! of its own (another process's view). Writes are put in a known order in
//! SQLite's queue by pause points and by futures polled by hand.

use idem::store::{RecordId, Reservation, ReserveRequest, StoredResponse};
use idem::{IdempotencyStore, MemoryStore, SqliteStore};
use idem_runtime::pause;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::Connection as _;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

const LONG: Duration = Duration::from_secs(3600);

fn id(key: &str) -> RecordId {
    RecordId::new("t", "local", key)
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

async fn reserved(store: &dyn IdempotencyStore, key: &str) -> &'static str {
    let token = idem_testkit::token();
    match store.reserve(req(&id(key), token)).await.unwrap() {
        Reservation::Reserved(_) => token,
        other => panic!("{key} not taken: {other:?}"),
    }
}

/// A reservation of a fresh key stopped inside its group's transaction
/// (the permit and SQLite's write lock held), before its commit.
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

type Fut<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// A completion queued for the next group (its first poll joins it).
fn queue_complete(store: &SqliteStore, key: &str, token: &'static str) -> Fut<Result<(), idem::StoreError>> {
    let (store, key) = (store.clone(), key.to_owned());
    let mut fut: Fut<Result<(), idem::StoreError>> = Box::pin(async move {
        let id = id(&key);
        store.complete(&id, token, &answer(&key)).await
    });
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    assert!(fut.as_mut().poll(&mut cx).is_pending());
    fut
}

/// A reservation queued for the next group: its peek done, its write joined
/// (polled by hand past the pause point that precedes `join_group`).
async fn queue_reserve(
    store: &SqliteStore,
    key: &str,
    token: &'static str,
) -> Fut<Result<Reservation, idem::StoreError>> {
    let (store2, key2) = (store.clone(), key.to_owned());
    let mut paused = pause::arm(pause::SQLITE_RESERVE_AFTER_PEEK, key);
    let mut fut: Fut<Result<Reservation, idem::StoreError>> = Box::pin(async move {
        let id = id(&key2);
        store2.reserve(req(&id, token)).await
    });
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    let started = std::time::Instant::now();
    loop {
        assert!(fut.as_mut().poll(&mut cx).is_pending(), "answered before joining");
        if paused.is_reached() {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(20), "peek never done");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    paused.resume();
    // This poll passes the pause and joins the group.
    assert!(fut.as_mut().poll(&mut cx).is_pending());
    fut
}

async fn state_of(pool: &sqlx::SqlitePool, key: &str) -> Option<(String, Option<String>)> {
    sqlx::query_as("SELECT state, lock_token FROM idempotency_keys WHERE key = ?")
        .bind(key)
        .fetch_optional(pool)
        .await
        .unwrap()
}

/// From a connection of its own (another process's view).
async fn state_seen_elsewhere(path: &std::path::Path, key: &str) -> Option<(String, Option<String>)> {
    let options = SqliteConnectOptions::new()
        .filename(path)
        .journal_mode(SqliteJournalMode::Wal);
    let mut conn = sqlx::SqliteConnection::connect_with(&options).await.unwrap();
    let row = sqlx::query_as("SELECT state, lock_token FROM idempotency_keys WHERE key = ?")
        .bind(key)
        .fetch_optional(&mut conn)
        .await
        .unwrap();
    conn.close().await.unwrap();
    row
}

// ---------------------------------------------------------------- SQLite

/// Group: [completion, completion whose token another process changed,
/// completion]. The fenced-out one is told LockLost; the others are told
/// done and are completed; nothing else changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_group_with_a_fenced_out_member_answers_each_truthfully() {
    let (store, dir) = idem_testkit::sqlite_store().await;
    let path = dir.path().join("idem.db");
    let keys = [
        idem_testkit::unique("a"),
        idem_testkit::unique("stolen"),
        idem_testkit::unique("c"),
    ];
    let mut tokens = Vec::new();
    for k in &keys {
        tokens.push(reserved(&store, k).await);
    }
    // Another process takes the middle record over behind our back.
    let options = SqliteConnectOptions::new()
        .filename(&path)
        .journal_mode(SqliteJournalMode::Wal);
    let mut other = sqlx::SqliteConnection::connect_with(&options).await.unwrap();
    sqlx::query("UPDATE idempotency_keys SET lock_token = 'thief' WHERE key = ?")
        .bind(&keys[1])
        .execute(&mut other)
        .await
        .unwrap();

    let (paused, holder) = hold_the_permit(&store).await;
    let writes: Vec<_> = (0..3)
        .map(|i| queue_complete(&store, &keys[i], tokens[i]))
        .collect();
    paused.resume();
    holder.await.unwrap();
    let mut outcomes = Vec::new();
    for w in writes {
        outcomes.push(w.await);
    }
    assert!(outcomes[0].is_ok(), "{outcomes:?}");
    assert!(
        matches!(outcomes[1], Err(idem::StoreError::LockLost)),
        "{outcomes:?}"
    );
    assert!(outcomes[2].is_ok(), "{outcomes:?}");
    for (i, k) in keys.iter().enumerate() {
        let (state, token) = state_seen_elsewhere(&path, k).await.unwrap();
        assert_eq!(
            state == "completed",
            outcomes[i].is_ok(),
            "{k}: {state} {token:?}"
        );
    }
    assert_eq!(
        state_seen_elsewhere(&path, &keys[1]).await.unwrap().1.as_deref(),
        Some("thief")
    );
}

/// Group: [fresh reservation, completion that SQLite rolls the whole
/// transaction back for (a trigger's RAISE(ROLLBACK)), fresh reservation].
/// A reservation told Reserved holds the key (committed); one told an
/// error does not hold a committed lock under its token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_reservation_grouped_with_a_rolled_back_completion_is_answered_truthfully() {
    for raise in ["ROLLBACK", "ABORT", "FAIL"] {
        let (store, dir) = idem_testkit::sqlite_store().await;
        let path = dir.path().join("idem.db");
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE TRIGGER poison BEFORE UPDATE ON idempotency_keys \
             WHEN NEW.key LIKE 'poison%' AND NEW.state = 'completed' \
             BEGIN SELECT RAISE({raise}, 'poisoned'); END;"
        )))
        .execute(store.pool())
        .await
        .unwrap();
        let poison = idem_testkit::unique("poison");
        let poison_token = reserved(&store, &poison).await;
        let (r1, r2) = (idem_testkit::unique("r1"), idem_testkit::unique("r2"));
        let (t1, t2) = (idem_testkit::token(), idem_testkit::token());

        let (paused, holder) = hold_the_permit(&store).await;
        let first = queue_reserve(&store, &r1, t1).await;
        let poisoned = queue_complete(&store, &poison, poison_token);
        let second = queue_reserve(&store, &r2, t2).await;
        paused.resume();
        holder.await.unwrap();
        let (first, poisoned, second) = (first.await, poisoned.await, second.await);
        assert!(poisoned.is_err(), "{raise}: {poisoned:?}");
        for (key, token, got) in [(&r1, t1, &first), (&r2, t2, &second)] {
            let row = state_seen_elsewhere(&path, key).await;
            match got {
                Ok(Reservation::Reserved(_)) => assert_eq!(
                    row,
                    Some(("in_progress".to_owned(), Some(token.to_owned()))),
                    "{raise}: {key} told Reserved"
                ),
                Err(_) => assert!(
                    row.as_ref().is_none_or(|(_, t)| t.as_deref() != Some(token)),
                    "{raise}: {key} told {got:?} but holds {row:?}"
                ),
                other => panic!("{raise}: {key}: {other:?}"),
            }
        }
        let poison_row = state_seen_elsewhere(&path, &poison).await.unwrap();
        assert_eq!(poison_row.0, "in_progress", "{raise}");
    }
}

/// Group of completions whose COMMIT fails (a deferred foreign key that a
/// trigger of another application breaks): every member is told it failed,
/// none is completed; and the connection, reused afterwards (a pool of one),
/// commits later writes for real (seen from another connection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_group_whose_commit_fails_answers_all_failed_and_later_writes_commit() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    let options = SqliteConnectOptions::new()
        .filename(&path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(5))
        .foreign_keys(true);
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(options)
        .await
        .unwrap();
    let store = SqliteStore::new(pool);
    store.migrate().await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE parent (id INTEGER PRIMARY KEY); \
         CREATE TABLE child (pid INTEGER REFERENCES parent(id) DEFERRABLE INITIALLY DEFERRED); \
         CREATE TRIGGER poison AFTER UPDATE ON idempotency_keys \
         WHEN NEW.key LIKE 'poison%' AND NEW.state = 'completed' \
         BEGIN INSERT INTO child (pid) VALUES (999); END;",
    )
    .execute(store.pool())
    .await
    .unwrap();
    let keys = [
        idem_testkit::unique("before"),
        idem_testkit::unique("poison"),
        idem_testkit::unique("after"),
    ];
    let mut tokens = Vec::new();
    for k in &keys {
        tokens.push(reserved(&store, k).await);
    }
    let (paused, holder) = hold_the_permit(&store).await;
    let writes: Vec<_> = (0..3)
        .map(|i| queue_complete(&store, &keys[i], tokens[i]))
        .collect();
    paused.resume();
    holder.await.unwrap();
    let mut outcomes = Vec::new();
    for w in writes {
        outcomes.push(w.await);
    }
    for (i, k) in keys.iter().enumerate() {
        let row = state_seen_elsewhere(&path, k).await.unwrap();
        assert_eq!(
            row.0 == "completed",
            outcomes[i].is_ok(),
            "{k}: told {:?}, holds {row:?}",
            outcomes[i]
        );
    }
    // Later writes on the (one) connection: each told done is committed.
    for n in 0..5 {
        let key = idem_testkit::unique(&format!("later{n}"));
        let token = reserved(&store, &key).await;
        let done = store.complete(&id(&key), token, &answer(&key)).await;
        let row = state_seen_elsewhere(&path, &key).await;
        assert!(done.is_ok(), "later{n}: {done:?}");
        assert_eq!(
            row.map(|r| r.0).as_deref(),
            Some("completed"),
            "later{n} told done"
        );
    }
    assert!(idem_testkit::dropped_transaction_rolls_back(store.pool()).await);
}

/// Another process holds SQLite's write lock (a raw `BEGIN IMMEDIATE`)
/// past the busy timeout, while reservations and completions queue:
/// every one is told it failed, and none of those told so is committed;
/// once the lock is free, the store serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_lock_held_elsewhere_past_busy_timeout_fails_truthfully() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    let options = SqliteConnectOptions::new()
        .filename(&path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_millis(200));
    let pool = SqlitePoolOptions::new()
        .max_connections(8)
        .connect_with(options.clone())
        .await
        .unwrap();
    let store = SqliteStore::new(pool).with_timeout(Duration::from_secs(3));
    store.migrate().await.unwrap();
    let done_keys: Vec<String> = (0..6).map(|i| idem_testkit::unique(&format!("c{i}"))).collect();
    let mut tokens = Vec::new();
    for k in &done_keys {
        tokens.push(reserved(&store, k).await);
    }
    let mut other = sqlx::SqliteConnection::connect_with(&options).await.unwrap();
    sqlx::raw_sql("BEGIN IMMEDIATE")
        .execute(&mut other)
        .await
        .unwrap();

    let mut completions = Vec::new();
    for (k, t) in done_keys.iter().zip(&tokens) {
        let (store, k, t) = (store.clone(), k.clone(), *t);
        completions.push(tokio::spawn(async move {
            store.complete(&id(&k), t, &answer(&k)).await
        }));
    }
    let fresh: Vec<(String, &'static str)> = (0..6)
        .map(|i| (idem_testkit::unique(&format!("r{i}")), idem_testkit::token()))
        .collect();
    let mut reservations = Vec::new();
    for (k, t) in &fresh {
        let (store, k, t) = (store.clone(), k.clone(), *t);
        reservations.push(tokio::spawn(async move { store.reserve(req(&id(&k), t)).await }));
    }
    let mut c_out = Vec::new();
    for c in completions {
        c_out.push(c.await.unwrap());
    }
    let mut r_out = Vec::new();
    for r in reservations {
        r_out.push(r.await.unwrap());
    }
    sqlx::raw_sql("ROLLBACK").execute(&mut other).await.unwrap();
    for (i, k) in done_keys.iter().enumerate() {
        let row = state_seen_elsewhere(&path, k).await.unwrap();
        assert_eq!(
            row.0 == "completed",
            c_out[i].is_ok(),
            "{k}: told {:?}, holds {row:?}",
            c_out[i]
        );
        assert!(
            c_out[i].is_err(),
            "completed while another process held the lock: {:?}",
            c_out[i]
        );
    }
    for (i, (k, t)) in fresh.iter().enumerate() {
        let row = state_seen_elsewhere(&path, k).await;
        match &r_out[i] {
            Ok(Reservation::Reserved(_)) => panic!("{k} reserved while the lock was held elsewhere"),
            Err(e) => {
                assert!(e.is_unavailable(), "{k}: {e:?}");
                assert!(
                    row.as_ref().is_none_or(|(_, tok)| tok.as_deref() != Some(*t)),
                    "{k} told {e:?} but holds {row:?}"
                );
            }
            other => panic!("{k}: {other:?}"),
        }
    }
    // The store serves again.
    let key = idem_testkit::unique("after");
    let token = reserved(&store, &key).await;
    store.complete(&id(&key), token, &answer(&key)).await.unwrap();
    assert_eq!(state_of(store.pool(), &key).await.unwrap().0, "completed");
}

// ---------------------------------------------------------------- memory

/// A record past its TTL whose lock is live is neither evicted (purge or
/// a full shard's sweep) nor taken by a second request; its completion is
/// recorded and replayed.
#[tokio::test]
async fn memory_expired_record_with_live_lock_survives_eviction() {
    let store = MemoryStore::new();
    let key = idem_testkit::unique("live");
    let rid = id(&key);
    let token = idem_testkit::token();
    let r = ReserveRequest {
        id: &rid,
        fingerprint: "F",
        token,
        ttl: Duration::from_millis(1),
        lock_timeout: LONG,
    };
    assert!(matches!(
        store.reserve(r).await.unwrap(),
        Reservation::Reserved(_)
    ));
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(store.purge_expired(1000).await.unwrap(), 0);
    // Fill every shard enough to force sweeps.
    for i in 0..50_000 {
        let other = id(&format!("{key}-fill{i}"));
        let _ = store
            .reserve(ReserveRequest {
                id: &other,
                fingerprint: "F",
                token: "x",
                ttl: Duration::from_millis(1),
                lock_timeout: Duration::from_millis(1),
            })
            .await
            .unwrap();
        let _ = store.release(&other, "x").await;
    }
    std::thread::sleep(Duration::from_millis(20));
    for i in 0..50_000 {
        let other = id(&format!("{key}-more{i}"));
        let _ = store.reserve(req(&other, "y")).await.unwrap();
    }
    let second = store
        .reserve(ReserveRequest { token: "second", ..r })
        .await
        .unwrap();
    assert!(matches!(second, Reservation::InProgress { .. }), "{second:?}");
    let other_fp = store
        .reserve(ReserveRequest {
            token: "third",
            fingerprint: "G",
            ..r
        })
        .await
        .unwrap();
    assert_eq!(other_fp, Reservation::Mismatch);
    store.complete(&rid, token, &answer(&key)).await.unwrap();
    match store
        .reserve(ReserveRequest { token: "fourth", ..r })
        .await
        .unwrap()
    {
        Reservation::Completed(resp) => assert_eq!(resp.body.as_deref(), Some(key.as_bytes())),
        other => panic!("{other:?}"),
    }
}

/// A record evicted between reserve and complete: the completion is
/// refused (LockLost), and a new request that took the key meanwhile is
/// not overwritten.
#[tokio::test]
async fn memory_record_evicted_between_reserve_and_complete() {
    let store = MemoryStore::new();
    let key = idem_testkit::unique("evicted");
    let rid = id(&key);
    let short = |token| ReserveRequest {
        id: &rid,
        fingerprint: "F",
        token,
        ttl: Duration::from_millis(1),
        lock_timeout: Duration::from_millis(1),
    };
    assert!(matches!(
        store.reserve(short("t1")).await.unwrap(),
        Reservation::Reserved(_)
    ));
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(store.purge_expired(1000).await.unwrap(), 1);
    assert_eq!(
        store.complete(&rid, "t1", &answer("old")).await,
        Err(idem::StoreError::LockLost)
    );
    assert_eq!(store.release(&rid, "t1").await, Err(idem::StoreError::LockLost));
    assert_eq!(
        store.extend_lock(&rid, "t1", LONG).await,
        Err(idem::StoreError::LockLost)
    );
    // A fresh owner, then the stale owner's writes.
    let Reservation::Reserved(lease) = store.reserve(req(&rid, "t2")).await.unwrap() else {
        panic!()
    };
    assert_eq!(lease.attempt, 1);
    assert_eq!(
        store.complete(&rid, "t1", &answer("old")).await,
        Err(idem::StoreError::LockLost)
    );
    assert_eq!(store.reject(&rid, "t1").await, Err(idem::StoreError::LockLost));
    assert!(matches!(
        store.reserve(req(&rid, "t3")).await.unwrap(),
        Reservation::InProgress { .. }
    ));
    store.complete(&rid, "t2", &answer("new")).await.unwrap();
    match store.reserve(req(&rid, "t4")).await.unwrap() {
        Reservation::Completed(r) => assert_eq!(r.body.as_deref(), Some(&b"new"[..])),
        other => panic!("{other:?}"),
    }
}

/// A replay racing the purge of its (expired) record: it is either the
/// stored answer or a fresh reservation, never an error or a half record.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_replay_racing_eviction() {
    let store = std::sync::Arc::new(MemoryStore::new());
    let keys: Vec<String> = (0..2000)
        .map(|i| idem_testkit::unique(&format!("rp{i}")))
        .collect();
    for k in &keys {
        let rid = id(k);
        let r = ReserveRequest {
            id: &rid,
            fingerprint: "F",
            token: "t",
            ttl: Duration::from_millis(30),
            lock_timeout: LONG,
        };
        assert!(matches!(
            store.reserve(r).await.unwrap(),
            Reservation::Reserved(_)
        ));
        store.complete(&rid, "t", &answer(k)).await.unwrap();
    }
    std::thread::sleep(Duration::from_millis(40));
    let purger = {
        let store = store.clone();
        tokio::spawn(async move {
            let mut n = 0;
            for _ in 0..100 {
                n += store.purge_expired(50).await.unwrap();
                tokio::task::yield_now().await;
            }
            n
        })
    };
    let mut fresh = 0;
    for k in &keys {
        let rid = id(k);
        match store.reserve(req(&rid, "again")).await.unwrap() {
            Reservation::Reserved(l) => {
                assert_eq!(l.attempt, 1);
                fresh += 1;
            }
            other => panic!("an expired record answered {other:?}"),
        }
    }
    assert_eq!(fresh, keys.len());
    assert!(purger.await.unwrap() <= keys.len() as u64);
}

/// More than a group's worth (64) of completions queue while the lock is
/// held; every seventh is fenced out (its token changed by another
/// process), every eleventh is a reservation of a fresh key. Each caller's
/// answer matches the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_many_groups_with_scattered_failures_answer_each_truthfully() {
    let (store, dir) = idem_testkit::sqlite_store().await;
    let path = dir.path().join("idem.db");
    let n = 200;
    let keys: Vec<String> = (0..n).map(|i| idem_testkit::unique(&format!("m{i}"))).collect();
    let mut tokens = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        if i % 11 == 0 {
            tokens.push(idem_testkit::token());
        } else {
            tokens.push(reserved(&store, k).await);
        }
    }
    let options = SqliteConnectOptions::new()
        .filename(&path)
        .journal_mode(SqliteJournalMode::Wal);
    let mut other = sqlx::SqliteConnection::connect_with(&options).await.unwrap();
    for (i, k) in keys.iter().enumerate() {
        if i % 7 == 0 && i % 11 != 0 {
            sqlx::query("UPDATE idempotency_keys SET lock_token = 'thief' WHERE key = ?")
                .bind(k)
                .execute(&mut other)
                .await
                .unwrap();
        }
    }
    let (paused, holder) = hold_the_permit(&store).await;
    enum W {
        C(Fut<Result<(), idem::StoreError>>),
        R(Fut<Result<Reservation, idem::StoreError>>),
    }
    let mut writes = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        if i % 11 == 0 {
            writes.push(W::R(queue_reserve(&store, k, tokens[i]).await));
        } else {
            writes.push(W::C(queue_complete(&store, k, tokens[i])));
        }
    }
    paused.resume();
    holder.await.unwrap();
    let mut bad = Vec::new();
    for (i, w) in writes.into_iter().enumerate() {
        let k = &keys[i];
        match w {
            W::C(f) => {
                let got = f.await;
                let row = state_seen_elsewhere(&path, k).await;
                let completed = row.as_ref().is_some_and(|r| r.0 == "completed");
                let expect_ok = i % 7 != 0;
                if got.is_ok() != completed || got.is_ok() != expect_ok {
                    bad.push(format!("{i}: told {got:?}, holds {row:?}"));
                }
            }
            W::R(f) => {
                let got = f.await;
                let row = state_seen_elsewhere(&path, k).await;
                let held = row.as_ref().is_some_and(|r| r.1.as_deref() == Some(tokens[i]));
                if !matches!(got, Ok(Reservation::Reserved(_))) || !held {
                    bad.push(format!("{i}: told {got:?}, holds {row:?}"));
                }
            }
        }
    }
    assert!(bad.is_empty(), "{bad:#?}");
}

/// Polls until `cond` holds on the row of `key`, up to 10 s.
async fn eventually_row(
    path: &std::path::Path,
    key: &str,
    cond: impl Fn(&Option<(String, Option<String>)>) -> bool,
) -> Option<(String, Option<String>)> {
    let started = std::time::Instant::now();
    loop {
        let row = state_seen_elsewhere(path, key).await;
        if cond(&row) || started.elapsed() > Duration::from_secs(10) {
            return row;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A reservation whose take ran in a group that has not committed yet,
/// and whose caller then times out (or goes away): once the group commits,
/// the key it took is given back (no lock that nobody holds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_reservation_given_up_mid_group_leaves_no_lock() {
    for drop_it in [false, true] {
        let (store, dir) = idem_testkit::sqlite_store().await;
        let path = dir.path().join("idem.db");
        let impatient = store.clone().with_timeout(Duration::from_millis(300));
        let key = idem_testkit::unique("given_up");
        let token = idem_testkit::token();
        let (paused, holder) = hold_the_permit(&store).await;
        let taking = queue_reserve(&impatient, &key, token).await;
        let stopper = idem_testkit::unique("stopper");
        let mut stop = pause::arm(pause::SQLITE_RESERVE_BEFORE_COMMIT, &stopper);
        let stopping = tokio::spawn(queue_reserve(&store, &stopper, idem_testkit::token()).await);
        paused.resume();
        holder.await.unwrap();
        tokio::time::timeout(Duration::from_secs(20), stop.reached())
            .await
            .unwrap();
        if drop_it {
            drop(taking);
        } else {
            let told = taking.await;
            assert!(matches!(told, Err(ref e) if e.is_unavailable()), "{told:?}");
        }
        stop.resume();
        let _ = stopping.await.unwrap();
        let row = eventually_row(&path, &key, |r| r.is_none()).await;
        assert_eq!(row, None, "drop {drop_it}: a lock nobody holds");
        // And the key is takeable at once as a first attempt.
        match store
            .reserve(req(&id(&key), idem_testkit::token()))
            .await
            .unwrap()
        {
            Reservation::Reserved(l) => assert_eq!((l.attempt, l.takeover), (1, false)),
            other => panic!("{other:?}"),
        }
    }
}

/// The leader runs on a runtime that shuts down while its group (holding a
/// completion issued from another runtime) waits before its commit: that
/// completion is told it failed, and is not completed; the store serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_leader_runtime_shutdown_mid_group_answers_other_runtimes_truthfully() {
    let (store, dir) = idem_testkit::sqlite_store().await;
    let path = dir.path().join("idem.db");
    let key = idem_testkit::unique("cross");
    let token = reserved(&store, &key).await;
    let rt1 = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // The holder's reservation starts the leader on rt1.
    let holder_key = idem_testkit::unique("holder");
    let mut held = pause::arm(pause::SQLITE_RESERVE_BEFORE_COMMIT, &holder_key);
    {
        let store = store.clone();
        let holder_key = holder_key.clone();
        rt1.spawn(async move {
            let _ = store.reserve(req(&id(&holder_key), idem_testkit::token())).await;
        });
    }
    tokio::time::timeout(Duration::from_secs(20), held.reached())
        .await
        .unwrap();
    let done = tokio::spawn(queue_complete(&store, &key, token));
    let stopper = idem_testkit::unique("stopper");
    let mut stop = pause::arm(pause::SQLITE_RESERVE_BEFORE_COMMIT, &stopper);
    let stopping = tokio::spawn(queue_reserve(&store, &stopper, idem_testkit::token()).await);
    held.resume();
    tokio::time::timeout(Duration::from_secs(20), stop.reached())
        .await
        .unwrap();
    // rt1 goes away with the leader mid-group.
    rt1.shutdown_background();
    let told = tokio::time::timeout(Duration::from_secs(10), done)
        .await
        .expect("answered")
        .unwrap();
    let _ = tokio::time::timeout(Duration::from_secs(10), stopping)
        .await
        .expect("answered")
        .unwrap();
    drop(stop);
    let row = state_seen_elsewhere(&path, &key).await.unwrap();
    assert_eq!(row.0 == "completed", told.is_ok(), "told {told:?}, holds {row:?}");
    // The store serves on, and retrying the completion works.
    if told.is_err() {
        store.complete(&id(&key), token, &answer(&key)).await.unwrap();
    }
    let later = idem_testkit::unique("later");
    let t = reserved(&store, &later).await;
    store.complete(&id(&later), t, &answer(&later)).await.unwrap();
    assert_eq!(state_seen_elsewhere(&path, &later).await.unwrap().0, "completed");
    assert_eq!(state_seen_elsewhere(&path, &key).await.unwrap().0, "completed");
}
