#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub use idem_runtime::*;

#[cfg(feature = "axum")]
#[doc = include_str!("idempotent.md")]
pub use idem_macros::idempotent;
