//! A reservation whose timeout fires in a poll that outlives the start of
//! its multi-thread runtime's shutdown. In a binary of its own: it watches
//! every panic of the process.

use idem::store::{RecordId, ReserveRequest};
use idem::IdempotencyStore;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

/// Tells when it is dropped.
struct OnDrop(mpsc::Sender<()>);

impl Drop for OnDrop {
    fn drop(&mut self) {
        let _ = self.0.send(());
    }
}

/// Its undo's spawn is refused (tokio drops the undo at once, and the
/// reservation's read with it), and no drop of idem's panics there; the
/// reservation is answered 503, as any past its bound.
#[test]
fn a_reservation_timing_out_as_its_runtime_shuts_down_is_answered_without_a_panic() {
    let panics = Arc::new(Mutex::new(Vec::<String>::new()));
    {
        let panics = panics.clone();
        std::panic::set_hook(Box::new(move |info| {
            panics.lock().unwrap().push(info.to_string())
        }));
    }
    let setup = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let store = setup.block_on(idem_testkit::sqlite_in_memory_store());
    let hasty = store.clone().with_timeout(Duration::from_millis(100));
    // In its context throughout: the connection below, dropped by a failing
    // assertion, gives itself back from a task of its own.
    let _context = setup.enter();
    // The one connection held: the reservation's read waits for it.
    let held = setup.block_on(store.pool().acquire()).unwrap();
    let doomed = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (polled_tx, polled_rx) = mpsc::channel();
    let (unblock_tx, unblock_rx) = mpsc::channel::<()>();
    let (answer_tx, answer_rx) = mpsc::channel();
    doomed.spawn(async move {
        let late = RecordId::new("t", "shutdown", "late");
        let request = ReserveRequest {
            id: &late,
            fingerprint: "F",
            token: "late-token",
            ttl: Duration::from_secs(3600),
            lock_timeout: Duration::from_secs(3600),
        };
        let mut reserve = hasty.reserve(request);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(reserve.as_mut().poll(&mut cx).is_pending());
        polled_tx.send(()).unwrap();
        // This worker stays busy until the shutdown has begun.
        unblock_rx.recv().unwrap();
        let answer = reserve.as_mut().poll(&mut cx);
        answer_tx.send(format!("{answer:?}")).unwrap();
    });
    polled_rx.recv().unwrap();
    // Once this 300 ms sleep has ended, so has the reservation's 100 ms bound.
    let (slept_tx, slept_rx) = mpsc::channel();
    doomed.spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        slept_tx.send(()).unwrap();
    });
    slept_rx.recv().unwrap();
    // Dropped by the shutdown, once the runtime no longer takes tasks
    // (polled or not: the signal is made before the task).
    let (closed_tx, closed_rx) = mpsc::channel();
    let signal = OnDrop(closed_tx);
    doomed.spawn(async move {
        let _signal = signal;
        std::future::pending::<()>().await
    });
    let shutting = std::thread::spawn(move || doomed.shutdown_timeout(Duration::from_secs(10)));
    closed_rx.recv().unwrap();
    unblock_tx.send(()).unwrap();
    let answer = answer_rx
        .recv()
        .expect("the reservation's task ended without an answer");
    shutting.join().unwrap();
    setup.block_on(async move { drop(held) });
    let _ = std::panic::take_hook();
    let panics = panics.lock().unwrap().clone();
    assert!(panics.is_empty(), "{panics:?}");
    assert!(answer.contains("Unavailable"), "{answer}");
}
