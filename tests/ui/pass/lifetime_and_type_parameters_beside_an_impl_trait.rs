// A lifetime parameter beside a type parameter, the README's form.
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{routing::post, Router};
use idem::{idempotent, Classification, Classify};
use std::marker::PhantomData;

struct Wrap<T>(PhantomData<T>);
impl<T> IntoResponse for Wrap<T> {
    fn into_response(self) -> Response {
        StatusCode::BAD_GATEWAY.into_response()
    }
}
impl<T> Classify for Wrap<T> {
    fn classify(&self) -> Classification {
        Classification::Store
    }
}

#[idempotent(scope = "payment.create")]
async fn create<'a, T: Send + 'static>(body: String) -> Result<impl IntoResponse + 'a, Wrap<T>>
where
    Wrap<T>: Classify,
    T: 'a,
{
    if body.is_empty() {
        return Err(Wrap(PhantomData));
    }
    Ok("ok")
}

fn main() {
    let _app: Router = Router::new().route("/a", post(create::<u8>));
}
