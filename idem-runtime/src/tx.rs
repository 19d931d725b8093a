//! Same-transaction completion: a handler's own writes and the completion
//! of its record commit together, or not at all.

#[cfg(any(feature = "postgres", feature = "sqlite"))]
use crate::store::bounded;
use crate::{IdempotencyStore, RecordId, StoreError, StoredResponse};

/// A handler's open transaction, held until the runtime knows the outcome.
pub(crate) enum PendingTx {
    /// With the store's bound on one operation.
    #[cfg(feature = "postgres")]
    Pg(sqlx::Transaction<'static, sqlx::Postgres>, std::time::Duration),
    #[cfg(feature = "sqlite")]
    Sqlite(sqlx::Transaction<'static, sqlx::Sqlite>, std::time::Duration),
}

/// The connection of a handler's transaction, borrowed from its
/// [`Operation`](crate::Operation): use `&mut *conn` as a sqlx executor.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub type TxConnection<'a, C> = tokio::sync::MappedMutexGuard<'a, C>;

#[cfg(feature = "postgres")]
impl PendingTx {
    pub(crate) async fn begin_pg(store: &dyn IdempotencyStore) -> Result<Self, StoreError> {
        let pg = store.as_any().downcast_ref::<crate::PgStore>().ok_or_else(|| {
            StoreError::Backend("pg_transaction needs the layer's store to be a PgStore".into())
        })?;
        Ok(PendingTx::Pg(pg.begin_tx().await?, pg.timeout()))
    }

    pub(crate) fn pg(&mut self) -> Option<&mut sqlx::PgConnection> {
        match self {
            PendingTx::Pg(tx, _) => Some(&mut **tx),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }
}

#[cfg(feature = "sqlite")]
impl PendingTx {
    pub(crate) async fn begin_sqlite(store: &dyn IdempotencyStore) -> Result<Self, StoreError> {
        let lite = store
            .as_any()
            .downcast_ref::<crate::SqliteStore>()
            .ok_or_else(|| {
                StoreError::Backend("sqlite_transaction needs the layer's store to be a SqliteStore".into())
            })?;
        Ok(PendingTx::Sqlite(lite.begin_tx().await?, lite.timeout()))
    }

    pub(crate) fn sqlite(&mut self) -> Option<&mut sqlx::SqliteConnection> {
        match self {
            PendingTx::Sqlite(tx, _) => Some(&mut **tx),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }
}

/// Why a same-transaction completion failed.
#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
pub(crate) enum TxFailure {
    /// Nothing was committed: neither the handler's writes nor the completion.
    NotCommitted(StoreError),
    /// The commit itself failed: whether it took effect is unknown.
    Unknown(StoreError),
}

impl PendingTx {
    /// Writes the completion inside the transaction, then commits both.
    /// If the lock was lost, nothing commits.
    pub(crate) async fn complete(
        self,
        store: &dyn IdempotencyStore,
        id: &RecordId,
        token: &str,
        response: &StoredResponse,
    ) -> Result<(), TxFailure> {
        #[cfg(not(any(feature = "postgres", feature = "sqlite")))]
        let _ = (store, id, token, response);
        match self {
            #[cfg(feature = "postgres")]
            PendingTx::Pg(mut tx, _) => {
                let pg = store.as_any().downcast_ref::<crate::PgStore>().ok_or_else(|| {
                    TxFailure::NotCommitted(StoreError::Backend("the transaction's store changed".into()))
                })?;
                // Each step is bounded: past the timeout the completion did not
                // happen (the transaction rolls back when dropped), while a
                // commit that does not answer may have happened.
                bounded(pg.timeout(), pg.complete_with(&mut *tx, id, token, response))
                    .await
                    .map_err(TxFailure::NotCommitted)?;
                bounded(pg.timeout(), async {
                    tx.commit().await.map_err(crate::sql::map_err)
                })
                .await
                .map_err(TxFailure::Unknown)
            }
            #[cfg(feature = "sqlite")]
            PendingTx::Sqlite(mut tx, _) => {
                let lite = store
                    .as_any()
                    .downcast_ref::<crate::SqliteStore>()
                    .ok_or_else(|| {
                        TxFailure::NotCommitted(StoreError::Backend("the transaction's store changed".into()))
                    })?;
                bounded(lite.timeout(), lite.complete_with(&mut *tx, id, token, response))
                    .await
                    .map_err(TxFailure::NotCommitted)?;
                bounded(lite.timeout(), async {
                    tx.commit().await.map_err(crate::sql::map_err)
                })
                .await
                .map_err(TxFailure::Unknown)
            }
        }
    }

    /// Rolls the handler's writes back, within the store's timeout (past
    /// it the connection is dropped, which rolls back all the same).
    pub(crate) async fn rollback(self) {
        match self {
            #[cfg(feature = "postgres")]
            PendingTx::Pg(tx, limit) => {
                log_rollback(bounded(limit, async { tx.rollback().await.map_err(crate::sql::map_err) }).await)
            }
            #[cfg(feature = "sqlite")]
            PendingTx::Sqlite(tx, limit) => {
                log_rollback(bounded(limit, async { tx.rollback().await.map_err(crate::sql::map_err) }).await)
            }
        }
    }
}

#[cfg(any(feature = "postgres", feature = "sqlite"))]
fn log_rollback(result: Result<(), StoreError>) {
    if let Err(e) = result {
        // Dropping the connection rolls back all the same.
        tracing::warn!(error = %e, "rollback failed; the connection is discarded");
    }
}
