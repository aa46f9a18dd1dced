//! `gatehouse`: the daemon and its operator commands.

use std::path::PathBuf;
use std::process::ExitCode;

use gatehouse::config::Config;
use gatehouse::Gateway;
use serde_json::{json, Value};

/// mimalloc rather than the system allocator. With thousands of sessions parked, glibc's heap held
/// their scattered allocations and every later allocation walked its bins: `_int_malloc` and
/// `malloc_consolidate` went from 3 % to 8 % of the daemon's CPU for the same healthy turns in
/// the bench's isolation rounds, which ran 10-20 % slower beside the parked sessions than alone.
/// Built without transparent huge pages (`no_thp`): with them the idle RSS doubled (31 MiB).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// How mimalloc gives memory back to the system.
mod allocator {
    use std::time::Duration;

    use libmimalloc_sys::{mi_collect, mi_option_get, mi_option_set, mi_option_t};

    /// `mi_option_purge_delay` in the bundled mimalloc (v3); its default there is 1000 ms.
    const PURGE_DELAY: mi_option_t = 15;
    const DEFAULT_PURGE_DELAY_MS: std::ffi::c_long = 1000;

    /// Freed memory goes back to the system 100 ms after it was freed, and a thread collects
    /// every 250 ms, so memory goes back even when nothing else allocates. With the default
    /// delay (1 s) and nothing to trigger the purge, a daemon that had answered a 32 MiB
    /// response kept ~240 MiB resident for good (glibc: 51 MiB); with immediate purging (0) the
    /// turn rate fell back to glibc's.
    pub fn tune() {
        // SAFETY: reads and sets an allocator option (the purge delay, when it still has the
        // default we know it by); no allocation depends on its old value.
        unsafe {
            if mi_option_get(PURGE_DELAY) == DEFAULT_PURGE_DELAY_MS {
                mi_option_set(PURGE_DELAY, 100);
            }
        }
        let spawned = std::thread::Builder::new()
            .name("gatehouse-mem".into())
            .spawn(|| loop {
                std::thread::sleep(Duration::from_millis(250));
                // SAFETY: no preconditions; purges what is due (not forced).
                unsafe { mi_collect(false) };
            });
        if let Err(e) = spawned {
            eprintln!("gatehouse: cannot start the memory collector: {e}");
        }
    }
}

const USAGE: &str = "usage: gatehouse <command> [--home DIR] [options]

commands:
  serve [--log-format human|json]     run the daemon in the foreground
  chat [--session NAME] [TEXT]        talk to a session (interactive without TEXT;
                                      after `--`, every word is TEXT, even -h or --x)
  bench [--quick] [--json] [--parked N] [--model-latency-ms N] [--dir DIR]
         [--only admission,turn,tool,room,isolation,recovery]
         [--levels 1,16,256]
         [--admissions N]
                                      measure the daemon against a loopback fake model
  status [--json]                     identify the running daemon and count admissions
  key create [NAME] | list | revoke NAME
                                      HTTP API keys (HOME/api_keys holds their SHA-256 only)
  sessions [--json]                   list sessions
  pending [--json]                    list unknown admissions waiting for an operator
  resolve-unknown SESSION ADMISSION   settle an unknown admission as interrupted
  rooms [--json]                      list hosted rooms and the room runtime's status
  room-retry ROOM TASK                retry an indeterminate or deferred room task
  room-cancel ROOM TASK               cancel a room task
  room-disband ROOM                   cancel a room's open tasks and retire the room
  room-respond ROOM TASK GENERATION REQUEST once|deny
                                      answer the approval a room's member waits on (rooms lists them)

The home is --home, else $GATEHOUSE_HOME, else $XDG_STATE_HOME/gatehouse (~/.local/state/gatehouse).";

struct Args {
    command: String,
    home: PathBuf,
    json: bool,
    log_json: bool,
    session: String,
    quick: bool,
    parked: Option<usize>,
    model_latency_ms: u64,
    dir: Option<PathBuf>,
    only: Vec<String>,
    levels: Option<Vec<usize>>,
    admissions: Option<usize>,
    rest: Vec<String>,
}

fn default_home() -> PathBuf {
    if let Ok(h) = std::env::var("GATEHOUSE_HOME") {
        if !h.is_empty() {
            return PathBuf::from(h);
        }
    }
    if let Ok(x) = std::env::var("XDG_STATE_HOME") {
        if !x.is_empty() {
            return PathBuf::from(x).join("gatehouse");
        }
    }
    let home = std::env::var("HOME").unwrap_or_else(|_| ".".into());
    PathBuf::from(home).join(".local/state/gatehouse")
}

fn parse_args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let command = it.next().ok_or_else(|| USAGE.to_string())?;
    let mut args = Args {
        command,
        home: default_home(),
        json: false,
        log_json: false,
        session: "default".into(),
        quick: false,
        parked: None,
        model_latency_ms: 0,
        dir: None,
        only: Vec::new(),
        levels: None,
        admissions: None,
        rest: Vec::new(),
    };
    while let Some(a) = it.next() {
        match a.as_str() {
            "--home" => args.home = PathBuf::from(it.next().ok_or("--home needs a directory")?),
            "--json" => args.json = true,
            "--quick" => args.quick = true,
            "--parked" => {
                args.parked = Some(
                    it.next()
                        .and_then(|v| v.parse().ok())
                        .ok_or("--parked needs a number")?,
                )
            }
            "--model-latency-ms" => {
                args.model_latency_ms = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .ok_or("--model-latency-ms needs a number")?
            }
            "--only" => {
                let list = it.next().ok_or("--only needs a list of sections")?;
                for s in list.split(',').filter(|s| !s.is_empty()) {
                    if !gatehouse::bench::SECTIONS.contains(&s) {
                        return Err(format!(
                            "--only: unknown section {s} (one of {})",
                            gatehouse::bench::SECTIONS.join(", ")
                        ));
                    }
                    args.only.push(s.to_string());
                }
            }
            "--levels" => {
                let list = it.next().ok_or("--levels needs a list of session counts")?;
                let levels = gatehouse::bench::parse_levels(&list)?;
                args.levels = Some(levels);
            }
            "--admissions" => {
                args.admissions = Some(
                    it.next()
                        .and_then(|v| v.parse().ok())
                        .filter(|n: &usize| *n > 0)
                        .ok_or("--admissions needs a positive number of inputs")?,
                )
            }
            "--dir" => args.dir = Some(PathBuf::from(it.next().ok_or("--dir needs a directory")?)),
            "--session" => args.session = it.next().ok_or("--session needs a name")?,
            "--log-format" => match it.next().as_deref() {
                Some("json") => args.log_json = true,
                Some("human") => args.log_json = false,
                _ => return Err("--log-format takes human or json".into()),
            },
            // What follows is text, not options (a message about `ls -h` printed the usage).
            "--" => {
                args.rest.extend(it.by_ref());
                break;
            }
            "-h" | "--help" => {
                args.command = "help".into();
                return Ok(args);
            }
            other if other.starts_with("--") => {
                return Err(format!("unknown option {other}\n\n{USAGE}"))
            }
            other => args.rest.push(other.to_string()),
        }
    }
    Ok(args)
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(msg) => {
            eprintln!("{msg}");
            return ExitCode::from(2);
        }
    };
    match args.command.as_str() {
        "serve" => serve(args),
        "status" | "sessions" | "pending" | "resolve-unknown" | "rooms" | "room-retry"
        | "room-cancel" | "room-disband" | "room-respond" => operator(args),
        "chat" => chat(args),
        "key" => key(args),
        "bench" => bench(args),
        "help" | "--help" | "-h" => {
            println!("{USAGE}");
            ExitCode::SUCCESS
        }
        other => {
            eprintln!("unknown command {other}\n\n{USAGE}");
            ExitCode::from(2)
        }
    }
}

/// A value a client or a model sent, as it is safe to print on the operator's terminal (see
/// `chat::printable`): a string without its quotes, anything else as JSON.
fn plain(v: &Value) -> String {
    match v.as_str() {
        Some(s) => gatehouse::chat::printable(s, false).into_owned(),
        None => gatehouse::chat::printable(&v.to_string(), false).into_owned(),
    }
}

fn serve(args: Args) -> ExitCode {
    // `gatehouse serve /var/lib/gatehouse` would serve the default home (and the named one's
    // queued work would never run): say so instead.
    if let Some(extra) = args.rest.first() {
        eprintln!("gatehouse serve takes no argument {extra:?} (the home is --home DIR)");
        return ExitCode::from(2);
    }
    gatehouse::telemetry::init_logging(args.log_json);
    allocator::tune();
    not_dumpable();
    let config = match Config::load(&args.home) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("gatehouse: {e}");
            return ExitCode::from(2);
        }
    };
    let system = actix_rt::System::new();
    // Err: (message, whether starting again would change nothing).
    let result: Result<(), (String, bool)> = system.block_on(async move {
        // Caught from before the start, so there is no moment when `READY=1` has been said and
        // a SIGTERM would still kill the daemon without its drain.
        use tokio::signal::unix::{signal, SignalKind};
        let watch = |kind: SignalKind, name: &str| {
            signal(kind).map_err(|e| (format!("cannot watch {name}: {e}"), false))
        };
        let mut term = watch(SignalKind::terminate(), "SIGTERM")?;
        let mut int = watch(SignalKind::interrupt(), "SIGINT")?;
        // There is no reload: a SIGHUP (often sent for one) would otherwise end the daemon at
        // once, with no drain, its running turns left `unknown`, and exit status that systemd
        // counts as clean (so it would not restart it).
        let mut hup = watch(SignalKind::hangup(), "SIGHUP")?;
        // A SIGTERM during the start (a wait for its address) ends it there, cleanly, if it has
        // done nothing durable yet; else the gateway stops gracefully as soon as it has started.
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let start = Gateway::start_unless_stopped(args.home.clone(), config, stopped);
        tokio::pin!(start);
        let started = loop {
            tokio::select! {
                started = &mut start => break started,
                why = stop_signal(&mut term, &mut int, &mut hup) => {
                    if *stop.borrow() {
                        signalled_again(why)?;
                        continue;
                    }
                    tracing::info!("{why} during the start: stopping");
                    stop.send_replace(true);
                }
            }
        };
        let gateway = match started {
            Err(gatehouse::gateway::StartError::Stopped) => return Ok(()),
            started => started.map_err(|e| (e.to_string(), e.is_permanent()))?,
        };
        if *stop.borrow() {
            return stop_unless_signalled(gateway, &mut term, &mut int, &mut hup).await;
        }
        if let Some(every) = gatehouse::notify::watchdog_interval() {
            let shared = gateway.shared.clone();
            actix_rt::spawn(async move {
                let mut tick = tokio::time::interval(every);
                loop {
                    tick.tick().await;
                    // A daemon whose writer is gone writes nothing more: systemd restarts it.
                    // (A commit slow on the disk is not that: a restart would not make it
                    // faster, and would leave the running turns unknown.)
                    if !shared.db.writer_alive() {
                        tracing::error!("the database writer is gone: the watchdog is not fed");
                        break;
                    }
                    // Nothing more is committed until a restart, which recovers from the WAL:
                    // systemd restarts it (it was fed on, the daemon left up and useless). Not
                    // for a database file found lost: a restart would start an empty ledger.
                    if shared.db.sync_failed() {
                        tracing::error!(
                            "a sync of the database file failed: the watchdog is not fed, so \
                             that systemd restarts the daemon"
                        );
                        break;
                    }
                    gatehouse::notify::watchdog();
                }
            });
        }
        let why = stop_signal(&mut term, &mut int, &mut hup).await;
        tracing::info!("{why}: stopping");
        stop_unless_signalled(gateway, &mut term, &mut int, &mut hup).await
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // 2: the home, the config or another daemon refuses the start (the unit does not
        // restart it for that); 1: a failure a later start may not meet.
        Err((e, permanent)) => {
            eprintln!("gatehouse: {e}");
            ExitCode::from(if permanent { 2 } else { 1 })
        }
    }
}

fn chat(args: Args) -> ExitCode {
    let text = if args.rest.is_empty() {
        None
    } else {
        Some(args.rest.join(" "))
    };
    let opts = gatehouse::chat::ChatOptions {
        home: args.home,
        session: args.session,
        text,
    };
    let system = actix_rt::System::new();
    match system.block_on(gatehouse::chat::run(opts)) {
        Ok(gatehouse::chat::ChatEnd::Completed) => ExitCode::SUCCESS,
        // The outcome is already shown (`[failed]`, `[interrupted]`, …).
        Ok(gatehouse::chat::ChatEnd::NotCompleted) => ExitCode::from(1),
        Err(e) => {
            eprintln!("gatehouse: {e}");
            ExitCode::from(1)
        }
    }
}

fn bench(args: Args) -> ExitCode {
    let mut opts = gatehouse::bench::BenchOptions::new(args.quick);
    if let Some(n) = args.parked {
        opts.parked = n;
    }
    if let Some(d) = args.dir {
        opts.dir = d;
    }
    opts.model_latency_ms = args.model_latency_ms;
    opts.only = args.only;
    if let Some(levels) = args.levels {
        opts.levels = levels;
    }
    if let Some(n) = args.admissions {
        opts.admissions = n;
    }
    let system = actix_rt::System::new();
    match system.block_on(gatehouse::bench::run(opts)) {
        Ok(report) => {
            if args.json {
                println!("{report}");
            } else {
                print!("{}", gatehouse::bench::table(&report));
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("gatehouse bench: {e}");
            ExitCode::from(1)
        }
    }
}

fn operator(args: Args) -> ExitCode {
    let (method, params) = match args.command.as_str() {
        "resolve-unknown" => {
            let [session, admission] = args.rest.as_slice() else {
                eprintln!("usage: gatehouse resolve-unknown SESSION ADMISSION");
                return ExitCode::from(2);
            };
            (
                "resolve-unknown",
                json!({"session_id": session, "admission_id": admission}),
            )
        }
        "room-retry" | "room-cancel" => {
            let [room, task] = args.rest.as_slice() else {
                eprintln!("usage: gatehouse {} ROOM TASK", args.command);
                return ExitCode::from(2);
            };
            (
                args.command.as_str(),
                json!({"room_id": room, "task_id": task}),
            )
        }
        "room-respond" => {
            let [room, task, generation, request, choice] = args.rest.as_slice() else {
                eprintln!("usage: gatehouse room-respond ROOM TASK GENERATION REQUEST once|deny");
                return ExitCode::from(2);
            };
            let Ok(generation) = generation.parse::<i64>() else {
                eprintln!("gatehouse room-respond: GENERATION must be a number (rooms lists it)");
                return ExitCode::from(2);
            };
            (
                "room-respond",
                json!({"room_id": room, "task_id": task, "execution_generation": generation,
                       "request_id": request, "choice": choice}),
            )
        }
        "room-disband" => {
            let [room] = args.rest.as_slice() else {
                eprintln!("usage: gatehouse room-disband ROOM");
                return ExitCode::from(2);
            };
            ("room-disband", json!({"room_id": room}))
        }
        other => {
            // `gatehouse status /var/lib/gatehouse` would ask the default home: say so instead.
            if let Some(extra) = args.rest.first() {
                eprintln!("gatehouse {other} takes no argument {extra:?} (the home is --home DIR)");
                return ExitCode::from(2);
            }
            (other, json!({}))
        }
    };
    let reply = match gatehouse::api::control::request(&args.home, method, params) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("gatehouse: {e}");
            return ExitCode::from(1);
        }
    };
    // From here on only standard output is written: a reader that stops early (`| head`)
    // ends the command quietly, as for any filter, instead of a panic on the closed pipe.
    default_sigpipe();
    if let Some(err) = reply.get("error") {
        if args.json {
            // A script reads the refusal as it reads an answer: one JSON object.
            println!("{reply}");
            return ExitCode::from(1);
        }
        eprintln!(
            "gatehouse: {}: {}",
            err["code"].as_str().unwrap_or("error"),
            err["message"].as_str().unwrap_or("")
        );
        return ExitCode::from(1);
    }
    if args.json {
        println!("{reply}");
        return ExitCode::SUCCESS;
    }
    match method {
        "status" => {
            println!("state      {}", reply["state"].as_str().unwrap_or("?"));
            println!("pid        {}", reply["pid"]);
            println!("epoch      {}", reply["authority_epoch"]);
            println!(
                "instance   {}",
                reply["instance_id"].as_str().unwrap_or("?")
            );
            println!("api        {}", reply["api_origin"].as_str().unwrap_or("?"));
            if let Some(a) = reply["admissions"].as_object() {
                for (k, v) in a {
                    println!("admissions {k:<9} {v}");
                }
            }
            if let Some(e) = reply["ledger_error"].as_str() {
                println!("ledger     cannot be read: {e}");
            }
        }
        "sessions" => {
            println!(
                "{:<40} {:<20} {:<6} GENERATION",
                "SESSION", "MODEL", "SOURCE"
            );
            for s in reply["sessions"].as_array().cloned().unwrap_or_default() {
                println!(
                    "{:<40} {:<20} {:<6} {}",
                    plain(&s["session_id"]),
                    plain(&s["model"]),
                    plain(&s["source"]),
                    s["execution_generation"]
                );
            }
            if reply["truncated"] == true {
                println!("… more sessions than these (the newest are listed)");
            }
        }
        "pending" => {
            println!(
                "{:<40} {:<34} {:<10} TEXT",
                "SESSION", "ADMISSION", "GENERATION"
            );
            for r in reply["unknown"].as_array().cloned().unwrap_or_default() {
                // A client's text: its control characters shown, not sent to the terminal.
                let text: String = plain(&r["text"]).chars().take(40).collect();
                println!(
                    "{:<40} {:<34} {:<10} {}",
                    plain(&r["session_id"]),
                    plain(&r["admission_id"]),
                    r["execution_generation"],
                    text
                );
            }
            if reply["truncated"] == true {
                println!("… more unknown inputs than these: resolve these, then list again");
            }
        }
        "rooms" => {
            println!("gateway {}", reply["gateway_id"].as_str().unwrap_or("?"));
            println!("{:<24} {:<24} {:<8} TASKS", "ROOM", "NAME", "MEMBERS");
            for r in reply["rooms"].as_array().cloned().unwrap_or_default() {
                println!(
                    "{:<24} {:<24} {:<8} {}",
                    plain(&r["room_id"]),
                    plain(&r["name"]),
                    r["members"],
                    r["task_counts"]
                );
                // What a peer member sent is printed without the control characters it may hold.
                for p in r["pending_actions"].as_array().cloned().unwrap_or_default() {
                    let a = &p["action"];
                    println!(
                        "  member {} waits on an approval of {}\n    answer: gatehouse room-respond {} {} {} {} once|deny",
                        plain(&p["member_id"]),
                        plain(&a["approval"]["command"]),
                        plain(&r["room_id"]),
                        plain(&a["task_id"]),
                        a["execution_generation"],
                        plain(&a["request_id"]),
                    );
                }
            }
            let st = &reply["status"];
            println!(
                "runtime running={} cycles={} leased={} blocked={} waiting={} last_error={}",
                st["running"],
                st["cycles"],
                st["leased_rooms"],
                st["blocked_rooms"],
                st["waiting_rooms"],
                st["last_error"]
            );
        }
        "room-disband" => {
            println!(
                "{} {}",
                reply["room_id"].as_str().unwrap_or(""),
                reply["state"].as_str().unwrap_or("")
            );
        }
        "room-respond" => {
            println!(
                "{} {}",
                reply["request_id"].as_str().unwrap_or(""),
                reply["status"].as_str().unwrap_or("")
            );
        }
        "room-retry" | "room-cancel" => {
            println!(
                "{} {} {}",
                reply["identity"]["room_id"].as_str().unwrap_or(""),
                reply["identity"]["task_id"].as_str().unwrap_or(""),
                reply["status"].as_str().unwrap_or("")
            );
        }
        _ => {
            println!(
                "{} {} {}",
                reply["admission_id"].as_str().unwrap_or(""),
                reply["status"].as_str().unwrap_or(""),
                reply["outcome"].as_str().unwrap_or("")
            );
        }
    }
    ExitCode::SUCCESS
}

/// The daemon's `/proc` entries are its user's no more: the commands its terminal tool runs (as
/// the same user, its children) cannot open its files through `/proc/$PPID/fd` (the ledger,
/// where an approval could be written), read its environment (the model's key) or trace it. A
/// root-run daemon's children are root and keep that reach. No core dumps follow.
/// The next signal that stops the daemon (SIGTERM or SIGINT), by name. There is no reload: a
/// SIGHUP (often sent for one) is said to be ignored, and waited past.
/// Stop `gateway` gracefully, unless a SIGINT comes first (a second Ctrl-C: someone who will
/// not wait for the drain): then the process ends at once. Nothing listened for one, and
/// outside systemd a drain of `gateway.drain_timeout_seconds` could only be cut short by
/// SIGKILL. A SIGTERM sent again is only a stop asked again (`kill` run twice).
async fn stop_unless_signalled(
    gateway: gatehouse::gateway::RunningGateway,
    term: &mut tokio::signal::unix::Signal,
    int: &mut tokio::signal::unix::Signal,
    hup: &mut tokio::signal::unix::Signal,
) -> Result<(), (String, bool)> {
    let stopping = gateway.stop();
    tokio::pin!(stopping);
    loop {
        tokio::select! {
            () = &mut stopping => return Ok(()),
            why = stop_signal(term, int, hup) => signalled_again(why)?,
        }
    }
}

/// A stop signal while stopping already: a SIGINT ends the process (status 1) without waiting
/// for the stop, said; another is a stop asked again.
fn signalled_again(why: &str) -> Result<(), (String, bool)> {
    if why != "SIGINT" {
        tracing::info!("{why} again: the daemon is stopping already");
        return Ok(());
    }
    tracing::error!(
        "{why} again during the stop: exiting now; turns still running become unknown at the \
         next start"
    );
    Err((
        format!("stopped by a second {why} before the graceful stop ended"),
        false,
    ))
}

async fn stop_signal(
    term: &mut tokio::signal::unix::Signal,
    int: &mut tokio::signal::unix::Signal,
    hup: &mut tokio::signal::unix::Signal,
) -> &'static str {
    loop {
        tokio::select! {
            _ = term.recv() => return "SIGTERM",
            _ = int.recv() => return "SIGINT",
            _ = hup.recv() => tracing::warn!(
                "SIGHUP ignored: the configuration is read only at start; restart the daemon \
                 to apply a change"
            ),
        }
    }
}

fn not_dumpable() {
    // SAFETY: prctl(PR_SET_DUMPABLE, 0) changes only this process's dumpable flag.
    let set = unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) };
    if set != 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "cannot make the daemon non-dumpable");
    }
}

/// Die of SIGPIPE on a closed standard output, as a filter does (Rust ignores the signal,
/// and `println!` then panics on the EPIPE). Only for commands that write nothing else after.
fn default_sigpipe() {
    // SAFETY: resetting a signal's disposition to its default; no handler is installed.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// `gatehouse key create|list|revoke`: API keys for the HTTP API, kept as SHA-256 hashes in
/// `HOME/api_keys` (the daemon re-reads it when it changes: no restart needed).
fn key(args: Args) -> ExitCode {
    use gatehouse::api::auth;
    let words: Vec<&str> = args.rest.iter().map(String::as_str).collect();
    if !matches!(
        words.as_slice(),
        ["create"] | ["create", _] | ["list"] | ["revoke", _]
    ) {
        eprintln!("usage: gatehouse key create [NAME] | key list | key revoke NAME|SHA256-PREFIX");
        return ExitCode::from(2);
    }
    let new_home = !args.home.exists();
    // Only a new key makes a home: listing or revoking under a mistyped --home made one.
    if new_home && words.first() != Some(&"create") {
        eprintln!("gatehouse: no home at {}", args.home.display());
        return ExitCode::from(1);
    }
    if let Err(e) = gatehouse::gateway::prepare_home(&args.home) {
        eprintln!("gatehouse: {e}");
        return ExitCode::from(1);
    }
    if new_home {
        // Keys may come before the first start; a mistyped --home must not pass unnoticed.
        eprintln!(
            "gatehouse: created the home {} (no daemon has used it yet)",
            args.home.display()
        );
    }
    let result = match words.as_slice() {
        ["create"] | ["create", _] => {
            let default = format!("key-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
            let name = words.get(1).map(|s| s.to_string()).unwrap_or(default);
            auth::create_key_noting(&args.home, &name).and_then(|(key, entry, warning)| {
                use std::io::Write;
                if let Some(warning) = warning {
                    eprintln!("gatehouse: warning: {warning}");
                }
                let line = if args.json {
                    json!({"key": key, "name": entry.name, "sha256": entry.digest}).to_string()
                } else {
                    key
                };
                let mut out = std::io::stdout().lock();
                // The key is shown only this once: one that could not be shown (standard
                // output closed, a full disk) is revoked, not left working unseen (println!
                // panicked there, after the key was written).
                if let Err(e) = writeln!(out, "{line}").and_then(|()| out.flush()) {
                    let revoked = auth::revoke_key(&args.home, &entry.digest);
                    return Err(std::io::Error::new(
                        e.kind(),
                        format!(
                            "the new key could not be written to standard output ({e}); {}",
                            match revoked {
                                Ok(1) => "it was revoked".to_string(),
                                Ok(n) => format!("{n} keys were revoked"),
                                Err(r) => format!(
                                    "and could not be revoked ({r}): revoke {:?} by hand",
                                    entry.name
                                ),
                            }
                        ),
                    ));
                }
                if !args.json {
                    eprintln!(
                        "created API key {:?} (sha256:{}…); it is shown only this once. Send it as \
                         `Authorization: Bearer <key>`.",
                        entry.name,
                        entry.digest.get(..12).unwrap_or(&entry.digest)
                    );
                }
                Ok(())
            })
        }
        ["list"] => auth::list_keys(&args.home).map(|keys| {
            if args.json {
                let list: Vec<Value> = keys
                    .iter()
                    .map(
                        |k| json!({"name": k.name, "sha256": k.digest, "created_at": k.created_at}),
                    )
                    .collect();
                println!("{}", json!({"keys": list}));
            } else {
                default_sigpipe();
                println!("{:<24} {:<14} CREATED", "NAME", "SHA256");
                for k in keys {
                    println!(
                        "{:<24} {:<14} {}",
                        k.name,
                        k.digest.get(..12).unwrap_or(&k.digest),
                        gatehouse::clock::utc_text(k.created_at)
                    );
                }
            }
        }),
        ["revoke", which] => match auth::revoke_key(&args.home, which) {
            Ok(0) => Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("no key named {which:?} (or with that hash prefix)"),
            )),
            Ok(n) => {
                println!("revoked {n} key(s)");
                Ok(())
            }
            Err(e) => Err(e),
        },
        _ => {
            eprintln!(
                "usage: gatehouse key create [NAME] | key list | key revoke NAME|SHA256-PREFIX"
            );
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gatehouse: {e}");
            ExitCode::from(1)
        }
    }
}
