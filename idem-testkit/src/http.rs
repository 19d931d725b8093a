//! One HTTP/1.1 exchange over a fresh TCP connection, written by hand so
//! that tests can send what a well-behaved client library refuses to (a
//! header twice, raw bytes) and can hang up mid-request. Shared by the
//! demo, the bench and the tests.

use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A whole answer, as read off the connection.
#[derive(Debug, Clone)]
pub struct Reply {
    /// The status code.
    pub status: u16,
    /// Lowercase names, in the order received.
    pub headers: Vec<(String, String)>,
    /// The body, de-chunked if it was sent chunked.
    pub body: Vec<u8>,
}

impl Reply {
    /// The value of the first header named `name` (lowercase).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The body as JSON, or `Null` if it is not JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }

    /// The problem type name, after the prefix.
    pub fn problem(&self) -> String {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{self:?}"
        );
        let t = self.json()["type"].as_str().unwrap_or_default().to_owned();
        t.strip_prefix(idem_runtime::PROBLEM_TYPE_PREFIX)
            .unwrap_or(&t)
            .to_owned()
    }
}

/// A request under construction.
pub struct Request {
    /// `GET`, `HEAD` or `POST`.
    method: &'static str,
    /// The path and query, as sent.
    path: String,
    /// Names and raw values, in the order they are sent.
    headers: Vec<(String, Vec<u8>)>,
    /// The body, sent with its `content-length`.
    body: Vec<u8>,
}

/// A POST of a JSON `body` to `path`.
pub fn post(path: &str, body: &str) -> Request {
    Request {
        method: "POST",
        path: path.to_owned(),
        headers: vec![("content-type".into(), b"application/json".to_vec())],
        body: body.as_bytes().to_vec(),
    }
}

/// A GET of `path`, without a body.
pub fn get(path: &str) -> Request {
    Request {
        method: "GET",
        path: path.to_owned(),
        headers: vec![],
        body: vec![],
    }
}

/// A HEAD of `path`: its answer has a head and no body.
pub fn head(path: &str) -> Request {
    Request {
        method: "HEAD",
        ..get(path)
    }
}

impl Request {
    /// Adds a header; a name given twice is sent twice.
    pub fn header(mut self, name: &str, value: impl AsRef<[u8]>) -> Self {
        self.headers.push((name.to_owned(), value.as_ref().to_vec()));
        self
    }

    /// Replaces the `content-type` (JSON by default).
    pub fn content_type(mut self, value: &str) -> Self {
        self.headers.retain(|(n, _)| n != "content-type");
        self.header("content-type", value)
    }

    /// Replaces the body with any bytes (invalid UTF-8 included).
    pub fn body_bytes(mut self, body: Vec<u8>) -> Self {
        self.body = body;
        self
    }

    /// Sets the `Idempotency-Key` header.
    pub fn key(self, key: &str) -> Self {
        self.header("Idempotency-Key", key)
    }

    /// Sets `Authorization: Bearer <token>`.
    pub fn bearer(self, token: &str) -> Self {
        self.header("Authorization", format!("Bearer {token}"))
    }

    /// The request on the wire, with `connection: close` and its length.
    fn bytes(&self, addr: std::net::SocketAddr) -> Vec<u8> {
        let mut out = format!(
            "{} {} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n",
            self.method, self.path
        )
        .into_bytes();
        for (n, v) in &self.headers {
            out.extend_from_slice(n.as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(v);
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(format!("content-length: {}\r\n\r\n", self.body.len()).as_bytes());
        out.extend_from_slice(&self.body);
        out
    }

    /// Sends the request and reads the whole answer.
    pub async fn send(&self, addr: std::net::SocketAddr) -> Reply {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        stream.write_all(&self.bytes(addr)).await.expect("write");
        let mut raw = Vec::new();
        tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut raw))
            .await
            .expect("answer within 30 s")
            .expect("read");
        parse(&raw)
    }

    /// Sends the request and hands over the open connection, unread.
    pub async fn start(&self, addr: std::net::SocketAddr) -> TcpStream {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        stream.write_all(&self.bytes(addr)).await.expect("write");
        stream
    }

    /// Sends the request and reads every byte until the server closes the
    /// connection, without parsing: for answers that may break off.
    pub async fn send_raw(&self, addr: std::net::SocketAddr) -> Vec<u8> {
        let mut stream = self.start(addr).await;
        let mut raw = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut raw))
            .await
            .expect("the server closes within 30 s");
        // A reset connection is one way to break off.
        let _ = read;
        raw
    }

    /// Sends the request until it is not 409 (an execution in progress),
    /// for at most 20 s.
    pub async fn wait_for_replay(&self, addr: std::net::SocketAddr) -> Reply {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let reply = self.send(addr).await;
            if reply.status != 409 || std::time::Instant::now() > deadline {
                return reply;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Sends the request, waits `after`, then hangs up without reading.
    pub async fn send_and_hang_up(&self, addr: std::net::SocketAddr, after: Duration) {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        stream.write_all(&self.bytes(addr)).await.expect("write");
        tokio::time::sleep(after).await;
        drop(stream);
    }
}

/// Splits a whole answer into status, headers and (de-chunked) body.
pub fn parse(raw: &[u8]) -> Reply {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a complete head");
    let head = String::from_utf8_lossy(&raw[..split]);
    let mut lines = head.split("\r\n");
    let status = lines.next().unwrap().split(' ').nth(1).unwrap().parse().unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    if headers
        .iter()
        .any(|(n, v)| n == "transfer-encoding" && v == "chunked")
    {
        body = dechunk(&body);
    }
    Reply {
        status,
        headers,
        body,
    }
}

/// The payload of a chunked body.
fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let line_end = data.windows(2).position(|w| w == b"\r\n").unwrap();
        let size = usize::from_str_radix(std::str::from_utf8(&data[..line_end]).unwrap().trim(), 16).unwrap();
        data = &data[line_end + 2..];
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&data[..size]);
        data = &data[size + 2..];
    }
}

/// Serves `app` on a free loopback port until the test ends.
pub async fn serve(app: axum::Router) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// A client that sends `request` (raw HTTP) and reads until the server
/// closes the connection (within 20 seconds): what it got, and `Ok` for a
/// clean close (what a whole HTTP/1.0 body or a `HEAD` answer looks like),
/// `Err` for a reset.
///
/// ```no_run
/// # async fn f(addr: std::net::SocketAddr) {
/// let (raw, closed) = idem_testkit::http::exchange(addr, idem_testkit::http::head_request("/p", "k-1")).await;
/// assert!(closed.is_ok() && raw.starts_with(b"HTTP/1.1 "));
/// # }
/// ```
pub async fn exchange(addr: std::net::SocketAddr, request: String) -> (Vec<u8>, std::io::Result<usize>) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(request.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let res = tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut out))
        .await
        .expect("the server closes within 20 s");
    (out, res)
}

/// A raw `HEAD` of `path` with the key `key`, the connection closed after it.
///
/// ```
/// let request = idem_testkit::http::head_request("/p", "k-1");
/// assert!(request.starts_with("HEAD /p HTTP/1.1\r\n") && request.contains("idempotency-key: k-1\r\n"));
/// ```
pub fn head_request(path: &str, key: &str) -> String {
    format!("HEAD {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\nidempotency-key: {key}\r\n\r\n")
}

/// A raw HTTP/1.0 `POST` of `path` with the key `key` and no body: its
/// answer's body, without a `Content-Length`, ends when the connection does.
///
/// ```
/// let request = idem_testkit::http::http10_request("/p", "k-1");
/// assert!(request.starts_with("POST /p HTTP/1.0\r\n"));
/// ```
pub fn http10_request(path: &str, key: &str) -> String {
    format!("POST {path} HTTP/1.0\r\nhost: x\r\nidempotency-key: {key}\r\ncontent-length: 0\r\n\r\n")
}

/// A raw answer's status code (0 if none), and its body after the head.
///
/// ```
/// let (status, body) = idem_testkit::http::split(b"HTTP/1.0 400 Bad Request\r\nx: y\r\n\r\nab");
/// assert_eq!((status, body), (400, &b"ab"[..]));
/// ```
pub fn split(out: &[u8]) -> (u16, &[u8]) {
    let text = std::str::from_utf8(out.get(9..12).unwrap_or_default()).unwrap_or_default();
    let at = out
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(out.len(), |i| i + 4);
    (text.parse().unwrap_or(0), &out[at..])
}
