#![deny(warnings)]

// Items of the user's named like the ones the attribute generates (or
// once generated) meet nothing: the handler's body sees its own. Names
// that start with `__idem_` are the attribute's.
use idem::idempotent;

static SPEC: &str = "also mine";
static __IDEM_SPEC: &str = "mine too";

#[idempotent(scope = "a.create")]
async fn handler() -> String {
    format!("{SPEC} {__IDEM_SPEC}")
}

fn main() {
    let _app: axum::Router = axum::Router::new().route("/", axum::routing::post(handler));
}
