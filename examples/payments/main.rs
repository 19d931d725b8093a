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
//! processes on one `DATABASE_URL` behave as one service. On Ctrl-C or
//! SIGTERM it stops accepting connections and lets the requests under way
//! finish, those whose clients left included (their answers recorded and
//! sent, for up to the lock timeout), before it exits: a restart loses no
//! answer and leaves no lock. A second signal stops it at once.
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
    // Settings are environment variables: `--help` lists them, and any
    // other argument is refused before anything starts or is created.
    if let Some(arg) = std::env::args_os().nth(1) {
        if arg == "--help" || arg == "-h" {
            use std::io::Write as _;
            if let Err(e) = std::io::stdout().write_all(config::USAGE.as_bytes()) {
                eprintln!("payments: cannot print the help: {e}");
                std::process::exit(1);
            }
            return;
        }
        eprintln!(
            "payments: takes no arguments (got {arg:?}); its settings are environment variables, \
             which `--help` lists"
        );
        std::process::exit(2);
    }
    // Logs go to stderr, coloured only on a terminal (a file or a pipe
    // gets plain text). `RUST_LOG` unset or empty is `info`; one that is
    // not UTF-8 or does not parse is refused, not taken for unset.
    let filter = match std::env::var("RUST_LOG") {
        Ok(v) if !v.is_empty() => tracing_subscriber::EnvFilter::try_new(&v).unwrap_or_else(|e| {
            eprintln!("payments: RUST_LOG: {e}");
            std::process::exit(2);
        }),
        Ok(_) | Err(std::env::VarError::NotPresent) => tracing_subscriber::EnvFilter::new("info"),
        Err(std::env::VarError::NotUnicode(_)) => {
            eprintln!("payments: RUST_LOG: its value is not UTF-8");
            std::process::exit(2);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
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
    let (addr, header_timeout, drain) = (config.addr, config.header_timeout, config.lock_timeout);
    let store = db::describe(&config.database_url);
    // The port first: a second start on a port in use stops before it
    // touches the database.
    let listener = match tokio::net::TcpListener::bind(addr).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("payments: cannot listen on {addr}: {e}");
            std::process::exit(1);
        }
    };
    let service = match service::start(config).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("payments: {e}");
            std::process::exit(1);
        }
    };
    // Where it listens, a port chosen by the system (`:0`) included.
    let addr = listener.local_addr().unwrap_or(addr);
    tracing::info!(%addr, %store, "payments service listening");
    // The janitor runs for as long as it is held: while the service serves.
    let service::Service {
        router,
        idem,
        janitor,
    } = service;
    serve(listener, router, &idem, header_timeout, drain).await;
    drop(janitor);
}

/// Serves HTTP/1.1 connections until Ctrl-C or SIGTERM, then stops
/// accepting, lets each connection finish the request under way and
/// `idem` the executions whose clients left (for up to `drain` in all: an
/// execution's answer is recorded, then sent), and returns; a second
/// signal stops it at once. Unlike `axum::serve`, a client that has not
/// sent its whole request head within `header_timeout` is disconnected
/// (slow headers hold no connection).
async fn serve(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    idem: &idem::Idem,
    header_timeout: std::time::Duration,
    drain: std::time::Duration,
) {
    let (stop, stopping) = tokio::sync::watch::channel(false);
    let mut connections = tokio::task::JoinSet::new();
    let mut signal = std::pin::pin!(shutdown_signal());
    loop {
        let stream = tokio::select! {
            () = &mut signal => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors, for instance: wait, then go on.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        // Finished connections, reaped as new ones come.
        while connections.try_join_next().is_some() {}
        let service = hyper_util::service::TowerToHyperService::new(router.clone());
        let mut stopping = stopping.clone();
        connections.spawn(async move {
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(header_timeout)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            let mut connection = std::pin::pin!(connection);
            let served = tokio::select! {
                served = connection.as_mut() => served,
                () = async { drop(stopping.wait_for(|stop| *stop).await) } => {
                    // The request under way is answered, then the
                    // connection closes; an idle one closes at once.
                    connection.as_mut().graceful_shutdown();
                    connection.await
                }
            };
            if let Err(e) = served {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    // Those that ended since the last accept are not under way.
    while connections.try_join_next().is_some() {}
    let under_way = connections.len();
    tracing::info!(
        connections = under_way,
        "stopping: no new connections; finishing the requests under way"
    );
    let _ = stop.send(true);
    // The connections' requests, then the executions whose clients left
    // (a task of idem's each): their answers are recorded before the
    // runtime, which would drop them, shuts down.
    let finishing = async {
        while connections.join_next().await.is_some() {}
        idem.idle().await;
    };
    tokio::select! {
        drained = tokio::time::timeout(drain, finishing) => if drained.is_err() {
            tracing::warn!(
                under_way = idem.under_way(),
                "requests still under way after the drain: stopping anyway (their keys stay locked until the lock timeout)"
            );
        },
        () = shutdown_signal() => tracing::warn!(
            under_way = idem.under_way(),
            "a second signal: stopping now (the keys of requests under way stay locked until the lock timeout)"
        ),
    }
    tracing::info!("payments service stopped");
}

/// Ctrl-C, or SIGTERM (what a service manager sends) on Unix.
async fn shutdown_signal() {
    let interrupted = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminated = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                term.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminated = std::future::pending::<()>();
    tokio::select! {
        () = interrupted => {}
        () = terminated => {}
    }
}
