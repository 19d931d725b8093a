//! Every refusal of the layer: one variant of [`Problem`] each, with its
//! status, `type` name, title and detail, answered as an RFC 9457 problem.
//! The README's table of refusals is checked against [`Problem::catalog`].

use crate::key::KeyError;
use axum::body::Body;
use axum::body::Bytes;
use axum::http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use std::borrow::Cow;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// The start of every problem `type` of this layer; the name follows.
pub const PROBLEM_TYPE_PREFIX: &str = "urn:idem:problem:";

/// The largest `Retry-After` of a 409, in seconds.
const MAX_RETRY_AFTER_SECS: u64 = 2;

/// How many problems have a body that never varies (see `Problem::fixed`).
const FIXED_BODIES: usize = 9;

/// The `Retry-After` of a 503, in seconds.
const UNAVAILABLE_RETRY_AFTER_SECS: u64 = 2;

/// A refusal of the layer: what the client gets instead of the handler's
/// answer. Its `type` is [`PROBLEM_TYPE_PREFIX`] (or the configured
/// `problem_type_base`) followed by [`Problem::type_name`].
///
/// ```
/// use idem::Problem;
/// use axum::response::IntoResponse;
///
/// let p = Problem::KeyReused;
/// assert_eq!(p.status().as_u16(), 422);
/// assert_eq!(p.type_name(), "idempotency-key-reused");
/// let response = p.into_response();
/// assert_eq!(response.headers()["content-type"], "application/problem+json");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Problem {
    /// 400: the key header is absent ([`KeyError::Missing`]) or invalid.
    Key {
        /// What is wrong with it.
        error: KeyError,
        /// The header's name.
        header: &'static str,
    },
    /// 400: a JSON body that is not I-JSON; the reason.
    BodyInvalid(String),
    /// 409: another execution with this key and fingerprint still runs.
    InProgress {
        /// Time until its lock deadline.
        retry_after: Duration,
    },
    /// 422: the key was used with a different request.
    KeyReused,
    /// 503: the store failed or did not answer in time; what is known.
    StoreUnavailable(Unavailable),
    /// 503: another execution took this one's operation over.
    LeaseLost,
    /// 500: no idem layer on the route, or no tenant.
    Misconfigured,
    /// 500: the handler (or its response body) panicked.
    HandlerFailed,
}

/// What a 503 `idempotency-store-unavailable` knows about the request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unavailable {
    /// Refused before the handler ran.
    NotProcessed,
    /// The handler's transaction was rolled back.
    RolledBack,
    /// The outcome could not be recorded (or its commit's fate is unknown).
    OutcomeUnknown,
    /// The handler stopped on a store error it passed on with `?`.
    NotCompleted,
}

impl Problem {
    /// One problem of each kind, in the order of the README's table.
    ///
    /// ```
    /// assert!(idem::Problem::catalog().iter().any(|p| p.type_name() == "handler-failed"));
    /// ```
    pub fn catalog() -> Vec<Problem> {
        vec![
            Problem::Key {
                error: KeyError::Missing,
                header: "idempotency-key",
            },
            Problem::Key {
                error: KeyError::Empty,
                header: "idempotency-key",
            },
            Problem::BodyInvalid(String::new()),
            Problem::InProgress {
                retry_after: Duration::from_secs(1),
            },
            Problem::KeyReused,
            Problem::StoreUnavailable(Unavailable::NotProcessed),
            Problem::LeaseLost,
            Problem::Misconfigured,
            Problem::HandlerFailed,
        ]
    }

    /// The HTTP status.
    ///
    /// ```
    /// assert_eq!(idem::Problem::LeaseLost.status().as_u16(), 503);
    /// ```
    pub fn status(&self) -> StatusCode {
        match self {
            Problem::Key { .. } | Problem::BodyInvalid(_) => StatusCode::BAD_REQUEST,
            Problem::InProgress { .. } => StatusCode::CONFLICT,
            Problem::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            Problem::StoreUnavailable(_) | Problem::LeaseLost => StatusCode::SERVICE_UNAVAILABLE,
            Problem::Misconfigured | Problem::HandlerFailed => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The name the problem's `type` ends with.
    ///
    /// ```
    /// assert_eq!(idem::Problem::Misconfigured.type_name(), "idempotency-misconfigured");
    /// ```
    pub fn type_name(&self) -> &'static str {
        match self {
            Problem::Key {
                error: KeyError::Missing,
                ..
            } => "idempotency-key-missing",
            Problem::Key { .. } => "idempotency-key-invalid",
            Problem::BodyInvalid(_) => "idempotency-body-invalid",
            Problem::InProgress { .. } => "idempotency-request-in-progress",
            Problem::KeyReused => "idempotency-key-reused",
            Problem::StoreUnavailable(_) => "idempotency-store-unavailable",
            Problem::LeaseLost => "idempotency-lease-lost",
            Problem::Misconfigured => "idempotency-misconfigured",
            Problem::HandlerFailed => "handler-failed",
        }
    }

    /// The short human-readable summary.
    ///
    /// ```
    /// assert_eq!(idem::Problem::KeyReused.title(), "Idempotency key reused");
    /// ```
    pub fn title(&self) -> &'static str {
        match self {
            Problem::Key {
                error: KeyError::Missing,
                ..
            } => "Idempotency key missing",
            Problem::Key { .. } => "Idempotency key invalid",
            Problem::BodyInvalid(_) => "Request body invalid",
            Problem::InProgress { .. } => "Request in progress",
            Problem::KeyReused => "Idempotency key reused",
            Problem::StoreUnavailable(_) => "Idempotency store unavailable",
            Problem::LeaseLost => "Idempotency lease lost",
            Problem::Misconfigured => "Idempotency layer misconfigured",
            Problem::HandlerFailed => "Internal error",
        }
    }

    /// What the client should know: only what is known about the request.
    ///
    /// ```
    /// use idem::{Problem, Unavailable};
    /// let p = Problem::StoreUnavailable(Unavailable::NotProcessed);
    /// assert!(p.detail().contains("not processed"));
    /// ```
    pub fn detail(&self) -> Cow<'static, str> {
        match self {
            Problem::Key { error, header } => format!("{error} (header `{header}`)").into(),
            Problem::BodyInvalid(why) => {
                format!("{why}; a request with an idempotency key must be I-JSON (RFC 7493)").into()
            }
            Problem::InProgress { .. } => "a request with this idempotency key is still being processed; retry \
                                           later with the same key"
                .into(),
            Problem::KeyReused => "this idempotency key was already used with a different request; use a new \
                                   key for a new request"
                .into(),
            Problem::StoreUnavailable(what) => match what {
                Unavailable::NotProcessed => "the request was not processed; retry later with the same key",
                Unavailable::RolledBack => {
                    "the request's changes in this service were rolled back; retry later with the same key"
                }
                Unavailable::OutcomeUnknown => {
                    "the outcome of the request could not be recorded; retry later with the same key to get it"
                }
                Unavailable::NotCompleted => "the request could not be completed; retry later with the same key",
            }
            .into(),
            Problem::LeaseLost => "this execution lost its lock on the request's operation, which another \
                                   execution may have taken over; retry later with the same key to get the \
                                   operation's answer"
                .into(),
            Problem::Misconfigured => "the server is not configured correctly for this endpoint; the request \
                                       was not processed"
                .into(),
            Problem::HandlerFailed => "the request failed; it may be retried with the same key".into(),
        }
    }

    /// For a problem whose body is the same every time (its texts do not
    /// vary): where that body is kept, below [`FIXED_BODIES`].
    fn fixed(&self) -> Option<usize> {
        Some(match self {
            Problem::Key { .. } | Problem::BodyInvalid(_) => return None,
            Problem::InProgress { .. } => 0,
            Problem::KeyReused => 1,
            Problem::StoreUnavailable(Unavailable::NotProcessed) => 2,
            Problem::StoreUnavailable(Unavailable::RolledBack) => 3,
            Problem::StoreUnavailable(Unavailable::OutcomeUnknown) => 4,
            Problem::StoreUnavailable(Unavailable::NotCompleted) => 5,
            Problem::LeaseLost => 6,
            Problem::Misconfigured => 7,
            Problem::HandlerFailed => 8,
        })
    }

    /// The `Retry-After` it carries, in seconds.
    ///
    /// ```
    /// assert_eq!(idem::Problem::LeaseLost.retry_after(), Some(2));
    /// assert_eq!(idem::Problem::KeyReused.retry_after(), None);
    /// ```
    pub fn retry_after(&self) -> Option<u64> {
        match self {
            // Until the lock deadline, at most 2 s: the lease keeps a living
            // owner's deadline a whole lock timeout away, yet it may finish
            // at once.
            Problem::InProgress { retry_after } => {
                let secs = retry_after
                    .as_secs()
                    .saturating_add(u64::from(retry_after.subsec_nanos() > 0));
                Some(secs.clamp(1, MAX_RETRY_AFTER_SECS))
            }
            Problem::StoreUnavailable(_) | Problem::LeaseLost => Some(UNAVAILABLE_RETRY_AFTER_SECS),
            _ => None,
        }
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let parts = Parts {
            name: Cow::Borrowed(self.type_name()),
            title: Cow::Borrowed(self.title()),
            detail: self.detail(),
            rebased: None,
        };
        let status = self.status();
        let mut response = match self.fixed() {
            // Written once, then shared.
            Some(slot) => {
                static FIXED: [OnceLock<Box<str>>; FIXED_BODIES] = [const { OnceLock::new() }; FIXED_BODIES];
                let body: &'static str =
                    FIXED[slot].get_or_init(|| parts.body(status, PROBLEM_TYPE_PREFIX).into());
                parts.response_with(status, Body::from(body))
            }
            None => parts.response(status),
        };
        if let Some(secs) = self.retry_after() {
            response
                .headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

/// A store failure a handler passes on with `?` (from a checkpoint or a
/// transaction): `503 idempotency-store-unavailable` with `Retry-After`,
/// which releases the key (a lost lock cannot be released, and is not).
/// The store's own message is logged, never sent.
impl IntoResponse for crate::StoreError {
    fn into_response(self) -> Response {
        tracing::error!(error = %self, "the handler stopped on a store error");
        Problem::StoreUnavailable(Unavailable::NotCompleted).into_response()
    }
}

/// An RFC 9457 problem response whose `type` ends with `name`, for a
/// service's own refusals in the same shape as the layer's.
///
/// ```
/// use axum::http::StatusCode;
/// let r = idem::problem(StatusCode::PAYMENT_REQUIRED, "card-declined", "Card declined", "insufficient funds");
/// assert_eq!(r.headers()["content-type"], "application/problem+json");
/// ```
pub fn problem(status: StatusCode, name: &str, title: &str, detail: &str) -> Response {
    let parts = Parts {
        name: Cow::Owned(name.to_owned()),
        title: Cow::Owned(title.to_owned()),
        detail: Cow::Owned(detail.to_owned()),
        rebased: None,
    };
    // The handler may put a body of its own in this one's place: the text
    // is chosen when the body is read, so that a rebase changes this body
    // alone, never the one the handler wrote.
    let text = Arc::new(ProblemText {
        first: Bytes::from(parts.body(status, PROBLEM_TYPE_PREFIX)),
        rebased: OnceLock::new(),
    });
    let body = Body::new(ProblemBody {
        text: Some(text.clone()),
    });
    Parts {
        rebased: Some(text),
        ..parts
    }
    .response_with(status, body)
}

/// The text of a handler's problem: as first written, or under the base the
/// layer rebased it to before it was read.
struct ProblemText {
    first: Bytes,
    rebased: OnceLock<Bytes>,
}

impl ProblemText {
    fn now(&self) -> &Bytes {
        self.rebased.get().unwrap_or(&self.first)
    }
}

/// The body [`problem`] gives: one frame, the text as it is when read.
struct ProblemBody {
    text: Option<Arc<ProblemText>>,
}

impl http_body::Body for ProblemBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        let frame = self
            .text
            .take()
            .map(|text| Ok(http_body::Frame::data(text.now().clone())));
        std::task::Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.text.is_none()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.text.as_ref().map_or(0, |text| text.now().len() as u64))
    }
}

/// What a problem response says, kept in its extensions so that its `type`
/// can be written with another base. The layer's own problems borrow their
/// texts.
#[derive(Clone)]
struct Parts {
    name: Cow<'static, str>,
    title: Cow<'static, str>,
    detail: Cow<'static, str>,
    /// A handler's problem: its body reads the rebased text from here.
    rebased: Option<Arc<ProblemText>>,
}

impl Parts {
    /// The problem's JSON object, its members in the order of their names.
    fn body(&self, status: StatusCode, base: &str) -> String {
        use crate::jcs::{write_escaped, write_string};
        let mut out =
            String::with_capacity(48 + self.detail.len() + self.title.len() + base.len() + self.name.len());
        out.push_str("{\"detail\":");
        write_string(&mut out, &self.detail);
        out.push_str(",\"status\":");
        out.push_str(status.as_str());
        out.push_str(",\"title\":");
        write_string(&mut out, &self.title);
        // The escape of `base` then `name` is that of the two as one text.
        out.push_str(",\"type\":\"");
        write_escaped(&mut out, base);
        write_escaped(&mut out, &self.name);
        out.push_str("\"}");
        out
    }

    fn response(self, status: StatusCode) -> Response {
        let body = Body::from(self.body(status, PROBLEM_TYPE_PREFIX));
        self.response_with(status, body)
    }

    /// The response, its body already written.
    fn response_with(self, status: StatusCode, body: Body) -> Response {
        let mut response = Response::new(body);
        *response.status_mut() = status;
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
        response.extensions_mut().insert(self);
        response
    }
}

/// A problem response with its `type` under `base`; any other response as
/// it is. Rebased once: the result carries no parts to rebase again.
pub(crate) fn rebase(mut response: Response, base: &str) -> Response {
    let Some(parts) = response.extensions_mut().remove::<Parts>() else {
        return response;
    };
    let text = parts.body(response.status(), base);
    if let Some(shared) = &parts.rebased {
        // The handler's own problem: its body, if still the one `problem()`
        // gave, reads this text; a body the handler wrote stays as written.
        let _ = shared.rebased.set(Bytes::from(text));
        return response;
    }
    let (mut head, _) = response.into_parts();
    head.headers.remove(axum::http::header::CONTENT_LENGTH);
    Response::from_parts(head, Body::from(text))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_problem_body_is_json_with_its_own_status_and_type() {
        for p in Problem::catalog() {
            let (status, name, retry) = (p.status(), p.type_name(), p.retry_after());
            let r = p.into_response();
            assert_eq!(r.status(), status);
            assert_eq!(
                r.headers()
                    .get(RETRY_AFTER)
                    .map(|v| v.to_str().unwrap().parse::<u64>().unwrap()),
                retry
            );
            let parts = r.extensions().get::<Parts>().unwrap();
            let body: serde_json::Value =
                serde_json::from_str(&parts.body(status, PROBLEM_TYPE_PREFIX)).unwrap();
            assert_eq!(body["type"], format!("{PROBLEM_TYPE_PREFIX}{name}"));
            assert_eq!(body["status"], status.as_u16());
        }
    }

    #[test]
    fn any_wait_gives_a_retry_after_of_one_to_two_seconds() {
        for (wait, secs) in [
            (Duration::ZERO, 1),
            (Duration::from_millis(1), 1),
            (Duration::from_millis(1001), 2),
            (Duration::from_secs(3600), 2),
            (Duration::MAX, 2),
        ] {
            let p = Problem::InProgress { retry_after: wait };
            assert_eq!(p.retry_after(), Some(secs), "{wait:?}");
        }
    }

    #[test]
    fn a_fixed_body_is_the_one_its_own_texts_give() {
        let mut every = Problem::catalog();
        every.extend(
            [
                Unavailable::RolledBack,
                Unavailable::OutcomeUnknown,
                Unavailable::NotCompleted,
            ]
            .map(Problem::StoreUnavailable),
        );
        every.push(Problem::InProgress {
            retry_after: Duration::from_millis(1500),
        });
        let mut slots = Vec::new();
        // Twice: written, then shared.
        for _ in 0..2 {
            for p in &every {
                let expected = Parts {
                    name: Cow::Borrowed(p.type_name()),
                    title: Cow::Borrowed(p.title()),
                    detail: p.detail(),
                    rebased: None,
                }
                .body(p.status(), PROBLEM_TYPE_PREFIX);
                let body = p.clone().into_response().into_body();
                let body = futures_util::FutureExt::now_or_never(axum::body::to_bytes(body, usize::MAX))
                    .unwrap()
                    .unwrap();
                assert_eq!(std::str::from_utf8(&body).unwrap(), expected, "{p:?}");
                slots.extend(p.fixed());
            }
        }
        slots.sort_unstable();
        slots.dedup();
        assert_eq!(slots, (0..FIXED_BODIES).collect::<Vec<_>>());
    }

    #[test]
    fn a_problem_body_escapes_as_serde_json_does_whatever_its_texts_hold() {
        let texts = [
            "",
            "plain",
            "quote \" and backslash \\",
            "controls \u{0} \u{8} \u{c} \n \r \t \u{1f} \u{7f}",
            "non-ASCII é 😀 \u{2028}",
            "</script>",
        ];
        for base in ["", PROBLEM_TYPE_PREFIX, "https://example.com/\"q\"/\n"] {
            for text in texts {
                for status in [StatusCode::CONFLICT, StatusCode::INTERNAL_SERVER_ERROR] {
                    let parts = Parts {
                        name: Cow::Owned(format!("name-{text}")),
                        title: Cow::Owned(format!("title {text}")),
                        detail: Cow::Owned(text.to_owned()),
                        rebased: None,
                    };
                    // serde_json's escaping of each text, in the body's
                    // fixed member order (a map's order would depend on
                    // serde_json's `preserve_order` feature).
                    let json = |s: &str| serde_json::to_string(s).unwrap();
                    let expected = format!(
                        "{{\"detail\":{},\"status\":{},\"title\":{},\"type\":{}}}",
                        json(text),
                        status.as_u16(),
                        json(&format!("title {text}")),
                        json(&format!("{base}name-{text}")),
                    );
                    let body = parts.body(status, base);
                    assert_eq!(body, expected, "{base:?} {text:?}");
                    let parsed: serde_json::Value = serde_json::from_str(&body).unwrap();
                    assert_eq!(parsed["type"], format!("{base}name-{text}"));
                    assert_eq!(parsed["detail"], text);
                }
            }
        }
    }
}
