//! Parses the arguments of `#[idempotent(...)]` and checks each on its own:
//! the values and keywords the expansion reads, and every mistake found.

use crate::errors::Errors;
use proc_macro2::Span;
use syn::ext::IdentExt as _;
use syn::parse::{Parse, ParseStream};
use syn::punctuated::Punctuated;
use syn::spanned::Spanned as _;
use syn::{Ident, LitStr, Token};

pub(crate) mod kw {
    syn::custom_keyword!(scope);
    syn::custom_keyword!(fields);
    syn::custom_keyword!(header);
    syn::custom_keyword!(optional);
    syn::custom_keyword!(ttl);
    syn::custom_keyword!(lock_timeout);
    syn::custom_keyword!(wait);
    syn::custom_keyword!(ignore);
    syn::custom_keyword!(body);
}

/// A field path of the body: `amount` or `recipient.account`, with the
/// wire path the client sends it under when it differs
/// (`recipient.account = "recipient.acct"`).
pub(crate) struct FieldPath {
    pub(crate) segments: Punctuated<Ident, Token![.]>,
    pub(crate) wire: Option<LitStr>,
}

impl FieldPath {
    pub(crate) fn name(&self) -> String {
        self.segments
            .iter()
            .map(|s| s.unraw().to_string())
            .collect::<Vec<_>>()
            .join(".")
    }

    /// The dotted path of JSON member names that the fingerprint reads.
    pub(crate) fn wire(&self) -> String {
        self.wire.as_ref().map_or_else(|| self.name(), LitStr::value)
    }

    /// The span of the whole path, for errors about it.
    pub(crate) fn span(&self) -> Span {
        let first = self.segments.first().map(Ident::span);
        let last = self.segments.last().map(Ident::span);
        match (first, last) {
            (Some(a), Some(b)) => a.join(b).unwrap_or(a),
            _ => Span::call_site(),
        }
    }
}

impl Parse for FieldPath {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let segment = |input: ParseStream<'_>| {
            // `items.0` (and `pair.0.1`, whose `0.1` is one float token).
            if input.peek(syn::LitInt) || input.peek(syn::LitFloat) {
                let index: syn::Lit = input.parse()?;
                return Err(syn::Error::new(
                    index.span(),
                    "a field path is field names, such as `recipient.acct`: a number (a tuple \
                     field's index) names nothing the body's JSON carries",
                ));
            }
            if input.peek(LitStr) {
                return Err(input.error(
                    "`fields` names a field as written in Rust, such as `fields(amount)`, not as a \
                     string; a field sent under another JSON name is written `amount = \"amt\"`",
                ));
            }
            Ident::parse_any(input)
        };
        let segments = Punctuated::parse_separated_nonempty_with(input, segment)?;
        if input.peek(Token![::]) {
            return Err(input.error("a nested field is written with `.`, such as `recipient.account`"));
        }
        if input.peek(syn::token::Paren) {
            // `amount()`: what rustc's help suggests when `amount` is a
            // method of the body's type (or its field is private).
            let call: proc_macro2::TokenTree = input.parse()?;
            return Err(syn::Error::new(
                call.span(),
                "`fields` names fields of the body's type as its JSON carries them, not methods: \
                 name the field itself (visible where the handler is), such as `fields(amount)`; \
                 a field sent under another JSON name is written `amount = \"amt\"`",
            ));
        }
        let wire = if input.peek(Token![=]) {
            input.parse::<Token![=]>()?;
            Some(unsuffixed(input.parse()?)?)
        } else {
            None
        };
        Ok(FieldPath { segments, wire })
    }
}

/// A duration literal such as `"30s"`, checked at compile time.
pub(crate) struct DurationLit {
    pub(crate) millis: u64,
}

impl DurationLit {
    fn parse_lit(lit: &LitStr) -> syn::Result<Self> {
        let text = lit.value();
        let bad = || {
            syn::Error::new(
                lit.span(),
                format!(
                    "invalid duration `{text}`: use a positive whole number followed by `ms`, `s`, `m`, `h` or `d`, such as `\"30s\"`"
                ),
            )
        };
        let digits_end = text.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
        let (number, unit) = text.split_at(digits_end);
        let number: u64 = number.parse().map_err(|_| bad())?;
        let factor = match unit {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            _ => return Err(bad()),
        };
        match number.checked_mul(factor) {
            Some(millis) if millis > 0 => Ok(DurationLit { millis }),
            _ => Err(bad()),
        }
    }
}

/// Everything `#[idempotent(...)]` accepts. Each keyword token is kept next
/// to its value so that errors can point at it.
#[derive(Default)]
pub(crate) struct IdempotentArgs {
    pub(crate) scope: Option<(kw::scope, LitStr)>,
    pub(crate) fields: Option<(kw::fields, Vec<FieldPath>)>,
    pub(crate) header: Option<(kw::header, LitStr)>,
    pub(crate) optional: Option<kw::optional>,
    pub(crate) ttl: Option<(kw::ttl, DurationLit)>,
    pub(crate) lock_timeout: Option<(kw::lock_timeout, DurationLit)>,
    pub(crate) wait: Option<(kw::wait, DurationLit)>,
    /// Path parameters and query names that do not count.
    pub(crate) ignore: Option<(kw::ignore, Vec<LitStr>)>,
    /// `body = "none"`: the last parameter reads no body.
    pub(crate) no_body: Option<kw::body>,
    pub(crate) krate: Option<(Token![crate], syn::Path)>,
    /// Semantic errors found while parsing; parsing goes on after them.
    pub(crate) errors: Errors,
}

/// `= "..."`: the string value of the argument `name`; anything else
/// (`ttl = 30`, `body = none`) is refused at the value with `example`.
fn value(input: ParseStream<'_>, name: &str, example: &str) -> syn::Result<LitStr> {
    input.parse::<Token![=]>()?;
    if input.peek(LitStr) {
        return unsuffixed(input.parse()?);
    }
    let span = match input.parse::<syn::Expr>() {
        Ok(expr) => expr.span(),
        Err(_) => input.span(),
    };
    Err(syn::Error::new(
        span,
        format!("`{name}` takes a string, such as `{name} = {example}`"),
    ))
}

/// `lit`, refused where it carries a suffix (`"5s"ms`): rustc refuses one
/// on a string literal everywhere else, and its value would drop it.
fn unsuffixed(lit: LitStr) -> syn::Result<LitStr> {
    if lit.suffix().is_empty() {
        return Ok(lit);
    }
    Err(syn::Error::new(
        lit.span(),
        format!(
            "a string here takes no suffix: remove `{}` after the closing quote",
            lit.suffix()
        ),
    ))
}

/// A flag written with a value (`optional = true`): `message` at the `=`,
/// and the value skipped, so that parsing goes on.
fn no_value(input: ParseStream<'_>, errors: &mut Errors, message: &str) -> syn::Result<()> {
    if input.peek(Token![=]) {
        let eq: Token![=] = input.parse()?;
        input.parse::<syn::Expr>()?;
        errors.push(syn::Error::new(eq.span, message));
    }
    Ok(())
}

/// A list written as a value (`fields = "amount"`): `message` at the `=`.
fn list_not_value(input: ParseStream<'_>, message: &str) -> syn::Result<()> {
    match input.parse::<Option<Token![=]>>()? {
        Some(eq) => Err(syn::Error::new(eq.span, message)),
        None => Ok(()),
    }
}

/// The durations each argument allows, in milliseconds, and how the
/// message writes them: the runtime's `TTL_RANGE` and `LOCK_TIMEOUT_RANGE`
/// (tests/settings.rs and tests/ui pin the same words for both).
pub(crate) const TTL_MS: (u64, u64, &str) = (1_000, 365 * 86_400_000, "1s to 365d");
pub(crate) const LOCK_TIMEOUT_MS: (u64, u64, &str) = (100, 86_400_000, "100ms to 1d");
pub(crate) const WAIT_MS: (u64, u64, &str) = (1, 3_600_000, "1ms to 1h");

fn duration(
    input: ParseStream<'_>,
    errors: &mut Errors,
    name: &str,
    (min, max, allowed): (u64, u64, &str),
) -> syn::Result<Option<DurationLit>> {
    let example = match name {
        "ttl" => "\"24h\"",
        "lock_timeout" => "\"30s\"",
        _ => "\"2s\"",
    };
    let lit: LitStr = value(input, name, example)?;
    match DurationLit::parse_lit(&lit) {
        Ok(d) if (min..=max).contains(&d.millis) => Ok(Some(d)),
        Ok(_) => {
            errors.push(syn::Error::new(
                lit.span(),
                format!("`{name}` is out of range: allowed {allowed}"),
            ));
            Ok(None)
        }
        Err(e) => {
            errors.push(e);
            Ok(None)
        }
    }
}

/// The longest scope, in bytes: with the longest tenant and key (255
/// each), a record's id stays within what PostgreSQL's primary-key index
/// holds (2,704 bytes a row).
const MAX_SCOPE_LEN: usize = 255;

fn valid_scope(scope: &str) -> bool {
    !scope.is_empty()
        && scope.len() <= MAX_SCOPE_LEN
        && scope.split('.').all(|part| {
            let mut chars = part.chars();
            matches!(chars.next(), Some('a'..='z')) && chars.all(|c| matches!(c, 'a'..='z' | '0'..='9' | '_'))
        })
}

/// Headers whose values are credentials: never a record's key (the key is
/// stored, and the contract stores no credential).
const CREDENTIAL_HEADERS: &[&str] = &[
    "api-key",
    "apikey",
    "authorization",
    "cookie",
    "ocp-apim-subscription-key",
    "private-token",
    "proxy-authorization",
    "set-cookie",
    "x-amz-security-token",
    "x-apikey",
    "x-consul-token",
    "x-auth-key",
    "x-csrftoken",
    "x-functions-key",
    "x-rapidapi-key",
    "x-vault-token",
    "x-xsrftoken",
];

/// Endings of credential headers' names (`X-API-Key`, `X-Auth-Token`, ...),
/// each also a name of its own without its first dash (`Auth-Token`).
const CREDENTIAL_HEADER_SUFFIXES: &[&str] = &[
    "-access-token",
    "-api-key",
    "-api-token",
    "-auth-token",
    "-authorization",
    "-csrf-token",
    "-id-token",
    "-refresh-token",
    "-security-token",
    "-session-token",
    "-xsrf-token",
];

/// Headers that carry a hash of the body: one value for every request with
/// one body, so two operations with the same body (the same coffee bought
/// twice) would share one record.
const BODY_HASH_HEADERS: &[&str] = &[
    "content-md5",
    "digest",
    "want-digest",
    "x-amz-content-sha256",
    "x-goog-hash",
    "x-hub-signature",
    "x-hub-signature-256",
    "x-shopify-hmac-sha256",
];

/// Beginnings of the names of headers that describe the message, its
/// connection or its client, refused as the headers of
/// [`MESSAGE_HEADERS`] are: every `Content-*` header describes the body,
/// every `Sec-*` one is set by the browser (client hints, fetch metadata,
/// privacy flags), `Accept-*`, `If-*` and `Access-Control-*` describe what
/// the client wants, the rest are set by proxies and CDNs. (Not `X-Amz-*`:
/// AWS sends idempotency tokens under it, such as `X-Amz-Client-Token`.)
const MESSAGE_HEADER_PREFIXES: &[&str] = &[
    "accept-",
    "access-control-",
    "cloudfront-viewer-",
    "content-",
    "if-",
    "ot-tracer-",
    "sec-",
    "x-b3-",
    "x-datadog-",
    "x-envoy-",
    "x-forwarded-",
];

/// Headers that describe the message, its connection or its client, which
/// many requests carry with one value: never a key (different operations
/// would share one record, and one be answered the other's replay).
const MESSAGE_HEADERS: &[&str] = &[
    "accept",
    "alt-used",
    "b3",
    "baggage",
    "cache-control",
    "cdn-loop",
    "cf-connecting-ipv6",
    "cf-ipcountry",
    "connection",
    "date",
    "device-memory",
    "dnt",
    "downlink",
    "dpr",
    "early-data",
    "ect",
    "expect",
    "forwarded",
    "host",
    "keep-alive",
    "max-forwards",
    "origin",
    "pragma",
    "prefer",
    "priority",
    "proxy-connection",
    "purpose",
    "range",
    "referer",
    "rtt",
    "save-data",
    "sentry-trace",
    "te",
    "traceparent",
    "tracestate",
    "trailer",
    "transfer-encoding",
    "uber-trace-id",
    "upgrade",
    "upgrade-insecure-requests",
    "user-agent",
    "via",
    "viewport-width",
    "width",
    "x-amz-date",
    "x-amzn-trace-id",
    "x-azure-clientip",
    "x-azure-socketip",
    "x-cloud-trace-context",
    "x-http-method",
    "x-http-method-override",
    "x-forwarded",
    "x-method-override",
    "x-original-host",
    "x-original-uri",
    "x-original-url",
    "x-purpose",
    "x-requested-with",
    "x-rewrite-url",
];

/// Why a header (its name in lowercase) cannot carry the key.
#[derive(Debug, PartialEq, Eq)]
enum Unfit {
    Credential,
    BodyHash,
    Message,
}

/// Whether a header (its name in lowercase) cannot carry the key, and why.
/// A client's address (`X-Real-IP`, `CF-Connecting-IP`, `Fastly-Client-IP`,
/// every name that ends in `-ip`) describes the message.
fn unfit_header(name: &str) -> Option<Unfit> {
    if CREDENTIAL_HEADERS.contains(&name)
        || CREDENTIAL_HEADER_SUFFIXES
            .iter()
            .any(|s| name.ends_with(s) || name == &s[1..])
    {
        Some(Unfit::Credential)
    } else if BODY_HASH_HEADERS.contains(&name)
        || name.ends_with("-digest")
        || name.starts_with("x-amz-checksum-")
    {
        Some(Unfit::BodyHash)
    } else if MESSAGE_HEADERS.contains(&name)
        || MESSAGE_HEADER_PREFIXES.iter().any(|p| name.starts_with(p))
        || ["-ip", "forwarded-for", "-trace-id", "-span-id"]
            .iter()
            .any(|s| name.ends_with(s))
    {
        Some(Unfit::Message)
    } else {
        None
    }
}

/// The longest header name a request can carry (the `http` crate's
/// `MAX_HEADER_NAME_LEN`): a longer one would never be found, and an
/// `optional` handler would run every request unprotected.
const MAX_HEADER_NAME_LEN: usize = (1 << 16) - 1;

fn valid_header(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_HEADER_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

impl Parse for IdempotentArgs {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let mut args = IdempotentArgs::default();
        let mut errors = Errors::default();
        while !input.is_empty() {
            let lookahead = input.lookahead1();
            if lookahead.peek(kw::scope) {
                let k: kw::scope = input.parse()?;
                let lit: LitStr = value(input, "scope", "\"payment.create\"")?;
                let scope = lit.value();
                if scope.len() > MAX_SCOPE_LEN {
                    errors.push(syn::Error::new(
                        lit.span(),
                        format!(
                            "`scope` is {} bytes long; at most {MAX_SCOPE_LEN} are allowed",
                            scope.len()
                        ),
                    ));
                } else if !valid_scope(&scope) {
                    errors.push(syn::Error::new(
                        lit.span(),
                        "`scope` must be a lowercase dotted name such as `\"payment.create\"`",
                    ));
                }
                errors.set_once(&mut args.scope, (k, lit), k.span, "scope");
            } else if lookahead.peek(kw::fields) {
                let k: kw::fields = input.parse()?;
                list_not_value(
                    input,
                    "`fields` takes a list of body fields, such as `fields(amount, currency)`",
                )?;
                let content;
                syn::parenthesized!(content in input);
                let list: Punctuated<FieldPath, Token![,]> = Punctuated::parse_terminated(&content)?;
                let mut seen: Vec<String> = Vec::new();
                let mut wires: Vec<String> = Vec::new();
                for field in &list {
                    let name = field.name();
                    if seen.contains(&name) {
                        errors.push(syn::Error::new(
                            field.span(),
                            format!("field `{name}` is listed twice"),
                        ));
                    } else if field.wire.as_ref().is_some_and(|lit| {
                        lit.value().is_empty() || lit.value().split('.').any(str::is_empty)
                    }) {
                        let span = field.wire.as_ref().map_or_else(|| field.span(), LitStr::span);
                        errors.push(syn::Error::new(
                            span,
                            "a wire path is the dotted JSON member names, such as `\"recipient.acct\"`",
                        ));
                    } else if wires.contains(&field.wire()) {
                        // In either order: a field named by its wire path
                        // after another that was given the same one.
                        let span = field.wire.as_ref().map_or_else(|| field.span(), LitStr::span);
                        errors.push(syn::Error::new(
                            span,
                            format!("wire path `{}` is listed twice", field.wire()),
                        ));
                    }
                    seen.push(name);
                    wires.push(field.wire());
                }
                if list.is_empty() {
                    errors.push(syn::Error::new(
                            k.span,
                            "`fields()` is empty: name at least one body field, or leave `fields` out to fingerprint the whole body",
                        ),
                    );
                }
                errors.set_once(
                    &mut args.fields,
                    (k, list.into_iter().collect()),
                    k.span,
                    "fields",
                );
            } else if lookahead.peek(kw::header) {
                let k: kw::header = input.parse()?;
                let lit: LitStr = value(input, "header", "\"Idempotency-Key\"")?;
                if !valid_header(&lit.value()) {
                    errors.push(syn::Error::new(
                        lit.span(),
                        "`header` must be a valid HTTP header name, such as `\"Idempotency-Key\"`",
                    ));
                } else if let Some(unfit) = unfit_header(&lit.value().to_ascii_lowercase()) {
                    let why = match unfit {
                        Unfit::Credential => {
                            "`header` cannot be a credential header: the key is stored with the record, \
                             and credentials are never stored"
                                .to_owned()
                        }
                        Unfit::BodyHash => format!(
                            "`header` cannot be `{}`: it is a hash of the body, so two operations with one \
                             body (the same order placed twice) would share one record, and the second be \
                             answered the first's replay",
                            lit.value()
                        ),
                        Unfit::Message => format!(
                            "`header` cannot be `{}`: it describes the message, not the operation, and many \
                             requests carry one value of it, so different operations would share one record",
                            lit.value()
                        ),
                    };
                    errors.push(syn::Error::new(
                        lit.span(),
                        format!("{why}; use a header of its own, such as `\"Idempotency-Key\"`"),
                    ));
                }
                errors.set_once(&mut args.header, (k, lit), k.span, "header");
            } else if lookahead.peek(kw::optional) {
                let k: kw::optional = input.parse()?;
                if input.peek(syn::token::Paren) {
                    let group: proc_macro2::TokenTree = input.parse()?;
                    errors.push(syn::Error::new(
                        group.span(),
                        "`optional` takes no arguments: write `optional` alone",
                    ));
                }
                no_value(
                    input,
                    &mut errors,
                    "`optional` takes no value: write `optional` alone",
                )?;
                errors.set_once(&mut args.optional, k, k.span, "optional");
            } else if lookahead.peek(kw::ttl) {
                let k: kw::ttl = input.parse()?;
                if let Some(d) = duration(input, &mut errors, "ttl", TTL_MS)? {
                    errors.set_once(&mut args.ttl, (k, d), k.span, "ttl");
                }
            } else if lookahead.peek(kw::lock_timeout) {
                let k: kw::lock_timeout = input.parse()?;
                if let Some(d) = duration(input, &mut errors, "lock_timeout", LOCK_TIMEOUT_MS)? {
                    errors.set_once(&mut args.lock_timeout, (k, d), k.span, "lock_timeout");
                }
            } else if lookahead.peek(kw::wait) {
                let k: kw::wait = input.parse()?;
                if let Some(d) = duration(input, &mut errors, "wait", WAIT_MS)? {
                    errors.set_once(&mut args.wait, (k, d), k.span, "wait");
                }
            } else if lookahead.peek(kw::ignore) {
                let k: kw::ignore = input.parse()?;
                list_not_value(
                    input,
                    "`ignore` takes a list of names, such as `ignore(\"page\")`",
                )?;
                let content;
                syn::parenthesized!(content in input);
                let list: Punctuated<LitStr, Token![,]> =
                    Punctuated::parse_terminated_with(&content, |content| {
                        if content.peek(LitStr) {
                            return unsuffixed(content.parse()?);
                        }
                        Err(content.error("`ignore` takes names as strings, such as `ignore(\"page\")`"))
                    })?;
                for (i, lit) in list.iter().enumerate() {
                    if lit.value().is_empty() {
                        errors.push(syn::Error::new(
                            lit.span(),
                            "`ignore` names path parameters or query names; this one is empty",
                        ));
                    } else if list.iter().take(i).any(|earlier| earlier.value() == lit.value()) {
                        errors.push(syn::Error::new(
                            lit.span(),
                            format!("`ignore` lists `{}` twice", lit.value()),
                        ));
                    }
                }
                errors.set_once(
                    &mut args.ignore,
                    (k, list.into_iter().collect()),
                    k.span,
                    "ignore",
                );
            } else if lookahead.peek(kw::body) {
                let k: kw::body = input.parse()?;
                let lit: LitStr = value(input, "body", "\"none\"")?;
                if lit.value() != "none" {
                    errors.push(syn::Error::new(
                        lit.span(),
                        "`body` takes `\"none\"`: it says that the handler reads no request body",
                    ));
                }
                errors.set_once(&mut args.no_body, k, k.span, "body");
            } else if lookahead.peek(Token![crate]) {
                let k: Token![crate] = input.parse()?;
                let lit: LitStr = value(input, "crate", "\"::idem\"")?;
                match lit.parse::<syn::Path>() {
                    Ok(path) => errors.set_once(&mut args.krate, (k, path), k.span, "crate"),
                    Err(_) => errors.push(syn::Error::new(
                        lit.span(),
                        "`crate` must be a path such as `\"::idem\"`",
                    )),
                }
            } else {
                return Err(lookahead.error());
            }
            if input.is_empty() {
                break;
            }
            input.parse::<Token![,]>()?;
        }
        if args.scope.is_none() {
            errors.push(syn::Error::new(
                Span::call_site(),
                "`#[idempotent]` requires `scope = \"...\"`, such as `scope = \"payment.create\"`",
            ));
        }
        args.errors = errors;
        Ok(args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(tokens: proc_macro2::TokenStream) -> syn::Result<IdempotentArgs> {
        syn::parse2(tokens)
    }

    #[test]
    fn parses_every_argument() {
        let args = parse(quote::quote!(
            scope = "payment.create",
            fields(amount, recipient.account),
            header = "X-Key",
            optional,
            ttl = "2h",
            lock_timeout = "30s",
            wait = "500ms",
            crate = "::idem"
        ))
        .unwrap();
        assert!(args.errors.finish().is_ok());
        assert_eq!(args.scope.unwrap().1.value(), "payment.create");
        let fields: Vec<String> = args.fields.unwrap().1.iter().map(FieldPath::name).collect();
        assert_eq!(fields, ["amount", "recipient.account"]);
        assert_eq!(args.ttl.unwrap().1.millis, 7_200_000);
        assert_eq!(args.lock_timeout.unwrap().1.millis, 30_000);
        assert_eq!(args.wait.unwrap().1.millis, 500);
        assert!(args.optional.is_some());
    }

    #[test]
    fn collects_every_semantic_error() {
        let args = parse(quote::quote!(scope = "Payment", ttl = "5x", fields(a, a))).unwrap();
        let messages: Vec<String> = args
            .errors
            .finish()
            .unwrap_err()
            .into_iter()
            .map(|e| e.to_string())
            .collect();
        assert_eq!(messages.len(), 3, "{messages:?}");
    }

    #[test]
    fn scopes_and_durations() {
        assert!(valid_scope("payment.create") && valid_scope("a1_b.c"));
        for bad in ["", "Payment", "payment.", ".x", "a..b", "a-b", "1a"] {
            assert!(!valid_scope(bad), "{bad}");
        }
        let longest = format!("a.{}", "b".repeat(MAX_SCOPE_LEN - 2));
        assert!(valid_scope(&longest));
        assert!(!valid_scope(&format!("{longest}c")));
        for bad in ["", "5", "s", "0s", "5 s", "-5s", "5sec", "99999999999999999999d"] {
            let lit = LitStr::new(bad, Span::call_site());
            assert!(DurationLit::parse_lit(&lit).is_err(), "{bad}");
        }
    }

    #[test]
    fn headers_that_cannot_carry_a_key() {
        let credentials: &[&str] = &[
            "authorization",
            "cookie",
            "x-api-key",
            "api-key",
            "x-goog-api-key",
            "x-auth-token",
            "x-access-token",
            "x-amz-security-token",
            "x-session-token",
            "x-csrftoken",
            "ocp-apim-subscription-key",
            "x-ms-token-aad-id-token",
            "private-token",
            "auth-token",
            "access-token",
            "api-token",
            "csrf-token",
            "x-api-token",
            "x-authorization",
            "x-consul-token",
        ];
        let hashes: &[&str] = &[
            "content-digest",
            "repr-digest",
            "want-content-digest",
            "digest",
            "content-md5",
            "x-amz-content-sha256",
            "x-amz-checksum-sha256",
            "x-hub-signature-256",
            "x-shopify-hmac-sha256",
        ];
        let message: &[&str] = &[
            "content-type",
            "content-location",
            "content-disposition",
            "content-range",
            "sec-gpc",
            "sec-purpose",
            "sec-ch-ua-platform",
            "dnt",
            "true-client-ip",
            "fastly-client-ip",
            "x-cluster-client-ip",
            "cf-connecting-ip",
            "x-real-ip",
            "x-forwarded-for",
            "traceparent",
            "priority",
            "prefer",
            "save-data",
            "early-data",
            "if-match",
            "accept-language",
            "x-amz-date",
            "user-agent",
            "x-azure-clientip",
            "cloudfront-viewer-address",
            "x-amzn-trace-id",
            "x-forwarded",
            "forwarded-for",
            "x-original-forwarded-for",
            "x-envoy-external-address",
            "x-envoy-original-path",
            "x-datadog-trace-id",
            "x-datadog-parent-id",
            "ot-tracer-traceid",
            "x-original-url",
            "x-original-uri",
            "x-rewrite-url",
        ];
        // What services name their key header (Stripe's and Adyen's,
        // PayPal's, Twilio's, Azure's, AWS's, Amazon Pay's), and headers
        // near the refused ones.
        let keys: &[&str] = &[
            "paypal-request-id",
            "i-twilio-idempotency-token",
            "x-ms-client-request-id",
            "repeatability-request-id",
            "x-amz-client-token",
            "x-amz-pay-idempotency-key",
            "x-amzn-requestid",
            "cko-idempotency-key",
            "idempotency-key",
            "x-idempotency-key",
            "idempotency-token",
            "x-idempotency-token",
            "x-request-id",
            "request-id",
            "x-correlation-id",
            "client-request-id",
            "x-operation-id",
            "x-tip",
            "key",
        ];
        let cases = [
            (Some(Unfit::Credential), credentials),
            (Some(Unfit::BodyHash), hashes),
            (Some(Unfit::Message), message),
            (None, keys),
        ];
        for (unfit, names) in cases {
            for name in names {
                assert_eq!(unfit_header(name), unfit, "{name}");
            }
        }
    }

    /// A header name longer than a request can carry would never be
    /// found (an `optional` handler would run every request unprotected).
    #[test]
    fn a_header_name_no_request_can_carry_is_refused() {
        assert!(valid_header(&"x".repeat(MAX_HEADER_NAME_LEN)));
        assert!(!valid_header(&"x".repeat(MAX_HEADER_NAME_LEN + 1)));
        let long = format!(
            "scope = \"a\", header = \"{}\"",
            "x".repeat(MAX_HEADER_NAME_LEN + 1)
        );
        let err = parse(long.parse().unwrap()).unwrap().errors.finish().unwrap_err();
        assert!(err.to_string().contains("header"), "{err}");
    }

    #[test]
    fn a_method_call_in_fields_is_refused_with_the_fix() {
        let err = parse(quote::quote!(scope = "a", fields(amount()))).err().unwrap();
        assert!(err.to_string().contains("not methods"), "{err}");
    }

    #[test]
    fn unknown_arguments_list_the_valid_ones() {
        let err = parse(quote::quote!(scope = "a", retries = 3)).err().unwrap();
        let message = err.to_string();
        for name in [
            "scope",
            "fields",
            "header",
            "optional",
            "ttl",
            "lock_timeout",
            "wait",
            "ignore",
            "body",
            "crate",
        ] {
            assert!(message.contains(name), "{message}");
        }
    }
}
