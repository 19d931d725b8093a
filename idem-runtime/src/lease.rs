//! The lease: the keeper that extends running executions' locks, and the
//! clock by which each knows its deadline. See docs/PROTOCOL.md, "Lease".

use crate::operation::OperationInfo;
use crate::store::StoreError;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Condvar, LazyLock, Mutex, MutexGuard};
use std::time::Duration;
use tokio::runtime::Handle;
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

impl LeaseClock {
    /// The clock of a lock of `lock_timeout` that a store set at `asked`
    /// or later. Counted in whole milliseconds, rounded down, as the SQL
    /// stores add it to their clock (a lock timeout of 100.9 ms is a 100 ms
    /// lock there): never later than the store's deadline. The heartbeats
    /// ask for the same.
    pub(crate) fn new(asked: Instant, lock_timeout: Duration) -> Self {
        let lock_timeout = Duration::from_millis(u64::try_from(lock_timeout.as_millis()).unwrap_or(u64::MAX));
        LeaseClock {
            lock_timeout,
            deadline: asked
                .checked_add(lock_timeout)
                .unwrap_or_else(|| far_future(asked)),
        }
    }

    /// Whether an execution starting at `now` has too little of its lock
    /// left for its first extension to land in time: under a tenth of the
    /// lock timeout, or under three of the keeper's shortest beats (it
    /// extends a fresh lease halfway to its deadline, never sooner than
    /// one beat from now). A reservation that slow is refused rather than
    /// started on a lease it would lose at once.
    pub(crate) fn too_late_to_start(&self, now: Instant) -> bool {
        let margin = (self.lock_timeout / 10).max(SHORTEST_BEAT * 3);
        now + margin > self.deadline
    }
}

/// A hundred years after `at`, or as far as an `Instant` can tell: a lock
/// that never runs out.
fn far_future(at: Instant) -> Instant {
    let mut by = Duration::from_secs(100 * 365 * 86_400);
    loop {
        if let Some(far) = at.checked_add(by) {
            return far;
        }
        by /= 2;
    }
}

/// The keeper's shortest interval between a lease's extensions, so that a
/// store that fails at once is not called in a loop.
const SHORTEST_BEAT: Duration = Duration::from_millis(10);

/// How long the keeper sleeps with nothing due: a lease registered
/// meanwhile wakes it if it is due sooner.
const IDLE: Duration = Duration::from_secs(1);

/// The process's lease keeper: one thread that knows every running
/// execution's lease and, when one is due, spawns its extension on the
/// runtime that execution runs on (its store's connections belong there).
/// Starting an execution's heartbeat is a registration (a lock and a map
/// insert), not a task. Being a thread of its own, the keeper is never
/// held up by a handler that blocks its thread, nor tied to one runtime:
/// executions on several runtimes, one after the other or at once, are all
/// kept. Each extension runs on its execution's runtime, so it waits for a
/// free worker there: one that blocks with `block_in_place` hands its
/// worker's tasks to another thread; work that blocks every worker of a
/// runtime holds up its extensions with the rest of its I/O.
static KEEPER: LazyLock<Keeper> = LazyLock::new(Keeper::default);

#[derive(Default)]
struct Keeper {
    state: Mutex<State>,
    wake: Condvar,
}

#[derive(Default)]
struct State {
    next_id: u64,
    leases: HashMap<u64, Entry, BuildHasherDefault<SequenceHasher>>,
    /// When the keeper thread wakes next, once it runs.
    wake_at: Option<Instant>,
    running: bool,
}

struct Entry {
    info: OperationInfo,
    clock: LeaseClock,
    /// When the next extension is due; the deadline while one is under way.
    next_beat: Instant,
    /// The request's span, for what the keeper logs about it.
    span: tracing::Span,
    /// The runtime the execution runs on.
    runtime: Handle,
    /// The extension under way, if any.
    beating: Option<Beating>,
}

/// An extension under way: its task, and whether its runtime has run it
/// yet (it has asked the store).
struct Beating {
    task: JoinHandle<()>,
    started: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

/// An execution's lease, kept (its lock extended every third of its lock
/// timeout) until this is dropped. When the lock is taken over, or cannot
/// be extended before its deadline, the lease counts as lost and the
/// handler is told (see [`Operation::lease_lost`]).
///
/// [`Operation::lease_lost`]: crate::Operation::lease_lost
pub(crate) struct Heartbeat {
    id: u64,
    /// Its execution, under way until the lease ends (`Idem::idle`).
    _under_way: crate::store::UnderWayGuard,
}

impl Heartbeat {
    /// Starts keeping `info`'s lease. Must be called within a Tokio runtime.
    pub(crate) fn start(
        info: &OperationInfo,
        clock: LeaseClock,
        under_way: crate::store::UnderWayGuard,
    ) -> Heartbeat {
        let next_beat = next_beat(Instant::now(), &clock);
        let mut state = KEEPER.lock();
        let id = state.next_id;
        state.next_id += 1;
        state.leases.insert(
            id,
            Entry {
                info: info.clone(),
                clock,
                next_beat,
                span: tracing::Span::current(),
                runtime: Handle::current(),
                beating: None,
            },
        );
        if !state.running {
            match std::thread::Builder::new()
                .name("idem-lease-keeper".into())
                .spawn(|| KEEPER.run())
            {
                Ok(_) => state.running = true,
                // Tried again at the next start; meanwhile the lease runs
                // out and counts as lost: nothing runs twice.
                Err(e) => tracing::error!(error = %e, "could not start the lease keeper thread"),
            }
        }
        KEEPER.wake_by(&mut state, next_beat);
        Heartbeat {
            id,
            _under_way: under_way,
        }
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        let Some(entry) = KEEPER.lock().leases.remove(&self.id) else {
            return;
        };
        if let Some(beating) = entry.beating {
            beating.task.abort();
        }
        // Nothing extends the lock from here. An execution that has not
        // begun to record its outcome (its future dropped with its
        // runtime) never will: its lease is lost, and work it handed a
        // clone of its `Operation` (a blocking task, which a runtime's
        // drop waits for) is told, rather than left to go on while the
        // lock lapses and another execution takes the operation over.
        // Once it settles, its outcome's write decides (`lease_ended`).
        if entry.info.lease_ended() {
            let _span = entry.span.enter();
            tracing::warn!("the execution ended before recording its outcome; its lease is lost");
        }
    }
}

/// Hashes the keeper's lease ids, which it numbers itself in sequence:
/// one multiplication spreads them over the table, where a keyed hash
/// would defend against keys that nobody else chooses.
#[derive(Default)]
struct SequenceHasher(u64);

impl Hasher for SequenceHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(self.0.rotate_left(8) ^ u64::from(b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

fn period(lock_timeout: Duration) -> Duration {
    (lock_timeout / 3).max(SHORTEST_BEAT)
}

/// When the next extension is due: a period from now, but never later than
/// halfway to the deadline, so that a lease with little time left (its
/// reservation was slow, or an extension failed or took long) is extended
/// while it still can be, not counted as lost without a try. At least 10 ms
/// apart, so that a store that fails at once is not called in a loop.
fn next_beat(now: Instant, clock: &LeaseClock) -> Instant {
    let halfway = clock.deadline.saturating_duration_since(now) / 2;
    now + period(clock.lock_timeout).min(halfway).max(SHORTEST_BEAT)
}

impl Keeper {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Makes the keeper wake by `due`.
    fn wake_by(&self, state: &mut State, due: Instant) {
        if state.wake_at.is_none_or(|w| due < w) {
            state.wake_at = Some(due);
            self.wake.notify_one();
        }
    }

    /// The keeper thread: starts each due extension, counts a lease whose
    /// deadline passed without one as lost, then sleeps until the next is
    /// due or a sooner one is registered.
    fn run(&self) {
        let mut state = self.lock();
        loop {
            let now = Instant::now();
            let mut next = now + IDLE;
            let mut lost = Vec::new();
            for (&id, entry) in &mut state.leases {
                if let Some(beating) = entry.beating.as_ref().filter(|b| !b.task.is_finished()) {
                    // The extension under way decides, by the deadline at
                    // the latest (its own timer, which looks at the store's
                    // answer first: one that came in time counts, however
                    // late its task is polled). Unless its runtime never
                    // ran it (the handler's blocking work holds that
                    // runtime's only thread): nothing was asked of the
                    // store, so past the deadline the lease is lost all
                    // the same, and the handler is told.
                    if !beating.started.load(std::sync::atomic::Ordering::Acquire) {
                        if now >= entry.clock.deadline {
                            lost.push(id);
                        } else {
                            next = next.min(entry.clock.deadline);
                        }
                    }
                    continue;
                }
                if now >= entry.clock.deadline {
                    lost.push(id);
                } else if now >= entry.next_beat {
                    // Until the extension says otherwise, nothing is due
                    // before the deadline.
                    entry.next_beat = entry.clock.deadline;
                    let started = std::sync::Arc::default();
                    let beat = beat(
                        id,
                        entry.info.clone(),
                        entry.clock,
                        std::sync::Arc::clone(&started),
                    )
                    .instrument(entry.span.clone());
                    entry.beating = Some(Beating {
                        task: entry.runtime.spawn(beat),
                        started,
                    });
                    next = next.min(entry.clock.deadline);
                } else {
                    next = next.min(entry.next_beat);
                }
            }
            for id in lost {
                if let Some(entry) = state.leases.remove(&id) {
                    let _in = entry.span.enter();
                    lease_lost(&entry.info);
                }
            }
            state.wake_at = Some(next);
            let sleep = next.saturating_duration_since(Instant::now());
            state = self
                .wake
                .wait_timeout(state, sleep)
                .map_or_else(|e| e.into_inner().0, |(guard, _)| guard);
        }
    }
}

/// One extension of the lock of lease `id`, bounded by its deadline;
/// `started` once its runtime runs it.
async fn beat(
    id: u64,
    info: OperationInfo,
    clock: LeaseClock,
    started: std::sync::Arc<std::sync::atomic::AtomicBool>,
) {
    started.store(true, std::sync::atomic::Ordering::Release);
    let asked = Instant::now();
    let extended = tokio::time::timeout_at(
        clock.deadline,
        info.store
            .extend_lock(&info.id, &info.lease.token, clock.lock_timeout),
    )
    .await;
    let mut state = KEEPER.lock();
    let extended = match extended {
        Ok(Ok(())) => true,
        Ok(Err(StoreError::LockLost)) => {
            if state.leases.remove(&id).is_some() {
                if info.lease_ended() {
                    tracing::error!("lock lost while the handler runs: another execution took over");
                } else {
                    // The execution's own completion (or release) may have
                    // cleared the lock: its write tells a takeover apart.
                    tracing::debug!("the lock is gone while the execution records its outcome");
                }
            }
            return;
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "could not extend the lock; trying again");
            false
        }
        Err(_) => {
            if state.leases.remove(&id).is_some() {
                lease_lost(&info);
            }
            return;
        }
    };
    let Some(entry) = state.leases.get_mut(&id) else {
        return;
    };
    if extended {
        entry.clock.deadline = asked + clock.lock_timeout;
    }
    entry.next_beat = next_beat(Instant::now(), &entry.clock);
    entry.beating = None;
    let due = entry.next_beat;
    KEEPER.wake_by(&mut state, due);
}

/// The lease's deadline passed without an extension.
fn lease_lost(info: &OperationInfo) {
    if info.lease_ended() {
        tracing::error!("the lock could not be extended before its deadline: the lease counts as lost");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lock timeout with a fraction of a millisecond is a lock of the
    /// whole milliseconds in the SQL stores: the clock runs out no later.
    #[test]
    fn the_clock_counts_whole_milliseconds_as_the_stores_do() {
        let asked = Instant::now();
        let clock = LeaseClock::new(asked, Duration::from_nanos(100_999_999));
        assert_eq!(clock.lock_timeout, Duration::from_millis(100));
        assert_eq!(clock.deadline, asked + Duration::from_millis(100));
        let whole = LeaseClock::new(asked, Duration::from_millis(101));
        assert_eq!(whole.deadline, asked + Duration::from_millis(101));
        // A lock that never runs out, as far as the clock can tell.
        let never = LeaseClock::new(asked, Duration::MAX);
        assert!(never.deadline > asked + Duration::from_secs(365 * 86_400));
    }
}
