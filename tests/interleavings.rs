//! Interleavings written on purpose: row locks held by a test connection
//! (PostgreSQL) pin the races of the record protocol that timing alone
//! rarely produces.

mod common;

use idem::{IdempotencyStore, RecordId, Reservation, ReserveRequest, StoredResponse};
use sqlx::Connection as _;
use std::time::Duration;

const LONG: Duration = Duration::from_secs(3600);

fn req<'a>(id: &'a RecordId, fp: &'a str, ttl: Duration) -> ReserveRequest<'a> {
    ReserveRequest {
        id,
        fingerprint: fp,
        token: common::token(),
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

/// The janitor picks an expired record, then waits on a row lock while a
/// new operation reserves that key afresh: it must not delete the new, live
/// record when it resumes.
#[tokio::test]
async fn postgres_the_janitor_never_deletes_a_record_reserved_afresh_while_it_waited() {
    let Some(url) = common::pg_url() else { return };
    let schema = common::pg_schema(&url).await;
    let store = std::sync::Arc::new(common::pg_store_in(&url, &schema, 8).await);
    let id = RecordId::new("t", "s", "janitor-race");
    expired_record(&*store, &id).await;

    // A reader holds FOR KEY SHARE: a DELETE waits for it, an UPDATE does not.
    let mut reader = sqlx::PgConnection::connect(&url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut reader).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT 1 FROM \"{schema}\".idempotency_keys WHERE key = 'janitor-race' FOR KEY SHARE"
    )))
    .execute(&mut reader)
    .await
    .unwrap();

    let purging = {
        let store = store.clone();
        tokio::spawn(async move { store.purge_expired(10).await })
    };
    until_blocked_or_done(&url, &schema, "DELETE", || purging.is_finished()).await;

    // A new operation takes the expired key while the janitor waits.
    let Reservation::Reserved(fresh) = store.reserve(req(&id, "fp-new", LONG)).await.unwrap() else {
        panic!("an expired record must be taken afresh")
    };
    sqlx::query("COMMIT").execute(&mut reader).await.unwrap();
    purging.await.unwrap().unwrap();

    // The live record survived: its owner completes it, and it replays.
    store.complete(&id, &fresh.token, &answer("new")).await.unwrap();
    assert_eq!(
        store.reserve(req(&id, "fp-new", LONG)).await.unwrap(),
        Reservation::Completed(answer("new"))
    );
}

/// Two requests race for one expired record: the winner's takeover is not
/// committed yet when the loser's statement starts. The loser must be judged
/// on the winner's row (409 for the same body, 422 for another), never on
/// the expired row its statement first saw.
#[tokio::test]
async fn postgres_the_loser_of_a_race_for_an_expired_record_is_judged_on_the_winners_row() {
    let Some(url) = common::pg_url() else { return };
    let schema = common::pg_schema(&url).await;
    let store = std::sync::Arc::new(common::pg_store_in(&url, &schema, 8).await);
    for (case, loser_fp, expected) in [
        ("same-body", "fp-b", "in progress"),
        ("old-body", "fp-a", "mismatch"),
    ] {
        let key = format!("race-{case}");
        let id = RecordId::new("t", "s", &key);
        expired_record(&*store, &id).await;

        // The winner: a takeover of the expired record with body fp-b, held
        // uncommitted by a test connection.
        let mut winner = sqlx::PgConnection::connect(&url).await.unwrap();
        sqlx::query("BEGIN").execute(&mut winner).await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE \"{schema}\".idempotency_keys SET fingerprint = 'fp-b', state = 'in_progress', \
             lock_token = 'winner', lock_expires_at = now() + interval '1 hour', attempt = 1, \
             operation_id = 'op-winner', created_at = now(), expires_at = now() + interval '1 hour', \
             response_status = NULL, response_headers = NULL, response_body = NULL WHERE key = $1"
        )))
        .bind(&key)
        .execute(&mut winner)
        .await
        .unwrap();

        let loser = {
            let (store, id) = (store.clone(), id.clone());
            let fp = loser_fp.to_owned();
            tokio::spawn(async move { store.reserve(req(&id, &fp, LONG)).await })
        };
        until_blocked_or_done(&url, &schema, "WITH", || loser.is_finished()).await;
        sqlx::query("COMMIT").execute(&mut winner).await.unwrap();
        let got = loser.await.unwrap().unwrap();
        let ok = match expected {
            "in progress" => matches!(got, Reservation::InProgress { .. }),
            _ => got == Reservation::Mismatch,
        };
        assert!(ok, "{case}: expected {expected}, got {got:?}");
    }
}
