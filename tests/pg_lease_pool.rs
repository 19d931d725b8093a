//! PostgreSQL: executions whose handlers hold every connection of the
//! store's pool (each in its own transaction) keep their leases. The lock
//! extensions fall back on a connection the store keeps of its own, so a
//! living execution is never counted as lost for want of a connection,
//! and a retry sent to another server meanwhile is answered 409, never run.

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use idem::{idempotent, Idem, Operation};
use idem_testkit::http::post as post_req;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;

const LOCK: Duration = Duration::from_millis(600);

#[derive(Clone)]
struct Gates {
    /// One permit per handler inside its open transaction.
    in_tx: Arc<Semaphore>,
    /// Lets the handlers return.
    done: Arc<Semaphore>,
    runs: Arc<AtomicU32>,
}

impl Gates {
    fn new() -> Self {
        Gates {
            in_tx: Arc::new(Semaphore::new(0)),
            done: Arc::new(Semaphore::new(0)),
            runs: Arc::default(),
        }
    }
}

/// Opens its transaction (a connection of the store's pool), writes in it,
/// and holds it until the test lets it go; says whether it was told its
/// lease was lost meanwhile.
#[idempotent(scope = "pool.tx", lock_timeout = "600ms")]
async fn holds_tx(State(g): State<Gates>, op: Operation) -> (StatusCode, String) {
    let run = g.runs.fetch_add(1, Ordering::SeqCst) + 1;
    let mut tx = op.pg_transaction().await.expect("the transaction opens");
    sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap();
    g.in_tx.add_permits(1);
    let told_lost = tokio::select! {
        () = op.lease_lost() => true,
        _ = g.done.acquire() => false,
    };
    drop(tx);
    (StatusCode::CREATED, format!("run {run}, told lost: {told_lost}"))
}

fn app(store: idem::PgStore, gates: &Gates) -> Router {
    Router::new()
        .route("/tx", post(holds_tx))
        .layer(Idem::new(store).single_tenant().layer())
        .with_state(gates.clone())
}

/// Waits until the lock of `key` has been extended to more than three lock
/// timeouts past its first deadline (the extensions ran while the
/// handlers held the pool), or `running` says its request ended first.
async fn extended_three_times(pool: &sqlx::PgPool, schema: &str, key: &str, running: impl Fn() -> bool) {
    let deadline = |pool: &sqlx::PgPool| {
        let sql = format!(
            "SELECT date_part('epoch', lock_expires_at)::float8 FROM \"{schema}\".idempotency_keys \
             WHERE key = '{key}' AND lock_token IS NOT NULL"
        );
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, f64>(sqlx::AssertSqlSafe(sql))
                .fetch_optional(&pool)
                .await
                .unwrap()
        }
    };
    let first = deadline(pool).await.expect("the record is locked");
    let until = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        assert!(
            running(),
            "the request of {key} ended while its handler held its transaction"
        );
        match deadline(pool).await {
            Some(now) if now > first + 3.0 * LOCK.as_secs_f64() => return,
            Some(_) => {}
            None => panic!("the lock of {key} is gone while its handler runs"),
        }
        assert!(
            std::time::Instant::now() < until,
            "the lock of {key} was not extended"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_handlers_holding_every_pooled_connection_keep_their_leases() {
    let url = idem_testkit::pg_url().expect("DATABASE_URL");
    let schema = idem_testkit::pg_schema(&url).await;
    let store = idem_testkit::pg_store_in(&url, &schema, 2)
        .await
        .with_timeout(Duration::from_secs(2));
    let observer = sqlx::PgPool::connect(&url).await.unwrap();
    let gates = Gates::new();
    let addr = idem_testkit::http::serve(app(store, &gates)).await;
    let keys: [&'static str; 2] = ["pool-full-0", "pool-full-1"];
    let sent: Vec<_> = keys
        .iter()
        .map(|&key| tokio::spawn(async move { post_req("/tx", "").key(key).send(addr).await }))
        .collect();
    // Both handlers hold their transactions: the pool of 2 has no
    // connection left.
    let _both = gates.in_tx.acquire_many(2).await.unwrap();
    for (key, request) in keys.iter().zip(&sent) {
        extended_three_times(&observer, &schema, key, || !request.is_finished()).await;
    }
    gates.done.add_permits(2);
    for request in sent {
        let answer = request.await.unwrap();
        let body = String::from_utf8_lossy(&answer.body).into_owned();
        assert_eq!(answer.status, 201, "{body}");
        assert!(body.ends_with("told lost: false"), "{body}");
    }
    assert_eq!(gates.runs.load(Ordering::SeqCst), 2);
}

/// Two servers on one table: the first's handler holds the only
/// connection of its store's pool; the same request sent to the second
/// while it runs is 409, and its retry afterwards replays the one run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_retry_elsewhere_is_409_while_an_execution_holds_its_pool() {
    let url = idem_testkit::pg_url().expect("DATABASE_URL");
    let schema = idem_testkit::pg_schema(&url).await;
    let one = idem_testkit::pg_store_in(&url, &schema, 1)
        .await
        .with_timeout(Duration::from_secs(2));
    let other = idem_testkit::pg_store_in(&url, &schema, 4)
        .await
        .with_timeout(Duration::from_secs(2));
    let observer = other.pool().clone();
    let gates = Gates::new();
    let first_server = idem_testkit::http::serve(app(one, &gates)).await;
    let second_server = idem_testkit::http::serve(app(other, &gates)).await;
    let first = tokio::spawn(async move { post_req("/tx", "").key("pool-one").send(first_server).await });
    gates.in_tx.acquire().await.unwrap().forget();
    extended_three_times(&observer, &schema, "pool-one", || !first.is_finished()).await;
    let retry = post_req("/tx", "").key("pool-one").send(second_server).await;
    assert_eq!(retry.status, 409, "{}", String::from_utf8_lossy(&retry.body));
    assert_eq!(gates.runs.load(Ordering::SeqCst), 1);
    gates.done.add_permits(1);
    let first = first.await.unwrap();
    assert_eq!(
        (first.status, String::from_utf8_lossy(&first.body).into_owned()),
        (201, "run 1, told lost: false".to_owned()),
    );
    let replay = post_req("/tx", "").key("pool-one").send(second_server).await;
    assert_eq!(
        (replay.status, String::from_utf8_lossy(&replay.body).into_owned()),
        (201, "run 1, told lost: false".to_owned()),
    );
    assert_eq!(gates.runs.load(Ordering::SeqCst), 1);
}

/// Waits for a handler of its own until the test lets it go; says whether
/// it was told its lease was lost meanwhile. No transaction: the pool
/// stays the test's to fill.
#[idempotent(scope = "pool.plain", lock_timeout = "600ms")]
async fn holds(State(g): State<Gates>, op: Operation) -> (StatusCode, String) {
    g.in_tx.add_permits(1);
    let told_lost = tokio::select! {
        () = op.lease_lost() => true,
        _ = g.done.acquire() => false,
    };
    (StatusCode::CREATED, format!("told lost: {told_lost}"))
}

/// Waits until an extension of the store in `schema` waits for a row lock
/// (seen by the database, not hoped for).
async fn an_extension_waits_for_a_row(observer: &sqlx::PgPool, schema: &str) {
    idem_testkit::within(
        Duration::from_secs(20),
        "an extension to wait for a row",
        async || {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE $1",
            )
            .bind(format!("%\"{schema}\"%lock_expires_at%"))
            .fetch_one(observer)
            .await
            .unwrap();
            waiting > 0
        },
    )
    .await;
}

/// One execution's extension held up on the store's spare connection (its
/// row held by another transaction) holds up no other execution's: with no
/// idle connection in the pool, the other's runs on one the pool opens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_an_extension_held_up_on_the_spare_holds_up_no_other() {
    let url = idem_testkit::pg_url().expect("DATABASE_URL");
    let schema = idem_testkit::pg_schema(&url).await;
    let store = idem_testkit::pg_store_in(&url, &schema, 10).await;
    let pool = store.pool().clone();
    // Idle connections: the first reservation takes its spare at once.
    drop(futures_util::future::join_all((0..3).map(|_| pool.acquire())).await);
    let gates = Gates::new();
    let app = Router::new()
        .route("/plain", post(holds))
        .layer(Idem::new(store.clone()).single_tenant().layer())
        .with_state(gates.clone());
    let addr = idem_testkit::http::serve(app).await;
    let held_up = tokio::spawn(async move { post_req("/plain", "").key("spare-x").send(addr).await });
    let other = tokio::spawn(async move { post_req("/plain", "").key("spare-y").send(addr).await });
    gates.in_tx.acquire_many(2).await.unwrap().forget();
    // Every connection the pool has open now is the test's (it may open
    // seven more): no extension finds an idle one.
    let open = pool.size() as usize;
    let mut taken = Vec::new();
    while taken.len() < open {
        match pool.try_acquire() {
            Some(c) => taken.push(c),
            None => tokio::time::sleep(Duration::from_millis(1)).await,
        }
    }
    let observer = sqlx::PgPool::connect(&url).await.unwrap();
    let holder = idem_testkit::records::pg_hold_row(
        &observer,
        &store,
        &idem::store::RecordId::new("", "pool.plain", "spare-x"),
    )
    .await;
    // The held-up execution's extension waits for the row.
    an_extension_waits_for_a_row(&observer, &schema).await;
    extended_three_times(&observer, &schema, "spare-y", || !other.is_finished()).await;
    holder.rollback().await.unwrap();
    drop(taken);
    gates.done.add_permits(2);
    let other = other.await.unwrap();
    assert_eq!(
        (other.status, String::from_utf8_lossy(&other.body).into_owned()),
        (201, "told lost: false".to_owned()),
    );
    // The held-up one's own lease may have run out meanwhile: it answers,
    // either way, and runs once.
    assert!(matches!(held_up.await.unwrap().status, 201 | 503));
}

/// With every connection of the pool held by handlers in their
/// transactions, one execution's extension held up on the spare (its row
/// held by another transaction) holds up the other's no longer than an
/// extension waits for its row: the other lease is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_an_extension_held_up_on_the_spare_with_the_pool_full_holds_up_no_lease() {
    let url = idem_testkit::pg_url().expect("DATABASE_URL");
    let schema = idem_testkit::pg_schema(&url).await;
    let store = idem_testkit::pg_store_in(&url, &schema, 2)
        .await
        .with_timeout(Duration::from_secs(2));
    let observer = sqlx::PgPool::connect(&url).await.unwrap();
    let gates = Gates::new();
    let addr = idem_testkit::http::serve(app(store.clone(), &gates)).await;
    let held_up = tokio::spawn(async move { post_req("/tx", "").key("full-a").send(addr).await });
    let other = tokio::spawn(async move { post_req("/tx", "").key("full-b").send(addr).await });
    gates.in_tx.acquire_many(2).await.unwrap().forget();
    let holder = idem_testkit::records::pg_hold_row(
        &observer,
        &store,
        &idem::store::RecordId::new("", "pool.tx", "full-a"),
    )
    .await;
    // The held-up execution's extension waits for the row on the spare
    // (the pool's two connections are in their handlers' transactions).
    an_extension_waits_for_a_row(&observer, &schema).await;
    extended_three_times(&observer, &schema, "full-b", || !other.is_finished()).await;
    holder.rollback().await.unwrap();
    gates.done.add_permits(2);
    let other = other.await.unwrap();
    let body = String::from_utf8_lossy(&other.body).into_owned();
    assert_eq!(other.status, 201, "{body}");
    assert!(body.ends_with("told lost: false"), "{body}");
    assert!(matches!(held_up.await.unwrap().status, 201 | 503));
}

/// A pool of three whose sessions are named `name`, and a migrated store
/// over it on `schema`'s table.
async fn named_store(url: &str, schema: &str, name: &str) -> (sqlx::PgPool, idem::PgStore) {
    let options = url
        .parse::<sqlx::postgres::PgConnectOptions>()
        .unwrap()
        .application_name(name);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(3)
        .connect_with(options)
        .await
        .unwrap();
    let store = idem::PgStore::new(pool.clone())
        .with_table(Some(schema), "idempotency_keys")
        .unwrap();
    store.migrate().await.unwrap();
    (pool, store)
}

/// How many of the database's sessions are named `name`.
async fn sessions_named(observer: &sqlx::PgPool, name: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1")
        .bind(name)
        .fetch_one(observer)
        .await
        .unwrap()
}

/// The application closes its pool: the store's spare connection is
/// closed with it, and no connection of the store stays open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_closing_the_pool_closes_the_spare() {
    let url = idem_testkit::pg_url().expect("DATABASE_URL");
    let schema = idem_testkit::pg_schema(&url).await;
    let name = idem_testkit::unique("idem_spare_close");
    let (pool, store) = named_store(&url, &schema, &name).await;
    let gates = Gates::new();
    let idem = Idem::new(store).single_tenant();
    let app = Router::new()
        .route("/plain", post(holds))
        .layer(idem.clone().layer())
        .with_state(gates.clone());
    let addr = idem_testkit::http::serve(app).await;
    gates.done.add_permits(1);
    assert_eq!(post_req("/plain", "").key("close-1").send(addr).await.status, 201);
    idem.idle().await;
    let observer = sqlx::PgPool::connect(&url).await.unwrap();
    // The spare is one of them (the pool keeps no more than three).
    assert!(sessions_named(&observer, &name).await > 0);
    pool.close().await;
    idem_testkit::within(
        Duration::from_secs(10),
        "every connection of the store to close",
        async || sessions_named(&observer, &name).await == 0,
    )
    .await;
}

/// A store and its `with_table` clone on one pool share one spare, and one
/// connection kept for the statements that run alone: with the pool at its
/// full size, the database has the pool's connections and two more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_store_and_its_clones_share_one_spare() {
    let url = idem_testkit::pg_url().expect("DATABASE_URL");
    let schema = idem_testkit::pg_schema(&url).await;
    let name = idem_testkit::unique("idem_spares");
    let (pool, one) = named_store(&url, &schema, &name).await;
    let other = one.clone().with_table(Some(&schema), "other_keys").unwrap();
    other.migrate().await.unwrap();
    let lasting = Duration::from_secs(3600);
    for (store, key) in [
        (&one, "one-1"),
        (&other, "other-1"),
        (&one, "one-2"),
        (&other, "other-2"),
    ] {
        let id = idem::store::RecordId::new("t", "s", key);
        idem_testkit::records::take(store, &id, "fp", lasting, lasting).await;
    }
    let mut full = Vec::new();
    for _ in 0..3 {
        full.push(pool.acquire().await.unwrap());
    }
    let observer = sqlx::PgPool::connect(&url).await.unwrap();
    // A spare taken in the background may still be on its way.
    idem_testkit::within(Duration::from_secs(10), "a spare to be taken", async || {
        sessions_named(&observer, &name).await >= 5
    })
    .await;
    assert_eq!(
        sessions_named(&observer, &name).await,
        5,
        "the pool's 3, one spare and one kept connection"
    );
}
