//! The lease covers producing the answer's body (contract, section 6) also
//! when nothing is kept: a failure's answer (released as failed) and a
//! rejected request's (released as rejected) are produced before their key
//! is let go, so that a retry meanwhile gets 409, never a second execution
//! beside the first; once the body has ended, the retry runs. A body
//! longer than the stored limit streams to its client under the lease too.

use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use futures_util::StreamExt as _;
use idem::{idempotent, Idem, Operation};
use idem_testkit::http::{post as post_req, serve};
use idem_testkit::StoreKind;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use tokio::sync::{mpsc, Notify};

/// The stored limit: the long bodies below are past it.
const LIMIT: usize = 64;

#[derive(Clone)]
struct S {
    runs: Arc<AtomicU32>,
    events: mpsc::UnboundedSender<&'static str>,
    gate: Arc<Notify>,
}

/// Each of the two parts of a first run's body: past the stored limit
/// when `long`, so that the answer streams from its first part on (the
/// second produced while it streams).
fn part(long: bool) -> String {
    if long {
        "x".repeat(LIMIT + 1)
    } else {
        "part ".into()
    }
}

/// The first run answers `?status=`, its body produced in two parts (the
/// second waits for the test): `?long=1` makes each longer than the stored
/// limit. Later runs answer 201.
#[idempotent(scope = "let_go.body")]
async fn answer(State(s): State<S>, _op: Operation, Query(q): Query<HashMap<String, u16>>) -> Response {
    if s.runs.fetch_add(1, Ordering::SeqCst) > 0 {
        return (StatusCode::CREATED, "done").into_response();
    }
    let status = StatusCode::from_u16(q["status"]).unwrap();
    let part = part(q.contains_key("long"));
    let (events, gate) = (s.events.clone(), s.gate.clone());
    let first = Ok::<_, std::io::Error>(Bytes::from(part.clone()));
    let rest = futures_util::stream::once(async move {
        events.send("produced in part").unwrap();
        gate.notified().await;
        Ok(Bytes::from(part))
    });
    (
        status,
        Body::from_stream(futures_util::stream::iter([first]).chain(rest)),
    )
        .into_response()
}

struct H {
    addr: SocketAddr,
    s: S,
    events: mpsc::UnboundedReceiver<&'static str>,
    _f: idem_testkit::Fixture,
}

async fn start(kind: StoreKind) -> Option<H> {
    let f = kind.fixture().await?;
    let (tx, events) = mpsc::unbounded_channel();
    let s = S {
        runs: Arc::default(),
        events: tx,
        gate: Arc::new(Notify::new()),
    };
    let idem = Idem::from_arc(f.store.clone())
        .single_tenant()
        .max_stored_body(LIMIT)
        .unwrap();
    let router = Router::new()
        .route("/a", post(answer))
        .layer(idem.layer())
        .with_state(s.clone());
    Some(H {
        addr: serve(router).await,
        s,
        events,
        _f: f,
    })
}

/// While the first run's answer (`status`, its body `long` or not) is
/// produced, a retry with its key gets 409; once it has ended, whole, the
/// retry runs.
async fn retried_while_produced(mut h: H, status: u16, long: bool) {
    let path = format!("/a?status={status}{}", if long { "&long=1" } else { "" });
    let key = format!("k-{status}-{long}");
    let first = tokio::spawn({
        let (addr, path, key) = (h.addr, path.clone(), key.clone());
        async move { post_req(&path, "").key(&key).send(addr).await }
    });
    assert_eq!(h.events.recv().await, Some("produced in part"));
    let meanwhile = post_req(&path, "").key(&key).send(h.addr).await;
    assert_eq!(
        (meanwhile.status, h.s.runs.load(Ordering::SeqCst)),
        (409, 1),
        "a retry while the first answer's body is produced: {meanwhile:?}"
    );
    h.s.gate.notify_one();
    let first = first.await.unwrap();
    let part = part(long);
    assert_eq!(first.status, status);
    assert_eq!(first.body, format!("{part}{part}").into_bytes(), "the whole body");
    let after = post_req(&path, "").key(&key).send(h.addr).await;
    assert_eq!(
        (after.status, after.body.as_slice()),
        (201, &b"done"[..]),
        "{after:?}"
    );
    assert_eq!(h.s.runs.load(Ordering::SeqCst), 2);
}

async fn a_failures_body_is_produced_before_its_key_is_released(h: H) {
    retried_while_produced(h, 503, false).await;
}

async fn a_rejections_body_is_produced_before_its_key_is_freed(h: H) {
    retried_while_produced(h, 400, false).await;
}

async fn a_failures_body_past_the_limit_streams_under_the_lease(h: H) {
    retried_while_produced(h, 500, true).await;
}

async fn a_rejections_body_past_the_limit_streams_under_the_lease(h: H) {
    retried_while_produced(h, 422, true).await;
}

idem_testkit::for_each_store! {
    stores: [memory, sqlite, postgres],
    setup: |kind| start(kind).await,
    worker_threads: 2,
    cases: [
        a_failures_body_is_produced_before_its_key_is_released,
        a_rejections_body_is_produced_before_its_key_is_freed,
        a_failures_body_past_the_limit_streams_under_the_lease,
        a_rejections_body_past_the_limit_streams_under_the_lease,
    ],
}
