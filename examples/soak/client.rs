//! The soak's HTTP/1.1 client: one request per connection, read to the end
//! of its body, or abandoned mid-flight on purpose.

use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

/// An answer as the client read it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Answer {
    pub(crate) status: u16,
    /// Lowercase names.
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) body: Vec<u8>,
}

impl Answer {
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The problem `type` without its prefix, or "" when not a problem.
    pub(crate) fn problem(&self) -> String {
        let json: serde_json::Value = serde_json::from_slice(&self.body).unwrap_or_default();
        let t = json["type"].as_str().unwrap_or_default();
        t.rsplit(':').next().unwrap_or_default().to_owned()
    }
}

/// What became of one request.
#[derive(Clone, Debug)]
pub(crate) enum Sent {
    Answered(Answer),
    /// The client left after sending (on purpose).
    Abandoned,
    /// The connection failed or broke (a killed server, a refused connect).
    Broken(String),
}

/// `POST /v1/payments` as `tenant` with `key`; `abandon_after` leaves the
/// request that long after sending it, without reading the answer.
pub(crate) async fn pay(
    addr: SocketAddr,
    tenant: &str,
    key: &str,
    body: &str,
    abandon_after: Option<Duration>,
) -> Sent {
    let request = format!(
        "POST /v1/payments HTTP/1.1\r\nhost: soak\r\nauthorization: Bearer {tenant}\r\n\
         idempotency-key: {key}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n{body}",
        body.len()
    );
    let exchange = async {
        let mut stream = TcpStream::connect(addr).await?;
        stream.write_all(request.as_bytes()).await?;
        if let Some(after) = abandon_after {
            tokio::time::sleep(after).await;
            return Ok(None);
        }
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await?;
        Ok::<_, std::io::Error>(Some(raw))
    };
    match tokio::time::timeout(Duration::from_secs(60), exchange).await {
        Err(_) => Sent::Broken("no answer within 60 s".into()),
        Ok(Err(e)) => Sent::Broken(e.to_string()),
        Ok(Ok(None)) => Sent::Abandoned,
        Ok(Ok(Some(raw))) => match parse(&raw) {
            Some(answer) => Sent::Answered(answer),
            None => Sent::Broken(format!("unreadable answer of {} bytes", raw.len())),
        },
    }
}

/// `GET path` (for the health check).
pub(crate) async fn get(addr: SocketAddr, path: &str) -> Option<Answer> {
    let mut stream = TcpStream::connect(addr).await.ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nhost: soak\r\nconnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut raw))
        .await
        .ok()?
        .ok()?;
    parse(&raw)
}

/// A whole HTTP/1.1 answer with a `content-length` body.
fn parse(raw: &[u8]) -> Option<Answer> {
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&raw[..end]).ok()?;
    let mut lines = head.split("\r\n");
    let status = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let body = raw[end + 4..].to_vec();
    let length: usize = headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .and_then(|(_, v)| v.parse().ok())?;
    (body.len() == length).then_some(Answer {
        status,
        headers,
        body,
    })
}
