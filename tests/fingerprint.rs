//! The fingerprint: golden vectors that pin the encoding, and the
//! properties of contract section 3 on typed, deserialized bodies.

use idem::{fingerprint, Fingerprint};
use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Deserialize, Serialize)]
struct Recipient {
    account: String,
    name: String,
}

#[derive(Deserialize)]
#[allow(dead_code)]
struct Payment {
    amount: f64,
    currency: String,
    recipient: Recipient,
    comment: Option<String>,
    metadata: Option<Value>,
}

fn fp_of(json: &str) -> String {
    let p: Payment = serde_json::from_str(json).unwrap();
    fingerprint(
        "payment.create",
        &[
            ("amount", &p.amount as &dyn Fingerprint),
            ("currency", &p.currency),
            ("recipient", &p.recipient),
        ],
    )
    .unwrap()
}

const BASE: &str = r#"{"amount":4990,"currency":"EUR","recipient":{"account":"acct_1","name":"Zoë"}}"#;

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
    let base = fp_of(BASE);
    let with_extras = r#"{"amount":4990,"currency":"EUR","recipient":{"account":"acct_1","name":"Zoë"},
        "comment":"retry from the mobile app","metadata":{"attempt":2}}"#;
    assert_eq!(fp_of(with_extras), base);
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

#[test]
fn the_scope_is_part_of_it() {
    let a = fingerprint("payment.create", &[("amount", &1 as &dyn Fingerprint)]).unwrap();
    let b = fingerprint("refund.create", &[("amount", &1 as &dyn Fingerprint)]).unwrap();
    assert_ne!(a, b);
}

/// `tests/fingerprint_vectors.json` pins the encoding: if this fails, the
/// fingerprint of stored records changed, which is a breaking change.
#[test]
fn matches_the_golden_vectors() {
    let vectors: Vec<Value> = serde_json::from_str(include_str!("fingerprint_vectors.json")).unwrap();
    assert!(vectors.len() >= 8);
    for v in vectors {
        let scope = v["scope"].as_str().unwrap();
        let fields: Vec<(String, Value)> = v["fields"]
            .as_array()
            .unwrap()
            .iter()
            .map(|pair| (pair[0].as_str().unwrap().to_owned(), pair[1].clone()))
            .collect();
        let refs: Vec<(&str, &dyn Fingerprint)> = fields
            .iter()
            .map(|(n, v)| (n.as_str(), v as &dyn Fingerprint))
            .collect();
        assert_eq!(
            fingerprint(scope, &refs).unwrap(),
            v["fingerprint"].as_str().unwrap(),
            "vector {}",
            v["name"]
        );
        if let Some(canonical) = v.get("canonical") {
            assert_eq!(idem::canonical_json(&fields[0].1), canonical.as_str().unwrap());
        }
    }
}
