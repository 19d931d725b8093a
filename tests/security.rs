//! Security properties as tests: credentials are never stored or replayed,
//! logs never carry a raw key or body, and every SQL value is bound (keys
//! and tenants that look like SQL are data). Tenant isolation is
//! tests/http_protocol.rs `tenants_and_scopes_with_the_same_key_are_isolated`
//! and tests/store_conformance.rs `isolates_tenants_and_scopes`; the stored
//! body limit is tests/lease.rs `bodies_at_the_limit_are_stored_and_one_byte_more_is_not`.

use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Idem, IdempotencyStore, Tenant};
use idem_testkit::http::{post as req, serve};
use idem_testkit::logs;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(serde::Deserialize, serde::Serialize)]
struct In {
    note: String,
}

#[idempotent(scope = "secure.create")]
async fn create(Json(i): Json<In>) -> (StatusCode, HeaderMap, String) {
    let mut h = HeaderMap::new();
    h.insert(
        header::SET_COOKIE,
        HeaderValue::from_static("session=SECRET-COOKIE"),
    );
    h.insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer realm=SECRET-REALM"),
    );
    h.insert(header::LOCATION, HeaderValue::from_static("/v1/things/1"));
    (StatusCode::CREATED, h, format!("created {}", i.note.len()))
}

#[idempotent(scope = "secure.panic")]
async fn explode(Json(i): Json<In>) -> String {
    if !i.note.is_empty() {
        panic!("a handler failure");
    }
    String::new()
}

/// Routes under a layer whose tenant comes from the `x-tenant` header.
fn router(store: Arc<dyn IdempotencyStore>) -> Router {
    Router::new()
        .route("/things", post(create))
        .route("/explode", post(explode))
        .layer(axum::middleware::from_fn(
            |mut r: axum::extract::Request, next: axum::middleware::Next| async move {
                let t = match r
                    .headers()
                    .get("x-tenant")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("t")
                {
                    // What an auth layer might put there, that no header can carry.
                    "NUL" => "acct\0x".to_owned(),
                    "LONG" => "x".repeat(10_000),
                    "EMPTY" => String::new(),
                    t => t.to_owned(),
                };
                r.extensions_mut().insert(Tenant::new(t));
                next.run(r).await
            },
        ))
        .layer(Idem::from_arc(store).layer())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_records_hold_no_credentials_and_replays_set_no_cookie() {
    logs();
    let (store, _dir) = idem_testkit::sqlite_store().await;
    let addr = serve(router(Arc::new(store.clone()))).await;
    let send = || async move {
        req("/things", r#"{"note":"hello"}"#)
            .key("k-cred")
            .header("authorization", "Bearer SECRET-TOKEN")
            .header("cookie", "session=SECRET-REQUEST-COOKIE")
            .send(addr)
            .await
    };
    let first = send().await;
    assert_eq!(first.status, 201);
    assert_eq!(first.header("set-cookie"), Some("session=SECRET-COOKIE"));
    let replay = send().await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.header("set-cookie"), None);
    assert_eq!(replay.header("www-authenticate"), None);
    assert_eq!(replay.header("location"), Some("/v1/things/1"));
    let rows: Vec<(Option<String>, Option<Vec<u8>>, String)> =
        sqlx::query_as("SELECT response_headers, response_body, fingerprint FROM idempotency_keys")
            .fetch_all(store.pool())
            .await
            .unwrap();
    assert_eq!(rows.len(), 1);
    let (headers, body, fingerprint) = &rows[0];
    let stored = format!(
        "{} {} {fingerprint}",
        headers.as_deref().unwrap_or_default(),
        String::from_utf8_lossy(body.as_deref().unwrap_or_default())
    );
    for secret in [
        "SECRET",
        "set-cookie",
        "authorization",
        "cookie",
        "www-authenticate",
    ] {
        assert!(
            !stored.to_ascii_lowercase().contains(&secret.to_ascii_lowercase()),
            "{secret} in {stored}"
        );
    }
}

/// No byte of a request's body is stored, on either SQL store: the body's
/// text is in no column of its record (nor anywhere in SQLite's files),
/// though the answer is stored and replayed; and a record is kept for the
/// default retention, 24 hours.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_holds_no_request_body_and_is_kept_24_hours_by_default() {
    const MARK: &str = "RAW-BODY-7F3A9C";
    let body = format!(r#"{{"note":"{MARK}"}}"#);
    let day_ms = 24 * 3600 * 1000;
    let send = |addr| {
        let body = body.clone();
        async move {
            let first = req("/things", &body).key("k-raw").send(addr).await;
            assert_eq!(first.status, 201, "{first:?}");
            let replay = req("/things", &body).key("k-raw").send(addr).await;
            assert_eq!(replay.header("idempotent-replayed"), Some("true"));
            assert_eq!(replay.body, first.body);
            // The answer says how long the note was, never the note.
            assert!(!String::from_utf8_lossy(&first.body).contains(MARK));
        }
    };

    let (store, dir) = idem_testkit::sqlite_store().await;
    send(serve(router(Arc::new(store.clone()))).await).await;
    let kept: i64 = sqlx::query_scalar("SELECT expires_at - created_at FROM idempotency_keys")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(kept, day_ms);
    let mut files = 0;
    for file in std::fs::read_dir(dir.path()).unwrap() {
        let bytes = std::fs::read(file.unwrap().path()).unwrap();
        files += 1;
        assert!(
            !bytes.windows(MARK.len()).any(|w| w == MARK.as_bytes()),
            "the body's text is in SQLite's files"
        );
    }
    assert!(files >= 1);

    let Some(url) = idem_testkit::pg_url() else {
        return;
    };
    let schema = idem_testkit::pg_schema(&url).await;
    let store = idem_testkit::pg_store_in(&url, &schema, 4).await;
    send(serve(router(Arc::new(store.clone()))).await).await;
    // The whole row as text (`bytea` as hex), and the stored body as text.
    let (row, answer, kept): (String, String, f64) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT t::text, convert_from(response_body, 'UTF8'), \
         extract(epoch FROM expires_at - created_at)::float8 * 1000 FROM \"{schema}\".idempotency_keys t"
    )))
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert!(answer.starts_with("created "), "{answer}");
    let hex: String = MARK.bytes().map(|b| format!("{b:02x}")).collect();
    assert!(!row.contains(MARK) && !row.contains(&hex), "{row}");
    assert_eq!(kept, day_ms as f64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_never_carry_a_raw_key_or_body() {
    let captured = logs();
    async {
        let (store, _dir) = idem_testkit::sqlite_store().await;
        let addr = serve(router(Arc::new(store))).await;
        let body = r#"{"note":"SECRET-BODY-TEXT"}"#;
        let key = "SECRET-KEY-0451";
        for (path, body) in [
            ("/things", body),
            ("/things", body),
            ("/things", r#"{"note":"SECRET-BODY-OTHER"}"#),
            ("/things", r#"{"note":"SECRET-BODY-DUP","note":"x"}"#),
            ("/explode", body),
        ] {
            let r = req(path, body).key(key).send(addr).await;
            assert!(r.status < 600);
        }
        // A store that is down logs its failure, not the request.
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = closed.local_addr().unwrap().port();
        drop(closed);
        let down = idem::PgStore::connect(&format!("postgres://postgres@127.0.0.1:{port}/test"))
            .unwrap()
            .with_timeout(Duration::from_millis(200));
        let addr = serve(router(Arc::new(down))).await;
        let r = req("/things", body).key(key).send(addr).await;
        assert_eq!(r.status, 503);
    }
    .await;
    let logs = captured.text();
    assert!(logs.contains("panicked"), "the capture works: {logs}");
    assert!(!logs.contains("SECRET-KEY"), "a raw key in the logs:\n{logs}");
    assert!(!logs.contains("SECRET-BODY"), "a body in the logs:\n{logs}");
}

/// One span per protected request: scope, outcome and a short hash of the
/// key; never the raw key, which clients sometimes fill with personal data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_span_names_scope_outcome_and_a_key_hash_but_never_the_key() {
    let captured = logs();
    let addr = serve(router(Arc::new(idem::MemoryStore::new()))).await;
    let key = "jane.doe@example.com";
    let send = |note: &'static str| async move { req("/things", note).key(key).send(addr).await };
    assert_eq!(send(r#"{"note":"a"}"#).await.status, 201);
    let replay = send(r#"{"note":"a"}"#).await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(send(r#"{"note":"b"}"#).await.status, 422);
    let hash = idem::key::IdempotencyKey::parse(key.as_bytes())
        .unwrap()
        .log_hash();
    let span_of = |log: &str, outcome: &str| {
        log.lines().any(|l| {
            l.contains("idem{")
                && l.contains("scope=\"secure.create\"")
                && l.contains(&format!("key={hash}"))
                && l.contains(&format!("outcome=\"{outcome}\""))
        })
    };
    // A span's line is written once every handle on it is dropped (the
    // execution's task holds one), which need not come before the client
    // has read the answer.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut log = captured.text();
    while !["executed", "replayed", "mismatch"]
        .iter()
        .all(|o| span_of(&log, o))
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
        log = captured.text();
    }
    assert!(!log.contains("jane.doe"), "{log}");
    for outcome in ["executed", "replayed", "mismatch"] {
        assert!(span_of(&log, outcome), "{outcome}: {log}");
    }
}

idem_testkit::for_each_store! {
    stores: [memory, sqlite, postgres],
    setup: |kind| ({
        logs();
        kind.fixture().await
    }),
    worker_threads: 2,
    cases: [keys_and_tenants_that_look_like_sql_are_data, tenants_no_store_can_key_are_refused_alike],
}

/// A tenant id with a NUL, of 10,000 bytes, or empty cannot key a record on
/// every store (PostgreSQL refuses a NUL and an index row past 8 kB): it is
/// the auth layer's bug, refused with 500 before any store call, the same
/// way everywhere, never a 503 that asks for retries that cannot succeed.
async fn tenants_no_store_can_key_are_refused_alike(f: idem_testkit::Fixture) {
    let addr = serve(router(f.store.clone())).await;
    for tenant in ["NUL", "LONG", "EMPTY"] {
        let r = req("/things", r#"{"note":"a"}"#)
            .key("k-tenant")
            .header("x-tenant", tenant)
            .send(addr)
            .await;
        assert_eq!(
            (r.status, r.problem().as_str()),
            (500, "idempotency-misconfigured"),
            "{tenant}"
        );
    }
    // Nothing was stored: the key is free for a valid tenant.
    let ok = req("/things", r#"{"note":"a"}"#)
        .key("k-tenant")
        .header("x-tenant", "acct_ok")
        .send(addr)
        .await;
    assert_eq!(ok.status, 201);
    assert_eq!(f.store.purge_expired(100).await.unwrap(), 0);
}

async fn keys_and_tenants_that_look_like_sql_are_data(f: idem_testkit::Fixture) {
    let addr = serve(router(f.store.clone())).await;
    let key = "';DROP/**/TABLE/**/idempotency_keys;--";
    let tenant = "t'); DELETE FROM idempotency_keys; --";
    let send = |note: &'static str| async move {
        req("/things", note)
            .key(key)
            .header("x-tenant", tenant)
            .send(addr)
            .await
    };
    let first = send(r#"{"note":"a"}"#).await;
    assert_eq!(first.status, 201);
    let replay = send(r#"{"note":"a"}"#).await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    let other = send(r#"{"note":"b"}"#).await;
    assert_eq!(other.status, 422);
    // The table is intact and holds the record under that tenant and key.
    let id = idem::store::RecordId::new(tenant, "secure.create", key);
    let req = idem::store::ReserveRequest {
        id: &id,
        fingerprint: "another",
        token: idem_testkit::token(),
        ttl: Duration::from_secs(60),
        lock_timeout: Duration::from_secs(5),
    };
    assert_eq!(
        f.store.reserve(req).await.unwrap(),
        idem::store::Reservation::Mismatch
    );
}
