//! What a replay carries, over real HTTP on every store: the headers
//! without which the stored answer is not the answer (a body's encoding, a
//! 401's challenge when named), never the headers of another connection;
//! a `HEAD` told the length of an answer too large to keep; and a 1xx,
//! which HTTP cannot send as a final answer, never stored as one (but a
//! 101, an upgrade, goes out as it does without idem).

use axum::extract::{Query, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use idem::{idempotent, Idem, Operation};
use idem_testkit::http::{get as get_req, head, post as post_req, serve};
use idem_testkit::Fixture;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

/// How many times the handler ran, by key.
#[derive(Clone, Default)]
struct Runs(Arc<Mutex<HashMap<String, u32>>>);

impl Runs {
    fn of(&self, key: &str) -> u32 {
        self.0.lock().unwrap().get(key).copied().unwrap_or(0)
    }
}

/// `{"id":"pay_1"}`, compressed with gzip by the handler itself.
const GZIPPED: &[u8] = &[
    0x1f, 0x8b, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x02, 0x03, 0xab, 0x56, 0xca, 0x4c, 0x51, 0xb2, 0x52,
    0x2a, 0x48, 0xac, 0x8c, 0x37, 0x54, 0xaa, 0x05, 0x00, 0xe0, 0x15, 0x1f, 0x5d, 0x0e, 0x00, 0x00, 0x00,
];

/// The stored limit of the layer below: `big` answers are past it.
const LIMIT: usize = 1024;

/// Answers as `?kind=` says.
#[idempotent(scope = "answer.kinds")]
async fn answer(
    State(runs): State<Runs>,
    op: Operation,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    *runs.0.lock().unwrap().entry(op.key().to_owned()).or_default() += 1;
    match q.get("kind").map(String::as_str).unwrap_or_default() {
        "gzip" => (
            StatusCode::CREATED,
            [
                (header::CONTENT_TYPE, "application/json"),
                (header::CONTENT_ENCODING, "gzip"),
            ],
            GZIPPED,
        )
            .into_response(),
        "unauthorized" => (
            StatusCode::UNAUTHORIZED,
            [(
                header::WWW_AUTHENTICATE,
                r#"Bearer realm="api", error="invalid_token""#,
            )],
            "expired",
        )
            .into_response(),
        "keep-alive" => {
            let mut r = (StatusCode::CREATED, "made").into_response();
            r.headers_mut()
                .insert("keep-alive", HeaderValue::from_static("timeout=5, max=1000"));
            r
        }
        "big" => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/octet-stream")],
            vec![b'z'; 4 * LIMIT],
        )
            .into_response(),
        "big-gzip" => (
            StatusCode::OK,
            [
                (header::CONTENT_TYPE, "application/json"),
                (header::CONTENT_ENCODING, "gzip"),
            ],
            [GZIPPED, &[0u8; 4 * LIMIT][..]].concat(),
        )
            .into_response(),
        "small" => (StatusCode::OK, "ok").into_response(),
        // Whole and small, with a media type that begins like an event
        // stream's (and one that is an event stream's, with a parameter).
        kind @ ("event-streamx" | "event-stream-json" | "event-stream-charset") => {
            let media = match kind {
                "event-streamx" => "text/event-streamx",
                "event-stream-json" => "text/event-stream-json",
                _ => "Text/Event-Stream ; charset=utf-8",
            };
            (
                StatusCode::CREATED,
                [(header::CONTENT_TYPE, media)],
                "whole-answer",
            )
                .into_response()
        }
        "early-hints" => (StatusCode::from_u16(103).unwrap(), "early hints").into_response(),
        other => panic!("no kind {other}"),
    }
}

struct App {
    addr: SocketAddr,
    runs: Runs,
    _fixture: Fixture,
}

async fn app(fixture: Fixture) -> App {
    let runs = Runs::default();
    let idem = Idem::from_arc(fixture.store.clone())
        .single_tenant()
        .max_stored_body(LIMIT)
        .unwrap()
        .replay_headers(["www-authenticate"])
        .unwrap();
    let router = Router::new()
        .route("/a", get(answer).post(answer))
        .layer(idem.layer())
        .with_state(runs.clone());
    App {
        addr: serve(router).await,
        runs,
        _fixture: fixture,
    }
}

/// A body the handler compressed itself is replayed with its
/// `content-encoding`, stored without being named: without it, the same
/// bytes would be read as plain JSON.
async fn a_body_encoded_by_the_handler_is_replayed_with_its_encoding(a: App) {
    let send = || async move { post_req("/a?kind=gzip", "").key("k-gzip").send(a.addr).await };
    let first = send().await;
    assert_eq!(first.header("content-encoding"), Some("gzip"), "{first:?}");
    let again = send().await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"), "{again:?}");
    assert_eq!(again.header("content-encoding"), Some("gzip"), "{again:?}");
    assert_eq!(again.header("content-type"), Some("application/json"));
    assert_eq!(again.body, GZIPPED);
    assert_eq!(a.runs.of("k-gzip"), 1);
}

/// Past the stored limit, the replay has no body: nothing for its type or
/// its encoding to describe, so neither is replayed (an empty payload
/// labelled gzip is no gzip stream).
async fn an_omitted_body_is_replayed_without_its_encoding(a: App) {
    let send = || async move {
        post_req("/a?kind=big-gzip", "")
            .key("k-big-gzip")
            .send(a.addr)
            .await
    };
    let first = send().await;
    assert_eq!(first.header("content-encoding"), Some("gzip"), "{first:?}");
    let again = send().await;
    assert_eq!(
        again.header("idempotent-replay-body-omitted"),
        Some("true"),
        "{again:?}"
    );
    assert!(again.body.is_empty());
    assert_eq!(again.header("content-type"), None, "{again:?}");
    assert_eq!(again.header("content-encoding"), None, "{again:?}");
    assert_eq!(a.runs.of("k-big-gzip"), 1);
}

/// A 401 the handler answers is stored (a rejection), and, with
/// `www-authenticate` named, replayed with its challenge.
async fn a_stored_401_is_replayed_with_its_named_challenge(a: App) {
    let send = || async move {
        post_req("/a?kind=unauthorized", "")
            .key("k-401")
            .send(a.addr)
            .await
    };
    let first = send().await;
    assert_eq!(first.status, 401, "{first:?}");
    let again = send().await;
    assert_eq!(
        (again.status, again.header("idempotent-replayed")),
        (401, Some("true")),
        "{again:?}"
    );
    assert_eq!(
        again.header("www-authenticate"),
        Some(r#"Bearer realm="api", error="invalid_token""#)
    );
    assert_eq!(a.runs.of("k-401"), 1);
}

/// A HEAD of an answer past the stored limit is told the length its GET
/// has, as without idem, not the length of the body it does not get.
async fn a_head_of_an_answer_past_the_limit_is_told_its_length(a: App) {
    let heads = head("/a?kind=big").key("k-head-big").send(a.addr).await;
    assert_eq!(heads.status, 200, "{heads:?}");
    let length = (4 * LIMIT).to_string();
    assert_eq!(heads.header("content-length"), Some(length.as_str()), "{heads:?}");
    assert!(heads.body.is_empty());
    let got = get_req("/a?kind=big").key("k-get-big").send(a.addr).await;
    assert_eq!(got.body.len(), 4 * LIMIT);
    // Within the limit, as it was.
    let small = head("/a?kind=small").key("k-head-small").send(a.addr).await;
    assert_eq!(small.header("content-length"), Some("2"), "{small:?}");
}

/// A 1xx as a final answer (HTTP cannot send one): not stored, the key
/// released as failed; the client gets 500 `handler-failed`, and its
/// retry runs the handler again.
async fn an_informational_status_is_no_answer(a: App) {
    let send = || async move {
        post_req("/a?kind=early-hints", "")
            .key("k-103")
            .send(a.addr)
            .await
    };
    let first = send().await;
    assert_eq!(first.problem(), "handler-failed", "{first:?}");
    assert_eq!(first.status, 500);
    let again = send().await;
    assert_eq!(again.problem(), "handler-failed", "{again:?}");
    assert_eq!(a.runs.of("k-103"), 2, "the retry was answered from a record");
}

/// Only `text/event-stream` (any case, with or without parameters) is an
/// event stream, completed at its headers; another media type that begins
/// with its letters is an ordinary answer, replayed byte for byte.
async fn only_the_event_stream_media_type_is_completed_at_its_headers(a: App) {
    for (kind, media) in [
        ("event-streamx", "text/event-streamx"),
        ("event-stream-json", "text/event-stream-json"),
    ] {
        let (key, path) = (format!("k-{kind}"), format!("/a?kind={kind}"));
        let send = || async { post_req(&path, "").key(&key).send(a.addr).await };
        assert_eq!(send().await.body, b"whole-answer");
        let again = send().await;
        assert_eq!(again.header("idempotent-replayed"), Some("true"), "{again:?}");
        assert_eq!(again.header("idempotent-replay-body-omitted"), None, "{again:?}");
        assert_eq!(again.header("content-type"), Some(media), "{again:?}");
        assert_eq!(again.body, b"whole-answer", "{kind}");
    }
    let send = || async move {
        post_req("/a?kind=event-stream-charset", "")
            .key("k-event-stream-charset")
            .send(a.addr)
            .await
    };
    assert_eq!(send().await.body, b"whole-answer");
    let again = send().await;
    assert_eq!(
        again.header("idempotent-replay-body-omitted"),
        Some("true"),
        "{again:?}"
    );
    assert!(again.body.is_empty());
}

idem_testkit::for_each_store! {
    stores: [memory, sqlite, postgres],
    setup: |kind| (match kind.fixture().await { Some(f) => Some(app(f).await), None => None }),
    worker_threads: 2,
    cases: [
        a_body_encoded_by_the_handler_is_replayed_with_its_encoding,
        an_omitted_body_is_replayed_without_its_encoding,
        a_stored_401_is_replayed_with_its_named_challenge,
        a_head_of_an_answer_past_the_limit_is_told_its_length,
        an_informational_status_is_no_answer,
        only_the_event_stream_media_type_is_completed_at_its_headers,
    ],
}

/// The headers of one connection are never stored, named or not:
/// `replay_headers` refuses them, as it refuses `connection`.
#[test]
fn the_headers_of_one_connection_cannot_be_named() {
    let idem = || Idem::new(idem::MemoryStore::new());
    for name in [
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
        "proxy-authenticate",
        "transfer-encoding",
    ] {
        let refused = idem().replay_headers([name]).err().map(|e| e.to_string());
        assert!(
            refused.as_deref().is_some_and(|e| e.contains("never stored")),
            "{name}: {refused:?}"
        );
    }
    assert!(idem().replay_headers(["www-authenticate"]).is_ok());
}

/// And unnamed, another connection's `keep-alive` is not replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_connections_keep_alive_is_not_replayed() {
    let a = app(Fixture::memory()).await;
    let send = || async move {
        post_req("/a?kind=keep-alive", "")
            .key("k-keep-alive")
            .send(a.addr)
            .await
    };
    let first = send().await;
    assert_eq!(first.header("keep-alive"), Some("timeout=5, max=1000"));
    let again = send().await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"), "{again:?}");
    assert_eq!(again.header("keep-alive"), None, "{again:?}");
}

/// 101 Switching Protocols is the one 1xx that goes out as the answer (an
/// upgrade): under the attribute the handler's upgrade happens, as
/// without it.
mod upgrades {
    use super::*;
    use axum::extract::FromRequestParts;
    use axum::http::request::Parts;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// The connection's upgrade, taken from the request.
    struct Upgrade(hyper::upgrade::OnUpgrade);

    impl<S: Send + Sync> FromRequestParts<S> for Upgrade {
        type Rejection = StatusCode;
        async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
            parts
                .extensions
                .remove::<hyper::upgrade::OnUpgrade>()
                .map(Upgrade)
                .ok_or(StatusCode::UPGRADE_REQUIRED)
        }
    }

    /// Answers 101, then says `hello` on the upgraded connection.
    fn switch(Upgrade(on): Upgrade) -> Response {
        tokio::spawn(async move {
            if let Ok(upgraded) = on.await {
                let mut io = hyper_util::rt::TokioIo::new(upgraded);
                let _ = io.write_all(b"hello").await;
                let _ = io.shutdown().await;
            }
        });
        (
            StatusCode::SWITCHING_PROTOCOLS,
            [(header::CONNECTION, "upgrade"), (header::UPGRADE, "echo")],
        )
            .into_response()
    }

    #[idempotent(scope = "answer.upgrade", body = "none")]
    async fn upgrade(State(runs): State<Runs>, op: Operation, up: Upgrade) -> Response {
        *runs.0.lock().unwrap().entry(op.key().to_owned()).or_default() += 1;
        switch(up)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_upgrade_goes_out_as_it_does_without_idem() {
        let runs = Runs::default();
        let router = Router::new()
            .route("/up", get(upgrade))
            .layer(Idem::new(idem::MemoryStore::new()).single_tenant().layer())
            .with_state(runs.clone());
        let addr = serve(router).await;
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = format!(
            "GET /up HTTP/1.1\r\nhost: {addr}\r\nconnection: upgrade\r\nupgrade: echo\r\nidempotency-key: k-up\r\n\r\n"
        );
        s.write_all(request.as_bytes()).await.unwrap();
        let mut raw = Vec::new();
        // The upgraded side says `hello`, then closes.
        tokio::time::timeout(std::time::Duration::from_secs(10), s.read_to_end(&mut raw))
            .await
            .expect("the upgraded connection ends within 10 s")
            .unwrap();
        let raw = String::from_utf8_lossy(&raw);
        assert!(raw.starts_with("HTTP/1.1 101"), "{raw}");
        assert!(raw.ends_with("hello"), "{raw}");
        assert_eq!(runs.of("k-up"), 1);
    }
}

/// HTTP trailers, which idem neither stores nor passes on (README, "What is
/// stored"): the first answer is the data without them, and without the
/// `Trailer` header that would announce them (it went out announcing a
/// trailer that never came), as its replay is.
mod trailers {
    use super::*;
    use axum::body::{Body, Bytes};
    use hyper::body::Frame;
    use std::pin::Pin;
    use std::task::{Context, Poll};

    /// `abc`, then the trailer `x-checksum`.
    struct WithTrailer(u8);

    impl hyper::body::Body for WithTrailer {
        type Data = Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            self.0 += 1;
            Poll::Ready(match self.0 {
                1 => Some(Ok(Frame::data(Bytes::from_static(b"abc")))),
                2 => {
                    let mut trailers = axum::http::HeaderMap::new();
                    trailers.insert("x-checksum", HeaderValue::from_static("sha256-abc"));
                    Some(Ok(Frame::trailers(trailers)))
                }
                _ => None,
            })
        }
    }

    fn with_trailer() -> Response {
        (
            StatusCode::CREATED,
            [(header::TRAILER, "x-checksum")],
            Body::new(WithTrailer(0)),
        )
            .into_response()
    }

    async fn bare() -> Response {
        with_trailer()
    }

    #[idempotent(scope = "answer.trailers", body = "none")]
    async fn keyed() -> Response {
        with_trailer()
    }

    /// `with_trailer`'s body and header under `status`.
    fn with_trailer_as(status: StatusCode) -> Response {
        let mut response = with_trailer();
        *response.status_mut() = status;
        response
    }

    #[idempotent(scope = "answer.trailers.reject", body = "none")]
    async fn rejected() -> Response {
        with_trailer_as(StatusCode::UNPROCESSABLE_ENTITY)
    }

    #[idempotent(scope = "answer.trailers.fail", body = "none")]
    async fn failed() -> Response {
        with_trailer_as(StatusCode::SERVICE_UNAVAILABLE)
    }

    /// A rejected answer (its key released to a corrected request) and a
    /// failed one (its key released for the retry) are not stored, and go
    /// out as a stored one does: their data, and neither the trailer nor
    /// the header that announces it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_rejected_or_failed_answer_announces_and_sends_no_trailer() {
        let router = Router::new()
            .route("/reject", axum::routing::post(rejected))
            .route("/fail", axum::routing::post(failed))
            .layer(Idem::new(idem::MemoryStore::new()).single_tenant().layer());
        let addr = serve(router).await;
        for (path, status) in [("/reject", "422"), ("/fail", "503")] {
            let raw = post_req(path, "")
                .header("te", "trailers")
                .key("k-tr")
                .send_raw(addr)
                .await;
            let raw = String::from_utf8_lossy(&raw).to_lowercase();
            assert!(raw.starts_with(&format!("http/1.1 {status}")), "{path}: {raw}");
            assert!(!raw.contains("x-checksum"), "{path}: {raw}");
            // Read whole under the lease before its key is let go, then
            // given with its length: its data, with no trailer after it.
            assert!(raw.contains("content-length: 3\r\n"), "{path}: {raw}");
            assert!(raw.ends_with("\r\n\r\nabc"), "{path}: {raw}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_first_answer_announces_no_trailer_it_does_not_send() {
        let router = Router::new()
            .route("/bare", axum::routing::post(bare))
            .route("/keyed", axum::routing::post(keyed))
            .layer(Idem::new(idem::MemoryStore::new()).single_tenant().layer());
        let addr = serve(router).await;
        // Without idem, the trailer goes out (the client asks for them).
        let raw = post_req("/bare", "")
            .header("te", "trailers")
            .send_raw(addr)
            .await;
        let raw = String::from_utf8_lossy(&raw).to_lowercase();
        assert!(
            raw.contains("trailer: x-checksum") && raw.contains("x-checksum: sha256-abc"),
            "{raw}"
        );
        for attempt in ["first", "replay"] {
            let raw = post_req("/keyed", "")
                .header("te", "trailers")
                .key("k-tr")
                .send_raw(addr)
                .await;
            let raw = String::from_utf8_lossy(&raw).to_lowercase();
            assert!(raw.starts_with("http/1.1 201"), "{attempt}: {raw}");
            assert!(!raw.contains("x-checksum"), "{attempt}: {raw}");
            assert!(
                raw.contains("content-length: 3\r\n") && raw.ends_with("\r\n\r\nabc"),
                "{attempt}: {raw}"
            );
            assert_eq!(
                raw.contains("idempotent-replayed: true"),
                attempt == "replay",
                "{raw}"
            );
        }
    }
}
