//! SQL shared by the PostgreSQL and SQLite stores. The two dialects differ
//! only in their clock expression and placeholder sign; every statement is
//! built once per store, with the table name validated and quoted, and every
//! value bound as a parameter.

#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg(feature = "sqlite")]
pub(crate) mod sqlite;

use crate::store::{RecordState, StoreError, StoredResponse};
use std::future::Future;
use std::time::Duration;

/// What a statement that took the key returns.
const RETURNED: &str = "attempt, taken_over, recovery_point, operation_id";

/// The table name both SQL stores use unless told otherwise.
pub const DEFAULT_TABLE: &str = "idempotency_keys";

/// The longest table name: PostgreSQL's 63 bytes. The names derived from it
/// (`<table>_expires_at_idx`, `<table>_migrations`) that would not fit are
/// `idem_<what>_` and a hash of the table's name instead, so that they never
/// truncate or collide.
pub const MAX_TABLE_NAME: usize = 63;

/// `<table>_<suffix>`, or `idem_<suffix>_<hash>` where that would not fit.
fn derived_name(table: &str, suffix: &str) -> String {
    use sha2::{Digest, Sha256};
    let name = format!("{table}_{suffix}");
    if name.len() <= 63 {
        return name;
    }
    let hash = crate::fingerprint::hex(&Sha256::digest(table.as_bytes())[..8]);
    format!("idem_{suffix}_{hash}")
}

/// One schema change: a new file for every change, never an edited one.
/// `{table}` and `{index}` stand for the configured, quoted names.
#[derive(Clone, Copy, Debug)]
pub struct Migration {
    /// Applied in this order; recorded in `<table>_migrations`.
    pub version: i64,
    /// What it does.
    pub name: &'static str,
    /// Its SQL.
    pub sql: &'static str,
}

/// The migrations of the records table, in order, for the dialect whose
/// files are in `migrations/<dir>/`: the one list of versions and names.
macro_rules! migrations {
    ($dir:literal) => {
        &[
            $crate::sql::Migration {
                version: 1,
                name: "create idempotency keys",
                sql: include_str!(concat!(
                    "../../migrations/",
                    $dir,
                    "/0001_create_idempotency_keys.sql"
                )),
            },
            $crate::sql::Migration {
                version: 2,
                name: "add taken_over",
                sql: include_str!(concat!("../../migrations/", $dir, "/0002_add_taken_over.sql")),
            },
            $crate::sql::Migration {
                version: 3,
                name: "ensure expiry index",
                sql: include_str!(concat!(
                    "../../migrations/",
                    $dir,
                    "/0003_ensure_expiry_index.sql"
                )),
            },
        ]
    };
}
pub(crate) use migrations;

/// Every column the records table has at the latest version.
const COLUMNS: &str =
    "tenant, scope, key, fingerprint, state, operation_id, lock_token, attempt, taken_over, \
                       lock_expires_at, recovery_point, response_status, response_headers, response_body, \
                       created_at, expires_at";

/// The two SQL dialects.
#[derive(Clone, Copy)]
pub(crate) struct Dialect {
    /// The store's clock, in the unit of the time columns.
    now: &'static str,
    /// `$` (PostgreSQL) or `?` (SQLite), followed by the parameter number.
    param: char,
    /// Turns a millisecond parameter into something addable to `now`.
    millis: fn(String) -> String,
    /// Milliseconds left until a time column, never negative.
    left: fn(&str, &str) -> String,
    /// What the purge adds to its choice of rows: on PostgreSQL it locks
    /// them and skips those another transaction holds.
    purge_lock: &'static str,
    /// The store's clock in milliseconds since the Unix epoch.
    epoch_millis: &'static str,
    /// The time now, even inside a transaction (PostgreSQL's `now()` is the
    /// transaction's start), the same everywhere in one statement.
    clock: &'static str,
    /// The length of time from `b` to `a`, addable to a time column: an
    /// exact one (PostgreSQL's timestamp difference counts calendar days,
    /// which a time zone with daylight saving stretches).
    span: fn(&str, &str) -> String,
    /// Lists the columns of `table` (in `schema`) that a row must fill (no
    /// default, not null) and that are not in `known` (a list of quoted
    /// names). The names are checked identifiers.
    required_columns: fn(Option<&str>, &str, &str) -> String,
}

#[cfg(feature = "postgres")]
pub(crate) const POSTGRES: Dialect = Dialect {
    now: "now()",
    param: '$',
    millis: |p| format!("({p}::bigint * interval '1 millisecond')"),
    left: |col, now| format!("GREATEST(0, CEIL(EXTRACT(EPOCH FROM ({col} - {now})) * 1000))::bigint"),
    purge_lock: " FOR UPDATE SKIP LOCKED",
    epoch_millis: "(EXTRACT(EPOCH FROM now()) * 1000)::bigint",
    clock: "statement_timestamp()",
    span: |a, b| format!("(EXTRACT(EPOCH FROM ({a} - {b})) * interval '1 second')"),
    required_columns: |schema, table, known| {
        let schema = schema.map_or_else(|| "current_schema()".to_owned(), |s| format!("'{s}'"));
        format!(
            "SELECT column_name::text FROM information_schema.columns WHERE table_schema = {schema} \
             AND table_name = '{table}' AND is_nullable = 'NO' AND column_default IS NULL \
             AND column_name NOT IN ({known})"
        )
    },
};

#[cfg(feature = "sqlite")]
pub(crate) const SQLITE: Dialect = Dialect {
    now: "CAST(unixepoch('subsec') * 1000 AS INTEGER)",
    param: '?',
    millis: |p| p,
    left: |col, now| format!("MAX(0, {col} - {now})"),
    // One statement under SQLite's write lock: nothing changes meanwhile.
    purge_lock: "",
    epoch_millis: "CAST(unixepoch('subsec') * 1000 AS INTEGER)",
    clock: "CAST(unixepoch('subsec') * 1000 AS INTEGER)",
    span: |a, b| format!("({a} - {b})"),
    required_columns: |_, table, known| {
        format!(
            "SELECT name FROM pragma_table_info('{table}') WHERE \"notnull\" = 1 AND dflt_value IS NULL \
             AND name NOT IN ({known})"
        )
    },
};

/// Every statement a store runs, for one table.
pub(crate) struct Statements {
    /// The quoted, qualified table name.
    pub(crate) table: String,
    /// The migrations, their names filled in.
    pub(crate) migrations: Vec<(Migration, String)>,
    /// Creates the migrations table.
    pub(crate) create_versions: String,
    /// The versions applied. Columns: version.
    pub(crate) versions: String,
    /// Records a version. Binds: version, name.
    pub(crate) record_version: String,
    /// Reads nothing, but fails unless the table exists.
    pub(crate) table_exists: String,
    /// Reads nothing, but fails unless version 2's column exists.
    pub(crate) has_taken_over: String,
    /// Reads nothing, but fails unless every column the code needs exists.
    pub(crate) has_columns: String,
    /// The columns a row must fill that the code does not know.
    pub(crate) unknown_required: String,
    /// Takes the key (insert, or update of a takeable row) in one upsert.
    /// Binds: tenant, scope, key, fingerprint, token, operation id, ttl ms, lock ms.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    pub(crate) take: String,
    /// Inserts a fresh record if there is none; the same binds.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) insert_new: String,
    /// Takes an existing, takeable record; the same binds.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) take_over: String,
    /// Binds: tenant, scope, key. Columns: fingerprint, state, status,
    /// headers, body, lock_left_ms.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    pub(crate) existing: String,
    /// `existing` plus `takeable` (1 or 0): whether a reservation with this
    /// fingerprint would take the row as read. Binds: tenant, scope, key,
    /// fingerprint.
    pub(crate) peek: String,
    /// Binds: tenant, scope, key, token, status, headers, body.
    pub(crate) complete: String,
    /// Binds: tenant, scope, key, token.
    pub(crate) release: String,
    /// Removes a rejected first attempt. Binds: tenant, scope, key, token.
    pub(crate) reject: String,
    /// Binds: tenant, scope, key, token, recovery point.
    pub(crate) checkpoint: String,
    /// Binds: tenant, scope, key, token, lock ms.
    pub(crate) extend: String,
    /// Binds: batch size.
    pub(crate) purge: String,
}

/// Checks a SQL identifier: ASCII letters, digits and `_`, not starting with
/// a digit, at most `max` bytes. Quoted afterwards all the same.
pub(crate) fn check_identifier(name: &str, max: usize) -> Result<(), StoreError> {
    if name.len() > max {
        return Err(StoreError::backend(format!(
            "the name `{name}` is {} bytes; at most {max} are allowed (PostgreSQL's limit for a name)",
            name.len()
        )));
    }
    let ok = !name.is_empty()
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
        && !name.as_bytes()[0].is_ascii_digit();
    if ok {
        Ok(())
    } else {
        Err(StoreError::backend(format!(
            "invalid table or schema name `{name}`: use ASCII letters, digits and `_`, not starting with a digit"
        )))
    }
}

impl Statements {
    pub(crate) fn new(
        d: Dialect,
        migrations: &[Migration],
        schema: Option<&str>,
        table: &str,
    ) -> Result<Self, StoreError> {
        check_identifier(table, MAX_TABLE_NAME)?;
        if let Some(schema) = schema {
            check_identifier(schema, 63)?;
        }
        let qualify = |name: &str| match schema {
            Some(s) => format!("\"{s}\".\"{name}\""),
            None => format!("\"{name}\""),
        };
        let t = qualify(table);
        let versions_table = qualify(&derived_name(table, "migrations"));
        let index = format!("\"{}\"", derived_name(table, "expires_at_idx"));
        let now = d.now;
        let p = |n: u8| format!("{}{n}", d.param);
        let ms = |n: u8| (d.millis)(p(n));
        let (in_progress, completed) = (RecordState::IN_PROGRESS_COLUMN, RecordState::COMPLETED_COLUMN);
        let live_lock = format!("(cur.state = '{in_progress}' AND cur.lock_expires_at > {now})");
        // Gone (as if absent, and purgeable): a completed record past its
        // TTL; a record in progress (its execution may have crashed after an
        // effect) only once it is also a whole TTL past its lock deadline,
        // so that a retry can still continue its operation.
        let expired = format!(
            "(cur.expires_at <= {now} AND (cur.state = '{completed}' \
             OR cur.lock_expires_at + {ttl} <= {now}))",
            ttl = (d.span)("cur.expires_at", "cur.created_at"),
        );
        let id = format!("tenant = {} AND scope = {} AND key = {}", p(1), p(2), p(3));
        let owned = format!("{id} AND state = '{in_progress}' AND lock_token = {}", p(4));
        // A fresh record: absent before, or replacing an expired one.
        let insert = format!(
            "INSERT INTO {t} AS cur (tenant, scope, key, fingerprint, state, operation_id, lock_token, \
             attempt, lock_expires_at, recovery_point, created_at, expires_at) \
             VALUES ({}, {}, {}, {}, '{in_progress}', {}, {}, 1, {now} + {}, NULL, {now}, {now} + {})",
            p(1),
            p(2),
            p(3),
            p(4),
            p(6),
            p(5),
            ms(8),
            ms(7),
        );
        // What may be taken: an expired record without a live lock (a new
        // operation), a stale lock (a takeover) or a record released as
        // failed (the retry of its operation), both with the same
        // fingerprint. A released record has no lock token.
        let takeable = format!(
            "NOT {live_lock} AND ({expired} OR (cur.state = '{in_progress}' AND cur.fingerprint = {}))",
            p(4)
        );
        // Taking it: `new(col)` is the new value of a column. A new operation
        // starts afresh; the same one keeps its id and recovery point, so
        // that its derived keys stay the same.
        let take_set = |new: &dyn Fn(&str) -> String| {
            let fresh = format!("({expired})");
            format!(
                "fingerprint = {fp}, state = '{in_progress}', lock_token = {token}, lock_expires_at = {lock}, \
                 attempt = CASE WHEN {fresh} THEN 1 ELSE cur.attempt + 1 END, \
                 taken_over = CASE WHEN {fresh} OR cur.lock_token IS NULL THEN 0 ELSE 1 END, \
                 recovery_point = CASE WHEN {fresh} THEN NULL ELSE cur.recovery_point END, \
                 operation_id = CASE WHEN {fresh} THEN {op} ELSE cur.operation_id END, \
                 created_at = CASE WHEN {fresh} THEN {created} ELSE cur.created_at END, \
                 expires_at = CASE WHEN {fresh} THEN {expires} ELSE cur.expires_at END, \
                 response_status = NULL, response_headers = NULL, response_body = NULL",
                fp = new("fingerprint"),
                token = new("lock_token"),
                lock = new("lock_expires_at"),
                op = new("operation_id"),
                created = new("created_at"),
                expires = new("expires_at"),
            )
        };
        Ok(Statements {
            table: t.clone(),
            migrations: migrations
                .iter()
                .map(|m| (*m, m.sql.replace("{table}", &t).replace("{index}", &index)))
                .collect(),
            create_versions: format!(
                "CREATE TABLE IF NOT EXISTS {versions_table} (version BIGINT PRIMARY KEY, name TEXT NOT NULL, \
                 applied_at BIGINT NOT NULL)"
            ),
            versions: format!("SELECT version FROM {versions_table} ORDER BY version"),
            record_version: format!(
                "INSERT INTO {versions_table} (version, name, applied_at) VALUES ({}, {}, {}) \
                 ON CONFLICT (version) DO NOTHING",
                p(1),
                p(2),
                d.epoch_millis,
            ),
            table_exists: format!("SELECT 1 FROM {t} LIMIT 0"),
            has_taken_over: format!("SELECT taken_over FROM {t} LIMIT 0"),
            has_columns: format!("SELECT {COLUMNS} FROM {t} LIMIT 0"),
            unknown_required: (d.required_columns)(
                schema,
                table,
                &COLUMNS
                    .split(',')
                    .map(|c| format!("'{}'", c.trim()))
                    .collect::<Vec<_>>()
                    .join(", "),
            ),
            take: format!(
                "{insert} ON CONFLICT (tenant, scope, key) DO UPDATE SET {set} \
                 WHERE {takeable} RETURNING {RETURNED}",
                set = take_set(&|col| format!("excluded.{col}")),
            ),
            insert_new: format!("{insert} ON CONFLICT (tenant, scope, key) DO NOTHING RETURNING {RETURNED}"),
            take_over: format!(
                "UPDATE {t} AS cur SET {set} WHERE cur.tenant = {p1} AND cur.scope = {p2} \
                 AND cur.key = {p3} AND {takeable} RETURNING {RETURNED}",
                set = take_set(&|col| match col {
                    "fingerprint" => p(4),
                    "lock_token" => p(5),
                    "operation_id" => p(6),
                    "lock_expires_at" => format!("{now} + {}", ms(8)),
                    "created_at" => now.to_owned(),
                    _ => format!("{now} + {}", ms(7)), // expires_at
                }),
                p1 = p(1),
                p2 = p(2),
                p3 = p(3),
            ),
            existing: format!(
                "SELECT fingerprint, state, CAST(response_status AS BIGINT) AS response_status, \
                 response_headers, response_body, {left} AS lock_left_ms \
                 FROM {t} WHERE {id}",
                left = (d.left)("lock_expires_at", now),
            ),
            peek: format!(
                "SELECT fingerprint, state, CAST(response_status AS BIGINT) AS response_status, \
                 response_headers, response_body, {left} AS lock_left_ms, \
                 CASE WHEN {takeable} THEN 1 ELSE 0 END AS takeable \
                 FROM {t} AS cur WHERE cur.tenant = {} AND cur.scope = {} AND cur.key = {}",
                p(1),
                p(2),
                p(3),
                left = (d.left)("cur.lock_expires_at", now),
            ),
            // The answer is kept a whole TTL from its completion.
            complete: format!(
                "UPDATE {t} SET state = '{completed}', lock_token = NULL, response_status = {}, \
                 response_headers = {}, response_body = {}, created_at = {clock}, \
                 expires_at = {clock} + {ttl} WHERE {owned}",
                p(5),
                p(6),
                p(7),
                clock = d.clock,
                ttl = (d.span)("expires_at", "created_at"),
            ),
            // Released, not deleted: the retry of the same request continues
            // the same operation (same id, so the same derived keys).
            release: format!("UPDATE {t} SET lock_token = NULL, lock_expires_at = {now} WHERE {owned}"),
            reject: format!("DELETE FROM {t} WHERE {owned} AND attempt = 1 AND recovery_point IS NULL"),
            checkpoint: format!("UPDATE {t} SET recovery_point = {} WHERE {owned}", p(5)),
            extend: format!("UPDATE {t} SET lock_expires_at = {now} + {} WHERE {owned}", ms(5)),
            // The conditions stand twice: on the chosen rows and on the row
            // deleted, so a row that changed in between (reserved afresh)
            // is judged again and kept.
            purge: format!(
                "DELETE FROM {t} AS cur WHERE (cur.tenant, cur.scope, cur.key) IN (SELECT tenant, scope, key \
                 FROM {t} AS cur WHERE {expired} AND NOT {live_lock} LIMIT {}{lock}) \
                 AND {expired} AND NOT {live_lock}",
                p(1),
                lock = d.purge_lock,
            ),
        })
    }
}

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
/// background, and if they took the key after all, it is given back at once
/// by a release fenced by the reservation's token. Statements still running
/// a lock timeout later are abandoned.
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
    let owned = OwnedReserve {
        id: req.id.clone(),
        fingerprint: req.fingerprint.to_owned(),
        token: req.token.to_owned(),
        ttl: req.ttl,
        lock_timeout: req.lock_timeout,
    };
    let mut running = run(store.clone(), owned);
    match tokio::time::timeout(limit, &mut running).await {
        Ok(answer) => answer,
        Err(_) => {
            let (store, id, token) = (store.clone(), req.id.clone(), req.token.to_owned());
            let hold = req.lock_timeout.max(limit);
            let undo = async move {
                let until = tokio::time::Instant::now() + hold;
                let late = tokio::time::timeout(hold, running).await;
                let took = !matches!(
                    late,
                    Ok(Ok(Reservation::Completed(_)
                        | Reservation::InProgress { .. }
                        | Reservation::Mismatch))
                );
                let mut pause = std::time::Duration::from_millis(100);
                while took && tokio::time::Instant::now() < until {
                    match store.release(&id, &token).await {
                        Ok(()) => {
                            tracing::warn!("a reservation answered after its timeout; gave the key back");
                            return;
                        }
                        Err(StoreError::LockLost) => return,
                        Err(_) => {
                            tokio::time::sleep(pause).await;
                            pause = (pause * 2).min(std::time::Duration::from_secs(2));
                        }
                    }
                }
            };
            tokio::spawn(tracing::Instrument::in_current_span(undo));
            Err(StoreError::unavailable(format!(
                "no answer within {} ms",
                limit.as_millis()
            )))
        }
    }
}

/// Maps a sqlx error: connection-level failures are [`StoreError::Unavailable`]
/// (the request is refused with 503 and may be retried), the rest
/// [`StoreError::Backend`].
pub(crate) fn map_err(e: sqlx::Error) -> StoreError {
    use sqlx::Error as E;
    let unavailable = match &e {
        E::Io(_) | E::Tls(_) | E::PoolTimedOut | E::PoolClosed | E::WorkerCrashed => true,
        E::Database(db) => {
            let code = db.code().unwrap_or_default();
            // PostgreSQL: 08 connection, 53 resources, 57P0x shutdown/crash;
            // SQLite: 5 busy, 6 locked (the busy timeout ran out).
            code.starts_with("08")
                || code.starts_with("53")
                || code.starts_with("57P0")
                || code == "5"
                || code == "6"
                || code.starts_with("5/")
                || code.starts_with("6/")
        }
        _ => false,
    };
    let reason = e.to_string();
    if unavailable {
        StoreError::unavailable(reason).with_source(e)
    } else {
        StoreError::backend(reason).with_source(e)
    }
}

/// Applies the migrations not yet applied, in a transaction `$tx` that
/// holds the store's migration lock, then checks the table. A table made
/// by a build from before the migrations table existed is recognised by its
/// columns. Probes that may fail run in a savepoint (PostgreSQL aborts a
/// transaction on an error otherwise).
macro_rules! migrate_in {
    ($self:ident, $tx:ident) => {{
        use sqlx::Acquire as _;
        let sql = &$self.sql;
        let run = |statement: &str| sqlx::raw_sql(sqlx::AssertSqlSafe(statement.to_owned()));
        run(&sql.create_versions)
            .execute(&mut *$tx)
            .await
            .map_err($crate::sql::map_err)?;
        let applied: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.versions.as_str()))
            .fetch_all(&mut *$tx)
            .await
            .map_err($crate::sql::map_err)?;
        let mut current = applied.last().copied().unwrap_or(0);
        let mut exists = $tx.begin().await.map_err($crate::sql::map_err)?;
        let table_exists = run(&sql.table_exists).execute(&mut *exists).await.is_ok();
        exists.rollback().await.map_err($crate::sql::map_err)?;
        if !table_exists {
            // Never made, or dropped since: every migration runs (again).
            current = 0;
        } else if current == 0 {
            // Made before versions were recorded: what is there already?
            for (version, probe) in [(1, &sql.table_exists), (2, &sql.has_taken_over)] {
                let mut savepoint = $tx.begin().await.map_err($crate::sql::map_err)?;
                let found = run(probe).execute(&mut *savepoint).await.is_ok();
                savepoint.rollback().await.map_err($crate::sql::map_err)?;
                if !found {
                    break;
                }
                current = version;
            }
        }
        let latest = sql.migrations.last().map_or(0, |(m, _)| m.version);
        if current > latest {
            return Err($crate::StoreError::backend(format!(
                "the table {} is at schema version {current}, newer than this build of idem knows \
                 ({latest}): upgrade idem",
                sql.table
            )));
        }
        for (migration, text) in &sql.migrations {
            if migration.version > current {
                run(text).execute(&mut *$tx).await.map_err($crate::sql::map_err)?;
            }
            if !applied.contains(&migration.version) {
                sqlx::query(sqlx::AssertSqlSafe(sql.record_version.as_str()))
                    .bind(migration.version)
                    .bind(migration.name)
                    .execute(&mut *$tx)
                    .await
                    .map_err($crate::sql::map_err)?;
            }
        }
        $tx.commit().await.map_err($crate::sql::map_err)?;
        $self.check_schema().await
    }};
}
pub(crate) use migrate_in;

/// Checks that the table has every column this build needs, at the latest
/// schema version.
macro_rules! check_schema {
    () => {
        /// Checks that the table matches what this build of idem needs (every
        /// migration applied): a service should refuse to start otherwise.
        /// [`migrate`](Self::migrate) ends with it.
        ///
        /// # Errors
        ///
        /// [`StoreError::Backend`](crate::StoreError::Backend) naming the table and what
        /// is missing, or [`StoreError::Unavailable`](crate::StoreError::Unavailable).
        pub async fn check_schema(&self) -> Result<(), $crate::StoreError> {
            let sql = &self.sql;
            let latest = sql.migrations.last().map_or(0, |(m, _)| m.version);
            let applied: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.versions.as_str()))
                .fetch_all(&self.pool)
                .await
                .map_err(|e| $crate::sql::schema_error(&sql.table, latest, e))?;
            let current = applied.last().copied().unwrap_or(0);
            if current != latest {
                return Err($crate::StoreError::backend(format!(
                    "the table {} is at schema version {current}, this build of idem needs {latest}: \
                     run migrate()",
                    sql.table
                )));
            }
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql.has_columns.clone()))
                .execute(&self.pool)
                .await
                .map_err(|e| $crate::sql::schema_error(&sql.table, latest, e))?;
            // A column of someone else's that every row must fill would make
            // every reservation fail.
            let unknown: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.unknown_required.as_str()))
                .fetch_all(&self.pool)
                .await
                .map_err(|e| $crate::sql::schema_error(&sql.table, latest, e))?;
            if !unknown.is_empty() {
                return Err($crate::StoreError::backend(format!(
                    "the table {} has columns idem does not fill and that have no default: {}; give them a \
                     default or drop them",
                    sql.table,
                    unknown.join(", ")
                )));
            }
            Ok(())
        }
    };
}
pub(crate) use check_schema;

/// A schema check that failed: unreachable, or a table that does not match.
pub(crate) fn schema_error(table: &str, latest: i64, e: sqlx::Error) -> StoreError {
    match map_err(e) {
        StoreError::Backend { reason, source } => StoreError::Backend {
            reason: format!(
                "the table {table} does not match schema version {latest} of idem ({reason}): run migrate()"
            ),
            source,
        },
        other => other,
    }
}

/// The fenced writes and the purge, the same text for both SQL stores.
/// Expects `self.pool`, `self.sql: Statements` and `self.timeout`.
macro_rules! fenced_ops {
    () => {
        fn complete<'a>(
            &'a self,
            id: &'a $crate::store::RecordId,
            token: &'a str,
            response: &'a $crate::store::StoredResponse,
        ) -> $crate::store::BoxFuture<'a, Result<(), $crate::StoreError>> {
            Box::pin($crate::sql::bounded(self.timeout, async move {
                self.complete_with(&self.pool, id, token, response).await?;
                pause_point!($crate::pause::COMPLETE_AFTER, &id.key);
                Ok(())
            }))
        }

        fn release<'a>(
            &'a self,
            id: &'a $crate::store::RecordId,
            token: &'a str,
        ) -> $crate::store::BoxFuture<'a, Result<(), $crate::StoreError>> {
            Box::pin($crate::sql::bounded(self.timeout, async move {
                $crate::sql::fenced(self.owned_write(&self.sql.release, id, token).await?)?;
                pause_point!($crate::pause::RELEASE_AFTER, &id.key);
                Ok(())
            }))
        }

        fn reject<'a>(
            &'a self,
            id: &'a $crate::store::RecordId,
            token: &'a str,
        ) -> $crate::store::BoxFuture<'a, Result<(), $crate::StoreError>> {
            Box::pin($crate::sql::bounded(self.timeout, async move {
                if self.owned_write(&self.sql.reject, id, token).await? == 0 {
                    // A later attempt (or a lost lock): released as failed.
                    $crate::sql::fenced(self.owned_write(&self.sql.release, id, token).await?)?;
                }
                pause_point!($crate::pause::REJECT_AFTER, &id.key);
                Ok(())
            }))
        }

        fn checkpoint<'a>(
            &'a self,
            id: &'a $crate::store::RecordId,
            token: &'a str,
            recovery_point: &'a str,
        ) -> $crate::store::BoxFuture<'a, Result<(), $crate::StoreError>> {
            Box::pin($crate::sql::bounded(self.timeout, async move {
                let done = sqlx::query(sqlx::AssertSqlSafe(self.sql.checkpoint.as_str()))
                    .bind(&id.tenant)
                    .bind(&id.scope)
                    .bind(&id.key)
                    .bind(token)
                    .bind(recovery_point)
                    .execute(&self.pool)
                    .await
                    .map_err($crate::sql::map_err)?;
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
            Box::pin($crate::sql::bounded(self.timeout, async move {
                let done = sqlx::query(sqlx::AssertSqlSafe(self.sql.extend.as_str()))
                    .bind(&id.tenant)
                    .bind(&id.scope)
                    .bind(&id.key)
                    .bind(token)
                    .bind($crate::sql::millis(lock_timeout))
                    .execute(&self.pool)
                    .await
                    .map_err($crate::sql::map_err)?;
                $crate::sql::fenced(done.rows_affected())?;
                pause_point!($crate::pause::EXTEND_AFTER, &id.key);
                Ok(())
            }))
        }

        fn purge_expired(&self, batch: u32) -> $crate::store::BoxFuture<'_, Result<u64, $crate::StoreError>> {
            Box::pin($crate::sql::bounded(self.timeout, async move {
                let done = sqlx::query(sqlx::AssertSqlSafe(self.sql.purge.as_str()))
                    .bind(i64::from(batch))
                    .execute(&self.pool)
                    .await
                    .map_err($crate::sql::map_err)?;
                pause_point!($crate::pause::PURGE_AFTER, &self.sql.table);
                Ok(done.rows_affected())
            }))
        }
    };
}
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
                .map_err($crate::sql::map_err)?;
            Ok(done.rows_affected())
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
            let done = sqlx::query(sqlx::AssertSqlSafe(self.sql.complete.as_str()))
                .bind(&id.tenant)
                .bind(&id.scope)
                .bind(&id.key)
                .bind(token)
                .bind(i32::from(response.status))
                .bind(response.headers_to_json())
                .bind(response.body.as_deref())
                .execute(executor)
                .await
                .map_err($crate::sql::map_err)?;
            $crate::sql::fenced(done.rows_affected())
        }
    };
}
pub(crate) use complete_with;

/// A fenced write that touched no row lost its lock.
pub(crate) fn fenced(rows: u64) -> Result<(), StoreError> {
    if rows == 1 {
        Ok(())
    } else {
        Err(StoreError::LockLost)
    }
}

/// Reads the row of an existing record that was not taken.
pub(crate) fn judge_row<R>(row: &R, fingerprint: &str) -> Result<crate::store::Reservation, StoreError>
where
    R: sqlx::Row,
    for<'r> &'r str: sqlx::ColumnIndex<R>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<String>: sqlx::Decode<'r, R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<i64>: sqlx::Decode<'r, R::Database>,
    for<'r> Option<Vec<u8>>: sqlx::Decode<'r, R::Database>,
    for<'r> Vec<u8>: sqlx::Type<R::Database>,
{
    let get_err = |e: sqlx::Error| StoreError::backend(e.to_string());
    let stored_fp: String = row.try_get("fingerprint").map_err(get_err)?;
    let state: String = row.try_get("state").map_err(get_err)?;
    let lock_left: i64 = row.try_get("lock_left_ms").map_err(get_err)?;
    let completed = if state == RecordState::COMPLETED_COLUMN {
        Some(crate::store::StoredResponse::from_columns(
            row.try_get("response_status").map_err(get_err)?,
            row.try_get("response_headers").map_err(get_err)?,
            row.try_get("response_body").map_err(get_err)?,
        )?)
    } else {
        None
    };
    Ok(crate::store::judge_existing(
        stored_fp == fingerprint,
        completed,
        std::time::Duration::from_millis(u64::try_from(lock_left).unwrap_or(0)),
    ))
}

/// Reads the row of a record the caller just took.
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
            Some(json) => {
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
            None => Vec::new(),
        };
        Ok(StoredResponse {
            status,
            headers,
            body,
        })
    }
}

/// Bounds a store operation by `limit`: past it, [`StoreError::Unavailable`].
pub(crate) async fn bounded<T>(
    limit: Duration,
    fut: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(limit, fut).await {
        Ok(result) => result,
        Err(_) => Err(StoreError::unavailable(format!(
            "no answer within {} ms",
            limit.as_millis()
        ))),
    }
}

/// Milliseconds as the stores bind them.
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_that_could_inject_sql_are_refused() {
        for bad in ["", "a b", "t\"; drop table x; --", "1abc", "é", &"x".repeat(64)] {
            assert!(check_identifier(bad, 63).is_err(), "{bad}");
        }
        for good in ["idempotency_keys", "_t", "Keys2"] {
            assert!(check_identifier(good, 63).is_ok(), "{good}");
        }
        assert!(check_identifier(&"x".repeat(MAX_TABLE_NAME + 1), MAX_TABLE_NAME).is_err());
        assert_eq!(derived_name("keys", "migrations"), "keys_migrations");
        let long = "x".repeat(63);
        let derived = derived_name(&long, "expires_at_idx");
        assert!(
            derived.starts_with("idem_expires_at_idx_") && derived.len() <= 63,
            "{derived}"
        );
        assert_ne!(derived, derived_name(&"y".repeat(63), "expires_at_idx"));
    }

    #[test]
    #[cfg(all(feature = "postgres", feature = "sqlite"))]
    fn statements_name_the_quoted_table() {
        let m = [Migration {
            version: 1,
            name: "t",
            sql: "CREATE TABLE {table}; {index}",
        }];
        let s = Statements::new(POSTGRES, &m, Some("app"), "keys").unwrap();
        assert_eq!(
            s.migrations[0].1,
            "CREATE TABLE \"app\".\"keys\"; \"keys_expires_at_idx\""
        );
        assert!(s.take.starts_with("INSERT INTO \"app\".\"keys\" AS cur"));
        assert!(!s.take.contains('?'));
        let s = Statements::new(SQLITE, &[], None, "keys").unwrap();
        assert!(s.take.contains("?8") && !s.take.contains('$'));
    }
}
