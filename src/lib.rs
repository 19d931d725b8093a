#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

// The items a service uses, listed one by one (tests/public_api.rs pins
// them). What a store implementer needs is under `idem::store`.
#[cfg(feature = "axum")]
pub use idem_runtime::{
    parse_duration, problem, BodyFormat, Classification, Classify, ConfigError, FingerprintBody, Idem,
    Operation, Problem, Tenant, Unavailable, BODY_OMITTED_HEADER, DEFAULT_LOCK_TIMEOUT,
    DEFAULT_MAX_STORED_BODY, DEFAULT_TTL, LOCK_TIMEOUT_RANGE, MAX_STORED_BODY_LIMIT, PROBLEM_TYPE_PREFIX,
    REPLAYED_HEADER, TTL_RANGE,
};
pub use idem_runtime::{purge_expired, IdempotencyStore, Janitor, MemoryStore, StoreError};

#[cfg(all(feature = "axum", any(feature = "postgres", feature = "sqlite")))]
pub use idem_runtime::TxConnection;

#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use idem_runtime::{PgStore, DEFAULT_OPERATION_TIMEOUT, DEFAULT_REPLAY_CACHE};

#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub use idem_runtime::{SqliteStore, DEFAULT_BUSY_TIMEOUT};

#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub use idem_runtime::migrations;
pub use idem_runtime::{fingerprint, key, store};

#[cfg(feature = "axum")]
#[doc = include_str!("idempotent.md")]
pub use idem_macros::idempotent;

#[cfg(feature = "axum")]
#[doc(hidden)]
pub use idem_runtime::__private;
