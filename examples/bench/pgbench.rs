//! The statements on the database alone (`bench --pgbench`): what idem's
//! reservation and completion cost PostgreSQL, without HTTP and without the
//! server's CPU, against the hand-written flow's statements on the same
//! database. Each cell is `pgbench -M prepared` (16 clients, 2 threads) on a
//! table of 100,000 completed records; the cells run back to back, round
//! after round, and the ratios are between cells of the same round.

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

fn cells(schema: &str, store: &idem::PgStore) -> Vec<Cell> {
    let (reserve, complete) = store.request_statements();
    let old = "\\set i random(1, 100000)\n";
    let new = "\\set i random(1000000, 1000000000000)\n";
    let body = "'\\x7b226964223a227061795f31227d'::bytea";
    // tenant, scope, key, fingerprint, token, operation id, ttl, lock.
    let reserve_key = |key: &'static str| {
        bound(
            reserve,
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
    let completion = bound(
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
    );
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
            name: "idem replay: the reserving statement",
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
            name: "idem first: reserve, then complete",
            baseline: Some("hand-written first: INSERT, then UPDATE"),
            script: format!("{new}{};\n{completion};\n", reserve_key("('new-' || :i)")),
        },
    ]
}

/// One pgbench run of `script`: its throughput in transactions per second.
fn run(url: &str, script: &std::path::Path, seconds: u32) -> f64 {
    let out = Command::new("pgbench")
        .args(["-n", "-M", "prepared", "-c", "16", "-j", "2", "-T"])
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

pub(crate) async fn pgbench(url: &str, rounds: usize, seconds: u32) {
    let pool = sqlx::PgPool::connect(url).await.expect("DATABASE_URL connects");
    let schema = format!("idem_pgbench_{}", std::process::id());
    let store = crate::pg_tables(&pool, &schema).await;
    crate::prefill(&pool, &schema, RECORDS).await;
    let dir = tempfile::tempdir().expect("a temporary directory");
    let cells = cells(&schema, &store);
    println!(
        "# pgbench -M prepared, 16 clients, {seconds} s per cell, {rounds} round(s), {RECORDS} records per table"
    );
    let mut tps: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut ratios: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for _ in 0..rounds {
        let mut this_round = BTreeMap::new();
        for (i, cell) in cells.iter().enumerate() {
            let path = dir.path().join(format!("{i}.sql"));
            std::fs::write(&path, &cell.script).expect("write the script");
            let t = run(url, &path, seconds);
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
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!("{:<46} {:>9} {:>17} {:>8}", "cell", "tps", "range", "ratio");
    for cell in &cells {
        let t = &tps[cell.name];
        let (lo, hi) = t
            .iter()
            .fold((f64::MAX, 0f64), |(lo, hi), x| (lo.min(*x), hi.max(*x)));
        let ratio = ratios
            .get(cell.name)
            .map_or_else(|| "-".to_owned(), |r| format!("{:.2}", median(r)));
        println!(
            "{:<46} {:>9.0} {:>17} {:>8}",
            cell.name,
            median(t),
            format!("{lo:.0}-{hi:.0}"),
            ratio
        );
    }
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&pool)
        .await
        .expect("drop schema");
}
