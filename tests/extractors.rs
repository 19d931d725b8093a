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

/// How many times the handlers behind `Auth` ran.
static AUTH_RUNS: AtomicUsize = AtomicUsize::new(0);

/// An extractor that establishes the tenant from the request's bearer
/// token, written before the body, as an auth extractor is.
struct Auth;

impl<S: Send + Sync> FromRequestParts<S> for Auth {
    type Rejection = axum::http::StatusCode;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        let account = parts
            .headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .ok_or(axum::http::StatusCode::UNAUTHORIZED)?;
        parts.extensions.insert(idem::Tenant::new(account));
        Ok(Auth)
    }
}

#[idempotent(scope = "auth.json", fields(amount))]
async fn auth_json(_auth: Auth, Json(p): Json<PaymentIn>) -> String {
    format!("{} run {}", p.amount, AUTH_RUNS.fetch_add(1, Ordering::SeqCst))
}

#[idempotent(scope = "auth.text")]
async fn auth_text(_auth: Auth, body: String) -> String {
    format!("{body} run {}", AUTH_RUNS.fetch_add(1, Ordering::SeqCst))
}

#[idempotent(scope = "auth.none", body = "none")]
async fn auth_none(_auth: Auth) -> String {
    format!("run {}", AUTH_RUNS.fetch_add(1, Ordering::SeqCst))
}

/// A tenant that one of the handler's own extractors establishes (an auth
/// extractor written before the body) is the request's tenant, whatever
/// the body: a retry replays, and another tenant's request under the same
/// key is its own (README, "Tenants").
#[tokio::test]
async fn a_tenant_established_by_an_extractor_keys_the_record() {
    let app = Router::new()
        .route("/json", post(auth_json))
        .route("/text", post(auth_text))
        .route("/none", post(auth_none))
        .layer(Idem::new(idem::MemoryStore::new()).layer());
    let addr = serve(app).await;
    for (path, body) in [("/json", r#"{"amount": 5}"#), ("/text", "hello"), ("/none", "")] {
        let send = |account: &str| {
            let request = post_req(path, body)
                .key("k-auth")
                .header("authorization", format!("Bearer {account}"));
            async move { request.send(addr).await }
        };
        let first = send("acct_1").await;
        assert_eq!(
            first.status,
            200,
            "{path}: {}",
            String::from_utf8_lossy(&first.body)
        );
        let again = send("acct_1").await;
        assert_eq!(
            (again.status, again.body.clone()),
            (200, first.body.clone()),
            "{path}"
        );
        assert_eq!(again.header("idempotent-replayed"), Some("true"), "{path}");
        let other = send("acct_2").await;
        assert_eq!(
            other.status,
            200,
            "{path}: {}",
            String::from_utf8_lossy(&other.body)
        );
        assert_ne!(
            other.body, first.body,
            "{path}: another tenant got the first one's answer"
        );
        assert_eq!(other.header("idempotent-replayed"), None, "{path}");
    }
    assert_eq!(AUTH_RUNS.load(Ordering::SeqCst), 6);
}
