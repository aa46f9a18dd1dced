//! Test harness: a temp home, a loopback fake model, the real daemon binary, the control socket,
//! a WebSocket JSON-RPC client and read-only looks at `state.db`.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use diesel::prelude::*;
use futures_util::{SinkExt, StreamExt};
use gatehouse::store::admissions::AdmissionRow;
use gatehouse::store::messages::MessageRow;
use gatehouse::store::prompts::PromptRow;
use gatehouse::store::schema::{messages, prompts, session_admissions, sessions};
use serde_json::{json, Value};

// ---------- temp home ----------

pub struct Home {
    pub path: PathBuf,
}

impl Home {
    pub fn new() -> Home {
        let path =
            std::env::temp_dir().join(format!("gatehouse-it-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&path).expect("home");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        Home { path }
    }

    pub fn write_config(&self, config: &Value) {
        std::fs::write(self.path.join("config.yaml"), config.to_string()).expect("config");
    }

    pub fn db(&self) -> SqliteConnection {
        let url = format!("file:{}?mode=ro", self.path.join("state.db").display());
        SqliteConnection::establish(&url).expect("open state.db read-only")
    }

    /// As another process taking the home's authority would: its epoch moves on (waiting for
    /// the daemon's write lock if it holds it).
    pub fn move_epoch_on(&self) {
        use diesel::connection::SimpleConnection;
        SqliteConnection::establish(&self.path.join("state.db").to_string_lossy())
            .expect("open state.db")
            .batch_execute(
                "PRAGMA busy_timeout = 10000; UPDATE runtime_epoch SET epoch = epoch + 1",
            )
            .expect("a newer epoch");
    }

    pub fn admissions(&self) -> Vec<AdmissionRow> {
        session_admissions::table
            .order(session_admissions::seq.asc())
            .select(AdmissionRow::as_select())
            .load(&mut self.db())
            .expect("admissions")
    }

    pub fn admission(&self, input_id: &str) -> AdmissionRow {
        self.admissions()
            .into_iter()
            .find(|r| r.request_id == input_id)
            .expect("admission row")
    }

    pub fn transcript(&self, session: &str) -> Vec<MessageRow> {
        messages::table
            .filter(messages::session_id.eq(session))
            .filter(messages::active.eq(1))
            .order(messages::id.asc())
            .select(MessageRow::as_select())
            .load(&mut self.db())
            .expect("messages")
    }

    pub fn all_messages(&self, session: &str) -> Vec<MessageRow> {
        messages::table
            .filter(messages::session_id.eq(session))
            .order(messages::id.asc())
            .select(MessageRow::as_select())
            .load(&mut self.db())
            .expect("messages")
    }

    pub fn children(&self, session: &str) -> Vec<String> {
        sessions::table
            .filter(sessions::parent_session_id.eq(session))
            .select(sessions::id)
            .load(&mut self.db())
            .expect("children")
    }

    pub fn end_reason(&self, session: &str) -> Option<String> {
        sessions::table
            .filter(sessions::id.eq(session))
            .select(sessions::end_reason)
            .first(&mut self.db())
            .expect("session")
    }

    /// The tokens a session's turns spent, as settled (prompt, completion).
    pub fn tokens(&self, session: &str) -> (i64, i64) {
        sessions::table
            .filter(sessions::id.eq(session))
            .select((sessions::prompt_tokens, sessions::completion_tokens))
            .first(&mut self.db())
            .expect("session")
    }

    /// The prompt audit rows of a session, oldest first.
    pub fn prompt_rows(&self, session: &str) -> Vec<PromptRow> {
        prompts::table
            .filter(prompts::session_id.eq(session))
            .order(prompts::opened_at.asc())
            .select(PromptRow::as_select())
            .load(&mut self.db())
            .expect("prompts")
    }

    pub fn admission_by_id(&self, admission_id: &str) -> AdmissionRow {
        self.admissions()
            .into_iter()
            .find(|r| r.admission_id == admission_id)
            .expect("admission row")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.path.join("daemon.log")).unwrap_or_default()
    }
}

impl Drop for Home {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "--- daemon log ({}) ---\n{}",
                self.path.display(),
                tail(&self.log(), 6000)
            );
        }
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

fn tail(s: &str, n: usize) -> &str {
    let start = s.len().saturating_sub(n);
    let mut i = start;
    while !s.is_char_boundary(i) {
        i += 1;
    }
    &s[i..]
}

/// A base config for a fake model at `url`.
pub fn config(url: &str, extra: Value) -> Value {
    let mut base = json!({
        "model": {"provider": "custom", "default": "fake-model", "base_url": url, "max_retries": 0},
        "approvals": {"mode": "manual", "timeout": 120},
        "agent": {"clarify_timeout": 120},
        "platform_toolsets": {"cli": ["terminal", "clarify"]},
    });
    merge(&mut base, extra);
    base
}

pub fn merge(base: &mut Value, extra: Value) {
    match (base, extra) {
        (Value::Object(b), Value::Object(e)) => {
            for (k, v) in e {
                match b.get_mut(&k) {
                    Some(slot) if slot.is_object() && v.is_object() => merge(slot, v),
                    _ => {
                        b.insert(k, v);
                    }
                }
            }
        }
        (b, e) => *b = e,
    }
}

// ---------- fake model ----------

/// What the fake model answers.
pub enum Reply {
    /// A chat completion: SSE or JSON according to the request's `stream`.
    Message(Value, &'static str),
    /// Raw SSE data payloads (each becomes one `data:` event), then `[DONE]`.
    Sse(Vec<String>),
    /// An HTTP error.
    Status(u16, Value),
    /// Never answer until `release()`.
    Hang,
}

type Handler = dyn Fn(&Value) -> Reply + Send + Sync;

pub struct FakeModel {
    pub url: String,
    pub requests: Arc<Mutex<Vec<Value>>>,
    /// Each request's `Authorization` header (None when absent), in arrival order.
    authorizations: Arc<Mutex<Vec<Option<String>>>>,
    release: Arc<(Mutex<bool>, Condvar)>,
}

impl FakeModel {
    pub fn start(handler: impl Fn(&Value) -> Reply + Send + Sync + 'static) -> FakeModel {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind fake model");
        let port = listener.local_addr().expect("addr").port();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let authorizations = Arc::new(Mutex::new(Vec::new()));
        let release = Arc::new((Mutex::new(false), Condvar::new()));
        let handler: Arc<Handler> = Arc::new(handler);
        let (reqs, auths, rel) = (requests.clone(), authorizations.clone(), release.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let (seen, rel, handler) =
                    ((reqs.clone(), auths.clone()), rel.clone(), handler.clone());
                std::thread::spawn(move || serve_one(stream, (&seen.0, &seen.1), &rel, &*handler));
            }
        });
        FakeModel {
            url: format!("http://127.0.0.1:{port}/v1"),
            requests,
            authorizations,
            release,
        }
    }

    /// Answers ACK_<last user text> to everything.
    pub fn ack() -> FakeModel {
        FakeModel::start(|body| {
            Reply::Message(
                json!({"role": "assistant", "content": format!("ACK_{}", last_user(body))}),
                "stop",
            )
        })
    }

    /// A model that answers `ACK_<text>`, and never answers `HANG` (until released).
    pub fn ack_or_hang() -> FakeModel {
        FakeModel::start(|body| match last_user(body).as_str() {
            "HANG" => Reply::Hang,
            text => Reply::Message(
                json!({"role": "assistant", "content": format!("ACK_{text}")}),
                "stop",
            ),
        })
    }

    pub fn release(&self) {
        let (lock, cv) = &*self.release;
        if let Ok(mut g) = lock.lock() {
            *g = true;
        }
        cv.notify_all();
    }

    pub fn requests(&self) -> Vec<Value> {
        self.requests.lock().map(|r| r.clone()).unwrap_or_default()
    }

    /// Requests whose last user text is `text` and whose last message is not a tool result.
    pub fn reached(&self, text: &str) -> usize {
        self.requests()
            .iter()
            .filter(|b| last_user(b) == text && !after_tool(b))
            .count()
    }

    /// The `Authorization` header of each request, in order.
    pub fn authorizations(&self) -> Vec<Option<String>> {
        self.authorizations
            .lock()
            .map(|a| a.clone())
            .unwrap_or_default()
    }

    /// Last user texts of the requests, in order.
    pub fn texts(&self) -> Vec<String> {
        self.requests().iter().map(last_user).collect()
    }
}

impl Drop for FakeModel {
    fn drop(&mut self) {
        self.release();
    }
}

pub fn last_user(body: &Value) -> String {
    body["messages"]
        .as_array()
        .and_then(|m| m.iter().rev().find(|m| m["role"] == "user"))
        .and_then(|m| m["content"].as_str())
        .unwrap_or("")
        .to_string()
}

pub fn after_tool(body: &Value) -> bool {
    body["messages"]
        .as_array()
        .and_then(|m| m.last())
        .is_some_and(|m| m["role"] == "tool")
}

pub fn user_texts(body: &Value) -> Vec<String> {
    body["messages"]
        .as_array()
        .map(|m| {
            m.iter()
                .filter(|m| m["role"] == "user")
                .filter_map(|m| m["content"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// The roles of a request's messages after the system prompt, in order.
pub fn roles(body: &Value) -> Vec<String> {
    body["messages"]
        .as_array()
        .map(|m| {
            m.iter()
                .filter_map(|m| m["role"].as_str())
                .filter(|r| *r != "system")
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

pub fn tool_call(id: &str, name: &str, args: Value) -> Value {
    json!({"role": "assistant", "content": null, "tool_calls": [
        {"index": 0, "id": id, "type": "function", "function": {"name": name, "arguments": args.to_string()}}]})
}

/// Several tool calls in one assistant message: `(id, name, args)`, at indexes 0, 1, ….
pub fn tool_calls(calls: &[(&str, &str, Value)]) -> Value {
    let list: Vec<Value> = calls
        .iter()
        .enumerate()
        .map(|(i, (id, name, args))| {
            json!({"index": i, "id": id, "type": "function", "function": {"name": name, "arguments": args.to_string()}})
        })
        .collect();
    json!({"role": "assistant", "content": null, "tool_calls": list})
}

/// The content of the last message when it is a tool result.
pub fn last_tool_result(body: &Value) -> Option<String> {
    body["messages"]
        .as_array()
        .and_then(|m| m.last())
        .filter(|m| m["role"] == "tool")
        .and_then(|m| m["content"].as_str())
        .map(str::to_string)
}

/// Total characters of a request's messages.
pub fn wire_chars(body: &Value) -> usize {
    body["messages"]
        .as_array()
        .map(|m| m.iter().map(|m| m.to_string().len()).sum())
        .unwrap_or(0)
}

fn serve_one(
    mut stream: TcpStream,
    (reqs, auths): (&Mutex<Vec<Value>>, &Mutex<Vec<Option<String>>>),
    release: &(Mutex<bool>, Condvar),
    handler: &Handler,
) {
    let mut reader = BufReader::new(match stream.try_clone() {
        Ok(s) => s,
        Err(_) => return,
    });
    let mut length = 0usize;
    let mut authorization = None;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some(v) = l.to_ascii_lowercase().strip_prefix("content-length:") {
            length = v.trim().parse().unwrap_or(0);
        }
        if l.to_ascii_lowercase().starts_with("authorization:") {
            authorization = Some(l["authorization:".len()..].trim().to_string());
        }
    }
    let mut body = vec![0u8; length];
    if reader.read_exact(&mut body).is_err() {
        return;
    }
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    if let Ok(mut a) = auths.lock() {
        a.push(authorization);
    }
    if let Ok(mut r) = reqs.lock() {
        r.push(body.clone());
    }
    let stream_mode = body["stream"].as_bool().unwrap_or(false);
    let (status, kind, payload) = match handler(&body) {
        Reply::Message(message, finish) => {
            let mut frame = json!({"id": "fake", "model": body["model"], "choices": [{"index": 0, "finish_reason": finish}],
                                   "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}});
            if stream_mode {
                frame["choices"][0]["delta"] = message;
                (
                    200,
                    "text/event-stream",
                    format!("data: {frame}\n\ndata: [DONE]\n\n"),
                )
            } else {
                frame["choices"][0]["message"] = message;
                (200, "application/json", frame.to_string())
            }
        }
        Reply::Sse(events) => {
            let mut s = String::new();
            for e in events {
                s.push_str(&format!("data: {e}\n\n"));
            }
            s.push_str("data: [DONE]\n\n");
            (200, "text/event-stream", s)
        }
        Reply::Status(code, v) => (code, "application/json", v.to_string()),
        Reply::Hang => {
            let (lock, cv) = release;
            let deadline = Instant::now() + Duration::from_secs(120);
            let mut released = lock.lock().unwrap_or_else(|e| e.into_inner());
            while !*released && Instant::now() < deadline {
                released = cv
                    .wait_timeout(released, Duration::from_millis(100))
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
            return;
        }
    };
    let head = format!(
        "HTTP/1.1 {status} X\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        payload.len()
    );
    let _ = stream.write_all(head.as_bytes());
    let _ = stream.write_all(payload.as_bytes());
}

// ---------- daemon ----------

pub struct Daemon {
    pub child: Child,
    pub home: PathBuf,
    pub identify: Value,
}

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_gatehouse")
}

impl Daemon {
    pub fn start(home: &Home) -> Daemon {
        Self::start_with_env(home, &[])
    }

    /// A daemon on a fresh home whose config points at `model`, with `extra` merged in.
    pub fn with_model(model: &FakeModel, extra: Value) -> (Home, Daemon) {
        let home = Home::new();
        home.write_config(&config(&model.url, extra));
        let d = Daemon::start(&home);
        (home, d)
    }

    pub fn start_with_env(home: &Home, env: &[(&str, &str)]) -> Daemon {
        Self::start_with(home, |cmd| {
            for (k, v) in env {
                cmd.env(k, v);
            }
        })
    }

    /// Start with a last say over the command (environment, `pre_exec`, …).
    pub fn start_with(home: &Home, tweak: impl FnOnce(&mut Command)) -> Daemon {
        Self::start_program(home, Path::new(bin()), tweak)
    }

    /// [`Daemon::start_with`] of the binary at `program`.
    pub fn start_program(home: &Home, program: &Path, tweak: impl FnOnce(&mut Command)) -> Daemon {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(home.path.join("daemon.log"))
            .expect("log");
        let mut cmd = Command::new(program);
        cmd.arg("serve")
            .arg("--home")
            .arg(&home.path)
            .env_remove("OPENAI_BASE_URL")
            .env("OPENAI_API_KEY", "loopback-only")
            .env(
                "RUST_LOG",
                std::env::var("TEST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log);
        tweak(&mut cmd);
        let child = cmd.spawn().expect("spawn gatehouse");
        Self::when_ready(child, &home.path, || home.log())
    }

    /// The daemon `child`, serving `home`, once it says it is ready (within a minute); `log`
    /// gives what it wrote, for a failure.
    pub fn when_ready(mut child: Child, home: &Path, log: impl Fn() -> String) -> Daemon {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                panic!("gatehouse exited with {status} before ready:\n{}", log());
            }
            if let Ok(v) = control(home, "identify", json!({})) {
                if v["state"] == "ready" {
                    return Daemon {
                        child,
                        home: home.to_path_buf(),
                        identify: v,
                    };
                }
            }
            assert!(Instant::now() < deadline, "gatehouse not ready:\n{}", log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn epoch(&self) -> i64 {
        self.identify["authority_epoch"].as_i64().expect("epoch")
    }

    pub fn origin(&self) -> String {
        self.identify["api_origin"]
            .as_str()
            .expect("origin")
            .to_string()
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Send `signal`, not waiting for anything.
    pub fn signal(&self, signal: libc::c_int) {
        // SAFETY: sending a signal to our own child process.
        unsafe {
            libc::kill(self.child.id() as i32, signal);
        }
    }

    /// SIGTERM; returns the exit code.
    pub fn term(&mut self) -> Option<i32> {
        self.stop_with(libc::SIGTERM)
    }

    /// Send `signal` and wait for the exit (60 s at most); the exit code.
    pub fn stop_with(&mut self, signal: libc::c_int) -> Option<i32> {
        self.signal(signal);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.code();
            }
            assert!(
                Instant::now() < deadline,
                "gatehouse did not stop on signal {signal}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub async fn ws(&self) -> Ws {
        Ws::connect(&self.home, &self.origin()).await
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
    }
}

pub fn control(home: &Path, method: &str, params: Value) -> std::io::Result<Value> {
    let mut s = UnixStream::connect(home.join("gateway.sock"))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    s.write_all(format!("{}\n", json!({"method": method, "params": params})).as_bytes())?;
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line)?;
    serde_json::from_str(&line).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

pub fn ticket(home: &Path) -> String {
    control(home, "session-ticket", json!({"purpose": "interactive"})).expect("ticket")["ticket"]
        .as_str()
        .expect("ticket string")
        .to_string()
}

// ---------- WebSocket client ----------

type Framed = actix_codec::Framed<awc::BoxedSocket, awc::ws::Codec>;

pub struct Ws {
    framed: Framed,
    pub events: Vec<Value>,
    next_id: u64,
}

/// Try an upgrade with these subprotocols; the HTTP status on refusal.
pub async fn try_upgrade(origin: &str, protocols: &[String]) -> Result<(), u16> {
    let url = format!("{}/api/ws", origin.replacen("http", "ws", 1));
    let client = awc::Client::builder()
        .max_http_version(awc::http::Version::HTTP_11)
        .finish();
    match client.ws(url).protocols(protocols).connect().await {
        Ok(_) => Ok(()),
        Err(awc::error::WsClientError::InvalidResponseStatus(s)) => Err(s.as_u16()),
        Err(e) => panic!("upgrade failed oddly: {e}"),
    }
}

impl Ws {
    pub async fn connect(home: &Path, origin: &str) -> Ws {
        let t = ticket(home);
        let url = format!("{}/api/ws", origin.replacen("http", "ws", 1));
        let client = awc::Client::builder()
            .max_http_version(awc::http::Version::HTTP_11)
            .finish();
        let (resp, framed) = client
            .ws(url)
            .protocols(["gatehouse.v1".to_string(), format!("gatehouse-ticket.{t}")])
            .max_frame_size(64 << 20)
            .connect()
            .await
            .expect("websocket connect");
        assert_eq!(
            resp.headers()
                .get("sec-websocket-protocol")
                .and_then(|v| v.to_str().ok()),
            Some("gatehouse.v1")
        );
        Ws {
            framed,
            events: Vec::new(),
            next_id: 1,
        }
    }

    /// Wrap an already-upgraded connection (e.g. one made with a bearer key).
    pub fn from_framed(framed: Framed) -> Ws {
        Ws {
            framed,
            events: Vec::new(),
            next_id: 1,
        }
    }

    pub async fn send_raw(&mut self, text: String) {
        self.framed
            .send(awc::ws::Message::Text(text.into()))
            .await
            .expect("send");
    }

    pub async fn send_binary(&mut self, bytes: Vec<u8>) {
        self.framed
            .send(awc::ws::Message::Binary(bytes.into()))
            .await
            .expect("send");
    }

    /// The next non-event frame.
    pub async fn recv_reply(&mut self) -> Value {
        loop {
            let v = self
                .recv_any(Duration::from_secs(30))
                .await
                .expect("a reply frame");
            if v.get("method").is_some() && v.get("id").is_none() {
                self.events.push(v);
                continue;
            }
            return v;
        }
    }

    async fn recv_any(&mut self, timeout: Duration) -> Option<Value> {
        // One deadline for the whole wait: the server's pings must not restart it (a wait for
        // a frame that never comes answered each ping and waited again, for good).
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let frame = tokio::time::timeout_at(deadline, self.framed.next())
                .await
                .ok()??;
            match frame {
                Ok(awc::ws::Frame::Text(b)) => return serde_json::from_slice(&b).ok(),
                Ok(awc::ws::Frame::Ping(p)) => {
                    let _ = self.framed.send(awc::ws::Message::Pong(p)).await;
                }
                Ok(awc::ws::Frame::Close(_)) | Err(_) => return None,
                Ok(_) => {}
            }
        }
    }

    /// One call; the whole reply (result or error).
    pub async fn call(&mut self, method: &str, params: Value) -> Value {
        let id = format!("t{}", self.next_id);
        self.next_id += 1;
        self.send_raw(
            json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}).to_string(),
        )
        .await;
        loop {
            let v = self.recv_reply().await;
            if v["id"] == json!(id) {
                return v;
            }
        }
    }

    /// One call that must succeed.
    pub async fn ok(&mut self, method: &str, params: Value) -> Value {
        let v = self.call(method, params).await;
        assert!(v.get("result").is_some(), "{method} failed: {v}");
        v["result"].clone()
    }

    /// One call that must fail with `reason`.
    pub async fn refused(&mut self, method: &str, params: Value, reason: &str) -> Value {
        let v = self.call(method, params).await;
        assert_eq!(v["error"]["data"]["reason"], reason, "{method}: {v}");
        v
    }

    /// Wait for an event matching `pred` (already received ones count).
    pub async fn event(&mut self, timeout: Duration, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(pos) = self.events.iter().position(|e| pred(&e["params"])) {
                return self.events.remove(pos)["params"].clone();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "no matching event; saw {:?}", self.events);
            if let Some(v) = self.recv_any(left).await {
                if v.get("method").is_some() && v.get("id").is_none() {
                    self.events.push(v);
                }
            }
        }
    }

    pub async fn create(&mut self, request_id: &str, cwd: &Path, extra: Value) -> Value {
        let mut params = json!({"request_id": request_id, "cwd": cwd.to_string_lossy()});
        merge(&mut params, extra);
        self.ok("session.create", params).await
    }

    /// Create a session without tools; its id.
    pub async fn toolless(&mut self, request_id: &str, cwd: &Path) -> String {
        self.create(request_id, cwd, json!({"toolsets": []})).await["session_id"]
            .as_str()
            .expect("session id")
            .to_string()
    }

    /// Create a session with default params; its id.
    pub async fn session(&mut self, request_id: &str, cwd: &Path) -> String {
        self.create(request_id, cwd, json!({})).await["session_id"]
            .as_str()
            .expect("session id")
            .to_string()
    }

    pub async fn submit(&mut self, session: &str, input_id: &str, text: &str) -> Value {
        self.ok(
            "prompt.submit",
            json!({"session_id": session, "input_id": input_id, "text": text}),
        )
        .await
    }

    /// Poll `session.resume` until an open prompt of `kind` shows.
    /// The page of `session`'s logged events after seq `after` (`session.events.since`).
    pub async fn events_after(&mut self, session: &str, after: i64) -> Vec<Value> {
        let page = self
            .ok(
                "session.events.since",
                json!({"session_id": session, "last_sequence": after}),
            )
            .await;
        page["events"].as_array().cloned().unwrap_or_default()
    }

    pub async fn wait_prompt(&mut self, session: &str, kind: &str) -> Value {
        let snap = self
            .resume_when(session, &format!("a {kind} prompt"), |snap| {
                snap["prompts"]
                    .as_array()
                    .is_some_and(|a| a.iter().any(|p| p["kind"] == kind))
            })
            .await;
        snap["prompts"]
            .as_array()
            .and_then(|a| a.iter().find(|p| p["kind"] == kind))
            .cloned()
            .unwrap_or_default()
    }

    /// Poll `session.resume` until its snapshot satisfies `pred` (30 s at most); the snapshot.
    pub async fn resume_when(
        &mut self,
        session: &str,
        what: &str,
        pred: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let snap = self
                .ok("session.resume", json!({"session_id": session}))
                .await;
            if pred(&snap) {
                return snap;
            }
            assert!(Instant::now() < deadline, "no {what}: {snap}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Poll a condition until it holds.
pub async fn wait_until(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The one admission whose outcome is unknown, and the operator command that settles it.
pub fn unknown_admission(home: &Home) -> (AdmissionRow, String) {
    let row = home
        .admissions()
        .into_iter()
        .find(|a| a.status == "unknown")
        .expect("an unknown admission");
    let command = format!(
        "gatehouse resolve-unknown {} {}",
        row.target_session_id, row.admission_id
    );
    (row, command)
}

/// All admissions terminal?
pub fn all_terminal(home: &Home) -> bool {
    home.admissions().iter().all(|r| r.status == "terminal")
}

/// GET `url`: its status and body.
pub async fn http_get(url: &str) -> (u16, String) {
    let client = awc::Client::builder()
        .timeout(Duration::from_secs(10))
        .finish();
    match client.get(url).send().await {
        Ok(mut resp) => {
            let body = resp
                .body()
                .limit(1 << 20)
                .await
                .map(|b| String::from_utf8_lossy(&b).to_string())
                .unwrap_or_default();
            (resp.status().as_u16(), body)
        }
        Err(e) => panic!("GET {url}: {e}"),
    }
}

/// One sample of the daemon's `/metrics`.
pub async fn metric(origin: &str, name: &str) -> f64 {
    let mut resp = awc::Client::new()
        .get(format!("{origin}/metrics"))
        .send()
        .await
        .expect("metrics");
    let body = resp.body().await.expect("metrics body");
    String::from_utf8_lossy(&body)
        .lines()
        .find_map(|l| {
            l.strip_prefix(name)
                .filter(|rest| rest.starts_with(' '))
                .and_then(|rest| rest.trim().parse().ok())
        })
        .unwrap_or_else(|| panic!("no metric {name}"))
}

/// A WebSocket connection as the principal of API key `key` (a ticket connection is the local
/// user's).
pub async fn keyed_ws(d: &Daemon, key: &str) -> Ws {
    let url = format!("{}/api/ws", d.origin().replacen("http", "ws", 1));
    let (_, framed) = awc::Client::builder()
        .max_http_version(awc::http::Version::HTTP_11)
        .finish()
        .ws(url)
        .protocols(["gatehouse.v1"])
        .bearer_auth(key)
        .max_frame_size(64 << 20)
        .connect()
        .await
        .expect("bearer connect");
    Ws::from_framed(framed)
}

/// A child process killed (and reaped) when dropped, so a test that fails midway leaves no
/// daemon behind.
pub struct Reaped(pub Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
