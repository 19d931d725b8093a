//! Running the statements: a reservation that may outlive its caller, the
//! fenced writes shared by both SQL stores, row and error mapping, and the
//! bound on each store operation.

use crate::store::{RecordState, Reservation, StoreError, StoredResponse};
use std::future::Future;
use std::time::Duration;

/// A reservation request that owns its parts, for a reservation that may
/// outlive its caller.
pub(crate) struct OwnedReserve {
    id: crate::store::RecordId,
    fingerprint: String,
    token: String,
    ttl: std::time::Duration,
    lock_timeout: std::time::Duration,
}

impl OwnedReserve {
    /// `req`, owned.
    pub(crate) fn of(req: &crate::store::ReserveRequest<'_>) -> Self {
        OwnedReserve {
            id: req.id.clone(),
            fingerprint: req.fingerprint.to_owned(),
            token: req.token.to_owned(),
            ttl: req.ttl,
            lock_timeout: req.lock_timeout,
        }
    }

    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    pub(crate) fn id(&self) -> &crate::store::RecordId {
        &self.id
    }

    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    pub(crate) fn token(&self) -> &str {
        &self.token
    }

    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    pub(crate) fn lock_timeout(&self) -> std::time::Duration {
        self.lock_timeout
    }

    pub(crate) fn request(&self) -> crate::store::ReserveRequest<'_> {
        crate::store::ReserveRequest {
            id: &self.id,
            fingerprint: &self.fingerprint,
            token: &self.token,
            ttl: self.ttl,
            lock_timeout: self.lock_timeout,
        }
    }
}

/// Runs a reservation so that a timeout never leaves it half-done. Past
/// `limit` the caller gets [`StoreError::Unavailable`], but the statements
/// are not cancelled (a cancelled statement may still commit on the server,
/// after anything the caller does to undo it): they run on in the
/// background, on the caller's runtime, and if they took the key after all,
/// it is given back at once by a release fenced by the reservation's token.
/// Statements still running a lock timeout later are abandoned.
#[cfg(feature = "postgres")]
pub(crate) async fn reserve_detached<S>(
    store: &S,
    limit: std::time::Duration,
    req: crate::store::ReserveRequest<'_>,
    run: impl FnOnce(
        S,
        OwnedReserve,
    ) -> crate::store::BoxFuture<'static, Result<crate::store::Reservation, StoreError>>,
) -> Result<crate::store::Reservation, StoreError>
where
    S: crate::IdempotencyStore + Clone,
{
    use crate::store::Reservation;
    let mut running = run(store.clone(), OwnedReserve::of(&req));
    match tokio::time::timeout(limit, &mut running).await {
        Ok(answer) => answer,
        Err(_) => {
            let (store, id, token) = (store.clone(), req.id.clone(), req.token.to_owned());
            let hold = req.lock_timeout.max(limit);
            // Under way (`Idem::idle`) until it ends.
            let under_way = crate::store::background_work().enter();
            let undo = async move {
                let _under_way = under_way;
                let until = crate::store::deadline_after(hold);
                let late = tokio::time::timeout(hold, running).await;
                let took = !matches!(
                    late,
                    Ok(Ok(Reservation::Completed(_)
                        | Reservation::InProgress { .. }
                        | Reservation::Mismatch))
                );
                // As it was found (see `IdempotencyStore::hand_back`); not knowing
                // how, as a stale lock.
                let taken_over = match &late {
                    Ok(Ok(Reservation::Reserved(lease))) => lease.is_takeover(),
                    _ => true,
                };
                if !took || tokio::time::Instant::now() >= until {
                    return;
                }
                let given =
                    crate::store::retry_until(until, || store.hand_back(&id, &token, taken_over)).await;
                if given.is_ok() {
                    tracing::warn!("a reservation answered after its timeout; gave the key back");
                }
            };
            drop(tokio::spawn(tracing::Instrument::in_current_span(undo)));
            Err(StoreError::unavailable(format!(
                "no answer within {} ms",
                limit.as_millis()
            )))
        }
    }
}

/// Maps a sqlx error: connection-level failures, and statements cancelled
/// (PostgreSQL's `query_canceled`, 57014: the session's `statement_timeout`,
/// an operator's cancel), are [`StoreError::Unavailable`] (the store did
/// not answer in time; the request is refused with 503 and may be
/// retried), the rest [`StoreError::Backend`].
pub(crate) fn map_err(e: sqlx::Error) -> StoreError {
    use sqlx::Error as E;
    let unavailable = match &e {
        E::Io(_) | E::Tls(_) | E::PoolTimedOut | E::PoolClosed | E::WorkerCrashed => true,
        E::Database(db) => {
            #[cfg(feature = "sqlite")]
            if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() {
                let busy = sqlite_busy_or_locked(&**db);
                return store_error(e, busy);
            }
            // PostgreSQL: 08 connection, 53 resources, 57014 cancelled,
            // 57P0x shutdown/crash.
            let code = db.code().unwrap_or_default();
            code.starts_with("08") || code.starts_with("53") || code == "57014" || code.starts_with("57P0")
        }
        _ => false,
    };
    store_error(e, unavailable)
}

/// [`map_err`] for a write that may wait for a record's row: PostgreSQL's
/// `lock_not_available` (55P03), the bound of that wait run out (see
/// `FencedWrites`), is the store not answering within its timeout, as
/// that timeout on idem's side is: [`StoreError::Unavailable`].
pub(crate) fn map_wait_err(e: sqlx::Error) -> StoreError {
    if lock_wait_ran_out(&e) {
        store_error(e, true)
    } else {
        map_err(e)
    }
}

/// SQLite's answer that it is busy or locked: 5 busy, 6 locked (the busy
/// timeout ran out, or a table of a shared-cache database is locked), as
/// primary codes or extended ones (such as 262 or 517), whose low byte is
/// the primary code.
#[cfg(feature = "sqlite")]
pub(crate) fn sqlite_busy_or_locked(db: &dyn sqlx::error::DatabaseError) -> bool {
    db.code()
        .and_then(|code| code.split('/').next().and_then(|c| c.parse::<i32>().ok()))
        .is_some_and(|code| matches!(code & 0xff, 5 | 6))
}

/// PostgreSQL's `lock_not_available` (55P03): a wait for a lock ran out
/// (a `lock_timeout`, of the session's or of idem's own bound).
pub(crate) fn lock_wait_ran_out(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|db| db.code())
        .is_some_and(|code| code == "55P03")
}

fn store_error(e: sqlx::Error, unavailable: bool) -> StoreError {
    let reason = e.to_string();
    if unavailable {
        StoreError::unavailable(reason).with_source(e)
    } else {
        StoreError::backend(reason).with_source(e)
    }
}

/// The fenced writes and the purge of the PostgreSQL store (SQLite's queue
/// them for its write permit). Expects `self.pool`, `self.sql: Statements`
/// and `self.timeout`.
#[cfg(feature = "postgres")]
macro_rules! fenced_ops {
    () => {
        fn complete<'a>(
            &'a self,
            id: &'a $crate::store::RecordId,
            token: &'a str,
            response: &'a $crate::store::StoredResponse,
        ) -> $crate::store::BoxFuture<'a, Result<(), $crate::StoreError>> {
            // Before the write is sent: a conflict is answered from memory
            // only while the record cannot have changed.
            self.replays.finish(id, token);
            Box::pin($crate::sql::bounded(self.timeout, async move {
                self.complete_grouped(id, token, response).await?;
                pause_point!($crate::pause::COMPLETE_AFTER, &id.key);
                Ok(())
            }))
        }

        fn release<'a>(
            &'a self,
            id: &'a $crate::store::RecordId,
            token: &'a str,
        ) -> $crate::store::BoxFuture<'a, Result<(), $crate::StoreError>> {
            self.replays.finish(id, token);
            Box::pin($crate::sql::bounded(self.timeout, async move {
                $crate::sql::fenced(
                    self.owned_write(&self.fenced_writes().release, id, token)
                        .await?,
                )?;
                pause_point!($crate::pause::RELEASE_AFTER, &id.key);
                Ok(())
            }))
        }

        fn reject<'a>(
            &'a self,
            id: &'a $crate::store::RecordId,
            token: &'a str,
        ) -> $crate::store::BoxFuture<'a, Result<(), $crate::StoreError>> {
            self.replays.finish(id, token);
            Box::pin($crate::sql::bounded(self.timeout, async move {
                self.reject_statements(id, token).await?;
                pause_point!($crate::pause::REJECT_AFTER, &id.key);
                Ok(())
            }))
        }

        fn hand_back<'a>(
            &'a self,
            id: &'a $crate::store::RecordId,
            token: &'a str,
            taken_over: bool,
        ) -> $crate::store::BoxFuture<'a, Result<(), $crate::StoreError>> {
            self.replays.finish(id, token);
            Box::pin($crate::sql::bounded(self.timeout, async move {
                let handed_back = self.hand_back_statements(id, token, taken_over).await;
                pause_point!($crate::pause::HAND_BACK_AFTER, &id.key);
                handed_back
            }))
        }

        fn checkpoint<'a>(
            &'a self,
            id: &'a $crate::store::RecordId,
            token: &'a str,
            recovery_point: &'a str,
        ) -> $crate::store::BoxFuture<'a, Result<(), $crate::StoreError>> {
            Box::pin($crate::sql::bounded(self.timeout, async move {
                let done = sqlx::query(sqlx::AssertSqlSafe(
                    self.fenced_writes().checkpoint.as_str(),
                ))
                .bind(&id.tenant)
                .bind(&id.scope)
                .bind(&id.key)
                .bind(token)
                .bind(recovery_point)
                .execute(&self.pool)
                .await
                .map_err($crate::sql::map_wait_err)?;
                $crate::sql::fenced(done.rows_affected())?;
                pause_point!($crate::pause::CHECKPOINT_AFTER, &id.key);
                Ok(())
            }))
        }

        fn extend_lock<'a>(
            &'a self,
            id: &'a $crate::store::RecordId,
            token: &'a str,
            lock_timeout: std::time::Duration,
        ) -> $crate::store::BoxFuture<'a, Result<(), $crate::StoreError>> {
            // What the process knows of its execution: dropped before a
            // heartbeat that may move the deadline earlier, moved on by
            // one written, dropped after one that failed (the lock may be
            // lost). One given up on (the timeout) leaves it as it was: the
            // statement, if it still runs, moves the deadline no earlier.
            let sent = std::time::Instant::now();
            self.replays.extending(id, token, lock_timeout);
            Box::pin($crate::sql::bounded(self.timeout, async move {
                let extended = self
                    .extend_write(id, token, lock_timeout)
                    .await
                    .and_then($crate::sql::fenced);
                match extended {
                    Ok(()) => self.replays.extended(id, token, sent, lock_timeout),
                    Err(_) => self.replays.finish(id, token),
                }
                extended?;
                pause_point!($crate::pause::EXTEND_AFTER, &id.key);
                Ok(())
            }))
        }

        fn purge_expired(&self, batch: u32) -> $crate::store::BoxFuture<'_, Result<u64, $crate::StoreError>> {
            let statement = move |sql: fn(&$crate::sql::Statements) -> &str| async move {
                let done = sqlx::query(sqlx::AssertSqlSafe(sql(&self.sql)))
                    .bind(i64::from(batch))
                    .execute(&self.pool)
                    .await
                    .map_err($crate::sql::map_err)?;
                Ok(done.rows_affected())
            };
            Box::pin($crate::sql::purge_within(
                self.timeout,
                batch,
                move || statement(|sql| &sql.purge_set),
                move || async move {
                    let purged = statement(|sql| &sql.purge).await?;
                    pause_point!($crate::pause::PURGE_AFTER, &self.sql.table);
                    Ok(purged)
                },
            ))
        }
    };
}
#[cfg(feature = "postgres")]
pub(crate) use fenced_ops;

/// The completion statement on any executor of the store's database: the
/// pool, or the handler's open transaction.
macro_rules! complete_with {
    ($db:ty) => {
        /// Runs `statement` (binds: tenant, scope, key, token) on the pool
        /// and says how many rows it changed.
        async fn owned_write(
            &self,
            statement: &str,
            id: &$crate::store::RecordId,
            token: &str,
        ) -> Result<u64, $crate::StoreError> {
            let done = sqlx::query(sqlx::AssertSqlSafe(statement))
                .bind(&id.tenant)
                .bind(&id.scope)
                .bind(&id.key)
                .bind(token)
                .execute(&self.pool)
                .await
                .map_err($crate::sql::map_wait_err)?;
            Ok(done.rows_affected())
        }

        /// Moves the lock deadline of the record `token` owns to
        /// `lock_timeout` from now, on the connection the store gives its
        /// extensions (`run_extension`); says how many rows it changed.
        async fn extend_write(
            &self,
            id: &$crate::store::RecordId,
            token: &str,
            lock_timeout: std::time::Duration,
        ) -> Result<u64, $crate::StoreError> {
            // The statement's text is the store's to choose (see
            // `run_extension`).
            let extend = |statement: &str| {
                sqlx::query(sqlx::AssertSqlSafe(statement))
                    .bind(&id.tenant)
                    .bind(&id.scope)
                    .bind(&id.key)
                    .bind(token)
                    .bind($crate::sql::millis(lock_timeout))
            };
            let done = self.run_extension(extend).await?;
            Ok(done.rows_affected())
        }

        /// [`IdempotencyStore::reject`](crate::IdempotencyStore::reject)'s
        /// statements: a first attempt with no recovery point is removed; a
        /// later one (or one with progress) is released as failed. When
        /// `token` holds nothing and no record is left at all, the
        /// rejection is done all the same: the key is free (an earlier try
        /// whose answer was lost removed the record, or the janitor did).
        async fn reject_statements(
            &self,
            id: &$crate::store::RecordId,
            token: &str,
        ) -> Result<(), $crate::StoreError> {
            if self
                .owned_write(&self.fenced_writes().reject, id, token)
                .await?
                > 0
                || self
                    .owned_write(&self.fenced_writes().release, id, token)
                    .await?
                    > 0
            {
                return Ok(());
            }
            let left = sqlx::query(sqlx::AssertSqlSafe(self.sql.present.as_str()))
                .bind(&id.tenant)
                .bind(&id.scope)
                .bind(&id.key)
                .fetch_optional(&self.pool)
                .await
                .map_err($crate::sql::map_err)?;
            match left {
                Some(_) => Err($crate::StoreError::LockLost),
                None => Ok(()),
            }
        }

        /// [`IdempotencyStore::hand_back`](crate::IdempotencyStore::hand_back)'s
        /// statements: taken fresh (first attempt, no recovery point), the
        /// record is removed, as `reject` removes it; otherwise it goes
        /// back as it was found, a stale lock (`extend` to now) or released.
        /// Its attempt stays counted: a record whose attempt went back to 1
        /// would pass for one taken fresh, and a second hand-back (the
        /// caller's and a late reservation's undo) would remove what ran.
        async fn hand_back_statements(
            &self,
            id: &$crate::store::RecordId,
            token: &str,
            taken_over: bool,
        ) -> Result<(), $crate::StoreError> {
            if self
                .owned_write(&self.fenced_writes().reject, id, token)
                .await?
                > 0
            {
                return Ok(());
            }
            let put_back = if taken_over {
                self.extend_write(id, token, std::time::Duration::ZERO)
                    .await?
            } else {
                self.owned_write(&self.fenced_writes().release, id, token)
                    .await?
            };
            $crate::sql::fenced(put_back)
        }

        pub(crate) async fn complete_with<'e, E>(
            &self,
            executor: E,
            id: &$crate::store::RecordId,
            token: &str,
            response: &$crate::store::StoredResponse,
        ) -> Result<(), $crate::StoreError>
        where
            E: sqlx::Executor<'e, Database = $db>,
        {
            let completed = self
                .complete_rows(
                    executor,
                    &self.fenced_writes().complete,
                    id,
                    token,
                    response,
                )
                .await?;
            $crate::sql::fenced(completed)
        }

        /// Runs `statement`, a completion with `complete`'s binds (tenant,
        /// scope, key, token, status, headers, body), and says how many rows
        /// it changed.
        pub(crate) async fn complete_rows<'e, E>(
            &self,
            executor: E,
            statement: &str,
            id: &$crate::store::RecordId,
            token: &str,
            response: &$crate::store::StoredResponse,
        ) -> Result<u64, $crate::StoreError>
        where
            E: sqlx::Executor<'e, Database = $db>,
        {
            use sqlx::Arguments as _;
            let headers = response.headers_to_json();
            let body = response.body.as_deref();
            let texts = [id.tenant.as_str(), &id.scope, &id.key, token];
            let mut args = $crate::sql::sized_arguments::<$db>(
                7,
                texts.iter().map(|t| t.len()).sum::<usize>()
                    + 4
                    + headers.len()
                    + body.map_or(0, <[u8]>::len),
            );
            // In the statement's order: tenant, scope, key, token, status,
            // headers, body.
            for text in texts {
                args.add(text)
                    .map_err(|e| $crate::sql::encode_err(args.len() + 1, e))?;
            }
            args.add(i32::from(response.status))
                .map_err(|e| $crate::sql::encode_err(args.len() + 1, e))?;
            args.add(headers.as_str())
                .map_err(|e| $crate::sql::encode_err(args.len() + 1, e))?;
            args.add(body)
                .map_err(|e| $crate::sql::encode_err(args.len() + 1, e))?;
            let done = sqlx::query_with(sqlx::AssertSqlSafe(statement), args)
                .execute(executor)
                .await
                .map_err($crate::sql::map_wait_err)?;
            Ok(done.rows_affected())
        }
    };
}
pub(crate) use complete_with;

/// Arguments with room for `count` values of `bytes` bytes in all (each
/// value's length word besides): bound one by one from empty, sqlx's
/// buffers grow about three times per statement, which costs about a
/// third of what binding does.
pub(crate) fn sized_arguments<DB: sqlx::Database>(count: usize, bytes: usize) -> DB::Arguments {
    use sqlx::Arguments as _;
    let mut args = DB::Arguments::default();
    args.reserve(count, bytes + 4 * count);
    args
}

/// The value at `position` (from 1, as `$1` counts), which sqlx could not
/// encode: a backend error, as sqlx reports it when it binds as the
/// statement runs.
pub(crate) fn encode_err(position: usize, e: sqlx::error::BoxDynError) -> StoreError {
    map_err(sqlx::Error::Encode(
        format!("encoding argument ${position} failed: {e}").into(),
    ))
}

/// A fenced write that touched no row lost its lock.
pub(crate) fn fenced(rows: u64) -> Result<(), StoreError> {
    if rows == 1 {
        Ok(())
    } else {
        Err(StoreError::LockLost)
    }
}

/// The columns that every row [`judge_row`] reads starts with, in this
/// order: the PostgreSQL reserving statement's, `peek`'s and `existing`'s.
/// Read by position, which costs a replay no lookup by name.
const JUDGED_COLUMNS: [&str; 6] = [
    "fingerprint",
    "state",
    "response_status",
    "response_headers",
    "response_body",
    "lock_left_ms",
];

/// Whether `row`'s columns from `first` on are `names`: checked in debug
/// builds (every test), where a statement whose columns moved would
/// otherwise be read at the wrong positions.
pub(crate) fn columns_are<R: sqlx::Row>(row: &R, first: usize, names: &[&str]) -> bool {
    use sqlx::Column as _;
    let columns = row.columns();
    names
        .iter()
        .enumerate()
        .all(|(i, name)| columns.get(first + i).is_some_and(|c| c.name() == *name))
}

/// Reads the row of an existing record that was not taken.
pub(crate) fn judge_row<R>(row: &R, fingerprint: &str) -> Result<crate::store::Reservation, StoreError>
where
    R: sqlx::Row,
    usize: sqlx::ColumnIndex<R>,
    for<'r> &'r str: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<String>: sqlx::Decode<'r, R::Database>,
    String: sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<i64>: sqlx::Decode<'r, R::Database>,
    for<'r> Option<Vec<u8>>: sqlx::Decode<'r, R::Database>,
    for<'r> Vec<u8>: sqlx::Type<R::Database>,
{
    debug_assert!(
        columns_are(row, 0, &JUDGED_COLUMNS),
        "a judged row starts with {JUDGED_COLUMNS:?}"
    );
    let get_err = |e: sqlx::Error| StoreError::backend(e.to_string());
    // Borrowed from the row: a replay copies only the answer.
    let stored_fp: &str = row.try_get(0).map_err(get_err)?;
    let state: &str = row.try_get(1).map_err(get_err)?;
    let lock_left: i64 = row.try_get(5).map_err(get_err)?;
    let completed = if state == RecordState::COMPLETED_COLUMN {
        Some(crate::store::StoredResponse::from_columns(
            row.try_get(2).map_err(get_err)?,
            row.try_get(3).map_err(get_err)?,
            row.try_get(4).map_err(get_err)?,
        )?)
    } else {
        None
    };
    Ok(judge_existing(
        stored_fp == fingerprint,
        completed,
        std::time::Duration::from_millis(u64::try_from(lock_left).unwrap_or(0)),
    ))
}

/// Reads the row of a record the caller just took.
#[cfg(feature = "sqlite")]
pub(crate) fn lease_from_row<R>(row: &R, token: String) -> Result<crate::store::Lease, StoreError>
where
    R: sqlx::Row,
    for<'r> &'r str: sqlx::ColumnIndex<R>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<String>: sqlx::Decode<'r, R::Database>,
    for<'r> i32: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    let get_err = |e: sqlx::Error| StoreError::backend(e.to_string());
    let attempt: i32 = row.try_get("attempt").map_err(get_err)?;
    let taken_over: i32 = row.try_get("taken_over").map_err(get_err)?;
    Ok(crate::store::Lease {
        token,
        attempt: u32::try_from(attempt).unwrap_or(1),
        takeover: taken_over != 0,
        recovery_point: row.try_get("recovery_point").map_err(get_err)?,
        operation_id: row.try_get("operation_id").map_err(get_err)?,
    })
}

// The SQL stores' column mapping.
impl StoredResponse {
    /// The headers as a JSON array of `[name, value]` strings, each value
    /// byte one character of the same number (U+0000 to U+00FF): ASCII
    /// values read as they are, and every byte comes back.
    pub(crate) fn headers_to_json(&self) -> String {
        let latin1: Vec<(&str, String)> = self
            .headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.iter().map(|&b| char::from(b)).collect()))
            .collect();
        serde_json::to_string(&latin1).unwrap_or_else(|_| "[]".to_owned())
    }

    pub(crate) fn from_columns(
        status: Option<i64>,
        headers: Option<String>,
        body: Option<Vec<u8>>,
    ) -> Result<Self, StoreError> {
        let status = status
            .and_then(|s| u16::try_from(s).ok())
            .ok_or_else(|| StoreError::backend("completed record without a status"))?;
        let unreadable = |why: String| StoreError::backend(format!("stored headers unreadable: {why}"));
        let headers = match headers {
            Some(json) => match plain_headers(&json) {
                Some(headers) => headers,
                None => {
                    let latin1: Vec<(String, String)> =
                        serde_json::from_str(&json).map_err(|e| unreadable(e.to_string()))?;
                    latin1
                        .into_iter()
                        .map(|(n, v)| {
                            let bytes: Option<Vec<u8>> =
                                v.chars().map(|c| u8::try_from(u32::from(c)).ok()).collect();
                            bytes
                                .map(|b| (n, b))
                                .ok_or_else(|| unreadable("a value beyond one byte a character".into()))
                        })
                        .collect::<Result<_, _>>()?
                }
            },
            None => Vec::new(),
        };
        Ok(StoredResponse {
            status,
            headers,
            body,
        })
    }
}

/// The stored headers read without serde where they are as
/// [`StoredResponse::headers_to_json`] writes them and need no unescaping
/// (`[["name","value"],...]` with nothing between the parts, no backslash,
/// no control character, every value character at most U+00FF): what serde would read
/// from them. `None` for anything else, which serde then reads (and
/// refuses where it must).
fn plain_headers(json: &str) -> Option<Vec<(String, Vec<u8>)>> {
    if json.bytes().any(|c| c == b'\\' || c < 0x20) {
        return None;
    }
    let mut rest = json.strip_prefix('[')?.strip_suffix(']')?;
    let mut headers = Vec::new();
    // Splits at `"`, an ASCII byte, so every part is whole UTF-8.
    let string = |rest: &mut &str, after: &str| -> Option<String> {
        let (s, tail) = rest.strip_prefix('"')?.split_once('"')?;
        *rest = tail.strip_prefix(after)?;
        Some(s.to_owned())
    };
    while !rest.is_empty() {
        rest = rest.strip_prefix('[')?;
        let name = string(&mut rest, ",")?;
        let value = string(&mut rest, "]")?;
        let bytes = if value.is_ascii() {
            value.into_bytes()
        } else {
            value
                .chars()
                .map(|c| u8::try_from(u32::from(c)).ok())
                .collect::<Option<Vec<u8>>>()?
        };
        headers.push((name, bytes));
        if !rest.is_empty() {
            rest = rest.strip_prefix(',')?;
            if rest.is_empty() {
                return None;
            }
        }
    }
    Some(headers)
}

/// One purge call, bounded by `timeout` in all (past it,
/// [`StoreError::Unavailable`]). First `set_purge_at` sets `purge_at` on
/// up to `batch` rows that have none yet (from before migration 5, or an
/// earlier build's) and says how many: it runs until one run sets fewer,
/// or half the timeout has passed, each run within what is left of that
/// half (an earlier build may still be writing such rows, and the next
/// call takes up what is left), so that the purge starts with the other
/// half; then `purge` removes up to `batch` purgeable rows, within what
/// is left. A run no longer waited for is not stopped: it ends on its
/// connection (on SQLite holding the write lock), and the purge may wait
/// for it. A batch of 0 removes nothing and runs nothing.
pub(crate) async fn purge_within<S, SFut, P, PFut>(
    timeout: Duration,
    batch: u32,
    mut set_purge_at: S,
    purge: P,
) -> Result<u64, StoreError>
where
    S: FnMut() -> SFut,
    SFut: Future<Output = Result<u64, StoreError>>,
    P: FnOnce() -> PFut,
    PFut: Future<Output = Result<u64, StoreError>>,
{
    if batch == 0 {
        return Ok(0);
    }
    let deadline = Deadline::start(timeout);
    let backfill = Deadline::start(timeout / 2);
    deadline
        .bound(async move {
            while !backfill.left().is_zero() {
                match tokio::time::timeout(backfill.left(), set_purge_at()).await {
                    Ok(set) if set.as_ref().is_ok_and(|&set| set < u64::from(batch)) => break,
                    Ok(set) => {
                        set?;
                    }
                    // The backfill's half is spent.
                    Err(_) => break,
                }
            }
            purge().await
        })
        .await
}

/// Bounds a store operation by `limit`, counted from its first poll: past
/// it, [`StoreError::Unavailable`].
pub(crate) fn bounded<F>(limit: Duration, fut: F) -> Bounded<F> {
    Bounded {
        fut,
        timer: None,
        deadline: None,
        limit,
        started: false,
    }
}

pin_project_lite::pin_project! {
    /// [`bounded`]'s and [`Deadline::bound`]'s future. It holds the
    /// operation's future once, where an `async fn` would keep it as its
    /// argument and again as what it awaits: the statements' futures are
    /// several kilobytes, each copied whenever the future that holds them
    /// is built, moved or boxed.
    pub(crate) struct Bounded<F> {
        #[pin]
        fut: F,
        // Set at the first poll, unless the deadline is too far to be
        // told (it never passes). Outside the task's cooperative budget,
        // which an operation busy with ready work may spend on every poll:
        // the time is up all the same.
        #[pin]
        timer: Option<tokio::task::Unconstrained<tokio::time::Sleep>>,
        // `None` for [`bounded`], until its first poll starts it.
        deadline: Option<Deadline>,
        limit: Duration,
        started: bool,
    }
}

impl<T, F: Future<Output = Result<T, StoreError>>> Future for Bounded<F> {
    type Output = Result<T, StoreError>;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let mut this = self.project();
        let limit = *this.limit;
        let deadline = *this.deadline.get_or_insert_with(|| Deadline::start(limit));
        if !*this.started {
            *this.started = true;
            // A step due once nothing is left is not started at all.
            if let Some(e) = deadline.passed() {
                return std::task::Poll::Ready(Err(e));
            }
            if let Some(at) = deadline.started.checked_add(deadline.limit) {
                this.timer
                    .set(Some(tokio::task::unconstrained(tokio::time::sleep_until(at))));
            }
        }
        // The operation first, as `tokio::time::timeout` does: one that is
        // ready when the time is up is answered.
        if let std::task::Poll::Ready(out) = this.fut.poll(cx) {
            return std::task::Poll::Ready(out);
        }
        match this.timer.as_pin_mut().map(|timer| timer.poll(cx)) {
            Some(std::task::Poll::Ready(())) => std::task::Poll::Ready(Err(deadline.error())),
            _ => std::task::Poll::Pending,
        }
    }
}

/// One store timeout shared by the steps of one call (a completion and
/// its commit, say): each step is bounded by what is left of it, so that
/// the call as a whole is bounded by the timeout, not each step.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Deadline {
    started: tokio::time::Instant,
    limit: Duration,
}

impl Deadline {
    /// `limit` from now.
    pub(crate) fn start(limit: Duration) -> Self {
        Deadline {
            started: tokio::time::Instant::now(),
            limit,
        }
    }

    /// How long since it started.
    pub(crate) fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// What is left of it.
    pub(crate) fn left(&self) -> Duration {
        self.limit.saturating_sub(self.elapsed())
    }

    /// The error of a step due once nothing is left, if nothing is: such
    /// a step is not started at all.
    pub(crate) fn passed(&self) -> Option<StoreError> {
        self.left().is_zero().then(|| self.error())
    }

    fn error(&self) -> StoreError {
        StoreError::unavailable(format!("no answer within {} ms", self.limit.as_millis()))
    }

    /// Runs `fut` within what is left, counted when it is first polled:
    /// past it, [`StoreError::Unavailable`], naming the whole limit. A step
    /// due once nothing is left is not started at all (see
    /// [`passed`](Self::passed)).
    pub(crate) fn bound<F>(&self, fut: F) -> Bounded<F> {
        Bounded {
            fut,
            timer: None,
            deadline: Some(*self),
            limit: self.limit,
            started: false,
        }
    }
}

/// The longest a SQL store retains a record or holds a lock: 10,000
/// years, "never" in practice. A longer duration (only through the public
/// store API: no layer accepts one) is bound as this one, which the
/// databases' timestamps can still tell, rather than failing the call.
pub(crate) const LONGEST: Duration = Duration::from_secs(10_000 * 365 * 86_400);

/// Milliseconds as the stores bind them, at most [`LONGEST`].
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.min(LONGEST).as_millis()).unwrap_or(i64::MAX)
}

/// How an existing row that the caller did not take is answered: the
/// state table's rows for a record that is neither taken nor gone.
pub(crate) fn judge_existing(
    fingerprint_matches: bool,
    completed: Option<StoredResponse>,
    lock_left: Duration,
) -> Reservation {
    match (fingerprint_matches, completed) {
        (false, _) => Reservation::Mismatch,
        (true, Some(response)) => Reservation::Completed(response),
        (true, None) => Reservation::InProgress {
            retry_after: lock_left,
        },
    }
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use super::map_err;
    use crate::StoreError;

    /// A table of a shared-cache database that another connection writes:
    /// SQLite's extended code 262 (locked, shared cache), which is a store
    /// that cannot serve now, not a backend fault.
    #[tokio::test]
    async fn a_locked_table_is_unavailable_in_its_extended_code_too() {
        use sqlx::Connection as _;
        let url = "sqlite:file:idem_locked_probe?mode=memory&cache=shared";
        let mut writer = sqlx::SqliteConnection::connect(url).await.unwrap();
        let mut reader = sqlx::SqliteConnection::connect(url).await.unwrap();
        sqlx::raw_sql("CREATE TABLE t (x INTEGER); BEGIN IMMEDIATE; INSERT INTO t VALUES (1);")
            .execute(&mut writer)
            .await
            .unwrap();
        let e = sqlx::query("SELECT x FROM t")
            .fetch_all(&mut reader)
            .await
            .unwrap_err();
        let code = e
            .as_database_error()
            .and_then(|d| d.code())
            .unwrap_or_default()
            .into_owned();
        assert_ne!(code, "6", "an extended code, as SQLite reports it");
        assert!(
            matches!(map_err(e), StoreError::Unavailable { .. }),
            "code {code}"
        );
    }
}

#[cfg(test)]
mod headers_tests {
    use super::plain_headers;
    use crate::store::StoredResponse;
    use proptest::prelude::*;

    /// What serde reads from stored headers, as `from_columns` did before
    /// the plain reading: the reference.
    fn by_serde(json: &str) -> Option<Vec<(String, Vec<u8>)>> {
        let latin1: Vec<(String, String)> = serde_json::from_str(json).ok()?;
        latin1
            .into_iter()
            .map(|(n, v)| {
                Some((
                    n,
                    v.chars()
                        .map(|c| u8::try_from(u32::from(c)).ok())
                        .collect::<Option<_>>()?,
                ))
            })
            .collect()
    }

    fn read(json: &str) -> Result<Vec<(String, Vec<u8>)>, String> {
        StoredResponse::from_columns(Some(200), Some(json.to_owned()), None)
            .map(|r| r.headers)
            .map_err(|e| e.to_string())
    }

    /// Headers written by idem read back as they were, by the plain
    /// reading, whatever their bytes.
    #[test]
    fn written_headers_are_read_plainly() {
        let headers = vec![
            ("content-type".to_owned(), b"application/json".to_vec()),
            ("x-latin".to_owned(), vec![0xe9, 0x80, 0xff, b'a']),
            ("empty".to_owned(), vec![]),
        ];
        let json = StoredResponse {
            status: 200,
            headers: headers.clone(),
            body: None,
        }
        .headers_to_json();
        assert_eq!(plain_headers(&json), Some(headers));
        assert_eq!(plain_headers("[]"), Some(vec![]));
    }

    /// Where the plain reading declines, serde reads (or refuses) as
    /// before: spaces, escapes, trailing commas, wrong shapes.
    #[test]
    fn other_texts_go_to_serde() {
        for json in [
            r#"[ ["a","b"] ]"#,
            r#"[["a","b\u00e9"]]"#,
            r#"[["a","b"],]"#,
            r#"[["a"]]"#,
            r#"[["a","b","c"]]"#,
            r#"[["a",1]]"#,
            r#"{"a":"b"}"#,
            "[[\"a\",\"\u{100}\"]]",
            "[[\"a\",\"\u{1}\"]]",
            "[[\"\u{1f}\",\"b\"]]",
            "",
        ] {
            assert_eq!(plain_headers(json), None, "{json}");
            assert_eq!(read(json).ok(), by_serde(json), "{json}");
        }
    }

    proptest! {
        /// Any headers, written then read: the plain reading and serde's
        /// agree, and give them back.
        #[test]
        fn written_headers_read_back_the_same(
            headers in proptest::collection::vec((".{0,12}", proptest::collection::vec(any::<u8>(), 0..12)), 0..5)
        ) {
            let json = StoredResponse { status: 200, headers: headers.clone(), body: None }.headers_to_json();
            prop_assert_eq!(read(&json).ok(), Some(headers.clone()));
            prop_assert_eq!(by_serde(&json), Some(headers));
        }

        /// Any text of JSON's characters: wherever the plain reading gives
        /// headers, serde gives the same.
        #[test]
        fn plain_reading_never_differs_from_serde(json in "[\\[\\]\",a\\\\u0e9\u{e9}\u{101} \u{1}]{0,24}") {
            if let Some(plain) = plain_headers(&json) {
                prop_assert_eq!(Some(plain), by_serde(&json));
            }
            prop_assert_eq!(read(&json).ok(), by_serde(&json));
        }

        /// Texts shaped as stored headers, written verbatim (so with
        /// quotes, backslashes, control and wide characters unescaped),
        /// with a space or a trailing comma at times: the same agreement.
        #[test]
        fn shaped_texts_read_as_serde_reads_them(
            pairs in proptest::collection::vec(("[a\u{e9}\u{101}\\\\\" \u{1}]{0,4}", "[a\u{e9}\u{101}\\\\\" \u{1}]{0,4}"), 0..4),
            space in any::<bool>(),
            trailing in any::<bool>(),
        ) {
            let items: Vec<String> = pairs.iter().map(|(n, v)| format!("[\"{n}\",\"{v}\"]")).collect();
            let json = format!(
                "[{}{}{}]",
                items.join(if space { ", " } else { "," }),
                if trailing { "," } else { "" },
                if space { " " } else { "" }
            );
            if let Some(plain) = plain_headers(&json) {
                prop_assert_eq!(Some(plain), by_serde(&json));
            }
            prop_assert_eq!(read(&json).ok(), by_serde(&json));
        }
    }
}

#[cfg(all(test, feature = "postgres"))]
mod encode_tests {
    use super::{encode_err, sized_arguments};
    use sqlx::Arguments as _;

    /// A value that refuses to be encoded.
    struct Refused;

    impl sqlx::Type<sqlx::Postgres> for Refused {
        fn type_info() -> sqlx::postgres::PgTypeInfo {
            <&str as sqlx::Type<sqlx::Postgres>>::type_info()
        }
    }

    impl sqlx::Encode<'_, sqlx::Postgres> for Refused {
        fn encode_by_ref(
            &self,
            _: &mut sqlx::postgres::PgArgumentBuffer,
        ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
            Err("refused".into())
        }
    }

    /// A value sqlx cannot encode is a backend error (not `Unavailable`:
    /// a retry would fail the same way), naming the argument, as sqlx's
    /// own binding named it.
    #[test]
    fn a_value_that_cannot_be_encoded_is_a_backend_error_naming_its_argument() {
        let mut args = sized_arguments::<sqlx::Postgres>(2, 8);
        args.add("fine").unwrap();
        let e = args
            .add(Refused)
            .map_err(|e| encode_err(args.len() + 1, e))
            .unwrap_err();
        assert!(!e.is_unavailable(), "{e:?}");
        let text = e.to_string();
        assert!(text.contains("argument $2") && text.contains("refused"), "{text}");
    }
}

#[cfg(test)]
mod bound_tests {
    use super::{bounded, Deadline};
    use crate::StoreError;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    /// An operation that never answers is answered `Unavailable` once its
    /// limit is spent, naming the limit.
    #[tokio::test]
    async fn an_operation_that_never_answers_is_unavailable_after_its_limit() {
        let answer = bounded(
            Duration::from_millis(30),
            std::future::pending::<Result<(), StoreError>>(),
        )
        .await;
        match answer {
            Err(StoreError::Unavailable { reason, .. }) => {
                assert!(reason.contains("no answer within 30 ms"), "{reason}")
            }
            other => panic!("expected Unavailable, got {other:?}"),
        }
    }

    /// `bounded` counts from its first poll, not from when it was built:
    /// an operation built long before it is awaited still gets its limit.
    #[tokio::test]
    async fn bounded_counts_from_its_first_poll() {
        let built = bounded(Duration::from_millis(20), async {
            tokio::task::yield_now().await;
            Ok::<_, StoreError>(7)
        });
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert_eq!(built.await.unwrap(), 7);
    }

    /// A step of a shared deadline that is due once nothing is left is not
    /// started at all.
    #[tokio::test]
    async fn a_step_due_after_its_deadline_is_not_started() {
        let deadline = Deadline::start(Duration::from_millis(10));
        tokio::time::sleep(Duration::from_millis(30)).await;
        let polled = AtomicBool::new(false);
        let answer = deadline
            .bound(async {
                polled.store(true, Ordering::SeqCst);
                Ok::<_, StoreError>(())
            })
            .await;
        assert!(
            matches!(answer, Err(StoreError::Unavailable { .. })),
            "{answer:?}"
        );
        assert!(!polled.load(Ordering::SeqCst), "the step ran past its deadline");
    }

    /// The steps of one deadline share it: the second is bounded by what
    /// the first left, not by the whole limit again.
    #[tokio::test]
    async fn steps_share_one_deadline() {
        let deadline = Deadline::start(Duration::from_millis(400));
        deadline
            .bound(async {
                tokio::time::sleep(Duration::from_millis(300)).await;
                Ok::<_, StoreError>(())
            })
            .await
            .unwrap();
        let started = std::time::Instant::now();
        let second = deadline
            .bound(std::future::pending::<Result<(), StoreError>>())
            .await;
        assert!(
            matches!(second, Err(StoreError::Unavailable { .. })),
            "{second:?}"
        );
        // About 100 ms left; the whole limit again would be 400.
        assert!(
            started.elapsed() < Duration::from_millis(300),
            "{:?}",
            started.elapsed()
        );
    }

    /// An operation that spends the task's whole cooperative budget on
    /// each poll (one busy with ready work) still times out: the bound's
    /// timer does not wait for budget, as tokio's own `timeout` does not.
    #[tokio::test]
    async fn a_bound_fires_while_its_operation_spends_every_budget() {
        let busy = async {
            loop {
                tokio::task::consume_budget().await;
            }
        };
        let answer = tokio::time::timeout(
            Duration::from_secs(5),
            bounded(Duration::from_millis(50), async {
                busy.await;
                Ok::<(), StoreError>(())
            }),
        )
        .await;
        assert!(
            matches!(answer, Ok(Err(StoreError::Unavailable { .. }))),
            "the bound never fired: {answer:?}"
        );
    }

    /// A limit too far for the clock to tell never passes, and does not
    /// panic.
    #[tokio::test]
    async fn a_limit_past_the_clock_never_passes() {
        let answer = bounded(Duration::MAX, async {
            tokio::task::yield_now().await;
            Ok::<_, StoreError>(1)
        })
        .await;
        assert_eq!(answer.unwrap(), 1);
    }
}
