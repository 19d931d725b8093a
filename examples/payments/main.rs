//! Runs the payments service, a small API that charges a fake card gateway
//! and is protected by `#[idempotent]`: settings from the environment, logs
//! to stderr, served until the process ends.
//!
//! ```text
//! cargo run --release --example payments
//! curl -i -X POST http://127.0.0.1:8080/v1/payments \
//!   -H 'Authorization: Bearer acct_1' -H 'Idempotency-Key: order-42' \
//!   -H 'Content-Type: application/json' \
//!   -d '{"amount": 4990, "currency": "EUR", "recipient": "acct_bob"}'
//! ```
//!
//! Environment (`config.rs`): `PAYMENTS_ADDR` (default `127.0.0.1:8080`),
//! `DATABASE_URL` (`postgres://...` or `sqlite://...`, default
//! `sqlite://payments.db`), `IDEM_TTL` (default `24h`), `IDEM_LOCK_TIMEOUT`
//! (default `60s`), `PAYMENTS_GATEWAY_DELAY_MS` (default 0),
//! `PAYMENTS_HEADER_TIMEOUT` and `PAYMENTS_BODY_TIMEOUT` (default `10s`
//! each: slow headers are cut off, slow bodies answered 408). Several
//! processes on one `DATABASE_URL` behave as one service.
//!
//! The handlers are in `api.rs`, the database of either kind in `db.rs`;
//! `service.rs` puts them together.

// In this binary (and the demo, which shares the modules), `pub` means
// "used by the other modules".
#![allow(unreachable_pub)]

mod api;
mod config;
mod db;
mod service;

#[tokio::main]
async fn main() {
    // Logs go to stderr, coloured only on a terminal (a file or a pipe
    // gets plain text).
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let config = match config::Config::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("payments: {e}");
            std::process::exit(2);
        }
    };
    let (addr, header_timeout) = (config.addr, config.header_timeout);
    let store = db::describe(&config.database_url);
    let service = match service::start(config).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("payments: {e}");
            std::process::exit(1);
        }
    };
    let listener = match tokio::net::TcpListener::bind(addr).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("payments: cannot listen on {addr}: {e}");
            std::process::exit(1);
        }
    };
    tracing::info!(%addr, %store, "payments service listening");
    // The janitor runs for as long as it is held: while the service serves.
    let service::Service { router, janitor } = service;
    serve(listener, router, header_timeout).await;
    drop(janitor);
}

/// Serves HTTP/1.1 connections until the process ends. Unlike
/// `axum::serve`, a client that has not sent its whole request head within
/// `header_timeout` is disconnected (slow headers hold no connection).
async fn serve(listener: tokio::net::TcpListener, router: axum::Router, header_timeout: std::time::Duration) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors, for instance: wait, then go on.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let service = hyper_util::service::TowerToHyperService::new(router.clone());
        tokio::spawn(async move {
            let served = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(header_timeout)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
            if let Err(e) = served {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
}
