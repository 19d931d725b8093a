//! An annotated handler's parameters live as an ordinary axum handler's do:
//! an extractor the handler's body never names (a lock, a permit, any
//! guard) is held until the handler has answered, not dropped before it
//! runs.

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Idem};
use idem_testkit::http::{post as post_req, serve};
use std::sync::atomic::{AtomicUsize, Ordering};

/// How many `Guard`s are alive.
static ALIVE: AtomicUsize = AtomicUsize::new(0);

/// Stands for a per-account lock held for the whole request.
struct Guard;

impl<S: Send + Sync> FromRequestParts<S> for Guard {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(_: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        ALIVE.fetch_add(1, Ordering::SeqCst);
        Ok(Guard)
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        ALIVE.fetch_sub(1, Ordering::SeqCst);
    }
}

#[derive(serde::Deserialize)]
struct PaymentIn {
    amount: i64,
}

#[idempotent(scope = "guard.named", body = "none")]
async fn named(_guard: Guard) -> String {
    format!("held {}", ALIVE.load(Ordering::SeqCst))
}

#[idempotent(scope = "guard.unnamed", fields(amount))]
async fn unnamed(_: Guard, Json(p): Json<PaymentIn>) -> String {
    format!("held {} for {}", ALIVE.load(Ordering::SeqCst), p.amount)
}

#[tokio::test]
async fn a_parameter_the_handler_never_names_lives_until_it_answers() {
    let app = Router::new()
        .route("/named", post(named))
        .route("/unnamed", post(unnamed))
        .layer(Idem::new(idem::MemoryStore::new()).single_tenant().layer());
    let addr = serve(app).await;
    let reply = post_req("/named", "").key("k-named").send(addr).await;
    assert_eq!((reply.status, text(&reply.body)), (200, "held 1"));
    let reply = post_req("/unnamed", r#"{"amount": 7}"#)
        .key("k-unnamed")
        .send(addr)
        .await;
    assert_eq!((reply.status, text(&reply.body)), (200, "held 1 for 7"));
    assert_eq!(ALIVE.load(Ordering::SeqCst), 0, "dropped once answered");
}

fn text(body: &[u8]) -> &str {
    std::str::from_utf8(body).unwrap()
}

/// How many times `with_auth_extractor` ran.
static AUTH_RUNS: AtomicUsize = AtomicUsize::new(0);

/// An extractor that establishes the tenant, written before the body.
struct Auth;

impl<S: Send + Sync> FromRequestParts<S> for Auth {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        parts.extensions.insert(idem::Tenant::new("acct_1"));
        Ok(Auth)
    }
}

#[idempotent(scope = "auth.extractor", fields(amount))]
async fn with_auth_extractor(_auth: Auth, Json(p): Json<PaymentIn>) -> String {
    AUTH_RUNS.fetch_add(1, Ordering::SeqCst);
    p.amount.to_string()
}

/// idem reads the tenant before the handler's own extractors run: one that
/// an extractor inserts is not seen, and the request is refused as having
/// none (500 `idempotency-misconfigured`), the handler never run (README,
/// "Tenants": insert it in a middleware).
#[tokio::test]
async fn a_tenant_inserted_by_an_extractor_is_not_seen_and_nothing_runs() {
    let app = Router::new()
        .route("/auth", post(with_auth_extractor))
        .layer(Idem::new(idem::MemoryStore::new()).layer());
    let addr = serve(app).await;
    let reply = post_req("/auth", r#"{"amount": 5}"#)
        .key("k-auth")
        .send(addr)
        .await;
    assert_eq!(reply.status, 500);
    assert_eq!(reply.problem(), "idempotency-misconfigured");
    assert_eq!(AUTH_RUNS.load(Ordering::SeqCst), 0);
}
