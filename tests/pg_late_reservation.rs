//! PostgreSQL: a reservation whose statement waited for a row (an
//! operator's transaction held it) longer than its lock timeout. The
//! database counts the new record's lock and TTL from the statement's
//! start, so the record it answers with has already run out there: the
//! janitor may purge it, and another request may take the key. The
//! runtime counts the lease from before the call as well, so it never
//! starts the handler on such a reservation: the client is answered 503
//! (nothing processed), the key is given back, and the one execution that
//! runs is another request's.

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem::store::RecordId;
use idem::{idempotent, Idem, IdempotencyStore};
use idem_testkit::http::post as post_req;
use idem_testkit::records::{pg_hold_row, pg_table, take};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[derive(serde::Deserialize)]
struct Pay {
    amount: u64,
}

#[idempotent(scope = "late.pay", fields(amount), lock_timeout = "300ms")]
async fn pay(State(runs): State<Arc<AtomicU32>>, Json(p): Json<Pay>) -> (StatusCode, String) {
    let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
    (StatusCode::CREATED, format!("run {run}: {}", p.amount))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_reservation_that_waited_past_its_lock_never_runs() {
    let url = idem_testkit::pg_url().expect("DATABASE_URL");
    let schema = idem_testkit::pg_schema(&url).await;
    // The store's timeout (10 s) bounds the row wait, well past the lock.
    let store = idem_testkit::pg_store_in(&url, &schema, 8).await;
    // An expired record under the key: the request below takes it afresh.
    let id = RecordId::new("", "late.pay", "late-1");
    let old = take(
        &store,
        &id,
        "old",
        Duration::from_secs(1),
        Duration::from_secs(60),
    )
    .await;
    store
        .complete(
            &id,
            &old.token,
            &idem::store::StoredResponse {
                status: 201,
                headers: vec![],
                body: None,
            },
        )
        .await
        .unwrap();
    let operators = sqlx::PgPool::connect(&url).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {} SET created_at = created_at - interval '1 hour', \
         expires_at = expires_at - interval '1 hour', purge_at = purge_at - interval '1 hour', \
         lock_expires_at = lock_expires_at - interval '1 hour' WHERE key = 'late-1'",
        pg_table(&store)
    )))
    .execute(&operators)
    .await
    .unwrap();

    let runs = Arc::new(AtomicU32::new(0));
    let app = Router::new()
        .route("/pay", post(pay))
        .layer(Idem::new(store.clone()).single_tenant().layer())
        .with_state(runs.clone());
    let addr = idem_testkit::http::serve(app).await;

    // An operator's transaction holds the record's row.
    let operator = pg_hold_row(&operators, &store, &id).await;
    let first = tokio::spawn(async move {
        post_req("/pay", r#"{"amount":100}"#)
            .key("late-1")
            .send(addr)
            .await
    });
    // Its reservation waits for the row.
    let watcher = store.pool().clone();
    let until = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE $1",
        )
        .bind(format!("%{schema}%"))
        .fetch_one(&watcher)
        .await
        .unwrap();
        if waiting > 0 {
            break;
        }
        assert!(!first.is_finished(), "the reservation did not wait for the row");
        assert!(
            std::time::Instant::now() < until,
            "the reservation never waited for the row"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Held for longer than the 300 ms lock (a duration, not an ordering).
    tokio::time::sleep(Duration::from_millis(600)).await;
    operator.commit().await.unwrap();

    let first = first.await.unwrap();
    assert_eq!(first.status, 503, "{}", String::from_utf8_lossy(&first.body));
    assert_eq!(first.problem(), "idempotency-store-unavailable");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "the late reservation ran its handler"
    );

    // Another body takes the key and runs once; the first body's retry
    // is then a mismatch, never a second run.
    let other = post_req("/pay", r#"{"amount":200}"#)
        .key("late-1")
        .send(addr)
        .await;
    assert_eq!(
        (other.status, String::from_utf8_lossy(&other.body).into_owned()),
        (201, "run 1: 200".to_owned())
    );
    let retry = post_req("/pay", r#"{"amount":100}"#)
        .key("late-1")
        .send(addr)
        .await;
    assert_eq!(retry.status, 422, "{}", String::from_utf8_lossy(&retry.body));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
