//! The room runtime's handle on SQLite: an r2d2 pool of diesel connections. Async callers run
//! store functions on the blocking pool and never hold a connection across an await.

use std::path::Path;
use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::r2d2::{ConnectionManager, CustomizeConnection, Pool, PooledConnection};
use diesel::sqlite::SqliteConnection;

use crate::store::rooms::{RoomStoreError, StoreResult};

/// A pool of SQLite connections.
pub type SqlitePool = Pool<ConnectionManager<SqliteConnection>>;

/// The PRAGMAs every pooled connection runs on acquire.
#[derive(Debug, Clone, Copy)]
pub struct SqlitePragmas;

impl CustomizeConnection<SqliteConnection, diesel::r2d2::Error> for SqlitePragmas {
    fn on_acquire(&self, conn: &mut SqliteConnection) -> Result<(), diesel::r2d2::Error> {
        conn.batch_execute(
            "PRAGMA busy_timeout = 10000; PRAGMA journal_mode = WAL; \
             PRAGMA synchronous = FULL; PRAGMA foreign_keys = ON; PRAGMA temp_store = MEMORY;",
        )
        .map_err(diesel::r2d2::Error::QueryError)
    }
}

/// Open a pool on `path` with the house PRAGMAs and a bounded wait for a connection.
pub fn open_pool(path: &Path, max_size: u32) -> StoreResult<SqlitePool> {
    crate::store::install_planner_stability();
    let manager = ConnectionManager::<SqliteConnection>::new(path.to_string_lossy());
    Pool::builder()
        .max_size(max_size)
        .connection_timeout(Duration::from_secs(10))
        .connection_customizer(Box::new(SqlitePragmas))
        .build(manager)
        .map_err(|e| RoomStoreError::Pool(e.to_string()))
}

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
