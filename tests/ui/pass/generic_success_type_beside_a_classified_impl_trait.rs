// A generic handler whose answer names `T` on the success side and hides
// its error behind `impl IntoResponse + Classify`, as the
// README asks of generic handlers.
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{routing::post, Json, Router};
use idem::{idempotent, Classification, Classify};

struct Declined;
impl IntoResponse for Declined {
    fn into_response(self) -> Response {
        StatusCode::PAYMENT_REQUIRED.into_response()
    }
}
impl Classify for Declined {
    fn classify(&self) -> Classification {
        Classification::Store
    }
}

#[idempotent(scope = "payment.list")]
async fn list<T: serde::Serialize + Default + Send + 'static>(
    body: String,
) -> Result<Json<Vec<T>>, impl IntoResponse + Classify> {
    if body.is_empty() {
        return Err(Declined);
    }
    Ok(Json(vec![T::default()]))
}

fn main() {
    let _app: Router = Router::new().route("/a", post(list::<u8>));
}
