//! Gates a test opens by key: a handler waits on its key's gate, so that
//! the test decides when it goes on, never a sleep.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;

/// One [`Notify`] per key, made at its first use by either side.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let gates = idem_testkit::Gates::default();
/// gates.gate("k").notify_one(); // the test opens it, before or after
/// gates.gate("k").notified().await; // the handler waits
/// # }
/// ```
#[derive(Clone, Default)]
pub struct Gates(Arc<Mutex<HashMap<String, Arc<Notify>>>>);

impl Gates {
    /// The gate of `key`: `notified().await` to wait on it, `notify_one()`
    /// to open it (a gate opened before its wait lets the wait through).
    pub fn gate(&self, key: &str) -> Arc<Notify> {
        self.0.lock().unwrap().entry(key.to_owned()).or_default().clone()
    }
}
