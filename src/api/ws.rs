//! `GET /api/ws`: the WebSocket (JSON-RPC 2.0 text frames). All WebSocket code lives here.

use std::any::Any;
use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use actix::prelude::*;
use actix_web::{web, HttpRequest, HttpResponse};
use actix_web_actors::ws;
use serde_json::{json, Value};

use super::auth::Credential;
use super::http::AppState;
use super::rpc::{Authority, Caller, Subscriptions};
use crate::error::GatewayError;
use crate::session::registry::UnsubscribeFrom;
use crate::session::supervisor::PushEvent;

static NEXT_CONN: AtomicU64 = AtomicU64::new(1);

/// Open connections, so that a graceful stop can close them (1001) instead of waiting them out.
static OPEN: Mutex<BTreeMap<u64, Recipient<CloseNow>>> = Mutex::new(BTreeMap::new());

/// Close the connection (1001 "going away" unless another code is given).
#[derive(Message)]
#[rtype(result = "()")]
pub struct CloseNow(pub &'static str);

/// Open WebSocket connections and HTTP requests that wait (event streams, long polls, chat
/// completions), counted against `gateway.max_connections`.
static CONNECTIONS: AtomicUsize = AtomicUsize::new(0);

/// One connection's place under `gateway.max_connections`, given back when it is dropped.
pub(crate) struct Slot;

impl Slot {
    fn take(max: usize) -> Option<Slot> {
        let before = CONNECTIONS.fetch_add(1, Ordering::SeqCst);
        if before >= max {
            CONNECTIONS.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        Some(Slot)
    }

    /// A place for an HTTP request that waits (an event stream, a long poll, a chat
    /// completion), or its refusal: uncounted, one client's waiting requests could take every
    /// connection the server accepts, the other clients' and the WebSockets' included.
    pub(crate) fn for_waiting(max: usize) -> Result<Slot, GatewayError> {
        Slot::take(max).ok_or_else(|| {
            GatewayError::RateLimited(format!(
                "too many open connections and waiting requests (gateway.max_connections = \
                 {max})"
            ))
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        CONNECTIONS.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A duplicate of the connection's socket, so a consumer too slow to read its frames can be cut
/// off even while its writer is blocked (the connection's actor does not run then).
#[derive(Clone)]
pub struct ConnSocket(Arc<OwnedFd>);

impl ConnSocket {
    /// How many bytes the client's end has acknowledged in all (`TCP_INFO`), when the kernel
    /// says: it grows while the client reads, even while one frame takes long to go out.
    pub(crate) fn bytes_acked(&self) -> Option<u64> {
        // SAFETY: `tcp_info` is plain data (all integers): zeroes are a valid value.
        let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
        // SAFETY: getsockopt(2) on a descriptor we own, into a buffer of `len` bytes.
        let rc = unsafe {
            libc::getsockopt(
                self.0.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_INFO,
                (&mut info as *mut libc::tcp_info).cast(),
                &mut len,
            )
        };
        // An older kernel fills less of the structure.
        let needed = std::mem::offset_of!(libc::tcp_info, tcpi_bytes_acked) + 8;
        (rc == 0 && len as usize >= needed).then_some(info.tcpi_bytes_acked)
    }

    pub(crate) fn shutdown(&self) {
        // SAFETY: shutdown(2) on a descriptor we own; it only ends the connection.
        unsafe {
            libc::shutdown(self.0.as_raw_fd(), libc::SHUT_RDWR);
        }
    }
}

/// `HttpServer::on_connect` hook: remember a duplicate of every TCP connection's socket.
pub fn on_connect(conn: &dyn Any, ext: &mut actix_web::dev::Extensions) {
    if let Some(tcp) = conn.downcast_ref::<actix_web::rt::net::TcpStream>() {
        if let Ok(fd) = tcp.as_fd().try_clone_to_owned() {
            ext.insert(ConnSocket(Arc::new(fd)));
        }
    }
}

/// Ask every open WebSocket connection to close; returns how many were asked.
pub fn close_all(reason: &'static str) -> usize {
    let open: Vec<Recipient<CloseNow>> = OPEN
        .lock()
        .map(|m| m.values().cloned().collect())
        .unwrap_or_default();
    for r in &open {
        r.do_send(CloseNow(reason));
    }
    open.len()
}

pub const SUBPROTOCOL: &str = "gatehouse.v1";
pub const TICKET_PREFIX: &str = "gatehouse-ticket.";

/// The upgrade: a valid single-use ticket (or API key) first, then `gatehouse.v1`.
pub async fn ws_route(
    req: HttpRequest,
    stream: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse, actix_web::Error> {
    let offered: Vec<String> = req
        .headers()
        .get_all("sec-websocket-protocol")
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(',').map(|s| s.trim().to_string()))
        .collect();
    let cfg = &state.authority.shared.config.gateway;
    // Checked before the ticket is spent, so a refused client may retry with it.
    let Some(slot) = Slot::take(cfg.max_connections) else {
        return Ok(HttpResponse::ServiceUnavailable()
            .insert_header(("retry-after", super::auth::RETRY_AFTER_SECONDS))
            .json(
                json!({"error": {"reason": "rate_limited", "message": format!(
                "too many open connections (gateway.max_connections = {})", cfg.max_connections)}}),
            ));
    };
    // No credential at all is refused as such (401) before anything else is asked of the
    // request: there is no ticket to keep for a retry.
    let ticket = offered
        .iter()
        .find_map(|p| p.strip_prefix(TICKET_PREFIX).map(str::to_string));
    if ticket.is_none() && !req.headers().contains_key("authorization") {
        return Ok(HttpResponse::Unauthorized().json(
            json!({"error": {"reason": "permission_denied", "message": "a ticket subprotocol or API key is required"}}),
        ));
    }
    // The rest of the request is checked before the ticket is spent too: a client refused for
    // a missing subprotocol or a stripped handshake header can retry with the same ticket.
    if !offered.iter().any(|p| p == SUBPROTOCOL) {
        return Ok(HttpResponse::BadRequest()
            .json(json!({"error": {"reason": "invalid_request", "message": "offer the gatehouse.v1 subprotocol"}})));
    }
    if let Err(e) = ws::handshake(&req) {
        return Ok(HttpResponse::BadRequest().json(
            json!({"error": {"reason": "invalid_request", "message": format!("not a WebSocket upgrade: {e}")}}),
        ));
    }
    let credential = match ticket {
        Some(_) => Credential::ticket(&state.auth),
        None => Credential::of(&state.auth, &req),
    };
    let principal = match ticket {
        Some(t) => {
            match state.tickets.redeem(&t) {
                Ok(p) => p,
                Err(why) => return Ok(HttpResponse::Unauthorized().json(
                    json!({"error": {"reason": "permission_denied", "message": why.to_string()}}),
                )),
            }
        }
        None => match state.bearer_principal(&req) {
            Some(p) => p,
            None => {
                return Ok(HttpResponse::Unauthorized().json(
                    json!({"error": {"reason": "permission_denied", "message": "the API key or token is not valid"}}),
                ));
            }
        },
    };
    let conn = WsConnection {
        authority: state.authority.clone(),
        principal,
        conn_id: NEXT_CONN.fetch_add(1, Ordering::Relaxed),
        subscribed: Subscriptions::default(),
        last_seen: Instant::now(),
        seen_acked: 0,
        max_frame: cfg.max_frame_bytes,
        max_followed: cfg.max_sessions_per_connection,
        heartbeat: Duration::from_secs_f64(cfg.heartbeat_seconds),
        client_timeout: Duration::from_secs_f64(cfg.client_timeout_seconds),
        partial: None,
        in_flight: 0,
        barriers: 0,
        slow_ordered: 0,
        reads: 0,
        reads_waiting: std::collections::VecDeque::new(),
        held: std::collections::VecDeque::new(),
        waiting_bytes: 0,
        following: Vec::new(),
        next_follow: 0,
        credential,
        outbox: None,
        outbox_actor: None,
        pending: Arc::new(Outbound::default()),
        socket: req.conn_data::<ConnSocket>().cloned(),
        _slot: slot,
    };
    let frame_size = cfg.max_frame_bytes.saturating_mul(4).max(64 * 1024);
    // The decoder is given one frame at a time: it buffered all the socket gave, without bound.
    let stream = super::inbound::FrameAtATime::new(stream, frame_size);
    let mut accepted = ws::WsResponseBuilder::new(conn, &req, stream)
        .protocols(&[SUBPROTOCOL])
        .frame_size(frame_size)
        .start()?;
    // The subprotocols may come on several header lines (RFC 6455 allows it), where the
    // handshake reads only the first: the upgrade, its ticket spent, answered without the
    // subprotocol, which a strict client refuses. It was offered (checked above): say so.
    let protocol = actix_web::http::header::SEC_WEBSOCKET_PROTOCOL;
    if !accepted.headers().contains_key(&protocol) {
        accepted.headers_mut().insert(
            protocol,
            actix_web::http::header::HeaderValue::from_static(SUBPROTOCOL),
        );
    }
    Ok(accepted)
}

/// What the heartbeat's own pings may have had acknowledged between two looks (an empty ping
/// is 2 bytes on the wire; two may fall between looks), which says nothing of the client.
const PINGS_ACKED: u64 = 4;

/// Requests one connection may have read and not yet answered. Past it a request is refused at
/// once (`rate_limited`) instead of queueing work (and memory) without bound for a client that
/// pipelines faster than the store answers; a client that waits for its replies never meets it.
pub const MAX_IN_FLIGHT: usize = 256;

/// Why a request on a connection whose credential no longer holds is refused.
const REVOKED: &str =
    "the connection's API key was revoked (or its token expired): the connection ends";

pub struct WsConnection {
    authority: Authority,
    principal: String,
    conn_id: u64,
    subscribed: Subscriptions,
    last_seen: Instant,
    /// The bytes the client had acknowledged at the last heartbeat.
    seen_acked: u64,
    max_frame: usize,
    /// Most sessions the connection may follow (`gateway.max_sessions_per_connection`): each
    /// one followed keeps its supervisor in memory for as long as the connection lives.
    max_followed: usize,
    heartbeat: Duration,
    client_timeout: Duration,
    partial: Option<Vec<u8>>,
    /// Requests read and not yet answered (at most [`MAX_IN_FLIGHT`]).
    in_flight: usize,
    /// Requests in flight that change what the connection follows ([`FOLLOWING`]).
    barriers: usize,
    /// Requests in flight that change a session ([`ORDERED`]) and reach it only after a lookup
    /// (any but a submit, an interrupt or an answer naming a followed root, which is handed
    /// over when read: [`HANDED_OVER`]): a later such request waits until they are answered,
    /// so it cannot reach the session before them (an approval sent after an interrupt must
    /// not run its command first).
    slow_ordered: usize,
    /// Requests in flight that read a whole page ([`READS`]), at most [`MAX_READS_IN_FLIGHT`].
    reads: usize,
    /// Such requests free to run (past every other hold) that wait for one of those to be
    /// answered, in the order they were read, each with the sessions the connection followed
    /// then (it runs as of then). Requests behind them do not wait for them.
    reads_waiting: std::collections::VecDeque<(Waiting, Subscriptions)>,
    /// Requests read behind such a request, in order, waiting for its answer.
    held: std::collections::VecDeque<Waiting>,
    /// The bytes of the requests in `held` and `reads_waiting` (bounded: [`MAX_WAITING_BYTES`]).
    waiting_bytes: usize,
    /// Sessions that a create or resume in flight may already have subscribed this connection
    /// to, by request; and the last request's number.
    following: Vec<(u64, String)>,
    next_follow: u64,
    /// Checked again on every heartbeat: a revoked key or an expired token ends the connection.
    credential: Credential,
    /// Where sessions push this connection's events (see [`Outbox`]).
    outbox: Option<Recipient<PushEvent>>,
    /// The outbox itself, told to stop with the connection: its mailbox (held by every session
    /// and room this connection followed) then reads as closed, and its socket is let go.
    outbox_actor: Option<Addr<Outbox>>,
    /// Event frames handed over by the outbox and not yet written.
    pending: Arc<Outbound>,
    socket: Option<ConnSocket>,
    _slot: Slot,
}

/// What the outbox handed a connection and the connection has not yet written: frames and
/// their bytes; and how many frames it has written in all and how many heartbeats it has run
/// (whether it makes progress), and the bytes its client had acknowledged at the outbox's last
/// look (whether the client takes them in).
#[derive(Default)]
struct Outbound {
    frames: AtomicUsize,
    bytes: AtomicUsize,
    written: AtomicUsize,
    ticks: AtomicUsize,
    acked: AtomicU64,
}

impl Outbound {
    fn handed(&self, m: &PushEvent) {
        self.frames.fetch_add(m.0.len(), Ordering::SeqCst);
        self.bytes.fetch_add(batch_bytes(m), Ordering::SeqCst);
    }

    fn written(&self, m: &PushEvent) {
        self.frames.fetch_sub(m.0.len(), Ordering::SeqCst);
        self.bytes.fetch_sub(batch_bytes(m), Ordering::SeqCst);
        self.written.fetch_add(m.0.len(), Ordering::SeqCst);
    }
}

fn batch_bytes(m: &PushEvent) -> usize {
    m.0.iter().map(|f| f.len()).sum()
}

/// Stands between the sessions and one connection and counts the event frames handed to the
/// connection but not yet written (`pending`). While its client reads, the connection writes
/// them as they come; when the client stops reading, the connection's writer blocks (its actor
/// is not even polled then) and `pending` grows. Past `gateway.outbound_queue_frames` frames or
/// `gateway.outbound_queue_bytes` bytes (a frame may be a whole reply: 30 turns of 6 MB to a
/// client that did not read held 900 MiB under the frame bound alone) the client is told why
/// (1008) and disconnected, so a slow consumer never grows memory without bound and never
/// silently misses events. The outbox also watches that the connection makes progress (writes
/// the frames handed over, runs its heartbeat): the connection's own heartbeat cannot run while
/// its writer is blocked, by events or by replies to requests the client sent without reading
/// them, so a client that stopped reading is cut off here after
/// `gateway.client_timeout_seconds` without progress.
struct Outbox {
    conn: Addr<WsConnection>,
    conn_id: u64,
    socket: Option<ConnSocket>,
    limit: usize,
    limit_bytes: usize,
    pending: Arc<Outbound>,
    cut: bool,
    /// How often progress is checked, and how long it may stall.
    heartbeat: Duration,
    client_timeout: Duration,
    /// Frames written and heartbeats run as of the last check, and since when neither has
    /// moved.
    seen_progress: usize,
    stalled_since: Option<Instant>,
}

impl Actor for Outbox {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        // Its own mailbox only buffers a burst until it forwards (it never blocks).
        ctx.set_mailbox_capacity(self.limit.max(1024));
        ctx.run_interval(self.heartbeat, |act, ctx| {
            // A client still reading a large frame acknowledges its bytes meanwhile (the
            // connection neither writes more nor ticks until that frame is out).
            // Read here only: the connection's heartbeat reads what this saw.
            let acked = act
                .socket
                .as_ref()
                .and_then(ConnSocket::bytes_acked)
                .unwrap_or(0);
            act.pending.acked.store(acked, Ordering::SeqCst);
            let progress = act
                .pending
                .written
                .load(Ordering::SeqCst)
                .wrapping_add(act.pending.ticks.load(Ordering::SeqCst))
                .wrapping_add(acked as usize);
            if progress != act.seen_progress {
                act.seen_progress = progress;
                act.stalled_since = None;
                return;
            }
            let since = *act.stalled_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= act.client_timeout && !act.cut {
                tracing::warn!(
                    conn = act.conn_id,
                    "slow consumer: nothing written for the client timeout; disconnecting"
                );
                act.cut_off("slow consumer: the client stopped reading", ctx);
            }
        });
    }
}

impl Outbox {
    /// Tell the client why (1008) and disconnect it; if its writer is blocked the connection
    /// cannot even send the close frame, so the socket is shut down shortly after.
    fn cut_off(&mut self, reason: &'static str, ctx: &mut Context<Self>) {
        self.cut = true;
        self.conn.do_send(CloseSlow(reason));
        ctx.run_later(Duration::from_millis(500), |act, ctx| {
            if act.conn.connected() {
                if let Some(s) = &act.socket {
                    s.shutdown();
                }
            }
            ctx.stop();
        });
    }
}

/// The connection closed: stop, and let its socket go.
#[derive(Message)]
#[rtype(result = "()")]
struct StopOutbox;

impl Handler<StopOutbox> for Outbox {
    type Result = ();
    fn handle(&mut self, _: StopOutbox, ctx: &mut Context<Self>) {
        self.socket = None;
        ctx.stop();
    }
}

impl Handler<PushEvent> for Outbox {
    type Result = ();
    fn handle(&mut self, m: PushEvent, ctx: &mut Context<Self>) {
        if self.cut {
            return;
        }
        if !self.conn.connected() {
            ctx.stop();
            return;
        }
        let reason = if m.is_lost() {
            tracing::warn!(
                conn = self.conn_id,
                "events lost: a session found this connection's mailbox full; disconnecting"
            );
            "events lost: the connection fell behind"
        } else if self.pending.frames.load(Ordering::SeqCst) < self.limit
            && self.pending.bytes.load(Ordering::SeqCst) < self.limit_bytes
        {
            self.pending.handed(&m);
            self.conn.do_send(m);
            return;
        } else {
            tracing::warn!(
                conn = self.conn_id,
                frames = self.pending.frames.load(Ordering::SeqCst),
                bytes = self.pending.bytes.load(Ordering::SeqCst),
                "slow consumer: outbound queue full; disconnecting"
            );
            "slow consumer: outbound queue full"
        };
        self.cut_off(reason, ctx);
    }
}

/// Close with 1008 because the client does not read its frames (or fell so far behind that a
/// session could not hand it events): it reconnects and reads the log from its last seq.
#[derive(Message)]
#[rtype(result = "()")]
struct CloseSlow(&'static str);

impl Handler<CloseSlow> for WsConnection {
    type Result = ();
    fn handle(&mut self, m: CloseSlow, ctx: &mut Self::Context) {
        ctx.close(Some(ws::CloseReason {
            code: ws::CloseCode::Policy,
            description: Some(m.0.into()),
        }));
        ctx.stop();
    }
}

/// A `session.create` without a `request_id` makes a new session each time: name it here, so
/// the connection knows which session it will follow and counts it against its bound (one
/// made up by the authority was followed uncounted, without bound).
fn name_the_create(params: &mut Value) {
    if params.is_null() {
        *params = Value::Object(serde_json::Map::new());
    }
    if let Some(p) = params.as_object_mut() {
        if p.get("request_id").is_none_or(Value::is_null) {
            let id = uuid::Uuid::new_v4().simple().to_string();
            p.insert("request_id".into(), Value::String(id));
        }
    }
}

fn error_frame(id: Value, err: &GatewayError) -> String {
    text_of(&json!({"jsonrpc": "2.0", "id": id, "error": err.to_rpc_error()}))
}

/// `v` as JSON text, written into one buffer by serde_json's writer: `Value`'s `to_string` goes
/// through the formatter, one small write per token, which cost a reply frame about twice as
/// many instructions.
pub fn text_of(v: &impl serde::Serialize) -> String {
    // Nothing the daemon writes has a map with non-string keys, the only way this fails.
    serde_json::to_string(v).unwrap_or_default()
}

/// The reply frame `{"jsonrpc": "2.0", "id": id, "result": result}`, written straight from its
/// parts (the fields in the order serde_json writes an object's keys) instead of being built as
/// a value that moves the result in.
pub fn result_frame(id: &Value, result: &impl serde::Serialize) -> String {
    #[derive(serde::Serialize)]
    struct ResultFrame<'a, R> {
        id: &'a Value,
        jsonrpc: &'static str,
        result: &'a R,
    }
    text_of(&ResultFrame {
        id,
        jsonrpc: "2.0",
        result,
    })
}

/// One decoded JSON-RPC request: `id` is `None` for a notification (no reply is sent).
#[derive(Debug, Clone, PartialEq)]
pub struct RpcRequest {
    pub id: Option<Value>,
    pub method: String,
    pub params: Value,
}

/// The most bytes of requests one connection may have waiting to run (held behind another, or
/// past the bound of page reads in flight); one more is refused `rate_limited`.
const MAX_WAITING_BYTES: usize = 16 << 20;

/// A request waiting to run, its params kept as the JSON text they were read as, not as a
/// parsed tree: that takes up to sixteen times the text's bytes (`[0,0,…]`), and the 255
/// requests one connection may have waiting held some 4 GiB under the 1 MiB frame bound.
struct Waiting {
    id: Option<Value>,
    method: String,
    params: String,
}

impl Waiting {
    fn of(request: RpcRequest) -> Waiting {
        Waiting {
            id: request.id,
            method: request.method,
            params: request.params.to_string(),
        }
    }

    /// What it takes of the connection's [`MAX_WAITING_BYTES`].
    fn bytes(&self) -> usize {
        self.params.len() + self.method.len()
    }

    /// The request again (its params parsed from the text they were written to).
    fn request(self) -> RpcRequest {
        RpcRequest {
            id: self.id,
            params: serde_json::from_str(&self.params).unwrap_or(Value::Null),
            method: self.method,
        }
    }
}

/// The top level of a frame, as far as the envelope rules read it: an object's four members
/// (each present or not; any other member is skipped as it is parsed, and a repeated one counts
/// as its last value, as in a JSON value), an array, or anything else. Read this way the frame
/// is not built into a JSON value whose map the decoder would only take apart again.
enum Envelope {
    Object(EnvelopeFields),
    Array,
    Other,
}

#[derive(Default)]
struct EnvelopeFields {
    id: Option<Value>,
    jsonrpc: Option<Value>,
    method: Option<Value>,
    params: Option<Value>,
}

#[derive(serde::Deserialize)]
#[serde(field_identifier, rename_all = "lowercase")]
enum EnvelopeKey {
    Id,
    Jsonrpc,
    Method,
    Params,
    #[serde(other)]
    Other,
}

impl<'de> serde::Deserialize<'de> for Envelope {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Envelope, D::Error> {
        d.deserialize_any(EnvelopeVisitor)
    }
}

struct EnvelopeVisitor;

impl<'de> serde::de::Visitor<'de> for EnvelopeVisitor {
    type Value = Envelope;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON-RPC request")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Envelope, A::Error> {
        let mut fields = EnvelopeFields::default();
        while let Some(key) = map.next_key::<EnvelopeKey>()? {
            let slot = match key {
                EnvelopeKey::Id => &mut fields.id,
                EnvelopeKey::Jsonrpc => &mut fields.jsonrpc,
                EnvelopeKey::Method => &mut fields.method,
                EnvelopeKey::Params => &mut fields.params,
                EnvelopeKey::Other => {
                    map.next_value::<serde::de::IgnoredAny>()?;
                    continue;
                }
            };
            *slot = Some(map.next_value()?);
        }
        Ok(Envelope::Object(fields))
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Envelope, A::Error> {
        while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
        Ok(Envelope::Array)
    }

    fn visit_bool<E>(self, _: bool) -> Result<Envelope, E> {
        Ok(Envelope::Other)
    }

    fn visit_i64<E>(self, _: i64) -> Result<Envelope, E> {
        Ok(Envelope::Other)
    }

    fn visit_u64<E>(self, _: u64) -> Result<Envelope, E> {
        Ok(Envelope::Other)
    }

    fn visit_f64<E>(self, _: f64) -> Result<Envelope, E> {
        Ok(Envelope::Other)
    }

    fn visit_str<E>(self, _: &str) -> Result<Envelope, E> {
        Ok(Envelope::Other)
    }

    fn visit_unit<E>(self) -> Result<Envelope, E> {
        Ok(Envelope::Other)
    }
}

/// A number outside the 64-bit integer range: an integer that wide is read as a float.
fn is_wide_integer(n: &serde_json::Number) -> bool {
    !(n.is_i64() || n.is_u64())
        && n.as_f64()
            .is_some_and(|f| f < i64::MIN as f64 || f >= u64::MAX as f64)
}

/// The id of a frame over the bound, when it is a JSON object with a usable one (else `null`),
/// so that the refusal answers the request it refuses. Only `id` is kept: the other members,
/// the frame's bulk, are checked and skipped, never built.
fn id_of_oversized(text: &str) -> Value {
    #[derive(serde::Deserialize)]
    struct IdOnly {
        #[serde(default)]
        id: Option<Value>,
    }
    match serde_json::from_str::<IdOnly>(text) {
        Ok(IdOnly { id: Some(id) }) => usable_id(id),
        _ => Value::Null,
    }
}

/// `id` when it can answer a request (a string, or a number in the 64-bit range), else `null`.
fn usable_id(id: Value) -> Value {
    match id {
        Value::String(_) => id,
        Value::Number(ref n) if !is_wide_integer(n) => id,
        _ => Value::Null,
    }
}

/// The id of a message whose fragments passed the bound before it ended, read from the part
/// received, member by member, as far as it is whole (the rest never came, and is not waited
/// for). An `id` counts only once what follows it (the next member, or the object's end) was
/// received: a number cut short would be another id. The last one read wins, as in a whole
/// message, and none does when the last one was cut off; `null` when none was. (An `id` in the
/// part never received cannot be seen: a message naming its id twice may be answered under the
/// first.)
fn id_of_prefix(bytes: &[u8]) -> Value {
    /// The value at the start of `bytes`, and what follows it.
    fn value<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Option<(T, &[u8])> {
        let mut stream = serde_json::Deserializer::from_slice(bytes).into_iter::<T>();
        let value = stream.next()?.ok()?;
        Some((value, bytes.get(stream.byte_offset()..)?.trim_ascii_start()))
    }
    let mut id = Value::Null;
    let Some(mut rest) = bytes.trim_ascii_start().strip_prefix(b"{") else {
        return id;
    };
    loop {
        let Some((key, after)) = value::<String>(rest.trim_ascii_start()) else {
            return id;
        };
        // An `id` whose value was cut off would have been the id (the last one wins): none is.
        let Some(after) = after.strip_prefix(b":") else {
            return if key == "id" { Value::Null } else { id };
        };
        let after = after.trim_ascii_start();
        let after = if key == "id" {
            let Some((read, after)) = value::<Value>(after) else {
                return Value::Null;
            };
            if !matches!(after.first(), Some(b',' | b'}')) {
                return Value::Null;
            }
            id = usable_id(read);
            after
        } else {
            let Some((serde::de::IgnoredAny, after)) = value(after) else {
                return id;
            };
            after
        };
        match after.strip_prefix(b",") {
            Some(next) => rest = next,
            None => return id,
        }
    }
}

/// Decode one text frame into a request (pure: no I/O). On refusal, the id to answer with (the
/// request's own when it could be read, else `null`) and the typed error.
pub fn parse_request(text: &str, max_bytes: usize) -> Result<RpcRequest, (Value, GatewayError)> {
    if text.len() > max_bytes {
        let err = GatewayError::PayloadTooLarge(format!("frame is over {max_bytes} bytes"));
        return Err((id_of_oversized(text), err));
    }
    let envelope: Envelope = serde_json::from_str(text)
        .map_err(|e| (Value::Null, GatewayError::Parse(e.to_string())))?;
    let mut obj = match envelope {
        Envelope::Object(fields) => fields,
        Envelope::Array => {
            return Err((
                Value::Null,
                GatewayError::InvalidRequest("batch requests are not supported".into()),
            ))
        }
        Envelope::Other => {
            return Err((
                Value::Null,
                GatewayError::InvalidRequest("a request must be an object".into()),
            ))
        }
    };
    let id = obj.id.take();
    let reply_id = match &id {
        // An integer past 64 bits is read as a float and would be echoed as one (`1e+23`, not
        // the digits the client sent): refused rather than misanswered.
        Some(Value::Number(n)) if is_wide_integer(n) => {
            return Err((
                Value::Null,
                GatewayError::InvalidRequest(
                    "a numeric id must be within the 64-bit integer range (use a string id)".into(),
                ),
            ))
        }
        Some(v @ (Value::String(_) | Value::Number(_) | Value::Null)) => v.clone(),
        Some(_) => {
            return Err((
                Value::Null,
                GatewayError::InvalidRequest("id must be a string, number or null".into()),
            ))
        }
        None => Value::Null,
    };
    if obj.jsonrpc.as_ref().and_then(|v| v.as_str()) != Some("2.0") {
        return Err((
            reply_id,
            GatewayError::InvalidRequest("jsonrpc must be \"2.0\"".into()),
        ));
    }
    let Some(Value::String(method)) = obj.method.take() else {
        return Err((
            reply_id,
            GatewayError::InvalidRequest("method must be a string".into()),
        ));
    };
    let params = match obj.params.take() {
        None | Some(Value::Null) => json!({}),
        Some(p @ Value::Object(_)) => p,
        Some(_) => {
            return Err((
                reply_id,
                GatewayError::InvalidParams("params must be an object".into()),
            ))
        }
    };
    Ok(RpcRequest { id, method, params })
}

/// Is `text` a request object without an `id` member (a notification)? Read again only when
/// its params were refused.
fn is_notification(text: &str) -> bool {
    matches!(
        serde_json::from_str::<Envelope>(text),
        Ok(Envelope::Object(EnvelopeFields { id: None, .. }))
    )
}

impl WsConnection {
    /// End a connection whose API key was revoked (or whose token expired): close 1008.
    fn close_revoked(conn_id: u64, ctx: &mut ws::WebsocketContext<Self>) {
        tracing::info!(
            conn = conn_id,
            "the connection's API key was revoked (or its token expired); closing"
        );
        ctx.close(Some(ws::CloseReason {
            code: ws::CloseCode::Policy,
            description: Some("credential revoked or expired".into()),
        }));
        ctx.stop();
    }

    fn handle_text(&mut self, text: &str, ctx: &mut ws::WebsocketContext<Self>) {
        let request = match parse_request(text, self.max_frame) {
            Ok(r) => r,
            // A notification (a request without an `id`) is never answered, also when its
            // params are refused: the reply, `id: null`, would be taken for another's.
            Err((_, GatewayError::InvalidParams(_))) if is_notification(text) => return,
            Err((reply_id, err)) => {
                ctx.text(error_frame(reply_id, &err));
                return;
            }
        };
        // Every request checks the connection's credential, not only the heartbeat: a request
        // sent after its key was revoked is refused and the connection ends at once (it was
        // admitted, and its commands ran, for up to a heartbeat).
        if !self.credential.still_valid() {
            if let Some(id) = request.id {
                ctx.text(error_frame(
                    id,
                    &GatewayError::PermissionDenied(REVOKED.into()),
                ));
            }
            Self::close_revoked(self.conn_id, ctx);
            return;
        }
        if self.in_flight >= MAX_IN_FLIGHT {
            let err = GatewayError::RateLimited(format!(
                "{MAX_IN_FLIGHT} requests of this connection are already in flight: wait for their replies"
            ));
            if let Some(id) = request.id {
                ctx.text(error_frame(id, &err));
            }
            return;
        }
        self.in_flight += 1;
        // Behind anything already held, too: a later request for a session that is followed by
        // now must not overtake an earlier one for it that still waits.
        if !self.held.is_empty()
            || (self.barriers > 0 && self.waits_for_following(&request))
            || self.behind_slow_ordered(&request.method)
        {
            // Read behind a request that changes what this connection follows, and it names a
            // session this connection does not follow (yet): it runs once that one has
            // answered, so a `prompt.submit` sent right behind its `session.resume` finds the
            // session followed. Requests for followed sessions go on meanwhile.
            self.wait(request, ctx, |act, waiting| act.held.push_back(waiting));
            return;
        }
        self.go(request, ctx);
    }

    /// Keep `request` waiting (`put` places it), within the connection's bound of waiting bytes:
    /// past it, refused `rate_limited`.
    fn wait(
        &mut self,
        request: RpcRequest,
        ctx: &mut ws::WebsocketContext<Self>,
        put: impl FnOnce(&mut Self, Waiting),
    ) {
        let waiting = Waiting::of(request);
        if self.waiting_bytes + waiting.bytes() > MAX_WAITING_BYTES {
            self.in_flight -= 1;
            if let Some(id) = waiting.id {
                let err = GatewayError::RateLimited(format!(
                    "this connection's requests waiting to run hold {} bytes, its most: wait \
                     for their replies",
                    self.waiting_bytes
                ));
                ctx.text(error_frame(id, &err));
            }
            return;
        }
        self.waiting_bytes += waiting.bytes();
        put(self, waiting);
    }

    /// A waiting request taken up again; `None` (it is refused, and the connection ends) if
    /// the connection's credential was revoked while it waited: checked as it was read, it
    /// ran after the revocation (an approval it carried let a command run).
    fn resume(
        &mut self,
        waiting: Waiting,
        ctx: &mut ws::WebsocketContext<Self>,
    ) -> Option<RpcRequest> {
        self.waiting_bytes = self.waiting_bytes.saturating_sub(waiting.bytes());
        if !self.credential.still_valid() {
            self.in_flight -= 1;
            if let Some(id) = waiting.id {
                ctx.text(error_frame(
                    id,
                    &GatewayError::PermissionDenied(REVOKED.into()),
                ));
            }
            Self::close_revoked(self.conn_id, ctx);
            return None;
        }
        Some(waiting.request())
    }

    /// Run `request`, free of every hold but the bound of page reads in flight: a page read
    /// past it waits in `reads_waiting`.
    fn go(&mut self, request: RpcRequest, ctx: &mut ws::WebsocketContext<Self>) {
        if READS.contains(&request.method.as_str())
            && (self.reads >= MAX_READS_IN_FLIGHT || !self.reads_waiting.is_empty())
        {
            // With what the connection follows now: a `session.unsubscribe` read after it and
            // answered before it runs does not have it refused.
            let as_followed = self.subscribed.clone();
            self.wait(request, ctx, |act, waiting| {
                act.reads_waiting.push_back((waiting, as_followed))
            });
            return;
        }
        self.dispatch(request, None, ctx);
    }

    /// Must `request` wait for a request that changes a session and is still on its way there
    /// (see `slow_ordered`)?
    fn behind_slow_ordered(&self, method: &str) -> bool {
        self.slow_ordered > 0 && ORDERED.contains(&method)
    }

    /// Does `request` depend on what a request in flight may change in the sessions this
    /// connection follows: one of those requests itself, or one naming a session not followed?
    fn waits_for_following(&self, request: &RpcRequest) -> bool {
        FOLLOWING.contains(&request.method.as_str())
            || request
                .params
                .get("session_id")
                .and_then(Value::as_str)
                .is_some_and(|id| !self.subscribed.contains_key(id))
    }

    /// Run a request read (and counted in flight) earlier; `as_followed`: what the connection
    /// followed when it was read, if not what it follows now.
    fn dispatch(
        &mut self,
        request: RpcRequest,
        as_followed: Option<Subscriptions>,
        ctx: &mut ws::WebsocketContext<Self>,
    ) {
        let RpcRequest {
            id,
            method,
            mut params,
        } = request;
        let reply_id = id.clone().unwrap_or(Value::Null);
        if method == "session.create" {
            name_the_create(&mut params);
        }
        let barrier = FOLLOWING.contains(&method.as_str());
        if barrier {
            self.barriers += 1;
        }
        // A submit, an interrupt or an answer handed to its session at once (see
        // `Authority::begin`) is in order already; any other request that changes a session
        // holds those read after it.
        let handed_over = HANDED_OVER.contains(&method.as_str())
            && params
                .get("session_id")
                .and_then(Value::as_str)
                .is_some_and(|id| super::rpc::followed_supervisor(&self.subscribed, id).is_some());
        let slow_ordered = ORDERED.contains(&method.as_str()) && !handed_over;
        if slow_ordered {
            self.slow_ordered += 1;
        }
        let read = READS.contains(&method.as_str());
        if read {
            self.reads += 1;
        }
        // The session a create or resume may follow before it answers: if the connection closes
        // first, it is told to let go of this connection all the same (see `stopped`).
        let follows = match method.as_str() {
            "session.resume" => params
                .get("session_id")
                .and_then(Value::as_str)
                .map(str::to_string),
            "session.create" => params
                .get("request_id")
                .and_then(Value::as_str)
                .map(|r| super::rpc::session_id_for(&self.principal, r)),
            _ => None,
        };
        // One more session followed past the bound is refused; one already followed (or on
        // its way) is not one more.
        let over = follows.as_ref().is_some_and(|root| {
            !self.subscribed.contains_key(root)
                && !self.following.iter().any(|(_, r)| r == root)
                && self.subscribed.len() + self.following.len() >= self.max_followed
        });
        let follows = follows.filter(|_| !over);
        let follow_token = follows.map(|root| {
            self.next_follow += 1;
            self.following.push((self.next_follow, root));
            self.next_follow
        });
        let caller = Caller {
            principal: self.principal.clone(),
            conn_id: self.conn_id,
            recipient: self.outbox.clone(),
            subscribed: as_followed.unwrap_or_else(|| self.subscribed.clone()),
        };
        tracing::debug!(method = %method, conn = self.conn_id, "rpc");
        // Begun here, in the order the requests were read: an input reaches its session now,
        // not when the task awaiting its answer is first polled (in no fixed order).
        let fut = if over {
            let max = self.max_followed;
            let refused = GatewayError::RateLimited(format!(
                "this connection follows {max} sessions, its most: session.unsubscribe one first"
            ));
            Box::pin(std::future::ready(Err(refused)))
        } else {
            self.authority.begin(method, params, caller)
        };
        ctx.spawn(fut.into_actor(self).map(move |res, act, ctx| {
            act.in_flight -= 1;
            if barrier {
                act.barriers -= 1;
            }
            if slow_ordered {
                act.slow_ordered -= 1;
            }
            if read {
                act.reads -= 1;
                if act.reads < MAX_READS_IN_FLIGHT {
                    if let Some((next, as_followed)) = act.reads_waiting.pop_front() {
                        if let Some(next) = act.resume(next, ctx) {
                            act.dispatch(next, Some(as_followed), ctx);
                        }
                    }
                }
            }
            if let Some(token) = follow_token {
                act.following.retain(|(t, _)| *t != token);
            }
            let frame = match res {
                Ok(r) => {
                    if let Some((root, sup)) = r.subscribe {
                        Arc::make_mut(&mut act.subscribed).insert(root, sup);
                    }
                    if let Some(root) = r.unsubscribe {
                        Arc::make_mut(&mut act.subscribed).remove(&root);
                    }
                    result_frame(&reply_id, &r.result)
                }
                Err(e) => error_frame(reply_id, &e),
            };
            if id.is_some() {
                ctx.text(frame);
            }
            // What was held behind it runs now, in the order it was read, up to the next
            // request that changes what the connection follows.
            while act.barriers == 0 {
                if act
                    .held
                    .front()
                    .is_some_and(|next| act.behind_slow_ordered(&next.method))
                {
                    break;
                }
                let Some(next) = act.held.pop_front() else {
                    break;
                };
                if let Some(next) = act.resume(next, ctx) {
                    act.go(next, ctx);
                }
            }
        }));
    }
}

/// Methods that change a session's or a room's state: a connection's requests of these reach
/// their sessions and rooms in the order it sent them (a room's each after the one before it
/// has answered: each reads the store before it acts, and a `room.cancel` sent right behind
/// its task's `room.admit` was answered `not_found`, the task left to run).
const ORDERED: [&str; 12] = [
    "prompt.submit",
    "prompt.cancel",
    "prompt.resolve_unknown",
    "approval.respond",
    "clarify.respond",
    "session.interrupt",
    "room.create",
    "room.admit",
    "room.cancel",
    "room.retry",
    "room.respond",
    "room.disband",
];

/// Of those, the methods handed to the session's supervisor as they are read when they name a
/// session the connection follows (see `Authority::begin`).
const HANDED_OVER: [&str; 4] = [
    "prompt.submit",
    "approval.respond",
    "clarify.respond",
    "session.interrupt",
];

/// Methods that read a whole page (of events, of tasks: up to 8 MiB each), or a receipt (a
/// settled input's carries its result: an answer of up to `model.max_response_bytes`, and
/// more with its tool calls). Pipelined without bound (256 of them, unread), they held as many
/// pages in memory at once, none counted against the connection's outbound bound, and queued
/// on the store's readers ahead of every other session's reads (a turn's start, a revived
/// supervisor's, whose session then took no input). (A snapshot's `session.create` and
/// `session.resume` go one at a time already: they change what the connection follows.)
const READS: [&str; 3] = ["session.events.since", "room.tasks", "prompt.receipt"];

/// Of those, the most one connection has in flight at once.
const MAX_READS_IN_FLIGHT: usize = 4;

/// Methods that change which sessions a connection follows: a request read behind one of them
/// that names a session not followed waits for its answer (it may need the session followed).
const FOLLOWING: [&str; 3] = ["session.create", "session.resume", "session.unsubscribe"];

impl Actor for WsConnection {
    type Context = ws::WebsocketContext<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        self.authority.shared.metrics.ws_opened();
        if let Ok(mut open) = OPEN.lock() {
            open.insert(self.conn_id, ctx.address().recipient());
        }
        let gateway = &self.authority.shared.config.gateway;
        let outbox = Outbox {
            conn: ctx.address(),
            conn_id: self.conn_id,
            socket: self.socket.clone(),
            limit: gateway.outbound_queue_frames,
            limit_bytes: gateway.outbound_queue_bytes.max(1),
            pending: self.pending.clone(),
            cut: false,
            heartbeat: self.heartbeat,
            client_timeout: self.client_timeout,
            seen_progress: 0,
            stalled_since: None,
        }
        .start();
        self.outbox = Some(outbox.clone().recipient());
        self.outbox_actor = Some(outbox);
        ctx.run_interval(self.heartbeat, |act, ctx| {
            // Seen by the outbox: this connection still runs (its writer is not blocked).
            act.pending.ticks.fetch_add(1, Ordering::SeqCst);
            // A client that took in bytes since the last look is there: it may have had no
            // chance to answer a ping queued behind a large frame it was still reading. Not
            // the pings' own bytes: a client's system acknowledges those for it, so a client
            // that was frozen, or never read, was never let go.
            let acked = act.pending.acked.load(Ordering::SeqCst);
            if acked.wrapping_sub(act.seen_acked) > PINGS_ACKED {
                act.last_seen = Instant::now();
            }
            act.seen_acked = acked;
            let close = if act.last_seen.elapsed() > act.client_timeout {
                Some((
                    ws::CloseCode::Away,
                    "heartbeat timeout",
                    "client stopped answering pings; closing",
                ))
            } else if !act.credential.still_valid() {
                Self::close_revoked(act.conn_id, ctx);
                return;
            } else {
                None
            };
            if let Some((code, why, log)) = close {
                tracing::info!(conn = act.conn_id, "{log}");
                ctx.close(Some(ws::CloseReason {
                    code,
                    description: Some(why.into()),
                }));
                ctx.stop();
                return;
            }
            ctx.ping(b"");
        });
    }

    fn stopped(&mut self, _: &mut Self::Context) {
        self.authority.shared.metrics.ws_closed();
        if let Ok(mut open) = OPEN.lock() {
            open.remove(&self.conn_id);
        }
        // Only sessions still in memory need to hear it (none is revived for this).
        let followed = std::mem::take(&mut self.subscribed);
        // Also the sessions a create or resume still in flight may have subscribed it to: its
        // answer will never be read, so it never recorded them.
        let in_flight = std::mem::take(&mut self.following)
            .into_iter()
            .map(|(_, root)| root)
            .filter(|root| !followed.contains_key(root));
        for root_id in followed.keys().cloned().chain(in_flight) {
            self.authority.registry.do_send(UnsubscribeFrom {
                root_id,
                conn_id: self.conn_id,
            });
        }
        if let Some(rooms) = self.authority.rooms.get() {
            rooms.hub.unsubscribe_all(self.conn_id);
        }
        self.outbox = None;
        if let Some(outbox) = self.outbox_actor.take() {
            outbox.do_send(StopOutbox);
        }
    }
}

impl Handler<CloseNow> for WsConnection {
    type Result = ();
    fn handle(&mut self, m: CloseNow, ctx: &mut Self::Context) {
        ctx.close(Some(ws::CloseReason {
            code: ws::CloseCode::Away,
            description: Some(m.0.to_string()),
        }));
        ctx.stop();
    }
}

impl Handler<PushEvent> for WsConnection {
    type Result = ();
    fn handle(&mut self, m: PushEvent, ctx: &mut Self::Context) {
        for frame in m.0.iter() {
            ctx.text(frame.to_string());
        }
        self.pending.written(&m);
    }
}

impl StreamHandler<Result<ws::Message, ws::ProtocolError>> for WsConnection {
    fn handle(&mut self, item: Result<ws::Message, ws::ProtocolError>, ctx: &mut Self::Context) {
        self.last_seen = Instant::now();
        match item {
            Ok(ws::Message::Text(text)) => self.handle_text(&text, ctx),
            Ok(ws::Message::Binary(_)) => {
                ctx.text(error_frame(
                    Value::Null,
                    &GatewayError::InvalidRequest("binary frames are not supported".into()),
                ));
            }
            Ok(ws::Message::Continuation(item)) => {
                use actix_http::ws::Item;
                let (bytes, last, first) = match &item {
                    Item::FirstText(b) => (b.clone(), false, true),
                    Item::FirstBinary(_) => {
                        // A binary message is refused whole, however it is framed: its
                        // fragments are dropped, never run as a request.
                        self.partial = None;
                        ctx.text(error_frame(
                            Value::Null,
                            &GatewayError::InvalidRequest("binary frames are not supported".into()),
                        ));
                        return;
                    }
                    Item::Continue(b) => (b.clone(), false, false),
                    Item::Last(b) => (b.clone(), true, false),
                };
                if first {
                    self.partial = Some(Vec::new());
                }
                let Some(buf) = self.partial.as_mut() else {
                    return;
                };
                buf.extend_from_slice(&bytes);
                if buf.len() > self.max_frame {
                    // Answered with its id when the part received names it.
                    let id = id_of_prefix(buf);
                    self.partial = None;
                    let err = GatewayError::PayloadTooLarge(format!(
                        "message is over {} bytes",
                        self.max_frame
                    ));
                    ctx.text(error_frame(id, &err));
                    return;
                }
                if last {
                    if let Some(buf) = self.partial.take() {
                        match String::from_utf8(buf) {
                            Ok(text) => self.handle_text(&text, ctx),
                            Err(_) => ctx.text(error_frame(
                                Value::Null,
                                &GatewayError::Parse("message is not UTF-8".into()),
                            )),
                        }
                    }
                }
            }
            Ok(ws::Message::Ping(p)) => ctx.pong(&p),
            Ok(ws::Message::Pong(_)) => {}
            Ok(ws::Message::Close(reason)) => {
                ctx.close(reason);
                ctx.stop();
            }
            Ok(ws::Message::Nop) => {}
            Err(e) => {
                tracing::info!(conn = self.conn_id, error = %e, "websocket protocol error; closing");
                let code = match &e {
                    ws::ProtocolError::Overflow => ws::CloseCode::Size,
                    // A text frame that is not UTF-8 (the codec reports it as an I/O error).
                    ws::ProtocolError::Io(io) if io.to_string().contains("utf-8") => {
                        ws::CloseCode::Invalid
                    }
                    _ => ws::CloseCode::Protocol,
                };
                ctx.close(Some(ws::CloseReason {
                    code,
                    description: Some(e.to_string()),
                }));
                ctx.stop();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A frame is read member by member: a repeated member counts as its last value (as in a
    /// JSON value), other members are skipped but must still be valid JSON, and what is not an
    /// object is refused as before.
    #[test]
    fn a_request_is_read_from_its_envelope_members() {
        let r = parse_request(
            r#"{"jsonrpc":"1.0","i\u0064":"x","extra":[1,{"y":[null]}],"jsonrpc":"2.0","method":"a","method":"b","id":7,"params":{"k":"v"}}"#,
            1 << 20,
        )
        .expect("request");
        assert_eq!(
            r,
            RpcRequest {
                id: Some(json!(7)),
                method: "b".into(),
                params: json!({"k": "v"}),
            }
        );
        let reason = |text: &str| parse_request(text, 1 << 20).map_err(|(id, e)| (id, e.reason()));
        assert_eq!(
            reason(r#"{"jsonrpc":"2.0","method":"m","extra":[1,}"#),
            Err((Value::Null, "parse_error"))
        );
        assert_eq!(
            reason(r#"[{"jsonrpc":"2.0"}]"#),
            Err((Value::Null, "invalid_request"))
        );
        assert_eq!(
            reason(r#""a string""#),
            Err((Value::Null, "invalid_request"))
        );
        assert_eq!(
            reason(r#"{"jsonrpc":"2.0","method":"m"} x"#),
            Err((Value::Null, "parse_error"))
        );
        assert_eq!(
            reason(r#"{"id":null,"jsonrpc":"2.0","method":"m","params":[]}"#),
            Err((Value::Null, "invalid_params"))
        );
        assert_eq!(
            reason(r#"{"id":"q","method":"m"}"#),
            Err((json!("q"), "invalid_request"))
        );
        // A frame over the bound is refused answering its own id, when it has one.
        let pad = "p".repeat(1 << 20);
        for (id, answered) in [
            (json!("big-1"), json!("big-1")),
            (json!(12), json!(12)),
            (json!({"x": 1}), Value::Null),
        ] {
            let big = json!({"jsonrpc": "2.0", "method": "m", "params": {"text": pad}, "id": id});
            assert_eq!(
                reason(&big.to_string()),
                Err((answered, "payload_too_large"))
            );
        }
        assert_eq!(
            reason(&format!("{{\"id\":\"cut\",\"pad\":\"{pad}")),
            Err((Value::Null, "payload_too_large"))
        );
        assert_eq!(
            reason(r#"{"jsonrpc":"2.0","method":"m","id":18446744073709551615}"#).map(|r| r.id),
            Ok(Some(json!(u64::MAX)))
        );
        for id in [json!(1.5), json!(2.0), json!(-9.0e18)] {
            assert_eq!(
                reason(&format!(r#"{{"jsonrpc":"2.0","method":"m","id":{id}}}"#)).map(|r| r.id),
                Ok(Some(id))
            );
        }
        for id in [
            "100000000000000000000000",
            "-1e19",
            "18446744073709551616",
            "1e300",
        ] {
            assert_eq!(
                reason(&format!(r#"{{"jsonrpc":"2.0","method":"m","id":{id}}}"#)),
                Err((Value::Null, "invalid_request")),
                "id {id}"
            );
        }
        // Nesting past the parser's depth limit is refused where a value is built (the params),
        // and skipped without recursion in a member nobody reads.
        let nested = |member: &str| {
            format!(
                r#"{{"jsonrpc":"2.0","method":"m","{member}":{{"a":{}1{}}}}}"#,
                "[".repeat(200),
                "]".repeat(200)
            )
        };
        assert_eq!(reason(&nested("params")), Err((Value::Null, "parse_error")));
        assert!(reason(&nested("extra")).is_ok());
    }

    /// A reply frame written from its parts is, byte for byte, the one built as a value and
    /// written out, for awkward ids and results; so is any value written into one buffer.
    /// A message refused part way through its fragments answers the id of the part received,
    /// once that id is whole: a number is whole only when what follows it came too.
    #[test]
    fn an_oversized_messages_id_is_read_from_the_part_received() {
        for (prefix, id) in [
            (
                r#"{"jsonrpc":"2.0","id":"big","params":{"text":"aaaa"#,
                json!("big"),
            ),
            (
                r#" { "i\u0064" : 12 , "method": "m", "params": [1, 2, {"#,
                json!(12),
            ),
            (r#"{"extra":{"nested":[1,"}"]},"id":7}"#, json!(7)),
            (r#"{"id":1,"id":"second","params":"#, json!("second")),
            // Cut short, or after nothing of it.
            (r#"{"jsonrpc":"2.0","id":12"#, Value::Null),
            (r#"{"jsonrpc":"2.0","id":"bi"#, Value::Null),
            (r#"{"jsonrpc":"2.0","params":{"text":"aaaa"#, Value::Null),
            (r#"{"id":true,"params":"#, Value::Null),
            (r#"{"id":18446744073709551616,"params":"#, Value::Null),
            (r#"{"id":1,"id":{"x":1},"params":"#, Value::Null),
            // A later id cut off would have been the id: the earlier one is not.
            (r#"{"id":1,"id":2"#, Value::Null),
            (r#"{"id":"a","id":"b"#, Value::Null),
            (r#"{"id":1,"id""#, Value::Null),
            (r#"[{"id":1},"#, Value::Null),
            ("\u{feff}{\"id\":1,", Value::Null),
            ("", Value::Null),
        ] {
            assert_eq!(id_of_prefix(prefix.as_bytes()), id, "{prefix}");
        }
    }

    #[test]
    fn a_result_frame_is_the_reply_written_from_its_value() {
        let ids = [
            json!(null),
            json!(7),
            json!(-12.5),
            json!("a\"b\\c"),
            json!("é 🐙"),
        ];
        let results = [
            json!({"admission_id": "0190", "ref": {"session_id": "local-1"}, "sequence": 3,
                   "outcome": null, "status": "queued", "execution_generation": null}),
            json!({"text": "quote \" newline \n nul \u{0} \u{2028}", "list": [1, 2.5, true, {}]}),
            json!([]),
            json!("bare"),
            json!(null),
            json!(12345678901234567890u64),
        ];
        for id in &ids {
            for result in &results {
                let built = json!({"jsonrpc": "2.0", "id": id, "result": result});
                assert_eq!(result_frame(id, result), built.to_string());
                assert_eq!(text_of(&built), built.to_string());
            }
        }
    }
}
