//! The `#[idempotent]` attribute of idem.
