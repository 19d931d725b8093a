//! The store's side of the protocol: the [`IdempotencyStore`] trait, the
//! types it speaks, and the record's states.
//!
//! # The record's states
//!
//! A record is keyed by (tenant, scope, key). When a request with its key
//! arrives, the record is in one of the states of [`RecordState`], and the
//! reservation answers as this table says (docs/PROTOCOL.md, "States", draws
//! it as a diagram):
//!
//! | state | what the record holds | same fingerprint | other fingerprint |
//! | --- | --- | --- | --- |
//! | [`Absent`](RecordState::Absent) | no row | taken: attempt 1 | taken: attempt 1 |
//! | [`Locked`](RecordState::Locked) | in progress, a token, lock deadline ahead | 409 in progress | 422 mismatch |
//! | [`Stale`](RecordState::Stale) | in progress, a token, lock deadline passed | taken over: attempt + 1 | 422 mismatch |
//! | [`Released`](RecordState::Released) | in progress, no token (given back as failed) | taken: attempt + 1 | 422 mismatch |
//! | [`Completed`](RecordState::Completed) | completed, the stored answer | replayed | 422 mismatch |
//! | [`Gone`](RecordState::Gone) | past its retention, no live lock | taken afresh: attempt 1 | taken afresh: attempt 1 |
//!
//! "Gone" is: `expires_at <= now`, and completed, or a whole TTL past its lock
//! deadline (an execution that crashed after an effect can still be
//! continued by its retry until then). A taken record keeps its operation id
//! and recovery point unless it was absent or gone.
//!
//! Each store encodes this table once:
//! - [`MemoryStore`]: `RecordState::of` and [`RecordState::decide`], in Rust;
//! - the SQL stores: the `live_lock`, `expired` and `takeable` conditions that
//!   `Statements::new` builds for both dialects (the PostgreSQL store runs
//!   them in one statement, the SQLite store in one write transaction).

mod memory;

pub use crate::janitor::{purge_expired, Janitor};
pub use memory::MemoryStore;
#[cfg(feature = "pause-points")]
#[doc(hidden)]
pub use memory::RecordView;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

/// How much work is under way (`Idem::idle`): through an `Idem`, its keyed
/// requests from the start of their protocol to their answer and their
/// executions until their completion or release is recorded; for the
/// stores, their own work in the background ([`background_work`]).
#[derive(Debug, Default)]
pub(crate) struct UnderWay {
    count: std::sync::atomic::AtomicUsize,
    idle: tokio::sync::Notify,
}

impl UnderWay {
    /// One more under way, until the guard is dropped.
    pub(crate) fn enter(self: &Arc<Self>) -> UnderWayGuard {
        self.count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        UnderWayGuard(self.clone())
    }

    /// How many are under way now.
    pub(crate) fn count(&self) -> usize {
        self.count.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Once none is under way.
    #[cfg_attr(not(feature = "axum"), allow(dead_code))]
    pub(crate) async fn idle(&self) {
        loop {
            let notified = self.idle.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            if self.count() == 0 {
                return;
            }
            notified.await;
        }
    }
}

/// One piece of work under way (see [`UnderWay`]).
#[derive(Debug)]
pub(crate) struct UnderWayGuard(Arc<UnderWay>);

impl Drop for UnderWayGuard {
    fn drop(&mut self) {
        if self.0.count.fetch_sub(1, std::sync::atomic::Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

/// The stores' own work in the background, of the whole process: what a
/// reservation given up on at the store's timeout leaves to do (its late
/// answer awaited, its key given back).
#[cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "axum")),
    allow(dead_code)
)]
pub(crate) fn background_work() -> &'static Arc<UnderWay> {
    static WORK: std::sync::OnceLock<Arc<UnderWay>> = std::sync::OnceLock::new();
    WORK.get_or_init(Arc::default)
}

/// Where a record stands when a request with its key arrives: the rows of
/// the state table in [the module docs](self).
///
/// ```
/// use idem::store::{Decision, RecordState};
/// assert_eq!(RecordState::Released.decide(true), Decision::Continue);
/// assert_eq!(RecordState::Released.decide(false), Decision::Mismatch);
/// assert_eq!(RecordState::Gone.decide(false), Decision::Fresh);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordState {
    /// No record.
    Absent,
    /// In progress, and its lock deadline is ahead.
    Locked,
    /// In progress with a lock token whose deadline passed: its execution
    /// died, or runs without extending its lease.
    Stale,
    /// In progress without a lock token: an execution gave the key back as
    /// failed, so that its retry really retries.
    Released,
    /// Completed, with the stored answer.
    Completed,
    /// Past its retention and without a live lock: as if absent.
    Gone,
}

/// What a reservation does with a record, by [`RecordState::decide`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Take the key for a new operation: attempt 1, a new operation id.
    Fresh,
    /// Take the key for the next attempt of the same operation (a takeover
    /// of a stale lock, or the retry of a released one).
    Continue,
    /// Answer with the stored response.
    Replay,
    /// Answer 409: another execution holds the lock.
    InProgress,
    /// Answer 422: the key belongs to another request.
    Mismatch,
}

impl RecordState {
    /// The `state` column of a SQL row in progress (locked, stale or released).
    #[cfg(any(feature = "postgres", feature = "sqlite"))]
    pub(crate) const IN_PROGRESS_COLUMN: &'static str = "in_progress";
    /// The `state` column of a completed SQL row.
    #[cfg(any(feature = "postgres", feature = "sqlite"))]
    pub(crate) const COMPLETED_COLUMN: &'static str = "completed";

    /// What a reservation with the same (`true`) or another fingerprint does
    /// with a record in this state.
    ///
    /// ```
    /// use idem::store::{Decision, RecordState};
    /// assert_eq!(RecordState::Completed.decide(true), Decision::Replay);
    /// assert_eq!(RecordState::Locked.decide(true), Decision::InProgress);
    /// ```
    pub fn decide(self, same_fingerprint: bool) -> Decision {
        match (self, same_fingerprint) {
            (RecordState::Absent | RecordState::Gone, _) => Decision::Fresh,
            (_, false) => Decision::Mismatch,
            (RecordState::Stale | RecordState::Released, true) => Decision::Continue,
            (RecordState::Completed, true) => Decision::Replay,
            (RecordState::Locked, true) => Decision::InProgress,
        }
    }
}

/// A boxed, sendable future: what the store trait's methods return, so that
/// `Arc<dyn IdempotencyStore>` works.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What identifies a record: (tenant, scope, key), never the key alone.
///
/// ```
/// use idem::store::RecordId;
/// let id = RecordId::new("acct_1", "payment.create", "k-1");
/// assert_eq!(id.scope, "payment.create");
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RecordId {
    /// The authenticated principal.
    pub tenant: String,
    /// The operation name of the attribute.
    pub scope: String,
    /// The client's idempotency key.
    pub key: String,
}

impl RecordId {
    /// Builds an id from its three parts.
    ///
    /// ```
    /// # use idem::store::RecordId;
    /// let id = RecordId::new("t", "s", "k");
    /// assert_eq!((id.tenant.as_str(), id.key.as_str()), ("t", "k"));
    /// ```
    pub fn new(tenant: impl Into<String>, scope: impl Into<String>, key: impl Into<String>) -> Self {
        RecordId {
            tenant: tenant.into(),
            scope: scope.into(),
            key: key.into(),
        }
    }
}

/// One request to take a key.
///
/// ```
/// use idem::store::{RecordId, ReserveRequest};
/// use std::time::Duration;
///
/// let id = RecordId::new("t", "s", "k");
/// let req = ReserveRequest {
///     id: &id,
///     fingerprint: "ab12",
///     token: "5f0c0ffee",
///     ttl: Duration::from_secs(86_400),
///     lock_timeout: Duration::from_secs(60),
/// };
/// assert_eq!(req.id.key, "k");
/// ```
#[derive(Clone, Copy, Debug)]
pub struct ReserveRequest<'a> {
    /// Which record.
    pub id: &'a RecordId,
    /// The request's fingerprint (see [`crate::fingerprint::fingerprint()`]).
    pub fingerprint: &'a str,
    /// The lock token this execution will hold if it takes the key (128
    /// random bits, chosen by the caller): a reservation whose answer never
    /// arrives (a timeout, a cancellation) is undone by releasing it. A
    /// fresh one for every call, a retry of the same request's included: a
    /// store may give back, later and fenced by this token, a key that a
    /// call took after it had answered (see [`IdempotencyStore::reserve`]),
    /// which with a token used again could be a later call's live key.
    pub token: &'a str,
    /// How long the record is kept, counted from its first reservation
    /// (and again from its completion). A duration past what a store's
    /// clock can tell (`Duration::MAX`, or past 10,000 years in the SQL
    /// stores) means "never".
    pub ttl: Duration,
    /// How long the lock holds before another request may take over; a
    /// duration past what a store's clock can tell means "never", as for
    /// [`ttl`](Self::ttl).
    pub lock_timeout: Duration,
}

/// The answer of [`IdempotencyStore::reserve`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reservation {
    /// The caller owns the record now and must run the operation, then
    /// complete or release it with the lease's token.
    Reserved(Lease),
    /// The operation completed before; here is its stored answer.
    Completed(StoredResponse),
    /// Another execution holds a valid lock; it expires in `retry_after`.
    InProgress {
        /// Time left until the lock deadline.
        retry_after: Duration,
    },
    /// The key was used with a different fingerprint.
    Mismatch,
}

/// Ownership of a record, proven by its lock token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    /// The lock token that every later write must carry.
    pub token: String,
    /// 1 for the first execution of the operation, then + 1 for every later
    /// one (a takeover, or the retry of a released outcome).
    pub attempt: u32,
    /// Whether this execution took over a lock whose deadline had passed
    /// (the previous execution may still be running, or died).
    pub takeover: bool,
    /// The last checkpoint a previous attempt stored.
    pub recovery_point: Option<String>,
    /// An id the record got when first reserved; kept through takeovers.
    pub operation_id: String,
}

impl Lease {
    /// Whether this execution took over a lock whose deadline had passed.
    ///
    /// ```
    /// # use idem::store::Lease;
    /// let lease = Lease { token: "t".into(), attempt: 2, takeover: true, recovery_point: None, operation_id: "o".into() };
    /// assert!(lease.is_takeover());
    /// ```
    pub fn is_takeover(&self) -> bool {
        self.takeover
    }
}

/// A stored answer: status, the headers worth replaying, and the body.
///
/// ```
/// use idem::store::StoredResponse;
/// let r = StoredResponse { status: 201, headers: vec![("location".into(), "/v1/p/1".into())], body: Some(b"{}".to_vec()) };
/// assert_eq!(r.status, 201);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredResponse {
    /// The HTTP status code.
    pub status: u16,
    /// Header names (lowercase) and values as bytes (HTTP allows bytes
    /// beyond ASCII in a value), in the order they are replayed.
    pub headers: Vec<(String, Vec<u8>)>,
    /// The body bytes; `None` when only status and headers were kept: the
    /// body was larger than the configured limit, or an event stream
    /// (`text/event-stream`, whatever its size).
    pub body: Option<Vec<u8>>,
}

/// The error a store passes on as the cause of a [`StoreError`].
pub type Source = std::sync::Arc<dyn std::error::Error + Send + Sync + 'static>;

/// Why a store operation failed. The driver's error, when there is one, is
/// kept as its [`source`](std::error::Error::source).
///
/// ```
/// use idem::StoreError;
/// let e = StoreError::unavailable("no answer within 2000 ms");
/// assert!(e.is_unavailable());
/// assert_eq!(e.to_string(), "idempotency store unavailable: no answer within 2000 ms");
/// ```
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The store could not be reached, or did not answer in time.
    #[error("idempotency store unavailable: {reason}")]
    Unavailable {
        /// What happened.
        reason: String,
        /// The driver's error.
        #[source]
        source: Option<Source>,
    },
    /// The lock token no longer owns the record: it was taken over, or the
    /// record is gone.
    #[error("the lock on this idempotency record was lost")]
    LockLost,
    /// The store answered with an error.
    #[error("idempotency store error: {reason}")]
    Backend {
        /// What happened.
        reason: String,
        /// The driver's error.
        #[source]
        source: Option<Source>,
    },
}

impl StoreError {
    /// [`StoreError::Unavailable`] without a source.
    ///
    /// ```
    /// assert!(idem::StoreError::unavailable("down").is_unavailable());
    /// ```
    pub fn unavailable(reason: impl Into<String>) -> Self {
        StoreError::Unavailable {
            reason: reason.into(),
            source: None,
        }
    }

    /// [`StoreError::Backend`] without a source.
    ///
    /// ```
    /// assert!(!idem::StoreError::backend("constraint violated").is_unavailable());
    /// ```
    pub fn backend(reason: impl Into<String>) -> Self {
        StoreError::Backend {
            reason: reason.into(),
            source: None,
        }
    }

    /// The same error with `source` as its cause.
    ///
    /// ```
    /// use std::error::Error as _;
    /// let io = std::io::Error::other("connection reset");
    /// let e = idem::StoreError::unavailable("connection reset").with_source(io);
    /// assert!(e.source().is_some());
    /// ```
    pub fn with_source(self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        let source: Option<Source> = Some(std::sync::Arc::new(source));
        match self {
            StoreError::Unavailable { reason, .. } => StoreError::Unavailable { reason, source },
            StoreError::Backend { reason, .. } => StoreError::Backend { reason, source },
            other => other,
        }
    }

    /// Whether the store could not be reached in time.
    ///
    /// ```
    /// # use idem::StoreError;
    /// assert!(!StoreError::LockLost.is_unavailable());
    /// ```
    pub fn is_unavailable(&self) -> bool {
        matches!(self, StoreError::Unavailable { .. })
    }

    /// Whether the lock token no longer owns the record.
    ///
    /// ```
    /// assert!(idem::StoreError::LockLost.is_lock_lost());
    /// ```
    pub fn is_lock_lost(&self) -> bool {
        matches!(self, StoreError::LockLost)
    }
}

/// Equal when of the same kind with the same reason; sources are not compared.
impl PartialEq for StoreError {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (StoreError::Unavailable { reason: a, .. }, StoreError::Unavailable { reason: b, .. })
            | (StoreError::Backend { reason: a, .. }, StoreError::Backend { reason: b, .. }) => a == b,
            (StoreError::LockLost, StoreError::LockLost) => true,
            _ => false,
        }
    }
}

impl Eq for StoreError {}

/// A place where idempotency records live.
///
/// Every method is one atomic operation of the store. `complete`,
/// `release`, `checkpoint` and `extend_lock` are fenced by the lock token:
/// a token whose lock was taken over gets [`StoreError::LockLost`] and
/// changes nothing. Expiry and lock deadlines are judged by the store's own
/// clock.
///
/// ```
/// use idem::{IdempotencyStore, MemoryStore};
/// use idem::store::{RecordId, Reservation, ReserveRequest};
/// use std::time::Duration;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let store = MemoryStore::new();
/// let id = RecordId::new("t", "s", "k");
/// let req = ReserveRequest { id: &id, fingerprint: "f", token: "t1", ttl: Duration::from_secs(60), lock_timeout: Duration::from_secs(5) };
/// let Reservation::Reserved(lease) = store.reserve(req).await.unwrap() else { panic!() };
/// store.release(&id, &lease.token).await.unwrap();
/// # }
/// ```
pub trait IdempotencyStore: std::any::Any + Send + Sync + 'static {
    /// Takes the key in one atomic step, or says why not. The record, if
    /// taken, holds `req.token`. An error means the key may or may not have
    /// been taken: the caller gives it back with [`IdempotencyStore::release`]
    /// and that token, and a store whose statements may still commit after
    /// it answered (with a timeout, or with a state read apart) gives the
    /// key back itself when they do.
    ///
    /// The lock and the TTL of a record taken count, by the store's clock,
    /// from some moment after the call began: on PostgreSQL, the start of
    /// the statement, even one that then waited for a row another
    /// transaction held. A caller counts its lease from before the call
    /// and starts no work on one whose lock may have run out by the time
    /// it is answered, as the runtime does: the store may already let
    /// another request take the key, or its janitor remove the record.
    fn reserve<'a>(&'a self, req: ReserveRequest<'a>) -> BoxFuture<'a, Result<Reservation, StoreError>>;

    /// Marks the record completed with `response`.
    fn complete<'a>(
        &'a self,
        id: &'a RecordId,
        token: &'a str,
        response: &'a StoredResponse,
    ) -> BoxFuture<'a, Result<(), StoreError>>;

    /// Releases the record as *failed*, so that a retry really retries: the
    /// same request (the same fingerprint) continues the same operation
    /// (attempt + 1, same operation id and recovery point); another request
    /// with this key is a mismatch until the record expires.
    fn release<'a>(&'a self, id: &'a RecordId, token: &'a str) -> BoxFuture<'a, Result<(), StoreError>>;

    /// Releases the record as *rejected*: on the operation's first attempt
    /// with no recovery point (nothing can have happened) the record is
    /// removed and the key is free; otherwise it is released as failed
    /// ([`IdempotencyStore::release`]). When no record is left under the
    /// key at all, the rejection is done (`Ok`): the key is free, and the
    /// runtime tries a rejection again after an error, which may have come
    /// after the first try committed. The default is the safe half: always
    /// release as failed.
    fn reject<'a>(&'a self, id: &'a RecordId, token: &'a str) -> BoxFuture<'a, Result<(), StoreError>> {
        self.release(id, token)
    }

    /// Stores `recovery_point` as the operation's progress.
    fn checkpoint<'a>(
        &'a self,
        id: &'a RecordId,
        token: &'a str,
        recovery_point: &'a str,
    ) -> BoxFuture<'a, Result<(), StoreError>>;

    /// Moves the lock deadline to `lock_timeout` from now (a lease heartbeat).
    fn extend_lock<'a>(
        &'a self,
        id: &'a RecordId,
        token: &'a str,
        lock_timeout: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>>;

    /// Deletes at most `batch` records past their TTL, never one whose lock
    /// is still valid, and says how many it deleted.
    fn purge_expired(&self, batch: u32) -> BoxFuture<'_, Result<u64, StoreError>>;

    /// Hands back a key that a reservation under `token` took but that
    /// never ran (its request was refused, or its answer was lost), as the
    /// key was found, so that it counts as no execution:
    ///
    /// - taken fresh (the operation's first attempt, no recovery point: the
    ///   key was absent or expired): the record is removed;
    /// - taken over from a stale lock (`taken_over`): a stale lock again,
    ///   its deadline now and its token kept, so that the next request is
    ///   told it takes over from an execution that never ended;
    /// - the retry of a released record: released again.
    ///
    /// The attempt it counted stays counted: the next execution is told
    /// one attempt more than ran (a record whose attempt went back to 1
    /// would pass for one taken fresh, which a second hand-back of the same
    /// reservation, the caller's and a late answer's, would remove, with
    /// the effects of what ran before it).
    ///
    /// Where it is not known how the key was found, `taken_over` is true: a
    /// record that was not taken fresh then becomes a stale lock (the next
    /// request may be told it takes over when nothing ran, never the other
    /// way round). Fenced by `token`: [`StoreError::LockLost`] when the key
    /// is no longer this reservation's.
    ///
    /// The default is the safe half, for stores that cannot delete on a
    /// condition: never removed, a stale lock or released as above.
    ///
    /// ```
    /// use idem::store::{RecordId, Reservation, ReserveRequest};
    /// use idem::{IdempotencyStore, MemoryStore};
    /// use std::time::Duration;
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let store = MemoryStore::new();
    /// let id = RecordId::new("acct_1", "payment.create", "k1");
    /// let req = |token| ReserveRequest {
    ///     id: &id,
    ///     fingerprint: "fp",
    ///     token,
    ///     ttl: Duration::from_secs(3600),
    ///     lock_timeout: Duration::from_secs(30),
    /// };
    /// let Ok(Reservation::Reserved(_)) = store.reserve(req("t1")).await else { panic!() };
    /// // Refused before it ran: the fresh key goes back to absent.
    /// store.hand_back(&id, "t1", true).await.unwrap();
    /// let Ok(Reservation::Reserved(lease)) = store.reserve(req("t2")).await else { panic!() };
    /// assert_eq!((lease.attempt, lease.is_takeover()), (1, false));
    /// # }
    /// ```
    fn hand_back<'a>(
        &'a self,
        id: &'a RecordId,
        token: &'a str,
        taken_over: bool,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        if taken_over {
            self.extend_lock(id, token, Duration::ZERO)
        } else {
            self.release(id, token)
        }
    }
}

/// `timeout` from now, as `tokio::time::timeout` counts it: a timeout past
/// what the clock can tell (`Duration::MAX`, say, for "no bound") is about
/// 30 years away, never an overflow.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) fn deadline_after(timeout: Duration) -> tokio::time::Instant {
    let now = tokio::time::Instant::now();
    now.checked_add(timeout)
        .unwrap_or_else(|| now + Duration::from_secs(86_400 * 365 * 30))
}

/// Tries `give_back` (a release or a hand-back, fenced by a token) until
/// the store answers: at once, then, while the store fails, again every
/// 100 ms doubling to 2 s, as long as `until` has not passed. It stops at
/// the first answer that is not a store error: done, or
/// [`StoreError::LockLost`] (the key is no longer the token's). Says how
/// the last try went. Every give-back that must not leave a lock behind
/// retries this way.
#[cfg(any(feature = "axum", feature = "postgres", feature = "sqlite"))]
pub(crate) async fn retry_until<F, Fut>(
    until: tokio::time::Instant,
    mut give_back: F,
) -> Result<(), StoreError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), StoreError>>,
{
    let mut pause = Duration::from_millis(100);
    loop {
        let tried = give_back().await;
        if matches!(tried, Ok(()) | Err(StoreError::LockLost)) || tokio::time::Instant::now() >= until {
            return tried;
        }
        tokio::time::sleep(pause).await;
        if tokio::time::Instant::now() >= until {
            return tried;
        }
        pause = (pause * 2).min(Duration::from_secs(2));
    }
}

/// A fresh random token: 128 bits as 32 hex digits.
pub(crate) fn random_token() -> String {
    random_token_inline().as_str().to_owned()
}

/// [`random_token`], kept inline.
pub(crate) fn random_token_inline() -> crate::fingerprint::HexStr<32> {
    crate::fingerprint::HexStr::of(&random_bytes())
}

/// 16 bytes from the OS's generator, drawn 4 KiB at a time per thread (one
/// system call for 256 tokens; bytes handed out are wiped from the buffer).
/// A process that forks after serving requests shares the undrawn rest of
/// the forking thread's buffer with its child: fork before serving, as
/// Tokio's runtime needs anyway.
fn random_bytes() -> [u8; 16] {
    use std::cell::RefCell;
    const BUF: usize = 4096;
    struct Pool {
        bytes: Box<[u8; BUF]>,
        used: usize,
    }
    thread_local! {
        static POOL: RefCell<Pool> = RefCell::new(Pool { bytes: Box::new([0; BUF]), used: BUF });
    }
    POOL.with(|pool| {
        let mut pool = pool.borrow_mut();
        if pool.used == BUF {
            // getrandom only fails when the OS has no entropy source at all.
            if getrandom::fill(&mut pool.bytes[..]).is_err() {
                let nanos = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos())
                    .unwrap_or_default();
                return nanos.to_le_bytes();
            }
            pool.used = 0;
        }
        let at = pool.used;
        let mut out = [0u8; 16];
        out.copy_from_slice(&pool.bytes[at..at + 16]);
        // Handed out once: wiped from the buffer.
        pool.bytes[at..at + 16].fill(0);
        pool.used = at + 16;
        out
    })
}
