//! Named pause points in the record protocol, so that a test can stop one
//! execution at a chosen step and run another against it: a race written on
//! purpose instead of hoped for. Compiled in only with the `pause-points`
//! feature, which idem's own tests enable; in every other build a pause
//! point is nothing at all.
//!
//! A point is armed for one record key (tests use unique keys, so they do
//! not disturb each other); the purge, which has no key, hits its point
//! with its table's quoted name (`"schema"."table"` on PostgreSQL,
//! `"table"` on SQLite, the empty string in memory). The first execution to reach an armed point stops
//! there until the test resumes it (or drops the handle).
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! use idem_runtime::pause;
//! let mut armed = pause::arm(pause::RESERVE_AFTER, "key-1");
//! let run = tokio::spawn(pause::hit(pause::RESERVE_AFTER, "key-1"));
//! armed.reached().await;
//! armed.resume();
//! run.await.unwrap();
//! # }
//! ```
// Test support: a misuse by a test fails loudly.
#![allow(clippy::expect_used)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use tokio::sync::oneshot;

/// A reservation whose statements have committed, before it returns.
pub const RESERVE_AFTER: &str = "reserve.after";
/// SQLite: the reservation read the record and is about to take the write lock.
pub const SQLITE_RESERVE_AFTER_PEEK: &str = "sqlite.reserve.after_peek";
/// SQLite: the reservation's upsert ran; its transaction (holding the write
/// lock) is not committed yet.
pub const SQLITE_RESERVE_BEFORE_COMMIT: &str = "sqlite.reserve.before_commit";
/// A SQLite group's leader, or a reservation's read, found no idle
/// connection, before it asks the pool for one (keyed by the table's name as written in SQL, quoted).
pub const SQLITE_GROUP_WAITS_FOR_A_CONNECTION: &str = "sqlite.group.waits_for_a_connection";
/// PostgreSQL: a reservation took one of the store's turns to look up,
/// before its statement: once every turn is taken, the reservations that
/// come meanwhile queue for the next group.
pub const RESERVE_TURN: &str = "reserve.turn";
/// A completion committed, before it returns.
pub const COMPLETE_AFTER: &str = "complete.after";
/// A completion in the handler's transaction is written; the commit has
/// not started.
pub const TX_BEFORE_COMMIT: &str = "tx.before_commit";
/// PostgreSQL: a completion took one of the store's turns to write, before
/// its statement: once every turn is taken, the completions that come
/// meanwhile queue for the next group.
pub const COMPLETE_TURN: &str = "complete.turn";
/// A release committed, before it returns.
pub const RELEASE_AFTER: &str = "release.after";
/// A rejection committed, before it returns.
pub const REJECT_AFTER: &str = "reject.after";
/// SQL stores: a hand-back of a key a reservation may have taken ran,
/// whatever it found (fenced out, or the key given back), before it returns.
pub const HAND_BACK_AFTER: &str = "hand_back.after";
/// A checkpoint committed, before it returns.
pub const CHECKPOINT_AFTER: &str = "checkpoint.after";
/// A lock extension committed, before it returns.
pub const EXTEND_AFTER: &str = "extend.after";
/// A purge batch committed, before it returns (keyed by the table's name).
pub const PURGE_AFTER: &str = "purge.after";
/// The handler returned; its answer is not classified or recorded yet.
pub const HANDLER_RETURNED: &str = "handler.returned";

struct Armed {
    point: &'static str,
    key: String,
    reached: oneshot::Sender<()>,
    resume: oneshot::Receiver<()>,
}

static ARMED: Mutex<Vec<Armed>> = Mutex::new(Vec::new());
/// Whether any point was ever armed: until then a hit costs one load.
static EVER_ARMED: AtomicBool = AtomicBool::new(false);

/// A test's hold on an armed pause point.
#[derive(Debug)]
pub struct Pause {
    reached: Option<oneshot::Receiver<()>>,
    resume: Option<oneshot::Sender<()>>,
}

/// Arms `point` for the record `key`: the next execution that reaches it
/// stops until [`Pause::resume`] (or until the handle is dropped).
pub fn arm(point: &'static str, key: &str) -> Pause {
    EVER_ARMED.store(true, Ordering::SeqCst);
    let (reached_tx, reached_rx) = oneshot::channel();
    let (resume_tx, resume_rx) = oneshot::channel();
    lock().push(Armed {
        point,
        key: key.to_owned(),
        reached: reached_tx,
        resume: resume_rx,
    });
    Pause {
        reached: Some(reached_rx),
        resume: Some(resume_tx),
    }
}

impl Pause {
    /// Waits until an execution stopped at the point.
    ///
    /// # Panics
    ///
    /// When called twice, or when the point was disarmed unreached.
    pub async fn reached(&mut self) {
        let reached = self.reached.take().expect("`reached` waits once");
        reached
            .await
            .expect("the pause point was disarmed before it was reached");
    }

    /// Whether an execution stopped at the point, without waiting.
    pub fn is_reached(&mut self) -> bool {
        match self.reached.as_mut().map(|r| r.try_recv()) {
            Some(Ok(())) => {
                self.reached = None;
                true
            }
            None => true,
            Some(Err(_)) => false,
        }
    }

    /// Lets the stopped execution go on.
    pub fn resume(mut self) {
        if let Some(resume) = self.resume.take() {
            let _ = resume.send(());
        }
    }
}

impl Drop for Pause {
    fn drop(&mut self) {
        // Dropping a handle never leaves an execution stopped; an unreached
        // point is disarmed.
        if let Some(resume) = self.resume.take() {
            let _ = resume.send(());
        }
        drop(self.reached.take());
        lock().retain(|a| !a.reached.is_closed());
    }
}

fn lock() -> std::sync::MutexGuard<'static, Vec<Armed>> {
    ARMED.lock().unwrap_or_else(|e| e.into_inner())
}

/// Stops here if a test armed `point` for `key`.
pub async fn hit(point: &'static str, key: &str) {
    if !EVER_ARMED.load(Ordering::SeqCst) {
        return;
    }
    let armed = {
        let mut all = lock();
        let at = all.iter().position(|a| a.point == point && a.key == key);
        at.map(|i| all.swap_remove(i))
    };
    if let Some(armed) = armed {
        let _ = armed.reached.send(());
        let _ = armed.resume.await;
    }
}
