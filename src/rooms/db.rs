//! The room runtime's handle on SQLite: an r2d2 pool of diesel connections. Async callers run
//! store functions on the blocking pool and never hold a connection across an await.

use diesel::r2d2::{ConnectionManager, PooledConnection};
use diesel::sqlite::SqliteConnection;

use crate::store::rooms::{RoomStoreError, StoreResult};
/// The rooms share the authority's pool (`store::open_pool`: its PRAGMAs and migrations).
pub use crate::store::SqlitePool;

/// The rooms' database handle.
#[derive(Clone)]
pub struct RoomsDb {
    pool: SqlitePool,
}

impl std::fmt::Debug for RoomsDb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RoomsDb").finish_non_exhaustive()
    }
}

impl RoomsDb {
    pub fn new(pool: SqlitePool) -> Self {
        Self { pool }
    }

    /// A pooled connection.
    pub fn conn(&self) -> StoreResult<PooledConnection<ConnectionManager<SqliteConnection>>> {
        self.pool
            .get()
            .map_err(|e| RoomStoreError::Pool(e.to_string()))
    }

    /// Run a store function on the calling thread (for synchronous callers such as a terminal
    /// callback).
    pub fn run_sync<T>(
        &self,
        f: impl FnOnce(&mut SqliteConnection) -> StoreResult<T>,
    ) -> StoreResult<T> {
        let mut conn = self.conn()?;
        f(&mut conn)
    }

    /// Run a store function on the blocking pool.
    pub async fn run<T, F>(&self, f: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut SqliteConnection) -> StoreResult<T> + Send + 'static,
    {
        let pool = self.pool.clone();
        tokio::task::spawn_blocking(move || {
            let mut conn = pool
                .get()
                .map_err(|e| RoomStoreError::Pool(e.to_string()))?;
            f(&mut conn)
        })
        .await
        .map_err(|e| RoomStoreError::Pool(format!("database worker failed: {e}")))?
    }
}
