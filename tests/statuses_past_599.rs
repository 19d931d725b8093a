//! A status past 599 (600 to 999, which `http` lets a handler send) is no
//! HTTP status: RFC 9110 section 15 tells a client to process it as a 5xx,
//! so it is released as failed, as every 5xx is, never stored and replayed.

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use idem::{idempotent, Idem, MemoryStore};
use idem_testkit::http::{post as post_req, serve};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

#[idempotent(scope = "status.past")]
async fn answer(
    State(runs): State<Arc<AtomicU32>>,
    Query(q): Query<HashMap<String, u16>>,
) -> (StatusCode, String) {
    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
    (StatusCode::from_u16(q["s"]).unwrap(), format!("run {n}"))
}

#[tokio::test]
async fn a_status_past_599_is_released_as_failed_not_replayed() {
    let runs = Arc::new(AtomicU32::new(0));
    let router = Router::new()
        .route("/s", post(answer))
        .layer(Idem::new(MemoryStore::new()).single_tenant().layer())
        .with_state(runs.clone());
    let addr = serve(router).await;
    for (s, n) in [(600u16, 1), (999, 3)] {
        let (key, path) = (format!("k-{s}"), format!("/s?s={s}"));
        let first = post_req(&path, "").key(&key).send(addr).await;
        assert_eq!(
            (first.status, &first.body),
            (s, &format!("run {n}").into_bytes()),
            "{first:?}"
        );
        // The same request retried runs again (the next attempt)...
        let again = post_req(&path, "").key(&key).send(addr).await;
        assert_eq!(again.header("idempotent-replayed"), None, "{again:?}");
        assert_eq!(again.body, format!("run {}", n + 1).into_bytes(), "{again:?}");
        // ...and the key stays bound to it, as after any failure.
        let other = post_req(&format!("{path}&x=1"), "").key(&key).send(addr).await;
        assert_eq!(other.status, 422, "{other:?}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 4);
}
