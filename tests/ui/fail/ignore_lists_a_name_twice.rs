use idem::idempotent;

#[idempotent(scope = "search.save", ignore("utm_source", "page", "utm_source"))]
async fn save() {}

fn main() {}
