//! The [`Operation`] handed to a handler: its key and attempt, checkpoints,
//! derived keys for downstream calls, the lease's state, and transactions
//! committed with the completion.

use crate::store::{IdempotencyStore, Lease, RecordId, StoreError};
use crate::tx::PendingTx;
#[cfg(any(feature = "postgres", feature = "sqlite"))]
use crate::tx::TxConnection;
#[cfg(any(feature = "postgres", feature = "sqlite"))]
use std::future::Future;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;

/// `OperationInfo::phase`: the handler (or its body) still runs.
const RUNNING: u8 = 0;
/// The lease keeper ended the lease while the execution ran: it is lost.
const ENDED: u8 = 1;
/// The execution records its outcome.
const SETTLING: u8 = 2;
/// The execution's outcome is over, confirmed or not.
const SETTLED: u8 = 3;

/// What an execution runs under, shared (one allocation per execution) by
/// its handler's [`Operation`], the lease keeper and the answer: the record,
/// the lease, and what the handler leaves for the completion.
#[derive(Clone)]
pub(crate) struct OperationInfo(Arc<Shared>);

pub(crate) struct Shared {
    pub(crate) store: Arc<dyn IdempotencyStore>,
    pub(crate) id: RecordId,
    pub(crate) lease: Lease,
    /// Set once the lease is lost: taken over, or not extended in time.
    /// Never unset. A flag and a `Notify` (neither allocates) rather than a
    /// watch channel, which allocated its state for every execution and
    /// woke its (never present) watchers when dropped.
    lost: std::sync::atomic::AtomicBool,
    /// Wakes those waiting in [`Operation::lease_lost`] once `lost` is set.
    lost_told: tokio::sync::Notify,
    /// `RUNNING`, then `ENDED` (the keeper ended the lease first) or
    /// `SETTLING` and `SETTLED` (the execution records its outcome: it
    /// completes its record or lets its key go). Once it settles, the
    /// keeper no longer decides: the execution's own write may clear the
    /// lock, or commit while an extension waits behind it, so a refused
    /// extension or a passed deadline says nothing then. The write does:
    /// confirmed by the store, the lease is not lost; not confirmed (it
    /// failed, timed out, or found the operation taken over), another
    /// execution may take the operation over, and the lease counts as lost.
    phase: std::sync::atomic::AtomicU8,
    /// The recovery point as this execution last set it.
    pub(crate) recovery_point: std::sync::Mutex<Option<String>>,
    /// Held by a checkpoint from its write to setting `recovery_point`:
    /// checkpoints from several tasks are written one at a time, so the
    /// last one set is the last one the store kept.
    checkpoints: tokio::sync::Mutex<()>,
    /// The handler's transaction, once it asked for one; the execution
    /// takes it for the completion ([`OperationInfo::take_tx`]).
    pub(crate) tx: tokio::sync::Mutex<Option<PendingTx>>,
    /// How long [`Operation`]'s transaction calls wait for its connection
    /// while something else holds it: the lock timeout.
    #[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
    tx_wait: std::time::Duration,
    /// Set once the execution took the transaction, or stopped waiting for
    /// it: a transaction opened after that (by a task the handler left
    /// holding `op`) could never commit with the answer.
    tx_closed: std::sync::atomic::AtomicBool,
}

/// A task kept the handler's transaction connection for as long as the
/// execution waits to take it ([`OperationInfo::take_tx`]).
pub(crate) struct TxHeld;

impl std::ops::Deref for OperationInfo {
    type Target = Shared;

    fn deref(&self) -> &Shared {
        &self.0
    }
}

impl OperationInfo {
    pub(crate) fn new(
        store: Arc<dyn IdempotencyStore>,
        id: RecordId,
        lease: Lease,
        tx_wait: std::time::Duration,
    ) -> Self {
        OperationInfo(Arc::new(Shared {
            store,
            id,
            lease,
            lost: std::sync::atomic::AtomicBool::new(false),
            lost_told: tokio::sync::Notify::new(),
            phase: std::sync::atomic::AtomicU8::new(RUNNING),
            recovery_point: std::sync::Mutex::new(None),
            checkpoints: tokio::sync::Mutex::const_new(()),
            tx: tokio::sync::Mutex::new(None),
            tx_wait,
            tx_closed: std::sync::atomic::AtomicBool::new(false),
        }))
    }

    /// The handler's transaction, for its execution to finish: taken once
    /// the handler returned and its answer's body was read (a task that
    /// feeds the body may hold the transaction's connection until then).
    /// Waits up to `bound` for a task that still holds the connection;
    /// [`TxHeld`] past that. None opens after this, either way.
    pub(crate) fn take_tx(
        &self,
        bound: std::time::Duration,
    ) -> impl std::future::Future<Output = Result<Option<PendingTx>, TxHeld>> + Send + '_ {
        // Nobody holds the connection, as a rule: taken without waiting.
        let free = self.try_take_tx();
        async move {
            match free {
                Some(tx) => Ok(tx),
                None => Box::pin(self.take_tx_held(bound)).await,
            }
        }
    }

    /// [`OperationInfo::take_tx`] without waiting: `None` while a task holds
    /// the connection (and the slot stays open).
    pub(crate) fn try_take_tx(&self) -> Option<Option<PendingTx>> {
        self.tx.try_lock().ok().map(|mut slot| self.close_tx(&mut slot))
    }

    /// [`OperationInfo::take_tx`]'s wait for a held connection.
    pub(crate) async fn take_tx_held(&self, bound: std::time::Duration) -> Result<Option<PendingTx>, TxHeld> {
        match tokio::time::timeout(bound, self.tx.lock()).await {
            Ok(mut slot) => Ok(self.close_tx(&mut slot)),
            Err(_) => {
                self.refuse_tx();
                Err(TxHeld)
            }
        }
    }

    /// No transaction opens through `op` from now on: the execution no
    /// longer waits for the one a task holds.
    pub(crate) fn refuse_tx(&self) {
        self.tx_closed.store(true, SeqCst);
    }

    /// [`OperationInfo::take_tx`] waiting as long as it takes.
    pub(crate) async fn take_tx_when_free(&self) -> Option<PendingTx> {
        self.close_tx(&mut *self.tx.lock().await)
    }

    /// The transaction out of its slot, under its lock; none opens after
    /// this.
    pub(crate) fn close_tx(&self, slot: &mut Option<PendingTx>) -> Option<PendingTx> {
        self.tx_closed.store(true, SeqCst);
        slot.take()
    }

    /// Whether the handler opened a transaction through `op` (one a task
    /// holds counts), without taking it.
    pub(crate) fn has_tx(&self) -> bool {
        self.tx.try_lock().map_or(true, |slot| slot.is_some())
    }

    pub(crate) fn is_lost(&self) -> bool {
        self.lost.load(std::sync::atomic::Ordering::Acquire)
    }

    /// The execution starts recording its outcome (see `phase`). False
    /// when the keeper ended the lease first: it is lost.
    pub(crate) fn settle(&self) -> bool {
        self.phase
            .compare_exchange(RUNNING, SETTLING, SeqCst, SeqCst)
            .is_ok()
    }

    /// The outcome's write is over: `confirmed` when the store confirmed
    /// it. Not confirmed, the lease counts as lost.
    pub(crate) fn settled(&self, confirmed: bool) {
        let _ = self.phase.compare_exchange(SETTLING, SETTLED, SeqCst, SeqCst);
        if !confirmed {
            self.set_lost();
        }
    }

    /// The lease keeper ended the lease: an extension was refused, or its
    /// deadline passed. While the execution runs, the lease is lost; once
    /// it settles, its outcome's write decides (see `phase`). Says whether
    /// this counted the lease as lost.
    pub(crate) fn lease_ended(&self) -> bool {
        if self
            .phase
            .compare_exchange(RUNNING, ENDED, SeqCst, SeqCst)
            .is_err()
        {
            return false;
        }
        self.set_lost();
        true
    }

    /// Counts the lease as lost, and tells those waiting for it.
    pub(crate) fn set_lost(&self) {
        self.lost.store(true, std::sync::atomic::Ordering::Release);
        self.lost_told.notify_waiters();
    }

    /// Resolves once the lease is lost (at once if it already is).
    pub(crate) async fn until_lost(&self) {
        loop {
            let told = self.lost_told.notified();
            let mut told = std::pin::pin!(told);
            // Registered before the flag is read: a `set_lost` after the
            // read wakes this waiter, one before it is seen by the read.
            told.as_mut().enable();
            if self.is_lost() {
                return;
            }
            told.await;
        }
    }
}

/// The operation an annotated handler runs for: its key, attempt and
/// recovery point, checkpoints, and derived keys for downstream calls.
///
/// Ask for it as a parameter of an `#[idempotent]` handler (any position:
/// the attribute supplies it after the reservation, it is not an extractor).
/// An `optional` handler asks for `Option<Operation>`: a request without a
/// key runs unprotected and gets `None`.
///
/// ```
/// use axum::Json;
/// use idem::{idempotent, Operation};
/// # #[derive(serde::Deserialize, serde::Serialize)] struct Order { sku: String }
///
/// #[idempotent(scope = "order.create", fields(sku))]
/// async fn create_order(op: Operation, Json(order): Json<Order>) -> String {
///     if op.recovery_point().as_deref() != Some("reserved") {
///         // ... reserve stock, then remember that it is done:
///         op.checkpoint("reserved").await.ok();
///     }
///     let gateway_key = op.derived_key("charge");
///     format!("attempt {} with {gateway_key}", op.attempt())
/// }
/// ```
#[derive(Clone)]
pub struct Operation {
    pub(crate) info: OperationInfo,
}

impl std::fmt::Debug for Operation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Operation")
            .field("scope", &self.info.id.scope)
            .field("attempt", &self.info.lease.attempt)
            .finish_non_exhaustive()
    }
}

impl Operation {
    /// The client's idempotency key.
    pub fn key(&self) -> &str {
        &self.info.id.key
    }

    /// The tenant the record belongs to.
    pub fn tenant(&self) -> &str {
        &self.info.id.tenant
    }

    /// The scope of the attribute.
    pub fn scope(&self) -> &str {
        &self.info.id.scope
    }

    /// 1 for the first execution of the operation, + 1 for every later
    /// reservation of it: a takeover of a stale lock, or the retry of a
    /// released outcome. One that took the key but never ran (refused,
    /// or its answer lost) counts too: attempts may be more than the
    /// executions that ran, never fewer.
    pub fn attempt(&self) -> u32 {
        self.info.lease.attempt
    }

    /// Whether this execution took over from one whose lock ran out.
    pub fn is_takeover(&self) -> bool {
        self.info.lease.is_takeover()
    }

    /// The last recovery point: set by [`Operation::checkpoint`] in this
    /// execution, or by an earlier attempt of the same operation (one
    /// taken over, or released as failed and retried).
    pub fn recovery_point(&self) -> Option<String> {
        let own = self
            .info
            .recovery_point
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        own.or_else(|| self.info.lease.recovery_point.clone())
    }

    /// Whether this execution's lease is lost: another execution took the
    /// operation over, or the lock could not be extended before its deadline
    /// (the store was unreachable), so another may have. A handler that sees
    /// it should stop before its next external effect: whatever it answers
    /// now is neither given nor stored (its client gets 503
    /// `idempotency-lease-lost` with `Retry-After`, its transaction rolls
    /// back, and the key is given back so that a retry continues the
    /// operation). Once the handler returned, the write of its outcome
    /// decides: the lease is lost when the store did not confirm it (the
    /// operation was taken over, or the write failed or timed out and may
    /// or may not have taken effect), never when it did.
    ///
    /// ```
    /// # use idem::{idempotent, Operation};
    /// #[idempotent(scope = "report.build")]
    /// async fn build(op: Operation) -> &'static str {
    ///     for _part in 0..3 {
    ///         if op.is_lease_lost() {
    ///             return "stopped"; // the client gets 503, never this
    ///         }
    ///         // ... one step of work
    ///     }
    ///     "built"
    /// }
    /// ```
    pub fn is_lease_lost(&self) -> bool {
        self.info.is_lost()
    }

    /// Resolves when this execution's lease is lost (see
    /// [`Operation::is_lease_lost`]); never while the lease holds, nor for
    /// an execution whose outcome the store confirmed. Race it against long
    /// work to stop early.
    ///
    /// ```
    /// # use idem::{idempotent, Operation};
    /// # async fn long_work() -> &'static str { "done" }
    /// #[idempotent(scope = "report.build")]
    /// async fn build(op: Operation) -> &'static str {
    ///     tokio::select! {
    ///         done = long_work() => done,
    ///         () = op.lease_lost() => "stopped", // the client gets 503, never this
    ///     }
    /// }
    /// ```
    pub async fn lease_lost(&self) {
        // Once the execution is over, the lease is never lost: this then
        // never resolves.
        self.info.until_lost().await;
    }

    /// Persists `name` as the operation's progress, under this execution's
    /// lock token. Checkpoints from several tasks (clones of this
    /// `Operation`) are written one at a time, in the order they are
    /// called: [`Operation::recovery_point`] is then the last one stored.
    ///
    /// # Errors
    ///
    /// [`StoreError::LockLost`] when another execution took the operation
    /// over, or when the lease is lost (see [`Operation::is_lease_lost`]),
    /// also while the checkpoint was written (it is then stored, for the
    /// execution that takes the operation over): stop, the record is not
    /// yours any more. The lease then counts as
    /// lost ([`Operation::is_lease_lost`] is true, [`Operation::lease_lost`]
    /// resolves). [`StoreError::Backend`], on every store alike and
    /// before the store is asked, for a `name` holding U+0000, which
    /// PostgreSQL's `text` cannot hold (any other text is kept as it is).
    /// Another [`StoreError`] when the store fails.
    ///
    /// ```
    /// # use idem::{idempotent, Operation, StoreError};
    /// #[idempotent(scope = "order.ship")]
    /// async fn ship(op: Operation) -> Result<&'static str, StoreError> {
    ///     if op.recovery_point().as_deref() != Some("labelled") {
    ///         // Buy the label under `op.derived_key("label")`, then:
    ///         op.checkpoint("labelled").await?;
    ///     }
    ///     Ok("shipped")
    /// }
    /// ```
    pub async fn checkpoint(&self, name: &str) -> Result<(), StoreError> {
        let info = &self.info;
        if info.is_lost() {
            return Err(StoreError::LockLost);
        }
        if name.contains('\0') {
            return Err(StoreError::backend(
                "a checkpoint's name cannot hold U+0000 (PostgreSQL's text cannot store it)",
            ));
        }
        let _one_at_a_time = info.checkpoints.lock().await;
        // Lost while an earlier checkpoint was written.
        if info.is_lost() {
            return Err(StoreError::LockLost);
        }
        if let Err(e) = info.store.checkpoint(&info.id, &info.lease.token, name).await {
            // The store says another token holds the record: the lease is
            // lost, and the handler is told so everywhere (`is_lease_lost`,
            // `lease_lost`), not only by this error.
            if e == StoreError::LockLost && info.lease_ended() {
                tracing::error!("a checkpoint found the operation taken over: the lease is lost");
            }
            return Err(e);
        }
        *self.info.recovery_point.lock().unwrap_or_else(|e| e.into_inner()) = Some(name.to_owned());
        // Written under this token, which still held the record, but while
        // the write waited (a row lock, a slow store) the lease ran out: the
        // handler must stop all the same. The recovery point stays, for the
        // retry that takes the operation over.
        if info.is_lost() {
            return Err(StoreError::LockLost);
        }
        Ok(())
    }

    /// The handler's transaction on the PostgreSQL store: its writes commit
    /// together with the completion of this record (a stored outcome), or
    /// are rolled back (a released outcome, a panic, a lost lock). The first
    /// call opens it; later calls return the same one, once the connection
    /// an earlier call gave is dropped (a call while it is still in hand,
    /// in this task or another, waits for it one lock timeout at most). The
    /// execution takes
    /// the transaction for the completion once the handler has returned and
    /// the answer's body has been read; it waits for a task still holding
    /// the connection then for one lock timeout at most. Past that, the
    /// client gets 503, and the transaction is rolled back once the task
    /// lets go (README, "Multi-step operations").
    ///
    /// # Errors
    ///
    /// [`StoreError::Backend`] when the layer's store is not a
    /// [`crate::PgStore`]; [`StoreError::Unavailable`] when no connection
    /// can be had, or when an earlier call's connection stays in hand for a
    /// whole lock timeout; [`StoreError::LockLost`] when the lease is lost, or once
    /// the handler has returned and its execution has taken the transaction,
    /// or stopped waiting for it (to a task the handler left holding `op`):
    /// a transaction opened then
    /// could never commit with the answer. (What such a task wrote before,
    /// in the handler's transaction, commits with the answer.)
    ///
    /// ```no_run
    /// # use idem::{idempotent, Operation};
    /// #[idempotent(scope = "order.create")]
    /// async fn create_order(op: Operation) -> Result<&'static str, idem::StoreError> {
    ///     let mut conn = op.pg_transaction().await?;
    ///     sqlx::query("INSERT INTO orders (id) VALUES ($1)")
    ///         .bind(op.derived_key("order-id"))
    ///         .execute(&mut *conn)
    ///         .await
    ///         .map_err(|e| idem::StoreError::backend(e.to_string()))?;
    ///     Ok("created")
    /// }
    /// ```
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub async fn pg_transaction(&self) -> Result<TxConnection<'_, sqlx::PgConnection>, StoreError> {
        self.transaction(PendingTx::begin_pg(&*self.info.store), PendingTx::pg)
            .await
    }

    /// The handler's transaction on the SQLite store (`BEGIN IMMEDIATE`):
    /// the same contract as [`Operation::pg_transaction`].
    ///
    /// # Errors
    ///
    /// [`StoreError::Backend`] when the layer's store is not a
    /// [`crate::SqliteStore`]; [`StoreError::Unavailable`] when the write
    /// lock cannot be had within the store's timeout, or when an earlier
    /// call's connection stays in hand for a whole lock timeout;
    /// [`StoreError::LockLost`] as for [`Operation::pg_transaction`].
    ///
    /// ```no_run
    /// # use idem::{idempotent, Operation};
    /// #[idempotent(scope = "order.create")]
    /// async fn create_order(op: Operation) -> Result<&'static str, idem::StoreError> {
    ///     let mut conn = op.sqlite_transaction().await?;
    ///     sqlx::query("INSERT INTO orders (id) VALUES (?1)")
    ///         .bind(op.derived_key("order-id"))
    ///         .execute(&mut *conn)
    ///         .await
    ///         .map_err(|e| idem::StoreError::backend(e.to_string()))?;
    ///     Ok("created")
    /// }
    /// ```
    #[cfg(feature = "sqlite")]
    #[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
    pub async fn sqlite_transaction(&self) -> Result<TxConnection<'_, sqlx::SqliteConnection>, StoreError> {
        self.transaction(PendingTx::begin_sqlite(&*self.info.store), PendingTx::sqlite)
            .await
    }

    /// The open transaction's connection, opening it with `begin` first.
    #[cfg(any(feature = "postgres", feature = "sqlite"))]
    async fn transaction<'a, C: 'a>(
        &'a self,
        begin: impl Future<Output = Result<PendingTx, StoreError>>,
        connection: fn(&mut PendingTx) -> Option<&mut C>,
    ) -> Result<TxConnection<'a, C>, StoreError> {
        if self.info.is_lost() {
            return Err(StoreError::LockLost);
        }
        // Held by another task of the handler's, for a while; or by the
        // caller itself (a second call while the first's connection is in
        // hand), for ever: bounded either way, never a hang.
        let Ok(mut slot) = tokio::time::timeout(self.info.tx_wait, self.info.tx.lock()).await else {
            return Err(StoreError::unavailable(
                "the handler's transaction connection stayed in use (by this caller or another task) for a whole \
                 lock timeout",
            ));
        };
        if self.info.tx_closed.load(SeqCst) {
            return Err(StoreError::LockLost);
        }
        if slot.is_none() {
            *slot = Some(begin.await?);
        }
        // Lost while the connection was waited for, or the transaction
        // begun: it is rolled back with the execution's end.
        if self.info.is_lost() {
            return Err(StoreError::LockLost);
        }
        tokio::sync::MutexGuard::try_map(slot, |slot| slot.as_mut().and_then(connection))
            .map_err(|_| StoreError::backend("the operation holds a transaction of another store"))
    }

    /// A key for the downstream call `step`, to pass to another system's own
    /// idempotency support: the same on every retry, takeover and restart of
    /// this operation; different for a new operation that reuses the key
    /// after the old record expired; revealing none of its inputs.
    pub fn derived_key(&self, step: &str) -> String {
        derived_key(&self.info.id, &self.info.lease.operation_id, step)
    }
}

/// `idem_` and 40 hex digits of SHA-256 over the record, its operation id
/// and the step, all length-prefixed.
pub(crate) fn derived_key(id: &RecordId, operation_id: &str, step: &str) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for part in [
        "idem-derived-key-v1",
        &id.tenant,
        &id.scope,
        &id.key,
        operation_id,
        step,
    ] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    format!("idem_{}", crate::fingerprint::hex(&h.finalize()[..20]))
}

/// What a handler's parameter that `#[idempotent]` fills with the
/// operation may be: `Operation`, or `Option<Operation>`. The macro knows
/// the parameter by its type's name; another type named `Operation` is
/// refused here, at that type. Used by the generated code only.
#[doc(hidden)]
#[diagnostic::on_unimplemented(
    message = "`#[idempotent]` fills a parameter whose type is named `Operation` with idem's `Operation`, and `{Self}` is another type",
    label = "not `idem::Operation`",
    note = "an extractor of your own named `Operation` needs another name here: `use audit::Operation as AuditOperation;`"
)]
pub trait OperationParam {}

impl OperationParam for Operation {}
impl OperationParam for Option<Operation> {}

/// Compiles only for an [`OperationParam`]. Used by the generated code only.
#[doc(hidden)]
pub fn operation_param<T: OperationParam>() {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_keys_are_stable_opaque_and_per_operation() {
        let id = RecordId::new("acct_1", "payment.create", "key-1");
        let a = derived_key(&id, "op-1", "charge");
        assert_eq!(a, derived_key(&id, "op-1", "charge"));
        assert_ne!(a, derived_key(&id, "op-2", "charge"));
        assert_ne!(a, derived_key(&id, "op-1", "notify"));
        assert!(!a.contains("acct_1") && !a.contains("key-1") && !a.contains("charge"));
        assert_eq!(a.len(), 45);
    }

    fn info() -> OperationInfo {
        let lease = Lease {
            token: "t".into(),
            attempt: 1,
            takeover: false,
            recovery_point: None,
            operation_id: "op".into(),
        };
        let store: Arc<dyn IdempotencyStore> = Arc::new(crate::MemoryStore::new());
        OperationInfo::new(
            store,
            RecordId::new("", "s", "k"),
            lease,
            std::time::Duration::from_secs(30),
        )
    }

    /// `until_lost` resolves whether the lease was lost before it was
    /// called or while it waits, and never while the lease holds.
    #[tokio::test]
    async fn until_lost_sees_a_loss_before_or_after_it_waits() {
        use std::time::Duration;
        let before = info();
        before.set_lost();
        tokio::time::timeout(Duration::from_secs(5), before.until_lost())
            .await
            .expect("a loss before the wait is seen");

        let during = info();
        assert!(!during.is_lost());
        let waiting = tokio::spawn({
            let during = during.clone();
            async move { during.until_lost().await }
        });
        // It waits while the lease holds.
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        let mut waiting = std::pin::pin!(waiting);
        assert!(
            tokio::time::timeout(Duration::from_millis(50), waiting.as_mut())
                .await
                .is_err(),
            "until_lost resolved while the lease held"
        );
        during.set_lost();
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("a loss during the wait is seen")
            .expect("the waiter ran");
        assert!(during.is_lost());
    }
}
