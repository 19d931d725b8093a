//! Same-transaction completion: a handler's own writes and the completion
//! of its record commit together, or not at all.

#[cfg(any(feature = "postgres", feature = "sqlite"))]
use crate::sql::Deadline;
use crate::store::{RecordId, StoreError, StoredResponse};
#[cfg(any(feature = "postgres", feature = "sqlite"))]
use crate::IdempotencyStore;

/// A handler's open transaction, held until the runtime knows the outcome.
/// Boxed: an execution's future holds it (or room for it) at each step
/// that may be handed it, and that future is allocated on every first
/// request, which seldom has a transaction; a pointer keeps it small.
pub(crate) struct PendingTx(Box<Open>);

/// What [`PendingTx`] holds.
enum Open {
    /// With the store it was opened on, which also completes the record.
    #[cfg(feature = "postgres")]
    /// With idem's mark in it (see [`PgStands`]).
    Pg(
        sqlx::Transaction<'static, sqlx::Postgres>,
        crate::PgStore,
        crate::fingerprint::HexStr<32>,
    ),
    #[cfg(feature = "sqlite")]
    Sqlite(LiteTx, crate::SqliteStore),
}

/// A handler's SQLite transaction, dropped from the writers' runtime
/// however it ends (see [`crate::sql::sqlite::drop_on_writers`]): left
/// open when its execution's task goes with a runtime that shuts down,
/// cut halfway through its completion or rollback, or committed and done
/// with. sqlx's own drop (the rollback of what is open, and the
/// connection's way back to the pool) would be a task of the dropping
/// task's runtime, dropped if that runtime is shutting down, and then sqlx
/// closes the connection (losing a database in memory); or never run on a
/// current-thread runtime left idle (stalling a pool of one).
#[cfg(feature = "sqlite")]
pub(crate) struct LiteTx(Option<sqlx::Transaction<'static, sqlx::Sqlite>>);

#[cfg(feature = "sqlite")]
impl LiteTx {
    pub(crate) fn new(tx: sqlx::Transaction<'static, sqlx::Sqlite>) -> Self {
        LiteTx(Some(tx))
    }

    /// The transaction's connection (held until the transaction is
    /// dropped; an error, never a panic, otherwise).
    pub(crate) fn conn(&mut self) -> Result<&mut sqlx::SqliteConnection, StoreError> {
        match self.0.as_mut() {
            Some(tx) => Ok(&mut **tx),
            None => Err(StoreError::backend("the handler's transaction is gone")),
        }
    }

    /// How many levels sqlx counts open on the connection.
    fn depth(&self) -> usize {
        use sqlx_core::transaction::TransactionManager as _;
        type Manager = <sqlx::Sqlite as sqlx::Database>::TransactionManager;
        self.0.as_ref().map_or(0, |tx| Manager::get_transaction_depth(tx))
    }
}

#[cfg(feature = "sqlite")]
impl Drop for LiteTx {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            crate::sql::sqlite::drop_on_writers(tx);
        }
    }
}

/// The connection of a handler's transaction, borrowed from its
/// [`Operation`](crate::Operation): use `&mut *conn` as a sqlx executor.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub type TxConnection<'a, C> = tokio::sync::MappedMutexGuard<'a, C>;

#[cfg(feature = "postgres")]
impl PendingTx {
    pub(crate) async fn begin_pg(store: &dyn IdempotencyStore) -> Result<Self, StoreError> {
        let any: &dyn std::any::Any = store;
        let pg = any
            .downcast_ref::<crate::PgStore>()
            .ok_or_else(|| StoreError::backend("pg_transaction needs the layer's store to be a PgStore"))?;
        let (tx, mark) = pg.begin_tx().await?;
        Ok(PendingTx(Box::new(Open::Pg(tx, pg.clone(), mark))))
    }

    pub(crate) fn pg(&mut self) -> Option<&mut sqlx::PgConnection> {
        match &mut *self.0 {
            Open::Pg(tx, ..) => Some(&mut **tx),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }
}

/// Where a handler's PostgreSQL transaction stands, told by idem's mark
/// (`SET LOCAL idem.handler` to 128 random bits drawn for the transaction,
/// set with its `BEGIN`, and gone with the transaction). sqlx's own count
/// of the levels open cannot tell it: a begin of the handler's cut between
/// its statement and the answer makes
/// sqlx roll back the levels it counted before, often the whole transaction
/// (what the handler writes after that commits on its own), and at none
/// asks nothing while the server opens a transaction of its own; and a
/// handler may leave a nested transaction open (forgotten), which sqlx goes
/// on counting.
#[cfg(feature = "postgres")]
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum PgStands {
    /// The transaction idem began (what savepoints opened after the mark
    /// hold is the transaction's), or one whose mark the handler reset
    /// (`RESET ALL`) while sqlx counts idem's one level.
    Open,
    /// A transaction that a statement failed (PostgreSQL refuses all
    /// others until it rolls back, and it commits nothing), which sqlx
    /// counts as idem's one level: taken as idem's. (The mark cannot be
    /// read there; only a cut begin of the handler's followed by a nested
    /// transaction left open makes that count lie.)
    Failed,
    /// Not the transaction idem began: that one ended, and what the handler
    /// wrote after its end committed on its own (or is in another
    /// transaction, which idem rolls back).
    Ended,
}

/// Reads idem's mark to tell where the handler's transaction stands (see
/// [`PgStands`]).
#[cfg(feature = "postgres")]
async fn pg_stands(
    conn: &mut sqlx::PgConnection,
    mark: crate::fingerprint::HexStr<32>,
) -> Result<PgStands, StoreError> {
    match sqlx::query_scalar::<_, Option<String>>("SELECT pg_catalog.current_setting('idem.handler', true)")
        .fetch_one(&mut *conn)
        .await
    {
        Ok(Some(found)) if found == mark.as_str() => Ok(PgStands::Open),
        // Set once on this connection and now empty: reset by the
        // handler's `RESET ALL`, or gone with idem's transaction. Taken as
        // idem's while sqlx counts its one level, which with sqlx's own
        // begins, commits and rollbacks (cut ones included) it does only in
        // idem's transaction: only a nested transaction forgotten after a
        // cut begin, or the handler's own `COMMIT` or `ROLLBACK`, makes
        // that count lie.
        Ok(Some(found)) if found.is_empty() && pg_depth(conn) == 1 => Ok(PgStands::Open),
        Ok(_) => Ok(PgStands::Ended),
        // "current transaction is aborted".
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("25P02") => Ok(if pg_depth(conn) == 1 {
            PgStands::Failed
        } else {
            PgStands::Ended
        }),
        Err(e) => Err(crate::sql::map_err(e)),
    }
}

/// How many levels sqlx counts open on a PostgreSQL connection.
#[cfg(feature = "postgres")]
fn pg_depth(conn: &sqlx::PgConnection) -> usize {
    use sqlx_core::transaction::TransactionManager as _;
    <sqlx::Postgres as sqlx::Database>::TransactionManager::get_transaction_depth(conn)
}

/// Lets a handler's PostgreSQL transaction go without committing it, the
/// connection back to the pool outside any transaction. A `ROLLBACK` of
/// idem's first, in a task of its own, run to its end: it ends whatever
/// transaction the server has open, savepoints and all, however many levels
/// sqlx counts (none, when a cut begin of the handler's opened it unseen; or
/// more than one, a nested transaction the handler left open, where sqlx's
/// own rollback of a dropped transaction would end its last level only and
/// leave the rest open on a pooled connection). Then the transaction is
/// dropped: from one level, sqlx's `ROLLBACK` finds none to end (a warning);
/// from more, its `ROLLBACK TO SAVEPOINT` fails, and the pool closes the
/// connection.
///
/// A statement given up on before (the handler's, or idem's check cut by
/// its bound) may still have its answer to come: sqlx reads it before it
/// sends the next statement, and a failure there is returned as that
/// statement's own, which is then never sent. So the `ROLLBACK` is sent
/// again until it is answered itself (each try reads one such failure).
/// When it cannot be (the connection broken, or [`PG_LET_GO_TRIES`]
/// failures read), the session is ended by the server instead
/// (`pg_terminate_backend` of its own), and the pool's check closes the
/// connection.
#[cfg(feature = "postgres")]
fn pg_let_go(mut tx: sqlx::Transaction<'static, sqlx::Postgres>) {
    drop(tokio::spawn(tracing::Instrument::in_current_span(async move {
        let mut tries = 0;
        let rolled_back = loop {
            tries += 1;
            match sqlx::raw_sql("ROLLBACK").execute(&mut *tx).await {
                Ok(_) => break Ok(()),
                // An earlier statement's failure, read first.
                Err(sqlx::Error::Database(_)) if tries < PG_LET_GO_TRIES => {}
                Err(e) => break Err(crate::sql::map_err(e)),
            }
        };
        if rolled_back.is_err() {
            // Not known to be outside a transaction: ended by the server
            // with the session, not given back to the pool so.
            let _ = sqlx::raw_sql("SELECT pg_terminate_backend(pg_backend_pid())")
                .execute(&mut *tx)
                .await;
        }
        log_rollback(rolled_back);
        drop(tx);
    })));
}

/// How many answers [`pg_let_go`] reads before its own `ROLLBACK`'s, at
/// most: one per statement given up on, of which a handler leaves few.
#[cfg(feature = "postgres")]
const PG_LET_GO_TRIES: u32 = 64;

#[cfg(feature = "sqlite")]
impl PendingTx {
    pub(crate) async fn begin_sqlite(store: &dyn IdempotencyStore) -> Result<Self, StoreError> {
        let any: &dyn std::any::Any = store;
        let lite = any.downcast_ref::<crate::SqliteStore>().ok_or_else(|| {
            StoreError::backend("sqlite_transaction needs the layer's store to be a SqliteStore")
        })?;
        Ok(PendingTx(Box::new(Open::Sqlite(
            lite.begin_tx().await?,
            lite.clone(),
        ))))
    }

    pub(crate) fn sqlite(&mut self) -> Option<&mut sqlx::SqliteConnection> {
        match &mut *self.0 {
            Open::Sqlite(tx, _) => tx.conn().ok(),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }
}

/// Why a same-transaction completion failed.
#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
pub(crate) enum TxFailure {
    /// Nothing was committed: neither the handler's writes nor the completion.
    NotCommitted(StoreError),
    /// The handler's transaction had failed before the outcome (on
    /// PostgreSQL, one of its statements failed: it refuses every other
    /// until it rolls back, and commits nothing): the completion was not
    /// written, and the transaction is rolled back. None of its writes can
    /// be part of the answer; one that needs none (a rejection) may be
    /// recorded on its own.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    Failed,
    /// The commit itself failed: whether it took effect is unknown.
    Unknown(StoreError),
    /// The database refused the commit (PostgreSQL answered it with an
    /// error: a serialization failure, a deferred constraint, a deadlock;
    /// SQLite found a deferred foreign key broken): the transaction was
    /// rolled back, the handler's writes and the completion with it.
    #[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
    CommitRefused(StoreError),
    /// The handler's transaction had ended before the outcome (SQLite
    /// ended it by itself, see [`sqlite_transaction_lost`]; on PostgreSQL
    /// idem's mark was gone, see `PgStands`: a begin of the handler's given
    /// up on part-way ends it): the completion was not written, and of the
    /// handler's writes some may have been rolled back and some committed
    /// on their own.
    #[cfg_attr(not(any(feature = "sqlite", feature = "postgres")), allow(dead_code))]
    Lost,
    /// Whether the handler's transaction was still idem's could not be
    /// told (the check failed or timed out): the completion was not
    /// written, and what the handler wrote may or may not have committed.
    #[cfg_attr(not(any(feature = "sqlite", feature = "postgres")), allow(dead_code))]
    Unclear(StoreError),
}

impl TxFailure {
    /// A failed commit: [`CommitRefused`](TxFailure::CommitRefused) where
    /// the database `refused` it (and so rolled it back), else
    /// [`Unknown`](TxFailure::Unknown).
    #[cfg(any(feature = "postgres", feature = "sqlite"))]
    fn of_commit(e: StoreError, refused: bool) -> Self {
        match refused {
            true => TxFailure::CommitRefused(e),
            false => TxFailure::Unknown(e),
        }
    }
}

/// Whether SQLite ended the handler's transaction by itself. It does so on
/// some errors (a trigger's `RAISE(ROLLBACK)`, a constraint's `ON CONFLICT
/// ROLLBACK`, a full disk, an I/O error), after which each statement on the
/// connection commits on its own (or, after a savepoint of the handler's,
/// in a transaction that is not the handler's): the completion written
/// there would commit without the handler's writes. The transaction was
/// begun with a savepoint of idem's (`HANDLER_MARK`); releasing it
/// succeeds only in that transaction, and keeps it open.
#[cfg(feature = "sqlite")]
async fn sqlite_transaction_lost(conn: &mut sqlx::SqliteConnection) -> Result<bool, StoreError> {
    match sqlx::raw_sql("RELEASE SAVEPOINT idem_handler")
        .execute(&mut *conn)
        .await
    {
        Ok(_) => Ok(false),
        Err(sqlx::Error::Database(e)) if e.message().contains("no such savepoint") => Ok(true),
        Err(e) => Err(crate::sql::map_err(e)),
    }
}

/// Ends a handler's SQLite transaction that SQLite ended by itself, leaving
/// the connection as sqlx counts it: outside any transaction. Whatever
/// transaction is open now (one a savepoint of the handler's opened) is
/// rolled back; then what sqlx still counts (the transaction, and a
/// savepoint of the handler's whose rollback failed) is opened again with
/// sqlx's own statements and rolled back through sqlx, level by level, so
/// that the connection goes back to the pool neither inside a transaction
/// nor counted inside one. Waited for within what is left of `deadline`;
/// past it, it goes on in the background (see [`unwind_later`]) rather
/// than being cut short.
#[cfg(feature = "sqlite")]
async fn end_lost(tx: LiteTx, deadline: Deadline) {
    let _ = tokio::time::timeout(deadline.left(), unwind_later(tx)).await;
}

/// How long the unwinding of a connection left busy waits before a
/// warning says it still waits (it goes on waiting: see [`unwind_later`]).
#[cfg(all(feature = "sqlite", not(feature = "pause-points")))]
const UNWIND_SLOW: std::time::Duration = std::time::Duration::from_secs(60);
/// idem's own tests (built with pause points) hold an unwinding past its
/// warning: 3 seconds there, where a minute took a minute of every CI run.
/// Only when the warning is said changes: the unwinding waits on after it.
#[cfg(all(feature = "sqlite", feature = "pause-points"))]
const UNWIND_SLOW: std::time::Duration = std::time::Duration::from_secs(3);

/// [`end_lost`], in a task of its own and not bounded at all: for a
/// transaction whose check or completion did not answer in time (a
/// statement the handler abandoned still holds the connection, waiting on
/// another process's lock). Whether SQLite had ended the transaction or
/// not, it is rolled back, and the connection goes back to the pool once
/// it is as sqlx counts it. The returned handle tells when; dropping it
/// leaves the task running.
///
/// Not bounded, because the unwinding cannot be cut without harm: its
/// statements wait behind the abandoned one in sqlx's worker, and cut
/// there, the transaction's drop asks for one rollback, which comes after
/// the unwinding's own `ROLLBACK` has ended SQLite's transaction, and
/// fails: the connection would go back counted inside a transaction (every
/// `BEGIN` on it failing, and every write on it after the application's
/// next dropped transaction never committed). Nor would a bound gain
/// anything: until the abandoned statement ends, the connection serves no
/// one.
#[cfg(feature = "sqlite")]
fn unwind_later(tx: LiteTx) -> tokio::task::JoinHandle<()> {
    let unwinding = async move {
        let mut unwinding = std::pin::pin!(unwind(tx));
        let unwound = match tokio::time::timeout(UNWIND_SLOW, &mut unwinding).await {
            Ok(unwound) => unwound,
            Err(_) => {
                tracing::warn!(
                    waited = ?UNWIND_SLOW,
                    "a SQLite connection is still busy with a statement its handler gave up on; \
                     it goes back to the pool once that ends and the handler's transaction is rolled back"
                );
                unwinding.await
            }
        };
        log_rollback(unwound);
    };
    // On the writers' runtime: the caller's may be shutting down, and the
    // connection, dropped with a task of its, would be closed (losing a
    // database in memory).
    crate::sql::sqlite::spawn_on_writers(tracing::Instrument::in_current_span(unwinding))
}

/// Rolls back whatever transaction is open on `tx`'s connection, then opens
/// again what sqlx still counts (with sqlx's own statements) and rolls it
/// back through sqlx, level by level: the connection ends neither inside a
/// transaction nor counted inside one. Not to be cut part-way (see
/// [`unwind_later`]).
#[cfg(feature = "sqlite")]
async fn unwind(mut tx: LiteTx) -> Result<(), StoreError> {
    use sqlx_core::transaction::TransactionManager as _;
    type Manager = <sqlx::Sqlite as sqlx::Database>::TransactionManager;
    let depth = crate::sql::sqlite::reopen_counted(tx.conn()?).await?;
    for _ in 1..depth {
        crate::sql::sqlite::rollback_level(tx.conn()?).await?;
    }
    Manager::rollback(tx.conn()?).await.map_err(crate::sql::map_err)
}

impl PendingTx {
    /// Writes the completion inside the transaction, then commits both.
    /// If the lock was lost, nothing commits.
    pub(crate) async fn complete(
        self,
        id: &RecordId,
        token: &str,
        response: &StoredResponse,
    ) -> Result<(), TxFailure> {
        #[cfg(not(any(feature = "postgres", feature = "sqlite")))]
        let _ = (id, token, response);
        match *self.0 {
            #[cfg(feature = "postgres")]
            Open::Pg(tx, pg, mark) => complete_pg(tx, pg, mark, id, token, response).await,
            // Committed, and its connection given back, on a runtime that
            // stays driven (see `OnWriters`).
            #[cfg(feature = "sqlite")]
            Open::Sqlite(tx, lite) => {
                crate::sql::sqlite::OnWriters::new(complete_sqlite(tx, lite, id, token, response)).await
            }
        }
    }

    /// Rolls the handler's writes back, within the store's timeout (past
    /// it the connection is dropped, which rolls back all the same). False
    /// when they could not all be: the transaction had ended before (SQLite
    /// ended it by itself, see [`sqlite_transaction_lost`]; or on
    /// PostgreSQL, see `PgStands`), and what the handler wrote after that
    /// committed on its own, or whether it had cannot be told.
    pub(crate) async fn rollback(self) -> bool {
        match *self.0 {
            #[cfg(feature = "postgres")]
            Open::Pg(tx, pg, mark) => rollback_pg(tx, pg, mark).await,
            // Rolled back, and its connection given back, on a runtime that
            // stays driven (see `OnWriters`).
            #[cfg(feature = "sqlite")]
            Open::Sqlite(tx, lite) => crate::sql::sqlite::OnWriters::new(rollback_sqlite(tx, lite)).await,
        }
    }
}

/// [`PendingTx::complete`] on PostgreSQL.
#[cfg(feature = "postgres")]
async fn complete_pg(
    mut tx: sqlx::Transaction<'static, sqlx::Postgres>,
    pg: crate::PgStore,
    mark: crate::fingerprint::HexStr<32>,
    id: &RecordId,
    token: &str,
    response: &StoredResponse,
) -> Result<(), TxFailure> {
    // The check, the completion and the commit within one store timeout:
    // past it before the commit, the completion did not happen; during the
    // commit, it may have.
    let deadline = Deadline::start(pg.timeout());
    match deadline.bound(pg_stands(&mut tx, mark)).await {
        Ok(PgStands::Open) => {}
        Ok(PgStands::Failed) => {
            pg_let_go(tx);
            return Err(TxFailure::Failed);
        }
        Ok(PgStands::Ended) => {
            pg_let_go(tx);
            return Err(TxFailure::Lost);
        }
        Err(e) => {
            pg_let_go(tx);
            return Err(TxFailure::Unclear(e));
        }
    }
    // Before the completion is sent: its conflicts are no longer answered
    // from memory.
    pg.finish_running(id, token);
    if let Err(e) = deadline
        .bound(pg.complete_in_handlers_tx(&mut tx, id, token, response))
        .await
    {
        pg_let_go(tx);
        return Err(TxFailure::NotCommitted(e));
    }
    pause_point!(crate::pause::TX_BEFORE_COMMIT, &id.key);
    // A commit due once the timeout has passed is not sent: nothing
    // commits.
    if let Some(e) = deadline.passed() {
        pg_let_go(tx);
        return Err(TxFailure::NotCommitted(e));
    }
    if pg_depth(&tx) == 1 {
        return deadline
            .bound(async { Ok(tx.commit().await.map_err(pg_commit_failed)) })
            .await
            .unwrap_or_else(|e| Err(TxFailure::Unknown(e)));
    }
    // sqlx counts other than the one level of idem's transaction (a nested
    // transaction the handler left open, or a count a cut begin moved): its
    // commit would release a savepoint, or send nothing. `COMMIT` ends the
    // transaction whatever its savepoints; the levels sqlx still counts are
    // let go after it (see `pg_let_go`).
    let committed = deadline
        .bound(async {
            Ok(sqlx::raw_sql("COMMIT")
                .execute(&mut *tx)
                .await
                .map(drop)
                .map_err(pg_commit_failed))
        })
        .await
        .unwrap_or_else(|e| Err(TxFailure::Unknown(e)));
    pg_let_go(tx);
    committed
}

/// How a `COMMIT` that failed with `e` left the transaction: refused
/// ([`TxFailure::CommitRefused`]) where PostgreSQL answered it with an
/// error of severity `ERROR`, which rolls the transaction back (none is
/// raised once a commit is recorded); unknown otherwise (a lost
/// connection, or a `FATAL` error, which ends the session, possibly after
/// the commit).
#[cfg(feature = "postgres")]
fn pg_commit_failed(e: sqlx::Error) -> TxFailure {
    let refused = e
        .as_database_error()
        .and_then(|d| d.try_downcast_ref::<sqlx::postgres::PgDatabaseError>())
        .is_some_and(|d| d.severity() == sqlx::postgres::PgSeverity::Error);
    TxFailure::of_commit(crate::sql::map_err(e), refused)
}

/// [`PendingTx::rollback`] on PostgreSQL, after reading idem's mark (see
/// [`PgStands`]): false when the transaction was no longer idem's.
#[cfg(feature = "postgres")]
async fn rollback_pg(
    mut tx: sqlx::Transaction<'static, sqlx::Postgres>,
    pg: crate::PgStore,
    mark: crate::fingerprint::HexStr<32>,
) -> bool {
    let deadline = Deadline::start(pg.timeout());
    let stands = match deadline.bound(pg_stands(&mut tx, mark)).await {
        Ok(stands) => stands,
        // Not told: idem's if sqlx counts its one level, as before the mark.
        Err(e) if pg_depth(&tx) == 1 => {
            tracing::warn!(error = %e, "cannot read the handler's transaction's mark; rolling it back");
            PgStands::Failed
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot tell whether the handler's transaction is still idem's");
            PgStands::Ended
        }
    };
    if stands != PgStands::Ended && pg_depth(&tx) == 1 {
        log_rollback(
            deadline
                .bound(async { tx.rollback().await.map_err(crate::sql::map_err) })
                .await,
        );
    } else {
        pg_let_go(tx);
    }
    stands != PgStands::Ended
}

/// [`PendingTx::rollback`] on SQLite.
#[cfg(feature = "sqlite")]
async fn rollback_sqlite(mut tx: LiteTx, lite: crate::SqliteStore) -> bool {
    // The check and the rollback within one store timeout.
    let deadline = Deadline::start(lite.timeout());
    let lost = deadline
        .bound(async { sqlite_transaction_lost(tx.conn()?).await })
        .await;
    if let Err(e) = &lost {
        tracing::warn!(error = %e, "cannot tell whether SQLite ended the handler's transaction");
    }
    use sqlx_core::transaction::TransactionManager as _;
    type Manager = <sqlx::Sqlite as sqlx::Database>::TransactionManager;
    if lost == Ok(true) {
        end_lost(tx, deadline).await;
    } else if lost.is_err() {
        drop(unwind_later(tx));
    } else if tx.depth() > 1 {
        // A nested transaction the handler left open lost its savepoints
        // with idem's mark, released by the check: sqlx's rollback of its
        // level would name one that is gone, fail, and leave the whole
        // transaction open on a pooled connection (the application's next
        // commit there would commit nothing). Unwound level by level.
        end_lost(tx, deadline).await;
    } else {
        // Through sqlx's transaction manager, on the connection, as the
        // commit is: the transaction is then dropped from the writers'
        // runtime (see `LiteTx`), and one cut here asks for its rollback
        // there, which sqlx's worker skips if this one got through.
        log_rollback(
            deadline
                .bound(async { Manager::rollback(tx.conn()?).await.map_err(crate::sql::map_err) })
                .await,
        );
    }
    lost == Ok(false)
}

#[cfg(any(feature = "postgres", feature = "sqlite"))]
fn log_rollback(result: Result<(), StoreError>) {
    if let Err(e) = result {
        tracing::warn!(error = %e, "the rollback of the handler's transaction failed");
    }
}

/// [`PendingTx::complete`] on SQLite.
#[cfg(feature = "sqlite")]
async fn complete_sqlite(
    mut tx: LiteTx,
    lite: crate::SqliteStore,
    id: &RecordId,
    token: &str,
    response: &StoredResponse,
) -> Result<(), TxFailure> {
    // The check, the completion and the commit within one store timeout.
    let deadline = Deadline::start(lite.timeout());
    match deadline
        .bound(async { sqlite_transaction_lost(tx.conn()?).await })
        .await
    {
        Ok(false) => {}
        Ok(true) => {
            end_lost(tx, deadline).await;
            return Err(TxFailure::Lost);
        }
        // Whether SQLite had ended it is not known: what the
        // handler wrote after such an end may have committed.
        Err(e) => {
            drop(unwind_later(tx));
            return Err(TxFailure::Unclear(e));
        }
    }
    if let Err(e) = deadline
        .bound(async { lite.complete_with(tx.conn()?, id, token, response).await })
        .await
    {
        drop(unwind_later(tx));
        return Err(TxFailure::NotCommitted(e));
    }
    pause_point!(crate::pause::TX_BEFORE_COMMIT, &id.key);
    // A commit due once the timeout has passed is not sent: nothing
    // commits.
    if let Some(e) = deadline.passed() {
        drop(unwind_later(tx));
        return Err(TxFailure::NotCommitted(e));
    }
    // Committed through sqlx's transaction manager, on the
    // connection, so that the transaction stays in hand when the
    // commit fails: SQLite may then have rolled it back by itself
    // while sqlx still counts it, and the connection must not go
    // back to the pool so (every `BEGIN` on it would fail). Once
    // committed, sqlx counts none: dropping the transaction then
    // rolls nothing back.
    //
    // The commit runs to its end in a task of its own, and the caller
    // waits for it within what is left of the timeout: a commit cut in
    // flight still commits in sqlx's worker, which then skips the next
    // rollback that a dropped transaction asks of the connection, and the
    // unwinding never asks that way; the application's next dropped
    // transaction on the connection would stay open, and every write
    // after it (completions included) would be lost with it.
    //
    // A nested transaction the handler left open (sqlx counts more than
    // idem's level) lost its savepoints with idem's mark, released above:
    // they are opened again, empty, with sqlx's own names, so that sqlx's
    // commits, level by level, release them and then commit the whole, as
    // PostgreSQL's `COMMIT` commits a transaction whatever its savepoints.
    use sqlx_core::transaction::TransactionManager as _;
    type Manager = <sqlx::Sqlite as sqlx::Database>::TransactionManager;
    // A task that finishes on the writers' runtime if its own shuts down
    // (see `Finishing`): cut there, the commit would still commit in sqlx's
    // worker, and the connection, given back from a runtime shutting down,
    // would be closed (losing a database in memory).
    let commit = tokio::spawn(crate::sql::sqlite::Finishing::new(async move {
        let committed = async {
            let unknown = |e| TxFailure::Unknown(crate::sql::map_err(e));
            let depth = tx.depth();
            let conn = tx.conn().map_err(TxFailure::Unknown)?;
            for level in 1..depth {
                sqlx::raw_sql(sqlx_core::transaction::begin_ansi_transaction_sql(level))
                    .execute(&mut *conn)
                    .await
                    .map_err(unknown)?;
            }
            for _ in 1..depth {
                Manager::commit(&mut *conn).await.map_err(unknown)?;
            }
            // A deferred foreign key broken at the commit fails it, and
            // SQLite keeps the transaction open: it is rolled back below.
            Manager::commit(conn).await.map_err(|e| {
                let refused = e
                    .as_database_error()
                    .is_some_and(|d| d.kind() == sqlx::error::ErrorKind::ForeignKeyViolation);
                TxFailure::of_commit(crate::sql::map_err(e), refused)
            })
        }
        .await;
        if committed.is_err() {
            drop(unwind_later(tx));
        }
        committed
    }));
    deadline
        .bound(async {
            Ok(commit.await.unwrap_or_else(|e| {
                Err(TxFailure::Unknown(StoreError::unavailable(format!(
                    "the commit's task ended: {e}"
                ))))
            }))
        })
        .await
        .unwrap_or_else(|e| Err(TxFailure::Unknown(e)))
}

#[cfg(test)]
mod tests {
    use super::PendingTx;

    /// An execution's future keeps room for a transaction at every step
    /// that may be handed one: a pointer's worth, not a connection's.
    #[test]
    fn a_pending_transaction_takes_a_pointer() {
        assert_eq!(
            std::mem::size_of::<Option<PendingTx>>(),
            std::mem::size_of::<usize>()
        );
    }
}
