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
