//! The lease: the keeper that extends running executions' locks, and the
//! clock by which each knows its deadline. See docs/PROTOCOL.md, "Lease".

use crate::operation::OperationInfo;
use crate::store::StoreError;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::Instrument as _;

/// When this execution's lock runs out, as far as it can tell.
#[derive(Clone, Copy)]
pub(crate) struct LeaseClock {
    pub(crate) lock_timeout: Duration,
    /// The lock deadline, or earlier: the store's clock set it after this.
    pub(crate) deadline: Instant,
}

/// How long the keeper sleeps with nothing due: a lease registered
/// meanwhile wakes it if its first beat is due sooner.
const IDLE: Duration = Duration::from_secs(1);

/// The heartbeats of one engine's running executions, driven by one task
/// of their own: each lock is extended every third of its lock timeout
/// until its [`Heartbeat`] is dropped. Starting an execution's heartbeat
/// spawns nothing; an extension runs in a task only when it is due (an
/// execution that lasts past a third of its lock timeout). The keeper runs
/// apart from the handlers' tasks, so that a handler that blocks its thread
/// (`block_in_place`, heavy work) still keeps its lease. When a lock is
/// taken over, or cannot be extended before its deadline, its lease counts
/// as lost and the handler is told (see [`Operation::lease_lost`]).
///
/// [`Operation::lease_lost`]: crate::Operation::lease_lost
#[derive(Default)]
pub(crate) struct Keeper {
    state: Mutex<State>,
    wake: Notify,
}

#[derive(Default)]
struct State {
    next_id: u64,
    leases: HashMap<u64, Entry>,
    /// When the keeper task wakes next, if it runs.
    wake_at: Option<Instant>,
    task: Option<JoinHandle<()>>,
}

struct Entry {
    info: OperationInfo,
    clock: LeaseClock,
    next_beat: Instant,
    /// The request's span, for what the keeper logs about it.
    span: tracing::Span,
    /// The extension under way, if any.
    beating: Option<JoinHandle<()>>,
}

/// An execution's registration with the keeper: its lock is extended until
/// this is dropped.
pub(crate) struct Heartbeat {
    keeper: Arc<Keeper>,
    id: u64,
}

impl Keeper {
    /// Starts extending `info`'s lock.
    pub(crate) fn start(self: &Arc<Self>, info: &OperationInfo, clock: LeaseClock) -> Heartbeat {
        let next_beat = Instant::now() + period(clock.lock_timeout);
        let mut state = self.lock();
        let id = state.next_id;
        state.next_id += 1;
        state.leases.insert(
            id,
            Entry {
                info: info.clone(),
                clock,
                next_beat,
                span: tracing::Span::current(),
                beating: None,
            },
        );
        if state.task.as_ref().is_none_or(JoinHandle::is_finished) {
            // The first lease, or the keeper's runtime is gone.
            let keeper = Arc::downgrade(self);
            state.task = Some(tokio::spawn(keep(keeper)));
            state.wake_at = Some(next_beat);
        } else {
            self.wake_by(&mut state, next_beat);
        }
        Heartbeat {
            keeper: self.clone(),
            id,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Makes the keeper wake by `due`.
    fn wake_by(&self, state: &mut State, due: Instant) {
        if state.wake_at.is_none_or(|w| due < w) {
            state.wake_at = Some(due);
            self.wake.notify_one();
        }
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        let entry = self.keeper.lock().leases.remove(&self.id);
        if let Some(beating) = entry.and_then(|e| e.beating) {
            beating.abort();
        }
    }
}

fn period(lock_timeout: Duration) -> Duration {
    (lock_timeout / 3).max(Duration::from_millis(10))
}

/// The keeper's task: starts each due extension, counts a lease whose
/// deadline passed without one as lost, then sleeps until the next is due.
async fn keep(keeper: Weak<Keeper>) {
    let Some(k) = keeper.upgrade() else { return };
    loop {
        if Arc::strong_count(&k) == 1 {
            // The engine and every heartbeat are gone.
            return;
        }
        let now = Instant::now();
        let mut next = now + IDLE;
        {
            let mut state = k.lock();
            let mut lost = Vec::new();
            for (&id, entry) in &mut state.leases {
                if entry.beating.as_ref().is_some_and(|b| !b.is_finished()) {
                    continue;
                }
                if now >= entry.clock.deadline {
                    lost.push(id);
                } else if now >= entry.next_beat {
                    entry.beating = Some(tokio::spawn(
                        beat(Arc::downgrade(&k), id, entry.info.clone(), entry.clock)
                            .instrument(entry.span.clone()),
                    ));
                } else {
                    next = next.min(entry.next_beat.min(entry.clock.deadline));
                }
            }
            for id in lost {
                if let Some(entry) = state.leases.remove(&id) {
                    let _in = entry.span.enter();
                    lease_lost(&entry.info);
                }
            }
            state.wake_at = Some(next);
        }
        let wake = k.wake.notified();
        tokio::select! {
            () = tokio::time::sleep_until(next) => {}
            () = wake => {}
        }
    }
}

/// One extension of the lock of lease `id`, bounded by its deadline.
async fn beat(keeper: Weak<Keeper>, id: u64, info: OperationInfo, clock: LeaseClock) {
    let asked = Instant::now();
    let extended = tokio::time::timeout_at(
        clock.deadline,
        info.store
            .extend_lock(&info.id, &info.lease.token, clock.lock_timeout),
    )
    .await;
    let Some(k) = keeper.upgrade() else { return };
    let mut state = k.lock();
    let retry = match extended {
        Ok(Ok(())) => None,
        Ok(Err(StoreError::LockLost)) => {
            tracing::error!("lock lost while the handler runs: another execution took over");
            Some(false)
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "could not extend the lock; trying again");
            Some(true)
        }
        Err(_) => Some(false),
    };
    match retry {
        Some(false) => {
            if state.leases.remove(&id).is_some() {
                lease_lost(&info);
            }
        }
        again => {
            let Some(entry) = state.leases.get_mut(&id) else {
                return;
            };
            if again.is_none() {
                entry.clock.deadline = asked + clock.lock_timeout;
            }
            entry.next_beat = Instant::now() + period(clock.lock_timeout);
            entry.beating = None;
            let due = entry.next_beat.min(entry.clock.deadline);
            k.wake_by(&mut state, due);
        }
    }
}

fn lease_lost(info: &OperationInfo) {
    if !info.is_lost() {
        tracing::error!("the lock could not be extended before its deadline: the lease counts as lost");
    }
    info.lost.send_replace(true);
}
