// A generic handler whose error type depends on its parameter: a
// `Classify` impl of that type could not be seen, so a bound must say it.
use axum::response::IntoResponse;
use idem::idempotent;

pub trait Gateway: Send + Sync + 'static {
    type Error: IntoResponse + Send;
    fn charge(&self) -> Result<String, Self::Error>;
}

#[idempotent(scope = "payment.create")]
async fn create<G: Gateway>(_body: String) -> Result<String, G::Error> {
    unimplemented!()
}

// A bound that names `Classify` on something else does not say it of the
// error type.
#[idempotent(scope = "payment.update")]
async fn update<G: Gateway + idem::Classify>(_body: String) -> Result<String, G::Error> {
    unimplemented!()
}

fn main() {}
