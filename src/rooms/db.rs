//! The room runtime's handle on SQLite: an r2d2 pool of diesel connections for reads, and in the
//! daemon its one writer for writes ([`RoomsDb::write`]). Async callers never hold a connection
//! across an await.

use diesel::r2d2::{ConnectionManager, PooledConnection};
use diesel::sqlite::SqliteConnection;

use crate::store::rooms::{RoomStoreError, StoreResult};
/// The rooms share the authority's pool (`store::open_pool`: its PRAGMAs and migrations).
pub use crate::store::SqlitePool;

/// The rooms' database handle.
#[derive(Clone)]
pub struct RoomsDb {
    pool: SqlitePool,
    /// The daemon's one writer: room writes join its group commits instead of taking SQLite's
    /// write lock from a connection of their own. Two writers contend for that lock, and
    /// SQLite's busy handler waits it out in sleeps of 1 to 100 ms, on both sides: with sixteen
    /// rooms busy, room tasks slept thousands of times per run, and so did the sessions' writer.
    writer: Option<crate::store::Db>,
}

impl std::fmt::Debug for RoomsDb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RoomsDb").finish_non_exhaustive()
    }
}

impl RoomsDb {
    /// Writes in transactions of their own on pooled connections (tools and tests).
    pub fn new(pool: SqlitePool) -> Self {
        Self { pool, writer: None }
    }

    /// Writes through the daemon's writer.
    pub fn with_writer(pool: SqlitePool, writer: crate::store::Db) -> Self {
        Self {
            pool,
            writer: Some(writer),
        }
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

    /// Run a store function that writes, on the calling thread, which it blocks until the
    /// commit (a synchronous caller's, never an async task's).
    pub fn write_sync<T>(
        &self,
        f: impl FnOnce(&mut SqliteConnection) -> StoreResult<T> + Send + 'static,
    ) -> StoreResult<T>
    where
        T: Send + 'static,
    {
        match &self.writer {
            Some(writer) => writer
                .write_blocking(move |c| Ok(f(c)))
                .map_err(|e| RoomStoreError::Pool(e.to_string()))?,
            None => self.run_sync(f),
        }
    }

    /// Run a store function that writes: through the daemon's writer (answered after its
    /// commit), else on the blocking pool.
    pub async fn write<T, F>(&self, f: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut SqliteConnection) -> StoreResult<T> + Send + 'static,
    {
        match &self.writer {
            Some(writer) => writer
                .write(move |c| Ok(f(c)))
                .await
                .map_err(|e| RoomStoreError::Pool(e.to_string()))?,
            None => self.run(f).await,
        }
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

/// Prune ended room tasks every `config.prune_interval_seconds` (first right away), for the life
/// of the process, on the current arbiter. A backlog is pruned in several transactions of at
/// most [`PRUNE_BATCH`] tasks, so other commits run between them.
pub fn spawn_task_pruner(
    db: RoomsDb,
    clock: crate::clock::SharedClock,
    config: &crate::rooms::RoomsConfig,
) {
    use crate::store::room_tasks::{prune_ended_tasks, TaskRetention};
    let retention = TaskRetention {
        max_age_seconds: config.task_retention_seconds,
        max_per_room: config.max_ended_tasks_per_room,
    };
    let every = std::time::Duration::from_secs_f64(config.prune_interval_seconds);
    actix::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let mut deleted = 0;
            loop {
                let now = clock.now();
                match db
                    .write(move |c| prune_ended_tasks(c, retention, now, PRUNE_BATCH))
                    .await
                {
                    Ok(pruned) => {
                        deleted += pruned.deleted;
                        if !pruned.more || pruned.deleted == 0 {
                            break;
                        }
                    }
                    Err(error) => {
                        tracing::warn!(%error, "cannot prune ended room tasks");
                        break;
                    }
                }
            }
            if deleted > 0 {
                tracing::debug!(tasks = deleted, "pruned ended room tasks");
            }
        }
    });
}

/// Most ended tasks one pruning transaction deletes. A task holds up to 128 KiB of prompt and
/// its result: a thousand of them freed hundreds of MiB of pages in one commit of the writer,
/// every session's commits waiting behind it.
pub const PRUNE_BATCH: usize = 64;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::SystemClock;
    use crate::store::rooms::{create_room, get_room, RoomMember};
    use crate::store::{open_pool, testing::tempfile_dir::TempDir, Db};

    fn room(c: &mut SqliteConnection, id: &str) -> StoreResult<String> {
        let members = [RoomMember {
            profile: "ops".into(),
            handle: "ops".into(),
        }];
        create_room(c, id, id, &members, "gw", &SystemClock::default()).map(|r| r.room_id)
    }

    /// With the daemon's writer, a room write is a savepoint of the writer's group commit
    /// (answered after that commit), not a transaction of its own contending for SQLite's write
    /// lock: each is one of the writer's commits, from an async task or a thread that may block.
    #[test]
    fn room_writes_are_the_writers_commits() {
        let dir = TempDir::new();
        let pool = open_pool(&dir.path().join("state.db"), 4).expect("pool");
        let (db, rooms) = actix_rt::System::new().block_on(async {
            let db = Db::start(pool.clone(), 1);
            let rooms = RoomsDb::with_writer(pool, db.clone());
            let before = db.commits();
            let created = rooms.write(|c| room(c, "room-a")).await;
            assert_eq!(created.expect("room a"), "room-a");
            assert_eq!(db.commits() - before, 1);
            (db, rooms)
        });
        let before = db.commits();
        let on_thread = rooms.clone();
        let created = std::thread::spawn(move || on_thread.write_sync(|c| room(c, "room-b")))
            .join()
            .expect("thread");
        assert_eq!(created.expect("room b"), "room-b");
        assert_eq!(db.commits() - before, 1);
        for id in ["room-a", "room-b"] {
            let found = rooms.run_sync(|c| get_room(c, id)).expect("read");
            assert!(found.is_some(), "{id}");
        }
        // Without a writer (tools, tests) the same write is a transaction of its own.
        let alone = RoomsDb::new(rooms.pool.clone());
        let before = db.commits();
        assert_eq!(
            alone.write_sync(|c| room(c, "room-c")).expect("room c"),
            "room-c"
        );
        assert_eq!(db.commits(), before);
    }
}
