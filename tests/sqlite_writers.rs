//! SQLite writers of one process queue for one write permit, first come
//! first served, instead of racing into SQLite's busy handler; writers of
//! other processes are still waited for by the busy timeout.

use idem::store::{RecordId, Reservation, ReserveRequest, StoredResponse};
use idem::{IdempotencyStore, SqliteStore};
use idem_runtime::pause;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::Connection as _;
use std::future::Future;
use std::pin::Pin;
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

/// `key` reserved through a store of its own on `path` (another process's,
/// with its own line of writes): no leader of the store under test is left
/// running by it, to take the next write on the runtime it runs on.
async fn reserved_elsewhere(path: &std::path::Path, key: &str) -> &'static str {
    let elsewhere = SqliteStore::open(path).await.unwrap();
    let token = reserved(&elsewhere, key).await;
    elsewhere.pool().close().await;
    token
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

/// A trigger that refuses, with `RAISE(<raise>)`, the completion of every
/// key starting `poison`.
async fn poison_completions(store: &SqliteStore, raise: &str) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TRIGGER poison BEFORE UPDATE ON idempotency_keys \
         WHEN NEW.key LIKE 'poison%' AND NEW.state = 'completed' \
         BEGIN SELECT RAISE({raise}, 'poisoned'); END;"
    )))
    .execute(store.pool())
    .await
    .unwrap();
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

/// A reservation of a fresh key started from `rt` (a multi-thread runtime:
/// its group is led from there), stopped before its commit with the write
/// permit held.
async fn hold_from(rt: &tokio::runtime::Runtime, store: &SqliteStore) -> pause::Pause {
    let key = idem_testkit::unique("holder");
    let mut held = pause::arm(pause::SQLITE_RESERVE_BEFORE_COMMIT, &key);
    let store = store.clone();
    rt.spawn(async move {
        let _ = store.reserve(req(&id(&key), idem_testkit::token())).await;
    });
    tokio::time::timeout(Duration::from_secs(20), held.reached())
        .await
        .expect("the holder reaches its commit");
    held
}

/// Stops a hook of SQLite's (a commit hook, a progress handler) on a
/// connection's thread once armed: it says so on `reached` and waits for
/// `released` (30 s at most).
#[derive(Default)]
struct Hold {
    armed: std::sync::atomic::AtomicBool,
    reached: Mutex<Option<mpsc::Sender<()>>>,
    released: Mutex<Option<mpsc::Receiver<()>>>,
}

impl Hold {
    /// The test's ends: where it hears that the hook stopped, and how it
    /// lets it go.
    fn channels(&self) -> (mpsc::Receiver<()>, mpsc::Sender<()>) {
        let (reached, held) = mpsc::channel();
        let (release, released) = mpsc::channel();
        *self.reached.lock().unwrap() = Some(reached);
        *self.released.lock().unwrap() = Some(released);
        (held, release)
    }

    fn arm(&self, armed: bool) {
        self.armed.store(armed, std::sync::atomic::Ordering::SeqCst);
    }

    /// In the hook: stops there if armed, and disarms.
    fn stop_if_armed(&self) {
        if self.armed.swap(false, std::sync::atomic::Ordering::SeqCst) {
            let reached = self.reached.lock().unwrap().take();
            let released = self.released.lock().unwrap().take();
            let _ = reached.map(|r| r.send(()));
            let _ = released.map(|r| r.recv_timeout(Duration::from_secs(30)));
        }
    }
}

/// A one-connection database in memory on each of whose connections
/// `hook` sets one of SQLite's hooks to stop at `hold` (an `after_connect`
/// step).
async fn hooked_in_memory(
    hold: Arc<Hold>,
    hook: fn(&mut sqlx::sqlite::LockedSqliteHandle<'_>, Arc<Hold>),
) -> sqlx::SqlitePool {
    SqlitePoolOptions::new()
        .max_connections(1)
        .after_connect(move |conn, _| {
            let hold = hold.clone();
            Box::pin(async move {
                hook(&mut conn.lock_handle().await?, hold);
                Ok(())
            })
        })
        .connect("sqlite::memory:")
        .await
        .unwrap()
}

/// Sets `hold` to stop the COMMIT, on `conn`, of a transaction that wrote
/// to `table` (an `after_connect` step).
async fn hold_commits_writing(
    conn: &mut sqlx::SqliteConnection,
    hold: Arc<Hold>,
    table: &'static str,
) -> Result<(), sqlx::Error> {
    let mut handle = conn.lock_handle().await?;
    let on_update = hold.clone();
    handle.set_update_hook(move |u| {
        if u.table == table {
            on_update.arm(true);
        }
    });
    let on_rollback = hold.clone();
    handle.set_rollback_hook(move || on_rollback.arm(false));
    handle.set_commit_hook(move || {
        hold.stop_if_armed();
        // true: go on with the commit.
        true
    });
    Ok(())
}

/// A POST to `path` under the idempotency key `key`.
fn keyed(path: &str, key: &str) -> axum::http::Request<axum::body::Body> {
    axum::http::Request::post(path)
        .header("idempotency-key", key)
        .body(axum::body::Body::empty())
        .unwrap()
}

/// A pool hook held by a test once armed: the hook says so on the first
/// end and waits for the second (or for its drop).
type HookHold = Arc<Mutex<Option<(mpsc::Sender<()>, tokio::sync::oneshot::Receiver<()>)>>>;

/// A pool hook's body: once `hold` is armed, it says so and waits to be
/// let go; then it lets the pool go on with the connection.
fn hook_stop(hold: &HookHold) -> Pin<Box<dyn Future<Output = Result<bool, sqlx::Error>> + Send>> {
    let armed = hold.lock().unwrap().take();
    Box::pin(async move {
        if let Some((reached, release)) = armed {
            let _ = reached.send(());
            let _ = release.await;
        }
        Ok(true)
    })
}

/// Which of the pool's hooks [`held_in_memory`] holds.
#[derive(Clone, Copy)]
enum HookAt {
    /// `before_acquire`: the check before the pool hands a connection over.
    Check,
    /// `after_release`: the connection's way back to the pool.
    GiveBack,
}

/// The documented one-connection database in memory, migrated (the store's
/// timeout 20 s), whose pool stops in the hook `at` once `hold` is armed,
/// and a table `effects` for handlers to write to.
async fn held_in_memory(hold: HookHold, at: HookAt) -> SqliteStore {
    let options = SqlitePoolOptions::new().max_connections(1);
    let options = match at {
        HookAt::Check => options.before_acquire(move |_, _| hook_stop(&hold)),
        HookAt::GiveBack => options.after_release(move |_, _| hook_stop(&hold)),
    };
    let store = SqliteStore::new(options.connect("sqlite::memory:").await.unwrap())
        .with_timeout(Duration::from_secs(20));
    store.migrate().await.unwrap();
    sqlx::query("CREATE TABLE effects (id TEXT PRIMARY KEY)")
        .execute(store.pool())
        .await
        .unwrap();
    store
}

/// A database in memory opened by URL (`sqlite::memory:`) gets one
/// connection, as `in_memory()` does: several, sharing one database, lock
/// whole tables without waiting, and concurrent requests on 40 keys were
/// answered "database table is locked" (503) instead of reserved or 409.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_database_in_memory_opened_by_url_serves_concurrent_requests() {
    let store = SqliteStore::open_url("sqlite::memory:").await.unwrap();
    store.migrate().await.unwrap();
    serves_concurrent_requests(&store, "m").await;
}

/// 400 concurrent reservations on 40 keys, each completed when taken:
/// every one reserved, in progress or replayed, never a store error.
async fn serves_concurrent_requests(store: &SqliteStore, prefix: &'static str) {
    let tasks: Vec<_> = (0..400)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                let (id, token) = (id(&format!("{prefix}-{}", i % 40)), idem_testkit::token());
                match store.reserve(req(&id, token)).await? {
                    Reservation::Reserved(_) => store.complete(&id, token, &answer(prefix)).await,
                    Reservation::InProgress { .. } | Reservation::Completed(_) => Ok(()),
                    other => panic!("{other:?}"),
                }
            })
        })
        .collect();
    for task in tasks {
        let result = task.await.unwrap();
        assert!(result.is_ok(), "{result:?}");
    }
}

/// A file opened by URL with a shared cache (`cache=shared`) would lock
/// whole tables without waiting as the database in memory did (10 of 20
/// concurrent reservations answered "database table is locked"): refused
/// before the file is made, saying why, however the URL spells it (sqlx
/// decodes percent escapes); so is a VFS that takes no file locks
/// (`vfs=unix-none`). The same file's URL with another parameter
/// (`mode=rwc`) serves concurrent requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_file_opened_by_url_with_a_shared_cache_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    for query in [
        "cache=shared",
        "mode=rwc&cache=shared",
        "cache=%73hared",
        "c%61che=shared",
        "mode=rwc&cache=%73hared",
    ] {
        let url = format!("sqlite://{}?{query}", path.display());
        let err = SqliteStore::open_url(&url).await.map(|_| ()).unwrap_err();
        assert!(
            matches!(err, idem::StoreError::Backend { .. }) && err.to_string().contains("cache=shared"),
            "{url}: {err}"
        );
        assert!(!path.exists(), "{url} made the file it refused");
    }
    // Nor a VFS that takes no file locks: two stores on the file each
    // reserved one key (the last `vfs` counts, as for sqlx).
    for query in ["vfs=unix-none", "vfs=unix&vfs=unix-none", "vfs=unix-n%6Fne"] {
        let url = format!("sqlite://{}?{query}", path.display());
        let err = SqliteStore::open_url(&url).await.map(|_| ()).unwrap_err();
        assert!(
            matches!(err, idem::StoreError::Backend { .. }) && err.to_string().contains("vfs=unix-none"),
            "{url}: {err}"
        );
        assert!(!path.exists(), "{url} made the file it refused");
    }
    // A database in memory gets its one connection however it is spelled.
    for query in ["mode=memory", "mode=%6Demory", "m%6Fde=memory"] {
        let url = format!("sqlite://shared-probe?{query}");
        let store = SqliteStore::open_url(&url).await.unwrap();
        assert_eq!(store.pool().options().get_max_connections(), 1, "{url}");
    }
    let store = SqliteStore::open_url(&format!("sqlite://{}?mode=rwc", path.display()))
        .await
        .unwrap();
    store.migrate().await.unwrap();
    serves_concurrent_requests(&store, "f").await;
}

/// SQLite reads a file name that is itself a URI (`file:...`, which sqlx
/// opens with URIs allowed) with its own parameters: a shared cache asked
/// there (`%3F` decodes to the `?`) answered 278 of 400 concurrent
/// reservations "database table is locked". Such names are refused, by
/// URL and by path, before a file is made. A shared cache asked and then
/// taken back (`cache=shared&cache=private`: the last counts, as for sqlx)
/// is a private one, and serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_uri_file_name_is_refused_and_the_last_cache_parameter_counts() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    for url in [
        format!("sqlite://file:{}%3Fcache%3Dshared", path.display()),
        format!("sqlite:file:{}%3Fmode%3Drwc%26cache%3Dshared", path.display()),
    ] {
        let err = SqliteStore::open_url(&url).await.map(|_| ()).unwrap_err();
        assert!(
            matches!(err, idem::StoreError::Backend { .. }) && err.to_string().contains("URI file name"),
            "{url}: {err}"
        );
        assert!(!path.exists(), "{url} made the file it refused");
    }
    let by_path = format!("file:{}?cache=shared", path.display());
    let err = SqliteStore::open(&by_path).await.map(|_| ()).unwrap_err();
    assert!(err.to_string().contains("URI file name"), "{err}");
    assert!(!path.exists());

    let url = format!("sqlite://{}?cache=shared&cache=private", path.display());
    let store = SqliteStore::open_url(&url).await.unwrap();
    store.migrate().await.unwrap();
    serves_concurrent_requests(&store, "p").await;
}

/// A database in memory is told from its name as SQLite reads it: `:memory:`
/// escaped (`%3Amemory%3A`, which sqlx decodes) or given as a path is one,
/// as are no name and `vfs=memdb`
/// (one connection: eight would be eight databases, and the migration's
/// check would run on another than its tables), while a file whose path
/// merely holds `:memory:` is a file, opened in WAL mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_database_in_memory_is_told_by_its_name_as_sqlite_reads_it() {
    // No name at all is a temporary database, one per connection too, and
    // so is SQLite's VFS of databases in memory under a relative name.
    for store in [
        SqliteStore::open_url("sqlite:%3Amemory%3A").await.unwrap(),
        SqliteStore::open(":memory:").await.unwrap(),
        SqliteStore::open_url("sqlite://?mode=rwc").await.unwrap(),
        SqliteStore::open("").await.unwrap(),
        SqliteStore::open_url("sqlite://idem-memdb-probe.db?vfs=memdb")
            .await
            .unwrap(),
    ] {
        assert_eq!(store.pool().options().get_max_connections(), 1);
        store.migrate().await.unwrap();
        serves_concurrent_requests(&store, "m").await;
    }
    let dir = tempfile::tempdir().unwrap();
    let holder = dir.path().join("a:memory:b");
    std::fs::create_dir(&holder).unwrap();
    let path = holder.join("idem.db");
    let store = SqliteStore::open_url(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    assert!(store.pool().options().get_max_connections() > 1);
    store.migrate().await.unwrap();
    let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(mode, "wal");
    assert!(path.exists());
    let err = SqliteStore::open_url(&format!("sqlite://{}?cache=shared", path.display()))
        .await
        .map(|_| ())
        .unwrap_err();
    assert!(err.to_string().contains("cache=shared"), "{err}");
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

/// A connection of its own on the database in `dir` (another process's,
/// as far as the store can tell), holding SQLite's write lock in a
/// `BEGIN IMMEDIATE` transaction until it ends.
async fn write_lock_held_elsewhere(dir: &std::path::Path) -> sqlx::SqliteConnection {
    let options = SqliteConnectOptions::new()
        .filename(dir.join("idem.db"))
        .journal_mode(SqliteJournalMode::Wal);
    let mut other = sqlx::SqliteConnection::connect_with(&options).await.unwrap();
    sqlx::raw_sql("BEGIN IMMEDIATE")
        .execute(&mut other)
        .await
        .unwrap();
    other
}

/// Another process's writer (here another pool on the same file, outside
/// this store's line) is not failed against but waited for, by SQLite's
/// busy timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_of_another_process_is_waited_for() {
    let (store, dir) = idem_testkit::sqlite_store().await;
    let mut other = write_lock_held_elsewhere(dir.path()).await;

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
/// group's transaction where it fails: those before it commit with it, or,
/// when SQLite rolled that transaction back whole (`RAISE(ROLLBACK)`), go
/// back in line and are written without it (never "done" for a write
/// rolled back, and never failed for another write's sake: an innocent
/// completion failed so would release its key, and its retry would run the
/// handler again); those after it go on in a transaction of their own. After a
/// transaction that SQLite rolled back by itself, sqlx would still count it
/// open on its connection (and every `BEGIN` there would fail); closing
/// that connection instead would lose a database in memory. On the
/// documented in-memory store of one connection, everything recorded
/// before stays, and the store keeps serving.
#[tokio::test]
async fn a_failed_write_in_a_group_fails_only_what_its_transaction_held() {
    for raise in ["ROLLBACK", "ABORT"] {
        let store = in_memory_store().await;
        poison_completions(&store, raise).await;
        let recorded = idem_testkit::unique("recorded");
        let recorded_token = reserved(&store, &recorded).await;
        store
            .complete(&id(&recorded), recorded_token, &answer(&recorded))
            .await
            .unwrap();
        let keys = [
            idem_testkit::unique("before"),
            idem_testkit::unique("poison"),
            idem_testkit::unique("poison"),
            idem_testkit::unique("after"),
        ];
        let mut tokens = Vec::new();
        for key in &keys {
            tokens.push(reserved(&store, key).await);
        }
        let ids: Vec<RecordId> = keys.iter().map(|k| id(k)).collect();
        let bodies: Vec<StoredResponse> = keys.iter().map(|k| answer(k)).collect();

        // The four queue, in this order, while the lock is held.
        let (paused, holder) = hold_the_permit(&store).await;
        let mut writes: Vec<_> = (0..4)
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
        assert!(outcomes[0].is_ok(), "{raise}: {outcomes:?}");
        assert!(
            outcomes[1].is_err() && outcomes[2].is_err(),
            "{raise}: {outcomes:?}"
        );
        assert!(outcomes[3].is_ok(), "{raise}: {outcomes:?}");

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
    idem_testkit::multi_thread(2)
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
/// `first` started, paused before its commit; then `first` shuts down (its
/// worker threads gone, its tasks dropped) and only then is the pause let
/// go. The queued write's answer, within 5 s (not at its timeout), and the
/// store, its key and token.
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
    // Not through `store`: the group `first` starts must be led from there.
    let token = setup.block_on(reserved_elsewhere(&dir.path().join("idem.db"), &key));
    let (paused, _holder) = first.block_on(hold_the_permit(&store));
    let caller = runtime();
    let (queued, body) = (id(&key), answer(&key));
    let mut write = store.complete(&queued, token, &body);
    {
        let _context = caller.enter();
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(write.as_mut().poll(&mut cx).is_pending());
    }
    // Waits for `first`'s workers: a leader there is dropped, not resumed.
    first.shutdown_timeout(Duration::from_secs(10));
    drop(paused);
    let started = Instant::now();
    let written = caller.block_on(write);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "waited {:?}",
        started.elapsed()
    );
    (written, store, dir, key, token)
}

/// A leader whose (multi-thread) runtime shuts down while its group runs
/// (paused before its commit): the group goes on from the writers' thread,
/// and so does the write queued behind it from another runtime, at once,
/// as from a current-thread runtime (next test).
#[test]
fn a_group_whose_leaders_runtime_shuts_down_goes_on_with_the_writes_behind_it() {
    let first = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (queued, store, _dir, key, _) = queued_behind_a_group_whose_runtime_shuts_down(first);
    queued.unwrap();
    runtime().block_on(assert_replays(&store, &key));
}

/// A leader dropped with its (multi-thread) runtime before it took any
/// write from the queue (here: waiting for the pool's one connection, which
/// the test holds): the writes queued are handed to a leader on the
/// writers' thread, which writes them once the connection is free; one
/// whose caller gave up before its turn is not written.
#[test]
fn a_leader_dropped_before_its_group_hands_the_queue_to_another() {
    let setup = runtime();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    let (store, held, keys, tokens) = setup.block_on(async {
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(
                SqliteConnectOptions::new()
                    .filename(&path)
                    .create_if_missing(true)
                    .journal_mode(SqliteJournalMode::Wal),
            )
            .await
            .unwrap();
        let store = SqliteStore::new(pool).with_timeout(Duration::from_secs(120));
        store.migrate().await.unwrap();
        let keys = [idem_testkit::unique("given-up"), idem_testkit::unique("handed")];
        // Through a store of their own: `store` has led no group yet.
        let mut tokens = Vec::new();
        for key in &keys {
            tokens.push(reserved_elsewhere(&path, key).await);
        }
        let held = store.pool().acquire().await.unwrap();
        (store, held, keys, tokens)
    });
    let first = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    // A completion from `first` starts the leader there; its caller then
    // gives up on it.
    let (given_up, given_up_body) = (id(&keys[0]), answer(&keys[0]));
    first.block_on(async {
        let mut write = store.complete(&given_up, tokens[0], &given_up_body);
        assert!(write.as_mut().poll(&mut cx).is_pending());
    });
    // A completion from another runtime, queued behind.
    let caller = runtime();
    let (handed, handed_body) = (id(&keys[1]), answer(&keys[1]));
    let mut write = store.complete(&handed, tokens[1], &handed_body);
    {
        let _context = caller.enter();
        assert!(write.as_mut().poll(&mut cx).is_pending());
    }
    first.shutdown_timeout(Duration::from_secs(10));
    // Given back from a runtime driven while the write is awaited (sqlx
    // gives a connection back from a task spawned where it is dropped).
    let written = caller.block_on(async {
        drop(held);
        tokio::time::timeout(Duration::from_secs(10), write).await
    });
    written.expect("answered").unwrap();
    setup.block_on(async {
        assert_eq!(
            state_seen_elsewhere(&path, &keys[1]).await.unwrap().0,
            "completed"
        );
        assert_eq!(
            state_seen_elsewhere(&path, &keys[0]).await.unwrap().0,
            "in_progress"
        );
        served_within(&store, Duration::from_secs(5)).await;
    });
}

/// The documented one-connection database in memory, its leader on a
/// multi-thread runtime waiting for the pool's one connection (in use
/// elsewhere), which sqlx is handing over through an application's
/// `before_acquire` check, held open here, when that runtime shuts down:
/// the leader goes on from the writers' thread, the connection is not
/// dropped halfway through sqlx's hand-over (which closes it, and a
/// database in memory with it), the write queued from another runtime is
/// written, one whose caller went with the runtime is not, and the database
/// serves on.
#[test]
fn a_leader_whose_runtime_goes_while_the_pool_hands_it_a_connection_loses_no_database_in_memory() {
    let hold: HookHold = Arc::default();
    let table = idem_testkit::unique("handed_over").replace('-', "_");
    let setup = runtime();
    let store = setup.block_on(async {
        let hook = hold.clone();
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .before_acquire(move |_, _| hook_stop(&hook))
            .connect("sqlite::memory:")
            .await
            .unwrap();
        // A table of its own: its leader's pause point is keyed by it.
        let store = SqliteStore::new(pool)
            .with_table(&table)
            .unwrap()
            .with_timeout(Duration::from_secs(120));
        store.migrate().await.unwrap();
        store
    });
    let keys = [
        idem_testkit::unique("paid"),
        idem_testkit::unique("given-up"),
        idem_testkit::unique("queued"),
    ];
    let (tokens, busy) = setup.block_on(async {
        let paid = reserved(&store, &keys[0]).await;
        store
            .complete(&id(&keys[0]), paid, &answer(&keys[0]))
            .await
            .unwrap();
        let tokens = [reserved(&store, &keys[1]).await, reserved(&store, &keys[2]).await];
        // The connection in use elsewhere (an application's), once the
        // set-up's leader has given it back.
        let busy = tokio::time::timeout(Duration::from_secs(10), store.pool().acquire())
            .await
            .unwrap()
            .unwrap();
        (tokens, busy)
    });
    let (reached_tx, reached) = mpsc::channel();
    let (release, release_rx) = tokio::sync::oneshot::channel();
    *hold.lock().unwrap() = Some((reached_tx, release_rx));
    let first = idem_testkit::multi_thread(1);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    // A completion from `first` starts the leader there (which finds no
    // idle connection); its caller goes with `first`.
    let (given_up, given_up_body) = (id(&keys[1]), answer(&keys[1]));
    let waits = pause::arm(
        pause::SQLITE_GROUP_WAITS_FOR_A_CONNECTION,
        &format!("\"{table}\""),
    );
    first.block_on(async {
        let mut write = store.complete(&given_up, tokens[0], &given_up_body);
        assert!(write.as_mut().poll(&mut cx).is_pending());
        let mut waits = waits;
        tokio::time::timeout(Duration::from_secs(20), waits.reached())
            .await
            .expect("the leader finds no idle connection");
        waits.resume();
    });
    let caller = runtime();
    let (queued, queued_body) = (id(&keys[2]), answer(&keys[2]));
    let mut write = store.complete(&queued, tokens[1], &queued_body);
    {
        let _context = caller.enter();
        assert!(write.as_mut().poll(&mut cx).is_pending());
    }
    // The connection given back (from the runtime that drops it, driven
    // meanwhile) is being handed to the leader, held in the check.
    setup.block_on(async {
        drop(busy);
        tokio::task::spawn_blocking(move || reached.recv_timeout(Duration::from_secs(20)))
            .await
            .unwrap()
            .expect("the connection's hand-over is held in its check");
    });
    first.shutdown_timeout(Duration::from_secs(10));
    drop(release);
    let written = caller.block_on(async { tokio::time::timeout(Duration::from_secs(10), write).await });
    written.expect("answered").unwrap();
    caller.block_on(async {
        assert_replays(&store, &keys[0]).await;
        assert_replays(&store, &keys[2]).await;
        let given_up: Option<(String,)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT state FROM \"{table}\" WHERE key = ?"
        )))
        .bind(&keys[1])
        .fetch_optional(store.pool())
        .await
        .unwrap();
        assert_eq!(given_up, Some(("in_progress".to_owned(),)));
        served_within(&store, Duration::from_secs(5)).await;
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

/// Waits (10 s at most) until the record of `key` is gone, given back as a
/// fresh key was; then a retry takes the key.
async fn given_back_and_taken_again(store: &SqliteStore, key: &str) {
    let until = Instant::now() + Duration::from_secs(10);
    while row(store, key).await.is_some() && Instant::now() < until {
        tokio::task::yield_now().await;
    }
    assert_eq!(row(store, key).await, None, "a lock nobody holds stayed");
    let retry = store.reserve(req(&id(key), "retry-token")).await;
    assert!(matches!(retry, Ok(Reservation::Reserved(_))), "{retry:?}");
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
        given_back_and_taken_again(&patient, &gone).await;
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

/// A reservation answered (committed, its lease handed to its channel)
/// while its caller's current-thread runtime is not driven, and that
/// runtime then shut down before the caller read the answer: the key is
/// given back on the writers' thread, as when the caller had gone before
/// the answer came, not left locked until its lock timeout.
#[test]
fn a_reservation_answered_to_a_runtime_shut_down_before_reading_it_leaves_no_lock() {
    let main = two_workers();
    let (store, _dir) = main.block_on(idem_testkit::sqlite_store());
    let store = store.with_timeout(Duration::from_secs(10));
    let unread = idem_testkit::unique("unread");
    let mut paused = pause::arm(pause::SQLITE_RESERVE_BEFORE_COMMIT, &unread);
    let caller = runtime();
    let token = idem_testkit::token();
    drop(caller.spawn({
        let (store, unread) = (store.clone(), unread.clone());
        async move { store.reserve(req(&id(&unread), token)).await }
    }));
    // Driven until its reservation's write is in its group, then idle.
    caller.block_on(paused.reached());
    paused.resume();
    main.block_on(async {
        // Committed: its answer is in the caller's channel, unread.
        let until = Instant::now() + Duration::from_secs(10);
        while row(&store, &unread).await.is_none() && Instant::now() < until {
            tokio::task::yield_now().await;
        }
        let committed = row(&store, &unread).await;
        assert_eq!(committed.map(|r| r.1), Some(Some(token.to_owned())));
    });
    drop(caller);
    main.block_on(given_back_and_taken_again(&store, &unread));
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

/// An execution that failed, on a current-thread runtime left idle once
/// its client had the answer: the release that gave up in line is tried
/// again in the background on the writers' thread.
mod a_failed_execution_on_an_idle_runtime {
    use super::*;
    use axum::http::{Request, StatusCode};
    use axum::routing::post;
    use axum::Router;
    use idem::{idempotent, Idem, Operation};
    use tower::ServiceExt as _;

    /// Told when [`fail`] runs; `fail` answers once `GO` says so.
    static STARTED: Mutex<Option<mpsc::Sender<()>>> = Mutex::new(None);
    static GO: Mutex<Option<tokio::sync::oneshot::Receiver<()>>> = Mutex::new(None);

    /// A 5xx: released as failed, to be run again by its retry.
    #[idempotent(scope = "writers.fail")]
    async fn fail(_op: Operation) -> Result<StatusCode, StatusCode> {
        if let Some(started) = STARTED.lock().unwrap().take() {
            let _ = started.send(());
        }
        let go = GO.lock().unwrap().take();
        if let Some(go) = go {
            let _ = go.await;
        }
        Err(StatusCode::BAD_GATEWAY)
    }

    fn failing(key: &str) -> Request<axum::body::Body> {
        keyed("/fail", key)
    }

    /// The execution fails (502) while a write holds the permit; its
    /// release waits in line past the store's timeout (300 ms) and gives
    /// up, and the caller's current-thread runtime is then kept but no
    /// longer driven. Once the permit frees, the key is let go (CONTRACT
    /// section 6: a store call that times out never leaves a lock that no
    /// execution holds), and the same request retried runs again. (The
    /// retry in the background was a task of the idle runtime, never run:
    /// the key stayed locked, by no execution, until its lock timeout; 6
    /// runs in 6.)
    #[test]
    fn its_release_timed_out_in_line_is_tried_again_and_leaves_no_lock() {
        let main = two_workers();
        let (store, _dir) = main.block_on(idem_testkit::sqlite_store());
        let patient = store.clone().with_timeout(Duration::from_secs(10));
        let hasty = store.with_timeout(Duration::from_millis(300));
        let app = Router::new()
            .route("/fail", post(fail))
            .layer(Idem::new(hasty).single_tenant().layer());
        let (started, running) = mpsc::channel();
        *STARTED.lock().unwrap() = Some(started);
        let (go, waiting) = tokio::sync::oneshot::channel();
        *GO.lock().unwrap() = Some(waiting);
        let key = idem_testkit::unique("fail");
        let (answered, answer) = mpsc::channel();
        let idle = {
            let (app, key) = (app.clone(), key.clone());
            std::thread::spawn(move || {
                let idle = runtime();
                let response = idle.block_on(app.oneshot(failing(&key))).unwrap();
                let _ = answered.send(response.status());
                // Kept, and not driven, until the end.
                idle
            })
        };
        running
            .recv_timeout(Duration::from_secs(20))
            .expect("the handler runs");
        let (paused, _holder) = main.block_on(hold_the_permit(&patient));
        go.send(()).unwrap();
        let status = answer
            .recv_timeout(Duration::from_secs(20))
            .expect("the failed execution is answered");
        assert_eq!(status, StatusCode::BAD_GATEWAY);
        let idle = idle.join().unwrap();
        main.block_on(async {
            drop(paused);
            let until = Instant::now() + Duration::from_secs(10);
            while row(&patient, &key).await.and_then(|r| r.1).is_some() {
                assert!(Instant::now() < until, "a lock nobody holds stayed");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let retried = Router::new()
                .route("/fail", post(fail))
                .layer(Idem::new(patient.clone()).single_tenant().layer())
                .oneshot(failing(&key))
                .await
                .unwrap();
            // Run again (and failing again), not 409.
            assert_eq!(retried.status(), StatusCode::BAD_GATEWAY);
        });
        drop(idle);
    }
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

    /// Opens the handler's transaction and writes its effect there.
    async fn effect_written(
        op: &Operation,
    ) -> Result<idem::TxConnection<'_, sqlx::SqliteConnection>, StatusCode> {
        let mut conn = op
            .sqlite_transaction()
            .await
            .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
        sqlx::query("INSERT INTO effects (id) VALUES (?1)")
            .bind(op.derived_key("effect"))
            .execute(&mut *conn)
            .await
            .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
        Ok(conn)
    }

    #[idempotent(scope = "writers.tx")]
    async fn pay(op: Operation) -> Result<StatusCode, StatusCode> {
        drop(effect_written(&op).await?);
        Ok(StatusCode::CREATED)
    }

    fn paid(key: &str) -> Request<axum::body::Body> {
        keyed("/pay", key)
    }

    /// The documented one-connection database in memory, a handler's own
    /// transaction served from a multi-thread runtime that shuts down while the
    /// transaction's COMMIT is under way (held in a commit hook): the commit's
    /// task goes on from the writers' thread, so the connection goes back to
    /// the pool instead of being closed with that runtime's tasks, and the
    /// database, its effect and its record live on; the retry is a replay.
    /// (The commit's task was a task of that runtime's: the database was lost
    /// in about half of the runs.)
    #[test]
    fn a_handler_transaction_whose_runtime_goes_during_its_commit_loses_no_database_in_memory() {
        let hold = Arc::new(Hold::default());
        let (held, release) = hold.channels();
        let setup = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let store = setup.block_on(async {
            let hooks = hold.clone();
            let pool = SqlitePoolOptions::new()
                .max_connections(1)
                .after_connect(move |conn, _| Box::pin(hold_commits_writing(conn, hooks.clone(), "effects")))
                .connect("sqlite::memory:")
                .await
                .unwrap();
            let store = idem::SqliteStore::new(pool).with_timeout(Duration::from_secs(20));
            store.migrate().await.unwrap();
            sqlx::query("CREATE TABLE effects (id TEXT PRIMARY KEY)")
                .execute(store.pool())
                .await
                .unwrap();
            store
        });
        let app = Router::new()
            .route("/pay", post(pay))
            .layer(Idem::new(store.clone()).single_tenant().layer());
        let key = idem_testkit::unique("pay");
        let a = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        {
            let (app, key) = (app.clone(), key.clone());
            a.spawn(async move {
                let _ = app.oneshot(paid(&key)).await;
            });
        }
        held.recv_timeout(Duration::from_secs(20))
            .expect("the handler's commit is held");
        a.shutdown_timeout(Duration::from_secs(10));
        release.send(()).unwrap();
        setup.block_on(async {
            let effects = tokio::time::timeout(
                Duration::from_secs(10),
                sqlx::query_scalar::<_, i64>("SELECT count(*) FROM effects").fetch_one(store.pool()),
            )
            .await;
            let records = tokio::time::timeout(
                Duration::from_secs(10),
                sqlx::query_scalar::<_, i64>("SELECT count(*) FROM idempotency_keys").fetch_one(store.pool()),
            )
            .await;
            assert!(
                matches!(effects, Ok(Ok(1))) && matches!(records, Ok(Ok(1))),
                "the database in memory: effects {effects:?}, records {records:?}"
            );
            let replay = tokio::time::timeout(Duration::from_secs(10), app.oneshot(paid(&key)))
                .await
                .expect("the retry is answered")
                .unwrap();
            assert_eq!(replay.status(), StatusCode::CREATED);
            assert!(replay.headers().contains_key("idempotent-replayed"));
        });
    }

    /// Told when [`pay_and_stay`] has written its effect.
    static WROTE: Mutex<Option<mpsc::Sender<()>>> = Mutex::new(None);

    /// Writes its effect in its own transaction, then never returns.
    #[idempotent(scope = "writers.tx.stays")]
    async fn pay_and_stay(op: Operation) -> Result<StatusCode, StatusCode> {
        let _conn = effect_written(&op).await?;
        if let Some(wrote) = WROTE.lock().unwrap().take() {
            let _ = wrote.send(());
        }
        std::future::pending::<()>().await;
        Ok(StatusCode::CREATED)
    }

    /// The documented one-connection database in memory, a handler's own
    /// transaction still open (its effect written, not committed) when the
    /// multi-thread runtime it runs on shuts down, as a process's runtime
    /// does when a service stops: the transaction is rolled back and its
    /// connection goes back to the pool, so the database lives on, without
    /// the effect, the key held by the execution that died (as after a
    /// crash: its lock runs out), and later requests are served. (The
    /// transaction was dropped where its task went, and sqlx's give-back
    /// with it: 10 runs in 10 lost the database.)
    #[test]
    fn a_handler_transaction_open_when_its_runtime_shuts_down_loses_no_database_in_memory() {
        let setup = two_workers();
        let store = setup
            .block_on(in_memory_store())
            .with_timeout(Duration::from_secs(10));
        setup
            .block_on(sqlx::query("CREATE TABLE effects (id TEXT PRIMARY KEY)").execute(store.pool()))
            .unwrap();
        let app = Router::new()
            .route("/pay", post(pay_and_stay))
            .layer(Idem::new(store.clone()).single_tenant().layer());
        let (wrote, written) = mpsc::channel();
        *WROTE.lock().unwrap() = Some(wrote);
        let a = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let key = idem_testkit::unique("stays");
        a.spawn(app.clone().oneshot(paid(&key)));
        written
            .recv_timeout(Duration::from_secs(20))
            .expect("the handler wrote its effect");
        a.shutdown_timeout(Duration::from_secs(10));
        setup.block_on(async {
            let count = |table: &'static str| {
                let pool = store.pool().clone();
                async move {
                    tokio::time::timeout(
                        Duration::from_secs(10),
                        sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(format!(
                            "SELECT count(*) FROM {table}"
                        )))
                        .fetch_one(&pool),
                    )
                    .await
                }
            };
            let (records, effects) = (count("idempotency_keys").await, count("effects").await);
            assert!(
                matches!(records, Ok(Ok(1))) && matches!(effects, Ok(Ok(0))),
                "the database in memory: records {records:?}, effects {effects:?}"
            );
            let retry = tokio::time::timeout(Duration::from_secs(10), app.oneshot(paid(&key)))
                .await
                .expect("the retry is answered")
                .unwrap();
            assert_eq!(retry.status(), StatusCode::CONFLICT);
            served_within(&store, Duration::from_secs(5)).await;
        });
    }

    /// A handler's transaction committed on a multi-thread runtime that
    /// shuts down while the connection goes back to the pool (held in the
    /// pool's `after_release`): the transaction is dropped from the
    /// writers' thread, where its give-back runs, and the database in
    /// memory lives on, its effect and its record replayed. (Dropped at the
    /// end of the commit's task, on the caller's runtime, sqlx's give-back
    /// was a task of that runtime: 10 runs in 10 lost the database.)
    #[test]
    fn a_handler_transaction_given_back_as_its_runtime_shuts_down_loses_no_database_in_memory() {
        let hold: HookHold = Arc::default();
        let setup = runtime();
        let store = setup.block_on(held_in_memory(hold.clone(), HookAt::GiveBack));
        let app = Router::new()
            .route("/pay", post(pay))
            .layer(Idem::new(store.clone()).single_tenant().layer());
        let key = idem_testkit::unique("pay");
        let mut before_commit = pause::arm(pause::TX_BEFORE_COMMIT, &key);
        let caller = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        caller.spawn(app.clone().oneshot(paid(&key)));
        setup.block_on(async {
            tokio::time::timeout(Duration::from_secs(20), before_commit.reached())
                .await
                .expect("the handler's commit is due");
        });
        // The transaction holds the pool's one connection: the next
        // give-back is the one after its commit.
        let (reached_tx, reached) = mpsc::channel();
        let (release, release_rx) = tokio::sync::oneshot::channel();
        *hold.lock().unwrap() = Some((reached_tx, release_rx));
        before_commit.resume();
        reached
            .recv_timeout(Duration::from_secs(20))
            .expect("the connection's give-back after the commit is held");
        caller.shutdown_timeout(Duration::from_secs(10));
        drop(release);
        setup.block_on(async {
            let replay = tokio::time::timeout(Duration::from_secs(10), app.oneshot(paid(&key)))
                .await
                .expect("the retry is answered")
                .unwrap();
            assert_eq!(replay.status(), StatusCode::CREATED);
            assert!(replay.headers().contains_key("idempotent-replayed"));
            let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
                .fetch_one(store.pool())
                .await
                .unwrap();
            assert_eq!(effects, 1);
        });
    }

    /// The hold that [`pay_in_turn`] arms for the pool's next check, and
    /// the ends of it the test keeps.
    #[allow(clippy::type_complexity)]
    static ARM: Mutex<Option<(HookHold, (mpsc::Sender<()>, tokio::sync::oneshot::Receiver<()>))>> =
        Mutex::new(None);

    /// [`pay`], arming first the hold of the pool's next check: the one of
    /// its `BEGIN`.
    #[idempotent(scope = "writers.tx.begin")]
    async fn pay_in_turn(op: Operation) -> Result<StatusCode, StatusCode> {
        if let Some((hold, ends)) = ARM.lock().unwrap().take() {
            *hold.lock().unwrap() = Some(ends);
        }
        drop(effect_written(&op).await?);
        Ok(StatusCode::CREATED)
    }

    /// A handler's `BEGIN` done on the writers' thread and its transaction
    /// on its way to the handler, whose current-thread runtime, not driven
    /// at that moment, is then dropped (a service stopping) with the
    /// handler's task woken but not run: the transaction, held from its
    /// `BEGIN` on in what drops it from the writers' runtime, is rolled
    /// back there and its connection given back, so the pool still counts
    /// its one connection and the database in memory lives on. (The bare
    /// transaction was dropped with the task, and sqlx closed the
    /// connection: 6 runs in 6.)
    #[test]
    fn a_transaction_begun_but_not_yet_taken_when_its_runtime_shuts_down_loses_no_database_in_memory() {
        let hold: HookHold = Arc::default();
        let setup = two_workers();
        let store = setup.block_on(held_in_memory(hold.clone(), HookAt::Check));
        let app = Router::new()
            .route("/pay", post(pay_in_turn))
            .layer(Idem::new(store.clone()).single_tenant().layer());
        let (reached_tx, reached) = mpsc::channel();
        let (release, release_rx) = tokio::sync::oneshot::channel();
        *ARM.lock().unwrap() = Some((hold.clone(), (reached_tx, release_rx)));
        let caller = runtime();
        caller.spawn(app.clone().oneshot(paid(&idem_testkit::unique("begin"))));
        // Driven until the handler's BEGIN is in the pool's check (on the
        // writers' thread, in its turn at the write permit).
        caller.block_on(async {
            let until = Instant::now() + Duration::from_secs(20);
            while reached.try_recv().is_err() {
                assert!(
                    Instant::now() < until,
                    "the handler's BEGIN never reached the pool's check"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        });
        // Not driven from here: the BEGIN goes on, and its answer wakes the
        // handler's task into the runtime's queue.
        drop(release);
        let until = Instant::now() + Duration::from_secs(20);
        while caller.metrics().global_queue_depth() == 0 {
            assert!(Instant::now() < until, "the handler was never answered");
            std::thread::sleep(Duration::from_millis(2));
        }
        drop(caller);
        // Given back from the writers' runtime, the connection is still
        // counted; closed with the runtime, the pool would count none.
        let counted = store.pool().size();
        setup.block_on(async {
            let effects = tokio::time::timeout(
                Duration::from_secs(10),
                sqlx::query_scalar::<_, i64>("SELECT count(*) FROM effects").fetch_one(store.pool()),
            )
            .await;
            assert!(
                counted == 1 && matches!(effects, Ok(Ok(0))),
                "the pool counts {counted} connections right after; effects in the database in memory: \
                 {effects:?}"
            );
            served_within(&store, Duration::from_secs(5)).await;
        });
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

// What a caller is told when something fails in a group, against what the
// file holds, read from a connection of its own (another process's view).
// Writes are put in a known order in the queue by pause points and by
// futures polled by hand.

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
        poison_completions(&store, raise).await;
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
/// completion issued from another runtime, and a reservation) waits before
/// its commit: the group goes on from the writers' thread once let go, the
/// completion is committed and told so, the reservation too; the store
/// serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_whose_leaders_runtime_shuts_down_goes_on_and_answers_each_caller() {
    let (store, dir) = idem_testkit::sqlite_store().await;
    // No caller gives up on its own (that answer is "not known", whatever
    // is then committed): each is answered by the group.
    let store = store.with_timeout(Duration::from_secs(120));
    let path = dir.path().join("idem.db");
    let key = idem_testkit::unique("cross");
    // Not through `store`: the holder's group must be led from rt1.
    let token = reserved_elsewhere(&path, &key).await;
    let rt1 = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // The holder's reservation starts the leader on rt1.
    let held = hold_from(&rt1, &store).await;
    let done = tokio::spawn(queue_complete(&store, &key, token));
    let stopper = idem_testkit::unique("stopper");
    let mut stop = pause::arm(pause::SQLITE_RESERVE_BEFORE_COMMIT, &stopper);
    let stopping = tokio::spawn(queue_reserve(&store, &stopper, idem_testkit::token()).await);
    held.resume();
    tokio::time::timeout(Duration::from_secs(20), stop.reached())
        .await
        .unwrap();
    // rt1 goes away (its workers joined) with the leader mid-group.
    tokio::task::spawn_blocking(move || rt1.shutdown_timeout(Duration::from_secs(10)))
        .await
        .unwrap();
    stop.resume();
    let told = tokio::time::timeout(Duration::from_secs(10), done)
        .await
        .expect("answered")
        .unwrap();
    let stopped = tokio::time::timeout(Duration::from_secs(10), stopping)
        .await
        .expect("answered")
        .unwrap();
    told.unwrap();
    assert!(matches!(stopped, Ok(Reservation::Reserved(_))), "{stopped:?}");
    assert_eq!(state_seen_elsewhere(&path, &key).await.unwrap().0, "completed");
    assert_eq!(
        state_seen_elsewhere(&path, &stopper).await.unwrap().0,
        "in_progress"
    );
    let later = idem_testkit::unique("later");
    let t = reserved(&store, &later).await;
    store.complete(&id(&later), t, &answer(&later)).await.unwrap();
    assert_eq!(state_seen_elsewhere(&path, &later).await.unwrap().0, "completed");
}

/// A group leader whose runtime shuts down while its group's COMMIT is
/// under way in sqlx's worker, which runs it whatever becomes of the future
/// that asked. The COMMIT is held by a SQLite commit hook that blocks (on a
/// std channel) when the transaction wrote a marker row, which a trigger
/// writes for keys starting `cut`.
mod cut_in_its_commit {
    use super::*;

    struct Fixture {
        store: SqliteStore,
        path: std::path::PathBuf,
        _dir: tempfile::TempDir,
        held: mpsc::Receiver<()>,
        release: mpsc::Sender<()>,
    }

    async fn fixture(connections: u32) -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("idem.db");
        let file = SqliteConnectOptions::new()
            .filename(&path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(30));
        fixture_on(file, connections, path, dir).await
    }

    async fn fixture_on(
        file: SqliteConnectOptions,
        connections: u32,
        path: std::path::PathBuf,
        dir: tempfile::TempDir,
    ) -> Fixture {
        // Holds the next COMMIT of a transaction that wrote to `marks`.
        let hold = Arc::new(Hold::default());
        let (held, release) = hold.channels();
        let hooks = hold.clone();
        let pool = SqlitePoolOptions::new()
            .max_connections(connections)
            .after_connect(move |conn, _| Box::pin(hold_commits_writing(conn, hooks.clone(), "marks")))
            .connect_with(file)
            .await
            .unwrap();
        let store = SqliteStore::new(pool).with_timeout(Duration::from_secs(120));
        store.migrate().await.unwrap();
        sqlx::raw_sql(
            "CREATE TABLE marks (key TEXT NOT NULL); \
             CREATE TRIGGER mark_ins AFTER INSERT ON idempotency_keys WHEN NEW.key LIKE 'cutr%' \
             BEGIN INSERT INTO marks (key) VALUES (NEW.key); END; \
             CREATE TRIGGER mark_upd AFTER UPDATE ON idempotency_keys \
             WHEN NEW.key LIKE 'cut%' AND NEW.state = 'completed' \
             BEGIN INSERT INTO marks (key) VALUES (NEW.key); END;",
        )
        .execute(store.pool())
        .await
        .unwrap();
        Fixture {
            store,
            path,
            _dir: dir,
            held,
            release,
        }
    }

    fn hold_on(rt: &tokio::runtime::Runtime, store: &SqliteStore) -> pause::Pause {
        rt.block_on(hold_from(rt, store))
    }

    fn leader_runtime() -> tokio::runtime::Runtime {
        idem_testkit::multi_thread(1)
    }

    /// A completion queued (from another runtime) behind a group led on a
    /// multi-thread runtime; that runtime shuts down while the completion's
    /// own COMMIT is under way in sqlx's worker (held there by a commit hook);
    /// then the COMMIT is let go. Its caller is told it is done, and it is
    /// (it used to be told "did not finish", the leader dropped mid-commit).
    #[test]
    fn a_completion_whose_leader_goes_during_its_commit_is_told_done() {
        let setup = runtime();
        let fx = setup.block_on(fixture(8));
        let key = idem_testkit::unique("cut-complete");
        // Reserved through a store of its own on the file (no leader of
        // `fx.store` left anywhere), outside the marker (only completions of
        // `cut%` are marked; the insert is marked too, so hold is not armed yet:
        // use another store whose connections have no hooks).
        let token = idem_testkit::token();
        setup.block_on(async {
            let elsewhere = SqliteStore::open(&fx.path).await.unwrap();
            match elsewhere.reserve(req(&id(&key), token)).await.unwrap() {
                Reservation::Reserved(_) => {}
                other => panic!("{other:?}"),
            }
            elsewhere.pool().close().await;
        });
        let rt1 = leader_runtime();
        let paused = hold_on(&rt1, &fx.store);
        let caller = runtime();
        let body = answer(&key);
        let queued = id(&key);
        let mut write: Fut<Result<(), idem::StoreError>> = {
            let store = fx.store.clone();
            Box::pin(async move { store.complete(&queued, token, &body).await })
        };
        {
            let _context = caller.enter();
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            assert!(write.as_mut().poll(&mut cx).is_pending());
        }
        // The holder's group commits; the leader (on rt1) takes the completion
        // next and is held in its COMMIT.
        paused.resume();
        fx.held
            .recv_timeout(Duration::from_secs(20))
            .expect("the completion's commit is held");
        rt1.shutdown_timeout(Duration::from_secs(10));
        fx.release.send(()).unwrap();
        let told = caller.block_on(async { tokio::time::timeout(Duration::from_secs(20), write).await });
        let told = told.expect("answered");
        let row = caller.block_on(eventually_row(&fx.path, &key, |r| {
            r.as_ref().is_some_and(|r| r.0 == "completed")
        }));
        let completed = row.as_ref().is_some_and(|r| r.0 == "completed");
        assert!(completed && told.is_ok(), "told {told:?}, the file holds {row:?}");
    }

    /// The same with a reservation in a `BEGIN IMMEDIATE` group: its caller is
    /// told it holds the key, and the file holds the key under its token (it
    /// used to be told "did not finish" while the key stayed taken under its
    /// token: a lock nobody held, met by every retry until its timeout).
    #[test]
    fn a_reservation_whose_leader_goes_during_its_commit_is_told_it_holds_the_key() {
        let setup = runtime();
        let fx = setup.block_on(fixture(8));
        let key = idem_testkit::unique("cutr-reserve");
        let rt1 = leader_runtime();
        let paused = hold_on(&rt1, &fx.store);
        let caller = runtime();
        let token = idem_testkit::token();
        let mut write: Fut<Result<Reservation, idem::StoreError>> = {
            let store = fx.store.clone();
            let key = key.clone();
            Box::pin(async move { store.reserve(req(&id(&key), token)).await })
        };
        // Polled by hand past its peek (on the writers' thread) until it joins.
        {
            let mut peeked = pause::arm(pause::SQLITE_RESERVE_AFTER_PEEK, &key);
            let _context = caller.enter();
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            let started = Instant::now();
            loop {
                assert!(write.as_mut().poll(&mut cx).is_pending());
                if peeked.is_reached() {
                    break;
                }
                assert!(started.elapsed() < Duration::from_secs(20));
                std::thread::yield_now();
            }
            peeked.resume();
            assert!(write.as_mut().poll(&mut cx).is_pending());
        }
        paused.resume();
        fx.held
            .recv_timeout(Duration::from_secs(20))
            .expect("the reservation's commit is held");
        rt1.shutdown_timeout(Duration::from_secs(10));
        fx.release.send(()).unwrap();
        let told = caller
            .block_on(async { tokio::time::timeout(Duration::from_secs(20), write).await })
            .expect("answered");
        let row = caller.block_on(eventually_row(&fx.path, &key, |r| r.is_some()));
        let retry = caller.block_on(async {
            tokio::time::timeout(
                Duration::from_secs(20),
                fx.store.reserve(req(&id(&key), idem_testkit::token())),
            )
            .await
            .expect("retry answered")
        });
        assert!(
            matches!(told, Ok(Reservation::Reserved(_))),
            "told {told:?}; the file holds {row:?}"
        );
        assert_eq!(row, Some(("in_progress".to_owned(), Some(token.to_owned()))));
        // The caller holds it: a retry meets its lock.
        assert!(matches!(retry, Ok(Reservation::InProgress { .. })), "{retry:?}");
    }

    /// The documented one-connection database in memory: a group of two
    /// completions (BEGIN IMMEDIATE .. COMMIT on the one connection) whose
    /// leader's runtime shuts down while its COMMIT is held, with a third
    /// completion queued behind it meanwhile. Each of the three is told done
    /// and is completed, the pool still serves, and a transaction the
    /// application drops is rolled back.
    #[test]
    fn a_group_in_memory_whose_leader_goes_during_its_commit_answers_each_and_serves_on() {
        use std::str::FromStr as _;
        let rt1 = leader_runtime();
        let dir = tempfile::tempdir().unwrap();
        let fx = rt1.block_on(fixture_on(
            SqliteConnectOptions::from_str("sqlite::memory:").unwrap(),
            1,
            dir.path().join("unused"),
            dir,
        ));
        let keys = [
            idem_testkit::unique("cut-mem"),
            idem_testkit::unique("plain"),
            idem_testkit::unique("behind"),
        ];
        let tokens: Vec<&'static str> = rt1.block_on(async {
            let mut tokens = Vec::new();
            for k in &keys {
                let t = idem_testkit::token();
                match fx.store.reserve(req(&id(k), t)).await.unwrap() {
                    Reservation::Reserved(_) => tokens.push(t),
                    other => panic!("{other:?}"),
                }
            }
            tokens
        });
        let paused = hold_on(&rt1, &fx.store);
        let caller = runtime();
        let complete = |i: usize| -> Fut<Result<(), idem::StoreError>> {
            let store = fx.store.clone();
            let (key, token) = (keys[i].clone(), tokens[i]);
            let mut fut: Fut<Result<(), idem::StoreError>> =
                Box::pin(async move { store.complete(&id(&key), token, &answer(&key)).await });
            let _context = caller.enter();
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            assert!(fut.as_mut().poll(&mut cx).is_pending());
            fut
        };
        let first = complete(0);
        let second = complete(1);
        paused.resume();
        fx.held
            .recv_timeout(Duration::from_secs(20))
            .expect("the group's commit is held");
        // Queued while the leader is in its commit: written after it.
        let queued = complete(2);
        rt1.shutdown_timeout(Duration::from_secs(10));
        fx.release.send(()).unwrap();
        let mut wrong: Vec<String> = Vec::new();
        caller.block_on(async {
            let store = &fx.store;
            let state = |k: String| async move {
                let row: Option<(String, Option<String>)> =
                    sqlx::query_as("SELECT state, lock_token FROM idempotency_keys WHERE key = ?")
                        .bind(k)
                        .fetch_optional(store.pool())
                        .await
                        .unwrap();
                row
            };
            for (i, fut) in [first, second, queued].into_iter().enumerate() {
                let told = tokio::time::timeout(Duration::from_secs(20), fut).await;
                let row = tokio::time::timeout(Duration::from_secs(10), state(keys[i].clone())).await;
                let completed = matches!(&row, Ok(Some((s, _))) if s == "completed");
                let ok = matches!(told, Ok(Ok(())));
                if !(completed && ok) {
                    wrong.push(format!("{}: told {told:?}, holds {row:?}", keys[i]));
                }
            }
            let later = idem_testkit::unique("later");
            let t = idem_testkit::token();
            let served = tokio::time::timeout(Duration::from_secs(10), async {
                store.reserve(req(&id(&later), t)).await?;
                store.complete(&id(&later), t, &answer(&later)).await
            })
            .await;
            if !matches!(served, Ok(Ok(()))) {
                wrong.push(format!("the pool does not serve: {served:?}"));
            }
            match tokio::time::timeout(
                Duration::from_secs(10),
                idem_testkit::dropped_transaction_rolls_back(store.pool()),
            )
            .await
            {
                Ok(true) => {}
                other => wrong.push(format!("a dropped transaction rolls back: {other:?}")),
            }
        });
        assert!(wrong.is_empty(), "{wrong:#?}");
    }
}

/// A reservation R whose caller goes away after its write ran in its group
/// (a group led on rt1), before the commit: the key R took is given back,
/// from a task of its own, which waits for its turn behind the next group
/// (paused). `shut_down`: whether rt1 shuts down meanwhile. The row R's
/// key holds at the end, and what a retry of R is told.
async fn given_up_mid_group(
    shut_down: bool,
) -> (
    Option<(String, Option<String>)>,
    Result<Reservation, idem::StoreError>,
    &'static str,
) {
    let (store, dir) = idem_testkit::sqlite_store().await;
    let store = store.with_timeout(Duration::from_secs(120));
    let path = dir.path().join("idem.db");
    let rt1 = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    // Group 1: a holder, its leader on rt1, paused before its commit.
    let held = hold_from(&rt1, &store).await;
    // Group 2: R (whose caller will go away), then S (paused).
    let r_key = idem_testkit::unique("gone");
    let r_token = idem_testkit::token();
    let r = queue_reserve(&store, &r_key, r_token).await;
    let s_key = idem_testkit::unique("stop");
    let mut s_stop = pause::arm(pause::SQLITE_RESERVE_BEFORE_COMMIT, &s_key);
    let s = tokio::spawn(queue_reserve(&store, &s_key, idem_testkit::token()).await);
    held.resume();
    tokio::time::timeout(Duration::from_secs(20), s_stop.reached())
        .await
        .unwrap();
    // Group 3: U, queued behind, paused in its turn.
    let u_key = idem_testkit::unique("next");
    let mut u_stop = pause::arm(pause::SQLITE_RESERVE_BEFORE_COMMIT, &u_key);
    let u = tokio::spawn(queue_reserve(&store, &u_key, idem_testkit::token()).await);
    // R's caller goes away after its take ran, before the commit.
    drop(r);
    s_stop.resume();
    let s_told = tokio::time::timeout(Duration::from_secs(20), s)
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(s_told, Ok(Reservation::Reserved(_))), "{s_told:?}");
    tokio::time::timeout(Duration::from_secs(20), u_stop.reached())
        .await
        .unwrap();
    let mut rt1 = Some(rt1);
    if shut_down {
        let rt1 = rt1.take().unwrap();
        tokio::task::spawn_blocking(move || rt1.shutdown_timeout(Duration::from_secs(10)))
            .await
            .unwrap();
    }
    u_stop.resume();
    let u_told = tokio::time::timeout(Duration::from_secs(20), u)
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(u_told, Ok(Reservation::Reserved(_))), "{u_told:?}");
    let row = eventually_row(&path, &r_key, |r| r.is_none()).await;
    let retry = tokio::time::timeout(
        Duration::from_secs(20),
        store.reserve(req(&id(&r_key), idem_testkit::token())),
    )
    .await
    .expect("retry answered");
    if let Some(rt1) = rt1 {
        tokio::task::spawn_blocking(move || rt1.shutdown_timeout(Duration::from_secs(10)))
            .await
            .unwrap();
    }
    (row, retry, r_token)
}

/// Without a shutdown, the key is given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_given_up_mid_group_is_given_back() {
    let (row, retry, _) = given_up_mid_group(false).await;
    assert_eq!(row, None);
    assert!(matches!(retry, Ok(Reservation::Reserved(_))), "{retry:?}");
}

/// The leader's runtime shuts down while the give-back waits for its turn:
/// the key is given back all the same (the give-back used to be a task of
/// that runtime's, dropped with it, and the key stayed taken under the gone
/// caller's token: a lock nobody held, met by every retry).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_given_up_mid_group_is_given_back_though_the_leaders_runtime_goes() {
    let (row, retry, token) = given_up_mid_group(true).await;
    assert_eq!(
        row, None,
        "a lock nobody holds (the gone caller's token is {token}); a retry is told {retry:?}"
    );
    assert!(matches!(retry, Ok(Reservation::Reserved(_))), "{retry:?}");
}

/// A reservation given up on by its caller (its own timeout), from a
/// multi-thread runtime, while another group holds the write permit; the
/// caller's runtime then shuts down. Once the permit is free the write,
/// whose caller is gone, leaves the line: the key was never taken, and the
/// retry takes it. (It used to take the key after all, to be given back
/// from a task of the caller's runtime, dropped with it: the key stayed
/// taken under the gone caller's token until its lock timeout.)
#[test]
fn a_reservation_given_up_then_its_callers_runtime_shut_down_leaves_no_lock() {
    let setup = runtime();
    let (store, _dir) = setup.block_on(idem_testkit::sqlite_store());
    let patient = store.clone().with_timeout(Duration::from_secs(30));
    let hasty = store.with_timeout(Duration::from_millis(300));
    // The write permit held by a group (led on the writers' thread, the
    // setup runtime being current-thread), paused before its commit.
    let holder_key = idem_testkit::unique("holder");
    let mut held = pause::arm(pause::SQLITE_RESERVE_BEFORE_COMMIT, &holder_key);
    let holder = {
        let patient = patient.clone();
        let holder_key = holder_key.clone();
        setup.spawn(async move {
            let _ = patient
                .reserve(req(&id(&holder_key), idem_testkit::token()))
                .await;
        })
    };
    setup.block_on(async {
        tokio::time::timeout(Duration::from_secs(20), held.reached())
            .await
            .expect("the holder reaches its commit")
    });
    // The caller: a multi-thread runtime; its reservation times out in line.
    let gone = idem_testkit::unique("gone");
    let a = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let told = a.block_on(hasty.reserve(req(&id(&gone), "gone-token")));
    assert!(told.is_err(), "{told:?}");
    // The caller's runtime shuts down (the process stopping a server's
    // runtime), then the group commits.
    a.shutdown_timeout(Duration::from_secs(10));
    held.resume();
    setup.block_on(async {
        holder.await.unwrap();
        // Behind the given-up write in the line: once this one is written,
        // that one had its turn.
        reserved(&patient, &idem_testkit::unique("after")).await;
        let left = row(&patient, &gone).await;
        let retry = patient.reserve(req(&id(&gone), "retry-token")).await;
        assert!(
            left.is_none() && matches!(retry, Ok(Reservation::Reserved(_))),
            "a lock nobody holds: the row is {left:?}; the caller was told {told:?}; a retry is told {retry:?}"
        );
    });
}

/// A reservation given up on while its read runs: the read leaves nothing
/// behind, whatever its caller's runtime does next.
mod a_read_given_up_on {
    use super::*;
    use idem::StoreError;
    use std::sync::atomic::AtomicBool;

    /// A record completed with the body `paid`, under a fresh key.
    pub(super) async fn paid_record(store: &SqliteStore) -> String {
        let key = idem_testkit::unique("paid");
        let token = reserved(store, &key).await;
        let body = StoredResponse {
            status: 201,
            headers: vec![],
            body: Some(b"paid".to_vec()),
        };
        store.complete(&id(&key), token, &body).await.unwrap();
        key
    }

    /// A runtime of one worker, the documented one-connection database in
    /// memory, and [`paid_record`]'s key there.
    fn paid_in_memory() -> (tokio::runtime::Runtime, SqliteStore, String) {
        let main = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let store = main.block_on(in_memory_store());
        let paid = main.block_on(paid_record(&store));
        (main, store, paid)
    }

    /// Panics with `lost` and what it is told unless a reservation of
    /// `paid` is, within 10 s, the replay of [`paid_record`]'s answer.
    pub(super) async fn lives_on(store: &SqliteStore, paid: &str, lost: &str) {
        if let Err(told) = replayed(store, paid).await {
            panic!("{lost}: {told}");
        }
    }

    /// Whether a reservation of `key` is, within 10 s, the replay of
    /// [`paid_record`]'s answer; else what it is told.
    pub(super) async fn replayed(store: &SqliteStore, key: &str) -> Result<(), String> {
        let told = tokio::time::timeout(
            Duration::from_secs(10),
            store.reserve(req(&id(key), idem_testkit::token())),
        )
        .await;
        match told {
            Ok(Ok(Reservation::Completed(r))) if r.body.as_deref() == Some(&b"paid"[..]) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    }

    /// Set when the held `before_acquire` check was dropped before it ended.
    static CHECK_CUT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

    type CheckHold = Arc<Mutex<Option<tokio::sync::oneshot::Receiver<()>>>>;

    async fn store_with_hook(hold: CheckHold, table: &str) -> SqliteStore {
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .before_acquire(move |_, _| {
                let armed = hold.lock().unwrap().take();
                Box::pin(async move {
                    if let Some(release) = armed {
                        struct Cut;
                        impl Drop for Cut {
                            fn drop(&mut self) {
                                CHECK_CUT.store(true, std::sync::atomic::Ordering::SeqCst);
                            }
                        }
                        let cut = Cut;
                        let _ = release.await;
                        std::mem::forget(cut);
                    }
                    Ok(true)
                })
            })
            .connect("sqlite::memory:")
            .await
            .unwrap();
        let store = SqliteStore::new(pool)
            .with_table(table)
            .unwrap()
            .with_timeout(Duration::from_millis(300));
        store.migrate().await.unwrap();
        store
    }

    /// A reservation given up on (its own timeout) while the pool hands its
    /// read the connection (held in the application's `before_acquire` check):
    /// the read now takes an idle connection without that check, or has one
    /// acquired on the writers' thread, so the hand-over is never cut halfway
    /// (sqlx closed the connection, and the database in memory was lost: 70
    /// runs in 72).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reservation_timed_out_in_its_read_loses_no_database_in_memory() {
        let hold: CheckHold = Arc::default();
        // A table of its own: the read's pause point is keyed by it.
        let table = idem_testkit::unique("checked").replace('-', "_");
        let store = store_with_hook(hold.clone(), &table).await;
        let paid = paid_record(&store).await;
        // The connection in use elsewhere: the read finds none idle, and
        // asks the pool, whose next hand-over is held in the check.
        let busy = store.pool().acquire().await.unwrap();
        let (release, held) = tokio::sync::oneshot::channel();
        *hold.lock().unwrap() = Some(held);
        let mut waits = pause::arm(
            pause::SQLITE_GROUP_WAITS_FOR_A_CONNECTION,
            &format!("\"{table}\""),
        );
        let fresh = idem_testkit::unique("fresh");
        let reserving = {
            let store = store.clone();
            tokio::spawn(async move { store.reserve(req(&id(&fresh), idem_testkit::token())).await })
        };
        tokio::time::timeout(Duration::from_secs(20), waits.reached())
            .await
            .expect("the read finds no idle connection");
        waits.resume();
        drop(busy);
        let r = reserving.await.unwrap();
        assert!(matches!(r, Err(StoreError::Unavailable { .. })), "{r:?}");
        drop(release);
        // The database in memory lives on: the completed record is replayed.
        if let Err(told) = replayed(&store, &paid).await {
            panic!(
                "the completed record is not replayed (database in memory lost?): {told}; \
                 the pool's check was cut halfway: {}",
                CHECK_CUT.load(std::sync::atomic::Ordering::SeqCst)
            );
        }
    }

    /// A store on the documented one-connection database in memory, whose next
    /// statement after arming is held (SQLite's progress handler) until
    /// released; a completed record "paid".
    fn fixture(main: &tokio::runtime::Runtime) -> (SqliteStore, Arc<Hold>, String) {
        let hold = Arc::new(Hold::default());
        let store = main.block_on(async {
            let pool = hooked_in_memory(hold.clone(), |handle, hold| {
                handle.set_progress_handler(1, move || {
                    hold.stop_if_armed();
                    true
                });
            })
            .await;
            let store = SqliteStore::new(pool).with_timeout(Duration::from_millis(300));
            store.migrate().await.unwrap();
            store
        });
        let paid = main.block_on(paid_record(&store));
        (store, hold, paid)
    }

    /// Tries for up to 5 s to get the completed record replayed.
    async fn replayed_eventually(store: &SqliteStore, paid: &str) -> Result<(), String> {
        let until = Instant::now() + Duration::from_secs(5);
        let mut last = String::new();
        while Instant::now() < until {
            match store.reserve(req(&id(paid), idem_testkit::token())).await {
                Ok(Reservation::Completed(r)) if r.body.as_deref() == Some(&b"paid"[..]) => return Ok(()),
                other => last = format!("{other:?}"),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(last)
    }

    /// A reservation given up on (its own timeout) while its read's statement
    /// runs (held by SQLite's progress handler), from a current-thread runtime
    /// then left idle: the read's connection goes back to the pool from the
    /// writers' thread once the statement ends (sqlx gave it back from a task
    /// of that idle runtime, which never ran: the pool of one stalled for
    /// good, 10 runs in 10).
    #[test]
    fn a_read_timed_out_mid_statement_on_an_idle_runtime_gives_its_connection_back() {
        let main = two_workers();
        let (store, hold, paid) = fixture(&main);
        let (held, release) = hold.channels();
        hold.arm(true);
        let idle = {
            let store = store.clone();
            std::thread::spawn(move || {
                let idle = runtime();
                let fresh = id(&idem_testkit::unique("fresh"));
                let r = idle.block_on(store.reserve(req(&fresh, idem_testkit::token())));
                assert!(matches!(r, Err(StoreError::Unavailable { .. })), "{r:?}");
                // Kept, and not driven, until the end.
                idle
            })
            .join()
            .unwrap()
        };
        held.recv_timeout(Duration::from_secs(1))
            .expect("the read's statement was held");
        release.send(()).unwrap();
        let served = main.block_on(replayed_eventually(&store, &paid));
        drop(idle);
        served.expect("the store serves again once the held read ended (its connection given back)");
    }

    /// The same from a multi-thread runtime that then shuts down: the database
    /// in memory lives on (the give-back, a task of that runtime, was dropped
    /// with it, and sqlx closed the connection: 8 runs in 10).
    #[test]
    fn a_read_timed_out_mid_statement_then_its_runtime_shut_down_loses_no_database_in_memory() {
        let main = two_workers();
        let (store, hold, paid) = fixture(&main);
        let (held, release) = hold.channels();
        hold.arm(true);
        let caller = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let fresh = id(&idem_testkit::unique("fresh"));
        let r = caller.block_on(store.reserve(req(&fresh, idem_testkit::token())));
        assert!(matches!(r, Err(StoreError::Unavailable { .. })), "{r:?}");
        held.recv_timeout(Duration::from_secs(1))
            .expect("the read's statement was held");
        caller.shutdown_timeout(Duration::from_secs(10));
        release.send(()).unwrap();
        main.block_on(replayed_eventually(&store, &paid))
            .expect("the database in memory lives on: the completed record is replayed");
    }

    struct Flag(AtomicBool);
    impl std::task::Wake for Flag {
        fn wake(self: Arc<Self>) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    /// A reservation's read waiting for a connection acquired on the writers'
    /// runtime (the pool's one connection in use elsewhere), cut (its caller
    /// gives up) after that acquisition has ended but before the read is
    /// polled again: the acquired connection, the output of the acquisition's
    /// task, is dropped with it. Returns the main runtime, the store, and the
    /// caller's current-thread runtime (left as it is). `in_caller`: dropped
    /// in that runtime's context, or on a thread outside any runtime.
    fn cut_read(
        key: &str,
        in_caller: bool,
    ) -> (
        tokio::runtime::Runtime,
        SqliteStore,
        String,
        tokio::runtime::Runtime,
    ) {
        let (main, store, paid) = paid_in_memory();
        // Someone else holds the pool's one connection for a while.
        let held = main.block_on(async { store.pool().acquire().await.unwrap() });
        let caller = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let flag = Arc::new(Flag(AtomicBool::new(false)));
        let waker = std::task::Waker::from(flag.clone());
        let rid = id(key);
        {
            let mut _in = Some(caller.enter());
            let mut fut = store.reserve(req(&rid, "tok-cut"));
            assert!(fut
                .as_mut()
                .poll(&mut std::task::Context::from_waker(&waker))
                .is_pending());
            // The read waits for the acquisition on the writers' runtime.
            main.block_on(async move { drop(held) });
            // The acquisition ends: the read's task is woken (not yet polled).
            let until = std::time::Instant::now() + Duration::from_secs(10);
            while !flag.0.load(Ordering::SeqCst) {
                assert!(std::time::Instant::now() < until, "never woken");
                std::thread::yield_now();
            }
            if !in_caller {
                // Dropped on a thread outside any runtime.
                _in = None;
            }
            // Its caller gives up on it (its own timeout, a select!).
            drop(fut);
        }
        (main, store, paid, caller)
    }

    /// ... from a current-thread runtime then left idle: the pool of one serves
    /// on (the connection was given back from a task of that runtime, which
    /// never ran: 10 runs in 10).
    #[test]
    fn a_read_cut_after_its_acquisition_stalls_no_pool_of_one() {
        let (main, store, paid, _caller_left_idle) = cut_read("fresh-idle", true);
        main.block_on(lives_on(&store, &paid, "the pool of one is stalled"));
    }

    /// ... from a current-thread runtime then dropped: the database in memory
    /// lives on (10 in 10 lost).
    #[test]
    fn a_read_cut_after_its_acquisition_loses_no_database_in_memory() {
        let (main, store, paid, caller) = cut_read("fresh-dropped", true);
        drop(caller);
        main.block_on(lives_on(&store, &paid, "the database in memory was lost"));
    }

    /// ... dropped on a thread outside any runtime (where sqlx's give-back
    /// panics): the database in memory lives on (9 in 10 lost).
    #[test]
    fn a_read_cut_after_its_acquisition_outside_any_runtime_loses_no_database_in_memory() {
        let (main, store, paid, _caller) = cut_read("fresh-nort", false);
        main.block_on(lives_on(&store, &paid, "the database in memory was lost"));
    }

    /// A read done from a multi-thread runtime that shuts down right after (its
    /// reservation paused after the read): the read's connection goes back to
    /// the pool all the same, and the database in memory lives on (sqlx's
    /// give-back was a task of that runtime, dropped with it: 28 runs in 100
    /// lost the database).
    #[test]
    fn a_read_done_just_before_its_runtime_shuts_down_loses_no_database_in_memory() {
        let (main, store, paid) = paid_in_memory();
        main.block_on(async {
            // The connection back in the pool (given back by a task).
            let until = std::time::Instant::now() + Duration::from_secs(10);
            while store.pool().num_idle() != 1 {
                assert!(std::time::Instant::now() < until, "never given back");
                tokio::task::yield_now().await;
            }
        });
        let caller = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let fresh_key = idem_testkit::unique("fresh");
        let mut armed = pause::arm(pause::SQLITE_RESERVE_AFTER_PEEK, &fresh_key);
        let s2 = store.clone();
        let _task = caller.spawn(async move {
            let fresh = id(&fresh_key);
            let _ = s2.reserve(req(&fresh, "tok-fresh")).await;
        });
        main.block_on(armed.reached());
        caller.shutdown_background();
        drop(armed);
        main.block_on(lives_on(&store, &paid, "the database in memory was lost"));
    }
}

/// The writes outside the groups (a release, a rejection, a hand-back, a
/// lock extension, a checkpoint, the janitor's batches, a handler's
/// `BEGIN`) take their connection from the pool and give it back through
/// sqlx: they run on the writers' thread, so a caller's runtime that shuts
/// down, or the store's timeout, cuts neither sqlx's hand-over of the
/// connection nor its give-back (either cut, sqlx closed the connection,
/// and the documented one-connection database in memory was lost).
mod writes_outside_the_groups {
    use super::a_read_given_up_on::{lives_on, paid_record, replayed};
    use super::*;
    use std::sync::atomic::AtomicBool;

    /// A runtime of one worker, which the tests shut down.
    fn one_worker() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap()
    }

    /// The documented one-connection database in memory, whose next
    /// COMMIT once `hold` is armed stops there (idem's table is `WITHOUT
    /// ROWID`: no update hook tells its writes), and a record "paid".
    fn held_commits(setup: &tokio::runtime::Runtime, hold: Arc<Hold>) -> (SqliteStore, String) {
        setup.block_on(async {
            let pool = hooked_in_memory(hold, |handle, hold| {
                handle.set_commit_hook(move || {
                    hold.stop_if_armed();
                    true
                });
            })
            .await;
            let store = SqliteStore::new(pool).with_timeout(Duration::from_secs(20));
            store.migrate().await.unwrap();
            let paid = paid_record(&store).await;
            (store, paid)
        })
    }

    /// `write` of a key reserved for it, from a multi-thread runtime that
    /// shuts down while the write's COMMIT is held (a server stopping while
    /// an execution lets its key go, or its heartbeat extends its lock):
    /// the write ends, and the database in memory lives on. (Run from the
    /// caller's task, the write's connection was closed with that runtime's
    /// tasks: the database was lost in 5 to 9 runs in 10, by write; it
    /// survives when sqlx opens the next connection before the old one is
    /// closed.)
    fn cut_by_its_runtime_shutting_down(write: &'static str) {
        let hold = Arc::new(Hold::default());
        let setup = runtime();
        let (store, paid) = held_commits(&setup, hold.clone());
        let key = idem_testkit::unique(write);
        let token = setup.block_on(reserved(&store, &key));
        let (held, release) = hold.channels();
        hold.arm(true);
        let caller = one_worker();
        {
            let (store, key) = (store.clone(), key.clone());
            caller.spawn(async move {
                let id = id(&key);
                let _ = match write {
                    "release" => store.release(&id, token).await,
                    "reject" => store.reject(&id, token).await,
                    "hand_back" => store.hand_back(&id, token, false).await,
                    "extend" => store.extend_lock(&id, token, LONG).await,
                    _ => store.checkpoint(&id, token, "step-1").await,
                };
            });
        }
        held.recv_timeout(Duration::from_secs(20))
            .expect("the write's commit is held");
        caller.shutdown_timeout(Duration::from_secs(10));
        release.send(()).unwrap();
        setup.block_on(async {
            lives_on(
                &store,
                &paid,
                &format!("{write}: the database in memory was lost"),
            )
            .await;
            // The write itself went through: a key let go is taken again.
            if matches!(write, "release" | "reject" | "hand_back") {
                let again = store.reserve(req(&id(&key), idem_testkit::token())).await;
                assert!(
                    matches!(again, Ok(Reservation::Reserved(_))),
                    "{write}: the key was not let go: {again:?}"
                );
            }
        });
    }

    #[test]
    fn a_release_cut_by_its_runtime_shutting_down_loses_no_database_in_memory() {
        cut_by_its_runtime_shutting_down("release");
    }

    #[test]
    fn a_rejection_cut_by_its_runtime_shutting_down_loses_no_database_in_memory() {
        cut_by_its_runtime_shutting_down("reject");
    }

    #[test]
    fn a_hand_back_cut_by_its_runtime_shutting_down_loses_no_database_in_memory() {
        cut_by_its_runtime_shutting_down("hand_back");
    }

    #[test]
    fn a_lock_extension_cut_by_its_runtime_shutting_down_loses_no_database_in_memory() {
        cut_by_its_runtime_shutting_down("extend");
    }

    #[test]
    fn a_checkpoint_cut_by_its_runtime_shutting_down_loses_no_database_in_memory() {
        cut_by_its_runtime_shutting_down("checkpoint");
    }

    /// Waits until the pool's one connection is idle (the set-up's writes
    /// have given it back).
    async fn settled(store: &SqliteStore) {
        let until = Instant::now() + Duration::from_secs(10);
        while store.pool().num_idle() != 1 {
            assert!(Instant::now() < until, "the set-up's connection never came back");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// `check_schema` (a service's start-up check) from a current-thread
    /// runtime that is then left idle, or dropped: the pool's one
    /// connection comes back, and the database in memory lives on. (Run in
    /// the caller's task, sqlx's give-back was a task of that runtime:
    /// never run, the pool of one stalled; dropped, the database was lost;
    /// 10 runs in 10 each.)
    fn check_schema_on_a_current_thread_runtime(then_dropped: bool) {
        let main = one_worker();
        let (store, paid) = main.block_on(async {
            let store = in_memory_store().await;
            let paid = paid_record(&store).await;
            settled(&store).await;
            (store, paid)
        });
        let caller = runtime();
        caller
            .block_on(store.check_schema())
            .expect("the schema is up to date");
        if then_dropped {
            drop(caller);
            main.block_on(async {
                lives_on(&store, &paid, "the database in memory was lost").await;
            });
        } else {
            main.block_on(async {
                lives_on(&store, &paid, "the pool of one is stalled").await;
            });
            drop(caller);
        }
    }

    #[test]
    fn check_schema_on_an_idle_current_thread_runtime_stalls_no_pool_of_one() {
        check_schema_on_a_current_thread_runtime(false);
    }

    #[test]
    fn check_schema_on_a_current_thread_runtime_then_dropped_loses_no_database_in_memory() {
        check_schema_on_a_current_thread_runtime(true);
    }

    /// `migrate` of a second table on the same pool, from a multi-thread
    /// runtime that shuts down while the migration's COMMIT is held (a
    /// service stopping during its start-up): the database in memory, with
    /// the first table's record, lives on. (Run in the caller's task: lost
    /// in 9 runs in 10.)
    #[test]
    fn a_migration_cut_by_its_runtime_shutting_down_loses_no_database_in_memory() {
        let hold = Arc::new(Hold::default());
        let setup = runtime();
        let (store, paid) = held_commits(&setup, hold.clone());
        let second = store.clone().with_table("second_records").unwrap();
        let (held, release) = hold.channels();
        hold.arm(true);
        let caller = one_worker();
        caller.spawn(async move {
            let _ = second.migrate().await;
        });
        held.recv_timeout(Duration::from_secs(20))
            .expect("the migration's commit is held");
        caller.shutdown_timeout(Duration::from_secs(10));
        release.send(()).unwrap();
        setup.block_on(async {
            lives_on(&store, &paid, "the database in memory was lost").await;
        });
    }

    /// `migrate` of a second table given up on by its caller (a start-up
    /// timeout) while the pool's `before_acquire` check of its connection
    /// is under way: the check is not cut halfway, the migration runs to
    /// its end, and the database in memory lives on. (Cut with its caller,
    /// sqlx closed the connection: 10 runs in 10.)
    #[test]
    fn a_migration_given_up_on_in_the_pools_check_loses_no_database_in_memory() {
        let hold: HookHold = Arc::default();
        let main = one_worker();
        let (store, paid) = main.block_on(async {
            let store = held_in_memory(hold.clone(), HookAt::Check).await;
            let paid = paid_record(&store).await;
            settled(&store).await;
            (store, paid)
        });
        let second = store.clone().with_table("second_records").unwrap();
        let (reached, _reached) = mpsc::channel();
        let (release, held) = tokio::sync::oneshot::channel();
        *hold.lock().unwrap() = Some((reached, held));
        let told =
            main.block_on(async { tokio::time::timeout(Duration::from_millis(300), second.migrate()).await });
        assert!(
            told.is_err(),
            "the migration is held in the pool's check: {told:?}"
        );
        drop(release);
        main.block_on(async {
            lives_on(&store, &paid, "the database in memory was lost").await;
            assert!(
                second.check_schema().await.is_ok(),
                "the migration did not run to its end"
            );
        });
    }

    /// The documented database in memory keeps its one connection for the
    /// store's whole life: a pool with sqlx's defaults closes an idle
    /// connection after 10 minutes and every connection after 30, and the
    /// database goes with it (the store built as `SqliteStore::new`'s
    /// documentation built it lost every record after 20 minutes idle).
    #[tokio::test]
    async fn the_database_in_memory_keeps_its_one_connection() {
        let store = SqliteStore::in_memory().await.unwrap();
        let options = store.pool().options();
        assert_eq!(options.get_max_connections(), 1);
        assert_eq!(options.get_idle_timeout(), None);
        assert_eq!(options.get_max_lifetime(), None);
        let paid = paid_record(&store).await;
        replayed(&store, &paid).await.unwrap();
    }

    /// An application's own queries on the in-memory store's pool, each
    /// given up on at its first wait (as a timeout of the application's
    /// that fires there would): no record is lost. (With sqlx's ping before
    /// every hand-over, the pool's default, the first query cut during it
    /// had sqlx close the one connection: 10 runs in 10.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_applications_queries_given_up_on_lose_no_record_in_memory() {
        let store = in_memory_store().await;
        let paid = paid_record(&store).await;
        let waker = futures_util::task::noop_waker();
        let mut cx = std::task::Context::from_waker(&waker);
        for _ in 0..200 {
            settled(&store).await;
            let mut acquiring = Box::pin(store.pool().acquire());
            // Cut there, or done at once and given back.
            drop(acquiring.as_mut().poll(&mut cx));
            drop(acquiring);
        }
        settled(&store).await;
        replayed(&store, &paid).await.unwrap();
    }

    /// A panic of the application's pool hook (`after_connect`) during
    /// `migrate` reaches its caller as that panic, as it would had the
    /// migration run in the caller's task (on the writers' thread, it came
    /// back as a store error: 10 runs in 10).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_panic_of_the_applications_hook_during_migrate_reaches_its_caller() {
        let dir = tempfile::tempdir().unwrap();
        let armed = Arc::new(AtomicBool::new(true));
        let hook = armed.clone();
        let pool = SqlitePoolOptions::new()
            .max_connections(2)
            .after_connect(move |_, _| {
                let hook = hook.clone();
                Box::pin(async move {
                    assert!(
                        !hook.swap(false, std::sync::atomic::Ordering::SeqCst),
                        "the application's after_connect hook panicked"
                    );
                    Ok(())
                })
            })
            .connect_lazy_with(
                SqliteConnectOptions::new()
                    .filename(dir.path().join("idem.db"))
                    .create_if_missing(true)
                    .journal_mode(SqliteJournalMode::Wal),
            );
        let store = SqliteStore::new(pool);
        match tokio::spawn(async move { store.migrate().await }).await {
            Err(e) if e.is_panic() => {}
            other => panic!("the hook's panic came back as {other:?}"),
        }
        assert!(
            !armed.load(std::sync::atomic::Ordering::SeqCst),
            "the hook never ran"
        );
    }

    /// A release answered, its connection on its way back to the pool
    /// (held in the pool's `after_release`) when the caller's multi-thread
    /// runtime shuts down: the give-back is a task of the writers' thread,
    /// and the database in memory lives on. (sqlx's give-back was a task of
    /// the caller's runtime, dropped with it: 10 runs in 10 lost the
    /// database.)
    #[test]
    fn a_release_given_back_as_its_runtime_shuts_down_loses_no_database_in_memory() {
        let hold: HookHold = Arc::default();
        let setup = runtime();
        let (store, paid) = setup.block_on(async {
            let store = held_in_memory(hold.clone(), HookAt::GiveBack).await;
            let paid = paid_record(&store).await;
            (store, paid)
        });
        let key = idem_testkit::unique("rel");
        let token = setup.block_on(async {
            let token = reserved(&store, &key).await;
            // The set-up's connection back in the pool first: the hold
            // then stops the release's give-back, not the set-up's.
            let until = Instant::now() + Duration::from_secs(10);
            while store.pool().num_idle() != 1 {
                assert!(Instant::now() < until, "the set-up's connection never came back");
                tokio::task::yield_now().await;
            }
            token
        });
        let (reached_tx, reached) = mpsc::channel();
        let (release, release_rx) = tokio::sync::oneshot::channel();
        *hold.lock().unwrap() = Some((reached_tx, release_rx));
        let mut answered = pause::arm(pause::RELEASE_AFTER, &key);
        let caller = one_worker();
        {
            let (store, key) = (store.clone(), key.clone());
            caller.spawn(async move {
                let _ = store.release(&id(&key), token).await;
            });
        }
        reached
            .recv_timeout(Duration::from_secs(20))
            .expect("the release's give-back is held");
        setup.block_on(async {
            tokio::time::timeout(Duration::from_secs(20), answered.reached())
                .await
                .expect("the release is answered");
        });
        caller.shutdown_timeout(Duration::from_secs(10));
        drop(release);
        setup.block_on(async {
            lives_on(&store, &paid, "the database in memory was lost").await;
        });
    }

    /// A release whose caller's timeout (the store's, on a current-thread
    /// runtime) passes while the pool hands its write the connection (held
    /// in the application's `before_acquire` check): the hand-over is not
    /// cut halfway, and once it ends the release is written, and the
    /// database in memory lives on. (The store's bound ran inside the
    /// write, cut the check, and sqlx closed the connection: 10 runs in 10.)
    #[test]
    fn a_release_timed_out_in_the_pools_check_is_written_and_loses_no_database_in_memory() {
        type CheckHold = Arc<Mutex<Option<tokio::sync::oneshot::Receiver<()>>>>;
        let hold: CheckHold = Arc::default();
        let cut = Arc::new(AtomicBool::new(false));
        let main = runtime();
        let store = main.block_on(async {
            let (hook, cut) = (hold.clone(), cut.clone());
            let pool = SqlitePoolOptions::new()
                .max_connections(1)
                .before_acquire(move |_, _| {
                    let armed = hook.lock().unwrap().take();
                    let cut = cut.clone();
                    Box::pin(async move {
                        if let Some(release) = armed {
                            /// Sets the flag if dropped before the check ends.
                            struct Cut(Arc<AtomicBool>);
                            impl Drop for Cut {
                                fn drop(&mut self) {
                                    self.0.store(true, std::sync::atomic::Ordering::SeqCst);
                                }
                            }
                            let cut = Cut(cut);
                            let _ = release.await;
                            std::mem::forget(cut);
                        }
                        Ok(true)
                    })
                })
                .connect("sqlite::memory:")
                .await
                .unwrap();
            let store = SqliteStore::new(pool).with_timeout(Duration::from_millis(300));
            store.migrate().await.unwrap();
            store
        });
        let paid = main.block_on(paid_record(&store));
        let key = idem_testkit::unique("rel");
        let token = main.block_on(reserved(&store, &key));
        let (release, held) = tokio::sync::oneshot::channel();
        *hold.lock().unwrap() = Some(held);
        let told = main.block_on(store.release(&id(&key), token));
        assert!(
            matches!(told, Err(idem::StoreError::Unavailable { .. })),
            "the release is held in the check: {told:?}"
        );
        // Three of the store's timeouts: a bound inside the write would
        // have cut the check by then.
        std::thread::sleep(Duration::from_millis(900));
        assert!(
            !cut.load(std::sync::atomic::Ordering::SeqCst),
            "the pool's check was cut halfway"
        );
        drop(release);
        main.block_on(async {
            lives_on(&store, &paid, "the database in memory was lost").await;
            let until = Instant::now() + Duration::from_secs(10);
            loop {
                match store.reserve(req(&id(&key), idem_testkit::token())).await {
                    Ok(Reservation::Reserved(_)) => break,
                    other => assert!(Instant::now() < until, "the release was never written: {other:?}"),
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
    }
}

/// Another process holds SQLite's write lock past the store's timeout (but
/// not past the busy timeout): the reservation is answered 503 while its
/// group still waits for the lock. Its caller is gone, so once the lock is
/// free its write leaves the line instead of taking the key for nobody:
/// the next write through the store finds the key untouched, and the
/// client's retry takes it at once, rather than a 409 telling it to wait a
/// whole lock timeout for a lock no execution holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_reservation_answered_503_behind_another_process_takes_nothing_later() {
    let (store, dir) = idem_testkit::sqlite_store().await;
    let store = store.with_timeout(Duration::from_millis(500));
    let mut other = write_lock_held_elsewhere(dir.path()).await;
    let key = idem_testkit::unique("behind");
    let given_up = store.reserve(req(&id(&key), idem_testkit::token())).await;
    assert!(matches!(&given_up, Err(e) if e.is_unavailable()), "{given_up:?}");
    sqlx::raw_sql("COMMIT").execute(&mut other).await.unwrap();
    // Behind the given-up write in the line: once this one is written, that
    // one had its turn.
    reserved(&store, &idem_testkit::unique("after")).await;
    assert_eq!(
        row(&store, &key).await,
        None,
        "a reservation answered 503 took its key later"
    );
    reserved(&store, &key).await;
}

/// Several processes starting together on a fresh file (here three stores
/// on separate pools, forty times): opening a store switches the file to
/// WAL, which SQLite does without its busy handler, so one of them failed
/// at once ("database is locked", two or three in forty rounds). Every open
/// now waits for the file within the busy timeout, as every other wait for
/// it does: all open and migrate, and serve.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stores_opened_at_once_on_a_fresh_file_all_open() {
    for round in 0..40 {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("opened-at-once.db");
        let open = |path: std::path::PathBuf| async move {
            let store = SqliteStore::open(&path).await?;
            store.migrate().await?;
            Ok::<SqliteStore, idem::StoreError>(store)
        };
        let (a, b, c) = tokio::join!(open(path.clone()), open(path.clone()), open(path.clone()));
        for (n, opened) in [a, b, c].into_iter().enumerate() {
            if let Err(e) = opened {
                panic!("round {round}, store {n}: {e}");
            }
        }
        if round == 0 {
            serves_concurrent_requests(&SqliteStore::open(&path).await.unwrap(), "o").await;
        }
    }
}
