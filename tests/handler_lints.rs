//! Handlers that clippy accepts without the attribute are accepted with it:
//! what the expansion adds (idem's own parameters, the extractor that keeps
//! the body's bytes) raises no lint of clippy's defaults on the handler's
//! code. CI's `cargo clippy --all-targets -- -D warnings` lints this file;
//! the test below serves each handler and replays it.

use axum::extract::{OriginalUri, Path, Query, State};
use axum::http::{HeaderMap, Method, Uri};
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Idem};
use idem_testkit::http::{post as post_req, serve};
use std::collections::HashMap;

type Params = Query<HashMap<String, String>>;

/// Seven parameters, clippy's limit: idem's two more take the expansion
/// past it.
#[idempotent(scope = "lints.seven")]
async fn seven(
    State(s): State<u8>,
    Path(p): Path<String>,
    _q: Params,
    _h: HeaderMap,
    _m: Method,
    _u: Uri,
    Json(b): Json<u8>,
) -> String {
    format!("seven {s} {p} {b}")
}

/// Six head-only parameters: idem adds its context and a last extractor
/// that reads no body.
#[idempotent(scope = "lints.six_head")]
async fn six_head(
    State(s): State<u8>,
    Path(p): Path<String>,
    _q: Params,
    _h: HeaderMap,
    _m: Method,
    _u: Uri,
) -> String {
    format!("six {s} {p}")
}

/// Eight: clippy's lint holds without the attribute, so the handler's own
/// expectation of it must hold with it.
#[idempotent(scope = "lints.eight")]
#[expect(clippy::too_many_arguments)]
async fn eight(
    State(s): State<u8>,
    Path(p): Path<String>,
    _q: Params,
    _h: HeaderMap,
    _m: Method,
    _u: Uri,
    _o: OriginalUri,
    Json(b): Json<u8>,
) -> String {
    format!("eight {s} {p} {b}")
}

/// A body type just under clippy's type complexity (230 of 250): the
/// extractor idem puts around it must not take it over.
#[idempotent(scope = "lints.complex")]
async fn complex(Json(b): Json<HashMap<String, Vec<(String, u8)>>>) -> String {
    format!("complex {}", b.len())
}

#[tokio::test]
async fn handlers_past_clippys_limits_only_by_idems_parameters_serve_and_replay() {
    let app = Router::new()
        .route("/seven/{p}", post(seven))
        .route("/six/{p}", post(six_head))
        .route("/eight/{p}", post(eight))
        .route("/complex", post(complex))
        .with_state(3u8)
        .layer(Idem::new(idem::MemoryStore::new()).single_tenant().layer());
    let addr = serve(app).await;
    for (path, body, answer) in [
        ("/seven/a", "5", "seven 3 a 5"),
        ("/six/b", "", "six 3 b"),
        ("/eight/c", "6", "eight 3 c 6"),
        ("/complex", r#"{"x": [["y", 1]]}"#, "complex 1"),
    ] {
        let first = post_req(path, body).key(path).send(addr).await;
        assert_eq!(
            (first.status, &first.body[..]),
            (200, answer.as_bytes()),
            "{path}"
        );
        let again = post_req(path, body).key(path).send(addr).await;
        assert_eq!(
            (again.status, &again.body[..]),
            (200, answer.as_bytes()),
            "{path}"
        );
        assert_eq!(again.header("idempotent-replayed"), Some("true"), "{path}");
    }
}
