//! Completed records' answers, kept in the process's memory for a moment
//! after a reservation read them, so that a retry storm's replays are
//! answered without a round trip (PostgreSQL's store; see
//! [`crate::PgStore::with_replay_cache`]).
//!
//! A completed record does not change until it expires or is deleted: its
//! answer, fingerprint and expiry are fixed by its completion. An entry is
//! kept for the shorter of the store's bound (one second by default) and
//! the record's retention left, as the database's clock measured it when
//! the lookup ran, counted from before the lookup was sent: it is never
//! answered from past the record's expiry. What it cannot see is a record
//! deleted or edited by hand (an operator freeing a key): each process
//! answers its copy for at most the bound.

use crate::store::{RecordId, Reservation, StoredResponse};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The most entries kept at once.
pub(crate) const MAX_ENTRIES: usize = 8192;
/// The most bytes of answers kept at once (by [`size`]).
pub(crate) const MAX_BYTES: usize = 16 << 20;
/// The largest answer kept (by [`size`]: its body, its headers and its
/// texts): larger ones are always read from the store.
pub(crate) const MAX_ANSWER_BYTES: usize = 16 << 10;
/// How often a full cache is swept of its expired entries, at most.
const SWEEP_EVERY: Duration = Duration::from_millis(100);

/// The answers, shared by a store's clones.
#[derive(Debug)]
pub(crate) struct Replays {
    keep: Duration,
    kept: Mutex<Kept>,
}

#[derive(Debug, Default)]
struct Kept {
    entries: HashMap<RecordId, Entry>,
    bytes: usize,
    next_sweep: Option<Instant>,
}

#[derive(Debug)]
struct Entry {
    fingerprint: Box<str>,
    /// Copied out of the map after the lock is let go: a hit holds it
    /// only for the lookup.
    answer: Arc<StoredResponse>,
    until: Instant,
    bytes: usize,
}

/// What an entry counts against [`MAX_BYTES`]: its texts and a share for
/// the map.
fn size(id: &RecordId, fingerprint: &str, answer: &StoredResponse) -> usize {
    let headers: usize = answer.headers.iter().map(|(n, v)| n.len() + v.len() + 48).sum();
    id.tenant.len()
        + id.scope.len()
        + id.key.len()
        + fingerprint.len()
        + headers
        + answer.body.as_ref().map_or(0, Vec::len)
        + 160
}

impl Replays {
    /// Answers kept for `keep` at most; `Duration::ZERO` keeps none.
    pub(crate) fn new(keep: Duration) -> Self {
        Replays {
            keep,
            kept: Mutex::default(),
        }
    }

    /// How long answers are kept, at most.
    pub(crate) fn keep(&self) -> Duration {
        self.keep
    }

    /// A panic under this lock cannot leave the map half-changed beyond
    /// its byte count, which only bounds it.
    fn lock(&self) -> std::sync::MutexGuard<'_, Kept> {
        self.kept.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The answer to a reservation of `id` with `fingerprint`, when a
    /// completed record of it is kept: its replay, or a mismatch.
    pub(crate) fn find(&self, id: &RecordId, fingerprint: &str) -> Option<Reservation> {
        if self.keep.is_zero() {
            return None;
        }
        self.find_at(id, fingerprint, Instant::now())
    }

    fn find_at(&self, id: &RecordId, fingerprint: &str, now: Instant) -> Option<Reservation> {
        let answer = {
            let mut kept = self.lock();
            let entry = kept.entries.get(id)?;
            if now >= entry.until {
                if let Some(gone) = kept.entries.remove(id) {
                    kept.bytes = kept.bytes.saturating_sub(gone.bytes);
                }
                return None;
            }
            if *entry.fingerprint != *fingerprint {
                return Some(Reservation::Mismatch);
            }
            Arc::clone(&entry.answer)
        };
        Some(Reservation::Completed(StoredResponse::clone(&answer)))
    }

    /// Keeps the answer of a completed record that a lookup sent at `sent`
    /// read, with `left` of its retention by the database's clock.
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
        let bytes = size(id, fingerprint, answer);
        if bytes > MAX_ANSWER_BYTES {
            return;
        }
        let Some(until) = sent.checked_add(self.keep.min(left)) else {
            return;
        };
        let now = Instant::now();
        if until <= now {
            return;
        }
        let mut kept = self.lock();
        if let Some(old) = kept.entries.get(id) {
            // Another reservation kept it first: the same answer.
            if old.until >= until {
                return;
            }
        } else if kept.entries.len() >= MAX_ENTRIES || kept.bytes + bytes > MAX_BYTES {
            if kept.next_sweep.is_some_and(|at| now < at) {
                return;
            }
            kept.next_sweep = Some(now + SWEEP_EVERY);
            kept.entries.retain(|_, e| e.until > now);
            kept.bytes = kept.entries.values().map(|e| e.bytes).sum();
            if kept.entries.len() >= MAX_ENTRIES || kept.bytes + bytes > MAX_BYTES {
                return;
            }
        }
        let entry = Entry {
            fingerprint: fingerprint.into(),
            answer: Arc::new(answer.clone()),
            until,
            bytes,
        };
        if let Some(old) = kept.entries.insert(id.clone(), entry) {
            kept.bytes = kept.bytes.saturating_sub(old.bytes);
        }
        kept.bytes += bytes;
    }

    /// How many answers are kept now (expired ones not yet swept included).
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
}
