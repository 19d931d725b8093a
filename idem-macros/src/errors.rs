//! The errors of one expansion, gathered so that every mistake is reported at
//! once, in the order found.

use proc_macro2::Span;

/// Every error found so far, merged with `syn::Error::combine`.
#[derive(Default)]
pub(crate) struct Errors(Option<syn::Error>);

impl Errors {
    pub(crate) fn push(&mut self, err: syn::Error) {
        match &mut self.0 {
            Some(all) => all.combine(err),
            None => self.0 = Some(err),
        }
    }

    /// Stores `value` in `slot`, or reports the keyword `name` given twice
    /// at its second occurrence, `span`.
    pub(crate) fn set_once<T>(&mut self, slot: &mut Option<T>, value: T, span: Span, name: &str) {
        if slot.is_some() {
            self.push(syn::Error::new(span, format!("`{name}` is given twice")));
        } else {
            *slot = Some(value);
        }
    }

    /// The value of `result`, or `None` with its error kept.
    pub(crate) fn ok<T>(&mut self, result: syn::Result<T>) -> Option<T> {
        match result {
            Ok(value) => Some(value),
            Err(err) => {
                self.push(err);
                None
            }
        }
    }

    /// `Err` with every error found, or `Ok` if there was none.
    pub(crate) fn finish(self) -> syn::Result<()> {
        match self.0 {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }
}
