//! The server under test: one handler, served bare, behind a hand-written
//! sqlx flow, and behind `#[idempotent]` on each store.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Idem};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use std::sync::Arc;

/// The request body every variant reads.
pub(crate) const BODY: &str =
    r#"{"amount": 4990, "currency": "EUR", "recipient": "acct_bob", "note": "invoice 2026-118"}"#;

#[derive(Deserialize)]
pub(crate) struct PaymentIn {
    amount: i64,
    currency: String,
    recipient: String,
    #[allow(dead_code)]
    note: String,
}

#[derive(Serialize)]
pub(crate) struct Payment {
    id: &'static str,
    amount: i64,
    currency: String,
    recipient: String,
    status: &'static str,
}

/// The business work of every variant: none beyond building the answer.
fn charge(p: PaymentIn) -> (StatusCode, Json<Payment>) {
    (
        StatusCode::CREATED,
        Json(Payment {
            id: "pay_1",
            amount: p.amount,
            currency: p.currency,
            recipient: p.recipient,
            status: "succeeded",
        }),
    )
}

/// The handler alone: the ceiling of every variant.
async fn bare(Json(p): Json<PaymentIn>) -> (StatusCode, Json<Payment>) {
    charge(p)
}

/// The same handler under the attribute.
#[idempotent(scope = "bench.pay", fields(amount, currency, recipient))]
async fn pay(Json(p): Json<PaymentIn>) -> (StatusCode, Json<Payment>) {
    charge(p)
}

/// A handler that holds its key until the run ends: its keys answer 409.
#[idempotent(scope = "bench.hold", fields(amount, currency, recipient))]
async fn hold(State(gate): State<Gate>, Json(p): Json<PaymentIn>) -> (StatusCode, Json<Payment>) {
    gate.hold().await;
    charge(p)
}

/// Counts the held handlers, and lets them go when the run ends.
#[derive(Clone, Default)]
pub(crate) struct Gate {
    open: Arc<tokio::sync::watch::Sender<bool>>,
    entered: Arc<tokio::sync::watch::Sender<usize>>,
}

impl Gate {
    pub(crate) fn open(&self) {
        self.open.send_replace(true);
    }

    /// Waits until `n` handlers in all are held.
    pub(crate) async fn entered(&self, n: usize) {
        let _ = self.entered.subscribe().wait_for(|held| *held >= n).await;
    }

    async fn hold(&self) {
        self.entered.send_modify(|held| *held += 1);
        let _ = self.open.subscribe().wait_for(|open| *open).await;
    }
}

/// The hand-written flow's table: the key, the request's fingerprint and
/// the stored answer, under the same primary key as idem's.
pub(crate) const HAND_TABLE: &str =
    "CREATE TABLE IF NOT EXISTS {schema}.hand_keys (tenant TEXT NOT NULL, scope TEXT NOT NULL, \
     key TEXT NOT NULL, fingerprint TEXT NOT NULL, status INTEGER, body BYTEA, \
     created_at TIMESTAMPTZ NOT NULL DEFAULT now(), PRIMARY KEY (tenant, scope, key))";

#[derive(Clone)]
pub(crate) struct Hand {
    pool: PgPool,
    insert: Arc<str>,
    update: Arc<str>,
    select: Arc<str>,
}

impl Hand {
    pub(crate) fn new(pool: PgPool, schema: &str) -> Hand {
        Hand {
            pool,
            insert: format!(
                "INSERT INTO {schema}.hand_keys (tenant, scope, key, fingerprint) VALUES ($1, $2, $3, $4) \
                 ON CONFLICT DO NOTHING RETURNING key"
            )
            .into(),
            update: format!(
                "UPDATE {schema}.hand_keys SET status = $4, body = $5 WHERE tenant = $1 AND scope = $2 AND key = $3"
            )
            .into(),
            select: format!(
                "SELECT status, body FROM {schema}.hand_keys WHERE tenant = $1 AND scope = $2 AND key = $3"
            )
            .into(),
        }
    }
}

fn key_of(headers: &HeaderMap) -> String {
    headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

/// The hand-written first request: `INSERT ... ON CONFLICT DO NOTHING`, the
/// handler, then one `UPDATE` with the answer (two round trips, two commits).
async fn hand_first(
    State(hand): State<Hand>,
    headers: HeaderMap,
    Json(p): Json<PaymentIn>,
) -> Result<(StatusCode, Vec<u8>), StatusCode> {
    let key = key_of(&headers);
    let fingerprint = format!("{}|{}|{}", p.amount, p.currency, p.recipient);
    let fresh = sqlx::query(sqlx::AssertSqlSafe(&*hand.insert))
        .bind("bench")
        .bind("bench.pay")
        .bind(&key)
        .bind(&fingerprint)
        .fetch_optional(&hand.pool)
        .await
        .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
    if fresh.is_none() {
        return Err(StatusCode::CONFLICT);
    }
    let (status, Json(payment)) = charge(p);
    let body = serde_json::to_vec(&payment).map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    sqlx::query(sqlx::AssertSqlSafe(&*hand.update))
        .bind("bench")
        .bind("bench.pay")
        .bind(&key)
        .bind(i32::from(status.as_u16()))
        .bind(&body)
        .execute(&hand.pool)
        .await
        .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
    Ok((status, body))
}

/// The hand-written replay: one primary-key `SELECT` (one round trip).
async fn hand_replay(
    State(hand): State<Hand>,
    headers: HeaderMap,
    Json(_): Json<PaymentIn>,
) -> Result<(StatusCode, [(&'static str, &'static str); 1], Vec<u8>), StatusCode> {
    let key = key_of(&headers);
    let row: Option<(Option<i32>, Option<Vec<u8>>)> = sqlx::query_as(sqlx::AssertSqlSafe(&*hand.select))
        .bind("bench")
        .bind("bench.pay")
        .bind(&key)
        .fetch_optional(&hand.pool)
        .await
        .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
    match row {
        Some((Some(status), Some(body))) => Ok((
            StatusCode::from_u16(u16::try_from(status).unwrap_or(500)).unwrap_or(StatusCode::OK),
            [("idempotent-replayed", "true")],
            body,
        )),
        _ => Err(StatusCode::NOT_FOUND),
    }
}

/// The stores under test, each behind its own `Idem` layer.
pub(crate) struct Stores {
    pub(crate) postgres: Option<(idem::PgStore, Hand)>,
    pub(crate) sqlite: idem::SqliteStore,
    pub(crate) memory: idem::MemoryStore,
}

pub(crate) fn app(stores: Stores, gate: Gate) -> Router {
    // Every variant is one route of one router, so that routing costs each
    // the same. The `Idem` layer of a store is on its routes, as
    // `Router::layer` would put it on each route of a router of its own;
    // nesting those routers would add a second routing step that the bare
    // handler does not take.
    let protected = |app: Router<Gate>, prefix: &str, idem: Idem| {
        let layer = idem.single_tenant().layer();
        app.route(&format!("{prefix}/pay"), post(pay).layer(layer.clone()))
            .route(&format!("{prefix}/hold"), post(hold).layer(layer))
    };
    let mut app = Router::new().route("/bare", post(bare));
    app = protected(app, "/sqlite", Idem::new(stores.sqlite));
    app = protected(app, "/memory", Idem::new(stores.memory));
    if let Some((pg, hand)) = stores.postgres {
        let from_db = pg.clone().with_replay_cache(std::time::Duration::ZERO);
        app = protected(app, "/postgres-db", Idem::new(from_db));
        app = protected(app, "/postgres", Idem::new(pg))
            .route("/hand/first", post(hand_first).with_state(hand.clone()))
            .route("/hand/replay", post(hand_replay).with_state(hand));
    }
    app.with_state(gate)
}
