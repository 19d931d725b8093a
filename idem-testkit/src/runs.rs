//! How many times a test's handler ran for each key.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// A count of runs per key, shared by a handler's clones and the test.
///
/// ```
/// let runs = idem_testkit::Runs::default();
/// assert_eq!(runs.ran("k"), 1); // the handler counts its run
/// assert_eq!(runs.ran("k"), 2);
/// assert_eq!(runs.of("k"), 2); // the test reads the count
/// assert_eq!(runs.of("other"), 0);
/// ```
#[derive(Clone, Default)]
pub struct Runs(Arc<Mutex<HashMap<String, u32>>>);

impl Runs {
    /// Counts one more run of `key`, and returns how many it has had.
    pub fn ran(&self, key: &str) -> u32 {
        let mut runs = self.0.lock().unwrap();
        let n = runs.entry(key.to_owned()).or_default();
        *n += 1;
        *n
    }

    /// How many runs `key` has had.
    pub fn of(&self, key: &str) -> u32 {
        self.0.lock().unwrap().get(key).copied().unwrap_or(0)
    }
}
