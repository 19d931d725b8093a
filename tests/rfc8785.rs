//! RFC 8785 exactly: the RFC's number samples (Appendix B), the reference
//! implementation's test data, and ECMAScript's `String(x)` on random
//! doubles. `tests/ecmascript_numbers.txt` holds 2,000 of those, made by
//! `node scripts/ecmascript-numbers.mjs 2000`; set
//! `IDEM_ECMASCRIPT_NUMBERS=<file>` to check a larger corpus (CI checks a
//! million).

use idem::fingerprint::canonical_json;

/// The canonical form of the double with IEEE 754 bits `bits`, written the
/// long way (always with an exponent, so never an exact integer).
fn canonical_double(bits: u64) -> String {
    let text = format!("{:e}", f64::from_bits(bits));
    canonical_json(text.as_bytes()).unwrap()
}

#[test]
fn the_number_samples_of_rfc_8785_appendix_b() {
    for (bits, expected) in [
        (0x0000000000000000, "0"),
        (0x8000000000000000, "0"),
        (0x0000000000000001, "5e-324"),
        (0x8000000000000001, "-5e-324"),
        (0x7fefffffffffffff, "1.7976931348623157e+308"),
        (0xffefffffffffffff, "-1.7976931348623157e+308"),
        (0x4340000000000000, "9007199254740992"),
        (0xc340000000000000, "-9007199254740992"),
        (0x4430000000000000, "295147905179352830000"),
        (0x44b52d02c7e14af5, "9.999999999999997e+22"),
        (0x44b52d02c7e14af6, "1e+23"),
        (0x44b52d02c7e14af7, "1.0000000000000001e+23"),
        (0x444b1ae4d6e2ef4e, "999999999999999700000"),
        (0x444b1ae4d6e2ef4f, "999999999999999900000"),
        (0x444b1ae4d6e2ef50, "1e+21"),
        (0x3eb0c6f7a0b5ed8c, "9.999999999999997e-7"),
        (0x3eb0c6f7a0b5ed8d, "0.000001"),
        (0x41b3de4355555553, "333333333.3333332"),
        (0x41b3de4355555554, "333333333.33333325"),
        (0x41b3de4355555555, "333333333.3333333"),
        (0x41b3de4355555556, "333333333.3333334"),
        (0x41b3de4355555557, "333333333.33333343"),
        (0xbecbf647612f3696, "-0.0000033333333333333333"),
        (0x43143ff3c1cb0959, "1424953923781206.2"),
    ] {
        assert_eq!(canonical_double(bits), expected, "{bits:016x}");
    }
    // NaN and the infinities have no JSON form: a text that parses to one
    // is refused.
    assert!(canonical_json(b"1e309").is_err());
}

/// The test data of the RFC's reference implementation
/// (cyberphone/json-canonicalization, testdata/input and testdata/output).
#[test]
fn the_reference_test_data() {
    for (name, input, output) in [
        (
            "arrays",
            "[\n  56,\n  {\n    \"d\": true,\n    \"10\": null,\n    \"1\": [ ]\n  }\n]",
            r#"[56,{"1":[],"10":null,"d":true}]"#,
        ),
        (
            "french",
            "{\n  \"peach\": \"This sorting order\",\n  \"péché\": \"is wrong according to French\",\n  \"pêche\": \"but canonicalization MUST\",\n  \"sin\":   \"ingnore locale\"\n}\n",
            r#"{"peach":"This sorting order","péché":"is wrong according to French","pêche":"but canonicalization MUST","sin":"ingnore locale"}"#,
        ),
        (
            "structures",
            "{\n  \"1\": {\"f\": {\"f\": \"hi\",\"F\": 5} ,\"\\n\": 56.0},\n  \"10\": { },\n  \"\": \"empty\",\n  \"a\": { },\n  \"111\": [ { } ],\n  \"A\": { }\n}",
            r#"{"":"empty","1":{"\n":56,"f":{"F":5,"f":"hi"}},"10":{},"111":[{}],"A":{},"a":{}}"#,
        ),
        (
            "unicode",
            "{\n  \"Unnormalized Unicode\":\"\\u1e0d\\u0307\"\n}\n",
            "{\"Unnormalized Unicode\":\"\u{1e0d}\u{307}\"}",
        ),
        (
            "values",
            "{\n  \"numbers\": [1E30, 4.50, 333333333.33333329, 2e-3, 0.000000000000000000000000001],\n  \"escaping\": \"\\u20ac$\\u000F\\u000aA'\\u0042\\u0022\\u005c\\\\\\\"\\/\",\n  \"literals\": [null, true, false]\n}",
            "{\"escaping\":\"€$\\u000f\\nA'B\\\"\\\\\\\\\\\"/\",\"literals\":[null,true,false],\"numbers\":[1e+30,4.5,333333333.3333333,0.002,1e-27]}",
        ),
        (
            "weird",
            "{\n  \"\\u20ac\": \"Euro Sign\",\n  \"1\": \"One\",\n  \"\\u0080\": \"Control\\u007f\",\n  \"\\ud83d\\ude02\": \"Smiley\",\n  \"\\u00f6\": \"Latin Small Letter O With Diaeresis\",\n  \"\\ufb33\": \"Hebrew Letter Dalet With Dagesh\",\n  \"</script>\": \"Browser Challenge\"\n}\n",
            "{\"1\":\"One\",\"</script>\":\"Browser Challenge\",\"\u{80}\":\"Control\u{7f}\",\"ö\":\"Latin Small Letter O With Diaeresis\",\"€\":\"Euro Sign\",\"😂\":\"Smiley\",\"\u{fb33}\":\"Hebrew Letter Dalet With Dagesh\"}",
        ),
    ] {
        assert_eq!(canonical_json(input.as_bytes()).unwrap(), output, "{name}");
    }
}

/// Every double of the corpus: idem's form is ECMAScript's, from the double
/// itself (correctly rounded parsing of its long form), and ECMAScript's own
/// text is its own canonical form.
#[test]
fn random_doubles_match_ecmascript() {
    let corpus = match std::env::var("IDEM_ECMASCRIPT_NUMBERS") {
        Ok(path) => std::fs::read_to_string(path).unwrap(),
        Err(_) => include_str!("ecmascript_numbers.txt").to_owned(),
    };
    let mut checked = 0;
    for line in corpus.lines() {
        let (hex, expected) = line.split_once(' ').unwrap();
        let bits = u64::from_str_radix(hex, 16).unwrap();
        assert_eq!(canonical_double(bits), expected, "{hex}");
        // ECMAScript's own text is canonical already: canonical texts are
        // fixed points, integers in digits included.
        assert_eq!(canonical_json(expected.as_bytes()).unwrap(), expected, "{hex}");
        checked += 1;
    }
    assert!(checked >= 2000);
    eprintln!("{checked} doubles match ECMAScript's String(x)");
}
