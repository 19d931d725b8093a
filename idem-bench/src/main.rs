//! The benchmark harness: in one run, the same handler bare, behind a
//! hand-written sqlx flow, and behind `#[idempotent]` on PostgreSQL, SQLite
//! and memory (first requests, replays and 409s), at 1, 16 and 64 clients
//! over loopback HTTP/1.1. It prints throughput, p50, p99 and max latency,
//! the ratios against the bare handler and the hand-written flow of the same
//! run, and the peak RSS of each cell. See BENCHMARKS.md.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1/test \
//!     cargo run --release -p idem-bench -- --seconds 2 --repeat 3 --csv bench.csv
//! cargo run --release -p idem-bench -- --growth 1200000   # the memory store growing
//! cargo run --release -p idem-bench -- --pgbench --repeat 3 # the statements alone (pgbench)
//! ```
//!
//! Options: `--seconds S` per cell (default 2), `--max N` requests per cell
//! (default 200000), `--repeat R` rounds of all cells run back to back
//! (default 1; medians and ranges are reported), `--clients 1,16,64`,
//! `--only bare,hand,postgres,sqlite,memory` (groups, or whole variant
//! names such as `"idem postgres replay"`), `--csv FILE`, `--prefill N`
//! (records put in the PostgreSQL tables first), `--pool N` (PostgreSQL
//! connections, shared by idem and the hand-written flow; default 16),
//! `--server-threads N` (default 1), `--no-pin` (by default the server runs
//! on CPU 0 and the client on CPU 1, when the machine has two),
//! `--spin-client` (the client's thread polls its sockets and never sleeps:
//! on loopback a server's write pays for waking a sleeping client, a cost
//! that grows as the server gets slower and that a server whose clients
//! are on other machines never pays).
//! `--pgbench` runs idem's statements and the hand-written flow's on the
//! database alone instead (`pgbench`, `--seconds` per cell, `--repeat`
//! rounds). `--cpu N` measures the CPU of one request in process, without
//! the network: the bare handler, idem's first request and replay on the
//! memory store, and (with `DATABASE_URL`) the server's CPU per PostgreSQL
//! replay and first request, 5 rounds of `N` requests each (one at a time, or `--inflight K`
//! under way at once, as 16 clients' requests are on the server's thread);
//! `--only` picks its cells too, so that a profiler (`perf`, `valgrind
//! --tool=callgrind`) sees one path.
//! `--pgexec` runs the same statements in one backend, in a PL/pgSQL
//! loop (5,000 iterations per cell; 5 rounds, or more with `--repeat`): what each costs PostgreSQL's executor alone, without the
//! network, a commit or the noise of concurrent clients.
//! Without `DATABASE_URL` the PostgreSQL and hand-written cells are skipped.

mod client;
mod growth;
mod pgbench;
mod routes;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

/// Completed keys a replay cell cycles over, per store.
const REPLAY_KEYS: usize = 2000;
/// Keys held in progress a 409 cell cycles over, per store.
const HELD_KEYS: usize = 64;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Path {
    Bare,
    First,
    Replay,
    Conflict,
}

#[derive(Clone, Debug)]
struct Variant {
    name: String,
    /// `bare`, `hand`, `postgres`, `sqlite` or `memory`.
    group: &'static str,
    path: Path,
    route: &'static str,
}

#[derive(Clone)]
struct Args {
    seconds: f64,
    max: usize,
    repeat: usize,
    clients: Vec<usize>,
    /// Whether `--clients` was given (`--pgbench` runs 16 otherwise).
    clients_given: bool,
    only: Option<Vec<String>>,
    csv: Option<std::path::PathBuf>,
    prefill: u64,
    pool: u32,
    server_threads: usize,
    pin: bool,
    /// Whether the client's thread polls its sockets without ever sleeping.
    spin: bool,
    growth: Option<usize>,
    cpu: Option<usize>,
    inflight: usize,
    pgbench: bool,
    pgexec: bool,
}

fn args() -> Args {
    let mut a = Args {
        seconds: 2.0,
        max: 200_000,
        repeat: 1,
        clients: vec![1, 16, 64],
        clients_given: false,
        only: None,
        csv: None,
        prefill: 0,
        pool: 16,
        server_threads: 1,
        pin: true,
        spin: false,
        growth: std::env::var("IDEM_BENCH_GROWTH")
            .ok()
            .and_then(|v| v.parse().ok()),
        cpu: None,
        inflight: 1,
        pgbench: false,
        pgexec: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--seconds" => a.seconds = value().parse().expect("--seconds: a number"),
            "--max" => a.max = value().parse().expect("--max: a count"),
            "--repeat" => a.repeat = value().parse().expect("--repeat: a count"),
            "--clients" => {
                a.clients_given = true;
                a.clients = value()
                    .split(',')
                    .map(|c| c.parse().expect("--clients: counts"))
                    .collect()
            }
            "--only" => a.only = Some(value().split(',').map(str::to_owned).collect()),
            "--csv" => a.csv = Some(value().into()),
            "--prefill" => a.prefill = value().parse().expect("--prefill: a count"),
            "--pool" => a.pool = value().parse().expect("--pool: a count"),
            "--server-threads" => a.server_threads = value().parse().expect("--server-threads: a count"),
            "--no-pin" => a.pin = false,
            "--spin-client" => a.spin = true,
            "--growth" => a.growth = Some(value().parse().expect("--growth: a count")),
            "--cpu" => a.cpu = Some(value().parse().expect("--cpu: a count")),
            "--inflight" => a.inflight = value().parse().expect("--inflight: a count"),
            "--pgbench" => a.pgbench = true,
            "--pgexec" => a.pgexec = true,
            "--help" | "-h" => {
                println!(
                    "bench [--seconds S] [--max N] [--repeat R] [--clients 1,16,64] \
                     [--only bare,hand,postgres,sqlite,memory] [--csv FILE] [--prefill N] [--pool N] \
                     [--server-threads N] [--no-pin] [--spin-client] [--growth N] [--cpu N [--inflight K]] [--pgbench] [--pgexec]\n\
                     (DATABASE_URL for the PostgreSQL cells; see BENCHMARKS.md)"
                );
                std::process::exit(0);
            }
            other => panic!("unknown option {other}; see the header of idem-bench/src/main.rs"),
        }
    }
    a
}

fn variants(postgres: bool, only: Option<&[String]>) -> Vec<Variant> {
    let v = |group: &'static str, path: Path, name: &str, route: &'static str| Variant {
        name: name.to_owned(),
        group,
        path,
        route,
    };
    let mut all = vec![v("bare", Path::Bare, "bare handler", "/bare")];
    if postgres {
        all.push(v("hand", Path::First, "hand-written first", "/hand/first"));
        all.push(v("hand", Path::Replay, "hand-written replay", "/hand/replay"));
    }
    for (group, prefix, pay, hold) in [
        ("postgres", "idem postgres", "/postgres/pay", "/postgres/hold"),
        ("sqlite", "idem sqlite", "/sqlite/pay", "/sqlite/hold"),
        ("memory", "idem memory", "/memory/pay", "/memory/hold"),
    ] {
        if group == "postgres" && !postgres {
            continue;
        }
        all.push(v(group, Path::First, &format!("{prefix} first"), pay));
        all.push(v(group, Path::Replay, &format!("{prefix} replay"), pay));
        if group == "postgres" {
            // The same replays with no answer kept in memory: each one the
            // lookup's round trip.
            all.push(v(
                group,
                Path::Replay,
                "idem postgres db replay",
                "/postgres-db/pay",
            ));
        }
        all.push(v(group, Path::Conflict, &format!("{prefix} 409"), hold));
        if group == "postgres" {
            // The same 409s with nothing known in memory: each one the
            // lookup's round trip (the keys are held by the other route's
            // store, on the same table: a 409 of another process).
            all.push(v(
                group,
                Path::Conflict,
                "idem postgres db 409",
                "/postgres-db/hold",
            ));
        }
    }
    all.retain(|v| chosen(only, v.group, &v.name));
    all
}

/// Whether `--only` names the variant, or its group.
fn chosen(only: Option<&[String]>, group: &str, name: &str) -> bool {
    only.is_none_or(|o| o.iter().any(|g| g == group || g == name))
}

/// Pins the calling thread to `cpu` (with `taskset`, which util-linux
/// provides; without it the thread stays unpinned).
fn pin_to(cpu: usize) {
    let Some(tid) = std::fs::read_link("/proc/thread-self")
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
    else {
        return;
    };
    let _ = std::process::Command::new("taskset")
        .args(["-p", "-c", &cpu.to_string(), &tid])
        .stdout(std::process::Stdio::null())
        .status();
}

/// Resets the process's peak RSS (Linux: `clear_refs` 5).
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// The process's peak RSS in kB since the last reset.
fn peak_rss_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

struct Setup {
    addr: SocketAddr,
    gate: routes::Gate,
    pg: Option<(sqlx::PgPool, String)>,
    /// The database's round trip and one-row commit, measured before the cells.
    pg_latency: Option<PgLatency>,
    _dir: tempfile::TempDir,
}

async fn setup(a: &Args) -> Setup {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let sqlite = idem::SqliteStore::open(dir.path().join("bench.db"))
        .await
        .expect("open SQLite");
    sqlite.migrate().await.expect("migrate SQLite");
    let url = std::env::var("DATABASE_URL")
        .ok()
        .filter(|u| u.starts_with("postgres"));
    let mut pg = None;
    let mut pg_latency = None;
    let postgres = match url {
        Some(url) => {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(a.pool)
                .connect(&url)
                .await
                .expect("DATABASE_URL connects");
            let schema = format!("idem_bench_{}", std::process::id());
            let store = pg_tables(&pool, &schema).await;
            if a.prefill > 0 {
                prefill(&pool, &schema, a.prefill).await;
            }
            let hand = routes::Hand::new(pool.clone(), &schema);
            pg_latency = Some(pg_latency_of(&pool, &schema).await);
            pg = Some((pool, schema));
            Some((store, hand))
        }
        None => None,
    };
    let gate = routes::Gate::default();
    let app = routes::app(
        routes::Stores {
            postgres,
            sqlite,
            memory: idem::MemoryStore::new(),
        },
        gate.clone(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a port");
    let addr = listener.local_addr().expect("an address");
    tokio::spawn(async move { axum::serve(listener, app).await });
    Setup {
        addr,
        gate,
        pg,
        pg_latency,
        _dir: dir,
    }
}

/// What one statement costs on this machine's database before any of its
/// work: a round trip (`SELECT 1`) and a one-row commit (an `INSERT` on its
/// own, so one flush of the write-ahead log), in microseconds.
#[derive(Clone, Copy, Debug)]
struct PgLatency {
    round_trip: (f64, f64),
    commit: (f64, f64),
}

/// Times `COMMIT_PROBES` of each, one at a time on one connection: their
/// medians and 90th percentiles. The grouped statements save commits and
/// round trips, so how much they gain depends on these: a machine whose
/// disk flushes in tens of microseconds gains little from them.
async fn pg_latency_of(pool: &sqlx::PgPool, schema: &str) -> PgLatency {
    const COMMIT_PROBES: usize = 300;
    let mut conn = pool.acquire().await.expect("a connection");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {schema}.commit_probe (n INTEGER NOT NULL)"
    )))
    .execute(&mut *conn)
    .await
    .expect("the commit probe's table");
    let insert = format!("INSERT INTO {schema}.commit_probe (n) VALUES ($1)");
    let (mut round_trips, mut commits) = (Vec::new(), Vec::new());
    for i in 0..COMMIT_PROBES {
        let started = std::time::Instant::now();
        sqlx::query("SELECT 1")
            .execute(&mut *conn)
            .await
            .expect("SELECT 1");
        round_trips.push(started.elapsed().as_secs_f64() * 1e6);
        let started = std::time::Instant::now();
        sqlx::query(sqlx::AssertSqlSafe(insert.as_str()))
            .bind(i as i32)
            .execute(&mut *conn)
            .await
            .expect("a one-row commit");
        commits.push(started.elapsed().as_secs_f64() * 1e6);
    }
    let spread = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        (v[v.len() / 2], v[v.len() * 9 / 10])
    };
    PgLatency {
        round_trip: spread(round_trips),
        commit: spread(commits),
    }
}

/// A new schema `schema` with idem's table (migrated) and the hand-written
/// flow's; the store on it.
async fn pg_tables(pool: &sqlx::PgPool, schema: &str) -> idem::PgStore {
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(pool)
        .await
        .expect("create schema");
    let store = idem::PgStore::new(pool.clone())
        .with_table(Some(schema), "idempotency_keys")
        .expect("names");
    store.migrate().await.expect("migrate PostgreSQL");
    sqlx::query(sqlx::AssertSqlSafe(
        routes::HAND_TABLE.replace("{schema}", schema),
    ))
    .execute(pool)
    .await
    .expect("the hand-written table");
    store
}

/// Puts `n` completed records in idem's table and `n` answered keys in the
/// hand-written one, under another scope, as a long-running service has.
async fn prefill(pool: &sqlx::PgPool, schema: &str, n: u64) {
    let started = std::time::Instant::now();
    let n = i64::try_from(n).expect("a count");
    let mut from = 1i64;
    while from <= n {
        let to = (from + 999_999).min(n);
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {schema}.idempotency_keys (tenant, scope, key, fingerprint, state, operation_id, \
             attempt, lock_expires_at, response_status, response_headers, response_body, created_at, expires_at, purge_at) \
             SELECT '', 'bench.old', 'old-' || i, md5(i::text), 'completed', md5(i::text), 1, now(), 201, \
             '[[\"content-type\",\"application/json\"]]', convert_to(repeat('x', 90), 'UTF8'), now(), \
             now() + interval '1 day', now() + interval '1 day' FROM generate_series($1::bigint, $2::bigint) AS i"
        )))
        .bind(from)
        .bind(to)
        .execute(pool)
        .await
        .expect("prefill idem's table");
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {schema}.hand_keys (tenant, scope, key, fingerprint, status, body) \
             SELECT 'bench', 'bench.old', 'old-' || i, md5(i::text), 201, convert_to(repeat('x', 90), 'UTF8') \
             FROM generate_series($1::bigint, $2::bigint) AS i"
        )))
        .bind(from)
        .bind(to)
        .execute(pool)
        .await
        .expect("prefill the hand-written table");
        from = to + 1;
    }
    for table in ["idempotency_keys", "hand_keys"] {
        sqlx::query(sqlx::AssertSqlSafe(format!("VACUUM ANALYZE {schema}.{table}")))
            .execute(pool)
            .await
            .expect("vacuum");
    }
    // Millions of rows leave gigabytes of log behind them and a checkpoint
    // spread over the next minutes, whose writes and flushes would slow
    // every cell that follows: the table's size would not be what is
    // measured. A checkpoint now writes them before the first cell.
    if let Err(e) = sqlx::query("CHECKPOINT").execute(pool).await {
        println!(
            "# no CHECKPOINT after the prefill ({e}): the cells may run while the database writes it out"
        );
    }
    println!(
        "prefilled {n} records in each table in {:.0} s",
        started.elapsed().as_secs_f64()
    );
}

fn key(run: &str, what: &str, a: usize, b: usize) -> String {
    format!("{run}-{what}-{a}-{b}")
}

/// Completed keys for the replay cells, and keys held in progress for the
/// 409 cells, made before any cell runs.
async fn prepare(
    addr: SocketAddr,
    run: &str,
    variants: &[Variant],
    gate: &routes::Gate,
) -> Vec<client::Conn> {
    let mut held = Vec::new();
    let mut held_so_far = 0;
    let mut held_groups = Vec::new();
    for v in variants {
        match v.path {
            Path::Replay => {
                let first = match v.group {
                    "hand" => "/hand/first",
                    _ => v.route,
                };
                let mut conn = client::Conn::open(addr).await;
                for j in 0..REPLAY_KEYS {
                    let k = key(run, v.group, 0, j);
                    let answer = conn.send(&client::post(first, Some(&k), routes::BODY)).await;
                    assert_eq!(answer.status, 201, "{}: preparing replay key {j}", v.name);
                }
            }
            // The variants of a group share its held keys (one table).
            Path::Conflict if held_groups.contains(&v.group) => {}
            Path::Conflict => {
                held_groups.push(v.group);
                for j in 0..HELD_KEYS {
                    let hold = format!("{}-hold", v.group);
                    let mut conn = client::Conn::open(addr).await;
                    conn.start(&client::post(v.route, Some(&key(run, &hold, 0, j)), routes::BODY))
                        .await;
                    held.push(conn);
                }
                // Held once every one of them is in the handler.
                held_so_far += HELD_KEYS;
                gate.entered(held_so_far).await;
            }
            Path::Bare | Path::First => {}
        }
    }
    held
}

/// Runs one cell.
async fn cell(
    addr: SocketAddr,
    run: &str,
    v: &Variant,
    clients: usize,
    round: usize,
    a: &Args,
) -> client::Sample {
    let limit = Duration::from_secs_f64(a.seconds);
    let (route, path) = (v.route, v.path);
    let prefix = format!("{run}-{}-{clients}-{round}", v.name.replace(' ', "_"));
    let group = v.group;
    let run = run.to_owned();
    let request = move |c: usize, i: usize| -> Vec<u8> {
        match path {
            Path::Bare => client::post(route, None, routes::BODY),
            Path::First => client::post(route, Some(&format!("{prefix}-{c}-{i}")), routes::BODY),
            Path::Replay => client::post(
                route,
                Some(&key(&run, group, 0, (c * 7919 + i) % REPLAY_KEYS)),
                routes::BODY,
            ),
            Path::Conflict => client::post(
                route,
                Some(&key(&run, &format!("{group}-hold"), 0, (c + i) % HELD_KEYS)),
                routes::BODY,
            ),
        }
    };
    let check = move |answer: client::Answer| match path {
        Path::Bare => answer.status == 201,
        Path::First => answer.status == 201 && !answer.replayed,
        Path::Replay => answer.status == 201 && answer.replayed,
        Path::Conflict => answer.status == 409,
    };
    client::load(addr, clients, limit, a.max, a.spin, request, check).await
}

/// Each cell's rounds, by clients and variant.
type Results = BTreeMap<(usize, String), Vec<Measured>>;
/// Each cell's ratios per round, against the bare handler and the
/// hand-written flow, by clients and variant.
type Ratios = BTreeMap<(usize, String), (Vec<f64>, Vec<f64>)>;

/// One measured cell.
struct Measured {
    throughput: f64,
    requests: usize,
    seconds: f64,
    p50: u32,
    p99: u32,
    max: u32,
    rss_kb: u64,
    /// The server process's CPU per request (its threads, not the client's
    /// and not the database's), in microseconds.
    server_us: f64,
    /// The share of the cell's time the server's threads were on a CPU
    /// (1.0: one core busy throughout).
    server_busy: f64,
    /// The same for the client's thread.
    client_busy: f64,
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

/// The baseline a variant's throughput is compared with, besides the bare
/// handler: the hand-written flow's cell for the same path.
fn hand_baseline(v: &Variant) -> Option<&'static str> {
    match (v.group, v.path) {
        ("postgres", Path::First) => Some("hand-written first"),
        ("postgres", Path::Replay | Path::Conflict) => Some("hand-written replay"),
        _ => None,
    }
}

fn main() {
    let a = args();
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    let pin = a.pin && cpus >= 2;
    if let Some(records) = a.growth {
        let rt = tokio::runtime::Runtime::new().expect("a runtime");
        rt.block_on(growth::memory_growth(records));
        return;
    }
    if a.pgexec {
        let url = std::env::var("DATABASE_URL").expect("--pgexec needs DATABASE_URL (PostgreSQL)");
        let rt = tokio::runtime::Runtime::new().expect("a runtime");
        rt.block_on(pgbench::pgexec(&url, a.repeat.max(5), 5000));
        return;
    }
    if let Some(n) = a.cpu {
        cpu_cost(n, a.inflight, a.only.as_deref());
        return;
    }
    if a.pgbench {
        let url = std::env::var("DATABASE_URL").expect("--pgbench needs DATABASE_URL (PostgreSQL)");
        let seconds = (a.seconds.ceil() as u32).max(1);
        let rt = tokio::runtime::Runtime::new().expect("a runtime");
        // 16 clients unless `--clients` says otherwise.
        let clients = if a.clients_given {
            a.clients.clone()
        } else {
            vec![16]
        };
        for clients in clients {
            rt.block_on(pgbench::pgbench(&url, a.repeat, seconds, clients));
        }
        return;
    }
    let server = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(a.server_threads)
        .enable_all()
        .on_thread_start(move || {
            if pin {
                pin_to(0)
            }
        })
        .build()
        .expect("the server's runtime");
    let s = server.block_on(setup(&a));
    if pin {
        pin_to(1);
    }
    let client_rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("the client's runtime");
    let run = format!(
        "{:x}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis())
    );
    let variants = variants(s.pg.is_some(), a.only.as_deref());
    if s.pg.is_none() {
        println!(
            "# DATABASE_URL is not set to PostgreSQL: the PostgreSQL and hand-written cells are skipped"
        );
    }
    println!(
        "# {} s per cell (at most {} requests), {} round(s), server: {} worker thread(s){}{}, PostgreSQL pool {}",
        a.seconds,
        a.max,
        a.repeat,
        a.server_threads,
        if pin { " on CPU 0, client on CPU 1" } else { "" },
        if a.spin { ", the client spinning" } else { "" },
        a.pool
    );
    if let Some(l) = s.pg_latency {
        println!(
            "# PostgreSQL: a round trip (SELECT 1) {:.0} us, a one-row commit {:.0} us (medians; p90 {:.0} and {:.0} us)",
            l.round_trip.0, l.commit.0, l.round_trip.1, l.commit.1
        );
    }
    let held = client_rt.block_on(prepare(s.addr, &run, &variants, &s.gate));
    // Warm-up: each variant once, unmeasured.
    for v in &variants {
        let quick = Args {
            seconds: 0.3,
            max: 500,
            ..a.clone()
        };
        client_rt.block_on(cell(s.addr, &run, v, 4, usize::MAX, &quick));
    }
    let mut results = Results::new();
    let mut ratios = Ratios::new();
    for &clients in &a.clients {
        for round in 0..a.repeat {
            let mut this_round: BTreeMap<String, f64> = BTreeMap::new();
            for v in &variants {
                reset_peak_rss();
                let (server0, client0) = (others_cpu_ns(), thread_cpu_ns().unwrap_or(0));
                let sample = client_rt.block_on(cell(s.addr, &run, v, clients, round, &a));
                let server_ns = others_cpu_ns().saturating_sub(server0) as f64;
                let client_ns = thread_cpu_ns().unwrap_or(0).saturating_sub(client0) as f64;
                let wall_ns = sample.elapsed.as_nanos() as f64;
                let m = Measured {
                    throughput: sample.throughput(),
                    requests: sample.latencies_us.len(),
                    seconds: sample.elapsed.as_secs_f64(),
                    p50: sample.quantile(0.5),
                    p99: sample.quantile(0.99),
                    max: sample.quantile(1.0),
                    rss_kb: peak_rss_kb(),
                    server_us: server_ns / 1000.0 / sample.latencies_us.len().max(1) as f64,
                    server_busy: server_ns / wall_ns,
                    client_busy: client_ns / wall_ns,
                };
                this_round.insert(v.name.clone(), m.throughput);
                results.entry((clients, v.name.clone())).or_default().push(m);
            }
            for v in &variants {
                let tp = this_round[&v.name];
                let r = ratios.entry((clients, v.name.clone())).or_default();
                if let Some(bare) = this_round.get("bare handler") {
                    r.0.push(tp / bare);
                }
                if let Some(hand) = hand_baseline(v).and_then(|h| this_round.get(h)) {
                    r.1.push(tp / hand);
                }
            }
        }
    }
    report(&a, &variants, &results, &ratios);
    s.gate.open();
    client_rt.block_on(async {
        for mut conn in held {
            assert_eq!(conn.answer().await.status, 201, "a held request, once let go");
        }
    });
    if let Some((pool, schema)) = &s.pg {
        server.block_on(async {
            let _ = sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
                .execute(pool)
                .await;
        });
    }
}

fn report(a: &Args, variants: &[Variant], results: &Results, ratios: &Ratios) {
    let mut csv = String::from(
        "variant,clients,requests,seconds,throughput,p50_us,p99_us,max_us,ratio_bare,ratio_hand,peak_rss_kb,throughput_min,throughput_max,server_cpu_us,server_busy,client_busy\n",
    );
    println!(
        "\n{:<24} {:>3} {:>9} {:>15} {:>8} {:>8} {:>8} {:>6} {:>6} {:>8} {:>7} {:>5} {:>5}",
        "variant",
        "c",
        "req/s",
        "range",
        "p50 us",
        "p99 us",
        "max us",
        "/bare",
        "/hand",
        "RSS MB",
        "cpu us",
        "srv%",
        "cli%"
    );
    for &clients in &a.clients {
        for v in variants {
            let Some(ms) = results.get(&(clients, v.name.clone())) else {
                continue;
            };
            let tp = median(ms.iter().map(|m| m.throughput).collect());
            let lo = ms.iter().map(|m| m.throughput).fold(f64::INFINITY, f64::min);
            let hi = ms.iter().map(|m| m.throughput).fold(0.0, f64::max);
            let p50 = median(ms.iter().map(|m| f64::from(m.p50)).collect());
            let p99 = median(ms.iter().map(|m| f64::from(m.p99)).collect());
            let max = ms.iter().map(|m| m.max).max().unwrap_or(0);
            let rss = ms.iter().map(|m| m.rss_kb).max().unwrap_or(0);
            let requests: usize = ms.iter().map(|m| m.requests).sum();
            let server_us = median(ms.iter().map(|m| m.server_us).collect());
            let server_busy = median(ms.iter().map(|m| m.server_busy).collect());
            let client_busy = median(ms.iter().map(|m| m.client_busy).collect());
            let seconds: f64 = ms.iter().map(|m| m.seconds).sum();
            let (rb, rh) = ratios
                .get(&(clients, v.name.clone()))
                .cloned()
                .unwrap_or_default();
            let (rb, rh) = (median(rb), median(rh));
            let show = |r: f64| {
                if r.is_nan() {
                    "-".to_owned()
                } else {
                    format!("{r:.2}")
                }
            };
            println!(
                "{:<24} {:>3} {:>9.0} {:>7.0}-{:<7.0} {:>8.0} {:>8.0} {:>8} {:>6} {:>6} {:>8.1} {:>7.1} {:>5.0} {:>5.0}",
                v.name,
                clients,
                tp,
                lo,
                hi,
                p50,
                p99,
                max,
                show(rb),
                show(rh),
                rss as f64 / 1024.0,
                server_us,
                100.0 * server_busy,
                100.0 * client_busy
            );
            let field = |r: f64| {
                if r.is_nan() {
                    String::new()
                } else {
                    format!("{r:.3}")
                }
            };
            csv.push_str(&format!(
                "{},{clients},{requests},{seconds:.2},{tp:.1},{p50:.0},{p99:.0},{max},{},{},{rss},{lo:.1},{hi:.1},{server_us:.2},{server_busy:.3},{client_busy:.3}\n",
                v.name,
                field(rb),
                field(rh)
            ));
        }
    }
    if let Some(path) = &a.csv {
        std::fs::write(path, csv).expect("the CSV is written");
        println!("\nwrote {}", path.display());
    }
}

/// The server's CPU per request without the network: the router called in
/// process, one request at a time on one thread, bare and behind
/// `#[idempotent]` on the memory store (first request, replay), `n` each;
/// with `DATABASE_URL`, also a PostgreSQL replay against the hand-written
/// one (by the thread's CPU time: the database answers meanwhile).
fn cpu_cost(n: usize, inflight: usize, only: Option<&[String]>) {
    use tower::ServiceExt as _;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    rt.block_on(async {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let sqlite = idem::SqliteStore::open(dir.path().join("cpu.db"))
            .await
            .expect("open");
        sqlite.migrate().await.expect("migrate");
        let gate = routes::Gate::default();
        let app = routes::app(
            routes::Stores {
                postgres: None,
                sqlite,
                memory: idem::MemoryStore::new(),
            },
            gate.clone(),
        );
        let request = |path: &str, key: Option<String>| {
            let mut r = axum::http::Request::post(path).header("content-type", "application/json");
            if let Some(k) = key {
                r = r.header("idempotency-key", k);
            }
            r.body(axum::body::Body::from(routes::BODY)).expect("a request")
        };
        let time = |name: &'static str, path: &'static str, keyed: Option<&'static str>| {
            let app = app.clone();
            async move {
                let mut times = Vec::new();
                for round in 0..5 {
                    let started = std::time::Instant::now();
                    let one = |i: usize| {
                        let key = keyed.map(|k| match k {
                            "first" => format!("cpu-{round}-{i}"),
                            "conflict" => format!("cpu-held-{}", i % 100),
                            _ => format!("cpu-replay-{}", i % 100),
                        });
                        let answer = app.clone().oneshot(request(path, key));
                        async move {
                            let answer = answer.await.expect("an answer");
                            let expected = if keyed == Some("conflict") { 409 } else { 201 };
                            assert_eq!(answer.status(), expected, "{name}");
                            if i == 0 || i + 1 == n {
                                // The cell is the path it names: only a
                                // replay is answered from the record.
                                let replayed = answer.headers().contains_key("idempotent-replayed");
                                assert_eq!(replayed, keyed == Some("replay"), "{name}: replayed {replayed}");
                            }
                            let _ = axum::body::to_bytes(answer.into_body(), usize::MAX).await;
                        }
                    };
                    if inflight <= 1 {
                        for i in 0..n {
                            one(i).await;
                        }
                    } else {
                        // `inflight` requests under way at once, as many
                        // clients' requests are on a server's one thread.
                        futures_util::StreamExt::for_each(
                            futures_util::StreamExt::buffer_unordered(
                                futures_util::stream::iter((0..n).map(one)),
                                inflight,
                            ),
                            |()| async {},
                        )
                        .await;
                    }
                    times.push(started.elapsed().as_secs_f64() * 1e6 / n as f64);
                }
                times.sort_by(f64::total_cmp);
                println!(
                    "{name:<28} {:>7.2} us per request (median of 5; {:.2} to {:.2})",
                    times[2], times[0], times[4]
                );
                times[2]
            }
        };
        // The keys the replays cycle over, completed first.
        for i in 0..100 {
            let key = Some(format!("cpu-replay-{i}"));
            let answer = app
                .clone()
                .oneshot(request("/memory/pay", key))
                .await
                .expect("an answer");
            assert_eq!(answer.status(), 201);
        }
        // The keys the 409s cycle over, held by their handlers until the
        // end (only for that cell: the others' counts stay comparable).
        if chosen(only, "memory", "idem memory 409") {
            for i in 0..100 {
                let key = Some(format!("cpu-held-{i}"));
                tokio::spawn(app.clone().oneshot(request("/memory/hold", key)));
            }
            gate.entered(100).await;
        }
        let cell = |group: &str, name: &'static str, path: &'static str, keyed: Option<&'static str>| {
            chosen(only, group, name).then(|| time(name, path, keyed))
        };
        let cells = [
            cell("bare", "bare handler", "/bare", None),
            cell("memory", "idem memory first", "/memory/pay", Some("first")),
            cell("memory", "idem memory replay", "/memory/pay", Some("replay")),
            cell("memory", "idem memory 409", "/memory/hold", Some("conflict")),
        ];
        let mut times = Vec::new();
        for cell in cells {
            times.push(match cell {
                Some(timed) => Some(timed.await),
                None => None,
            });
        }
        if let [Some(bare), Some(first), Some(replay), _] = times[..] {
            println!(
                "idem's own CPU: first {:.2} us, replay {:.2} us",
                first - bare,
                replay - bare
            );
        }
        let pg_cells: Vec<&str> = [
            "hand-written replay",
            "idem postgres replay",
            "hand-written first",
            "idem postgres first",
        ]
        .into_iter()
        .filter(|name| {
            chosen(
                only,
                if name.starts_with("hand") {
                    "hand"
                } else {
                    "postgres"
                },
                name,
            )
        })
        .collect();
        if !pg_cells.is_empty() {
            pg_cpu(n, &pg_cells).await;
        }
    });
}

/// The CPU time so far of this process's other threads (the server's
/// runtime, sqlx's SQLite workers), from each one's `schedstat`; 0 where
/// `/proc` is missing. A thread that ended meanwhile is not counted.
fn others_cpu_ns() -> u64 {
    let me = std::fs::read_link("/proc/thread-self").ok();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .flatten()
        .filter(|t| {
            me.as_ref()
                .and_then(|m| m.file_name())
                .is_none_or(|m| m != t.file_name().as_os_str())
        })
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// This thread's CPU time so far (Linux's `schedstat`: user and system,
/// in nanoseconds); `None` elsewhere.
fn thread_cpu_ns() -> Option<u64> {
    cpu_ns("/proc/thread-self/schedstat")
}

/// The CPU time so far of the task whose `schedstat` is at `path`.
fn cpu_ns(path: &str) -> Option<u64> {
    std::fs::read_to_string(path)
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// With PostgreSQL (`DATABASE_URL`): the server's own CPU per replay, idem's
/// against the hand-written one-`SELECT` replay, and per first request,
/// idem's against the hand-written `INSERT` and `UPDATE` (the `cells`
/// named), on one connection of a pool with sqlx's defaults. The runtime has one thread, and sqlx's
/// PostgreSQL driver works on it, so its CPU time is the server's whole
/// share, system calls included (the database's is not counted).
async fn pg_cpu(n: usize, cells: &[&str]) {
    use tower::ServiceExt as _;
    let Some(url) = std::env::var("DATABASE_URL")
        .ok()
        .filter(|u| u.starts_with("postgres"))
    else {
        println!("# DATABASE_URL is not set to PostgreSQL: no PostgreSQL replay figures");
        return;
    };
    if thread_cpu_ns().is_none() {
        println!("# no per-thread CPU time on this system: no PostgreSQL replay figures");
        return;
    }
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .expect("DATABASE_URL connects");
    let schema = format!("idem_bench_cpu_{}", std::process::id());
    let store = pg_tables(&pool, &schema).await;
    let hand = routes::Hand::new(pool.clone(), &schema);
    let dir = tempfile::tempdir().expect("a temporary directory");
    let sqlite = idem::SqliteStore::open(dir.path().join("cpu-pg.db"))
        .await
        .expect("open");
    let app = routes::app(
        routes::Stores {
            postgres: Some((store, hand)),
            sqlite,
            memory: idem::MemoryStore::new(),
        },
        routes::Gate::default(),
    );
    let send = |path: &'static str, key: String| {
        let app = app.clone();
        async move {
            let request = axum::http::Request::post(path)
                .header("content-type", "application/json")
                .header("idempotency-key", key)
                .body(axum::body::Body::from(routes::BODY))
                .expect("a request");
            let answer = app.oneshot(request).await.expect("an answer");
            let status = answer.status();
            let _ = axum::body::to_bytes(answer.into_body(), usize::MAX).await;
            status
        }
    };
    for i in 0..100 {
        assert_eq!(send("/hand/first", format!("cpu-pg-{i}")).await, 201);
        assert_eq!(send("/postgres/pay", format!("cpu-pg-{i}")).await, 201);
    }
    let mut medians = BTreeMap::new();
    for (name, path) in [
        ("hand-written replay", "/hand/replay"),
        // Read from the database, as the hand-written replay is: the
        // answers the store keeps in memory would take the round trip out.
        ("idem postgres replay", "/postgres-db/pay"),
        ("hand-written first", "/hand/first"),
        ("idem postgres first", "/postgres/pay"),
    ] {
        if !cells.contains(&name) {
            continue;
        }
        let (mut cpu, mut wall) = (Vec::new(), Vec::new());
        for round in 0..5 {
            let started = thread_cpu_ns().unwrap_or(0);
            let clock = std::time::Instant::now();
            for i in 0..n {
                // A first request takes a key no request has taken.
                let key = if name.ends_with("first") {
                    format!("cpu-pg-first-{round}-{i}")
                } else {
                    format!("cpu-pg-{}", i % 100)
                };
                let status = send(path, key).await;
                assert!(status == 201, "{name}: {status}");
            }
            let spent = thread_cpu_ns().unwrap_or(0).saturating_sub(started);
            cpu.push(spent as f64 / 1e3 / n as f64);
            wall.push(clock.elapsed().as_secs_f64() * 1e6 / n as f64);
        }
        cpu.sort_by(f64::total_cmp);
        wall.sort_by(f64::total_cmp);
        println!(
            "{name:<28} {:>7.2} us of this thread's CPU per request (median of 5; {:.2} to {:.2}), \
             {:.2} us of wall time ({:.2} to {:.2})",
            cpu[2], cpu[0], cpu[4], wall[2], wall[0], wall[4]
        );
        medians.insert(name, cpu[2]);
    }
    for path in ["replay", "first"] {
        let (Some(hand), Some(idem)) = (
            medians.get(format!("hand-written {path}").as_str()),
            medians.get(format!("idem postgres {path}").as_str()),
        ) else {
            continue;
        };
        println!(
            "idem's PostgreSQL {path} costs the server {:.2} us of CPU {} than the hand-written one ({:.2}x)",
            (idem - hand).abs(),
            if idem >= hand { "more" } else { "less" },
            idem / hand
        );
    }
    let _ = sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&pool)
        .await;
}
