//! The service's settings, read from the environment: their names, their
//! defaults, and a start refused on a bad value.

use std::net::SocketAddr;
use std::time::Duration;

/// What `--help` prints: the service takes no arguments, only these.
pub const USAGE: &str = "\
payments: the example payments API protected by #[idempotent]. It takes no
arguments; its settings are environment variables, read at start:

  PAYMENTS_ADDR              IP address and port to serve on (127.0.0.1:8080)
  DATABASE_URL               postgres://... or sqlite://... (sqlite://payments.db)
  IDEM_TTL                   how long answers are kept (24h)
  IDEM_LOCK_TIMEOUT          how long a crashed request holds its key (60s)
  PAYMENTS_HEADER_TIMEOUT    a request head not whole by then is cut off (10s)
  PAYMENTS_BODY_TIMEOUT      a body not whole by then is answered 408 (10s)
  PAYMENTS_GATEWAY_DELAY_MS  how long the fake card gateway takes (0)
  RUST_LOG                   what is logged, to stderr (info)

Fault injection, for crash tests: PAYMENTS_FAULT_AFTER_CHARGE_MS,
PAYMENTS_FAULT_BEFORE_COMMIT_MS, PAYMENTS_FAULT_LEDGER_ONCE=1.
";

/// The service's settings, read from the environment.
#[derive(Clone, Debug)]
pub struct Config {
    /// `PAYMENTS_ADDR`, default `127.0.0.1:8080`.
    pub addr: SocketAddr,
    /// `DATABASE_URL`: `postgres://...` or `sqlite://...`; default `sqlite://payments.db`.
    pub database_url: String,
    /// `IDEM_TTL`, default 24h.
    pub ttl: Duration,
    /// `IDEM_LOCK_TIMEOUT`, default 60s.
    pub lock_timeout: Duration,
    /// `PAYMENTS_GATEWAY_DELAY_MS`: how long the fake gateway takes, default 0.
    pub gateway_delay: Duration,
    /// `PAYMENTS_FAULT_AFTER_CHARGE_MS` (fault injection for crash tests): a
    /// pause after the gateway charged and before the payment is written.
    pub pause_after_charge: Duration,
    /// `PAYMENTS_FAULT_BEFORE_COMMIT_MS` (fault injection for crash tests): a
    /// pause after the payment is written and before it commits.
    pub pause_before_commit: Duration,
    /// `PAYMENTS_FAULT_LEDGER_ONCE=1` (fault injection): the first attempt of
    /// every payment finds the ledger down after the gateway charged (503).
    pub ledger_down_once: bool,
    /// `PAYMENTS_HEADER_TIMEOUT`, default 10s: a client that has not sent a
    /// whole request head by then is disconnected (slow headers).
    pub header_timeout: Duration,
    /// `PAYMENTS_BODY_TIMEOUT`, default 10s: a request body not received
    /// whole by then is answered 408 (slow bodies); no key is taken before
    /// the body is whole.
    pub body_timeout: Duration,
}

impl Config {
    /// Reads the environment; a bad value is an error that names the variable.
    pub fn from_env() -> Result<Config, String> {
        // Unset or empty: the default. A value that is not UTF-8 is
        // refused, never taken for unset (a `DATABASE_URL` would otherwise
        // fall back to a local file).
        let var = |name: &str| match std::env::var(name) {
            Ok(v) => Ok(Some(v).filter(|v| !v.is_empty())),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => Err(format!("{name}: its value is not UTF-8")),
        };
        let duration = |name: &str, default: Duration| match var(name)? {
            Some(v) => idem::parse_duration(&v).map_err(|e| format!("{name}: {e}")),
            None => Ok(default),
        };
        let millis = |name: &str| match var(name)? {
            Some(v) => v
                .parse::<u64>()
                .map(Duration::from_millis)
                .map_err(|_| format!("{name}: expected milliseconds, got `{v}`")),
            None => Ok(Duration::ZERO),
        };
        let in_range = |name: &str, d: Duration, range: std::ops::RangeInclusive<Duration>, words: &str| {
            if range.contains(&d) {
                Ok(d)
            } else {
                Err(format!("{name}: {d:?} is out of range; allowed {words}"))
            }
        };
        Ok(Config {
            addr: {
                let addr = var("PAYMENTS_ADDR")?.unwrap_or_else(|| "127.0.0.1:8080".into());
                addr.parse().map_err(|e| {
                    format!(
                        "PAYMENTS_ADDR: expected an IP address and a port, such as 127.0.0.1:8080, \
                         got `{addr}` ({e})"
                    )
                })?
            },
            database_url: var("DATABASE_URL")?.unwrap_or_else(|| "sqlite://payments.db".into()),
            ttl: in_range(
                "IDEM_TTL",
                duration("IDEM_TTL", idem::DEFAULT_TTL)?,
                idem::TTL_RANGE,
                "1s to 365d",
            )?,
            lock_timeout: in_range(
                "IDEM_LOCK_TIMEOUT",
                duration("IDEM_LOCK_TIMEOUT", idem::DEFAULT_LOCK_TIMEOUT)?,
                idem::LOCK_TIMEOUT_RANGE,
                "100ms to 1d",
            )?,
            gateway_delay: millis("PAYMENTS_GATEWAY_DELAY_MS")?,
            pause_after_charge: millis("PAYMENTS_FAULT_AFTER_CHARGE_MS")?,
            pause_before_commit: millis("PAYMENTS_FAULT_BEFORE_COMMIT_MS")?,
            ledger_down_once: match var("PAYMENTS_FAULT_LEDGER_ONCE")?.as_deref() {
                None | Some("0" | "false") => false,
                Some("1" | "true") => true,
                Some(v) => return Err(format!("PAYMENTS_FAULT_LEDGER_ONCE: expected 1 or 0, got `{v}`")),
            },
            header_timeout: duration("PAYMENTS_HEADER_TIMEOUT", Duration::from_secs(10))?,
            body_timeout: duration("PAYMENTS_BODY_TIMEOUT", Duration::from_secs(10))?,
        })
    }
}
