//! What a PostgreSQL store knows of its records without asking the
//! database, for a moment (see [`crate::PgStore::with_replay_cache`]):
//!
//! - **Answers.** A completed record does not change until it expires or is
//!   deleted: its answer, fingerprint and expiry are fixed by its
//!   completion. Its answer, once a lookup read it, is kept for the shorter
//!   of the store's bound (one second by default) and the record's
//!   retention left, as the database's clock measured it when the lookup
//!   ran, counted from before the lookup was sent: it is never answered
//!   from past the record's expiry.
//! - **Running executions.** A record this process's execution reserved
//!   stays in progress, under its token, until that execution writes to it
//!   (completes, releases, hands it back), and nobody may take it over
//!   before its lock deadline. So, from its reservation until the first of
//!   those writes is sent, a conflicting request is answered here: a 409
//!   for the same fingerprint, a mismatch for another. The entry is dropped
//!   *before* the write is sent (a request that finds none reads the
//!   database), and its lock deadline is the one the database set, counted
//!   from before the statement that set it was sent (so never later than
//!   the database's, in the database's whole milliseconds). A heartbeat
//!   that fails drops it, and so does one asking for another lock timeout
//!   than the reservation's; one written moves its deadline on; a lookup
//!   that finds the record still in progress under its token confirms it
//!   again (within the deadline known); a lookup that finds another token
//!   drops it. The map is shared by a store's clones, whatever their
//!   bound (an execution may be ended through any of them); each answers
//!   for its own bound from an entry's last confirmation.
//!
//! What neither can see is a record deleted or edited by hand (an operator
//! freeing a key): each process answers what it knows for at most the
//! bound.

use crate::store::{RecordId, Reservation, StoredResponse};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The most entries kept at once (answers and running executions).
pub(crate) const MAX_ENTRIES: usize = 8192;
/// The most bytes kept at once (by [`size`]).
pub(crate) const MAX_BYTES: usize = 16 << 20;
/// The largest answer kept (by [`size`]: its body, its headers and its
/// texts): larger ones are always read from the store.
pub(crate) const MAX_ANSWER_BYTES: usize = 16 << 10;
/// How often a full map is swept of its expired entries, at most.
const SWEEP_EVERY: Duration = Duration::from_millis(100);

/// What the store knows: its bound, and the map it shares with its
/// clones, those with another bound included (an execution may be ended
/// through any of them). Each answers from an entry for its own bound at
/// most, counted from the entry's last confirmation.
#[derive(Clone, Debug)]
pub(crate) struct Replays {
    keep: Duration,
    kept: Arc<Mutex<Kept>>,
    /// The map of each table that the stores derived from one another (by
    /// [`of_table`](Self::of_table)) use, by the table's name as written in
    /// SQL: a store that comes back to a table shares its map again.
    tables: Arc<Mutex<HashMap<String, Arc<Mutex<Kept>>>>>,
}

#[derive(Debug, Default)]
struct Kept {
    entries: HashMap<RecordId, Entry>,
    bytes: usize,
    next_sweep: Option<Instant>,
    /// The longest bound of the stores sharing the map: an entry past it
    /// since its last confirmation is of no use to any of them.
    keep_max: Duration,
}

#[derive(Debug)]
struct Entry {
    fingerprint: Box<str>,
    known: Known,
    /// When the database last said so: from before the statement that
    /// said it was sent. Answered from for a store's bound after that.
    confirmed: Instant,
    bytes: usize,
}

#[derive(Debug)]
enum Known {
    /// A completed record's answer, until the record's retention `ends`.
    /// Copied out of the map after the lock is let go: a hit holds it
    /// only for the lookup.
    Answer {
        answer: Arc<StoredResponse>,
        ends: Instant,
    },
    /// A record this process's execution holds under `token`, its lock
    /// valid until `lock_until` at least, extended by heartbeats of
    /// `lock_timeout` (that of the reservation, as the database adds it).
    Running {
        token: Box<str>,
        lock_until: Instant,
        lock_timeout: Duration,
    },
}

impl Entry {
    /// When what is known ends whatever the bound: the record's retention,
    /// or the lock's deadline.
    fn ends(&self) -> Instant {
        match &self.known {
            Known::Answer { ends, .. } => *ends,
            Known::Running { lock_until, .. } => *lock_until,
        }
    }

    /// Past any use: past its end, or (an answer) past every bound. A
    /// running execution past the bounds stays, to be confirmed again.
    fn gone(&self, now: Instant, keep_max: Duration) -> bool {
        now >= self.ends()
            || matches!(self.known, Known::Answer { .. }) && now >= later(self.confirmed, keep_max)
    }

    /// Whether a store whose bound is `keep` answers from it at `now`.
    fn answers(&self, now: Instant, keep: Duration) -> bool {
        now < self.ends() && now < later(self.confirmed, keep)
    }
}

/// What an entry counts against [`MAX_BYTES`]: its texts and a share for
/// the map.
fn size(id: &RecordId, fingerprint: &str, answer: Option<&StoredResponse>) -> usize {
    let answer = answer.map_or(0, |answer| {
        let headers: usize = answer.headers.iter().map(|(n, v)| n.len() + v.len() + 48).sum();
        headers + answer.body.as_ref().map_or(0, Vec::len)
    });
    id.tenant.len() + id.scope.len() + id.key.len() + fingerprint.len() + answer + 160
}

/// `at + by`, or, past what an `Instant` can tell, a hundred years on
/// (a lock that never expires); `at` itself where even that cannot be told.
fn later(at: Instant, by: Duration) -> Instant {
    at.checked_add(by)
        .or_else(|| at.checked_add(Duration::from_secs(100 * 365 * 24 * 3600)))
        .unwrap_or(at)
}

/// A lock timeout as the database adds it to its clock: in whole
/// milliseconds, rounded down, at most 10,000 years (as `millis` binds it).
fn as_stored(lock_timeout: Duration) -> Duration {
    Duration::from_millis(u64::try_from(super::millis(lock_timeout)).unwrap_or(0))
}

impl Replays {
    /// Kept for `keep` at most, in a map of its own; `Duration::ZERO`
    /// keeps nothing.
    pub(crate) fn new(keep: Duration) -> Self {
        let kept = Kept {
            keep_max: keep,
            ..Kept::default()
        };
        Replays {
            keep,
            kept: Arc::new(Mutex::new(kept)),
            tables: Arc::default(),
        }
    }

    /// The map of `table`, for a store derived from this one's, of
    /// `own`: this one's when it is the same, the one a store derived from
    /// the same one used if any, or a new one; answered from for this
    /// one's bound.
    pub(crate) fn of_table(&self, own: &str, table: &str) -> Self {
        let kept = {
            let mut tables = self.tables.lock().unwrap_or_else(|e| e.into_inner());
            tables
                .entry(own.to_owned())
                .or_insert_with(|| Arc::clone(&self.kept));
            Arc::clone(tables.entry(table.to_owned()).or_insert_with(|| {
                Arc::new(Mutex::new(Kept {
                    keep_max: self.keep,
                    ..Kept::default()
                }))
            }))
        };
        Replays {
            keep: self.keep,
            kept,
            tables: Arc::clone(&self.tables),
        }
        .with_keep(self.keep)
    }

    /// The same map, answered from for `keep` at most by this one.
    pub(crate) fn with_keep(&self, keep: Duration) -> Self {
        let shared = Replays {
            keep,
            kept: Arc::clone(&self.kept),
            tables: Arc::clone(&self.tables),
        };
        let mut kept = shared.lock();
        kept.keep_max = kept.keep_max.max(keep);
        drop(kept);
        shared
    }

    /// A panic under this lock cannot leave the map half-changed beyond
    /// its byte count, which only bounds it.
    fn lock(&self) -> std::sync::MutexGuard<'_, Kept> {
        self.kept.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The answer to a reservation of `id` with `fingerprint`, when it is
    /// known here: a kept answer's replay, a 409 for a record this
    /// process's execution holds, or a mismatch with either.
    pub(crate) fn find(&self, id: &RecordId, fingerprint: &str) -> Option<Reservation> {
        if self.keep.is_zero() {
            return None;
        }
        self.find_at(id, fingerprint, Instant::now())
    }

    fn find_at(&self, id: &RecordId, fingerprint: &str, now: Instant) -> Option<Reservation> {
        let answer = {
            let mut kept = self.lock();
            let keep_max = kept.keep_max;
            let entry = kept.entries.get(id)?;
            if entry.gone(now, keep_max) {
                Self::remove(&mut kept, id);
                return None;
            }
            // Not confirmed within this store's bound: the database is
            // asked (and its lookup may confirm it again).
            if !entry.answers(now, self.keep) {
                return None;
            }
            if *entry.fingerprint != *fingerprint {
                return Some(Reservation::Mismatch);
            }
            match &entry.known {
                Known::Answer { answer, .. } => Arc::clone(answer),
                Known::Running { lock_until, .. } => {
                    // The lock left in whole milliseconds, rounded up, as
                    // the database's answer gives it.
                    let left = lock_until.saturating_duration_since(now);
                    let ms = left.as_nanos().div_ceil(1_000_000);
                    return Some(Reservation::InProgress {
                        retry_after: Duration::from_millis(u64::try_from(ms).unwrap_or(u64::MAX)),
                    });
                }
            }
        };
        Some(Reservation::Completed(StoredResponse::clone(&answer)))
    }

    /// Whether `bytes` more fit, sweeping a full map (at most every
    /// [`SWEEP_EVERY`]) to make room.
    fn room(kept: &mut Kept, bytes: usize, now: Instant) -> bool {
        let full = |kept: &Kept| kept.entries.len() >= MAX_ENTRIES || kept.bytes + bytes > MAX_BYTES;
        if !full(kept) {
            return true;
        }
        if kept.next_sweep.is_some_and(|at| now < at) {
            return false;
        }
        kept.next_sweep = Some(now + SWEEP_EVERY);
        let keep_max = kept.keep_max;
        kept.entries.retain(|_, e| !e.gone(now, keep_max));
        kept.bytes = kept.entries.values().map(|e| e.bytes).sum();
        !full(kept)
    }

    fn insert(kept: &mut Kept, id: &RecordId, entry: Entry) {
        let bytes = entry.bytes;
        if let Some(old) = kept.entries.insert(id.clone(), entry) {
            kept.bytes = kept.bytes.saturating_sub(old.bytes);
        }
        kept.bytes += bytes;
    }

    fn remove(kept: &mut Kept, id: &RecordId) {
        if let Some(old) = kept.entries.remove(id) {
            kept.bytes = kept.bytes.saturating_sub(old.bytes);
        }
    }

    /// Keeps the answer of a completed record that a lookup sent at `sent`
    /// read, with `left` of its retention by the database's clock. It
    /// replaces what was known of a running execution: the record
    /// completed since.
    pub(crate) fn keep_answer(
        &self,
        id: &RecordId,
        fingerprint: &str,
        answer: &StoredResponse,
        sent: Instant,
        left: Duration,
    ) {
        if self.keep.is_zero() {
            return;
        }
        let bytes = size(id, fingerprint, Some(answer));
        if bytes > MAX_ANSWER_BYTES {
            return;
        }
        let Some(ends) = sent.checked_add(left) else {
            return;
        };
        let now = Instant::now();
        if ends.min(later(sent, self.keep)) <= now {
            return;
        }
        let mut kept = self.lock();
        let known = kept
            .entries
            .get(id)
            .map(|old| matches!(old.known, Known::Answer { .. }) && old.confirmed >= sent);
        match known {
            // Another reservation kept it first, as lately: the same answer.
            Some(true) => return,
            Some(false) => {}
            None if !Self::room(&mut kept, bytes, now) => return,
            None => {}
        }
        let entry = Entry {
            fingerprint: fingerprint.into(),
            known: Known::Answer {
                answer: Arc::new(answer.clone()),
                ends,
            },
            confirmed: sent,
            bytes,
        };
        Self::insert(&mut kept, id, entry);
    }

    /// Knows that this process's execution reserved `id` under `token`
    /// with `fingerprint`, by a reservation sent at `sent` whose lock
    /// holds `lock_timeout` from the database's clock then. It replaces
    /// whatever was known of `id`: the reservation is newer.
    pub(crate) fn run(
        &self,
        id: &RecordId,
        fingerprint: &str,
        token: &str,
        sent: Instant,
        lock_timeout: Duration,
    ) {
        let now = Instant::now();
        let lock_timeout = as_stored(lock_timeout);
        let lock_until = later(sent, lock_timeout);
        let mut kept = self.lock();
        if self.keep.is_zero() || lock_until.min(later(sent, self.keep)) <= now {
            // Nothing to answer from: what was known of `id` is older.
            Self::remove(&mut kept, id);
            return;
        }
        let bytes = size(id, fingerprint, None) + token.len();
        if !kept.entries.contains_key(id) && !Self::room(&mut kept, bytes, now) {
            return;
        }
        let entry = Entry {
            fingerprint: fingerprint.into(),
            known: Known::Running {
                token: token.into(),
                lock_until,
                lock_timeout,
            },
            confirmed: sent,
            bytes,
        };
        Self::insert(&mut kept, id, entry);
    }

    /// Runs `f` on the entry of the running execution of `id` under
    /// `token` (when the database last said so, its lock deadline, its
    /// lock timeout), when one is known; `f` says whether to keep it.
    fn running_with(
        &self,
        id: &RecordId,
        token: &str,
        f: impl FnOnce(&mut Instant, &mut Instant, Duration) -> bool,
    ) {
        let mut kept = self.lock();
        let keep = match kept.entries.get_mut(id) {
            Some(Entry {
                known:
                    Known::Running {
                        token: held,
                        lock_until,
                        lock_timeout,
                    },
                confirmed,
                ..
            }) if **held == *token => f(confirmed, lock_until, *lock_timeout),
            _ => true,
        };
        if !keep {
            Self::remove(&mut kept, id);
        }
    }

    /// A heartbeat of the record `token` holds, asking for `lock_timeout`,
    /// is about to be sent. Each heartbeat sets the deadline to its own
    /// time of writing plus its lock timeout (PostgreSQL's
    /// `clock_timestamp()`: of two writes of one row the later one's is
    /// later), so the deadline only moves on while every one asks for the
    /// reservation's lock timeout; one asking for another drops what is
    /// known, and the database answers until the execution ends.
    pub(crate) fn extending(&self, id: &RecordId, token: &str, lock_timeout: Duration) {
        let asked = as_stored(lock_timeout);
        self.running_with(id, token, |_, _, reserved| asked == reserved);
    }

    /// The heartbeat sent at `sent` (after [`Replays::extending`]) moved
    /// the lock of the record `token` holds on: its deadline is that
    /// heartbeat's lock timeout from then at least (any later write of it
    /// is later), and the database said so then.
    pub(crate) fn extended(&self, id: &RecordId, token: &str, sent: Instant, lock_timeout: Duration) {
        let asked = as_stored(lock_timeout);
        self.running_with(id, token, |confirmed, lock_until, reserved| {
            if asked != reserved {
                return false;
            }
            *lock_until = (*lock_until).max(later(sent, asked));
            *confirmed = (*confirmed).max(sent);
            true
        });
    }

    /// A lookup sent at `sent` found `id` in progress under `token` (if
    /// it could read it): the running execution under that token is still
    /// the record's, as of then, within the deadline already known (the
    /// lookup may have read the record before a heartbeat moved its
    /// deadline). One under another token lost its lock, and is dropped.
    pub(crate) fn found_running(&self, id: &RecordId, token: Option<&str>, sent: Instant) {
        let mut kept = self.lock();
        let ours = match kept.entries.get_mut(id) {
            Some(Entry {
                known: Known::Running { token: held, .. },
                confirmed,
                ..
            }) => {
                let ours = Some(&**held) == token;
                if ours {
                    *confirmed = (*confirmed).max(sent);
                }
                ours
            }
            _ => true,
        };
        if !ours {
            Self::remove(&mut kept, id);
        }
    }

    /// The execution holding `id` under `token` is about to write to it
    /// (complete, release, hand back), or lost it: nothing is answered
    /// from what was known of it any more.
    pub(crate) fn finish(&self, id: &RecordId, token: &str) {
        // Whatever this one's bound: a clone with another may know it.
        let mut kept = self.lock();
        if let Some(Entry {
            known: Known::Running { token: held, .. },
            ..
        }) = kept.entries.get(id)
        {
            if **held == *token {
                Self::remove(&mut kept, id);
            }
        }
    }

    /// How many entries are kept now (expired ones not yet swept included).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(body: usize) -> StoredResponse {
        StoredResponse {
            status: 201,
            headers: vec![("content-type".into(), b"application/json".to_vec())],
            body: Some(vec![b'x'; body]),
        }
    }

    fn id(key: &str) -> RecordId {
        RecordId::new("t", "s", key)
    }

    #[test]
    fn an_answer_is_kept_no_longer_than_the_record_lives() {
        let replays = Replays::new(Duration::from_secs(60));
        let sent = Instant::now();
        replays.keep_answer(&id("a"), "fp", &answer(3), sent, Duration::from_secs(1));
        let just_before = sent + Duration::from_millis(999);
        assert!(matches!(
            replays.find_at(&id("a"), "fp", just_before),
            Some(Reservation::Completed(_))
        ));
        assert!(matches!(
            replays.find_at(&id("a"), "other", just_before),
            Some(Reservation::Mismatch)
        ));
        assert!(replays.find(&id("b"), "fp").is_none());
        // Past the record's retention (measured from before the lookup),
        // it is the store's to answer, however long the bound.
        let later = sent + Duration::from_secs(1);
        assert!(replays.find_at(&id("a"), "fp", later).is_none());
        assert_eq!(replays.len(), 0);
        // A lookup whose record expired before its answer came is not kept.
        let long_ago = Instant::now() - Duration::from_millis(50);
        replays.keep_answer(&id("c"), "fp", &answer(3), long_ago, Duration::from_millis(20));
        assert!(replays.find(&id("c"), "fp").is_none());
        // And the store's own bound holds for a record that lives long.
        let short = Replays::new(Duration::from_secs(1));
        let sent = Instant::now();
        short.keep_answer(&id("d"), "fp", &answer(3), sent, Duration::from_secs(3600));
        assert!(short
            .find_at(&id("d"), "fp", sent + Duration::from_millis(999))
            .is_some());
        assert!(short
            .find_at(&id("d"), "fp", sent + Duration::from_secs(1))
            .is_none());
    }

    #[test]
    fn nothing_is_kept_with_a_zero_bound_or_past_its_bounds() {
        let off = Replays::new(Duration::ZERO);
        off.keep_answer(
            &id("a"),
            "fp",
            &answer(3),
            Instant::now(),
            Duration::from_secs(60),
        );
        assert!(off.find(&id("a"), "fp").is_none());

        let on = Replays::new(Duration::from_secs(60));
        on.keep_answer(
            &id("big"),
            "fp",
            &answer(MAX_ANSWER_BYTES + 1),
            Instant::now(),
            Duration::from_secs(60),
        );
        assert!(on.find(&id("big"), "fp").is_none());
        // Its headers count as much as its body.
        let mut headers = answer(3);
        headers
            .headers
            .push(("location".into(), vec![b'/'; MAX_ANSWER_BYTES]));
        on.keep_answer(
            &id("long"),
            "fp",
            &headers,
            Instant::now(),
            Duration::from_secs(60),
        );
        assert!(on.find(&id("long"), "fp").is_none());
        let many = StoredResponse {
            headers: (0..MAX_ANSWER_BYTES / 64)
                .map(|i| (format!("x-{i}"), vec![b'v'; 32]))
                .collect(),
            ..answer(3)
        };
        on.keep_answer(&id("many"), "fp", &many, Instant::now(), Duration::from_secs(60));
        assert!(on.find(&id("many"), "fp").is_none());
        for i in 0..MAX_ENTRIES + 10 {
            on.keep_answer(
                &id(&i.to_string()),
                "fp",
                &answer(3),
                Instant::now(),
                Duration::from_secs(60),
            );
        }
        assert_eq!(on.len(), MAX_ENTRIES);
        let kept = on.lock().bytes;
        assert!(kept <= MAX_BYTES);
        assert_eq!(kept, on.lock().entries.values().map(|e| e.bytes).sum::<usize>());
    }

    fn in_progress(found: Option<Reservation>) -> Option<Duration> {
        match found {
            Some(Reservation::InProgress { retry_after }) => Some(retry_after),
            _ => None,
        }
    }

    #[test]
    fn a_running_execution_answers_its_conflicts_until_it_writes() {
        let known = Replays::new(Duration::from_secs(1));
        let sent = Instant::now();
        known.run(&id("a"), "fp", "t1", sent, Duration::from_secs(30));
        // Its lock left, as the database counts it from the reservation.
        let at = sent + Duration::from_millis(500);
        assert_eq!(
            in_progress(known.find_at(&id("a"), "fp", at)),
            Some(Duration::from_millis(29_500))
        );
        assert!(matches!(
            known.find_at(&id("a"), "other", at),
            Some(Reservation::Mismatch)
        ));
        assert!(known.find_at(&id("b"), "fp", at).is_none());
        // Another token's write is not this execution's.
        known.finish(&id("a"), "t2");
        assert!(in_progress(known.find_at(&id("a"), "fp", at)).is_some());
        known.finish(&id("a"), "t1");
        assert!(known.find_at(&id("a"), "fp", at).is_none());
        assert_eq!(known.len(), 0);
    }

    #[test]
    fn a_running_execution_is_answered_for_the_bound_and_within_its_lock_only() {
        let known = Replays::new(Duration::from_secs(1));
        let sent = Instant::now();
        known.run(&id("a"), "fp", "t1", sent, Duration::from_secs(30));
        assert!(in_progress(known.find_at(&id("a"), "fp", sent + Duration::from_millis(999))).is_some());
        // Past the bound, the database is asked; what is known stays, to be
        // confirmed by its answer, within the deadline already known.
        let past = sent + Duration::from_secs(1);
        assert!(known.find_at(&id("a"), "fp", past).is_none());
        assert_eq!(known.len(), 1);
        known.found_running(&id("a"), Some("t1"), past);
        assert_eq!(
            in_progress(known.find_at(&id("a"), "fp", past + Duration::from_millis(900))),
            Some(Duration::from_millis(28_100))
        );
        assert!(known
            .find_at(&id("a"), "fp", past + Duration::from_secs(1))
            .is_none());
        // A heartbeat written moves the deadline on, from before it was sent.
        let beat = sent + Duration::from_secs(10);
        known.extending(&id("a"), "t1", Duration::from_secs(30));
        known.extended(&id("a"), "t1", beat, Duration::from_secs(30));
        assert_eq!(
            in_progress(known.find_at(&id("a"), "fp", beat + Duration::from_millis(500))),
            Some(Duration::from_millis(29_500))
        );
        // A lock that holds less than the bound is answered from for as
        // long, in the database's whole milliseconds.
        let short = Instant::now();
        known.run(&id("s"), "fp", "t1", short, Duration::from_micros(200_990));
        assert!(in_progress(known.find_at(&id("s"), "fp", short + Duration::from_millis(199))).is_some());
        assert!(known
            .find_at(&id("s"), "fp", short + Duration::from_millis(200))
            .is_none());
    }

    #[test]
    fn a_heartbeat_that_may_move_the_deadline_earlier_drops_the_running_execution() {
        let known = Replays::new(Duration::from_secs(1));
        let sent = Instant::now();
        for key in ["zero", "shorter", "raced"] {
            known.run(&id(key), "fp", "t1", sent, Duration::from_secs(30));
        }
        // A hand-back to a stale lock, or any shorter lock timeout.
        known.extending(&id("zero"), "t1", Duration::ZERO);
        known.extending(&id("shorter"), "t1", Duration::from_millis(29_999));
        // Two heartbeats at once, the longer asked for first: which ran
        // last is not known once the shorter one is written.
        known.extending(&id("raced"), "t1", Duration::from_secs(60));
        known.extending(&id("raced"), "t1", Duration::from_secs(40));
        for key in ["zero", "shorter", "raced"] {
            assert!(known.find_at(&id(key), "fp", sent).is_none(), "{key}");
        }
        assert_eq!(known.len(), 0);
        // Another token's heartbeat is not this execution's.
        known.run(&id("a"), "fp", "t1", sent, Duration::from_secs(30));
        known.extending(&id("a"), "t2", Duration::ZERO);
        known.extended(&id("a"), "t2", sent, Duration::from_secs(3600));
        assert_eq!(
            in_progress(known.find_at(&id("a"), "fp", sent)),
            Some(Duration::from_secs(30))
        );
    }

    #[test]
    fn a_lookup_read_before_a_heartbeat_never_moves_the_deadline() {
        let known = Replays::new(Duration::from_secs(60));
        let sent = Instant::now();
        known.run(&id("a"), "fp", "t1", sent, Duration::from_secs(30));
        // A lookup that read a deadline an hour away (a row edited, or a
        // heartbeat since undone): the known deadline stays.
        known.found_running(&id("a"), Some("t1"), sent);
        assert!(known
            .find_at(&id("a"), "fp", sent + Duration::from_secs(30))
            .is_none());
    }

    #[test]
    fn clones_with_another_bound_share_what_is_known() {
        let known = Replays::new(Duration::from_secs(1));
        let off = known.with_keep(Duration::ZERO);
        let sent = Instant::now();
        known.run(&id("a"), "fp", "t1", sent, Duration::from_secs(30));
        // Answered only by the one with a bound, ended through either.
        assert!(off.find(&id("a"), "fp").is_none());
        assert!(known.find(&id("a"), "fp").is_some());
        off.finish(&id("a"), "t1");
        assert!(known.find(&id("a"), "fp").is_none());
        // Reserved through the one without: nothing older is answered.
        known.run(&id("b"), "fp", "t1", sent, Duration::from_secs(30));
        off.run(&id("b"), "fp", "t2", sent, Duration::from_secs(30));
        assert!(known.find(&id("b"), "fp").is_none());
        // A new map for another table.
        let other = Replays::new(Duration::from_secs(1));
        known.run(&id("c"), "fp", "t1", sent, Duration::from_secs(30));
        assert!(other.find(&id("c"), "fp").is_none());
    }

    #[test]
    fn a_lookup_that_finds_another_token_drops_the_running_execution() {
        let known = Replays::new(Duration::from_secs(1));
        let sent = Instant::now();
        known.run(&id("a"), "fp", "t1", sent, Duration::from_secs(30));
        known.run(&id("b"), "fp", "t1", sent, Duration::from_secs(30));
        known.found_running(&id("a"), Some("t2"), sent);
        known.found_running(&id("b"), None, sent);
        assert!(known.find_at(&id("a"), "fp", sent).is_none());
        assert!(known.find_at(&id("b"), "fp", sent).is_none());
        assert_eq!(known.len(), 0);
        // Its own token confirms it.
        known.run(&id("c"), "fp", "t1", sent, Duration::from_secs(30));
        let later = sent + Duration::from_millis(1500);
        known.found_running(&id("c"), Some("t1"), sent + Duration::from_secs(1));
        assert!(in_progress(known.find_at(&id("c"), "fp", later)).is_some());
    }

    #[test]
    fn the_newer_of_an_answer_and_a_reservation_is_what_is_known() {
        let known = Replays::new(Duration::from_secs(1));
        let sent = Instant::now();
        known.run(&id("a"), "fp", "t1", sent, Duration::from_secs(30));
        // Completed since (by a takeover elsewhere): the answer replaces it.
        known.keep_answer(&id("a"), "fp", &answer(3), sent, Duration::from_secs(60));
        assert!(matches!(
            known.find_at(&id("a"), "fp", sent),
            Some(Reservation::Completed(_))
        ));
        // Expired and taken again here: the reservation replaces the answer.
        known.run(&id("a"), "fp2", "t2", sent, Duration::from_secs(30));
        assert!(in_progress(known.find_at(&id("a"), "fp2", sent)).is_some());
        let kept = known.lock().bytes;
        assert_eq!(
            kept,
            known.lock().entries.values().map(|e| e.bytes).sum::<usize>()
        );
        // With a zero bound nothing is known.
        let off = Replays::new(Duration::ZERO);
        off.run(&id("a"), "fp", "t1", Instant::now(), Duration::from_secs(30));
        assert!(off.find(&id("a"), "fp").is_none());
        assert_eq!(off.len(), 0);
    }

    #[test]
    fn each_store_answers_for_its_own_bound() {
        let slow = Replays::new(Duration::from_secs(60));
        let fast = slow.with_keep(Duration::from_millis(50));
        let sent = Instant::now();
        slow.keep_answer(&id("a"), "fp", &answer(3), sent, Duration::from_secs(3600));
        slow.run(&id("b"), "fp", "t1", sent, Duration::from_secs(300));
        let at = sent + Duration::from_millis(100);
        assert!(fast.find_at(&id("a"), "fp", at).is_none());
        assert!(fast.find_at(&id("b"), "fp", at).is_none());
        assert!(matches!(
            slow.find_at(&id("a"), "fp", at),
            Some(Reservation::Completed(_))
        ));
        assert!(in_progress(slow.find_at(&id("b"), "fp", at)).is_some());
        // Confirmed again (a lookup, a heartbeat): the short bound counts
        // from then.
        fast.found_running(&id("b"), Some("t1"), at);
        assert!(in_progress(fast.find_at(&id("b"), "fp", at + Duration::from_millis(49))).is_some());
        assert!(fast
            .find_at(&id("b"), "fp", at + Duration::from_millis(50))
            .is_none());
        // An answer past every bound is of no use to any: it goes.
        let late = sent + Duration::from_secs(61);
        assert!(slow.find_at(&id("a"), "fp", late).is_none());
        assert!(!slow.lock().entries.contains_key(&id("a")));
    }
}
