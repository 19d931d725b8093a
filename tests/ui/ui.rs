//! Compile-time behaviour of `#[idempotent]`: every misuse is a pinned
//! error at the right token, and every supported handler shape compiles.
//! Regenerate the `.stderr` files with
//! `TRYBUILD=overwrite cargo test -p idem-ui-tests` and review the diff.

#[test]
fn ui_pass() {
    trybuild::TestCases::new().pass("pass/*.rs");
}

#[test]
fn ui_fail() {
    trybuild::TestCases::new().compile_fail("fail/*.rs");
}
