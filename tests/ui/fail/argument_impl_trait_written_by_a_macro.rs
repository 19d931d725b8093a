// An `impl Trait` among the parameters' types, written by a type macro:
// the handler is generic as with `State<impl Gateway>`, so its opaque error
// must be refused as there (its Classify impl would be ignored).
use axum::extract::State;
use axum::response::IntoResponse;
use idem::idempotent;

pub trait Gateway: Clone + Send + Sync + 'static {
    type Error: IntoResponse + Send;
    fn charge(&self) -> Result<String, Self::Error>;
}

macro_rules! gateway {
    () => { impl Gateway };
}

#[idempotent(scope = "payment.create")]
async fn create(State(gw): State<gateway!()>, _body: String) -> Result<String, impl IntoResponse> {
    gw.charge()
}

fn main() {}
