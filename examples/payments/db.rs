//! The service's database, PostgreSQL or SQLite, which is also idem's
//! store: opening it, the service's tables, and the ledger's queries.

use idem::{Idem, Operation, PgStore, SqliteStore, StoreError};
use sqlx::postgres::PgRow;
use sqlx::sqlite::SqliteRow;
use sqlx::{FromRow, PgConnection, SqliteConnection};
use std::ops::DerefMut;
use std::time::Duration;

/// Every tenant starts with this balance, in minor units.
pub const STARTING_BALANCE: i64 = 1_000_000;

/// On PostgreSQL, the longest any statement of the service (its handlers',
/// idem's) waits for a lock, and the longest one runs, unless the operator
/// set either of their own (in `DATABASE_URL`'s `options`, or for the role
/// or the database; then the service sets neither, so that its statement
/// timeout never cuts an operator's longer lock timeout short). idem puts
/// no bound on a handler: a handler stuck on a row lock (another
/// transaction holding its tenant's account) would hold its key, every
/// retry answered 409, for as long as the lock is held. Bounded, it fails
/// with 503 and its key is released for the retry. (On SQLite the busy
/// timeout bounds each wait for the write lock.)
const PG_LOCK_TIMEOUT: &str = "5s";
/// See [`PG_LOCK_TIMEOUT`].
const PG_STATEMENT_TIMEOUT: &str = "10s";

/// The service's tables, next to idem's `idempotency_keys`.
const SCHEMA: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS accounts (tenant TEXT PRIMARY KEY, balance BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS payments (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, amount BIGINT NOT NULL, \
     currency TEXT NOT NULL, recipient TEXT NOT NULL, refunded BIGINT NOT NULL DEFAULT 0)",
    "CREATE TABLE IF NOT EXISTS refunds (id TEXT PRIMARY KEY, payment_id TEXT NOT NULL, tenant TEXT NOT NULL, \
     amount BIGINT NOT NULL)",
    // The fake card gateway's own state: charges are unique by the caller's key.
    "CREATE TABLE IF NOT EXISTS gateway_charges (charge_key TEXT PRIMARY KEY, tenant TEXT NOT NULL, \
     amount BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS gateway_calls (tenant TEXT PRIMARY KEY, calls BIGINT NOT NULL)",
    // Balance held for a payment in flight, once per operation: debited when
    // taken, settled with the payment (the row stays, so a late execution
    // of the same operation cannot hold again), given back when the gateway
    // declines or fails.
    "CREATE TABLE IF NOT EXISTS holds (hold_key TEXT PRIMARY KEY, tenant TEXT NOT NULL, amount BIGINT NOT NULL, \
     settled INTEGER NOT NULL DEFAULT 0)",
];

/// The service's database: the same one as the idempotency records, so a
/// payment and its stored answer commit in one transaction.
#[derive(Clone)]
pub enum Db {
    Pg(PgStore),
    Sqlite(SqliteStore),
}

/// What a tenant's ledger holds (`GET /v1/ledger`).
pub struct Ledger {
    pub charges: i64,
    pub payments: i64,
    pub gateway_calls: i64,
    pub balance: i64,
}

impl Db {
    /// Opens the database `url` names and applies idem's migrations and the
    /// service's schema. Errors say what failed and never carry the URL.
    pub async fn open(url: &str) -> Result<Db, String> {
        let shown = describe(url);
        // A URL's scheme is case-insensitive: `Postgres://` is `postgres://`.
        let url = &match url.split_once(':') {
            Some((scheme, rest)) => format!("{}:{rest}", scheme.to_ascii_lowercase()),
            None => url.to_owned(),
        };
        if url.starts_with("postgres") {
            // One connection first: its error names the cause (refused, unknown
            // host, bad password), where a pool would only say it timed out.
            use sqlx::Connection as _;
            match tokio::time::timeout(Duration::from_secs(5), PgConnection::connect(url)).await {
                Ok(Ok(conn)) => drop(conn),
                Ok(Err(e)) => return Err(format!("cannot connect to {shown}: {e}")),
                Err(_) => return Err(format!("cannot connect to {shown}: no answer within 5 s")),
            }
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(32)
                .acquire_timeout(Duration::from_secs(5))
                .after_connect(|conn, _| {
                    Box::pin(async move {
                        // Where the session has neither of its own (`0`,
                        // which a `0` set on purpose cannot be told from).
                        sqlx::query(
                            "SELECT set_config('lock_timeout', $1, false), \
                             set_config('statement_timeout', $2, false) \
                             WHERE current_setting('lock_timeout') = '0' \
                             AND current_setting('statement_timeout') = '0'",
                        )
                        .bind(PG_LOCK_TIMEOUT)
                        .bind(PG_STATEMENT_TIMEOUT)
                        .execute(conn)
                        .await
                        .map(drop)
                    })
                })
                .connect(url)
                .await
                .map_err(|e| format!("cannot connect to {shown}: {e}"))?;
            let store = PgStore::new(pool.clone());
            store.migrate().await.map_err(|e| e.to_string())?;
            let mut tx = pool.begin().await.map_err(|e| e.to_string())?;
            // One migrating process at a time; and each start's
            // "relation ... already exists, skipping" (a notice per table
            // that is there) is not logged.
            sqlx::raw_sql(
                "SELECT pg_advisory_xact_lock(7319002152); SET LOCAL client_min_messages = warning",
            )
            .execute(&mut *tx)
            .await
            .map_err(|e| e.to_string())?;
            for ddl in SCHEMA {
                sqlx::query(*ddl)
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| e.to_string())?;
            }
            tx.commit().await.map_err(|e| e.to_string())?;
            Ok(Db::Pg(store))
        } else if url.starts_with("sqlite:") {
            // Several processes may start on one file at once: opening (which
            // switches the file to WAL) and migrating wait for each other,
            // within SQLite's busy timeout.
            let store = SqliteStore::open_url(url)
                .await
                .map_err(|e| format!("cannot open {shown}: {e}"))?;
            store
                .migrate()
                .await
                .map_err(|e| format!("cannot open {shown}: {e}"))?;
            for ddl in SCHEMA {
                sqlx::query(*ddl)
                    .execute(store.pool())
                    .await
                    .map_err(|e| e.to_string())?;
            }
            Ok(Db::Sqlite(store))
        } else {
            Err(
                "DATABASE_URL must start with postgres:// or sqlite:// (its value is not shown: it may hold a password)"
                    .to_owned(),
            )
        }
    }

    /// idem on this database's store, with the default settings.
    pub fn idem(&self) -> Idem {
        match self {
            Db::Pg(store) => Idem::new(store.clone()),
            Db::Sqlite(store) => Idem::new(store.clone()),
        }
    }

    /// Whether the store answers and its table is migrated.
    pub async fn check_schema(&self) -> Result<(), StoreError> {
        match self {
            Db::Pg(store) => store.check_schema().await,
            Db::Sqlite(store) => store.check_schema().await,
        }
    }

    /// The operation's transaction: what is written in it commits with the
    /// stored answer, or not at all.
    pub async fn transaction<'o>(&self, op: &'o Operation) -> Result<Tx<'o>, StoreError> {
        Ok(Tx(match self {
            Db::Pg(_) => Conn::Pg(Box::new(op.pg_transaction().await?)),
            Db::Sqlite(_) => Conn::Sqlite(Box::new(op.sqlite_transaction().await?)),
        }))
    }

    /// Opens the tenant's account with the starting balance, once.
    pub async fn ensure_account(&self, tenant: &str) -> Result<(), sqlx::Error> {
        self.conn()
            .await?
            .execute(
                "INSERT INTO accounts (tenant, balance) VALUES ($1, $2) ON CONFLICT (tenant) DO NOTHING",
                &[tenant.into(), STARTING_BALANCE.into()],
            )
            .await?;
        Ok(())
    }

    /// Holds `amount` of the tenant's balance for the operation whose hold
    /// key is `key`, atomically and once: `false` when the balance is too
    /// low (nothing changed), `true` when held now or before.
    pub async fn hold(&self, tenant: &str, key: &str, amount: i64) -> Result<bool, sqlx::Error> {
        let mut tx = self.begin().await?;
        let taken = tx
            .conn()
            .execute(
                "INSERT INTO holds (hold_key, tenant, amount) VALUES ($1, $2, $3) ON CONFLICT (hold_key) DO NOTHING",
                &[key.into(), tenant.into(), amount.into()],
            )
            .await?;
        if taken == 1 {
            let debited = tx
                .conn()
                .execute(
                    "UPDATE accounts SET balance = balance - $2 WHERE tenant = $1 AND balance >= $2",
                    &[tenant.into(), amount.into()],
                )
                .await?;
            if debited == 0 {
                tx.rollback().await?;
                return Ok(false);
            }
        }
        tx.commit().await?;
        Ok(true)
    }

    /// Gives a hold back to the balance (a payment that did not happen).
    pub async fn release_hold(&self, tenant: &str, key: &str) -> Result<(), sqlx::Error> {
        let mut tx = self.begin().await?;
        let held: Option<(i64,)> = tx
            .conn()
            .fetch_optional(
                "DELETE FROM holds WHERE hold_key = $1 AND settled = 0 RETURNING amount",
                &[key.into()],
            )
            .await?;
        if let Some((amount,)) = held {
            tx.conn()
                .execute(
                    "UPDATE accounts SET balance = balance + $2 WHERE tenant = $1",
                    &[tenant.into(), amount.into()],
                )
                .await?;
        }
        tx.commit().await
    }

    /// Counts a call of the fake card gateway.
    pub async fn count_gateway_call(&self, tenant: &str) -> Result<(), sqlx::Error> {
        self.conn()
            .await?
            .execute(
                "INSERT INTO gateway_calls (tenant, calls) VALUES ($1, 1) \
                 ON CONFLICT (tenant) DO UPDATE SET calls = gateway_calls.calls + 1",
                &[tenant.into()],
            )
            .await?;
        Ok(())
    }

    /// Records a charge of the fake card gateway, at most once per charge key.
    pub async fn record_charge(
        &self,
        charge_key: &str,
        tenant: &str,
        amount: i64,
    ) -> Result<(), sqlx::Error> {
        self.conn()
            .await?
            .execute(
                "INSERT INTO gateway_charges (charge_key, tenant, amount) VALUES ($1, $2, $3) \
                 ON CONFLICT (charge_key) DO NOTHING",
                &[charge_key.into(), tenant.into(), amount.into()],
            )
            .await?;
        Ok(())
    }

    /// A payment of the tenant: (amount, currency, recipient, refunded).
    pub async fn payment(
        &self,
        id: &str,
        tenant: &str,
    ) -> Result<Option<(i64, String, String, i64)>, sqlx::Error> {
        self.conn()
            .await?
            .fetch_optional(
                "SELECT amount, currency, recipient, refunded FROM payments WHERE id = $1 AND tenant = $2",
                &[id.into(), tenant.into()],
            )
            .await
    }

    /// The tenant's ledger: what the gateway charged and was asked, the
    /// payments, the balance.
    pub async fn ledger(&self, tenant: &str) -> Result<Ledger, sqlx::Error> {
        let mut conn = self.conn().await?;
        let (charges,) = conn
            .fetch_one(
                "SELECT COUNT(*) FROM gateway_charges WHERE tenant = $1",
                &[tenant.into()],
            )
            .await?;
        let calls: Option<(i64,)> = conn
            .fetch_optional(
                "SELECT calls FROM gateway_calls WHERE tenant = $1",
                &[tenant.into()],
            )
            .await?;
        let (payments,) = conn
            .fetch_one(
                "SELECT COUNT(*) FROM payments WHERE tenant = $1",
                &[tenant.into()],
            )
            .await?;
        let balance: Option<(i64,)> = conn
            .fetch_optional("SELECT balance FROM accounts WHERE tenant = $1", &[tenant.into()])
            .await?;
        Ok(Ledger {
            charges,
            payments,
            gateway_calls: calls.map_or(0, |(calls,)| calls),
            balance: balance.map_or(STARTING_BALANCE, |(balance,)| balance),
        })
    }

    /// A connection from the pool.
    async fn conn(&self) -> Result<Conn<'static>, sqlx::Error> {
        Ok(match self {
            Db::Pg(store) => Conn::Pg(Box::new(store.pool().acquire().await?)),
            Db::Sqlite(store) => Conn::Sqlite(Box::new(store.pool().acquire().await?)),
        })
    }

    /// A transaction of the service's own, which commits at once (not with
    /// the answer).
    async fn begin(&self) -> Result<OwnTx, sqlx::Error> {
        Ok(match self {
            Db::Pg(store) => OwnTx::Pg(store.pool().begin().await?),
            Db::Sqlite(store) => OwnTx::Sqlite(store.pool().begin().await?),
        })
    }
}

/// The operation's transaction ([`Db::transaction`]) and what the handlers
/// write in it.
pub struct Tx<'o>(Conn<'o>);

impl Tx<'_> {
    /// Writes a payment.
    pub async fn insert_payment(
        &mut self,
        id: &str,
        tenant: &str,
        amount: i64,
        currency: &str,
        recipient: &str,
    ) -> Result<(), sqlx::Error> {
        self.0
            .execute(
                "INSERT INTO payments (id, tenant, amount, currency, recipient) VALUES ($1, $2, $3, $4, $5)",
                &[
                    id.into(),
                    tenant.into(),
                    amount.into(),
                    currency.into(),
                    recipient.into(),
                ],
            )
            .await?;
        Ok(())
    }

    /// Marks a hold as spent by its payment: it is never given back.
    pub async fn settle_hold(&mut self, key: &str) -> Result<(), sqlx::Error> {
        self.0
            .execute("UPDATE holds SET settled = 1 WHERE hold_key = $1", &[key.into()])
            .await?;
        Ok(())
    }

    /// The amount of a payment of the tenant.
    pub async fn payment_amount(&mut self, id: &str, tenant: &str) -> Result<Option<i64>, sqlx::Error> {
        let row: Option<(i64,)> = self
            .0
            .fetch_optional(
                "SELECT amount FROM payments WHERE id = $1 AND tenant = $2",
                &[id.into(), tenant.into()],
            )
            .await?;
        Ok(row.map(|(amount,)| amount))
    }

    /// Refunds `amount` of a payment of the tenant to its balance, as the
    /// refund `refund_id`: `false` (nothing written) when the payment's
    /// refunds would exceed it.
    pub async fn refund(
        &mut self,
        refund_id: &str,
        payment_id: &str,
        tenant: &str,
        amount: i64,
    ) -> Result<bool, sqlx::Error> {
        // `refunded <= amount - $3` cannot overflow: $3 is at most the amount.
        let refunded = self
            .0
            .execute(
                "UPDATE payments SET refunded = refunded + $3 \
                 WHERE id = $1 AND tenant = $2 AND refunded <= amount - $3",
                &[payment_id.into(), tenant.into(), amount.into()],
            )
            .await?;
        if refunded == 0 {
            return Ok(false);
        }
        self.0
            .execute(
                "INSERT INTO refunds (id, payment_id, tenant, amount) VALUES ($1, $2, $3, $4)",
                &[refund_id.into(), payment_id.into(), tenant.into(), amount.into()],
            )
            .await?;
        self.0
            .execute(
                "UPDATE accounts SET balance = balance + $2 WHERE tenant = $1",
                &[tenant.into(), amount.into()],
            )
            .await?;
        Ok(true)
    }
}

/// What `DATABASE_URL` names, safe to log: the kind of database and where
/// it is, never the URL itself (which may carry a password in any of its
/// many spellings).
pub fn describe(url: &str) -> String {
    use std::str::FromStr as _;
    let lower = url.to_ascii_lowercase();
    if lower.starts_with("postgres:") || lower.starts_with("postgresql:") {
        match sqlx::postgres::PgConnectOptions::from_str(url) {
            Ok(o) => format!("PostgreSQL at {}:{}", o.get_host(), o.get_port()),
            Err(_) => "PostgreSQL (DATABASE_URL does not parse)".into(),
        }
    } else if lower.starts_with("sqlite:") {
        match sqlx::sqlite::SqliteConnectOptions::from_str(url) {
            Ok(o) => format!("SQLite file {}", o.get_filename().display()),
            Err(_) => "SQLite (DATABASE_URL does not parse)".into(),
        }
    } else {
        "a database of an unsupported kind".into()
    }
}

// The dialect layer: the queries above are written once, with `$1`
// placeholders, and run on a connection of either kind.

/// A value for a `$n` placeholder.
#[derive(Clone, Copy)]
enum Arg<'a> {
    Text(&'a str),
    Int(i64),
}

impl<'a> From<&'a str> for Arg<'a> {
    fn from(text: &'a str) -> Self {
        Arg::Text(text)
    }
}

impl From<i64> for Arg<'_> {
    fn from(n: i64) -> Self {
        Arg::Int(n)
    }
}

/// A row as both dialects decode it: here a tuple of `i64` and `String`.
trait Tuple: for<'r> FromRow<'r, PgRow> + for<'r> FromRow<'r, SqliteRow> {}
impl<T: for<'r> FromRow<'r, PgRow> + for<'r> FromRow<'r, SqliteRow>> Tuple for T {}

/// A connection of either kind, with whatever lends it: the pool, a
/// transaction of the service's own, or the operation's transaction.
enum Conn<'c> {
    Pg(Box<dyn DerefMut<Target = PgConnection> + Send + 'c>),
    Sqlite(Box<dyn DerefMut<Target = SqliteConnection> + Send + 'c>),
}

impl Conn<'_> {
    /// Runs a statement; the number of rows it changed.
    async fn execute(&mut self, sql: &str, args: &[Arg<'_>]) -> Result<u64, sqlx::Error> {
        Ok(match self {
            Conn::Pg(conn) => {
                let conn: &mut PgConnection = conn;
                pg_query(sql, args).execute(conn).await?.rows_affected()
            }
            Conn::Sqlite(conn) => {
                let conn: &mut SqliteConnection = conn;
                sqlite_query(sql, args).execute(conn).await?.rows_affected()
            }
        })
    }

    /// The first row of a query, if any.
    async fn fetch_optional<T: Tuple>(
        &mut self,
        sql: &str,
        args: &[Arg<'_>],
    ) -> Result<Option<T>, sqlx::Error> {
        match self {
            Conn::Pg(conn) => {
                let conn: &mut PgConnection = conn;
                let row = pg_query(sql, args).fetch_optional(conn).await?;
                row.map(|row| T::from_row(&row)).transpose()
            }
            Conn::Sqlite(conn) => {
                let conn: &mut SqliteConnection = conn;
                let row = sqlite_query(sql, args).fetch_optional(conn).await?;
                row.map(|row| T::from_row(&row)).transpose()
            }
        }
    }

    /// The first row of a query that always returns one.
    async fn fetch_one<T: Tuple>(&mut self, sql: &str, args: &[Arg<'_>]) -> Result<T, sqlx::Error> {
        self.fetch_optional(sql, args)
            .await?
            .ok_or(sqlx::Error::RowNotFound)
    }
}

/// A transaction of the service's own ([`Db::begin`]): rolled back unless
/// committed.
enum OwnTx {
    Pg(sqlx::Transaction<'static, sqlx::Postgres>),
    Sqlite(sqlx::Transaction<'static, sqlx::Sqlite>),
}

impl OwnTx {
    fn conn(&mut self) -> Conn<'_> {
        match self {
            OwnTx::Pg(tx) => Conn::Pg(Box::new(&mut **tx)),
            OwnTx::Sqlite(tx) => Conn::Sqlite(Box::new(&mut **tx)),
        }
    }

    async fn commit(self) -> Result<(), sqlx::Error> {
        match self {
            OwnTx::Pg(tx) => tx.commit().await,
            OwnTx::Sqlite(tx) => tx.commit().await,
        }
    }

    async fn rollback(self) -> Result<(), sqlx::Error> {
        match self {
            OwnTx::Pg(tx) => tx.rollback().await,
            OwnTx::Sqlite(tx) => tx.rollback().await,
        }
    }
}

/// `sql` with `args` bound, for PostgreSQL.
fn pg_query<'q>(
    sql: &str,
    args: &[Arg<'q>],
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    let mut query = sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()));
    for arg in args {
        query = match *arg {
            Arg::Text(text) => query.bind(text),
            Arg::Int(n) => query.bind(n),
        };
    }
    query
}

/// The same for SQLite, which writes the placeholder `$1` as `?1`.
fn sqlite_query<'q>(
    sql: &str,
    args: &[Arg<'q>],
) -> sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments> {
    let mut query = sqlx::query(sqlx::AssertSqlSafe(sql.replace('$', "?")));
    for arg in args {
        query = match *arg {
            Arg::Text(text) => query.bind(text),
            Arg::Int(n) => query.bind(n),
        };
    }
    query
}
