#![deny(warnings)]

// A body extractor behind a type alias, an application's own `Json` with
// its own rejections, and a head-only extractor wrapped in `Option`.
use axum::extract::{FromRequest, Path, Request};
use axum::http::StatusCode;
use axum::{routing::post, Router};
use idem::{idempotent, BodyFormat, FingerprintBody};

type Body = axum::Json<serde_json::Value>;

#[idempotent(scope = "payment.create")]
async fn aliased(axum::Json(p): Body) -> String {
    p.to_string()
}

/// The application's own JSON extractor, named like axum's.
struct Json<T>(T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> FromRequest<S> for Json<T> {
    type Rejection = (StatusCode, String);
    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        axum::Json::<T>::from_request(req, state)
            .await
            .map(|axum::Json(v)| Json(v))
            .map_err(|e| (e.status(), format!("bad JSON: {e}")))
    }
}

impl<T> FingerprintBody for Json<T> {
    const FORMAT: BodyFormat = BodyFormat::Json;
}

#[derive(serde::Deserialize)]
struct PaymentIn {
    amount: i64,
}

#[idempotent(scope = "payment.own", fields(amount))]
async fn own_json(Json(p): Json<PaymentIn>) -> String {
    p.amount.to_string()
}

type Note = String;

#[idempotent(scope = "note.create")]
async fn note(text: Note) -> String {
    text
}

#[idempotent(scope = "payment.get")]
async fn optional_path(id: Option<Path<String>>) -> String {
    id.map(|Path(id)| id).unwrap_or_default()
}

fn main() {
    let _app: Router = Router::new()
        .route("/a", post(aliased))
        .route("/o", post(own_json))
        .route("/n", post(note))
        .route("/p/{id}", post(optional_path));
}
