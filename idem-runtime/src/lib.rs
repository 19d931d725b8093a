//! The runtime of [idem](https://docs.rs/idem): idempotency keys,
//! fingerprints, the record protocol on real stores, and the HTTP layer that
//! the `#[idempotent]` attribute calls.
//!
//! Users depend on the `idem` crate, which re-exports what they need.
#![cfg_attr(docsrs, feature(doc_cfg))]
// Failures are values: the runtime never unwraps outside its tests.
#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

/// Stops at a named pause point when a test armed it (the `pause-points`
/// feature); otherwise nothing.
macro_rules! pause_point {
    ($point:expr, $key:expr) => {
        #[cfg(feature = "pause-points")]
        $crate::pause::hit($point, $key).await;
    };
}

mod janitor;
mod jcs;

pub mod fingerprint;
pub mod key;
pub mod store;

#[cfg(feature = "pause-points")]
#[doc(hidden)]
pub mod pause;

#[cfg(any(feature = "postgres", feature = "sqlite"))]
mod sql;

#[cfg(feature = "axum")]
mod answer;
#[cfg(feature = "axum")]
mod classify;
#[cfg(feature = "axum")]
mod layer;
#[cfg(feature = "axum")]
mod lease;
#[cfg(feature = "axum")]
mod operation;
#[cfg(feature = "axum")]
mod outcome;
#[cfg(feature = "axum")]
mod problem;
#[cfg(feature = "axum")]
mod protocol;
#[cfg(feature = "axum")]
mod request;
#[cfg(feature = "axum")]
mod tx;

// The user's items. Store implementers' items are in `store`; the
// fingerprint's and the key's in their modules.
pub use janitor::{purge_expired, Janitor};
pub use store::{IdempotencyStore, MemoryStore, StoreError};

#[cfg(feature = "axum")]
pub use classify::{Classification, Classify};
#[cfg(feature = "axum")]
pub use layer::{
    parse_duration, ConfigError, Idem, Tenant, BODY_OMITTED_HEADER, DEFAULT_LOCK_TIMEOUT,
    DEFAULT_MAX_STORED_BODY, DEFAULT_TTL, LOCK_TIMEOUT_RANGE, MAX_STORED_BODY_LIMIT, REPLAYED_HEADER,
    TTL_RANGE,
};
#[cfg(feature = "axum")]
pub use operation::Operation;
#[cfg(feature = "axum")]
pub use problem::{problem, Problem, Unavailable, PROBLEM_TYPE_PREFIX};
#[cfg(feature = "axum")]
pub use request::{BodyFormat, FingerprintBody};
#[cfg(all(feature = "axum", any(feature = "postgres", feature = "sqlite")))]
pub use tx::TxConnection;

#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use sql::postgres::{PgStore, DEFAULT_OPERATION_TIMEOUT, DEFAULT_REPLAY_CACHE};
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub use sql::sqlite::{SqliteStore, DEFAULT_BUSY_TIMEOUT};

/// The SQL stores' migrations, for services that apply them with their own
/// migration tool instead of `migrate()`.
///
/// ```
/// # #[cfg(feature = "sqlite")] {
/// let first = &idem::migrations::SQLITE_MIGRATIONS[0];
/// assert_eq!(first.version, 1);
/// # }
/// ```
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub mod migrations {
    #[cfg(feature = "postgres")]
    pub use crate::sql::postgres::POSTGRES_MIGRATIONS;
    #[cfg(feature = "sqlite")]
    pub use crate::sql::sqlite::SQLITE_MIGRATIONS;
    pub use crate::sql::{Migration, DEFAULT_TABLE, MAX_TABLE_NAME};
}

/// What the `#[idempotent]` expansion calls; not a public API.
#[cfg(feature = "axum")]
#[doc(hidden)]
pub mod __private {
    pub use crate::classify::{named_result, Probe};
    pub use crate::fingerprint::BodyPrint;
    pub use crate::fingerprint::FingerprintError;
    pub use crate::layer::{Context, CustomKeyHeader, DefaultKeyHeader, KeyHeader};
    pub use crate::operation::{operation_param, OperationParam};
    pub use crate::protocol::{returning, run, run_optional};
    pub use crate::request::{
        fingerprint_request, is_json, print_body, raw, FieldJson, FieldProbe, NoBody, Raw, ScopeNoted, Spec,
        Tail,
    };
    pub use axum::response::{IntoResponse, Response};
    pub use std::time::Duration;

    /// The classification's probe traits, which the expansion imports
    /// whole: a glob import counts as used when any of its traits is, so
    /// the expansion needs no `#[allow(unused_imports)]`, which a crate
    /// that forbids that lint refuses.
    pub mod classifying {
        pub use crate::classify::{ViaErr, ViaSelf, ViaStatus};
    }

    /// The field reads' probe traits, imported whole the same way.
    pub mod reading {
        pub use crate::request::{ViaDeserialize, ViaNothing, ViaSerialize};
    }
}
