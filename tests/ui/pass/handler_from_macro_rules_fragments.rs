#![deny(warnings)]
// Handlers written by macro_rules with fragments: literal scope, ty body,
// ident fields, pat parameters.
use axum::{routing::post, Json, Router};
use idem::{idempotent, Operation};

#[derive(serde::Deserialize, serde::Serialize)]
pub struct In {
    amount: u64,
}

macro_rules! handler {
    ($name:ident, $scope:literal, $field:ident, $p:pat, $ty:ty, $opty:ty) => {
        #[idempotent(scope = $scope, fields($field))]
        async fn $name(op: $opty, $p: $ty) -> String {
            let _ = op;
            String::new()
        }
    };
}

handler!(h1, "m.one", amount, Json(_p), Json<In>, Operation);
handler!(h2, "m.two", amount, Json(_p), Json<In>, Option<Operation>);

macro_rules! scoped {
    ($name:ident, $scope:expr) => {
        #[idempotent(scope = $scope)]
        async fn $name(body: String) -> String {
            body
        }
    };
}
scoped!(h3, "m.three");

fn main() {
    let _app: Router = Router::new()
        .route("/1", post(h1))
        .route("/2", post(h2))
        .route("/3", post(h3));
}
