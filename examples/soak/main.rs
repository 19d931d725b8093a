//! The soak: drives the example payments service over real HTTP on
//! loopback, two service processes on one store, with retries, concurrent
//! retries, abandoned requests, declines, gateway outages, panics and reused
//! keys, optionally under one injected fault; then reconciles every effect
//! and exits non-zero on any discrepancy.
//!
//! ```text
//! cargo build --release --examples
//! cargo run --release --example soak -- --store postgres --ops 20000 --fault kill-connections
//! ```
//! Options: `--store sqlite|postgres` (PostgreSQL from `DATABASE_URL`),
//! `--ops N`, `--clients N`, `--tenants N`, `--seconds N` (the load stops
//! starting operations after that), `--seed N`, and `--fault none|
//! kill-connections|restart-postgres|kill-process|stall|clock`.

mod client;
mod faults;
mod load;
mod reconcile;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// What one run does.
#[derive(Clone, Debug)]
pub(crate) struct Args {
    pub(crate) store: String,
    pub(crate) ops: usize,
    pub(crate) clients: usize,
    pub(crate) tenants: usize,
    pub(crate) seconds: u64,
    pub(crate) seed: u64,
    pub(crate) fault: String,
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        store: "sqlite".into(),
        ops: 600,
        clients: 16,
        tenants: 40,
        seconds: 300,
        seed: 1,
        fault: "none".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let number = || {
            value
                .parse::<u64>()
                .map_err(|_| format!("{flag}: `{value}` is not a number"))
        };
        match flag.as_str() {
            "--store" => a.store = value.clone(),
            "--ops" => a.ops = number()? as usize,
            "--clients" => a.clients = number()?.max(1) as usize,
            "--tenants" => a.tenants = number()?.max(2) as usize,
            "--seconds" => a.seconds = number()?,
            "--seed" => a.seed = number()?,
            "--fault" => a.fault = value.clone(),
            _ => return Err(format!("unknown option {flag}")),
        }
    }
    if !["sqlite", "postgres"].contains(&a.store.as_str()) {
        return Err(format!("--store {}: sqlite or postgres", a.store));
    }
    let faults = [
        "none",
        "kill-connections",
        "restart-postgres",
        "kill-process",
        "stall",
        "clock",
    ];
    if !faults.contains(&a.fault.as_str()) {
        return Err(format!("--fault {}: one of {}", a.fault, faults.join(", ")));
    }
    if a.store == "sqlite" && ["kill-connections", "restart-postgres", "stall"].contains(&a.fault.as_str()) {
        return Err(format!("--fault {} needs --store postgres", a.fault));
    }
    Ok(a)
}

/// The two service processes and how to start them again.
pub(crate) struct Services {
    binary: std::path::PathBuf,
    database_url: String,
    /// With `--fault clock`: each process's wall clock is shifted (by
    /// libfaketime), the first 1 h behind, the second 2 h ahead.
    skewed: bool,
    pub(crate) addrs: Vec<SocketAddr>,
    children: Vec<Option<tokio::process::Child>>,
}

impl Services {
    async fn start(database_url: String, skewed: bool) -> Result<Self, String> {
        let binary = std::env::current_exe()
            .map_err(|e| e.to_string())?
            .with_file_name("payments");
        if !binary.exists() {
            return Err(format!(
                "{} is missing: build the examples first (cargo build --release --examples)",
                binary.display()
            ));
        }
        if skewed && !std::path::Path::new(FAKETIME).exists() {
            return Err(format!(
                "--fault clock needs libfaketime ({FAKETIME}): apt-get install faketime"
            ));
        }
        let mut s = Services {
            binary,
            database_url,
            skewed,
            addrs: Vec::new(),
            children: Vec::new(),
        };
        for _ in 0..2 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map_err(|e| e.to_string())?
                .port();
            s.addrs.push(SocketAddr::from(([127, 0, 0, 1], port)));
            s.children.push(None);
        }
        for i in 0..2 {
            s.spawn(i)?;
        }
        for i in 0..2 {
            s.wait_healthy(i, Duration::from_secs(30)).await?;
        }
        Ok(s)
    }

    fn spawn(&mut self, i: usize) -> Result<(), String> {
        let mut cmd = tokio::process::Command::new(&self.binary);
        if self.skewed {
            cmd.env("LD_PRELOAD", FAKETIME)
                .env("FAKETIME", if i == 0 { "-1h" } else { "+2h" })
                // Timers and timeouts run on the monotonic clock, as in
                // production; only the wall clock disagrees.
                .env("DONT_FAKE_MONOTONIC", "1");
        }
        if i == 1 {
            // The second process plays a ledger outage after the charge on
            // every payment's first attempt: its retry must continue the
            // same operation (one charge under its derived key).
            cmd.env("PAYMENTS_FAULT_LEDGER_ONCE", "1");
        }
        let child = cmd
            .env("PAYMENTS_ADDR", self.addrs[i].to_string())
            .env("DATABASE_URL", &self.database_url)
            .env("IDEM_LOCK_TIMEOUT", "2s")
            .env("PAYMENTS_GATEWAY_DELAY_MS", "2")
            .env("RUST_LOG", "off")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("start {}: {e}", self.binary.display()))?;
        self.children[i] = Some(child);
        Ok(())
    }

    async fn wait_healthy(&self, i: usize, within: Duration) -> Result<(), String> {
        let until = Instant::now() + within;
        while Instant::now() < until {
            if client::get(self.addrs[i], "/health")
                .await
                .is_some_and(|a| a.status == 200)
            {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(format!("service {i} on {} did not become healthy", self.addrs[i]))
    }

    /// SIGKILL, then a new process on the same port.
    async fn kill_and_restart(&mut self, i: usize) -> Result<(), String> {
        if let Some(mut c) = self.children[i].take() {
            let _ = c.kill().await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        self.spawn(i)?;
        self.wait_healthy(i, Duration::from_secs(30)).await
    }
}

/// libfaketime, for `--fault clock`.
const FAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1";

/// Where the run's data lives, and how the soak reads it afterwards.
pub(crate) enum Db {
    /// The pool, and the directory of the file (removed when dropped).
    Sqlite(sqlx::SqlitePool, #[allow(dead_code)] tempfile::TempDir),
    Postgres {
        pool: sqlx::PgPool,
        admin_url: String,
        schema: String,
    },
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let args = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("soak: {e}");
            return ExitCode::from(2);
        }
    };
    match run(args).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("soak: {e}");
            ExitCode::from(2)
        }
    }
}

async fn run(args: Args) -> Result<bool, String> {
    let run_id = format!(
        "s{}{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_err(|e| e.to_string())?
            .as_secs()
            % 100_000
    );
    let mut proxy = None;
    let (db, service_url) = match args.store.as_str() {
        "sqlite" => {
            let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
            let file = dir.path().join("soak.db");
            let url = format!("sqlite://{}", file.display());
            // The service creates the file and its tables; the soak reads it
            // once the run is over.
            (None, (url, dir))
        }
        _ => {
            let url = std::env::var("DATABASE_URL")
                .ok()
                .filter(|u| u.starts_with("postgres"))
                .ok_or("--store postgres needs DATABASE_URL=postgres://...")?;
            let admin = sqlx::PgPool::connect(&url).await.map_err(|e| e.to_string())?;
            let schema = format!("soak_{run_id}");
            sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA \"{schema}\"")))
                .execute(&admin)
                .await
                .map_err(|e| e.to_string())?;
            let mut target = url.clone();
            if args.fault == "stall" {
                let (written, upstream) = pg_addr(&url)?;
                let p = faults::StallProxy::start(upstream)
                    .await
                    .map_err(|e| e.to_string())?;
                target = target.replacen(&format!("@{written}"), &format!("@{}", p.addr), 1);
                if !target.contains(&p.addr.to_string()) {
                    return Err("--fault stall needs DATABASE_URL as postgres://user@host[:port]/db".into());
                }
                proxy = Some(p);
            }
            let sep = if target.contains('?') { '&' } else { '?' };
            let service_url =
                format!("{target}{sep}options=-c%20search_path%3D{schema}&application_name=idem_{run_id}");
            (
                Some(Db::Postgres {
                    pool: admin,
                    admin_url: url,
                    schema,
                }),
                (service_url, tempfile::tempdir().map_err(|e| e.to_string())?),
            )
        }
    };
    let (service_url, dir) = service_url;
    let mut services = Services::start(service_url.clone(), args.fault == "clock").await?;
    if args.fault == "clock" {
        // Proof that the clocks differ: each process's `date` header.
        for (i, addr) in services.addrs.iter().enumerate() {
            let date = client::get(*addr, "/health")
                .await
                .and_then(|a| a.header("date").map(str::to_owned));
            println!("service {i} says the time is {}", date.unwrap_or_default());
        }
    }
    let db = match db {
        Some(db) => db,
        None => {
            let file = dir.path().join("soak.db");
            let pool = sqlx::sqlite::SqlitePoolOptions::new()
                .max_connections(1)
                .connect_with(
                    sqlx::sqlite::SqliteConnectOptions::new()
                        .filename(file)
                        .busy_timeout(Duration::from_secs(30)),
                )
                .await
                .map_err(|e| e.to_string())?;
            Db::Sqlite(pool, dir)
        }
    };
    println!(
        "soak {run_id}: {} operations, {} clients, {} tenants, store {}, fault {}",
        args.ops, args.clients, args.tenants, args.store, args.fault
    );
    let started = Instant::now();
    let plan = load::plan(&args, &run_id);
    let stop_faults = std::sync::Arc::new(tokio::sync::Notify::new());
    let fault_log = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let addrs = services.addrs.clone();
    let load = tokio::spawn(load::run(plan.clone(), addrs.clone(), args.clients, args.seconds));
    // The fault runs beside the load until the load is over.
    let fault = {
        let stop = stop_faults.clone();
        let log = fault_log.clone();
        let args = args.clone();
        let admin = match &db {
            Db::Postgres { pool, admin_url, .. } => Some((pool.clone(), admin_url.clone())),
            Db::Sqlite(..) => None,
        };
        let application = format!("idem_{run_id}");
        async move {
            let mut n = 0u64;
            loop {
                let every = match args.fault.as_str() {
                    "kill-connections" => Duration::from_secs(2),
                    "restart-postgres" => Duration::from_secs(8),
                    "kill-process" => Duration::from_secs(3),
                    "stall" => Duration::from_secs(5),
                    _ => Duration::from_secs(3600),
                };
                tokio::select! {
                    () = stop.notified() => break,
                    () = tokio::time::sleep(every) => {}
                }
                n += 1;
                let entry = match args.fault.as_str() {
                    "kill-connections" => {
                        let (pool, _) = admin.as_ref().expect("postgres");
                        format!(
                            "killed {} connections",
                            faults::kill_connections(pool, &application).await
                        )
                    }
                    "restart-postgres" => {
                        let (_, url) = admin.as_ref().expect("postgres");
                        let r = faults::pg_cluster("restart");
                        let up = faults::pg_ready(url, Duration::from_secs(60)).await;
                        format!("restarted PostgreSQL: {r:?}, accepting again: {up}")
                    }
                    "kill-process" => {
                        let i = (n % 2) as usize;
                        let r = services.kill_and_restart(i).await;
                        format!("SIGKILL service {i} and restart: {r:?}")
                    }
                    "stall" => {
                        let p = proxy.as_ref().expect("proxy");
                        p.stall(true);
                        tokio::time::sleep(Duration::from_secs(3)).await;
                        p.stall(false);
                        "store stalled for 3 s".to_owned()
                    }
                    _ => continue,
                };
                log.lock().unwrap().push(entry);
            }
            (services, proxy)
        }
    };
    let fault = tokio::spawn(fault);
    let mut logs = load.await.map_err(|e| e.to_string())?;
    stop_faults.notify_one();
    let (mut services, proxy) = fault.await.map_err(|e| e.to_string())?;
    if let Some(p) = &proxy {
        p.stall(false);
    }
    if let Db::Postgres { admin_url, .. } = &db {
        if !faults::pg_ready(admin_url, Duration::from_secs(5)).await {
            // The tool restores what it broke.
            let _ = faults::pg_cluster("start");
            faults::pg_ready(admin_url, Duration::from_secs(60)).await;
        }
    }
    for i in 0..2 {
        if services.wait_healthy(i, Duration::from_secs(10)).await.is_err() {
            services.kill_and_restart(i).await?;
        }
    }
    let load_time = started.elapsed();
    // Every operation without a final answer is retried until it has one.
    load::settle(&plan, &mut logs, &services.addrs).await;
    let faults_done = fault_log.lock().unwrap().clone();
    let ok = reconcile::report(
        &args,
        &plan,
        &logs,
        &db,
        &faults_done,
        load_time,
        started.elapsed(),
    )
    .await?;
    if let Db::Postgres { pool, schema, .. } = &db {
        if ok {
            let _ = sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA \"{schema}\" CASCADE")))
                .execute(pool)
                .await;
        } else {
            println!("kept schema {schema} for inspection");
        }
    }
    Ok(ok)
}

/// The host and port of a `postgres://` URL, as written and as an address.
fn pg_addr(url: &str) -> Result<(String, SocketAddr), String> {
    let rest = url.split("://").nth(1).unwrap_or_default();
    let host_port = rest.split(['/', '?']).next().unwrap_or_default();
    let host_port = host_port.rsplit('@').next().unwrap_or_default();
    let with_port = if host_port.contains(':') {
        host_port.to_owned()
    } else {
        format!("{host_port}:5432")
    };
    let with_port = with_port.replace("localhost", "127.0.0.1");
    let addr = with_port
        .parse()
        .map_err(|_| format!("--fault stall needs DATABASE_URL with an IP host, not `{host_port}`"))?;
    Ok((host_port.to_owned(), addr))
}
