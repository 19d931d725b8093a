// `body = "none"` on a handler whose last parameter reads the body under a
// name idem cannot tell: axum refuses it, since idem's own extractor comes
// last and leaves only the request's head to the handler's parameters.
use axum::{routing::post, Json, Router};
use idem::idempotent;

type Body = Json<serde_json::Value>;

#[idempotent(scope = "payment.create", body = "none")]
async fn create(Json(_v): Body) {}

// The same under the name of a head extractor, with or without
// `body = "none"`: idem fingerprints no body, so axum must refuse it.
type Parts = Json<serde_json::Value>;

#[idempotent(scope = "payment.update", body = "none")]
async fn update(Json(_v): Parts) {}

#[idempotent(scope = "payment.delete")]
async fn delete(Json(_v): Parts) {}

fn main() {
    let _app: Router = Router::new()
        .route("/pay", post(create))
        .route("/update", post(update))
        .route("/delete", post(delete));
}
