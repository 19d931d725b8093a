//! Multi-step operations (contract section 8) on the SQL stores: the
//! handler's own writes commit with the completion or not at all, derived
//! keys and recovery points survive a takeover, and the janitor purges in
//! batches without touching a live lock.

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem::store::{RecordId, Reservation, ReserveRequest};
use idem::{idempotent, Idem, IdempotencyStore, Operation};
use idem_testkit::http::{post as post_req, serve};
use idem_testkit::StoreKind;
use std::sync::Arc;
use std::time::Duration;

/// Which SQL store the handler writes its own rows into.
#[derive(Clone)]
enum Db {
    Pg(sqlx::PgPool, String),
    Sqlite(sqlx::SqlitePool),
}

impl Db {
    fn effects(&self) -> String {
        match self {
            Db::Pg(_, schema) => format!("\"{schema}\".effects"),
            Db::Sqlite(_) => "effects".to_owned(),
        }
    }

    async fn create_table(&self) {
        let sql = format!(
            "CREATE TABLE {} (id TEXT PRIMARY KEY, note TEXT NOT NULL)",
            self.effects()
        );
        match self {
            Db::Pg(pool, _) => sqlx::query(sqlx::AssertSqlSafe(sql))
                .execute(pool)
                .await
                .map(drop),
            Db::Sqlite(pool) => sqlx::query(sqlx::AssertSqlSafe(sql))
                .execute(pool)
                .await
                .map(drop),
        }
        .unwrap();
    }

    async fn count(&self) -> i64 {
        let sql = format!("SELECT COUNT(*) FROM {}", self.effects());
        match self {
            Db::Pg(pool, _) => sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).fetch_one(pool).await,
            Db::Sqlite(pool) => sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).fetch_one(pool).await,
        }
        .unwrap()
    }
}

#[derive(serde::Deserialize, serde::Serialize)]
struct EffectIn {
    /// `ok`, `fail` (503 after the write), `panic` (after the write).
    then: String,
}

/// Writes one row in the operation's transaction, then ends as asked.
#[idempotent(scope = "effect.create", fields(then))]
async fn write_effect(
    State(db): State<Db>,
    op: Operation,
    Json(input): Json<EffectIn>,
) -> Result<(StatusCode, String), StatusCode> {
    let sql = match &db {
        Db::Pg(..) => format!("INSERT INTO {} (id, note) VALUES ($1, $2)", db.effects()),
        Db::Sqlite(_) => format!("INSERT INTO {} (id, note) VALUES (?1, ?2)", db.effects()),
    };
    let id = op.derived_key("effect");
    if input.then == "late" {
        // A slow first step, before the transaction opens.
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    let written = match &db {
        Db::Pg(..) => {
            let mut conn = op
                .pg_transaction()
                .await
                .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(&id)
                .bind(&input.then)
                .execute(&mut *conn)
                .await
                .map(drop)
        }
        Db::Sqlite(_) => {
            let mut conn = op
                .sqlite_transaction()
                .await
                .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(&id)
                .bind(&input.then)
                .execute(&mut *conn)
                .await
                .map(drop)
        }
    };
    written.map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    match input.then.as_str() {
        "fail" => Err(StatusCode::SERVICE_UNAVAILABLE),
        "panic" => panic!("after the write"),

        _ => Ok((StatusCode::CREATED, id)),
    }
}

async fn harness(store: Arc<dyn IdempotencyStore>, db: Db) -> std::net::SocketAddr {
    db.create_table().await;
    let app = Router::new()
        .route("/effects", post(write_effect))
        .layer(Idem::from_arc(store).single_tenant().layer())
        .with_state(db);
    serve(app).await
}

/// A SQL store, the handle its handler writes its own rows through, and
/// the SQLite file's directory.
struct Sql {
    store: Arc<dyn IdempotencyStore>,
    db: Db,
    _dir: Option<tempfile::TempDir>,
}

/// A fresh SQL store of `kind`; `None` for PostgreSQL without `DATABASE_URL`.
async fn sql(kind: StoreKind) -> Option<Sql> {
    match kind {
        StoreKind::Sqlite => {
            let (store, dir) = idem_testkit::sqlite_store().await;
            let db = Db::Sqlite(store.pool().clone());
            Some(Sql {
                store: Arc::new(store),
                db,
                _dir: Some(dir),
            })
        }
        StoreKind::Postgres => {
            let url = idem_testkit::pg_url()?;
            let schema = idem_testkit::pg_schema(&url).await;
            let store = idem_testkit::pg_store_in(&url, &schema, 10).await;
            let db = Db::Pg(store.pool().clone(), schema);
            Some(Sql {
                store: Arc::new(store),
                db,
                _dir: None,
            })
        }
        StoreKind::Memory => unreachable!("the handler's rows are written in a SQL transaction"),
    }
}

async fn the_handlers_writes_commit_with_the_completion(Sql { store, db, _dir }: Sql) {
    let addr = harness(store, db.clone()).await;
    let first = post_req("/effects", r#"{"then":"ok"}"#)
        .key("k-ok")
        .send(addr)
        .await;
    assert_eq!(first.status, 201);
    assert_eq!(db.count().await, 1);
    let replay = post_req("/effects", r#"{"then":"ok"}"#)
        .key("k-ok")
        .send(addr)
        .await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.body, first.body);
    assert_eq!(db.count().await, 1);
}

async fn a_released_outcome_rolls_the_writes_back(Sql { store, db, _dir }: Sql) {
    let addr = harness(store, db.clone()).await;
    for key in ["k-fail", "k-fail"] {
        let r = post_req("/effects", r#"{"then":"fail"}"#)
            .key(key)
            .send(addr)
            .await;
        assert_eq!(r.status, 503);
        assert_eq!(r.header("idempotent-replayed"), None);
    }
    assert_eq!(db.count().await, 0);
    for _ in 0..2 {
        let r = post_req("/effects", r#"{"then":"panic"}"#)
            .key("k-panic")
            .send(addr)
            .await;
        assert_eq!(r.status, 500);
    }
    assert_eq!(db.count().await, 0);
}

async fn a_fenced_out_execution_commits_nothing(Sql { store, db, _dir }: Sql) {
    let addr = harness(store, db.clone()).await;
    let slow = tokio::spawn(async move {
        post_req("/effects", r#"{"then":"late"}"#)
            .key("k-fenced")
            .send(addr)
            .await
    });
    // While the handler is in its slow first step, another execution takes
    // the record over (as one would whose lock ran out).
    tokio::time::sleep(Duration::from_millis(150)).await;
    let records = match &db {
        Db::Pg(_, schema) => format!("\"{schema}\".idempotency_keys"),
        Db::Sqlite(_) => "idempotency_keys".to_owned(),
    };
    let steal = format!("UPDATE {records} SET lock_token = 'another-owner', attempt = attempt + 1");
    let stolen = match &db {
        Db::Pg(pool, _) => sqlx::query(sqlx::AssertSqlSafe(steal))
            .execute(pool)
            .await
            .unwrap()
            .rows_affected(),
        Db::Sqlite(pool) => sqlx::query(sqlx::AssertSqlSafe(steal))
            .execute(pool)
            .await
            .unwrap()
            .rows_affected(),
    };
    assert_eq!(stolen, 1);
    let r = slow.await.unwrap();
    assert_eq!(r.status, 503, "a fenced-out execution must not claim success");
    assert_eq!(db.count().await, 0, "its write must not commit");
}

async fn the_janitor_purges_in_batches_and_spares_live_locks(Sql { store, _dir, .. }: Sql) {
    let short = Duration::from_millis(50);
    let long = Duration::from_secs(3600);
    for i in 0..250 {
        let id = RecordId::new("t", "janitor", format!("expired-{i}"));
        let req = ReserveRequest {
            id: &id,
            fingerprint: "f",
            token: idem_testkit::token(),
            ttl: short,
            lock_timeout: short,
        };
        let Reservation::Reserved(l) = store.reserve(req).await.unwrap() else {
            panic!()
        };
        if i % 2 == 0 {
            let done = idem::store::StoredResponse {
                status: 200,
                headers: vec![],
                body: Some(vec![]),
            };
            store.complete(&id, &l.token, &done).await.unwrap();
        }
    }
    let live = RecordId::new("t", "janitor", "live-lock");
    let req = ReserveRequest {
        id: &live,
        fingerprint: "f",
        token: idem_testkit::token(),
        ttl: short,
        lock_timeout: long,
    };
    assert!(matches!(
        store.reserve(req).await.unwrap(),
        Reservation::Reserved(_)
    ));
    let kept = RecordId::new("t", "janitor", "unexpired");
    let req = ReserveRequest {
        id: &kept,
        fingerprint: "f",
        token: idem_testkit::token(),
        ttl: long,
        lock_timeout: short,
    };
    assert!(matches!(
        store.reserve(req).await.unwrap(),
        Reservation::Reserved(_)
    ));
    tokio::time::sleep(Duration::from_millis(150)).await;

    // One batch at a time: a scheduler's call.
    assert_eq!(store.purge_expired(100).await.unwrap(), 100);
    // The background task finishes the rest.
    let janitor = idem::Janitor::start(store.clone(), Duration::from_secs(3600), 100);
    for _ in 0..100 {
        if janitor.removed() == 150 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(janitor.removed(), 150);
    janitor.stop();
    assert_eq!(store.purge_expired(100).await.unwrap(), 0);
    let req = ReserveRequest {
        id: &live,
        fingerprint: "f",
        token: idem_testkit::token(),
        ttl: long,
        lock_timeout: long,
    };
    assert!(matches!(
        store.reserve(req).await.unwrap(),
        Reservation::InProgress { .. }
    ));
    // Still there: its stale lock is taken over, not absent.
    let req = ReserveRequest {
        id: &kept,
        fingerprint: "f",
        token: idem_testkit::token(),
        ttl: long,
        lock_timeout: long,
    };
    assert!(matches!(store.reserve(req).await.unwrap(), Reservation::Reserved(l) if l.attempt == 2));
}

idem_testkit::for_each_store! {
    stores: [sqlite, postgres],
    setup: |kind| sql(kind).await,
    worker_threads: 2,
    cases: [
        the_handlers_writes_commit_with_the_completion,
        a_released_outcome_rolls_the_writes_back,
        a_fenced_out_execution_commits_nothing,
        the_janitor_purges_in_batches_and_spares_live_locks,
    ],
}
