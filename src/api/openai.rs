//! `POST /v1/chat/completions`: an OpenAI-compatible facade over sessions.
//!
//! The conversation's last user message becomes one input of a session: the one named by the
//! `X-Gatehouse-Session` header (a session id the caller owns, or a name), which keeps its own
//! history; else the session where the same conversation left off, when it is exactly there;
//! else a new one that starts with the client's earlier turns (see [`derived_thread`]). The
//! input id is the `Idempotency-Key` header, else a hash of the request's messages: a retried
//! request joins the same admission instead of running again (after a turn that ended without an
//! answer, it asks again). The answer is the turn's final assistant message, as a
//! `chat.completion` or (with `stream: true`) as `chat.completion.chunk` events ending with
//! `data: [DONE]`; the stream carries `: keep-alive` comments while the turn runs.
//!
//! These sessions are created with source `api`: unattended, so approval-gated commands follow
//! `approvals.unattended_mode` (deny by default) and the `clarify` tool is not offered by default.
//! A request never waits longer than `http.completion_timeout_seconds` (504; sending the same
//! request again keeps waiting for the same turn).

use std::time::Duration;

use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse, ResponseError};
use bytes::Bytes;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

use super::auth::{authenticate, ApiError};
use super::http::AppState;
use super::openapi::{api_object, ApiSchema, Body, Components, Operation};
use super::rest::CreateSession;
use super::rest::{
    call, caller, idempotency, read_json, sse_response, wait_terminal, BodyLimit, Receipt,
    SessionSnapshot, SseOut,
};
use super::rpc::{session_id_for, Authority, Seed};
use super::ws::Slot;
use crate::agent::tokens;
use crate::error::GatewayError;
use crate::store::admissions::{self, hex};
use crate::store::messages::NewMessage;
use crate::store::threads;

/// A message's `content`: a string, or a list of parts whose `text` parts are read (joined by
/// line breaks). Read as it is parsed, keeping only the text: parsed into JSON values, a body of
/// 16 MiB of tiny parts (`[0,0,…]`) took some 256 MB before it was refused, and one client could
/// send many at once.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChatContent(Option<String>);

impl ChatContent {
    /// Its text: the string, or the text parts joined; `None` for a list with no text part.
    pub fn text(&self) -> Option<&str> {
        self.0.as_deref()
    }
}

impl serde::Serialize for ChatContent {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl<'de> serde::Deserialize<'de> for ChatContent {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        /// A content part: its kind and text; any other field is skipped unread.
        #[derive(serde::Deserialize)]
        struct Part {
            #[serde(rename = "type")]
            kind: Option<String>,
            text: Option<String>,
        }
        struct Read;
        impl<'de> serde::de::Visitor<'de> for Read {
            type Value = ChatContent;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string or a list of content parts")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<ChatContent, E> {
                Ok(ChatContent(Some(v.to_string())))
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<ChatContent, E> {
                Ok(ChatContent(Some(v)))
            }
            fn visit_unit<E: serde::de::Error>(self) -> Result<ChatContent, E> {
                Ok(ChatContent(None))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut parts: A,
            ) -> Result<ChatContent, A::Error> {
                let mut text: Option<String> = None;
                while let Some(part) = parts.next_element::<Part>()? {
                    let (Some("text"), Some(t)) = (part.kind.as_deref(), part.text) else {
                        continue;
                    };
                    match &mut text {
                        Some(all) => {
                            all.push('\n');
                            all.push_str(&t);
                        }
                        None => text = Some(t),
                    }
                }
                Ok(ChatContent(text))
            }
        }
        d.deserialize_any(Read)
    }
}

impl ApiSchema for ChatContent {
    fn schema(_: &mut Components) -> Value {
        json!({})
    }
}

/// Names the session of a chat completion.
pub const SESSION_HEADER: &str = "x-gatehouse-session";
/// The admission a chat request's input became (success and refusal alike, once admitted).
pub const ADMISSION_HEADER: &str = "x-gatehouse-admission";
/// The largest request body (a whole conversation).
const BODY_LIMIT: usize = 16 << 20;
/// The most messages a conversation sent whole may have (a new session starts with all of them).
pub const MAX_MESSAGES: usize = 10_000;
/// The most messages of every role a request may carry, counted as its body is parsed: only the
/// system, user and assistant ones count toward [`MAX_MESSAGES`], and a 16 MiB body of some
/// two million others (`{"role":"x"}`) was parsed whole, then each estimated as a JSON value
/// built for it, about 1 GB for one request.
pub const MAX_PARSED_MESSAGES: usize = 4 * MAX_MESSAGES;

/// `messages`, refused as they are parsed once past [`MAX_PARSED_MESSAGES`].
fn bounded_messages<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<ChatMessage>, D::Error> {
    struct Bounded;
    impl<'de> serde::de::Visitor<'de> for Bounded {
        type Value = Vec<ChatMessage>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a list of messages")
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            while let Some(m) = seq.next_element::<ChatMessage>()? {
                if out.len() == MAX_PARSED_MESSAGES {
                    return Err(serde::de::Error::custom(format!(
                        "more than {MAX_PARSED_MESSAGES} messages"
                    )));
                }
                out.push(m);
            }
            Ok(out)
        }
    }
    d.deserialize_seq(Bounded)
}

api_object! {
    /// A message of the conversation. `content` is a string or a list of parts (`text` parts are
    /// read).
    open struct ChatMessage {
        role: String,
        #[serde(default)]
        content: Option<ChatContent>,
        name: Option<String>,
    }
}

api_object! {
    open struct StreamOptions {
        /// Send a last chunk with `usage` (and no choices) before `[DONE]`.
        include_usage: Option<bool>,
    }
}

api_object! {
    /// An OpenAI chat-completions request. Other OpenAI fields (`temperature`, `tools`, …) are
    /// accepted and ignored: the session's launch policy decides. A `model` naming a configured
    /// profile runs the conversation under that profile, in a session of its own (a named
    /// session of another profile answers 409 `profile_mismatch`).
    open struct ChatCompletionRequest {
        model: Option<String>,
        #[serde(deserialize_with = "bounded_messages")]
        messages: Vec<ChatMessage>,
        stream: Option<bool>,
        stream_options: Option<StreamOptions>,
        user: Option<String>,
        /// How many answers: 1 only (a turn has one).
        n: Option<u64>,
    }
}

api_object! {
    response struct AssistantMessage {
        role: String,
        content: Option<String>,
        refusal: Option<String>,
    }
}

api_object! {
    response struct Choice {
        index: u32,
        message: AssistantMessage,
        finish_reason: String,
        logprobs: Option<Value>,
    }
}

api_object! {
    /// Estimated (characters / 4): the gateway does not meter a turn's model calls one by one.
    response struct Usage {
        prompt_tokens: u64,
        completion_tokens: u64,
        total_tokens: u64,
    }
}

api_object! {
    response struct ChatCompletion {
        /// `chatcmpl-<admission id>`.
        id: String,
        /// Always `chat.completion`.
        object: String,
        created: i64,
        model: String,
        choices: Vec<Choice>,
        usage: Usage,
        system_fingerprint: Option<String>,
    }
}

api_object! {
    response struct ChunkDelta {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        role: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        content: Option<String>,
    }
}

api_object! {
    response struct ChunkChoice {
        index: u32,
        delta: ChunkDelta,
        finish_reason: Option<String>,
        logprobs: Option<Value>,
    }
}

api_object! {
    /// One `data:` event of a streamed completion.
    response struct ChatCompletionChunk {
        id: String,
        /// Always `chat.completion.chunk`.
        object: String,
        created: i64,
        model: String,
        choices: Vec<ChunkChoice>,
        system_fingerprint: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        usage: Option<Usage>,
    }
}

api_object! {
    response struct ChatErrorDetail {
        message: String,
        /// OpenAI's error type (`invalid_request_error`, `authentication_error`, …).
        r#type: String,
        param: Option<String>,
        code: Option<String>,
        /// The gateway's stable reason.
        reason: String,
    }
}

api_object! {
    /// A refusal, in OpenAI's shape plus the gateway's `reason`.
    response struct ChatError {
        error: ChatErrorDetail,
    }
}

/// A refusal of this route.
#[derive(Debug)]
pub struct ChatFailure {
    status: StatusCode,
    body: Box<ChatError>,
    /// The session (and input) the refused request reached, sent as the success's headers are,
    /// so a client whose turn failed or timed out can follow it up.
    reached: Option<Box<(String, Option<String>)>>,
    /// The request's turn ran and ended without an answer: sent again, the request would run
    /// it again (tools and all), so clients that retry on their own are told not to
    /// (`x-should-retry: false`, which OpenAI's SDKs heed before retrying a 409 or 5xx).
    ended: bool,
}

impl ChatFailure {
    fn new(status: StatusCode, reason: &str, message: impl Into<String>) -> ChatFailure {
        let kind = match status.as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            409 => "conflict_error",
            429 => "rate_limit_error",
            400 | 413 => "invalid_request_error",
            504 => "timeout",
            _ => "api_error",
        };
        ChatFailure {
            status,
            reached: None,
            ended: false,
            body: Box::new(ChatError {
                error: ChatErrorDetail {
                    message: message.into(),
                    r#type: kind.to_string(),
                    param: None,
                    code: Some(reason.to_string()),
                    reason: reason.to_string(),
                },
            }),
        }
    }
}

impl ChatFailure {
    /// This refusal is of a turn that ran and ended (see `ended`).
    fn ended(mut self) -> ChatFailure {
        self.ended = true;
        self
    }

    /// This refusal came after the request reached `session` (and its input `admission`).
    fn reached(mut self, session: &str, admission: Option<&str>) -> ChatFailure {
        let admission = admission
            .map(str::to_string)
            .or_else(|| self.reached.as_ref().and_then(|r| r.1.clone()));
        self.reached = Some(Box::new((session.to_string(), admission)));
        self
    }
}

impl std::fmt::Display for ChatFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.body.error.reason, self.body.error.message)
    }
}

impl From<ApiError> for ChatFailure {
    fn from(e: ApiError) -> ChatFailure {
        ChatFailure::new(e.status, e.reason, e.message)
    }
}

impl From<crate::error::StoreError> for ChatFailure {
    fn from(e: crate::error::StoreError) -> ChatFailure {
        ChatFailure::from(GatewayError::from(e))
    }
}

impl From<GatewayError> for ChatFailure {
    fn from(e: GatewayError) -> ChatFailure {
        ApiError::from(e).into()
    }
}

impl ResponseError for ChatFailure {
    fn status_code(&self) -> StatusCode {
        self.status
    }

    fn error_response(&self) -> HttpResponse {
        let mut r = HttpResponse::build(self.status);
        super::auth::refusal_headers(self.status, &mut r);
        if self.status == StatusCode::METHOD_NOT_ALLOWED {
            r.insert_header(("allow", "POST"));
        }
        if self.ended {
            r.insert_header(("x-should-retry", "false"));
        }
        if let Some(reached) = &self.reached {
            r.insert_header((SESSION_HEADER, reached.0.as_str()));
            if let Some(admission) = &reached.1 {
                r.insert_header((ADMISSION_HEADER, admission.as_str()));
            }
        }
        r.json(&*self.body)
    }
}

fn invalid(message: impl Into<String>) -> ChatFailure {
    ChatFailure::from(GatewayError::InvalidParams(message.into()))
}

/// The text of a message's content (a string, or the `text` parts of a list).
fn text_of(content: &Option<ChatContent>) -> Option<String> {
    content.as_ref()?.text().map(str::to_string)
}

/// A conversation as keys and seeds read it: each system, user and assistant message's role
/// (`developer` is `system`) and text; other messages (tool results) are not the client's turns.
fn turns(messages: &[ChatMessage]) -> Vec<(String, String)> {
    messages
        .iter()
        .filter_map(|m| {
            let role = match m.role.as_str() {
                "system" | "developer" => "system",
                "user" => "user",
                "assistant" => "assistant",
                _ => return None,
            };
            Some((role.to_string(), text_of(&m.content).unwrap_or_default()))
        })
        .collect()
}

/// The key of a conversation's first `turns`, within `scope` (the end user and the profile:
/// two users' or two profiles' conversations never share a session).
fn thread_key(scope: &Value, turns: &[(String, String)]) -> String {
    hex(&Sha256::digest(
        json!([scope, turns]).to_string().as_bytes(),
    ))
}

/// Where a request's input goes.
enum Thread {
    /// An existing session (named, a retried request, or where the conversation left off).
    Existing(String),
    /// A new session under this request id, starting with the conversation so far.
    New { request_id: String, seed: Seed },
}

/// The session of a named conversation (`X-Gatehouse-Session`): a session id the caller owns
/// (as the response header gives it), else a name of the caller's own.
async fn named_thread(
    authority: &Authority,
    principal: &str,
    name: &str,
) -> Result<Thread, ChatFailure> {
    if name.is_empty() || name.len() > 256 {
        return Err(invalid("X-Gatehouse-Session must be 1 to 256 characters"));
    }
    match authority.owned_root(name, principal).await {
        Ok(root) => return Ok(Thread::Existing(root.id)),
        Err(GatewayError::NotFound(_)) => {}
        Err(e) => return Err(e.into()),
    }
    let request_id = format!("openai/{name}");
    let id = session_id_for(principal, &request_id);
    match authority.owned_root(&id, principal).await {
        Ok(root) => Ok(Thread::Existing(root.id)),
        Err(GatewayError::NotFound(_)) => Ok(Thread::New {
            request_id,
            seed: Seed::default(),
        }),
        Err(e) => Err(e.into()),
    }
}

/// The session recorded for the thread key `key` of `principal`, if any.
async fn recorded(
    authority: &Authority,
    principal: &str,
    key: &str,
) -> Result<Option<String>, ChatFailure> {
    let (p, k) = (principal.to_string(), key.to_string());
    Ok(authority
        .shared
        .db
        .read(move |c| threads::find(c, &p, &k))
        .await?)
}

/// The session of a derived conversation, which the client sends whole every time: the one
/// this very request went to before (a retry); else the one the conversation left off in, when
/// it is exactly there (its last input is the request before this one, answered with the
/// answer the client sends back); else a new one that starts with the conversation so far (a
/// new conversation, another branch of one, or a history the client wrote).
async fn derived_thread(
    authority: &Authority,
    principal: &str,
    scope: &Value,
    request: &[(String, String)],
) -> Result<(Thread, String, Option<Claim>), ChatFailure> {
    let key = thread_key(scope, request);
    if let Some(session) = recorded(authority, principal, &key).await? {
        return Ok((Thread::Existing(session), key, None));
    }
    let prior = &request[..request.len().saturating_sub(1)];
    if let [before @ .., (role, answer)] = prior {
        if role == "assistant" && !before.is_empty() {
            let previous = thread_key(scope, before);
            if let Some(session) = recorded(authority, principal, &previous).await? {
                // The previous request's input: named by its Idempotency-Key when it had one
                // (a client that sends each request under a key of its own started a new session
                // every turn), else by its conversation.
                // Either may be the one it went on with: a keyed request sent again without
                // its key is admitted under the conversation's own id.
                let mut inputs = vec![input_id_of(&previous)];
                inputs
                    .extend(recorded(authority, principal, &threads::input_key(&previous)).await?);
                let claim = Claim {
                    session: session.clone(),
                    previous,
                    key: key.clone(),
                    inputs,
                    answer: answer.clone(),
                    made: false,
                    records: Vec::new(),
                };
                let (c1, p) = (claim.clone(), principal.to_string());
                let there = authority
                    .shared
                    .db
                    .read(move |c| threads::left_at(c, &c1.session, &p, &c1.inputs, &c1.answer))
                    .await?;
                if there {
                    let (c1, p, now) =
                        (claim.clone(), principal.to_string(), authority.shared.now());
                    let (claimed, made) = authority
                        .shared
                        .db
                        .write(move |c| {
                            threads::claim_next(c, &p, &c1.session, &c1.previous, &c1.key, now)
                        })
                        .await?;
                    if claimed {
                        let claim = Claim { made, ..claim };
                        return Ok((Thread::Existing(session), key, Some(claim)));
                    }
                }
            }
        }
    }
    let mut seed = Seed::default();
    let mut system = Vec::new();
    for (role, text) in prior {
        match role.as_str() {
            "system" => system.push(text.clone()),
            _ if text.is_empty() => {}
            role => seed.messages.push(NewMessage {
                finish_reason: (role == "assistant").then(|| "stop".to_string()),
                ..NewMessage::text(role, text.clone())
            }),
        }
    }
    seed.system = (!system.is_empty()).then(|| system.join("\n\n"));
    let request_id = format!("openai/thread-{}", &key[..32]);
    Ok((Thread::New { request_id, seed }, key, None))
}

/// A request's claim on going on in the session where its conversation left off (see
/// `threads::claim_next`).
#[derive(Clone)]
struct Claim {
    session: String,
    /// The key of the conversation's previous request, which the session's last input is.
    previous: String,
    /// This request's conversation key, the claim's holder.
    key: String,
    /// The ids the previous request's input may have.
    inputs: Vec<String>,
    /// Its answer, as the client sent it back.
    answer: String,
    /// This request made the claim (else the same request, sent twice at once, made it: that
    /// one lets go of it, or goes on).
    made: bool,
    /// The records this request made, each key with what it names.
    records: Vec<(String, String)>,
}

impl Claim {
    /// Let go of the claim of a request that was refused: an edited message sent next goes on
    /// in the session rather than in a new one. Kept when its input was admitted after all
    /// (the session is no longer where the conversation left off).
    async fn let_go(self, authority: &Authority, principal: &str) {
        if !self.made {
            return;
        }
        let p = principal.to_string();
        let session = self.session.clone();
        let done = authority
            .shared
            .db
            .write(move |c| {
                threads::let_go(
                    c,
                    &p,
                    &threads::Refused {
                        session: &self.session,
                        previous: &self.previous,
                        key: &self.key,
                        left: (&self.inputs, &self.answer),
                        records: &self.records,
                    },
                )
            })
            .await;
        if let Err(e) = done {
            // Left held: the conversation's next request starts a new session.
            tracing::warn!(session = %session, error = %e, "could not let go of a refused request's claim");
        }
    }
}

/// The input id of a request to a named session, without an Idempotency-Key. Such a session
/// keeps its own history and its client sends only the new message, so the same text later
/// ("continue", "yes") is a new input: it was joined to the earlier one and answered with its
/// old reply. The request is the same request sent again (joined) only while its input is the
/// principal's latest in the session: the id is the request's hash and the seq of the input it
/// follows.
async fn named_base(
    authority: &Authority,
    root: &str,
    principal: &str,
    (user, profile): (Option<&str>, Option<&str>),
    request: &[(String, String)],
) -> Result<String, ChatFailure> {
    // The end user and the profile are part of the request: another end user's same message
    // ("yes") in the same session joined this one's input and got its answer. (Neither given,
    // the id is what it was.)
    let scope = if user.is_none() && profile.is_none() {
        Value::Null
    } else {
        json!([user, profile])
    };
    let prefix = format!("chat-{}-s", &thread_key(&scope, request)[..32]);
    let (r, p) = (root.to_string(), principal.to_string());
    let latest = authority
        .shared
        .db
        .read(move |c| admissions::latest_of(c, &r, &p))
        .await?;
    let Some(latest) = latest else {
        return Ok(format!("{prefix}0"));
    };
    // This request's own input (or a later attempt of it, `-N`): the base it was made under.
    if let Some(rest) = latest.request_id.strip_prefix(&prefix) {
        let follows: String = rest.chars().take_while(char::is_ascii_digit).collect();
        if !follows.is_empty() {
            return Ok(format!("{prefix}{follows}"));
        }
    }
    Ok(format!("{prefix}{}", latest.seq))
}

/// Times the same request may ask again after its turn ended without an answer.
const MAX_ATTEMPTS: u32 = 20;

/// The input id for a request whose own id is `base`: `base`, unless the input under it (and
/// each later attempt, `base-2`, `base-3`, …) ended without an answer (failed, interrupted):
/// then sending the same request again asks again. An input still queued or running, or
/// completed, is joined: a retried request never runs its turn twice.
async fn next_attempt(
    authority: &Authority,
    root: &str,
    principal: &str,
    base: &str,
) -> Result<String, ChatFailure> {
    let mut id = base.to_string();
    for n in 2..=MAX_ATTEMPTS + 1 {
        let (r, p, i) = (root.to_string(), principal.to_string(), id.clone());
        let row = authority
            .shared
            .db
            .read(move |c| admissions::by_request(c, &r, &p, &i))
            .await?;
        match row {
            Some(row)
                if row.status == "terminal" && row.outcome.as_deref() != Some("completed") =>
            {
                id = format!("{base}-{n}");
            }
            _ => break,
        }
    }
    Ok(id)
}

/// A refusal for an input that cannot be answered until an operator settles an input whose
/// outcome is unknown (this one, or one ahead of it in its session): waiting would be for good.
fn held_by(snap: &SessionSnapshot, receipt: &Receipt) -> Option<ChatFailure> {
    let session = &snap.session_id;
    let unknown = if receipt.status == "unknown" {
        Some(receipt.admission_id.clone())
    } else if receipt.status == "queued" {
        snap.pending
            .iter()
            .find(|p| p.status == "unknown" && p.admission_id != receipt.admission_id)
            .map(|p| p.admission_id.clone())
    } else {
        None
    }?;
    let whose = if unknown == receipt.admission_id {
        "its turn was running when the gateway stopped"
    } else {
        "the session is held by an earlier input whose turn was running when the gateway stopped"
    };
    Some(ChatFailure::from(GatewayError::UnknownExecution(format!(
        "{whose}: its outcome is unknown and it will not run again. Check what it did, then \
         settle it with `gatehouse resolve-unknown {session} {unknown}` and send the request again"
    ))))
}

/// The input id of a derived request.
fn input_id_of(key: &str) -> String {
    format!("chat-{}", &key[..32])
}

/// What the finished turn gives the client.
struct Reply {
    id: String,
    model: String,
    created: i64,
    text: String,
    usage: Usage,
    /// Why the answer ended: `length` (cut at the model's output limit, its continuations
    /// spent) and `content_filter` (some of it withheld) as the model said; else `stop`.
    finish_reason: &'static str,
}

/// The turn's answer, or why there is none.
fn reply_of(
    receipt: &Receipt,
    model: &str,
    prompt_tokens: u64,
    timeout: f64,
) -> Result<Reply, ChatFailure> {
    if receipt.status != "terminal" {
        return Err(ChatFailure::new(
            StatusCode::GATEWAY_TIMEOUT,
            "timeout",
            format!(
                "the turn did not finish within {timeout} s (admission {}); send the same request again to \
                 keep waiting for it (in a named session without an Idempotency-Key, only before \
                 any other input to the session: after one, the same text is a new input), or \
                 follow the admission",
                receipt.admission_id
            ),
        ));
    }
    let result = receipt.result.clone().unwrap_or(Value::Null);
    match receipt.outcome.as_deref() {
        Some("completed") => {
            let text = result["final_response"].as_str().unwrap_or("").to_string();
            let completion_tokens = (text.len() as u64).div_ceil(4);
            Ok(Reply {
                id: format!("chatcmpl-{}", receipt.admission_id),
                model: model.to_string(),
                created: crate::store::now() as i64,
                usage: Usage {
                    prompt_tokens,
                    completion_tokens,
                    total_tokens: prompt_tokens + completion_tokens,
                },
                text,
                finish_reason: match result["finish_reason"].as_str() {
                    Some("length") => "length",
                    Some("content_filter") => "content_filter",
                    _ => "stop",
                },
            })
        }
        Some("failed") => {
            let reason = result["reason"].as_str().unwrap_or("failed");
            let message = result["error"].as_str().unwrap_or("the turn failed");
            Err(match reason {
                // A model that still limits the rate after the retries: a 429, but not one to
                // send again unasked. The same request sent again runs a new turn, and the
                // limit may have come after the turn's tools ran: OpenAI's and Anthropic's
                // clients retried it twice on their own, running its tools three times.
                "rate_limited" => {
                    ChatFailure::new(StatusCode::TOO_MANY_REQUESTS, reason, message).ended()
                }
                // As OpenAI answers a conversation too long for its model: a 400 whose `code`
                // is `context_length_exceeded`, which clients look for.
                "context_overflow" => {
                    let mut f = ChatFailure::new(StatusCode::BAD_REQUEST, reason, message);
                    f.body.error.code = Some("context_length_exceeded".into());
                    f.ended()
                }
                _ => ChatFailure::new(StatusCode::BAD_GATEWAY, reason, message).ended(),
            })
        }
        other => {
            let outcome = other.unwrap_or("unknown");
            Err(ChatFailure::new(
                StatusCode::CONFLICT,
                if outcome == "cancelled" {
                    "cancelled"
                } else {
                    "interrupted"
                },
                format!("the turn ended {outcome} without an answer"),
            )
            .ended())
        }
    }
}

fn completion(r: &Reply) -> ChatCompletion {
    ChatCompletion {
        id: r.id.clone(),
        object: "chat.completion".into(),
        created: r.created,
        model: r.model.clone(),
        choices: vec![Choice {
            index: 0,
            message: AssistantMessage {
                role: "assistant".into(),
                content: Some(r.text.clone()),
                refusal: None,
            },
            finish_reason: r.finish_reason.into(),
            logprobs: None,
        }],
        usage: r.usage.clone(),
        system_fingerprint: None,
    }
}

/// The chunks of a finished reply: role, content, finish (and usage when asked).
fn chunks(r: &Reply, include_usage: bool) -> Vec<ChatCompletionChunk> {
    let chunk = |delta: ChunkDelta, finish: Option<&str>| ChatCompletionChunk {
        id: r.id.clone(),
        object: "chat.completion.chunk".into(),
        created: r.created,
        model: r.model.clone(),
        choices: vec![ChunkChoice {
            index: 0,
            delta,
            finish_reason: finish.map(str::to_string),
            logprobs: None,
        }],
        system_fingerprint: None,
        usage: None,
    };
    let mut out = vec![
        chunk(
            ChunkDelta {
                role: Some("assistant".into()),
                content: Some(String::new()),
            },
            None,
        ),
        chunk(
            ChunkDelta {
                role: None,
                content: Some(r.text.clone()),
            },
            None,
        ),
        chunk(
            ChunkDelta {
                role: None,
                content: None,
            },
            Some(r.finish_reason),
        ),
    ];
    if include_usage {
        let mut last = chunk(
            ChunkDelta {
                role: None,
                content: None,
            },
            None,
        );
        last.choices.clear();
        last.usage = Some(r.usage.clone());
        out.push(last);
    }
    out
}

fn data(v: &impl serde::Serialize) -> Bytes {
    Bytes::from(format!(
        "data: {}\n\n",
        serde_json::to_string(v).unwrap_or_else(|_| "{}".into())
    ))
}

pub async fn chat_completions(
    req: HttpRequest,
    state: web::Data<AppState>,
    payload: web::Payload,
) -> Result<HttpResponse, ChatFailure> {
    // Authenticated here rather than by the `Principal` extractor, so a credential refusal is
    // in OpenAI's error shape too, like every other refusal of this route.
    let principal = authenticate(&state, &req)?;
    // Taken before anything is admitted: a request refused for want of one admitted nothing.
    let slot = Slot::for_waiting(state.authority.shared.config.gateway.max_connections)?;
    let mut claim = None;
    let answered = complete(req, &state, payload, &principal, (&mut claim, slot)).await;
    // Not after a store failure: an admission that did not commit in time may commit still.
    if let (Err(f), Some(claim)) = (&answered, claim) {
        if f.body.error.reason != "storage_unavailable" {
            claim.let_go(&state.authority, &principal).await;
        }
    }
    answered
}

/// The route asked with another method than POST: 405 with `Allow`, in OpenAI's shape (after
/// authentication, like every other answer of the route).
pub async fn method_not_allowed(
    req: HttpRequest,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ChatFailure> {
    authenticate(&state, &req)?;
    Err(ChatFailure::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "this route answers POST only",
    ))
}

/// [`chat_completions`] past the credential check; `claim` is set to the claim the request
/// takes on going on in its conversation's session, if it takes one.
async fn complete(
    req: HttpRequest,
    state: &AppState,
    payload: web::Payload,
    principal: &str,
    (claim, slot): (&mut Option<Claim>, Slot),
) -> Result<HttpResponse, ChatFailure> {
    let principal = principal.to_string();
    let mut body: ChatCompletionRequest =
        read_json(payload, BodyLimit::of(state, BODY_LIMIT)).await?;
    // More than one answer cannot be given: say so rather than send one of the n asked for.
    if body.n.is_some_and(|n| n != 1) {
        return Err(invalid("n must be 1: a turn gives one answer"));
    }
    // The input is the last user message's text; the request is the conversation up to it.
    let conversation = turns(&body.messages);
    let last_user = conversation
        .iter()
        .rposition(|(role, _)| role == "user")
        .filter(|&i| !conversation[i].1.trim().is_empty())
        .ok_or_else(|| invalid("the conversation has no user message with text"))?;
    // The gateway runs the conversation's tools itself: a reply or tool result after the last
    // user message (a client running tools of its own, or prefilling the answer) would be
    // dropped, and the request answered as if it ended at that user message.
    let after: Vec<&str> = body
        .messages
        .iter()
        .rposition(|m| m.role == "user")
        .map(|i| {
            body.messages[i + 1..]
                .iter()
                .map(|m| m.role.as_str())
                .collect()
        })
        .unwrap_or_default();
    if !after.is_empty() {
        return Err(invalid(format!(
            "the conversation must end with its user message, not with {after:?} messages: \
             this gateway runs the tools itself and answers the last user message"
        )));
    }
    let request = &conversation[..=last_user];
    let text = request[last_user].1.clone();
    let authority = &state.authority;
    // Refused before anything is written: the input would be refused after its conversation's
    // session had been made, and a history past MAX_MESSAGES would hold the writer while it
    // is copied in row by row. Every message the new session would store is held to the
    // bound of an input's text (a history of one 10 MB message was stored whole, and sent
    // with every model request of the session).
    let max = authority.shared.config.session.max_text_bytes;
    if text.len() > max {
        return Err(GatewayError::PayloadTooLarge(format!(
            "the last user message is over {max} bytes"
        ))
        .into());
    }
    if let Some((role, _)) = request.iter().find(|(_, t)| t.len() > max) {
        return Err(GatewayError::PayloadTooLarge(format!(
            "a {role} message of the conversation is over {max} bytes"
        ))
        .into());
    }
    let system: usize = request
        .iter()
        .filter(|(role, _)| role == "system")
        .map(|(_, t)| t.len())
        .sum();
    if system > max {
        return Err(GatewayError::PayloadTooLarge(format!(
            "the conversation's system messages are over {max} bytes together"
        ))
        .into());
    }
    if request.len() > MAX_MESSAGES {
        return Err(invalid(format!(
            "the conversation has {} messages; at most {MAX_MESSAGES} are taken",
            request.len()
        )));
    }
    // The prompt's size is all the parsed messages are needed for now: let go of them, rather
    // than hold a body's worth of parsed JSON (many times its size) while the turn runs.
    // Each message estimated as the JSON `{"role", "content"}` it is sent as, borrowing its
    // text: no value is built for it.
    let prompt_tokens = {
        #[derive(serde::Serialize)]
        struct Wire<'a> {
            content: Option<&'a str>,
            role: &'a str,
        }
        let wire: Vec<Wire> = body
            .messages
            .iter()
            .map(|m| Wire {
                content: m.content.as_ref().and_then(ChatContent::text),
                role: &m.role,
            })
            .collect();
        tokens::estimate_request(&wire, None)
    };
    body.messages = Vec::new();
    // A `model` naming a configured profile runs the conversation under that profile.
    let profile = body
        .model
        .as_deref()
        .filter(|m| authority.shared.config.profiles.contains_key(*m));
    let named = match req.headers().get(SESSION_HEADER) {
        Some(v) => Some(
            v.to_str()
                .map_err(|_| invalid("X-Gatehouse-Session must be visible ASCII"))?
                .trim()
                .to_string(),
        ),
        None => None,
    };
    // An explicit Idempotency-Key names the request wherever its conversation would lead: sent
    // again, with other messages, it finds its input (and a conflict), not a new session.
    let explicit = idempotency(&req, None, "input_id")?;
    if explicit
        .as_ref()
        .is_some_and(|k| k.is_empty() || k.len() > 1024)
    {
        return Err(invalid("Idempotency-Key must be 1 to 1024 bytes"));
    }
    let idem = explicit
        .as_deref()
        .map(|k| format!("idem-{}", hex(&Sha256::digest(k.as_bytes()))));
    // The key with what it was sent with (the conversation, its end user, the profile, the
    // session named): sent again with anything else, it is a conflict, not the first answer.
    // The session named is the session, however it was named: a retry that names it by the id
    // the first try's answer gave (as the answer asks) was a conflict with its own key.
    let named_thread = match &named {
        Some(name) => Some(named_thread(authority, &principal, name).await?),
        None => None,
    };
    let named_session = match (&idem, &named_thread) {
        (Some(_), Some(Thread::Existing(id))) => Some(id.clone()),
        (Some(_), Some(Thread::New { request_id, .. })) => {
            Some(session_id_for(&principal, request_id))
        }
        _ => None,
    };
    let sent_with = idem.as_ref().map(|idem| {
        let scope = json!([body.user, profile, named_session]);
        format!("{idem}-{}", &thread_key(&scope, request)[..32])
    });
    let earlier = match &idem {
        Some(idem) => recorded(authority, &principal, idem).await?,
        None => None,
    };
    if let (Some(session), Some(with)) = (&earlier, &sent_with) {
        if recorded(authority, &principal, with).await?.as_ref() != Some(session) {
            return Err(GatewayError::AdmissionConflict(format!(
                "Idempotency-Key was already used with another conversation (in session {session})"
            ))
            .into());
        }
    }
    let (thread, key) = match (named_thread, earlier) {
        (Some(thread), Some(session)) => match thread {
            Thread::Existing(id) if id == session => (Thread::Existing(id), None),
            _ => {
                return Err(GatewayError::AdmissionConflict(format!(
                    "Idempotency-Key was already used in session {session}"
                ))
                .into())
            }
        },
        (None, Some(session)) => (Thread::Existing(session), None),
        (Some(thread), None) => (thread, None),
        (None, None) => {
            let scope = json!([body.user, profile]);
            let (thread, key, claimed) =
                derived_thread(authority, &principal, &scope, request).await?;
            *claim = claimed;
            (thread, Some(key))
        }
    };
    let mut snap: SessionSnapshot = match thread {
        Thread::Existing(root) => {
            let root = authority.owned_root(&root, &principal).await?;
            // A session runs under the profile it was created with; a request for another is
            // refused rather than answered by the wrong profile.
            if let Some(p) = profile.filter(|p| *p != root.profile) {
                return Err(GatewayError::ProfileMismatch(format!(
                    "the session runs profile {:?}; model {p:?} names another profile",
                    root.profile
                ))
                .into());
            }
            call(
                authority,
                "session.resume",
                json!({"session_id": root.id}),
                &caller(&principal, None),
            )
            .await?
        }
        Thread::New { request_id, seed } => {
            let mut params =
                json!({"request_id": request_id, "source": "api", "title": "chat completions"});
            if let Some(p) = profile {
                params["profile"] = json!(p);
            }
            let create: CreateSession = serde_json::from_value(params)
                .map_err(|e| GatewayError::Internal(format!("session.create params: {e}")))?;
            let created = authority
                .create_seeded(create, seed, &caller(&principal, None))
                .await?;
            serde_json::from_value(created.result.into_value()).map_err(|e| {
                GatewayError::Internal(format!("session.create answered an unexpected shape: {e}"))
            })?
        }
    };
    // From here only its id, its pending inputs and its model are read, for as long as the turn
    // takes (up to `http.completion_timeout_seconds`): its transcript, which may be the whole
    // conversation the request carried, is let go now, as the request's own messages were.
    drop(std::mem::take(&mut snap.messages));
    // Of its pending inputs only the unknown ones are read (`held_by`): the rest, up to a
    // thousand of 4,096 characters each, were held by every request waiting in the session.
    snap.pending.retain(|p| p.status == "unknown");
    snap.pending.shrink_to_fit();
    let root = snap.session_id.clone();
    let snap_root = root.clone();
    // Every refusal from here on names the session the request reached (and its input, once
    // admitted), as the answer would.
    let answered: Result<HttpResponse, ChatFailure> = async {
        // Recorded before the input is admitted: a retry finds the session even if this request is
        // cut off right after the admission.
        // The key with its conversation first: a key found recorded always has it.
        let records: Vec<String> = [key.clone(), sent_with, idem.clone()]
            .into_iter()
            .flatten()
            .collect();
        let (p, r, now) = (principal.clone(), root.clone(), authority.shared.now());
        // A keyed request's input is named by its key: recorded by its conversation, for the
        // next request of the conversation to know it as the one to go on from.
        let keyed_input = explicit.clone().zip(key.clone());
        let (named, made) = authority
            .shared
            .db
            .write(move |c| {
                crate::store::write_tx(c, |c| {
                    let named = threads::record_made(c, &p, &records, &r, now)?;
                    // The records this request made naming the session (let go of with its
                    // claim, if it is refused).
                    let mut made: Vec<(String, String)> = records
                        .iter()
                        .zip(&named)
                        .filter(|(_, (session, made))| *made && *session == r)
                        .map(|(key, _)| (key.clone(), r.clone()))
                        .collect();
                    let named: Vec<String> = named.into_iter().map(|(s, _)| s).collect();
                    // Not for a key already used in another session: that request is refused.
                    let own_key = named.last().is_some_and(|s| *s == r);
                    if let (Some((input, key)), true) = (&keyed_input, own_key) {
                        threads::record_input(c, &p, key, input, now)?;
                        made.push((threads::input_key(key), input.clone()));
                    }
                    Ok::<_, crate::error::StoreError>((named, made))
                })
            })
            .await?;
        if let Some(claim) = claim.as_mut() {
            claim.records = made;
        }
        if idem.is_some() && named.last().is_some_and(|s| *s != root) {
            // Another request with this key, and another conversation, got here first.
            return Err(GatewayError::AdmissionConflict(
                "Idempotency-Key was already used with another conversation".into(),
            )
            .into());
        }
        if key.is_some() && named.first().is_some_and(|s| *s != root) {
            // The same conversation reached another session first: an identical request at
            // the same instant, which found no record and no input where this one looked.
            // Going on here ran the turn in both sessions; sent again, this request finds the
            // record and joins that session's input.
            return Err(GatewayError::SessionBusy(
                "the same conversation is being answered by another request: send it again to \
                 join it"
                    .into(),
            )
            .into());
        }
        let c = caller(&principal, Some(&root));
        let input_id = match (explicit, &key) {
            (Some(explicit), _) => explicit,
            (None, Some(key)) => {
                next_attempt(authority, &root, &principal, &input_id_of(key)).await?
            }
            (None, None) => {
                let scope = (body.user.as_deref(), profile);
                let base = named_base(authority, &root, &principal, scope, request).await?;
                next_attempt(authority, &root, &principal, &base).await?
            }
        };
        let receipt: Receipt = call(
            authority,
            "prompt.submit",
            json!({"session_id": root, "input_id": input_id, "text": text}),
            &c,
        )
        .await?;
        let admitted = |e| ChatFailure::from(e).reached(&root, Some(&receipt.admission_id));
        if let Some(held) = held_by(&snap, &receipt) {
            return Err(held.reached(&root, Some(&receipt.admission_id)));
        }
        let http = &authority.shared.config.http;
        let timeout = http.completion_timeout_seconds;
        let deadline = tokio::time::Instant::now() + Duration::from_secs_f64(timeout);
        let model = snap.info.model.clone();
        if !body.stream.unwrap_or(false) {
            let credential = crate::api::auth::Credential::of(&state.auth, &req);
            let done = wait_terminal(
                authority,
                &c,
                &root,
                &receipt.admission_id,
                (deadline, Some(&credential)),
            )
            .await
            .map_err(admitted)?;
            let reply = reply_of(&done, &model, prompt_tokens, timeout)
                .map_err(|f| f.reached(&root, Some(&receipt.admission_id)))?;
            return Ok(HttpResponse::Ok()
                .insert_header((SESSION_HEADER, root))
                .insert_header((ADMISSION_HEADER, receipt.admission_id))
                .json(completion(&reply)));
        }
        let include_usage = body
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
        let keepalive = Duration::from_secs_f64(http.sse_keepalive_seconds);
        let (tx, rx) = mpsc::channel::<Bytes>(16);
        // A reader that takes nothing is cut off, as an event stream's is.
        let out = SseOut::new(tx, keepalive, &req);
        let budget = out.budget();
        let credential = crate::api::auth::Credential::of(&state.auth, &req);
        let authority = authority.clone();
        let admission = receipt.admission_id.clone();
        let session = root.clone();
        actix_web::rt::spawn(async move {
            // The stream's place is held until it ends.
            let _slot = slot;
            // The key is looked at on each keep-alive below (the stream ends with `[DONE]`).
            let wait = wait_terminal(&authority, &c, &session, &admission, (deadline, None));
            tokio::pin!(wait);
            let mut tick =
                tokio::time::interval_at(tokio::time::Instant::now() + keepalive, keepalive);
            let done = loop {
                tokio::select! {
                    r = &mut wait => break r,
                    _ = tick.tick() => {
                        // A key revoked meanwhile ends the stream, as it ends an event stream (the
                        // answer kept coming to the end, up to `http.completion_timeout_seconds`).
                        if !credential.still_valid() {
                            // The refusal an event stream ends with, in the chat shape.
                            let revoked = ChatFailure::from(ApiError::unauthorized(
                                "the API key was revoked (or the token expired)",
                            ));
                            // Then `[DONE]`, as every stream of this route ends.
                            if out.send(data(&*revoked.body)).await.is_ok() {
                                let _ = out.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
                            }
                            return;
                        }
                        if out.send(Bytes::from_static(b": keep-alive\n\n")).await.is_err() {
                            return;
                        }
                    }
                    _ = out.tx.closed() => return,
                }
            };
            let events = match done
                .map_err(ChatFailure::from)
                .and_then(|r| reply_of(&r, &model, prompt_tokens, timeout))
            {
                Ok(reply) => chunks(&reply, include_usage).iter().map(data).collect(),
                Err(f) => vec![data(&*f.body)],
            };
            for e in events
                .into_iter()
                .chain(std::iter::once(Bytes::from_static(b"data: [DONE]\n\n")))
            {
                if out.send(e).await.is_err() {
                    return;
                }
            }
        });
        let mut resp = sse_response(rx, budget);
        let headers = resp.headers_mut();
        for (name, value) in [
            (SESSION_HEADER, root),
            (ADMISSION_HEADER, receipt.admission_id),
        ] {
            if let Ok(v) = actix_web::http::header::HeaderValue::from_str(&value) {
                headers.insert(actix_web::http::header::HeaderName::from_static(name), v);
            }
        }
        Ok(resp)
    }
    .await;
    answered.map_err(|f| f.reached(&snap_root, None))
}

/// This route in the OpenAPI document.
pub fn operations(c: &mut Components) -> Vec<Operation> {
    vec![Operation {
        method: "post",
        path: "/v1/chat/completions",
        id: "createChatCompletion",
        summary:
            "OpenAI-compatible chat completion: the last user message becomes an input of a session",
        params: vec![
            (
                "X-Gatehouse-Session",
                "header",
                "A session id (as the x-gatehouse-session response header gives it) or a name \
                 (default: the conversation's own session)",
            ),
            (
                "Idempotency-Key",
                "header",
                "The input's id (default: a hash of the messages)",
            ),
        ],
        request: Body::json::<ChatCompletionRequest>(c),
        status: 200,
        also: vec![],
        response: Body::Alternatives(vec![
            ("application/json", ChatCompletion::schema(c)),
            (
                "text/event-stream",
                json!({"type": "string", "description":
                    "With stream: true — `data: <ChatCompletionChunk>` events, then `data: [DONE]`.",
                    "contentSchema": ChatCompletionChunk::schema(c)}),
            ),
        ]),
        errors: vec![400, 403, 409, 413, 429, 502, 503, 504],
        // OpenAI's error shape (plus the gateway's reason), its credential refusals included.
        error_body: Some(ChatError::schema(c)),
        headers: vec![
            (
                "X-Gatehouse-Session",
                "The session the input was admitted to (send it back to continue there)",
            ),
            ("X-Gatehouse-Admission", "The input's admission id"),
        ],
        refusal_headers: vec![
            (
                "X-Gatehouse-Session",
                "The session the request reached, when it reached one (a failed or timed-out \
                 turn can be followed up there)",
            ),
            (
                "X-Gatehouse-Admission",
                "The input's admission id, when it was admitted",
            ),
        ],
    }]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A message's `content` as a request body's JSON reads.
    fn content(v: Value) -> Result<Option<ChatContent>, serde_json::Error> {
        serde_json::from_value(v)
    }

    fn msg(role: &str, v: Value) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content(v).expect("content"),
            name: None,
        }
    }

    #[test]
    fn content_parts_and_conversation_hashes() {
        assert_eq!(
            text_of(&content(json!("hi")).expect("string")),
            Some("hi".into())
        );
        assert_eq!(
            text_of(
                &content(json!([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "b"}]))
                    .expect("parts")
            ),
            Some("a\nb".into())
        );
        assert_eq!(text_of(&content(json!([])).expect("no parts")), None);
        assert_eq!(content(json!(null)).expect("null"), None);
        // Neither a string nor a list of parts: refused as it is read (a list of anything else
        // is not kept to be looked at).
        assert!(content(json!(3)).is_err());
        assert!(content(json!([0, 0, 0])).is_err());
        assert!(content(json!({"text": "a"})).is_err());
        let conversation = vec![
            msg("developer", json!("be brief")),
            msg("user", json!("hello")),
            msg("assistant", json!("hi!")),
            msg("tool", json!("ignored")),
            msg("user", json!([{"type": "text", "text": "again"}])),
        ];
        let t = turns(&conversation);
        let pair = |r: &str, x: &str| (r.to_string(), x.to_string());
        assert_eq!(
            t,
            [
                pair("system", "be brief"),
                pair("user", "hello"),
                pair("assistant", "hi!"),
                pair("user", "again")
            ]
        );
        // A key is of the turns and the scope: another end user or profile is another key.
        let scopes = [
            json!([null, null]),
            json!(["alice", null]),
            json!(["bob", null]),
            json!([null, "ops"]),
            json!(["alice", "ops"]),
        ];
        let keys: Vec<String> = scopes.iter().map(|s| thread_key(s, &t)).collect();
        for (i, k) in keys.iter().enumerate() {
            assert!(keys[i + 1..].iter().all(|o| o != k), "{keys:?}");
        }
        assert_eq!(keys[0], thread_key(&scopes[0], &t), "stable");
        assert_ne!(keys[0], thread_key(&scopes[0], &t[..2]));
        assert_eq!(input_id_of(&keys[0]).len(), "chat-".len() + 32);
    }

    #[test]
    fn replies_have_the_openai_shape() {
        let r = Reply {
            id: "chatcmpl-x".into(),
            model: "m".into(),
            created: 1,
            text: "hello".into(),
            usage: Usage {
                prompt_tokens: 3,
                completion_tokens: 2,
                total_tokens: 5,
            },
            finish_reason: "stop",
        };
        let c = serde_json::to_value(completion(&r)).expect("json");
        assert_eq!(c["object"], "chat.completion");
        assert_eq!(c["choices"][0]["message"]["content"], "hello");
        assert_eq!(c["choices"][0]["finish_reason"], "stop");
        let ch: Vec<Value> = chunks(&r, true)
            .iter()
            .map(|c| serde_json::to_value(c).expect("json"))
            .collect();
        assert_eq!(ch.len(), 4);
        assert_eq!(
            ch[0]["choices"][0]["delta"],
            json!({"role": "assistant", "content": ""})
        );
        assert_eq!(ch[2]["choices"][0]["delta"], json!({}));
        assert_eq!(ch[3]["choices"], json!([]));
        assert_eq!(ch[3]["usage"]["total_tokens"], 5);
        assert!(ch[0].get("usage").is_none());
    }
}
