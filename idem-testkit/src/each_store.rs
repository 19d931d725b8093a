//! `for_each_store!`: one test per store and case, so that a suite states
//! its cases once and runs them on every store it names.

/// Writes one `#[tokio::test(flavor = "multi_thread", worker_threads = N)]`
/// per store and case: `<store>::<case>`.
///
/// - `stores`: some of `memory`, `sqlite`, `postgres`; each names a module
///   and a [`StoreKind`](crate::StoreKind).
/// - `setup: |kind| <expr>`: builds the case's argument, with `kind` bound
///   to the store's `StoreKind` (not a closure: the expression is written
///   into each test, and may `.await`). It gives an `Option`: `None` skips
///   the test (PostgreSQL without `DATABASE_URL`).
/// - `worker_threads`: the runtime's threads.
/// - `cases`: async fns of the invoking module, each taking what `setup`
///   built.
///
/// The modules import the invoking module (`use super::*`), so `setup` can
/// call its fns. Two invocations in one module would write the same
/// modules: put each in a module of its own. The tests are
/// `#[tokio::test]`s: the invoking crate needs tokio with `macros` and
/// `rt-multi-thread`.
///
/// ```
/// use idem_testkit::Fixture;
///
/// async fn starts_empty(f: Fixture) {
///     assert_eq!(f.store.purge_expired(100).await.unwrap(), 0);
/// }
///
/// async fn purges_twice(f: Fixture) {
///     f.store.purge_expired(100).await.unwrap();
///     assert_eq!(f.store.purge_expired(100).await.unwrap(), 0);
/// }
///
/// // memory::starts_empty, memory::purges_twice, sqlite::starts_empty,
/// // sqlite::purges_twice, postgres::starts_empty, postgres::purges_twice.
/// idem_testkit::for_each_store! {
///     stores: [memory, sqlite, postgres],
///     setup: |kind| kind.fixture().await,
///     worker_threads: 4,
///     cases: [starts_empty, purges_twice],
/// }
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! for_each_store {
    (
        stores: [$($store:ident),+ $(,)?],
        setup: |$kind:ident| $setup:expr,
        worker_threads: $threads:literal,
        cases: $cases:tt $(,)?
    ) => {
        $( $crate::for_each_store!(@store $store, |$kind| $setup, $threads, $cases); )+
    };
    (@store $store:ident, |$kind:ident| $setup:expr, $threads:literal, [$($case:ident),+ $(,)?]) => {
        mod $store {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = $threads)]
                async fn $case() {
                    let $kind = $crate::for_each_store!(@kind $store);
                    let Some(fixture) = $setup else { return };
                    super::$case(fixture).await;
                }
            )+
        }
    };
    (@kind memory) => { $crate::StoreKind::Memory };
    (@kind sqlite) => { $crate::StoreKind::Sqlite };
    (@kind postgres) => { $crate::StoreKind::Postgres };
}
