//! `POST /v1/chat/completions`: an OpenAI-compatible facade over sessions.
//!
//! The conversation's last user message becomes one input of a session: the one named by the
//! `X-Gatehouse-Session` header, else one derived from the conversation (a hash of its messages up
//! to the first user message, so a growing conversation keeps its session, and of the request's
//! `user` when it names one, so two end users' conversations never share a session). The input id is the
//! `Idempotency-Key` header, else a hash of the whole request's messages: a retried request joins
//! the same admission instead of running again. The answer is the turn's final assistant message,
//! as a `chat.completion` or (with `stream: true`) as `chat.completion.chunk` events ending with
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

use super::auth::{ApiError, Principal};
use super::http::AppState;
use super::openapi::{api_object, ApiSchema, Body, Components, Operation};
use super::rest::{
    call, caller, idempotency, read_json, sse_response, wait_terminal, Receipt, SessionSnapshot,
};
use super::rpc::session_id_for;
use crate::agent::tokens;
use crate::error::GatewayError;
use crate::store::admissions::hex;

/// Names the session of a chat completion.
pub const SESSION_HEADER: &str = "x-gatehouse-session";
/// The largest request body (a whole conversation).
const BODY_LIMIT: usize = 16 << 20;

api_object! {
    /// A message of the conversation. `content` is a string or a list of parts (`text` parts are
    /// read).
    open struct ChatMessage {
        role: String,
        #[serde(default)]
        content: Option<Value>,
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
        HttpResponse::build(self.status).json(&*self.body)
    }
}

fn invalid(message: impl Into<String>) -> ChatFailure {
    ChatFailure::from(GatewayError::InvalidParams(message.into()))
}

/// The text of a message's content (a string, or the `text` parts of a list).
fn text_of(content: &Option<Value>) -> Option<String> {
    match content {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Array(parts)) => {
            let texts: Vec<&str> = parts
                .iter()
                .filter(|p| p["type"] == "text")
                .filter_map(|p| p["text"].as_str())
                .collect();
            (!texts.is_empty()).then(|| texts.join("\n"))
        }
        _ => None,
    }
}

fn digest_of(messages: &[ChatMessage]) -> String {
    let canonical: Vec<Value> = messages
        .iter()
        .map(|m| json!([m.role, m.content]))
        .collect();
    hex(&Sha256::digest(
        Value::Array(canonical).to_string().as_bytes(),
    ))
}

/// The session's request id: the header's name, else a hash of the conversation's opening and,
/// when the request names them, its end user (`user`) and the profile its `model` names: an app
/// serving many users through one key must not put two users' conversations that open alike into
/// one session (the second would get the first's answers and, later, its history), and the same
/// conversation sent to another profile is another session, run by that profile.
fn session_request_id(
    req: &HttpRequest,
    messages: &[ChatMessage],
    user: Option<&str>,
    profile: Option<&str>,
) -> Result<String, ChatFailure> {
    if let Some(v) = req.headers().get(SESSION_HEADER) {
        let name = v
            .to_str()
            .map_err(|_| invalid("X-Gatehouse-Session must be visible ASCII"))?
            .trim();
        if name.is_empty() || name.len() > 256 {
            return Err(invalid("X-Gatehouse-Session must be 1 to 256 characters"));
        }
        return Ok(format!("openai/{name}"));
    }
    let opening = messages
        .iter()
        .position(|m| m.role == "user")
        .map_or(messages.len(), |i| i + 1);
    let conversation = digest_of(&messages[..opening]);
    let scoped = |parts: Value| hex(&Sha256::digest(parts.to_string().as_bytes()));
    Ok(match (user, profile) {
        (None, None) => format!("openai/conv-{}", &conversation[..32]),
        (Some(user), None) => {
            format!(
                "openai/user-conv-{}",
                &scoped(json!([user, conversation]))[..32]
            )
        }
        (user, Some(profile)) => format!(
            "openai/profile-conv-{}",
            &scoped(json!([user, profile, conversation]))[..32]
        ),
    })
}

/// What the finished turn gives the client.
struct Reply {
    id: String,
    model: String,
    created: i64,
    text: String,
    usage: Usage,
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
                 keep waiting for it",
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
            })
        }
        Some("failed") => Err(ChatFailure::new(
            StatusCode::BAD_GATEWAY,
            result["reason"].as_str().unwrap_or("failed"),
            result["error"]
                .as_str()
                .unwrap_or("the turn failed")
                .to_string(),
        )),
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
            ))
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
            finish_reason: "stop".into(),
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
            Some("stop"),
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
    principal: Principal,
    state: web::Data<AppState>,
    payload: web::Payload,
) -> Result<HttpResponse, ChatFailure> {
    let body: ChatCompletionRequest = read_json(payload, BODY_LIMIT).await?;
    // More than one answer cannot be given: say so rather than send one of the n asked for.
    if body.n.is_some_and(|n| n != 1) {
        return Err(invalid("n must be 1: a turn gives one answer"));
    }
    let text = body
        .messages
        .iter()
        .rev()
        .find(|m| m.role == "user")
        .and_then(|m| text_of(&m.content))
        .filter(|t| !t.is_empty())
        .ok_or_else(|| invalid("the conversation has no user message with text"))?;
    let authority = &state.authority;
    let principal = principal.0;
    // A `model` naming a configured profile runs the conversation under that profile.
    let profile = body
        .model
        .as_deref()
        .filter(|m| authority.shared.config.profiles.contains_key(*m));
    let request_id = session_request_id(&req, &body.messages, body.user.as_deref(), profile)?;
    let session_id = session_id_for(&principal, &request_id);
    let snap: SessionSnapshot = match authority.owned_root(&session_id, &principal).await {
        Ok(root) => {
            // A named session runs under the profile it was created with; a request for another
            // is refused rather than answered by the wrong profile.
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
        Err(GatewayError::NotFound(_)) => {
            let mut params =
                json!({"request_id": request_id, "source": "api", "title": "chat completions"});
            if let Some(p) = profile {
                params["profile"] = json!(p);
            }
            call(
                authority,
                "session.create",
                params,
                &caller(&principal, None),
            )
            .await?
        }
        Err(e) => return Err(e.into()),
    };
    let root = snap.session_id.clone();
    let input_id = idempotency(&req, None, "input_id")?
        .unwrap_or_else(|| format!("chat-{}", &digest_of(&body.messages)[..32]));
    let c = caller(&principal, Some(&root));
    let receipt: Receipt = call(
        authority,
        "prompt.submit",
        json!({"session_id": root, "input_id": input_id, "text": text}),
        &c,
    )
    .await?;
    let wire: Vec<Value> = body
        .messages
        .iter()
        .map(|m| json!({"role": m.role, "content": m.content}))
        .collect();
    let prompt_tokens = tokens::estimate_request(&wire, None);
    let http = &authority.shared.config.http;
    let timeout = http.completion_timeout_seconds;
    let deadline = tokio::time::Instant::now() + Duration::from_secs_f64(timeout);
    let model = snap.info.model.clone();
    if !body.stream.unwrap_or(false) {
        let done = wait_terminal(authority, &c, &root, &receipt.admission_id, deadline).await?;
        let reply = reply_of(&done, &model, prompt_tokens, timeout)?;
        return Ok(HttpResponse::Ok()
            .insert_header(("x-gatehouse-session", root))
            .insert_header(("x-gatehouse-admission", receipt.admission_id))
            .json(completion(&reply)));
    }
    let include_usage = body
        .stream_options
        .and_then(|o| o.include_usage)
        .unwrap_or(false);
    let keepalive = Duration::from_secs_f64(http.sse_keepalive_seconds);
    let (tx, rx) = mpsc::channel::<Bytes>(16);
    let authority = authority.clone();
    let admission = receipt.admission_id.clone();
    let session = root.clone();
    actix_web::rt::spawn(async move {
        let wait = wait_terminal(&authority, &c, &session, &admission, deadline);
        tokio::pin!(wait);
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + keepalive, keepalive);
        let done = loop {
            tokio::select! {
                r = &mut wait => break r,
                _ = tick.tick() => {
                    if tx.send(Bytes::from_static(b": keep-alive\n\n")).await.is_err() {
                        return;
                    }
                }
                _ = tx.closed() => return,
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
            if tx.send(e).await.is_err() {
                return;
            }
        }
    });
    let mut resp = sse_response(rx);
    let headers = resp.headers_mut();
    for (name, value) in [
        ("x-gatehouse-session", root),
        ("x-gatehouse-admission", receipt.admission_id),
    ] {
        if let Ok(v) = actix_web::http::header::HeaderValue::from_str(&value) {
            headers.insert(actix_web::http::header::HeaderName::from_static(name), v);
        }
    }
    Ok(resp)
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
                "The session's name (default: derived from the conversation)",
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
    }]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: Value) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: Some(content),
            name: None,
        }
    }

    #[test]
    fn content_parts_and_conversation_hashes() {
        assert_eq!(text_of(&Some(json!("hi"))), Some("hi".into()));
        assert_eq!(
            text_of(&Some(
                json!([{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}])
            )),
            Some("a\nb".into())
        );
        assert_eq!(text_of(&Some(json!(3))), None);
        let first = vec![
            msg("system", json!("be brief")),
            msg("user", json!("hello")),
        ];
        let mut later = first.clone();
        later.push(msg("assistant", json!("hi!")));
        later.push(msg("user", json!("again")));
        let req = actix_web::test::TestRequest::default().to_http_request();
        let a = session_request_id(&req, &first, None, None).expect("id");
        assert_eq!(
            a,
            session_request_id(&req, &later, None, None).expect("id"),
            "a growing conversation keeps its session"
        );
        let alice = session_request_id(&req, &first, Some("alice"), None).expect("id");
        let bob = session_request_id(&req, &first, Some("bob"), None).expect("id");
        assert!(alice != bob && alice != a && bob != a, "{alice} {bob} {a}");
        assert_eq!(
            alice,
            session_request_id(&req, &later, Some("alice"), None).expect("id"),
            "a user's growing conversation keeps its session"
        );
        // Another profile is another session; the same profile keeps it as it grows.
        let ops = session_request_id(&req, &first, None, Some("ops")).expect("id");
        let alice_ops = session_request_id(&req, &first, Some("alice"), Some("ops")).expect("id");
        let dev = session_request_id(&req, &first, None, Some("dev")).expect("id");
        let ids = [&a, &alice, &ops, &alice_ops, &dev];
        for (i, x) in ids.iter().enumerate() {
            assert!(ids[i + 1..].iter().all(|y| y != x), "{ids:?}");
        }
        assert_eq!(
            ops,
            session_request_id(&req, &later, None, Some("ops")).expect("id")
        );
        assert_ne!(
            digest_of(&first),
            digest_of(&later),
            "each request is its own input"
        );
        let named = actix_web::test::TestRequest::default()
            .insert_header((SESSION_HEADER, "work"))
            .to_http_request();
        assert_eq!(
            session_request_id(&named, &first, Some("alice"), Some("ops")).expect("id"),
            "openai/work"
        );
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
