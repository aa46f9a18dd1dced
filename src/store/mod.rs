//! Durable state: SQLite through diesel.
//!
//! Transitions are plain functions on `&mut SqliteConnection` in the aggregate modules; each is one
//! transaction ([`write_tx`]: `BEGIN IMMEDIATE`, or a savepoint inside a group commit) whose fences
//! (epoch, generation, status) are checked in SQL. Actors reach them through [`Db`]: reads go to a
//! bounded set of blocking workers (an actix `SyncArbiter`) over an r2d2 pool; writes go to one
//! group-commit writer thread, which runs every write waiting in its queue as one savepoint each
//! inside a single `BEGIN IMMEDIATE … COMMIT` and answers each caller only after that commit (so an
//! acknowledged write is durable under `synchronous=FULL`, and one fsync serves many callers). No
//! actor ever holds a connection across an await.

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
pub mod threads;
pub mod vfs;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use diesel::connection::SimpleConnection;
use diesel::r2d2::{
    ConnectionManager, CustomizeConnection, ManageConnection, Pool, PooledConnection,
};
use diesel::sqlite::SqliteConnection;
use diesel_migrations::{embed_migrations, EmbeddedMigrations, MigrationHarness};
use tokio::sync::oneshot;

use crate::clock::process_ms;
use crate::error::StoreError;

pub const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations");

pub type SqlitePool = Pool<ConnectionManager<SqliteConnection>>;
pub type Conn = PooledConnection<ConnectionManager<SqliteConnection>>;

/// Turn on SQLite's query planner stability guarantee for every connection this process opens.
///
/// Without it, SQLite (3.47 and later) reads the value bound to `LIMIT ?` while planning and marks
/// the statement to be re-planned whenever that parameter is bound again, so every cached
/// statement with a limit (diesel binds `.first()` as `LIMIT ?`) was parsed and planned anew on
/// each run: a third of the writer's CPU per admission. With the guarantee, plans never depend on
/// bound values and a cached statement stays prepared.
pub fn install_planner_stability() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: registers a C entry point that SQLite calls with each new connection's handle;
        // the entry point only sets a per-connection option on that handle.
        let rc = unsafe { libsqlite3_sys::sqlite3_auto_extension(Some(enable_qpsg)) };
        if rc == libsqlite3_sys::SQLITE_OK {
            HOOKED.store(true, Ordering::Relaxed);
        } else {
            tracing::warn!(
                code = rc,
                "cannot enable the SQLite planner stability guarantee and transaction hooks \
                 (the writer asks the connection after every write instead)"
            );
        }
    });
}

unsafe extern "C" fn enable_qpsg(
    db: *mut libsqlite3_sys::sqlite3,
    _err: *mut *mut std::ffi::c_char,
    _api: *const libsqlite3_sys::sqlite3_api_routines,
) -> std::ffi::c_int {
    // SAFETY: `db` is the connection SQLite is opening; the option takes an int and an optional
    // out-pointer (null: not wanted). The hooks are plain functions that take no argument of
    // their own (null) and only set a flag of the calling thread.
    unsafe {
        libsqlite3_sys::sqlite3_db_config(
            db,
            libsqlite3_sys::SQLITE_DBCONFIG_ENABLE_QPSG,
            1 as std::ffi::c_int,
            std::ptr::null_mut::<std::ffi::c_int>(),
        );
        libsqlite3_sys::sqlite3_commit_hook(db, Some(note_commit), std::ptr::null_mut());
        libsqlite3_sys::sqlite3_rollback_hook(db, Some(note_rollback), std::ptr::null_mut());
        #[cfg(test)]
        libsqlite3_sys::sqlite3_create_function_v2(
            db,
            c"cache_used".as_ptr(),
            0,
            libsqlite3_sys::SQLITE_UTF8,
            std::ptr::null_mut(),
            Some(cache_used),
            None,
            None,
            None,
        );
    }
    libsqlite3_sys::SQLITE_OK
}

/// `cache_used()`, in tests: the bytes the calling connection's page cache holds.
#[cfg(test)]
unsafe extern "C" fn cache_used(
    ctx: *mut libsqlite3_sys::sqlite3_context,
    _argc: std::ffi::c_int,
    _argv: *mut *mut libsqlite3_sys::sqlite3_value,
) {
    let (mut now, mut high) = (0, 0);
    // SAFETY: `ctx` is the call's context, which names its connection; the status is read into
    // two locals, without a reset.
    unsafe {
        let db = libsqlite3_sys::sqlite3_context_db_handle(ctx);
        libsqlite3_sys::sqlite3_db_status(
            db,
            libsqlite3_sys::SQLITE_DBSTATUS_CACHE_USED,
            &mut now,
            &mut high,
            0,
        );
        libsqlite3_sys::sqlite3_result_int64(ctx, i64::from(now));
    }
}

/// Are the commit and rollback hooks set on every connection (see [`TRANSACTION_ENDED`])?
static HOOKED: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// Has a transaction of a connection used on this thread ended (committed or rolled back,
    /// explicitly or by SQLite after an error) since the flag was last cleared? The writer
    /// clears it as its batch begins and reads it after each write of the batch: one that ended
    /// the batch's transaction is seen at once, whatever the write answered.
    static TRANSACTION_ENDED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Is the writer running a batch's writes on this thread? No commit but the batch's own may
    /// happen then (see [`note_commit`]).
    static IN_BATCH: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

unsafe extern "C" fn note_commit(_: *mut std::ffi::c_void) -> std::ffi::c_int {
    TRANSACTION_ENDED.with(|ended| ended.set(true));
    // While a batch's writes run, a commit is a statement run after SQLite ended the batch's
    // transaction under it (a full disk, an I/O error), in a transaction of its own: refused
    // (non-zero turns it into a rollback). Committed, a write answered as failed with its batch
    // was half done, or done again when its caller asked again. Zero: the commit goes ahead.
    std::ffi::c_int::from(IN_BATCH.with(|b| b.get()))
}

unsafe extern "C" fn note_rollback(_: *mut std::ffi::c_void) {
    TRANSACTION_ENDED.with(|ended| ended.set(true));
}

/// Every pooled connection: WAL with `synchronous = FULL` (an acknowledged commit survives power
/// loss), foreign keys, a bounded busy wait (set first: changing `journal_mode` needs the
/// file's lock, and a held one failed the open at once), and `temp_store = MEMORY`, which
/// keeps savepoint sub-journals in memory (each write of a group commit runs in its own
/// savepoint, and a sub-journal spilled to a temp file cost a `pwrite` per page touched).
///
/// New databases get 1 KiB pages: a turn's commit touches ~15 pages scattered over the indexes,
/// and the writer's CPU per WAL frame (copy, checksum, `pwrite`) grows with the page size.
///
/// Checkpoints belong to the background checkpointer ([`spawn_checkpointer`]). SQLite's own
/// automatic checkpoint runs on the committing connection, the group-commit writer, and with a
/// large store it stalled every session's commits for 10-30 ms several times a second; it stays
/// only as a bound on the WAL (100,000 frames) should the background one fall behind, and a WAL
/// that grew past 64 MiB is truncated when it restarts.
#[derive(Debug)]
struct Pragmas;

/// What every connection of the store sets (see [`Pragmas`]); the bench's raw commits too.
pub const PRAGMAS: &str =
    "PRAGMA busy_timeout = 5000; PRAGMA page_size = 1024; PRAGMA journal_mode = WAL; \
     PRAGMA synchronous = FULL; PRAGMA foreign_keys = ON; PRAGMA wal_autocheckpoint = 100000; \
     PRAGMA journal_size_limit = 67108864; PRAGMA temp_store = MEMORY;";

impl CustomizeConnection<SqliteConnection, diesel::r2d2::Error> for Pragmas {
    fn on_acquire(&self, conn: &mut SqliteConnection) -> Result<(), diesel::r2d2::Error> {
        conn.batch_execute(PRAGMAS)
            .map_err(diesel::r2d2::Error::QueryError)
    }
}

/// Whether SQLite runs without its per-connection mutexes (see [`configure_threading`]).
static UNLOCKED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// Before SQLite starts in this process (so before the first connection, and before
/// [`install_planner_stability`] and [`vfs::install`], which start it): no mutex on connections
/// and statements, and no global count of SQLite's memory. Each connection is only ever used by
/// one thread at a time (diesel's connection is `Send` and not `Sync`; the pool lends it out
/// whole), which is all SQLite's multi-thread mode asks; in its default serialized mode every
/// call into SQLite (each bind, step and column read) took and released the connection's
/// mutex, and every allocation the memory-statistics mutex. Once SQLite has started it
/// refuses the change and keeps its defaults, which is only slower; the answer says which.
pub fn configure_threading() -> bool {
    *UNLOCKED.get_or_init(|| {
        // SAFETY: `sqlite3_config` changes process-wide settings and must run before SQLite is
        // initialised and while no other thread uses SQLite; once initialised it changes nothing
        // and returns SQLITE_MISUSE. It runs once per process, from the first pool opened.
        let (threading, memstatus) = unsafe {
            (
                libsqlite3_sys::sqlite3_config(libsqlite3_sys::SQLITE_CONFIG_MULTITHREAD),
                libsqlite3_sys::sqlite3_config(
                    libsqlite3_sys::SQLITE_CONFIG_MEMSTATUS,
                    0 as std::ffi::c_int,
                ),
            )
        };
        let unlocked = threading == libsqlite3_sys::SQLITE_OK;
        if !unlocked || memstatus != libsqlite3_sys::SQLITE_OK {
            tracing::info!(
                threading,
                memstatus,
                "SQLite had started before it was configured: it keeps its mutexes"
            );
        }
        unlocked
    })
}

/// Set SQLite up as every connection of this process uses it, in the one order that works: the
/// threading mode before SQLite starts, then what starts it (the planner's stability, the VFS).
pub fn prepare_sqlite() {
    configure_threading();
    install_planner_stability();
    vfs::install();
}

/// Open the pool on `path` and bring the schema up to date.
pub fn open_pool(path: &Path, size: u32) -> Result<SqlitePool, StoreError> {
    prepare_sqlite();
    let url = path.to_string_lossy().to_string();
    let manager = ConnectionManager::<SqliteConnection>::new(url);
    // One connection first, outside the pool: a file that is not a database, or a corrupt one,
    // is reported at once with SQLite's own words (through the pool it was reported only when
    // the pool's connection timeout ran out, ten seconds later).
    let mut probe = manager
        .connect()
        .map_err(|e| StoreError::Other(format!("{}: {e}", path.display())))?;
    Pragmas
        .on_acquire(&mut probe)
        .map_err(|e| StoreError::Other(format!("{}: {e}", path.display())))?;
    let pool = Pool::builder()
        .max_size(size)
        // A local SQLite file does not go stale: no `SELECT 1` before every checkout.
        .test_on_check_out(false)
        // One connection at start (the `get` below), the rest on first use, and none closed for
        // being idle: with the default, every connection opened at start, side by side with the
        // first one, which could be rebuilding the WAL index after a crash (the others waited on
        // its locks; the probe rebuilds it now, before the pool opens any). None is opened ahead
        // of need either: one taken with no other idle would be replaced at once, as each is
        // when an idle store takes them all to release their caches ([`release_pooled`]).
        .min_idle(Some(0))
        .idle_timeout(None)
        // Nor for their age: with r2d2's default (30 minutes) each was closed and opened again
        // every half hour, its prepared statements and cached pages lost, and a reaper woke
        // every 30 s to look for them.
        .max_lifetime(None)
        // One thread opens the pool's connections (r2d2 started three per pool): with neither
        // lifetime nor idle time to watch, opening a connection on first use is all it does,
        // and one at a time is quick enough.
        .thread_pool(std::sync::Arc::new(
            scheduled_thread_pool::ScheduledThreadPool::builder()
                .num_threads(1)
                .thread_name_pattern("gatehouse-open{}")
                .build(),
        ))
        .connection_timeout(Duration::from_secs(10))
        .connection_customizer(Box::new(Pragmas))
        .build(manager)
        .map_err(|e| StoreError::Pool(e.to_string()))?;
    // The probe closes once the pool holds a connection of its own, which stays open while the
    // pool keeps it. The last connection of a store to close copies the whole WAL into the
    // database file, syncs it and deletes the WAL: after a crash, the probe closing first did
    // that, in the start's path, with the WAL it had just read back (usually about 16 MiB, the
    // length at which the writer restarts it; more when it could not). In the bench, started
    // from the disk after a SIGKILL with 1,000 turns running, a start took 131-141 ms that way
    // and 74-81 ms this way. The background checkpointer copies those frames after the start
    // instead, as it copies any others.
    let mut conn = pool.get().map_err(|e| StoreError::Pool(e.to_string()))?;
    drop(probe);
    migrate(&mut conn)?;
    Ok(pool)
}

/// Bring the schema up to date. A migration that copies a table takes time in proportion to it
/// (25 s for a store of a million turns on this project's machine), so a start with pending
/// migrations says so, keeps systemd's start timeout extended meanwhile, and gives the migrating
/// connection a 128 MiB page cache (the same SQL run outside the daemon on that store took 37 s
/// with it, 47 s with SQLite's default 2 MiB).
fn migrate(conn: &mut SqliteConnection) -> Result<(), StoreError> {
    let pending = conn
        .pending_migrations(MIGRATIONS)
        .map_err(|e| StoreError::Other(format!("migrations: {e}")))?;
    if pending.is_empty() {
        return Ok(());
    }
    let names: Vec<String> = pending.iter().map(|m| m.name().to_string()).collect();
    tracing::info!(
        migrations = ?names,
        "bringing the store's schema up to date; a migration that copies a large table takes a while"
    );
    let started = std::time::Instant::now();
    let _extended = crate::notify::extend_start_while_alive();
    conn.batch_execute("PRAGMA cache_size = -131072;")?;
    let migrated = conn
        .run_pending_migrations(MIGRATIONS)
        .map(|_| ())
        .map_err(|e| StoreError::Other(format!("migrations: {e}")));
    // Back to SQLite's default for the connection the pool keeps.
    conn.batch_execute("PRAGMA cache_size = -2000;")?;
    migrated?;
    tracing::info!(
        seconds = started.elapsed().as_secs_f64(),
        "the store's schema is up to date"
    );
    Ok(())
}

/// Run `f` as one write transaction: `BEGIN IMMEDIATE` on its own, or a savepoint when the caller
/// (the group-commit writer) already opened one. Either way `f`'s writes apply all or nothing.
pub fn write_tx<T, E, F>(conn: &mut SqliteConnection, f: F) -> Result<T, E>
where
    F: FnOnce(&mut SqliteConnection) -> Result<T, E>,
    E: From<diesel::result::Error>,
{
    use diesel::connection::{AnsiTransactionManager, TransactionManager};
    let nested = matches!(
        AnsiTransactionManager::transaction_manager_status_mut(conn).transaction_depth(),
        Ok(Some(_))
    );
    if !nested {
        return conn.immediate_transaction(f);
    }
    // A savepoint of statements kept prepared: diesel's own (`conn.transaction`) sends its
    // `SAVEPOINT` and `RELEASE` as text that SQLite parses again on every write of a batch.
    // Nested calls reuse the name: `RELEASE` and `ROLLBACK TO` act on the innermost.
    use diesel::RunQueryDsl;
    hot_sql!("SAVEPOINT write_tx", &[]).execute(conn)?;
    match f(conn) {
        Ok(v) => match hot_sql!("RELEASE write_tx", &[]).execute(conn) {
            Ok(_) => Ok(v),
            // The write's statements would stay in the batch's transaction and commit with it,
            // its caller told it failed: none of the batch may commit (as below).
            Err(r) => {
                tracing::error!(error = %r, "cannot release a write's savepoint");
                let _ = conn.batch_execute("ROLLBACK");
                Err(r.into())
            }
        },
        Err(e) => {
            // Undo this write's statements; the batch's transaction goes on with the others.
            let undone = hot_sql!("ROLLBACK TO write_tx", &[])
                .execute(conn)
                .and_then(|_| hot_sql!("RELEASE write_tx", &[]).execute(conn));
            if let Err(r) = undone {
                // Then none of the batch may commit: end its transaction here, and its COMMIT
                // fails, so every write of the batch is answered with an error.
                tracing::error!(error = %r, "cannot roll a write back to its savepoint");
                let _ = conn.batch_execute("ROLLBACK");
            }
            Err(e)
        }
    }
}

/// A value bound to a [`HotSql`] placeholder.
#[derive(Debug, Clone, Copy)]
pub enum Bind<'a> {
    Text(&'a str),
    Int(i64),
    Real(f64),
}

/// A hot-path statement written out in SQL, kept prepared by the connection: written with
/// [`hot_sql!`], which gives each statement a type of its own.
///
/// Diesel never keeps an `UPDATE` prepared (a changeset with optional fields changes its SQL
/// while its type stays the same), so every turn parsed and planned its updates again on the
/// writer thread, the one thread every commit waits for. The few updates each turn runs are
/// written here instead; `?` marks each bound value, in order (the text has no other `?`).
///
/// Diesel's statement cache finds a statement whose query id is a type by that type alone; any
/// other statement it finds by its SQL text, which it builds and hashes on every run (about a
/// tenth of the writer's instructions per turn when these statements were keyed by text). The
/// type, `Site`, is one declared by each use of [`hot_sql!`], so one type never stands for two
/// texts.
pub struct HotSql<'a, Site> {
    text: &'static str,
    /// Where the text's `?` are, found when it compiles (see [`placeholders`]).
    at: &'static [usize],
    binds: &'a [Bind<'a>],
    site: std::marker::PhantomData<fn() -> Site>,
}

/// How many `?` a statement's text has.
pub const fn count_placeholders(text: &str) -> usize {
    let bytes = text.as_bytes();
    let (mut i, mut n) = (0, 0);
    while i < bytes.len() {
        if bytes[i] == b'?' {
            n += 1;
        }
        i += 1;
    }
    n
}

/// The byte offsets of a statement's `N` placeholders, computed when it compiles, so that no
/// run of the statement looks for them in its text again.
pub const fn placeholders<const N: usize>(text: &str) -> [usize; N] {
    let bytes = text.as_bytes();
    let mut out = [0usize; N];
    let (mut i, mut n) = (0, 0);
    while i < bytes.len() {
        if bytes[i] == b'?' {
            out[n] = i;
            n += 1;
        }
        i += 1;
    }
    out
}

/// `hot_sql!(text, &[binds…])`: a [`HotSql`] statement keyed in the statement cache by a type
/// declared here, for this use only.
macro_rules! hot_sql {
    ($text:expr, $binds:expr $(,)?) => {{
        struct Site;
        const TEXT: &str = $text;
        const AT: [usize; $crate::store::count_placeholders(TEXT)] =
            $crate::store::placeholders(TEXT);
        $crate::store::HotSql::<Site>::at(TEXT, &AT, $binds)
    }};
}
pub(crate) use hot_sql;

impl<'a, Site: 'static> HotSql<'a, Site> {
    /// Use [`hot_sql!`], which names a `Site` of its own for each statement.
    pub(crate) fn at(text: &'static str, at: &'static [usize], binds: &'a [Bind<'a>]) -> Self {
        Self {
            text,
            at,
            binds,
            site: std::marker::PhantomData,
        }
    }

    /// The statement returns one row of SQL type `ST` (`… RETURNING …` or a `SELECT`), read
    /// with `get_result`.
    pub fn returning<ST>(self) -> HotQuery<'a, ST, Site> {
        HotQuery {
            sql: self,
            row: std::marker::PhantomData,
        }
    }
}

impl<Site: 'static> diesel::query_builder::QueryId for HotSql<'_, Site> {
    type QueryId = Site;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl<Site> diesel::query_builder::QueryFragment<diesel::sqlite::Sqlite> for HotSql<'_, Site> {
    fn walk_ast<'b>(
        &'b self,
        mut out: diesel::query_builder::AstPass<'_, 'b, diesel::sqlite::Sqlite>,
    ) -> diesel::QueryResult<()> {
        use diesel::sql_types::{BigInt, Double, Text};
        let mismatch = || {
            diesel::result::Error::QueryBuilderError(
                "placeholders and bound values differ in number".into(),
            )
        };
        if self.at.len() != self.binds.len() {
            return Err(mismatch());
        }
        let mut start = 0;
        for (&at, bind) in self.at.iter().zip(self.binds) {
            out.push_sql(self.text.get(start..at).ok_or_else(mismatch)?);
            match bind {
                Bind::Text(s) => out.push_bind_param::<Text, _>(s)?,
                Bind::Int(i) => out.push_bind_param::<BigInt, _>(i)?,
                Bind::Real(f) => out.push_bind_param::<Double, _>(f)?,
            }
            start = at + 1;
        }
        out.push_sql(self.text.get(start..).ok_or_else(mismatch)?);
        Ok(())
    }
}

impl<Conn, Site> diesel::RunQueryDsl<Conn> for HotSql<'_, Site> {}

/// A [`HotSql`] statement that returns rows of SQL type `ST`; kept prepared the same way.
pub struct HotQuery<'a, ST, Site> {
    sql: HotSql<'a, Site>,
    row: std::marker::PhantomData<ST>,
}

impl<ST, Site: 'static> diesel::query_builder::QueryId for HotQuery<'_, ST, Site> {
    type QueryId = Site;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl<ST, Site> diesel::query_builder::QueryFragment<diesel::sqlite::Sqlite>
    for HotQuery<'_, ST, Site>
{
    fn walk_ast<'b>(
        &'b self,
        out: diesel::query_builder::AstPass<'_, 'b, diesel::sqlite::Sqlite>,
    ) -> diesel::QueryResult<()> {
        self.sql.walk_ast(out)
    }
}

impl<ST, Site> diesel::query_builder::Query for HotQuery<'_, ST, Site> {
    type SqlType = ST;
}

impl<Conn, ST, Site> diesel::RunQueryDsl<Conn> for HotQuery<'_, ST, Site> {}

type Job = Box<dyn FnOnce(&mut SqliteConnection) + Send>;

/// A write: runs inside the batch transaction and returns how to answer once the batch commits.
/// A write run in a batch's transaction: how to answer it once the batch is committed (or not),
/// and whether it failed (then the batch's transaction may have ended with it).
type WriteJob = Box<dyn FnOnce(&mut SqliteConnection) -> Deliver + Send>;
type Deliver = Box<dyn FnOnce(Result<(), String>) + Send>;

/// What the writer's queue carries.
enum ToWriter {
    /// A write, committed with the others of its batch.
    Write(WriteJob),
    /// The store went a lull ([`Db::with_idle_release`]) after the writer's `batches`th batch:
    /// give back the pages the writer's connection caches ([`release_idle_memory`]), unless
    /// another batch began since.
    Release { batches: u64 },
}

/// Most writes committed together.
const MAX_BATCH: usize = 512;

/// A WAL past this many frames is restarted from its beginning (see [`restart_wal`]).
const WAL_RESTART_FRAMES: i64 = 16_384;

/// Does `conn` say its transaction state is broken (so it must not be used again)?
fn broken(conn: &mut SqliteConnection) -> bool {
    use diesel::connection::{Connection, TransactionManager};
    <<SqliteConnection as Connection>::TransactionManager as TransactionManager<
        SqliteConnection,
    >>::is_broken_transaction_manager(conn)
}

fn writer_loop(
    pool: SqlitePool,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<ToWriter>,
    wal: Arc<WalState>,
) {
    // The writer keeps one connection (and so one warm statement cache) for as long as it works.
    let mut held: Option<Conn> = None;
    while let Some(first) = rx.blocking_recv() {
        let first = match first {
            ToWriter::Write(job) => job,
            ToWriter::Release { batches } => {
                if wal.batches.load(Ordering::Acquire) == batches {
                    release_idle_memory(&wal, held.as_deref_mut());
                }
                continue;
            }
        };
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(ToWriter::Write(job)) => batch.push(job),
                // Writes came after all: the store is not idle, and keeps its cache.
                Ok(ToWriter::Release { .. }) => {}
                Err(_) => break,
            }
        }
        let conn = match held.take().map(Ok).unwrap_or_else(|| pool.get()) {
            Ok(c) => held.insert(c),
            Err(e) => {
                tracing::error!(error = %e, "no database connection for writes");
                // Dropping the batch drops its reply channels: the callers see a storage error.
                continue;
            }
        };
        let writes = batch.len();
        let mut deliveries: Vec<Deliver> = Vec::with_capacity(writes);
        // A database file found gone (or not synced) is not written again: the batch runs (its
        // jobs answer only through a transaction) and is rolled back.
        let halted = wal.halted();
        wal.batches.fetch_add(1, Ordering::Release);
        wal.busy_since_ms
            .store(process_ms().max(1), Ordering::Relaxed);
        let mut committed = conn
            .immediate_transaction::<_, diesel::result::Error, _>(|c| {
                TRANSACTION_ENDED.with(|ended| ended.set(false));
                IN_BATCH.with(|b| b.set(true));
                for job in batch.drain(..) {
                    // A write that panics is answered as not written (its caller's channel is
                    // dropped) and its batch rolled back: the writer thread goes on (it died,
                    // and every later write of the process failed).
                    let Ok(deliver) =
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(c)))
                    else {
                        tracing::error!("a write panicked; its batch is rolled back");
                        return Err(diesel::result::Error::RollbackTransaction);
                    };
                    deliveries.push(deliver);
                    // After every write, failed or not: one that met an error and went on (a
                    // step it may do without, a claim answered apart from its admission) may
                    // have had the batch's transaction ended under it all the same. SQLite's
                    // hooks say so for nothing; without them the connection is asked.
                    let ended = if HOOKED.load(Ordering::Relaxed) {
                        TRANSACTION_ENDED.with(|ended| ended.get())
                    } else {
                        transaction_ended(c)
                    };
                    if ended {
                        // SQLite rolled the whole batch back with this write (an I/O error, a
                        // full disk, a ROLLBACK): the writes after it would each commit on their
                        // own, outside the batch, and be answered that the batch failed. They
                        // are not run (dropped with the batch: their callers see a storage
                        // error), and the batch is answered as failed.
                        return Err(diesel::result::Error::RollbackTransaction);
                    }
                }
                if halted {
                    return Err(diesel::result::Error::RollbackTransaction);
                }
                // The batch's own COMMIT follows.
                IN_BATCH.with(|b| b.set(false));
                Ok(())
            })
            .map_err(|e| e.to_string());
        IN_BATCH.with(|b| b.set(false));
        wal.busy_since_ms.store(0, Ordering::Relaxed);
        // Jobs the transaction never ran (it could not begin) are dropped with `batch`, which
        // drops their reply channels: their callers see a storage error.
        if committed.is_ok() {
            wal.commits.fetch_add(1, Ordering::Release);
            // Committed to the file opened at start, which must still be the one at its path:
            // a commit to a file since removed or replaced is lost at the next start, so it is
            // not acknowledged (one `stat`, against the commit's `fsync`).
            committed = wal.confirm_file();
        } else if halted {
            committed = wal.file_health();
        }
        if let Err(e) = &committed {
            wal.failed.fetch_add(1, Ordering::Relaxed);
            if !halted {
                if let Some(skipped) = crate::error::STORAGE_LOG.admit() {
                    tracing::error!(error = %e, writes, skipped, "group commit failed");
                }
            }
            // Start the next batch on a fresh connection only if this one's transaction state is
            // broken. Given back to the pool after every failed commit, the next batch asked the
            // pool for another, which readers held busy (the rooms' among them) could keep past
            // its timeout: the whole batch was dropped, every caller told the store failed.
            if held.as_mut().is_some_and(|c| broken(c)) {
                held = None;
            }
        }
        for d in deliveries {
            d(committed.clone());
        }
        // After the answers: the restart's short wait is charged to the writes queued behind.
        if let Some(conn) = held.as_mut() {
            // A large batch means many writers waiting, and the frames the restart would copy
            // first are many: it waits, unless the WAL is long past its restart length.
            let wanted = match wal.wanted.load(Ordering::Relaxed) {
                WAL_RESTART_SOON => writes <= WAL_RESTART_MAX_BATCH,
                WAL_RESTART_NOW => true,
                _ => false,
            };
            // After a failed sync of the database file the WAL is the only sure copy of what
            // a checkpoint copied: it is never written over.
            if wanted && !wal.sync_failed.load(Ordering::Relaxed) {
                wal.wanted.store(WAL_RESTART_NO, Ordering::Relaxed);
                if restart_wal(conn) {
                    wal.done.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
}

/// The writer's job for `f`, whose answer goes to `answer` once its batch has committed (or
/// failed).
fn write_job<R, F>(f: F, answer: impl FnOnce(Result<R, StoreError>) + Send + 'static) -> WriteJob
where
    R: Send + 'static,
    F: FnOnce(&mut SqliteConnection) -> Result<R, StoreError> + Send + 'static,
{
    Box::new(move |conn| {
        let result = f(conn);
        let deliver: Deliver = Box::new(move |committed: Result<(), String>| {
            answer(match (result, committed) {
                (Ok(r), Ok(())) => Ok(r),
                (Ok(_), Err(e)) => Err(StoreError::Other(format!("commit failed: {e}"))),
                // A refusal read from the batch's own writes (a conflict with an admission made
                // earlier in it, a claim or cancel that found a row it changed) is not true once
                // the batch is rolled back: answered as the storage failure it is, so the caller
                // tries again instead of taking a refusal for a state that never was (a session
                // request reusing a request id taken earlier in it, too). What holds whatever
                // the batch did (another process's epoch, the store's own errors) is answered
                // as it is.
                (
                    Err(
                        e @ (StoreError::StaleEpoch
                        | StoreError::CorruptPolicy(_)
                        | StoreError::Database(_)
                        | StoreError::Pool(_)
                        | StoreError::Other(_)),
                    ),
                    _,
                ) => Err(e),
                (Err(_), Err(e)) => Err(StoreError::Other(format!("commit failed: {e}"))),
                (Err(e), Ok(())) => Err(e),
            })
        });
        deliver
    })
}

/// Has the batch's transaction ended under a write (asked when SQLite's hooks could not be
/// set)? A `BEGIN` fails inside a transaction; one that succeeds found none, and is rolled back
/// at once. (The connection does not say whether it is in a transaction; the `BEGIN` is kept
/// prepared.)
fn transaction_ended(conn: &mut SqliteConnection) -> bool {
    use diesel::RunQueryDsl;
    if hot_sql!("BEGIN", &[]).execute(conn).is_err() {
        return false;
    }
    let _ = conn.batch_execute("ROLLBACK");
    true
}

/// Let the next commit write the WAL from its beginning again.
///
/// SQLite restarts a WAL only when a write begins while every frame is in the database file, and
/// under steady writes the background (PASSIVE) checkpoint never catches up with the writer: the
/// WAL grew by every commit for as long as the writes kept coming, each commit's fsync then also
/// committed the file system's allocation of new blocks (timed on this project's disk: 0.27-0.31
/// ms for a 13 KiB append against 0.17-0.18 ms for the same write over written blocks), and a
/// crash left a WAL to be read whole at the next start. A RESTART checkpoint run by the writer
/// itself, between two batches, copies the few frames the background one has not yet and waits
/// (briefly: 2 ms at most) for readers of the old frames. If a reader stays longer it gives up
/// and the checkpointer asks again on its next round. Whether the WAL will restart.
fn restart_wal(conn: &mut SqliteConnection) -> bool {
    use diesel::RunQueryDsl;
    let restarted = conn
        .batch_execute("PRAGMA busy_timeout = 2;")
        .and_then(|()| diesel::sql_query("PRAGMA wal_checkpoint(RESTART)").get_result(conn));
    // Whatever happened, the connection waits for locks as long as before (see [`Pragmas`]).
    let reset = conn.batch_execute("PRAGMA busy_timeout = 5000;");
    match (restarted, reset) {
        (Ok(Checkpointed { busy: 0, .. }), Ok(())) => true,
        (Ok(_), Ok(())) => false,
        (Err(e), _) | (_, Err(e)) => {
            tracing::warn!(error = %e, "WAL restart failed");
            false
        }
    }
}

/// What the writer, the checkpointer and the store's handles share: the checkpointer's request
/// to restart the WAL (`WAL_RESTART_*`), the restarts the writer made, the transactions it
/// committed, and the checkpointer's rounds and syncs of the database file.
#[derive(Debug, Default)]
struct WalState {
    wanted: AtomicU8,
    done: AtomicU64,
    commits: AtomicU64,
    syncs: AtomicU64,
    /// The checkpointer's rounds.
    rounds: AtomicU64,
    /// Batches the writer began, committed or not: a lull is a time none began.
    batches: AtomicU64,
    /// Times the store gave its caches back after going idle ([`release_idle_memory`]).
    releases: AtomicU64,
    /// How long a lull lasts before that, in ms (0: [`IDLE_RELEASE_AFTER`]).
    idle_release_after_ms: AtomicU64,
    /// Group commits that failed (or were refused: see `lost`).
    failed: AtomicU64,
    /// When the batch being committed began ([`process_ms`]), 0 while none is.
    busy_since_ms: AtomicU64,
    /// The database file as opened ([`Db::watch_file`]).
    file: std::sync::OnceLock<FileIdentity>,
    /// The file was found removed or replaced: nothing more is committed (until a restart).
    lost: AtomicBool,
    /// A write was refused `stale_epoch`: another process took the home's authority.
    deposed: AtomicBool,
    /// A sync of the database file after a checkpoint failed: what the checkpoint copied may
    /// not be on the disk, and the WAL is its only sure copy. Nothing more is committed, no
    /// checkpoint runs and the WAL is never restarted (until a restart, whose recovery copies
    /// the whole WAL again).
    sync_failed: AtomicBool,
    /// For tests: the checkpointer's next sync of the database file fails.
    #[cfg(test)]
    fail_next_sync: AtomicBool,
    /// How long a commit may wait before the store is unhealthy, in ms (0: [`STALL_AFTER`]).
    stall_after_ms: AtomicU64,
}

impl WalState {
    fn idle_release_after(&self) -> Duration {
        match self.idle_release_after_ms.load(Ordering::Relaxed) {
            0 => IDLE_RELEASE_AFTER,
            ms => Duration::from_millis(ms),
        }
    }

    /// Nothing is committed any more: the file was lost, or a sync of it failed.
    fn halted(&self) -> bool {
        self.lost.load(Ordering::Relaxed) || self.sync_failed.load(Ordering::Relaxed)
    }

    /// Why nothing is committed any more: the database file was found removed or replaced, or
    /// a sync of it failed.
    fn file_health(&self) -> Result<(), String> {
        if self.sync_failed.load(Ordering::Relaxed) {
            return Err(
                "a sync of the database file failed after a checkpoint: nothing more is \
                        committed until the daemon restarts (its WAL keeps every commit)"
                    .into(),
            );
        }
        if !self.lost.load(Ordering::Relaxed) {
            return Ok(());
        }
        Err(self
            .file
            .get()
            .map(FileIdentity::lost_message)
            .unwrap_or_else(|| "the database file is gone".into()))
    }

    /// After a commit: is the file committed to still the one at its path? A commit to a file
    /// since removed or replaced is lost at the next start, so it is not acknowledged, and from
    /// then on nothing more is committed (said once in the log).
    fn confirm_file(&self) -> Result<(), String> {
        let Some(file) = self.file.get() else {
            return Ok(());
        };
        if file.still_there() {
            return Ok(());
        }
        if !self.lost.swap(true, Ordering::Relaxed) {
            tracing::error!(path = %file.path.display(),
                "the database file was removed or replaced while this daemon had it open: \
                 nothing more is acknowledged; restart the daemon");
        }
        Err(file.lost_message())
    }
}

/// A commit waiting longer than this makes the store unhealthy (`/readyz` 503).
pub const STALL_AFTER: Duration = Duration::from_secs(5);

/// Which file the database is: its path, and the device and inode it had when opened.
#[derive(Debug)]
struct FileIdentity {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

impl FileIdentity {
    fn of(path: &Path) -> std::io::Result<FileIdentity> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(path)?;
        Ok(FileIdentity {
            path: path.to_path_buf(),
            dev: m.dev(),
            ino: m.ino(),
        })
    }

    /// Is the file at the path still the one opened (not removed, not replaced)?
    fn still_there(&self) -> bool {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(&self.path).is_ok_and(|m| m.dev() == self.dev && m.ino() == self.ino)
    }

    /// Said where anyone may read it (`/readyz` needs no credentials): the file's name, not its
    /// path (the log has the path).
    fn lost_message(&self) -> String {
        format!(
            "the database file {} was removed or replaced while the daemon had it open; \
             restart the daemon",
            self.path
                .file_name()
                .map_or_else(|| "state.db".into(), |n| n.to_string_lossy())
        )
    }
}

const WAL_RESTART_NO: u8 = 0;
/// After a batch of at most [`WAL_RESTART_MAX_BATCH`] writes.
const WAL_RESTART_SOON: u8 = 1;
/// After the next batch, however large.
const WAL_RESTART_NOW: u8 = 2;
const WAL_RESTART_MAX_BATCH: usize = 16;

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
/// Say once that a write was refused `stale_epoch`: another process took the home.
fn observe_write<R>(wal: &WalState, result: &Result<R, StoreError>) {
    if matches!(result, Err(StoreError::StaleEpoch)) && !wal.deposed.swap(true, Ordering::Relaxed) {
        tracing::error!(
            "a write was refused stale_epoch: another process took this home's authority; \
             this daemon writes nothing more and should be stopped"
        );
    }
}

#[derive(Clone)]
pub struct Db {
    /// The writer's queue. It has no bound of its own: every write's caller waits for its
    /// answer, and callers are bounded where they ask (a connection's requests in flight, a
    /// session's one turn, a room's one pass). A bounded queue, once full, let writes asked
    /// for one after the other wait for room in the order their tasks were first polled,
    /// which an actor does not fix: two inputs of one session could be admitted out of order.
    writer: tokio::sync::mpsc::UnboundedSender<ToWriter>,
    wal: Arc<WalState>,
    readers: Addr<DbWorker>,
    /// The reader of clients' pages ([`Db::read_page`]), apart from `readers`.
    pages: Addr<DbWorker>,
    pool: SqlitePool,
    metrics: Option<std::sync::Arc<crate::telemetry::Metrics>>,
}

impl Db {
    /// Start the workers (one writer: SQLite has one; `readers` for snapshots; one for clients'
    /// pages): the pool needs a connection for each, and one for the checkpointer.
    pub fn start(pool: SqlitePool, readers: usize) -> Db {
        let (writer, rx) = tokio::sync::mpsc::unbounded_channel::<ToWriter>();
        let p = pool.clone();
        let wal = Arc::new(WalState::default());
        let flag = wal.clone();
        let spawned = std::thread::Builder::new()
            .name("gatehouse-db-writer".into())
            .spawn(move || writer_loop(p, rx, flag));
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start the database writer");
        }
        let p = pool.clone();
        let readers = SyncArbiter::start(readers.max(1), move || DbWorker { pool: p.clone() });
        let p = pool.clone();
        let pages = SyncArbiter::start(1, move || DbWorker { pool: p.clone() });
        Db {
            writer,
            wal,
            readers,
            pages,
            pool,
            metrics: None,
        }
    }

    /// How many times the writer restarted the WAL.
    pub fn wal_restarts(&self) -> u64 {
        self.wal.done.load(Ordering::Relaxed)
    }

    /// How many times the checkpointer synced the database file.
    pub fn checkpoint_syncs(&self) -> u64 {
        self.wal.syncs.load(Ordering::Relaxed)
    }

    /// How many times the store gave its caches back after going idle.
    pub fn idle_releases(&self) -> u64 {
        self.wal.releases.load(Ordering::Relaxed)
    }

    /// How many group-commit transactions the writer committed.
    pub fn commits(&self) -> u64 {
        self.wal.commits.load(Ordering::Relaxed)
    }

    /// How many group commits failed.
    pub fn failed_commits(&self) -> u64 {
        self.wal.failed.load(Ordering::Relaxed)
    }

    /// A commit waiting longer than `bound` makes the store unhealthy (default [`STALL_AFTER`]).
    pub fn with_stall_bound(self, bound: Duration) -> Db {
        let ms = u64::try_from(bound.as_millis()).unwrap_or(u64::MAX).max(1);
        self.wal.stall_after_ms.store(ms, Ordering::Relaxed);
        self
    }

    /// Give the store's caches back after `after` in which the writer began no batch (default
    /// [`IDLE_RELEASE_AFTER`]).
    pub fn with_idle_release(self, after: Duration) -> Db {
        let ms = u64::try_from(after.as_millis()).unwrap_or(u64::MAX).max(1);
        self.wal.idle_release_after_ms.store(ms, Ordering::Relaxed);
        self
    }

    /// Check before every acknowledgement that the database file at `path` is still the one
    /// this store opened (see [`Db::health`]).
    pub fn watch_file(&self, path: &Path) -> Result<(), StoreError> {
        let identity = FileIdentity::of(path)
            .map_err(|e| StoreError::Other(format!("{}: {e}", path.display())))?;
        let _ = self.wal.file.set(identity);
        Ok(())
    }

    /// Whether the store can acknowledge writes now; if not, why (in words for an operator):
    /// its file was removed or replaced, another process took the home's authority, or a
    /// commit has been waiting on the disk for longer than [`STALL_AFTER`].
    /// Is the writer thread still there to take writes?
    pub fn writer_alive(&self) -> bool {
        !self.writer.is_closed()
    }

    /// A sync of the database file after a checkpoint failed: nothing more is committed until
    /// a restart (whose recovery copies the whole WAL again), unlike a file found lost, which a
    /// restart would replace with an empty ledger.
    pub fn sync_failed(&self) -> bool {
        self.wal.sync_failed.load(Ordering::Relaxed)
    }

    pub fn health(&self) -> Result<(), String> {
        self.wal.file_health()?;
        if self.wal.deposed.load(Ordering::Relaxed) {
            return Err(
                "another process took this home's authority (a newer epoch): this daemon \
                 writes nothing more; stop it"
                    .into(),
            );
        }
        let since = self.wal.busy_since_ms.load(Ordering::Relaxed);
        let waited = Duration::from_millis(process_ms().saturating_sub(since));
        let bound = match self.wal.stall_after_ms.load(Ordering::Relaxed) {
            0 => STALL_AFTER,
            ms => Duration::from_millis(ms),
        };
        if since != 0 && waited > bound {
            return Err(format!(
                "a commit has been waiting on the disk for {} s",
                waited.as_secs()
            ));
        }
        Ok(())
    }

    /// Note a write's answer: `stale_epoch` means this process is no longer the home's
    /// authority (said once in the log, and by [`Db::health`] from then on).
    fn observe<R>(&self, result: &Result<R, StoreError>) {
        observe_write(&self.wal, result);
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

    /// Run a write transition on the group-commit writer; answers after its batch committed.
    ///
    /// The write is queued when this is called, not when the answer is first awaited: writes
    /// asked for one after the other commit in that order even when the tasks awaiting them
    /// are first polled in another (an actor polls its tasks in no fixed order), however long
    /// the writer's queue.
    pub fn write<R, F>(
        &self,
        f: F,
    ) -> impl std::future::Future<Output = Result<R, StoreError>> + Send + 'static
    where
        R: Send + 'static,
        F: FnOnce(&mut SqliteConnection) -> Result<R, StoreError> + Send + 'static,
    {
        let started = std::time::Instant::now();
        let (tx, rx) = oneshot::channel();
        let job = write_job(f, move |answer| {
            let _ = tx.send(answer);
        });
        let queued = self.writer.send(ToWriter::Write(job)).is_ok();
        let (metrics, wal) = (self.metrics.clone(), self.wal.clone());
        async move {
            if !queued {
                return Err(StoreError::Pool("the database writer stopped".into()));
            }
            let result = rx
                .await
                .map_err(|_| StoreError::Pool("the database writer gave no answer".into()))?;
            if let Some(m) = &metrics {
                m.db_hist.observe(started.elapsed().as_secs_f64());
                m.db_write();
            }
            observe_write(&wal, &result);
            result
        }
    }

    /// [`Db::write`] for a caller on a thread that may block (never an async task's: it blocks
    /// its thread until the commit). When the writer is gone, the write runs in a
    /// transaction of its own on a pooled connection instead (waiting for the write lock).
    pub fn write_blocking<R, F>(&self, f: F) -> Result<R, StoreError>
    where
        R: Send + 'static,
        F: FnOnce(&mut SqliteConnection) -> Result<R, StoreError> + Send + 'static,
    {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let job = write_job(f, move |answer| {
            let _ = tx.send(answer);
        });
        if let Err(tokio::sync::mpsc::error::SendError(ToWriter::Write(job))) =
            self.writer.send(ToWriter::Write(job))
        {
            // As the writer runs a job, in a transaction of one.
            self.wal.file_health().map_err(StoreError::Other)?;
            let mut conn = self.blocking_conn()?;
            let mut deliver = None;
            let mut committed = conn
                .immediate_transaction::<_, diesel::result::Error, _>(|c| {
                    deliver = Some(job(c));
                    Ok(())
                })
                .map_err(|e| e.to_string());
            if committed.is_ok() {
                committed = self.wal.confirm_file();
            }
            match deliver {
                Some(deliver) => deliver(committed),
                None => {
                    return Err(StoreError::Other(format!(
                        "cannot begin a write: {committed:?}"
                    )))
                }
            }
        }
        let result = rx
            .recv()
            .map_err(|_| StoreError::Pool("the database writer gave no answer".into()))?;
        if let Some(m) = &self.metrics {
            m.db_write();
        }
        self.observe(&result);
        result
    }

    /// Run a read on a reader worker.
    pub async fn read<R, F>(&self, f: F) -> Result<R, StoreError>
    where
        R: Send + 'static,
        F: FnOnce(&mut SqliteConnection) -> Result<R, StoreError> + Send + 'static,
    {
        self.run(&self.readers, f).await
    }

    /// Run a read of a page a client asked for (`session.events.since`, an event stream's
    /// catch-up) on the one worker kept for them. The readers serve requests in the order they
    /// came: a client that asks for many pages at once used to queue its reads ahead of other
    /// clients' resumes and receipts and the sessions' own reads (a revived supervisor's head,
    /// an answer's lookup), each waiting behind every page. Now pages wait only for pages.
    pub async fn read_page<R, F>(&self, f: F) -> Result<R, StoreError>
    where
        R: Send + 'static,
        F: FnOnce(&mut SqliteConnection) -> Result<R, StoreError> + Send + 'static,
    {
        self.run(&self.pages, f).await
    }

    /// A connection for start-up work that runs before the actors.
    pub fn blocking_conn(&self) -> Result<Conn, StoreError> {
        self.pool.get().map_err(|e| StoreError::Pool(e.to_string()))
    }
}

/// Checkpoint the WAL in the background (PASSIVE: never blocks writers or readers), often enough
/// that the writer never reaches SQLite's automatic checkpoint (see [`Pragmas`]); with nothing to
/// copy a round costs a few microseconds.
///
/// A round that finds the WAL past [`WAL_RESTART_FRAMES`] asks the writer to restart it
/// ([`restart_wal`]) once the frames left for the writer to copy are few: it checkpoints again
/// at once while its last pass still had much to copy (the writes made during a pass are all the
/// next one copies), up to a few passes, and the writer does it after a small batch only. A
/// writer so busy that neither happens is left alone until the WAL reaches
/// [`WAL_RESTART_ANYWAY_FRAMES`].
///
/// A round that copied frames syncs the database file (`path`) itself, before it asks for a
/// restart. SQLite syncs it only after a pass that caught up with the writer, which under steady
/// writes is the restart: its one `fsync` then flushed every page checkpointed since the WAL
/// last restarted (timed in the bench's isolation section: 40-80 ms, with every session's
/// commits waiting behind it). Synced round by round, the restart's own sync covers only the few
/// frames the restart copies.
///
/// After a lull ([`IDLE_RELEASE_AFTER`], or [`Db::with_idle_release`], in which the writer
/// began no batch) it gives back the pages SQLite caches, once per lull: the pool's idle
/// connections' ([`release_pooled`]), and the writer's, which the writer releases between
/// batches ([`release_idle_memory`]).
///
/// It stops once the store is let go: every [`Db`] handle dropped and the writer ended.
pub fn spawn_checkpointer(
    db: &Db,
    path: &Path,
    every: Duration,
) -> Option<std::thread::JoinHandle<()>> {
    let (pool, state) = (db.pool.clone(), Arc::downgrade(&db.wal));
    let writer = db.writer.downgrade();
    let path = path.to_path_buf();
    let spawned = std::thread::Builder::new()
        .name("gatehouse-checkpoint".into())
        .spawn(move || {
            // Never closed: closing any descriptor of a file drops every POSIX lock the process
            // holds on it, SQLite's included, and connections of the pool (readers', the
            // rooms') may outlive this thread; another process (a backup) could then take the
            // database for unused and delete the WAL under them. One descriptor per store.
            let file = std::mem::ManuallyDrop::new(
                std::fs::File::open(&path)
                    .map_err(|e| {
                        tracing::warn!(error = %e, path = %path.display(),
                            "cannot open the database file to sync checkpoints: restarts sync it all")
                    })
                    .ok(),
            );
            // How many WAL frames were in the database file as of the last sync, and the
            // writer's commits then. The count alone misses a round that copied as many frames
            // as the last one did before the WAL restarted (the same writes again).
            let (mut synced, mut synced_commits) = (0, 0);
            // The writer's batches as of the last round, since when they have not moved, and
            // whether this lull's memory was given back.
            let (mut seen, mut still_since, mut released) = (0, std::time::Instant::now(), false);
            loop {
                std::thread::sleep(every);
                let Some(wal) = state.upgrade() else {
                    return;
                };
                // Read before the round: every commit counted is in the WAL it checkpoints.
                let commits = wal.commits.load(Ordering::Acquire);
                // A batch being committed is no lull either, however long it takes.
                let batches = wal.batches.load(Ordering::Acquire);
                if batches != seen || wal.busy_since_ms.load(Ordering::Relaxed) != 0 {
                    (seen, still_since, released) = (batches, std::time::Instant::now(), false);
                } else if !released && still_since.elapsed() >= wal.idle_release_after() {
                    released = true;
                    release_pooled(&pool);
                    // The writer's connection is its own: the writer releases it (and counts
                    // the release), between batches.
                    let asked = writer
                        .upgrade()
                        .is_some_and(|w| w.send(ToWriter::Release { batches }).is_ok());
                    if !asked {
                        release_idle_memory(&wal, None);
                    }
                }
                let mut conn = match pool.get() {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::debug!(error = %e, "no connection for the background checkpoint");
                        continue;
                    }
                };
                let round = match checkpoint_round(&mut conn) {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::debug!(error = %e, "background checkpoint skipped");
                        continue;
                    }
                };
                let copied = round.checkpointed != synced
                    || (commits != synced_commits && round.checkpointed > 0);
                if copied {
                    (synced, synced_commits) = (round.checkpointed, commits);
                    if let Some(f) = &*file {
                        #[cfg(test)]
                        let synced_file = if wal.fail_next_sync.swap(false, Ordering::Relaxed) {
                            Err(std::io::Error::other("injected sync failure"))
                        } else {
                            f.sync_data()
                        };
                        #[cfg(not(test))]
                        let synced_file = f.sync_data();
                        match synced_file {
                            Ok(()) => {
                                wal.syncs.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => {
                                // After a failed fsync the kernel may have dropped the pages
                                // and a retry may report success: nothing copied since the WAL's
                                // start is sure on disk, and the WAL must be kept whole. The
                                // store stops (unhealthy, committing nothing) until a restart,
                                // whose recovery copies the whole WAL again. A warning and the
                                // next round went on, and a WAL restart overwrote the only copy.
                                wal.sync_failed.store(true, Ordering::Relaxed);
                                tracing::error!(error = %e,
                                    "the database file could not be synced after a checkpoint: \
                                     nothing more is committed and the WAL is kept; restart the \
                                     daemon");
                                break;
                            }
                        }
                    }
                }
                // A WAL that restarted on its own in a lull takes back an earlier request.
                wal.wanted.store(round.want, Ordering::Relaxed);
                // Counted last, so a round seen counted has synced what it copied.
                wal.rounds.fetch_add(1, Ordering::Release);
            }
        });
    spawned
        .map_err(|e| tracing::warn!(error = %e, "cannot start the background checkpointer"))
        .ok()
}

/// How long the store goes without a write (the writer begins no batch) before it gives its
/// caches back.
pub const IDLE_RELEASE_AFTER: Duration = Duration::from_secs(2);

/// Give back the pages `conn` caches (the writer's: readers' caches are emptied at their next
/// read after any commit, the writer's never are), and then the free memory the C allocator
/// holds, which SQLite's allocations come from (the daemon's own come from mimalloc, which
/// returns its own). A connection caches up to 2 MiB of pages: after the bench's 1,600 warm-up
/// turns the writer's held some 2.3 MiB of a daemon idle at 33.9 MiB, against 29.5 MiB at
/// start. The next writes read their pages from the operating system's cache again. Counted in
/// `wal` ([`Db::idle_releases`]).
fn release_idle_memory(wal: &WalState, conn: Option<&mut SqliteConnection>) {
    if let Some(conn) = conn {
        shrink(conn);
    }
    // SAFETY: glibc's `malloc_trim` takes each arena's lock and only returns whole free pages
    // to the system; no allocation is moved or freed.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    unsafe {
        libc::malloc_trim(0);
    }
    wal.releases.fetch_add(1, Ordering::Relaxed);
}

/// Give back the pages a connection caches (those no statement of it is using).
fn shrink(conn: &mut SqliteConnection) {
    if let Err(e) = conn.batch_execute("PRAGMA shrink_memory;") {
        tracing::debug!(error = %e, "a connection's cache stays");
    }
}

/// [`shrink`] every connection idle in the pool, each taken from it meanwhile; not while a
/// read is in flight (a connection out of the pool beside the writer's), whose cache is warm,
/// and which could take the pool's last idle connection and have another opened, for good.
fn release_pooled(pool: &SqlitePool) {
    let state = pool.state();
    if state.connections.saturating_sub(state.idle_connections) > 1 {
        return;
    }
    let mut idle = Vec::new();
    while let Some(conn) = pool.try_get() {
        idle.push(conn);
    }
    for conn in &mut idle {
        shrink(conn);
    }
}

/// Past this many frames the WAL is restarted even if the writer must copy many frames first.
const WAL_RESTART_ANYWAY_FRAMES: i64 = 65_536;
/// A pass that copied at most this many frames leaves the writer little to copy.
const WAL_RESTART_TAIL_FRAMES: i64 = 1024;

/// What a round of checkpoints left: whether (`WAL_RESTART_*`) the WAL should be restarted, and
/// how many of its frames are in the database file.
struct Round {
    want: u8,
    checkpointed: i64,
}

/// One round of PASSIVE checkpoints.
fn checkpoint_round(conn: &mut SqliteConnection) -> diesel::QueryResult<Round> {
    let mut done = checkpoint(conn)?;
    let round = |want, done: &Checkpointed| Round {
        want,
        checkpointed: done.checkpointed,
    };
    for _ in 0..4 {
        if done.log >= WAL_RESTART_ANYWAY_FRAMES {
            return Ok(round(WAL_RESTART_NOW, &done));
        }
        if done.log < WAL_RESTART_FRAMES {
            return Ok(round(WAL_RESTART_NO, &done));
        }
        let again = checkpoint(conn)?;
        // Within one WAL, the frames this pass copied; after a restart, all it copied.
        let copied = if again.checkpointed >= done.checkpointed {
            again.checkpointed - done.checkpointed
        } else {
            again.checkpointed
        };
        if copied <= WAL_RESTART_TAIL_FRAMES && again.log >= WAL_RESTART_FRAMES {
            return Ok(round(WAL_RESTART_SOON, &again));
        }
        done = again;
    }
    let want = if done.log >= WAL_RESTART_ANYWAY_FRAMES {
        WAL_RESTART_NOW
    } else {
        WAL_RESTART_NO
    };
    Ok(round(want, &done))
}

#[derive(diesel::QueryableByName)]
struct Checkpointed {
    /// 1 when the checkpoint could not finish (a lock it waited for stayed taken).
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    busy: i64,
    /// The WAL's length in frames.
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    log: i64,
    /// How many of them are in the database file.
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    checkpointed: i64,
}

/// One PASSIVE checkpoint.
fn checkpoint(conn: &mut SqliteConnection) -> diesel::QueryResult<Checkpointed> {
    use diesel::RunQueryDsl;
    diesel::sql_query("PRAGMA wal_checkpoint(PASSIVE)").get_result(conn)
}

/// Current wall time in seconds.
pub fn now() -> f64 {
    use crate::clock::Clock;
    crate::clock::SystemClock::default().now()
}

#[cfg(test)]
pub mod testing {
    use super::*;

    /// A migrated ledger with session `s1` whose input `in` has been claimed: the epoch, and
    /// the `started` row.
    pub fn started_turn() -> (
        tempfile_dir::TempDir,
        SqliteConnection,
        i64,
        admissions::AdmissionRow,
    ) {
        let (dir, mut c) = conn();
        let e = epoch::begin_epoch(&mut c, "i", 1.0).expect("epoch");
        session(&mut c, e, "s1");
        admissions::admit(&mut c, e, "p", "s1", "in", "hi", 10, 1.0).expect("admit");
        let (claimed, _) = admissions::claim_next(&mut c, e, "s1", 2.0).expect("claim");
        let admissions::Claim::Started(row) = claimed.value else {
            panic!("no claim")
        };
        (dir, c, e, *row)
    }

    /// Settle [`started_turn`]'s `row` as `outcome` at `now`, with nothing else written (no
    /// closing messages, events or usage).
    pub fn settle_bare(
        c: &mut SqliteConnection,
        epoch: i64,
        row: &admissions::AdmissionRow,
        outcome: &str,
        now: f64,
    ) {
        let generation = row.execution_generation.expect("generation");
        admissions::settle(
            c,
            epoch,
            "s1",
            &row.admission_id,
            generation,
            outcome,
            "{}",
            &[],
            &[],
            (0, 0),
            now,
        )
        .expect("settle");
    }

    /// A connection on a fresh temp file with foreign keys on, and no schema yet.
    fn fresh() -> (tempfile_dir::TempDir, SqliteConnection) {
        use diesel::Connection;
        let dir = tempfile_dir::TempDir::new();
        let path = dir.path().join("state.db");
        let mut conn = SqliteConnection::establish(&path.to_string_lossy()).expect("open");
        conn.batch_execute("PRAGMA foreign_keys = ON;")
            .expect("pragma");
        (dir, conn)
    }

    /// A migrated connection on a fresh temp file.
    pub fn conn() -> (tempfile_dir::TempDir, SqliteConnection) {
        let (dir, mut conn) = fresh();
        conn.run_pending_migrations(MIGRATIONS).expect("migrate");
        (dir, conn)
    }

    /// A connection on a fresh temp file whose schema is that before the migration ending with
    /// `suffix`: old rows go in, then the migration runs.
    pub fn conn_just_before(suffix: &str) -> (tempfile_dir::TempDir, SqliteConnection) {
        let (dir, mut conn) = fresh();
        migrate_to_just_before(&mut conn, suffix);
        (dir, conn)
    }

    /// `q`'s SQL as SQLite gets it, without diesel's list of bound values.
    pub fn sql_of<Q>(q: &Q) -> String
    where
        Q: diesel::query_builder::QueryFragment<diesel::sqlite::Sqlite>,
    {
        let s = diesel::debug_query::<diesel::sqlite::Sqlite, _>(q).to_string();
        s.split(" -- binds").next().unwrap_or_default().to_string()
    }

    /// How many `sqlite_sequence` entries `table` has (1 while it is an AUTOINCREMENT table that
    /// was written, else 0).
    pub fn sequence_entries(conn: &mut SqliteConnection, table: &str) -> i64 {
        use diesel::RunQueryDsl;
        diesel::sql_query("SELECT count(*) AS n FROM sqlite_sequence WHERE name = ?")
            .bind::<diesel::sql_types::Text, _>(table)
            .get_result::<Count>(conn)
            .expect("sequence")
            .n
    }

    /// The embedded migration whose name ends with `suffix`.
    fn migration_named(
        suffix: &str,
    ) -> Box<dyn diesel::migration::Migration<diesel::sqlite::Sqlite>> {
        use diesel::migration::MigrationSource;
        MIGRATIONS
            .migrations()
            .expect("migrations")
            .into_iter()
            .find(|m| m.name().to_string().ends_with(suffix))
            .expect("the migration")
    }

    /// Run the migration whose name ends with `suffix` alone (on a schema just before it, so
    /// that its test stays about it when later migrations are added).
    pub fn run_migration_named(
        c: &mut SqliteConnection,
        suffix: &str,
    ) -> diesel::migration::Result<()> {
        c.run_migration(&migration_named(suffix)).map(|_| ())
    }

    /// Revert the applied migrations, newest first, down to and including the one whose name
    /// ends with `suffix`.
    pub fn revert_through(c: &mut SqliteConnection, suffix: &str) {
        let target = migration_named(suffix).name().version().to_string();
        loop {
            let reverted = c.revert_last_migration(MIGRATIONS).expect("revert");
            if reverted.to_string() == target {
                return;
            }
        }
    }

    /// Bring a fresh connection's schema up to, not including, the migration whose name ends
    /// with `suffix` (to test that migration on data of the schema before it).
    pub fn migrate_to_just_before(c: &mut SqliteConnection, suffix: &str) {
        use diesel::migration::MigrationSource;
        let all = MIGRATIONS.migrations().expect("migrations");
        let mut names: Vec<String> = all.iter().map(|m| m.name().to_string()).collect();
        names.sort();
        let before = names
            .iter()
            .position(|n| n.ends_with(suffix))
            .expect("the migration");
        diesel::migration::MigrationConnection::setup(c).expect("migration table");
        for name in &names[..before] {
            let m = all
                .iter()
                .find(|m| m.name().to_string() == *name)
                .expect("migration");
            c.run_migration(m).expect("older migration");
        }
    }

    /// A text column named `detail`, for `sql_query`.
    #[derive(diesel::QueryableByName)]
    pub struct Detail {
        #[diesel(sql_type = diesel::sql_types::Text)]
        pub detail: String,
    }

    /// An integer column named `n`, for `sql_query`.
    #[derive(diesel::QueryableByName)]
    pub struct Count {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        pub n: i64,
    }

    /// What `f` returned, and the SQL of every statement it ran on `conn` (binds left out), in
    /// order.
    pub fn statements_of<T>(
        conn: &mut SqliteConnection,
        f: impl FnOnce(&mut SqliteConnection) -> T,
    ) -> (T, Vec<String>) {
        use diesel::connection::{Connection, InstrumentationEvent};
        use std::sync::{Arc, Mutex};
        let ran: Arc<Mutex<Vec<String>>> = Arc::default();
        let sink = ran.clone();
        conn.set_instrumentation(move |ev: InstrumentationEvent<'_>| {
            if let InstrumentationEvent::StartQuery { query, .. } = ev {
                if let Ok(mut v) = sink.lock() {
                    let sql = query.to_string();
                    v.push(
                        sql.split(" -- binds")
                            .next()
                            .unwrap_or_default()
                            .to_string(),
                    );
                }
            }
        });
        let out = f(conn);
        conn.set_instrumentation(|_: InstrumentationEvent<'_>| {});
        let ran = std::mem::take(&mut *ran.lock().expect("lock"));
        (out, ran)
    }

    /// The details of SQLite's plan for `sql` (`SEARCH … USING INDEX …`, `SCAN …`), one per step.
    pub fn query_plan(conn: &mut SqliteConnection, sql: &str) -> Vec<String> {
        use diesel::RunQueryDsl;
        diesel::sql_query(format!("EXPLAIN QUERY PLAN {sql}"))
            .load::<Detail>(conn)
            .expect("plan")
            .into_iter()
            .map(|s| s.detail)
            .collect()
    }

    /// Create session `id` (principal `p`, request id `id`) under authority `epoch`; on a schema
    /// from before session ordinals (a migration's test), as a row of that schema.
    pub fn session(conn: &mut SqliteConnection, epoch: i64, id: &str) {
        use diesel::RunQueryDsl;
        let ordinals: i64 = diesel::dsl::sql::<diesel::sql_types::BigInt>(
            "SELECT count(*) FROM pragma_table_info('sessions') WHERE name = 'ordinal'",
        )
        .get_result(conn)
        .expect("sessions' columns");
        if ordinals == 0 {
            diesel::sql_query(
                "INSERT INTO sessions (id, root_id, tip_session_id, principal_id, request_id, \
                 request_digest, source, model, provider, cwd, toolsets_json, profile, started_at) \
                 VALUES (?1, ?1, ?1, 'p', ?1, 'd', 'cli', 'm', 'custom', '/', '[]', 'default', 1.0)",
            )
            .bind::<diesel::sql_types::Text, _>(id)
            .execute(conn)
            .expect("session of an older schema");
            return;
        }
        super::sessions::create_or_get(conn, epoch, &new_session(id), 1.0).expect("session");
    }

    /// A session of principal `p` with no tools, its request id its own id.
    pub fn new_session(id: &str) -> super::sessions::NewSession {
        super::sessions::NewSession {
            id: id.into(),
            principal_id: "p".into(),
            request_id: id.into(),
            request_digest: "d".into(),
            source: "cli".into(),
            model: "m".into(),
            provider: "custom".into(),
            base_url: None,
            cwd: "/".into(),
            toolsets_json: "[]".into(),
            profile: "default".into(),
            title: None,
            system_prompt: None,
            seed: Vec::new(),
        }
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

#[cfg(test)]
mod schema_tests {
    use super::testing::Detail;
    use diesel::RunQueryDsl;

    #[derive(diesel::QueryableByName)]
    struct Opcode {
        #[diesel(sql_type = diesel::sql_types::Text)]
        opcode: String,
    }

    /// No write to any table builds a temporary B-tree to check a constraint (SQLite does so
    /// for every `IN` list of three or more constants, on every statement that checks it): an
    /// `INSERT` and an `UPDATE` of every column of every table compile to programs that open
    /// no ephemeral table.
    #[test]
    fn no_write_checks_its_constraints_through_a_temporary_table() {
        let (_dir, mut c) = super::testing::conn();
        let tables: Vec<Detail> = diesel::sql_query(
            "SELECT name AS detail FROM sqlite_schema WHERE type = 'table' AND name NOT LIKE 'sqlite_%' \
             AND name != '__diesel_schema_migrations' ORDER BY name",
        )
        .load(&mut c)
        .expect("tables");
        assert!(tables.len() > 10, "the schema has its tables");
        let mut offending = Vec::new();
        for t in tables.iter().map(|t| &t.detail) {
            let mut names = |filter: &str| -> Vec<String> {
                diesel::sql_query(format!(
                    "SELECT name AS detail FROM pragma_table_info('{t}') WHERE {filter} ORDER BY cid"
                ))
                .load::<Detail>(&mut c)
                .expect("columns")
                .into_iter()
                .map(|c| c.detail)
                .collect()
            };
            let (columns, values, keys) = (names("1"), names("pk = 0"), names("pk > 0"));
            let key = if keys.is_empty() {
                "rowid = ?".to_string()
            } else {
                keys.iter()
                    .map(|k| format!("{k} = ?"))
                    .collect::<Vec<_>>()
                    .join(" AND ")
            };
            let marks = vec!["?"; columns.len()].join(", ");
            let sets: Vec<String> = values.iter().map(|c| format!("{c} = ?")).collect();
            // An update of one row, as every write of the gateway is (an update of many rows
            // gathers their ids in a temporary table first, whatever the constraints).
            for sql in [
                format!("INSERT INTO {t} ({}) VALUES ({marks})", columns.join(", ")),
                format!("UPDATE {t} SET {} WHERE {key}", sets.join(", ")),
            ] {
                let program: Vec<Opcode> = diesel::sql_query(format!("EXPLAIN {sql}"))
                    .load(&mut c)
                    .expect("explain");
                if program.iter().any(|o| o.opcode == "OpenEphemeral") {
                    offending.push(sql);
                }
            }
        }
        assert!(offending.is_empty(), "temporary tables in: {offending:#?}");
    }

    /// The migration that spells the checks out keeps every row, index and trigger of the
    /// tables it copies, and the checks refuse what they refused.
    #[test]
    fn the_checks_migration_keeps_the_tables_and_what_they_refuse() {
        use diesel::connection::SimpleConnection;
        let (_dir, mut c) = super::testing::conn_just_before("_checks_without_lists");
        let e = super::epoch::begin_epoch(&mut c, "i", 1.0).expect("epoch");
        super::testing::session(&mut c, e, "s1");
        c.batch_execute(
            "INSERT INTO session_admissions (seq, admission_id, request_id, principal_id, \
               target_session_id, payload_json, payload_digest, intent, status, outcome, \
               owner_epoch, execution_generation, created_at, updated_at) VALUES \
             (3, 'a3', 'r3', 'p', 's1', '{}', 'd', 'queue', 'terminal', 'completed', 1, 1, 1.0, 1.0), \
             (5, 'a5', 'r5', 'p', 's1', '{}', 'd', 'steer', 'queued', NULL, 1, NULL, 2.0, 2.0);
             INSERT INTO messages (id, session_id, role, content, active, timestamp) VALUES \
             (4, 's1', 'user', 'one', 1, 1.0), (9, 's1', 'tool', 'two', 0, 2.0);
             INSERT INTO rooms (room_id, name, authority_gateway_id, created_at, updated_at) \
             VALUES ('r1', 'room', 'g', 1.0, 1.0);
             INSERT INTO room_tasks (room_id, task_id, thread_id, turn_id, source_event_seq, \
               payload_json, payload_digest, status, created_at, updated_at) VALUES \
             ('r1', 't1', 'th', 'tu1', 1, '{}', 'd', 'queued', 1.0, 1.0), \
             ('r1', 't2', 'th', 'tu2', 2, '{}', 'd', 'deferred', 1.0, 1.0);",
        )
        .expect("old rows");
        let text = |c: &mut diesel::sqlite::SqliteConnection, sql: &str| -> String {
            diesel::sql_query(sql)
                .load::<Detail>(c)
                .expect(sql)
                .into_iter()
                .map(|n| n.detail)
                .collect::<Vec<_>>()
                .join("; ")
        };
        let snapshot = |c: &mut diesel::sqlite::SqliteConnection| {
            [
                "SELECT type || ' ' || name AS detail FROM sqlite_schema WHERE tbl_name IN \
                 ('session_admissions', 'messages', 'room_tasks') ORDER BY type, name",
                "SELECT seq || admission_id || intent || status || ifnull(outcome, '-') AS detail \
                 FROM session_admissions ORDER BY seq",
                "SELECT id || role || content || active AS detail FROM messages ORDER BY id",
                "SELECT task_id || status AS detail FROM room_tasks ORDER BY task_id",
                "SELECT status || n AS detail FROM room_task_counts ORDER BY status",
            ]
            .map(|q| text(c, q))
        };
        let before = snapshot(&mut c);
        super::testing::run_migration_named(&mut c, "_checks_without_lists").expect("migrate");
        assert_eq!(snapshot(&mut c), before);
        assert!(
            before[0].contains("trigger room_task_counts_update"),
            "{}",
            before[0]
        );
        // The triggers count on.
        c.batch_execute("UPDATE room_tasks SET status = 'running' WHERE task_id = 't1'")
            .expect("update");
        assert_eq!(
            text(
                &mut c,
                "SELECT status || n AS detail FROM room_task_counts ORDER BY status"
            ),
            "deferred1; queued0; running1"
        );
        for refused in [
            "UPDATE session_admissions SET intent = 'shove' WHERE seq = 5",
            "UPDATE session_admissions SET status = 'lost' WHERE seq = 5",
            "UPDATE session_admissions SET outcome = 'maybe' WHERE seq = 3",
            "UPDATE messages SET role = 'narrator' WHERE id = 4",
            "UPDATE room_tasks SET status = 'paused' WHERE task_id = 't2'",
            "UPDATE room_tasks SET settlement_status = 'queued' WHERE task_id = 't2'",
        ] {
            let e = c.batch_execute(refused).expect_err(refused).to_string();
            assert!(e.contains("CHECK constraint failed"), "{refused}: {e}");
        }
        for accepted in [
            "UPDATE session_admissions SET intent = 'redirect' WHERE seq = 5",
            "UPDATE session_admissions SET outcome = 'rejected' WHERE seq = 3",
            "UPDATE messages SET role = 'system' WHERE id = 4",
            "UPDATE room_tasks SET status = 'indeterminate' WHERE task_id = 't2'",
        ] {
            c.batch_execute(accepted).expect(accepted);
        }
    }
}

#[cfg(test)]
mod hot_sql_tests {
    use diesel::query_builder::QueryId;
    use diesel::sql_types::BigInt;
    use diesel::RunQueryDsl;

    use super::{Bind, HotQuery};

    fn id_of<ST, Site: 'static>(_: &HotQuery<'_, ST, Site>) -> Option<std::any::TypeId> {
        <HotQuery<'_, ST, Site> as QueryId>::query_id()
    }

    /// Each statement is keyed in the statement cache by a type of its own: two statements run
    /// in turn on one connection each give their own answer, every time.
    #[test]
    fn each_hot_statement_is_cached_under_its_own_type() {
        let dir = super::testing::tempfile_dir::TempDir::new();
        let pool = super::open_pool(&dir.path().join("h.db"), 1).expect("pool");
        let mut c = pool.get().expect("conn");
        let plus_one = |c: &mut diesel::SqliteConnection, v: i64| -> i64 {
            hot_sql!("SELECT ? + 1", &[Bind::Int(v)])
                .returning::<BigInt>()
                .get_result(c)
                .expect("plus one")
        };
        let times_ten = |c: &mut diesel::SqliteConnection, v: i64| -> i64 {
            hot_sql!("SELECT ? * 10", &[Bind::Int(v)])
                .returning::<BigInt>()
                .get_result(c)
                .expect("times ten")
        };
        for v in 1..4 {
            assert_eq!(plus_one(&mut c, v), v + 1);
            assert_eq!(times_ten(&mut c, v), v * 10);
        }
        let a = hot_sql!("SELECT 1", &[]).returning::<BigInt>();
        let b = hot_sql!("SELECT 1", &[]).returning::<BigInt>();
        assert!(id_of(&a).is_some(), "a hot statement has a static query id");
        assert_ne!(id_of(&a), id_of(&b), "two uses share a query id");
    }

    #[test]
    fn placeholders_are_found_when_the_statement_compiles() {
        const TEXT: &str = "UPDATE t SET a = ? WHERE b = ? AND c = 'x'";
        const AT: [usize; super::count_placeholders(TEXT)] = super::placeholders(TEXT);
        assert_eq!(AT, [17, 29]);
        assert!(AT.iter().all(|&i| &TEXT[i..=i] == "?"));
        assert_eq!(super::count_placeholders("SELECT 1"), 0);
    }

    /// A text whose placeholders and values differ in number is refused, not run.
    #[test]
    fn a_hot_statement_with_the_wrong_number_of_values_is_refused() {
        let dir = super::testing::tempfile_dir::TempDir::new();
        let pool = super::open_pool(&dir.path().join("h.db"), 1).expect("pool");
        let mut c = pool.get().expect("conn");
        let few = hot_sql!("SELECT ? + ?", &[Bind::Int(1)])
            .returning::<BigInt>()
            .get_result::<i64>(&mut c);
        assert!(few.is_err(), "{few:?}");
        let many = hot_sql!("SELECT ?", &[Bind::Int(1), Bind::Int(2)])
            .returning::<BigInt>()
            .get_result::<i64>(&mut c);
        assert!(many.is_err(), "{many:?}");
    }
}

#[cfg(test)]
mod planner_tests {
    /// Configured before SQLite started, a connection has no mutex of its own (multi-thread
    /// mode); configured too late, it keeps one, and the answer says so.
    #[test]
    fn connections_opened_after_configuration_have_no_mutex() {
        let unlocked = super::configure_threading();
        let dir = super::testing::tempfile_dir::TempDir::new();
        let path = std::ffi::CString::new(dir.path().join("m.db").to_string_lossy().as_bytes())
            .expect("path");
        let mut db: *mut libsqlite3_sys::sqlite3 = std::ptr::null_mut();
        // SAFETY: plain C API use on a connection this test owns and closes.
        let mutex = unsafe {
            assert_eq!(
                libsqlite3_sys::sqlite3_open(path.as_ptr(), &mut db),
                libsqlite3_sys::SQLITE_OK
            );
            let m = libsqlite3_sys::sqlite3_db_mutex(db);
            libsqlite3_sys::sqlite3_close(db);
            m
        };
        assert_eq!(mutex.is_null(), unlocked, "configured: {unlocked}");
    }

    /// Every connection opened after installation has the planner stability guarantee on.
    #[test]
    fn new_connections_get_the_planner_stability_guarantee() {
        super::install_planner_stability();
        let dir = super::testing::tempfile_dir::TempDir::new();
        let path = std::ffi::CString::new(dir.path().join("q.db").to_string_lossy().as_bytes())
            .expect("path");
        let mut db: *mut libsqlite3_sys::sqlite3 = std::ptr::null_mut();
        // SAFETY: plain C API use on a connection this test owns and closes.
        unsafe {
            assert_eq!(
                libsqlite3_sys::sqlite3_open(path.as_ptr(), &mut db),
                libsqlite3_sys::SQLITE_OK
            );
            let mut on: std::ffi::c_int = -1;
            libsqlite3_sys::sqlite3_db_config(
                db,
                libsqlite3_sys::SQLITE_DBCONFIG_ENABLE_QPSG,
                -1 as std::ffi::c_int,
                &mut on as *mut std::ffi::c_int,
            );
            libsqlite3_sys::sqlite3_close(db);
            assert_eq!(on, 1, "QPSG must be on for new connections");
        }
    }
}

#[cfg(test)]
mod wal_restart_tests {
    use super::*;

    /// The values in the tests' table `t`, in order.
    async fn values_of_t(db: &Db) -> Vec<i64> {
        use diesel::RunQueryDsl;
        db.read(|c| {
            let rows: Vec<testing::Count> =
                diesel::sql_query("SELECT v AS n FROM t ORDER BY v").load(c)?;
            Ok(rows.into_iter().map(|r| r.n).collect::<Vec<i64>>())
        })
        .await
        .expect("rows")
    }

    /// A store opened after a crash keeps the WAL the crash left: its first connection reads it
    /// back (every commit in it is there), and the background checkpointer copies it to the
    /// database file later. The connection that probes the store, closed first, was the last
    /// one open: it copied the whole WAL into the database file, synced it and deleted the WAL,
    /// in the start's path.
    #[test]
    fn a_crash_wal_is_read_back_and_left_to_the_checkpointer() {
        use diesel::RunQueryDsl;
        let dir = testing::tempfile_dir::TempDir::new();
        let (live, crashed) = (dir.path().join("live"), dir.path().join("crashed"));
        for d in [&live, &crashed] {
            std::fs::create_dir_all(d).expect("dir");
        }
        // The crash's image: the store's files copied while it is open, its commits in the WAL
        // alone (no checkpoint has run: the automatic one is kept out of reach).
        let pool = open_pool(&live.join("state.db"), 1).expect("pool");
        let mut conn = pool.get().expect("conn");
        conn.batch_execute("CREATE TABLE t (v INTEGER NOT NULL)")
            .expect("table");
        for v in 0..64 {
            diesel::sql_query(format!("INSERT INTO t (v) VALUES ({v})"))
                .execute(&mut conn)
                .expect("insert");
        }
        for name in ["state.db", "state.db-wal"] {
            std::fs::copy(live.join(name), crashed.join(name)).expect("copy");
        }
        drop(conn);
        drop(pool);
        let (db, wal) = (crashed.join("state.db"), crashed.join("state.db-wal"));
        let len = |f: &Path| std::fs::metadata(f).map(|m| m.len()).ok();
        let (pages, left) = (len(&db), len(&wal).expect("the crash's WAL"));
        assert!(left > 64 * 1024, "the commits are in the WAL: {left} bytes");

        let pool = open_pool(&db, 2).expect("the store after the crash");
        assert_eq!(
            len(&wal),
            Some(left),
            "the WAL is left as the crash left it"
        );
        assert_eq!(len(&db), pages, "nothing was copied into the database file");
        let rows: testing::Count = diesel::sql_query("SELECT count(*) AS n FROM t")
            .get_result(&mut pool.get().expect("conn"))
            .expect("count");
        assert_eq!(rows.n, 64, "every commit in the WAL was read back");
    }

    /// The pool keeps its connections for good (neither idle time nor age closes one), so no
    /// reaper wakes to look for them either.
    #[test]
    fn the_pool_closes_no_connection_for_its_idleness_or_age() {
        let dir = testing::tempfile_dir::TempDir::new();
        let pool = open_pool(&dir.path().join("state.db"), 2).expect("pool");
        assert_eq!(pool.idle_timeout(), None);
        assert_eq!(pool.max_lifetime(), None);
    }

    /// A store opened while another connection holds the file's lock waits for it (up to the
    /// busy timeout) instead of failing at once: the timeout is the first setting each
    /// connection takes. It came after `journal_mode`, whose change needs the lock, so an open
    /// that met a held lock failed with "database is locked" without waiting.
    #[test]
    fn a_store_opened_while_its_lock_is_held_waits_for_the_lock() {
        use diesel::Connection;
        let dir = testing::tempfile_dir::TempDir::new();
        let path = dir.path().join("state.db");
        let url = path.to_string_lossy().to_string();
        // A file still in rollback mode, its lock held by another connection.
        let mut holder = SqliteConnection::establish(&url).expect("holder");
        holder
            .batch_execute("CREATE TABLE t (v INTEGER); BEGIN EXCLUSIVE;")
            .expect("lock held");
        let (tx, rx) = std::sync::mpsc::channel();
        let opener = std::thread::spawn(move || {
            let _ = tx.send(open_pool(&path, 1).map(|_| ()).map_err(|e| e.to_string()));
        });
        // A refusal comes at once; a wait is still waiting.
        let early = rx.recv_timeout(Duration::from_millis(300));
        assert!(early.is_err(), "the open did not wait: {early:?}");
        holder.batch_execute("COMMIT").expect("lock released");
        let opened = rx.recv_timeout(Duration::from_secs(5)).expect("opened");
        assert_eq!(opened, Ok(()), "the open waited for the lock");
        opener.join().expect("opener");
    }

    /// Clients' pages wait only for pages: while a page read that does not return holds the
    /// pages' reader, with more pages queued behind it, a read answers at once.
    #[test]
    fn a_held_page_read_holds_up_no_other_read() {
        let dir = testing::tempfile_dir::TempDir::new();
        let pool = open_pool(&dir.path().join("state.db"), 4).expect("pool");
        actix_rt::System::new().block_on(async {
            let db = Db::start(pool, 1);
            let (started, began) = tokio::sync::oneshot::channel::<()>();
            let (open, gate) = std::sync::mpsc::channel::<()>();
            let held = {
                let db = db.clone();
                actix_rt::spawn(async move {
                    db.read_page(move |_| {
                        let _ = started.send(());
                        gate.recv().map_err(|e| StoreError::Other(e.to_string()))
                    })
                    .await
                })
            };
            began.await.expect("the held page started");
            let queued: Vec<_> = (0..3)
                .map(|n| {
                    let db = db.clone();
                    actix_rt::spawn(async move { db.read_page(move |_| Ok(n)).await })
                })
                .collect();
            let answered = tokio::time::timeout(Duration::from_secs(5), db.read(|_| Ok(7)))
                .await
                .expect("a read waited behind the pages");
            assert_eq!(answered.expect("the read"), 7);
            open.send(()).expect("release the held page");
            held.await.expect("held task").expect("held page");
            for (n, page) in queued.into_iter().enumerate() {
                assert_eq!(page.await.expect("page task").expect("page"), n);
            }
        });
    }

    /// The writes of one group commit are each all or nothing: a failed write's statements are
    /// undone and the others of its batch commit, nested writes included.
    #[test]
    fn a_failed_write_of_a_batch_leaves_the_others_committed() {
        use diesel::RunQueryDsl;
        let dir = testing::tempfile_dir::TempDir::new();
        let pool = open_pool(&dir.path().join("state.db"), 4).expect("pool");
        let rows = actix_rt::System::new().block_on(async {
            let db = Db::start(pool, 1);
            db.write(|c| Ok(c.batch_execute("CREATE TABLE t (v INTEGER NOT NULL)")?))
                .await
                .expect("table");
            // The first write holds the writer until every other one is queued behind it, so
            // they are taken as one batch.
            let (open, gate) = std::sync::mpsc::channel::<()>();
            let held = db.write(move |_| gate.recv().map_err(|e| StoreError::Other(e.to_string())));
            let insert = |c: &mut SqliteConnection, v: i64| -> Result<(), StoreError> {
                diesel::sql_query(format!("INSERT INTO t (v) VALUES ({v})")).execute(c)?;
                Ok(())
            };
            type Answer<'a> =
                std::pin::Pin<Box<dyn std::future::Future<Output = Result<i64, StoreError>> + 'a>>;
            let mut writes: Vec<Answer<'_>> = (0..20i64)
                .map(|v| {
                    Box::pin(db.write(move |c| {
                        write_tx(c, |c| {
                            insert(c, v)?;
                            // A nested write that fails is undone alone.
                            let inner: Result<(), StoreError> = write_tx(c, |c| {
                                insert(c, 1000 + v)?;
                                Err(StoreError::Other("inner".into()))
                            });
                            if inner.is_ok() {
                                return Err(StoreError::Other("the inner write passed".into()));
                            }
                            if v % 2 == 1 {
                                return Err(StoreError::Other(format!("odd {v}")));
                            }
                            Ok(v)
                        })
                    })) as Answer<'_>
                })
                .collect();
            // Polled after every write above has been sent.
            writes.push(Box::pin(async move {
                open.send(())
                    .map_err(|e| StoreError::Other(e.to_string()))?;
                Ok(-1)
            }));
            let (first, answers) =
                futures_util::future::join(held, futures_util::future::join_all(writes)).await;
            first.expect("held");
            for (v, a) in answers.iter().enumerate().take(20) {
                assert_eq!(a.is_ok(), v % 2 == 0, "write {v}: {a:?}");
            }
            values_of_t(&db).await
        });
        assert_eq!(rows, (0..20).step_by(2).collect::<Vec<i64>>());
    }

    /// A write that panics is answered as not written, and the writer goes on: the thread died
    /// with it, and every later write of the process failed ("the database writer stopped").
    #[test]
    fn a_write_that_panics_leaves_the_writer_working() {
        use diesel::RunQueryDsl;
        let dir = testing::tempfile_dir::TempDir::new();
        let pool = open_pool(&dir.path().join("state.db"), 4).expect("pool");
        let (panicked, after, rows) = actix_rt::System::new().block_on(async {
            let db = Db::start(pool, 1);
            db.write(|c| Ok(c.batch_execute("CREATE TABLE t (v INTEGER NOT NULL)")?))
                .await
                .expect("table");
            let panicked = db
                .write(|c| -> Result<(), StoreError> {
                    diesel::sql_query("INSERT INTO t (v) VALUES (1)").execute(c)?;
                    panic!("a bug in a write");
                })
                .await;
            let after = db
                .write(|c| {
                    diesel::sql_query("INSERT INTO t (v) VALUES (2)").execute(c)?;
                    Ok(())
                })
                .await;
            let rows = values_of_t(&db).await;
            assert!(db.writer_alive());
            (panicked.is_err(), after.is_ok(), rows)
        });
        assert!(panicked, "the panicked write is not answered as written");
        assert!(after, "the writer takes writes after it");
        assert_eq!(rows, [2], "nothing of the panicked write committed");
    }

    /// After a batch that failed, the writer keeps its connection (it is not broken): the next
    /// batch does not wait for the pool, whose other connections may all be busy. It gave the
    /// connection back and asked again, and with the pool taken the next batch was dropped.
    #[test]
    fn a_failed_batch_keeps_the_writers_connection() {
        use diesel::RunQueryDsl;
        let dir = testing::tempfile_dir::TempDir::new();
        let pool = open_pool(&dir.path().join("state.db"), 3).expect("pool");
        let taken = pool.clone();
        let (after, rows) = actix_rt::System::new().block_on(async {
            let db = Db::start(pool, 1);
            db.write(|c| Ok(c.batch_execute("CREATE TABLE t (v INTEGER NOT NULL)")?))
                .await
                .expect("table");
            let failed = db
                .write(|_| -> Result<(), StoreError> { panic!("a failed batch") })
                .await;
            assert!(failed.is_err());
            // Every connection the pool can give now is held elsewhere (busy readers).
            let mut held = Vec::new();
            while let Ok(c) = taken.get_timeout(Duration::from_millis(200)) {
                held.push(c);
            }
            let after = tokio::time::timeout(
                Duration::from_secs(5),
                db.write(|c| {
                    diesel::sql_query("INSERT INTO t (v) VALUES (2)").execute(c)?;
                    Ok(())
                }),
            )
            .await;
            drop(held);
            let rows = values_of_t(&db).await;
            (after, rows)
        });
        assert!(matches!(after, Ok(Ok(()))), "{after:?}");
        assert_eq!(rows, [2]);
    }

    /// A write under which SQLite ends the whole batch's transaction (here a trigger's
    /// ROLLBACK; an I/O error or a full disk do the same) fails the batch, and no write after it
    /// commits on its own: they did, each in a transaction of its own, and were answered that
    /// they had failed.
    #[test]
    fn a_write_that_ends_the_batchs_transaction_commits_nothing_after_it() {
        let (answers, rows) = a_batch_with_a_doomed_write(false);
        assert_eq!(answers, [false; 6], "the batch failed whole");
        assert_eq!(rows, Vec::<i64>::new(), "and nothing of it committed");
    }

    /// The same when the write under which the transaction ended went on as if nothing had
    /// happened (a step it may do without, a claim answered apart from its admission): the
    /// writes after it each committed in a transaction of their own, answered as failed.
    #[test]
    fn a_write_that_goes_on_after_its_transaction_ended_commits_nothing_after_it() {
        let (answers, rows) = a_batch_with_a_doomed_write(true);
        assert_eq!(answers, [false; 6], "the batch failed whole");
        assert_eq!(rows, Vec::<i64>::new(), "and nothing of it committed");
    }

    /// Writes asked for one after the other commit in that order however many are queued
    /// before them and whichever of their answers is awaited first: past 4,096 queued writes
    /// they waited for room in the order they were first awaited, and a session's second input
    /// could be admitted before its first.
    #[test]
    fn writes_commit_in_the_order_asked_behind_a_long_queue() {
        use diesel::RunQueryDsl;
        let dir = testing::tempfile_dir::TempDir::new();
        let pool = open_pool(&dir.path().join("state.db"), 4).expect("pool");
        let order = actix_rt::System::new().block_on(async {
            let db = Db::start(pool, 1);
            db.write(|c| {
                Ok(c.batch_execute(
                    "CREATE TABLE t (n INTEGER PRIMARY KEY AUTOINCREMENT, v TEXT NOT NULL)",
                )?)
            })
            .await
            .expect("table");
            let (open, held) = hold_writer(&db);
            let queued: Vec<_> = (0..4200).map(|_| db.write(|_| Ok(()))).collect();
            let insert = |v: &'static str| {
                db.write(move |c| {
                    diesel::sql_query(format!("INSERT INTO t (v) VALUES ('{v}')")).execute(c)?;
                    Ok(())
                })
            };
            let (first, second) = (insert("first"), insert("second"));
            open.send(()).expect("open the gate");
            // The second answer is awaited first.
            let second = actix_rt::spawn(second);
            tokio::task::yield_now().await;
            let first = actix_rt::spawn(first);
            held.await.expect("the held batch");
            futures_util::future::join_all(queued).await;
            second.await.expect("joined").expect("second");
            first.await.expect("joined").expect("first");
            db.read(|c| {
                #[derive(diesel::QueryableByName)]
                struct Row {
                    #[diesel(sql_type = diesel::sql_types::Text)]
                    v: String,
                }
                let rows: Vec<Row> = diesel::sql_query("SELECT v FROM t ORDER BY n").load(c)?;
                Ok(rows.into_iter().map(|r| r.v).collect::<Vec<_>>())
            })
            .await
            .expect("rows")
        });
        assert_eq!(order, ["first", "second"]);
    }

    /// A refusal a write read from an earlier write of its batch is answered as a storage
    /// failure when the batch is rolled back: the state it was refused for never was (it was
    /// answered as the refusal, `admission_conflict` here, and the caller did not try again).
    #[test]
    fn a_refusal_read_from_a_rolled_back_batch_is_a_storage_failure() {
        use diesel::RunQueryDsl;
        let dir = testing::tempfile_dir::TempDir::new();
        let pool = open_pool(&dir.path().join("state.db"), 4).expect("pool");
        let (first, second, rows) = actix_rt::System::new().block_on(async {
            let db = Db::start(pool, 1);
            let (first, second) = in_a_doomed_batch(
                &db,
                |c| {
                    write_tx(c, |c| {
                        diesel::sql_query("INSERT INTO t (v) VALUES (1)").execute(c)?;
                        Ok(())
                    })
                },
                // Refused for what the first write did.
                |c| {
                    let seen = diesel::sql_query(
                        "INSERT INTO t (v) SELECT 2 WHERE EXISTS (SELECT 1 FROM t)",
                    )
                    .execute(c)?;
                    if seen > 0 {
                        return Err(StoreError::AdmissionConflict(
                            "the first write's row".into(),
                        ));
                    }
                    Ok(())
                },
            )
            .await;
            (first, second, values_of_t(&db).await)
        });
        assert!(first.is_err());
        assert!(
            matches!(second, Err(StoreError::Other(ref m)) if m.contains("commit failed")),
            "{second:?}"
        );
        assert_eq!(rows, Vec::<i64>::new(), "nothing of the batch committed");
    }

    /// A session request refused for reusing a request id that an earlier write of the same
    /// batch took, the batch then rolled back, is a storage failure: the session it conflicts
    /// with never existed (the refusal was `invalid_params`, for good).
    #[test]
    fn a_reused_request_refused_in_a_rolled_back_batch_is_a_storage_failure() {
        let dir = testing::tempfile_dir::TempDir::new();
        let pool = open_pool(&dir.path().join("state.db"), 4).expect("pool");
        let epoch = {
            let mut c = pool.get().expect("conn");
            epoch::begin_epoch(&mut c, "i", 1.0).expect("epoch")
        };
        let (first, second, sessions) = actix_rt::System::new().block_on(async {
            let db = Db::start(pool, 1);
            let (first, second) = in_a_doomed_batch(
                &db,
                move |c| sessions::create_or_get(c, epoch, &testing::new_session("s"), 1.0),
                move |c| {
                    let mut other = testing::new_session("s");
                    other.request_digest = "other".into();
                    sessions::create_or_get(c, epoch, &other, 1.0)
                },
            )
            .await;
            let sessions = db.read(|c| sessions::find(c, "s")).await.expect("read");
            (first, second, sessions)
        });
        assert!(first.is_err());
        assert!(
            matches!(second, Err(StoreError::Other(ref m)) if m.contains("commit failed")),
            "{second:?}"
        );
        assert!(sessions.is_none(), "nothing of the batch committed");
    }

    /// The tables of the batch tests: `t`, and `doom`, whose every insert rolls the whole    /// The tables of the batch tests: `t`, and `doom`, whose every insert rolls the whole
    /// transaction back (as an I/O error or a full disk do).
    async fn doom_tables(db: &Db) {
        db.write(|c| {
            Ok(c.batch_execute(
                "CREATE TABLE t (v INTEGER NOT NULL); CREATE TABLE doom (v INTEGER);
                 CREATE TRIGGER doom_all BEFORE INSERT ON doom
                 BEGIN SELECT RAISE(ROLLBACK, 'the batch is rolled back'); END;",
            )?)
        })
        .await
        .expect("tables");
    }

    /// Hold the writer in a batch of its own until the sender is used (the writes asked for
    /// meanwhile are then taken as one batch); the held write's answer.
    fn hold_writer(
        db: &Db,
    ) -> (
        std::sync::mpsc::Sender<()>,
        impl std::future::Future<Output = Result<(), StoreError>>,
    ) {
        let (open, gate) = std::sync::mpsc::channel::<()>();
        let (running, runs) = std::sync::mpsc::channel::<()>();
        let held = db.write(move |_| {
            let _ = running.send(());
            gate.recv().map_err(|e| StoreError::Other(e.to_string()))
        });
        runs.recv().expect("the writer holds");
        (open, held)
    }

    /// `first`, then `second`, written in one batch that a later write of it ends (rolled back
    /// whole, as an I/O error or a full disk does): their answers.
    async fn in_a_doomed_batch<A, B>(
        db: &Db,
        first: impl FnOnce(&mut SqliteConnection) -> Result<A, StoreError> + Send + 'static,
        second: impl FnOnce(&mut SqliteConnection) -> Result<B, StoreError> + Send + 'static,
    ) -> (Result<A, StoreError>, Result<B, StoreError>)
    where
        A: Send + 'static,
        B: Send + 'static,
    {
        use diesel::RunQueryDsl;
        doom_tables(db).await;
        let (open, held) = hold_writer(db);
        let (first, second) = (db.write(first), db.write(second));
        let doomed = db.write(|c| {
            write_tx(c, |c| {
                diesel::sql_query("INSERT INTO doom (v) VALUES (0)").execute(c)?;
                Ok::<_, StoreError>(())
            })
        });
        open.send(()).expect("open the gate");
        held.await.expect("the held batch");
        let answers = (first.await, second.await);
        assert!(doomed.await.is_err());
        answers
    }

    /// A batch of six writes whose second ends the batch's transaction (and answers its error,
    /// or goes on when `swallowed`): whether each was answered as written, and what committed.
    fn a_batch_with_a_doomed_write(swallowed: bool) -> (Vec<bool>, Vec<i64>) {
        a_batch_with_a_doomed_write_then(swallowed, false)
    }

    /// A write that goes on writing after SQLite ended the batch's transaction under it: its
    /// later statements each committed on their own (autocommit), though the write and its
    /// batch were answered as failed.
    #[test]
    fn statements_of_a_write_after_its_batch_ended_commit_nothing() {
        let (answers, rows) = a_batch_with_a_doomed_write_then(true, true);
        assert_eq!(answers, [false; 6], "the batch failed whole");
        assert_eq!(rows, Vec::<i64>::new(), "and nothing of it committed");
    }

    /// [`a_batch_with_a_doomed_write`], the doomed write then inserting 9 into `t` when
    /// `writes_on`.
    fn a_batch_with_a_doomed_write_then(swallowed: bool, writes_on: bool) -> (Vec<bool>, Vec<i64>) {
        use diesel::RunQueryDsl;
        let dir = testing::tempfile_dir::TempDir::new();
        let pool = open_pool(&dir.path().join("state.db"), 4).expect("pool");
        actix_rt::System::new().block_on(async {
            let db = Db::start(pool, 1);
            doom_tables(&db).await;
            // The writer is held in a batch of its own until every write below is queued
            // behind it: they are then taken as one batch.
            let (open, held) = hold_writer(&db);
            let write = |sql: &'static str| {
                db.write(move |c| {
                    write_tx(c, |c| {
                        diesel::sql_query(sql).execute(c)?;
                        Ok(())
                    })
                })
            };
            let before = write("INSERT INTO t (v) VALUES (1)");
            let doomed = db.write(move |c| {
                let ended = write_tx(c, |c| {
                    diesel::sql_query("INSERT INTO doom (v) VALUES (0)").execute(c)?;
                    Ok::<_, StoreError>(())
                });
                if writes_on {
                    let _ = diesel::sql_query("INSERT INTO t (v) VALUES (9)").execute(c);
                }
                if swallowed {
                    return Ok(());
                }
                ended
            });
            let after: Vec<_> = (2..6)
                .map(|v| {
                    db.write(move |c| {
                        write_tx(c, |c| {
                            diesel::sql_query(format!("INSERT INTO t (v) VALUES ({v})"))
                                .execute(c)?;
                            Ok(())
                        })
                    })
                })
                .collect();
            open.send(()).expect("open the gate");
            held.await.expect("the held batch");
            let mut answers = vec![before.await.is_ok(), doomed.await.is_ok()];
            for a in futures_util::future::join_all(after).await {
                answers.push(a.is_ok());
            }
            let rows = values_of_t(&db).await;
            (answers, rows)
        })
    }

    /// When the writer cannot take a blocking caller's write (it is gone), the write runs as the
    /// writer would run it, in an immediate transaction of its own: committed before the answer
    /// when it succeeds, undone when it fails, and not counted among the writer's commits.
    #[test]
    fn a_write_the_writer_cannot_take_runs_in_a_transaction_of_its_own() {
        use diesel::RunQueryDsl;
        let dir = testing::tempfile_dir::TempDir::new();
        let path = dir.path().join("state.db");
        let pool = open_pool(&path, 4).expect("pool");
        let db = actix_rt::System::new().block_on(async {
            let mut db = Db::start(pool, 1);
            db.write(|c| Ok(c.batch_execute("CREATE TABLE t (v INTEGER NOT NULL)")?))
                .await
                .expect("table");
            // A writer that takes nothing more: every write is refused by its queue.
            let (closed, gone) = tokio::sync::mpsc::unbounded_channel::<ToWriter>();
            drop(gone);
            db.writer = closed;
            db
        });
        let before = db.commits();
        let insert = |v: i64, fail: bool| {
            move |c: &mut SqliteConnection| {
                write_tx(c, |c| {
                    diesel::sql_query(format!("INSERT INTO t (v) VALUES ({v})")).execute(c)?;
                    if fail {
                        return Err(StoreError::Other(format!("refused {v}")));
                    }
                    Ok(v)
                })
            }
        };
        let written = std::thread::spawn({
            let db = db.clone();
            move || {
                (
                    db.write_blocking(insert(1, false)),
                    db.write_blocking(insert(2, true)),
                )
            }
        })
        .join()
        .expect("thread");
        assert_eq!(written.0.expect("committed"), 1);
        assert!(matches!(written.1, Err(StoreError::Other(ref m)) if m == "refused 2"));
        assert_eq!(db.commits(), before);
        // What another connection reads: the committed write, and nothing of the failed one.
        let mut other =
            <SqliteConnection as diesel::Connection>::establish(&path.to_string_lossy())
                .expect("open");
        let rows: Vec<testing::Count> = diesel::sql_query("SELECT v AS n FROM t ORDER BY v")
            .load(&mut other)
            .expect("rows");
        assert_eq!(rows.into_iter().map(|r| r.n).collect::<Vec<_>>(), vec![1]);
    }

    /// The checkpointer syncs the database file after a round that copied frames (the restart's
    /// sync is then short), and not in rounds that found nothing to copy, also when the frames
    /// it copied are as many as it copied before a WAL restart.
    /// A failed sync of the database file after a checkpoint halts the store: the next write
    /// is refused, health says why, no checkpoint round runs and the WAL is not restarted (the
    /// sync's failure was logged and every round went on).
    #[test]
    fn a_failed_sync_of_the_database_file_halts_the_store() {
        let dir = testing::tempfile_dir::TempDir::new();
        let path = dir.path().join("state.db");
        let pool = open_pool(&path, 4).expect("pool");
        actix_rt::System::new().block_on(async {
            let db = Db::start(pool, 1);
            db.wal.fail_next_sync.store(true, Ordering::Relaxed);
            spawn_checkpointer(&db, &path, Duration::from_millis(5));
            db.write(|c| Ok(c.batch_execute("CREATE TABLE w (v BLOB NOT NULL)")?))
                .await
                .expect("table");
            db.write(|c| Ok(c.batch_execute("INSERT INTO w (v) VALUES (zeroblob(4096))")?))
                .await
                .expect("a row");
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            while !db.wal.sync_failed.load(Ordering::Relaxed) {
                assert!(std::time::Instant::now() < deadline, "no sync was tried");
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            let health = db.health().expect_err("unhealthy");
            assert!(health.contains("sync"), "{health}");
            let refused = db
                .write(|c| Ok(c.batch_execute("INSERT INTO w (v) VALUES (zeroblob(10))")?))
                .await;
            assert!(refused.is_err(), "committed after a failed sync");
            let (rounds, restarts) = (
                db.wal.rounds.load(Ordering::Acquire),
                db.wal.done.load(Ordering::Relaxed),
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert_eq!(
                db.wal.rounds.load(Ordering::Acquire),
                rounds,
                "rounds went on"
            );
            assert_eq!(
                db.wal.done.load(Ordering::Relaxed),
                restarts,
                "the WAL restarted"
            );
        });
    }

    #[test]
    fn the_checkpointer_syncs_what_it_copied_and_nothing_more() {
        let dir = testing::tempfile_dir::TempDir::new();
        let path = dir.path().join("state.db");
        let pool = open_pool(&path, 4).expect("pool");
        actix_rt::System::new().block_on(async {
            let db = Db::start(pool, 1);
            spawn_checkpointer(&db, &path, Duration::from_millis(5));
            db.write(|c| Ok(c.batch_execute("CREATE TABLE w (v BLOB NOT NULL)")?))
                .await
                .expect("table");
            let rounds_after = |n: u64| {
                let wal = db.wal.clone();
                let from = wal.rounds.load(Ordering::Relaxed);
                async move {
                    let deadline = std::time::Instant::now() + Duration::from_secs(30);
                    while wal.rounds.load(Ordering::Acquire) < from + n {
                        assert!(std::time::Instant::now() < deadline, "the rounds stopped");
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                }
            };
            let mut syncs = db.checkpoint_syncs();
            // Each pass writes the same frames: once a pass is all checkpointed, the next one's
            // write restarts the WAL from its first frame, and the WAL then holds as many frames,
            // as many of them copied, as after the pass before.
            for _ in 0..3 {
                db.write(|c| {
                    for _ in 0..20 {
                        c.batch_execute("INSERT INTO w (v) VALUES (zeroblob(4096))")?;
                    }
                    Ok(())
                })
                .await
                .expect("insert");
                rounds_after(2).await;
                let now = db.checkpoint_syncs();
                assert!(
                    now > syncs,
                    "copied frames were not synced ({syncs} → {now})"
                );
                syncs = now;
                // Idle: later rounds find every frame copied and synced already.
                rounds_after(5).await;
                assert_eq!(db.checkpoint_syncs(), syncs, "an idle round synced");
            }
        });
    }

    /// After a lull without writes the writer gives back the pages its connection cached, once
    /// per lull: rounds that find the store still idle do nothing more, and a write starts the
    /// count again.
    #[test]
    fn the_writer_gives_its_cache_back_once_per_lull() {
        let dir = testing::tempfile_dir::TempDir::new();
        let path = dir.path().join("state.db");
        let pool = open_pool(&path, 4).expect("pool");
        actix_rt::System::new().block_on(async {
            let db = Db::start(pool, 1).with_idle_release(Duration::from_millis(50));
            spawn_checkpointer(&db, &path, Duration::from_millis(5));
            let released = |n: u64| {
                let db = db.clone();
                async move {
                    let deadline = std::time::Instant::now() + Duration::from_secs(30);
                    while db.idle_releases() < n {
                        assert!(std::time::Instant::now() < deadline, "no release came");
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                }
            };
            // What the writer's own connection caches.
            let cached = |c: &mut SqliteConnection| -> Result<i64, StoreError> {
                use diesel::RunQueryDsl;
                Ok(diesel::sql_query("SELECT cache_used() AS n")
                    .get_result::<testing::Count>(c)?
                    .n)
            };
            // Several MiB of rows: the writer's cache fills to its bound (2 MiB of pages).
            let full = db
                .write(move |c| {
                    c.batch_execute(
                        "CREATE TABLE w (v BLOB NOT NULL); \
                         WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n \
                         WHERE i < 4000) INSERT INTO w SELECT randomblob(1000) FROM n;",
                    )?;
                    cached(c)
                })
                .await
                .expect("rows");
            assert!(full > 1 << 20, "the cache never filled: {full} bytes");
            released(1).await;
            // Read by a write of its own, which ends the lull: the next one releases again.
            let after = db.write(cached).await.expect("read");
            assert!(
                after < full / 8,
                "the writer's cache stayed: {full} bytes full, {after} after the lull"
            );
            released(2).await;
            // Still idle: no round releases again.
            let rounds = db.wal.rounds.load(Ordering::Acquire);
            while db.wal.rounds.load(Ordering::Acquire) < rounds + 20 {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            assert_eq!(db.idle_releases(), 2, "an idle round released again");
        });
    }

    /// The checkpointer ends with the store: once every handle is dropped (and so the writer
    /// ended), its thread returns instead of checkpointing a database nobody uses.
    #[test]
    fn the_checkpointer_stops_once_the_store_is_dropped() {
        let dir = testing::tempfile_dir::TempDir::new();
        let path = dir.path().join("state.db");
        let pool = open_pool(&path, 4).expect("pool");
        let thread = actix_rt::System::new().block_on(async {
            let db = Db::start(pool, 1);
            let thread = spawn_checkpointer(&db, &path, Duration::from_millis(5)).expect("thread");
            db.write(|c| Ok(c.batch_execute("CREATE TABLE w (v INTEGER)")?))
                .await
                .expect("table");
            assert!(
                !thread.is_finished(),
                "it stopped while the store was in use"
            );
            thread
        });
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !thread.is_finished() {
            assert!(
                std::time::Instant::now() < deadline,
                "the checkpointer outlived its store"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// A commit that waits on the disk past the bound makes the store unhealthy while it waits
    /// (the writer is held here by a write that blocks, as a frozen disk holds its `fsync`).
    #[test]
    fn a_commit_waiting_past_the_bound_makes_the_store_unhealthy_while_it_waits() {
        let dir = testing::tempfile_dir::TempDir::new();
        let pool = open_pool(&dir.path().join("state.db"), 4).expect("pool");
        actix_rt::System::new().block_on(async {
            let db = Db::start(pool, 1).with_stall_bound(Duration::from_millis(50));
            assert_eq!(db.health(), Ok(()));
            let (open, gate) = std::sync::mpsc::channel::<()>();
            let held = db.write(move |_| gate.recv().map_err(|e| StoreError::Other(e.to_string())));
            let watch = async {
                let deadline = std::time::Instant::now() + Duration::from_secs(30);
                let why = loop {
                    if let Err(why) = db.health() {
                        break why;
                    }
                    assert!(std::time::Instant::now() < deadline, "never unhealthy");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                };
                assert!(why.contains("waiting on the disk"), "{why}");
                open.send(()).expect("release the writer");
            };
            let (written, ()) = tokio::join!(held, watch);
            written.expect("the held write commits");
            assert_eq!(db.health(), Ok(()), "healthy once the commit is answered");
        });
    }

    /// Steady writes rarely let SQLite restart the WAL on its own: without the writer's restart
    /// this WAL grows past 36 MiB; with it, it stays near its restart length.
    #[test]
    fn steady_writes_keep_the_wal_near_its_restart_length() {
        let dir = testing::tempfile_dir::TempDir::new();
        let path = dir.path().join("state.db");
        let pool = open_pool(&path, 4).expect("pool");
        let (restarts, wal) = actix_rt::System::new().block_on(async {
            let db = Db::start(pool, 1);
            spawn_checkpointer(&db, &path, Duration::from_millis(20));
            db.write(|c| Ok(c.batch_execute("CREATE TABLE w (v BLOB NOT NULL)")?))
                .await
                .expect("table");
            // 4,000 commits of 9 frames each (an 8 KiB value over 1 KiB pages).
            for _ in 0..4000 {
                db.write(|c| Ok(c.batch_execute("INSERT INTO w (v) VALUES (zeroblob(8192))")?))
                    .await
                    .expect("insert");
            }
            // Measured while the store is open: once its last connection closes (the writer's
            // and the checkpointer's threads end on their own), SQLite removes the WAL.
            let wal = std::fs::metadata(dir.path().join("state.db-wal"))
                .expect("wal")
                .len();
            (db.wal_restarts(), wal)
        });
        let frame = 1024 + 24;
        assert!(
            wal <= (WAL_RESTART_FRAMES as u64 + 8 * 1024) * frame,
            "the WAL grew to {wal} bytes"
        );
        // A WAL that outgrew its restart length was restarted by the writer, and counted. (With
        // pauses between writes, as on a loaded machine, SQLite may restart it on its own, and
        // the writer need not; the file then never grows that far. The slack covers a WAL that
        // crossed the length in the last commits, before a checkpoint round asked for a restart.)
        assert!(
            restarts >= 1 || wal <= (WAL_RESTART_FRAMES as u64 + 2048) * frame,
            "a WAL of {wal} bytes and no restart counted"
        );
        // And every committed row is there, read by a connection of its own.
        use diesel::{Connection, RunQueryDsl};
        let mut c = SqliteConnection::establish(&path.to_string_lossy()).expect("open");
        // The store's last connection may be closing (checkpointing and removing the WAL) as
        // this one reads: wait for its lock instead of failing on it.
        c.batch_execute("PRAGMA busy_timeout = 10000")
            .expect("busy timeout");
        let rows: testing::Count = diesel::sql_query("SELECT count(*) AS n FROM w")
            .get_result(&mut c)
            .expect("count");
        assert_eq!(rows.n, 4000);
    }
}
