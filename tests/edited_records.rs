//! A completed record edited by hand in the database, on SQLite and
//! PostgreSQL: each retry of its key gets either the documented replay (a
//! `NULL` headers column or body) or a 503 `idempotency-store-unavailable`
//! problem, never part of the stored answer, and the handler never runs
//! again.

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use idem::{idempotent, Idem, Operation};
use idem_testkit::http::{post as post_req, serve, Reply};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

#[derive(Clone, Default)]
struct Runs(Arc<Mutex<HashMap<String, u32>>>);

#[idempotent(scope = "edited.answer")]
async fn answer(State(runs): State<Runs>, op: Operation) -> Response {
    *runs.0.lock().unwrap().entry(op.key().to_owned()).or_default() += 1;
    (
        StatusCode::CREATED,
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::LOCATION, "/payments/1"),
        ],
        r#"{"id":"pay_1","amount":100}"#,
    )
        .into_response()
}

/// Each edit of the completed record (a SQL assignment), and whether its
/// retry is still replayed (else refused 503).
const EDITS: &[(&str, &str, bool)] = &[
    ("headers-not-json", "response_headers = 'not json'", false),
    ("headers-object", r#"response_headers = '{"a":1}'"#, false),
    (
        "headers-wide-char",
        r#"response_headers = '[["content-type","\u0100"]]'"#,
        false,
    ),
    (
        "headers-newline-in-value",
        r#"response_headers = '[["location","/a\nb"]]'"#,
        false,
    ),
    (
        "headers-bad-name",
        r#"response_headers = '[["bad name","x"],["location","/p"]]'"#,
        false,
    ),
    ("status-null", "response_status = NULL", false),
    ("status-negative", "response_status = -1", false),
    ("status-0", "response_status = 0", false),
    ("status-99", "response_status = 99", false),
    ("status-150", "response_status = 150", false),
    ("status-1000", "response_status = 1000", false),
    ("status-70000", "response_status = 70000", false),
    // Documented: the answer without headers, and the body-omitted form.
    ("headers-null", "response_headers = NULL", true),
    ("body-null", "response_body = NULL", true),
];

/// Completes a key per edit, edits its record with `edit` (the key, the
/// assignment), and checks its retry.
async fn each_edit<F, Fut>(addr: SocketAddr, runs: &Runs, edit: F)
where
    F: Fn(String, &'static str) -> Fut,
    Fut: std::future::Future<Output = u64>,
{
    for (name, set, replayed) in EDITS {
        let key = format!("k-{name}");
        let first = post_req("/a", "{}").key(&key).send(addr).await;
        assert_eq!(first.status, 201, "{name}: {first:?}");
        assert_eq!(
            edit(key.clone(), set).await,
            1,
            "{name}: the record was not edited"
        );
        let again: Reply = post_req("/a", "{}").key(&key).send(addr).await;
        assert_eq!(runs.0.lock().unwrap()[&key], 1, "{name}: the handler ran again");
        if *replayed {
            assert_eq!(
                (again.status, again.header("idempotent-replayed")),
                (201, Some("true")),
                "{name}: {again:?}"
            );
        } else {
            assert_eq!(
                (again.status, again.problem().as_str()),
                (503, "idempotency-store-unavailable"),
                "{name}: {again:?}"
            );
            assert_eq!(again.header("idempotent-replayed"), None, "{name}");
            assert_eq!(again.header("location"), None, "{name}: part of the answer given");
        }
    }
}

async fn serve_on(store: Arc<dyn idem::IdempotencyStore>, runs: &Runs) -> SocketAddr {
    let router = Router::new()
        .route("/a", post(answer))
        .layer(Idem::from_arc(store).single_tenant().layer())
        .with_state(runs.clone());
    serve(router).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_an_edited_answer_is_replayed_as_stored_or_refused() {
    let (store, _dir) = idem_testkit::sqlite_store().await;
    let pool = store.pool().clone();
    let runs = Runs::default();
    let addr = serve_on(Arc::new(store), &runs).await;
    each_edit(addr, &runs, |key, set| {
        let (pool, sql) = (
            pool.clone(),
            format!("UPDATE idempotency_keys SET {set} WHERE key = ?1"),
        );
        async move {
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(key)
                .execute(&pool)
                .await
                .unwrap()
                .rows_affected()
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_an_edited_answer_is_replayed_as_stored_or_refused() {
    let Some(store) = idem_testkit::pg_store().await else {
        return;
    };
    // Every retry read from the database, not from the second a process
    // keeps an answer it read.
    let store = store.with_replay_cache(std::time::Duration::ZERO);
    let table = idem_testkit::records::pg_table(&store);
    let pool = store.pool().clone();
    let runs = Runs::default();
    let addr = serve_on(Arc::new(store), &runs).await;
    each_edit(addr, &runs, |key, set| {
        let (pool, sql) = (pool.clone(), format!("UPDATE {table} SET {set} WHERE key = $1"));
        async move {
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(key)
                .execute(&pool)
                .await
                .unwrap()
                .rows_affected()
        }
    })
    .await;
}
