//! The janitor: deleting records past their retention, in batches, now
//! ([`purge_expired`]) or in the background ([`Janitor`]).

use crate::store::{IdempotencyStore, StoreError};
use std::time::Duration;

/// Deletes every record past its TTL, `batch` at a time (each batch one
/// short statement, so no long table lock; a `batch` of 0 counts as 1,
/// where a store's own `purge_expired(0)` deletes nothing), and says how
/// many it deleted. Call it from a scheduler, or let
/// [`crate::Idem::start_janitor`] do it.
///
/// # Errors
///
/// The first [`StoreError`] of a batch; what earlier batches deleted stays deleted.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let store = idem::MemoryStore::new();
/// assert_eq!(idem::purge_expired(&store, 500).await.unwrap(), 0);
/// # }
/// ```
pub async fn purge_expired(store: &dyn IdempotencyStore, batch: u32) -> Result<u64, StoreError> {
    let mut total = 0;
    purge_batches(store, batch, |n| total += n).await?;
    Ok(total)
}

/// Purges batch after batch until one comes back short, telling `removed`
/// what each deleted as soon as it is committed (so that a later batch's
/// failure loses no count).
async fn purge_batches(
    store: &dyn IdempotencyStore,
    batch: u32,
    mut removed: impl FnMut(u64),
) -> Result<(), StoreError> {
    let batch = batch.max(1);
    loop {
        let n = store.purge_expired(batch).await?;
        removed(n);
        if n < u64::from(batch) {
            return Ok(());
        }
        tokio::task::yield_now().await;
    }
}

/// A background task that deletes expired records: every `every`, it
/// purges in batches of `batch` until nothing expired is left. It never
/// removes a record whose lock is still valid. Stops when dropped or
/// [`Janitor::stop`]ped.
///
/// ```
/// use idem::{Janitor, MemoryStore};
/// use std::{sync::Arc, time::Duration};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let janitor = Janitor::start(Arc::new(MemoryStore::new()), Duration::from_secs(60), 500);
/// assert_eq!(janitor.removed(), 0);
/// janitor.stop();
/// # }
/// ```
#[derive(Debug)]
pub struct Janitor {
    task: tokio::task::JoinHandle<()>,
    removed: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl Janitor {
    /// Starts the janitor on the current Tokio runtime. Its first pass runs
    /// at once; the next ones every `every` (10 ms at the least). A round
    /// that fails (the store down, the table missing before `migrate`) logs
    /// one warning and is tried again at the next round: a store that stays
    /// down is logged once per period, so keep the period to seconds
    /// ([`Idem::start_janitor`](crate::Idem::start_janitor) refuses less
    /// than a second).
    ///
    /// # Panics
    ///
    /// When called outside a Tokio runtime.
    pub fn start(store: std::sync::Arc<dyn IdempotencyStore>, every: Duration, batch: u32) -> Self {
        let removed = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counter = removed.clone();
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(every.max(Duration::from_millis(10)));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let mut round = 0;
                let done = purge_batches(&*store, batch, |n| {
                    round += n;
                    counter.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
                })
                .await;
                match done {
                    Ok(()) if round == 0 => {}
                    Ok(()) => tracing::info!(removed = round, "idempotency janitor removed expired records"),
                    Err(e) => tracing::warn!(
                        error = %e,
                        removed = round,
                        "idempotency janitor failed; retrying next round"
                    ),
                }
            }
        });
        Janitor { task, removed }
    }

    /// How many records it removed so far: every batch whose commit the
    /// store confirmed, in rounds that ended in a failure as in the others
    /// (a batch that committed after the store's timeout gave up on its
    /// answer is not counted).
    pub fn removed(&self) -> u64 {
        self.removed.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Stops the janitor.
    pub fn stop(self) {
        self.task.abort();
    }
}

impl Drop for Janitor {
    fn drop(&mut self) {
        self.task.abort();
    }
}
