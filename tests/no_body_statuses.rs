//! Answers whose status carries no body on the wire (204, 304): the server
//! sends none and never reads the handler's, so neither does idem. The
//! answer is its status and headers, recorded before they go out, and
//! replayed the same. A handler's body past the stored limit was streamed
//! instead: the client got a whole-looking 204 at its head, before anything
//! was recorded, and when that body then failed the key was let go and the
//! retry ran the handler again.

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures_util::StreamExt as _;
use idem::{idempotent, Idem, MemoryStore, Operation};
use idem_testkit::http::{get as get_req, post as post_req, serve, Request};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

#[derive(Clone, Default)]
struct App {
    runs: Arc<AtomicUsize>,
    /// How many times a handler's body was read.
    read: Arc<AtomicUsize>,
}

/// `status` with 80 bytes (past the stored limit of 16) and then a body
/// that fails: what hyper never reads.
fn answer(app: &App, status: StatusCode) -> Response {
    app.runs.fetch_add(1, Ordering::SeqCst);
    let read = app.read.clone();
    let body = futures_util::stream::once(async move {
        read.fetch_add(1, Ordering::SeqCst);
        Ok::<_, std::io::Error>(Bytes::from("x".repeat(80)))
    })
    .chain(futures_util::stream::once(async {
        Err(std::io::Error::other("the body failed"))
    }));
    (status, Body::from_stream(body)).into_response()
}

#[idempotent(scope = "nobody.no_content", body = "none")]
async fn no_content(State(app): State<App>, _op: Operation) -> Response {
    answer(&app, StatusCode::NO_CONTENT)
}

#[idempotent(scope = "nobody.not_modified", body = "none")]
async fn not_modified(State(app): State<App>, _op: Operation) -> Response {
    answer(&app, StatusCode::NOT_MODIFIED)
}

#[idempotent(scope = "nobody.events", body = "none")]
async fn events(State(app): State<App>, _op: Operation) -> Response {
    app.runs.fetch_add(1, Ordering::SeqCst);
    (
        StatusCode::NO_CONTENT,
        [("content-type", "text/event-stream")],
        "data: x\n\n",
    )
        .into_response()
}

#[idempotent(scope = "nobody.small", body = "none")]
async fn small(State(app): State<App>, _op: Operation) -> (StatusCode, &'static str) {
    app.runs.fetch_add(1, Ordering::SeqCst);
    (StatusCode::NO_CONTENT, "never sent")
}

async fn start() -> (SocketAddr, App) {
    let app = App::default();
    let idem = Idem::new(MemoryStore::new())
        .single_tenant()
        .max_stored_body(16)
        .unwrap();
    let router = Router::new()
        .route("/no-content", post(no_content))
        .route("/not-modified", get(not_modified))
        .route("/small", post(small))
        .route("/events", post(events))
        .layer(idem.layer())
        .with_state(app.clone());
    (serve(router).await, app)
}

/// Answered `status` with no body, recorded by then (the next request is
/// its replay, the same on the wire), the handler run once and its body
/// never read.
async fn answered_then_replayed(path: &str, request: Request, status: u16) {
    let (addr, app) = start().await;
    let first = request.send(addr).await;
    assert_eq!((first.status, first.body.len()), (status, 0), "{path}: {first:?}");
    let again = request.send(addr).await;
    assert_eq!(
        again.header("idempotent-replayed"),
        Some("true"),
        "{path}: {again:?}"
    );
    assert_eq!((again.status, again.body.len()), (status, 0));
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
    assert_eq!(
        app.read.load(Ordering::SeqCst),
        0,
        "{path}: the handler's body was read"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_204_is_recorded_before_it_goes_out_and_its_body_is_not_read() {
    answered_then_replayed("/no-content", post_req("/no-content", "").key("k-204"), 204).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_304_is_recorded_before_it_goes_out_and_its_body_is_not_read() {
    answered_then_replayed("/not-modified", get_req("/not-modified").key("k-304"), 304).await;
}

/// A 204 whose handler gave a small body: the replay is the answer as it
/// went out, no body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_204_with_a_small_body_replays_as_it_went_out() {
    let (addr, app) = start().await;
    let request = post_req("/small", "").key("k-small");
    let first = request.send(addr).await;
    let again = request.send(addr).await;
    assert_eq!((first.status, first.body.len()), (204, 0), "{first:?}");
    assert_eq!((again.status, again.body.len()), (204, 0), "{again:?}");
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
}

/// A 204 with an event stream's type: nothing streams, and the replay
/// carries the type and the whole (empty) answer as it went out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_204_with_an_event_streams_type_replays_as_it_went_out() {
    let (addr, app) = start().await;
    let request = post_req("/events", "").key("k-events");
    let first = request.send(addr).await;
    let again = request.send(addr).await;
    assert_eq!(
        (first.status, first.header("content-type")),
        (204, Some("text/event-stream"))
    );
    assert_eq!(
        (again.status, again.header("content-type")),
        (204, Some("text/event-stream")),
        "{again:?}"
    );
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.header("idempotent-replay-body-omitted"), None);
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
}
