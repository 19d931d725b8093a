//! Recording an execution's outcome: completing the record (in the handler's
//! transaction when it opened one), or letting the key go as failed or
//! rejected, fenced by the lease's token. See docs/PROTOCOL.md, "Completion
//! and release".

use crate::layer::Engine;
use crate::operation::OperationInfo;
use crate::problem::{Problem, Unavailable};
use crate::protocol::{drop_unsent, record, Outcome};
use crate::store::{BoxFuture, RecordId, StoreError, StoredResponse};
use crate::tx::{PendingTx, TxFailure};
use axum::response::{IntoResponse as _, Response};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tracing::Instrument as _;

/// Records the completion, in the handler's transaction if it opened one.
/// `Err` is the answer the client gets instead of the handler's.
// Not an async fn, which would copy its arguments into its state twice.
#[allow(clippy::manual_async_fn)]
pub(crate) fn record_completion<'a>(
    engine: &'a Arc<Engine>,
    info: &'a OperationInfo,
    lock_timeout: Duration,
    stored: &'a StoredResponse,
    tx: Option<PendingTx>,
) -> impl Future<Output = Result<(), Response>> + Send + 'a {
    async move {
        if !info.settle() {
            return Err(refuse_lost(engine, info, lock_timeout, tx).await);
        }
        let recorded = completing(engine, info, lock_timeout, stored, tx).await;
        info.settled(recorded.is_ok());
        recorded
    }
}

/// The answer of an execution whose lease was lost before its outcome was
/// recorded (the handler was told): whatever it answered then is not the
/// operation's answer. Rolls back its transaction, gives the key back (the
/// retry continues the operation) and answers 503 `idempotency-lease-lost`.
pub(crate) async fn refuse_lost(
    engine: &Arc<Engine>,
    info: &OperationInfo,
    lock_timeout: Duration,
    tx: Option<PendingTx>,
) -> Response {
    record(Outcome::LockLost);
    if let Some(tx) = tx {
        Box::pin(tx.rollback()).await;
    }
    let _ = give_back(engine, &info.id, &info.lease.token, lock_timeout).await;
    Problem::LeaseLost.into_response()
}

/// [`record_completion`]'s write, once the execution settles.
// Not an async fn, which would copy its arguments into its state twice.
#[allow(clippy::manual_async_fn)]
fn completing<'a>(
    engine: &'a Arc<Engine>,
    info: &'a OperationInfo,
    lock_timeout: Duration,
    stored: &'a StoredResponse,
    tx: Option<PendingTx>,
) -> impl Future<Output = Result<(), Response>> + Send + 'a {
    async move {
        let Some(tx) = tx else {
            return complete(engine, info, lock_timeout, stored).await;
        };
        // Boxed, as is every step that only some executions take: an
        // execution's state is as large as its largest step, so those steps
        // would make every execution's allocation larger and its moves longer.
        match Box::pin(tx.complete(&info.id, &info.lease.token, stored)).await {
            Ok(()) => Ok(()),
            Err(TxFailure::NotCommitted(StoreError::LockLost)) => {
                record(Outcome::LockLost);
                tracing::error!(
                    "cannot complete: another execution took this operation over; this execution's writes \
                 were rolled back"
                );
                // Given back, fenced by the token: after a takeover this
                // changes nothing, and where the completion found no row
                // for another reason the key is not left locked by an
                // execution that has ended.
                let _ = give_back(engine, &info.id, &info.lease.token, lock_timeout).await;
                Err(Problem::LeaseLost.into_response())
            }
            Err(TxFailure::Failed) if (400..500).contains(&stored.status) => {
                // A rejection (such as 402 after a statement refused by a
                // constraint): it needs none of the handler's writes, which
                // can never commit. Recorded on its own, as on a store whose
                // failed statements leave the transaction open.
                tracing::warn!(
                    status = stored.status,
                    "a statement of the handler's failed its transaction: its writes were rolled back, \
                     and its rejection is recorded without them"
                );
                Box::pin(complete(engine, info, lock_timeout, stored)).await
            }
            Err(failure @ (TxFailure::Failed | TxFailure::NotCommitted(_) | TxFailure::CommitRefused(_))) => {
                // Nothing of this execution committed: the retry runs it again.
                record(Outcome::Released);
                match failure {
                    TxFailure::CommitRefused(e) => {
                        let hint = if e.to_string().contains("could not serialize") {
                            " (the transaction runs above READ COMMITTED, and another transaction's writes \
                             conflicted with what it read or wrote; a retry runs the operation again)"
                        } else {
                            ""
                        };
                        tracing::error!(
                            error = %e,
                            "the database refused the commit of the handler's transaction: its writes and the \
                             completion were rolled back{hint}"
                        )
                    }
                    TxFailure::NotCommitted(e) => {
                        // PostgreSQL's words for it, as sqlx passes them on.
                        let hint = if e.to_string().contains("could not serialize") {
                            " (the transaction runs above READ COMMITTED, and the record's row changed after \
                             its snapshot: a lease extension, or a checkpoint after its first statement; \
                             README, \"Multi-step operations\")"
                        } else {
                            ""
                        };
                        tracing::error!(error = %e, "completing in the handler's transaction failed; rolled back{hint}")
                    }
                    // An answer that claims writes that cannot commit.
                    _ => tracing::error!(
                        "a statement of the handler's failed its transaction, yet it answered as if it had \
                         succeeded; rolled back"
                    ),
                }
                if give_back(engine, &info.id, &info.lease.token, lock_timeout).await
                    == Err(StoreError::LockLost)
                {
                    return Err(Problem::LeaseLost.into_response());
                }
                Err(Problem::StoreUnavailable(Unavailable::RolledBack).into_response())
            }
            Err(failure @ (TxFailure::Lost | TxFailure::Unclear(_))) => {
                // Some of the handler's writes may be gone and some may have
                // committed (its transaction ended before its outcome, or
                // whether it did cannot be told): the answer is not the operation's, and
                // nothing says the writes were undone. The retry continues the
                // operation (attempt + 1).
                record(Outcome::TransactionLost);
                match failure {
                    TxFailure::Unclear(e) => tracing::error!(
                        error = %e,
                        "cannot tell whether the handler's transaction was still idem's (on SQLite: whether SQLite ended \
                         it by itself); nothing recorded"
                    ),
                    _ => tracing::error!(
                        "the handler's transaction ended before its outcome (SQLite ending it by itself on a \
                     ROLLBACK from a trigger or a conflict clause, a full disk, an I/O error; or a nested \
                     transaction given up on part-way, which ends the enclosing one): some of its writes \
                     may have been rolled back and some committed on their own; nothing recorded"
                    ),
                }
                let _ = give_back(engine, &info.id, &info.lease.token, lock_timeout).await;
                Err(Problem::StoreUnavailable(Unavailable::OutcomeUnknown).into_response())
            }
            Err(TxFailure::Unknown(e)) => {
                // Committed or not, nobody knows. Giving the key back is fenced:
                // if the commit took effect, the record is completed and stays so.
                record(Outcome::CommitUnknown);
                tracing::error!(error = %e, "the commit of the handler's transaction failed");
                let _ = give_back(engine, &info.id, &info.lease.token, lock_timeout).await;
                Err(Problem::StoreUnavailable(Unavailable::OutcomeUnknown).into_response())
            }
        }
    }
}

/// Completes the record, retrying a store that fails for a moment. When it
/// cannot, the answer is not given (it would never be replayed): the key is
/// given back and the client told to retry.
// Not an async fn, which would copy its arguments into its state twice.
#[allow(clippy::manual_async_fn)]
pub(crate) fn complete<'a>(
    engine: &'a Arc<Engine>,
    info: &'a OperationInfo,
    lock_timeout: Duration,
    stored: &'a StoredResponse,
) -> impl Future<Output = Result<(), Response>> + Send + 'a {
    async move {
        let mut pause = Duration::from_millis(100);
        for attempt in 1..=4 {
            match engine.store.complete(&info.id, &info.lease.token, stored).await {
                Ok(()) => return Ok(()),
                Err(StoreError::LockLost) if attempt == 1 => {
                    record(Outcome::LockLost);
                    tracing::error!("cannot complete: another execution took this operation over");
                    return Err(Problem::LeaseLost.into_response());
                }
                Err(StoreError::LockLost) => {
                    // An earlier attempt that failed may have completed the
                    // record after all (its answer lost), or another execution
                    // took over: which, nobody can tell, so not a takeover's
                    // 503. The retry is told which, a replay or the other
                    // execution's answer.
                    record(Outcome::NotRecorded);
                    tracing::error!(
                    "cannot tell whether the answer was recorded: an earlier attempt may have completed the \
                     record, or another execution took this operation over"
                );
                    return Err(Problem::StoreUnavailable(Unavailable::OutcomeUnknown).into_response());
                }
                // Retried even past the lock's deadline (the keeper no longer
                // ends the lease while the execution settles): every try is
                // fenced by the token.
                Err(e) if attempt < 4 => {
                    tracing::warn!(error = %e, attempt, "completing the record failed; retrying");
                    Box::pin(tokio::time::sleep(pause)).await;
                    pause *= 2;
                }
                Err(e) => {
                    tracing::error!(error = %e, "completing the record failed; giving the key back");
                    break;
                }
            }
        }
        record(Outcome::NotRecorded);
        let _ = give_back(engine, &info.id, &info.lease.token, lock_timeout).await;
        Err(Problem::StoreUnavailable(Unavailable::OutcomeUnknown).into_response())
    }
}

/// How an execution that produced no answer to keep lets its key go.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum LetGo {
    /// Released as failed: bound to its request (see [`Classification::Release`]).
    Fail,
    /// Rejected: the key is free on a first attempt (see [`Classification::Reject`]).
    Reject,
}

/// A failed execution (`fail`) or a rejected request (`reject`): rolls back
/// the handler's transaction, lets the key go as `how` says, and answers
/// `response`, unless another execution took the operation over, whose
/// answer is the one that counts, or the handler answered after it was
/// told its lease is lost (503 `idempotency-lease-lost` for both), or a
/// rejection the store did not confirm (503: see below). When the rollback
/// could not undo all the handler wrote (SQLite had ended the transaction
/// by itself), the key goes back as failed and the client gets 503: the
/// outcome is not known. Boxed: see [`record_completion`].
pub(crate) fn let_go<'a>(
    engine: &'a Arc<Engine>,
    info: &'a OperationInfo,
    lock_timeout: Duration,
    tx: Option<PendingTx>,
    response: Response,
    how: LetGo,
) -> BoxFuture<'a, Response> {
    Box::pin(letting_go(engine, info, lock_timeout, tx, response, how))
}

async fn letting_go(
    engine: &Arc<Engine>,
    info: &OperationInfo,
    lock_timeout: Duration,
    tx: Option<PendingTx>,
    mut response: Response,
    mut how: LetGo,
) -> Response {
    // Settled from here, before the rollback, which may wait (on a
    // statement the handler left running): a deadline that passes
    // meanwhile is not a loss unless the release below is not confirmed.
    // Let go even when the lease was lost first: the write is fenced.
    // `told`: the keeper ended the lease before the execution settled
    // (while the handler ran, which was told, or in the moment since it
    // returned): as for a success, its answer is not given.
    let told = !info.settle();
    let mut lost = false;
    if let Some(tx) = tx {
        if !tx.rollback().await {
            // Not everything it wrote was undone: the key is not free for
            // a new operation, and the answer, which says nothing changed,
            // is not given.
            lost = true;
            tracing::error!(
                "the handler's transaction ended before its outcome (SQLite ending it by itself on a \
                 ROLLBACK from a trigger or a conflict clause, a full disk, an I/O error; or a nested \
                 transaction given up on part-way, which ends the enclosing one): any writes after that \
                 committed on their own; released as failed"
            );
            how = LetGo::Fail;
            drop_unsent(std::mem::replace(
                &mut response,
                Problem::StoreUnavailable(Unavailable::OutcomeUnknown).into_response(),
            ));
        }
    }
    record(if lost {
        Outcome::TransactionLost
    } else if how == LetGo::Reject {
        Outcome::Rejected
    } else {
        Outcome::Released
    });
    let (id, token) = (&info.id, &info.lease.token);
    // Whether a first try failed with its effect unknown (it may have
    // committed, its answer lost).
    let mut unclear = false;
    let outcome = match how {
        LetGo::Reject => match engine.store.reject(id, token).await {
            // Tried again, as a rejection: released as failed instead, the
            // key would stay bound to the request the handler refused, and
            // the client's corrected request would get 422 until the
            // record expired.
            Err(e) if e != StoreError::LockLost => {
                unclear = true;
                Box::pin(retried(engine, id, token, lock_timeout, Back::Rejected)).await
            }
            other => other,
        },
        LetGo::Fail => give_back(engine, id, token, lock_timeout).await,
    };
    info.settled(outcome.is_ok());
    if unclear && outcome == Err(StoreError::LockLost) {
        // The token holds nothing now: the first try took effect, or
        // another execution took the operation over. Which, nobody can
        // tell: not a takeover's 503, and not the handler's answer either
        // (a conflict may not hold for the execution that took over). The
        // retry gets the answer that counts.
        record(Outcome::NotRecorded);
        tracing::error!(
            "cannot tell whether the rejection was recorded: its first try failed, and the second found the \
             lock no longer held"
        );
        drop_unsent(response);
        return Problem::StoreUnavailable(Unavailable::OutcomeUnknown).into_response();
    }
    if outcome == Err(StoreError::LockLost) {
        record(Outcome::LockLost);
        tracing::error!("cannot release: another execution took this operation over");
        drop_unsent(response);
        return Problem::LeaseLost.into_response();
    }
    if told {
        // What it answered once told is not the operation's answer (often
        // an early stop), as for a success (see `refuse_lost`); its key
        // went back all the same, so the retry runs.
        record(Outcome::LockLost);
        tracing::error!("the handler answered after it was told its lease is lost; its answer is not given");
        drop_unsent(response);
        return Problem::LeaseLost.into_response();
    }
    if how == LetGo::Reject && outcome.is_err() {
        // Not confirmed: the lock may have run out meanwhile (the store
        // fails, so its extensions may too) and another execution taken
        // the operation over, for which a conflict need not hold. The
        // rejection goes on in the background; the retry gets the answer
        // that counts. (A failure's answer asks for that retry itself.)
        record(Outcome::NotRecorded);
        tracing::error!("the rejection could not be recorded; its answer is not given");
        drop_unsent(response);
        return Problem::StoreUnavailable(Unavailable::OutcomeUnknown).into_response();
    }
    response
}

/// Gives the key back: a release fenced by `token`, which changes nothing
/// if the token holds nothing. It serves executions that failed and
/// completions whose answer never came (a timeout: they may have committed
/// all the same). While the store is unreachable it keeps trying in the
/// background, until the lock would have run out by itself, so no lock
/// stays that nobody holds. Says how the first try went. Boxed: see
/// [`record_completion`].
pub(crate) fn give_back<'a>(
    engine: &'a Arc<Engine>,
    id: &'a RecordId,
    token: &'a str,
    lock_timeout: Duration,
) -> BoxFuture<'a, Result<(), StoreError>> {
    Box::pin(retried(engine, id, token, lock_timeout, Back::Ran))
}

/// [`give_back`] of a key that never ran, as it was found (see
/// [`crate::IdempotencyStore::hand_back`]). Boxed: see
/// [`record_completion`].
pub(crate) fn hand_back_key<'a>(
    engine: &'a Arc<Engine>,
    id: &'a RecordId,
    token: &'a str,
    lock_timeout: Duration,
    taken_over: bool,
) -> BoxFuture<'a, Result<(), StoreError>> {
    Box::pin(retried(
        engine,
        id,
        token,
        lock_timeout,
        Back::NeverRan { taken_over },
    ))
}

/// How a key goes back.
#[derive(Clone, Copy)]
enum Back {
    /// An execution ran and failed: released as failed.
    Ran,
    /// An execution ran and its answer was a rejection: the key freed (see
    /// [`crate::IdempotencyStore::reject`]).
    Rejected,
    /// Nothing ran: as it was found.
    NeverRan { taken_over: bool },
}

impl Back {
    async fn to(
        self,
        store: &dyn crate::IdempotencyStore,
        id: &RecordId,
        token: &str,
    ) -> Result<(), StoreError> {
        match self {
            Back::Ran => store.release(id, token).await,
            Back::Rejected => store.reject(id, token).await,
            Back::NeverRan { taken_over } => store.hand_back(id, token, taken_over).await,
        }
    }
}

/// Gives the key back `how`, and while the store is unreachable keeps
/// trying in the background (see [`give_back`]).
async fn retried(
    engine: &Arc<Engine>,
    id: &RecordId,
    token: &str,
    lock_timeout: Duration,
    how: Back,
) -> Result<(), StoreError> {
    let first = how.to(&*engine.store, id, token).await;
    match &first {
        Ok(()) | Err(StoreError::LockLost) => {}
        Err(e) => {
            tracing::warn!(error = %e, "giving the key back failed; trying again in the background");
            // Counted from the failed try, not from before it: the lease
            // may have extended the lock while that try took its time.
            let until = Instant::now() + lock_timeout;
            let (store, id, token) = (engine.store.clone(), id.clone(), token.to_owned());
            // Under way (`Idem::idle`) until it is given back or given up.
            let under_way = engine.under_way.enter();
            let retrying = async move {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let _ = crate::store::retry_until(until, || how.to(&*store, &id, &token)).await;
                drop(under_way);
            };
            in_background(&*engine.store, retrying.in_current_span());
        }
    }
    first
}

/// Runs `task` in the background where it runs whatever becomes of the
/// caller: for a SQLite store, on the writers' runtime (a current-thread
/// runtime left idle once its request was answered would never run it, and
/// one shutting down would drop it: either way the key stayed locked, by no
/// execution, until its lock timeout); for the others on the caller's
/// runtime, whose sockets a PostgreSQL pool's connections are.
fn in_background(store: &dyn crate::IdempotencyStore, task: impl Future<Output = ()> + Send + 'static) {
    #[cfg(feature = "sqlite")]
    {
        let any: &dyn std::any::Any = store;
        if any.is::<crate::SqliteStore>() {
            drop(crate::sql::sqlite::spawn_on_writers(task));
            return;
        }
    }
    #[cfg(not(feature = "sqlite"))]
    let _ = store;
    drop(tokio::spawn(task));
}
