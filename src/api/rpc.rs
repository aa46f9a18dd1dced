//! The session authority's methods, shared by every transport (WebSocket today). Each method
//! parses its params into a typed struct (unknown fields refused), then goes through the
//! registry → supervisor; there is no second path that writes admissions.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use actix::prelude::*;
use serde::Deserialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::rest::CreateSession;
use super::rooms::RoomsService;
use crate::error::{GatewayError, GatewayResult};
use crate::session::prompts::{PromptAnswer, PromptKind};
use crate::session::registry::{GetSupervisor, SessionRegistry};
use crate::session::supervisor::{
    CancelQueued, GetLive, Interrupt, PushEvent, ResolveUnknown, Respond, SessionSupervisor,
    Submit, Subscribe, Unsubscribe,
};
use crate::session::Shared;
use crate::store::admissions::{self, hex, AdmissionRow};
use crate::store::events;
use crate::store::messages::{self, MessageRow};
use crate::store::prompts as prompt_store;
use crate::store::sessions::{self, NewSession, SessionRow};
use crate::tools::KNOWN_TOOLS;

/// The longest session title a client may give.
const MAX_TITLE_CHARS: usize = 512;
/// The longest model or provider name a client may give.
const MAX_NAME_CHARS: usize = 256;
/// The longest model endpoint URL a client may give.
const MAX_URL_CHARS: usize = 2048;
/// Who is calling, and what it may touch.
#[derive(Clone)]
pub struct Caller {
    pub principal: String,
    pub conn_id: u64,
    pub recipient: Option<Recipient<PushEvent>>,
    pub subscribed: Subscriptions,
}

/// The sessions (roots) a caller follows, each with its supervisor when the caller holds it, so
/// that the hot path (`prompt.submit`) goes straight to the supervisor without asking the
/// registry. Shared, so a request's copy is a reference count.
pub type Subscriptions = Arc<HashMap<String, Option<Addr<SessionSupervisor>>>>;

/// The live supervisor of `session_id` when the caller follows it as a root: a submit for it
/// is handed over as it is begun (see [`Authority::begin`]), with no lookup.
pub fn followed_supervisor<'a>(
    subscribed: &'a Subscriptions,
    session_id: &str,
) -> Option<&'a Addr<SessionSupervisor>> {
    subscribed
        .get(session_id)?
        .as_ref()
        .filter(|sup| sup.connected())
}

/// The answer to a call begun with [`Authority::begin`].
pub type CallFuture = futures_util::future::BoxFuture<'static, GatewayResult<CallResult>>;

/// A call's result: a JSON value, or an admission's receipt, which the WebSocket writes into its
/// reply frame straight from the row it was made of (the hot path: no value is built).
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    Value(Value),
    Receipt(Box<Receipt>),
}

impl Reply {
    /// The result as a JSON value.
    pub fn into_value(self) -> Value {
        match self {
            Reply::Value(v) => v,
            Reply::Receipt(r) => r.into_value(),
        }
    }
}

impl serde::Serialize for Reply {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Reply::Value(v) => v.serialize(s),
            Reply::Receipt(r) => r.serialize(s),
        }
    }
}

impl From<Value> for Reply {
    fn from(v: Value) -> Reply {
        Reply::Value(v)
    }
}

/// An admission's receipt (`prompt.submit`, `prompt.receipt`, …). Its fields are declared in the
/// order serde_json writes an object's keys, so the text is the one the value would write.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Receipt {
    admission_id: String,
    authority_epoch: i64,
    execution_generation: Option<i64>,
    input_id: String,
    outcome: Option<String>,
    #[serde(rename = "ref")]
    reference: ReceiptRef,
    #[serde(skip_serializing_if = "Option::is_none")]
    result: Option<Value>,
    sequence: i64,
    session_id: String,
    status: String,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
struct ReceiptRef {
    session_id: String,
}

impl Receipt {
    /// The receipt of `row` under `epoch` (the row's own owner epoch when it has one); a settled
    /// row carries its result.
    pub fn of(row: &AdmissionRow, epoch: i64) -> Receipt {
        let result = if row.is_terminal() {
            row.result_json
                .as_deref()
                .and_then(|r| serde_json::from_str::<Value>(r).ok())
        } else {
            None
        };
        Receipt::with(row, epoch, result)
    }

    /// The receipt a `prompt.submit` is answered with: [`Receipt::of`] without the result,
    /// which `prompt.receipt` gives (nor is the stored result parsed for it). A finished input
    /// sent again was answered with its whole result (up to `model.max_response_bytes`), so a
    /// client sending it again many times over without reading held that many copies in the
    /// daemon, past every bound on what a connection holds.
    pub fn admitted(row: &AdmissionRow, epoch: i64) -> Receipt {
        Receipt::with(row, epoch, None)
    }

    fn with(row: &AdmissionRow, epoch: i64, result: Option<Value>) -> Receipt {
        Receipt {
            admission_id: row.admission_id.clone(),
            authority_epoch: row.owner_epoch.unwrap_or(epoch),
            execution_generation: row.execution_generation,
            input_id: row.request_id.clone(),
            outcome: row.outcome.clone(),
            reference: ReceiptRef {
                session_id: row.target_session_id.clone(),
            },
            result,
            sequence: row.seq,
            session_id: row.target_session_id.clone(),
            status: row.status.clone(),
        }
    }

    pub fn into_value(self) -> Value {
        // A struct of strings, numbers and values always makes a value.
        serde_json::to_value(self).unwrap_or(Value::Null)
    }
}

/// What a successful call changes on the connection.
pub struct CallResult {
    pub result: Reply,
    /// `session.create` made a new session (rather than finding the one its request id made);
    /// REST answers 201 for it. The RPC result does not carry it.
    pub created: bool,
    /// Follow this root from now on (with its supervisor, when known).
    pub subscribe: Option<(String, Option<Addr<SessionSupervisor>>)>,
    /// Stop following this root.
    pub unsubscribe: Option<String>,
}

impl CallResult {
    /// A result that changes no subscription.
    pub fn plain(result: impl Into<Reply>) -> CallResult {
        CallResult {
            result: result.into(),
            subscribe: None,
            unsubscribe: None,
            created: false,
        }
    }
}

#[derive(Clone)]
pub struct Authority {
    pub shared: Arc<Shared>,
    pub registry: Addr<SessionRegistry>,
    /// The hosted-room service, set once it is built (it needs this authority for its port).
    pub rooms: Arc<std::sync::OnceLock<Arc<RoomsService>>>,
}

fn params<T: for<'de> Deserialize<'de>>(p: Value) -> GatewayResult<T> {
    serde_json::from_value(p).map_err(|e| GatewayError::InvalidParams(e.to_string()))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SessionParams {
    session_id: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SubmitParams {
    session_id: String,
    input_id: String,
    text: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AdmissionParams {
    session_id: String,
    admission_id: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ResolveParams {
    session_id: String,
    admission_id: String,
    execution_generation: i64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ApprovalParams {
    session_id: String,
    execution_generation: Value,
    prompt_id: String,
    choice: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ClarifyParams {
    session_id: String,
    execution_generation: Value,
    prompt_id: String,
    answer: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EventsSinceParams {
    session_id: String,
    last_sequence: i64,
    limit: Option<i64>,
}

/// The most events one `session.events.since` answer carries (ask again from `last_sequence`).
pub const EVENTS_PAGE: i64 = 500;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct InterruptParams {
    session_id: String,
    /// Required, as for every answer to a running attempt: an interrupt meant for one turn that
    /// arrives after it ended must not stop the next.
    execution_generation: i64,
}

/// The sources a client may name (the room runtime's own, `bot_room`, besides).
const CLIENT_SOURCES: &[&str] = &["cli", "tui", "gui", "api", "acp"];

fn check_id(name: &str, v: &str) -> GatewayResult<()> {
    if v.is_empty() || v.len() > 1024 {
        return Err(GatewayError::InvalidParams(format!(
            "{name} must be 1 to 1024 bytes (UTF-8)"
        )));
    }
    Ok(())
}

/// The receipt of an admission.
pub fn receipt(row: &AdmissionRow, epoch: i64) -> Value {
    Receipt::of(row, epoch).into_value()
}

/// The requests that ask a running session's supervisor for a change.
const SESSION_CHANGES: [&str; 3] = ["session.interrupt", "approval.respond", "clarify.respond"];

/// What one of [`SESSION_CHANGES`] asks of the session's supervisor.
enum SessionChange {
    Interrupt(i64),
    Answer {
        kind: PromptKind,
        /// Checked when it is sent (after the session's lookup, on that path).
        generation: Value,
        prompt_id: String,
        answer: PromptAnswer,
    },
}

/// One of [`SESSION_CHANGES`], parsed: the session it names, and what it asks.
fn session_change(method: &str, p: Value) -> GatewayResult<(String, SessionChange)> {
    Ok(match method {
        "session.interrupt" => {
            let p: InterruptParams = params(p)?;
            (
                p.session_id,
                SessionChange::Interrupt(p.execution_generation),
            )
        }
        "approval.respond" => {
            let p: ApprovalParams = params(p)?;
            let answer = SessionChange::Answer {
                kind: PromptKind::Approval,
                generation: p.execution_generation,
                prompt_id: p.prompt_id,
                answer: PromptAnswer::Choice(p.choice),
            };
            (p.session_id, answer)
        }
        "clarify.respond" => {
            let p: ClarifyParams = params(p)?;
            let answer = SessionChange::Answer {
                kind: PromptKind::Clarify,
                generation: p.execution_generation,
                prompt_id: p.prompt_id,
                answer: PromptAnswer::Text(p.answer),
            };
            (p.session_id, answer)
        }
        other => {
            return Err(GatewayError::Internal(format!(
                "{other} asks no change of a session"
            )))
        }
    })
}

/// A pending input in a snapshot: its receipt and its text, of which a long one carries only its
/// first [`admissions::PENDING_TEXT_CHARS`] characters (`text_truncated`, and `text_chars` the
/// whole length: the client sent it, and holds it under its `input_id`).
fn pending_view((row, chars): &(AdmissionRow, i64), epoch: i64) -> Value {
    let mut v = receipt(row, epoch);
    v["text"] = json!(row.text());
    if *chars > admissions::PENDING_TEXT_CHARS {
        v["text_truncated"] = json!(true);
        v["text_chars"] = json!(chars);
    }
    v
}

fn message_view(m: &MessageRow) -> Value {
    let mut v = json!({"id": m.id, "role": m.role, "content": m.content});
    if let Some(calls) = m
        .tool_calls
        .as_deref()
        .and_then(|c| serde_json::from_str::<Value>(c).ok())
    {
        v["tool_calls"] = calls;
    }
    if let Some(id) = &m.tool_call_id {
        v["tool_call_id"] = json!(id);
    }
    if let Some(k) = &m.display_kind {
        v["display_kind"] = json!(k);
    }
    if let Some(r) = &m.reasoning {
        v["reasoning"] = json!(r);
    }
    v
}

/// What a session created for a chat-completions conversation starts with.
#[derive(Debug, Default)]
pub struct Seed {
    /// Earlier turns, as the client sent them (user and assistant text).
    pub messages: Vec<crate::store::messages::NewMessage>,
    /// The client's own system instructions, added to the session's system prompt.
    pub system: Option<String>,
}

/// Deterministic session id from principal and request id.
pub fn session_id_for(principal: &str, request_id: &str) -> String {
    let mut h = Sha256::new();
    h.update(json!([principal, request_id]).to_string().as_bytes());
    format!("local-{}", &hex(&h.finalize())[..32])
}

impl Authority {
    pub async fn supervisor(&self, root: &str) -> GatewayResult<Addr<SessionSupervisor>> {
        self.registry
            .send(GetSupervisor(root.to_string()))
            .await
            .map_err(|_| GatewayError::Internal("session registry unavailable".into()))
    }

    async fn root(&self, id: &str) -> GatewayResult<SessionRow> {
        let id = id.to_string();
        Ok(self
            .shared
            .db
            .read(move |c| sessions::root_of(c, &id))
            .await?)
    }

    /// The root of session `id` when `principal` owns it; `not_found` otherwise, as for a
    /// session that does not exist: session ids can be computed from a principal and a request
    /// id (a chat conversation's is its text's hash), and a refusal that said the session was
    /// another principal's confirmed that principal's sessions, and conversations, to any key.
    pub async fn owned_root(&self, id: &str, principal: &str) -> GatewayResult<SessionRow> {
        let root = self.root(id).await?;
        if root.principal_id != principal {
            return Err(GatewayError::NotFound(format!("no session {id}")));
        }
        Ok(root)
    }

    /// The root of session `id`, which the caller follows on this connection. Another
    /// principal's session is `not_found`, as with [`Authority::owned_root`] (a refusal that
    /// said it was not followed confirmed that it existed); the caller's own, not followed
    /// here, is `permission_denied`.
    async fn followed_root(&self, id: &str, caller: &Caller) -> GatewayResult<SessionRow> {
        let root = self.owned_root(id, &caller.principal).await?;
        Self::require_subscribed(caller, &root.id)?;
        Ok(root)
    }

    fn require_subscribed(caller: &Caller, root: &str) -> GatewayResult<()> {
        if caller.subscribed.contains_key(root) {
            Ok(())
        } else {
            Err(GatewayError::PermissionDenied(
                "create or resume this session on this connection first".into(),
            ))
        }
    }

    /// [`Authority::call`], begun now. A `prompt.submit` for a session the caller follows
    /// reaches that session before this returns: requests a connection begins one after the
    /// other are admitted in that order, however the tasks awaiting their answers are polled.
    pub fn begin(&self, method: String, p: Value, caller: Caller) -> CallFuture {
        if method == "prompt.submit" {
            return match params(p) {
                Ok(p) => self.submit(p, &caller),
                Err(e) => Box::pin(std::future::ready(Err(e))),
            };
        }
        if let Some(handed) = self.hand_over(&method, &p, &caller) {
            return handed;
        }
        let this = self.clone();
        Box::pin(async move { this.call(&method, p, &caller).await })
    }

    /// An interrupt or an answer to a prompt of a session the caller follows and holds the live
    /// supervisor of: handed to the supervisor at once, as it is read, like a submit. Behind a
    /// lookup (a read on the shared readers, then the registry) it waited for other clients'
    /// reads, and on its connection each one held every later request that changes a session
    /// until it was answered: an interrupt sent after an answer waited for the answer to be
    /// recorded (for ever, on a disk that stopped answering).
    fn hand_over(&self, method: &str, p: &Value, caller: &Caller) -> Option<CallFuture> {
        if !SESSION_CHANGES.contains(&method) {
            return None;
        }
        let id = p.get("session_id")?.as_str()?;
        let sup = followed_supervisor(&caller.subscribed, id)?;
        Some(match session_change(method, p.clone()) {
            Ok((_, change)) => Self::send_change(sup, change, caller),
            Err(e) => Box::pin(std::future::ready(Err(e))),
        })
    }

    /// Send `change` to the session's supervisor now; its answer. An answer to a prompt whose
    /// `execution_generation` is not an integer is stale, and sent nowhere.
    fn send_change(
        sup: &Addr<SessionSupervisor>,
        change: SessionChange,
        caller: &Caller,
    ) -> CallFuture {
        let gone = || GatewayError::Internal("session supervisor unavailable".into());
        match change {
            SessionChange::Interrupt(generation) => {
                let sent = sup.send(Interrupt {
                    generation,
                    reason: "client interrupt".into(),
                });
                Box::pin(async move {
                    let done = sent.await.map_err(|_| gone())??;
                    Ok(CallResult::plain(json!({"interrupted": done})))
                })
            }
            SessionChange::Answer {
                kind,
                generation,
                prompt_id,
                answer,
            } => {
                let Some(generation) = generation.as_i64() else {
                    return Box::pin(std::future::ready(Err(GatewayError::StaleGeneration(
                        "execution_generation must be an integer".into(),
                    ))));
                };
                let sent = sup.send(Respond {
                    kind,
                    generation,
                    prompt_id,
                    answer,
                    by: caller.principal.clone(),
                });
                Box::pin(async move { Ok(CallResult::plain(sent.await.map_err(|_| gone())??)) })
            }
        }
    }

    /// `prompt.submit`. The input is handed to its session's supervisor at once when the caller
    /// follows the session and holds its live supervisor (the hot path); else after the lookup.
    fn submit(&self, p: SubmitParams, caller: &Caller) -> CallFuture {
        if let Err(e) = self.check_submit(&p) {
            return Box::pin(std::future::ready(Err(e)));
        }
        // A session this connection created or resumed is a known root: no lookup needed
        // on the hot path (the ledger still checks that the session exists).
        if let Some(sup) = followed_supervisor(&caller.subscribed, &p.session_id) {
            if self.shared.runtime.draining() {
                let root = p.session_id.clone();
                return Box::pin(
                    self.clone()
                        .admitted_before(root, caller.principal.clone(), p),
                );
            }
            let (sup, root) = (sup.clone(), p.session_id.clone());
            return self.admit(&sup, root, caller.principal.clone(), p);
        }
        let (this, caller) = (self.clone(), caller.clone());
        Box::pin(async move {
            let (root_id, known) = match caller.subscribed.get(&p.session_id) {
                Some(sup) => (p.session_id.clone(), sup.clone()),
                None => {
                    let root = this.followed_root(&p.session_id, &caller).await?;
                    let sup = caller.subscribed.get(&root.id).cloned().flatten();
                    (root.id, sup)
                }
            };
            if this.shared.runtime.draining() {
                return this
                    .admitted_before(root_id, caller.principal.clone(), p)
                    .await;
            }
            let sup = match known.filter(|a| a.connected()) {
                Some(a) => a,
                None => this.supervisor(&root_id).await?,
            };
            this.admit(&sup, root_id, caller.principal.clone(), p).await
        })
    }

    /// A submit while the runtime drains: no new input is admitted, but one admitted before is
    /// not new: the same `input_id` with the same text is answered with its receipt, whatever
    /// its status, as at any other time (a client whose reply was lost in the stop learns its
    /// admission), and with other text refused as a conflict.
    async fn admitted_before(
        self,
        root: String,
        principal: String,
        p: SubmitParams,
    ) -> GatewayResult<CallResult> {
        let input = admissions::Input::new(&root, &p.text);
        let row = self
            .shared
            .db
            .read(move |c| admissions::by_request(c, &root, &principal, &p.input_id))
            .await?
            .ok_or(GatewayError::RuntimeDraining)?;
        let row = input.same_as(row)?;
        Ok(CallResult::plain(Reply::Receipt(Box::new(
            Receipt::admitted(&row, self.shared.epoch),
        ))))
    }

    fn check_submit(&self, p: &SubmitParams) -> GatewayResult<()> {
        check_id("input_id", &p.input_id)?;
        // Nothing to say is not an input: the model would be sent an empty user turn.
        if p.text.trim().is_empty() {
            return Err(GatewayError::InvalidParams("text is empty".into()));
        }
        self.shared.config.session.check_text("text", &p.text)
    }

    /// Hand the input to `sup` now; the answer is its admission's receipt.
    fn admit(
        &self,
        sup: &Addr<SessionSupervisor>,
        root_id: String,
        principal: String,
        p: SubmitParams,
    ) -> CallFuture {
        // Bounded: on a disk that stops answering (frozen, failing) the commit may wait
        // for ever. The admission goes on, and may still commit: the same input sent
        // again finds it, or is admitted then.
        let wait = std::time::Duration::from_secs_f64(
            self.shared.config.session.admission_timeout_seconds,
        );
        let epoch = self.shared.epoch;
        let submitted = sup.send(Submit {
            principal,
            input_id: p.input_id,
            text: p.text,
        });
        Box::pin(async move {
            let row: AdmissionRow = match tokio::time::timeout(wait, submitted).await {
                Ok(answer) => answer.map_err(|_| {
                    GatewayError::Internal("session supervisor unavailable".into())
                })??,
                Err(_) => {
                    if let Some(skipped) = crate::error::STORAGE_LOG.admit() {
                        tracing::error!(session = %root_id, ?wait, skipped,
                            "an admission did not commit in time (the disk, or the session, is not answering)");
                    }
                    return Err(GatewayError::StorageUnavailable);
                }
            };
            let receipt = Reply::Receipt(Box::new(Receipt::admitted(&row, epoch)));
            GatewayResult::Ok(CallResult::plain(receipt))
        })
    }

    /// Dispatch one method.
    pub async fn call(&self, method: &str, p: Value, caller: &Caller) -> GatewayResult<CallResult> {
        let plain = |result: Value| Ok(CallResult::plain(result));
        match method {
            "session.create" => self.create(params(p)?, caller).await,
            "session.resume" => {
                let p: SessionParams = params(p)?;
                let root = self.owned_root(&p.session_id, &caller.principal).await?;
                self.opened(root.id, caller, false).await
            }
            "session.unsubscribe" => {
                // Stop following a session: its events stop, and its supervisor may be let go
                // when idle (a followed one never is), so a client that looked at many sessions
                // does not keep them all in memory for the life of its connection.
                let p: SessionParams = params(p)?;
                let root = self.owned_root(&p.session_id, &caller.principal).await?;
                let followed = caller.subscribed.contains_key(&root.id);
                if followed {
                    let sup = self.supervisor(&root.id).await?;
                    sup.do_send(Unsubscribe {
                        conn_id: caller.conn_id,
                    });
                }
                Ok(CallResult {
                    result: json!({"session_id": root.id, "unsubscribed": followed}).into(),
                    subscribe: None,
                    unsubscribe: Some(root.id),
                    created: false,
                })
            }
            "prompt.submit" => self.submit(params(p)?, caller).await,
            "prompt.receipt" => {
                let p: AdmissionParams = params(p)?;
                let root = self.followed_root(&p.session_id, caller).await?;
                let (r, a) = (root.id.clone(), p.admission_id.clone());
                let row = self
                    .shared
                    .db
                    .read(move |c| admissions::of_session(c, &r, &a))
                    .await?;
                plain(receipt(&row, self.shared.epoch))
            }
            "prompt.cancel" => {
                let p: AdmissionParams = params(p)?;
                let root = self.followed_root(&p.session_id, caller).await?;
                let sup = self.supervisor(&root.id).await?;
                let row = sup
                    .send(CancelQueued {
                        admission_id: p.admission_id,
                    })
                    .await
                    .map_err(|_| {
                        GatewayError::Internal("session supervisor unavailable".into())
                    })??;
                plain(receipt(&row, self.shared.epoch))
            }
            "prompt.resolve_unknown" => {
                let p: ResolveParams = params(p)?;
                let root = self.followed_root(&p.session_id, caller).await?;
                let row = self
                    .resolve_unknown(&root.id, &p.admission_id, p.execution_generation)
                    .await?;
                plain(receipt(&row, self.shared.epoch))
            }
            "approval.respond" | "clarify.respond" | "session.interrupt" => {
                let (session_id, change) = session_change(method, p)?;
                let root = self.followed_root(&session_id, caller).await?;
                let sup = self.supervisor(&root.id).await?;
                Self::send_change(&sup, change, caller).await
            }
            "session.events.since" => {
                let p: EventsSinceParams = params(p)?;
                if p.last_sequence < 0 {
                    return Err(GatewayError::InvalidParams(
                        "last_sequence must be 0 or more".into(),
                    ));
                }
                let root = self.followed_root(&p.session_id, caller).await?;
                if p.limit.is_some_and(|n| n < 1) {
                    return Err(GatewayError::InvalidParams(
                        "limit must be 1 or more".into(),
                    ));
                }
                // At most a page at once: `has_more` says to ask again.
                let limit = p.limit.map_or(EVENTS_PAGE, |n| n.min(EVENTS_PAGE));
                let s = self.events_since(&root.id, p.last_sequence, limit).await?;
                // A position past the log's head (from another session, or a store made again)
                // would be followed in silence: every event up to it taken as already seen.
                if p.last_sequence > s.last_sequence {
                    return Err(GatewayError::InvalidParams(format!(
                        "last_sequence {} is past this session's last event ({})",
                        p.last_sequence, s.last_sequence
                    )));
                }
                plain(json!({
                    "events": s.events.iter().map(|e| e.to_wire()).collect::<Vec<_>>(),
                    "last_sequence": s.last_sequence,
                    "truncated": s.truncated,
                    "has_more": s.has_more,
                }))
            }
            m if m.starts_with("room.") => {
                let Some(rooms) = self.rooms.get() else {
                    return Err(GatewayError::UnknownMethod(m.to_string()));
                };
                let wanted = std::sync::Mutex::new(Vec::new());
                let result = rooms
                    .call(m, p, Some(&caller.principal), |room| {
                        if let Ok(mut w) = wanted.lock() {
                            w.push(room.to_string());
                        }
                    })
                    .await?;
                if let Some(r) = &caller.recipient {
                    for room in wanted.into_inner().unwrap_or_default() {
                        rooms.hub.subscribe(&room, caller.conn_id, r.clone());
                    }
                }
                plain(result)
            }
            other => Err(GatewayError::UnknownMethod(other.to_string())),
        }
    }

    /// Durable events of root session `root` after `after` (`session.events.since`, SSE).
    pub async fn events_since(
        &self,
        root: &str,
        after: i64,
        limit: i64,
    ) -> GatewayResult<events::Since> {
        let root = root.to_string();
        Ok(self
            .shared
            .db
            .read_page(move |c| events::since(c, &root, after, limit))
            .await?)
    }

    /// Resolve an unknown admission (shared by the RPC and the operator CLI).
    pub async fn resolve_unknown(
        &self,
        root: &str,
        admission_id: &str,
        generation: i64,
    ) -> GatewayResult<AdmissionRow> {
        let sup = self.supervisor(root).await?;
        sup.send(ResolveUnknown {
            admission_id: admission_id.to_string(),
            generation,
        })
        .await
        .map_err(|_| GatewayError::Internal("session supervisor unavailable".into()))?
    }

    /// Subscribe the caller's connection to `root`'s events; its supervisor (none for a caller
    /// without a connection).
    async fn subscribe(
        &self,
        root: &str,
        caller: &Caller,
    ) -> GatewayResult<Option<Addr<SessionSupervisor>>> {
        let Some(r) = &caller.recipient else {
            return Ok(None);
        };
        let sup = self.supervisor(root).await?;
        // Subscribed before the snapshot is read, not merely asked to be: an event the
        // supervisor delivered between the two (its write's answer handled before the
        // subscription) was in neither the snapshot nor the live stream.
        sup.send(Subscribe {
            conn_id: caller.conn_id,
            recipient: r.clone(),
        })
        .await
        .map_err(|_| GatewayError::Internal("session supervisor unavailable".into()))?;
        Ok(Some(sup))
    }

    async fn create(&self, p: CreateSession, caller: &Caller) -> GatewayResult<CallResult> {
        self.create_seeded(p, Seed::default(), caller).await
    }

    /// `session.create`, the new session starting with `seed` (an existing one is answered as
    /// it is: the seed is part of what its request id names).
    pub async fn create_seeded(
        &self,
        p: CreateSession,
        seed: Seed,
        caller: &Caller,
    ) -> GatewayResult<CallResult> {
        if self.shared.runtime.draining() {
            return Err(GatewayError::RuntimeDraining);
        }
        let cfg = &self.shared.config;
        let request_id = p
            .request_id
            .clone()
            .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string());
        check_id("request_id", &request_id)?;
        let source = p.source.clone().unwrap_or_else(|| "cli".into());
        // `bot_room` names a hosted room's member session: only the room runtime opens those
        // (a client's session under it would take the rooms' platform tools).
        let allowed = CLIENT_SOURCES.contains(&source.as_str())
            || (source == crate::rooms::port::ROOM_SESSION_SOURCE
                && caller.principal == crate::rooms::local::ROOMS_PRINCIPAL);
        if !allowed {
            return Err(GatewayError::InvalidParams(format!(
                "source must be one of {CLIENT_SOURCES:?}"
            )));
        }
        // The same request gives the same session, also after a restart with another config:
        // an existing session is answered before anything the config decides is checked.
        let digest = |cwd: Value| {
            let request = json!({
                "source": source, "cwd": cwd, "model": p.model, "provider": p.provider,
                "base_url": p.base_url, "toolsets": p.toolsets, "profile": p.profile, "title": p.title,
            });
            hex(&Sha256::digest(request.to_string().as_bytes()))
        };
        // The cwd as a path, not as text: "/srv/x/" and "/srv/x" are one request. Sessions
        // created before it was compared so hold the digest of its text.
        let request_digest = digest(json!(p
            .cwd
            .as_ref()
            .map(|c| Path::new(c).components().collect::<std::path::PathBuf>())));
        let legacy_digest = digest(json!(p.cwd));
        let id = session_id_for(&caller.principal, &request_id);
        let lookup = id.clone();
        if let Some(existing) = self
            .shared
            .db
            .read(move |c| sessions::find(c, &lookup))
            .await?
        {
            if existing.request_digest != request_digest && existing.request_digest != legacy_digest
            {
                return Err(GatewayError::InvalidParams(
                    "request_id was already used with different parameters".into(),
                ));
            }
            return self.opened(existing.id, caller, false).await;
        }
        // What a client names is stored with the session and sent on every model call: bounded.
        for (field, value, max) in [
            ("title", &p.title, MAX_TITLE_CHARS),
            ("model", &p.model, MAX_NAME_CHARS),
            ("provider", &p.provider, MAX_NAME_CHARS),
            ("base_url", &p.base_url, MAX_URL_CHARS),
        ] {
            if value.as_ref().is_some_and(|v| v.chars().count() > max) {
                return Err(GatewayError::InvalidParams(format!(
                    "{field} is over {max} characters"
                )));
            }
            // An empty name would be sent to the endpoint as is and fail every turn there; left
            // out, the profile's or the config's is used.
            if field != "title" && value.as_ref().is_some_and(|v| v.trim().is_empty()) {
                return Err(GatewayError::InvalidParams(format!(
                    "{field} must not be empty (leave it out to use the configured one)"
                )));
            }
        }
        let profile = p.profile.clone().unwrap_or_else(|| "default".into());
        let profile_cfg = cfg.profiles.get(&profile);
        if profile != "default" && profile_cfg.is_none() {
            return Err(GatewayError::InvalidParams(format!(
                "no profile {profile:?} in the config"
            )));
        }
        let cwd = match &p.cwd {
            Some(c) => c.clone(),
            None => cfg
                .terminal
                .cwd
                .clone()
                .unwrap_or_else(|| self.shared.home.clone())
                .to_string_lossy()
                .to_string(),
        };
        let cwd_path = Path::new(&cwd);
        let outside = || {
            GatewayError::PermissionDenied(format!(
                "cwd {cwd:?} is outside gateway.allowed_cwd_roots"
            ))
        };
        // A path outside the roots as written is refused as outside whatever it is: that it
        // does not exist, or is no directory, or cannot be resolved, would tell a client what
        // the host has where the roots keep it out. (One that resolves into them is taken.)
        let within = cwd_path.is_absolute() && cfg.gateway.cwd_within_roots_as_written(cwd_path);
        if !cwd_path.is_absolute() || !cwd_path.is_dir() {
            if cwd_path.is_absolute() && !within {
                return Err(outside());
            }
            return Err(GatewayError::InvalidParams(format!(
                "cwd {cwd:?} must be an absolute, existing directory"
            )));
        }
        // The path is resolved once, and the directory checked is the one kept: a symlink on the
        // way retargeted later (or between the check and the resolution, as it could be when
        // each resolved it) does not move the session's tools elsewhere.
        let real = match cwd_path.canonicalize() {
            Ok(real) => real,
            Err(_) if !within => return Err(outside()),
            Err(e) => {
                return Err(GatewayError::InvalidParams(format!(
                    "cwd {cwd:?} cannot be resolved: {e}"
                )))
            }
        };
        if !cfg.gateway.cwd_allowed(&real) {
            return Err(outside());
        }
        let cwd = real.to_string_lossy().into_owned();
        let endpoint = cfg.default_endpoint();
        let model = p
            .model
            .clone()
            .or_else(|| profile_cfg.and_then(|c| c.model.clone()))
            .unwrap_or(endpoint.model.clone());
        let provider = p
            .provider
            .clone()
            .or_else(|| profile_cfg.and_then(|c| c.provider.clone()))
            .unwrap_or(endpoint.provider.clone());
        let base_url = p
            .base_url
            .clone()
            .or_else(|| profile_cfg.and_then(|c| c.base_url.clone()))
            .or(endpoint.base_url);
        if let Some(u) = &base_url {
            if !crate::config::endpoint_url_fits(u) {
                return Err(GatewayError::InvalidParams(
                    "base_url must be http(s) with no credentials, query or fragment".into(),
                ));
            }
            if !cfg.is_configured_endpoint(u) {
                tracing::info!(base_url = %u, "session endpoint is not configured: no API key is sent to it");
            }
        }
        let platform = cfg.platform_tools(&source);
        let toolsets = match &p.toolsets {
            Some(list) => {
                // A client narrows what the operator enabled (the platform's tools, or the
                // profile's), never widens it.
                let profile_tools = profile_cfg.and_then(|c| c.toolsets.as_ref());
                for t in list {
                    if !KNOWN_TOOLS.contains(&t.as_str()) {
                        return Err(GatewayError::InvalidParams(format!(
                            "unknown toolset {t:?}"
                        )));
                    }
                    if !platform.contains(t) && !profile_tools.is_some_and(|p| p.contains(t)) {
                        return Err(GatewayError::InvalidParams(format!(
                            "toolset {t:?} is not enabled for source {source:?} \
                             (platform_toolsets.{source}: {platform:?})"
                        )));
                    }
                }
                // Each tool once: a repeated name would repeat its schema in every model call.
                let mut seen = std::collections::HashSet::new();
                list.iter()
                    .filter(|t| seen.insert(*t))
                    .cloned()
                    .collect::<Vec<String>>()
            }
            // A profile's list offers `clarify` to sessions of its sources that have someone to
            // ask, not to unattended ones unless the operator offers it to their source
            // (`platform_toolsets.api`): a chat completion of such a profile waited out
            // `agent.clarify_timeout` for an answer its client had no way to give.
            None => {
                let ask_nobody = crate::config::is_unattended(&source)
                    && !platform.iter().any(|t| t == "clarify");
                profile_cfg
                    .and_then(|c| c.toolsets.clone())
                    .unwrap_or(platform)
                    .into_iter()
                    .filter(|t| KNOWN_TOOLS.contains(&t.as_str()))
                    .filter(|t| !(ask_nobody && t == "clarify"))
                    .collect()
            }
        };
        // Built once, with the session (its first turn then writes nothing more).
        let mut system_prompt = crate::agent::turn::system_prompt_for(&self.shared, &cwd, &profile);
        if let Some(extra) = seed.system.filter(|s| !s.trim().is_empty()) {
            system_prompt = format!("{system_prompt}\n\n{extra}");
        }
        let new = NewSession {
            id,
            principal_id: caller.principal.clone(),
            request_id,
            request_digest,
            source,
            model,
            provider,
            base_url,
            cwd,
            toolsets_json: serde_json::to_string(&toolsets).unwrap_or_else(|_| "[]".into()),
            profile,
            title: p.title.clone(),
            system_prompt: Some(system_prompt),
            seed: seed.messages,
        };
        let (epoch, now) = (self.shared.epoch, self.shared.now());
        let (row, created) = self
            .shared
            .db
            .write(move |c| sessions::create_or_get(c, epoch, &new, now))
            .await?;
        self.opened(row.id, caller, created).await
    }

    /// The reply to a `session.create` or `session.resume` of `root`: the caller follows it, and
    /// gets its snapshot.
    async fn opened(
        &self,
        root: String,
        caller: &Caller,
        created: bool,
    ) -> GatewayResult<CallResult> {
        let followed = caller.subscribed.contains_key(&root);
        let sup = self.subscribe(&root, caller).await?;
        let snap = match self.snapshot(&root).await {
            Ok(snap) => snap,
            Err(e) => {
                // Refused, the session is not followed: the subscription made for it goes too.
                // Kept, it was one the connection did not know of (its close never ended it),
                // and it pinned the supervisor in memory for good.
                if let Some(sup) = sup.as_ref().filter(|_| !followed) {
                    sup.do_send(Unsubscribe {
                        conn_id: caller.conn_id,
                    });
                }
                return Err(e);
            }
        };
        Ok(CallResult {
            result: snap.into(),
            subscribe: Some((root, sup)),
            unsubscribe: None,
            created,
        })
    }

    /// The snapshot `session.create` and `session.resume` return.
    pub async fn snapshot(&self, root_id: &str) -> GatewayResult<Value> {
        let id = root_id.to_string();
        // One read transaction: the transcript, the inputs still to run and the log's head are
        // of one moment, so the events after `last_sequence` are exactly what the snapshot does
        // not hold. (The head was the supervisor's count of events sent, read after the
        // transcript: a turn that settled in between was counted, and its reply was in neither
        // the snapshot nor the events after it.)
        // The open prompts too: listed from the supervisor's memory, a prompt whose request was
        // committed (and counted in the head) before the turn handed it over was in neither the
        // snapshot nor the events after it, and its client never saw it.
        let (root, msgs, pending, prompts, head) = self
            .shared
            .db
            .read(move |c| {
                diesel::Connection::transaction(c, |c| {
                    let root = sessions::root_of(c, &id)?;
                    let msgs = messages::live(c, &root.tip_session_id)?;
                    let pending = admissions::pending(c, &root.id)?;
                    let prompts = match pending.iter().find(|(r, _)| r.status == "started") {
                        Some((r, _)) => {
                            let generation = r.execution_generation.unwrap_or_default();
                            prompt_store::open_of_attempt(c, &r.admission_id, generation)?
                        }
                        None => Vec::new(),
                    };
                    let head = crate::store::events::head(c, &root.id)?;
                    Ok::<_, crate::error::StoreError>((root, msgs, pending, prompts, head))
                })
            })
            .await?;
        let prompts: Vec<Value> = prompts
            .iter()
            .filter_map(|p| match serde_json::from_str(&p.payload_json) {
                Ok(payload) => Some(payload),
                Err(e) => {
                    tracing::error!(session = %root.id, prompt = %p.prompt_id, error = %e,
                        "an open prompt's JSON does not read back: left out of the snapshot");
                    None
                }
            })
            .collect();
        let sup = self.supervisor(&root.id).await?;
        let live = sup
            .send(GetLive)
            .await
            .map_err(|_| GatewayError::Internal("session supervisor unavailable".into()))?;
        let epoch = self.shared.epoch;
        Ok(json!({
            "session_id": root.id,
            "stored_session_id": root.tip_session_id,
            "messages": msgs.iter().map(message_view).collect::<Vec<_>>(),
            "message_count": msgs.len(),
            "pending": pending.iter().map(|r| pending_view(r, epoch)).collect::<Vec<_>>(),
            "prompts": prompts,
            "execution_generation": root.runtime_generation,
            "running": live.running.is_some(),
            "authority_epoch": epoch,
            "last_sequence": head.last_seq,
            "revision": root.runtime_revision,
            "info": {
                "source": root.source,
                "model": root.model,
                "provider": root.provider,
                "base_url": root.base_url,
                "cwd": root.cwd,
                "toolsets": root.toolsets()?,
                "profile": root.profile,
                "title": root.title,
            },
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(status: &str, outcome: Option<&str>, result_json: Option<&str>) -> AdmissionRow {
        AdmissionRow {
            seq: 42,
            admission_id: "0190aa".into(),
            request_id: "in-\"7\"".into(),
            principal_id: "local".into(),
            target_session_id: "local-é1".into(),
            session_ordinal: 1,
            payload_json: r#"{"text":"hi"}"#.into(),
            payload_digest: "d".into(),
            intent: "queue".into(),
            status: status.into(),
            outcome: outcome.map(str::to_string),
            owner_epoch: (status != "queued").then_some(3),
            execution_generation: (status != "queued").then_some(2),
            result_json: result_json.map(str::to_string),
            created_at: 1.0,
            updated_at: 2.0,
        }
    }

    /// A receipt written from its row is, byte for byte, the one built as a JSON value (the
    /// receipt's definition before it had a type), for a queued, a settled and an unreadable row.
    #[test]
    fn a_receipt_is_written_as_the_value_it_stands_for() {
        let rows = [
            row("queued", None, None),
            row(
                "terminal",
                Some("completed"),
                Some(r#"{"text":"done \n","n":[1,2]}"#),
            ),
            row("terminal", Some("failed"), Some("not json")),
            row("started", None, None),
        ];
        for r in rows {
            let mut v = json!({
                "admission_id": r.admission_id,
                "ref": {"session_id": r.target_session_id},
                "session_id": r.target_session_id,
                "input_id": r.request_id,
                "sequence": r.seq,
                "status": r.status,
                "outcome": r.outcome,
                "authority_epoch": r.owner_epoch.unwrap_or(9),
                "execution_generation": r.execution_generation,
            });
            if r.is_terminal() {
                if let Some(res) = r
                    .result_json
                    .as_deref()
                    .and_then(|j| serde_json::from_str(j).ok())
                {
                    v["result"] = res;
                }
            }
            let reply = Reply::Receipt(Box::new(Receipt::of(&r, 9)));
            assert_eq!(
                crate::api::ws::result_frame(&json!(1), &reply),
                json!({"jsonrpc": "2.0", "id": 1, "result": v}).to_string()
            );
            assert_eq!(reply.into_value(), v);
            assert_eq!(receipt(&r, 9), v);
        }
    }
}
