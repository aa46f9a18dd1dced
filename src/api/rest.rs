//! The REST API under `/v1` and its Server-Sent Events stream.
//!
//! Every handler parses its body into a typed request (declared with `api_object!`, which also
//! gives the OpenAPI document its schemas) and goes through the same [`Authority::call`] as the
//! WebSocket: there is no second path that writes admissions. A REST caller is treated as
//! subscribed to every session its principal owns.
//!
//! `GET /v1/sessions/{id}/events` streams the durable event log as SSE: `id:` is the event's
//! `seq`; `Last-Event-ID` (or `?after=`) resumes right after it; live deltas (no `id:`) follow while
//! connected; `: keep-alive` comments keep proxies from closing an idle stream; a `truncated`
//! event says that events after the requested position were pruned (its `id:` is where the
//! stream picks up).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use actix_web::{web, HttpRequest, HttpResponse};
use bytes::Bytes;
use futures_util::StreamExt;
use serde::de::DeserializeOwned;
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;

use super::auth::{ApiError, Credential, Principal, TICKET_HEADER};
use super::http::AppState;
use super::openapi::{self, api_object, ApiSchema, Body, Components, Operation};
use super::rpc::{Authority, Caller, EVENTS_PAGE};
use super::ws::Slot;
use crate::error::GatewayError;
use crate::session::supervisor::{PushEvent, SessionSupervisor, Subscribe, Unsubscribe};

// ---------- wire types ----------

api_object! {
    /// A new session (the parameters of `session.create`). The same principal and `request_id`
    /// give the same session; without `request_id`, the `Idempotency-Key` header is used.
    request struct CreateSession {
        request_id: Option<String>,
        /// `cli` (default), `tui`, `gui`, `api` (unattended: approvals follow
        /// `approvals.unattended_mode`, deny by default) or `acp`.
        source: Option<String>,
        /// An absolute, existing directory.
        cwd: Option<String>,
        model: Option<String>,
        provider: Option<String>,
        base_url: Option<String>,
        /// An empty list means no tools.
        toolsets: Option<Vec<String>>,
        profile: Option<String>,
        title: Option<String>,
    }
}

api_object! {
    /// A message of the live transcript.
    response struct TranscriptMessage {
        id: i64,
        role: String,
        content: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tool_calls: Option<Value>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tool_call_id: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        display_kind: Option<String>,
        /// The model's reasoning text beside its answer, when it sent one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reasoning: Option<String>,
    }
}

api_object! {
    /// What an admission looks like now (`prompt.receipt`).
    response struct Receipt {
        admission_id: String,
        session_id: String,
        input_id: String,
        /// The admission's place in the ledger.
        sequence: i64,
        /// `queued`, `started`, `unknown` or `terminal`.
        status: String,
        /// When terminal: `completed`, `interrupted`, `failed`, `cancelled` or `rejected`.
        outcome: Option<String>,
        authority_epoch: i64,
        execution_generation: Option<i64>,
        /// When terminal: `final_response` (completed) or the error.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        result: Option<Value>,
    }
}

api_object! {
    /// A non-terminal admission, in FIFO order.
    response struct PendingInput {
        admission_id: String,
        input_id: String,
        sequence: i64,
        status: String,
        outcome: Option<String>,
        execution_generation: Option<i64>,
        /// The input's text; of a long one only its first 4,096 characters (see `text_truncated`).
        text: String,
        /// Present (`true`) when `text` is only the start of the input's text.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        text_truncated: Option<bool>,
        /// The whole text's length in characters, when `text` is only its start.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        text_chars: Option<i64>,
    }
}

api_object! {
    /// The launch policy a session was frozen to.
    response struct SessionInfo {
        source: String,
        model: String,
        provider: String,
        base_url: Option<String>,
        cwd: String,
        toolsets: Vec<String>,
        profile: String,
        title: Option<String>,
    }
}

api_object! {
    /// A session snapshot (as `session.resume`).
    response struct SessionSnapshot {
        session_id: String,
        /// The physical session holding the live transcript (changes when it is compacted).
        stored_session_id: String,
        messages: Vec<TranscriptMessage>,
        message_count: usize,
        pending: Vec<PendingInput>,
        /// Open approval and clarify prompts of the running attempt (answer them at
        /// `/v1/sessions/{id}/prompts/{prompt_id}`).
        prompts: Vec<Value>,
        execution_generation: i64,
        running: bool,
        authority_epoch: i64,
        /// The last event seq sent: read `/events` after it to follow on.
        last_sequence: i64,
        revision: i64,
        info: SessionInfo,
    }
}

api_object! {
    /// An input for the session. Its id is `input_id` or the `Idempotency-Key` header: the same
    /// id with the same text returns the same receipt, with other text 409.
    request struct SubmitInput {
        input_id: Option<String>,
        text: String,
    }
}

api_object! {
    /// An answer to an open prompt: `choice` for an approval (one of its `choices`), `answer` for
    /// a clarify question (empty = skipped).
    request struct PromptAnswerBody {
        /// The attempt the prompt belongs to (`stale_generation` otherwise).
        execution_generation: i64,
        choice: Option<String>,
        answer: Option<String>,
    }
}

api_object! {
    response struct PromptAnswerResult {
        /// `resolved` or `already_resolved`.
        status: String,
        prompt_id: String,
    }
}

api_object! {
    /// Settle an `unknown` admission `terminal/interrupted` (it never runs again).
    request struct ResolveUnknownBody {
        admission_id: String,
        execution_generation: i64,
    }
}

api_object! {
    request struct InterruptBody {
        /// The attempt to interrupt (`stale_generation` if it is not the one running): a late
        /// interrupt never stops the turn after it.
        execution_generation: i64,
    }
}

api_object! {
    response struct InterruptResult {
        interrupted: bool,
    }
}

api_object! {
    /// A durable event of a session's log (an SSE `data:` line; `id:` is its `seq`).
    response struct SessionEvent {
        r#type: String,
        session_id: String,
        /// +1 per durable event of the session. Live deltas have no `seq` but `after_seq` and
        /// `live_seq`.
        seq: i64,
        payload: Value,
        created_at: f64,
    }
}

api_object! {
    /// A bearer token for a control-socket ticket, for local clients making many requests.
    response struct TokenResult {
        token: String,
        token_type: String,
        expires_at: i64,
    }
}

api_object! {
    response struct ErrorDetail {
        /// A stable reason (`invalid_params`, `not_found`, `permission_denied`,
        /// `admission_conflict`, `stale_generation`, …).
        reason: String,
        message: String,
    }
}

api_object! {
    /// Every refusal.
    response struct ErrorBody {
        error: ErrorDetail,
    }
}

// ---------- plumbing ----------

/// Largest JSON body of a REST request beyond the input text itself.
const BODY_OVERHEAD: usize = 64 * 1024;

/// What a request body may be: at most `bytes`, arrived within `within` of its headers.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimit {
    pub bytes: usize,
    pub within: Duration,
}

impl BodyLimit {
    /// At most `bytes`, within `http.body_timeout_seconds`.
    pub fn of(state: &AppState, bytes: usize) -> BodyLimit {
        let seconds = state.authority.shared.config.http.body_timeout_seconds;
        BodyLimit {
            bytes,
            within: Duration::from_secs_f64(seconds),
        }
    }
}

/// Read a JSON body within `limit` into `T` (an empty body is `{}`). A body that has not
/// arrived in time is answered 408 (and its connection closed, its rest unread): a client
/// trickling one in held the connection, and the handler, for as long as it liked.
pub async fn read_json<T: DeserializeOwned>(
    mut payload: web::Payload,
    limit: BodyLimit,
) -> Result<T, ApiError> {
    let max = limit.bytes;
    let read = async {
        let mut buf = web::BytesMut::new();
        while let Some(chunk) = payload.next().await {
            let chunk = chunk
                .map_err(|e| ApiError::invalid(format!("cannot read the request body: {e}")))?;
            if buf.len() + chunk.len() > max {
                return Err(ApiError::from(GatewayError::PayloadTooLarge(format!(
                    "the request body is over {max} bytes"
                ))));
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(buf)
    };
    let buf = match tokio::time::timeout(limit.within, read).await {
        Ok(read) => read?,
        Err(_) => {
            return Err(ApiError::new(
                actix_web::http::StatusCode::REQUEST_TIMEOUT,
                "invalid_params",
                format!(
                    "the request body did not arrive within {:?} of its headers",
                    limit.within
                ),
            ))
        }
    };
    let body: &[u8] = if buf.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        &buf
    };
    // Every body is an object: say so, rather than how serde reads a struct from an array
    // ("expected struct CreateSession with 9 elements").
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(ApiError::invalid(
            "bad request body: expected a JSON object".to_string(),
        ));
    }
    serde_json::from_slice(body).map_err(|e| ApiError::invalid(format!("bad request body: {e}")))
}

/// A REST route's body: room for the largest text the session takes, however its client
/// escapes it (JSON writes a character as up to six bytes, `\u0436` for a two-byte one, as
/// Python's `json.dumps` does by default). The text's own limit is checked on its UTF-8 bytes,
/// as over the WebSocket.
pub fn body_limit(state: &AppState) -> BodyLimit {
    let text = state.authority.shared.config.session.max_text_bytes;
    BodyLimit::of(state, text.saturating_mul(6).saturating_add(BODY_OVERHEAD))
}

/// A caller for the authority: `principal`, treated as subscribed to `root`.
pub fn caller(principal: &str, root: Option<&str>) -> Caller {
    Caller {
        principal: principal.to_string(),
        conn_id: 0,
        recipient: None,
        subscribed: std::sync::Arc::new(root.into_iter().map(|r| (r.to_string(), None)).collect()),
    }
}

/// The root id of session `id` when `principal` owns it.
pub async fn owned(state: &AppState, principal: &str, id: &str) -> Result<String, ApiError> {
    Ok(state.authority.owned_root(id, principal).await?.id)
}

/// One authority call whose result is read as `T`.
pub async fn call<T: DeserializeOwned>(
    authority: &Authority,
    method: &str,
    params: Value,
    caller: &Caller,
) -> Result<T, ApiError> {
    let r = authority.call(method, params, caller).await?;
    shaped(method, r.result.into_value())
}

/// A method's result as the documented type.
fn shaped<T: DeserializeOwned>(method: &str, result: Value) -> Result<T, ApiError> {
    serde_json::from_value(result).map_err(|e| {
        ApiError::from(GatewayError::Internal(format!(
            "{method} answered an unexpected shape: {e}"
        )))
    })
}

fn to_params<T: serde::Serialize>(value: &T) -> Map<String, Value> {
    match serde_json::to_value(value) {
        Ok(Value::Object(m)) => m,
        _ => Map::new(),
    }
}

/// An id from the body or the `Idempotency-Key` header (both: they must agree).
pub fn idempotency(
    req: &HttpRequest,
    body: Option<String>,
    name: &str,
) -> Result<Option<String>, ApiError> {
    let header = match req.headers().get("idempotency-key") {
        Some(v) => Some(
            v.to_str()
                .map_err(|_| ApiError::invalid("Idempotency-Key must be visible ASCII"))?
                .trim()
                .to_string(),
        ),
        None => None,
    };
    match (body, header) {
        (Some(b), Some(h)) if b != h => Err(ApiError::invalid(format!(
            "{name} and the Idempotency-Key header differ"
        ))),
        (b, h) => Ok(b.or(h)),
    }
}

fn query<T: DeserializeOwned>(req: &HttpRequest) -> Result<T, ApiError> {
    web::Query::<T>::from_query(req.query_string())
        .map(web::Query::into_inner)
        .map_err(|e| ApiError::invalid(format!("bad query: {e}")))
}

static NEXT_FEED: AtomicU64 = AtomicU64::new(1 << 48);

/// Forwards one session's notifications to an HTTP request.
struct Forwarder {
    tx: mpsc::Sender<Arc<str>>,
    lagged: Arc<AtomicBool>,
    /// Bytes of the frames sent and not yet read ([`FEED_BYTES`] at most, or one frame).
    queued: Arc<AtomicUsize>,
}

impl Actor for Forwarder {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.set_mailbox_capacity(FEED_CAPACITY);
    }
}

impl Handler<PushEvent> for Forwarder {
    type Result = ();
    fn handle(&mut self, m: PushEvent, ctx: &mut Context<Self>) {
        // Events this feed was sent were lost on the way (its mailbox was full, or the session
        // could not read them from its log): the reader reads the log to catch up. Ignored, a
        // lost batch that ended the session's events (its `message.complete`) was never sent.
        if m.is_lost() {
            self.lagged.store(true, Ordering::SeqCst);
            return;
        }
        for frame in m.0.iter() {
            // Counted before it is sent: the reader may take it (and count it out) at once.
            let before = self.queued.fetch_add(frame.len(), Ordering::SeqCst);
            let over = before > 0 && before.saturating_add(frame.len()) > FEED_BYTES;
            let sent = if over {
                Err(mpsc::error::TrySendError::Full(frame.clone()))
            } else {
                self.tx.try_send(frame.clone())
            };
            match sent {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(_)) => {
                    self.queued.fetch_sub(frame.len(), Ordering::SeqCst);
                    // The reader reads the log to catch up: the rest of the batch would be a gap.
                    self.lagged.store(true, Ordering::SeqCst);
                    return;
                }
                Err(mpsc::error::TrySendError::Closed(_)) => {
                    self.queued.fetch_sub(frame.len(), Ordering::SeqCst);
                    ctx.stop();
                    return;
                }
            }
        }
    }
}

const FEED_CAPACITY: usize = 4096;

/// The most bytes of frames a feed holds for its reader (one frame, however large, always
/// fits): past it the frames are dropped and the reader catches up from the log, in pages. A
/// slow reader of a session whose turns answer megabytes held 4,096 of them, its
/// `message.complete` frames each carrying a whole answer.
const FEED_BYTES: usize = 16 << 20;

/// A live subscription of one HTTP request to a session (unsubscribed when dropped).
pub struct Feed {
    rx: mpsc::Receiver<Arc<str>>,
    /// Frames were dropped (the reader was slow): read the log to catch up.
    lagged: Arc<AtomicBool>,
    queued: Arc<AtomicUsize>,
    sup: Addr<SessionSupervisor>,
    conn_id: u64,
}

impl Feed {
    pub async fn open(authority: &Authority, root: &str) -> Result<Feed, ApiError> {
        let sup = authority.supervisor(root).await?;
        let (tx, rx) = mpsc::channel(FEED_CAPACITY);
        let lagged = Arc::new(AtomicBool::new(false));
        let queued = Arc::new(AtomicUsize::new(0));
        let forwarder = Forwarder {
            tx,
            lagged: lagged.clone(),
            queued: queued.clone(),
        }
        .start();
        let conn_id = NEXT_FEED.fetch_add(1, Ordering::Relaxed);
        sup.send(Subscribe {
            conn_id,
            recipient: forwarder.recipient(),
        })
        .await
        .map_err(|_| GatewayError::Internal("session supervisor unavailable".into()))?;
        Ok(Feed {
            rx,
            lagged,
            queued,
            sup,
            conn_id,
        })
    }

    /// The next notification's `params` (`None`: the subscription ended).
    pub async fn next(&mut self) -> Option<Value> {
        let text = self.rx.recv().await?;
        self.queued.fetch_sub(text.len(), Ordering::SeqCst);
        let mut v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        Some(v["params"].take())
    }

    pub fn lagged(&self) -> bool {
        self.lagged.swap(false, Ordering::SeqCst)
    }
}

impl Drop for Feed {
    fn drop(&mut self) {
        self.sup.do_send(Unsubscribe {
            conn_id: self.conn_id,
        });
    }
}

/// Read the receipt of `admission_id` until it is terminal or `deadline` passes.
pub async fn wait_terminal(
    authority: &Authority,
    caller: &Caller,
    root: &str,
    admission_id: &str,
    (deadline, credential): (tokio::time::Instant, Option<&Credential>),
) -> Result<Receipt, ApiError> {
    let params = json!({"session_id": root, "admission_id": admission_id});
    let receipt: Receipt = call(authority, "prompt.receipt", params.clone(), caller).await?;
    if receipt.status == "terminal" || tokio::time::Instant::now() >= deadline {
        return Ok(receipt);
    }
    let mut feed = Feed::open(authority, root).await?;
    loop {
        // A key revoked (or a token expired) while the request waits: refused, as an event
        // stream is cut, rather than answered minutes later with what it no longer may read.
        if credential.is_some_and(|c| !c.still_valid()) {
            return Err(ApiError::unauthorized(
                "the API key was revoked (or the token expired)",
            ));
        }
        // Subscribed first, then read: a settlement cannot slip between the two.
        let receipt: Receipt = call(authority, "prompt.receipt", params.clone(), caller).await?;
        let now = tokio::time::Instant::now();
        if receipt.status == "terminal" || now >= deadline {
            return Ok(receipt);
        }
        let nap = deadline.min(now + Duration::from_secs(1));
        loop {
            tokio::select! {
                params = feed.next() => match params {
                    // A durable event (it has a seq) may be the settlement.
                    Some(p) if p.get("seq").is_some() => break,
                    Some(_) => continue,
                    None => {
                        feed = Feed::open(authority, root).await?;
                        break;
                    }
                },
                _ = tokio::time::sleep_until(nap) => break,
            }
        }
    }
}

// ---------- handlers ----------

async fn create_session(
    req: HttpRequest,
    principal: Principal,
    state: web::Data<AppState>,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let mut body: CreateSession = read_json(payload, body_limit(&state)).await?;
    body.request_id = idempotency(&req, body.request_id.take(), "request_id")?;
    let mut params = to_params(&body);
    params.retain(|_, v| !v.is_null());
    let r = state
        .authority
        .call(
            "session.create",
            Value::Object(params),
            &caller(&principal.0, None),
        )
        .await?;
    let created = r.created;
    let snap: SessionSnapshot = shaped("session.create", r.result.into_value())?;
    Ok(if created {
        HttpResponse::Created().json(snap)
    } else {
        HttpResponse::Ok().json(snap)
    })
}

async fn get_session(
    principal: Principal,
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let snap: SessionSnapshot = call(
        &state.authority,
        "session.resume",
        json!({"session_id": path.into_inner()}),
        &caller(&principal.0, None),
    )
    .await?;
    Ok(HttpResponse::Ok().json(snap))
}

async fn submit_input(
    req: HttpRequest,
    principal: Principal,
    state: web::Data<AppState>,
    path: web::Path<String>,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let root = owned(&state, &principal.0, &path.into_inner()).await?;
    let body: SubmitInput = read_json(payload, body_limit(&state)).await?;
    let input_id = idempotency(&req, body.input_id, "input_id")?
        .ok_or_else(|| ApiError::invalid("input_id or the Idempotency-Key header is required"))?;
    let receipt: Receipt = call(
        &state.authority,
        "prompt.submit",
        json!({"session_id": root, "input_id": input_id, "text": body.text}),
        &caller(&principal.0, Some(&root)),
    )
    .await?;
    Ok(HttpResponse::Accepted().json(receipt))
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct WaitQuery {
    wait: Option<f64>,
}

async fn get_receipt(
    req: HttpRequest,
    principal: Principal,
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    let (id, admission) = path.into_inner();
    let q: WaitQuery = query(&req)?;
    let root = owned(&state, &principal.0, &id).await?;
    let max = state.authority.shared.config.http.max_wait_seconds;
    let wait = q
        .wait
        .filter(|w| w.is_finite())
        .unwrap_or(0.0)
        .clamp(0.0, max);
    let deadline = tokio::time::Instant::now() + Duration::from_secs_f64(wait);
    let c = caller(&principal.0, Some(&root));
    let credential = Credential::of(&state.auth, &req);
    // Read first: one that answers at once takes no place among the requests that wait.
    let now = tokio::time::Instant::now();
    let receipt = wait_terminal(&state.authority, &c, &root, &admission, (now, None)).await?;
    if receipt.status == "terminal" || wait <= 0.0 {
        return Ok(HttpResponse::Ok().json(receipt));
    }
    let _slot = Slot::for_waiting(state.authority.shared.config.gateway.max_connections)?;
    let receipt = wait_terminal(
        &state.authority,
        &c,
        &root,
        &admission,
        (deadline, Some(&credential)),
    )
    .await?;
    Ok(HttpResponse::Ok().json(receipt))
}

async fn cancel_input(
    principal: Principal,
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    let (id, admission) = path.into_inner();
    let root = owned(&state, &principal.0, &id).await?;
    let receipt: Receipt = call(
        &state.authority,
        "prompt.cancel",
        json!({"session_id": root, "admission_id": admission}),
        &caller(&principal.0, Some(&root)),
    )
    .await?;
    Ok(HttpResponse::Ok().json(receipt))
}

async fn answer_prompt(
    principal: Principal,
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let (id, prompt_id) = path.into_inner();
    let root = owned(&state, &principal.0, &id).await?;
    let body: PromptAnswerBody = read_json(payload, body_limit(&state)).await?;
    let (method, key, value) = match (body.choice, body.answer) {
        (Some(choice), None) => ("approval.respond", "choice", choice),
        (None, Some(answer)) => ("clarify.respond", "answer", answer),
        _ => {
            return Err(ApiError::invalid(
                "send either `choice` (approval) or `answer` (clarify)",
            ))
        }
    };
    let result: PromptAnswerResult = call(
        &state.authority,
        method,
        json!({"session_id": root, "prompt_id": prompt_id,
               "execution_generation": body.execution_generation, key: value}),
        &caller(&principal.0, Some(&root)),
    )
    .await?;
    Ok(HttpResponse::Ok().json(result))
}

async fn resolve_unknown(
    principal: Principal,
    state: web::Data<AppState>,
    path: web::Path<String>,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let root = owned(&state, &principal.0, &path.into_inner()).await?;
    let body: ResolveUnknownBody = read_json(payload, body_limit(&state)).await?;
    let receipt: Receipt = call(
        &state.authority,
        "prompt.resolve_unknown",
        json!({"session_id": root, "admission_id": body.admission_id,
               "execution_generation": body.execution_generation}),
        &caller(&principal.0, Some(&root)),
    )
    .await?;
    Ok(HttpResponse::Ok().json(receipt))
}

async fn interrupt(
    principal: Principal,
    state: web::Data<AppState>,
    path: web::Path<String>,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let root = owned(&state, &principal.0, &path.into_inner()).await?;
    let body: InterruptBody = read_json(payload, body_limit(&state)).await?;
    let result: InterruptResult = call(
        &state.authority,
        "session.interrupt",
        json!({"session_id": root, "execution_generation": body.execution_generation}),
        &caller(&principal.0, Some(&root)),
    )
    .await?;
    Ok(HttpResponse::Ok().json(result))
}

/// `POST /v1/auth/token`: exchange a control-socket ticket (`X-Gatehouse-Ticket`) for a bearer
/// token. Only a ticket is accepted: a token must not outlive the revocation of a key.
async fn token(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let Some(ticket) = req.headers().get(TICKET_HEADER) else {
        return Err(ApiError::unauthorized(
            "send X-Gatehouse-Ticket: <ticket from the control socket>",
        ));
    };
    let principal = state
        .tickets
        .redeem(ticket.to_str().unwrap_or("").trim())
        .map_err(|why| ApiError::unauthorized(why.to_string()))?;
    let (token, expires_at) = state.auth.tokens.mint(&principal);
    Ok(HttpResponse::Ok().json(TokenResult {
        token,
        token_type: "bearer".into(),
        expires_at: expires_at as i64,
    }))
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct EventsQuery {
    after: Option<i64>,
}

async fn events(
    req: HttpRequest,
    principal: Principal,
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let root = owned(&state, &principal.0, &path.into_inner()).await?;
    let q: EventsQuery = query(&req)?;
    // A reconnecting EventSource sends Last-Event-ID to the same URL: it wins over `?after=`.
    let after = match (req.headers().get("last-event-id"), q.after) {
        (Some(h), _) => h
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse::<i64>().ok())
            .ok_or_else(|| ApiError::invalid("Last-Event-ID must be an event seq"))?,
        (None, Some(a)) => a,
        (None, None) => 0,
    };
    if after < 0 {
        return Err(ApiError::invalid(
            "the event seq to resume after must be 0 or more",
        ));
    }
    // A position past the log's head (from another session, or a store made again) would be
    // followed in silence: every event up to it is taken as already seen.
    let head = state.authority.events_since(&root, after, 1).await?;
    if after > head.last_sequence {
        return Err(ApiError::invalid(format!(
            "the event seq to resume after ({after}) is past this session's last event ({})",
            head.last_sequence
        )));
    }
    let slot = Slot::for_waiting(state.authority.shared.config.gateway.max_connections)?;
    let feed = Feed::open(&state.authority, &root).await?;
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    let keepalive =
        Duration::from_secs_f64(state.authority.shared.config.http.sse_keepalive_seconds);
    let out = SseOut::new(tx, keepalive, &req);
    let budget = out.budget();
    let credential = Credential::of(&state.auth, &req);
    let streamed = stream_events(
        state.authority.clone(),
        root,
        after,
        feed,
        out,
        (keepalive, credential),
    );
    actix_web::rt::spawn(async move {
        let _slot = slot;
        streamed.await
    });
    Ok(sse_response(rx, budget))
}

/// A `text/event-stream` response fed by `rx`, giving back to `budget` what it takes.
pub fn sse_response(
    rx: mpsc::Receiver<Bytes>,
    budget: Arc<tokio::sync::Semaphore>,
) -> HttpResponse {
    let body = futures_util::stream::unfold((rx, budget), |(mut rx, budget)| async move {
        let b = rx.recv().await?;
        budget.add_permits(budget_for(b.len()) as usize);
        Some((Ok::<Bytes, actix_web::Error>(b), (rx, budget)))
    });
    HttpResponse::Ok()
        .content_type("text/event-stream")
        .insert_header(("cache-control", "no-cache"))
        .insert_header(("x-accel-buffering", "no"))
        .streaming(body)
}

/// One SSE event (`data` is one line of JSON).
fn sse_event(id: Option<i64>, kind: &str, data: &Value) -> Bytes {
    let mut s = String::new();
    if let Some(id) = id {
        s.push_str(&format!("id: {id}\n"));
    }
    s.push_str(&format!("event: {kind}\ndata: {data}\n\n"));
    Bytes::from(s)
}

/// Where an event stream writes: a bounded channel to the response body, and how long one write
/// may wait for a reader that takes nothing. Past that the stream ends (its client resumes from
/// its Last-Event-ID) instead of holding its subscription, and its session in memory, for as
/// long as the connection stays open; and its connection is shut down, since what the body
/// still held (up to its channel's frames, and the kernel's send queue) waited for a reader
/// that never came, as long as its peer answered TCP's probes (30 stalled readers held 150 MB).
pub(crate) struct SseOut {
    pub tx: mpsc::Sender<Bytes>,
    within: Duration,
    socket: Option<crate::api::ws::ConnSocket>,
    /// Bytes the body may hold unread ([`SSE_OUT_BYTES`]), given back as it takes them.
    budget: Arc<tokio::sync::Semaphore>,
}

/// The most bytes of events a stream's body holds for its reader (an event larger than that
/// waits for the body to be empty). Its channel's bound was in events only: 64 of an answer's
/// size each.
const SSE_OUT_BYTES: usize = 16 << 20;

/// What an event of `len` bytes takes of a stream's budget.
fn budget_for(len: usize) -> u32 {
    len.min(SSE_OUT_BYTES) as u32
}

impl SseOut {
    /// A stream to `req`'s connection that sends a keep-alive every `keepalive`: a reader that
    /// takes no bytes for four of them (at least 30 s) is not reading.
    pub fn new(tx: mpsc::Sender<Bytes>, keepalive: Duration, req: &HttpRequest) -> SseOut {
        SseOut {
            tx,
            within: (keepalive * 4).max(Duration::from_secs(30)),
            socket: req.conn_data::<crate::api::ws::ConnSocket>().cloned(),
            budget: Arc::new(tokio::sync::Semaphore::new(SSE_OUT_BYTES)),
        }
    }

    /// The budget the response's body gives back to (see [`sse_response`]).
    pub fn budget(&self) -> Arc<tokio::sync::Semaphore> {
        self.budget.clone()
    }

    pub async fn send(&self, event: Bytes) -> Result<(), ()> {
        let sent = async {
            let taken = self
                .budget
                .acquire_many(budget_for(event.len()))
                .await
                .map_err(|_| ())?;
            taken.forget();
            self.tx.send(event).await.map_err(|_| ())
        };
        match tokio::time::timeout(self.within, sent).await {
            Ok(Ok(())) => Ok(()),
            // The body is gone: so is the connection, or it is on its way out.
            Ok(Err(())) => Err(()),
            Err(_) => {
                tracing::info!(within = ?self.within, "a stream's reader took nothing; cut off");
                if let Some(socket) = &self.socket {
                    socket.shutdown();
                }
                Err(())
            }
        }
    }
}

/// Send what the log holds after `*last`, page by page; false when the client is gone.
async fn send_log(authority: &Authority, root: &str, last: &mut i64, out: &SseOut) -> bool {
    loop {
        let page = match authority.events_since(root, *last, EVENTS_PAGE).await {
            Ok(p) => p,
            Err(e) => {
                let body = ApiError::from(e).body();
                let _ = out.send(sse_event(None, "error", &body)).await;
                return false;
            }
        };
        if page.truncated {
            let resume = page
                .events
                .first()
                .map(|e| e.seq - 1)
                .unwrap_or(page.last_sequence);
            let data = json!({"requested_after": *last, "last_sequence": resume,
                              "message": "events after requested_after up to last_sequence were pruned"});
            *last = resume;
            if out
                .send(sse_event(Some(resume), "truncated", &data))
                .await
                .is_err()
            {
                return false;
            }
        }
        for e in &page.events {
            if out
                .send(sse_event(Some(e.seq), &e.kind, &e.to_wire()))
                .await
                .is_err()
            {
                return false;
            }
            *last = e.seq;
        }
        *last = (*last).max(page.last_sequence);
        if !page.has_more {
            return true;
        }
    }
}

async fn stream_events(
    authority: Authority,
    root: String,
    mut last: i64,
    mut feed: Feed,
    out: SseOut,
    (keepalive, credential): (Duration, Credential),
) {
    if out
        .send(Bytes::from_static(b"retry: 1000\n\n"))
        .await
        .is_err()
    {
        return;
    }
    // Subscribed before this read: everything committed from now on also arrives live.
    if !send_log(&authority, &root, &mut last, &out).await {
        return;
    }
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + keepalive, keepalive);
    loop {
        tokio::select! {
            params = feed.next() => {
                let Some(mut params) = params else {
                    // The session dropped this subscriber: end; the client resumes from its id.
                    return;
                };
                if let Some(o) = params.as_object_mut() {
                    o.remove("authority_epoch");
                }
                let kind = params["type"].as_str().unwrap_or("event").to_string();
                let sent = match params.get("seq").and_then(Value::as_i64) {
                    Some(seq) if seq <= last => true,
                    Some(seq) if seq == last + 1 && !feed.lagged() => {
                        last = seq;
                        out.send(sse_event(Some(seq), &kind, &params)).await.is_ok()
                    }
                    // A gap (or dropped frames): the log has them, in order.
                    Some(_) => send_log(&authority, &root, &mut last, &out).await,
                    // A live frame follows the durable event `after_seq`: sent once that one
                    // is (frames dropped for a slow reader are read from the log first), and
                    // dropped when the log has gone past it (the catch-up sent later events).
                    // It went out at once: a delta before the `message.start` dropped ahead of
                    // it, or after its `message.complete`.
                    None => {
                        let after = params.get("after_seq").and_then(Value::as_i64);
                        let behind = feed.lagged() || after.is_some_and(|a| a > last);
                        if behind && !send_log(&authority, &root, &mut last, &out).await {
                            return;
                        }
                        if after.is_some_and(|a| a < last) {
                            true
                        } else {
                            out.send(sse_event(None, &kind, &params)).await.is_ok()
                        }
                    }
                };
                if !sent {
                    return;
                }
            }
            _ = tick.tick() => {
                if !credential.still_valid() {
                    let body = ApiError::unauthorized("the API key was revoked (or the token expired)").body();
                    let _ = out.send(sse_event(None, "error", &body)).await;
                    return;
                }
                let ok = if feed.lagged() {
                    send_log(&authority, &root, &mut last, &out).await
                } else {
                    true
                };
                if !ok || out.send(Bytes::from_static(b": keep-alive\n\n")).await.is_err() {
                    return;
                }
            }
            _ = out.tx.closed() => return,
        }
    }
}

async fn openapi_json(_: Principal) -> HttpResponse {
    HttpResponse::Ok().json(document())
}

async fn unknown_route(_: Principal) -> Result<HttpResponse, ApiError> {
    Err(GatewayError::NotFound("no such route".into()).into())
}

/// A path that exists, asked with a method it does not answer: 405 with `Allow` (after
/// authentication, like every other answer under `/v1`).
async fn method_not_allowed(_: Principal, allow: &'static str) -> HttpResponse {
    let refusal = ApiError::new(
        actix_web::http::StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!("this route answers {allow} only"),
    );
    HttpResponse::MethodNotAllowed()
        .insert_header(("allow", allow))
        .json(refusal.body())
}

/// The resource at `path`, answering `method` with `route` and any other method with 405.
fn only(path: &str, method: &'static str, route: actix_web::Route) -> actix_web::Resource {
    web::resource(path)
        .route(route)
        .default_service(web::to(move |p: Principal| method_not_allowed(p, method)))
}

/// The `/v1` routes.
pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.service(
        web::scope("/v1")
            .service(only("/sessions", "POST", web::post().to(create_session)))
            .service(only("/sessions/{id}", "GET", web::get().to(get_session)))
            .service(only(
                "/sessions/{id}/inputs",
                "POST",
                web::post().to(submit_input),
            ))
            .service(only(
                "/sessions/{id}/inputs/{admission}",
                "GET",
                web::get().to(get_receipt),
            ))
            .service(only(
                "/sessions/{id}/inputs/{admission}/cancel",
                "POST",
                web::post().to(cancel_input),
            ))
            .service(only(
                "/sessions/{id}/prompts/{prompt_id}",
                "POST",
                web::post().to(answer_prompt),
            ))
            .service(only(
                "/sessions/{id}/resolve-unknown",
                "POST",
                web::post().to(resolve_unknown),
            ))
            .service(only(
                "/sessions/{id}/interrupt",
                "POST",
                web::post().to(interrupt),
            ))
            .service(only("/sessions/{id}/events", "GET", web::get().to(events)))
            .service(only("/auth/token", "POST", web::post().to(token)))
            .service(only("/openapi.json", "GET", web::get().to(openapi_json)))
            .service(
                // Its refusals in OpenAI's shape, the wrong method's too.
                web::resource("/chat/completions")
                    .route(web::post().to(super::openai::chat_completions))
                    .default_service(web::to(super::openai::method_not_allowed)),
            )
            .default_service(web::to(unknown_route)),
    );
}

// ---------- the document ----------

fn operations(c: &mut Components) -> Vec<Operation> {
    let errs = |list: &[u16]| list.to_vec();
    let idem = (
        "Idempotency-Key",
        "header",
        "The idempotency id when the body has none",
    );
    vec![
        Operation {
            method: "post",
            path: "/v1/sessions",
            id: "createSession",
            summary: "Create a session (idempotent by request_id / Idempotency-Key): 201 when \
                      created, 200 with the same session when the id had created it before",
            params: vec![idem],
            request: Body::json::<CreateSession>(c),
            status: 201,
            also: vec![200],
            response: Body::json::<SessionSnapshot>(c),
            errors: errs(&[400, 403, 503]),
            error_body: None,
            headers: vec![],
            refusal_headers: vec![],
        },
        Operation {
            method: "get",
            path: "/v1/sessions/{id}",
            id: "getSession",
            summary: "A snapshot of the session",
            params: vec![],
            request: Body::None,
            status: 200,
            also: vec![],
            response: Body::json::<SessionSnapshot>(c),
            errors: errs(&[403, 404, 503]),
            error_body: None,
            headers: vec![],
            refusal_headers: vec![],
        },
        Operation {
            method: "post",
            path: "/v1/sessions/{id}/inputs",
            id: "submitInput",
            summary: "Admit an input (committed before the answer; the same id never runs twice)",
            params: vec![idem],
            request: Body::json::<SubmitInput>(c),
            status: 202,
            also: vec![],
            response: Body::json::<Receipt>(c),
            errors: errs(&[400, 403, 404, 409, 413, 429, 503]),
            error_body: None,
            headers: vec![],
            refusal_headers: vec![],
        },
        Operation {
            method: "get",
            path: "/v1/sessions/{id}/inputs/{admission}",
            id: "getReceipt",
            summary: "The receipt of an admission, with its result when terminal",
            params: vec![(
                "wait",
                "query",
                "Seconds to wait for the admission to become terminal (long poll)",
            )],
            request: Body::None,
            status: 200,
            also: vec![],
            response: Body::json::<Receipt>(c),
            errors: errs(&[400, 403, 404, 429, 503]),
            error_body: None,
            headers: vec![],
            refusal_headers: vec![],
        },
        Operation {
            method: "post",
            path: "/v1/sessions/{id}/inputs/{admission}/cancel",
            id: "cancelInput",
            summary: "Cancel a queued admission",
            params: vec![],
            request: Body::None,
            status: 200,
            also: vec![],
            response: Body::json::<Receipt>(c),
            errors: errs(&[403, 404, 409, 503]),
            error_body: None,
            headers: vec![],
            refusal_headers: vec![],
        },
        Operation {
            method: "post",
            path: "/v1/sessions/{id}/prompts/{prompt_id}",
            id: "answerPrompt",
            summary: "Answer an approval (choice) or clarify (answer) prompt",
            params: vec![],
            request: Body::json::<PromptAnswerBody>(c),
            status: 200,
            also: vec![],
            response: Body::json::<PromptAnswerResult>(c),
            errors: errs(&[400, 403, 404, 409, 503]),
            error_body: None,
            headers: vec![],
            refusal_headers: vec![],
        },
        Operation {
            method: "post",
            path: "/v1/sessions/{id}/resolve-unknown",
            id: "resolveUnknown",
            summary: "Settle an unknown admission as interrupted",
            params: vec![],
            request: Body::json::<ResolveUnknownBody>(c),
            status: 200,
            also: vec![],
            response: Body::json::<Receipt>(c),
            errors: errs(&[400, 403, 404, 409, 503]),
            error_body: None,
            headers: vec![],
            refusal_headers: vec![],
        },
        Operation {
            method: "post",
            path: "/v1/sessions/{id}/interrupt",
            id: "interrupt",
            summary: "Interrupt the running turn",
            params: vec![],
            request: Body::json::<InterruptBody>(c),
            status: 200,
            also: vec![],
            response: Body::json::<InterruptResult>(c),
            errors: errs(&[400, 403, 404, 409, 503]),
            error_body: None,
            headers: vec![],
            refusal_headers: vec![],
        },
        Operation {
            method: "get",
            path: "/v1/sessions/{id}/events",
            id: "streamEvents",
            summary: "The session's events as Server-Sent Events (resumable)",
            params: vec![
                ("Last-Event-ID", "header", "Resume after this event seq"),
                ("after", "query", "Resume after this event seq"),
            ],
            request: Body::None,
            status: 200,
            also: vec![],
            response: Body::Other(
                "text/event-stream",
                json!({"type": "string", "description":
                    "`id: <seq>` / `event: <type>` / `data: <SessionEvent JSON>` per durable event; \
                     live deltas without `id:`; `event: truncated` when pruned events cannot be \
                     sent; `: keep-alive` comments.",
                    "contentSchema": SessionEvent::schema(c)}),
            ),
            errors: errs(&[400, 403, 404, 429, 503]),
            error_body: None,
            headers: vec![],
            refusal_headers: vec![],
        },
        Operation {
            method: "post",
            path: "/v1/auth/token",
            id: "exchangeTicket",
            summary: "Exchange a control-socket ticket (X-Gatehouse-Ticket) for a bearer token",
            params: vec![(
                "X-Gatehouse-Ticket",
                "header",
                "A ticket from the control socket",
            )],
            request: Body::None,
            status: 200,
            also: vec![],
            response: Body::json::<TokenResult>(c),
            errors: vec![],
            error_body: None,
            headers: vec![],
            refusal_headers: vec![],
        },
        Operation {
            method: "get",
            path: "/v1/openapi.json",
            id: "openapi",
            summary: "This document",
            params: vec![],
            request: Body::None,
            status: 200,
            also: vec![],
            response: Body::Json(json!({"type": "object"})),
            errors: vec![],
            error_body: None,
            headers: vec![],
            refusal_headers: vec![],
        },
    ]
}

/// The OpenAPI 3.1 document of `/v1`.
pub fn document() -> Value {
    let mut c = Components::default();
    let mut ops = operations(&mut c);
    ops.extend(super::openai::operations(&mut c));
    let error = ErrorBody::schema(&mut c);
    openapi::document(
        "Gatehouse HTTP API",
        env!("CARGO_PKG_VERSION"),
        "Sessions, inputs, prompts and events over REST and SSE, and an OpenAI-compatible \
         chat-completions facade. Every route needs `Authorization: Bearer <API key or token>` \
         or a single-use `X-Gatehouse-Ticket`.",
        ops,
        c,
        error,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The document lists the refusals each route can give: 503 wherever the store or a
    /// session is asked (each was missing from most routes), 413 wherever a body is read, 429
    /// wherever a wait takes a slot.
    #[test]
    fn every_route_lists_the_refusals_it_can_give() {
        let doc = document();
        let paths = doc["paths"].as_object().expect("paths");
        let mut seen = 0;
        for (path, item) in paths {
            for (method, op) in item.as_object().expect("operations") {
                let id = op["operationId"].as_str().unwrap_or_default();
                let has = |status: &str| op["responses"].get(status).is_some();
                let at = format!("{method} {path}");
                if op.get("requestBody").is_some() {
                    assert!(has("413"), "{at}");
                }
                if !matches!(id, "openapi" | "exchangeTicket") {
                    assert!(has("503"), "{at}");
                    seen += 1;
                }
                if matches!(id, "getReceipt" | "streamEvents") {
                    assert!(has("429"), "{at}");
                }
            }
        }
        assert!(seen >= 10, "{seen} routes");
        // The ticket's exchange takes the ticket alone; every other route a key too.
        assert_eq!(
            paths["/v1/auth/token"]["post"]["security"],
            json!([{"ticket": []}])
        );
        assert_eq!(
            paths["/v1/sessions"]["post"]["security"],
            json!([{"bearer": []}, {"ticket": []}])
        );
    }

    /// An event stream's body holds at most its byte budget unread: one more event waits for
    /// the reader to take one. (Its channel's bound was 64 events, of any size.)
    #[actix_rt::test]
    async fn an_event_stream_holds_at_most_its_budget_unread() {
        use actix_web::body::MessageBody;
        let req = actix_web::test::TestRequest::default().to_http_request();
        let (tx, rx) = mpsc::channel::<Bytes>(64);
        let out = SseOut::new(tx, Duration::from_secs(15), &req);
        let event = Bytes::from(vec![b'x'; SSE_OUT_BYTES / 4]);
        for _ in 0..4 {
            assert_eq!(out.send(event.clone()).await, Ok(()));
        }
        let wait = Duration::from_millis(200);
        assert!(
            tokio::time::timeout(wait, out.send(event.clone()))
                .await
                .is_err(),
            "a fifth event is held"
        );
        let mut body = Box::pin(sse_response(rx, out.budget()).into_body());
        let taken = std::future::poll_fn(|cx| body.as_mut().poll_next(cx)).await;
        assert!(taken.is_some_and(|b| b.is_ok_and(|b| b.len() == event.len())));
        assert_eq!(
            tokio::time::timeout(wait, out.send(event.clone())).await,
            Ok(Ok(())),
            "the reader took one"
        );
    }

    #[test]
    fn the_document_lists_every_route_with_schemas() {
        let doc = document();
        assert_eq!(doc["openapi"], "3.1.0");
        let paths = doc["paths"].as_object().expect("paths");
        for p in [
            "/v1/sessions",
            "/v1/sessions/{id}",
            "/v1/sessions/{id}/inputs",
            "/v1/sessions/{id}/inputs/{admission}",
            "/v1/sessions/{id}/inputs/{admission}/cancel",
            "/v1/sessions/{id}/prompts/{prompt_id}",
            "/v1/sessions/{id}/resolve-unknown",
            "/v1/sessions/{id}/events",
            "/v1/chat/completions",
        ] {
            assert!(paths.contains_key(p), "{p} missing");
        }
        let schemas = doc["components"]["schemas"].as_object().expect("schemas");
        for s in [
            "CreateSession",
            "SessionSnapshot",
            "Receipt",
            "SubmitInput",
            "PromptAnswerBody",
            "ErrorBody",
            "ChatCompletionRequest",
            "ChatCompletion",
            "ChatCompletionChunk",
        ] {
            assert!(schemas.contains_key(s), "{s} missing");
        }
        assert_eq!(
            schemas["SubmitInput"]["required"],
            json!(["text"]),
            "input_id may come from the Idempotency-Key header"
        );
        let submit = &paths["/v1/sessions/{id}/inputs"]["post"];
        assert_eq!(
            submit["requestBody"]["content"]["application/json"]["schema"]["$ref"],
            "#/components/schemas/SubmitInput"
        );
        // A body is required where its object asks for a field: an empty one reads as `{}`,
        // which a session's create takes.
        assert_eq!(submit["requestBody"]["required"], true);
        assert_eq!(
            paths["/v1/sessions"]["post"]["requestBody"]["required"],
            false
        );
        assert!(submit["responses"]["202"].is_object());
        assert!(submit["responses"]["409"].is_object());
        // A create answers 201, or 200 with the same body when the session existed.
        let create = &paths["/v1/sessions"]["post"]["responses"];
        assert_eq!(create["201"]["description"], "Created");
        assert_eq!(create["200"]["content"], create["201"]["content"]);
        // The headers a response carries are named: the chat route's session and admission on
        // its success and on refusals after the request reached a session, and the challenge
        // of every 401.
        let chat = &paths["/v1/chat/completions"]["post"]["responses"];
        for status in ["200", "409", "504"] {
            for h in ["X-Gatehouse-Session", "X-Gatehouse-Admission"] {
                assert_eq!(
                    chat[status]["headers"][h]["schema"]["type"], "string",
                    "{h} on {status}"
                );
            }
        }
        for op in paths
            .values()
            .flat_map(|item| item.as_object().into_iter().flatten())
        {
            let challenge = &op.1["responses"]["401"]["headers"]["WWW-Authenticate"];
            assert!(challenge.is_object(), "{} without its challenge", op.0);
            // An operation that takes a body may be answered 408 when it is slow to arrive.
            assert_eq!(
                op.1.get("requestBody").is_some(),
                op.1["responses"].get("408").is_some(),
                "{}",
                op.0
            );
        }
        assert!(chat.get("408").is_some());
        assert!(submit["responses"]["202"].get("headers").is_none());
        assert!(submit["responses"]["429"]["headers"]["Retry-After"].is_object());
        assert!(submit["responses"]["503"]["headers"]["Retry-After"].is_object());
        assert!(submit["responses"]["409"].get("headers").is_none());
        // Every $ref resolves.
        let text = doc.to_string();
        for r in text.split("\"$ref\":\"#/components/schemas/").skip(1) {
            let name = r.split('"').next().unwrap_or("");
            assert!(schemas.contains_key(name), "dangling $ref {name}");
        }
    }
}
