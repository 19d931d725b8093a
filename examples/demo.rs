//! Plays the classic failures of payment APIs against the payments service
//! over real HTTP, prints what happened, and exits non-zero if any
//! protection failed.
//!
//! ```text
//! cargo run --example demo                                        # temporary SQLite file
//! DATABASE_URL=postgres://postgres@127.0.0.1/test cargo run --example demo
//! ```

/// The payments service, from the files of the `payments` example
/// (`examples/payments/`), started in this process.
#[allow(dead_code, unreachable_pub)]
mod payments {
    pub mod api;
    pub mod config;
    pub mod db;
    pub mod service;
}

use idem_testkit::http::{get, post, Reply};
use std::net::SocketAddr;
use std::time::Duration;

/// One scenario's outcome, a row of the table.
struct Row {
    scenario: &'static str,
    requests: usize,
    statuses: String,
    charges: i64,
    verdict: Result<(), String>,
}

struct Demo {
    addr: SocketAddr,
    /// Makes the tenants of this run unique, so a shared database's earlier
    /// runs do not count.
    run: String,
}

fn body(amount: i64, recipient: &str) -> String {
    format!(r#"{{"amount": {amount}, "currency": "EUR", "recipient": "{recipient}"}}"#)
}

fn statuses(replies: &[Reply]) -> String {
    let mut parts: Vec<String> = replies
        .iter()
        .map(|r| {
            if r.header("idempotent-replayed") == Some("true") {
                format!("{}r", r.status)
            } else {
                r.status.to_string()
            }
        })
        .collect();
    // Summarize long runs: 409 x19.
    parts.sort();
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < parts.len() {
        let n = parts[i..].iter().take_while(|p| **p == parts[i]).count();
        out.push(if n > 1 {
            format!("{} x{n}", parts[i])
        } else {
            parts[i].clone()
        });
        i += n;
    }
    out.join(", ")
}

fn check(ok: bool, why: &str) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(why.to_owned())
    }
}

impl Demo {
    fn tenant(&self, name: &str) -> String {
        format!("{name}_{}", self.run)
    }

    async fn pay(&self, tenant: &str, key: &str, json: &str) -> Reply {
        post("/v1/payments", json)
            .bearer(tenant)
            .key(key)
            .send(self.addr)
            .await
    }

    async fn ledger(&self, tenant: &str) -> (i64, i64) {
        let l = get("/v1/ledger").bearer(tenant).send(self.addr).await.json();
        (
            l["charges"].as_i64().unwrap_or(-1),
            l["gateway_calls"].as_i64().unwrap_or(-1),
        )
    }

    async fn double_click(&self) -> Row {
        let t = self.tenant("double_click");
        let json = body(4990, "acct_bob");
        let (a, b) = tokio::join!(self.pay(&t, "k1", &json), self.pay(&t, "k1", &json));
        let later = self.pay(&t, "k1", &json).await;
        let replies = vec![a, b, later];
        let (charges, _) = self.ledger(&t).await;
        let executed = replies
            .iter()
            .filter(|r| r.status == 201 && r.header("idempotent-replayed").is_none())
            .count();
        Row {
            scenario: "double click",
            requests: replies.len(),
            statuses: statuses(&replies),
            charges,
            verdict: check(
                charges == 1 && executed == 1,
                "expected one execution and one charge",
            ),
        }
    }

    async fn response_lost(&self) -> Row {
        let t = self.tenant("response_lost");
        post("/v1/payments", &body(2500, "acct_bob"))
            .bearer(&t)
            .key("k1")
            .send_and_hang_up(self.addr, Duration::from_millis(100))
            .await;
        tokio::time::sleep(Duration::from_millis(600)).await;
        let retry = self.pay(&t, "k1", &body(2500, "acct_bob")).await;
        let (charges, _) = self.ledger(&t).await;
        let replayed = retry.header("idempotent-replayed") == Some("true");
        Row {
            scenario: "response lost, then retried",
            requests: 2,
            statuses: format!("(hung up), {}", statuses(std::slice::from_ref(&retry))),
            charges,
            verdict: check(
                charges == 1 && retry.status == 201 && replayed,
                "the retry must replay the first charge",
            ),
        }
    }

    async fn different_amount(&self) -> Row {
        let t = self.tenant("different_amount");
        let first = self.pay(&t, "k1", &body(1000, "acct_bob")).await;
        let second = self.pay(&t, "k1", &body(9000, "acct_bob")).await;
        let (charges, _) = self.ledger(&t).await;
        let reused = second.json()["type"]
            .as_str()
            .unwrap_or_default()
            .ends_with("idempotency-key-reused");
        Row {
            scenario: "same key, different amount",
            requests: 2,
            statuses: statuses(&[first.clone(), second.clone()]),
            charges,
            verdict: check(
                first.status == 201 && second.status == 422 && reused && charges == 1,
                "expected 422 idempotency-key-reused",
            ),
        }
    }

    async fn comment_added(&self) -> Row {
        let t = self.tenant("comment_added");
        let first = self.pay(&t, "k1", &body(700, "acct_bob")).await;
        let with_comment = r#"{"amount": 700, "currency": "EUR", "recipient": "acct_bob", "comment": "second try", "metadata": {"app": "ios"}}"#;
        let second = self.pay(&t, "k1", with_comment).await;
        let (charges, calls) = self.ledger(&t).await;
        Row {
            scenario: "comment added on retry",
            requests: 2,
            statuses: statuses(&[first.clone(), second.clone()]),
            charges,
            verdict: check(
                second.status == 201
                    && second.body == first.body
                    && second.header("idempotent-replayed") == Some("true")
                    && charges == 1
                    && calls == 1,
                "the retry must replay, the gateway asked once",
            ),
        }
    }

    async fn declined_retried(&self) -> Row {
        let t = self.tenant("declined");
        let first = self.pay(&t, "k1", &body(700, "acct_declined")).await;
        let second = self.pay(&t, "k1", &body(700, "acct_declined")).await;
        let (charges, calls) = self.ledger(&t).await;
        Row {
            scenario: "declined card, retried",
            requests: 2,
            statuses: statuses(&[first.clone(), second.clone()]),
            charges,
            verdict: check(
                first.status == 402
                    && second.status == 402
                    && second.header("idempotent-replayed") == Some("true")
                    && calls == 1,
                "the decline must be stored and replayed, the gateway asked once",
            ),
        }
    }

    async fn gateway_outage(&self) -> Row {
        let t = self.tenant("outage");
        let first = self.pay(&t, "k1", &body(700, "acct_unavailable")).await;
        let second = self.pay(&t, "k1", &body(700, "acct_unavailable")).await;
        let (charges, calls) = self.ledger(&t).await;
        Row {
            scenario: "gateway outage, retried",
            requests: 2,
            statuses: statuses(&[first.clone(), second.clone()]),
            charges,
            verdict: check(
                first.status == 503
                    && second.status == 503
                    && second.header("idempotent-replayed").is_none()
                    && calls == 2,
                "the retry must really call the gateway again",
            ),
        }
    }

    async fn twenty_concurrent(&self) -> Row {
        let t = self.tenant("concurrent");
        let tasks: Vec<_> = (0..20)
            .map(|_| {
                let (addr, t) = (self.addr, t.clone());
                tokio::spawn(async move {
                    post("/v1/payments", &body(100, "acct_bob"))
                        .bearer(&t)
                        .key("k1")
                        .send(addr)
                        .await
                })
            })
            .collect();
        let mut replies = Vec::new();
        for task in tasks {
            if let Ok(r) = task.await {
                replies.push(r);
            }
        }
        let (charges, calls) = self.ledger(&t).await;
        // One ran; the others met it in flight (409), or, arriving late on
        // a busy machine, after it (its replay).
        let ran: Vec<_> = replies
            .iter()
            .filter(|r| r.status == 201 && r.header("idempotent-replayed").is_none())
            .collect();
        let others_fine = replies.iter().all(|r| {
            r.status == 409 || (r.status == 201 && ran.first().is_some_and(|first| first.body == r.body))
        });
        Row {
            scenario: "twenty concurrent, one key",
            requests: 20,
            statuses: statuses(&replies),
            charges,
            verdict: check(
                replies.len() == 20 && ran.len() == 1 && others_fine && charges == 1 && calls == 1,
                "expected one 201, the others 409 (or its replay), the gateway asked once",
            ),
        }
    }

    async fn two_tenants(&self) -> Row {
        let (a, b) = (self.tenant("tenant_a"), self.tenant("tenant_b"));
        let ra = self.pay(&a, "shared-key", &body(300, "acct_bob")).await;
        let rb = self.pay(&b, "shared-key", &body(300, "acct_bob")).await;
        let (ca, _) = self.ledger(&a).await;
        let (cb, _) = self.ledger(&b).await;
        Row {
            scenario: "two tenants, same key",
            requests: 2,
            statuses: statuses(&[ra.clone(), rb.clone()]),
            charges: ca + cb,
            verdict: check(
                ra.status == 201
                    && rb.status == 201
                    && rb.header("idempotent-replayed").is_none()
                    && ca == 1
                    && cb == 1,
                "each tenant must get its own charge",
            ),
        }
    }

    async fn new_key_same_body(&self) -> Row {
        let t = self.tenant("second_purchase");
        let first = self.pay(&t, "coffee-1", &body(350, "acct_cafe")).await;
        let second = self.pay(&t, "coffee-2", &body(350, "acct_cafe")).await;
        let (charges, _) = self.ledger(&t).await;
        Row {
            scenario: "new key, same body (2nd coffee)",
            requests: 2,
            statuses: statuses(&[first.clone(), second.clone()]),
            charges,
            verdict: check(
                first.status == 201 && second.status == 201 && charges == 2,
                "a new key is a new purchase",
            ),
        }
    }
}

#[tokio::main]
async fn main() {
    let tmp = tempfile::tempdir().expect("a temporary directory");
    // Unset or empty: a temporary SQLite file. A value that is not UTF-8
    // is refused, never taken for unset.
    let given = match std::env::var("DATABASE_URL") {
        Ok(url) => Some(url).filter(|u| !u.is_empty()),
        Err(std::env::VarError::NotPresent) => None,
        Err(std::env::VarError::NotUnicode(_)) => {
            eprintln!("demo: DATABASE_URL: its value is not UTF-8");
            std::process::exit(2);
        }
    };
    let store = match &given {
        None => "SQLite (temporary file)".to_owned(),
        Some(url) => payments::db::describe(url),
    };
    let database_url = given.unwrap_or_else(|| format!("sqlite://{}", tmp.path().join("demo.db").display()));
    let config = payments::config::Config {
        addr: "127.0.0.1:0".parse().expect("an address"),
        database_url,
        ttl: idem::DEFAULT_TTL,
        lock_timeout: idem::DEFAULT_LOCK_TIMEOUT,
        // Slow enough that concurrent duplicates meet the first one in flight.
        gateway_delay: Duration::from_millis(300),
        pause_after_charge: Duration::ZERO,
        pause_before_commit: Duration::ZERO,
        ledger_down_once: false,
        header_timeout: Duration::from_secs(10),
        body_timeout: Duration::from_secs(10),
    };
    let service = match payments::service::start(config).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("demo: {e}");
            std::process::exit(1);
        }
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a free port");
    let addr = listener.local_addr().expect("an address");
    // The janitor stays in `service` until the demo ends.
    let router = service.router;
    tokio::spawn(async move { axum::serve(listener, router).await });
    let run = format!(
        "{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or_default()
    );
    let demo = Demo { addr, run };
    println!("payments service on http://{addr}, store: {store}, gateway delay 300 ms\n");

    let rows = vec![
        demo.double_click().await,
        demo.response_lost().await,
        demo.different_amount().await,
        demo.comment_added().await,
        demo.declined_retried().await,
        demo.gateway_outage().await,
        demo.twenty_concurrent().await,
        demo.two_tenants().await,
        demo.new_key_same_body().await,
    ];

    println!(
        "{:<32} {:>8}  {:<28} {:>7}  verdict",
        "scenario", "requests", "statuses (r = replayed)", "charges"
    );
    println!("{}", "-".repeat(92));
    let mut failed = 0;
    for row in &rows {
        let verdict = match &row.verdict {
            Ok(()) => "ok".to_owned(),
            Err(why) => {
                failed += 1;
                format!("FAILED: {why}")
            }
        };
        println!(
            "{:<32} {:>8}  {:<28} {:>7}  {verdict}",
            row.scenario, row.requests, row.statuses, row.charges
        );
    }
    println!("\n{} passed, {} failed", rows.len() - failed, failed);
    if failed > 0 {
        std::process::exit(1);
    }
}
