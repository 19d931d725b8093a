//! Classification: how a handler's outcome is recorded (stored, released as
//! failed, or rejected), and the probes the attribute uses to find a
//! [`Classify`] impl. See docs/PROTOCOL.md, "Classification".

use axum::http::StatusCode;

/// How an outcome of the handler is recorded (docs/PROTOCOL.md, "Classification").
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
    /// retry (408, 425, 429, 5xx and past, a panic). The record stays bound to its
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
    /// rejected; 408, 425, 429, every 5xx and every status past 599 (600
    /// to 999, which a client processes as a 5xx: RFC 9110 section 15) are
    /// released as failed; every other 4xx is stored. A 1xx other than 101 (an upgrade) is not a
    /// final answer (HTTP cannot send one as such): released as failed, and
    /// its client gets 500, whatever a handler's error type says.
    ///
    /// ```
    /// # use idem::Classification;
    /// # use axum::http::StatusCode;
    /// assert_eq!(Classification::from_status(StatusCode::CONFLICT), Classification::Reject);
    /// assert_eq!(Classification::from_status(StatusCode::TOO_MANY_REQUESTS), Classification::Release);
    /// assert_eq!(Classification::from_status(StatusCode::NOT_FOUND), Classification::Store);
    /// assert_eq!(Classification::from_status(StatusCode::CONTINUE), Classification::Release);
    /// let past_599 = StatusCode::from_u16(600).unwrap();
    /// assert_eq!(Classification::from_status(past_599), Classification::Release);
    /// ```
    pub fn from_status(status: StatusCode) -> Self {
        if never_final(status) {
            return Classification::Release;
        }
        match status.as_u16() {
            400 | 409 | 422 => Classification::Reject,
            // 600 to 999 (which `http` lets a handler send) are no HTTP
            // status: a client processes one as a 5xx (RFC 9110 15).
            408 | 425 | 429 | 500..=999 => Classification::Release,
            _ => Classification::Store,
        }
    }
}

/// Whether `status` can never be a final answer: a 1xx other than 101
/// Switching Protocols, which hyper sends as the answer to an upgrade.
pub(crate) fn never_final(status: StatusCode) -> bool {
    status.is_informational() && status != StatusCode::SWITCHING_PROTOCOLS
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

/// The autoref probe the generated code uses to find a [`Classify`] impl on
/// the handler's error type, then on its whole return type, else none.
#[doc(hidden)]
pub struct Probe<'a, T>(pub &'a T);

/// A return type named `Result`, which the macro reads as the standard
/// library's (its second argument the error type whose `Classify` impl
/// decides): it must be that one, or the impl would be ignored.
#[doc(hidden)]
#[diagnostic::on_unimplemented(
    message = "`#[idempotent]` reads a return type named `Result` as the standard library's, whose error type's \
               `Classify` impl decides; `{Self}` is another type, whose error's impl would be ignored",
    label = "not `std::result::Result`",
    note = "return `std::result::Result` (or an alias of it), or give this type another name"
)]
pub trait NamedResult {}

impl<T, E> NamedResult for Result<T, E> {}

/// Checks at compile time that a return type named `Result` is one.
#[doc(hidden)]
pub fn named_result<T: NamedResult>(_: &T) {}

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
            // Outside 100..599, invalid: processed as a 5xx (RFC 9110 15).
            (600, Classification::Release),
            (999, Classification::Release),
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
}
