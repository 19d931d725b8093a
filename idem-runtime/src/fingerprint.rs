//! Request fingerprints (contract section 3): SHA-256 over a version tag, the
//! scope and the RFC 8785 canonical JSON of each declared field, all
//! length-prefixed. Changing this encoding is a breaking change; the golden
//! vectors in `tests/fingerprint_vectors.json` pin it.

use serde::Serialize;
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::fmt::Write as _;

/// The version tag that starts every fingerprint input.
pub const FINGERPRINT_VERSION: &str = "idem-fingerprint-v1";

/// A value that can take part in a fingerprint: anything `serde` can
/// serialize to JSON.
///
/// ```
/// use idem_runtime::{fingerprint, Fingerprint};
///
/// let amount = 4990_u64;
/// let fields: [(&str, &dyn Fingerprint); 1] = [("amount", &amount)];
/// assert_eq!(fingerprint("payment.create", &fields).unwrap().len(), 64);
/// ```
#[diagnostic::on_unimplemented(
    message = "the field type `{Self}` cannot be fingerprinted",
    label = "this field's type does not implement `serde::Serialize`",
    note = "fingerprinted fields must implement `serde::Serialize`; derive it, or leave the field out of `fields(...)`"
)]
pub trait Fingerprint {
    /// The value as JSON, ready for canonicalization.
    ///
    /// # Errors
    ///
    /// When `serde_json` cannot represent the value (a map with non-string
    /// keys, a failing `Serialize` impl).
    fn to_json(&self) -> Result<Value, FingerprintError>;
}

impl<T: Serialize + ?Sized> Fingerprint for T {
    fn to_json(&self) -> Result<Value, FingerprintError> {
        serde_json::to_value(self).map_err(|e| FingerprintError(e.to_string()))
    }
}

/// A field value could not be turned into JSON.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FingerprintError(pub String);

impl std::fmt::Display for FingerprintError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "cannot fingerprint the request: {}", self.0)
    }
}

impl std::error::Error for FingerprintError {}

/// Computes the fingerprint (64 lowercase hex digits) of `scope` and the
/// declared `fields`. Fields are sorted by name, so the order in which the
/// attribute lists them does not matter.
///
/// # Errors
///
/// [`FingerprintError`] when a value cannot be represented as JSON, or when a
/// field name is given twice.
///
/// ```
/// use idem_runtime::{fingerprint, Fingerprint};
///
/// let a = fingerprint("payment.create", &[("amount", &4990 as &dyn Fingerprint)]).unwrap();
/// let b = fingerprint("payment.create", &[("amount", &4991 as &dyn Fingerprint)]).unwrap();
/// assert_ne!(a, b);
/// ```
pub fn fingerprint(scope: &str, fields: &[(&str, &dyn Fingerprint)]) -> Result<String, FingerprintError> {
    let mut sorted: Vec<(&str, Value)> = Vec::with_capacity(fields.len());
    for (name, value) in fields {
        sorted.push((name, value.to_json()?));
    }
    sorted.sort_by(|a, b| a.0.cmp(b.0));
    if let Some(pair) = sorted.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(FingerprintError(format!("field `{}` is listed twice", pair[0].0)));
    }
    let mut hasher = Sha256::new();
    let mut put = |bytes: &[u8]| {
        hasher.update((bytes.len() as u64).to_be_bytes());
        hasher.update(bytes);
    };
    put(FINGERPRINT_VERSION.as_bytes());
    put(scope.as_bytes());
    for (name, value) in &sorted {
        put(name.as_bytes());
        put(canonical_json(value).as_bytes());
    }
    Ok(hex(&hasher.finalize()))
}

/// Lowercase hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// RFC 8785 (JCS) canonical JSON: object members sorted by their UTF-16 code
/// units, no whitespace, minimal string escapes, ECMAScript number form.
///
/// One deliberate difference: integers that `serde_json` holds exactly
/// (`i64`/`u64`) are written exactly, even above 2^53 where JCS would round
/// them through a double; two different large amounts never collide.
///
/// ```
/// use idem_runtime::canonical_json;
/// let v: serde_json::Value = serde_json::from_str(r#"{ "b": 4.99e3, "a": "\u00e9" }"#).unwrap();
/// assert_eq!(canonical_json(&v), r#"{"a":"é","b":4990}"#);
/// ```
pub fn canonical_json(value: &Value) -> String {
    let mut out = String::new();
    write_value(&mut out, value);
    out
}

fn write_value(out: &mut String, value: &Value) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                let _ = write!(out, "{i}");
            } else if let Some(u) = n.as_u64() {
                let _ = write!(out, "{u}");
            } else {
                write_f64(out, n.as_f64().unwrap_or(0.0));
            }
        }
        Value::String(s) => write_string(out, s),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_value(out, item);
            }
            out.push(']');
        }
        Value::Object(map) => {
            let mut members: Vec<(&String, &Value)> = map.iter().collect();
            members.sort_by(|a, b| a.0.encode_utf16().cmp(b.0.encode_utf16()));
            out.push('{');
            for (i, (k, v)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_string(out, k);
                out.push(':');
                write_value(out, v);
            }
            out.push('}');
        }
    }
}

fn write_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// ECMAScript `Number.prototype.toString` for finite doubles (RFC 8785 3.2.2.3).
fn write_f64(out: &mut String, v: f64) {
    if v == 0.0 || !v.is_finite() {
        // JSON has no NaN or infinity; serde_json never yields them.
        out.push('0');
        return;
    }
    if v < 0.0 {
        out.push('-');
    }
    // Rust's `{:e}` gives the shortest digits that round-trip: "d.ddde-N".
    let sci = format!("{:e}", v.abs());
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let k = digits.len() as i32;
    let n = exp.parse::<i32>().unwrap_or(0) + 1; // decimal point position
    if k <= n && n <= 21 {
        out.push_str(&digits);
        out.extend(std::iter::repeat_n('0', (n - k) as usize));
    } else if 0 < n && n <= 21 {
        out.push_str(&digits[..n as usize]);
        out.push('.');
        out.push_str(&digits[n as usize..]);
    } else if -6 < n && n <= 0 {
        out.push_str("0.");
        out.extend(std::iter::repeat_n('0', (-n) as usize));
        out.push_str(&digits);
    } else {
        out.push_str(&digits[..1]);
        if k > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let e = n - 1;
        let _ = write!(out, "e{}{}", if e < 0 { '-' } else { '+' }, e.abs());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn canon(json: &str) -> String {
        canonical_json(&serde_json::from_str(json).unwrap())
    }

    #[test]
    fn numbers_follow_ecmascript_form() {
        for (input, expected) in [
            ("4990", "4990"),
            ("4.99e3", "4990"),
            ("1.5", "1.5"),
            ("-0.0", "0"),
            ("1e21", "1e+21"),
            ("1e20", "100000000000000000000"),
            ("0.000001", "0.000001"),
            ("0.0000001", "1e-7"),
            ("123.456e-10", "1.23456e-8"),
            ("9007199254740993", "9007199254740993"),
            ("-12.5", "-12.5"),
            ("5e-324", "5e-324"),
            ("1.7976931348623157e308", "1.7976931348623157e+308"),
        ] {
            assert_eq!(canon(input), expected, "input {input}");
        }
    }

    #[test]
    fn objects_are_sorted_by_utf16_code_units() {
        // By code point U+E000 comes first; by UTF-16 code unit the surrogate
        // pair of U+1F600 (0xD83D ...) does, and JCS sorts by UTF-16.
        assert_eq!(
            canon(r#"{"\ue000":1,"\ud83d\ude00":2}"#),
            "{\"😀\":2,\"\u{e000}\":1}"
        );
        assert_eq!(
            canon(r#"{"b":[1,{"d":1,"c":2}],"a":null}"#),
            r#"{"a":null,"b":[1,{"c":2,"d":1}]}"#
        );
    }

    #[test]
    fn strings_use_minimal_escapes() {
        assert_eq!(canon(r#""\u0041\u00e9\/\n\u001f\"""#), "\"Aé/\\n\\u001f\\\"\"");
    }

    #[test]
    fn field_order_in_the_attribute_does_not_matter() {
        let a = fingerprint("s", &[("x", &1 as &dyn Fingerprint), ("y", &"z")]).unwrap();
        let b = fingerprint("s", &[("y", &"z" as &dyn Fingerprint), ("x", &1)]).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn a_field_listed_twice_is_an_error() {
        assert!(fingerprint("s", &[("x", &1 as &dyn Fingerprint), ("x", &1)]).is_err());
    }

    #[test]
    fn scope_and_field_names_are_length_prefixed() {
        // Without length prefixes "ab"+"c" and "a"+"bc" would collide.
        let a = fingerprint("ab", &[("c", &1 as &dyn Fingerprint)]).unwrap();
        let b = fingerprint("a", &[("bc", &1 as &dyn Fingerprint)]).unwrap();
        assert_ne!(a, b);
    }

    proptest! {
        #[test]
        fn every_finite_double_round_trips_through_its_canonical_form(v in any::<f64>().prop_filter("finite", |v| v.is_finite())) {
            let mut s = String::new();
            write_f64(&mut s, v);
            let back: f64 = s.parse().unwrap();
            prop_assert!(back == v || (v == 0.0 && back == 0.0), "{} -> {}", v, s);
        }
    }
}
