//! What identifies a request, over real HTTP: the path and query, every
//! kind of body, the body as the client sent it (not the handler's type),
//! and fingerprints that survive deploys that do not change a request's
//! meaning.

use axum::extract::Path;
use axum::routing::post;
use axum::{Form, Json, Router};
use idem::{idempotent, Idem, IdempotencyStore, MemoryStore};
use idem_testkit::http::{post as post_req, Reply};
use std::net::SocketAddr;
use std::sync::Arc;

/// Serves `router` with idem over `store` (single tenant).
async fn serve(store: &Arc<dyn IdempotencyStore>, router: Router) -> SocketAddr {
    idem_testkit::http::serve(router.layer(Idem::from_arc(store.clone()).single_tenant().layer())).await
}

fn memory() -> Arc<dyn IdempotencyStore> {
    Arc::new(MemoryStore::new())
}

async fn send(addr: SocketAddr, path: &str, body: &str, key: &str) -> Reply {
    post_req(path, body).key(key).send(addr).await
}

fn replayed(r: &Reply) -> bool {
    r.header("idempotent-replayed") == Some("true")
}

/// Sends `body` under `key`, expecting the handler to run (200).
async fn ran(addr: SocketAddr, path: &str, body: &str, key: &str) -> Reply {
    let reply = send(addr, path, body, key).await;
    assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
    reply
}

/// Sends `body` under `key`, expecting another request's key (422).
async fn refused(addr: SocketAddr, path: &str, body: &str, key: &str) {
    let reply = send(addr, path, body, key).await;
    assert_eq!(reply.status, 422, "{}", String::from_utf8_lossy(&reply.body));
}

/// Sends `body` under `key` to `before`, then the same to `after` (a deploy,
/// on one store): the second is the first's replay.
async fn replays_across_a_deploy(
    store: &Arc<dyn IdempotencyStore>,
    before: Router,
    after: Router,
    body: &str,
    key: &str,
) {
    let (before, after) = (serve(store, before).await, serve(store, after).await);
    let a = send(before, "/", body, key).await;
    assert_eq!(a.status, 200, "{}", String::from_utf8_lossy(&a.body));
    let b = send(after, "/", body, key).await;
    assert_eq!(
        (b.status, b.body.clone(), replayed(&b)),
        (200, a.body.clone(), true),
        "{}",
        String::from_utf8_lossy(&b.body)
    );
}

mod v1 {
    use super::*;

    #[derive(serde::Deserialize)]
    pub(crate) struct PaymentIn {
        pub(crate) amount: i64,
        pub(crate) currency: String,
    }

    #[idempotent(scope = "payment.create", fields(amount, currency))]
    pub(crate) async fn declared(Json(p): Json<PaymentIn>) -> String {
        format!("v1 {} {}", p.amount, p.currency)
    }

    #[idempotent(scope = "payment.whole")]
    pub(crate) async fn whole(Json(p): Json<PaymentIn>) -> String {
        format!("v1 {} {}", p.amount, p.currency)
    }
}

/// The same endpoints after a deploy: a Rust field renamed under the same
/// wire name, an optional field the client does not send.
mod v2 {
    use super::*;

    #[derive(serde::Deserialize)]
    pub(crate) struct PaymentIn {
        #[serde(rename = "amount")]
        pub(crate) amount_minor: i64,
        pub(crate) currency: String,
        pub(crate) note: Option<String>,
    }

    #[idempotent(scope = "payment.create", fields(amount_minor = "amount", currency))]
    pub(crate) async fn declared(Json(p): Json<PaymentIn>) -> String {
        format!("v2 {} {} {:?}", p.amount_minor, p.currency, p.note)
    }

    #[idempotent(scope = "payment.whole")]
    pub(crate) async fn whole(Json(p): Json<PaymentIn>) -> String {
        format!("v2 {} {} {:?}", p.amount_minor, p.currency, p.note)
    }
}

/// A retry that spans a deploy which renames a Rust field (same wire name)
/// or adds an optional field replays the first answer.
#[tokio::test]
async fn a_retry_across_a_deploy_that_keeps_the_wire_form_replays() {
    let store = memory();
    let before = serve(
        &store,
        Router::new()
            .route("/declared", post(v1::declared))
            .route("/whole", post(v1::whole)),
    )
    .await;
    let after = serve(
        &store,
        Router::new()
            .route("/declared", post(v2::declared))
            .route("/whole", post(v2::whole)),
    )
    .await;
    let body = r#"{"amount": 4990, "currency": "EUR"}"#;
    for path in ["/declared", "/whole"] {
        let first = send(before, path, body, "k-deploy").await;
        assert_eq!((first.status, first.body.as_slice()), (200, &b"v1 4990 EUR"[..]));
        let retry = send(after, path, body, "k-deploy").await;
        assert!(replayed(&retry), "{path}: {retry:?}");
        assert_eq!(retry.body, first.body);
        // And a changed value is still another request.
        let changed = send(after, path, r#"{"amount": 4991, "currency": "EUR"}"#, "k-deploy").await;
        assert_eq!(changed.status, 422, "{path}");
    }
}

#[derive(serde::Deserialize, serde::Serialize)]
struct CardPayment {
    amount: i64,
    /// Kept out of every response, yet part of what the client sent.
    #[serde(skip_serializing)]
    card: String,
    big: Option<u128>,
}

#[idempotent(scope = "card.charge")]
async fn charge(Json(p): Json<CardPayment>) -> String {
    format!("charged {} on {}", p.amount, &p.card[p.card.len() - 4..])
}

/// The whole-body fingerprint is what the client sent: a field the type
/// never serializes counts, a value past u64 fingerprints (and exactly).
#[tokio::test]
async fn the_whole_body_is_what_the_client_sent() {
    let addr = serve(&memory(), Router::new().route("/charge", post(charge))).await;
    let first = send(
        addr,
        "/charge",
        r#"{"amount": 5, "card": "4111111111111111"}"#,
        "k-card",
    )
    .await;
    assert_eq!(first.status, 200);
    let other_card = send(
        addr,
        "/charge",
        r#"{"amount": 5, "card": "5500000000000004"}"#,
        "k-card",
    )
    .await;
    assert_eq!(other_card.status, 422, "another card is another request");

    let big = |n: &str| format!(r#"{{"amount": 5, "card": "4111111111111111", "big": {n}}}"#);
    let a = send(
        addr,
        "/charge",
        &big("340282366920938463463374607431768211454"),
        "k-big",
    )
    .await;
    assert_eq!(a.status, 200, "{a:?}");
    let b = send(
        addr,
        "/charge",
        &big("340282366920938463463374607431768211455"),
        "k-big",
    )
    .await;
    assert_eq!(b.status, 422, "two u128 values one apart are two requests");
    let same = send(
        addr,
        "/charge",
        &big("340282366920938463463374607431768211454"),
        "k-big",
    )
    .await;
    assert!(replayed(&same));
}

#[idempotent(scope = "event.record")]
async fn record_event(Json(v): Json<serde_json::Value>) -> String {
    v.to_string()
}

/// A body that is not I-JSON cannot be fingerprinted: where the handler's
/// type would take it (a map keeps the last of two equal names), idem
/// refuses it with 400, stores nothing, and the handler does not run.
#[tokio::test]
async fn a_body_with_duplicate_names_is_refused_before_anything_is_stored() {
    let store = memory();
    let addr = serve(&store, Router::new().route("/events", post(record_event))).await;
    let dup = send(addr, "/events", r#"{"kind": "a", "kind": "b"}"#, "k-dup").await;
    assert_eq!(dup.status, 400, "{dup:?}");
    assert_eq!(dup.problem(), "idempotency-body-invalid");
    assert_eq!(store.as_any_store_len(), 0);
}

/// How many records a memory store holds.
trait StoreLen {
    fn as_any_store_len(&self) -> usize;
}

impl StoreLen for Arc<dyn IdempotencyStore> {
    fn as_any_store_len(&self) -> usize {
        let any: &dyn std::any::Any = &**self;
        any.downcast_ref::<MemoryStore>().unwrap().len()
    }
}

#[derive(serde::Deserialize)]
struct RefundIn {
    amount: i64,
}

#[idempotent(scope = "refund.create", fields(amount), ignore("utm_source"))]
async fn refund(Path(id): Path<String>, Json(r): Json<RefundIn>) -> String {
    format!("refunded {} of {id}", r.amount)
}

#[idempotent(scope = "report.create", body = "none")]
async fn report(axum::extract::RawQuery(q): axum::extract::RawQuery) -> String {
    format!("report {q:?}")
}

/// The path parameters and the query identify the request; an ignored
/// query name does not.
#[tokio::test]
async fn the_path_and_the_query_identify_the_request() {
    let addr = serve(
        &memory(),
        Router::new()
            .route("/payments/{id}/refunds", post(refund))
            .route("/reports", post(report)),
    )
    .await;
    let body = r#"{"amount": 100}"#;
    let a = send(addr, "/payments/pay_a/refunds", body, "k-r").await;
    assert_eq!(a.body, b"refunded 100 of pay_a");
    let b = send(addr, "/payments/pay_b/refunds", body, "k-r").await;
    assert_eq!(b.status, 422, "another payment's refund is another request");
    let tracked = send(addr, "/payments/pay_a/refunds?utm_source=mail", body, "k-r").await;
    assert!(replayed(&tracked), "an ignored query name changes nothing");

    let first = send(addr, "/reports?month=11&year=2026", "", "k-q").await;
    assert_eq!(first.status, 200);
    let reordered = send(addr, "/reports?year=2026&month=11", "", "k-q").await;
    assert!(replayed(&reordered), "the order of query names does not count");
    let other = send(addr, "/reports?month=12&year=2026", "", "k-q").await;
    assert_eq!(other.status, 422);
}

#[derive(serde::Deserialize)]
struct Charge {
    amount: i64,
}

#[idempotent(scope = "charge.create", fields(amount))]
async fn charge_on(uri: axum::http::Uri, Json(c): Json<Charge>) -> String {
    format!("charged {} on {}", c.amount, uri.path())
}

#[idempotent(scope = "charge.live", fields(amount))]
async fn charge_live(Json(c): Json<Charge>) -> String {
    format!("charged {} live", c.amount)
}

/// The literal path does not count, only its parameters (README): one
/// handler on two routes is one scope, and a key sent to both is one
/// request; a handler of its own per route (its own scope) keeps them
/// apart.
#[tokio::test]
async fn one_handler_on_two_routes_is_one_scope() {
    let addr = serve(
        &memory(),
        Router::new()
            .route("/test/charges", post(charge_on))
            .route("/live/charges", post(charge_on))
            .route("/live-own/charges", post(charge_live)),
    )
    .await;
    let body = r#"{"amount": 100}"#;
    let test = send(addr, "/test/charges", body, "k-mount").await;
    assert_eq!(test.body, b"charged 100 on /test/charges");
    let live = send(addr, "/live/charges", body, "k-mount").await;
    assert!(replayed(&live), "{live:?}");
    assert_eq!(live.body, test.body);
    let own = send(addr, "/live-own/charges", body, "k-mount").await;
    assert_eq!(
        (own.body.as_slice(), replayed(&own)),
        (&b"charged 100 live"[..], false)
    );
}

trait Provider: Send + Sync + 'static {
    const NAME: &'static str;
}

struct Stripe;
struct Adyen;

impl Provider for Stripe {
    const NAME: &'static str = "stripe";
}

impl Provider for Adyen {
    const NAME: &'static str = "adyen";
}

#[idempotent(scope = "charge.generic", fields(amount))]
async fn charge_with<P: Provider>(Json(c): Json<Charge>) -> String {
    format!("charged {} on {}", c.amount, P::NAME)
}

#[idempotent(scope = "charge.adyen", fields(amount))]
async fn charge_adyen(c: Json<Charge>) -> String {
    charge_with_code::<Adyen>(c)
}

fn charge_with_code<P: Provider>(Json(c): Json<Charge>) -> String {
    format!("charged {} on {}", c.amount, P::NAME)
}

/// A generic handler is one handler (README): its instantiations share its
/// scope, so one key sent to two of them is one request, replayed; a thin
/// handler of its own per instantiation keeps them apart.
#[tokio::test]
async fn a_generic_handlers_instantiations_are_one_scope() {
    let addr = serve(
        &memory(),
        Router::new()
            .route("/stripe/charges", post(charge_with::<Stripe>))
            .route("/adyen/charges", post(charge_with::<Adyen>))
            .route("/adyen-own/charges", post(charge_adyen)),
    )
    .await;
    let body = r#"{"amount": 500}"#;
    let stripe = send(addr, "/stripe/charges", body, "k-generic").await;
    assert_eq!(stripe.body, b"charged 500 on stripe");
    let adyen = send(addr, "/adyen/charges", body, "k-generic").await;
    assert!(replayed(&adyen), "{adyen:?}");
    assert_eq!(adyen.body, stripe.body);
    let own = send(addr, "/adyen-own/charges", body, "k-generic").await;
    assert_eq!(
        (own.body.as_slice(), replayed(&own)),
        (&b"charged 500 on adyen"[..], false)
    );
}

#[idempotent(scope = "refund.by_query")]
async fn refund_by_query(
    axum::extract::Query(q): axum::extract::Query<std::collections::HashMap<String, String>>,
) -> String {
    format!("refund to {:?}", q.get("\u{FFFD}"))
}

#[idempotent(scope = "refund.by_form")]
async fn refund_by_form(Form(q): Form<std::collections::HashMap<String, String>>) -> String {
    format!("refund to {:?}", q.get("\u{FFFD}"))
}

/// Names that are not UTF-8 (`%FF`, `%FE`, `%EF%BF%BD`) are one name to a
/// handler (axum decodes them lossily, to U+FFFD), whose map keeps the last
/// value: their order as sent is two requests, as one name's values are,
/// never one replayed for the other.
#[tokio::test]
async fn names_a_handler_reads_as_one_keep_their_order() {
    let addr = serve(
        &memory(),
        Router::new()
            .route("/refunds", post(refund_by_query))
            .route("/form-refunds", post(refund_by_form)),
    )
    .await;
    let alice_then_bob = send(addr, "/refunds?%FF=acct_alice&%FE=acct_bob", "", "k-query").await;
    assert_eq!(alice_then_bob.body, b"refund to Some(\"acct_bob\")");
    refused(addr, "/refunds?%FE=acct_bob&%FF=acct_alice", "", "k-query").await;
    let form = |body: &'static str, key: &'static str| async move {
        post_req("/form-refunds", body)
            .content_type("application/x-www-form-urlencoded")
            .key(key)
            .send(addr)
            .await
    };
    let first = form("%FF=acct_alice&%EF%BF%BD=acct_bob", "k-form").await;
    assert_eq!(first.body, b"refund to Some(\"acct_bob\")");
    let other = form("%EF%BF%BD=acct_bob&%FF=acct_alice", "k-form").await;
    assert_eq!(other.status, 422, "{other:?}");
}

#[derive(serde::Deserialize)]
struct Signup {
    email: String,
}

#[idempotent(scope = "signup.create")]
async fn signup(Form(s): Form<Signup>) -> String {
    format!("welcome {}", s.email)
}

#[idempotent(scope = "message.send")]
async fn message(body: axum::body::Bytes) -> String {
    format!("{} bytes", body.len())
}

/// Forms count by their pairs, raw bodies by every byte.
#[tokio::test]
async fn forms_and_raw_bodies_are_fingerprinted() {
    let addr = serve(
        &memory(),
        Router::new()
            .route("/signup", post(signup))
            .route("/messages", post(message)),
    )
    .await;
    let form = |body: &str, key: &str| {
        let request = post_req("/signup", body)
            .content_type("application/x-www-form-urlencoded")
            .key(key);
        async move { request.send(addr).await }
    };
    let first = form("email=a%40example.com&plan=pro", "k-form").await;
    assert_eq!(first.body, b"welcome a@example.com");
    assert!(replayed(&form("plan=pro&email=a@example.com", "k-form").await));
    assert_eq!(form("email=b%40example.com&plan=pro", "k-form").await.status, 422);

    let raw = |body: &str| {
        let request = post_req("/messages", body)
            .content_type("application/octet-stream")
            .key("k-raw");
        async move { request.send(addr).await }
    };
    assert_eq!(raw("hello").await.status, 200);
    assert!(replayed(&raw("hello").await));
    assert_eq!(raw("hellp").await.status, 422);
}

#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct AliasedIn {
    #[serde(alias = "amt")]
    amount: i64,
    account_id: Option<String>,
    #[serde(rename = "billing.account")]
    billing: Option<String>,
    #[serde(default, deserialize_with = "present")]
    nickname: Option<Option<String>>,
}

/// `Some(None)` for an explicit `null`, `None` (by default) for absent.
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Option<String>>, D::Error> {
    use serde::Deserialize;
    Option::<String>::deserialize(d).map(Some)
}

#[idempotent(
    scope = "aliased.pay",
    fields(amount, account_id, billing = "billing.account", nickname)
)]
async fn aliased(Json(p): Json<AliasedIn>) -> String {
    format!("{} {:?} {:?} {:?}", p.amount, p.account_id, p.billing, p.nickname)
}

#[derive(serde::Deserialize)]
struct Positional {
    amount: i64,
    currency: String,
}

#[idempotent(scope = "positional.pay", fields(amount, currency))]
async fn positional(Json(p): Json<Positional>) -> String {
    format!("{} {}", p.amount, p.currency)
}

/// A declared field that is not where its wire path says (sent under an
/// alias, renamed by the type, behind a dot in its name, left out, or in a
/// struct sent as an array) never makes two requests meet: the whole body
/// counts then.
#[tokio::test]
async fn a_declared_field_idem_cannot_find_makes_the_whole_body_count() {
    let addr = serve(
        &memory(),
        Router::new()
            .route("/aliased", post(aliased))
            .route("/positional", post(positional)),
    )
    .await;
    for (key, first, second) in [
        ("k-alias", r#"{"amt": 100}"#, r#"{"amt": 999}"#),
        (
            "k-camel",
            r#"{"amount": 1, "accountId": "a"}"#,
            r#"{"amount": 1, "accountId": "b"}"#,
        ),
        (
            "k-dot",
            r#"{"amount": 1, "billing.account": "a"}"#,
            r#"{"amount": 1, "billing.account": "b"}"#,
        ),
        ("k-null", r#"{"amount": 1}"#, r#"{"amount": 1, "nickname": null}"#),
        // A decoy at the declared path, while serde reads another member.
        (
            "k-decoy-camel",
            r#"{"amount": 1, "accountId": "a", "account_id": "legacy"}"#,
            r#"{"amount": 1, "accountId": "b", "account_id": "legacy"}"#,
        ),
        (
            "k-decoy-dot",
            r#"{"amount": 1, "billing.account": "a", "billing": {"account": "x"}}"#,
            r#"{"amount": 1, "billing.account": "b", "billing": {"account": "x"}}"#,
        ),
    ] {
        let a = send(addr, "/aliased", first, key).await;
        assert_eq!(a.status, 200, "{key}: {a:?}");
        let b = send(addr, "/aliased", second, key).await;
        assert_eq!(
            b.status,
            422,
            "{key}: another request replayed {:?}",
            String::from_utf8_lossy(&b.body)
        );
        assert!(replayed(&send(addr, "/aliased", first, key).await), "{key}");
    }
    let a = send(addr, "/positional", r#"[100, "EUR"]"#, "k-array").await;
    assert_eq!(a.body, b"100 EUR");
    assert_eq!(
        send(addr, "/positional", r#"[999999, "USD"]"#, "k-array")
            .await
            .status,
        422
    );
}

#[idempotent(scope = "number.record")]
async fn number(Json(n): Json<serde_json::Number>) -> String {
    n.to_string()
}

/// Numbers past 2^53: the same number spelled two ways is one request; two
/// different numbers are two, whichever way each is spelled.
#[tokio::test]
async fn large_numbers_are_one_request_per_value() {
    let addr = serve(&memory(), Router::new().route("/n", post(number))).await;
    for (key, a, b) in [
        ("k-2p60", "1152921504606846976.0", "1152921504606846976"),
        ("k-1e21", "1e21", "1000000000000000000000"),
        ("k-4990", "4.99e3", "4990"),
    ] {
        assert_eq!(send(addr, "/n", a, key).await.status, 200);
        let again = send(addr, "/n", b, key).await;
        assert!(replayed(&again), "{key}: {b} is {a}: {again:?}");
    }
    assert_eq!(
        send(addr, "/n", "1152921504606847000", "k-2p60").await.status,
        422
    );
    assert_eq!(send(addr, "/n", "9007199254740993", "k-big").await.status, 200);
    assert_eq!(send(addr, "/n", "9007199254740992", "k-big").await.status, 422);
    // An integer written with a point and zeros is that integer, past 2^53
    // too; more significant digits than a double holds keep the exact value.
    for (key, a, b) in [
        ("k-2p60-00", "1152921504606846976.00", "1152921504606846976"),
        ("k-big-00", "9007199254740993.00", "9007199254740993"),
        ("k-19", "1.000000000000000001", "1.0000000000000000010"),
        ("k-19e", "1000000000000000001e-18", "1.000000000000000001"),
    ] {
        assert_eq!(send(addr, "/n", a, key).await.status, 200);
        let again = send(addr, "/n", b, key).await;
        assert!(replayed(&again), "{key}: {b} is {a}: {again:?}");
    }
    for (key, other) in [
        ("k-2p60-00", "1152921504606847000"),
        ("k-big-00", "9007199254740992"),
        ("k-19", "1"),
        ("k-19", "1.0000000000000000011"),
    ] {
        assert_eq!(send(addr, "/n", other, key).await.status, 422, "{key}: {other}");
    }
}

#[derive(serde::Deserialize)]
struct Inner {
    account: String,
}

#[derive(serde::Deserialize)]
struct Flattened {
    #[serde(flatten)]
    inner: Inner,
}

#[idempotent(scope = "flattened.pay", fields(inner.account))]
async fn flattened(Json(p): Json<Flattened>) -> String {
    format!("paid to {}", p.inner.account)
}

/// A flattened field, even with a decoy under the declared path, counts by
/// what the handler read.
#[tokio::test]
async fn a_flattened_field_counts_by_what_the_handler_read() {
    let addr = serve(&memory(), Router::new().route("/f", post(flattened))).await;
    let a = send(
        addr,
        "/f",
        r#"{"account": "a", "inner": {"account": "x"}}"#,
        "k-flat",
    )
    .await;
    assert_eq!(a.body, b"paid to a");
    let b = send(
        addr,
        "/f",
        r#"{"account": "b", "inner": {"account": "x"}}"#,
        "k-flat",
    )
    .await;
    assert_eq!(b.status, 422, "{b:?}");
}

/// The body extractor sees the request as it came: its own checks in its
/// own order (415 before the body limit), and axum's body limit.
#[tokio::test]
async fn the_body_extractor_keeps_its_own_rejections_and_limits() {
    let addr = serve(&memory(), Router::new().route("/charge", post(charge))).await;
    let big = format!(r#"{{"amount": 5, "card": "{}"}}"#, "4".repeat(3 * 1024 * 1024));
    let wrong_type = post_req("/charge", &big)
        .content_type("text/plain")
        .key("k-415")
        .send(addr)
        .await;
    assert_eq!(wrong_type.status, 415, "{:?}", wrong_type.status);
    let too_big = post_req("/charge", &big).key("k-413").send(addr).await;
    assert_eq!(too_big.status, 413);
}

#[derive(serde::Deserialize)]
struct Transfer {
    rate: f64,
}

#[idempotent(scope = "transfer.create", fields(rate))]
async fn transfer(Json(t): Json<Transfer>) -> String {
    format!("rate {}", t.rate)
}

/// A declared number reads as the value the JSON text means, whatever its
/// spelling: the handler's typed `f64` and the fingerprint's parsing agree
/// (both correctly rounded), so that the field counts alone and an
/// undeclared member changes nothing. (With serde_json's default, faster
/// parsing, `123456789012345680000` read as `123456789012345670000`, the
/// two disagreed, and the whole body counted.)
#[tokio::test]
async fn a_declared_number_counts_alone_however_it_is_spelled() {
    let addr = serve(&memory(), Router::new().route("/transfers", post(transfer))).await;
    for (i, rate) in [
        "0.1",
        "1e21",
        "5e-324",
        "123456789012345680000",
        "2.2250738585072011e-308",
        "1.7976931348623157e308",
    ]
    .iter()
    .enumerate()
    {
        let key = format!("k-rate-{i}");
        let body = |note: &str| format!(r#"{{"rate": {rate}, "note": "{note}"}}"#);
        let first = send(addr, "/transfers", &body("first"), &key).await;
        assert_eq!(first.status, 200, "{rate}: {first:?}");
        let retry = send(addr, "/transfers", &body("second"), &key).await;
        assert!(
            replayed(&retry),
            "{rate}: an undeclared member changed: {retry:?}"
        );
        let other = send(addr, "/transfers", r#"{"rate": 3.25, "note": "first"}"#, &key).await;
        assert_eq!(other.status, 422, "{rate}");
    }
}

/// A path parameter that is not UTF-8 once decoded identifies the request
/// by the raw path: the same bytes replay, other bytes are another request.
#[tokio::test]
async fn a_path_parameter_that_is_not_utf8_still_identifies_the_request() {
    let addr = serve(&memory(), Router::new().route("/raw/{id}", post(raw_id))).await;
    let first = send(addr, "/raw/%FF", "", "k-raw-path").await;
    assert_eq!(first.status, 200, "{first:?}");
    assert!(replayed(&send(addr, "/raw/%FF", "", "k-raw-path").await));
    assert_eq!(send(addr, "/raw/%FE", "", "k-raw-path").await.status, 422);
    assert_eq!(send(addr, "/raw/%FF?x=1", "", "k-raw-path").await.status, 422);
}

#[idempotent(scope = "raw.id", body = "none")]
async fn raw_id(uri: axum::http::Uri) -> String {
    format!("got {}", uri.path())
}

/// A parameter of a nested router's prefix that is not UTF-8 once decoded
/// identifies the request too: the whole path as the client sent it counts,
/// not what is left of it inside the nested router (with that, another
/// organisation's request replayed the first one's answer).
#[tokio::test]
async fn a_nested_parameter_that_is_not_utf8_still_identifies_the_request() {
    let addr = serve(
        &memory(),
        Router::new().nest("/org/{org}", Router::new().route("/items", post(raw_id))),
    )
    .await;
    let first = send(addr, "/org/%FF/items", "", "k-nested-raw").await;
    assert_eq!(first.status, 200, "{first:?}");
    assert!(replayed(&send(addr, "/org/%FF/items", "", "k-nested-raw").await));
    let other = send(addr, "/org/%FE/items", "", "k-nested-raw").await;
    assert_eq!(other.status, 422, "another organisation's request: {other:?}");
}

#[derive(serde::Deserialize)]
struct Amount {
    amount: u64,
}

#[idempotent(scope = "shared.create", fields(amount))]
async fn pay_shared(Json(a): Json<Amount>) -> String {
    format!("paid {}", a.amount)
}

#[idempotent(scope = "shared.create", fields(amount))]
async fn refund_shared(Json(a): Json<Amount>) -> String {
    format!("refunded {}", a.amount)
}

/// A payment and a refund handler given one scope, both attributes on the
/// line of the macro's call.
macro_rules! two_handlers_of_one_scope {
    ($scope:literal, $pay:ident, $refund:ident) => {
        #[idempotent(scope = $scope, fields(amount))]
        async fn $pay(Json(a): Json<Amount>) -> String {
            format!("paid {}", a.amount)
        }
        #[idempotent(scope = $scope, fields(amount))]
        async fn $refund(Json(a): Json<Amount>) -> String {
            format!("refunded {}", a.amount)
        }
    };
}

/// What was logged of handlers of one scope `scope` served through one
/// `Idem`: this test's lines, since the binary's other tests log into the
/// same text.
fn same_scope_said(scope: &str) -> Vec<String> {
    idem_testkit::logs()
        .text()
        .lines()
        .filter(|l| l.contains("have the same scope") && l.contains(&format!("scope=\"{scope}\"")))
        .map(str::to_owned)
        .collect()
}

/// Two handlers given one scope are one operation (the scope is the
/// operation's name): a key sent to both runs the first and replays its
/// answer to the second. The first request of the second handler says so
/// in the log, once, naming both handlers and where both attributes are.
#[tokio::test(flavor = "current_thread")]
async fn two_handlers_of_one_scope_are_one_operation_and_the_second_says_so() {
    // Installed before anything this test logs.
    let _ = idem_testkit::logs();
    let said = || same_scope_said("shared.create");
    let addr = serve(
        &memory(),
        Router::new()
            .route("/pay", post(pay_shared))
            .route("/refund", post(refund_shared)),
    )
    .await;
    let body = r#"{"amount": 100}"#;
    let paid = send(addr, "/pay", body, "k-shared").await;
    assert_eq!(paid.body, b"paid 100");
    assert_eq!(said(), Vec::<String>::new());
    let refund = send(addr, "/refund", body, "k-shared").await;
    assert!(replayed(&refund), "{refund:?}");
    assert_eq!(refund.body, b"paid 100");
    send(addr, "/refund", body, "k-other").await;
    send(addr, "/pay", body, "k-third").await;
    let said = said();
    assert_eq!(said.len(), 1, "{said:?}");
    assert_eq!(
        said[0].matches("tests/request_identity.rs:").count(),
        2,
        "{said:?}"
    );
    assert!(
        said[0].contains("handler=\"pay_shared\"") && said[0].contains("other=\"refund_shared\"")
            || said[0].contains("handler=\"refund_shared\"") && said[0].contains("other=\"pay_shared\""),
        "{said:?}"
    );
}

two_handlers_of_one_scope!("apart.create", pay_apart, refund_apart);

/// Handlers of one scope served through two `Idem`s over two stores (two
/// services in one process, two tests in one binary) share no record: a
/// key sent to both runs both, and nothing is said of their scope.
#[tokio::test(flavor = "current_thread")]
async fn handlers_of_one_scope_through_two_idems_are_two_operations_and_nothing_is_said() {
    // Installed before anything this test logs.
    let _ = idem_testkit::logs();
    let pay = serve(&memory(), Router::new().route("/pay", post(pay_apart))).await;
    let refund = serve(&memory(), Router::new().route("/refund", post(refund_apart))).await;
    let body = r#"{"amount": 5}"#;
    assert_eq!(send(pay, "/pay", body, "k-apart").await.body, b"paid 5");
    let refunded = send(refund, "/refund", body, "k-apart").await;
    assert!(!replayed(&refunded), "{refunded:?}");
    assert_eq!(refunded.body, b"refunded 5");
    assert_eq!(same_scope_said("apart.create"), Vec::<String>::new());
}

#[idempotent(scope = "routed.create", fields(amount))]
async fn pay_routed(Json(a): Json<Amount>) -> String {
    format!("paid {}", a.amount)
}

/// One handler on several routes, nested routers and two apps is one
/// handler: nothing is said of its scope.
#[tokio::test(flavor = "current_thread")]
async fn one_handler_on_many_routes_and_apps_says_nothing_of_its_scope() {
    // Installed before anything this test logs.
    let _ = idem_testkit::logs();
    let one = serve(
        &memory(),
        Router::new()
            .route("/a", post(pay_routed))
            .route("/b", post(pay_routed))
            .nest("/n", Router::new().route("/c", post(pay_routed))),
    )
    .await;
    let two = serve(&memory(), Router::new().route("/x", post(pay_routed))).await;
    for (addr, path) in [(one, "/a"), (one, "/b"), (one, "/n/c"), (two, "/x")] {
        let sent = send(addr, path, r#"{"amount": 1}"#, &format!("k-routed{path}")).await;
        assert_eq!(sent.status, 200, "{sent:?}");
    }
    assert_eq!(same_scope_said("routed.create"), Vec::<String>::new());
}

two_handlers_of_one_scope!("macro.create", pay_by_macro, refund_by_macro);

/// Two handlers of one scope written by one macro have their attributes on
/// one line: what is said names them apart by their names.
#[tokio::test(flavor = "current_thread")]
async fn handlers_of_one_scope_written_by_one_macro_are_named_apart() {
    // Installed before anything this test logs.
    let _ = idem_testkit::logs();
    let addr = serve(
        &memory(),
        Router::new()
            .route("/pay", post(pay_by_macro))
            .route("/refund", post(refund_by_macro)),
    )
    .await;
    send(addr, "/pay", r#"{"amount": 5}"#, "k-macro-1").await;
    send(addr, "/refund", r#"{"amount": 5}"#, "k-macro-2").await;
    let said = same_scope_said("macro.create");
    assert_eq!(said.len(), 1, "{said:?}");
    assert!(
        said[0].contains("handler=\"refund_by_macro\"") && said[0].contains("other=\"pay_by_macro\""),
        "{said:?}"
    );
}

/// A number other than zero whose double is zero keeps its exact value:
/// `1e-400` and `0` are two requests (a handler reading a decimal type
/// tells them apart), `1e-400` and `10e-401` one.
#[tokio::test]
async fn a_number_too_small_for_a_double_is_not_zero() {
    let addr = serve(&memory(), Router::new().route("/n", post(number))).await;
    assert_eq!(send(addr, "/n", "1e-400", "k-tiny").await.status, 200);
    assert!(replayed(&send(addr, "/n", "10e-401", "k-tiny").await));
    assert_eq!(send(addr, "/n", "0", "k-tiny").await.status, 422);
    assert_eq!(send(addr, "/n", "2e-400", "k-tiny").await.status, 422);
}

#[derive(serde::Deserialize, serde::Serialize)]
struct Rate {
    rate: f32,
    note: Option<String>,
}

#[idempotent(scope = "rate.set", fields(rate))]
async fn set_rate(Json(r): Json<Rate>) -> String {
    r.rate.to_string()
}

/// A declared `f32` counts alone, as the client wrote it: a changed
/// undeclared member replays, also for a decimal with more significant
/// digits than an `f32` holds (the value sent, read as an `f32`, is what
/// the handler read). Another spelling of the same `f32` is another request
/// (stricter, never looser).
#[tokio::test]
async fn a_declared_f32_counts_alone_as_the_client_wrote_it() {
    let addr = serve(&memory(), Router::new().route("/rate", post(set_rate))).await;
    let body = |rate: &str, note: &str| format!(r#"{{"rate": {rate}, "note": "{note}"}}"#);
    for rate in ["0.1", "4.99", "123.456", "0.123456789"] {
        let key = format!("k-{rate}");
        assert_eq!(send(addr, "/rate", &body(rate, "first"), &key).await.status, 200);
        let again = send(addr, "/rate", &body(rate, "second"), &key).await;
        assert!(replayed(&again), "{rate}: {again:?}");
    }
    let other_spelling = send(addr, "/rate", &body("0.12345679", "first"), "k-0.123456789").await;
    assert_eq!(other_spelling.status, 422, "{other_spelling:?}");
}

#[idempotent(scope = "account.touch", body = "none")]
async fn touch(method: axum::http::Method) -> String {
    format!("{method} ran")
}

#[derive(serde::Deserialize)]
struct Ratio {
    x: f64,
}

#[idempotent(scope = "ratio.set")]
async fn ratio(Json(r): Json<Ratio>) -> String {
    format!("inverse {}", 1.0 / r.x)
}

/// What the README says does not count, pinned: the method (one handler
/// routed for two methods is one scope), and the sign of a zero (RFC 8785
/// writes `-0.0` as `0`), though the handler tells each apart.
#[tokio::test]
async fn the_method_and_the_sign_of_a_zero_do_not_count() {
    let addr = serve(
        &memory(),
        Router::new()
            .route("/touch", axum::routing::get(touch).post(touch))
            .route("/ratio", post(ratio)),
    )
    .await;
    let first = post_req("/touch", "").key("k-method").send(addr).await;
    assert_eq!(first.body, b"POST ran");
    let other = idem_testkit::http::get("/touch").key("k-method").send(addr).await;
    assert!(replayed(&other), "{other:?}");
    assert_eq!(other.body, b"POST ran");
    let negative = send(addr, "/ratio", r#"{"x": -0.0}"#, "k-zero").await;
    assert_eq!(negative.body, b"inverse -inf");
    let positive = send(addr, "/ratio", r#"{"x": 0.0}"#, "k-zero").await;
    assert!(replayed(&positive), "{positive:?}");
    assert_eq!(positive.body, b"inverse -inf");
}

/// A declared field whose value is an object: serde writes its absent
/// `Option` members as `null`, where the client left them out.
mod nested {
    use super::*;

    #[derive(serde::Deserialize, serde::Serialize)]
    pub(crate) struct Recipient {
        pub(crate) account: String,
        pub(crate) bank: Option<String>,
    }

    #[derive(serde::Deserialize)]
    pub(crate) struct TransferIn {
        pub(crate) amount: i64,
        pub(crate) recipient: Recipient,
        #[allow(dead_code)]
        pub(crate) comment: Option<String>,
    }

    #[idempotent(scope = "transfer.create", fields(amount, recipient))]
    pub(crate) async fn transfer(Json(t): Json<TransferIn>) -> String {
        format!(
            "{} to {} at {:?}",
            t.amount, t.recipient.account, t.recipient.bank
        )
    }

    /// The same, before a deploy that added `bank`, which this client
    /// does not send.
    #[derive(serde::Deserialize, serde::Serialize)]
    pub(crate) struct RecipientBefore {
        pub(crate) account: String,
    }

    #[derive(serde::Deserialize)]
    pub(crate) struct TransferBefore {
        pub(crate) amount: i64,
        pub(crate) recipient: RecipientBefore,
    }

    #[idempotent(scope = "transfer.create", fields(amount, recipient))]
    pub(crate) async fn transfer_before(Json(t): Json<TransferBefore>) -> String {
        format!("{} to {} at None", t.amount, t.recipient.account)
    }

    /// A declared field read from another wire name than its path: the
    /// member at the path is not what the handler read.
    #[derive(serde::Deserialize)]
    pub(crate) struct Renamed {
        pub(crate) amount: i64,
        #[serde(rename = "to")]
        pub(crate) recipient: Recipient,
    }

    #[idempotent(scope = "transfer.renamed", fields(amount, recipient))]
    pub(crate) async fn renamed(Json(t): Json<Renamed>) -> String {
        format!(
            "{} to {} at {:?}",
            t.amount, t.recipient.account, t.recipient.bank
        )
    }

    /// A merge-patch map, read from another wire name than its path:
    /// `null` deletes a key.
    #[derive(serde::Deserialize)]
    pub(crate) struct Patch {
        pub(crate) amount: i64,
        #[serde(rename = "meta")]
        pub(crate) metadata: std::collections::BTreeMap<String, Option<String>>,
    }

    #[idempotent(scope = "patch.map", fields(amount, metadata))]
    pub(crate) async fn patch_map(Json(p): Json<Patch>) -> String {
        let deleted: Vec<&String> = p
            .metadata
            .iter()
            .filter(|(_, v)| v.is_none())
            .map(|(k, _)| k)
            .collect();
        format!("amount {} delete {:?}", p.amount, deleted)
    }

    fn cleared<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Option<String>>, D::Error> {
        <Option<String> as serde::Deserialize>::deserialize(d).map(Some)
    }

    /// Patch semantics: `bank` absent leaves it, `null` clears it.
    #[derive(serde::Deserialize, serde::Serialize)]
    pub(crate) struct RecipientPatch {
        pub(crate) account: String,
        #[serde(
            default,
            deserialize_with = "cleared",
            skip_serializing_if = "Option::is_none"
        )]
        pub(crate) bank: Option<Option<String>>,
    }

    #[derive(serde::Deserialize)]
    pub(crate) struct PatchRenamed {
        pub(crate) amount: i64,
        #[serde(rename = "to")]
        pub(crate) recipient: RecipientPatch,
    }

    #[idempotent(scope = "patch.recipient", fields(amount, recipient))]
    pub(crate) async fn patch_recipient(Json(t): Json<PatchRenamed>) -> String {
        match t.recipient.bank {
            None => format!("{} to {}: bank left", t.amount, t.recipient.account),
            Some(None) => format!("{} to {}: bank cleared", t.amount, t.recipient.account),
            Some(Some(b)) => format!("{} to {}: bank {b}", t.amount, t.recipient.account),
        }
    }

    /// After a deploy that added a defaulted member, which this client
    /// does not send.
    #[derive(serde::Deserialize, serde::Serialize)]
    pub(crate) struct RecipientTagged {
        pub(crate) account: String,
        #[serde(default)]
        pub(crate) tags: Vec<String>,
    }

    #[derive(serde::Deserialize)]
    pub(crate) struct TransferTagged {
        pub(crate) amount: i64,
        pub(crate) recipient: RecipientTagged,
    }

    #[idempotent(scope = "transfer.create", fields(amount, recipient))]
    pub(crate) async fn transfer_tagged(Json(t): Json<TransferTagged>) -> String {
        format!("{} to {} at None", t.amount, t.recipient.account)
    }

    /// A card whose number its type never writes.
    #[derive(serde::Deserialize, serde::Serialize)]
    pub(crate) struct Card {
        pub(crate) last4: String,
        #[serde(skip_serializing)]
        pub(crate) number: String,
    }

    /// Read from `paymentCard`, declared at `payment_card`.
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    pub(crate) struct Charge {
        pub(crate) amount: i64,
        pub(crate) payment_card: Card,
    }

    #[idempotent(scope = "charge.create", fields(amount, payment_card))]
    pub(crate) async fn charge(Json(c): Json<Charge>) -> String {
        format!("charged {} to card {}", c.amount, c.payment_card.number)
    }
}

/// A declared object whose optional member the client leaves out is still
/// its declared value: a retry that changes an undeclared member replays.
#[tokio::test]
async fn a_declared_object_without_its_optional_members_keeps_undeclared_fields_out() {
    let store = memory();
    let addr = serve(&store, Router::new().route("/transfers", post(nested::transfer))).await;
    let first = r#"{"amount": 5, "recipient": {"account": "acct_bob"}, "comment": "first"}"#;
    let a = send(addr, "/transfers", first, "k-nested").await;
    assert_eq!(a.status, 200, "{}", String::from_utf8_lossy(&a.body));
    let retry = r#"{"comment": "second", "recipient": {"account": "acct_bob"}, "amount": 5}"#;
    let b = send(addr, "/transfers", retry, "k-nested").await;
    assert_eq!(
        (b.status, b.body.clone(), replayed(&b)),
        (200, a.body.clone(), true),
        "{}",
        String::from_utf8_lossy(&b.body)
    );
    // The declared object still counts, member by member.
    let other_bank =
        r#"{"amount": 5, "recipient": {"account": "acct_bob", "bank": "B"}, "comment": "first"}"#;
    let c = send(addr, "/transfers", other_bank, "k-nested").await;
    assert_eq!(c.status, 422, "{}", String::from_utf8_lossy(&c.body));
    // A member sent as `null` is sent: another request than one without it
    // (stricter, never looser).
    let null_bank = r#"{"amount": 5, "recipient": {"account": "acct_bob", "bank": null}}"#;
    let d = send(addr, "/transfers", null_bank, "k-nested").await;
    assert_eq!(d.status, 422, "{}", String::from_utf8_lossy(&d.body));
}

/// A deploy that adds a member to a declared object, which the client does
/// not send, keeps the request's fingerprint: an `Option` (serde writes it
/// as `null`) or a defaulted member (the value sent, read as the new type
/// reads it, is what the handler read).
#[tokio::test]
async fn a_deploy_that_adds_a_member_the_client_does_not_send_replays() {
    let added = [
        (
            Router::new().route("/", post(nested::transfer)),
            "k-deploy-option",
        ),
        (
            Router::new().route("/", post(nested::transfer_tagged)),
            "k-deploy-default",
        ),
    ];
    for (after, key) in added {
        let before = Router::new().route("/", post(nested::transfer_before));
        let body = r#"{"amount": 5, "recipient": {"account": "acct_bob"}}"#;
        replays_across_a_deploy(&memory(), before, after, body, key).await;
    }
}

/// Where the handler read a member that the value at the declared path
/// lacks (the field is read from another wire name), the whole body
/// counts, and a change to what it read is another request.
#[tokio::test]
async fn a_declared_object_read_from_elsewhere_makes_the_whole_body_count() {
    let addr = serve(&memory(), Router::new().route("/r", post(nested::renamed))).await;
    let first =
        r#"{"amount": 5, "to": {"account": "acct_bob", "bank": "A"}, "recipient": {"account": "acct_bob"}}"#;
    ran(addr, "/r", first, "k-renamed").await;
    let other =
        r#"{"amount": 5, "to": {"account": "acct_bob", "bank": "B"}, "recipient": {"account": "acct_bob"}}"#;
    refused(addr, "/r", other, "k-renamed").await;
}

/// A map of `Option`s read from another wire name than its path: a `null`
/// entry the handler read (a key to delete) that the map at the path lacks
/// makes the whole body count, never the first request's replay.
#[tokio::test]
async fn a_null_the_handler_read_from_elsewhere_is_another_request() {
    let store = memory();
    let addr = serve(&store, Router::new().route("/patch", post(nested::patch_map))).await;
    ran(
        addr,
        "/patch",
        r#"{"amount": 5, "meta": {}, "metadata": {}}"#,
        "k-map",
    )
    .await;
    let deleting = r#"{"amount": 5, "meta": {"tier": null}, "metadata": {}}"#;
    refused(addr, "/patch", deleting, "k-map").await;
    // The same with a patch's double option: left (absent) against cleared
    // (`null`), the object at the declared path the same.
    let addr = serve(&store, Router::new().route("/r", post(nested::patch_recipient))).await;
    let left = r#"{"amount": 5, "to": {"account": "acct_bob"}, "recipient": {"account": "acct_bob"}}"#;
    ran(addr, "/r", left, "k-double").await;
    let cleared =
        r#"{"amount": 5, "to": {"account": "acct_bob", "bank": null}, "recipient": {"account": "acct_bob"}}"#;
    refused(addr, "/r", cleared, "k-double").await;
}

mod wide {
    use super::*;

    #[derive(serde::Deserialize)]
    pub(crate) struct AsInteger {
        pub(crate) amount: i64,
    }

    #[idempotent(scope = "wide.amount", fields(amount))]
    pub(crate) async fn as_integer(Json(p): Json<AsInteger>) -> String {
        format!("charged {}", p.amount)
    }

    #[derive(serde::Deserialize)]
    pub(crate) struct AsFloat {
        pub(crate) amount: f64,
    }

    #[idempotent(scope = "wide.amount", fields(amount))]
    pub(crate) async fn as_float(Json(p): Json<AsFloat>) -> String {
        format!("charged {}", p.amount)
    }
}

/// An integer past 2^53, declared `i64`, then `f64` after a deploy: the
/// value sent counts in both, and the retry replays; another integer that
/// the `f64` reads as the same double is another request.
#[tokio::test]
async fn an_integer_past_2_pow_53_keeps_its_fingerprint_from_i64_to_f64() {
    let store = memory();
    let before = serve(&store, Router::new().route("/a", post(wide::as_integer))).await;
    let after = serve(&store, Router::new().route("/a", post(wide::as_float))).await;
    let a = ran(
        before,
        "/a",
        r#"{"amount": 9007199254740993, "note": "x"}"#,
        "k-wide",
    )
    .await;
    let b = send(
        after,
        "/a",
        r#"{"note": "y", "amount": 9007199254740993}"#,
        "k-wide",
    )
    .await;
    assert_eq!(
        (b.status, b.body.clone(), replayed(&b)),
        (200, a.body, true),
        "{b:?}"
    );
    refused(
        after,
        "/a",
        r#"{"amount": 9007199254740992, "note": "x"}"#,
        "k-wide",
    )
    .await;
}

/// A member of the value sent that the handler's value never shows (its
/// type skips it when writing) may stand for another member the handler
/// read: where the field is read from another wire name, the value at the
/// declared path does not count for it, and another card is another
/// request.
#[tokio::test]
async fn a_member_the_type_never_writes_does_not_stand_for_the_one_read() {
    let addr = serve(&memory(), Router::new().route("/c", post(nested::charge))).await;
    let card = |number: &str| {
        format!(
            r#"{{"amount": 5, "paymentCard": {{"last4": "4242", "number": "{number}"}}, "payment_card": {{"last4": "4242", "number": "x"}}}}"#
        )
    };
    ran(addr, "/c", &card("4000000000004242"), "k-card").await;
    refused(addr, "/c", &card("5555555555554242"), "k-card").await;
}
