//! What a request contributes to its fingerprint: the attribute's [`Spec`],
//! and the body extractors that let the fingerprint see the bytes the
//! handler's extractor read.

use crate::layer::Context;
use axum::body::Body;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;
use std::time::Duration;

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
    /// The handler's name, for what is logged about it.
    pub handler: &'static str,
    /// Where the attribute is (`file:line`), for what is logged about it.
    pub at: &'static str,
    /// Which [`ScopeBook`] its scope was last compared in
    /// ([`Spec::note_scope`]).
    pub scope_noted: ScopeNoted,
}

/// The id of the [`ScopeBook`] a handler's scope was last compared in (0:
/// none yet).
#[doc(hidden)]
#[derive(Debug)]
pub struct ScopeNoted(std::sync::atomic::AtomicU64);

impl ScopeNoted {
    /// Not yet compared.
    pub const fn new() -> Self {
        ScopeNoted(std::sync::atomic::AtomicU64::new(0))
    }
}

impl Default for ScopeNoted {
    fn default() -> Self {
        Self::new()
    }
}

/// The handlers that served through one [`Idem`](crate::Idem) (and the
/// ones configured from it, which share its store), by scope.
#[derive(Debug)]
pub(crate) struct ScopeBook {
    /// Never 0, never another book's.
    id: u64,
    served: std::sync::Mutex<Vec<&'static Spec>>,
}

impl ScopeBook {
    pub(crate) fn new() -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        ScopeBook {
            id: NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            served: std::sync::Mutex::new(Vec::new()),
        }
    }
}

impl Spec {
    /// At its handler's first request through an `Idem`, compares its
    /// scope with those of the handlers that served through it before, and
    /// warns when another has the same: their records are one store's, so
    /// a key sent to both is one operation, and one replays the other's
    /// answer (README, "The fingerprint"). Handlers served through
    /// different `Idem`s are not compared. After that, one atomic load per
    /// request (a handler served through two `Idem`s in turn compares again
    /// at each change).
    pub(crate) fn note_scope(&'static self, book: &ScopeBook) {
        use std::sync::atomic::Ordering::Relaxed;
        if self.scope_noted.0.load(Relaxed) == book.id {
            return;
        }
        let mut served = book
            .served
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !served.iter().any(|known| std::ptr::eq(*known, self)) {
            if let Some(other) = served.iter().find(|other| other.scope == self.scope) {
                tracing::warn!(
                    scope = self.scope,
                    handler = self.handler,
                    at = self.at,
                    other = other.handler,
                    other_at = other.at,
                    "two handlers served through one `Idem` have the same scope: their records are one \
                     store's, so a key sent to both is one operation, and one replays the other's \
                     answer; give each operation a scope of its own"
                );
            }
            served.push(self);
        }
        self.scope_noted.0.store(book.id, Relaxed);
    }
}

/// The fingerprint of the request: the scope, the path parameters, the
/// query and `body`, as the handler's attribute says; `read`, each declared
/// field as the handler read it.
#[doc(hidden)]
pub fn fingerprint_request<K>(
    ctx: &Context<K>,
    spec: &Spec,
    body: crate::fingerprint::BodyPrint<'_>,
    read: &[FieldJson],
) -> crate::fingerprint::Printed {
    crate::fingerprint::gathered(read.iter().map(FieldJson::bytes), |bytes| {
        crate::fingerprint::gathered(read.iter().map(FieldJson::reread), |rereads| {
            let body = match body {
                crate::fingerprint::BodyPrint::Json { text, .. } => crate::fingerprint::BodyPrint::Json {
                    text,
                    fields: spec.fields,
                    read: Some(bytes),
                },
                other => other,
            };
            crate::fingerprint::gathered(ctx.path.iter(), |path| {
                crate::fingerprint::fingerprint_hex(
                    &crate::fingerprint::RequestPrint {
                        scope: spec.scope,
                        path,
                        query: ctx.query.as_ref().and_then(|q| q.query()),
                        body,
                        ignore: spec.ignore,
                    },
                    rereads,
                )
            })
        })
    })
}

/// A raw body (`String`, `Bytes`) as the fingerprint sees it.
#[doc(hidden)]
pub fn raw<T: AsRef<[u8]>>(body: &T) -> crate::fingerprint::BodyPrint<'_> {
    crate::fingerprint::BodyPrint::Raw(body.as_ref())
}

/// A body extractor (`Json<T>`, `Form<T>`) and the bytes it was read from:
/// the handler gets the typed value, the fingerprint what the client sent.
/// Rejections are the extractor's own.
#[doc(hidden)]
pub struct Raw<E> {
    pub value: E,
    pub bytes: axum::body::Bytes,
    /// The tenant once every extractor before it ran ([`Tail`]).
    pub tenant: Option<crate::Tenant>,
}

/// The last extractor of a handler whose body is read whole (`String`,
/// `Bytes`): the body, and the tenant as the request carries it once every
/// extractor before it ran, one of which (an `Auth` extractor) may have
/// established it. Rejections are the extractor's own.
#[doc(hidden)]
pub struct Tail<E> {
    pub value: E,
    pub tenant: Option<crate::Tenant>,
}

impl<S, E> axum::extract::FromRequest<S> for Tail<E>
where
    S: Send + Sync,
    E: axum::extract::FromRequest<S>,
{
    type Rejection = E::Rejection;

    async fn from_request(req: axum::extract::Request, state: &S) -> Result<Self, Self::Rejection> {
        let tenant = req.extensions().get::<crate::Tenant>().cloned();
        Ok(Tail {
            value: E::from_request(req, state).await?,
            tenant,
        })
    }
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
        let tenant = req.extensions().get::<crate::Tenant>().cloned();
        let seen: Arc<std::sync::Mutex<Seen>> = Arc::default();
        let req = req.map(|body| {
            Body::new(Tapped {
                body,
                seen: seen.clone(),
            })
        });
        let value = E::from_request(req, state)
            .await
            .map_err(IntoResponse::into_response)?;
        let (first, rest) = std::mem::take(&mut *seen.lock().unwrap_or_else(|e| e.into_inner()));
        let bytes = match (first, rest.is_empty()) {
            (None, _) => axum::body::Bytes::new(),
            (Some(first), true) => first,
            (Some(first), false) => {
                let mut all = Vec::with_capacity(first.len() + rest.iter().map(|c| c.len()).sum::<usize>());
                all.extend_from_slice(&first);
                for chunk in &rest {
                    all.extend_from_slice(chunk);
                }
                all.into()
            }
        };
        Ok(Raw { value, bytes, tenant })
    }
}

/// The chunks read, the first apart: most bodies are one.
type Seen = (Option<axum::body::Bytes>, Vec<axum::body::Bytes>);

/// A request's body as [`Raw`]'s extractor reads it, each data frame kept
/// in `seen` as it passes. Frames, size and end are the body's; so is an
/// error: taken out of the [`axum::Error`] the body put it in, which
/// [`Body::new`] puts it back in, so that the extractor finds it as deep as
/// without idem (axum answers 413 for a body-limit layer's error only
/// where it finds it within two).
struct Tapped {
    body: Body,
    seen: Arc<std::sync::Mutex<Seen>>,
}

impl http_body::Body for Tapped {
    type Data = axum::body::Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let frame = std::task::ready!(std::pin::Pin::new(&mut self.body).poll_frame(cx));
        if let Some(bytes) = frame.as_ref().and_then(|f| f.as_ref().ok()?.data_ref()) {
            let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
            match &seen.0 {
                None => seen.0 = Some(bytes.clone()),
                Some(_) => seen.1.push(bytes.clone()),
            }
        }
        std::task::Poll::Ready(frame.map(|f| f.map_err(axum::Error::into_inner)))
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// The last extractor of a `body = "none"` handler: it reads nothing, and
/// puts every parameter of the handler before it, where axum accepts only
/// extractors of the request's head (`FromRequestParts`). A parameter that
/// reads the body (one idem cannot tell by its name, such as a type alias of
/// `Json<T>`) is then a compile error, never an unseen body.
/// It keeps the tenant as the request carries it once every extractor
/// before it ran ([`Tail`]).
#[doc(hidden)]
pub struct NoBody {
    pub tenant: Option<crate::Tenant>,
}

impl<S: Send + Sync> axum::extract::FromRequest<S> for NoBody {
    type Rejection = std::convert::Infallible;

    async fn from_request(req: axum::extract::Request, _: &S) -> Result<Self, Self::Rejection> {
        Ok(NoBody {
            tenant: req.extensions().get::<crate::Tenant>().cloned(),
        })
    }
}

/// The body of `raw` as the fingerprint sees it, as `E` says.
#[doc(hidden)]
pub fn print_body<E: FingerprintBody>(raw: &Raw<E>) -> crate::fingerprint::BodyPrint<'_> {
    match E::FORMAT {
        BodyFormat::Json => crate::fingerprint::BodyPrint::Json {
            text: &raw.bytes,
            fields: None,
            read: None,
        },
        BodyFormat::Form => crate::fingerprint::BodyPrint::Form(&raw.bytes),
        BodyFormat::Raw => crate::fingerprint::BodyPrint::Raw(&raw.bytes),
    }
}

/// What a body extractor reads, for the fingerprint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyFormat {
    /// JSON: fingerprinted in its canonical form; `fields(...)` may name
    /// its members. The macro reads a named field at `.0` of the extractor
    /// (`body.0.amount`), as in axum's `Json<T>`: an extractor of your own
    /// used with `fields(...)` is a tuple struct with the value first
    /// (otherwise the compiler says it has no field `0`).
    Json,
    /// `application/x-www-form-urlencoded`: fingerprinted by its pairs.
    Form,
    /// Anything else: fingerprinted by its bytes.
    Raw,
}

/// Says how `#[idempotent]` fingerprints the body a body extractor reads.
/// idem implements it for axum's `Json<T>` and `Form<T>`; implement it for
/// an extractor of your own (such as a `Json<T>` with your own rejections).
/// Another crate's extractor (`axum_extra`'s `WithRejection`, say) cannot
/// take it here (Rust's orphan rule): wrap it in a type of your own, as
/// `AppJson` wraps `Json` below.
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
    note = "implement `idem::FingerprintBody` for `{Self}` (JSON, a form or raw bytes; for another crate's extractor, \
            for a wrapper of your own around it), take the body as axum's \
            `Json<T>`, `Form<T>`, `String` or `Bytes`, or add `body = \"none\"` to the attribute if this parameter \
            reads only the request head",
    note = "if this parameter is idem's `Operation` imported under another name, write it as `Operation`: \
            `#[idempotent]` knows it by its name"
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

/// The autoref probe the generated code uses to read a declared field as
/// JSON when its type is `Serialize`, else nothing.
#[doc(hidden)]
pub struct FieldProbe<'a, T>(pub &'a T);

/// A declared field as the handler read it, as JSON: on the stack when it
/// is as short as most fields are (an amount, a currency, an id), so that
/// reading it allocates nothing. With the field's type, where it is
/// `Deserialize` too, to read a value sent as the handler's type does.
#[doc(hidden)]
pub struct FieldJson {
    text: FieldText,
    reread: Option<crate::fingerprint::Reread>,
}

enum FieldText {
    /// Its type cannot say (not `Serialize`, or its serialization failed).
    Unknown,
    /// The first `.0` bytes of `.1`.
    Short(u8, [u8; FieldJson::SHORT]),
    Long(Vec<u8>),
}

impl FieldJson {
    /// The longest JSON kept on the stack.
    const SHORT: usize = 48;

    /// The JSON text, if its type could say.
    pub fn bytes(&self) -> Option<&[u8]> {
        match &self.text {
            FieldText::Unknown => None,
            FieldText::Short(len, buf) => buf.get(..usize::from(*len)),
            FieldText::Long(json) => Some(json),
        }
    }

    /// How the field's type reads a value sent, if it can say.
    pub(crate) fn reread(&self) -> Option<crate::fingerprint::Reread> {
        self.reread
    }

    /// `value` as JSON.
    fn of<T: serde::Serialize>(value: &T, reread: Option<crate::fingerprint::Reread>) -> Self {
        // Written once, whatever its length: a `Serialize` may not give the
        // same text twice, and a write that never fails leaves no error for
        // a `Display` behind `collect_str` to ignore.
        let mut out = FieldJson {
            text: FieldText::Short(0, [0; FieldJson::SHORT]),
            reread,
        };
        if serde_json::to_writer(&mut out, value).is_err() {
            out.text = FieldText::Unknown;
        }
        out
    }
}

/// The JSON text `sent`, read as `T` and written back.
fn reread<T: serde::Serialize + serde::de::DeserializeOwned>(sent: &[u8]) -> Option<Vec<u8>> {
    let value: T = serde_json::from_slice(sent).ok()?;
    serde_json::to_vec(&value).ok()
}

#[doc(hidden)]
pub trait ViaDeserialize {
    fn __idem_json(&self) -> FieldJson;
}

impl<T: serde::Serialize + serde::de::DeserializeOwned> ViaDeserialize for &&FieldProbe<'_, T> {
    fn __idem_json(&self) -> FieldJson {
        FieldJson::of(self.0, Some(reread::<T>))
    }
}

#[doc(hidden)]
pub trait ViaSerialize {
    fn __idem_json(&self) -> FieldJson;
}

impl<T: serde::Serialize> ViaSerialize for &FieldProbe<'_, T> {
    fn __idem_json(&self) -> FieldJson {
        FieldJson::of(self.0, None)
    }
}

/// Fills the stack buffer, then moves to the heap: it never fails.
impl std::io::Write for FieldJson {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        match &mut self.text {
            FieldText::Short(len, buf) => {
                let at = usize::from(*len);
                match buf.get_mut(at..at + data.len()) {
                    Some(room) => {
                        room.copy_from_slice(data);
                        *len += data.len() as u8;
                    }
                    None => {
                        let mut all = Vec::with_capacity((at + data.len()).max(2 * FieldJson::SHORT));
                        all.extend_from_slice(&buf[..at]);
                        all.extend_from_slice(data);
                        self.text = FieldText::Long(all);
                    }
                }
            }
            FieldText::Long(all) => all.extend_from_slice(data),
            FieldText::Unknown => {}
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[doc(hidden)]
pub trait ViaNothing {
    fn __idem_json(&self) -> FieldJson;
}

impl<T> ViaNothing for FieldProbe<'_, T> {
    fn __idem_json(&self) -> FieldJson {
        FieldJson {
            text: FieldText::Unknown,
            reread: None,
        }
    }
}

#[cfg(test)]
mod tests {
    /// What the probe reads is `serde_json`'s text of the value, short or
    /// long, and nothing for a value that cannot be written as JSON.
    #[test]
    fn a_field_reads_as_its_json_whatever_its_length() {
        let read = |v: &dyn erased::Probe| v.json().bytes().map(<[u8]>::to_vec);
        for len in [0, 1, 45, 46, 47, 48, 49, 200] {
            let text = "x".repeat(len);
            assert_eq!(
                read(&text),
                Some(serde_json::to_vec(&text).unwrap()),
                "{len} characters"
            );
        }
        assert_eq!(read(&4990u64), Some(b"4990".to_vec()));
        assert_eq!(
            read(&"\u{e9}\"".to_owned()),
            Some(serde_json::to_vec("\u{e9}\"").unwrap())
        );
        let refused: std::collections::HashMap<Vec<u8>, u8> = [(vec![1], 1)].into();
        assert_eq!(read(&refused), None, "a map keyed by bytes is not JSON");
        let long_refused: std::collections::BTreeMap<String, std::collections::HashMap<Vec<u8>, u8>> =
            [("y".repeat(60), refused)].into();
        assert_eq!(read(&long_refused), None, "nor past the buffer");
    }

    /// A value is written once, however long: one whose `Serialize` works
    /// only once, or whose `Display` goes on after a write error, reads as
    /// its JSON past the stack buffer too (written twice, the first would
    /// read as unknown and the second panic in a debug build).
    #[test]
    fn a_long_field_is_written_once() {
        struct Once(String, std::cell::Cell<bool>);
        impl serde::Serialize for Once {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                if self.1.replace(true) {
                    return Err(serde::ser::Error::custom("already written"));
                }
                s.serialize_str(&self.0)
            }
        }
        struct Words(Vec<&'static str>);
        impl std::fmt::Display for Words {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                for (i, w) in self.0.iter().enumerate() {
                    if i > 0 {
                        let _ = f.write_str(" ");
                    }
                    let _ = f.write_str(w);
                }
                Ok(())
            }
        }
        impl serde::Serialize for Words {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }
        let read = |v: &dyn erased::Probe| v.json().bytes().map(<[u8]>::to_vec);
        for len in [10, 46, 47, 60] {
            let text = "r".repeat(len);
            let once = Once(text.clone(), std::cell::Cell::new(false));
            assert_eq!(
                read(&once),
                Some(serde_json::to_vec(&text).unwrap()),
                "{len} characters"
            );
        }
        let words = Words(vec![
            "alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
        ]);
        let expected = serde_json::to_vec(&words.to_string()).unwrap();
        assert_eq!(read(&words), Some(expected));
    }

    mod erased {
        use super::super::*;

        pub(super) trait Probe {
            fn json(&self) -> FieldJson;
        }

        impl<T: serde::Serialize> Probe for T {
            fn json(&self) -> FieldJson {
                (&&FieldProbe(self)).__idem_json()
            }
        }
    }
}
