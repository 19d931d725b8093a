//! The runtime of [idem](https://docs.rs/idem): idempotency keys,
//! fingerprints, the record protocol on real stores, and the HTTP layer that
//! the `#[idempotent]` attribute calls.
//!
//! Users depend on the `idem` crate, which re-exports everything here.
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

mod fingerprint;
mod jcs;
mod key;
mod store;

#[cfg(feature = "pause-points")]
#[doc(hidden)]
pub mod pause;

#[cfg(any(feature = "postgres", feature = "sqlite"))]
mod sql;

#[cfg(feature = "axum")]
mod http;

#[cfg(feature = "axum")]
mod tx;

#[cfg(feature = "postgres")]
mod postgres;

#[cfg(feature = "sqlite")]
mod sqlite;

pub use fingerprint::{fingerprint, BodyPrint, FingerprintError, RequestPrint, FINGERPRINT_VERSION};
pub use jcs::{canonical_json, JsonError};
pub use key::{IdempotencyKey, KeyError, MAX_KEY_LEN};
pub use store::{
    purge_expired, AsAny, BoxFuture, IdempotencyStore, Janitor, Lease, MemoryStore, RecordId, Reservation,
    ReserveRequest, StoreError, StoredResponse,
};

#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub use sql::{Migration, DEFAULT_TABLE, MAX_TABLE_NAME};

#[cfg(feature = "axum")]
pub use http::{
    problem, BodyFormat, Classification, Classify, ConfigError, FingerprintBody, Idem, Operation, Tenant,
    BODY_OMITTED_HEADER, DEFAULT_LOCK_TIMEOUT, DEFAULT_MAX_STORED_BODY, DEFAULT_TTL, LOCK_TIMEOUT_RANGE,
    MAX_STORED_BODY_LIMIT, PROBLEM_TYPE_PREFIX, REPLAYED_HEADER, TTL_RANGE,
};

/// What the `#[idempotent]` expansion calls; not a public API.
#[cfg(feature = "axum")]
#[doc(hidden)]
pub mod __private {
    pub use crate::fingerprint::BodyPrint;
    pub use crate::http::{
        fingerprint_request, is_json, print_body, raw, run, run_optional, Context, FieldProbe, Probe, Raw,
        Spec, ViaErr, ViaNothing, ViaSelf, ViaSerialize, ViaStatus,
    };
    pub use axum::response::{IntoResponse, Response};
    pub use std::time::Duration;
}

#[cfg(all(feature = "axum", any(feature = "postgres", feature = "sqlite")))]
pub use tx::TxConnection;

#[cfg(feature = "postgres")]
pub use postgres::{PgStore, DEFAULT_OPERATION_TIMEOUT, POSTGRES_MIGRATIONS};

#[cfg(feature = "sqlite")]
pub use sqlite::{SqliteStore, DEFAULT_BUSY_TIMEOUT, SQLITE_MIGRATIONS};
