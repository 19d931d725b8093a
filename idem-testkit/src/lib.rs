//! The shared set-up of idem's integration tests and examples, kept in one
//! unpublished crate as sqlx keeps `sqlx-test`.
//!
//! - [`http`]: a raw HTTP/1.1 client, for requests a client library refuses
//!   to send.
//! - Fresh stores on real databases: [`sqlite_store`] on a temporary file,
//!   [`pg_store`] in a schema of its own in `DATABASE_URL` (skipped without
//!   it, unless `IDEM_REQUIRE_POSTGRES=1`: see [`pg_url`]).
//! - One [`Fixture`] per [`StoreKind`], and [`for_each_store!`] to run a
//!   suite's cases on each.
//! - Names that no concurrent test shares: [`unique`], [`token`].
//! - [`Gates`] a handler waits on by key, and [`Runs`]: its runs counted by key.
//! - [`records`]: store calls as the store-level tests write them.
//! - [`multi_thread`]: a runtime of its own, for tests that shut one down.
//! - [`logs`]: every line the test binary logs, to assert on.
//! - [`within`]: a condition polled until it holds, or the test fails.

mod each_store;
mod gates;
pub mod http;
mod logs;
mod names;
pub mod records;
mod runs;
mod stores;

pub use gates::Gates;
pub use logs::{logs, Logged};
pub use names::{token, unique};
pub use runs::Runs;
pub use stores::{
    dropped_transaction_rolls_back, pg_schema, pg_store, pg_store_in, pg_url, sqlite_in_memory_store,
    sqlite_store, Fixture, StoreKind,
};

/// Polls `done` every 5 ms until it holds; fails the test, saying what it
/// waited for, once `limit` has passed.
///
/// # Panics
///
/// When `limit` passes first.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let mut polls = 0;
/// idem_testkit::within(std::time::Duration::from_secs(1), "a third poll", async || {
///     polls += 1;
///     polls == 3
/// })
/// .await;
/// # }
/// ```
pub async fn within(limit: std::time::Duration, what: &str, mut done: impl AsyncFnMut() -> bool) {
    let until = std::time::Instant::now() + limit;
    while !done().await {
        assert!(std::time::Instant::now() < until, "waited {limit:?} for {what}");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// A multi-thread runtime of `workers` workers, with I/O and time, whose
/// workers drive its tasks whatever its callers do.
///
/// # Panics
///
/// When the runtime cannot be built.
///
/// ```
/// let rt = idem_testkit::multi_thread(1);
/// assert_eq!(rt.block_on(async { 1 + 1 }), 2);
/// ```
pub fn multi_thread(workers: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .expect("a multi-thread runtime")
}
