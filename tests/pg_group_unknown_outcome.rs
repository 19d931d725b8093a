//! PostgreSQL: a reservation waiting in a lookup group whose caller is
//! gone before the group answers, when the group's statement committed but
//! its answer never arrived (the connection cut after the commit: an
//! outcome not known). The group's task hands its key back, fenced by its
//! token, as it does for one whose caller is gone after an answer: no lock
//! is left that nobody holds.
//!
//! The ordering: pause points (the two lookup turns), the queue's counter,
//! a TCP proxy between the store and PostgreSQL that holds the server's
//! replies to the group's statement and then cuts the connections, and the
//! row seen committed from a direct connection.

use idem::store::{RecordId, Reservation, ReserveRequest, StoredResponse};
use idem::{IdempotencyStore, StoreError};
use idem_testkit::records::{pg_table, req, take};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const LONG: Duration = Duration::from_secs(3600);

fn response(tag: &str) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), "application/json".into())],
        body: Some(format!("{{\"id\":\"{tag}\"}}").into_bytes()),
    }
}

struct Proxy {
    port: u16,
    frozen: Arc<AtomicBool>,
    kill: tokio::sync::watch::Sender<u64>,
}

async fn proxy() -> Proxy {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let frozen = Arc::new(AtomicBool::new(false));
    let (kill, _) = tokio::sync::watch::channel(0_u64);
    let (f, k) = (frozen.clone(), kill.clone());
    tokio::spawn(async move {
        loop {
            let Ok((client, _)) = listener.accept().await else {
                return;
            };
            let Ok(server) = tokio::net::TcpStream::connect("127.0.0.1:5432").await else {
                continue;
            };
            let mut killed = k.subscribe();
            let frozen = f.clone();
            tokio::spawn(async move {
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                // Held on this connection only: from the execution of a
                // group's statement (the chunk after its text was parsed).
                let here = Arc::new(AtomicBool::new(false));
                let up = {
                    let (here, frozen) = (here.clone(), frozen.clone());
                    async move {
                        let mut buf = vec![0_u8; 65536];
                        let mut parsed = false;
                        loop {
                            let n = match cr.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => n,
                            };
                            let chunk = &buf[..n];
                            if parsed && frozen.load(Ordering::SeqCst) {
                                here.store(true, Ordering::SeqCst);
                            }
                            if chunk.windows(10).any(|w| w == b"idem-group") {
                                parsed = true;
                            }
                            if sw.write_all(chunk).await.is_err() {
                                return;
                            }
                        }
                    }
                };
                let frozen = here;
                let down = async {
                    let mut buf = vec![0_u8; 16384];
                    loop {
                        let n = match sr.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        while frozen.load(Ordering::SeqCst) {
                            tokio::time::sleep(Duration::from_millis(1)).await;
                        }
                        if cw.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                };
                tokio::select! {
                    () = up => {}
                    () = down => {}
                    _ = killed.changed() => {}
                }
            });
        }
    });
    Proxy { port, frozen, kill }
}

fn reserve_in_task(
    store: &idem::PgStore,
    id: &RecordId,
) -> tokio::task::JoinHandle<Result<Reservation, StoreError>> {
    let (store, id) = (store.clone(), id.clone());
    tokio::spawn(async move { store.reserve(req(&id, "fp", LONG, LONG)).await })
}

async fn until_lookups_waiting(store: &idem::PgStore, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.waiting_lookups() != n {
        assert!(Instant::now() < deadline, "{n} lookups never waited");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

async fn token_of(direct: &sqlx::PgPool, table: &str, id: &RecordId) -> Option<Option<String>> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT lock_token FROM {table} WHERE tenant = $1 AND scope = $2 AND key = $3"
    )))
    .bind(&id.tenant)
    .bind(&id.scope)
    .bind(&id.key)
    .fetch_optional(direct)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_group_member_gone_before_an_unknown_outcome_has_its_key_handed_back() {
    let url = idem_testkit::pg_url().expect("DATABASE_URL");
    let schema = idem_testkit::pg_schema(&url).await;
    let proxy = proxy().await;
    let via_proxy = {
        let (head, tail) = url.rsplit_once('/').unwrap();
        let host = head.rsplit_once('@').map_or("postgres://", |(u, _)| u);
        format!("{host}@127.0.0.1:{}/{tail}", proxy.port)
    };
    let store = idem_testkit::pg_store_in(&via_proxy, &schema, 8)
        .await
        .with_replay_cache(Duration::ZERO);
    let direct = sqlx::PgPool::connect(&url).await.unwrap();
    let table = pg_table(&store);

    // Both lookup turns held (replays of completed records, paused at
    // their turn): what comes next queues.
    let mut pauses = Vec::new();
    let mut turns = Vec::new();
    for k in ["turn-1", "turn-2"] {
        let id = RecordId::new("t", "turns", idem_testkit::unique(k));
        let lease = take(&store, &id, "fp", LONG, LONG).await;
        store.complete(&id, &lease.token, &response(k)).await.unwrap();
        let mut pause = idem_runtime::pause::arm(idem_runtime::pause::RESERVE_TURN, &id.key);
        turns.push(reserve_in_task(&store, &id));
        tokio::time::timeout(Duration::from_secs(10), pause.reached())
            .await
            .expect("the lookup never took a turn");
        pauses.push(pause);
    }

    let a = RecordId::new("t", "gone", idem_testkit::unique("a"));
    let b = RecordId::new("t", "gone", idem_testkit::unique("b"));
    let tok_a = idem_testkit::token();
    let mut fut_a = store.reserve(ReserveRequest {
        id: &a,
        fingerprint: "fp",
        token: tok_a,
        ttl: LONG,
        lock_timeout: LONG,
    });
    let waker = futures_util::task::noop_waker();
    let mut cx = std::task::Context::from_waker(&waker);
    assert!(std::future::Future::poll(fut_a.as_mut(), &mut cx).is_pending());
    until_lookups_waiting(&store, 1).await;
    let b_task = reserve_in_task(&store, &b);
    until_lookups_waiting(&store, 2).await;

    // The server's replies held from here on; the first turn goes on, and
    // the group [a, b] is sent.
    proxy.frozen.store(true, Ordering::SeqCst);
    let mut pauses = pauses.into_iter();
    pauses.next().unwrap().resume();
    // The group's statement committed: a's key is taken under its token.
    let deadline = Instant::now() + Duration::from_secs(10);
    while token_of(&direct, &table, &a).await != Some(Some(tok_a.to_owned())) {
        assert!(Instant::now() < deadline, "the group never took a's key");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // a's caller leaves before the group's answer arrives.
    drop(fut_a);
    // The answer never arrives: the connections are cut.
    proxy.frozen.store(false, Ordering::SeqCst);
    proxy.kill.send_modify(|g| *g += 1);
    let b_out = tokio::time::timeout(Duration::from_secs(20), b_task)
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(&b_out, Err(e) if e.is_unavailable()),
        "b, still there, is told the outcome is not known: {b_out:?}"
    );
    pauses.next().unwrap().resume();
    for t in turns {
        let _ = tokio::time::timeout(Duration::from_secs(20), t).await;
    }
    // The group's task has answered everyone; its hand-back of a's key is
    // bounded by the store's timeout.
    let deadline = Instant::now() + Duration::from_secs(12);
    let mut still = token_of(&direct, &table, &a).await;
    while still == Some(Some(tok_a.to_owned())) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        still = token_of(&direct, &table, &a).await;
    }
    let retry = store.reserve(req(&a, "fp", LONG, LONG)).await;
    assert!(
        still != Some(Some(tok_a.to_owned())),
        "a's key stays locked (lock timeout: an hour) under the token of a reservation that is gone; retry: {retry:?}"
    );
    assert!(matches!(retry, Ok(Reservation::Reserved(_))), "{retry:?}");
}
