//! A rejection's (or a failure's) answer past the stored limit, for a
//! client that cannot tell a broken body from a whole one (a HEAD, HTTP/1.0
//! without a length): read to its end under the lease, and given only once
//! its key is let go; a body that fails is a failure (500), never a
//! whole-looking refusal whose key stays bound.

use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use futures_util::StreamExt as _;
use idem::{idempotent, Idem, Operation};
use idem_testkit::http::{exchange, head_request, http10_request, parse, post as post_req, split};
use idem_testkit::StoreKind;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::sync::mpsc;

const LIMIT: usize = 64;

#[derive(Clone)]
struct App {
    runs: idem_testkit::Runs,
    gates: idem_testkit::Gates,
    events: mpsc::UnboundedSender<String>,
}

fn chunk(c: &str, n: usize) -> Result<Bytes, std::io::Error> {
    Ok(Bytes::from(c.repeat(n)))
}

/// First run of a key: `?status=`, 80 bytes (past the limit), then a
/// failure. Later runs: 201 "done".
#[idempotent(scope = "let_go.breaks")]
async fn breaks(State(app): State<App>, op: Operation, Query(q): Query<HashMap<String, String>>) -> Response {
    if app.runs.ran(op.key()) > 1 {
        return (StatusCode::CREATED, "done").into_response();
    }
    let status = StatusCode::from_u16(q["status"].parse().unwrap()).unwrap();
    let body = futures_util::stream::iter([
        chunk("a", 40),
        chunk("b", 40),
        Err(std::io::Error::other("broken")),
    ]);
    (status, Body::from_stream(body)).into_response()
}

/// First run of a key: `?status=`, 80 bytes, then 10 more once the key's
/// gate opens. Later runs: 201 "done".
#[idempotent(scope = "let_go.gated")]
async fn gated(State(app): State<App>, op: Operation, Query(q): Query<HashMap<String, String>>) -> Response {
    let key = op.key().to_owned();
    if app.runs.ran(&key) > 1 {
        return (StatusCode::CREATED, "done").into_response();
    }
    let status = StatusCode::from_u16(q["status"].parse().unwrap()).unwrap();
    let gate = app.gates.gate(&key);
    let _ = app.events.send(format!("gated {key}"));
    let last = async move {
        gate.notified().await;
        chunk("c", 10)
    };
    let body =
        futures_util::stream::iter([chunk("a", 40), chunk("b", 40)]).chain(futures_util::stream::once(last));
    (status, Body::from_stream(body)).into_response()
}

struct H {
    addr: SocketAddr,
    app: App,
    events: mpsc::UnboundedReceiver<String>,
    _f: idem_testkit::Fixture,
}

async fn start(kind: StoreKind) -> Option<H> {
    let f = kind.fixture().await?;
    let (tx, events) = mpsc::unbounded_channel();
    let app = App {
        runs: idem_testkit::Runs::default(),
        gates: idem_testkit::Gates::default(),
        events: tx,
    };
    let idem = Idem::from_arc(f.store.clone())
        .single_tenant()
        .max_stored_body(LIMIT)
        .unwrap();
    let router = Router::new()
        .route("/breaks", get(breaks).post(breaks))
        .route("/gated", get(gated).post(gated))
        .layer(idem.layer())
        .with_state(app.clone());
    Some(H {
        addr: idem_testkit::http::serve(router).await,
        app,
        events,
        _f: f,
    })
}

/// A GET (HTTP/1.1) of `path` with `key` until it is not 409.
async fn get_after(addr: SocketAddr, path: &str, key: &str) -> idem_testkit::http::Reply {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let request =
            format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\nidempotency-key: {key}\r\n\r\n");
        let r = parse(&exchange(addr, request).await.0);
        if r.status != 409 || std::time::Instant::now() > deadline {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// HTTP/1.0 (no length): a 400 past the limit whose body then fails, read
/// to its end before anything is given: the client gets 500
/// `handler-failed` (it could not have told the break), and the key is
/// released as failed, bound to its request (the corrected one: 422), as
/// for a stored answer's body that fails. Never a whole-looking 400 whose
/// key is bound.
async fn http10_rejection_past_limit_that_fails(h: H) {
    let key = "k-10-reject-fails";
    let (out, res) = exchange(h.addr, http10_request("/breaks?status=400&v=1", key)).await;
    let (status, body) = split(&out);
    let body = String::from_utf8_lossy(body).into_owned();
    // The client's corrected request (another query: another fingerprint).
    let fixed = post_req("/breaks?status=400&v=2", "")
        .key(key)
        .wait_for_replay(h.addr)
        .await;
    assert!(
        matches!((status, fixed.status), (500, 422)),
        "first: status {status}, close {res:?}, body {body:?}; the corrected request with the key: {} {:?} (runs {})",
        fixed.status,
        String::from_utf8_lossy(&fixed.body),
        h.app.runs.of(key)
    );
}

/// HEAD: the same, the client sees its answer's head only.
async fn head_rejection_past_limit_that_fails(h: H) {
    let key = "k-head-reject-fails";
    let (out, res) = exchange(h.addr, head_request("/breaks?status=400&v=1", key)).await;
    let (status, _) = split(&out);
    let fixed = get_after(h.addr, "/breaks?status=400&v=2", key).await;
    assert!(
        matches!((status, fixed.status), (500, 422)),
        "HEAD: status {status}, close {res:?}, {:?}; the corrected GET with the key: {} {:?} (runs {})",
        String::from_utf8_lossy(&out),
        fixed.status,
        String::from_utf8_lossy(&fixed.body),
        h.app.runs.of(key)
    );
}

/// HEAD: a 400 past the limit whose body is still produced. The HEAD's
/// whole answer (its status, the connection closed) must not go out
/// before the key is let go ("then the key let go, then given"): a client
/// holding its final 400 may send the corrected request at once.
async fn head_rejection_past_limit_given_before_let_go(mut h: H) {
    let key = "k-head-reject-gated";
    let first = tokio::spawn(exchange(h.addr, head_request("/gated?status=400&v=1", key)));
    assert_eq!(h.events.recv().await, Some(format!("gated {key}")));
    // Gate still closed: the body is not done, the key not let go.
    // A bound, not an ordering: given early, it would be at once.
    let done_early = tokio::time::timeout(Duration::from_millis(500), async {
        loop {
            if first.is_finished() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .is_ok();
    let fixed = if done_early {
        Some(post_req("/gated?status=400&v=2", "").key(key).send(h.addr).await)
    } else {
        None
    };
    h.app.gates.gate(key).notify_one();
    let (out, _) = first.await.unwrap();
    assert!(
        !done_early,
        "the HEAD client had its whole answer {:?} while the key was still held (body gated); its corrected \
         request then got {:?}",
        String::from_utf8_lossy(&out),
        fixed.map(|f| (f.status, String::from_utf8_lossy(&f.body).into_owned()))
    );
}

idem_testkit::for_each_store! {
    stores: [memory, sqlite, postgres],
    setup: |kind| start(kind).await,
    worker_threads: 2,
    cases: [
        http10_rejection_past_limit_that_fails,
        head_rejection_past_limit_that_fails,
        head_rejection_past_limit_given_before_let_go,
    ],
}
