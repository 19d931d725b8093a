//! What idem holds in memory while it reads an answer's body: the bytes it
//! keeps, never a handle for each chunk. A body of a million empty chunks
//! (a producer that flushes nothing, as encoders do) or of many one-byte
//! chunks holds its bytes and no more, on the path that stores the answer
//! and on the one that keeps a too-large answer for an HTTP/1.0 client.
//!
//! Measured as the growth of the process's resident memory while the body
//! waits, a million chunks read: a handle for each (32 bytes) would be 32
//! MB. The tests of this file run one at a time.

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use idem::{idempotent, Idem, MemoryStore, Operation};
use idem_testkit::http::{post as request, serve};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, Semaphore};

/// The process's resident memory, in bytes (Linux's `/proc/self/statm`).
fn resident() -> isize {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: isize = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .expect("resident pages");
    pages * 4096
}

/// One test at a time: each measures the whole process's allocations.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// More than any of these answers' bytes (at most 1 MB) and the server's
/// own work for one request; a quarter of a handle for each of a million
/// chunks (32 MB).
const BOUND: isize = 8 * 1024 * 1024;

#[derive(Clone)]
struct Answer {
    /// The first chunk, if any.
    first: &'static [u8],
    /// How many chunks follow it, each `each`.
    chunks: usize,
    each: &'static [u8],
    /// Told when the chunks are all read (the body then waits for `go`).
    read: mpsc::UnboundedSender<()>,
    go: Arc<Semaphore>,
    runs: Arc<AtomicUsize>,
}

/// `first`, then `chunks` times `each`, then (once the test has measured)
/// `end`.
#[idempotent(scope = "memory.answer")]
async fn answer(State(a): State<Answer>, _op: Operation) -> Response {
    a.runs.fetch_add(1, Ordering::SeqCst);
    let body = futures_util::stream::unfold(0usize, move |n| {
        let a = a.clone();
        async move {
            let chunk = if n == 0 {
                Bytes::from_static(a.first)
            } else if n <= a.chunks {
                Bytes::from_static(a.each)
            } else if n == a.chunks + 1 {
                let _ = a.read.send(());
                a.go.acquire().await.unwrap().forget();
                Bytes::from_static(b"end")
            } else {
                return None;
            };
            Some((Ok::<_, std::io::Error>(chunk), n + 1))
        }
    });
    (StatusCode::CREATED, Body::from_stream(body)).into_response()
}

/// Serves `answer` with `chunks` chunks of `each` after `first`, under a
/// stored limit of `limit`; sends `send` (a request for key `k`), and
/// returns the bytes held while the body waited, and the raw answer.
async fn held_while_read(
    limit: usize,
    first: &'static [u8],
    chunks: usize,
    each: &'static [u8],
    send: &'static [u8],
) -> (isize, Vec<u8>, std::net::SocketAddr, Arc<AtomicUsize>) {
    let (read, mut all_read) = mpsc::unbounded_channel();
    let a = Answer {
        first,
        chunks,
        each,
        read,
        go: Arc::new(Semaphore::new(0)),
        runs: Arc::default(),
    };
    let idem = Idem::new(MemoryStore::new())
        .single_tenant()
        .max_stored_body(limit)
        .unwrap();
    let app = Router::new()
        .route("/a", post(answer))
        .layer(idem.layer())
        .with_state(a.clone());
    let addr = serve(app).await;
    let (held, raw) = sent_and_held(addr, send, &mut all_read, &a.go).await;
    (held, raw, addr, a.runs)
}

/// Sends `send` to `addr` and waits until the body has read its chunks
/// (`all_read`); returns how much the process's resident memory grew by
/// then, and, once `go` lets the body end, the raw answer.
async fn sent_and_held(
    addr: std::net::SocketAddr,
    send: &'static [u8],
    all_read: &mut mpsc::UnboundedReceiver<()>,
    go: &Semaphore,
) -> (isize, Vec<u8>) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let before = resident();
    let client = tokio::spawn(async move {
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        c.write_all(send).await.unwrap();
        let mut raw = Vec::new();
        let _ = c.read_to_end(&mut raw).await;
        raw
    });
    let waited = tokio::time::timeout(Duration::from_secs(120), all_read.recv()).await;
    assert_eq!(waited, Ok(Some(())), "the body was never read to its last chunk");
    let held = resident() - before;
    go.add_permits(1);
    let raw = tokio::time::timeout(Duration::from_secs(60), client)
        .await
        .expect("an answer")
        .unwrap();
    (held, raw)
}

fn body_of(raw: &[u8]) -> &[u8] {
    let at = raw.windows(4).position(|w| w == b"\r\n\r\n").expect("a head");
    &raw[at + 4..]
}

/// An answer of 5 bytes sent as a million empty chunks between them, well
/// within the stored limit: idem holds its bytes, not the chunks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_in_a_million_empty_chunks_holds_its_bytes() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (held, raw, addr, runs) = held_while_read(
        64,
        b"ok",
        1_000_000,
        b"",
        b"POST /a HTTP/1.1\r\nhost: t\r\nidempotency-key: empties\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
    )
    .await;
    assert!(held < BOUND, "{held} bytes held while a 5-byte answer was read");
    let text = String::from_utf8_lossy(&raw);
    assert!(text.starts_with("HTTP/1.1 201"), "{text}");
    let replay = request("/a", "").key("empties").send(addr).await;
    assert_eq!((replay.status, &replay.body[..]), (201, &b"okend"[..]));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// An answer of a million one-byte chunks within the stored limit: held
/// as its megabyte, not as a million handles.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_in_one_byte_chunks_holds_its_bytes() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (held, raw, addr, runs) = held_while_read(
        2 * 1024 * 1024,
        b"",
        1_000_000,
        b"x",
        b"POST /a HTTP/1.1\r\nhost: t\r\nidempotency-key: bytes\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
    )
    .await;
    assert!(held < BOUND, "{held} bytes held while a 1 MB answer was read");
    assert!(String::from_utf8_lossy(&raw).starts_with("HTTP/1.1 201"));
    let replay = request("/a", "").key("bytes").send(addr).await;
    assert_eq!(replay.status, 201);
    assert_eq!(replay.body.len(), 1_000_003);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// An answer past the stored limit for an HTTP/1.0 client, which cannot
/// tell a broken body from a whole one, so idem reads it to its end before
/// answering: 128 bytes, then a million empty chunks. What it keeps for
/// the client is the bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http10_answer_past_the_limit_in_empty_chunks_holds_its_bytes() {
    let _one = ONE_AT_A_TIME.lock().await;
    const FIRST: &[u8] = &[b'x'; 128];
    let (held, raw, _, runs) = held_while_read(
        64,
        FIRST,
        1_000_000,
        b"",
        b"POST /a HTTP/1.0\r\nidempotency-key: http10\r\ncontent-length: 0\r\n\r\n",
    )
    .await;
    assert!(held < BOUND, "{held} bytes held while a 131-byte answer was read");
    let text = String::from_utf8_lossy(&raw);
    assert!(text.starts_with("HTTP/1.0 201"), "{text}");
    assert_eq!(body_of(&raw), [FIRST, b"end"].concat());
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// The handler's own data (a file it holds, say): 32 MiB, made before any
/// measurement.
static SHARED: std::sync::LazyLock<Bytes> = std::sync::LazyLock::new(|| Bytes::from(vec![b's'; 32 << 20]));

#[derive(Clone)]
struct Slices {
    /// How long each slice of `SHARED` is.
    slice: usize,
    /// A chunk sent after each slice, if not empty (a record's newline).
    separator: &'static [u8],
    read: mpsc::UnboundedSender<()>,
    go: Arc<Semaphore>,
}

/// `SHARED` in slices, each followed by the separator, then (once the test
/// has measured) `end`.
#[idempotent(scope = "memory.slices")]
async fn slices(State(s): State<Slices>, _op: Operation) -> Response {
    let per = 1 + usize::from(!s.separator.is_empty());
    let count = SHARED.len() / s.slice * per;
    let body = futures_util::stream::unfold(0usize, move |n| {
        let s = s.clone();
        async move {
            let chunk = if n < count && n % per == 0 {
                let at = n / per * s.slice;
                SHARED.slice(at..at + s.slice)
            } else if n < count {
                Bytes::from_static(s.separator)
            } else if n == count {
                let _ = s.read.send(());
                s.go.acquire().await.unwrap().forget();
                Bytes::from_static(b"end")
            } else {
                return None;
            };
            Some((Ok::<_, std::io::Error>(chunk), n + 1))
        }
    });
    (StatusCode::CREATED, Body::from_stream(body)).into_response()
}

/// An answer past the stored limit for an HTTP/1.0 client, made of
/// `slice`-long slices of a buffer the handler holds, each followed by
/// `separator`: returns the memory held beyond that buffer while it was
/// read, and the body the client got.
async fn held_for_slices(slice: usize, separator: &'static [u8]) -> (isize, Vec<u8>) {
    std::sync::LazyLock::force(&SHARED);
    let (read, mut all_read) = mpsc::unbounded_channel();
    let s = Slices {
        slice,
        separator,
        read,
        go: Arc::new(Semaphore::new(0)),
    };
    let app = Router::new()
        .route("/s", post(slices))
        .layer(Idem::new(MemoryStore::new()).single_tenant().layer())
        .with_state(s.clone());
    let addr = serve(app).await;
    let send = b"POST /s HTTP/1.0\r\nidempotency-key: slices\r\ncontent-length: 0\r\n\r\n";
    let (held, raw) = sent_and_held(addr, send, &mut all_read, &s.go).await;
    assert!(String::from_utf8_lossy(&raw[..16]).starts_with("HTTP/1.0 201"));
    (held, body_of(&raw).to_vec())
}

/// An answer past the stored limit for an HTTP/1.0 client, made of slices
/// of a buffer the handler holds: kept for the client as those slices, not
/// copied (a copy would be 32 MiB more).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http10_answer_of_slices_of_one_buffer_is_kept_not_copied() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (held, body) = held_for_slices(1 << 20, b"").await;
    assert!(held < BOUND, "{held} bytes held beyond the handler's 32 MiB");
    assert_eq!(body.len(), SHARED.len() + 3);
}

/// The same in 4 KiB slices, each followed by a one-byte chunk (records
/// and their newlines): each byte between two slices is kept as a byte,
/// not in a buffer of 4 KiB (8,192 of them were 32 MiB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http10_answer_of_slices_and_newlines_holds_its_newlines_as_bytes() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (held, body) = held_for_slices(4096, b"\n").await;
    assert!(held < BOUND, "{held} bytes held beyond the handler's 32 MiB");
    assert_eq!(body.len(), SHARED.len() + SHARED.len() / 4096 + 3);
    assert_eq!((body[4096], body[4097], body[8193]), (b'\n', b's', b'\n'));
}
