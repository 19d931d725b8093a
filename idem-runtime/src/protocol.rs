//! The request flow, top to bottom: read the key, the tenant and the
//! fingerprint, reserve the record, execute the handler under the lease,
//! classify its outcome, then complete or let go, or answer from the record.
//! See docs/PROTOCOL.md.

use crate::answer::{
    collect, drain, replay, stream_then_complete, Collected, End, Frame, Reader, StreamedAnswer, ABANDONED,
    BODY_OMITTED,
};
use crate::classify::Classification;
use crate::key::{IdempotencyKey, KeyError};
use crate::layer::{Context, Engine, Tenant};
use crate::lease::{Heartbeat, LeaseClock};
use crate::operation::{Operation, OperationInfo, TxHeld};
use crate::outcome::{hand_back_key, let_go, record_completion, refuse_lost, LetGo};
use crate::problem::{Problem, Unavailable};
use crate::request::Spec;
use crate::store::{Lease, RecordId, Reservation, ReserveRequest, StoredResponse};
use crate::tx::PendingTx;
use axum::body::Body;
use axum::http::header::{HeaderValue, CONTENT_LENGTH, CONTENT_TYPE};
use axum::response::{IntoResponse as _, Response};
use futures_util::future::Either;
use futures_util::{FutureExt as _, StreamExt as _};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tracing::Instrument as _;

/// The handler's outcome as the generated code hands it over.
#[doc(hidden)]
pub(crate) type HandlerFuture = Pin<Box<dyn Future<Output = (Response, Option<Classification>)> + Send>>;

pub(crate) type Handler = Box<dyn FnOnce(Option<Operation>) -> HandlerFuture + Send>;

/// The handler's body as an async block whose output is `T`, the declared
/// return type: `?` and `return` in the body infer from it.
#[doc(hidden)]
pub fn returning<T, F: Future<Output = T>>(body: F) -> F {
    body
}

/// Runs an annotated handler under the protocol. The generated code calls
/// this once; `handler` builds the handler's future once the key is reserved.
#[doc(hidden)]
pub fn run<K, H, F>(
    ctx: Context<K>,
    spec: &'static Spec,
    fingerprint: crate::fingerprint::Printed,
    handler: H,
) -> impl Future<Output = Response> + Send
where
    H: FnOnce(Operation) -> F + Send + 'static,
    F: Future<Output = (Response, Option<Classification>)> + Send + 'static,
{
    let handler: Handler = Box::new(move |op: Option<Operation>| -> HandlerFuture {
        match op {
            Some(op) => Box::pin(handler(op)),
            // Only `run_optional` runs a handler without a reservation.
            None => Box::pin(async {
                (
                    Problem::Misconfigured.into_response(),
                    Some(Classification::Release),
                )
            }),
        }
    });
    run_boxed(ctx.erase(), spec, fingerprint, handler)
}

/// [`run`] for an `optional` handler: without a key it runs unprotected and
/// gets `None`.
#[doc(hidden)]
pub fn run_optional<K, H, F>(
    ctx: Context<K>,
    spec: &'static Spec,
    fingerprint: crate::fingerprint::Printed,
    handler: H,
) -> impl Future<Output = Response> + Send
where
    H: FnOnce(Option<Operation>) -> F + Send + 'static,
    F: Future<Output = (Response, Option<Classification>)> + Send + 'static,
{
    let handler: Handler = Box::new(move |op: Option<Operation>| -> HandlerFuture { Box::pin(handler(op)) });
    run_boxed(ctx.erase(), spec, fingerprint, handler)
}

/// Works out, before anything is awaited, how the request starts: the
/// future it returns holds only what is left to await (the protocol,
/// boxed, which becomes [`Detachable`] at its first poll), so the handler
/// future that axum allocates for every request, with this one inside,
/// stays small.
pub(crate) fn run_boxed(
    ctx: Context,
    spec: &'static Spec,
    fingerprint: crate::fingerprint::Printed,
    handler: Handler,
) -> impl Future<Output = Response> + Send {
    let started = start(ctx, spec, fingerprint, handler);
    async move {
        let (response, base) = match started {
            Started::Answered(response) => return response,
            Started::Unprotected { handler, base } => (handler.await.0, base),
            // Detachable from its first poll: a request future dropped
            // before it was ever polled runs nothing, as before it started.
            Started::Protected { protocol, base } => (Detachable::boxed(protocol).await, base),
        };
        match base {
            Some(base) => crate::problem::rebase(response, &base),
            None => response,
        }
    }
}

/// How a request starts.
enum Started<P: Future<Output = Response> + Send + 'static> {
    /// Refused before any store call, its problem rebased.
    Answered(Response),
    /// Without a key, on an `optional` handler: the handler alone.
    Unprotected {
        handler: tracing::instrument::Instrumented<HandlerFuture>,
        base: Option<Arc<str>>,
    },
    /// The protocol, boxed, which no client can cancel once it is polled.
    /// `base`: where the answer's problem `type`, if any, is rebased.
    Protected {
        protocol: Pin<Box<P>>,
        base: Option<Arc<str>>,
    },
}

/// Reads the key, then builds the protocol, which no client can cancel
/// once it is polled.
fn start(
    ctx: Context,
    spec: &'static Spec,
    fingerprint: crate::fingerprint::Printed,
    handler: Handler,
) -> Started<impl Future<Output = Response> + Send + 'static> {
    let handler = Unrun(handler);
    let Some(engine) = ctx.idem.as_ref().map(|idem| idem.inner.clone()) else {
        tracing::error!(
            scope = spec.scope,
            "no idempotency store is configured for this route: add `.layer(idem::Idem::new(store).layer())` \
             to the router (below the routes it protects)"
        );
        return Started::Answered(Problem::Misconfigured.into_response());
    };
    spec.note_scope(&engine.scopes);
    let base = engine.problem_base.clone();
    let key = match &ctx.headers {
        Some(headers) => {
            IdempotencyKey::from_header_values(headers.get_all(spec.header).iter().map(HeaderValue::as_bytes))
        }
        None => IdempotencyKey::from_header_values(ctx.key.iter().map(HeaderValue::as_bytes)),
    };
    let rebased = |refused: Response| match &base {
        Some(base) => crate::problem::rebase(refused, base),
        None => refused,
    };
    let key = match key {
        Ok(key) => key,
        Err(KeyError::Missing) if spec.optional => {
            // Logged with its scope, as a keyed request's refusal is.
            let checked = tracing::info_span!("idem", scope = spec.scope)
                .in_scope(|| tenant_id(&engine, ctx.tenant.as_ref()));
            if checked.is_none() {
                return Started::Answered(rebased(Problem::Misconfigured.into_response()));
            }
            let span = tracing::info_span!(
                "idem",
                scope = spec.scope,
                outcome = Outcome::Unprotected.as_str()
            );
            return Started::Unprotected {
                handler: handler.run(None).instrument(span),
                base,
            };
        }
        Err(e) => {
            let refused = Problem::Key {
                error: e,
                header: spec.header,
            }
            .into_response();
            return Started::Answered(rebased(refused));
        }
    };
    let span = tracing::info_span!(
        "idem",
        scope = spec.scope,
        key = %key.log_hash_display(),
        outcome = tracing::field::Empty,
        attempt = tracing::field::Empty,
    );
    // From its first poll on the protocol cannot be cancelled: a client
    // that goes away cancels neither the reservation nor the execution.
    // Under way (`Idem::idle`) until it answers, or is dropped.
    let under_way = engine.under_way.enter();
    Started::Protected {
        protocol: Box::pin(
            async move {
                let answer = protect(engine, ctx.tenant, spec, fingerprint, key, handler, ctx.reader).await;
                drop(under_way);
                answer
            }
            .instrument(span),
        ),
        base,
    }
}

/// The protocol of one request, run in the request's own task while its
/// client waits, and finished in a task of its own when the request is
/// dropped before it is done (the client went away): exactly where it
/// stopped, never run again from the start, never cancelled. (An execution
/// always runs in a task of its own: see `protect`.)
///
/// Spawning the whole protocol up front would give the same guarantee, at
/// the price of a task, a hand-over and a wake-up on every request, which
/// replays and conflicts would pay too.
pub(crate) struct Detachable<F: Future<Output = Response> + Send + 'static> {
    /// `None` once it answered.
    rest: Option<Pin<Box<F>>>,
    /// The runtime it started on, where it finishes even when the request is
    /// dropped on a thread of no runtime's.
    runtime: Option<tokio::runtime::Handle>,
}

impl<F: Future<Output = Response> + Send + 'static> Detachable<F> {
    /// `protocol`, already boxed, on the runtime this is called on.
    pub(crate) fn boxed(protocol: Pin<Box<F>>) -> Self {
        Detachable {
            rest: Some(protocol),
            runtime: tokio::runtime::Handle::try_current().ok(),
        }
    }
}

impl<F: Future<Output = Response> + Send + 'static> Future for Detachable<F> {
    type Output = Response;

    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Response> {
        let Some(rest) = self.rest.as_mut() else {
            // Polled after it answered: a caller's bug, answered as an
            // error rather than a panic in the server.
            return std::task::Poll::Ready(Problem::HandlerFailed.into_response());
        };
        // The handler's and the body's panics are caught inside; one that
        // escapes anyway (a store's) is this request's 500, not the
        // connection's.
        let polled = std::panic::catch_unwind(AssertUnwindSafe(|| rest.as_mut().poll(cx)));
        match polled {
            Ok(std::task::Poll::Pending) => std::task::Poll::Pending,
            Ok(std::task::Poll::Ready(response)) => {
                self.rest = None;
                std::task::Poll::Ready(response)
            }
            Err(panic) => {
                self.rest = None;
                tracing::error!(panic = %panic_message(&*panic), "the idempotency protocol panicked");
                std::task::Poll::Ready(Problem::HandlerFailed.into_response())
            }
        }
    }
}

impl<F: Future<Output = Response> + Send + 'static> Drop for Detachable<F> {
    fn drop(&mut self) {
        if let Some(rest) = self.rest.take() {
            // Its next poll, in the new task, registers that task's waker
            // with whatever it waits on.
            match self
                .runtime
                .take()
                .or_else(|| tokio::runtime::Handle::try_current().ok())
            {
                // A runtime that is shutting down drops it, as it drops
                // every task.
                Some(runtime) => drop(runtime.spawn(rest)),
                // Built outside any runtime and dropped outside one too:
                // nowhere to finish it.
                None => drop(rest),
            }
        }
    }
}

/// The tenant a request's records are keyed by; `None`, logged, when none
/// was established (and the layer is not single-tenant) or it cannot key a
/// record: the request is answered 500 `idempotency-misconfigured`, a
/// keyless one to an `optional` handler too, which stores nothing but would
/// otherwise hide the misconfiguration until a key comes.
fn tenant_id(engine: &Engine, tenant: Option<&Tenant>) -> Option<String> {
    match (tenant, engine.single_tenant) {
        (Some(t), _) if !Tenant::storable(t.as_str()) => {
            // Every store must key a record by it: refused the same way on
            // all of them, before any store call.
            tracing::error!(
                len = t.as_str().len(),
                "the tenant id cannot key a record: it must be 1 to {} bytes without control characters",
                Tenant::MAX_LEN
            );
            None
        }
        (Some(t), _) => Some(t.as_str().to_owned()),
        (None, true) => Some(String::new()),
        (None, false) => {
            tracing::error!(
                "no tenant for this request: insert an `idem::Tenant` into the request extensions in \
                 your auth layer (a middleware, or an extractor of the handler's), or call \
                 `Idem::single_tenant()` if the service has one tenant"
            );
            None
        }
    }
}

/// The protocol for one keyed request: tenant, fingerprint, reserve, then
/// execute under the lease, or answer from the record.
pub(crate) async fn protect(
    engine: Arc<Engine>,
    tenant: Option<Tenant>,
    spec: &'static Spec,
    fingerprint: crate::fingerprint::Printed,
    key: IdempotencyKey,
    handler: Unrun,
    reader: Reader,
) -> Response {
    let Some(tenant) = tenant_id(&engine, tenant.as_ref()) else {
        return Problem::Misconfigured.into_response();
    };
    let fingerprint = match fingerprint {
        Ok(fp) => fp,
        Err(e) => {
            record(Outcome::BodyInvalid);
            return Problem::BodyInvalid(e.to_string()).into_response();
        }
    };
    let id = RecordId::new(tenant, spec.scope, key.into_string());
    let waited_until = spec.wait.map(|w| Instant::now() + w);
    let mut pause = Duration::from_millis(20);
    loop {
        // A token of its own for each try of a `wait`: a store may still
        // hand back, fenced by its token, a key that an earlier try took
        // after it was answered 409 (a PostgreSQL group's statement that
        // failed after its read apart answered), and with one token for
        // all that would give back the key this try took and is running.
        let token = crate::store::random_token_inline();
        let request = ReserveRequest {
            id: &id,
            fingerprint: fingerprint.as_str(),
            token: token.as_str(),
            ttl: spec.ttl.unwrap_or(engine.ttl),
            lock_timeout: spec.lock_timeout.unwrap_or(engine.lock_timeout),
        };
        let asked = Instant::now();
        let reservation = match engine.store.reserve(request).await {
            Ok(r) => r,
            Err(e) => {
                record(Outcome::StoreUnavailable);
                tracing::error!(error = %e, "idempotency store failed; refusing the request");
                // The reservation may have committed although its answer
                // never came: hand the key back, fenced by our token. How it
                // was found is not known (fresh, released, or a stale lock
                // taken over): it goes back as a stale lock, so that the
                // next request is told it takes over if it took one over.
                hand_back_in_own_task(&engine, &id, token.as_str(), request.lock_timeout).await;
                return Problem::StoreUnavailable(Unavailable::NotProcessed).into_response();
            }
        };
        match reservation {
            Reservation::Reserved(lease) => {
                tracing::Span::current().record("attempt", lease.attempt);
                // The store set the deadline after `asked`: counting from
                // it errs on the safe side.
                let clock = LeaseClock::new(asked, request.lock_timeout);
                // The execution runs in a task of its own: the handler runs
                // the same way whether its client stays or leaves (it never
                // sees the request task's task-locals), and it goes on
                // while the request's future is not polled (the lease
                // keeper extends its lock meanwhile). A replay or a
                // conflict (most of what a retry storm sends) spawns
                // nothing. Boxed: the task then holds a pointer, and the
                // runtime moves a pointer, not the execution's state, each
                // time the task starts, finishes or hands over its answer.
                let execution = tokio::spawn(
                    Box::pin(execute(engine, id, lease, clock, handler, reader)).in_current_span(),
                );
                return match execution.await {
                    Ok(response) => response,
                    // The handler's and its body's panics are caught inside;
                    // this is a store's.
                    Err(_) => Problem::HandlerFailed.into_response(),
                };
            }
            Reservation::Completed(stored) => {
                return match replay(stored) {
                    Ok(answer) => {
                        record(Outcome::Replayed);
                        answer
                    }
                    Err(why) => {
                        record(Outcome::StoreUnavailable);
                        tracing::error!(
                            why,
                            "the stored answer cannot be replayed (a record edited by hand?); refusing the request"
                        );
                        Problem::StoreUnavailable(Unavailable::NotProcessed).into_response()
                    }
                };
            }
            Reservation::Mismatch => {
                record(Outcome::Mismatch);
                return Problem::KeyReused.into_response();
            }
            Reservation::InProgress { retry_after } => {
                let now = Instant::now();
                match waited_until {
                    Some(deadline) if now < deadline => {
                        tokio::time::sleep(pause.min(deadline - now)).await;
                        pause = (pause * 2).min(Duration::from_millis(250));
                    }
                    _ => {
                        record(Outcome::InProgress);
                        return Problem::InProgress { retry_after }.into_response();
                    }
                }
            }
        }
    }
}

/// [`hand_back_key`] of a key whose reservation failed, in a task of its
/// own, awaited: it runs to its end even while
/// the request's future is not polled (a SQLite release waits for, then
/// holds, the process's turn at the write lock).
async fn hand_back_in_own_task(engine: &Arc<Engine>, id: &RecordId, token: &str, lock_timeout: Duration) {
    let (engine, id, token) = (engine.clone(), id.clone(), token.to_owned());
    let giving_back = async move {
        let _ = hand_back_key(&engine, &id, &token, lock_timeout, true).await;
    };
    let _ = tokio::spawn(giving_back.in_current_span()).await;
}

/// Hands back a key this reservation took but never ran, as it was found
/// (see [`crate::IdempotencyStore::hand_back`]).
pub(crate) async fn unrun(engine: &Arc<Engine>, id: &RecordId, lease: &Lease, lock_timeout: Duration) {
    let _ = hand_back_key(engine, id, &lease.token, lock_timeout, lease.is_takeover()).await;
}

/// How a keyed request ended, as its `idem` span's `outcome` field says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Without a key, on an `optional` handler.
    Unprotected,
    /// A body that cannot be fingerprinted: 400.
    BodyInvalid,
    /// The store failed before the handler ran: 503.
    StoreUnavailable,
    /// A stored answer was replayed.
    Replayed,
    /// The key belongs to another request: 422.
    Mismatch,
    /// Another execution holds the lock: 409.
    InProgress,
    /// The handler ran and its answer was recorded.
    Executed,
    /// The handler ran after taking over a stale lock, and its answer was
    /// recorded.
    Takeover,
    /// Released as failed.
    Released,
    /// Released as rejected.
    Rejected,
    /// Fenced out: another execution owns the record.
    LockLost,
    /// The answer could not be recorded: 503.
    NotRecorded,
    /// The commit of the handler's transaction failed: its fate is unknown.
    CommitUnknown,
    /// SQLite ended the handler's transaction by itself before its
    /// outcome: nothing recorded, released as failed.
    TransactionLost,
}

impl Outcome {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Outcome::Unprotected => "unprotected",
            Outcome::BodyInvalid => "body_invalid",
            Outcome::StoreUnavailable => "store_unavailable",
            Outcome::Replayed => "replayed",
            Outcome::Mismatch => "mismatch",
            Outcome::InProgress => "in_progress",
            Outcome::Executed => "executed",
            Outcome::Takeover => "takeover",
            Outcome::Released => "released",
            Outcome::Rejected => "rejected",
            Outcome::LockLost => "lock_lost",
            Outcome::NotRecorded => "not_recorded",
            Outcome::CommitUnknown => "commit_unknown",
            Outcome::TransactionLost => "transaction_lost",
        }
    }

    /// An execution's recorded answer: a takeover's, or a plain one.
    pub(crate) fn executed(takeover: bool) -> Self {
        if takeover {
            Outcome::Takeover
        } else {
            Outcome::Executed
        }
    }
}

/// Records how this request ended on its span.
pub(crate) fn record(outcome: Outcome) {
    tracing::Span::current().record("outcome", outcome.as_str());
}

/// Runs the handler, produces its answer and records the outcome, all under
/// the lease: the lock is extended until the completion is recorded.
///
/// The record's id and lease go where the handler and the outcome read them
/// before the future is built, so that the future, which the execution's
/// task boxes, holds one pointer to them rather than their copies.
pub(crate) fn execute(
    engine: Arc<Engine>,
    id: RecordId,
    lease: Lease,
    clock: LeaseClock,
    handler: Unrun,
    reader: Reader,
) -> impl Future<Output = Response> + Send + 'static {
    let info = OperationInfo::new(engine.store.clone(), id, lease, clock.lock_timeout);
    async move {
        if clock.too_late_to_start(Instant::now()) {
            // Answered so late (its request was not polled meanwhile, or its
            // thread or this task was starved) that the lock may have run out
            // before its first extension, with nothing extending it until now:
            // another execution may hold the key by then, so this one must not
            // start. Nothing ran: the key goes back as it was found (fenced by
            // the token: nothing happens if it was taken over meanwhile), and
            // the retry really retries.
            record(Outcome::StoreUnavailable);
            tracing::warn!(
                "the reservation was answered too close to its lock deadline; giving the key back"
            );
            unrun(&engine, &info.id, &info.lease, clock.lock_timeout).await;
            return Problem::StoreUnavailable(Unavailable::NotProcessed).into_response();
        }
        let handler = handler.run(Some(Operation { info: info.clone() }));
        if info.lease.is_takeover() {
            tracing::warn!(
                attempt = info.lease.attempt,
                "taking over an operation whose lock ran out"
            );
        }
        // Under way until its completion or release is recorded, which
        // the lease's keeper lasts until (`Idem::idle`).
        let beat = Heartbeat::start(&info, clock, engine.under_way.enter());
        let outcome = AssertUnwindSafe(handler).catch_unwind().await;
        pause_point!(crate::pause::HANDLER_RETURNED, &info.id.key);
        finish(&engine, &info, clock.lock_timeout, outcome, beat, reader).await
    }
}

pub(crate) type Caught = Result<(Response, Option<Classification>), Box<dyn std::any::Any + Send>>;

/// Classifies the outcome, produces the answer and records it; `beat`
/// keeps the lease until then. The handler's transaction, if it opened one,
/// is taken on the way ([`OperationInfo::take_tx`]): after the answer's
/// body was read when it is recorded, before the key is let go otherwise.
///
/// What needs no waiting (a panic, the classification, the rebased problem)
/// is worked out before the future is built, so that the future holds only
/// what is left to await: the execution's future, with this one inside,
/// stays under the size that the allocator serves from its per-thread cache.
pub(crate) fn finish<'a>(
    engine: &'a Arc<Engine>,
    info: &'a OperationInfo,
    lock_timeout: Duration,
    outcome: Caught,
    beat: Heartbeat,
    reader: Reader,
) -> Either<impl Future<Output = Response> + Send + 'a, impl Future<Output = Response> + Send + 'a> {
    let (response, declared) = match outcome {
        Ok(pair) => pair,
        Err(panic) => {
            tracing::error!(panic = %panic_message(&*panic), "the handler panicked; releasing the key");
            // The payload is dropped once the key is let go: its drop is
            // the handler's code, which may panic again.
            return Either::Left(keeping(
                engine,
                info,
                lock_timeout,
                beat,
                Some(panic),
                Problem::HandlerFailed.into_response(),
                LetGo::Fail,
            ));
        }
    };
    // A 1xx other than 101 (an upgrade, which hyper sends as the final
    // answer) is no final answer: HTTP cannot send it as one (hyper answers
    // 500 instead), so it is neither stored nor given; released as failed,
    // as a panic is, whatever the handler's error type says.
    if crate::classify::never_final(response.status()) {
        tracing::error!(
            status = response.status().as_u16(),
            "the handler answered with an informational status, which is no final answer; releasing the key"
        );
        drop_unsent(response);
        let failed = Problem::HandlerFailed.into_response();
        return Either::Left(keeping(
            engine,
            info,
            lock_timeout,
            beat,
            None,
            failed,
            LetGo::Fail,
        ));
    }
    // A problem of the handler's own is stored, and so replayed, as its
    // client first gets it: under the configured base.
    let response = match &engine.problem_base {
        Some(base) => crate::problem::rebase(response, base),
        None => response,
    };
    // Kept or let go, the answer's body is produced under the lease: a
    // retry meanwhile gets 409, never a second execution beside it (but
    // for a handler's transaction: below).
    let how = match declared.unwrap_or_else(|| Classification::from_status(response.status())) {
        Classification::Reject => Some(LetGo::Reject),
        Classification::Release => Some(LetGo::Fail),
        Classification::Store => None,
    };
    if let Some(how) = how.filter(|_| info.has_tx()) {
        // With the handler's transaction, which a task may hold while it
        // feeds this very body: rolled back and the key let go once the
        // connection is free, then the answer given (README, "Multi-step
        // operations").
        return Either::Left(keeping(engine, info, lock_timeout, beat, None, response, how));
    }
    let (parts, body) = response.into_parts();
    Either::Right(complete_answer(
        engine,
        info,
        lock_timeout,
        parts,
        body,
        beat,
        reader,
        how,
    ))
}

/// The key let go as `how`, with the lease kept until that is done, and
/// then `panic`, the handler's panic payload if it panicked, dropped, and
/// then the answer given: for an answer of idem's own (a panic's, a 1xx's),
/// whose body is whole, and for a rejection or a failure of a handler that
/// opened a transaction (see `finish`). Boxed: only some executions take
/// this step.
fn keeping<'a>(
    engine: &'a Arc<Engine>,
    info: &'a OperationInfo,
    lock_timeout: Duration,
    beat: Heartbeat,
    panic: Option<Box<dyn std::any::Any + Send>>,
    response: Response,
    how: LetGo,
) -> crate::store::BoxFuture<'a, Response> {
    Box::pin(async move {
        // Its body is passed on as data, as a stored answer's is: trailers
        // are neither kept nor passed on, so none is announced (README).
        let (mut parts, body) = response.into_parts();
        parts.headers.remove(axum::http::header::TRAILER);
        let response = Response::from_parts(parts, Body::new(DataOnly(body)));
        let Some(tx) = info.try_take_tx() else {
            return keeping_held(engine, info, lock_timeout, beat, panic, response, how).await;
        };
        let response = let_go(engine, info, lock_timeout, tx, response, how).await;
        drop(panic);
        drop(beat);
        response
    })
}

/// A body's data frames, its trailers left out; its size and end as the
/// body says.
struct DataOnly(Body);

impl http_body::Body for DataOnly {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        loop {
            match std::task::ready!(Pin::new(&mut self.0).poll_frame(cx)) {
                Some(Ok(frame)) if !frame.is_data() => {}
                other => return std::task::Poll::Ready(other),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.0.size_hint()
    }
}

/// [`keeping`] while a task holds the transaction's connection, which it
/// may hold until this very body is read (it may be feeding it). The body
/// is read meanwhile, up to the stored limit, until the connection is let
/// go; the rest, if any, is passed on unread after the let-go, as on every
/// other path. Within one lock timeout: past it (an event stream kept open,
/// a body fed beyond the limit), [`let_go_once_free`]. A panic payload
/// (the handler's, or its body's) is dropped once the key is let go: its
/// drop is the handler's code, which may panic again.
async fn keeping_held(
    engine: &Arc<Engine>,
    info: &OperationInfo,
    lock_timeout: Duration,
    beat: Heartbeat,
    mut panic: Option<Box<dyn std::any::Any + Send>>,
    response: Response,
    how: LetGo,
) -> Response {
    enum Tail {
        Open,
        Ended,
        Failed(axum::Error),
    }
    let (parts, body) = response.into_parts();
    let mut rest = body.into_data_stream();
    let (mut head, mut len, mut tail) = (Vec::new(), 0usize, Tail::Open);
    let mut slot = std::pin::pin!(info.tx.lock());
    let mut deadline = std::pin::pin!(tokio::time::sleep(lock_timeout));
    let slot = loop {
        let reading = matches!(tail, Tail::Open) && len <= engine.max_stored_body;
        tokio::select! {
            // The deadline before the body: a body always ready (empty
            // chunks) cannot hold it off.
            biased;
            slot = &mut slot => break Some(slot),
            () = &mut deadline => break None,
            next = AssertUnwindSafe(rest.next()).catch_unwind(), if reading => {
                match next {
                    Ok(Some(Ok(chunk))) => {
                        len = len.saturating_add(chunk.len());
                        head.push(chunk);
                        // A body always ready never returns Pending: the
                        // runtime gets its turn here, to drive the deadline
                        // and the lease's extensions (on a current-thread
                        // runtime, nothing else would).
                        tokio::task::consume_budget().await;
                        continue;
                    }
                    Ok(None) => tail = Tail::Ended,
                    Ok(Some(Err(e))) => tail = Tail::Failed(e),
                    Err(body_panic) => {
                        tracing::error!(panic = %panic_message(&*body_panic), "the response body panicked");
                        let e = axum::Error::new(std::io::Error::other("the response body panicked"));
                        tail = Tail::Failed(e);
                        // Of the handler and its body, at most one panicked: a
                        // panic's answer is idem's own problem, whose body does not.
                        panic = panic.or(Some(body_panic));
                    }
                }
                // The body is done with: dropped now, as the free path
                // drops it, since the task may let go only once it is
                // (its feeding ends).
                drop_caught(std::mem::replace(&mut rest, Body::empty().into_data_stream()), &mut panic);
            },
        }
    };
    let Some(mut slot) = slot else {
        // Its status and headers are not given either (their extensions
        // are the handler's code).
        drop_unsent(Response::from_parts(parts, Body::empty()));
        return let_go_once_free(engine, info, lock_timeout, beat, how, panic, Some(rest));
    };
    let tx = info.close_tx(&mut slot);
    drop(slot);
    let head = futures_util::stream::iter(head.into_iter().map(Ok::<_, axum::Error>));
    let body = match tail {
        Tail::Open => Body::from_stream(head.chain(rest)),
        Tail::Ended => Body::from_stream(head),
        // What was read, then the failure where it happened: after a
        // yield, as it came (a body fails after waiting), so that the
        // server sends the head before the failure cuts the connection.
        Tail::Failed(e) => Body::from_stream(head.chain(futures_util::stream::once(async move {
            tokio::task::yield_now().await;
            Err::<axum::body::Bytes, _>(e)
        }))),
    };
    let response = let_go(
        engine,
        info,
        lock_timeout,
        tx,
        Response::from_parts(parts, body),
        how,
    )
    .await;
    drop(panic);
    drop(beat);
    response
}

/// Drops an answer that is not given (the handler's code: its drop may
/// panic), once the key is let go: a panic caught and logged, and its
/// payload dropped the same way (forgotten if that panics too).
pub(crate) fn drop_unsent(response: Response) {
    drop_quietly(response, "an answer not given");
}

/// Drops `value`, the user's code, its panic caught and logged as `what`'s,
/// and the panic's payload dropped the same way (forgotten if that panics
/// too).
fn drop_quietly<T>(value: T, what: &'static str) {
    let mut payload = None;
    keep_drop_panic(value, what, &mut payload);
    if let Err(again) = std::panic::catch_unwind(AssertUnwindSafe(move || drop(payload))) {
        std::mem::forget(again);
    }
}

/// Drops `value`, the user's code: its panic caught and logged as `what`'s,
/// its payload kept in `panic` (to be dropped once the key is let go), or
/// forgotten if one is there already (its drop could panic again).
fn keep_drop_panic<T>(value: T, what: &'static str, panic: &mut Option<Box<dyn std::any::Any + Send>>) {
    if let Err(drop_panic) = std::panic::catch_unwind(AssertUnwindSafe(move || drop(value))) {
        tracing::error!(panic = %panic_message(&*drop_panic), "{what} panicked when dropped");
        match panic {
            Some(_) => std::mem::forget(drop_panic),
            None => *panic = Some(drop_panic),
        }
    }
}

/// The handler, not run yet. What its extractors made is the user's code,
/// whose drop may panic: dropped unrun (a replay, a 409, a refused key),
/// the panic is caught, and the answer stays what it is.
pub(crate) struct Unrun(Handler);

impl Unrun {
    fn run(mut self, op: Option<Operation>) -> HandlerFuture {
        std::mem::replace(&mut self.0, spent())(op)
    }
}

impl Drop for Unrun {
    fn drop(&mut self) {
        drop_quietly(
            std::mem::replace(&mut self.0, spent()),
            "the handler's arguments (not run)",
        );
    }
}

/// What is left of a handler once it ran: nothing (a closure and a future
/// of no size: boxing them allocates nothing), never called.
fn spent() -> Handler {
    Box::new(|_| Box::pin(std::future::pending()))
}

/// Drops what is left of a response body, whose drop is the handler's code
/// and may panic: see [`keep_drop_panic`].
pub(crate) fn drop_caught(
    body: axum::body::BodyDataStream,
    panic: &mut Option<Box<dyn std::any::Any + Send>>,
) {
    keep_drop_panic(body, "the response body", panic);
}

/// A task kept the handler's transaction connection (a task the handler
/// left holding `op`) for a whole lock timeout after its execution came to
/// take it: the answer waits no longer. The client gets 503, and its retry
/// gets 409 until the task lets the connection go; then a task spawned here
/// rolls the transaction back and lets the key go as `how` (a rejection
/// stays one), under the lease until then, and drops `panic` after that.
/// Nothing the task wrote commits: no transaction opens through `op` any
/// more. `body`, the rest of an answer's body that may be what the task
/// waits to feed, is dropped first (its drop caught: the handler's code).
pub(crate) fn let_go_once_free(
    engine: &Arc<Engine>,
    info: &OperationInfo,
    lock_timeout: Duration,
    beat: Heartbeat,
    how: LetGo,
    panic: Option<Box<dyn std::any::Any + Send>>,
    body: Option<axum::body::BodyDataStream>,
) -> Response {
    record(if how == LetGo::Reject {
        Outcome::Rejected
    } else {
        Outcome::Released
    });
    tracing::error!(
        "a task kept the handler's transaction connection for a lock timeout after its execution came to \
         take it; answering 503: the transaction is rolled back, and the key released, once it lets go"
    );
    info.refuse_tx();
    let (engine, info) = (engine.clone(), info.clone());
    let releasing = async move {
        let mut panic = panic;
        if let Some(body) = body {
            drop_caught(body, &mut panic);
        }
        let tx = info.take_tx_when_free().await;
        let _ = let_go(&engine, &info, lock_timeout, tx, Response::default(), how).await;
        drop(panic);
        drop(beat);
    };
    tokio::spawn(releasing.in_current_span());
    Problem::StoreUnavailable(Unavailable::NotCompleted).into_response()
}

/// Whether an answer with `status` has no body on the wire: an
/// informational one, 204 No Content, 304 Not Modified (RFC 9110 6.4.1).
fn carries_no_body(status: axum::http::StatusCode) -> bool {
    status.is_informational()
        || status == axum::http::StatusCode::NO_CONTENT
        || status == axum::http::StatusCode::NOT_MODIFIED
}

/// The handler's answer: its body produced under the lease, then recorded
/// (`how` is `None`: a success, a business rejection) or the key let go as
/// `how` says (a failure, a rejected request), then given. A body larger
/// than the stored limit streams to the client still under the lease, and
/// is recorded or let go when it ends.
// Not an async fn, which would copy its arguments into its state twice.
#[allow(clippy::manual_async_fn, clippy::too_many_arguments)]
fn complete_answer<'a>(
    engine: &'a Arc<Engine>,
    info: &'a OperationInfo,
    lock_timeout: Duration,
    mut parts: axum::http::response::Parts,
    body: Body,
    beat: Heartbeat,
    reader: Reader,
    how: Option<LetGo>,
) -> impl Future<Output = Response> + Send + 'a {
    async move {
        // The body is read as data: its trailers are neither stored nor
        // passed on, so the answer does not announce any (README).
        parts.headers.remove(axum::http::header::TRAILER);
        // A payload of the body's drop (the handler's code), dropped on
        // leaving, once the key is let go or the answer recorded.
        let mut body_panic = None;
        // A status that carries no body (1xx, 204, 304): the server sends
        // none and never reads the handler's (hyper drops it unread), so
        // neither does idem: the answer is its status and headers, recorded
        // before they go out. Read, a body past the stored limit streamed
        // (the client seeing a whole answer at its head) and, failing, let
        // the key go: the retry ran the handler again.
        let no_body = carries_no_body(parts.status);
        let body = if no_body {
            drop_caught(body.into_data_stream(), &mut body_panic);
            Body::empty()
        } else {
            body
        };
        // (An event stream's type on a status without a body streams
        // nothing: recorded whole, its headers replayed as they went out.)
        let stream = !no_body
            && parts
                .headers
                .get(CONTENT_TYPE)
                .is_some_and(|v| is_event_stream(v.as_bytes()));
        // A client that could not tell a broken body from a whole one (a
        // `HEAD`, HTTP/1.0 without a length) gets an answer too large to keep
        // only once it is recorded: read to its end first.
        let sees_breaks = reader.sees_breaks(&parts.headers);
        let collected = AssertUnwindSafe(async {
            match collect(body, engine.max_stored_body, stream, &mut body_panic).await {
                // Boxed: the common answers' futures stay as small as they were.
                // (An answer let go too: its client gets it once the key is.)
                Collected::Streamed { head, rest } if !stream && !sees_breaks => {
                    Box::pin(drain(reader, head, rest, &mut body_panic)).await
                }
                collected => collected,
            }
        })
        .catch_unwind()
        .await;
        // The transaction is taken once the body was read, since the task
        // that feeds it may hold its connection until then; an answer that
        // streams on takes it when its body ends.
        let lost = info.is_lost();
        let mut collected = collected;
        if let (true, Ok(Collected::Streamed { rest, .. })) = (lost, &mut collected) {
            // Already lost: none of the rest is given. Dropped before the
            // transaction is taken, since a task that feeds it until it is
            // gone lets the connection go only then.
            drop_caught(
                std::mem::replace(rest, Body::empty().into_data_stream()),
                &mut body_panic,
            );
        }
        let streams_on = matches!(collected, Ok(Collected::Streamed { .. })) && !stream && !lost;
        let tx = if streams_on {
            None
        } else {
            match info.take_tx(lock_timeout).await {
                Ok(tx) => tx,
                Err(TxHeld) => {
                    // What the body left (a panic's payload, the rest of an
                    // event stream) goes with the let-go: dropped after it.
                    let (panic, rest) = match collected {
                        Err(payload) => (Some(payload), None),
                        Ok(Collected::Streamed { rest, .. }) => (body_panic, Some(rest)),
                        Ok(_) => (body_panic, None),
                    };
                    drop_unsent(Response::from_parts(parts, Body::empty()));
                    let how = how.unwrap_or(LetGo::Fail);
                    return let_go_once_free(engine, info, lock_timeout, beat, how, panic, rest);
                }
            }
        };
        let collected = match collected {
            Ok(collected) => collected,
            Err(panic) => {
                let refused = panicked(
                    engine,
                    info,
                    lock_timeout,
                    tx,
                    "the response body",
                    panic_message(&*panic),
                )
                .await;
                drop_unsent(Response::from_parts(parts, Body::empty()));
                return refused;
            }
        };
        let mut stored = StoredResponse {
            status: parts.status.as_u16(),
            headers: engine
                .replay_headers
                .iter()
                .flat_map(|name| parts.headers.get_all(name).iter().map(move |v| (name, v)))
                .map(|(name, v)| (name.as_str().to_owned(), v.as_bytes().to_vec()))
                .collect(),
            body: None,
        };
        // `None`: the answer is the stored body, handed over once it is recorded.
        let answer = match collected {
            // Given as it is, not kept.
            Collected::Whole(bytes) if how.is_some() => Some(Body::from(bytes)),
            Collected::Whole(bytes) => {
                // No copy when the body is one buffer that nothing else holds.
                stored.body = Some(Vec::from(bytes));
                None
            }
            Collected::Over(read, len) => {
                if how.is_none() {
                    tracing::warn!(
                        limit = engine.max_stored_body,
                        "response body larger than the stored limit: a replay gets status and headers only"
                    );
                }
                // Recorded (status and headers), or its key let go, before
                // any of it goes out.
                match read {
                    // With its length, which the client can check.
                    Some(read) => {
                        let len = read.iter().map(axum::body::Bytes::len).sum::<usize>();
                        parts.headers.insert(CONTENT_LENGTH, HeaderValue::from(len));
                        Some(Body::from_stream(futures_util::stream::iter(
                            read.into_iter().map(Ok::<_, axum::Error>),
                        )))
                    }
                    None => {
                        if reader == Reader::UntilClose {
                            // Past what is held for it: what a replay gets,
                            // the status and headers, said so.
                            for described in crate::answer::BODY_DESCRIPTION {
                                parts.headers.remove(described);
                            }
                            parts
                                .headers
                                .insert(BODY_OMITTED, HeaderValue::from_static("true"));
                        } else {
                            // A `HEAD`: told the length its `GET` would
                            // have, not the empty body's (RFC 9110 9.3.2).
                            parts.headers.insert(CONTENT_LENGTH, HeaderValue::from(len));
                        }
                        Some(Body::empty())
                    }
                }
            }
            Collected::Streamed { head, rest } if stream => {
                // An event stream may never end: it is completed at its
                // headers, and then streams.
                let head = futures_util::stream::iter(head.into_iter().map(Ok::<_, axum::Error>));
                Some(Body::from_stream(head.chain(rest)))
            }
            Collected::Streamed { .. } if lost => {
                // Already lost (the handler was told): none of it is given (its
                // status and first bytes would go out before the completion
                // that refuses it). A loss from here on, or a takeover the
                // keeper has not seen, breaks the body (docs/PROTOCOL.md).
                let refused = Box::pin(refuse_lost(engine, info, lock_timeout, tx)).await;
                drop_unsent(Response::from_parts(parts, Body::empty()));
                return refused;
            }
            Collected::Streamed { head, rest } => {
                let end = match how {
                    Some(how) => End::LetGo(how),
                    None => {
                        tracing::warn!(
                            limit = engine.max_stored_body,
                            "response body larger than the stored limit: a replay gets status and headers only"
                        );
                        End::Complete(stored)
                    }
                };
                let (to_client, from_task) = tokio::sync::mpsc::channel(1);
                let streamer = stream_then_complete(StreamedAnswer {
                    engine: engine.clone(),
                    info: info.clone(),
                    lock_timeout,
                    end,
                    beat,
                    head,
                    rest,
                    client: Some(to_client),
                });
                tokio::spawn(streamer.in_current_span());
                // The body ends only on `End`: a streamer that stops without it
                // breaks the client's connection instead.
                let body = futures_util::stream::unfold(Some(from_task), |rx| async move {
                    let mut rx = rx?;
                    match rx.recv().await {
                        Some(Frame::Data(bytes)) => Some((Ok(bytes), Some(rx))),
                        Some(Frame::End) => None,
                        Some(Frame::Fail(e)) => Some((Err(e), None)),
                        None => Some((Err(axum::Error::new(std::io::Error::other(ABANDONED))), None)),
                    }
                });
                return Response::from_parts(parts, Body::from_stream(body));
            }
            Collected::Failed(read, e) => {
                // Without idem the connection would break: so it does here, and
                // nothing is stored.
                tracing::error!(error = %e, "the response body failed while it was produced; releasing the key");
                if !sees_breaks {
                    // Its client could not tell a broken body from a whole
                    // one: it is told the handler failed instead.
                    drop_unsent(Response::from_parts(parts, Body::empty()));
                    return handler_failed(engine, info, lock_timeout, tx).await;
                }
                // An answer let go gets what was read of it, then the
                // failure where it came, after a yield (so that the server
                // sends the head before the failure cuts the connection).
                let head = (how.is_some() && !read.is_empty()).then_some(Ok(read));
                let broken = futures_util::stream::iter(head).chain(futures_util::stream::once(async move {
                    tokio::task::yield_now().await;
                    Err::<axum::body::Bytes, _>(e)
                }));
                return let_go(
                    engine,
                    info,
                    lock_timeout,
                    tx,
                    Response::from_parts(parts, Body::from_stream(broken)),
                    LetGo::Fail,
                )
                .await;
            }
        };
        if let Some(how) = how {
            let answer = Response::from_parts(parts, answer.unwrap_or_else(Body::empty));
            let answer = let_go(engine, info, lock_timeout, tx, answer, how).await;
            drop(beat);
            if let Some(payload) = body_panic.take() {
                drop_quietly(payload, "the response body's panic");
            }
            return answer;
        }
        if let Err(refusal) = record_completion(engine, info, lock_timeout, &stored, tx).await {
            drop_unsent(Response::from_parts(parts, answer.unwrap_or_else(Body::empty)));
            return refusal;
        }
        drop(beat);
        record(Outcome::executed(info.lease.is_takeover()));
        // Recorded: a payload whose own drop panics does not undo that.
        if let Some(payload) = body_panic.take() {
            drop_quietly(payload, "the response body's panic");
        }
        let answer = answer.unwrap_or_else(|| Body::from(stored.body.take().unwrap_or_default()));
        Response::from_parts(parts, answer)
    }
}

/// The media type of server-sent events, compared without regard to case.
pub(crate) const EVENT_STREAM: &[u8] = b"text/event-stream";

/// Whether a `content-type` names the event stream's media type
/// ([`EVENT_STREAM`], without regard to case, with or without parameters),
/// not another type that begins with its letters (`text/event-streamx`).
fn is_event_stream(content_type: &[u8]) -> bool {
    let Some((name, rest)) = content_type
        .trim_ascii_start()
        .split_at_checked(EVENT_STREAM.len())
    else {
        return false;
    };
    name.eq_ignore_ascii_case(EVENT_STREAM) && matches!(rest.trim_ascii_start().first(), None | Some(b';'))
}

pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_default()
}

/// A handler or response body that panicked: the key is released as failed
/// and the client gets 500 `handler-failed`.
fn panicked<'a>(
    engine: &'a Arc<Engine>,
    info: &'a OperationInfo,
    lock_timeout: Duration,
    tx: Option<PendingTx>,
    what: &str,
    panic: String,
) -> crate::store::BoxFuture<'a, Response> {
    tracing::error!(panic = %panic, "{what} panicked; releasing the key");
    handler_failed(engine, info, lock_timeout, tx)
}

/// The key released as failed, and the client told so (500 `handler-failed`).
fn handler_failed<'a>(
    engine: &'a Arc<Engine>,
    info: &'a OperationInfo,
    lock_timeout: Duration,
    tx: Option<PendingTx>,
) -> crate::store::BoxFuture<'a, Response> {
    let_go(
        engine,
        info,
        lock_timeout,
        tx,
        Problem::HandlerFailed.into_response(),
        LetGo::Fail,
    )
}
