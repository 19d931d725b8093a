//! The harness's own loopback HTTP/1.1 client: one keep-alive connection per
//! simulated client, requests written as prepared bytes, answers read by
//! their `Content-Length`. Nothing else: its cost is the same for every
//! variant, and small.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

/// One answer: its status and whether it was marked as a replay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) replayed: bool,
}

/// A keep-alive connection to the server under test.
pub(crate) struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Conn {
    pub(crate) async fn open(addr: std::net::SocketAddr) -> Conn {
        let stream = TcpStream::connect(addr).await.expect("the server accepts");
        stream.set_nodelay(true).expect("nodelay");
        Conn {
            stream,
            buf: Vec::with_capacity(4096),
        }
    }

    /// Sends one request and reads its whole answer.
    pub(crate) async fn send(&mut self, request: &[u8]) -> Answer {
        self.start(request).await;
        self.answer().await
    }

    /// Writes a request without waiting for its answer.
    pub(crate) async fn start(&mut self, request: &[u8]) {
        self.stream
            .write_all(request)
            .await
            .expect("the request is written");
    }

    /// Reads the answer to the request written last.
    pub(crate) async fn answer(&mut self) -> Answer {
        self.buf.clear();
        let head_end = loop {
            if let Some(end) = find(&self.buf, b"\r\n\r\n") {
                break end + 4;
            }
            self.fill().await;
        };
        let head = std::str::from_utf8(&self.buf[..head_end]).expect("an ASCII head");
        let status: u16 = head
            .get(9..12)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no status line in {head:?}"));
        let mut length = None;
        let mut replayed = false;
        for line in head.split("\r\n").skip(1) {
            let Some((name, value)) = line.split_once(':') else {
                continue;
            };
            if name.eq_ignore_ascii_case("content-length") {
                length = value.trim().parse::<usize>().ok();
            } else if name.eq_ignore_ascii_case("idempotent-replayed") {
                replayed = value.trim() == "true";
            }
        }
        let length = length.unwrap_or_else(|| panic!("an answer without Content-Length: {head:?}"));
        while self.buf.len() < head_end + length {
            self.fill().await;
        }
        assert_eq!(self.buf.len(), head_end + length, "nothing follows an answer");
        Answer { status, replayed }
    }

    async fn fill(&mut self) {
        let mut chunk = [0u8; 4096];
        let n = self.stream.read(&mut chunk).await.expect("the answer is read");
        assert!(n > 0, "the server closed the connection");
        self.buf.extend_from_slice(&chunk[..n]);
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// A POST with a JSON body and, when given, an `Idempotency-Key`.
pub(crate) fn post(path: &str, key: Option<&str>, body: &str) -> Vec<u8> {
    let key = key
        .map(|k| format!("Idempotency-Key: {k}\r\n"))
        .unwrap_or_default();
    format!(
        "POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n{key}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// What one cell measured: every latency, in microseconds, and the wall time.
pub(crate) struct Sample {
    pub(crate) latencies_us: Vec<u32>,
    pub(crate) elapsed: Duration,
}

impl Sample {
    pub(crate) fn throughput(&self) -> f64 {
        self.latencies_us.len() as f64 / self.elapsed.as_secs_f64()
    }

    /// The `q` quantile (0 to 1) of the sorted latencies.
    pub(crate) fn quantile(&self, q: f64) -> u32 {
        let n = self.latencies_us.len();
        if n == 0 {
            return 0;
        }
        let i = ((n as f64 - 1.0) * q).round() as usize;
        self.latencies_us[i.min(n - 1)]
    }
}

/// Runs `clients` connections, each sending `request(client, i)` back to
/// back, until `limit` time has passed or `max` requests were sent in all;
/// with `spin`, the client's thread never sleeps.
/// Every answer must satisfy `check`.
pub(crate) async fn load<R, C>(
    addr: std::net::SocketAddr,
    clients: usize,
    limit: Duration,
    max: usize,
    spin: bool,
    request: R,
    check: C,
) -> Sample
where
    R: Fn(usize, usize) -> Vec<u8> + Clone + Send + Sync + 'static,
    C: Fn(Answer) -> bool + Clone + Send + Sync + 'static,
{
    let per_client = max.div_ceil(clients);
    let mut conns = Vec::with_capacity(clients);
    for _ in 0..clients {
        conns.push(Conn::open(addr).await);
    }
    let start = Instant::now();
    let deadline = start + limit;
    // `spin`: a task that only yields keeps the client's runtime polling
    // its sockets, never asleep in `epoll_wait`, so that the server's
    // writes never pay for waking it (on loopback the sender's CPU does).
    let spinning = Arc::new(AtomicBool::new(true));
    let spinner = spin.then(|| {
        let spinning = spinning.clone();
        tokio::spawn(async move {
            while spinning.load(Ordering::Relaxed) {
                tokio::task::yield_now().await;
            }
        })
    });
    let tasks: Vec<_> = conns
        .into_iter()
        .enumerate()
        .map(|(c, mut conn)| {
            let (request, check) = (request.clone(), check.clone());
            tokio::spawn(async move {
                let mut times = Vec::with_capacity(per_client.min(1 << 16));
                for i in 0..per_client {
                    let bytes = request(c, i);
                    let t = Instant::now();
                    let answer = conn.send(&bytes).await;
                    let took = t.elapsed();
                    assert!(
                        check(answer),
                        "unexpected answer {answer:?} (client {c}, request {i})"
                    );
                    times.push(u32::try_from(took.as_micros()).unwrap_or(u32::MAX));
                    if Instant::now() >= deadline {
                        break;
                    }
                }
                times
            })
        })
        .collect();
    let mut latencies_us = Vec::new();
    for t in tasks {
        latencies_us.extend(t.await.expect("a client task"));
    }
    let elapsed = start.elapsed();
    spinning.store(false, Ordering::Relaxed);
    if let Some(spinner) = spinner {
        let _ = spinner.await;
    }
    latencies_us.sort_unstable();
    Sample {
        latencies_us,
        elapsed,
    }
}
