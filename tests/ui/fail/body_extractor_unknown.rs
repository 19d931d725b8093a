use axum::extract::{FromRequest, Request};
use idem::idempotent;

/// A body extractor of the application's own that says nothing to idem.
struct Upload(Vec<u8>);

impl<S: Send + Sync> FromRequest<S> for Upload {
    type Rejection = axum::http::StatusCode;
    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = axum::body::Bytes::from_request(req, state)
            .await
            .map_err(|_| axum::http::StatusCode::BAD_REQUEST)?;
        Ok(Upload(bytes.to_vec()))
    }
}

#[idempotent(scope = "file.upload")]
async fn upload(Upload(bytes): Upload) -> String {
    bytes.len().to_string()
}

fn main() {}
