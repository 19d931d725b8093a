//! The fingerprint: golden vectors that pin the encoding (version 2), and
//! the properties of contract section 3 on requests as clients send them.

use idem::fingerprint::{fingerprint, BodyPrint, RequestPrint};
use serde_json::{json, Value};

const BASE: &str = r#"{"amount":4990,"currency":"EUR","recipient":{"account":"acct_1","name":"Zoë"}}"#;
const FIELDS: &[&str] = &["amount", "currency", "recipient"];

fn fp_of(json: &str) -> String {
    fingerprint(&RequestPrint {
        scope: "payment.create",
        path: &[],
        query: None,
        body: BodyPrint::Json {
            text: json.as_bytes(),
            fields: Some(FIELDS),
            read: None,
        },
        ignore: &[],
    })
    .unwrap()
}

#[test]
fn whitespace_key_order_number_spelling_and_escapes_never_change_it() {
    let base = fp_of(BASE);
    for same in [
        "{ \"amount\" : 4990 ,\n \"currency\":\"EUR\", \"recipient\": {\"account\":\"acct_1\",\"name\":\"Zoë\"} }",
        r#"{"recipient":{"name":"Zoë","account":"acct_1"},"currency":"EUR","amount":4990}"#,
        r#"{"amount":4.99e3,"currency":"EUR","recipient":{"account":"acct_1","name":"Zoë"}}"#,
        r#"{"amount":4990.0,"currency":"EUR","recipient":{"account":"acct_1","name":"Zoë"}}"#,
        r#"{"amount":4990,"currency":"\u0045UR","recipient":{"account":"acct_1","name":"Zo\u00eb"}}"#,
    ] {
        assert_eq!(fp_of(same), base, "{same}");
    }
}

#[test]
fn undeclared_fields_never_change_it() {
    let with_extras = r#"{"amount":4990,"currency":"EUR","recipient":{"account":"acct_1","name":"Zoë"},
        "comment":"retry from the mobile app","metadata":{"attempt":2}}"#;
    assert_eq!(fp_of(with_extras), fp_of(BASE));
}

#[test]
fn any_change_of_a_declared_field_always_changes_it() {
    let base = fp_of(BASE);
    for changed in [
        r#"{"amount":4991,"currency":"EUR","recipient":{"account":"acct_1","name":"Zoë"}}"#,
        r#"{"amount":4990,"currency":"USD","recipient":{"account":"acct_1","name":"Zoë"}}"#,
        r#"{"amount":4990,"currency":"EUR","recipient":{"account":"acct_2","name":"Zoë"}}"#,
        r#"{"amount":4990,"currency":"EUR","recipient":{"account":"acct_1","name":"Zoe"}}"#,
    ] {
        assert_ne!(fp_of(changed), base, "{changed}");
    }
}

/// One golden vector: a request, and the fingerprint it must keep.
fn vector_print(v: &Value) -> String {
    let path: Vec<(String, String)> = v["path"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p[0].as_str().unwrap().to_owned(),
                p[1].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let path: Vec<(&str, &str)> = path.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let fields: Option<Vec<&str>> = v["fields"]
        .as_array()
        .map(|f| f.iter().map(|x| x.as_str().unwrap()).collect());
    let ignore: Vec<&str> = v["ignore"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_str().unwrap())
        .collect();
    let text = v["body"].as_str().unwrap_or_default().as_bytes();
    let body = match v["body_kind"].as_str().unwrap() {
        "none" => BodyPrint::None,
        "json" => BodyPrint::Json {
            text,
            fields: fields.as_deref(),
            read: None,
        },
        "form" => BodyPrint::Form(text),
        _ => BodyPrint::Raw(text),
    };
    fingerprint(&RequestPrint {
        scope: v["scope"].as_str().unwrap(),
        path: &path,
        query: v["query"].as_str(),
        body,
        ignore: &ignore,
    })
    .unwrap()
}

/// `tests/fingerprint_vectors.json` pins the encoding: if this fails, the
/// fingerprint of stored records changed, which is a breaking change (bump
/// `FINGERPRINT_VERSION`). `IDEM_WRITE_VECTORS=1` rewrites the file.
#[test]
fn matches_the_golden_vectors() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fingerprint_vectors.json");
    let mut vectors: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    if std::env::var("IDEM_WRITE_VECTORS").as_deref() == Ok("1") {
        for v in &mut vectors {
            v["fingerprint"] = json!(vector_print(v));
        }
        std::fs::write(path, serde_json::to_string_pretty(&vectors).unwrap() + "\n").unwrap();
    }
    assert!(vectors.len() >= 10);
    for v in &vectors {
        assert_eq!(
            vector_print(v),
            v["fingerprint"].as_str().unwrap(),
            "vector {}",
            v["name"]
        );
    }
}
