//! The statements on the database alone (`bench --pgbench`): what idem's
//! reservation and completion cost PostgreSQL, without HTTP and without the
//! server's CPU, against the hand-written flow's statements on the same
//! database. Each cell is `pgbench -M prepared` (16 clients unless `--clients`
//! says otherwise, 2 threads) on a
//! table of 100,000 completed records; the cells run back to back, round
//! after round, and the ratios are between cells of the same round. The
//! last four cells take the reservation apart: the statement that judges
//! the record in SQL (what a record the lookup cannot answer from gets),
//! its lookup alone, and a first request with its writes as one plain
//! upsert (no lookup first, no function), on the table as it is and on the
//! same table without the `purge_at` index.

use std::collections::BTreeMap;
use std::process::Command;

/// Completed records in each table; replays pick one at random.
const RECORDS: u64 = 100_000;

/// One pgbench script, and the cell whose throughput it is compared with.
struct Cell {
    name: &'static str,
    baseline: Option<&'static str>,
    script: String,
}

/// `statement` with its binds replaced: `$n` by `binds[n - 1]`.
fn bound(statement: &str, binds: &[&str]) -> String {
    // From the highest number down, so that `$1` never eats `$10`'s digit.
    let mut s = statement.to_owned();
    for (n, value) in binds.iter().enumerate().rev() {
        s = s.replace(&format!("${}", n + 1), value);
    }
    s
}

/// The cells, on idem's table in `schema` and the same table without its
/// `purge_at` index in `unindexed`.
fn cells(schema: &str, store: &idem::PgStore, unindexed: &idem::PgStore) -> Vec<Cell> {
    let statements = store.request_statements();
    let (lookup, complete) = (statements.lookup, statements.complete);
    let old = "\\set i random(1, 100000)\n";
    let new = "\\set i random(1000000, 1000000000000)\n";
    let body = "'\\x7b226964223a227061795f31227d'::bytea";
    // tenant, scope, key, fingerprint, token, operation id, ttl, lock.
    let reserve_with = |statement: &str, key: &'static str| {
        bound(
            statement,
            &[
                "''",
                "'bench.old'",
                key,
                "'fp'",
                "'tok'",
                "'op'",
                "86400000",
                "30000",
            ],
        )
    };
    let reserve_key = |key: &'static str| reserve_with(lookup, key);
    let completion_of = |complete: &str| {
        bound(
            complete,
            &[
                "''",
                "'bench.old'",
                "('new-' || :i)",
                "'tok'",
                "201",
                "'[[\"content-type\",\"application/json\"]]'",
                body,
            ],
        )
    };
    let completion = completion_of(complete);
    let completion_bounded = completion_of(statements.complete_bounded);
    let bare = unindexed.request_statements();
    vec![
        Cell {
            name: "hand-written replay: one primary-key SELECT",
            baseline: None,
            script: format!(
                "{old}SELECT status, body FROM {schema}.hand_keys \
                 WHERE tenant = 'bench' AND scope = 'bench.old' AND key = ('old-' || :i);\n"
            ),
        },
        Cell {
            name: "idem replay: the lookup, judged in Rust",
            baseline: Some("hand-written replay: one primary-key SELECT"),
            script: format!("{old}{};\n", reserve_key("('old-' || :i)")),
        },
        Cell {
            name: "hand-written first: INSERT, then UPDATE",
            baseline: None,
            script: format!(
                "{new}INSERT INTO {schema}.hand_keys (tenant, scope, key, fingerprint) \
                 VALUES ('bench', 'bench.old', ('new-' || :i), 'fp') ON CONFLICT DO NOTHING RETURNING key;\n\
                 UPDATE {schema}.hand_keys SET status = 201, body = {body} \
                 WHERE tenant = 'bench' AND scope = 'bench.old' AND key = ('new-' || :i);\n"
            ),
        },
        Cell {
            name: "idem first: the lookup, then complete",
            baseline: Some("hand-written first: INSERT, then UPDATE"),
            script: format!("{new}{};\n{completion};\n", reserve_key("('new-' || :i)")),
        },
        // What a first request runs when no other completion of its store
        // is being written: the completion with its wait for a held row
        // bounded on the server.
        Cell {
            name: "idem first: the lookup, then complete, bounded",
            baseline: Some("hand-written first: INSERT, then UPDATE"),
            script: format!("{new}{};\n{completion_bounded};\n", reserve_key("('new-' || :i)")),
        },
        // Where the rest goes: the reservation's parts on their own.
        Cell {
            name: "idem replay, judged in SQL: the reserving statement",
            baseline: Some("hand-written replay: one primary-key SELECT"),
            script: format!("{old}{};\n", reserve_with(statements.reserve, "('old-' || :i)")),
        },
        Cell {
            name: "idem replay, judged in SQL: the lookup alone",
            baseline: Some("hand-written replay: one primary-key SELECT"),
            script: format!(
                "{old}{};\n",
                bound(statements.peek, &["''", "'bench.old'", "('old-' || :i)", "'fp'"])
            ),
        },
        Cell {
            name: "idem first, part: one upsert, no lookup, no function",
            baseline: Some("hand-written first: INSERT, then UPDATE"),
            script: format!(
                "{new}{};\n{completion};\n",
                reserve_with(statements.upsert, "('new-' || :i)")
            ),
        },
        Cell {
            name: "idem first, part: the same, no purge_at index",
            baseline: Some("hand-written first: INSERT, then UPDATE"),
            script: format!(
                "{new}{};\n{};\n",
                reserve_with(bare.upsert, "('new-' || :i)"),
                completion_of(bare.complete)
            ),
        },
    ]
}

/// One pgbench run of `script`: its throughput in transactions per second.
fn run(url: &str, script: &std::path::Path, seconds: u32, clients: usize) -> f64 {
    let out = Command::new("pgbench")
        .args(["-n", "-M", "prepared", "-j"])
        .arg(clients.min(2).to_string())
        .arg("-c")
        .arg(clients.to_string())
        .arg("-T")
        .arg(seconds.to_string())
        .arg("-f")
        .arg(script)
        .arg(url)
        .output()
        .expect("pgbench runs (Debian: apt-get install postgresql-client)");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "pgbench failed: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text.lines()
        .find_map(|l| l.strip_prefix("tps = "))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|tps| tps.parse().ok())
        .unwrap_or_else(|| panic!("no tps in pgbench's output: {text}"))
}

pub(crate) async fn pgbench(url: &str, rounds: usize, seconds: u32, clients: usize) {
    let pool = sqlx::PgPool::connect(url).await.expect("DATABASE_URL connects");
    let schema = format!("idem_pgbench_{}", std::process::id());
    let store = crate::pg_tables(&pool, &schema).await;
    crate::prefill(&pool, &schema, RECORDS).await;
    // The same table without the janitor's index, for the cell that says
    // what the index costs.
    let unindexed_schema = format!("{schema}_unindexed");
    let unindexed = crate::pg_tables(&pool, &unindexed_schema).await;
    let index: String = sqlx::query_scalar(
        "SELECT indexname::text FROM pg_indexes WHERE schemaname = $1 AND indexdef LIKE '%(purge_at)%'",
    )
    .bind(&unindexed_schema)
    .fetch_one(&pool)
    .await
    .expect("the purge_at index");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP INDEX {unindexed_schema}.\"{index}\""
    )))
    .execute(&pool)
    .await
    .expect("drop the purge_at index");
    crate::prefill(&pool, &unindexed_schema, RECORDS).await;
    let dir = tempfile::tempdir().expect("a temporary directory");
    let cells = cells(&schema, &store, &unindexed);
    println!(
        "# pgbench -M prepared, {clients} client(s), {seconds} s per cell, {rounds} round(s), {RECORDS} records per table"
    );
    let mut tps: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut ratios: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for _ in 0..rounds {
        let mut this_round = BTreeMap::new();
        for (i, cell) in cells.iter().enumerate() {
            let path = dir.path().join(format!("{i}.sql"));
            std::fs::write(&path, &cell.script).expect("write the script");
            let t = run(url, &path, seconds, clients);
            this_round.insert(cell.name, t);
            tps.entry(cell.name).or_default().push(t);
        }
        for cell in &cells {
            if let Some(base) = cell.baseline {
                ratios
                    .entry(cell.name)
                    .or_default()
                    .push(this_round[cell.name] / this_round[base]);
            }
        }
    }
    print_table(cells.iter().map(|c| c.name), &tps, &ratios, ("tps", "ratio"), 0);
    for schema in [&schema, &unindexed_schema] {
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
            .execute(&pool)
            .await
            .expect("drop schema");
    }
}

/// One `--pgexec` cell: statements run in one PL/pgSQL loop, with the
/// binds as PL/pgSQL variables (so, as with sqlx, the plans see parameters,
/// not constants), and the key each iteration uses.
struct ExecCell {
    name: &'static str,
    baseline: Option<&'static str>,
    /// An expression of the loop's counter `i`, the round `r` and the cell's
    /// number `c`.
    key: &'static str,
    statements: Vec<String>,
}

/// The variables that stand for the binds of idem's statements, in bind
/// order: tenant, scope, key, fingerprint, token, operation id, ttl ms,
/// lock ms (the reservation); tenant, scope, key, token, status, headers,
/// body (the completion).
const RESERVE_VARS: [&str; 8] = ["v_t", "v_s", "v_k", "v_fp", "v_tok", "v_op", "v_ttl", "v_lock"];
const COMPLETE_VARS: [&str; 7] = ["v_t", "v_s", "v_k", "v_tok", "v_status", "v_headers", "v_body"];

fn exec_cells(schema: &str, store: &idem::PgStore) -> Vec<ExecCell> {
    let s = store.request_statements();
    let old = "'old-' || (1 + (i * 7919) % 100000)";
    // Fresh in every cell and round.
    let new = "'exec-' || r || '-' || c || '-' || i";
    let hand = |sql: &str| sql.replace("{schema}", schema);
    let lookup = bound(s.lookup, &RESERVE_VARS);
    let reserve = bound(s.reserve, &RESERVE_VARS);
    let complete = bound(s.complete, &COMPLETE_VARS);
    // The call is the last branch before `taken`: the condition before it
    // holds a `CASE` of its own (the bound on its lock waits).
    let function = reserve[..reserve
        .find(" END AS taken")
        .expect("the reserving statement's CASE")]
        .rsplit_once(" THEN ")
        .expect("the reservation function's call")
        .1
        .to_owned();
    vec![
        ExecCell {
            name: "hand-written replay: one primary-key SELECT",
            baseline: None,
            key: old,
            statements: vec![hand(
                "SELECT status, body FROM {schema}.hand_keys WHERE tenant = 'bench' AND scope = v_s AND key = v_k",
            )],
        },
        ExecCell {
            name: "idem replay: the lookup, judged in Rust",
            baseline: Some("hand-written replay: one primary-key SELECT"),
            key: old,
            statements: vec![lookup.clone()],
        },
        ExecCell {
            name: "idem replay, judged in SQL: the reserving statement",
            baseline: Some("hand-written replay: one primary-key SELECT"),
            key: old,
            statements: vec![reserve.clone()],
        },
        ExecCell {
            name: "idem replay, judged in SQL: the lookup alone",
            baseline: Some("hand-written replay: one primary-key SELECT"),
            key: old,
            statements: vec![bound(s.peek, &RESERVE_VARS[..4])],
        },
        ExecCell {
            name: "idem replay, judged in SQL: no function in the CASE",
            baseline: Some("hand-written replay: one primary-key SELECT"),
            key: old,
            statements: vec![reserve.replace(&function, "NULL::text[]")],
        },
        ExecCell {
            name: "idem replay, judged in SQL: no expression in the lookup",
            baseline: Some("hand-written replay: one primary-key SELECT"),
            key: old,
            statements: vec![without_expressions(&reserve)],
        },
        ExecCell {
            name: "idem replay, judged in SQL: neither",
            baseline: Some("hand-written replay: one primary-key SELECT"),
            key: old,
            statements: vec![without_expressions(&reserve).replace(&function, "NULL::text[]")],
        },
        ExecCell {
            name: "idem replay, part: its five columns, no join",
            baseline: Some("hand-written replay: one primary-key SELECT"),
            key: old,
            statements: vec![format!(
                "SELECT fingerprint, state, response_status, response_headers, response_body \
                 FROM {schema}.idempotency_keys WHERE tenant = v_t AND scope = v_s AND key = v_k"
            )],
        },
        ExecCell {
            name: "idem replay, other form: UNION ALL, LIMIT 1",
            baseline: Some("hand-written replay: one primary-key SELECT"),
            key: old,
            statements: vec![union_form(s.peek, &function)],
        },
        ExecCell {
            name: "hand-written first: INSERT, then UPDATE",
            baseline: None,
            key: new,
            statements: vec![
                hand(
                    "INSERT INTO {schema}.hand_keys (tenant, scope, key, fingerprint) \
                     VALUES ('bench', v_s, v_k, v_fp) ON CONFLICT DO NOTHING RETURNING key",
                ),
                hand(
                    "UPDATE {schema}.hand_keys SET status = v_status, body = v_body \
                     WHERE tenant = 'bench' AND scope = v_s AND key = v_k",
                ),
            ],
        },
        ExecCell {
            name: "idem first: the lookup, then complete",
            baseline: Some("hand-written first: INSERT, then UPDATE"),
            key: new,
            statements: vec![lookup.clone(), complete.clone()],
        },
        ExecCell {
            name: "idem first: the lookup, then complete, bounded",
            baseline: Some("hand-written first: INSERT, then UPDATE"),
            key: new,
            statements: vec![lookup.clone(), bound(s.complete_bounded, &COMPLETE_VARS)],
        },
        ExecCell {
            name: "idem first, without the lock-wait bounds",
            baseline: Some("hand-written first: INSERT, then UPDATE"),
            key: new,
            statements: vec![unbounded(&lookup), unbounded(&complete)],
        },
        ExecCell {
            name: "idem first, part: the lookup",
            baseline: Some("hand-written first: INSERT, then UPDATE"),
            key: new,
            statements: vec![lookup],
        },
        ExecCell {
            name: "idem first, judged in SQL: reserve, then complete",
            baseline: Some("hand-written first: INSERT, then UPDATE"),
            key: new,
            statements: vec![reserve, complete.clone()],
        },
        ExecCell {
            name: "idem first, other form: UNION ALL, LIMIT 1",
            baseline: Some("hand-written first: INSERT, then UPDATE"),
            key: new,
            statements: vec![union_form(s.peek, &function), complete.clone()],
        },
        ExecCell {
            name: "idem first, part: the reservation function alone",
            baseline: Some("hand-written first: INSERT, then UPDATE"),
            key: new,
            statements: vec![format!("SELECT {function}")],
        },
    ]
}

/// The reservation in another form, for comparison: the lookup keeping
/// only a record to answer from, then, in a second branch that PostgreSQL
/// starts only when the first returned nothing (an order SQL does not
/// promise, where the `CASE` rests on one PostgreSQL documents), the
/// reservation function, whose row is kept only when it took the key.
fn union_form(peek: &str, function: &str) -> String {
    let peek = bound(peek, &RESERVE_VARS[..4]);
    format!(
        "SELECT * FROM ((SELECT p.*, NULL::text[] AS taken FROM ({peek}) AS p WHERE p.takeable = 0) \
         UNION ALL (SELECT NULL, NULL, NULL::bigint, NULL, NULL::bytea, NULL::bigint, NULL::int, w.taken \
         FROM (SELECT {function} AS taken) AS w WHERE w.taken IS NOT NULL)) AS u LIMIT 1"
    )
}

/// The reserving statement with constants for the lookup's expressions
/// (the lock left, and whether the record may be taken), for the cell
/// that says what they cost.
fn without_expressions(reserve: &str) -> String {
    let cut = |sql: &str, from: &str, to: &str, with: &str, after: usize| {
        let a = after
            + sql[after..]
                .find(from)
                .unwrap_or_else(|| panic!("{from} in the statement"));
        let b = a + sql[a..]
            .find(to)
            .unwrap_or_else(|| panic!("{to} in the statement"));
        format!("{}{with}{}", &sql[..a], &sql[b..])
    };
    // Within the lookup: the lock left is the expression between the
    // body's column and its name, whatever form it takes.
    let join = reserve.find("LEFT JOIN (").expect("the lookup's join");
    let sql = cut(
        reserve,
        "response_body, ",
        " AS lock_left_ms",
        "response_body, 0::bigint",
        join,
    );
    cut(&sql, "CASE WHEN", " AS takeable", "0", join)
}

/// The loop of `cell`, `n` iterations, as one `DO` block. A statement
/// that returns rows is run by `PERFORM`, an `INSERT ... RETURNING` into
/// a variable, anything else as it is.
fn exec_block(cell: &ExecCell, number: usize, round: usize, n: usize) -> String {
    let body: String = cell
        .statements
        .iter()
        .map(|sql| {
            if sql.starts_with("SELECT") {
                format!("PERFORM * FROM ({sql}) AS s;\n")
            } else if sql.contains(" RETURNING ") {
                format!("{sql} INTO v_out;\n")
            } else {
                format!("{sql};\n")
            }
        })
        .collect();
    format!(
        "DO $exec$ DECLARE r int := {round}; c int := {number}; v_t text := ''; v_s text := 'bench.old'; v_k text; \
         v_fp text := 'fp'; v_tok text := 'tok'; v_op text := 'op'; v_ttl bigint := 86400000; \
         v_lock bigint := 30000; v_status int := 201; \
         v_headers text := '[[\"content-type\",\"application/json\"]]'; \
         v_body bytea := '\\x7b226964223a227061795f31227d'; v_out text; \
         BEGIN FOR i IN 1..{n} LOOP v_k := {key};\n{body}END LOOP; END $exec$",
        key = cell.key,
    )
}

/// `bench --pgexec`: what each statement costs PostgreSQL's executor, in
/// one backend, without the network, the protocol or a commit (each cell
/// is one `DO` block of `n` iterations, in one transaction): the
/// microseconds per iteration, the median of `rounds` rounds run back to
/// back. Far steadier than throughput on a shared machine, it says where a
/// statement's cost goes; it does not count the commit, the WAL written,
/// or the round trips.
pub(crate) async fn pgexec(url: &str, rounds: usize, n: usize) {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(url)
        .await
        .expect("DATABASE_URL connects");
    let schema = format!("idem_pgexec_{}", std::process::id());
    let store = crate::pg_tables(&pool, &schema).await;
    crate::prefill(&pool, &schema, RECORDS).await;
    let cells = exec_cells(&schema, &store);
    println!(
        "# PostgreSQL's executor alone: one backend, {n} iterations per cell in one DO block, \
         {rounds} round(s), {RECORDS} records per table"
    );
    let mut us: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut ratios: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut cpu_us: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut cpu_ratios: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut conn = pool.acquire().await.expect("a connection");
    // The backend's own CPU time, when it runs on this machine: steadier
    // than the wall clock on a shared one (no time spent waiting for a CPU).
    let backend: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *conn)
        .await
        .expect("the backend's pid");
    let backend_cpu = || crate::cpu_ns(&format!("/proc/{backend}/schedstat"));
    for round in 0..rounds.max(1) {
        let mut this_round = BTreeMap::new();
        let mut this_round_cpu = BTreeMap::new();
        for (number, cell) in cells.iter().enumerate() {
            let block = exec_block(cell, number, round, n);
            let started = std::time::Instant::now();
            let cpu_before = backend_cpu();
            sqlx::raw_sql(sqlx::AssertSqlSafe(block))
                .execute(&mut *conn)
                .await
                .unwrap_or_else(|e| panic!("{}: {e}", cell.name));
            let per = started.elapsed().as_secs_f64() * 1e6 / n as f64;
            this_round.insert(cell.name, per);
            us.entry(cell.name).or_default().push(per);
            if let (Some(before), Some(after)) = (cpu_before, backend_cpu()) {
                let per = after.saturating_sub(before) as f64 / 1e3 / n as f64;
                this_round_cpu.insert(cell.name, per);
                cpu_us.entry(cell.name).or_default().push(per);
            }
        }
        for cell in &cells {
            if let Some(base) = cell.baseline {
                // A cost: the baseline's over the cell's, so that, as with
                // throughput, below 1 means idem costs more.
                ratios
                    .entry(cell.name)
                    .or_default()
                    .push(this_round[base] / this_round[cell.name]);
                if let (Some(b), Some(c)) = (this_round_cpu.get(base), this_round_cpu.get(cell.name)) {
                    cpu_ratios.entry(cell.name).or_default().push(b / c);
                }
            }
        }
    }
    drop(conn);
    print_table(
        cells.iter().map(|c| c.name),
        &us,
        &ratios,
        ("us/iter", "hand / idem"),
        2,
    );
    if cpu_us.len() == cells.len() {
        println!("# the same, in the backend's CPU time (/proc/<pid>/schedstat)");
        print_table(
            cells.iter().map(|c| c.name),
            &cpu_us,
            &cpu_ratios,
            ("cpu us", "hand / idem"),
            2,
        );
    } else {
        println!("# the backend's CPU time is not readable here (PostgreSQL on another machine?)");
    }
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&pool)
        .await
        .expect("drop schema");
}

/// Prints one line per cell: the median of its figures and their range
/// (with `decimals`), and the median of its ratios to its baseline.
fn print_table<'a>(
    cells: impl Iterator<Item = &'a str>,
    figures: &BTreeMap<&str, Vec<f64>>,
    ratios: &BTreeMap<&str, Vec<f64>>,
    (unit, ratio_name): (&str, &str),
    decimals: usize,
) {
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!("{:<54} {unit:>9} {:>17} {ratio_name:>13}", "cell", "range");
    for name in cells {
        let t = &figures[name];
        let (lo, hi) = t
            .iter()
            .fold((f64::MAX, 0f64), |(lo, hi), x| (lo.min(*x), hi.max(*x)));
        let ratio = ratios
            .get(name)
            .map_or_else(|| "-".to_owned(), |r| format!("{:.2}", median(r)));
        println!(
            "{name:<54} {:>9.decimals$} {:>17} {ratio:>13}",
            median(t),
            format!("{lo:.decimals$}-{hi:.decimals$}"),
        );
    }
}

/// `sql` without its lock-wait bounds (each `set_config('lock_timeout', ..)`
/// condition made `TRUE`), for the cell that says what they cost.
fn unbounded(sql: &str) -> String {
    let mut out = sql.to_owned();
    while let Some(a) = out.find("set_config('lock_timeout'") {
        let end = ", true) IS NOT NULL";
        let b = a + out[a..].find(end).expect("the bound's end") + end.len();
        out.replace_range(a..b, "TRUE");
    }
    out
}
