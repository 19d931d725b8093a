use axum::extract::{FromRequest, Request};
use idem::{idempotent, BodyFormat, FingerprintBody};

#[derive(serde::Deserialize, serde::Serialize)]
struct PaymentIn {
    amount: i64,
}

struct AppJson<T> {
    value: T,
}

impl<S: Send + Sync, T: serde::de::DeserializeOwned> FromRequest<S> for AppJson<T> {
    type Rejection = axum::http::StatusCode;
    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        axum::Json::<T>::from_request(req, state)
            .await
            .map(|axum::Json(value)| AppJson { value })
            .map_err(|e| e.status())
    }
}

impl<T> FingerprintBody for AppJson<T> {
    const FORMAT: BodyFormat = BodyFormat::Json;
}

#[idempotent(scope = "payment.create", fields(amount))]
async fn create(AppJson { value }: AppJson<PaymentIn>) -> String {
    value.amount.to_string()
}

fn main() {}
