//! Settings that would disable or break the protection are refused where
//! they are set, with the allowed range; the attribute checks the same
//! ranges at compile time.

use idem::{Idem, MemoryStore, LOCK_TIMEOUT_RANGE, MAX_STORED_BODY_LIMIT, TTL_RANGE};
use std::time::Duration;

fn idem() -> Idem {
    Idem::new(MemoryStore::new())
}

#[test]
fn each_invalid_setting_is_refused_with_its_range() {
    let err = |r: Result<Idem, idem::ConfigError>| r.unwrap_err().to_string();
    assert!(err(idem().ttl(Duration::ZERO)).contains("allowed: 1s to 365d"));
    assert!(err(idem().ttl(Duration::from_secs(366 * 86_400))).contains("allowed: 1s to 365d"));
    assert!(err(idem().lock_timeout(Duration::ZERO)).contains("allowed: 100ms to 1d"));
    assert!(err(idem().lock_timeout(Duration::from_millis(99))).contains("allowed: 100ms to 1d"));
    assert!(err(idem().max_stored_body(MAX_STORED_BODY_LIMIT + 1)).contains("0 to 67108864"));
    assert!(err(idem().replay_headers(["authorization"])).contains("never stored"));
    assert!(err(idem().replay_headers(["bad header"])).contains("not a header name"));
    assert!(err(idem().problem_type_base("")).contains("URI prefix"));
    assert!(idem().ttl(*TTL_RANGE.start()).is_ok() && idem().ttl(*TTL_RANGE.end()).is_ok());
    assert!(idem().lock_timeout(*LOCK_TIMEOUT_RANGE.start()).is_ok());
    assert!(idem().max_stored_body(0).is_ok() && idem().max_stored_body(MAX_STORED_BODY_LIMIT).is_ok());
}

/// What the README calls "the like" of the never-stored headers, refused
/// too: older cookies and authentication answers; and a problem base a URI
/// cannot hold as it is.
#[test]
fn cookie_like_headers_and_bases_no_uri_holds_are_refused() {
    for name in [
        "set-cookie2",
        "Cookie2",
        "authentication-info",
        "proxy-authentication-info",
    ] {
        let refused = idem().replay_headers([name]).map(|_| ()).unwrap_err().to_string();
        assert!(refused.contains("never stored"), "{name}: {refused}");
    }
    for base in [
        "https://docs.example.com/<errors>/",
        "https://docs.example.com/\"e\"/",
        "https://docs.example.com/{e}/",
        "https://docs.example.com/a|b/",
        "https://docs.example.com\\e/",
        "https://dócs.example.com/",
        "\u{200b}https://docs.example.com/",
        "https://docs.example.com/100%/",
        "https://docs.example.com/%zz/",
        "https://docs.example.com/%",
        "https://docs.example.com/%4",
    ] {
        let refused = idem()
            .problem_type_base(base)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(refused.contains("URI prefix"), "{base:?}: {refused}");
    }
    for base in [
        "urn:example:problem:",
        "https://docs.example.com/errors/",
        "https://d.example/%C3%A9/?t=",
    ] {
        assert!(idem().problem_type_base(base).is_ok(), "{base}");
    }
}

/// Outside a Tokio runtime the janitor cannot start: an error, not a panic.
#[test]
fn the_janitor_outside_a_runtime_is_an_error() {
    let refused = idem()
        .start_janitor(Duration::from_secs(60), 100)
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(refused.contains("outside a Tokio runtime"), "{refused}");
}

#[tokio::test]
async fn the_janitor_refuses_a_zero_batch_or_period() {
    assert!(idem().start_janitor(Duration::ZERO, 10).is_err());
    assert!(idem().start_janitor(Duration::from_secs(60), 0).is_err());
    assert!(idem().start_janitor(Duration::from_secs(60), 500).is_ok());
}

#[idem::idempotent(scope = "order.place")]
async fn place() -> (axum::http::StatusCode, &'static str) {
    (axum::http::StatusCode::CREATED, "placed")
}

/// A SQL store's timeout of `Duration::MAX` ("no bound") bounds nothing:
/// the request is reserved, answered and replayed on both SQL stores, as
/// with any other timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_timeout_of_duration_max_bounds_nothing() {
    use idem::IdempotencyStore;
    use idem_testkit::http::{post, serve};
    let (sqlite, _dir) = idem_testkit::sqlite_store().await;
    let mut stores: Vec<(&str, std::sync::Arc<dyn IdempotencyStore>)> =
        vec![("sqlite", std::sync::Arc::new(sqlite.with_timeout(Duration::MAX)))];
    if let Some(pg) = idem_testkit::pg_store().await {
        stores.push(("postgres", std::sync::Arc::new(pg.with_timeout(Duration::MAX))));
    }
    for (name, store) in stores {
        let router = axum::Router::new()
            .route("/orders", axum::routing::post(place))
            .layer(Idem::from_arc(store).single_tenant().layer());
        let addr = serve(router).await;
        for replayed in [None, Some("true")] {
            let r = post("/orders", "").key("k-max").send(addr).await;
            assert_eq!(
                (r.status, r.body.as_slice(), r.header("idempotent-replayed")),
                (201, &b"placed"[..], replayed),
                "{name}: {r:?}"
            );
        }
    }
}

/// Names and URLs that would send idem's records elsewhere than they read:
/// a second `mode` after `mode=memory` (sqlx keeps the database in memory,
/// so a file's records were lost at every restart, and a retry ran again),
/// a URL of another scheme given to SQLite (read as a file's name: a store
/// "down", or a file made in the working directory), a table name SQLite
/// keeps for itself, and PostgreSQL's own schemas (where a superuser's
/// `migrate()` wrote idem's tables): each refused where it is given, as
/// a configuration error (not a store that is down).
#[tokio::test]
async fn names_and_urls_that_send_records_elsewhere_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("idem.db");
    for (url, says) in [
        (
            format!("sqlite://{}?mode=memory&mode=rwc", file.display()),
            "mode is given more than once",
        ),
        (
            format!("sqlite://{}?mode=rwc&mode=rwc", file.display()),
            "mode is given more than once",
        ),
        ("postgres://postgres@127.0.0.1/test".to_owned(), "another store's"),
        ("SQLITE://idem.db".to_owned(), "must start with sqlite:"),
        ("idem.db".to_owned(), "must start with sqlite:"),
    ] {
        let err = idem::SqliteStore::open_url(&url).await.unwrap_err();
        assert!(
            !err.is_unavailable() && err.to_string().contains(says),
            "{url}: {err}"
        );
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "no file made");
    let store = idem::SqliteStore::open_url(&format!("sqlite://{}?mode=rwc", file.display()))
        .await
        .unwrap();
    for table in ["sqlite_keys", "SQLite_Keys"] {
        let Err(err) = store.clone().with_table(table) else {
            panic!("{table} taken")
        };
        assert!(err.to_string().contains("SQLite's own"), "{table}: {err}");
    }
    let pool = sqlx::postgres::PgPoolOptions::new()
        .connect_lazy("postgres://127.0.0.1/x")
        .unwrap();
    for schema in ["information_schema", "pg_catalog", "pg_temp"] {
        let Err(err) = idem::PgStore::new(pool.clone()).with_table(Some(schema), "keys") else {
            panic!("{schema} taken")
        };
        assert!(err.to_string().contains("PostgreSQL's own"), "{schema}: {err}");
    }
    assert!(idem::PgStore::new(pool)
        .with_table(Some("Pg_Keys"), "keys")
        .is_ok());
}
