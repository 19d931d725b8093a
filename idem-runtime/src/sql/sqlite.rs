//! The embedded default store: SQLite in WAL mode through sqlx.

use crate::sql::millis;
use crate::sql::{self, Statements};
use crate::store::{deadline_after, random_token_inline, BoxFuture};
use crate::store::{IdempotencyStore, Reservation, ReserveRequest, StoreError};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};
use std::str::FromStr;
use std::time::Duration;

/// The migrations of the records table, in order, with `{table}` and
/// `{index}` standing for the configured names. [`SqliteStore::migrate`]
/// applies those not yet applied.
pub const SQLITE_MIGRATIONS: &[sql::Migration] = sql::migrations!("sqlite");

/// How long a connection waits for another writer before giving up.
pub const DEFAULT_BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// Idempotency records in one SQLite file: the embedded default.
///
/// The file is opened in WAL mode with a busy timeout, so several tasks and
/// several processes on one machine can share it. A reservation first reads
/// the record: a replay, a mismatch or a live lock is answered from that
/// read, without the write lock. Otherwise it runs in a `BEGIN IMMEDIATE`
/// transaction, where SQLite's write lock makes the upsert (which checks
/// again) and the read of a blocking row one atomic step. Expiry and lock deadlines
/// use SQLite's clock, which is the machine's.
///
/// Writers queue. SQLite has one write lock per file, and a writer that
/// finds it taken sleeps in SQLite's busy handler, which is unfair: under
/// load a few writers wait far longer than the rest. So within the process
/// this store's writes (a reservation's `BEGIN IMMEDIATE` transaction, from
/// `BEGIN` to `COMMIT`; the completion, release, rejection, checkpoint, lock
/// extension and purge; [`migrate`](Self::migrate)) first wait their turn,
/// first come first served, for one write permit shared by all clones of
/// the store (and kept by [`with_table`](Self::with_table)), and so rarely
/// meet the lock taken. Reads never wait for it. The wait counts against
/// the operation's timeout: past it the operation fails with
/// [`StoreError::Unavailable`]. A handler's own transaction (which holds
/// SQLite's lock while the handler runs) waits in the same line to *begin*
/// and gives the permit back as soon as it has begun; the completion written
/// inside it takes no permit. Writers of other processes on the file, the
/// application's own writes on [`pool`](Self::pool), and a store made
/// separately on the same file are not in the line: they and this store
/// still wait for each other in SQLite's busy handler, up to the busy
/// timeout.
///
/// Reservations and completions commit in groups. Those that queue while
/// the write lock is held are written, when it is free, in one transaction
/// with one sync of the log (with `synchronous = FULL`, one commit's sync
/// is what bounds a first request's throughput). Nothing is answered
/// before that transaction's commit, and a write rolled back is never
/// answered as done. A write whose statement fails ends its group's
/// transaction there; the writes after it go on in another.
///
/// A database file deleted or replaced while the store has it open is
/// noticed at the next reservation (a `stat` of its path before the read,
/// and again after a write that took a key): from then on every reservation
/// fails with [`StoreError::Unavailable`] (503), since SQLite in WAL mode
/// would write on to a file no process started afterwards reads.
///
/// From a current-thread runtime, which may no longer be driven once its
/// caller has an answer or has given up (between two `block_on`s), the
/// writes in the permit's line run on a thread of idem's own (one for the
/// process), and what a reservation given up on leaves behind is undone
/// there: a write waiting on such a runtime would keep the permit, or a
/// lock taken for nobody would stay.
///
/// ```
/// use idem::SqliteStore;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idem::StoreError> {
/// let dir = tempfile::tempdir().unwrap();
/// let store = SqliteStore::open(dir.path().join("idem.db")).await?;
/// store.migrate().await?;
/// # Ok(()) }
/// ```
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
#[derive(Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
    sql: std::sync::Arc<Statements>,
    timeout: Duration,
    /// One permit, taken by each write of this store and its clones in turn
    /// (tokio's semaphore queues its waiters first come first served).
    writer: std::sync::Arc<tokio::sync::Semaphore>,
    /// Reservations' and completions' writes waiting for the next group
    /// commit, shared like `writer`.
    group: std::sync::Arc<Group>,
    /// Whether the database file is still the one at its path, shared
    /// like `writer`.
    file: std::sync::Arc<sql::sqlite_file::FileWatch>,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl SqliteStore {
    /// Opens (creating if needed) the database file at `path`, in WAL mode
    /// with a 5 second busy timeout. A relative path is made absolute now,
    /// against the current directory (unless that directory's name is not
    /// UTF-8, which SQLite cannot be given): every connection the pool
    /// opens later opens that file, wherever the process has moved since.
    /// `:memory:`, which SQLite opens in memory, gets
    /// [`SqliteStore::in_memory`]'s one connection; a path that is a URI
    /// file name (`file:...`) is refused (see [`SqliteStore::open_url`]).
    ///
    /// # Errors
    ///
    /// [`StoreError::Unavailable`] when the file cannot be opened or created;
    /// [`StoreError::Backend`] for a URI file name.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let err = idem::SqliteStore::open("/nonexistent-dir/x/idem.db").await.unwrap_err();
    /// assert!(err.is_unavailable());
    /// # }
    /// ```
    pub async fn open(path: impl AsRef<std::path::Path>) -> Result<Self, StoreError> {
        let memory = filename_kind(&path.as_ref().to_string_lossy())? == FilenameKind::Memory;
        let options = SqliteConnectOptions::new().filename(path).create_if_missing(true);
        if memory {
            return Self::open_in_memory(options).await;
        }
        Self::open_with(options).await
    }

    /// Opens a `sqlite://` URL, such as `sqlite://payments.db`, read as
    /// sqlx reads it (percent escapes decoded, the last of a parameter
    /// counting; `mode` may be given once). A database in memory (`sqlite::memory:`, `mode=memory`,
    /// or a name that SQLite reads as `:memory:`) gets the pool that
    /// [`SqliteStore::in_memory`] makes: one connection, kept open (several
    /// would lock whole tables without waiting, and answer concurrent
    /// requests 503 where they should get 409). For that reason a file's
    /// URL asking for a shared cache (`cache=shared`) is refused, and so is
    /// a file name that is itself a URI (`file:...`), whose own parameters
    /// could ask for one unseen, and a VFS that takes no file locks
    /// (`vfs=unix-none`), under which two connections could each take one
    /// key.
    ///
    /// # Errors
    ///
    /// [`StoreError::Backend`] for a URL that does not parse or does not
    /// start with `sqlite:`, gives `mode` twice, asks a file for a shared
    /// cache or a VFS without locks, or names a URI file name;
    /// [`StoreError::Unavailable`] when the file cannot be opened.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let dir = tempfile::tempdir().unwrap();
    /// let url = format!("sqlite://{}", dir.path().join("idem.db").display());
    /// let store = idem::SqliteStore::open_url(&url).await.unwrap();
    /// let memory = idem::SqliteStore::open_url("sqlite::memory:").await.unwrap();
    /// assert_eq!(memory.pool().options().get_max_connections(), 1);
    /// let shared = idem::SqliteStore::open_url(&format!("{url}?cache=shared")).await;
    /// assert!(shared.unwrap_err().to_string().contains("cache=shared"));
    /// # }
    /// ```
    pub async fn open_url(url: &str) -> Result<Self, StoreError> {
        // sqlx trims only `sqlite:` and reads anything else as a file's
        // name: a `postgres://` URL would be a file that cannot be opened
        // (the store down, 503) or one made in the working directory.
        if !url.starts_with("sqlite:") {
            return Err(StoreError::backend(format!(
                "invalid SQLite URL: it must start with sqlite: (such as sqlite://payments.db){}",
                if url.contains("://") {
                    "; a URL of another scheme is another store's (postgres:// is PgStore::connect's)"
                } else {
                    ""
                }
            )));
        }
        let options = SqliteConnectOptions::from_str(url)
            .map_err(|e| StoreError::backend(format!("invalid SQLite URL: {e}")))?
            .create_if_missing(true);
        // Read as sqlx reads it: the scheme trimmed, the database up to the
        // first `?` (in memory when it is `:memory:` as written), and each
        // parameter decoded, the last of a name counting.
        let rest = url.trim_start_matches("sqlite://").trim_start_matches("sqlite:");
        let (database, params) = rest.split_once('?').unwrap_or((rest, ""));
        let mut in_memory = database == ":memory:";
        let mut shared_cache = in_memory;
        let mut vfs = None;
        let mut modes = 0;
        for (name, value) in form_urlencoded::parse(params.as_bytes()) {
            // sqlx keeps a database in memory once any `mode=memory` asked
            // for one, whatever a later `mode` says: a second `mode` would
            // not mean what it reads as.
            if name == "mode" {
                modes += 1;
                if modes > 1 {
                    return Err(StoreError::backend(
                        "invalid SQLite URL: mode is given more than once; give it once",
                    ));
                }
            }
            match (&*name, &*value) {
                ("mode", "memory") => (in_memory, shared_cache) = (true, true),
                ("vfs", _) => vfs = Some(value),
                ("cache", "shared") => shared_cache = true,
                ("cache", "private") => shared_cache = false,
                _ => {}
            }
        }
        match vfs.as_deref() {
            // SQLite's VFS of databases in memory: one per connection
            // under most names.
            Some("memdb") => in_memory = true,
            // A VFS that locks nothing (`unix-none`, `win32-none`): two
            // connections, or two processes, would each take one key.
            Some(none) if none.ends_with("-none") => {
                return Err(StoreError::backend(format!(
                    "invalid SQLite URL: vfs={none} is refused: it takes no file locks, so two connections or \
                     processes could each reserve one key; open the file without it"
                )));
            }
            _ => {}
        }
        // What SQLite then makes of the decoded name (sqlx names its own
        // database for `:memory:`).
        if database != ":memory:"
            && filename_kind(&options.get_filename().to_string_lossy())? == FilenameKind::Memory
        {
            in_memory = true;
        }
        if in_memory {
            return Self::open_in_memory(options).await;
        }
        if shared_cache {
            return Err(StoreError::backend(
                "invalid SQLite URL: cache=shared on a file is refused: connections that share a cache \
                 lock whole tables and never wait, so concurrent requests would get 503 where they should \
                 get 409; open the file without it",
            ));
        }
        Self::open_with(options).await
    }

    /// A store on a database in memory, migrated: for tests and
    /// development, its records gone with the process. One connection,
    /// kept open for the store's whole life: the database lives only as
    /// long as a connection to it does, and a pool with sqlx's defaults
    /// closes its idle connections after 10 minutes, and every connection
    /// after 30, each time losing every record (see [`SqliteStore::new`]);
    /// nor does the pool ping the connection before handing it over (sqlx's
    /// `test_before_acquire`), so that an application's own query on
    /// [`SqliteStore::pool`] given up on during that ping (its timeout)
    /// does not have sqlx close it.
    ///
    /// # Errors
    ///
    /// [`StoreError::Unavailable`] when SQLite cannot open the database.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let store = idem::SqliteStore::in_memory().await.unwrap();
    /// assert_eq!(store.pool().options().get_idle_timeout(), None);
    /// # }
    /// ```
    pub async fn in_memory() -> Result<Self, StoreError> {
        let pool = in_memory_pool()
            .connect("sqlite::memory:")
            .await
            .map_err(|e| StoreError::unavailable(e.to_string()))?;
        let store = Self::new(pool);
        store.migrate().await?;
        Ok(store)
    }

    /// A store on the database in memory `options` name, on the pool
    /// that [`SqliteStore::in_memory`] makes.
    async fn open_in_memory(options: SqliteConnectOptions) -> Result<Self, StoreError> {
        in_memory_pool()
            .connect_with(options)
            .await
            .map(Self::new)
            .map_err(|e| StoreError::unavailable(e.to_string()))
    }

    async fn open_with(options: SqliteConnectOptions) -> Result<Self, StoreError> {
        // Made absolute once: the pool opens each new connection by this
        // name, and one relative to a directory the process has since
        // moved to would open (and create) another database.
        // (SQLite takes only names in UTF-8: one whose directory is not
        // stays relative.)
        let options = match std::path::absolute(options.get_filename()) {
            Ok(absolute) if absolute.to_str().is_some() => options.filename(absolute),
            _ => options,
        };
        let options = options
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(DEFAULT_BUSY_TIMEOUT)
            .foreign_keys(true);
        // The switch to WAL takes the file's exclusive lock without
        // SQLite's busy handler: beside another process opening or reading
        // the file it fails at once, so it is tried again within the busy
        // timeout, as every other wait for the file is.
        let deadline = tokio::time::Instant::now() + DEFAULT_BUSY_TIMEOUT;
        let mut pause = Duration::from_millis(5);
        loop {
            match SqlitePoolOptions::new()
                .max_connections(8)
                .acquire_timeout(DEFAULT_BUSY_TIMEOUT)
                .connect_with(options.clone())
                .await
            {
                Ok(pool) => {
                    let store = Self::new(pool);
                    // The file as opened, learnt now: one deleted or
                    // replaced before the first request is noticed too.
                    let name = sqlx::query_scalar::<_, String>(sql::sqlite_file::MAIN_FILE)
                        .fetch_one(&store.pool)
                        .await;
                    if let Ok(name) = name {
                        store.file.learn(&name);
                    }
                    return Ok(store);
                }
                Err(sqlx::Error::Database(db))
                    if sql::sqlite_busy_or_locked(&*db) && tokio::time::Instant::now() + pause < deadline =>
                {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(100));
                }
                Err(e) => return Err(StoreError::unavailable(e.to_string())),
            }
        }
    }

    /// A store over an existing pool (which should use WAL mode and a busy
    /// timeout), on the table `idempotency_keys`.
    ///
    /// An in-memory database must be a pool of one connection: connections
    /// that share one lock whole tables and never wait, so concurrent
    /// requests would get 503 where they should get 409. And that
    /// connection must never be closed, which loses the database: set
    /// `idle_timeout(None)` and `max_lifetime(None)` on the pool (sqlx's
    /// defaults close an idle connection after 10 minutes, and every
    /// connection after 30), and `test_before_acquire(false)` (a query of
    /// the application's given up on during that ping has sqlx close the
    /// connection), or use [`SqliteStore::in_memory`], which does.
    ///
    /// The store's reservations and completions take an idle connection as
    /// it is, without the pool's checks before a hand-over
    /// (`test_before_acquire`, `before_acquire`): an `await` there could be
    /// cut by a caller's timeout or a runtime shutting down, and sqlx then
    /// closes the connection (losing a database in memory). Per-connection settings
    /// belong in `after_connect`, which every connection runs. The other
    /// writes (a release, a rejection, a lock extension, a checkpoint, the
    /// janitor's batches, the `BEGIN` of a handler's transaction) take
    /// their connection through the pool, checks and all, on a thread of
    /// idem's, one for the process's SQLite stores, which is always driven:
    /// the pool's hooks then run there, and a hook that blocks its thread
    /// (rather than awaiting) holds up those writes, and the group writes of
    /// callers on current-thread runtimes, of every SQLite store of the
    /// process.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let pool = sqlx::sqlite::SqlitePoolOptions::new()
    ///     .max_connections(1)
    ///     .idle_timeout(None)
    ///     .max_lifetime(None)
    ///     .test_before_acquire(false)
    ///     .connect("sqlite::memory:")
    ///     .await
    ///     .unwrap();
    /// let store = idem::SqliteStore::new(pool);
    /// # }
    /// ```
    pub fn new(pool: SqlitePool) -> Self {
        Self::build(pool, sql::DEFAULT_TABLE).unwrap_or_else(|_| unreachable!("default names are valid"))
    }

    /// Uses another table name. SQLite compares names without regard to
    /// the case of ASCII letters, quoted or not: `Keys` and `keys` are one
    /// table, whose records two stores so named share (on PostgreSQL,
    /// which idem's quoting keeps case-sensitive, they are two).
    ///
    /// # Errors
    ///
    /// [`StoreError::Backend`] for a name that is not a plain identifier,
    /// or one SQLite keeps for itself (beginning with `sqlite_`, in any case).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// # let pool = sqlx::sqlite::SqlitePoolOptions::new().max_connections(1).connect("sqlite::memory:").await.unwrap();
    /// let store = idem::SqliteStore::new(pool).with_table("idem_records").unwrap();
    /// # }
    /// ```
    pub fn with_table(self, table: &str) -> Result<Self, StoreError> {
        let (timeout, writer, group, file) = (self.timeout, self.writer, self.group, self.file);
        Self::build(self.pool, table).map(|s| SqliteStore {
            timeout,
            writer,
            group,
            file,
            ..s
        })
    }

    /// Bounds every operation by `timeout` (default: the busy timeout plus
    /// one second); past it the operation fails with
    /// [`StoreError::Unavailable`]. `Duration::MAX` bounds nothing. The wait
    /// for a connection is bounded by the pool too: a pool
    /// [`SqliteStore::open`] builds gives up after the 5 second busy
    /// timeout (build your own pool for a longer one). A `timeout` too short
    /// for a write (zero, or a millisecond) fails every request with 503.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// # let pool = sqlx::sqlite::SqlitePoolOptions::new().max_connections(1).connect("sqlite::memory:").await.unwrap();
    /// let store = idem::SqliteStore::new(pool).with_timeout(std::time::Duration::from_secs(1));
    /// # }
    /// ```
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The pool, for the application's own queries.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    fn build(pool: SqlitePool, table: &str) -> Result<Self, StoreError> {
        let file = sql::sqlite_file::FileWatch::of(pool.connect_options().get_filename());
        Ok(SqliteStore {
            pool,
            sql: std::sync::Arc::new(Statements::new(sql::SQLITE, SQLITE_MIGRATIONS, None, table)?),
            timeout: DEFAULT_BUSY_TIMEOUT + Duration::from_secs(1),
            writer: std::sync::Arc::new(tokio::sync::Semaphore::new(1)),
            group: std::sync::Arc::default(),
            file: std::sync::Arc::new(file),
        })
    }

    /// Waits in line for this process's turn at SQLite's write lock. Every
    /// caller bounds the wait by the store's timeout; a waiter given up on
    /// leaves the line without taking the permit.
    async fn write_turn(&self) -> Result<tokio::sync::SemaphorePermit<'_>, StoreError> {
        self.writer
            .acquire()
            .await
            .map_err(|_| StoreError::unavailable("the SQLite write queue is closed"))
    }

    /// Runs `write` in this process's turn at the write lock, on the
    /// writers' runtime, and waits for its answer within the store's
    /// timeout. A write whose caller gave up while it waited in line is
    /// not made; one under way runs to its end (every such write is fenced
    /// by its token, or is the store's own). For the writes outside the
    /// groups (a release, a rejection, a hand-back, a lock extension, a
    /// checkpoint, the janitor's batches, a handler's `BEGIN`), which take
    /// their connection from the pool through sqlx: sqlx's acquisition (its
    /// checks) and its give-back of the connection are then tasks of a
    /// runtime that is always driven, and nothing cuts them halfway. Run
    /// from the caller's task, a runtime shutting down dropped them, or the
    /// store's timeout cut the pool's check of the connection, and sqlx
    /// closed the connection (losing a database in memory); from a
    /// current-thread runtime left idle, the give-back never ran. A hop
    /// costs these writes a wake-up of the writers' thread; the writes of a
    /// first request (grouped) make none from a multi-thread runtime.
    async fn queued<T, F, W>(&self, write: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(SqliteStore) -> W + Send + 'static,
        W: std::future::Future<Output = Result<T, StoreError>> + Send + 'static,
    {
        let store = self.clone();
        let (answer, answered) = tokio::sync::oneshot::channel();
        let writing = async move {
            let turn = store.write_turn().await;
            // Given up on in line: nothing was written, and nothing is.
            if answer.is_closed() {
                return;
            }
            let written = match turn {
                Ok(_turn) => write(store.clone()).await,
                Err(e) => Err(e),
            };
            let _ = answer.send(written);
        };
        drop(spawn_on_writers(tracing::Instrument::in_current_span(writing)));
        sql::bounded(self.timeout, async {
            answered
                .await
                .unwrap_or_else(|_| Err(StoreError::backend("a SQLite write did not finish")))
        })
        .await
    }

    /// Brings the table to the schema this build needs: applies, under the
    /// write lock, each migration not yet recorded in `<table>_migrations`,
    /// then checks the table ([`SqliteStore::check_schema`]). A table made
    /// by an earlier build is recognised and upgraded.
    ///
    /// # Errors
    ///
    /// [`StoreError`] when the file is not writable (even when the table is
    /// current and nothing is to be done), or the table does not match
    /// afterwards (a table made by hand without a unique key on (tenant,
    /// scope, key), say).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// # let pool = sqlx::sqlite::SqlitePoolOptions::new().max_connections(1).connect("sqlite::memory:").await.unwrap();
    /// let store = idem::SqliteStore::new(pool);
    /// store.migrate().await.unwrap();
    /// # }
    /// ```
    pub async fn migrate(&self) -> Result<(), StoreError> {
        // As every write in the permit's line (see `queued`), on the
        // writers' runtime, where nothing cuts sqlx's hand-over of the
        // connection or its give-back (either cut, sqlx closes the
        // connection, losing a database in memory); the migrations
        // themselves are not bounded, and a caller that gives up leaves
        // them to run to their end.
        let store = self.clone();
        on_writers(async move {
            let _turn = sql::bounded(store.timeout, store.write_turn()).await?;
            let mut tx = store
                .pool
                .begin_with("BEGIN IMMEDIATE")
                .await
                .map_err(sql::map_err)?;
            let store = &store;
            sql::migrate_in!(store, tx)?;
            store.check_schema_here().await
        })
        .await
    }

    /// Checks that the table matches what this build of idem needs (every
    /// migration applied): a service should refuse to start otherwise.
    /// [`migrate`](Self::migrate) ends with it. Run on a thread of idem's
    /// (see [`SqliteStore::new`]): its connection is taken from the pool and
    /// given back there, whatever becomes of the caller's runtime.
    ///
    /// # Errors
    ///
    /// [`StoreError::Backend`] naming the table and what is missing, or
    /// [`StoreError::Unavailable`].
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let store = idem::SqliteStore::in_memory().await.unwrap();
    /// store.check_schema().await.unwrap();
    /// # }
    /// ```
    pub async fn check_schema(&self) -> Result<(), StoreError> {
        let store = self.clone();
        on_writers(async move { store.check_schema_here().await }).await
    }

    sql::check_schema!(check_schema_here);
}

impl SqliteStore {
    sql::complete_with!(sqlx::Sqlite);

    /// A lock extension, built by `statement` from the statement's text,
    /// on the pool.
    async fn run_extension<'q>(
        &self,
        statement: impl Fn(&str) -> sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments>,
    ) -> Result<sqlx::sqlite::SqliteQueryResult, StoreError> {
        statement(&self.sql.extend)
            .execute(&self.pool)
            .await
            .map_err(sql::map_wait_err)
    }

    /// The token-fenced writes, as written: SQLite's waits for the file
    /// are its busy timeout's, which ends the statement with its wait.
    fn fenced_writes(&self) -> &Statements {
        &self.sql
    }

    /// The bound on one store operation.
    #[cfg(feature = "axum")]
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Opens a transaction for a handler's own writes, committed together
    /// with the completion.
    ///
    /// `BEGIN IMMEDIATE` takes SQLite's write lock, kept until the runtime
    /// commits or rolls back. It is taken in turn with this process's other
    /// writers (so it does not race them in the busy handler), but the
    /// permit is given back as soon as the transaction has begun: the
    /// handler runs holding SQLite's lock only, never the permit, so nothing
    /// of the request (the handler's code, the completion written inside
    /// this transaction, which takes no permit) waits on a permit its own
    /// request holds, and a cancelled request cannot keep it.
    ///
    /// Begun on the writers' runtime (see [`SqliteStore::queued`]), and held
    /// from there on in a [`crate::tx::LiteTx`], which is dropped from that
    /// runtime however it ends: also while it is on its way to a caller
    /// whose task goes with its runtime before it takes it.
    #[cfg(feature = "axum")]
    pub(crate) async fn begin_tx(&self) -> Result<crate::tx::LiteTx, StoreError> {
        crate::sql::bounded(
            self.timeout,
            self.queued(|store| async move {
                let mut tx = crate::tx::LiteTx::new(
                    store
                        .pool
                        .begin_with("BEGIN IMMEDIATE")
                        .await
                        .map_err(sql::map_err)?,
                );
                // The mark of this transaction: SQLite ends a transaction by
                // itself on some errors, and a savepoint of the handler's
                // may then open another; only this one holds the mark
                // (see `crate::tx`).
                sqlx::raw_sql(HANDLER_MARK)
                    .execute(tx.conn()?)
                    .await
                    .map_err(sql::map_err)?;
                Ok(tx)
            }),
        )
        .await
    }
}

/// Marks a handler's transaction (see `crate::tx`).
#[cfg(feature = "axum")]
pub(crate) const HANDLER_MARK: &str = "SAVEPOINT idem_handler";

impl IdempotencyStore for SqliteStore {
    fn reserve<'a>(&'a self, req: ReserveRequest<'a>) -> BoxFuture<'a, Result<Reservation, StoreError>> {
        Box::pin(async move {
            // Nothing is read from, nor written to, a file that is no
            // longer the one at its path (see `sql::sqlite_file`).
            self.file.check()?;
            let deadline = deadline_after(self.timeout);
            // A read first, in the caller's task (a read given up on leaves
            // nothing behind): a replay, a mismatch or a live lock is
            // answered without the write lock (WAL readers never wait for a
            // writer).
            match tokio::time::timeout_at(deadline, self.peek(&req)).await {
                Err(_) => {
                    return Err(StoreError::unavailable(format!(
                        "no answer within {} ms",
                        self.timeout.as_millis()
                    )))
                }
                Ok(Err(e)) => return Err(e),
                Ok(Ok(Some(answer))) => {
                    pause_point!(crate::pause::RESERVE_AFTER, &req.id.key);
                    return Ok(answer);
                }
                Ok(Ok(None)) => {}
            }
            // Then the write, within what is left. Given up on, its answer's
            // channel closes: a write that has not begun (in line, or its
            // group still waiting for SQLite's write lock) leaves the line,
            // and one already written gives its key back when its answer is
            // dropped unread, from the writers' runtime (see `Delivered`).
            // Nothing the write awaits belongs to the caller's runtime.
            let writing = self.clone().take_in_group(sql::OwnedReserve::of(&req));
            match tokio::time::timeout_at(deadline, writing).await {
                Ok(answer) => answer,
                Err(_) => Err(StoreError::unavailable(format!(
                    "no answer within {} ms",
                    self.timeout.as_millis()
                ))),
            }
        })
    }

    // `sql::fenced_ops!` (as on PostgreSQL), but each write in this
    // process's turn at the write lock, which is given back before the
    // pause point that follows the commit.

    fn complete<'a>(
        &'a self,
        id: &'a crate::store::RecordId,
        token: &'a str,
        response: &'a crate::store::StoredResponse,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(sql::bounded(self.timeout, async move {
            match self.complete_in_group(id, token, response).await {
                // Rolled back with another write of its group that failed:
                // written again at once, alone in its turn at the write
                // lock, where no other write can roll it back.
                Err(e) if rolled_back_with_its_group(&e) => {
                    let (id, token, response) = (id.clone(), token.to_owned(), response.clone());
                    self.queued(move |store| async move {
                        store.complete_with(&store.pool, &id, &token, &response).await
                    })
                    .await?;
                }
                done => done?,
            }
            pause_point!(crate::pause::COMPLETE_AFTER, &id.key);
            Ok(())
        }))
    }

    fn release<'a>(
        &'a self,
        id: &'a crate::store::RecordId,
        token: &'a str,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        let (owned_id, owned_token) = (id.clone(), token.to_owned());
        Box::pin(sql::bounded(self.timeout, async move {
            sql::fenced(
                self.queued(|store| async move {
                    store
                        .owned_write(&store.sql.release, &owned_id, &owned_token)
                        .await
                })
                .await?,
            )?;
            pause_point!(crate::pause::RELEASE_AFTER, &id.key);
            Ok(())
        }))
    }

    fn reject<'a>(
        &'a self,
        id: &'a crate::store::RecordId,
        token: &'a str,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        let (owned_id, owned_token) = (id.clone(), token.to_owned());
        Box::pin(sql::bounded(self.timeout, async move {
            self.queued(|store| async move { store.reject_statements(&owned_id, &owned_token).await })
                .await?;
            pause_point!(crate::pause::REJECT_AFTER, &id.key);
            Ok(())
        }))
    }

    fn hand_back<'a>(
        &'a self,
        id: &'a crate::store::RecordId,
        token: &'a str,
        taken_over: bool,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        // In this process's turn at the write lock, both statements.
        let (id, token) = (id.clone(), token.to_owned());
        Box::pin(sql::bounded(
            self.timeout,
            self.queued(
                move |store| async move { store.hand_back_statements(&id, &token, taken_over).await },
            ),
        ))
    }

    fn checkpoint<'a>(
        &'a self,
        id: &'a crate::store::RecordId,
        token: &'a str,
        recovery_point: &'a str,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        let (owned_id, owned_token, point) = (id.clone(), token.to_owned(), recovery_point.to_owned());
        Box::pin(sql::bounded(self.timeout, async move {
            let done = self
                .queued(|store| async move {
                    sqlx::query(sqlx::AssertSqlSafe(store.sql.checkpoint.as_str()))
                        .bind(&owned_id.tenant)
                        .bind(&owned_id.scope)
                        .bind(&owned_id.key)
                        .bind(&owned_token)
                        .bind(&point)
                        .execute(&store.pool)
                        .await
                        .map_err(sql::map_err)
                })
                .await?;
            sql::fenced(done.rows_affected())?;
            pause_point!(crate::pause::CHECKPOINT_AFTER, &id.key);
            Ok(())
        }))
    }

    fn extend_lock<'a>(
        &'a self,
        id: &'a crate::store::RecordId,
        token: &'a str,
        lock_timeout: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        let (owned_id, owned_token) = (id.clone(), token.to_owned());
        Box::pin(sql::bounded(self.timeout, async move {
            sql::fenced(
                self.queued(move |store| async move {
                    store.extend_write(&owned_id, &owned_token, lock_timeout).await
                })
                .await?,
            )?;
            pause_point!(crate::pause::EXTEND_AFTER, &id.key);
            Ok(())
        }))
    }

    fn purge_expired(&self, batch: u32) -> BoxFuture<'_, Result<u64, StoreError>> {
        Box::pin(async move {
            // Each batch a short write of its own in the queue.
            let batched = |statement: fn(&Statements) -> &str| {
                self.queued(move |store| async move {
                    sqlx::query(sqlx::AssertSqlSafe(statement(&store.sql)))
                        .bind(i64::from(batch))
                        .execute(&store.pool)
                        .await
                        .map_err(sql::map_err)
                })
            };
            sql::purge_within(
                self.timeout,
                batch,
                || async { Ok(batched(|sql| &sql.purge_set).await?.rows_affected()) },
                || async move {
                    let done = batched(|sql| &sql.purge).await?;
                    pause_point!(crate::pause::PURGE_AFTER, &self.sql.table);
                    Ok(done.rows_affected())
                },
            )
            .await
        })
    }
}

impl SqliteStore {
    /// What the read before a reservation's write answers: a replay, a
    /// mismatch or a live lock, or `None` when the key may be taken.
    ///
    /// Given up on (its caller's timeout), it leaves nothing behind: its
    /// connection comes from [`SqliteStore::group_connection`] (never cut
    /// halfway through sqlx's hand-over, which closes it), and, dropped
    /// before the read is done, goes back to the pool from the writers'
    /// runtime (see [`Held`]).
    async fn peek(&self, req: &ReserveRequest<'_>) -> Result<Option<Reservation>, StoreError> {
        let seen = OnWriters::new(async {
            let mut conn = self.group_connection().await?;
            let Some(c) = conn.0.as_mut() else {
                return Ok(None);
            };
            let row = sqlx::query(sqlx::AssertSqlSafe(self.sql.peek.as_str()))
                .bind(&req.id.tenant)
                .bind(&req.id.scope)
                .bind(&req.id.key)
                .bind(req.fingerprint)
                .fetch_optional(&mut **c)
                .await
                .map_err(sql::map_err);
            // Done: back to the pool (see `give_back`).
            if let Some(c) = conn.0.take() {
                give_back(c);
            }
            row
        })
        .await?;
        if let Some(row) = seen {
            let takeable: i32 =
                sqlx::Row::try_get(&row, "takeable").map_err(|e| StoreError::backend(e.to_string()))?;
            if takeable == 0 {
                return sql::judge_row(&row, req.fingerprint).map(Some);
            }
        }
        Ok(None)
    }

    /// A completion's write, in the next group commit.
    async fn complete_in_group(
        &self,
        id: &crate::store::RecordId,
        token: &str,
        response: &crate::store::StoredResponse,
    ) -> Result<(), StoreError> {
        let (answer, answered) = tokio::sync::oneshot::channel();
        let store = self.clone();
        let (owned_id, token, response) = (id.clone(), token.to_owned(), response.clone());
        self.join_group(job(true, move |conn| {
            Box::pin(async move {
                let (conn, answer) = match start_job(conn, answer) {
                    Ok(started) => started,
                    Err(written) => return written,
                };
                let done = store
                    .complete_with(&mut *conn, &owned_id, &token, &response)
                    .await;
                Written {
                    failed: done.is_err(),
                    answer: Box::new(move |committed| {
                        let _ = answer.send(done.and(committed));
                    }),
                }
            })
        }));
        answered
            .await
            .map_err(|_| StoreError::backend("the completion's write did not finish"))?
    }

    /// A reservation's write, as long as it takes: its caller bounds it,
    /// and dropping it leaves nothing behind (see `reserve`).
    async fn take_in_group(self, owned: sql::OwnedReserve) -> Result<Reservation, StoreError> {
        pause_point!(crate::pause::SQLITE_RESERVE_AFTER_PEEK, &owned.id().key);
        #[cfg(feature = "pause-points")]
        let key = owned.id().key.clone();
        // The write joins the next group commit, which a task of its own
        // runs: it holds the process's turn at the write lock from BEGIN to
        // COMMIT, and must not stop midway because the request that asked
        // for it is not being polled (every other writer of the process
        // would wait behind it). Its answer comes back on a channel once
        // the group has committed: a write whose caller stopped waiting for
        // it before it began writes nothing (`start_job`), and one that
        // took the key after all gives it back itself, so that no lock
        // stays that nobody holds.
        let (answer, answered) = tokio::sync::oneshot::channel::<Result<Delivered, StoreError>>();
        let store = self.clone();
        self.join_group(job(false, move |conn| {
            Box::pin(async move {
                let (conn, answer) = match start_job(conn, answer) {
                    Ok(started) => started,
                    Err(written) => return written,
                };
                let taken = store.take(conn, owned.request()).await;
                Written {
                    failed: taken.is_err(),
                    answer: Box::new(move |committed| {
                        let taken = taken.and_then(|t| committed.map(|()| t));
                        // A caller already gone hands it back at once: it is
                        // dropped here, and gives the key back.
                        drop(answer.send(Ok(Delivered {
                            answer: Some(taken),
                            undo: Some((store, owned)),
                        })));
                    }),
                }
            })
        }));
        let answer = answered
            .await
            .map_err(|_| StoreError::backend("the reservation's write did not finish"))??
            .read();
        // A key taken in a file that is gone by its commit is held by nothing
        // a later process reads: its handler does not run.
        if let Ok(Reservation::Reserved(_)) = answer {
            self.file.check()?;
        }
        pause_point!(crate::pause::RESERVE_AFTER, &key);
        answer
    }

    /// Gives back a key that a reservation took after its caller gave up on
    /// it, as it was found (see `IdempotencyStore::hand_back`), so that no
    /// lock stays that nobody holds.
    async fn give_back(self, owned: sql::OwnedReserve, taken_over: bool) {
        tracing::warn!("a reservation took its key after its caller gave up; giving the key back");
        let until = deadline_after(owned.lock_timeout());
        let given = crate::store::retry_until(until, || {
            IdempotencyStore::hand_back(&self, owned.id(), owned.token(), taken_over)
        })
        .await;
        match given {
            Ok(()) | Err(StoreError::LockLost) => {}
            Err(e) => {
                tracing::error!(error = %e, "could not give back a key taken after its caller gave up");
            }
        }
    }

    /// Takes the key, on the group's connection, in its transaction, which
    /// holds SQLite's write lock: the upsert decides again on the row as it
    /// is now (absent, expired, stale or released: taken).
    async fn take(
        &self,
        conn: &mut sqlx::SqliteConnection,
        req: ReserveRequest<'_>,
    ) -> Result<Reservation, StoreError> {
        let operation_id = random_token_inline();
        let taken = sqlx::query(sqlx::AssertSqlSafe(self.sql.take.as_str()))
            .bind(&req.id.tenant)
            .bind(&req.id.scope)
            .bind(&req.id.key)
            .bind(req.fingerprint)
            .bind(req.token)
            .bind(operation_id.as_str())
            .bind(millis(req.ttl))
            .bind(millis(req.lock_timeout))
            .fetch_optional(&mut *conn)
            .await
            .map_err(sql::map_err)?;
        let answer = match taken {
            Some(row) => sql::lease_from_row(&row, req.token.to_owned()).map(Reservation::Reserved)?,
            None => {
                let row = sqlx::query(sqlx::AssertSqlSafe(self.sql.existing.as_str()))
                    .bind(&req.id.tenant)
                    .bind(&req.id.scope)
                    .bind(&req.id.key)
                    .fetch_one(&mut *conn)
                    .await
                    .map_err(sql::map_err)?;
                sql::judge_row(&row, req.fingerprint)?
            }
        };
        // The file this store writes to, learnt once (a read that fails
        // leaves it for the next write).
        if !self.file.learnt() {
            let name = sqlx::query_scalar::<_, String>(sql::sqlite_file::MAIN_FILE)
                .fetch_one(&mut *conn)
                .await;
            if let Ok(name) = name {
                self.file.learn(&name);
            }
        }
        pause_point!(crate::pause::SQLITE_RESERVE_BEFORE_COMMIT, &req.id.key);
        Ok(answer)
    }
}

/// A reservation's answer on its way to its caller. A key it took that
/// its caller never reads is given back when it is dropped, on the
/// writers' runtime, as it was found (see `SqliteStore::give_back`): the
/// caller was gone before the answer came (the send hands it back), or
/// went before reading it (its runtime shut down with the answer in its
/// channel, or its future was dropped).
struct Delivered {
    /// `None` once read.
    answer: Option<Result<Reservation, StoreError>>,
    /// What gives the key back; `None` once read.
    undo: Option<(SqliteStore, sql::OwnedReserve)>,
}

impl Delivered {
    /// The answer, read by its caller: nothing is given back any more.
    fn read(mut self) -> Result<Reservation, StoreError> {
        self.undo = None;
        self.answer
            .take()
            .unwrap_or_else(|| Err(StoreError::backend("the reservation's answer was read twice")))
    }
}

impl Drop for Delivered {
    fn drop(&mut self) {
        let (Some(Ok(Reservation::Reserved(lease))), Some((store, owned))) =
            (self.answer.take(), self.undo.take())
        else {
            return;
        };
        // Under way (`Idem::idle`) until the key is given back.
        let under_way = crate::store::background_work().enter();
        let giving_back = async move {
            store.give_back(owned, lease.is_takeover()).await;
            drop(under_way);
        };
        // On the writers' runtime: the dropping one may be shutting down
        // (or be this leader's, see `Finishing`); on this one if that
        // runtime could not be started; nowhere outside any runtime.
        match writer_runtime() {
            Some(writers) => drop(writers.spawn(giving_back)),
            None => match tokio::runtime::Handle::try_current() {
                Ok(here) => drop(here.spawn(giving_back)),
                Err(_) => tracing::error!(
                    "a reservation took its key after its caller went, and no runtime can give it back: \
                     it stays locked until its lock timeout"
                ),
            },
        }
    }
}

/// Rolls back whatever transaction is open on `conn`, then opens again as
/// many as sqlx still counts (with sqlx's own statements), one per level;
/// says how many. A transaction that SQLite ended by itself is one that
/// sqlx still counts: rolling those back through sqlx leaves the connection
/// neither inside a transaction nor counted inside one.
pub(crate) async fn reopen_counted(conn: &mut sqlx::SqliteConnection) -> Result<usize, StoreError> {
    use sqlx_core::transaction::{begin_ansi_transaction_sql, TransactionManager as _};
    type Manager = <sqlx::Sqlite as sqlx::Database>::TransactionManager;
    let _ = sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await;
    let depth = Manager::get_transaction_depth(conn);
    for level in 0..depth {
        sqlx::raw_sql(begin_ansi_transaction_sql(level))
            .execute(&mut *conn)
            .await
            .map_err(sql::map_err)?;
    }
    Ok(depth)
}

/// Leaves `conn` with no transaction open and none counted, after one
/// ended in a failure (see [`reopen_counted`]).
async fn settle(conn: &mut sqlx::SqliteConnection) -> Result<(), StoreError> {
    for _ in 0..reopen_counted(conn).await? {
        rollback_level(conn).await?;
    }
    Ok(())
}

/// Rolls back the innermost level sqlx counts on `conn`, as sqlx's
/// transaction manager does; dropped part-way (its runtime shutting down,
/// a timeout), it asks for that rollback the way a dropped transaction
/// does. sqlx's worker, once it has rolled back for an answer nobody
/// waits for any more, skips the next rollback asked that way: with none
/// asked, it would skip the rollback of the application's next dropped
/// transaction on the connection, which would stay open with every write
/// after it. (An owned `Transaction` dropped part-way asks by itself.)
pub(crate) async fn rollback_level(conn: &mut sqlx::SqliteConnection) -> Result<(), StoreError> {
    use sqlx_core::transaction::TransactionManager as _;
    type Manager = <sqlx::Sqlite as sqlx::Database>::TransactionManager;
    /// Asks for the rollback on drop, unless taken out first.
    struct AskOnDrop<'c>(Option<&'c mut sqlx::SqliteConnection>);
    impl Drop for AskOnDrop<'_> {
        fn drop(&mut self) {
            if let Some(conn) = self.0.take() {
                Manager::start_rollback(conn);
            }
        }
    }
    let mut asking = AskOnDrop(Some(conn));
    let Some(conn) = asking.0.as_deref_mut() else {
        return Ok(());
    };
    let rolled_back = Manager::rollback(conn).await;
    asking.0 = None;
    rolled_back.map_err(sql::map_err)
}

/// A group's connection. Dropped before its group is done (its leader's
/// runtime shutting down, a job's panic), it is put right in a task of its
/// own before it goes back to the pool, as after a failed commit
/// ([`settle`]): SQLite may have ended the group's transaction by itself,
/// which sqlx still counts, at any step the cut came after, and going
/// back so, every `BEGIN` on it would fail and what was written on it
/// outside a transaction would never commit. (The group's transaction,
/// dropped first, has asked for its rollback by then.) Outside a runtime,
/// it is closed instead.
struct GroupConnection(Option<sqlx::pool::PoolConnection<sqlx::Sqlite>>);

impl Drop for GroupConnection {
    fn drop(&mut self) {
        let Some(mut conn) = self.0.take() else {
            return;
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(async move {
                if settle(&mut conn).await.is_err() {
                    conn.close_on_drop();
                }
            })),
            Err(_) => conn.close_on_drop(),
        }
    }
}

/// The writes of reservations and completions that wait while the write
/// lock is held, committed together when it is free: one transaction, one
/// sync of the log, for all of them.
#[derive(Default)]
struct Group {
    queue: std::sync::Mutex<Queue>,
}

#[derive(Default)]
struct Queue {
    jobs: Vec<Job>,
    /// Whether a leader runs (or is being started): it takes every job
    /// queued.
    leading: bool,
}

/// The most writes one group commits.
const GROUP_MAX: usize = 64;

/// A write's statements, run on its group's connection in the group's
/// transaction (or told why there is none).
type Run = Box<
    dyn for<'c> FnOnce(Result<&'c mut sqlx::SqliteConnection, StoreError>) -> BoxFuture<'c, Written> + Send,
>;

/// One write of a group.
struct Job {
    run: Run,
    /// It is one statement, atomic by itself: alone in its group, it runs
    /// without `BEGIN` and `COMMIT` (two statements fewer), as it would
    /// without groups.
    one_statement: bool,
}

/// A [`Job`], its closure's signature spelled out once.
fn job<F>(one_statement: bool, f: F) -> Job
where
    F: for<'c> FnOnce(Result<&'c mut sqlx::SqliteConnection, StoreError>) -> BoxFuture<'c, Written>
        + Send
        + 'static,
{
    Job {
        run: Box::new(f),
        one_statement,
    }
}

/// The start of a job: its connection and its caller's answer channel, or
/// what it did instead. With no transaction begun, it is answered why. A
/// write whose caller gave up on it before its turn is not written, as a
/// write given up on in line never was (a reservation leaves the line, as
/// it used to leave SQLite's busy handler, instead of taking a key only to
/// give it back).
fn start_job<T: Send + 'static>(
    conn: Result<&mut sqlx::SqliteConnection, StoreError>,
    answer: Answer<T>,
) -> Result<(&mut sqlx::SqliteConnection, Answer<T>), Written> {
    match conn {
        Err(e) => Err(Written::answered(answer, Err(e))),
        Ok(_) if answer.is_closed() => Err(Written::nothing()),
        Ok(conn) => Ok((conn, answer)),
    }
}

/// The failure a write of a group is answered with when SQLite rolled the
/// group's transaction back whole after another write's statement failed:
/// its own statements had succeeded.
const ROLLED_BACK_WITH_ITS_GROUP: &str =
    "rolled back with another write of its group, whose statement failed";

/// Whether `e` is [`ROLLED_BACK_WITH_ITS_GROUP`].
fn rolled_back_with_its_group(e: &StoreError) -> bool {
    matches!(e, StoreError::Backend { reason, .. } if reason == ROLLED_BACK_WITH_ITS_GROUP)
}

/// Where a job's caller waits for its answer.
type Answer<T> = tokio::sync::oneshot::Sender<Result<T, StoreError>>;

/// What a job did in its group's transaction.
struct Written {
    /// Its statements failed: the group commits what came before it, and
    /// the rest go on in a transaction of their own.
    failed: bool,
    /// Hands over its answer once the commit's outcome is known: nothing is
    /// answered before it.
    answer: Box<dyn FnOnce(Result<(), StoreError>) + Send>,
}

impl Written {
    /// A job that ran nothing.
    fn nothing() -> Self {
        Written {
            failed: false,
            answer: Box::new(|_| {}),
        }
    }

    /// A job that ran nothing, answered with `result`.
    fn answered<T: Send + 'static>(answer: Answer<T>, result: Result<T, StoreError>) -> Self {
        let _ = answer.send(result);
        Written::nothing()
    }
}

/// A pool's connection held by a future that may be dropped before it is
/// done (its caller's timeout): dropped so, it goes back to the pool from
/// the writers' runtime, not from the dropping task's runtime, which may
/// never run sqlx's give-back (a current-thread runtime left idle) or may
/// be shutting down (and then sqlx closes the connection, losing a database
/// in memory). Taken out first, it is given back with [`give_back`].
struct Held(Option<sqlx::pool::PoolConnection<sqlx::Sqlite>>);

/// Gives `conn` back to its pool from a task of the current runtime that
/// finishes on the writers' runtime if this one shuts down first (see
/// [`Finishing`]): sqlx's own give-back on drop is a task of the current
/// runtime, dropped with it, and then sqlx closes the connection (losing a
/// database in memory). Outside a runtime, from the writers' runtime.
fn give_back(conn: sqlx::pool::PoolConnection<sqlx::Sqlite>) {
    match tokio::runtime::Handle::try_current() {
        Ok(here) => drop(here.spawn(Finishing::new(returning(conn)))),
        Err(_) => give_back_on_writers(conn),
    }
}

/// `conn`'s way back to its pool, taken out of it at once (its drop then
/// spawns nothing of sqlx's).
fn returning(
    mut conn: sqlx::pool::PoolConnection<sqlx::Sqlite>,
) -> impl std::future::Future<Output = ()> + Send + 'static {
    let back = conn.return_to_pool();
    drop(conn);
    back
}

/// Gives `conn` back from the writers' runtime (a spawn on another
/// runtime's handle, which, unlike entering its context, a drop may do
/// while tokio is spawning).
fn give_back_on_writers(conn: sqlx::pool::PoolConnection<sqlx::Sqlite>) {
    if let Some(writers) = writer_runtime() {
        drop(writers.spawn(returning(conn)));
    }
}

/// Spawns `task` on the writers' runtime, which runs whatever becomes of
/// the caller's (or, when it cannot be started, on the current one).
pub(crate) fn spawn_on_writers<F>(task: F) -> tokio::task::JoinHandle<()>
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    match writer_runtime() {
        Some(writers) => writers.spawn(task),
        None => tokio::spawn(task),
    }
}

/// Drops `value` (a handler's transaction) from the writers' runtime, or
/// here when that runtime cannot be started: whatever sqlx's drop starts
/// there (the rollback of what is left open, the connection's way back to
/// its pool, a task of the runtime it is dropped on) runs whatever becomes
/// of the dropping task's runtime. A spawn on another runtime's handle,
/// which a drop may do while tokio is spawning or shutting down.
#[cfg(feature = "axum")]
pub(crate) fn drop_on_writers<T: Send + 'static>(value: T) {
    match writer_runtime() {
        Some(writers) => drop(writers.spawn(async move { drop(value) })),
        None => drop(value),
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(conn) = self.0.take() {
            give_back_on_writers(conn);
        }
    }
}

/// The writers' runtime: one thread of its own for the process, driven
/// until the process ends, started when first needed (and again later, if
/// starting it failed). See [`off_caller`].
fn writer_runtime() -> Option<tokio::runtime::Handle> {
    static WRITERS: std::sync::Mutex<Option<tokio::runtime::Handle>> = std::sync::Mutex::new(None);
    let mut writers = WRITERS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if writers.is_none() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .ok()?;
        let handle = runtime.handle().clone();
        std::thread::Builder::new()
            .name("idem-sqlite-commit".into())
            .spawn(move || runtime.block_on(std::future::pending::<()>()))
            .ok()?;
        *writers = Some(handle);
    }
    writers.clone()
}

/// Where what outlives a call of the caller's must run, when not on the
/// caller's runtime (`None`): on the writers' runtime. A current-thread
/// runtime runs its tasks only while a `block_on` drives it, which may end
/// once the caller has its answer or has given up; there, a write waiting
/// in the permit's line would get the permit in its turn and keep it
/// (every other writer waiting for its timeout), a group leader would never
/// run, a key taken for a caller that gave up would never be given back,
/// and a connection would never go back to its pool (stalling a pool of
/// one, such as a database in memory). A multi-thread runtime's workers run
/// its tasks whatever its callers do, so there everything stays on the
/// caller's runtime, without a thread hop (hops for every caller cost a
/// first request on SQLite about 60% more CPU at one client: docs/benchmarks-log.md).
pub(crate) fn off_caller() -> Option<tokio::runtime::Handle> {
    match tokio::runtime::Handle::try_current() {
        Ok(caller) if caller.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => None,
        _ => writer_runtime(),
    }
}

/// A future that holds a pool's connection, polled in the caller's task,
/// inside [`off_caller`]'s runtime's context when there is one (decided at
/// its first poll, where it runs). sqlx gives a connection back to its pool
/// from a task spawned where the connection is dropped, and such a task
/// never runs on a runtime no longer driven: the connection is then held
/// for good, stalling a pool of one (a database in memory), which loses
/// its database when that runtime is dropped. (Dropped before it is done,
/// it is dropped where it is: entering another runtime's context from a
/// drop that tokio runs while it spawns panics.)
pub(crate) struct OnWriters<F: std::future::Future> {
    inner: Option<std::pin::Pin<Box<F>>>,
    /// `None` until the first poll.
    context: Option<Option<tokio::runtime::Handle>>,
}

impl<F: std::future::Future> OnWriters<F> {
    pub(crate) fn new(inner: F) -> Self {
        OnWriters {
            inner: Some(Box::pin(inner)),
            context: None,
        }
    }
}

impl<F: std::future::Future> std::future::Future for OnWriters<F> {
    type Output = F::Output;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        let this = &mut *self;
        let context = this.context.get_or_insert_with(off_caller);
        let _context = context.as_ref().map(tokio::runtime::Handle::enter);
        let Some(inner) = this.inner.as_mut() else {
            return std::task::Poll::Pending;
        };
        let out = std::task::ready!(inner.as_mut().poll(cx));
        // Dropped here, in the same context.
        this.inner = None;
        std::task::Poll::Ready(out)
    }
}

/// A task that finishes what it started: when its runtime drops it before
/// it is done (the runtime is shutting down), what is left of it goes on to
/// its end on the writers' runtime (its output, if any, unread). For what
/// must not stop halfway: a group leader, whose writes may be under way in
/// sqlx's worker, its COMMIT among them, which that worker runs whatever
/// becomes of the future that asked, so that each write is answered as it
/// turned out, not told that it failed while it is committed (nor a
/// reservation left holding a key for a caller told it did not get it);
/// the commit of a handler's own transaction. Either way the connection
/// held, or being handed over by the pool, goes back to the pool from
/// there rather than being closed with that runtime's tasks (which would
/// lose a database in memory). What it wraps must await no timer or I/O
/// resource of its runtime: a group leader's turn is a semaphore's, its
/// connection comes at once from the pool or from an acquisition on the
/// writers' runtime ([`SqliteStore::group_connection`]), and the rest is
/// sqlx's worker's channels. Only a task whose poll panicked is dropped
/// instead (a leader's mark then hands the queue to another: see
/// [`Leading`]).
pub(crate) struct Finishing<F: std::future::Future + Send + 'static>
where
    F::Output: Send,
{
    inner: Option<std::pin::Pin<Box<F>>>,
    /// Set while `inner` is polled: still set when it is dropped, that poll
    /// panicked, and `inner` cannot be polled again.
    polling: bool,
}

impl<F: std::future::Future + Send + 'static> Finishing<F>
where
    F::Output: Send,
{
    pub(crate) fn new(inner: F) -> Self {
        Finishing {
            inner: Some(Box::pin(inner)),
            polling: false,
        }
    }
}

impl<F: std::future::Future + Send + 'static> std::future::Future for Finishing<F>
where
    F::Output: Send,
{
    type Output = F::Output;

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<F::Output> {
        let this = self.get_mut();
        let Some(inner) = this.inner.as_mut() else {
            return std::task::Poll::Pending;
        };
        this.polling = true;
        let polled = inner.as_mut().poll(cx);
        this.polling = false;
        let out = std::task::ready!(polled);
        this.inner = None;
        std::task::Poll::Ready(out)
    }
}

impl<F: std::future::Future + Send + 'static> Drop for Finishing<F>
where
    F::Output: Send,
{
    fn drop(&mut self) {
        if let (Some(inner), Some(writers)) = (self.inner.take(), writer_runtime()) {
            // A spawn on another runtime's handle, which (unlike entering its
            // context) a drop may do while tokio is spawning.
            if self.polling {
                drop(writers.spawn(async move { drop(inner) }));
            } else {
                drop(writers.spawn(async move { drop(inner.await) }));
            }
        }
    }
}

/// Runs `work` on the writers' runtime (to its end, whatever the caller
/// does), or in the caller's task when that runtime cannot be started, and
/// answers with its outcome.
async fn on_writers<T: Send + 'static>(
    work: impl std::future::Future<Output = Result<T, StoreError>> + Send + 'static,
) -> Result<T, StoreError> {
    match writer_runtime() {
        Some(runtime) => match runtime.spawn(work).await {
            Ok(done) => done,
            // A panic there (an application's pool hook's, say) is the
            // caller's, as it would be had the work run in its task.
            Err(e) => match e.try_into_panic() {
                Ok(panic) => std::panic::resume_unwind(panic),
                Err(e) => Err(StoreError::backend(format!("a SQLite call did not finish: {e}"))),
            },
        },
        None => work.await,
    }
}

/// The leader's mark, made before its task is spawned and dropped with it.
/// A leader that ends before the queue is empty (a panic; or its task
/// dropped with no writers' runtime to go on on: see [`Finishing`]; or a
/// spawn of it that a runtime refused) hands the writes still queued to a leader of
/// their own on the writers' thread (see [`off_caller`]): a write that
/// joined the line while the leader was running, or as it was being
/// dropped, saw a leader and started none, and would otherwise wait for
/// its timeout, or be failed though nothing went wrong with it. Only when
/// no such leader can be started (no writers' thread, or its runtime gone)
/// are they answered with an error at once (dropping a job drops its
/// caller's answer channel), and the next write queued starts a leader of
/// its own.
struct Leading {
    store: SqliteStore,
    armed: bool,
}

std::thread_local! {
    /// Set while a [`Leading`]'s drop spawns the next leader: a spawn on a
    /// runtime that is gone drops that leader at once, and its own mark's
    /// drop must then fail the queue rather than spawn again.
    static HANDING_OVER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl Drop for Leading {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        {
            let mut queue = self.store.group.lock();
            if queue.jobs.is_empty() {
                // Under the lock that queues: a write queued after this
                // starts a leader of its own.
                queue.leading = false;
                return;
            }
        }
        // `leading` stays set: the writes queued, and those that join
        // meanwhile, are the next leader's.
        let writers = if HANDING_OVER.with(std::cell::Cell::get) {
            None
        } else {
            writer_runtime()
        };
        if let Some(writers) = writers {
            let next = Leading {
                store: self.store.clone(),
                armed: true,
            };
            HANDING_OVER.with(|h| h.set(true));
            drop(writers.spawn(self.store.clone().lead(next)));
            HANDING_OVER.with(|h| h.set(false));
            return;
        }
        let orphans = {
            let mut queue = self.store.group.lock();
            queue.leading = false;
            std::mem::take(&mut queue.jobs)
        };
        drop(orphans);
    }
}

impl Group {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl SqliteStore {
    /// Queues `job` for the next group commit, starting the task that leads
    /// groups if none runs.
    fn join_group(&self, job: Job) {
        let lead = {
            let mut queue = self.group.lock();
            queue.jobs.push(job);
            !std::mem::replace(&mut queue.leading, true)
        };
        if lead {
            // Its mark made first (see `Leading`): if it cannot start, the
            // mark's drop hands the queued writes to a leader on the
            // writers' thread, or else answers them with an error at once.
            let leading = Leading {
                store: self.clone(),
                armed: true,
            };
            let runtime = off_caller().or_else(|| tokio::runtime::Handle::try_current().ok());
            match runtime {
                // Its connection given back on the writers' runtime if its
                // own shuts down while it runs.
                Some(runtime) => drop(runtime.spawn(Finishing::new(self.clone().lead(leading)))),
                None => {
                    tracing::error!("no runtime to commit SQLite's writes on");
                    drop(leading);
                }
            }
        }
    }

    /// Commits groups while writes are queued: waits its turn at the write
    /// lock with the process's other writers, then for a connection, takes
    /// every write queued by then, commits them, gives the turn back, and
    /// goes on while more are queued. It runs on the runtime of the write that started it when
    /// that one is a multi-thread runtime, else on the writers' thread (see
    /// [`off_caller`]), as does one that takes over the line from a leader
    /// that ended early (see [`Leading`]).
    async fn lead(self, mut leading: Leading) {
        loop {
            let Ok(turn) = self.write_turn().await else {
                // The line is closed: nothing queued can be written, by this
                // leader or another (the mark's drop would hand it over).
                let orphans = {
                    let mut queue = self.group.lock();
                    queue.leading = false;
                    std::mem::take(&mut queue.jobs)
                };
                leading.armed = false;
                drop(orphans);
                return;
            };
            // The connection before the writes: the group takes every write
            // queued while it came.
            let conn = self.group_connection().await;
            let jobs: Vec<Job> = {
                let mut queue = self.group.lock();
                let n = queue.jobs.len().min(GROUP_MAX);
                queue.jobs.drain(..n).collect()
            };
            self.commit_group(conn, jobs).await;
            drop(turn);
            let mut queue = self.group.lock();
            if queue.jobs.is_empty() {
                // Under the lock that queues: a write queued after this
                // starts a leader of its own.
                queue.leading = false;
                leading.armed = false;
                return;
            }
        }
    }

    /// Runs `jobs` on `conn` in one `BEGIN IMMEDIATE` transaction and
    /// commits it, then answers each. A job whose statements fail ends the
    /// transaction (what came before it commits), and the jobs after it
    /// are first in line again, for the next.
    async fn commit_group(&self, conn: Result<Held, StoreError>, mut jobs: Vec<Job>) {
        let conn = match conn.map(|mut held| held.0.take()) {
            Ok(Some(conn)) => conn,
            Ok(None) => return,
            Err(e) => return Self::fail_all(jobs.into_iter(), e).await,
        };
        if let [only] = &jobs[..] {
            if only.one_statement {
                let job = jobs.pop().unwrap_or_else(|| unreachable!("one job"));
                let mut conn = conn;
                let written = (job.run)(Ok(&mut *conn)).await;
                give_back(conn);
                return (written.answer)(Ok(()));
            }
        }
        let mut group_conn = GroupConnection(Some(conn));
        let Some(conn) = group_conn.0.as_mut() else {
            return;
        };
        let mut jobs = jobs.into_iter();
        let mut answers = Vec::new();
        let mut one_failed = false;
        let committed = {
            let mut tx = match sqlx::Connection::begin_with(&mut **conn, "BEGIN IMMEDIATE").await {
                Ok(tx) => tx,
                Err(e) => return Self::fail_all(jobs, sql::map_err(e)).await,
            };
            for job in jobs.by_ref() {
                let written = (job.run)(Ok(&mut *tx)).await;
                answers.push(written.answer);
                if written.failed {
                    one_failed = true;
                    break;
                }
            }
            tx.commit().await.map_err(sql::map_err)
        };
        // SQLite may have ended the transaction by itself (on some errors a
        // failed statement rolls back the whole transaction, and the commit
        // then fails): sqlx would still count it open, and every `BEGIN` on
        // the connection would fail. The count is put right; a connection
        // that cannot be is closed (which, for a database in memory, would
        // lose it: the last resort).
        let unsound = committed.is_err() && settle(conn).await.is_err();
        // Done: back to the pool as it is, or closed.
        if let Some(mut conn) = group_conn.0.take() {
            if unsound {
                conn.close_on_drop();
            } else {
                give_back(conn);
            }
        }
        let rest: Vec<Job> = jobs.collect();
        if !rest.is_empty() {
            self.group.lock().jobs.splice(0..0, rest);
        }
        // A write that failed answers its own failure (its closure holds
        // it). When the commit failed after it, SQLite rolled back the writes
        // before it too, though theirs succeeded: they are told so, and a
        // completion then goes back in line for a group without it.
        let outcome = match committed {
            Err(StoreError::Backend { source, .. } | StoreError::Unavailable { source, .. })
                if one_failed =>
            {
                Err(StoreError::Backend {
                    reason: ROLLED_BACK_WITH_ITS_GROUP.to_owned(),
                    source,
                })
            }
            other => other,
        };
        for answer in answers {
            answer(outcome.clone());
        }
    }

    /// A connection for a group, or for a reservation's read: an idle one
    /// at once (no `await`, and no check of sqlx's before it is handed
    /// over), or else one acquired on the writers' runtime, whose timer
    /// that acquisition uses. Either way a leader dropped by its runtime
    /// while it waits can go on elsewhere (see [`Finishing`]); and a
    /// connection is never dropped halfway through sqlx's hand-over, which
    /// closes it (losing a database in memory), however the caller is cut.
    /// It comes in a [`Held`]: one acquired on the writers' runtime for a
    /// caller that is gone by then is dropped with the acquisition's output,
    /// and goes back to the pool from there too.
    async fn group_connection(&self) -> Result<Held, StoreError> {
        if let Some(conn) = self.pool.try_acquire() {
            return Ok(Held(Some(conn)));
        }
        pause_point!(crate::pause::SQLITE_GROUP_WAITS_FOR_A_CONNECTION, &self.sql.table);
        match writer_runtime() {
            Some(writers) => {
                let pool = self.pool.clone();
                writers
                    .spawn(async move { pool.acquire().await.map(|conn| Held(Some(conn))) })
                    .await
                    .map_err(|e| {
                        StoreError::backend(format!("a SQLite connection's acquisition failed: {e}"))
                    })?
                    .map_err(sql::map_err)
            }
            None => self
                .pool
                .acquire()
                .await
                .map(|conn| Held(Some(conn)))
                .map_err(sql::map_err),
        }
    }

    /// Answers every job with `e`: no transaction could begin.
    async fn fail_all(jobs: impl Iterator<Item = Job>, e: StoreError) {
        for job in jobs {
            ((job.run)(Err(e.clone())).await.answer)(Err(e.clone()));
        }
    }
}

/// The pool of a database in memory: one connection (connections that
/// share one lock whole tables and never wait), never closed (the database
/// lives as long as a connection to it), and handed over unpinged (a query
/// of the application's given up on during a ping has sqlx close it).
fn in_memory_pool() -> SqlitePoolOptions {
    SqlitePoolOptions::new()
        .max_connections(1)
        .idle_timeout(None)
        .max_lifetime(None)
        .test_before_acquire(false)
}

/// What SQLite opens under a file name.
#[derive(Debug, PartialEq, Eq)]
enum FilenameKind {
    File,
    /// `:memory:`, or no name (a temporary database): one database per
    /// connection.
    Memory,
}

/// What SQLite makes of `name`, which sqlx opens with URIs allowed: a URI
/// filename (`file:...`) is refused, as its own parameters (a shared
/// cache, a database in memory) would go unseen here.
fn filename_kind(name: &str) -> Result<FilenameKind, StoreError> {
    if name == ":memory:" || name.is_empty() {
        return Ok(FilenameKind::Memory);
    }
    // SQLite reads a name as a URI only when it begins so, in lower case.
    if name.starts_with("file:") {
        return Err(StoreError::backend(format!(
            "invalid SQLite file name {name:?}: a URI file name is refused, since its parameters \
             (cache=shared, mode=memory) would change how the store must open it; give the path, and \
             parameters in the URL's own query (sqlite://path?mode=rwc)"
        )));
    }
    Ok(FilenameKind::File)
}
