//! The HTTP protocol around an annotated axum handler (contract sections 1,
//! 2, 5, 6, 7 and 9). The `#[idempotent]` attribute expands to one call of
//! [`run`]; everything else lives here.

use crate::{
    IdempotencyKey, IdempotencyStore, KeyError, Lease, RecordId, Reservation, ReserveRequest, StoreError,
    StoredResponse,
};
use axum::body::Body;
use axum::extract::FromRequestParts;
use axum::http::header::{HeaderName, HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::{FutureExt as _, StreamExt as _};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tracing::Instrument as _;

#[cfg(any(feature = "postgres", feature = "sqlite"))]
use crate::tx::TxConnection;
use crate::tx::{PendingTx, TxFailure};

/// A setting that would disable or break the protection, with the allowed
/// range.
///
/// ```
/// let err = idem::Idem::new(idem::MemoryStore::new()).lock_timeout(std::time::Duration::ZERO).unwrap_err();
/// assert!(err.to_string().contains("allowed: 100ms to 1d"));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError(String);

impl ConfigError {
    fn check(name: &str, value: Duration, range: &std::ops::RangeInclusive<Duration>) -> Result<(), Self> {
        if range.contains(&value) {
            return Ok(());
        }
        Err(ConfigError(format!(
            "{name} is {value:?}; allowed: {} to {}",
            human(*range.start()),
            human(*range.end())
        )))
    }
}

/// `100ms`, `1s`, `365d`: how the attribute writes durations.
fn human(d: Duration) -> String {
    let ms = d.as_millis();
    for (unit, size) in [("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1_000)] {
        if ms >= size && ms.is_multiple_of(size) {
            return format!("{}{unit}", ms / size);
        }
    }
    format!("{ms}ms")
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

/// The TTLs allowed: 1 second to 365 days (the attribute checks the same).
pub const TTL_RANGE: std::ops::RangeInclusive<Duration> =
    Duration::from_secs(1)..=Duration::from_secs(365 * 86_400);
/// The lock timeouts allowed: 100 milliseconds to 1 day (the attribute
/// checks the same).
pub const LOCK_TIMEOUT_RANGE: std::ops::RangeInclusive<Duration> =
    Duration::from_millis(100)..=Duration::from_secs(86_400);
/// The largest `max_stored_body`: 64 MiB.
pub const MAX_STORED_BODY_LIMIT: usize = 64 * 1024 * 1024;

/// The default record retention: 24 hours.
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 3600);
/// The default lock timeout: 60 seconds. It must exceed the longest
/// legitimate execution of a handler (the lease heartbeat extends it while
/// the handler runs, so only a dead process's lock expires).
pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(60);
/// The default limit of a stored response body: 1 MiB.
pub const DEFAULT_MAX_STORED_BODY: usize = 1024 * 1024;
/// The largest `Retry-After` of a 409, in seconds.
const MAX_RETRY_AFTER_SECS: u64 = 2;
/// The header that marks a replayed answer.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";
/// The header that marks a replay whose body was too large to keep.
pub const BODY_OMITTED_HEADER: &str = "idempotent-replay-body-omitted";

/// Headers that are never stored, even when named.
const NEVER_STORED: &[&str] = &[
    "set-cookie",
    "authorization",
    "proxy-authorization",
    "cookie",
    "date",
    "www-authenticate",
    "content-length",
    "transfer-encoding",
    "connection",
];

/// The authenticated principal, as the application's auth layer puts it in
/// the request extensions. Records are scoped by it: one tenant can neither
/// read nor block another's.
///
/// ```
/// use axum::{extract::Request, middleware::Next, response::Response};
/// use idem::Tenant;
///
/// async fn auth(mut req: Request, next: Next) -> Response {
///     // ... verify the credentials, then:
///     req.extensions_mut().insert(Tenant::new("acct_42"));
///     next.run(req).await
/// }
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Tenant(String);

impl Tenant {
    /// A tenant id, such as an account or API client id.
    ///
    /// ```
    /// assert_eq!(idem::Tenant::new("acct_1").as_str(), "acct_1");
    /// ```
    pub fn new(id: impl Into<String>) -> Self {
        Tenant(id.into())
    }

    /// The tenant id.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// How an outcome of the handler is recorded (contract section 6).
///
/// ```
/// use idem::Classification;
/// use axum::http::StatusCode;
///
/// assert_eq!(Classification::from_status(StatusCode::PAYMENT_REQUIRED), Classification::Store);
/// assert_eq!(Classification::from_status(StatusCode::SERVICE_UNAVAILABLE), Classification::Release);
/// assert_eq!(Classification::from_status(StatusCode::UNPROCESSABLE_ENTITY), Classification::Reject);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Classification {
    /// The answer is final: complete the record and replay it to retries.
    Store,
    /// Released as *failed*: something went wrong that a retry should really
    /// retry (408, 425, 429, 5xx, a panic). The record stays bound to its
    /// request: the same request retried continues the operation (the next
    /// attempt, recovery point, derived keys); another request with this
    /// key gets 422 until the record expires.
    Release,
    /// Released as *rejected*: the request was refused and nothing happened
    /// (400, 409, 422). The key is free: a fixed request with the same key
    /// starts a new operation. On a later attempt of an operation (one that
    /// failed before, or saved a recovery point) something may have
    /// happened, so it is kept bound as [`Classification::Release`] is.
    Reject,
}

impl Classification {
    /// The default rule: 2xx and 3xx are stored; 400, 409 and 422 are
    /// rejected; 408, 425, 429 and every 5xx are released as failed; every
    /// other 4xx is stored.
    ///
    /// ```
    /// # use idem::Classification;
    /// # use axum::http::StatusCode;
    /// assert_eq!(Classification::from_status(StatusCode::CONFLICT), Classification::Reject);
    /// assert_eq!(Classification::from_status(StatusCode::TOO_MANY_REQUESTS), Classification::Release);
    /// assert_eq!(Classification::from_status(StatusCode::NOT_FOUND), Classification::Store);
    /// ```
    pub fn from_status(status: StatusCode) -> Self {
        match status.as_u16() {
            400 | 409 | 422 => Classification::Reject,
            408 | 425 | 429 | 500..=599 => Classification::Release,
            _ => Classification::Store,
        }
    }
}

/// Lets a handler's error type (or whole return type) say how its outcome is
/// recorded, instead of the status code rule.
///
/// ```
/// use axum::{http::StatusCode, response::{IntoResponse, Response}};
/// use idem::{Classification, Classify};
///
/// enum PaymentError { Declined, GatewayDown }
///
/// impl IntoResponse for PaymentError {
///     fn into_response(self) -> Response {
///         match self {
///             PaymentError::Declined => StatusCode::PAYMENT_REQUIRED.into_response(),
///             PaymentError::GatewayDown => StatusCode::BAD_GATEWAY.into_response(),
///         }
///     }
/// }
///
/// impl Classify for PaymentError {
///     fn classify(&self) -> Classification {
///         match self {
///             PaymentError::Declined => Classification::Store,
///             PaymentError::GatewayDown => Classification::Release,
///         }
///     }
/// }
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` does not say how `#[idempotent]` should record it",
    note = "implement `idem::Classify` for `{Self}`"
)]
pub trait Classify {
    /// Store or release the record for this value.
    fn classify(&self) -> Classification;
}

/// The configured idempotency layer: a store plus the service-wide
/// defaults. Add it to the router with [`Idem::layer`].
///
/// ```no_run
/// use axum::{routing::post, Router};
/// use idem::{Idem, SqliteStore};
///
/// # async fn handler() {}
/// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let store = SqliteStore::open("idem.db").await?;
/// store.migrate().await?;
/// let app: Router = Router::new()
///     .route("/v1/payments", post(handler))
///     .layer(Idem::new(store).single_tenant().layer());
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Idem {
    inner: Arc<Engine>,
}

#[derive(Clone)]
struct Engine {
    store: Arc<dyn IdempotencyStore>,
    ttl: Duration,
    lock_timeout: Duration,
    single_tenant: bool,
    max_stored_body: usize,
    replay_headers: Vec<HeaderName>,
    /// What problem `type`s start with, when not [`PROBLEM_TYPE_PREFIX`].
    problem_base: Option<Arc<str>>,
}

impl std::fmt::Debug for Idem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idem")
            .field("ttl", &self.inner.ttl)
            .field("lock_timeout", &self.inner.lock_timeout)
            .field("single_tenant", &self.inner.single_tenant)
            .field("max_stored_body", &self.inner.max_stored_body)
            .finish_non_exhaustive()
    }
}

impl Idem {
    /// A layer over `store` with the defaults: TTL 24 hours, lock timeout
    /// 60 seconds, stored bodies up to 1 MiB, tenants required.
    ///
    /// ```
    /// let idem = idem::Idem::new(idem::MemoryStore::new());
    /// ```
    pub fn new(store: impl IdempotencyStore) -> Self {
        Self::from_arc(Arc::new(store))
    }

    /// Like [`Idem::new`], for a store that is already shared.
    ///
    /// ```
    /// use std::sync::Arc;
    /// let store: Arc<dyn idem::IdempotencyStore> = Arc::new(idem::MemoryStore::new());
    /// let idem = idem::Idem::from_arc(store);
    /// ```
    pub fn from_arc(store: Arc<dyn IdempotencyStore>) -> Self {
        Idem {
            inner: Arc::new(Engine {
                store,
                ttl: DEFAULT_TTL,
                lock_timeout: DEFAULT_LOCK_TIMEOUT,
                single_tenant: false,
                max_stored_body: DEFAULT_MAX_STORED_BODY,
                replay_headers: vec![CONTENT_TYPE, axum::http::header::LOCATION],
                problem_base: None,
            }),
        }
    }

    fn change(mut self, f: impl FnOnce(&mut Engine)) -> Self {
        // Copies the engine only when a clone of this `Idem` shares it.
        f(Arc::make_mut(&mut self.inner));
        self
    }

    /// How long records are kept (default 24 hours): how long an answer is
    /// replayed. Handlers can override it with `ttl = "..."`.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] outside [`TTL_RANGE`] (1 second to 365 days): a zero
    /// TTL would turn the protection off.
    ///
    /// ```
    /// let idem = idem::Idem::new(idem::MemoryStore::new()).ttl(std::time::Duration::from_secs(3600))?;
    /// assert!(idem::Idem::new(idem::MemoryStore::new()).ttl(std::time::Duration::ZERO).is_err());
    /// # Ok::<(), idem::ConfigError>(())
    /// ```
    pub fn ttl(self, ttl: Duration) -> Result<Self, ConfigError> {
        ConfigError::check("ttl", ttl, &TTL_RANGE)?;
        Ok(self.change(|e| e.ttl = ttl))
    }

    /// How long a lock holds before another request may take the operation
    /// over (default 60 seconds). It must exceed the longest legitimate
    /// execution that could stall without its heartbeat; while a handler
    /// runs its lock is extended every third of this time, so only a dead
    /// process's lock runs out.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] outside [`LOCK_TIMEOUT_RANGE`] (100 milliseconds to
    /// 1 day): a zero lock timeout would let concurrent duplicates run.
    ///
    /// ```
    /// let idem = idem::Idem::new(idem::MemoryStore::new()).lock_timeout(std::time::Duration::from_secs(30))?;
    /// # Ok::<(), idem::ConfigError>(())
    /// ```
    pub fn lock_timeout(self, lock_timeout: Duration) -> Result<Self, ConfigError> {
        ConfigError::check("lock_timeout", lock_timeout, &LOCK_TIMEOUT_RANGE)?;
        Ok(self.change(|e| e.lock_timeout = lock_timeout))
    }

    /// Serves one tenant: requests without a [`Tenant`] share one namespace.
    /// Without this call such requests are refused with 500, so that a
    /// missing auth layer never silently makes keys global.
    ///
    /// ```
    /// let idem = idem::Idem::new(idem::MemoryStore::new()).single_tenant();
    /// ```
    pub fn single_tenant(self) -> Self {
        self.change(|e| e.single_tenant = true)
    }

    /// The largest response body stored for replay (default 1 MiB). A larger
    /// answer still completes the record, so the handler never runs twice
    /// for one key, but only its status and headers are kept: a replay
    /// answers them with an empty body and `Idempotent-Replay-Body-Omitted: true`.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] past [`MAX_STORED_BODY_LIMIT`] (64 MiB).
    ///
    /// ```
    /// let idem = idem::Idem::new(idem::MemoryStore::new()).max_stored_body(64 * 1024)?;
    /// # Ok::<(), idem::ConfigError>(())
    /// ```
    pub fn max_stored_body(self, bytes: usize) -> Result<Self, ConfigError> {
        if bytes > MAX_STORED_BODY_LIMIT {
            return Err(ConfigError(format!(
                "max_stored_body is {bytes} bytes; allowed: 0 to {MAX_STORED_BODY_LIMIT} (64 MiB)"
            )));
        }
        Ok(self.change(|e| e.max_stored_body = bytes))
    }

    /// Also stores and replays these response headers (besides
    /// `content-type` and `location`).
    ///
    /// # Errors
    ///
    /// [`ConfigError`] for a name that is not a header name, or one that is
    /// never stored (`set-cookie`, `authorization`, `cookie`, `date`,
    /// `content-length` and the like: stored data must be safe to keep).
    ///
    /// ```
    /// let idem = idem::Idem::new(idem::MemoryStore::new()).replay_headers(["etag", "x-request-cost"])?;
    /// assert!(idem::Idem::new(idem::MemoryStore::new()).replay_headers(["set-cookie"]).is_err());
    /// # Ok::<(), idem::ConfigError>(())
    /// ```
    pub fn replay_headers<I, H>(self, names: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = H>,
        H: AsRef<str>,
    {
        let mut checked = Vec::new();
        for name in names {
            let name = name.as_ref();
            let n = HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| ConfigError(format!("replay_headers: `{name}` is not a header name")))?;
            if NEVER_STORED.contains(&n.as_str()) {
                return Err(ConfigError(format!(
                    "replay_headers: `{name}` is never stored (credentials, cookies and framing headers are not \
                     safe to keep or to replay)"
                )));
            }
            checked.push(n);
        }
        Ok(self.change(|e| {
            for n in checked {
                if !e.replay_headers.contains(&n) {
                    e.replay_headers.push(n);
                }
            }
        }))
    }

    /// Makes every problem `type` of this layer start with `base` instead of
    /// `urn:idem:problem:`, so that it points to the application's own
    /// documentation: `problem_type_base("https://docs.example.com/errors/")`
    /// gives `https://docs.example.com/errors/idempotency-key-reused`.
    ///
    /// ```
    /// let idem = idem::Idem::new(idem::MemoryStore::new()).problem_type_base("https://docs.example.com/errors/")?;
    /// # Ok::<(), idem::ConfigError>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`ConfigError`] for an empty base, or one with spaces.
    pub fn problem_type_base(self, base: impl Into<String>) -> Result<Self, ConfigError> {
        let base: String = base.into();
        if base.is_empty() || base.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(ConfigError(format!(
                "problem_type_base `{base}` must be a URI prefix without spaces, such as \
                 `https://docs.example.com/errors/`"
            )));
        }
        Ok(self.change(|e| e.problem_base = Some(base.into())))
    }

    /// Starts a [`crate::Janitor`] on this layer's store: every `every`,
    /// expired records are deleted in batches of `batch`.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] for `every` under 1 second or over 1 day, or `batch`
    /// outside 1 to 100,000.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idem::ConfigError> {
    /// let idem = idem::Idem::new(idem::MemoryStore::new());
    /// let janitor = idem.start_janitor(std::time::Duration::from_secs(300), 1000)?;
    /// # Ok(()) }
    /// ```
    pub fn start_janitor(&self, every: Duration, batch: u32) -> Result<crate::Janitor, ConfigError> {
        ConfigError::check(
            "janitor period",
            every,
            &(Duration::from_secs(1)..=Duration::from_secs(86_400)),
        )?;
        if !(1..=100_000).contains(&batch) {
            return Err(ConfigError(format!(
                "janitor batch is {batch}; allowed: 1 to 100000"
            )));
        }
        Ok(crate::Janitor::start(self.inner.store.clone(), every, batch))
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn IdempotencyStore> {
        &self.inner.store
    }

    /// The layer to add to the router: it makes this configuration
    /// available to every `#[idempotent]` handler below it.
    ///
    /// ```
    /// use axum::Router;
    /// let app: Router = Router::new().layer(idem::Idem::new(idem::MemoryStore::new()).layer());
    /// ```
    pub fn layer(self) -> axum::Extension<Idem> {
        axum::Extension(self)
    }
}

/// What one annotated handler declared in its attribute. Built by the macro.
#[doc(hidden)]
#[derive(Debug)]
pub struct Spec {
    pub scope: &'static str,
    /// Lowercase header name.
    pub header: &'static str,
    pub optional: bool,
    pub ttl: Option<Duration>,
    pub lock_timeout: Option<Duration>,
    pub wait: Option<Duration>,
    /// The declared fields' wire paths; `None` for the whole body.
    pub fields: Option<&'static [&'static str]>,
    /// Path parameters and query names that do not count.
    pub ignore: &'static [&'static str],
}

/// What the injected first parameter of an annotated handler extracts: the
/// configuration, the tenant, the request headers and what identifies the
/// request besides its body.
#[doc(hidden)]
pub struct Context {
    idem: Option<Idem>,
    tenant: Option<Tenant>,
    headers: HeaderMap,
    /// The route's path parameters.
    path: Vec<(String, String)>,
    query: Option<String>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").finish_non_exhaustive()
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Context {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        use axum::extract::rejection::RawPathParamsRejection;
        let path = match axum::extract::RawPathParams::from_request_parts(parts, state).await {
            Ok(params) => params.iter().map(|(k, v)| (k.to_owned(), v.to_owned())).collect(),
            Err(RawPathParamsRejection::MissingPathParams(_)) => Vec::new(),
            // Not UTF-8 once decoded: the raw path identifies it all the same.
            Err(_) => vec![(String::new(), parts.uri.path().to_owned())],
        };
        Ok(Context {
            idem: parts.extensions.get::<Idem>().cloned(),
            tenant: parts.extensions.get::<Tenant>().cloned(),
            headers: parts.headers.clone(),
            path,
            query: parts.uri.query().map(str::to_owned),
        })
    }
}

/// The fingerprint of the request: the scope, the path parameters, the
/// query and `body`, as the handler's attribute says.
#[doc(hidden)]
pub fn fingerprint_request(
    ctx: &Context,
    spec: &Spec,
    body: crate::BodyPrint<'_>,
    read: &[Option<Vec<u8>>],
) -> Result<String, crate::FingerprintError> {
    let path: Vec<(&str, &str)> = ctx.path.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let body = match body {
        crate::BodyPrint::Json { text, .. } => crate::BodyPrint::Json {
            text,
            fields: spec.fields,
            read: Some(read),
        },
        other => other,
    };
    crate::fingerprint(&crate::RequestPrint {
        scope: spec.scope,
        path: &path,
        query: ctx.query.as_deref(),
        body,
        ignore: spec.ignore,
    })
}

/// A raw body (`String`, `Bytes`) as the fingerprint sees it.
#[doc(hidden)]
pub fn raw<T: AsRef<[u8]>>(body: &T) -> crate::BodyPrint<'_> {
    crate::BodyPrint::Raw(body.as_ref())
}

/// A body extractor (`Json<T>`, `Form<T>`) and the bytes it was read from:
/// the handler gets the typed value, the fingerprint what the client sent.
/// Rejections are the extractor's own.
#[doc(hidden)]
pub struct Raw<E> {
    pub value: E,
    pub bytes: axum::body::Bytes,
}

impl<S, E> axum::extract::FromRequest<S> for Raw<E>
where
    S: Send + Sync,
    E: axum::extract::FromRequest<S>,
{
    type Rejection = Response;

    /// Extracts `E` from the request, keeping a copy of every body byte it
    /// reads: `E` sees the request as it came (its own checks, its own body
    /// limit, its own rejections, in its own order).
    async fn from_request(req: axum::extract::Request, state: &S) -> Result<Self, Self::Rejection> {
        let seen: Arc<std::sync::Mutex<Vec<axum::body::Bytes>>> = Arc::default();
        let tap = seen.clone();
        let req = req.map(|body| {
            Body::from_stream(body.into_data_stream().map(move |chunk| {
                if let Ok(bytes) = &chunk {
                    tap.lock().unwrap_or_else(|e| e.into_inner()).push(bytes.clone());
                }
                chunk
            }))
        });
        let value = E::from_request(req, state)
            .await
            .map_err(IntoResponse::into_response)?;
        let chunks = std::mem::take(&mut *seen.lock().unwrap_or_else(|e| e.into_inner()));
        let bytes = match chunks.len() {
            1 => chunks.into_iter().next().unwrap_or_default(),
            _ => chunks.concat().into(),
        };
        Ok(Raw { value, bytes })
    }
}

/// The body of `raw` as the fingerprint sees it, as `E` says.
#[doc(hidden)]
pub fn print_body<E: FingerprintBody>(raw: &Raw<E>) -> crate::BodyPrint<'_> {
    match E::FORMAT {
        BodyFormat::Json => crate::BodyPrint::Json {
            text: &raw.bytes,
            fields: None,
            read: None,
        },
        BodyFormat::Form => crate::BodyPrint::Form(&raw.bytes),
        BodyFormat::Raw => crate::BodyPrint::Raw(&raw.bytes),
    }
}

/// What a body extractor reads, for the fingerprint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyFormat {
    /// JSON: fingerprinted in its canonical form; `fields(...)` may name
    /// its members.
    Json,
    /// `application/x-www-form-urlencoded`: fingerprinted by its pairs.
    Form,
    /// Anything else: fingerprinted by its bytes.
    Raw,
}

/// Says how `#[idempotent]` fingerprints the body a body extractor reads.
/// idem implements it for axum's `Json<T>` and `Form<T>`; implement it for
/// an extractor of your own (such as a `Json<T>` with your own rejections).
///
/// ```
/// use axum::extract::{FromRequest, Request};
/// use idem::{BodyFormat, FingerprintBody};
///
/// /// axum's JSON with the application's own error answers.
/// struct AppJson<T>(T);
///
/// impl<S: Send + Sync, T: serde::de::DeserializeOwned> FromRequest<S> for AppJson<T> {
///     type Rejection = (axum::http::StatusCode, String);
///     async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
///         axum::Json::<T>::from_request(req, state)
///             .await
///             .map(|axum::Json(v)| AppJson(v))
///             .map_err(|e| (e.status(), format!("bad JSON: {e}")))
///     }
/// }
///
/// impl<T> FingerprintBody for AppJson<T> {
///     const FORMAT: BodyFormat = BodyFormat::Json;
/// }
/// ```
#[diagnostic::on_unimplemented(
    message = "`#[idempotent]` cannot tell what the body extractor `{Self}` reads, so it cannot fingerprint it",
    label = "idem must see this request body",
    note = "implement `idem::FingerprintBody` for `{Self}` (JSON, a form or raw bytes), take the body as axum's \
            `Json<T>`, `Form<T>`, `String` or `Bytes`, or add `body = \"none\"` to the attribute if this parameter \
            reads only the request head"
)]
pub trait FingerprintBody {
    /// What the extractor reads.
    const FORMAT: BodyFormat;
}

impl<T> FingerprintBody for axum::Json<T> {
    const FORMAT: BodyFormat = BodyFormat::Json;
}

impl<T> FingerprintBody for axum::Form<T> {
    const FORMAT: BodyFormat = BodyFormat::Form;
}

/// A `String` body (also behind a type alias) counts by its bytes.
impl FingerprintBody for String {
    const FORMAT: BodyFormat = BodyFormat::Raw;
}

/// A `Bytes` body (also behind a type alias) counts by its bytes.
impl FingerprintBody for axum::body::Bytes {
    const FORMAT: BodyFormat = BodyFormat::Raw;
}

/// Whether `E` reads JSON, for the macro's check that `fields(...)` names
/// members of a JSON body.
#[doc(hidden)]
pub const fn is_json<E: FingerprintBody>() -> bool {
    matches!(E::FORMAT, BodyFormat::Json)
}

#[derive(Clone)]
struct OperationInfo {
    store: Arc<dyn IdempotencyStore>,
    id: RecordId,
    lease: Lease,
    /// Set once the lease is lost: taken over, or not extended in time.
    lost: Arc<tokio::sync::watch::Sender<bool>>,
}

impl OperationInfo {
    fn is_lost(&self) -> bool {
        *self.lost.borrow()
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
    info: OperationInfo,
    /// The recovery point as this execution last set it.
    recovery_point: Arc<std::sync::Mutex<Option<String>>>,
    /// The handler's transaction, once it asked for one.
    #[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
    tx: Arc<tokio::sync::Mutex<Option<PendingTx>>>,
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

    /// 1 for the first execution of the operation, + 1 for every later one:
    /// a takeover of a stale lock, or the retry of a released outcome.
    pub fn attempt(&self) -> u32 {
        self.info.lease.attempt
    }

    /// Whether this execution took over from one whose lock ran out.
    pub fn is_takeover(&self) -> bool {
        self.info.lease.is_takeover()
    }

    /// The last recovery point: set by [`Operation::checkpoint`] in this
    /// execution, or by an earlier attempt that was taken over.
    pub fn recovery_point(&self) -> Option<String> {
        let own = self
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
    /// operation).
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
    /// [`Operation::is_lease_lost`]); never while the lease holds. Race it
    /// against long work to stop early.
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
        let mut lost = self.info.lost.subscribe();
        if lost.wait_for(|lost| *lost).await.is_err() {
            // The execution is over: the lease will never be lost now.
            std::future::pending::<()>().await;
        }
    }

    /// Persists `name` as the operation's progress, under this execution's
    /// lock token.
    ///
    /// # Errors
    ///
    /// [`StoreError::LockLost`] when another execution took the operation
    /// over, or when the lease is lost (see [`Operation::is_lease_lost`]):
    /// stop, the record is not yours any more. Another [`StoreError`] when
    /// the store fails.
    pub async fn checkpoint(&self, name: &str) -> Result<(), StoreError> {
        let info = &self.info;
        if info.is_lost() {
            return Err(StoreError::LockLost);
        }
        info.store.checkpoint(&info.id, &info.lease.token, name).await?;
        *self.recovery_point.lock().unwrap_or_else(|e| e.into_inner()) = Some(name.to_owned());
        Ok(())
    }

    /// The handler's transaction on the PostgreSQL store: its writes commit
    /// together with the completion of this record (a stored outcome), or
    /// are rolled back (a released outcome, a panic, a lost lock). The first
    /// call opens it; later calls return the same one.
    ///
    /// # Errors
    ///
    /// [`StoreError::Backend`] when the layer's store is not a
    /// [`crate::PgStore`]; [`StoreError::Unavailable`] when no connection
    /// can be had.
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
    ///         .map_err(|e| idem::StoreError::Backend(e.to_string()))?;
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
    /// lock cannot be had within the store's timeout.
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
    ///         .map_err(|e| idem::StoreError::Backend(e.to_string()))?;
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
        let mut slot = self.tx.lock().await;
        if slot.is_none() {
            *slot = Some(begin.await?);
        }
        tokio::sync::MutexGuard::try_map(slot, |slot| slot.as_mut().and_then(connection))
            .map_err(|_| StoreError::Backend("the operation holds a transaction of another store".into()))
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

/// The handler's outcome as the generated code hands it over.
#[doc(hidden)]
type HandlerFuture = Pin<Box<dyn Future<Output = (Response, Option<Classification>)> + Send>>;

type Handler = Box<dyn FnOnce(Option<Operation>) -> HandlerFuture + Send>;

/// Runs an annotated handler under the protocol. The generated code calls
/// this once; `handler` builds the handler's future once the key is reserved.
#[doc(hidden)]
pub fn run<H, F>(
    ctx: Context,
    spec: &'static Spec,
    fingerprint: Result<String, crate::FingerprintError>,
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
            None => Box::pin(async { (misconfigured(), Some(Classification::Release)) }),
        }
    });
    run_boxed(ctx, spec, fingerprint, handler)
}

/// [`run`] for an `optional` handler: without a key it runs unprotected and
/// gets `None`.
#[doc(hidden)]
pub fn run_optional<H, F>(
    ctx: Context,
    spec: &'static Spec,
    fingerprint: Result<String, crate::FingerprintError>,
    handler: H,
) -> impl Future<Output = Response> + Send
where
    H: FnOnce(Option<Operation>) -> F + Send + 'static,
    F: Future<Output = (Response, Option<Classification>)> + Send + 'static,
{
    let handler: Handler = Box::new(move |op: Option<Operation>| -> HandlerFuture { Box::pin(handler(op)) });
    run_boxed(ctx, spec, fingerprint, handler)
}

async fn run_boxed(
    ctx: Context,
    spec: &'static Spec,
    fingerprint: Result<String, crate::FingerprintError>,
    handler: Handler,
) -> Response {
    let Some(idem) = ctx.idem.clone() else {
        tracing::error!(
            scope = spec.scope,
            "no idempotency store is configured for this route: add `.layer(idem::Idem::new(store).layer())` \
             to the router (below the routes it protects)"
        );
        return misconfigured();
    };
    let base = idem.inner.problem_base.clone();
    let response = run_keyed(idem.inner, ctx, spec, fingerprint, handler).await;
    match base {
        Some(base) => rebase_problem(response, &base),
        None => response,
    }
}

/// Reads the key, then runs the protocol detached from the connection.
async fn run_keyed(
    engine: Arc<Engine>,
    ctx: Context,
    spec: &'static Spec,
    fingerprint: Result<String, crate::FingerprintError>,
    handler: Handler,
) -> Response {
    let values = ctx.headers.get_all(spec.header).iter().map(HeaderValue::as_bytes);
    let key = match IdempotencyKey::from_header_values(values) {
        Ok(key) => key,
        Err(KeyError::Missing) if spec.optional => {
            let span = tracing::info_span!("idem", scope = spec.scope, outcome = "unprotected");
            return handler(None).instrument(span).await.0;
        }
        Err(e) => return key_problem(e, spec.header),
    };
    let span = tracing::info_span!(
        "idem",
        scope = spec.scope,
        key = %key.log_hash(),
        outcome = tracing::field::Empty,
        attempt = tracing::field::Empty,
    );
    // From here on the protocol runs detached from the connection: a client
    // that goes away cancels neither the reservation nor the execution.
    let task = tokio::spawn(protect(engine, ctx.tenant, spec, fingerprint, key, handler).instrument(span));
    match task.await {
        Ok(response) => response,
        // The task itself never panics: the handler's panic is caught inside.
        Err(_) => handler_failed(),
    }
}

/// The protocol for one keyed request: tenant, fingerprint, reserve, then
/// execute under the lease, or answer from the record.
async fn protect(
    engine: Arc<Engine>,
    tenant: Option<Tenant>,
    spec: &'static Spec,
    fingerprint: Result<String, crate::FingerprintError>,
    key: IdempotencyKey,
    handler: Handler,
) -> Response {
    let tenant = match (tenant, engine.single_tenant) {
        (Some(t), _) => t.0,
        (None, true) => String::new(),
        (None, false) => {
            tracing::error!(
                "no tenant for this request: insert an `idem::Tenant` into the request extensions in \
                 your auth layer, or call `Idem::single_tenant()` if the service has one tenant"
            );
            return misconfigured();
        }
    };
    let fingerprint = match fingerprint {
        Ok(fp) => fp,
        Err(e) => {
            record("body_invalid");
            return problem(
                StatusCode::BAD_REQUEST,
                "idempotency-body-invalid",
                "Request body invalid",
                &format!("{e}; a request with an idempotency key must be I-JSON (RFC 7493)"),
            );
        }
    };
    let id = RecordId::new(tenant, spec.scope, key.as_str());
    let token = crate::store::random_token();
    let request = ReserveRequest {
        id: &id,
        fingerprint: &fingerprint,
        token: &token,
        ttl: spec.ttl.unwrap_or(engine.ttl),
        lock_timeout: spec.lock_timeout.unwrap_or(engine.lock_timeout),
    };
    let waited_until = spec.wait.map(|w| Instant::now() + w);
    let mut pause = Duration::from_millis(20);
    loop {
        let asked = Instant::now();
        let reservation = match engine.store.reserve(request).await {
            Ok(r) => r,
            Err(e) => {
                record("store_unavailable");
                tracing::error!(error = %e, "idempotency store failed; refusing the request");
                // The reservation may have committed although its answer
                // never came: give the key back, fenced by our token.
                let _ = give_back(&engine, &id, &token, request.lock_timeout).await;
                return store_unavailable(NOT_PROCESSED);
            }
        };
        match reservation {
            Reservation::Reserved(lease) => {
                tracing::Span::current().record("attempt", lease.attempt);
                let clock = LeaseClock {
                    lock_timeout: request.lock_timeout,
                    // The store set the deadline after `asked`: counting from
                    // it errs on the safe side.
                    deadline: asked + request.lock_timeout,
                };
                return execute(engine, id, lease, clock, handler).await;
            }
            Reservation::Completed(stored) => {
                record("replayed");
                return replay(stored);
            }
            Reservation::Mismatch => {
                record("mismatch");
                return problem(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "idempotency-key-reused",
                    "Idempotency key reused",
                    "this idempotency key was already used with a different request; \
                     use a new key for a new request",
                );
            }
            Reservation::InProgress { retry_after } => {
                let now = Instant::now();
                match waited_until {
                    Some(deadline) if now < deadline => {
                        tokio::time::sleep(pause.min(deadline - now)).await;
                        pause = (pause * 2).min(Duration::from_millis(250));
                    }
                    _ => {
                        record("in_progress");
                        return in_progress(retry_after);
                    }
                }
            }
        }
    }
}

fn record(outcome: &'static str) {
    tracing::Span::current().record("outcome", outcome);
}

/// When this execution's lock runs out, as far as it can tell.
#[derive(Clone, Copy)]
struct LeaseClock {
    lock_timeout: Duration,
    /// The lock deadline, or earlier: the store's clock set it after this.
    deadline: Instant,
}

/// Runs the handler, produces its answer and records the outcome, all under
/// the lease: the lock is extended until the completion is recorded.
async fn execute(
    engine: Arc<Engine>,
    id: RecordId,
    lease: Lease,
    clock: LeaseClock,
    handler: Handler,
) -> Response {
    let info = OperationInfo {
        store: engine.store.clone(),
        id,
        lease,
        lost: Arc::new(tokio::sync::watch::Sender::new(false)),
    };
    let tx: Arc<tokio::sync::Mutex<Option<PendingTx>>> = Arc::default();
    let handler = handler(Some(Operation {
        info: info.clone(),
        recovery_point: Arc::default(),
        tx: tx.clone(),
    }));
    if info.lease.is_takeover() {
        tracing::warn!(
            attempt = info.lease.attempt,
            "taking over an operation whose lock ran out"
        );
    }
    let beat = Heartbeat::start(&info, clock);
    let outcome = AssertUnwindSafe(handler).catch_unwind().await;
    pause_point!(crate::pause::HANDLER_RETURNED, &info.id.key);
    // The handler is done: its transaction, if any, is ours now.
    let tx = tx.lock().await.take();
    finish(&engine, &info, clock.lock_timeout, outcome, tx, beat).await
}

/// The lease's heartbeat: it extends the lock every third of the lock
/// timeout until dropped. It runs in a task of its own, so that a handler
/// that blocks its thread (`block_in_place`, heavy work) still keeps its
/// lease. When the lock is taken over, or cannot be extended before its
/// deadline, the lease counts as lost and the handler is told (see
/// [`Operation::lease_lost`]).
struct Heartbeat(tokio::task::JoinHandle<()>);

impl Heartbeat {
    fn start(info: &OperationInfo, clock: LeaseClock) -> Self {
        let info = info.clone();
        let beat = async move {
            let period = (clock.lock_timeout / 3).max(Duration::from_millis(10));
            let mut deadline = clock.deadline;
            loop {
                tokio::select! {
                    () = tokio::time::sleep_until(deadline) => break,
                    () = tokio::time::sleep(period) => {}
                }
                let asked = Instant::now();
                let extended = tokio::time::timeout_at(
                    deadline,
                    info.store
                        .extend_lock(&info.id, &info.lease.token, clock.lock_timeout),
                )
                .await;
                match extended {
                    Ok(Ok(())) => deadline = asked + clock.lock_timeout,
                    Ok(Err(StoreError::LockLost)) => {
                        tracing::error!("lock lost while the handler runs: another execution took over");
                        break;
                    }
                    Ok(Err(e)) => tracing::warn!(error = %e, "could not extend the lock; trying again"),
                    Err(_) => break,
                }
            }
            if !info.is_lost() {
                tracing::error!(
                    "the lock could not be extended before its deadline: the lease counts as lost"
                );
            }
            info.lost.send_replace(true);
        };
        Heartbeat(tokio::spawn(beat.in_current_span()))
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.0.abort();
    }
}

type Caught = Result<(Response, Option<Classification>), Box<dyn std::any::Any + Send>>;

/// Classifies the outcome, produces the answer and records it; `beat`
/// keeps the lease until then.
async fn finish(
    engine: &Arc<Engine>,
    info: &OperationInfo,
    lock_timeout: Duration,
    outcome: Caught,
    tx: Option<PendingTx>,
    beat: Heartbeat,
) -> Response {
    let (response, declared) = match outcome {
        Ok(pair) => pair,
        Err(panic) => {
            tracing::error!(panic = %panic_message(&*panic), "handler panicked; releasing the key");
            return let_go(engine, info, lock_timeout, tx, handler_failed(), LetGo::Fail).await;
        }
    };
    let class = declared.unwrap_or_else(|| Classification::from_status(response.status()));
    if class == Classification::Reject {
        return let_go(engine, info, lock_timeout, tx, response, LetGo::Reject).await;
    }
    if class == Classification::Release {
        return let_go(engine, info, lock_timeout, tx, response, LetGo::Fail).await;
    }
    let (parts, body) = response.into_parts();
    let stream = parts
        .headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.as_bytes().get(..EVENT_STREAM.len()))
        .is_some_and(|v| v.eq_ignore_ascii_case(EVENT_STREAM));
    let collected = match AssertUnwindSafe(collect(body, engine.max_stored_body, stream))
        .catch_unwind()
        .await
    {
        Ok(collected) => collected,
        Err(panic) => {
            tracing::error!(panic = %panic_message(&*panic), "the response body panicked; releasing the key");
            return let_go(engine, info, lock_timeout, tx, handler_failed(), LetGo::Fail).await;
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
    let answer = match collected {
        Collected::Whole(bytes) => {
            stored.body = Some(bytes.to_vec());
            Body::from(bytes)
        }
        Collected::Streamed { head, rest } if stream => {
            // An event stream may never end: it is completed at its
            // headers, and then streams.
            let head = futures_util::stream::iter(head.into_iter().map(Ok::<_, axum::Error>));
            Body::from_stream(head.chain(rest))
        }
        Collected::Streamed { head, rest } => {
            tracing::warn!(
                limit = engine.max_stored_body,
                "response body larger than the stored limit: a replay gets status and headers only"
            );
            let (to_client, from_task) = tokio::sync::mpsc::channel(1);
            let streamer = stream_then_complete(StreamedAnswer {
                engine: engine.clone(),
                info: info.clone(),
                lock_timeout,
                stored,
                tx,
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
        Collected::Failed(e) => {
            // Without idem the connection would break: so it does here, and
            // nothing is stored.
            tracing::error!(error = %e, "the response body failed while it was produced; releasing the key");
            let broken = futures_util::stream::once(async move { Err::<axum::body::Bytes, _>(e) });
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
    if let Err(refusal) = record_completion(engine, info, lock_timeout, &stored, tx).await {
        return refusal;
    }
    drop(beat);
    record(if info.lease.is_takeover() {
        "takeover"
    } else {
        "executed"
    });
    Response::from_parts(parts, answer)
}

/// The media type of server-sent events, compared without regard to case.
const EVENT_STREAM: &[u8] = b"text/event-stream";

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_default()
}

/// A response body, read under the lease.
enum Collected {
    /// The whole body, within the stored limit.
    Whole(axum::body::Bytes),
    /// Larger than the limit, or an event stream: what was read, and the rest.
    Streamed {
        head: Vec<axum::body::Bytes>,
        rest: axum::body::BodyDataStream,
    },
    /// The body failed while it was produced.
    Failed(axum::Error),
}

/// Reads `body` up to `limit` bytes, holding no more than that in memory.
async fn collect(body: Body, limit: usize, stream: bool) -> Collected {
    let mut rest = body.into_data_stream();
    if stream {
        return Collected::Streamed {
            head: Vec::new(),
            rest,
        };
    }
    let (mut head, mut len) = (Vec::new(), 0usize);
    while let Some(chunk) = rest.next().await {
        match chunk {
            Ok(chunk) => {
                len = len.saturating_add(chunk.len());
                head.push(chunk);
                if len > limit {
                    return Collected::Streamed { head, rest };
                }
            }
            Err(e) => return Collected::Failed(e),
        }
    }
    let mut whole = Vec::with_capacity(len);
    for chunk in head {
        whole.extend_from_slice(&chunk);
    }
    Collected::Whole(whole.into())
}

/// What the streamer sends to the client's body.
enum Frame {
    Data(axum::body::Bytes),
    /// The body is whole: its answer is recorded.
    End,
    Fail(axum::Error),
}

const ABANDONED: &str = "the client did not read the answer within the lock timeout";

/// An answer too large to keep, still being produced.
struct StreamedAnswer {
    engine: Arc<Engine>,
    info: OperationInfo,
    lock_timeout: Duration,
    /// Its status and headers, to record once the body ended.
    stored: StoredResponse,
    tx: Option<PendingTx>,
    beat: Heartbeat,
    head: Vec<axum::body::Bytes>,
    rest: axum::body::BodyDataStream,
    /// Gone once the client went away, or stopped reading.
    client: Option<tokio::sync::mpsc::Sender<Frame>>,
}

/// Streams an answer larger than the stored limit to the client, still under
/// the lease, and records its completion (status and headers) when the body
/// ends. The last bytes are held back until the completion is recorded (and
/// the body ends only with an explicit end): a client gets a whole body only
/// when its answer is recorded; otherwise its connection breaks. A body that
/// fails is a failed execution. A client that goes away, or reads nothing
/// for a whole lock timeout, cancels nothing: it is cut off, and the body is
/// read to its end and the outcome recorded all the same.
async fn stream_then_complete(mut s: StreamedAnswer) {
    let mut held: Option<axum::body::Bytes> = None;
    for chunk in std::mem::take(&mut s.head) {
        s.hold(&mut held, chunk).await;
    }
    let broken = loop {
        match AssertUnwindSafe(s.rest.next()).catch_unwind().await {
            Ok(Some(Ok(chunk))) => s.hold(&mut held, chunk).await,
            Ok(None) => break None,
            Ok(Some(Err(e))) => {
                tracing::error!(error = %e, "the response body failed while it was produced; releasing the key");
                break Some(e);
            }
            Err(panic) => {
                tracing::error!(panic = %panic_message(&*panic), "the response body panicked; releasing the key");
                break Some(axum::Error::new(std::io::Error::other(
                    "the response body panicked",
                )));
            }
        }
    };
    let StreamedAnswer {
        engine,
        info,
        lock_timeout,
        stored,
        tx,
        beat,
        mut client,
        ..
    } = s;
    let ending = match broken {
        Some(e) => {
            let _ = let_go(&engine, &info, lock_timeout, tx, Response::default(), LetGo::Fail).await;
            vec![Frame::Fail(e)]
        }
        None => match record_completion(&engine, &info, lock_timeout, &stored, tx).await {
            Ok(()) => {
                record(if info.lease.is_takeover() {
                    "takeover"
                } else {
                    "executed"
                });
                held.into_iter().map(Frame::Data).chain([Frame::End]).collect()
            }
            Err(_) => vec![Frame::Fail(axum::Error::new(std::io::Error::other(
                "the answer could not be recorded; retry with the same key",
            )))],
        },
    };
    drop(beat);
    for frame in ending {
        let Some(c) = &client else { break };
        if !matches!(
            tokio::time::timeout(lock_timeout, c.send(frame)).await,
            Ok(Ok(()))
        ) {
            client = None;
        }
    }
}

impl StreamedAnswer {
    /// Keeps `chunk` back and sends the one kept before: the last bytes
    /// wait for the completion. Empty chunks carry nothing to keep.
    async fn hold(&mut self, held: &mut Option<axum::body::Bytes>, chunk: axum::body::Bytes) {
        if chunk.is_empty() {
            return;
        }
        let Some(previous) = held.replace(chunk) else {
            return;
        };
        let Some(c) = &self.client else { return };
        // A client that reads nothing for a lock timeout is cut off (its
        // connection breaks); the body is still read to its end.
        if !matches!(
            tokio::time::timeout(self.lock_timeout, c.send(Frame::Data(previous))).await,
            Ok(Ok(()))
        ) {
            tracing::warn!("{ABANDONED}; cut off, the answer is still recorded");
            self.client = None;
        }
    }
}

/// Records the completion, in the handler's transaction if it opened one.
/// `Err` is the answer the client gets instead of the handler's.
async fn record_completion(
    engine: &Arc<Engine>,
    info: &OperationInfo,
    lock_timeout: Duration,
    stored: &StoredResponse,
    tx: Option<PendingTx>,
) -> Result<(), Response> {
    if info.is_lost() {
        // The handler was told its lease is lost: whatever it answered then
        // is not the operation's answer. Give the key back; the retry
        // continues the operation.
        record("lock_lost");
        if let Some(tx) = tx {
            tx.rollback().await;
        }
        let _ = give_back(engine, &info.id, &info.lease.token, lock_timeout).await;
        return Err(lease_lost());
    }
    let Some(tx) = tx else {
        return complete(engine, info, lock_timeout, stored).await;
    };
    match tx
        .complete(&*engine.store, &info.id, &info.lease.token, stored)
        .await
    {
        Ok(()) => Ok(()),
        Err(TxFailure::NotCommitted(StoreError::LockLost)) => {
            record("lock_lost");
            tracing::error!(
                "cannot complete: another execution took this operation over; this execution's writes \
                 were rolled back"
            );
            Err(lease_lost())
        }
        Err(TxFailure::NotCommitted(e)) => {
            // Nothing of this execution committed: the retry runs it again.
            record("released");
            tracing::error!(error = %e, "completing in the handler's transaction failed; rolled back");
            if give_back(engine, &info.id, &info.lease.token, lock_timeout).await == Err(StoreError::LockLost)
            {
                return Err(lease_lost());
            }
            Err(store_unavailable(ROLLED_BACK))
        }
        Err(TxFailure::Unknown(e)) => {
            // Committed or not, nobody knows. Giving the key back is fenced:
            // if the commit took effect, the record is completed and stays so.
            record("commit_unknown");
            tracing::error!(error = %e, "the commit of the handler's transaction failed");
            let _ = give_back(engine, &info.id, &info.lease.token, lock_timeout).await;
            Err(store_unavailable(OUTCOME_UNKNOWN))
        }
    }
}

/// Completes the record, retrying a store that fails for a moment. When it
/// cannot, the answer is not given (it would never be replayed): the key is
/// given back and the client told to retry.
async fn complete(
    engine: &Arc<Engine>,
    info: &OperationInfo,
    lock_timeout: Duration,
    stored: &StoredResponse,
) -> Result<(), Response> {
    let mut pause = Duration::from_millis(100);
    for attempt in 1..=4 {
        match engine.store.complete(&info.id, &info.lease.token, stored).await {
            Ok(()) => return Ok(()),
            Err(StoreError::LockLost) => {
                record("lock_lost");
                tracing::error!("cannot complete: another execution took this operation over");
                return Err(lease_lost());
            }
            Err(e) if attempt < 4 && !info.is_lost() => {
                tracing::warn!(error = %e, attempt, "completing the record failed; retrying");
                tokio::time::sleep(pause).await;
                pause *= 2;
            }
            Err(e) => {
                tracing::error!(error = %e, "completing the record failed; giving the key back");
                break;
            }
        }
    }
    record("not_recorded");
    let _ = give_back(engine, &info.id, &info.lease.token, lock_timeout).await;
    Err(store_unavailable(OUTCOME_UNKNOWN))
}

/// How an execution that produced no answer to keep lets its key go.
#[derive(Clone, Copy, PartialEq, Eq)]
enum LetGo {
    /// Released as failed: bound to its request (see [`Classification::Release`]).
    Fail,
    /// Rejected: the key is free on a first attempt (see [`Classification::Reject`]).
    Reject,
}

/// A failed execution (`fail`) or a rejected request (`reject`): rolls back
/// the handler's transaction, lets the key go as `how` says, and answers
/// `response`, unless another execution took the operation over, whose
/// answer is the one that counts.
async fn let_go(
    engine: &Arc<Engine>,
    info: &OperationInfo,
    lock_timeout: Duration,
    tx: Option<PendingTx>,
    response: Response,
    how: LetGo,
) -> Response {
    record(if how == LetGo::Reject {
        "rejected"
    } else {
        "released"
    });
    if let Some(tx) = tx {
        tx.rollback().await;
    }
    let (id, token) = (&info.id, &info.lease.token);
    let outcome = match how {
        LetGo::Reject => match engine.store.reject(id, token).await {
            // Not freed: at least never left locked.
            Err(e) if e != StoreError::LockLost => give_back(engine, id, token, lock_timeout).await,
            other => other,
        },
        LetGo::Fail => give_back(engine, id, token, lock_timeout).await,
    };
    if outcome == Err(StoreError::LockLost) {
        record("lock_lost");
        tracing::error!("cannot release: another execution took this operation over");
        return lease_lost();
    }
    response
}

/// Gives the key back: a release fenced by `token`, which changes nothing
/// if the token holds nothing. It serves executions that failed and
/// reservations or completions whose answer never came (a timeout: they may
/// have committed all the same). While the store is unreachable it keeps
/// trying in the background, until the lock would have run out by itself,
/// so no lock stays that nobody holds. Says how the first try went.
async fn give_back(
    engine: &Arc<Engine>,
    id: &RecordId,
    token: &str,
    lock_timeout: Duration,
) -> Result<(), StoreError> {
    let first = engine.store.release(id, token).await;
    match &first {
        Ok(()) | Err(StoreError::LockLost) => {}
        Err(e) => {
            tracing::warn!(error = %e, "giving the key back failed; trying again in the background");
            let (store, id, token) = (engine.store.clone(), id.clone(), token.to_owned());
            let until = Instant::now() + lock_timeout;
            tokio::spawn(
                async move {
                    let mut pause = Duration::from_millis(100);
                    while Instant::now() < until {
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(Duration::from_secs(2));
                        match store.release(&id, &token).await {
                            Ok(()) | Err(StoreError::LockLost) => return,
                            Err(_) => {}
                        }
                    }
                }
                .in_current_span(),
            );
        }
    }
    first
}

fn replay(stored: StoredResponse) -> Response {
    let status = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let omitted = stored.body.is_none();
    let mut response = Response::new(Body::from(stored.body.unwrap_or_default()));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    for (name, value) in stored.headers {
        if omitted && name == CONTENT_TYPE.as_str() {
            continue;
        }
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(&value),
        ) {
            headers.append(n, v);
        }
    }
    headers.insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    if omitted {
        headers.insert(BODY_OMITTED_HEADER, HeaderValue::from_static("true"));
    }
    response
}

/// An RFC 9457 problem response whose `type` ends with `name`.
///
/// ```
/// use axum::http::StatusCode;
/// let r = idem::problem(StatusCode::CONFLICT, "idempotency-request-in-progress", "In progress", "wait");
/// assert_eq!(r.headers()["content-type"], "application/problem+json");
/// ```
pub fn problem(status: StatusCode, name: &str, title: &str, detail: &str) -> Response {
    let parts = ProblemParts {
        name: name.into(),
        title: title.into(),
        detail: detail.into(),
    };
    let mut response = Response::new(Body::from(parts.body(status, PROBLEM_TYPE_PREFIX)));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
    response.extensions_mut().insert(parts);
    response
}

/// What a problem response of this layer says, kept so that its `type` can
/// be written with another base.
#[derive(Clone)]
struct ProblemParts {
    name: Box<str>,
    title: Box<str>,
    detail: Box<str>,
}

impl ProblemParts {
    fn body(&self, status: StatusCode, base: &str) -> String {
        serde_json::json!({
            "type": format!("{base}{}", self.name),
            "title": &*self.title,
            "status": status.as_u16(),
            "detail": &*self.detail,
        })
        .to_string()
    }
}

/// A problem of this layer with its `type` under `base`; any other response
/// as it is.
fn rebase_problem(response: Response, base: &str) -> Response {
    let Some(parts) = response.extensions().get::<ProblemParts>().cloned() else {
        return response;
    };
    let (mut head, _) = response.into_parts();
    let body = parts.body(head.status, base);
    head.headers.remove(axum::http::header::CONTENT_LENGTH);
    Response::from_parts(head, Body::from(body))
}

/// The start of every problem `type` of this layer; the name follows.
pub const PROBLEM_TYPE_PREFIX: &str = "urn:idem:problem:";

fn key_problem(e: KeyError, header: &str) -> Response {
    let title = if e == KeyError::Missing {
        "Idempotency key missing"
    } else {
        "Idempotency key invalid"
    };
    problem(
        StatusCode::BAD_REQUEST,
        e.problem_name(),
        title,
        &format!("{e} (header `{header}`)"),
    )
}

/// A store failure a handler passes on with `?` (from a checkpoint or a
/// transaction): `503 idempotency-store-unavailable` with `Retry-After`,
/// which releases the key (a lost lock cannot be released, and is not).
/// The store's own message is logged, never sent.
impl IntoResponse for StoreError {
    fn into_response(self) -> Response {
        tracing::error!(error = %self, "the handler stopped on a store error");
        store_unavailable(NOT_COMPLETED)
    }
}

fn in_progress(retry_after: Duration) -> Response {
    let mut r = problem(
        StatusCode::CONFLICT,
        "idempotency-request-in-progress",
        "Request in progress",
        "a request with this idempotency key is still being processed; retry later with the same key",
    );
    // Until the lock deadline, at most 2 s: the lease keeps a living
    // owner's deadline a whole lock timeout away, yet it may finish at once.
    let secs = retry_after.as_secs() + u64::from(retry_after.subsec_nanos() > 0);
    r.headers_mut().insert(
        RETRY_AFTER,
        HeaderValue::from(secs.clamp(1, MAX_RETRY_AFTER_SECS)),
    );
    r
}

/// What a 503 says: only what is known about the request.
const NOT_PROCESSED: &str = "the request was not processed; retry later with the same key";
const ROLLED_BACK: &str = "the request's changes in this service were rolled back; retry later with the \
                           same key";
const OUTCOME_UNKNOWN: &str = "the outcome of the request could not be recorded; retry later with the same \
                               key to get it";
const NOT_COMPLETED: &str = "the request could not be completed; retry later with the same key";

fn store_unavailable(detail: &str) -> Response {
    let mut r = problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "idempotency-store-unavailable",
        "Idempotency store unavailable",
        detail,
    );
    r.headers_mut().insert(RETRY_AFTER, HeaderValue::from_static("2"));
    r
}

/// The answer of an execution that another one fenced out: its result will
/// never be replayed, so it is not given.
fn lease_lost() -> Response {
    let mut r = problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "idempotency-lease-lost",
        "Idempotency lease lost",
        "another execution of this request took over; retry later with the same key to get its answer",
    );
    r.headers_mut().insert(RETRY_AFTER, HeaderValue::from_static("2"));
    r
}

fn handler_failed() -> Response {
    problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        "handler-failed",
        "Internal error",
        "the request failed; it may be retried with the same key",
    )
}

fn misconfigured() -> Response {
    problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        "idempotency-misconfigured",
        "Idempotency layer misconfigured",
        "the server is not configured correctly for this endpoint; the request was not processed",
    )
}

/// The autoref probe the generated code uses to read a declared field as
/// JSON when its type is `Serialize`, else nothing.
#[doc(hidden)]
pub struct FieldProbe<'a, T>(pub &'a T);

#[doc(hidden)]
pub trait ViaSerialize {
    fn __idem_json(&self) -> Option<Vec<u8>>;
}

impl<T: serde::Serialize> ViaSerialize for &FieldProbe<'_, T> {
    fn __idem_json(&self) -> Option<Vec<u8>> {
        serde_json::to_vec(self.0).ok()
    }
}

#[doc(hidden)]
pub trait ViaNothing {
    fn __idem_json(&self) -> Option<Vec<u8>>;
}

impl<T> ViaNothing for FieldProbe<'_, T> {
    fn __idem_json(&self) -> Option<Vec<u8>> {
        None
    }
}

/// The autoref probe the generated code uses to find a [`Classify`] impl on
/// the handler's error type, then on its whole return type, else none.
#[doc(hidden)]
pub struct Probe<'a, T>(pub &'a T);

#[doc(hidden)]
pub trait ViaErr {
    fn __idem_classify(&self) -> Option<Classification>;
}

impl<T, E: Classify> ViaErr for &&Probe<'_, Result<T, E>> {
    fn __idem_classify(&self) -> Option<Classification> {
        match self.0 {
            Ok(_) => None,
            Err(e) => Some(e.classify()),
        }
    }
}

#[doc(hidden)]
pub trait ViaSelf {
    fn __idem_classify(&self) -> Option<Classification>;
}

impl<T: Classify> ViaSelf for &Probe<'_, T> {
    fn __idem_classify(&self) -> Option<Classification> {
        Some(self.0.classify())
    }
}

#[doc(hidden)]
pub trait ViaStatus {
    fn __idem_classify(&self) -> Option<Classification>;
}

impl<T> ViaStatus for Probe<'_, T> {
    fn __idem_classify(&self) -> Option<Classification> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configuring_a_clone_leaves_the_original_as_it_was() {
        let original = Idem::new(crate::MemoryStore::new());
        let changed = original
            .clone()
            .ttl(Duration::from_secs(1))
            .unwrap()
            .single_tenant();
        assert_eq!(
            (original.inner.ttl, original.inner.single_tenant),
            (DEFAULT_TTL, false)
        );
        assert_eq!(
            (changed.inner.ttl, changed.inner.single_tenant),
            (Duration::from_secs(1), true)
        );
    }

    #[test]
    fn classification_follows_the_contract_table() {
        for (code, class) in [
            (200, Classification::Store),
            (201, Classification::Store),
            (303, Classification::Store),
            (402, Classification::Store),
            (403, Classification::Store),
            (404, Classification::Store),
            (400, Classification::Reject),
            (408, Classification::Release),
            (409, Classification::Reject),
            (422, Classification::Reject),
            (425, Classification::Release),
            (429, Classification::Release),
            (500, Classification::Release),
            (503, Classification::Release),
        ] {
            assert_eq!(
                Classification::from_status(StatusCode::from_u16(code).unwrap()),
                class,
                "{code}"
            );
        }
    }

    #[test]
    // The borrows are the autoref mechanism under test.
    #[allow(clippy::needless_borrow)]
    fn the_probe_prefers_the_error_type_then_the_whole_type_then_the_status() {
        struct Declared;
        impl Classify for Declared {
            fn classify(&self) -> Classification {
                Classification::Release
            }
        }
        let err: Result<(), Declared> = Err(Declared);
        assert_eq!((&&&Probe(&err)).__idem_classify(), Some(Classification::Release));
        let ok: Result<(), Declared> = Ok(());
        assert_eq!((&&&Probe(&ok)).__idem_classify(), None);
        assert_eq!(
            (&&&Probe(&Declared)).__idem_classify(),
            Some(Classification::Release)
        );
        let plain: Result<(), String> = Err(String::new());
        assert_eq!((&&&Probe(&plain)).__idem_classify(), None);
    }

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
}
