// The attribute on a method of a trait's impl: the expansion adds idem's
// own parameters, which the trait's declaration does not have, and the
// compiler counts them. Put the attribute on an inherent fn (or an
// associated fn of the type's own `impl`) and call the trait's method
// from it.
use axum::Json;
use idem::idempotent;

#[derive(serde::Deserialize)]
struct In {
    amount: i64,
}

trait Payments {
    fn create(body: Json<In>) -> impl std::future::Future<Output = String> + Send;
}

struct Live;

impl Payments for Live {
    #[idempotent(scope = "payment.create", fields(amount))]
    async fn create(Json(p): Json<In>) -> String {
        p.amount.to_string()
    }
}

fn main() {}
