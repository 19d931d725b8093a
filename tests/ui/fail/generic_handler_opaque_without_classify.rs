// A generic handler's answer behind `impl Trait`: the value may be of a
// type parameter, whose `Classify` impl could not be seen, so the bounds
// must say it.
use axum::response::IntoResponse;
use idem::idempotent;

#[idempotent(scope = "payment.create")]
async fn create<E: IntoResponse + Default + Send + 'static>(_body: String) -> Result<String, impl IntoResponse> {
    Err::<String, E>(E::default())
}

#[idempotent(scope = "payment.update")]
async fn update<R: IntoResponse + Default + Send + 'static>(_body: String) -> impl IntoResponse {
    R::default()
}

// A const parameter is one too.
#[idempotent(scope = "payment.retry")]
async fn retry<const N: u16>(_body: String) -> impl IntoResponse {
    axum::http::StatusCode::from_u16(N).unwrap()
}

// Its bounds naming `Classify` say it.
#[idempotent(scope = "payment.cancel")]
async fn cancel<R: IntoResponse + idem::Classify + Default + Send + 'static>(
    _body: String,
) -> impl IntoResponse + idem::Classify {
    R::default()
}

// An `impl Trait` the outcome is not classified by (the success) is let through.
#[idempotent(scope = "payment.list")]
async fn list<T: Send + 'static>(_body: String) -> Result<impl IntoResponse, axum::http::StatusCode> {
    let _ = std::marker::PhantomData::<T>;
    Ok::<_, axum::http::StatusCode>("listed")
}

fn main() {}
