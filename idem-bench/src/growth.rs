//! The memory store growing past a million records: the slowest
//! reservation while its maps grow, against the same writes into one
//! locked `HashMap` (how the store kept its records before it was sharded).

use idem::store::{RecordId, Reservation, ReserveRequest, StoredResponse};
use idem::IdempotencyStore;
use std::sync::Arc;
use std::time::{Duration, Instant};

const LONG: Duration = Duration::from_secs(3600);

async fn reserve(store: &dyn IdempotencyStore, id: &RecordId) -> Reservation {
    let token = format!("{}-token", id.key);
    let req = ReserveRequest {
        id,
        fingerprint: "fp",
        token: &token,
        ttl: LONG,
        lock_timeout: LONG,
    };
    store.reserve(req).await.expect("reserve")
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// The memory store growing to `records` records from 8 concurrent writers:
/// the slowest reservation and the 99th percentile, against the same writes
/// into one `HashMap` behind one lock (how the store kept its records
/// before it was sharded), and the machine's floor (as much memory put in
/// place with no map and no shared lock), measured back to back; and the
/// resident memory the store holds once grown.
pub(crate) async fn memory_growth(records: usize) {
    const WRITERS: usize = 8;
    async fn grow<F, Fut>(records: usize, write: F) -> (Duration, Duration, Duration)
    where
        F: Fn(usize) -> Fut + Clone + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        let started = Instant::now();
        let tasks: Vec<_> = (0..WRITERS)
            .map(|w| {
                let write = write.clone();
                tokio::spawn(async move {
                    let mut times = Vec::with_capacity(records / WRITERS);
                    for i in (w..records).step_by(WRITERS) {
                        let t = Instant::now();
                        write(i).await;
                        times.push(t.elapsed());
                    }
                    times
                })
            })
            .collect();
        let mut times = Vec::with_capacity(records);
        for t in tasks {
            times.extend(t.await.expect("writer"));
        }
        times.sort();
        let p99 = times[times.len() * 99 / 100];
        (started.elapsed(), p99, *times.last().expect("a time"))
    }
    let body = vec![b'x'; 200];
    crate::reset_peak_rss();
    let before_kb = crate::peak_rss_kb();
    let store = Arc::new(idem::MemoryStore::new());
    let sharded = {
        let (store, body) = (store.clone(), body.clone());
        grow(records, move |i| {
            let (store, body) = (store.clone(), body.clone());
            async move {
                let id = RecordId::new("bench", "bench.grow", format!("k-{i}"));
                let Reservation::Reserved(l) = reserve(&*store, &id).await else {
                    panic!("not reserved")
                };
                let answer = StoredResponse {
                    status: 201,
                    headers: vec![],
                    body: Some(body),
                };
                store.complete(&id, &l.token, &answer).await.expect("complete");
            }
        })
        .await
    };
    // What the store holds, its records' 200-byte bodies included (and the
    // writers' 16 bytes of timing per record).
    let held_kb = crate::peak_rss_kb().saturating_sub(before_kb);
    drop(store);
    let one_lock: Arc<std::sync::Mutex<std::collections::HashMap<RecordId, Vec<u8>>>> = Arc::default();
    let single = grow(records, move |i| {
        let (map, body) = (one_lock.clone(), body.clone());
        async move {
            let id = RecordId::new("bench", "bench.grow", format!("k-{i}"));
            map.lock().expect("lock").insert(id, body);
        }
    })
    .await;
    // The machine's floor: the same writers putting as much memory in
    // place (the id, a 1 kB record), each into a list of its own made large
    // enough up front, with no lock and no map. What stalls this (the
    // memory's first touch, a writer descheduled) is the machine's.
    type List = std::sync::Mutex<Vec<(RecordId, Vec<u8>)>>;
    let lists: Arc<Vec<List>> = Arc::new(
        (0..WRITERS)
            .map(|_| std::sync::Mutex::new(Vec::with_capacity(records / WRITERS + 1)))
            .collect(),
    );
    let floor = grow(records, move |i| {
        let lists = lists.clone();
        async move {
            let id = RecordId::new("bench", "bench.grow", format!("k-{i}"));
            lists[i % WRITERS]
                .lock()
                .expect("lock")
                .push((id, vec![b'x'; 1024]));
        }
    })
    .await;
    println!(
        "\n{:<44} {:>10} {:>10} {:>10}",
        format!("growing to {records} records, {WRITERS} writers"),
        "total",
        "p99",
        "max"
    );
    for (name, (total, p99, max)) in [
        ("MemoryStore (256 shards): reserve + complete", sharded),
        ("baseline: insert into one locked HashMap", single),
        ("floor: the same memory, no map, no shared lock", floor),
    ] {
        println!(
            "{name:<44} {:>9.2}s {:>8.1}us {:>8.2}ms",
            total.as_secs_f64(),
            us(p99),
            max.as_secs_f64() * 1000.0
        );
    }
    println!(
        "MemoryStore resident with its {records} records: {:.0} MiB, {:.0} bytes a record \
         (its 200-byte body and 16 bytes of timing included)",
        held_kb as f64 / 1024.0,
        held_kb as f64 * 1024.0 / records as f64
    );
}
