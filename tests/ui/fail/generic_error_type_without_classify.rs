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

// A const parameter is one too: `Code<N>` may implement `Classify` for one `N`.
pub struct Code<const N: u16>;

impl<const N: u16> IntoResponse for Code<N> {
    fn into_response(self) -> axum::response::Response {
        axum::http::StatusCode::BAD_GATEWAY.into_response()
    }
}

#[idempotent(scope = "payment.refund")]
async fn refund<const N: u16>(_body: String) -> Result<String, Code<N>> {
    Err(Code::<N>)
}

fn main() {}
