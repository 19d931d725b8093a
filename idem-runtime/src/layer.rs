//! The layer: [`Idem`] and its configuration, the [`Tenant`] a request runs
//! for, and the [`Context`] extractor that hands both to an annotated handler.

use crate::store::IdempotencyStore;
use axum::extract::FromRequestParts;
use axum::http::header::{HeaderName, CONTENT_TYPE};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue};
use std::sync::Arc;
use std::time::Duration;

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

/// Parses a duration as the attribute writes it: a positive whole number
/// followed by `ms`, `s`, `m`, `h` or `d`, such as `30s` or `24h`. For
/// settings read at run time (an environment variable, a file); the
/// attribute's own arguments are checked at compile time with the same
/// grammar.
///
/// # Errors
///
/// Anything else, zero, or a duration past `u64` milliseconds.
///
/// ```
/// use std::time::Duration;
/// assert_eq!(idem::parse_duration("24h").unwrap(), Duration::from_secs(86_400));
/// assert_eq!(idem::parse_duration("250ms").unwrap(), Duration::from_millis(250));
/// assert!(idem::parse_duration("1.5s").is_err());
/// assert!(idem::parse_duration("99999999999999999d").is_err());
/// ```
pub fn parse_duration(text: &str) -> Result<Duration, ConfigError> {
    let bad = || {
        ConfigError(format!(
            "invalid duration `{text}`: use a positive whole number followed by `ms`, `s`, `m`, `h` or `d`, \
             such as `30s`"
        ))
    };
    let digits_end = text.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
    let (number, unit) = text.split_at(digits_end);
    let number: u64 = number.parse().map_err(|_| bad())?;
    let factor: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(bad()),
    };
    match number.checked_mul(factor) {
        Some(millis) if millis > 0 => Ok(Duration::from_millis(millis)),
        _ => Err(bad()),
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
/// The header that marks a replayed answer.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";
/// The header that marks a replay whose body was too large to keep.
pub const BODY_OMITTED_HEADER: &str = "idempotent-replay-body-omitted";

/// Headers that are never stored, even when named: credentials and
/// cookies (not safe to keep for a day), `date` (the replay's own), and the
/// headers of one connection or one message's framing (RFC 9110 7.6.1 and
/// 11.7.1: `keep-alive` and `proxy-authenticate` speak to the one client
/// or proxy next on that connection, not to whoever sends the retry).
const NEVER_STORED: &[&str] = &[
    "set-cookie",
    "set-cookie2",
    "authorization",
    "proxy-authorization",
    "authentication-info",
    "proxy-authentication-info",
    "cookie",
    "cookie2",
    "date",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "upgrade",
    "proxy-authenticate",
];

/// The headers stored and replayed without being named: those without
/// which the stored body is not the answer (its type, its encoding: a body
/// the handler compressed itself is stored as it was sent) and a created
/// resource's address.
pub(crate) const STORED_BY_DEFAULT: [HeaderName; 3] = [
    CONTENT_TYPE,
    axum::http::header::CONTENT_ENCODING,
    axum::http::header::LOCATION,
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

    /// The longest tenant id a record can be keyed by, in bytes.
    pub const MAX_LEN: usize = 255;

    /// Whether every store can key a record by `id`: 1 to [`Tenant::MAX_LEN`]
    /// bytes, no control character (PostgreSQL refuses a NUL in text). A
    /// request whose tenant is not is refused with 500
    /// `idempotency-misconfigured` (the auth layer's bug, logged), on every
    /// store alike.
    ///
    /// ```
    /// use idem::Tenant;
    /// assert!(Tenant::storable("acct_42"));
    /// assert!(!Tenant::storable("acct\0x"));
    /// assert!(!Tenant::storable(&"a".repeat(256)));
    /// ```
    pub fn storable(id: &str) -> bool {
        (1..=Self::MAX_LEN).contains(&id.len()) && !id.chars().any(char::is_control)
    }
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
    pub(crate) inner: Arc<Engine>,
}

#[derive(Clone)]
pub(crate) struct Engine {
    pub(crate) store: Arc<dyn IdempotencyStore>,
    pub(crate) ttl: Duration,
    pub(crate) lock_timeout: Duration,
    pub(crate) single_tenant: bool,
    pub(crate) max_stored_body: usize,
    pub(crate) replay_headers: Vec<HeaderName>,
    /// What problem `type`s start with, when not [`PROBLEM_TYPE_PREFIX`].
    pub(crate) problem_base: Option<Arc<str>>,
    /// The handlers served through this `Idem`, by scope: shared by the
    /// ones configured from it, which share its store.
    pub(crate) scopes: Arc<crate::request::ScopeBook>,
    /// The requests under way through this `Idem` and the ones configured
    /// from it ([`Idem::idle`]).
    pub(crate) under_way: Arc<crate::store::UnderWay>,
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
                replay_headers: STORED_BY_DEFAULT.to_vec(),
                problem_base: None,
                scopes: Arc::new(crate::request::ScopeBook::new()),
                under_way: Arc::default(),
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
    /// answers them with an empty body and `Idempotent-Replay-Body-Omitted: true`,
    /// without the headers that described the body (`Content-Type`,
    /// `Content-Encoding`).
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
    /// `content-type`, `content-encoding` and `location`). A handler that
    /// answers 401 itself names `www-authenticate`, so that the replayed 401
    /// carries its challenge.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] for a name that is not a header name, or one that is
    /// never stored: credentials and cookies (`set-cookie`, `authorization`,
    /// `cookie`: stored data must be safe to keep), `date`, and the headers
    /// of one connection or of one message's framing (`content-length`,
    /// `transfer-encoding`, `connection`, `keep-alive`, `upgrade`, `te`,
    /// `trailer`, `proxy-connection`, `proxy-authenticate`).
    ///
    /// ```
    /// let idem = idem::Idem::new(idem::MemoryStore::new()).replay_headers(["etag", "www-authenticate"])?;
    /// assert!(idem::Idem::new(idem::MemoryStore::new()).replay_headers(["set-cookie"]).is_err());
    /// assert!(idem::Idem::new(idem::MemoryStore::new()).replay_headers(["keep-alive"]).is_err());
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
                    "replay_headers: `{name}` is never stored (credentials, cookies, and the headers of one \
                     connection or of one message's framing are not safe to keep or to replay)"
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
    /// [`ConfigError`] for an empty base, or one with a character a URI
    /// cannot hold as it is (a space, `"`, `<`, `{`, non-ASCII text:
    /// percent-encode it).
    pub fn problem_type_base(self, base: impl Into<String>) -> Result<Self, ConfigError> {
        let base: String = base.into();
        // RFC 3986's characters only (percent escapes included): a `type`
        // is a URI reference.
        let uri_char = |c: char| c.is_ascii_alphanumeric() || "-._~:/?#[]@!$&'()*+,;=%".contains(c);
        // Each `%` begins an escape: two hex digits follow it.
        let escapes_whole = base.match_indices('%').all(|(at, _)| {
            base.get(at + 1..at + 3)
                .is_some_and(|h| h.chars().all(|c| c.is_ascii_hexdigit()))
        });
        if base.is_empty() || !base.chars().all(uri_char) || !escapes_whole {
            return Err(ConfigError(format!(
                "problem_type_base `{}` must be a URI prefix: ASCII letters, digits and -._~:/?#[]@!$&'()*+,;=% \
                 only, each % followed by two hex digits (no spaces, quotes, angle brackets or other text; \
                 percent-encode it), such as `https://docs.example.com/errors/`",
                base.escape_debug()
            )));
        }
        Ok(self.change(|e| e.problem_base = Some(base.into())))
    }

    /// How many keyed requests and executions are under way through this
    /// `Idem` (and the ones configured from it) now.
    ///
    /// ```
    /// let idem = idem::Idem::new(idem::MemoryStore::new());
    /// assert_eq!(idem.under_way(), 0);
    /// ```
    pub fn under_way(&self) -> usize {
        self.inner.under_way.count()
    }

    /// Waits until no keyed request or execution is under way through this
    /// `Idem` (and the ones configured from it): for a graceful shutdown,
    /// once the server accepts no more requests. An execution runs in a
    /// task of its own, and goes on when its client leaves; a runtime shut
    /// down before it ends drops it, and its key stays locked until its
    /// lock timeout, as after a crash. This counts every protocol from its
    /// start to its answer, and every execution until its completion or
    /// release is recorded (an answer streamed past the stored limit, a
    /// release finished in the background), whether its client waits or
    /// not; and it waits for the stores' own work in the background (a
    /// reservation given up on at the store's timeout whose key is still
    /// to be given back; a group of PostgreSQL lookups, which may give
    /// back a key it took for a lookup answered already), of any `Idem` of
    /// the process. Bound the wait
    /// yourself (`tokio::time::timeout`): an execution may take as long as
    /// its handler.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let idem = idem::Idem::new(idem::MemoryStore::new());
    /// // ... the server stopped accepting:
    /// tokio::time::timeout(std::time::Duration::from_secs(60), idem.idle())
    ///     .await
    ///     .expect("every execution ended");
    /// # }
    /// ```
    pub async fn idle(&self) {
        let background = crate::store::background_work();
        // Both at once: the wait for one may see the other start again.
        while self.inner.under_way.count() + background.count() > 0 {
            self.inner.under_way.idle().await;
            background.idle().await;
        }
    }

    /// Starts a [`crate::Janitor`] on this layer's store: every `every`,
    /// expired records are deleted in batches of `batch`.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] for `every` under 1 second or over 1 day, `batch`
    /// outside 1 to 100,000, or when called outside a Tokio runtime (the
    /// janitor is a task of it).
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
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(ConfigError(
                "start_janitor was called outside a Tokio runtime: the janitor is a task of the runtime \
                 it is started in; call it from within one (in main, or a task)"
                    .to_owned(),
            ));
        }
        Ok(crate::Janitor::start(self.inner.store.clone(), every, batch))
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn IdempotencyStore> {
        &self.inner.store
    }

    /// The layer to add to the router: it makes this configuration
    /// available to every `#[idempotent]` handler below it. It is an axum
    /// `Extension`: where layers are added at two levels (a router's, and
    /// one route's own), the innermost configures the handlers it covers,
    /// its settings and its store alike.
    ///
    /// ```
    /// use axum::Router;
    /// let app: Router = Router::new().layer(idem::Idem::new(idem::MemoryStore::new()).layer());
    /// ```
    pub fn layer(self) -> axum::Extension<Idem> {
        axum::Extension(self)
    }
}

/// Which header an annotated handler reads its key from: the default, or
/// the one its attribute's `header = ".."` names.
#[doc(hidden)]
pub trait KeyHeader: 'static {
    /// The header whose values the context keeps, or `None` to keep the
    /// header map (the handler's spec names the header). A `HeaderName`,
    /// so that it is not parsed again for every request.
    const NAME: Option<HeaderName>;
}

/// `Idempotency-Key`: only its values are kept.
#[doc(hidden)]
#[derive(Debug)]
pub struct DefaultKeyHeader;

impl KeyHeader for DefaultKeyHeader {
    const NAME: Option<HeaderName> = Some(HeaderName::from_static("idempotency-key"));
}

/// A header of the handler's own: the header map is kept.
#[doc(hidden)]
#[derive(Debug)]
pub struct CustomKeyHeader;

impl KeyHeader for CustomKeyHeader {
    const NAME: Option<HeaderName> = None;
}

/// What the injected first parameter of an annotated handler extracts: the
/// configuration, the tenant, the values of the key header (for the default
/// header, only those: the header map is not copied) and what identifies
/// the request besides its body.
#[doc(hidden)]
pub struct Context<K = DefaultKeyHeader> {
    pub(crate) idem: Option<Idem>,
    pub(crate) tenant: Option<Tenant>,
    /// Every value of the default key header, in order.
    pub(crate) key: HeaderValues,
    /// The header map, for a handler with a header of its own.
    pub(crate) headers: Option<HeaderMap>,
    /// The route's path parameters.
    pub(crate) path: PathParams,
    /// The request target's path and query (shared with the request's,
    /// not copied).
    pub(crate) query: Option<axum::http::uri::PathAndQuery>,
    /// What the client can tell of the answer's body.
    pub(crate) reader: crate::answer::Reader,
    header: std::marker::PhantomData<fn() -> K>,
}

/// The route's path parameters, as axum matched them: its own shared
/// strings, none of them copied.
pub(crate) enum PathParams {
    /// The route has none.
    None,
    Matched(axum::extract::RawPathParams),
    /// Not UTF-8 once decoded: the raw path, whole (a nested router's
    /// prefix included), identifies the request all the same, under an
    /// empty name.
    Raw(String),
}

impl PathParams {
    /// Each parameter's name and value, in the route's order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        let (matched, raw) = match self {
            PathParams::None => (None, None),
            PathParams::Matched(params) => (Some(params.iter()), None),
            PathParams::Raw(path) => (None, Some(("", path.as_str()))),
        };
        matched.into_iter().flatten().chain(raw)
    }
}

/// A header's values, in order, the first apart: a request sends one, and
/// keeping it costs no allocation.
#[derive(Default)]
pub(crate) struct HeaderValues {
    first: Option<HeaderValue>,
    more: Vec<HeaderValue>,
}

impl HeaderValues {
    pub(crate) fn iter(&self) -> impl Iterator<Item = &HeaderValue> {
        self.first.iter().chain(&self.more)
    }
}

impl<K> Context<K> {
    /// The context with the tenant as idem's last extractor saw it, once
    /// the handler's own extractors ran: one of them may establish it.
    #[doc(hidden)]
    pub fn seen_last(mut self, tenant: Option<Tenant>) -> Self {
        self.tenant = tenant;
        self
    }

    /// The same context, its header name no longer in its type.
    pub(crate) fn erase(self) -> Context {
        Context {
            idem: self.idem,
            tenant: self.tenant,
            key: self.key,
            headers: self.headers,
            path: self.path,
            query: self.query,
            reader: self.reader,
            header: std::marker::PhantomData,
        }
    }
}

impl<K> std::fmt::Debug for Context<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").finish_non_exhaustive()
    }
}

impl<S: Send + Sync, K: KeyHeader> FromRequestParts<S> for Context<K> {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        use axum::extract::rejection::RawPathParamsRejection;
        let path = match axum::extract::RawPathParams::from_request_parts(parts, state).await {
            Ok(params) => PathParams::Matched(params),
            Err(RawPathParamsRejection::MissingPathParams(_)) => PathParams::None,
            // The path as the client sent it: inside a nested router,
            // `parts.uri` has lost the prefix, and the prefix's parameters
            // with it.
            Err(_) => PathParams::Raw(
                parts
                    .extensions
                    .get::<axum::extract::OriginalUri>()
                    .map_or(&parts.uri, |original| &original.0)
                    .path()
                    .to_owned(),
            ),
        };
        Ok(Context {
            idem: parts.extensions.get::<Idem>().cloned(),
            // Read by idem's last extractor, once the handler's own ran
            // (`seen_last`): one of them may establish it.
            tenant: None,
            key: K::NAME.map_or_else(HeaderValues::default, |name| {
                let mut values = parts.headers.get_all(name).iter().cloned();
                HeaderValues {
                    first: values.next(),
                    more: values.collect(),
                }
            }),
            headers: K::NAME.is_none().then(|| parts.headers.clone()),
            path,
            query: parts
                .uri
                .path_and_query()
                .filter(|pq| pq.query().is_some())
                .cloned(),
            reader: crate::answer::Reader::of(&parts.method, parts.version),
            header: std::marker::PhantomData,
        })
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
}
