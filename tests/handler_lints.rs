//! What clippy says of an annotated handler. The extractor that keeps the
//! body's bytes is the macro's, not the handler's: a body type clippy
//! accepts alone is accepted under the attribute. idem's own parameters
//! (its context, and `NoBody` without a body) count toward clippy's
//! `too_many_arguments`, as the README says: a handler they take past the
//! limit carries its own `#[allow]` (or `#[expect]`), which the expansion
//! keeps. CI's `cargo clippy --all-targets -- -D warnings` lints this
//! file; the test below serves each handler and replays it.

use axum::extract::{OriginalUri, Path, Query, State};
use axum::http::{HeaderMap, Method, Uri};
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Idem};
use idem_testkit::http::{post as post_req, serve};
use std::collections::HashMap;

type Params = Query<HashMap<String, String>>;

/// Seven parameters, clippy's limit: idem's context takes the expansion
/// past it, and the handler's own `allow` holds for it.
#[idempotent(scope = "lints.seven")]
#[allow(clippy::too_many_arguments)]
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
/// that reads no body, and the handler's own `expect` holds.
#[idempotent(scope = "lints.six_head")]
#[expect(clippy::too_many_arguments)]
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

/// Eight: clippy's lint holds without the attribute, and the handler's
/// own expectation of it holds with it.
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
async fn handlers_with_their_own_lint_attributes_serve_and_replay() {
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
