//! Fresh stores for tests, one per kind: in memory, SQLite on a temporary
//! file, PostgreSQL in a schema of its own in `DATABASE_URL`.

use crate::unique;
use idem_runtime::{IdempotencyStore, MemoryStore, PgStore, SqliteStore};
use std::sync::Arc;
use std::time::Duration;

/// The kinds of store a suite runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreKind {
    /// [`MemoryStore`], in the test process.
    Memory,
    /// [`SqliteStore`] on a temporary file ([`sqlite_store`]).
    Sqlite,
    /// [`PgStore`] in a fresh schema of `DATABASE_URL` ([`pg_store`]).
    Postgres,
}

impl StoreKind {
    /// A fresh store of this kind. `None` for PostgreSQL when
    /// `DATABASE_URL` is not set, unless `IDEM_REQUIRE_POSTGRES=1`, which
    /// panics instead (see [`pg_url`]).
    pub async fn fixture(self) -> Option<Fixture> {
        Some(match self {
            StoreKind::Memory => Fixture::memory(),
            StoreKind::Sqlite => {
                let (store, dir) = sqlite_store().await;
                Fixture {
                    store: Arc::new(store),
                    dir: Some(dir),
                }
            }
            StoreKind::Postgres => Fixture {
                store: Arc::new(pg_store().await?),
                dir: None,
            },
        })
    }
}

/// A store for one test, and the directory it lives in, if any.
pub struct Fixture {
    /// The store under test.
    pub store: Arc<dyn IdempotencyStore>,
    /// A SQLite store's temporary directory, removed when the fixture drops.
    pub dir: Option<tempfile::TempDir>,
}

impl Fixture {
    /// A fresh [`MemoryStore`].
    pub fn memory() -> Fixture {
        Fixture {
            store: Arc::new(MemoryStore::new()),
            dir: None,
        }
    }
}

/// `DATABASE_URL`, or `None` after one loud line. With
/// `IDEM_REQUIRE_POSTGRES=1` (CI) a missing URL fails the test instead.
pub fn pg_url() -> Option<String> {
    match std::env::var("DATABASE_URL") {
        Ok(url) if url.starts_with("postgres") => Some(url),
        _ if std::env::var("IDEM_REQUIRE_POSTGRES").as_deref() == Ok("1") => {
            panic!("IDEM_REQUIRE_POSTGRES=1 but DATABASE_URL does not name a PostgreSQL database")
        }
        _ => {
            eprintln!("skipped: set DATABASE_URL=postgres://... to run the PostgreSQL tests");
            None
        }
    }
}

/// A fresh schema in the test database, so tests run in parallel. Its name
/// carries its creation time: schemas of runs over an hour old are dropped
/// here, so the test database does not fill up.
pub async fn pg_schema(url: &str) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let schema = unique(&format!("idem_t_{now}"));
    let pool = sqlx::PgPool::connect(url).await.expect("connect to DATABASE_URL");
    let old: Vec<String> = sqlx::query_scalar(
        "SELECT nspname::text FROM pg_namespace WHERE nspname ~ '^idem_t_[0-9]+_' \
         AND split_part(nspname, '_', 3)::bigint < $1",
    )
    .bind(now as i64 - 3600)
    .fetch_all(&pool)
    .await
    .expect("list old schemas");
    for name in old {
        // Another test process may drop it at the same time: ignore errors.
        let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS \"{name}\" CASCADE"
        )))
        .execute(&pool)
        .await;
    }
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA \"{schema}\"")))
        .execute(&pool)
        .await
        .expect("create schema");
    pool.close().await;
    schema
}

/// A PostgreSQL store in its own schema, on a pool of `connections`.
pub async fn pg_store_in(url: &str, schema: &str, connections: u32) -> PgStore {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(Duration::from_secs(10))
        .connect(url)
        .await
        .expect("connect to DATABASE_URL");
    let store = PgStore::new(pool)
        .with_table(Some(schema), "idempotency_keys")
        .unwrap()
        .with_timeout(Duration::from_secs(10));
    store.migrate().await.expect("migrate");
    store
}

/// A PostgreSQL store in a fresh schema, on a pool of 25; `None` without
/// `DATABASE_URL` (see [`pg_url`]).
pub async fn pg_store() -> Option<PgStore> {
    let url = pg_url()?;
    let schema = pg_schema(&url).await;
    Some(pg_store_in(&url, &schema, 25).await)
}

/// The documented in-memory database ([`SqliteStore::in_memory`]): a pool
/// of one connection (whose records live only as long as it does),
/// migrated.
pub async fn sqlite_in_memory_store() -> SqliteStore {
    SqliteStore::in_memory().await.unwrap()
}

/// A SQLite store on a temporary file (never `:memory:`, which hides locking).
pub async fn sqlite_store() -> (SqliteStore, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("idem.db")).await.unwrap();
    store.migrate().await.unwrap();
    (store, dir)
}

/// Whether a transaction the application drops on `pool` (sqlx's rollback
/// on drop, as on an early `?` return) is rolled back: on a pool of one
/// connection, whether that connection is as sqlx counts it, neither
/// inside a transaction left open nor set to skip a rollback.
pub async fn dropped_transaction_rolls_back(pool: &sqlx::SqlitePool) -> bool {
    let count = || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM testkit_dropped")
            .fetch_one(pool)
            .await
            .unwrap();
        n
    };
    sqlx::query("CREATE TABLE IF NOT EXISTS testkit_dropped (note TEXT NOT NULL)")
        .execute(pool)
        .await
        .unwrap();
    let before = count().await;
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO testkit_dropped (note) VALUES ('dropped')")
        .execute(&mut *tx)
        .await
        .unwrap();
    drop(tx);
    count().await == before
}
