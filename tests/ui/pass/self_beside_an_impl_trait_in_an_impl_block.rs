// A handler in an `impl` block whose return type names `Self` next to an
// `impl Trait`.
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{routing::post, Json, Router};
use idem::idempotent;

#[derive(serde::Deserialize, serde::Serialize)]
struct Payment {
    amount: i64,
}

struct PayErr;
impl IntoResponse for PayErr {
    fn into_response(self) -> Response {
        StatusCode::PAYMENT_REQUIRED.into_response()
    }
}

impl Payment {
    #[idempotent(scope = "payment.create", fields(amount))]
    async fn create(Json(p): Json<Self>) -> Result<Json<Self>, impl IntoResponse> {
        if p.amount < 0 {
            return Err(PayErr);
        }
        Ok(Json(p))
    }
}

impl PayErr {
    #[idempotent(scope = "payment.update")]
    async fn update(body: String) -> Result<impl IntoResponse, Self> {
        if body.is_empty() {
            return Err(PayErr);
        }
        Ok("ok")
    }
}

fn main() {
    let _app: Router = Router::new()
        .route("/a", post(Payment::create))
        .route("/b", post(PayErr::update));
}
