//! The records table's schema versions: the list of migrations, applying
//! those not yet applied, and checking a table against the latest version.

use super::map_err;
use crate::store::StoreError;

/// One schema change: a new file for every change, never an edited one.
/// `{table}`, `{index}`, `{purge_index}` and `{expiry_index}` stand for the
/// configured, quoted names (the last one qualified), as are
/// `{times_on_insert}` and `{times_on_update}` (SQLite's triggers); `{reserve_function}`
/// and `{take_function}` for the generated functions' definitions.
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
            $crate::sql::Migration {
                version: 4,
                name: "reserve function",
                sql: include_str!(concat!("../../migrations/", $dir, "/0004_reserve_function.sql")),
            },
            $crate::sql::Migration {
                version: 5,
                name: "purge index",
                sql: include_str!(concat!("../../migrations/", $dir, "/0005_purge_index.sql")),
            },
            $crate::sql::Migration {
                version: 6,
                name: "take function",
                sql: include_str!(concat!("../../migrations/", $dir, "/0006_take_function.sql")),
            },
            $crate::sql::Migration {
                version: 7,
                name: "integer times",
                sql: include_str!(concat!("../../migrations/", $dir, "/0007_integer_times.sql")),
            },
        ]
    };
}
pub(crate) use migrations;

/// Runs `$statement` in a savepoint of `$tx` and rolls it back: whether
/// what it reads is there ([`found`]). A probe that fails does not abort
/// `$tx` (PostgreSQL aborts a transaction on an error otherwise).
macro_rules! probed {
    ($tx:ident, $statement:expr) => {{
        use sqlx::Acquire as _;
        let mut savepoint = $tx.begin().await.map_err($crate::sql::map_err)?;
        let found = $crate::sql::found(
            sqlx::raw_sql(sqlx::AssertSqlSafe($statement.to_owned()))
                .execute(&mut *savepoint)
                .await,
        )?;
        savepoint.rollback().await.map_err($crate::sql::map_err)?;
        found
    }};
}
pub(crate) use probed;

/// Applies the migrations not yet applied, in a transaction `$tx` that
/// holds the store's migration lock, and commits it (the caller then checks
/// the table). A table made by a build from before the migrations table
/// existed is recognised by its columns. Probes that may fail run in a
/// savepoint (PostgreSQL aborts a transaction on an error otherwise).
macro_rules! migrate_in {
    ($self:ident, $tx:ident) => {{
        let sql = &$self.sql;
        let run = |statement: &str| sqlx::raw_sql(sqlx::AssertSqlSafe(statement.to_owned()));
        $crate::sql::refuse_found_elsewhere(&mut *$tx, sql).await?;
        // Created only when missing: a role that may create nothing in the
        // schema can still run `migrate()` on an up-to-date table.
        let versions_exist = $crate::sql::probed!($tx, &sql.versions_exist);
        if !versions_exist {
            run(&sql.create_versions)
                .execute(&mut *$tx)
                .await
                .map_err($crate::sql::map_err)?;
        } else {
            // A table of that name without idem's columns (another
            // service's): refused by name before anything is written,
            // rather than with the database's word for a missing column.
            // With them, one that cannot serve as it (a view, other
            // types, no unique version) is refused too: PostgreSQL would
            // cast idem's numbers into it, and the table made beside it
            // would find its versions unreadable.
            let why = if $crate::sql::probed!($tx, &sql.versions_shape) {
                $crate::sql::reason(&mut *$tx, &sql.versions_fit).await?
            } else {
                Some("it lacks version, name or applied_at".to_owned())
            };
            if let Some(why) = why {
                return Err($crate::StoreError::backend(format!(
                    "the table {} exists but is not idem's migrations table: {why}; nothing was changed. \
                     It is the one idem names after its table {}: give idem's table another name \
                     (`with_table`), or that table another",
                    sql.versions_shown, sql.table
                )));
            }
        }
        let applied: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.versions.as_str()))
            .fetch_all(&mut *$tx)
            .await
            .map_err($crate::sql::map_err)?;
        let mut current = applied.last().copied().unwrap_or(0);
        let latest = sql.migrations.last().map_or(0, |(m, _)| m.version);
        // A newer build's table is refused before anything is written, also
        // when its records table is gone (that build may have renamed it):
        // this build's table made beside it would be found by neither.
        if current > latest {
            return Err($crate::sql::newer_schema(&sql.table, current, latest));
        }
        let table_exists = $crate::sql::probed!($tx, &sql.table_exists);
        if !table_exists {
            // Never made, or dropped since: every migration runs (again).
            current = 0;
        } else if current == 0 {
            // Made before versions were recorded: what is there already? A
            // table without version 1's columns is not idem's (another
            // service's, under the same name): refused before anything is
            // written, and the transaction, never committed, changes nothing.
            let ours = $crate::sql::probed!($tx, &sql.has_v1_columns);
            if !ours {
                return Err($crate::StoreError::backend(format!(
                    "the table {} exists but is not idem's: it has no schema version recorded and lacks \
                     idem's columns (tenant, scope, key, fingerprint, ...); nothing was changed. Give idem \
                     a table of its own (`with_table`)",
                    sql.table
                )));
            }
            // Version 5's column says 3 and 4 are there too (3's index is
            // gone with it; 4 changed no table); a table of this build moved
            // without its versions has it, and SQLite cannot add it twice.
            for (version, probe) in [
                (1, &sql.table_exists),
                (2, &sql.has_taken_over),
                (5, &sql.has_purge_at),
            ] {
                let found = $crate::sql::probed!($tx, probe);
                if !found {
                    break;
                }
                current = version;
            }
        }
        // A name a pending migration gives an object of its own, held by
        // something else: refused before anything is written, where `IF NOT
        // EXISTS` would leave the table without its index and `DROP INDEX IF
        // EXISTS` would drop another table's.
        for (before, statement) in &sql.names_taken {
            if current >= *before {
                continue;
            }
            let taken: Option<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(statement.as_str()))
                .fetch_optional(&mut *$tx)
                .await
                .map_err($crate::sql::map_err)?;
            if let Some(taken) = taken {
                return Err($crate::StoreError::backend(format!(
                    "migrate() changed nothing: {taken}, where the migrations of the table {} make an \
                     index or trigger of that name for it (or drop idem's own). Rename that, or give \
                     idem's table another name (`with_table`)",
                    sql.table
                )));
            }
        }
        let mut recorded = false;
        for (migration, text) in &sql.migrations {
            if migration.version > current {
                run(text).execute(&mut *$tx).await.map_err($crate::sql::map_err)?;
            }
            if !applied.contains(&migration.version) {
                recorded = true;
                sqlx::query(sqlx::AssertSqlSafe(sql.record_version.as_str()))
                    .bind(migration.version)
                    .bind(migration.name)
                    .execute(&mut *$tx)
                    .await
                    .map_err($crate::sql::map_err)?;
            }
        }
        // The versions recorded must read back (a rule or trigger of the
        // table's own may drop them): else every later start would find
        // the table at an older version and be told to migrate again.
        if recorded {
            let kept: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.versions.as_str()))
                .fetch_all(&mut *$tx)
                .await
                .map_err($crate::sql::map_err)?;
            if sql.migrations.iter().any(|(m, _)| !kept.contains(&m.version)) {
                return Err($crate::StoreError::backend(format!(
                    "the table {} did not keep the versions migrate() recorded in it (a rule or trigger \
                     of its own?); nothing was changed. It is the one idem names after its table {}: give \
                     idem's table another name (`with_table`), or that table another",
                    sql.versions_shown, sql.table
                )));
            }
        }
        // Whatever the version, the reservation function is this build's:
        // made again if someone dropped it or another build changed it, and
        // left alone otherwise (a role that does not own it can migrate).
        if let (Some(ddl), Some((body, source))) = (&sql.reserve_ddl, &sql.reserve_source) {
            let found: Option<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(source.as_str()))
                .fetch_optional(&mut *$tx)
                .await
                .map_err($crate::sql::map_err)?;
            if found.as_ref() != Some(body) {
                run(ddl).execute(&mut *$tx).await.map_err($crate::sql::map_err)?;
            }
        }
        // Not a schema version (no build needs it, so a build before it
        // still finds the table at its own version): PostgreSQL's drop of
        // the first schema's check on `state`, which gives up when it cannot
        // take the table's lock at once, and so is tried at every migration
        // until the check is gone.
        if let Some((probe, step)) = &sql.drop_state_check {
            let there: bool = sqlx::query_scalar(sqlx::AssertSqlSafe(probe.as_str()))
                .fetch_one(&mut *$tx)
                .await
                .map_err($crate::sql::map_err)?;
            if there {
                run(step).execute(&mut *$tx).await.map_err($crate::sql::map_err)?;
            }
        }
        // A table this build finds current writes nothing above: whether it
        // can be written at all (a read-only file or replica, a role
        // without the right) is asked here, so that a service refuses to
        // start rather than answer every request 503.
        $crate::sql::refuse_unreservable(&mut *$tx, sql, &sql.writes).await?;
        $tx.commit().await.map_err($crate::sql::map_err)?;
        Ok::<(), $crate::StoreError>(())
    }};
}
pub(crate) use migrate_in;

/// What a probe of the schema found: `false` only where the database says
/// the table or column is not there. Any other error (a lock wait that ran
/// out, a connection lost) is the migration's error, never read as a
/// missing table, which would run every migration again on a table that
/// has them. On SQLite, inside the migration's write transaction, an error
/// reads as absent, as it always has.
pub(crate) fn found<T>(probed: Result<T, sqlx::Error>) -> Result<bool, StoreError> {
    match probed {
        Ok(_) => Ok(true),
        Err(sqlx::Error::Database(db)) if missing(&*db) => Ok(false),
        Err(e) => Err(map_err(e)),
    }
}

/// Whether the database's error says that what was asked for does not exist.
fn missing(db: &dyn sqlx::error::DatabaseError) -> bool {
    #[cfg(feature = "sqlite")]
    if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() {
        return true;
    }
    // PostgreSQL: undefined table, undefined column, invalid schema name.
    matches!(db.code().as_deref(), Some("42P01" | "42703" | "3F000"))
}

/// Checks that the table has every column this build needs, at the latest
/// schema version.
macro_rules! check_schema {
    () => {
        $crate::sql::check_schema!(pub check_schema);
    };
    ($vis:vis $name:ident) => {
        /// Checks that the table matches what this build of idem needs (every
        /// migration applied; every column, of a type, collation and
        /// nullability that hold what idem writes; no unique index that can
        /// make two ids one; and a unique key on (tenant, scope, key)): a
        /// service should refuse to start otherwise (README, "Choosing a
        /// store").
        /// [`migrate`](Self::migrate) ends with it.
        ///
        /// # Errors
        ///
        /// [`StoreError::Backend`](crate::StoreError::Backend) naming the table and what
        /// is missing (or, on PostgreSQL, a database not encoded in `UTF8`
        /// or `SQL_ASCII`), or [`StoreError::Unavailable`](crate::StoreError::Unavailable).
        $vis async fn $name(&self) -> Result<(), $crate::StoreError> {
            let sql = &self.sql;
            let latest = sql.migrations.last().map_or(0, |(m, _)| m.version);
            $crate::sql::refuse_encoding(&self.pool, sql).await?;
            $crate::sql::refuse_schema(&self.pool, sql).await?;
            $crate::sql::refuse_found_elsewhere(&self.pool, sql).await?;
            let applied: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.versions.as_str()))
                .fetch_all(&self.pool)
                .await
                .map_err(|e| $crate::sql::schema_error(&sql.table, latest, e))?;
            let current = applied.last().copied().unwrap_or(0);
            if current > latest {
                return Err($crate::sql::newer_schema(&sql.table, current, latest));
            }
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
            if let Some(query) = &sql.has_reserve_function {
                let found: bool = sqlx::query_scalar(sqlx::AssertSqlSafe(query.as_str()))
                    .fetch_one(&self.pool)
                    .await
                    .map_err(|e| $crate::sql::schema_error(&sql.table, latest, e))?;
                if !found {
                    return Err($crate::StoreError::backend(format!(
                        "the reservation function of the table {} is missing (schema version 6): run migrate()",
                        sql.table
                    )));
                }
            }
            $crate::sql::refuse_column_types(&self.pool, sql).await?;
            // Every reservation's `ON CONFLICT (tenant, scope, key)` needs a
            // unique key on those columns (a table made by hand may have
            // every column and none).
            $crate::sql::refuse_unreservable(&self.pool, sql, &sql.has_unique_key).await?;
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

/// Refuses a table that `search_path` finds in another schema than the
/// one new objects go to: it is someone else's (another service's records,
/// whose answers this store would replay as its own). PostgreSQL, no schema
/// named; nothing to check otherwise.
pub(crate) async fn refuse_found_elsewhere<'c, E, DB>(
    conn: E,
    sql: &super::Statements,
) -> Result<(), StoreError>
where
    DB: sqlx::Database,
    E: sqlx::Executor<'c, Database = DB>,
    for<'r> (String, Option<String>): sqlx::FromRow<'r, DB::Row>,
    DB::Arguments: sqlx::IntoArguments<DB>,
{
    let Some(query) = &sql.found_elsewhere else {
        return Ok(());
    };
    let found: Option<(String, Option<String>)> = sqlx::query_as(sqlx::AssertSqlSafe(query.as_str()))
        .fetch_optional(conn)
        .await
        .map_err(map_err)?;
    match found {
        None => Ok(()),
        Some((elsewhere, here)) => Err(StoreError::backend(format!(
            "the table {} (or its migrations table) is found through search_path in schema \
             `{elsewhere}`, but this connection makes new objects in `{}`: it may be another \
             service's, whose records this store would share. Name the schema of this store's own \
             table with with_table(Some(\"<schema>\"), ...) (`{elsewhere}` only if that table is \
             this service's)",
            sql.table,
            here.as_deref().unwrap_or("(none)"),
        ))),
    }
}

/// Refuses a database whose encoding cannot hold every Unicode text: a
/// tenant or a checkpoint's name it cannot convert would fail every request
/// that carries it, on every retry, where the other stores keep it.
/// PostgreSQL's `UTF8` holds them all, and `SQL_ASCII` keeps the bytes as
/// sent; nothing to check on SQLite.
pub(crate) async fn refuse_encoding<'c, E, DB>(conn: E, sql: &super::Statements) -> Result<(), StoreError>
where
    DB: sqlx::Database,
    E: sqlx::Executor<'c, Database = DB>,
    for<'r> (String,): sqlx::FromRow<'r, DB::Row>,
    DB::Arguments: sqlx::IntoArguments<DB>,
{
    let Some(query) = sql.encoding else {
        return Ok(());
    };
    let (encoding,): (String,) = sqlx::query_as(query).fetch_one(conn).await.map_err(map_err)?;
    match encoding.as_str() {
        "UTF8" | "SQL_ASCII" => Ok(()),
        other => Err(StoreError::backend(format!(
            "the database of the table {} is encoded in {other}, which cannot hold every tenant and \
             checkpoint name (idem's text is Unicode): use a database created with ENCODING 'UTF8'",
            sql.table
        ))),
    }
}

/// What a check statement (one row of one nullable text column) gives as
/// the reason a table cannot serve, or `None`.
pub(crate) async fn reason<'c, E, DB>(conn: E, check: &str) -> Result<Option<String>, StoreError>
where
    DB: sqlx::Database,
    E: sqlx::Executor<'c, Database = DB>,
    for<'r> (Option<String>,): sqlx::FromRow<'r, DB::Row>,
    DB::Arguments: sqlx::IntoArguments<DB>,
{
    let (why,): (Option<String>,) = sqlx::query_as(sqlx::AssertSqlSafe(check))
        .fetch_one(conn)
        .await
        .map_err(map_err)?;
    Ok(why)
}

/// Refuses a table whose schema cannot hold it (PostgreSQL): a schema
/// named that does not exist (`migrate()` makes tables, not schemas), no
/// schema of the search path that exists, or one PostgreSQL keeps for
/// itself (`information_schema`, `pg_...`, a session's `pg_temp_...`,
/// where a superuser's `migrate()` would write, or the records would go
/// with one connection) that the search path puts the table in.
pub(crate) async fn refuse_schema<'c, E, DB>(conn: E, sql: &super::Statements) -> Result<(), StoreError>
where
    DB: sqlx::Database,
    E: sqlx::Executor<'c, Database = DB>,
    for<'r> (Option<String>,): sqlx::FromRow<'r, DB::Row>,
    DB::Arguments: sqlx::IntoArguments<DB>,
{
    let Some(query) = &sql.schema_problem else {
        return Ok(());
    };
    match reason(conn, query).await? {
        None => Ok(()),
        Some(why) => Err(StoreError::backend(format!(
            "the table {} cannot be served: {why}; nothing was changed",
            sql.table
        ))),
    }
}

/// A table a newer build of idem migrated: this build refuses it, and its
/// `migrate()` cannot help.
pub(crate) fn newer_schema(table: &str, current: i64, latest: i64) -> StoreError {
    StoreError::backend(format!(
        "the table {table} is at schema version {current}, newer than this build of idem knows \
         ({latest}): upgrade idem"
    ))
}

/// Refuses a table that no reservation could be written to, by `check`
/// (its `has_unique_key` or `writes`): read where `checks_read`
/// (PostgreSQL: why not, or NULL), else run (SQLite: the database's own
/// error, with what the table needs). A store that did not answer stays
/// unavailable.
pub(crate) async fn refuse_unreservable<'c, E, DB>(
    conn: E,
    sql: &super::Statements,
    check: &str,
) -> Result<(), StoreError>
where
    DB: sqlx::Database,
    E: sqlx::Executor<'c, Database = DB>,
    for<'r> (Option<String>,): sqlx::FromRow<'r, DB::Row>,
    DB::Arguments: sqlx::IntoArguments<DB>,
{
    let why = if sql.checks_read {
        reason(conn, check).await?
    } else {
        match conn
            .execute(sqlx::raw_sql(sqlx::AssertSqlSafe(check)))
            .await
            .map_err(map_err)
        {
            Ok(_) => None,
            Err(StoreError::Backend { reason, .. }) => Some(format!(
                "{reason}; it needs a unique key on (tenant, scope, key), its primary key as migrate() makes \
                 it, and a database and role that may write it"
            )),
            Err(other) => return Err(other),
        }
    };
    match why {
        None => Ok(()),
        Some(why) => Err(StoreError::backend(format!(
            "the table {} cannot take a reservation: {why}",
            sql.table
        ))),
    }
}

/// Refuses a table with a column or a unique index that idem cannot use
/// safely (see `column_types` and `sqlite_column_types`), naming each.
pub(crate) async fn refuse_column_types<'c, E, DB>(conn: E, sql: &super::Statements) -> Result<(), StoreError>
where
    DB: sqlx::Database,
    E: sqlx::Executor<'c, Database = DB>,
    for<'r> (Option<String>,): sqlx::FromRow<'r, DB::Row>,
    DB::Arguments: sqlx::IntoArguments<DB>,
{
    match reason(conn, &sql.column_types).await? {
        None => Ok(()),
        Some(why) => Err(StoreError::backend(format!(
            "the table {} cannot serve as it is: {why}. Change that by hand: migrate() changes no \
             column's type and drops no index",
            sql.table
        ))),
    }
}

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
