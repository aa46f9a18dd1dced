//! `Gateway::start`: boot in order (new epoch, started→unknown sweep, restore sessions, listeners,
//! then ready), and the graceful stop. Used by `main` and by the tests alike.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use actix_web::{web, App, HttpServer};

use crate::api::control::{self, Control};
use crate::api::http::{routes, AppState};
use crate::api::rooms::{RoomEventHub, RoomsService};
use crate::api::rpc::Authority;
use crate::api::tickets::Tickets;
use crate::clock::{SharedClock, SystemClock};
use crate::config::Config;
use crate::model::client::{ModelClient, ModelClientConfig};
use crate::rooms::db::RoomsDb;
use crate::rooms::runtime::{BindingSource, RoomBinding, RoomRuntime};
use crate::session::registry::{DrainAll, PumpSessions, SessionRegistry};
use crate::session::{RuntimePhase, RuntimeState, Shared};
use crate::store::{self, admissions, epoch, prompts, Db};
use crate::telemetry::Metrics;
use crate::tools::{StopBackground, TerminalTool};

/// Where background processes' logs go, in the home.
pub const BACKGROUND_LOGS: &str = "background";

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("{0}")]
    Home(String),
    #[error("config: {0}")]
    Config(#[from] crate::config::ConfigError),
    #[error("state database: {0}")]
    Store(#[from] crate::error::StoreError),
    #[error("cannot listen: {0}")]
    Listen(std::io::Error),
    #[error("{0}")]
    Refused(String),
    /// `gateway.host` did not resolve: the resolver may not be up yet (at boot), so it is
    /// waited for (`gateway.bind_wait_seconds`; a name still unknown then is refused for good).
    #[error("{0}")]
    Resolve(String),
    /// The resolver could not answer for now (`EAI_AGAIN`: no DNS server reachable yet, as at
    /// boot before DHCP): waited for as [`StartError::Resolve`] is, and still no answer after
    /// the wait is no refusal for good: a later start may find the resolver up.
    #[error("{0}")]
    ResolverDown(String),
    /// An I/O failure on the home that a later start may not meet (a full disk).
    #[error("{0}")]
    Io(String),
    /// The hosted rooms could not start (their store, most likely: a later start may succeed).
    #[error("rooms: {0}")]
    Rooms(String),
    /// Asked to stop (SIGTERM) before anything durable was done: a clean end.
    #[error("stopped during the start")]
    Stopped,
}

impl StartError {
    /// A refusal that starting again will not change (the home, the config, another daemon on
    /// the home, an address this machine does not have): a supervisor should not restart the
    /// daemon for it. A port in use is not one: the process that holds it may be on its way out.
    pub fn is_permanent(&self) -> bool {
        match self {
            StartError::Home(_) | StartError::Config(_) | StartError::Refused(_) => true,
            StartError::Listen(e) => matches!(
                e.kind(),
                std::io::ErrorKind::AddrNotAvailable | std::io::ErrorKind::PermissionDenied
            ),
            StartError::Store(e) => e.is_corrupt(),
            StartError::Io(_)
            | StartError::Rooms(_)
            | StartError::Resolve(_)
            | StartError::ResolverDown(_)
            | StartError::Stopped => false,
        }
    }
}

/// The longest path a Unix socket binds to (`sun_path` less its terminating NUL).
const MAX_SOCKET_PATH: usize = 107;

/// Connections the kernel queues for the API before it accepts them.
const LISTEN_BACKLOG: u32 = 2048;

/// Bind the API's TCP listener on `host:port` (the first of the host's addresses that binds).
fn listen(host: &str, port: u16) -> Result<std::net::TcpListener, StartError> {
    use std::net::ToSocketAddrs;
    let addrs: Vec<_> = (host, port)
        .to_socket_addrs()
        .map_err(|e| {
            let text = format!("gateway.host {host:?} does not resolve: {e}");
            if resolver_down(&e) {
                StartError::ResolverDown(text)
            } else {
                StartError::Resolve(text)
            }
        })?
        .collect();
    // As the HTTP server would bind itself: reuse the address (a restart does not wait out
    // TIME_WAIT) and a deep accept queue (a burst of clients is queued, not refused).
    let bind = |addr: std::net::SocketAddr| -> std::io::Result<std::net::TcpListener> {
        let socket = if addr.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        socket.set_reuseaddr(true)?;
        socket.bind(addr)?;
        socket.listen(LISTEN_BACKLOG)?.into_std()
    };
    let mut last = None;
    for addr in addrs {
        match bind(addr) {
            Ok(l) => return Ok(l),
            Err(e) => last = Some((addr, e)),
        }
    }
    Err(match last {
        Some((addr, e)) => {
            StartError::Listen(std::io::Error::new(e.kind(), format!("{addr}: {e}")))
        }
        None => StartError::Refused(format!("gateway.host {host:?} has no address")),
    })
}

/// Whether a failed lookup is the resolver's temporary failure (`EAI_AGAIN`), not an answer
/// that the name is unknown. The standard library reports a lookup's failure as text only, in
/// `gai_strerror`'s words, read here from the same function.
fn resolver_down(e: &std::io::Error) -> bool {
    // SAFETY: `gai_strerror` returns a pointer to a static, NUL-terminated string.
    let again = unsafe { std::ffi::CStr::from_ptr(libc::gai_strerror(libc::EAI_AGAIN)) };
    again
        .to_str()
        .is_ok_and(|again| !again.is_empty() && e.to_string().ends_with(again))
}

/// How often a start tries again to bind an address that is not on this machine yet.
const BIND_RETRY: Duration = Duration::from_millis(250);

/// Bind with `bind`, waiting up to `wait` for an address this machine does not have yet: at boot,
/// the interface of a configured `gateway.host` may come up after the gateway starts (a network
/// that systemd counted online before its addresses were assigned). Any other failure, or the
/// address still missing after `wait`, refuses the start.
async fn listen_waiting(
    mut bind: impl FnMut() -> Result<std::net::TcpListener, StartError>,
    wait: Duration,
    retry: Duration,
) -> Result<std::net::TcpListener, StartError> {
    let started = std::time::Instant::now();
    let mut warned = false;
    // While it waits, systemd is asked for more time to start (a long wait would otherwise
    // outlast `TimeoutStartSec` and the start be killed, then restarted into the same wait).
    let mut _extended = None;
    loop {
        let result = bind();
        // An address not on this machine yet, or a name the resolver does not know yet (it is
        // not up yet at boot, or the name not published yet): waited for. (A failure to resolve
        // refused the start for good at once, and systemd did not start it again.)
        let missing = match &result {
            Err(StartError::Resolve(e)) => Some((e.clone(), "does not resolve")),
            Err(StartError::ResolverDown(e)) => Some((e.clone(), "cannot be resolved for now")),
            Err(StartError::Listen(e)) if e.kind() == std::io::ErrorKind::AddrNotAvailable => {
                Some((e.to_string(), "is not an address of this machine"))
            }
            _ => None,
        };
        let waited = started.elapsed();
        match missing {
            Some((error, what)) if waited < wait => {
                if !warned {
                    warned = true;
                    _extended = Some(crate::notify::extend_start_while_alive());
                    tracing::warn!(
                        %error,
                        wait_seconds = wait.as_secs_f64(),
                        "gateway.host {what} (yet): waiting for it"
                    );
                }
                tokio::time::sleep(retry.min(wait.saturating_sub(waited))).await;
            }
            // Still missing after the wait: for good (a typo, an address never had), unless
            // the resolver could not answer at all.
            Some((error, what)) => {
                let why = format!(
                    "{error} ({what}; waited {:.1} s, gateway.bind_wait_seconds)",
                    waited.as_secs_f64()
                );
                return Err(match result {
                    Err(StartError::Listen(e)) => {
                        StartError::Listen(std::io::Error::new(e.kind(), why))
                    }
                    Err(StartError::ResolverDown(_)) => StartError::ResolverDown(why),
                    _ => StartError::Refused(why),
                });
            }
            None => {
                if warned && result.is_ok() {
                    tracing::info!(
                        waited_seconds = waited.as_secs_f64(),
                        "gateway.host's address appeared: listening"
                    );
                }
                return result;
            }
        }
    }
}

/// Reader workers (snapshots, transcripts).
const READERS: u32 = 2;

/// A running gateway.
pub struct RunningGateway {
    pub home: PathBuf,
    pub api_origin: String,
    pub runtime: Arc<RuntimeState>,
    pub shared: Arc<Shared>,
    registry: Addr<SessionRegistry>,
    rooms: Arc<RoomsService>,
    server: actix_web::dev::ServerHandle,
    tickets: Arc<Tickets>,
    control_task: AbortOnDrop,
    _lock: HomeLock,
    /// Dropped once the control task has stopped.
    socket: SocketFile,
}

/// A task stopped when this is dropped (a start that fails stops it).
struct AbortOnDrop(actix_rt::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The lock file that makes a home one gateway's.
pub const LOCK_FILE: &str = "gateway.lock";

/// Take the home's exclusive lock, or refuse: a second gateway on the same home would replace the
/// first one's control socket, take its authority epoch and mark its running work `unknown` while
/// it still runs. The lock is released by the kernel when the holder exits, however it exits.
fn lock_home(home: &Path) -> Result<HomeLock, StartError> {
    use std::io::{Read, Seek, Write};
    use std::os::unix::fs::OpenOptionsExt;
    let path = home.join(LOCK_FILE);
    let refused = |file: Option<&mut std::fs::File>| {
        let mut holder = String::new();
        if let Some(f) = file {
            let _ = f.read_to_string(&mut holder);
        }
        let holder = holder.trim();
        StartError::Refused(format!(
            "another gateway is serving {}{}; stop it first",
            home.display(),
            if holder.is_empty() {
                String::new()
            } else {
                format!(" (pid {holder})")
            }
        ))
    };
    // The directory itself is locked first: a lock file can be deleted (and a second gateway
    // then lock a new one) while the home cannot be, not while it holds the state.
    let dir = std::fs::File::open(home).map_err(|e| home_io(home, e))?;
    match dir.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let mut file = std::fs::File::open(&path).ok();
            return Err(refused(file.as_mut()));
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(home_io(home, e)),
    }
    // The lock file, as earlier versions take it, says which process holds the home.
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)
        .map_err(|e| home_io(&path, e))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => return Err(refused(Some(&mut file))),
        Err(std::fs::TryLockError::Error(e)) => return Err(home_io(&path, e)),
    }
    file.set_len(0).map_err(|e| home_io(&path, e))?;
    file.rewind().map_err(|e| home_io(&path, e))?;
    write!(file, "{}", std::process::id()).map_err(|e| home_io(&path, e))?;
    Ok(HomeLock {
        _dir: dir,
        _file: file,
    })
}

/// The file beside the database that records the highest authority epoch taken on this home:
/// a `state.db` restored from a backup holds an older epoch, and the next start would take one
/// an earlier process already had (the contract promises each is greater than every earlier one).
const EPOCH_MARK: &str = "authority_epoch";

/// The highest epoch recorded on `home` (0 when none is, or it cannot be read: then the
/// database's own is the only floor).
fn read_epoch_mark(home: &Path) -> i64 {
    let path = home.join(EPOCH_MARK);
    match std::fs::read_to_string(&path) {
        Ok(text) => text.trim().parse().unwrap_or_else(|_| {
            tracing::warn!(path = %path.display(), "unreadable epoch mark ignored");
            0
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot read the epoch mark");
            0
        }
    }
}

/// Record `epoch` as the highest taken on `home` (written whole, then renamed into place).
fn write_epoch_mark(home: &Path, epoch: i64) {
    use std::io::Write;
    let (path, tmp) = (
        home.join(EPOCH_MARK),
        home.join(format!("{EPOCH_MARK}.tmp")),
    );
    let written = std::fs::File::create(&tmp)
        .and_then(|mut f| {
            write!(f, "{epoch}")?;
            f.sync_all()
        })
        .and_then(|()| std::fs::rename(&tmp, &path))
        .and_then(|()| std::fs::File::open(home)?.sync_all());
    if let Err(e) = written {
        tracing::warn!(path = %path.display(), error = %e,
            "cannot record the authority epoch beside the database (a restored backup could take an earlier epoch again)");
    }
}

/// The home's locks, held for the life of the gateway (released when the process ends).
struct HomeLock {
    _dir: std::fs::File,
    _file: std::fs::File,
}

/// An I/O error on the home at start: permanent when it is about access (the unit must not
/// restart the daemon for it), else temporary (a full disk, an I/O error: a later start may
/// succeed).
fn home_io(path: &Path, e: std::io::Error) -> StartError {
    use std::io::ErrorKind;
    let message = format!("{}: {e}", path.display());
    match e.kind() {
        ErrorKind::PermissionDenied
        | ErrorKind::ReadOnlyFilesystem
        | ErrorKind::NotADirectory
        | ErrorKind::IsADirectory
        | ErrorKind::NotFound => StartError::Home(message),
        _ => StartError::Io(message),
    }
}

/// The control socket's file, removed when the gateway stops or its start fails, but only
/// while it is still this gateway's own (a socket another process bound at the same path since
/// is left alone).
struct SocketFile {
    path: PathBuf,
    inode: Option<u64>,
}

impl SocketFile {
    fn new(path: PathBuf) -> SocketFile {
        use std::os::unix::fs::MetadataExt;
        let inode = std::fs::symlink_metadata(&path).ok().map(|m| m.ino());
        SocketFile { path, inode }
    }
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        use std::os::unix::fs::MetadataExt;
        let now = std::fs::symlink_metadata(&self.path).ok().map(|m| m.ino());
        if now.is_some() && now == self.inode {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Refuse a home that is group- or world-accessible, and create it 0700 when missing.
pub fn prepare_home(home: &Path) -> Result<(), StartError> {
    if !home.exists() {
        std::fs::create_dir_all(home)
            .map_err(|e| StartError::Home(format!("cannot create {}: {e}", home.display())))?;
        std::fs::set_permissions(home, std::fs::Permissions::from_mode(0o700)).map_err(|e| {
            StartError::Home(format!("cannot set permissions on {}: {e}", home.display()))
        })?;
    }
    // Through a symlink: a home linked to another disk is its target's directory, with the
    // target's permissions (it was refused as "not a directory").
    let meta = std::fs::metadata(home)
        .map_err(|e| StartError::Home(format!("{}: {e}", home.display())))?;
    if !meta.is_dir() {
        return Err(StartError::Home(format!(
            "{} is not a directory",
            home.display()
        )));
    }
    use std::os::unix::fs::MetadataExt;
    // Its owner can rewrite its api_keys and config, or put a socket of theirs in its place:
    // a home of another user's (a root daemon on a user's home) is theirs to command.
    let (owner, uid) = (meta.uid(), crate::api::control::own_uid());
    if owner != uid {
        return Err(StartError::Home(format!(
            "{} is owned by uid {owner}, not by this user (uid {uid}): its owner could rewrite \
             its keys and config. Use a home of this user's, or fix it with: chown {uid} {}",
            home.display(),
            home.display()
        )));
    }
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(StartError::Home(format!(
            "{} is accessible to other users (mode {:o}); the control socket there grants full control. \
             Fix it with: chmod 700 {}",
            home.display(),
            mode,
            home.display()
        )));
    }
    Ok(())
}

/// The directory in the home where sessions work when `terminal.cwd` names none.
pub const WORKSPACE: &str = "workspace";

/// A session's default cwd when `terminal.cwd` names none: `HOME/workspace`, made if missing.
/// Not the home itself: a command there sees the gateway's own files by listing its directory
/// (`for f in $(ls); do : > "$f"; done` emptied the ledger with no name for a rule to read).
fn default_workspace(home: &Path) -> Result<PathBuf, StartError> {
    let workspace = home.join(WORKSPACE);
    if !workspace.is_dir() {
        std::fs::create_dir_all(&workspace)
            .and_then(|()| {
                std::fs::set_permissions(&workspace, std::fs::Permissions::from_mode(0o700))
            })
            .map_err(|e| home_io(&workspace, e))?;
    }
    Ok(workspace)
}

/// What a stop may take past the drain timeout at most: the terminal's stop of background
/// processes and the HTTP server's close each get at least this much, however little of the
/// drain timeout the turns left them.
const TERMINAL_STOP_FLOOR: Duration = Duration::from_secs(1);
const SERVER_STOP_FLOOR: Duration = Duration::from_millis(250);

/// The longest a graceful stop takes, in seconds (what `TimeoutStopSec` has to exceed).
fn longest_stop_seconds(config: &Config) -> f64 {
    config.gateway.drain_timeout_seconds
        + config.gateway.drain_grace_seconds
        + (TERMINAL_STOP_FLOOR + SERVER_STOP_FLOOR).as_secs_f64()
}

/// A systemd time span (`90`, `90s`, `2min`, `1min 30s`, `1m30s`, `500ms`, `infinity`), in
/// seconds: what `TimeoutStopSec` is written as, so what the variable set equal to it says.
fn parse_timespan(text: &str) -> Option<f64> {
    let text = text.trim();
    if text == "infinity" {
        return Some(f64::INFINITY);
    }
    let (mut total, mut rest, mut parts) = (0.0, text, 0);
    while !rest.is_empty() {
        let number_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let number: f64 = rest[..number_end].parse().ok()?;
        rest = rest[number_end..].trim_start();
        let unit_end = rest
            .find(|c: char| !c.is_ascii_alphabetic())
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_end] {
            "" | "s" | "sec" | "second" | "seconds" => 1.0,
            "us" | "usec" => 1e-6,
            "ms" | "msec" => 1e-3,
            "m" | "min" | "minute" | "minutes" => 60.0,
            "h" | "hr" | "hour" | "hours" => 3600.0,
            "d" | "day" | "days" => 86400.0,
            _ => return None,
        };
        total += number * scale;
        rest = rest[unit_end..].trim_start();
        parts += 1;
    }
    (parts > 0).then_some(total)
}

/// Warn when systemd would kill the daemon before its drain can finish.
fn check_stop_budget(config: &Config) {
    let needed = longest_stop_seconds(config);
    let stated = std::env::var("GATEHOUSE_SYSTEMD_TIMEOUT_STOP_SEC").ok();
    if let Some(text) = stated.as_deref().filter(|t| parse_timespan(t).is_none()) {
        tracing::warn!(
            value = text,
            "GATEHOUSE_SYSTEMD_TIMEOUT_STOP_SEC is not a time span (90, 90s, 2min): cannot check \
             TimeoutStopSec against the drain timeout"
        );
        return;
    }
    match stated.as_deref().and_then(parse_timespan) {
        Some(limit) if limit <= needed => tracing::warn!(
            limit,
            needed,
            "TimeoutStopSec is not longer than gateway.drain_timeout_seconds + drain_grace_seconds \
             + 1.25 s (the terminal's and the server's last stops): systemd may SIGKILL the daemon \
             mid-drain (those turns would become unknown)"
        ),
        None if std::env::var_os("INVOCATION_ID").is_some() => tracing::warn!(
            "running under systemd without GATEHOUSE_SYSTEMD_TIMEOUT_STOP_SEC; cannot check TimeoutStopSec \
             against the drain timeout"
        ),
        _ => {}
    }
}

/// The API's origin on `addr`.
fn origin_of(addr: std::net::SocketAddr) -> String {
    match addr {
        std::net::SocketAddr::V6(a) => format!("http://[{}]:{}", a.ip(), a.port()),
        std::net::SocketAddr::V4(a) => format!("http://{}:{}", a.ip(), a.port()),
    }
}

/// What opening and recovering the store found.
struct Opened {
    pool: store::SqlitePool,
    epoch: i64,
    recovered: usize,
    to_pump: Vec<String>,
    gateway_id: String,
}

/// Open the store (bringing its schema up to date), take the next authority epoch, settle what
/// the last process left `started` as `unknown`, close its prompts, and find the sessions with
/// queued work. Blocking: it may wait on a migration or on another process's write lock.
fn open_and_recover(
    db_path: &Path,
    home: &Path,
    instance_id: &str,
    clock: &dyn crate::clock::Clock,
    configured_id: Option<String>,
) -> Result<Opened, StartError> {
    // The writer, the checkpointer, blocking writes, the readers and the pages' reader.
    let pool = store::open_pool(db_path, 4 + READERS)?;
    let mut conn = pool
        .get()
        .map_err(|e| crate::error::StoreError::Pool(e.to_string()))?;
    // The start's time is after the schema's migration, which may have taken a while.
    let now = clock.now();
    let taken = read_epoch_mark(home);
    let epoch = epoch::begin_epoch_above(&mut conn, instance_id, now, taken)?;
    let recovered = epoch::recover_started(&mut conn, epoch, now)?;
    prompts::close_abandoned(&mut conn, epoch, now)?;
    let to_pump = admissions::sessions_ready_to_pump(&mut conn)?;
    let gateway_id = match configured_id {
        Some(id) => id,
        None => epoch::meta_get_or_create(&mut conn, "gateway_id", || {
            format!("gw-{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
        })?,
    };
    drop(conn);
    Ok(Opened {
        pool,
        epoch,
        recovered,
        to_pump,
        gateway_id,
    })
}

/// The listener's answers while the store opens and recovers: `/healthz` 200, `/readyz` 503
/// `starting`, anything else 503 `starting` (come back in a second). Stopped on drop (a failed
/// start) or by [`StartingHttp::stop`] before the gateway's own server takes the listener.
struct StartingHttp(actix_web::dev::ServerHandle);

impl StartingHttp {
    fn serve(tcp: &std::net::TcpListener, max_connections: usize) -> Result<Self, StartError> {
        let listener = tcp.try_clone().map_err(StartError::Listen)?;
        // Every answer closes its connection: one kept alive would be cut when the gateway's
        // own server takes the listener, and a client's retry on it lost.
        let server = HttpServer::new(|| App::new().configure(crate::api::http::starting_routes))
            .keep_alive(actix_web::http::KeepAlive::Disabled)
            .workers(1)
            .disable_signals()
            .shutdown_timeout(0)
            .max_connections(max_connections)
            .listen(listener)
            .map_err(StartError::Listen)?
            .run();
        let handle = server.handle();
        actix_rt::spawn(async move {
            if let Err(e) = server.await {
                tracing::warn!(error = %e, "the starting listener stopped");
            }
        });
        Ok(StartingHttp(handle))
    }

    /// Stop answering, and wait until the listener is let go.
    async fn stop(self) {
        self.0.stop(false).await;
    }
}

impl Drop for StartingHttp {
    fn drop(&mut self) {
        // Sent at once; a failed start does not wait for it.
        drop(self.0.stop(false));
    }
}

/// Build and start the hosted-room runtime over the local session port.
fn start_rooms(
    config: &Config,
    pool: store::SqlitePool,
    authority: &Authority,
    clock: SharedClock,
    gateway_id: &str,
    process_generation: &str,
) -> Result<Arc<RoomsService>, StartError> {
    let rooms_db = RoomsDb::with_writer(pool, authority.shared.db.clone());
    // This process holds the session authority's epoch now: leases its predecessors held end.
    let (gid, generation, now) = (
        gateway_id.to_string(),
        process_generation.to_string(),
        clock.clone(),
    );
    let ended = rooms_db
        .write_sync(move |c| {
            store::leases::end_earlier_process_leases(c, &gid, &generation, now.as_ref())
        })
        .map_err(|e| StartError::Rooms(e.to_string()))?;
    if ended > 0 {
        tracing::info!(leases = ended, "ended the room leases of earlier processes");
    }
    let hub = Arc::new(RoomEventHub::default());
    let bindings: BindingSource = {
        let (db, gid) = (rooms_db.clone(), gateway_id.to_string());
        Arc::new(move || {
            db.run_sync(|c| store::rooms::list_bindings_for_gateway(c, &gid))
                .map(|rooms| {
                    rooms
                        .into_iter()
                        .map(|(room_id, epoch, disbanding)| {
                            RoomBinding::new(room_id, gid.clone(), epoch).disbanding(disbanding)
                        })
                        .collect()
                })
                .unwrap_or_else(|e| {
                    tracing::error!(error = %e, "cannot list rooms");
                    Vec::new()
                })
        })
    };
    let poll = Duration::from_secs_f64(config.rooms.active_poll_interval_seconds);
    let runtime = RoomRuntime::builder(rooms_db.clone(), bindings)
        .rpc(crate::rooms::local::port(authority.clone(), poll))
        .hooks(hub.clone())
        .clock(clock.clone())
        .config(config.rooms.clone())
        .process_generation(process_generation.to_string())
        .build()
        .map_err(|e| StartError::Rooms(e.to_string()))?;
    crate::rooms::db::spawn_task_pruner(rooms_db.clone(), clock.clone(), &config.rooms);
    let scheduler = crate::rooms::actors::RoomScheduler::new(runtime.clone()).start();
    tracing::info!(gateway = %gateway_id, "hosted rooms running");
    Ok(Arc::new(RoomsService {
        runtime,
        scheduler,
        db: rooms_db,
        hub,
        gateway_id: gateway_id.to_string(),
        clock,
        phase: authority.shared.runtime.clone(),
        max_prompt_bytes: config
            .session
            .max_text_bytes
            .min(store::room_tasks::MAX_PROMPT_BYTES),
    }))
}

pub struct Gateway;

impl Gateway {
    /// Boot a gateway on `home` with `config`. Must run inside an actix system.
    pub async fn start(home: PathBuf, config: Config) -> Result<RunningGateway, StartError> {
        let (_never, stop) = tokio::sync::watch::channel(false);
        Self::start_unless_stopped(home, config, stop).await
    }

    /// [`Gateway::start`], given up ([`StartError::Stopped`]) when `stop` turns true before
    /// anything durable is done (while it waits for its address, say): a SIGTERM then waited for
    /// the whole wait, and a start that then failed exited 2 although it was asked to stop. Once
    /// the store is opened the start goes on to its end (its caller then stops it gracefully).
    pub async fn start_unless_stopped(
        home: PathBuf,
        config: Config,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) -> Result<RunningGateway, StartError> {
        // Absolute from here on: the home is every session's default cwd, and a relative one
        // (`--home ./gatehouse-home`) would be refused as a cwd by every session create.
        let home = std::path::absolute(&home)
            .map_err(|e| StartError::Home(format!("{}: {e}", home.display())))?;
        prepare_home(&home)?;
        let lock = lock_home(&home)?;
        let mut config = config;
        let cwd_configured = config.terminal.cwd.is_some();
        if config.terminal.cwd.is_none() {
            config.terminal.cwd = Some(default_workspace(&home)?);
        }
        for warning in config.endpoint_warnings().iter().chain(&config.notices) {
            tracing::warn!("{warning}");
        }
        for key in config.unknown_keys() {
            tracing::warn!(key = %key, "unknown config key ignored");
        }
        let socket_path = control::socket_path(&home);
        // A Unix socket's path has at most 107 bytes: a longer one never binds, whatever the
        // next start does (it was a listen error, and the unit restarted it until its limit).
        if socket_path.as_os_str().len() > MAX_SOCKET_PATH {
            return Err(StartError::Home(format!(
                "the control socket's path {} is {} bytes, longer than a Unix socket's {MAX_SOCKET_PATH}: \
                 use a home with a shorter path",
                socket_path.display(),
                socket_path.as_os_str().len()
            )));
        }
        let listener = control::bind(&socket_path).map_err(StartError::Listen)?;
        // From here a failed start removes the socket it bound.
        let socket = SocketFile::new(socket_path);
        // Answered from now on: `identify` says `starting` until the gateway serves (a failed
        // start stops it), while it waits for its address and opens and recovers its store.
        let instance_id = uuid::Uuid::new_v4().simple().to_string();
        let starting = |api_origin: Option<String>| {
            Arc::new(control::Answerer::Starting {
                version: env!("CARGO_PKG_VERSION"),
                instance_id: instance_id.clone(),
                api_origin,
            })
        };
        let (answerer, answers) = tokio::sync::watch::channel(starting(None));
        let control_task = AbortOnDrop(actix_rt::spawn(control::serve(listener, answers)));
        // Listen before anything durable happens: a start that cannot serve takes no epoch
        // and recovers nothing, and leaves no actor behind.
        let tcp = tokio::select! {
            tcp = listen_waiting(
                || listen(config.gateway.bind_host(), config.gateway.port),
                Duration::from_secs_f64(config.gateway.bind_wait_seconds),
                BIND_RETRY,
            ) => tcp?,
            _ = stop.wait_for(|stop| *stop) => return Err(StartError::Stopped),
        };
        answerer.send_replace(starting(tcp.local_addr().ok().map(origin_of)));
        if !config.gateway.is_loopback()
            && !crate::api::auth::any_api_key(&home, &config.gateway.api_keys)
        {
            return Err(StartError::Refused(format!(
                "gateway.host {} is not a loopback address: configure at least one gateway.api_keys entry \
                 (or run `gatehouse key create`) first",
                config.gateway.host
            )));
        }
        if let Some(cwd) = &config.terminal.cwd {
            if !cwd.is_dir() {
                return Err(StartError::Refused(format!(
                    "terminal.cwd {} is not an existing directory",
                    cwd.display()
                )));
            }
            // The cwd of every session made without one (chat completions, room members),
            // which a client cannot choose: outside the roots, each of those is refused.
            let real = cwd.canonicalize().unwrap_or_else(|_| cwd.clone());
            if !config.gateway.cwd_allowed(&real) {
                let what = format!(
                    "terminal.cwd {} (the cwd of sessions made without one: chat completions, \
                     hosted-room members) is outside gateway.allowed_cwd_roots",
                    cwd.display()
                );
                if cwd_configured {
                    return Err(StartError::Refused(format!(
                        "{what}: set it within a root, or add it to the roots"
                    )));
                }
                tracing::warn!("{what}: those sessions are refused until terminal.cwd names a directory within a root");
            }
        }
        if !crate::tools::redact::ready() || !crate::tools::danger::all_rules_compiled() {
            return Err(StartError::Refused(
                "the secret filter's or the dangerous-command rules' patterns do not compile in \
                 this build (check the regex crate's features)"
                    .into(),
            ));
        }
        check_stop_budget(&config);
        let clock: SharedClock = Arc::new(SystemClock::default());
        let db_path = home.join("state.db");
        if *stop.borrow() {
            return Err(StartError::Stopped);
        }
        // Meanwhile the listener answers too: alive, not ready, everything else `starting`.
        // Optional: without it the listener's clients wait in its queue, as they did before.
        let early_http = StartingHttp::serve(&tcp, config.gateway.max_connections)
            .map_err(|e| tracing::warn!(error = %e, "cannot answer HTTP while starting"))
            .ok();
        // Off this thread, which answers the control socket and the listener meanwhile (a
        // migration can take a while, another process may hold the write lock).
        let Opened {
            pool,
            epoch,
            recovered,
            to_pump,
            gateway_id,
        } = {
            let (path, home) = (db_path.clone(), home.clone());
            let (instance_id, clock) = (instance_id.clone(), clock.clone());
            let configured = config.gateway.id.clone();
            actix_rt::task::spawn_blocking(move || {
                open_and_recover(&path, &home, &instance_id, clock.as_ref(), configured)
            })
            .await
            .map_err(|e| {
                StartError::Store(crate::error::StoreError::Other(format!(
                    "opening the store stopped: {e}"
                )))
            })??
        };
        tracing::info!(
            epoch,
            instance = %instance_id,
            version = env!("CARGO_PKG_VERSION"),
            "authority epoch taken"
        );
        if recovered > 0 {
            // Work that was running when the last process died: each holds its session until
            // an operator resolves it (never run again).
            // The commands name this home: under a service user, the operator's default home is
            // another one. (Hints sent to clients leave the home's path out.)
            let shown = crate::chat::shell_word(&home.display().to_string());
            tracing::warn!(
                recovered,
                "inputs left running by the last process are now unknown; list them with \
                 `gatehouse pending --home {shown}`, settle each with `gatehouse \
                 resolve-unknown SESSION ADMISSION --home {shown}`"
            );
        }
        write_epoch_mark(&home, epoch);
        let metrics = Arc::new(Metrics::default());
        let db = Db::start(pool.clone(), READERS as usize).with_metrics(metrics.clone());
        db.watch_file(&db_path)?;
        // Short rounds: each copies little, and the WAL stays small.
        store::spawn_checkpointer(&db, &db_path, Duration::from_millis(100));
        let m = &config.model;
        let model = ModelClient::start_on_own_arbiter(ModelClientConfig {
            connect_timeout: Duration::from_secs_f64(m.connect_timeout_seconds),
            idle_timeout: Duration::from_secs_f64(m.idle_timeout_seconds),
            max_concurrent: m.max_concurrent_requests,
            max_retries: m.max_retries,
            max_response_bytes: m.max_response_bytes,
            retry_base: Duration::from_millis(500),
            metrics: Some(metrics.clone()),
        });
        let endpoint = config.default_endpoint();
        if endpoint.provider == "echo" {
            tracing::warn!("no model configured: using the built-in echo provider (set model.base_url for a real one)");
        }
        let runtime = Arc::new(RuntimeState::new(instance_id, epoch));
        // Asked to stop while the store was opened (a migration, a lock another process held):
        // stopping from here on, so nothing queued starts now only to be interrupted by the
        // stop that follows the start (queued work runs after the restart, as a graceful stop
        // promises), and no room task is handed to its member.
        if *stop.borrow() {
            runtime.set_phase(RuntimePhase::Stopping);
        }
        let shared = Arc::new(Shared {
            config: config.clone(),
            home: home.clone(),
            db,
            epoch,
            model,
            terminal: TerminalTool::start_on_own_arbiter(
                config.terminal.max_background,
                home.join(BACKGROUND_LOGS),
                // Its own setting: tied to the events' retention, a log was kept for good
                // whenever the events were kept by count alone (`events.retention_seconds: 0`).
                (config.terminal.log_retention_seconds > 0.0)
                    .then(|| Duration::from_secs_f64(config.terminal.log_retention_seconds)),
            ),
            runtime: runtime.clone(),
            clock: clock.clone(),
            metrics,
            ledger: Default::default(),
            settlements: Default::default(),
        });
        let registry = SessionRegistry::new(shared.clone()).start();
        let authority = Authority {
            shared: shared.clone(),
            registry: registry.clone(),
            rooms: Arc::new(std::sync::OnceLock::new()),
        };
        let rooms = start_rooms(
            &config,
            pool,
            &authority,
            clock.clone(),
            &gateway_id,
            &runtime.instance_id,
        )?;
        let _ = authority.rooms.set(rooms.clone());
        let tickets = Arc::new(Tickets::new(
            config.gateway.ticket_ttl_seconds,
            clock.clone(),
        ));
        crate::store::events::spawn_pruner(
            shared.db.clone(),
            clock.clone(),
            config.events.retention(),
            Duration::from_secs_f64(config.events.prune_interval_seconds),
        );
        let state = web::Data::new(AppState {
            authority: authority.clone(),
            tickets: tickets.clone(),
            auth: Arc::new(crate::api::auth::HttpAuth::new(
                &home,
                &config,
                clock.clone(),
            )),
        });
        if let Some(early_http) = early_http {
            early_http.stop().await;
        }
        // Asked again after the start's last wait: a stop asked during it came after the look
        // above, and the queued work pumped before it started, only to be interrupted by the
        // stop that follows (it runs after the restart instead).
        if *stop.borrow() {
            runtime.set_phase(RuntimePhase::Stopping);
        }
        if !to_pump.is_empty() && !runtime.draining() {
            tracing::info!(sessions = to_pump.len(), "resuming queued work");
            registry.do_send(PumpSessions(to_pump));
        }
        let server = HttpServer::new(move || App::new().app_data(state.clone()).configure(routes))
            .on_connect(crate::api::ws::on_connect)
            .workers(2)
            .tcp_nodelay(true)
            .disable_signals()
            .shutdown_timeout(5)
            .max_connections(config.gateway.max_connections)
            // A client that closes its side has left: its request ends then. A long poll, a
            // plain completion, or an event stream whose client had gone went on to its
            // deadline (its subscription, its supervisor kept), and such requests piled up.
            .h1_allow_half_closed(false)
            .listen(tcp)
            .map_err(StartError::Listen)?;
        let addr = server
            .addrs()
            .first()
            .copied()
            .ok_or_else(|| StartError::Refused("no listening address".into()))?;
        let api_origin = origin_of(addr);
        if let Ok(mut o) = runtime.api_origin.lock() {
            *o = api_origin.clone();
        }
        let server = server.run();
        let handle = server.handle();
        actix_rt::spawn(async move {
            if let Err(e) = server.await {
                tracing::error!(error = %e, "http server stopped");
            }
        });
        let ctl = Arc::new(Control {
            authority,
            tickets: tickets.clone(),
            version: env!("CARGO_PKG_VERSION"),
        });
        answerer.send_replace(Arc::new(control::Answerer::Ready(ctl)));
        // A start asked to stop stays stopping (its caller stops it next).
        if !runtime.draining() {
            runtime.set_phase(RuntimePhase::Ready);
        }
        crate::notify::ready(&format!("serving {api_origin}"));
        tracing::info!(api = %api_origin, home = %home.display(), "gatehouse ready");
        Ok(RunningGateway {
            home,
            api_origin,
            runtime,
            shared,
            registry,
            rooms,
            server: handle,
            tickets,
            control_task,
            _lock: lock,
            socket,
        })
    }
}

impl RunningGateway {
    /// Graceful stop: refuse new work, interrupt running turns and let them settle
    /// `interrupted`, keep queued work queued, then close the listeners.
    pub async fn stop(self) {
        self.runtime.set_phase(RuntimePhase::Stopping);
        crate::notify::stopping();
        let grace = self.shared.config.gateway.drain_grace_seconds;
        if grace > 0.0 {
            // Keep answering `/readyz` 503 (and refusing new work) so load balancers move away first.
            tracing::info!(grace, "refusing new work before the drain");
            tokio::time::sleep(Duration::from_secs_f64(grace)).await;
        }
        tracing::info!("draining");
        // Before the rooms quiesce and the drain reaches the sessions: a turn that is between
        // two steps then makes no further model call (one could start a few ms after SIGTERM).
        self.runtime.stop_turns();
        let draining = std::time::Instant::now();
        let timeout = Duration::from_secs_f64(self.shared.config.gateway.drain_timeout_seconds);
        // The drain reaches the sessions now, beside the rooms' quiesce (its message is queued
        // as it is sent; its answer is awaited below). Sent after the quiesce, it left up to a
        // quarter of the timeout in which a turn's cancel was not set: the flag above stops a
        // turn between its steps, but a model call waiting out a retry's backoff sent its next
        // request, and a turn that failed in that window settled `failed`, not `interrupted`.
        // No session starts anything meanwhile: the phase refuses claims and new inputs.
        let drain_all = self.registry.send(DrainAll);
        tokio::pin!(drain_all);
        // Rooms start nothing new, but keep watching their attempts while the members drain: a
        // member turn the drain interrupts fails its room task under the room's lease, so the
        // lease is released below and the next boot drives the room at once (instead of
        // waiting out the lease of a task left `running`).
        // Bounded as every step of the stop is (its answer is quick, but it waits in a mailbox).
        // The drain's request is polled meanwhile: one the registry's full mailbox did not take
        // as it was sent is handed over when there is room, not after the quiesce.
        let mut drained = false;
        let quiesce = tokio::time::timeout(timeout.mul_f64(0.25), self.rooms.quiesce());
        tokio::pin!(quiesce);
        let quiesced = loop {
            tokio::select! {
                quiesced = &mut quiesce => break quiesced.is_ok(),
                _ = &mut drain_all, if !drained => drained = true,
            }
        };
        if !quiesced {
            tracing::warn!("the rooms did not quiesce in time");
        }
        // The sessions' drain (and the quiesce beside it) has three quarters of the timeout,
        // the rooms' idle wait and stop an eighth each.
        let sessions_share = timeout.mul_f64(0.75);
        let drain = sessions_share.saturating_sub(draining.elapsed());
        drained = drained || tokio::time::timeout(drain, &mut drain_all).await.is_ok();
        let rooms = timeout.saturating_sub(sessions_share) / 2;
        if !self.rooms.idle(rooms).await {
            tracing::warn!("room passes still observing attempts at the end of the drain");
        }
        if !self.rooms.stop(rooms).await {
            tracing::warn!("room workers did not stop in time");
        }
        // A settlement still on its way (a store retry) has what is left of the drain timeout
        // too: the stop went on at three quarters of it, and such a turn was left `started`
        // (unknown at the next boot) with time to spare.
        if !drained
            && tokio::time::timeout(timeout.saturating_sub(draining.elapsed()), &mut drain_all)
                .await
                .is_err()
        {
            tracing::warn!(
                ?timeout,
                "drain timed out; unsettled turns become unknown at the next boot"
            );
        }
        // What is left of the drain timeout, at least `floor`.
        let left = |floor: Duration| timeout.saturating_sub(draining.elapsed()).max(floor);
        // What the turns left running outlives them, not the gateway. Within the stop's budget:
        // the terminal thread may be held by a command's start on a mount that stopped
        // answering, and the stop then waited for it without end.
        let left_for_terminal = left(TERMINAL_STOP_FLOOR);
        match tokio::time::timeout(left_for_terminal, self.shared.terminal.send(StopBackground))
            .await
        {
            Ok(Ok(n @ 1..)) => tracing::info!(n, "background processes killed"),
            Ok(_) => {}
            Err(_) => tracing::warn!(
                left = ?left_for_terminal,
                "the terminal did not stop its background processes in time; they end with \
                 the process's cgroup under systemd"
            ),
        }
        self.tickets.revoke_all();
        drop(self.control_task);
        drop(self.socket);
        // Clients see 1001 "going away" rather than a five-second wait for them to hang up.
        crate::api::ws::close_all("server stopping");
        // HTTP requests still open (event streams, long polls) get what is left of the drain
        // timeout, not the server's own shutdown wait on top of it: the whole stop stays within
        // the budget systemd is told about. Those still open then end with the process.
        if tokio::time::timeout(left(SERVER_STOP_FLOOR), self.server.stop(true))
            .await
            .is_err()
        {
            tracing::info!("HTTP requests still open at the end of the drain timeout are cut");
        }
        tracing::info!("stopped");
    }
}

#[cfg(test)]
mod tests {
    use super::{home_io, StartError};
    use std::path::Path;

    /// A home reached through a symlink is its target: taken when the target is the user's
    /// alone, refused (for its permissions, not as "not a directory") when it is not.
    #[test]
    fn a_symlinked_home_is_its_target() {
        use std::os::unix::fs::PermissionsExt;
        let dir = crate::store::testing::tempfile_dir::TempDir::new();
        let (target, link) = (dir.path().join("target"), dir.path().join("link"));
        std::fs::create_dir(&target).expect("target");
        std::os::unix::fs::symlink(&target, &link).expect("link");
        let mode = |m: u32| {
            std::fs::set_permissions(&target, std::fs::Permissions::from_mode(m)).expect("chmod")
        };
        mode(0o700);
        super::prepare_home(&link).expect("a symlink to a 0700 directory");
        mode(0o755);
        let Err(StartError::Home(e)) = super::prepare_home(&link) else {
            panic!("a symlink to a 0755 directory was taken")
        };
        assert!(e.contains("accessible to other users"), "{e}");
    }

    /// The stop's budget counts the last stops' floors: a `TimeoutStopSec` one second past the
    /// drain timeout and grace could SIGKILL a stop whose turns used the whole drain timeout.
    #[test]
    fn the_stop_budget_counts_the_terminal_and_server_floors() {
        let mut config = crate::config::Config::default();
        config.gateway.drain_timeout_seconds = 10.0;
        config.gateway.drain_grace_seconds = 2.0;
        let longest = super::longest_stop_seconds(&config);
        assert!(longest > 13.0, "{longest}");
        assert!((longest - 13.25).abs() < 1e-9, "{longest}");
    }

    /// A home another user owns is refused, whatever its mode: its owner could rewrite its
    /// keys and config. (Giving a directory away needs root; elsewhere only the own home's
    /// acceptance is checked.)
    #[test]
    fn a_home_another_user_owns_is_refused() {
        let dir = crate::store::testing::tempfile_dir::TempDir::new();
        let home = private_dir(&dir.path().join("home"));
        super::prepare_home(&home).expect("the user's own home");
        if crate::api::control::own_uid() != 0 {
            return;
        }
        std::os::unix::fs::chown(&home, Some(65534), None).expect("chown");
        let Err(StartError::Home(e)) = super::prepare_home(&home) else {
            panic!("a home owned by another user was taken")
        };
        assert!(e.contains("owned by uid 65534"), "{e}");
    }

    /// A configured terminal.cwd outside gateway.allowed_cwd_roots refuses the start: every
    /// session made without a cwd (a chat completion, a room member) would be refused. One
    /// within a root starts.
    #[actix_rt::test]
    async fn a_terminal_cwd_outside_the_allowed_roots_refuses_the_start() {
        let dir = crate::store::testing::tempfile_dir::TempDir::new();
        let (root, elsewhere) = (dir.path().join("root"), dir.path().join("elsewhere"));
        for d in [root.join("work"), elsewhere.clone()] {
            std::fs::create_dir_all(d).expect("dir");
        }
        let start = |cwd: std::path::PathBuf, home: &str| {
            let home = private_dir(&dir.path().join(home));
            let mut config = crate::config::Config::default();
            config.gateway.allowed_cwd_roots = vec![root.clone()];
            config.terminal.cwd = Some(cwd);
            super::Gateway::start(home, config)
        };
        let Err(e) = start(elsewhere.clone(), "h1").await else {
            panic!("started with terminal.cwd outside the roots")
        };
        assert!(e.is_permanent(), "{e}");
        assert!(e.to_string().contains("allowed_cwd_roots"), "{e}");
        let gw = start(root.join("work"), "h2").await.expect("within a root");
        gw.stop().await;
    }

    /// `TimeoutStopSec`'s forms, as the variable set equal to it may be written.
    #[test]
    fn systemd_time_spans_are_read() {
        let read = super::parse_timespan;
        assert_eq!(read("90"), Some(90.0));
        assert_eq!(read("90s"), Some(90.0));
        assert_eq!(read("2min"), Some(120.0));
        assert_eq!(read("1min 30s"), Some(90.0));
        assert_eq!(read("1m30s"), Some(90.0));
        assert_eq!(read("1h"), Some(3600.0));
        assert_eq!(read("500ms"), Some(0.5));
        assert_eq!(read("infinity"), Some(f64::INFINITY));
        for bad in ["", "soon", "90 parsecs", "1..5s", "-5s"] {
            assert_eq!(read(bad), None, "{bad:?}");
        }
    }

    /// A home whose control socket's path is longer than a Unix socket's is refused for good,
    /// saying why (it was a listen error, restarted by the unit until its limit).
    #[actix_rt::test]
    async fn a_home_too_deep_for_its_socket_is_refused_for_good() {
        let dir = crate::store::testing::tempfile_dir::TempDir::new();
        let home = dir.path().join("h".repeat(120));
        let refused = super::Gateway::start(home, crate::config::Config::default()).await;
        let Err(e) = refused else {
            panic!("a home too deep for its socket started")
        };
        assert!(e.is_permanent(), "{e}");
        assert!(e.to_string().contains("shorter path"), "{e}");
    }

    /// What a restart cannot change exits 2 (the unit does not restart it); a store, a listener
    /// or the rooms' store may do better on a later start.
    #[test]
    fn only_refusals_a_restart_cannot_change_are_permanent() {
        assert!(StartError::Home("0755".into()).is_permanent());
        let full = std::io::Error::from_raw_os_error(libc::ENOSPC);
        assert!(!home_io(Path::new("/h/gateway.lock"), full).is_permanent());
        let denied = std::io::Error::from(std::io::ErrorKind::PermissionDenied);
        assert!(home_io(Path::new("/h/gateway.lock"), denied).is_permanent());
        assert!(StartError::Store(crate::error::StoreError::Other(
            "/h/state.db: file is not a database".into()
        ))
        .is_permanent());
        assert!(StartError::Refused("another gateway is serving".into()).is_permanent());
        assert!(!StartError::Rooms("database is locked".into()).is_permanent());
        assert!(
            !StartError::Store(crate::error::StoreError::Other("locked".into())).is_permanent()
        );
        assert!(
            !StartError::Listen(std::io::Error::from(std::io::ErrorKind::AddrInUse)).is_permanent()
        );
    }

    fn refused(kind: std::io::ErrorKind) -> Result<std::net::TcpListener, StartError> {
        Err(StartError::Listen(std::io::Error::from(kind)))
    }

    /// An address that appears while the start waits is listened on; one that never does, and
    /// any other failure, refuse the start (the first after the wait, the others at once).
    #[actix_rt::test]
    async fn a_start_waits_a_bounded_time_for_its_address_to_appear() {
        use std::io::ErrorKind::{AddrInUse, AddrNotAvailable};
        use std::time::{Duration, Instant};
        let (wait, retry) = (Duration::from_secs(10), Duration::from_millis(5));
        let mut tries = 0;
        let listener = super::listen_waiting(
            || {
                tries += 1;
                if tries < 4 {
                    refused(AddrNotAvailable)
                } else {
                    std::net::TcpListener::bind("127.0.0.1:0").map_err(StartError::Listen)
                }
            },
            wait,
            retry,
        )
        .await;
        assert!(listener.is_ok(), "{:?}", listener.err());
        assert_eq!(tries, 4);

        let started = Instant::now();
        let mut tries = 0;
        let never = super::listen_waiting(
            || {
                tries += 1;
                refused(AddrNotAvailable)
            },
            Duration::from_millis(100),
            retry,
        )
        .await;
        let waited = started.elapsed();
        let Err(e) = never else {
            panic!("an address that never appears was listened on")
        };
        assert!(e.is_permanent(), "{e}");
        assert!(e.to_string().contains("bind_wait_seconds"), "{e}");
        assert!(waited >= Duration::from_millis(100), "{waited:?}");
        assert!(waited < wait, "{waited:?}");
        assert!(tries >= 2, "retried: {tries}");

        let mut tries = 0;
        let in_use = super::listen_waiting(
            || {
                tries += 1;
                refused(AddrInUse)
            },
            wait,
            retry,
        )
        .await;
        assert!(in_use.is_err());
        assert_eq!(tries, 1, "a port in use is not waited for");

        // A name the resolver does not know yet is waited for (it refused the start at once,
        // for good: a resolver that came up late at boot left the daemon down); one it still
        // does not know after the wait is refused for good.
        let mut tries = 0;
        let resolved = super::listen_waiting(
            || {
                tries += 1;
                if tries < 3 {
                    Err(StartError::Resolve("not yet".into()))
                } else {
                    std::net::TcpListener::bind("127.0.0.1:0").map_err(StartError::Listen)
                }
            },
            wait,
            retry,
        )
        .await;
        assert!(resolved.is_ok(), "{:?}", resolved.err());
        assert_eq!(tries, 3);
        // The host as configured, bracketed and padded: bound as the address it names.
        let host = crate::config::GatewayConfig {
            host: " [127.0.0.1] ".into(),
            ..Default::default()
        };
        let bound = super::listen(host.bind_host(), 0).expect("a padded, bracketed address");
        assert!(bound.local_addr().expect("address").ip().is_loopback());
        let unresolved = super::listen("no-such-host.invalid", 0);
        let Err(e) = unresolved else {
            panic!("a name that does not resolve was listened on")
        };
        // (`ResolverDown` on a machine whose resolver cannot be reached.)
        assert!(
            matches!(e, StartError::Resolve(_) | StartError::ResolverDown(_)),
            "{e:?}"
        );
        let never = super::listen_waiting(
            || Err(StartError::Resolve("no such name".into())),
            Duration::from_millis(50),
            retry,
        )
        .await;
        let Err(e) = never else {
            panic!("a name that never resolves was listened on")
        };
        assert!(e.is_permanent(), "{e}");
        assert!(e.to_string().contains("bind_wait_seconds"), "{e}");
        // A resolver that cannot answer at all (no DNS server reachable yet) is waited for the
        // same, and its failure after the wait is not for good: systemd starts it again (it
        // was refused for good, as a name the resolver said it did not know).
        let never = super::listen_waiting(
            || Err(StartError::ResolverDown("no answer".into())),
            Duration::from_millis(50),
            retry,
        )
        .await;
        let Err(e) = never else {
            panic!("a name that never resolves was listened on")
        };
        assert!(!e.is_permanent(), "{e}");
        assert!(e.to_string().contains("bind_wait_seconds"), "{e}");
    }

    /// A lookup's temporary failure is told apart from a name the resolver does not know, in
    /// the words the standard library reports them with.
    #[test]
    fn a_resolver_that_cannot_answer_is_told_apart_from_an_unknown_name() {
        let words = |code: libc::c_int| {
            // SAFETY: `gai_strerror` returns a pointer to a static, NUL-terminated string.
            let text = unsafe { std::ffi::CStr::from_ptr(libc::gai_strerror(code)) };
            std::io::Error::other(format!(
                "failed to lookup address information: {}",
                text.to_string_lossy()
            ))
        };
        assert!(super::resolver_down(&words(libc::EAI_AGAIN)));
        assert!(!super::resolver_down(&words(libc::EAI_NONAME)));
        assert!(!super::resolver_down(&words(libc::EAI_FAIL)));
    }

    /// A gateway on a fresh home with session `s` (principal `p`), and that session's supervisor.
    async fn started_with_a_session() -> (
        crate::store::testing::tempfile_dir::TempDir,
        super::RunningGateway,
        actix::Addr<crate::session::supervisor::SessionSupervisor>,
    ) {
        started_with_a_session_on(crate::config::Config::default()).await
    }

    /// A directory at `path`, made, that only its user can use (as a home must be).
    fn private_dir(path: &Path) -> std::path::PathBuf {
        use std::os::unix::fs::PermissionsExt;
        std::fs::create_dir(path).expect("dir");
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        path.to_path_buf()
    }

    /// Session `id` (principal `p`) in `gw`'s store.
    async fn create_session(gw: &super::RunningGateway, id: &str) {
        let (epoch, id) = (gw.shared.epoch, id.to_string());
        gw.shared
            .db
            .write(move |c| {
                let new = crate::store::testing::new_session(&id);
                crate::store::sessions::create_or_get(c, epoch, &new, 1.0)
            })
            .await
            .expect("session");
    }

    /// Session `id` (principal `p`) calling the model at `base_url` with `toolsets` (JSON), and
    /// its supervisor.
    async fn session_on(
        gw: &super::RunningGateway,
        id: &str,
        base_url: String,
        toolsets: &str,
    ) -> actix::Addr<crate::session::supervisor::SessionSupervisor> {
        let (epoch, sid, toolsets) = (gw.shared.epoch, id.to_string(), toolsets.to_string());
        gw.shared
            .db
            .write(move |c| {
                let mut new = crate::store::testing::new_session(&sid);
                new.base_url = Some(base_url);
                new.toolsets_json = toolsets;
                crate::store::sessions::create_or_get(c, epoch, &new, 1.0)
            })
            .await
            .expect("session");
        gw.registry
            .send(crate::session::registry::GetSupervisor(id.into()))
            .await
            .expect("supervisor")
    }

    /// Input `a` ("hello") submitted to `sup`, admitted and started.
    async fn started_input(
        sup: &actix::Addr<crate::session::supervisor::SessionSupervisor>,
    ) -> crate::store::admissions::AdmissionRow {
        let started = sup
            .send(crate::session::supervisor::Submit {
                principal: "p".into(),
                input_id: "a".into(),
                text: "hello".into(),
            })
            .await
            .expect("sent")
            .expect("admitted");
        assert_eq!(started.status, "started");
        started
    }

    /// `gw`'s session authority, without its rooms.
    fn authority_of(gw: &super::RunningGateway) -> crate::api::rpc::Authority {
        crate::api::rpc::Authority {
            shared: gw.shared.clone(),
            registry: gw.registry.clone(),
            rooms: Default::default(),
        }
    }

    /// [`started_with_a_session`] with `config`.
    async fn started_with_a_session_on(
        config: crate::config::Config,
    ) -> (
        crate::store::testing::tempfile_dir::TempDir,
        super::RunningGateway,
        actix::Addr<crate::session::supervisor::SessionSupervisor>,
    ) {
        let dir = crate::store::testing::tempfile_dir::TempDir::new();
        let home = private_dir(&dir.path().join("home"));
        let gw = super::Gateway::start(home, config).await.expect("start");
        create_session(&gw, "s").await;
        let sup = gw
            .registry
            .send(crate::session::registry::GetSupervisor("s".into()))
            .await
            .expect("supervisor");
        (dir, gw, sup)
    }

    /// A replay of an admitted input that reaches its session's supervisor once the drain has
    /// begun (the RPC layer looked before the phase turned) is answered with its row, as one
    /// the RPC layer sees during the drain is; other text is a conflict, a new input is refused.
    #[actix_rt::test]
    async fn a_replay_its_supervisor_takes_during_the_drain_gets_its_admission() {
        use crate::error::GatewayError;
        use crate::session::supervisor::Submit;
        let (_dir, gw, sup) = started_with_a_session().await;
        let submit = |input_id: &str, text: &str| Submit {
            principal: "p".into(),
            input_id: input_id.into(),
            text: text.into(),
        };
        let admitted = sup
            .send(submit("a", "hello"))
            .await
            .expect("sent")
            .expect("admitted");
        gw.runtime.set_phase(super::RuntimePhase::Stopping);
        let again = sup
            .send(submit("a", "hello"))
            .await
            .expect("sent")
            .expect("the replay's admission");
        assert_eq!(again.admission_id, admitted.admission_id);
        let other = sup.send(submit("a", "other text")).await.expect("sent");
        assert!(
            matches!(other, Err(GatewayError::AdmissionConflict(_))),
            "{other:?}"
        );
        let new = sup.send(submit("b", "hello")).await.expect("sent");
        assert!(matches!(new, Err(GatewayError::RuntimeDraining)), "{new:?}");
        gw.stop().await;
    }

    /// A room's stop looks for its attempt's admission after every write queued before it: an
    /// admission whose submit answered ambiguously (its supervisor gone, its commit failed) may
    /// still be queued on the writer, and a read on a reader that did not see it let the stop
    /// be acknowledged (the task recorded cancelled) before the input ran.
    #[actix_rt::test]
    async fn a_rooms_stop_sees_an_admission_still_queued_on_the_writer() {
        use crate::rooms::port::SessionRef;
        use crate::session::supervisor::{GetLive, Submit};
        let (_dir, gw, sup) = started_with_a_session().await;
        let authority = authority_of(&gw);
        let port = crate::rooms::local::port(authority, std::time::Duration::from_millis(50));
        let task =
            crate::store::room_tasks::TaskIdentity::new("room", "t1", "th", "tu").expect("task");
        // The writer held: the member's admission is queued behind this write.
        let (release, held) = std::sync::mpsc::channel::<()>();
        let holding = gw.shared.db.write(move |_| {
            let _ = held.recv();
            Ok(())
        });
        let submitted = sup.send(Submit {
            principal: crate::rooms::local::ROOMS_PRINCIPAL.into(),
            input_id: crate::rooms::local::input_id("room", "t1", 1),
            text: "hello".into(),
        });
        // Its handler has run (so its write is queued) once a later message is answered.
        sup.send(GetLive).await.expect("live");
        let member = SessionRef {
            profile: "default".into(),
            session_id: "s".into(),
            source: crate::rooms::port::ROOM_SESSION_SOURCE.into(),
        };
        let mut withdraw = std::pin::pin!(port.withdraw_queued(member, task, 1));
        // Not answered while the admission it has to see is still queued (a reader answered
        // at once that the member never admitted the attempt).
        let early =
            tokio::time::timeout(std::time::Duration::from_millis(300), &mut withdraw).await;
        assert!(
            early.is_err(),
            "answered before the queued admission: {early:?}"
        );
        release.send(()).expect("release");
        holding.await.expect("held write");
        let admitted = submitted.await.expect("sent").expect("admitted");
        let withdrawn = withdraw.await.expect("withdraw");
        // Claimed with its admission (nothing else ran): it runs, and the stop interrupts it.
        assert_eq!(admitted.status, "started");
        assert_eq!(withdrawn, Some(false));
        gw.stop().await;
    }

    /// A snapshot lists a prompt its turn has recorded open but not yet handed to the session's
    /// supervisor: the request's event is at or before the snapshot's `last_sequence`, so a
    /// client that reads the events after it would never see the prompt otherwise.
    #[actix_rt::test]
    async fn a_snapshot_lists_a_prompt_recorded_before_it_is_handed_over() {
        // A model that takes the request and never answers: the turn stays running.
        let model = std::net::TcpListener::bind("127.0.0.1:0").expect("listener");
        let mut config = crate::config::Config::default();
        config.model.base_url = Some(format!("http://{}/v1", model.local_addr().expect("addr")));
        let (_dir, gw, sup) = started_with_a_session_on(config).await;
        let started = started_input(&sup).await;
        let generation = started.execution_generation.expect("generation");
        // What a turn commits before it hands the prompt over (`RegisterPrompt`).
        let (epoch, admission) = (gw.shared.epoch, started.admission_id.clone());
        let events = gw
            .shared
            .db
            .write(move |c| {
                let payload = serde_json::json!({"kind": "clarify", "prompt_id": "q1",
                    "question": "which?", "execution_generation": generation});
                crate::store::prompts::record_open(
                    c, epoch, "q1", "s", &admission, generation, "clarify", &payload, 2.0,
                )
            })
            .await
            .expect("recorded open");
        let authority = authority_of(&gw);
        let snap = authority.snapshot("s").await.expect("snapshot");
        assert!(
            snap["last_sequence"].as_i64() >= Some(events[0].seq),
            "{snap}"
        );
        let prompts = snap["prompts"].as_array().cloned().unwrap_or_default();
        assert_eq!(prompts.len(), 1, "{snap}");
        assert_eq!(prompts[0]["prompt_id"], "q1");
        gw.stop().await;
    }

    /// A session.resume refused after its subscription was made (the snapshot could not be
    /// read: here the session's stored policy is damaged) takes the subscription back: kept,
    /// the connection did not know of it (its close never ended it), and the supervisor stayed
    /// followed, in memory, for good.
    #[actix_rt::test]
    async fn a_refused_resume_leaves_no_subscription_behind() {
        use crate::session::supervisor::IsIdle;
        use actix::Actor;
        let (_dir, gw, sup) = started_with_a_session().await;
        gw.shared
            .db
            .write(|c| {
                use diesel::RunQueryDsl;
                diesel::sql_query("UPDATE sessions SET toolsets_json = 'damaged' WHERE id = 's'")
                    .execute(c)?;
                Ok(())
            })
            .await
            .expect("damage the policy");
        let authority = authority_of(&gw);
        let sink = Sink.start();
        let caller = crate::api::rpc::Caller {
            principal: "p".into(),
            conn_id: 7,
            recipient: Some(sink.clone().recipient()),
            subscribed: Default::default(),
        };
        let resumed = authority
            .call(
                "session.resume",
                serde_json::json!({"session_id": "s"}),
                &caller,
            )
            .await;
        assert!(resumed.is_err(), "resumed a damaged session");
        let idle = sup.send(IsIdle).await.expect("asked");
        assert!(idle, "the refused resume's subscription is still there");
        drop(sink);
        gw.stop().await;
    }

    /// A connection that follows nothing: what the events for it are handed to.
    struct Sink;

    impl actix::Actor for Sink {
        type Context = actix::Context<Self>;
    }

    impl actix::Handler<crate::session::supervisor::PushEvent> for Sink {
        type Result = ();
        fn handle(&mut self, _: crate::session::supervisor::PushEvent, _: &mut Self::Context) {}
    }

    /// Records whether each push it gets says events were lost.
    struct Watcher(tokio::sync::mpsc::UnboundedSender<bool>);

    impl actix::Actor for Watcher {
        type Context = actix::Context<Self>;
    }

    impl actix::Handler<crate::session::supervisor::PushEvent> for Watcher {
        type Result = ();
        fn handle(&mut self, m: crate::session::supervisor::PushEvent, _: &mut Self::Context) {
            let _ = self.0.send(m.is_lost());
        }
    }

    /// A session supervisor ended by a fault in one of its handlers tells its followers that
    /// they lost its events (their connections are then cut off, and a client resumes on the
    /// new supervisor): they were left following it, told nothing, and got no more events.
    #[actix_rt::test]
    async fn followers_of_a_supervisor_ended_by_a_fault_are_told_they_lost_its_events() {
        use crate::session::supervisor::{PanicForTest, Subscribe};
        use actix::Actor;
        let (_dir, _gw, sup) = started_with_a_session().await;
        let (tx, mut pushed) = tokio::sync::mpsc::unbounded_channel();
        let watcher = Watcher(tx).start();
        sup.send(Subscribe {
            conn_id: 7,
            recipient: watcher.clone().recipient(),
        })
        .await
        .expect("subscribed");
        assert!(
            sup.send(PanicForTest).await.is_err(),
            "the handler's fault ended it"
        );
        let told = tokio::time::timeout(std::time::Duration::from_secs(10), pushed.recv())
            .await
            .expect("told within 10 s");
        assert_eq!(told, Some(true), "told that its events were lost");
    }

    /// A session supervisor ended by a fault in a handler while its turn ran leaves that input
    /// `unknown` (reported by `session.info {unknown}`), as a crash would, for the operator to
    /// resolve at once: it stayed `started`, holding the session's queue until a restart.
    #[actix_rt::test]
    async fn a_turn_dropped_by_its_supervisors_fault_is_unknown_at_once() {
        use crate::session::supervisor::PanicForTest;
        // A model that takes the request and never answers: the turn stays running.
        let model = std::net::TcpListener::bind("127.0.0.1:0").expect("listener");
        let base_url = format!("http://{}/v1", model.local_addr().expect("addr"));
        let (_dir, gw, _) = started_with_a_session().await;
        let sup = session_on(&gw, "m", base_url, "[]").await;
        let started = started_input(&sup).await;
        let generation = started.execution_generation.expect("generation");
        // The model has the request: the turn runs (a failed one settles on its own).
        model.set_nonblocking(true).expect("nonblocking");
        let model = tokio::net::TcpListener::from_std(model).expect("listener");
        let _asked = tokio::time::timeout(std::time::Duration::from_secs(20), model.accept())
            .await
            .expect("the model is asked within 20 s")
            .expect("accepted");
        assert!(
            sup.send(PanicForTest).await.is_err(),
            "the handler's fault ended it"
        );
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        let status = loop {
            let id = started.admission_id.clone();
            let row = gw
                .shared
                .db
                .write(move |c| crate::store::admissions::by_id(c, &id))
                .await
                .expect("row");
            if row.status != "started" || tokio::time::Instant::now() > deadline {
                break row.status;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        };
        assert_eq!(status, "unknown");
        let events = gw
            .shared
            .db
            .read(|c| crate::store::events::since(c, "m", 0, 100))
            .await
            .expect("events");
        let told = events.events.iter().any(|e| {
            let p = e.payload();
            e.kind == "session.info"
                && p["unknown"] == started.admission_id.as_str()
                && p["execution_generation"] == generation
        });
        assert!(
            told,
            "no session.info {{unknown}} among {:?}",
            events.events
        );
        gw.stop().await;
    }

    /// The command a turn was running when its supervisor's fault dropped the turn is stopped
    /// (as a crash under systemd stops it): it ran on to its own timeout, its input `unknown`.
    #[actix_rt::test]
    async fn a_command_of_a_turn_dropped_by_its_supervisors_fault_is_stopped() {
        use crate::session::supervisor::PanicForTest;
        use std::io::{BufRead, Read, Write};
        let dir = crate::store::testing::tempfile_dir::TempDir::new();
        let pid_file = dir.path().join("pid");
        // A model that asks for one command, which writes its pid and sleeps.
        let model = std::net::TcpListener::bind("127.0.0.1:0").expect("listener");
        let base_url = format!("http://{}/v1", model.local_addr().expect("addr"));
        let command = format!("echo $$ > {}; exec sleep 60", pid_file.display());
        std::thread::spawn(move || {
            let Ok((stream, _)) = model.accept() else {
                return;
            };
            let mut reader = std::io::BufReader::new(&stream);
            let mut length = 0usize;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 {
                    return;
                }
                let line = line.trim_end().to_ascii_lowercase();
                if line.is_empty() {
                    break;
                }
                if let Some(v) = line.strip_prefix("content-length:") {
                    length = v.trim().parse().unwrap_or(0);
                }
            }
            let mut body = vec![0u8; length];
            if reader.read_exact(&mut body).is_err() {
                return;
            }
            let body: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
            let call = serde_json::json!({"index": 0, "id": "c1", "type": "function",
                "function": {"name": "terminal",
                             "arguments": serde_json::json!({"command": command}).to_string()}});
            let (kind, text) = if body["stream"].as_bool().unwrap_or(false) {
                let frame = serde_json::json!({"id": "m", "choices": [{"index": 0,
                    "delta": {"role": "assistant", "tool_calls": [call]},
                    "finish_reason": "tool_calls"}]});
                (
                    "text/event-stream",
                    format!("data: {frame}\n\ndata: [DONE]\n\n"),
                )
            } else {
                let frame = serde_json::json!({"id": "m", "choices": [{"index": 0,
                    "message": {"role": "assistant", "content": null, "tool_calls": [call]},
                    "finish_reason": "tool_calls"}]});
                ("application/json", frame.to_string())
            };
            let _ = write!(
                &stream,
                "HTTP/1.1 200 OK\r\nContent-Type: {kind}\r\nContent-Length: {}\r\n\
                 Connection: close\r\n\r\n{text}",
                text.len()
            );
        });
        let home = private_dir(&dir.path().join("home"));
        let gw = super::Gateway::start(home, crate::config::Config::default())
            .await
            .expect("start");
        let sup = session_on(&gw, "t", base_url, r#"["terminal"]"#).await;
        started_input(&sup).await;
        async fn until(what: &str, done: impl Fn() -> bool) {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
            while !done() {
                assert!(
                    std::time::Instant::now() < deadline,
                    "{what}: not within 20 s"
                );
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        }
        let read_pid = || {
            std::fs::read_to_string(&pid_file)
                .ok()
                .and_then(|t| t.trim().parse::<u32>().ok())
        };
        until("the command started", || read_pid().is_some()).await;
        let proc = std::path::PathBuf::from(format!("/proc/{}", read_pid().unwrap_or(0)));
        assert!(proc.exists(), "the command runs");
        assert!(
            sup.send(PanicForTest).await.is_err(),
            "the handler's fault ended it"
        );
        until("the command stopped", || !proc.exists()).await;
        gw.stop().await;
    }

    /// A connection that closes while it resumes a session by another of its ids (its tip,
    /// after a compaction) knows only that id: its subscription on the root's supervisor is
    /// ended all the same (it stayed, and kept the supervisor followed, for good).
    #[actix_rt::test]
    async fn a_closed_connection_known_by_a_tip_id_is_unsubscribed_from_the_root() {
        use crate::session::registry::UnsubscribeFrom;
        use crate::session::supervisor::{IsIdle, Subscribe};
        use actix::Actor;
        let (_dir, gw, sup) = started_with_a_session().await;
        gw.shared
            .db
            .write(|c| {
                use diesel::RunQueryDsl;
                // `c`: a later session of `s`'s lineage (as a compaction makes).
                diesel::sql_query(
                    "INSERT INTO sessions (id, root_id, parent_session_id, tip_session_id, \
                     principal_id, request_id, request_digest, source, model, provider, base_url, \
                     cwd, toolsets_json, profile, title, system_prompt, runtime_generation, \
                     runtime_revision, compression_count, prompt_tokens, completion_tokens, \
                     started_at, ended_at, end_reason, ordinal) \
                     SELECT 'c', 's', 's', tip_session_id, principal_id, 'c', request_digest, \
                     source, model, provider, base_url, cwd, toolsets_json, profile, title, \
                     system_prompt, runtime_generation, runtime_revision, compression_count, \
                     prompt_tokens, completion_tokens, started_at, ended_at, end_reason, \
                     ordinal + 1000 FROM sessions WHERE id = 's'",
                )
                .execute(c)?;
                Ok(())
            })
            .await
            .expect("a later session of the lineage");
        let sink = Sink.start();
        sup.send(Subscribe {
            conn_id: 9,
            recipient: sink.clone().recipient(),
        })
        .await
        .expect("subscribed");
        assert!(!sup.send(IsIdle).await.expect("asked"), "followed");
        gw.registry.do_send(UnsubscribeFrom {
            root_id: "c".into(),
            conn_id: 9,
        });
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !sup.send(IsIdle).await.expect("asked") {
            assert!(
                std::time::Instant::now() < deadline,
                "still followed by the closed connection"
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        drop(sink);
        gw.stop().await;
    }

    /// A sweep lets idle sessions go while another is slow to say whether it is idle (here one
    /// starting behind every reader, held): it waited for every answer, and the slow one held
    /// every eviction up.
    #[actix_rt::test]
    async fn an_idle_session_is_let_go_of_while_another_is_slow_to_answer() {
        use crate::session::registry::{CountLoaded, GetSupervisor};
        use crate::session::supervisor::IsIdle;
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::{Arc, Condvar, Mutex};
        let mut config = crate::config::Config::default();
        config.session.max_in_memory = 1;
        let (_dir, gw, sup) = started_with_a_session_on(config).await;
        assert!(sup.send(IsIdle).await.expect("asked"), "s started, idle");
        drop(sup);
        create_session(&gw, "t").await;
        // Every reader held until the end.
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let holding = Arc::new(AtomicUsize::new(0));
        for _ in 0..super::READERS {
            let (db, gate, holding) = (gw.shared.db.clone(), gate.clone(), holding.clone());
            actix_rt::spawn(async move {
                let _ = db
                    .read(move |_| {
                        holding.fetch_add(1, Ordering::SeqCst);
                        let (open, opened) = &*gate;
                        let mut open = open.lock().unwrap_or_else(|e| e.into_inner());
                        while !*open {
                            open = opened.wait(open).unwrap_or_else(|e| e.into_inner());
                        }
                        Ok(())
                    })
                    .await;
            });
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while holding.load(Ordering::SeqCst) < super::READERS as usize {
            assert!(
                std::time::Instant::now() < deadline,
                "the readers were not held"
            );
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        // `t` starts behind them: it reads its log's head first, and answers nothing until then.
        let t = gw
            .registry
            .send(GetSupervisor("t".into()))
            .await
            .expect("t");
        let loaded = || gw.registry.send(CountLoaded);
        while loaded().await.expect("count") > 1 {
            assert!(
                std::time::Instant::now() < deadline,
                "the idle session was not let go of while t was slow to answer"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        *gate.0.lock().unwrap_or_else(|e| e.into_inner()) = true;
        gate.1.notify_all();
        drop(t);
        gw.stop().await;
    }
}
