//! `gatehouse`: the platform's default SQLite VFS, except that a WAL file gathers the frames of a
//! commit and hands them to the operating system in one write.
//!
//! SQLite writes every WAL frame as two `pwrite`s (its 24-byte header, then the page), so a commit
//! of 15 pages cost 30 system calls before its fsync, measured as a large part of the writer's CPU
//! per commit. Here a WAL file keeps the writes of a run of consecutive offsets in memory and
//! writes them out with one call:
//! - right after the page of a *commit frame* (a frame header whose "database size after commit"
//!   field is not zero): SQLite writes all of a transaction's frames before it syncs the WAL and
//!   before it publishes the new frames in the WAL index, so no reader, in this process or
//!   another, can be told of a frame that is still in memory, whatever the `synchronous` setting;
//! - before anything else touches the file (read, sync, truncate, size, file control, close) and
//!   before a write that does not continue the run, so the file sees the same writes in the same
//!   order as without the buffer;
//! - when the run reaches [`MAX_PENDING`] bytes (a large transaction that spills pages).
//!
//! The fsync is SQLite's own and unchanged: an acknowledged commit is on disk exactly as before. A
//! failed write (a full disk, a file-size limit) is reported by the call that flushed, which is
//! always one of the same transaction's calls: a write reports it as it is, any other call (a
//! read) as an I/O error, which ends the whole transaction (a full disk reported by a read ended
//! only its statement), and every later write and sync of the transaction fails with it, so no
//! commit is made over the frames lost. A connection's main database file is wrapped too, only to learn when the connection lets
//! go of the WAL write lock (see [`shm_lock`]); every other file (journals, temporary files) is
//! opened by the default VFS itself.

use std::ffi::{c_int, c_void, CStr};
use std::mem::{align_of, size_of};
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Mutex, Once};

use libsqlite3_sys as ffi;

/// A run longer than this is written out even before its commit frame.
const MAX_PENDING: usize = 4 << 20;
/// A buffer that grew past this for a large transaction shrinks back after it was written.
const KEEP_CAPACITY: usize = 256 << 10;
/// The most the base VFS takes in one write (its Unix `pwrite` wrapper masks a length to 17 bits).
const MAX_WRITE: usize = 127 << 10;
/// SQLite's WAL frame header; no other write to a WAL file has this length.
const FRAME_HEADER: usize = 24;

static NAME: &CStr = c"gatehouse";
/// The default VFS this one wraps.
static BASE: AtomicPtr<ffi::sqlite3_vfs> = AtomicPtr::new(std::ptr::null_mut());
thread_local! {
    /// `write` calls this thread made to WAL files (SQLite runs a connection's I/O on the thread
    /// that calls it), for tests.
    static WAL_WRITES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// Bytes this thread's WAL files dropped unwritten (a rolled-back spill), for tests.
    static WAL_DROPPED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}
#[cfg(test)]
thread_local! {
    /// The next write-out of a gathered run on this thread fails as a full disk would.
    static FAIL_NEXT_FLUSH: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Register the VFS as the process's default (once; before the first connection opens). If the
/// platform has no default VFS to wrap, SQLite keeps its own default and a warning is logged.
pub fn install() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: `sqlite3_vfs_find(NULL)` returns the default VFS, a static object of SQLite's
        // that lives as long as the process; the copy registered here is leaked, so it does too.
        unsafe {
            let base = ffi::sqlite3_vfs_find(std::ptr::null());
            if base.is_null() {
                tracing::warn!("SQLite has no default VFS: WAL writes are not gathered");
                return;
            }
            BASE.store(base, Ordering::Release);
            // Everything but the name, the file size and `xOpen` is the base's own, including its
            // `pAppData` (the Unix VFS keeps its locking style there).
            let mut vfs: ffi::sqlite3_vfs = std::ptr::read(base);
            vfs.pNext = std::ptr::null_mut();
            vfs.zName = NAME.as_ptr();
            vfs.szOsFile = (real_offset() + (*base).szOsFile as usize) as c_int;
            vfs.xOpen = Some(open);
            let rc = ffi::sqlite3_vfs_register(Box::into_raw(Box::new(vfs)), 1);
            if rc != ffi::SQLITE_OK {
                tracing::warn!(code = rc, "cannot register the gathering SQLite VFS");
            }
        }
    });
}

/// How many bytes this thread's WAL files dropped unwritten.
pub fn wal_dropped() -> u64 {
    WAL_DROPPED.with(|n| n.get())
}

/// How many `write` calls this thread has made to WAL files.
pub fn wal_writes() -> u64 {
    WAL_WRITES.with(|n| n.get())
}

/// Which of a connection's files a [`File`] is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// The main database: forwarded as is, except that releasing the WAL write lock through it
    /// drops whatever its WAL still holds (see [`shm_lock`]).
    Db,
    /// Its WAL: writes gathered.
    Wal,
}

/// One of a connection's files: our header, then the base VFS's file at [`real_offset`] in the
/// same allocation.
#[repr(C)]
struct File {
    base: ffi::sqlite3_file,
    real: *mut ffi::sqlite3_file,
    kind: Kind,
    /// A database's open WAL, a WAL's database (null when there is none).
    peer: *mut File,
    /// Offset of `data[0]` in the file.
    start: i64,
    /// A WAL's gathered writes (empty for a database, and for a WAL whose database is unknown,
    /// which writes through).
    data: Vec<u8>,
    gather: bool,
    /// The last write was the header of a commit frame: its page completes the commit.
    commit_page_next: bool,
    /// A gathered run whose write-out failed (its frames are gone): every later write and sync
    /// fails with it until the write lock is let go (the transaction rolled back).
    failed: c_int,
}

const fn real_offset() -> usize {
    let a = align_of::<u64>();
    size_of::<File>().div_ceil(a) * a
}

/// Open database files of this process, by the address of the name SQLite opened them with: a
/// WAL's name lives in the same allocation, and `sqlite3_filename_database` on it returns that
/// very address, so each WAL finds the database of its own connection.
static DATABASES: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());

fn databases() -> std::sync::MutexGuard<'static, Vec<(usize, usize)>> {
    DATABASES.lock().unwrap_or_else(|e| e.into_inner())
}

unsafe extern "C" fn open(
    vfs: *mut ffi::sqlite3_vfs,
    name: ffi::sqlite3_filename,
    file: *mut ffi::sqlite3_file,
    flags: c_int,
    out_flags: *mut c_int,
) -> c_int {
    let _ = vfs;
    let base = BASE.load(Ordering::Acquire);
    // SAFETY: SQLite calls this with an allocation of our `szOsFile` bytes (aligned for any
    // type SQLite uses, 8 bytes), which holds our header and then the base's file; `base` is the
    // default VFS found in `install`. Other files are the base's own, placed at the start.
    unsafe {
        let Some(base_open) = base.as_ref().and_then(|b| b.xOpen) else {
            (*file).pMethods = std::ptr::null();
            return ffi::SQLITE_ERROR;
        };
        let kind = if flags & ffi::SQLITE_OPEN_WAL != 0 {
            Kind::Wal
        } else if flags & ffi::SQLITE_OPEN_MAIN_DB != 0 && !name.is_null() {
            Kind::Db
        } else {
            return base_open(base, name, file, flags, out_flags);
        };
        let real = (file as *mut u8).add(real_offset()) as *mut ffi::sqlite3_file;
        (*real).pMethods = std::ptr::null();
        let rc = base_open(base, name, real, flags, out_flags);
        if rc != ffi::SQLITE_OK {
            if let Some(close) = (*real).pMethods.as_ref().and_then(|m| m.xClose) {
                close(real);
            }
            (*file).pMethods = std::ptr::null();
            return rc;
        }
        let this = file as *mut File;
        std::ptr::write(
            this,
            File {
                base: ffi::sqlite3_file { pMethods: &METHODS },
                real,
                kind,
                peer: std::ptr::null_mut(),
                start: 0,
                data: Vec::new(),
                gather: false,
                commit_page_next: false,
                failed: ffi::SQLITE_OK,
            },
        );
        let mut dbs = databases();
        match kind {
            Kind::Db => dbs.push((name as usize, this as usize)),
            Kind::Wal => {
                let db_name = ffi::sqlite3_filename_database(name) as usize;
                if let Some(&(_, db)) = dbs.iter().find(|(n, _)| *n == db_name) {
                    let db = db as *mut File;
                    (*db).peer = this;
                    (*this).peer = db;
                    (*this).gather = true;
                }
            }
        }
        ffi::SQLITE_OK
    }
}

/// The base file's methods.
///
/// # Safety
/// `f.real` is an open file of the base VFS.
unsafe fn real(f: &File) -> &ffi::sqlite3_io_methods {
    // SAFETY: per the contract; an open file's `pMethods` is valid until it is closed.
    unsafe { &*(*f.real).pMethods }
}

/// # Safety
/// `file` was opened by [`open`] and is not closed.
unsafe fn ours<'a>(file: *mut ffi::sqlite3_file) -> &'a mut File {
    // SAFETY: per the contract; SQLite never calls a connection's files concurrently.
    unsafe { &mut *(file as *mut File) }
}

/// Empty the run (keeping a moderate buffer for the next one).
fn reset(f: &mut File) {
    f.commit_page_next = false;
    f.data.clear();
    if f.data.capacity() > KEEP_CAPACITY {
        f.data.shrink_to(KEEP_CAPACITY / 4);
    }
}

/// Forget the gathered writes unwritten (they belong to no commit; see [`shm_lock`]), and a
/// failed write-out with them.
fn discard(f: &mut File) {
    WAL_DROPPED.with(|n| n.set(n.get() + f.data.len() as u64));
    f.failed = ffi::SQLITE_OK;
    reset(f);
}

/// `rc`, a failed write-out, as a call that is no write reports it: an I/O error. SQLite takes
/// an I/O error from a read as the end of the whole transaction; a full disk reported by a read
/// undid only the statement, and the transaction went on to commit over the frames lost.
fn as_io_error(rc: c_int) -> c_int {
    if rc & 0xff == ffi::SQLITE_IOERR {
        rc
    } else {
        ffi::SQLITE_IOERR_WRITE
    }
}

/// Write out the gathered run (if any), in pieces the base VFS takes.
fn flush(f: &mut File) -> c_int {
    if f.data.is_empty() {
        f.commit_page_next = false;
        return ffi::SQLITE_OK;
    }
    #[cfg(test)]
    if FAIL_NEXT_FLUSH.with(|fail| fail.replace(false)) {
        f.failed = ffi::SQLITE_FULL;
        reset(f);
        return ffi::SQLITE_FULL;
    }
    // SAFETY: `f` is open (every caller holds one from `ours`).
    let rc = match unsafe { real(f) }.xWrite {
        Some(write) => {
            let mut rc = ffi::SQLITE_OK;
            let mut at = f.start;
            for piece in f.data.chunks(MAX_WRITE) {
                WAL_WRITES.with(|n| n.set(n.get() + 1));
                // SAFETY: `piece` holds `piece.len()` (≤ MAX_WRITE) initialised bytes.
                rc = unsafe {
                    write(
                        f.real,
                        piece.as_ptr() as *const c_void,
                        piece.len() as c_int,
                        at,
                    )
                };
                if rc != ffi::SQLITE_OK {
                    break;
                }
                at += piece.len() as i64;
            }
            rc
        }
        None => ffi::SQLITE_IOERR_WRITE,
    };
    if rc != ffi::SQLITE_OK {
        f.failed = rc;
    }
    reset(f);
    rc
}

unsafe extern "C" fn write(
    file: *mut ffi::sqlite3_file,
    buf: *const c_void,
    amount: c_int,
    offset: i64,
) -> c_int {
    // SAFETY: SQLite passes an open file of ours and `amount` readable bytes at `buf`.
    let f = unsafe { ours(file) };
    if !f.gather {
        // SAFETY: forwarded as given.
        return unsafe { real(f) }
            .xWrite
            .map(|w| unsafe { w(f.real, buf, amount, offset) })
            .unwrap_or(ffi::SQLITE_IOERR_WRITE);
    }
    if f.failed != ffi::SQLITE_OK {
        return f.failed;
    }
    // SAFETY: as above.
    let bytes = unsafe { std::slice::from_raw_parts(buf as *const u8, amount.max(0) as usize) };
    if !f.data.is_empty() && offset != f.start + f.data.len() as i64 {
        let rc = flush(f);
        if rc != ffi::SQLITE_OK {
            return rc;
        }
    }
    if f.data.is_empty() {
        f.start = offset;
    }
    f.data.extend_from_slice(bytes);
    if bytes.len() == FRAME_HEADER {
        // Bytes 4..8 of a frame header: the database size after a commit, zero otherwise.
        f.commit_page_next = bytes[4..8] != [0, 0, 0, 0];
    } else if f.commit_page_next || f.data.len() >= MAX_PENDING {
        return flush(f);
    }
    ffi::SQLITE_OK
}

/// Flush, then run `op` on the base file.
///
/// # Safety
/// `file` was opened by [`open`] and is not closed.
unsafe fn then<F>(file: *mut ffi::sqlite3_file, op: F) -> c_int
where
    F: FnOnce(&ffi::sqlite3_io_methods, *mut ffi::sqlite3_file) -> Option<c_int>,
{
    // SAFETY: per the contract.
    let f = unsafe { ours(file) };
    let rc = flush(f);
    if rc != ffi::SQLITE_OK {
        return as_io_error(rc);
    }
    // SAFETY: `f` is open.
    op(unsafe { real(f) }, f.real).unwrap_or(ffi::SQLITE_IOERR)
}

/// Run `op` on the base file, without flushing (calls that do not touch the file's bytes).
///
/// # Safety
/// `file` was opened by [`open`] and is not closed.
unsafe fn plain<T>(
    file: *mut ffi::sqlite3_file,
    op: impl FnOnce(&ffi::sqlite3_io_methods, *mut ffi::sqlite3_file) -> T,
) -> T {
    // SAFETY: per the contract.
    let f = unsafe { ours(file) };
    // SAFETY: `f` is open.
    op(unsafe { real(f) }, f.real)
}

unsafe extern "C" fn close(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: SQLite closes each file once and never uses it again, so the header is dropped in
    // place. Whatever a WAL still holds at its close belongs to no commit (a commit writes its
    // frames out before it returns): it is dropped, not written.
    unsafe {
        let f = ours(file);
        {
            let mut dbs = databases();
            if !f.peer.is_null() {
                (*f.peer).peer = std::ptr::null_mut();
                (*f.peer).gather = false;
                discard(&mut *f.peer);
            }
            if f.kind == Kind::Db {
                dbs.retain(|&(_, db)| db != file as usize);
            }
        }
        let closed = real(f).xClose.map(|c| c(f.real)).unwrap_or(ffi::SQLITE_OK);
        std::ptr::drop_in_place(&mut f.data);
        (*file).pMethods = std::ptr::null();
        closed
    }
}

unsafe extern "C" fn read(
    file: *mut ffi::sqlite3_file,
    buf: *mut c_void,
    amount: c_int,
    offset: i64,
) -> c_int {
    // SAFETY: forwarded as given, after the gathered run is written.
    unsafe { then(file, |m, r| m.xRead.map(|f| f(r, buf, amount, offset))) }
}

unsafe extern "C" fn truncate(file: *mut ffi::sqlite3_file, size: i64) -> c_int {
    // SAFETY: as `read`.
    unsafe { then(file, |m, r| m.xTruncate.map(|f| f(r, size))) }
}

unsafe extern "C" fn sync(file: *mut ffi::sqlite3_file, flags: c_int) -> c_int {
    // SAFETY: per the contract. Frames lost to a failed write-out are never synced as a commit.
    let failed = unsafe { ours(file) }.failed;
    if failed != ffi::SQLITE_OK {
        return as_io_error(failed);
    }
    // SAFETY: as `read`.
    unsafe { then(file, |m, r| m.xSync.map(|f| f(r, flags))) }
}

unsafe extern "C" fn file_size(file: *mut ffi::sqlite3_file, size: *mut i64) -> c_int {
    // SAFETY: as `read`.
    unsafe { then(file, |m, r| m.xFileSize.map(|f| f(r, size))) }
}

unsafe extern "C" fn file_control(
    file: *mut ffi::sqlite3_file,
    op: c_int,
    arg: *mut c_void,
) -> c_int {
    // SAFETY: as `read`. An unknown op answers SQLITE_NOTFOUND, as the base does.
    unsafe {
        then(file, |m, r| {
            Some(
                m.xFileControl
                    .map(|f| f(r, op, arg))
                    .unwrap_or(ffi::SQLITE_NOTFOUND),
            )
        })
    }
}

unsafe extern "C" fn lock(file: *mut ffi::sqlite3_file, level: c_int) -> c_int {
    // SAFETY: forwarded as given.
    unsafe {
        plain(file, |m, r| {
            m.xLock.map(|f| f(r, level)).unwrap_or(ffi::SQLITE_OK)
        })
    }
}

unsafe extern "C" fn unlock(file: *mut ffi::sqlite3_file, level: c_int) -> c_int {
    // SAFETY: forwarded as given.
    unsafe {
        plain(file, |m, r| {
            m.xUnlock.map(|f| f(r, level)).unwrap_or(ffi::SQLITE_OK)
        })
    }
}

unsafe extern "C" fn check_reserved_lock(file: *mut ffi::sqlite3_file, out: *mut c_int) -> c_int {
    // SAFETY: forwarded as given.
    unsafe {
        plain(file, |m, r| match m.xCheckReservedLock {
            Some(f) => f(r, out),
            None => {
                *out = 0;
                ffi::SQLITE_OK
            }
        })
    }
}

unsafe extern "C" fn sector_size(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: forwarded as given.
    unsafe { plain(file, |m, r| m.xSectorSize.map(|f| f(r)).unwrap_or(4096)) }
}

unsafe extern "C" fn device_characteristics(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: forwarded as given.
    unsafe {
        plain(file, |m, r| {
            m.xDeviceCharacteristics.map(|f| f(r)).unwrap_or(0)
        })
    }
}

unsafe extern "C" fn shm_map(
    file: *mut ffi::sqlite3_file,
    region: c_int,
    size: c_int,
    extend: c_int,
    out: *mut *mut c_void,
) -> c_int {
    // SAFETY: forwarded as given.
    unsafe {
        plain(file, |m, r| match (m.iVersion >= 2, m.xShmMap) {
            (true, Some(f)) => f(r, region, size, extend, out),
            _ => ffi::SQLITE_IOERR_SHMMAP,
        })
    }
}

/// SQLite's WAL write lock: the first of the shared-memory lock slots.
const WAL_WRITE_LOCK: c_int = 0;

/// Forwarded; and when a database's connection releases (or takes) the WAL write lock, its WAL
/// drops whatever it still holds. A commit writes its frames out before its connection lets the
/// lock go, so what is left is only ever pages a transaction spilled and then rolled back:
/// garbage past the WAL's end, which must not be written later, when another connection may
/// have committed frames at those offsets.
unsafe extern "C" fn shm_lock(
    file: *mut ffi::sqlite3_file,
    offset: c_int,
    n: c_int,
    flags: c_int,
) -> c_int {
    // SAFETY: forwarded as given; `peer` is this connection's open WAL (unlinked at its close).
    unsafe {
        let f = ours(file);
        let rc = match (real(f).iVersion >= 2, real(f).xShmLock) {
            (true, Some(lock)) => lock(f.real, offset, n, flags),
            _ => ffi::SQLITE_IOERR_SHMLOCK,
        };
        let write_lock = offset <= WAL_WRITE_LOCK && WAL_WRITE_LOCK < offset + n;
        if f.kind == Kind::Db
            && write_lock
            && flags & ffi::SQLITE_SHM_EXCLUSIVE != 0
            && !f.peer.is_null()
        {
            discard(&mut *f.peer);
        }
        rc
    }
}

unsafe extern "C" fn shm_barrier(file: *mut ffi::sqlite3_file) {
    // SAFETY: forwarded as given.
    unsafe {
        plain(file, |m, r| {
            if let (true, Some(f)) = (m.iVersion >= 2, m.xShmBarrier) {
                f(r)
            }
        })
    }
}

unsafe extern "C" fn shm_unmap(file: *mut ffi::sqlite3_file, delete: c_int) -> c_int {
    // SAFETY: forwarded as given.
    unsafe {
        plain(file, |m, r| match (m.iVersion >= 2, m.xShmUnmap) {
            (true, Some(f)) => f(r, delete),
            _ => ffi::SQLITE_OK,
        })
    }
}

unsafe extern "C" fn fetch(
    file: *mut ffi::sqlite3_file,
    offset: i64,
    amount: c_int,
    out: *mut *mut c_void,
) -> c_int {
    // SAFETY: as `read`; a null page tells SQLite to read instead.
    unsafe {
        then(file, |m, r| match (m.iVersion >= 3, m.xFetch) {
            (true, Some(f)) => Some(f(r, offset, amount, out)),
            _ => {
                *out = std::ptr::null_mut();
                Some(ffi::SQLITE_OK)
            }
        })
    }
}

unsafe extern "C" fn unfetch(
    file: *mut ffi::sqlite3_file,
    offset: i64,
    page: *mut c_void,
) -> c_int {
    // SAFETY: forwarded as given.
    unsafe {
        plain(file, |m, r| match (m.iVersion >= 3, m.xUnfetch) {
            (true, Some(f)) => f(r, offset, page),
            _ => ffi::SQLITE_OK,
        })
    }
}

static METHODS: ffi::sqlite3_io_methods = ffi::sqlite3_io_methods {
    iVersion: 3,
    xClose: Some(close),
    xRead: Some(read),
    xWrite: Some(write),
    xTruncate: Some(truncate),
    xSync: Some(sync),
    xFileSize: Some(file_size),
    xLock: Some(lock),
    xUnlock: Some(unlock),
    xCheckReservedLock: Some(check_reserved_lock),
    xFileControl: Some(file_control),
    xSectorSize: Some(sector_size),
    xDeviceCharacteristics: Some(device_characteristics),
    xShmMap: Some(shm_map),
    xShmLock: Some(shm_lock),
    xShmBarrier: Some(shm_barrier),
    xShmUnmap: Some(shm_unmap),
    xFetch: Some(fetch),
    xUnfetch: Some(unfetch),
};

#[cfg(test)]
mod tests {
    use super::*;
    use diesel::connection::SimpleConnection;
    use diesel::prelude::*;
    use diesel::sql_types::BigInt;

    #[derive(QueryableByName)]
    struct N {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }

    fn count(c: &mut SqliteConnection) -> i64 {
        diesel::sql_query("SELECT count(*) AS n FROM t")
            .get_result::<N>(c)
            .expect("count")
            .n
    }

    fn connect(path: &std::path::Path, sync: &str) -> SqliteConnection {
        install();
        let mut c = SqliteConnection::establish(&path.to_string_lossy()).expect("open");
        c.batch_execute(&format!(
            "PRAGMA page_size = 1024; PRAGMA journal_mode = WAL; PRAGMA synchronous = {sync}; \
             PRAGMA wal_autocheckpoint = 0; CREATE TABLE IF NOT EXISTS t (id INTEGER PRIMARY KEY, v TEXT NOT NULL); \
             CREATE INDEX IF NOT EXISTS t_v ON t(v);"
        ))
        .expect("pragmas");
        c
    }

    #[test]
    fn a_commit_of_many_pages_is_one_write_and_other_connections_see_it_without_a_sync() {
        let dir = crate::store::testing::tempfile_dir::TempDir::new();
        let path = dir.path().join("wal.db");
        // NORMAL: no sync at commit, so only the commit-frame rule makes the frames visible.
        let mut writer = connect(&path, "NORMAL");
        let mut reader = connect(&path, "NORMAL");
        for round in 0..20 {
            let before = wal_writes();
            writer
                .immediate_transaction::<_, diesel::result::Error, _>(|c| {
                    for i in 0..20 {
                        // Values spread over the index: many pages per commit.
                        c.batch_execute(&format!(
                            "INSERT INTO t (v) VALUES ('{:08x}{}')",
                            (i * 2654435761u64 + round) % 4294967291,
                            "x".repeat(200)
                        ))?;
                    }
                    Ok(())
                })
                .expect("commit");
            // Without gathering: two writes for each of the commit's frames (dozens; all of
            // them together stay below one write's largest size).
            let writes = wal_writes() - before;
            assert_eq!(writes, 1, "round {round}: {writes} writes for one commit");
            assert_eq!(count(&mut reader), (round as i64 + 1) * 20);
        }
        // And the database is whole after a checkpoint and a reopen.
        writer
            .batch_execute("PRAGMA wal_checkpoint(TRUNCATE);")
            .expect("checkpoint");
        drop(writer);
        drop(reader);
        assert_whole(&path, 400);
    }

    /// Reopened, the database holds `rows` rows and passes SQLite's integrity check.
    fn assert_whole(path: &std::path::Path, rows: i64) {
        let mut again = connect(path, "FULL");
        assert_eq!(count(&mut again), rows);
        let ok: Vec<String> = diesel::sql_query("PRAGMA integrity_check")
            .load::<Check>(&mut again)
            .expect("integrity")
            .into_iter()
            .map(|c| c.integrity_check)
            .collect();
        assert_eq!(ok, vec!["ok".to_string()]);
    }

    #[derive(QueryableByName)]
    struct Check {
        #[diesel(sql_type = diesel::sql_types::Text)]
        integrity_check: String,
    }

    #[test]
    fn a_transaction_larger_than_the_page_cache_spills_and_reads_its_own_frames_back() {
        let dir = crate::store::testing::tempfile_dir::TempDir::new();
        let path = dir.path().join("spill.db");
        let mut c = connect(&path, "FULL");
        // A 20-page cache: the transaction spills dirty pages to the WAL and reads them back.
        c.batch_execute("PRAGMA cache_size = 20;").expect("cache");
        c.immediate_transaction::<_, diesel::result::Error, _>(|c| {
            for i in 0..3000 {
                c.batch_execute(&format!(
                    "INSERT INTO t (v) VALUES ('{:08x}{}')",
                    (i * 2654435761u64) % 4294967291,
                    "y".repeat(100)
                ))?;
            }
            c.batch_execute("UPDATE t SET v = v || 'z' WHERE id % 3 = 0")?;
            Ok(())
        })
        .expect("commit");
        assert_eq!(count(&mut c), 3000);
        drop(c);
        let mut again = connect(&path, "FULL");
        assert_eq!(count(&mut again), 3000);
        let z: i64 = diesel::sql_query("SELECT count(*) AS n FROM t WHERE v LIKE '%z'")
            .get_result::<N>(&mut again)
            .expect("count")
            .n;
        assert_eq!(z, 1000);
    }

    /// A write-out of spilled frames that fails when a statement reads them back (a full
    /// disk) ends the whole transaction: the statement's error is an I/O error, and the
    /// transaction cannot commit over the frames lost. It was a full-disk error, which undid
    /// only the statement; the transaction committed, its frames missing.
    #[test]
    fn a_write_out_that_fails_in_a_read_ends_the_transaction() {
        let dir = crate::store::testing::tempfile_dir::TempDir::new();
        let path = dir.path().join("full.db");
        let mut c = connect(&path, "FULL");
        c.batch_execute("INSERT INTO t (v) VALUES ('before')")
            .expect("a row");
        c.batch_execute("PRAGMA cache_size = 10;").expect("cache");
        let mut statement_error = None;
        let committed = c.immediate_transaction::<_, diesel::result::Error, _>(|c| {
            c.batch_execute("CREATE TABLE IF NOT EXISTS u (id INTEGER PRIMARY KEY, v TEXT)")?;
            for i in 0..200 {
                c.batch_execute(&format!(
                    "INSERT INTO u (v) VALUES ('{i}{}')",
                    "a".repeat(300)
                ))?;
            }
            // A many-row update (it has a statement journal) reads the spilled pages back.
            FAIL_NEXT_FLUSH.with(|f| f.set(true));
            statement_error = c.batch_execute("UPDATE u SET v = v || 'z'").err();
            FAIL_NEXT_FLUSH.with(|f| f.set(false));
            Ok(())
        });
        let e = statement_error.expect("the update failed");
        assert!(e.to_string().contains("I/O"), "{e}");
        assert!(committed.is_err(), "committed over the lost frames");
        drop(c);
        assert_whole(&path, 1);
    }

    #[test]
    fn pages_a_rolled_back_transaction_spilled_are_never_written_over_another_connections_commit() {
        let dir = crate::store::testing::tempfile_dir::TempDir::new();
        let path = dir.path().join("rollback.db");
        let mut a = connect(&path, "FULL");
        let mut b = connect(&path, "FULL");
        a.batch_execute("PRAGMA cache_size = 10;").expect("cache");
        let mut dropped = wal_dropped();
        for round in 0..5 {
            // An empty WAL, so that A's rollback reloads its pages from the database file and
            // never reads the WAL (a read would write A's spill out while A still holds the
            // write lock, which is harmless): only the lock's release can drop the spill.
            b.batch_execute("PRAGMA wal_checkpoint(TRUNCATE);")
                .expect("checkpoint");
            // A spills pages to the WAL (no commit frame among them), then rolls back.
            let spilled = a.immediate_transaction::<(), diesel::result::Error, _>(|c| {
                // Appended rows with no index: the leaves spilled are never read back.
                c.batch_execute("CREATE TABLE IF NOT EXISTS u (id INTEGER PRIMARY KEY, v TEXT)")?;
                for _ in 0..200 {
                    c.batch_execute(&format!("INSERT INTO u (v) VALUES ('{}')", "a".repeat(300)))?;
                }
                Err(diesel::result::Error::RollbackTransaction)
            });
            assert!(spilled.is_err());
            assert!(
                wal_dropped() > dropped,
                "round {round}: the spill was not left pending"
            );
            dropped = wal_dropped();

            // B commits frames at the offsets A's spill had used.
            b.immediate_transaction::<_, diesel::result::Error, _>(|c| {
                c.batch_execute(&format!("INSERT INTO t (v) VALUES ('b{round}')"))
            })
            .expect("b commits");
            // A writes again: nothing of its spill may land on B's frames.
            a.immediate_transaction::<_, diesel::result::Error, _>(|c| {
                c.batch_execute(&format!("INSERT INTO t (v) VALUES ('a{round}')"))
            })
            .expect("a commits");
        }
        drop(a);
        drop(b);
        assert_whole(&path, 10);
    }
}
