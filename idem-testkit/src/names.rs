//! Names no other test or test process uses at the same time: for schemas,
//! files, tenants and lock tokens.

/// A unique name for a schema, table or file.
pub fn unique(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    /// Tells apart the names asked for in the same nanosecond.
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!(
        "{prefix}_{}_{}_{}",
        std::process::id(),
        nanos % 1_000_000_000,
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// A fresh lock token for one reservation (leaked: tests are short-lived).
pub fn token() -> &'static str {
    Box::leak(unique("token").into_boxed_str())
}
