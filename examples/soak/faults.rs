//! The faults the soak injects while the load runs: PostgreSQL connections
//! killed, PostgreSQL restarted, a service process killed and restarted, and
//! a store that stalls behind a loopback proxy.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A TCP proxy on loopback in front of the store: while stalled it forwards
/// nothing in either direction (connections stay open), like a database
/// that stops answering.
pub(crate) struct StallProxy {
    pub(crate) addr: SocketAddr,
    stalled: Arc<watch::Sender<bool>>,
}

impl StallProxy {
    pub(crate) async fn start(upstream: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let stalled = Arc::new(watch::Sender::new(false));
        let flag = stalled.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let flag = flag.clone();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::join!(pump(cr, sw, flag.subscribe()), pump(sr, cw, flag.subscribe()));
                });
            }
        });
        Ok(StallProxy { addr, stalled })
    }

    pub(crate) fn stall(&self, on: bool) {
        self.stalled.send_replace(on);
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut stalled: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        if stalled.wait_for(|s| !*s).await.is_err() {
            return;
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if stalled.wait_for(|s| !*s).await.is_err() || to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// Terminates every connection of the soak's services (their
/// `application_name`), as a failover or an administrator would.
pub(crate) async fn kill_connections(admin: &sqlx::PgPool, application: &str) -> u64 {
    sqlx::query_scalar::<_, i64>(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE application_name = $1 AND pid <> pg_backend_pid()) t",
    )
    .bind(application)
    .fetch_one(admin)
    .await
    .map(|n| n as u64)
    .unwrap_or(0)
}

/// The machine's PostgreSQL cluster: `pg_ctlcluster <version> main <action>`.
pub(crate) fn pg_cluster(action: &str) -> Result<(), String> {
    let version = std::fs::read_dir("/etc/postgresql")
        .map_err(|e| format!("/etc/postgresql: {e}"))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .next()
        .ok_or("no PostgreSQL cluster in /etc/postgresql")?;
    let status = std::process::Command::new("pg_ctlcluster")
        .args(["--skip-systemctl-redirect", &version, "main", action])
        .status()
        .map_err(|e| format!("pg_ctlcluster: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("pg_ctlcluster {action}: {status}"))
    }
}

/// Waits until PostgreSQL accepts connections again.
pub(crate) async fn pg_ready(url: &str, within: Duration) -> bool {
    let until = tokio::time::Instant::now() + within;
    while tokio::time::Instant::now() < until {
        if let Ok(mut c) = <sqlx::PgConnection as sqlx::Connection>::connect(url).await {
            if sqlx::query("SELECT 1").execute(&mut c).await.is_ok() {
                return true;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    false
}
