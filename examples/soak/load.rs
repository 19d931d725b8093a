//! The load: which operations run, and how each is sent: retried 1 to 5
//! times with its key, some retries concurrent, some after a pause, some
//! abandoned mid-flight, and some keys reused with another amount.

use crate::client::{self, Answer, Sent};
use crate::Args;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What an operation's handler does, by its recipient.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Charged once: 201, replayed byte for byte.
    Pays,
    /// `acct_declined`: 402, stored and replayed; never charged.
    Declined,
    /// `acct_unavailable`: the gateway is down, 503, released; never charged.
    GatewayDown,
    /// `acct_panic`: the handler panics, 500, released; never charged.
    Panics,
}

/// One operation: a tenant, a key, a body, and how it is sent.
#[derive(Clone, Debug)]
pub(crate) struct Op {
    pub(crate) tenant: String,
    pub(crate) key: String,
    /// Unique within the tenant: (tenant, amount) names the operation in
    /// the ledger.
    pub(crate) amount: i64,
    pub(crate) kind: Kind,
    pub(crate) attempts: u32,
    /// After a final answer, the key is sent again with another amount,
    /// recipient or currency (by the operation's number).
    pub(crate) reuse_key: bool,
    /// The operation's number.
    pub(crate) index: usize,
    pub(crate) seed: u64,
}

impl Op {
    pub(crate) fn recipient(&self) -> &'static str {
        match self.kind {
            Kind::Pays => "acct_shop",
            Kind::Declined => "acct_declined",
            Kind::GatewayDown => "acct_unavailable",
            Kind::Panics => "acct_panic",
        }
    }

    pub(crate) fn body(&self) -> String {
        let (amount, recipient) = (self.amount, self.recipient());
        format!(r#"{{"amount":{amount},"currency":"EUR","recipient":"{recipient}"}}"#)
    }

    /// The body a reused key is sent with: another amount (never another
    /// operation's), recipient or currency, in turn.
    pub(crate) fn other_body(&self) -> String {
        let (amount, recipient) = (self.amount, self.recipient());
        match self.index % 3 {
            0 => format!(
                r#"{{"amount":{},"currency":"EUR","recipient":"{recipient}"}}"#,
                amount + 1_000_000
            ),
            1 => format!(r#"{{"amount":{amount},"currency":"EUR","recipient":"acct_elsewhere"}}"#),
            _ => format!(r#"{{"amount":{amount},"currency":"USD","recipient":"{recipient}"}}"#),
        }
    }

    /// Whether `a` is this operation's final answer (as opposed to a 409, a
    /// 503 of the store, or a broken connection, which ask for a retry).
    pub(crate) fn is_final(&self, a: &Answer) -> bool {
        match self.kind {
            Kind::Pays => a.status == 201,
            Kind::Declined => a.status == 402,
            Kind::GatewayDown => a.status == 503 && a.problem() == "gateway-unavailable",
            Kind::Panics => a.status == 500 && a.problem() == "handler-failed",
        }
    }
}

/// What one operation's requests got.
#[derive(Clone, Debug, Default)]
pub(crate) struct Log {
    pub(crate) started: bool,
    pub(crate) answers: Vec<Answer>,
    pub(crate) abandoned: u32,
    pub(crate) broken: Vec<String>,
    /// The answers to the reused key with another amount.
    pub(crate) reused: Vec<Answer>,
    /// Requests sent in the settling phase after the load.
    pub(crate) settled_with: u32,
}

/// A small deterministic generator (xorshift64*), so a seed replays a run.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    pub(crate) fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// The run's operations.
pub(crate) fn plan(args: &Args, run_id: &str) -> Arc<Vec<Op>> {
    let mut rng = Rng::new(args.seed);
    let ops = (0..args.ops)
        .map(|i| {
            let kind = match rng.below(100) {
                0..=77 => Kind::Pays,
                78..=87 => Kind::Declined,
                88..=95 => Kind::GatewayDown,
                _ => Kind::Panics,
            };
            Op {
                tenant: format!("{run_id}_t{}", i % args.tenants),
                // Two operations of two tenants share each key: one tenant
                // must never get the other's answer nor be blocked by it.
                key: format!("{run_id}-op-{}", i / 2),
                index: i,
                amount: (i / args.tenants) as i64 + 1,
                kind,
                attempts: 1 + rng.below(5) as u32,
                reuse_key: rng.chance(15),
                seed: rng.next(),
            }
        })
        .collect();
    Arc::new(ops)
}

/// Runs the plan with `clients` concurrent clients; no operation starts
/// after `seconds`.
pub(crate) async fn run(
    plan: Arc<Vec<Op>>,
    addrs: Vec<SocketAddr>,
    clients: usize,
    seconds: u64,
) -> Vec<Log> {
    let next = Arc::new(AtomicUsize::new(0));
    let logs = Arc::new(Mutex::new(vec![Log::default(); plan.len()]));
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let workers: Vec<_> = (0..clients)
        .map(|_| {
            let (plan, addrs, next, logs) = (plan.clone(), addrs.clone(), next.clone(), logs.clone());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= plan.len() || Instant::now() >= deadline {
                        return;
                    }
                    let log = send(&plan[i], &addrs).await;
                    logs.lock().unwrap()[i] = log;
                }
            })
        })
        .collect();
    for w in workers {
        let _ = w.await;
    }
    let logs = logs.lock().unwrap().clone();
    logs
}

fn record(log: &mut Log, sent: Sent) {
    match sent {
        Sent::Answered(a) => log.answers.push(a),
        Sent::Abandoned => log.abandoned += 1,
        Sent::Broken(e) => log.broken.push(e),
    }
}

/// Sends one operation as a client that retries would.
async fn send(op: &Op, addrs: &[SocketAddr]) -> Log {
    let mut rng = Rng::new(op.seed);
    let mut log = Log {
        started: true,
        ..Log::default()
    };
    let body = op.body();
    for _ in 0..op.attempts {
        if rng.chance(30) {
            tokio::time::sleep(Duration::from_millis(rng.below(200))).await;
        }
        let at = rng.below(addrs.len() as u64) as usize;
        let addr = addrs[at];
        let abandon = rng.chance(10).then(|| Duration::from_millis(rng.below(30)));
        if rng.chance(20) {
            // Two copies at once, one on each service: the race between
            // processes, which one process's lock could not settle.
            let other = addrs[(at + 1) % addrs.len()];
            let (a, b) = tokio::join!(
                client::pay(addr, &op.tenant, &op.key, &body, abandon),
                client::pay(other, &op.tenant, &op.key, &body, None)
            );
            record(&mut log, a);
            record(&mut log, b);
        } else {
            record(
                &mut log,
                client::pay(addr, &op.tenant, &op.key, &body, abandon).await,
            );
        }
    }
    if op.reuse_key && log.answers.iter().any(|a| op.is_final(a)) {
        reuse(op, addrs, &mut log).await;
    }
    log
}

/// The key again with another amount, until an answer that is not a retry
/// signal (at most 5 tries).
async fn reuse(op: &Op, addrs: &[SocketAddr], log: &mut Log) {
    let body = op.other_body();
    for i in 0..5 {
        match client::pay(addrs[i % addrs.len()], &op.tenant, &op.key, &body, None).await {
            Sent::Answered(a) => {
                let retry = a.status == 409 || a.status == 503;
                log.reused.push(a);
                if !retry {
                    return;
                }
            }
            Sent::Abandoned | Sent::Broken(_) => {}
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// After the load and the faults: every started operation without a final
/// answer is retried (at most 60 times, 250 ms apart) until it has one, a
/// released one (the gateway outage) is sent once more in any case, and a
/// reused key without a conclusive answer is tried again.
pub(crate) async fn settle(plan: &[Op], logs: &mut [Log], addrs: &[SocketAddr]) {
    for (op, log) in plan.iter().zip(logs.iter_mut()) {
        if !log.started {
            continue;
        }
        let body = op.body();
        // A released operation (the gateway outage) runs again on every
        // retry, so its last execution may have died mid-way during the
        // fault, holding part of the balance; a client retries a 503 until
        // the outage ends, and so does this: one more answer, after the
        // faults, whatever came before.
        let mut settled_once = op.kind != Kind::GatewayDown;
        let mut tries = 0;
        while (!settled_once || !log.answers.iter().any(|a| op.is_final(a))) && tries < 60 {
            settled_once = true;
            tries += 1;
            log.settled_with += 1;
            let sent = client::pay(addrs[tries % addrs.len()], &op.tenant, &op.key, &body, None).await;
            record(log, sent);
            if !log.answers.iter().any(|a| op.is_final(a)) {
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
        let conclusive = log
            .reused
            .last()
            .is_some_and(|a| a.status != 409 && a.status != 503);
        if op.reuse_key && !conclusive && log.answers.iter().any(|a| op.is_final(a)) {
            reuse(op, addrs, log).await;
        }
    }
}
