//! Store calls as the store-level tests write them: a reservation request
//! with a fresh token, a reservation that must be taken, and the
//! (state, token, body) of a PostgreSQL store's row.

use idem_runtime::store::{Lease, RecordId, Reservation, ReserveRequest};
use idem_runtime::{IdempotencyStore, PgStore};
use std::time::Duration;

/// A reservation request of `id` with fingerprint `fp`, a fresh token
/// ([`crate::token`]), and the given TTL and lock timeout.
///
/// ```
/// # use std::time::Duration;
/// let id = idem_runtime::store::RecordId::new("t", "s", "k");
/// let r = idem_testkit::records::req(&id, "fp", Duration::from_secs(60), Duration::from_secs(5));
/// assert_eq!(r.lock_timeout, Duration::from_secs(5));
/// ```
pub fn req<'a>(id: &'a RecordId, fp: &'a str, ttl: Duration, lock: Duration) -> ReserveRequest<'a> {
    ReserveRequest {
        id,
        fingerprint: fp,
        token: crate::token(),
        ttl,
        lock_timeout: lock,
    }
}

/// What `store` answers to [`req`]; a store error fails the test.
///
/// # Panics
///
/// When the store answers an error.
pub async fn reserve(
    store: &dyn IdempotencyStore,
    id: &RecordId,
    fp: &str,
    ttl: Duration,
    lock: Duration,
) -> Reservation {
    store.reserve(req(id, fp, ttl, lock)).await.expect("reserve")
}

/// The lease of [`reserve`], which must take the key.
///
/// # Panics
///
/// When the key is not taken.
pub async fn take(
    store: &dyn IdempotencyStore,
    id: &RecordId,
    fp: &str,
    ttl: Duration,
    lock: Duration,
) -> Lease {
    match reserve(store, id, fp, ttl, lock).await {
        Reservation::Reserved(lease) => lease,
        other => panic!("expected a reservation, got {other:?}"),
    }
}

/// The schema-qualified table a PostgreSQL store writes (read off its
/// completion statement).
///
/// # Panics
///
/// When the statement does not name a table.
pub fn pg_table(store: &PgStore) -> String {
    let complete = store.request_statements().complete;
    complete.split_whitespace().nth(1).expect("a table").to_owned()
}

/// The (state, lock token, response body as text) of `id`'s row in a
/// PostgreSQL store's table, or `None` without a row.
///
/// # Panics
///
/// When the query fails.
pub async fn pg_row(store: &PgStore, id: &RecordId) -> Option<(String, Option<String>, Option<String>)> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT state, lock_token, convert_from(response_body, 'UTF8') FROM {} \
         WHERE tenant = $1 AND scope = $2 AND key = $3",
        pg_table(store)
    )))
    .bind(&id.tenant)
    .bind(&id.scope)
    .bind(&id.key)
    .fetch_optional(store.pool())
    .await
    .expect("the row")
}

/// A transaction on `pool` that has inserted the records of `ids` (as a
/// reservation would, with the token `holder-token`) and not committed:
/// inserts of them wait for it, until it ends.
///
/// # Panics
///
/// When an insert fails.
pub async fn insert_uncommitted(
    pool: &sqlx::PgPool,
    store: &PgStore,
    ids: &[&RecordId],
) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut holder = pool.begin().await.expect("a transaction");
    for k in ids {
        sqlx::query(sqlx::AssertSqlSafe(store.request_statements().lookup.to_owned()))
            .bind(&k.tenant)
            .bind(&k.scope)
            .bind(&k.key)
            .bind("fp")
            .bind("holder-token")
            .bind("holder-op")
            .bind(3_600_000_i64)
            .bind(3_600_000_i64)
            .execute(&mut *holder)
            .await
            .expect("the insert");
    }
    holder
}

/// A transaction on `pool` (not the store's) holding `id`'s row with
/// `FOR UPDATE`, until it ends: the store's writes of that row wait.
///
/// # Panics
///
/// When the query fails.
pub async fn pg_hold_row(
    pool: &sqlx::PgPool,
    store: &PgStore,
    id: &RecordId,
) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut holder = pool.begin().await.expect("a transaction");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT 1 FROM {} WHERE tenant = $1 AND scope = $2 AND key = $3 FOR UPDATE",
        pg_table(store)
    )))
    .bind(&id.tenant)
    .bind(&id.scope)
    .bind(&id.key)
    .execute(&mut *holder)
    .await
    .expect("the row held");
    holder
}
