//! A SQLite database file deleted or replaced while the process has it
//! open. In WAL mode SQLite writes on to the file it opened, which a
//! process started afterwards never reads: a key reserved there would be
//! forgotten, and its retry would run the handler again. So once the path
//! no longer leads to the file the store opened, every reservation answers
//! 503 and no handler runs.

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Idem, SqliteStore};
use idem_runtime::pause;
use idem_testkit::http::{post as req, serve, Reply};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Held by the tests that change the process's directory.
static CWD: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[derive(Clone, Default)]
struct App {
    runs: Arc<AtomicUsize>,
}

#[derive(serde::Deserialize, serde::Serialize)]
struct Pay {
    amount: i64,
}

#[idempotent(scope = "file.pay", fields(amount))]
async fn pay(State(app): State<App>, Json(p): Json<Pay>) -> (StatusCode, String) {
    app.runs.fetch_add(1, Ordering::SeqCst);
    (StatusCode::CREATED, format!("paid {}", p.amount))
}

/// `store` served, and what its handler saw.
async fn serving(store: SqliteStore) -> (SocketAddr, App) {
    let app = App::default();
    let router = Router::new()
        .route("/pay", post(pay))
        .layer(Idem::new(store).single_tenant().layer())
        .with_state(app.clone());
    (serve(router).await, app)
}

struct Server {
    addr: SocketAddr,
    app: App,
    db: PathBuf,
    dir: tempfile::TempDir,
}

impl Server {
    async fn start() -> Server {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("idem.db");
        let store = SqliteStore::open(&db).await.unwrap();
        store.migrate().await.unwrap();
        let (addr, app) = serving(store).await;
        Server { addr, app, db, dir }
    }

    async fn send(&self, key: &str) -> Reply {
        req("/pay", r#"{"amount":5}"#).key(key).send(self.addr).await
    }

    fn runs(&self) -> usize {
        self.app.runs.load(Ordering::SeqCst)
    }

    /// Answered and replayed, its handler run once.
    async fn served(&self, key: &str) {
        let before = self.runs();
        assert_eq!(self.send(key).await.status, 201);
        assert_eq!(self.send(key).await.status, 201);
        assert_eq!(self.runs(), before + 1);
    }

    /// Refused as the store's, its handler not run.
    async fn refused(&self, key: &str) {
        let before = self.runs();
        let r = self.send(key).await;
        assert_eq!(r.status, 503, "{r:?}");
        assert_eq!(r.problem(), "idempotency-store-unavailable");
        assert_eq!(self.runs(), before);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_database_file_refuses_every_key_and_runs_no_handler() {
    let s = Server::start().await;
    s.served("before").await;
    std::fs::remove_file(&s.db).unwrap();
    // A new key, and the replay of one answered before: what the process
    // reads and writes now, no process started afterwards would.
    s.refused("after").await;
    s.refused("before").await;
    assert_eq!(s.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_file_replaced_by_another_refuses_every_key() {
    let s = Server::start().await;
    s.served("before").await;
    // Another database, migrated and moved over the path, as a restore
    // from a backup does.
    let other = s.dir.path().join("other.db");
    let restored = SqliteStore::open(&other).await.unwrap();
    restored.migrate().await.unwrap();
    restored.pool().close().await;
    std::fs::rename(&other, &s.db).unwrap();
    s.refused("after").await;
    s.refused("before").await;
}

/// The file deleted while a reservation's transaction holds the write lock,
/// before its commit: the key is taken in the file that is gone, and its
/// handler does not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_file_deleted_while_a_reservation_commits_runs_no_handler() {
    let s = Server::start().await;
    s.served("first").await;
    let key = idem_testkit::unique("racing");
    let mut paused = pause::arm(pause::SQLITE_RESERVE_BEFORE_COMMIT, &key);
    let addr = s.addr;
    let sending = {
        let key = key.clone();
        tokio::spawn(async move { req("/pay", r#"{"amount":5}"#).key(&key).send(addr).await })
    };
    paused.reached().await;
    std::fs::remove_file(&s.db).unwrap();
    paused.resume();
    let r = sending.await.unwrap();
    assert_eq!(r.status, 503, "{r:?}");
    assert_eq!(r.problem(), "idempotency-store-unavailable");
    assert_eq!(s.runs(), 1);
}

/// Files that stay where they are are never taken for moved: a database
/// whose WAL is checkpointed and truncated, and one vacuumed (rewritten in
/// place), go on answering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_file_checkpointed_or_vacuumed_in_place_goes_on() {
    let s = Server::start().await;
    s.served("one").await;
    let elsewhere = SqliteStore::open(&s.db).await.unwrap();
    sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)")
        .execute(elsewhere.pool())
        .await
        .unwrap();
    s.served("two").await;
    sqlx::query("VACUUM").execute(elsewhere.pool()).await.unwrap();
    s.served("three").await;
    assert_eq!(s.send("one").await.status, 201);
    assert_eq!(s.runs(), 3);
}

/// The file deleted after the store opened it and before any keyed
/// request: the store learnt the file when it opened it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_file_deleted_before_the_first_request_refuses_it() {
    let s = Server::start().await;
    std::fs::remove_file(&s.db).unwrap();
    s.refused("first").await;
    assert_eq!(s.runs(), 0);
}

/// The same over an application's pool, whose file the store learns at
/// its first write: gone by then, it is taken for deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_applications_pool_whose_file_is_deleted_before_the_first_request_refuses_it() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(&db)
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal);
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .unwrap();
    let store = SqliteStore::new(pool);
    store.migrate().await.unwrap();
    std::fs::remove_file(&db).unwrap();
    assert_eq!(first_requests(store, &["first"]).await, (vec![503], 0));
}

/// Opened through a symbolic link that a restore then points at another
/// file (a link moved over the path): what a process started afterwards
/// opens is that file, so the store refuses.
#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_symbolic_link_pointed_at_another_file_refuses_every_key() {
    let dir = tempfile::tempdir().unwrap();
    let (a, link) = (dir.path().join("a.db"), dir.path().join("idem.db"));
    std::os::unix::fs::symlink(&a, &link).unwrap();
    let store = SqliteStore::open(&link).await.unwrap();
    store.migrate().await.unwrap();
    let (addr, app) = serving(store).await;
    let s = Server {
        addr,
        app,
        db: link.clone(),
        dir,
    };
    s.served("before").await;
    let b = s.dir.path().join("b.db");
    let restored = SqliteStore::open(&b).await.unwrap();
    restored.migrate().await.unwrap();
    restored.pool().close().await;
    let moving = s.dir.path().join("idem.db.new");
    std::os::unix::fs::symlink(&b, &moving).unwrap();
    std::fs::rename(&moving, &link).unwrap();
    s.refused("after").await;
    assert_eq!(s.runs(), 1);
}

/// Never taken for moved: a database in memory, a clone on another table,
/// and an application's pool that connects lazily, whose file does not
/// exist before its first connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn databases_in_memory_and_lazy_pools_go_on() {
    let memory = SqliteStore::in_memory().await.unwrap();
    let other = memory.clone().with_table("other_keys").unwrap();
    other.migrate().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(dir.path().join("lazy.db"))
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal);
    let lazy = SqliteStore::new(
        sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(4)
            .connect_lazy_with(options),
    );
    lazy.migrate().await.unwrap();
    for store in [memory, other, lazy] {
        let (addr, app) = serving(store).await;
        for key in ["one", "two", "one"] {
            let r = req("/pay", r#"{"amount":5}"#).key(key).send(addr).await;
            assert_eq!(r.status, 201, "{r:?}");
        }
        assert_eq!(app.runs.load(Ordering::SeqCst), 2);
    }
}

/// Opened by a relative path, then the process moves to another directory:
/// the connections the pool opens afterwards open the same file (made
/// absolute when the store opened it), not a second database there, and
/// nothing is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relative_path_opens_one_file_whatever_the_directory_later() {
    let _cwd = CWD.lock().await;
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let was = std::env::current_dir().unwrap();
    std::env::set_current_dir(a.path()).unwrap();
    let store = SqliteStore::open("relative.db").await.unwrap();
    store.migrate().await.unwrap();
    std::env::set_current_dir(b.path()).unwrap();
    // The connections the pool has open, busy: it opens more.
    let mut held = Vec::new();
    for _ in 0..store.pool().size() {
        held.push(store.pool().acquire().await.unwrap());
    }
    let (addr, app) = serving(store).await;
    let sends: Vec<_> = (0..8)
        .map(|i| {
            tokio::spawn(async move {
                req("/pay", r#"{"amount":5}"#)
                    .key(&format!("k{i}"))
                    .send(addr)
                    .await
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for send in sends {
        statuses.push(send.await.unwrap().status);
    }
    drop(held);
    std::env::set_current_dir(was).unwrap();
    assert_eq!(statuses, vec![201; 8]);
    assert!(
        !b.path().join("relative.db").exists(),
        "a second database was made"
    );
    assert_eq!(app.runs.load(Ordering::SeqCst), 8);
}

/// An application's pool with WAL, on `db`.
fn pool_options(db: &std::path::Path) -> sqlx::sqlite::SqliteConnectOptions {
    sqlx::sqlite::SqliteConnectOptions::new()
        .filename(db)
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
}

/// Another migrated database moved over `db`, as a restore does, without
/// the old one's log.
async fn restore_over(db: &std::path::Path) {
    let dir = db.parent().unwrap();
    let other = dir.join("restored.db");
    let restored = SqliteStore::open(&other).await.unwrap();
    restored.migrate().await.unwrap();
    restored.pool().close().await;
    std::fs::rename(&other, db).unwrap();
    let name = db.file_name().unwrap().to_str().unwrap();
    for log in [format!("{name}-wal"), format!("{name}-shm")] {
        let _ = std::fs::remove_file(dir.join(log));
    }
}

/// `store` served; the status of a first request for each of `keys`, and
/// how many times the handler ran.
async fn first_requests(store: SqliteStore, keys: &[&str]) -> (Vec<u16>, usize) {
    let (addr, app) = serving(store).await;
    let mut statuses = Vec::new();
    for key in keys {
        statuses.push(req("/pay", r#"{"amount":5}"#).key(key).send(addr).await.status);
    }
    (statuses, app.runs.load(Ordering::SeqCst))
}

/// A pool that connects lazily, whose file a restore replaces before its
/// first connection: every connection it opens opens the file now there,
/// which is fine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lazy_pool_whose_file_is_replaced_before_it_connects_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    let made = SqliteStore::open(&db).await.unwrap();
    made.migrate().await.unwrap();
    made.pool().close().await;
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(4)
        .connect_lazy_with(pool_options(&db));
    let store = SqliteStore::new(pool);
    restore_over(&db).await;
    assert_eq!(first_requests(store, &["one", "two"]).await, (vec![201, 201], 2));
}

/// A relative path in a directory whose name is not UTF-8 (which SQLite
/// cannot be given): opened as given, relative.
#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relative_path_in_a_directory_not_named_in_utf8_opens() {
    use std::os::unix::ffi::OsStrExt as _;
    let _cwd = CWD.lock().await;
    let base = tempfile::tempdir().unwrap();
    let odd = base.path().join(std::ffi::OsStr::from_bytes(b"data-\xff"));
    std::fs::create_dir(&odd).unwrap();
    let was = std::env::current_dir().unwrap();
    std::env::set_current_dir(&odd).unwrap();
    let opened = SqliteStore::open("idem.db").await;
    let migrated = match &opened {
        Ok(store) => store.migrate().await,
        Err(_) => Ok(()),
    };
    std::env::set_current_dir(was).unwrap();
    assert!(opened.is_ok() && migrated.is_ok(), "{opened:?} {migrated:?}");
}

/// A store opened at the path of a file another store of the process had
/// open and that was deleted: the new store's file is the one at the path,
/// and it serves (the first store refuses).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_opened_where_another_stores_file_was_deleted_serves() {
    let s = Server::start().await;
    s.served("before").await;
    for name in ["idem.db", "idem.db-wal", "idem.db-shm"] {
        let _ = std::fs::remove_file(s.dir.path().join(name));
    }
    s.refused("after").await;
    let again = SqliteStore::open(&s.db).await.unwrap();
    again.migrate().await.unwrap();
    assert_eq!(first_requests(again, &["after"]).await, (vec![201], 1));
}
