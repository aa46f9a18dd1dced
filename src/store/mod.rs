//! Durable state: SQLite through diesel.
//!
//! Transitions are plain functions on `&mut SqliteConnection` in the aggregate modules; each is one
//! transaction (`immediate_transaction` for writes) whose fences (epoch, generation, status) are
//! checked in SQL. Actors reach them through [`Db`], a bounded set of blocking workers (an actix
//! `SyncArbiter`) over an r2d2 pool, so no actor ever holds a connection across an await.

pub mod admissions;
pub mod epoch;
pub mod events;
pub mod leases;
pub mod messages;
pub mod prompts;
pub mod room_tasks;
pub mod rooms;
pub mod rooms_schema;
pub mod schema;
pub mod sessions;

use std::path::Path;
use std::time::Duration;

use actix::prelude::*;
use diesel::connection::SimpleConnection;
use diesel::r2d2::{ConnectionManager, CustomizeConnection, Pool, PooledConnection};
use diesel::sqlite::SqliteConnection;
use diesel_migrations::{embed_migrations, EmbeddedMigrations, MigrationHarness};
use tokio::sync::oneshot;

use crate::error::StoreError;

pub const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations");

pub type SqlitePool = Pool<ConnectionManager<SqliteConnection>>;
pub type Conn = PooledConnection<ConnectionManager<SqliteConnection>>;

#[derive(Debug)]
struct Pragmas;

impl CustomizeConnection<SqliteConnection, diesel::r2d2::Error> for Pragmas {
    fn on_acquire(&self, conn: &mut SqliteConnection) -> Result<(), diesel::r2d2::Error> {
        conn.batch_execute(
            "PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL; PRAGMA foreign_keys = ON; \
             PRAGMA busy_timeout = 5000;",
        )
        .map_err(diesel::r2d2::Error::QueryError)
    }
}

/// Open the pool on `path` and bring the schema up to date.
pub fn open_pool(path: &Path, size: u32) -> Result<SqlitePool, StoreError> {
    let url = path.to_string_lossy().to_string();
    let manager = ConnectionManager::<SqliteConnection>::new(url);
    let pool = Pool::builder()
        .max_size(size)
        .connection_timeout(Duration::from_secs(10))
        .connection_customizer(Box::new(Pragmas))
        .build(manager)
        .map_err(|e| StoreError::Pool(e.to_string()))?;
    let mut conn = pool.get().map_err(|e| StoreError::Pool(e.to_string()))?;
    conn.run_pending_migrations(MIGRATIONS)
        .map_err(|e| StoreError::Other(format!("migrations: {e}")))?;
    Ok(pool)
}

type Job = Box<dyn FnOnce(&mut SqliteConnection) + Send>;

struct DbJob(Job);

impl Message for DbJob {
    type Result = ();
}

/// One blocking worker: takes a pooled connection per job.
struct DbWorker {
    pool: SqlitePool,
}

impl Actor for DbWorker {
    type Context = SyncContext<Self>;
}

impl Handler<DbJob> for DbWorker {
    type Result = ();

    fn handle(&mut self, job: DbJob, _: &mut Self::Context) {
        match self.pool.get() {
            Ok(mut conn) => (job.0)(&mut conn),
            Err(e) => {
                tracing::error!(error = %e, "no database connection");
                // Dropping the job drops its reply channel: the caller sees a storage error.
            }
        }
    }
}

/// The handle actors use to run store functions off their own thread.
#[derive(Clone)]
pub struct Db {
    writer: Addr<DbWorker>,
    readers: Addr<DbWorker>,
    pool: SqlitePool,
    metrics: Option<std::sync::Arc<crate::telemetry::Metrics>>,
}

impl Db {
    /// Start the workers (one writer: SQLite has one; `readers` for snapshots).
    pub fn start(pool: SqlitePool, readers: usize) -> Db {
        let p = pool.clone();
        let writer = SyncArbiter::start(1, move || DbWorker { pool: p.clone() });
        let p = pool.clone();
        let readers = SyncArbiter::start(readers.max(1), move || DbWorker { pool: p.clone() });
        Db {
            writer,
            readers,
            pool,
            metrics: None,
        }
    }

    /// Record job latencies in `metrics`.
    pub fn with_metrics(mut self, metrics: std::sync::Arc<crate::telemetry::Metrics>) -> Db {
        self.metrics = Some(metrics);
        self
    }

    async fn run<R, F>(&self, addr: &Addr<DbWorker>, f: F) -> Result<R, StoreError>
    where
        R: Send + 'static,
        F: FnOnce(&mut SqliteConnection) -> Result<R, StoreError> + Send + 'static,
    {
        let started = std::time::Instant::now();
        let result = Self::run_job(addr, f).await;
        if let Some(m) = &self.metrics {
            m.db_hist.observe(started.elapsed().as_secs_f64());
        }
        result
    }

    async fn run_job<R, F>(addr: &Addr<DbWorker>, f: F) -> Result<R, StoreError>
    where
        R: Send + 'static,
        F: FnOnce(&mut SqliteConnection) -> Result<R, StoreError> + Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        let job: Job = Box::new(move |conn| {
            let _ = tx.send(f(conn));
        });
        addr.send(DbJob(job))
            .await
            .map_err(|e| StoreError::Pool(e.to_string()))?;
        rx.await
            .map_err(|_| StoreError::Pool("database worker gave no answer".into()))?
    }

    /// Run a write transition on the single writer.
    pub async fn write<R, F>(&self, f: F) -> Result<R, StoreError>
    where
        R: Send + 'static,
        F: FnOnce(&mut SqliteConnection) -> Result<R, StoreError> + Send + 'static,
    {
        self.run(&self.writer, f).await
    }

    /// Run a read on a reader worker.
    pub async fn read<R, F>(&self, f: F) -> Result<R, StoreError>
    where
        R: Send + 'static,
        F: FnOnce(&mut SqliteConnection) -> Result<R, StoreError> + Send + 'static,
    {
        self.run(&self.readers, f).await
    }

    /// A connection for start-up work that runs before the actors.
    pub fn blocking_conn(&self) -> Result<Conn, StoreError> {
        self.pool.get().map_err(|e| StoreError::Pool(e.to_string()))
    }
}

/// Current wall time in seconds.
pub fn now() -> f64 {
    use crate::clock::Clock;
    crate::clock::SystemClock::default().now()
}

#[cfg(test)]
pub mod testing {
    use super::*;

    /// A migrated connection on a fresh temp file.
    pub fn conn() -> (tempfile_dir::TempDir, SqliteConnection) {
        use diesel::Connection;
        let dir = tempfile_dir::TempDir::new();
        let path = dir.path().join("state.db");
        let mut conn = SqliteConnection::establish(&path.to_string_lossy()).expect("open");
        conn.batch_execute("PRAGMA foreign_keys = ON;")
            .expect("pragma");
        conn.run_pending_migrations(MIGRATIONS).expect("migrate");
        (dir, conn)
    }

    /// A tiny self-cleaning temp dir (keeps the dependency list short).
    pub mod tempfile_dir {
        use std::path::{Path, PathBuf};

        pub struct TempDir(PathBuf);

        impl TempDir {
            #[allow(clippy::new_without_default)]
            pub fn new() -> TempDir {
                let p = std::env::temp_dir()
                    .join(format!("gatehouse-test-{}", uuid::Uuid::new_v4().simple()));
                std::fs::create_dir_all(&p).expect("temp dir");
                TempDir(p)
            }
            pub fn path(&self) -> &Path {
                &self.0
            }
        }

        impl Drop for TempDir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    #[test]
    fn migrations_round_trip() {
        let (_dir, mut conn) = conn();
        conn.revert_all_migrations(MIGRATIONS).expect("revert all");
        conn.run_pending_migrations(MIGRATIONS).expect("run again");
    }
}
