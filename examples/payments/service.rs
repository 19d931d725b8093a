//! Puts the service together: its database, idem on the same database with
//! the service's settings, the janitor, and the routes. The `payments`
//! binary and the demo both start the service here.

use super::api;
use super::config::Config;
use super::db::Db;
use axum::Router;
use idem::Janitor;
use std::time::Duration;

/// The service, ready to serve.
pub struct Service {
    pub router: Router,
    /// The idempotency layer, whose executions a shutdown waits for
    /// (`Idem::idle`).
    pub idem: idem::Idem,
    /// Deletes expired idempotency records every five minutes, for as long
    /// as it is kept.
    pub janitor: Janitor,
}

/// Opens the database named by the config (applying the migrations) and
/// builds the service. Errors say what failed and never carry the URL.
pub async fn start(config: Config) -> Result<Service, String> {
    let db = Db::open(&config.database_url).await?;
    let idem = db
        .idem()
        .ttl(config.ttl)
        .and_then(|idem| idem.lock_timeout(config.lock_timeout))
        .map_err(|e| format!("IDEM_TTL / IDEM_LOCK_TIMEOUT: {e}"))?;
    let janitor = idem
        .start_janitor(Duration::from_secs(300), 1000)
        .map_err(|e| e.to_string())?;
    let body_timeout = config.body_timeout;
    Ok(Service {
        idem: idem.clone(),
        router: api::router(idem, db, config).layer(axum::middleware::from_fn(
            move |req: axum::extract::Request, next: axum::middleware::Next| {
                api::body_within(body_timeout, req, next)
            },
        )),
        janitor,
    })
}
