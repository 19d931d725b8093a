//! The in-memory store, for unit tests and demos. Its reservation rules are
//! the state table of [`crate::store`], written in Rust.

use crate::store::{
    random_token, BoxFuture, Decision, IdempotencyStore, Lease, RecordId, RecordState, Reservation,
    ReserveRequest, StoreError, StoredResponse,
};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
struct MemoryRecord {
    fingerprint: String,
    token: Option<String>,
    attempt: u32,
    operation_id: String,
    recovery_point: Option<String>,
    lock_deadline: Instant,
    expires_at: Instant,
    /// The retention it was reserved with.
    ttl: Duration,
    response: Option<StoredResponse>,
}

impl MemoryRecord {
    fn lock_live(&self, now: Instant) -> bool {
        self.response.is_none() && self.lock_deadline > now
    }

    /// Its operation's first attempt, with no recovery point: nothing can
    /// have happened under it yet, so it may be removed as if never taken.
    fn untouched(&self) -> bool {
        self.attempt == 1 && self.recovery_point.is_none()
    }

    /// As if absent, and purgeable: a completed record past its TTL; one in
    /// progress only once also a whole TTL past its lock deadline.
    fn gone(&self, now: Instant) -> bool {
        self.expires_at <= now && (self.response.is_some() || self.lock_deadline + self.ttl <= now)
    }

    /// Its row of the state table.
    fn state(&self, now: Instant) -> RecordState {
        if self.gone(now) && !self.lock_live(now) {
            RecordState::Gone
        } else if self.response.is_some() {
            RecordState::Completed
        } else if self.lock_deadline > now {
            RecordState::Locked
        } else if self.token.is_none() {
            RecordState::Released
        } else {
            RecordState::Stale
        }
    }
}

/// An in-process store for unit tests and demos.
///
/// Records live in one process's memory: they vanish on restart and are not
/// shared between servers, so it protects nothing across processes. Use
/// [`crate::SqliteStore`] or [`crate::PgStore`] for anything real.
///
/// Records are spread over 256 shards, each behind its own lock: a request
/// locks one shard for one step, and a shard that grows rehashes only its
/// own records (a 256th), so a growing store never stalls the others (the
/// slowest reservation while it grows past a million records: 5 to 8 ms,
/// against 360 ms for one locked map; `IDEM_BENCH_GROWTH=1200000 cargo run
/// --release --example bench`). Memory is bounded by the records within their retention: expired
/// ones stay until [`purge_expired`](crate::purge_expired) (or a
/// [`Janitor`](crate::Janitor)) removes them, about 1 kB each plus the
/// stored body.
///
/// ```
/// use idem::MemoryStore;
/// let store = MemoryStore::new();
/// assert_eq!(store.len(), 0);
/// ```
#[derive(Debug)]
pub struct MemoryStore {
    shards: Box<[Mutex<HashMap<RecordId, MemoryRecord>>]>,
    hasher: std::hash::RandomState,
}

/// How many locks the records are spread over.
const SHARDS: usize = 256;

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: std::hash::RandomState::new(),
        }
    }
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many records it holds, expired ones included.
    pub fn len(&self) -> usize {
        (0..SHARDS).map(|i| lock(&self.shards[i]).len()).sum()
    }

    /// Whether it holds no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The shard that holds `id`, locked.
    fn shard(&self, id: &RecordId) -> std::sync::MutexGuard<'_, HashMap<RecordId, MemoryRecord>> {
        use std::hash::BuildHasher as _;
        lock(&self.shards[self.hasher.hash_one(id) as usize % SHARDS])
    }

    fn fenced<T>(
        &self,
        id: &RecordId,
        token: &str,
        change: impl FnOnce(&mut HashMap<RecordId, MemoryRecord>, Instant) -> T,
    ) -> Result<T, StoreError> {
        let mut records = self.shard(id);
        let now = Instant::now();
        match records.get(id) {
            Some(r) if r.response.is_none() && r.token.as_deref() == Some(token) => {
                Ok(change(&mut records, now))
            }
            _ => Err(StoreError::LockLost),
        }
    }

    fn reserve_now(&self, req: ReserveRequest<'_>) -> Reservation {
        let mut records = self.shard(req.id);
        let now = Instant::now();
        // Judged in place: a replay copies the stored answer and nothing
        // else, a conflict copies nothing.
        let existing = records.get(req.id);
        let state = existing.map_or(RecordState::Absent, |r| r.state(now));
        let same = existing.is_some_and(|r| r.fingerprint == req.fingerprint);
        let (record, taken_over) = match (state.decide(same), existing) {
            (Decision::Fresh, _) | (_, None) => (
                MemoryRecord {
                    fingerprint: req.fingerprint.to_owned(),
                    token: Some(req.token.to_owned()),
                    attempt: 1,
                    operation_id: random_token(),
                    recovery_point: None,
                    lock_deadline: now + req.lock_timeout,
                    expires_at: now + req.ttl,
                    ttl: req.ttl,
                    response: None,
                },
                false,
            ),
            (Decision::Continue, Some(r)) => (
                MemoryRecord {
                    token: Some(req.token.to_owned()),
                    attempt: r.attempt + 1,
                    lock_deadline: now + req.lock_timeout,
                    ..r.clone()
                },
                state == RecordState::Stale,
            ),
            (Decision::Replay, Some(r)) => {
                return Reservation::Completed(
                    r.response
                        .clone()
                        .unwrap_or_else(|| unreachable!("a completed record")),
                )
            }
            (Decision::InProgress, Some(r)) => {
                return Reservation::InProgress {
                    retry_after: r.lock_deadline.saturating_duration_since(now),
                }
            }
            (Decision::Mismatch, Some(_)) => return Reservation::Mismatch,
        };
        let lease = Lease {
            token: req.token.to_owned(),
            attempt: record.attempt,
            takeover: taken_over,
            recovery_point: record.recovery_point.clone(),
            operation_id: record.operation_id.clone(),
        };
        records.insert(req.id.clone(), record);
        Reservation::Reserved(lease)
    }
}

impl IdempotencyStore for MemoryStore {
    fn reserve<'a>(&'a self, req: ReserveRequest<'a>) -> BoxFuture<'a, Result<Reservation, StoreError>> {
        Box::pin(async move {
            let answer = self.reserve_now(req);
            pause_point!(crate::pause::RESERVE_AFTER, &req.id.key);
            Ok(answer)
        })
    }

    fn complete<'a>(
        &'a self,
        id: &'a RecordId,
        token: &'a str,
        response: &'a StoredResponse,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            self.fenced(id, token, |records, now| {
                if let Some(r) = records.get_mut(id) {
                    r.response = Some(response.clone());
                    r.token = None;
                    // The answer is kept a whole TTL from its completion.
                    r.expires_at = now + r.ttl;
                }
            })?;
            pause_point!(crate::pause::COMPLETE_AFTER, &id.key);
            Ok(())
        })
    }

    fn release<'a>(&'a self, id: &'a RecordId, token: &'a str) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            self.fenced(id, token, |records, now| {
                if let Some(r) = records.get_mut(id) {
                    r.token = None;
                    r.lock_deadline = now;
                }
            })?;
            pause_point!(crate::pause::RELEASE_AFTER, &id.key);
            Ok(())
        })
    }

    fn reject<'a>(&'a self, id: &'a RecordId, token: &'a str) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            self.fenced(id, token, |records, now| {
                if records.get(id).is_some_and(MemoryRecord::untouched) {
                    records.remove(id);
                } else if let Some(r) = records.get_mut(id) {
                    r.token = None;
                    r.lock_deadline = now;
                }
            })?;
            pause_point!(crate::pause::REJECT_AFTER, &id.key);
            Ok(())
        })
    }

    fn hand_back<'a>(
        &'a self,
        id: &'a RecordId,
        token: &'a str,
        taken_over: bool,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            self.fenced(id, token, |records, now| {
                if records.get(id).is_some_and(MemoryRecord::untouched) {
                    records.remove(id);
                } else if let Some(r) = records.get_mut(id) {
                    if !taken_over {
                        r.token = None;
                    }
                    r.lock_deadline = now;
                }
            })
        })
    }

    fn checkpoint<'a>(
        &'a self,
        id: &'a RecordId,
        token: &'a str,
        recovery_point: &'a str,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            self.fenced(id, token, |records, _| {
                if let Some(r) = records.get_mut(id) {
                    r.recovery_point = Some(recovery_point.to_owned());
                }
            })?;
            pause_point!(crate::pause::CHECKPOINT_AFTER, &id.key);
            Ok(())
        })
    }

    fn extend_lock<'a>(
        &'a self,
        id: &'a RecordId,
        token: &'a str,
        lock_timeout: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            self.fenced(id, token, |records, now| {
                if let Some(r) = records.get_mut(id) {
                    r.lock_deadline = now + lock_timeout;
                }
            })?;
            pause_point!(crate::pause::EXTEND_AFTER, &id.key);
            Ok(())
        })
    }

    fn purge_expired(&self, batch: u32) -> BoxFuture<'_, Result<u64, StoreError>> {
        Box::pin(async move {
            // One shard locked at a time.
            let mut removed = 0u64;
            for shard in self.shards.iter() {
                let left = u64::from(batch).saturating_sub(removed);
                if left == 0 {
                    break;
                }
                let mut records = lock(shard);
                let now = Instant::now();
                let doomed: Vec<RecordId> = records
                    .iter()
                    .filter(|(_, r)| r.gone(now) && !r.lock_live(now))
                    .map(|(id, _)| id.clone())
                    .take(usize::try_from(left).unwrap_or(usize::MAX))
                    .collect();
                for id in &doomed {
                    records.remove(id);
                }
                removed += doomed.len() as u64;
            }
            pause_point!(crate::pause::PURGE_AFTER, "");
            Ok(removed)
        })
    }
}

/// Locks a shard. A panic while holding the lock cannot leave a record
/// half-written: every change is a single assignment.
fn lock(
    shard: &Mutex<HashMap<RecordId, MemoryRecord>>,
) -> std::sync::MutexGuard<'_, HashMap<RecordId, MemoryRecord>> {
    shard.lock().unwrap_or_else(|e| e.into_inner())
}
