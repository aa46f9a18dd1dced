//! Test support: a fresh SQLite file with the gateway's schema (the rooms migration included).

use std::path::PathBuf;

use diesel::r2d2::{ConnectionManager, PooledConnection};
use diesel::sqlite::SqliteConnection;

use crate::clock::SystemClock;
use crate::rooms::db::RoomsDb;
use crate::store::rooms::{create_room, RoomMember};

pub(crate) const UP_SQL: &str = include_str!("../../migrations/2026-11-29-000002_rooms/up.sql");
pub(crate) const DOWN_SQL: &str = include_str!("../../migrations/2026-11-29-000002_rooms/down.sql");
/// The task counts kept on top of the room tables (a later migration).
pub(crate) const COUNTS_DOWN_SQL: &str =
    include_str!("../../migrations/2026-12-01-000005_room_task_counts/down.sql");
/// The rooms' owners (a later migration).
pub(crate) const OWNERS_DOWN_SQL: &str =
    include_str!("../../migrations/2026-12-04-000012_room_owners/down.sql");
/// The pruned tasks' tombstones (a later migration).
pub(crate) const TOMBSTONES_DOWN_SQL: &str =
    include_str!("../../migrations/2026-12-05-000016_room_task_tombstones/down.sql");

/// A temporary database, removed on drop.
pub(crate) struct TestDb {
    dir: PathBuf,
    pub db: RoomsDb,
}

impl TestDb {
    pub fn new() -> Self {
        let dir =
            std::env::temp_dir().join(format!("gatehouse-rooms-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let pool = crate::store::open_pool(&dir.join("state.db"), 8).expect("pool");
        let db = RoomsDb::new(pool);
        Self { dir, db }
    }

    /// A database with one room of member `ops` driven by `gateway`.
    pub fn with_room(room_id: &str, gateway: &str) -> Self {
        let db = Self::new();
        db.add_room(room_id, "ops", gateway);
        db
    }

    pub fn add_room(&self, room_id: &str, profile: &str, gateway: &str) {
        let members = vec![RoomMember {
            profile: profile.into(),
            handle: profile.into(),
        }];
        create_room(
            &mut self.conn(),
            room_id,
            room_id,
            &members,
            gateway,
            &SystemClock::default(),
        )
        .expect("room");
    }

    pub fn conn(&self) -> PooledConnection<ConnectionManager<SqliteConnection>> {
        self.db.conn().expect("conn")
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
