//! Tools the model can call: `terminal` (a real child process, gated by dangerous-command
//! approval) and `clarify` (a question to the user). The prompt flow itself lives in the turn.

pub mod danger;
pub mod guard;
pub mod redact;
pub mod terminal;

use std::collections::HashMap;
use std::path::PathBuf;

use actix::prelude::*;
use serde_json::{json, Value};
use tokio::sync::watch;

pub use terminal::{CommandOutcome, CommandSpec, TerminalError};

/// Tool names this gateway knows.
pub const KNOWN_TOOLS: &[&str] = &["terminal", "clarify"];

/// The OpenAI function schema of `name`.
pub fn schema(name: &str) -> Option<Value> {
    match name {
        "terminal" => Some(json!({
            "type": "function",
            "function": {
                "name": "terminal",
                "description": "Run a shell command in the session's working directory and return its output and exit code.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "command": {"type": "string", "description": "The command line to run."},
                        "timeout": {"type": "integer", "description": "Seconds before the command is killed (at most the gateway's limit, which is also the default)."},
                        "workdir": {"type": "string", "description": "Working directory, absolute or under the session's (defaults to the session's)."},
                        "background": {"type": "boolean", "description": "Start the command and return at once, leaving it running (a server, a watcher); its output goes to a log file the result names, and the result gives its pid."}
                    },
                    "required": ["command"]
                }
            }
        })),
        "clarify" => Some(json!({
            "type": "function",
            "function": {
                "name": "clarify",
                "description": "Ask the user one or more questions and wait for the answer.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "question": {"type": "string"},
                        "choices": {"type": "array", "items": {"type": "string"}},
                        "multi_select": {"type": "boolean", "description": "The user may pick several of the choices (the answer is then their list)."},
                        "questions": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {
                                    "id": {"type": "string"},
                                    "question": {"type": "string"},
                                    "choices": {"type": "array", "items": {"type": "string"}},
                                    "multi_select": {"type": "boolean"}
                                },
                                "required": ["question"]
                            }
                        }
                    }
                }
            }
        })),
        _ => None,
    }
}

/// Runs terminal commands on its own arbiter so child processes never share a session's thread,
/// and keeps the background processes it started (`background: true`) until they end.
pub struct TerminalTool {
    /// Live background processes: their process group, by id.
    background: HashMap<String, libc::pid_t>,
    /// How many may live at once (`terminal.max_background`).
    max_background: usize,
    /// Where their logs go.
    logs: PathBuf,
    /// The gateway stops: no new one starts.
    closed: bool,
    /// Background starts on their way (their shells spawning): counted against the bound.
    starting: usize,
    /// How long the log of a process that has ended is kept (`None`: for good).
    log_max_age: Option<std::time::Duration>,
}

/// How often ended processes' old logs are looked for.
const LOG_PRUNE_EVERY: std::time::Duration = std::time::Duration::from_secs(3600);

impl Actor for TerminalTool {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        // What boots left (a crash's, or a stop's killed processes') ages out too.
        self.prune_logs();
        ctx.run_interval(LOG_PRUNE_EVERY, |act, _| act.prune_logs());
    }
}

impl TerminalTool {
    pub fn start_on_own_arbiter(
        max_background: usize,
        logs: PathBuf,
        log_max_age: Option<std::time::Duration>,
    ) -> Addr<TerminalTool> {
        let arbiter = Arbiter::new();
        TerminalTool::start_in_arbiter(&arbiter.handle(), move |_| TerminalTool {
            background: HashMap::new(),
            max_background,
            logs,
            closed: false,
            starting: 0,
            log_max_age,
        })
    }

    /// Remove the logs of processes that are not running, last written longer ago than
    /// `log_max_age` (a log is written while its process runs).
    fn prune_logs(&mut self) {
        let Some(max_age) = self.log_max_age else {
            return;
        };
        let Ok(entries) = std::fs::read_dir(&self.logs) else {
            return;
        };
        let mut removed = 0usize;
        for entry in entries.flatten() {
            let path = entry.path();
            // Only the logs this tool names (`bg-` and 12 hex digits): nothing else put there.
            let Some(id) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".log"))
                .filter(|id| {
                    id.strip_prefix("bg-").is_some_and(|hex| {
                        hex.len() == 12 && hex.bytes().all(|b| b.is_ascii_hexdigit())
                    })
                })
            else {
                continue;
            };
            if self.background.contains_key(id) {
                continue;
            }
            let old = entry
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age > max_age);
            if old && std::fs::remove_file(&path).is_ok() {
                removed += 1;
            }
        }
        if removed > 0 {
            tracing::info!(removed, "old background process logs removed");
        }
    }
}

/// Run one command; `cancel` true kills its process group.
pub struct RunCommand {
    pub spec: CommandSpec,
    pub cancel: watch::Receiver<bool>,
}

impl Message for RunCommand {
    type Result = Result<CommandOutcome, TerminalError>;
}

impl Handler<RunCommand> for TerminalTool {
    type Result = ResponseFuture<Result<CommandOutcome, TerminalError>>;

    fn handle(&mut self, m: RunCommand, _: &mut Context<Self>) -> Self::Result {
        Box::pin(terminal::run_command(m.spec, m.cancel))
    }
}

/// A background process started: its id, its shell's pid (which is its process group), and its
/// log.
#[derive(Debug, Clone)]
pub struct BackgroundStarted {
    pub id: String,
    pub pid: u32,
    pub log: PathBuf,
}

/// Start a command to run on after the call returns (`background: true`).
pub struct StartBackground {
    pub spec: CommandSpec,
    /// The turn's interrupt: set before the terminal takes the start up (its thread may be busy
    /// with other sessions' commands), nothing starts.
    pub cancel: watch::Receiver<bool>,
}

impl Message for StartBackground {
    type Result = Result<BackgroundStarted, TerminalError>;
}

impl Handler<StartBackground> for TerminalTool {
    type Result = ResponseActFuture<Self, Result<BackgroundStarted, TerminalError>>;

    fn handle(&mut self, m: StartBackground, _: &mut Context<Self>) -> Self::Result {
        let refused = |e: TerminalError| -> Self::Result { Box::pin(fut::ready(Err(e))) };
        if self.closed {
            return refused(TerminalError::Stopping);
        }
        // An interrupt acknowledged while the start waited for this thread: the client was told
        // the turn stopped, and a process that outlives it started after that.
        if *m.cancel.borrow() {
            return refused(TerminalError::Interrupted);
        }
        if self.background.len() + self.starting >= self.max_background {
            return refused(TerminalError::TooManyBackground(self.max_background));
        }
        let id = format!("bg-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
        let log = self.logs.join(format!("{id}.log"));
        let file = match open_log(&self.logs, &log) {
            Ok(file) => file,
            Err(e) => return refused(TerminalError::Log(e)),
        };
        // The directory's look and the shell's spawn (which waits for its `chdir` and `exec`)
        // on a thread of their own: on this one, which runs every session's commands, a
        // directory on a mount that stopped answering hung them all (their interrupts and time
        // limits with them).
        self.starting += 1;
        let (spec, cancel) = (m.spec, m.cancel);
        let command = redact::redact(&spec.command).into_owned();
        let cwd = spec.cwd.clone();
        let spawned = on_own_thread(terminal::SPAWN_TIMEOUT, move |given_up| {
            let started =
                terminal::spawn_background(&spec, file, terminal::BACKGROUND_LOG_CAP, &cancel)?;
            if given_up.load(std::sync::atomic::Ordering::SeqCst) {
                terminal::kill_group(libc::pid_t::try_from(started.0).unwrap_or(0));
                return Err(TerminalError::Spawn(std::io::Error::other(
                    "started too late",
                )));
            }
            Ok(started)
        });
        Box::pin(spawned.into_actor(self).map(move |spawned, act, ctx| {
            act.starting -= 1;
            let spawned = spawned.unwrap_or_else(|| Err(terminal::spawn_timed_out(&cwd)));
            let (pid, run) = match spawned {
                // The gateway began to stop while it started: nothing is left running past it.
                Ok((pid, _)) if act.closed => {
                    terminal::kill_group(libc::pid_t::try_from(pid).unwrap_or(0));
                    let _ = std::fs::remove_file(&log);
                    return Err(TerminalError::Stopping);
                }
                Ok(started) => started,
                Err(e) => {
                    // Nothing ran, or (interrupted as it started) its output was never read:
                    // no log of it is left.
                    let _ = std::fs::remove_file(&log);
                    return Err(e);
                }
            };
            let pgid = libc::pid_t::try_from(pid).unwrap_or(0);
            act.background.insert(id.clone(), pgid);
            tracing::info!(id = %id, pid, command = %command, "background process started");
            let ended = id.clone();
            ctx.spawn(run.into_actor(act).map(move |code, act, _| {
                act.background.remove(&ended);
                tracing::info!(id = %ended, pid, exit_code = ?code, "background process ended");
            }));
            Ok(BackgroundStarted { id, pid, log })
        }))
    }
}

/// The logs' directory (the daemon's user's only) and a new log in it, which only that user
/// may read: a command's output may hold what it printed of secrets.
fn open_log(dir: &std::path::Path, log: &std::path::Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    // Also when it was there already (made by hand, or under another umask).
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(log)
}

/// Kill every background process still running (the gateway stops); how many there were.
pub struct StopBackground;

impl Message for StopBackground {
    type Result = usize;
}

impl Handler<StopBackground> for TerminalTool {
    type Result = usize;

    fn handle(&mut self, _: StopBackground, _: &mut Context<Self>) -> usize {
        // A turn still finishing its tool call past the drain starts nothing that would be left.
        self.closed = true;
        let n = self.background.len();
        for (id, pgid) in self.background.drain() {
            // Each is the group its shell was made.
            terminal::kill_group(pgid);
            tracing::info!(id = %id, "background process killed: the gateway stops");
        }
        n
    }
}

/// The most threads [`on_own_thread`] keeps at once (stuck ones included).
const MAX_LOOKS: usize = 64;

/// Threads of [`on_own_thread`] alive now.
static LOOKS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Run `f` (which reads the file system, or spawns a process in a directory) on a thread of its
/// own, for at most `limit`: `None` past it, or if `f` panicked. A thread stuck on a mount that
/// stopped answering stays stuck, and nothing waits for it: not the caller's thread (which may
/// run every session), and not the process's exit (which waits for the runtime's blocking
/// threads). `f` runs in the caller's runtime context, and is told whether it was given up on.
pub(crate) async fn on_own_thread<T: Send + 'static>(
    limit: std::time::Duration,
    f: impl FnOnce(&std::sync::atomic::AtomicBool) -> T + Send + 'static,
) -> Option<T> {
    on_own_thread_within(&LOOKS, MAX_LOOKS, limit, f).await
}

/// [`on_own_thread`], with at most `most` threads counted in `looks` at once.
async fn on_own_thread_within<T: Send + 'static>(
    looks: &'static std::sync::atomic::AtomicUsize,
    most: usize,
    limit: std::time::Duration,
    f: impl FnOnce(&std::sync::atomic::AtomicBool) -> T + Send + 'static,
) -> Option<T> {
    use std::sync::atomic::{AtomicBool, Ordering};
    // Taken for as long as the thread lives (a stuck one keeps it): each call on a mount that
    // stopped answering left a thread behind, without bound (a turn's retries, 64 calls a
    // response). Past the bound, a look is given up on at once.
    if looks.fetch_add(1, Ordering::SeqCst) >= most {
        looks.fetch_sub(1, Ordering::SeqCst);
        tracing::warn!(
            threads = most,
            "file system looks are all still waiting (a mount that stopped answering?): this \
             one is given up on at once"
        );
        return None;
    }
    struct Taken(&'static std::sync::atomic::AtomicUsize);
    impl Drop for Taken {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }
    let taken = Taken(looks);
    let given_up = std::sync::Arc::new(AtomicBool::new(false));
    let flag = given_up.clone();
    let runtime = tokio::runtime::Handle::try_current().ok();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let spawned = std::thread::Builder::new()
        .name("gatehouse-look".into())
        .spawn(move || {
            let _taken = taken;
            let _entered = runtime.as_ref().map(|r| r.enter());
            let _ = tx.send(f(&flag));
        });
    if let Err(e) = spawned {
        // The closure, and the slot it holds, went with the failed spawn.
        tracing::error!(error = %e, "cannot start a thread");
        return None;
    }
    match tokio::time::timeout(limit, rx).await {
        Ok(answered) => answered.ok(),
        Err(_) => {
            given_up.store(true, Ordering::SeqCst);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, SystemTime};

    /// A look that does not answer in time is given up on (and told so), without waiting for
    /// it; one that answers gets its answer, in the caller's runtime.
    #[actix_rt::test]
    async fn a_look_on_its_own_thread_is_given_up_on_in_time() {
        use std::sync::atomic::Ordering;
        let (release, stuck) = std::sync::mpsc::channel::<()>();
        let (told_tx, told) = std::sync::mpsc::channel::<bool>();
        let started = std::time::Instant::now();
        let given_up = super::on_own_thread(Duration::from_millis(100), move |flag| {
            let _ = stuck.recv();
            let _ = told_tx.send(flag.load(Ordering::SeqCst));
        })
        .await;
        assert!(given_up.is_none());
        assert!(started.elapsed() < Duration::from_secs(5));
        release.send(()).expect("release");
        let told = told
            .recv_timeout(Duration::from_secs(10))
            .expect("the look ends");
        assert!(told, "the look was told it was given up on");
        let answered = super::on_own_thread(Duration::from_secs(10), |_| {
            tokio::runtime::Handle::try_current().is_ok()
        })
        .await;
        assert_eq!(answered, Some(true));
    }

    /// Threads stuck on a look are bounded: past the bound a look is given up on at once, with
    /// no thread started, until a stuck one ends (each stuck one was one more thread for good).
    #[actix_rt::test]
    async fn stuck_looks_are_bounded() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static LOOKS: AtomicUsize = AtomicUsize::new(0);
        let (release, stuck) = std::sync::mpsc::channel::<()>();
        let stuck = std::sync::Arc::new(std::sync::Mutex::new(stuck));
        for _ in 0..2 {
            let stuck = stuck.clone();
            let given_up =
                super::on_own_thread_within(&LOOKS, 2, Duration::from_millis(20), move |_| {
                    let _ = stuck.lock().map(|s| s.recv());
                })
                .await;
            assert!(given_up.is_none());
        }
        assert_eq!(LOOKS.load(Ordering::SeqCst), 2);
        let started = std::time::Instant::now();
        let ran = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let seen = ran.clone();
        let refused = super::on_own_thread_within(&LOOKS, 2, Duration::from_secs(10), move |_| {
            seen.store(true, Ordering::SeqCst);
        })
        .await;
        assert!(refused.is_none());
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "refused at once"
        );
        assert!(!ran.load(Ordering::SeqCst), "no thread ran it");
        // The stuck ones end: their slots come back.
        release.send(()).expect("release");
        release.send(()).expect("release");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while LOOKS.load(Ordering::SeqCst) > 0 {
            assert!(std::time::Instant::now() < deadline, "the slots come back");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let answered = super::on_own_thread_within(&LOOKS, 2, Duration::from_secs(10), |_| 7).await;
        assert_eq!(answered, Some(7));
    }

    /// An ended background process's log is removed once older than the retention (and with
    /// none set, never); a file the tool did not name is left alone whatever its age.
    #[test]
    fn ended_logs_age_out_after_their_retention_only() {
        let dir = std::env::temp_dir().join(format!("gatehouse-logs-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("dir");
        let week = Duration::from_secs(7 * 24 * 3600);
        let write = |name: &str, age: Duration| {
            let path = dir.join(name);
            let file = std::fs::File::create(&path).expect("a log");
            file.set_modified(SystemTime::now() - age).expect("its age");
            path
        };
        let old = write("bg-0123456789ab.log", week + Duration::from_secs(3600));
        let fresh = write("bg-abcdefabcdef.log", Duration::from_secs(60));
        let other = write("notes.log", 4 * week);
        let mut tool = TerminalTool {
            background: HashMap::new(),
            max_background: 8,
            logs: dir.clone(),
            closed: false,
            starting: 0,
            log_max_age: None,
        };
        tool.prune_logs();
        assert!(
            old.exists() && fresh.exists() && other.exists(),
            "kept for good"
        );
        tool.log_max_age = Some(week);
        tool.prune_logs();
        assert!(!old.exists(), "past the retention");
        assert!(fresh.exists() && other.exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A background start whose turn was interrupted before the terminal took it up starts
    /// nothing: it started, and ran on after the client was told the turn had stopped.
    #[actix_rt::test]
    async fn a_background_start_after_its_turns_interrupt_starts_nothing() {
        let dir = std::env::temp_dir().join(format!("gatehouse-bg-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("dir");
        let tool = TerminalTool::start_on_own_arbiter(8, dir.join("logs"), None);
        let marker = dir.join("started");
        let spec = CommandSpec::new(format!("touch {}", marker.display()), &dir);
        let (interrupt, cancel) = watch::channel(false);
        interrupt.send_replace(true);
        let started = tool
            .send(StartBackground {
                spec: spec.clone(),
                cancel,
            })
            .await
            .expect("the terminal answers");
        assert!(
            matches!(started, Err(TerminalError::Interrupted)),
            "{started:?}"
        );
        // Not interrupted: it starts.
        let (_interrupt, cancel) = watch::channel(false);
        let started = tool
            .send(StartBackground { spec, cancel })
            .await
            .expect("the terminal answers");
        assert!(started.is_ok(), "{started:?}");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !marker.exists() {
            assert!(std::time::Instant::now() < deadline, "it never ran");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
