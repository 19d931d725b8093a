//! A handler in a generic `impl` block whose body type names the block's
//! parameter: `fields(...)` is checked when the handler is instantiated.
use axum::Json;
use idem::idempotent;

#[derive(serde::Deserialize, serde::Serialize)]
struct Envelope<T> {
    amount: i64,
    data: T,
}

struct Api<T>(std::marker::PhantomData<T>);

impl<T: serde::de::DeserializeOwned + serde::Serialize + Send + 'static> Api<T> {
    #[idempotent(scope = "payment.create", fields(amount))]
    async fn create(Json(p): Json<Envelope<T>>) -> String {
        p.amount.to_string()
    }
}

fn main() {
    let _ = Api::<String>::create;
}
