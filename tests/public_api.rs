//! The public API, pinned: the items a service uses sit at `idem::`, the
//! store implementer's under `idem::store`, and nothing else is public but
//! the modules below. Adding or removing an item means editing this list.
//! The README's table of refusals is checked against `idem::Problem`.

#[allow(unused_imports)]
use idem::{
    fingerprint::{
        canonical_json, fingerprint, BodyPrint, FingerprintError, JsonError, RequestPrint,
        FINGERPRINT_VERSION,
    },
    key::{IdempotencyKey, KeyError, MAX_KEY_LEN},
    migrations::{Migration, DEFAULT_TABLE, MAX_TABLE_NAME, POSTGRES_MIGRATIONS, SQLITE_MIGRATIONS},
    store::{
        BoxFuture, Decision, Lease, RecordId, RecordState, Reservation, ReserveRequest, Source,
        StoredResponse,
    },
};
#[allow(unused_imports)]
use idem::{
    idempotent, parse_duration, problem, purge_expired, BodyFormat, Classification, Classify, ConfigError,
    FingerprintBody, Idem, IdempotencyStore, Janitor, MemoryStore, Operation, PgStore, Problem, SqliteStore,
    StoreError, Tenant, TxConnection, Unavailable, BODY_OMITTED_HEADER, DEFAULT_BUSY_TIMEOUT,
    DEFAULT_LOCK_TIMEOUT, DEFAULT_MAX_STORED_BODY, DEFAULT_OPERATION_TIMEOUT, DEFAULT_REPLAY_CACHE,
    DEFAULT_TTL, LOCK_TIMEOUT_RANGE, MAX_STORED_BODY_LIMIT, PROBLEM_TYPE_PREFIX, REPLAYED_HEADER, TTL_RANGE,
};

/// The names `src/lib.rs` re-exports at the root, one by one.
const ROOT: &[&str] = &[
    "BODY_OMITTED_HEADER",
    "BodyFormat",
    "Classification",
    "Classify",
    "ConfigError",
    "DEFAULT_BUSY_TIMEOUT",
    "DEFAULT_LOCK_TIMEOUT",
    "DEFAULT_MAX_STORED_BODY",
    "DEFAULT_OPERATION_TIMEOUT",
    "DEFAULT_REPLAY_CACHE",
    "DEFAULT_TTL",
    "FingerprintBody",
    "Idem",
    "IdempotencyStore",
    "Janitor",
    "LOCK_TIMEOUT_RANGE",
    "MAX_STORED_BODY_LIMIT",
    "MemoryStore",
    "Operation",
    "PROBLEM_TYPE_PREFIX",
    "PgStore",
    "Problem",
    "REPLAYED_HEADER",
    "SqliteStore",
    "StoreError",
    "TTL_RANGE",
    "Tenant",
    "TxConnection",
    "Unavailable",
    "__private",
    "fingerprint",
    "idempotent",
    "key",
    "migrations",
    "parse_duration",
    "problem",
    "purge_expired",
    "store",
];

/// Every name in the `pub use` items of the facade's source.
fn reexported(source: &str) -> Vec<String> {
    let mut names = Vec::new();
    for item in source.split("pub use ").skip(1) {
        let item = &item[..item.find(';').expect("a `pub use` ends with `;`")];
        assert!(
            !item.contains('*'),
            "the facade re-exports by name, never a glob: `pub use {item}`"
        );
        let list = match item.find('{') {
            Some(open) => &item[open + 1..item.rfind('}').unwrap()],
            None => item,
        };
        for path in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            names.push(path.rsplit("::").next().unwrap().to_owned());
        }
    }
    names.sort();
    names
}

#[test]
fn the_facade_lists_exactly_the_users_items() {
    let mut expected: Vec<String> = ROOT.iter().map(|s| (*s).to_owned()).collect();
    expected.sort();
    assert_eq!(reexported(include_str!("../src/lib.rs")), expected);
}

#[test]
fn implementers_items_are_not_at_the_root() {
    let root = reexported(include_str!("../src/lib.rs"));
    for name in [
        "RecordId",
        "Reservation",
        "ReserveRequest",
        "Lease",
        "StoredResponse",
        "BoxFuture",
    ] {
        assert!(
            !root.iter().any(|n| n == name),
            "`{name}` belongs under `idem::store`"
        );
    }
}

/// The refusals in the README's table under "What a client gets": status
/// and problem name.
fn readme_refusals() -> Vec<(u16, String)> {
    let readme = include_str!("../README.md");
    let start = readme
        .find("| status | problem type")
        .expect("the README's table of refusals");
    readme[start..]
        .lines()
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .filter_map(|row| {
            let cells: Vec<&str> = row.split('|').map(str::trim).collect();
            // The first rows are the handler's own and the replayed answers.
            Some((cells[1].parse().ok()?, cells[2].trim_matches('`').to_owned()))
        })
        .collect()
}

#[test]
fn the_readme_table_lists_every_problem_once_with_its_status() {
    let catalog: Vec<(u16, String)> = Problem::catalog()
        .iter()
        .map(|p| (p.status().as_u16(), p.type_name().to_owned()))
        .collect();
    assert_eq!(readme_refusals(), catalog);
}
