//! The record protocol (contract sections 4, 6 and 7): the store trait, the
//! types it speaks, and the in-memory store.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A boxed, sendable future: what the store trait's methods return, so that
/// `Arc<dyn IdempotencyStore>` works.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What identifies a record: (tenant, scope, key), never the key alone.
///
/// ```
/// use idem_runtime::RecordId;
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
    /// # use idem_runtime::RecordId;
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
/// use idem_runtime::{RecordId, ReserveRequest};
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
    /// The request's fingerprint (see [`crate::fingerprint()`]).
    pub fingerprint: &'a str,
    /// The lock token this execution will hold if it takes the key (128
    /// random bits, chosen by the caller): a reservation whose answer never
    /// arrives (a timeout, a cancellation) is undone by releasing it.
    pub token: &'a str,
    /// How long the record is kept, counted from its first reservation.
    pub ttl: Duration,
    /// How long the lock holds before another request may take over.
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
    /// # use idem_runtime::Lease;
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
/// use idem_runtime::StoredResponse;
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
    /// The body bytes; `None` when the body was larger than the configured
    /// limit and only status and headers were kept.
    pub body: Option<Vec<u8>>,
}

// The SQL stores' column mapping.
#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
impl StoredResponse {
    /// The headers as a JSON array of `[name, value]` strings, each value
    /// byte one character of the same number (U+0000 to U+00FF): ASCII
    /// values read as they are, and every byte comes back.
    pub(crate) fn headers_to_json(&self) -> String {
        let latin1: Vec<(&str, String)> = self
            .headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.iter().map(|&b| char::from(b)).collect()))
            .collect();
        serde_json::to_string(&latin1).unwrap_or_else(|_| "[]".to_owned())
    }

    pub(crate) fn from_columns(
        status: Option<i64>,
        headers: Option<String>,
        body: Option<Vec<u8>>,
    ) -> Result<Self, StoreError> {
        let status = status
            .and_then(|s| u16::try_from(s).ok())
            .ok_or_else(|| StoreError::Backend("completed record without a status".into()))?;
        let unreadable = |why: String| StoreError::Backend(format!("stored headers unreadable: {why}"));
        let headers = match headers {
            Some(json) => {
                let latin1: Vec<(String, String)> =
                    serde_json::from_str(&json).map_err(|e| unreadable(e.to_string()))?;
                latin1
                    .into_iter()
                    .map(|(n, v)| {
                        let bytes: Option<Vec<u8>> =
                            v.chars().map(|c| u8::try_from(u32::from(c)).ok()).collect();
                        bytes
                            .map(|b| (n, b))
                            .ok_or_else(|| unreadable("a value beyond one byte a character".into()))
                    })
                    .collect::<Result<_, _>>()?
            }
            None => Vec::new(),
        };
        Ok(StoredResponse {
            status,
            headers,
            body,
        })
    }
}

/// Why a store operation failed.
///
/// ```
/// use idem_runtime::StoreError;
/// assert!(StoreError::Unavailable("timed out".into()).is_unavailable());
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreError {
    /// The store could not be reached, or did not answer in time.
    Unavailable(String),
    /// The lock token no longer owns the record: it was taken over, or the
    /// record is gone.
    LockLost,
    /// The store answered with an error.
    Backend(String),
}

impl StoreError {
    /// Whether the store could not be reached in time.
    ///
    /// ```
    /// # use idem_runtime::StoreError;
    /// assert!(!StoreError::LockLost.is_unavailable());
    /// ```
    pub fn is_unavailable(&self) -> bool {
        matches!(self, StoreError::Unavailable(_))
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Unavailable(why) => write!(f, "idempotency store unavailable: {why}"),
            StoreError::LockLost => f.write_str("the lock on this idempotency record was lost"),
            StoreError::Backend(why) => write!(f, "idempotency store error: {why}"),
        }
    }
}

impl std::error::Error for StoreError {}

/// A place where idempotency records live.
///
/// Every method is one atomic operation of the store. `complete`,
/// `release`, `checkpoint` and `extend_lock` are fenced by the lock token:
/// a token whose lock was taken over gets [`StoreError::LockLost`] and
/// changes nothing. Expiry and lock deadlines are judged by the store's own
/// clock.
///
/// ```
/// use idem_runtime::{IdempotencyStore, MemoryStore, RecordId, Reservation, ReserveRequest};
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
pub trait IdempotencyStore: AsAny + Send + Sync + 'static {
    /// Takes the key in one atomic step, or says why not. The record, if
    /// taken, holds `req.token`. An error means the key may or may not have
    /// been taken: the caller gives it back with [`IdempotencyStore::release`]
    /// and that token, and a store whose statements may still commit after
    /// it answered with a timeout gives the key back itself when they do.
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
    /// ([`IdempotencyStore::release`]). The default is the safe half:
    /// always release as failed.
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
}

/// Lets the runtime find the concrete store behind `dyn IdempotencyStore`
/// (for transactions on the SQL stores). Implemented for every type.
pub trait AsAny {
    /// `self` as `Any`.
    fn as_any(&self) -> &dyn std::any::Any;
}

impl<T: std::any::Any> AsAny for T {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Deletes every record past its TTL, `batch` at a time (each batch one
/// short statement, so no long table lock), and says how many it deleted.
/// Call it from a scheduler, or let [`crate::Idem::start_janitor`] do it.
///
/// # Errors
///
/// The first [`StoreError`] of a batch; what earlier batches deleted stays deleted.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let store = idem_runtime::MemoryStore::new();
/// assert_eq!(idem_runtime::purge_expired(&store, 500).await.unwrap(), 0);
/// # }
/// ```
pub async fn purge_expired(store: &dyn IdempotencyStore, batch: u32) -> Result<u64, StoreError> {
    let batch = batch.max(1);
    let mut total = 0;
    loop {
        let removed = store.purge_expired(batch).await?;
        total += removed;
        if removed < u64::from(batch) {
            return Ok(total);
        }
        tokio::task::yield_now().await;
    }
}

/// A fresh random token: 128 bits as 32 hex digits.
pub(crate) fn random_token() -> String {
    let mut bytes = [0u8; 16];
    // getrandom only fails when the OS has no entropy source at all.
    if getrandom::fill(&mut bytes).is_err() {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        bytes = nanos.to_le_bytes();
    }
    crate::fingerprint::hex(&bytes)
}

/// How an existing record that the caller did not take is answered.
pub(crate) fn judge_existing(
    fingerprint_matches: bool,
    completed: Option<StoredResponse>,
    lock_left: Duration,
) -> Reservation {
    match (fingerprint_matches, completed) {
        (false, _) => Reservation::Mismatch,
        (true, Some(response)) => Reservation::Completed(response),
        (true, None) => Reservation::InProgress {
            retry_after: lock_left,
        },
    }
}

#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
/// Bounds a store operation by `limit`: past it, [`StoreError::Unavailable`].
pub(crate) async fn bounded<T>(
    limit: Duration,
    fut: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(limit, fut).await {
        Ok(result) => result,
        Err(_) => Err(StoreError::Unavailable(format!(
            "no answer within {} ms",
            limit.as_millis()
        ))),
    }
}

#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
/// Milliseconds as the stores bind them.
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
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

    /// As if absent, and purgeable: a completed record past its TTL; one in
    /// progress only once also a whole TTL past its lock deadline.
    fn gone(&self, now: Instant) -> bool {
        self.expires_at <= now && (self.response.is_some() || self.lock_deadline + self.ttl <= now)
    }
}

/// An in-process store for unit tests and demos.
///
/// Records live in one process's memory: they vanish on restart and are not
/// shared between servers, so it protects nothing across processes. Use
/// [`crate::SqliteStore`] or [`crate::PgStore`] for anything real.
///
/// ```
/// use idem_runtime::MemoryStore;
/// let store = MemoryStore::new();
/// assert_eq!(store.len(), 0);
/// ```
#[derive(Debug, Default)]
pub struct MemoryStore {
    records: Mutex<HashMap<RecordId, MemoryRecord>>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many records it holds, expired ones included.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether it holds no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<RecordId, MemoryRecord>> {
        // A panic while holding the lock cannot leave a record half-written:
        // every change below is a single assignment.
        self.records.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn fenced<T>(
        &self,
        id: &RecordId,
        token: &str,
        change: impl FnOnce(&mut HashMap<RecordId, MemoryRecord>, Instant) -> T,
    ) -> Result<T, StoreError> {
        let mut records = self.lock();
        let now = Instant::now();
        match records.get(id) {
            Some(r) if r.response.is_none() && r.token.as_deref() == Some(token) => {
                Ok(change(&mut records, now))
            }
            _ => Err(StoreError::LockLost),
        }
    }

    fn reserve_now(&self, req: ReserveRequest<'_>) -> Reservation {
        let mut records = self.lock();
        let now = Instant::now();
        let token = req.token.to_owned();
        let existing = records.get(req.id).cloned();
        let fresh = |operation_id: String| MemoryRecord {
            fingerprint: req.fingerprint.to_owned(),
            token: Some(token.clone()),
            attempt: 1,
            operation_id,
            recovery_point: None,
            lock_deadline: now + req.lock_timeout,
            expires_at: now + req.ttl,
            ttl: req.ttl,
            response: None,
        };
        let mut taken_over = false;
        let record = match existing {
            None => fresh(random_token()),
            Some(r) if r.gone(now) && !r.lock_live(now) => fresh(random_token()),
            // A stale lock (a takeover) or a released record (its retry).
            Some(r) if r.response.is_none() && r.lock_deadline <= now && r.fingerprint == req.fingerprint => {
                taken_over = r.token.is_some();
                MemoryRecord {
                    token: Some(token.clone()),
                    attempt: r.attempt + 1,
                    lock_deadline: now + req.lock_timeout,
                    ..r
                }
            }
            Some(r) => {
                return judge_existing(
                    r.fingerprint == req.fingerprint,
                    r.response.clone(),
                    r.lock_deadline.saturating_duration_since(now),
                )
            }
        };
        let lease = Lease {
            token,
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
                let first = records
                    .get(id)
                    .is_some_and(|r| r.attempt == 1 && r.recovery_point.is_none());
                if first {
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
            let removed = {
                let mut records = self.lock();
                let now = Instant::now();
                let doomed: Vec<RecordId> = records
                    .iter()
                    .filter(|(_, r)| r.gone(now) && !r.lock_live(now))
                    .map(|(id, _)| id.clone())
                    .take(batch as usize)
                    .collect();
                for id in &doomed {
                    records.remove(id);
                }
                doomed.len() as u64
            };
            pause_point!(crate::pause::PURGE_AFTER, "");
            Ok(removed)
        })
    }
}

/// A background task that deletes expired records: every `every`, it
/// purges in batches of `batch` until nothing expired is left. It never
/// removes a record whose lock is still valid. Stops when dropped or
/// [`Janitor::stop`]ped.
///
/// ```
/// use idem_runtime::{Janitor, MemoryStore};
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
    /// at once.
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
                match purge_expired(&*store, batch).await {
                    Ok(0) => {}
                    Ok(n) => {
                        counter.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
                        tracing::info!(removed = n, "idempotency janitor removed expired records");
                    }
                    Err(e) => tracing::warn!(error = %e, "idempotency janitor failed; retrying next round"),
                }
            }
        });
        Janitor { task, removed }
    }

    /// How many records it removed so far.
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
