//! The shared set-up of idem's integration tests and examples, kept in one
//! unpublished crate as sqlx keeps `sqlx-test`.
//!
//! - [`http`]: a raw HTTP/1.1 client, for requests a client library refuses
//!   to send.

pub mod http;
