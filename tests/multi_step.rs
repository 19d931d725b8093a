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
    sql_within(kind, None).await
}

/// [`sql`], its store bounded by `timeout` if one is given.
async fn sql_within(kind: StoreKind, timeout: Option<Duration>) -> Option<Sql> {
    let (store, db, dir): (Arc<dyn IdempotencyStore>, _, _) = match kind {
        StoreKind::Sqlite => {
            let (store, dir) = idem_testkit::sqlite_store().await;
            let db = Db::Sqlite(store.pool().clone());
            let store = match timeout {
                Some(t) => store.with_timeout(t),
                None => store,
            };
            (Arc::new(store), db, Some(dir))
        }
        StoreKind::Postgres => {
            let url = idem_testkit::pg_url()?;
            let schema = idem_testkit::pg_schema(&url).await;
            let store = idem_testkit::pg_store_in(&url, &schema, 10).await;
            let db = Db::Pg(store.pool().clone(), schema);
            let store = match timeout {
                Some(t) => store.with_timeout(t),
                None => store,
            };
            (Arc::new(store), db, None)
        }
        StoreKind::Memory => unreachable!("the handler's rows are written in a SQL transaction"),
    };
    Some(Sql { store, db, _dir: dir })
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

/// What a task the handler left holding `op` is told when it opens the
/// operation's transaction once the handler has returned.
#[derive(Clone)]
struct Late {
    db: Db,
    /// Lets the task go, once the first answer is in.
    go: Arc<tokio::sync::Semaphore>,
    /// What the task's transaction and write came to.
    told: tokio::sync::mpsc::UnboundedSender<Result<(), idem::StoreError>>,
}

/// Answers at once, leaving a task that holds `op` and, when let go, opens
/// the operation's transaction and writes one row in it.
#[idempotent(scope = "effect.late")]
async fn leave_a_late_writer(State(late): State<Late>, op: Operation) -> StatusCode {
    tokio::spawn(async move {
        late.go.acquire().await.unwrap().forget();
        let id = op.derived_key("late");
        // The transaction's connection types differ; the steps do not.
        macro_rules! write_in {
            ($transaction:ident, $param:literal) => {
                match op.$transaction().await {
                    Ok(mut conn) => sqlx::query(sqlx::AssertSqlSafe(format!(
                        "INSERT INTO {} (id, note) VALUES ({}, 'late')",
                        late.db.effects(),
                        $param
                    )))
                    .bind(&id)
                    .execute(&mut *conn)
                    .await
                    .map(drop)
                    .map_err(|e| idem::StoreError::backend(e.to_string())),
                    Err(e) => Err(e),
                }
            };
        }
        let written = match &late.db {
            Db::Pg(..) => write_in!(pg_transaction, "$1"),
            Db::Sqlite(_) => write_in!(sqlite_transaction, "?1"),
        };
        drop(op);
        let _ = late.told.send(written);
    });
    StatusCode::CREATED
}

/// A server whose handler leaves a late writer, and the handle that lets
/// that writer go and hears what it came to.
async fn late_writer(store: Arc<dyn IdempotencyStore>, db: &Db) -> (std::net::SocketAddr, LateWriter) {
    db.create_table().await;
    let (told, written) = tokio::sync::mpsc::unbounded_channel();
    let late = Late {
        db: db.clone(),
        go: Arc::new(tokio::sync::Semaphore::new(0)),
        told,
    };
    let app = Router::new()
        .route("/late", post(leave_a_late_writer))
        .layer(Idem::from_arc(store).single_tenant().layer())
        .with_state(late.clone());
    (serve(app).await, LateWriter { go: late.go, written })
}

struct LateWriter {
    go: Arc<tokio::sync::Semaphore>,
    written: tokio::sync::mpsc::UnboundedReceiver<Result<(), idem::StoreError>>,
}

impl LateWriter {
    /// Lets the late writer go, and what its transaction and write came to.
    async fn lets_go(&mut self) -> Result<(), idem::StoreError> {
        self.go.add_permits(1);
        tokio::time::timeout(Duration::from_secs(10), self.written.recv())
            .await
            .expect("the late writer reports")
            .expect("the late writer reports once")
    }
}

/// A transaction opened through `op` once the handler has returned could
/// never commit with the answer, which is recorded already: it is refused
/// (`LockLost`, as a checkpoint then is), never opened and silently rolled
/// back (on SQLite it would also hold the write lock of every other request
/// until the task let `op` go).
async fn a_transaction_opened_after_the_handler_returned_is_refused(Sql { store, db, _dir }: Sql) {
    let (addr, mut late) = late_writer(store, &db).await;
    let first = post_req("/late", "").key("k-late").send(addr).await;
    assert_eq!(first.status, 201);
    let written = late.lets_go().await;
    assert!(
        matches!(written, Err(idem::StoreError::LockLost)),
        "opened after the handler returned: {written:?}"
    );
    assert_eq!(db.count().await, 0);
    let replay = post_req("/late", "").key("k-late").send(addr).await;
    assert_eq!(
        (replay.status, replay.header("idempotent-replayed")),
        (201, Some("true"))
    );
}

/// The other side of that boundary: a task that opens the transaction after
/// the handler returned but before its execution takes it (held here at
/// `HANDLER_RETURNED`) writes in the handler's transaction, which commits
/// with the answer.
async fn a_transaction_opened_before_the_execution_takes_it_commits(Sql { store, db, _dir }: Sql) {
    use idem_runtime::pause;
    let (addr, mut late) = late_writer(store, &db).await;
    let key = idem_testkit::unique("k-late-open");
    let mut returned = pause::arm(pause::HANDLER_RETURNED, &key);
    let first = {
        let key = key.clone();
        tokio::spawn(async move { post_req("/late", "").key(&key).send(addr).await })
    };
    returned.reached().await;
    let written = late.lets_go().await;
    assert!(
        written.is_ok(),
        "opened before the execution took it: {written:?}"
    );
    assert_eq!(db.count().await, 0, "not committed before the answer");
    returned.resume();
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(db.count().await, 1, "committed with the answer");
}

/// What a task that keeps the handler's transaction connection is let do.
#[derive(Clone)]
struct Holder {
    db: Db,
    /// Lets a `hold` task let the connection go.
    go: Arc<tokio::sync::Semaphore>,
}

#[derive(serde::Deserialize, serde::Serialize)]
struct HoldIn {
    /// `feed`: the task writes two rows, sending a line of the answer's
    /// body after each, and lets the connection go once the body is read.
    /// The handler answers 201; with `feed-reject`, 422 (a rejection);
    /// with `feed-release`, 500. With `-long` at the end, six rows and
    /// lines. `feed-sse-reject`: one row and line, then the task keeps the
    /// connection and the body (an event stream, 422) open until let go.
    /// `lost-feed`, `lost-feed-reject`: as `feed` and `feed-reject`, the
    /// handler returning once told its lease is lost.
    /// `hold`: it writes one row and keeps the connection until let go;
    /// the handler answers 201. `hold-reject`: the same, and the handler
    /// answers 422.
    then: String,
}

/// Makes every row's id new: a row that committed when it should not have
/// is counted, not refused as a duplicate.
static ROW: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The operation's transaction on either SQL store: their connection types
/// differ, what a test's task does with it does not.
enum HeldTx<'a> {
    Pg(idem::TxConnection<'a, sqlx::PgConnection>),
    Sqlite(idem::TxConnection<'a, sqlx::SqliteConnection>),
}

impl<'a> HeldTx<'a> {
    async fn open(op: &'a Operation, db: &Db) -> Self {
        match db {
            Db::Pg(..) => Self::Pg(op.pg_transaction().await.expect("the transaction opens")),
            Db::Sqlite(_) => Self::Sqlite(op.sqlite_transaction().await.expect("the transaction opens")),
        }
    }

    /// Writes a row noted `note` (with an id of its own) in the effects table.
    async fn write(&mut self, db: &Db, note: &str) {
        let id = format!("{note}-{}", ROW.fetch_add(1, std::sync::atomic::Ordering::SeqCst));
        let insert = |param: &str| {
            format!(
                "INSERT INTO {} (id, note) VALUES ({param}, '{note}')",
                db.effects()
            )
        };
        match self {
            Self::Pg(conn) => sqlx::query(sqlx::AssertSqlSafe(insert("$1")))
                .bind(id)
                .execute(&mut **conn)
                .await
                .map(drop),
            Self::Sqlite(conn) => sqlx::query(sqlx::AssertSqlSafe(insert("?1")))
                .bind(id)
                .execute(&mut **conn)
                .await
                .map(drop),
        }
        .expect("the write");
    }
}

/// Leaves a task that opens the operation's transaction, writes in it and
/// keeps its connection after the handler returned (see [`HoldIn`]).
#[idempotent(scope = "effect.held", fields(then))]
async fn keep_the_connection(
    State(h): State<Holder>,
    op: Operation,
    Json(input): Json<HoldIn>,
) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    let feed = input.then.contains("feed");
    let long = input.then.ends_with("-long");
    let sse = input.then.contains("sse");
    let task_op = op.clone();
    let (line, lines) = tokio::sync::mpsc::channel::<Result<String, std::io::Error>>(1);
    let (holding, held) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let op = task_op;
        let rows: &[&str] = match (feed, long, sse) {
            (true, true, _) => &["one", "two", "three", "four", "five", "six"],
            (true, false, false) => &["one", "two"],
            (true, false, true) => &["one"],
            (false, _, _) => &["held"],
        };
        let mut conn = HeldTx::open(&op, &h.db).await;
        let _ = holding.send(());
        for row in rows {
            conn.write(&h.db, row).await;
            if feed {
                let _ = line.send(Ok(format!("{row}\n"))).await;
            }
        }
        if !feed || sse {
            h.go.acquire().await.unwrap().forget();
        }
        drop(conn);
    });
    // The handler returns while the task holds the connection.
    held.await.expect("the task opens the transaction");
    if input.then == "hold-reject" {
        return (StatusCode::UNPROCESSABLE_ENTITY, "refused while held").into_response();
    }
    if !feed {
        return (StatusCode::CREATED, "held by a task").into_response();
    }
    let body = futures_util::stream::unfold(lines, |mut lines| async move {
        lines.recv().await.map(|line| (line, lines))
    });
    if input.then.starts_with("lost") {
        op.lease_lost().await;
    }
    let status = if input.then.contains("reject") {
        StatusCode::UNPROCESSABLE_ENTITY
    } else if input.then.contains("release") {
        StatusCode::INTERNAL_SERVER_ERROR
    } else {
        StatusCode::CREATED
    };
    let mut response = (status, axum::body::Body::from_stream(body)).into_response();
    if sse {
        let stream = axum::http::HeaderValue::from_static("text/event-stream");
        response
            .headers_mut()
            .insert(axum::http::header::CONTENT_TYPE, stream);
    }
    response
}

/// A server with the handler above three times: `/held` stores answers
/// whole (a lock timeout of 1 second), `/held-big` stores none of their
/// bodies (the limit is 4 bytes), `/fed` has the default lock timeout (60
/// seconds: a wait for the connection would outlast [`answered`]); and the
/// handle that lets `hold` tasks go.
async fn keeper_app(
    store: Arc<dyn IdempotencyStore>,
    db: &Db,
) -> (std::net::SocketAddr, Arc<tokio::sync::Semaphore>) {
    db.create_table().await;
    let h = Holder {
        db: db.clone(),
        go: Arc::new(tokio::sync::Semaphore::new(0)),
    };
    let plain = Idem::from_arc(store).single_tenant();
    let idem = plain.clone().lock_timeout(Duration::from_secs(1)).unwrap();
    let app = Router::new()
        .route("/held", post(keep_the_connection))
        .layer(idem.clone().layer())
        .merge(
            Router::new()
                .route("/fed", post(keep_the_connection))
                .layer(plain.layer()),
        )
        .merge(
            Router::new()
                .route("/held-big", post(keep_the_connection))
                .layer(idem.max_stored_body(4).unwrap().layer()),
        )
        .with_state(h.clone());
    (serve(app).await, h.go)
}

/// Asserts `reply` is 503 `idempotency-store-unavailable`: the execution
/// gave up waiting for the transaction's connection.
fn not_completed(reply: &idem_testkit::http::Reply) {
    assert_eq!(
        (reply.status, reply.problem()),
        (503, "idempotency-store-unavailable".to_owned()),
        "{reply:?}"
    );
}

/// `request`'s answer, which must come within 20 seconds.
async fn answered(
    request: idem_testkit::http::Request,
    addr: std::net::SocketAddr,
) -> idem_testkit::http::Reply {
    tokio::time::timeout(Duration::from_secs(20), request.send(addr))
        .await
        .expect("the request is answered")
}

/// A body fed by a task that holds the handler's transaction connection
/// until the body is read: the execution reads the body before it takes
/// the transaction, so the task lets go, and its writes commit with the
/// answer (taking the transaction first, the request would never answer).
async fn a_body_fed_by_the_transactions_holder_is_read_before_it_is_taken(Sql { store, db, _dir }: Sql) {
    let (addr, _) = keeper_app(store, &db).await;
    let first = answered(post_req("/held", r#"{"then":"feed"}"#).key("k-feed"), addr).await;
    assert_eq!(
        (first.status, first.body.as_slice()),
        (201, b"one\ntwo\n".as_slice())
    );
    assert_eq!(db.count().await, 2, "committed with the answer");
    let replay = answered(post_req("/held", r#"{"then":"feed"}"#).key("k-feed"), addr).await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.body, first.body);
    assert_eq!(db.count().await, 2);
}

/// The same, with a body too large to store: it streams to the client, and
/// the transaction is taken when the body has ended.
async fn a_streamed_body_fed_by_the_transactions_holder_commits_at_its_end(Sql { store, db, _dir }: Sql) {
    let (addr, _) = keeper_app(store, &db).await;
    let first = answered(
        post_req("/held-big", r#"{"then":"feed"}"#).key("k-feed-big"),
        addr,
    )
    .await;
    assert_eq!(
        (first.status, first.body.as_slice()),
        (201, b"one\ntwo\n".as_slice())
    );
    assert_eq!(db.count().await, 2, "committed with the answer");
    let replay = answered(
        post_req("/held-big", r#"{"then":"feed"}"#).key("k-feed-big"),
        addr,
    )
    .await;
    assert_eq!(
        (replay.status, replay.header("idempotent-replay-body-omitted")),
        (201, Some("true"))
    );
    assert_eq!(db.count().await, 2);
}

/// A rejection (422) or a failure (500) whose body is fed by the task that
/// holds the transaction's connection: the client gets the handler's own
/// answer, not 503 after a lock timeout; the task's writes are rolled
/// back; the rejection frees the key for a corrected request, the failure
/// lets its retry run again.
async fn a_refusal_fed_by_the_transactions_holder_is_passed_on(Sql { store, db, _dir }: Sql) {
    let (addr, _) = keeper_app(store, &db).await;
    for (then, status) in [("feed-reject", 422), ("feed-release", 500)] {
        let key = format!("k-{then}");
        let body = format!(r#"{{"then":"{then}"}}"#);
        let before = db.count().await;
        let first = answered(post_req("/fed", &body).key(&key), addr).await;
        assert_eq!(
            (first.status, first.body.as_slice()),
            (status, b"one\ntwo\n".as_slice()),
            "{then}: {first:?}"
        );
        assert_eq!(db.count().await, before, "{then}: rolled back");
        let next = if status == 422 {
            post_req("/fed", r#"{"then":"feed"}"#).key(&key)
        } else {
            post_req("/fed", &body).key(&key)
        };
        let next = answered(next, addr).await;
        assert_eq!(
            next.header("idempotent-replayed"),
            None,
            "{then}: the key was let go"
        );
        assert_eq!(next.body, b"one\ntwo\n", "{then}: {next:?}");
    }
    // Only the corrected request after the rejection committed its rows.
    assert_eq!(db.count().await, 2);
}

/// The same with a body too large to hold (the limit on `/held-big` is 4
/// bytes), which the task goes on feeding: the execution cannot take the
/// transaction before the body ends, nor pass the body on before the key
/// is let go. Within one lock timeout it gives up: 503, and once the task
/// lets go, the rows are rolled back and the key let go as the handler's
/// answer said (a corrected request runs after the rejection).
async fn a_long_refusal_fed_by_the_transactions_holder_ends_in_503(Sql { store, db, _dir }: Sql) {
    const SIX: &[u8] = b"one\ntwo\nthree\nfour\nfive\nsix\n";
    let (addr, _) = keeper_app(store, &db).await;
    for then in ["feed-reject-long", "feed-release-long"] {
        let key = format!("k-{then}");
        let before = db.count().await;
        let body = format!(r#"{{"then":"{then}"}}"#);
        let first = answered(post_req("/held-big", &body).key(&key), addr).await;
        assert_eq!(
            (first.status, first.problem()),
            (503, "idempotency-store-unavailable".to_owned()),
            "{then}: {first:?}"
        );
        assert_eq!(db.count().await, before, "{then}: nothing committed");
    }
    let corrected = || post_req("/held-big", r#"{"then":"feed-long"}"#).key("k-feed-reject-long");
    let corrected = once_let_go(addr, corrected).await;
    assert_eq!((corrected.status, corrected.body.as_slice()), (201, SIX));
    assert_eq!(db.count().await, 6, "only the corrected request's rows");
}

/// An event stream's refusal fed by a task that keeps the connection and
/// the stream open: within one lock timeout, 503 (not an answer that never
/// comes); once the task lets go, the corrected request runs.
async fn an_event_stream_refusal_fed_by_the_holder_ends_in_503(Sql { store, db, _dir }: Sql) {
    let (addr, go) = keeper_app(store, &db).await;
    let key = idem_testkit::unique("k-sse-reject");
    let first = answered(post_req("/held", r#"{"then":"feed-sse-reject"}"#).key(&key), addr).await;
    not_completed(&first);
    go.add_permits(1);
    let corrected = once_let_go(addr, || post_req("/held", r#"{"then":"feed"}"#).key(&key)).await;
    assert_eq!(
        (corrected.status, corrected.body.as_slice()),
        (201, b"one\ntwo\n".as_slice())
    );
    assert_eq!(db.count().await, 2, "only the corrected request's rows");
}

/// A refusal fed by the holder from a handler told its lease is lost (its
/// extension held past the deadline): not given, as on every other path,
/// whether its body fits the stored limit or not (`/held-big`: 503 once
/// the wait for the connection runs out), and nothing committed.
async fn a_held_refusal_after_the_lease_was_lost_is_not_given(Sql { store, db, _dir }: Sql) {
    use idem_runtime::pause;
    let (addr, _) = keeper_app(store, &db).await;
    for (path, then, problem) in [
        ("/held", "lost-feed-reject", "idempotency-lease-lost"),
        (
            "/held-big",
            "lost-feed-reject-long",
            "idempotency-store-unavailable",
        ),
        // A success too large to store is not streamed once the lease is
        // lost: its rest is dropped before the transaction is taken, so
        // the task feeding it lets go, and the answer is the small one's.
        ("/held", "lost-feed", "idempotency-lease-lost"),
        ("/held-big", "lost-feed-long", "idempotency-lease-lost"),
    ] {
        let key = idem_testkit::unique("k-lost-reject");
        let extension = pause::arm(pause::EXTEND_AFTER, &key);
        let body = format!(r#"{{"then":"{then}"}}"#);
        let first = tokio::time::timeout(
            Duration::from_secs(20),
            post_req(path, &body).key(&key).send_raw(addr),
        )
        .await
        .expect("answered");
        drop(extension);
        let first = idem_testkit::http::parse(&first);
        assert_eq!(
            (first.status, first.problem()),
            (503, problem.to_owned()),
            "{then}: {first:?}"
        );
    }
    assert_eq!(db.count().await, 0);
}

/// A panic payload whose `Drop` panics, thrown by a refusal's body while a
/// task holds the transaction's connection: the key is let go all the same
/// (the payload is dropped after that), so the retry runs at once instead
/// of getting 409 for a lock timeout.
async fn a_refusal_body_panic_while_the_connection_is_held_lets_the_key_go(Sql { store, db, _dir }: Sql) {
    db.create_table().await;
    let h = Holder {
        db: db.clone(),
        go: Arc::new(tokio::sync::Semaphore::new(0)),
    };
    let idem = Idem::from_arc(store).single_tenant();
    let app = Router::new()
        .route("/panics", post(body_panics_while_held))
        .layer(idem.layer())
        .with_state(h);
    let addr = serve(app).await;
    for status in [500u16, 422] {
        let body = format!(r#"{{"status":{status}}}"#);
        let key = format!("k-body-panic-{status}");
        let _ = post_req("/panics", &body).key(&key).send_raw(addr).await;
        let retry = post_req("/panics", &body).key(&key).send_raw(addr).await;
        let retry = String::from_utf8_lossy(&retry);
        assert!(
            !retry.starts_with("HTTP/1.1 409"),
            "{status}: the key stayed locked: {retry}"
        );
    }
    assert_eq!(db.count().await, 0, "nothing committed");
}

/// What makes a panic payload's `Drop` panic in its turn.
struct DropPanics;

impl Drop for DropPanics {
    fn drop(&mut self) {
        panic!("the body's panic payload's drop panicked");
    }
}

#[derive(serde::Deserialize, serde::Serialize)]
struct StatusIn {
    status: u16,
}

/// A task opens the transaction, writes a row and holds the connection
/// until the body is first polled; the body then panics with a payload
/// whose `Drop` panics.
#[idempotent(scope = "effect.body_panic", fields(status))]
async fn body_panics_while_held(
    State(h): State<Holder>,
    op: Operation,
    Json(input): Json<StatusIn>,
) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    let (holding, held) = tokio::sync::oneshot::channel::<()>();
    let (polled, first_poll) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let mut conn = HeldTx::open(&op, &h.db).await;
        conn.write(&h.db, "p").await;
        let _ = holding.send(());
        let _ = first_poll.await;
        drop(conn);
    });
    held.await.expect("the task opens the transaction");
    let mut polled = Some(polled);
    let body = futures_util::stream::poll_fn(
        move |_| -> std::task::Poll<Option<Result<axum::body::Bytes, std::io::Error>>> {
            if let Some(polled) = polled.take() {
                let _ = polled.send(());
            }
            std::panic::panic_any(DropPanics)
        },
    );
    (
        StatusCode::from_u16(input.status).unwrap(),
        axum::body::Body::from_stream(body),
    )
        .into_response()
}

/// The keys whose handler's panic payload was dropped.
static PAYLOADS_DROPPED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// A panic payload that says when it is dropped.
struct Flagged(String);

impl Drop for Flagged {
    fn drop(&mut self) {
        PAYLOADS_DROPPED.lock().unwrap().push(std::mem::take(&mut self.0));
    }
}

/// Panics while a task holds the transaction's connection until let go.
#[idempotent(scope = "effect.panic_held")]
async fn panic_while_held(State(h): State<Holder>, op: Operation) -> StatusCode {
    let (holding, held) = tokio::sync::oneshot::channel::<()>();
    let key = op.key().to_owned();
    tokio::spawn(async move {
        let conn = HeldTx::open(&op, &h.db).await;
        let _ = holding.send(());
        h.go.acquire().await.unwrap().forget();
        drop(conn);
    });
    held.await.unwrap();
    std::panic::panic_any(Flagged(key))
}

/// A handler that panics while a task keeps the connection past the lock
/// timeout: its payload (the handler's code) is dropped only once the key
/// is let go, after the task lets go, as when nothing holds the connection.
async fn a_panic_payload_outlives_a_connection_kept_past_the_lock_timeout(Sql { store, db, _dir }: Sql) {
    db.create_table().await;
    let go = Arc::new(tokio::sync::Semaphore::new(0));
    let h = Holder {
        db: db.clone(),
        go: go.clone(),
    };
    let idem = Idem::from_arc(store)
        .single_tenant()
        .lock_timeout(Duration::from_secs(1))
        .unwrap();
    let app = Router::new()
        .route("/p", post(panic_while_held))
        .layer(idem.layer())
        .with_state(h);
    let addr = serve(app).await;
    let key = idem_testkit::unique("k-panic-held");
    let dropped = || PAYLOADS_DROPPED.lock().unwrap().contains(&key);
    let first = answered(post_req("/p", "").key(&key), addr).await;
    assert_eq!(first.status, 503, "{first:?}");
    assert!(!dropped(), "dropped while the key is held");
    // One permit for the first task, one for the retry's.
    go.add_permits(2);
    let retry = once_let_go(addr, || post_req("/p", "").key(&key)).await;
    assert_eq!(retry.status, 500, "the retry ran (and panicked): {retry:?}");
    tokio::time::timeout(Duration::from_secs(10), async {
        while !dropped() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("dropped once the key was let go");
}

/// `request`'s answer once its key is let go: polled while it gets 409 or
/// 503, or 422 `idempotency-key-reused` (a corrected request meeting the
/// held record's other fingerprint), for 20 seconds at most.
async fn once_let_go(
    addr: std::net::SocketAddr,
    request: impl Fn() -> idem_testkit::http::Request,
) -> idem_testkit::http::Reply {
    tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let r = request().send(addr).await;
            let reused = r.status == 422 && r.header("content-type") == Some("application/problem+json");
            if r.status != 409 && r.status != 503 && !reused {
                break r;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the key is let go")
}

/// A task that keeps the connection a whole lock timeout after the handler
/// returned: the answer does not wait for it any longer. The client gets
/// 503 (its retry really retries); the key stays held until the task lets
/// go, and then its transaction is rolled back and the key released: the
/// retry runs, and only its row commits.
async fn a_connection_kept_past_the_lock_timeout_is_rolled_back_when_let_go(Sql { store, db, _dir }: Sql) {
    let (addr, go) = keeper_app(store, &db).await;
    let hold = || post_req("/held", r#"{"then":"hold"}"#).key("k-hold");
    let first = answered(hold(), addr).await;
    not_completed(&first);
    let retried = after_the_holder_lets_go(&db, addr, go, hold, hold).await;
    assert_eq!(
        (retried.status, retried.body.as_slice()),
        (201, b"held by a task".as_slice())
    );
    assert_eq!(db.count().await, 1, "the first run's row was rolled back");
}

/// The same for a rejection (422): the client gets 503 rather than the
/// rejection; once the task lets go, the rejected run's row is rolled back
/// and the key let go as a rejection, free for a corrected request.
async fn a_rejection_whose_connection_is_kept_is_rolled_back_when_let_go(Sql { store, db, _dir }: Sql) {
    let (addr, go) = keeper_app(store, &db).await;
    let refused = || post_req("/held", r#"{"then":"hold-reject"}"#).key("k-hold-reject");
    let first = answered(refused(), addr).await;
    not_completed(&first);
    let corrected = || post_req("/held", r#"{"then":"hold"}"#).key("k-hold-reject");
    let retried = after_the_holder_lets_go(&db, addr, go, refused, corrected).await;
    assert_eq!(
        (retried.status, retried.body.as_slice()),
        (201, b"held by a task".as_slice()),
        "the corrected request runs"
    );
    assert_eq!(db.count().await, 1, "the rejected run's row was rolled back");
}

/// The same for a body too large to store, whose status is on its way to
/// the client when the body ends: the client's connection breaks instead.
async fn a_streamed_answer_whose_connection_is_kept_breaks_and_is_rolled_back(Sql { store, db, _dir }: Sql) {
    let (addr, go) = keeper_app(store, &db).await;
    let hold = || post_req("/held-big", r#"{"then":"hold"}"#).key("k-hold-big");
    let raw = tokio::time::timeout(Duration::from_secs(20), hold().send_raw(addr))
        .await
        .expect("the connection ends");
    let text = String::from_utf8_lossy(&raw);
    assert!(text.starts_with("HTTP/1.1 201"), "{text}");
    assert!(!text.ends_with("0\r\n\r\n"), "a complete answer: {text}");
    let retried = after_the_holder_lets_go(&db, addr, go, hold, hold).await;
    assert_eq!(
        (retried.status, retried.body.as_slice()),
        (201, b"held by a task".as_slice())
    );
    assert_eq!(db.count().await, 1, "the first run's row was rolled back");
}

/// Once a task kept the connection past the lock timeout: nothing it wrote
/// has committed; on PostgreSQL a retry gets 409 while it holds on (on
/// SQLite the open transaction holds every writer: the retry cannot even
/// reserve); and once it and the retry's task are let go, the key is let
/// go and `retry`'s answer is the one returned (polled until then).
async fn after_the_holder_lets_go(
    db: &Db,
    addr: std::net::SocketAddr,
    go: Arc<tokio::sync::Semaphore>,
    same: impl Fn() -> idem_testkit::http::Request,
    retry: impl Fn() -> idem_testkit::http::Request,
) -> idem_testkit::http::Reply {
    assert_eq!(db.count().await, 0, "nothing committed");
    if matches!(db, Db::Pg(..)) {
        assert_eq!(answered(same(), addr).await.status, 409);
    }
    // One permit for the first task, one for the retry's.
    go.add_permits(2);
    tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let r = retry().send(addr).await;
            // A corrected request meets the held record's other fingerprint
            // until the key is let go.
            let reused = r.status == 422 && r.header("content-type") == Some("application/problem+json");
            if r.status != 409 && r.status != 503 && !reused {
                break r;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the key is released once the task lets go")
}

idem_testkit::for_each_store! {
    stores: [sqlite, postgres],
    setup: |kind| sql(kind).await,
    worker_threads: 2,
    cases: [
        the_handlers_writes_commit_with_the_completion,
        a_released_outcome_rolls_the_writes_back,
        a_fenced_out_execution_commits_nothing,
        a_transaction_opened_after_the_handler_returned_is_refused,
        a_transaction_opened_before_the_execution_takes_it_commits,
        a_body_fed_by_the_transactions_holder_is_read_before_it_is_taken,
        a_streamed_body_fed_by_the_transactions_holder_commits_at_its_end,
        a_refusal_fed_by_the_transactions_holder_is_passed_on,
        a_long_refusal_fed_by_the_transactions_holder_ends_in_503,
        an_event_stream_refusal_fed_by_the_holder_ends_in_503,
        a_held_refusal_after_the_lease_was_lost_is_not_given,
        a_refusal_body_panic_while_the_connection_is_held_lets_the_key_go,
        a_panic_payload_outlives_a_connection_kept_past_the_lock_timeout,
        a_connection_kept_past_the_lock_timeout_is_rolled_back_when_let_go,
        a_rejection_whose_connection_is_kept_is_rolled_back_when_let_go,
        a_streamed_answer_whose_connection_is_kept_breaks_and_is_rolled_back,
        the_janitor_purges_in_batches_and_spares_live_locks,
    ],
}

/// A statement of the handler's that fails in its transaction (a primary
/// key taken): PostgreSQL refuses every statement of that transaction
/// after it, and commits none of it; SQLite fails the statement alone.
mod a_statement_fails {
    use super::*;

    #[derive(serde::Deserialize, serde::Serialize)]
    struct RefuseIn {
        /// The status answered once the statement failed.
        status: u16,
    }

    /// Writes the effect, tries to write it again (refused: its id is
    /// taken), then answers `status`.
    #[idempotent(scope = "effect.refused", fields(status))]
    async fn write_twice(State(db): State<Db>, op: Operation, Json(input): Json<RefuseIn>) -> StatusCode {
        let id = op.derived_key("effect");
        let mut written = Vec::new();
        for _ in 0..2 {
            written.push(match &db {
                Db::Pg(..) => {
                    let mut conn = op.pg_transaction().await.unwrap();
                    let sql = format!("INSERT INTO {} (id, note) VALUES ($1, 'refused')", db.effects());
                    sqlx::query(sqlx::AssertSqlSafe(sql))
                        .bind(&id)
                        .execute(&mut *conn)
                        .await
                        .is_ok()
                }
                Db::Sqlite(_) => {
                    let mut conn = op.sqlite_transaction().await.unwrap();
                    let sql = format!("INSERT INTO {} (id, note) VALUES (?1, 'refused')", db.effects());
                    sqlx::query(sqlx::AssertSqlSafe(sql))
                        .bind(&id)
                        .execute(&mut *conn)
                        .await
                        .is_ok()
                }
            });
        }
        assert_eq!(written, [true, false], "the second insert is refused");
        StatusCode::from_u16(input.status).unwrap()
    }

    async fn app(store: Arc<dyn IdempotencyStore>, db: Db) -> std::net::SocketAddr {
        db.create_table().await;
        let app = Router::new()
            .route("/refused", post(write_twice))
            .layer(Idem::from_arc(store).single_tenant().layer())
            .with_state(db);
        serve(app).await
    }

    /// A rejection after the failure is the operation's answer: stored and
    /// replayed on both stores, the handler run once. On PostgreSQL the
    /// failed transaction's write is rolled back (nothing of it can
    /// commit); on SQLite it commits with the rejection.
    async fn a_rejection_after_a_failed_statement_is_stored(Sql { store, db, _dir }: Sql) {
        let addr = app(store, db.clone()).await;
        let send = || async move {
            post_req("/refused", r#"{"status":402}"#)
                .key("k-402")
                .send(addr)
                .await
        };
        let first = send().await;
        assert_eq!(first.status, 402, "{first:?}");
        assert_eq!(first.header("idempotent-replayed"), None);
        let again = send().await;
        assert_eq!(
            (again.status, again.header("idempotent-replayed")),
            (402, Some("true")),
            "{again:?}"
        );
        let kept = match db {
            Db::Pg(..) => 0,
            Db::Sqlite(_) => 1,
        };
        assert_eq!(db.count().await, kept);
    }

    /// A success after the failure: on PostgreSQL its write cannot commit,
    /// so it is not the answer (503, the key back as failed, the retry runs
    /// again); on SQLite the transaction is whole and commits with it.
    async fn a_success_after_a_failed_statement_commits_or_is_refused(Sql { store, db, _dir }: Sql) {
        let addr = app(store, db.clone()).await;
        let send = || async move {
            post_req("/refused", r#"{"status":201}"#)
                .key("k-201")
                .send(addr)
                .await
        };
        let first = send().await;
        let again = send().await;
        match db {
            Db::Pg(..) => {
                assert_eq!(first.problem(), "idempotency-store-unavailable", "{first:?}");
                assert_eq!(again.problem(), "idempotency-store-unavailable", "{again:?}");
                assert_eq!(db.count().await, 0);
            }
            Db::Sqlite(_) => {
                assert_eq!(first.status, 201, "{first:?}");
                assert_eq!(again.header("idempotent-replayed"), Some("true"), "{again:?}");
                assert_eq!(db.count().await, 1);
            }
        }
    }

    idem_testkit::for_each_store! {
        stores: [sqlite, postgres],
        setup: |kind| sql(kind).await,
        worker_threads: 2,
        cases: [
            a_rejection_after_a_failed_statement_is_stored,
            a_success_after_a_failed_statement_commits_or_is_refused,
        ],
    }
}

/// A handler's PostgreSQL transaction at REPEATABLE READ and a checkpoint:
/// one saved before the transaction's snapshot completes; one saved after
/// it changes the record's row under the snapshot, and the completion in
/// that transaction cannot be written (README, "Multi-step operations").
mod repeatable_read {
    use super::*;

    #[derive(serde::Deserialize, serde::Serialize)]
    struct When {
        /// `before` or `after` the transaction's first write.
        checkpoint: String,
    }

    #[idempotent(scope = "effect.repeatable", fields(checkpoint))]
    async fn checkpointed(State(db): State<Db>, op: Operation, Json(when): Json<When>) -> StatusCode {
        let mut conn = op.pg_transaction().await.unwrap();
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            .execute(&mut *conn)
            .await
            .unwrap();
        if when.checkpoint == "before" {
            op.checkpoint("started").await.unwrap();
        }
        let sql = format!("INSERT INTO {} (id, note) VALUES ($1, 'rr')", db.effects());
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(op.derived_key("effect"))
            .execute(&mut *conn)
            .await
            .unwrap();
        if when.checkpoint == "after" {
            op.checkpoint("written").await.unwrap();
        }
        StatusCode::CREATED
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_checkpoint_before_the_snapshot_completes_and_one_after_it_cannot() {
        let logs = idem_testkit::logs();
        let Some(Sql { store, db, _dir }) = sql(StoreKind::Postgres).await else {
            return;
        };
        db.create_table().await;
        let app = Router::new()
            .route("/rr", post(checkpointed))
            .layer(Idem::from_arc(store).single_tenant().layer())
            .with_state(db.clone());
        let addr = serve(app).await;
        let before = post_req("/rr", r#"{"checkpoint":"before"}"#)
            .key("k-before")
            .send(addr)
            .await;
        assert_eq!(before.status, 201, "{before:?}");
        assert_eq!(db.count().await, 1);
        let after = post_req("/rr", r#"{"checkpoint":"after"}"#)
            .key("k-after")
            .send(addr)
            .await;
        assert_eq!(after.problem(), "idempotency-store-unavailable", "{after:?}");
        assert_eq!(db.count().await, 1, "nothing of it committed");
        assert!(
            logs.text().contains("a checkpoint after its first statement"),
            "the log does not say why"
        );
    }
}

/// SQLite ends a transaction by itself on some errors (here a trigger's
/// `RAISE(ROLLBACK)`); every statement after that commits on its own.
mod sqlite_ends_the_transaction {
    use super::*;

    /// What the handler does once the charge, which the trigger refuses
    /// in the same transaction, has failed: `decline` (402, an answer that
    /// is stored), `invalid` (422, which frees the key), `fallback` (a
    /// write to the ledger, then 503), `after` (an insert in a savepoint,
    /// which SQLite's own rollback left to open a new transaction, refused
    /// and rolled back, then 402); or `savepoint` (`deeper`: two nested):
    /// the charge tried in a savepoint, whose rollback then fails, and 402.
    #[derive(serde::Deserialize, serde::Serialize)]
    struct ChargeIn {
        then: String,
    }

    #[idempotent(scope = "charge.sqlite", fields(then))]
    async fn charge(op: Operation, Json(input): Json<ChargeIn>) -> StatusCode {
        use sqlx::Connection as _;
        let mut conn = op.sqlite_transaction().await.unwrap();
        sqlx::query("INSERT INTO audit (note) VALUES ('attempted')")
            .execute(&mut *conn)
            .await
            .unwrap();
        if input.then == "commit_fails" {
            // The next commit on this connection fails, and SQLite rolls
            // the transaction back by itself, as on a full disk or an I/O
            // error at commit.
            let once = std::sync::atomic::AtomicBool::new(true);
            conn.lock_handle()
                .await
                .unwrap()
                .set_commit_hook(move || !once.swap(false, std::sync::atomic::Ordering::SeqCst));
            return StatusCode::CREATED;
        }
        let charge = "INSERT INTO charges (amount) VALUES (1000)";
        if input.then == "savepoint" {
            let mut savepoint = conn.begin().await.unwrap();
            let charged = sqlx::query(charge).execute(&mut *savepoint).await;
            assert!(charged.is_err(), "the trigger refuses the charge");
            assert!(savepoint.rollback().await.is_err(), "SQLite ended it");
            return StatusCode::PAYMENT_REQUIRED;
        }
        if input.then == "deeper" {
            let mut outer = conn.begin().await.unwrap();
            let mut inner = outer.begin().await.unwrap();
            let charged = sqlx::query(charge).execute(&mut *inner).await;
            assert!(charged.is_err(), "the trigger refuses the charge");
            assert!(inner.rollback().await.is_err(), "SQLite ended it");
            assert!(outer.rollback().await.is_err(), "SQLite ended it");
            return StatusCode::PAYMENT_REQUIRED;
        }
        let charged = sqlx::query(charge).execute(&mut *conn).await;
        assert!(charged.is_err(), "the trigger refuses the charge");
        match input.then.as_str() {
            "decline" => StatusCode::PAYMENT_REQUIRED,
            "invalid" => StatusCode::UNPROCESSABLE_ENTITY,
            "after" => {
                let mut savepoint = conn.begin().await.unwrap();
                let inserted = sqlx::query("INSERT INTO once (id) VALUES (1)")
                    .execute(&mut *savepoint)
                    .await;
                assert!(inserted.is_err(), "a primary key taken");
                savepoint.rollback().await.unwrap();
                StatusCode::PAYMENT_REQUIRED
            }
            _ => {
                sqlx::query("INSERT INTO ledger (amount) VALUES (1000)")
                    .execute(&mut *conn)
                    .await
                    .unwrap();
                StatusCode::SERVICE_UNAVAILABLE
            }
        }
    }

    #[idempotent(scope = "plain.sqlite")]
    async fn plain() -> StatusCode {
        StatusCode::CREATED
    }

    async fn app() -> (std::net::SocketAddr, sqlx::SqlitePool, tempfile::TempDir) {
        let (store, dir) = idem_testkit::sqlite_store().await;
        let (addr, pool) = app_on(store).await;
        (addr, pool, dir)
    }

    async fn app_on(store: idem::SqliteStore) -> (std::net::SocketAddr, sqlx::SqlitePool) {
        sqlx::raw_sql(
            "CREATE TABLE audit (note TEXT NOT NULL); CREATE TABLE ledger (amount INTEGER NOT NULL); \
             CREATE TABLE once (id INTEGER PRIMARY KEY); INSERT INTO once VALUES (1); \
             CREATE TABLE charges (amount INTEGER NOT NULL); \
             CREATE TRIGGER funds BEFORE INSERT ON charges WHEN NEW.amount > 500 \
             BEGIN SELECT RAISE(ROLLBACK, 'insufficient funds'); END;",
        )
        .execute(store.pool())
        .await
        .unwrap();
        let pool = store.pool().clone();
        let app = Router::new()
            .route("/charge", post(charge))
            .route("/plain", post(plain))
            .layer(Idem::new(store).single_tenant().layer());
        (serve(app).await, pool)
    }

    /// [`app_on`] an in-memory database of one connection (whose records
    /// live only as long as it does), with one answer recorded (`k-paid`).
    async fn one_connection_app() -> (std::net::SocketAddr, sqlx::SqlitePool) {
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(1)
            .connect("sqlite::memory:")
            .await
            .unwrap();
        let store = idem::SqliteStore::new(pool.clone());
        store.migrate().await.unwrap();
        let (addr, _) = app_on(store).await;
        assert_eq!(post_req("/plain", "").key("k-paid").send(addr).await.status, 201);
        (addr, pool)
    }

    /// 24 requests of other keys, each 201: no connection of the pool is
    /// left unfit.
    async fn other_requests_are_served(addr: std::net::SocketAddr) {
        for i in 0..24 {
            let r = post_req("/plain", "")
                .key(&format!("k-plain-{i}"))
                .send(addr)
                .await;
            assert_eq!(
                r.status,
                201,
                "request {i}: {:?}",
                String::from_utf8_lossy(&r.body)
            );
        }
    }

    async fn count(pool: &sqlx::SqlitePool, table: &str) -> i64 {
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT COUNT(*) FROM {table}")))
            .fetch_one(pool)
            .await
            .unwrap()
    }

    async fn record(pool: &sqlx::SqlitePool, key: &str) -> Option<(String, Option<String>, i64)> {
        sqlx::query_as("SELECT state, lock_token, attempt FROM idempotency_keys WHERE key = ?1")
            .bind(key)
            .fetch_optional(pool)
            .await
            .unwrap()
    }

    fn outcome_unknown(answer: &idem_testkit::http::Reply) {
        assert_eq!(answer.status, 503);
        let problem = answer.json();
        assert!(
            problem["type"]
                .as_str()
                .unwrap()
                .ends_with("idempotency-store-unavailable")
                && problem["detail"]
                    .as_str()
                    .unwrap()
                    .contains("could not be recorded"),
            "{problem}"
        );
    }

    /// An answer to store, after SQLite rolled back the audit row: the
    /// completion is not written alone, and the retry runs again.
    #[tokio::test]
    async fn an_answer_is_not_recorded_without_the_writes_sqlite_rolled_back() {
        let (addr, pool, _dir) = app().await;
        let body = r#"{"then":"decline"}"#;
        let first = post_req("/charge", body).key("k-decline").send(addr).await;
        outcome_unknown(&first);
        assert_eq!(count(&pool, "audit").await, 0);
        assert_eq!(
            record(&pool, "k-decline").await,
            Some(("in_progress".to_owned(), None, 1)),
            "released as failed, nothing recorded"
        );
        let retry = post_req("/charge", body).key("k-decline").send(addr).await;
        assert_eq!(retry.header("idempotent-replayed"), None);
        outcome_unknown(&retry);
        assert_eq!(
            record(&pool, "k-decline").await.unwrap().2,
            2,
            "the same operation"
        );
    }

    /// An answer that would free the key (422) does not, when what the
    /// handler wrote could not all be undone; another request with the key
    /// is refused.
    #[tokio::test]
    async fn a_key_is_not_freed_when_sqlite_ended_the_transaction() {
        let (addr, pool, _dir) = app().await;
        let first = post_req("/charge", r#"{"then":"invalid"}"#)
            .key("k-invalid")
            .send(addr)
            .await;
        outcome_unknown(&first);
        assert_eq!(
            record(&pool, "k-invalid").await,
            Some(("in_progress".to_owned(), None, 1))
        );
        let other = post_req("/charge", r#"{"then":"decline"}"#)
            .key("k-invalid")
            .send(addr)
            .await;
        assert_eq!(other.status, 422, "the key is not free: {:?}", other.json());
    }

    /// A write made after SQLite ended the transaction committed on its
    /// own: the failure's answer is not given as if nothing had changed.
    #[tokio::test]
    async fn a_failure_after_sqlite_ended_the_transaction_is_told_as_unknown() {
        let (addr, pool, _dir) = app().await;
        let first = post_req("/charge", r#"{"then":"fallback"}"#)
            .key("k-fallback")
            .send(addr)
            .await;
        outcome_unknown(&first);
        assert_eq!(count(&pool, "ledger").await, 1, "committed on its own");
        assert_eq!(
            record(&pool, "k-fallback").await,
            Some(("in_progress".to_owned(), None, 1))
        );
    }

    /// The connection goes back to the pool as sqlx counts it: no other
    /// request finds it still "in a transaction".
    #[tokio::test]
    async fn the_connection_is_fit_for_other_requests_afterwards() {
        let (addr, _pool, _dir) = app().await;
        post_req("/charge", r#"{"then":"decline"}"#)
            .key("k-first")
            .send(addr)
            .await;
        other_requests_are_served(addr).await;
    }

    /// A savepoint of the handler's that SQLite's own rollback ended (its
    /// rollback fails): nothing recorded, and no connection is left unfit
    /// for other requests.
    #[tokio::test]
    async fn a_savepoint_sqlite_ended_leaves_no_connection_unfit() {
        let (addr, pool, _dir) = app().await;
        let first = post_req("/charge", r#"{"then":"savepoint"}"#)
            .key("k-savepoint")
            .send(addr)
            .await;
        outcome_unknown(&first);
        assert_eq!(count(&pool, "audit").await, 0);
        other_requests_are_served(addr).await;
    }

    /// A savepoint opened after SQLite ended the transaction opens another
    /// transaction, which must not pass for the handler's.
    #[tokio::test]
    async fn a_transaction_opened_after_sqlite_ended_the_handlers_does_not_pass_for_it() {
        let (addr, pool, _dir) = app().await;
        let first = post_req("/charge", r#"{"then":"after"}"#)
            .key("k-after")
            .send(addr)
            .await;
        outcome_unknown(&first);
        assert_eq!(count(&pool, "audit").await, 0);
        assert_eq!(
            record(&pool, "k-after").await,
            Some(("in_progress".to_owned(), None, 1))
        );
    }

    /// After transactions SQLite ended inside savepoints (one and two deep),
    /// the connection of a one-connection in-memory database (whose records
    /// live only as long as it does) serves on: nothing recorded is lost, and
    /// the application's own transactions on the pool commit.
    #[tokio::test]
    async fn a_one_connection_database_keeps_everything_after_savepoints_sqlite_ended() {
        let (addr, pool) = one_connection_app().await;
        for (key, then) in [("k-one", "savepoint"), ("k-two", "deeper")] {
            let lost = post_req("/charge", &format!(r#"{{"then":"{then}"}}"#))
                .key(key)
                .send(addr)
                .await;
            outcome_unknown(&lost);
            let next = post_req("/plain", "")
                .key(&format!("{key}-next"))
                .send(addr)
                .await;
            assert_eq!(
                next.status,
                201,
                "{then}: {:?}",
                String::from_utf8_lossy(&next.body)
            );
            let replay = post_req("/plain", "").key("k-paid").send(addr).await;
            assert_eq!(replay.header("idempotent-replayed"), Some("true"), "{then}");
            let mut deposit = pool.begin().await.unwrap();
            sqlx::query("INSERT INTO ledger (amount) VALUES (7)")
                .execute(&mut *deposit)
                .await
                .unwrap();
            deposit.commit().await.unwrap();
        }
        assert_eq!(post_req("/plain", "").key("k-last").send(addr).await.status, 201);
        assert_eq!(
            count(&pool, "ledger").await,
            2,
            "both deposits committed and kept"
        );
        assert_eq!(count(&pool, "audit").await, 0);
    }

    /// A handler's transaction whose commit fails, SQLite rolling it back
    /// by itself: the outcome is unknown to the client (503), nothing of it
    /// stays, and its connection (the only one of an in-memory database)
    /// goes back to the pool as sqlx counts it, outside any transaction:
    /// later requests are served, and the application's own transactions
    /// begin.
    #[tokio::test]
    async fn a_handler_transaction_whose_commit_fails_leaves_its_connection_fit() {
        let (addr, pool) = one_connection_app().await;
        let failed = post_req("/charge", r#"{"then":"commit_fails"}"#)
            .key("k-commit")
            .send(addr)
            .await;
        outcome_unknown(&failed);
        assert_eq!(count(&pool, "audit").await, 0, "the failed commit kept nothing");
        other_requests_are_served(addr).await;
        let replay = post_req("/plain", "").key("k-paid").send(addr).await;
        assert_eq!(replay.header("idempotent-replayed"), Some("true"));
        let mut deposit = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
        sqlx::query("INSERT INTO ledger (amount) VALUES (7)")
            .execute(&mut *deposit)
            .await
            .unwrap();
        deposit.commit().await.unwrap();
    }
}

/// A check of a lost transaction that does not answer within the store's
/// timeout: a statement the handler gave up on holds the connection,
/// waiting on another process's write lock. The connection is unwound in
/// the background and comes back fit.
mod sqlite_check_times_out {
    use super::*;
    use futures_util::FutureExt as _;
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
    use sqlx::Connection as _;
    use std::sync::Mutex;
    use tokio::sync::oneshot;

    type Gates = (oneshot::Sender<()>, oneshot::Receiver<()>);
    static GATES: Mutex<Option<Gates>> = Mutex::new(None);

    #[idempotent(scope = "charge.timed_out")]
    async fn charge(op: Operation) -> StatusCode {
        let mut conn = op.sqlite_transaction().await.unwrap();
        sqlx::query("INSERT INTO audit (note) VALUES ('attempted')")
            .execute(&mut *conn)
            .await
            .unwrap();
        let charged = sqlx::query("INSERT INTO charges (amount) VALUES (1000)")
            .execute(&mut *conn)
            .await;
        assert!(
            charged.is_err(),
            "the trigger refuses the charge (RAISE(ROLLBACK))"
        );
        let (lost, locked) = GATES.lock().unwrap().take().unwrap();
        lost.send(()).unwrap();
        // Another process now holds the write lock.
        locked.await.unwrap();
        // The handler gives up on a write at once (as with its own statement
        // timeout): the statement is queued on the connection and waits there
        // on the write lock.
        let pending = sqlx::query("INSERT INTO ledger (amount) VALUES (1000)").execute(&mut *conn);
        assert!(pending.now_or_never().is_none(), "waits on the write lock");
        StatusCode::CREATED
    }

    #[idempotent(scope = "plain.timed_out")]
    async fn plain() -> StatusCode {
        StatusCode::CREATED
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lost_transaction_whose_check_times_out_leaves_the_connection_fit() {
        let dir = tempfile::tempdir().unwrap();
        let options = SqliteConnectOptions::new()
            .filename(dir.path().join("idem.db"))
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(5));
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(options.clone())
            .await
            .unwrap();
        // The README's own example of a store timeout.
        let store = idem::SqliteStore::new(pool.clone()).with_timeout(Duration::from_secs(1));
        store.migrate().await.unwrap();
        sqlx::raw_sql(
            "CREATE TABLE audit (note TEXT NOT NULL); CREATE TABLE ledger (amount INTEGER NOT NULL); \
             CREATE TABLE charges (amount INTEGER NOT NULL); \
             CREATE TRIGGER funds BEFORE INSERT ON charges WHEN NEW.amount > 500 \
             BEGIN SELECT RAISE(ROLLBACK, 'insufficient funds'); END;",
        )
        .execute(&pool)
        .await
        .unwrap();
        let app = Router::new()
            .route("/charge", post(charge))
            .route("/plain", post(plain))
            .layer(Idem::new(store).single_tenant().layer());
        let addr = serve(app).await;

        let (lost_tx, lost_rx) = oneshot::channel();
        let (locked_tx, locked_rx) = oneshot::channel();
        *GATES.lock().unwrap() = Some((lost_tx, locked_rx));
        let first = tokio::spawn(async move { post_req("/charge", "").key("k-lost").send(addr).await });
        lost_rx.await.unwrap();
        // Another process takes the write lock (SQLite released the handler's).
        let mut other = sqlx::SqliteConnection::connect_with(&options).await.unwrap();
        sqlx::raw_sql("BEGIN IMMEDIATE")
            .execute(&mut other)
            .await
            .unwrap();
        locked_tx.send(()).unwrap();
        let first = first.await.unwrap();
        assert_eq!(first.status, 503, "{:?}", String::from_utf8_lossy(&first.body));
        // Whether SQLite had ended it was not known in time: the answer
        // does not say the writes were undone (the abandoned one commits).
        let detail = first.json()["detail"].as_str().unwrap().to_owned();
        assert!(detail.contains("could not be recorded"), "{detail}");
        // The other process is done: the connection's queue drains.
        sqlx::raw_sql("ROLLBACK").execute(&mut other).await.unwrap();
        // Wait (no timing) until the connection is back in the pool.
        {
            let conn = pool.acquire().await.unwrap();
            drop(conn);
        }
        let conn = pool.acquire().await.unwrap();
        let depth_counted = conn.is_in_transaction();
        drop(conn);
        for i in 0..3 {
            let r = post_req("/plain", "")
                .key(&format!("k-plain-{i}"))
                .send(addr)
                .await;
            assert_eq!(
                r.status,
                201,
                "request {i} after the lost transaction (sqlx counts the connection in a transaction: \
                 {depth_counted}): {:?}",
                String::from_utf8_lossy(&r.body)
            );
        }
        assert!(
            !depth_counted,
            "the pooled connection is counted inside a transaction"
        );
    }
}

// The edges of a refusal while a task holds the transaction's connection:
// a body slow to come but not fed by the task, one whose drop panics, one
// larger than the stored limit, a lease lost while it is read, a body that
// ends as the wait's deadline passes.

#[derive(serde::Deserialize, serde::Serialize)]
struct EdgeIn {
    /// `slow-held`: a task opens the transaction, writes a row, and lets the
    /// connection go as soon as the answer's body is first polled; the
    /// handler answers 422 with a body ("a", then "b" 3 s later) that the
    /// task does not feed. `slow-free`: the same body, no transaction.
    /// `drop-panic`: a task holds the connection until `go`; the handler
    /// answers 422 with a body that never ends and whose `Drop` panics.
    /// `fine`: 201 "fine", no transaction.
    then: String,
}

/// A body stream whose `Drop` panics (outside an unwinding).
struct PanicOnDrop<S>(S);
impl<S: futures_util::Stream + Unpin> futures_util::Stream for PanicOnDrop<S> {
    type Item = S::Item;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<S::Item>> {
        std::pin::Pin::new(&mut self.0).poll_next(cx)
    }
}
impl<S> Drop for PanicOnDrop<S> {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            panic!("the body's drop panics");
        }
    }
}

/// What [`EdgeIn`] says (and `long-held`, `edge-held`, `lost-read`,
/// `panic-held`, `body-panic-held`: see each test).
#[idempotent(scope = "effect.probe", fields(then))]
async fn edge_handler(
    State(h): State<Holder>,
    op: Operation,
    Json(input): Json<EdgeIn>,
) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    if input.then == "fine" {
        return (StatusCode::CREATED, "fine").into_response();
    }
    let held = input.then != "slow-free";
    let (polled_tx, polled_rx) = tokio::sync::oneshot::channel::<()>();
    let (line, lines) = tokio::sync::mpsc::channel::<Result<String, std::io::Error>>(1);
    let lost_read = input.then == "lost-read";
    if held {
        let (holding, is_held) = tokio::sync::oneshot::channel::<()>();
        let task_op = op.clone();
        let h2 = h.clone();
        let by_poll = ["slow-held", "long-held", "sse-held", "edge-held"].contains(&input.then.as_str());
        tokio::spawn(async move {
            let op = task_op;
            let mut conn = HeldTx::open(&op, &h2.db).await;
            conn.write(&h2.db, "probe").await;
            let _ = holding.send(());
            if lost_read {
                // Feeds one line, keeps the connection and the body
                // open until the lease is lost, then lets both go.
                let _ = line.send(Ok("x".to_owned())).await;
                op.lease_lost().await;
            } else if by_poll {
                let _ = polled_rx.await;
            } else {
                h2.go.acquire().await.unwrap().forget();
            }
            drop(conn);
            drop(line);
        });
        is_held.await.expect("the task opens the transaction");
    }
    if lost_read {
        let body = futures_util::stream::unfold(lines, |mut lines| async move {
            lines.recv().await.map(|line| (line, lines))
        });
        return (
            StatusCode::UNPROCESSABLE_ENTITY,
            axum::body::Body::from_stream(body),
        )
            .into_response();
    }
    if input.then == "panic-held" {
        std::panic::panic_any(DropPanics);
    }
    if input.then == "body-panic-held" {
        let body = futures_util::stream::once(async {
            std::panic::panic_any(DropPanics);
            #[allow(unreachable_code)]
            Ok::<_, std::io::Error>(String::new())
        });
        return (
            StatusCode::UNPROCESSABLE_ENTITY,
            axum::body::Body::from_stream(body),
        )
            .into_response();
    }
    if input.then == "drop-panic" {
        let body = PanicOnDrop(futures_util::stream::pending::<Result<String, std::io::Error>>());
        return (
            StatusCode::UNPROCESSABLE_ENTITY,
            axum::body::Body::from_stream(body),
        )
            .into_response();
    }
    if input.then == "edge-held" {
        // "a" at once (telling the holder to let go), then "b" and the end
        // one lock timeout (1 s) after the first read: as the read's
        // deadline passes.
        let body = futures_util::stream::unfold(
            (0u8, Some(polled_tx), None),
            |(step, mut polled, end)| async move {
                match step {
                    0 => {
                        let end = tokio::time::Instant::now() + Duration::from_secs(1);
                        if let Some(p) = polled.take() {
                            let _ = p.send(());
                        }
                        Some((Ok::<_, std::io::Error>("a".to_owned()), (1, None, Some(end))))
                    }
                    1 => {
                        tokio::time::sleep_until(end.unwrap()).await;
                        Some((Ok("b".to_owned()), (2, None, None)))
                    }
                    _ => None,
                }
            },
        );
        return (
            StatusCode::UNPROCESSABLE_ENTITY,
            axum::body::Body::from_stream(body),
        )
            .into_response();
    }
    if input.then == "long-held" {
        // "ab" (telling the holder to let go), "cdef" (past the 4-byte
        // limit), then "gh" 2 s later: not fed by the holder.
        let body = futures_util::stream::unfold((0u8, Some(polled_tx)), |(step, mut polled)| async move {
            match step {
                0 => {
                    if let Some(p) = polled.take() {
                        let _ = p.send(());
                    }
                    Some((Ok::<_, std::io::Error>("ab".to_owned()), (1, None)))
                }
                1 => Some((Ok("cdef".to_owned()), (2, None))),
                2 => {
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    Some((Ok("gh".to_owned()), (3, None)))
                }
                _ => None,
            }
        });
        return (
            StatusCode::UNPROCESSABLE_ENTITY,
            axum::body::Body::from_stream(body),
        )
            .into_response();
    }
    // "a" at once (telling the holder to let go), "b" 3 s later.
    let body = futures_util::stream::unfold((0u8, Some(polled_tx)), |(step, mut polled)| async move {
        match step {
            0 => {
                if let Some(p) = polled.take() {
                    let _ = p.send(());
                }
                Some((Ok::<_, std::io::Error>("a".to_owned()), (1, None)))
            }
            1 => {
                tokio::time::sleep(Duration::from_secs(3)).await;
                Some((Ok("b".to_owned()), (2, None)))
            }
            _ => None,
        }
    });
    let mut response = (
        StatusCode::UNPROCESSABLE_ENTITY,
        axum::body::Body::from_stream(body),
    )
        .into_response();
    if input.then == "sse-held" {
        let stream = axum::http::HeaderValue::from_static("text/event-stream");
        response
            .headers_mut()
            .insert(axum::http::header::CONTENT_TYPE, stream);
    }
    response
}

async fn edge_app(
    store: Arc<dyn IdempotencyStore>,
    db: &Db,
) -> (std::net::SocketAddr, Arc<tokio::sync::Semaphore>) {
    db.create_table().await;
    small_and_big_app(store, db, "/probe", post(edge_handler)).await
}

/// A refusal whose body the holder does NOT feed, and which the
/// holder lets go of as soon as the body is first read (long before the
/// lock timeout): the client should get the handler's 422, as it does
/// when no task holds the connection.
async fn unfed_slow_refusal_after_the_holder_let_go(Sql { store, db, _dir }: Sql) {
    let (addr, _) = edge_app(store, &db).await;
    let free = answered(post_req("/probe", r#"{"then":"slow-free"}"#).key("p-free"), addr).await;
    assert_eq!(
        (free.status, free.body.as_slice()),
        (422, b"ab".as_slice()),
        "control: {free:?}"
    );
    let held = answered(post_req("/probe", r#"{"then":"slow-held"}"#).key("p-held"), addr).await;
    let sse = answered(post_req("/probe", r#"{"then":"sse-held"}"#).key("p-sse"), addr).await;
    assert_eq!(db.count().await, 0, "rolled back");
    assert_eq!(
        (held.status, held.body.as_slice()),
        (422, b"ab".as_slice()),
        "held then let go: {held:?}"
    );
    assert_eq!(
        (sse.status, sse.body.as_slice()),
        (422, b"ab".as_slice()),
        "event stream, held then let go: {sse:?}"
    );
}

/// A refusal body whose Drop panics, dropped on the 503 path
/// (the read ran out of time while a task held the connection): once the
/// task lets go, the rejection should free the key (the corrected request
/// runs), and the client should have had 503.
async fn refusal_body_drop_panic_on_the_503_path(Sql { store, db, _dir }: Sql) {
    let (addr, go) = edge_app(store, &db).await;
    let first = answered(post_req("/probe", r#"{"then":"drop-panic"}"#).key("p-drop"), addr).await;
    not_completed(&first);
    go.add_permits(1);
    let corrected = once_let_go(addr, || post_req("/probe", r#"{"then":"fine"}"#).key("p-drop")).await;
    assert_eq!(db.count().await, 0, "rolled back");
    assert_eq!(
        (corrected.status, corrected.body.as_slice()),
        (201, b"fine".as_slice()),
        "corrected"
    );
}

mod held_connection_edges {
    use super::*;
    /// A refusal body larger than the limit (4 bytes), not fed by
    /// the holder, which lets go at the body's first read: the execution takes
    /// the transaction, lets the key go, and passes `head.chain(rest)` on
    /// whole; the key is free for a corrected request.
    async fn long_unfed_refusal_is_passed_on_whole(Sql { store, db, _dir }: Sql) {
        let (addr, _) = edge_app(store, &db).await;
        let held = answered(
            post_req("/probe-big", r#"{"then":"long-held"}"#).key("p-long"),
            addr,
        )
        .await;
        assert_eq!(
            (held.status, held.body.as_slice()),
            (422, b"abcdefgh".as_slice()),
            "{held:?}"
        );
        assert_eq!(db.count().await, 0, "rolled back");
        let corrected = answered(post_req("/probe-big", r#"{"then":"fine"}"#).key("p-long"), addr).await;
        assert_eq!(
            (corrected.status, corrected.body.as_slice()),
            (201, b"fine".as_slice()),
            "{corrected:?}"
        );
    }

    /// The lease is lost (its extension held past the deadline)
    /// while `keeping_held` reads a refusal body the holder feeds; the holder
    /// lets go once told. The client must get 503 lease-lost, nothing commits,
    /// and the key is let go.
    async fn lease_lost_while_keeping_held_reads(Sql { store, db, _dir }: Sql) {
        use idem_runtime::pause;
        let (addr, _) = edge_app(store, &db).await;
        let key = idem_testkit::unique("p-lost-read");
        let extension = pause::arm(pause::EXTEND_AFTER, &key);
        let first = answered(post_req("/probe", r#"{"then":"lost-read"}"#).key(&key), addr).await;
        drop(extension);
        assert_eq!(
            (first.status, first.problem()),
            (503, "idempotency-lease-lost".to_owned()),
            "{first:?}"
        );
        assert_eq!(db.count().await, 0, "rolled back");
        let corrected = once_let_go(addr, || post_req("/probe", r#"{"then":"fine"}"#).key(&key)).await;
        assert_eq!(
            (corrected.status, corrected.body.as_slice()),
            (201, b"fine".as_slice()),
            "{corrected:?}"
        );
    }

    /// A panic payload whose Drop panics (the handler's, or a
    /// refusal body's), while a task keeps the connection past the lock
    /// timeout: 503, and once the task lets go, the key is let go (the same
    /// request runs again).
    async fn drop_panicking_payload_on_the_503_path(Sql { store, db, _dir }: Sql) {
        let (addr, go) = edge_app(store, &db).await;
        for then in ["panic-held", "body-panic-held"] {
            let key = idem_testkit::unique("p-payload");
            let body = format!(r#"{{"then":"{then}"}}"#);
            let first = answered(post_req("/probe", &body).key(&key), addr).await;
            assert_eq!(
                (first.status, first.problem()),
                (503, "idempotency-store-unavailable".to_owned()),
                "{then}: {first:?}"
            );
            go.add_permits(2);
            if then == "panic-held" {
                // Released as failed: the same request runs again (and panics).
                let retry = once_let_go(addr, || post_req("/probe", &body).key(&key)).await;
                assert_eq!(retry.status, 500, "{then}: the retry ran: {retry:?}");
            } else {
                // A rejection: the key is free for a corrected request.
                let retry = once_let_go(addr, || post_req("/probe", r#"{"then":"fine"}"#).key(&key)).await;
                assert_eq!(retry.status, 201, "{then}: the corrected request ran: {retry:?}");
            }
            assert_eq!(db.count().await, 0, "{then}: nothing committed");
        }
    }

    /// A refusal body (not fed by the holder, which let go at its
    /// first read) that ends as the read's deadline passes: what comes of it,
    /// ten times.
    async fn body_ending_at_the_deadline(Sql { store, db, _dir }: Sql) {
        let (addr, _) = edge_app(store, &db).await;
        for _ in 0..3 {
            let key = idem_testkit::unique("p-edge");
            let r = answered(post_req("/probe", r#"{"then":"edge-held"}"#).key(&key), addr).await;
            assert_eq!((r.status, r.body.as_slice()), (422, b"ab".as_slice()), "{r:?}");
        }
        assert_eq!(db.count().await, 0);
    }

    idem_testkit::for_each_store! {
        stores: [sqlite, postgres],
        setup: |kind| sql(kind).await,
        worker_threads: 2,
        cases: [
            body_ending_at_the_deadline,
            drop_panicking_payload_on_the_503_path,
            lease_lost_while_keeping_held_reads,
            long_unfed_refusal_is_passed_on_whole,
            unfed_slow_refusal_after_the_holder_let_go,
            refusal_body_drop_panic_on_the_503_path,
        ],
    }
}

/// A server with `route` at `path`, answers stored whole, and at
/// `{path}-big`, where no body is stored (the limit is 4 bytes); a lock
/// timeout of 1 second, on a table already made; and the handle that lets
/// `hold` tasks go.
async fn small_and_big_app(
    store: Arc<dyn IdempotencyStore>,
    db: &Db,
    path: &str,
    route: axum::routing::MethodRouter<Holder>,
) -> (std::net::SocketAddr, Arc<tokio::sync::Semaphore>) {
    let h = Holder {
        db: db.clone(),
        go: Arc::new(tokio::sync::Semaphore::new(0)),
    };
    let idem = Idem::from_arc(store)
        .single_tenant()
        .lock_timeout(Duration::from_secs(1))
        .unwrap();
    let go = h.go.clone();
    let app = Router::new()
        .route(path, route.clone())
        .layer(idem.clone().layer())
        .merge(
            Router::new()
                .route(&format!("{path}-big"), route)
                .layer(idem.max_stored_body(4).unwrap().layer()),
        )
        .with_state(h);
    (serve(app).await, go)
}

/// A server with `route` alone at `path` (a lock timeout of 1 second), on a
/// table already made, and the handle that lets `hold` tasks go.
async fn one_route_app(
    store: Arc<dyn IdempotencyStore>,
    db: &Db,
    path: &str,
    route: axum::routing::MethodRouter<Holder>,
) -> (std::net::SocketAddr, Arc<tokio::sync::Semaphore>) {
    let h = Holder {
        db: db.clone(),
        go: Arc::new(tokio::sync::Semaphore::new(0)),
    };
    let idem = Idem::from_arc(store)
        .single_tenant()
        .lock_timeout(Duration::from_secs(1))
        .unwrap();
    let go = h.go.clone();
    let app = Router::new().route(path, route).layer(idem.layer()).with_state(h);
    (serve(app).await, go)
}

/// Refusal bodies that end, fail or never pause while a task holds the
/// handler's connection: the answer is the one the free path gives.
mod held_refusal_bodies {
    use super::*;
    use axum::response::IntoResponse as _;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// `err-*`: a 422 body "a", then an error. `end-drop-*`: a 422 body "a",
    /// then its end; its drop panics. `spin-*`: a 422 body of empty chunks,
    /// always ready, until the holder lets go. With `-held`, a task holds the
    /// handler's connection (a write in its transaction) until the body is
    /// polled past "a" (`spin`: until the test lets it go).
    #[idempotent(scope = "effect.refusal", fields(then))]
    async fn refusal(
        State(h): State<Holder>,
        op: Operation,
        Json(input): Json<EdgeIn>,
    ) -> axum::response::Response {
        if input.then == "fine" {
            return (StatusCode::CREATED, "fine").into_response();
        }
        let held = input.then.ends_with("-held");
        let spin = input.then.starts_with("spin");
        let (polled_tx, polled_rx) = tokio::sync::oneshot::channel::<()>();
        let let_go = Arc::new(AtomicBool::new(false));
        if held {
            let (holding, is_held) = tokio::sync::oneshot::channel::<()>();
            let (h, let_go) = (h.clone(), let_go.clone());
            tokio::spawn(async move {
                let mut conn = HeldTx::open(&op, &h.db).await;
                conn.write(&h.db, "refusal").await;
                let _ = holding.send(());
                if spin {
                    h.go.acquire().await.unwrap().forget();
                } else {
                    let _ = polled_rx.await;
                }
                drop(conn);
                let_go.store(true, Ordering::SeqCst);
            });
            is_held.await.expect("the task opens the transaction");
        }
        if spin {
            let body = futures_util::stream::poll_fn(move |_| {
                std::task::Poll::Ready(
                    (!let_go.load(Ordering::SeqCst))
                        .then(|| Ok::<_, std::io::Error>(axum::body::Bytes::new())),
                )
            });
            return (
                StatusCode::UNPROCESSABLE_ENTITY,
                axum::body::Body::from_stream(body),
            )
                .into_response();
        }
        let fails = input.then.starts_with("err");
        let body =
            futures_util::stream::unfold((0u8, Some(polled_tx)), move |(step, mut polled)| async move {
                match step {
                    0 => Some((Ok::<_, std::io::Error>("a".to_owned()), (1, polled))),
                    1 => {
                        // Pending a while after "a" (the server sends what it has),
                        // the same on both paths; then the holder lets go.
                        tokio::time::sleep(Duration::from_millis(300)).await;
                        if let Some(p) = polled.take() {
                            let _ = p.send(());
                        }
                        fails.then(|| (Err(std::io::Error::other("the body fails")), (2, None)))
                    }
                    _ => None,
                }
            });
        let body = if fails {
            axum::body::Body::from_stream(body)
        } else {
            axum::body::Body::from_stream(PanicOnDrop(Box::pin(body)))
        };
        (StatusCode::UNPROCESSABLE_ENTITY, body).into_response()
    }

    async fn app(
        store: Arc<dyn IdempotencyStore>,
        db: &Db,
    ) -> (std::net::SocketAddr, Arc<tokio::sync::Semaphore>) {
        db.create_table().await;
        one_route_app(store, db, "/refusal", post(refusal)).await
    }

    fn refuse(then: &str, key: &str) -> idem_testkit::http::Request {
        post_req("/refusal", &format!(r#"{{"then":"{then}"}}"#)).key(key)
    }

    /// The raw answer (status line, headers, chunks), as the client read it.
    async fn raw(addr: std::net::SocketAddr, request: idem_testkit::http::Request) -> String {
        let raw = tokio::time::timeout(Duration::from_secs(20), request.send_raw(addr))
            .await
            .expect("answered");
        String::from_utf8_lossy(&raw).into_owned()
    }

    /// A refusal body that yields "a" and then fails, while a task holds the
    /// connection: what was read ("a") is sent before the failure cuts the
    /// answer, as on the free path.
    async fn a_failing_refusal_body_keeps_its_head(Sql { store, db, _dir }: Sql) {
        let (addr, _) = app(store, &db).await;
        for then in ["err-free", "err-held"] {
            let answer = raw(addr, refuse(then, &idem_testkit::unique(then))).await;
            assert!(answer.starts_with("HTTP/1.1 422"), "{then}: {answer}");
            assert!(
                answer.contains("\r\n\r\n1\r\na\r\n"),
                "{then}: the head 'a' is sent: {answer}"
            );
            assert!(
                !answer.ends_with("0\r\n\r\n"),
                "{then}: the failure cuts the answer: {answer}"
            );
        }
        assert_eq!(db.count().await, 0, "rolled back");
    }

    /// A refusal body "a" that ends, whose drop panics, while a task holds
    /// the connection: the client gets the handler's 422, and the key is
    /// let go as on the free path.
    async fn an_ended_refusal_body_whose_drop_panics(Sql { store, db, _dir }: Sql) {
        let (addr, _) = app(store, &db).await;
        let mut afterwards = Vec::new();
        for then in ["end-drop-free", "end-drop-held"] {
            let key = idem_testkit::unique(then);
            let answer = raw(addr, refuse(then, &key)).await;
            assert!(
                answer.starts_with("HTTP/1.1 422"),
                "{then}: the handler's 422: {answer}"
            );
            let next = once_let_go(addr, || refuse("fine", &key)).await;
            afterwards.push((next.status, next.header("idempotent-replayed").map(str::to_owned)));
        }
        assert_eq!(
            afterwards[0], afterwards[1],
            "the key is let go as on the free path"
        );
        assert_eq!(db.count().await, 0, "rolled back");
    }

    /// A refusal body of empty chunks, always ready, while a task holds the
    /// connection: the client gets 503 within about one lock timeout (1 s),
    /// and the key is free once the task lets go (a rejection's is).
    async fn always_ready_empty_chunks_do_not_hold_off_the_deadline(Sql { store, db, _dir }: Sql) {
        let (addr, go) = app(store, &db).await;
        let key = idem_testkit::unique("spin");
        let first = tokio::time::timeout(Duration::from_secs(6), refuse("spin-held", &key).send(addr)).await;
        // Whatever came, the holder lets go (the spinning body then ends).
        go.add_permits(1);
        let first = first.expect("answered within one lock timeout and some");
        not_completed(&first);
        let next = once_let_go(addr, || refuse("fine", &key)).await;
        assert_eq!((next.status, next.body.as_slice()), (201, b"fine".as_slice()));
        assert_eq!(db.count().await, 0, "rolled back");
    }

    idem_testkit::for_each_store! {
        stores: [sqlite, postgres],
        setup: |kind| sql(kind).await,
        worker_threads: 2,
        cases: [
            a_failing_refusal_body_keeps_its_head,
            an_ended_refusal_body_whose_drop_panics,
            always_ready_empty_chunks_do_not_hold_off_the_deadline,
        ],
    }
}

/// Refusal bodies whose feeder lets go only once the body is dropped, and
/// bodies always ready on a current-thread runtime.
mod held_feeders {
    use super::*;
    use axum::response::IntoResponse as _;
    use futures_util::StreamExt as _;
    use std::sync::atomic::Ordering;

    #[derive(serde::Deserialize, serde::Serialize)]
    struct FeedIn {
        /// `take-two`: a task opens the transaction and feeds four lines,
        /// writing a row before each, into a channel of capacity 1, until
        /// the body is gone (its send fails); then it lets the connection
        /// go. The body is the first two lines (`take(2)`): it ends on its
        /// own, within a few milliseconds, far under `max_stored_body`.
        /// `spin`: a task holds the connection until `go`; the body yields
        /// empty chunks, always ready, for 6 s of wall clock, then ends.
        /// `fail-two`: as `take-two`, its second line an error. `hold`: a
        /// task holds the connection until `go`; the body is empty.
        /// `fine`: 201 "fine".
        then: String,
        status: u16,
    }

    #[idempotent(scope = "effect.feeders", fields(then, status))]
    async fn feeder(
        State(h): State<Holder>,
        op: Operation,
        Json(input): Json<FeedIn>,
    ) -> axum::response::Response {
        let status = StatusCode::from_u16(input.status).unwrap();
        RUNS.lock().unwrap().push((op.key().to_owned(), op.attempt()));
        let op_key = format!("{}#{}", op.key(), op.attempt());
        if input.then == "fine" {
            return (status, "fine").into_response();
        }
        if input.then == "twice" {
            // The transaction asked for again while its connection is in
            // hand (a helper given `&op`): refused within a lock timeout.
            let mut conn = HeldTx::open(&op, &h.db).await;
            conn.write(&h.db, "twice").await;
            let again = match &h.db {
                Db::Pg(..) => op.pg_transaction().await.map(drop),
                Db::Sqlite(_) => op.sqlite_transaction().await.map(drop),
            };
            drop(conn);
            return match again {
                Ok(()) => (StatusCode::CREATED, "the same one".to_owned()).into_response(),
                Err(e) => (StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response(),
            };
        }
        let spin = input.then == "spin";
        let fail_two = input.then == "fail-two";
        let hold = input.then == "hold";
        let (line, lines) = tokio::sync::mpsc::channel::<Result<String, std::io::Error>>(1);
        let (holding, is_held) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            let mut conn = HeldTx::open(&op, &h.db).await;
            let _ = holding.send(());
            let rows: &[&str] = if spin || hold {
                &["spin"]
            } else {
                &["one", "two", "three", "four"]
            };
            for row in rows {
                conn.write(&h.db, row).await;
                let item = if fail_two && *row == "two" {
                    Err(std::io::Error::other("the feeder reports a failure"))
                } else {
                    Ok(format!("{row}\n"))
                };
                if !spin && !hold && line.send(item).await.is_err() {
                    // The body is gone: nothing more to feed.
                    break;
                }
            }
            if spin || hold {
                h.go.acquire().await.unwrap().forget();
            }
            drop(conn);
            drop(line);
        });
        is_held.await.expect("the task opens the transaction");
        if spin {
            let until = std::time::Instant::now() + Duration::from_secs(6);
            let key = op_key;
            let body = futures_util::stream::poll_fn(move |_| {
                let spinning = std::time::Instant::now() < until;
                SPIN.lock()
                    .unwrap()
                    .insert(key.clone(), if spinning { 1 } else { 2 });
                std::task::Poll::Ready(spinning.then(|| Ok::<_, std::io::Error>(axum::body::Bytes::new())))
            });
            return (status, axum::body::Body::from_stream(body)).into_response();
        }
        let body = futures_util::stream::unfold(lines, |mut lines| async move {
            lines.recv().await.map(|line| (line, lines))
        })
        .take(2);
        (status, axum::body::Body::from_stream(body)).into_response()
    }

    /// Per key: 1 while a `spin` body is ready, 2 once it ended.
    static SPIN: std::sync::LazyLock<std::sync::Mutex<std::collections::HashMap<String, u8>>> =
        std::sync::LazyLock::new(Default::default);
    fn spin_state(key: &str) -> u8 {
        SPIN.lock().unwrap().get(key).copied().unwrap_or(0)
    }

    /// Every execution of `feeder`: its key and attempt.
    static RUNS: std::sync::Mutex<Vec<(String, u32)>> = std::sync::Mutex::new(Vec::new());

    async fn app(
        store: Arc<dyn IdempotencyStore>,
        db: &Db,
    ) -> (std::net::SocketAddr, Arc<tokio::sync::Semaphore>) {
        db.create_table().await;
        app_on(store, db).await
    }

    async fn app_on(
        store: Arc<dyn IdempotencyStore>,
        db: &Db,
    ) -> (std::net::SocketAddr, Arc<tokio::sync::Semaphore>) {
        one_route_app(store, db, "/feed", post(feeder)).await
    }

    fn req(then: &str, status: u16, key: &str) -> idem_testkit::http::Request {
        post_req("/feed", &format!(r#"{{"then":"{then}","status":{status}}}"#)).key(key)
    }

    /// The body (two lines, 8 bytes) ends at once, long before the lock
    /// timeout; its feeder lets the connection go when the body is dropped
    /// (its next send fails), as on the success path (`collect` drops the
    /// ended body, then the transaction is taken). A refusal's body is
    /// dropped once it ended, too: the client gets the handler's 422 (and
    /// 500) with "one\ntwo\n", not 503 after a lock timeout.
    async fn an_ended_refusal_body_is_dropped_so_its_feeder_lets_go(Sql { store, db, _dir }: Sql) {
        let (addr, _) = app(store, &db).await;
        let ok = answered(req("take-two", 201, &idem_testkit::unique("feed-ok")), addr).await;
        assert_eq!(
            (ok.status, ok.body.as_slice()),
            (201, b"one\ntwo\n".as_slice()),
            "control: {ok:?}"
        );
        let committed = db.count().await;
        let mut got = Vec::new();
        for status in [422u16, 500] {
            let key = idem_testkit::unique("feed-refuse");
            let started = std::time::Instant::now();
            let r = answered(req("take-two", status, &key), addr).await;
            got.push((
                status,
                r.status,
                String::from_utf8_lossy(&r.body).into_owned(),
                started.elapsed(),
            ));
        }
        // Whatever came: once the feeder lets go, nothing it wrote commits.
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(db.count().await, committed, "refusals rolled back");
        for (asked, status, body, took) in &got {
            assert_eq!(
                (*status, body.as_str()),
                (*asked, "one\ntwo\n"),
                "the handler's {asked} with its ended body; got {status} {body:?} after {took:?}"
            );
        }
    }

    /// The same with a body that fails at its second line (the feeder sends
    /// an error, then goes on feeding until the body is gone): the failed
    /// body is dropped at once, as hyper drops it on the free path; the
    /// client gets the handler's 422, its head "one", then the cut.
    async fn a_failed_refusal_body_is_dropped_so_its_feeder_lets_go(Sql { store, db, _dir }: Sql) {
        let (addr, _) = app(store, &db).await;
        let key = idem_testkit::unique("feed-fail");
        let started = std::time::Instant::now();
        let raw = tokio::time::timeout(Duration::from_secs(20), req("fail-two", 422, &key).send_raw(addr))
            .await
            .expect("answered");
        let took = started.elapsed();
        let raw = String::from_utf8_lossy(&raw).into_owned();
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(db.count().await, 0, "rolled back");
        assert!(
            raw.starts_with("HTTP/1.1 422") && raw.contains("\r\n\r\n4\r\none\n\r\n"),
            "the handler's 422 with its head; got after {took:?}: {raw}"
        );
    }

    /// The client goes away after the handler returned, while a
    /// task holds the connection (the body pending until it lets go). The
    /// execution runs in its own task: once the task lets go, the rejection
    /// is recorded and the key freed for a corrected request.
    async fn a_client_gone_while_keeping_held_waits(Sql { store, db, _dir }: Sql) {
        use idem_runtime::pause;
        let (addr, go) = app(store, &db).await;
        let key = idem_testkit::unique("feed-gone");
        let mut returned = pause::arm(pause::HANDLER_RETURNED, &key);
        let mut rejected = pause::arm(pause::REJECT_AFTER, &key);
        let client = {
            let key = key.clone();
            tokio::spawn(async move { req("hold", 422, &key).send_raw(addr).await })
        };
        returned.reached().await;
        client.abort();
        let _ = client.await;
        returned.resume();
        go.add_permits(1);
        tokio::time::timeout(Duration::from_secs(10), rejected.reached())
            .await
            .expect("the rejection is recorded with the client gone");
        rejected.resume();
        let next = answered(req("fine", 201, &key), addr).await;
        assert_eq!(
            (next.status, next.body.as_slice()),
            (201, b"fine".as_slice()),
            "{next:?}"
        );
        assert_eq!(db.count().await, 0, "rolled back");
    }

    /// The handler asks for its transaction again while it holds the first
    /// call's connection: the second call waits one lock timeout (1 s) at
    /// most, then fails (no hang with the key held); what the handler
    /// wrote is rolled back with its 503. (On SQLite the open transaction
    /// holds the write lock the lease's extension needs: waiting a lock
    /// timeout, the lease is lost first, and the 503 says so.)
    async fn the_transaction_asked_for_twice_is_refused_in_time(Sql { store, db, _dir }: Sql) {
        let (addr, _) = app(store, &db).await;
        let r = answered(req("twice", 201, &idem_testkit::unique("twice")), addr).await;
        assert_eq!(r.status, 503, "{r:?}");
        if let Db::Pg(..) = db {
            assert!(
                String::from_utf8_lossy(&r.body).contains("stayed in use"),
                "{r:?}"
            );
        }
        assert_eq!(db.count().await, 0, "rolled back");
    }

    idem_testkit::for_each_store! {
        stores: [sqlite, postgres],
        setup: |kind| sql(kind).await,
        worker_threads: 2,
        cases: [
            the_transaction_asked_for_twice_is_refused_in_time,
            a_client_gone_while_keeping_held_waits,
            an_ended_refusal_body_is_dropped_so_its_feeder_lets_go,
            a_failed_refusal_body_is_dropped_so_its_feeder_lets_go,
        ],
    }

    /// A refusal body always ready (empty chunks for 6 s) while a task
    /// holds the connection, on a current-thread runtime: the wait gives
    /// the runtime its turn, so the deadline fires and the client gets 503
    /// within about one lock timeout (1 s), not when the body stops.
    fn always_ready_body_on_a_current_thread_runtime(kind: idem_testkit::StoreKind) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let Some(Sql { store, db, _dir }) = sql(kind).await else {
                return;
            };
            let (addr, go) = app(store, &db).await;
            let key = idem_testkit::unique("feed-spin");
            let started = std::time::Instant::now();
            let first = answered(req("spin", 422, &key), addr).await;
            let took = started.elapsed();
            go.add_permits(1);
            let next = once_let_go(addr, || req("fine", 201, &key)).await;
            assert_eq!(next.status, 201);
            assert_eq!(db.count().await, 0, "rolled back");
            not_completed(&first);
            assert!(
                took < Duration::from_millis(3000),
                "503 within one lock timeout (1 s) and some; came after {took:?}"
            );
        });
    }

    /// A body always ready (empty chunks for 6 s, lock timeout 1 s) on a
    /// current-thread runtime, while its execution reads it: a refusal's
    /// while a task holds the connection, and a success's (`collect`). The
    /// lease's extensions run on that runtime, which the read gives its
    /// turn: a second server on the same database, asking again and again
    /// meanwhile, gets 409 and never takes the living execution over (the
    /// handler runs once).
    fn an_always_ready_body_keeps_its_lease(status: u16) {
        let Some(url) = idem_testkit::pg_url() else { return };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let Some(Sql { store, db, _dir }) = sql(idem_testkit::StoreKind::Postgres).await else { return };
            let Db::Pg(_, schema) = &db else { unreachable!() };
            let (addr, go) = app(store, &db).await;
            let key = idem_testkit::unique("feed-take");
            let (start, started) = std::sync::mpsc::channel::<()>();
            let first_done = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let other = {
                let (url, schema, db, key) = (url.clone(), schema.clone(), db.clone(), key.clone());
                let first_done = first_done.clone();
                std::thread::spawn(move || {
                    let rt = tokio::runtime::Builder::new_multi_thread()
                        .worker_threads(2)
                        .enable_all()
                        .build()
                        .unwrap();
                    rt.block_on(async move {
                        let store = idem_testkit::pg_store_in(&url, &schema, 10).await;
                        let (addr2, go2) = app_on(Arc::new(store), &db).await;
                        started.recv().unwrap();
                        // Once the first execution's body spins: the same
                        // request, again and again, until one is not 409 or
                        // the first request was answered.
                        let first = format!("{key}#1");
                        while spin_state(&first) == 0 {
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                        let last = loop {
                            let r = answered(req("spin", status, &key), addr2).await;
                            if r.status != 409 || first_done.load(Ordering::SeqCst) {
                                break (r.status, first_done.load(Ordering::SeqCst));
                            }
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        };
                        go2.add_permits(1);
                        last
                    })
                })
            };
            start.send(()).unwrap();
            let first = answered(req("spin", status, &key), addr).await;
            first_done.store(true, Ordering::SeqCst);
            // Awaited without blocking this runtime (its heartbeats run on it).
            let second = tokio::task::spawn_blocking(move || other.join().unwrap()).await.unwrap();
            go.add_permits(1);
            let runs: Vec<u32> = RUNS
                .lock()
                .unwrap()
                .iter()
                .filter(|(k, _)| *k == key)
                .map(|(_, a)| *a)
                .collect();
            // The second server asked until the first request was answered,
            // and got 409 all along (its last ask, as the first was answered:
            // 409, or a success's replay).
            assert!(
                runs == [1] && second.1 && (second.0 == 409 || second.0 == 201 && status == 201),
                "first answered {} {:?}; the second server's same request got {} (the first answered by then: {}); the handler ran with attempts {runs:?}",
                first.status,
                first.problem(),
                second.0,
                second.1
            );
        });
    }

    #[test]
    fn an_always_ready_refusal_body_keeps_its_lease() {
        an_always_ready_body_keeps_its_lease(422)
    }

    #[test]
    fn an_always_ready_success_body_keeps_its_lease() {
        an_always_ready_body_keeps_its_lease(201)
    }

    #[test]
    fn always_ready_body_on_a_current_thread_runtime_postgres() {
        always_ready_body_on_a_current_thread_runtime(idem_testkit::StoreKind::Postgres)
    }

    #[test]
    fn always_ready_body_on_a_current_thread_runtime_sqlite() {
        always_ready_body_on_a_current_thread_runtime(idem_testkit::StoreKind::Sqlite)
    }
}

/// Review 9 probes.
/// Answers whose body's drop, or whose panic's payload, panics, on the
/// paths where the answer is not given or the connection is held; and an
/// event stream fed by the holder once the lease is lost.
mod bodies_that_panic_when_dropped {
    use super::*;
    use axum::response::IntoResponse as _;

    /// A stream whose `Drop` panics with a payload whose own drop panics.
    struct PayloadDropPanics<S>(S);
    impl<S: futures_util::Stream + Unpin> futures_util::Stream for PayloadDropPanics<S> {
        type Item = S::Item;
        fn poll_next(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<S::Item>> {
            std::pin::Pin::new(&mut self.0).poll_next(cx)
        }
    }
    impl<S> Drop for PayloadDropPanics<S> {
        fn drop(&mut self) {
            if !std::thread::panicking() {
                std::panic::panic_any(DropPanics);
            }
        }
    }

    #[idempotent(scope = "effect.drops", fields(then))]
    async fn dropper(
        State(h): State<Holder>,
        op: Operation,
        Json(input): Json<EdgeIn>,
    ) -> axum::response::Response {
        let then = input.then.as_str();
        if then == "fine" {
            return (StatusCode::CREATED, "fine").into_response();
        }
        if then.starts_with("lost-drop") {
            // Free path (no transaction): once told the lease is lost, a
            // body "x" that ends, and whose drop panics.
            op.lease_lost().await;
            let body = PanicOnDrop(futures_util::stream::iter([Ok::<_, std::io::Error>(
                "x".to_owned(),
            )]));
            let status = if then == "lost-drop-201" {
                StatusCode::CREATED
            } else {
                StatusCode::UNPROCESSABLE_ENTITY
            };
            return (status, axum::body::Body::from_stream(body)).into_response();
        }
        if then == "held-success-body-panic" {
            // A task holds the connection until `go`; the success's body
            // panics with a payload whose drop panics.
            let (holding, is_held) = tokio::sync::oneshot::channel::<()>();
            let h2 = h.clone();
            let task_op = op.clone();
            tokio::spawn(async move {
                let op = task_op;
                let mut conn = HeldTx::open(&op, &h2.db).await;
                conn.write(&h2.db, "r9").await;
                let _ = holding.send(());
                h2.go.acquire().await.unwrap().forget();
                drop(conn);
            });
            is_held.await.unwrap();
            let body = futures_util::stream::once(async {
                std::panic::panic_any(DropPanics);
                #[allow(unreachable_code)]
                Ok::<_, std::io::Error>(String::new())
            });
            return (StatusCode::CREATED, axum::body::Body::from_stream(body)).into_response();
        }
        if then == "big-drop-payload" {
            // Over the 4-byte limit, ends whole; its drop panics with a
            // payload whose drop panics.
            let body = PayloadDropPanics(futures_util::stream::iter([
                Ok::<_, std::io::Error>("abcd".to_owned()),
                Ok("efgh".to_owned()),
            ]));
            return (StatusCode::CREATED, axum::body::Body::from_stream(body)).into_response();
        }
        if then == "sse-lost-feed" {
            // A task opens the transaction, writes, and feeds events until
            // the body is gone; the handler answers 200 text/event-stream
            // once told its lease is lost.
            let (line, lines) = tokio::sync::mpsc::channel::<Result<String, std::io::Error>>(1);
            let (holding, is_held) = tokio::sync::oneshot::channel::<()>();
            let h2 = h.clone();
            let task_op = op.clone();
            tokio::spawn(async move {
                let op = task_op;
                let mut conn = HeldTx::open(&op, &h2.db).await;
                conn.write(&h2.db, "sse").await;
                let _ = holding.send(());
                loop {
                    if line.send(Ok("data: x\n\n".to_owned())).await.is_err() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                drop(conn);
            });
            is_held.await.unwrap();
            op.lease_lost().await;
            let body = futures_util::stream::unfold(lines, |mut lines| async move {
                lines.recv().await.map(|line| (line, lines))
            });
            let mut r = (StatusCode::OK, axum::body::Body::from_stream(body)).into_response();
            r.headers_mut().insert(
                axum::http::header::CONTENT_TYPE,
                axum::http::HeaderValue::from_static("text/event-stream"),
            );
            return r;
        }
        unreachable!("{then}")
    }

    async fn app(
        store: Arc<dyn IdempotencyStore>,
        db: &Db,
    ) -> (std::net::SocketAddr, Arc<tokio::sync::Semaphore>) {
        db.create_table().await;
        small_and_big_app(store, db, "/p", post(dropper)).await
    }

    fn req(path: &str, then: &str, key: &str) -> idem_testkit::http::Request {
        post_req(path, &format!(r#"{{"then":"{then}"}}"#)).key(key)
    }

    /// Free path: the lease lost (extension held past its deadline), the
    /// handler answers once told, with a body that ends and whose drop
    /// panics. The answer is not given, and its drop is caught: 503
    /// lease-lost for a success and for a refusal (422) alike.
    async fn a_lost_answer_whose_body_panics_when_dropped(Sql { store, db, _dir }: Sql) {
        use idem_runtime::pause;
        let (addr, _) = app(store, &db).await;
        let mut got = Vec::new();
        for then in ["lost-drop-201", "lost-drop-422"] {
            let key = idem_testkit::unique(then);
            let extension = pause::arm(pause::EXTEND_AFTER, &key);
            let r = answered(req("/p", then, &key), addr).await;
            drop(extension);
            got.push((then, r.status, r.problem()));
        }
        for (then, status, problem) in &got {
            assert_eq!(
                (*status, problem.as_str()),
                (503, "idempotency-lease-lost"),
                "{then}: all: {got:?}"
            );
        }
    }

    /// A success's body panics (payload whose drop panics) while a task
    /// keeps the connection past the lock timeout: as for a refusal's body
    /// (drop_panicking_payload_on_the_503_path), the client should get 503
    /// store-unavailable, the payload dropped once the key is let go.
    async fn a_held_success_whose_body_panics(Sql { store, db, _dir }: Sql) {
        let (addr, go) = app(store, &db).await;
        let key = idem_testkit::unique("held-body-panic");
        let first = answered(req("/p", "held-success-body-panic", &key), addr).await;
        go.add_permits(3);
        // The key is let go all the same: the same request runs again
        // (its task lets go at once; its body panics again: 500).
        let retry = once_let_go(addr, || req("/p", "held-success-body-panic", &key)).await;
        assert_eq!(
            (first.status, first.problem(), retry.status, db.count().await),
            (503, "idempotency-store-unavailable".to_owned(), 500, 0),
            "{first:?}"
        );
    }

    /// A success over the stored limit whose body ends whole and whose drop
    /// panics (a payload whose drop panics): the answer is recorded, and
    /// the client gets the whole body (the payload is dropped last).
    async fn a_streamed_body_whose_drop_panics_is_sent_whole(Sql { store, db, _dir }: Sql) {
        let (addr, _) = app(store, &db).await;
        let key = idem_testkit::unique("big-drop");
        let raw = tokio::time::timeout(
            Duration::from_secs(20),
            req("/p-big", "big-drop-payload", &key).send_raw(addr),
        )
        .await
        .expect("answered");
        let raw = String::from_utf8_lossy(&raw).into_owned();
        assert!(
            raw.starts_with("HTTP/1.1 201") && raw.ends_with("0\r\n\r\n") && raw.contains("efgh"),
            "the whole body: {raw:?}"
        );
        let replay = answered(req("/p-big", "big-drop-payload", &key), addr).await;
        assert_eq!(
            (replay.status, replay.header("idempotent-replayed")),
            (201, Some("true")),
            "recorded: {replay:?}"
        );
    }

    /// An event stream fed by the transaction's holder until it is gone,
    /// answered once the lease is lost: 503 lease-lost at once, nothing
    /// commits.
    async fn a_lost_event_stream_fed_by_the_holder(Sql { store, db, _dir }: Sql) {
        use idem_runtime::pause;
        let (addr, _) = app(store, &db).await;
        let key = idem_testkit::unique("sse-lost");
        let extension = pause::arm(pause::EXTEND_AFTER, &key);
        let started = std::time::Instant::now();
        let r = answered(req("/p", "sse-lost-feed", &key), addr).await;
        let took = started.elapsed();
        drop(extension);
        assert_eq!(
            (r.status, r.problem(), db.count().await),
            (503, "idempotency-lease-lost".to_owned(), 0),
            "after {took:?}: {r:?}"
        );
    }

    idem_testkit::for_each_store! {
        stores: [sqlite, postgres],
        setup: |kind| sql(kind).await,
        worker_threads: 2,
        cases: [
            a_lost_event_stream_fed_by_the_holder,
            a_lost_answer_whose_body_panics_when_dropped,
            a_held_success_whose_body_panics,
            a_streamed_body_whose_drop_panics_is_sent_whole,
        ],
    }
}

/// Review 10 probes: user code dropped by idem outside its catches.
/// Answers not given (the lease lost while the execution waits for the
/// connection; a refusal held past the lock timeout) whose body or whose
/// response extension panics when dropped: dropped caught, the 503 stands.
mod answers_not_given {
    use super::*;
    use axum::response::IntoResponse as _;

    /// A response extension whose drop panics.
    #[derive(Clone)]
    struct ExtPanicsOnDrop;
    impl Drop for ExtPanicsOnDrop {
        fn drop(&mut self) {
            if !std::thread::panicking() {
                panic!("the response extension's drop panics");
            }
        }
    }

    fn event_stream(body: axum::body::Body) -> axum::response::Response {
        let mut r = (StatusCode::OK, body).into_response();
        r.headers_mut().insert(
            axum::http::header::CONTENT_TYPE,
            axum::http::HeaderValue::from_static("text/event-stream"),
        );
        r
    }

    /// `*-held-*`: a task holds the transaction until `go`, the handler
    /// answers 422 at once. Otherwise a task holds it until the lease is
    /// lost (the test holds the extension back), and the handler answers at
    /// once, so that the loss comes while the execution waits for the
    /// connection. `-control`: nothing panics when dropped.
    #[idempotent(scope = "effect.not_given", fields(then))]
    async fn not_given(
        State(h): State<Holder>,
        op: Operation,
        Json(input): Json<EdgeIn>,
    ) -> axum::response::Response {
        let then = input.then.as_str();
        if then == "fine" {
            return (StatusCode::CREATED, "fine").into_response();
        }
        let held = then.starts_with("ext-held");
        let (holding, is_held) = tokio::sync::oneshot::channel::<()>();
        let (h2, task_op) = (h.clone(), op.clone());
        tokio::spawn(async move {
            let op = task_op;
            let mut conn = HeldTx::open(&op, &h2.db).await;
            conn.write(&h2.db, "not-given").await;
            let _ = holding.send(());
            if held {
                h2.go.acquire().await.unwrap().forget();
                drop(conn);
            } else {
                op.lease_lost().await;
                drop(conn);
                // Tells the test it let go.
                h2.go.add_permits(1);
            }
        });
        is_held.await.unwrap();
        let items = || futures_util::stream::iter([Ok::<_, std::io::Error>("data: x\n\n".to_owned())]);
        let mut r = match then {
            "ext-held" | "ext-held-control" => (StatusCode::UNPROCESSABLE_ENTITY, "no").into_response(),
            "sse-lost" => event_stream(axum::body::Body::from_stream(PanicOnDrop(items()))),
            "sse-lost-control" => event_stream(axum::body::Body::from_stream(items())),
            "ext-lost" | "ext-lost-control" => (StatusCode::CREATED, "x").into_response(),
            _ => unreachable!("{then}"),
        };
        if then.starts_with("ext") && !then.ends_with("-control") {
            r.extensions_mut().insert(ExtPanicsOnDrop);
        }
        r
    }

    async fn app(
        store: Arc<dyn IdempotencyStore>,
        db: &Db,
    ) -> (std::net::SocketAddr, Arc<tokio::sync::Semaphore>) {
        db.create_table().await;
        one_route_app(store, db, "/not-given", post(not_given)).await
    }

    fn req(then: &str, key: &str) -> idem_testkit::http::Request {
        post_req("/not-given", &format!(r#"{{"then":"{then}"}}"#)).key(key)
    }

    /// The lease lost while a task holds the connection (the execution
    /// held right after the handler returned until the task, told of the
    /// loss, has let go): the completion is refused (503 lease-lost), and
    /// the answer not given (an event stream whose body panics when
    /// dropped; a 201 whose extension does) is dropped caught: 503
    /// lease-lost as for the control. (Left to run, the execution's wait
    /// for the connection and the lease's deadline ended milliseconds
    /// apart, and on a loaded machine the wait's own 503 came first.)
    async fn an_answer_not_given_on_a_lost_lease(Sql { store, db, _dir }: Sql) {
        use idem_runtime::pause;
        let (addr, let_go) = app(store, &db).await;
        for then in ["sse-lost-control", "sse-lost", "ext-lost-control", "ext-lost"] {
            let key = idem_testkit::unique(then);
            // PostgreSQL's extension is held once it is written, so that
            // the lease runs out; on SQLite the task's transaction keeps
            // it from writing.
            let extension = pause::arm(pause::EXTEND_AFTER, &key);
            let mut returned = pause::arm(pause::HANDLER_RETURNED, &key);
            let answer = tokio::spawn(answered(req(then, &key), addr));
            returned.reached().await;
            let_go.acquire().await.unwrap().forget();
            returned.resume();
            let r = answer.await.unwrap();
            drop(extension);
            assert_eq!(
                (r.status, r.problem()),
                (503, "idempotency-lease-lost".to_owned()),
                "{then}: {r:?}"
            );
        }
        assert_eq!(db.count().await, 0, "rolled back");
    }

    /// A refusal (422) while a task keeps the connection past the lock
    /// timeout, its response carrying an extension whose drop panics: 503
    /// store-unavailable as for the control, and the key let go once the
    /// task lets go.
    async fn a_held_refusal_whose_extension_panics_when_dropped(Sql { store, db, _dir }: Sql) {
        let (addr, go) = app(store, &db).await;
        for then in ["ext-held-control", "ext-held"] {
            let key = idem_testkit::unique(then);
            let r = answered(req(then, &key), addr).await;
            go.add_permits(1);
            not_completed(&r);
            let next = once_let_go(addr, || req("fine", &key)).await;
            assert_eq!(next.status, 201, "{then}: {next:?}");
        }
        assert_eq!(db.count().await, 0, "rolled back");
    }

    idem_testkit::for_each_store! {
        stores: [sqlite, postgres],
        setup: |kind| sql(kind).await,
        worker_threads: 2,
        cases: [
            an_answer_not_given_on_a_lost_lease,
            a_held_refusal_whose_extension_panics_when_dropped,
        ],
    }
}

/// The handler's arguments, made by its extractors before idem decides,
/// are dropped unrun on a replay, a 409 and a refused key: a drop that
/// panics (the user's code) is caught, and the answer stays what it is.
mod unrun_arguments {
    use super::*;

    /// An extractor whose drop panics when the request says `x-trip: 1`
    /// (a header outside the fingerprint).
    struct Tripwire(bool);
    impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Tripwire {
        type Rejection = std::convert::Infallible;
        async fn from_request_parts(
            parts: &mut axum::http::request::Parts,
            _: &S,
        ) -> Result<Self, Self::Rejection> {
            Ok(Tripwire(parts.headers.contains_key("x-trip")))
        }
    }
    impl Drop for Tripwire {
        fn drop(&mut self) {
            if self.0 && !std::thread::panicking() {
                panic!("the extractor's drop panics");
            }
        }
    }

    /// Its body uses the argument, so that it is the handler's (an unused
    /// one stays in the generated wrapper, dropped when it returns).
    #[idempotent(scope = "effect.unrun", fields(then))]
    async fn tripped(trip: Tripwire, Json(_input): Json<EdgeIn>) -> StatusCode {
        let _used = trip;
        StatusCode::CREATED
    }

    async fn app(store: Arc<dyn IdempotencyStore>) -> std::net::SocketAddr {
        let idem = Idem::from_arc(store).single_tenant();
        serve(Router::new().route("/trip", post(tripped)).layer(idem.layer())).await
    }

    fn req() -> idem_testkit::http::Request {
        post_req("/trip", r#"{"then":"fine"}"#)
    }

    async fn a_replay_a_409_and_a_missing_key_drop_the_arguments_caught(Sql { store, db: _, _dir }: Sql) {
        use idem_runtime::pause;
        let addr = app(store).await;
        let key = idem_testkit::unique("unrun");
        // The first execution holds the key after its handler returned.
        let mut paused = pause::arm(pause::HANDLER_RETURNED, &key);
        let first = {
            let key = key.clone();
            tokio::spawn(async move { answered(req().key(&key), addr).await })
        };
        paused.reached().await;
        let in_progress = answered(req().key(&key).header("x-trip", "1"), addr).await;
        paused.resume();
        assert_eq!(first.await.unwrap().status, 201);
        assert_eq!(
            (in_progress.status, in_progress.problem()),
            (409, "idempotency-request-in-progress".to_owned()),
            "{in_progress:?}"
        );
        let replay = answered(req().key(&key).header("x-trip", "1"), addr).await;
        assert_eq!(
            (replay.status, replay.header("idempotent-replayed")),
            (201, Some("true")),
            "{replay:?}"
        );
        let keyless = answered(req().header("x-trip", "1"), addr).await;
        assert_eq!(
            (keyless.status, keyless.problem()),
            (400, "idempotency-key-missing".to_owned()),
            "{keyless:?}"
        );
    }

    idem_testkit::for_each_store! {
        stores: [sqlite, postgres],
        setup: |kind| sql(kind).await,
        worker_threads: 2,
        cases: [a_replay_a_409_and_a_missing_key_drop_the_arguments_caught],
    }
}

/// A completion in the handler's transaction and its commit share one
/// store timeout (contract section 10), not one each: a commit due once
/// it has passed is not sent. The handler's writes roll back, the key is
/// given back, the client gets a 503, and its retry runs the operation
/// once.
mod the_completion_and_its_commit_share_one_timeout {
    use super::*;
    use idem_runtime::pause;

    const TIMEOUT: Duration = Duration::from_secs(1);

    async fn a_commit_due_past_the_timeout_is_not_sent(Sql { store, db, _dir }: Sql) {
        let addr = harness(store, db.clone()).await;
        let key = idem_testkit::unique("k-tx-deadline");
        let mut paused = pause::arm(pause::TX_BEFORE_COMMIT, &key);
        let request = || post_req("/effects", r#"{"then":"ok"}"#).key(&key);
        let first = {
            let request = request();
            tokio::spawn(async move { request.send(addr).await })
        };
        paused.reached().await;
        // The completion is written; the store's timeout, counted from
        // its start, passes before the commit (a deadline, not an
        // ordering).
        tokio::time::sleep(TIMEOUT + Duration::from_millis(100)).await;
        paused.resume();
        let first = first.await.unwrap();
        assert_eq!(first.status, 503, "{first:?}");
        assert_eq!(first.problem(), "idempotency-store-unavailable");
        let detail = first.json()["detail"].as_str().unwrap().to_owned();
        assert!(detail.contains("rolled back"), "{detail}");
        assert_eq!(db.count().await, 0, "nothing committed");

        let retry = request().send(addr).await;
        assert_eq!(retry.status, 201, "{retry:?}");
        assert_eq!(retry.header("idempotent-replayed"), None);
        assert_eq!(db.count().await, 1);
        let replay = request().send(addr).await;
        assert_eq!(
            (replay.header("idempotent-replayed"), &replay.body),
            (Some("true"), &retry.body)
        );
    }

    idem_testkit::for_each_store! {
        stores: [sqlite, postgres],
        setup: |kind| sql_within(kind, Some(TIMEOUT)).await,
        worker_threads: 2,
        cases: [a_commit_due_past_the_timeout_is_not_sent],
    }
}

/// PostgreSQL: a commit that was sent, then outlived the store timeout
/// (a deferred constraint trigger waits on an advisory lock the test
/// holds), lands after the client got its 503 "could not be recorded".
/// A retry while it waits gets a 409; once it lands, the retry replays
/// the answer; the handler ran once.
mod a_commit_that_lands_past_the_timeout {
    use super::*;
    use idem_runtime::pause;
    use sqlx::Connection as _;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const TIMEOUT: Duration = Duration::from_secs(1);
    static RUNS: AtomicUsize = AtomicUsize::new(0);

    #[idempotent(scope = "gated.create")]
    async fn gated(State(schema): State<String>, op: Operation) -> Result<(StatusCode, String), StatusCode> {
        RUNS.fetch_add(1, Ordering::SeqCst);
        let mut conn = op
            .pg_transaction()
            .await
            .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO \"{schema}\".gated (id) VALUES ($1)"
        )))
        .bind(op.derived_key("gated"))
        .execute(&mut *conn)
        .await
        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
        Ok((StatusCode::CREATED, "made".to_owned()))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_is_replayed_once_it_lands() {
        let Some(url) = idem_testkit::pg_url() else { return };
        let schema = idem_testkit::pg_schema(&url).await;
        let store = idem_testkit::pg_store_in(&url, &schema, 10)
            .await
            .with_timeout(TIMEOUT);
        let pool = store.pool().clone();
        let gate: i64 = 0x1de_0000 + i64::from(std::process::id() % 10_000);
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE \"{schema}\".gated (id TEXT PRIMARY KEY); \
             CREATE FUNCTION \"{schema}\".gate() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN PERFORM pg_advisory_xact_lock_shared({gate}); RETURN NULL; END $$; \
             CREATE CONSTRAINT TRIGGER gate AFTER INSERT ON \"{schema}\".gated \
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION \"{schema}\".gate()"
        )))
        .execute(&pool)
        .await
        .unwrap();
        let app = Router::new()
            .route("/gated", post(gated))
            .layer(Idem::new(store).single_tenant().layer())
            .with_state(schema.clone());
        let addr = serve(app).await;
        let landed = || {
            let (pool, schema) = (pool.clone(), schema.clone());
            async move {
                let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                    "SELECT count(*) FROM \"{schema}\".gated"
                )))
                .fetch_one(&pool)
                .await
                .unwrap();
                n
            }
        };

        // The gate, held by a connection of the test's own.
        let mut holder = sqlx::PgConnection::connect(&url).await.unwrap();
        sqlx::query("SELECT pg_advisory_lock($1)")
            .bind(gate)
            .execute(&mut holder)
            .await
            .unwrap();
        let key = idem_testkit::unique("k-late-commit");
        let request = || post_req("/gated", "").key(&key);
        let mut paused = pause::arm(pause::TX_BEFORE_COMMIT, &key);
        let first = {
            let request = request();
            tokio::spawn(async move { request.send(addr).await })
        };
        paused.reached().await;
        paused.resume();
        // The commit is sent, waits at the gate, and the timeout cuts it.
        let first = first.await.unwrap();
        assert_eq!(first.status, 503, "{first:?}");
        let detail = first.json()["detail"].as_str().unwrap().to_owned();
        assert!(detail.contains("could not be recorded"), "{detail}");
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE wait_event_type = 'Lock' AND query ILIKE 'commit%' AND datname = current_database()",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(waiting, 1, "the commit waits at the gate");
        assert_eq!(landed().await, 0);

        let during = request().send(addr).await;
        assert_eq!(during.status, 409, "{during:?}");

        sqlx::query("SELECT pg_advisory_unlock($1)")
            .bind(gate)
            .execute(&mut holder)
            .await
            .unwrap();
        // Until the commit has landed (a condition, polled).
        tokio::time::timeout(Duration::from_secs(10), async {
            while landed().await == 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("the commit lands once the gate opens");
        let after = request().send(addr).await;
        assert_eq!(
            (
                after.status,
                after.header("idempotent-replayed"),
                after.body.as_slice()
            ),
            (201, Some("true"), &b"made"[..]),
            "{after:?}"
        );
        assert_eq!(RUNS.load(Ordering::SeqCst), 1, "the handler ran once");
        assert_eq!(landed().await, 1);
    }

    static SIDE_RUNS: AtomicUsize = AtomicUsize::new(0);

    /// Writes its row into `side`, an attached database in SQLite's
    /// rollback-journal mode, whose lock a test connection can hold.
    #[idempotent(scope = "side.create")]
    async fn side(op: Operation) -> Result<(StatusCode, String), StatusCode> {
        SIDE_RUNS.fetch_add(1, Ordering::SeqCst);
        let mut conn = op
            .sqlite_transaction()
            .await
            .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
        sqlx::query("INSERT INTO side.t (id) VALUES (?1)")
            .bind(op.derived_key("side"))
            .execute(&mut *conn)
            .await
            .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
        Ok((StatusCode::CREATED, "made".to_owned()))
    }

    /// The same on SQLite, on a pool of one connection: the COMMIT waits
    /// in SQLite's busy handler for a read a test connection holds on the
    /// attached database, the timeout cuts the wait, and the COMMIT lands
    /// once the read ends. Afterwards the connection is as sqlx counts it:
    /// a transaction the application drops on it is rolled back, and a
    /// new operation's completion commits. (A COMMIT cut in flight used to
    /// leave sqlx's worker set to skip the next rollback-on-drop: the
    /// application's next dropped transaction stayed open, and every
    /// completion written in it was lost, so its operation ran again.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite_is_replayed_once_it_lands_and_its_connection_stays_sound() {
        use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
        use sqlx::Executor as _;
        let dir = tempfile::tempdir().unwrap();
        let (main_db, side_db) = (dir.path().join("main.db"), dir.path().join("side.db"));
        let side_file = SqliteConnectOptions::new().filename(&side_db);
        let mut c = sqlx::SqliteConnection::connect_with(&side_file.clone().create_if_missing(true))
            .await
            .unwrap();
        c.execute("CREATE TABLE t (id TEXT PRIMARY KEY)").await.unwrap();
        c.close().await.unwrap();
        let attach = format!("ATTACH DATABASE '{}' AS side", side_db.display());
        let main_file = SqliteConnectOptions::new()
            .filename(&main_db)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(30));
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .after_connect(move |conn, _| {
                let attach = attach.clone();
                Box::pin(async move { conn.execute(sqlx::AssertSqlSafe(attach)).await.map(drop) })
            })
            .connect_with(main_file.clone())
            .await
            .unwrap();
        let store = idem::SqliteStore::new(pool.clone()).with_timeout(TIMEOUT);
        store.migrate().await.unwrap();
        let app = Router::new()
            .route("/side", post(side))
            .layer(Idem::new(store).single_tenant().layer());
        let addr = serve(app).await;

        let key = idem_testkit::unique("k-late-commit");
        let request = || post_req("/side", "").key(&key);
        let mut paused = pause::arm(pause::TX_BEFORE_COMMIT, &key);
        let first = {
            let request = request();
            tokio::spawn(async move { request.send(addr).await })
        };
        paused.reached().await;
        // The completion is written, the commit not yet sent: a read on
        // the side database, which the COMMIT must write, holds it.
        let mut reader = sqlx::SqliteConnection::connect_with(&side_file).await.unwrap();
        reader.execute("BEGIN").await.unwrap();
        let _: i64 = sqlx::query_scalar("SELECT count(*) FROM t")
            .fetch_one(&mut reader)
            .await
            .unwrap();
        paused.resume();
        let first = first.await.unwrap();
        assert_eq!(first.status, 503, "{first:?}");
        let detail = first.json()["detail"].as_str().unwrap().to_owned();
        assert!(detail.contains("could not be recorded"), "{detail}");
        reader.execute("COMMIT").await.unwrap();
        // Until the answer is replayed (a condition, polled).
        let replay = tokio::time::timeout(Duration::from_secs(20), async {
            loop {
                let r = request().send(addr).await;
                if r.status != 409 {
                    break r;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("the commit lands once the read ends");
        assert_eq!(
            (
                replay.status,
                replay.header("idempotent-replayed"),
                replay.body.as_slice()
            ),
            (201, Some("true"), &b"made"[..]),
            "{replay:?}"
        );
        assert_eq!(SIDE_RUNS.load(Ordering::SeqCst), 1, "the handler ran once");

        // The application's own transaction on the pool's one connection,
        // dropped: rolled back.
        assert!(idem_testkit::dropped_transaction_rolls_back(&pool).await);
        // A new operation's answer and effect commit: another connection
        // sees both.
        let next = idem_testkit::unique("k-next");
        let answer = post_req("/side", "").key(&next).send(addr).await;
        assert_eq!(answer.status, 201, "{answer:?}");
        let mut other = sqlx::SqliteConnection::connect_with(&main_file).await.unwrap();
        let state: String = sqlx::query_scalar("SELECT state FROM idempotency_keys WHERE key = ?1")
            .bind(&next)
            .fetch_one(&mut other)
            .await
            .unwrap();
        assert_eq!(state, "completed");
        assert_eq!(SIDE_RUNS.load(Ordering::SeqCst), 2);
    }
}

/// A PostgreSQL handler transaction whose own begin, or a nested begin of
/// the handler's, is cut between its statement and the answer. sqlx counts
/// a level only once its answer came, and a cut begin asks the rollback of
/// the level it counted before: none for idem's `BEGIN` (the connection
/// stays inside a transaction nobody ends), the enclosing transaction for a
/// nested `SAVEPOINT` (the handler's transaction ends, and what it writes
/// after commits on its own).
mod pg_begins_cut {
    use super::*;
    use futures_util::FutureExt as _;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Mutex;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::sync::{oneshot, watch};

    /// A TCP proxy to PostgreSQL that, once armed, holds back the server's
    /// answers from the next simple query that begins with `BEGIN` on, until
    /// let go.
    struct Proxy {
        armed: AtomicBool,
        held: watch::Sender<bool>,
    }

    async fn proxy(upstream: std::net::SocketAddr) -> (std::net::SocketAddr, Arc<Proxy>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let p = Arc::new(Proxy {
            armed: AtomicBool::new(false),
            held: watch::channel(false).0,
        });
        let shared = p.clone();
        tokio::spawn(async move {
            loop {
                let (client, _) = listener.accept().await.unwrap();
                let server = tokio::net::TcpStream::connect(upstream).await.unwrap();
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                let up = shared.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 65536];
                    loop {
                        let n = match cr.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        // A simple query (`Q`, its length) that begins with `BEGIN`.
                        let begins = buf[..n]
                            .windows(10)
                            .any(|w| w[0] == b'Q' && w[1] == 0 && &w[5..] == b"BEGIN");
                        if begins && up.armed.swap(false, Ordering::SeqCst) {
                            up.held.send_replace(true);
                        }
                        if sw.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
                let down = shared.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 65536];
                    let mut held = down.held.subscribe();
                    loop {
                        let n = match sr.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        let _ = held.wait_for(|h| !*h).await;
                        if cw.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (addr, p)
    }

    /// A server of `routes` on a store in a schema of its own (a pool of
    /// `connections`), with its effects table; its schema's name.
    pub(super) async fn served(
        url: &str,
        connections: u32,
        routes: Router<Db>,
    ) -> (std::net::SocketAddr, Db, String) {
        served_within(url, connections, Duration::from_secs(10), routes).await
    }

    /// [`served`], with the store's bound on each operation.
    async fn served_within(
        url: &str,
        connections: u32,
        timeout: Duration,
        routes: Router<Db>,
    ) -> (std::net::SocketAddr, Db, String) {
        let schema = idem_testkit::pg_schema(url).await;
        let store = idem_testkit::pg_store_in(url, &schema, connections)
            .await
            .with_timeout(timeout);
        let db = Db::Pg(store.pool().clone(), schema.clone());
        db.create_table().await;
        let app = routes
            .layer(Idem::new(store).single_tenant().layer())
            .with_state(db.clone());
        (serve(app).await, db, schema)
    }

    /// A pool of one connection to the database at `url`, through a
    /// [`proxy`] of its own.
    async fn proxied_pool(url: &str) -> (sqlx::PgPool, Arc<Proxy>) {
        let direct: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
        let upstream = tokio::net::lookup_host((direct.get_host().to_owned(), direct.get_port()))
            .await
            .unwrap()
            .next()
            .unwrap();
        let (proxied, p) = proxy(upstream).await;
        let via_proxy = direct
            .host("127.0.0.1")
            .port(proxied.port())
            .ssl_mode(sqlx::postgres::PgSslMode::Disable);
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect_with(via_proxy)
            .await
            .unwrap();
        (pool, p)
    }

    static BEGIN_FAILED: Mutex<Option<oneshot::Sender<String>>> = Mutex::new(None);
    static PAID: AtomicUsize = AtomicUsize::new(0);

    #[idempotent(scope = "begin_cut.tx")]
    async fn tx_open(op: Operation) -> StatusCode {
        match op.pg_transaction().await {
            Ok(_) => StatusCode::CREATED,
            Err(e) => {
                if let Some(tx) = BEGIN_FAILED.lock().unwrap().take() {
                    let _ = tx.send(e.to_string());
                }
                StatusCode::SERVICE_UNAVAILABLE
            }
        }
    }

    #[idempotent(scope = "begin_cut.pay")]
    async fn pay() -> StatusCode {
        PAID.fetch_add(1, Ordering::SeqCst);
        StatusCode::CREATED
    }

    #[idempotent(scope = "begin_cut.plain")]
    async fn plain() -> StatusCode {
        StatusCode::CREATED
    }

    fn begin_app(store: idem::PgStore) -> Router {
        Router::new()
            .route("/tx", post(tx_open))
            .route("/pay", post(pay))
            .layer(Idem::new(store).single_tenant().layer())
    }

    /// idem's `BEGIN` answered past the store's timeout, on a pool of one
    /// connection: the next operation on that connection is recorded (seen
    /// from another connection) and replayed by another server, never run
    /// twice.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_handlers_begin_answered_past_the_timeout_leaves_no_transaction_open() {
        let Some(url) = idem_testkit::pg_url() else { return };
        let schema = idem_testkit::pg_schema(&url).await;
        let (pool, p) = proxied_pool(&url).await;
        let store = idem::PgStore::new(pool.clone())
            .with_table(Some(&schema), "idempotency_keys")
            .unwrap()
            .with_timeout(Duration::from_secs(1));
        store.migrate().await.unwrap();
        let a = serve(begin_app(store)).await;

        let (failed_tx, failed_rx) = oneshot::channel();
        *BEGIN_FAILED.lock().unwrap() = Some(failed_tx);
        p.armed.store(true, Ordering::SeqCst);
        let first = tokio::spawn(async move { post_req("/tx", "").key("k-tx").send(a).await });
        let why = failed_rx.await.unwrap();
        assert!(why.contains("no answer within"), "{why}");
        // Its answer let through only once the begin was given up on.
        p.held.send_replace(false);
        assert_eq!(first.await.unwrap().status, 503);

        let paid = post_req("/pay", "").key("k-pay").send(a).await;
        assert_eq!(paid.status, 201);
        let check = sqlx::PgPool::connect(&url).await.unwrap();
        let seen: Option<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT state FROM \"{schema}\".idempotency_keys WHERE key = 'k-pay'"
        )))
        .fetch_optional(&check)
        .await
        .unwrap();
        assert_eq!(
            seen.as_deref(),
            Some("completed"),
            "told 201, its record not committed"
        );

        // That server's process ends; another, on the same table, replays.
        pool.close().await;
        let b = serve(begin_app(idem_testkit::pg_store_in(&url, &schema, 5).await)).await;
        let again = post_req("/pay", "").key("k-pay").send(b).await;
        assert_eq!(again.status, 201);
        assert_eq!(again.header("idempotent-replayed"), Some("true"));
        assert_eq!(
            PAID.load(Ordering::SeqCst),
            1,
            "the handler ran twice for one key"
        );
    }

    /// `migrate()` given up on while its `BEGIN` waits for its answer (a
    /// timeout of the caller's at start-up), on a pool of one connection:
    /// the store's next reservation on that connection commits.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_migration_given_up_on_during_its_begin_leaves_no_transaction_open() {
        let Some(url) = idem_testkit::pg_url() else { return };
        let schema = idem_testkit::pg_schema(&url).await;
        let (pool, p) = proxied_pool(&url).await;
        let store = idem::PgStore::new(pool.clone())
            .with_table(Some(&schema), "idempotency_keys")
            .unwrap();
        store.migrate().await.unwrap();
        p.armed.store(true, Ordering::SeqCst);
        let mut migrating = Box::pin(store.migrate());
        // Given up on once its BEGIN is held (polled until then).
        while !*p.held.borrow() {
            assert!(migrating.as_mut().now_or_never().is_none(), "the migration ended");
            tokio::task::yield_now().await;
        }
        drop(migrating);
        p.held.send_replace(false);
        let id = RecordId::new("t", "migrate.cut", "k");
        let reserved = store
            .reserve(ReserveRequest {
                id: &id,
                fingerprint: "f",
                token: "tok",
                ttl: Duration::from_secs(3600),
                lock_timeout: Duration::from_secs(60),
            })
            .await
            .unwrap();
        assert!(matches!(reserved, Reservation::Reserved(_)), "{reserved:?}");
        let check = sqlx::PgPool::connect(&url).await.unwrap();
        let seen: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM \"{schema}\".idempotency_keys WHERE key = 'k'"
        )))
        .fetch_one(&check)
        .await
        .unwrap();
        assert_eq!(
            seen, 1,
            "the reservation on the pool's connection never committed"
        );
    }

    type Gate = (oneshot::Sender<()>, oneshot::Receiver<()>);
    static NESTED_GATE: Mutex<Option<Gate>> = Mutex::new(None);

    /// A connection of the test's whose open transaction holds the row
    /// `blocked` of the effects table: a handler's insert of it waits.
    async fn holding_blocked(url: &str, db: &Db) -> sqlx::PgConnection {
        use sqlx::Connection as _;
        let mut blocker = sqlx::PgConnection::connect(url).await.unwrap();
        sqlx::query("BEGIN").execute(&mut blocker).await.unwrap();
        insert(&mut blocker, &db.effects(), "blocked").await.unwrap();
        blocker
    }

    pub(super) async fn insert(
        conn: &mut sqlx::PgConnection,
        table: &str,
        id: &str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {table} (id, note) VALUES ($1, 'x')"
        )))
        .bind(id)
        .execute(conn)
        .await
        .map(drop)
    }

    /// Writes, gives up on a nested begin queued behind a statement it
    /// gave up on too (a row the test holds), then writes again and
    /// answers 201.
    #[idempotent(scope = "begin_cut.nested")]
    async fn nested(State(db): State<Db>, op: Operation) -> StatusCode {
        use sqlx::Connection as _;
        let table = db.effects();
        let mut conn = op.pg_transaction().await.unwrap();
        insert(&mut conn, &table, "before").await.unwrap();
        let pending = insert(&mut conn, &table, "blocked").now_or_never().is_none();
        assert!(pending, "the insert waits on the test's row");
        let gave_up = tokio::time::timeout(Duration::ZERO, conn.begin()).await.is_err();
        assert!(gave_up, "the nested begin was given up on");
        let (at_cut, go) = NESTED_GATE.lock().unwrap().take().unwrap();
        at_cut.send(()).unwrap();
        go.await.unwrap();
        insert(&mut conn, &table, "after").await.unwrap();
        StatusCode::CREATED
    }

    /// The handler's transaction ended under it by sqlx: its 201 is not
    /// given nor recorded (503, released as failed), and the test's check
    /// sees exactly what committed: the write made after the end.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_nested_begin_given_up_on_is_not_answered_as_recorded() {
        let Some(url) = idem_testkit::pg_url() else { return };
        let routes = Router::new()
            .route("/nested", post(nested))
            .route("/plain", post(plain));
        let (addr, db, schema) = served(&url, 5, routes).await;
        let mut blocker = holding_blocked(&url, &db).await;
        let (at_cut_tx, at_cut_rx) = oneshot::channel();
        let (go_tx, go_rx) = oneshot::channel();
        *NESTED_GATE.lock().unwrap() = Some((at_cut_tx, go_rx));
        let first = tokio::spawn(async move { post_req("/nested", "").key("k-nested").send(addr).await });
        at_cut_rx.await.unwrap();
        sqlx::query("ROLLBACK").execute(&mut blocker).await.unwrap();
        go_tx.send(()).unwrap();
        let first = first.await.unwrap();
        assert_eq!(first.status, 503, "{}", String::from_utf8_lossy(&first.body));
        let Db::Pg(pool, _) = &db else { unreachable!() };
        let rows: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT id FROM {} ORDER BY id",
            db.effects()
        )))
        .fetch_all(pool)
        .await
        .unwrap();
        assert_eq!(rows, vec!["after"]);
        let record: (String, Option<String>) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT state, lock_token FROM \"{schema}\".idempotency_keys WHERE key = 'k-nested'"
        )))
        .fetch_one(pool)
        .await
        .unwrap();
        assert_ne!(
            record.0, "completed",
            "a 201 recorded without the handler's transaction"
        );
        assert_eq!(record.1, None, "the key was given back");
        // The store's connections serve the next operations.
        for i in 0..10 {
            let r = post_req("/plain", "")
                .key(&format!("k-after-{i}"))
                .send(addr)
                .await;
            assert_eq!(r.status, 201);
        }
    }

    /// Leaves a nested transaction of its own open (forgotten: neither
    /// committed nor dropped) after a write, and answers 201.
    #[idempotent(scope = "begin_cut.leaked")]
    async fn leaked(State(db): State<Db>, op: Operation) -> StatusCode {
        leave_open(&db, &op).await;
        StatusCode::CREATED
    }

    async fn leave_open(db: &Db, op: &Operation) {
        use sqlx::Connection as _;
        let table = db.effects();
        let mut conn = op.pg_transaction().await.unwrap();
        insert(&mut conn, &table, "outer").await.unwrap();
        let mut inner = conn.begin().await.unwrap();
        insert(&mut inner, &table, "inner").await.unwrap();
        std::mem::forget(inner);
    }

    /// A nested transaction left open: what it holds is the handler's
    /// transaction's, and commits with the answer; the pool's one
    /// connection serves the next operations outside any transaction.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_nested_transaction_left_open_commits_with_the_answer() {
        let Some(url) = idem_testkit::pg_url() else { return };
        let routes = Router::new()
            .route("/leaked", post(leaked))
            .route("/plain", post(plain));
        let (addr, db, schema) = served(&url, 1, routes).await;
        let first = post_req("/leaked", "").key("k-leaked").send(addr).await;
        assert_eq!(first.status, 201, "{}", String::from_utf8_lossy(&first.body));
        for i in 0..5 {
            let r = post_req("/plain", "")
                .key(&format!("k-next-{i}"))
                .send(addr)
                .await;
            assert_eq!(r.status, 201);
        }
        let check = sqlx::PgPool::connect(&url).await.unwrap();
        assert_eq!(db.count().await, 2, "the handler's writes did not commit");
        let completed: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM \"{schema}\".idempotency_keys WHERE key LIKE 'k-next-%' AND state = 'completed'"
        )))
        .fetch_one(&check)
        .await
        .unwrap();
        assert_eq!(completed, 5, "the next operations' records were not committed");
        let state: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT state FROM \"{schema}\".idempotency_keys WHERE key = 'k-leaked'"
        )))
        .fetch_one(&check)
        .await
        .unwrap();
        assert_eq!(state, "completed");
    }

    /// Leaves a nested transaction open after a write as `leaked` does,
    /// and answers 500: released as failed.
    #[idempotent(scope = "begin_cut.leaked_failing")]
    async fn leaked_failing(State(db): State<Db>, op: Operation) -> StatusCode {
        leave_open(&db, &op).await;
        StatusCode::INTERNAL_SERVER_ERROR
    }

    /// Writes, then fails a statement inside a nested transaction it leaves
    /// open, and answers 201: nothing of it can commit.
    #[idempotent(scope = "begin_cut.failed_in_leaked")]
    async fn failed_in_leaked(State(db): State<Db>, op: Operation) -> StatusCode {
        use sqlx::Connection as _;
        let table = db.effects();
        let mut conn = op.pg_transaction().await.unwrap();
        insert(&mut conn, &table, "outer").await.unwrap();
        let mut inner = conn.begin().await.unwrap();
        assert!(
            insert(&mut inner, &table, "outer").await.is_err(),
            "a duplicate key"
        );
        std::mem::forget(inner);
        StatusCode::CREATED
    }

    static GIVEN_UP_PID: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

    /// Leaves a nested transaction open after a write, then gives up on a
    /// statement that waits on a row the test holds, and answers 500.
    #[idempotent(scope = "begin_cut.given_up_in_leaked")]
    async fn given_up_in_leaked(State(db): State<Db>, op: Operation) -> StatusCode {
        leave_open(&db, &op).await;
        let mut conn = op.pg_transaction().await.unwrap();
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        GIVEN_UP_PID.store(pid, Ordering::SeqCst);
        let pending = insert(&mut conn, &db.effects(), "blocked")
            .now_or_never()
            .is_none();
        assert!(pending, "the insert waits on the test's row");
        StatusCode::INTERNAL_SERVER_ERROR
    }

    /// The same, when a statement the handler gave up on fails after the
    /// answer (cancelled here, as a `lock_timeout` or a deadlock would end
    /// it): its failure, read before idem's `ROLLBACK` is sent, does not
    /// stand for that `ROLLBACK`'s answer. The whole transaction is rolled
    /// back, and the pool's connections are fit for what follows.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_nested_transaction_left_open_over_a_statement_given_up_on_is_rolled_back_whole() {
        let Some(url) = idem_testkit::pg_url() else { return };
        let routes = Router::new()
            .route("/given_up", post(given_up_in_leaked))
            .route("/plain", post(plain));
        let (addr, db, schema) = served_within(&url, 2, Duration::from_secs(1), routes).await;
        let mut blocker = holding_blocked(&url, &db).await;
        // The mark cannot be read behind the statement (the store's bound
        // runs out), and sqlx counts two levels: whether the transaction
        // is still idem's cannot be told.
        let first = post_req("/given_up", "").key("k-given-up").send(addr).await;
        let body = String::from_utf8_lossy(&first.body).into_owned();
        assert_eq!(first.status, 503, "{body}");
        assert!(body.contains("could not be recorded"), "{body}");
        let check = sqlx::PgPool::connect(&url).await.unwrap();
        let pid = GIVEN_UP_PID.load(Ordering::SeqCst);
        let state = |pid: i32| {
            let check = check.clone();
            async move {
                sqlx::query_scalar::<_, Option<String>>("SELECT state FROM pg_stat_activity WHERE pid = $1")
                    .bind(pid)
                    .fetch_optional(&check)
                    .await
                    .unwrap()
                    .flatten()
            }
        };
        assert_eq!(
            state(pid).await.as_deref(),
            Some("active"),
            "the statement given up on still waits"
        );
        let cancelled: bool = sqlx::query_scalar("SELECT pg_cancel_backend($1)")
            .bind(pid)
            .fetch_one(&check)
            .await
            .unwrap();
        assert!(cancelled);
        // Until the backend no longer runs the statement (a condition, not
        // an ordering).
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while state(pid).await.as_deref() == Some("active") {
            assert!(std::time::Instant::now() < until, "the statement never ended");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        sqlx::query("ROLLBACK").execute(&mut blocker).await.unwrap();
        for i in 0..3 {
            let key = format!("k-next-{i}");
            let r = post_req("/plain", "").key(&key).send(addr).await;
            assert_eq!(r.status, 201);
            let state: Option<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT state FROM \"{schema}\".idempotency_keys WHERE key = $1"
            )))
            .bind(&key)
            .fetch_optional(&check)
            .await
            .unwrap();
            assert_eq!(
                state.as_deref(),
                Some("completed"),
                "{key}: a 201 that did not commit"
            );
        }
        assert_eq!(db.count().await, 0, "the handler's writes committed");
        let (record, lock): (String, Option<String>) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT state, lock_token FROM \"{schema}\".idempotency_keys WHERE key = 'k-given-up'"
        )))
        .fetch_one(&check)
        .await
        .unwrap();
        assert_eq!(
            (record.as_str(), lock),
            ("in_progress", None),
            "the key given back"
        );
    }

    /// A nested transaction left open under an execution that does not
    /// commit (a failure, or a statement failed inside it): the whole
    /// transaction is rolled back, not its last level only, so the pool's
    /// one connection goes back outside any transaction: the key is given
    /// back, and the next operations on that connection are recorded, seen
    /// from another connection.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_nested_transaction_left_open_is_rolled_back_whole_when_nothing_commits() {
        let Some(url) = idem_testkit::pg_url() else { return };
        for (route, status) in [("/leaked_failing", 500), ("/failed_in_leaked", 503)] {
            let routes = Router::new()
                .route("/leaked_failing", post(leaked_failing))
                .route("/failed_in_leaked", post(failed_in_leaked))
                .route("/plain", post(plain));
            let (addr, db, schema) = served(&url, 1, routes).await;
            let first = post_req(route, "").key("k-leaked").send(addr).await;
            assert_eq!(
                first.status,
                status,
                "{route}: {}",
                String::from_utf8_lossy(&first.body)
            );
            for i in 0..3 {
                let r = post_req("/plain", "")
                    .key(&format!("k-next-{i}"))
                    .send(addr)
                    .await;
                assert_eq!(r.status, 201, "{route}");
            }
            let check = sqlx::PgPool::connect(&url).await.unwrap();
            let records: Vec<(String, String, Option<String>)> = sqlx::query_as(sqlx::AssertSqlSafe(
                format!("SELECT key, state, lock_token FROM \"{schema}\".idempotency_keys ORDER BY key"),
            ))
            .fetch_all(&check)
            .await
            .unwrap();
            let states: Vec<(&str, &str, bool)> = records
                .iter()
                .map(|(k, s, t)| (k.as_str(), s.as_str(), t.is_some()))
                .collect();
            assert_eq!(
                states,
                [
                    ("k-leaked", "in_progress", false),
                    ("k-next-0", "completed", false),
                    ("k-next-1", "completed", false),
                    ("k-next-2", "completed", false),
                ],
                "{route}: the key given back and the next operations committed"
            );
            let rows: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT count(*) FROM {}",
                db.effects()
            )))
            .fetch_one(&check)
            .await
            .unwrap();
            assert_eq!(rows, 0, "{route}: the handler's writes committed");
            check.close().await;
        }
    }
}

/// A handler transaction raised to REPEATABLE READ whose snapshot is older
/// than an extension of its own lease: the completion, an update of the
/// row the extension changed, cannot serialize. What the README says: 503,
/// nothing of the handler's committed, the key given back.
mod pg_isolation {
    use super::*;
    use idem_runtime::pause;
    use std::sync::Mutex;
    use tokio::sync::oneshot;

    type Gate = (oneshot::Sender<()>, oneshot::Receiver<()>);
    static GATE: Mutex<Option<Gate>> = Mutex::new(None);

    #[idempotent(scope = "isolation.rr")]
    async fn repeatable_read(State(db): State<Db>, op: Operation) -> StatusCode {
        let mut conn = op.pg_transaction().await.unwrap();
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            .execute(&mut *conn)
            .await
            .unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {} (id, note) VALUES ('rr', 'x')",
            db.effects()
        )))
        .execute(&mut *conn)
        .await
        .unwrap();
        let (started, go) = GATE.lock().unwrap().take().unwrap();
        started.send(()).unwrap();
        go.await.unwrap();
        StatusCode::CREATED
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_repeatable_read_handler_spanning_an_extension_is_rolled_back() {
        let Some(url) = idem_testkit::pg_url() else { return };
        let schema = idem_testkit::pg_schema(&url).await;
        let store = idem_testkit::pg_store_in(&url, &schema, 5).await;
        let db = Db::Pg(store.pool().clone(), schema.clone());
        db.create_table().await;
        let app = Router::new()
            .route("/rr", post(repeatable_read))
            .layer(
                Idem::new(store)
                    .single_tenant()
                    .lock_timeout(Duration::from_secs(3))
                    .unwrap()
                    .layer(),
            )
            .with_state(db.clone());
        let addr = serve(app).await;
        let (started_tx, started_rx) = oneshot::channel();
        let (go_tx, go_rx) = oneshot::channel();
        *GATE.lock().unwrap() = Some((started_tx, go_rx));
        let mut extension = pause::arm(pause::EXTEND_AFTER, "k-rr");
        let req = tokio::spawn(async move { post_req("/rr", "").key("k-rr").send(addr).await });
        // The snapshot is taken; then an extension of the lease commits.
        started_rx.await.unwrap();
        extension.reached().await;
        extension.resume();
        go_tx.send(()).unwrap();
        let r = req.await.unwrap();
        assert_eq!(r.status, 503, "{}", String::from_utf8_lossy(&r.body));
        assert_eq!(db.count().await, 0, "the handler's write committed");
        let Db::Pg(pool, _) = &db else { unreachable!() };
        let lock: Option<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT lock_token FROM \"{schema}\".idempotency_keys WHERE key = 'k-rr'"
        )))
        .fetch_one(pool)
        .await
        .unwrap();
        assert_eq!(lock, None, "the key was not given back");
    }
}

/// A handler that gives up on a nested begin twice: the first ends idem's
/// transaction (sqlx rolls back the level it counted before), the second
/// runs at sqlx's level none, sends a plain `BEGIN` and asks nothing when
/// cut. The connection must not go back to the pool inside that
/// transaction, whether the handler succeeds or rejects.
mod pg_begins_cut_twice {
    use axum::extract::State;
    use axum::http::StatusCode;
    use axum::routing::post;
    use axum::Router;
    use futures_util::FutureExt as _;
    use idem::{idempotent, Idem, Operation};
    use idem_testkit::http::{post as post_req, serve};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;
    use tokio::sync::oneshot;

    struct Probe {
        table: String,
        at_cut: Mutex<Option<oneshot::Sender<()>>>,
        answer: StatusCode,
        paid: AtomicUsize,
    }

    use super::pg_begins_cut::insert;

    /// Writes, gives up on a statement (blocked by the test's row lock), then
    /// retries a nested begin that times out: twice. Answers as asked.
    #[idempotent(scope = "cut_twice.cut")]
    async fn cut_twice(State(p): State<Arc<Probe>>, op: Operation) -> StatusCode {
        use sqlx::Connection as _;
        let mut conn = op.pg_transaction().await.unwrap();
        insert(&mut conn, &p.table, "before").await.unwrap();
        assert!(
            insert(&mut conn, &p.table, "blocked").now_or_never().is_none(),
            "the insert waits on the test's row"
        );
        for attempt in 0..2 {
            let gave_up = tokio::time::timeout(Duration::ZERO, conn.begin()).await.is_err();
            assert!(gave_up, "begin attempt {attempt} was given up on");
        }
        p.at_cut.lock().unwrap().take().unwrap().send(()).unwrap();
        p.answer
    }

    #[idempotent(scope = "cut_twice.pay")]
    async fn pay(State(p): State<Arc<Probe>>) -> StatusCode {
        p.paid.fetch_add(1, Ordering::SeqCst);
        StatusCode::CREATED
    }

    async fn run(answer: StatusCode) {
        use sqlx::Connection as _;
        let Some(url) = idem_testkit::pg_url() else { return };
        let schema = idem_testkit::pg_schema(&url).await;
        // A pool of one connection: the next operation runs on the same one.
        let store = idem_testkit::pg_store_in(&url, &schema, 1).await;
        let pool = store.pool().clone();
        let table = format!("\"{schema}\".effects");
        let check = sqlx::PgPool::connect(&url).await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {table} (id TEXT PRIMARY KEY, note TEXT NOT NULL)"
        )))
        .execute(&check)
        .await
        .unwrap();
        let (at_cut_tx, at_cut_rx) = oneshot::channel();
        let probe = Arc::new(Probe {
            table: table.clone(),
            at_cut: Mutex::new(Some(at_cut_tx)),
            answer,
            paid: AtomicUsize::new(0),
        });
        let app = |store: idem::PgStore, probe: Arc<Probe>| {
            Router::new()
                .route("/cut", post(cut_twice))
                .route("/pay", post(pay))
                .layer(Idem::new(store).single_tenant().layer())
                .with_state(probe)
        };
        let a = serve(app(store, probe.clone())).await;

        let mut blocker = sqlx::PgConnection::connect(&url).await.unwrap();
        sqlx::query("BEGIN").execute(&mut blocker).await.unwrap();
        insert(&mut blocker, &table, "blocked").await.unwrap();
        let first = tokio::spawn(async move { post_req("/cut", "").key("k-cut").send(a).await });
        at_cut_rx.await.unwrap();
        sqlx::query("ROLLBACK").execute(&mut blocker).await.unwrap();
        let first = first.await.unwrap();
        // The handler's transaction ended under it: its answer is not
        // given; what it wrote before the end was rolled back.
        assert_eq!(first.status, 503, "{}", String::from_utf8_lossy(&first.body));

        let paid = post_req("/pay", "").key("k-pay").send(a).await;
        assert_eq!(paid.status, 201);
        // The pool's one connection, as the server sees it.
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&pool)
            .await
            .unwrap();
        let state: Option<String> = sqlx::query_scalar("SELECT state FROM pg_stat_activity WHERE pid = $1")
            .bind(pid)
            .fetch_one(&check)
            .await
            .unwrap();
        assert_eq!(
            state.as_deref(),
            Some("idle"),
            "the pool's connection was left inside a transaction"
        );
        let seen: Option<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT state FROM \"{schema}\".idempotency_keys WHERE key = 'k-pay'"
        )))
        .fetch_optional(&check)
        .await
        .unwrap();

        // That server's process ends; another, on the same table, gets the retry.
        pool.close().await;
        let b = serve(app(
            idem_testkit::pg_store_in(&url, &schema, 5).await,
            probe.clone(),
        ))
        .await;
        let again = post_req("/pay", "").key("k-pay").send(b).await;
        assert_eq!(again.header("idempotent-replayed"), Some("true"));
        assert_eq!(
            seen.as_deref(),
            Some("completed"),
            "told 201, its record not committed"
        );
        assert_eq!(
            probe.paid.load(Ordering::SeqCst),
            1,
            "the handler ran twice for one key"
        );
    }

    /// The completion path (the handler answers 201).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_second_cut_begin_leaves_no_transaction_open_on_a_success() {
        run(StatusCode::CREATED).await;
    }

    /// The rollback path (the handler answers a 4xx rejection).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_second_cut_begin_leaves_no_transaction_open_on_a_rejection() {
        run(StatusCode::UNPROCESSABLE_ENTITY).await;
    }
}

/// sqlx's count of levels after cut begins and forgotten nested
/// transactions: idem's mark, not that count, says whether the transaction
/// is still idem's.
mod pg_counts_that_drift {
    use axum::extract::State;
    use axum::http::StatusCode;
    use axum::routing::post;
    use axum::Router;
    use futures_util::FutureExt as _;
    use idem::{idempotent, Idem, Operation};
    use idem_testkit::http::{post as post_req, serve};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;
    use tokio::sync::oneshot;

    struct Probe {
        table: String,
        at_cut: Mutex<Option<oneshot::Sender<()>>>,
        go: Mutex<Option<oneshot::Receiver<()>>>,
    }

    use super::pg_begins_cut::insert;

    /// The existing `leaked` handler of tests/multi_step.rs, one level deeper,
    /// with one nested begin given up on inside the forgotten transactions. (A
    /// begin given up on asks two rollbacks: its own guard's, and the
    /// `Transaction`'s drop, whose `open` is already true; at depth 3 they are
    /// `ROLLBACK TO SAVEPOINT _sqlx_savepoint_2` and `_1`, and sqlx counts 1.)
    #[idempotent(scope = "drift.forgotten")]
    async fn cut_then_forgotten(State(p): State<Arc<Probe>>, op: Operation) -> StatusCode {
        use sqlx::Connection as _;
        let mut conn = op.pg_transaction().await.unwrap();
        insert(&mut conn, &p.table, "outer").await.unwrap();
        let mut inner = conn.begin().await.unwrap();
        insert(&mut inner, &p.table, "inner").await.unwrap();
        let mut inner2 = inner.begin().await.unwrap();
        insert(&mut inner2, &p.table, "inner2").await.unwrap();
        if insert(&mut inner2, &p.table, "blocked").now_or_never().is_some() {
            return StatusCode::CONFLICT; // not blocked: only on a retry
        }
        let gave_up = tokio::time::timeout(Duration::ZERO, inner2.begin())
            .await
            .is_err();
        assert!(gave_up, "the nested begin was given up on");
        std::mem::forget(inner2);
        std::mem::forget(inner);
        p.at_cut.lock().unwrap().take().unwrap().send(()).unwrap();
        StatusCode::CREATED
    }

    /// Cut at depth 1 (sqlx ends the transaction), writes (on its own), then
    /// leaves a transaction open two levels deep.
    #[idempotent(scope = "drift.left_open")]
    async fn ended_then_left_open(State(p): State<Arc<Probe>>, op: Operation) -> StatusCode {
        use sqlx::Connection as _;
        let mut conn = op.pg_transaction().await.unwrap();
        insert(&mut conn, &p.table, "before").await.unwrap();
        assert!(
            insert(&mut conn, &p.table, "blocked").now_or_never().is_none(),
            "the insert waits on the test's row"
        );
        let gave_up = tokio::time::timeout(Duration::ZERO, conn.begin()).await.is_err();
        assert!(gave_up, "the nested begin was given up on");
        p.at_cut.lock().unwrap().take().unwrap().send(()).unwrap();
        let go = p.go.lock().unwrap().take().unwrap();
        go.await.unwrap();
        insert(&mut conn, &p.table, "after").await.unwrap();
        let mut t = conn.begin().await.unwrap();
        let t2 = t.begin().await.unwrap();
        std::mem::forget(t2);
        std::mem::forget(t);
        StatusCode::CREATED
    }

    struct Setup {
        url: String,
        schema: String,
        table: String,
        check: sqlx::PgPool,
        addr: std::net::SocketAddr,
        blocker: sqlx::PgConnection,
        at_cut: oneshot::Receiver<()>,
        go: Option<oneshot::Sender<()>>,
    }

    async fn setup() -> Option<Setup> {
        use sqlx::Connection as _;
        let url = idem_testkit::pg_url()?;
        let schema = idem_testkit::pg_schema(&url).await;
        let store = idem_testkit::pg_store_in(&url, &schema, 5).await;
        let table = format!("\"{schema}\".effects");
        let check = sqlx::PgPool::connect(&url).await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {table} (id TEXT PRIMARY KEY, note TEXT NOT NULL)"
        )))
        .execute(&check)
        .await
        .unwrap();
        let (at_cut_tx, at_cut) = oneshot::channel();
        let (go, go_rx) = oneshot::channel();
        let probe = Arc::new(Probe {
            table: table.clone(),
            at_cut: Mutex::new(Some(at_cut_tx)),
            go: Mutex::new(Some(go_rx)),
        });
        let app = Router::new()
            .route("/forgotten", post(cut_then_forgotten))
            .route("/left-open", post(ended_then_left_open))
            .layer(Idem::new(store).single_tenant().layer())
            .with_state(probe);
        let addr = serve(app).await;
        let mut blocker = sqlx::PgConnection::connect(&url).await.unwrap();
        sqlx::query("BEGIN").execute(&mut blocker).await.unwrap();
        insert(&mut blocker, &table, "blocked").await.unwrap();
        Some(Setup {
            url,
            schema,
            table,
            check,
            addr,
            blocker,
            at_cut,
            go: Some(go),
        })
    }

    async fn rows(s: &Setup) -> Vec<String> {
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT id FROM {} ORDER BY id",
            s.table
        )))
        .fetch_all(&s.check)
        .await
        .unwrap()
    }

    async fn record(s: &Setup, key: &str) -> Option<(String, Option<String>)> {
        sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT state, lock_token FROM \"{}\".idempotency_keys WHERE key = $1",
            s.schema
        )))
        .bind(key)
        .fetch_optional(&s.check)
        .await
        .unwrap()
    }

    /// A begin cut three levels deep makes sqlx roll back the two nested
    /// levels (it counts one); the transactions then forgotten. idem's
    /// transaction is still open: what it holds commits with the answer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn nested_levels_rolled_back_by_a_cut_begin_then_forgotten_commit_what_is_left() {
        let Some(mut s) = setup().await else { return };
        let addr = s.addr;
        let first = tokio::spawn(async move { post_req("/forgotten", "").key("k-f").send(addr).await });
        (&mut s.at_cut).await.unwrap();
        sqlx::query("ROLLBACK").execute(&mut s.blocker).await.unwrap();
        let first = first.await.unwrap();
        assert_eq!(first.status, 201, "{}", String::from_utf8_lossy(&first.body));
        assert_eq!(rows(&s).await, vec!["outer"]);
        assert_eq!(record(&s, "k-f").await, Some(("completed".to_owned(), None)));
        let again = post_req("/forgotten", "").key("k-f").send(s.addr).await;
        assert_eq!(again.status, 201);
        assert_eq!(again.header("idempotent-replayed"), Some("true"));
        let _ = &s.url;
    }

    /// sqlx ended idem's transaction (a cut begin at its level), a write
    /// committed on its own, and the handler left a new transaction open
    /// two levels deep (sqlx counts two): the answer says the outcome could
    /// not be recorded, never that the changes were rolled back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_ended_transaction_is_never_answered_as_rolled_back() {
        let Some(mut s) = setup().await else { return };
        let addr = s.addr;
        let first = tokio::spawn(async move { post_req("/left-open", "").key("k-l").send(addr).await });
        (&mut s.at_cut).await.unwrap();
        sqlx::query("ROLLBACK").execute(&mut s.blocker).await.unwrap();
        let _ = s.go.take().unwrap().send(());
        let first = first.await.unwrap();
        let body = String::from_utf8_lossy(&first.body).into_owned();
        assert_eq!(first.status, 503, "{body}");
        assert!(body.contains("could not be recorded"), "{body}");
        assert_eq!(rows(&s).await, vec!["after"]);
        let (state, lock) = record(&s, "k-l").await.unwrap();
        assert_ne!(state, "completed");
        assert_eq!(lock, None, "the key was not given back");
    }
}

/// A handler that runs `RESET ALL` in its transaction (which resets idem's
/// mark too): its writes commit with its 201, and its rejection is given
/// with nothing committed, as before the mark.
mod pg_reset_all {
    use super::*;

    #[derive(serde::Deserialize)]
    struct Answer {
        status: u16,
    }

    #[idempotent(scope = "reset_all.pay")]
    async fn resets(State(db): State<Db>, op: Operation, Json(a): Json<Answer>) -> StatusCode {
        let mut conn = op.pg_transaction().await.unwrap();
        sqlx::raw_sql("RESET ALL").execute(&mut *conn).await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {} (id, note) VALUES ($1, 'x')",
            db.effects()
        )))
        .bind(op.key().to_owned())
        .execute(&mut *conn)
        .await
        .unwrap();
        StatusCode::from_u16(a.status).unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_handler_that_resets_its_settings_keeps_its_answers() {
        let Some(url) = idem_testkit::pg_url() else { return };
        let (addr, db, _) =
            super::pg_begins_cut::served(&url, 1, Router::new().route("/resets", post(resets))).await;
        let ok = post_req("/resets", r#"{"status":201}"#)
            .key("k-ok")
            .send(addr)
            .await;
        assert_eq!(ok.status, 201, "{}", String::from_utf8_lossy(&ok.body));
        assert_eq!(db.count().await, 1);
        let replay = post_req("/resets", r#"{"status":201}"#)
            .key("k-ok")
            .send(addr)
            .await;
        assert_eq!(replay.header("idempotent-replayed"), Some("true"));
        let refused = post_req("/resets", r#"{"status":422}"#)
            .key("k-no")
            .send(addr)
            .await;
        assert_eq!(refused.status, 422, "{}", String::from_utf8_lossy(&refused.body));
        assert_eq!(db.count().await, 1, "a rejection's write committed");
    }
}

/// idem's mark is a value drawn for each transaction: a value the setting
/// has outside it (a `SET` for the session, which outlives its transaction
/// on the pooled connection) never passes for it.
mod pg_session_mark {
    use super::pg_begins_cut::{insert, served};
    use super::*;

    /// Writes, fails a statement, then begins a nested transaction, which
    /// fails in the failed transaction, and sqlx's begin then rolls back
    /// the handler's transaction; writes again (on its own), 201.
    #[idempotent(scope = "session_mark.ends")]
    async fn ends(State(db): State<Db>, op: Operation) -> StatusCode {
        use sqlx::Connection as _;
        let table = db.effects();
        let mut conn = op.pg_transaction().await.unwrap();
        insert(&mut conn, &table, "before").await.unwrap();
        assert!(
            insert(&mut conn, &table, "before").await.is_err(),
            "a duplicate key"
        );
        assert!(conn.begin().await.is_err(), "a begin in a failed transaction");
        insert(&mut conn, &table, "after").await.unwrap();
        StatusCode::CREATED
    }

    /// On a pool of one connection whose session has the setting at what a
    /// fixed mark would be (set there by a statement of the application's
    /// own), a handler's transaction ended under it: not answered as
    /// recorded (503, the key given back), and nothing of its transaction
    /// committed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_mark_set_for_the_session_does_not_pass_for_idems() {
        let Some(url) = idem_testkit::pg_url() else { return };
        let routes = Router::new().route("/ends", post(ends));
        let (addr, db, schema) = served(&url, 1, routes).await;
        let Db::Pg(pool, _) = &db else { unreachable!() };
        sqlx::query("SET idem.handler = 'on'")
            .execute(pool)
            .await
            .unwrap();
        let second = post_req("/ends", "").key("k-ends").send(addr).await;
        let body = String::from_utf8_lossy(&second.body).into_owned();
        assert_eq!(second.status, 503, "{body}");
        assert!(body.contains("could not be recorded"), "{body}");
        let check = sqlx::PgPool::connect(&url).await.unwrap();
        let (state, lock): (String, Option<String>) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT state, lock_token FROM \"{schema}\".idempotency_keys WHERE key = 'k-ends'"
        )))
        .fetch_one(&check)
        .await
        .unwrap();
        assert_ne!(
            state, "completed",
            "a 201 recorded without the handler's transaction"
        );
        assert_eq!(lock, None, "the key was not given back");
        let rows: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT id FROM {} ORDER BY id",
            db.effects()
        )))
        .fetch_all(&check)
        .await
        .unwrap();
        // What the handler wrote after sqlx ended its transaction committed
        // on its own (the README's caveat); the rest did not.
        assert_eq!(rows, ["after"]);
    }
}

mod sqlite_nested_left_open {
    use super::*;
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};

    /// Writes in the handler's transaction, then leaves a nested transaction
    /// of its own open (forgotten: neither committed nor dropped) after a
    /// second write.
    async fn leave_nested_open(op: &Operation) {
        use sqlx::Connection as _;
        let mut conn = op.sqlite_transaction().await.unwrap();
        sqlx::query("INSERT INTO effects (note) VALUES ('outer')")
            .execute(&mut *conn)
            .await
            .unwrap();
        let mut inner = conn.begin().await.unwrap();
        sqlx::query("INSERT INTO effects (note) VALUES ('inner')")
            .execute(&mut *inner)
            .await
            .unwrap();
        std::mem::forget(inner);
    }

    /// Leaves a nested transaction open (`leave_nested_open`), answers 201.
    #[idempotent(scope = "leaked.sqlite")]
    async fn leaked(op: Operation) -> StatusCode {
        leave_nested_open(&op).await;
        StatusCode::CREATED
    }

    #[idempotent(scope = "plain.sqlite_leaked")]
    async fn plain() -> StatusCode {
        StatusCode::CREATED
    }

    #[derive(serde::Deserialize, serde::Serialize)]
    struct Then {
        status: u16,
    }

    /// As `leaked`, then answers the status it is sent (503: released as
    /// failed; 422: rejected, which frees the key), with its attempt.
    #[idempotent(scope = "leaked_then.sqlite", fields(status))]
    async fn leaked_then(op: Operation, Json(then): Json<Then>) -> (StatusCode, String) {
        leave_nested_open(&op).await;
        (
            StatusCode::from_u16(then.status).unwrap(),
            format!("attempt {}", op.attempt()),
        )
    }

    async fn count(options: &SqliteConnectOptions, table: &str) -> i64 {
        let mut other = <sqlx::SqliteConnection as sqlx::Connection>::connect_with(options)
            .await
            .unwrap();
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
            .fetch_one(&mut other)
            .await
            .unwrap()
    }

    /// A nested transaction left open under an outcome that commits
    /// nothing (503, 422): the whole transaction is rolled back, the key is
    /// let go as the outcome says (503: the retry runs again; 422: a fixed
    /// request runs), and the pool's one connection goes back outside any
    /// transaction: the application's next commit on it is durable.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_nested_transaction_left_open_is_rolled_back_whole_and_the_key_let_go() {
        let (_dir, options, pool, store) = on_one_connection().await;
        sqlx::raw_sql("CREATE TABLE effects (note TEXT NOT NULL); CREATE TABLE app (note TEXT NOT NULL)")
            .execute(&pool)
            .await
            .unwrap();
        let app = Router::new()
            .route("/then", post(leaked_then))
            .layer(Idem::new(store).single_tenant().layer());
        let addr = serve(app).await;
        let first = post_req("/then", r#"{"status": 503}"#)
            .key("k-503")
            .send(addr)
            .await;
        assert_eq!(first.status, 503, "{}", String::from_utf8_lossy(&first.body));
        let retry = post_req("/then", r#"{"status": 503}"#)
            .key("k-503")
            .send(addr)
            .await;
        assert_eq!(
            (retry.status, retry.body.as_slice()),
            (503, &b"attempt 2"[..]),
            "{retry:?}"
        );
        let rejected = post_req("/then", r#"{"status": 422}"#)
            .key("k-422")
            .send(addr)
            .await;
        assert_eq!(rejected.status, 422, "{rejected:?}");
        let fixed = post_req("/then", r#"{"status": 503}"#)
            .key("k-422")
            .send(addr)
            .await;
        assert_eq!(
            (fixed.status, fixed.body.as_slice()),
            (503, &b"attempt 1"[..]),
            "{fixed:?}"
        );
        assert_eq!(
            count(&options, "effects").await,
            0,
            "a rolled-back write committed"
        );
        // The application's own commit on the pool's one connection.
        let mut tx = pool.begin().await.unwrap();
        sqlx::query("INSERT INTO app (note) VALUES ('committed')")
            .execute(&mut *tx)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        assert_eq!(
            count(&options, "app").await,
            1,
            "the application's commit was lost"
        );
        assert!(idem_testkit::dropped_transaction_rolls_back(&pool).await);
    }

    /// A store on a file whose pool has one connection, how to open
    /// another connection to it (another process's view), and the pool.
    async fn on_one_connection() -> (
        tempfile::TempDir,
        SqliteConnectOptions,
        sqlx::SqlitePool,
        idem::SqliteStore,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let options = SqliteConnectOptions::new()
            .filename(dir.path().join("idem.db"))
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal);
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(options.clone())
            .await
            .unwrap();
        let store = idem::SqliteStore::new(pool.clone());
        store.migrate().await.unwrap();
        (dir, options, pool, store)
    }

    /// As on PostgreSQL: what the nested transaction holds is the handler's
    /// transaction's, and commits with the answer (seen from a connection
    /// of its own); the pool's one connection then serves the next
    /// operations outside any transaction.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_nested_transaction_left_open_commits_with_the_answer() {
        let (_dir, options, pool, store) = on_one_connection().await;
        sqlx::raw_sql("CREATE TABLE effects (note TEXT NOT NULL)")
            .execute(&pool)
            .await
            .unwrap();
        let app = Router::new()
            .route("/leaked", post(leaked))
            .route("/plain", post(plain))
            .layer(Idem::new(store).single_tenant().layer());
        let addr = serve(app).await;
        let first = post_req("/leaked", "").key("k-leaked").send(addr).await;
        assert_eq!(first.status, 201, "{}", String::from_utf8_lossy(&first.body));
        let again = post_req("/leaked", "").key("k-leaked").send(addr).await;
        assert_eq!(
            (again.status, again.header("idempotent-replayed")),
            (201, Some("true"))
        );
        for i in 0..5 {
            let r = post_req("/plain", "")
                .key(&format!("k-next-{i}"))
                .send(addr)
                .await;
            assert_eq!(r.status, 201);
        }
        let mut other = <sqlx::SqliteConnection as sqlx::Connection>::connect_with(&options)
            .await
            .unwrap();
        let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
            .fetch_one(&mut other)
            .await
            .unwrap();
        assert_eq!(effects, 2, "the handler's writes did not commit");
        let completed: i64 =
            sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE state = 'completed'")
                .fetch_one(&mut other)
                .await
                .unwrap();
        assert_eq!(completed, 6, "the records were not all committed");
        assert!(idem_testkit::dropped_transaction_rolls_back(&pool).await);
    }
}

/// Checkpoints from two tasks of one execution (clones of its `Operation`):
/// "a" is written first and held after its write, then "b" is asked for.
/// "b" used to be written and return while "a" was held, and "a" then set
/// the execution's own `recovery_point()` last: it said "a" where the store
/// kept "b" (the one the next attempt is told). Checkpoints are now written
/// one at a time: "b" waits for "a" to return.
mod concurrent_checkpoints {
    use super::*;
    use idem_runtime::pause;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[derive(Clone, Default)]
    struct Steps {
        runs: Arc<AtomicUsize>,
        /// The test says when to ask for "b".
        ask_b: Arc<tokio::sync::Notify>,
        /// "b" returned.
        b_done: Arc<tokio::sync::Notify>,
    }

    /// The first run checkpoints "a" in a task and "b" itself, then fails
    /// (503, released) telling what `recovery_point()` says; the retry
    /// answers with what it was told.
    #[idempotent(scope = "steps.concurrent")]
    async fn two_tasks(State(s): State<Steps>, op: Operation) -> (StatusCode, String) {
        if s.runs.fetch_add(1, Ordering::SeqCst) > 0 {
            return (StatusCode::OK, op.recovery_point().unwrap_or_default());
        }
        let a = tokio::spawn({
            let op = op.clone();
            async move { op.checkpoint("a").await }
        });
        s.ask_b.notified().await;
        op.checkpoint("b").await.unwrap();
        s.b_done.notify_one();
        a.await.unwrap().unwrap();
        (
            StatusCode::SERVICE_UNAVAILABLE,
            op.recovery_point().unwrap_or_default(),
        )
    }

    async fn the_last_checkpoint_set_is_the_last_stored(f: idem_testkit::Fixture) {
        let steps = Steps::default();
        let app = Router::new()
            .route("/steps", post(two_tasks))
            .layer(Idem::from_arc(f.store.clone()).single_tenant().layer())
            .with_state(steps.clone());
        let addr = serve(app).await;
        let key = idem_testkit::unique("steps");
        let mut a_written = pause::arm(pause::CHECKPOINT_AFTER, &key);
        let first = tokio::spawn({
            let key = key.clone();
            async move { post_req("/steps", "").key(&key).send(addr).await }
        });
        a_written.reached().await;
        steps.ask_b.notify_one();
        // Nothing holds "b" up but "a": it used to return within
        // milliseconds. Half a second is the bound given to it.
        let overtook = tokio::time::timeout(Duration::from_millis(500), steps.b_done.notified())
            .await
            .is_ok();
        a_written.resume();
        let first = first.await.unwrap();
        assert_eq!(first.status, 503, "{first:?}");
        let retry = post_req("/steps", "").key(&key).send(addr).await;
        assert_eq!(retry.status, 200, "{retry:?}");
        assert_eq!(
            String::from_utf8_lossy(&first.body),
            String::from_utf8_lossy(&retry.body),
            "what the execution said it set (left), against what the store kept (right)"
        );
        assert_eq!(retry.body, b"b", "the last checkpoint asked for is the one kept");
        assert!(
            !overtook,
            "\"b\" was written and returned while \"a\" had not returned"
        );
    }

    idem_testkit::for_each_store! {
        stores: [memory, sqlite, postgres],
        setup: |kind| kind.fixture().await,
        worker_threads: 2,
        cases: [
            the_last_checkpoint_set_is_the_last_stored,
        ],
    }
}

/// A handler that points its own transaction at another schema (a schema
/// per tenant, `SET LOCAL search_path`), on a store given no schema: idem's
/// completion, written in that transaction, finds its table as idem's other
/// statements do, through the search path the transaction began with.
mod pg_search_path {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[derive(Clone)]
    struct Tenant {
        idem_schema: String,
        tenant_schema: String,
        runs: Arc<AtomicUsize>,
        /// Whether the handler also deletes idem's record in its
        /// transaction: the completion then finds no row, with no takeover.
        delete_the_record: bool,
    }

    #[idempotent(scope = "order.create")]
    async fn create_order(State(t): State<Tenant>, op: Operation) -> Result<StatusCode, StatusCode> {
        t.runs.fetch_add(1, Ordering::SeqCst);
        let mut conn = op
            .pg_transaction()
            .await
            .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "SET LOCAL search_path TO \"{}\"",
            t.tenant_schema
        )))
        .execute(&mut *conn)
        .await
        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
        sqlx::query("INSERT INTO orders (id) VALUES ($1)")
            .bind(op.derived_key("order"))
            .execute(&mut *conn)
            .await
            .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
        if t.delete_the_record {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "DELETE FROM \"{}\".idempotency_keys WHERE key = $1",
                t.idem_schema
            )))
            .bind(op.key().to_owned())
            .execute(&mut *conn)
            .await
            .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
        }
        Ok(StatusCode::CREATED)
    }

    struct Served {
        addr: std::net::SocketAddr,
        pool: sqlx::PgPool,
        tenant: Tenant,
    }

    /// A store given no schema, on a pool whose search path is a fresh
    /// schema (where `migrate` puts the table), and a tenant schema with
    /// the application's `orders`; `shadow`: the tenant schema also has a
    /// table of idem's name and shape, empty.
    ///
    /// `hyphen`: idem's schema has a name that is no plain identifier
    /// (PostgreSQL takes any, quoted).
    async fn served(shadow: bool, delete_the_record: bool, hyphen: bool) -> Option<Served> {
        let url = idem_testkit::pg_url()?;
        let mut idem_schema = idem_testkit::pg_schema(&url).await;
        let tenant_schema = idem_testkit::pg_schema(&url).await;
        if hyphen {
            idem_schema += "-x";
            let admin = sqlx::PgPool::connect(&url).await.unwrap();
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA \"{idem_schema}\"")))
                .execute(&admin)
                .await
                .unwrap();
        }
        let options: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
        let path = format!("\"{idem_schema}\"");
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect_with(options.options([("search_path", path.as_str())]))
            .await
            .unwrap();
        let store = idem::PgStore::new(pool.clone());
        store.migrate().await.unwrap();
        let mut setup = format!("CREATE TABLE \"{tenant_schema}\".orders (id TEXT PRIMARY KEY);");
        if shadow {
            setup += &format!(
                "CREATE TABLE \"{tenant_schema}\".idempotency_keys \
                 (LIKE \"{idem_schema}\".idempotency_keys INCLUDING ALL);"
            );
        }
        sqlx::raw_sql(sqlx::AssertSqlSafe(setup))
            .execute(&pool)
            .await
            .unwrap();
        let tenant = Tenant {
            idem_schema,
            tenant_schema,
            runs: Arc::default(),
            delete_the_record,
        };
        let app = Router::new()
            .route("/orders", post(create_order))
            .layer(Idem::new(store).single_tenant().layer())
            .with_state(tenant.clone());
        Some(Served {
            addr: serve(app).await,
            pool,
            tenant,
        })
    }

    impl Served {
        async fn count(&self, table: &str, schema: &str) -> i64 {
            sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT count(*) FROM \"{schema}\".{table}"
            )))
            .fetch_one(&self.pool)
            .await
            .unwrap()
        }

        /// The record's state and lock token, in idem's own table.
        async fn record(&self, key: &str) -> Option<(String, Option<String>)> {
            sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT state, lock_token FROM \"{}\".idempotency_keys WHERE key = $1",
                self.tenant.idem_schema
            )))
            .bind(key)
            .fetch_optional(&self.pool)
            .await
            .unwrap()
        }
    }

    /// Once answered, retried: replayed, the handler run once, its row
    /// committed with the answer, idem's record completed in its own table.
    async fn commits_and_replays(s: &Served) {
        let first = post_req("/orders", "").key("k-order").send(s.addr).await;
        assert_eq!(first.status, 201, "{}", String::from_utf8_lossy(&first.body));
        let retry = post_req("/orders", "").key("k-order").send(s.addr).await;
        assert_eq!(
            (retry.status, retry.header("idempotent-replayed")),
            (201, Some("true"))
        );
        assert_eq!(s.tenant.runs.load(Ordering::SeqCst), 1);
        assert_eq!(s.count("orders", &s.tenant.tenant_schema).await, 1);
        assert_eq!(
            s.record("k-order").await.map(|(state, _)| state).as_deref(),
            Some("completed")
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_handler_that_sets_its_search_path_commits_with_its_answer() {
        let Some(s) = served(false, false, false).await else {
            return;
        };
        commits_and_replays(&s).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_table_of_idems_name_on_the_handlers_path_is_left_alone() {
        let Some(s) = served(true, false, false).await else {
            return;
        };
        commits_and_replays(&s).await;
        assert_eq!(s.count("idempotency_keys", &s.tenant.tenant_schema).await, 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_schema_named_with_a_hyphen_is_named_too() {
        let Some(s) = served(false, false, true).await else {
            return;
        };
        commits_and_replays(&s).await;
    }

    #[idempotent(scope = "order.gated")]
    async fn gated(State(gate): State<Gate>, op: Operation) -> Result<StatusCode, StatusCode> {
        let signals = gate.0.lock().unwrap().take();
        if let Some((started, go)) = signals {
            started.send(()).unwrap();
            go.await.unwrap();
        }
        let mut conn = op
            .pg_transaction()
            .await
            .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
        sqlx::query("SELECT 1")
            .execute(&mut *conn)
            .await
            .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
        Ok(StatusCode::CREATED)
    }

    /// The first handler told the test it started, and waits for its go.
    type Signals = (
        tokio::sync::oneshot::Sender<()>,
        tokio::sync::oneshot::Receiver<()>,
    );
    #[derive(Clone, Default)]
    struct Gate(Arc<std::sync::Mutex<Option<Signals>>>);

    /// The schema is looked up on a session that has a temporary table of
    /// idem's table's name (PostgreSQL's search path finds temporary
    /// tables first): the session's own temporary schema is not where
    /// idem's table is, and is not kept for the store.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_temporary_table_of_the_same_name_is_not_taken_for_the_table() {
        let Some(url) = idem_testkit::pg_url() else { return };
        let idem_schema = idem_testkit::pg_schema(&url).await;
        let options: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .connect_with(options.options([("search_path", idem_schema.as_str())]))
            .await
            .unwrap();
        let store = idem::PgStore::new(pool.clone());
        store.migrate().await.unwrap();
        // Both connections in hand: the first gets the temporary table, the
        // second is left for the reservation.
        let mut with_temp = pool.acquire().await.unwrap();
        let other = pool.acquire().await.unwrap();
        sqlx::raw_sql("CREATE TEMP TABLE idempotency_keys (note text)")
            .execute(&mut *with_temp)
            .await
            .unwrap();
        drop(other);
        let (started_tx, started) = tokio::sync::oneshot::channel();
        let (go, go_rx) = tokio::sync::oneshot::channel();
        let gate = Gate::default();
        *gate.0.lock().unwrap() = Some((started_tx, go_rx));
        let app = Router::new()
            .route("/orders", post(gated))
            .layer(Idem::new(store).single_tenant().layer())
            .with_state(gate);
        let addr = serve(app).await;
        let first = tokio::spawn(async move { post_req("/orders", "").key("k-temp-1").send(addr).await });
        started.await.unwrap();
        // Reserved on the other connection, which the test now holds: the
        // store's first transaction looks its schema up on the one with the
        // temporary table.
        let held = pool.acquire().await.unwrap();
        drop(with_temp);
        go.send(()).unwrap();
        let first = first.await.unwrap();
        drop(held);
        assert_eq!(first.status, 201, "{}", String::from_utf8_lossy(&first.body));
        // Gone from every session: later requests, on either connection.
        let mut a = pool.acquire().await.unwrap();
        let mut b = pool.acquire().await.unwrap();
        for conn in [&mut a, &mut b] {
            sqlx::raw_sql("DROP TABLE IF EXISTS pg_temp.idempotency_keys")
                .execute(&mut **conn)
                .await
                .unwrap();
        }
        drop((a, b));
        for i in 0..3 {
            let r = post_req("/orders", "")
                .key(&format!("k-temp-after-{i}"))
                .send(addr)
                .await;
            assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
        }
    }

    /// A completion in the handler's transaction that finds no row of its
    /// own when no execution took the record over (here the handler
    /// deleted it) gives the key back: no lock is left that no execution
    /// holds, and the retry continues the operation at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_completion_that_finds_no_row_gives_the_key_back() {
        let Some(s) = served(false, true, false).await else {
            return;
        };
        let first = post_req("/orders", "").key("k-gone").send(s.addr).await;
        let body = String::from_utf8_lossy(&first.body).into_owned();
        assert_eq!(first.status, 503, "{body}");
        assert!(body.contains("idempotency-lease-lost"), "{body}");
        assert_eq!(s.count("orders", &s.tenant.tenant_schema).await, 0, "rolled back");
        let record = s.record("k-gone").await;
        assert!(
            matches!(&record, Some((state, None)) if state == "in_progress"),
            "released, not left locked: {record:?}"
        );
        let retry = post_req("/orders", "").key("k-gone").send(s.addr).await;
        assert_eq!(retry.status, 503, "{}", String::from_utf8_lossy(&retry.body));
        assert_eq!(s.tenant.runs.load(Ordering::SeqCst), 2, "the retry ran at once");
    }
}

/// The purge's choice of rows has a name no table can have: on SQLite a
/// table named as the choice, read inside it, would be the choice itself.
#[tokio::test]
async fn sqlite_a_table_named_chosen_is_purged() {
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(1)
        .connect("sqlite::memory:")
        .await
        .unwrap();
    let store = idem::SqliteStore::new(pool.clone()).with_table("Chosen").unwrap();
    store.migrate().await.unwrap();
    sqlx::raw_sql(
        "INSERT INTO chosen (tenant, scope, key, fingerprint, state, operation_id, attempt, lock_expires_at, \
         created_at, expires_at, purge_at) VALUES ('t', 's', 'k', 'fp', 'completed', 'op', 1, 1, 1, 2, 2)",
    )
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(store.purge_expired(5).await.unwrap(), 1);
}

/// One purge statement stays within its batch on PostgreSQL whatever plan
/// the planner picks: with the statistics a round that emptied the table
/// leaves (pages, no live row), new rows are estimated at one, and a choice
/// of rows written as a subquery was run again for each deleted row.
mod pg_purge_batches {
    use super::*;

    /// Statistics as a janitor round that purged every row leaves them.
    async fn analyzed_while_empty(pool: &sqlx::PgPool, t: &str) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {t} (tenant, scope, key, fingerprint, state, operation_id, attempt, lock_expires_at, \
             created_at, expires_at, purge_at) SELECT 't', 's', 'gone-' || n, 'fp', 'completed', 'op', 1, \
             now() - interval '2 hours', now() - interval '3 hours', now() - interval '1 hour', \
             now() - interval '1 hour' FROM generate_series(1, 200) AS n; \
             DELETE FROM {t}; ANALYZE {t};"
        )))
        .execute(pool)
        .await
        .unwrap();
        let tuples: f32 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT reltuples FROM pg_class WHERE oid = '{t}'::regclass"
        )))
        .fetch_one(pool)
        .await
        .unwrap();
        assert_eq!(tuples, 0.0, "the statistics the test needs");
    }

    /// 50 rows of `state` and `purge_at` as given, expired an hour ago.
    async fn fifty(pool: &sqlx::PgPool, t: &str, purge_at: &str) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {t} (tenant, scope, key, fingerprint, state, operation_id, attempt, lock_expires_at, \
             created_at, expires_at, purge_at) SELECT 't', 's', 'k-' || n, 'fp', 'completed', 'op', 1, \
             now() - interval '2 hours', now() - interval '3 hours', now() - interval '1 hour', \
             {purge_at} FROM generate_series(1, 50) AS n"
        )))
        .execute(pool)
        .await
        .unwrap();
    }

    async fn served() -> Option<(sqlx::PgPool, String, idem::PgStore)> {
        let url = idem_testkit::pg_url()?;
        let schema = idem_testkit::pg_schema(&url).await;
        let store = idem_testkit::pg_store_in(&url, &schema, 4).await;
        let pool = sqlx::PgPool::connect(&url).await.unwrap();
        let t = format!("\"{schema}\".idempotency_keys");
        analyzed_while_empty(&pool, &t).await;
        Some((pool, t, store))
    }

    #[tokio::test]
    async fn one_purge_deletes_at_most_its_batch() {
        let Some((pool, t, store)) = served().await else {
            return;
        };
        fifty(&pool, &t, "now() - interval '1 hour'").await;
        assert_eq!(store.purge_expired(5).await.unwrap(), 5);
        let left: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {t}")))
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(left, 45);
    }

    /// The backfill of rows an earlier build wrote (`purge_at` not set):
    /// each statement (its own transaction) sets at most the batch; a row
    /// trigger notes the transaction of every row set.
    #[tokio::test]
    async fn one_backfill_statement_sets_at_most_its_batch() {
        let Some((pool, t, store)) = served().await else {
            return;
        };
        let schema = t.split('.').next().unwrap().to_owned();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {schema}.seen (tx bigint); \
             CREATE FUNCTION {schema}.note() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN INSERT INTO {schema}.seen VALUES (txid_current()); RETURN NEW; END $$; \
             CREATE TRIGGER note AFTER UPDATE OF purge_at ON {t} FOR EACH ROW EXECUTE FUNCTION {schema}.note();"
        )))
        .execute(&pool)
        .await
        .unwrap();
        fifty(&pool, &t, "'-infinity'").await;
        store.purge_expired(5).await.unwrap();
        let per_statement: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM {schema}.seen GROUP BY tx ORDER BY 1 DESC"
        )))
        .fetch_all(&pool)
        .await
        .unwrap();
        assert!(!per_statement.is_empty());
        assert!(
            per_statement.iter().all(|&n| n <= 5),
            "rows set per backfill statement with a batch of 5: {per_statement:?}"
        );
    }
}

/// What a handler's statements on its SQLite transaction leave on the
/// pooled connection must not change which table idem reads and writes.
mod sqlite_temp_table {
    use super::*;

    /// An effect row in the operation's transaction; with `temp`, a `TEMP`
    /// table of idem's table's name too (SQLite finds `temp` before `main`),
    /// a copy of idem's rows, left on the connection.
    #[idempotent(scope = "lite.temp", lock_timeout = "1s")]
    async fn handler(op: Operation, Json(temp): Json<bool>) -> StatusCode {
        let mut conn = op.sqlite_transaction().await.unwrap();
        sqlx::query("INSERT INTO main.effects (id, note) VALUES (?1, 'x')")
            .bind(op.key().to_owned())
            .execute(&mut *conn)
            .await
            .unwrap();
        if temp {
            sqlx::raw_sql("CREATE TEMP TABLE idempotency_keys AS SELECT * FROM main.idempotency_keys")
                .execute(&mut *conn)
                .await
                .unwrap();
        }
        StatusCode::CREATED
    }

    #[tokio::test]
    async fn a_temp_table_of_idems_name_takes_nothing_from_it() {
        let (store, _dir) = idem_testkit::sqlite_store().await;
        let db = Db::Sqlite(store.pool().clone());
        db.create_table().await;
        let addr = serve(
            Router::new()
                .route("/temp", post(handler))
                .layer(Idem::new(store).single_tenant().layer()),
        )
        .await;
        let first = post_req("/temp", "true").key("k-temp").send(addr).await;
        assert_eq!(first.status, 201, "{}", String::from_utf8_lossy(&first.body));
        // The connection keeps the temporary table: every later request,
        // whichever connection it gets, is recorded in idem's table.
        for i in 0..8 {
            let key = format!("k-after-{i}");
            let r = post_req("/temp", "false").key(&key).send(addr).await;
            assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
        }
        let Db::Sqlite(pool) = &db else { unreachable!() };
        let completed: i64 =
            sqlx::query_scalar("SELECT count(*) FROM main.idempotency_keys WHERE state = 'completed'")
                .fetch_one(pool)
                .await
                .unwrap();
        assert_eq!(completed, 9);
        for key in ["k-temp", "k-after-0", "k-after-7"] {
            let body = if key == "k-temp" { "true" } else { "false" };
            let retry = post_req("/temp", body).key(key).send(addr).await;
            assert_eq!(
                (retry.status, retry.header("idempotent-replayed")),
                (201, Some("true"))
            );
        }
        assert_eq!(db.count().await, 9, "a handler ran twice");
    }
}

/// A checkpoint that passed its first check, then waited on the record's
/// row (held by a test connection) while the lease keeper counted the lease
/// lost (its extension waits on the row too): it is written once the row
/// is free, under the token that still holds the record, and the handler is
/// told `LockLost` all the same, as `checkpoint` promises once the lease is
/// lost; its client gets 503 `idempotency-lease-lost`. The order is read
/// from the database and the lease's own flag, never hoped for.
mod a_checkpoint_written_as_the_lease_runs_out {
    use super::*;
    use std::sync::Mutex;
    use tokio::sync::{mpsc, Notify};

    #[derive(Clone)]
    struct Probe {
        slot: Arc<Mutex<Option<Operation>>>,
        go: Arc<Notify>,
        events: mpsc::UnboundedSender<String>,
    }

    #[idempotent(scope = "checkpoint.late", lock_timeout = "1s")]
    async fn checkpointing(State(p): State<Probe>, op: Operation) -> (StatusCode, &'static str) {
        p.slot.lock().unwrap().replace(op.clone());
        p.events.send("ready".into()).unwrap();
        p.go.notified().await;
        let r = op.checkpoint("cp").await;
        p.events
            .send(format!("checkpoint={r:?} lost_at_return={}", op.is_lease_lost()))
            .unwrap();
        (StatusCode::CREATED, "first")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn postgres_a_checkpoint_written_after_the_lease_was_lost_says_lock_lost() {
        use sqlx::Connection as _;
        let Some(url) = idem_testkit::pg_url() else { return };
        let schema = idem_testkit::pg_schema(&url).await;
        let store = idem_testkit::pg_store_in(&url, &schema, 8).await;
        let pool = store.pool().clone();
        let (tx, mut events) = mpsc::unbounded_channel();
        let probe = Probe {
            slot: Arc::default(),
            go: Arc::default(),
            events: tx,
        };
        let idem = Idem::new(store).single_tenant();
        let router = Router::new()
            .route("/cp", post(checkpointing))
            .layer(idem.layer())
            .with_state(probe.clone());
        let addr = idem_testkit::http::serve(router).await;

        let first = tokio::spawn(async move { post_req("/cp", "").key("k-cp").send(addr).await });
        assert_eq!(events.recv().await.unwrap(), "ready");

        // A test connection holds the record's row.
        let mut holder = sqlx::PgConnection::connect(&url).await.unwrap();
        sqlx::query("BEGIN").execute(&mut holder).await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT 1 FROM \"{schema}\".idempotency_keys WHERE key = $1 FOR UPDATE"
        )))
        .bind("k-cp")
        .execute(&mut holder)
        .await
        .unwrap();

        let op = probe.slot.lock().unwrap().clone().unwrap();
        assert!(
            !op.is_lease_lost(),
            "too slow a setup: the lease was lost before the checkpoint"
        );
        probe.go.notify_one();

        // The checkpoint's UPDATE waits on the row lock.
        until_waiting_for_a_lock(&pool, &schema, "SET recovery_point").await;
        // The keeper counts the lease lost (its extension waits on the row too).
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !op.is_lease_lost() {
            assert!(
                std::time::Instant::now() < deadline,
                "the lease was never counted lost"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        sqlx::query("COMMIT").execute(&mut holder).await.unwrap();

        let said = events.recv().await.unwrap();
        let first = first.await.unwrap();
        assert_eq!(
            (first.status, first.problem()),
            (503, "idempotency-lease-lost".to_owned())
        );
        let rp: Option<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT recovery_point FROM \"{schema}\".idempotency_keys WHERE key = 'k-cp'"
        )))
        .fetch_one(&pool)
        .await
        .unwrap();
        // Written under the token that still held the record: kept for the
        // execution that takes the operation over.
        assert_eq!(rp.as_deref(), Some("cp"));
        assert_eq!(said, "checkpoint=Err(LockLost) lost_at_return=true");
    }
}

/// The completion in the handler's transaction bounds its own wait for the
/// record's row, then puts the transaction's `lock_timeout` back for the
/// commit. When another transaction updated the row while it waited
/// (idem's own heartbeat does), PostgreSQL judges the row again, and the
/// `lock_timeout` kept must still be the transaction's own (here the
/// handler's `SET LOCAL lock_timeout = '7s'`, which a deferred trigger
/// records at the commit), not the bound set by then.
mod the_commit_keeps_the_transactions_lock_timeout {
    use super::*;
    use std::sync::Mutex;

    #[derive(Clone)]
    struct Held {
        schema: String,
        store: idem::PgStore,
        holders: sqlx::PgPool,
        holder: Arc<Mutex<Option<sqlx::Transaction<'static, sqlx::Postgres>>>>,
    }

    #[idempotent(scope = "kept.create")]
    async fn create(State(h): State<Held>, op: Operation) -> Result<(StatusCode, &'static str), StatusCode> {
        let mut conn = op
            .pg_transaction()
            .await
            .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "SET LOCAL lock_timeout = '7s'; INSERT INTO \"{}\".made (id) VALUES ('one')",
            h.schema
        )))
        .execute(&mut *conn)
        .await
        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
        drop(conn);
        // The record's row updated, uncommitted, by another transaction.
        let mut holder = h.holders.begin().await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE {} SET lock_expires_at = lock_expires_at WHERE key = $1",
            idem_testkit::records::pg_table(&h.store)
        )))
        .bind(op.key())
        .execute(&mut *holder)
        .await
        .unwrap();
        *h.holder.lock().unwrap() = Some(holder);
        Ok((StatusCode::CREATED, "made"))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_even_when_the_row_was_updated_while_it_waited() {
        let Some(url) = idem_testkit::pg_url() else { return };
        let schema = idem_testkit::pg_schema(&url).await;
        // A bound shorter than the handler's 7 s.
        let store = idem_testkit::pg_store_in(&url, &schema, 4)
            .await
            .with_timeout(Duration::from_secs(2));
        let pool = store.pool().clone();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE \"{schema}\".made (id TEXT PRIMARY KEY); \
             CREATE TABLE \"{schema}\".seen (lock_timeout TEXT); \
             CREATE FUNCTION \"{schema}\".see() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN INSERT INTO \"{schema}\".seen VALUES (current_setting('lock_timeout')); RETURN NULL; END $$; \
             CREATE CONSTRAINT TRIGGER see AFTER INSERT ON \"{schema}\".made \
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION \"{schema}\".see()"
        )))
        .execute(&pool)
        .await
        .unwrap();
        let held = Held {
            schema: schema.clone(),
            store: store.clone(),
            holders: sqlx::PgPool::connect(&url).await.unwrap(),
            holder: Arc::default(),
        };
        let app = Router::new()
            .route("/made", post(create))
            .layer(Idem::new(store).single_tenant().layer())
            .with_state(held.clone());
        let addr = serve(app).await;
        let key = idem_testkit::unique("k-kept");
        let first = {
            let key = key.clone();
            tokio::spawn(async move { post_req("/made", "").key(&key).send(addr).await })
        };
        // The completion waits for the row; then the other transaction
        // commits its update.
        until_waiting_for_a_lock(&pool, &schema, "RETURNING set_config").await;
        let holder = held.holder.lock().unwrap().take().unwrap();
        holder.commit().await.unwrap();
        let first = first.await.unwrap();
        assert_eq!(first.status, 201, "{first:?}");
        let seen: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT lock_timeout FROM \"{schema}\".seen"
        )))
        .fetch_all(&pool)
        .await
        .unwrap();
        assert_eq!(seen, ["7s"]);
    }
}

/// Until a statement of the test's schema whose text holds `part` waits for
/// a lock, as the database says (never an ordering hoped for).
async fn until_waiting_for_a_lock(pool: &sqlx::PgPool, schema: &str, part: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
             AND query LIKE '%' || $2 || '%' AND query LIKE '%' || $1 || '%'",
        )
        .bind(schema)
        .bind(part)
        .fetch_one(pool)
        .await
        .unwrap();
        if waiting > 0 {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no statement with {part:?} waited for a lock"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A commit that PostgreSQL refuses (a deferred constraint, a serialization
/// failure) rolled the handler's transaction back, the completion with it:
/// the client is told its changes were rolled back (not that the outcome
/// is unknown), the key is let go, and a retry runs the operation again,
/// once.
mod a_commit_postgresql_refuses_was_rolled_back {
    use super::*;
    use idem_runtime::pause;

    #[derive(Clone)]
    struct Ledger {
        pool: sqlx::PgPool,
        schema: String,
    }

    #[derive(serde::Deserialize, serde::Serialize)]
    struct Entry {
        note: String,
        /// Serializable, having read the ledger first.
        serializable: bool,
    }

    #[idempotent(scope = "ledger.write", fields(note, serializable))]
    async fn write(
        State(ledger): State<Ledger>,
        op: Operation,
        Json(entry): Json<Entry>,
    ) -> Result<(StatusCode, String), StatusCode> {
        let failed = |_| StatusCode::INTERNAL_SERVER_ERROR;
        let mut conn = op
            .pg_transaction()
            .await
            .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
        if entry.serializable {
            sqlx::raw_sql("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE")
                .execute(&mut *conn)
                .await
                .map_err(failed)?;
            let _: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT count(*) FROM \"{}\".ledger",
                ledger.schema
            )))
            .fetch_one(&mut *conn)
            .await
            .map_err(failed)?;
        }
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO \"{}\".ledger (note) VALUES ($1)",
            ledger.schema
        )))
        .bind(&entry.note)
        .execute(&mut *conn)
        .await
        .map_err(failed)?;
        Ok((StatusCode::CREATED, entry.note))
    }

    /// The ledger (each note once, checked at commit), the store, and the
    /// service's address.
    async fn ledger() -> Option<(Ledger, idem::PgStore, std::net::SocketAddr)> {
        let url = idem_testkit::pg_url()?;
        let schema = idem_testkit::pg_schema(&url).await;
        let store = idem_testkit::pg_store_in(&url, &schema, 10).await;
        let pool = store.pool().clone();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE \"{schema}\".ledger (note TEXT NOT NULL, \
             CONSTRAINT once UNIQUE (note) DEFERRABLE INITIALLY DEFERRED)"
        )))
        .execute(&pool)
        .await
        .unwrap();
        let ledger = Ledger { pool, schema };
        let app = Router::new()
            .route("/ledger", post(write))
            .layer(Idem::new(store.clone()).single_tenant().layer())
            .with_state(ledger.clone());
        Some((ledger, store, serve(app).await))
    }

    impl Ledger {
        async fn run(&self, sql: &str) {
            let sql = sql.replace("ledger", &format!("\"{}\".ledger", self.schema));
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                .execute(&self.pool)
                .await
                .unwrap();
        }

        async fn notes(&self) -> Vec<String> {
            sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT note FROM \"{}\".ledger ORDER BY note",
                self.schema
            )))
            .fetch_all(&self.pool)
            .await
            .unwrap()
        }
    }

    /// 503, its changes said to be rolled back, and the key let go (not
    /// completed, no lock left).
    async fn rolled_back(answer: &idem_testkit::http::Reply, store: &idem::PgStore, key: &str) {
        assert_eq!(answer.status, 503, "{answer:?}");
        assert_eq!(answer.problem(), "idempotency-store-unavailable");
        let detail = answer.json()["detail"].as_str().unwrap().to_owned();
        assert!(detail.contains("rolled back"), "{detail}");
        let row = idem_testkit::records::pg_row(store, &RecordId::new("", "ledger.write", key)).await;
        let (state, token, _) = row.expect("the record");
        assert_ne!(state, "completed");
        assert_eq!(token, None, "a lock left that no execution holds");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_a_deferred_constraint() {
        let Some((ledger, store, addr)) = ledger().await else {
            return;
        };
        ledger.run("INSERT INTO ledger VALUES ('taken')").await;
        let key = "k-deferred";
        let request = || post_req("/ledger", r#"{"note":"taken","serializable":false}"#).key(key);
        rolled_back(&request().send(addr).await, &store, key).await;
        // Refused again as long as the note is taken: never a 409.
        rolled_back(&request().send(addr).await, &store, key).await;
        assert_eq!(ledger.notes().await, ["taken"]);

        ledger.run("DELETE FROM ledger").await;
        let retry = request().send(addr).await;
        assert_eq!(retry.status, 201, "{retry:?}");
        assert_eq!(retry.header("idempotent-replayed"), None);
        let replay = request().send(addr).await;
        assert_eq!(replay.header("idempotent-replayed"), Some("true"));
        assert_eq!(replay.body, retry.body);
        assert_eq!(ledger.notes().await, ["taken"], "one write of the operation's");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_a_serialization_failure() {
        let Some((ledger, store, addr)) = ledger().await else {
            return;
        };
        let key = "k-serializable";
        let request = || post_req("/ledger", r#"{"note":"mine","serializable":true}"#).key(key);
        let mut paused = pause::arm(pause::TX_BEFORE_COMMIT, key);
        let first = {
            let request = request();
            tokio::spawn(async move { request.send(addr).await })
        };
        paused.reached().await;
        // Another serializable writer reads what the handler wrote to and
        // writes what it read, and commits first: the handler's commit
        // closes a cycle, and PostgreSQL refuses it.
        let mut other = ledger.pool.begin().await.unwrap();
        for sql in [
            "SET TRANSACTION ISOLATION LEVEL SERIALIZABLE".to_owned(),
            format!("SELECT count(*) FROM \"{}\".ledger", ledger.schema),
            format!("INSERT INTO \"{}\".ledger VALUES ('theirs')", ledger.schema),
        ] {
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                .execute(&mut *other)
                .await
                .unwrap();
        }
        other.commit().await.unwrap();
        paused.resume();
        rolled_back(&first.await.unwrap(), &store, key).await;
        assert_eq!(ledger.notes().await, ["theirs"]);

        let retry = request().send(addr).await;
        assert_eq!(retry.status, 201, "{retry:?}");
        assert_eq!(retry.header("idempotent-replayed"), None);
        assert_eq!(ledger.notes().await, ["mine", "theirs"]);
        let replay = request().send(addr).await;
        assert_eq!(replay.header("idempotent-replayed"), Some("true"));
        assert_eq!(ledger.notes().await, ["mine", "theirs"]);
    }
}

/// On SQLite, a deferred foreign key that the `COMMIT` of the handler's
/// transaction finds broken fails the commit and leaves the transaction
/// open, which idem then rolls back: as on PostgreSQL, the client is told
/// its changes were rolled back, and a retry runs the operation again,
/// once.
mod a_commit_sqlite_refuses_was_rolled_back {
    use super::*;

    #[derive(serde::Deserialize, serde::Serialize)]
    struct Line {
        order: i64,
    }

    #[idempotent(scope = "line.add", fields(order))]
    async fn add(op: Operation, Json(line): Json<Line>) -> Result<(StatusCode, String), StatusCode> {
        let mut conn = op
            .sqlite_transaction()
            .await
            .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
        sqlx::query("INSERT INTO lines (order_id) VALUES (?1)")
            .bind(line.order)
            .execute(&mut *conn)
            .await
            .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
        Ok((StatusCode::CREATED, format!("line of {}", line.order)))
    }

    #[tokio::test]
    async fn sqlite_a_deferred_foreign_key() {
        let (store, _dir) = idem_testkit::sqlite_store().await;
        let pool = store.pool().clone();
        sqlx::raw_sql(
            "CREATE TABLE orders (id INTEGER PRIMARY KEY); \
             CREATE TABLE lines (order_id INTEGER NOT NULL \
             REFERENCES orders (id) DEFERRABLE INITIALLY DEFERRED)",
        )
        .execute(&pool)
        .await
        .unwrap();
        let app = Router::new()
            .route("/lines", post(add))
            .layer(Idem::new(store).single_tenant().layer());
        let addr = serve(app).await;
        let lines = || async {
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM lines")
                .fetch_one(&pool)
                .await
                .unwrap();
            n
        };
        let record = || async {
            let row: (String, Option<String>) =
                sqlx::query_as("SELECT state, lock_token FROM idempotency_keys WHERE key = 'k-line'")
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            row
        };
        let request = || post_req("/lines", r#"{"order":7}"#).key("k-line");
        for _ in 0..2 {
            let refused = request().send(addr).await;
            assert_eq!(refused.status, 503, "{refused:?}");
            assert_eq!(refused.problem(), "idempotency-store-unavailable");
            let detail = refused.json()["detail"].as_str().unwrap().to_owned();
            assert!(detail.contains("rolled back"), "{detail}");
            assert_eq!(lines().await, 0);
            let (state, token) = record().await;
            assert_ne!(state, "completed");
            assert_eq!(token, None, "a lock left that no execution holds");
        }

        sqlx::query("INSERT INTO orders (id) VALUES (7)")
            .execute(&pool)
            .await
            .unwrap();
        let retry = request().send(addr).await;
        assert_eq!(retry.status, 201, "{retry:?}");
        assert_eq!(retry.header("idempotent-replayed"), None);
        let replay = request().send(addr).await;
        assert_eq!(replay.header("idempotent-replayed"), Some("true"));
        assert_eq!(lines().await, 1);
    }
}
