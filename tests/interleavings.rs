//! Interleavings written on purpose: row locks held by a test connection
//! (PostgreSQL) pin the races of the record protocol that timing alone
//! rarely produces.

use idem::store::{RecordId, Reservation, ReserveRequest, StoredResponse};
use idem::IdempotencyStore;
use sqlx::Connection as _;
use std::time::Duration;

const LONG: Duration = Duration::from_secs(3600);

fn req<'a>(id: &'a RecordId, fp: &'a str, ttl: Duration) -> ReserveRequest<'a> {
    ReserveRequest {
        id,
        fingerprint: fp,
        token: idem_testkit::token(),
        ttl,
        lock_timeout: LONG,
    }
}

fn answer(tag: &str) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), "application/json".into())],
        body: Some(format!("{{\"id\":\"{tag}\"}}").into_bytes()),
    }
}

/// Waits until a statement starting with `prefix` on `table` waits for a row
/// lock, or until `done()` says the statement already finished.
async fn until_blocked_or_done(url: &str, table: &str, prefix: &str, done: impl Fn() -> bool) {
    let mut watcher = sqlx::PgConnection::connect(url).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
             AND query LIKE $1 AND query LIKE $2",
        )
        .bind(format!("{prefix}%"))
        .bind(format!("%{table}%"))
        .fetch_one(&mut watcher)
        .await
        .unwrap();
        if waiting > 0 || done() {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the statement neither blocked nor finished"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// An expired, completed record `id` with fingerprint `fp-a`.
async fn expired_record(store: &dyn IdempotencyStore, id: &RecordId) {
    let Reservation::Reserved(old) = store
        .reserve(req(id, "fp-a", Duration::from_millis(50)))
        .await
        .unwrap()
    else {
        panic!("expected a reservation")
    };
    store.complete(id, &old.token, &answer("old")).await.unwrap();
    // Wait for the TTL (a deadline of the database's clock), not for an ordering.
    tokio::time::sleep(Duration::from_millis(150)).await;
}

/// The winner's `statement` (on the record of `id`, bound to its key) runs
/// in a transaction of a test connection and stays uncommitted while the
/// loser's reservation of `id` with `fp` starts and waits for it; then the
/// winner commits. What the loser was answered.
async fn reserve_behind(
    url: &str,
    schema: &str,
    store: &std::sync::Arc<idem::PgStore>,
    statement: String,
    id: &RecordId,
    fp: &str,
) -> Reservation {
    let mut winner = sqlx::PgConnection::connect(url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut winner).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(statement))
        .bind(&id.key)
        .execute(&mut winner)
        .await
        .unwrap();
    let loser = {
        let (store, id, fp) = (store.clone(), id.clone(), fp.to_owned());
        tokio::spawn(async move { store.reserve(req(&id, &fp, LONG)).await })
    };
    until_blocked_or_done(url, schema, "SELECT p.fingerprint", || loser.is_finished()).await;
    sqlx::query("COMMIT").execute(&mut winner).await.unwrap();
    loser.await.unwrap().unwrap()
}

/// The janitor never waits on a row lock: a record that another
/// transaction holds (here `FOR KEY SHARE`, which a `DELETE` waits for) is
/// skipped, left to a later round. So it cannot wait while a new operation
/// reserves the key afresh and then delete the new record.
#[tokio::test]
async fn postgres_the_janitor_skips_a_record_another_transaction_holds() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let store = idem_testkit::pg_store_in(&url, &schema, 8).await;
    let id = RecordId::new("t", "s", "janitor-race");
    expired_record(&store, &id).await;

    let mut reader = sqlx::PgConnection::connect(&url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut reader).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT 1 FROM \"{schema}\".idempotency_keys WHERE key = 'janitor-race' FOR KEY SHARE"
    )))
    .execute(&mut reader)
    .await
    .unwrap();
    // A purge that waited would wait until the reader commits.
    let purged = tokio::time::timeout(Duration::from_secs(10), store.purge_expired(10))
        .await
        .expect("the purge waited for a row lock");
    assert_eq!(purged, Ok(0));
    sqlx::query("COMMIT").execute(&mut reader).await.unwrap();
    assert_eq!(store.purge_expired(10).await, Ok(1));
}

/// The janitor stopped in its `DELETE` (a row trigger waits for an
/// advisory lock a test connection holds), the expired record chosen and
/// locked; a new operation reserves the key meanwhile and waits for that
/// row. The purge deletes the expired record alone; the reservation then
/// takes the key afresh (attempt 1, a new operation), and the new record
/// survives: its owner completes it, and it replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_reservation_behind_the_janitors_delete_takes_the_key_afresh() {
    const ADVISORY: i64 = 77_001;
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let store = std::sync::Arc::new(idem_testkit::pg_store_in(&url, &schema, 8).await);
    let expired = RecordId::new("t", "s", "janitor-behind");
    expired_record(&*store, &expired).await;
    let mut holder = sqlx::PgConnection::connect(&url).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE FUNCTION \"{schema}\".hold() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN PERFORM pg_advisory_xact_lock_shared({ADVISORY}); RETURN OLD; END $$; \
         CREATE TRIGGER hold BEFORE DELETE ON \"{schema}\".idempotency_keys FOR EACH ROW \
         EXECUTE FUNCTION \"{schema}\".hold(); \
         SELECT pg_advisory_lock({ADVISORY})"
    )))
    .execute(&mut holder)
    .await
    .unwrap();
    let purging = {
        let store = store.clone();
        tokio::spawn(async move { store.purge_expired(10).await })
    };
    until_blocked_or_done(&url, &schema, "", || purging.is_finished()).await;
    assert!(!purging.is_finished(), "the purge did not stop in its DELETE");

    let reserving = {
        let (store, expired) = (store.clone(), expired.clone());
        tokio::spawn(async move { store.reserve(req(&expired, "fp-new", LONG)).await })
    };
    until_blocked_or_done(&url, &schema, "SELECT p.fingerprint", || reserving.is_finished()).await;
    assert!(
        !reserving.is_finished(),
        "the reservation did not wait for the purge's row"
    );
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT pg_advisory_unlock({ADVISORY})"
    )))
    .execute(&mut holder)
    .await
    .unwrap();
    assert_eq!(purging.await.unwrap(), Ok(1));
    let Reservation::Reserved(fresh) = reserving.await.unwrap().unwrap() else {
        panic!("an expired record must be taken afresh")
    };
    assert_eq!(fresh.attempt, 1);
    store
        .complete(&expired, &fresh.token, &answer("new"))
        .await
        .unwrap();
    assert_eq!(
        store.reserve(req(&expired, "fp-new", LONG)).await.unwrap(),
        Reservation::Completed(answer("new"))
    );
}

/// Two requests race for one expired record: the winner's takeover is not
/// committed yet when the loser's statement starts. The loser must be judged
/// on the winner's row (409 for the same body, 422 for another), never on
/// the expired row its statement first saw.
#[tokio::test]
async fn postgres_the_loser_of_a_race_for_an_expired_record_is_judged_on_the_winners_row() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let store = std::sync::Arc::new(idem_testkit::pg_store_in(&url, &schema, 8).await);
    for (case, loser_fp, expected) in [
        ("same-body", "fp-b", "in progress"),
        ("old-body", "fp-a", "mismatch"),
    ] {
        let key = format!("race-{case}");
        let id = RecordId::new("t", "s", &key);
        expired_record(&*store, &id).await;

        // The winner: a takeover of the expired record with body fp-b.
        let takeover = format!(
            "UPDATE \"{schema}\".idempotency_keys SET fingerprint = 'fp-b', state = 'in_progress', \
             lock_token = 'winner', lock_expires_at = now() + interval '1 hour', attempt = 1, \
             operation_id = 'op-winner', created_at = now(), expires_at = now() + interval '1 hour', \
             response_status = NULL, response_headers = NULL, response_body = NULL WHERE key = $1"
        );
        let got = reserve_behind(&url, &schema, &store, takeover, &id, loser_fp).await;
        let ok = match expected {
            "in progress" => matches!(got, Reservation::InProgress { .. }),
            _ => got == Reservation::Mismatch,
        };
        assert!(ok, "{case}: expected {expected}, got {got:?}");
    }
}

/// Two requests race for a fresh key: the winner's insert is not committed
/// yet when the loser's statement starts, so the loser's insert waits for
/// it. The loser is judged on the winner's row as committed: 409 while the
/// winner runs, the winner's answer once it is stored, and when the winner
/// released the key as failed, the loser continues its operation (attempt 2,
/// the same operation id), as a retry of the same request does.
#[tokio::test]
async fn postgres_the_loser_of_a_race_for_a_fresh_key_is_judged_on_the_winners_row() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let store = std::sync::Arc::new(idem_testkit::pg_store_in(&url, &schema, 8).await);
    for (case, state, token, lock, status) in [
        (
            "running",
            "in_progress",
            "'winner'",
            "now() + interval '1 hour'",
            "NULL",
        ),
        ("released", "in_progress", "NULL", "now()", "NULL"),
        (
            "completed",
            "completed",
            "NULL",
            "now() + interval '1 hour'",
            "201",
        ),
    ] {
        let key = format!("fresh-race-{case}");
        let id = RecordId::new("t", "s", &key);
        let insert = format!(
            "INSERT INTO \"{schema}\".idempotency_keys (tenant, scope, key, fingerprint, state, \
             operation_id, lock_token, attempt, lock_expires_at, response_status, response_headers, \
             response_body, created_at, expires_at) VALUES ('t', 's', $1, 'fp-a', '{state}', 'op-winner', \
             {token}, 1, {lock}, {status}, '[]', 'won', now(), now() + interval '1 hour')"
        );
        let got = reserve_behind(&url, &schema, &store, insert, &id, "fp-a").await;
        match (case, got) {
            ("running", Reservation::InProgress { .. }) => {}
            ("released", Reservation::Reserved(lease))
                if lease.attempt == 2 && lease.operation_id == "op-winner" && !lease.takeover => {}
            ("completed", Reservation::Completed(stored))
                if stored.status == 201 && stored.body.as_deref() == Some(&b"won"[..]) => {}
            (case, got) => panic!("{case}: judged on the wrong row: {got:?}"),
        }
    }
}

// ---------------------------------------------------------------------------
// The interleaving harness.
//
// Every pair of protocol steps (reserve with the same body, reserve with
// another, takeover, complete, release, extend, checkpoint, purge) runs
// against each other from every state a record can be in: step A stops at
// each of its pause points, step B runs to one of its own points or to its
// end, then A goes on, then B. After every run the answers of both steps
// and the record must be those of running them one after the other, in an
// order the schedule allows (A first when A had committed before B began),
// on a model of the protocol. That one check holds the invariants: at most
// one live lease per key, a live lease's operation never changes, a
// completed record never changes, an expired record behaves as absent, and
// no request is answered from a stale row.
// ---------------------------------------------------------------------------

use idem_runtime::pause;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Initial {
    Absent,
    Live,
    Stale,
    Released,
    Completed,
    ExpiredCompleted,
    ExpiredStale,
    ExpiredLive,
}

const INITIALS: [Initial; 8] = [
    Initial::Absent,
    Initial::Live,
    Initial::Stale,
    Initial::Released,
    Initial::Completed,
    Initial::ExpiredCompleted,
    Initial::ExpiredStale,
    Initial::ExpiredLive,
];

/// A step. Reserves use their executor's own token; the fenced steps use
/// the token of the initial holder, `h0`.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Step {
    ReserveSame,
    ReserveOther,
    Complete,
    Release,
    Reject,
    Extend,
    Checkpoint,
    Purge,
}

const STEPS: [Step; 8] = [
    Step::ReserveSame,
    Step::ReserveOther,
    Step::Complete,
    Step::Release,
    Step::Reject,
    Step::Extend,
    Step::Checkpoint,
    Step::Purge,
];

/// What a step answered, with tokens and ids reduced to who they belong to.
#[derive(Clone, Debug, PartialEq)]
enum Out {
    Reserved {
        attempt: i64,
        takeover: bool,
        new_operation: bool,
        recovery_point: Option<String>,
    },
    Completed(String),
    InProgress,
    Mismatch,
    Done,
    LockLost,
    Purged(u64),
    /// The store failed: never right in these schedules.
    Failed(String),
}

/// A record as the model (and the check) sees it.
#[derive(Clone, Debug, PartialEq)]
struct Rec {
    fingerprint: String,
    /// The stored body, once completed.
    completed: Option<String>,
    holder: Option<String>,
    attempt: i64,
    taken_over: bool,
    new_operation: bool,
    recovery_point: Option<String>,
    lock_live: bool,
    expired: bool,
}

fn initial_rec(initial: Initial) -> Option<Rec> {
    let (completed, holder, lock_live, expired) = match initial {
        Initial::Absent => return None,
        Initial::Live => (None, Some("h0"), true, false),
        Initial::Stale => (None, Some("h0"), false, false),
        Initial::Released => (None, None, false, false),
        Initial::Completed => (Some("done"), None, false, false),
        Initial::ExpiredCompleted => (Some("done"), None, false, true),
        Initial::ExpiredStale => (None, Some("h0"), false, true),
        Initial::ExpiredLive => (None, Some("h0"), true, true),
    };
    Some(Rec {
        fingerprint: "F".into(),
        completed: completed.map(Into::into),
        holder: holder.map(Into::into),
        attempt: 1,
        taken_over: false,
        new_operation: false,
        // A first attempt with no recovery point yet: a rejection frees it.
        recovery_point: None,
        lock_live,
        expired,
    })
}

/// The protocol, one step at a time (the store trait's documented rules).
fn model(state: &mut Option<Rec>, step: Step, me: &str) -> Out {
    let fenced = |state: &mut Option<Rec>, change: &dyn Fn(&mut Rec)| match state {
        Some(r) if r.completed.is_none() && r.holder.as_deref() == Some("h0") => {
            change(r);
            Out::Done
        }
        _ => Out::LockLost,
    };
    match step {
        Step::ReserveSame | Step::ReserveOther => {
            let fp = if step == Step::ReserveSame { "F" } else { "G" };
            let fresh = Rec {
                fingerprint: fp.into(),
                completed: None,
                holder: Some(me.into()),
                attempt: 1,
                taken_over: false,
                new_operation: true,
                recovery_point: None,
                lock_live: true,
                expired: false,
            };
            let Some(r) = state.as_mut() else {
                *state = Some(fresh);
                return reserved(state);
            };
            let in_progress = r.completed.is_none();
            let live = in_progress && r.lock_live;
            if gone(r) {
                *state = Some(fresh);
                return reserved(state);
            }
            if let Some(body) = &r.completed {
                return if r.fingerprint == fp {
                    Out::Completed(body.clone())
                } else {
                    Out::Mismatch
                };
            }
            if live {
                return if r.fingerprint == fp {
                    Out::InProgress
                } else {
                    Out::Mismatch
                };
            }
            if r.fingerprint != fp {
                return Out::Mismatch;
            }
            r.taken_over = r.holder.is_some();
            r.holder = Some(me.into());
            r.attempt += 1;
            r.lock_live = true;
            reserved(state)
        }
        Step::Complete => fenced(state, &|r| {
            r.completed = Some("b-h0".into());
            r.holder = None;
            r.lock_live = false;
            // Kept a whole TTL from its completion.
            r.expired = false;
        }),
        Step::Release => fenced(state, &|r| {
            r.holder = None;
            r.lock_live = false;
        }),
        // No record at all: the key is free, which is what a rejection
        // asks, so it is done (a try again after a lost answer finds this).
        Step::Reject if state.is_none() => Out::Done,
        Step::Reject => {
            let first = state
                .as_ref()
                .is_some_and(|r| r.attempt == 1 && r.recovery_point.is_none());
            let out = fenced(state, &|r| {
                r.holder = None;
                r.lock_live = false;
            });
            if out == Out::Done && first {
                *state = None;
            }
            out
        }
        Step::Extend => fenced(state, &|r| r.lock_live = true),
        Step::Checkpoint => fenced(state, &|r| r.recovery_point = Some("rp-new".into())),
        Step::Purge => match state {
            Some(r) if gone(r) => {
                *state = None;
                Out::Purged(1)
            }
            _ => Out::Purged(0),
        },
    }
}

/// As if absent, and purgeable: past its TTL and completed. (A record in
/// progress is kept a whole TTL past its lock deadline; in these schedules,
/// with TTLs of an hour, that never comes.)
fn gone(r: &Rec) -> bool {
    r.expired && r.completed.is_some()
}

fn reserved(state: &Option<Rec>) -> Out {
    let r = state.as_ref().unwrap();
    Out::Reserved {
        attempt: r.attempt,
        takeover: r.taken_over,
        new_operation: r.new_operation,
        recovery_point: r.recovery_point.clone(),
    }
}

/// A real store under the harness, and the SQL to set and read its records.
struct Subject {
    store: std::sync::Arc<dyn IdempotencyStore>,
    pool: SubjectPool,
    table: String,
    /// The points each step can stop at.
    sqlite: bool,
}

enum SubjectPool {
    Pg(sqlx::PgPool),
    Sqlite(sqlx::SqlitePool),
    /// The memory store itself, whose records its test API sets and reads.
    Memory(std::sync::Arc<idem::MemoryStore>),
}

/// A time `ms` from the database's now, in the dialect's unit.
fn at(sqlite: bool, ms: i64) -> String {
    if sqlite {
        format!("(CAST(unixepoch('subsec') * 1000 AS INTEGER) + ({ms}))")
    } else {
        format!("(now() + ({ms} * interval '1 millisecond'))")
    }
}

impl Subject {
    async fn exec(&self, sql: String) {
        match &self.pool {
            SubjectPool::Pg(p) => sqlx::query(sqlx::AssertSqlSafe(sql)).execute(p).await.map(|_| ()),
            SubjectPool::Sqlite(p) => sqlx::query(sqlx::AssertSqlSafe(sql)).execute(p).await.map(|_| ()),
            SubjectPool::Memory(_) => unreachable!("no SQL in memory"),
        }
        .unwrap();
    }

    async fn delete(&self, key: &str) {
        match &self.pool {
            SubjectPool::Memory(m) => m.set(&RecordId::new("t", "harness", key), None),
            _ => {
                self.exec(format!("DELETE FROM {} WHERE key = '{key}'", self.table))
                    .await
            }
        }
    }

    async fn set(&self, key: &str, initial: Initial) {
        self.delete(key).await;
        let Some(r) = initial_rec(initial) else { return };
        if let SubjectPool::Memory(m) = &self.pool {
            let view = idem_runtime::store::RecordView {
                fingerprint: r.fingerprint,
                token: r.holder,
                attempt: 1,
                operation_id: "op0".into(),
                recovery_point: None,
                lock_live: r.lock_live,
                expired: r.expired,
                body: r.completed.map(String::into_bytes),
            };
            m.set(&RecordId::new("t", "harness", key), Some(view));
            return;
        }
        let hour = 3_600_000;
        let lock = if r.lock_live { hour } else { -2000 };
        let expires = if r.expired { -1000 } else { hour };
        let (state, status, body) = match &r.completed {
            Some(b) => ("completed", "201", format!("'{b}'")),
            None => ("in_progress", "NULL", "NULL".into()),
        };
        let body = if self.sqlite {
            format!("CAST({body} AS BLOB)")
        } else {
            format!("convert_to({body}, 'UTF8')")
        };
        let holder = r.holder.map_or("NULL".into(), |h| format!("'{h}'"));
        self.exec(format!(
            "INSERT INTO {t} (tenant, scope, key, fingerprint, state, operation_id, lock_token, attempt, \
             taken_over, lock_expires_at, recovery_point, response_status, response_headers, response_body, \
             created_at, expires_at) VALUES ('t', 'harness', '{key}', 'F', '{state}', 'op0', {holder}, 1, 0, \
             {lock}, NULL, {status}, '[]', {body}, {created}, {expires})",
            t = self.table,
            lock = at(self.sqlite, lock),
            created = at(self.sqlite, -hour),
            expires = at(self.sqlite, expires),
        ))
        .await;
    }

    async fn read(&self, key: &str) -> Option<Rec> {
        if let SubjectPool::Memory(m) = &self.pool {
            return m.view(&RecordId::new("t", "harness", key)).map(|v| Rec {
                fingerprint: v.fingerprint,
                completed: v.body.map(|b| String::from_utf8(b).unwrap()),
                holder: v.token,
                attempt: i64::from(v.attempt),
                // Not kept by the memory store: its lease says it
                // (`Out::Reserved`), and its hand-back is told it.
                taken_over: false,
                new_operation: v.operation_id != "op0",
                recovery_point: v.recovery_point,
                lock_live: v.lock_live,
                expired: v.expired,
            });
        }
        let sql = format!(
            "SELECT fingerprint, state, lock_token, CAST(attempt AS BIGINT) AS attempt, \
             CAST(taken_over AS BIGINT) AS taken_over, operation_id, recovery_point, response_body, \
             CASE WHEN lock_expires_at > {now} THEN 1 ELSE 0 END AS lock_live, \
             CASE WHEN expires_at <= {now} THEN 1 ELSE 0 END AS expired \
             FROM {t} WHERE key = '{key}'",
            now = at(self.sqlite, 0),
            t = self.table,
        );
        macro_rules! rec {
            ($row:expr) => {{
                use sqlx::Row as _;
                let row = $row;
                let state: String = row.get("state");
                let body: Option<Vec<u8>> = row.get("response_body");
                Rec {
                    fingerprint: row.get("fingerprint"),
                    completed: (state == "completed")
                        .then(|| String::from_utf8(body.unwrap_or_default()).unwrap()),
                    holder: row.get("lock_token"),
                    attempt: row.get("attempt"),
                    taken_over: row.get::<i64, _>("taken_over") != 0,
                    new_operation: row.get::<String, _>("operation_id") != "op0",
                    recovery_point: row.get("recovery_point"),
                    lock_live: row.get::<i32, _>("lock_live") != 0 && state == "in_progress",
                    expired: row.get::<i32, _>("expired") != 0,
                }
            }};
        }
        match &self.pool {
            SubjectPool::Pg(p) => sqlx::query(sqlx::AssertSqlSafe(sql))
                .fetch_optional(p)
                .await
                .unwrap()
                .map(|row| rec!(row)),
            SubjectPool::Sqlite(p) => sqlx::query(sqlx::AssertSqlSafe(sql))
                .fetch_optional(p)
                .await
                .unwrap()
                .map(|row| rec!(row)),
            SubjectPool::Memory(_) => unreachable!("read above"),
        }
    }

    /// `rec` as this store keeps it: the memory store keeps no
    /// `taken_over` flag.
    fn as_kept(&self, rec: Option<Rec>) -> Option<Rec> {
        match &self.pool {
            SubjectPool::Memory(_) => rec.map(|r| Rec {
                taken_over: false,
                ..r
            }),
            _ => rec,
        }
    }

    /// The points where `step` can stop, in order.
    fn points(&self, step: Step) -> Vec<&'static str> {
        match step {
            Step::ReserveSame | Step::ReserveOther if self.sqlite => vec![
                pause::SQLITE_RESERVE_AFTER_PEEK,
                pause::SQLITE_RESERVE_BEFORE_COMMIT,
                pause::RESERVE_AFTER,
            ],
            Step::ReserveSame | Step::ReserveOther => vec![pause::RESERVE_AFTER],
            Step::Complete => vec![pause::COMPLETE_AFTER],
            Step::Release => vec![pause::RELEASE_AFTER],
            Step::Reject => vec![pause::REJECT_AFTER],
            Step::Extend => vec![pause::EXTEND_AFTER],
            Step::Checkpoint => vec![pause::CHECKPOINT_AFTER],
            Step::Purge => vec![pause::PURGE_AFTER],
        }
    }

    /// What a pause point of step `step` is armed for.
    fn pause_key(&self, step: Step, key: &str) -> String {
        if step == Step::Purge {
            self.table.clone()
        } else {
            key.to_owned()
        }
    }
}

/// Whether a step stopped at `point` has committed all it writes.
fn committed(point: &str) -> bool {
    point.ends_with(".after")
}

/// Whether a step stopped at `point` holds SQLite's write lock.
fn holds_write_lock(point: &str) -> bool {
    point == pause::SQLITE_RESERVE_BEFORE_COMMIT
}

async fn perform(store: &dyn IdempotencyStore, id: &RecordId, step: Step, me: &'static str) -> Out {
    let fenced = |r: Result<(), idem::StoreError>| match r {
        Ok(()) => Out::Done,
        Err(idem::StoreError::LockLost) => Out::LockLost,
        Err(e) => Out::Failed(e.to_string()),
    };
    match step {
        Step::ReserveSame | Step::ReserveOther => {
            let fp = if step == Step::ReserveSame { "F" } else { "G" };
            let request = ReserveRequest {
                id,
                fingerprint: fp,
                token: me,
                ttl: LONG,
                lock_timeout: LONG,
            };
            let reservation = match store.reserve(request).await {
                Ok(r) => r,
                Err(e) => return Out::Failed(e.to_string()),
            };
            match reservation {
                Reservation::Reserved(l) => Out::Reserved {
                    attempt: i64::from(l.attempt),
                    takeover: l.takeover,
                    new_operation: l.operation_id != "op0",
                    recovery_point: l.recovery_point,
                },
                Reservation::Completed(r) => Out::Completed(String::from_utf8(r.body.unwrap()).unwrap()),
                Reservation::InProgress { retry_after } if retry_after.is_zero() => {
                    Out::Failed("in progress on a lock that ran out".into())
                }
                Reservation::InProgress { .. } => Out::InProgress,
                Reservation::Mismatch => Out::Mismatch,
            }
        }
        Step::Complete => fenced(store.complete(id, "h0", &answer_of("b-h0")).await),
        Step::Release => fenced(store.release(id, "h0").await),
        Step::Reject => fenced(store.reject(id, "h0").await),
        Step::Extend => fenced(store.extend_lock(id, "h0", LONG).await),
        Step::Checkpoint => fenced(store.checkpoint(id, "h0", "rp-new").await),
        Step::Purge => match store.purge_expired(100).await {
            Ok(n) => Out::Purged(n),
            Err(e) => Out::Failed(e.to_string()),
        },
    }
}

fn answer_of(body: &str) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![],
        body: Some(body.as_bytes().to_vec()),
    }
}

/// A step running in its own task, maybe stopped at a pause point.
struct Running {
    task: tokio::task::JoinHandle<Out>,
    pause: Option<pause::Pause>,
    stopped: bool,
}

async fn launch(
    s: &Subject,
    id: &RecordId,
    step: Step,
    me: &'static str,
    point: Option<&'static str>,
) -> Running {
    let mut pause = point.map(|p| pause::arm(p, &s.pause_key(step, &id.key)));
    let task = {
        let (store, id) = (s.store.clone(), id.clone());
        tokio::spawn(async move { perform(&*store, &id, step, me).await })
    };
    let mut stopped = false;
    if let Some(p) = pause.as_mut() {
        // Until it stops there, or ends without passing the point.
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            if p.is_reached() {
                stopped = true;
                break;
            }
            if task.is_finished() {
                // It never passed the point: disarm it, or the other step
                // would stop there.
                pause = None;
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{step:?} neither stopped nor ended"
            );
            tokio::task::yield_now().await;
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    Running { task, pause, stopped }
}

impl Running {
    async fn finish(self) -> Out {
        if let Some(p) = self.pause {
            p.resume();
        }
        tokio::time::timeout(Duration::from_secs(20), self.task)
            .await
            .expect("the step ends")
            .unwrap()
    }
}

/// Runs every schedule on `s` and says how many ran.
async fn every_schedule(s: &Subject) -> usize {
    let mut runs = 0;
    let mut failures = Vec::new();
    for a in STEPS {
        for b in STEPS {
            for p in s.points(a) {
                let mut qs: Vec<Option<&'static str>> = s.points(b).into_iter().map(Some).collect();
                qs.push(None);
                for q in qs {
                    // Skip schedules that would wait on SQLite's write lock
                    // held by a stopped step (a deadlock of the schedule,
                    // not of the protocol).
                    let b_writes_first = q.is_none_or(|q| q != pause::SQLITE_RESERVE_AFTER_PEEK);
                    if holds_write_lock(p) && b_writes_first {
                        continue;
                    }
                    if q.is_some_and(holds_write_lock) && !committed(p) {
                        continue;
                    }
                    for initial in INITIALS {
                        runs += 1;
                        let key = format!("h{runs}");
                        let id = RecordId::new("t", "harness", &key);
                        s.set(&key, initial).await;
                        let ra = launch(s, &id, a, "tA", Some(p)).await;
                        let a_committed_first = ra.stopped && committed(p);
                        let rb = launch(s, &id, b, "tB", q).await;
                        let out_a = ra.finish().await;
                        let out_b = rb.finish().await;
                        let seen = s.read(&key).await;

                        let mut orders = vec![("A;B", true)];
                        if !a_committed_first {
                            orders.push(("B;A", false));
                        }
                        let ok = orders.iter().any(|&(_, a_first)| {
                            let mut m = initial_rec(initial);
                            let (ma, mb) = if a_first {
                                let ma = model(&mut m, a, "tA");
                                (ma, model(&mut m, b, "tB"))
                            } else {
                                let mb = model(&mut m, b, "tB");
                                (model(&mut m, a, "tA"), mb)
                            };
                            ma == out_a && mb == out_b && s.as_kept(m) == seen
                        });
                        if !ok {
                            failures.push(format!(
                                "{initial:?}: A={a:?} at {p}, B={b:?} to {q:?}: A got {out_a:?}, B got {out_b:?}, \
                                 record {seen:?}"
                            ));
                        }
                        s.delete(&key).await;
                    }
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {runs} schedules broke the protocol:\n{}",
        failures.len(),
        failures.join("\n")
    );
    runs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_every_pair_of_steps_at_every_pause_point_is_linearizable() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let store = idem_testkit::pg_store_in(&url, &schema, 8).await;
    let s = Subject {
        pool: SubjectPool::Pg(store.pool().clone()),
        store: std::sync::Arc::new(store),
        table: format!("\"{schema}\".\"idempotency_keys\""),
        sqlite: false,
    };
    let runs = every_schedule(&s).await;
    eprintln!("postgres: {runs} schedules");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_every_pair_of_steps_at_every_pause_point_is_linearizable() {
    let (store, _dir) = idem_testkit::sqlite_store().await;
    let s = Subject {
        pool: SubjectPool::Sqlite(store.pool().clone()),
        store: std::sync::Arc::new(store),
        table: "\"idempotency_keys\"".into(),
        sqlite: true,
    };
    let runs = every_schedule(&s).await;
    eprintln!("sqlite: {runs} schedules");
}

/// The memory store, whose steps are each one change under its shard's
/// lock, judged by the same model through the same schedules.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_every_pair_of_steps_at_every_pause_point_is_linearizable() {
    let store = std::sync::Arc::new(idem::MemoryStore::new());
    let s = Subject {
        pool: SubjectPool::Memory(store.clone()),
        store,
        // What its purge's pause point is armed for.
        table: String::new(),
        sqlite: false,
    };
    let runs = every_schedule(&s).await;
    eprintln!("memory: {runs} schedules");
}

/// A hand-back of a fresh reservation that never ran deletes its record
/// only while it is the first attempt with no recovery point: a checkpoint
/// committed while the hand-back's `DELETE` waits on the row (a test
/// connection holds it) makes the `DELETE` judge the row again and keep
/// it; it goes back released, its recovery point kept.
#[tokio::test]
async fn postgres_a_checkpoint_committed_while_a_hand_back_waits_keeps_the_record() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let store = std::sync::Arc::new(idem_testkit::pg_store_in(&url, &schema, 4).await);
    let id = RecordId::new("t", "s", "hand-back-race");
    let Reservation::Reserved(lease) = store.reserve(req(&id, "fp", LONG)).await.unwrap() else {
        panic!("a fresh key is taken")
    };
    let mut checkpointer = sqlx::PgConnection::connect(&url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut checkpointer).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE \"{schema}\".idempotency_keys SET recovery_point = 'charged' WHERE key = 'hand-back-race'"
    )))
    .execute(&mut checkpointer)
    .await
    .unwrap();
    let handing_back = {
        let (store, id, token) = (store.clone(), id.clone(), lease.token.clone());
        tokio::spawn(async move { store.hand_back(&id, &token, false).await })
    };
    until_blocked_or_done(&url, &schema, "DELETE", || handing_back.is_finished()).await;
    sqlx::query("COMMIT").execute(&mut checkpointer).await.unwrap();
    handing_back.await.unwrap().unwrap();
    let row: Option<(Option<String>, Option<String>, i32)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT lock_token, recovery_point, attempt FROM \"{schema}\".idempotency_keys WHERE key = 'hand-back-race'"
    )))
    .fetch_optional(&mut checkpointer)
    .await
    .unwrap();
    assert_eq!(
        row,
        Some((None, Some("charged".to_owned()), 1)),
        "the checkpointed record is kept, released"
    );
    let Reservation::Reserved(next) = store.reserve(req(&id, "fp", LONG)).await.unwrap() else {
        panic!("the released record is continued")
    };
    assert_eq!(
        (next.attempt, next.recovery_point.as_deref()),
        (2, Some("charged"))
    );
}
