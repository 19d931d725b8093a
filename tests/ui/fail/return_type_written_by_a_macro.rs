// A return type written by a macro: idem cannot see what it stands for (a
// `Result` whose error type is a generic parameter, an `impl Trait`), so it
// is refused with a message, both ways.
use axum::response::IntoResponse;
use idem::idempotent;

macro_rules! answer {
    ($e:ty) => { Result<String, $e> };
}

macro_rules! opaque {
    () => { impl IntoResponse };
}

#[idempotent(scope = "payment.create")]
async fn generic_error<E: IntoResponse + Default + Send + 'static>(_body: String) -> answer!(E) {
    Err(E::default())
}

#[idempotent(scope = "payment.update")]
async fn hidden_impl(_body: String) -> opaque!() {
    "ok"
}

fn main() {}
