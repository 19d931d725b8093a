//! The lease: the heartbeat that extends a running execution's lock, and
//! the clock by which it knows its deadline. See docs/PROTOCOL.md, "Lease".

use crate::operation::OperationInfo;
use crate::store::StoreError;
use std::time::Duration;
use tokio::time::Instant;
use tracing::Instrument as _;

/// When this execution's lock runs out, as far as it can tell.
#[derive(Clone, Copy)]
pub(crate) struct LeaseClock {
    pub(crate) lock_timeout: Duration,
    /// The lock deadline, or earlier: the store's clock set it after this.
    pub(crate) deadline: Instant,
}

/// The lease's heartbeat: it extends the lock every third of the lock
/// timeout until dropped. It runs in a task of its own, so that a handler
/// that blocks its thread (`block_in_place`, heavy work) still keeps its
/// lease. When the lock is taken over, or cannot be extended before its
/// deadline, the lease counts as lost and the handler is told (see
/// [`Operation::lease_lost`]).
pub(crate) struct Heartbeat(tokio::task::JoinHandle<()>);

impl Heartbeat {
    pub(crate) fn start(info: &OperationInfo, clock: LeaseClock) -> Self {
        let info = info.clone();
        let beat = async move {
            let period = (clock.lock_timeout / 3).max(Duration::from_millis(10));
            let mut deadline = clock.deadline;
            loop {
                tokio::select! {
                    () = tokio::time::sleep_until(deadline) => break,
                    () = tokio::time::sleep(period) => {}
                }
                let asked = Instant::now();
                let extended = tokio::time::timeout_at(
                    deadline,
                    info.store
                        .extend_lock(&info.id, &info.lease.token, clock.lock_timeout),
                )
                .await;
                match extended {
                    Ok(Ok(())) => deadline = asked + clock.lock_timeout,
                    Ok(Err(StoreError::LockLost)) => {
                        tracing::error!("lock lost while the handler runs: another execution took over");
                        break;
                    }
                    Ok(Err(e)) => tracing::warn!(error = %e, "could not extend the lock; trying again"),
                    Err(_) => break,
                }
            }
            if !info.is_lost() {
                tracing::error!(
                    "the lock could not be extended before its deadline: the lease counts as lost"
                );
            }
            info.lost.send_replace(true);
        };
        Heartbeat(tokio::spawn(beat.in_current_span()))
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.0.abort();
    }
}
