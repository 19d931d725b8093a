//! A reservation that must wait for a lock (a row another transaction
//! holds: an expired record's, a stale lock's; or a key another
//! transaction inserted and has not committed) waits on the server no
//! longer than the store's timeout. Given up on at that timeout on idem's
//! side only, each such statement kept a connection of the pool until the
//! lock was let go, so a few retries of one key used the pool up, and
//! another key's completion, on a row nobody holds, failed: its handler
//! had run, and its retry ran it again.

use idem::store::{RecordId, StoredResponse};
use idem::IdempotencyStore;
use idem_testkit::records::{insert_uncommitted, pg_hold_row, pg_table, req, take};
use std::time::{Duration, Instant};

const LONG: Duration = Duration::from_secs(3600);

fn response(tag: &str) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), "application/json".into())],
        body: Some(format!("{{\"id\":\"{tag}\"}}").into_bytes()),
    }
}

/// Until the database says `cond` (SQL on the row of `id`).
async fn until_db(store: &idem::PgStore, id: &RecordId, cond: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let holds: Option<bool> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT {cond} FROM {} WHERE tenant = $1 AND scope = $2 AND key = $3",
            pg_table(store)
        )))
        .bind(&id.tenant)
        .bind(&id.scope)
        .bind(&id.key)
        .fetch_optional(store.pool())
        .await
        .unwrap();
        if holds == Some(true) {
            return;
        }
        assert!(Instant::now() < deadline, "{cond} never held");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

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

mod http {
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

    #[idempotent(scope = "heldtake.pay", fields(amount), lock_timeout = "1s")]
    async fn pay(State(runs): State<Runs>, op: Operation, Json(_b): Json<Body>) -> (StatusCode, String) {
        let n = {
            let mut runs = runs.0.lock().unwrap();
            let n = runs.entry(op.key().to_owned()).or_default();
            *n += 1;
            *n
        };
        (StatusCode::CREATED, format!("{{\"run\":{n}}}"))
    }

    /// As `postgres_a_held_row_never_fails_another_keys_completion`
    /// (tests/pg_caches_and_groups.rs), but the held row is that of an
    /// expired record that a new request of its key takes over: the free
    /// key's handler has run, and its client gets 503, its answer never
    /// recorded.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn postgres_http_a_held_takeable_row_never_fails_another_keys_completion() {
        let Some(url) = idem_testkit::pg_url() else { return };
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
        let (held_key, free_key) = (idem_testkit::unique("held"), idem_testkit::unique("free"));
        let held_id = RecordId::new("", "heldtake.pay", held_key.clone());
        expired_record(&store, &held_id).await;
        let send = |key: String| {
            tokio::spawn(async move { post_req("/pay", "{\"amount\": 1}").key(&key).send(addr).await })
        };

        // The free key's handler has returned; its completion waits.
        let mut free_returned = idem_runtime::pause::arm(idem_runtime::pause::HANDLER_RETURNED, &free_key);
        let free_first = send(free_key.clone());
        tokio::time::timeout(Duration::from_secs(10), free_returned.reached())
            .await
            .unwrap();

        // The held key's expired record is held by another transaction:
        // four requests for it (a client's retries), each answered 503.
        let holders = sqlx::PgPool::connect(&url).await.unwrap();
        let holder = pg_hold_row(&holders, &store, &held_id).await;
        for n in 0..4 {
            let answer = send(held_key.clone()).await.unwrap();
            assert_eq!(answer.status, 503, "retry {n}: {answer:?}");
        }
        until_no_lock_waits(&holders, &schema).await;

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
        let runs_of_free = runs.0.lock().unwrap().get(&free_key).copied();
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
}
