//! Capturing a handler's answer under the lease (whole, too large to keep,
//! streamed, or failed) and replaying a stored one.

use crate::layer::{Engine, BODY_OMITTED_HEADER, REPLAYED_HEADER};
use crate::lease::Heartbeat;
use crate::operation::OperationInfo;
use crate::outcome::{let_go, record_completion, LetGo};
use crate::protocol::{drop_caught, let_go_once_free, panic_message, record, Outcome};
use crate::store::StoredResponse;
use axum::body::Body;
use axum::http::header::{HeaderName, HeaderValue, CONTENT_ENCODING, CONTENT_TYPE};
use axum::http::StatusCode;
use axum::response::Response;
use futures_util::{FutureExt as _, StreamExt as _};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

/// The headers that describe a body (its type, its encoding): dropped from
/// an answer whose body is omitted, which has nothing for them to describe.
pub(crate) const BODY_DESCRIPTION: [HeaderName; 2] = [CONTENT_TYPE, CONTENT_ENCODING];

/// A response body, read under the lease.
pub(crate) enum Collected {
    /// The whole body, within the stored limit.
    Whole(axum::body::Bytes),
    /// Larger than the limit, or an event stream: what was read, and the rest.
    Streamed {
        head: Vec<axum::body::Bytes>,
        rest: axum::body::BodyDataStream,
    },
    /// The body failed while it was produced: what was read of it (within
    /// the limit, `collect` only), and the failure.
    Failed(axum::body::Bytes, axum::Error),
    /// Larger than the limit, read to its end for a client that could not
    /// tell it broken from whole ([`Reader`]): the whole of it for that
    /// client, or `None` when it was dropped as it came (a `HEAD`, or past
    /// [`MAX_HELD_FOR_HTTP10`]); and its length, which a `HEAD` is told.
    Over(Option<Vec<axum::body::Bytes>>, usize),
}

/// What a request's client can tell of its answer's body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reader {
    /// HTTP/1.1 chunks or a declared length, HTTP/2 frames: a body that
    /// breaks reaches the client broken.
    Framed,
    /// HTTP/1.0 or older: a body without a `Content-Length` ends when the
    /// connection closes, broken or whole.
    UntilClose,
    /// A `HEAD` request: the status and headers, no body at all.
    Headless,
}

/// The most of an answer held in memory for an HTTP/1.0 client until it is
/// recorded ([`drain`]); of a larger one it gets what a replay gets, the
/// status and headers.
pub(crate) const MAX_HELD_FOR_HTTP10: usize = crate::layer::MAX_STORED_BODY_LIMIT;

impl Reader {
    /// The reader of a request with `method` and `version`.
    pub(crate) fn of(method: &axum::http::Method, version: axum::http::Version) -> Self {
        if method == axum::http::Method::HEAD {
            Reader::Headless
        } else if version <= axum::http::Version::HTTP_10 {
            Reader::UntilClose
        } else {
            Reader::Framed
        }
    }

    /// Whether a body with `headers` that breaks reaches this client as
    /// broken, so that it may stream before its answer is recorded.
    pub(crate) fn sees_breaks(self, headers: &axum::http::HeaderMap) -> bool {
        match self {
            Reader::Framed => true,
            Reader::UntilClose => headers.contains_key(axum::http::header::CONTENT_LENGTH),
            Reader::Headless => false,
        }
    }
}

/// Reads to its end the rest of a body larger than the stored limit, for a
/// client that cannot tell a broken body from a whole one: it gets the
/// answer once it is recorded (or a problem, never a body that looks whole
/// and is not). `head` is what was read. The bytes are kept for an HTTP/1.0
/// client, up to [`MAX_HELD_FOR_HTTP10`] ([`Kept`]: its bytes, never a
/// handle for each small chunk, and a large chunk not copied); past it,
/// and for a `HEAD`, they are dropped as they come. A body that ended is
/// dropped here, its drop caught as in [`collect`].
pub(crate) async fn drain(
    reader: Reader,
    head: Vec<axum::body::Bytes>,
    mut rest: axum::body::BodyDataStream,
    panic: &mut Option<Box<dyn std::any::Any + Send>>,
) -> Collected {
    let mut len = head
        .iter()
        .map(axum::body::Bytes::len)
        .fold(0usize, usize::saturating_add);
    let mut kept = (reader != Reader::Headless && len <= MAX_HELD_FOR_HTTP10).then(|| {
        let mut kept = Kept::default();
        head.into_iter().for_each(|chunk| kept.push(chunk));
        kept
    });
    while let Some(chunk) = rest.next().await {
        match chunk {
            Ok(chunk) => {
                len = len.saturating_add(chunk.len());
                if let Some(read) = kept.as_mut() {
                    if len > MAX_HELD_FOR_HTTP10 {
                        kept = None;
                    } else {
                        read.push(chunk);
                    }
                }
            }
            Err(e) => return Collected::Failed(axum::body::Bytes::new(), e),
        }
        // As in `collect`: a body always ready gives the runtime its turn.
        tokio::task::consume_budget().await;
    }
    drop_caught(rest, panic);
    Collected::Over(kept.map(Kept::into_chunks), len)
}

/// Chunks shorter than this are joined to their neighbours when kept.
const JOINED_BELOW: usize = 4096;

/// A body's chunks as they are kept: one shorter than [`JOINED_BELOW`] is
/// copied into a buffer with its neighbours, so that a body of many empty
/// or tiny chunks holds its bytes rather than a handle (32 bytes) for each;
/// a longer one is kept as it is, not copied (it may be a slice of a buffer
/// the handler holds anyway). Every handle kept stands for at least
/// [`JOINED_BELOW`] bytes, or for what came before a long chunk, and holds
/// no more memory than its bytes.
#[derive(Default)]
struct Kept {
    chunks: Vec<axum::body::Bytes>,
    joined: Vec<u8>,
}

impl Kept {
    fn push(&mut self, chunk: axum::body::Bytes) {
        if chunk.len() >= JOINED_BELOW {
            self.flush();
            self.chunks.push(chunk);
            return;
        }
        if self.joined.capacity() == 0 {
            self.joined.reserve(JOINED_BELOW);
        }
        self.joined.extend_from_slice(&chunk);
        if self.joined.len() >= JOINED_BELOW {
            self.flush();
        }
    }

    /// Keeps what was joined, copied to a buffer of its own length (a
    /// buffer handed over whole would keep its whole capacity, 4 KiB for a
    /// byte between two long chunks), and keeps the joining buffer for what
    /// comes next.
    fn flush(&mut self) {
        if !self.joined.is_empty() {
            self.chunks.push(axum::body::Bytes::copy_from_slice(&self.joined));
            self.joined.clear();
        }
    }

    fn into_chunks(mut self) -> Vec<axum::body::Bytes> {
        self.flush();
        self.chunks
    }
}

/// Reads `body` up to `limit` bytes, holding no more than that in memory.
/// A body that ended whole is dropped here, its drop caught: a panic there
/// (the handler's code) does not undo an answer that is whole; its payload
/// goes to `panic`, to be dropped once the answer is recorded.
pub(crate) async fn collect(
    body: Body,
    limit: usize,
    stream: bool,
    panic: &mut Option<Box<dyn std::any::Any + Send>>,
) -> Collected {
    let mut rest = body.into_data_stream();
    if stream {
        return Collected::Streamed {
            head: Vec::new(),
            rest,
        };
    }
    // Most bodies are one buffer (`Json`, `String`, `Bytes`): kept as it
    // is, not copied, when nothing follows it.
    let first = match rest.next().await {
        None => {
            drop_caught(rest, panic);
            return Collected::Whole(axum::body::Bytes::new());
        }
        Some(Err(e)) => return Collected::Failed(axum::body::Bytes::new(), e),
        Some(Ok(first)) if first.len() > limit => {
            return Collected::Streamed {
                head: vec![first],
                rest,
            }
        }
        Some(Ok(first)) => first,
    };
    if axum::body::HttpBody::is_end_stream(&rest) {
        drop_caught(rest, panic);
        return Collected::Whole(first);
    }
    // Joined as they come: what is held is the bytes read (at most the
    // limit), never a handle for each chunk, which a body of many empty or
    // one-byte chunks would make many times larger than its bytes.
    let mut read = Vec::from(first);
    while let Some(chunk) = rest.next().await {
        match chunk {
            Ok(chunk) => {
                if chunk.len() > limit - read.len() {
                    let head = if read.is_empty() {
                        vec![chunk]
                    } else {
                        vec![read.into(), chunk]
                    };
                    return Collected::Streamed { head, rest };
                }
                read.extend_from_slice(&chunk);
                // A body always ready (empty chunks) never returns Pending:
                // the runtime gets its turn here, to drive the lease's
                // extensions (on a current-thread runtime, nothing else would).
                tokio::task::consume_budget().await;
            }
            Err(e) => return Collected::Failed(read.into(), e),
        }
    }
    drop_caught(rest, panic);
    Collected::Whole(read.into())
}

/// What the streamer sends to the client's body.
pub(crate) enum Frame {
    Data(axum::body::Bytes),
    /// The body is whole: its answer is recorded.
    End,
    Fail(axum::Error),
}

pub(crate) const ABANDONED: &str = "the client did not read the answer within the lock timeout";

/// How a streamed answer ends once its body has.
pub(crate) enum End {
    /// Recorded: its status and headers.
    Complete(StoredResponse),
    /// The key let go as it says, nothing recorded.
    LetGo(LetGo),
}

/// An answer too large to keep, still being produced.
pub(crate) struct StreamedAnswer {
    pub(crate) engine: Arc<Engine>,
    pub(crate) info: OperationInfo,
    pub(crate) lock_timeout: Duration,
    /// What is done once the body ended.
    pub(crate) end: End,
    pub(crate) beat: Heartbeat,
    pub(crate) head: Vec<axum::body::Bytes>,
    pub(crate) rest: axum::body::BodyDataStream,
    /// Gone once the client went away, or stopped reading.
    pub(crate) client: Option<tokio::sync::mpsc::Sender<Frame>>,
}

/// Streams an answer larger than the stored limit to the client, still under
/// the lease, and records its completion (status and headers) when the body
/// ends, or lets its key go (`End`). The last bytes are held back until that
/// is done (and the body ends only with an explicit end): a client gets a
/// whole body only when its answer's outcome is recorded; otherwise its
/// connection breaks. A body that
/// fails is a failed execution. A client that goes away, or reads nothing
/// for a whole lock timeout, cancels nothing: it is cut off, and the body is
/// read to its end and the outcome recorded all the same.
pub(crate) async fn stream_then_complete(mut s: StreamedAnswer) {
    let mut held: Option<axum::body::Bytes> = None;
    for chunk in std::mem::take(&mut s.head) {
        s.hold(&mut held, chunk).await;
    }
    // A panic's payload (the handler's code) is dropped once the key is let go.
    let mut panic = None;
    let broken = loop {
        match AssertUnwindSafe(s.rest.next()).catch_unwind().await {
            Ok(Some(Ok(chunk))) => {
                s.hold(&mut held, chunk).await;
                // An empty chunk, or a client gone, sends nothing and so
                // waits for nothing: a body always ready would never
                // return Pending. The runtime gets its turn here, to drive
                // the lease's extensions (on a current-thread runtime,
                // nothing else would).
                tokio::task::consume_budget().await;
            }
            Ok(None) => break None,
            Ok(Some(Err(e))) => {
                tracing::error!(error = %e, "the response body failed while it was produced; releasing the key");
                break Some(e);
            }
            Err(body_panic) => {
                tracing::error!(panic = %panic_message(&*body_panic), "the response body panicked; releasing the key");
                panic = Some(body_panic);
                break Some(axum::Error::new(std::io::Error::other(
                    "the response body panicked",
                )));
            }
        }
    };
    // The body is done with: dropped before the transaction is taken, as
    // `collect` drops it, since a task that feeds it until it is gone lets
    // the connection go only then. A drop that panics (caught; its payload
    // dropped at the end) does not undo a body that ended whole.
    drop_caught(
        std::mem::replace(&mut s.rest, Body::empty().into_data_stream()),
        &mut panic,
    );
    let StreamedAnswer {
        engine,
        info,
        lock_timeout,
        end,
        beat,
        mut client,
        ..
    } = s;
    // The body has ended: a task that fed it while it held the handler's
    // transaction connection has let it go.
    let Ok(tx) = info.take_tx(lock_timeout).await else {
        // The client has its status already: its connection breaks.
        let how = match end {
            End::LetGo(how) => how,
            End::Complete(_) => LetGo::Fail,
        };
        let _ = let_go_once_free(&engine, &info, lock_timeout, beat, how, panic, None);
        if let Some(c) = &client {
            let kept = axum::Error::new(std::io::Error::other(
                "the handler's transaction was kept from its completion; retry with the same key",
            ));
            let _ = tokio::time::timeout(lock_timeout, c.send(Frame::Fail(kept))).await;
        }
        return;
    };
    let not_recorded = || {
        vec![Frame::Fail(axum::Error::new(std::io::Error::other(
            "the answer could not be recorded; retry with the same key",
        )))]
    };
    let ending = match (broken, end) {
        (Some(e), _) => {
            let _ = let_go(&engine, &info, lock_timeout, tx, Response::default(), LetGo::Fail).await;
            vec![Frame::Fail(e)]
        }
        (None, End::Complete(stored)) => {
            match record_completion(&engine, &info, lock_timeout, &stored, tx).await {
                Ok(()) => {
                    record(Outcome::executed(info.lease.is_takeover()));
                    held.into_iter().map(Frame::Data).chain([Frame::End]).collect()
                }
                Err(_) => not_recorded(),
            }
        }
        (None, End::LetGo(how)) => {
            // Let go as asked, its answer stands; otherwise (the lease lost,
            // a rejection not confirmed) it is not the answer that counts.
            let mut asked = Response::default();
            asked.extensions_mut().insert(LetGoneAsAsked);
            let answer = let_go(&engine, &info, lock_timeout, tx, asked, how).await;
            if answer.extensions().get::<LetGoneAsAsked>().is_some() {
                held.into_iter().map(Frame::Data).chain([Frame::End]).collect()
            } else {
                not_recorded()
            }
        }
    };
    drop(beat);
    for frame in ending {
        let Some(c) = &client else { break };
        if !matches!(
            tokio::time::timeout(lock_timeout, c.send(frame)).await,
            Ok(Ok(()))
        ) {
            client = None;
        }
    }
    // Last: its drop may panic again, which must not cut the client off.
    drop(panic);
}

/// Marks the answer [`let_go`] gives back when the key went as asked (it
/// gives another when it did not).
#[derive(Clone, Copy)]
struct LetGoneAsAsked;

impl StreamedAnswer {
    /// Keeps `chunk` back and sends the one kept before: the last bytes
    /// wait for the completion. Empty chunks carry nothing to keep.
    async fn hold(&mut self, held: &mut Option<axum::body::Bytes>, chunk: axum::body::Bytes) {
        if chunk.is_empty() {
            return;
        }
        let Some(previous) = held.replace(chunk) else {
            return;
        };
        let Some(c) = &self.client else { return };
        // A client that reads nothing for a lock timeout is cut off (its
        // connection breaks); the body is still read to its end.
        if !matches!(
            tokio::time::timeout(self.lock_timeout, c.send(Frame::Data(previous))).await,
            Ok(Ok(()))
        ) {
            tracing::warn!("{ABANDONED}; cut off, the answer is still recorded");
            self.client = None;
        }
    }
}

/// The stored answer as the retry gets it, or why it cannot be sent as
/// stored: a status that is no final HTTP answer (a 1xx other than 101,
/// which hyper would swap for an empty 500, or outside 100 to 999), or a
/// header name or value HTTP cannot carry. idem stores neither; a record
/// edited by hand (or a store of one's own) may hold them, and a retry
/// is then refused as an unreadable record is, never given part of it.
pub(crate) fn replay(stored: StoredResponse) -> Result<Response, String> {
    let status = StatusCode::from_u16(stored.status)
        .ok()
        .filter(|s| !crate::classify::never_final(*s))
        .ok_or_else(|| format!("the status {} is no final answer", stored.status))?;
    let omitted = stored.body.is_none();
    let mut response = Response::new(Body::from(stored.body.unwrap_or_default()));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    for (name, value) in stored.headers {
        if omitted && BODY_DESCRIPTION.iter().any(|h| h.as_str() == name) {
            continue;
        }
        let Ok(n) = HeaderName::from_bytes(name.as_bytes()) else {
            return Err(format!("the header name {name:?} cannot be sent"));
        };
        // The value's bytes move into it, uncopied.
        let Ok(v) = HeaderValue::from_maybe_shared(axum::body::Bytes::from(value)) else {
            return Err(format!("the value of the header {name:?} cannot be sent"));
        };
        headers.append(n, v);
    }
    headers.insert(REPLAYED, HeaderValue::from_static("true"));
    if omitted {
        headers.insert(BODY_OMITTED, HeaderValue::from_static("true"));
    }
    Ok(response)
}

/// [`REPLAYED_HEADER`] as a header name built at compile time: from a
/// `&str`, the map would copy the name of a header it does not know for
/// every replay.
const REPLAYED: HeaderName = HeaderName::from_static(REPLAYED_HEADER);
/// [`BODY_OMITTED_HEADER`], the same way.
pub(crate) const BODY_OMITTED: HeaderName = HeaderName::from_static(BODY_OMITTED_HEADER);

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Bytes;

    fn chunks(parts: &[&'static [u8]]) -> Body {
        let frames = parts
            .iter()
            .map(|p| Ok::<_, std::io::Error>(Bytes::from_static(p)));
        Body::from_stream(futures_util::stream::iter(frames.collect::<Vec<_>>()))
    }

    fn whole(collected: Collected) -> Bytes {
        match collected {
            Collected::Whole(bytes) => bytes,
            Collected::Streamed { head, .. } => panic!("streamed, {} chunks read", head.len()),
            Collected::Failed(_, e) => panic!("failed: {e}"),
            Collected::Over(read, _) => panic!("over the limit, {:?} chunks kept", read.map(|r| r.len())),
        }
    }

    #[tokio::test]
    async fn a_body_of_one_buffer_is_kept_as_it_is_not_copied() {
        let sent = Bytes::from(b"{\"id\":1}".to_vec());
        let kept = whole(collect(Body::from(sent.clone()), 64, false, &mut None).await);
        assert_eq!(kept, sent);
        assert_eq!(kept.as_ptr(), sent.as_ptr(), "the buffer was copied");
    }

    #[tokio::test]
    async fn a_body_of_several_chunks_is_joined_in_order() {
        let kept = whole(collect(chunks(&[b"ab", b"", b"cd", b"e"]), 5, false, &mut None).await);
        assert_eq!(&kept[..], b"abcde");
        assert_eq!(
            whole(collect(chunks(&[b"", b"x"]), 5, false, &mut None).await),
            "x"
        );
        assert_eq!(whole(collect(Body::empty(), 5, false, &mut None).await), "");
    }

    #[tokio::test]
    async fn a_body_over_the_limit_is_streamed_with_what_was_read() {
        // Exactly the limit, in one buffer or in two: kept whole.
        assert_eq!(
            whole(collect(Body::from("abcd"), 4, false, &mut None).await),
            "abcd"
        );
        assert_eq!(
            whole(collect(chunks(&[b"ab", b"cd"]), 4, false, &mut None).await),
            "abcd"
        );
        for (body, read, sent) in [
            (Body::from("abcde"), 1, &b"abcde"[..]),
            (chunks(&[b"ab", b"cde", b"f"]), 2, b"abcdef"),
            // What was read is one buffer, however many chunks it came in.
            (
                chunks(&[b"a", b"", b"b", b"c", b"", b"d", b"ef", b"g"]),
                2,
                b"abcdefg",
            ),
        ] {
            match collect(body, 4, false, &mut None).await {
                Collected::Streamed { head, rest } => {
                    assert_eq!(head.len(), read);
                    let mut all = head.concat();
                    let rest: Vec<_> = rest.collect().await;
                    for chunk in rest {
                        all.extend_from_slice(&chunk.expect("a chunk"));
                    }
                    assert_eq!(all, sent, "nothing lost, nothing repeated");
                }
                _ => panic!("a body over the limit was not streamed"),
            }
        }
    }

    #[tokio::test]
    async fn a_body_that_fails_first_or_later_is_failed() {
        for parts in [vec![Err("broken")], vec![Ok(&b"ab"[..]), Err("broken")]] {
            let frames = parts
                .into_iter()
                .map(|p| p.map(Bytes::from_static).map_err(std::io::Error::other));
            let body = Body::from_stream(futures_util::stream::iter(frames.collect::<Vec<_>>()));
            assert!(matches!(
                collect(body, 64, false, &mut None).await,
                Collected::Failed(..)
            ));
        }
    }

    #[test]
    fn a_head_and_an_http10_client_without_a_length_cannot_see_a_body_break() {
        use axum::http::{header::CONTENT_LENGTH, HeaderMap, Method, Version};
        let none = HeaderMap::new();
        let mut length = HeaderMap::new();
        length.insert(CONTENT_LENGTH, HeaderValue::from_static("90"));
        for (method, version, sees, sees_with_length) in [
            (Method::POST, Version::HTTP_11, true, true),
            (Method::GET, Version::HTTP_2, true, true),
            (Method::POST, Version::HTTP_10, false, true),
            (Method::POST, Version::HTTP_09, false, true),
            (Method::HEAD, Version::HTTP_11, false, false),
            (Method::HEAD, Version::HTTP_10, false, false),
        ] {
            let reader = Reader::of(&method, version);
            assert_eq!(reader.sees_breaks(&none), sees, "{method} {version:?}");
            assert_eq!(
                reader.sees_breaks(&length),
                sees_with_length,
                "{method} {version:?} with a length"
            );
        }
    }

    #[tokio::test]
    async fn a_drained_body_is_kept_for_http10_and_dropped_for_a_head() {
        let head = vec![Bytes::from_static(b"ab")];
        let rest = || chunks(&[b"cd", b"", b"e"]).into_data_stream();
        match drain(Reader::UntilClose, head.clone(), rest(), &mut None).await {
            Collected::Over(Some(read), len) => {
                assert_eq!((read.concat(), len), (b"abcde".to_vec(), 5));
                assert_eq!(read.len(), 1, "small chunks kept apart");
            }
            _ => panic!("not read to its end and kept"),
        }
        match drain(Reader::Headless, head.clone(), rest(), &mut None).await {
            Collected::Over(None, len) => assert_eq!(len, 5),
            _ => panic!("a HEAD's body was kept, or not read to its end"),
        }
        let broken = Body::from_stream(futures_util::stream::iter(vec![
            Ok(Bytes::from_static(b"cd")),
            Err(std::io::Error::other("broken")),
        ]));
        assert!(matches!(
            drain(Reader::UntilClose, head, broken.into_data_stream(), &mut None).await,
            Collected::Failed(..)
        ));
    }

    #[test]
    fn small_chunks_are_joined_and_large_ones_kept_as_they_are() {
        let large = Bytes::from(vec![b'l'; JOINED_BELOW]);
        let mut kept = Kept::default();
        for chunk in [
            Bytes::from_static(b"a"),
            Bytes::new(),
            Bytes::from_static(b"b"),
            large.clone(),
            Bytes::from_static(b"c"),
        ] {
            kept.push(chunk);
        }
        for _ in 0..JOINED_BELOW {
            kept.push(Bytes::from_static(b"d"));
        }
        let chunks = kept.into_chunks();
        let lengths: Vec<usize> = chunks.iter().map(Bytes::len).collect();
        assert_eq!(lengths, [2, JOINED_BELOW, JOINED_BELOW, 1]);
        assert_eq!(chunks[1].as_ptr(), large.as_ptr(), "a large chunk was copied");
        let all = chunks.concat();
        assert_eq!(&all[..3], b"abl");
        assert_eq!(all[2 + JOINED_BELOW], b'c');
        assert!(all[3 + JOINED_BELOW..].iter().all(|&b| b == b'd'));
    }

    #[tokio::test]
    async fn an_http10_answer_past_what_is_held_is_read_to_its_end_and_dropped() {
        let big = Bytes::from(vec![b'x'; MAX_HELD_FOR_HTTP10 / 2 + 1]);
        let polled = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = polled.clone();
        let rest = Body::from_stream(
            futures_util::stream::iter(vec![big.clone(), big, Bytes::from_static(b"tail")]).map(move |b| {
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Ok::<_, std::io::Error>(b)
            }),
        );
        match drain(Reader::UntilClose, Vec::new(), rest.into_data_stream(), &mut None).await {
            Collected::Over(None, len) => assert_eq!(len, MAX_HELD_FOR_HTTP10 + 2 + 4),
            _ => panic!("held past {MAX_HELD_FOR_HTTP10} bytes, or not read to its end"),
        }
        assert_eq!(
            polled.load(std::sync::atomic::Ordering::SeqCst),
            3,
            "the rest was not read"
        );
    }
}
