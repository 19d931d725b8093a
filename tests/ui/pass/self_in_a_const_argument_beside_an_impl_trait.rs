// `Self::CODE` in a const argument of the error type, beside an `impl Trait`.
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{routing::post, Router};
use idem::idempotent;

struct Code<const N: u16>;
impl<const N: u16> IntoResponse for Code<N> {
    fn into_response(self) -> Response {
        StatusCode::from_u16(N).unwrap().into_response()
    }
}

struct Svc;
impl Svc {
    const CODE: u16 = 402;

    #[idempotent(scope = "payment.create")]
    async fn create(body: String) -> Result<impl IntoResponse, Code<{ Self::CODE }>> {
        if body.is_empty() {
            return Err(Code);
        }
        Ok("ok")
    }
}

fn main() {
    let _app: Router = Router::new().route("/a", post(Svc::create));
}
