//! Every line a test binary logs, kept to be read back.

use std::sync::{Arc, Mutex, OnceLock};

/// A log writer that keeps every line it is given.
#[derive(Clone, Default)]
pub struct Logged(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Logged {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Logged {
    /// Everything written so far, as text (invalid UTF-8 replaced).
    pub fn text(&self) -> String {
        let bytes = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// Every line the test binary logs, at TRACE, with a line per span as it
/// closes, from the first call on. A test that reads it calls it before
/// what it logs, and looks for lines of its own (by a name no other test
/// uses): the tests of the binary run at once, and log into the same text.
///
/// The subscriber is the process's global one: the protocol runs in tasks
/// on any thread. A scoped one (`set_default`) is not enough even on a
/// current-thread runtime: while it is the only subscriber in the process,
/// a callsite that another test's thread reaches first caches "never"
/// for every thread (tracing issue 3611), and its events are lost.
///
/// # Panics
///
/// When another global subscriber was set first.
///
/// ```
/// let logs = idem_testkit::logs();
/// tracing::warn!(marker = "doc-example", "something worth a line");
/// assert!(logs.text().contains("doc-example"));
/// ```
pub fn logs() -> &'static Logged {
    static LOGS: OnceLock<Logged> = OnceLock::new();
    LOGS.get_or_init(|| {
        let logged = Logged::default();
        let writer = logged.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::set_global_default(subscriber).expect("no other global subscriber");
        logged
    })
}
