//! Request fingerprints (docs/PROTOCOL.md; README, "The fingerprint"): SHA-256 over a version tag,
//! the scope, the route's path parameters, the query and the body as the
//! client sent it, each part length-prefixed. Changing this encoding is a
//! breaking change: the golden vectors in `tests/fingerprint_vectors.json`
//! pin it.

pub use crate::jcs::{canonical_json, JsonError};

use crate::jcs::{self, Node};
use sha2::{Digest, Sha256};

/// The version tag that starts every fingerprint input. Records written
/// under another version never match a new request's fingerprint: a retry
/// that spans the upgrade gets 422 until the old record expires.
pub const FINGERPRINT_VERSION: &str = "idem-fingerprint-v2";

/// A request's body, as the fingerprint sees it.
#[derive(Clone, Copy, Debug)]
pub enum BodyPrint<'a> {
    /// The handler reads no body.
    None,
    /// A JSON body (`Json<T>`), as sent. With `fields`, only the members at
    /// those dotted paths of wire names count, when every one is there;
    /// without `fields`, or when one is missing, the whole body does.
    Json {
        /// The body's bytes.
        text: &'a [u8],
        /// The declared fields' wire paths.
        fields: Option<&'a [&'a str]>,
        /// What the handler read for each declared field, as JSON (`None`
        /// where its type cannot say). A field counts by its wire path only
        /// where the JSON there is what the handler read; otherwise (a
        /// serde alias, `flatten`, another member under the same name) the
        /// whole body counts. `None`: not checked.
        read: Option<&'a [Option<&'a [u8]>]>,
    },
    /// A form body (`Form<T>`): its pairs, each name's values in order.
    Form(&'a [u8]),
    /// Any other body (`String`, `Bytes`): its bytes.
    Raw(&'a [u8]),
}

/// Everything that identifies a request to the fingerprint.
///
/// ```
/// use idem::fingerprint::{fingerprint, BodyPrint, RequestPrint};
///
/// let refund = |payment: &str| {
///     fingerprint(&RequestPrint {
///         scope: "refund.create",
///         path: &[("id", payment)],
///         query: None,
///         body: BodyPrint::Json { text: br#"{"amount": 500}"#, fields: Some(&["amount"]), read: None },
///         ignore: &[],
///     })
///     .unwrap()
/// };
/// assert_ne!(refund("pay_a"), refund("pay_b"));
/// ```
#[derive(Clone, Copy, Debug)]
pub struct RequestPrint<'a> {
    /// The operation name of the attribute.
    pub scope: &'a str,
    /// The route's path parameters, by name.
    pub path: &'a [(&'a str, &'a str)],
    /// The raw query string, without `?`.
    pub query: Option<&'a str>,
    /// The body.
    pub body: BodyPrint<'a>,
    /// Path parameters and query names that do not count.
    pub ignore: &'a [&'a str],
}

/// The body cannot be fingerprinted: it is not I-JSON (RFC 7493).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FingerprintError(pub String);

impl std::fmt::Display for FingerprintError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "cannot fingerprint the request body: {}", self.0)
    }
}

impl std::error::Error for FingerprintError {}

impl From<JsonError> for FingerprintError {
    fn from(e: JsonError) -> Self {
        FingerprintError(e.0)
    }
}

/// The fingerprint (64 lowercase hex digits) of a request.
///
/// What never changes it: whitespace, member order, number spelling
/// (`4990`, `4.99e3`), unicode escapes, undeclared body members when
/// `fields` are given, the order of different query names (but for names
/// that decode alike and are not UTF-8, such as `%FF` and `%FE`, which a
/// handler reads as one: their order counts, as one name's values' does),
/// ignored names.
/// What always does: the scope, a path parameter, a query value, a declared
/// field (or, without `fields`, any member), any byte of a raw body.
///
/// # Errors
///
/// [`FingerprintError`] for a JSON body that is not I-JSON: duplicate member
/// names, a lone surrogate, a number beyond the range of a double, nesting
/// deeper than 128.
pub fn fingerprint(req: &RequestPrint<'_>) -> Result<String, FingerprintError> {
    Ok(fingerprint_hex(req, &[])?.as_str().to_owned())
}

/// Reads the JSON text of a value as a declared field's type would, and
/// writes what it read back as JSON; `None` where that type refuses it.
pub(crate) type Reread = fn(&[u8]) -> Option<Vec<u8>>;

/// A request's fingerprint as the generated code hands it to the protocol:
/// its digits, kept inline, or why the body has none.
#[doc(hidden)]
pub type Printed = Result<HexStr<64>, FingerprintError>;

/// [`fingerprint`], its digits kept inline. `rereads`: how each declared
/// field's type reads a value sent, where it can say (see `agrees` in
/// [`digest`]).
pub(crate) fn fingerprint_hex(req: &RequestPrint<'_>, rereads: &[Option<Reread>]) -> Printed {
    // One buffer per thread for the canonical texts, kept between requests
    // unless a large body made it large. Taken, not borrowed: a call made
    // while it is out gets a new one.
    thread_local! {
        static CANONICAL: std::cell::Cell<String> = const { std::cell::Cell::new(String::new()) };
    }
    const KEPT: usize = 16 * 1024;
    // A thread tearing down its locals gets a buffer of its own.
    let mut canonical = CANONICAL.try_with(std::cell::Cell::take).unwrap_or_default();
    canonical.clear();
    let digest = digest(req, rereads, &mut canonical);
    if canonical.capacity() <= KEPT {
        let _ = CANONICAL.try_with(|kept| kept.set(canonical));
    }
    Ok(HexStr::of(&digest?))
}

/// How many declared fields or path parameters are gathered on the stack;
/// more take a vector.
const FIELDS_INLINE: usize = 8;

/// Runs `f` on `items`, gathered on the stack when there are at most
/// [`FIELDS_INLINE`] of them, else in a vector.
pub(crate) fn gathered<T: Copy + Default, R>(
    items: impl Iterator<Item = T>,
    f: impl FnOnce(&mut [T]) -> R,
) -> R {
    let mut inline = [T::default(); FIELDS_INLINE];
    let mut len = 0;
    let mut spilled = Vec::new();
    for item in items {
        match inline.get_mut(len) {
            Some(slot) if spilled.is_empty() => {
                *slot = item;
                len += 1;
            }
            _ => {
                if spilled.is_empty() {
                    spilled.extend_from_slice(&inline[..len]);
                }
                spilled.push(item);
            }
        }
    }
    if spilled.is_empty() {
        f(&mut inline[..len])
    } else {
        f(&mut spilled)
    }
}

/// The SHA-256 of the request's parts, `canonical` holding each canonical
/// text in turn.
fn digest(
    req: &RequestPrint<'_>,
    rereads: &[Option<Reread>],
    canonical: &mut String,
) -> Result<[u8; 32], FingerprintError> {
    let mut hasher = Sha256::new();
    let mut put = |bytes: &[u8]| {
        hasher.update((bytes.len() as u64).to_be_bytes());
        hasher.update(bytes);
    };
    put(FINGERPRINT_VERSION.as_bytes());
    put(req.scope.as_bytes());
    let counts = |name: &str| !req.ignore.contains(&name);

    gathered(req.path.iter().copied().filter(|(n, _)| counts(n)), |path| {
        path.sort_by(|a, b| jcs::utf16_cmp(a.0, b.0));
        put(b"path");
        // The canonical JSON object of the parameters, as `Node::Object` writes it.
        canonical.push('{');
        for (i, (name, value)) in path.iter().enumerate() {
            if i > 0 {
                canonical.push(',');
            }
            jcs::write_string(canonical, name);
            canonical.push(':');
            jcs::write_string(canonical, value);
        }
        canonical.push('}');
        put(canonical.as_bytes());
    });

    put(b"query");
    match req.query {
        // What `pairs` makes of no pairs.
        None | Some("") => put(b"[]"),
        Some(query) => put(pairs(query.as_bytes(), &counts).as_bytes()),
    }

    put(b"body");
    match req.body {
        BodyPrint::None => put(b"none"),
        BodyPrint::Raw(bytes) => {
            put(b"raw");
            put(bytes);
        }
        BodyPrint::Form(bytes) => {
            put(b"form");
            put(pairs(bytes, &|_| true).as_bytes());
        }
        BodyPrint::Json {
            text, fields: None, ..
        } => {
            put(b"json");
            canonical.clear();
            jcs::parse(text)?.write(canonical);
            put(canonical.as_bytes());
        }
        BodyPrint::Json {
            text,
            fields: Some(fields),
            read,
        } => {
            let body = jcs::parse(text)?;
            // Where the handler read something else than the member at the
            // wire path, that member does not identify the request. Two
            // values are equal exactly when their canonical forms are. Or
            // where the value sent, read as the field's type reads it (when
            // that type is `Deserialize` too), writes as what the handler
            // read: an object whose `Option` members the client left out,
            // which serde writes as `null`, or fills with their defaults.
            // The fingerprint covers the value sent, which then decides
            // what the handler's type reads. Not where the value sent has a
            // member that what the handler read does not show (one its
            // type never writes, `skip_serializing`): where the field is
            // read from another wire name, that member would stand for one
            // the handler read, and is not it.
            let agrees = |i: usize, node: &Node| match read {
                None => true,
                Some(read) => read.get(i).copied().flatten().is_some_and(|json| {
                    plain_equals(json, node).unwrap_or_else(|| {
                        let Ok(typed) = jcs::parse(json) else { return false };
                        typed == *node
                            || rereads
                                .get(i)
                                .copied()
                                .flatten()
                                .is_some_and(|reread| reads_as(reread, node, &typed))
                    })
                }),
            };
            // Every declared field where its wire path says; else (the
            // field left out, sent under an alias, in an array, behind a
            // flattened or renamed name) the whole body counts, so that two
            // different requests can never meet on a missing value.
            // Each field's name and value, `None` where it is missing or
            // not what the handler read.
            let found = fields
                .iter()
                .enumerate()
                .map(|(i, f)| body.get(f).filter(|node| agrees(i, node)).map(|node| (*f, node)));
            gathered(found, |values| {
                if values.iter().all(Option::is_some) {
                    values.sort_unstable_by_key(|v| v.map(|(f, _)| f));
                    put(b"fields");
                    let mut last = None;
                    for &(field, value) in values.iter().flatten() {
                        // A field named twice counts once.
                        if last == Some(field) {
                            continue;
                        }
                        last = Some(field);
                        put(field.as_bytes());
                        canonical.clear();
                        value.write(canonical);
                        put(canonical.as_bytes());
                    }
                } else {
                    put(b"json");
                    canonical.clear();
                    body.write(canonical);
                    put(canonical.as_bytes());
                }
            });
        }
    }
    Ok(hasher.finalize().into())
}

/// Whether `sent`, read by a declared field's type (`reread`) and written
/// back, is `typed`, what the handler read, and has no member `typed` does
/// not show (see `agrees` in [`digest`]).
fn reads_as(reread: Reread, sent: &Node<'_>, typed: &Node<'_>) -> bool {
    if !sent.shown_in(typed) {
        return false;
    }
    let mut text = String::new();
    sent.write(&mut text);
    reread(text.as_bytes()).is_some_and(|again| jcs::parse(&again).is_ok_and(|again| again == *typed))
}

/// Whether the JSON text `json` is the value `node`, without parsing it,
/// when it is what most fields are: a string without escapes, or an integer
/// of at most 15 digits (below 2^53, so a double holds it). Both are then
/// their own canonical form. `None` for anything else: parse it.
fn plain_equals(json: &[u8], node: &Node<'_>) -> Option<bool> {
    match json {
        [b'"', inner @ .., b'"'] if !inner.iter().any(|&b| b == b'\\' || b == b'"' || b < 0x20) => {
            Some(matches!(node, Node::String(s) if s.as_bytes() == inner))
        }
        _ => {
            let digits = json.strip_prefix(b"-").unwrap_or(json);
            let plain = matches!(digits, [b'1'..=b'9', rest @ ..] if rest.len() < 15 && rest.iter().all(u8::is_ascii_digit))
                || json == b"0";
            plain.then(|| matches!(node, Node::Number(n) if n.as_bytes() == json))
        }
    }
}

/// `application/x-www-form-urlencoded` pairs as canonical JSON: an array of
/// `[name, value]`, sorted by name as a handler reads it, each name's
/// values in their order. A name or value whose bytes are not UTF-8 once
/// decoded is the array of its bytes, so that two different byte strings
/// never read as one (a lossy decoding would make `%FF` and `%FE` the same
/// character); but the names are ordered by their lossy text, as axum's
/// `Query` and `Form` read them (`%FF`, `%FE` and `%EF%BF%BD` all U+FFFD),
/// so that the order of names a handler reads as one, whose last value a
/// map keeps, counts as that of one name's values does.
fn pairs(encoded: &[u8], counts: &dyn Fn(&str) -> bool) -> String {
    let mut pairs: Vec<(Component, Node<'static>)> = encoded
        .split(|&b| b == b'&')
        .filter(|pair| !pair.is_empty())
        .filter_map(|pair| {
            let (name, value) = match pair.iter().position(|&b| b == b'=') {
                Some(at) => (&pair[..at], &pair[at + 1..]),
                None => (pair, &pair[pair.len()..]),
            };
            let name = Component::decode(name);
            // A name that is not UTF-8 is never one the attribute lists.
            let counted = name.text().is_none_or(counts);
            counted.then(|| (name, Component::decode(value).node()))
        })
        .collect();
    // By name as read (UTF-16 code units of the lossy text), in a stable
    // sort: the pairs of one name, and of names that read as one, keep
    // their order.
    pairs.sort_by(|(a, _), (b, _)| jcs::utf16_cmp(&a.lossy, &b.lossy));
    Node::Array(
        pairs
            .into_iter()
            .map(|(n, v)| Node::Array(vec![n.node(), v]))
            .collect(),
    )
    .canonical()
}

/// One decoded name or value of a form.
struct Component {
    bytes: Vec<u8>,
    /// The bytes as text, with U+FFFD where they are not UTF-8.
    lossy: String,
}

impl Component {
    fn decode(raw: &[u8]) -> Self {
        let plus: Vec<u8> = raw.iter().map(|&b| if b == b'+' { b' ' } else { b }).collect();
        let bytes: Vec<u8> = percent_encoding::percent_decode(&plus).collect();
        let lossy = String::from_utf8_lossy(&bytes).into_owned();
        Component { bytes, lossy }
    }

    /// The text, when the bytes are UTF-8.
    fn text(&self) -> Option<&str> {
        std::str::from_utf8(&self.bytes).ok()
    }

    /// The string, or, when the bytes are not UTF-8, the array of its bytes.
    fn node(self) -> Node<'static> {
        match String::from_utf8(self.bytes) {
            Ok(text) => Node::String(text.into()),
            Err(e) => Node::Array(
                e.into_bytes()
                    .iter()
                    .map(|b| Node::Number(b.to_string().into()))
                    .collect(),
            ),
        }
    }
}

/// Lowercase hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    let mut digits = vec![0; bytes.len() * 2];
    hex_into(bytes, &mut digits);
    String::from_utf8(digits).unwrap_or_else(|_| unreachable!("hex digits are ASCII"))
}

/// `bytes` as lowercase hex digits into `out`, two per byte.
fn hex_into(bytes: &[u8], out: &mut [u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for (pair, &b) in out.chunks_exact_mut(2).zip(bytes) {
        pair[0] = DIGITS[usize::from(b >> 4)];
        pair[1] = DIGITS[usize::from(b & 0x0f)];
    }
}

/// `N` lowercase hex digits, kept inline: a fingerprint (64) or a token
/// (32) that a request carries without allocating it.
#[doc(hidden)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct HexStr<const N: usize>([u8; N]);

impl<const N: usize> HexStr<N> {
    /// The digits of the first `N / 2` bytes of `bytes`, padded with `0`
    /// when it is shorter.
    pub fn of(bytes: &[u8]) -> Self {
        let mut digits = [b'0'; N];
        hex_into(bytes, &mut digits);
        HexStr(digits)
    }

    /// The digits.
    pub fn as_str(&self) -> &str {
        std::str::from_utf8(&self.0).unwrap_or_else(|_| unreachable!("hex digits are ASCII"))
    }
}

impl<const N: usize> std::fmt::Debug for HexStr<N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn query_values_that_are_not_utf8_stay_distinct() {
        let p = |q: &'static str| print(&[], Some(q), BodyPrint::None);
        let all = [
            p("ref=%FF"),
            p("ref=%FE"),
            p("ref=%EF%BF%BD"),
            p("ref=%FF%FF"),
            p("%FF=1"),
        ];
        for (i, a) in all.iter().enumerate() {
            for b in &all[i + 1..] {
                assert_ne!(a, b);
            }
        }
        // Valid text reads as before, however it is encoded.
        assert_eq!(p("ref=caf%C3%A9"), p("ref=café"));
        assert_eq!(p("a=1+2"), p("a=1%202"));
        // Names that a handler reads as one (U+FFFD, lossily) keep their
        // order, as one name's values do: a map keeps the last.
        assert_ne!(p("%FF=1&%FE=2"), p("%FE=2&%FF=1"));
        assert_ne!(p("%FF=1&%EF%BF%BD=2"), p("%EF%BF%BD=2&%FF=1"));
        // Names that read apart are ordered, whatever their bytes.
        assert_eq!(p("%FF=1&b=2"), p("b=2&%FF=1"));
    }

    fn print<'a>(path: &'a [(&'a str, &'a str)], query: Option<&'a str>, body: BodyPrint<'a>) -> String {
        fingerprint(&RequestPrint {
            scope: "s",
            path,
            query,
            body,
            ignore: &["utm_source"],
        })
        .unwrap()
    }

    #[test]
    fn the_query_counts_except_the_order_of_names_and_ignored_names() {
        let base = print(&[], Some("a=1&b=2"), BodyPrint::None);
        assert_eq!(print(&[], Some("b=2&a=1"), BodyPrint::None), base);
        assert_eq!(print(&[], Some("a=1&utm_source=x&b=2"), BodyPrint::None), base);
        assert_eq!(print(&[], Some("a=%31&b=2"), BodyPrint::None), base);
        assert_ne!(print(&[], Some("a=1&b=3"), BodyPrint::None), base);
        assert_ne!(
            print(&[], Some("a=1&a=2"), BodyPrint::None),
            print(&[], Some("a=2&a=1"), BodyPrint::None)
        );
        assert_ne!(print(&[], None, BodyPrint::None), base);
    }

    #[test]
    fn parts_cannot_be_confused_with_each_other() {
        let a = print(&[("id", "1")], None, BodyPrint::None);
        let b = print(&[], Some("id=1"), BodyPrint::None);
        let c = print(&[], None, BodyPrint::Raw(b"id=1"));
        let d = print(&[], None, BodyPrint::Form(b"id=1"));
        assert!(a != b && b != c && c != d && a != d);
    }

    #[test]
    fn declared_fields_count_by_wire_path_and_nothing_else() {
        let fields: &[&str] = &["amount", "recipient.account"];
        let fp = |text: &'static str| {
            print(
                &[],
                None,
                BodyPrint::Json {
                    text: text.as_bytes(),
                    fields: Some(fields),
                    read: None,
                },
            )
        };
        let base = fp(r#"{"amount":1,"recipient":{"account":"a"}}"#);
        assert_eq!(
            fp(r#"{"recipient":{"name":"x","account":"a"},"amount":1.0,"note":"hi"}"#),
            base
        );
        assert_ne!(fp(r#"{"amount":2,"recipient":{"account":"a"}}"#), base);
        assert_ne!(fp(r#"{"amount":1,"recipient":{"account":"b"}}"#), base);
        // A missing field is not a null one: the whole body counts then.
        assert_ne!(
            fp(r#"{"amount":1}"#),
            fp(r#"{"amount":1,"recipient":{"account":null}}"#)
        );
        assert_ne!(fp(r#"{"amount":1}"#), fp(r#"{"amount":2}"#));
        assert_ne!(fp(r#"[1,"a"]"#), fp(r#"[2,"a"]"#));
    }

    /// Path parameters count by name, in any order, few (on the stack) or
    /// many (in a vector), ignored names left out.
    #[test]
    fn path_parameters_count_by_name_however_many() {
        let names: Vec<String> = (0..12).map(|i| format!("p{i}")).collect();
        let params: Vec<(&str, &str)> = names.iter().map(|n| (n.as_str(), "v")).collect();
        for n in [0, 1, 8, 9, 12] {
            let some = &params[..n];
            let mut reversed = some.to_vec();
            reversed.reverse();
            let base = print(some, None, BodyPrint::None);
            assert_eq!(print(&reversed, None, BodyPrint::None), base, "{n} parameters");
            let mut ignored = some.to_vec();
            ignored.insert(n / 2, ("utm_source", "x"));
            assert_eq!(print(&ignored, None, BodyPrint::None), base, "{n} parameters");
            if let Some(last) = reversed.first_mut() {
                last.1 = "w";
                assert_ne!(print(&reversed, None, BodyPrint::None), base, "{n} parameters");
            }
        }
        let gathered = |n: usize| super::gathered(0..n, |items| items.to_vec());
        for n in [0, 7, 8, 9, 20] {
            assert_eq!(gathered(n), (0..n).collect::<Vec<_>>());
        }
    }

    /// The declared fields count as a set: in any order, named twice, few
    /// (gathered on the stack) or many (in a vector), the same set prints
    /// the same, and what the handler read is matched to its own field.
    #[test]
    fn declared_fields_count_as_a_set_however_many() {
        let body = br#"{"f0":0,"f1":1,"f2":2,"f3":3,"f4":4,"f5":5,"f6":6,"f7":7,"f8":8,"note":"x"}"#;
        let names = ["f0", "f1", "f2", "f3", "f4", "f5", "f6", "f7", "f8"];
        let fp = |fields: &[&str], read: Option<&[Option<&[u8]>]>| {
            print(
                &[],
                None,
                BodyPrint::Json {
                    text: body,
                    fields: Some(fields),
                    read,
                },
            )
        };
        let nine = fp(&names, None);
        let mut reversed = names;
        reversed.reverse();
        assert_eq!(fp(&reversed, None), nine);
        // Eight named, one of them twice: nine entries, eight fields.
        let eight = fp(&names[..8], None);
        assert_ne!(eight, nine);
        let mut twice = names;
        twice[8] = "f3";
        assert_eq!(fp(&twice, None), eight);
        assert_eq!(fp(&["f2", "f1", "f2", "f0"], None), fp(&["f0", "f1", "f2"], None));
        // Read as sent: as if unchecked. Read otherwise at the ninth
        // field (an alias, say): the whole body counts, note and all.
        let digits: Vec<String> = (0..9).map(|i| i.to_string()).collect();
        let agree: Vec<Option<&[u8]>> = digits.iter().map(|d| Some(d.as_bytes())).collect();
        assert_eq!(fp(&names, Some(&agree)), nine);
        let mut other = agree.clone();
        other[8] = Some(b"9");
        let whole = print(
            &[],
            None,
            BodyPrint::Json {
                text: body,
                fields: None,
                read: None,
            },
        );
        assert_eq!(fp(&names, Some(&other)), whole);
        let mut reversed_read = agree;
        reversed_read.reverse();
        assert_eq!(fp(&reversed, Some(&reversed_read)), nine);
    }

    fn json_print(text: &str) -> String {
        print(
            &[],
            None,
            BodyPrint::Json {
                text: text.as_bytes(),
                fields: Some(&["a", "b"]),
                read: None,
            },
        )
    }

    proptest! {
        #[test]
        fn hex_is_two_lowercase_digits_per_byte(bytes in proptest::collection::vec(any::<u8>(), 0..80)) {
            let expected: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
            prop_assert_eq!(hex(&bytes), expected.clone());
            if let Some(token) = bytes.get(..16) {
                let inline = HexStr::<32>::of(token);
                prop_assert_eq!(inline.as_str(), &expected[..32]);
            }
        }

        /// Requests that differ in a path parameter, a query value, a
        /// declared field or any byte of a raw body never share a
        /// fingerprint.
        #[test]
        fn what_identifies_a_request_always_changes_it(
            x in "[a-z0-9]{1,8}", y in "[a-z0-9]{1,8}", n in any::<i64>(), m in any::<i64>(),
            raw in proptest::collection::vec(any::<u8>(), 1..64), at in any::<usize>(), flip in 1u8..=255,
        ) {
            prop_assume!(x != y && n != m);
            prop_assert_ne!(print(&[("id", &x)], None, BodyPrint::None), print(&[("id", &y)], None, BodyPrint::None));
            let (qx, qy) = (format!("q={x}"), format!("q={y}"));
            prop_assert_ne!(print(&[], Some(&qx), BodyPrint::None), print(&[], Some(&qy), BodyPrint::None));
            prop_assert_ne!(json_print(&format!(r#"{{"a":{n},"b":1}}"#)), json_print(&format!(r#"{{"a":{m},"b":1}}"#)));
            let mut other = raw.clone();
            let i = at % other.len();
            other[i] ^= flip;
            prop_assert_ne!(print(&[], None, BodyPrint::Raw(&raw)), print(&[], None, BodyPrint::Raw(&other)));
        }

        /// Requests that differ only in an undeclared field, whitespace,
        /// member order or number spelling always share it.
        #[test]
        fn what_does_not_identify_a_request_never_changes_it(
            n in -1_000_000i64..1_000_000, s in "[a-z]{0,8}", note in "[a-z ]{0,12}", ws in "[ \t\n]{0,3}", swap in any::<bool>(),
        ) {
            let base = json_print(&format!(r#"{{"a":{n},"b":"{s}"}}"#));
            let (first, second) = (format!(r#""a"{ws}:{ws}{n}.0e0"#), format!(r#""b":{ws}"{s}""#));
            let members = if swap { [second, first] } else { [first, second] };
            let spelled = format!("{ws}{{{ws}{},{ws}{},\"note\":\"{note}\"}}{ws}", members[0], members[1]);
            prop_assert_eq!(json_print(&spelled), base);
        }

        /// Where a value is read without parsing it, it agrees with the
        /// parser: on typed values as serde_json writes them, and on raw
        /// texts that only look plain.
        #[test]
        fn plain_values_agree_with_the_parser(
            a in plain_or_not(), b in plain_or_not(),
        ) {
            let (node_a, node_b) = (jcs::parse(&a).unwrap(), jcs::parse(&b).unwrap());
            if let Some(equal) = plain_equals(&a, &node_b) {
                prop_assert_eq!(equal, node_a == node_b, "{} against {}", String::from_utf8_lossy(&a), String::from_utf8_lossy(&b));
            }
            prop_assert_ne!(plain_equals(&a, &node_a), Some(false));
        }
    }

    /// JSON texts of values a field holds, plain and not: strings with and
    /// without escapes, integers around 15 digits and 2^53, other numbers,
    /// and raw spellings of the same values.
    fn plain_or_not() -> impl Strategy<Value = Vec<u8>> {
        let typed = prop_oneof![
            any::<String>().prop_map(serde_json::Value::from),
            "[a-z\"\\\\/\u{0}-\u{1f}\u{e9}\u{1f600}]{0,6}".prop_map(serde_json::Value::from),
            any::<i64>().prop_map(serde_json::Value::from),
            (-1_000_000_000_000_000i64..1_000_000_000_000_000).prop_map(serde_json::Value::from),
            (-10_000_000_000_000_000i64..10_000_000_000_000_000).prop_map(serde_json::Value::from),
            (0i64..100).prop_map(serde_json::Value::from),
            any::<u64>().prop_map(serde_json::Value::from),
            any::<f64>().prop_map(serde_json::Value::from),
            any::<bool>().prop_map(serde_json::Value::from),
        ]
        .prop_map(|v| serde_json::to_vec(&v).unwrap());
        let raw = prop::sample::select(vec![
            "-0",
            "0",
            "1.0",
            "1e2",
            "10",
            "-10",
            "999999999999999",
            "1000000000000000",
            "9007199254740993",
            "\"\\u0041\"",
            "\"A\"",
            "\"\\/\"",
            "\"/\"",
            "\"\"",
            "\"a\\\"b\"",
            "null",
        ])
        .prop_map(|t| t.as_bytes().to_vec());
        prop_oneof![3 => typed, 1 => raw]
    }
}
