//! Versioned migrations: every schema ever released upgrades and serves, a
//! table that does not match refuses to serve with a clear error, and names
//! derived from the table's never truncate.

use idem::store::{RecordId, Reservation, ReserveRequest, StoredResponse};
use idem::{IdempotencyStore, PgStore, SqliteStore};
use sqlx::{Connection as _, Executor as _};
use std::time::Duration;

const LONG: Duration = Duration::from_secs(3600);

/// The first released schema (before `taken_over`), as that build created it.
const V1_POSTGRES: &str = "CREATE TABLE {t} (tenant TEXT NOT NULL, scope TEXT NOT NULL, key TEXT NOT NULL, \
    fingerprint TEXT NOT NULL, state TEXT NOT NULL CHECK (state IN ('in_progress', 'completed')), \
    operation_id TEXT NOT NULL, lock_token TEXT, attempt INTEGER NOT NULL, lock_expires_at TIMESTAMPTZ NOT NULL, \
    recovery_point TEXT, response_status INTEGER, response_headers TEXT, response_body BYTEA, \
    created_at TIMESTAMPTZ NOT NULL, expires_at TIMESTAMPTZ NOT NULL, PRIMARY KEY (tenant, scope, key)); \
    INSERT INTO {t} VALUES ('t', 's', 'old', 'fp', 'completed', 'op', NULL, 1, now(), NULL, 201, \
    '[[\"content-type\",\"text/plain\"]]', 'before the upgrade', now(), now() + interval '1 hour')";

const V1_SQLITE: &str = "CREATE TABLE {t} (tenant TEXT NOT NULL, scope TEXT NOT NULL, key TEXT NOT NULL, \
    fingerprint TEXT NOT NULL, state TEXT NOT NULL CHECK (state IN ('in_progress', 'completed')), \
    operation_id TEXT NOT NULL, lock_token TEXT, attempt INTEGER NOT NULL, lock_expires_at INTEGER NOT NULL, \
    recovery_point TEXT, response_status INTEGER, response_headers TEXT, response_body BLOB, \
    created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL, PRIMARY KEY (tenant, scope, key)) WITHOUT ROWID; \
    INSERT INTO {t} VALUES ('t', 's', 'old', 'fp', 'completed', 'op', NULL, 1, 0, NULL, 201, \
    '[[\"content-type\",\"text/plain\"]]', CAST('before the upgrade' AS BLOB), 0, \
    CAST(unixepoch('subsec') * 1000 AS INTEGER) + 3600000)";

fn req<'a>(id: &'a RecordId, fp: &'a str) -> ReserveRequest<'a> {
    ReserveRequest {
        id,
        fingerprint: fp,
        token: idem_testkit::token(),
        ttl: LONG,
        lock_timeout: LONG,
    }
}

/// A stored 201 with `body`.
fn created(body: &[u8]) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![],
        body: Some(body.to_vec()),
    }
}

/// The old record replays, a new key is served end to end.
async fn serves_after_the_upgrade(store: &dyn IdempotencyStore) {
    let old = RecordId::new("t", "s", "old");
    assert_eq!(
        store.reserve(req(&old, "fp")).await.unwrap(),
        Reservation::Completed(StoredResponse {
            status: 201,
            headers: vec![("content-type".into(), "text/plain".into())],
            body: Some(b"before the upgrade".to_vec()),
        })
    );
    takes_completes_replays(store, "new").await;
}

/// A pool on `url`, a fresh schema, and a store on its table, migrated.
async fn migrated_pg_store(url: &str) -> (sqlx::PgPool, String, PgStore) {
    let schema = idem_testkit::pg_schema(url).await;
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    let store = PgStore::new(pool.clone())
        .with_table(Some(&schema), "idempotency_keys")
        .unwrap();
    store.migrate().await.unwrap();
    (pool, schema, store)
}

#[tokio::test]
async fn postgres_the_first_released_schema_upgrades_and_serves() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let t = format!("\"{schema}\".\"idempotency_keys\"");
    pool.execute(sqlx::AssertSqlSafe(V1_POSTGRES.replace("{t}", &t)))
        .await
        .unwrap();
    let store = PgStore::new(pool.clone())
        .with_table(Some(&schema), "idempotency_keys")
        .unwrap();
    assert!(
        store.check_schema().await.is_err(),
        "an old table is refused before the upgrade"
    );
    store.migrate().await.unwrap();
    store.migrate().await.unwrap();
    let versions: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT version FROM \"{schema}\".\"idempotency_keys_migrations\" ORDER BY version"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        versions,
        [1, 2, 3, 4, 5, 6, 7],
        "the check's drop is no schema version"
    );
    assert_eq!(
        state_checks(&pool, &schema, "idempotency_keys").await,
        0,
        "the upgrade drops the check on state"
    );
    serves_after_the_upgrade(&store).await;
}

#[tokio::test]
async fn sqlite_the_first_released_schema_upgrades_and_serves() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("old.db")).await.unwrap();
    store
        .pool()
        .execute(sqlx::AssertSqlSafe(
            V1_SQLITE.replace("{t}", "\"idempotency_keys\""),
        ))
        .await
        .unwrap();
    assert!(store.check_schema().await.is_err());
    store.migrate().await.unwrap();
    store.migrate().await.unwrap();
    serves_after_the_upgrade(&store).await;
}

/// A table made by the build that added `taken_over` in place (before
/// versions were recorded) is recognised as version 2, not altered twice.
#[tokio::test]
async fn sqlite_a_table_from_before_versions_were_recorded_is_recognised() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("v2.db")).await.unwrap();
    let in_place = V1_SQLITE.replace("{t}", "\"idempotency_keys\"").replacen(
        "attempt INTEGER NOT NULL,",
        "attempt INTEGER NOT NULL, taken_over INTEGER NOT NULL DEFAULT 0,",
        1,
    );
    let in_place = in_place.replace("'op', NULL, 1, 0,", "'op', NULL, 1, 0, 0,");
    store.pool().execute(sqlx::AssertSqlSafe(in_place)).await.unwrap();
    store.migrate().await.unwrap();
    serves_after_the_upgrade(&store).await;
}

/// A table at a version this build does not know, whose records table that
/// newer build renamed or dropped: `migrate()` refuses before it writes
/// anything (no table of this build's made beside it), and both it and
/// `check_schema()` say to upgrade idem, not to run `migrate()`.
fn says_upgrade_idem(what: &str, result: Result<(), idem::StoreError>) {
    let err = result.expect_err(what).to_string();
    assert!(
        err.contains("newer than this build of idem knows (7): upgrade idem")
            && !err.contains("run migrate()"),
        "{what}: {err}"
    );
}

/// Runs `statement`, binding `key`, on `store`'s database.
async fn edit(store: &SqliteStore, statement: &str, key: &str) -> Result<(), sqlx::Error> {
    sqlx::query(sqlx::AssertSqlSafe(statement.to_owned()))
        .bind(key)
        .execute(store.pool())
        .await
        .map(drop)
}

/// Takes `key` on `store`, and completes it with `created(b"done")` when
/// `complete`.
async fn taken(store: &SqliteStore, key: &str, complete: bool) -> RecordId {
    let id = RecordId::new("t", "s", key);
    let Reservation::Reserved(lease) = store.reserve(req(&id, "fp")).await.unwrap() else {
        panic!("a fresh key was not taken")
    };
    if complete {
        store
            .complete(&id, &lease.token, &created(b"done"))
            .await
            .unwrap();
    }
    id
}

/// SQLite stores what it is given in a column of any type, and ranks text
/// above every number: a lock edited by hand as a date never ran out (409
/// forever), one edited as a fraction (`julianday` arithmetic) could not
/// be read (503), and a record expired by hand as dates was replayed and
/// never purged. A time that is not an integer is now refused where it is
/// written, saying what to write; the record is as it was.
#[tokio::test]
async fn sqlite_times_written_by_hand_are_integers_or_refused() {
    let (store, _dir) = idem_testkit::sqlite_store().await;
    let running = taken(&store, "running", false).await;
    for set in [
        "lock_expires_at = (julianday('now') - 2440587.5) * 86400000.0 + 600000",
        "lock_expires_at = datetime('now', '-1 hour')",
        "created_at = datetime('now', '-2 days'), expires_at = datetime('now', '-1 day')",
        "expires_at = 1.5",
        "purge_at = 'soon'",
    ] {
        let refused = edit(
            &store,
            &format!("UPDATE idempotency_keys SET {set} WHERE key = ?1"),
            "running",
        )
        .await;
        let said = refused.map_err(|e| e.to_string());
        assert!(
            said.as_ref()
                .is_err_and(|e| e.contains("integers, milliseconds since the Unix epoch")),
            "{set}: {said:?}"
        );
    }
    let refused = edit(
        &store,
        "INSERT INTO idempotency_keys (tenant, scope, key, fingerprint, state, operation_id, attempt, \
         lock_expires_at, created_at, expires_at) VALUES ('t', 's', ?1, 'fp', 'in_progress', 'op', 1, \
         datetime('now'), 0, 0)",
        "inserted",
    )
    .await;
    assert!(refused.is_err(), "a text time inserted by hand was stored");
    let Ok(Reservation::InProgress { retry_after }) = store.reserve(req(&running, "fp")).await else {
        panic!("the record changed")
    };
    assert!(retry_after > Duration::from_secs(3000), "{retry_after:?}");
    // The same edit written as an integer frees the lock.
    edit(
        &store,
        "UPDATE idempotency_keys SET lock_expires_at = CAST(unixepoch('subsec') * 1000 AS INTEGER) - 3600000 \
         WHERE key = ?1",
        "running",
    )
    .await
    .unwrap();
    let taken_over = store.reserve(req(&running, "fp")).await.unwrap();
    assert!(
        matches!(&taken_over, Reservation::Reserved(l) if l.is_takeover()),
        "{taken_over:?}"
    );
}

/// Times edited by hand before the upgrade that checks them are read once
/// as SQLite reads them: a fraction as its milliseconds, a date as its
/// instant, a purge time as not set yet; text that is no date is left, and
/// holds up no purge.
#[tokio::test]
async fn sqlite_times_edited_before_the_upgrade_are_read_as_times() {
    let (store, _dir) = idem_testkit::sqlite_store().await;
    let extended = taken(&store, "extended", false).await;
    let freed = taken(&store, "freed", false).await;
    let expired = taken(&store, "expired", true).await;
    let odd = taken(&store, "odd", true).await;
    let never = taken(&store, "never", true).await;
    let never_running = taken(&store, "never-running", false).await;
    // A table of the build before: no triggers, version 7 not applied.
    for statement in [
        "DROP TRIGGER IF EXISTS idempotency_keys_times_on_insert",
        "DROP TRIGGER IF EXISTS idempotency_keys_times_on_update",
        "DELETE FROM idempotency_keys_migrations WHERE version = 7",
    ] {
        store.pool().execute(statement).await.unwrap();
    }
    for (set, key) in [
        (
            "lock_expires_at = (julianday('now') - 2440587.5) * 86400000.0 + 600000",
            "extended",
        ),
        ("lock_expires_at = datetime('now', '-1 hour')", "freed"),
        (
            "created_at = datetime('now', '-2 days'), expires_at = datetime('now', '-1 day'), purge_at = 1.5",
            "expired",
        ),
        ("purge_at = 'soon', lock_expires_at = 'whenever'", "odd"),
        // Kept for ever by hand: left as text, and its purge time, read as
        // not set yet, is set by the janitor to the earliest time, never
        // to the text (which the triggers refuse: every purge failed).
        ("expires_at = 'never', purge_at = 0", "never"),
        // Its lock run out: taken over, its retention counted afresh (not
        // from 'never' read as 0), its answer then stored and replayed.
        (
            "expires_at = 'never', lock_expires_at = CAST(unixepoch('subsec') * 1000 AS INTEGER) - 1000",
            "never-running",
        ),
    ] {
        edit(
            &store,
            &format!("UPDATE idempotency_keys SET {set} WHERE key = ?1"),
            key,
        )
        .await
        .unwrap();
    }
    store.migrate().await.unwrap();
    let types: Vec<(String, String, String, String, String)> = sqlx::query_as(
        "SELECT key, typeof(lock_expires_at), typeof(created_at), typeof(expires_at), typeof(purge_at) \
         FROM idempotency_keys ORDER BY key",
    )
    .fetch_all(store.pool())
    .await
    .unwrap();
    let integer = || "integer".to_owned();
    for (key, lock, created_at, expires_at, purge_at) in types {
        let (lock_kept_as_text, expiry_kept_as_text) = (key == "odd", key.starts_with("never"));
        assert_eq!(
            (lock == "integer", created_at, expires_at == "integer", purge_at),
            (!lock_kept_as_text, integer(), !expiry_kept_as_text, integer()),
            "{key}"
        );
    }
    // Ten minutes left on the lock: 409 with about that.
    let Ok(Reservation::InProgress { retry_after }) = store.reserve(req(&extended, "fp")).await else {
        panic!("the extended lock was not read as ten minutes")
    };
    assert!(
        retry_after > Duration::from_secs(500) && retry_after <= Duration::from_secs(600),
        "{retry_after:?}"
    );
    let taken_over = store.reserve(req(&freed, "fp")).await.unwrap();
    assert!(
        matches!(&taken_over, Reservation::Reserved(l) if l.is_takeover()),
        "{taken_over:?}"
    );
    // Past its retention: absent, then purged by the janitor's rule.
    assert_eq!(idem::purge_expired(&store, 100).await.unwrap(), 1);
    let fresh = store.reserve(req(&expired, "another request")).await.unwrap();
    assert!(
        matches!(&fresh, Reservation::Reserved(l) if !l.is_takeover()),
        "{fresh:?}"
    );
    for kept in [&odd, &never] {
        assert_eq!(
            store.reserve(req(kept, "fp")).await.unwrap(),
            Reservation::Completed(created(b"done"))
        );
    }
    assert_eq!(idem::purge_expired(&store, 100).await.unwrap(), 0);
    let Ok(Reservation::Reserved(lease)) = store.reserve(req(&never_running, "fp")).await else {
        panic!("a record whose lock ran out was not taken over")
    };
    assert!(lease.is_takeover());
    store
        .complete(&never_running, &lease.token, &created(b"again"))
        .await
        .unwrap();
    assert_eq!(
        store.reserve(req(&never_running, "fp")).await.unwrap(),
        Reservation::Completed(created(b"again"))
    );
}

#[tokio::test]
async fn sqlite_a_newer_schema_is_refused_before_anything_is_written() {
    let (store, _dir) = idem_testkit::sqlite_store().await;
    for statement in [
        "INSERT INTO idempotency_keys_migrations (version, name, applied_at) VALUES (8, 'a newer build', 0)",
        "DROP TABLE idempotency_keys",
    ] {
        store.pool().execute(statement).await.unwrap();
    }
    says_upgrade_idem("migrate()", store.migrate().await);
    says_upgrade_idem("check_schema()", store.check_schema().await);
    let made: i64 = sqlx::query_scalar("SELECT count(*) FROM sqlite_master WHERE name = 'idempotency_keys'")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(made, 0, "migrate() made a table before it refused");
}

#[tokio::test]
async fn postgres_a_newer_schema_is_refused_before_anything_is_written() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let (pool, schema, store) = migrated_pg_store(&url).await;
    for statement in [
        format!(
            "INSERT INTO \"{schema}\".idempotency_keys_migrations (version, name, applied_at) \
             VALUES (8, 'a newer build', 0)"
        ),
        format!("DROP TABLE \"{schema}\".idempotency_keys"),
    ] {
        pool.execute(sqlx::AssertSqlSafe(statement)).await.unwrap();
    }
    says_upgrade_idem("migrate()", store.migrate().await);
    says_upgrade_idem("check_schema()", store.check_schema().await);
    let made: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = 'idempotency_keys'",
    )
    .bind(&schema)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(made, 0, "migrate() made a table before it refused");
}

/// A table of this build whose versions table is gone (the table alone
/// copied to another file, say): recognised by its columns as at least
/// version 5, whose column SQLite cannot add twice, and served.
#[tokio::test]
async fn sqlite_a_current_table_without_its_versions_is_recognised() {
    let (store, _dir) = idem_testkit::sqlite_store().await;
    let id = RecordId::new("t", "s", "kept");
    let lease = idem_testkit::records::take(&store, &id, "fp", LONG, LONG).await;
    store
        .complete(&id, &lease.token, &created(b"kept"))
        .await
        .unwrap();
    store
        .pool()
        .execute("DROP TABLE idempotency_keys_migrations")
        .await
        .unwrap();
    store.migrate().await.unwrap();
    assert_eq!(
        store.reserve(req(&id, "fp")).await.unwrap(),
        Reservation::Completed(created(b"kept"))
    );
    let versions: Vec<i64> =
        sqlx::query_scalar("SELECT version FROM idempotency_keys_migrations ORDER BY version")
            .fetch_all(store.pool())
            .await
            .unwrap();
    assert_eq!(versions, [1, 2, 3, 4, 5, 6, 7]);
}

#[tokio::test]
async fn postgres_a_current_table_without_its_versions_is_recognised() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let (pool, schema, store) = migrated_pg_store(&url).await;
    let id = RecordId::new("t", "s", "kept");
    let lease = idem_testkit::records::take(&store, &id, "fp", LONG, LONG).await;
    store
        .complete(&id, &lease.token, &created(b"kept"))
        .await
        .unwrap();
    pool.execute(sqlx::AssertSqlSafe(format!(
        "DROP TABLE \"{schema}\".idempotency_keys_migrations"
    )))
    .await
    .unwrap();
    store.migrate().await.unwrap();
    assert_eq!(
        store.reserve(req(&id, "fp")).await.unwrap(),
        Reservation::Completed(created(b"kept"))
    );
    takes_completes_replays(&store, "new").await;
}

/// A table that claims the latest version but lacks a column refuses to
/// serve, and says what to do.
#[tokio::test]
async fn postgres_a_table_that_does_not_match_refuses_to_start() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let (pool, schema, store) = migrated_pg_store(&url).await;
    pool.execute(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE \"{schema}\".idempotency_keys DROP COLUMN response_headers"
    )))
    .await
    .unwrap();
    let err = store.migrate().await.unwrap_err().to_string();
    assert!(
        err.contains("does not match schema version 7")
            && err.contains("response_headers")
            && err.contains("run migrate()"),
        "{err}"
    );
}

/// A column changed by hand to a type or collation that cannot hold what
/// idem writes, or that makes two ids one, refuses to serve (`migrate()`
/// and `check_schema()` name each column): before, a body column of `text`
/// stored each answer and every replay of it then failed (503 on every
/// retry of a request that was served), a `varchar(8)` key refused longer
/// keys, and a case-insensitive key answered the key `abc` with the answer
/// of `ABC`, as this test first shows.
#[tokio::test]
async fn postgres_columns_that_cannot_hold_what_idem_writes_refuse_to_start() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let cases = [
        (
            "ALTER TABLE {t} ALTER COLUMN response_body TYPE text USING encode(response_body, 'escape')",
            "response_body is text, where idem needs bytea",
        ),
        (
            "ALTER TABLE {t} ALTER COLUMN key TYPE varchar(8)",
            "key is character varying(8), where idem needs text or varchar of at least 255 characters",
        ),
        (
            "ALTER TABLE {t} ALTER COLUMN response_headers TYPE jsonb USING response_headers::jsonb",
            "response_headers is jsonb, where idem needs text or varchar without a length",
        ),
        (
            "ALTER TABLE {t} ALTER COLUMN attempt TYPE smallint",
            "attempt is smallint, where idem needs integer or bigint",
        ),
        (
            "ALTER TABLE {t} ALTER COLUMN lock_expires_at TYPE text",
            "lock_expires_at is text, where idem needs timestamptz",
        ),
        (
            // To the second: a lock of 1 s taken at .45 past a second was
            // stored as run out, and another server took it over while its
            // handler ran.
            "ALTER TABLE {t} ALTER COLUMN lock_expires_at TYPE timestamptz(0)",
            "lock_expires_at is timestamp(0) with time zone, where idem needs timestamptz, \
             to the millisecond at least",
        ),
        (
            // Read in each session's own time zone: a server whose
            // sessions were in another took a running lock over.
            "ALTER TABLE {t} ALTER COLUMN lock_expires_at TYPE timestamp",
            "lock_expires_at is timestamp without time zone, where idem needs timestamptz",
        ),
        (
            // Every completion failed: the token is NULL once the answer is stored.
            "CREATE DOMAIN {s}.tok AS text NOT NULL; ALTER TABLE {t} ALTER COLUMN lock_token TYPE {s}.tok",
            "lock_token is the domain",
        ),
        (
            // Every completion failed, as with the domain.
            "ALTER TABLE {t} ALTER COLUMN lock_token SET NOT NULL",
            "lock_token is NOT NULL, where idem writes NULL",
        ),
        (
            // `ON CONFLICT` takes both and refuses the deferrable one:
            // every reservation failed.
            "ALTER TABLE {t} DROP CONSTRAINT idempotency_keys_pkey; \
             ALTER TABLE {t} ADD PRIMARY KEY (tenant, scope, key) DEFERRABLE INITIALLY IMMEDIATE; \
             CREATE UNIQUE INDEX own_key ON {t} (tenant, scope, key)",
            "idempotency_keys_pkey is DEFERRABLE",
        ),
        (
            // Not an arbiter: of two first requests that race on a key,
            // one can fail on it (a duplicate key of this index, not a
            // conflict that ON CONFLICT answers).
            "CREATE UNIQUE INDEX own_wider ON {t} (tenant, scope, key, fingerprint)",
            "own_wider is not one ON CONFLICT takes",
        ),
        (
            "CREATE UNIQUE INDEX own_partial ON {t} (tenant, scope, key) WHERE key <> ''",
            "own_partial is not one ON CONFLICT takes",
        ),
        (
            "ALTER TABLE {t} ADD CONSTRAINT same_key EXCLUDE USING btree (tenant WITH =, scope WITH =, key WITH =)",
            "same_key is not one ON CONFLICT takes",
        ),
        (
            "ALTER TABLE {t} ADD CONSTRAINT ex EXCLUDE USING btree (tenant WITH =, scope WITH =, lower(key) WITH =)",
            "the exclusion constraint's index",
        ),
        (
            // Two tenants' same key.
            "CREATE UNIQUE INDEX key_alone ON {t} (key)",
            "key_alone does not hold tenant, scope and key",
        ),
        (
            // An operator class that compares keys as lower case.
            "CREATE FUNCTION {s}.ci_cmp(text, text) RETURNS int LANGUAGE sql IMMUTABLE AS \
             $$ SELECT CASE WHEN lower($1) < lower($2) THEN -1 WHEN lower($1) > lower($2) THEN 1 ELSE 0 END $$; \
             CREATE FUNCTION {s}.ci_lt(text, text) RETURNS bool LANGUAGE sql IMMUTABLE AS $$ SELECT lower($1) < lower($2) $$; \
             CREATE FUNCTION {s}.ci_le(text, text) RETURNS bool LANGUAGE sql IMMUTABLE AS $$ SELECT lower($1) <= lower($2) $$; \
             CREATE FUNCTION {s}.ci_eq(text, text) RETURNS bool LANGUAGE sql IMMUTABLE AS $$ SELECT lower($1) = lower($2) $$; \
             CREATE FUNCTION {s}.ci_ge(text, text) RETURNS bool LANGUAGE sql IMMUTABLE AS $$ SELECT lower($1) >= lower($2) $$; \
             CREATE FUNCTION {s}.ci_gt(text, text) RETURNS bool LANGUAGE sql IMMUTABLE AS $$ SELECT lower($1) > lower($2) $$; \
             CREATE OPERATOR {s}.~<~ (LEFTARG = text, RIGHTARG = text, FUNCTION = {s}.ci_lt); \
             CREATE OPERATOR {s}.~<=~ (LEFTARG = text, RIGHTARG = text, FUNCTION = {s}.ci_le); \
             CREATE OPERATOR {s}.~=~ (LEFTARG = text, RIGHTARG = text, FUNCTION = {s}.ci_eq); \
             CREATE OPERATOR {s}.~>=~ (LEFTARG = text, RIGHTARG = text, FUNCTION = {s}.ci_ge); \
             CREATE OPERATOR {s}.~>~ (LEFTARG = text, RIGHTARG = text, FUNCTION = {s}.ci_gt); \
             CREATE OPERATOR CLASS {s}.ci_ops FOR TYPE text USING btree AS \
             OPERATOR 1 {s}.~<~, OPERATOR 2 {s}.~<=~, OPERATOR 3 {s}.~=~, OPERATOR 4 {s}.~>=~, \
             OPERATOR 5 {s}.~>~, FUNCTION 1 {s}.ci_cmp(text, text); \
             CREATE UNIQUE INDEX ci_ops_key ON {t} (tenant, scope, key {s}.ci_ops)",
            "ci_ops_key does not hold tenant, scope and key",
        ),
        (
            "ALTER TABLE {t} ADD COLUMN id_ci text \
             GENERATED ALWAYS AS (tenant || '/' || scope || '/' || lower(key)) STORED; \
             CREATE UNIQUE INDEX generated_ci ON {t} (id_ci)",
            "generated_ci does not hold tenant, scope and key",
        ),
        (
            // The whole row, through a function.
            "CREATE FUNCTION {s}.id_ci(r {t}) RETURNS text LANGUAGE sql IMMUTABLE \
             AS $$ SELECT r.tenant || '/' || r.scope || '/' || lower(r.key) $$; \
             CREATE UNIQUE INDEX row_ci ON {t} ({s}.id_ci(idempotency_keys))",
            "row_ci does not hold tenant, scope and key",
        ),
        (
            // One key per tenant and scope: the operator, not the operator
            // class, says what conflicts.
            "CREATE EXTENSION IF NOT EXISTS btree_gist; \
             ALTER TABLE {t} ADD CONSTRAINT one_key EXCLUDE USING gist (tenant WITH =, scope WITH =, key WITH <>)",
            "the exclusion constraint's index",
        ),
        (
            "CREATE COLLATION {s}.ci (provider = icu, locale = 'und-u-ks-level2', deterministic = false); \
             ALTER TABLE {t} ALTER COLUMN key TYPE text COLLATE {s}.ci",
            "key has the nondeterministic collation ci",
        ),
        (
            // The column as it was, the unique key under such a collation:
            // the key abc, after ABC, was 503 on every try.
            "CREATE COLLATION {s}.ci (provider = icu, locale = 'und-u-ks-level2', deterministic = false); \
             ALTER TABLE {t} DROP CONSTRAINT idempotency_keys_pkey; \
             CREATE UNIQUE INDEX ci_key ON {t} (tenant, scope, key COLLATE {s}.ci)",
            "the unique index",
        ),
        (
            "CREATE UNIQUE INDEX lower_key ON {t} (tenant, scope, lower(key))",
            "lower_key does not hold tenant, scope and key",
        ),
    ];
    for (alter, says) in cases {
        let (pool, schema, store) = migrated_pg_store(&url).await;
        let s = format!("\"{schema}\"");
        let t = format!("{s}.idempotency_keys");
        if says.contains("collation ci") {
            // What such a collation does: another key's answer replayed.
            pool.execute(sqlx::AssertSqlSafe(alter.replace("{t}", &t).replace("{s}", &s)))
                .await
                .unwrap();
            takes_completes_replays(&store, "ABC").await;
            let other = RecordId::new("t", "s", "abc");
            assert_eq!(
                store.reserve(req(&other, "fp")).await.unwrap(),
                Reservation::Completed(created(b"ok")),
                "the key abc is answered as ABC was"
            );
        } else {
            pool.execute(sqlx::AssertSqlSafe(alter.replace("{t}", &t).replace("{s}", &s)))
                .await
                .unwrap();
        }
        for (what, result) in [
            ("check_schema", store.check_schema().await),
            ("migrate", store.migrate().await),
        ] {
            let err = result.expect_err(says).to_string();
            // Refused as a table that cannot serve, or take a reservation.
            assert!(err.contains(says) && err.contains("the table"), "{what}: {err}");
        }
    }
}

/// The checks of `check_schema()` (run by `migrate()` too, at every start)
/// are planned well below PostgreSQL's default `jit_above_cost` (100,000):
/// one that read `pg_index` whole, on a catalog of a few thousand
/// relations, was estimated at 48 million, and its JIT compilation took
/// about a second of every start (the check itself, 4 ms). Each statement
/// the checks prepared on the store's one connection is explained as it
/// is.
#[tokio::test]
async fn postgres_the_schema_checks_are_planned_below_the_jit_threshold() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let store = idem_testkit::pg_store_in(&url, &schema, 1).await;
    // Again, on the table made: the migrations table's own check runs too.
    store.migrate().await.unwrap();
    store.check_schema().await.unwrap();
    let statements: Vec<String> = sqlx::query_scalar(
        "SELECT statement FROM pg_prepared_statements WHERE statement NOT LIKE '%$1%' \
         AND (statement ILIKE 'SELECT%' OR statement ILIKE 'WITH%')",
    )
    .fetch_all(store.pool())
    .await
    .unwrap();
    assert!(
        statements.iter().any(|s| s.contains("pg_index"))
            && statements.iter().any(|s| s.contains("WITH RECURSIVE cols")),
        "the unique indexes' and the migrations table's checks were prepared: {statements:#?}"
    );
    for statement in statements {
        // The plan's first line: `Aggregate  (cost=12.34..56.78 rows=1 width=32)`.
        let (top,): (String,) = sqlx::query_as(sqlx::AssertSqlSafe(format!("EXPLAIN {statement}")))
            .fetch_one(store.pool())
            .await
            .unwrap();
        let cost: f64 = top
            .split_once("..")
            .and_then(|(_, rest)| rest.split_once(' '))
            .and_then(|(total, _)| total.parse().ok())
            .unwrap_or_else(|| panic!("no cost in {top}"));
        assert!(cost < 100_000.0, "estimated at {cost} ({top}): {statement}");
    }
}

/// A name the migrations give an index of their own, already held in the
/// table's schema by another table's index (a table renamed to keep it,
/// whose indexes kept their names) or by another relation: `migrate()`
/// refuses, naming it, and changes nothing. Before, `CREATE INDEX IF NOT
/// EXISTS` skipped idem's purge index (the janitor then read the whole
/// table), and version 5's `DROP INDEX IF EXISTS` dropped the other
/// table's expiry index. Once the table is past the versions that make
/// those names, a name taken later changes nothing.
#[tokio::test]
async fn postgres_an_index_name_held_by_another_table_is_refused_and_kept() {
    let Some(url) = idem_testkit::pg_url() else { return };
    for (held, says) in [
        (
            "CREATE INDEX idempotency_keys_expires_at_idx ON {s}.kept (expires_at)",
            "idempotency_keys_expires_at_idx is an index on",
        ),
        (
            "CREATE INDEX idempotency_keys_purge_at_idx ON {s}.kept (purge_at)",
            "idempotency_keys_purge_at_idx is an index on",
        ),
        (
            "CREATE TABLE {s}.idempotency_keys_purge_at_idx (x int)",
            "idempotency_keys_purge_at_idx is a table",
        ),
    ] {
        let schema = idem_testkit::pg_schema(&url).await;
        let pool = sqlx::PgPool::connect(&url).await.unwrap();
        let s = format!("\"{schema}\"");
        pool.execute(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {s}.kept (expires_at timestamptz, purge_at timestamptz); {}",
            held.replace("{s}", &s)
        )))
        .await
        .unwrap();
        let relations = || {
            let pool = pool.clone();
            let schema = schema.clone();
            async move {
                let names: Vec<String> = sqlx::query_scalar(
                    "SELECT relname::text FROM pg_class WHERE relnamespace = to_regnamespace($1) ORDER BY 1",
                )
                .bind(format!("\"{schema}\""))
                .fetch_all(&pool)
                .await
                .unwrap();
                names
            }
        };
        let before = relations().await;
        let store = PgStore::new(pool.clone())
            .with_table(Some(&schema), "idempotency_keys")
            .unwrap();
        let err = store.migrate().await.expect_err(says).to_string();
        assert!(
            err.contains(says) && err.contains("changed nothing") && err.contains("with_table"),
            "{err}"
        );
        assert_eq!(relations().await, before, "nothing made, nothing dropped");
    }

    // Past version 5, the expiry index's name taken since changes nothing.
    let (pool, schema, store) = migrated_pg_store(&url).await;
    pool.execute(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE \"{schema}\".kept (expires_at timestamptz); \
         CREATE INDEX idempotency_keys_expires_at_idx ON \"{schema}\".kept (expires_at)"
    )))
    .await
    .unwrap();
    store.migrate().await.unwrap();
    takes_completes_replays(&store, "after").await;
}

/// A table of someone else's under the name idem gives its migrations
/// table (`<table>_migrations`): `migrate()` refuses it by name, says why
/// and the way out, and makes nothing, where before it failed with the
/// database's "column \"version\" does not exist", or (with idem's columns
/// of other types, which PostgreSQL casts idem's numbers into, or without
/// a unique version, or a view that lists every version) made the table
/// and then failed every check with the driver's word for a type, or
/// served with versions it could not record.
#[tokio::test]
async fn postgres_a_migrations_table_of_someone_elses_is_refused_by_name() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let all = "SELECT v, 'x', 0 FROM generate_series(1, 7) AS v";
    for (made, why) in [
        (
            "CREATE TABLE {m} (id serial PRIMARY KEY, note text)",
            "it lacks version",
        ),
        (
            "CREATE TABLE {m} (version text PRIMARY KEY, name text, applied_at text)",
            "its columns applied_at, version are not of the type",
        ),
        (
            "CREATE TABLE {m} (version integer PRIMARY KEY, name text, applied_at bigint)",
            "its column version is not of the type",
        ),
        (
            "CREATE TABLE {m} (version bigint PRIMARY KEY, name text, applied_at numeric)",
            "its column applied_at is not of the type",
        ),
        (
            "CREATE TABLE {m} (version bigint, name text, applied_at bigint)",
            "not a unique key",
        ),
        (
            "CREATE TABLE {m} (version bigint, name text, applied_at bigint); INSERT INTO {m} {all}",
            "not a unique key",
        ),
        (
            "CREATE TABLE {m} (version bigint, name text, applied_at bigint); \
             CREATE UNIQUE INDEX ON {m} (version) WHERE version > 0",
            "not a unique key",
        ),
        (
            "CREATE VIEW {m} (version, name, applied_at) AS {all}",
            "not a table",
        ),
        (
            "CREATE TABLE {m} (version bigint PRIMARY KEY DEFERRABLE, name text, applied_at bigint); \
             CREATE UNIQUE INDEX ON {m} (version)",
            "DEFERRABLE",
        ),
        (
            "CREATE TABLE {m} (version bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, name text, \
             applied_at bigint)",
            "is generated",
        ),
        (
            "CREATE TABLE {m} (version bigint PRIMARY KEY, name varchar(3), applied_at bigint)",
            "name text of 32",
        ),
        (
            "CREATE TABLE {m} (version bigint PRIMARY KEY, name text, applied_at bigint); \
             CREATE RULE dropped AS ON INSERT TO {m} DO INSTEAD NOTHING",
            "did not keep the versions",
        ),
    ] {
        let schema = idem_testkit::pg_schema(&url).await;
        let m = format!("\"{schema}\".idempotency_keys_migrations");
        pool.execute(sqlx::AssertSqlSafe(made.replace("{m}", &m).replace("{all}", all)))
            .await
            .unwrap();
        let store = PgStore::new(pool.clone())
            .with_table(Some(&schema), "idempotency_keys")
            .unwrap();
        let err = store.migrate().await.unwrap_err().to_string();
        assert!(
            err.contains("idempotency_keys_migrations\"")
                && err.contains(why)
                && err.contains("nothing was changed")
                && err.contains("with_table"),
            "{made}: {err}"
        );
        let found = regclass(&pool, &format!("\"{schema}\".idempotency_keys")).await;
        assert_eq!(found, None, "{made}: nothing made");
    }
    // Made by hand as idem would, with a domain over a domain over bigint
    // and a varchar name: taken.
    let schema = idem_testkit::pg_schema(&url).await;
    pool.execute(sqlx::AssertSqlSafe(format!(
        "CREATE DOMAIN \"{schema}\".v1 AS bigint; CREATE DOMAIN \"{schema}\".v AS \"{schema}\".v1; \
         CREATE TABLE \"{schema}\".idempotency_keys_migrations \
         (version \"{schema}\".v PRIMARY KEY, name varchar(200), applied_at \"{schema}\".v)"
    )))
    .await
    .unwrap();
    let store = PgStore::new(pool.clone())
        .with_table(Some(&schema), "idempotency_keys")
        .unwrap();
    store.migrate().await.unwrap();
}

/// The same on SQLite, whose columns take any type: a version kept as
/// text, one without a unique key (also when it lists every version), or
/// a view.
#[tokio::test]
async fn sqlite_a_migrations_table_of_someone_elses_is_refused_by_name() {
    let all =
        "VALUES (1, 'x', 0), (2, 'x', 0), (3, 'x', 0), (4, 'x', 0), (5, 'x', 0), (6, 'x', 0), (7, 'x', 0)";
    for (made, why) in [
        (
            "CREATE TABLE m (id INTEGER PRIMARY KEY, note TEXT)",
            "it lacks version",
        ),
        (
            "CREATE TABLE m (version TEXT PRIMARY KEY, name TEXT, applied_at INTEGER); \
             INSERT INTO m VALUES ('one', 'x', 0)",
            "not declared as integers",
        ),
        (
            "CREATE TABLE m (version INTEGER, name TEXT, applied_at INTEGER)",
            "not a unique key",
        ),
        (
            "CREATE TABLE m (version INTEGER, name TEXT, applied_at INTEGER); INSERT INTO m {all}",
            "not a unique key",
        ),
        (
            "CREATE TABLE m (version INTEGER, name TEXT, applied_at INTEGER); \
             CREATE UNIQUE INDEX m_v ON m (version) WHERE version > 0",
            "not a unique key",
        ),
        (
            "CREATE VIEW m (version, name, applied_at) AS {all}",
            "not a table",
        ),
        (
            "CREATE TABLE m (version INTEGER PRIMARY KEY, name TEXT, applied_at INTEGER AS (version * 2))",
            "is generated",
        ),
        (
            "CREATE TABLE m (version INTEGER PRIMARY KEY, name TEXT, applied_at INTEGER); \
             CREATE TRIGGER dropped BEFORE INSERT ON m BEGIN SELECT RAISE(IGNORE); END",
            "did not keep the versions",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path().join("theirs.db")).await.unwrap();
        let made = made
            .replace(" ON m ", " ON idempotency_keys_migrations ")
            .replace(" m ", " idempotency_keys_migrations ")
            .replace(" m (", " idempotency_keys_migrations (")
            .replace("{all}", all);
        store
            .pool()
            .execute(sqlx::AssertSqlSafe(made.clone()))
            .await
            .unwrap();
        let err = store.migrate().await.unwrap_err().to_string();
        assert!(
            err.contains("idempotency_keys_migrations\"")
                && err.contains(why)
                && err.contains("nothing was changed"),
            "{made}: {err}"
        );
        let made_table: Option<String> =
            sqlx::query_scalar("SELECT name FROM sqlite_master WHERE name = 'idempotency_keys'")
                .fetch_optional(store.pool())
                .await
                .unwrap();
        assert_eq!(made_table, None, "{made}: nothing made");
    }
    // `INTEGER PRIMARY KEY` (the rowid, in no index) and an untyped
    // applied_at: taken.
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("ours.db")).await.unwrap();
    store
        .pool()
        .execute("CREATE TABLE idempotency_keys_migrations (version INTEGER PRIMARY KEY, name, applied_at)")
        .await
        .unwrap();
    store.migrate().await.unwrap();
}

/// A read-only session's `migrate()` on idem's own table with a version
/// to record is refused with the database's words, not taken for a table
/// of someone else's.
#[tokio::test]
async fn postgres_a_read_only_session_is_not_told_the_migrations_table_is_foreign() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let admin = sqlx::PgPool::connect(&url).await.unwrap();
    let store = |pool: sqlx::PgPool| {
        PgStore::new(pool)
            .with_table(Some(&schema), "idempotency_keys")
            .unwrap()
    };
    store(admin.clone()).migrate().await.unwrap();
    admin
        .execute(sqlx::AssertSqlSafe(format!(
            "DELETE FROM \"{schema}\".idempotency_keys_migrations WHERE version = 1"
        )))
        .await
        .unwrap();
    let options: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
    let read_only = sqlx::PgPool::connect_with(options.options([("default_transaction_read_only", "on")]))
        .await
        .unwrap();
    let err = store(read_only).migrate().await.unwrap_err().to_string();
    assert!(
        err.contains("read-only") && !err.contains("migrations table"),
        "{err}"
    );
}

/// With no schema configured, the table goes to the first schema of the
/// search path: one PostgreSQL keeps for itself (`information_schema`,
/// where a superuser's `migrate()` made idem's tables and function, or a
/// session's `pg_temp`, where the records would go with its connection)
/// is refused before anything is made; and so is a path of schemas none
/// of which exists, or a schema named that does not exist, said as such
/// by `migrate()` and `check_schema()` (which said "run migrate()"), where
/// they gave the database's words without the table.
#[tokio::test]
async fn postgres_a_schema_that_is_missing_or_postgresqls_own_is_refused() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let table = idem_testkit::unique("sys").replace('-', "_");
    for (path, named, says) in [
        (
            "information_schema",
            None,
            "in the schema information_schema, which is PostgreSQL's own",
        ),
        ("pg_temp", None, "which is PostgreSQL's own"),
        (
            "idem_no_such_schema",
            None,
            "no schema of the connection's search_path exists",
        ),
        (
            "public",
            Some("idem_no_such_schema"),
            "the schema \"idem_no_such_schema\" does not exist",
        ),
    ] {
        let options: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect_with(options.options([("search_path", path)]))
            .await
            .unwrap();
        let store = PgStore::new(pool.clone()).with_table(named, &table).unwrap();
        for err in [
            store.migrate().await.unwrap_err(),
            store.check_schema().await.unwrap_err(),
        ] {
            let err = err.to_string();
            assert!(
                err.contains("the table \"") && err.contains(says) && err.contains("nothing was changed"),
                "{path}: {err}"
            );
        }
        assert_eq!(
            regclass(&pool, &format!("\"{table}\"")).await,
            None,
            "{path}: nothing made"
        );
    }
    // An application's schema whose name begins with `pg` is not
    // PostgreSQL's, under `standard_conforming_strings = off` too (where
    // `LIKE 'pg\_%'` read `\_` as any character).
    let schema = format!("pgapp_{}", idem_testkit::pg_schema(&url).await);
    let admin = sqlx::PgPool::connect(&url).await.unwrap();
    admin
        .execute(sqlx::AssertSqlSafe(format!("CREATE SCHEMA \"{schema}\"")))
        .await
        .unwrap();
    let options: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options.options([
            ("search_path", schema.as_str()),
            ("standard_conforming_strings", "off"),
        ]))
        .await
        .unwrap();
    let store = PgStore::new(pool).with_table(None, &table).unwrap();
    store.migrate().await.unwrap();
    store.check_schema().await.unwrap();
    admin
        .execute(sqlx::AssertSqlSafe(format!("DROP SCHEMA \"{schema}\" CASCADE")))
        .await
        .unwrap();
}

/// With no schema configured, version 5 names the old expiry index bare,
/// and `DROP INDEX` finds it through the search path: where the table's
/// schema holds none (dropped by hand), an index of that name in a later
/// schema on the path (another table's) was dropped. It is dropped only
/// where it is an index on idem's table.
#[tokio::test]
async fn postgres_an_expiry_index_name_later_on_the_search_path_is_kept() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let (own, later) = (
        idem_testkit::pg_schema(&url).await,
        idem_testkit::pg_schema(&url).await,
    );
    let admin = sqlx::PgPool::connect(&url).await.unwrap();
    // A table at version 4 whose expiry index was dropped by hand.
    PgStore::new(admin.clone())
        .with_table(Some(&own), "idempotency_keys")
        .unwrap()
        .migrate()
        .await
        .unwrap();
    admin
        .execute(sqlx::AssertSqlSafe(format!(
            "DELETE FROM \"{own}\".idempotency_keys_migrations WHERE version >= 5; \
             ALTER TABLE \"{own}\".idempotency_keys DROP COLUMN purge_at; \
             CREATE TABLE \"{later}\".kept (expires_at timestamptz); \
             CREATE UNIQUE INDEX idempotency_keys_expires_at_idx ON \"{later}\".kept (expires_at)"
        )))
        .await
        .unwrap();
    let options: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
    let pool = sqlx::PgPool::connect_with(
        options.options([("search_path", format!("\"{own}\",\"{later}\"").as_str())]),
    )
    .await
    .unwrap();
    let store = PgStore::new(pool);
    store.migrate().await.unwrap();
    takes_completes_replays(&store, "after").await;
    let kept: Option<String> = sqlx::query_scalar(
        "SELECT indexrelid::regclass::text FROM pg_index WHERE indrelid = to_regclass($1)",
    )
    .bind(format!("\"{later}\".kept"))
    .fetch_optional(&admin)
    .await
    .unwrap();
    assert!(kept.is_some(), "the other table's index was dropped");
}

/// The same on SQLite, where version 7's triggers have names of their
/// own too, and names are one in any case.
#[tokio::test]
async fn sqlite_an_index_or_trigger_name_held_by_another_table_is_refused_and_kept() {
    for (held, says) in [
        (
            "CREATE INDEX IDEMPOTENCY_KEYS_expires_at_idx ON kept (expires_at)",
            "IDEMPOTENCY_KEYS_expires_at_idx\" is an index on \"kept\"",
        ),
        (
            "CREATE INDEX idempotency_keys_purge_at_idx ON kept (purge_at)",
            "idempotency_keys_purge_at_idx\" is an index on \"kept\"",
        ),
        (
            "CREATE TRIGGER idempotency_keys_times_on_insert AFTER INSERT ON kept BEGIN SELECT 1; END",
            "idempotency_keys_times_on_insert\" is a trigger on \"kept\"",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path().join("held.db")).await.unwrap();
        store
            .pool()
            .execute(sqlx::AssertSqlSafe(format!(
                "CREATE TABLE kept (expires_at INTEGER, purge_at INTEGER); {held}"
            )))
            .await
            .unwrap();
        let schema = || async {
            let names: Vec<(String, String)> =
                sqlx::query_as("SELECT type, name FROM sqlite_master ORDER BY type, name")
                    .fetch_all(store.pool())
                    .await
                    .unwrap();
            names
        };
        let before = schema().await;
        let err = store.migrate().await.expect_err(says).to_string();
        assert!(err.contains(says) && err.contains("changed nothing"), "{err}");
        assert_eq!(schema().await, before, "nothing made, nothing dropped");
    }
    // Triggers are a namespace of their own: a view named as a trigger of
    // idem's, or a trigger named as an index of idem's, holds nothing.
    for held in [
        "CREATE VIEW idempotency_keys_times_on_insert AS SELECT 1",
        "CREATE TRIGGER idempotency_keys_purge_at_idx AFTER INSERT ON kept BEGIN SELECT 1; END",
    ] {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path().join("other.db")).await.unwrap();
        store
            .pool()
            .execute(sqlx::AssertSqlSafe(format!(
                "CREATE TABLE kept (expires_at INTEGER, purge_at INTEGER); {held}"
            )))
            .await
            .unwrap();
        store.migrate().await.unwrap();
        takes_completes_replays(&store, "served").await;
    }
}

/// SQLite: a table made by hand whose key has a numeric affinity, or a
/// collation other than `BINARY`, makes two keys one record (as this test
/// first shows: the key `1e3` answered with the answer of `1000`, `abc`
/// with that of `ABC`); `migrate()` and `check_schema()` refuse it, naming
/// the column.
#[tokio::test]
async fn sqlite_id_columns_that_make_two_keys_one_refuse_to_start() {
    for (i, (declared, first, second, says)) in [
        (
            "key NUMERIC NOT NULL",
            "1000",
            "1e3",
            "key is declared NUMERIC, whose numeric affinity",
        ),
        (
            "key TEXT NOT NULL COLLATE NOCASE",
            "ABC",
            "abc",
            "key has a collation under which two different ids are equal",
        ),
        (
            // The column's collation decides the statements' comparisons,
            // whatever the key's index says.
            "key TEXT NOT NULL COLLATE NOCASE",
            "ABC",
            "abc",
            "key has a collation under which two different ids are equal",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path().join("hand.db")).await.unwrap();
        let mut table =
            V1_SQLITE
                .replace("{t}", "\"idempotency_keys\"")
                .replacen("key TEXT NOT NULL", declared, 1);
        if i == 2 {
            // The key's index `BINARY`, the column not.
            table = table.replacen(
                "PRIMARY KEY (tenant, scope, key)",
                "PRIMARY KEY (tenant, scope, key COLLATE BINARY)",
                1,
            );
        }
        store.pool().execute(sqlx::AssertSqlSafe(table)).await.unwrap();
        let err = store.migrate().await.expect_err(says).to_string();
        assert!(
            err.contains(says) && err.contains("cannot serve as it is"),
            "migrate: {err}"
        );
        takes_completes_replays(&store, first).await;
        assert_eq!(
            store
                .reserve(req(&RecordId::new("t", "s", second), "fp"))
                .await
                .unwrap(),
            Reservation::Completed(created(b"ok")),
            "{declared}: the key {second} is answered as {first} was"
        );
        let err = store.check_schema().await.expect_err(says).to_string();
        assert!(err.contains(says), "check_schema: {err}");
    }
}

/// SQLite: a unique index of the table's own that does not hold the key as
/// a column (`lower(key)`) made the key `abc`, after `ABC`, fail on every
/// try; refused. One that holds tenant, scope and key (`COLLATE binary`,
/// as written in lower case, or with more columns) passes.
#[tokio::test]
async fn sqlite_a_unique_index_that_makes_two_keys_one_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("index.db")).await.unwrap();
    store.migrate().await.unwrap();
    store
        .pool()
        .execute(
            "CREATE UNIQUE INDEX wider ON idempotency_keys (tenant, scope, key COLLATE binary, fingerprint)",
        )
        .await
        .unwrap();
    store
        .pool()
        .execute("CREATE UNIQUE INDEX own_operation ON idempotency_keys (operation_id)")
        .await
        .unwrap();
    store
        .check_schema()
        .await
        .expect("indexes that never make two ids one pass");
    takes_completes_replays(&store, "ABC").await;
    takes_completes_replays(&store, "DEF").await;
    for (index, name) in [
        (
            "CREATE UNIQUE INDEX lower_key ON idempotency_keys (tenant, scope, lower(key))",
            "lower_key",
        ),
        (
            "ALTER TABLE idempotency_keys ADD COLUMN id_ci TEXT GENERATED ALWAYS AS \
             (tenant || '/' || scope || '/' || lower(key)) VIRTUAL; \
             CREATE UNIQUE INDEX generated_ci ON idempotency_keys (id_ci)",
            "generated_ci",
        ),
    ] {
        store.pool().execute(index).await.unwrap();
        for result in [store.check_schema().await, store.migrate().await] {
            let err = result.expect_err("refused").to_string();
            assert!(
                err.contains(&format!(
                    "the unique index {name} does not hold tenant, scope and key"
                )),
                "{err}"
            );
        }
        store
            .pool()
            .execute(sqlx::AssertSqlSafe(format!("DROP INDEX {name}")))
            .await
            .unwrap();
    }
}

/// A partitioned table: what one of its partitions holds counts as the
/// table's own, and each of these passed before and then failed: a unique
/// index on `lower(key)` (the key `abc` after `ABC`, on every try), a
/// `NOT NULL` token (every completion), a partition attached with a
/// `DEFERRABLE` key of its own (every reservation, as `ON CONFLICT` takes
/// it for the partition's rows).
#[tokio::test]
async fn postgres_a_partition_that_cannot_serve_refuses_to_start() {
    let Some(url) = idem_testkit::pg_url() else { return };
    for (change, says) in [
        (
            "CREATE UNIQUE INDEX lower_on_partition ON {s}.p0 (tenant, scope, lower(key))",
            "lower_on_partition does not hold tenant, scope and key",
        ),
        (
            // Not attached to the table's key: not an arbiter for the
            // partition's rows, and of two first requests that race on a
            // key one failed on it (3 in 1,800 in a review's run).
            "CREATE UNIQUE INDEX own_on_partition ON {s}.p0 (tenant, scope, key)",
            "own_on_partition is not one ON CONFLICT takes",
        ),
        (
            "UPDATE {s}.p0 SET lock_token = '-' WHERE lock_token IS NULL; \
             ALTER TABLE {s}.p0 ALTER COLUMN lock_token SET NOT NULL",
            "lock_token is NOT NULL in the partition",
        ),
        (
            "ALTER TABLE {t} DETACH PARTITION {s}.p0; DROP TABLE {s}.p0; \
             CREATE TABLE {s}.p0 (LIKE {t} INCLUDING DEFAULTS); \
             ALTER TABLE {s}.p0 ADD PRIMARY KEY (tenant, scope, key) DEFERRABLE INITIALLY IMMEDIATE; \
             ALTER TABLE {t} ATTACH PARTITION {s}.p0 FOR VALUES WITH (MODULUS 1, REMAINDER 0)",
            "is DEFERRABLE",
        ),
    ] {
        let schema = idem_testkit::pg_schema(&url).await;
        let pool = sqlx::PgPool::connect(&url).await.unwrap();
        let (s, t) = (format!("\"{schema}\""), format!("\"{schema}\".idempotency_keys"));
        pool.execute(sqlx::AssertSqlSafe(V1_POSTGRES.replace("{t}", &t).replacen(
            "PRIMARY KEY (tenant, scope, key));",
            &format!(
                "PRIMARY KEY (tenant, scope, key)) PARTITION BY HASH (tenant); \
                 CREATE TABLE {s}.p0 PARTITION OF {t} FOR VALUES WITH (MODULUS 1, REMAINDER 0);"
            ),
            1,
        )))
        .await
        .unwrap();
        let store = PgStore::new(pool.clone())
            .with_table(Some(&schema), "idempotency_keys")
            .unwrap();
        store.migrate().await.expect("a partitioned table serves");
        takes_completes_replays(&store, "ABC").await;
        pool.execute(sqlx::AssertSqlSafe(change.replace("{s}", &s).replace("{t}", &t)))
            .await
            .unwrap();
        for result in [store.check_schema().await, store.migrate().await] {
            let err = result.expect_err(says).to_string();
            assert!(err.contains(says), "{err}");
        }
    }
}

/// SQLite: a column where idem writes NULL made `NOT NULL` (every
/// completion failed) is refused; column and table names are SQLite's, in
/// any case (`KEY`, a `STRICT` table made as `IDEMPOTENCY_KEYS`), and pass.
#[tokio::test]
async fn sqlite_not_null_where_idem_writes_null_refuses_and_names_in_any_case_pass() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("not-null.db")).await.unwrap();
    // The table alone: its row has no token.
    let table = V1_SQLITE
        .replace("{t}", "\"idempotency_keys\"")
        .replacen("lock_token TEXT,", "lock_token TEXT NOT NULL DEFAULT '',", 1)
        .split("; INSERT")
        .next()
        .unwrap()
        .to_owned();
    store.pool().execute(sqlx::AssertSqlSafe(table)).await.unwrap();
    for result in [store.migrate().await, store.check_schema().await] {
        let err = result.expect_err("refused").to_string();
        assert!(
            err.contains("lock_token is NOT NULL, where idem writes NULL"),
            "{err}"
        );
    }
    for (name, table) in [
        (
            "upper-case-key.db",
            V1_SQLITE.replace("{t}", "\"idempotency_keys\"").replacen(
                "key TEXT NOT NULL",
                "KEY TEXT NOT NULL",
                1,
            ),
        ),
        (
            "upper-case-table.db",
            V1_SQLITE
                .replace("{t}", "\"IDEMPOTENCY_KEYS\"")
                .replacen("key TEXT NOT NULL", "key ANY NOT NULL", 1)
                .replacen("WITHOUT ROWID;", "WITHOUT ROWID, STRICT;", 1),
        ),
    ] {
        let store = SqliteStore::open(dir.path().join(name)).await.unwrap();
        store.pool().execute(sqlx::AssertSqlSafe(table)).await.unwrap();
        store.migrate().await.expect(name);
        takes_completes_replays(&store, "1000").await;
        takes_completes_replays(&store, "1e3").await;
    }
}

/// SQLite: a `STRICT` table keeps a key declared `ANY` as the text it is
/// (`1000` and `1e3` stay two records): it passes.
#[tokio::test]
async fn sqlite_a_strict_table_with_any_keys_serves() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("strict.db")).await.unwrap();
    let table = V1_SQLITE
        .replace("{t}", "\"idempotency_keys\"")
        .replacen("key TEXT NOT NULL", "key ANY NOT NULL", 1)
        .replacen("WITHOUT ROWID;", "WITHOUT ROWID, STRICT;", 1);
    store.pool().execute(sqlx::AssertSqlSafe(table)).await.unwrap();
    store.migrate().await.expect("a STRICT table's ANY keeps text");
    takes_completes_replays(&store, "1000").await;
    takes_completes_replays(&store, "1e3").await;
}

/// Columns changed by hand to types that hold every value idem writes (a
/// `varchar` as long as the longest, a domain over `text`, a narrower or
/// wider integer, times to the millisecond) pass, and serve: the longest
/// key is taken, completed and replayed.
#[tokio::test]
async fn postgres_columns_changed_to_types_that_hold_what_idem_writes_serve() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let (pool, schema, store) = migrated_pg_store(&url).await;
    let s = format!("\"{schema}\"");
    pool.execute(sqlx::AssertSqlSafe(format!(
        "CREATE DOMAIN {s}.text_of AS text; CREATE DOMAIN {s}.print AS {s}.text_of; \
         CREATE DOMAIN {s}.short AS varchar(32); CREATE DOMAIN {s}.token AS {s}.short; \
         ALTER TABLE {s}.idempotency_keys ALTER COLUMN key TYPE varchar(255), \
         ALTER COLUMN tenant TYPE varchar, ALTER COLUMN fingerprint TYPE {s}.print, \
         ALTER COLUMN lock_token TYPE {s}.token, ALTER COLUMN operation_id TYPE varchar(32), \
         ALTER COLUMN response_status TYPE smallint, \
         ALTER COLUMN attempt TYPE bigint, ALTER COLUMN expires_at TYPE timestamptz(3)"
    )))
    .await
    .unwrap();
    store
        .check_schema()
        .await
        .expect("the table passes the schema check");
    store.migrate().await.expect("and migrate() agrees");
    takes_completes_replays(&store, &"k".repeat(255)).await;
    // Indexes of the application's own: on other columns (a predicate on
    // the id's is no column of the index), or on the id in another order
    // or compared as text is (`text_pattern_ops`), which `ON CONFLICT`
    // takes as it takes the primary key; a domain `NOT NULL` where idem
    // always writes; and a unique index that a failed `CREATE INDEX
    // CONCURRENTLY` left, not ready, which enforces nothing.
    let t = format!("{s}.idempotency_keys");
    pool.execute(sqlx::AssertSqlSafe(format!(
        "CREATE UNIQUE INDEX own_operation ON {t} (operation_id); \
         CREATE UNIQUE INDEX own_same ON {t} (key, scope, tenant) INCLUDE (state); \
         ALTER TABLE {t} ADD COLUMN \"api key\" text, ADD COLUMN \"tenant-ref\" text; \
         CREATE UNIQUE INDEX own_named ON {t} (\"api key\", \"tenant-ref\"); \
         CREATE UNIQUE INDEX own_partial ON {t} (operation_id) WHERE key <> '' AND tenant <> 'x'; \
         CREATE UNIQUE INDEX own_pattern ON {t} (tenant, scope, key text_pattern_ops); \
         CREATE DOMAIN {s}.filled AS text NOT NULL; \
         ALTER TABLE {t} ALTER COLUMN scope TYPE {s}.filled"
    )))
    .await
    .unwrap();
    takes_completes_replays(&store, "ABC").await;
    takes_completes_replays(&store, "abc").await;
    let failed = pool
        .execute(sqlx::AssertSqlSafe(format!(
            "CREATE UNIQUE INDEX CONCURRENTLY lower_key ON {t} (tenant, scope, lower(key))"
        )))
        .await;
    assert!(failed.is_err(), "ABC and abc are both there");
    store
        .check_schema()
        .await
        .expect("the table passes the schema check");
    takes_completes_replays(&store, "XyZ").await;
    takes_completes_replays(&store, "xyz").await;
}

/// The reservation function gone (dropped by hand, or a restore that left
/// functions out): the store refuses to start and says what to do, and
/// `migrate()` brings it back.
#[tokio::test]
async fn postgres_a_missing_reservation_function_is_refused_then_restored() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let (pool, schema, store) = migrated_pg_store(&url).await;
    pool.execute(sqlx::AssertSqlSafe(format!(
        "DROP FUNCTION \"{schema}\".idempotency_keys_take"
    )))
    .await
    .unwrap();
    let err = store.check_schema().await.unwrap_err().to_string();
    assert!(
        err.contains("reservation function") && err.contains("run migrate()"),
        "{err}"
    );
    store.migrate().await.unwrap();
    takes_completes_replays(&store, "after-restore").await;
}

/// A build from before migration 6 that still serves during a rolling
/// upgrade calls version 4's set-returning function: it is still there
/// after the upgrade, takes a fresh key (attempt 1), takes nothing while
/// that key is held, and this build sees that holder's record in progress.
#[tokio::test]
async fn postgres_the_function_of_builds_before_version_6_still_serves() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let (pool, schema, store) = migrated_pg_store(&url).await;
    let old_build = format!(
        "SELECT attempt, taken_over, operation_id FROM \"{schema}\".idempotency_keys_reserve(\
         't', 's', 'rolling', 'fp', 'old-token', 'old-op', 3600000, 3600000)"
    );
    let taken: Vec<(i32, i32, String)> = sqlx::query_as(sqlx::AssertSqlSafe(old_build.clone()))
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(taken, [(1, 0, "old-op".to_owned())]);
    let again: Vec<(i32, i32, String)> = sqlx::query_as(sqlx::AssertSqlSafe(old_build))
        .fetch_all(&pool)
        .await
        .unwrap();
    assert!(again.is_empty(), "a held key is not taken twice: {again:?}");
    let id = RecordId::new("t", "s", "rolling");
    assert!(matches!(
        store.reserve(req(&id, "fp")).await.unwrap(),
        Reservation::InProgress { .. }
    ));
    assert!(store.complete(&id, "old-token", &created(b"old")).await.is_ok());
    assert!(matches!(
        store.reserve(req(&id, "fp")).await.unwrap(),
        Reservation::Completed(_)
    ));
}

/// A released record whose `attempt` someone set out of range by hand is
/// taken and read as attempt 1, as before migration 6; nothing is left
/// locked under a token that no execution holds.
#[tokio::test]
async fn postgres_an_attempt_out_of_range_is_taken_as_attempt_1() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let (pool, schema, store) = migrated_pg_store(&url).await;
    pool.execute(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{schema}\".idempotency_keys (tenant, scope, key, fingerprint, state, operation_id, \
         lock_token, attempt, lock_expires_at, created_at, expires_at) VALUES ('t', 's', 'negative', 'fp', \
         'in_progress', 'op', NULL, -5, now(), now(), now() + interval '1 hour')"
    )))
    .await
    .unwrap();
    let id = RecordId::new("t", "s", "negative");
    let Reservation::Reserved(lease) = store.reserve(req(&id, "fp")).await.unwrap() else {
        panic!("the released record is taken")
    };
    assert_eq!((lease.attempt, lease.operation_id.as_str()), (1, "op"));
    store.complete(&id, &lease.token, &created(b"ok")).await.unwrap();
}

/// The check constraints of `table` in `schema` (the one on `state` is
/// the only one idem ever made).
async fn state_checks(pool: &sqlx::PgPool, schema: &str, table: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_constraint WHERE contype = 'c' AND conrelid = \
         (quote_ident($1) || '.' || quote_ident($2))::regclass",
    )
    .bind(schema)
    .bind(table)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// `migrate()` drops the check on `state` (PostgreSQL rebuilt it in every
/// write). A state that only a hand edit can write reads as a record in
/// progress: a conflict, never replayed, never run, and no write of idem's
/// touches it; once gone by the retention rule, the key is reserved afresh.
#[tokio::test]
async fn postgres_a_state_edited_by_hand_is_a_conflict_until_gone() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let (pool, schema, store) = migrated_pg_store(&url).await;
    assert_eq!(state_checks(&pool, &schema, "idempotency_keys").await, 0);
    let t = format!("\"{schema}\".idempotency_keys");
    // Released (no lock token, deadline passed) and with the request's
    // fingerprint: with `in_progress` it would be taken and run again.
    pool.execute(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {t} (tenant, scope, key, fingerprint, state, operation_id, lock_token, attempt, \
         lock_expires_at, created_at, expires_at) VALUES ('t', 's', 'edited', 'fp', 'paused', 'op', NULL, 1, \
         now() - interval '1 minute', now() - interval '1 minute', now() + interval '1 hour')"
    )))
    .await
    .unwrap();
    let id = RecordId::new("t", "s", "edited");
    for _ in 0..2 {
        assert!(
            matches!(
                store.reserve(req(&id, "fp")).await.unwrap(),
                Reservation::InProgress { .. }
            ),
            "an unknown state is neither taken nor replayed"
        );
        assert_eq!(
            store.reserve(req(&id, "other")).await.unwrap(),
            Reservation::Mismatch
        );
    }
    let state: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT state FROM {t} WHERE key = 'edited'"
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(state, "paused", "nothing of idem's wrote the row");
    // Gone by the records' rule (a whole TTL past its lock deadline): a new
    // operation.
    pool.execute(sqlx::AssertSqlSafe(format!(
        "UPDATE {t} SET created_at = now() - interval '3 hours', expires_at = now() - interval '2 hours', \
         lock_expires_at = now() - interval '2 hours' WHERE key = 'edited'"
    )))
    .await
    .unwrap();
    let Reservation::Reserved(lease) = store.reserve(req(&id, "fp")).await.unwrap() else {
        panic!("a gone record is reserved afresh")
    };
    assert_eq!(lease.attempt, 1);
    assert_ne!(lease.operation_id, "op");
    store.complete(&id, &lease.token, &created(b"ok")).await.unwrap();
    assert_eq!(
        store.reserve(req(&id, "fp")).await.unwrap(),
        Reservation::Completed(created(b"ok"))
    );
}

/// The names of the check constraints of `table` in `schema`.
async fn check_names(pool: &sqlx::PgPool, schema: &str, table: &str) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT conname::text FROM pg_constraint WHERE contype = 'c' AND conrelid = \
         (quote_ident($1) || '.' || quote_ident($2))::regclass ORDER BY conname",
    )
    .bind(schema)
    .bind(table)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// A transaction that has read the table in `schema`, and so holds its
/// lock (as an earlier build's request would) until it ends.
async fn reading(pool: &sqlx::PgPool, schema: &str) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut reader = pool.begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM \"{schema}\".idempotency_keys"
    )))
    .execute(&mut *reader)
    .await
    .unwrap();
    reader
}

/// Gives the migrated table in `schema` the first schema's check again, and
/// returns a transaction that has read it (and holds off the lock the
/// check's drop needs until it ends).
async fn checked_and_read(pool: &sqlx::PgPool, schema: &str) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let t = format!("\"{schema}\".idempotency_keys");
    pool.execute(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE {t} ADD CONSTRAINT idempotency_keys_state_check \
         CHECK (state IN ('in_progress', 'completed'))"
    )))
    .await
    .unwrap();
    reading(pool, schema).await
}

/// A session whose `statement_timeout` is shorter than half a second would
/// cancel the check's drop while it waits for the lock (and `migrate()` with
/// it, at every start): it waits at most half the statement timeout. (Run
/// as one's own tool runs it: `migrate()` would first wait for the other
/// tests' migrations, under the migration lock.)
#[tokio::test]
async fn postgres_the_check_drop_waits_within_the_statement_timeout() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let (pool, schema, store) = migrated_pg_store(&url).await;
    let reader = checked_and_read(&pool, &schema).await;
    let (_, (_, result)) = drop_in_a_session(&url, &store, "SET statement_timeout = '200ms'").await;
    result.unwrap();
    kept_then_dropped(&pool, &schema, &store, reader).await;
}

/// Runs the check's drop of `store` on a connection of its own set up by
/// `setup`: how long it took, its result, and the connection.
async fn drop_in_a_session(
    url: &str,
    store: &PgStore,
    setup: &'static str,
) -> (sqlx::PgConnection, (Duration, Result<(), sqlx::Error>)) {
    let mut conn = sqlx::PgConnection::connect(url).await.unwrap();
    conn.execute(setup).await.unwrap();
    let started = std::time::Instant::now();
    let result = conn
        .execute(sqlx::AssertSqlSafe(store.state_check_drop_sql().to_owned()))
        .await
        .map(drop);
    (conn, (started.elapsed(), result))
}

/// After a `migrate()` that could not take the table's lock from `reader`:
/// the check is still there and the store serves; once `reader` ends, the
/// next `migrate()` drops it.
async fn kept_then_dropped(
    pool: &sqlx::PgPool,
    schema: &str,
    store: &PgStore,
    reader: sqlx::Transaction<'static, sqlx::Postgres>,
) {
    assert_eq!(
        check_names(pool, schema, "idempotency_keys").await,
        ["idempotency_keys_state_check"],
        "the check stays while the lock is held"
    );
    takes_completes_replays(store, "while-held").await;
    reader.rollback().await.unwrap();
    store.migrate().await.unwrap();
    assert_eq!(state_checks(pool, schema, "idempotency_keys").await, 0);
}

/// `url` with a server setting for every session of its pool.
fn with_setting(url: &str, name: &str, value: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}options=-c%20{name}%3D{value}")
}

/// An operator's shorter `lock_timeout` bounds the check's drop's wait (every
/// request waits behind it), and is the session's again afterwards.
#[tokio::test]
async fn postgres_the_check_drop_keeps_a_shorter_lock_timeout() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let (pool, schema, store) = migrated_pg_store(&url).await;
    let reader = checked_and_read(&pool, &schema).await;
    let (mut conn, (waited, result)) = drop_in_a_session(&url, &store, "SET lock_timeout = '20ms'").await;
    result.unwrap();
    // 500 ms if the session's bound were raised to the drop's own.
    assert!(waited < Duration::from_millis(400), "{waited:?}");
    let now: String = sqlx::query_scalar("SHOW lock_timeout")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(now, "20ms");
    kept_then_dropped(&pool, &schema, &store, reader).await;
}

/// Dropping the check needs the table's lock, and every request to the
/// table queues behind a migration that waits for it: the drop waits at
/// most half a second (here, behind a transaction that has read the table),
/// leaves the check, and the next `migrate()` drops it.
#[tokio::test]
async fn postgres_the_check_drop_never_waits_long_for_the_tables_lock() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let (pool, schema, store) = migrated_pg_store(&url).await;
    let reader = checked_and_read(&pool, &schema).await;
    let migrated = tokio::time::timeout(Duration::from_secs(10), store.migrate()).await;
    assert!(
        matches!(migrated, Ok(Ok(()))),
        "migrate() while a transaction holds the table: {migrated:?}"
    );
    kept_then_dropped(&pool, &schema, &store, reader).await;
}

/// A table at the first released schema, in a fresh schema, with a store
/// on it (not migrated), and a transaction that has read the table and
/// holds it until it ends.
async fn v1_table_held(
    url: &str,
) -> (
    sqlx::PgPool,
    String,
    PgStore,
    sqlx::Transaction<'static, sqlx::Postgres>,
) {
    let schema = idem_testkit::pg_schema(url).await;
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    let t = format!("\"{schema}\".\"idempotency_keys\"");
    pool.execute(sqlx::AssertSqlSafe(V1_POSTGRES.replace("{t}", &t)))
        .await
        .unwrap();
    let reader = reading(&pool, &schema).await;
    let store = PgStore::new(pool.clone())
        .with_table(Some(&schema), "idempotency_keys")
        .unwrap();
    (pool, schema, store, reader)
}

/// The waits for a lock on the table in `schema`: each one's lock mode,
/// the waiting session's `application_name`, and when it began (seconds
/// since the epoch, by the server's clock).
async fn lock_waits(pool: &sqlx::PgPool, schema: &str) -> Vec<(String, String, f64)> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT l.mode, coalesce(a.application_name, ''), extract(epoch FROM l.waitstart)::float8 \
         FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
         WHERE l.relation = '\"{schema}\".\"idempotency_keys\"'::regclass AND NOT l.granted"
    )))
    .fetch_all(pool)
    .await
    .unwrap()
}

/// An upgrade needs the table's lock, and every request to the table queues
/// behind a migration that waits for it. Behind a transaction that holds
/// the table through the whole upgrade, `migrate()` waits at most about a
/// second at a time, so requests to the table (here an earlier build's
/// replay, read again and again) are never held up longer; then it gives
/// up, says why, and leaves the table as it was.
#[tokio::test]
async fn postgres_an_upgrade_never_holds_requests_up_behind_a_long_transaction() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let (pool, schema, store, reader) = v1_table_held(&url).await;
    let migrating = tokio::spawn(async move { store.migrate().await });
    let (started, mut slowest) = (std::time::Instant::now(), Duration::ZERO);
    while !migrating.is_finished() {
        let asked = std::time::Instant::now();
        let read = tokio::time::timeout(
            Duration::from_secs(10),
            sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(format!(
                "SELECT count(*) FROM \"{schema}\".\"idempotency_keys\" WHERE key = 'old'"
            )))
            .fetch_one(&pool),
        )
        .await;
        assert!(
            matches!(read, Ok(Ok(1))),
            "a request to the table queued behind the upgrade for {:?}: {read:?}",
            asked.elapsed()
        );
        slowest = slowest.max(asked.elapsed());
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "migrate() still waits after a minute"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let e = migrating.await.unwrap().expect_err("the lock never frees");
    assert!(e.is_unavailable(), "{e}");
    assert!(e.to_string().contains("run migrate() again"), "{e}");
    // Each wait for a lock lasts at most two seconds (1.25 s with
    // PostgreSQL's default `deadlock_timeout`).
    assert!(
        slowest < Duration::from_secs(4),
        "a request waited {slowest:?} behind the upgrade"
    );
    // Nothing changed: the first schema, no version recorded.
    let columns: Vec<String> = sqlx::query_scalar(
        "SELECT column_name::text FROM information_schema.columns WHERE table_schema = $1 \
         AND table_name = 'idempotency_keys' AND column_name IN ('taken_over', 'purge_at')",
    )
    .bind(&schema)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(columns.is_empty(), "{columns:?}");
    reader.commit().await.unwrap();
    let store = PgStore::new(pool.clone())
        .with_table(Some(&schema), "idempotency_keys")
        .unwrap();
    store.migrate().await.unwrap();
    serves_after_the_upgrade(&store).await;
}

/// An upgrade whose first try could not take the table's lock tries again
/// after a pause, and applies once the transaction that held it ends. Its
/// wait lasts past the server's `deadlock_timeout`, when PostgreSQL checks
/// the wait and cancels an autovacuum in the way (one would otherwise hold
/// every try off).
#[tokio::test]
async fn postgres_an_upgrade_that_could_not_take_the_lock_applies_once_it_frees() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let (pool, schema, store, reader) = v1_table_held(&url).await;
    let store_ = store.clone();
    let migrating = tokio::spawn(async move { store_.migrate().await });
    // Its first try waits for the lock, gives up, and pauses.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    // When the wait began, by the server's clock.
    let began = loop {
        if let Some((_, _, began)) = lock_waits(&pool, &schema).await.first() {
            break *began;
        }
        assert!(std::time::Instant::now() < deadline, "the upgrade never waited");
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    while !lock_waits(&pool, &schema).await.is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the upgrade still waits for the lock"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (lasted, deadlock): (f64, f64) = sqlx::query_as(
        "SELECT extract(epoch FROM clock_timestamp())::float8 - $1, \
         extract(epoch FROM current_setting('deadlock_timeout')::interval)::float8",
    )
    .bind(began)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(
        lasted >= deadlock,
        "the wait gave up after {lasted:.3} s, before the server's deadlock_timeout ({deadlock} s)"
    );
    assert!(!migrating.is_finished(), "{:?}", migrating.await);
    reader.commit().await.unwrap();
    migrating.await.unwrap().unwrap();
    let versions: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT version FROM \"{schema}\".\"idempotency_keys_migrations\" ORDER BY version"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(versions, [1, 2, 3, 4, 5, 6, 7]);
    serves_after_the_upgrade(&store).await;
}

/// The schema's probes (does the table, the column exist?) wait for the
/// table's lock within the bound too, and one that ran out is the try's
/// failure, never a missing table: here the probe queues behind someone's
/// `LOCK TABLE` that waits behind a reader. Read as missing, the upgrade
/// ran every migration again on a table that has them (and failed on
/// migration 2's column, already there).
#[tokio::test]
async fn postgres_a_lock_wait_in_the_schema_probe_is_never_read_as_a_missing_table() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let (pool, schema, _) = migrated_pg_store(&url).await;
    let t = format!("\"{schema}\".\"idempotency_keys\"");
    let reader = reading(&pool, &schema).await;
    let mut other = sqlx::PgConnection::connect(&url).await.unwrap();
    let other_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut other)
        .await
        .unwrap();
    let lock = format!("BEGIN; LOCK TABLE {t} IN ACCESS EXCLUSIVE MODE");
    let locking = tokio::spawn(async move {
        let locked = other.execute(sqlx::AssertSqlSafe(lock)).await.map(drop);
        (other, locked)
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while lock_waits(&pool, &schema).await.is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the LOCK TABLE never queued"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let app = idem_testkit::unique("idem_probe");
    let migrator = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&with_setting(&url, "application_name", &app))
        .await
        .unwrap();
    let store = PgStore::new(migrator)
        .with_table(Some(&schema), "idempotency_keys")
        .unwrap();
    let migrating = tokio::spawn(async move { store.migrate().await });
    // Two tries, each waiting only for the probe's lock (a table read as
    // missing would wait for migration 1's index next).
    let (mut tries, mut waiting) = (0, false);
    while tries < 2 {
        let waits: Vec<String> = lock_waits(&pool, &schema)
            .await
            .into_iter()
            .filter(|(_, name, _)| *name == app)
            .map(|(mode, _, _)| mode)
            .collect();
        assert!(
            waits.iter().all(|mode| mode == "AccessShareLock"),
            "the upgrade of an up-to-date table waits for {waits:?}: its probe's lock wait read as a missing table"
        );
        if !waiting && !waits.is_empty() {
            tries += 1;
        }
        waiting = !waits.is_empty();
        assert!(!migrating.is_finished(), "{:?}", migrating.await);
        assert!(std::time::Instant::now() < deadline, "{tries} tries seen");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let _: bool = sqlx::query_scalar("SELECT pg_cancel_backend($1)")
        .bind(other_pid)
        .fetch_one(&pool)
        .await
        .unwrap();
    let (_other, locked) = locking.await.unwrap();
    assert!(locked.is_err(), "the LOCK TABLE was cancelled");
    reader.commit().await.unwrap();
    migrating.await.unwrap().unwrap();
    let versions: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT version FROM \"{schema}\".\"idempotency_keys_migrations\" ORDER BY version"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(versions, [1, 2, 3, 4, 5, 6, 7]);
}

/// The wait for the migration lock (another process migrating) is not the
/// table's: one that the session's own `lock_timeout` ends is returned as
/// PostgreSQL's error at once, not tried again as a table held by others.
#[tokio::test]
async fn postgres_a_wait_for_the_migration_lock_is_not_reported_as_the_tables() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let mut holder = sqlx::PgConnection::connect(&url).await.unwrap();
    holder
        .execute("BEGIN; SELECT pg_advisory_xact_lock(7319002151)")
        .await
        .unwrap();
    let pool = sqlx::PgPool::connect(&with_setting(&url, "lock_timeout", "100ms"))
        .await
        .unwrap();
    let store = PgStore::new(pool)
        .with_table(Some(&schema), "idempotency_keys")
        .unwrap();
    let migrated = store.migrate().await;
    holder.execute("COMMIT").await.unwrap();
    let e = migrated.expect_err("the migration lock is held");
    assert!(!e.to_string().contains("could not be upgraded"), "{e}");
    assert!(e.to_string().contains("lock timeout"), "{e}");
}

/// `migrate()` drops the first schema's check only, and finds it whatever
/// the session's quoting: checks of one's own, on `state` too, stay.
#[tokio::test]
async fn postgres_the_check_drop_drops_only_the_first_schemas_check() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let pool = sqlx::PgPool::connect(&with_setting(&url, "quote_all_identifiers", "on"))
        .await
        .unwrap();
    let t = format!("\"{schema}\".\"idempotency_keys\"");
    pool.execute(sqlx::AssertSqlSafe(V1_POSTGRES.replace("{t}", &t)))
        .await
        .unwrap();
    pool.execute(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE {t} ADD CONSTRAINT own_attempt CHECK (attempt >= 0), \
         ADD CONSTRAINT own_states CHECK (state IN ('in_progress', 'completed', 'archived')), \
         ADD CONSTRAINT own_reordered CHECK (state IN ('completed', 'in_progress'))"
    )))
    .await
    .unwrap();
    let store = PgStore::new(pool.clone())
        .with_table(Some(&schema), "idempotency_keys")
        .unwrap();
    store.migrate().await.unwrap();
    assert_eq!(
        check_names(&pool, &schema, "idempotency_keys").await,
        ["own_attempt", "own_reordered", "own_states"]
    );
    serves_after_the_upgrade(&store).await;
}

/// Replays, conflicts and mismatches are the lookup alone: the reservation
/// function runs only for the two fresh keys (PostgreSQL's own count of its
/// calls, `track_functions`). Every replay and mismatch is read from the
/// database (no answer kept in memory), so that each is a lookup.
#[tokio::test]
async fn postgres_replays_and_conflicts_never_call_the_reservation_function() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let (_, schema, _) = migrated_pg_store(&url).await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&with_setting(&url, "track_functions", "all"))
        .await
        .unwrap();
    let store = PgStore::new(pool.clone())
        .with_table(Some(&schema), "idempotency_keys")
        .unwrap()
        .with_replay_cache(Duration::ZERO);
    let (done, held) = (RecordId::new("t", "s", "done"), RecordId::new("t", "s", "held"));
    let Reservation::Reserved(lease) = store.reserve(req(&done, "fp")).await.unwrap() else {
        panic!("a fresh key is taken")
    };
    assert!(matches!(
        store.reserve(req(&held, "fp")).await.unwrap(),
        Reservation::Reserved(_)
    ));
    let answer = created(b"ok");
    store.complete(&done, &lease.token, &answer).await.unwrap();
    for _ in 0..10 {
        assert_eq!(
            store.reserve(req(&done, "fp")).await.unwrap(),
            Reservation::Completed(answer.clone())
        );
        assert_eq!(
            store.reserve(req(&done, "other")).await.unwrap(),
            Reservation::Mismatch
        );
        assert!(matches!(
            store.reserve(req(&held, "fp")).await.unwrap(),
            Reservation::InProgress { .. }
        ));
    }
    // The counts reach the statistics when the session ends.
    pool.close().await;
    let reader = sqlx::PgPool::connect(&url).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let calls: Option<i64> = sqlx::query_scalar(
            "SELECT calls FROM pg_stat_user_functions WHERE schemaname = $1 AND funcname = 'idempotency_keys_take'",
        )
        .bind(&schema)
        .fetch_optional(&reader)
        .await
        .unwrap();
        if let Some(calls) = calls {
            assert_eq!(calls, 2, "only the fresh keys call the function");
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no function statistics reported"
        );
        sqlx::query("SELECT pg_stat_clear_snapshot()")
            .execute(&reader)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Two processes (pools) migrating at once: one applies, both serve.
#[tokio::test]
async fn postgres_concurrent_migrations_apply_once() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let stores: Vec<PgStore> = futures_util::future::join_all((0..4).map(|_| {
        let (url, schema) = (url.clone(), schema.clone());
        async move {
            let pool = sqlx::PgPool::connect(&url).await.unwrap();
            PgStore::new(pool)
                .with_table(Some(&schema), "idempotency_keys")
                .unwrap()
        }
    }))
    .await;
    let results = futures_util::future::join_all(stores.iter().map(|s| s.migrate())).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
}

/// Names derived from the table's never truncate: a table name past 63
/// bytes is refused; a long one gets a purge index and a migrations table
/// whose names fit, and a long table of an earlier build upgrades.
#[tokio::test]
async fn postgres_long_table_names_get_their_index_and_upgrade() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let too_long = "t".repeat(idem::migrations::MAX_TABLE_NAME + 1);
    let err = PgStore::new(pool.clone())
        .with_table(Some(&schema), &too_long)
        .unwrap_err();
    assert!(err.to_string().contains("at most 63"), "{err}");
    let indexes = |table: String| {
        let pool = pool.clone();
        let schema = schema.clone();
        async move {
            let names: Vec<String> = sqlx::query_scalar(
                "SELECT indexname::text FROM pg_indexes WHERE schemaname = $1 AND tablename = $2 \
                 AND indexdef LIKE '%(purge_at)%'",
            )
            .bind(&schema)
            .bind(&table)
            .fetch_all(&pool)
            .await
            .unwrap();
            names
        }
    };
    let longest = "t".repeat(idem::migrations::MAX_TABLE_NAME);
    let store = PgStore::new(pool.clone())
        .with_table(Some(&schema), &longest)
        .unwrap();
    store.migrate().await.unwrap();
    let names = indexes(longest.clone()).await;
    assert_eq!(names.len(), 1, "{names:?}");
    assert!(names[0].starts_with("idem_purge_at_idx_"), "{names:?}");
    assert_eq!(state_checks(&pool, &schema, &longest).await, 0);

    // A 50-byte table of the first released build: upgraded in place.
    let earlier = "k".repeat(50);
    let t = format!("\"{schema}\".\"{earlier}\"");
    pool.execute(sqlx::AssertSqlSafe(V1_POSTGRES.replace("{t}", &t)))
        .await
        .unwrap();
    let store = PgStore::new(pool.clone())
        .with_table(Some(&schema), &earlier)
        .unwrap();
    store.migrate().await.unwrap();
    serves_after_the_upgrade(&store).await;
    // Its check on `state` had a name cut to 63 bytes: found all the same.
    assert_eq!(state_checks(&pool, &schema, &earlier).await, 0);
    assert_eq!(indexes(earlier).await.len(), 1);
}

/// A table dropped after it was migrated is made again by `migrate()`.
#[tokio::test]
async fn sqlite_a_dropped_table_is_made_again() {
    let (store, _dir) = idem_testkit::sqlite_store().await;
    store.pool().execute("DROP TABLE idempotency_keys").await.unwrap();
    assert!(store.check_schema().await.is_err());
    store.migrate().await.unwrap();
    let id = RecordId::new("t", "s", "again");
    assert!(matches!(
        store.reserve(req(&id, "fp")).await.unwrap(),
        Reservation::Reserved(_)
    ));
}

/// A column of someone else's that every row must fill is refused at the
/// check, not at the first request.
#[tokio::test]
async fn postgres_an_extra_required_column_refuses_to_start() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let (pool, schema, store) = migrated_pg_store(&url).await;
    pool.execute(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE \"{schema}\".idempotency_keys ADD COLUMN region TEXT NOT NULL"
    )))
    .await
    .unwrap();
    let err = store.check_schema().await.unwrap_err().to_string();
    assert!(err.contains("region") && err.contains("no default"), "{err}");
    pool.execute(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE \"{schema}\".idempotency_keys ALTER COLUMN region SET DEFAULT 'eu'"
    )))
    .await
    .unwrap();
    store.check_schema().await.unwrap();
}

#[tokio::test]
async fn sqlite_an_extra_required_column_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("extra.db")).await.unwrap();
    let with_region = V1_SQLITE
        .replace("{t}", "\"idempotency_keys\"")
        .replacen(
            "attempt INTEGER NOT NULL,",
            "attempt INTEGER NOT NULL, region TEXT NOT NULL,",
            1,
        )
        .replace("'op', NULL, 1, 0,", "'op', NULL, 1, 'eu', 0,");
    store
        .pool()
        .execute(sqlx::AssertSqlSafe(with_region))
        .await
        .unwrap();
    let err = store.migrate().await.unwrap_err().to_string();
    assert!(err.contains("region") && err.contains("no default"), "{err}");
}

/// A fresh key is taken, completed and replayed.
async fn takes_completes_replays(store: &dyn IdempotencyStore, key: &str) {
    let id = RecordId::new("t", "s", key);
    let Reservation::Reserved(lease) = store.reserve(req(&id, "fp")).await.unwrap() else {
        panic!("a fresh key is taken")
    };
    let answer = created(b"ok");
    store.complete(&id, &lease.token, &answer).await.unwrap();
    assert_eq!(
        store.reserve(req(&id, "fp")).await.unwrap(),
        Reservation::Completed(answer)
    );
}

/// A team that applies the migrations with its own tool takes them from
/// `migrations_sql()` (names and the generated function filled in): they
/// apply, `check_schema` agrees and the store serves.
#[tokio::test]
async fn postgres_migrations_applied_with_an_own_tool_serve() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let store = PgStore::new(pool.clone())
        .with_table(Some(&schema), "idempotency_keys")
        .unwrap();
    pool.execute(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE \"{schema}\".idempotency_keys_migrations (version BIGINT PRIMARY KEY, \
         name TEXT NOT NULL, applied_at BIGINT NOT NULL)"
    )))
    .await
    .unwrap();
    for (migration, sql) in store.migrations_sql() {
        pool.execute(sqlx::AssertSqlSafe(sql.to_owned()))
            .await
            .unwrap_or_else(|e| panic!("migration {}: {e}", migration.version));
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO \"{schema}\".idempotency_keys_migrations VALUES ($1, $2, 0)"
        )))
        .bind(migration.version)
        .bind(migration.name)
        .execute(&pool)
        .await
        .unwrap();
    }
    store.check_schema().await.unwrap();
    takes_completes_replays(&store, "own-tool").await;
}

/// A service role that may use the table but may create nothing in its
/// schema (and does not own the reservation function) runs `migrate()` at
/// start on an up-to-date table: it succeeds (nothing is created, and the
/// function is this build's, so it is left alone) and the role serves.
#[tokio::test]
async fn postgres_a_role_that_does_not_own_the_function_migrates_an_up_to_date_table() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let (admin, schema, _) = migrated_pg_store(&url).await;
    let role = format!("idem_svc_{}", &schema[schema.len() - 12..]).to_lowercase();
    admin
        .execute(sqlx::AssertSqlSafe(format!(
            "DROP ROLE IF EXISTS {role}; CREATE ROLE {role} LOGIN; \
             GRANT USAGE ON SCHEMA \"{schema}\" TO {role}; \
             GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA \"{schema}\" TO {role}"
        )))
        .await
        .unwrap();
    let service_url = url.replacen("postgres://postgres@", &format!("postgres://{role}@"), 1);
    assert_ne!(service_url, url, "DATABASE_URL names the postgres user");
    let service = sqlx::PgPool::connect(&service_url).await.unwrap();
    let store = PgStore::new(service.clone())
        .with_table(Some(&schema), "idempotency_keys")
        .unwrap();
    let migrated = store.migrate().await;
    let served = async {
        takes_completes_replays(&store, "service-role").await;
    };
    if migrated.is_ok() {
        served.await;
    }
    service.close().await;
    admin
        .execute(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA \"{schema}\" CASCADE; DROP ROLE {role}"
        )))
        .await
        .unwrap();
    migrated.unwrap();
}

/// A name no other test run uses, for a database or a role of its own.
fn unique_suffix() -> String {
    let nanos = std::time::SystemTime::UNIX_EPOCH
        .elapsed()
        .unwrap()
        .subsec_nanos();
    format!("{}_{nanos}", std::process::id())
}

/// A database that refuses PL/pgSQL to its service role (`USAGE` on the
/// language revoked from PUBLIC, a common hardening): once the check on
/// `state` is gone, that role's `migrate()` runs no PL/pgSQL, and succeeds
/// on the up-to-date table.
#[tokio::test]
async fn postgres_a_role_refused_plpgsql_migrates_an_up_to_date_table() {
    use sqlx::postgres::PgConnectOptions;
    let Some(url) = idem_testkit::pg_url() else { return };
    let admin = sqlx::PgPool::connect(&url).await.unwrap();
    let unique = unique_suffix();
    let (database, role) = (format!("idem_hardened_{unique}"), format!("idem_svc_{unique}"));
    admin
        .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")))
        .await
        .unwrap();
    let options: PgConnectOptions = url.parse().unwrap();
    let owner = sqlx::PgPool::connect_with(options.clone().database(&database))
        .await
        .unwrap();
    owner
        .execute(sqlx::AssertSqlSafe(format!(
            "REVOKE USAGE ON LANGUAGE plpgsql FROM PUBLIC; CREATE ROLE {role} LOGIN; \
             CREATE SCHEMA app; GRANT USAGE ON SCHEMA app TO {role}"
        )))
        .await
        .unwrap();
    let migrated_by_owner = PgStore::new(owner.clone())
        .with_table(Some("app"), "idempotency_keys")
        .unwrap()
        .migrate()
        .await;
    owner
        .execute(sqlx::AssertSqlSafe(format!(
            "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA app TO {role}"
        )))
        .await
        .unwrap();
    let service = sqlx::PgPool::connect_with(options.database(&database).username(&role))
        .await
        .unwrap();
    let store = PgStore::new(service.clone())
        .with_table(Some("app"), "idempotency_keys")
        .unwrap();
    let migrated = store.migrate().await;
    if migrated.is_ok() {
        takes_completes_replays(&store, "hardened").await;
    }
    service.close().await;
    owner.close().await;
    // One statement each: `DROP DATABASE` refuses to run in the implicit
    // transaction of several.
    for drop in [
        format!("DROP DATABASE {database} WITH (FORCE)"),
        format!("DROP ROLE {role}"),
    ] {
        admin.execute(sqlx::AssertSqlSafe(drop)).await.unwrap();
    }
    migrated_by_owner.unwrap();
    migrated.unwrap();
}

/// A database not encoded in UTF8 (LATIN1 here) cannot hold every tenant
/// and checkpoint name: `migrate()` refuses it, naming the encoding,
/// before it creates anything, and `check_schema()` refuses it too, where
/// requests whose text it cannot convert would get 503 on every retry.
#[tokio::test]
async fn postgres_a_database_not_encoded_in_utf8_is_refused() {
    use sqlx::postgres::PgConnectOptions;
    let Some(url) = idem_testkit::pg_url() else { return };
    let admin = sqlx::PgPool::connect(&url).await.unwrap();
    let database = format!("idem_latin1_{}", unique_suffix());
    admin
        .execute(sqlx::AssertSqlSafe(format!(
            "CREATE DATABASE {database} ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0"
        )))
        .await
        .unwrap();
    let options: PgConnectOptions = url.parse().unwrap();
    let pool = sqlx::PgPool::connect_with(options.database(&database))
        .await
        .unwrap();
    let store = PgStore::new(pool.clone());
    let migrated = store.migrate().await.map_err(|e| e.to_string());
    let checked = store.check_schema().await.map_err(|e| e.to_string());
    let created: Option<String> = sqlx::query_scalar("SELECT to_regclass('idempotency_keys')::text")
        .fetch_one(&pool)
        .await
        .unwrap();
    pool.close().await;
    admin
        .execute(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE {database} WITH (FORCE)"
        )))
        .await
        .unwrap();
    for refused in [migrated, checked] {
        let reason = refused.expect_err("a LATIN1 database is refused");
        assert!(reason.contains("LATIN1") && reason.contains("UTF8"), "{reason}");
    }
    assert_eq!(created, None, "migrate() created the table before refusing");
}

/// The columns the completion writes (`state`, `lock_token`, the answer,
/// `created_at`, `expires_at`): none may be indexed, so that PostgreSQL
/// stores an answer in place (a HOT update: no new index entries, less WAL),
/// as a hand-written flow does. The janitor's index is on `purge_at`, which
/// the completion leaves alone.
#[tokio::test]
async fn postgres_storing_an_answer_changes_no_indexed_column() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let (pool, schema, _) = migrated_pg_store(&url).await;
    let indexed: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT a.attname::text FROM pg_index i \
         JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey) \
         WHERE i.indrelid = format('%I.%I', $1::text, 'idempotency_keys')::regclass ORDER BY 1",
    )
    .bind(&schema)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(indexed, ["key", "purge_at", "scope", "tenant"]);
}

/// Migration 5 rewrites no row (a rewrite would hold the table's lock, and
/// stop every request, for as long as it takes). The janitor then finds
/// records by `purge_at`: it sets it from the expiry on the rows already
/// there at the upgrade and on those an earlier build writes while a
/// rolling upgrade is under way (which leave it to its default). Expired
/// ones go; live ones stay.
#[tokio::test]
async fn postgres_records_of_an_earlier_build_are_purged_once_expired() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let t = format!("\"{schema}\".\"idempotency_keys\"");
    // The first released schema with its one live record, and one expired.
    pool.execute(sqlx::AssertSqlSafe(format!(
        "{}; INSERT INTO {t} VALUES ('t', 's', 'gone', 'fp', 'completed', 'op', NULL, 1, now(), NULL, 201, \
         '[]', 'x', now() - interval '2 hours', now() - interval '1 hour')",
        V1_POSTGRES.replace("{t}", &t)
    )))
    .await
    .unwrap();
    let versions = || {
        let pool = pool.clone();
        let t = t.clone();
        async move {
            let rows: Vec<(String, String)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT key, xmin::text FROM {t} ORDER BY key"
            )))
            .fetch_all(&pool)
            .await
            .unwrap();
            rows
        }
    };
    let before = versions().await;
    let store = PgStore::new(pool.clone())
        .with_table(Some(&schema), "idempotency_keys")
        .unwrap();
    store.migrate().await.unwrap();
    assert_eq!(versions().await, before, "the migrations rewrote rows");
    // What an earlier build inserts after the upgrade: no `purge_at`.
    pool.execute(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {t} (tenant, scope, key, fingerprint, state, operation_id, lock_token, attempt, \
         lock_expires_at, recovery_point, response_status, response_headers, response_body, created_at, \
         expires_at) VALUES \
         ('t', 's', 'gone-later', 'fp', 'completed', 'op', NULL, 1, now(), NULL, 201, '[]', 'x', \
          now() - interval '2 hours', now() - interval '1 hour'), \
         ('t', 's', 'live-later', 'fp', 'completed', 'op', NULL, 1, now(), NULL, 201, '[]', 'x', \
          now(), now() + interval '1 hour')"
    )))
    .await
    .unwrap();
    assert_eq!(idem::purge_expired(&store, 1).await.unwrap(), 2);
    let left: Vec<String> =
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT key FROM {t} ORDER BY key")))
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(left, ["live-later", "old"]);
    let unset: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {t} WHERE purge_at <> expires_at"
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(unset, 0, "the janitor set purge_at on the rows it kept");
    serves_after_the_upgrade(&store).await;
}

/// A store configured without a schema uses what `search_path` resolves.
/// When its table (or migrations table, or function) resolves to another
/// schema than the one new objects go to, it is someone else's (another
/// service's records, whose answers it would replay): `migrate()` and
/// `check_schema()` refuse, name the schema, and change nothing.
#[tokio::test]
async fn postgres_a_table_found_in_another_schema_through_search_path_is_refused() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let a = idem_testkit::pg_schema(&url).await;
    let b = idem_testkit::pg_schema(&url).await;
    let on_path = |path: &str| {
        let o: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
        o.options([("search_path", path)])
    };
    let pool_a = sqlx::PgPool::connect_with(on_path(&a)).await.unwrap();
    PgStore::new(pool_a.clone()).migrate().await.unwrap();
    let pool_b = sqlx::PgPool::connect_with(on_path(&format!("{b},{a}")))
        .await
        .unwrap();
    let store_b = PgStore::new(pool_b.clone());
    for err in [
        store_b.migrate().await.unwrap_err(),
        store_b.check_schema().await.unwrap_err(),
    ] {
        let err = err.to_string();
        assert!(err.contains(&a) && err.contains("with_table"), "{err}");
    }
    let in_b: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1",
    )
    .bind(&b)
    .fetch_one(&pool_a)
    .await
    .unwrap();
    assert_eq!(in_b, 0, "nothing made in {b}");
    // Named, the schema is used as asked: b gets a table of its own.
    let own = PgStore::new(pool_b.clone())
        .with_table(Some(&b), "idempotency_keys")
        .unwrap();
    own.migrate().await.unwrap();
    takes_completes_replays(&own, "b-key").await;
    let in_a: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM \"{a}\".idempotency_keys WHERE key = 'b-key'"
    )))
    .fetch_one(&pool_a)
    .await
    .unwrap();
    assert_eq!(in_a, 0);

    // Its own table in the schema new objects go to, without its function
    // (dropped, as before migration 4), and another service's function on
    // the path: migrate() makes its own function there, never adopts the
    // other one.
    pool_b
        .execute(sqlx::AssertSqlSafe(format!(
            "DROP FUNCTION \"{b}\".idempotency_keys_take"
        )))
        .await
        .unwrap();
    let unnamed = PgStore::new(pool_b.clone());
    unnamed.migrate().await.unwrap();
    let home: String = sqlx::query_scalar(
        "SELECT n.nspname::text FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace \
         WHERE p.proname = 'idempotency_keys_take' AND n.nspname IN ($1, $2) ORDER BY n.nspname = $1 LIMIT 1",
    )
    .bind(&a)
    .bind(&b)
    .fetch_one(&pool_a)
    .await
    .unwrap();
    assert_eq!(home, b, "the function is made in {b}");
    takes_completes_replays(&unnamed, "b-key-2").await;
}

/// Rows without a `purge_at` (from before migration 5, or an earlier
/// build's) that keep coming, and one whose expiry someone set by hand to
/// the "not set" value itself: a purge call still ends (each call sets
/// `purge_at` for at most one store timeout), and the expired row goes.
macro_rules! purge_ends_despite_unset_rows {
    ($store:expr, $pool:expr, $table:expr, $unset_expiry:expr, $live_expiry:expr, $many:expr) => {{
        let (store, pool, table) = ($store, $pool, $table);
        let row = |key: &str, expiry: &str| {
            format!(
                "INSERT INTO {table} (tenant, scope, key, fingerprint, state, operation_id, attempt, \
                 lock_expires_at, created_at, expires_at) \
                 VALUES ('t', 's', '{key}', 'fp', 'completed', 'op', 1, {expiry}, {expiry}, {expiry})"
            )
        };
        pool.execute(sqlx::AssertSqlSafe(row("by-hand", $unset_expiry)))
            .await
            .unwrap();
        // 30,000 live rows without `purge_at`: one store statement each
        // (batch 1) would take far longer than a call may.
        pool.execute(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {table} (tenant, scope, key, fingerprint, state, operation_id, attempt, \
             lock_expires_at, created_at, expires_at) \
             SELECT 't', 's', 'live-' || n, 'fp', 'completed', 'op', 1, {e}, {e}, {e} FROM {many}",
            e = $live_expiry,
            many = $many,
        )))
        .await
        .unwrap();
        let mut gone = false;
        for _ in 0..200 {
            tokio::time::timeout(Duration::from_secs(5), store.purge_expired(1))
                .await
                .expect("a purge call ends")
                .unwrap();
            let left: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT count(*) FROM {table} WHERE key = 'by-hand'"
            )))
            .fetch_one(pool)
            .await
            .unwrap();
            if left == 0 {
                gone = true;
                break;
            }
        }
        assert!(gone, "the expired row was never purged");
    }};
}

#[tokio::test]
async fn postgres_a_purge_ends_despite_unset_rows() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let (pool, schema, store) = migrated_pg_store(&url).await;
    let store = store.with_timeout(Duration::from_millis(300));
    let t = format!("\"{schema}\".idempotency_keys");
    purge_ends_despite_unset_rows!(
        &store,
        &pool,
        &t,
        "'-infinity'",
        "now() + interval '1 hour'",
        "generate_series(1, 30000) AS n"
    );
}

#[tokio::test]
async fn sqlite_a_purge_ends_despite_unset_rows() {
    let (store, _dir) = idem_testkit::sqlite_store().await;
    let store = store.with_timeout(Duration::from_millis(300));
    let pool = store.pool().clone();
    purge_ends_despite_unset_rows!(
        &store,
        &pool,
        "idempotency_keys",
        "0",
        "CAST(unixepoch('subsec') * 1000 AS INTEGER) + 3600000",
        "(WITH RECURSIVE c(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM c WHERE n < 30000) SELECT n FROM c)"
    );
}

/// Another service's table under idem's name (no versions recorded, other
/// columns): `migrate()` refuses it, says so, and changes nothing: no
/// column added, no version recorded, no function made, its row intact.
#[tokio::test]
async fn postgres_another_services_table_of_the_same_name_is_left_alone() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let schema = idem_testkit::pg_schema(&url).await;
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    pool.execute(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE \"{schema}\".idempotency_keys (key TEXT PRIMARY KEY, expires_at TIMESTAMPTZ, payload TEXT); \
         INSERT INTO \"{schema}\".idempotency_keys VALUES ('theirs', now(), 'kept')"
    )))
    .await
    .unwrap();
    let store = PgStore::new(pool.clone())
        .with_table(Some(&schema), "idempotency_keys")
        .unwrap();
    let err = store.migrate().await.unwrap_err().to_string();
    assert!(err.contains("not idem's") && err.contains("tenant"), "{err}");
    let columns: Vec<String> = sqlx::query_scalar(
        "SELECT column_name::text FROM information_schema.columns WHERE table_schema = $1 \
         AND table_name = 'idempotency_keys' ORDER BY ordinal_position",
    )
    .bind(&schema)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(columns, ["key", "expires_at", "payload"]);
    let others: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
                 WHERE n.nspname = $1 AND c.relname <> 'idempotency_keys' AND c.relname NOT LIKE '%_pkey') \
              + (SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = $1)",
    )
    .bind(&schema)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(others, 0, "migrate() made something beside their table");
    let payload: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT payload FROM \"{schema}\".idempotency_keys WHERE key = 'theirs'"
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(payload, "kept");
}

/// The same on SQLite.
#[tokio::test]
async fn sqlite_another_services_table_of_the_same_name_is_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("shared.db")).await.unwrap();
    store
        .pool()
        .execute(
            "CREATE TABLE idempotency_keys (key TEXT PRIMARY KEY, expires_at INTEGER, payload TEXT); \
                  INSERT INTO idempotency_keys VALUES ('theirs', 0, 'kept')",
        )
        .await
        .unwrap();
    let err = store.migrate().await.unwrap_err().to_string();
    assert!(err.contains("not idem's") && err.contains("tenant"), "{err}");
    let columns: Vec<String> = sqlx::query_scalar("SELECT name FROM pragma_table_info('idempotency_keys')")
        .fetch_all(store.pool())
        .await
        .unwrap();
    assert_eq!(columns, ["key", "expires_at", "payload"]);
    let tables: Vec<String> =
        sqlx::query_scalar("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
            .fetch_all(store.pool())
            .await
            .unwrap();
    assert_eq!(
        tables,
        ["idempotency_keys"],
        "migrate() made something beside their table"
    );
}

/// SQLite: every statement of idem's, the migrations and the checks
/// included, names `main`, so that a `TEMP` table of idem's table's name
/// (a handler's, left on a pooled connection) or an attached database's
/// tables are never read or written instead.
mod sqlite_names_main {
    use axum::http::StatusCode;
    use axum::routing::post;
    use axum::{Json, Router};
    use idem::{idempotent, Idem, Operation};
    use idem_testkit::http::{post as post_req, serve};

    /// A pool of one connection to `url`, kept open: what one statement
    /// leaves on the connection (a TEMP table, an attached database) is
    /// there for the next.
    async fn one_connection(url: &str) -> sqlx::SqlitePool {
        sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .connect(url)
            .await
            .unwrap()
    }

    /// Leaves, in its transaction on the pooled connection, a TEMP table of
    /// idem's table's name.
    #[idempotent(scope = "lite.review")]
    async fn leaves_temp(op: Operation, Json(temp): Json<bool>) -> StatusCode {
        let mut conn = op.sqlite_transaction().await.unwrap();
        if temp {
            sqlx::raw_sql("CREATE TEMP TABLE idempotency_keys (note TEXT NOT NULL)")
                .execute(&mut *conn)
                .await
                .unwrap();
        }
        StatusCode::CREATED
    }

    /// The in-memory store (one connection: every statement of idem's runs
    /// where the handler left its TEMP table): requests, `check_schema` and
    /// a second `migrate` all see idem's table.
    #[tokio::test]
    async fn a_handlers_temp_table_is_not_what_check_schema_judges() {
        let store = idem::SqliteStore::in_memory().await.unwrap();
        store.check_schema().await.unwrap();
        let addr = serve(
            Router::new()
                .route("/t", post(leaves_temp))
                .layer(Idem::new(store.clone()).single_tenant().layer()),
        )
        .await;
        let first = post_req("/t", "true").key("k-1").send(addr).await;
        assert_eq!(first.status, 201, "{}", String::from_utf8_lossy(&first.body));
        // Requests are served from idem's table (main): they work.
        let second = post_req("/t", "false").key("k-2").send(addr).await;
        assert_eq!(second.status, 201, "{}", String::from_utf8_lossy(&second.body));
        let replay = post_req("/t", "false").key("k-2").send(addr).await;
        assert_eq!(
            (replay.status, replay.header("idempotent-replayed")),
            (201, Some("true"))
        );
        // idem's table is unchanged and matches this build.
        let checked = store.check_schema().await;
        assert!(
            checked.is_ok(),
            "check_schema after a handler's TEMP table: {checked:?}"
        );
        let migrated = store.migrate().await;
        assert!(
            migrated.is_ok(),
            "migrate after a handler's TEMP table: {migrated:?}"
        );
    }

    /// idem's table (main) has a column idem does not fill and that has no
    /// default, so every reservation fails: `check_schema` says so, with or
    /// without a TEMP table of the same name on the connection.
    #[tokio::test]
    async fn check_schema_judges_mains_table_whatever_temp_holds() {
        let pool = one_connection("sqlite::memory:").await;
        // idem's table as this build makes it, plus someone else's required column.
        sqlx::raw_sql(
            "CREATE TABLE idempotency_keys (tenant TEXT NOT NULL, scope TEXT NOT NULL, key TEXT NOT NULL, \
             fingerprint TEXT NOT NULL, state TEXT NOT NULL CHECK (state IN ('in_progress', 'completed')), \
             operation_id TEXT NOT NULL, lock_token TEXT, attempt INTEGER NOT NULL, lock_expires_at INTEGER NOT NULL, \
             recovery_point TEXT, response_status INTEGER, response_headers TEXT, response_body BLOB, \
             created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL, taken_over INTEGER NOT NULL DEFAULT 0, \
             purge_at INTEGER NOT NULL DEFAULT 0, extra TEXT NOT NULL, PRIMARY KEY (tenant, scope, key)) WITHOUT ROWID",
        )
        .execute(&pool)
        .await
        .unwrap();
        let store = idem::SqliteStore::new(pool.clone());
        // Refused, rightly: the versions are recorded, the column is named.
        let refused = store.migrate().await;
        assert!(
            format!("{refused:?}").contains("extra"),
            "without a TEMP table: {refused:?}"
        );
        assert!(store.check_schema().await.is_err());
        // A handler's TEMP table of idem's name on the (only) connection.
        sqlx::raw_sql("CREATE TEMP TABLE idempotency_keys (note TEXT)")
            .execute(&pool)
            .await
            .unwrap();
        let addr = serve(
            Router::new()
                .route("/t", post(leaves_temp))
                .layer(Idem::new(store.clone()).single_tenant().layer()),
        )
        .await;
        let r = post_req("/t", "false").key("k-1").send(addr).await;
        let checked = store.check_schema().await;
        assert!(
            checked.is_err(),
            "check_schema passed idem's table, whose every request fails ({})",
            r.status
        );
    }

    /// `migrate()` on a connection that has a TEMP table of idem's table's
    /// name (one with an `expires_at` column too, which an index on the bare
    /// name would find) makes the table, its indexes and its columns in
    /// main, records the versions main's table got, and leaves the TEMP
    /// table as it was; once the TEMP table is gone the table serves.
    #[tokio::test]
    async fn migrate_leaves_a_temp_table_of_idems_name_alone() {
        for column in ["note", "expires_at"] {
            let pool = one_connection("sqlite::memory:").await;
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "CREATE TEMP TABLE idempotency_keys ({column} INTEGER)"
            )))
            .execute(&pool)
            .await
            .unwrap();
            let store = idem::SqliteStore::new(pool.clone());
            store.migrate().await.unwrap();
            let names = |sql: &'static str| {
                let pool = pool.clone();
                async move {
                    sqlx::query_scalar::<_, String>(sql)
                        .fetch_all(&pool)
                        .await
                        .unwrap()
                }
            };
            let temp_columns = names("SELECT name FROM pragma_table_info('idempotency_keys', 'temp')").await;
            assert_eq!(temp_columns, [column], "the TEMP table changed");
            let temp_indexes = names("SELECT name FROM temp.sqlite_master WHERE type = 'index'").await;
            assert!(
                temp_indexes.is_empty(),
                "an index on the TEMP table: {temp_indexes:?}"
            );
            let versions: Vec<i64> =
                sqlx::query_scalar("SELECT version FROM main.idempotency_keys_migrations ORDER BY version")
                    .fetch_all(&pool)
                    .await
                    .unwrap();
            assert_eq!(versions, [1, 2, 3, 4, 5, 6, 7]);
            let main_columns = names("SELECT name FROM pragma_table_info('idempotency_keys', 'main')").await;
            for column in ["taken_over", "purge_at"] {
                assert!(main_columns.iter().any(|c| c == column), "{main_columns:?}");
            }
            sqlx::raw_sql("DROP TABLE temp.idempotency_keys")
                .execute(&pool)
                .await
                .unwrap();
            store.migrate().await.unwrap();
            store.check_schema().await.unwrap();
        }
    }

    /// A pool whose connection ATTACHes another idem database (say, an older
    /// one kept to read from): on a fresh main database, `migrate()` records
    /// its versions in main's migrations table, and leaves the attached
    /// database's alone.
    #[tokio::test]
    async fn migrate_records_its_versions_in_main_not_an_attached_database() {
        let dir = tempfile::tempdir().unwrap();
        let aux_path = dir.path().join("old.db");
        {
            let old = idem::SqliteStore::open(&aux_path).await.unwrap();
            old.migrate().await.unwrap();
            // An older build's: versions 1 to 5.
            sqlx::raw_sql("DELETE FROM idempotency_keys_migrations WHERE version >= 6")
                .execute(old.pool())
                .await
                .unwrap();
            old.pool().close().await;
        }
        let pool = one_connection(&format!(
            "sqlite://{}?mode=rwc",
            dir.path().join("main.db").display()
        ))
        .await;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "ATTACH DATABASE '{}' AS old",
            aux_path.display()
        )))
        .execute(&pool)
        .await
        .unwrap();
        let store = idem::SqliteStore::new(pool.clone());
        let migrated = store.migrate().await;
        let main_versions: Option<String> = sqlx::query_scalar(
            "SELECT name FROM main.sqlite_master WHERE name = 'idempotency_keys_migrations'",
        )
        .fetch_optional(&pool)
        .await
        .unwrap();
        let old_versions: Vec<i64> =
            sqlx::query_scalar("SELECT version FROM old.idempotency_keys_migrations ORDER BY version")
                .fetch_all(&pool)
                .await
                .unwrap();
        assert!(migrated.is_ok());
        assert_eq!(
            old_versions,
            [1, 2, 3, 4, 5],
            "migrate wrote into the attached database"
        );
        assert!(main_versions.is_some(), "main has no migrations table");
    }

    /// The migrations' own text is what a team that applies them with its
    /// own tool fills in: the placeholders `Migration` documents, bare names,
    /// and nothing else; `check_schema` then agrees and the store serves.
    #[tokio::test]
    async fn the_migrations_text_is_filled_as_documented() {
        use idem::store::{RecordId, Reservation, ReserveRequest};
        use idem::IdempotencyStore as _;
        let dir = tempfile::tempdir().unwrap();
        let store = idem::SqliteStore::open(dir.path().join("own.db")).await.unwrap();
        let t = "idempotency_keys";
        sqlx::raw_sql(
            "CREATE TABLE idempotency_keys_migrations (version BIGINT PRIMARY KEY, name TEXT NOT NULL, \
             applied_at BIGINT NOT NULL)",
        )
        .execute(store.pool())
        .await
        .unwrap();
        for m in idem::migrations::SQLITE_MIGRATIONS {
            let sql = m
                .sql
                .replace("{table}", &format!("\"{t}\""))
                .replace("{index}", &format!("\"{t}_expires_at_idx\""))
                .replace("{purge_index}", &format!("\"{t}_purge_at_idx\""))
                .replace("{expiry_index}", &format!("\"{t}_expires_at_idx\""))
                .replace("{times_on_insert}", &format!("\"{t}_times_on_insert\""))
                .replace("{times_on_update}", &format!("\"{t}_times_on_update\""))
                .replace("{reserve_function}", "")
                .replace("{take_function}", "");
            assert!(
                !sql.contains('{'),
                "a placeholder no doc names, in version {}",
                m.version
            );
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                .execute(store.pool())
                .await
                .unwrap();
            sqlx::query("INSERT INTO idempotency_keys_migrations VALUES (?, ?, 0)")
                .bind(m.version)
                .bind(m.name)
                .execute(store.pool())
                .await
                .unwrap();
        }
        store.check_schema().await.unwrap();
        let id = RecordId::new("t", "s", "own-tool");
        let reserved = store
            .reserve(ReserveRequest {
                id: &id,
                fingerprint: "fp",
                token: "tok",
                ttl: std::time::Duration::from_secs(60),
                lock_timeout: std::time::Duration::from_secs(60),
            })
            .await
            .unwrap();
        assert!(matches!(reserved, Reservation::Reserved(_)), "{reserved:?}");
    }
}

/// A table with every column but no unique key on (tenant, scope, key)
/// (dropped by hand, or made by hand), on which every reservation's
/// `ON CONFLICT` fails: `check_schema` and `migrate` refuse it, saying
/// what it needs, before a request is served.
#[tokio::test]
async fn postgres_a_table_without_its_unique_key_refuses_to_start() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let (pool, schema, store) = migrated_pg_store(&url).await;
    let table = format!("\"{schema}\".idempotency_keys");
    let key: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT conname::text FROM pg_constraint WHERE conrelid = '{table}'::regclass AND contype = 'p'"
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    pool.execute(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE {table} DROP CONSTRAINT \"{key}\""
    )))
    .await
    .unwrap();
    for (what, said) in [
        ("check_schema", store.check_schema().await),
        ("migrate", store.migrate().await),
    ] {
        let err = said.unwrap_err();
        assert!(
            matches!(err, idem::StoreError::Backend { .. })
                && err.to_string().contains("cannot take a reservation")
                && err.to_string().contains("unique key on (tenant, scope, key)"),
            "{what}: {err}"
        );
    }
    // Given back its key, it serves.
    pool.execute(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE {table} ADD PRIMARY KEY (tenant, scope, key)"
    )))
    .await
    .unwrap();
    store.migrate().await.unwrap();
    takes_completes_replays(&store, "keyed").await;
}

/// The same on SQLite, whose primary key cannot be dropped: a table made by
/// hand with every column and no key is refused by `migrate`.
#[tokio::test]
async fn sqlite_a_table_without_its_unique_key_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("no-key.db")).await.unwrap();
    store
        .pool()
        .execute(
            "CREATE TABLE idempotency_keys (tenant TEXT NOT NULL, scope TEXT NOT NULL, key TEXT NOT NULL, \
             fingerprint TEXT NOT NULL, state TEXT NOT NULL, operation_id TEXT NOT NULL, lock_token TEXT, \
             attempt INTEGER NOT NULL, taken_over INTEGER NOT NULL DEFAULT 0, \
             lock_expires_at INTEGER NOT NULL, recovery_point TEXT, response_status INTEGER, \
             response_headers TEXT, response_body BLOB, created_at INTEGER NOT NULL, \
             expires_at INTEGER NOT NULL, purge_at INTEGER NOT NULL DEFAULT 0)",
        )
        .await
        .unwrap();
    // Refused before anything is recorded: the versions it would have
    // recorded are rolled back with it.
    let err = store.migrate().await.unwrap_err();
    assert!(
        err.to_string().contains("cannot take a reservation")
            && err.to_string().contains("unique key on (tenant, scope, key)"),
        "{err}"
    );
}

/// A database that reads but cannot be written (a replica, a read-only
/// session, a read-only file) finds an up-to-date table and writes
/// nothing to migrate it: `migrate` asks for a write all the same, so that
/// a service refuses to start rather than answer every request 503.
#[tokio::test]
async fn a_database_that_cannot_be_written_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("read-only.db");
    let store = SqliteStore::open(&path).await.unwrap();
    store.migrate().await.unwrap();
    let read_only = SqliteStore::open_url(&format!("sqlite://{}?mode=ro", path.display()))
        .await
        .unwrap();
    read_only.check_schema().await.unwrap();
    let err = read_only.migrate().await.unwrap_err().to_string();
    assert!(
        err.contains("cannot take a reservation") && err.contains("readonly"),
        "{err}"
    );

    let Some(url) = idem_testkit::pg_url() else { return };
    let (_, schema, _) = migrated_pg_store(&url).await;
    let pool = sqlx::PgPool::connect(&with_setting(&url, "default_transaction_read_only", "on"))
        .await
        .unwrap();
    let read_only = PgStore::new(pool)
        .with_table(Some(&schema), "idempotency_keys")
        .unwrap();
    read_only.check_schema().await.unwrap();
    let err = read_only.migrate().await.unwrap_err().to_string();
    assert!(
        err.contains("cannot take a reservation") && err.contains("the session is read only"),
        "{err}"
    );
}

/// A plain `CREATE INDEX` on the table holds its SHARE lock while it builds
/// (a test connection holds it here): `check_schema` (a health check) and
/// `migrate` of a current table read the catalog, never wait for that
/// lock, and answer at once.
#[tokio::test]
async fn postgres_the_checks_never_wait_for_the_tables_lock() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let (pool, schema, store) = migrated_pg_store(&url).await;
    let mut holder = pool.begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "LOCK TABLE \"{schema}\".idempotency_keys IN SHARE MODE"
    )))
    .execute(&mut *holder)
    .await
    .unwrap();
    let within = |what: &'static str| {
        move |r: Result<Result<(), idem::StoreError>, _>| match r {
            Ok(done) => done.unwrap_or_else(|e| panic!("{what}: {e}")),
            Err(_) => panic!("{what} waited for the table's lock"),
        }
    };
    within("check_schema")(tokio::time::timeout(Duration::from_secs(10), store.check_schema()).await);
    within("migrate")(tokio::time::timeout(Duration::from_secs(10), store.migrate()).await);
    holder.rollback().await.unwrap();
}

/// A role that may write every column idem writes, granted column by
/// column, migrates and serves; a role that may only read is refused by
/// `migrate()`, saying why.
#[tokio::test]
async fn postgres_a_role_is_judged_by_the_rights_it_has() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let (admin, schema, _) = migrated_pg_store(&url).await;
    let table = format!("\"{schema}\".idempotency_keys");
    let columns: String = sqlx::query_scalar(
        "SELECT string_agg(quote_ident(column_name::text), ', ') FROM information_schema.columns \
         WHERE table_schema = $1 AND table_name = 'idempotency_keys'",
    )
    .bind(&schema)
    .fetch_one(&admin)
    .await
    .unwrap();
    let suffix = schema[schema.len() - 10..].to_lowercase();
    let (writer, reader) = (format!("idem_cols_{suffix}"), format!("idem_reads_{suffix}"));
    admin
        .execute(sqlx::AssertSqlSafe(format!(
            "DROP ROLE IF EXISTS {writer}; DROP ROLE IF EXISTS {reader}; \
             CREATE ROLE {writer} LOGIN; CREATE ROLE {reader} LOGIN; \
             GRANT USAGE ON SCHEMA \"{schema}\" TO {writer}, {reader}; \
             GRANT SELECT ON ALL TABLES IN SCHEMA \"{schema}\" TO {writer}, {reader}; \
             GRANT DELETE ON {table} TO {writer}; \
             GRANT INSERT ({columns}), UPDATE ({columns}) ON {table} TO {writer}"
        )))
        .await
        .unwrap();
    let as_role = |role: &str| {
        let url = url.replacen("postgres://postgres@", &format!("postgres://{role}@"), 1);
        let schema = schema.clone();
        async move {
            PgStore::new(sqlx::PgPool::connect(&url).await.unwrap())
                .with_table(Some(&schema), "idempotency_keys")
                .unwrap()
        }
    };
    let writes = as_role(&writer).await;
    let migrated = writes.migrate().await;
    let served = async {
        takes_completes_replays(&writes, "by-column").await;
    };
    if migrated.is_ok() {
        served.await;
    }
    let refused = as_role(&reader).await.migrate().await;
    writes.pool().close().await;
    admin
        .execute(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA \"{schema}\" CASCADE; DROP OWNED BY {writer}, {reader}; \
             DROP ROLE {writer}; DROP ROLE {reader}"
        )))
        .await
        .unwrap();
    migrated.expect("a role that writes every column idem writes");
    let err = refused.unwrap_err().to_string();
    assert!(
        err.contains("this role may not insert, update and delete"),
        "{err}"
    );
}

/// The relation `name` names, as PostgreSQL finds it; `None` where none.
async fn regclass(pool: &sqlx::PgPool, name: &str) -> Option<String> {
    sqlx::query_scalar("SELECT to_regclass($1)::text")
        .bind(name)
        .fetch_one(pool)
        .await
        .unwrap()
}
