// An `impl Trait` in an associated type binding of a `dyn` among the
// parameters' types makes the handler generic too: its `impl IntoResponse`
// error may be that type, whose `Classify` impl would be ignored.
use axum::extract::State;
use axum::response::IntoResponse;
use idem::idempotent;
use std::sync::Arc;

pub trait DynGateway {
    type Error;
    fn charge(&self) -> Result<String, Self::Error>;
}

#[idempotent(scope = "payment.create")]
async fn create(
    State(gw): State<Arc<dyn DynGateway<Error = impl IntoResponse + Send + 'static> + Send + Sync>>,
    _body: String,
) -> Result<String, impl IntoResponse> {
    gw.charge()
}

fn main() {}
