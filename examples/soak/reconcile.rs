//! Reconciliation: every effect in the ledger against every answer the
//! clients got, and the table of counts the soak prints.

use crate::client::Answer;
use crate::load::{Kind, Log, Op};
use crate::{Args, Db};
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

/// Rows per (tenant, amount) of a ledger table.
async fn count_by_op(db: &Db, table: &str) -> Result<HashMap<(String, i64), i64>, String> {
    let sql = format!("SELECT tenant, amount, COUNT(*) FROM {table} GROUP BY tenant, amount");
    let rows: Vec<(String, i64, i64)> = match db {
        Db::Sqlite(pool, _) => sqlx::query_as(sqlx::AssertSqlSafe(sql)).fetch_all(pool).await,
        Db::Postgres { pool, schema, .. } => {
            let sql = sql.replace(table, &format!("\"{schema}\".{table}"));
            sqlx::query_as(sqlx::AssertSqlSafe(sql)).fetch_all(pool).await
        }
    }
    .map_err(|e| format!("reading {table}: {e}"))?;
    Ok(rows.into_iter().map(|(t, a, n)| ((t, a), n)).collect())
}

/// The example's starting balance of every tenant.
const STARTING_BALANCE: i64 = 1_000_000;

/// Every account's balance.
async fn balances(db: &Db) -> Result<Vec<(String, i64)>, String> {
    let sql = "SELECT tenant, balance FROM accounts";
    match db {
        Db::Sqlite(pool, _) => sqlx::query_as(sql).fetch_all(pool).await,
        Db::Postgres { pool, schema, .. } => {
            sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT tenant, balance FROM \"{schema}\".accounts"
            )))
            .fetch_all(pool)
            .await
        }
    }
    .map_err(|e| format!("reading accounts: {e}"))
}

/// The statuses an operation may see on the way to its final answer.
fn allowed(op: &Op, a: &Answer) -> bool {
    let retry = a.status == 409 || a.status == 503;
    match op.kind {
        Kind::Pays => a.status == 201 || retry,
        Kind::Declined => a.status == 402 || retry,
        Kind::GatewayDown => retry,
        Kind::Panics => (a.status == 500 && a.problem() == "handler-failed") || retry,
    }
}

/// Prints the table and the discrepancies; `true` when there are none.
pub(crate) async fn report(
    args: &Args,
    plan: &[Op],
    logs: &[Log],
    db: &Db,
    faults: &[String],
    load_time: Duration,
    total_time: Duration,
) -> Result<bool, String> {
    let charges = count_by_op(db, "gateway_charges").await?;
    let payments = count_by_op(db, "payments").await?;
    let mut problems: Vec<String> = Vec::new();
    let mut statuses: BTreeMap<String, u64> = BTreeMap::new();
    let (mut requests, mut answered, mut abandoned, mut broken, mut replays, mut settled) =
        (0, 0, 0, 0, 0, 0);
    let (mut started, mut succeeded, mut lost, mut double, mut unequal, mut no_retry_after, mut bad_5xx) =
        (0, 0, 0, 0, 0, 0, 0);
    let (mut reused, mut reuse_refused, mut reuse_inconclusive) = (0, 0, 0);
    let mut expected_effects: HashMap<(String, i64), ()> = HashMap::new();
    for (op, log) in plan.iter().zip(logs) {
        if !log.started {
            continue;
        }
        started += 1;
        let id = format!(
            "{} (tenant {}, amount {}, {:?})",
            op.key, op.tenant, op.amount, op.kind
        );
        abandoned += log.abandoned as u64;
        broken += log.broken.len() as u64;
        settled += log.settled_with as u64;
        for a in log.answers.iter().chain(&log.reused) {
            answered += 1;
            let problem = a.problem();
            let label = if problem.is_empty() {
                a.status.to_string()
            } else {
                format!("{} {problem}", a.status)
            };
            *statuses.entry(label).or_default() += 1;
            if a.header("idempotent-replayed") == Some("true") {
                replays += 1;
            }
            if (a.status == 503 || a.status == 409) && a.header("retry-after").is_none() {
                no_retry_after += 1;
                problems.push(format!("{id}: {} without Retry-After", a.status));
            }
            if args.fault == "none"
                && matches!(
                    problem.as_str(),
                    "idempotency-lease-lost" | "idempotency-store-unavailable"
                )
            {
                problems.push(format!(
                    "{id}: {problem} in a run without faults (a live lock taken over, or the store failing)"
                ));
            }
            if a.status >= 500 && a.status != 503 && !(op.kind == Kind::Panics && a.status == 500) {
                bad_5xx += 1;
                problems.push(format!("{id}: unexpected {}", a.status));
            }
        }
        for a in &log.answers {
            if !allowed(op, a) {
                problems.push(format!("{id}: unexpected answer {} {}", a.status, a.problem()));
            }
        }
        requests += log.answers.len() as u64
            + log.reused.len() as u64
            + log.abandoned as u64
            + log.broken.len() as u64;
        let finals: Vec<&Answer> = log.answers.iter().filter(|a| op.is_final(a)).collect();
        if finals.is_empty() {
            lost += 1;
            problems.push(format!(
                "{id}: no final answer after {} requests",
                log.answers.len()
            ));
        }
        // A stored answer is the same on every retry, byte for byte, and
        // is this operation's own: its amount and recipient.
        if matches!(op.kind, Kind::Pays | Kind::Declined) {
            if let Some(first) = finals.first() {
                let same = |f: &&Answer| {
                    f.body == first.body
                        && f.header("location") == first.header("location")
                        && f.header("content-type") == first.header("content-type")
                };
                if !finals[1..].iter().all(same) {
                    unequal += 1;
                    problems.push(format!("{id}: a retry's answer differs from the first"));
                }
                let body: serde_json::Value = serde_json::from_slice(&first.body).unwrap_or_default();
                let own = match op.kind {
                    Kind::Pays => {
                        body["amount"] == op.amount
                            && body["recipient"] == op.recipient()
                            && body["status"] == "succeeded"
                    }
                    _ => body == serde_json::json!({ "error": "card_declined" }),
                };
                if !own {
                    problems.push(format!("{id}: answered with another operation's answer: {body}"));
                }
            }
            // One execution answers; every other answer is a replay.
            let executed = finals
                .iter()
                .filter(|f| f.header("idempotent-replayed") != Some("true"))
                .count();
            if executed > 1 {
                double += 1;
                problems.push(format!(
                    "{id}: {executed} answers were not replays (executed more than once)"
                ));
            }
            if finals.len() > 1
                && finals
                    .iter()
                    .all(|f| f.header("idempotent-replayed") != Some("true"))
            {
                problems.push(format!(
                    "{id}: retries of a finished operation not marked as replays"
                ));
            }
        }
        let key = (op.tenant.clone(), op.amount);
        let (c, p) = (
            charges.get(&key).copied().unwrap_or(0),
            payments.get(&key).copied().unwrap_or(0),
        );
        if op.kind == Kind::Pays && !finals.is_empty() {
            succeeded += 1;
            expected_effects.insert(key, ());
            if c != 1 || p != 1 {
                if c > 1 {
                    double += 1;
                }
                problems.push(format!("{id}: succeeded with {c} charges and {p} payments"));
            }
        } else if c != 0 || p != 0 {
            if op.kind == Kind::Pays {
                // Charged while no client ever saw it succeed.
                problems.push(format!(
                    "{id}: {c} charges and {p} payments without a success answer"
                ));
            } else {
                problems.push(format!("{id}: {:?} yet {c} charges and {p} payments", op.kind));
            }
        }
        if op.reuse_key && !log.reused.is_empty() {
            reused += 1;
            match log.reused.last() {
                Some(a) if a.status == 422 && a.problem() == "idempotency-key-reused" => reuse_refused += 1,
                Some(a) if a.status == 409 || a.status == 503 => reuse_inconclusive += 1,
                Some(a) => problems.push(format!(
                    "{id}: the key reused with another amount got {}",
                    a.status
                )),
                None => {}
            }
        }
    }
    // Effects that belong to no succeeded operation (another amount charged
    // under a reused key, a decline charged, ...).
    let mut unexplained = 0;
    for (key, n) in charges.iter().chain(payments.iter()) {
        if *n > 0
            && !expected_effects.contains_key(key)
            && !plan.iter().any(|o| (o.tenant.clone(), o.amount) == *key)
        {
            unexplained += 1;
            problems.push(format!(
                "ledger row for tenant {} amount {} belongs to no operation",
                key.0, key.1
            ));
        }
    }
    // Every tenant's balance: the start, less what succeeded (holds of
    // failed payments given back).
    let balances = balances(db).await?;
    let mut spent: HashMap<String, i64> = HashMap::new();
    for (op, log) in plan.iter().zip(logs) {
        if op.kind == Kind::Pays && log.answers.iter().any(|a| op.is_final(a)) {
            *spent.entry(op.tenant.clone()).or_default() += op.amount;
        }
    }
    for (tenant, balance) in &balances {
        let expected = STARTING_BALANCE - spent.get(tenant).copied().unwrap_or(0);
        if *balance != expected {
            problems.push(format!("tenant {tenant}: balance {balance}, expected {expected}"));
        }
    }
    let total_charges: i64 = charges.values().sum();
    let total_payments: i64 = payments.values().sum();
    let verdict = problems.is_empty();

    println!();
    println!("| measure | count |");
    println!("| --- | --- |");
    let row = |k: &str, v: String| println!("| {k} | {v} |");
    row(
        "operations planned / started",
        format!("{} / {started}", plan.len()),
    );
    row(
        "requests (answered, abandoned, broken)",
        format!("{requests} ({answered}, {abandoned}, {broken})"),
    );
    row("requests sent while settling", settled.to_string());
    for (label, n) in &statuses {
        row(&format!("answers {label}"), n.to_string());
    }
    row("replays (idempotent-replayed)", replays.to_string());
    row("operations that succeeded", succeeded.to_string());
    row(
        "charges in the ledger / payments",
        format!("{total_charges} / {total_payments}"),
    );
    row("double charges", double.to_string());
    row("lost answers (no final answer)", lost.to_string());
    row("retries answered differently", unequal.to_string());
    row("503 without Retry-After", no_retry_after.to_string());
    row("unexpected 5xx", bad_5xx.to_string());
    row("unexplained ledger rows", unexplained.to_string());
    row(
        "keys reused with another amount: 422 / inconclusive",
        format!("{reuse_refused} / {reuse_inconclusive} of {reused}"),
    );
    row("faults injected", faults.len().to_string());
    row(
        "load time / total time",
        format!(
            "{:.1} s / {:.1} s",
            load_time.as_secs_f64(),
            total_time.as_secs_f64()
        ),
    );
    row(
        "verdict",
        if verdict {
            "PASS".into()
        } else {
            format!("FAIL ({} discrepancies)", problems.len())
        },
    );
    if let Some(f) = faults.first() {
        println!("\nfirst fault: {f}; last: {}", faults.last().unwrap_or(f));
    }
    println!(
        "\nRELIABILITY row: | {} | {} | {} | {requests} | {total_charges} | {lost} | {double} | {} | {} |",
        args.store,
        args.fault,
        started,
        statuses
            .iter()
            .filter(|(k, _)| k.starts_with("503"))
            .map(|(_, n)| n)
            .sum::<u64>(),
        if verdict { "pass" } else { "FAIL" }
    );
    for p in problems.iter().take(50) {
        println!("DISCREPANCY {p}");
    }
    if problems.len() > 50 {
        println!("... and {} more", problems.len() - 50);
    }
    Ok(verdict)
}
