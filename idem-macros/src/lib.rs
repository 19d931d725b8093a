//! The entry point of the `#[idempotent]` attribute of idem, which
//! `expand::idempotent` expands. Use it through the `idem` crate, whose
//! documentation describes it: `idem::idempotent`.

mod args;
mod errors;
mod expand;
mod handler;

use proc_macro::TokenStream;

/// Makes an axum handler idempotent. See `idem::idempotent` for the full
/// documentation.
#[proc_macro_attribute]
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::idempotent(args.into(), item.into()).into()
}
