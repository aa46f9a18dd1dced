//! Running one shell command in a real child process (Unix only).
//!
//! The command runs as `bash -c <command>` (falling back to `sh`) in its own
//! process group, with stdin closed and stdout/stderr captured together in
//! arrival order. On timeout or cancellation the whole process group is
//! killed with `SIGKILL`, and with it every process descended from the shell
//! that moved to a group of its own (`timeout`, a job of `set -m`, `setsid`):
//! they are stopped first, so none can fork past the kill.
//!
//! Background processes: once the shell itself has exited, remaining output
//! is read for at most [`DRAIN_AFTER_EXIT`]. If some process (typically a
//! backgrounded grandchild such as `sleep 30 & echo hi`) still holds the
//! output pipes at that point, the whole group is killed. A background
//! process that released the pipes (`server >log 2>&1 &`) is left running.
//!
//! Output handling: ANSI escape sequences are stripped, invalid UTF-8 is
//! decoded lossily, secrets are masked (`tools::redact`), trailing whitespace is trimmed and the result is capped
//! to [`CommandSpec::output_cap`] characters (first 40 % and last 60 % kept).
//! While reading, at most `4 × cap` bytes are kept for the head and a rolling
//! tail of `4 × cap` bytes (plus slack) for the end, so a command producing
//! gigabytes of output does not grow memory. When bytes had to be dropped
//! the "omitted" count in the truncation marker is computed from the number
//! of UTF-8 characters dropped (escape sequences in the dropped part are
//! counted as text).

use std::collections::{HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::process::{Child, ChildStderr, ChildStdout, Command};
use tokio::sync::watch;
use tokio::time::Instant;

/// Default output cap, in characters.
pub const DEFAULT_OUTPUT_CAP: usize = 50_000;
/// Default command timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(180);
/// Exit code reported when the command timed out.
pub const EXIT_CODE_TIMEOUT: i32 = 124;
/// Exit code reported when the command was interrupted.
pub const EXIT_CODE_INTERRUPTED: i32 = 130;
/// How long output is still read after the shell exited.
pub const DRAIN_AFTER_EXIT: Duration = Duration::from_millis(200);

const DRAIN_AFTER_KILL: Duration = Duration::from_millis(500);
const REAP_AFTER_KILL: Duration = Duration::from_secs(2);
const READ_CHUNK: usize = 64 * 1024;
const MIN_BUFFER: usize = 4096;
const SHELLS: &[&str] = &["bash", "/bin/bash", "sh", "/bin/sh"];

/// What to run and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandSpec {
    /// Shell command line, passed to `bash -c`.
    pub command: String,
    /// Working directory; must exist.
    pub cwd: PathBuf,
    /// Wall-clock limit for the shell process.
    pub timeout: Duration,
    /// Maximum output length in characters.
    pub output_cap: usize,
    /// Environment variables whose name starts with one of these are removed.
    pub env_remove_prefixes: Vec<String>,
    /// Environment variables with exactly these names are removed.
    pub env_remove: Vec<String>,
    /// Variables added to (or overriding) the inherited environment. Removal
    /// rules are applied after these, so they cannot reintroduce a removed
    /// variable.
    pub env_set: Vec<(String, String)>,
}

impl CommandSpec {
    /// A spec with the default timeout and output cap and no env changes.
    pub fn new(command: impl Into<String>, cwd: impl Into<PathBuf>) -> Self {
        Self {
            command: command.into(),
            cwd: cwd.into(),
            timeout: DEFAULT_TIMEOUT,
            output_cap: DEFAULT_OUTPUT_CAP,
            env_remove_prefixes: Vec::new(),
            env_remove: Vec::new(),
            env_set: Vec::new(),
        }
    }
}

/// Result of one command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandOutcome {
    /// Cleaned, capped combined output.
    pub output: String,
    /// Exit code (`128 + signal` when killed by a signal, 124 on timeout,
    /// 130 when interrupted).
    pub exit_code: i32,
    pub timed_out: bool,
    pub interrupted: bool,
    /// Whether the output was capped.
    pub truncated: bool,
    /// Whether the shell was started (an interrupt that came first starts nothing).
    pub started: bool,
}

impl CommandOutcome {
    /// The tool error message, if any.
    pub fn error_message(&self, timeout_secs: u64) -> Option<String> {
        if self.timed_out {
            Some(format!("Command timed out after {timeout_secs} seconds"))
        } else if self.interrupted {
            Some(
                "Command interrupted (the turn was stopped) after it started: it may have done \
                 part of its work"
                    .to_string(),
            )
        } else {
            None
        }
    }

    /// `{"output": ..., "exit_code": rc, "error": null | "..."}`.
    pub fn to_tool_json(&self, timeout_secs: u64) -> String {
        let error = self
            .error_message(timeout_secs)
            .map_or(serde_json::Value::Null, serde_json::Value::String);
        format!(
            "{{\"output\":{},\"exit_code\":{},\"error\":{}}}",
            serde_json::Value::from(self.output.as_str()),
            self.exit_code,
            error
        )
    }
}

/// Errors of a command that did not run, or (`Wait`) whose end could not be known.
#[derive(Debug, thiserror::Error)]
pub enum TerminalError {
    #[error("working directory {} does not exist or is not a directory", .0.display())]
    InvalidCwd(PathBuf),
    #[error("failed to start shell: {0}")]
    Spawn(#[source] io::Error),
    /// The command started: it may have done part of its work before it was killed.
    #[error(
        "the command started, but waiting for its shell failed ({0}): it was killed, and how far \
         it got is unknown"
    )]
    Wait(#[source] io::Error),
    #[error(
        "{0} background processes are running already (terminal.max_background): stop one \
         first (kill -- -PID)"
    )]
    TooManyBackground(usize),
    #[error("cannot open the background process's log: {0}")]
    Log(#[source] io::Error),
    #[error("the gateway is stopping: no background process starts now")]
    Stopping,
    /// The turn was interrupted before the terminal took up the start: nothing started.
    #[error("interrupted before it started")]
    Interrupted,
    /// The turn's interrupt came while a background start was being spawned: its shell had
    /// started and was killed at once, so it may have done part of its work.
    #[error(
        "the turn was interrupted as the command started: its shell had started and was killed \
         at once, so it may have done part of its work"
    )]
    InterruptedAtStart,
}

/// Runs `spec.command` and collects its output.
///
/// `cancel` interrupts the command when its value becomes `true`; dropping
/// the sender is not a cancellation. If the value is already `true` the
/// command is not started.
pub async fn run_command(
    spec: CommandSpec,
    mut cancel: watch::Receiver<bool>,
) -> Result<CommandOutcome, TerminalError> {
    if *cancel.borrow_and_update() {
        return Ok(CommandOutcome {
            output: String::new(),
            exit_code: EXIT_CODE_INTERRUPTED,
            timed_out: false,
            interrupted: true,
            truncated: false,
            started: false,
        });
    }
    let mut env = build_env(std::env::vars_os(), &spec);
    // Every process of this command inherits it (unless it clears its environment): found by
    // it, one that left the shell's group is killed with the group.
    let run = uuid::Uuid::new_v4().simple().to_string();
    env.retain(|(k, _)| k.as_bytes() != RUN_VAR.as_bytes());
    env.push((OsString::from(RUN_VAR), OsString::from(&run)));
    let mark = format!("{RUN_VAR}={run}");
    let mut child = spawn_off_thread(&spec, env).await?;
    let mut group = GroupGuard {
        pgid: child.id().and_then(|id| libc::pid_t::try_from(id).ok()),
        reaped: false,
        mark: Some(mark),
    };
    let mut pipes = Pipes::of(&mut child);
    let mut collector = Collector::new(spec.output_cap);

    let start = Instant::now();
    let deadline = start
        .checked_add(spec.timeout)
        .unwrap_or_else(|| start + Duration::from_secs(60 * 60 * 24 * 365));
    let mut status: Option<ExitStatus> = None;
    let mut drain_deadline: Option<Instant> = None;
    let mut cancel_live = true;

    let end = loop {
        if status.is_some() && !pipes.is_open() {
            break End::Completed;
        }
        tokio::select! {
            biased;
            changed = cancel.changed(), if cancel_live => match changed {
                Ok(()) => {
                    if *cancel.borrow_and_update() {
                        break End::Interrupted;
                    }
                }
                Err(_) => cancel_live = false,
            },
            () = tokio::time::sleep_until(deadline), if status.is_none() => break End::TimedOut,
            waited = child.wait(), if status.is_none() => match waited {
                Ok(exit) => {
                    status = Some(exit);
                    group.reaped = true;
                    drain_deadline = Some(Instant::now() + DRAIN_AFTER_EXIT);
                }
                // The guard kills the group and kill_on_drop the child.
                Err(err) => return Err(TerminalError::Wait(err)),
            },
            () = tokio::time::sleep_until(drain_deadline.unwrap_or(deadline)), if drain_deadline.is_some() => {
                break End::DrainExpired;
            }
            () = pipes.pump(&mut collector), if pipes.is_open() => {}
            else => break End::DrainExpired,
        }
    };

    // An interrupt that came once the shell had ended (its output still draining, or its exit
    // not yet seen) stops only what it left behind: the command ran to its end, and its exit
    // code stands (it was reported 130, "interrupted, may have done part of its work").
    // Likewise a deadline seen in the same look as the shell's exit (the terminal thread was
    // busy past both): the command ended in time, and its exit code stands (it was reported
    // timed out, and likely run again); what it left behind is stopped, its time being up.
    let end = match end {
        End::Interrupted if status.is_some() => End::EndedThenInterrupted,
        End::Interrupted | End::TimedOut => match child.try_wait() {
            Ok(Some(exit)) => {
                status = Some(exit);
                group.reaped = true;
                End::EndedThenInterrupted
            }
            _ => end,
        },
        end => end,
    };
    let (exit_code, timed_out, interrupted) = match end {
        End::Completed => {
            group.disarm();
            (status.map_or(-1, exit_code_of), false, false)
        }
        End::DrainExpired => {
            group.kill();
            // What is still in the pipes is read: the drain's time can pass while the shell's
            // last output waits unread (this thread held up by other sessions' commands past
            // it), and the end of a build log is where its error is.
            pipes.drain_for(&mut collector, DRAIN_AFTER_KILL).await;
            (status.map_or(-1, exit_code_of), false, false)
        }
        End::EndedThenInterrupted => {
            group.kill();
            // What the shell wrote before it ended, still in the pipes, is read (the interrupt
            // won the race with it).
            pipes.drain_for(&mut collector, DRAIN_AFTER_KILL).await;
            (status.map_or(-1, exit_code_of), false, false)
        }
        End::TimedOut | End::Interrupted => {
            group.kill();
            // Reap the shell; kill_on_drop covers the (unlikely) failure.
            let _ = tokio::time::timeout(REAP_AFTER_KILL, child.wait()).await;
            pipes.drain_for(&mut collector, DRAIN_AFTER_KILL).await;
            if matches!(end, End::TimedOut) {
                (EXIT_CODE_TIMEOUT, true, false)
            } else {
                (EXIT_CODE_INTERRUPTED, false, true)
            }
        }
    };

    let (output, truncated) = collector.finish();
    Ok(CommandOutcome {
        output,
        exit_code,
        timed_out,
        interrupted,
        truncated,
        started: true,
    })
}

/// How often a background process's group is looked at once its shell has ended.
const GROUP_POLL: Duration = Duration::from_secs(1);

/// The most of a background process's output its log keeps; what comes after is read and
/// dropped (the process never blocks on a full pipe), and the log says so.
pub const BACKGROUND_LOG_CAP: u64 = 16 << 20;

/// Starts `spec.command` to run on after its call returns (`background: true`), in its own
/// process group, with its output (stdout and stderr, in arrival order) written to `log`, at
/// most `cap` bytes of it. `spec.timeout` does not apply. Returns the shell's pid and what
/// drives the process to its end: it pumps the output and reaps the shell, and gives the exit
/// code (`None` if it could not be read) once the shell has ended and no process is left in its
/// group. Dropping it kills the shell.
///
/// `cancel` is the turn's interrupt, looked at again once the shell is spawned: set by then
/// (after its caller's look, before this returned), the group is killed and the start is
/// `InterruptedAtStart` (the shell ran, if only for an instant). Nothing else would have stopped a process that outlives its call, started
/// after the client was told its turn stopped.
pub fn spawn_background(
    spec: &CommandSpec,
    log: std::fs::File,
    cap: u64,
    cancel: &watch::Receiver<bool>,
) -> Result<(u32, impl std::future::Future<Output = Option<i32>>), TerminalError> {
    use tokio::io::AsyncWriteExt;
    if !spec.cwd.is_dir() {
        return Err(TerminalError::InvalidCwd(spec.cwd.clone()));
    }
    let env = build_env(std::env::vars_os(), spec);
    let mut child = spawn_shell(spec, &env)?;
    let pid = child
        .id()
        .ok_or_else(|| TerminalError::Spawn(io::Error::other("the shell exited at once")))?;
    if *cancel.borrow() {
        // Its own group, just made, killed as a foreground command's is: the shell, and
        // whatever it forked in the instant it ran. The shell is reaped by `kill_on_drop` as
        // `child` goes.
        GroupGuard {
            pgid: libc::pid_t::try_from(pid).ok(),
            reaped: false,
            mark: None,
        }
        .kill();
        return Err(TerminalError::InterruptedAtStart);
    }
    let mut pipes = Pipes::of(&mut child);
    let run = async move {
        let mut log = tokio::fs::File::from_std(log);
        let mut written = 0u64;
        let (mut log_ok, mut capped) = (true, false);
        while pipes.is_open() {
            let data = pipes.read_chunk().await;
            let n = data.len();
            let keep = usize::try_from(cap.saturating_sub(written))
                .unwrap_or(usize::MAX)
                .min(n);
            if log_ok && keep > 0 {
                log_ok = log.write_all(&data[..keep]).await.is_ok();
            }
            // Said once, at the first byte dropped (also when the cap fell between two reads).
            if log_ok && keep < n && !capped {
                capped = true;
                let notice = format!("\n[log capped at {cap} bytes: later output is dropped]\n");
                log_ok = log.write_all(notice.as_bytes()).await.is_ok();
            }
            written = written.saturating_add(n as u64);
        }
        let _ = log.flush().await;
        let code = child.wait().await.ok().map(exit_code_of);
        // What the shell left running in its group (a server it started with `&`, its output
        // sent elsewhere) is still the background process: it ends when the group does. Until
        // then the group's id names no other process, so a kill of the group reaches only it.
        if let Ok(group) = libc::pid_t::try_from(pid) {
            while group > 1 && group_running_off_thread(group).await {
                tokio::time::sleep(GROUP_POLL).await;
            }
        }
        code
    };
    Ok((pid, run))
}

/// Caps `text` to `cap` characters, keeping the first 40 % and the last
/// 60 % of the cap with a marker in between. Returns whether it was cut.
pub fn cap_output(text: &str, cap: usize) -> (String, bool) {
    let total = text.chars().count();
    if total <= cap {
        return (text.to_string(), false);
    }
    let (keep_head, keep_tail) = split_cap(cap);
    let head_end = char_to_byte(text, keep_head);
    let tail_start = char_to_byte(text, total - keep_tail);
    let omitted = total - keep_head - keep_tail;
    let mut out = String::with_capacity(head_end + (text.len() - tail_start) + 80);
    out.push_str(&text[..head_end]);
    out.push_str(&truncation_marker(omitted, total));
    out.push_str(&text[tail_start..]);
    (out, true)
}

/// Removes ANSI escape sequences (CSI, OSC and other string sequences,
/// short escapes, 8-bit CSI).
pub fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\u{1b}' => match chars.peek().copied() {
                Some('[') => {
                    chars.next();
                    skip_csi(&mut chars);
                }
                Some(']' | 'P' | 'X' | '^' | '_') => {
                    chars.next();
                    skip_string(&mut chars);
                }
                Some(next) if ('\u{20}'..='\u{2f}').contains(&next) => {
                    while let Some(&i) = chars.peek() {
                        chars.next();
                        if !('\u{20}'..='\u{2f}').contains(&i) {
                            break;
                        }
                    }
                }
                Some(_) => {
                    chars.next();
                }
                None => {}
            },
            '\u{9b}' => skip_csi(&mut chars),
            _ => out.push(c),
        }
    }
    out
}

fn skip_csi(chars: &mut std::iter::Peekable<std::str::Chars<'_>>) {
    for c in chars.by_ref() {
        if ('\u{40}'..='\u{7e}').contains(&c) {
            break;
        }
    }
}

fn skip_string(chars: &mut std::iter::Peekable<std::str::Chars<'_>>) {
    while let Some(c) = chars.next() {
        match c {
            '\u{7}' | '\u{9c}' => break,
            '\u{1b}' => {
                if chars.peek() == Some(&'\\') {
                    chars.next();
                }
                break;
            }
            _ => {}
        }
    }
}

fn truncation_marker(omitted: usize, total: usize) -> String {
    format!("\n... [OUTPUT TRUNCATED - {omitted} chars omitted out of {total} total] ...\n")
}

/// (head, tail) character budgets: 40 % / 60 % of `cap`.
fn split_cap(cap: usize) -> (usize, usize) {
    let head = cap / 5 * 2 + cap % 5 * 2 / 5;
    (head, cap - head)
}

/// Byte offset of the `n`th character (or the end).
fn char_to_byte(text: &str, n: usize) -> usize {
    text.char_indices().nth(n).map_or(text.len(), |(i, _)| i)
}

/// Number of UTF-8 characters starting in `bytes` (non-continuation bytes).
fn count_chars(bytes: &[u8]) -> usize {
    bytes.iter().filter(|b| (**b & 0xC0) != 0x80).count()
}

/// Escape sequences stripped, secrets masked ([`super::redact`]), trailing blanks trimmed.
fn clean(text: &str) -> String {
    let stripped = strip_ansi(text);
    let mut redacted = super::redact::redact(&stripped).into_owned();
    let trimmed = redacted.trim_end().len();
    redacted.truncate(trimmed);
    redacted
}

fn exit_code_of(status: ExitStatus) -> i32 {
    status
        .code()
        .unwrap_or_else(|| status.signal().map_or(-1, |sig| 128 + sig))
}

/// The inherited environment plus `env_set`, minus removed variables.
fn build_env<I>(base: I, spec: &CommandSpec) -> Vec<(OsString, OsString)>
where
    I: IntoIterator<Item = (OsString, OsString)>,
{
    let mut env: Vec<(OsString, OsString)> = base.into_iter().collect();
    for (name, value) in &spec.env_set {
        env.retain(|(existing, _)| existing.as_os_str() != OsStr::new(name));
        env.push((OsString::from(name), OsString::from(value)));
    }
    env.retain(|(name, _)| !is_removed(name, spec));
    env
}

fn is_removed(name: &OsStr, spec: &CommandSpec) -> bool {
    let name = name.as_bytes();
    spec.env_remove.iter().any(|r| r.as_bytes() == name)
        || spec
            .env_remove_prefixes
            .iter()
            .any(|p| !p.is_empty() && name.starts_with(p.as_bytes()))
}

/// `program` as a path to run: a name without a slash is looked up in `path` (the child's `PATH`;
/// the daemon's own when the child has none), as the child's `exec` would find it.
///
/// Spawning a path lets the standard library start the child with `posix_spawn`, a `vfork` that
/// shares the daemon's memory until the child execs. Given a bare name and a `PATH` of the child's
/// own, it forks instead, to search that `PATH` in the child: a fork copies the daemon's page
/// tables on every tool call and holds its address space meanwhile, so every other thread that
/// faults a page waits (without it, the daemon's CPU per tool turn in the bench fell by a third at
/// one session and by three fifths at 16).
fn resolve_program(program: &str, path: Option<&OsStr>) -> Option<PathBuf> {
    if program.contains('/') {
        return Some(PathBuf::from(program));
    }
    let path = path
        .map(OsStr::to_os_string)
        .or_else(|| std::env::var_os("PATH"))?;
    // A relative entry would name a directory relative to wherever the daemon runs: skipped.
    std::env::split_paths(&path)
        .filter(|dir| dir.is_absolute())
        .map(|dir| dir.join(program))
        .find(|candidate| is_executable_file(candidate))
}

fn is_executable_file(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The shell a command runs in when the child's `PATH` is the daemon's: the first of [`SHELLS`]
/// found.
pub fn default_shell() -> Option<PathBuf> {
    SHELLS.iter().find_map(|s| resolve_program(s, None))
}

/// How long the start of a foreground command may take: its directory checked, its shell
/// spawned (the spawn waits for the shell's `chdir` and `exec`).
pub(crate) const SPAWN_TIMEOUT: Duration = Duration::from_secs(10);

/// [`spawn_shell`] in `spec.cwd` (checked first), on a thread of its own: on this one, which
/// runs every session's commands, a directory on a mount that stopped answering hung them all.
/// Given up after [`SPAWN_TIMEOUT`]; a shell that starts after that is killed with its group at
/// once.
async fn spawn_off_thread(
    spec: &CommandSpec,
    env: Vec<(OsString, OsString)>,
) -> Result<Child, TerminalError> {
    let spec = spec.clone();
    let cwd = spec.cwd.clone();
    let spawned = super::on_own_thread(SPAWN_TIMEOUT, move |given_up| {
        if !spec.cwd.is_dir() {
            return Err(TerminalError::InvalidCwd(spec.cwd.clone()));
        }
        let child = spawn_shell(&spec, &env)?;
        if given_up.load(std::sync::atomic::Ordering::SeqCst) {
            if let Some(pgid) = child.id().and_then(|id| libc::pid_t::try_from(id).ok()) {
                kill_group(pgid);
            }
            return Err(TerminalError::Spawn(io::Error::other("started too late")));
        }
        Ok(child)
    })
    .await;
    spawned.unwrap_or_else(|| Err(spawn_timed_out(&cwd)))
}

/// A shell that did not start within [`SPAWN_TIMEOUT`] in `cwd`.
pub(crate) fn spawn_timed_out(cwd: &Path) -> TerminalError {
    TerminalError::Spawn(io::Error::new(
        io::ErrorKind::TimedOut,
        format!(
            "its shell did not start within {} s in {} (a mount that stopped answering?); not run",
            SPAWN_TIMEOUT.as_secs(),
            cwd.display()
        ),
    ))
}

/// Kill process group `pgid` (never our own group, 0, nor init's, 1).
pub(crate) fn kill_group(pgid: libc::pid_t) {
    if pgid > 1 {
        // SAFETY: killpg has no memory-safety preconditions.
        unsafe { libc::killpg(pgid, libc::SIGKILL) };
    }
}

fn spawn_shell(spec: &CommandSpec, env: &[(OsString, OsString)]) -> Result<Child, TerminalError> {
    let mut last_err = None;
    let child_path = env
        .iter()
        .find(|(k, _)| k.as_bytes() == b"PATH")
        .map(|(_, v)| v.as_os_str());
    for shell in SHELLS {
        let Some(program) = resolve_program(shell, child_path) else {
            last_err = Some(io::Error::from(io::ErrorKind::NotFound));
            continue;
        };
        let mut cmd = Command::new(program);
        cmd.arg("-c")
            .arg(&spec.command)
            .current_dir(&spec.cwd)
            .env_clear()
            .envs(env.iter().map(|(k, v)| (k.as_os_str(), v.as_os_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        match cmd.spawn() {
            Ok(child) => return Ok(child),
            Err(err) if err.kind() == io::ErrorKind::NotFound => last_err = Some(err),
            Err(err) => return Err(TerminalError::Spawn(err)),
        }
    }
    Err(TerminalError::Spawn(last_err.unwrap_or_else(|| {
        io::Error::from(io::ErrorKind::NotFound)
    })))
}

enum End {
    Completed,
    DrainExpired,
    TimedOut,
    Interrupted,
    /// Interrupted once the shell had ended (see [`run_command`]).
    EndedThenInterrupted,
}

/// The variable each foreground command's processes carry, its value the run's own.
const RUN_VAR: &str = "GATEHOUSE_RUN";

/// Kills the process group when dropped, unless disarmed.
struct GroupGuard {
    pgid: Option<libc::pid_t>,
    /// The shell was reaped: its pid may name another process now.
    reaped: bool,
    /// The `GATEHOUSE_RUN=<id>` entry in the environment of the command's processes.
    mark: Option<String>,
}

impl GroupGuard {
    fn kill(&mut self) {
        if !self.reaped {
            // The shell's pid still names it: its descendants in other groups can be found.
            self.kill_tree();
        }
        if let Some(pgid) = self.pgid.take() {
            // The group was created for this command by `process_group(0)`.
            kill_group(pgid);
        }
        // What left the group and lost its parent (`set -m; job &`, `timeout 600 srv &`,
        // `setsid srv &`) is no descendant of the shell any more once the shell has ended:
        // found by its mark, it is killed too (it ran on, holding the output pipes, counted
        // nowhere). Off this thread, which pumps every command's output: the sweep reads all
        // of `/proc`, and a process stuck in the kernel can hold a read of its environment.
        if let Some(mark) = self.mark.take() {
            sweep(mark);
        }
    }

    fn disarm(&mut self) {
        self.pgid = None;
        self.mark = None;
    }

    /// Kill every descendant of the shell (whose pid is the group's id) that left its group,
    /// while the shell is alive or a zombie not yet reaped (so the pid cannot name another
    /// process). The group and each descendant found are stopped first and the walk repeated
    /// until it finds none new, so none forks a child the kill misses; then all are killed.
    fn kill_tree(&mut self) {
        let Some(shell) = self.pgid.filter(|&p| p > 1) else {
            return;
        };
        // SAFETY: killpg/kill have no memory-safety preconditions; the group was created for
        // this command, and every pid signalled is a live descendant of its shell.
        unsafe {
            libc::killpg(shell, libc::SIGSTOP);
        }
        let mut found: HashSet<libc::pid_t> = HashSet::new();
        for _ in 0..MAX_TREE_WALKS {
            let mut fresh = false;
            for pid in descendants(shell) {
                if found.insert(pid) {
                    fresh = true;
                    // SAFETY: as above.
                    unsafe {
                        libc::kill(pid, libc::SIGSTOP);
                    }
                }
            }
            if !fresh {
                break;
            }
        }
        for &pid in &found {
            // SAFETY: as above.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
    }
}

/// Does a process of group `pgid` run (a zombie does not: one nobody reaps, under an init that
/// does not, would hold its background process's slot for good)? As `/proc` shows it; a group
/// that cannot be read is taken as ended.
fn group_running(pgid: libc::pid_t) -> bool {
    processes().any(|p| p.pgrp == pgid && p.running())
}

/// [`group_running`], read off the terminal's thread, which pumps every foreground command's
/// output (a read of all of `/proc` once a second per background process held it on a host
/// of many processes); a group signal 0 no longer finds is not read at all.
async fn group_running_off_thread(pgid: libc::pid_t) -> bool {
    // SAFETY: signal 0 sends nothing; it only asks whether the group has a process.
    if unsafe { libc::killpg(pgid, 0) } != 0
        && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
    {
        return false;
    }
    tokio::task::spawn_blocking(move || group_running(pgid))
        .await
        .unwrap_or(false)
}

/// A process as `/proc/<pid>/stat` shows it, as far as this module reads it.
struct ProcStat {
    pid: libc::pid_t,
    state: char,
    ppid: libc::pid_t,
    pgrp: libc::pid_t,
}

impl ProcStat {
    fn read(pid: libc::pid_t) -> Option<ProcStat> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // `pid (comm) state ppid pgrp ...`: comm may hold anything, so read after its last `)`.
        let mut fields = stat.rsplit_once(')')?.1.split_whitespace();
        let state = fields.next()?.chars().next()?;
        let ppid = fields.next()?.parse().ok()?;
        let pgrp = fields.next()?.parse().ok()?;
        Some(ProcStat {
            pid,
            state,
            ppid,
            pgrp,
        })
    }

    /// Not a zombie (nor dead).
    fn running(&self) -> bool {
        !matches!(self.state, 'Z' | 'X')
    }
}

/// Every process `/proc` lists now (none if it cannot be read).
fn processes() -> impl Iterator<Item = ProcStat> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<libc::pid_t>().ok())
        .filter_map(ProcStat::read)
}

/// Kill, on the one sweeper thread, every process that carries `mark` (see
/// [`GroupGuard::kill`]); here when that thread cannot be had.
fn sweep(mark: String) {
    static SWEEPER: std::sync::Mutex<Option<std::sync::mpsc::Sender<String>>> =
        std::sync::Mutex::new(None);
    // Swept here (the lock let go first) when no sweeper can take it.
    let unswept = {
        let mut sweeper = SWEEPER
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mark = match sweeper.as_ref() {
            Some(tx) => match tx.send(mark) {
                Ok(()) => return,
                // The sweeper is gone: another is started.
                Err(std::sync::mpsc::SendError(back)) => back,
            },
            None => mark,
        };
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        let started = std::thread::Builder::new()
            .name("gatehouse-sweep".into())
            .spawn(move || {
                // The marks sent meanwhile are swept together: one read of /proc a round.
                while let Ok(first) = rx.recv() {
                    let mut marks = vec![first];
                    marks.extend(rx.try_iter());
                    kill_marked(&marks);
                }
            });
        match started {
            Ok(_) => match tx.send(mark) {
                Ok(()) => {
                    *sweeper = Some(tx);
                    return;
                }
                Err(std::sync::mpsc::SendError(back)) => back,
            },
            Err(e) => {
                tracing::warn!(error = %e, "cannot start the process sweeper");
                mark
            }
        }
    };
    kill_marked(&[unswept]);
}

/// How long a sweep waits for processes asleep in the kernel (`D`), which it cannot read, to
/// wake (one of them may carry a mark).
const SWEEP_WAIT: Duration = Duration::from_secs(5);

/// Kill every process that carries one of `marks`, until none is found (each round may find
/// what one forked meanwhile) and none is left unread.
fn kill_marked(marks: &[String]) {
    let until = Instant::now() + SWEEP_WAIT;
    for _ in 0..MAX_TREE_WALKS * 4 {
        let (found, asleep) = marked(marks);
        if found.is_empty() {
            if asleep == 0 || Instant::now() >= until {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
            continue;
        }
        for pid in found {
            // SAFETY: kill has no memory-safety preconditions; `pid` carried a killed command's
            // own mark an instant ago.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
    }
}

/// Does process `pid`'s environment hold an entry `matches` takes (false if it cannot be read)?
fn environ_has(pid: libc::pid_t, matches: impl Fn(&[u8]) -> bool) -> bool {
    std::fs::read(format!("/proc/{pid}/environ"))
        .is_ok_and(|environ| environ.split(|&b| b == 0).any(&matches))
}

/// Is process `pid` one of the commands this gateway runs (or a process one of them started)?
/// Every foreground command's processes carry [`RUN_VAR`] (unless they cleared it), and the
/// gateway is an ancestor of each process it forked that was not orphaned. A process that both
/// cleared its environment and left its parent (a double fork) is not found: a bar to pass, not
/// a sandbox (run commands as another user for one).
pub(crate) fn is_a_command(pid: libc::pid_t) -> bool {
    let Ok(own) = libc::pid_t::try_from(std::process::id()) else {
        return false;
    };
    if pid == own {
        return false;
    }
    let marked = environ_has(pid, |entry| {
        entry
            .strip_prefix(RUN_VAR.as_bytes())
            .is_some_and(|rest| rest.first() == Some(&b'='))
    });
    if marked {
        return true;
    }
    // Up the parents, a bounded number of steps: the gateway among them is its command's.
    let mut at = pid;
    for _ in 0..64 {
        let Some(parent) = ProcStat::read(at).map(|p| p.ppid) else {
            return false;
        };
        if parent == own {
            return true;
        }
        if parent <= 1 {
            return false;
        }
        at = parent;
    }
    false
}

/// Every live process (other than this one) whose environment holds one of the entries
/// `marks`, as `/proc` shows them now (a process of another user cannot be read, and is not one
/// of ours); and how many of this user's it passed over asleep in the kernel (`D`): a read of
/// such a process's environment can wait as long as it sleeps.
fn marked(marks: &[String]) -> (Vec<libc::pid_t>, usize) {
    use std::os::unix::fs::MetadataExt;
    let own = std::process::id();
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    let mut asleep = 0;
    let found = processes()
        .filter(|p| p.running() && u32::try_from(p.pid).ok() != Some(own))
        .filter(|p| {
            if p.state == 'D' {
                // Only one of ours could carry a mark: another user's, or a kernel thread
                // (a child of kthreadd, pid 2), is not waited for.
                let ours = p.ppid != 2
                    && p.pid != 2
                    && std::fs::metadata(format!("/proc/{}", p.pid)).is_ok_and(|m| m.uid() == uid);
                if ours {
                    asleep += 1;
                }
                return false;
            }
            environ_has(p.pid, |entry| marks.iter().any(|m| entry == m.as_bytes()))
        })
        .map(|p| p.pid)
        .collect();
    (found, asleep)
}

/// How many times the walk for a killed command's descendants is repeated at most (each walk
/// stops what it found, so a new one can only appear between two walks).
const MAX_TREE_WALKS: usize = 16;

/// Every live process descended from `root`, as `/proc` shows them now (none if it cannot be
/// read: the group's kill still stands).
fn descendants(root: libc::pid_t) -> Vec<libc::pid_t> {
    let mut children: HashMap<libc::pid_t, Vec<libc::pid_t>> = HashMap::new();
    for p in processes() {
        children.entry(p.ppid).or_default().push(p.pid);
    }
    let mut out = HashSet::new();
    let mut next = vec![root];
    while let Some(pid) = next.pop() {
        for &child in children.get(&pid).into_iter().flatten() {
            if child != root && out.insert(child) {
                next.push(child);
            }
        }
    }
    out.into_iter().collect()
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

struct Pipes {
    stdout: Option<ChildStdout>,
    stderr: Option<ChildStderr>,
    out_buf: Vec<u8>,
    err_buf: Vec<u8>,
}

impl Pipes {
    /// Read what is left in the pipes into `collector`, until they close or `limit` passes.
    async fn drain_for(&mut self, collector: &mut Collector, limit: Duration) {
        let until = Instant::now() + limit;
        while self.is_open() {
            tokio::select! {
                () = tokio::time::sleep_until(until) => break,
                () = self.pump(collector) => {}
            }
        }
    }

    /// The child's output pipes, taken from it.
    fn of(child: &mut Child) -> Pipes {
        Pipes {
            stdout: child.stdout.take(),
            stderr: child.stderr.take(),
            out_buf: vec![0; READ_CHUNK],
            err_buf: vec![0; READ_CHUNK],
        }
    }

    fn is_open(&self) -> bool {
        self.stdout.is_some() || self.stderr.is_some()
    }

    /// Reads one chunk from whichever pipe is ready (empty when that pipe ended or failed: it
    /// is closed, the other may go on). Cancel safe. Pending forever when both pipes are closed.
    async fn read_chunk(&mut self) -> &[u8] {
        tokio::select! {
            read = read_some(&mut self.stdout, &mut self.out_buf) => {
                accept(read, &mut self.stdout, &self.out_buf)
            }
            read = read_some(&mut self.stderr, &mut self.err_buf) => {
                accept(read, &mut self.stderr, &self.err_buf)
            }
        }
    }

    /// Reads one chunk into `collector` (see [`Pipes::read_chunk`]).
    async fn pump(&mut self, collector: &mut Collector) {
        let chunk = self.read_chunk().await;
        if !chunk.is_empty() {
            collector.push(chunk);
        }
    }
}

async fn read_some<R: AsyncRead + Unpin>(
    reader: &mut Option<R>,
    buf: &mut [u8],
) -> io::Result<usize> {
    match reader {
        Some(reader) => reader.read(buf).await,
        None => std::future::pending().await,
    }
}

/// What a read of `slot` into `buf` gave: its bytes, or none when the pipe ended or failed
/// (then closed).
fn accept<'a, R>(read: io::Result<usize>, slot: &mut Option<R>, buf: &'a [u8]) -> &'a [u8] {
    match read {
        Ok(n) if n > 0 => buf.get(..n).unwrap_or(buf),
        _ => {
            *slot = None;
            &[]
        }
    }
}

/// Bounded output buffer: a fixed head and a rolling tail.
struct Collector {
    cap: usize,
    head: Vec<u8>,
    head_limit: usize,
    tail: Vec<u8>,
    tail_limit: usize,
    dropped_chars: usize,
    dropped_bytes: usize,
}

impl Collector {
    fn new(cap: usize) -> Self {
        let limit = cap.saturating_mul(4).max(MIN_BUFFER);
        Self {
            cap,
            head: Vec::new(),
            head_limit: limit,
            tail: Vec::new(),
            tail_limit: limit,
            dropped_chars: 0,
            dropped_bytes: 0,
        }
    }

    fn push(&mut self, mut data: &[u8]) {
        let room = self.head_limit - self.head.len();
        if room > 0 {
            let take = room.min(data.len());
            self.head.extend_from_slice(&data[..take]);
            data = &data[take..];
        }
        if data.is_empty() {
            return;
        }
        self.tail.extend_from_slice(data);
        if self.tail.len() > self.tail_limit.saturating_mul(2) {
            self.compact();
        }
    }

    fn compact(&mut self) {
        if self.tail.len() > self.tail_limit {
            let excess = self.tail.len() - self.tail_limit;
            self.dropped_chars += count_chars(&self.tail[..excess]);
            self.dropped_bytes += excess;
            self.tail.drain(..excess);
        }
    }

    #[cfg(test)]
    fn buffered_bytes(&self) -> usize {
        self.head.len() + self.tail.len()
    }

    fn finish(mut self) -> (String, bool) {
        self.compact();
        if self.dropped_bytes == 0 {
            let mut all = self.head;
            all.extend_from_slice(&self.tail);
            return cap_output(&clean(&String::from_utf8_lossy(&all)), self.cap);
        }

        // Head: drop an incomplete character at the end (counted as dropped).
        let head_valid = match std::str::from_utf8(&self.head) {
            Err(err) if err.error_len().is_none() => err.valid_up_to(),
            _ => self.head.len(),
        };
        self.dropped_chars += count_chars(&self.head[head_valid..]);
        let head_text = super::redact::redact(&strip_ansi(&String::from_utf8_lossy(
            &self.head[..head_valid],
        )))
        .into_owned();
        // Tail: skip continuation bytes of a character cut at the start.
        let skip = self
            .tail
            .iter()
            .take(3)
            .take_while(|b| (**b & 0xC0) == 0x80)
            .count();
        let tail_text = clean(&String::from_utf8_lossy(&self.tail[skip..]));

        let head_chars = head_text.chars().count();
        let tail_chars = tail_text.chars().count();
        let total = head_chars + self.dropped_chars + tail_chars;
        let (keep_head, keep_tail) = split_cap(self.cap);
        let keep_head = keep_head.min(head_chars);
        let keep_tail = keep_tail.min(tail_chars);
        let head_part = &head_text[..char_to_byte(&head_text, keep_head)];
        let tail_part = &tail_text[char_to_byte(&tail_text, tail_chars - keep_tail)..];
        let omitted = total - keep_head - keep_tail;
        let mut out = String::with_capacity(head_part.len() + tail_part.len() + 80);
        out.push_str(head_part);
        out.push_str(&truncation_marker(omitted, total));
        out.push_str(tail_part);
        (out, true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> Self {
            static COUNTER: AtomicUsize = AtomicUsize::new(0);
            let n = COUNTER.fetch_add(1, Ordering::SeqCst);
            let path = std::env::temp_dir().join(format!(
                "gatehouse-terminal-{}-{n}-{name}",
                std::process::id()
            ));
            let _ = std::fs::remove_dir_all(&path);
            std::fs::create_dir_all(&path).unwrap();
            Self(path.canonicalize().unwrap())
        }

        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn spec(command: &str, dir: &TempDir) -> CommandSpec {
        CommandSpec::new(command, dir.path())
    }

    async fn run(spec: CommandSpec) -> CommandOutcome {
        let (_tx, rx) = watch::channel(false);
        run_command(spec, rx).await.unwrap()
    }

    fn process_alive(pid: libc::pid_t) -> bool {
        // SAFETY: signal 0 only checks whether the process exists.
        if unsafe { libc::kill(pid, 0) } != 0 {
            return io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
        }
        // A zombie is dead for our purposes (the reaper may be slow).
        ProcStat::read(pid).is_some_and(|p| p.running())
    }

    async fn wait_until(mut cond: impl FnMut() -> bool, limit: Duration) -> bool {
        let until = Instant::now() + limit;
        loop {
            if cond() {
                return true;
            }
            if Instant::now() >= until {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn read_pid(path: &Path) -> Option<libc::pid_t> {
        std::fs::read_to_string(path).ok()?.trim().parse().ok()
    }

    /// A command that ended before its deadline, whose exit is seen only once the deadline has
    /// passed too (the terminal thread was busy), ran to its end: its exit code and output
    /// stand. It was reported timed out (124), and the model was likely to run it again.
    #[tokio::test]
    async fn a_command_ended_before_its_deadline_is_not_timed_out_when_seen_late() {
        let dir = TempDir::new("late");
        let mut spec = spec("sleep 0.1; echo done; exit 3", &dir);
        spec.timeout = Duration::from_millis(300);
        let (_tx, rx) = watch::channel(false);
        let mut running = Box::pin(run_command(spec, rx));
        // Started, and waiting on the shell.
        tokio::select! {
            _ = &mut running => panic!("the command was not waited for"),
            () = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
        // The thread busy past the deadline: the shell's exit and the deadline are both ready
        // at the next look.
        std::thread::sleep(Duration::from_millis(800));
        let out = running.await.unwrap();
        assert!(!out.timed_out, "{out:?}");
        assert_eq!(out.exit_code, 3);
        assert_eq!(out.output, "done");
    }

    #[tokio::test]
    async fn echo_output_and_exit_code() {
        let dir = TempDir::new("echo");
        let out = run(spec("echo hello; sleep 0.1; echo oops >&2", &dir)).await;
        assert_eq!(out.output, "hello\noops");
        assert_eq!(out.exit_code, 0);
        assert!(!out.timed_out && !out.interrupted && !out.truncated);
        assert_eq!(
            out.to_tool_json(180),
            r#"{"output":"hello\noops","exit_code":0,"error":null}"#
        );
    }

    /// A background process's output (both pipes) goes to its log up to the cap, then a notice:
    /// what follows is read and dropped, so the process is never blocked on a full pipe and
    /// runs to its end.
    #[tokio::test]
    async fn a_background_log_keeps_its_cap_and_says_so() {
        let dir = TempDir::new("bg");
        let run_to_end = |command: &str, name: &str| {
            let log = dir.path().join(name);
            let file = std::fs::File::create(&log).unwrap();
            let (_live, cancel) = watch::channel(false);
            let (pid, run) = spawn_background(&spec(command, &dir), file, 1000, &cancel).unwrap();
            assert!(pid > 1);
            async move { (run.await, std::fs::read_to_string(&log).unwrap()) }
        };
        let (code, text) = run_to_end("echo on-stderr >&2; exit 3", "err.log").await;
        assert_eq!((code, text.as_str()), (Some(3), "on-stderr\n"));
        let command = "head -c 300000 /dev/zero | tr '\\0' x; echo last";
        let (code, text) = run_to_end(command, "big.log").await;
        assert_eq!(code, Some(0), "it ran to its end");
        let notice = "\n[log capped at 1000 bytes: later output is dropped]\n";
        assert_eq!(text, format!("{}{notice}", "x".repeat(1000)));
        // Exactly the cap: nothing dropped, nothing said; past it by a later write, said once.
        let exact = "head -c 1000 /dev/zero | tr '\\0' x";
        assert_eq!(run_to_end(exact, "exact.log").await.1, "x".repeat(1000));
        let later = format!("{exact}; echo more; echo more");
        let (_, text) = run_to_end(&later, "later.log").await;
        assert_eq!(text, format!("{}{notice}", "x".repeat(1000)));
    }

    /// A group whose only process is a zombie runs nothing, though signal 0 still finds it (a
    /// background process's slot would be held for good under an init that does not reap).
    #[test]
    fn a_group_of_zombies_runs_nothing() {
        use std::os::unix::process::CommandExt;
        let spawn = |script: &str| {
            std::process::Command::new("sh")
                .args(["-c", script])
                .process_group(0)
                .spawn()
                .unwrap()
        };
        let mut running = spawn("exec sleep 30");
        let group = running.id() as libc::pid_t;
        assert!(group_running(group));
        running.kill().unwrap();
        running.wait().unwrap();
        assert!(!group_running(group));
        let mut zombie = spawn("exit 0");
        let group = zombie.id() as libc::pid_t;
        let state = || ProcStat::read(group).map(|p| p.state);
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while state() != Some('Z') {
            assert!(std::time::Instant::now() < until, "never a zombie");
            std::thread::sleep(Duration::from_millis(10));
        }
        // SAFETY: signal 0 sends nothing.
        assert_eq!(unsafe { libc::killpg(group, 0) }, 0, "signal 0 finds it");
        assert!(!group_running(group));
        zombie.wait().unwrap();
    }

    #[tokio::test]
    async fn nonzero_exit_code() {
        let dir = TempDir::new("exit");
        let out = run(spec("echo partial; exit 3", &dir)).await;
        assert_eq!(out.output, "partial");
        assert_eq!(out.exit_code, 3);
        let out = run(spec("kill -TERM $$", &dir)).await;
        assert_eq!(out.exit_code, 128 + libc::SIGTERM);
    }

    #[tokio::test]
    async fn cwd_is_honoured() {
        let dir = TempDir::new("cwd");
        let out = run(spec("pwd -P", &dir)).await;
        assert_eq!(Path::new(&out.output), dir.path());
    }

    #[tokio::test]
    async fn invalid_cwd_is_an_error() {
        let dir = TempDir::new("badcwd");
        let spec = CommandSpec::new("true", dir.path().join("missing"));
        let (_tx, rx) = watch::channel(false);
        let err = run_command(spec, rx).await.unwrap_err();
        assert!(matches!(err, TerminalError::InvalidCwd(_)), "{err}");
    }

    #[tokio::test]
    async fn env_vars_are_removed() {
        let dir = TempDir::new("env");
        let mut spec = spec(
            r#"echo "${GATEHOUSE_TOKEN-unset} ${OPENAI_API_KEY-unset} ${DROP_EXACT-unset} ${DROP_EXACT_NOT-unset} ${KEEP_ME-unset} ${PATH:+path}""#,
            &dir,
        );
        spec.env_set = vec![
            ("GATEHOUSE_TOKEN".into(), "secret".into()),
            ("OPENAI_API_KEY".into(), "sk".into()),
            ("DROP_EXACT".into(), "x".into()),
            ("DROP_EXACT_NOT".into(), "kept".into()),
            ("KEEP_ME".into(), "yes".into()),
        ];
        spec.env_remove_prefixes = vec!["GATEHOUSE_".into(), "OPENAI_".into()];
        spec.env_remove = vec!["DROP_EXACT".into()];
        let out = run(spec).await;
        assert_eq!(out.output, "unset unset unset kept yes path");
    }

    #[test]
    fn build_env_filters_inherited_variables() {
        let base = [
            ("PATH", "/bin"),
            ("OPENAI_API_KEY", "sk"),
            ("GATEHOUSE_DB", "x"),
            ("HOME", "/root"),
            ("SECRET", "s"),
            ("SECRETS", "kept"),
        ]
        .map(|(k, v)| (OsString::from(k), OsString::from(v)));
        let mut spec = CommandSpec::new("true", "/");
        spec.env_remove_prefixes = vec!["OPENAI_".into(), "GATEHOUSE_".into(), String::new()];
        spec.env_remove = vec!["SECRET".into()];
        spec.env_set = vec![
            ("HOME".into(), "/tmp/h".into()),
            ("EXTRA".into(), "1".into()),
        ];
        let mut env: Vec<(String, String)> = build_env(base, &spec)
            .into_iter()
            .map(|(k, v)| (k.into_string().unwrap(), v.into_string().unwrap()))
            .collect();
        env.sort();
        let expected: Vec<(String, String)> = [
            ("EXTRA", "1"),
            ("HOME", "/tmp/h"),
            ("PATH", "/bin"),
            ("SECRETS", "kept"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .to_vec();
        assert_eq!(env, expected);
    }

    #[tokio::test]
    async fn timeout_kills_the_process_group() {
        let dir = TempDir::new("timeout");
        let pid_file = dir.path().join("bg.pid");
        let mut spec = spec("sleep 30 & echo $! > bg.pid; echo started; sleep 30", &dir);
        spec.timeout = Duration::from_secs(1);
        let started = Instant::now();
        let out = run(spec).await;
        let elapsed = started.elapsed();
        assert!(out.timed_out);
        assert!(!out.interrupted);
        assert_eq!(out.exit_code, EXIT_CODE_TIMEOUT);
        assert_eq!(out.output, "started");
        assert!(elapsed >= Duration::from_secs(1), "{elapsed:?}");
        assert!(elapsed < Duration::from_secs(10), "{elapsed:?}");
        assert_eq!(
            out.to_tool_json(1),
            r#"{"output":"started","exit_code":124,"error":"Command timed out after 1 seconds"}"#
        );
        let pid = read_pid(&pid_file).unwrap();
        assert!(
            wait_until(|| !process_alive(pid), Duration::from_secs(5)).await,
            "background sleep {pid} survived the timeout"
        );
    }

    /// An interrupt set while a background start was being spawned (after its caller's look)
    /// stops it at once: nothing of it runs on, and the start is refused `InterruptedAtStart`
    /// (its shell had started: not the `Interrupted` of a start that never began).
    #[tokio::test]
    async fn a_background_start_interrupted_while_it_spawned_runs_nothing() {
        let dir = TempDir::new("bg-interrupted");
        let marker = dir.path().join("ran");
        let log = dir.path().join("log");
        let (interrupt, cancel) = watch::channel(false);
        interrupt.send(true).unwrap();
        let started = spawn_background(
            &spec("sleep 0.3; touch ran", &dir),
            std::fs::File::create(&log).unwrap(),
            1000,
            &cancel,
        );
        assert!(matches!(started, Err(TerminalError::InterruptedAtStart)));
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert!(!marker.exists(), "the interrupted start ran its command");
    }

    #[tokio::test]
    async fn background_grandchild_does_not_hang() {
        let dir = TempDir::new("bg");
        let pid_file = dir.path().join("bg.pid");
        let mut spec = spec("sleep 30 & echo $! > bg.pid; echo hi", &dir);
        spec.timeout = Duration::from_secs(20);
        let started = Instant::now();
        let out = run(spec).await;
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(out.output, "hi");
        assert_eq!(out.exit_code, 0);
        assert!(!out.timed_out && !out.interrupted);
        let pid = read_pid(&pid_file).unwrap();
        assert!(
            wait_until(|| !process_alive(pid), Duration::from_secs(5)).await,
            "background sleep {pid} still holds the pipe"
        );
    }

    #[tokio::test]
    async fn cancel_kills_the_process_group() {
        let dir = TempDir::new("cancel");
        let pid_file = dir.path().join("bg.pid");
        let mut spec = spec("sleep 30 & echo $! > bg.pid; sleep 30", &dir);
        spec.timeout = Duration::from_secs(60);
        let (tx, rx) = watch::channel(false);
        let started = Instant::now();
        let canceller = async {
            let appeared =
                wait_until(|| read_pid(&pid_file).is_some(), Duration::from_secs(10)).await;
            let pid = read_pid(&pid_file);
            let alive_before = pid.is_some_and(process_alive);
            tx.send(true).unwrap();
            (appeared, pid, alive_before)
        };
        let (out, (appeared, pid, alive_before)) = tokio::join!(run_command(spec, rx), canceller);
        let out = out.unwrap();
        assert!(appeared && alive_before, "background process never ran");
        assert!(out.interrupted);
        assert!(!out.timed_out);
        assert_eq!(out.exit_code, EXIT_CODE_INTERRUPTED);
        assert!(started.elapsed() < Duration::from_secs(15));
        assert!(out.started);
        assert_eq!(
            out.to_tool_json(60),
            r#"{"output":"","exit_code":130,"error":"Command interrupted (the turn was stopped) after it started: it may have done part of its work"}"#
        );
        let pid = pid.unwrap();
        assert!(
            wait_until(|| !process_alive(pid), Duration::from_secs(5)).await,
            "background sleep {pid} survived cancellation"
        );
    }

    /// Processes that left the shell's group (`timeout` makes a group of its own, as does a
    /// job under `set -m`) are killed with it: they ran on after the turn was stopped.
    #[tokio::test]
    async fn cancel_kills_descendants_that_left_the_group() {
        let dir = TempDir::new("cancel-tree");
        let (inner, job) = (dir.path().join("inner.pid"), dir.path().join("job.pid"));
        let shell = dir.path().join("shell.pid");
        let mut spec = spec(
            "echo $$ > shell.pid; set -m; sleep 60 & echo $! > job.pid; set +m; \
             timeout 60 sh -c 'echo $$ > inner.pid; sleep 60; true'; true",
            &dir,
        );
        spec.timeout = Duration::from_secs(60);
        let (tx, rx) = watch::channel(false);
        let canceller = async {
            let appeared = wait_until(
                || read_pid(&inner).is_some() && read_pid(&job).is_some(),
                Duration::from_secs(10),
            )
            .await;
            let pids = [read_pid(&inner), read_pid(&job)];
            let shell = read_pid(&shell).unwrap_or(0);
            let apart = pids.iter().flatten().all(|&pid| {
                // SAFETY: getpgid has no memory-safety preconditions.
                let group = unsafe { libc::getpgid(pid) };
                process_alive(pid) && group > 0 && group != shell
            });
            tx.send(true).unwrap();
            (appeared, pids, apart)
        };
        let (out, (appeared, pids, apart)) = tokio::join!(run_command(spec, rx), canceller);
        assert!(out.unwrap().interrupted);
        assert!(appeared && apart, "the processes never ran apart: {pids:?}");
        for pid in pids.into_iter().flatten() {
            assert!(
                wait_until(|| !process_alive(pid), Duration::from_secs(5)).await,
                "{pid} survived the cancellation"
            );
        }
    }

    /// A job that left the shell's group and outlives the shell (`set -m; job &`, holding the
    /// output pipe) is killed when the wait for the pipes to close ends: it is no descendant
    /// of the shell any more, nor in its group, and ran on, counted nowhere. The shell's own
    /// exit code stands.
    #[tokio::test]
    async fn a_job_that_left_the_group_and_outlived_the_shell_is_killed() {
        let dir = TempDir::new("escaped");
        let job = dir.path().join("job.pid");
        let (_tx, rx) = watch::channel(false);
        let out = run_command(
            spec(
                "set -m; sleep 300 & echo $! > job.pid; echo hi; exit 3",
                &dir,
            ),
            rx,
        )
        .await
        .unwrap();
        assert_eq!(out.exit_code, 3, "{out:?}");
        assert!(out.output.contains("hi"), "{out:?}");
        let pid = read_pid(&job).expect("the job's pid");
        assert!(
            wait_until(|| !process_alive(pid), Duration::from_secs(5)).await,
            "{pid} survived its command"
        );
    }

    /// An interrupt that comes once the shell has ended (a job it left holds the output)
    /// reports the shell's own exit code, not 130: the command ran to its end.
    #[tokio::test]
    async fn an_interrupt_after_the_shell_ended_keeps_its_exit_code() {
        let dir = TempDir::new("ended");
        let shell = dir.path().join("shell.pid");
        let mut spec = spec(
            "echo $$ > shell.pid; echo last words; sleep 30 & exit 3",
            &dir,
        );
        spec.timeout = Duration::from_secs(60);
        let (tx, rx) = watch::channel(false);
        let canceller = async {
            let ended = wait_until(
                || read_pid(&shell).is_some_and(|pid| !process_alive(pid)),
                Duration::from_secs(10),
            )
            .await;
            tx.send(true).unwrap();
            ended
        };
        let (out, ended) = tokio::join!(run_command(spec, rx), canceller);
        let out = out.unwrap();
        assert!(ended, "the shell never ended");
        assert_eq!(out.exit_code, 3, "{out:?}");
        assert!(!out.interrupted, "{out:?}");
        assert!(out.output.contains("last words"), "{out:?}");
    }

    #[tokio::test]
    async fn dropped_sender_is_not_a_cancel() {
        let dir = TempDir::new("dropped");
        let (tx, rx) = watch::channel(false);
        drop(tx);
        let out = run_command(spec("sleep 0.2; echo done", &dir), rx)
            .await
            .unwrap();
        assert_eq!(out.output, "done");
        assert!(!out.interrupted);
        assert_eq!(out.exit_code, 0);
    }

    #[tokio::test]
    async fn already_cancelled_does_not_run() {
        let dir = TempDir::new("precancel");
        let (_tx, rx) = watch::channel(true);
        let out = run_command(spec("touch ran", &dir), rx).await.unwrap();
        assert!(out.interrupted);
        assert_eq!(out.exit_code, EXIT_CODE_INTERRUPTED);
        assert!(!dir.path().join("ran").exists());
    }

    #[tokio::test]
    async fn output_is_capped_head_and_tail() {
        let dir = TempDir::new("cap");
        let out = run(spec(
            "head -c 30000 /dev/zero | tr '\\0' a; head -c 30000 /dev/zero | tr '\\0' b",
            &dir,
        ))
        .await;
        assert!(out.truncated);
        let expected = format!(
            "{}\n... [OUTPUT TRUNCATED - 10000 chars omitted out of 60000 total] ...\n{}",
            "a".repeat(20_000),
            "b".repeat(30_000)
        );
        assert_eq!(out.output.len(), expected.len());
        assert!(out.output == expected, "unexpected capped output");
    }

    #[tokio::test]
    async fn huge_output_stays_bounded() {
        let dir = TempDir::new("huge");
        let mut spec = spec("yes | head -c 100000000", &dir);
        spec.timeout = Duration::from_secs(120);
        let out = run(spec).await;
        assert_eq!(out.exit_code, 0);
        assert!(out.truncated);
        // 100M bytes of "y\n"; the final newline is trimmed.
        let expected = format!(
            "{}\n... [OUTPUT TRUNCATED - 99949999 chars omitted out of 99999999 total] ...\n{}",
            "y\n".repeat(10_000),
            "\ny".repeat(15_000)
        );
        assert!(
            out.output == expected,
            "unexpected output {:?}",
            out.output.chars().take(200).collect::<String>()
        );
    }

    #[test]
    fn collector_memory_is_bounded() {
        let cap = 1000;
        let mut collector = Collector::new(cap);
        let chunk = "é".repeat(10_000);
        let mut max = 0;
        for _ in 0..1000 {
            collector.push(chunk.as_bytes());
            max = max.max(collector.buffered_bytes());
        }
        // head 4×cap + tail up to 2×4×cap + one chunk
        assert!(max <= 4 * cap + 8 * cap + chunk.len(), "{max}");
        let (text, truncated) = collector.finish();
        assert!(truncated);
        let expected = format!(
            "{}{}{}",
            "é".repeat(400),
            truncation_marker(10_000_000 - 1000, 10_000_000),
            "é".repeat(600)
        );
        assert_eq!(text, expected);
    }

    #[tokio::test]
    async fn output_is_cleaned() {
        let dir = TempDir::new("clean");
        let out = run(spec(r"printf '\033[31mred\033[0m a\377b \n\n  \n'", &dir)).await;
        assert_eq!(out.output, "red a\u{fffd}b");
    }

    #[test]
    fn cap_output_keeps_short_text() {
        assert_eq!(cap_output("hello", 5), ("hello".to_string(), false));
        assert_eq!(cap_output("", 0), (String::new(), false));
    }

    #[test]
    fn cap_output_splits_40_60_on_char_boundaries() {
        let text: String = "αβγδεζηθικ".repeat(2); // 20 chars, 2 bytes each
        let (out, truncated) = cap_output(&text, 10);
        assert!(truncated);
        assert_eq!(out, format!("αβγδ{}εζηθικ", truncation_marker(10, 20)));
        let (out, _) = cap_output("abcdefgh", 3);
        assert_eq!(out, format!("a{}gh", truncation_marker(5, 8)));
        let (out, _) = cap_output("abc", 0);
        assert_eq!(out, truncation_marker(3, 3));
    }

    #[test]
    fn split_cap_is_forty_sixty() {
        assert_eq!(split_cap(50_000), (20_000, 30_000));
        assert_eq!(split_cap(7), (2, 5));
        assert_eq!(split_cap(usize::MAX).0, usize::MAX / 5 * 2);
    }

    #[test]
    fn strip_ansi_removes_sequences() {
        assert_eq!(strip_ansi("\u{1b}[1;32mok\u{1b}[0m"), "ok");
        assert_eq!(strip_ansi("\u{1b}]0;title\u{7}x\u{1b}(By"), "xy");
        assert_eq!(strip_ansi("plain"), "plain");
    }

    /// A shell is spawned by its path, found in the child's `PATH` (a bare name would make the
    /// standard library fork the daemon to search that `PATH` in the child): an executable file
    /// in the first absolute entry that has one; not a file without execute permission, a
    /// directory, or anything in a relative entry; a name with a slash as it is.
    #[test]
    fn a_program_is_found_as_the_childs_exec_would_find_it() {
        use std::os::unix::fs::PermissionsExt;
        let dir = TempDir::new("resolve");
        let (first, second) = (dir.path().join("first"), dir.path().join("second"));
        for d in [&first, &second] {
            std::fs::create_dir_all(d).unwrap();
        }
        let write = |path: &Path, mode: u32| {
            std::fs::write(path, "#!/bin/sh\n").unwrap();
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
        };
        write(&first.join("plain"), 0o644);
        write(&second.join("plain"), 0o755);
        write(&first.join("tool"), 0o755);
        write(&second.join("tool"), 0o755);
        std::fs::create_dir_all(first.join("adir")).unwrap();
        let path =
            std::env::join_paths(["relative-bin".into(), first.clone(), second.clone()]).unwrap();
        let path = Some(path.as_os_str());
        assert_eq!(resolve_program("tool", path), Some(first.join("tool")));
        assert_eq!(resolve_program("plain", path), Some(second.join("plain")));
        assert_eq!(resolve_program("adir", path), None);
        assert_eq!(resolve_program("missing", path), None);
        assert_eq!(
            resolve_program("./relative", path),
            Some(PathBuf::from("./relative"))
        );
        std::fs::create_dir_all(dir.path().join("relative-bin")).unwrap();
        write(&dir.path().join("relative-bin").join("only-here"), 0o755);
        assert_eq!(resolve_program("only-here", path), None);
        let shell = default_shell().expect("a shell on this machine");
        assert!(shell.is_absolute(), "{}", shell.display());
    }
}
