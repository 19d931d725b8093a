//! `#[idempotent]` over HTTP/2 (h2c, prior knowledge) as `axum::serve`
//! serves it, driven by a raw `h2` client: a key shared with HTTP/1.1,
//! concurrent streams on one connection, streams reset (RST_STREAM) at each
//! stage of a request, and connection-specific headers, which HTTP/2 forbids.

use axum::body::Bytes;
use axum::extract::{Path, Request, State};
use axum::http::{self, HeaderName, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::{routing, Json, Router};
use idem::{idempotent, Idem, Operation};
use idem_runtime::pause;
use idem_testkit::http::{post as h1_post, serve, Reply};
use idem_testkit::{unique, Fixture, StoreKind};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

const PATH: &str = "/v1/accounts/acct_1/payments?currency=EUR&note=a%20b";

/// What a handler may set that HTTP/2 forbids.
const CONNECTION_HEADERS: [(&str, &str); 6] = [
    ("connection", "keep-alive"),
    ("keep-alive", "timeout=5"),
    ("upgrade", "websocket"),
    ("te", "trailers"),
    ("transfer-encoding", "chunked"),
    ("proxy-connection", "keep-alive"),
];

#[derive(Clone, Default)]
struct App {
    /// Per event and key: "entered" the router, "done" there (answered or
    /// dropped), "ran" the handler.
    counts: Arc<Mutex<HashMap<(&'static str, String), u32>>>,
    /// A `gated` handler waits on its key's gate.
    gates: idem_testkit::Gates,
    payments: Arc<AtomicU64>,
}

impl App {
    fn bump(&self, event: &'static str, key: &str) {
        *self
            .counts
            .lock()
            .unwrap()
            .entry((event, key.to_owned()))
            .or_default() += 1;
    }
    fn count(&self, event: &'static str, key: &str) -> u32 {
        let counts = self.counts.lock().unwrap();
        counts.get(&(event, key.to_owned())).copied().unwrap_or(0)
    }
    /// Waits, for at most 20 s, until `event` happened to `key`.
    async fn until(&self, event: &'static str, key: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.count(event, key) == 0 {
            assert!(Instant::now() < deadline, "{key}: never {event}");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    fn gate(&self, key: &str) -> Arc<Notify> {
        self.gates.gate(key)
    }
}

#[derive(serde::Deserialize, serde::Serialize)]
struct In {
    amount: i64,
    /// `ok`; `gated`: waits for the test to open its key's gate;
    /// `connection-headers`: sets every [`CONNECTION_HEADERS`].
    mode: String,
}

#[idempotent(scope = "http2.pay", fields(amount, mode))]
async fn pay(State(app): State<App>, op: Operation, Path(acct): Path<String>, Json(p): Json<In>) -> Response {
    app.bump("ran", op.key());
    if p.mode == "gated" {
        app.gate(op.key()).notified().await;
    }
    let n = app.payments.fetch_add(1, Ordering::SeqCst);
    let body = format!(r#"{{"id": "pay_{n}", "acct": "{acct}", "amount": {}}}"#, p.amount);
    let headers = [
        ("content-type", "application/json".to_owned()),
        ("location", format!("/v1/payments/pay_{n}")),
        ("x-trace", format!("t{n}")),
    ];
    let mut response = (StatusCode::CREATED, headers, body).into_response();
    if p.mode == "connection-headers" {
        for (name, value) in CONNECTION_HEADERS {
            let (name, value) = (HeaderName::from_static(name), HeaderValue::from_static(value));
            response.headers_mut().insert(name, value);
        }
    }
    response
}

/// Counts, by key, the requests that enter the router, and those it is
/// done with: answered, or dropped unanswered (their stream was reset).
async fn watch(State(app): State<App>, request: Request, next: Next) -> Response {
    struct Done(App, String);
    impl Drop for Done {
        fn drop(&mut self) {
            self.0.bump("done", &self.1);
        }
    }
    let key = request
        .headers()
        .get("idempotency-key")
        .map(|k| k.to_str().unwrap());
    let key = key.unwrap_or_default().to_owned();
    app.bump("entered", &key);
    let _done = Done(app, key);
    next.run(request).await
}

struct H {
    kind: StoreKind,
    app: App,
    addr: SocketAddr,
    h2: h2::client::SendRequest<Bytes>,
    _fixture: Fixture,
}

async fn start(kind: StoreKind) -> Option<H> {
    let fixture = kind.fixture().await?;
    let idem = Idem::from_arc(fixture.store.clone())
        .single_tenant()
        .replay_headers(["x-trace"])
        .unwrap();
    let app = App::default();
    let router = Router::new()
        .route("/v1/accounts/{acct}/payments", routing::post(pay))
        .layer(idem.layer())
        .layer(middleware::from_fn_with_state(app.clone(), watch))
        .with_state(app.clone());
    let addr = serve(router).await;
    let h2 = connect(addr).await;
    Some(H {
        kind,
        app,
        addr,
        h2,
        _fixture: fixture,
    })
}

async fn connect(addr: SocketAddr) -> h2::client::SendRequest<Bytes> {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (client, connection) = h2::client::handshake(tcp).await.expect("h2 handshake");
    tokio::spawn(connection);
    client
}

fn body(amount: i64, mode: &str) -> String {
    format!(r#"{{"amount": {amount}, "mode": "{mode}"}}"#)
}

impl H {
    /// Opens a stream: the headers (no `content-length`), then `data`,
    /// with or without the end of the stream.
    async fn open(&self, path: &str, key: &str, data: &str, end: bool) -> Stream {
        let request = http::Request::post(format!("http://{}{path}", self.addr))
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .body(())
            .unwrap();
        let mut client = self.h2.clone().ready().await.unwrap();
        let (response, mut send) = client.send_request(request, false).unwrap();
        send.send_data(Bytes::from(data.to_owned()), end).unwrap();
        (response, send)
    }

    /// One whole exchange on the connection; an h2 protocol error fails.
    async fn post_to(&self, path: &str, key: &str, data: &str) -> Reply {
        let (response, _send) = self.open(path, key, data, true).await;
        let exchange = async {
            let (parts, mut body) = response.await?.into_parts();
            let mut bytes = Vec::new();
            while let Some(chunk) = body.data().await {
                let chunk = chunk?;
                body.flow_control().release_capacity(chunk.len())?;
                bytes.extend_from_slice(&chunk);
            }
            Ok::<_, h2::Error>(Reply {
                status: parts.status.as_u16(),
                headers: (parts.headers.iter())
                    .map(|(n, v)| (n.to_string(), v.to_str().unwrap().to_owned()))
                    .collect(),
                body: bytes,
            })
        };
        let reply = tokio::time::timeout(Duration::from_secs(30), exchange).await;
        reply.expect("an answer within 30 s").expect("an h2 exchange")
    }

    async fn post(&self, key: &str, data: &str) -> Reply {
        self.post_to(PATH, key, data).await
    }

    /// Posts until the answer is not 409 (an execution in progress), for
    /// at most 20 s.
    async fn wait_for_replay(&self, key: &str, data: &str) -> Reply {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let reply = self.post(key, data).await;
            if reply.status != 409 || Instant::now() > deadline {
                return reply;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

type Stream = (h2::client::ResponseFuture, h2::SendStream<Bytes>);

/// Resets a stream, and waits until the server is done with its request
/// (drops it, if it waits at a pause point or in a `gated` handler).
async fn reset(h: &H, key: &str, (response, mut send): Stream) {
    send.send_reset(h2::Reason::CANCEL);
    drop(response);
    h.app.until("done", key).await;
}

fn replayed(r: &Reply) -> bool {
    r.header("idempotent-replayed") == Some("true")
}

fn assert_replays(again: &Reply, first: &Reply) {
    assert!(replayed(again), "{again:?}");
    assert_eq!(
        (again.status, &again.body),
        (first.status, &first.body),
        "{again:?}"
    );
    for name in ["content-type", "location", "x-trace"] {
        assert_eq!(again.header(name), first.header(name), "{name}");
    }
}

/// A key names one request whatever the protocol: HTTP/1.1 then HTTP/2, and
/// the reverse, is a replay, status, body and headers alike. HTTP/2 sends
/// its URI in absolute form: the path and query still count, so another
/// path or query with the key is 422.
async fn a_key_is_one_request_over_http1_and_http2(h: H) {
    let b = body(4990, "ok");
    let k = unique("h1-then-h2");
    let first = h1_post(PATH, &b).key(&k).send(h.addr).await;
    assert_eq!((first.status, replayed(&first)), (201, false), "{first:?}");
    assert_replays(&h.post(&k, &b).await, &first);

    let k = unique("h2-then-h1");
    let first = h.post(&k, &b).await;
    assert_eq!((first.status, replayed(&first)), (201, false), "{first:?}");
    assert_replays(&h1_post(PATH, &b).key(&k).send(h.addr).await, &first);
    for other in [
        "/v1/accounts/acct_1/payments?currency=USD&note=a%20b",
        "/v1/accounts/acct_2/payments?currency=EUR&note=a%20b",
    ] {
        let r = h.post_to(other, &k, &b).await;
        assert_eq!(r.status, 422, "{other}: {r:?}");
    }
    assert_eq!(h.app.count("ran", &k), 1);
}

/// Twenty concurrent streams with one key on one connection are twenty
/// requests: one runs, the nineteen others are 409 while it does.
async fn twenty_streams_with_one_key_on_one_connection_run_once(h: H) {
    let h = Arc::new(h);
    let (k, b) = (unique("streams"), body(100, "gated"));
    let mut streams = tokio::task::JoinSet::new();
    for _ in 0..20 {
        let (h, k, b) = (h.clone(), k.clone(), b.clone());
        streams.spawn(async move { h.post(&k, &b).await });
    }
    for _ in 0..19 {
        let r = streams.join_next().await.unwrap().unwrap();
        assert_eq!(
            (r.status, r.problem().as_str()),
            (409, "idempotency-request-in-progress")
        );
        assert!(r.header("retry-after").is_some(), "{r:?}");
    }
    h.app.gate(&k).notify_one();
    let r = streams.join_next().await.unwrap().unwrap();
    assert_eq!((r.status, replayed(&r)), (201, false), "{r:?}");
    assert_eq!(h.app.count("ran", &k), 1);
}

/// A stream reset while its reservation is stopped at a pause point cancels
/// nothing: the request runs once, on its own, and the retry gets its
/// answer, as does a request on another connection.
async fn a_stream_reset_during_the_reservation_runs_once(h: H) {
    let store_points = match h.kind {
        StoreKind::Sqlite => vec![
            pause::SQLITE_RESERVE_AFTER_PEEK,
            pause::SQLITE_RESERVE_BEFORE_COMMIT,
        ],
        _ => vec![pause::RESERVE_TURN],
    };
    for point in [vec![pause::RESERVE_AFTER], store_points].concat() {
        let (k, b) = (unique("reset-reserving"), body(7, "ok"));
        let mut paused = pause::arm(point, &k);
        let stream = h.open(PATH, &k, &b, true).await;
        paused.reached().await;
        reset(&h, &k, stream).await;
        paused.resume();
        h.app.until("ran", &k).await;
        let retry = h.wait_for_replay(&k, &b).await;
        assert_eq!(
            (retry.status, replayed(&retry)),
            (201, true),
            "{point}: {retry:?}"
        );
        assert_replays(&h1_post(PATH, &b).key(&k).send(h.addr).await, &retry);
        assert_eq!(h.app.count("ran", &k), 1, "{point}");
    }
}

/// A stream reset while the handler runs cancels nothing: the retry is 409
/// until the execution ends, then its replay.
async fn a_stream_reset_while_the_handler_runs_is_409_then_replayed(h: H) {
    let (k, b) = (unique("reset-running"), body(8, "gated"));
    let stream = h.open(PATH, &k, &b, true).await;
    h.app.until("ran", &k).await;
    reset(&h, &k, stream).await;
    let during = h.post(&k, &b).await;
    assert_eq!(
        (during.status, during.problem().as_str()),
        (409, "idempotency-request-in-progress")
    );
    h.app.gate(&k).notify_one();
    let r = h.wait_for_replay(&k, &b).await;
    assert_eq!((r.status, replayed(&r)), (201, true), "{r:?}");
    assert_eq!(h.app.count("ran", &k), 1);
}

/// A stream reset part-way through a body sent without `content-length`
/// (the request's end is the stream's end): the handler never runs and
/// nothing is stored, so the key is free for another body.
async fn a_stream_reset_part_way_through_the_body_stores_nothing(h: H) {
    let k = unique("reset-body");
    let stream = h.open(PATH, &k, r#"{"amount": 1, "mo"#, false).await;
    h.app.until("entered", &k).await;
    reset(&h, &k, stream).await;
    assert_eq!(h.app.count("ran", &k), 0);
    let r = h.post(&k, &body(2, "ok")).await;
    assert_eq!((r.status, replayed(&r)), (201, false), "{r:?}");
    assert_eq!(h.app.count("ran", &k), 1);
}

/// Connection-specific headers the handler set are not replayed: HTTP/2
/// forbids them, and an h2 client refuses an answer that has one as a
/// protocol error. The replay parses, with none of them, and repeats the
/// answer.
async fn a_replay_over_http2_carries_no_connection_specific_headers(h: H) {
    let (k, b) = (unique("connection-headers"), body(11, "connection-headers"));
    let first = h.post(&k, &b).await;
    assert_eq!(first.status, 201, "{first:?}");
    let again = h.post(&k, &b).await;
    assert_replays(&again, &first);
    for (name, _) in CONNECTION_HEADERS {
        assert_eq!(again.header(name), None, "{name}: {again:?}");
    }
}

idem_testkit::for_each_store! {
    stores: [sqlite, postgres],
    setup: |kind| start(kind).await,
    worker_threads: 4,
    cases: [
        a_key_is_one_request_over_http1_and_http2,
        twenty_streams_with_one_key_on_one_connection_run_once,
        a_stream_reset_during_the_reservation_runs_once,
        a_stream_reset_while_the_handler_runs_is_409_then_replayed,
        a_stream_reset_part_way_through_the_body_stores_nothing,
        a_replay_over_http2_carries_no_connection_specific_headers,
    ],
}
