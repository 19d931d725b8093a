//! The payments service of the examples: a small API that charges a fake
//! card gateway, protected by `#[idempotent]`. Shared by `payments` (the
//! server) and `demo` (which starts it in-process).
#![allow(dead_code, unreachable_pub)]

use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use idem::{idempotent, Idem, Operation, PgStore, SqliteStore, StoreError, Tenant};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// Every tenant starts with this balance, in minor units.
pub const STARTING_BALANCE: i64 = 1_000_000;

/// The service's settings, read from the environment.
#[derive(Clone, Debug)]
pub struct Config {
    /// `PAYMENTS_ADDR`, default `127.0.0.1:8080`.
    pub addr: SocketAddr,
    /// `DATABASE_URL`: `postgres://...` or `sqlite://...`; default `sqlite://payments.db`.
    pub database_url: String,
    /// `IDEM_TTL`, default 24h.
    pub ttl: Duration,
    /// `IDEM_LOCK_TIMEOUT`, default 60s.
    pub lock_timeout: Duration,
    /// `PAYMENTS_GATEWAY_DELAY_MS`: how long the fake gateway takes, default 0.
    pub gateway_delay: Duration,
    /// `PAYMENTS_FAULT_AFTER_CHARGE_MS` (fault injection for crash tests): a
    /// pause after the gateway charged and before the payment is written.
    pub pause_after_charge: Duration,
    /// `PAYMENTS_FAULT_BEFORE_COMMIT_MS` (fault injection for crash tests): a
    /// pause after the payment is written and before it commits.
    pub pause_before_commit: Duration,
    /// `PAYMENTS_FAULT_LEDGER_ONCE=1` (fault injection): the first attempt of
    /// every payment finds the ledger down after the gateway charged (503).
    pub ledger_down_once: bool,
}

impl Config {
    /// Reads the environment; a bad value is an error that names the variable.
    pub fn from_env() -> Result<Config, String> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let duration = |name: &str, default: Duration| match var(name) {
            Some(v) => idem::parse_duration(&v).map_err(|e| format!("{name}: {e}")),
            None => Ok(default),
        };
        let millis = |name: &str| match var(name) {
            Some(v) => v
                .parse::<u64>()
                .map(Duration::from_millis)
                .map_err(|_| format!("{name}: expected milliseconds, got `{v}`")),
            None => Ok(Duration::ZERO),
        };
        let in_range = |name: &str, d: Duration, range: std::ops::RangeInclusive<Duration>, words: &str| {
            if range.contains(&d) {
                Ok(d)
            } else {
                Err(format!("{name}: {d:?} is out of range; allowed {words}"))
            }
        };
        Ok(Config {
            addr: var("PAYMENTS_ADDR")
                .unwrap_or_else(|| "127.0.0.1:8080".into())
                .parse()
                .map_err(|e| format!("PAYMENTS_ADDR: {e}"))?,
            database_url: var("DATABASE_URL").unwrap_or_else(|| "sqlite://payments.db".into()),
            ttl: in_range(
                "IDEM_TTL",
                duration("IDEM_TTL", idem::DEFAULT_TTL)?,
                idem::TTL_RANGE,
                "1s to 365d",
            )?,
            lock_timeout: in_range(
                "IDEM_LOCK_TIMEOUT",
                duration("IDEM_LOCK_TIMEOUT", idem::DEFAULT_LOCK_TIMEOUT)?,
                idem::LOCK_TIMEOUT_RANGE,
                "100ms to 1d",
            )?,
            gateway_delay: millis("PAYMENTS_GATEWAY_DELAY_MS")?,
            pause_after_charge: millis("PAYMENTS_FAULT_AFTER_CHARGE_MS")?,
            pause_before_commit: millis("PAYMENTS_FAULT_BEFORE_COMMIT_MS")?,
            ledger_down_once: var("PAYMENTS_FAULT_LEDGER_ONCE").as_deref() == Some("1"),
        })
    }
}

/// The service's database: the same one as the idempotency records, so a
/// payment and its stored answer commit in one transaction.
#[derive(Clone)]
enum Db {
    Pg(sqlx::PgPool),
    Sqlite(sqlx::SqlitePool),
}

/// Runs the same sqlx code on whichever pool or transaction the service has.
macro_rules! on_pool {
    ($db:expr, |$pool:ident| $body:expr) => {
        match $db {
            Db::Pg($pool) => $body,
            Db::Sqlite($pool) => $body,
        }
    };
}

/// Runs the same sqlx code inside the operation's transaction.
macro_rules! in_tx {
    ($svc:expr, $op:expr, |$conn:ident| $body:expr) => {
        match &$svc.db {
            Db::Pg(_) => {
                let mut guard = $op.pg_transaction().await?;
                let $conn = &mut *guard;
                $body
            }
            Db::Sqlite(_) => {
                let mut guard = $op.sqlite_transaction().await?;
                let $conn = &mut *guard;
                $body
            }
        }
    };
}

#[derive(Clone)]
struct Service {
    db: Db,
    config: Arc<Config>,
    /// The idempotency store, for `GET /health`.
    store: Store,
}

/// The idempotency store of either kind.
#[derive(Clone)]
enum Store {
    Pg(PgStore),
    Sqlite(SqliteStore),
}

impl Service {
    /// SQL written with `$1` placeholders, in the dialect of the database.
    fn sql(&self, sql: &str) -> sqlx::AssertSqlSafe<String> {
        match self.db {
            Db::Pg(_) => sqlx::AssertSqlSafe(sql.to_owned()),
            Db::Sqlite(_) => sqlx::AssertSqlSafe(sql.replace('$', "?")),
        }
    }
}

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
    // of the same operation cannot hold again), given back when it fails.
    "CREATE TABLE IF NOT EXISTS holds (hold_key TEXT PRIMARY KEY, tenant TEXT NOT NULL, amount BIGINT NOT NULL, \
     settled INTEGER NOT NULL DEFAULT 0)",
];

/// An answer of the service that is not a success.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    body: serde_json::Value,
    problem: bool,
}

impl ApiError {
    fn problem(status: StatusCode, name: &str, detail: &str) -> Self {
        ApiError {
            status,
            problem: true,
            body: serde_json::json!({
                "type": format!("urn:payments:problem:{name}"),
                "title": status.canonical_reason().unwrap_or("Error"),
                "status": status.as_u16(),
                "detail": detail,
            }),
        }
    }

    fn declined(code: &str) -> Self {
        ApiError {
            status: StatusCode::PAYMENT_REQUIRED,
            problem: false,
            body: serde_json::json!({ "error": code }),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body)).into_response();
        if self.problem {
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/problem+json"),
            );
        }
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            // Like idem's own 503s: the client is told when to retry.
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("2"));
        }
        response
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        tracing::error!(error = %e, "database error");
        ApiError::problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "database-unavailable",
            "try again later",
        )
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        tracing::error!(error = %e, "idempotency store error");
        ApiError::problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "database-unavailable",
            "try again later",
        )
    }
}

#[derive(Deserialize, Serialize)]
struct PaymentIn {
    amount: i64,
    currency: String,
    recipient: String,
    comment: Option<String>,
    metadata: Option<serde_json::Map<String, serde_json::Value>>,
}

#[derive(Serialize)]
struct Payment {
    id: String,
    amount: i64,
    currency: String,
    recipient: String,
    status: &'static str,
}

type Created<T> = (StatusCode, HeaderMap, Json<T>);

fn validate(p: &PaymentIn) -> Result<(), ApiError> {
    let invalid = |detail: &str| {
        Err(ApiError::problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid-request",
            detail,
        ))
    };
    if p.amount <= 0 {
        return invalid("amount must be a positive integer in minor units");
    }
    if p.currency.len() != 3 || !p.currency.bytes().all(|b| b.is_ascii_uppercase()) {
        return invalid("currency must be three uppercase letters");
    }
    if p.recipient.is_empty() || p.recipient.chars().count() > 64 {
        return invalid("recipient must be 1 to 64 characters");
    }
    Ok(())
}

impl Service {
    async fn ensure_account(&self, tenant: &str) -> Result<(), sqlx::Error> {
        let sql = self
            .sql("INSERT INTO accounts (tenant, balance) VALUES ($1, $2) ON CONFLICT (tenant) DO NOTHING");
        on_pool!(&self.db, |pool| sqlx::query(sql)
            .bind(tenant)
            .bind(STARTING_BALANCE)
            .execute(pool)
            .await
            .map(|r| r.rows_affected()))?;
        Ok(())
    }

    /// Holds `amount` of the tenant's balance for the operation whose hold
    /// key is `key`, atomically and once: `false` when the balance is too
    /// low (nothing changed), `true` when held now or before.
    async fn hold(&self, tenant: &str, key: &str, amount: i64) -> Result<bool, sqlx::Error> {
        let insert =
            self.sql("INSERT INTO holds (hold_key, tenant, amount) VALUES ($1, $2, $3) ON CONFLICT (hold_key) DO NOTHING");
        let debit =
            self.sql("UPDATE accounts SET balance = balance - $2 WHERE tenant = $1 AND balance >= $2");
        on_pool!(&self.db, |pool| async {
            let mut tx = pool.begin().await?;
            let taken = sqlx::query(insert)
                .bind(key)
                .bind(tenant)
                .bind(amount)
                .execute(&mut *tx)
                .await?
                .rows_affected();
            if taken == 1 {
                let debited = sqlx::query(debit)
                    .bind(tenant)
                    .bind(amount)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                if debited == 0 {
                    tx.rollback().await?;
                    return Ok(false);
                }
            }
            tx.commit().await?;
            Ok(true)
        }
        .await)
    }

    /// Gives a hold back to the balance (a payment that did not happen).
    async fn release_hold(&self, tenant: &str, key: &str) -> Result<(), sqlx::Error> {
        let remove = self.sql("DELETE FROM holds WHERE hold_key = $1 AND settled = 0 RETURNING amount");
        let credit = self.sql("UPDATE accounts SET balance = balance + $2 WHERE tenant = $1");
        on_pool!(&self.db, |pool| async {
            let mut tx = pool.begin().await?;
            let held: Option<i64> = sqlx::query_scalar(remove)
                .bind(key)
                .fetch_optional(&mut *tx)
                .await?;
            if let Some(amount) = held {
                sqlx::query(credit)
                    .bind(tenant)
                    .bind(amount)
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await
        }
        .await)
    }

    async fn balance(&self, tenant: &str) -> Result<i64, sqlx::Error> {
        let sql = self.sql("SELECT balance FROM accounts WHERE tenant = $1");
        let balance: Option<i64> = on_pool!(&self.db, |pool| sqlx::query_scalar(sql)
            .bind(tenant)
            .fetch_optional(pool)
            .await)?;
        Ok(balance.unwrap_or(STARTING_BALANCE))
    }

    /// The fake card gateway. It counts every call, waits its delay, and
    /// charges at most once per charge key (a real gateway's idempotency).
    /// `acct_declined` plays a declined card, `acct_unavailable` an outage.
    /// Its writes are its own: they commit at once, outside the handler's
    /// transaction.
    async fn gateway_charge(
        &self,
        tenant: &str,
        charge_key: &str,
        amount: i64,
        recipient: &str,
    ) -> Result<(), ApiError> {
        let count = self.sql(
            "INSERT INTO gateway_calls (tenant, calls) VALUES ($1, 1) \
             ON CONFLICT (tenant) DO UPDATE SET calls = gateway_calls.calls + 1",
        );
        on_pool!(&self.db, |pool| sqlx::query(count)
            .bind(tenant)
            .execute(pool)
            .await
            .map(|r| r.rows_affected()))?;
        tokio::time::sleep(self.config.gateway_delay).await;
        if recipient == "acct_declined" {
            return Err(ApiError::declined("card_declined"));
        }
        if recipient == "acct_unavailable" {
            return Err(ApiError::problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "gateway-unavailable",
                "the card gateway is down; retry with the same key",
            ));
        }
        let charge = self.sql(
            "INSERT INTO gateway_charges (charge_key, tenant, amount) VALUES ($1, $2, $3) \
             ON CONFLICT (charge_key) DO NOTHING",
        );
        on_pool!(&self.db, |pool| sqlx::query(charge)
            .bind(charge_key)
            .bind(tenant)
            .bind(amount)
            .execute(pool)
            .await
            .map(|r| r.rows_affected()))?;
        Ok(())
    }
}

/// Creates a payment: validate, check the balance, charge the gateway under
/// the operation's derived key, then write the payment and debit the
/// balance in the transaction that also completes the idempotency record.
#[idempotent(scope = "payment.create", fields(amount, currency, recipient))]
async fn create_payment(
    State(svc): State<Service>,
    op: Operation,
    Json(p): Json<PaymentIn>,
) -> Result<Created<Payment>, ApiError> {
    validate(&p)?;
    let tenant = op.tenant().to_owned();
    svc.ensure_account(&tenant).await?;
    if p.recipient == "acct_panic" {
        panic!("acct_panic: the handler panics (the key is released)");
    }
    // The balance is held atomically before the gateway is called: two
    // payments near the balance cannot both charge. Once per operation (a
    // retry or takeover finds its hold), settled with the payment below,
    // given back when the payment fails.
    let hold = op.derived_key("hold");
    if op.is_lease_lost() {
        // Another execution owns this payment now: no further effect.
        return Err(StoreError::LockLost.into());
    }
    if !svc.hold(&tenant, &hold, p.amount).await? {
        return Err(ApiError::declined("insufficient_funds"));
    }
    if op.recovery_point().as_deref() == Some("charged") {
        tracing::info!(
            attempt = op.attempt(),
            "resuming after the charge: the gateway deduplicates the derived key"
        );
    }
    if let Err(e) = svc
        .gateway_charge(&tenant, &op.derived_key("charge"), p.amount, &p.recipient)
        .await
    {
        // Declined, or the gateway is down: nothing was charged.
        svc.release_hold(&tenant, &hold).await?;
        return Err(e);
    }
    op.checkpoint("charged").await?;
    tokio::time::sleep(svc.config.pause_after_charge).await;
    if svc.config.ledger_down_once && op.attempt() == 1 {
        // Released as failed: the retry of this request continues this
        // operation (the gateway deduplicates its derived key); another
        // request with this key gets 422.
        return Err(ApiError::problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "ledger-unavailable",
            "the ledger is down after the charge; retry with the same key",
        ));
    }

    // The same id on every attempt of this operation. The payment and the
    // settled hold commit with the stored answer, or not at all.
    let id = format!("pay_{}", &op.derived_key("payment-id")[5..29]);
    let insert =
        svc.sql("INSERT INTO payments (id, tenant, amount, currency, recipient) VALUES ($1, $2, $3, $4, $5)");
    let settle = svc.sql("UPDATE holds SET settled = 1 WHERE hold_key = $1");
    in_tx!(svc, op, |conn| {
        sqlx::query(insert)
            .bind(&id)
            .bind(&tenant)
            .bind(p.amount)
            .bind(&p.currency)
            .bind(&p.recipient)
            .execute(&mut *conn)
            .await?;
        sqlx::query(settle).bind(&hold).execute(&mut *conn).await?;
    });
    tokio::time::sleep(svc.config.pause_before_commit).await;
    let mut headers = HeaderMap::new();
    if let Ok(location) = HeaderValue::from_str(&format!("/v1/payments/{id}")) {
        headers.insert(header::LOCATION, location);
    }
    Ok((
        StatusCode::CREATED,
        headers,
        Json(Payment {
            id,
            amount: p.amount,
            currency: p.currency,
            recipient: p.recipient,
            status: "succeeded",
        }),
    ))
}

#[derive(Deserialize, Serialize)]
struct RefundIn {
    amount: i64,
}

#[derive(Serialize)]
struct Refund {
    id: String,
    payment_id: String,
    amount: i64,
}

/// Refunds part or all of a payment: 201, 404 for a payment of another
/// tenant or none, 422 when more than the payment would be refunded.
#[idempotent(scope = "refund.create", fields(amount))]
async fn create_refund(
    State(svc): State<Service>,
    Path(payment_id): Path<String>,
    op: Operation,
    Json(r): Json<RefundIn>,
) -> Result<Created<Refund>, ApiError> {
    if r.amount <= 0 {
        return Err(ApiError::problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid-request",
            "amount must be a positive integer",
        ));
    }
    let tenant = op.tenant().to_owned();
    let id = format!("re_{}", &op.derived_key("refund-id")[5..29]);
    let find = svc.sql("SELECT amount, refunded FROM payments WHERE id = $1 AND tenant = $2");
    // `refunded <= amount - $3` cannot overflow: $3 is at most the amount.
    let refund = svc.sql("UPDATE payments SET refunded = refunded + $3 WHERE id = $1 AND tenant = $2 AND refunded <= amount - $3");
    let insert = svc.sql("INSERT INTO refunds (id, payment_id, tenant, amount) VALUES ($1, $2, $3, $4)");
    let credit = svc.sql("UPDATE accounts SET balance = balance + $2 WHERE tenant = $1");
    let outcome: Result<(), ApiError> = in_tx!(svc, op, |conn| {
        let found: Option<(i64, i64)> = sqlx::query_as(find)
            .bind(&payment_id)
            .bind(&tenant)
            .fetch_optional(&mut *conn)
            .await?;
        match found {
            None => Err(ApiError::problem(
                StatusCode::NOT_FOUND,
                "payment-not-found",
                "no such payment",
            )),
            Some((amount, _)) if r.amount > amount => Err(ApiError::problem(
                StatusCode::UNPROCESSABLE_ENTITY,
                "refund-exceeds-payment",
                "the refunds would exceed the payment",
            )),
            Some(_) => {
                let done = sqlx::query(refund)
                    .bind(&payment_id)
                    .bind(&tenant)
                    .bind(r.amount)
                    .execute(&mut *conn)
                    .await?;
                if done.rows_affected() == 0 {
                    Err(ApiError::problem(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        "refund-exceeds-payment",
                        "the refunds would exceed the payment",
                    ))
                } else {
                    sqlx::query(insert)
                        .bind(&id)
                        .bind(&payment_id)
                        .bind(&tenant)
                        .bind(r.amount)
                        .execute(&mut *conn)
                        .await?;
                    sqlx::query(credit)
                        .bind(&tenant)
                        .bind(r.amount)
                        .execute(&mut *conn)
                        .await?;
                    Ok(())
                }
            }
        }
    });
    outcome?;
    Ok((
        StatusCode::CREATED,
        HeaderMap::new(),
        Json(Refund {
            id,
            payment_id,
            amount: r.amount,
        }),
    ))
}

async fn get_payment(
    State(svc): State<Service>,
    axum::Extension(tenant): axum::Extension<Tenant>,
    Path(id): Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let sql =
        svc.sql("SELECT amount, currency, recipient, refunded FROM payments WHERE id = $1 AND tenant = $2");
    let row: Option<(i64, String, String, i64)> = on_pool!(&svc.db, |pool| sqlx::query_as(sql)
        .bind(&id)
        .bind(tenant.as_str())
        .fetch_optional(pool)
        .await)?;
    let (amount, currency, recipient, refunded) =
        row.ok_or_else(|| ApiError::problem(StatusCode::NOT_FOUND, "payment-not-found", "no such payment"))?;
    Ok(Json(serde_json::json!({
        "id": id, "amount": amount, "currency": currency, "recipient": recipient,
        "refunded": refunded, "status": "succeeded",
    })))
}

async fn ledger(
    State(svc): State<Service>,
    axum::Extension(tenant): axum::Extension<Tenant>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let t = tenant.as_str();
    let charges_sql = svc.sql("SELECT COUNT(*) FROM gateway_charges WHERE tenant = $1");
    let calls_sql = svc.sql("SELECT calls FROM gateway_calls WHERE tenant = $1");
    let charges: i64 = on_pool!(&svc.db, |pool| sqlx::query_scalar(charges_sql)
        .bind(t)
        .fetch_one(pool)
        .await)?;
    let calls: Option<i64> = on_pool!(&svc.db, |pool| sqlx::query_scalar(calls_sql)
        .bind(t)
        .fetch_optional(pool)
        .await)?;
    let payments_sql = svc.sql("SELECT COUNT(*) FROM payments WHERE tenant = $1");
    let payments: i64 = on_pool!(&svc.db, |pool| sqlx::query_scalar(payments_sql)
        .bind(t)
        .fetch_one(pool)
        .await)?;
    Ok(Json(serde_json::json!({
        "charges": charges,
        "payments": payments,
        "gateway_calls": calls.unwrap_or(0),
        "balance": svc.balance(t).await?,
    })))
}

/// `GET /health`: 200 when the store answers and its table is migrated,
/// 503 (with `Retry-After`) otherwise.
async fn health(State(svc): State<Service>) -> Result<Json<serde_json::Value>, ApiError> {
    let checked = match &svc.store {
        Store::Pg(s) => s.check_schema().await,
        Store::Sqlite(s) => s.check_schema().await,
    };
    match checked {
        Ok(()) => Ok(Json(serde_json::json!({ "status": "ok" }))),
        Err(e) => {
            tracing::error!(error = %e, "health check failed");
            Err(ApiError::problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "unhealthy",
                "the store is unreachable or not migrated",
            ))
        }
    }
}

/// Demo authentication, not for production: the bearer token is the tenant
/// id (1 to 64 of `[A-Za-z0-9_-]`).
async fn auth(mut req: Request, next: Next) -> Response {
    let token = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        // The scheme is case-insensitive (RFC 9110, 11.1).
        .and_then(|(scheme, token)| scheme.eq_ignore_ascii_case("bearer").then_some(token.trim()))
        .filter(|t| {
            !t.is_empty()
                && t.len() <= 64
                && t.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        })
        .map(str::to_owned);
    match token {
        Some(t) => {
            req.extensions_mut().insert(Tenant::new(t));
            next.run(req).await
        }
        None => {
            let mut r = ApiError::problem(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "send `Authorization: Bearer <tenant id>` (1 to 64 of A-Z a-z 0-9 _ -)",
            )
            .into_response();
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            r
        }
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

/// Opens the database named by the config, applies the migrations, and
/// builds the router (with its janitor, which lives as long as the router).
/// Errors say what failed and never carry the URL.
pub async fn build(config: Config) -> Result<Router, String> {
    let url = config.database_url.clone();
    let shown = describe(&url);
    let (idem, db, store) = if url.starts_with("postgres") {
        // One connection first: its error names the cause (refused, unknown
        // host, bad password), where a pool would only say it timed out.
        use sqlx::Connection as _;
        match tokio::time::timeout(Duration::from_secs(5), sqlx::PgConnection::connect(&url)).await {
            Ok(Ok(conn)) => drop(conn),
            Ok(Err(e)) => return Err(format!("cannot connect to {shown}: {e}")),
            Err(_) => return Err(format!("cannot connect to {shown}: no answer within 5 s")),
        }
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(32)
            .acquire_timeout(Duration::from_secs(5))
            .connect(&url)
            .await
            .map_err(|e| format!("cannot connect to {shown}: {e}"))?;
        let store = PgStore::new(pool.clone());
        store.migrate().await.map_err(|e| e.to_string())?;
        let mut tx = pool.begin().await.map_err(|e| e.to_string())?;
        // One migrating process at a time.
        sqlx::query("SELECT pg_advisory_xact_lock(7319002152)")
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
        (Idem::new(store.clone()), Db::Pg(pool), Store::Pg(store))
    } else if url.starts_with("sqlite:") {
        // Several processes may start on one file at once: opening (which
        // switches the file to WAL) and migrating wait for each other, a few
        // busy timeouts at most.
        let mut tries = 0;
        let store = loop {
            let opened = match SqliteStore::open_url(&url).await {
                Ok(store) => store.migrate().await.map(|()| store),
                Err(e) => Err(e),
            };
            match opened {
                Ok(store) => break store,
                Err(e) if e.is_unavailable() && tries < 5 => tries += 1,
                Err(e) => return Err(format!("cannot open {shown}: {e}")),
            }
        };
        for ddl in SCHEMA {
            sqlx::query(*ddl)
                .execute(store.pool())
                .await
                .map_err(|e| e.to_string())?;
        }
        let pool = store.pool().clone();
        (Idem::new(store.clone()), Db::Sqlite(pool), Store::Sqlite(store))
    } else {
        return Err(
            "DATABASE_URL must start with postgres:// or sqlite:// (its value is not shown: it may hold a password)"
                .to_owned(),
        );
    };
    let idem = idem
        .ttl(config.ttl)
        .and_then(|idem| idem.lock_timeout(config.lock_timeout))
        .map_err(|e| format!("IDEM_TTL / IDEM_LOCK_TIMEOUT: {e}"))?;
    let janitor = Arc::new(
        idem.start_janitor(Duration::from_secs(300), 1000)
            .map_err(|e| e.to_string())?,
    );
    let svc = Service {
        db,
        config: Arc::new(config),
        store,
    };
    Ok(Router::new()
        .route("/v1/payments", post(create_payment))
        .route("/v1/payments/{id}", get(get_payment))
        .route("/v1/payments/{id}/refunds", post(create_refund))
        .route("/v1/ledger", get(ledger))
        .layer(idem.layer())
        .layer(axum::Extension(janitor))
        .layer(middleware::from_fn(auth))
        // Outside the authentication: for orchestrators.
        .route("/health", get(health))
        .with_state(svc))
}

/// Serves on `listener` until the process ends.
pub async fn serve(listener: tokio::net::TcpListener, router: Router) -> std::io::Result<()> {
    axum::serve(listener, router).await
}
