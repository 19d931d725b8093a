//! The service's HTTP API: the two `#[idempotent]` handlers first, then
//! what they take and answer, the fake card gateway, the reads, the routes,
//! the demo authentication and the errors.

use super::config::Config;
use super::db::Db;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use idem::{idempotent, Idem, Operation, StoreError, Tenant};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// Creates a payment: validate, hold the balance, charge the gateway under
/// the operation's derived key, then write the payment and settle the hold
/// in the transaction that also completes the idempotency record.
#[idempotent(scope = "payment.create", fields(amount, currency, recipient))]
async fn create_payment(
    State(app): State<App>,
    op: Operation,
    ApiJson(p): ApiJson<PaymentIn>,
) -> Result<Created<Payment>, ApiError> {
    validate(&p)?;
    let tenant = op.tenant().to_owned();
    app.db.ensure_account(&tenant).await?;
    if p.recipient == "acct_panic" {
        panic!("acct_panic: the handler panics (the key is released)");
    }
    // The balance is held atomically before the gateway is called: two
    // payments near the balance cannot both charge. Once per operation (a
    // retry or takeover finds its hold), settled with the payment below,
    // given back when the gateway declines or fails. A crash leaves it to
    // the operation's next attempt (none after the record's TTL: README,
    // "The example payments service").
    let hold = op.derived_key("hold");
    if op.is_lease_lost() {
        // Another execution owns this payment now: no further effect.
        return Err(StoreError::LockLost.into());
    }
    if !app.db.hold(&tenant, &hold, p.amount).await? {
        return Err(ApiError::declined("insufficient_funds"));
    }
    if op.recovery_point().as_deref() == Some("charged") {
        tracing::info!(
            attempt = op.attempt(),
            "resuming after the charge: the gateway deduplicates the derived key"
        );
    }
    let charge_key = op.derived_key("charge");
    if let Err(e) = gateway_charge(&app, &tenant, &charge_key, p.amount, &p.recipient).await {
        // Declined, or the gateway is down: nothing was charged.
        app.db.release_hold(&tenant, &hold).await?;
        return Err(e);
    }
    op.checkpoint("charged").await?;
    tokio::time::sleep(app.config.pause_after_charge).await;
    if app.config.ledger_down_once && op.attempt() == 1 {
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
    let mut tx = app.db.transaction(&op).await?;
    tx.insert_payment(&id, &tenant, p.amount, &p.currency, &p.recipient)
        .await?;
    tx.settle_hold(&hold).await?;
    tokio::time::sleep(app.config.pause_before_commit).await;
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

/// Refunds part or all of a payment: 201, 404 for a payment of another
/// tenant or none, 422 when more than the payment would be refunded.
#[idempotent(scope = "refund.create", fields(amount))]
async fn create_refund(
    State(app): State<App>,
    PaymentId(payment_id): PaymentId,
    op: Operation,
    ApiJson(r): ApiJson<RefundIn>,
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
    // The refund and the credit commit with the stored answer, or not at all.
    let mut tx = app.db.transaction(&op).await?;
    let paid = match possible_payment_id(&payment_id) {
        true => tx.payment_amount(&payment_id, &tenant).await?,
        false => None,
    };
    let Some(paid) = paid else {
        return Err(ApiError::problem(
            StatusCode::NOT_FOUND,
            "payment-not-found",
            "no such payment",
        ));
    };
    if r.amount > paid || !tx.refund(&id, &payment_id, &tenant, r.amount).await? {
        return Err(ApiError::problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "refund-exceeds-payment",
            "the refunds would exceed the payment",
        ));
    }
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

/// What every handler gets: the database and the settings.
#[derive(Clone)]
struct App {
    db: Db,
    config: Arc<Config>,
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
    // Before anything is held or charged: text the database cannot hold
    // (PostgreSQL refuses U+0000) would fail the payment's insert after its
    // charge, on every retry.
    if p.recipient.is_empty() || p.recipient.chars().count() > 64 || p.recipient.chars().any(char::is_control)
    {
        return invalid("recipient must be 1 to 64 characters, none of them a control character");
    }
    Ok(())
}

/// Whether `id` may name a payment: ids are made here (`pay_` and 24 hex
/// digits), so anything else is no payment, never a question for the
/// database (which refuses some text, U+0000 on PostgreSQL, as an error).
fn possible_payment_id(id: &str) -> bool {
    id.strip_prefix("pay_")
        .is_some_and(|hex| hex.len() == 24 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// The fake card gateway. It counts every call, waits its delay, and
/// charges at most once per charge key (a real gateway's idempotency).
/// `acct_declined` plays a declined card, `acct_unavailable` an outage.
/// Its writes are its own: they commit at once, outside the handler's
/// transaction.
async fn gateway_charge(
    app: &App,
    tenant: &str,
    charge_key: &str,
    amount: i64,
    recipient: &str,
) -> Result<(), ApiError> {
    app.db.count_gateway_call(tenant).await?;
    tokio::time::sleep(app.config.gateway_delay).await;
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
    app.db.record_charge(charge_key, tenant, amount).await?;
    Ok(())
}

async fn get_payment(
    State(app): State<App>,
    Extension(tenant): Extension<Tenant>,
    PaymentId(id): PaymentId,
) -> Result<Json<serde_json::Value>, ApiError> {
    let found = match possible_payment_id(&id) {
        true => app.db.payment(&id, tenant.as_str()).await?,
        false => None,
    };
    let (amount, currency, recipient, refunded) = found
        .ok_or_else(|| ApiError::problem(StatusCode::NOT_FOUND, "payment-not-found", "no such payment"))?;
    Ok(Json(serde_json::json!({
        "id": id, "amount": amount, "currency": currency, "recipient": recipient,
        "refunded": refunded, "status": "succeeded",
    })))
}

async fn ledger(
    State(app): State<App>,
    Extension(tenant): Extension<Tenant>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let ledger = app.db.ledger(tenant.as_str()).await?;
    Ok(Json(serde_json::json!({
        "charges": ledger.charges,
        "payments": ledger.payments,
        "gateway_calls": ledger.gateway_calls,
        "balance": ledger.balance,
    })))
}

/// `GET /health`: 200 when the store answers and its table is migrated,
/// 503 (with `Retry-After`) otherwise.
async fn health(State(app): State<App>) -> Result<Json<serde_json::Value>, ApiError> {
    match app.db.check_schema().await {
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

/// The routes: the payments API behind the demo authentication, under
/// `idem`'s layer; `GET /health` outside the authentication, for
/// orchestrators.
pub fn router(idem: Idem, db: Db, config: Config) -> Router {
    Router::new()
        .route("/v1/payments", post(create_payment))
        .route("/v1/payments/{id}", get(get_payment))
        .route("/v1/payments/{id}/refunds", post(create_refund))
        .route("/v1/ledger", get(ledger))
        .layer(idem.layer())
        .layer(middleware::from_fn(auth))
        .route("/health", get(health))
        .with_state(App {
            db,
            config: Arc::new(config),
        })
}

/// The largest request body: axum's default limit.
const BODY_LIMIT: usize = 2 * 1024 * 1024;

/// Reads the request body whole within `within`, before any handler (or
/// idem's reservation) sees the request: a body that trickles is answered
/// 408 and takes no key; one past the limit, 413.
pub async fn body_within(within: std::time::Duration, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    match tokio::time::timeout(within, axum::body::to_bytes(body, BODY_LIMIT)).await {
        Ok(Ok(bytes)) => {
            next.run(Request::from_parts(parts, axum::body::Body::from(bytes)))
                .await
        }
        Ok(Err(_)) => ApiError::problem(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body-too-large",
            "the request body is larger than 2 MiB, or broke off",
        )
        .into_response(),
        Err(_) => ApiError::problem(
            StatusCode::REQUEST_TIMEOUT,
            "body-timeout",
            "the request body did not arrive in time; send it again",
        )
        .into_response(),
    }
}

/// Demo authentication, not for production: the bearer token is the tenant
/// id (1 to 64 of `[A-Za-z0-9_-]`), in exactly one `Authorization` header
/// (two are ambiguous: which tenant's records would the request touch?).
async fn auth(mut req: Request, next: Next) -> Response {
    let mut all = req.headers().get_all(header::AUTHORIZATION).iter();
    let token = all
        .next()
        .filter(|_| all.next().is_none())
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
                "send one `Authorization: Bearer <tenant id>` header (1 to 64 of A-Z a-z 0-9 _ -)",
            )
            .into_response();
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            r
        }
    }
}

/// An answer of the service that is not a success. idem records it by its
/// status (README, "Classifying what the handler did"): 402 and 404 are
/// stored, 422 rejected, 503 released as failed.
/// A JSON body, as axum's `Json` reads it, whose refusal (not JSON, not
/// the expected shape, no JSON content type) is a problem like the
/// service's other refusals, rather than axum's plain text; idem
/// fingerprints it as JSON (`idem::FingerprintBody`).
struct ApiJson<T>(T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> axum::extract::FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(value)) => Ok(ApiJson(value)),
            Err(refused) => Err(ApiError::problem(
                refused.status(),
                "invalid-body",
                &refused.body_text(),
            )),
        }
    }
}

impl<T> idem::FingerprintBody for ApiJson<T> {
    const FORMAT: idem::BodyFormat = idem::BodyFormat::Json;
}

/// The `{id}` of a payment's path. One that is not UTF-8 once decoded is
/// an id the service never makes: it reads as the empty id, which names
/// no payment (404, as for any other), rather than as the router's
/// plain-text 400. idem fingerprints the path as the client sent it.
struct PaymentId(String);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for PaymentId {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, ApiError> {
        use axum::extract::path::ErrorKind;
        use axum::extract::rejection::PathRejection;
        match Path::<String>::from_request_parts(parts, state).await {
            Ok(Path(id)) => Ok(PaymentId(id)),
            Err(PathRejection::FailedToDeserializePathParams(e))
                if matches!(e.kind(), ErrorKind::InvalidUtf8InPathParam { .. }) =>
            {
                Ok(PaymentId(String::new()))
            }
            Err(refused) => Err(ApiError::problem(
                refused.status(),
                "invalid-path",
                &refused.body_text(),
            )),
        }
    }
}

#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    body: serde_json::Value,
    problem: bool,
}

impl ApiError {
    /// An RFC 9457 problem, `urn:payments:problem:{name}`.
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

    /// 402 `{"error": code}`: the payment was refused.
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
