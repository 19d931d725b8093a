//! The in-memory store, for unit tests and demos. Its reservation rules are
//! the state table of [`crate::store`], written in Rust.

use crate::store::{
    random_token, BoxFuture, Decision, IdempotencyStore, Lease, RecordId, RecordState, Reservation,
    ReserveRequest, StoreError, StoredResponse,
};
use std::hash::BuildHasher as _;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// `at` plus `d`, or, past what the clock can tell (a duration no layer
/// accepts: the store is public), the latest instant it can: "never", for
/// a deadline or an expiry, rather than a panic.
fn after(at: Instant, d: Duration) -> Instant {
    if let Some(t) = at.checked_add(d) {
        return t;
    }
    let (mut t, mut step) = (at, d);
    while !step.is_zero() {
        match t.checked_add(step) {
            Some(next) => t = next,
            None => step /= 2,
        }
    }
    t
}

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
        self.expires_at <= now && (self.response.is_some() || after(self.lock_deadline, self.ttl) <= now)
    }

    /// What the janitor removes: gone, and not locked.
    fn purgeable(&self, now: Instant) -> bool {
        self.gone(now) && !self.lock_live(now)
    }

    /// The first instant at which it is [`purgeable`](Self::purgeable), as
    /// long as it is not changed: purgeable exactly from then on (a
    /// completed record at its expiry; one in progress once both its
    /// expiry and a whole TTL past its lock deadline have come, which is
    /// also past the deadline itself).
    fn purgeable_from(&self) -> Instant {
        if self.response.is_some() {
            return self.expires_at;
        }
        self.expires_at.max(after(self.lock_deadline, self.ttl))
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
/// locks one shard for one step, and a shard that grows moves only its own
/// records (a 256th), without hashing them again, and only a hash, a time
/// and a pointer for each (32 bytes), so a growing store never stalls the
/// others (the slowest reservation while it grows past a million records:
/// 3 to 9 ms on a quiet machine, against 270 to 360 ms for one locked map,
/// where a machine whose own stalls reach 4 to 8 ms gives 3 to 36 ms
/// against 700 to 1,300; `cargo run --release -p idem-bench -- --growth
/// 1200000`, which times that floor too). Memory is bounded by the records
/// within their retention, about 550 bytes each with short ids, plus its
/// tenant, scope and key, each kept once (three ids of 255 bytes, the
/// longest a client's key may be, add about 700 bytes), plus the stored
/// answer (1.2 million records with short ids and 200-byte bodies: 870 MiB
/// resident, as `--growth` prints): a shard that is full first drops its expired records (by
/// the rule of [`purge_expired`](crate::purge_expired), which a
/// [`Janitor`](crate::Janitor) runs) before it grows, so without a janitor
/// each of its 256 shards holds at most about four times the most records
/// it has held within their retention at once, and at least the 3 its
/// smallest table holds. A store whose records come and go evenly over
/// its shards (its ids are hashed with a key of its own, so clients cannot
/// aim at one) holds about four times its most records within retention,
/// plus up to 768 expired ones; at worst, where each shard's busiest time
/// is another's quiet one, four times the sum of each shard's own most
/// (with their bodies: run a janitor where answers are large).
///
/// ```
/// use idem::MemoryStore;
/// let store = MemoryStore::new();
/// assert_eq!(store.len(), 0);
/// ```
#[derive(Debug)]
pub struct MemoryStore {
    shards: Box<[Mutex<Shard>]>,
    /// Keyed at random per store: the keys are the clients'.
    hasher: std::hash::RandomState,
    /// Where the last purge that filled its batch stopped: a shard (the
    /// high 16 bits) and a bucket of its table (the rest), where the next
    /// one starts, so that a janitor's round reads each bucket about twice
    /// whatever its batch, not once per batch (see `purge_round`).
    purge_from: std::sync::atomic::AtomicU64,
    /// How many of its tables' buckets purges have read (for tests).
    #[cfg(feature = "pause-points")]
    purge_reads: std::sync::atomic::AtomicU64,
}

/// One shard's records, each with its id's hash: a store call hashes its
/// id once, for the shard and the table both, and a table that grows moves
/// its records without hashing them again.
type Shard = hashbrown::HashTable<Slot>;

/// A record's place in its shard's table: its hash, when it becomes
/// purgeable, and the record boxed, so that a table that grows moves 32
/// bytes per record rather than the record (about 280 bytes), a table
/// stays small enough to be taken from the heap rather than mapped afresh,
/// page by page, each time it doubles, and a sweep reads the table alone,
/// never a record that is not yet due.
#[derive(Debug)]
struct Slot {
    hash: u64,
    /// The record's [`MemoryRecord::purgeable_from`], kept with every
    /// change to it ([`Place::put`], [`Place::update`]).
    purgeable_from: Instant,
    entry: Box<Entry>,
}

#[derive(Debug)]
struct Entry {
    id: RecordId,
    record: MemoryRecord,
}

impl Slot {
    /// Whether it holds `id`, whose hash is `hash`: the hashes are compared
    /// first, so that another id's strings are never read.
    fn is(&self, hash: u64, id: &RecordId) -> bool {
        self.hash == hash && self.entry.id == *id
    }

    /// Whether its record is purgeable at `now`: read from the record
    /// only once it is due.
    fn purgeable(&self, now: Instant) -> bool {
        self.purgeable_from <= now && self.entry.record.purgeable(now)
    }
}

/// One record's place in its shard, the shard locked: every store call is
/// one step under one lock.
struct Place<'a> {
    shard: MutexGuard<'a, Shard>,
    hash: u64,
    id: &'a RecordId,
}

impl Place<'_> {
    fn get(&self) -> Option<&MemoryRecord> {
        let (hash, id) = (self.hash, self.id);
        self.shard.find(hash, |s| s.is(hash, id)).map(|s| &s.entry.record)
    }

    /// Runs `change` on the record here, if any, and keeps its slot's
    /// `purgeable_from` with it.
    fn update(&mut self, change: impl FnOnce(&mut MemoryRecord)) {
        let (hash, id) = (self.hash, self.id);
        if let Some(slot) = self.shard.find_mut(hash, |s| s.is(hash, id)) {
            change(&mut slot.entry.record);
            slot.purgeable_from = slot.entry.record.purgeable_from();
        }
    }

    /// Puts `record` here, in place of the one here if any.
    fn put(&mut self, record: MemoryRecord) {
        let (hash, id) = (self.hash, self.id);
        let purgeable_from = record.purgeable_from();
        if let Some(slot) = self.shard.find_mut(hash, |s| s.is(hash, id)) {
            slot.entry.record = record;
            slot.purgeable_from = purgeable_from;
            return;
        }
        if self.shard.len() == self.shard.capacity() {
            make_room(&mut self.shard, Instant::now());
        }
        let slot = Slot {
            hash,
            purgeable_from,
            entry: Box::new(Entry {
                id: id.clone(),
                record,
            }),
        };
        self.shard.insert_unique(hash, slot, |s| s.hash);
    }

    fn remove(&mut self) {
        let (hash, id) = (self.hash, self.id);
        if let Ok(slot) = self.shard.find_entry(hash, |s| s.is(hash, id)) {
            slot.remove();
        }
    }
}

/// Makes room in a full shard before a record is added: removes what the
/// janitor would (so that a store no janitor runs on still holds no more
/// than a few times its most records within retention), and moves what is
/// left to a table of its own: twice what is left where that is more than
/// half of what it held, else as large as it was. The sweep runs only
/// where the table would have doubled, moving every record, anyway; and
/// the next one comes no sooner than as many additions again as it holds,
/// never on every addition (one record gone per addition would otherwise
/// sweep the whole shard each time). A new table, not the swept one: a
/// table counts the slots a sweep emptied as room only once it is
/// rehashed, so the swept one looked full still and grew, each shard then
/// holding up to seven times its records within retention.
fn make_room(shard: &mut Shard, now: Instant) {
    let held = shard.len();
    shard.retain(|slot| !slot.purgeable(now));
    let left = shard.len();
    let room = if left > held / 2 { 2 * left } else { held };
    let mut moved = Shard::with_capacity(room);
    for slot in shard.drain() {
        moved.insert_unique(slot.hash, slot, |s| s.hash);
    }
    *shard = moved;
}

/// How many locks the records are spread over.
const SHARDS: usize = 256;

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: std::hash::RandomState::new(),
            purge_from: std::sync::atomic::AtomicU64::new(0),
            #[cfg(feature = "pause-points")]
            purge_reads: std::sync::atomic::AtomicU64::new(0),
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

    /// How many buckets of its shards' tables purges have read so far (for
    /// tests, with the `pause-points` feature only).
    #[cfg(feature = "pause-points")]
    #[doc(hidden)]
    pub fn purge_reads(&self) -> u64 {
        self.purge_reads.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Where `id` lies, its shard locked.
    fn place<'a>(&'a self, id: &'a RecordId) -> Place<'a> {
        let hash = self.hasher.hash_one(id);
        // The table places a record by the hash's low bits and tells
        // records apart by its top seven: the shard is chosen by others.
        let shard = (hash >> 32) as usize % SHARDS;
        Place {
            shard: lock(&self.shards[shard]),
            hash,
            id,
        }
    }

    /// Runs `change` on the record `token` holds locked, if it does.
    fn fenced<T>(
        &self,
        id: &RecordId,
        token: &str,
        change: impl FnOnce(&mut Place<'_>, Instant) -> T,
    ) -> Result<T, StoreError> {
        let mut place = self.place(id);
        let now = Instant::now();
        match place.get() {
            Some(r) if r.response.is_none() && r.token.as_deref() == Some(token) => {
                Ok(change(&mut place, now))
            }
            _ => Err(StoreError::LockLost),
        }
    }

    fn reserve_now(&self, req: ReserveRequest<'_>) -> Reservation {
        let mut place = self.place(req.id);
        let now = Instant::now();
        // Judged in place: a replay copies the stored answer and nothing
        // else, a conflict copies nothing.
        let existing = place.get();
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
                    lock_deadline: after(now, req.lock_timeout),
                    expires_at: after(now, req.ttl),
                    ttl: req.ttl,
                    response: None,
                },
                false,
            ),
            (Decision::Continue, Some(r)) => (
                MemoryRecord {
                    token: Some(req.token.to_owned()),
                    attempt: r.attempt + 1,
                    lock_deadline: after(now, req.lock_timeout),
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
        place.put(record);
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
            self.fenced(id, token, |place, now| {
                place.update(|r| {
                    r.response = Some(response.clone());
                    r.token = None;
                    // The answer is kept a whole TTL from its completion.
                    r.expires_at = after(now, r.ttl);
                });
            })?;
            pause_point!(crate::pause::COMPLETE_AFTER, &id.key);
            Ok(())
        })
    }

    fn release<'a>(&'a self, id: &'a RecordId, token: &'a str) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            self.fenced(id, token, |place, now| {
                place.update(|r| {
                    r.token = None;
                    r.lock_deadline = now;
                });
            })?;
            pause_point!(crate::pause::RELEASE_AFTER, &id.key);
            Ok(())
        })
    }

    fn reject<'a>(&'a self, id: &'a RecordId, token: &'a str) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let rejected = self.fenced(id, token, |place, now| {
                if place.get().is_some_and(MemoryRecord::untouched) {
                    place.remove();
                } else {
                    place.update(|r| {
                        r.token = None;
                        r.lock_deadline = now;
                    });
                }
            });
            match rejected {
                // No record left: the key is free, which is what the
                // rejection asks (an earlier try removed it, or the purge).
                Err(StoreError::LockLost) if self.place(id).get().is_none() => {}
                other => other?,
            }
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
            self.fenced(id, token, |place, now| {
                if place.get().is_some_and(MemoryRecord::untouched) {
                    place.remove();
                } else {
                    place.update(|r| {
                        if !taken_over {
                            r.token = None;
                        }
                        r.lock_deadline = now;
                    });
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
            self.fenced(id, token, |place, _| {
                place.update(|r| r.recovery_point = Some(recovery_point.to_owned()));
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
            self.fenced(id, token, |place, now| {
                place.update(|r| r.lock_deadline = after(now, lock_timeout));
            })?;
            pause_point!(crate::pause::EXTEND_AFTER, &id.key);
            Ok(())
        })
    }

    fn purge_expired(&self, batch: u32) -> BoxFuture<'_, Result<u64, StoreError>> {
        Box::pin(async move {
            let removed = self.purge_round(u64::from(batch));
            pause_point!(crate::pause::PURGE_AFTER, "");
            Ok(removed)
        })
    }
}

impl MemoryStore {
    /// Removes up to `batch` purgeable records, reading the tables from
    /// where the last purge that filled its batch stopped, one shard locked
    /// at a time, at most once around: the first shard from that bucket on,
    /// every other shard, then the first shard's beginning. A batch that
    /// fills leaves the next purge its place, so a janitor's round (batch
    /// after batch, until one comes back short) reads each bucket about
    /// twice whatever its batch, where starting from the first shard every
    /// time read the records of every shard already swept again, for each
    /// batch. A table that grew since (rebuilt, its buckets in a new order)
    /// is still read whole by a round that does not fill its batch.
    fn purge_round(&self, batch: u64) -> u64 {
        use std::sync::atomic::Ordering::Relaxed;
        const BUCKET_BITS: u32 = 48;
        if batch == 0 {
            return 0;
        }
        let from = self.purge_from.load(Relaxed);
        let first = (from >> BUCKET_BITS) as usize % SHARDS;
        let first_bucket = (from & ((1 << BUCKET_BITS) - 1)) as usize;
        let mut removed = 0;
        let mut read = 0u64;
        let mut stopped = None;
        for step in 0..=SHARDS {
            let index = (first + step) % SHARDS;
            let (start, end) = match step {
                0 => (first_bucket, usize::MAX),
                SHARDS => (0, first_bucket),
                _ => (0, usize::MAX),
            };
            let now = Instant::now();
            let mut table = lock(&self.shards[index]);
            let end = end.min(table.num_buckets());
            for bucket in start..end {
                read += 1;
                if !table.get_bucket(bucket).is_some_and(|slot| slot.purgeable(now)) {
                    continue;
                }
                if let Ok(entry) = table.get_bucket_entry(bucket) {
                    drop(entry.remove());
                    removed += 1;
                }
                if removed == batch {
                    stopped = Some((index, bucket + 1));
                    break;
                }
            }
            drop(table);
            if stopped.is_some() {
                break;
            }
        }
        if let Some((shard, bucket)) = stopped {
            self.purge_from
                .store(((shard as u64) << BUCKET_BITS) | bucket as u64, Relaxed);
        }
        #[cfg(feature = "pause-points")]
        self.purge_reads.fetch_add(read, Relaxed);
        #[cfg(not(feature = "pause-points"))]
        let _ = read;
        removed
    }
}

/// A record as idem's own interleaving tests set and read it (with the
/// `pause-points` feature only): what the SQL stores' tests read from their
/// tables.
#[cfg(feature = "pause-points")]
#[doc(hidden)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordView {
    pub fingerprint: String,
    pub token: Option<String>,
    pub attempt: u32,
    pub operation_id: String,
    pub recovery_point: Option<String>,
    /// Its lock is live (in progress, before its deadline).
    pub lock_live: bool,
    /// Past its expiry.
    pub expired: bool,
    /// The stored body, once completed.
    pub body: Option<Vec<u8>>,
}

#[cfg(feature = "pause-points")]
impl MemoryStore {
    /// The record of `id`, if any, as [`RecordView`].
    #[doc(hidden)]
    pub fn view(&self, id: &RecordId) -> Option<RecordView> {
        let place = self.place(id);
        let now = Instant::now();
        place.get().map(|r| RecordView {
            fingerprint: r.fingerprint.clone(),
            token: r.token.clone(),
            attempt: r.attempt,
            operation_id: r.operation_id.clone(),
            recovery_point: r.recovery_point.clone(),
            lock_live: r.lock_live(now),
            expired: r.expires_at <= now,
            body: r.response.as_ref().map(|a| a.body.clone().unwrap_or_default()),
        })
    }

    /// Puts `view` as the record of `id` (or removes it, with `None`), with
    /// a retention of an hour: a live lock runs an hour on, another ran out
    /// two seconds ago; an expired record expired a second ago, another
    /// expires in an hour. A completed one answered 201 with no header.
    #[doc(hidden)]
    pub fn set(&self, id: &RecordId, view: Option<RecordView>) {
        let mut place = self.place(id);
        let Some(view) = view else {
            place.remove();
            return;
        };
        let (now, hour) = (Instant::now(), Duration::from_secs(3600));
        let ago = |d: Duration| now.checked_sub(d).unwrap_or(now);
        place.put(MemoryRecord {
            fingerprint: view.fingerprint,
            token: view.token,
            attempt: view.attempt,
            operation_id: view.operation_id,
            recovery_point: view.recovery_point,
            lock_deadline: if view.lock_live {
                now + hour
            } else {
                ago(Duration::from_secs(2))
            },
            expires_at: if view.expired {
                ago(Duration::from_secs(1))
            } else {
                now + hour
            },
            ttl: hour,
            response: view.body.map(|body| StoredResponse {
                status: 201,
                headers: Vec::new(),
                body: Some(body),
            }),
        });
    }
}

/// Locks a shard. A panic while holding the lock cannot leave a record
/// half-written: every change is a single assignment.
fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    shard.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(fingerprint: &str) -> MemoryRecord {
        let now = Instant::now();
        MemoryRecord {
            fingerprint: fingerprint.to_owned(),
            token: Some("token".to_owned()),
            attempt: 1,
            operation_id: "op".to_owned(),
            recovery_point: None,
            lock_deadline: now,
            expires_at: now,
            ttl: Duration::ZERO,
            response: None,
        }
    }

    fn fingerprint_at(shard: &Mutex<Shard>, hash: u64, id: &RecordId) -> Option<String> {
        let place = Place {
            shard: lock(shard),
            hash,
            id,
        };
        place.get().map(|r| r.fingerprint.clone())
    }

    /// A table holds a hash, a time and a pointer per record: growing it
    /// moves 32 bytes per record, never the records themselves.
    #[test]
    fn a_slot_is_a_hash_a_time_and_a_pointer() {
        assert_eq!(std::mem::size_of::<Slot>(), 32);
    }

    /// A slot's `purgeable_from` is exactly when its record becomes
    /// purgeable: on every combination of state and times, before, at and
    /// after each of them.
    #[test]
    fn purgeable_from_is_exactly_when_the_rule_starts_to_hold() {
        let base = Instant::now();
        let at = |ms: u64| base + Duration::from_millis(ms);
        let mut checked = 0;
        for completed in [false, true] {
            for expires in [0, 10, 50, 100] {
                for lock in [0, 10, 50, 100] {
                    for ttl in [0, 10, 60] {
                        let r = MemoryRecord {
                            expires_at: at(expires),
                            lock_deadline: at(lock),
                            ttl: Duration::from_millis(ttl),
                            response: completed.then(|| StoredResponse {
                                status: 201,
                                headers: vec![],
                                body: None,
                            }),
                            ..record("fp")
                        };
                        for now in 0..=200 {
                            assert_eq!(
                                r.purgeable(at(now)),
                                r.purgeable_from() <= at(now),
                                "completed {completed}, expires {expires}, lock {lock}, ttl {ttl}, now {now}"
                            );
                            checked += 1;
                        }
                    }
                }
            }
        }
        assert_eq!(checked, 2 * 4 * 4 * 3 * 201);
    }

    /// A TTL and a lock timeout each within the clock's range, whose sum is
    /// not (no layer accepts them: the store is public), reserve and are
    /// never purged.
    #[tokio::test]
    async fn a_ttl_past_the_clocks_range_reserves_and_is_kept() {
        let store = MemoryStore::new();
        let id = RecordId::new("t", "s", "far");
        let far = (1..=62)
            .rev()
            .map(|bits| Duration::from_secs(1u64 << bits))
            .find(|d| {
                let now = Instant::now();
                now.checked_add(*d).is_some() && now.checked_add(*d + *d).is_none()
            })
            .expect("a duration that fits once and not twice");
        let request = ReserveRequest {
            id: &id,
            fingerprint: "fp",
            token: "token",
            ttl: far,
            lock_timeout: far,
        };
        assert!(matches!(store.reserve_now(request), Reservation::Reserved(_)));
        store.release(&id, "token").await.unwrap();
        assert_eq!(store.purge_expired(100).await.unwrap(), 0);
        assert_eq!(store.len(), 1);
    }

    /// Every change to a record moves its slot's `purgeable_from` with it:
    /// a lock released long before it would have run out is purged once
    /// its TTL has passed from the release, not from the lock's deadline.
    #[tokio::test]
    async fn a_change_to_a_record_moves_when_it_is_purged() {
        let store = MemoryStore::new();
        let id = RecordId::new("t", "s", "released");
        let request = ReserveRequest {
            id: &id,
            fingerprint: "fp",
            token: "token",
            ttl: Duration::from_millis(1),
            lock_timeout: Duration::from_secs(3600),
        };
        assert!(matches!(store.reserve_now(request), Reservation::Reserved(_)));
        assert_eq!(store.purge_expired(100).await.unwrap(), 0, "locked for an hour");
        store.release(&id, "token").await.unwrap();
        // Past its retention from the release (a deadline, not an ordering).
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(store.purge_expired(100).await.unwrap(), 1);
        assert_eq!(store.len(), 0);
    }

    /// Two ids whose hashes are equal are two records: a slot is found by
    /// its hash, then told apart by its whole id.
    #[test]
    fn ids_whose_hashes_collide_stay_apart() {
        let shard = Mutex::new(Shard::default());
        let (a, b) = (RecordId::new("t", "s", "a"), RecordId::new("t", "s", "b"));
        let place = |id| Place {
            shard: lock(&shard),
            hash: 7,
            id,
        };
        place(&a).put(record("fp-a"));
        assert_eq!(fingerprint_at(&shard, 7, &b), None);
        place(&b).put(record("fp-b"));
        assert_eq!(fingerprint_at(&shard, 7, &a).as_deref(), Some("fp-a"));
        assert_eq!(fingerprint_at(&shard, 7, &b).as_deref(), Some("fp-b"));
        place(&a).put(record("fp-a2"));
        assert_eq!(lock(&shard).len(), 2, "a record put again replaces itself");
        place(&a).remove();
        assert_eq!(fingerprint_at(&shard, 7, &a), None);
        assert_eq!(fingerprint_at(&shard, 7, &b).as_deref(), Some("fp-b"));
        assert_eq!(lock(&shard).len(), 1);
    }

    /// A full shard with one record gone sweeps it, and then grows: the
    /// next sweep is as many additions away as it holds, not one.
    #[test]
    fn a_full_shard_sweeps_then_grows_to_twice_what_it_holds() {
        let shard = Mutex::new(Shard::default());
        let live = |fp: &str| MemoryRecord {
            lock_deadline: Instant::now() + Duration::from_secs(60),
            expires_at: Instant::now() + Duration::from_secs(60),
            ttl: Duration::from_secs(60),
            ..record(fp)
        };
        let ids: Vec<RecordId> = (0..1000)
            .map(|i| RecordId::new("t", "s", format!("k{i}")))
            .collect();
        let place = |i: usize| Place {
            shard: lock(&shard),
            hash: i as u64,
            id: &ids[i],
        };
        // Filled: the first record gone (a completed one past its TTL),
        // the rest live.
        let full = || {
            let shard = lock(&shard);
            shard.len() == shard.capacity()
        };
        let mut n = 0;
        while n < 2 || !full() {
            let r = if n == 0 {
                MemoryRecord {
                    response: Some(StoredResponse {
                        status: 200,
                        headers: vec![],
                        body: None,
                    }),
                    ..record("gone")
                }
            } else {
                live("live")
            };
            place(n).put(r);
            n += 1;
        }
        let filled = lock(&shard).capacity();
        place(n).put(live("new"));
        let (len, capacity) = {
            let shard = lock(&shard);
            (shard.len(), shard.capacity())
        };
        assert_eq!(len, filled, "the gone record made room for the new one");
        assert_eq!(fingerprint_at(&shard, 0, &ids[0]), None);
        assert!(capacity >= 2 * len, "grown to {capacity} for {len}");
        for (i, id) in ids.iter().enumerate().take(n + 1).skip(1) {
            assert!(fingerprint_at(&shard, i as u64, id).is_some(), "{i} kept");
        }
    }

    /// A store on which no janitor runs drops the records that are gone as
    /// its shards fill, and keeps every record within its retention.
    #[test]
    fn a_store_without_a_janitor_drops_what_is_gone_as_it_grows() {
        let store = MemoryStore::new();
        let reserve_complete = |key: String, ttl: Duration| {
            let id = RecordId::new("t", "s", key);
            let request = ReserveRequest {
                id: &id,
                fingerprint: "fp",
                token: "token",
                ttl,
                lock_timeout: Duration::from_secs(60),
            };
            assert!(matches!(store.reserve_now(request), Reservation::Reserved(_)));
            let mut place = store.place(&id);
            place.update(|r| {
                r.response = Some(StoredResponse {
                    status: 201,
                    headers: vec![],
                    body: None,
                });
                r.token = None;
                r.expires_at = Instant::now() + ttl;
            });
        };
        for i in 0..20_000 {
            reserve_complete(format!("old{i}"), Duration::from_millis(1));
        }
        // Past their retention (a deadline, not an ordering).
        std::thread::sleep(Duration::from_millis(20));
        for i in 0..20_000 {
            reserve_complete(format!("new{i}"), Duration::from_secs(60));
        }
        let held = store.len();
        assert!(
            (20_000..30_000).contains(&held),
            "{held} records held for 20,000 within retention"
        );
        for i in 0..20_000 {
            let id = RecordId::new("t", "s", format!("new{i}"));
            let request = ReserveRequest {
                id: &id,
                fingerprint: "fp",
                token: "other",
                ttl: Duration::from_secs(60),
                lock_timeout: Duration::from_secs(60),
            };
            assert!(
                matches!(store.reserve_now(request), Reservation::Completed(_)),
                "new{i}"
            );
        }
    }

    /// Tables that grow many times over keep every record where a lookup
    /// finds it.
    #[test]
    fn every_record_is_found_after_the_tables_grow() {
        let store = MemoryStore::new();
        let ids: Vec<RecordId> = (0..20_000)
            .map(|i| RecordId::new("t", "grow", format!("k{i}")))
            .collect();
        let request = |id| ReserveRequest {
            id,
            fingerprint: "fp",
            token: "token",
            ttl: Duration::from_secs(60),
            lock_timeout: Duration::from_secs(60),
        };
        for id in &ids {
            assert!(matches!(store.reserve_now(request(id)), Reservation::Reserved(_)));
        }
        assert_eq!(store.len(), ids.len());
        for id in &ids {
            assert!(matches!(
                store.reserve_now(request(id)),
                Reservation::InProgress { .. }
            ));
        }
    }

    /// Without a janitor, a store whose records come and go evenly over its
    /// shards (ids hashed at random) holds about four times the most
    /// records it has held within their retention, plus up to 768 expired
    /// ones: phases of `m` records, each phase's ending (purgeable) before
    /// the next begins. (Where each shard's busiest time is another's quiet
    /// one, the bound is four times the sum of each shard's own most: the
    /// docs say so.)
    #[test]
    fn a_store_whose_records_spread_over_its_shards_holds_about_four_times_its_most() {
        for m in [256usize, 1024] {
            let store = MemoryStore::new();
            let mut most = 0;
            for phase in 0..16 {
                let ids: Vec<RecordId> = (0..m)
                    .map(|i| RecordId::new("t", "s", format!("p{phase}-{i}")))
                    .collect();
                for id in &ids {
                    let mut r = record("fp");
                    r.lock_deadline = Instant::now() + Duration::from_secs(3600);
                    store.place(id).put(r);
                    most = most.max(store.len());
                }
                // The phase's records end: purgeable from now on.
                for id in &ids {
                    store.place(id).update(|r| r.lock_deadline = Instant::now());
                }
            }
            assert!(
                most <= 4 * m + 768,
                "{most} records held, at most {m} within their retention at once"
            );
        }
    }

    /// Without a janitor, a shard holds about four times the most records
    /// it has held within their retention (and at least the 3 its smallest
    /// table holds): records kept an hour, then a stream of records purgeable
    /// as soon as they are put, each sweep leaving about as many as are kept.
    #[test]
    fn a_shard_holds_about_four_times_its_records_within_retention() {
        use std::hash::BuildHasher as _;
        let hasher = std::hash::RandomState::new();
        for kept in [20usize, 100, 120, 250, 500, 1000] {
            let shard = Mutex::new(Shard::default());
            let mut most = 0;
            for i in 0..kept * 25 {
                let id = RecordId::new("t", "s", format!("k{i}"));
                let mut r = record("fp");
                if i < kept {
                    r.lock_deadline = Instant::now() + Duration::from_secs(3600);
                }
                let mut place = Place {
                    shard: lock(&shard),
                    hash: hasher.hash_one(i),
                    id: &id,
                };
                place.put(r);
                most = most.max(place.shard.len());
            }
            assert!(
                most <= 4 * (kept + 1) + 3,
                "{most} records in a shard that keeps {kept} within their retention"
            );
        }
    }
}
