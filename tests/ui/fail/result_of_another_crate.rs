// A return type named `Result` that is not the standard library's: the
// macro reads its second argument as the error type, whose `Classify` impl
// would then be ignored.
use axum::response::{IntoResponse, Response};
use idem::idempotent;

mod own {
    pub enum Result<T, E> {
        Ok(T),
        Err(E),
    }
}

impl<T: IntoResponse, E: IntoResponse> IntoResponse for own::Result<T, E> {
    fn into_response(self) -> Response {
        match self {
            own::Result::Ok(t) => t.into_response(),
            own::Result::Err(e) => e.into_response(),
        }
    }
}

#[idempotent(scope = "payment.create")]
async fn create(_body: String) -> own::Result<String, String> {
    own::Result::Ok(String::new())
}

// The standard library's, under any path, and an alias of it are fine.
#[idempotent(scope = "payment.update")]
async fn update(_body: String) -> axum::response::Result<String, String> {
    Ok(String::new())
}

#[idempotent(scope = "payment.cancel")]
async fn cancel(_body: String) -> core::result::Result<String, String> {
    Ok(String::new())
}

fn main() {}
