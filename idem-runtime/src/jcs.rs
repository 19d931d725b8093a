//! RFC 8785 (JCS) canonical JSON of the bytes a client sent: a parser that
//! keeps what typed deserialization loses (integers of any size, member
//! names as sent) and refuses what I-JSON (RFC 7493) forbids, and the
//! canonical writer.

use std::borrow::Cow;
use std::cmp::Ordering;
use std::fmt::Write as _;

/// How deep arrays and objects may nest (as `serde_json` allows).
const MAX_DEPTH: usize = 128;

/// A body that is not I-JSON, so it has no canonical form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonError(pub(crate) String);

impl std::fmt::Display for JsonError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for JsonError {}

/// A parsed JSON value, its numbers already in canonical form. Its text
/// borrows from the JSON text where that text is already the value's.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Node<'a> {
    Null,
    Bool(bool),
    /// The canonical text of the number.
    Number(Cow<'a, str>),
    String(Cow<'a, str>),
    Array(Vec<Node<'a>>),
    /// Members sorted by their names' UTF-16 code units.
    Object(Vec<(Cow<'a, str>, Node<'a>)>),
}

/// The RFC 8785 canonical form of the JSON text `text`: object members
/// sorted by the UTF-16 code units of their names, no whitespace, minimal
/// string escapes, numbers in ECMAScript form from correctly rounded
/// parsing.
///
/// Two deliberate differences, where RFC 8785 would round a number to the
/// nearest double: an integer written in digits (perhaps with a point and
/// zeros) that no double holds exactly (past 2^53, such as a `u128`) is
/// kept exactly, as its digits followed by `.0` (a form ECMAScript never
/// writes), and an integer that a double does hold is written as RFC 8785
/// writes that double; a number written with more than 17 significant
/// digits (more than any double needs) keeps its exact value. Two different
/// numbers of those kinds never share a canonical form.
///
/// # Errors
///
/// [`JsonError`] for text that is not I-JSON: invalid JSON, duplicate member
/// names, a lone surrogate, a number beyond the range of a double, nesting
/// deeper than 128.
///
/// ```
/// use idem::fingerprint::canonical_json;
/// assert_eq!(canonical_json(br#"{ "b": 4.99e3, "a": "\u00e9" }"#).unwrap(), r#"{"a":"é","b":4990}"#);
/// assert!(canonical_json(br#"{"a": 1, "a": 2}"#).is_err());
/// ```
pub fn canonical_json(text: &[u8]) -> Result<String, JsonError> {
    Ok(parse(text)?.canonical())
}

pub(crate) fn parse(text: &[u8]) -> Result<Node<'_>, JsonError> {
    let text = std::str::from_utf8(text).map_err(|_| JsonError("the body is not UTF-8".into()))?;
    let mut p = Parser {
        text,
        s: text.as_bytes(),
        at: 0,
    };
    p.skip_ws();
    let node = p.value(0)?;
    p.skip_ws();
    if p.at != p.s.len() {
        return Err(p.error("unexpected text after the value"));
    }
    Ok(node)
}

impl Node<'_> {
    pub(crate) fn canonical(&self) -> String {
        let mut out = String::with_capacity(64);
        self.write(&mut out);
        out
    }

    /// Appends the canonical form to `out`.
    pub(crate) fn write(&self, out: &mut String) {
        match self {
            Node::Null => out.push_str("null"),
            Node::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Node::Number(n) => out.push_str(n),
            Node::String(s) => write_string(out, s),
            Node::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    item.write(out);
                }
                out.push(']');
            }
            Node::Object(members) => {
                out.push('{');
                for (i, (name, value)) in members.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    write_string(out, name);
                    out.push(':');
                    value.write(out);
                }
                out.push('}');
            }
        }
    }

    /// Whether every member of every object in `self` (a value sent) is in
    /// `written` (a value as a type wrote it) at the same place: `written`
    /// may have more members, and other scalars.
    pub(crate) fn shown_in(&self, written: &Node<'_>) -> bool {
        match (self, written) {
            // Both sorted by name: one walk, however many members.
            (Node::Object(sent), Node::Object(written)) => {
                let mut written = written.iter().peekable();
                sent.iter().all(|(name, value)| {
                    while written
                        .next_if(|(n, _)| utf16_cmp(n, name) == Ordering::Less)
                        .is_some()
                    {}
                    written
                        .next_if(|(n, _)| n == name)
                        .is_some_and(|(_, w)| value.shown_in(w))
                })
            }
            (Node::Object(_), _) => false,
            (Node::Array(sent), Node::Array(written)) => {
                sent.len() == written.len() && sent.iter().zip(written).all(|(s, w)| s.shown_in(w))
            }
            (Node::Array(_), _) => false,
            _ => true,
        }
    }

    /// The member at `path` (names, outermost first), if every step is an
    /// object that has it.
    pub(crate) fn get(&self, path: &str) -> Option<&Self> {
        path.split('.').try_fold(self, |node, name| match node {
            Node::Object(members) => members.iter().find(|(n, _)| n == name).map(|(_, v)| v),
            _ => None,
        })
    }
}

/// The order of `a` and `b` by their UTF-16 code units, as RFC 8785 sorts
/// member names.
pub(crate) fn utf16_cmp(a: &str, b: &str) -> Ordering {
    // UTF-8 bytes sort in code point order, and so do UTF-16 code units
    // except that U+E000..U+FFFF sort after U+10000 and up. The two orders
    // part only at the first code point that differs, and only if it is
    // from U+E000 up on either side: its first differing byte is then a
    // first byte from 0xEE up. (A differing continuation byte follows the
    // same first byte on both sides: two code points of one range.)
    let (x, y) = (a.as_bytes(), b.as_bytes());
    match x.iter().zip(y).position(|(p, q)| p != q) {
        None => x.len().cmp(&y.len()),
        Some(i) if x[i] < 0xEE && y[i] < 0xEE => x[i].cmp(&y[i]),
        Some(_) => a.encode_utf16().cmp(b.encode_utf16()),
    }
}

/// A JSON string, with RFC 8785's minimal escapes.
pub(crate) fn write_string(out: &mut String, s: &str) {
    out.push('"');
    write_escaped(out, s);
    out.push('"');
}

/// What [`write_string`] writes between the quotes: `s`, escaped.
pub(crate) fn write_escaped(out: &mut String, s: &str) {
    let mut rest = s;
    // Runs of characters written as they are, each up to an ASCII character
    // that takes an escape.
    while let Some(at) = rest.bytes().position(|b| b == b'"' || b == b'\\' || b < 0x20) {
        let (run, escaped) = rest.split_at(at);
        out.push_str(run);
        let c = escaped.as_bytes()[0];
        match c {
            b'"' => out.push_str("\\\""),
            b'\\' => out.push_str("\\\\"),
            0x08 => out.push_str("\\b"),
            0x0c => out.push_str("\\f"),
            b'\n' => out.push_str("\\n"),
            b'\r' => out.push_str("\\r"),
            b'\t' => out.push_str("\\t"),
            c => {
                let _ = write!(out, "\\u{c:04x}");
            }
        }
        rest = &escaped[1..];
    }
    out.push_str(rest);
}

/// The canonical text of a JSON number as written: the ECMAScript text of
/// its double (Rust's parser rounds correctly), with two departures that
/// keep a number the double would change:
///
/// - an integer written in digits (perhaps followed by a point and zeros)
///   whose digits that text would change (past 2^53, a `u128`) keeps its
///   exact digits followed by `.0` ([`integer`]);
/// - any other number written with more than 17 significant digits, more
///   than any double needs to be told apart, keeps its exact value
///   ([`Exact::text`]), and so does a number that is not zero but whose
///   double is (below a double's range).
///
/// Neither text is one ECMAScript writes for any double: two different
/// numbers of those kinds never share a text. A number with a fraction or an
/// exponent and at most 17 significant digits is its double, as RFC 8785
/// has it (`0.1` and `0.10000000000000001` are one number). Every
/// canonical text is its own canonical text.
fn number(lexeme: &str) -> Result<Cow<'_, str>, String> {
    let digits = lexeme.strip_suffix(".0").unwrap_or(lexeme);
    // An integer of at most 15 digits other than zero (JSON has no leading
    // zeros): a double holds it exactly, and ECMAScript writes it as its
    // digits.
    let magnitude = digits.strip_prefix('-').unwrap_or(digits);
    if (1..=15).contains(&magnitude.len())
        && magnitude.bytes().all(|b| b.is_ascii_digit())
        && !magnitude.starts_with('0')
    {
        return Ok(Cow::Borrowed(digits));
    }
    let beyond = || format!("the number {} is beyond the range of a double", shown(lexeme));
    let v: f64 = lexeme
        .parse()
        .map_err(|_| format!("invalid number {}", shown(lexeme)))?;
    // Digits, perhaps with a point and zeros: an integer as written.
    if let Some(whole) = lexeme
        .split_once('.')
        .map_or(Some(lexeme), |(whole, fraction)| {
            fraction.bytes().all(|b| b == b'0').then_some(whole)
        })
        .filter(|_| !lexeme.contains(['e', 'E']))
    {
        // Past a double's range as any other spelling of it is.
        if !v.is_finite() {
            return Err(beyond());
        }
        return Ok(Cow::Owned(integer(v, whole)));
    }
    if !v.is_finite() {
        return Err(beyond());
    }
    let significant = significant_digits(lexeme);
    if significant == 0 {
        return Ok("0".into());
    }
    if significant <= 17 && v != 0.0 {
        return Ok(Cow::Owned(ecmascript(v)));
    }
    let exact = Exact::of(lexeme).ok_or_else(beyond)?;
    if v == 0.0 {
        return Ok(Cow::Owned(exact.text()));
    }
    Ok(Cow::Owned(match exact.integer() {
        Some(whole) => integer(v, &whole),
        None => exact.text(),
    }))
}

/// The canonical text of the integer `digits` (JSON digits, perhaps with a
/// minus), whose double is `v`: the ECMAScript text of `v` when that text
/// is the integer (its digits, or from `1e21` up an exponent of the same
/// value); otherwise the digits followed by `.0`.
fn integer(v: f64, digits: &str) -> String {
    if v == 0.0 {
        return "0".into();
    }
    if v.is_finite() {
        let text = ecmascript(v);
        if text == digits || (text.contains('e') && Exact::of(&text) == Exact::of(digits)) {
            return text;
        }
    }
    format!("{digits}.0")
}

/// A number's text as an error shows it: its first 32 characters and its
/// length when it is longer (the error goes back to the client and into
/// the log, a text as long as the body it came in would not).
fn shown(lexeme: &str) -> Cow<'_, str> {
    match lexeme.get(..32) {
        Some(head) if lexeme.len() > 40 => format!("{head}... ({} characters)", lexeme.len()).into(),
        _ => lexeme.into(),
    }
}

/// How many significant digits a JSON number's text has: those of its
/// mantissa, leading and trailing zeros left out (none for zero).
fn significant_digits(lexeme: &str) -> usize {
    let mantissa = lexeme.split(['e', 'E']).next().unwrap_or(lexeme);
    let digits = || mantissa.bytes().filter(u8::is_ascii_digit);
    let leading = digits().take_while(|&b| b == b'0').count();
    let trailing = digits().rev().take_while(|&b| b == b'0').count();
    digits().count().saturating_sub(leading + trailing)
}

/// How many places from the units a number's first digit may be
/// (`1e-1000000000000000` is the smallest accepted, `1e-1000000000000001`
/// refused as `1e400` is): far past a double's range, and far from the
/// ends of an `i64`.
const MAX_POINT: u64 = 1_000_000_000_000_000;

/// The exact decimal value of a number's text (JSON's grammar, or
/// ECMAScript's, whose exponent may carry a `+`): `0.digits × 10^point`,
/// `digits` without leading or trailing zeros (none for zero, which has no
/// sign).
#[derive(Debug, PartialEq, Eq)]
struct Exact {
    negative: bool,
    digits: String,
    point: i64,
}

impl Exact {
    /// `None` when the first digit is more than [`MAX_POINT`] places from
    /// the units (far past any double's range, at either end).
    fn of(text: &str) -> Option<Self> {
        let (negative, unsigned) = match text.strip_prefix('-') {
            Some(rest) => (true, rest),
            None => (false, text),
        };
        let (mantissa, exponent) = match unsigned.find(['e', 'E']) {
            Some(at) => (&unsigned[..at], unsigned[at + 1..].parse::<i64>().ok()?),
            None => (unsigned, 0),
        };
        let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
        let all = whole.bytes().chain(fraction.bytes());
        let leading = all.clone().take_while(|&b| b == b'0').count();
        let mut digits: String = all.skip(leading).map(char::from).collect();
        digits.truncate(digits.trim_end_matches('0').len());
        if digits.is_empty() {
            return Some(Exact {
                negative: false,
                digits,
                point: 0,
            });
        }
        let point = i64::try_from(whole.len())
            .ok()?
            .checked_sub(i64::try_from(leading).ok()?)?
            .checked_add(exponent)?;
        // The first digit stands at 10^(point - 1).
        if point.checked_sub(1)?.unsigned_abs() > MAX_POINT {
            return None;
        }
        Some(Exact {
            negative,
            digits,
            point,
        })
    }

    /// The value's digits when it is an integer (a minus included).
    fn integer(&self) -> Option<String> {
        let k = i64::try_from(self.digits.len()).ok()?;
        let zeros = usize::try_from(self.point.checked_sub(k)?).ok()?;
        let mut out = String::with_capacity(self.digits.len() + zeros + 1);
        if self.negative {
            out.push('-');
        }
        out.push_str(&self.digits);
        out.extend(std::iter::repeat_n('0', zeros));
        Some(out)
    }

    /// The value, not an integer ([`integer`] writes those), in
    /// ECMAScript's layout with every digit: `0.000ddd`, `dd.ddd`, or
    /// `d.ddde±n` past 21 digits before the point or 6 zeros after it.
    fn text(&self) -> String {
        let mut out = String::with_capacity(self.digits.len() + 8);
        if self.negative {
            out.push('-');
        }
        let k = i64::try_from(self.digits.len()).unwrap_or(i64::MAX);
        let n = self.point;
        debug_assert!(n < k, "an integer's text is `integer`'s");
        if 0 < n && n <= 21 {
            let (whole, fraction) = self.digits.split_at(usize::try_from(n).unwrap_or(0));
            out.push_str(whole);
            out.push('.');
            out.push_str(fraction);
        } else if -6 < n && n <= 0 {
            out.push_str("0.");
            out.extend(std::iter::repeat_n('0', usize::try_from(-n).unwrap_or(0)));
            out.push_str(&self.digits);
        } else {
            let (first, rest) = self.digits.split_at(1);
            out.push_str(first);
            if !rest.is_empty() {
                out.push('.');
                out.push_str(rest);
            }
            let _ = write!(
                out,
                "e{}{}",
                if n > 0 { '+' } else { '-' },
                (n - 1).unsigned_abs()
            );
        }
        out
    }
}

/// ECMAScript's `Number.prototype.toString` of a finite double.
pub(crate) fn ecmascript(v: f64) -> String {
    if v == 0.0 {
        return "0".into();
    }
    ryu_js::Buffer::new().format_finite(v).to_owned()
}

struct Parser<'a> {
    /// The JSON text, and its bytes.
    text: &'a str,
    s: &'a [u8],
    at: usize,
}

impl<'a> Parser<'a> {
    fn error(&self, what: &str) -> JsonError {
        JsonError(format!("{what} at byte {}", self.at))
    }

    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.s.get(self.at) {
            self.at += 1;
        }
    }

    fn eat(&mut self, lit: &[u8]) -> bool {
        if self.s[self.at..].starts_with(lit) {
            self.at += lit.len();
            true
        } else {
            false
        }
    }

    /// A value inside `depth` arrays and objects.
    fn value(&mut self, depth: usize) -> Result<Node<'a>, JsonError> {
        if depth >= MAX_DEPTH && matches!(self.s.get(self.at), Some(b'{' | b'[')) {
            return Err(self.error("nested deeper than 128"));
        }
        match self.s.get(self.at) {
            Some(b'{') => self.object(depth),
            Some(b'[') => self.array(depth),
            Some(b'"') => Ok(Node::String(self.string()?)),
            Some(b'-' | b'0'..=b'9') => self.number(),
            _ if self.eat(b"null") => Ok(Node::Null),
            _ if self.eat(b"true") => Ok(Node::Bool(true)),
            _ if self.eat(b"false") => Ok(Node::Bool(false)),
            _ => Err(self.error("expected a JSON value")),
        }
    }

    fn object(&mut self, depth: usize) -> Result<Node<'a>, JsonError> {
        self.at += 1;
        let mut members: Vec<(Cow<'a, str>, Node<'a>)> = Vec::new();
        self.skip_ws();
        if self.eat(b"}") {
            return Ok(Node::Object(members));
        }
        loop {
            self.skip_ws();
            if self.s.get(self.at) != Some(&b'"') {
                return Err(self.error("expected a member name"));
            }
            let name = self.string()?;
            self.skip_ws();
            if !self.eat(b":") {
                return Err(self.error("expected `:`"));
            }
            self.skip_ws();
            let value = self.value(depth + 1)?;
            members.push((name, value));
            self.skip_ws();
            if self.eat(b",") {
                continue;
            }
            if self.eat(b"}") {
                break;
            }
            return Err(self.error("expected `,` or `}`"));
        }
        members.sort_by(|a, b| utf16_cmp(&a.0, &b.0));
        if let Some(pair) = members.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(JsonError(format!(
                "the member name {:?} appears twice",
                pair[0].0
            )));
        }
        Ok(Node::Object(members))
    }

    fn array(&mut self, depth: usize) -> Result<Node<'a>, JsonError> {
        self.at += 1;
        let mut items = Vec::new();
        self.skip_ws();
        if self.eat(b"]") {
            return Ok(Node::Array(items));
        }
        loop {
            self.skip_ws();
            items.push(self.value(depth + 1)?);
            self.skip_ws();
            if self.eat(b",") {
                continue;
            }
            if self.eat(b"]") {
                return Ok(Node::Array(items));
            }
            return Err(self.error("expected `,` or `]`"));
        }
    }

    fn number(&mut self) -> Result<Node<'a>, JsonError> {
        let start = self.at;
        let digits = |p: &mut Self| {
            let from = p.at;
            while p.s.get(p.at).is_some_and(u8::is_ascii_digit) {
                p.at += 1;
            }
            p.at > from
        };
        self.eat(b"-");
        if self.eat(b"0") {
            if self.s.get(self.at).is_some_and(u8::is_ascii_digit) {
                return Err(self.error("a number with a leading zero"));
            }
        } else if !digits(self) {
            return Err(self.error("expected digits"));
        }
        if self.eat(b".") && !digits(self) {
            return Err(self.error("expected digits after `.`"));
        }
        if self.eat(b"e") || self.eat(b"E") {
            let _ = self.eat(b"+") || self.eat(b"-");
            if !digits(self) {
                return Err(self.error("expected exponent digits"));
            }
        }
        // The lexeme is ASCII, checked above.
        let lexeme = self
            .text
            .get(start..self.at)
            .ok_or_else(|| self.error("invalid number"))?;
        number(lexeme).map(Node::Number).map_err(JsonError)
    }

    fn hex4(&mut self) -> Result<u32, JsonError> {
        let hex = self
            .s
            .get(self.at..self.at + 4)
            .ok_or_else(|| self.error("a short \\u escape"))?;
        let hex = std::str::from_utf8(hex).map_err(|_| self.error("an invalid \\u escape"))?;
        let v = u32::from_str_radix(hex, 16).map_err(|_| self.error("an invalid \\u escape"))?;
        self.at += 4;
        Ok(v)
    }

    fn string(&mut self) -> Result<Cow<'a, str>, JsonError> {
        self.at += 1;
        let mut out = String::new();
        loop {
            let start = self.at;
            let rest = self.s.get(start..).unwrap_or_default();
            self.at += rest
                .iter()
                .position(|&b| b == b'"' || b == b'\\' || b < 0x20)
                .unwrap_or(rest.len());
            // The text is UTF-8, and a run stops only at ASCII bytes.
            let run = self
                .text
                .get(start..self.at)
                .ok_or_else(|| self.error("invalid UTF-8"))?;
            match self.s.get(self.at) {
                // A string without escapes is its text.
                Some(b'"') if out.is_empty() => {
                    self.at += 1;
                    return Ok(Cow::Borrowed(run));
                }
                Some(b'"') => {
                    self.at += 1;
                    out.push_str(run);
                    return Ok(Cow::Owned(out));
                }
                Some(b'\\') => {
                    out.push_str(run);
                    self.at += 1;
                    let escaped = *self
                        .s
                        .get(self.at)
                        .ok_or_else(|| self.error("an unfinished escape"))?;
                    self.at += 1;
                    match escaped {
                        b'"' => out.push('"'),
                        b'\\' => out.push('\\'),
                        b'/' => out.push('/'),
                        b'b' => out.push('\u{8}'),
                        b'f' => out.push('\u{c}'),
                        b'n' => out.push('\n'),
                        b'r' => out.push('\r'),
                        b't' => out.push('\t'),
                        b'u' => {
                            let hi = self.hex4()?;
                            let c = if (0xD800..0xDC00).contains(&hi) {
                                if !self.eat(b"\\u") {
                                    return Err(self.error("a lone surrogate"));
                                }
                                let lo = self.hex4()?;
                                if !(0xDC00..0xE000).contains(&lo) {
                                    return Err(self.error("a lone surrogate"));
                                }
                                0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00)
                            } else {
                                hi
                            };
                            out.push(char::from_u32(c).ok_or_else(|| self.error("a lone surrogate"))?);
                        }
                        _ => return Err(self.error("an invalid escape")),
                    }
                }
                Some(_) => return Err(self.error("a control character in a string")),
                None => return Err(self.error("an unfinished string")),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A value sent is shown in a value written when every member of its
    /// objects is there, at the same place, whatever else is written.
    #[test]
    fn a_value_sent_is_shown_where_each_of_its_members_is_written() {
        let shown = |sent: &str, written: &str| {
            parse(sent.as_bytes())
                .unwrap()
                .shown_in(&parse(written.as_bytes()).unwrap())
        };
        assert!(shown(r#"{"account":"a"}"#, r#"{"account":"a","bank":null}"#));
        assert!(shown(
            r#"{"b":1,"d":[{"x":1}]}"#,
            r#"{"a":0,"b":2,"c":0,"d":[{"x":3,"y":4}]}"#
        ));
        assert!(shown(
            r#"{"\ue000":1,"\ud800\udc00":1}"#,
            r#"{"\ud800\udc00":1,"\ue000":1,"z":0}"#
        ));
        assert!(shown("1.5", "2"));
        assert!(!shown(r#"{"account":"a","number":"4242"}"#, r#"{"account":"a"}"#));
        assert!(!shown(r#"{"a":{"b":1}}"#, r#"{"a":{"c":1}}"#));
        assert!(!shown(r#"[{"b":1}]"#, r#"[{"c":1}]"#));
        assert!(!shown("[1]", "[1,2]"));
        assert!(!shown(r#"{"a":1}"#, "\"a\""));
    }

    fn canon(json: &str) -> String {
        canonical_json(json.as_bytes()).unwrap()
    }

    /// The README's bound: a first digit more than 10^15 places from the
    /// units is refused, however the number is written; at 10^15 it is not.
    #[test]
    fn a_digit_more_than_ten_to_the_fifteen_places_from_the_units_is_refused() {
        for accepted in [
            "1e-1000000000000000",
            "0.1e-999999999999999",
            "10e-1000000000000001",
        ] {
            assert!(Exact::of(accepted).is_some(), "{accepted}");
        }
        for refused in [
            "1e-1000000000000001",
            "0.1e-1000000000000000",
            "0.01e-999999999999999",
        ] {
            assert!(Exact::of(refused).is_none(), "{refused}");
        }
        assert!(Exact::of("1e1000000000000000").is_some());
        assert!(Exact::of("1e1000000000000001").is_none());
        // Zero has no first digit to be far: it is zero whatever its
        // exponent (the README says so).
        for zero in [
            "0e-9999999999999999",
            "0.0e9999999999999999",
            "-0e-9999999999999999",
        ] {
            assert_eq!(canon(zero), "0", "{zero}");
        }
    }

    #[test]
    fn numbers_follow_ecmascript_form_and_integers_stay_exact() {
        for (input, expected) in [
            ("4990", "4990"),
            ("4.99e3", "4990"),
            ("4990.0", "4990"),
            ("1.5", "1.5"),
            ("-0", "0"),
            ("-0.0", "0"),
            ("1e21", "1e+21"),
            ("1e20", "100000000000000000000"),
            ("0.000001", "0.000001"),
            ("0.0000001", "1e-7"),
            ("123.456e-10", "1.23456e-8"),
            ("9007199254740992", "9007199254740992"),
            ("9007199254740993", "9007199254740993.0"),
            ("1152921504606846976", "1152921504606846976.0"),
            ("1152921504606846976.0", "1152921504606846976.0"),
            ("1152921504606846976.00", "1152921504606846976.0"),
            ("11529215046068469760e-1", "1152921504606846976.0"),
            ("1.152921504606846976e18", "1152921504606846976.0"),
            ("1152921504606847000", "1152921504606847000"),
            ("-146880264381457820", "-146880264381457820"),
            ("-146880264381457824", "-146880264381457824.0"),
            ("1000000000000000000000", "1e+21"),
            // Held exactly by a double whose text is another value.
            (
                "170141183460469212842221372237303250944",
                "170141183460469212842221372237303250944.0",
            ),
            ("1.7014118346046921e38", "1.7014118346046921e+38"),
            (
                "170141183460469212842221372237303250944e0",
                "170141183460469212842221372237303250944.0",
            ),
            (
                "-170141183460469231731687303715884105728",
                "-170141183460469231731687303715884105728.0",
            ),
            (
                "1361129467683753853853498429727072845824",
                "1361129467683753853853498429727072845824.0",
            ),
            ("1180591620717411303424", "1180591620717411303424.0"),
            ("1.1805916207174113e21", "1.1805916207174113e+21"),
            (
                "340282366920938463463374607431768211457",
                "340282366920938463463374607431768211457.0",
            ),
            (
                "-340282366920938463463374607431768211457",
                "-340282366920938463463374607431768211457.0",
            ),
            ("-12.5", "-12.5"),
            // More digits than a double holds: the exact value, which no
            // other value's text is.
            ("1.000000000000000001", "1.000000000000000001"),
            ("1.0000000000000000010", "1.000000000000000001"),
            ("-1.0000000000000000001", "-1.0000000000000000001"),
            (
                "0.1000000000000000055511151231257827",
                "0.1000000000000000055511151231257827",
            ),
            // At most 17 significant digits: the double (RFC 8785).
            ("0.10000000000000001", "0.1"),
            ("333333333.33333329", "333333333.3333333"),
            ("9007199254740993.00", "9007199254740993.0"),
            ("0.0000001000000000000000001", "1.000000000000000001e-7"),
            ("1.0000000000000000000001e30", "1000000000000000000000100000000.0"),
            ("123456789012345678901.5", "123456789012345678901.5"),
            ("1234567890123456789012.5", "1.2345678901234567890125e+21"),
            ("1e-400", "1e-400"),
            ("-2.5e-400", "-2.5e-400"),
            ("0e-400", "0"),
            ("1.5e0000000000000000000000000001", "15"),
            ("5e-324", "5e-324"),
            ("1.7976931348623157e308", "1.7976931348623157e+308"),
        ] {
            assert_eq!(canon(input), expected, "input {input}");
            assert_eq!(
                canon(expected),
                expected,
                "the canonical text of {input} is not its own"
            );
        }
    }

    #[test]
    fn a_long_number_is_refused_without_being_echoed() {
        let long = format!("1{}e400", "0".repeat(100_000));
        let error = canonical_json(long.as_bytes()).unwrap_err().to_string();
        assert!(error.len() < 200, "{} characters", error.len());
        assert!(error.contains("100005 characters"), "{error}");
    }

    #[test]
    fn what_i_json_forbids_is_refused() {
        for bad in [
            "0.1e-9223372036854775808",
            "0.01e-9223372036854775807",
            "1e-1000000000000005",
            "1e9223372036854775807",
            r#"{"a":1,"a":2}"#,
            r#"{"a":{"b":1,"b":1}}"#,
            r#""\ud800""#,
            r#""\udc00\ud800""#,
            "1e400",
            "-1e400",
            "1e309",
            "01",
            "1.",
            "[1,]",
            "{\"a\":1}x",
            "\"a\u{1}\"",
            "nul",
        ] {
            assert!(canonical_json(bad.as_bytes()).is_err(), "{bad}");
        }
        assert!(canonical_json(&[b'"', 0xff, b'"']).is_err());
        let deep = "[".repeat(129) + &"]".repeat(129);
        assert!(canonical_json(deep.as_bytes()).is_err());
        // Past a double's range however it is spelled: digits, a point,
        // an exponent.
        let huge = "1".repeat(400);
        for spelling in [
            huge.clone(),
            format!("{huge}.0"),
            format!("{huge}e0"),
            format!("-{huge}"),
        ] {
            let error = canonical_json(spelling.as_bytes()).unwrap_err().to_string();
            assert!(error.contains("beyond the range of a double"), "{error}");
        }
        // The largest double's integer, in digits: kept.
        let largest = format!("17976931348623157{}", "0".repeat(292));
        assert_eq!(canon(&largest), "1.7976931348623157e+308");
        let near = format!("1{}", "1".repeat(307));
        assert_eq!(canon(&near), format!("{near}.0"));
        let fine = "[".repeat(128) + &"]".repeat(128);
        assert!(canonical_json(fine.as_bytes()).is_ok());
    }

    #[test]
    fn objects_are_sorted_by_utf16_code_units() {
        // By code point U+E000 comes first; by UTF-16 code unit the surrogate
        // pair of U+1F600 (0xD83D ...) does, and JCS sorts by UTF-16.
        assert_eq!(
            canon(r#"{"\ue000":1,"\ud83d\ude00":2}"#),
            "{\"😀\":2,\"\u{e000}\":1}"
        );
    }

    #[test]
    fn paths_reach_nested_members() {
        let node = parse(br#"{"recipient":{"account":"a1"},"n":[1]}"#).unwrap();
        assert_eq!(node.get("recipient.account"), Some(&Node::String("a1".into())));
        assert_eq!(node.get("recipient.name"), None);
        assert_eq!(node.get("n.0"), None);
    }

    /// Characters from each range whose UTF-8 and UTF-16 orders differ or
    /// meet: ASCII, two and three bytes below U+E000, U+E000..U+FFFF, and
    /// beyond U+FFFF.
    fn tricky_text() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let c = prop_oneof![
            Just('a'),
            Just('b'),
            Just('\u{e9}'),
            Just('\u{d7ff}'),
            Just('\u{e000}'),
            Just('\u{fffd}'),
            Just('\u{ffff}'),
            Just('\u{10000}'),
            Just('\u{1f600}'),
            any::<char>(),
        ];
        proptest::collection::vec(c, 0..5).prop_map(|cs| cs.into_iter().collect())
    }

    proptest::proptest! {
        #[test]
        fn utf16_cmp_is_the_order_of_utf16_code_units(a in tricky_text(), b in tricky_text()) {
            proptest::prop_assert_eq!(utf16_cmp(&a, &b), a.encode_utf16().cmp(b.encode_utf16()));
            let shared = format!("{a}{b}");
            proptest::prop_assert_eq!(utf16_cmp(&shared, &a), shared.encode_utf16().cmp(a.encode_utf16()));
        }
    }
}
