//! Same-transaction completion: a handler's own writes and the completion
//! of its record commit together, or not at all.

use crate::{IdempotencyStore, RecordId, StoreError, StoredResponse};

/// A handler's open transaction, held until the runtime knows the outcome.
pub(crate) enum PendingTx {
    #[cfg(feature = "postgres")]
    Pg(sqlx::Transaction<'static, sqlx::Postgres>),
    #[cfg(feature = "sqlite")]
    Sqlite(sqlx::Transaction<'static, sqlx::Sqlite>),
}

/// The connection of a handler's transaction, borrowed from its
/// [`Operation`](crate::Operation): use `&mut *conn` as a sqlx executor.
pub type TxConnection<'a, C> = tokio::sync::MappedMutexGuard<'a, C>;

/// Why a same-transaction completion failed.
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
            PendingTx::Pg(mut tx) => {
                let pg = store.as_any().downcast_ref::<crate::PgStore>().ok_or_else(|| {
                    TxFailure::NotCommitted(StoreError::Backend("the transaction's store changed".into()))
                })?;
                pg.complete_with(&mut *tx, id, token, response)
                    .await
                    .map_err(TxFailure::NotCommitted)?;
                tx.commit()
                    .await
                    .map_err(|e| TxFailure::Unknown(crate::sql::map_err(e)))
            }
            #[cfg(feature = "sqlite")]
            PendingTx::Sqlite(mut tx) => {
                let lite = store
                    .as_any()
                    .downcast_ref::<crate::SqliteStore>()
                    .ok_or_else(|| {
                        TxFailure::NotCommitted(StoreError::Backend("the transaction's store changed".into()))
                    })?;
                lite.complete_with(&mut *tx, id, token, response)
                    .await
                    .map_err(TxFailure::NotCommitted)?;
                tx.commit()
                    .await
                    .map_err(|e| TxFailure::Unknown(crate::sql::map_err(e)))
            }
        }
    }

    /// Rolls the handler's writes back.
    pub(crate) async fn rollback(self) {
        let result: Result<(), sqlx_error::Error> = match self {
            #[cfg(feature = "postgres")]
            PendingTx::Pg(tx) => tx.rollback().await,
            #[cfg(feature = "sqlite")]
            PendingTx::Sqlite(tx) => tx.rollback().await,
        };
        #[allow(unreachable_code)]
        if let Err(e) = result {
            // Dropping the connection rolls back all the same.
            tracing::warn!(error = %e, "rollback failed; the connection is discarded");
        }
    }
}

#[cfg(any(feature = "postgres", feature = "sqlite"))]
mod sqlx_error {
    pub(crate) use sqlx::Error;
}

#[cfg(not(any(feature = "postgres", feature = "sqlite")))]
mod sqlx_error {
    pub(crate) type Error = std::convert::Infallible;
}
