//! Compile-time behaviour of `#[idempotent]`: every misuse is a pinned
//! error at the right token, and every supported handler shape compiles.
//! Regenerate the `.stderr` files with `TRYBUILD=overwrite cargo test --test ui`
//! and review the diff.

#[test]
fn ui_pass() {
    trybuild::TestCases::new().pass("tests/ui/pass/*.rs");
}

#[test]
fn ui_fail() {
    trybuild::TestCases::new().compile_fail("tests/ui/fail/*.rs");
}
