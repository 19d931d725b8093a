//! The store's clock decides, whatever this process's wall clock says. The
//! test runs `skewed` again in a child process whose wall clock is a day
//! ahead of the database's, then a day behind (libfaketime; the monotonic
//! clock, which idem counts durations by, is left as it is), against the
//! same PostgreSQL: every TTL, lock deadline and purge still follows the
//! database's clock. A server whose clock disagrees with the database's
//! (clock skew) then answers as one whose clock agrees.
//!
//! Needs libfaketime (`apt-get install faketime`): skipped with a line
//! without it, unless `IDEM_REQUIRE_FAKETIME=1` (CI), which fails instead.

use idem::store::{RecordId, Reservation, ReserveRequest, StoredResponse};
use idem::{IdempotencyStore, PgStore};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The build of libfaketime for programs with threads, where Debian puts
/// it for this machine's architecture.
fn libfaketime() -> Option<std::path::PathBuf> {
    std::fs::read_dir("/usr/lib")
        .ok()?
        .flatten()
        .map(|dir| dir.path().join("faketime/libfaketimeMT.so.1"))
        .find(|lib| lib.exists())
}
const LONG: Duration = Duration::from_secs(3600);
const SHORT: Duration = Duration::from_secs(1);

#[tokio::test]
async fn the_database_clock_decides_whatever_this_process_clock_says() {
    let Some(url) = idem_testkit::pg_url() else { return };
    let Some(lib) = libfaketime() else {
        assert_ne!(
            std::env::var("IDEM_REQUIRE_FAKETIME").as_deref(),
            Ok("1"),
            "IDEM_REQUIRE_FAKETIME=1 but /usr/lib/*/faketime/libfaketimeMT.so.1 is missing: \
             apt-get install faketime"
        );
        eprintln!("skipped: install faketime (apt-get install faketime) to run the clock-skew test");
        return;
    };
    for shift in ["+25h", "-25h"] {
        // Made here, on the true clock: the schemas of the tests' runs are
        // named after it, and old ones dropped by it.
        let schema = idem_testkit::pg_schema(&url).await;
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "skewed", "--ignored", "--nocapture"])
            .env("LD_PRELOAD", &lib)
            .env("FAKETIME", shift)
            .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
            .env("IDEM_SKEW", shift)
            .env("IDEM_SKEW_SCHEMA", &schema)
            .output()
            .unwrap();
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success() && said.contains("1 passed"),
            "a wall clock {shift} off the database's:\n{said}"
        );
    }
}

#[tokio::test]
#[ignore = "run by `the_database_clock_decides_whatever_this_process_clock_says`, under a shifted clock"]
async fn skewed() {
    let shift = std::env::var("IDEM_SKEW").expect("run by the test above");
    let schema = std::env::var("IDEM_SKEW_SCHEMA").expect("run by the test above");
    let url = idem_testkit::pg_url().expect("DATABASE_URL");
    let store = idem_testkit::pg_store_in(&url, &schema, 4)
        .await
        .with_replay_cache(Duration::ZERO);
    // The shift is in effect: this process's wall clock is a day off the
    // database's, on the side asked for.
    let database: f64 = sqlx::query_scalar("SELECT extract(epoch FROM now())::float8")
        .fetch_one(store.pool())
        .await
        .unwrap();
    let here = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let ahead = here - database;
    match shift.as_str() {
        "+25h" => assert!(ahead > 24.0 * 3600.0, "{ahead} s"),
        _ => assert!(ahead < -24.0 * 3600.0, "{ahead} s"),
    }

    let id = |key: &str| RecordId::new("t", "clock.skew", key);
    let (kept, running, stale, expired, purged) = (
        id("kept"),
        id("running"),
        id("stale"),
        id("expired"),
        id("purged"),
    );
    // A day's TTL ahead: kept. A lock of an hour: held.
    let lease = take(&store, &kept, "fp", LONG, LONG).await;
    store.complete(&kept, &lease.token, &answer()).await.unwrap();
    take(&store, &running, "fp", LONG, LONG).await;
    kept_and_running(&store, &kept, &running).await;
    // A lock of a second, and TTLs of a second, each checked right after
    // it is set (a stalled second would pass them): past them in 1.2 s.
    take(&store, &stale, "fp", LONG, SHORT).await;
    assert!(matches!(
        reserve(&store, &stale, "fp", LONG, LONG).await,
        Reservation::InProgress { .. }
    ));
    let lease = take(&store, &expired, "fp", SHORT, LONG).await;
    store.complete(&expired, &lease.token, &answer()).await.unwrap();
    assert_eq!(
        reserve(&store, &expired, "other", LONG, LONG).await,
        Reservation::Mismatch
    );
    let lease = take(&store, &purged, "fp", SHORT, LONG).await;
    store.complete(&purged, &lease.token, &answer()).await.unwrap();

    tokio::time::sleep(Duration::from_millis(1200)).await;

    // Past its lock deadline by the database's clock: taken over.
    let taken = take(&store, &stale, "fp", LONG, LONG).await;
    assert_eq!((taken.attempt, taken.is_takeover()), (2, true));
    // Past its TTL: absent, so another body may use the key.
    let fresh = take(&store, &expired, "other", LONG, LONG).await;
    assert_eq!(fresh.attempt, 1);
    // The janitor deletes what the database's clock says is gone, and only that.
    assert_eq!(store.purge_expired(100).await.unwrap(), 1);
    kept_and_running(&store, &kept, &running).await;
    let gone: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM \"{schema}\".idempotency_keys WHERE key = $1"
    )))
    .bind(&purged.key)
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(gone, 0);
}

/// A day's TTL ahead, `kept` is replayed; a lock of an hour ahead,
/// `running` is in progress.
async fn kept_and_running(store: &PgStore, kept: &RecordId, running: &RecordId) {
    assert_eq!(
        reserve(store, kept, "fp", LONG, LONG).await,
        Reservation::Completed(answer())
    );
    assert!(matches!(
        reserve(store, running, "fp", LONG, LONG).await,
        Reservation::InProgress { .. }
    ));
}

async fn reserve(store: &PgStore, id: &RecordId, fp: &str, ttl: Duration, lock: Duration) -> Reservation {
    let request = ReserveRequest {
        id,
        fingerprint: fp,
        token: idem_testkit::token(),
        ttl,
        lock_timeout: lock,
    };
    store.reserve(request).await.expect("reserve")
}

async fn take(store: &PgStore, id: &RecordId, fp: &str, ttl: Duration, lock: Duration) -> idem::store::Lease {
    match reserve(store, id, fp, ttl, lock).await {
        Reservation::Reserved(lease) => lease,
        other => panic!("expected a reservation of {}, got {other:?}", id.key),
    }
}

fn answer() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), "application/json".into())],
        body: Some(b"{\"id\":\"pay_1\"}".to_vec()),
    }
}
