//! The PostgreSQL store's performance machinery under the interleavings
//! that can happen: the answers and running executions it knows in memory
//! (`with_replay_cache`), and the lookups and completions it groups into
//! one statement. Each test orders its race with pause points, or with row
//! and table locks held (or backends terminated) by a test connection; the
//! waits that remain are for what the database says (an expiry, a lock
//! deadline, a backend waiting), never for an ordering.

use idem::store::{RecordId, Reservation, ReserveRequest, StoredResponse};
use idem::{IdempotencyStore, StoreError};
use idem_testkit::records::{insert_uncommitted, pg_hold_row, pg_row, pg_table, req, reserve, take};
use std::time::{Duration, Instant};

const LONG: Duration = Duration::from_secs(3600);

fn response(tag: &str) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), "application/json".into())],
        body: Some(format!("{{\"id\":\"{tag}\"}}").into_bytes()),
    }
}

fn schema_of(store: &idem::PgStore) -> String {
    pg_table(store).split('.').next().unwrap().to_owned()
}

/// Until the database says `cond` (SQL on the row of `id`) holds: a
/// deadline of the database's clock, not an ordering.
async fn until_db(store: &idem::PgStore, id: &RecordId, cond: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !db_says(store.pool(), store, id, cond).await {
        assert!(Instant::now() < deadline, "{cond} never held");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Whether `cond` (SQL on the row of `id`) holds now, asked on `pool`.
async fn db_says(pool: &sqlx::PgPool, store: &idem::PgStore, id: &RecordId, cond: &str) -> bool {
    let holds: Option<bool> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT {cond} FROM {} WHERE tenant = $1 AND scope = $2 AND key = $3",
        pg_table(store)
    )))
    .bind(&id.tenant)
    .bind(&id.scope)
    .bind(&id.key)
    .fetch_optional(pool)
    .await
    .unwrap();
    holds == Some(true)
}

/// A store in a schema of its own, with `connections` and answers kept
/// for `keep`; `None` without PostgreSQL.
async fn fresh_store(connections: u32, keep: Duration) -> Option<(String, String, idem::PgStore)> {
    let url = idem_testkit::pg_url()?;
    let schema = idem_testkit::pg_schema(&url).await;
    let store = idem_testkit::pg_store_in(&url, &schema, connections)
        .await
        .with_replay_cache(keep);
    Some((url, schema, store))
}

async fn knowing_pair(url: &str) -> (String, idem::PgStore, idem::PgStore) {
    let schema = idem_testkit::pg_schema(url).await;
    let a = idem_testkit::pg_store_in(url, &schema, 4)
        .await
        .with_replay_cache(LONG);
    let b = idem_testkit::pg_store_in(url, &schema, 4)
        .await
        .with_replay_cache(LONG);
    (schema, a, b)
}

/// A store that comes back to its table through `with_table` after another
/// one (named the same way) shares what is known of it again: an execution
/// reserved through the first and completed through the second is
/// replayed, never answered 409 from a map the completion never saw.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_with_table_back_to_the_same_table_shares_what_is_known() {
    let Some((_, schema, a)) = fresh_store(4, LONG).await else {
        return;
    };
    let other = a.clone().with_table(Some(&schema), "other_keys").unwrap();
    other.migrate().await.unwrap();
    let back = other.with_table(Some(&schema), "idempotency_keys").unwrap();
    let id = RecordId::new("t", "tables", idem_testkit::unique("k"));
    let lease = take(&a, &id, "fp", LONG, LONG).await;
    back.complete(&id, &lease.token, &response("done")).await.unwrap();
    assert_eq!(
        reserve(&a, &id, "fp", LONG, LONG).await,
        Reservation::Completed(response("done"))
    );
    // And another table's map is its own.
    let there = RecordId::new("t", "tables", idem_testkit::unique("k"));
    let elsewhere = take(&a, &there, "fp", LONG, LONG).await;
    let fresh = reserve(
        &back.clone().with_table(Some(&schema), "other_keys").unwrap(),
        &there,
        "fp",
        LONG,
        LONG,
    )
    .await;
    assert!(matches!(fresh, Reservation::Reserved(_)), "{fresh:?}");
    drop(elsewhere);
}

// ---------------------------------------------------------------------------
// 1. Kept answers vs expiry, purge, and a new operation (another process)
// ---------------------------------------------------------------------------

/// A kept answer (bound: an hour) is never replayed once its record has
/// expired, was purged, and another process took the key for a new
/// operation and completed it: this process must replay the new answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_kept_answer_after_expiry_purge_and_new_operation() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let (_schema, a, b) = knowing_pair(&url).await;
    let id = RecordId::new("t", "kept", idem_testkit::unique("k"));
    let ttl = Duration::from_millis(600);
    let old = take(&a, &id, "fp", ttl, LONG).await;
    a.complete(&id, &old.token, &response("old")).await.unwrap();
    // Read (and so kept) by a lookup.
    assert_eq!(
        reserve(&a, &id, "fp", ttl, LONG).await,
        Reservation::Completed(response("old"))
    );
    assert_eq!(reserve(&a, &id, "other", ttl, LONG).await, Reservation::Mismatch);
    until_db(&a, &id, "expires_at <= now()").await;
    // The janitor purges it; the other process takes the key afresh.
    let purged = b.purge_expired(100).await.unwrap();
    assert!(purged >= 1);
    let new = take(&b, &id, "fp2", LONG, LONG).await;
    assert_eq!(new.attempt, 1);
    // This process: the new operation's in-progress record.
    let r = reserve(&a, &id, "fp2", LONG, LONG).await;
    assert!(matches!(r, Reservation::InProgress { .. }), "{r:?}");
    let r = reserve(&a, &id, "fp", LONG, LONG).await;
    assert_eq!(r, Reservation::Mismatch);
    b.complete(&id, &new.token, &response("new")).await.unwrap();
    assert_eq!(
        reserve(&a, &id, "fp2", LONG, LONG).await,
        Reservation::Completed(response("new"))
    );
}

// ---------------------------------------------------------------------------
// 2. Running executions vs release, takeover elsewhere, heartbeats
// ---------------------------------------------------------------------------

/// This process's execution is released as failed (infra failure): the
/// retry with the same request really retries (attempt 2), through the
/// store or a clone with another bound, never a 409 from memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_release_then_retry_is_not_a_409_from_memory() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let (_schema, a, _b) = knowing_pair(&url).await;
    let short = a.clone().with_replay_cache(Duration::from_millis(1));
    let id = RecordId::new("t", "rel", idem_testkit::unique("k"));
    let lease = take(&a, &id, "fp", LONG, Duration::from_secs(30)).await;
    assert!(matches!(
        reserve(&a, &id, "fp", LONG, LONG).await,
        Reservation::InProgress { .. }
    ));
    short.release(&id, &lease.token).await.unwrap();
    let again = take(&a, &id, "fp", LONG, Duration::from_secs(30)).await;
    assert_eq!(again.attempt, 2);
    // And a hand back through a clone: the key is free for a new one.
    let id2 = RecordId::new("t", "rel", idem_testkit::unique("k2"));
    let l2 = take(&a, &id2, "fp", LONG, Duration::from_secs(30)).await;
    short.hand_back(&id2, &l2.token, false).await.unwrap();
    assert_eq!(take(&a, &id2, "other", LONG, LONG).await.attempt, 1);
}

/// This process's execution lost its lock (its deadline passed) and
/// another process took over and completed: this process replays the
/// other's answer, and this execution is fenced out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_takeover_elsewhere_then_replay_here() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let (_schema, a, b) = knowing_pair(&url).await;
    let id = RecordId::new("t", "over", idem_testkit::unique("k"));
    let lock = Duration::from_millis(400);
    let mine = take(&a, &id, "fp", LONG, lock).await;
    assert!(matches!(
        reserve(&a, &id, "fp", LONG, lock).await,
        Reservation::InProgress { .. }
    ));
    until_db(&a, &id, "lock_expires_at <= now()").await;
    let theirs = take(&b, &id, "fp", LONG, LONG).await;
    assert!(theirs.is_takeover());
    // Here: the other's live lock.
    assert!(matches!(
        reserve(&a, &id, "fp", LONG, lock).await,
        Reservation::InProgress { .. }
    ));
    assert_eq!(
        a.extend_lock(&id, &mine.token, lock).await,
        Err(StoreError::LockLost)
    );
    b.complete(&id, &theirs.token, &response("theirs")).await.unwrap();
    assert_eq!(
        reserve(&a, &id, "fp", LONG, lock).await,
        Reservation::Completed(response("theirs"))
    );
    assert_eq!(
        a.complete(&id, &mine.token, &response("mine")).await,
        Err(StoreError::LockLost)
    );
    assert_eq!(
        pg_row(&a, &id).await.unwrap().2.as_deref(),
        Some("{\"id\":\"theirs\"}")
    );
}

/// A heartbeat that the store gave up on (its timeout) while the lock was
/// being taken over: the entry kept must not outlive the database's lock
/// deadline (a 409 from memory past it, where the database would let the
/// request take over).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_heartbeat_given_up_keeps_no_entry_past_the_deadline() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let a = idem_testkit::pg_store_in(&url, &schema, 4)
        .await
        .with_replay_cache(LONG)
        .with_timeout(Duration::from_millis(300));
    let id = RecordId::new("t", "beat", idem_testkit::unique("k"));
    let lock = Duration::from_millis(800);
    let mine = take(&a, &id, "fp", LONG, lock).await;
    // Hold the row: the heartbeat waits, and is given up on.
    let holders = sqlx::PgPool::connect(&url).await.unwrap();
    let holder = pg_hold_row(&holders, &a, &id).await;
    let beat = a.extend_lock(&id, &mine.token, lock).await;
    assert!(matches!(beat, Err(StoreError::Unavailable { .. })), "{beat:?}");
    holder.rollback().await.unwrap();
    // The heartbeat, still queued on the server, now writes; then the
    // deadline passes by the database's clock.
    until_db(&a, &id, "lock_expires_at <= now()").await;
    let r = reserve(&a, &id, "fp", LONG, lock).await;
    assert!(
        matches!(&r, Reservation::Reserved(l) if l.is_takeover()),
        "past the database's deadline the request takes over: {r:?}"
    );
}

// ---------------------------------------------------------------------------
// 3. Grouped lookups
// ---------------------------------------------------------------------------

fn lookup_id(tenant: &str, scope: &str, k: &str) -> RecordId {
    RecordId::new(tenant, scope, k)
}

async fn hold_the_lookup_turns(
    store: &idem::PgStore,
) -> (
    [idem_runtime::pause::Pause; 2],
    [tokio::task::JoinHandle<Result<Reservation, StoreError>>; 2],
) {
    let mut pauses = Vec::new();
    let mut tasks = Vec::new();
    for k in ["turn-1", "turn-2"] {
        let id = RecordId::new("t", "turns", idem_testkit::unique(k));
        let lease = take(store, &id, "fp", LONG, LONG).await;
        store.complete(&id, &lease.token, &response(k)).await.unwrap();
        let mut pause = idem_runtime::pause::arm(idem_runtime::pause::RESERVE_TURN, &id.key);
        tasks.push(reserve_in_task(store, &id, "fp"));
        tokio::time::timeout(Duration::from_secs(10), pause.reached())
            .await
            .expect("the lookup never took a turn");
        pauses.push(pause);
    }
    let (Ok(pauses), Ok(tasks)) = (pauses.try_into(), tasks.try_into()) else {
        unreachable!()
    };
    (pauses, tasks)
}

fn reserve_in_task(
    store: &idem::PgStore,
    id: &RecordId,
    fingerprint: &str,
) -> tokio::task::JoinHandle<Result<Reservation, StoreError>> {
    let (store, id, fingerprint) = (store.clone(), id.clone(), fingerprint.to_owned());
    tokio::spawn(async move { store.reserve(req(&id, &fingerprint, LONG, LONG)).await })
}

/// Like `reserve_in_task`, returning the token too.
fn reserve_in_task_tok(
    store: &idem::PgStore,
    id: &RecordId,
    fingerprint: &str,
    lock: Duration,
) -> (
    &'static str,
    tokio::task::JoinHandle<Result<Reservation, StoreError>>,
) {
    let token = idem_testkit::token();
    let (store, id, fingerprint) = (store.clone(), id.clone(), fingerprint.to_owned());
    (
        token,
        tokio::spawn(async move {
            store
                .reserve(ReserveRequest {
                    id: &id,
                    fingerprint: &fingerprint,
                    token,
                    ttl: LONG,
                    lock_timeout: lock,
                })
                .await
        }),
    )
}

/// What each reservation task was answered, with its token, in order.
async fn answers_of(
    tasks: Vec<(
        &'static str,
        tokio::task::JoinHandle<Result<Reservation, StoreError>>,
    )>,
) -> Vec<(&'static str, Result<Reservation, StoreError>)> {
    let mut answers = Vec::new();
    for (tok, t) in tasks {
        answers.push((
            tok,
            tokio::time::timeout(Duration::from_secs(20), t)
                .await
                .unwrap()
                .unwrap(),
        ));
    }
    answers
}

async fn until_lookups_waiting(store: &idem::PgStore, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.waiting_lookups() != n {
        assert!(Instant::now() < deadline, "{n} lookups never waited");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// One group: the same key under two tenants and two scopes (all fresh),
/// the same key twice (same tenant/scope), a completed record, another
/// tenant's completed record under the same key with another fingerprint,
/// and a record whose row a test connection holds FOR UPDATE. Each gets
/// its own answer, nothing is taken twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_lookup_group_tenants_scopes_duplicates_and_held_row() {
    let Some((url, _, store)) = fresh_store(8, Duration::ZERO).await else {
        return;
    };
    let k = idem_testkit::unique("same");
    let t1s1 = lookup_id("t1", "s1", &k);
    let t2s1 = lookup_id("t2", "s1", &k);
    let t1s2 = lookup_id("t1", "s2", &k);
    let done = lookup_id("t3", "s1", &k);
    let done_other = lookup_id("t4", "s1", &k);
    let held = lookup_id("t5", "s1", &k);
    for (id, tag) in [(&done, "done"), (&done_other, "other"), (&held, "held")] {
        let l = take(&store, id, "fp", LONG, LONG).await;
        store.complete(id, &l.token, &response(tag)).await.unwrap();
    }
    let holders = sqlx::PgPool::connect(&url).await.unwrap();
    let holder = pg_hold_row(&holders, &store, &held).await;
    let ([first, second], turns) = hold_the_lookup_turns(&store).await;
    let mut tasks = Vec::new();
    let plan: Vec<(&RecordId, &str)> = vec![
        (&t1s1, "fp"),
        (&t2s1, "fp"),
        (&t1s2, "fp"),
        (&t1s1, "fp"),
        (&done, "fp"),
        (&done_other, "fp-x"),
        (&held, "fp"),
    ];
    for (n, (id, fp)) in plan.iter().enumerate() {
        tasks.push(reserve_in_task_tok(&store, id, fp, LONG));
        until_lookups_waiting(&store, n + 1).await;
    }
    first.resume();
    let answers = answers_of(tasks).await;
    second.resume();
    for t in turns {
        let _ = t.await.unwrap();
    }
    holder.rollback().await.unwrap();
    for i in [0, 1, 2] {
        let (tok, a) = &answers[i];
        assert!(
            matches!(a, Ok(Reservation::Reserved(l)) if l.attempt == 1),
            "{i}: {a:?}"
        );
        let (state, token, _) = pg_row(&store, plan[i].0).await.unwrap();
        assert_eq!(
            (state.as_str(), token.as_deref()),
            ("in_progress", Some(*tok)),
            "{i}"
        );
    }
    assert!(
        matches!(answers[3].1, Ok(Reservation::InProgress { .. })),
        "{:?}",
        answers[3].1
    );
    assert_eq!(answers[4].1, Ok(Reservation::Completed(response("done"))));
    assert_eq!(answers[5].1, Ok(Reservation::Mismatch));
    assert_eq!(answers[6].1, Ok(Reservation::Completed(response("held"))));
}

/// A trigger named `name` that sleeps `seconds` on each row of `event`
/// (`INSERT` or `UPDATE`) for which `condition` holds (an audit trigger's
/// work, a synchronous standby: not a row lock).
async fn slow_trigger(store: &idem::PgStore, name: &str, event: &str, condition: &str, seconds: f64) {
    let table = pg_table(store);
    let schema = schema_of(store);
    for ddl in [
        format!(
            "CREATE FUNCTION {schema}.{name}() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN IF {condition} THEN PERFORM pg_sleep({seconds}); END IF; RETURN NEW; END $$"
        ),
        format!(
            "CREATE TRIGGER {name} BEFORE {event} ON {table} FOR EACH ROW EXECUTE FUNCTION {schema}.{name}()"
        ),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(ddl))
            .execute(store.pool())
            .await
            .unwrap();
    }
}

/// A trigger that sleeps `seconds` before inserting a key starting `slow`.
async fn slow_inserts(store: &idem::PgStore, seconds: f64) {
    slow_trigger(store, "slow_insert", "INSERT", "NEW.key LIKE 'slow%'", seconds).await;
}

/// A trigger that sleeps `seconds` when a key starting `slow` is completed.
async fn slow_completions(store: &idem::PgStore, seconds: f64) {
    slow_trigger(
        store,
        "slow_complete",
        "UPDATE",
        "NEW.key LIKE 'slow%' AND NEW.state = 'completed'",
        seconds,
    )
    .await;
}

/// Terminates the backend `pid` (`pg_terminate_backend`), from `watcher`;
/// whether it was there to terminate.
async fn terminate(watcher: &sqlx::PgPool, pid: i32) -> bool {
    sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(watcher)
        .await
        .unwrap()
}

async fn backend_of(pool: &sqlx::PgPool, schema: &str, like: &str, wait_event: Option<&str>) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let pid: Option<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity WHERE state = 'active' AND query LIKE $1 \
             AND query LIKE '%' || $2 || '%' AND ($3::text IS NULL OR wait_event = $3) LIMIT 1",
        )
        .bind(like)
        .bind(schema)
        .bind(wait_event)
        .fetch_optional(pool)
        .await
        .unwrap();
        if let Some(pid) = pid {
            return pid;
        }
        assert!(Instant::now() < deadline, "never saw {like} ({wait_event:?})");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// A group's statement ends in an error whose outcome is not known (its
/// backend terminated) after the read apart answered one of its lookups (a
/// replay): the group's task hands that lookup's key back, fenced by its
/// token, in the background, and `Idem::idle` waits for it, as for every
/// other give-back in the background, so that a process that exits at
/// `idle` leaves no key locked that nobody holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_idle_waits_for_a_groups_hand_back() {
    let Some((url, schema, store)) = fresh_store(8, LONG).await else {
        return;
    };
    slow_inserts(&store, 5.0).await;
    let idem = idem::Idem::new(store.clone());
    let slow = lookup_id("t", "idle", &idem_testkit::unique("slow"));
    let done = lookup_id("t", "idle", &idem_testkit::unique("done"));
    let l = take(&store, &done, "fp", LONG, LONG).await;
    store.complete(&done, &l.token, &response("done")).await.unwrap();
    let ([first, second], turns) = hold_the_lookup_turns(&store).await;
    let (_, slow_task) = reserve_in_task_tok(&store, &slow, "fp", LONG);
    until_lookups_waiting(&store, 1).await;
    let (_, replay) = reserve_in_task_tok(&store, &done, "fp", LONG);
    until_lookups_waiting(&store, 2).await;
    first.resume();
    let watcher = sqlx::PgPool::connect(&url).await.unwrap();
    let pid = backend_of(&watcher, &schema, "%idem-group%", Some("PgSleep")).await;
    // The replay is answered by the read apart meanwhile.
    let replayed = tokio::time::timeout(Duration::from_secs(5), replay)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(replayed, Ok(Reservation::Completed(response("done"))));
    let mut handed_back = idem_runtime::pause::arm(idem_runtime::pause::HAND_BACK_AFTER, &done.key);
    assert!(terminate(&watcher, pid).await);
    tokio::time::timeout(Duration::from_secs(10), handed_back.reached())
        .await
        .expect("the group never handed back the answered lookup's key");
    assert!(
        tokio::time::timeout(Duration::from_millis(300), idem.idle())
            .await
            .is_err(),
        "idle() resolved while the group's hand-back was under way"
    );
    handed_back.resume();
    tokio::time::timeout(Duration::from_secs(10), idem.idle())
        .await
        .expect("idle() after the hand-back");
    let _ = slow_task.await.unwrap();
    second.resume();
    for t in turns {
        let _ = t.await.unwrap();
    }
}

/// A group's statement (slow: an insert sleeps) is terminated
/// (`pg_terminate_backend`) after its fresh keys were inserted, uncommitted.
/// Each caller is answered either 503 or what the database holds; the
/// existing record is replayed; no key stays taken under a token whose
/// caller was told 503 once that caller hands it back (as the layer does),
/// and no key is taken twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_lookup_group_killed_mid_statement() {
    let Some((url, schema, store)) = fresh_store(8, LONG).await else {
        return;
    };
    slow_inserts(&store, 5.0).await;
    let fresh = lookup_id("t", "kill", &idem_testkit::unique("fresh"));
    let slow = lookup_id("t", "kill", &idem_testkit::unique("slow"));
    let done = lookup_id("t", "kill", &idem_testkit::unique("done"));
    let l = take(&store, &done, "fp", LONG, LONG).await;
    store.complete(&done, &l.token, &response("done")).await.unwrap();
    let ([first, second], turns) = hold_the_lookup_turns(&store).await;
    let mut tasks = Vec::new();
    for (n, id) in [&fresh, &slow, &done].iter().enumerate() {
        tasks.push(reserve_in_task_tok(&store, id, "fp", LONG));
        until_lookups_waiting(&store, n + 1).await;
    }
    first.resume();
    let watcher = sqlx::PgPool::connect(&url).await.unwrap();
    let pid = backend_of(&watcher, &schema, "%idem-group%", Some("PgSleep")).await;
    // The replay is answered by the read apart meanwhile.
    let (_, replay) = tasks.pop().unwrap();
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(5), replay)
            .await
            .unwrap()
            .unwrap(),
        Ok(Reservation::Completed(response("done")))
    );
    assert!(terminate(&watcher, pid).await);
    let answers = answers_of(tasks).await;
    second.resume();
    for t in turns {
        let _ = t.await.unwrap();
    }
    for ((tok, a), id) in answers.iter().zip([&fresh, &slow]) {
        match a {
            Ok(Reservation::Reserved(_)) => {
                let (state, token, _) = pg_row(&store, id).await.unwrap();
                assert_eq!((state.as_str(), token.as_deref()), ("in_progress", Some(*tok)));
            }
            Err(StoreError::Unavailable { .. }) => {
                // The layer hands it back, fenced by its token.
                let _ = store.hand_back(id, tok, true).await;
                if let Some((state, token, _)) = pg_row(&store, id).await {
                    assert!(
                        token.as_deref() != Some(*tok),
                        "a key stays locked under the token of a caller told 503: {state}"
                    );
                }
            }
            other => panic!("{other:?}"),
        }
    }
    // Retried: a key whose caller was told 503 is taken afresh (handed
    // back, or never committed); one whose caller holds it is in progress.
    for ((_, a), id) in answers.iter().zip([&fresh, &slow]) {
        let r = reserve(&store, id, "fp", LONG, LONG).await;
        match a {
            Ok(Reservation::Reserved(_)) => assert!(matches!(r, Reservation::InProgress { .. }), "{r:?}"),
            _ => assert!(
                matches!(&r, Reservation::Reserved(l) if !l.is_takeover()),
                "{r:?}"
            ),
        }
    }
}

// ---------------------------------------------------------------------------
// 4. Grouped completions
// ---------------------------------------------------------------------------

async fn until_waiting(store: &idem::PgStore, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.waiting_completions() != n {
        assert!(Instant::now() < deadline, "{n} completions never waited");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

fn complete_in_task(
    store: &idem::PgStore,
    id: &RecordId,
    token: &str,
    tag: &str,
) -> tokio::task::JoinHandle<Result<(), StoreError>> {
    let (store, id, token, tag) = (store.clone(), id.clone(), token.to_owned(), tag.to_owned());
    tokio::spawn(async move { store.complete(&id, &token, &response(&tag)).await })
}

/// A completion slow in the database (a trigger's work, not a row lock)
/// holds the store's turn to write no longer than `TURN_HELD_MAX`: the
/// completion of a free key that queued behind it is written while the
/// slow one still runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_slow_completion_holds_the_turn_no_longer_than_a_turn() {
    let Some((url, schema, store)) = fresh_store(8, Duration::ZERO).await else {
        return;
    };
    // One turn to write: the completion after the slow one queues.
    let store = store.with_completion_turns(1);
    slow_completions(&store, 5.0).await;
    let slow = RecordId::new("t", "turn", "slow-1");
    let fast = RecordId::new("t", "turn", "fast-1");
    let slow_lease = take(&store, &slow, "fp", LONG, LONG).await;
    let fast_lease = take(&store, &fast, "fp", LONG, LONG).await;
    let slow_task = complete_in_task(&store, &slow, &slow_lease.token, "slow");
    let watcher = sqlx::PgPool::connect(&url).await.unwrap();
    backend_of(&watcher, &schema, "UPDATE%", Some("PgSleep")).await;
    let fast_task = complete_in_task(&store, &fast, &fast_lease.token, "fast");
    until_waiting(&store, 1).await;
    assert_eq!(fast_task.await.unwrap(), Ok(()));
    assert!(
        !slow_task.is_finished(),
        "the fast completion waited for the slow one"
    );
    assert_eq!(
        pg_row(&store, &fast).await.unwrap().2.as_deref(),
        Some("{\"id\":\"fast\"}")
    );
    assert_eq!(slow_task.await.unwrap(), Ok(()));
}

/// A group of completions slow in the database holds up the next group no
/// longer than `TURN_HELD_MAX`: the group is left to finish in its task,
/// which answers its members, and the completion queued after it is
/// written while it still runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_slow_completion_group_holds_up_the_next_no_longer_than_a_turn() {
    let Some((url, schema, store)) = fresh_store(8, Duration::ZERO).await else {
        return;
    };
    // One turn to write: the completions after the one stopped at its turn queue.
    let store = store.with_completion_turns(1);
    slow_completions(&store, 5.0).await;
    let ids: Vec<RecordId> = ["turn-0", "slow-2", "group-2", "after-2"]
        .iter()
        .map(|k| RecordId::new("t", "turn", *k))
        .collect();
    let mut leases = Vec::new();
    for id in &ids {
        leases.push(take(&store, id, "fp", LONG, LONG).await);
    }
    // The first holds the turn, paused, while two queue into one group.
    let mut turn = idem_runtime::pause::arm(idem_runtime::pause::COMPLETE_TURN, &ids[0].key);
    let first = complete_in_task(&store, &ids[0], &leases[0].token, "turn");
    tokio::time::timeout(Duration::from_secs(10), turn.reached())
        .await
        .expect("the first completion took the turn");
    let slow_group = complete_in_task(&store, &ids[1], &leases[1].token, "slow");
    let in_group = complete_in_task(&store, &ids[2], &leases[2].token, "group");
    until_waiting(&store, 2).await;
    turn.resume();
    assert_eq!(first.await.unwrap(), Ok(()));
    // The group's statement sleeps on its slow row.
    let watcher = sqlx::PgPool::connect(&url).await.unwrap();
    backend_of(&watcher, &schema, "WITH c AS%", Some("PgSleep")).await;
    let after = complete_in_task(&store, &ids[3], &leases[3].token, "after");
    assert_eq!(after.await.unwrap(), Ok(()));
    assert!(
        !slow_group.is_finished(),
        "the completion after the group waited for it"
    );
    assert_eq!(slow_group.await.unwrap(), Ok(()));
    assert_eq!(in_group.await.unwrap(), Ok(()));
    for (id, tag) in ids.iter().zip(["turn", "slow", "group", "after"]) {
        assert_eq!(
            pg_row(&store, id).await.unwrap().2,
            Some(format!("{{\"id\":\"{tag}\"}}"))
        );
    }
}

/// One completion group: the same key under two tenants and a scope, a
/// record deleted by hand before the group, a record held FOR UPDATE by a
/// test connection, a stale token, the same record twice (same token, two
/// answers). Each is answered its own outcome; each stored answer is its
/// own; the held one is written once its row is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_completion_group_mixed_members() {
    let Some((url, _, store)) = fresh_store(8, LONG).await else {
        return;
    };
    // One turn to write: the completions after the one stopped at its turn queue.
    let store = store.with_completion_turns(1);
    let k = idem_testkit::unique("ck");
    let first = lookup_id("t0", "s", &idem_testkit::unique("first"));
    let a = lookup_id("t1", "s1", &k);
    let b = lookup_id("t2", "s1", &k);
    let c = lookup_id("t1", "s2", &k);
    let deleted = lookup_id("t3", "s1", &k);
    let held = lookup_id("t4", "s1", &k);
    let stale = lookup_id("t5", "s1", &k);
    let mut leases = std::collections::HashMap::new();
    for id in [&first, &a, &b, &c, &deleted, &held, &stale] {
        leases.insert(id.clone(), take(&store, id, "fp", LONG, LONG).await);
    }
    let mut turn = idem_runtime::pause::arm(idem_runtime::pause::COMPLETE_TURN, &first.key);
    let first_task = complete_in_task(&store, &first, &leases[&first].token, "first");
    tokio::time::timeout(Duration::from_secs(10), turn.reached())
        .await
        .unwrap();
    // Deleted by hand (an operator), and a row held by another connection.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DELETE FROM {} WHERE tenant = 't3' AND key = $1",
        pg_table(&store)
    )))
    .bind(&k)
    .execute(store.pool())
    .await
    .unwrap();
    let holders = sqlx::PgPool::connect(&url).await.unwrap();
    let holder = pg_hold_row(&holders, &store, &held).await;
    let plan: Vec<(&RecordId, String, &str)> = vec![
        (&a, leases[&a].token.clone(), "a"),
        (&b, leases[&b].token.clone(), "b"),
        (&c, leases[&c].token.clone(), "c"),
        (&deleted, leases[&deleted].token.clone(), "deleted"),
        (&held, leases[&held].token.clone(), "held"),
        (&stale, "not-its-token".to_owned(), "stale"),
        (&a, leases[&a].token.clone(), "a-again"),
    ];
    let mut tasks = Vec::new();
    for (n, (id, tok, tag)) in plan.iter().enumerate() {
        tasks.push(complete_in_task(&store, id, tok, tag));
        until_waiting(&store, n + 1).await;
    }
    turn.resume();
    assert_eq!(first_task.await.unwrap(), Ok(()));
    // Every completion but the held row's is answered while its row is held.
    let mut outcomes = Vec::new();
    let mut held_task = None;
    for (i, t) in tasks.into_iter().enumerate() {
        if i == 4 {
            held_task = Some(t);
            outcomes.push(Ok(()));
            continue;
        }
        outcomes.push(
            tokio::time::timeout(Duration::from_secs(20), t)
                .await
                .unwrap()
                .unwrap(),
        );
    }
    let held_task = held_task.unwrap();
    assert!(
        !held_task.is_finished(),
        "the held row's completion did not wait for it"
    );
    holder.rollback().await.unwrap();
    outcomes[4] = tokio::time::timeout(Duration::from_secs(20), held_task)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(outcomes[0], Ok(()));
    assert_eq!(outcomes[1], Ok(()));
    assert_eq!(outcomes[2], Ok(()));
    assert_eq!(outcomes[3], Err(StoreError::LockLost));
    assert_eq!(outcomes[4], Ok(()));
    assert_eq!(outcomes[5], Err(StoreError::LockLost));
    assert_eq!(outcomes[6], Err(StoreError::LockLost), "a record completed once");
    for (id, tag) in [(&a, "a"), (&b, "b"), (&c, "c"), (&held, "held")] {
        assert_eq!(
            reserve(&store, id, "fp", LONG, LONG).await,
            Reservation::Completed(response(tag)),
            "{tag}"
        );
    }
    assert!(pg_row(&store, &deleted).await.is_none());
    assert_eq!(pg_row(&store, &stale).await.unwrap().0, "in_progress");
}

/// The completion group's statement is terminated (`pg_terminate_backend`)
/// while it waits for the table (a test connection holds it in SHARE mode),
/// as is the first completion's, which runs once more on a tested
/// connection (it ran alone, untested) and is terminated again: each
/// member is told it failed, and nothing of the group was stored;
/// completed again, each stores its answer once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_completion_group_killed() {
    let Some((url, schema, store)) = fresh_store(8, LONG).await else {
        return;
    };
    // One turn to write: the completions after the one stopped at its turn queue.
    let store = store.with_completion_turns(1);
    let ids: Vec<RecordId> = ["first", "b", "c"]
        .iter()
        .map(|k| lookup_id("t", "ckill", &idem_testkit::unique(k)))
        .collect();
    let mut leases = Vec::new();
    for id in &ids {
        leases.push(take(&store, id, "fp", LONG, LONG).await);
    }
    let mut turn = idem_runtime::pause::arm(idem_runtime::pause::COMPLETE_TURN, &ids[0].key);
    let first_task = complete_in_task(&store, &ids[0], &leases[0].token, "first");
    tokio::time::timeout(Duration::from_secs(10), turn.reached())
        .await
        .unwrap();
    let b = complete_in_task(&store, &ids[1], &leases[1].token, "b");
    until_waiting(&store, 1).await;
    let c = complete_in_task(&store, &ids[2], &leases[2].token, "c");
    until_waiting(&store, 2).await;
    let holders = sqlx::PgPool::connect(&url).await.unwrap();
    let mut holder = holders.begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "LOCK TABLE {} IN SHARE MODE",
        pg_table(&store)
    )))
    .execute(&mut *holder)
    .await
    .unwrap();
    turn.resume();
    let watcher = sqlx::PgPool::connect(&url).await.unwrap();
    // Its statement, alone, took an idle connection untested: ended, it
    // runs again once on a tested one, which is ended in turn.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut ended = std::collections::HashSet::new();
    while !first_task.is_finished() {
        assert!(Instant::now() < deadline, "the first completion never ended");
        let waiting: Vec<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity WHERE state = 'active' AND query LIKE 'UPDATE%' \
             AND query LIKE '%' || $1 || '%' AND wait_event = 'relation'",
        )
        .bind(&schema)
        .fetch_all(&watcher)
        .await
        .unwrap();
        for pid in waiting {
            if ended.insert(pid) {
                terminate(&watcher, pid).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(
        ended.len(),
        2,
        "the first completion's statement and its second try"
    );
    let first_out = first_task.await.unwrap();
    let pid = backend_of(&watcher, &schema, "WITH c AS%", Some("relation")).await;
    terminate(&watcher, pid).await;
    let (b_out, c_out) = (b.await.unwrap(), c.await.unwrap());
    holder.rollback().await.unwrap();
    for ((id, out), (lease, tag)) in ids
        .iter()
        .zip([first_out, b_out, c_out])
        .zip(leases.iter().zip(["first", "b", "c"]))
    {
        let (state, _, body) = pg_row(&store, id).await.unwrap();
        match out {
            Ok(()) => assert_eq!(body.as_deref(), Some(format!("{{\"id\":\"{tag}\"}}").as_str())),
            Err(StoreError::Unavailable { .. }) => {
                assert_eq!(state, "in_progress", "{tag}: told it failed, but stored");
                store.complete(id, &lease.token, &response(tag)).await.unwrap();
            }
            other => panic!("{tag}: {other:?}"),
        }
        assert_eq!(
            reserve(&store, id, "fp", LONG, LONG).await,
            Reservation::Completed(response(tag))
        );
    }
}

// ---------------------------------------------------------------------------
// 5. Over HTTP: two processes, the caches and groups at their defaults
// ---------------------------------------------------------------------------

mod http {
    use super::*;
    use axum::extract::State;
    use axum::http::StatusCode;
    use axum::routing::post;
    use axum::{Json, Router};
    use idem::{idempotent, Idem, Operation};
    use idem_testkit::http::post as post_req;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[derive(Clone, Default)]
    pub(crate) struct App {
        runs: Arc<AtomicUsize>,
        attempts: Arc<std::sync::Mutex<Vec<u32>>>,
        release: Arc<tokio::sync::Notify>,
        fail_first: Arc<std::sync::atomic::AtomicBool>,
    }

    #[derive(serde::Deserialize)]
    pub(crate) struct Body {
        #[allow(dead_code)]
        amount: i64,
    }

    #[idempotent(scope = "race.pay", fields(amount))]
    async fn pay(State(app): State<App>, op: Operation, Json(_b): Json<Body>) -> (StatusCode, String) {
        let n = app.runs.fetch_add(1, Ordering::SeqCst) + 1;
        app.attempts.lock().unwrap().push(op.attempt());
        let _ = tokio::time::timeout(Duration::from_secs(15), app.release.notified()).await;
        if n == 1 && app.fail_first.load(Ordering::SeqCst) {
            return (StatusCode::SERVICE_UNAVAILABLE, "down".into());
        }
        (
            StatusCode::CREATED,
            format!("{{\"run\":{n},\"attempt\":{}}}", op.attempt()),
        )
    }

    #[idempotent(scope = "race.quick", fields(amount))]
    async fn quick(State(app): State<App>, op: Operation, Json(_b): Json<Body>) -> (StatusCode, String) {
        let n = app.runs.fetch_add(1, Ordering::SeqCst) + 1;
        app.attempts.lock().unwrap().push(op.attempt());
        (
            StatusCode::CREATED,
            format!("{{\"run\":{n},\"attempt\":{}}}", op.attempt()),
        )
    }

    fn router(app: App, store: idem::PgStore) -> Router {
        Router::new()
            .route("/quick", post(quick))
            .route("/pay", post(pay))
            .layer(Idem::new(store).single_tenant().layer())
            .with_state(app)
    }

    async fn two_servers(app: &App) -> Option<(std::net::SocketAddr, std::net::SocketAddr, idem::PgStore)> {
        let url = idem_testkit::pg_url()?;
        let schema = idem_testkit::pg_schema(&url).await;
        let a = idem_testkit::pg_store_in(&url, &schema, 8)
            .await
            .with_timeout(idem::DEFAULT_OPERATION_TIMEOUT)
            .with_replay_cache(idem::DEFAULT_REPLAY_CACHE);
        let b = idem_testkit::pg_store_in(&url, &schema, 8)
            .await
            .with_timeout(idem::DEFAULT_OPERATION_TIMEOUT);
        let sa = idem_testkit::http::serve(router(app.clone(), a.clone())).await;
        let sb = idem_testkit::http::serve(router(app.clone(), b)).await;
        Some((sa, sb, a))
    }

    /// A completion lost after the handler ran: every try of the
    /// completion is terminated (`pg_terminate_backend`) while the table is
    /// held. The client gets 503 with Retry-After (never the unrecorded
    /// answer); the key is released as failed once the table is free, and
    /// the retry really retries (attempt 2), then replays.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn postgres_http_completion_lost_after_the_handler_ran() {
        let Some(url) = idem_testkit::pg_url() else { return };
        let schema = idem_testkit::pg_schema(&url).await;
        let store = idem_testkit::pg_store_in(&url, &schema, 8)
            .await
            .with_timeout(Duration::from_millis(500));
        let app = App::default();
        let addr = idem_testkit::http::serve(router(app.clone(), store.clone())).await;
        let key = idem_testkit::unique("lost");
        let holders = sqlx::PgPool::connect(&url).await.unwrap();
        let mut holder = holders.begin().await.unwrap();
        // Reads (the reservation's lookup finds no row and inserts: the
        // insert must not wait) - so hold only what completions need:
        // take the key first, then lock.
        let mut returned = idem_runtime::pause::arm(idem_runtime::pause::HANDLER_RETURNED, &key);
        let first = {
            let key = key.clone();
            tokio::spawn(async move { post_req("/quick", "{\"amount\": 5}").key(&key).send(addr).await })
        };
        // The handler returned; its answer is not recorded yet: hold the table.
        tokio::time::timeout(Duration::from_secs(10), returned.reached())
            .await
            .unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "LOCK TABLE {} IN SHARE MODE",
            pg_table(&store)
        )))
        .execute(&mut *holder)
        .await
        .unwrap();
        returned.resume();
        // Terminate every completion that waits for the table.
        let killer = {
            let (url, schema) = (url.clone(), schema.clone());
            tokio::spawn(async move {
                let pool = sqlx::PgPool::connect(&url).await.unwrap();
                let mut killed = 0usize;
                let until = Instant::now() + Duration::from_secs(4);
                while Instant::now() < until {
                    let n: Vec<bool> = sqlx::query_scalar(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE state = 'active' \
                         AND query LIKE '%SET state = ''completed''%' AND query LIKE '%' || $1 || '%'",
                    )
                    .bind(&schema)
                    .fetch_all(&pool)
                    .await
                    .unwrap();
                    killed += n.len();
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                killed
            })
        };
        let r = first.await.unwrap();
        let killed = killer.await.unwrap();
        assert!(
            killed > 0,
            "no completion was terminated: the test did not lose one"
        );
        holder.rollback().await.unwrap();
        assert_ne!(r.status, 201, "the unrecorded answer was sent");
        assert_eq!(r.status, 503);
        assert!(r.header("retry-after").is_some());
        let id = RecordId::new("", "race.quick", key.clone());
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let row = pg_row(&store, &id).await;
            if matches!(&row, Some((s, None, _)) if s == "in_progress")
                || matches!(&row, Some((s, _, _)) if s == "completed")
            {
                break;
            }
            assert!(Instant::now() < deadline, "the key was never released: {row:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let again = post_req("/quick", "{\"amount\": 5}").key(&key).send(addr).await;
        assert_eq!(again.status, 201);
        let replay = post_req("/quick", "{\"amount\": 5}").key(&key).send(addr).await;
        assert_eq!((replay.status, replay.body.clone()), (201, again.body.clone()));
    }

    /// Twenty concurrent requests, one key, one body, over two processes:
    /// one execution, one success, nineteen 409s; then replays on both.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn postgres_http_twenty_over_two_processes() {
        let app = App::default();
        let Some((sa, sb, _)) = two_servers(&app).await else {
            return;
        };
        let key = idem_testkit::unique("k20");
        let mut tasks = Vec::new();
        for i in 0..20 {
            let key = key.clone();
            let addr = if i % 2 == 0 { sa } else { sb };
            tasks.push(tokio::spawn(async move {
                post_req("/pay", "{\"amount\": 5}").key(&key).send(addr).await
            }));
        }
        // The 19 others answer while the one execution is held.
        let deadline = Instant::now() + Duration::from_secs(20);
        while tasks.iter().filter(|t| t.is_finished()).count() < 19 {
            assert!(Instant::now() < deadline, "the conflicts never answered");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        app.release.notify_waiters();
        let mut statuses = Vec::new();
        for t in tasks {
            statuses.push(t.await.unwrap().status);
        }
        statuses.sort_unstable();
        assert_eq!(app.runs.load(Ordering::SeqCst), 1, "{statuses:?}");
        assert_eq!(statuses.iter().filter(|s| **s == 201).count(), 1, "{statuses:?}");
        assert_eq!(statuses.iter().filter(|s| **s == 409).count(), 19, "{statuses:?}");
        for addr in [sa, sb] {
            let r = post_req("/pay", "{\"amount\": 5}").key(&key).send(addr).await;
            assert_eq!(r.status, 201);
            assert_eq!(r.header("idempotent-replayed"), Some("true"));
        }
    }

    /// The execution fails with a 5xx (released as failed) while its
    /// conflicts were answered 409 from memory: the retry on the same
    /// server really retries (attempt 2), and replays everywhere after.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn postgres_http_failed_execution_is_retried_not_409_from_memory() {
        let app = App::default();
        app.fail_first.store(true, Ordering::SeqCst);
        let Some((sa, sb, _)) = two_servers(&app).await else {
            return;
        };
        let key = idem_testkit::unique("kf");
        let first = {
            let key = key.clone();
            tokio::spawn(async move { post_req("/pay", "{\"amount\": 5}").key(&key).send(sa).await })
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while app.runs.load(Ordering::SeqCst) == 0 {
            assert!(Instant::now() < deadline);
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        // A conflict, from memory on `sa`.
        assert_eq!(
            post_req("/pay", "{\"amount\": 5}")
                .key(&key)
                .send(sa)
                .await
                .status,
            409
        );
        assert_eq!(
            post_req("/pay", "{\"amount\": 6}")
                .key(&key)
                .send(sa)
                .await
                .status,
            422
        );
        app.release.notify_waiters();
        assert_eq!(first.await.unwrap().status, 503);
        let retry = {
            let key = key.clone();
            tokio::spawn(async move { post_req("/pay", "{\"amount\": 5}").key(&key).send(sa).await })
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while app.runs.load(Ordering::SeqCst) < 2 && !retry.is_finished() {
            assert!(Instant::now() < deadline);
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        app.release.notify_waiters();
        let r = retry.await.unwrap();
        assert_eq!(r.status, 201, "{:?}", String::from_utf8_lossy(&r.body));
        assert_eq!(*app.attempts.lock().unwrap(), vec![1, 2]);
        for addr in [sa, sb] {
            let r = post_req("/pay", "{\"amount\": 5}").key(&key).send(addr).await;
            assert_eq!((r.status, r.header("idempotent-replayed")), (201, Some("true")));
        }
    }

    #[derive(Clone, Default)]
    struct Waits {
        runs: Arc<AtomicUsize>,
        first_may_end: Arc<tokio::sync::Notify>,
        second_may_end: Arc<tokio::sync::Notify>,
    }

    /// The first execution ends with a 400 (rejected: the key is free); the
    /// others run until the test lets them end.
    #[idempotent(scope = "race.wait", fields(amount), wait = "20s")]
    async fn wait_pay(State(w): State<Waits>, Json(_b): Json<Body>) -> (StatusCode, String) {
        let n = w.runs.fetch_add(1, Ordering::SeqCst) + 1;
        if n == 1 {
            let _ = tokio::time::timeout(Duration::from_secs(20), w.first_may_end.notified()).await;
            return (StatusCode::BAD_REQUEST, "rejected".into());
        }
        let _ = tokio::time::timeout(Duration::from_secs(20), w.second_may_end.notified()).await;
        (StatusCode::CREATED, format!("{{\"run\":{n}}}"))
    }

    #[idempotent(scope = "race.other", fields(amount))]
    async fn other(Json(_b): Json<Body>) -> (StatusCode, String) {
        (StatusCode::CREATED, "other".into())
    }

    /// A `wait`ing request's first try is answered 409 by its group's read
    /// apart while the group's statement still runs (an insert sleeps);
    /// the key is freed and the next try takes it and runs; then the
    /// group's statement is terminated (a failover), and the group hands
    /// back, fenced by a token, the key it may have taken for the first
    /// try. Each try has a token of its own: the running execution's record
    /// is untouched, and the same request on another server waits for it
    /// and replays it, never running a second time.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn postgres_http_a_waiting_retry_keeps_its_key_when_an_earlier_try_is_handed_back() {
        let Some(url) = idem_testkit::pg_url() else { return };
        let schema = idem_testkit::pg_schema(&url).await;
        let here = idem_testkit::pg_store_in(&url, &schema, 8)
            .await
            .with_timeout(idem::DEFAULT_OPERATION_TIMEOUT);
        let there = idem_testkit::pg_store_in(&url, &schema, 8)
            .await
            .with_timeout(idem::DEFAULT_OPERATION_TIMEOUT);
        slow_inserts(&here, 30.0).await;
        let w = Waits::default();
        let router = |store: idem::PgStore| {
            Router::new()
                .route("/pay", post(wait_pay))
                .route("/other", post(other))
                .layer(Idem::new(store).single_tenant().layer())
                .with_state(w.clone())
        };
        let a_here = idem_testkit::http::serve(router(here.clone())).await;
        let a_there = idem_testkit::http::serve(router(there.clone())).await;
        let key = idem_testkit::unique("k");
        let send = |addr, path: &'static str, key: String| {
            tokio::spawn(async move { post_req(path, "{\"amount\": 5}").key(&key).send(addr).await })
        };
        let until_runs = |n: usize| {
            let w = w.clone();
            async move {
                let deadline = Instant::now() + Duration::from_secs(10);
                while w.runs.load(Ordering::SeqCst) < n {
                    assert!(Instant::now() < deadline, "run {n} never started");
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
        };
        // The first execution, on the other server, holds the key.
        let first = send(a_there, "/pay", key.clone());
        until_runs(1).await;
        // Here both lookup turns are held: the waiting request's first try
        // and a request with a fresh key whose insert sleeps queue into one
        // group.
        let ([turn_1, turn_2], turns) = hold_the_lookup_turns(&here).await;
        let mut answered = idem_runtime::pause::arm(idem_runtime::pause::RESERVE_AFTER, &key);
        let waiting = send(a_here, "/pay", key.clone());
        until_lookups_waiting(&here, 1).await;
        let slow = send(a_here, "/other", idem_testkit::unique("slow"));
        until_lookups_waiting(&here, 2).await;
        turn_1.resume();
        let watcher = sqlx::PgPool::connect(&url).await.unwrap();
        let pid = backend_of(&watcher, &schema, "%idem-group%", Some("PgSleep")).await;
        // The read apart answers the first try: in progress.
        tokio::time::timeout(Duration::from_secs(10), answered.reached())
            .await
            .expect("the first try was never answered");
        // The first execution is rejected: the key is free, and the next
        // try takes it and runs.
        w.first_may_end.notify_one();
        assert_eq!(first.await.unwrap().status, 400);
        answered.resume();
        until_runs(2).await;
        let id = RecordId::new("", "race.wait", key.clone());
        let running = pg_row(&here, &id).await;
        assert!(
            matches!(&running, Some((state, Some(_), None)) if state == "in_progress"),
            "{running:?}"
        );
        // The group's statement ends; it hands back what it may have taken
        // for the first try.
        let mut handed_back = idem_runtime::pause::arm(idem_runtime::pause::HAND_BACK_AFTER, &key);
        assert!(terminate(&watcher, pid).await);
        tokio::time::timeout(Duration::from_secs(10), handed_back.reached())
            .await
            .expect("the group never handed back the first try's key");
        handed_back.resume();
        assert_eq!(
            pg_row(&here, &id).await,
            running,
            "the record of the running execution was handed back"
        );
        // The same request on the other server is answered in progress.
        let mut asked = idem_runtime::pause::arm(idem_runtime::pause::RESERVE_AFTER, &key);
        let again = send(a_there, "/pay", key.clone());
        tokio::time::timeout(Duration::from_secs(10), asked.reached())
            .await
            .expect("the same request elsewhere was never answered");
        assert_eq!(
            pg_row(&here, &id).await,
            running,
            "the same request elsewhere took the key"
        );
        asked.resume();
        w.second_may_end.notify_one();
        let (waiting, again) = (waiting.await.unwrap(), again.await.unwrap());
        assert_eq!(
            (waiting.status, waiting.body.as_ref()),
            (201, b"{\"run\":2}".as_ref())
        );
        assert_eq!(
            (again.status, again.body.as_ref()),
            (201, b"{\"run\":2}".as_ref())
        );
        assert_eq!(again.header("idempotent-replayed"), Some("true"));
        assert_eq!(w.runs.load(Ordering::SeqCst), 2, "the handler ran again");
        let _ = slow.await;
        turn_2.resume();
        for t in turns {
            let _ = t.await;
        }
    }
}

/// After a group refused for its lock waits (it set `lock_timeout` for its
/// own transaction), no pooled connection keeps that `lock_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_group_lock_timeout_does_not_leak_to_the_pool() {
    let Some((url, _, store)) = fresh_store(4, Duration::ZERO).await else {
        return;
    };
    let fresh = lookup_id("t", "leak", &idem_testkit::unique("fresh"));
    let other = lookup_id("t", "leak", &idem_testkit::unique("other"));
    let holders = sqlx::PgPool::connect(&url).await.unwrap();
    let holder = insert_uncommitted(&holders, &store, &[&fresh]).await;
    let ([first, second], turns) = hold_the_lookup_turns(&store).await;
    let a = reserve_in_task(&store, &other, "fp");
    until_lookups_waiting(&store, 1).await;
    let b = reserve_in_task(&store, &fresh, "fp");
    until_lookups_waiting(&store, 2).await;
    first.resume();
    let a = a.await.unwrap();
    assert!(matches!(a, Ok(Reservation::Reserved(_))), "{a:?}");
    holder.rollback().await.unwrap();
    let b = b.await.unwrap();
    assert!(matches!(b, Ok(Reservation::Reserved(_))), "{b:?}");
    second.resume();
    for t in turns {
        let _ = t.await.unwrap();
    }
    let mut conns = Vec::new();
    for _ in 0..4 {
        let mut c = store.pool().acquire().await.unwrap();
        let lt: String = sqlx::query_scalar("SHOW lock_timeout")
            .fetch_one(&mut *c)
            .await
            .unwrap();
        assert_eq!(lt, "0", "a pooled connection kept the group's lock_timeout");
        conns.push(c);
    }
}

/// A group of fresh keys with each its own TTL and lock timeout: each
/// record gets its own, as alone (the binds are per element).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_lookup_group_per_member_ttl_and_lock() {
    let Some((_, _, store)) = fresh_store(8, Duration::ZERO).await else {
        return;
    };
    let a = lookup_id("t", "ttl", &idem_testkit::unique("a"));
    let b = lookup_id("t", "ttl", &idem_testkit::unique("b"));
    let ([first, second], turns) = hold_the_lookup_turns(&store).await;
    let spawn = |id: &RecordId, ttl: Duration, lock: Duration| {
        let (store, id) = (store.clone(), id.clone());
        tokio::spawn(async move { store.reserve(req(&id, "fp", ttl, lock)).await })
    };
    let ta = spawn(&a, Duration::from_secs(60), Duration::from_secs(2));
    until_lookups_waiting(&store, 1).await;
    let tb = spawn(&b, Duration::from_secs(7200), Duration::from_secs(900));
    until_lookups_waiting(&store, 2).await;
    first.resume();
    assert!(matches!(ta.await.unwrap(), Ok(Reservation::Reserved(_))));
    assert!(matches!(tb.await.unwrap(), Ok(Reservation::Reserved(_))));
    second.resume();
    for t in turns {
        let _ = t.await.unwrap();
    }
    for (id, ttl, lock) in [(&a, 60.0, 2.0), (&b, 7200.0, 900.0)] {
        let (t, l): (f64, f64) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT date_part('epoch', expires_at - created_at)::float8, \
             date_part('epoch', lock_expires_at - created_at)::float8 FROM {} WHERE key = $1",
            pg_table(&store)
        )))
        .bind(&id.key)
        .fetch_one(store.pool())
        .await
        .unwrap();
        assert_eq!((t, l), (ttl, lock), "{}", id.key);
    }
}

/// Many reservers over two stores (one knowing for an hour, one at the
/// default bound), a few keys, long locks and TTLs, every ending (complete,
/// release, reject, hand back): at most one holder of a key at a time, at
/// most one completion per key, every replay is that completion's answer,
/// and no reservation after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 8)]
async fn postgres_stress_two_stores_caches_and_groups() {
    use std::sync::{Arc, Mutex};
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let a = idem_testkit::pg_store_in(&url, &schema, 6)
        .await
        .with_replay_cache(LONG);
    let b = idem_testkit::pg_store_in(&url, &schema, 6).await;
    for round in 0..6 {
        let prefix = idem_testkit::unique("r");
        let keys: Vec<RecordId> = (0..20)
            .map(|i| {
                RecordId::new(
                    if i % 2 == 0 { "t1" } else { "t2" },
                    "stress",
                    format!("{prefix}-k{}", i / 2),
                )
            })
            .collect();
        #[derive(Default)]
        struct Book {
            holder: Option<String>,
            completed: Option<String>,
            violations: Vec<String>,
            counts: [usize; 6],
            attempted: Vec<String>,
            replayed: std::collections::BTreeSet<String>,
        }
        let book: Arc<Mutex<Vec<Book>>> =
            Arc::new(Mutex::new((0..keys.len()).map(|_| Book::default()).collect()));
        let until = Instant::now() + Duration::from_millis(700);
        let mut tasks = Vec::new();
        for w in 0..48usize {
            let store = if w % 2 == 0 { a.clone() } else { b.clone() };
            let (keys, book) = (keys.clone(), book.clone());
            tasks.push(tokio::spawn(async move {
                let mut n = w as u64;
                while Instant::now() < until {
                    n = n
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let ki = (n >> 33) as usize % keys.len();
                    let id = &keys[ki];
                    let fp = if (n >> 20).is_multiple_of(11) {
                        "fp-other"
                    } else {
                        "fp"
                    };
                    let token = idem_testkit::token();
                    let got = store
                        .reserve(ReserveRequest {
                            id,
                            fingerprint: fp,
                            token,
                            ttl: LONG,
                            lock_timeout: LONG,
                        })
                        .await;
                    match got {
                        Ok(Reservation::Reserved(lease)) => {
                            {
                                let mut bk = book.lock().unwrap();
                                let e = &mut bk[ki];
                                e.counts[0] += 1;
                                if let Some(h) = &e.holder {
                                    e.violations
                                        .push(format!("{}: reserved by {token} while {h} holds it", id.key));
                                }
                                if let Some(c) = &e.completed {
                                    e.violations
                                        .push(format!("{}: reserved after completion {c}", id.key));
                                }
                                e.holder = Some(token.to_owned());
                            }
                            tokio::time::sleep(Duration::from_micros((n >> 40) % 3000)).await;
                            let how =
                                [0, 1, 1, 2, 2, 3, 3, 1, 1, 2, 3, 1, 2, 1, 3, 1][((n >> 10) % 16) as usize];
                            let tag = format!("{}-{token}", id.tenant);
                            // Let go of the holder mark before the write is sent:
                            // after it, another may take the key at once.
                            {
                                let mut bk = book.lock().unwrap();
                                bk[ki].holder = None;
                                if how == 0 {
                                    bk[ki].attempted.push(format!("{{\"id\":\"{tag}\"}}"));
                                }
                            }
                            let done = {
                                match how {
                                    0 => store.complete(id, token, &response(&tag)).await,
                                    1 => store.release(id, token).await,
                                    2 => store.reject(id, token).await,
                                    _ => store.hand_back(id, token, lease.is_takeover()).await,
                                }
                            };
                            let mut bk = book.lock().unwrap();
                            let e = &mut bk[ki];
                            match (how, done) {
                                (0, Ok(())) => {
                                    e.counts[1] += 1;
                                    if let Some(c) = &e.completed {
                                        e.violations
                                            .push(format!("{}: completed twice ({c}, {tag})", id.key));
                                    }
                                    e.completed = Some(tag);
                                }
                                (_, Ok(())) => e.counts[2] += 1,
                                (h, Err(err)) => e
                                    .violations
                                    .push(format!("{}: ending {h} failed: {err:?}", id.key)),
                            }
                        }
                        Ok(Reservation::Completed(ans)) => {
                            let mut bk = book.lock().unwrap();
                            let e = &mut bk[ki];
                            e.counts[3] += 1;
                            let body = String::from_utf8(ans.body.clone().unwrap()).unwrap();
                            if !e.attempted.contains(&body) {
                                e.violations
                                    .push(format!("{}: replayed {body}, never sent", id.key));
                            }
                            e.replayed.insert(body);
                        }
                        Ok(Reservation::InProgress { .. }) => book.lock().unwrap()[ki].counts[4] += 1,
                        Ok(Reservation::Mismatch) => book.lock().unwrap()[ki].counts[5] += 1,
                        Err(e) => book.lock().unwrap()[ki]
                            .violations
                            .push(format!("reserve failed: {e:?}")),
                    }
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let bk = std::mem::take(&mut *book.lock().unwrap());
        let mut all = Vec::new();
        let mut totals = [0usize; 6];
        for (i, e) in bk.iter().enumerate() {
            let stored = pg_row(&a, &keys[i]).await;
            if let Some(c) = &e.completed {
                let body = format!("{{\"id\":\"{c}\"}}");
                if stored.as_ref().and_then(|r| r.2.clone()) != Some(body.clone()) {
                    all.push(format!("{}: completed {c}, stored {stored:?}", keys[i].key));
                }
                if e.replayed.iter().any(|r| *r != body) {
                    all.push(format!(
                        "{}: completed {c}, replayed {:?}",
                        keys[i].key, e.replayed
                    ));
                }
            } else if !e.replayed.is_empty()
                && stored
                    .as_ref()
                    .and_then(|r| r.2.clone())
                    .map(|b| e.replayed.iter().any(|r| *r != b))
                    != Some(false)
            {
                all.push(format!(
                    "{}: replayed {:?}, stored {stored:?}",
                    keys[i].key, e.replayed
                ));
            }
            for (sum, n) in totals.iter_mut().zip(e.counts) {
                *sum += n;
            }
            all.extend(e.violations.iter().cloned());
        }
        assert!(all.is_empty(), "{:#?}", &all[..all.len().min(20)]);
        // The round ran every path: reservations, completions, endings that
        // let the key go, replays, conflicts and mismatches.
        assert!(totals.iter().all(|n| *n > 0), "round {round}: {totals:?}");
    }
}

/// Once the database says a completed record has expired, a store that
/// keeps answers for an hour never replays it again (a new operation
/// takes the key): checked by a tight loop around the expiry.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_kept_answer_never_replayed_after_db_expiry() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let (_schema, a, _b) = knowing_pair(&url).await;
    let watcher = sqlx::PgPool::connect(&url).await.unwrap();
    for round in 0..5 {
        let id = RecordId::new("t", "expiry", idem_testkit::unique("k"));
        let ttl = Duration::from_millis(150 + 37 * round);
        let l = take(&a, &id, "fp", ttl, LONG).await;
        a.complete(&id, &l.token, &response("old")).await.unwrap();
        assert_eq!(
            reserve(&a, &id, "fp", ttl, LONG).await,
            Reservation::Completed(response("old"))
        );
        let mut seen_expired = false;
        loop {
            seen_expired |= db_says(&watcher, &a, &id, "expires_at <= now()").await;
            let r = reserve(&a, &id, "fp", ttl, LONG).await;
            match r {
                Reservation::Completed(_) => {
                    assert!(!seen_expired, "replayed after the database said expired")
                }
                Reservation::Reserved(l) => {
                    assert_eq!(l.attempt, 1);
                    break;
                }
                other => panic!("{other:?}"),
            }
        }
    }
}

/// Once the database says this process's execution's lock has passed its
/// deadline (after a heartbeat moved it once), this process never answers
/// 409 from memory again: the request takes over.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_running_entry_never_outlives_db_lock_deadline() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let (_schema, a, _b) = knowing_pair(&url).await;
    let watcher = sqlx::PgPool::connect(&url).await.unwrap();
    for round in 0..5u32 {
        let id = RecordId::new("t", "lockdl", idem_testkit::unique("k"));
        let lock = Duration::from_millis(150 + 41 * u64::from(round));
        let l = take(&a, &id, "fp", LONG, lock).await;
        assert!(matches!(
            reserve(&a, &id, "fp", LONG, lock).await,
            Reservation::InProgress { .. }
        ));
        tokio::time::sleep(lock / 2).await;
        a.extend_lock(&id, &l.token, lock).await.unwrap();
        let mut seen_expired = false;
        loop {
            seen_expired |= db_says(&watcher, &a, &id, "lock_expires_at <= now()").await;
            match reserve(&a, &id, "fp", LONG, lock).await {
                Reservation::InProgress { .. } => assert!(!seen_expired, "409 after the database's deadline"),
                Reservation::Reserved(l) => {
                    assert!(l.is_takeover());
                    break;
                }
                other => panic!("{other:?}"),
            }
        }
    }
}

/// A store belongs to one runtime (README, "Where idem departs from the
/// contract"): what a runtime that goes away leaves behind, and the
/// warning of a store used from a second one.
mod runtimes {
    use super::*;

    /// A runtime shut down while its reservation's statement runs (an
    /// insert sleeping in a trigger): the statement commits on the server
    /// and the key stays locked under the token of an execution that never
    /// started, until its lock timeout, as after a crash; the retry then
    /// takes the operation over.
    #[test]
    fn postgres_a_runtime_shut_down_mid_reservation_leaves_its_key_as_a_crash_does() {
        let lock = Duration::from_secs(5);
        let driven = idem_testkit::multi_thread(1);
        let Some((url, schema, store)) = driven.block_on(fresh_store(4, Duration::ZERO)) else {
            return;
        };
        let watcher = driven.block_on(async {
            slow_inserts(&store, 0.5).await;
            sqlx::PgPool::connect(&url).await.unwrap()
        });
        let id = RecordId::new("t", "shut", idem_testkit::unique("slow"));
        let token = idem_testkit::token();
        let caller = idem_testkit::multi_thread(1);
        {
            let (store, id) = (store.clone(), id.clone());
            caller.spawn(async move {
                let request = ReserveRequest {
                    token,
                    ..req(&id, "fp", LONG, lock)
                };
                store.reserve(request).await
            });
        }
        driven.block_on(backend_of(&watcher, &schema, "%", Some("PgSleep")));
        drop(caller);
        driven.block_on(async {
            // The statement ends on the server, committed.
            until_db(&store, &id, "true").await;
            let (state, held_by, _) = pg_row(&store, &id).await.unwrap();
            assert_eq!((state.as_str(), held_by.as_deref()), ("in_progress", Some(token)));
            let retry = store.reserve(req(&id, "fp", LONG, lock)).await;
            assert!(matches!(retry, Ok(Reservation::InProgress { .. })), "{retry:?}");
            // Once the lock runs out by the database's clock, the retry
            // takes the operation over.
            until_db(&store, &id, "lock_expires_at <= now()").await;
            match store.reserve(req(&id, "fp", LONG, lock)).await {
                Ok(Reservation::Reserved(lease)) => {
                    assert!(lease.is_takeover(), "{lease:?}");
                    assert_eq!(lease.attempt, 2);
                }
                other => panic!("{other:?}"),
            }
        });
    }

    /// Reservations from one runtime say nothing; the first from a second
    /// runtime, through the store or a clone of it, warns once, and no
    /// later one again.
    #[test]
    fn postgres_a_store_used_from_a_second_runtime_says_so_once() {
        let _ = idem_testkit::logs();
        let (first, second) = (idem_testkit::multi_thread(1), idem_testkit::multi_thread(1));
        let Some((_, schema, store)) = first.block_on(fresh_store(4, Duration::ZERO)) else {
            return;
        };
        let clone = store.clone().with_timeout(Duration::from_secs(5));
        reserved_on(&store, &first);
        reserved_on(&clone, &first);
        assert_eq!(second_runtime_said(&schema), 0);
        reserved_on(&clone, &second);
        reserved_on(&store, &second);
        reserved_on(&store, &first);
        assert_eq!(second_runtime_said(&schema), 1);
    }

    /// A fresh key reserved through `store`, from `rt`.
    fn reserved_on(store: &idem::PgStore, rt: &tokio::runtime::Runtime) {
        let id = RecordId::new("t", "runtimes", idem_testkit::unique("k"));
        let answer = rt.block_on(async { reserve(store, &id, "fp", LONG, LONG).await });
        assert!(matches!(answer, Reservation::Reserved(_)), "{answer:?}");
    }

    /// How many times the second-runtime warning was logged for `schema`'s
    /// table (this test's: the binary's other tests log into the same text).
    fn second_runtime_said(schema: &str) -> usize {
        idem_testkit::logs()
            .text()
            .lines()
            .filter(|l| l.contains("a PgStore is used from a second Tokio runtime") && l.contains(schema))
            .count()
    }

    /// A store built over a pool whose connections a setup runtime opened,
    /// or one migrated on a setup runtime, and then used only from the
    /// server's runtime: the pool's connections are the setup runtime's
    /// (a setup runtime no longer driven would stall them), so the first
    /// reservation from the server's runtime warns, once per store.
    #[test]
    fn postgres_a_store_set_up_on_one_runtime_and_served_on_another_says_so() {
        let _ = idem_testkit::logs();
        let (setup, server) = (idem_testkit::multi_thread(1), idem_testkit::multi_thread(1));
        let Some(url) = idem_testkit::pg_url() else { return };
        let (schema, built, migrated) = setup.block_on(async {
            let schema = idem_testkit::pg_schema(&url).await;
            // Migrates the schema's table, on its own pool.
            drop(idem_testkit::pg_store_in(&url, &schema, 1).await);
            // Connections opened here, no migration through this store.
            let pool = sqlx::PgPool::connect(&url).await.unwrap();
            let built = idem::PgStore::new(pool)
                .with_table(Some(&schema), "idempotency_keys")
                .unwrap();
            // No connection open before the migration, which opens one.
            let migrated = idem::PgStore::connect(&url)
                .unwrap()
                .with_table(Some(&schema), "idempotency_keys")
                .unwrap();
            migrated.migrate().await.unwrap();
            (schema, built, migrated)
        });
        assert_eq!(second_runtime_said(&schema), 0);
        for (n, store) in [(1, &built), (2, &migrated), (2, &built)] {
            reserved_on(store, &server);
            assert_eq!(second_runtime_said(&schema), n);
        }
    }

    /// Two stores over one pool (a second `PgStore::new` of a clone of the
    /// pool), each used from a runtime of its own: the pool is used from
    /// two runtimes, and that is said once.
    #[test]
    fn postgres_two_stores_over_one_pool_used_from_two_runtimes_say_so_once() {
        let _ = idem_testkit::logs();
        let (first, second) = (idem_testkit::multi_thread(1), idem_testkit::multi_thread(1));
        let Some((_, schema, a)) = first.block_on(fresh_store(4, Duration::ZERO)) else {
            return;
        };
        let b = idem::PgStore::new(a.pool().clone())
            .with_table(Some(&schema), "idempotency_keys")
            .unwrap();
        for (store, rt) in [(&a, &first), (&b, &second), (&a, &second), (&b, &first)] {
            reserved_on(store, rt);
        }
        assert_eq!(second_runtime_said(&schema), 1);
    }

    /// A reservation's future built outside any runtime and handed to a
    /// second runtime's `block_on` runs on that runtime: it is judged where
    /// it runs, and said.
    #[test]
    fn postgres_a_reservation_built_outside_and_run_on_a_second_runtime_says_so() {
        let _ = idem_testkit::logs();
        let (first, second) = (idem_testkit::multi_thread(1), idem_testkit::multi_thread(1));
        let Some((_, schema, store)) = first.block_on(fresh_store(4, Duration::ZERO)) else {
            return;
        };
        let id = RecordId::new("t", "runtimes", idem_testkit::unique("k"));
        let answer = second.block_on(store.reserve(req(&id, "fp", LONG, LONG)));
        assert!(matches!(answer, Ok(Reservation::Reserved(_))), "{answer:?}");
        assert_eq!(second_runtime_said(&schema), 1);
    }
}

/// Cancellation inside the groups: a caller's lookup or completion dropped
/// while it holds the turn, while queued, or while its group's statement
/// runs; group statements cancelled by a `statement_timeout`, killed while
/// holding row locks, or cut by the pool's close; and, over HTTP, the client
/// of the request holding the turn going away. The other members always get
/// their own answers, nothing hangs, nothing runs twice, and a key a
/// dropped caller's statement took is left as a crash leaves it (taken over
/// after its lock deadline) or handed back.
mod cancellation {
    use super::*;

    type Reserving = (
        &'static str,
        tokio::task::JoinHandle<Result<Reservation, StoreError>>,
    );

    /// A group of lookups running: those of `ids` queue behind the two held
    /// turns, the first turn is let go, and this returns once the group's
    /// statement sleeps in the database (the slow insert of a key starting
    /// `slow`, from `slow_inserts`). The second turn is still held.
    struct Running {
        second: idem_runtime::pause::Pause,
        turns: [tokio::task::JoinHandle<Result<Reservation, StoreError>>; 2],
        members: Vec<Reserving>,
        watcher: sqlx::PgPool,
    }

    async fn a_group_running(url: &str, schema: &str, store: &idem::PgStore, ids: &[&RecordId]) -> Running {
        let ([first, second], turns) = hold_the_lookup_turns(store).await;
        let mut members = Vec::new();
        for (n, i) in ids.iter().enumerate() {
            members.push(reserve_in_task_tok(store, i, "fp", LONG));
            until_lookups_waiting(store, n + 1).await;
        }
        first.resume();
        let watcher = sqlx::PgPool::connect(url).await.unwrap();
        backend_of(&watcher, schema, "%idem-group%", Some("PgSleep")).await;
        Running {
            second,
            turns,
            members,
            watcher,
        }
    }

    type Completing = tokio::task::JoinHandle<Result<(), StoreError>>;

    /// Completions queued behind one that holds the turn: every key of
    /// `ids` is reserved; the first's completion stops at its turn, then
    /// the others' (each storing `response` of its key) queue behind it.
    struct Queued {
        leases: Vec<idem::store::Lease>,
        turn: idem_runtime::pause::Pause,
        first: Completing,
        rest: Vec<Completing>,
    }

    async fn completions_queued(store: &idem::PgStore, ids: &[&RecordId]) -> Queued {
        let mut leases = Vec::new();
        for i in ids {
            leases.push(take(store, i, "fp", LONG, LONG).await);
        }
        let mut turn = idem_runtime::pause::arm(idem_runtime::pause::COMPLETE_TURN, &ids[0].key);
        let first = complete_in_task(store, ids[0], &leases[0].token, &ids[0].key);
        tokio::time::timeout(Duration::from_secs(10), turn.reached())
            .await
            .expect("the completion never took its turn");
        let mut rest = Vec::new();
        for (n, i) in ids.iter().enumerate().skip(1) {
            rest.push(complete_in_task(store, i, &leases[n].token, &i.key));
            until_waiting(store, n).await;
        }
        Queued {
            leases,
            turn,
            first,
            rest,
        }
    }

    fn id(k: &str) -> RecordId {
        RecordId::new("t", "s", idem_testkit::unique(k))
    }

    async fn within<T>(what: &str, t: tokio::task::JoinHandle<T>) -> T {
        tokio::time::timeout(Duration::from_secs(20), t)
            .await
            .unwrap_or_else(|_| panic!("{what}: never answered (hang)"))
            .unwrap()
    }

    async fn until_row<F: Fn(&Option<(String, Option<String>, Option<String>)>) -> bool>(
        store: &idem::PgStore,
        id: &RecordId,
        what: &str,
        cond: F,
    ) {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let row = pg_row(store, id).await;
            if cond(&row) {
                return;
            }
            assert!(Instant::now() < deadline, "{what}: row stayed {row:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// (b) A member aborted while queued for the next group: the others get
    /// their own answers; the aborted one's key is not taken.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lookup_member_aborted_while_queued() {
        let Some((_, _, store)) = fresh_store(8, Duration::ZERO).await else {
            return;
        };
        let (a, b, c) = (id("a"), id("b"), id("c"));
        let (pauses, turns) = hold_the_lookup_turns(&store).await;
        let (_ta, ja) = reserve_in_task_tok(&store, &a, "fp", LONG);
        until_lookups_waiting(&store, 1).await;
        let (tb, jb) = reserve_in_task_tok(&store, &b, "fp", LONG);
        until_lookups_waiting(&store, 2).await;
        let (tc, jc) = reserve_in_task_tok(&store, &c, "fp", LONG);
        until_lookups_waiting(&store, 3).await;
        ja.abort();
        assert!(ja.await.unwrap_err().is_cancelled());
        let mut pauses = pauses.into_iter();
        pauses.next().unwrap().resume();
        for (name, tok, j, i) in [("b", tb, jb, &b), ("c", tc, jc, &c)] {
            let got = within(name, j).await;
            assert!(
                matches!(&got, Ok(Reservation::Reserved(l)) if l.attempt == 1),
                "{name}: {got:?}"
            );
            let (state, token, _) = pg_row(&store, i).await.unwrap();
            assert_eq!(
                (state.as_str(), token.as_deref()),
                ("in_progress", Some(tok)),
                "{name}"
            );
        }
        pauses.next().unwrap().resume();
        for t in turns {
            let _ = within("turn", t).await;
        }
        assert!(
            pg_row(&store, &a).await.is_none(),
            "the aborted member's key was taken"
        );
    }

    /// (c) A member aborted while its group's statement runs (slow: another
    /// member's insert sleeps): the others are answered; the aborted one's
    /// key, which the statement took, is handed back (not left locked).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lookup_member_aborted_while_its_group_runs() {
        let Some((url, schema, store)) = fresh_store(8, Duration::ZERO).await else {
            return;
        };
        slow_inserts(&store, 1.5).await;
        let a = id("aaa");
        let s = id("slow");
        let Running {
            second,
            turns,
            members,
            watcher: _,
        } = a_group_running(&url, &schema, &store, &[&a, &s]).await;
        let [(_, ja), (ts, js)] = <[Reserving; 2]>::try_from(members).unwrap_or_else(|_| unreachable!());
        ja.abort();
        assert!(ja.await.unwrap_err().is_cancelled());
        let got = within("slow", js).await;
        assert!(matches!(&got, Ok(Reservation::Reserved(_))), "{got:?}");
        let (state, token, _) = pg_row(&store, &s).await.unwrap();
        assert_eq!((state.as_str(), token.as_deref()), ("in_progress", Some(ts)));
        second.resume();
        for t in turns {
            let _ = within("turn", t).await;
        }
        until_row(&store, &a, "aborted member's key handed back", |r| r.is_none()).await;
        let again = reserve(&store, &a, "fp", LONG, LONG).await;
        assert!(
            matches!(&again, Reservation::Reserved(l) if l.attempt == 1 && !l.is_takeover()),
            "{again:?}"
        );
    }

    /// (a) The turn holder aborted while stopped at its turn: the queued members
    /// get their answers (the turn is passed on).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lookup_leader_aborted_at_its_turn() {
        let Some((_, _, store)) = fresh_store(8, Duration::ZERO).await else {
            return;
        };
        let (b, c) = (id("b"), id("c"));
        let (pauses, turns) = hold_the_lookup_turns(&store).await;
        let (tb, jb) = reserve_in_task_tok(&store, &b, "fp", LONG);
        until_lookups_waiting(&store, 1).await;
        let (tc, jc) = reserve_in_task_tok(&store, &c, "fp", LONG);
        until_lookups_waiting(&store, 2).await;
        let mut turns = turns.into_iter();
        let first = turns.next().unwrap();
        first.abort();
        assert!(first.await.unwrap_err().is_cancelled());
        for (name, tok, j, i) in [("b", tb, jb, &b), ("c", tc, jc, &c)] {
            let got = within(name, j).await;
            assert!(matches!(&got, Ok(Reservation::Reserved(_))), "{name}: {got:?}");
            assert_eq!(pg_row(&store, i).await.unwrap().1.as_deref(), Some(tok), "{name}");
        }
        drop(pauses);
        for t in turns {
            let _ = within("turn", t).await;
        }
        // The queue is not stuck: a later reservation is answered.
        let d = id("d");
        let _ = take(&store, &d, "fp", LONG, LONG).await;
    }

    /// (a) The turn holder aborted while its own statement runs (its insert
    /// waits for another transaction's uncommitted insert of the same key).
    /// Members queued meanwhile are answered; the aborted reservation may
    /// commit afterwards, but then only as a crash leaves it: taken over once
    /// its (short) lock deadline passes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lookup_leader_aborted_mid_statement() {
        let Some((url, schema, store)) = fresh_store(8, Duration::ZERO).await else {
            return;
        };
        let k = id("leader");
        let holders = sqlx::PgPool::connect(&url).await.unwrap();
        let holder = insert_uncommitted(&holders, &store, &[&k]).await;
        let (tk, jk) = reserve_in_task_tok(&store, &k, "fp", Duration::from_millis(800));
        let watcher = sqlx::PgPool::connect(&url).await.unwrap();
        let _pid = backend_of(&watcher, &schema, "SELECT p.fingerprint%", Some("transactionid")).await;
        jk.abort();
        assert!(jk.await.unwrap_err().is_cancelled());
        // Other reservations meanwhile.
        let others: Vec<_> = (0..4).map(|n| (n, id("o"))).collect();
        let mut tasks = Vec::new();
        for (_, o) in &others {
            tasks.push(reserve_in_task_tok(&store, o, "fp", LONG));
        }
        for ((tok, j), (n, o)) in tasks.into_iter().zip(&others) {
            let got = within("other", j).await;
            assert!(matches!(&got, Ok(Reservation::Reserved(_))), "{n}: {got:?}");
            assert_eq!(pg_row(&store, o).await.unwrap().1.as_deref(), Some(tok));
        }
        // The holder goes away: the aborted statement's insert may now commit.
        holder.rollback().await.unwrap();
        until_row(&store, &k, "the aborted statement settled", |r| {
            r.as_ref().is_some_and(|(_, t, _)| t.as_deref() == Some(tk)) || r.is_none()
        })
        .await;
        // Never forever: past the lock deadline it is taken over.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match reserve(&store, &k, "fp", LONG, LONG).await {
                Reservation::Reserved(_) => break,
                Reservation::InProgress { .. } => {}
                other => panic!("{other:?}"),
            }
            assert!(
                Instant::now() < deadline,
                "the aborted reservation's key stayed locked"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// (a) The completion holding the turn aborted while stopped at it: the
    /// queued completions are written, each its own answer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn completion_leader_aborted_at_its_turn() {
        let Some((_, _, store)) = fresh_store(8, LONG).await else {
            return;
        };
        // One turn to write: the completions after the one stopped at its turn queue.
        let store = store.with_completion_turns(1);
        let ids: Vec<RecordId> = ["first", "b", "c"].iter().map(|k| id(k)).collect();
        let Queued {
            leases,
            turn,
            first,
            rest,
        } = completions_queued(&store, &[&ids[0], &ids[1], &ids[2]]).await;
        let [b, c] = <[Completing; 2]>::try_from(rest).unwrap_or_else(|_| unreachable!());
        first.abort();
        assert!(first.await.unwrap_err().is_cancelled());
        assert_eq!(within("b", b).await, Ok(()));
        assert_eq!(within("c", c).await, Ok(()));
        drop(turn);
        for i in &ids[1..] {
            assert_eq!(
                reserve(&store, i, "fp", LONG, LONG).await,
                Reservation::Completed(response(&i.key))
            );
        }
        let (state, token, _) = pg_row(&store, &ids[0]).await.unwrap();
        assert_eq!(
            (state.as_str(), token.as_deref()),
            ("in_progress", Some(leases[0].token.as_str()))
        );
        store
            .complete(&ids[0], &leases[0].token, &response("first"))
            .await
            .unwrap();
    }

    /// (b) A completion aborted while queued: not written; the others are.
    /// (c) One aborted while its group's statement runs (another member's
    /// update sleeps in a trigger): the others are answered their own outcome.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn completion_members_aborted_queued_and_in_flight() {
        let Some((url, schema, store)) = fresh_store(8, LONG).await else {
            return;
        };
        // One turn to write: the completions after the one stopped at its turn queue.
        let store = store.with_completion_turns(1);
        slow_completions(&store, 1.5).await;
        let ids: Vec<RecordId> = ["first", "q", "b", "f", "slow"].iter().map(|k| id(k)).collect();
        let Queued {
            leases,
            turn,
            first,
            rest: mut tasks,
        } = completions_queued(&store, &ids.iter().collect::<Vec<_>>()).await;
        // q aborted while queued.
        let q = tasks.remove(0);
        q.abort();
        assert!(q.await.unwrap_err().is_cancelled());
        turn.resume();
        let watcher = sqlx::PgPool::connect(&url).await.unwrap();
        let _ = backend_of(&watcher, &schema, "WITH c AS%", Some("PgSleep")).await;
        // f aborted while its group's statement runs.
        let f = tasks.remove(1);
        f.abort();
        assert!(f.await.unwrap_err().is_cancelled());
        assert_eq!(within("first", first).await, Ok(()));
        assert_eq!(within("b", tasks.remove(0)).await, Ok(()));
        assert_eq!(within("slow", tasks.remove(0)).await, Ok(()));
        for n in [0, 2, 4] {
            assert_eq!(
                reserve(&store, &ids[n], "fp", LONG, LONG).await,
                Reservation::Completed(response(&ids[n].key)),
            );
        }
        let (state, token, _) = pg_row(&store, &ids[1]).await.unwrap();
        assert_eq!(
            (state.as_str(), token.as_deref()),
            ("in_progress", Some(leases[1].token.as_str())),
            "a completion aborted while queued was written"
        );
        let f_row = pg_row(&store, &ids[3]).await.unwrap();
        assert!(
            f_row.0 == "completed" && f_row.2 == Some(format!("{{\"id\":\"{}\"}}", ids[3].key))
                || f_row.0 == "in_progress" && f_row.1.as_deref() == Some(leases[3].token.as_str()),
            "{f_row:?}"
        );
    }

    /// A store whose sessions have `statement_timeout` (as a role setting
    /// would give them).
    async fn store_with_statement_timeout(ms: u32) -> Option<(String, String, idem::PgStore)> {
        let url = idem_testkit::pg_url()?;
        let schema = idem_testkit::pg_schema(&url).await;
        // Migrate with a plain store first.
        let _ = idem_testkit::pg_store_in(&url, &schema, 2).await;
        let sep = if url.contains('?') { '&' } else { '?' };
        let timed = format!("{url}{sep}options=-c%20statement_timeout%3D{ms}");
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(8)
            .connect(&timed)
            .await
            .unwrap();
        let st: String = sqlx::query_scalar("SHOW statement_timeout")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(st, format!("{ms}ms"));
        let store = idem::PgStore::new(pool)
            .with_table(Some(&schema), "idempotency_keys")
            .unwrap()
            .with_timeout(Duration::from_secs(10))
            .with_replay_cache(Duration::ZERO);
        Some((url, schema, store))
    }

    /// A lookup group cancelled by statement_timeout (one insert sleeps past
    /// it): every member gets an error or its own right answer; nothing is
    /// taken for a member told an error; nothing is taken twice.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lookup_group_cancelled_by_statement_timeout() {
        let Some((_, _, store)) = store_with_statement_timeout(400).await else {
            return;
        };
        slow_inserts(&store, 1.0).await;
        let a = id("aaa");
        let s = id("slow");
        let z = id("zzz");
        let (pauses, turns) = hold_the_lookup_turns(&store).await;
        let mut tasks = Vec::new();
        for (n, i) in [&a, &s, &z].iter().enumerate() {
            tasks.push(reserve_in_task_tok(&store, i, "fp", LONG));
            until_lookups_waiting(&store, n + 1).await;
        }
        let mut pauses = pauses.into_iter();
        pauses.next().unwrap().resume();
        for ((tok, j), i) in tasks.into_iter().zip([&a, &s, &z]) {
            let got = within(&i.key, j).await;
            let row = pg_row(&store, i).await;
            match got {
                Ok(Reservation::Reserved(_)) => {
                    assert_eq!(row.as_ref().and_then(|r| r.1.as_deref()), Some(tok), "{}", i.key)
                }
                Err(e) => {
                    assert!(e.is_unavailable(), "{}: {e:?}", i.key);
                    assert!(
                        row.as_ref().is_none_or(|r| r.1.as_deref() != Some(tok)),
                        "{}: told an error but taken: {row:?}",
                        i.key
                    )
                }
                other => panic!("{}: {other:?}", i.key),
            }
        }
        pauses.next().unwrap().resume();
        for t in turns {
            let _ = within("turn", t).await;
        }
    }

    /// A completion group cancelled by statement_timeout (one member's update
    /// sleeps past it): each member gets its own outcome; the slow one is
    /// told it failed and nothing of it is stored; it can then be released
    /// and retried (attempt 2), never replayed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn completion_group_cancelled_by_statement_timeout() {
        let Some((_, _, store)) = store_with_statement_timeout(400).await else {
            return;
        };
        // One turn to write: the completions after the one stopped at its turn queue.
        let store = store.with_completion_turns(1);
        slow_completions(&store, 1.0).await;
        let first = id("first");
        let a = id("aaa");
        let s = id("slow");
        let z = id("zzz");
        let Queued {
            leases,
            turn,
            first: ft,
            rest: tasks,
        } = completions_queued(&store, &[&first, &a, &s, &z]).await;
        turn.resume();
        assert_eq!(within("first", ft).await, Ok(()));
        let mut outs = Vec::new();
        for (j, i) in tasks.into_iter().zip([&a, &s, &z]) {
            let got = within(&i.key, j).await;
            outs.push(got);
        }
        assert_eq!(outs[0], Ok(()));
        assert_eq!(outs[2], Ok(()));
        // Cancelled by the session's `statement_timeout` (57014): the store
        // did not answer in time, as at idem's own timeout.
        assert!(matches!(&outs[1], Err(e) if e.is_unavailable()), "{:?}", outs[1]);
        for (i, tag) in [(&a, a.key.clone()), (&z, z.key.clone())] {
            assert_eq!(
                reserve(&store, i, "fp", LONG, LONG).await,
                Reservation::Completed(response(&tag))
            );
        }
        let (state, token, _) = pg_row(&store, &s).await.unwrap();
        assert_eq!(
            (state.as_str(), token.as_deref()),
            ("in_progress", Some(leases[2].token.as_str()))
        );
        store.release(&s, &leases[2].token).await.unwrap();
        let again = take(&store, &s, "fp", LONG, LONG).await;
        assert_eq!(again.attempt, 2);
    }

    /// The pool closed (`pool.close()`) while members wait for the next group
    /// and while a group's statement runs: every member is answered (an error
    /// or its own answer), none hangs.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pool_closed_mid_group() {
        let Some((url, schema, store)) = fresh_store(8, Duration::ZERO).await else {
            return;
        };
        slow_inserts(&store, 1.0).await;
        let a = id("aaa");
        let s = id("slow");
        let Running {
            second,
            turns,
            members: tasks,
            watcher,
        } = a_group_running(&url, &schema, &store, &[&a, &s]).await;
        // Two more queue behind the running group.
        let b = id("bbb");
        let c = id("ccc");
        let mut later = Vec::new();
        for i in [&b, &c] {
            later.push(reserve_in_task_tok(&store, i, "fp", LONG));
        }
        let closing = {
            let pool = store.pool().clone();
            tokio::spawn(async move { pool.close().await })
        };
        for ((tok, j), i) in tasks.into_iter().chain(later).zip([&a, &s, &b, &c]) {
            let got = within(&i.key, j).await;
            let row: Option<(String, Option<String>)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT state, lock_token FROM {} WHERE tenant = $1 AND scope = $2 AND key = $3",
                pg_table(&store)
            )))
            .bind(&i.tenant)
            .bind(&i.scope)
            .bind(&i.key)
            .fetch_optional(&watcher)
            .await
            .unwrap();
            match got {
                Ok(Reservation::Reserved(_)) => assert_eq!(row.and_then(|r| r.1).as_deref(), Some(tok)),
                Err(_) => assert!(row.is_none(), "{}: refused, yet taken: {row:?}", i.key),
                other => panic!("{other:?}"),
            }
        }
        drop(second);
        for t in turns {
            let _ = within("turn", t).await;
        }
        within("close", closing).await;
    }

    mod http {
        use super::*;
        use axum::extract::State;
        use axum::http::StatusCode;
        use axum::routing::post;
        use axum::{Json, Router};
        use idem::{idempotent, Idem, Operation};
        use idem_testkit::http::post as post_req;
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;

        #[derive(Clone, Default)]
        pub(crate) struct App {
            runs: Arc<AtomicUsize>,
        }

        #[derive(serde::Deserialize)]
        pub(crate) struct Body {
            amount: i64,
        }

        #[idempotent(scope = "zz.quick", fields(amount))]
        async fn quick(State(app): State<App>, op: Operation, Json(_b): Json<Body>) -> (StatusCode, String) {
            let n = app.runs.fetch_add(1, Ordering::SeqCst) + 1;
            (
                StatusCode::CREATED,
                format!("{{\"run\":{n},\"attempt\":{}}}", op.attempt()),
            )
        }

        /// Request 1 holds a lookup turn (stopped at it), a store-level
        /// reservation the other; request 2 queues for the next group; then
        /// request 1's client disconnects. Both operations run once, their
        /// retries replay; nothing stays locked.
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn http_leader_client_disconnects() {
            let Some((_, _, store)) = fresh_store(8, Duration::ZERO).await else {
                return;
            };
            let app = App::default();
            let router = Router::new()
                .route("/quick", post(quick))
                .layer(Idem::new(store.clone()).single_tenant().layer())
                .with_state(app.clone());
            let addr = idem_testkit::http::serve(router).await;
            let k1 = idem_testkit::unique("lead");
            let k2 = idem_testkit::unique("member");
            let mut p1 = idem_runtime::pause::arm(idem_runtime::pause::RESERVE_TURN, &k1);
            let conn1 = post_req("/quick", "{\"amount\": 1}").key(&k1).start(addr).await;
            tokio::time::timeout(Duration::from_secs(10), p1.reached())
                .await
                .unwrap();
            // The second turn.
            let other = RecordId::new("", "zz.other", idem_testkit::unique("t2"));
            let l = take(&store, &other, "fp", LONG, LONG).await;
            store.complete(&other, &l.token, &response("o")).await.unwrap();
            let mut p2 = idem_runtime::pause::arm(idem_runtime::pause::RESERVE_TURN, &other.key);
            let t2 = reserve_in_task_tok(&store, &other, "fp", LONG).1;
            tokio::time::timeout(Duration::from_secs(10), p2.reached())
                .await
                .unwrap();
            let r2 = {
                let k2 = k2.clone();
                tokio::spawn(async move { post_req("/quick", "{\"amount\": 2}").key(&k2).send(addr).await })
            };
            until_lookups_waiting(&store, 1).await;
            drop(conn1);
            // The server sees the disconnect (or not: either way the protocol goes on).
            p1.resume();
            let r2 = within("request 2", r2).await;
            assert_eq!(r2.status, 201);
            p2.resume();
            let _ = within("turn 2", t2).await;
            let id1 = RecordId::new("", "zz.quick", k1.clone());
            until_row(
                &store,
                &id1,
                "the disconnected leader's execution completed",
                |r| r.as_ref().is_some_and(|r| r.0 == "completed"),
            )
            .await;
            let again = post_req("/quick", "{\"amount\": 1}").key(&k1).send(addr).await;
            assert_eq!(
                (again.status, again.header("idempotent-replayed")),
                (201, Some("true"))
            );
            let again2 = post_req("/quick", "{\"amount\": 2}").key(&k2).send(addr).await;
            assert_eq!((again2.status, again2.body.clone()), (201, r2.body.clone()));
            assert_eq!(app.runs.load(Ordering::SeqCst), 2);
        }
    }

    /// The completion group's backend is terminated while it holds the row
    /// locks of the members it updated (the last one's trigger sleeps): each
    /// member is told an error; nothing is stored; each completes afterwards
    /// with its own answer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn completion_group_killed_holding_row_locks() {
        let Some((url, schema, store)) = fresh_store(8, LONG).await else {
            return;
        };
        // One turn to write: the completions after the one stopped at its turn queue.
        let store = store.with_completion_turns(1);
        slow_completions(&store, 5.0).await;
        let first = id("first");
        let a = id("aaa");
        let b = id("bbb");
        let s = id("slow");
        let all = [&first, &a, &b, &s];
        let Queued {
            leases,
            turn,
            first: ft,
            rest: tasks,
        } = completions_queued(&store, &all).await;
        turn.resume();
        assert_eq!(within("first", ft).await, Ok(()));
        let watcher = sqlx::PgPool::connect(&url).await.unwrap();
        let pid = backend_of(&watcher, &schema, "WITH c AS%", Some("PgSleep")).await;
        // a's and b's rows are locked by the group now (the update reached s).
        let locked: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM (SELECT 1 FROM {} WHERE key = ANY($1) FOR UPDATE SKIP LOCKED) AS f",
            pg_table(&store)
        )))
        .bind(vec![a.key.clone(), b.key.clone()])
        .fetch_one(&watcher)
        .await
        .unwrap();
        assert_eq!(locked, 0, "the group holds a's and b's rows while it sleeps on s");
        assert!(terminate(&watcher, pid).await);
        let mut outs = Vec::new();
        for (j, i) in tasks.into_iter().zip([&a, &b, &s]) {
            let got = within(&i.key, j).await;
            outs.push(got);
        }
        for (n, (out, i)) in outs.iter().zip([&a, &b, &s]).enumerate() {
            let (state, token, body) = pg_row(&store, i).await.unwrap();
            match out {
                Ok(()) => assert_eq!(
                    body.as_deref(),
                    Some(format!("{{\"id\":\"{}\"}}", i.key).as_str())
                ),
                Err(_) => {
                    assert_eq!(
                        (state.as_str(), token.as_deref()),
                        ("in_progress", Some(leases[n + 1].token.as_str())),
                        "{}: told it failed, but stored",
                        i.key
                    );
                }
            }
        }
    }

    /// A member whose group answered it (the key taken for it) but whose
    /// caller dropped the reservation before reading the answer: the key is
    /// left as a crash leaves it, in progress until its lock deadline, then
    /// taken over by the same request; never locked forever, and never
    /// answered to another.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lookup_member_answered_then_dropped_unread() {
        let Some((_, _, store)) = fresh_store(8, Duration::ZERO).await else {
            return;
        };
        let (a, b) = (id("a"), id("b"));
        let (pauses, turns) = hold_the_lookup_turns(&store).await;
        let tok_a = idem_testkit::token();
        let lock = Duration::from_millis(1500);
        let mut fut_a = store.reserve(ReserveRequest {
            id: &a,
            fingerprint: "fp",
            token: tok_a,
            ttl: LONG,
            lock_timeout: lock,
        });
        // Polled once: it queues.
        let waker = futures_util::task::noop_waker();
        let mut cx = std::task::Context::from_waker(&waker);
        assert!(std::future::Future::poll(fut_a.as_mut(), &mut cx).is_pending());
        until_lookups_waiting(&store, 1).await;
        let (tb, jb) = reserve_in_task_tok(&store, &b, "fp", LONG);
        until_lookups_waiting(&store, 2).await;
        let mut pauses = pauses.into_iter();
        pauses.next().unwrap().resume();
        let got = within("b", jb).await;
        assert!(matches!(&got, Ok(Reservation::Reserved(_))), "{got:?}");
        assert_eq!(pg_row(&store, &b).await.unwrap().1.as_deref(), Some(tb));
        // The group took a's key for it; its caller drops it unread.
        drop(fut_a);
        pauses.next().unwrap().resume();
        for t in turns {
            let _ = within("turn", t).await;
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match reserve(&store, &a, "fp", LONG, LONG).await {
                Reservation::Reserved(l) => {
                    assert_eq!((l.attempt, l.takeover), (2, true), "taken over, as after a crash");
                    break;
                }
                Reservation::InProgress { .. } => {}
                other => panic!("{other:?}"),
            }
            assert!(Instant::now() < deadline, "a stayed locked");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A lookup of a key in the next group while the running group holds a
    /// lookup of the same key (sorted after a slow insert): exactly one of the
    /// two takes it; the other is told it is in progress.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn same_key_in_the_next_group_while_one_runs() {
        let Some((url, schema, store)) = fresh_store(8, Duration::ZERO).await else {
            return;
        };
        slow_inserts(&store, 1.5).await;
        let s = id("slow");
        let k = id("zzz");
        let x = id("xxx");
        let Running {
            second,
            turns,
            members: g1,
            watcher: _,
        } = a_group_running(&url, &schema, &store, &[&s, &k]).await;
        until_lookups_waiting(&store, 0).await;
        // The next group: the same key, and another.
        let mut g2 = Vec::new();
        for i in [&k, &x] {
            g2.push(reserve_in_task_tok(&store, i, "fp", LONG));
        }
        let mut answers = Vec::new();
        for ((tok, j), name) in g1.into_iter().chain(g2).zip(["s", "k1", "k2", "x"]) {
            let got = within(name, j).await;
            answers.push((tok, got));
        }
        second.resume();
        for t in turns {
            let _ = within("turn", t).await;
        }
        let holders: Vec<&str> = [&answers[1], &answers[2]]
            .iter()
            .filter(|(_, a)| matches!(a, Ok(Reservation::Reserved(_))))
            .map(|(t, _)| *t)
            .collect();
        assert_eq!(holders.len(), 1, "{answers:?}");
        assert_eq!(pg_row(&store, &k).await.unwrap().1.as_deref(), Some(holders[0]));
        for i in [1, 2] {
            assert!(
                matches!(
                    answers[i].1,
                    Ok(Reservation::Reserved(_)) | Ok(Reservation::InProgress { .. })
                ),
                "{:?}",
                answers[i]
            );
        }
    }

    /// A member whose store call times out (the store's own timeout) while its
    /// group's statement runs, the statement then taking its key: the key is
    /// given back (contract: "a store call that times out never leaves a lock
    /// that no execution holds"), and the same request then takes it afresh.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lookup_member_store_timeout_then_group_takes_its_key() {
        let Some((_, _, store)) = fresh_store(8, Duration::ZERO).await else {
            return;
        };
        let store = store.with_timeout(Duration::from_millis(400));
        slow_inserts(&store, 1.5).await;
        let watcher = sqlx::PgPool::connect(&idem_testkit::pg_url().unwrap())
            .await
            .unwrap();
        let a = id("aaa");
        let s = id("slow");
        let (pauses, turns) = hold_the_lookup_turns(&store).await;
        let mut tasks = Vec::new();
        for (n, i) in [&a, &s].iter().enumerate() {
            tasks.push(reserve_in_task_tok(&store, i, "fp", LONG));
            until_lookups_waiting(&store, n + 1).await;
        }
        let mut pauses = pauses.into_iter();
        pauses.next().unwrap().resume();
        let mut outs = Vec::new();
        for ((tok, j), i) in tasks.into_iter().zip([&a, &s]) {
            let got = within(&i.key, j).await;
            outs.push((tok, got));
        }
        drop(pauses);
        for t in turns {
            let _ = within("turn", t).await;
        }
        // The group's statement ends (it ran on after its callers gave up).
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND query LIKE '%idem-group%' \
                 AND query LIKE '%' || $1 || '%'",
            )
            .bind(schema_of(&store))
            .fetch_one(&watcher)
            .await
            .unwrap();
            if n == 0 {
                break;
            }
            assert!(Instant::now() < deadline);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        for ((tok, out), i) in outs.iter().zip([&a, &s]) {
            if out.is_err() {
                until_row(&store, i, "a timed-out member's key given back", |r| {
                    r.as_ref().is_none_or(|r| r.1.as_deref() != Some(*tok))
                })
                .await;
                if i.key.starts_with("aaa") {
                    let again = reserve(&store, i, "fp", LONG, LONG).await;
                    assert!(matches!(&again, Reservation::Reserved(_)), "{}: {again:?}", i.key);
                }
            }
        }
    }
}

/// A record's row held for long by another transaction (a test connection
/// here, an operator's elsewhere) while its execution completes: every try
/// of that completion, and of the release after it, gives up at the
/// store's timeout on the server too, so its connection comes back. Before,
/// each kept waiting for the row on the server with its connection, the
/// pool was used up, and another key's completion, on a row nobody held,
/// failed: its client got 503 and its retry ran the handler again.
mod held_rows {
    use super::*;
    use axum::extract::State;
    use axum::http::StatusCode;
    use axum::routing::post;
    use axum::{Json, Router};
    use idem::{idempotent, Idem, Operation};
    use idem_testkit::http::post as post_req;
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Runs(Arc<Mutex<HashMap<String, usize>>>);

    #[derive(serde::Deserialize)]
    struct Body {
        #[allow(dead_code)]
        amount: i64,
    }

    #[idempotent(scope = "held.pay", fields(amount))]
    async fn pay(State(runs): State<Runs>, op: Operation, Json(_b): Json<Body>) -> (StatusCode, String) {
        let n = {
            let mut runs = runs.0.lock().unwrap();
            let n = runs.entry(op.key().to_owned()).or_default();
            *n += 1;
            *n
        };
        (StatusCode::CREATED, format!("{{\"run\":{n}}}"))
    }

    /// `pay` served on a store of its own schema, with a small pool and a
    /// short timeout, to use the pool up quickly.
    struct PayApp {
        url: String,
        schema: String,
        store: idem::PgStore,
        runs: Runs,
        addr: std::net::SocketAddr,
    }

    impl PayApp {
        async fn start() -> Option<Self> {
            let url = idem_testkit::pg_url()?;
            let schema = idem_testkit::pg_schema(&url).await;
            let store = idem_testkit::pg_store_in(&url, &schema, 4)
                .await
                .with_timeout(Duration::from_millis(300));
            let runs = Runs::default();
            let router = Router::new()
                .route("/pay", post(pay))
                .layer(Idem::new(store.clone()).single_tenant().layer())
                .with_state(runs.clone());
            let addr = idem_testkit::http::serve(router).await;
            Some(Self {
                url,
                schema,
                store,
                runs,
                addr,
            })
        }

        /// A request of `key`, sent in a task of its own.
        fn send(&self, key: &str) -> tokio::task::JoinHandle<idem_testkit::http::Reply> {
            let (addr, key) = (self.addr, key.to_owned());
            tokio::spawn(async move { post_req("/pay", "{\"amount\": 1}").key(&key).send(addr).await })
        }

        /// How many times `pay` ran for `key`.
        fn runs_of(&self, key: &str) -> Option<usize> {
            self.runs.0.lock().unwrap().get(key).copied()
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn postgres_a_held_row_never_fails_another_keys_completion() {
        let Some(app) = PayApp::start().await else { return };
        let (store, url) = (&app.store, &app.url);
        let (held_key, free_key) = (idem_testkit::unique("held"), idem_testkit::unique("free"));
        let held_id = RecordId::new("", "held.pay", held_key.clone());
        let send = |key: String| app.send(&key);

        // The free key's handler has returned; its completion waits.
        let mut free_returned = idem_runtime::pause::arm(idem_runtime::pause::HANDLER_RETURNED, &free_key);
        let free_first = send(free_key.clone());
        tokio::time::timeout(Duration::from_secs(10), free_returned.reached())
            .await
            .unwrap();
        // The held key's row is held once its handler returned: its
        // completion, then its release, cannot be written.
        let mut held_returned = idem_runtime::pause::arm(idem_runtime::pause::HANDLER_RETURNED, &held_key);
        let held_first = send(held_key.clone());
        tokio::time::timeout(Duration::from_secs(10), held_returned.reached())
            .await
            .unwrap();
        let holders = sqlx::PgPool::connect(url).await.unwrap();
        let holder = pg_hold_row(&holders, store, &held_id).await;
        held_returned.resume();
        let held_answer = tokio::time::timeout(Duration::from_secs(30), held_first)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(held_answer.status, 503, "{held_answer:?}");

        // The free key's completion, its row held by nobody, is recorded.
        free_returned.resume();
        let free_answer = tokio::time::timeout(Duration::from_secs(30), free_first)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            (free_answer.status, free_answer.body.as_slice()),
            (201, b"{\"run\":1}".as_slice()),
            "{free_answer:?}"
        );
        holder.rollback().await.unwrap();
        let again = send(free_key.clone()).await.unwrap();
        assert_eq!(again.header("idempotent-replayed"), Some("true"), "{again:?}");
        assert_eq!(app.runs_of(&free_key), Some(1));
    }

    // A reservation that must wait for a lock (a row another transaction
    // holds: an expired record's, a stale lock's; or a key another
    // transaction inserted and has not committed) waits on the server no
    // longer than the store's timeout. Given up on at that timeout on
    // idem's side only, each such statement kept a connection of the pool
    // until the lock was let go, so a few retries of one key used the pool
    // up, and another key's completion, on a row nobody holds, failed: its
    // handler had run, and its retry ran it again.

    /// Until no statement on `schema`'s table waits for a lock: the server let
    /// go of the reservations given up on, and of their connections.
    async fn until_no_lock_waits(pool: &sqlx::PgPool, schema: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND wait_event_type = 'Lock' \
                 AND query LIKE '%' || $1 || '%'",
            )
            .bind(schema)
            .fetch_one(pool)
            .await
            .unwrap();
            if waiting == 0 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{waiting} statements given up on still wait for a lock, each with a connection of the pool"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// An expired record (completed, TTL 1 s) of `id`, as left for the janitor.
    async fn expired_record(store: &idem::PgStore, id: &RecordId) {
        let lease = take(store, id, "old", Duration::from_secs(1), LONG).await;
        store.complete(id, &lease.token, &response("old")).await.unwrap();
        until_db(store, id, "expires_at <= now()").await;
    }

    /// How the key that two retries ask for is held by another transaction.
    #[derive(Clone, Copy)]
    enum Held {
        /// Its expired record's row, which a retry would take over.
        ExpiredRow,
        /// An insert of it, not committed (another server's reservation, its
        /// commit slow), which a retry's lookup waits for.
        UncommittedInsert,
    }

    /// Store level: two retries of a key held as `held` (each answered 503 at
    /// the store's timeout), then another key's completion, its row held by
    /// nobody, on a pool of two connections.
    async fn another_keys_completion_is_written(held: Held) {
        let Some(url) = idem_testkit::pg_url() else { return };
        let schema = idem_testkit::pg_schema(&url).await;
        let store = idem_testkit::pg_store_in(&url, &schema, 2)
            .await
            .with_timeout(Duration::from_millis(300));
        let free = RecordId::new("t", "held", idem_testkit::unique("free"));
        let free_lease = take(&store, &free, "fp", LONG, LONG).await;
        let key = RecordId::new("t", "held", idem_testkit::unique("held"));
        let holders = sqlx::PgPool::connect(&url).await.unwrap();
        let holder = match held {
            Held::ExpiredRow => {
                expired_record(&store, &key).await;
                pg_hold_row(&holders, &store, &key).await
            }
            Held::UncommittedInsert => insert_uncommitted(&holders, &store, &[&key]).await,
        };
        for n in 0..2 {
            let r = store.reserve(req(&key, "new", LONG, LONG)).await;
            assert!(matches!(&r, Err(e) if e.is_unavailable()), "retry {n}: {r:?}");
        }
        // Given up on by idem, and by the server: their connections are free.
        until_no_lock_waits(&holders, &schema).await;
        let done = store.complete(&free, &free_lease.token, &response("free")).await;
        holder.rollback().await.unwrap();
        assert!(
            done.is_ok(),
            "another key's completion, on a row nobody holds, failed: {done:?}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn postgres_a_held_takeable_row_never_fails_another_keys_completion() {
        another_keys_completion_is_written(Held::ExpiredRow).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn postgres_an_uncommitted_insert_of_a_key_never_fails_another_keys_completion() {
        another_keys_completion_is_written(Held::UncommittedInsert).await;
    }

    /// As `postgres_a_held_row_never_fails_another_keys_completion`, but
    /// the held row is that of an expired record that a new request of its
    /// key would take over, and each of its retries is given up on at the
    /// store's timeout: its wait for the row ends on the server then too,
    /// so the free key's completion finds a connection.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn postgres_http_a_held_takeable_row_never_fails_another_keys_completion() {
        let Some(app) = PayApp::start().await else { return };
        let (store, url, schema) = (&app.store, &app.url, &app.schema);
        let (held_key, free_key) = (idem_testkit::unique("held"), idem_testkit::unique("free"));
        let held_id = RecordId::new("", "held.pay", held_key.clone());
        expired_record(store, &held_id).await;
        let send = |key: String| app.send(&key);

        // The free key's handler has returned; its completion waits.
        let mut free_returned = idem_runtime::pause::arm(idem_runtime::pause::HANDLER_RETURNED, &free_key);
        let free_first = send(free_key.clone());
        tokio::time::timeout(Duration::from_secs(10), free_returned.reached())
            .await
            .unwrap();

        // The held key's expired record is held by another transaction:
        // four requests for it (a client's retries), each answered 503.
        let holders = sqlx::PgPool::connect(url).await.unwrap();
        let holder = pg_hold_row(&holders, store, &held_id).await;
        for n in 0..4 {
            let answer = send(held_key.clone()).await.unwrap();
            assert_eq!(answer.status, 503, "retry {n}: {answer:?}");
        }
        until_no_lock_waits(&holders, schema).await;

        // The free key's completion, its row held by nobody.
        free_returned.resume();
        let free_answer = tokio::time::timeout(Duration::from_secs(30), free_first)
            .await
            .unwrap()
            .unwrap();
        holder.rollback().await.unwrap();
        let lost = (
            free_answer.status,
            String::from_utf8_lossy(&free_answer.body).into_owned(),
        );
        // What the client's retry of the free key then gets, once no
        // execution holds its lock (409s until the database's deadline).
        let deadline = Instant::now() + Duration::from_secs(20);
        let retry = loop {
            let r = send(free_key.clone()).await.unwrap();
            if r.status != 409 || Instant::now() > deadline {
                break r;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let runs_of_free = app.runs_of(&free_key);
        assert_eq!(
            lost,
            (201, "{\"run\":1}".to_owned()),
            "the free key's handler ran, and its answer was lost; its retry got {} {:?}; \
             the free key's handler ran {runs_of_free:?} times",
            retry.status,
            String::from_utf8_lossy(&retry.body),
        );
        assert_eq!((retry.status, runs_of_free), (201, Some(1)), "{retry:?}");
    }

    #[derive(Clone)]
    struct Holding {
        store: idem::PgStore,
        holders: sqlx::PgPool,
        held: Arc<Mutex<Vec<sqlx::Transaction<'static, sqlx::Postgres>>>>,
    }

    /// Writes in its own transaction, then holds its record's row from
    /// another connection: the completion in its transaction waits for it.
    #[idempotent(scope = "held.tx")]
    async fn in_tx(
        State(h): State<Holding>,
        op: Operation,
    ) -> Result<(StatusCode, &'static str), idem::StoreError> {
        let mut conn = op.pg_transaction().await?;
        sqlx::query("SELECT 1")
            .execute(&mut *conn)
            .await
            .map_err(|e| idem::StoreError::backend(e.to_string()))?;
        drop(conn);
        let id = RecordId::new("", "held.tx", op.key().to_owned());
        let holder = pg_hold_row(&h.holders, &h.store, &id).await;
        h.held.lock().unwrap().push(holder);
        Ok((StatusCode::CREATED, "tx"))
    }

    #[idempotent(scope = "held.plain")]
    async fn plain() -> (StatusCode, &'static str) {
        (StatusCode::CREATED, "plain")
    }

    /// The same for the completion written in the handler's transaction:
    /// its wait for the held row ends on the server at the timeout, so the
    /// `ROLLBACK` after it does not wait with the connection, and with a
    /// pool of two, two such keys leave a third key's request served.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn postgres_a_held_row_never_holds_a_transactions_connection() {
        let Some(url) = idem_testkit::pg_url() else { return };
        let schema = idem_testkit::pg_schema(&url).await;
        let store = idem_testkit::pg_store_in(&url, &schema, 2)
            .await
            .with_timeout(Duration::from_millis(300));
        let holding = Holding {
            store: store.clone(),
            holders: sqlx::PgPool::connect(&url).await.unwrap(),
            held: Arc::default(),
        };
        let router = Router::new()
            .route("/tx", post(in_tx))
            .route("/plain", post(plain))
            .layer(Idem::new(store.clone()).single_tenant().layer())
            .with_state(holding.clone());
        let addr = idem_testkit::http::serve(router).await;
        for n in 0..2 {
            let key = idem_testkit::unique(&format!("held-tx-{n}"));
            let held = post_req("/tx", "{}").key(&key).send(addr).await;
            assert_eq!(held.status, 503, "{held:?}");
        }
        let free = post_req("/plain", "{}")
            .key(&idem_testkit::unique("free"))
            .send(addr)
            .await;
        assert_eq!(free.status, 201, "another key's request was held up: {free:?}");
        holding.held.lock().unwrap().clear();
    }
}

/// A row of a group that the database refuses with an error of its own (a
/// trigger's, here one raising a SQLSTATE of the classes that otherwise
/// say the database is out of reach: 08, as dblink or postgres_fdw raise
/// for a remote they cannot reach, and 53) fails only its own request: the
/// other members of its group are answered their own outcome.
mod refused_rows {
    use super::*;

    /// The codes: a serialization failure (40001, as before) and the two
    /// classes a group took for the database out of reach.
    const CODES: [&str; 3] = ["40001", "08006", "53300"];

    /// A trigger on `event` (`INSERT` or `UPDATE`) raising `code` for the
    /// rows whose key starts with `bad`.
    async fn refuse_bad_rows(store: &idem::PgStore, schema: &str, event: &str, code: &str) {
        let table = pg_table(store);
        for ddl in [
            format!(
                "CREATE OR REPLACE FUNCTION \"{schema}\".refuse() RETURNS trigger LANGUAGE plpgsql AS \
                 $$ BEGIN IF NEW.key LIKE 'bad%' THEN RAISE EXCEPTION 'refused by a trigger' \
                 USING ERRCODE = '{code}'; END IF; RETURN NEW; END $$"
            ),
            format!("DROP TRIGGER IF EXISTS refuse ON {table}"),
            format!(
                "CREATE TRIGGER refuse BEFORE {event} ON {table} FOR EACH ROW \
                 EXECUTE FUNCTION \"{schema}\".refuse()"
            ),
        ] {
            sqlx::query(sqlx::AssertSqlSafe(ddl))
                .execute(store.pool())
                .await
                .unwrap();
        }
    }

    fn members() -> Vec<RecordId> {
        ["good-1", "bad", "good-2"]
            .iter()
            .map(|k| RecordId::new("t", "s", idem_testkit::unique(k)))
            .collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_a_completion_refused_in_a_group_fails_only_itself() {
        for code in CODES {
            let Some((_, schema, store)) = fresh_store(8, Duration::ZERO).await else {
                return;
            };
            // One turn to write: the completions after the one stopped at its turn queue.
            let store = store.with_completion_turns(1);
            let first = RecordId::new("t", "s", idem_testkit::unique("first"));
            let ids = members();
            let mut tokens = Vec::new();
            for id in std::iter::once(&first).chain(&ids) {
                tokens.push(take(&store, id, "fp", LONG, LONG).await.token);
            }
            refuse_bad_rows(&store, &schema, "UPDATE", code).await;
            // The first completion takes the turn and stops there: the
            // others queue, and are written as one group when it goes on.
            let mut turn = idem_runtime::pause::arm(idem_runtime::pause::COMPLETE_TURN, &first.key);
            let first_task = complete_in_task(&store, &first, &tokens[0], "first");
            tokio::time::timeout(Duration::from_secs(10), turn.reached())
                .await
                .unwrap();
            let mut tasks = Vec::new();
            for (n, (id, token)) in ids.iter().zip(&tokens[1..]).enumerate() {
                tasks.push(complete_in_task(&store, id, token, &id.key));
                until_waiting(&store, n + 1).await;
            }
            turn.resume();
            assert_eq!(first_task.await.unwrap(), Ok(()), "{code}");
            for (id, task) in ids.iter().zip(tasks) {
                let got = tokio::time::timeout(Duration::from_secs(20), task)
                    .await
                    .unwrap()
                    .unwrap();
                let state = pg_row(&store, id).await.unwrap().0;
                if id.key.starts_with("bad") {
                    assert!(got.is_err(), "{code}: the refused row was written: {got:?}");
                    assert_eq!(state, "in_progress", "{code}");
                } else {
                    assert_eq!(got, Ok(()), "{code}: {} failed with the refused row", id.key);
                    assert_eq!(state, "completed", "{code}: {}", id.key);
                }
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_a_reservation_refused_in_a_group_fails_only_itself() {
        for code in CODES {
            let Some((_, schema, store)) = fresh_store(8, Duration::ZERO).await else {
                return;
            };
            refuse_bad_rows(&store, &schema, "INSERT", code).await;
            let (pauses, turns) = hold_the_lookup_turns(&store).await;
            let ids = members();
            let mut tasks = Vec::new();
            for (n, id) in ids.iter().enumerate() {
                tasks.push(reserve_in_task_tok(&store, id, "fp", LONG));
                until_lookups_waiting(&store, n + 1).await;
            }
            let [first, second] = pauses;
            first.resume();
            let answers = answers_of(tasks).await;
            drop(second);
            for turn in turns {
                let _ = turn.await;
            }
            for (id, (_, got)) in ids.iter().zip(&answers) {
                if id.key.starts_with("bad") {
                    assert!(got.is_err(), "{code}: the refused row was reserved: {got:?}");
                } else {
                    assert!(
                        matches!(got, Ok(Reservation::Reserved(_))),
                        "{code}: {} failed with the refused row: {got:?}",
                        id.key
                    );
                }
            }
        }
    }
}

/// PostgreSQL: a reservation waiting in a lookup group whose caller is
/// gone before the group answers, when the group's statement committed but
/// its answer never arrived (the connection cut after the commit: an
/// outcome not known). The group's task hands its key back, fenced by its
/// token, as it does for one whose caller is gone after an answer: no lock
/// is left that nobody holds.
///
/// The ordering: pause points (the two lookup turns), the queue's counter,
/// a TCP proxy between the store and PostgreSQL that holds the server's
/// replies to the group's statement and then cuts the connections, and the
/// row seen committed from a direct connection.
mod unknown_outcome {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    struct Proxy {
        port: u16,
        frozen: Arc<AtomicBool>,
        kill: tokio::sync::watch::Sender<u64>,
    }

    async fn proxy() -> Proxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let frozen = Arc::new(AtomicBool::new(false));
        let (kill, _) = tokio::sync::watch::channel(0_u64);
        let (f, k) = (frozen.clone(), kill.clone());
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let Ok(server) = tokio::net::TcpStream::connect("127.0.0.1:5432").await else {
                    continue;
                };
                let mut killed = k.subscribe();
                let frozen = f.clone();
                tokio::spawn(async move {
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    // Held on this connection only: from the execution of a
                    // group's statement (the chunk after its text was parsed).
                    let here = Arc::new(AtomicBool::new(false));
                    let up = {
                        let (here, frozen) = (here.clone(), frozen.clone());
                        async move {
                            let mut buf = vec![0_u8; 65536];
                            let mut parsed = false;
                            loop {
                                let n = match cr.read(&mut buf).await {
                                    Ok(0) | Err(_) => return,
                                    Ok(n) => n,
                                };
                                let chunk = &buf[..n];
                                if parsed && frozen.load(Ordering::SeqCst) {
                                    here.store(true, Ordering::SeqCst);
                                }
                                if chunk.windows(10).any(|w| w == b"idem-group") {
                                    parsed = true;
                                }
                                if sw.write_all(chunk).await.is_err() {
                                    return;
                                }
                            }
                        }
                    };
                    let frozen = here;
                    let down = async {
                        let mut buf = vec![0_u8; 16384];
                        loop {
                            let n = match sr.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => n,
                            };
                            while frozen.load(Ordering::SeqCst) {
                                tokio::time::sleep(Duration::from_millis(1)).await;
                            }
                            if cw.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    };
                    tokio::select! {
                        () = up => {}
                        () = down => {}
                        _ = killed.changed() => {}
                    }
                });
            }
        });
        Proxy { port, frozen, kill }
    }

    async fn token_of(direct: &sqlx::PgPool, table: &str, id: &RecordId) -> Option<Option<String>> {
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT lock_token FROM {table} WHERE tenant = $1 AND scope = $2 AND key = $3"
        )))
        .bind(&id.tenant)
        .bind(&id.scope)
        .bind(&id.key)
        .fetch_optional(direct)
        .await
        .unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_a_group_member_gone_before_an_unknown_outcome_has_its_key_handed_back() {
        let url = idem_testkit::pg_url().expect("DATABASE_URL");
        let schema = idem_testkit::pg_schema(&url).await;
        let proxy = proxy().await;
        let via_proxy = {
            let (head, tail) = url.rsplit_once('/').unwrap();
            let host = head.rsplit_once('@').map_or("postgres://", |(u, _)| u);
            format!("{host}@127.0.0.1:{}/{tail}", proxy.port)
        };
        let store = idem_testkit::pg_store_in(&via_proxy, &schema, 8)
            .await
            .with_replay_cache(Duration::ZERO);
        let direct = sqlx::PgPool::connect(&url).await.unwrap();
        let table = pg_table(&store);

        // Both lookup turns held (replays of completed records, paused at
        // their turn): what comes next queues.
        let (pauses, turns) = hold_the_lookup_turns(&store).await;

        let a = RecordId::new("t", "gone", idem_testkit::unique("a"));
        let b = RecordId::new("t", "gone", idem_testkit::unique("b"));
        let tok_a = idem_testkit::token();
        let mut fut_a = store.reserve(ReserveRequest {
            id: &a,
            fingerprint: "fp",
            token: tok_a,
            ttl: LONG,
            lock_timeout: LONG,
        });
        let waker = futures_util::task::noop_waker();
        let mut cx = std::task::Context::from_waker(&waker);
        assert!(std::future::Future::poll(fut_a.as_mut(), &mut cx).is_pending());
        until_lookups_waiting(&store, 1).await;
        let b_task = reserve_in_task(&store, &b, "fp");
        until_lookups_waiting(&store, 2).await;

        // The server's replies held from here on; the first turn goes on, and
        // the group [a, b] is sent.
        proxy.frozen.store(true, Ordering::SeqCst);
        let mut pauses = pauses.into_iter();
        pauses.next().unwrap().resume();
        // The group's statement committed: a's key is taken under its token.
        let deadline = Instant::now() + Duration::from_secs(10);
        while token_of(&direct, &table, &a).await != Some(Some(tok_a.to_owned())) {
            assert!(Instant::now() < deadline, "the group never took a's key");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        // a's caller leaves before the group's answer arrives.
        drop(fut_a);
        // The answer never arrives: the connections are cut.
        proxy.frozen.store(false, Ordering::SeqCst);
        proxy.kill.send_modify(|g| *g += 1);
        let b_out = tokio::time::timeout(Duration::from_secs(20), b_task)
            .await
            .unwrap()
            .unwrap();
        assert!(
            matches!(&b_out, Err(e) if e.is_unavailable()),
            "b, still there, is told the outcome is not known: {b_out:?}"
        );
        pauses.next().unwrap().resume();
        for t in turns {
            let _ = tokio::time::timeout(Duration::from_secs(20), t).await;
        }
        // The group's task has answered everyone; its hand-back of a's key is
        // bounded by the store's timeout.
        let deadline = Instant::now() + Duration::from_secs(12);
        let mut still = token_of(&direct, &table, &a).await;
        while still == Some(Some(tok_a.to_owned())) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
            still = token_of(&direct, &table, &a).await;
        }
        let retry = store.reserve(req(&a, "fp", LONG, LONG)).await;
        assert!(
        still != Some(Some(tok_a.to_owned())),
        "a's key stays locked (lock timeout: an hour) under the token of a reservation that is gone; retry: {retry:?}"
    );
        assert!(matches!(retry, Ok(Reservation::Reserved(_))), "{retry:?}");
    }
}
