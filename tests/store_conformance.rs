//! One conformance suite for the record protocol, run against every store:
//! memory, SQLite (a temp file) and PostgreSQL (`DATABASE_URL`, own schema).

use idem::store::{Lease, RecordId, Reservation, ReserveRequest, StoredResponse};
use idem::{IdempotencyStore, StoreError};
use idem_testkit::records::{
    insert_uncommitted, pg_hold_row as hold_row, pg_table as table_of, req, reserve, take,
};
use idem_testkit::{Fixture, StoreKind};
use std::sync::Arc;
use std::time::{Duration, Instant};

const LONG: Duration = Duration::from_secs(3600);

fn response(tag: &str) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![
            ("content-type".into(), "application/json".into()),
            ("location".into(), format!("/v1/payments/{tag}").into()),
        ],
        body: Some(format!("{{\"id\":\"{tag}\"}}").into_bytes()),
    }
}

/// Absent, then in_progress, then completed with the stored answer.
async fn moves_through_absent_in_progress_and_completed(f: Fixture) {
    let s = &*f.store;
    let id = RecordId::new("t1", "payment.create", "k1");
    let lease = take(s, &id, "fp", LONG, Duration::from_secs(30)).await;
    assert_eq!(lease.attempt, 1);
    assert!(!lease.is_takeover());
    assert_eq!(lease.recovery_point, None);
    match reserve(s, &id, "fp", LONG, Duration::from_secs(30)).await {
        Reservation::InProgress { retry_after } => {
            assert!(
                retry_after <= Duration::from_secs(30) && retry_after >= Duration::from_secs(25),
                "{retry_after:?}"
            )
        }
        other => panic!("expected in progress, got {other:?}"),
    }
    s.complete(&id, &lease.token, &response("p1")).await.unwrap();
    assert_eq!(
        reserve(s, &id, "fp", LONG, LONG).await,
        Reservation::Completed(response("p1"))
    );
    // Completed is final: neither the token nor anyone else can change it.
    assert_eq!(s.release(&id, &lease.token).await, Err(StoreError::LockLost));
    assert_eq!(
        s.complete(&id, &lease.token, &response("p2")).await,
        Err(StoreError::LockLost)
    );
    assert_eq!(
        reserve(s, &id, "fp", LONG, LONG).await,
        Reservation::Completed(response("p1"))
    );
}

/// The stored answer comes back byte for byte, even bytes that are not UTF-8,
/// and a body that was too large to keep comes back as `None`.
async fn replays_every_body_byte_and_header(f: Fixture) {
    let s = &*f.store;
    let id = RecordId::new("t1", "s", "bytes");
    let lease = take(s, &id, "fp", LONG, LONG).await;
    let stored = StoredResponse {
        status: 402,
        headers: vec![
            ("content-type".into(), "application/octet-stream".into()),
            ("x-b".into(), "2".into()),
            ("x-a".into(), "1".into()),
            // obs-text: a byte beyond ASCII, which HTTP allows in a value.
            ("x-note".into(), vec![b'c', b'a', b'f', 0xe9, b' ', 0xff]),
        ],
        body: Some((0..=255u8).collect()),
    };
    s.complete(&id, &lease.token, &stored).await.unwrap();
    assert_eq!(
        reserve(s, &id, "fp", LONG, LONG).await,
        Reservation::Completed(stored)
    );

    let id = RecordId::new("t1", "s", "omitted");
    let lease = take(s, &id, "fp", LONG, LONG).await;
    let stored = StoredResponse {
        status: 201,
        headers: vec![],
        body: None,
    };
    s.complete(&id, &lease.token, &stored).await.unwrap();
    assert_eq!(
        reserve(s, &id, "fp", LONG, LONG).await,
        Reservation::Completed(stored)
    );
}

/// A different fingerprint is a mismatch in any state.
async fn refuses_a_different_fingerprint_in_every_state(f: Fixture) {
    let s = &*f.store;
    let id = RecordId::new("t1", "payment.create", "k2");
    let lease = take(s, &id, "fp-a", LONG, LONG).await;
    assert_eq!(reserve(s, &id, "fp-b", LONG, LONG).await, Reservation::Mismatch);
    s.complete(&id, &lease.token, &response("p")).await.unwrap();
    assert_eq!(reserve(s, &id, "fp-b", LONG, LONG).await, Reservation::Mismatch);

    // Also once the lock deadline has passed: no takeover with another body.
    let id = RecordId::new("t1", "payment.create", "k3");
    take(s, &id, "fp-a", LONG, Duration::from_millis(100)).await;
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert_eq!(reserve(s, &id, "fp-b", LONG, LONG).await, Reservation::Mismatch);
}

/// Release (as failed) lets the retry really retry: the same request
/// continues the same operation (its derived keys stay the same: a release
/// after an external effect cannot cause a second one), while another
/// request with the key is a mismatch. A rejection frees the key.
async fn release_lets_the_next_request_run(f: Fixture) {
    let s = &*f.store;
    let id = RecordId::new("t1", "s", "k4");
    let first = take(s, &id, "fp-a", LONG, LONG).await;
    s.checkpoint(&id, &first.token, "charged").await.unwrap();
    s.release(&id, &first.token).await.unwrap();
    assert_eq!(s.release(&id, &first.token).await, Err(StoreError::LockLost));
    // Bound to its request: another body cannot start a new operation.
    assert_eq!(reserve(s, &id, "fp-b", LONG, LONG).await, Reservation::Mismatch);

    let retry = take(s, &id, "fp-a", LONG, LONG).await;
    assert_eq!(retry.attempt, 2);
    assert!(!retry.is_takeover(), "a retry after a release is not a takeover");
    assert_eq!(retry.operation_id, first.operation_id);
    assert_eq!(retry.recovery_point.as_deref(), Some("charged"));
    // A rejection on a later attempt keeps the key bound all the same.
    s.reject(&id, &retry.token).await.unwrap();
    assert_eq!(reserve(s, &id, "fp-b", LONG, LONG).await, Reservation::Mismatch);
    let again = take(s, &id, "fp-a", LONG, LONG).await;
    assert_eq!(again.attempt, 3);
    assert_eq!(
        s.complete(&id, &retry.token, &response("stale")).await,
        Err(StoreError::LockLost)
    );
    s.complete(&id, &again.token, &response("done")).await.unwrap();
    assert_eq!(
        reserve(s, &id, "fp-a", LONG, LONG).await,
        Reservation::Completed(response("done"))
    );
    assert_eq!(reserve(s, &id, "fp-b", LONG, LONG).await, Reservation::Mismatch);

    // A first attempt rejected: nothing happened, the key is free.
    let id = RecordId::new("t1", "s", "k4-rejected");
    let first = take(s, &id, "fp-a", LONG, LONG).await;
    s.reject(&id, &first.token).await.unwrap();
    // Tried again (the first try's answer may have been lost after it
    // committed): no record is left, so the rejection is done.
    s.reject(&id, &first.token).await.unwrap();
    let fixed = take(s, &id, "fp-b", LONG, LONG).await;
    assert_eq!(fixed.attempt, 1);
    assert!(!fixed.is_takeover());
    assert_eq!(fixed.recovery_point, None);
    assert_ne!(fixed.operation_id, first.operation_id);
    // Once another execution holds the key, the old token rejects nothing.
    assert_eq!(s.reject(&id, &first.token).await, Err(StoreError::LockLost));
    s.complete(&id, &fixed.token, &response("fixed")).await.unwrap();
    assert_eq!(
        reserve(s, &id, "fp-b", LONG, LONG).await,
        Reservation::Completed(response("fixed"))
    );
}

/// A record past its TTL counts as absent: a new operation with a new id.
async fn treats_a_record_past_its_ttl_as_absent(f: Fixture) {
    let s = &*f.store;
    let id = RecordId::new("t1", "s", "k5");
    let ttl = Duration::from_millis(300);
    let first = take(s, &id, "fp-a", ttl, LONG).await;
    s.complete(&id, &first.token, &response("old")).await.unwrap();
    assert_eq!(
        reserve(s, &id, "fp-a", ttl, LONG).await,
        Reservation::Completed(response("old"))
    );
    tokio::time::sleep(Duration::from_millis(450)).await;
    // Another body may use the key now: the old operation is gone.
    let second = take(s, &id, "fp-b", LONG, LONG).await;
    assert_eq!(second.attempt, 1);
    assert_eq!(second.recovery_point, None);
    assert_ne!(second.operation_id, first.operation_id);
}

/// An answer is kept a whole TTL from its completion, not from its first
/// reservation: a slow execution's answer is still replayed right after.
async fn an_answer_is_kept_a_whole_ttl_from_its_completion(f: Fixture) {
    let s = &*f.store;
    let id = RecordId::new("t1", "s", "k-ttl-completion");
    // The windows are wide (400 ms at least) so that a loaded machine's
    // stall between two steps cannot close them.
    let ttl = Duration::from_millis(1000);
    let lease = take(s, &id, "fp", ttl, LONG).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    s.complete(&id, &lease.token, &response("slow")).await.unwrap();
    // Past the TTL from the reservation, within it from the completion.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        reserve(s, &id, "fp", ttl, LONG).await,
        Reservation::Completed(response("slow"))
    );
}

/// An execution that crashed after an effect is kept a whole TTL past its
/// lock deadline: its retry continues the same operation (same id and
/// recovery point), even past the record's TTL, and the janitor keeps it.
async fn a_crashed_operation_outlives_its_ttl_for_its_retry(f: Fixture) {
    let s = &*f.store;
    let id = RecordId::new("t1", "crash", "k-ttl-crash");
    let (ttl, lock) = (Duration::from_millis(800), Duration::from_millis(400));
    let dead = take(s, &id, "fp", ttl, lock).await;
    s.checkpoint(&id, &dead.token, "charged").await.unwrap();
    // Past the TTL and the lock deadline, but not the deadline plus a TTL:
    // 300 ms are left for the steps below, even on a loaded machine.
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert_eq!(s.purge_expired(100).await.unwrap(), 0);
    assert_eq!(
        reserve(s, &id, "fp-other", ttl, lock).await,
        Reservation::Mismatch
    );
    let retry = take(s, &id, "fp", ttl, LONG).await;
    assert_eq!(
        (
            retry.attempt,
            retry.is_takeover(),
            retry.recovery_point.as_deref()
        ),
        (2, true, Some("charged"))
    );
    assert_eq!(retry.operation_id, dead.operation_id);
}

/// Durations past what a clock can tell (`Duration::MAX`: the stores are
/// public, no layer accepts it) mean "never": every call takes them, none
/// panics or fails, and such a record is neither purged nor taken back
/// while it stands.
async fn durations_past_the_clocks_range_mean_never(f: Fixture) {
    let s = &*f.store;
    let (ms, never) = (Duration::from_millis(1), Duration::MAX);
    // Locked for ever, retained a millisecond: once its retention has
    // passed, its lock's deadline plus its TTL is what is judged.
    let locked = RecordId::new("t1", "s", "locked-for-ever");
    let lease = take(s, &locked, "fp", ms, never).await;
    // Past its retention (a deadline, not an ordering).
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(matches!(
        reserve(s, &locked, "fp", ms, never).await,
        Reservation::InProgress { .. }
    ));
    assert_eq!(s.purge_expired(100).await.unwrap(), 0);
    s.extend_lock(&locked, &lease.token, never).await.unwrap();
    s.checkpoint(&locked, &lease.token, "point").await.unwrap();
    // Retained for ever from its completion.
    let kept = RecordId::new("t1", "s", "kept-for-ever");
    let first = take(s, &kept, "fp", never, ms).await;
    s.complete(&kept, &first.token, &response("kept")).await.unwrap();
    assert_eq!(
        reserve(s, &kept, "fp", never, never).await,
        Reservation::Completed(response("kept"))
    );
    // Held and retained for ever, released: taken again at once, the
    // operation continued.
    let released = RecordId::new("t1", "s", "released");
    let first = take(s, &released, "fp", never, never).await;
    s.checkpoint(&released, &first.token, "point").await.unwrap();
    s.release(&released, &first.token).await.unwrap();
    let again = take(s, &released, "fp", never, never).await;
    assert_eq!(
        (again.attempt, again.recovery_point.as_deref()),
        (2, Some("point"))
    );
    assert!(matches!(
        reserve(s, &released, "fp", never, never).await,
        Reservation::InProgress { .. }
    ));
    assert_eq!(s.purge_expired(100).await.unwrap(), 0);
}

/// A lock past its deadline is taken over: new token, attempt + 1, recovery
/// point and operation id kept; the old token can then do nothing.
async fn takes_over_a_stale_lock_and_fences_the_old_owner(f: Fixture) {
    let s = &*f.store;
    let id = RecordId::new("t1", "s", "k6");
    // Long enough for a checkpoint and a read under a loaded machine's
    // syncs (200 ms was not, once).
    let lock = Duration::from_millis(1000);
    let old = take(s, &id, "fp", LONG, lock).await;
    s.checkpoint(&id, &old.token, "charged").await.unwrap();
    assert!(matches!(
        reserve(s, &id, "fp", LONG, lock).await,
        Reservation::InProgress { .. }
    ));
    tokio::time::sleep(Duration::from_millis(1150)).await;

    let new = take(s, &id, "fp", LONG, LONG).await;
    assert_eq!(new.attempt, 2);
    assert!(new.is_takeover());
    assert_eq!(new.recovery_point.as_deref(), Some("charged"));
    assert_eq!(new.operation_id, old.operation_id);
    assert_ne!(new.token, old.token);

    assert_eq!(
        s.complete(&id, &old.token, &response("stale")).await,
        Err(StoreError::LockLost)
    );
    assert_eq!(s.release(&id, &old.token).await, Err(StoreError::LockLost));
    assert_eq!(
        s.checkpoint(&id, &old.token, "stale").await,
        Err(StoreError::LockLost)
    );
    assert_eq!(
        s.extend_lock(&id, &old.token, LONG).await,
        Err(StoreError::LockLost)
    );
    assert!(matches!(
        reserve(s, &id, "fp", LONG, LONG).await,
        Reservation::InProgress { .. }
    ));

    s.checkpoint(&id, &new.token, "notified").await.unwrap();
    s.complete(&id, &new.token, &response("fresh")).await.unwrap();
    assert_eq!(
        reserve(s, &id, "fp", LONG, LONG).await,
        Reservation::Completed(response("fresh"))
    );
}

/// A key handed back by a reservation that never ran goes back as it was
/// found: a fresh key is absent again (however it is said to have been
/// found), a taken-over stale lock is a stale lock again, a continued
/// released record is released again. Fenced by the token.
async fn hands_back_a_key_as_it_was_found(f: Fixture) {
    let s = &*f.store;
    // Fresh, and not known how it was found: removed.
    for taken_over in [true, false] {
        let id = RecordId::new("t1", "s", format!("k-fresh-{taken_over}"));
        let lost = take(s, &id, "fp-a", LONG, LONG).await;
        s.hand_back(&id, &lost.token, taken_over).await.unwrap();
        assert_eq!(
            s.hand_back(&id, &lost.token, taken_over).await,
            Err(StoreError::LockLost)
        );
        // Absent: another body starts a new operation, attempt 1.
        let next = take(s, &id, "fp-b", LONG, LONG).await;
        assert_eq!((next.attempt, next.is_takeover()), (1, false));
        assert_ne!(next.operation_id, lost.operation_id);
    }

    // A stale lock taken over, handed back: a stale lock again.
    let id = RecordId::new("t1", "s", "k-stale");
    let lock = Duration::from_millis(1000);
    let crashed = take(s, &id, "fp", LONG, lock).await;
    s.checkpoint(&id, &crashed.token, "charged").await.unwrap();
    tokio::time::sleep(Duration::from_millis(1150)).await;
    let refused = take(s, &id, "fp", LONG, LONG).await;
    assert_eq!((refused.attempt, refused.is_takeover()), (2, true));
    assert_eq!(
        s.hand_back(&id, &crashed.token, true).await,
        Err(StoreError::LockLost)
    );
    s.hand_back(&id, &refused.token, true).await.unwrap();
    assert_eq!(reserve(s, &id, "fp-b", LONG, LONG).await, Reservation::Mismatch);
    let next = take(s, &id, "fp", LONG, LONG).await;
    assert_eq!((next.attempt, next.is_takeover()), (3, true));
    assert_eq!(next.recovery_point.as_deref(), Some("charged"));
    assert_eq!(next.operation_id, crashed.operation_id);

    // A fresh key with a recovery point: something may have happened; kept
    // (here a stale lock).
    let id = RecordId::new("t1", "s", "k-checkpointed");
    let first = take(s, &id, "fp", LONG, LONG).await;
    s.checkpoint(&id, &first.token, "charged").await.unwrap();
    s.hand_back(&id, &first.token, true).await.unwrap();
    let next = take(s, &id, "fp", LONG, LONG).await;
    assert_eq!((next.attempt, next.is_takeover()), (2, true));
    assert_eq!(next.recovery_point.as_deref(), Some("charged"));

    // The retry of a released record, handed back: released again.
    let id = RecordId::new("t1", "s", "k-released");
    let failed = take(s, &id, "fp", LONG, LONG).await;
    s.release(&id, &failed.token).await.unwrap();
    let refused = take(s, &id, "fp", LONG, LONG).await;
    assert_eq!((refused.attempt, refused.is_takeover()), (2, false));
    s.hand_back(&id, &refused.token, false).await.unwrap();
    let next = take(s, &id, "fp", LONG, LONG).await;
    assert_eq!((next.attempt, next.is_takeover()), (3, false));
    assert_eq!(next.operation_id, failed.operation_id);

    // A completed record is no reservation's to hand back.
    s.complete(&id, &next.token, &response("done")).await.unwrap();
    assert_eq!(
        s.hand_back(&id, &next.token, true).await,
        Err(StoreError::LockLost)
    );
    assert_eq!(
        reserve(s, &id, "fp", LONG, LONG).await,
        Reservation::Completed(response("done"))
    );
}

/// A hand-back never removes what ran or what another reservation holds:
/// a crashed first attempt's record stays bound to its body after a
/// takeover that never ran is handed back (either way it is said to have
/// been found), and a late hand-back of an old token leaves the next
/// owner's record alone.
async fn a_hand_back_never_removes_what_ran_or_another_owns(f: Fixture) {
    let s = &*f.store;
    for taken_over in [false, true] {
        // Attempt 1 ran (no checkpoint) and crashed; a takeover never ran.
        let id = RecordId::new("t1", "s", format!("k-crashed-{taken_over}"));
        let crashed = take(s, &id, "fp", LONG, Duration::from_millis(150)).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let refused = take(s, &id, "fp", LONG, LONG).await;
        assert_eq!((refused.attempt, refused.is_takeover()), (2, true));
        s.hand_back(&id, &refused.token, taken_over).await.unwrap();
        assert_eq!(reserve(s, &id, "fp-b", LONG, LONG).await, Reservation::Mismatch);
        let next = take(s, &id, "fp", LONG, LONG).await;
        assert_eq!(next.attempt, 3);
        assert_eq!(next.operation_id, crashed.operation_id);

        // A fresh reservation whose lock ran out was taken over: its late
        // hand-back is fenced out.
        let id = RecordId::new("t1", "s", format!("k-old-{taken_over}"));
        let old = take(s, &id, "fp", LONG, Duration::from_millis(150)).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let new = take(s, &id, "fp", LONG, LONG).await;
        assert_eq!(
            s.hand_back(&id, &old.token, taken_over).await,
            Err(StoreError::LockLost)
        );
        // Handed back, then taken afresh by another: the old token again.
        let id = RecordId::new("t1", "s", format!("k-twice-{taken_over}"));
        let first = take(s, &id, "fp", LONG, LONG).await;
        s.hand_back(&id, &first.token, taken_over).await.unwrap();
        let owner = take(s, &id, "fp", LONG, LONG).await;
        assert_eq!(
            s.hand_back(&id, &first.token, taken_over).await,
            Err(StoreError::LockLost)
        );
        for (id, owner) in [
            (RecordId::new("t1", "s", format!("k-old-{taken_over}")), new),
            (id, owner),
        ] {
            assert!(matches!(
                reserve(s, &id, "fp", LONG, LONG).await,
                Reservation::InProgress { .. }
            ));
            s.complete(&id, &owner.token, &response("done")).await.unwrap();
            assert_eq!(
                reserve(s, &id, "fp", LONG, LONG).await,
                Reservation::Completed(response("done"))
            );
        }
    }
}

/// Extending the lock keeps a slow but living owner from being taken over.
async fn an_extended_lock_is_not_taken_over(f: Fixture) {
    let s = &*f.store;
    let id = RecordId::new("t1", "s", "k7");
    let lease = take(s, &id, "fp", LONG, Duration::from_millis(300)).await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    s.extend_lock(&id, &lease.token, Duration::from_secs(5))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(matches!(
        reserve(s, &id, "fp", LONG, LONG).await,
        Reservation::InProgress { .. }
    ));
}

/// The same key under another tenant or scope is another operation.
async fn isolates_tenants_and_scopes(f: Fixture) {
    let s = &*f.store;
    let a = RecordId::new("tenant-a", "payment.create", "same-key");
    let b = RecordId::new("tenant-b", "payment.create", "same-key");
    let c = RecordId::new("tenant-a", "refund.create", "same-key");
    let la = take(s, &a, "fp-a", LONG, LONG).await;
    // Neither blocked (in progress) nor refused (different body) by tenant a.
    let lb = take(s, &b, "fp-b", LONG, LONG).await;
    let lc = take(s, &c, "fp-c", LONG, LONG).await;
    s.complete(&a, &la.token, &response("a")).await.unwrap();
    // A token of one record is worthless on another.
    assert_eq!(
        s.complete(&b, &la.token, &response("x")).await,
        Err(StoreError::LockLost)
    );
    assert_eq!(s.release(&c, &lb.token).await, Err(StoreError::LockLost));
    assert!(matches!(
        reserve(s, &b, "fp-b", LONG, LONG).await,
        Reservation::InProgress { .. }
    ));
    s.complete(&b, &lb.token, &response("b")).await.unwrap();
    s.release(&c, &lc.token).await.unwrap();
    assert_eq!(
        reserve(s, &a, "fp-a", LONG, LONG).await,
        Reservation::Completed(response("a"))
    );
    assert_eq!(
        reserve(s, &b, "fp-b", LONG, LONG).await,
        Reservation::Completed(response("b"))
    );
}

/// Purge removes expired records in bounded batches and never a live lock.
async fn purges_in_batches_and_never_a_live_lock(f: Fixture) {
    let s = &*f.store;
    let short = Duration::from_millis(100);
    for i in 0..3 {
        let id = RecordId::new("t1", "purge", format!("done-{i}"));
        let l = take(s, &id, "fp", short, LONG).await;
        s.complete(&id, &l.token, &response("x")).await.unwrap();
    }
    let stale = RecordId::new("t1", "purge", "stale-lock");
    take(s, &stale, "fp", short, short).await;
    let live = RecordId::new("t1", "purge", "live-lock");
    take(s, &live, "fp", short, LONG).await;
    let kept = RecordId::new("t1", "purge", "kept");
    let l = take(s, &kept, "fp", LONG, LONG).await;
    s.complete(&kept, &l.token, &response("kept")).await.unwrap();
    tokio::time::sleep(Duration::from_millis(250)).await;

    assert_eq!(s.purge_expired(2).await.unwrap(), 2);
    assert_eq!(s.purge_expired(2).await.unwrap(), 2);
    assert_eq!(s.purge_expired(2).await.unwrap(), 0);
    assert!(matches!(
        reserve(s, &live, "fp", LONG, LONG).await,
        Reservation::InProgress { .. }
    ));
    assert_eq!(
        reserve(s, &kept, "fp", LONG, LONG).await,
        Reservation::Completed(response("kept"))
    );
}

/// `n` tasks reserve one key at the same moment: exactly one wins.
async fn concurrent_reservers_get_exactly_one(stores: Vec<Arc<dyn IdempotencyStore>>, n: usize) {
    let id = Arc::new(RecordId::new("t1", "race", "one-key"));
    let barrier = Arc::new(tokio::sync::Barrier::new(n));
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let store = stores[i % stores.len()].clone();
            let (id, barrier) = (id.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                store.reserve(req(&id, "fp", LONG, LONG)).await
            })
        })
        .collect();
    let (mut reserved, mut in_progress) = (0, 0);
    for t in tasks {
        match t.await.unwrap().expect("reserve") {
            Reservation::Reserved(_) => reserved += 1,
            Reservation::InProgress { .. } => in_progress += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!((reserved, in_progress), (1, n - 1));
}

async fn twenty_concurrent_reservers_get_exactly_one(f: Fixture) {
    concurrent_reservers_get_exactly_one(vec![f.store], 20).await;
}

/// The store of `kind`; SQLite on a pool of 20, so every reserver of the
/// race has its own connection.
async fn fixture(kind: StoreKind) -> Option<Fixture> {
    if kind != StoreKind::Sqlite {
        return kind.fixture().await;
    }
    let dir = tempfile::tempdir().unwrap();
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(dir.path().join("idem.db"))
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(10));
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(20)
        .min_connections(20)
        .connect_with(options)
        .await
        .unwrap();
    let store = idem::SqliteStore::new(pool).with_timeout(Duration::from_secs(15));
    store.migrate().await.unwrap();
    Some(Fixture {
        store: Arc::new(store),
        dir: Some(dir),
    })
}

idem_testkit::for_each_store! {
    stores: [memory, sqlite, postgres],
    setup: |kind| fixture(kind).await,
    worker_threads: 4,
    cases: [
        moves_through_absent_in_progress_and_completed,
        replays_every_body_byte_and_header,
        refuses_a_different_fingerprint_in_every_state,
        release_lets_the_next_request_run,
        treats_a_record_past_its_ttl_as_absent,
        takes_over_a_stale_lock_and_fences_the_old_owner,
        hands_back_a_key_as_it_was_found,
        a_hand_back_never_removes_what_ran_or_another_owns,
        an_answer_is_kept_a_whole_ttl_from_its_completion,
        a_crashed_operation_outlives_its_ttl_for_its_retry,
        an_extended_lock_is_not_taken_over,
        durations_past_the_clocks_range_mean_never,
        isolates_tenants_and_scopes,
        purges_in_batches_and_never_a_live_lock,
        twenty_concurrent_reservers_get_exactly_one,
    ],
}

/// 200 reservers over 4 separate pools, as 4 server processes would be.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_two_hundred_reservers_over_four_pools_get_exactly_one() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let mut stores: Vec<Arc<dyn IdempotencyStore>> = Vec::new();
    for _ in 0..4 {
        stores.push(Arc::new(idem_testkit::pg_store_in(&url, &schema, 10).await));
    }
    concurrent_reservers_get_exactly_one(stores, 200).await;
}

/// A server that is down answers `Unavailable` within the configured time.
#[tokio::test]
async fn postgres_unreachable_is_unavailable_within_the_timeout() {
    // A closed port: connections are refused.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    // A port that accepts and never answers: the handshake hangs.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_port = silent.local_addr().unwrap().port();
    let _keep = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((sock, _)) = silent.accept().await {
            held.push(sock);
        }
    });

    for port in [port, silent_port] {
        let store = idem::PgStore::connect(&format!("postgres://postgres@127.0.0.1:{port}/test"))
            .unwrap()
            .with_timeout(Duration::from_millis(500));
        let id = RecordId::new("t", "s", "k");
        let started = Instant::now();
        let err = store.reserve(req(&id, "fp", LONG, LONG)).await.unwrap_err();
        let took = started.elapsed();
        assert!(err.is_unavailable(), "port {port}: {err:?}");
        assert!(took < Duration::from_millis(1500), "port {port}: took {took:?}");
        let err = store.release(&id, "token").await.unwrap_err();
        assert!(err.is_unavailable(), "port {port}: {err:?}");
    }
}

/// A migrated PostgreSQL store in a schema of its own, bounded by
/// `timeout`, with its pool and schema; `None` without `DATABASE_URL`.
async fn pg_store_within(timeout: Duration) -> Option<(sqlx::PgPool, String, idem::PgStore)> {
    let url = idem_testkit::pg_url()?;
    let schema = idem_testkit::pg_schema(&url).await;
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let store = idem::PgStore::new(pool.clone())
        .with_table(Some(&schema), "idempotency_keys")
        .unwrap()
        .with_timeout(timeout);
    store.migrate().await.unwrap();
    Some((pool, schema, store))
}

/// A purge call is bounded by one store timeout in all, however its
/// statements share it: with each statement that sets `purge_at` or
/// deletes taking 0.7 of the timeout, the call is `Unavailable` once the
/// timeout has passed, not answered after both.
#[tokio::test]
async fn postgres_a_purge_call_is_bounded_by_one_store_timeout() {
    let timeout = Duration::from_secs(1);
    let Some((pool, schema, store)) = pg_store_within(timeout).await else {
        return;
    };
    // Every UPDATE and DELETE on the table takes 0.7 s, rows or none.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE FUNCTION \"{schema}\".slow() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN PERFORM pg_sleep(0.7); RETURN NULL; END $$; \
         CREATE TRIGGER slow BEFORE UPDATE OR DELETE ON \"{schema}\".idempotency_keys \
         FOR EACH STATEMENT EXECUTE FUNCTION \"{schema}\".slow()"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let started = Instant::now();
    let purged = store.purge_expired(100).await;
    let took = started.elapsed();
    assert!(
        matches!(&purged, Err(e) if e.is_unavailable()),
        "{purged:?} after {took:?}"
    );
    assert!(took < 2 * timeout, "took {took:?}");
}

/// Two OS processes reserve the same 50 keys in one SQLite file at once:
/// every key is won exactly once.
#[test]
fn sqlite_two_processes_get_exactly_one_reservation_per_key() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("shared.db");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        idem::SqliteStore::open(&db)
            .await
            .unwrap()
            .migrate()
            .await
            .unwrap();
    });
    let start_at = std::time::SystemTime::now() + Duration::from_millis(1500);
    let start_ms = start_at
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis();
    let children: Vec<_> = (0..2)
        .map(|_| {
            std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "sqlite_reserver_process",
                    "--ignored",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env("IDEM_RACE_DB", &db)
                .env("IDEM_RACE_START_MS", start_ms.to_string())
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut won = Vec::new();
    for child in children {
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "reserver process failed");
        let text = String::from_utf8(out.stdout).unwrap();
        let keys: Vec<String> = text
            .lines()
            // The harness writes "test ... " before the first line of ours.
            .filter_map(|l| l.split("WON ").nth(1))
            .map(|k| k.trim().to_owned())
            .collect();
        assert!(text.contains("DONE"), "reserver did not finish: {text}");
        won.push(keys);
    }
    let mut all: Vec<String> = won.concat();
    all.sort();
    let expected: Vec<String> = {
        let mut v: Vec<String> = (0..50).map(|i| format!("key-{i}")).collect();
        v.sort();
        v
    };
    assert_eq!(all, expected, "each key must be won exactly once");
    eprintln!("process 1 won {}, process 2 won {}", won[0].len(), won[1].len());
}

/// The child of the test above (run only by it, through `--ignored`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "helper process of sqlite_two_processes_get_exactly_one_reservation_per_key"]
async fn sqlite_reserver_process() {
    let db = std::env::var("IDEM_RACE_DB").expect("run by the two-process test");
    let start_ms: u128 = std::env::var("IDEM_RACE_START_MS").unwrap().parse().unwrap();
    let store = Arc::new(
        idem::SqliteStore::open(&db)
            .await
            .unwrap()
            .with_timeout(Duration::from_secs(30)),
    );
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis();
    tokio::time::sleep(Duration::from_millis(start_ms.saturating_sub(now) as u64)).await;
    let tasks: Vec<_> = (0..50)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                let id = RecordId::new("t", "race", format!("key-{i}"));
                let r = store.reserve(req(&id, "fp", LONG, LONG)).await.expect("reserve");
                (id.key, r)
            })
        })
        .collect();
    for t in tasks {
        let (key, r) = t.await.unwrap();
        if let Reservation::Reserved(_) = r {
            println!("WON {key}");
        }
    }
    println!("DONE");
}

/// `PgStore::connect`'s pool replaces a connection the database
/// terminated before it lends it (sqlx pings it first), so that no
/// statement is lost on it: after a second idle, and right after use, five
/// times over (a pool that lends a just-used connection without a ping
/// fails every one of these).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_connect_replaces_terminated_connections_unseen() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let name = idem_testkit::unique("idem_ping");
    let sep = if url.contains('?') { '&' } else { '?' };
    // Every replay read from the database: each is a statement.
    let store = idem::PgStore::connect(&format!("{url}{sep}application_name={name}"))
        .unwrap()
        .with_table(Some(&schema), "idempotency_keys")
        .unwrap()
        .with_replay_cache(Duration::ZERO);
    store.migrate().await.unwrap();
    let id = RecordId::new("t", "s", "ping");
    let lease = take(&store, &id, "fp", LONG, LONG).await;
    store.complete(&id, &lease.token, &response("p")).await.unwrap();
    let watcher = sqlx::PgPool::connect(&url).await.unwrap();
    let backends = || async {
        let pids: Vec<i32> =
            sqlx::query_scalar("SELECT pid FROM pg_stat_activity WHERE application_name = $1")
                .bind(&name)
                .fetch_all(&watcher)
                .await
                .unwrap();
        pids
    };
    // Waits until every connection is back in the pool, then terminates
    // the store's connections and waits until they are gone.
    let terminate = || async {
        let until = Instant::now() + Duration::from_secs(10);
        while store.pool().num_idle() < store.pool().size() as usize {
            assert!(Instant::now() < until, "a connection never came back to the pool");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let before = backends().await;
        assert!(!before.is_empty(), "the store has no connection");
        sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1")
            .bind(&name)
            .execute(&watcher)
            .await
            .unwrap();
        while !backends().await.is_empty() {
            assert!(Instant::now() < until, "the connections did not end");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        before
    };
    // Idle for longer than a second (a duration, not an ordering).
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let mut dead = terminate().await;
    assert_eq!(
        reserve(&store, &id, "fp", LONG, LONG).await,
        Reservation::Completed(response("p"))
    );
    // Right after use.
    for _ in 0..5 {
        dead.extend(terminate().await);
        assert_eq!(
            store.reserve(req(&id, "fp", LONG, LONG)).await,
            Ok(Reservation::Completed(response("p"))),
            "a statement was lent a terminated connection"
        );
    }
    let now = backends().await;
    assert!(
        now.iter().all(|pid| !dead.contains(pid)),
        "a terminated connection answered: {now:?}"
    );
}

/// A store of its own pool, its connections named `name` (so that a test
/// can find and end their sessions), on `schema`'s table, migrated, every
/// replay read from the database.
async fn named_pg_store(url: &str, schema: &str, name: &str) -> idem::PgStore {
    let sep = if url.contains('?') { '&' } else { '?' };
    let store = idem::PgStore::connect(&format!("{url}{sep}application_name={name}"))
        .unwrap()
        .with_table(Some(schema), "idempotency_keys")
        .unwrap()
        .with_replay_cache(Duration::ZERO);
    store.migrate().await.unwrap();
    // Four connections in the pool, idle: the store's first statements
    // take two of them for its own (its spare, and the one kept for the
    // statements that run alone), and the rest stay idle for a statement
    // to find as it is.
    drop(futures_util::future::join_all((0..4).map(|_| store.pool().acquire())).await);
    store
}

/// Waits until every connection of `store`'s pool is idle, then ends the
/// sessions named `name` and waits until they are gone.
async fn end_idle_sessions(store: &idem::PgStore, watcher: &sqlx::PgPool, name: &str) {
    // Two lent and given back first: the pool has idle connections to end
    // (the store may have made its kept connection of the last one).
    drop(futures_util::future::join_all((0..2).map(|_| store.pool().acquire())).await);
    all_idle(store).await;
    sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1")
        .bind(name)
        .execute(watcher)
        .await
        .unwrap();
    within_ten_seconds("the sessions to end", async || {
        sessions(watcher, name, "").await == 0
    })
    .await;
}

/// Polls `done` every 5 ms until it holds; fails the test, saying what it
/// waited for, after ten seconds.
async fn within_ten_seconds(what: &str, done: impl AsyncFnMut() -> bool) {
    idem_testkit::within(Duration::from_secs(10), what, done).await;
}

/// How many sessions named `name` there are, of those whose state
/// satisfies `and` (an SQL condition on `pg_stat_activity`, or nothing).
async fn sessions(watcher: &sqlx::PgPool, name: &str, and: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 {and}"
    )))
    .bind(name)
    .fetch_one(watcher)
    .await
    .unwrap()
}

/// Waits until every connection of `store`'s pool is idle (sqlx gives
/// each back from a task of its own), and there is one.
async fn all_idle(store: &idem::PgStore) {
    let pool = store.pool();
    within_ten_seconds("every connection back in the pool", async || {
        pool.num_idle() == pool.size() as usize && pool.num_idle() > 0
    })
    .await;
}

/// Waits until a session named `name` waits for a lock, and ends it.
async fn end_the_waiting_session(watcher: &sqlx::PgPool, name: &str) {
    within_ten_seconds("a statement of the store to wait for the lock", async || {
        let ended: Vec<bool> = sqlx::query_scalar(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE application_name = $1 AND wait_event_type = 'Lock'",
        )
        .bind(name)
        .fetch_all(watcher)
        .await
        .unwrap();
        ended.contains(&true)
    })
    .await;
}

/// A completion written on an idle connection whose session the database
/// ended is written again on a tested one: the answer is stored, and
/// replayed. (A store that took an idle connection as it is and did not
/// run the statement again fails this.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_completion_on_an_ended_session_is_written_again() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let name = idem_testkit::unique("idem_gone_c");
    let store = named_pg_store(&url, &schema, &name).await;
    let watcher = sqlx::PgPool::connect(&url).await.unwrap();
    for round in 0..3 {
        let id = RecordId::new("t", "s", format!("complete-{round}"));
        let lease = take(&store, &id, "fp", LONG, LONG).await;
        end_idle_sessions(&store, &watcher, &name).await;
        store
            .complete(&id, &lease.token, &response("c"))
            .await
            .expect("the completion");
        assert_eq!(
            reserve(&store, &id, "fp", LONG, LONG).await,
            Reservation::Completed(response("c"))
        );
    }
}

/// A statement whose session ends while it waits for a row lock (so that
/// it wrote nothing) runs again, once the lock is let go: a reservation
/// takes its key, a completion stores its answer, each exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_statement_whose_session_ends_while_it_waits_runs_again() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let name = idem_testkit::unique("idem_gone_w");
    let store = Arc::new(named_pg_store(&url, &schema, &name).await);
    let watcher = sqlx::PgPool::connect(&url).await.unwrap();
    // Four connections in the pool, idle: the store's first reservation
    // takes one for its lock extensions, and a statement's second try, and
    // the completion that follows the one that skips the held row, each
    // find one of the rest.
    let lent: Vec<_> = futures_util::future::join_all((0..4).map(|_| store.pool().acquire())).await;
    drop(lent);

    // The reservation: its insert waits for another transaction's.
    let id = RecordId::new("t", "s", "waits");
    let holder = insert_uncommitted(&watcher, &store, &[&id]).await;
    all_idle(&store).await;
    let reserving = tokio::spawn({
        let (store, id) = (store.clone(), id.clone());
        async move { store.reserve(req(&id, "fp", LONG, LONG)).await }
    });
    end_the_waiting_session(&watcher, &name).await;
    // Its second try waits in turn; the other transaction ends unwritten.
    until_a_session_waits(&watcher, &name).await;
    holder.rollback().await.unwrap();
    let lease = match reserving.await.unwrap() {
        Ok(Reservation::Reserved(lease)) => lease,
        other => panic!("expected the key taken by the second try, got {other:?}"),
    };

    // The completion: its row held by another transaction.
    let holder = hold_row(&watcher, &store, &id).await;
    all_idle(&store).await;
    let completing = tokio::spawn({
        let (store, id, token) = (store.clone(), id.clone(), lease.token.clone());
        async move { store.complete(&id, &token, &response("w")).await }
    });
    end_the_waiting_session(&watcher, &name).await;
    until_a_session_waits(&watcher, &name).await;
    holder.rollback().await.unwrap();
    completing
        .await
        .unwrap()
        .expect("the completion, written by its second try");
    assert_eq!(
        reserve(&*store, &id, "fp", LONG, LONG).await,
        Reservation::Completed(response("w"))
    );
}

/// Waits until a session named `name` waits for a lock again (the
/// statement's second try), without ending it.
async fn until_a_session_waits(watcher: &sqlx::PgPool, name: &str) {
    within_ten_seconds("the statement's second try to wait for the lock", async || {
        sessions(watcher, name, "AND wait_event_type = 'Lock'").await > 0
    })
    .await;
}

/// After the store's idle sessions were ended (a restart), each
/// reservation's first try fails on its connection and runs again, and is
/// answered as it would have been without the restart: another
/// execution's running record is a conflict, another fingerprint a
/// mismatch, a record released as failed or a stale lock taken again.
/// None of these can be what the first try wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_second_try_answers_what_it_finds_as_the_first_would_have() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let name = idem_testkit::unique("idem_gone_r");
    let store = named_pg_store(&url, &schema, &name).await;
    let other = named_pg_store(&url, &schema, &idem_testkit::unique("idem_other")).await;
    let watcher = sqlx::PgPool::connect(&url).await.unwrap();
    take(&store, &RecordId::new("t", "s", "warm"), "fp", LONG, LONG).await;
    let (running, released, stale) = (
        RecordId::new("t", "s", "running"),
        RecordId::new("t", "s", "released"),
        RecordId::new("t", "s", "stale"),
    );
    take(&other, &running, "fp", LONG, LONG).await;
    let lease = take(&other, &released, "fp", LONG, LONG).await;
    other.release(&released, &lease.token).await.unwrap();
    take(&other, &stale, "fp", LONG, LONG).await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {} SET lock_expires_at = now() - interval '1 second' WHERE key = 'stale'",
        table_of(&store)
    )))
    .execute(&watcher)
    .await
    .unwrap();

    end_idle_sessions(&store, &watcher, &name).await;
    assert!(matches!(
        store.reserve(req(&running, "fp", LONG, LONG)).await,
        Ok(Reservation::InProgress { .. })
    ));
    end_idle_sessions(&store, &watcher, &name).await;
    assert_eq!(
        store.reserve(req(&running, "other", LONG, LONG)).await,
        Ok(Reservation::Mismatch)
    );
    for id in [&released, &stale] {
        end_idle_sessions(&store, &watcher, &name).await;
        let taken = store.reserve(req(id, "fp", LONG, LONG)).await;
        assert!(
            matches!(&taken, Ok(Reservation::Reserved(l)) if l.attempt == 2),
            "{}: {taken:?}",
            id.key
        );
    }
}

/// A reservation whose first try's session ended, and whose second try
/// finds the key held under its own token (what the first try wrote,
/// its answer lost), is answered as the first try failed: unavailable.
/// The caller's hand-back, fenced by that token, frees the key, and the
/// client's retry takes it. (The first try's write is made here by another
/// store under the same token: a session that ends between a statement's
/// commit and its answer cannot be timed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_second_try_that_finds_its_own_token_fails_as_the_first() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let name = idem_testkit::unique("idem_gone_o");
    let store = named_pg_store(&url, &schema, &name).await;
    let other = named_pg_store(&url, &schema, &idem_testkit::unique("idem_other")).await;
    let watcher = sqlx::PgPool::connect(&url).await.unwrap();
    take(&store, &RecordId::new("t", "s", "warm"), "fp", LONG, LONG).await;
    let id = RecordId::new("t", "s", "own");
    let mine = req(&id, "fp", LONG, LONG);
    let token = mine.token.to_owned();
    assert!(matches!(other.reserve(mine).await, Ok(Reservation::Reserved(_))));

    end_idle_sessions(&store, &watcher, &name).await;
    let e = store
        .reserve(mine)
        .await
        .expect_err("answered as the first try failed");
    assert!(e.is_unavailable(), "{e:?}");
    store.hand_back(&id, &token, false).await.unwrap();
    let taken = reserve(&store, &id, "fp", LONG, LONG).await;
    assert!(matches!(taken, Reservation::Reserved(_)), "{taken:?}");
}

/// A completion whose first try's session ended, and whose row another
/// transaction holds when it runs again, waits for the row and is
/// written, as without the restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_completion_run_again_waits_for_a_held_row() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let name = idem_testkit::unique("idem_gone_h");
    let store = Arc::new(named_pg_store(&url, &schema, &name).await);
    let watcher = sqlx::PgPool::connect(&url).await.unwrap();
    let lent: Vec<_> = futures_util::future::join_all((0..3).map(|_| store.pool().acquire())).await;
    drop(lent);
    let id = RecordId::new("t", "s", "held");
    let lease = take(&*store, &id, "fp", LONG, LONG).await;
    let holder = hold_row(&watcher, &store, &id).await;
    end_idle_sessions(&store, &watcher, &name).await;
    let completing = tokio::spawn({
        let (store, id, token) = (store.clone(), id.clone(), lease.token.clone());
        async move { store.complete(&id, &token, &response("h")).await }
    });
    until_a_session_waits(&watcher, &name).await;
    holder.rollback().await.unwrap();
    completing
        .await
        .unwrap()
        .expect("the completion, written once the row is let go");
    assert_eq!(
        reserve(&*store, &id, "fp", LONG, LONG).await,
        Reservation::Completed(response("h"))
    );
}

/// The statements a request waits for take an idle connection as it is,
/// without the pool's test (which would run its `before_acquire` hook, as
/// it does for every lent connection); `with_tested_connections(true)`
/// takes them as the pool lends them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_request_statements_skip_the_pools_test_unless_told() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let tested = Arc::new(AtomicUsize::new(0));
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .before_acquire({
            let tested = tested.clone();
            move |_, _| {
                tested.fetch_add(1, Ordering::SeqCst);
                Box::pin(async { Ok(true) })
            }
        })
        .connect(&url)
        .await
        .unwrap();
    let store = idem::PgStore::new(pool)
        .with_table(Some(&schema), "idempotency_keys")
        .unwrap()
        .with_replay_cache(Duration::ZERO);
    store.migrate().await.unwrap();
    let idle = || all_idle(&store);
    let first_request = |store: idem::PgStore, key: &'static str| async move {
        let id = RecordId::new("t", "s", key);
        let lease = take(&store, &id, "fp", LONG, LONG).await;
        store.complete(&id, &lease.token, &response(key)).await.unwrap();
        assert_eq!(
            reserve(&store, &id, "fp", LONG, LONG).await,
            Reservation::Completed(response(key))
        );
    };
    // Three connections idle, so that each statement below finds one idle
    // while the one before it goes back through sqlx's ping; and the
    // store's spare connection taken before counting (a store's first
    // reservation takes one, at once from the idle ones, else through the
    // pool's test in a task of its own: not a request's statement).
    let three_idle = || async {
        drop(futures_util::future::join_all((0..3).map(|_| store.pool().acquire())).await);
        idle().await;
    };
    three_idle().await;
    first_request(store.clone(), "warm").await;
    three_idle().await;
    let before = tested.load(Ordering::SeqCst);
    first_request(store.clone(), "untested").await;
    assert_eq!(
        tested.load(Ordering::SeqCst),
        before,
        "a request's statement was lent a tested connection"
    );
    // Three connections idle again: each statement below is lent one of
    // them, tested (a connection the pool opens anew runs `after_connect`,
    // not `before_acquire`).
    three_idle().await;
    let before = tested.load(Ordering::SeqCst);
    first_request(store.clone().with_tested_connections(true), "tested").await;
    assert!(
        tested.load(Ordering::SeqCst) >= before + 3,
        "the reservation, the completion and the replay each take a tested connection"
    );

    // While another statement of the store is under way (a completion
    // waiting for a row another transaction holds), a reservation takes
    // a tested connection.
    let watcher = sqlx::PgPool::connect(&url).await.unwrap();
    let held = RecordId::new("t", "s", "held");
    let lease = take(&store, &held, "fp", LONG, LONG).await;
    let holder = hold_row(&watcher, &store, &held).await;
    let completing = tokio::spawn({
        let (store, held, token) = (store.clone(), held.clone(), lease.token.clone());
        async move { store.complete(&held, &token, &response("held")).await }
    });
    within_ten_seconds("the completion to wait for the row", async || {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE 'UPDATE%'",
        )
        .fetch_one(&watcher)
        .await
        .unwrap()
            > 0
    })
    .await;
    let before = tested.load(Ordering::SeqCst);
    take(&store, &RecordId::new("t", "s", "beside"), "fp", LONG, LONG).await;
    assert!(
        tested.load(Ordering::SeqCst) > before,
        "a reservation beside a statement under way took an untested connection"
    );
    holder.rollback().await.unwrap();
    completing.await.unwrap().unwrap();
}

/// The statements a request waits for, when they run alone, keep the
/// connection they ran on for the next, rather than give it back to the
/// pool, which would test it first (sqlx pings every connection given back
/// to it, running its `after_release` hook): request after request, no
/// connection goes back to the pool. A store that takes tested connections
/// gives each back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_request_statements_that_run_alone_keep_their_connection() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let given_back = Arc::new(AtomicUsize::new(0));
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .after_release({
            let given_back = given_back.clone();
            move |_, _| {
                given_back.fetch_add(1, Ordering::SeqCst);
                Box::pin(async { Ok(true) })
            }
        })
        .connect(&url)
        .await
        .unwrap();
    let store = idem::PgStore::new(pool)
        .with_table(Some(&schema), "idempotency_keys")
        .unwrap()
        .with_replay_cache(Duration::ZERO);
    store.migrate().await.unwrap();
    let first_request = |store: idem::PgStore, key: String| async move {
        let id = RecordId::new("t", "s", key.as_str());
        let lease = take(&store, &id, "fp", LONG, LONG).await;
        store.complete(&id, &lease.token, &response(&key)).await.unwrap();
        assert_eq!(
            reserve(&store, &id, "fp", LONG, LONG).await,
            Reservation::Completed(response(&key))
        );
    };
    // The first takes the store's connections (its spare, and the one it
    // keeps) from the pool.
    first_request(store.clone(), "warm".into()).await;
    let pool = store.pool().clone();
    within_ten_seconds("every connection lent back in the pool", async || {
        pool.num_idle() == pool.size() as usize
    })
    .await;
    let before = given_back.load(Ordering::SeqCst);
    for n in 0..5 {
        first_request(store.clone(), format!("kept-{n}")).await;
    }
    assert_eq!(
        given_back.load(Ordering::SeqCst),
        before,
        "a request's statement gave its connection back to the pool"
    );
    let tested = store.clone().with_tested_connections(true);
    first_request(tested, "tested".into()).await;
    all_idle(&store).await;
    assert!(
        given_back.load(Ordering::SeqCst) >= before + 3,
        "the reservation, the completion and the replay each give their lent connection back"
    );
}

/// A statement that runs alone and that the database refuses with an
/// error of its own (here a lock wait run out, SQLSTATE 55P03, under the
/// session's shorter `lock_timeout`), its session in step, keeps its
/// connection as one it answers does: refused statements cost the store
/// no new connection each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_statement_the_database_refuses_keeps_its_connection() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let opened = Arc::new(AtomicUsize::new(0));
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .after_connect({
            let opened = opened.clone();
            move |conn, _| {
                opened.fetch_add(1, Ordering::SeqCst);
                Box::pin(async move {
                    sqlx::Executor::execute(conn, "SET lock_timeout = '50ms'").await?;
                    Ok(())
                })
            }
        })
        .connect(&url)
        .await
        .unwrap();
    let store = idem::PgStore::new(pool)
        .with_table(Some(&schema), "idempotency_keys")
        .unwrap()
        .with_replay_cache(Duration::ZERO)
        .with_timeout(Duration::from_secs(5));
    store.migrate().await.unwrap();
    let watcher = sqlx::PgPool::connect(&url).await.unwrap();
    let warm = RecordId::new("t", "s", "warm");
    let lease = take(&store, &warm, "fp", LONG, LONG).await;
    store
        .complete(&warm, &lease.token, &response("warm"))
        .await
        .unwrap();
    for round in 0..10 {
        let id = RecordId::new("t", "s", format!("held-{round}"));
        let lease = take(&store, &id, "fp", LONG, LONG).await;
        let holder = hold_row(&watcher, &store, &id).await;
        let refused = store.complete(&id, &lease.token, &response("x")).await;
        assert!(refused.is_err(), "round {round}: {refused:?}");
        holder.rollback().await.unwrap();
        store.complete(&id, &lease.token, &response("x")).await.unwrap();
    }
    // The database ended no session: the pool's size and the store's two.
    let opened = opened.load(Ordering::SeqCst);
    assert!(opened <= 4 + 2, "{opened} connections opened for a pool of 4");
}

/// The connection a store keeps is closed once it has been idle longer
/// than the pool keeps one idle (its `idle_timeout`), as the pool closes
/// its own, even when no statement comes to find it so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_kept_connection_idle_past_the_pools_idle_timeout_is_closed() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let name = idem_testkit::unique("idem_kept_idle");
    let sep = if url.contains('?') { '&' } else { '?' };
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .idle_timeout(Duration::from_secs(1))
        .connect(&format!("{url}{sep}application_name={name}"))
        .await
        .unwrap();
    let store = idem::PgStore::new(pool.clone())
        .with_table(Some(&schema), "idempotency_keys")
        .unwrap()
        .with_replay_cache(Duration::ZERO);
    store.migrate().await.unwrap();
    // Three connections idle: the first request finds its spare and the
    // one it keeps among them.
    drop(futures_util::future::join_all((0..3).map(|_| pool.acquire())).await);
    let watcher = sqlx::PgPool::connect(&url).await.unwrap();
    let id = RecordId::new("t", "s", "idle");
    let lease = take(&store, &id, "fp", LONG, LONG).await;
    store.complete(&id, &lease.token, &response("i")).await.unwrap();
    // The completion's session, kept, is left idle; then it is closed.
    let kept_since = |watcher: &sqlx::PgPool| {
        let (watcher, name) = (watcher.clone(), name.clone());
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'UPDATE%'",
            )
            .bind(&name)
            .fetch_one(&watcher)
            .await
            .unwrap()
        }
    };
    assert_eq!(kept_since(&watcher).await, 1, "the completion's connection, kept");
    within_ten_seconds("the kept connection to be closed", async || {
        kept_since(&watcher).await == 0
    })
    .await;
}

/// Expiry is judged by the database's clock: moving the record's times
/// back in the database (as if its clock ran ahead of this server's) is
/// all it takes, while this process's clock has not moved. With answers
/// kept in memory (the default), a replay right after the move is still
/// answered from memory, and the record counts as absent once the store's
/// bound on keeping it has passed, measured by this process's monotonic
/// clock; with none kept, at once.
#[tokio::test]
async fn postgres_the_database_clock_decides_expiry() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    for kept in [Duration::ZERO, idem::DEFAULT_REPLAY_CACHE] {
        let store = idem_testkit::pg_store_in(&url, &schema, 2)
            .await
            .with_replay_cache(kept);
        let id = RecordId::new("t", "clock", format!("k-{}", kept.as_millis()));
        let first = take(&store, &id, "fp", LONG, LONG).await;
        store.complete(&id, &first.token, &response("old")).await.unwrap();
        assert_eq!(
            reserve(&store, &id, "fp", LONG, LONG).await,
            Reservation::Completed(response("old"))
        );
        let moved_at = Instant::now();
        let shift = format!(
            "UPDATE \"{schema}\".idempotency_keys SET created_at = now() - interval '2 hours', \
             expires_at = now() - interval '1 second' WHERE key = $1"
        );
        sqlx::query(sqlx::AssertSqlSafe(shift))
            .bind(&id.key)
            .execute(store.pool())
            .await
            .unwrap();
        if !kept.is_zero() {
            assert_eq!(
                reserve(&store, &id, "fp", LONG, LONG).await,
                Reservation::Completed(response("old")),
                "answered from memory"
            );
            // A duration, not an ordering: the bound on keeping it.
            tokio::time::sleep_until((moved_at + kept).into()).await;
        }
        let again = take(&store, &id, "fp", LONG, LONG).await;
        assert_eq!(again.attempt, 1, "a new operation");
        assert_ne!(again.operation_id, first.operation_id);
    }
}

/// A completed record's answer kept in memory after a lookup read it: the
/// stored answer, for that record only (tenant, scope and key), judged as
/// the store judges it (another fingerprint: a mismatch), in this store
/// and its clones only, and never past the record's retention by the
/// database's clock, however long the bound.
#[tokio::test]
async fn postgres_kept_answers_are_per_record_and_end_with_the_record() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let store = idem_testkit::pg_store_in(&url, &schema, 2)
        .await
        .with_replay_cache(Duration::from_secs(3600));
    let id = RecordId::new("t1", "kept", "k");
    let lease = take(&store, &id, "fp", LONG, LONG).await;
    store
        .complete(&id, &lease.token, &response("kept"))
        .await
        .unwrap();
    assert_eq!(
        reserve(&store, &id, "fp", LONG, LONG).await,
        Reservation::Completed(response("kept"))
    );
    // Gone from the table (by hand): what follows is answered from memory.
    let delete = format!("DELETE FROM \"{schema}\".idempotency_keys WHERE key = 'k'");
    sqlx::query(sqlx::AssertSqlSafe(delete.clone()))
        .execute(store.pool())
        .await
        .unwrap();
    let clone = store.clone();
    assert_eq!(
        reserve(&clone, &id, "fp", LONG, LONG).await,
        Reservation::Completed(response("kept"))
    );
    assert_eq!(
        reserve(&store, &id, "other", LONG, LONG).await,
        Reservation::Mismatch
    );
    for other in [
        RecordId::new("t2", "kept", "k"),
        RecordId::new("t1", "kept2", "k"),
        RecordId::new("t1", "kept", "k2"),
    ] {
        take(&store, &other, "fp", LONG, LONG).await;
    }
    // Another process's store reads the table.
    let elsewhere = idem_testkit::pg_store_in(&url, &schema, 2).await;
    take(&elsewhere, &id, "fp", LONG, LONG).await;

    // A record kept for 2 seconds: answered from memory until the
    // database's clock says it expired, then a new operation.
    sqlx::query(sqlx::AssertSqlSafe(delete))
        .execute(store.pool())
        .await
        .unwrap();
    let short = RecordId::new("t1", "kept", "short");
    let ttl = Duration::from_secs(2);
    let first = take(&store, &short, "fp", ttl, LONG).await;
    store
        .complete(&short, &first.token, &response("short"))
        .await
        .unwrap();
    assert_eq!(
        reserve(&store, &short, "fp", ttl, LONG).await,
        Reservation::Completed(response("short"))
    );
    let expired =
        format!("SELECT expires_at <= now() FROM \"{schema}\".idempotency_keys WHERE key = 'short'");
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let gone: bool = sqlx::query_scalar(sqlx::AssertSqlSafe(expired.clone()))
            .fetch_one(store.pool())
            .await
            .unwrap();
        if gone {
            break;
        }
        assert!(Instant::now() < until, "the record never expired");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let again = take(&store, &short, "fp", ttl, LONG).await;
    assert_eq!(again.attempt, 1, "a new operation");
    assert_ne!(again.operation_id, first.operation_id);
}

/// A fresh schema, and a store on it whose bound on what it knows
/// (`with_replay_cache`) is longer than any lock of these tests: the lock's
/// deadline, or the execution's write, ends what it knows.
async fn knowing_store(url: &str) -> (String, idem::PgStore) {
    let schema = idem_testkit::pg_schema(url).await;
    let store = idem_testkit::pg_store_in(url, &schema, 2)
        .await
        .with_replay_cache(LONG);
    (schema, store)
}

/// Runs `set` on the row of `id` in `schema`'s table, by hand (as an
/// operator would), and says how many rows it changed.
async fn edit_by_hand(store: &idem::PgStore, schema: &str, id: &RecordId, set: &str) -> u64 {
    let sql = format!(
        "UPDATE \"{schema}\".idempotency_keys SET {set} WHERE tenant = $1 AND scope = $2 AND key = $3"
    );
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(&id.tenant)
        .bind(&id.scope)
        .bind(&id.key)
        .execute(store.pool())
        .await
        .unwrap()
        .rows_affected()
}

/// Moves the lock of `key` past its deadline by hand: the database would
/// let any request take it over. What a request gets then says whether it
/// was answered from what the process knows (a 409) or by the database (a
/// takeover).
async fn stale_by_hand(store: &idem::PgStore, schema: &str, id: &RecordId) {
    let stale = "lock_expires_at = now() - interval '1 second'";
    assert_eq!(edit_by_hand(store, schema, id, stale).await, 1);
}

fn is_takeover(found: &Reservation) -> bool {
    matches!(found, Reservation::Reserved(lease) if lease.is_takeover())
}

/// A conflict with an execution of this process is answered from what the
/// process knows, from its reservation (a 409 with the lock left, a
/// mismatch for another fingerprint, in the store and its clones; never in
/// another process), until the execution's first write: from the
/// completion, release, rejection or hand-back on, the database answers,
/// at once.
#[tokio::test]
async fn postgres_a_conflict_with_this_process_execution_is_answered_from_memory_until_its_write() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let (schema, store) = knowing_store(&url).await;
    let lock = Duration::from_secs(30);
    let id = |key: &str| RecordId::new("t1", "running", key);

    let lease = take(&store, &id("a"), "fp", LONG, lock).await;
    stale_by_hand(&store, &schema, &id("a")).await;
    let Reservation::InProgress { retry_after } = reserve(&store.clone(), &id("a"), "fp", LONG, lock).await
    else {
        panic!("a conflict with this process's execution, answered from what it knows");
    };
    assert!(
        retry_after > Duration::from_secs(20) && retry_after <= lock,
        "{retry_after:?}"
    );
    assert_eq!(
        reserve(&store, &id("a"), "other", LONG, lock).await,
        Reservation::Mismatch
    );
    // Another tenant's record under the same key is another record.
    take(&store, &RecordId::new("t2", "running", "a"), "fp", LONG, lock).await;
    let live = "lock_expires_at = now() + interval '30 seconds'";
    assert_eq!(edit_by_hand(&store, &schema, &id("a"), live).await, 1);
    // Completed: replayed at once.
    store
        .complete(&id("a"), &lease.token, &response("a"))
        .await
        .unwrap();
    assert_eq!(
        reserve(&store, &id("a"), "fp", LONG, lock).await,
        Reservation::Completed(response("a"))
    );

    // Released as failed: the same request retries it at once.
    let b = take(&store, &id("b"), "fp", LONG, lock).await;
    store.release(&id("b"), &b.token).await.unwrap();
    let again = take(&store, &id("b"), "fp", LONG, lock).await;
    assert_eq!(again.attempt, 2);
    // Rejected: the key is free at once.
    let c = take(&store, &id("c"), "fp", LONG, lock).await;
    store.reject(&id("c"), &c.token).await.unwrap();
    assert_eq!(take(&store, &id("c"), "other", LONG, lock).await.attempt, 1);
    // Handed back: as it was found, at once.
    let d = take(&store, &id("d"), "fp", LONG, lock).await;
    store.hand_back(&id("d"), &d.token, false).await.unwrap();
    assert_eq!(take(&store, &id("d"), "fp", LONG, lock).await.attempt, 1);

    // Another process's store knows nothing of this one's executions: the
    // database answers it (here the lock moved by hand: a takeover).
    let e = take(&store, &id("e"), "fp", LONG, lock).await;
    stale_by_hand(&store, &schema, &id("e")).await;
    let elsewhere = idem_testkit::pg_store_in(&url, &schema, 2).await;
    assert!(is_takeover(
        &reserve(&elsewhere, &id("e"), "fp", LONG, lock).await
    ));
    // Its lock lost, this execution's heartbeat fails, and what this
    // process knew of it goes: the database answers (the other process's
    // execution holds it now).
    assert_eq!(
        store.extend_lock(&id("e"), &e.token, lock).await,
        Err(StoreError::LockLost)
    );
    stale_by_hand(&store, &schema, &id("e")).await;
    assert!(is_takeover(&reserve(&store, &id("e"), "fp", LONG, lock).await));
}

/// The completion drops what the process knows of its execution before
/// its statement is sent: stopped there, a conflict is the database's to
/// answer (here, a lock moved past its deadline by hand: a takeover, which
/// then fences the completion out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_completion_about_to_be_sent_leaves_conflicts_to_the_database() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let store = idem_testkit::pg_store_in(&url, &schema, 4)
        .await
        .with_replay_cache(LONG)
        .with_completion_turns(1);
    let (ids, _leases, _holders, turn, first) = hold_the_first_completion(&store, &url, &["sent"]).await;
    stale_by_hand(&store, &schema, &ids[0]).await;
    assert!(is_takeover(&reserve(&store, &ids[0], "fp", LONG, LONG).await));
    turn.resume();
    assert_eq!(first.await.unwrap(), Err(StoreError::LockLost));
}

/// Past the bound, a conflict with this process's execution is read from
/// the database, whose answer confirms it for the bound again (the record
/// still in progress under its token), as a successful heartbeat does; a
/// record found under another token (edited by hand) drops it.
#[tokio::test]
async fn postgres_this_process_execution_is_confirmed_by_the_database_past_the_bound() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let bound = idem::DEFAULT_REPLAY_CACHE;
    let store = idem_testkit::pg_store_in(&url, &schema, 2).await;
    let lock = Duration::from_secs(30);
    let id = |key: &str| RecordId::new("t1", "confirmed", key);
    let a = take(&store, &id("a"), "fp", LONG, lock).await;
    let b = take(&store, &id("b"), "fp", LONG, lock).await;
    let c = take(&store, &id("c"), "fp", LONG, lock).await;
    let _ = (&a, &c);
    // Not a wait for an ordering: the bound must pass.
    tokio::time::sleep(bound + Duration::from_millis(50)).await;

    // `a`: read from the database (in progress under its token), and so
    // confirmed.
    assert!(matches!(
        reserve(&store, &id("a"), "fp", LONG, lock).await,
        Reservation::InProgress { .. }
    ));
    stale_by_hand(&store, &schema, &id("a")).await;
    assert!(matches!(
        reserve(&store, &id("a"), "fp", LONG, lock).await,
        Reservation::InProgress { .. }
    ));
    // `b`: confirmed by its heartbeat.
    store.extend_lock(&id("b"), &b.token, lock).await.unwrap();
    stale_by_hand(&store, &schema, &id("b")).await;
    assert!(matches!(
        reserve(&store, &id("b"), "fp", LONG, lock).await,
        Reservation::InProgress { .. }
    ));
    // `c`: found under another token, dropped; the database answers from
    // then on.
    assert_eq!(
        edit_by_hand(&store, &schema, &id("c"), "lock_token = 'edited'").await,
        1
    );
    assert!(matches!(
        reserve(&store, &id("c"), "fp", LONG, lock).await,
        Reservation::InProgress { .. }
    ));
    stale_by_hand(&store, &schema, &id("c")).await;
    assert!(is_takeover(&reserve(&store, &id("c"), "fp", LONG, lock).await));
    // And with a zero bound nothing is known: the database answers.
    let off = idem_testkit::pg_store_in(&url, &schema, 2)
        .await
        .with_replay_cache(Duration::ZERO);
    take(&off, &id("d"), "fp", LONG, lock).await;
    stale_by_hand(&off, &schema, &id("d")).await;
    assert!(is_takeover(&reserve(&off, &id("d"), "fp", LONG, lock).await));
}

/// An execution reserved through a store and ended through a clone with
/// another bound (`with_replay_cache`) is ended in both: they share what
/// they know, so the store replays the completion at once.
#[tokio::test]
async fn postgres_an_execution_ended_through_a_clone_with_another_bound_is_ended_in_both() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let (_schema, store) = knowing_store(&url).await;
    let lock = Duration::from_secs(30);
    for (key, bound) in [("k-short", Duration::from_secs(1)), ("k-none", Duration::ZERO)] {
        let id = RecordId::new("t", "clones", key);
        let lease = take(&store, &id, "fp", LONG, lock).await;
        let clone = store.clone().with_replay_cache(bound);
        clone.complete(&id, &lease.token, &response(key)).await.unwrap();
        assert_eq!(
            reserve(&store, &id, "fp", LONG, lock).await,
            Reservation::Completed(response(key)),
            "{key}"
        );
    }
}

/// A heartbeat asking for a shorter lock than the reservation's may move
/// the deadline earlier: what the process knows of its execution is
/// dropped before it is sent, and the database answers from then on (here
/// a lock then moved past its deadline by hand: a takeover). One asking
/// for the same lock keeps it.
#[tokio::test]
async fn postgres_a_heartbeat_asking_for_a_shorter_lock_leaves_conflicts_to_the_database() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let (schema, store) = knowing_store(&url).await;
    let lock = Duration::from_secs(30);
    let id = |key: &str| RecordId::new("t1", "shorter", key);
    let same = take(&store, &id("same"), "fp", LONG, lock).await;
    store.extend_lock(&id("same"), &same.token, lock).await.unwrap();
    stale_by_hand(&store, &schema, &id("same")).await;
    assert!(matches!(
        reserve(&store, &id("same"), "fp", LONG, lock).await,
        Reservation::InProgress { .. }
    ));
    let shorter = take(&store, &id("shorter"), "fp", LONG, lock).await;
    store
        .extend_lock(&id("shorter"), &shorter.token, Duration::from_secs(20))
        .await
        .unwrap();
    stale_by_hand(&store, &schema, &id("shorter")).await;
    assert!(is_takeover(
        &reserve(&store, &id("shorter"), "fp", LONG, lock).await
    ));
}

/// A heartbeat counts the deadline from when it computes the row it
/// writes, not from when its statement arrived: one that waited for
/// another transaction's write of the row (another heartbeat's) computes
/// it again after that write. So a heartbeat written after another never
/// sets an earlier deadline, and the deadline a process counts from before
/// its last heartbeat was sent is never later than the database's.
#[tokio::test]
async fn postgres_a_heartbeat_counts_the_deadline_from_when_it_writes() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let store = idem_testkit::pg_store_in(&url, &schema, 2).await;
    let id = RecordId::new("t", "beat", "k");
    let lock = Duration::from_secs(30);
    let lease = take(&store, &id, "fp", LONG, lock).await;
    let holder = sqlx::PgPool::connect(&url).await.unwrap();
    let mut held = holder.begin().await.unwrap();
    // Another write of the row, not committed yet (as a heartbeat sent
    // earlier would be).
    let write =
        format!("UPDATE \"{schema}\".idempotency_keys SET recovery_point = recovery_point WHERE key = 'k'");
    sqlx::query(sqlx::AssertSqlSafe(write))
        .execute(&mut *held)
        .await
        .unwrap();
    let beat = tokio::spawn({
        let (store, id, token) = (store.clone(), id.clone(), lease.token.clone());
        async move { store.extend_lock(&id, &token, lock).await }
    });
    // Waiting on the row: seen by the database, not hoped for.
    let waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
                   AND query LIKE 'UPDATE%SET lock_expires_at%'";
    let until = Instant::now() + Duration::from_secs(10);
    while sqlx::query_scalar::<_, i64>(waiting)
        .fetch_one(&holder)
        .await
        .unwrap()
        == 0
    {
        assert!(Instant::now() < until, "the heartbeat never waited on the row");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Time passes while it waits: a deadline counted from its arrival
    // would be this much short of a lock timeout from its writing.
    tokio::time::sleep(Duration::from_millis(500)).await;
    held.commit().await.unwrap();
    beat.await.unwrap().unwrap();
    let left: f64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT date_part('epoch', lock_expires_at - clock_timestamp())::float8 \
         FROM \"{schema}\".idempotency_keys WHERE key = 'k'"
    )))
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert!(
        left > 29.7,
        "the deadline is {left} s away, not the lock timeout's 30 from the write"
    );
}

/// A store on the same table named the same way (`with_table`) shares what
/// the process knows; another table does not.
#[tokio::test]
async fn postgres_with_table_shares_what_is_known_for_the_same_table_only() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let (schema, store) = knowing_store(&url).await;
    let lock = Duration::from_secs(30);
    let id = RecordId::new("t", "tables", "k");
    let lease = take(&store, &id, "fp", LONG, lock).await;
    let same = store
        .clone()
        .with_table(Some(&schema), "idempotency_keys")
        .unwrap();
    same.complete(&id, &lease.token, &response("k")).await.unwrap();
    assert_eq!(
        reserve(&store, &id, "fp", LONG, lock).await,
        Reservation::Completed(response("k"))
    );
    // Another table: nothing known of this one's records.
    let other = store.clone().with_table(Some(&schema), "other_keys").unwrap();
    other.migrate().await.unwrap();
    take(&other, &id, "fp", LONG, lock).await;
}

#[tokio::test]
async fn sqlite_the_database_clock_decides_expiry() {
    let (store, _dir) = idem_testkit::sqlite_store().await;
    let id = RecordId::new("t", "clock", "k");
    let first = take(&store, &id, "fp", LONG, LONG).await;
    store.complete(&id, &first.token, &response("old")).await.unwrap();
    let shift = "UPDATE idempotency_keys SET expires_at = CAST(unixepoch('subsec') * 1000 AS INTEGER) - 1000";
    sqlx::query(shift).execute(store.pool()).await.unwrap();
    let again = take(&store, &id, "fp", LONG, LONG).await;
    assert_eq!(again.attempt, 1);
    assert_ne!(again.operation_id, first.operation_id);
}

/// Retention is exact on PostgreSQL whatever the session's time zone (a
/// timestamp difference in calendar days would gain or lose an hour across
/// a change of daylight saving).
#[tokio::test]
async fn postgres_retention_is_exact_in_a_time_zone_with_daylight_saving() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .after_connect(|conn, _| {
            Box::pin(async move {
                sqlx::Executor::execute(conn, "SET TIME ZONE 'America/New_York'").await?;
                Ok(())
            })
        })
        .connect(&url)
        .await
        .unwrap();
    let store = idem::PgStore::new(pool.clone())
        .with_table(Some(&schema), "idempotency_keys")
        .unwrap();
    store.migrate().await.unwrap();
    let id = RecordId::new("t", "s", "dst");
    let ttl = Duration::from_secs(200 * 86_400);
    let lease = take(&store, &id, "fp", ttl, LONG).await;
    store
        .complete(&id, &lease.token, &response("kept"))
        .await
        .unwrap();
    let kept: f64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT EXTRACT(EPOCH FROM (expires_at - created_at))::float8 FROM \"{schema}\".idempotency_keys"
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(kept, ttl.as_secs_f64());
}

/// What a reservation says of a record, for comparing two judgements: the
/// lease's attempt and whether it continues the stored operation, or the
/// answer, with the lock left where there is one.
fn judged(got: &Reservation) -> (String, Option<Duration>) {
    match got {
        Reservation::Reserved(lease) => (
            format!(
                "reserved: attempt {}, takeover {}, same operation {}",
                lease.attempt,
                lease.takeover,
                lease.operation_id == "op-stored"
            ),
            None,
        ),
        Reservation::Completed(stored) => (format!("completed {}", stored.status), None),
        Reservation::InProgress { retry_after } => ("in progress".into(), Some(*retry_after)),
        Reservation::Mismatch => ("mismatch".into(), None),
    }
}

/// The same, from the statement that judges in SQL alone (`takeable`,
/// `taken` and the lock left), as the store reads its row: run on `key`
/// with the fingerprint `fp` in a transaction rolled back, so that it
/// takes nothing.
async fn judged_in_sql(store: &idem::PgStore, key: &str, fp: &str) -> (String, Option<Duration>) {
    use sqlx::Row as _;
    let judging = store.request_statements().reserve.to_owned();
    let mut tx = store.pool().begin().await.unwrap();
    let row = sqlx::query(sqlx::AssertSqlSafe(judging))
        .bind("t")
        .bind("s")
        .bind(key)
        .bind(fp)
        .bind("tok-sql")
        .bind("op-sql")
        .bind(3_600_000_i64)
        .bind(3_600_000_i64)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    if let Some(taken) = row.get::<Option<Vec<Option<String>>>, _>("taken") {
        let taken: Vec<String> = taken.into_iter().map(Option::unwrap_or_default).collect();
        return (
            format!(
                "reserved: attempt {}, takeover {}, same operation {}",
                taken[0],
                taken[1] != "0",
                taken[3] == "op-stored"
            ),
            None,
        );
    }
    assert_eq!(
        row.get::<Option<i32>, _>("takeable"),
        Some(0),
        "neither taken nor judged"
    );
    if row.get::<&str, _>("fingerprint") != fp {
        ("mismatch".into(), None)
    } else if row.get::<&str, _>("state") == "completed" {
        (
            format!("completed {}", row.get::<i64, _>("response_status")),
            None,
        )
    } else {
        let left = row.get::<i64, _>("lock_left_ms");
        ("in progress".into(), Some(Duration::from_millis(left as u64)))
    }
}

/// Asserts that the store answers `key` for `fp` as [`judged_in_sql`]
/// says, the lock left included (judged a moment later: as much less,
/// never more).
async fn answers_as_sql_judges(store: &idem::PgStore, key: &str, fp: &str, case: &str) {
    let (expected, sql_left) = judged_in_sql(store, key, fp).await;
    let id = RecordId::new("t", "s", key);
    let (got, left) = judged(&reserve(store, &id, fp, LONG, LONG).await);
    assert_eq!(got, expected, "{case}");
    if let (Some(left), Some(sql_left)) = (left, sql_left) {
        assert!(
            left <= sql_left && sql_left - left < Duration::from_secs(5),
            "{case}: {left:?} left, SQL said {sql_left:?}"
        );
    }
}

/// Two records through the store: `done`, completed with the answer
/// "kept", and `running`, in progress under a lock an hour long; both
/// with the fingerprint "fp".
async fn done_and_running(store: &idem::PgStore) -> (RecordId, RecordId) {
    let done = RecordId::new("t", "s", "done");
    let lease = take(store, &done, "fp", LONG, LONG).await;
    store
        .complete(&done, &lease.token, &response("kept"))
        .await
        .unwrap();
    let running = RecordId::new("t", "s", "running");
    take(store, &running, "fp", LONG, LONG).await;
    (done, running)
}

/// Writes a record by hand: `state`, `fp` and `token` (SQL, or `NULL`),
/// with the lock, creation and expiry times given as SQL expressions, a
/// status of 201 and the operation id "op-stored".
async fn insert_record(
    store: &idem::PgStore,
    schema: &str,
    key: &str,
    (state, fp, token): (&str, &str, &str),
    (lock, created, expires): (&str, &str, &str),
) {
    let insert = format!(
        "INSERT INTO \"{schema}\".idempotency_keys (tenant, scope, key, fingerprint, state, \
         operation_id, lock_token, attempt, lock_expires_at, response_status, response_headers, \
         response_body, created_at, expires_at) VALUES ('t', 's', $1, '{fp}', '{state}', 'op-stored', \
         {token}, 1, {lock}, 201, '[]', 'b', {created}, {expires})"
    );
    sqlx::query(sqlx::AssertSqlSafe(insert))
        .bind(key)
        .execute(store.pool())
        .await
        .unwrap();
}

/// A reservation's first statement reads the record's columns as stored
/// and judges in Rust the records it can answer from; every other goes to
/// the statement that judges in SQL. Over every kind of row the table can
/// hold (each state, and one edited by hand; the same fingerprint or
/// another; a lock and an expiry ahead, just past and long past; a lock
/// token or none), the store answers exactly as that statement alone does
/// on the same row (run first in a transaction rolled back): a replay, a
/// conflict with its lock left, a mismatch, or the key taken with the same
/// attempt and operation.
#[tokio::test]
async fn postgres_the_lookup_answers_every_record_as_sql_judges_it() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let store = idem_testkit::pg_store_in(&url, &schema, 2).await;
    let times = [
        "now() + interval '1 hour'",
        "now() - interval '1 millisecond'",
        "now() - interval '3 hours'",
    ];
    let mut cases = 0;
    for state in ["completed", "in_progress", "edited"] {
        for stored_fp in ["fp", "other"] {
            for lock in times {
                for expires in times {
                    for token in ["'tok'", "NULL"] {
                        cases += 1;
                        let key = format!("judged-{cases}");
                        let case =
                            format!("{state}, {stored_fp}, lock {lock}, expiry {expires}, token {token}");
                        insert_record(
                            &store,
                            &schema,
                            &key,
                            (state, stored_fp, token),
                            (lock, "now() - interval '2 hours'", expires),
                        )
                        .await;
                        answers_as_sql_judges(&store, &key, "fp", &case).await;
                    }
                }
            }
        }
    }
    assert_eq!(cases, 108);
}

/// Times edited by hand to the infinities, which the statement that
/// judges in SQL cannot subtract: a lookup that can answer from the record
/// still does (a replay, a conflict whose lock never ends), and nothing
/// overflows.
#[tokio::test]
async fn postgres_a_record_whose_times_were_edited_to_infinity_is_still_answered() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let store = idem_testkit::pg_store_in(&url, &schema, 2).await;
    for (key, state, lock, expires) in [
        ("done", "completed", "'-infinity'", "'infinity'"),
        ("done-lock", "completed", "'infinity'", "'infinity'"),
        ("running", "in_progress", "'infinity'", "'infinity'"),
    ] {
        insert_record(
            &store,
            &schema,
            key,
            (state, "fp", "'tok'"),
            (lock, "now()", expires),
        )
        .await;
        let id = RecordId::new("t", "s", key);
        match (state, reserve(&store, &id, "fp", LONG, LONG).await) {
            ("completed", Reservation::Completed(stored)) => assert_eq!(stored.status, 201),
            ("in_progress", Reservation::InProgress { retry_after }) => {
                assert!(
                    retry_after > Duration::from_secs(100 * 365 * 86_400),
                    "{retry_after:?}"
                )
            }
            (_, got) => panic!("{key}: {got:?}"),
        }
        assert_eq!(
            reserve(&store, &id, "other", LONG, LONG).await,
            Reservation::Mismatch,
            "{key}"
        );
    }
}

/// A record whose creation time was edited by hand to `-infinity`, from
/// which PostgreSQL cannot subtract its expiry (the retention the rules
/// read): the janitor still purges the other records (one such row failed
/// every purge of the table), the row itself is kept (its retention cannot
/// be told), and its key is still taken once its lock has run out, its
/// retention counted afresh, so that its answer is stored.
#[tokio::test]
async fn postgres_a_record_whose_retention_cannot_be_told_holds_up_no_purge() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let store = idem_testkit::pg_store_in(&url, &schema, 2).await;
    for (key, state, created) in [
        ("expired", "completed", "now() - interval '2 days'"),
        ("edited", "in_progress", "'-infinity'"),
    ] {
        insert_record(
            &store,
            &schema,
            key,
            (state, "fp", "'tok'"),
            ("now() - interval '2 days'", created, "now() - interval '1 day'"),
        )
        .await;
    }
    assert_eq!(idem::purge_expired(&store, 100).await, Ok(1));
    let left: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT key FROM \"{schema}\".idempotency_keys ORDER BY key"
    )))
    .fetch_all(store.pool())
    .await
    .unwrap();
    assert_eq!(left, ["edited"]);
    // Its retention counted afresh from the takeover: the answer is
    // stored, and replayed (it was refused, and each retry ran again).
    let id = RecordId::new("t", "s", "edited");
    taken_over_and_completed(&store, &id, LONG).await;
    assert_eq!(
        store.reserve(req(&id, "fp", LONG, LONG)).await,
        Ok(Reservation::Completed(response("done")))
    );
}

/// Takes `id` over (its lock has run out) with a retention of `ttl`, and
/// stores `response("done")` as its answer.
async fn taken_over_and_completed(store: &idem::PgStore, id: &RecordId, ttl: Duration) {
    let taken = store.reserve(req(id, "fp", ttl, LONG)).await;
    let Ok(Reservation::Reserved(lease)) = taken else {
        panic!("not taken over: {taken:?}")
    };
    assert!(lease.is_takeover());
    assert_eq!(store.complete(id, &lease.token, &response("done")).await, Ok(()));
}

/// A record kept for ever by hand (`expires_at = 'infinity'`), whose
/// `purge_at` the janitor set from that expiry, is taken over once its
/// lock has run out, its retention counted afresh: once that retention has
/// passed, the janitor deletes it (it looked at it only at `infinity`).
#[tokio::test]
async fn postgres_a_retention_counted_afresh_is_purged_once_past() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let store = idem_testkit::pg_store_in(&url, &schema, 2).await;
    insert_record(
        &store,
        &schema,
        "forever",
        ("in_progress", "fp", "'tok'"),
        (
            "now() - interval '1 second'",
            "now() - interval '1 minute'",
            "'infinity'",
        ),
    )
    .await;
    // Its `purge_at`, not set yet, is set from the expiry: `infinity`.
    assert_eq!(idem::purge_expired(&store, 100).await, Ok(0));
    let id = RecordId::new("t", "s", "forever");
    taken_over_and_completed(&store, &id, Duration::from_millis(1)).await;
    // Until the answer's retention has passed by the database's clock.
    let past = format!("SELECT bool_and(expires_at < now()) FROM \"{schema}\".idempotency_keys");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !sqlx::query_scalar::<_, bool>(sqlx::AssertSqlSafe(past.clone()))
        .fetch_one(store.pool())
        .await
        .unwrap()
    {
        assert!(Instant::now() < deadline, "the retention never passed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(idem::purge_expired(&store, 100).await, Ok(1));
}

/// A lock edited by hand to `-infinity` has run out, and one edited to
/// `infinity` on a record past its retention changes nothing: the statement
/// that judges in SQL, which such rows go to, answers them (it failed on
/// the lock left, which PostgreSQL cannot subtract from an infinity, and
/// every request for the key got 503).
#[tokio::test]
async fn postgres_an_infinite_lock_is_judged_not_refused() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let store = idem_testkit::pg_store_in(&url, &schema, 2)
        .await
        .with_replay_cache(Duration::ZERO);
    for (key, state, lock, created, expires) in [
        (
            "ran-out",
            "in_progress",
            "'-infinity'",
            "now() - interval '1 minute'",
            "now() + interval '1 hour'",
        ),
        (
            "expired",
            "completed",
            "'infinity'",
            "now() - interval '2 days'",
            "now() - interval '1 day'",
        ),
    ] {
        insert_record(
            &store,
            &schema,
            key,
            (state, "fp", "'tok'"),
            (lock, created, expires),
        )
        .await;
    }
    let ran_out = RecordId::new("t", "s", "ran-out");
    assert_eq!(
        store.reserve(req(&ran_out, "other", LONG, LONG)).await,
        Ok(Reservation::Mismatch)
    );
    let taken = store.reserve(req(&ran_out, "fp", LONG, LONG)).await;
    assert!(
        matches!(&taken, Ok(Reservation::Reserved(l)) if l.is_takeover()),
        "{taken:?}"
    );
    let expired = RecordId::new("t", "s", "expired");
    let fresh = store.reserve(req(&expired, "other", LONG, LONG)).await;
    assert!(
        matches!(&fresh, Ok(Reservation::Reserved(l)) if !l.is_takeover() && l.attempt == 1),
        "{fresh:?}"
    );
}

/// A table whose columns were changed by hand (the status widened or
/// narrowed, NULL times where the
/// constraint was dropped), which `check_schema()` accepts: the lookup
/// leaves what it cannot read as idem's migrations made it to the
/// statement that judges in SQL, so a completed record is still replayed,
/// a running one still a 409, another body still a 422, never an error.
#[tokio::test]
async fn postgres_a_table_whose_columns_were_changed_by_hand_is_answered_as_before() {
    let Some(url) = idem_testkit::pg_url() else { return };
    for (case, alter, edit) in [
        ("status bigint", "ALTER TABLE {t} ALTER COLUMN response_status TYPE bigint", ""),
        ("status smallint", "ALTER TABLE {t} ALTER COLUMN response_status TYPE smallint", ""),
        (
            "NULL times",
            "ALTER TABLE {t} ALTER COLUMN lock_expires_at DROP NOT NULL, ALTER COLUMN expires_at DROP NOT NULL",
            "UPDATE {t} SET expires_at = NULL, lock_expires_at = NULL WHERE key = 'done'; \
             UPDATE {t} SET lock_expires_at = NULL WHERE key = 'running'",
        ),
    ] {
        let schema = idem_testkit::pg_schema(&url).await;
        // The lookup is what is tested, on rows edited by hand: a store
        // that keeps nothing in memory reads each answer.
        let store = idem_testkit::pg_store_in(&url, &schema, 2)
            .await
            .with_replay_cache(Duration::ZERO);
        let table = format!("\"{schema}\".idempotency_keys");
        sqlx::raw_sql(sqlx::AssertSqlSafe(alter.replace("{t}", &table)))
            .execute(store.pool())
            .await
            .unwrap();
        store.check_schema().await.expect("the table passes the schema check");
        done_and_running(&store).await;
        if !edit.is_empty() {
            sqlx::raw_sql(sqlx::AssertSqlSafe(edit.replace("{t}", &table)))
                .execute(store.pool())
                .await
                .unwrap();
        }
        for (key, fp) in [("done", "fp"), ("done", "other"), ("running", "fp"), ("running", "other")] {
            answers_as_sql_judges(&store, key, fp, &format!("{case}: {key}, {fp}")).await;
        }
    }
}

/// A replay, a 409 and a 422 are the lookup alone: with the reservation
/// function replaced by one that fails, a found record is still answered
/// (also past the executions after which PostgreSQL may plan the statement
/// once for all), and only a fresh key reaches the function.
#[tokio::test]
async fn postgres_a_found_record_is_answered_without_the_reservation_function() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let store = idem_testkit::pg_store_in(&url, &schema, 2).await;
    let (done, running) = done_and_running(&store).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE OR REPLACE FUNCTION \"{schema}\".idempotency_keys_take(text, text, text, text, text, text, \
         bigint, bigint) RETURNS text[] LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'called'; END $$"
    )))
    .execute(store.pool())
    .await
    .unwrap();
    for _ in 0..12 {
        assert_eq!(
            reserve(&store, &done, "fp", LONG, LONG).await,
            Reservation::Completed(response("kept"))
        );
        assert_eq!(
            reserve(&store, &done, "other", LONG, LONG).await,
            Reservation::Mismatch
        );
        assert!(matches!(
            reserve(&store, &running, "fp", LONG, LONG).await,
            Reservation::InProgress { .. }
        ));
    }
    let fresh = RecordId::new("t", "s", "fresh");
    let err = store.reserve(req(&fresh, "fp", LONG, LONG)).await.unwrap_err();
    assert!(err.to_string().contains("called"), "{err}");
}

/// A column's type or precision changed by hand while servers run, on
/// connections that have already prepared the reservation's statements:
/// PostgreSQL refuses a prepared statement whose result types changed, so
/// the lookup returns the status and the times cast to the types it reads,
/// and a replay, a 409 and a 422 are answered as before the change, on the
/// same connection.
#[tokio::test]
async fn postgres_a_column_type_changed_while_servers_run_changes_no_answer() {
    let Some(url) = idem_testkit::pg_url() else { return };
    for (case, alter) in [
        (
            "status bigint",
            "ALTER TABLE {t} ALTER COLUMN response_status TYPE bigint",
        ),
        (
            "status smallint",
            "ALTER TABLE {t} ALTER COLUMN response_status TYPE smallint",
        ),
        (
            "times to the millisecond",
            "ALTER TABLE {t} ALTER COLUMN lock_expires_at TYPE timestamptz(3), \
             ALTER COLUMN expires_at TYPE timestamptz(3)",
        ),
    ] {
        let schema = idem_testkit::pg_schema(&url).await;
        // One connection: every statement runs where it was prepared.
        let store = idem_testkit::pg_store_in(&url, &schema, 1).await;
        let (done, running) = done_and_running(&store).await;
        let answers = |when: &'static str| {
            let (store, done, running) = (&store, &done, &running);
            async move {
                for _ in 0..3 {
                    let replay = store.reserve(req(done, "fp", LONG, LONG)).await;
                    assert_eq!(
                        replay.ok(),
                        Some(Reservation::Completed(response("kept"))),
                        "{case}, {when}"
                    );
                    let conflict = store.reserve(req(running, "fp", LONG, LONG)).await;
                    assert!(
                        matches!(conflict, Ok(Reservation::InProgress { .. })),
                        "{case}, {when}: {conflict:?}"
                    );
                    let other = store.reserve(req(done, "other", LONG, LONG)).await;
                    assert_eq!(other.ok(), Some(Reservation::Mismatch), "{case}, {when}");
                }
            }
        };
        answers("before the change").await;
        let table = format!("\"{schema}\".idempotency_keys");
        sqlx::raw_sql(sqlx::AssertSqlSafe(alter.replace("{t}", &table)))
            .execute(store.pool())
            .await
            .unwrap();
        store
            .check_schema()
            .await
            .expect("the table passes the schema check");
        answers("after the change").await;
    }
}

/// A PostgreSQL store with `connections` connections and one turn to
/// write completions (so that one completion stopped at its turn makes
/// those after it queue), on a schema of its own, and `DATABASE_URL`;
/// `None` without it.
async fn pg_group_store(connections: u32) -> Option<(String, idem::PgStore)> {
    let url = idem_testkit::pg_url()?;
    let schema = idem_testkit::pg_schema(&url).await;
    let store = idem_testkit::pg_store_in(&url, &schema, connections)
        .await
        .with_completion_turns(1);
    Some((url, store))
}

/// Until `n` statements on `store`'s table wait on a row lock (a
/// condition, not an ordering).
async fn until_lock_waits(pool: &sqlx::PgPool, store: &idem::PgStore, n: i64) {
    until_statements_wait(pool, store, "UPDATE%", n).await;
}

/// Until `n` statements on `store`'s table whose text is like `like` wait
/// for a lock (a condition, not an ordering).
async fn until_statements_wait(pool: &sqlx::PgPool, store: &idem::PgStore, like: &str, n: i64) {
    let table = table_of(store);
    let schema = table.split('.').next().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
             AND query LIKE $2 AND query LIKE '%' || $1 || '%'",
        )
        .bind(schema)
        .bind(like)
        .fetch_one(pool)
        .await
        .unwrap();
        if waiting == n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{n} lock waits never seen (saw {waiting})"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Takes the keys `keys` of scope "group" on `store` (a store of one turn
/// to write, `with_completion_turns(1)`), and stops the first one's
/// completion at `pause::COMPLETE_TURN`, holding that turn: the
/// completions after it queue until the test resumes it.
/// Returns the ids, their leases, a pool for connections that hold rows,
/// the pause, and the first completion's task, stopped there by then.
async fn hold_the_first_completion(
    store: &idem::PgStore,
    url: &str,
    keys: &[&str],
) -> (
    Vec<RecordId>,
    Vec<Lease>,
    sqlx::PgPool,
    idem_runtime::pause::Pause,
    tokio::task::JoinHandle<Result<(), StoreError>>,
) {
    // Unique keys: a pause point is armed by key, for every test at once.
    let ids: Vec<RecordId> = keys
        .iter()
        .map(|k| RecordId::new("t", "group", idem_testkit::unique(k)))
        .collect();
    let mut leases = Vec::new();
    for id in &ids {
        leases.push(take(store, id, "fp", LONG, LONG).await);
    }
    let holders = sqlx::PgPool::connect(url).await.unwrap();
    let mut turn = idem_runtime::pause::arm(idem_runtime::pause::COMPLETE_TURN, &ids[0].key);
    let first = tokio::spawn({
        let (store, id, token) = (store.clone(), ids[0].clone(), leases[0].token.clone());
        async move { store.complete(&id, &token, &response("first")).await }
    });
    tokio::time::timeout(Duration::from_secs(10), turn.reached())
        .await
        .expect("the first completion never took the turn");
    (ids, leases, holders, turn, first)
}

/// Spawns the completion of `id` with `token`.
fn complete_in_task(
    store: &idem::PgStore,
    id: &RecordId,
    token: &str,
) -> tokio::task::JoinHandle<Result<(), StoreError>> {
    let (store, id, token) = (store.clone(), id.clone(), token.to_owned());
    tokio::spawn(async move { store.complete(&id, &token, &response(&id.key)).await })
}

/// Until `n` completions wait in `store`'s queue.
async fn until_waiting(store: &idem::PgStore, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.waiting_completions() != n {
        assert!(Instant::now() < deadline, "{n} completions never waited");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Spawns the completion of each (id, token) in turn, each queued before
/// the next is spawned.
async fn queue_completions(
    store: &idem::PgStore,
    completions: &[(&RecordId, &str)],
) -> Vec<tokio::task::JoinHandle<Result<(), StoreError>>> {
    let before = store.waiting_completions();
    let mut tasks = Vec::new();
    for (n, (id, token)) in completions.iter().enumerate() {
        tasks.push(complete_in_task(store, id, token));
        until_waiting(store, before + n + 1).await;
    }
    tasks
}

/// [`queue_completions`] of the second and third records, each with its
/// own lease (the first holds the turn).
async fn queue_the_second_and_third(
    store: &idem::PgStore,
    ids: &[RecordId],
    leases: &[Lease],
) -> [tokio::task::JoinHandle<Result<(), StoreError>>; 2] {
    queue_completions(store, &[(&ids[1], &leases[1].token), (&ids[2], &leases[2].token)])
        .await
        .try_into()
        .unwrap_or_else(|_| unreachable!("two completions queued"))
}

/// Each record's state and the clock its completion was written at
/// (`created_at`, which the completion sets to its statement's time).
async fn written_at(store: &idem::PgStore, id: &RecordId) -> (String, String) {
    column_and_clock(store, id, "state").await
}

/// A record's `column` and its `created_at`, as text.
async fn column_and_clock<T>(store: &idem::PgStore, id: &RecordId, column: &str) -> (T, String)
where
    T: for<'r> sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> + Send + Unpin,
{
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {column}, created_at::text FROM {} WHERE tenant = $1 AND scope = $2 AND key = $3",
        table_of(store)
    )))
    .bind(&id.tenant)
    .bind(&id.scope)
    .bind(&id.key)
    .fetch_one(store.pool())
    .await
    .unwrap()
}

/// Asserts that each of `ids` is completed.
async fn all_completed(store: &idem::PgStore, ids: &[RecordId]) {
    for id in ids {
        assert_eq!(written_at(store, id).await.0, "completed", "{}", id.key);
    }
}

/// Completions that arrive while one is being written wait for it, and are
/// then written together, by one statement (one statement time for all),
/// each answered with its own outcome: a completion whose lock is lost is
/// told so, and its record left as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_completions_that_queue_are_written_as_one_group() {
    let Some((url, store)) = pg_group_store(4).await else {
        return;
    };
    let (ids, leases, _holders, turn, first) =
        hold_the_first_completion(&store, &url, &["held", "b", "c", "d"]).await;
    let [b, c, d]: [_; 3] = queue_completions(
        &store,
        &[
            (&ids[1], &leases[1].token),
            (&ids[2], "not-its-token"),
            (&ids[3], &leases[3].token),
        ],
    )
    .await
    .try_into()
    .unwrap();
    turn.resume();
    assert_eq!(first.await.unwrap(), Ok(()));
    assert_eq!(b.await.unwrap(), Ok(()));
    assert_eq!(c.await.unwrap(), Err(StoreError::LockLost));
    assert_eq!(d.await.unwrap(), Ok(()));
    let (held, b, c, d) = (
        written_at(&store, &ids[0]).await,
        written_at(&store, &ids[1]).await,
        written_at(&store, &ids[2]).await,
        written_at(&store, &ids[3]).await,
    );
    assert_eq!(
        (held.0.as_str(), b.0.as_str(), c.0.as_str(), d.0.as_str()),
        ("completed", "completed", "in_progress", "completed")
    );
    assert_eq!(b.1, d.1, "b and d written by one statement");
    assert_ne!(held.1, b.1, "the first written alone, before them");
    for (i, id) in ids.iter().enumerate().filter(|(i, _)| *i != 2) {
        let replay = store.reserve(req(id, "fp", LONG, LONG)).await.unwrap();
        let tag = if i == 0 { "first" } else { id.key.as_str() };
        assert_eq!(replay, Reservation::Completed(response(tag)), "{}", id.key);
    }
    assert_eq!(store.waiting_completions(), 0);
}

/// A store writes up to three completions at once (its default turns):
/// three stopped at their turns hold them all, the two that come next
/// queue and are written together by one statement once the three go on;
/// then every turn is free again, and three more each take one at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_three_completions_are_written_at_once_and_the_rest_queue() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let store = idem_testkit::pg_store_in(&url, &schema, 6).await;
    for round in 0..2 {
        let ids: Vec<RecordId> = (0..5)
            .map(|i| RecordId::new("t", "turns", idem_testkit::unique(&format!("r{round}-{i}"))))
            .collect();
        let mut leases = Vec::new();
        for id in &ids {
            leases.push(take(&store, id, "fp", LONG, LONG).await);
        }
        let mut turns = Vec::new();
        let mut holders = Vec::new();
        for (id, lease) in ids.iter().zip(&leases).take(3) {
            let mut turn = idem_runtime::pause::arm(idem_runtime::pause::COMPLETE_TURN, &id.key);
            holders.push(complete_in_task(&store, id, &lease.token));
            tokio::time::timeout(Duration::from_secs(10), turn.reached())
                .await
                .unwrap_or_else(|_| panic!("round {round}: {} found no free turn", id.key));
            turns.push(turn);
        }
        assert_eq!(store.waiting_completions(), 0, "round {round}");
        let queued = queue_completions(
            &store,
            &[(&ids[3], &leases[3].token), (&ids[4], &leases[4].token)],
        )
        .await;
        assert!(
            queued.iter().all(|q| !q.is_finished()),
            "round {round}: written past three at once"
        );
        for turn in turns {
            turn.resume();
        }
        for task in holders.into_iter().chain(queued) {
            assert_eq!(task.await.unwrap(), Ok(()), "round {round}");
        }
        let mut written = Vec::new();
        for id in &ids {
            let (state, at) = written_at(&store, id).await;
            assert_eq!(state, "completed", "round {round}: {}", id.key);
            written.push(at);
        }
        assert_eq!(
            written[3], written[4],
            "round {round}: the queued two written by one statement"
        );
        assert_eq!(store.waiting_completions(), 0, "round {round}");
    }
}

/// A completion whose caller gave up while it waited for its group is not
/// written; the rest of its group is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_completion_given_up_on_in_the_queue_is_not_written() {
    let Some((url, store)) = pg_group_store(4).await else {
        return;
    };
    let (ids, leases, _holders, turn, first) =
        hold_the_first_completion(&store, &url, &["held", "gone", "kept"]).await;
    let gone = complete_in_task(&store, &ids[1], &leases[1].token);
    until_waiting(&store, 1).await;
    gone.abort();
    assert!(gone.await.unwrap_err().is_cancelled());
    let kept = complete_in_task(&store, &ids[2], &leases[2].token);
    until_waiting(&store, 2).await;
    turn.resume();
    assert_eq!(first.await.unwrap(), Ok(()));
    assert_eq!(kept.await.unwrap(), Ok(()));
    assert_eq!(written_at(&store, &ids[1]).await.0, "in_progress");
    assert_eq!(written_at(&store, &ids[2]).await.0, "completed");
    // Its lock is still the caller's: completed again, it is written.
    store
        .complete(&ids[1], &leases[1].token, &response("gone"))
        .await
        .unwrap();
    assert_eq!(written_at(&store, &ids[1]).await.0, "completed");
}

/// A completion that the database refuses (here a trigger) fails its
/// group's statement; every completion of the group is then written alone,
/// so that it fails only itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_completion_refused_in_a_group_fails_only_itself() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let store = idem_testkit::pg_store_in(&url, &schema, 4)
        .await
        .with_completion_turns(1);
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE FUNCTION \"{schema}\".refuse() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN RAISE EXCEPTION 'refused'; END $$; \
         CREATE TRIGGER refuse BEFORE UPDATE ON \"{schema}\".idempotency_keys FOR EACH ROW \
         WHEN (NEW.key LIKE 'refused%' AND NEW.state = 'completed') EXECUTE FUNCTION \"{schema}\".refuse()"
    )))
    .execute(store.pool())
    .await
    .unwrap();
    let (ids, leases, _holders, turn, first) =
        hold_the_first_completion(&store, &url, &["held", "b", "refused", "d"]).await;
    let queued: Vec<(&RecordId, &str)> = (1..4).map(|i| (&ids[i], leases[i].token.as_str())).collect();
    let tasks = queue_completions(&store, &queued).await;
    turn.resume();
    assert_eq!(first.await.unwrap(), Ok(()));
    let answers: Vec<Result<(), StoreError>> = futures_util::future::join_all(tasks)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(answers[0], Ok(()));
    assert!(
        matches!(&answers[1], Err(e) if !e.is_unavailable() && e.to_string().contains("refused")),
        "{:?}",
        answers[1]
    );
    assert_eq!(answers[2], Ok(()));
    let (b, refused, d) = (
        written_at(&store, &ids[1]).await,
        written_at(&store, &ids[2]).await,
        written_at(&store, &ids[3]).await,
    );
    assert_eq!(
        (b.0.as_str(), refused.0.as_str(), d.0.as_str()),
        ("completed", "in_progress", "completed")
    );
    assert_ne!(b.1, d.1, "written alone, after the group failed");
}

/// A completion whose own row is free is not held up by another of its
/// group whose row a transaction holds: it is answered, completed, while
/// that row is still held, and the held one is written once it is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_held_row_in_a_group_holds_up_only_its_own_completion() {
    let Some((url, store)) = pg_group_store(6).await else {
        return;
    };
    let (ids, leases, holders, turn, first) =
        hold_the_first_completion(&store, &url, &["held", "free", "locked"]).await;
    let peer = hold_row(&holders, &store, &ids[2]).await;
    let [free, locked] = queue_the_second_and_third(&store, &ids, &leases).await;
    turn.resume();
    assert_eq!(first.await.unwrap(), Ok(()));
    // The other row is still held: the free one's answer comes regardless.
    assert_eq!(free.await.unwrap(), Ok(()));
    assert_eq!(written_at(&store, &ids[1]).await.0, "completed");
    assert!(
        !locked.is_finished(),
        "the held row's completion waits for its row"
    );
    peer.commit().await.unwrap();
    assert_eq!(locked.await.unwrap(), Ok(()));
    assert_eq!(written_at(&store, &ids[2]).await.0, "completed");
}

/// A clone with a longer timeout does not queue behind a clone with a
/// shorter one: its completion, waiting on its held row, is bounded by its
/// own timeout, not cut off by the other's (and then written anyway).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_clone_with_another_timeout_completes_within_its_own() {
    let Some((url, base)) = pg_group_store(6).await else {
        return;
    };
    let short = base.clone().with_timeout(Duration::from_secs(3));
    let long = base.clone().with_timeout(Duration::from_secs(30));
    let (ids, leases, holders, turn, first) =
        hold_the_first_completion(&short, &url, &["short", "long"]).await;
    let long_holder = hold_row(&holders, &base, &ids[1]).await;
    let waiter = complete_in_task(&long, &ids[1], &leases[1].token);
    until_lock_waits(&holders, &base, 1).await;
    turn.resume();
    assert_eq!(first.await.unwrap(), Ok(()));
    // Past the short clone's timeout (a bound to exceed, not an ordering).
    tokio::time::sleep(Duration::from_millis(3500)).await;
    assert!(!waiter.is_finished(), "still waiting, within its own 30 s");
    long_holder.commit().await.unwrap();
    assert_eq!(waiter.await.unwrap(), Ok(()));
}

/// A store used from a current-thread runtime that is not driven once its
/// `block_on` returns, and from a multi-thread one: no completion ever
/// waits on a task of the idle runtime. Each completion from the
/// current-thread runtime is written alone, so a completion from the other
/// runtime, made while it waits on a held row, is answered at once.
#[test]
fn postgres_a_completion_never_waits_on_a_runtime_that_is_not_driven() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let driven = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (store, holders, ids, leases) = driven.block_on(async {
        let schema = idem_testkit::pg_schema(&url).await;
        let store = idem_testkit::pg_store_in(&url, &schema, 4)
            .await
            .with_timeout(Duration::from_secs(2));
        // Every connection opened on the driven runtime.
        let mut conns = Vec::new();
        for _ in 0..4 {
            conns.push(store.pool().acquire().await.unwrap());
        }
        drop(conns);
        let holders = sqlx::PgPool::connect(&url).await.unwrap();
        let ids: Vec<RecordId> = ["x", "y", "z"]
            .iter()
            .map(|k| RecordId::new("t", "idle", *k))
            .collect();
        let mut leases = Vec::new();
        for id in &ids {
            leases.push(take(&store, id, "fp", LONG, LONG).await);
        }
        (store, holders, ids, leases)
    });
    let holder = driven.block_on(hold_row(&holders, &store, &ids[0]));
    let (go, went) = std::sync::mpsc::channel::<()>();
    let (done, answered) = std::sync::mpsc::channel();
    let idle = {
        let (store, id, token) = (store.clone(), ids[0].clone(), leases[0].token.clone());
        std::thread::spawn(move || {
            let idle = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            done.send(idle.block_on(store.complete(&id, &token, &response("x"))))
                .unwrap();
            // Alive, but not driven, until told.
            went.recv().unwrap();
            drop(idle);
        })
    };
    driven.block_on(until_lock_waits(&holders, &store, 1));
    let y = {
        let _runtime = driven.enter();
        complete_in_task(&store, &ids[1], &leases[1].token)
    };
    assert_eq!(driven.block_on(y).unwrap(), Ok(()), "while x waits on its row");
    driven.block_on(holder.commit()).unwrap();
    assert_eq!(answered.recv().unwrap(), Ok(()));
    // The idle runtime is not driven now.
    let z = driven.block_on(store.complete(&ids[2], &leases[2].token, &response("z")));
    assert_eq!(z, Ok(()));
    go.send(()).unwrap();
    idle.join().unwrap();
}

/// Completions whose rows the group found held are written by their own
/// callers, each waiting for its own row: the task writing groups never
/// waits on a row lock, so a completion that comes after them, of a row
/// nobody holds, is answered at once while those rows are still held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_held_rows_of_a_group_hold_up_no_later_completion() {
    let Some((url, store)) = pg_group_store(8).await else {
        return;
    };
    let (ids, leases, holders, turn, first) =
        hold_the_first_completion(&store, &url, &["held", "h1", "h2", "free"]).await;
    let peers = (
        hold_row(&holders, &store, &ids[1]).await,
        hold_row(&holders, &store, &ids[2]).await,
    );
    let [h1, h2] = queue_the_second_and_third(&store, &ids, &leases).await;
    turn.resume();
    assert_eq!(first.await.unwrap(), Ok(()));
    // The group skipped both rows: each caller now waits on its own.
    until_lock_waits(&holders, &store, 2).await;
    let free = complete_in_task(&store, &ids[3], &leases[3].token);
    assert_eq!(free.await.unwrap(), Ok(()), "answered while h1 and h2 are held");
    assert!(!h1.is_finished() && !h2.is_finished());
    peers.0.commit().await.unwrap();
    peers.1.commit().await.unwrap();
    assert_eq!(h1.await.unwrap(), Ok(()));
    assert_eq!(h2.await.unwrap(), Ok(()));
    all_completed(&store, &ids[1..]).await;
}

/// The completion that takes the store's turn, finding its row held by
/// another transaction, waits for it holding the turn no longer than a
/// turn (`TURN_HELD_MAX`, 100 ms): the completions after it, of rows
/// nobody holds, are written while its row is still held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_held_row_holds_the_turn_no_longer_than_a_turn() {
    let Some((url, store)) = pg_group_store(6).await else {
        return;
    };
    let ids: Vec<RecordId> = ["x", "a", "b"]
        .iter()
        .map(|k| RecordId::new("t", "turn", *k))
        .collect();
    let mut leases = Vec::new();
    for id in &ids {
        leases.push(take(&store, id, "fp", LONG, LONG).await);
    }
    let holders = sqlx::PgPool::connect(&url).await.unwrap();
    let x_holder = hold_row(&holders, &store, &ids[0]).await;
    let x = complete_in_task(&store, &ids[0], &leases[0].token);
    until_lock_waits(&holders, &store, 1).await;
    let (a, b) = (
        complete_in_task(&store, &ids[1], &leases[1].token),
        complete_in_task(&store, &ids[2], &leases[2].token),
    );
    assert_eq!(a.await.unwrap(), Ok(()), "while x's row is held");
    assert_eq!(b.await.unwrap(), Ok(()), "while x's row is held");
    assert!(!x.is_finished());
    x_holder.commit().await.unwrap();
    assert_eq!(x.await.unwrap(), Ok(()));
    all_completed(&store, &ids).await;
}

/// A group whose callers have all given up is not written: its statement
/// is bounded by its members' own deadlines, so a group that waited for a
/// connection past them is dropped unsent, and the callers' retries write
/// the records themselves (not `LockLost`, as after a late write).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_group_is_not_written_past_its_callers_deadlines() {
    let Some((url, store)) = pg_group_store(3).await else {
        return;
    };
    // Tested connections only: the store keeps none of its own, so that
    // with the pool's taken, nothing it sends gets one.
    let store = store
        .with_timeout(Duration::from_secs(1))
        .with_tested_connections(true);
    let (ids, leases, _holders, turn, first) =
        hold_the_first_completion(&store, &url, &["first", "a", "b"]).await;
    let [a, b] = queue_the_second_and_third(&store, &ids, &leases).await;
    // Every connection of the store's pool taken: nothing it sends now
    // gets one.
    let mut taken = Vec::new();
    for _ in 0..3 {
        taken.push(store.pool().acquire().await.unwrap());
    }
    turn.resume();
    for (task, what) in [(first, "first"), (a, "a"), (b, "b")] {
        let answer = task.await.unwrap();
        assert!(
            matches!(&answer, Err(e) if e.is_unavailable()),
            "{what}: {answer:?}"
        );
    }
    drop(taken);
    for i in 1..3 {
        assert_eq!(
            store
                .complete(&ids[i], &leases[i].token, &response(&ids[i].key))
                .await,
            Ok(()),
            "{}: its retry writes it",
            ids[i].key
        );
    }
}

/// A group carries at most 1 MiB of answers (the completions queued behind
/// its statement wait for all of it, and PostgreSQL refuses a message over
/// 1 GiB): the completions that queued are taken in order while their
/// bodies fit, at least one a group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_group_carries_at_most_one_mebibyte_of_answers() {
    let Some((url, store)) = pg_group_store(6).await else {
        return;
    };
    let (ids, leases, _holders, turn, first) =
        hold_the_first_completion(&store, &url, &["first", "big1", "big2", "small"]).await;
    let mut tasks = Vec::new();
    for i in 1..4 {
        let big = i < 3;
        let (clone, id, token) = (store.clone(), ids[i].clone(), leases[i].token.clone());
        tasks.push(tokio::spawn(async move {
            let mut answer = response(&id.key);
            if big {
                answer.body = Some(vec![b'x'; 600 << 10]);
            }
            clone.complete(&id, &token, &answer).await
        }));
        until_waiting(&store, i).await;
    }
    turn.resume();
    assert_eq!(first.await.unwrap(), Ok(()));
    for task in tasks {
        assert_eq!(task.await.unwrap(), Ok(()));
    }
    let at: Vec<String> = futures_util::future::join_all(ids[1..].iter().map(|id| written_at(&store, id)))
        .await
        .into_iter()
        .map(|(state, at)| {
            assert_eq!(state, "completed");
            at
        })
        .collect();
    assert_ne!(at[0], at[1], "1.2 MiB do not fit one group: big1 alone");
    assert_eq!(at[1], at[2], "big2 and the small one fit one group");
}

/// A completion whose answer (body and headers) is over 1 MiB is written alone at once: it
/// neither queues behind the turn nor takes it, so that no other
/// completion waits for its bytes (a 64 MiB body took 1.5 s to write, and
/// the completions queued behind it failed with a short store timeout). An
/// answer of 1 MiB still queues.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_large_answer_is_written_alone_at_once() {
    let Some((url, store)) = pg_group_store(6).await else {
        return;
    };
    let (ids, leases, _holders, turn, first) =
        hold_the_first_completion(&store, &url, &["first", "large", "fits", "turn", "headed"]).await;
    // An answer of `len` bytes in all: its headers' names and values, and
    // its body.
    let with_body = |key: &str, len: usize| {
        let r = response(key);
        let headers: usize = r.headers.iter().map(|(n, v)| n.len() + v.len()).sum();
        StoredResponse {
            body: Some(vec![b'x'; len - headers]),
            ..r
        }
    };
    // Written, within a bound that a completion held at the turn (or
    // queued behind it, which nothing resumes) would not meet.
    let at_once = |i: usize, answer: StoredResponse| {
        let (store, id, token) = (store.clone(), ids[i].clone(), leases[i].token.clone());
        async move { tokio::time::timeout(Duration::from_secs(30), store.complete(&id, &token, &answer)).await }
    };
    // While the turn is held: not queued.
    assert_eq!(
        at_once(1, with_body(&ids[1].key, (1 << 20) + 1)).await,
        Ok(Ok(())),
        "written while the turn is held"
    );
    assert_eq!(store.waiting_completions(), 0);
    // Headers count with the body.
    let headed = StoredResponse {
        headers: vec![("x-large".to_owned(), vec![b'h'; 1 << 20])],
        ..response(&ids[4].key)
    };
    assert_eq!(
        at_once(4, headed).await,
        Ok(Ok(())),
        "large headers written while the turn is held"
    );
    assert_eq!(store.waiting_completions(), 0);
    let fits = tokio::spawn(at_once(2, with_body(&ids[2].key, 1 << 20)));
    until_waiting(&store, 1).await;
    turn.resume();
    assert_eq!(first.await.unwrap(), Ok(()));
    assert_eq!(fits.await.unwrap(), Ok(Ok(())));
    // The turn free, a large one does not take it: its pause point, which
    // would hold it there, is never reached.
    let _never = idem_runtime::pause::arm(idem_runtime::pause::COMPLETE_TURN, &ids[3].key);
    assert_eq!(
        at_once(3, with_body(&ids[3].key, 2 << 20)).await,
        Ok(Ok(())),
        "written without taking the turn"
    );
    all_completed(&store, &ids).await;
}

/// A store whose operations have no bound (`Duration::MAX`) completes,
/// written at once and queued in a group alike (a deadline past what the
/// clock can tell is no panic).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_store_without_a_bound_completes() {
    let Some((url, store)) = pg_group_store(4).await else {
        return;
    };
    let store = store.with_timeout(Duration::MAX);
    let (ids, leases, _holders, turn, first) =
        hold_the_first_completion(&store, &url, &["first", "a", "b"]).await;
    let [a, b] = queue_the_second_and_third(&store, &ids, &leases).await;
    turn.resume();
    for task in [first, a, b] {
        assert_eq!(task.await.unwrap(), Ok(()));
    }
    all_completed(&store, &ids).await;
}

/// The backfill of `purge_at` takes at most half of a purge call's store
/// timeout, each of its statements cut there: with each taking 0.45 of
/// the timeout, the delete 0.2 of it, and an earlier build writing rows
/// without `purge_at` between calls (two each), every call answers, and
/// the expired row goes.
#[tokio::test]
async fn postgres_the_backfill_takes_at_most_half_of_a_purge_call() {
    let timeout = Duration::from_secs(1);
    let Some((pool, schema, store)) = pg_store_within(timeout).await else {
        return;
    };
    let t = format!("\"{schema}\".idempotency_keys");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE FUNCTION \"{schema}\".slow_set() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN PERFORM pg_sleep(0.45); RETURN NULL; END $$; \
         CREATE FUNCTION \"{schema}\".slow_delete() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN PERFORM pg_sleep(0.2); RETURN NULL; END $$; \
         CREATE TRIGGER slow_set BEFORE UPDATE ON {t} FOR EACH STATEMENT EXECUTE FUNCTION \"{schema}\".slow_set(); \
         CREATE TRIGGER slow_delete BEFORE DELETE ON {t} FOR EACH STATEMENT EXECUTE FUNCTION \"{schema}\".slow_delete(); \
         INSERT INTO {t} (tenant, scope, key, fingerprint, state, operation_id, attempt, lock_expires_at, \
         created_at, expires_at, purge_at) VALUES ('t', 's', 'expired', 'fp', 'completed', 'op', 1, \
         now() - interval '1 hour', now() - interval '2 hours', now() - interval '1 hour', now() - interval '1 hour')"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let mut answers = Vec::new();
    for call in 0..4 {
        // An earlier build's rows, without `purge_at`, live for an hour.
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {t} (tenant, scope, key, fingerprint, state, operation_id, attempt, lock_expires_at, \
             created_at, expires_at) SELECT 't', 's', 'old-{call}-' || n, 'fp', 'completed', 'op', 1, \
             now() + interval '1 hour', now(), now() + interval '1 hour' FROM generate_series(1, 2) AS n"
        )))
        .execute(&pool)
        .await
        .unwrap();
        let started = Instant::now();
        let purged = store.purge_expired(1).await;
        answers.push((
            purged.as_ref().map_err(|e| e.to_string()).cloned(),
            started.elapsed(),
        ));
    }
    let left: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {t} WHERE key = 'expired'"
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(left, 0, "the expired row was never purged: {answers:?}");
    assert!(
        answers.iter().all(|(a, _)| a.is_ok()),
        "a backfill of at most half the timeout leaves the 0.2 s delete room: {answers:?}"
    );
    assert_eq!(
        answers.iter().filter(|(a, _)| a == &Ok(1)).count(),
        1,
        "{answers:?}"
    );
}

/// A purge of a batch of 0 (the public store API; the janitor asks at least
/// 1) removes nothing and answers at once in every store, one without a
/// timeout included.
#[tokio::test]
async fn a_purge_of_batch_zero_ends() {
    let mem = idem::MemoryStore::new();
    assert_eq!(mem.purge_expired(0).await.unwrap(), 0);
    let (lite, _dir) = idem_testkit::sqlite_store().await;
    let bounded = lite.clone().with_timeout(Duration::from_secs(2));
    let started = Instant::now();
    assert_eq!(bounded.purge_expired(0).await, Ok(0));
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    let unbounded = lite.with_timeout(Duration::MAX);
    let answer = tokio::time::timeout(Duration::from_secs(5), unbounded.purge_expired(0)).await;
    assert_eq!(
        answer,
        Ok(Ok(0)),
        "sqlite, no timeout: purge_expired(0) still running after 5 s"
    );
    if let Some(url) = idem_testkit::pg_url() {
        let schema = idem_testkit::pg_schema(&url).await;
        let pg = idem_testkit::pg_store_in(&url, &schema, 2)
            .await
            .with_timeout(Duration::MAX);
        let answer = tokio::time::timeout(Duration::from_secs(5), pg.purge_expired(0)).await;
        assert_eq!(answer, Ok(Ok(0)), "postgres, no timeout");
    }
}

/// A store of its own schema that keeps nothing in memory: every
/// reservation is a lookup (see [`hold_the_lookup_turns`]).
async fn pg_lookup_store() -> Option<(String, idem::PgStore)> {
    let (url, store) = pg_group_store(8).await?;
    Some((url, store.with_replay_cache(Duration::ZERO)))
}

/// [`pg_lookup_store`] whose operations are bounded by half a second.
async fn pg_lookup_store_bounded() -> Option<(String, idem::PgStore)> {
    let (url, store) = pg_lookup_store().await?;
    Some((url, store.with_timeout(Duration::from_millis(500))))
}

/// Takes `id` and completes it with `response("done")`.
async fn complete_as_done(store: &idem::PgStore, id: &RecordId) {
    let lease = take(store, id, "fp", LONG, LONG).await;
    store.complete(id, &lease.token, &response("done")).await.unwrap();
}

/// A fresh id of the scope these tests use.
fn lookup_id(k: &str) -> RecordId {
    RecordId::new("t", "lookups", idem_testkit::unique(k))
}

/// Holds both of `store`'s turns to look up: the reservations of `keys`
/// (two records completed first, so that their lookups insert nothing),
/// each stopped at `pause::RESERVE_TURN`, before its statement. The
/// lookups after them queue until the test resumes one. Returns the
/// pauses and the two reservations' tasks.
async fn hold_the_lookup_turns(
    store: &idem::PgStore,
) -> (
    [idem_runtime::pause::Pause; 2],
    [tokio::task::JoinHandle<Result<Reservation, StoreError>>; 2],
) {
    let mut pauses = Vec::new();
    let mut tasks = Vec::new();
    for k in ["turn-1", "turn-2"] {
        let id = lookup_id(k);
        let lease = take(store, &id, "fp", LONG, LONG).await;
        store.complete(&id, &lease.token, &response(k)).await.unwrap();
        let mut pause = idem_runtime::pause::arm(idem_runtime::pause::RESERVE_TURN, &id.key);
        tasks.push(reserve_in_task(store, &id, "fp"));
        tokio::time::timeout(Duration::from_secs(10), pause.reached())
            .await
            .expect("the lookup never took a turn");
        pauses.push(pause);
    }
    let (Ok(pauses), Ok(tasks)) = (pauses.try_into(), tasks.try_into()) else {
        unreachable!("two of each")
    };
    (pauses, tasks)
}

/// Lets the second of [`hold_the_lookup_turns`]'s lookups go on, and waits
/// for both (the first was let go before).
async fn let_the_turns_go(
    second: idem_runtime::pause::Pause,
    held: [tokio::task::JoinHandle<Result<Reservation, StoreError>>; 2],
) {
    second.resume();
    for task in held {
        let _ = task.await.unwrap();
    }
}

/// Every connection of `store`'s pool but one, held until dropped.
async fn all_connections_but_one(store: &idem::PgStore) -> Vec<sqlx::pool::PoolConnection<sqlx::Postgres>> {
    let mut busy = Vec::new();
    for _ in 1..store.pool().options().get_max_connections() {
        busy.push(store.pool().acquire().await.unwrap());
    }
    busy
}

/// Spawns the reservation of `id` with `fingerprint` (and a fresh token).
fn reserve_in_task(
    store: &idem::PgStore,
    id: &RecordId,
    fingerprint: &str,
) -> tokio::task::JoinHandle<Result<Reservation, StoreError>> {
    let (store, id, fingerprint) = (store.clone(), id.clone(), fingerprint.to_owned());
    tokio::spawn(async move { store.reserve(req(&id, &fingerprint, LONG, LONG)).await })
}

/// Spawns the reservation of each (id, fingerprint) in turn, each queued
/// for a group before the next is spawned.
async fn queue_reservations(
    store: &idem::PgStore,
    reservations: &[(&RecordId, &str)],
) -> Vec<tokio::task::JoinHandle<Result<Reservation, StoreError>>> {
    let before = store.waiting_lookups();
    let mut tasks = Vec::new();
    for (n, (id, fingerprint)) in reservations.iter().enumerate() {
        tasks.push(reserve_in_task(store, id, fingerprint));
        let deadline = Instant::now() + Duration::from_secs(10);
        while store.waiting_lookups() != before + n + 1 {
            assert!(
                Instant::now() < deadline,
                "{} lookups never waited",
                before + n + 1
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    tasks
}

/// A record's lock token and the clock its reservation was written at.
async fn taken_at(store: &idem::PgStore, id: &RecordId) -> (Option<String>, String) {
    column_and_clock(store, id, "lock_token").await
}

/// Reservations that arrive while the store's turns to look up are held
/// wait, and are then looked up together by one statement, each answered
/// as its lookup alone would be: fresh keys taken under their own tokens
/// (by one statement: one clock for both), a completed record replayed, a
/// record in progress a conflict, another fingerprint a mismatch. Two
/// reservations of one key are never in one group: the second waits for
/// the next, and finds the record the first took.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_reservations_that_queue_are_looked_up_as_one_group() {
    // Every answer from the database: none kept, no execution known.
    let Some((_url, store)) = pg_lookup_store().await else {
        return;
    };
    let id = lookup_id;
    let (b, c, done, running, other) = (id("b"), id("c"), id("done"), id("running"), id("other"));
    for record in [&done, &other] {
        let lease = take(&store, record, "fp", LONG, LONG).await;
        store
            .complete(record, &lease.token, &response(&record.key))
            .await
            .unwrap();
    }
    take(&store, &running, "fp", LONG, LONG).await;
    let (turns, held) = hold_the_lookup_turns(&store).await;
    let queued = queue_reservations(
        &store,
        &[
            (&c, "fp"),
            (&b, "fp"),
            (&c, "fp"),
            (&done, "fp"),
            (&running, "fp"),
            (&other, "another fingerprint"),
        ],
    )
    .await;
    // One turn goes to the group; the other stays held until the group
    // has answered, so that the second reservation of c waits for the
    // group after it.
    let [first, second] = turns;
    first.resume();
    let mut answers = Vec::new();
    for task in queued {
        answers.push(task.await.unwrap().expect("an answer"));
    }
    second.resume();
    for task in held {
        assert!(matches!(task.await.unwrap(), Ok(Reservation::Completed(_))));
    }
    let lease = |r: &Reservation| match r {
        Reservation::Reserved(lease) => lease.clone(),
        other => panic!("expected a reservation, got {other:?}"),
    };
    let (c_lease, b_lease) = (lease(&answers[0]), lease(&answers[1]));
    assert!(
        matches!(answers[2], Reservation::InProgress { .. }),
        "the second reservation of a key is a conflict: {:?}",
        answers[2]
    );
    assert_eq!(answers[3], Reservation::Completed(response(&done.key)));
    assert!(
        matches!(answers[4], Reservation::InProgress { .. }),
        "{:?}",
        answers[4]
    );
    assert_eq!(answers[5], Reservation::Mismatch);
    let (b_row, c_row) = (taken_at(&store, &b).await, taken_at(&store, &c).await);
    assert_eq!(
        b_row.0.as_deref(),
        Some(b_lease.token.as_str()),
        "b under its own token"
    );
    assert_eq!(
        c_row.0.as_deref(),
        Some(c_lease.token.as_str()),
        "c under its own token"
    );
    assert_eq!(b_row.1, c_row.1, "b and c taken by one statement");
    assert_eq!(store.waiting_lookups(), 0);
}

/// A group whose statement the database refuses (here a trigger refuses
/// one record) rolls back whole, and each of its reservations is then
/// looked up alone: the refused one fails, the others are taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_group_the_database_refuses_is_looked_up_alone_by_each() {
    let Some((_url, store)) = pg_lookup_store().await else {
        return;
    };
    let table = table_of(&store);
    let schema = table.split('.').next().unwrap();
    for ddl in [
        format!(
            "CREATE FUNCTION {schema}.refuse_poison() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN IF NEW.key LIKE 'poison%' THEN RAISE EXCEPTION 'poison refused'; END IF; RETURN NEW; END $$"
        ),
        format!("CREATE TRIGGER refuse_poison BEFORE INSERT ON {table} FOR EACH ROW EXECUTE FUNCTION {schema}.refuse_poison()"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(ddl)).execute(store.pool()).await.unwrap();
    }
    let (a, poison, z) = (lookup_id("a"), lookup_id("poison"), lookup_id("z"));
    let (turns, held) = hold_the_lookup_turns(&store).await;
    let queued = queue_reservations(&store, &[(&a, "fp"), (&poison, "fp"), (&z, "fp")]).await;
    for turn in turns {
        turn.resume();
    }
    for task in held {
        assert!(matches!(task.await.unwrap(), Ok(Reservation::Completed(_))));
    }
    let [a_answer, poison_answer, z_answer]: [_; 3] = queued.try_into().unwrap();
    assert!(matches!(a_answer.await.unwrap(), Ok(Reservation::Reserved(_))));
    let refused = poison_answer.await.unwrap();
    assert!(
        matches!(&refused, Err(StoreError::Backend { .. }))
            && format!("{refused:?}").contains("poison refused"),
        "{refused:?}"
    );
    assert!(matches!(z_answer.await.unwrap(), Ok(Reservation::Reserved(_))));
    let (a_row, z_row) = (taken_at(&store, &a).await, taken_at(&store, &z).await);
    assert_ne!(a_row.1, z_row.1, "a and z taken alone, each by its own statement");
    assert_eq!(store.waiting_lookups(), 0);
}

/// A group whose statement waits (here for the table's lock, held by a
/// test connection) does not hold up the lookups queued behind it past its
/// callers' bound: they give up with 503's error, the queue goes on (a
/// replay queued behind it is answered while the lock is still held), and
/// once the statement commits, the keys it took for callers that gave up
/// are handed back: a retry takes them at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_group_that_waits_holds_up_no_one_past_the_bound_and_gives_back_what_it_took() {
    let Some((url, store)) = pg_lookup_store_bounded().await else {
        return;
    };
    let (x, y, done) = (lookup_id("x"), lookup_id("y"), lookup_id("done"));
    complete_as_done(&store, &done).await;
    let ([first, second], held) = hold_the_lookup_turns(&store).await;
    let holders = sqlx::PgPool::connect(&url).await.unwrap();
    let mut holder = holders.begin().await.unwrap();
    // Inserts wait for it; lookups that insert nothing do not.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "LOCK TABLE {} IN SHARE MODE",
        table_of(&store)
    )))
    .execute(&mut *holder)
    .await
    .unwrap();
    let [x_answer, y_answer]: [_; 2] = queue_reservations(&store, &[(&x, "fp"), (&y, "fp")])
        .await
        .try_into()
        .unwrap();
    // The replay queued below waits past x's and y's bound, not past its
    // own: it queues a margin later than they did.
    tokio::time::sleep(Duration::from_millis(200)).await;
    // The first turn's lookup answers; its turn goes to the group of x
    // and y, which waits for the table's lock.
    // (Each paused lookup's caller may have given up meanwhile: its
    // turn is held until its statement answers all the same.)
    first.resume();
    let [first_task, second_task] = held;
    let _ = first_task.await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.waiting_lookups() != 0 {
        assert!(Instant::now() < deadline, "the group was never taken");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // Both turns held (the group's and the second paused lookup's): a
    // replay queues, and is answered once the group's bound has passed,
    // while the lock is still held.
    let [replay]: [_; 1] = queue_reservations(&store, &[(&done, "fp")])
        .await
        .try_into()
        .unwrap();
    let replayed = tokio::time::timeout(Duration::from_secs(10), replay)
        .await
        .expect("the queue went on past the waiting group")
        .unwrap();
    assert_eq!(replayed, Ok(Reservation::Completed(response("done"))));
    for answer in [x_answer, y_answer] {
        let given_up = tokio::time::timeout(Duration::from_secs(10), answer)
            .await
            .expect("the callers' bound ends their wait")
            .unwrap();
        assert!(
            matches!(given_up, Err(StoreError::Unavailable { .. })),
            "{given_up:?}"
        );
    }
    second.resume();
    let _ = second_task.await.unwrap();
    holder.commit().await.unwrap();
    // The group's statement commits now; x and y are given back by the
    // callers' reservations, which run on to their answer.
    let store = store.with_timeout(Duration::from_secs(10));
    for key in [&x, &y] {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match store.reserve(req(key, "fp", LONG, LONG)).await.unwrap() {
                Reservation::Reserved(_) => break,
                other => {
                    assert!(
                        Instant::now() < deadline,
                        "{} never given back: {other:?}",
                        key.key
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
    }
}

/// Until `n` lookups (statements starting `SELECT`) on `store`'s table
/// wait for a lock (a condition, not an ordering).
async fn until_lookups_wait(pool: &sqlx::PgPool, store: &idem::PgStore, n: i64) {
    until_statements_wait(pool, store, "SELECT%", n).await;
}

/// A transaction on `pool` holding `store`'s table in SHARE mode (what a
/// plain `CREATE INDEX` takes): inserts wait for it, reads do not.
async fn hold_the_table(
    pool: &sqlx::PgPool,
    store: &idem::PgStore,
) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut holder = pool.begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "LOCK TABLE {} IN SHARE MODE",
        table_of(store)
    )))
    .execute(&mut *holder)
    .await
    .unwrap();
    holder
}

/// Two first requests whose lookups wait for the table's lock hold the
/// store's two turns only for `TURN_HELD_MAX`: a replay that needs no lock,
/// coming right after, is answered within its bound, not refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_lookups_that_wait_for_a_lock_do_not_hold_up_a_replay() {
    let Some((url, store)) = pg_lookup_store_bounded().await else {
        return;
    };
    let (done, f1, f2) = (lookup_id("done"), lookup_id("f1"), lookup_id("f2"));
    complete_as_done(&store, &done).await;
    let holders = sqlx::PgPool::connect(&url).await.unwrap();
    let holder = hold_the_table(&holders, &store).await;
    let _f1 = reserve_in_task(&store, &f1, "fp");
    let _f2 = reserve_in_task(&store, &f2, "fp");
    until_lookups_wait(&holders, &store, 2).await;
    let replay = store.reserve(req(&done, "fp", LONG, LONG)).await;
    holder.rollback().await.unwrap();
    assert_eq!(replay, Ok(Reservation::Completed(response("done"))));
}

/// Two first requests whose keys another transaction inserted and has not
/// committed wait for it, and hold the store's two turns only for
/// `TURN_HELD_MAX`: an unrelated fresh key is taken meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_lookups_that_wait_for_a_row_do_not_hold_up_other_keys() {
    let Some((url, store)) = pg_lookup_store_bounded().await else {
        return;
    };
    let (k1, k2, other) = (lookup_id("k1"), lookup_id("k2"), lookup_id("other"));
    let holders = sqlx::PgPool::connect(&url).await.unwrap();
    let holder = insert_uncommitted(&holders, &store, &[&k1, &k2]).await;
    let _t1 = reserve_in_task(&store, &k1, "fp");
    let _t2 = reserve_in_task(&store, &k2, "fp");
    until_lookups_wait(&holders, &store, 2).await;
    let taken = store.reserve(req(&other, "fp", LONG, LONG)).await;
    holder.rollback().await.unwrap();
    assert!(matches!(taken, Ok(Reservation::Reserved(_))), "{taken:?}");
}

/// A replay grouped with a fresh key whose insert waits for the table's
/// lock is not held up by it: the group's statement waits for a lock at
/// most `GROUP_LOCK_WAIT`, then each of its lookups runs alone, and the
/// replay is answered within its bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_replay_grouped_with_an_insert_that_waits_is_answered() {
    let Some((url, store)) = pg_lookup_store_bounded().await else {
        return;
    };
    let (done, fresh) = (lookup_id("done"), lookup_id("fresh"));
    complete_as_done(&store, &done).await;
    let ([first, second], held) = hold_the_lookup_turns(&store).await;
    let holders = sqlx::PgPool::connect(&url).await.unwrap();
    let holder = hold_the_table(&holders, &store).await;
    let [_fresh, replay]: [_; 2] = queue_reservations(&store, &[(&fresh, "fp"), (&done, "fp")])
        .await
        .try_into()
        .unwrap();
    first.resume();
    let replay = replay.await.unwrap();
    holder.rollback().await.unwrap();
    let_the_turns_go(second, held).await;
    assert_eq!(replay, Ok(Reservation::Completed(response("done"))));
}

/// The lock waits of a group count together: a replay grouped with ten
/// fresh keys, each inserted and not committed by a transaction of its own
/// that ends 60 ms after the group starts waiting for it (no wait reaching
/// `GROUP_LOCK_WAIT` alone), is answered within its bound: the group is
/// refused once its waits add up to it, and each lookup runs alone.
///
/// Once they run alone, the lookups of the fresh keys whose transactions
/// are still open wait for them, each on a connection of its own: the pool
/// has one for each lookup, so that the replay's never waits for one of
/// theirs (with fewer, the replay got a connection only when it happened
/// to ask before them, and was refused otherwise, the pool's to blame and
/// not the group's bound).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_groups_lock_waits_add_up_to_one_bound() {
    let Some((url, store)) = pg_group_store(16).await else {
        return;
    };
    let store = store
        .with_replay_cache(Duration::ZERO)
        .with_timeout(Duration::from_millis(500));
    let done = lookup_id("done");
    complete_as_done(&store, &done).await;
    let fresh: Vec<RecordId> = (0..10).map(|i| lookup_id(&format!("f{i}"))).collect();
    let holders = sqlx::postgres::PgPoolOptions::new()
        .max_connections(12)
        .connect(&url)
        .await
        .unwrap();
    let mut held = Vec::new();
    for k in &fresh {
        let mut tx = insert_uncommitted(&holders, &store, &[k]).await;
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        held.push((pid, Some(tx)));
    }
    let ([first, second], turns) = hold_the_lookup_turns(&store).await;
    let mut queue: Vec<(&RecordId, &str)> = fresh.iter().map(|k| (k, "fp")).collect();
    queue.push((&done, "fp"));
    let replay = queue_reservations(&store, &queue).await.pop().unwrap();
    first.resume();
    let table = table_of(&store);
    let schema = table.split('.').next().unwrap();
    // Each transaction the group waits for ends 60 ms later.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !replay.is_finished() && held.iter().any(|(_, tx)| tx.is_some()) {
        assert!(Instant::now() < deadline, "the replay never answered");
        let blockers: Vec<i32> = sqlx::query_scalar(
            "SELECT unnest(pg_blocking_pids(pid)) FROM pg_stat_activity \
             WHERE query LIKE '%idem-group%' AND query LIKE '%' || $1 || '%'",
        )
        .bind(schema)
        .fetch_all(&holders)
        .await
        .unwrap();
        let blocking = held
            .iter_mut()
            .find(|(pid, tx)| tx.is_some() && blockers.contains(pid));
        match blocking {
            Some((_, tx)) => {
                tokio::time::sleep(Duration::from_millis(60)).await;
                tx.take().unwrap().rollback().await.unwrap();
            }
            None => tokio::time::sleep(Duration::from_millis(2)).await,
        }
    }
    for (_, tx) in held {
        if let Some(tx) = tx {
            tx.rollback().await.unwrap();
        }
    }
    let replayed = replay.await.unwrap();
    let_the_turns_go(second, turns).await;
    assert_eq!(replayed, Ok(Reservation::Completed(response("done"))));
}

/// A group's records that exist are read apart from its fresh keys'
/// inserts: a replay grouped with an insert that is slow for a reason no
/// lock timeout bounds (here a trigger that sleeps; a stalled disk, a
/// synchronous standby) is answered within its bound, as it is alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_replay_grouped_with_a_slow_insert_is_answered() {
    let Some((_url, store)) = pg_lookup_store_bounded().await else {
        return;
    };
    slow_inserts(&store, 1.0).await;
    let (done, slow, fresh) = (lookup_id("done"), lookup_id("slow"), lookup_id("fresh"));
    complete_as_done(&store, &done).await;
    let ([first, second], held) = hold_the_lookup_turns(&store).await;
    let [slow_task, replay, fresh_task]: [_; 3] =
        queue_reservations(&store, &[(&slow, "fp"), (&done, "fp"), (&fresh, "fp")])
            .await
            .try_into()
            .unwrap();
    first.resume();
    assert_eq!(
        replay.await.unwrap(),
        Ok(Reservation::Completed(response("done")))
    );
    second.resume();
    for task in held.into_iter().chain([slow_task, fresh_task]) {
        let _ = task.await.unwrap();
    }
}

/// A trigger on `store`'s table that sleeps `seconds` before inserting a
/// key that starts with `slow`: an insert slowed by what no lock timeout
/// bounds (a stalled disk, a synchronous standby).
async fn slow_inserts(store: &idem::PgStore, seconds: f64) {
    let table = table_of(store);
    let schema = table.split('.').next().unwrap();
    for ddl in [
        format!(
            "CREATE FUNCTION {schema}.slow_insert() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN IF NEW.key LIKE 'slow%' THEN PERFORM pg_sleep({seconds}); END IF; RETURN NEW; END $$"
        ),
        format!(
            "CREATE TRIGGER slow_insert BEFORE INSERT ON {table} FOR EACH ROW EXECUTE FUNCTION {schema}.slow_insert()"
        ),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(ddl)).execute(store.pool()).await.unwrap();
    }
}

/// Until a statement on `store`'s table whose text is like `query_like`
/// waits for `wait_event` (a condition, not an ordering).
async fn until_waiting_on(pool: &sqlx::PgPool, store: &idem::PgStore, wait_event: &str, query_like: &str) {
    let table = table_of(store);
    let schema = table.split('.').next().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event = $1 AND query LIKE $2 \
             AND query LIKE '%' || $3 || '%'",
        )
        .bind(wait_event)
        .bind(query_like)
        .bind(schema)
        .fetch_one(pool)
        .await
        .unwrap();
        if n > 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "never saw {wait_event} on {query_like}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// A group's slow statement that commits its fresh keys before the read
/// apart takes its snapshot (the pool busy: the read waits for a
/// connection, and gets the statement's once it is done) is not read back
/// as conflicts of themselves: each fresh key is taken, as alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_slow_groups_own_inserts_are_not_read_back_as_conflicts() {
    let Some((_url, store)) = pg_lookup_store().await else {
        return;
    };
    slow_inserts(&store, 0.3).await;
    let (slow, fresh) = (lookup_id("slow"), lookup_id("fresh"));
    let ([first, second], held) = hold_the_lookup_turns(&store).await;
    let queued = queue_reservations(&store, &[(&slow, "fp"), (&fresh, "fp")]).await;
    // All but one of the pool's connections in use elsewhere.
    let busy = all_connections_but_one(&store).await;
    first.resume();
    let mut answers = Vec::new();
    for task in queued {
        answers.push(task.await.unwrap());
    }
    drop(busy);
    let_the_turns_go(second, held).await;
    for answer in &answers {
        assert!(matches!(answer, Ok(Reservation::Reserved(_))), "{answer:?}");
    }
}

/// The read apart does not hold up the slow statement's own answers: a
/// read queued behind a migration's lock, which itself queued behind the
/// slow insert, is not waited for once the statement has answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_slow_groups_answers_are_not_held_up_by_the_read_apart() {
    let Some((url, store)) = pg_lookup_store().await else {
        return;
    };
    let store = store.with_timeout(Duration::from_secs(1));
    slow_inserts(&store, 0.3).await;
    let (slow, fresh) = (lookup_id("slow"), lookup_id("fresh"));
    let ([first, second], held) = hold_the_lookup_turns(&store).await;
    let queued = queue_reservations(&store, &[(&slow, "fp"), (&fresh, "fp")]).await;
    // The read waits for a connection until the migration's lock has queued.
    let mut busy = all_connections_but_one(&store).await;
    let watcher = sqlx::PgPool::connect(&url).await.unwrap();
    first.resume();
    until_waiting_on(&watcher, &store, "PgSleep", "%idem-group%").await;
    let (granted, is_granted) = tokio::sync::oneshot::channel::<()>();
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    let migration = {
        let (url, table) = (url.clone(), table_of(&store));
        tokio::spawn(async move {
            let pool = sqlx::PgPool::connect(&url).await.unwrap();
            let mut tx = pool.begin().await.unwrap();
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE"
            )))
            .execute(&mut *tx)
            .await
            .unwrap();
            let _ = granted.send(());
            let _ = released.await;
            tx.rollback().await.unwrap();
        })
    };
    until_waiting_on(&watcher, &store, "relation", "LOCK TABLE%").await;
    drop(busy.pop());
    // The statement has committed once the migration holds the table.
    tokio::time::timeout(Duration::from_secs(10), is_granted)
        .await
        .unwrap()
        .unwrap();
    let mut answers = Vec::new();
    for task in queued {
        answers.push(task.await.unwrap());
    }
    let _ = release.send(());
    migration.await.unwrap();
    drop(busy);
    let_the_turns_go(second, held).await;
    for answer in &answers {
        assert!(matches!(answer, Ok(Reservation::Reserved(_))), "{answer:?}");
    }
}

/// A memory-store request of `id` with the token `token`.
fn memory_req<'a>(id: &'a RecordId, token: &'a str, ttl: Duration, lock: Duration) -> ReserveRequest<'a> {
    ReserveRequest {
        id,
        fingerprint: "F",
        token,
        ttl,
        lock_timeout: lock,
    }
}

/// A memory store no janitor runs on holds no more than about four times
/// the most records it has held within their retention, plus the 768
/// expired ones its 256 shards' smallest tables hold (README,
/// "Housekeeping"): here never more than one record is within its
/// retention (each completed with a TTL of 1 ms, the next reserved only
/// once that has passed), through 4,000 records.
#[tokio::test]
async fn memory_without_a_janitor_holds_what_its_bound_says() {
    let store = idem::MemoryStore::new();
    let ttl = Duration::from_millis(1);
    let key = idem_testkit::unique("bound");
    let mut most = 0;
    for i in 0..4_000 {
        let id = RecordId::new("t", "bound", format!("{key}-{i}"));
        let token = format!("x{i}");
        let reserved = store.reserve(memory_req(&id, &token, ttl, LONG)).await.unwrap();
        assert!(matches!(reserved, Reservation::Reserved(_)), "{reserved:?}");
        store.complete(&id, &token, &response(&key)).await.unwrap();
        let completed = Instant::now();
        // Past its retention before the next is reserved: a deadline.
        while completed.elapsed() <= ttl {
            std::thread::sleep(Duration::from_micros(200));
        }
        most = most.max(store.len());
    }
    assert!(most <= 4 + 3 * 256, "held {most} records at once");
}

/// A memory-store record past its TTL whose lock is live is neither
/// evicted (by the purge, or by the sweeps of full shards) nor taken by a
/// second request; its completion is stored and replayed.
#[tokio::test]
async fn memory_an_expired_record_with_a_live_lock_survives_eviction() {
    let store = idem::MemoryStore::new();
    let key = idem_testkit::unique("live");
    let rid = RecordId::new("t", "evict", key.as_str());
    let live = memory_req(&rid, "first", Duration::from_millis(1), LONG);
    assert!(matches!(
        store.reserve(live).await.unwrap(),
        Reservation::Reserved(_)
    ));
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(store.purge_expired(1000).await.unwrap(), 0);
    // Enough records through every shard to make each sweep, twice: a
    // first wave expired and released, then a second wave.
    let short = Duration::from_millis(1);
    for i in 0..50_000 {
        let other = RecordId::new("t", "evict", format!("{key}-fill{i}"));
        let _ = store
            .reserve(memory_req(&other, "x", short, short))
            .await
            .unwrap();
        let _ = store.release(&other, "x").await;
    }
    std::thread::sleep(Duration::from_millis(20));
    for i in 0..50_000 {
        let other = RecordId::new("t", "evict", format!("{key}-more{i}"));
        let _ = store.reserve(memory_req(&other, "y", LONG, LONG)).await.unwrap();
    }
    let second = store
        .reserve(ReserveRequest {
            token: "second",
            ..live
        })
        .await
        .unwrap();
    assert!(matches!(second, Reservation::InProgress { .. }), "{second:?}");
    let other_body = ReserveRequest {
        token: "third",
        fingerprint: "G",
        ..live
    };
    assert_eq!(store.reserve(other_body).await.unwrap(), Reservation::Mismatch);
    store.complete(&rid, "first", &response(&key)).await.unwrap();
    assert_eq!(
        store
            .reserve(ReserveRequest {
                token: "fourth",
                ..live
            })
            .await
            .unwrap(),
        Reservation::Completed(response(&key))
    );
}

/// A memory-store record evicted between its reservation and its
/// completion: every write of the old token is refused (`LockLost`),
/// before and after a new request takes the key, whose answer stands.
#[tokio::test]
async fn memory_a_record_evicted_before_its_completion_fences_the_old_token() {
    let store = idem::MemoryStore::new();
    let rid = RecordId::new("t", "evict", idem_testkit::unique("evicted"));
    let short = Duration::from_millis(1);
    assert!(matches!(
        store.reserve(memory_req(&rid, "t1", short, short)).await.unwrap(),
        Reservation::Reserved(_)
    ));
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(store.purge_expired(1000).await.unwrap(), 1);
    assert_eq!(
        store.complete(&rid, "t1", &response("old")).await,
        Err(StoreError::LockLost)
    );
    assert_eq!(store.release(&rid, "t1").await, Err(StoreError::LockLost));
    assert_eq!(
        store.extend_lock(&rid, "t1", LONG).await,
        Err(StoreError::LockLost)
    );
    let Reservation::Reserved(lease) = store.reserve(memory_req(&rid, "t2", LONG, LONG)).await.unwrap()
    else {
        panic!("the key is not taken afresh")
    };
    assert_eq!(lease.attempt, 1);
    assert_eq!(
        store.complete(&rid, "t1", &response("old")).await,
        Err(StoreError::LockLost)
    );
    assert_eq!(store.reject(&rid, "t1").await, Err(StoreError::LockLost));
    assert!(matches!(
        store.reserve(memory_req(&rid, "t3", LONG, LONG)).await.unwrap(),
        Reservation::InProgress { .. }
    ));
    store.complete(&rid, "t2", &response("new")).await.unwrap();
    assert_eq!(
        store.reserve(memory_req(&rid, "t4", LONG, LONG)).await.unwrap(),
        Reservation::Completed(response("new"))
    );
}

/// Requests racing the purge of their expired memory-store records: each
/// is a fresh reservation (attempt 1), never the expired answer, an error
/// or a half-removed record.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_requests_racing_the_purge_of_their_expired_records_start_afresh() {
    let store = std::sync::Arc::new(idem::MemoryStore::new());
    let ids: Vec<RecordId> = (0..2000)
        .map(|i| RecordId::new("t", "evict", idem_testkit::unique(&format!("rp{i}"))))
        .collect();
    for id in &ids {
        let r = memory_req(id, "t", Duration::from_millis(30), LONG);
        assert!(matches!(
            store.reserve(r).await.unwrap(),
            Reservation::Reserved(_)
        ));
        store.complete(id, "t", &response(&id.key)).await.unwrap();
    }
    std::thread::sleep(Duration::from_millis(40));
    let purger = {
        let store = store.clone();
        tokio::spawn(async move {
            let mut n = 0;
            for _ in 0..100 {
                n += store.purge_expired(50).await.unwrap();
                tokio::task::yield_now().await;
            }
            n
        })
    };
    for id in &ids {
        match store.reserve(memory_req(id, "again", LONG, LONG)).await.unwrap() {
            Reservation::Reserved(l) => assert_eq!(l.attempt, 1),
            other => panic!("an expired record answered {other:?}"),
        }
    }
    assert!(purger.await.unwrap() <= ids.len() as u64);
}

/// The memory store's janitor reads each record about once a round,
/// whatever its batch: with 20,000 records within their retention and
/// 10,000 past it, purged one at a time, a round reads its tables about
/// twice, where starting every batch at the first shard read the shards
/// already swept again for each record (hundreds of millions of reads,
/// seconds of locked shards, growing with the square of the store).
#[tokio::test]
async fn memory_a_round_of_small_batches_reads_each_record_about_once() {
    let store = idem::MemoryStore::new();
    // The short-lived last: a shard that grows drops what is expired.
    for (n, ttl) in [(20_000, LONG), (10_000, Duration::from_secs(1))] {
        for i in 0..n {
            let id = RecordId::new("t", "purge.rounds", format!("k-{}-{i}", ttl.as_millis()));
            let lease = take(&store, &id, "fp", ttl, LONG).await;
            store.complete(&id, &lease.token, &response("r")).await.unwrap();
        }
    }
    tokio::time::sleep(Duration::from_millis(1100)).await;
    // Those a growing shard dropped already (on a slow machine) aside.
    let expired = store.len() - 20_000;
    assert!(expired > 5_000, "{expired}");
    assert_eq!(idem::purge_expired(&store, 1).await.unwrap(), expired as u64);
    assert_eq!(store.len(), 20_000);
    let reads = store.purge_reads();
    // A table has a few buckets for each record it ever held (at most ten
    // here, however it grew); read twice, and some spare.
    assert!(reads <= 20 * 30_000, "{reads} buckets read for 30,000 records");
    // A round that finds nothing reads each table once.
    let before = store.purge_reads();
    assert_eq!(idem::purge_expired(&store, 500).await.unwrap(), 0);
    let once = store.purge_reads() - before;
    assert!(once <= 10 * 30_000, "{once} buckets read for 20,000 records");
}
