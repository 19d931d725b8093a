// G::Error where G: Store<Self>, in an inherent impl of a concrete type.
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{routing::post, Router};
use idem::{idempotent, Classification, Classify};
use std::marker::PhantomData;

struct PayErr;
impl IntoResponse for PayErr {
    fn into_response(self) -> Response {
        StatusCode::PAYMENT_REQUIRED.into_response()
    }
}
impl Classify for PayErr {
    fn classify(&self) -> Classification {
        Classification::Store
    }
}

trait Store<Owner>: Clone + Send + Sync + 'static {
    type Error: IntoResponse + Send;
}
#[derive(Clone)]
struct Mem;
struct Svc;
impl Store<Svc> for Mem {
    type Error = PayErr;
}
impl Svc {
    #[idempotent(scope = "payment.create")]
    async fn create<G: Store<Self>>(State(_g): State<G>, body: String) -> Result<impl IntoResponse, G::Error>
    where
        G::Error: Classify,
    {
        if body.is_empty() {
            return Err(todo!());
        }
        Ok("ok")
    }
}
fn main() {
    let _app: Router = Router::new().route("/a", post(Svc::create::<Mem>)).with_state(Mem);
}
