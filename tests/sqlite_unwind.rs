//! A handler's SQLite transaction unwound in the background (the check
//! or the completion could not get through in time: a statement the
//! handler gave up on still holds sqlx's worker) while that statement runs
//! on past the unwinding's warning (after a minute; 3 seconds in idem's
//! own test builds, which have pause points). The unwinding must wait for
//! it, not be cut: cut while its first statement is queued behind the
//! held one, the transaction's drop asks for one rollback, which fails
//! once the unwinding's own `ROLLBACK` has ended SQLite's transaction, and
//! the connection goes back to the pool counted inside a transaction
//! (every `BEGIN IMMEDIATE` on it fails; after the application's next
//! dropped transaction, nothing written on it commits).
//!
//! The worker is held by a SQLite progress handler on the handler's
//! abandoned statement, and let go only once the unwinding has said it
//! still waits (its warning; a build that cut the unwinding there said so
//! with the failed rollback's warning instead). Its own binary: it reads
//! the process's log.

use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::Router;
use idem::store::{RecordId, Reservation, ReserveRequest};
use idem::{idempotent, Idem, IdempotencyStore as _, Operation, SqliteStore};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::Connection as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;
use tower::ServiceExt as _;

/// Set by the handler right before its abandoned statement: the next
/// progress call on the connection holds the worker.
static HOLD: AtomicBool = AtomicBool::new(false);
static REACHED: Mutex<Option<tokio::sync::oneshot::Sender<()>>> = Mutex::new(None);
static RELEASE: Mutex<Option<mpsc::Receiver<()>>> = Mutex::new(None);

#[idempotent(scope = "unwind.pay")]
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
    // A slow statement the handler stops waiting for (as with a timeout of
    // its own): it goes on in sqlx's worker, holding the connection.
    let (reached_tx, reached_rx) = tokio::sync::oneshot::channel();
    *REACHED.lock().unwrap() = Some(reached_tx);
    HOLD.store(true, Ordering::SeqCst);
    let slow = sqlx::query_scalar::<_, i64>("SELECT count(*) FROM effects").fetch_one(&mut *conn);
    tokio::select! {
        _ = slow => panic!("the slow statement was not held"),
        _ = reached_rx => {}
    }
    Ok(StatusCode::CREATED)
}

fn paid(key: &str) -> Request<axum::body::Body> {
    Request::post("/pay")
        .header("idempotency-key", key)
        .body(axum::body::Body::empty())
        .unwrap()
}

/// A log writer that says when the unwinding's warning came.
#[derive(Clone)]
struct Watch(Arc<Mutex<(String, Option<mpsc::Sender<()>>)>>);

impl std::io::Write for Watch {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut seen = self.0.lock().unwrap();
        seen.0.push_str(&String::from_utf8_lossy(buf));
        if seen
            .0
            .contains("still busy with a statement its handler gave up on")
            || seen
                .0
                .contains("the rollback of the handler's transaction failed")
        {
            if let Some(tx) = seen.1.take() {
                let _ = tx.send(());
            }
        }
        std::io::stderr().write_all(buf)?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unwinding_held_past_its_warning_waits_and_leaves_the_connection_sound() {
    let (warned_tx, warned_rx) = mpsc::channel::<()>();
    let watch = Watch(Arc::new(Mutex::new((String::new(), Some(warned_tx)))));
    let writer = watch.clone();
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .init();

    let (release_tx, release_rx) = mpsc::channel::<()>();
    *RELEASE.lock().unwrap() = Some(release_rx);

    let dir = tempfile::tempdir().unwrap();
    let file = SqliteConnectOptions::new()
        .filename(dir.path().join("unwind.db"))
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(30));
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .after_connect(|conn, _| {
            Box::pin(async move {
                let mut handle = conn.lock_handle().await?;
                handle.set_progress_handler(1, || {
                    if HOLD.swap(false, Ordering::SeqCst) {
                        if let Some(r) = REACHED.lock().unwrap().take() {
                            let _ = r.send(());
                        }
                        if let Some(r) = RELEASE.lock().unwrap().take() {
                            let _ = r.recv_timeout(Duration::from_secs(300));
                        }
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
    sqlx::raw_sql("CREATE TABLE effects (id TEXT PRIMARY KEY); CREATE TABLE audit (note TEXT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let app = Router::new().route("/pay", post(pay)).layer(
        Idem::new(store.clone())
            .single_tenant()
            .lock_timeout(Duration::from_secs(600))
            .unwrap()
            .layer(),
    );

    // The completion's check cannot get through the held worker within
    // the store's timeout: 503, and the transaction is unwound in the
    // background.
    let key = idem_testkit::unique("unwind");
    let first = app.clone().oneshot(paid(&key)).await.unwrap();
    assert_eq!(first.status(), StatusCode::SERVICE_UNAVAILABLE);

    // The unwinding has said it still waits: its raw ROLLBACK, queued behind
    // the held statement, has not run. Only now is the worker let go.
    tokio::task::spawn_blocking(move || warned_rx.recv_timeout(Duration::from_secs(120)))
        .await
        .unwrap()
        .expect("the unwinding said it still waits");
    release_tx.send(()).unwrap();

    // The layer's give-back (released as failed) ends first: a condition,
    // polled, so that nothing else takes the pool's one connection below.
    let other = || async { sqlx::SqliteConnection::connect_with(&file).await.unwrap() };
    tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let mut c = other().await;
            let token: Option<Option<String>> =
                sqlx::query_scalar("SELECT lock_token FROM idempotency_keys WHERE key = ?1")
                    .bind(&key)
                    .fetch_optional(&mut c)
                    .await
                    .unwrap();
            if matches!(token, Some(None)) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the key was given back");

    let mut wrong = Vec::new();
    {
        let mut conn = pool.acquire().await.unwrap();
        // 1. sqlx still counts a transaction on it.
        if let Err(e) = sqlx::Connection::begin_with(&mut *conn, "BEGIN IMMEDIATE").await {
            wrong.push(format!("BEGIN IMMEDIATE on the pool's connection fails: {e}"));
        }
        // 2. The application's transaction, dropped (an early `?`), then
        //    its next transaction, committed.
        let mut dropped = conn.begin().await.unwrap();
        sqlx::query("INSERT INTO audit (note) VALUES ('dropped')")
            .execute(&mut *dropped)
            .await
            .unwrap();
        drop(dropped);
        let mut committed = conn.begin().await.unwrap();
        sqlx::query("INSERT INTO audit (note) VALUES ('kept')")
            .execute(&mut *committed)
            .await
            .unwrap();
        committed.commit().await.unwrap();
    }
    let kept: i64 = sqlx::query_scalar("SELECT count(*) FROM audit WHERE note = 'kept'")
        .fetch_one(&mut other().await)
        .await
        .unwrap();
    if kept != 1 {
        wrong.push(format!(
            "a transaction committed (Ok) on the pool is not seen by another connection ({kept} rows)"
        ));
    }
    // 3. The handler's write was rolled back.
    let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(&mut other().await)
        .await
        .unwrap();
    if effects != 0 {
        wrong.push(format!("the handler's write committed ({effects} rows)"));
    }
    // 4. The store's next reservation.
    let next = RecordId::new("t", "unwind.next", "next");
    let reserved = tokio::time::timeout(
        Duration::from_secs(10),
        store.reserve(ReserveRequest {
            id: &next,
            fingerprint: "F",
            token: "tok-next",
            ttl: Duration::from_secs(3600),
            lock_timeout: Duration::from_secs(3600),
        }),
    )
    .await;
    if !matches!(reserved, Ok(Ok(Reservation::Reserved(_)))) {
        wrong.push(format!("the store's next reservation failed: {reserved:?}"));
    }
    let kept: i64 = sqlx::query_scalar("SELECT count(*) FROM audit WHERE note = 'kept'")
        .fetch_one(&pool)
        .await
        .unwrap();
    if kept != 1 {
        wrong.push(format!("the committed row is gone for good ({kept} rows)"));
    }
    drop(watch);
    assert!(wrong.is_empty(), "{wrong:#?}");
}
