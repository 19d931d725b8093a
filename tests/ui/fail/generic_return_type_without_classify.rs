// A generic handler whose whole return type is its parameter's: a
// `Classify` impl of that type could not be seen, so a bound must say it.
use axum::response::IntoResponse;
use idem::idempotent;

pub trait Gateway: Send + Sync + 'static {
    type Answer: IntoResponse + Send;
    fn charge(&self) -> Self::Answer;
}

#[idempotent(scope = "payment.create")]
async fn create<R: IntoResponse + Default + Send + 'static>(_body: String) -> R {
    R::default()
}

#[idempotent(scope = "payment.update")]
async fn update<G: Gateway>(_body: String) -> <G as Gateway>::Answer {
    unimplemented!()
}

// A type that only has the parameter among its arguments is let through.
#[idempotent(scope = "payment.list")]
async fn list<T: serde::Serialize + Send + 'static>(_body: String) -> axum::Json<Vec<T>> {
    axum::Json(Vec::new())
}

fn main() {}
