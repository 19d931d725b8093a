//! Property tests of what parses untrusted input: the key grammar, the
//! canonical JSON encoder, the duration grammar, and the problem bodies.
//! `PROPTEST_CASES` sets the number of cases (256 by default); the script
//! `scripts/fuzz.sh` runs them for a fixed time with many more.

use axum::response::IntoResponse as _;
use idem::fingerprint::canonical_json;
use idem::key::{IdempotencyKey, KeyError};
use idem::{parse_duration, Problem};
use proptest::prelude::*;
use serde_json::Value;

/// The key grammar, written again from the README: a bare token of 1 to 255
/// visible ASCII characters without `,`, `"` or `\`, or the same token as an
/// RFC 8941 string.
fn key_oracle(raw: &[u8]) -> Option<String> {
    let content: Vec<u8> = if raw.first() == Some(&b'"') {
        let inner = raw.strip_prefix(b"\"")?.strip_suffix(b"\"")?;
        let mut out = Vec::new();
        let mut it = inner.iter();
        while let Some(&c) = it.next() {
            match c {
                b'\\' => match it.next() {
                    Some(&e @ (b'"' | b'\\')) => out.push(e),
                    _ => return None,
                },
                b'"' => return None,
                0x20..=0x7e => out.push(c),
                _ => return None,
            }
        }
        out
    } else {
        raw.to_vec()
    };
    let ok = !content.is_empty()
        && content.len() <= 255
        && content
            .iter()
            .all(|&b| (0x21..=0x7e).contains(&b) && !matches!(b, b',' | b'"' | b'\\'));
    ok.then(|| String::from_utf8(content).unwrap())
}

/// Header values near the grammar's edges: mostly visible ASCII, with
/// quotes, backslashes, commas, spaces and any byte mixed in.
fn key_bytes() -> impl Strategy<Value = Vec<u8>> {
    let byte = prop_oneof![
        8 => 0x21u8..=0x7e,
        1 => Just(b'"'),
        1 => Just(b'\\'),
        1 => Just(b','),
        1 => Just(b' '),
        1 => any::<u8>(),
    ];
    (proptest::collection::vec(byte, 0..300), any::<bool>()).prop_map(|(mut v, quote)| {
        if quote {
            v.insert(0, b'"');
            v.push(b'"');
        }
        v
    })
}

/// Any JSON value whose numbers a double holds exactly.
fn json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        (-(1i64 << 53)..(1i64 << 53)).prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        "\\PC{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 64, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::btree_map("\\PC{0,8}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// The same value written another way: members in reverse order, spaces
/// and newlines between tokens, every non-ASCII character escaped, and
/// whole numbers as `n.0`.
fn rewrite(v: &Value, out: &mut String) {
    match v {
        Value::Null | Value::Bool(_) => out.push_str(&v.to_string()),
        Value::Number(n) => match n.as_i64() {
            Some(i) => out.push_str(&format!("{i}.0")),
            None => out.push_str(&format!("{:e}", n.as_f64().unwrap())),
        },
        Value::String(s) => escaped(s, out),
        Value::Array(items) => {
            out.push_str("[ ");
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(" ,\n");
                }
                rewrite(item, out);
            }
            out.push_str(" ]");
        }
        Value::Object(members) => {
            out.push_str("{\t");
            for (i, (k, item)) in members.iter().rev().enumerate() {
                if i > 0 {
                    out.push_str(",\r\n ");
                }
                escaped(k, out);
                out.push_str(" : ");
                rewrite(item, out);
            }
            out.push('}');
        }
    }
}

fn escaped(s: &str, out: &mut String) {
    out.push('"');
    for unit in s.encode_utf16() {
        match unit {
            0x22 => out.push_str("\\\""),
            0x5c => out.push_str("\\\\"),
            0x20..=0x7e => out.push(char::from(unit as u8)),
            _ => out.push_str(&format!("\\u{unit:04x}")),
        }
    }
    out.push('"');
}

/// The duration grammar, written again: digits, then one unit, positive,
/// within `u64` milliseconds.
fn duration_oracle(text: &str) -> Option<u64> {
    let split = text.find(|c: char| !c.is_ascii_digit())?;
    let (digits, unit) = text.split_at(split);
    let factor = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return None,
    };
    let n: u64 = digits.parse().ok()?;
    n.checked_mul(factor).filter(|&ms| ms > 0)
}

/// Equal as JSON values, any number equal to any number.
fn same_shape(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(_), Value::Number(_)) => true,
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same_shape(x, y))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same_shape(v, w)))
        }
        _ => a == b,
    }
}

fn problem_body(p: Problem) -> Value {
    let response = p.into_response();
    let bytes = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(axum::body::to_bytes(response.into_body(), usize::MAX))
        .unwrap();
    serde_json::from_slice(&bytes).expect("a problem body is JSON")
}

proptest! {
    #[test]
    fn the_key_parser_accepts_exactly_the_grammar(raw in key_bytes()) {
        let parsed = IdempotencyKey::parse(&raw).ok().map(|k| k.as_str().to_owned());
        prop_assert_eq!(parsed, key_oracle(&raw));
    }

    #[test]
    fn a_refused_key_says_why(raw in key_bytes()) {
        if let Err(e) = IdempotencyKey::parse(&raw) {
            prop_assert!(e != KeyError::Missing && e != KeyError::Repeated);
            prop_assert!(!e.to_string().is_empty());
        }
    }

    #[test]
    fn canonical_json_is_idempotent(v in json()) {
        let once = canonical_json(v.to_string().as_bytes()).unwrap();
        prop_assert_eq!(canonical_json(once.as_bytes()).unwrap(), once.clone());
        // The same members and items (numbers are compared by the
        // equal-values property below: serde_json's parser may round a
        // double's last digit differently).
        let back: Value = serde_json::from_str(&once).unwrap();
        prop_assert!(same_shape(&back, &v), "{} is not {}", back, v);
    }

    #[test]
    fn equal_values_written_differently_are_one_canonical_text(v in json()) {
        let mut other = String::new();
        rewrite(&v, &mut other);
        prop_assert_eq!(
            canonical_json(other.as_bytes()).unwrap(),
            canonical_json(v.to_string().as_bytes()).unwrap(),
            "{}", other
        );
    }

    #[test]
    fn the_canonical_encoder_never_panics(raw in proptest::collection::vec(any::<u8>(), 0..400)) {
        let _ = canonical_json(&raw);
    }

    #[test]
    fn the_duration_parser_accepts_exactly_the_grammar(
        text in prop_oneof![
            "[0-9]{0,22}(ms|s|m|h|d|)",
            "[0-9]{1,3}[a-z ]{0,3}",
            "\\PC{0,8}",
        ]
    ) {
        let parsed = parse_duration(&text).ok().map(|d| d.as_millis() as u64);
        prop_assert_eq!(parsed, duration_oracle(&text), "{:?}", text);
    }

    #[test]
    fn problem_bodies_are_json_whatever_their_detail(why in "\\PC{0,200}", bytes in proptest::collection::vec(any::<u8>(), 0..50)) {
        let body = problem_body(Problem::BodyInvalid(why.clone()));
        prop_assert_eq!(body["status"].as_u64(), Some(400));
        prop_assert!(body["detail"].as_str().unwrap().starts_with(&why));
        let lossy = String::from_utf8_lossy(&bytes).into_owned();
        let r = idem::problem(axum::http::StatusCode::BAD_REQUEST, &lossy, &lossy, &lossy);
        let bytes = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(axum::body::to_bytes(r.into_body(), usize::MAX))
            .unwrap();
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        prop_assert_eq!(v["title"].as_str(), Some(lossy.as_str()));
    }
}

#[test]
fn every_problem_body_is_json_with_its_status() {
    for p in Problem::catalog() {
        let status = p.status().as_u16();
        let body = problem_body(p);
        assert_eq!(body["status"].as_u64(), Some(u64::from(status)));
        assert!(body["type"]
            .as_str()
            .unwrap()
            .starts_with(idem::PROBLEM_TYPE_PREFIX));
    }
}

#[test]
fn nesting_a_hundred_thousand_deep_is_refused_without_overflowing_the_stack() {
    for open in ["[", "{\"a\":"] {
        let deep = open.repeat(100_000);
        assert!(canonical_json(deep.as_bytes()).is_err());
    }
}

/// Canonical numbers against an oracle written apart from `jcs.rs`: a
/// number's exact value as normalized digits, and ECMAScript's layout of
/// the shortest digits Rust writes for a double.
mod numbers {
    use super::*;

    /// `0.digits × 10^point`, digits without leading or trailing zeros
    /// (none for zero, which has no sign).
    #[derive(Debug, Clone, PartialEq, Eq)]
    struct Dec {
        neg: bool,
        digits: String,
        point: i128,
    }

    fn dec_of(lexeme: &str) -> Dec {
        let (neg, rest) = match lexeme.strip_prefix('-') {
            Some(r) => (true, r),
            None => (false, lexeme),
        };
        let (mant, exp) = match rest.find(['e', 'E']) {
            Some(i) => (&rest[..i], rest[i + 1..].parse::<i128>().unwrap()),
            None => (rest, 0),
        };
        let (w, f) = mant.split_once('.').unwrap_or((mant, ""));
        let all = format!("{w}{f}");
        let lead = all.len() - all.trim_start_matches('0').len();
        let digits = all.trim_start_matches('0').trim_end_matches('0').to_owned();
        if digits.is_empty() {
            return Dec {
                neg: false,
                digits,
                point: 0,
            };
        }
        let point = i128::try_from(w.len()).unwrap() - i128::try_from(lead).unwrap() + exp;
        Dec { neg, digits, point }
    }

    impl Dec {
        /// A JSON spelling: the digits with `tz` trailing zeros, the point
        /// after `p` of them, and an exponent where needed (or `force_e`).
        fn spell(&self, tz: usize, p: usize, force_e: bool) -> String {
            if self.digits.is_empty() {
                return "0".into();
            }
            let full = format!("{}{}", self.digits, "0".repeat(tz));
            let p = p.clamp(1, full.len());
            let e = self.point - i128::try_from(p).unwrap();
            let mut s = String::new();
            if self.neg {
                s.push('-');
            }
            s.push_str(&full[..p]);
            if p < full.len() {
                s.push('.');
                s.push_str(&full[p..]);
            }
            if e != 0 || force_e {
                s.push_str(&format!("e{e}"));
            }
            s
        }
    }

    /// A value: 1 to 25 digits with a point near a double's interesting
    /// ranges, or a random double's shortest text or exact value.
    fn a_value() -> impl Strategy<Value = Dec> {
        let digits = proptest::collection::vec(0u8..10, 1..26)
            .prop_map(|v| v.into_iter().map(|d| char::from(b'0' + d)).collect::<String>());
        let point = prop_oneof![-8i128..25, -330i128..-300, 300i128..310, 15i128..40];
        let made = (any::<bool>(), digits, point).prop_map(|(neg, digits, point)| {
            dec_of(&format!("{}0.{digits}e{point}", if neg { "-" } else { "" }))
        });
        let from_double = (any::<u64>(), any::<bool>()).prop_filter_map("finite", |(bits, shortest)| {
            let v = f64::from_bits(bits);
            v.is_finite().then(|| {
                dec_of(&if shortest {
                    format!("{v:e}")
                } else {
                    format!("{v:.1100e}")
                })
            })
        });
        prop_oneof![3 => made, 2 => from_double]
    }

    fn in_range(s: &str) -> bool {
        s.parse::<f64>().is_ok_and(f64::is_finite)
    }

    fn canon(s: &str) -> String {
        canonical_json(s.as_bytes()).unwrap()
    }

    proptest! {
        /// Every canonical text is its own, and keeps the number's exact
        /// value when it has more than 17 significant digits.
        #[test]
        fn a_canonical_number_is_its_own_and_keeps_a_precise_value(
            (d, tz, p, e) in (a_value(), 0usize..4, 0usize..30, any::<bool>())
        ) {
            let lexeme = d.spell(tz, p, e);
            prop_assume!(in_range(&lexeme));
            let c = canon(&lexeme);
            prop_assert_eq!(canon(&c), c.clone(), "{} -> {}", lexeme, c);
            if d.digits.len() > 17 {
                prop_assert_eq!(dec_of(c.strip_suffix(".0").unwrap_or(&c)), d, "{} -> {}", lexeme, c);
            }
        }

        /// Two different values share a text only when both have at most
        /// 17 significant digits and one double.
        #[test]
        fn two_values_share_a_text_only_as_one_double(
            (x, p, e1, e2) in (a_value(), 0usize..3, any::<bool>(), any::<bool>())
        ) {
            let fx = x.spell(0, p.min(x.digits.len()), e2);
            let v: f64 = fx.parse().unwrap_or(0.0);
            // (Not a rejection: most values are their own double's text.)
            if !(v.is_finite() && v != 0.0) {
                return Ok(());
            }
            // A value near it: its double's shortest text, or exact value.
            let y = dec_of(&if e1 { format!("{v:e}") } else { format!("{v:.1100e}") });
            let fy = y.spell(0, p, !e2);
            if x == y || !in_range(&fy) {
                return Ok(());
            }
            let (cx, cy) = (canon(&fx), canon(&fy));
            if cx == cy {
                let one_double = fy.parse::<f64>().unwrap() == v;
                prop_assert!(
                    x.digits.len() <= 17 && y.digits.len() <= 17 && one_double,
                    "{} and {} (two values) share {}", fx, fy, cx
                );
            }
        }

        /// A double written the long way (Rust's shortest digits, an
        /// exponent) is a text of that same double with at most 17
        /// significant digits (tests/rfc8785.rs checks it is ECMAScript's
        /// own against a million of node's).
        #[test]
        fn a_double_is_a_text_of_that_double(bits in any::<u64>()) {
            let v = f64::from_bits(bits);
            prop_assume!(v.is_finite());
            let lexeme = format!("{v:e}");
            let c = canon(&lexeme);
            prop_assert_eq!(c.parse::<f64>().ok(), Some(if v == 0.0 { 0.0 } else { v }), "{} -> {}", lexeme, c);
            prop_assert!(dec_of(&c).digits.len() <= 17, "{} -> {}", lexeme, c);
        }
    }
}
