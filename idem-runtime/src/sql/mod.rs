//! The statements of the SQL stores: one text for both dialects, which
//! differ only in their clock expression and placeholder sign. Every
//! statement is built once per store, with the table name validated and
//! quoted, and every value bound as a parameter. Running them is in `run`,
//! the schema's versions in `migrate`; docs/PROTOCOL.md, "Statements per
//! path", lists them by request path.

mod migrate;
mod run;

#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg(feature = "postgres")]
mod replays;
#[cfg(feature = "sqlite")]
pub(crate) mod sqlite;
#[cfg(feature = "sqlite")]
mod sqlite_file;

pub use migrate::Migration;
pub(crate) use migrate::{
    check_schema, found, migrate_in, migrations, newer_schema, probed, reason, refuse_column_types,
    refuse_encoding, refuse_found_elsewhere, refuse_schema, refuse_unreservable, schema_error,
};
#[cfg(feature = "sqlite")]
pub(crate) use run::sqlite_busy_or_locked;
#[cfg(feature = "axum")]
pub(crate) use run::Deadline;
pub(crate) use run::{
    bounded, complete_with, encode_err, fenced, judge_row, map_err, map_wait_err, millis, purge_within,
    sized_arguments,
};
#[cfg(feature = "postgres")]
pub(crate) use run::{columns_are, lock_wait_ran_out};
#[cfg(feature = "postgres")]
pub(crate) use run::{fenced_ops, judge_existing, reserve_detached};
#[cfg(feature = "sqlite")]
pub(crate) use run::{lease_from_row, OwnedReserve};

use crate::store::{RecordState, StoreError};

/// What a statement that took the key returns.
const RETURNED: &str = "attempt, taken_over, recovery_point, operation_id";

/// The table name both SQL stores use unless told otherwise.
pub const DEFAULT_TABLE: &str = "idempotency_keys";

/// The longest table name: PostgreSQL's 63 bytes. The names derived from it
/// (`<table>_purge_at_idx`, `<table>_migrations`) that would not fit are
/// `idem_<what>_` and a hash of the table's name instead, so that they never
/// truncate or collide.
pub const MAX_TABLE_NAME: usize = 63;

/// `<table>_<suffix>`, or `idem_<suffix>_<hash>` where that would not fit.
fn derived_name(table: &str, suffix: &str) -> String {
    use sha2::{Digest, Sha256};
    let name = format!("{table}_{suffix}");
    if name.len() <= 63 {
        return name;
    }
    let hash = crate::fingerprint::hex(&Sha256::digest(table.as_bytes())[..8]);
    format!("idem_{suffix}_{hash}")
}

/// Every column the records table has at the latest version.
const COLUMNS: &str =
    "tenant, scope, key, fingerprint, state, operation_id, lock_token, attempt, taken_over, \
                       lock_expires_at, recovery_point, response_status, response_headers, response_body, \
                       created_at, expires_at, purge_at";

/// PostgreSQL: why a column or an index of the table `t` (quoted, as the
/// statements name it) cannot be used, or NULL. Each column takes the types
/// that hold every value idem writes and that its statements read back: a
/// text column `text` or `varchar` (unbounded, or at least as long as the
/// longest value: the id's parts 255 characters, a fingerprint 64, a token
/// or operation id 32, the state 11), with a deterministic collation for
/// those an id or fingerprint is compared on (a case-insensitive one would
/// make the keys `A` and `a` one record, answering one request with
/// another's answer); the body `bytea`; the status and `taken_over` any
/// integer, `attempt` `integer` or `bigint`; the times `timestamptz` to the
/// millisecond at least (to the second, a lock ran out up to half a second
/// early; as `timestamp`, without a time zone, each session read them in
/// its own `TimeZone`, and a server whose sessions were in another took
/// the locks of the others over while their handlers ran). A domain counts
/// as its base type; none may be `NOT NULL` where idem writes NULL,
/// itself or through a domain (the token of a completed record: every
/// completion failed); a domain's `CHECK`s, like the table's own, are the
/// application's. Other types fail the
/// statements that write or read them, some only once an answer was
/// stored: a body column of `text` stores the answer and every replay of
/// it then fails. And every unique index or exclusion constraint with a
/// column that is tenant, scope or key, an expression or a generated column
/// must be one that `ON CONFLICT (tenant, scope, key)` takes as its
/// arbiter: those three columns alone, compared as text is (PostgreSQL's
/// own operator classes), under deterministic collations, without a
/// predicate, not `DEFERRABLE` (which it refuses), on a partition attached
/// to the table's. One on `lower(key)`, on the key alone, on a generated
/// column of the lower-case key, under a case-insensitive collation or
/// operator class makes two ids one (one of them then fails on every try);
/// any other (an exclusion constraint, a partial index, one on more
/// columns, a partition's own) is checked apart from the arbiter, and of
/// two first requests that race on one key one can fail on it. An
/// expression is not read: one that never involves the id (`payload ->>
/// 'key'`) is refused all the same. One that is not ready yet (a `CREATE
/// INDEX CONCURRENTLY` that failed) enforces nothing, and one on other
/// plain columns (`operation_id`) is the application's. The indexes of a
/// partitioned table's partitions count as its own.
///
/// Every catalog table is reached through its index on the table's oid:
/// a plan that scanned `pg_index` whole was estimated at tens of millions
/// (more, the more relations the database holds), above PostgreSQL's
/// `jit_above_cost`, and the JIT compilation alone took about a second of
/// every `check_schema()` and `migrate()`, where the check itself takes a
/// few milliseconds.
fn column_types(t: &str) -> String {
    // (column, kind, the longest value, whether ids are compared on it,
    // whether idem writes NULL to it).
    let columns = "('tenant', 'text', 255, true, false), ('scope', 'text', 255, true, false), \
                   ('key', 'text', 255, true, false), ('fingerprint', 'text', 64, true, false), \
                   ('state', 'text', 11, true, false), ('operation_id', 'text', 32, false, false), \
                   ('lock_token', 'text', 32, true, true), ('recovery_point', 'text', NULL, false, true), \
                   ('response_headers', 'text', NULL, false, true), ('response_body', 'bytea', NULL, false, true), \
                   ('response_status', 'int', NULL, false, true), ('taken_over', 'int', NULL, false, false), \
                   ('attempt', 'int4', NULL, false, false), ('lock_expires_at', 'time', NULL, false, false), \
                   ('created_at', 'time', NULL, false, false), ('expires_at', 'time', NULL, false, false), \
                   ('purge_at', 'time', NULL, false, false)";
    let deterministic = |collation: &str| {
        format!(
            "COALESCE((SELECT (to_jsonb(co) ->> 'collisdeterministic')::boolean \
             FROM pg_catalog.pg_collation co WHERE co.oid = {collation}), true)"
        )
    };
    format!(
        "SELECT string_agg(why, '; ' ORDER BY why) FROM (\
         SELECT CASE WHEN NOT CASE n.kind \
         WHEN 'text' THEN c.typ = 'text'::regtype OR (c.typ = 'varchar'::regtype \
         AND (c.typmod < 0 OR (n.len IS NOT NULL AND c.typmod - 4 >= n.len))) \
         WHEN 'bytea' THEN c.typ = 'bytea'::regtype \
         WHEN 'int' THEN c.typ IN ('int2'::regtype, 'int4'::regtype, 'int8'::regtype) \
         WHEN 'int4' THEN c.typ IN ('int4'::regtype, 'int8'::regtype) \
         ELSE c.typ = 'timestamptz'::regtype AND (c.typmod < 0 OR c.typmod >= 3) END \
         THEN format('%s is %s, where idem needs %s', n.col, format_type(c.typ, c.typmod), CASE n.kind \
         WHEN 'text' THEN 'text or varchar' || COALESCE(' of at least ' || n.len || ' characters', ' without a length') \
         WHEN 'bytea' THEN 'bytea' WHEN 'int' THEN 'smallint, integer or bigint' \
         WHEN 'int4' THEN 'integer or bigint' \
         ELSE 'timestamptz, to the millisecond at least (a time without a time zone is read in each \
         session''s own TimeZone, and servers in different ones take each other''s locks over)' END) \
         WHEN n.nulls AND c.no_null THEN format('%s is the domain %s, NOT NULL, where idem writes NULL; \
         idem needs %s itself or a domain that takes NULL', \
         n.col, format_type(a.atttypid, a.atttypmod), format_type(c.typ, c.typmod)) \
         WHEN n.nulls AND a.attnotnull THEN format('%s is NOT NULL, where idem writes NULL (the token of a \
         record no longer locked, the answer of one not yet answered); idem needs it to take NULL', n.col) \
         WHEN n.ids AND NOT {column_deterministic} \
         THEN format('%s has the nondeterministic collation %s, under which two different ids or \
         fingerprints can be equal; idem needs a deterministic one (the database''s default)', \
         n.col, (SELECT co.collname FROM pg_catalog.pg_collation co WHERE co.oid = a.attcollation)) END AS why \
         FROM (VALUES {columns}) AS n (col, kind, len, ids, nulls) \
         JOIN pg_catalog.pg_attribute a ON a.attrelid = to_regclass('{t}') AND a.attname = n.col \
         AND NOT a.attisdropped \
         CROSS JOIN LATERAL (WITH RECURSIVE d (typ, typmod, no_null, depth) AS (\
         SELECT a.atttypid, a.atttypmod, false, 0 UNION ALL \
         SELECT ty.typbasetype, CASE WHEN d.typmod >= 0 THEN d.typmod ELSE ty.typtypmod END, \
         d.no_null OR ty.typnotnull, d.depth + 1 \
         FROM d JOIN pg_catalog.pg_type ty ON ty.oid = d.typ AND ty.typtype = 'd' WHERE d.depth < 64) \
         SELECT typ, typmod, no_null FROM d ORDER BY depth DESC LIMIT 1) AS c \
         UNION ALL \
         SELECT format('%s is NOT NULL in the partition %s, where idem writes NULL; idem needs it to take NULL', \
         a.attname, a.attrelid::regclass) \
         FROM pg_catalog.pg_attribute a WHERE a.attrelid = ANY (ARRAY(SELECT p.relid::oid \
         FROM pg_catalog.pg_partition_tree(to_regclass('{t}')) AS p WHERE p.relid <> to_regclass('{t}'))) \
         AND a.attnotnull AND NOT a.attisdropped \
         AND a.attname IN ('lock_token', 'recovery_point', 'response_headers', 'response_body', 'response_status') \
         UNION ALL \
         SELECT format('the %s %s %s; idem needs every unique index or exclusion constraint with a column \
         that is tenant, scope or key, an expression or a generated column to be one that ON CONFLICT \
         (tenant, scope, key) takes: on those three columns alone, compared as text is, under \
         deterministic collations, without a predicate, not DEFERRABLE (on a partition, attached to the \
         table''s)', \
         CASE WHEN i.indisexclusion THEN 'exclusion constraint''s index' ELSE 'unique index' END, \
         i.indexrelid::regclass, CASE \
         WHEN NOT i.indimmediate THEN 'is DEFERRABLE, which ON CONFLICT refuses' \
         WHEN 3 > {held} THEN 'does not hold tenant, scope and key as columns compared as text is, under \
         deterministic collations: it can make two different ids one, and one of them then fails on every try' \
         ELSE 'is not one ON CONFLICT takes: of two first requests that race on one key, one can fail on it' \
         END) \
         FROM pg_catalog.pg_index i WHERE i.indrelid = ANY (ARRAY(SELECT to_regclass('{t}')::oid \
         UNION SELECT p.relid::oid FROM pg_catalog.pg_partition_tree(to_regclass('{t}')) AS p)) \
         AND (i.indisunique OR i.indisexclusion) AND i.indisready \
         AND EXISTS (SELECT 1 FROM {key_columns} \
         LEFT JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum \
         WHERE k.n <= i.indnkeyatts AND (k.attnum = 0 OR a.attname IN ('tenant', 'scope', 'key') \
         OR a.attgenerated <> '')) \
         AND NOT (i.indisunique AND NOT i.indisexclusion AND i.indimmediate AND i.indisvalid \
         AND i.indpred IS NULL AND i.indexprs IS NULL AND i.indnkeyatts = 3 AND {held} = 3 \
         AND (i.indrelid = to_regclass('{t}') \
         OR EXISTS (SELECT 1 FROM pg_catalog.pg_inherits h WHERE h.inhrelid = i.indexrelid)))) AS w",
        // How many of tenant, scope and key the index holds as columns
        // compared as text is (PostgreSQL's own operator classes), under
        // deterministic collations.
        held = format!(
            "(SELECT count(DISTINCT a.attname) FROM {key_columns} \
             JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum \
             JOIN pg_catalog.pg_opclass opc ON opc.oid = i.indclass[k.n - 1] \
             WHERE k.n <= i.indnkeyatts AND a.attname IN ('tenant', 'scope', 'key') AND {index_deterministic} \
             AND opc.opcnamespace = 'pg_catalog'::pg_catalog.regnamespace \
             AND EXISTS (SELECT 1 FROM pg_catalog.pg_amop op WHERE op.amopfamily = opc.opcfamily \
             AND op.amopstrategy = 3 AND op.amoplefttype = opc.opcintype AND op.amoprighttype = opc.opcintype \
             AND op.amopopr = 'pg_catalog.=(pg_catalog.text,pg_catalog.text)'::pg_catalog.regoperator::oid))",
            index_deterministic = deterministic("i.indcollation[k.n - 1]"),
            key_columns = KEY_COLUMNS,
        ),
        key_columns = KEY_COLUMNS,
        column_deterministic = deterministic("a.attcollation"),
    )
}

/// Version 5's drop of the expiry index, as its file writes it.
const EXPIRY_INDEX_DROP: &str = "DROP INDEX IF EXISTS {expiry_index};";

/// The same drop as PostgreSQL runs it: only where the name is an index on
/// the table. With no schema configured the name is bare, and `DROP INDEX`
/// finds it through the search path: where the table's schema held no
/// index of that name (dropped or renamed by hand), another schema's on
/// the path, another table's, went.
#[cfg(feature = "postgres")]
const PG_EXPIRY_INDEX_DROP: &str = "DO $idem$ BEGIN IF EXISTS (SELECT 1 FROM pg_catalog.pg_index \
     WHERE indexrelid = to_regclass('{expiry_index}') AND indrelid = to_regclass('{table}')) \
     THEN DROP INDEX {expiry_index}; END IF; END $idem$;";

/// PostgreSQL: what holds `name` where the migrations make an index of that
/// name on the table `t` (the table's schema; where it is not made yet, the
/// configured one or the first of the search path), unless it is an index
/// on `t`. One row, or none.
fn pg_name_taken(t: &str, schema: Option<&str>, name: &str) -> String {
    let made_in = match schema {
        Some(schema) => format!("to_regnamespace('\"{schema}\"')"),
        None => "(SELECT n.oid FROM pg_catalog.pg_namespace n WHERE n.nspname = current_schema())".to_owned(),
    };
    format!(
        "SELECT format('%s is %s', c.oid::regclass, COALESCE('an index on ' || i.indrelid::regclass, \
         CASE c.relkind WHEN 'r' THEN 'a table' WHEN 'v' THEN 'a view' WHEN 'S' THEN 'a sequence' \
         ELSE 'another relation' END)) \
         FROM pg_catalog.pg_class c LEFT JOIN pg_catalog.pg_index i ON i.indexrelid = c.oid \
         WHERE (c.relname = '{name}' AND c.relnamespace = COALESCE((SELECT r.relnamespace \
         FROM pg_catalog.pg_class r WHERE r.oid = to_regclass('{t}')), {made_in})) \
         AND NOT COALESCE(i.indrelid = to_regclass('{t}'), false) LIMIT 1"
    )
}

/// SQLite: what holds `name` in `schema` (names in any case), unless it is
/// `table`'s own: for an index, a table, view or index (one namespace in
/// SQLite); for a trigger, a trigger (a namespace of its own). One row, or
/// none.
fn sqlite_name_taken(schema: &str, table: &str, name: &str, trigger: bool) -> String {
    let kinds = if trigger {
        "'trigger'"
    } else {
        "'table', 'view', 'index'"
    };
    format!(
        "SELECT '\"' || name || '\" is ' || CASE WHEN type IN ('index', 'trigger') \
         THEN 'a' || CASE type WHEN 'index' THEN 'n ' ELSE ' ' END || type || ' on \"' || tbl_name || '\"' \
         ELSE 'a ' || type END FROM \"{schema}\".sqlite_master \
         WHERE lower(name) = lower('{name}') AND type IN ({kinds}) \
         AND NOT (type IN ('index', 'trigger') AND lower(tbl_name) = lower('{table}')) LIMIT 1"
    )
}

/// The key columns of the index `i` as rows `k (attnum, n)`, `n` from 1:
/// an `unnest`, which the planner takes for a few rows, where a
/// `generate_series` of bounds it cannot read is taken for a thousand (and
/// made the check's estimate a JIT compilation's). `n <= i.indnkeyatts`
/// leaves out the `INCLUDE` columns; `indclass` and `indcollation` are
/// read at `n - 1`, as they count from 0.
const KEY_COLUMNS: &str = "unnest(i.indkey::pg_catalog.int2[]) WITH ORDINALITY AS k (attnum, n)";

/// SQLite: why the id's columns of `schema.table` could make two ids
/// one, or NULL. SQLite's declared types refuse no value, but a column
/// whose affinity is numeric (declared `INTEGER`, `NUMERIC`, `REAL`,
/// `STRING`, ...) stores a key that reads as a number as that number (the
/// keys `1000` and `1e3` are then one record; `ANY` in a `STRICT` table
/// keeps text); a column's collation other than `BINARY` (`NOCASE`,
/// `RTRIM`) makes `ABC` and `abc` one where the statements compare it (told
/// by how a `UNION` led by the column counts `a`, `A` and `a `: the
/// column's collation decides), and so does a unique index with a column
/// that is one of them, an expression or a generated column, without
/// holding tenant, scope and key as `BINARY` columns. One on other plain
/// columns is the application's. And none of the token's and the answer's
/// columns may be `NOT NULL`, where idem writes NULL. Names are compared
/// as SQLite compares them, in any case.
fn sqlite_column_types(schema: &str, table: &str) -> String {
    let collated = |column: &str| {
        format!(
            "SELECT '{column} has a collation under which two different ids are equal (a, A and a followed by \
             a space are not three under it), where idem needs BINARY' WHERE (SELECT count(*) FROM \
             (SELECT {column} FROM \"{schema}\".\"{table}\" WHERE 0 UNION SELECT 'a' UNION SELECT 'A' \
             UNION SELECT 'a ')) <> 3"
        )
    };
    format!(
        "SELECT group_concat(why, '; ') FROM (\
         SELECT name || ' is declared ' || CASE WHEN type = '' THEN 'without a type' ELSE type END \
         || ', whose numeric affinity makes a key that reads as a number that number (1000 and 1e3 one \
         record), where idem needs TEXT' AS why FROM pragma_table_xinfo('{table}', '{schema}') \
         WHERE lower(name) IN ('tenant', 'scope', 'key') AND (upper(type) LIKE '%INT%' \
         OR (upper(type) NOT LIKE '%CHAR%' AND upper(type) NOT LIKE '%CLOB%' AND upper(type) NOT LIKE '%TEXT%' \
         AND upper(type) NOT LIKE '%BLOB%' AND type <> '')) \
         AND NOT (upper(type) = 'ANY' AND EXISTS (SELECT 1 FROM pragma_table_list \
         WHERE lower(schema) = lower('{schema}') AND lower(name) = lower('{table}') AND strict = 1)) \
         UNION ALL SELECT name || ' is NOT NULL, where idem writes NULL (the token of a record no longer \
         locked, the answer of one not yet answered); idem needs it to take NULL' \
         FROM pragma_table_xinfo('{table}', '{schema}') WHERE \"notnull\" = 1 AND lower(name) IN \
         ('lock_token', 'recovery_point', 'response_status', 'response_headers', 'response_body') \
         UNION ALL {tenant} UNION ALL {scope} UNION ALL {key} \
         UNION ALL SELECT 'the unique index ' || l.name || ' does not hold tenant, scope and key as BINARY \
         columns: it can make two different ids one, and one of them then fails on every try; idem needs \
         every unique index whose columns are any of them, an expression or a generated column to hold all \
         three' \
         FROM pragma_index_list('{table}', '{schema}') AS l WHERE l.\"unique\" = 1 \
         AND EXISTS (SELECT 1 FROM pragma_index_xinfo(l.name, '{schema}') AS x WHERE x.key = 1 \
         AND (lower(x.name) IN ('tenant', 'scope', 'key') OR x.cid = -2 OR lower(x.name) IN (SELECT lower(c.name) \
         FROM pragma_table_xinfo('{table}', '{schema}') AS c WHERE c.hidden IN (2, 3)))) AND 3 > (\
         SELECT count(DISTINCT lower(x.name)) FROM pragma_index_xinfo(l.name, '{schema}') AS x WHERE x.key = 1 \
         AND lower(x.name) IN ('tenant', 'scope', 'key') AND upper(x.coll) = 'BINARY'))",
        tenant = collated("tenant"),
        scope = collated("scope"),
        key = collated("key"),
    )
}

/// PostgreSQL: why the table `v`, named as idem's migrations table and
/// with its three columns, cannot be it, or NULL: a view (nothing can be
/// recorded in it); one of the three generated (`GENERATED ALWAYS`),
/// where idem writes them; columns of other types than `bigint`, text (of
/// 32 characters or more) and `bigint` (PostgreSQL casts idem's numbers
/// into text or a narrower integer on the way in, and the table would be
/// made beside it, its versions unreadable), a domain over one, at any
/// depth, counting as the type; or a `version` without a unique key that
/// `ON CONFLICT (version)` can take as its arbiter (valid, on the column
/// alone, without a predicate), or with one it refuses (`DEFERRABLE`).
fn pg_versions_fit(v: &str) -> String {
    let on_version = "i.indrelid = c.oid AND i.indisunique AND i.indpred IS NULL AND i.indexprs IS NULL \
                      AND i.indnkeyatts = 1 AND i.indkey[0] = (SELECT a.attnum FROM pg_catalog.pg_attribute a \
                      WHERE a.attrelid = c.oid AND a.attname = 'version')";
    // One row whatever the catalog holds (a scalar subquery), as every
    // check's reason is read.
    format!(
        "SELECT (WITH RECURSIVE cols (col, typ, typmod, depth) AS (SELECT a.attname::text, a.atttypid, a.atttypmod, 0 \
         FROM pg_catalog.pg_attribute a WHERE a.attrelid = to_regclass('{v}') AND a.attnum > 0 \
         AND NOT a.attisdropped AND a.attname IN ('version', 'name', 'applied_at') \
         UNION ALL SELECT c.col, t.typbasetype, t.typtypmod, c.depth + 1 FROM cols c \
         JOIN pg_catalog.pg_type t ON t.oid = c.typ WHERE t.typbasetype <> 0 AND c.depth < 32), \
         base AS (SELECT col, (array_agg(typ ORDER BY depth DESC))[1] AS typ, \
         min(typmod) FILTER (WHERE typmod >= 0) AS typmod FROM cols GROUP BY col) \
         SELECT CASE WHEN c.relkind NOT IN ('r', 'p') THEN 'it is not a table' \
         WHEN EXISTS (SELECT 1 FROM pg_catalog.pg_attribute a WHERE a.attrelid = c.oid AND NOT a.attisdropped \
         AND a.attname IN ('version', 'name', 'applied_at') AND (a.attidentity = 'a' OR a.attgenerated <> '')) \
         THEN 'its column version, name or applied_at is generated, where idem writes them' \
         WHEN odd.cols IS NOT NULL THEN CASE WHEN odd.cols LIKE '%,%' THEN 'its columns ' || odd.cols \
         || ' are' ELSE 'its column ' || odd.cols || ' is' END || ' not of the type idem writes (version \
         and applied_at bigint, name text of 32 characters or more)' \
         WHEN NOT EXISTS (SELECT 1 FROM pg_catalog.pg_index i WHERE {on_version} AND i.indisvalid) \
         THEN 'its version is not a unique key, where idem records each version once' \
         WHEN EXISTS (SELECT 1 FROM pg_catalog.pg_index i WHERE {on_version} AND NOT i.indimmediate) \
         THEN 'its unique key on version is DEFERRABLE, which ON CONFLICT (version) cannot take' END \
         FROM pg_catalog.pg_class c, (SELECT string_agg(b.col, ', ' ORDER BY b.col) AS cols FROM base b \
         JOIN pg_catalog.pg_type t ON t.oid = b.typ WHERE NOT ((b.col <> 'name' \
         AND b.typ = 'pg_catalog.int8'::pg_catalog.regtype) OR (b.col = 'name' AND t.typcategory = 'S' \
         AND (b.typmod IS NULL OR b.typmod - 4 >= 32)))) AS odd WHERE c.oid = to_regclass('{v}'))"
    )
}

/// PostgreSQL: why the table `t` cannot be served in its schema, or NULL
/// (see [`refuse_schema`]): a schema named that does not exist; or, none
/// named, no schema of the search path that exists, or one PostgreSQL
/// keeps for itself (`information_schema`, `pg_...`) that the table is in
/// or would be made in. The first three bytes are compared, not `LIKE
/// 'pg\_%'`, whose backslash `standard_conforming_strings = off` reads
/// otherwise; `Statements::new` refuses the same names given to it.
fn pg_schema_problem(t: &str, schema: Option<&str>) -> String {
    let advice = "set the search_path to a schema of the application''s, or name one (`with_table`)";
    match schema {
        Some(schema) => format!(
            "SELECT CASE WHEN to_regnamespace('\"{schema}\"') IS NULL THEN 'the schema \"{schema}\" does not \
             exist: create it first (migrate() makes idem''s tables, not their schema)' END"
        ),
        None => format!(
            "SELECT CASE WHEN current_schema() IS NULL AND to_regclass('{t}') IS NULL THEN 'no schema of the \
             connection''s search_path exists to make it in: {advice}' ELSE (SELECT 'it is, or would be \
             made, in the schema ' || n.nspname || ', which is PostgreSQL''s own: {advice}' \
             FROM pg_catalog.pg_namespace n WHERE n.oid = COALESCE((SELECT c.relnamespace \
             FROM pg_catalog.pg_class c WHERE c.oid = to_regclass('{t}')), (SELECT m.oid \
             FROM pg_catalog.pg_namespace m WHERE m.nspname = current_schema())) \
             AND (n.nspname = 'information_schema' OR left(n.nspname, 3) = 'pg_')) END"
        ),
    }
}

/// SQLite: [`pg_versions_fit`]'s reasons for the table `name` in
/// `schema`: a view; one of the three columns generated; `version` or
/// `applied_at` declared of a type without integer affinity (a `TEXT`
/// version keeps idem's numbers as text, which then read as no version);
/// or a `version` that is neither the table's sole primary key column nor
/// a unique index of its own without a `WHERE`. Names are compared in any
/// case.
fn sqlite_versions_fit(schema: &str, name: &str) -> String {
    format!(
        "SELECT CASE WHEN (SELECT type FROM \"{schema}\".sqlite_master WHERE lower(name) = lower('{name}') \
         AND type IN ('table', 'view')) <> 'table' THEN 'it is not a table' \
         WHEN EXISTS (SELECT 1 FROM pragma_table_xinfo('{name}', '{schema}') WHERE hidden <> 0 \
         AND lower(name) IN ('version', 'name', 'applied_at')) \
         THEN 'its column version, name or applied_at is generated, where idem writes them' \
         WHEN 3 > (SELECT count(*) FROM pragma_table_info('{name}', '{schema}') WHERE lower(name) = 'name' \
         OR (lower(name) IN ('version', 'applied_at') AND (upper(type) LIKE '%INT%' OR type = ''))) \
         THEN 'its columns version and applied_at are not declared as integers' \
         WHEN NOT (1 = (SELECT count(*) FROM pragma_table_info('{name}', '{schema}') WHERE pk > 0) \
         AND EXISTS (SELECT 1 FROM pragma_table_info('{name}', '{schema}') WHERE lower(name) = 'version' \
         AND pk = 1)) AND NOT EXISTS (SELECT 1 FROM pragma_index_list('{name}', '{schema}') AS l \
         WHERE l.\"unique\" = 1 AND l.partial = 0 AND 1 = (SELECT count(*) FROM pragma_index_info(l.name, \
         '{schema}')) AND EXISTS (SELECT 1 FROM pragma_index_info(l.name, '{schema}') AS x \
         WHERE lower(x.name) = 'version')) \
         THEN 'its version is not a unique key, where idem records each version once' END"
    )
}

/// The two SQL dialects.
#[derive(Clone, Copy)]
pub(crate) struct Dialect {
    /// The store's clock, in the unit of the time columns.
    now: &'static str,
    /// `$` (PostgreSQL) or `?` (SQLite), followed by the parameter number.
    param: char,
    /// Turns a millisecond parameter into something addable to `now`.
    millis: fn(String) -> String,
    /// Milliseconds left until a time column, never negative.
    left: fn(&str, &str) -> String,
    /// What the purge adds to its choice of rows: on PostgreSQL it locks
    /// them and skips those another transaction holds.
    purge_lock: &'static str,
    /// How the purge's choice of rows is kept, so that it is made once per
    /// statement: on PostgreSQL a subquery that locks its rows may be run
    /// again for each row of a nested loop, each run choosing the next
    /// rows past those already taken, and its `LIMIT` would then bound each
    /// run, not the statement.
    purge_chosen: &'static str,
    /// The schema every statement names the table, its migrations table
    /// and its indexes in when none is configured (SQLite's `main`: a
    /// `TEMP` table of the same name, which SQLite finds first, or an
    /// attached database's, would otherwise be read and written instead);
    /// `None`: the search path finds them.
    rows_schema: Option<&'static str>,
    /// The `purge_at` of a row written before migration 5 or by an earlier
    /// build: not set yet (the column's default).
    purge_unset: &'static str,
    /// A set `purge_at` earlier than every real time: what a row whose
    /// expiry is no later than "not set" gets (an expiry nobody writes but
    /// someone could, by hand).
    purge_floor: &'static str,
    /// Whether a row's expiry is a time the janitor may copy into
    /// `purge_at` (beside being later than "not set"): on SQLite, an
    /// integer (text left by the upgrade to version 7, which its triggers
    /// refuse to see written, gets `purge_floor`).
    purge_copies: &'static str,
    /// Version 5's drop of the old expiry index as the dialect runs it (its
    /// file's text is [`EXPIRY_INDEX_DROP`]).
    expiry_index_drop: &'static str,
    /// The store's clock in milliseconds since the Unix epoch.
    epoch_millis: &'static str,
    /// The time now, even inside a transaction (PostgreSQL's `now()` is the
    /// transaction's start), the same everywhere in one statement.
    clock: &'static str,
    /// The time as the statement computes the row it writes
    /// (PostgreSQL's `clock_timestamp()`, computed again after waiting for
    /// another transaction's write of the row; `now()` is the statement's
    /// start, before any wait): of two writes of one row, the later one's
    /// is later. What a heartbeat counts its deadline from, so that one
    /// sent earlier but written later (it waited on a lock, or was given
    /// up on at the store's timeout and ran on) never moves the deadline
    /// earlier than a later one set it.
    latest: &'static str,
    /// The length of time from `b` to `a`, addable to a time column: an
    /// exact one (PostgreSQL's timestamp difference counts calendar days,
    /// which a time zone with daylight saving stretches).
    span: fn(&str, &str) -> String,
    /// The same, for the completion alone. On PostgreSQL it is computed in
    /// `float8` (within a microsecond for any TTL), not `numeric`. (`span`
    /// is in the reservation function's source, which `migrate()` compares
    /// with this build's: a change to it is a new function, which
    /// `migrate()` creates in place of the old one; `check_schema` only
    /// asks that a function of that name and signature be there.)
    kept_span: fn(&str, &str) -> String,
    /// Lists the columns of `table` (in `schema`) that a row must fill (no
    /// default, not null) and that are not in `known` (a list of quoted
    /// names). The names are checked identifiers.
    required_columns: fn(Option<&str>, &str, &str) -> String,
    /// PostgreSQL: whether the first schema's check on `state` is there (a
    /// plain query: a role may be refused PL/pgSQL), and the block that
    /// drops it, `{table}` standing for the table in both (see
    /// `drop_state_check.sql`).
    drop_state_check: Option<(&'static str, &'static str)>,
    /// Whether the reservation's write path is a server-side function
    /// (PostgreSQL), created by migration 4.
    reserve_function: bool,
    /// PostgreSQL: the database's encoding, which must hold any Unicode
    /// text (a tenant, a checkpoint's name).
    encoding: Option<&'static str>,
}

#[cfg(feature = "postgres")]
pub(crate) const POSTGRES: Dialect = Dialect {
    now: "now()",
    param: '$',
    millis: |p| format!("({p}::bigint * interval '1 millisecond')"),
    // `date_part`, not `EXTRACT`: since PostgreSQL 14 `EXTRACT` gives a
    // `numeric`, whose arithmetic costs every lookup (a replay's, a 409's)
    // up to a microsecond more than `float8`'s. Its rounding can only add a
    // millisecond to the time left, which a 409 reports as `Retry-After`.
    // An infinite lock (edited by hand), which PostgreSQL cannot subtract:
    // a hundred years left, or none.
    left: |col, now| {
        format!(
            "(CASE WHEN isfinite({col}) THEN GREATEST(0, CEIL(date_part('epoch', {col} - {now}) * 1000))::bigint \
             WHEN {col} > {now} THEN 3155760000000 ELSE 0 END)"
        )
    },
    purge_lock: " FOR UPDATE SKIP LOCKED",
    purge_chosen: "MATERIALIZED ",
    rows_schema: None,
    purge_unset: "'-infinity'::timestamptz",
    purge_floor: "'epoch'::timestamptz",
    purge_copies: "TRUE",
    expiry_index_drop: PG_EXPIRY_INDEX_DROP,
    epoch_millis: "(EXTRACT(EPOCH FROM now()) * 1000)::bigint",
    clock: "statement_timestamp()",
    latest: "clock_timestamp()",
    // NULL where either time is infinite (edited by hand), which
    // PostgreSQL cannot subtract: a retention that cannot be told is not
    // past, and no statement fails on that row (the purge of the whole
    // table did).
    span: |a, b| {
        format!(
            "(CASE WHEN isfinite({a}) AND isfinite({b}) \
             THEN EXTRACT(EPOCH FROM ({a} - {b})) * interval '1 second' END)"
        )
    },
    kept_span: |a, b| format!("(date_part('epoch', {a} - {b}) * interval '1 second')"),
    required_columns: |schema, table, known| {
        let schema = schema.map_or_else(|| "current_schema()".to_owned(), |s| format!("'{s}'"));
        format!(
            "SELECT column_name::text FROM information_schema.columns WHERE table_schema = {schema} \
             AND table_name = '{table}' AND is_nullable = 'NO' AND column_default IS NULL \
             AND column_name NOT IN ({known})"
        )
    },
    drop_state_check: Some((
        "SELECT EXISTS (SELECT 1 FROM pg_constraint WHERE conrelid = '{table}'::regclass \
         AND contype = 'c' AND replace(pg_get_constraintdef(oid), '\"', '') \
         = 'CHECK ((state = ANY (ARRAY[''in_progress''::text, ''completed''::text])))')",
        include_str!("../../migrations/postgres/drop_state_check.sql"),
    )),
    reserve_function: true,
    encoding: Some("SELECT current_setting('server_encoding')"),
};

#[cfg(feature = "sqlite")]
pub(crate) const SQLITE: Dialect = Dialect {
    now: "CAST(unixepoch('subsec') * 1000 AS INTEGER)",
    param: '?',
    millis: |p| p,
    left: |col, now| format!("MAX(0, {col} - {now})"),
    // One statement under SQLite's write lock: nothing changes meanwhile.
    purge_lock: "",
    purge_chosen: "",
    rows_schema: Some("main"),
    purge_unset: "0",
    purge_floor: "1",
    purge_copies: "typeof(expires_at) = 'integer'",
    expiry_index_drop: EXPIRY_INDEX_DROP,
    epoch_millis: "CAST(unixepoch('subsec') * 1000 AS INTEGER)",
    clock: "CAST(unixepoch('subsec') * 1000 AS INTEGER)",
    // Computed as the statement runs, under the write lock.
    latest: "CAST(unixepoch('subsec') * 1000 AS INTEGER)",
    // NULL where either time is not an integer (text that is no date,
    // left by the upgrade to version 7): SQLite would read it as 0, and a
    // completion would count the answer's retention from 1970.
    span: |a, b| {
        format!("(CASE WHEN typeof({a}) = 'integer' AND typeof({b}) = 'integer' THEN {a} - {b} END)")
    },
    kept_span: |a, b| format!("({a} - {b})"),
    required_columns: |_, table, known| {
        format!(
            "SELECT name FROM pragma_table_info('{table}', 'main') WHERE \"notnull\" = 1 AND dflt_value IS NULL \
             AND lower(name) NOT IN ({known})"
        )
    },
    drop_state_check: None,
    reserve_function: false,
    encoding: None,
};

/// Every statement a store runs, for one table.
pub(crate) struct Statements {
    /// The quoted, qualified table name.
    pub(crate) table: String,
    /// The migrations, their names filled in.
    pub(crate) migrations: Vec<(Migration, String)>,
    /// Creates the migrations table.
    pub(crate) create_versions: String,
    /// The versions applied. Columns: version.
    pub(crate) versions: String,
    /// Reads nothing, but fails unless the versions table exists.
    pub(crate) versions_exist: String,
    /// Reads nothing, but fails unless the versions table has idem's columns.
    pub(crate) versions_shape: String,
    /// Why the versions table, which has idem's columns, cannot serve as
    /// it (not a table, columns of other types, no unique version), or
    /// NULL (see `pg_versions_fit` and `sqlite_versions_fit`).
    pub(crate) versions_fit: String,
    /// The versions table as errors name it.
    pub(crate) versions_shown: String,
    /// Records a version. Binds: version, name.
    pub(crate) record_version: String,
    /// Reads nothing, but fails unless the table exists.
    pub(crate) table_exists: String,
    /// Reads nothing, but fails unless version 2's column exists.
    pub(crate) has_taken_over: String,
    /// Version 5's column, probed the same way.
    pub(crate) has_purge_at: String,
    /// Reads the columns of schema version 1 (fails on a table without them).
    pub(crate) has_v1_columns: String,
    /// Reads nothing, but fails unless every column the code needs exists.
    pub(crate) has_columns: String,
    /// The columns a row must fill that the code does not know.
    pub(crate) unknown_required: String,
    /// Whether a unique key on (tenant, scope, key) is there for every
    /// reservation's `ON CONFLICT`. PostgreSQL: read from the catalog (no
    /// lock of the table's, which a `CREATE INDEX` building would hold up),
    /// one row, why not or NULL. SQLite: an upsert of no row under that
    /// conflict target, explained, not run, which fails without the key.
    pub(crate) has_unique_key: String,
    /// Why the table cannot be written, which reads alone never tell.
    /// PostgreSQL: from the catalog and the session (a standby, a read-only
    /// session, a role without the rights), one row, NULL when it can.
    /// SQLite: the same upsert of no row, run, which fails on a read-only
    /// file (within the migration's own write transaction).
    pub(crate) writes: String,
    /// Why the table cannot serve as it is: a column whose type, collation
    /// or `NOT NULL` cannot hold what idem writes, or a unique index that
    /// would make two ids one or that `ON CONFLICT` does not take. One row,
    /// NULL when the table will do, read from the catalog (SQLite: its
    /// pragmas).
    pub(crate) column_types: String,
    /// The names the migrations give objects of their own (the expiry and
    /// purge indexes; SQLite's triggers) that something else already holds
    /// (`CREATE ... IF NOT EXISTS` would skip idem's, `DROP INDEX IF
    /// EXISTS` would drop the other's): each with the version below which
    /// a pending migration still makes or drops it, and a statement that
    /// says what holds it, or returns no row.
    pub(crate) names_taken: Vec<(i64, String)>,
    /// Whether `has_unique_key` and `writes` are read (PostgreSQL) rather
    /// than run to fail (SQLite).
    pub(crate) checks_read: bool,
    /// Takes the key (insert, or update of a takeable row) in one upsert.
    /// Binds: tenant, scope, key, fingerprint, token, operation id, ttl ms, lock ms.
    #[cfg_attr(not(any(feature = "sqlite", feature = "postgres")), allow(dead_code))]
    pub(crate) take: String,
    /// Binds: tenant, scope, key. Columns: fingerprint, state, status,
    /// headers, body, lock_left_ms.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    pub(crate) existing: String,
    /// `existing` plus `takeable` (1 or 0): whether a reservation with this
    /// fingerprint would take the row as read. Binds: tenant, scope, key,
    /// fingerprint.
    pub(crate) peek: String,
    /// The record's columns as stored, under the primary key, for the
    /// PostgreSQL lookup. Binds: tenant, scope, key.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) stored: String,
    /// Binds: tenant, scope, key, token, status, headers, body.
    pub(crate) complete: String,
    /// Binds: tenant, scope, key, token.
    pub(crate) release: String,
    /// Removes a rejected first attempt. Binds: tenant, scope, key, token.
    pub(crate) reject: String,
    /// One row when a record is stored under the key, whatever its state.
    /// Binds: tenant, scope, key.
    pub(crate) present: String,
    /// Binds: tenant, scope, key, token, recovery point.
    pub(crate) checkpoint: String,
    /// Binds: tenant, scope, key, token, lock ms.
    pub(crate) extend: String,
    /// Binds: batch size.
    pub(crate) purge: String,
    /// Sets `purge_at` from the expiry where it is not set yet (rows from
    /// before migration 5, or of an earlier build). Binds: batch size.
    pub(crate) purge_set: String,
    /// PostgreSQL: the function that takes the key (insert a fresh record,
    /// else take over a takeable one), quoted and qualified; the same
    /// binds as `take`. It returns `take`'s `RETURNING` columns as one
    /// `text[]`, or NULL when it took nothing.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) reserve_function: String,
    /// Whether that function exists (true or false), where there is one.
    pub(crate) has_reserve_function: Option<String>,
    /// The database's encoding, where it may be one that cannot hold all
    /// of Unicode (see [`refuse_encoding`]).
    pub(crate) encoding: Option<&'static str>,
    /// PostgreSQL: why the table's schema cannot hold it (see
    /// [`refuse_schema`]), or NULL; `None` on SQLite.
    pub(crate) schema_problem: Option<String>,
    /// Creates or replaces that function: a migration run does when the
    /// function is missing or is not this build's.
    pub(crate) reserve_ddl: Option<String>,
    /// The function's body as this build defines it, and the query that
    /// reads the body in the database (no row when there is no function).
    pub(crate) reserve_source: Option<(String, String)>,
    /// PostgreSQL: whether the first schema's check on `state` is still
    /// there, and the block that drops it when it can take the table's lock
    /// at once; `migrate` runs the first every time, the second when needed.
    pub(crate) drop_state_check: Option<(String, String)>,
    /// PostgreSQL, no schema named: the schemas other than the one new
    /// objects go to (`current_schema()`) where `search_path` finds the
    /// table or its migrations table. Columns: the schema, where new
    /// objects go.
    pub(crate) found_elsewhere: Option<String>,
}

/// Checks a SQL identifier: ASCII letters, digits and `_`, not starting with
/// a digit, at most `max` bytes. Quoted afterwards all the same.
pub(crate) fn check_identifier(name: &str, max: usize) -> Result<(), StoreError> {
    if name.len() > max {
        return Err(StoreError::backend(format!(
            "the name `{name}` is {} bytes; at most {max} are allowed (PostgreSQL's limit for a name)",
            name.len()
        )));
    }
    let ok = !name.is_empty()
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
        && !name.as_bytes()[0].is_ascii_digit();
    if ok {
        Ok(())
    } else {
        Err(StoreError::backend(format!(
            "invalid table or schema name `{name}`: use ASCII letters, digits and `_`, not starting with a digit"
        )))
    }
}

impl Statements {
    /// `complete` on the table named `qualified`, a quoted name with its
    /// schema: `complete` names the table once, first.
    #[cfg(all(feature = "postgres", feature = "axum"))]
    pub(crate) fn complete_on(&self, qualified: &str) -> String {
        let rest = self
            .complete
            .strip_prefix(&format!("UPDATE {} ", self.table))
            .unwrap_or_else(|| unreachable!("`complete` begins with its table"));
        format!("UPDATE {qualified} {rest}")
    }

    pub(crate) fn new(
        d: Dialect,
        migrations: &[Migration],
        schema: Option<&str>,
        table: &str,
    ) -> Result<Self, StoreError> {
        check_identifier(table, MAX_TABLE_NAME)?;
        if let Some(schema) = schema {
            check_identifier(schema, 63)?;
        }
        // Names the databases keep for themselves: refused here, not by
        // `migrate()` (SQLite's `sqlite_` prefix), or never (PostgreSQL's
        // system schemas, where a superuser's `migrate()` would write).
        if !d.reserve_function && table.to_ascii_lowercase().starts_with("sqlite_") {
            return Err(StoreError::backend(format!(
                "invalid table name `{table}`: names beginning with sqlite_ are SQLite's own"
            )));
        }
        if let Some(system) = schema.filter(|s| *s == "information_schema" || s.starts_with("pg_")) {
            return Err(StoreError::backend(format!(
                "invalid schema `{system}`: it is PostgreSQL's own; give idem a schema of the application's"
            )));
        }
        let qualify = |name: &str| match schema {
            Some(s) => format!("\"{s}\".\"{name}\""),
            None => format!("\"{name}\""),
        };
        // The dialect's own schema (`rows_schema`) where none is configured.
        let own_schema = match (schema, d.rows_schema) {
            (None, Some(rows)) => Some(rows),
            _ => None,
        };
        // A name as the statements write it: in the configured schema, or
        // in the dialect's own.
        let named = |name: &str| match own_schema {
            Some(rows) => format!("\"{rows}\".\"{name}\""),
            None => qualify(name),
        };
        // The table as errors and pause points name it, and as statements
        // and migrations write it.
        let t_shown = qualify(table);
        let t = named(table);
        let versions_name = derived_name(table, "migrations");
        let versions_table = named(&versions_name);
        // Takes nothing (its `SELECT` has no row; SQLite's parser needs its
        // `WHERE` before an upsert), but is planned with the reservations'
        // conflict target, and run it writes.
        let no_row_upsert = format!(
            "INSERT INTO {t} (tenant, scope, key) SELECT tenant, scope, key FROM {t} WHERE 1 = 0 \
             ON CONFLICT (tenant, scope, key) DO NOTHING"
        );
        // An index as `CREATE INDEX` names it: PostgreSQL's, bare, goes to
        // its table's schema; SQLite's names its schema, and then the table
        // it is on (`ON {table} (`, filled with `indexed_table`) is bare.
        // The migrations' own text is never edited: a team that applies
        // them with its own tool fills `{table}` and `{index}` bare.
        let index_named = |name: &str| match own_schema {
            Some(_) => named(name),
            None => format!("\"{name}\""),
        };
        let indexed_table = match own_schema {
            Some(_) => format!("\"{table}\""),
            None => t.clone(),
        };
        let index = index_named(&derived_name(table, "expires_at_idx"));
        let expiry_index = named(&derived_name(table, "expires_at_idx"));
        let purge_index = index_named(&derived_name(table, "purge_at_idx"));
        // SQLite's triggers, named and placed as its indexes are.
        let times_on_insert = index_named(&derived_name(table, "times_on_insert"));
        let times_on_update = index_named(&derived_name(table, "times_on_update"));
        let function = qualify(&derived_name(table, "take"));
        // The function as the checks look it up: in the table's schema, or,
        // with none named, in the one new objects go to (where `migrate`
        // makes it, and where the search path finds it first), never one
        // of another schema on the path.
        let function_ref = match schema {
            Some(_) => format!("'{function}(text, text, text, text, text, text, bigint, bigint)'"),
            None => format!(
                "quote_ident(current_schema()) || '.{function}(text, text, text, text, text, text, bigint, bigint)'"
            ),
        };
        let now = d.now;
        let p = |n: u8| format!("{}{n}", d.param);
        let ms = |n: u8| (d.millis)(p(n));
        let (in_progress, completed) = (RecordState::IN_PROGRESS_COLUMN, RecordState::COMPLETED_COLUMN);
        let live_lock = format!("(cur.state = '{in_progress}' AND cur.lock_expires_at > {now})");
        // Gone (as if absent, and purgeable): a completed record past its
        // TTL; a record in progress (its execution may have crashed after an
        // effect) only once it is also a whole TTL past its lock deadline,
        // so that a retry can still continue its operation.
        let expired = format!(
            "(cur.expires_at <= {now} AND (cur.state = '{completed}' \
             OR cur.lock_expires_at + {ttl} <= {now}))",
            ttl = (d.span)("cur.expires_at", "cur.created_at"),
        );
        let id = format!("tenant = {} AND scope = {} AND key = {}", p(1), p(2), p(3));
        let owned = format!("{id} AND state = '{in_progress}' AND lock_token = {}", p(4));
        // When the janitor first looks at a fresh record: its first expiry,
        // which no record's expiry precedes (the completion counts the TTL
        // from later). It decides when the janitor looks, never what it
        // deletes (`expired` does). The completion leaves it alone, so that
        // storing an answer changes no indexed column.
        let purge_at = format!("{now} + {}", ms(7));
        // A fresh record: absent before, or replacing an expired one.
        let insert = format!(
            "INSERT INTO {t} AS cur (tenant, scope, key, fingerprint, state, operation_id, lock_token, \
             attempt, lock_expires_at, recovery_point, created_at, expires_at, purge_at) \
             VALUES ({}, {}, {}, {}, '{in_progress}', {}, {}, 1, {now} + {}, NULL, {now}, {now} + {}, {purge})",
            p(1),
            p(2),
            p(3),
            p(4),
            p(6),
            p(5),
            ms(8),
            ms(7),
            purge = purge_at,
        );
        // What may be taken: an expired record without a live lock (a new
        // operation), a stale lock (a takeover) or a record released as
        // failed (the retry of its operation), both with the same
        // fingerprint. A released record has no lock token.
        let takeable = format!(
            "NOT {live_lock} AND ({expired} OR (cur.state = '{in_progress}' AND cur.fingerprint = {}))",
            p(4)
        );
        // A retention that cannot be told (a time edited by hand: to an
        // infinity on PostgreSQL, to text on SQLite) is counted afresh from
        // the taking, so that the completion, which counts the answer's
        // retention from the record's, can be written, and the janitor
        // first looks at the record at its new expiry (not at an
        // `infinity` copied from it).
        let untold = format!("({} IS NULL)", (d.span)("cur.expires_at", "cur.created_at"));
        // Taking it: `new(col)` is the new value of a column. A new operation
        // starts afresh; the same one keeps its id and recovery point, so
        // that its derived keys stay the same.
        let take_set = |new: &dyn Fn(&str) -> String| {
            let fresh = format!("({expired})");
            format!(
                "fingerprint = {fp}, state = '{in_progress}', lock_token = {token}, lock_expires_at = {lock}, \
                 attempt = CASE WHEN {fresh} THEN 1 ELSE cur.attempt + 1 END, \
                 taken_over = CASE WHEN {fresh} OR cur.lock_token IS NULL THEN 0 ELSE 1 END, \
                 recovery_point = CASE WHEN {fresh} THEN NULL ELSE cur.recovery_point END, \
                 operation_id = CASE WHEN {fresh} THEN {op} ELSE cur.operation_id END, \
                 created_at = CASE WHEN {fresh} OR {untold} THEN {created} ELSE cur.created_at END, \
                 expires_at = CASE WHEN {fresh} OR {untold} THEN {expires} ELSE cur.expires_at END, \
                 purge_at = CASE WHEN {fresh} OR {untold} THEN {purge} ELSE cur.purge_at END, \
                 response_status = NULL, response_headers = NULL, response_body = NULL",
                fp = new("fingerprint"),
                token = new("lock_token"),
                lock = new("lock_expires_at"),
                op = new("operation_id"),
                created = new("created_at"),
                expires = new("expires_at"),
                purge = new("purge_at"),
            )
        };
        // The two writes of the reservation functions, each ending in
        // `RETURNING `: what they return is the function's to say.
        let insert_new = format!("{insert} ON CONFLICT (tenant, scope, key) DO NOTHING RETURNING ");
        let take_over = format!(
            "UPDATE {t} AS cur SET {set} WHERE cur.tenant = {p1} AND cur.scope = {p2} \
             AND cur.key = {p3} AND {takeable} RETURNING ",
            set = take_set(&|col| match col {
                "fingerprint" => p(4),
                "lock_token" => p(5),
                "operation_id" => p(6),
                "lock_expires_at" => format!("{now} + {}", ms(8)),
                "created_at" => now.to_owned(),
                "purge_at" => purge_at.clone(),
                _ => format!("{now} + {}", ms(7)), // expires_at
            }),
            p1 = p(1),
            p2 = p(2),
            p3 = p(3),
        );
        // PostgreSQL, migration 4: the write path of a reservation as a
        // set-returning function (the insert, and only when it took
        // nothing, the takeover). This build no longer calls it; it stays
        // for the builds before migration 6 that still serve during a
        // rolling upgrade, and a fresh table gets it as version 4 did.
        let reserve_v4_ddl = if d.reserve_function {
            format!(
                "CREATE OR REPLACE FUNCTION {function_v4}(text, text, text, text, text, text, bigint, bigint) \
                 RETURNS TABLE (attempt integer, taken_over integer, recovery_point text, operation_id text) \
                 LANGUAGE plpgsql AS $idem$\n#variable_conflict use_column\nBEGIN\n\
                 RETURN QUERY {insert_new}{RETURNED};\nIF FOUND THEN RETURN; END IF;\n\
                 RETURN QUERY {take_over}{RETURNED};\nEND\n$idem$;",
                function_v4 = qualify(&derived_name(table, "reserve")),
            )
        } else {
            String::new()
        };
        // PostgreSQL, migration 6: the same write path as a function that
        // returns one value (its plans cached per connection): the insert,
        // and only when it took nothing, the takeover, which judges the row
        // as committed by then (the winner's, when another request inserted
        // it meanwhile). It returns the lease's columns as text (attempt,
        // taken_over, recovery_point, operation_id), or NULL when it took
        // nothing. A scalar function is what lets the reserving statement
        // call it from a `CASE` that PostgreSQL evaluates only when the
        // lookup found nothing to answer from, at no cost otherwise.
        let taken = "ARRAY[attempt::text, taken_over::text, recovery_point, operation_id]";
        let reserve_body = format!(
            "\n#variable_conflict use_column\nDECLARE taken text[];\nBEGIN\n\
             {insert_new}{taken} INTO taken;\nIF FOUND THEN RETURN taken; END IF;\n\
             {take_over}{taken} INTO taken;\nRETURN taken;\nEND\n"
        );
        let reserve_ddl = if d.reserve_function {
            format!(
                "CREATE OR REPLACE FUNCTION {function}(text, text, text, text, text, text, bigint, bigint) \
                 RETURNS text[] LANGUAGE plpgsql AS $idem${reserve_body}$idem$;"
            )
        } else {
            String::new()
        };
        Ok(Statements {
            table: t_shown,
            migrations: migrations
                .iter()
                .map(|m| {
                    (
                        *m,
                        m.sql
                            .replace(EXPIRY_INDEX_DROP, d.expiry_index_drop)
                            .replace(" ON {table} (", &format!(" ON {indexed_table} ("))
                            .replace(" ON {table} FOR EACH ROW", &format!(" ON {indexed_table} FOR EACH ROW"))
                            .replace("{times_on_insert}", &times_on_insert)
                            .replace("{times_on_update}", &times_on_update)
                            .replace("{table}", &t)
                            .replace("{index}", &index)
                            .replace("{purge_index}", &purge_index)
                            .replace("{expiry_index}", &expiry_index)
                            .replace("{reserve_function}", &reserve_v4_ddl)
                            .replace("{take_function}", &reserve_ddl),
                    )
                })
                .collect(),
            create_versions: format!(
                "CREATE TABLE IF NOT EXISTS {versions_table} (version BIGINT PRIMARY KEY, name TEXT NOT NULL, \
                 applied_at BIGINT NOT NULL)"
            ),
            versions: format!("SELECT version FROM {versions_table} ORDER BY version"),
            versions_exist: format!("SELECT 1 FROM {versions_table} LIMIT 0"),
            versions_shape: format!("SELECT version, name, applied_at FROM {versions_table} LIMIT 0"),
            versions_fit: if d.reserve_function {
                pg_versions_fit(&versions_table)
            } else {
                sqlite_versions_fit(schema.or(d.rows_schema).unwrap_or("main"), &versions_name)
            },
            versions_shown: qualify(&versions_name),
            record_version: format!(
                "INSERT INTO {versions_table} (version, name, applied_at) VALUES ({}, {}, {}) \
                 ON CONFLICT (version) DO NOTHING",
                p(1),
                p(2),
                d.epoch_millis,
            ),
            table_exists: format!("SELECT 1 FROM {t} LIMIT 0"),
            has_taken_over: format!("SELECT taken_over FROM {t} LIMIT 0"),
            has_purge_at: format!("SELECT purge_at FROM {t} LIMIT 0"),
            has_v1_columns: format!(
                "SELECT tenant, scope, key, fingerprint, state, operation_id, lock_token, attempt, \
                 lock_expires_at, recovery_point, response_status, response_headers, response_body, \
                 created_at, expires_at FROM {t} LIMIT 0"
            ),
            has_columns: format!("SELECT {COLUMNS} FROM {t} LIMIT 0"),
            has_unique_key: if d.reserve_function {
                // The key's columns, in any order, and nothing else: what
                // `ON CONFLICT (tenant, scope, key)` infers its index from
                // (unique, not partial, not deferred, no expression).
                // (That no other unique index stands beside it that `ON
                // CONFLICT` refuses or leaves out, a deferred one, a
                // partition's own, is `column_types`'s to say.)
                format!(
                    "SELECT CASE WHEN NOT EXISTS (SELECT 1 FROM pg_catalog.pg_index i \
                     WHERE i.indrelid = to_regclass('{t}') \
                     AND i.indisunique AND i.indimmediate AND i.indisvalid AND i.indpred IS NULL \
                     AND i.indexprs IS NULL AND i.indnkeyatts = 3 \
                     AND (SELECT array_agg(a.attname::text ORDER BY a.attname) FROM pg_catalog.pg_attribute a \
                     WHERE a.attrelid = i.indrelid AND a.attnum = ANY ((i.indkey::int2[])[0:2])) \
                     = ARRAY['key', 'scope', 'tenant']) \
                     THEN 'it has no unique key on (tenant, scope, key), which every reservation''s ON CONFLICT \
                     needs; give it one (its primary key, as migrate() makes it)' END"
                )
            } else {
                format!("EXPLAIN {no_row_upsert}")
            },
            writes: if d.reserve_function {
                format!(
                    "SELECT CASE WHEN pg_catalog.pg_is_in_recovery() THEN 'the database is a standby, read only' \
                     WHEN current_setting('transaction_read_only') = 'on' THEN 'the session is read only \
                     (default_transaction_read_only)' \
                     WHEN NOT (has_any_column_privilege(to_regclass('{t}'), 'INSERT') \
                     AND has_any_column_privilege(to_regclass('{t}'), 'UPDATE') \
                     AND has_table_privilege(to_regclass('{t}'), 'DELETE')) \
                     THEN 'this role may not insert, update and delete its rows' END \
                     || '; it needs a database and role that may write it'"
                )
            } else {
                no_row_upsert.clone()
            },
            checks_read: d.reserve_function,
            column_types: if d.reserve_function {
                column_types(&t)
            } else {
                sqlite_column_types(schema.or(d.rows_schema).unwrap_or("main"), table)
            },
            names_taken: if d.reserve_function {
                [(5, "expires_at_idx"), (5, "purge_at_idx")]
                    .into_iter()
                    .map(|(before, suffix)| (before, pg_name_taken(&t, schema, &derived_name(table, suffix))))
                    .collect()
            } else {
                let schema = schema.or(d.rows_schema).unwrap_or("main");
                [
                    (5, "expires_at_idx", false),
                    (5, "purge_at_idx", false),
                    (7, "times_on_insert", true),
                    (7, "times_on_update", true),
                ]
                .into_iter()
                .map(|(before, suffix, trigger)| {
                    (before, sqlite_name_taken(schema, table, &derived_name(table, suffix), trigger))
                })
                .collect()
            },
            unknown_required: (d.required_columns)(
                schema,
                table,
                &COLUMNS
                    .split(',')
                    .map(|c| format!("'{}'", c.trim()))
                    .collect::<Vec<_>>()
                    .join(", "),
            ),
            take: format!(
                "{insert} ON CONFLICT (tenant, scope, key) DO UPDATE SET {set} \
                 WHERE {takeable} RETURNING {RETURNED}",
                set = take_set(&|col| format!("excluded.{col}")),
            ),
            existing: format!(
                "SELECT fingerprint, state, CAST(response_status AS BIGINT) AS response_status, \
                 response_headers, response_body, {left} AS lock_left_ms \
                 FROM {t} WHERE {id}",
                left = (d.left)("lock_expires_at", now),
            ),
            peek: format!(
                "SELECT fingerprint, state, CAST(response_status AS BIGINT) AS response_status, \
                 response_headers, response_body, {left} AS lock_left_ms, \
                 CASE WHEN {takeable} THEN 1 ELSE 0 END AS takeable \
                 FROM {t} AS cur WHERE cur.tenant = {} AND cur.scope = {} AND cur.key = {}",
                p(1),
                p(2),
                p(3),
                left = (d.left)("cur.lock_expires_at", now),
            ),
            // Cast to the types this build reads, which no change of the
            // columns' types or precision (by hand, or by a later
            // migration) changes: PostgreSQL refuses to run a prepared
            // statement whose result types changed, on every connection
            // that prepared it. A cast to the column's own type is no node
            // at all.
            stored: format!(
                "SELECT fingerprint, state, CAST(response_status AS BIGINT) AS response_status, \
                 response_headers, response_body, CAST(lock_expires_at AS TIMESTAMPTZ) AS lock_expires_at, \
                 CAST(expires_at AS TIMESTAMPTZ) AS expires_at, lock_token FROM {t} WHERE {id}"
            ),
            // The answer is kept a whole TTL from its completion.
            complete: format!(
                "UPDATE {t} SET state = '{completed}', lock_token = NULL, response_status = {}, \
                 response_headers = {}, response_body = {}, created_at = {clock}, \
                 expires_at = {clock} + {ttl} WHERE {owned}",
                p(5),
                p(6),
                p(7),
                clock = d.clock,
                ttl = (d.kept_span)("expires_at", "created_at"),
            ),
            // Released, not deleted: the retry of the same request continues
            // the same operation (same id, so the same derived keys).
            release: format!("UPDATE {t} SET lock_token = NULL, lock_expires_at = {now} WHERE {owned}"),
            reject: format!("DELETE FROM {t} WHERE {owned} AND attempt = 1 AND recovery_point IS NULL"),
            present: format!("SELECT 1 FROM {t} WHERE {id}"),
            checkpoint: format!("UPDATE {t} SET recovery_point = {} WHERE {owned}", p(5)),
            extend: format!(
                "UPDATE {t} SET lock_expires_at = {latest} + {} WHERE {owned}",
                ms(5),
                latest = d.latest
            ),
            encoding: d.encoding,
            schema_problem: d.reserve_function.then(|| pg_schema_problem(&t, schema)),
            has_reserve_function: d.reserve_function.then(|| {
                format!(
                    "SELECT to_regprocedure({function_ref}) \
                     IS NOT NULL"
                )
            }),
            reserve_ddl: d.reserve_function.then(|| reserve_ddl.clone()),
            drop_state_check: d
                .drop_state_check
                .map(|(probe, step)| (probe.replace("{table}", &t), step.replace("{table}", &t))),
            reserve_source: d.reserve_function.then(|| {
                (
                    reserve_body.clone(),
                    format!(
                        "SELECT prosrc FROM pg_proc WHERE oid = \
                         to_regprocedure({function_ref})"
                    ),
                )
            }),
            found_elsewhere: (d.reserve_function && schema.is_none()).then(|| {
                format!(
                    "SELECT n.nspname::text, current_schema()::text FROM pg_namespace n \
                     WHERE n.nspname <> current_schema() AND n.oid IN ( \
                     SELECT relnamespace FROM pg_class WHERE oid IN (to_regclass('{t}'), \
                     to_regclass('{versions_table}')))"
                )
            }),
            reserve_function: function,
            // Candidates come from the `purge_at` index, chosen once per
            // statement (`purge_chosen`): at most the batch. The choice's
            // name cannot be a table's, which is a checked identifier (on
            // SQLite a table of the same name, read inside the choice,
            // would be the choice itself). The conditions stand twice: on
            // the chosen rows and on the row deleted, so a row that changed
            // in between (reserved afresh) is judged again and kept.
            purge: format!(
                "WITH \"idem-chosen\" AS {chosen}(SELECT tenant, scope, key FROM {t} AS cur \
                 WHERE cur.purge_at > {unset} AND cur.purge_at <= {now} AND {expired} \
                 AND NOT {live_lock} LIMIT {}{lock}) \
                 DELETE FROM {t} AS cur WHERE (cur.tenant, cur.scope, cur.key) IN \
                 (SELECT tenant, scope, key FROM \"idem-chosen\") AND {expired} AND NOT {live_lock}",
                p(1),
                chosen = d.purge_chosen,
                lock = d.purge_lock,
                unset = d.purge_unset,
            ),
            purge_set: format!(
                "WITH \"idem-chosen\" AS {chosen}(SELECT tenant, scope, key FROM {t} WHERE purge_at = {unset} \
                 LIMIT {}{lock}) \
                 UPDATE {t} SET purge_at = CASE WHEN expires_at > {unset} AND {copies} THEN expires_at \
                 ELSE {floor} END \
                 WHERE (tenant, scope, key) IN (SELECT tenant, scope, key FROM \"idem-chosen\")",
                p(1),
                chosen = d.purge_chosen,
                lock = d.purge_lock,
                unset = d.purge_unset,
                floor = d.purge_floor,
                copies = d.purge_copies,
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_that_could_inject_sql_are_refused() {
        for bad in ["", "a b", "t\"; drop table x; --", "1abc", "é", &"x".repeat(64)] {
            assert!(check_identifier(bad, 63).is_err(), "{bad}");
        }
        for good in ["idempotency_keys", "_t", "Keys2"] {
            assert!(check_identifier(good, 63).is_ok(), "{good}");
        }
        assert!(check_identifier(&"x".repeat(MAX_TABLE_NAME + 1), MAX_TABLE_NAME).is_err());
        assert_eq!(derived_name("keys", "migrations"), "keys_migrations");
        let long = "x".repeat(63);
        let derived = derived_name(&long, "expires_at_idx");
        assert!(
            derived.starts_with("idem_expires_at_idx_") && derived.len() <= 63,
            "{derived}"
        );
        assert_ne!(derived, derived_name(&"y".repeat(63), "expires_at_idx"));
    }

    #[test]
    #[cfg(all(feature = "postgres", feature = "sqlite"))]
    fn statements_name_the_quoted_table() {
        let m = [Migration {
            version: 1,
            name: "t",
            sql: "CREATE TABLE {table}; {index}",
        }];
        let s = Statements::new(POSTGRES, &m, Some("app"), "keys").unwrap();
        assert_eq!(
            s.migrations[0].1,
            "CREATE TABLE \"app\".\"keys\"; \"keys_expires_at_idx\""
        );
        assert!(s.take.starts_with("INSERT INTO \"app\".\"keys\" AS cur"));
        assert!(!s.take.contains('?'));
        let s = Statements::new(SQLITE, &[], None, "keys").unwrap();
        assert!(s.take.contains("?8") && !s.take.contains('$'));
    }
}
