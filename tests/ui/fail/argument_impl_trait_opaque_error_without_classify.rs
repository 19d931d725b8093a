// An `impl Trait` among the parameters' types makes the handler generic:
// its `impl IntoResponse` error may be the state's own error type, whose
// `Classify` impl would be ignored. Refused, as for a declared parameter.
use axum::extract::State;
use axum::response::IntoResponse;
use idem::idempotent;

pub trait Gateway: Clone + Send + Sync + 'static {
    type Error: IntoResponse + Send;
    fn charge(&self) -> Result<String, Self::Error>;
}

#[idempotent(scope = "payment.create")]
async fn create(State(gw): State<impl Gateway>, _body: String) -> Result<String, impl IntoResponse> {
    gw.charge()
}

fn main() {}
