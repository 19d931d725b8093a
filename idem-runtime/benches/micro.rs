//! Micro-benchmarks of what every request pays before the store is asked:
//! parsing the idempotency key and fingerprinting the request.
//!
//! `cargo bench -p idem-runtime --bench micro -- --warm-up-time 1 --measurement-time 3`

use criterion::Criterion;
use idem_runtime::__private::FieldJson;
use idem_runtime::fingerprint::{canonical_json, fingerprint, BodyPrint, RequestPrint};
use idem_runtime::key::IdempotencyKey;
use sha2::{Digest, Sha256};
use std::hint::black_box;

/// A key as clients usually send it: a UUID.
const UUID_KEY: &[u8] = b"5f0c8a9e-3b1d-4c7a-9e2f-1a2b3c4d5e6f";

/// A small payment body: three declared fields and two the fingerprint
/// leaves out.
const SMALL_BODY: &[u8] = br#"{"amount": 4990, "currency": "EUR", "recipient": "acct_9f8e7d6c", "note": "rent for march", "reference": "inv-2024-03"}"#;
const SMALL_FIELDS: &[&str] = &["amount", "currency", "recipient"];

/// The route's path parameter, as `fingerprint_request` passes it.
const PATH: &[(&str, &str)] = &[("account", "acct_1a2b3c4d")];

/// One value of a body member, typed as the handler reads it.
enum Typed {
    Int(i64),
    Text(String),
}

impl Typed {
    /// The JSON the `#[idempotent]` expansion reads for a declared field
    /// (its probe: `serde_json` of the typed value, on the stack when short).
    fn read(&self) -> FieldJson {
        use idem_runtime::__private::{reading::ViaDeserialize as _, FieldProbe};
        match self {
            Typed::Int(n) => (&&&FieldProbe(n)).__idem_json(),
            Typed::Text(s) => (&&&FieldProbe(s)).__idem_json(),
        }
    }
}

/// A 50-member body (`f00` to `f49`, numbers and short strings
/// alternating), its member names, and its members typed.
fn wide_body() -> (Vec<u8>, Vec<String>, Vec<Typed>) {
    let mut text = String::from("{");
    let (mut names, mut typed) = (Vec::new(), Vec::new());
    for i in 0..50i64 {
        let name = format!("f{i:02}");
        if i > 0 {
            text.push_str(", ");
        }
        if i % 2 == 0 {
            text.push_str(&format!("\"{name}\": {}", 1000 + i * 37));
            typed.push(Typed::Int(1000 + i * 37));
        } else {
            text.push_str(&format!("\"{name}\": \"value-{i}\""));
            typed.push(Typed::Text(format!("value-{i}")));
        }
        names.push(name);
    }
    text.push('}');
    (text.into_bytes(), names, typed)
}

/// The fingerprint as a request pays it: the expansion serializes each
/// declared field to JSON (`read`), then `fingerprint_request` collects the
/// path parameters and fingerprints the request with them.
fn request_fingerprint(scope: &str, text: &[u8], fields: Option<&[&str]>, typed: &[Typed]) -> String {
    // The expansion keeps both on the stack.
    let json: Vec<FieldJson> = typed.iter().map(Typed::read).collect();
    let read: Vec<Option<&[u8]>> = json.iter().map(FieldJson::bytes).collect();
    let path: Vec<(&str, &str)> = PATH.to_vec();
    fingerprint(&RequestPrint {
        scope,
        path: &path,
        query: None,
        body: BodyPrint::Json {
            text,
            fields,
            read: Some(&read),
        },
        ignore: &[],
    })
    .unwrap_or_default()
}

/// Key parsing: a bare UUID key, the same key as an RFC 8941 quoted string,
/// and the header's values as a request carries them (one value).
fn key_parsing(c: &mut Criterion) {
    let mut g = c.benchmark_group("key");
    g.bench_function("parse uuid", |b| {
        b.iter(|| IdempotencyKey::parse(black_box(UUID_KEY)))
    });
    let quoted = [b"\"", UUID_KEY, b"\""].concat();
    g.bench_function("parse quoted uuid", |b| {
        b.iter(|| IdempotencyKey::parse(black_box(&quoted)))
    });
    g.bench_function("from_header_values uuid", |b| {
        b.iter(|| IdempotencyKey::from_header_values([black_box(UUID_KEY)]))
    });
    g.finish();
}

/// The whole fingerprint of a request (parse, field checks, canonical JSON,
/// SHA-256, hex) with `fields(amount, currency, recipient)` on a small body:
/// as a request pays it (with the typed fields' JSON to check against), and
/// without that check (`read: None`, as the public API's callers may).
fn fingerprint_three_fields(c: &mut Criterion) {
    let typed = [
        Typed::Int(4990),
        Typed::Text("EUR".into()),
        Typed::Text("acct_9f8e7d6c".into()),
    ];
    let mut g = c.benchmark_group("fingerprint");
    g.bench_function("3 fields, as a request", |b| {
        b.iter(|| {
            request_fingerprint(
                "payment.create",
                black_box(SMALL_BODY),
                Some(SMALL_FIELDS),
                &typed,
            )
        })
    });
    g.bench_function("3 fields, read: None", |b| {
        b.iter(|| {
            fingerprint(&RequestPrint {
                scope: "payment.create",
                path: PATH,
                query: None,
                body: BodyPrint::Json {
                    text: black_box(SMALL_BODY),
                    fields: Some(SMALL_FIELDS),
                    read: None,
                },
                ignore: &[],
            })
        })
    });
    g.finish();
}

/// The whole fingerprint of a request with a 50-member JSON body: every
/// member declared in `fields(...)` (as a request pays it, with each typed
/// field's JSON), and the whole body without `fields(...)`.
fn fingerprint_fifty_fields(c: &mut Criterion) {
    let (text, names, typed) = wide_body();
    let fields: Vec<&str> = names.iter().map(String::as_str).collect();
    let mut g = c.benchmark_group("fingerprint");
    g.bench_function("50 fields, as a request", |b| {
        b.iter(|| request_fingerprint("bulk.update", black_box(&text), Some(&fields), &typed))
    });
    g.bench_function("50-member whole body, as a request", |b| {
        b.iter(|| request_fingerprint("bulk.update", black_box(&text), None, &[]))
    });
    g.finish();
}

/// The pieces of the 3-field fingerprint, to see where its time goes:
/// serializing the typed fields, canonical JSON of the small body (parse and
/// write), and SHA-256 of an input about the size of the fingerprint's.
fn fingerprint_pieces(c: &mut Criterion) {
    let typed = [
        Typed::Int(4990),
        Typed::Text("EUR".into()),
        Typed::Text("acct_9f8e7d6c".into()),
    ];
    let mut g = c.benchmark_group("pieces");
    g.bench_function("serialize 3 typed fields", |b| {
        b.iter(|| black_box(&typed).iter().map(Typed::read).collect::<Vec<_>>())
    });
    g.bench_function("canonical_json small body", |b| {
        b.iter(|| canonical_json(black_box(SMALL_BODY)))
    });
    let input = vec![0x5au8; 200];
    g.bench_function("sha256 200 bytes", |b| {
        b.iter(|| Sha256::digest(black_box(&input)))
    });
    g.finish();
}

/// What `criterion_group!` and `criterion_main!` would write, but without
/// their undocumented public function.
fn main() {
    let mut c = Criterion::default().configure_from_args();
    key_parsing(&mut c);
    fingerprint_three_fields(&mut c);
    fingerprint_fifty_fields(&mut c);
    fingerprint_pieces(&mut c);
    c.final_summary();
}
