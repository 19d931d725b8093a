//! The `Idempotency-Key` header: parsing and validation (README, "What a client gets").

use std::fmt;

/// The longest key accepted, in bytes (after quotes and escapes are removed).
pub const MAX_KEY_LEN: usize = 255;

/// A validated idempotency key.
///
/// Holds 1 to 255 visible ASCII characters (0x21 to 0x7E) other than `,`,
/// `"` and `\`. Built only by [`IdempotencyKey::parse`] or
/// [`IdempotencyKey::from_header_values`].
///
/// ```
/// use idem::key::IdempotencyKey;
///
/// let key = IdempotencyKey::parse(b"\"order-7\"").unwrap();
/// assert_eq!(key.as_str(), "order-7");
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

/// Why a key header was refused. Each variant names the rule that failed.
///
/// ```
/// use idem::key::{IdempotencyKey, KeyError};
///
/// assert_eq!(IdempotencyKey::parse(b"a,b"), Err(KeyError::Comma));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyError {
    /// The header is absent.
    Missing,
    /// The header is present but empty (or an empty quoted string).
    Empty,
    /// More than [`MAX_KEY_LEN`] characters.
    TooLong,
    /// A comma: two header values folded into one.
    Comma,
    /// A byte outside visible ASCII: a control character, a space, or non-ASCII.
    InvalidCharacter,
    /// A `"` or `\` in the key, quoted or not (a quoted key's escaped `\"`
    /// and `\\` are refused too, once unescaped), or a quoted string that
    /// is not well-formed: unclosed, a bad escape, or text after its
    /// closing quote.
    BadQuoting,
    /// The header was sent more than once.
    Repeated,
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KeyError::Missing => "the idempotency key header is required",
            KeyError::Empty => "the idempotency key is empty",
            KeyError::TooLong => "the idempotency key is longer than 255 characters",
            KeyError::Comma => {
                "the idempotency key contains a comma (the header was folded from several values)"
            }
            KeyError::InvalidCharacter => {
                "the idempotency key may only contain visible ASCII characters (0x21 to 0x7E)"
            }
            KeyError::BadQuoting => {
                "the idempotency key contains a `\"` or `\\` (not allowed, quoted or escaped), \
                 or is a quoted string that is not well-formed"
            }
            KeyError::Repeated => "the idempotency key header was sent more than once",
        })
    }
}

impl std::error::Error for KeyError {}

impl IdempotencyKey {
    /// Parses one header value: a bare token, or an RFC 8941 string
    /// (`"..."`, with `\"` and `\\` as the only escapes).
    ///
    /// # Errors
    ///
    /// A [`KeyError`] naming the rule the value breaks.
    ///
    /// ```
    /// use idem::key::{IdempotencyKey, KeyError};
    ///
    /// assert_eq!(IdempotencyKey::parse(b"pay_01H8").unwrap().as_str(), "pay_01H8");
    /// assert_eq!(IdempotencyKey::parse(b""), Err(KeyError::Empty));
    /// assert_eq!(IdempotencyKey::parse(b"caf\xc3\xa9"), Err(KeyError::InvalidCharacter));
    /// ```
    pub fn parse(raw: &[u8]) -> Result<Self, KeyError> {
        let key = if raw.first() == Some(&b'"') {
            unquote(raw)?
        } else {
            raw.to_vec()
        };
        if key.is_empty() {
            return Err(KeyError::Empty);
        }
        if key.iter().any(|b| !(0x21..=0x7e).contains(b)) {
            return Err(KeyError::InvalidCharacter);
        }
        if key.contains(&b',') {
            return Err(KeyError::Comma);
        }
        if key.iter().any(|&b| b == b'"' || b == b'\\') {
            return Err(KeyError::BadQuoting);
        }
        if key.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong);
        }
        // Every byte is visible ASCII, so this cannot fail.
        String::from_utf8(key)
            .map(IdempotencyKey)
            .map_err(|_| KeyError::InvalidCharacter)
    }

    /// Parses the values of the key header as a request carries them: none,
    /// one, or (an error) several.
    ///
    /// # Errors
    ///
    /// [`KeyError::Missing`] for no value, [`KeyError::Repeated`] for more
    /// than one, otherwise what [`IdempotencyKey::parse`] says.
    ///
    /// ```
    /// use idem::key::{IdempotencyKey, KeyError};
    ///
    /// let none: [&[u8]; 0] = [];
    /// assert_eq!(IdempotencyKey::from_header_values(none), Err(KeyError::Missing));
    /// assert_eq!(
    ///     IdempotencyKey::from_header_values([&b"a"[..], &b"b"[..]]),
    ///     Err(KeyError::Repeated)
    /// );
    /// ```
    pub fn from_header_values<'a, I>(values: I) -> Result<Self, KeyError>
    where
        I: IntoIterator<Item = &'a [u8]>,
    {
        let mut values = values.into_iter();
        let first = values.next().ok_or(KeyError::Missing)?;
        if values.next().is_some() {
            return Err(KeyError::Repeated);
        }
        Self::parse(first)
    }

    /// The key as the client meant it (quotes and escapes removed).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The key as the client meant it, as a `String`, without a copy.
    ///
    /// ```
    /// use idem::key::IdempotencyKey;
    /// let key = IdempotencyKey::parse(b"\"order-1\"").unwrap();
    /// assert_eq!(key.into_string(), "order-1");
    /// ```
    pub fn into_string(self) -> String {
        self.0
    }

    /// A short, stable, one-way digest of the key (12 hex digits), for logs
    /// and spans: clients sometimes put personal data in keys.
    ///
    /// ```
    /// use idem::key::IdempotencyKey;
    /// let key = IdempotencyKey::parse(b"alice@example.com").unwrap();
    /// assert_eq!(key.log_hash().len(), 12);
    /// assert!(!key.log_hash().contains("alice"));
    /// ```
    pub fn log_hash(&self) -> String {
        use sha2::{Digest, Sha256};
        let digest = Sha256::digest(self.0.as_bytes());
        crate::fingerprint::hex(&digest[..6])
    }

    /// [`IdempotencyKey::log_hash`], computed only when it is written: a
    /// span that no subscriber records costs no digest.
    #[cfg(feature = "axum")]
    pub(crate) fn log_hash_display(&self) -> impl fmt::Display + '_ {
        struct Lazy<'a>(&'a IdempotencyKey);
        impl fmt::Display for Lazy<'_> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0.log_hash())
            }
        }
        Lazy(self)
    }
}

impl fmt::Debug for IdempotencyKey {
    // Never print the raw key in debug output either.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdempotencyKey(#{})", self.log_hash())
    }
}

/// RFC 8941 section 3.3.3: `"` chars `"`, where `\` escapes only `"` and `\`.
fn unquote(raw: &[u8]) -> Result<Vec<u8>, KeyError> {
    let mut out = Vec::with_capacity(raw.len());
    let mut bytes = raw[1..].iter();
    loop {
        match bytes.next() {
            None => return Err(KeyError::BadQuoting),
            Some(b'\\') => match bytes.next() {
                Some(&c @ (b'"' | b'\\')) => out.push(c),
                _ => return Err(KeyError::BadQuoting),
            },
            Some(b'"') => {
                return if bytes.next().is_none() {
                    Ok(out)
                } else {
                    Err(KeyError::BadQuoting)
                };
            }
            Some(&c) if (0x20..=0x7e).contains(&c) => out.push(c),
            Some(_) => return Err(KeyError::InvalidCharacter),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse(s: &[u8]) -> Result<String, KeyError> {
        IdempotencyKey::parse(s).map(|k| k.0)
    }

    #[test]
    fn accepts_visible_ascii_as_is() {
        assert_eq!(
            parse(b"abc-123_XYZ.~!#$%&'()*+/:;<=>?@[]^`{|}").unwrap(),
            "abc-123_XYZ.~!#$%&'()*+/:;<=>?@[]^`{|}"
        );
        assert_eq!(parse(b"x").unwrap(), "x");
        assert_eq!(parse(&[b'k'; 255]).unwrap().len(), 255);
    }

    #[test]
    fn accepts_structured_field_strings_without_their_quotes() {
        assert_eq!(parse(b"\"order-7\"").unwrap(), "order-7");
        assert_eq!(parse(b"\"a\\\\b\"").unwrap_err(), KeyError::BadQuoting);
        assert_eq!(parse(b"\"a\\\"b\"").unwrap_err(), KeyError::BadQuoting);
        // Said as what it is: a quote the key may not hold, not a string
        // that is not well-formed.
        assert!(KeyError::BadQuoting.to_string().contains("quoted or escaped"));
        assert_eq!(parse(b"\"a b\"").unwrap_err(), KeyError::InvalidCharacter);
    }

    #[test]
    fn refuses_each_invalid_class_with_its_own_error() {
        assert_eq!(parse(b""), Err(KeyError::Empty));
        assert_eq!(parse(b"\"\""), Err(KeyError::Empty));
        assert_eq!(parse(&[b'k'; 256]), Err(KeyError::TooLong));
        assert_eq!(parse(b"a,b"), Err(KeyError::Comma));
        assert_eq!(parse(b"a, b"), Err(KeyError::InvalidCharacter));
        assert_eq!(parse(b"a\tb"), Err(KeyError::InvalidCharacter));
        assert_eq!(parse(b"a\x7fb"), Err(KeyError::InvalidCharacter));
        assert_eq!(parse(b"caf\xc3\xa9"), Err(KeyError::InvalidCharacter));
        assert_eq!(parse(b"\"open"), Err(KeyError::BadQuoting));
        assert_eq!(parse(b"\"a\"b"), Err(KeyError::BadQuoting));
        assert_eq!(parse(b"\"a\\nb\""), Err(KeyError::BadQuoting));
        assert_eq!(parse(b"a\"b"), Err(KeyError::BadQuoting));
        assert_eq!(parse(b"a\\b"), Err(KeyError::BadQuoting));
    }

    #[test]
    fn refuses_absent_and_repeated_headers() {
        let none: Vec<&[u8]> = vec![];
        assert_eq!(IdempotencyKey::from_header_values(none), Err(KeyError::Missing));
        assert_eq!(
            IdempotencyKey::from_header_values(vec![&b"k1"[..], &b"k1"[..]]),
            Err(KeyError::Repeated)
        );
        assert_eq!(
            IdempotencyKey::from_header_values(vec![&b"k1"[..]]).map(|k| k.0),
            Ok("k1".to_owned())
        );
    }

    #[test]
    fn debug_output_hides_the_key() {
        let key = IdempotencyKey::parse(b"secret-customer-email").unwrap();
        assert!(!format!("{key:?}").contains("secret"));
    }

    fn valid_key() -> impl Strategy<Value = String> {
        proptest::collection::vec(
            (0x21u8..=0x7e).prop_filter("not , \" \\", |b| !matches!(b, b',' | b'"' | b'\\')),
            1..=255,
        )
        .prop_map(|v| String::from_utf8(v).unwrap())
    }

    proptest! {
        #[test]
        fn every_valid_key_round_trips_bare(key in valid_key()) {
            prop_assert_eq!(parse(key.as_bytes()).unwrap(), key);
        }

        #[test]
        fn every_valid_key_round_trips_quoted(key in valid_key()) {
            let quoted = format!("\"{key}\"");
            prop_assert_eq!(parse(quoted.as_bytes()).unwrap(), key);
        }

        #[test]
        fn keys_longer_than_255_are_refused(key in "[a-z]{256,400}") {
            prop_assert_eq!(parse(key.as_bytes()), Err(KeyError::TooLong));
        }

        #[test]
        fn any_comma_is_refused(a in "[a-z]{0,50}", b in "[a-z]{0,50}") {
            let key = format!("{a},{b}");
            prop_assert_eq!(parse(key.as_bytes()), Err(KeyError::Comma));
        }

        #[test]
        fn any_control_or_non_ascii_byte_is_refused(
            a in "[a-z]{0,20}",
            bad in prop_oneof![0u8..=0x20, 0x7fu8..=0xff],
            b in "[a-z]{0,20}",
        ) {
            let mut key = a.into_bytes();
            key.push(bad);
            key.extend(b.into_bytes());
            prop_assert_eq!(parse(&key), Err(KeyError::InvalidCharacter));
        }

        #[test]
        fn parse_never_panics(raw in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = parse(&raw);
        }
    }
}
