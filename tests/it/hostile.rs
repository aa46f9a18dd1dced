//! Hostile input, table-driven: every malformed or unauthorised request over the WebSocket, the
//! upgrade and the control socket gets a typed error, the daemon stays up, and a normal request
//! succeeds right after each case.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::helpers::*;

// ---------- a raw WebSocket client (for frames a well-behaved client cannot send) ----------

pub struct RawWs {
    stream: TcpStream,
    /// Reads give up past it (pings would keep a live connection's reads from timing out).
    deadline: Option<std::time::Instant>,
}

pub struct Upgrade {
    pub status: u16,
    /// The response's head (status line and headers).
    pub head: String,
    pub body: String,
    pub stream: TcpStream,
}

fn host_port(origin: &str) -> String {
    origin.trim_start_matches("http://").to_string()
}

/// An HTTP upgrade with these subprotocols (and extra headers); the status, body and stream.
pub fn raw_upgrade(origin: &str, protocols: &[String], headers: &[(&str, &str)]) -> Upgrade {
    let addr = host_port(origin);
    let mut stream = TcpStream::connect(&addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    let mut req = format!(
        "GET /api/ws HTTP/1.1\r\nHost: {addr}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
    );
    if !protocols.is_empty() {
        req.push_str(&format!(
            "Sec-WebSocket-Protocol: {}\r\n",
            protocols.join(", ")
        ));
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    stream.write_all(req.as_bytes()).expect("write upgrade");
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let n = stream.read(&mut byte).expect("read head");
        assert!(n == 1, "connection closed during the upgrade");
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).to_string();
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status");
    let mut body = String::new();
    if status != 101 {
        let len = head
            .lines()
            .find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("content-length:")
                    .and_then(|v| v.trim().parse::<usize>().ok())
            })
            .unwrap_or(0);
        let mut buf = vec![0u8; len];
        stream.read_exact(&mut buf).expect("body");
        body = String::from_utf8_lossy(&buf).to_string();
    }
    Upgrade {
        status,
        head,
        body,
        stream,
    }
}

impl RawWs {
    /// The WebSocket an accepted (101) upgrade opened.
    pub fn from_upgrade(up: Upgrade) -> RawWs {
        assert_eq!(up.status, 101, "{}", up.body);
        RawWs {
            stream: up.stream,
            deadline: None,
        }
    }

    pub fn connect(home: &Path, origin: &str) -> RawWs {
        let t = ticket(home);
        let up = raw_upgrade(
            origin,
            &["gatehouse.v1".to_string(), format!("gatehouse-ticket.{t}")],
            &[],
        );
        RawWs::from_upgrade(up)
    }

    /// Send one frame (client frames are masked).
    pub fn frame(&mut self, fin: bool, opcode: u8, payload: &[u8]) {
        let out = Self::masked(fin, opcode, payload);
        let _ = self.stream.write_all(&out);
    }

    /// A final text frame's bytes, to send several in one write.
    pub fn masked_text(payload: &[u8]) -> Vec<u8> {
        Self::masked(true, 0x1, payload)
    }

    pub fn write_all(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).expect("write");
    }

    fn masked(fin: bool, opcode: u8, payload: &[u8]) -> Vec<u8> {
        let mut out = vec![if fin { 0x80 } else { 0 } | opcode];
        let len = payload.len();
        if len < 126 {
            out.push(0x80 | len as u8);
        } else if len <= 0xffff {
            out.push(0x80 | 126);
            out.extend_from_slice(&(len as u16).to_be_bytes());
        } else {
            out.push(0x80 | 127);
            out.extend_from_slice(&(len as u64).to_be_bytes());
        }
        let mask = [0x11u8, 0x22, 0x33, 0x44];
        out.extend_from_slice(&mask);
        out.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
        out
    }

    pub fn text(&mut self, payload: &[u8]) {
        self.frame(true, 0x1, payload);
    }

    /// The next data or close frame: `(opcode, payload)`; `None` at EOF.
    pub fn read(&mut self) -> Option<(u8, Vec<u8>)> {
        loop {
            if self.deadline.is_some_and(|d| std::time::Instant::now() > d) {
                return None;
            }
            let mut h = [0u8; 2];
            self.stream.read_exact(&mut h).ok()?;
            let opcode = h[0] & 0x0f;
            let mut len = (h[1] & 0x7f) as u64;
            if len == 126 {
                let mut b = [0u8; 2];
                self.stream.read_exact(&mut b).ok()?;
                len = u16::from_be_bytes(b) as u64;
            } else if len == 127 {
                let mut b = [0u8; 8];
                self.stream.read_exact(&mut b).ok()?;
                len = u64::from_be_bytes(b);
            }
            let mut payload = vec![0u8; len as usize];
            self.stream.read_exact(&mut payload).ok()?;
            match opcode {
                0x9 => self.frame(true, 0xA, &payload),
                0xA => {}
                _ => return Some((opcode, payload)),
            }
        }
    }

    /// The next JSON reply (events skipped).
    pub fn reply(&mut self) -> Value {
        loop {
            let (op, payload) = self.read().expect("a frame");
            assert_eq!(op, 0x1, "a text frame, got opcode {op}");
            let v: Value = serde_json::from_slice(&payload).expect("json");
            if v.get("method").is_some() && v.get("id").is_none() {
                continue;
            }
            return v;
        }
    }

    /// [`RawWs::close_code`], failing if no close comes within `limit` (pings keep a live
    /// connection's reads from ever timing out).
    pub fn close_code_within(&mut self, limit: Duration) -> Option<(u16, String)> {
        self.deadline = Some(std::time::Instant::now() + limit);
        let close = self.close_code();
        self.deadline = None;
        close
    }

    /// The close frame's code and reason, or `None` if the stream just ended.
    pub fn close_code(&mut self) -> Option<(u16, String)> {
        loop {
            let (op, payload) = self.read()?;
            if op == 0x8 {
                return Some(close_of(&payload));
            }
        }
    }
}

/// A close frame's code and reason.
fn close_of(payload: &[u8]) -> (u16, String) {
    let code = payload
        .get(..2)
        .map(|b| u16::from_be_bytes([b[0], b[1]]))
        .unwrap_or(1005);
    let reason = String::from_utf8_lossy(payload.get(2..).unwrap_or(&[])).to_string();
    (code, reason)
}

fn sha256_hex(s: &str) -> String {
    Sha256::digest(s.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// `(name, frame, expected code, expected reason, expected reply id)`.
type FrameCase = (&'static str, String, i64, &'static str, Value);

fn frame_cases(sid: &str) -> Vec<FrameCase> {
    let resume = |params: Value| {
        json!({"jsonrpc": "2.0", "id": 9, "method": "session.resume", "params": params}).to_string()
    };
    let submit = |params: Value| {
        json!({"jsonrpc": "2.0", "id": 10, "method": "prompt.submit", "params": params}).to_string()
    };
    let create = |params: Value| {
        json!({"jsonrpc": "2.0", "id": 11, "method": "session.create", "params": params})
            .to_string()
    };
    let nested = format!(
        r#"{{"jsonrpc":"2.0","id":12,"method":"session.resume","params":{{"session_id":{}1{}}}}}"#,
        "[".repeat(400),
        "]".repeat(400)
    );
    vec![
        (
            "invalid_json",
            "{not json".into(),
            -32700,
            "parse_error",
            Value::Null,
        ),
        (
            "empty_frame",
            String::new(),
            -32700,
            "parse_error",
            Value::Null,
        ),
        (
            "truncated_json",
            r#"{"jsonrpc":"2.0","id":1,"method":"#.into(),
            -32700,
            "parse_error",
            Value::Null,
        ),
        (
            "lone_surrogate",
            r#"{"jsonrpc":"2.0","id":1,"method":"\ud800"}"#.into(),
            -32700,
            "parse_error",
            Value::Null,
        ),
        ("deep_nesting", nested, -32700, "parse_error", Value::Null),
        (
            "wrong_jsonrpc_version",
            json!({"jsonrpc": "1.0", "id": 2, "method": "session.resume"}).to_string(),
            -32600,
            "invalid_request",
            json!(2),
        ),
        (
            "jsonrpc_as_number",
            json!({"jsonrpc": 2.0, "id": 3, "method": "session.resume"}).to_string(),
            -32600,
            "invalid_request",
            json!(3),
        ),
        (
            "missing_jsonrpc",
            json!({"id": 4, "method": "session.resume"}).to_string(),
            -32600,
            "invalid_request",
            json!(4),
        ),
        (
            "batch_array",
            json!([{"jsonrpc": "2.0", "id": 5, "method": "session.resume"}]).to_string(),
            -32600,
            "invalid_request",
            Value::Null,
        ),
        (
            "empty_batch",
            "[]".into(),
            -32600,
            "invalid_request",
            Value::Null,
        ),
        (
            "bare_number",
            "42".into(),
            -32600,
            "invalid_request",
            Value::Null,
        ),
        (
            "bare_string",
            "\"hello\"".into(),
            -32600,
            "invalid_request",
            Value::Null,
        ),
        (
            "bare_null",
            "null".into(),
            -32600,
            "invalid_request",
            Value::Null,
        ),
        (
            "missing_method",
            json!({"jsonrpc": "2.0", "id": 6}).to_string(),
            -32600,
            "invalid_request",
            json!(6),
        ),
        (
            "method_not_a_string",
            json!({"jsonrpc": "2.0", "id": 7, "method": 17}).to_string(),
            -32600,
            "invalid_request",
            json!(7),
        ),
        (
            "id_bool",
            json!({"jsonrpc": "2.0", "id": true, "method": "x"}).to_string(),
            -32600,
            "invalid_request",
            Value::Null,
        ),
        (
            "id_array",
            json!({"jsonrpc": "2.0", "id": [1], "method": "x"}).to_string(),
            -32600,
            "invalid_request",
            Value::Null,
        ),
        (
            "id_object",
            json!({"jsonrpc": "2.0", "id": {"a": 1}, "method": "x"}).to_string(),
            -32600,
            "invalid_request",
            Value::Null,
        ),
        (
            "params_array",
            json!({"jsonrpc": "2.0", "id": 8, "method": "session.resume", "params": [sid]})
                .to_string(),
            -32602,
            "invalid_params",
            json!(8),
        ),
        (
            "params_string",
            json!({"jsonrpc": "2.0", "id": 8, "method": "session.resume", "params": "x"})
                .to_string(),
            -32602,
            "invalid_params",
            json!(8),
        ),
        (
            "unknown_method",
            json!({"jsonrpc": "2.0", "id": "u", "method": "session.explode"}).to_string(),
            -32601,
            "unknown_method",
            json!("u"),
        ),
        (
            "huge_method_name",
            json!({"jsonrpc": "2.0", "id": "m", "method": "x".repeat(20_000)}).to_string(),
            -32601,
            "unknown_method",
            json!("m"),
        ),
        (
            "missing_param",
            resume(json!({})),
            -32602,
            "invalid_params",
            json!(9),
        ),
        (
            "extra_param",
            resume(json!({"session_id": sid, "admin": true})),
            -32602,
            "invalid_params",
            json!(9),
        ),
        (
            "ill_typed_param",
            resume(json!({"session_id": 7})),
            -32602,
            "invalid_params",
            json!(9),
        ),
        (
            "null_param",
            resume(json!({"session_id": null})),
            -32602,
            "invalid_params",
            json!(9),
        ),
        (
            "unknown_session",
            resume(json!({"session_id": "local-nope"})),
            4001,
            "not_found",
            json!(9),
        ),
        (
            "text_over_limit",
            submit(json!({"session_id": sid, "input_id": "big", "text": "x".repeat(5000)})),
            4001,
            "payload_too_large",
            json!(10),
        ),
        (
            "empty_input_id",
            submit(json!({"session_id": sid, "input_id": "", "text": "x"})),
            -32602,
            "invalid_params",
            json!(10),
        ),
        (
            "huge_input_id",
            submit(json!({"session_id": sid, "input_id": "i".repeat(2000), "text": "x"})),
            -32602,
            "invalid_params",
            json!(10),
        ),
        (
            "text_ill_typed",
            submit(json!({"session_id": sid, "input_id": "i", "text": {"nested": [1, 2]}})),
            -32602,
            "invalid_params",
            json!(10),
        ),
        (
            "toolsets_ill_typed",
            create(json!({"request_id": "h", "toolsets": "terminal"})),
            -32602,
            "invalid_params",
            json!(11),
        ),
        (
            "unknown_toolset",
            create(json!({"request_id": "h", "toolsets": ["rocket"]})),
            -32602,
            "invalid_params",
            json!(11),
        ),
        (
            "unknown_source",
            create(json!({"request_id": "h", "source": "satellite"})),
            -32602,
            "invalid_params",
            json!(11),
        ),
        (
            "room_source",
            create(json!({"request_id": "h", "source": "bot_room"})),
            -32602,
            "invalid_params",
            json!(11),
        ),
        (
            "cwd_relative",
            create(json!({"request_id": "h", "cwd": "relative/dir"})),
            -32602,
            "invalid_params",
            json!(11),
        ),
        (
            "cwd_missing_dir",
            create(json!({"request_id": "h", "cwd": "/no/such/dir/anywhere"})),
            -32602,
            "invalid_params",
            json!(11),
        ),
        (
            "base_url_with_credentials",
            create(json!({"request_id": "h", "base_url": "http://u:p@127.0.0.1:1/v1"})),
            -32602,
            "invalid_params",
            json!(11),
        ),
        (
            "model_empty",
            create(json!({"request_id": "h", "model": ""})),
            -32602,
            "invalid_params",
            json!(11),
        ),
        (
            "provider_blank",
            create(json!({"request_id": "h", "provider": "  "})),
            -32602,
            "invalid_params",
            json!(11),
        ),
        (
            "id_past_64_bits",
            r#"{"jsonrpc":"2.0","id":100000000000000000000000,"method":"session.resume"}"#.into(),
            -32600,
            "invalid_request",
            Value::Null,
        ),
        (
            "request_id_too_long",
            create(json!({"request_id": "r".repeat(2000)})),
            -32602,
            "invalid_params",
            json!(11),
        ),
        (
            "frame_over_limit",
            json!({"jsonrpc": "2.0", "id": 13, "method": "x", "pad": "p".repeat(40_000)})
                .to_string(),
            4001,
            "payload_too_large",
            json!(13),
        ),
    ]
}

async fn normal_request(ws: &mut Ws, sid: &str) {
    let snap = ws.ok("session.resume", json!({"session_id": sid})).await;
    assert_eq!(snap["session_id"], sid);
}

#[actix_rt::test]
async fn hostile_frames_get_typed_errors_and_the_connection_keeps_serving() {
    let model = FakeModel::ack();
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({"gateway": {"max_frame_bytes": 32768}, "session": {"max_text_bytes": 4096}}),
    ));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.session("hostile", &home.path).await;
    for (name, frame, code, reason, id) in frame_cases(&sid) {
        ws.send_raw(frame).await;
        let v = ws.recv_reply().await;
        assert_eq!(v["jsonrpc"], "2.0", "{name}: {v}");
        assert_eq!(v["error"]["code"], code, "{name}: {v}");
        assert_eq!(v["error"]["data"]["reason"], reason, "{name}: {v}");
        assert_eq!(v["id"], id, "{name}: {v}");
        assert!(v.get("result").is_none(), "{name}: {v}");
        normal_request(&mut ws, &sid).await;
    }
    // Ids of every JSON type a request may use come back unchanged.
    for id in [
        json!("s"),
        json!(""),
        json!(0),
        json!(-7),
        json!(1.5),
        json!(9_007_199_254_740_993u64),
        Value::Null,
    ] {
        ws.send_raw(
            json!({"jsonrpc": "2.0", "id": id, "method": "session.resume", "params": {"session_id": sid}})
                .to_string(),
        )
        .await;
        let v = ws.recv_reply().await;
        assert_eq!(v["id"], id, "id {id}: {v}");
        assert_eq!(v["result"]["session_id"], sid, "id {id}: {v}");
    }
    // A notification (no id) gets no reply, even when it fails: the next reply is the next call's.
    ws.send_raw(json!({"jsonrpc": "2.0", "method": "no.such.method"}).to_string())
        .await;
    // Its params refused too (a list is a JSON-RPC request's other form of params).
    ws.send_raw(json!({"jsonrpc": "2.0", "method": "session.resume", "params": [sid]}).to_string())
        .await;
    ws.send_raw(
        json!({"jsonrpc": "2.0", "method": "session.resume", "params": {"session_id": sid}})
            .to_string(),
    )
    .await;
    ws.send_raw(
        json!({"jsonrpc": "2.0", "id": "n1", "method": "session.resume", "params": {"session_id": sid}})
            .to_string(),
    )
    .await;
    let v = ws.recv_reply().await;
    assert_eq!(
        v["id"], "n1",
        "the first reply after the notifications: {v}"
    );
    // Binary frames are refused in-band.
    ws.send_binary(b"\x00\x01binary".to_vec()).await;
    let v = ws.recv_reply().await;
    assert_eq!(
        (
            v["error"]["code"].clone(),
            v["error"]["data"]["reason"].clone()
        ),
        (json!(-32600), json!("invalid_request"))
    );
    normal_request(&mut ws, &sid).await;
    assert!(
        home.admissions().is_empty(),
        "no hostile frame admitted anything"
    );
    assert_eq!(model.requests().len(), 0);
}

#[actix_rt::test]
async fn hostile_raw_frames_close_or_refuse_and_the_daemon_keeps_serving() {
    let model = FakeModel::ack();
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({"gateway": {"max_frame_bytes": 4096}}),
    ));
    let d = Daemon::start(&home);
    let origin = d.origin();
    let mut ws = d.ws().await;
    let sid = ws.session("raw", &home.path).await;

    // non_utf8_text_frame: the connection is closed as invalid payload (1007), not the daemon.
    let mut raw = RawWs::connect(&home.path, &origin);
    raw.text(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"\xff\xfe\"}");
    let (code, reason) = raw
        .close_code()
        .expect("non_utf8_text_frame: a close frame");
    assert_eq!(code, 1007, "non_utf8_text_frame: {reason}");
    normal_request(&mut ws, &sid).await;

    // fragmented_message: reassembled and answered like one frame.
    let mut raw = RawWs::connect(&home.path, &origin);
    let msg =
        json!({"jsonrpc": "2.0", "id": "frag", "method": "session.resume", "params": {"session_id": sid}})
            .to_string();
    let (a, b) = msg.as_bytes().split_at(10);
    raw.frame(false, 0x1, a);
    raw.frame(true, 0x0, b);
    let v = raw.reply();
    assert_eq!(v["id"], "frag");
    assert_eq!(v["result"]["session_id"], sid, "{v}");

    // fragmented_over_limit: the pieces together exceed the limit → payload_too_large in-band,
    // answering the id the part received names (none here, then one).
    let chunk = vec![b' '; 3000];
    raw.frame(false, 0x1, b"{");
    raw.frame(false, 0x0, &chunk);
    raw.frame(true, 0x0, &chunk);
    let v = raw.reply();
    assert_eq!(
        v["error"]["data"]["reason"], "payload_too_large",
        "fragmented_over_limit: {v}"
    );
    assert_eq!(v["id"], Value::Null, "fragmented_over_limit: {v}");
    let pad = vec![b'a'; 3000];
    raw.frame(
        false,
        0x1,
        br#"{"jsonrpc":"2.0","id":"big","method":"m","params":{"text":""#,
    );
    raw.frame(false, 0x0, &pad);
    raw.frame(false, 0x0, &pad);
    raw.frame(true, 0x0, br#""}}"#);
    let v = raw.reply();
    assert_eq!(
        (&v["id"], &v["error"]["data"]["reason"]),
        (&json!("big"), &json!("payload_too_large")),
        "fragmented_over_limit: {v}"
    );
    raw.text(msg.as_bytes());
    assert_eq!(raw.reply()["id"], "frag", "still serving after fragments");

    // fragmented_binary: a binary message is refused however it is framed; its fragments are
    // never run as a request (they were reassembled and run: a session was created).
    let create = json!({"jsonrpc": "2.0", "id": "bin", "method": "session.create",
                        "params": {"request_id": "binary-fragments", "cwd": home.path.to_string_lossy()}})
    .to_string();
    let (a, b) = create.as_bytes().split_at(10);
    raw.frame(false, 0x2, a);
    raw.frame(true, 0x0, b);
    let v = raw.reply();
    assert_eq!(v["error"]["code"], -32600, "fragmented_binary: {v}");
    assert!(v["error"]["message"].to_string().contains("binary"), "{v}");
    raw.text(msg.as_bytes());
    assert_eq!(
        raw.reply()["id"],
        "frag",
        "still serving after a binary message"
    );
    let sessions: i64 = {
        use diesel::prelude::*;
        use gatehouse::store::schema::sessions;
        sessions::table
            .count()
            .get_result(&mut home.db())
            .expect("count")
    };
    assert_eq!(sessions, 1, "the binary message created a session");

    // fragmented_non_utf8: reassembled bytes that are not UTF-8 → parse error in-band.
    raw.frame(false, 0x1, b"{\"a\":\"\xff");
    raw.frame(true, 0x0, b"\"}");
    let v = raw.reply();
    assert_eq!(v["error"]["code"], -32700, "fragmented_non_utf8: {v}");
    raw.text(msg.as_bytes());
    assert_eq!(raw.reply()["id"], "frag");

    // frame_over_codec_limit: a single frame far over the limit closes the connection (1009).
    let mut raw = RawWs::connect(&home.path, &origin);
    raw.text(&vec![b'x'; 100 * 1024]);
    let (code, _) = raw
        .close_code()
        .expect("frame_over_codec_limit: a close frame");
    assert_eq!(code, 1009, "frame_over_codec_limit");
    normal_request(&mut ws, &sid).await;

    // reserved_opcode: a protocol error closes that connection only (1002).
    let mut raw = RawWs::connect(&home.path, &origin);
    raw.frame(true, 0x3, b"??");
    let closed = raw.close_code_within(Duration::from_secs(5));
    assert_eq!(
        closed.as_ref().map(|(code, _)| *code),
        Some(1002),
        "reserved_opcode: {closed:?}"
    );
    normal_request(&mut ws, &sid).await;
    assert!(home.admissions().is_empty());
}

#[actix_rt::test]
async fn hostile_upgrades_are_refused_before_the_websocket() {
    let model = FakeModel::ack();
    let home = Home::new();
    let key = "test-key-123";
    home.write_config(&config(
        &model.url,
        json!({"gateway": {"ticket_ttl_seconds": 3, "api_keys": [sha256_hex(key)]}}),
    ));
    let mut d = Daemon::start(&home);
    let origin = d.origin();
    let refused = |name: &str, up: Upgrade, status: u16, reason: &str| {
        assert_eq!(up.status, status, "{name}: {}", up.body);
        let body: Value = serde_json::from_str(&up.body).unwrap_or(Value::Null);
        assert_eq!(body["error"]["reason"], reason, "{name}: {}", up.body);
    };
    let p = |t: &str| vec!["gatehouse.v1".to_string(), format!("gatehouse-ticket.{t}")];
    refused(
        "ticket_missing",
        raw_upgrade(&origin, &["gatehouse.v1".into()], &[]),
        401,
        "permission_denied",
    );
    // No credential at all, nor any subprotocol: refused as unauthenticated (it was a 400).
    refused(
        "no_credential_no_subprotocol",
        raw_upgrade(&origin, &[], &[]),
        401,
        "permission_denied",
    );
    refused(
        "ticket_unknown",
        raw_upgrade(&origin, &p("bogus"), &[]),
        401,
        "permission_denied",
    );
    refused(
        "ticket_empty",
        raw_upgrade(&origin, &p(""), &[]),
        401,
        "permission_denied",
    );
    refused(
        "bearer_wrong_key",
        raw_upgrade(
            &origin,
            &["gatehouse.v1".into()],
            &[("Authorization", "Bearer not-the-key")],
        ),
        401,
        "permission_denied",
    );
    let t = ticket(&home.path);
    assert_eq!(raw_upgrade(&origin, &p(&t), &[]).status, 101);
    let reused = raw_upgrade(&origin, &p(&t), &[]);
    // In words (it read `ticket refused: Unknown`).
    assert!(
        reused.body.contains("unknown or already used"),
        "{}",
        reused.body
    );
    refused("ticket_reused", reused, 401, "permission_denied");
    let t = ticket(&home.path);
    refused(
        "subprotocol_missing",
        raw_upgrade(&origin, &[format!("gatehouse-ticket.{t}")], &[]),
        400,
        "invalid_request",
    );
    // A request refused before the ticket is looked at leaves it unspent: the retry gets in.
    assert_eq!(raw_upgrade(&origin, &p(&t), &[]).status, 101);
    // The subprotocols on two header lines (RFC 6455 allows it): the answer names ours, as
    // when they come on one (the handshake read the first line only, and answered none).
    for split in [true, false] {
        let t = ticket(&home.path);
        let up = if split {
            raw_upgrade(
                &origin,
                &[format!("gatehouse-ticket.{t}")],
                &[("Sec-WebSocket-Protocol", "gatehouse.v1")],
            )
        } else {
            raw_upgrade(&origin, &p(&t), &[])
        };
        assert_eq!(up.status, 101, "{}", up.body);
        assert!(
            up.head
                .to_ascii_lowercase()
                .contains("\r\nsec-websocket-protocol: gatehouse.v1\r\n"),
            "split {split}: {}",
            up.head
        );
    }
    let t = ticket(&home.path);
    // The only wait: the ticket's own lifetime (3 s, which every ticket here that gets in
    // must be redeemed within, on a loaded machine too).
    tokio::time::sleep(Duration::from_millis(3500)).await;
    refused(
        "ticket_expired",
        raw_upgrade(&origin, &p(&t), &[]),
        401,
        "permission_denied",
    );
    // ticket_for_another_instance: minted by this instance, offered to the next one.
    let t = ticket(&home.path);
    let old_instance = d.identify["instance_id"].clone();
    d.kill();
    let d2 = Daemon::start(&home);
    assert_ne!(d2.identify["instance_id"], old_instance);
    refused(
        "ticket_for_another_instance",
        raw_upgrade(&d2.origin(), &p(&t), &[]),
        401,
        "permission_denied",
    );
    // A bearer key works and is another principal.
    let up = raw_upgrade(
        &d2.origin(),
        &["gatehouse.v1".into()],
        &[("Authorization", &format!("Bearer {key}"))],
    );
    assert_eq!(up.status, 101, "bearer_key_accepted: {}", up.body);
    // After all that, a normal client connects and works.
    let mut ws = d2.ws().await;
    let sid = ws.session("after", &home.path).await;
    normal_request(&mut ws, &sid).await;
}

#[actix_rt::test]
async fn access_control_is_per_connection_and_per_principal() {
    let home = Home::new();
    let victim = home.path.join("victim");
    std::fs::create_dir_all(victim.join("inside")).expect("victim");
    let cmd = format!("rm -rf -- {}", victim.display());
    let model = FakeModel::start(move |body| {
        if after_tool(body) {
            Reply::Message(json!({"role": "assistant", "content": "done"}), "stop")
        } else {
            Reply::Message(
                tool_call("c1", "terminal", json!({"command": cmd})),
                "tool_calls",
            )
        }
    });
    let key = "principal-two";
    let inside = home.path.join("work");
    let outside = std::env::temp_dir();
    std::fs::create_dir_all(inside.join("sub")).expect("work dir");
    std::os::unix::fs::symlink(&outside, inside.join("escape")).expect("symlink");
    home.write_config(&config(
        &model.url,
        json!({"gateway": {"api_keys": [sha256_hex(key)], "allowed_cwd_roots": [inside]}}),
    ));
    let d = Daemon::start(&home);
    let mut owner = d.ws().await;
    // cwd outside the allowed roots, by path, by `..` and by symlink.
    let esc = |p: &Path| p.to_string_lossy().to_string();
    for (name, cwd, reason) in [
        ("cwd_outside_roots", esc(&outside), "permission_denied"),
        (
            "cwd_dotdot_escape",
            format!("{}/sub/../..", inside.display()),
            "permission_denied",
        ),
        (
            "cwd_symlink_escape",
            esc(&inside.join("escape")),
            "permission_denied",
        ),
        ("cwd_not_absolute", "work/sub".to_string(), "invalid_params"),
        // Outside, that a path does not exist is not told; inside, it is.
        (
            "cwd_outside_missing",
            esc(&outside.join("no-such-dir-here")),
            "permission_denied",
        ),
        (
            "cwd_inside_missing",
            esc(&inside.join("no-such-dir-here")),
            "invalid_params",
        ),
    ] {
        owner
            .refused(
                "session.create",
                json!({"request_id": name, "cwd": cwd}),
                reason,
            )
            .await;
    }
    let sid = owner.session("acl", &inside.join("sub")).await;
    let r = owner.submit(&sid, "RM", "RM").await;
    let p = owner.wait_prompt(&sid, "approval").await;
    let gen = p["execution_generation"].clone();
    // A second connection of the same principal that never resumed the session.
    let mut other = d.ws().await;
    for (name, method, params) in [
        (
            "answer_foreign_prompt",
            "approval.respond",
            json!({"session_id": sid, "execution_generation": gen, "prompt_id": p["prompt_id"], "choice": "once"}),
        ),
        (
            "clarify_foreign_prompt",
            "clarify.respond",
            json!({"session_id": sid, "execution_generation": gen, "prompt_id": p["prompt_id"], "answer": "yes"}),
        ),
        (
            "submit_unresumed",
            "prompt.submit",
            json!({"session_id": sid, "input_id": "x", "text": "x"}),
        ),
        (
            "receipt_unresumed",
            "prompt.receipt",
            json!({"session_id": sid, "admission_id": r["admission_id"]}),
        ),
        (
            "cancel_unresumed",
            "prompt.cancel",
            json!({"session_id": sid, "admission_id": r["admission_id"]}),
        ),
        (
            "interrupt_unresumed",
            "session.interrupt",
            json!({"session_id": sid, "execution_generation": gen}),
        ),
        (
            "resolve_unresumed",
            "prompt.resolve_unknown",
            json!({"session_id": sid, "admission_id": r["admission_id"], "execution_generation": gen}),
        ),
    ] {
        let v = other.call(method, params).await;
        assert_eq!(v["error"]["code"], 4001, "{name}: {v}");
        assert_eq!(
            v["error"]["data"]["reason"], "permission_denied",
            "{name}: {v}"
        );
        // The owner's connection keeps working, and the prompt is still open.
        normal_request(&mut owner, &sid).await;
    }
    assert!(victim.exists(), "no foreign answer ran the command");
    // Another principal (an API key) may not even resume it, nor learn that it exists: it is
    // not found, as a session that does not exist is (session ids can be computed).
    let mut stranger = keyed_ws(&d, key).await;
    let foreign = stranger
        .refused("session.resume", json!({"session_id": sid}), "not_found")
        .await;
    let missing = "local-00000000000000000000000000000000";
    let none = stranger
        .refused(
            "session.resume",
            json!({"session_id": missing}),
            "not_found",
        )
        .await;
    assert_eq!(
        foreign["error"]["data"]["detail"]
            .as_str()
            .map(|d| d.replace(&sid, "ID")),
        none["error"]["data"]["detail"]
            .as_str()
            .map(|d| d.replace(missing, "ID")),
        "the same answer: {foreign} {none}"
    );
    // Nor through any other method naming it: each answers as for a session that does not
    // exist (they said `permission_denied` for the owner's, confirming that it existed).
    for (method, extra) in [
        ("prompt.submit", json!({"input_id": "s1", "text": "hi"})),
        ("prompt.receipt", json!({"admission_id": "a"})),
        ("prompt.cancel", json!({"admission_id": "a"})),
        ("session.interrupt", json!({"execution_generation": 1})),
        ("session.events.since", json!({"last_sequence": 0})),
    ] {
        let mut answers = Vec::new();
        for id in [sid.as_str(), missing] {
            let mut params = extra.clone();
            params["session_id"] = json!(id);
            let v = stranger.refused(method, params, "not_found").await;
            answers.push(
                v["error"]["data"]["detail"]
                    .as_str()
                    .map(|d| d.replace(id, "ID")),
            );
        }
        assert_eq!(answers[0], answers[1], "{method}: the same answer");
    }
    // Nor use a room the owner created: read, drive, re-create or disband it.
    let members = json!([{"profile": "default", "handle": "d"}]);
    owner
        .ok(
            "room.create",
            json!({"room_id": "mine", "name": "Mine", "members": members}),
        )
        .await;
    let task = json!({"room_id": "mine", "task_id": "t1", "thread_id": "th", "turn_id": "tu",
                      "target_profile": "default", "prompt": "hi", "source_event_seq": 1});
    for (method, params) in [
        ("room.get", json!({"room_id": "mine"})),
        ("room.tasks", json!({"room_id": "mine"})),
        ("room.admit", task.clone()),
        (
            "room.cancel",
            json!({"room_id": "mine", "task_id": "t1", "cancel_id": "c"}),
        ),
        ("room.retry", json!({"room_id": "mine", "task_id": "t1"})),
        (
            "room.respond",
            json!({"room_id": "mine", "task_id": "t1", "execution_generation": 1,
                   "request_id": "p", "choice": "once"}),
        ),
        ("room.disband", json!({"room_id": "mine"})),
        (
            "room.create",
            json!({"room_id": "mine", "name": "Mine", "members": members}),
        ),
    ] {
        stranger.refused(method, params, "permission_denied").await;
    }
    let room = owner.ok("room.get", json!({"room_id": "mine"})).await;
    assert!(room["disbanded_at"].is_null(), "{room}");
    // Its own room is its own; the runtime's status is everyone's.
    stranger
        .ok(
            "room.create",
            json!({"room_id": "theirs", "name": "Theirs", "members": members}),
        )
        .await;
    owner
        .refused(
            "room.get",
            json!({"room_id": "theirs"}),
            "permission_denied",
        )
        .await;
    stranger.ok("room.status", json!({})).await;
    // Wrong-typed generation on a real prompt: refused as stale, nothing runs.
    owner
        .refused(
            "approval.respond",
            json!({"session_id": sid, "execution_generation": "1", "prompt_id": p["prompt_id"], "choice": "once"}),
            "stale_generation",
        )
        .await;
    owner
        .refused(
            "approval.respond",
            json!({"session_id": sid, "execution_generation": gen, "prompt_id": p["prompt_id"], "choice": "sudo"}),
            "invalid_params",
        )
        .await;
    assert!(victim.exists());
    owner
        .ok(
            "approval.respond",
            json!({"session_id": sid, "execution_generation": gen, "prompt_id": p["prompt_id"], "choice": "deny"}),
        )
        .await;
    wait_until("the turn", Duration::from_secs(20), || all_terminal(&home)).await;
    assert!(victim.exists(), "denied: never ran");
}

/// One control-socket exchange on a fresh connection: write `bytes`, read one line.
fn control_raw(home: &Path, bytes: &[u8], close_write: bool) -> (Value, UnixStream) {
    let mut s = UnixStream::connect(home.join("gateway.sock")).expect("control socket");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    s.write_all(bytes).expect("write");
    if close_write {
        s.shutdown(std::net::Shutdown::Write).expect("shutdown");
    }
    let mut line = String::new();
    BufReader::new(s.try_clone().expect("clone"))
        .read_line(&mut line)
        .expect("a reply line");
    (serde_json::from_str(&line).expect("json reply"), s)
}

#[actix_rt::test]
async fn hostile_control_socket_lines_get_typed_errors() {
    let model = FakeModel::ack();
    let (home, d) = Daemon::with_model(&model, json!({}));
    let ok = |name: &str| {
        let v = control(&home.path, "identify", json!({})).expect("identify");
        assert_eq!(v["state"], "ready", "after {name}: {v}");
    };
    let big = format!(
        "{{\"method\":\"identify\",\"pad\":\"{}\"}}\n",
        "x".repeat(70_000)
    );
    let cases: Vec<(&str, Vec<u8>, bool, &str)> = vec![
        ("invalid_json", b"{nope\n".to_vec(), false, "parse_error"),
        ("empty_line", b"\n".to_vec(), false, "parse_error"),
        (
            "non_utf8_line",
            b"{\"method\":\"\xff\xfe\"}\n".to_vec(),
            false,
            "parse_error",
        ),
        ("json_array", b"[1,2]\n".to_vec(), false, "invalid_request"),
        (
            "json_string",
            b"\"identify\"\n".to_vec(),
            false,
            "invalid_request",
        ),
        (
            "unknown_method",
            b"{\"method\":\"format-disk\"}\n".to_vec(),
            false,
            "unknown_method",
        ),
        (
            "method_not_a_string",
            b"{\"method\":7}\n".to_vec(),
            false,
            "unknown_method",
        ),
        (
            "ticket_bad_purpose",
            b"{\"method\":\"session-ticket\",\"params\":{\"purpose\":\"admin\"}}\n".to_vec(),
            false,
            "invalid_params",
        ),
        (
            "ticket_for_another_instance",
            b"{\"method\":\"session-ticket\",\"params\":{\"instance_id\":\"someone-else\"}}\n"
                .to_vec(),
            false,
            "stale_instance",
        ),
        (
            "resolve_unknown_nonsense",
            b"{\"method\":\"resolve-unknown\",\"params\":5}\n".to_vec(),
            false,
            "invalid_params",
        ),
        (
            // Once a panic of the connection's task: no reply, the connection dropped.
            "room_cancel_params_a_list",
            b"{\"method\":\"room-cancel\",\"params\":[]}\n".to_vec(),
            false,
            "invalid_params",
        ),
        (
            "resolve_unknown_without_params",
            b"{\"method\":\"resolve-unknown\"}\n".to_vec(),
            false,
            "not_found",
        ),
        (
            "line_without_newline",
            b"{\"method\":\"identify\"}".to_vec(),
            true,
            "invalid_request",
        ),
        (
            "line_over_limit",
            big.into_bytes(),
            false,
            "payload_too_large",
        ),
        (
            "line_far_over_limit",
            format!(
                "{{\"method\":\"identify\",\"pad\":\"{}\"}}\n",
                "x".repeat(300_000)
            )
            .into_bytes(),
            false,
            "payload_too_large",
        ),
    ];
    for (name, bytes, close_write, code) in cases {
        let (v, mut s) = control_raw(&home.path, &bytes, close_write);
        assert_eq!(v["error"]["code"], code, "{name}: {v}");
        if !close_write {
            // The same connection stays usable (after a line over the bound too: before, the
            // connection was closed after the answer).
            s.write_all(b"{\"method\":\"identify\"}\n").expect("write");
            let mut line = String::new();
            BufReader::new(s).read_line(&mut line).expect("line");
            let v: Value = serde_json::from_str(&line).expect("json");
            assert_eq!(v["state"], "ready", "{name}: same connection");
        }
        ok(name);
    }
    // Still a working daemon for WebSocket clients too.
    let mut ws = d.ws().await;
    let sid = ws.session("ctl", &home.path).await;
    normal_request(&mut ws, &sid).await;
}

// ---------- resource bounds ----------

/// Wait until at most `max` session supervisors are loaded; fails with the count after `timeout`.
async fn wait_loaded_at_most(origin: &str, max: f64, timeout: Duration, why: &str) {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let loaded = metric(origin, "gatehouse_sessions_loaded").await;
        if loaded <= max {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{loaded} supervisors still loaded{why}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn wait_metric_at_least(origin: &str, name: &str, min: f64, timeout: Duration) {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let v = metric(origin, name).await;
        if v >= min {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{name} is {v}, not yet {min}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// A client that writes frames needing no answer (pongs) as fast as it can, never reading, is
/// held back by its own socket: the daemon reads a frame at a time, and answers the client once
/// it has read what the socket held. Before, the frame decoder took all the socket gave, and
/// the daemon grew at the rate the client wrote.
#[actix_rt::test]
async fn a_flood_of_pongs_is_read_a_frame_at_a_time() {
    let model = FakeModel::ack_or_hang();
    let home = Home::new();
    home.write_config(&config(&model.url, json!({})));
    let d = Daemon::start(&home);
    let pid = d.child.id();
    let mut raw = RawWs::connect(&home.path, &d.origin());
    let base = rss_kib(pid);
    let pong = RawWs::masked(true, 0xA, b"");
    let burst = pong.repeat(64 * 1024 / pong.len());
    let flood = std::thread::spawn(move || {
        raw.stream
            .set_write_timeout(Some(Duration::from_millis(100)))
            .expect("write timeout");
        let until = std::time::Instant::now() + Duration::from_secs(3);
        let (mut at, mut written) = (0usize, 0usize);
        while std::time::Instant::now() < until {
            // From where the last write stopped: the frames stay whole.
            match raw.stream.write(&burst[at..]) {
                Ok(n) => {
                    written += n;
                    at = (at + n) % burst.len();
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(e) => panic!("the flood's write failed after {written} bytes: {e}"),
            }
        }
        // The next frame starts whole.
        if at != 0 {
            raw.write_all(&burst[at..]);
        }
        (raw, written)
    });
    let (mut raw, written) = flood.join().expect("flood");
    let grown = rss_kib(pid).saturating_sub(base);
    assert!(
        grown < 32 * 1024,
        "the daemon grew {grown} KiB while the client wrote {written} bytes"
    );
    raw.text(br#"{"jsonrpc":"2.0","id":"after","method":"no.such.method"}"#);
    let reply = raw.reply();
    assert_eq!(reply["id"], "after", "{reply}");
    assert_eq!(reply["error"]["code"], -32601, "{reply}");
}

#[actix_rt::test]
async fn a_slow_consumer_is_disconnected_and_others_get_every_event() {
    const CHUNKS: usize = 4000;
    let model = FakeModel::start(|body| {
        if last_user(body) == "FLOOD" {
            let piece = "w".repeat(8 * 1024);
            Reply::Sse(
                (0..CHUNKS)
                    .map(|_| {
                        json!({"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": null}]})
                            .to_string()
                    })
                    .chain(std::iter::once(
                        json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}).to_string(),
                    ))
                    .collect(),
            )
        } else {
            Reply::Message(json!({"role": "assistant", "content": "ok"}), "stop")
        }
    });
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({"gateway": {"outbound_queue_frames": 512}, "model": {"max_response_bytes": 256 << 20}}),
    ));
    let d = Daemon::start(&home);
    let origin = d.origin();
    let mut ws = d.ws().await;
    let sid = ws.session("flood", &home.path).await;
    let resume = json!({"jsonrpc": "2.0", "id": "r", "method": "session.resume", "params": {"session_id": sid}})
        .to_string();
    // A watcher that reads everything, on its own thread.
    let mut watcher = RawWs::connect(&home.path, &origin);
    watcher.text(resume.as_bytes());
    assert!(watcher.reply()["result"].is_object());
    let watching = std::thread::spawn(move || {
        let mut deltas = 0usize;
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while let Some((op, payload)) = watcher.read() {
            if std::time::Instant::now() > deadline {
                break;
            }
            if op != 0x1 {
                continue;
            }
            // Told apart by a search, not a parse: this thread must keep up with the daemon
            // (it is cut off too, 512 frames behind), and parsing each 8 KiB frame in a debug
            // build on a loaded machine could leave it that far behind.
            let text = std::str::from_utf8(&payload).unwrap_or("");
            if text.contains("\"type\":\"message.delta\"") {
                deltas += 1;
            } else if text.contains("\"type\":\"message.complete\"") {
                return deltas;
            }
        }
        deltas
    });
    // A consumer that subscribes and then never reads again.
    let mut slow = RawWs::connect(&home.path, &origin);
    slow.text(resume.as_bytes());
    assert!(slow.reply()["result"].is_object());
    let base_rss = rss_kib(d.child.id());
    // The submitting connection leaves right away.
    ws.submit(&sid, "FLOOD", "FLOOD").await;
    drop(ws);
    let seen = watching.join().expect("watcher");
    assert_eq!(seen, CHUNKS, "the reading watcher got every delta");
    wait_until("FLOOD settles", Duration::from_secs(60), || {
        home.admission("FLOOD").status == "terminal"
    })
    .await;
    // The allocator gives freed memory back to the system shortly after the turn's last copies
    // of the flood are freed: wait for that, then the growth left is what is still held.
    let pid = d.child.id();
    let settled = std::time::Instant::now() + Duration::from_secs(5);
    let mut grown = rss_kib(pid).saturating_sub(base_rss);
    while grown >= 200 * 1024 && std::time::Instant::now() < settled {
        tokio::time::sleep(Duration::from_millis(50)).await;
        grown = rss_kib(pid).saturating_sub(base_rss);
    }
    assert!(
        grown < 200 * 1024,
        "the daemon grew {grown} KiB for one slow consumer"
    );
    // The slow consumer finds what was in flight, then the end of its connection (promptly: a
    // connection left open would only end at the 20 s read timeout).
    let (deltas, ending, took) = read_to_the_end(&mut slow, "message.delta");
    assert!(
        took < Duration::from_secs(10),
        "the slow consumer's connection stayed open"
    );
    assert!(
        deltas < CHUNKS,
        "the slow consumer was cut off ({deltas} deltas)"
    );
    assert!(
        matches!(ending, None | Some(1008)),
        "closed as a policy violation or cut: {ending:?}"
    );
    assert!(home.log().contains("slow consumer"), "the reason is logged");
    // The daemon keeps serving.
    let mut ws = Ws::connect(&home.path, &origin).await;
    normal_request(&mut ws, &sid).await;
}

/// A model that answers `BIG…` with `mib` MiB of text (anything else `ok`), and a home.
fn big_model(mib: usize) -> (FakeModel, Home) {
    let model = FakeModel::start(move |body| {
        let text = if last_user(body).starts_with("BIG") {
            "b".repeat(mib << 20)
        } else {
            "ok".into()
        };
        Reply::Message(json!({"role": "assistant", "content": text}), "stop")
    });
    (model, Home::new())
}

/// A daemon whose model answers `BIG…` with `mib` MiB of text, a session, and a consumer that
/// follows it and then never reads again.
async fn big_replies_and_a_stalled_reader(
    gateway: Value,
    mib: usize,
) -> (FakeModel, Home, Daemon, String, RawWs) {
    let (model, home) = big_model(mib);
    home.write_config(&config(
        &model.url,
        json!({"gateway": gateway, "model": {"max_response_bytes": 64 << 20}}),
    ));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.session("big", &home.path).await;
    let mut slow = RawWs::connect(&home.path, &d.origin());
    let resume = json!({"jsonrpc": "2.0", "id": "r", "method": "session.resume", "params": {"session_id": sid}});
    slow.text(resume.to_string().as_bytes());
    assert!(slow.reply()["result"].is_object());
    for i in 0..6 {
        ws.submit(&sid, &format!("BIG{i}"), &format!("BIG{i}"))
            .await;
    }
    drop(ws);
    (model, home, d, sid, slow)
}

/// Read a consumer's frames until its connection ends (30 s at most): how many events of `kind`
/// it got, its close code (none when it was cut without one), and how long that took.
fn read_to_the_end(ws: &mut RawWs, kind: &str) -> (usize, Option<u16>, Duration) {
    let reading = std::time::Instant::now();
    let (mut seen, mut ending) = (0usize, None);
    while let Some((op, payload)) = ws.read() {
        if reading.elapsed() > Duration::from_secs(30) {
            break;
        }
        match op {
            0x1 => {
                let v: Value = serde_json::from_slice(&payload).unwrap_or(Value::Null);
                if v["params"]["type"] == kind {
                    seen += 1;
                }
            }
            0x8 => {
                ending = payload.get(..2).map(|b| u16::from_be_bytes([b[0], b[1]]));
                break;
            }
            _ => {}
        }
    }
    (seen, ending, reading.elapsed())
}

/// The slow consumer's connection ends promptly (a close 1008, or cut), before it has read
/// every reply.
fn cut_off_before_the_end(slow: &mut RawWs) {
    let (completes, ending, took) = read_to_the_end(slow, "message.complete");
    assert!(
        took < Duration::from_secs(20),
        "the slow consumer's connection stayed open"
    );
    assert!(
        completes < 6,
        "cut off before the end ({completes} replies)"
    );
    assert!(matches!(ending, None | Some(1008)), "{ending:?}");
}

/// Few frames, each a whole large reply: the outbound queue is bounded in bytes too. Before,
/// only frames counted (4096 by default), and 30 turns of 6 MB to a consumer that did not read
/// held 900 MiB.
#[actix_rt::test]
async fn a_slow_consumer_of_large_replies_is_cut_off_at_the_byte_bound() {
    let (_model, home, d, sid, mut slow) =
        big_replies_and_a_stalled_reader(json!({"outbound_queue_bytes": 8 << 20}), 4).await;
    wait_until("every BIG turn settles", Duration::from_secs(60), || {
        (0..6).all(|i| home.admission(&format!("BIG{i}")).status == "terminal")
    })
    .await;
    cut_off_before_the_end(&mut slow);
    assert!(
        home.log().contains("outbound queue full"),
        "the reason is logged"
    );
    let mut ws = Ws::connect(&home.path, &d.origin()).await;
    normal_request(&mut ws, &sid).await;
}

/// A client that neither reads nor answers pings (frozen, or gone without a FIN) is let go at
/// the client timeout. Before, its system's acknowledgement of each 2-byte ping counted as
/// the client taking in bytes, and it was kept for good.
#[actix_rt::test]
async fn a_client_that_never_answers_a_ping_is_let_go() {
    let model = FakeModel::ack_or_hang();
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({"gateway": {"heartbeat_seconds": 0.2, "client_timeout_seconds": 2}}),
    ));
    let d = Daemon::start(&home);
    let _silent = RawWs::connect(&home.path, &d.origin());
    wait_until(
        "the silent client is let go",
        Duration::from_secs(20),
        || {
            home.log()
                .contains("client stopped answering pings; closing")
        },
    )
    .await;
}

/// Under both bounds, a consumer that stopped reading (its frames are no longer written) is
/// cut off after the client timeout: the connection's own heartbeat cannot run while its
/// writer is blocked, and before, such a client was never dropped.
#[actix_rt::test]
async fn a_consumer_that_stopped_reading_is_cut_off_after_the_client_timeout() {
    let (_model, home, _d, _sid, mut slow) = big_replies_and_a_stalled_reader(
        json!({"heartbeat_seconds": 0.2, "client_timeout_seconds": 2}),
        4,
    )
    .await;
    wait_until("the stall is noticed", Duration::from_secs(60), || {
        home.log()
            .contains("nothing written for the client timeout")
    })
    .await;
    cut_off_before_the_end(&mut slow);
}

/// A daemon (heartbeat 0.2 s, `client_timeout` s) with a session whose one turn, settled, was
/// answered `mib` MiB of text.
async fn a_settled_big_reply(mib: usize, client_timeout: u64) -> (FakeModel, Home, Daemon, String) {
    let (model, home) = big_model(mib);
    home.write_config(&config(
        &model.url,
        json!({"gateway": {"heartbeat_seconds": 0.2, "client_timeout_seconds": client_timeout},
               "model": {"max_response_bytes": 64 << 20}}),
    ));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.session("big", &home.path).await;
    ws.submit(&sid, "BIG", "BIG").await;
    drop(ws);
    wait_until("the BIG turn settles", Duration::from_secs(60), || {
        home.admission("BIG").status == "terminal"
    })
    .await;
    (model, home, d, sid)
}

/// A client that sends requests and stops reading their replies (no events waiting) is cut off
/// after the client timeout too. Before, only event frames were watched: with the socket full
/// of replies the connection's heartbeat stopped running, and the connection, its slot and its
/// buffered replies were held for as long as the client kept it open.
#[actix_rt::test]
async fn a_client_that_stopped_reading_its_replies_is_cut_off_after_the_client_timeout() {
    let (_model, home, d, sid) = a_settled_big_reply(4, 2).await;
    // The session's whole log, 4 MiB, asked for ten times over: far more than the socket holds.
    let mut stalled = RawWs::connect(&home.path, &d.origin());
    let resume = json!({"jsonrpc": "2.0", "id": "r", "method": "session.resume", "params": {"session_id": sid}});
    stalled.text(resume.to_string().as_bytes());
    assert!(stalled.reply()["result"].is_object());
    for i in 0..10 {
        let since = json!({"jsonrpc": "2.0", "id": i, "method": "session.events.since",
                           "params": {"session_id": sid, "last_sequence": 0}});
        stalled.text(since.to_string().as_bytes());
    }
    wait_until("the stall is noticed", Duration::from_secs(30), || {
        home.log()
            .contains("nothing written for the client timeout")
    })
    .await;
    let (_, ending, took) = read_to_the_end(&mut stalled, "message.complete");
    assert!(took < Duration::from_secs(20), "the connection stayed open");
    assert!(matches!(ending, None | Some(1008)), "{ending:?}");
    let mut ws = Ws::connect(&home.path, &d.origin()).await;
    normal_request(&mut ws, &sid).await;
}

/// A client on a slow link that takes a reply longer than the client timeout to read, but
/// reads it, keeps its connection: it acknowledges bytes all along. Before, the connection
/// neither wrote more nor ran its heartbeat until the frame was out, and was closed for not
/// answering the pings queued behind it (or cut as a stalled consumer).
#[actix_rt::test]
async fn a_client_reading_a_large_reply_slowly_keeps_its_connection() {
    use std::os::fd::AsRawFd;
    let mib = 12;
    // A client timeout of 2 s: a stall of the reading thread shorter than that on a loaded
    // machine does not cut the connection either.
    let (_model, home, d, sid) = a_settled_big_reply(mib, 2).await;
    let mut slow = RawWs::connect(&home.path, &d.origin());
    // A small receive window, as on a slow link: the reply waits on the daemon's side.
    let small: libc::c_int = 128 << 10;
    // SAFETY: setsockopt(2) on the test's own socket, with an int option value.
    unsafe {
        libc::setsockopt(
            slow.stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&small as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
    let resume = json!({"jsonrpc": "2.0", "id": "r", "method": "session.resume", "params": {"session_id": sid}});
    slow.text(resume.to_string().as_bytes());
    // Read the reply's frame at about 2.5 MB/s: some five seconds for its 12 MiB.
    let started = std::time::Instant::now();
    let mut left = loop {
        let mut header = [0u8; 2];
        slow.stream.read_exact(&mut header).expect("a frame");
        if header[0] & 0x0f == 0x1 {
            assert_eq!(header[1] & 0x7f, 127, "a large frame");
            let mut len = [0u8; 8];
            slow.stream.read_exact(&mut len).expect("its length");
            break u64::from_be_bytes(len) as usize;
        }
        // A ping sent before the reply: answered.
        let mut payload = vec![0u8; usize::from(header[1] & 0x7f)];
        slow.stream
            .read_exact(&mut payload)
            .expect("a control frame");
        if header[0] & 0x0f == 0x9 {
            slow.frame(true, 0xA, &payload);
        }
    };
    assert!(left > mib << 20, "{left}");
    let mut reply = Vec::with_capacity(left);
    let mut chunk = vec![0u8; 256 << 10];
    while left > 0 {
        let n = slow
            .stream
            .read(&mut chunk[..left.min(256 << 10)])
            .expect("read");
        assert!(n > 0, "the connection ended after {} bytes", reply.len());
        reply.extend_from_slice(&chunk[..n]);
        left -= n;
        std::thread::sleep(Duration::from_millis(100));
    }
    let took = started.elapsed();
    assert!(
        took > Duration::from_secs(4),
        "twice slower than the client timeout: {took:?}"
    );
    let reply: Value = serde_json::from_slice(&reply).expect("the reply");
    assert_eq!(reply["id"], "r");
    assert!(reply["result"].is_object(), "{}", &reply.to_string()[..200]);
    // The same connection still answers.
    let again = json!({"jsonrpc": "2.0", "id": "again", "method": "session.events.since",
                       "params": {"session_id": sid, "last_sequence": 0, "limit": 1}});
    slow.text(again.to_string().as_bytes());
    let answer = slow.reply();
    assert_eq!(answer["id"], "again", "{answer}");
    assert!(
        !home.log().contains("slow consumer") && !home.log().contains("stopped answering pings"),
        "{}",
        home.log()
    );
}

#[actix_rt::test]
async fn connections_past_the_limit_are_refused_and_the_ticket_kept() {
    let model = FakeModel::ack();
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({"gateway": {"max_connections": 3}}),
    ));
    let d = Daemon::start(&home);
    let origin = d.origin();
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(RawWs::connect(&home.path, &origin));
    }
    let t = ticket(&home.path);
    let offer = vec!["gatehouse.v1".to_string(), format!("gatehouse-ticket.{t}")];
    let up = raw_upgrade(&origin, &offer, &[]);
    assert_eq!(up.status, 503, "{}", up.body);
    let body: Value = serde_json::from_str(&up.body).expect("json");
    assert_eq!(body["error"]["reason"], "rate_limited");
    // Plain HTTP still answers while the WebSocket slots are full.
    assert!(metric(&origin, "gatehouse_ws_connections").await >= 3.0);
    // One leaves: the refused client gets in with the same (unspent) ticket.
    drop(held.pop());
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let up = raw_upgrade(&origin, &offer, &[]);
        if up.status == 101 {
            break;
        }
        assert_eq!(up.status, 503, "{}", up.body);
        assert!(
            std::time::Instant::now() < deadline,
            "the slot never came back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(held);
    let mut ws = Ws::connect(&home.path, &origin).await;
    let sid = ws.session("after", &home.path).await;
    normal_request(&mut ws, &sid).await;
}

/// A session's live events keep counting up across its supervisor's eviction and revival
/// (`live_seq` is one counter of the process). It was the supervisor's own, and started again
/// at 1 in the revived one: a client ordering a session's deltas by it put the new ones first.
#[actix_rt::test]
async fn live_seq_counts_on_across_an_eviction() {
    let model = FakeModel::ack();
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({"session": {"max_in_memory": 1}}),
    ));
    let d = Daemon::start(&home);
    let origin = d.origin();
    let delta = |sid: &str| {
        let sid = sid.to_string();
        move |e: &Value| e["type"] == "message.delta" && e["session_id"] == sid.as_str()
    };
    let mut ws = d.ws().await;
    let s0 = ws.session("s0", &home.path).await;
    ws.submit(&s0, "one", "one").await;
    let first = ws.event(Duration::from_secs(20), delta(&s0)).await;
    let first = first["live_seq"].as_u64().expect("a live_seq");
    wait_until("one", Duration::from_secs(20), || {
        home.admission("one").status == "terminal"
    })
    .await;
    drop(ws);
    // Another session, followed, takes the one place in memory: s0's supervisor goes.
    let mut other = d.ws().await;
    let s1 = other.session("s1", &home.path).await;
    other.submit(&s1, "x", "x").await;
    wait_loaded_at_most(&origin, 1.0, Duration::from_secs(20), "").await;
    let mut ws = d.ws().await;
    ws.ok("session.resume", json!({"session_id": s0})).await;
    ws.submit(&s0, "two", "two").await;
    let second = ws.event(Duration::from_secs(20), delta(&s0)).await;
    let second = second["live_seq"].as_u64().expect("a live_seq");
    assert!(second > first, "live_seq {second} after {first}");
}

#[actix_rt::test]
async fn idle_sessions_are_evicted_and_revived_from_the_store() {
    let model = FakeModel::ack();
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({"session": {"max_in_memory": 2}}),
    ));
    let d = Daemon::start(&home);
    let origin = d.origin();
    // A followed session is never evicted: its watcher keeps getting events.
    let mut watcher = d.ws().await;
    let followed = watcher.session("followed", &home.path).await;
    let mut sids = Vec::new();
    for i in 0..6 {
        // Each session is used by a short-lived connection, then left idle.
        let mut ws = d.ws().await;
        let sid = ws.session(&format!("s{i}"), &home.path).await;
        let text = format!("first-{i}");
        ws.submit(&sid, &text, &text).await;
        wait_until(&text, Duration::from_secs(20), || {
            home.admission(&text).status == "terminal"
        })
        .await;
        sids.push(sid);
    }
    wait_loaded_at_most(&origin, 2.0, Duration::from_secs(15), "").await;
    // Connections that resume a session and close at once, before their reply: a session
    // followed by a connection that closed mid-request is not kept in memory for good. (Whether
    // a close lands between the subscription and the reply is up to timing: this guards the
    // outcome, it does not force the race.)
    for i in 0..30 {
        let mut raw = RawWs::connect(&home.path, &origin);
        raw.text(
            json!({"jsonrpc": "2.0", "id": i, "method": "session.resume", "params": {"session_id": sids[i % 6]}})
                .to_string()
                .as_bytes(),
        );
        drop(raw);
    }
    wait_loaded_at_most(
        &origin,
        2.0,
        Duration::from_secs(45),
        " after connections closed mid-request",
    )
    .await;
    // An evicted session comes back from the store with its history.
    let mut ws = d.ws().await;
    let snap = ws
        .ok("session.resume", json!({"session_id": sids[0]}))
        .await;
    assert_eq!(snap["messages"].as_array().map(Vec::len), Some(2));
    ws.submit(&sids[0], "second-0", "second-0").await;
    wait_until("second-0", Duration::from_secs(20), || {
        home.admission("second-0").status == "terminal"
    })
    .await;
    let reqs = model.requests();
    let req = reqs
        .iter()
        .find(|b| last_user(b) == "second-0")
        .expect("request");
    assert_eq!(
        user_texts(req),
        vec!["first-0".to_string(), "second-0".to_string()]
    );
    // The followed session was kept: its watcher sees a turn submitted elsewhere.
    let mut other = d.ws().await;
    other
        .ok("session.resume", json!({"session_id": followed}))
        .await;
    other.submit(&followed, "F", "F").await;
    let done = watcher
        .event(Duration::from_secs(20), |e| e["type"] == "message.complete")
        .await;
    assert_eq!(done["session_id"], followed);
    normal_request(&mut watcher, &followed).await;
}

/// A daemon that keeps at most `limit` supervisors loaded, and a connection following `busy`
/// sessions `busy-0` … (followed sessions are never idle).
async fn busy_sessions_over(limit: usize, busy: usize) -> (FakeModel, Home, Daemon, Ws) {
    let model = FakeModel::ack();
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({"session": {"max_in_memory": limit}}),
    ));
    let d = Daemon::start(&home);
    let mut watcher = d.ws().await;
    for i in 0..busy {
        watcher.session(&format!("busy-{i}"), &home.path).await;
    }
    (model, home, d, watcher)
}

#[actix_rt::test]
async fn eviction_reaches_idle_sessions_behind_many_busy_ones() {
    // Twelve followed (busy) sessions are the least recently used; five idle ones come after.
    // Each sweep asks a few more than the excess, oldest first: the busy ones must not stand in
    // front of the idle ones for ever.
    let (_model, home, d, mut watcher) = busy_sessions_over(10, 12).await;
    let origin = d.origin();
    for i in 0..5 {
        let mut ws = d.ws().await;
        ws.session(&format!("idle-{i}"), &home.path).await;
    }
    wait_loaded_at_most(
        &origin,
        12.0,
        Duration::from_secs(20),
        ": idle sessions were never asked",
    )
    .await;
    // The followed sessions are all still served by their supervisors.
    let first = watcher.session("busy-0", &home.path).await;
    normal_request(&mut watcher, &first).await;
}

#[actix_rt::test]
async fn a_sweep_asks_a_busy_session_again_only_once_it_is_idle() {
    // Six followed (busy) sessions over a limit of two. A sweep that found one busy does not ask
    // it again on the next sweeps (with thousands of parked sessions, every sweep asked thousands
    // of supervisors, on the thread that runs every session); once its watcher leaves, it tells
    // the registry it is idle and is let go.
    let (_model, _home, d, watcher) = busy_sessions_over(2, 6).await;
    let origin = d.origin();
    let (asks, sweeps) = (
        "gatehouse_eviction_asks_total",
        "gatehouse_eviction_sweeps_total",
    );
    let timeout = Duration::from_secs(20);
    wait_metric_at_least(&origin, asks, 6.0, timeout).await;
    let after = metric(&origin, sweeps).await + 2.0;
    wait_metric_at_least(&origin, sweeps, after, timeout).await;
    let asked = metric(&origin, asks).await;
    let after = metric(&origin, sweeps).await + 3.0;
    wait_metric_at_least(&origin, sweeps, after, timeout).await;
    assert_eq!(
        metric(&origin, asks).await,
        asked,
        "sweeps asked the busy sessions again"
    );
    drop(watcher);
    wait_loaded_at_most(&origin, 2.0, timeout, ": idle sessions were not let go").await;
}

#[actix_rt::test]
async fn a_turn_on_an_idle_session_is_two_writer_transitions() {
    // The admission commits with its claim, the settlement with the reply; with nothing queued
    // the supervisor does not claim again after the turn (a round trip that commits nothing).
    let model = FakeModel::ack();
    let (home, d) = Daemon::with_model(&model, json!({}));
    let origin = d.origin();
    let mut ws = d.ws().await;
    let sid = ws.session("two", &home.path).await;
    let turns = 6;
    let before = metric(&origin, "gatehouse_db_writes_total").await;
    for k in 0..turns {
        let text = format!("t{k}");
        ws.submit(&sid, &text, &text).await;
        wait_until(&text, Duration::from_secs(20), || {
            home.admission(&text).status == "terminal"
        })
        .await;
    }
    let writes = metric(&origin, "gatehouse_db_writes_total").await - before;
    // The bound leaves room for a background write (the event pruner); three per turn would
    // be 18.
    assert!(
        writes <= f64::from(2 * turns + 2),
        "{writes} writer transitions for {turns} turns"
    );
    assert_eq!(model.requests().len(), turns as usize);
}

/// A claim reads its turn's transcript on the writer only while it is short: past
/// `WRITER_READ_ROWS` (128) live messages the turn reads it through a reader, so one long
/// session does not hold every commit while its rows are read. Either way the model gets the
/// whole transcript: each request carries the system prompt and every message before it.
#[actix_rt::test]
async fn a_long_transcript_is_read_off_the_writer_and_sent_whole() {
    let model = FakeModel::ack();
    let (home, d) = Daemon::with_model(&model, json!({}));
    let origin = d.origin();
    let mut ws = d.ws().await;
    let sid = ws.session("long", &home.path).await;
    // Each turn adds two live messages: turn k starts from 2k of them plus its own input.
    let turns = 70;
    for k in 0..turns {
        let text = format!("L{k:03}");
        ws.submit(&sid, &text, &text).await;
    }
    wait_until("every turn", Duration::from_secs(120), || {
        home.admissions().iter().all(|r| r.status == "terminal")
    })
    .await;
    let requests = model.requests();
    assert_eq!(requests.len(), turns);
    for (k, body) in requests.iter().enumerate() {
        let messages = body["messages"].as_array().map_or(0, Vec::len);
        assert_eq!(
            messages,
            2 * k + 2,
            "request {k}: system, 2 × {k} earlier, its input"
        );
        assert_eq!(last_user(body), format!("L{k:03}"));
    }
    // Turns 0 to 63 start from at most 127 live messages, read in their claims; turns 64 to
    // 69 from 129 to 139, read apart: turn 64's claim found the transcript too long, and the
    // claims after it do not try. (A claim whose read failed would count too: none here.)
    assert_eq!(
        metric(&origin, "gatehouse_turn_starts_read_apart_total").await,
        6.0
    );
}

/// A claim that started the last queued input knows the FIFO is empty behind it: the turn's end
/// starts no claim. Each round holds an input at the model while a second one is queued; the
/// second is claimed after the first settles, and nothing is claimed after it.
#[actix_rt::test]
async fn a_claim_that_empties_the_queue_needs_no_claim_after_its_turn() {
    let opened = std::sync::Arc::new((std::sync::Mutex::new(0usize), std::sync::Condvar::new()));
    let gate = opened.clone();
    let model = FakeModel::start(move |body| {
        let text = last_user(body);
        if let Some(k) = text
            .strip_prefix("held-")
            .and_then(|k| k.parse::<usize>().ok())
        {
            let (lock, cv) = &*gate;
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            let mut open = lock.lock().unwrap_or_else(|e| e.into_inner());
            while *open <= k && std::time::Instant::now() < deadline {
                open = cv
                    .wait_timeout(open, Duration::from_millis(100))
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
        Reply::Message(
            json!({"role": "assistant", "content": format!("ACK_{text}")}),
            "stop",
        )
    });
    let (home, d) = Daemon::with_model(&model, json!({}));
    let origin = d.origin();
    let mut ws = d.ws().await;
    let sid = ws.session("emptied", &home.path).await;
    let rounds: u32 = 4;
    let before = metric(&origin, "gatehouse_db_writes_total").await;
    for k in 0..rounds {
        let held = format!("held-{k}");
        let k = k as usize;
        ws.submit(&sid, &held, &held).await;
        wait_until(&held, Duration::from_secs(20), || model.reached(&held) == 1).await;
        let next = format!("next-{k}");
        let admission = ws.submit(&sid, &next, &next).await["admission_id"].clone();
        {
            let (lock, cv) = &*opened;
            *lock.lock().unwrap_or_else(|e| e.into_inner()) = k + 1;
            cv.notify_all();
        }
        ws.event(Duration::from_secs(20), |e| {
            e["type"] == "message.complete" && e["payload"]["admission_id"] == admission
        })
        .await;
    }
    let writes = metric(&origin, "gatehouse_db_writes_total").await - before;
    // Per round: the held input's admission with its claim, the next one's admission, the held
    // one's settlement, the next one's claim and its settlement. A claim after the round's last
    // turn would make 24; the bound leaves room for a background write (the event pruner).
    assert!(
        writes <= f64::from(5 * rounds + 2),
        "{writes} writer transitions for {rounds} rounds"
    );
    assert_eq!(model.requests().len(), 2 * rounds as usize);
}

/// A session whose queue (`max_queued_admissions` 2) is full: `HEAD` hangs at the model, `Q1`
/// and `Q2` wait behind it. The receipt of `Q2` comes back with the rest.
async fn a_full_queue(name: &str) -> (FakeModel, Home, Daemon, Ws, String, Value) {
    let model = FakeModel::start(|body| {
        if last_user(body) == "HEAD" {
            Reply::Hang
        } else {
            Reply::Message(json!({"role": "assistant", "content": "ok"}), "stop")
        }
    });
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({"session": {"max_queued_admissions": 2}}),
    ));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.session(name, &home.path).await;
    ws.submit(&sid, "HEAD", "HEAD").await;
    wait_until("HEAD at the model", Duration::from_secs(20), || {
        model.reached("HEAD") == 1
    })
    .await;
    ws.submit(&sid, "Q1", "Q1").await;
    let q2 = ws.submit(&sid, "Q2", "Q2").await;
    (model, home, d, ws, sid, q2)
}

#[actix_rt::test]
async fn a_full_session_queue_is_refused_with_session_busy() {
    let (_model, home, _d, mut ws, sid, _) = a_full_queue("busy").await;
    let v = ws
        .refused(
            "prompt.submit",
            json!({"session_id": sid, "input_id": "Q3", "text": "Q3"}),
            "session_busy",
        )
        .await;
    assert_eq!(v["error"]["code"], 4001);
    // The same input again is still an idempotent hit, not a refusal.
    assert_eq!(ws.submit(&sid, "Q1", "Q1").await["status"], "queued");
    // Other sessions are not affected.
    let other = ws.session("other", &home.path).await;
    ws.submit(&other, "O", "O").await;
    normal_request(&mut ws, &sid).await;
    // When the queue drains, the refused input is accepted.
    ws.ok(
        "session.interrupt",
        json!({"session_id": sid, "execution_generation": home.admission("HEAD").execution_generation}),
    )
    .await;
    wait_until("the queue drains", Duration::from_secs(20), || {
        ["Q1", "Q2"]
            .iter()
            .all(|t| home.admission(t).status == "terminal")
    })
    .await;
    ws.submit(&sid, "Q3", "Q3").await;
    wait_until("Q3", Duration::from_secs(20), || all_terminal(&home)).await;
    assert_eq!(home.admission("Q3").outcome.as_deref(), Some("completed"));
}

#[actix_rt::test]
async fn the_model_key_goes_only_to_configured_endpoints() {
    // A client chooses its session's base_url; pointing it at a server of its own must not
    // hand it the operator's model key.
    let configured = FakeModel::ack();
    let foreign = FakeModel::ack();
    let (home, d) = Daemon::with_model(&configured, json!({}));
    let mut ws = d.ws().await;
    let own = ws.session("own", &home.path).await;
    let theirs = ws
        .create("theirs", &home.path, json!({"base_url": foreign.url}))
        .await["session_id"]
        .as_str()
        .expect("session id")
        .to_string();
    ws.submit(&own, "to-configured", "to-configured").await;
    ws.submit(&theirs, "to-foreign", "to-foreign").await;
    wait_until("both turns", Duration::from_secs(20), || {
        all_terminal(&home)
    })
    .await;
    assert_eq!(foreign.reached("to-foreign"), 1);
    assert_eq!(
        configured.authorizations(),
        vec![Some("Bearer loopback-only".to_string())]
    );
    assert_eq!(foreign.authorizations(), vec![None]);
    assert_eq!(
        home.admission("to-foreign").outcome.as_deref(),
        Some("completed")
    );
}

#[actix_rt::test]
async fn a_connection_that_pipelines_past_its_bound_is_refused_not_queued() {
    // 1000 writes sent in one burst, without waiting for a reply: the store answers slower than
    // they arrive, so more than the bound are in flight at once. Those past it are refused at
    // once; every request gets exactly one reply; the connection keeps serving.
    const SENT: usize = 1000;
    let model = FakeModel::ack();
    let (home, d) = Daemon::with_model(&model, json!({}));
    let mut raw = RawWs::connect(&home.path, &d.origin());
    let cwd = home.path.to_string_lossy().to_string();
    let mut burst = Vec::new();
    for i in 0..SENT {
        let req = json!({"jsonrpc": "2.0", "id": i, "method": "session.create",
                         "params": {"request_id": format!("burst-{i}"), "cwd": cwd}});
        let mut one = RawWs::masked_text(req.to_string().as_bytes());
        burst.append(&mut one);
    }
    raw.write_all(&burst);
    let mut ids = std::collections::BTreeSet::new();
    let (mut created, mut refused) = (0, 0);
    for _ in 0..SENT {
        let reply = raw.reply();
        assert!(ids.insert(reply["id"].as_u64().expect("id")), "{reply}");
        if reply["result"]["session_id"].is_string() {
            created += 1;
        } else {
            assert_eq!(reply["error"]["data"]["reason"], "rate_limited", "{reply}");
            refused += 1;
        }
    }
    assert!(refused > 0, "the bound never held: {created} created");
    assert!(created >= 256, "{created} created, {refused} refused");
    // Refused means not done: no session for a refused request.
    let sessions: i64 = {
        use diesel::prelude::*;
        gatehouse::store::schema::sessions::table
            .count()
            .get_result(&mut home.db())
            .expect("count")
    };
    assert_eq!(sessions as usize, created);
    raw.text(
        json!({"jsonrpc": "2.0", "id": "after", "method": "session.create",
                    "params": {"request_id": "after", "cwd": cwd}})
        .to_string()
        .as_bytes(),
    );
    let after = raw.reply();
    assert!(after["result"]["session_id"].is_string(), "{after}");
}

#[actix_rt::test]
async fn an_unsubscribed_session_is_no_longer_followed_and_can_be_let_go() {
    // A client that looked at many sessions keeps them all loaded while it follows them (a
    // followed session is never evicted); session.unsubscribe lets them go.
    let (_model, home, d, mut ws) = busy_sessions_over(2, 6).await;
    let origin = d.origin();
    let mut sids = Vec::new();
    for i in 0..6 {
        // The same request ids again: the ids of the sessions it already follows.
        sids.push(ws.session(&format!("busy-{i}"), &home.path).await);
    }
    let loaded = metric(&origin, "gatehouse_sessions_loaded").await;
    assert!(loaded >= 6.0, "followed sessions stay loaded: {loaded}");
    for sid in &sids[1..] {
        let r = ws
            .ok("session.unsubscribe", json!({"session_id": sid}))
            .await;
        assert_eq!(r["unsubscribed"], true, "{r}");
    }
    wait_loaded_at_most(
        &origin,
        2.0,
        Duration::from_secs(15),
        " after unsubscribing",
    )
    .await;
    // No longer followed on this connection: acting on it needs a resume first.
    ws.refused(
        "prompt.submit",
        json!({"session_id": sids[1], "input_id": "x", "text": "x"}),
        "permission_denied",
    )
    .await;
    let again = ws
        .ok("session.unsubscribe", json!({"session_id": sids[1]}))
        .await;
    assert_eq!(again["unsubscribed"], false, "{again}");
    ws.ok("session.resume", json!({"session_id": sids[1]}))
        .await;
    ws.submit(&sids[1], "back", "back").await;
    let done = ws
        .event(Duration::from_secs(20), |e| e["type"] == "message.complete")
        .await;
    assert_eq!(done["session_id"], sids[1]);
    // The one it kept following was never let go, and still reports.
    ws.submit(&sids[0], "kept", "kept").await;
    let done = ws
        .event(Duration::from_secs(20), |e| {
            e["type"] == "message.complete" && e["session_id"] == sids[0].as_str()
        })
        .await;
    assert_eq!(done["session_id"], sids[0]);
}

/// Pipelined in one write: a `prompt.submit` read right behind the `session.resume` that makes
/// the connection follow the session waits for it (it was refused `permission_denied`: each
/// request saw the connection as it was when the request was read), and the inputs run in the
/// order sent.
#[actix_rt::test]
async fn a_submit_pipelined_behind_its_resume_finds_the_session_followed() {
    let model = FakeModel::ack();
    let (home, d) = Daemon::with_model(&model, json!({}));
    let origin = d.origin();
    let mut ws = d.ws().await;
    let sid = ws.session("piped", &home.path).await;
    let mut raw = RawWs::connect(&home.path, &origin);
    let mut both = RawWs::masked_text(
        json!({"jsonrpc": "2.0", "id": "r", "method": "session.resume", "params": {"session_id": sid}})
            .to_string()
            .as_bytes(),
    );
    for i in 0..3 {
        both.extend(RawWs::masked_text(
            json!({"jsonrpc": "2.0", "id": format!("s{i}"), "method": "prompt.submit",
                   "params": {"session_id": sid, "input_id": format!("piped-{i}"), "text": format!("piped {i}")}})
            .to_string()
            .as_bytes(),
        ));
    }
    raw.write_all(&both);
    let ids: Vec<Value> = (0..4)
        .map(|_| {
            let v = raw.reply();
            assert!(v.get("error").is_none(), "{v}");
            v["id"].clone()
        })
        .collect();
    // The resume answers first (the submits wait for it); the submits then run concurrently,
    // so their answers may come in any order, but they are admitted (and run) in order.
    assert_eq!(ids[0], "r");
    let mut submits: Vec<String> = ids[1..]
        .iter()
        .filter_map(|v| v.as_str().map(str::to_string))
        .collect();
    submits.sort();
    assert_eq!(submits, ["s0", "s1", "s2"]);
    wait_until("the piped turns", Duration::from_secs(20), || {
        all_terminal(&home)
    })
    .await;
    assert_eq!(model.texts(), ["piped 0", "piped 1", "piped 2"]);
}

/// Page reads and receipts pipelined past the most one connection has in flight at once
/// (four) wait their turn, and every one is answered, as is every resume among them and an
/// input sent behind them.
#[actix_rt::test]
async fn reads_pipelined_past_their_bound_are_all_answered() {
    let model = FakeModel::ack();
    let (home, d) = Daemon::with_model(&model, json!({}));
    let origin = d.origin();
    let mut ws = d.ws().await;
    let sid = ws.session("reads", &home.path).await;
    let first = ws.submit(&sid, "first", "first").await;
    wait_until("first", Duration::from_secs(20), || all_terminal(&home)).await;
    let mut raw = RawWs::connect(&home.path, &origin);
    let mut sent = Vec::new();
    let mut frames = Vec::new();
    for i in 0..10 {
        for (id, method, params) in [
            (
                format!("r{i}"),
                "session.resume",
                json!({"session_id": sid}),
            ),
            (
                format!("e{i}"),
                "session.events.since",
                json!({"session_id": sid, "last_sequence": 0}),
            ),
            (
                format!("p{i}"),
                "prompt.receipt",
                json!({"session_id": sid, "admission_id": first["admission_id"]}),
            ),
        ] {
            frames.extend(RawWs::masked_text(
                json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params})
                    .to_string()
                    .as_bytes(),
            ));
            sent.push(id);
        }
    }
    frames.extend(RawWs::masked_text(
        json!({"jsonrpc": "2.0", "id": "s", "method": "prompt.submit",
               "params": {"session_id": sid, "input_id": "behind", "text": "behind"}})
        .to_string()
        .as_bytes(),
    ));
    sent.push("s".into());
    raw.write_all(&frames);
    let mut answered: Vec<String> = (0..sent.len())
        .map(|_| {
            let v = raw.reply();
            assert!(v.get("error").is_none(), "{v}");
            v["id"].as_str().unwrap_or_default().to_string()
        })
        .collect();
    answered.sort();
    sent.sort();
    assert_eq!(answered, sent);
    wait_until("behind", Duration::from_secs(20), || all_terminal(&home)).await;
    assert_eq!(model.texts(), ["first", "behind"]);
}

/// A `session.unsubscribe` pipelined behind more page reads of its session than one connection
/// runs at once waits for them: every read is answered as the session was followed when it was
/// sent, none refused as not followed.
#[actix_rt::test]
async fn an_unsubscribe_behind_waiting_reads_does_not_overtake_them() {
    let model = FakeModel::ack();
    let (home, d) = Daemon::with_model(&model, json!({}));
    let origin = d.origin();
    let mut ws = d.ws().await;
    let sid = ws.session("unsub-reads", &home.path).await;
    ws.submit(&sid, "first", "first").await;
    wait_until("first", Duration::from_secs(20), || all_terminal(&home)).await;
    let mut raw = RawWs::connect(&home.path, &origin);
    let mut frames = RawWs::masked_text(
        json!({"jsonrpc": "2.0", "id": "resume", "method": "session.resume",
               "params": {"session_id": sid}})
        .to_string()
        .as_bytes(),
    );
    for i in 0..12 {
        frames.extend(RawWs::masked_text(
            json!({"jsonrpc": "2.0", "id": format!("e{i}"), "method": "session.events.since",
                   "params": {"session_id": sid, "last_sequence": 0}})
            .to_string()
            .as_bytes(),
        ));
    }
    frames.extend(RawWs::masked_text(
        json!({"jsonrpc": "2.0", "id": "unsub", "method": "session.unsubscribe",
               "params": {"session_id": sid}})
        .to_string()
        .as_bytes(),
    ));
    raw.write_all(&frames);
    let mut answered = Vec::new();
    for _ in 0..14 {
        let v = raw.reply();
        assert!(v.get("error").is_none(), "{v}");
        let id = v["id"].as_str().unwrap_or_default().to_string();
        if id == "unsub" {
            assert_eq!(v["result"]["unsubscribed"], true, "{v}");
        }
        answered.push(id);
    }
    answered.sort();
    let mut sent: Vec<String> = (0..12).map(|i| format!("e{i}")).collect();
    sent.extend(["resume".to_string(), "unsub".to_string()]);
    sent.sort();
    assert_eq!(answered, sent);
}

/// Inputs a client pipelines on one connection, without waiting for their receipts, are
/// admitted in the order it sent them, also while the receipts of earlier ones come back. Each
/// request runs as a task of its own; a task that finished could let a later request reach its
/// session (and the session its commit) before an earlier one, so the FIFO held the inputs in
/// another order than the client's.
#[actix_rt::test]
async fn inputs_pipelined_on_one_connection_are_admitted_in_the_order_sent() {
    const BATCHES: usize = 12;
    const PER_BATCH: usize = 16;
    let model = FakeModel::ack();
    let (home, d) = Daemon::with_model(&model, json!({}));
    let origin = d.origin();
    let mut ws = d.ws().await;
    let sid = ws.session("ordered", &home.path).await;
    let mut raw = RawWs::connect(&home.path, &origin);
    raw.write_all(&RawWs::masked_text(
        json!({"jsonrpc": "2.0", "id": "r", "method": "session.resume", "params": {"session_id": sid}})
            .to_string()
            .as_bytes(),
    ));
    assert_eq!(raw.reply()["id"], "r");
    let mut expected = Vec::new();
    let mut answered = 0;
    for batch in 0..BATCHES {
        let mut bytes = Vec::new();
        for i in 0..PER_BATCH {
            let input = format!("ordered-{:03}", batch * PER_BATCH + i);
            bytes.extend(RawWs::masked_text(
                json!({"jsonrpc": "2.0", "id": input, "method": "prompt.submit",
                       "params": {"session_id": sid, "input_id": input, "text": input}})
                .to_string()
                .as_bytes(),
            ));
            expected.push(input);
        }
        raw.write_all(&bytes);
        // Some receipts of earlier inputs come back while later ones are read.
        if batch > 0 {
            for _ in 0..PER_BATCH / 2 {
                let v = raw.reply();
                assert!(v.get("error").is_none(), "{v}");
                answered += 1;
            }
        }
    }
    while answered < expected.len() {
        let v = raw.reply();
        assert!(v.get("error").is_none(), "{v}");
        answered += 1;
    }
    let admitted: Vec<String> = home
        .admissions()
        .into_iter()
        .filter(|a| a.target_session_id == sid)
        .map(|a| a.request_id)
        .collect();
    assert_eq!(admitted, expected, "admitted in another order than sent");
}

/// A connection follows at most `gateway.max_sessions_per_connection` sessions: each one it
/// follows keeps its supervisor in memory for the connection's life, so a client creating or
/// resuming sessions without end held them all (past `session.max_in_memory`). One more is
/// refused `rate_limited`; one already followed is not one more; an unsubscribe makes room.
#[actix_rt::test]
async fn a_connection_follows_a_bounded_number_of_sessions() {
    let model = FakeModel::ack();
    let (home, d) = Daemon::with_model(
        &model,
        json!({"gateway": {"max_sessions_per_connection": 2}}),
    );
    let mut ws = d.ws().await;
    let a = ws.session("a", &home.path).await;
    let b = ws.session("b", &home.path).await;
    let refused = ws
        .refused(
            "session.create",
            json!({"request_id": "c", "cwd": home.path.to_string_lossy()}),
            "rate_limited",
        )
        .await;
    assert!(
        refused["error"]["data"]["detail"]
            .as_str()
            .is_some_and(|m| m.contains("unsubscribe")),
        "{refused}"
    );
    // A create that names no request makes a new session each time: it counts too.
    for params in [json!({"cwd": home.path.to_string_lossy()}), json!(null)] {
        ws.refused("session.create", params, "rate_limited").await;
    }
    // Another connection has a bound of its own.
    let mut other = d.ws().await;
    let c = other.session("c", &home.path).await;
    other.ok("session.resume", json!({"session_id": a})).await;
    // Following what it follows already is not one more.
    ws.ok("session.resume", json!({"session_id": b})).await;
    ws.submit(&a, "still", "still").await;
    ws.refused("session.resume", json!({"session_id": c}), "rate_limited")
        .await;
    ws.ok("session.unsubscribe", json!({"session_id": a})).await;
    ws.ok("session.resume", json!({"session_id": c})).await;
    ws.refused("session.resume", json!({"session_id": a}), "rate_limited")
        .await;
}

/// Requests that change a session reach it in the order a connection sent them: a submit sent
/// right behind a cancel that frees a place in a full queue takes that place. The submit was
/// handed to the session when read and the cancel only after its lookup, so the submit came
/// first, found the queue full and was refused `session_busy`.
#[actix_rt::test]
async fn a_submit_pipelined_behind_a_cancel_finds_its_place() {
    let (_model, home, d, _ws, sid, q2) = a_full_queue("in-order").await;
    let q2 = q2["admission_id"].clone();
    // Both in one write, as a client that does not wait sends them.
    let mut raw = RawWs::connect(&home.path, &d.origin());
    let mut both = RawWs::masked_text(
        json!({"jsonrpc": "2.0", "id": "r", "method": "session.resume", "params": {"session_id": sid}})
            .to_string()
            .as_bytes(),
    );
    raw.write_all(&both);
    assert_eq!(raw.reply()["id"], "r");
    both = RawWs::masked_text(
        json!({"jsonrpc": "2.0", "id": "cancel", "method": "prompt.cancel",
               "params": {"session_id": sid, "admission_id": q2}})
        .to_string()
        .as_bytes(),
    );
    both.extend(RawWs::masked_text(
        json!({"jsonrpc": "2.0", "id": "submit", "method": "prompt.submit",
               "params": {"session_id": sid, "input_id": "Q3", "text": "Q3"}})
        .to_string()
        .as_bytes(),
    ));
    raw.write_all(&both);
    let replies = [raw.reply(), raw.reply()];
    for r in &replies {
        assert!(r.get("error").is_none(), "{replies:?}");
    }
    assert_eq!(home.admission("Q2").outcome.as_deref(), Some("cancelled"));
    assert_eq!(home.admission("Q3").status, "queued");
}
