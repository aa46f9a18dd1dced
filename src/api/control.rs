//! The control socket `HOME/gateway.sock` (0600): one JSON object per line in, one per line out.
//! Being able to open it (the home's permissions, and the peer's uid) is the local proof of
//! identity, so tickets are minted only here. Operator commands use it too.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

use super::rpc::{receipt, Authority};
use super::tickets::Tickets;
use crate::store::{admissions, prompts, sessions};

pub const MAX_LINE: usize = 64 * 1024;

pub struct Control {
    pub authority: Authority,
    pub tickets: Arc<Tickets>,
    pub version: &'static str,
}

/// Bind the socket (replacing a stale one) with mode 0600. Bound, it has the umask's mode until
/// the `chmod`; no other user can reach it meanwhile, as the start refuses a home that group or
/// others may enter.
pub fn bind(path: &Path) -> std::io::Result<UnixListener> {
    if path.exists() {
        std::fs::remove_file(path)?;
    }
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// Who answers the socket's requests: the gateway while it starts (it says so), then the
/// running gateway.
pub enum Answerer {
    /// The store is not open yet: `identify` says `starting`, anything else is refused.
    Starting {
        version: &'static str,
        /// This process's instance, the one it will serve as.
        instance_id: String,
        /// Known once the listener is bound.
        api_origin: Option<String>,
    },
    Ready(Arc<Control>),
}

impl Answerer {
    async fn dispatch(&self, method: &str, params: Value, same_user: bool) -> Value {
        match self {
            Answerer::Ready(control) => control.dispatch(method, params, same_user).await,
            Answerer::Starting {
                version,
                instance_id,
                api_origin,
            } => match method {
                // The epoch is taken only once the store is open: null until then. `status`
                // says `starting` too (a monitor could not tell it from a daemon that is down).
                "identify" | "status" => json!({
                    "state": "starting",
                    "pid": std::process::id(),
                    "instance_id": instance_id,
                    "api_origin": api_origin,
                    "authority_epoch": Value::Null,
                    "version": version,
                }),
                _ => err(
                    "starting",
                    "the gateway is starting (its store is being opened and recovered): try \
                     again shortly",
                ),
            },
        }
    }
}

/// Serve connections until the listener is dropped with the task. Each request is answered by
/// the answerer of the moment: served from the bind, before the store is opened (migrations and
/// recovery can take a while), the socket's connections waited in the kernel's queue
/// unanswered until then, and `gatehouse status` failed at its read timeout.
pub async fn serve(listener: UnixListener, control: tokio::sync::watch::Receiver<Arc<Answerer>>) {
    let open = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        match listener.accept().await {
            Ok((mut stream, _)) => {
                let control = control.clone();
                let Ok(held) = open.clone().try_acquire_owned() else {
                    // Each connection holds a descriptor and a task: past the bound it is told
                    // why, and closed.
                    actix::spawn(async move {
                        let r = err(
                            "busy",
                            format!("{MAX_CONNECTIONS} control connections are open; try again"),
                        );
                        let _ = tokio::time::timeout(
                            IDLE,
                            stream.write_all(format!("{r}\n").as_bytes()),
                        )
                        .await;
                    });
                    continue;
                };
                actix::spawn(async move {
                    if let Err(e) = handle(stream, control).await {
                        tracing::debug!(error = %e, "control connection ended");
                    }
                    drop(held);
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "control socket accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    }
}

/// Control connections open at once, and how long one may wait for its next request (or for
/// its reader to take a reply) before it is closed: each held a descriptor and a task for as
/// long as its client kept it open, however idle.
const MAX_CONNECTIONS: usize = 64;
const IDLE: std::time::Duration = std::time::Duration::from_secs(60);

/// Sessions `sessions` lists (the newest first), and `unknown` inputs `pending` lists.
const LISTED_SESSIONS: i64 = 500;
const LISTED_UNKNOWN: i64 = 1000;

fn err(code: &str, message: impl Into<String>) -> Value {
    json!({"error": {"code": code, "message": message.into()}})
}

async fn handle(
    stream: UnixStream,
    control: tokio::sync::watch::Receiver<Arc<Answerer>>,
) -> std::io::Result<()> {
    // The daemon's own user, and not a command the gateway runs for a model (which runs as that
    // user): one found so is answered as another user is (no operator verb, no ticket). The
    // guard's reading of a command's text does not see a socket path built at run time.
    let same_user = stream.peer_cred().is_ok_and(|c| {
        c.uid() == own_uid() && !c.pid().is_some_and(crate::tools::terminal::is_a_command)
    });
    let (read, mut write) = stream.into_split();
    let mut reader = BufReader::new(read);
    loop {
        let mut line = Vec::new();
        let mut limited = (&mut reader).take(MAX_LINE as u64 + 1);
        let Ok(n) = tokio::time::timeout(IDLE, limited.read_until(b'\n', &mut line)).await else {
            return Ok(());
        };
        let n = n?;
        if n == 0 {
            return Ok(());
        }
        let reply = if line.len() > MAX_LINE {
            // The rest of the line is read and let go, a bounded piece at a time: the
            // connection stays usable for the next request.
            let mut ended = line.ends_with(b"\n");
            while !ended {
                let mut rest = Vec::new();
                let mut limited = (&mut reader).take(MAX_LINE as u64);
                let Ok(n) = tokio::time::timeout(IDLE, limited.read_until(b'\n', &mut rest)).await
                else {
                    return Ok(());
                };
                if n? == 0 {
                    break;
                }
                ended = rest.ends_with(b"\n");
            }
            // At the end of its input the answer is the last: the loop below stops there.
            line = if ended { b"\n".to_vec() } else { Vec::new() };
            err(
                "payload_too_large",
                format!("a request line is limited to {MAX_LINE} bytes"),
            )
        } else if !line.ends_with(b"\n") {
            err("invalid_request", "a request must end with a newline")
        } else {
            match serde_json::from_slice::<Value>(&line) {
                Ok(Value::Object(obj)) => {
                    let method = obj
                        .get("method")
                        .and_then(|m| m.as_str())
                        .unwrap_or("")
                        .to_string();
                    let control = control.borrow().clone();
                    match obj.get("params").cloned().unwrap_or(Value::Null) {
                        Value::Null => control.dispatch(&method, json!({}), same_user).await,
                        params @ Value::Object(_) => {
                            control.dispatch(&method, params, same_user).await
                        }
                        _ => err("invalid_params", "params must be a JSON object"),
                    }
                }
                Ok(_) => err("invalid_request", "a request must be a JSON object"),
                Err(e) => err("parse_error", e.to_string()),
            }
        };
        let out = format!("{reply}\n");
        let Ok(wrote) = tokio::time::timeout(IDLE, write.write_all(out.as_bytes())).await else {
            return Ok(());
        };
        wrote?;
        if !line.ends_with(b"\n") {
            return Ok(());
        }
    }
}

pub(crate) fn own_uid() -> u32 {
    // SAFETY: getuid has no preconditions and cannot fail.
    unsafe { libc::getuid() }
}

impl Control {
    async fn dispatch(&self, method: &str, params: Value, same_user: bool) -> Value {
        let shared = &self.authority.shared;
        match method {
            "identify" => json!({
                "state": shared.runtime.phase().as_str(),
                "pid": shared.runtime.pid,
                "instance_id": shared.runtime.instance_id,
                "api_origin": shared.runtime.origin(),
                "authority_epoch": shared.epoch,
                "version": self.version,
                "capabilities": ["session-authority-v1", "durable-admission-v1", "event-replay-v1"],
            }),
            "session-ticket" => {
                if !same_user {
                    return err(
                        "permission_denied",
                        "tickets are minted only for the daemon's own user",
                    );
                }
                let purpose = params
                    .get("purpose")
                    .and_then(|p| p.as_str())
                    .unwrap_or("interactive");
                if purpose != "interactive" {
                    return err("invalid_params", "purpose must be \"interactive\"");
                }
                if let Some(i) = params.get("instance_id").and_then(|i| i.as_str()) {
                    if i != shared.runtime.instance_id {
                        return err(
                            "stale_instance",
                            "the ticket was asked of another daemon instance",
                        );
                    }
                }
                let (ticket, expires_at) = self.tickets.mint(&format!("uid:{}", own_uid()));
                json!({"ticket": ticket, "expires_at": expires_at as i64, "instance_id": shared.runtime.instance_id})
            }
            "status" => {
                // A ledger that cannot be read is said so (`admissions: null` and why), not
                // shown as an empty one.
                let (admissions, ledger_error) = match shared.ledger_counts().await {
                    Ok(counts) => {
                        let mut by_status = serde_json::Map::new();
                        for (status, _, n) in counts {
                            let e = by_status.entry(status).or_insert(json!(0));
                            *e = json!(e.as_i64().unwrap_or(0) + n);
                        }
                        (Value::Object(by_status), Value::Null)
                    }
                    Err(e) => (Value::Null, json!(e.to_string())),
                };
                json!({
                    "state": shared.runtime.phase().as_str(),
                    "pid": shared.runtime.pid,
                    "instance_id": shared.runtime.instance_id,
                    "authority_epoch": shared.epoch,
                    "api_origin": shared.runtime.origin(),
                    "admissions": admissions,
                    "ledger_error": ledger_error,
                })
            }
            "sessions" if same_user => match shared
                .db
                .read(|c| sessions::list_roots(c, LISTED_SESSIONS + 1))
                .await
            {
                // One more than is listed is read, to say when the list is cut short.
                Ok(rows) => {
                    json!({"sessions": rows.iter().take(LISTED_SESSIONS as usize).map(|r| json!({
                    "session_id": r.id, "tip_session_id": r.tip_session_id, "model": r.model, "source": r.source,
                    "title": r.title, "execution_generation": r.runtime_generation, "started_at": r.started_at,
                })).collect::<Vec<_>>(), "truncated": rows.len() > LISTED_SESSIONS as usize})
                }
                Err(e) => err("storage_unavailable", e.to_string()),
            },
            "pending" if same_user => {
                let epoch = shared.epoch;
                match shared
                    .db
                    .read(|c| {
                        let unknown =
                            admissions::all_with_status(c, "unknown", LISTED_UNKNOWN + 1)?;
                        let open: Vec<prompts::PromptRow> = Vec::new();
                        Ok((unknown, open))
                    })
                    .await
                {
                    Ok((unknown, _)) => {
                        json!({"unknown": unknown.iter().take(LISTED_UNKNOWN as usize).map(|r| {
                        let mut v = receipt(r, epoch);
                        v["text"] = json!(r.text());
                        v
                    }).collect::<Vec<_>>(), "truncated": unknown.len() > LISTED_UNKNOWN as usize})
                    }
                    Err(e) => err("storage_unavailable", e.to_string()),
                }
            }
            "resolve-unknown" if same_user => {
                let session = params
                    .get("session_id")
                    .and_then(|s| s.as_str())
                    .unwrap_or("")
                    .to_string();
                let admission = params
                    .get("admission_id")
                    .and_then(|s| s.as_str())
                    .unwrap_or("")
                    .to_string();
                let (s, a) = (session.clone(), admission.clone());
                let row = match shared
                    .db
                    .read(move |c| {
                        let root = sessions::root_of(c, &s)?;
                        admissions::of_session(c, &root.id, &a)
                    })
                    .await
                {
                    Ok(r) => r,
                    Err(e) => {
                        let e = crate::error::GatewayError::from(e);
                        return err(e.reason(), e.detail());
                    }
                };
                let generation = params
                    .get("execution_generation")
                    .and_then(|g| g.as_i64())
                    .or(row.execution_generation)
                    .unwrap_or(-1);
                match self
                    .authority
                    .resolve_unknown(&row.target_session_id, &admission, generation)
                    .await
                {
                    Ok(r) => {
                        tracing::info!(
                            session = %row.target_session_id,
                            admission = %admission,
                            outcome = ?r.outcome,
                            "operator resolved an unknown input"
                        );
                        receipt(&r, shared.epoch)
                    }
                    Err(e) => err(e.reason(), e.detail()),
                }
            }
            "rooms" | "room-retry" | "room-cancel" | "room-disband" | "room-respond"
                if same_user =>
            {
                let Some(rooms) = self.authority.rooms.get() else {
                    return err("unavailable", "hosted rooms are not running");
                };
                if matches!(method, "room-retry" | "room-cancel") {
                    tracing::info!(
                        command = method,
                        room = params.get("room_id").and_then(|r| r.as_str()).unwrap_or(""),
                        task = params.get("task_id").and_then(|t| t.as_str()).unwrap_or(""),
                        "operator command"
                    );
                }
                let result = match method {
                    "rooms" => rooms.list().await,
                    "room-retry" => rooms.call("room.retry", params, None, |_| {}).await,
                    "room-disband" => rooms.call("room.disband", params, None, |_| {}).await,
                    "room-respond" => rooms.call("room.respond", params, None, |_| {}).await,
                    _ => {
                        let mut p = params;
                        if p.get("cancel_id").is_none() {
                            p["cancel_id"] =
                                json!(format!("operator-{}", uuid::Uuid::new_v4().simple()));
                        }
                        rooms.call("room.cancel", p, None, |_| {}).await
                    }
                };
                result.unwrap_or_else(|e| err(e.reason(), e.detail()))
            }
            "sessions" | "pending" | "resolve-unknown" | "rooms" | "room-retry" | "room-cancel"
            | "room-disband" | "room-respond" => err(
                "permission_denied",
                "operator commands need the daemon's user",
            ),
            other => {
                json!({"error": {"code": "unknown_method", "message": format!("unknown method: {other}"),
                "supported": ["identify", "session-ticket", "status", "sessions", "pending", "resolve-unknown",
                    "rooms", "room-retry", "room-cancel", "room-disband", "room-respond"]}})
            }
        }
    }
}

/// Where the socket lives.
pub fn socket_path(home: &Path) -> PathBuf {
    home.join("gateway.sock")
}

/// The client side: one request line to the daemon running on `home`, its decoded reply line
/// (an `{"error":…}` reply is returned as is, for the caller to show).
pub fn request(home: &Path, method: &str, params: Value) -> Result<Value, String> {
    use std::io::{BufRead, Write};
    let path = socket_path(home);
    let mut stream = std::os::unix::net::UnixStream::connect(&path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::PermissionDenied {
            format!(
                "{} is the daemon's and may be opened only by its user ({e}): run this as that \
                 user (e.g. `sudo -u gatehouse gatehouse …`)",
                path.display()
            )
        } else {
            format!(
                "no gatehouse daemon answers on {} ({e}); start one with `gatehouse serve`",
                path.display()
            )
        }
    })?;
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .map_err(|e| e.to_string())?;
    let line = json!({"method": method, "params": params}).to_string() + "\n";
    stream
        .write_all(line.as_bytes())
        .map_err(|e| e.to_string())?;
    let mut reply = String::new();
    std::io::BufReader::new(stream)
        .read_line(&mut reply)
        .map_err(|e| e.to_string())?;
    serde_json::from_str(&reply).map_err(|e| format!("bad reply from the daemon: {e}"))
}
