//! The production store: PostgreSQL through sqlx.

use crate::sql::millis;
use crate::sql::{self, Statements};
use crate::store::{deadline_after, random_token_inline, BoxFuture};
use crate::store::{IdempotencyStore, Reservation, ReserveRequest, StoreError};
use sqlx::postgres::{PgPool, PgPoolOptions};
use std::time::{Duration, Instant};

/// The migrations of the records table, in order, with `{table}`,
/// `{index}` and `{reserve_function}` standing for the configured names and
/// the generated function; [`PgStore::migrations_sql`] gives them filled in.
/// [`PgStore::migrate`] applies those not yet applied.
pub const POSTGRES_MIGRATIONS: &[sql::Migration] = sql::migrations!("postgres");

/// The default bound on one store operation, connection included.
pub const DEFAULT_OPERATION_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a completed record's answer is answered from memory by default
/// (see [`PgStore::with_replay_cache`]).
pub const DEFAULT_REPLAY_CACHE: Duration = Duration::from_secs(1);

/// Idempotency records in PostgreSQL: the store for several servers.
///
/// Taking a key starts with one statement under the primary key (tenant,
/// scope, key) that reads first: when the record is there to answer from
/// (a replay, a conflict, a mismatch), that primary-key lookup is all it
/// does. For a fresh key it calls the reservation function (created by
/// [`PgStore::migrate`]): `INSERT ... ON CONFLICT DO NOTHING`. A record that
/// may be taken (expired, or its lock past its deadline or released) takes
/// a second statement, whose conditional `UPDATE` takes it, the database
/// deciding between concurrent callers. Every later write carries
/// the lock token; expiry and lock deadlines use the database's `now()`.
///
/// Round trips per request path:
///
/// | path | round trips |
/// | --- | --- |
/// | first request (reserve, then complete or release) | 2 |
/// | replay of a completed record | 1; none while its answer is kept ([`PgStore::with_replay_cache`]) |
/// | conflict (in progress, or fingerprint mismatch; a mismatch on a record whose lock is past its deadline: 2) | 1; none for a conflict with an execution of this process, or a mismatch on a kept answer ([`PgStore::with_replay_cache`]) |
/// | takeover after the lock deadline, retry of a released key, or an expired key reserved afresh (reserve, then complete) | 3 |
///
/// A request that races the very insert that created the row may need one
/// more round trip for its reserve: its lookup predates that row, so it
/// reads it again.
///
/// Completions are written at most three at a time per store (its clones
/// included): those that arrive while three are being written are written
/// next, together, by one statement with one commit, each answered with
/// its own outcome (see docs/PROTOCOL.md, "PostgreSQL's grouped
/// completions"). Under concurrency a first request's completion so shares
/// its round trip and its commit.
/// Reservations' lookups are grouped alike, two at once per store (see
/// docs/PROTOCOL.md, "PostgreSQL's grouped lookups"): under concurrency a
/// lookup, and the insert of a fresh key in it, shares its round trip.
///
/// A store, and the pool it holds, belongs to one Tokio runtime: sqlx's
/// connections are sockets of the runtime that opened them, and work only
/// while it runs. Use it from a multi-thread runtime that lives as long as
/// the server. A reservation made from another runtime than the pool's
/// first (the one a store was built on over open connections, migrated
/// on, or first reserved on) is reported once per pool (a warning). The
/// warning cannot see which runtime opened a pool's connections before a
/// store was built over it (sqlx does not say): a pool connected on a
/// setup runtime, with its store built outside any runtime or on the
/// server's, goes unreported. A runtime shut down while a reservation's statement runs
/// leaves that key as a crash does, locked until its lock timeout (README,
/// "Where idem departs from the contract").
///
/// ```no_run
/// use idem::PgStore;
///
/// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let store = PgStore::connect("postgres://postgres@127.0.0.1/app")?;
/// store.migrate().await?;
/// # Ok(()) }
/// ```
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
#[derive(Clone)]
pub struct PgStore {
    pool: PgPool,
    sql: std::sync::Arc<Statements>,
    /// What every reservation runs first: the record's columns as stored,
    /// judged in Rust, and the reservation function where there is none.
    lookup: std::sync::Arc<str>,
    /// The record judged in SQL, and taken when it may be: for a record
    /// the lookup found but cannot answer from.
    reserve: std::sync::Arc<str>,
    /// Looks up every record of a group: `lookup` for each element of
    /// its binds as arrays, one row each, in the arrays' order.
    lookup_group: std::sync::Arc<str>,
    /// `lookup_group` reading only: each record's row, nothing taken.
    peek_group: std::sync::Arc<str>,
    /// Completes every record of a group: `complete`'s binds as arrays.
    complete_group: std::sync::Arc<str>,
    /// The writes fenced by a lock token that may wait on a record's row,
    /// each bounded on the server by this store's timeout.
    fenced: std::sync::Arc<FencedWrites>,
    /// The completions that wait for the one being written, shared by the
    /// store's clones ([`with_timeout`](Self::with_timeout) and
    /// [`with_table`](Self::with_table) start their own).
    completions: std::sync::Arc<Completions>,
    /// The reservations' lookups that wait for the one being run, shared
    /// like `completions`.
    lookups: std::sync::Arc<Lookups>,
    /// Completed records' answers, kept a moment after a lookup read them,
    /// and this store's running executions
    /// ([`with_replay_cache`](Self::with_replay_cache)): this store's
    /// bound, and a map shared by its clones of the same table.
    replays: sql::replays::Replays,
    timeout: Duration,
    /// Whether every statement takes its connection as the pool lends it,
    /// tested first ([`with_tested_connections`](Self::with_tested_connections)).
    tested: bool,
    /// How many of the store's statements are under way (its clones'
    /// included): one that runs alone takes an idle connection as it is.
    statements: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// The runtime the store's pool was first used on, shared by every
    /// store over that pool: a reservation from another one is reported
    /// once.
    first_runtime: std::sync::Arc<FirstRuntime>,
    /// The completion written in a handler's transaction, shared by the
    /// store's clones.
    #[cfg_attr(not(feature = "axum"), allow(dead_code))]
    in_tx: std::sync::Arc<InTx>,
    /// The connection the lock extensions fall back on, shared by the
    /// store's clones.
    spare: std::sync::Arc<Spare>,
}

/// A connection of the store's own for its lock extensions, taken from the
/// pool and detached from it (the pool may then open another in its
/// place), at the first reservation that finds none: handlers that hold
/// every connection of the pool (each in its transaction) would otherwise
/// leave the extensions of the leases they run under nothing to run on,
/// and a living execution would count as lost, its key taken over by a
/// retry while it still runs. An extension runs on an idle connection of
/// the pool when there is one, else on whichever answers first of this
/// one and one the pool lends (see [`PgStore::run_extension`]); one found
/// gone is replaced at the next reservation. Closed when the pool is.
#[derive(Default)]
struct Spare {
    connection: std::sync::Arc<tokio::sync::Mutex<Option<sqlx::PgConnection>>>,
    /// Whether `connection` holds one (read without its lock, on every
    /// reservation's path).
    held: std::sync::atomic::AtomicBool,
    /// Whether a task closes the spare and the kept connection when the
    /// pool is closed.
    watched: std::sync::atomic::AtomicBool,
    /// The connection the statements that run alone take first (see
    /// [`Kept`]), shared by the store's clones. Never locked across an
    /// `.await`.
    kept: std::sync::Mutex<Option<Kept>>,
}

/// A connection of the store's own for the statements a request waits for
/// when they run alone (a reservation's lookup, a completion written
/// alone): taken from the pool idle and detached from it after the first
/// such statement that ran on it, then kept between statements. A
/// connection the pool takes back is tested first (sqlx pings every
/// connection given back to its pool, a round trip to the database, in a
/// task of its own); one kept by the store is used again as it is, so
/// that a request that runs alone pays no round trip beyond its
/// statements', and the pool's connections stay the application's. Kept
/// only after a statement that ended with the database's answer (its
/// session in step); one found gone runs its statement again on a
/// connection the pool lends, as an idle one found gone does.
struct Kept {
    connection: sqlx::PgConnection,
    /// When it was detached from the pool: kept no longer than the pool
    /// keeps a connection (its `max_lifetime`), counted from then (how
    /// long the pool had it before is not known).
    since: Instant,
    /// When it was last given back: kept idle no longer than the pool
    /// keeps one idle (its `idle_timeout`; closed within half that again
    /// when no statement comes).
    idle_since: Instant,
}

/// The completion a handler's transaction writes, whose search path is the
/// handler's to set (a schema per tenant): with the table named in its
/// schema, so that it finds the table idem's other statements find. With
/// a schema named, `complete`; with none, `complete` with the schema where
/// the pool's search path finds the table, found once (at the first
/// transaction that finds the table there).
#[cfg_attr(not(feature = "axum"), allow(dead_code))]
struct InTx {
    /// The table's own name, when no schema is named.
    unqualified: Option<String>,
    complete: std::sync::OnceLock<std::sync::Arc<str>>,
}

/// The runtime a pool was first used on by a store (a store built over
/// its open connections, a migration, a reservation), and whether a
/// reservation made on another runtime was reported. One per pool: every
/// store over the pool (its clones, [`PgStore::with_table`], another
/// [`PgStore::new`] of a clone of the pool) shares it.
#[derive(Default)]
struct FirstRuntime {
    id: std::sync::OnceLock<tokio::runtime::Id>,
    told: std::sync::atomic::AtomicBool,
}

/// The [`FirstRuntime`] of each pool a store was built over, known by the
/// pool's connect options (one allocation that every clone of the pool
/// shares until `set_connect_options` replaces it: stores built after that
/// are watched apart), held weakly: a pool dropped leaves its entry to be
/// swept.
type Pools = Vec<(
    std::sync::Weak<sqlx::postgres::PgConnectOptions>,
    std::sync::Arc<FirstRuntime>,
)>;
static POOLS: std::sync::Mutex<Pools> = std::sync::Mutex::new(Vec::new());

impl FirstRuntime {
    /// The one of `pool`; the runtime this is called on is its first when
    /// the pool has connections open already (most often that runtime's:
    /// which one opened them is not known).
    fn of(pool: &PgPool) -> std::sync::Arc<FirstRuntime> {
        let options = pool.connect_options();
        let mut pools = POOLS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        pools.retain(|(known, _)| known.strong_count() > 0);
        let first = match pools
            .iter()
            .find(|(known, _)| std::ptr::eq(known.as_ptr(), std::sync::Arc::as_ptr(&options)))
        {
            Some((_, first)) => first.clone(),
            None => {
                let first = std::sync::Arc::<FirstRuntime>::default();
                pools.push((std::sync::Arc::downgrade(&options), first.clone()));
                first
            }
        };
        drop(pools);
        if pool.size() > 0 {
            if let Ok(here) = tokio::runtime::Handle::try_current() {
                let _ = first.id.set(here.id());
            }
        }
        first
    }

    /// Reports, once, a reservation made on another runtime than the first
    /// one: the pool's connections are sockets of the runtime that opened
    /// them, and work only while it runs. Called where the store's future
    /// is polled (a future built outside a runtime and handed to
    /// `block_on` runs on that runtime).
    fn note(&self, table: &str) {
        use std::sync::atomic::Ordering::Relaxed;
        if self.told.load(Relaxed) {
            return;
        }
        let Ok(here) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let here = here.id();
        let first = *self.id.get_or_init(|| here);
        if first != here && !self.told.swap(true, Relaxed) {
            tracing::warn!(
                table,
                first = %first,
                this = %here,
                "a PgStore is used from a second Tokio runtime: its pool's connections belong to the \
                 runtime that opened them, and stall or fail once that runtime is shut down or no longer \
                 driven; a reservation cut that way leaves its key locked until its lock timeout. Use \
                 one store, and one pool, per runtime"
            );
        }
    }
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// What [`PgStore::request_statements`] returns.
#[doc(hidden)]
#[derive(Debug, Clone, Copy)]
pub struct RequestStatements<'a> {
    /// What every reservation runs first: the record's columns as stored
    /// (judged in Rust), and the reservation function only when there is
    /// no record. Binds: tenant, scope, key, fingerprint, token, operation
    /// id, ttl ms, lock ms.
    pub lookup: &'a str,
    /// Reserves a key, judged in SQL: the lookup, and the reservation
    /// function only when the lookup found nothing to answer from. Run
    /// when the first found a record it cannot answer from. Binds: those
    /// of `lookup`.
    pub reserve: &'a str,
    /// Stores an answer. Binds: tenant, scope, key, token, status, headers,
    /// body.
    pub complete: &'a str,
    /// `complete` with its wait for a held row bounded on the server by
    /// the store's timeout: what a completion not written in a group runs
    /// (see docs/PROTOCOL.md, "PostgreSQL's grouped completions"). The
    /// binds of `complete`.
    pub complete_bounded: &'a str,
    /// The lookup alone. Binds: tenant, scope, key, fingerprint.
    pub peek: &'a str,
    /// The writes of a reservation as one plain statement (an insert that
    /// takes over a takeable row on conflict), without the lookup first:
    /// what the SQLite store runs. The same binds as `reserve`.
    pub upsert: &'a str,
}

impl PgStore {
    /// A store over an existing pool, on the table `idempotency_keys` in the
    /// pool's search path.
    ///
    /// ```no_run
    /// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/app").await?;
    /// let store = idem::PgStore::new(pool);
    /// # Ok(()) }
    /// ```
    pub fn new(pool: PgPool) -> Self {
        Self::build(pool, None, sql::DEFAULT_TABLE)
            .unwrap_or_else(|_| unreachable!("default names are valid"))
    }

    /// A store with its own lazily connecting pool: the first operation
    /// connects, and an unreachable server is reported as
    /// [`StoreError::Unavailable`] within the operation timeout.
    ///
    /// # Errors
    ///
    /// [`StoreError::Backend`] when the URL does not parse, or when called
    /// outside a Tokio runtime (the pool needs one for its maintenance task).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let store = idem::PgStore::connect("postgres://postgres@127.0.0.1/app").unwrap();
    /// assert!(idem::PgStore::connect("postgres://127.0.0.1:notaport/app").is_err());
    /// # }
    /// ```
    pub fn connect(url: &str) -> Result<Self, StoreError> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(StoreError::backend(
                "PgStore::connect must be called within a Tokio runtime",
            ));
        }
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .acquire_timeout(DEFAULT_OPERATION_TIMEOUT)
            .connect_lazy(url)
            .map_err(|e| StoreError::backend(format!("invalid PostgreSQL URL: {e}")))?;
        Ok(Self::new(pool))
    }

    /// Uses `table` in `schema` (or in the search path with `None`). With
    /// `None`, `migrate` and `check_schema` refuse a table, migrations table
    /// or function that the search path finds in another schema than the
    /// one new objects go to: it would be another service's.
    ///
    /// # Errors
    ///
    /// [`StoreError::Backend`] for a name that is not a plain identifier,
    /// or a schema that is PostgreSQL's own (`information_schema`, `pg_...`).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// # let store = idem::PgStore::connect("postgres://127.0.0.1/app").unwrap();
    /// let store = store.with_table(Some("billing"), "idem_records").unwrap();
    /// assert!(store.with_table(None, "x; drop table y").is_err());
    /// # }
    /// ```
    pub fn with_table(self, schema: Option<&str>, table: &str) -> Result<Self, StoreError> {
        let built = Self::build(self.pool, schema, table)?
            .with_timeout(self.timeout)
            .with_completion_turns(self.completions.turns);
        // What is known in memory is per table: the same table, named
        // the same, shares it (an execution may be ended through either).
        let replays = self.replays.of_table(&self.sql.table, &built.sql.table);
        Ok(PgStore {
            replays,
            first_runtime: self.first_runtime,
            tested: self.tested,
            statements: self.statements,
            // One spare for the pool's stores of every table: the
            // extensions name their table.
            spare: self.spare,
            ..built
        })
    }

    /// How long a completed record's answer, once a reservation has read
    /// it, is answered from this process's memory (for the store and its
    /// clones): the replays of a retry storm then cost no round trip; and
    /// so are the conflicts with the process's own executions (below).
    /// Default: one second. `Duration::ZERO` reads every replay and every
    /// conflict from the database.
    ///
    /// A completed record does not change until it expires, so a kept
    /// answer is the stored one, byte for byte, and it is never answered
    /// past the record's retention (counted by the database's clock at the
    /// lookup, from before the lookup was sent). What a process cannot see
    /// is a record deleted or edited by hand: each answers its copy for at
    /// most this long. While the database is unreachable, a kept answer
    /// is still replayed (it is the stored one) where a lookup would
    /// answer 503; and a jump forward of the database's clock, or a
    /// suspend of the host (the monotonic clock stops), may let a kept
    /// answer outlive the record's retention by up to this long. At most
    /// 8,192 answers of up to 16 KiB each and 16 MiB in all are kept, each
    /// counted with its body, its headers (48 bytes more each), its
    /// tenant, scope, key and fingerprint, and 160 bytes for the map; an
    /// answer counted past 16 KiB (one a few hundred bytes under it may
    /// be) is always read.
    ///
    /// The same bound covers the store's own executions: from the
    /// reservation that handed an execution its lease until that
    /// execution's first write to the record (its completion, release or
    /// hand-back: dropped before the write is sent), a conflicting request
    /// to this store or its clones is answered from memory, a 409 with the
    /// lock left or a mismatch, for the bound at most and never past the
    /// lock's deadline (counted from before the reservation was sent). A
    /// heartbeat written moves the deadline on; a lookup that finds the
    /// record still in progress under the execution's token confirms it
    /// for the bound again; a heartbeat that fails (or asks for another
    /// lock timeout than the reservation's), or a lookup that finds another
    /// token, drops it. A record in progress freed by hand is answered 409
    /// by this process for up to the bound. The clones made by this method
    /// share what is known with the store (an execution may be ended
    /// through either), each answering for its own bound;
    /// [`with_table`](Self::with_table) shares it for the same table named
    /// the same way only.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// # let store = idem::PgStore::connect("postgres://127.0.0.1/app").unwrap();
    /// // Every replay from the database, for a table edited by hand.
    /// let store = store.with_replay_cache(Duration::ZERO);
    /// # }
    /// ```
    pub fn with_replay_cache(mut self, keep: Duration) -> Self {
        // The same map: an execution reserved through one clone may be
        // ended through another.
        self.replays = self.replays.with_keep(keep);
        self
    }

    /// Bounds every operation (connection included) by `timeout`; past it the
    /// operation fails with [`StoreError::Unavailable`]. Default: 2 seconds.
    /// `Duration::MAX` bounds nothing. The wait for a connection is bounded
    /// by the pool too: a pool [`PgStore::connect`] builds gives up after 2
    /// seconds, so a longer `timeout` waits longer for the database, not for
    /// a connection (build the pool with a longer `acquire_timeout` and use
    /// [`PgStore::new`] for that). A `timeout` shorter than a round trip to
    /// the database (zero, say) fails every request with 503. A write
    /// fenced by a lock token (a completion written alone, a release, a
    /// lease's extension, a checkpoint) that waits for a record's row held
    /// by another transaction is bounded by `timeout` on the database too
    /// (its statement's `lock_timeout`, unless the session's is shorter),
    /// so that it gives its connection back when idem gives up on it.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// # let store = idem::PgStore::connect("postgres://127.0.0.1/app").unwrap();
    /// let store = store.with_timeout(Duration::from_millis(500));
    /// # }
    /// ```
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self.fenced = std::sync::Arc::new(FencedWrites::new(&self.sql, timeout));
        (self.lookup, self.reserve) = reserving_statements(&self.sql, timeout);
        // Its completions and lookups queue apart: a group is bounded by
        // the timeout of the store that runs it.
        self.completions = std::sync::Arc::new(Completions::with_turns(self.completions.turns));
        self.lookups = std::sync::Arc::default();
        self
    }

    /// How many completions (or groups of them) this store writes at once,
    /// its own queue started (for tests that hold every turn with fewer
    /// than the default). At least one.
    #[doc(hidden)]
    pub fn with_completion_turns(mut self, turns: usize) -> Self {
        self.completions = std::sync::Arc::new(Completions::with_turns(turns));
        self
    }

    /// Whether a reservation's statement and a completion always take their
    /// connection as the pool lends any (`true`), or, by default, take an
    /// idle one as it is when no other statement of the store is under way.
    ///
    /// A pool lends a connection after testing it (sqlx's
    /// `test_before_acquire`, on by default: a round trip to the database)
    /// and running its `before_acquire` hook, so that a connection the
    /// database ended while it was idle is replaced before a statement
    /// fails on it. By default the statements a request waits for (the
    /// reservation's lookup and the completion the store writes alone)
    /// skip that round trip when they run alone: they take an idle
    /// connection of the pool as it is (sqlx's `try_acquire`, which neither
    /// tests it nor runs the hook), then keep it for the next such
    /// statement, detached from the pool (which sqlx would test again as
    /// it comes back: see [`Kept`]), and one that turns out gone (an I/O
    /// error, or the database's word that it ended the session: SQLSTATE
    /// class 08 or 57P0x) runs the same statement again, once, on a
    /// connection the pool lends. The pool still tests each connection as
    /// it comes back (sqlx does, off the request's path), so an idle one
    /// answered then. While other statements of the store are under way,
    /// each takes a lent one: those waits are what lets lookups and
    /// completions gather into groups (the benchmark log,
    /// `docs/benchmarks-log.md`, measured 10 to 20% fewer requests a second
    /// at 16 clients without them).
    ///
    /// A statement run again cannot run twice: each is fenced by the
    /// execution's lock token, and where the first try may have been
    /// written (its session ended while it ran), the answer is the one
    /// that try's failure would have given: a reservation that then finds
    /// the key held under its own lock token, or a completion that then
    /// finds its lock gone, fails as unavailable, as without the second
    /// try. Anything else found is answered as it would have been.
    ///
    /// `true` is for a pool whose `before_acquire` (or `after_release`)
    /// hook must run around every statement, idem's included; such a store
    /// keeps no connection of its own. Other statements (heartbeats,
    /// releases, the janitor's) always take a lent connection.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// # let store = idem::PgStore::connect("postgres://127.0.0.1/app").unwrap();
    /// let store = store.with_tested_connections(true);
    /// # }
    /// ```
    pub fn with_tested_connections(mut self, tested: bool) -> Self {
        self.tested = tested;
        self
    }

    /// An idle connection of the pool, taken as it is, for a statement
    /// that runs alone, unless the store takes only tested ones: see
    /// [`with_tested_connections`](Self::with_tested_connections).
    fn idle_connection(&self, under_way: &UnderWay) -> Option<AloneOn> {
        if self.tested || !under_way.alone {
            return None;
        }
        if let Some(kept) = self.take_kept() {
            return Some(AloneOn::Kept(kept));
        }
        self.pool.try_acquire().map(AloneOn::Idle)
    }

    /// The store's kept connection (see [`Kept`]), unless another
    /// statement has it, or it outlived the pool's bounds (then closed).
    fn take_kept(&self) -> Option<Kept> {
        let kept = self.spare.kept.try_lock().ok()?.take()?;
        if kept.outlived(&KeptBounds::of(&self.pool), Instant::now()) {
            close_apart(kept.connection);
            return None;
        }
        Some(kept)
    }

    /// Keeps `on`, the connection a statement that ran alone ended on with
    /// the database's answer, for the next (see [`Kept`]): detached from
    /// the pool if it came from it. Given back instead (to the pool, or
    /// closed if the store's) when the store keeps one already or the pool
    /// is closed.
    fn keep(&self, on: AloneOn) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return on.give_back();
        };
        let Ok(mut kept) = self.spare.kept.lock() else {
            return on.give_back();
        };
        // Under the lock, which the task that closes it takes after the
        // pool is closed: none is kept after that task ran.
        if kept.is_some() || self.pool.is_closed() {
            drop(kept);
            return on.give_back();
        }
        self.watch_close(&runtime);
        let now = Instant::now();
        *kept = Some(match on {
            AloneOn::Kept(k) => Kept { idle_since: now, ..k },
            AloneOn::Idle(pooled) => Kept {
                connection: pooled.detach(),
                since: now,
                idle_since: now,
            },
        });
    }

    /// Starts, once per store and its clones, the task that closes the
    /// spare and the kept connection when the pool is closed, so that the
    /// application's `pool.close()` leaves no connection of the store open.
    fn watch_close(&self, runtime: &tokio::runtime::Handle) {
        use std::sync::atomic::Ordering;
        if self.spare.watched.swap(true, Ordering::AcqRel) {
            return;
        }
        let (close, spare) = (self.pool.close_event(), self.spare.clone());
        let bounds = KeptBounds::of(&self.pool);
        drop(runtime.spawn(async move {
            // Meanwhile, a kept connection left idle past the pool's bounds
            // is closed, as the pool closes its own: checked every half of
            // the shorter bound (at most every 100 ms).
            let mut close = std::pin::pin!(close);
            let every = bounds.sweep_every();
            loop {
                let sweep = async {
                    match every {
                        Some(every) => tokio::time::sleep(every).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    () = &mut close => break,
                    () = sweep => {
                        let now = Instant::now();
                        let outlived = spare.kept.lock().ok().and_then(|mut k| {
                            k.take_if(|k| k.outlived(&bounds, now))
                        });
                        if let Some(kept) = outlived {
                            let _ = sqlx::Connection::close(kept.connection).await;
                        }
                    }
                }
            }
            let kept = spare.kept.lock().ok().and_then(|mut k| k.take());
            if let Some(kept) = kept {
                let _ = sqlx::Connection::close(kept.connection).await;
            }
            let taken = spare.connection.lock().await.take();
            spare.held.store(false, Ordering::Release);
            if let Some(connection) = taken {
                let _ = sqlx::Connection::close(connection).await;
            }
        }));
    }

    /// Counts a statement under way until the guard is dropped, and says
    /// whether it is the only one.
    fn under_way(&self) -> UnderWay {
        let before = self.statements.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        UnderWay {
            statements: self.statements.clone(),
            alone: before == 0,
        }
    }

    /// A connection as the pool lends it: tested, its hooks run.
    async fn lent_connection(&self) -> Result<sqlx::pool::PoolConnection<sqlx::Postgres>, StoreError> {
        self.pool.acquire().await.map_err(sql::map_err)
    }

    /// Takes the store's spare connection for its lock extensions (see
    /// [`Spare`]) when it has none: an idle one of the pool at once, else
    /// the next the pool lends, in a task of its own (the reservation that
    /// finds none never waits for it). Not for a store whose every
    /// statement takes a tested connection, nor outside a runtime.
    fn keep_spare(&self) {
        use std::sync::atomic::Ordering;
        if self.tested || self.spare.held.load(Ordering::Acquire) || self.pool.is_closed() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let Ok(mut held) = self.spare.connection.clone().try_lock_owned() else {
            // Being taken.
            return;
        };
        if held.is_some() {
            return;
        }
        self.watch_close(&runtime);
        if let Some(idle) = self.pool.try_acquire() {
            *held = Some(idle.detach());
            self.spare.held.store(true, Ordering::Release);
            return;
        }
        let (pool, spare, timeout) = (self.pool.clone(), self.spare.clone(), self.timeout);
        // `held` is this task's until it ends: nothing else can take a
        // spare meanwhile.
        drop(runtime.spawn(async move {
            if let Ok(Ok(connection)) = tokio::time::timeout(timeout, pool.acquire()).await {
                if !pool.is_closed() {
                    *held = Some(connection.detach());
                    spare.held.store(true, Ordering::Release);
                }
            }
        }));
    }

    /// A lock extension's statement, built by `statement`: on an idle
    /// connection of the pool, else on whichever answers first of the
    /// store's spare (see [`Spare`]) and a connection the pool lends (a new
    /// one while the pool has room, else the first a handler gives back).
    /// So an extension held up on the spare (its row held by another
    /// transaction, or one given up on still running there) holds up no
    /// other while the pool can lend one; when it cannot, no longer than
    /// an extension on the spare waits for its row
    /// ([`EXTENSION_ROW_WAIT`]). A spare found gone is replaced at the next
    /// reservation, from the pool (a connection made apart from it would
    /// run none of its `after_connect` settings, a role or a search path
    /// among them). A connection found gone is not tried again: the
    /// extension, fenced by its token and setting the deadline from the
    /// database's clock, runs on the next, and one that ran on two (the
    /// spare's given up on) moves the deadline twice.
    async fn run_extension<'q>(
        &self,
        statement: impl Fn(&str) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> Result<sqlx::postgres::PgQueryResult, StoreError> {
        use std::sync::atomic::Ordering;
        let (extend, on_spare) = (&self.fenced.extend, &self.fenced.extend_on_spare);
        if self.tested || self.pool.is_closed() {
            let mut lent = self.lent_connection().await?;
            return statement(extend)
                .execute(&mut *lent)
                .await
                .map_err(sql::map_wait_err);
        }
        if let Some(mut idle) = self.pool.try_acquire() {
            match statement(extend)
                .execute(&mut *idle)
                .await
                .map_err(sql::map_wait_err)
            {
                Err(e) if connection_gone(&e) => {}
                done => return done,
            }
        }
        // `None` when the store has no spare (not taken yet, or found
        // gone: the next reservation takes another from the pool).
        let on_spare = async {
            let mut spare = self.spare.connection.lock().await;
            let connection = spare.as_mut()?;
            match statement(on_spare)
                .execute(&mut *connection)
                .await
                .map_err(sql::map_wait_err)
            {
                Err(e) if connection_gone(&e) => {
                    *spare = None;
                    self.spare.held.store(false, Ordering::Release);
                    None
                }
                done => Some(done),
            }
        };
        let lent = self.lent_connection();
        tokio::select! {
            Some(done) = on_spare => done,
            Ok(mut lent) = lent => statement(extend).execute(&mut *lent).await.map_err(sql::map_wait_err),
            else => Err(StoreError::unavailable(
                "no connection for the lock's extension: the pool lent none, and the store has no spare",
            )),
        }
    }

    /// The statements of a keyed request as this store runs them (binds
    /// `$1`..: see docs/PROTOCOL.md), and the parts the reservation is made
    /// of, for measuring them on the database alone (`bench --pgbench`).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let store = idem::PgStore::connect("postgres://127.0.0.1/app").unwrap();
    /// let s = store.request_statements();
    /// assert!(s.reserve.contains("idempotency_keys_take") && s.complete.starts_with("UPDATE"));
    /// assert!(s.reserve.contains(s.peek) && s.upsert.starts_with("INSERT"));
    /// assert!(s.lookup.contains("idempotency_keys_take") && !s.lookup.contains(s.peek));
    /// assert!(s.complete_bounded.starts_with(s.complete) && s.complete_bounded.contains("lock_timeout"));
    /// # }
    /// ```
    #[doc(hidden)]
    pub fn request_statements(&self) -> RequestStatements<'_> {
        RequestStatements {
            lookup: &self.lookup,
            reserve: &self.reserve,
            complete: &self.sql.complete,
            complete_bounded: &self.fenced.complete,
            peek: &self.sql.peek,
            upsert: &self.sql.take,
        }
    }

    /// The pool, for the application's own queries.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The migrations as this store applies them, every name filled in (the
    /// table, its index, and the reservation function that migration 4
    /// defines), for teams that apply migrations with their own tool; record
    /// each version in `<table>_migrations` so that
    /// [`check_schema`](PgStore::check_schema) agrees. Run them with a bounded
    /// `lock_timeout`, as [`migrate`](PgStore::migrate) does: a migration
    /// waiting for the table's lock holds up every request to the table.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let store = idem::PgStore::connect("postgres://127.0.0.1/app").unwrap();
    /// for (migration, sql) in store.migrations_sql() {
    ///     assert!(!sql.contains("{table}") && !sql.contains("{reserve_function}") && !sql.contains("{take_function}"));
    ///     println!("-- {} {}\n{sql}", migration.version, migration.name);
    /// }
    /// # }
    /// ```
    pub fn migrations_sql(&self) -> impl Iterator<Item = (&sql::Migration, &str)> {
        self.sql.migrations.iter().map(|(m, text)| (m, text.as_str()))
    }

    /// What [`migrate`](PgStore::migrate) runs after the migrations while
    /// the check is there, for teams that apply migrations with their own
    /// tool: it drops the check on `state` that the first schema made
    /// (PostgreSQL rebuilt it in every write), waiting at most half a second
    /// for the table's lock, and leaves it when the lock is not free by then.
    /// Not a schema version (no build needs the check gone): run it after
    /// the migrations, in a transaction of its own (the lock, once taken, is
    /// held until the commit), as often as you like until the check is gone.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let store = idem::PgStore::connect("postgres://127.0.0.1/app").unwrap();
    /// let sql = store.state_check_drop_sql();
    /// assert!(sql.contains("DROP CONSTRAINT") && !sql.contains("{table}"));
    /// # }
    /// ```
    pub fn state_check_drop_sql(&self) -> &str {
        self.sql
            .drop_state_check
            .as_ref()
            .map_or("", |(_, step)| step.as_str())
    }

    fn build(pool: PgPool, schema: Option<&str>, table: &str) -> Result<Self, StoreError> {
        let sql = Statements::new(sql::POSTGRES, POSTGRES_MIGRATIONS, schema, table)?;
        // One round trip that reads first: a record to answer from (a
        // replay, a conflict, a mismatch) is that primary-key lookup and
        // nothing else, because PostgreSQL evaluates a `CASE` branch only
        // when it is taken; the write path (insert a fresh record, or take
        // over a takeable one) runs, in the reservation function, only when
        // the lookup found none. Each part has its own snapshot: a row that
        // another request wrote in between makes the function take nothing
        // (NULL), and the statement runs again.
        //
        // What a reservation runs first. The columns as they are stored,
        // with the database's clock: every expression a statement holds is
        // built again at each execution, and the judging ones cost a replay
        // about a fifth of its time in the database (`bench --pgexec`). A
        // record to answer from is judged in Rust by plain comparisons of
        // those times ([`judge_found`]); any other (to be taken, or edited
        // by hand) goes to `reserve`, which judges it in SQL.
        //
        // `taken` is what the lookup takes where there is no record: the
        // reservation function (`when` guards the call), or nothing.
        let (lookup, reserve) = reserving_statements(&sql, DEFAULT_OPERATION_TIMEOUT);
        // The lookup of a group of records, one per element of the arrays,
        // in the arrays' order (the order of the nested loop that the
        // lateral join is, so that every group takes its fresh keys in the
        // same order), each row numbered by its element. The alias cannot
        // be a table's name, which is a checked identifier.
        let group_of = |lookup: &str| {
            let mut lateral = lookup.to_owned();
            for (n, column) in (1..9).zip(LOOKUP_GROUP_COLUMNS).rev() {
                lateral = lateral.replace(&format!("${n}"), &format!("\"idem-group\".{column}"));
            }
            format!(
                "SELECT l.*, \"idem-group\".i FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], \
                 $5::text[], $6::text[], $7::int8[], $8::int8[]) WITH ORDINALITY AS \"idem-group\" ({columns}, i) \
                 CROSS JOIN LATERAL ({lateral}) AS l ORDER BY \"idem-group\".i",
                columns = LOOKUP_GROUP_COLUMNS.join(", "),
            )
        };
        // A group's inserts wait for locks no longer than `GROUP_LOCK_WAIT`
        // in all, counted from the statement's start: before each call of
        // the function, the lock timeout of the statement's own transaction
        // is set to what is left of it (at least 1 ms: 0 would mean no
        // bound). Past it the group is refused, and each of its lookups
        // runs alone, so that no key's wait (a concurrent insert of it, a
        // `CREATE INDEX` holding the table), nor many short ones, holds up
        // the others.
        let lookup_group = group_of(&lookup_taking(
            &sql,
            &take_when(
                &sql,
                &format!(
                    " AND set_config('lock_timeout', greatest(1, {} - floor(extract(epoch \
             FROM clock_timestamp() - statement_timestamp()) * 1000))::bigint || 'ms', true) IS NOT NULL",
                    GROUP_LOCK_WAIT.as_millis()
                ),
            ),
        ));
        // The same, reading only: nothing is taken.
        let peek_group = group_of(&lookup_taking(&sql, "NULL::text[]"));
        // The completion of a group of records, one per element of the
        // arrays: `complete`, each record fenced by its own token, with the
        // same clock for all, on the rows no other transaction holds
        // (`SKIP LOCKED`: a row held elsewhere never holds up the group).
        // Says by position which it completed; the rest are written alone, by their callers.
        let complete_group = format!(
            "WITH c AS (SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::int4[], \
             $6::text[], $7::bytea[]) WITH ORDINALITY AS c (tenant, scope, key, token, status, headers, body, i)), \
             free AS (SELECT r.tenant, r.scope, r.key FROM {t} AS r JOIN c ON r.tenant = c.tenant \
             AND r.scope = c.scope AND r.key = c.key WHERE r.state = '{in_progress}' AND r.lock_token = c.token \
             FOR UPDATE OF r SKIP LOCKED) \
             UPDATE {t} AS r SET state = '{completed}', lock_token = NULL, response_status = c.status, \
             response_headers = c.headers, response_body = c.body, created_at = statement_timestamp(), \
             expires_at = statement_timestamp() + (date_part('epoch', r.expires_at - r.created_at) * interval '1 second') \
             FROM c WHERE r.tenant = c.tenant AND r.scope = c.scope AND r.key = c.key \
             AND r.state = '{in_progress}' AND r.lock_token = c.token \
             AND (r.tenant, r.scope, r.key) IN (SELECT tenant, scope, key FROM free) RETURNING c.i",
            t = sql.table,
            completed = crate::store::RecordState::COMPLETED_COLUMN,
            in_progress = crate::store::RecordState::IN_PROGRESS_COLUMN,
        );
        let first_runtime = FirstRuntime::of(&pool);
        let in_tx = InTx {
            unqualified: schema.is_none().then(|| table.to_owned()),
            complete: match schema {
                Some(_) => std::sync::OnceLock::from(std::sync::Arc::from(sql.complete.as_str())),
                None => std::sync::OnceLock::new(),
            },
        };
        Ok(PgStore {
            pool,
            fenced: std::sync::Arc::new(FencedWrites::new(&sql, DEFAULT_OPERATION_TIMEOUT)),
            sql: std::sync::Arc::new(sql),
            lookup,
            lookup_group: lookup_group.into(),
            peek_group: peek_group.into(),
            reserve,
            complete_group: complete_group.into(),
            completions: std::sync::Arc::default(),
            lookups: std::sync::Arc::default(),
            replays: sql::replays::Replays::new(DEFAULT_REPLAY_CACHE),
            first_runtime,
            timeout: DEFAULT_OPERATION_TIMEOUT,
            tested: false,
            statements: std::sync::Arc::default(),
            in_tx: std::sync::Arc::new(in_tx),
            spare: std::sync::Arc::default(),
        })
    }

    /// Brings the table to the schema this build needs: applies, under an
    /// advisory lock (several processes may start at once), each migration
    /// not yet recorded in `<table>_migrations`, then checks the table
    /// ([`PgStore::check_schema`]). A table made by an earlier build is
    /// recognised and upgraded.
    ///
    /// A migration that alters the table (or builds an index on it) needs
    /// the table's lock, and every request to the table queues behind a
    /// migration that waits for it: so each of its waits for a lock lasts at
    /// most a quarter of a second past the server's `deadlock_timeout` (1.25
    /// s with PostgreSQL's default; at least half a second, at most two),
    /// less when the session's own `lock_timeout` is shorter, and at most
    /// half its `statement_timeout`. Past `deadlock_timeout`, PostgreSQL
    /// cancels an autovacuum that holds the table, so an upgrade that waits
    /// only for one goes on. One try may wait more than once (an index
    /// build, which holds writes back, then an `ALTER TABLE`), so a request
    /// may wait for more than one of them. When other transactions hold the
    /// lock of the table or of its migrations table longer (or wait for it
    /// ahead of the upgrade), the upgrade is rolled back whole and tried
    /// again after a pause, five times in all over about fifteen seconds;
    /// then `migrate()` gives up, the table as it was. The wait for the
    /// migration lock (another process migrating) is bounded only by the
    /// session's own `lock_timeout` and `statement_timeout`.
    ///
    /// # Errors
    ///
    /// [`StoreError`] when the database is unreachable, refuses the DDL, or
    /// the table does not match afterwards (without a unique key on
    /// (tenant, scope, key), say); [`StoreError::Backend`] when the table
    /// cannot be written (a read-only transaction or replica, a role
    /// without the right), even when nothing was to be done;
    /// [`StoreError::Backend`], before any change, when the database is
    /// not encoded in `UTF8` (or `SQL_ASCII`): another encoding cannot hold
    /// every tenant and checkpoint name;
    /// [`StoreError::Unavailable`] when the table's lock stayed taken
    /// through every try (nothing was changed: run `migrate()` again once
    /// those transactions end).
    ///
    /// ```no_run
    /// # #[tokio::main] async fn main() -> Result<(), idem::StoreError> {
    /// let store = idem::PgStore::connect("postgres://postgres@127.0.0.1/app")?;
    /// store.migrate().await?;
    /// # Ok(()) }
    /// ```
    pub async fn migrate(&self) -> Result<(), StoreError> {
        self.first_runtime.note(&self.sql.table);
        // Before any DDL: a database that cannot hold idem's text is refused
        // as it is, and so is a schema that is missing, or PostgreSQL's
        // own, that the search path would put the table in (`with_table`
        // refuses one named).
        sql::refuse_encoding(&self.pool, &self.sql).await?;
        sql::refuse_schema(&self.pool, &self.sql).await?;
        let mut pauses = MIGRATION_PAUSES.iter();
        loop {
            let mut tx = begin_to_its_answer(&self.pool, None).await?;
            // Errors here, a wait for the migration lock that the session's
            // own `lock_timeout` ended included, are returned as they are.
            // The notices of the migrations' `IF NOT EXISTS` and `IF
            // EXISTS` ("relation ... already exists, skipping"), which sqlx
            // logs, are not sent: warnings are (errors alone, where the
            // session asked for that).
            sqlx::query(
                "SELECT pg_advisory_xact_lock(7319002151), set_config('client_min_messages', \
                 CASE current_setting('client_min_messages') WHEN 'error' THEN 'error' ELSE 'warning' END, true)",
            )
                .execute(&mut *tx)
                .await
                .map_err(sql::map_err)?;
            let bound: String = sqlx::query_scalar(BOUNDED_LOCK_WAIT)
                .fetch_one(&mut *tx)
                .await
                .map_err(sql::map_err)?;
            // From here to the commit, a lock wait that ran out leaves
            // nothing changed (the transaction rolls back whole).
            let upgraded: Result<(), StoreError> = async { sql::migrate_in!(self, tx) }.await;
            match upgraded {
                Err(e) if lock_not_available(&e) => match pauses.next() {
                    Some(pause) => {
                        tracing::warn!(
                            table = %self.sql.table,
                            "other transactions hold the table's lock: the upgrade waits and tries again"
                        );
                        tokio::time::sleep(*pause).await;
                    }
                    None => {
                        return Err(StoreError::unavailable(format!(
                            "the table {} could not be upgraded: other transactions held the lock of the \
                             table or of its migrations table, or waited for it ahead of the upgrade, \
                             through {} tries whose waits for a lock lasted at most {bound} each (over \
                             about fifteen seconds), and requests to the table would have queued behind \
                             a longer wait. Nothing was changed; run migrate() again once those \
                             transactions end (pg_locks and pg_stat_activity show them)",
                            self.sql.table,
                            MIGRATION_PAUSES.len() + 1
                        ))
                        .with_source(e))
                    }
                },
                Err(e) => return Err(e),
                Ok(()) => return self.check_schema().await,
            }
        }
    }

    sql::check_schema!();
}

impl PgStore {
    sql::complete_with!(sqlx::Postgres);

    /// The token-fenced writes, each bounded on the server (see
    /// [`FencedWrites`]).
    fn fenced_writes(&self) -> &FencedWrites {
        &self.fenced
    }

    /// Writes one completion as the plain statement.
    async fn complete_alone(
        &self,
        id: &crate::store::RecordId,
        token: &str,
        response: &crate::store::StoredResponse,
    ) -> Result<(), StoreError> {
        let mut again = None;
        let completed = on_connection!(self, again, |conn| {
            self.complete_with(conn, id, token, response).await
        });
        match (completed, again) {
            // The first try may have been written (its session ended while
            // it ran): whether it was, or another execution took the
            // record over, nobody can tell here. Answered as that try
            // failed, as it would have without the second; the caller's
            // next try tells them apart.
            (Err(StoreError::LockLost), Some(first)) => Err(first),
            (completed, _) => completed,
        }
    }

    /// [`IdempotencyStore::complete`]: written at once when no other
    /// completion of this store is being written; otherwise it waits for
    /// the next group (see [`Completions`]).
    async fn complete_grouped(
        &self,
        id: &crate::store::RecordId,
        token: &str,
        response: &crate::store::StoredResponse,
    ) -> Result<(), StoreError> {
        // On a current-thread runtime, which may stop being driven once its
        // caller has an answer, no task of a group is started: such a
        // completion is written alone, and never queues.
        let multi_thread = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        // A large answer is written alone, as the plain statement: neither
        // the turn nor a group waits for its bytes to go over the wire.
        if !multi_thread || answer_bytes(response) > GROUP_ANSWER_BYTES_MAX {
            return self.complete_alone(id, token, response).await;
        }
        // When this caller's bound (the store's timeout, from the call)
        // runs out: a group it waits in is not written past it.
        let deadline = deadline_after(self.timeout);
        let waiting = {
            let mut queue = self.completions.lock();
            if queue.busy >= self.completions.turns {
                let (answer, answered) = tokio::sync::oneshot::channel();
                queue.waiting.push(Waiting {
                    id: id.clone(),
                    token: token.to_owned(),
                    response: response.clone(),
                    deadline,
                    answer,
                });
                Some(answered)
            } else {
                queue.busy += 1;
                None
            }
        };
        match waiting {
            Some(answered) => match answered.await {
                Ok(Grouped::Written(outcome)) => outcome,
                // Not written by the group: written here, as the plain
                // statement, bounded by this caller's own timeout.
                Ok(Grouped::Alone) => self.complete_alone(id, token, response).await,
                Err(_) => Err(StoreError::unavailable(
                    "the task writing this completion's group ended before writing it",
                )),
            },
            None => {
                // Written as the plain statement, as alone. Whether written,
                // failed, or given up on (a timeout), or still being written
                // after `TURN_HELD_MAX` (a trigger's work, a synchronous
                // standby, its row held by another transaction), the
                // completions that queued meanwhile go on without it.
                let turn = Turn(self);
                pause_point!(crate::pause::COMPLETE_TURN, &id.key);
                holding_at_most_a_turn(turn, self.complete_alone(id, token, response)).await
            }
        }
    }

    /// Passes the completions that queued behind the one just written (or
    /// given up on) to a task that writes them, or frees the turn when
    /// none did. Outside a runtime (which no store call is) they are
    /// answered with an error once no other turn is held.
    fn pass_on(&self) {
        let mut queue = self.completions.lock();
        if queue.waiting.is_empty() {
            queue.free_turn();
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                drop(queue);
                // Made before the task starts, so that a task dropped
                // unstarted (its runtime shutting down) still frees the turn
                // and answers the waiting.
                let writer = GroupWriter {
                    store: self.clone(),
                    done: false,
                };
                runtime.spawn(writer.run());
            }
            Err(_) => {
                queue.abandon_turn();
            }
        }
    }

    /// Writes one group and answers each completion of it: written (with
    /// its outcome), or to be written alone by its caller. A group of one
    /// is written alone, as the plain statement; so is each completion the
    /// group's statement did not complete (its lock lost, or its row held
    /// by another transaction and skipped), and, when the group's statement
    /// fails otherwise than for an unreachable database, every one of the
    /// group, so that one that cannot be written (say, a trigger refuses
    /// it) fails only itself. Written alone by its caller, a completion
    /// waits for its own row only, within its own caller's timeout, and
    /// this task never waits on a row lock.
    async fn write_group(&self, group: Vec<Waiting>) {
        let alone = |group: Vec<Waiting>| {
            for w in group {
                let _ = w.answer.send(Grouped::Alone);
            }
        };
        if group.len() == 1 {
            return alone(group);
        }
        let column = |f: fn(&Waiting) -> &str| group.iter().map(f).collect::<Vec<&str>>();
        // No later than its most pressed member's caller waits: a group
        // given up on is never sent, or (sent) not waited for.
        let deadline = group.iter().map(|w| w.deadline).min();
        let deadline = deadline.unwrap_or_else(|| deadline_after(self.timeout));
        let written = tokio::time::timeout_at(deadline, async {
            let _under_way = self.under_way();
            sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(&*self.complete_group))
                .bind(column(|w| &w.id.tenant))
                .bind(column(|w| &w.id.scope))
                .bind(column(|w| &w.id.key))
                .bind(column(|w| &w.token))
                .bind(
                    group
                        .iter()
                        .map(|w| i32::from(w.response.status))
                        .collect::<Vec<i32>>(),
                )
                .bind(
                    group
                        .iter()
                        .map(|w| w.response.headers_to_json())
                        .collect::<Vec<String>>(),
                )
                .bind(
                    group
                        .iter()
                        .map(|w| w.response.body.as_deref())
                        .collect::<Vec<Option<&[u8]>>>(),
                )
                .fetch_all(&self.pool)
                .await
                .map_err(sql::map_err)
        })
        .await
        .unwrap_or_else(|_| {
            Err(StoreError::unavailable(format!(
                "no answer within {} ms",
                self.timeout.as_millis()
            )))
        });
        match written {
            Ok(completed) => {
                for (i, w) in (1..).zip(group) {
                    let _ = w.answer.send(if completed.contains(&i) {
                        Grouped::Written(Ok(()))
                    } else {
                        Grouped::Alone
                    });
                }
            }
            Err(e) if e.is_unavailable() && !refused_by_its_statement(&e) => {
                for w in group {
                    let _ = w.answer.send(Grouped::Written(Err(e.clone())));
                }
            }
            Err(_) => alone(group),
        }
    }

    /// How many completions wait for the one being written (for tests).
    #[doc(hidden)]
    pub fn waiting_completions(&self) -> usize {
        self.completions.lock().waiting.len()
    }

    /// The execution holding `id` under `token` is about to write to it
    /// (see [`sql::replays::Replays::finish`]).
    #[cfg(feature = "axum")]
    pub(crate) fn finish_running(&self, id: &crate::store::RecordId, token: &str) {
        self.replays.finish(id, token);
    }

    /// The bound on one store operation.
    #[cfg(feature = "axum")]
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Opens a transaction for a handler's own writes, committed together
    /// with the completion; with the transaction, idem's mark in it.
    ///
    /// Within the store's timeout; begun to its answer all the same (see
    /// [`begin_to_its_answer`]). Its first statement after `BEGIN` sets
    /// idem's mark (`SET LOCAL idem.handler` to 128 random bits drawn for
    /// this transaction, in the same round trip), by which the completion
    /// tells that the transaction is still the one begun here (see
    /// `crate::tx`): a value the mark had before, or has outside this
    /// transaction (a handler's `SET` of it for the session), is never
    /// taken for it. It takes no snapshot, so the handler may still set the
    /// transaction's isolation level.
    #[cfg(feature = "axum")]
    pub(crate) async fn begin_tx(
        &self,
    ) -> Result<
        (
            sqlx::Transaction<'static, sqlx::Postgres>,
            crate::fingerprint::HexStr<32>,
        ),
        StoreError,
    > {
        let mark = random_token_inline();
        // Hexadecimal digits only: nothing to quote.
        let begin = format!("BEGIN; SET LOCAL idem.handler = '{}'", mark.as_str());
        crate::sql::bounded(self.timeout, async {
            self.find_the_tables_schema().await?;
            begin_to_its_answer(&self.pool, Some(begin)).await
        })
        .await
        .map(|tx| (tx, mark))
    }

    /// Finds, once, the schema where the pool's search path finds the table
    /// (when the store names none), for the completion written in a
    /// handler's transaction ([`InTx`]). A temporary table of the same name
    /// on the session asked is not it: it is that session's alone, and it
    /// is not where idem's table is. Not found yet (no table), it is looked
    /// for again at the next transaction.
    #[cfg(feature = "axum")]
    async fn find_the_tables_schema(&self) -> Result<(), StoreError> {
        let Some(table) = &self.in_tx.unqualified else {
            return Ok(());
        };
        if self.in_tx.complete.get().is_some() {
            return Ok(());
        }
        // The search path's schemas in its order, as `current_schemas`
        // gives them (pg_catalog left out: idem's table is never there).
        let schema: Option<String> = sqlx::query_scalar(
            "SELECT n.nspname::text FROM unnest(pg_catalog.current_schemas(false)) WITH ORDINALITY AS s (name, i) \
             JOIN pg_catalog.pg_namespace n ON n.nspname = s.name \
             JOIN pg_catalog.pg_class c ON c.relnamespace = n.oid AND c.relname = $1 \
             WHERE n.oid <> pg_catalog.pg_my_temp_schema() AND c.relkind IN ('r', 'p') \
             ORDER BY s.i LIMIT 1",
        )
        .bind(table)
        .fetch_optional(&self.pool)
        .await
        .map_err(sql::map_err)?;
        if let Some(schema) = schema {
            let qualified = format!("\"{}\".\"{table}\"", schema.replace('"', "\"\""));
            let _ = self.in_tx.complete.set(self.sql.complete_on(&qualified).into());
        }
        Ok(())
    }

    /// The completion in a handler's transaction (see [`InTx`]).
    #[cfg(feature = "axum")]
    pub(crate) async fn complete_in_handlers_tx(
        &self,
        tx: &mut sqlx::PgConnection,
        id: &crate::store::RecordId,
        token: &str,
        response: &crate::store::StoredResponse,
    ) -> Result<(), StoreError> {
        let statement = self
            .in_tx
            .complete
            .get()
            .map_or(self.sql.complete.as_str(), |c| &**c);
        // Its wait for the row bounded on the server as the other fenced
        // writes' are: given up on, the `ROLLBACK` after it would wait for
        // its answer, and the connection with it. The setting is the
        // handler's transaction's: the transaction's own is put back once
        // the row is written, so that the commit after it (a deferred
        // trigger's wait, say) is bounded as it was, and may land late.
        let statement = format!(
            "{} RETURNING set_config('lock_timeout', current_setting('idem.kept_lock_timeout'), true)",
            bounded_row_wait(statement, self.timeout, true)
        );
        let completed = self.complete_rows(tx, &statement, id, token, response).await?;
        sql::fenced(completed)
    }
}

/// Runs `$statement` (an expression of `$conn`, a `&mut PgConnection`,
/// that gives a `Result<_, StoreError>`) on an idle connection of `$store`'s
/// pool taken as it is when it runs alone and there is one, else (or when
/// that one turns out gone) on one the pool lends: see
/// [`PgStore::with_tested_connections`]. `$again` (an
/// `Option<StoreError>`) is set to the first try's error when the
/// statement ran again: that try may have been written (its session ended
/// while it ran), which the caller judges. A macro, not a function taking
/// a closure: the future stays `Send` for every lifetime of its borrows.
macro_rules! on_connection {
    ($store:expr, $again:ident, |$conn:ident| $statement:expr) => {
        async {
            let under_way = $store.under_way();
            if let Some(mut alone) = $store.idle_connection(&under_way) {
                let $conn: &mut sqlx::PgConnection = alone.connection();
                match $statement {
                    Err(e) if connection_gone(&e) => {
                        tracing::debug!(error = %e, "an idle connection was gone: the statement runs again on a tested one");
                        $again = Some(e);
                    }
                    done => {
                        // Answered by the database (a row, none, a fenced
                        // write that found its lock gone, or an error of
                        // the statement's own, a lock wait run out say):
                        // its session is in step, and kept for the next.
                        let answered = match &done {
                            Ok(_) | Err(StoreError::LockLost) => true,
                            Err(e) => refused_by_its_statement(e),
                        };
                        if answered {
                            $store.keep(alone);
                        } else {
                            alone.give_back();
                        }
                        return done;
                    }
                }
            }
            let mut lent = $store.lent_connection().await?;
            let $conn: &mut sqlx::PgConnection = &mut lent;
            let done = $statement;
            drop(under_way);
            done
        }
        .await
    };
}
use on_connection;

/// How long the pool keeps a connection, which bounds the kept one too.
#[derive(Clone, Copy)]
struct KeptBounds {
    max_lifetime: Option<Duration>,
    idle_timeout: Option<Duration>,
}

impl KeptBounds {
    fn of(pool: &PgPool) -> Self {
        let options = pool.options();
        KeptBounds {
            max_lifetime: options.get_max_lifetime(),
            idle_timeout: options.get_idle_timeout(),
        }
    }

    /// How often an idle kept connection is checked against the bounds:
    /// half the shorter one, at least 100 ms; never without a bound.
    fn sweep_every(&self) -> Option<Duration> {
        let shorter = match (self.max_lifetime, self.idle_timeout) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => a.or(b)?,
        };
        Some((shorter / 2).max(Duration::from_millis(100)))
    }
}

impl Kept {
    /// Whether it is older than the pool keeps a connection (counted from
    /// when it was kept), or idle longer.
    fn outlived(&self, bounds: &KeptBounds, now: Instant) -> bool {
        let past = |since: Instant, most: Option<Duration>| {
            most.is_some_and(|most| now.saturating_duration_since(since) >= most)
        };
        past(self.since, bounds.max_lifetime) || past(self.idle_since, bounds.idle_timeout)
    }
}

/// The connection a statement that runs alone takes as it is.
enum AloneOn {
    /// The store's own (see [`Kept`]).
    Kept(Kept),
    /// An idle one of the pool.
    Idle(sqlx::pool::PoolConnection<sqlx::Postgres>),
}

impl AloneOn {
    fn connection(&mut self) -> &mut sqlx::PgConnection {
        match self {
            AloneOn::Kept(kept) => &mut kept.connection,
            AloneOn::Idle(pooled) => pooled,
        }
    }

    /// Back to the pool (which tests it first), or closed if the store's.
    fn give_back(self) {
        match self {
            AloneOn::Kept(kept) => close_apart(kept.connection),
            AloneOn::Idle(pooled) => drop(pooled),
        }
    }
}

/// Closes a connection of the store's own (the database is told the
/// session ends) in a task of its own; dropped at once outside a runtime.
fn close_apart(connection: sqlx::PgConnection) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        drop(runtime.spawn(sqlx::Connection::close(connection)));
    }
}

/// A statement of the store under way, counted until this is dropped.
struct UnderWay {
    statements: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// Whether no other statement of the store was under way when it began.
    alone: bool,
}

impl Drop for UnderWay {
    fn drop(&mut self) {
        self.statements.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// Whether PostgreSQL refused the statement itself and the session goes
/// on: an ERROR, whatever its SQLSTATE. A trigger may raise a class that
/// otherwise says the database is out of reach (08, 53) for one row of a
/// group; the group's members then run alone, so that the row fails only
/// its own request. A failure of the connection or of the server (I/O, the
/// pool, the bound run out, a FATAL or PANIC, which ends the session)
/// fails every member of the group, as it would each alone.
fn refused_by_its_statement(e: &StoreError) -> bool {
    driver_error(e)
        .and_then(sqlx::Error::as_database_error)
        .and_then(|db| db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>())
        .is_some_and(|pg| matches!(pg.severity(), sqlx::postgres::PgSeverity::Error))
}

/// The driver's error that `e` came from, if any.
fn driver_error(e: &StoreError) -> Option<&sqlx::Error> {
    let (StoreError::Backend {
        source: Some(source), ..
    }
    | StoreError::Unavailable {
        source: Some(source), ..
    }) = e
    else {
        return None;
    };
    source.downcast_ref::<sqlx::Error>()
}

/// Whether a statement's error says that its connection is gone: an I/O
/// error, or the database's own word that the session ended (SQLSTATE
/// class 08, connection exception; 57P01-57P03, terminated, crashed or
/// shutting down).
fn connection_gone(e: &StoreError) -> bool {
    if !e.is_unavailable() {
        return false;
    }
    match driver_error(e) {
        Some(sqlx::Error::Io(_)) => true,
        Some(sqlx::Error::Database(db)) => db
            .code()
            .is_some_and(|code| code.starts_with("08") || code.starts_with("57P0")),
        _ => false,
    }
}

/// Begins a transaction (with `statement`, or a plain `BEGIN`) on one of
/// `pool`'s connections, in a task of its own that runs to the answer of
/// its `BEGIN` whether or not the caller waits that long. Cut after its `BEGIN` was sent and before the answer
/// came, sqlx's begin would ask no rollback (it counts a level only once
/// answered, and asks the rollback of the level it counted before: none),
/// and the connection would go back to the pool inside a transaction that
/// nobody ends: every later statement on it, reservations and completions
/// included, would run in that transaction and never commit. Given up on,
/// the task drops the transaction once begun, which rolls it back.
async fn begin_to_its_answer(
    pool: &sqlx::PgPool,
    statement: Option<String>,
) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, StoreError> {
    let pool = pool.clone();
    tokio::spawn(async move {
        match statement {
            Some(statement) => pool.begin_with(sqlx::AssertSqlSafe(statement)).await,
            None => pool.begin().await,
        }
    })
    .await
    .map_err(|e| StoreError::unavailable(format!("the begin's task ended: {e}")))?
    .map_err(sql::map_err)
}

/// The completions that arrive while others are being written. A
/// completion is written at once, as the one statement it is, while fewer
/// than [`COMPLETION_TURNS`] are being written; those that arrive meanwhile
/// queue, and when one ends a task writes everything queued by then (up
/// to [`GROUP_MAX`]) as one statement, then again for what queued during
/// that one, until none is left. One commit, one write of the log and one
/// round trip for a group, where each completion paid its own: what a
/// first request's throughput is bound by under concurrency. Nothing is answered before its group's
/// statement has committed; one the group did not write (its row held
/// elsewhere, its lock lost) its caller writes alone. A completion whose
/// caller gave up before its group was taken is not written.
struct Completions {
    queue: std::sync::Mutex<Queue<Waiting>>,
    /// How many completions, or tasks writing groups, may hold a turn.
    turns: usize,
}

impl Default for Completions {
    fn default() -> Self {
        Completions::with_turns(COMPLETION_TURNS)
    }
}

impl Completions {
    fn with_turns(turns: usize) -> Self {
        Completions {
            queue: std::sync::Mutex::default(),
            turns: turns.max(1),
        }
    }

    /// A panic under this lock cannot leave the queue half-changed: each
    /// change is one push, one drain or one assignment.
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue<Waiting>> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A store's queue of completions or of lookups: the turns held, and the
/// calls waiting for the next group.
struct Queue<W> {
    /// How many calls, or tasks running groups, hold a turn.
    busy: usize,
    waiting: Vec<W>,
}

impl<W> Default for Queue<W> {
    fn default() -> Self {
        Queue {
            busy: 0,
            waiting: Vec::new(),
        }
    }
}

impl<W> Queue<W> {
    /// Frees a turn whose holder passed on what waited (or nothing did).
    fn free_turn(&mut self) {
        self.busy = self.busy.saturating_sub(1);
    }

    /// Frees the turn of a holder that cannot pass on what waits (gone
    /// before its end, or outside a runtime): when no other turn is held,
    /// nobody would take the waiting calls, which are dropped, their
    /// callers answered with an error at once; otherwise another holder
    /// takes them when it ends.
    fn abandon_turn(&mut self) {
        self.free_turn();
        if self.busy == 0 {
            self.waiting.clear();
        }
    }
}

/// The most completions one statement writes.
const GROUP_MAX: usize = 64;

/// The most answer bytes (bodies and headers, [`answer_bytes`]) one
/// group's statement carries, and the largest answer that takes the turn
/// or queues: the completions queued behind a statement wait for all of it
/// to be sent and written (a 64 MiB body took 1.5 s here), and PostgreSQL
/// refuses a message over 1 GiB. A group takes completions while their
/// answers fit, and always at least one; a completion with a larger
/// answer is written alone, at once.
const GROUP_ANSWER_BYTES_MAX: usize = 1 << 20;

/// The bytes of an answer's body and of its headers' names and values.
fn answer_bytes(response: &crate::store::StoredResponse) -> usize {
    let headers: usize = response.headers.iter().map(|(n, v)| n.len() + v.len()).sum();
    headers + response.body.as_ref().map_or(0, Vec::len)
}

/// A completion waiting for its group.
struct Waiting {
    id: crate::store::RecordId,
    token: String,
    response: crate::store::StoredResponse,
    /// When its caller stops waiting.
    deadline: tokio::time::Instant,
    answer: tokio::sync::oneshot::Sender<Grouped>,
}

/// What a group tells a completion that waited for it.
enum Grouped {
    /// Written by the group's statement (or failed with it: the database
    /// unreachable), with this outcome.
    Written(Result<(), StoreError>),
    /// Not written by the group: its caller writes it alone.
    Alone,
}

/// The turn of the completion written at once: when it ends, the queue
/// goes on.
struct Turn<'a>(&'a PgStore);

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        self.0.pass_on();
    }
}

/// The task that writes the queued completions, group after group, until
/// none is left. Dropped before that (its runtime shutting down, or a
/// panic), it frees its turn, and when no other turn is held drops the
/// waiting completions, whose callers are answered with an error at once:
/// nothing waits on a task that is gone. (While another turn is held, its
/// holder takes them when it ends.)
struct GroupWriter {
    store: PgStore,
    done: bool,
}

impl GroupWriter {
    async fn run(mut self) {
        loop {
            let group: Vec<Waiting> = {
                let mut queue = self.store.completions.lock();
                let now = tokio::time::Instant::now();
                queue
                    .waiting
                    .retain(|w| !w.answer.is_closed() && w.deadline > now);
                if queue.waiting.is_empty() {
                    queue.free_turn();
                    self.done = true;
                    return;
                }
                let mut bytes = 0;
                let n = queue
                    .waiting
                    .iter()
                    .take(GROUP_MAX)
                    .take_while(|w| {
                        bytes += answer_bytes(&w.response);
                        bytes <= GROUP_ANSWER_BYTES_MAX
                    })
                    .count()
                    .max(1);
                queue.waiting.drain(..n).collect()
            };
            // Not past `TURN_HELD_MAX`: a group still being written then
            // (a trigger's work, a synchronous standby) is left to finish in
            // its task, which answers its members, and the next is written.
            let running = tokio::spawn({
                let store = self.store.clone();
                async move { store.write_group(group).await }
            });
            let _ = tokio::time::timeout(TURN_HELD_MAX, running).await;
        }
    }
}

impl Drop for GroupWriter {
    fn drop(&mut self) {
        if !self.done {
            let mut queue = self.store.completions.lock();
            queue.abandon_turn();
        }
    }
}

/// The reservations' lookups that arrive while others are being run, as
/// [`Completions`] are for completions: a lookup is sent at once, as the
/// one statement it is, while fewer than [`LOOKUP_TURNS`] are being run;
/// those that arrive meanwhile queue, and when one is answered a task runs everything
/// queued by then (up to [`GROUP_MAX`], one per record) as one statement,
/// then again for what queued during that one, until none is left. A
/// fresh key's record is inserted by that statement, so a group of first
/// requests shares one round trip and one commit, where each paid its own.
/// Each lookup is answered with its own row, judged by its own caller as a
/// lookup sent alone is; a group's statement that the database refuses
/// (it rolled back whole) is run again alone by each of its callers. A
/// group's statement runs to its answer in a task of its own, never
/// cancelled (it may insert records); once its most pressed caller has
/// given up, or [`TURN_HELD_MAX`] has passed, the queue goes on without
/// it, as it does past a lookup sent alone that still runs by then. A
/// group's inserts wait for locks [`GROUP_LOCK_WAIT`] in all at most. A
/// record a group took for a caller that is gone is handed back.
#[derive(Default)]
struct Lookups {
    queue: std::sync::Mutex<Queue<LookupWaiting>>,
}

impl Lookups {
    /// A panic under this lock cannot leave the queue half-changed: each
    /// change is one push, one drain or one assignment.
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue<LookupWaiting>> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A lookup waiting for its group: the binds of `lookup`.
struct LookupWaiting {
    binds: LookupBinds,
    /// When its caller stops waiting.
    deadline: tokio::time::Instant,
    answer: tokio::sync::oneshot::Sender<LookedUp>,
}

/// A lookup's binds.
struct LookupBinds {
    id: crate::store::RecordId,
    fingerprint: String,
    token: String,
    operation_id: String,
    ttl_ms: i64,
    lock_ms: i64,
}

/// What a group tells a lookup that waited for it.
enum LookedUp {
    /// The lookup's row, as the lookup alone returns it.
    Row(sqlx::postgres::PgRow),
    /// The group's statement failed, its outcome unknown (the database
    /// unreachable), or the caller's time ran out before it was sent.
    Failed(StoreError),
    /// Not run by a group: its caller sends the lookup alone.
    Alone,
}

/// The turn of the lookup sent at once: when it ends, the queue goes on.
struct LookupTurn<'a>(&'a PgStore);

impl Drop for LookupTurn<'_> {
    fn drop(&mut self) {
        self.0.pass_on_lookups();
    }
}

/// The task that runs the queued lookups, group after group, until none is
/// left, holding the turn of the lookup that started it. Dropped before
/// that (its runtime shutting down, or a panic), it frees its turn, and
/// when no other turn is held drops the waiting lookups, whose callers are
/// answered with an error at once.
struct GroupReader {
    store: PgStore,
    done: bool,
}

impl GroupReader {
    async fn run(mut self) {
        loop {
            let group: Vec<LookupWaiting> = {
                let mut queue = self.store.lookups.lock();
                let now = tokio::time::Instant::now();
                let (late, waiting): (Vec<_>, Vec<_>) = queue
                    .waiting
                    .drain(..)
                    .filter(|w| !w.answer.is_closed())
                    .partition(|w| w.deadline <= now);
                let mut group: Vec<LookupWaiting> = Vec::new();
                for w in waiting {
                    // One lookup of a record a group: the next waits for
                    // the next group, and finds the record this one wrote.
                    if group.len() < GROUP_MAX && !group.iter().any(|g| g.binds.id == w.binds.id) {
                        group.push(w);
                    } else {
                        queue.waiting.push(w);
                    }
                }
                if group.is_empty() {
                    queue.free_turn();
                    self.done = true;
                }
                drop(queue);
                for w in late {
                    let _ = w.answer.send(LookedUp::Failed(StoreError::unavailable(format!(
                        "no answer within {} ms",
                        self.store.timeout.as_millis()
                    ))));
                }
                if self.done {
                    return;
                }
                group
            };
            // No later than its most pressed member's caller waits, nor
            // past `TURN_HELD_MAX`; given up on, the statement still runs
            // to its answer in its task.
            let deadline = group.iter().map(|w| w.deadline).min();
            let deadline = deadline.unwrap_or_else(|| deadline_after(self.store.timeout));
            let deadline = deadline.min(tokio::time::Instant::now() + TURN_HELD_MAX);
            let running = tokio::spawn(self.store.clone().read_group(group));
            let _ = tokio::time::timeout_at(deadline, running).await;
        }
    }
}

impl Drop for GroupReader {
    fn drop(&mut self) {
        if !self.done {
            let mut queue = self.store.lookups.lock();
            queue.abandon_turn();
        }
    }
}

impl PgStore {
    /// A reservation's lookup: sent at once while a turn is free; otherwise
    /// it waits for the next group (see [`Lookups`]).
    async fn look_up(
        &self,
        req: &ReserveRequest<'_>,
        operation_id: &str,
    ) -> Result<sqlx::postgres::PgRow, StoreError> {
        // On a current-thread runtime, which may stop being driven once its
        // caller has an answer, no task of a group is started: such a
        // lookup is sent alone, and never queues.
        let multi_thread = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        // `Some` while this lookup holds a turn, `None` when it is sent alone.
        let turn = if multi_thread {
            let waiting = {
                let mut queue = self.lookups.lock();
                if queue.busy >= LOOKUP_TURNS {
                    let (answer, answered) = tokio::sync::oneshot::channel();
                    queue.waiting.push(LookupWaiting {
                        binds: LookupBinds {
                            id: req.id.clone(),
                            fingerprint: req.fingerprint.to_owned(),
                            token: req.token.to_owned(),
                            operation_id: operation_id.to_owned(),
                            ttl_ms: millis(req.ttl),
                            lock_ms: millis(req.lock_timeout),
                        },
                        deadline: deadline_after(self.timeout),
                        answer,
                    });
                    Some(answered)
                } else {
                    queue.busy += 1;
                    None
                }
            };
            match waiting {
                Some(answered) => match answered.await {
                    Ok(LookedUp::Row(row)) => return Ok(row),
                    Ok(LookedUp::Failed(e)) => return Err(e),
                    Ok(LookedUp::Alone) => None,
                    // Its group may have been sent: not known to have taken
                    // nothing (the caller hands the key back, fenced by its token).
                    Err(_) => {
                        return Err(StoreError::unavailable(
                            "the task running this reservation's group ended before answering it",
                        ))
                    }
                },
                None => Some(LookupTurn(self)),
            }
        } else {
            None
        };
        // The statement's future is built in this one place: it is several
        // kilobytes, and each place that awaited one would add them to this
        // future's size, which the reservation's own future carries.
        let running = std::pin::pin!(self.run_reserving(&self.lookup, req, operation_id));
        let Some(turn) = turn else {
            return running.await;
        };
        // Whether answered, failed, given up on, or still waiting after
        // `TURN_HELD_MAX`, the lookups that queued meanwhile go on without
        // it.
        pause_point!(crate::pause::RESERVE_TURN, &req.id.key);
        holding_at_most_a_turn(turn, running).await
    }

    /// Passes the lookups that queued behind the one just run (or given up
    /// on) to a task that runs them, or frees the turn when none did.
    /// Outside a runtime (which no store call is) they are answered with
    /// an error.
    fn pass_on_lookups(&self) {
        let mut queue = self.lookups.lock();
        if queue.waiting.is_empty() {
            queue.free_turn();
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                drop(queue);
                // Made before the task starts, so that a task dropped
                // unstarted still frees the turn and answers the waiting.
                let reader = GroupReader {
                    store: self.clone(),
                    done: false,
                };
                runtime.spawn(reader.run());
            }
            Err(_) => {
                queue.abandon_turn();
            }
        }
    }

    /// Runs one group's lookups as one statement and answers each with its
    /// row. A group of one is sent alone by its caller, as the plain
    /// statement; so is every one of a group whose statement the database
    /// refused (rolled back whole: say, a trigger refused one record, or
    /// PostgreSQL ended a deadlock with it). A statement still running
    /// after [`TURN_HELD_MAX`] does not hold up the group's records that
    /// exist: they are read apart, and each that the lookup alone would
    /// answer from is answered then. A record taken for a caller that is
    /// answered already or gone is handed back.
    async fn read_group(self, mut group: Vec<LookupWaiting>) {
        // Under way (`Idem::idle`) to its end: a key it hands back for a
        // lookup answered already is given back after that lookup's
        // request ended, and a process that exited at `idle` before then
        // left the key locked until its lock timeout.
        let _under_way = crate::store::background_work().enter();
        if group.len() == 1 {
            for w in group {
                let _ = w.answer.send(LookedUp::Alone);
            }
            return;
        }
        // In the same order in every group, so that two groups (of two
        // processes) inserting the same fresh keys wait for each other's
        // in one order, never for each other.
        group.sort_by(|a, b| {
            let (a, b) = (&a.binds.id, &b.binds.id);
            (&a.tenant, &a.scope, &a.key).cmp(&(&b.tenant, &b.scope, &b.key))
        });
        let (binds, answers): (Vec<LookupBinds>, Vec<_>) =
            group.into_iter().map(|w| (w.binds, w.answer)).unzip();
        let binds = std::sync::Arc::new(binds);
        let mut answers: Vec<Option<tokio::sync::oneshot::Sender<LookedUp>>> =
            answers.into_iter().map(Some).collect();
        // In a task of its own, so that a slow statement is not waited for
        // to answer the records that exist.
        let mut statement = tokio::spawn({
            let (store, binds) = (self.clone(), binds.clone());
            async move { store.run_group(&store.lookup_group, &binds).await }
        });
        let read = match tokio::time::timeout(TURN_HELD_MAX, &mut statement).await {
            Ok(read) => read,
            Err(_) => {
                // Still running (an insert that waits for what no lock
                // timeout bounds: a trigger's work, a stalled disk, a
                // synchronous standby): the records that exist are read
                // apart, and each that the lookup alone would answer from
                // (a replay, a conflict, a mismatch) is answered then;
                // whichever answers first, the read or the statement. One
                // that the statement takes all the same is handed back below.
                let mut peek = std::pin::pin!(self.run_group(&self.peek_group, &binds));
                let peeked = tokio::select! {
                    biased;
                    read = &mut statement => Err(read),
                    peeked = &mut peek => Ok(peeked),
                };
                match peeked {
                    Err(read) => read,
                    Ok(peeked) => {
                        if let (Ok(peeked), false) = (peeked, statement.is_finished()) {
                            answer_read_apart(&binds, &mut answers, peeked);
                        }
                        (&mut statement).await
                    }
                }
            }
        };
        let read = read.unwrap_or_else(|e| {
            Err(StoreError::unavailable(format!(
                "the task running a group's lookups ended: {e}"
            )))
        });
        let mut rows = match read {
            Ok(rows) => rows,
            Err(e) => {
                let unavailable = e.is_unavailable() && !refused_by_its_statement(&e);
                let mut gone = Vec::new();
                for (b, answer) in binds.iter().zip(answers) {
                    // Sent to its caller, which then hands the key back
                    // (a failure) or runs alone (a statement refused, which
                    // took nothing).
                    let told = answer.is_some_and(|answer| {
                        answer
                            .send(if unavailable {
                                LookedUp::Failed(e.clone())
                            } else {
                                LookedUp::Alone
                            })
                            .is_ok()
                    });
                    // Answered already, or its caller gone: the statement
                    // may have taken its key (its outcome is not known), so
                    // it is handed back here, fenced by its token, as it
                    // was found not known.
                    if !told && unavailable {
                        gone.push((b, true));
                    }
                }
                return self.hand_back_all(gone).await;
            }
        };
        let mut gone = Vec::new();
        for (i, (b, answer)) in (1_i64..).zip(binds.iter().zip(answers)) {
            let Some(row) = row_numbered(&mut rows, i) else {
                if let Some(answer) = answer {
                    let _ = answer.send(LookedUp::Failed(StoreError::backend(
                        "the group's lookup returned no row for this record",
                    )));
                }
                continue;
            };
            // Answered already, or its caller gone: a key taken for it is
            // given back.
            let unsent = match answer {
                Some(answer) => match answer.send(LookedUp::Row(row)) {
                    Ok(()) => continue,
                    Err(LookedUp::Row(row)) => row,
                    Err(_) => continue,
                },
                None => row,
            };
            let taken: Option<Vec<Option<String>>> = sqlx::Row::try_get(&unsent, 8).ok().flatten();
            if let Some(lease) = taken.and_then(|t| lease_from_taken(&t, &b.token)) {
                gone.push((b, lease.is_takeover()));
            }
        }
        self.hand_back_all(gone).await;
    }

    /// Hands back each key a group took for a lookup that is answered
    /// already or gone, fenced by its token.
    async fn hand_back_all(&self, gone: Vec<(&LookupBinds, bool)>) {
        for (b, taken_over) in gone {
            let until = deadline_after(self.timeout);
            let _ = crate::store::retry_until(until, || self.hand_back(&b.id, &b.token, taken_over)).await;
        }
    }

    /// Runs `statement`, [`Self::peek_group`]'s or [`Self::lookup_group`]'s,
    /// with the binds of `group`'s lookups as arrays, in their order.
    async fn run_group(
        &self,
        statement: &str,
        group: &[LookupBinds],
    ) -> Result<Vec<sqlx::postgres::PgRow>, StoreError> {
        let _under_way = self.under_way();
        let texts = |f: fn(&LookupBinds) -> &str| group.iter().map(f).collect::<Vec<&str>>();
        sqlx::query(sqlx::AssertSqlSafe(statement))
            .bind(texts(|w| w.id.tenant.as_str()))
            .bind(texts(|w| &w.id.scope))
            .bind(texts(|w| &w.id.key))
            .bind(texts(|w| &w.fingerprint))
            .bind(texts(|w| &w.token))
            .bind(texts(|w| &w.operation_id))
            .bind(group.iter().map(|w| w.ttl_ms).collect::<Vec<i64>>())
            .bind(group.iter().map(|w| w.lock_ms).collect::<Vec<i64>>())
            .fetch_all(&self.pool)
            .await
            .map_err(sql::map_err)
    }

    /// How many reservations wait for the lookup being run (for tests).
    #[doc(hidden)]
    pub fn waiting_lookups(&self) -> usize {
        self.lookups.lock().waiting.len()
    }
}

/// Answers each lookup of a group, still unanswered, whose record the read
/// apart (`peeked`, [`PgStore::peek_group`]'s rows) shows it would answer
/// from alone: a replay, a conflict, a mismatch. A record under the lookup's
/// own token is the one the group's statement took for it: its answer is
/// the statement's.
fn answer_read_apart(
    binds: &[LookupBinds],
    answers: &mut [Option<tokio::sync::oneshot::Sender<LookedUp>>],
    mut peeked: Vec<sqlx::postgres::PgRow>,
) {
    for (i, (b, answer)) in (1_i64..).zip(binds.iter().zip(answers.iter_mut())) {
        let Some(row) = row_numbered(&mut peeked, i) else {
            continue;
        };
        let token: Option<String> = sqlx::Row::try_get(&row, 9).ok().flatten();
        if token.as_deref() == Some(b.token.as_str()) {
            continue;
        }
        if matches!(judge_found(&row, &b.fingerprint), Ok(Some(_))) {
            if let Some(answer) = answer.take() {
                let _ = answer.send(LookedUp::Row(row));
            }
        }
    }
}

/// The row of a group's statement numbered `i` (by its element of the
/// arrays), taken out of `rows`.
fn row_numbered(rows: &mut Vec<sqlx::postgres::PgRow>, i: i64) -> Option<sqlx::postgres::PgRow> {
    let at = rows
        .iter()
        .position(|row| sqlx::Row::try_get::<i64, _>(row, LOOKUP_COLUMNS.len()).ok() == Some(i))?;
    Some(rows.swap_remove(at))
}

impl IdempotencyStore for PgStore {
    fn reserve<'a>(&'a self, req: ReserveRequest<'a>) -> BoxFuture<'a, Result<Reservation, StoreError>> {
        if let Some(kept) = self.replays.find(req.id, req.fingerprint) {
            return Box::pin(async move {
                pause_point!(crate::pause::RESERVE_AFTER, &req.id.key);
                Ok(kept)
            });
        }
        // Before anything is sent: the lock of a key taken is counted from here.
        let sent = std::time::Instant::now();
        self.keep_spare();
        Box::pin(async move {
            self.first_runtime.note(&self.sql.table);
            // On the caller's runtime: the pool's connections are registered
            // with the runtime that opened them.
            let reserved = sql::reserve_detached(self, self.timeout, req, |store, req| {
                Box::pin(async move { store.reserve_once(req.request()).await })
            })
            .await?;
            // Known only once its caller has it: a reservation whose caller
            // gave up on it is handed back, and never known here.
            if let Reservation::Reserved(lease) = &reserved {
                self.replays
                    .run(req.id, req.fingerprint, &lease.token, sent, req.lock_timeout);
            }
            Ok(reserved)
        })
    }

    sql::fenced_ops!();
}

impl PgStore {
    /// One reservation, as long as it takes: [`sql::reserve_detached`] bounds it.
    async fn reserve_once(&self, req: ReserveRequest<'_>) -> Result<Reservation, StoreError> {
        // Bound only where the record is new; kept inline, so that a
        // replay allocates nothing for it.
        let operation_id = random_token_inline();
        let get_err = |e: sqlx::Error| StoreError::backend(e.to_string());
        // Before the lookup is sent: a kept answer's time is counted from here.
        let sent = std::time::Instant::now();
        // First the lookup: a record to answer from is judged here, and a
        // fresh key is taken by the function in the same round trip.
        let row = self.look_up(&req, operation_id.as_str()).await?;
        debug_assert!(sql::columns_are(&row, 0, &LOOKUP_COLUMNS));
        let taken: Option<Vec<Option<String>>> = sqlx::Row::try_get(&row, 8).map_err(get_err)?;
        if let Some(taken) = taken {
            return self.taken(&taken, &req).await;
        }
        if let Some((answer, left)) = judge_found(&row, req.fingerprint)? {
            match (&answer, left) {
                (Reservation::Completed(stored), Holds::Retention(left)) => {
                    self.replays
                        .keep_answer(req.id, req.fingerprint, stored, sent, left);
                }
                // In progress (a conflict, or a mismatch with it): what
                // this process knows of its own execution of it is
                // confirmed, or dropped if another holds it now.
                (_, Holds::Lock) => {
                    let token: Option<&str> = sqlx::Row::try_get(&row, 9).ok().flatten();
                    self.replays.found_running(req.id, token, sent);
                }
                _ => {}
            }
            pause_point!(crate::pause::RESERVE_AFTER, &req.id.key);
            return Ok(answer);
        }
        // A record that may be taken, one edited by hand, or one written
        // since the lookup found none: judged, and taken, in SQL.
        loop {
            let row = self
                .run_reserving(&self.reserve, &req, operation_id.as_str())
                .await?;
            // By position (see `JUDGED_COLUMNS` in sql/run.rs): `takeable`, then `taken`.
            debug_assert!(sql::columns_are(&row, 6, &["takeable", "taken"]));
            let taken: Option<Vec<Option<String>>> = sqlx::Row::try_get(&row, 7).map_err(get_err)?;
            if let Some(taken) = taken {
                return self.taken(&taken, &req).await;
            }
            // Nothing to answer from, and nothing taken: another request
            // wrote the record between the lookup and the write path; read
            // again.
            let takeable: Option<i32> = sqlx::Row::try_get(&row, 6).map_err(get_err)?;
            if takeable != Some(0) {
                continue;
            }
            pause_point!(crate::pause::RESERVE_AFTER, &req.id.key);
            return sql::judge_row(&row, req.fingerprint);
        }
    }

    /// Runs `statement`, the lookup or the reserving statement (the same
    /// binds), and returns its one row.
    async fn run_reserving(
        &self,
        statement: &std::sync::Arc<str>,
        req: &ReserveRequest<'_>,
        operation_id: &str,
    ) -> Result<sqlx::postgres::PgRow, StoreError> {
        let mut again = None;
        let row = on_connection!(self, again, |conn| {
            match reserving_arguments(req, operation_id) {
                Ok(args) => sqlx::query_with(sqlx::AssertSqlSafe(statement.clone()), args)
                    // Not `fetch_one`: it wraps this future in another, and
                    // moves sqlx's (several kB) twice more on every call.
                    .fetch_optional(&mut *conn)
                    .await
                    // Its wait for a lock bounded (`reserving_statements`):
                    // run out, the store did not answer in time.
                    .map_err(sql::map_wait_err),
                Err(e) => Err(e),
            }
        })?
        .ok_or_else(|| StoreError::backend("the reserving statement returned no row"))?;
        match again {
            // Run again after a first try whose session ended: a record
            // that try may have taken (its answer lost) is answered as that
            // try failed, as it would have without the second: the caller
            // hands the key back, fenced by its token, and the client's
            // retry runs. Anything else is judged as found.
            Some(first) if may_be_first_tries(&row, req) => Err(first),
            _ => Ok(row),
        }
    }

    /// The lease of a key the reservation function took.
    async fn taken(
        &self,
        taken: &[Option<String>],
        req: &ReserveRequest<'_>,
    ) -> Result<Reservation, StoreError> {
        let Some(lease) = lease_from_taken(taken, req.token) else {
            // Taken, but unreadable: give the key back (fenced by our
            // token) rather than leave a lock nobody holds; how it was
            // found is not known.
            let _ = self.hand_back(req.id, req.token, true).await;
            return Err(StoreError::backend(format!(
                "the reservation function returned {taken:?}, not a lease"
            )));
        };
        pause_point!(crate::pause::RESERVE_AFTER, &req.id.key);
        Ok(Reservation::Reserved(lease))
    }
}

/// Whether the record the lookup's or the reserving statement's `row`
/// found (and did not take) may be the one an earlier try of `req` took:
/// held under `req`'s token, as the lookup's row says; the reserving
/// statement's, which does not name the holder, a live lock under `req`'s
/// fingerprint. A record released, a lock past its deadline, another
/// fingerprint or another holder is not.
fn may_be_first_tries(row: &sqlx::postgres::PgRow, req: &ReserveRequest<'_>) -> bool {
    let taken: Option<Vec<Option<String>>> = sqlx::Row::try_get(row, "taken").ok().flatten();
    let state: Option<&str> = sqlx::Row::try_get(row, "state").ok().flatten();
    if taken.is_some() || state != Some(crate::store::RecordState::IN_PROGRESS_COLUMN) {
        return false;
    }
    match sqlx::Row::try_get::<Option<&str>, _>(row, "lock_token") {
        Ok(holder) => holder == Some(req.token),
        Err(_) => {
            let fingerprint: Option<&str> = sqlx::Row::try_get(row, "fingerprint").ok().flatten();
            let lock_left: i64 = sqlx::Row::try_get(row, "lock_left_ms").unwrap_or(0);
            fingerprint == Some(req.fingerprint) && lock_left > 0
        }
    }
}

/// The binds of the lookup and of the reserving statement, in their
/// order: tenant, scope, key, fingerprint, token, operation id, ttl ms,
/// lock ms.
fn reserving_arguments(
    req: &ReserveRequest<'_>,
    operation_id: &str,
) -> Result<sqlx::postgres::PgArguments, StoreError> {
    use sqlx::Arguments as _;
    let texts = [
        req.id.tenant.as_str(),
        &req.id.scope,
        &req.id.key,
        req.fingerprint,
        req.token,
        operation_id,
    ];
    // The six texts, then two `int8`s.
    let mut args =
        sql::sized_arguments::<sqlx::Postgres>(8, texts.iter().map(|t| t.len()).sum::<usize>() + 16);
    for text in texts {
        args.add(text).map_err(|e| sql::encode_err(args.len() + 1, e))?;
    }
    args.add(millis(req.ttl))
        .map_err(|e| sql::encode_err(args.len() + 1, e))?;
    args.add(millis(req.lock_timeout))
        .map_err(|e| sql::encode_err(args.len() + 1, e))?;
    Ok(args)
}

/// The pauses between the tries of an upgrade that could not take the
/// table's lock.
const MIGRATION_PAUSES: [Duration; 4] = [
    Duration::from_millis(500),
    Duration::from_secs(1),
    Duration::from_secs(2),
    Duration::from_secs(4),
];

/// Bounds, for the rest of the migration's transaction, how long a
/// statement waits for a lock, and returns the bound: a quarter of a
/// second past the server's `deadlock_timeout` (when PostgreSQL checks the
/// wait, and cancels an autovacuum in the way), at least half a second
/// and at most two; or the session's own `lock_timeout` when shorter; and
/// at most half its `statement_timeout` (which would cancel the statement,
/// a wait for a lock included).
const BOUNDED_LOCK_WAIT: &str = "SELECT set_config('lock_timeout', greatest(1, round(extract(epoch FROM \
    least(greatest(interval '500 ms', \
    least(current_setting('deadlock_timeout')::interval + interval '250 ms', interval '2 s')), \
    CASE WHEN current_setting('lock_timeout') <> '0' THEN current_setting('lock_timeout')::interval END, \
    CASE WHEN current_setting('statement_timeout') <> '0' \
    THEN current_setting('statement_timeout')::interval / 2 END)) * 1000))::bigint || 'ms', true)";

/// The writes fenced by a lock token that may wait on a record's row held
/// by another transaction (an operator's, a takeover's), each bounded on
/// the server by the store's timeout: a wait given up on at the timeout
/// would otherwise end on idem's side alone, the statement waiting on for
/// the row with its connection, one for each try of a completion and of a
/// release, until the pool was used up and other keys' completions failed
/// too. At the bound the statement fails (`lock_not_available`) and gives
/// its connection back; a shorter `lock_timeout` of the session's stands.
/// The statement's own transaction's setting: it goes with the statement.
/// A completion that takes the turn waits for its row as one written
/// alone, holding the turn at most `TURN_HELD_MAX`; a group's never waits.
pub(crate) struct FencedWrites {
    pub(crate) release: String,
    pub(crate) reject: String,
    pub(crate) checkpoint: String,
    pub(crate) extend: String,
    /// `extend` on the store's spare connection, whose wait for a row is
    /// bounded by [`EXTENSION_ROW_WAIT`].
    pub(crate) extend_on_spare: String,
    /// The completion written alone.
    pub(crate) complete: String,
}

/// `statement`, a fenced write ending in its `WHERE`, with its wait for a
/// row bounded by `wait` on the server (see [`FencedWrites`]); `kept`: the
/// transaction's own `lock_timeout` first kept in `idem.kept_lock_timeout`
/// (empty outside the statement's transaction), for the statement to put
/// back (its `RETURNING`).
fn bounded_row_wait(statement: &str, wait: Duration, kept: bool) -> String {
    // Kept once: a row that another transaction updated while the
    // statement waited for it is judged again (its `WHERE` evaluated anew,
    // the bound set by then), and must not keep the bound for the own.
    let keep = if kept {
        "set_config('idem.kept_lock_timeout', CASE WHEN coalesce(current_setting('idem.kept_lock_timeout', true), \
         '') = '' THEN current_setting('lock_timeout') ELSE current_setting('idem.kept_lock_timeout', true) END, \
         true) IS NOT NULL AND "
    } else {
        ""
    };
    format!("{statement} AND {}", lock_timeout_at_most(wait, keep))
}

/// A condition, always true, that bounds the lock waits of the rest of the
/// statement's transaction by `wait`: the transaction's own `lock_timeout`
/// where it is shorter, after `keep` (a condition that keeps it, or none).
fn lock_timeout_at_most(wait: Duration, keep: &str) -> String {
    let ms = wait.as_millis().clamp(1, i32::MAX as u128);
    format!(
        "set_config('lock_timeout', CASE WHEN {keep}current_setting('lock_timeout') <> '0' \
         AND current_setting('lock_timeout')::interval < interval '{ms} ms' \
         THEN current_setting('lock_timeout') ELSE '{ms}ms' END, true) IS NOT NULL"
    )
}

/// The lookup, with the reservation function where the lookup finds no
/// record, and the reserving statement, which judges a record in SQL and
/// takes it when it may be: the statements of a reservation run alone.
/// Each bounds its wait for a lock (a row another transaction holds, or a
/// key it inserted and has not committed) by `wait`, the store's timeout,
/// on the server, as the fenced writes do (see [`FencedWrites`]): given up
/// on at the timeout on idem's side only, each such statement kept a
/// connection of the pool, waiting on, until the lock was let go, and a
/// few retries of one key then used the pool up and failed other keys'
/// completions. The bound is set only where the function is called: a
/// replay or a conflict, read, sets nothing.
fn reserving_statements(sql: &Statements, wait: Duration) -> (std::sync::Arc<str>, std::sync::Arc<str>) {
    let bound = lock_timeout_at_most(wait, "");
    let lookup = lookup_taking(sql, &take_when(sql, &format!(" AND {bound}")));
    let reserve = format!(
        "SELECT p.fingerprint, p.state, p.response_status, p.response_headers, p.response_body, \
         p.lock_left_ms, p.takeable, CASE WHEN p.takeable IS DISTINCT FROM 0 AND {bound} \
         THEN {function}($1, $2, $3, $4, $5, $6, $7, $8) END AS taken \
         FROM (VALUES (1)) AS one (x) LEFT JOIN ({peek}) AS p ON TRUE",
        peek = sql.peek,
        function = sql.reserve_function,
    );
    (lookup.into(), reserve.into())
}

/// A lookup: the columns of the record as stored, with the database's
/// clock, and `taken`, what it takes where there is no record.
fn lookup_taking(sql: &Statements, taken: &str) -> String {
    format!(
        "SELECT p.fingerprint, p.state, p.response_status, p.response_headers, p.response_body, \
         p.lock_expires_at, p.expires_at, now() AS now, {taken} AS taken, p.lock_token \
         FROM (VALUES (1)) AS one (x) LEFT JOIN ({stored}) AS p ON TRUE",
        stored = sql.stored,
    )
}

/// The reservation function's call where the lookup found no record and
/// `when` (`AND ...`, or nothing) holds.
fn take_when(sql: &Statements, when: &str) -> String {
    format!(
        "CASE WHEN p.state IS NULL{when} THEN {function}($1, $2, $3, $4, $5, $6, $7, $8) END",
        function = sql.reserve_function,
    )
}

impl FencedWrites {
    fn new(sql: &Statements, wait: Duration) -> Self {
        let bounded = |statement: &str| bounded_row_wait(statement, wait, false);
        FencedWrites {
            release: bounded(&sql.release),
            reject: bounded(&sql.reject),
            checkpoint: bounded(&sql.checkpoint),
            extend: bounded(&sql.extend),
            // Shorter: an extension given up on (its lease's deadline)
            // while it waits for its row runs on until the bound, and the
            // next extensions of other leases may need the spare.
            extend_on_spare: bounded_row_wait(&sql.extend, wait.min(EXTENSION_ROW_WAIT), false),
            complete: bounded(&sql.complete),
        }
    }
}

/// How long a lock extension on the store's spare connection waits for
/// its record's row, held by another transaction, before it fails
/// (`lock_not_available`) and is tried again at the lease's next period
/// (see [`FencedWrites`]).
const EXTENSION_ROW_WAIT: Duration = TURN_HELD_MAX;

/// Whether `e` is PostgreSQL's `lock_not_available`: a lock wait ran out.
fn lock_not_available(e: &StoreError) -> bool {
    driver_error(e).is_some_and(sql::lock_wait_ran_out)
}

/// Runs `statement` holding `turn` (whose drop lets the queue behind it go
/// on) until it answers or for [`TURN_HELD_MAX`], whichever comes first: a
/// statement still running then runs on to its answer without the turn.
async fn holding_at_most_a_turn<F: std::future::Future>(turn: impl Sized, statement: F) -> F::Output {
    let mut turn = Some(turn);
    let mut statement = std::pin::pin!(statement);
    let held_until = tokio::time::Instant::now() + TURN_HELD_MAX;
    tokio::select! {
        done = &mut statement => done,
        () = tokio::time::sleep_until(held_until) => {
            drop(turn.take());
            statement.await
        }
    }
}

/// How many completions (or groups of them) one store writes at once; the
/// rest queue for the next group. Three, measured on two CPUs shared with
/// the database (docs/benchmarks-log.md, "What changed"): with one, a
/// group's statement ran on one backend while the other CPU idled a third
/// of the time, and first requests at 16 and 64 clients were 0.8 and 1.1
/// of the hand-written flow's where three gave 0.9 and 1.8; with eight,
/// little is grouped and each completion pays its own commit.
const COMPLETION_TURNS: usize = 3;

/// How many lookups (or groups of them) one store runs at once; the rest
/// queue for the next group. Two, measured (docs/benchmarks-log.md, "What changed"):
/// with one, a group of fresh keys waits for the commit of the group before
/// it, and first requests at 16 clients lost a sixth of their throughput;
/// with eight or more, lookups rarely queue, and little is grouped.
const LOOKUP_TURNS: usize = 2;

/// The longest a turn to look up is held while its statement runs on,
/// and the longest a group's statement waits for a lock: lookups queued
/// behind a statement that waits (a lock, a stalled disk) are run by then,
/// without it.
const TURN_HELD_MAX: Duration = Duration::from_millis(100);

/// See [`TURN_HELD_MAX`].
const GROUP_LOCK_WAIT: Duration = TURN_HELD_MAX;

/// The lookup group's binds, as columns of its arrays: those of `lookup`,
/// in their order.
const LOOKUP_GROUP_COLUMNS: [&str; 8] = [
    "tenant",
    "scope",
    "key",
    "fingerprint",
    "token",
    "operation",
    "ttl_ms",
    "lock_ms",
];

/// The lookup's columns, in this order, read by position.
const LOOKUP_COLUMNS: [&str; 10] = [
    "fingerprint",
    "state",
    "response_status",
    "response_headers",
    "response_body",
    "lock_expires_at",
    "expires_at",
    "now",
    "taken",
    "lock_token",
];

/// A `timestamptz` as PostgreSQL sends it: microseconds from its epoch,
/// the infinities as the least and greatest values. Only ever compared
/// with another, or subtracted from one, so the epoch does not matter.
struct Micros(i64);

impl sqlx::Type<sqlx::Postgres> for Micros {
    fn type_info() -> sqlx::postgres::PgTypeInfo {
        // `timestamptz`'s fixed OID.
        sqlx::postgres::PgTypeInfo::with_oid(sqlx::postgres::types::Oid(1184))
    }
}

impl sqlx::Decode<'_, sqlx::Postgres> for Micros {
    fn decode(value: sqlx::postgres::PgValueRef<'_>) -> Result<Self, sqlx::error::BoxDynError> {
        match value.format() {
            sqlx::postgres::PgValueFormat::Binary => {
                Ok(Micros(i64::from_be_bytes(value.as_bytes()?.try_into()?)))
            }
            sqlx::postgres::PgValueFormat::Text => {
                Err("a timestamptz in text, where binary was asked for".into())
            }
        }
    }
}

/// How long what a lookup found holds, by the database's clock from when
/// the lookup ran.
#[derive(Clone, Copy, Debug)]
enum Holds {
    /// A completed record's retention left.
    Retention(Duration),
    /// A lock before its deadline.
    Lock,
}

/// From `from` to `to`, in microseconds of the database's clock; zero when
/// `to` is not later.
fn micros_between(from: i64, to: i64) -> Duration {
    Duration::from_micros(u64::try_from(i128::from(to) - i128::from(from)).unwrap_or(0))
}

/// The answer the lookup's record gives, where it is one SQL's judgement
/// would give by plain comparisons with the same clock: a completed record
/// before its expiry (a replay, or a mismatch), and one in progress under
/// a live lock (a conflict, or a mismatch). `None` for no record, and for
/// every other (expired, a stale or released lock, a state edited by hand):
/// those are judged in SQL, which alone may take them. The comparisons are
/// those of the reserving statement's `takeable` and lock left, on the
/// same values. So is a row whose columns it needs this build cannot read
/// as its migrations made them (such as a NULL expiry): SQL compares
/// whatever is there, as it did before this lookup. (The lookup casts the
/// status and the times to the types read here, whatever the columns'.)
/// With how long what it found holds by the database's clock.
fn judge_found(
    row: &sqlx::postgres::PgRow,
    fingerprint: &str,
) -> Result<Option<(Reservation, Holds)>, StoreError> {
    use crate::store::RecordState;
    use sqlx::Row as _;
    let (Ok(Some(state)), Ok(stored_fp), Ok(Some(Micros(now)))) = (
        row.try_get::<Option<&str>, _>(1),
        row.try_get::<&str, _>(0),
        row.try_get::<Option<Micros>, _>(7),
    ) else {
        return Ok(None);
    };
    let same = stored_fp == fingerprint;
    if state == RecordState::COMPLETED_COLUMN {
        let (Ok(Some(Micros(expires))), Ok(status)) = (
            row.try_get::<Option<Micros>, _>(6),
            row.try_get::<Option<i64>, _>(2),
        ) else {
            return Ok(None);
        };
        if expires <= now {
            return Ok(None);
        }
        let get_err = |e: sqlx::Error| StoreError::backend(e.to_string());
        let stored = crate::store::StoredResponse::from_columns(
            status,
            row.try_get(3).map_err(get_err)?,
            row.try_get(4).map_err(get_err)?,
        )?;
        return Ok(Some((
            sql::judge_existing(same, Some(stored), Duration::ZERO),
            Holds::Retention(micros_between(now, expires)),
        )));
    }
    let Ok(Some(Micros(lock))) = row.try_get::<Option<Micros>, _>(5) else {
        return Ok(None);
    };
    if state == RecordState::IN_PROGRESS_COLUMN && lock > now {
        // The lock left in whole milliseconds, rounded up, as SQL gives it.
        let left_ms = (i128::from(lock) - i128::from(now) + 999) / 1000;
        let left = Duration::from_millis(u64::try_from(left_ms).unwrap_or(u64::MAX));
        return Ok(Some((sql::judge_existing(same, None, left), Holds::Lock)));
    }
    Ok(None)
}

/// The lease in the reservation function's answer: attempt, taken_over,
/// recovery_point and operation_id, as text. An attempt out of range (a
/// row edited by hand) reads as 1, as the SQL stores read it before.
fn lease_from_taken(taken: &[Option<String>], token: &str) -> Option<crate::store::Lease> {
    let [Some(attempt), Some(taken_over), recovery_point, Some(operation_id)] = taken else {
        return None;
    };
    let attempt: i64 = attempt.parse().ok()?;
    Some(crate::store::Lease {
        token: token.to_owned(),
        attempt: u32::try_from(attempt).unwrap_or(1),
        takeover: taken_over.as_str() != "0",
        recovery_point: recovery_point.clone(),
        operation_id: operation_id.clone(),
    })
}
