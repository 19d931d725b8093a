#![deny(warnings)]

// Handlers written by a `macro_rules!`, with `crate = ".."` (a path given
// as a string, whose tokens carry the string's span): idem's own imports
// in the generated code raise no lint there.
use axum::{routing::post, Json, Router};

#[derive(serde::Deserialize, serde::Serialize)]
pub struct In {
    amount: u64,
}

mod my {
    pub use ::idem as engine;
}

macro_rules! handlers {
    ($name:ident) => {
        #[idem::idempotent(scope = "m.raw", crate = "crate::my::engine")]
        async fn $name(body: String) -> String {
            body
        }
    };
    (json $name:ident) => {
        #[idem::idempotent(scope = "m.json", crate = "my::engine", fields(amount))]
        #[axum::debug_handler]
        async fn $name(Json(p): Json<In>) -> String {
            p.amount.to_string()
        }
    };
}

handlers!(raw_in_macro);
handlers!(json json_in_macro);

fn main() {
    let _app: Router = Router::new()
        .route("/raw", post(raw_in_macro))
        .route("/json", post(json_in_macro));
}
