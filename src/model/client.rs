//! `ModelClient`: one actor on its own arbiter owning the HTTP client (awc is not `Send`).
//! Requests are bounded per provider by a semaphore so a flood of sessions queues instead of
//! opening unbounded sockets; transient failures are retried with back-off, but never once a delta
//! was delivered, and never a request that succeeded.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use futures_util::StreamExt;
use serde_json::Value;
use tokio::sync::{watch, Semaphore};

use super::sse::SseParser;
use super::wire::{parse_response, reported_error, ChatResponse, StreamAccumulator};
use crate::tools::redact::redact;

/// Why a model call failed.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum ModelError {
    #[error("context_overflow: {0}")]
    ContextOverflow(String),
    #[error("rate limited: {0}")]
    RateLimited(String),
    #[error("transient: {0}")]
    Transient(String),
    #[error("authentication failed: {0}")]
    Auth(String),
    #[error("request refused: {0}")]
    Client(String),
    #[error("invalid response: {0}")]
    Malformed(String),
    #[error("response larger than {0} bytes")]
    TooLarge(usize),
    #[error("timed out: {0}")]
    Timeout(String),
    #[error("interrupted")]
    Interrupted,
    #[error("model client unavailable")]
    Unavailable,
    /// A reply this client cannot read (asking again would get the same).
    #[error("unreadable response: {0}")]
    Unreadable(String),
}

impl ModelError {
    /// A short stable class for logs and metrics.
    pub fn class(&self) -> &'static str {
        match self {
            ModelError::ContextOverflow(_) => "context_overflow",
            ModelError::RateLimited(_) => "rate_limited",
            ModelError::Transient(_) => "transient",
            ModelError::Auth(_) => "auth",
            ModelError::Client(_) => "client",
            ModelError::Malformed(_) => "malformed",
            ModelError::TooLarge(_) => "too_large",
            ModelError::Timeout(_) => "timeout",
            ModelError::Interrupted => "interrupted",
            ModelError::Unavailable => "unavailable",
            ModelError::Unreadable(_) => "unreadable",
        }
    }

    fn retryable(&self) -> bool {
        matches!(
            self,
            ModelError::Transient(_)
                | ModelError::RateLimited(_)
                | ModelError::Timeout(_)
                | ModelError::Malformed(_)
        )
    }
}

const OVERFLOW_PHRASES: &[&str] = &[
    "context_length_exceeded",
    "context length",
    "maximum context",
    "context window",
    "token limit",
    "too many tokens",
    "reduce the length",
    "prompt is too long",
    "max_model_len",
    "request entity too large",
    // llama.cpp's server: "request (9000 tokens) exceeds the available context size (8192
    // tokens)", type `exceed_context_size_error`, with its `n_ctx`.
    "context size",
    "exceed_context_size",
    // Gemini: "The input token count (134123) exceeds the maximum number of tokens allowed
    // (131072)."; xAI: "This model's maximum prompt length is 131072 but the request contains
    // 136973 tokens."; Bedrock: "Input is too long for requested model."
    "maximum number of tokens allowed",
    "maximum prompt length",
    "input is too long",
];

/// Classify an HTTP error status and body.
pub fn classify(status: u16, body: &str) -> ModelError {
    let lower = body.to_lowercase();
    // Masked first (a proxy that echoes the request echoes its key): the snippet goes to the
    // log, the transcript, the receipt and every follower.
    let snippet: String = redact(body).chars().take(500).collect();
    let overflow_phrase = OVERFLOW_PHRASES.iter().any(|p| lower.contains(p));
    if status == 413 || (status == 400 && overflow_phrase) {
        return ModelError::ContextOverflow(snippet);
    }
    match status {
        429 => ModelError::RateLimited(snippet),
        401 | 403 => ModelError::Auth(snippet),
        // A proxy's request timeout and a conflict (a lock held upstream) pass: OpenAI's own
        // clients try both again.
        408 | 409 | 500..=599 => ModelError::Transient(format!("HTTP {status}: {snippet}")),
        _ => ModelError::Client(format!("HTTP {status}: {snippet}")),
    }
}

/// Live output of a streamed call.
#[derive(Debug, Clone)]
pub enum StreamEvent {
    Content(String),
    Reasoning(String),
    ToolName(String),
}

/// Where a streamed call reports its output as it arrives, on the model client's thread.
pub type DeltaSink = Box<dyn Fn(StreamEvent) + Send>;

/// One chat-completions call.
pub struct ChatCall {
    pub provider: String,
    pub base_url: Option<String>,
    pub api_key: Option<String>,
    pub body: Value,
    pub stream: bool,
    /// Only for a streamed call: a plain one has no live output.
    pub deltas: Option<DeltaSink>,
    pub cancel: watch::Receiver<bool>,
    pub timeout: Duration,
    /// Whether a transient failure is tried again (`model.max_retries` times). A compaction's
    /// summary is not: its turn goes on without it, rather than wait out four time-outs.
    pub retry: bool,
}

impl Message for ChatCall {
    type Result = Result<ChatResponse, ModelError>;
}

/// Settings the client needs.
#[derive(Debug, Clone)]
pub struct ModelClientConfig {
    pub connect_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_concurrent: usize,
    pub max_retries: u32,
    pub max_response_bytes: usize,
    pub retry_base: Duration,
    /// Where request latencies are recorded.
    pub metrics: Option<Arc<crate::telemetry::Metrics>>,
}

/// Endpoints whose concurrency limits are kept while none of them has a call in flight.
const MAX_IDLE_ENDPOINTS: usize = 256;

pub struct ModelClient {
    config: ModelClientConfig,
    client: awc::Client,
    limits: HashMap<String, Arc<Semaphore>>,
    /// Models that refused to stream, by endpoint and model (see [`plain_key`]): asked plainly
    /// from then on (at most [`MAX_IDLE_ENDPOINTS`] remembered).
    plain_only: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
}

impl ModelClient {
    pub fn new(config: ModelClientConfig) -> Self {
        // `model.connect_timeout_seconds` bounds the connection (it was awc's own 5 s, whatever
        // was configured); the call's own deadline bounds the wait for the reply, retries
        // included (awc's request timeout, 20 connect timeouts, cut a slow plain reply short
        // of `model.timeout_seconds`, and a longer one was cut at 600 s).
        let client = awc::Client::builder()
            .connector(super::nodelay::connector(config.connect_timeout))
            .disable_timeout()
            .disable_redirects()
            .finish();
        Self {
            config,
            client,
            limits: HashMap::new(),
            plain_only: Arc::default(),
        }
    }

    /// The concurrency limit of endpoint `key`. Endpoints are a session's choice: past
    /// [`MAX_IDLE_ENDPOINTS`], the ones with no call in flight are forgotten, so the map holds
    /// only endpoints in use (at most one per call) beyond that.
    fn limit_for(&mut self, key: String) -> Arc<Semaphore> {
        if !self.limits.contains_key(&key) && self.limits.len() >= MAX_IDLE_ENDPOINTS {
            self.limits.retain(|_, sem| Arc::strong_count(sem) > 1);
        }
        self.limits
            .entry(key)
            .or_insert_with(|| Arc::new(Semaphore::new(self.config.max_concurrent)))
            .clone()
    }

    /// Start on a dedicated arbiter.
    pub fn start_on_own_arbiter(config: ModelClientConfig) -> Addr<ModelClient> {
        let arbiter = Arbiter::new();
        ModelClient::start_in_arbiter(&arbiter.handle(), move |_| ModelClient::new(config))
    }
}

impl Actor for ModelClient {
    type Context = Context<Self>;
}

/// Waits for a slot logged at most once a minute (with how many were not).
static SLOT_WAIT_LOG: crate::error::LogLimiter = crate::error::LogLimiter::new(60_000);

impl Handler<ChatCall> for ModelClient {
    type Result = ResponseFuture<Result<ChatResponse, ModelError>>;

    fn handle(&mut self, call: ChatCall, _: &mut Context<Self>) -> Self::Result {
        let key = format!(
            "{}|{}",
            call.provider,
            call.base_url.clone().unwrap_or_default()
        );
        let sem = self.limit_for(key.clone());
        let plain_key = plain_key(&key, &call.body);
        let client = self.client.clone();
        let config = self.config.clone();
        let plain_only = self.plain_only.clone();
        Box::pin(async move {
            if call.provider == "echo" {
                return Ok(echo_reply(&call.body));
            }
            let mut cancel = call.cancel.clone();
            // The timeout bounds the call from here: the wait for a slot of the endpoint is part
            // of it (a call behind hung ones waited for their timeouts, then had its own whole).
            let deadline = tokio::time::Instant::now() + call.timeout;
            if sem.available_permits() == 0 {
                // Every slot of the endpoint is taken (by calls that may hang until their
                // timeout): this call waits, which an operator should be able to see.
                if let Some(m) = &config.metrics {
                    m.model_slot_wait();
                }
                if let Some(skipped) = SLOT_WAIT_LOG.admit() {
                    tracing::warn!(
                        endpoint = %without_userinfo(&key), slots = config.max_concurrent, skipped,
                        "every request slot of the model endpoint is taken; the call waits \
                         (model.max_concurrent_requests)"
                    );
                }
            }
            let permit = tokio::select! {
                p = sem.acquire_owned() => p.map_err(|_| ModelError::Unavailable)?,
                _ = wait_cancel(&mut cancel) => return Err(ModelError::Interrupted),
                _ = tokio::time::sleep_until(deadline) => return Err(ModelError::Timeout(format!(
                    "no request slot of the endpoint within {:?} (model.max_concurrent_requests)",
                    call.timeout
                ))),
            };
            let started = std::time::Instant::now();
            let known_plain = plain_only.lock().is_ok_and(|p| p.contains(&plain_key));
            let stream = call.stream && !known_plain;
            let result = call_with_retries(&client, &config, &call, stream, deadline).await;
            if let Ok((_, fell_back)) = &result {
                if *fell_back {
                    if let Ok(mut p) = plain_only.lock() {
                        if p.len() >= MAX_IDLE_ENDPOINTS {
                            p.clear();
                        }
                        p.insert(plain_key);
                    }
                }
            }
            let result = result.map(|(response, _)| response);
            drop(permit);
            if let Some(m) = &config.metrics {
                m.model_hist.observe(started.elapsed().as_secs_f64());
            }
            result
        })
    }
}

/// What remembers that a model refused to stream: its endpoint (`key`) and the model the body
/// names. One model's refusal is no other's: keyed by the endpoint alone, one model that does not
/// stream made every model of its endpoint answer plainly (no live output) from then on.
fn plain_key(key: &str, body: &Value) -> String {
    let model = body
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or_default();
    format!("{key}|{model}")
}

/// Until the call is cancelled, or its turn is gone: the turn's attempt holds the sender for
/// as long as it runs, so a sender dropped is a turn that ended without a cancel (its actor
/// stopped), and nobody waits for the answer any more. Waited for, the call, its retries and
/// its endpoint slot went on to the call's timeout.
async fn wait_cancel(rx: &mut watch::Receiver<bool>) {
    // Answers at a cancel, and with an error once the sender is gone: either ends the wait.
    let _ = rx.wait_for(|cancelled| *cancelled).await;
}

/// The response, and whether it came plainly after the endpoint refused to stream.
async fn call_with_retries(
    client: &awc::Client,
    config: &ModelClientConfig,
    call: &ChatCall,
    mut stream: bool,
    deadline: tokio::time::Instant,
) -> Result<(ChatResponse, bool), ModelError> {
    let mut attempt = 0u32;
    // The endpoint said it does not stream (it is asked plainly from then on).
    let mut refused_stream = false;
    // Tries so far whose stream broke or stalled (a connection lost, reset or silent).
    let mut streams_broke = 0u32;
    // The timeout bounds the call, retries included: each attempt had it whole, and a model that
    // never answered held its session (and a slot of the endpoint's concurrency) for four times
    // `model.timeout_seconds` (40 minutes by default) before the turn failed.
    loop {
        let mut delivered = false;
        let mut retry_after = None;
        let mut cancel = call.cancel.clone();
        let attempt_call = one_call(
            client,
            config,
            call,
            stream,
            deadline,
            &mut delivered,
            &mut retry_after,
        );
        let result = tokio::select! {
            r = tokio::time::timeout_at(deadline, attempt_call) => match r {
                Ok(r) => r,
                Err(_) => return Err(ModelError::Timeout(format!(
                    "no complete response within {:?}",
                    call.timeout
                ))),
            },
            _ = wait_cancel(&mut cancel) => return Err(ModelError::Interrupted),
        };
        match result {
            Ok(r) => return Ok((r, refused_stream)),
            // A server that refuses to stream is asked once more, plainly (nothing was shown).
            Err(ModelError::Client(m)) if stream && !delivered && refuses_streaming(&m) => {
                tracing::warn!(error = %m, "the model endpoint does not stream; asking without streaming");
                stream = false;
                refused_stream = true;
            }
            Err(e) if call.retry && e.retryable() && !delivered && attempt < config.max_retries => {
                attempt += 1;
                // A server that says when to come back (`Retry-After`, on a 429 or a 503) is
                // asked again no sooner, within the call's time; ours is the least wait.
                // Spread within the call's time: a server's wait that fits is kept to, not given
                // up for a spread that would pass the deadline (nor is the spread dropped, which
                // sent the calls refused together back together).
                let floor = wait_before(config.retry_base, attempt, retry_after);
                let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                let backoff = floor + spread(floor, left.saturating_sub(floor));
                let wake = tokio::time::Instant::now() + backoff;
                if wake >= deadline {
                    // No time left for another attempt: this one's error is the call's.
                    return Err(e);
                }
                // The last try of a stream that broke (or stalled) on every try before, with
                // nothing shown, asks plainly: something between here and the server (a proxy
                // that cuts or holds event streams) may break only streams. This call only: the
                // next one streams again.
                if stream && matches!(e, ModelError::Transient(_) | ModelError::Timeout(_)) {
                    streams_broke += 1;
                }
                if stream && attempt == config.max_retries && streams_broke == attempt {
                    tracing::warn!(error = %e, "the stream broke on every try; the last asks without streaming");
                    stream = false;
                }
                tracing::warn!(error = %e, attempt, ?backoff, "model call failed; retrying");
                tokio::select! {
                    _ = tokio::time::sleep_until(wake) => {}
                    _ = wait_cancel(&mut cancel) => return Err(ModelError::Interrupted),
                }
            }
            Err(e) => return Err(e),
        }
    }
}

/// The least wait before try `attempt` + 1 (`attempt` ≥ 1): doubling from `base`, at most 60 s,
/// no less than the server's `Retry-After`. It is then spread ([`spread`]): the sessions a rate
/// limit refused together asked again all at once, and were refused together again; the
/// server's wait and the cap are spread too (they set the same wait for every session).
fn wait_before(base: Duration, attempt: u32, retry_after: Option<Duration>) -> Duration {
    (base * 2u32.saturating_pow(attempt.saturating_sub(1)))
        .min(Duration::from_secs(60))
        .max(retry_after.unwrap_or_default())
}

/// What to add to `wait`, at random: up to half of it, and less than `room` (the time left
/// after it), spread evenly over what may be added.
fn spread(wait: Duration, room: Duration) -> Duration {
    let fraction = (uuid::Uuid::new_v4().as_u128() % 1024) as f64 / 1024.0;
    (wait / 2)
        .min(room.saturating_sub(Duration::from_millis(1)))
        .mul_f64(fraction)
}

/// `url` without the user and password it may carry (`https://user:key@host/v1`), for the log.
fn without_userinfo(url: &str) -> std::borrow::Cow<'_, str> {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
        return url.into();
    };
    let authority_end = url[scheme_end..]
        .find('/')
        .map_or(url.len(), |i| scheme_end + i);
    match url[scheme_end..authority_end].rfind('@') {
        Some(at) => format!("{}…{}", &url[..scheme_end], &url[scheme_end + at..]).into(),
        None => url.into(),
    }
}

/// Does a refusal say that the endpoint does not stream ("stream not supported",
/// "streaming is not available for this model", …)?
fn refuses_streaming(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    // The word itself ("stream", "streaming", `"stream"`), not "upstream".
    let names_streaming = m.match_indices("stream").any(|(i, _)| {
        !m[..i]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_ascii_alphanumeric())
    });
    names_streaming
        && [
            "not supported",
            "unsupported",
            "not available",
            "does not support",
            "not allowed",
            // A server that takes no field it does not know refuses the streaming options
            // (`stream_options`): every streamed turn failed there.
            "not permitted",
            "extra_forbidden",
            "unrecognized",
            "unknown parameter",
            "unknown field",
        ]
        .iter()
        .any(|p| m.contains(p))
}

/// The request's bytes: the body as the turn built it, with the streaming options after its
/// fields when the call streams. Written from the turn's value, so no call copies the
/// transcript first (a body that already names the options, or is no object, is copied and
/// given them).
fn request_body(call: &ChatCall, stream: bool) -> serde_json::Result<Vec<u8>> {
    #[derive(serde::Serialize)]
    struct Streaming<'a> {
        #[serde(flatten)]
        body: &'a serde_json::Map<String, Value>,
        stream: bool,
        stream_options: StreamOptions,
    }
    #[derive(serde::Serialize)]
    struct StreamOptions {
        include_usage: bool,
    }
    if !stream {
        return serde_json::to_vec(&call.body);
    }
    match call.body.as_object() {
        Some(body) if !body.contains_key("stream") && !body.contains_key("stream_options") => {
            serde_json::to_vec(&Streaming {
                body,
                stream: true,
                stream_options: StreamOptions {
                    include_usage: true,
                },
            })
        }
        _ => {
            let mut body = call.body.clone();
            body["stream"] = Value::Bool(true);
            body["stream_options"] = serde_json::json!({"include_usage": true});
            serde_json::to_vec(&body)
        }
    }
}

/// The first `max` bytes of a response's body (fewer if it ends, fails, or falls silent for
/// `idle` first).
async fn head_of<S>(resp: &mut awc::ClientResponse<S>, max: usize, idle: Duration) -> Vec<u8>
where
    S: futures_util::Stream<Item = Result<bytes::Bytes, awc::error::PayloadError>> + Unpin,
{
    use futures_util::StreamExt;
    let mut out = Vec::new();
    while out.len() < max {
        match tokio::time::timeout(idle, resp.next()).await.ok().flatten() {
            Some(Ok(chunk)) => {
                let take = chunk.len().min(max - out.len());
                out.extend_from_slice(&chunk[..take]);
            }
            _ => break,
        }
    }
    out
}

async fn one_call(
    client: &awc::Client,
    config: &ModelClientConfig,
    call: &ChatCall,
    stream: bool,
    deadline: tokio::time::Instant,
    delivered: &mut bool,
    retry_after: &mut Option<Duration>,
) -> Result<ChatResponse, ModelError> {
    let base = call
        .base_url
        .as_deref()
        .ok_or_else(|| ModelError::Client("no base_url configured".into()))?;
    let url = format!("{}/chat/completions", base.trim_end_matches('/'));
    let mut req = client
        .post(&url)
        .insert_header(("Content-Type", "application/json"));
    if let Some(key) = call.api_key.as_deref().filter(|k| !k.is_empty()) {
        req = req.insert_header(("Authorization", format!("Bearer {key}")));
    }
    let payload = request_body(call, stream).map_err(|e| ModelError::Client(e.to_string()))?;
    let sent = req.send_body(payload);
    // A stream's head is part of its silence: a server (or a proxy) that took the request and
    // never answered held the call for its whole timeout, never asked again, where a stream
    // that fell silent after its head was given up at the idle timeout. A plain reply's head
    // may come only with the whole answer: the call's timeout bounds it.
    let mut resp = if stream {
        tokio::time::timeout(config.idle_timeout, sent)
            .await
            .map_err(|_| {
                ModelError::Timeout(format!("no response head for {:?}", config.idle_timeout))
            })?
    } else {
        sent.await
    }
    .map_err(|e| ModelError::Transient(format!("send: {e}")))?;
    let status = resp.status().as_u16();
    if status != 200 {
        *retry_after = resp
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(retry_after_seconds);
        // Its head: a longer refusal (a proxy that echoes the request) was read as empty, and a
        // context overflow it named was taken for another refusal. A body that falls silent is
        // read no further (its status classifies it): waited for, it held the call to its
        // timeout, and a refusal that allowed a retry got none.
        let bytes = head_of(&mut resp, 64 * 1024, config.idle_timeout).await;
        return Err(classify(status, &String::from_utf8_lossy(&bytes)));
    }
    // HTTP/1.1 allows a body delimited by the connection's close (no length, not chunked), but
    // this client reads such a body as empty: say so, rather than take it for an empty answer.
    let headers = resp.headers();
    if resp.version() == awc::http::Version::HTTP_11
        && !headers.contains_key("content-length")
        && !headers.contains_key("transfer-encoding")
    {
        return Err(ModelError::Unreadable(
            "an HTTP/1.1 reply with neither Content-Length nor chunked encoding (its body ends \
             when the connection closes), which this client does not read; send chunked replies \
             (a proxy in front of the endpoint can)"
                .into(),
        ));
    }
    let labelled = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("text/event-stream"));
    // A body not labelled a stream is looked at first: a stream labelled as another type (a
    // proxy's `text/plain`, or no type) is read as the stream it is. Taken for a malformed
    // reply, it was asked for again (a whole generation each time) on every retry.
    let mut first: Option<bytes::Bytes> = None;
    // The body ended while it was looked at: not read again (a finished payload polled again
    // panics in awc's decoder).
    let mut ended = false;
    let is_sse = labelled || {
        use futures_util::StreamExt;
        let wait = if stream {
            config.idle_timeout
        } else {
            call.timeout
        };
        // Enough to tell (`data:` and a character, past any blank lines), or all there is.
        let mut seen = bytes::BytesMut::new();
        while events_start(&seen).len() < 6 && seen.len() <= config.max_response_bytes {
            match tokio::time::timeout(wait, resp.next()).await {
                Ok(Some(Ok(bytes))) => seen.extend_from_slice(&bytes),
                Ok(Some(Err(e))) => return Err(ModelError::Transient(format!("body: {e}"))),
                Ok(None) => {
                    ended = true;
                    break;
                }
                Err(_) => return Err(ModelError::Timeout("response body".into())),
            }
        }
        let events = looks_like_events(&seen);
        first = Some(seen.freeze());
        events
    };
    if !is_sse {
        let max = config.max_response_bytes;
        let head = first.take().unwrap_or_default();
        if head.len() > max {
            return Err(ModelError::TooLarge(max));
        }
        // The whole body against the bound: awc's own limit compares a Content-Length (the
        // whole body's) with it before reading.
        let rest = if ended {
            bytes::Bytes::new()
        } else {
            tokio::time::timeout(call.timeout, resp.body().limit(max))
                .await
                .map_err(|_| ModelError::Timeout("response body".into()))?
                .map_err(|e| match e {
                    awc::error::PayloadError::Overflow => ModelError::TooLarge(max),
                    other => ModelError::Transient(format!("body: {other}")),
                })?
        };
        if head.len() + rest.len() > max {
            return Err(ModelError::TooLarge(max));
        }
        let mut bytes = head.to_vec();
        bytes.extend_from_slice(&rest);
        let v: Value =
            serde_json::from_slice(&bytes).map_err(|e| ModelError::Malformed(e.to_string()))?;
        // `"error": null` (or an empty one) beside an answer is no error.
        if let Some(error) = reported_error(&v) {
            return Err(classify_in_band(&error.to_string()));
        }
        return parse_response(&v).map_err(ModelError::Malformed);
    }
    let mut parser = SseParser::new();
    let mut acc = StreamAccumulator::default();
    let mut total = 0usize;
    let mut done = false;
    let mut saw_done = false;
    // When the last event came: comments (`: keep-alive`, `: PROCESSING`) are silence too. A
    // server whose upstream was stuck sent them for as long as it was, and the call waited out
    // its whole `timeout_seconds`, not asked again.
    let mut event_at = tokio::time::Instant::now();
    while !done {
        // Once a chunk has said why the answer ended, what may still come is its usage and
        // `[DONE]`: a server that falls silent then has answered (the turn failed at the idle
        // timeout, after the client had seen the whole answer).
        let wait = if acc.finished() {
            config.idle_timeout.min(FINISHED_GRACE)
        } else {
            config.idle_timeout
        }
        .min(config.idle_timeout.saturating_sub(event_at.elapsed()));
        // That wait ends by the call's deadline too: the attempt's own time-out is at the
        // deadline, but this one is polled first, so the answer is kept. Passing in the wait,
        // the deadline failed the call with a time-out, the answer whole and shown.
        let mut until = tokio::time::Instant::now() + wait;
        if acc.finished() {
            until = until.min(deadline);
        }
        let peeked = first.take().map(|bytes| Some(Ok(bytes)));
        let next = match peeked {
            Some(next) => next,
            // Its end was met while it was looked at.
            None if ended => None,
            None => match tokio::time::timeout_at(until, resp.next()).await {
                Ok(next) => next,
                Err(_) if acc.finished() => {
                    tracing::debug!(
                        "the stream fell silent after its finish_reason; taken as ended"
                    );
                    break;
                }
                Err(_) => {
                    return Err(ModelError::Timeout(format!(
                        "no event for {:?} (comments are not events)",
                        config.idle_timeout
                    )))
                }
            },
        };
        let mut at_body_end = false;
        let mut events = match next {
            None => {
                let rest = parser.finish();
                done = true;
                at_body_end = true;
                rest
            }
            // The answer had ended (its finish_reason came): what was lost after it is at most
            // its usage and `[DONE]`, as with a server that falls silent there.
            Some(Err(e)) if acc.finished() => {
                tracing::debug!(error = %e, "the stream broke after its finish_reason; taken as ended");
                break;
            }
            Some(Err(e)) => return Err(ModelError::Transient(format!("stream: {e}"))),
            // The answer is bounded by what it keeps (below); the bytes on the wire, mostly the
            // events' framing, by a multiple of that, and one event by twice it (its JSON may
            // escape every character). The stream's bytes were the bound: an answer streamed a
            // token at a time, in events of some 230 bytes each, was refused at 36,000 tokens of
            // the default 8 MiB, after it had all been shown, where the same answer sent whole
            // was 200 KB.
            Some(Ok(bytes)) => {
                total += bytes.len();
                if total > config.max_response_bytes.saturating_mul(STREAM_FRAMING)
                    || parser.pending_len() > config.max_response_bytes.saturating_mul(2)
                {
                    return Err(ModelError::TooLarge(config.max_response_bytes));
                }
                parser.feed(&bytes)
            }
        };
        // An event whose data is empty or blank (`data: `, a keep-alive some proxies send) is
        // skipped as a comment is, and is silence as a comment is: read as JSON, it ended the
        // stream as malformed.
        events.retain(|data| !data.trim().is_empty());
        if !events.is_empty() {
            event_at = tokio::time::Instant::now();
        }
        for data in events {
            if data.trim() == "[DONE]" {
                done = true;
                saw_done = true;
                break;
            }
            // After the answer has ended (its finish_reason came), an event that is cut short
            // (by the body's end), malformed, or an error is no part of it: the stream is taken
            // as ended, as one that breaks or falls silent there is. Failed, the whole answer
            // was lost after it had been shown.
            let chunk: Value = match serde_json::from_str(&data) {
                Ok(chunk) => chunk,
                Err(e) if acc.finished() => {
                    tracing::debug!(error = %e, "a malformed event after the finish_reason; taken as ended");
                    done = true;
                    break;
                }
                // The body ended (cleanly) inside an event: cut off, as a body that ends
                // between events before the answer did; not a server's malformed answer.
                Err(e) if at_body_end => {
                    return Err(ModelError::Transient(format!(
                        "stream ended inside an event (cut off): {e}"
                    )))
                }
                Err(e) => return Err(ModelError::Malformed(format!("SSE chunk: {e}"))),
            };
            let delta = match acc.apply(&chunk) {
                Ok(delta) => delta,
                Err(e) if acc.finished() => {
                    tracing::debug!(error = %e, "an error event after the finish_reason; taken as ended");
                    done = true;
                    break;
                }
                Err(e) => return Err(classify_in_band(&e)),
            };
            if acc.kept_bytes() > config.max_response_bytes {
                return Err(ModelError::TooLarge(config.max_response_bytes));
            }
            if let Some(sink) = &call.deltas {
                if let Some(text) = delta.content {
                    *delivered = true;
                    sink(StreamEvent::Content(text));
                }
                if let Some(text) = delta.reasoning {
                    *delivered = true;
                    sink(StreamEvent::Reasoning(text));
                }
                for name in delta.tool_names {
                    *delivered = true;
                    sink(StreamEvent::ToolName(name));
                }
            }
        }
    }
    // A body that ends (the connection closed cleanly) before `[DONE]` and before any chunk said
    // why the answer ended was cut off: keeping it would store part of an answer, or none, as
    // the whole of one.
    if !saw_done && !acc.finished() {
        return Err(ModelError::Transient(
            "stream ended before a finish_reason or [DONE] (cut off)".into(),
        ));
    }
    Ok(acc.finish())
}

/// Does a body start as server-sent events do (a `data:`, `event:`, `id:`, `retry:` or comment
/// line)? A stream may open with any field, or with a byte-order mark: not taken for one, it
/// was read as a malformed reply and asked for again.
fn looks_like_events(body: &[u8]) -> bool {
    let start = events_start(body);
    [&b"data:"[..], b"event:", b"id:", b"retry:", b":"]
        .iter()
        .any(|p| start.starts_with(p))
}

/// A body from its first line that is not blank, past a leading UTF-8 byte-order mark.
fn events_start(body: &[u8]) -> &[u8] {
    body.strip_prefix(b"\xEF\xBB\xBF")
        .unwrap_or(body)
        .trim_ascii_start()
}

/// A `Retry-After` value in seconds (a number; an HTTP date is not read, and the usual back-off
/// applies), at most an hour.
fn retry_after_seconds(value: &str) -> Option<Duration> {
    let seconds: f64 = value.trim().parse().ok()?;
    (seconds.is_finite() && seconds >= 0.0).then(|| Duration::from_secs_f64(seconds.min(3600.0)))
}

/// The bytes a stream may carry, as a multiple of `model.max_response_bytes` (the bound of the
/// answer it keeps): room for the framing of an answer streamed a token at a time.
const STREAM_FRAMING: usize = 8;

/// How long a stream whose answer has ended (a `finish_reason` came) may stay silent before it
/// is taken as ended without its `[DONE]`.
const FINISHED_GRACE: Duration = Duration::from_secs(2);

/// What an error the model reports in its body says, by class (checked in this order).
const RATE_PHRASES: &[&str] = &["rate limit", "rate_limit", "too many requests", "quota"];
const AUTH_PHRASES: &[&str] = &[
    "unauthorized",
    "unauthenticated",
    "authentication",
    "invalid api key",
    "invalid_api_key",
    "incorrect api key",
    "permission denied",
    "permission_denied",
    "forbidden",
];
const SERVER_PHRASES: &[&str] = &[
    "connection lost",
    "connection reset",
    "connection closed",
    "overloaded",
    "server_error",
    "server error",
    "internal error",
    "internal_error",
    "timed out",
    "timeout",
    "unavailable",
    "try again",
];

/// Classify an error the model reported in its body (a stream's `{"error": …}` event, or a
/// plain reply's `error`), given as its JSON text: by its own status when it carries one
/// (`code` or `status`, 400–599), as an HTTP error of that status; else by what it says. Only a
/// server-side failure (a connection lost, reset or closed, an overloaded or failing server, a
/// time-out) or a rate limit is asked again: a bad key or an unknown model would fail the same
/// way on every try, each one a request.
fn classify_in_band(error: &str) -> ModelError {
    let v: Value = serde_json::from_str(error).unwrap_or_else(|_| Value::String(error.into()));
    let status = ["code", "status"]
        .iter()
        .filter_map(|k| v.get(k))
        .find_map(|c| c.as_u64().or_else(|| c.as_str()?.trim().parse().ok()))
        .filter(|s| (400..600).contains(s));
    if let Some(status) = status {
        return classify(status as u16, error);
    }
    let lower = error.to_lowercase();
    let says = |phrases: &[&str]| phrases.iter().any(|p| lower.contains(p));
    let snippet: String = redact(error).chars().take(500).collect();
    if says(OVERFLOW_PHRASES) {
        ModelError::ContextOverflow(snippet)
    } else if says(RATE_PHRASES) {
        ModelError::RateLimited(snippet)
    } else if says(AUTH_PHRASES) {
        ModelError::Auth(snippet)
    } else if says(SERVER_PHRASES) {
        ModelError::Transient(format!("model error: {snippet}"))
    } else {
        ModelError::Client(format!("model error: {snippet}"))
    }
}

/// The built-in `echo` provider: answers by echoing, and says so.
fn echo_reply(body: &Value) -> ChatResponse {
    let last = body
        .get("messages")
        .and_then(|m| m.as_array())
        .and_then(|m| {
            m.iter()
                .rev()
                .find(|m| m.get("role").and_then(|r| r.as_str()) == Some("user"))
        })
        .and_then(|m| m.get("content"))
        .and_then(|c| c.as_str())
        .unwrap_or("");
    ChatResponse {
        content: Some(format!(
            "[echo provider: this session answers with the built-in echo, not a model] {last}"
        )),
        finish_reason: "stop".into(),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error the model reports in its body is classed by its own status, else by what it
    /// says; only a failing server and a rate limit are asked again.
    #[test]
    fn an_error_in_the_body_is_classed_as_its_status_or_words_say() {
        let class = |error: serde_json::Value| {
            let e = classify_in_band(&error.to_string());
            (e.class(), e.retryable())
        };
        for (error, want) in [
            (
                serde_json::json!({"message": "Incorrect API key provided", "type": "invalid_request_error", "code": "invalid_api_key"}),
                ("auth", false),
            ),
            (
                serde_json::json!({"message": "nope", "code": 401}),
                ("auth", false),
            ),
            (
                serde_json::json!({"message": "slow down", "code": "429"}),
                ("rate_limited", true),
            ),
            (
                serde_json::json!({"message": "Rate limit reached for requests"}),
                ("rate_limited", true),
            ),
            (
                serde_json::json!({"message": "The model `x` does not exist", "code": "model_not_found"}),
                ("client", false),
            ),
            (
                serde_json::json!({"message": "bad", "status": 404}),
                ("client", false),
            ),
            (
                serde_json::json!({"message": "upstream failed", "code": 502}),
                ("transient", true),
            ),
            (
                serde_json::json!({"message": "The server had an error", "type": "server_error", "code": null}),
                ("transient", true),
            ),
            (
                serde_json::json!({"type": "overloaded_error", "message": "Overloaded"}),
                ("transient", true),
            ),
            (
                serde_json::json!("connection reset by peer"),
                ("transient", true),
            ),
            (
                serde_json::json!({"message": "This model's maximum context length is 8192 tokens", "code": "context_length_exceeded"}),
                ("context_overflow", false),
            ),
            (
                serde_json::json!({"message": "too long", "code": 413}),
                ("context_overflow", false),
            ),
            (
                serde_json::json!({"message": "something odd"}),
                ("client", false),
            ),
            (
                serde_json::json!({"message": "The service is currently unavailable"}),
                ("transient", true),
            ),
        ] {
            assert_eq!(class(error.clone()), want, "{error}");
        }
    }

    #[test]
    fn classification_checks_overflow_before_generic_client_errors() {
        let body = r#"{"error":{"message":"This model's maximum context length is 64000 tokens.","type":"invalid_request_error","code":"context_length_exceeded"}}"#;
        assert!(matches!(
            classify(400, body),
            ModelError::ContextOverflow(_)
        ));
        assert!(matches!(
            classify(413, "too big"),
            ModelError::ContextOverflow(_)
        ));
        // llama.cpp's server, current and older.
        for body in [
            r#"{"error":{"code":400,"message":"request (9000 tokens) exceeds the available context size (8192 tokens), try increasing it","type":"exceed_context_size_error","n_ctx":8192,"n_prompt_tokens":9000}}"#,
            r#"{"error":{"code":400,"message":"the request exceeds the available context size, try increasing it","type":"invalid_request_error"}}"#,
        ] {
            assert!(
                matches!(classify(400, body), ModelError::ContextOverflow(_)),
                "{body}"
            );
        }
        // Gemini's, xAI's and Bedrock's wording.
        for body in [
            r#"{"error":{"code":400,"message":"The input token count (134123) exceeds the maximum number of tokens allowed (131072).","status":"INVALID_ARGUMENT"}}"#,
            r#"{"code":"Client specified an invalid argument","error":"This model's maximum prompt length is 131072 but the request contains 136973 tokens."}"#,
            r#"{"message":"Input is too long for requested model."}"#,
        ] {
            assert!(
                matches!(classify(400, body), ModelError::ContextOverflow(_)),
                "{body}"
            );
        }
        assert!(matches!(classify(400, "bad field"), ModelError::Client(_)));
        assert!(matches!(classify(429, ""), ModelError::RateLimited(_)));
        assert_eq!(retry_after_seconds(" 2 "), Some(Duration::from_secs(2)));
        assert_eq!(retry_after_seconds("0.5"), Some(Duration::from_millis(500)));
        assert_eq!(retry_after_seconds("1e9"), Some(Duration::from_secs(3600)));
        for odd in ["-1", "NaN", "inf", "Wed, 21 Oct 2026 07:28:00 GMT", ""] {
            assert_eq!(retry_after_seconds(odd), None, "{odd}");
        }
        assert!(matches!(classify(503, ""), ModelError::Transient(_)));
        assert!(matches!(classify(408, ""), ModelError::Transient(_)));
        assert!(matches!(classify(409, ""), ModelError::Transient(_)));
        assert!(matches!(classify(404, ""), ModelError::Client(_)));
        assert!(matches!(classify(401, ""), ModelError::Auth(_)));
    }

    #[test]
    fn a_jittered_wait_is_at_least_the_wait_and_at_most_half_again() {
        let wait = Duration::from_millis(1000);
        let waits: Vec<Duration> = (0..200)
            .map(|_| wait + spread(wait, Duration::MAX))
            .collect();
        assert!(waits.iter().all(|w| *w >= wait && *w < wait.mul_f64(1.5)));
        assert!(waits.iter().any(|w| *w != waits[0]), "not all the same");
    }

    /// The back-off doubles up to its cap and keeps to a server's `Retry-After`; the waits these
    /// set are spread as well, not the same for every session.
    #[test]
    fn a_back_off_keeps_to_the_servers_wait_and_is_spread() {
        fn spread_wait(base: Duration, attempt: u32, retry_after: Option<Duration>) -> Duration {
            let wait = wait_before(base, attempt, retry_after);
            wait + spread(wait, Duration::MAX)
        }
        let base = Duration::from_millis(500);
        let within = |w: Duration, at_least: Duration| w >= at_least && w < at_least.mul_f64(1.5);
        assert!(within(spread_wait(base, 1, None), base));
        assert!(within(spread_wait(base, 3, None), base * 4));
        for (attempt, retry_after, at_least) in [
            (1, Some(Duration::from_secs(30)), Duration::from_secs(30)),
            (20, None, Duration::from_secs(60)),
        ] {
            let waits: Vec<Duration> = (0..200)
                .map(|_| spread_wait(base, attempt, retry_after))
                .collect();
            assert!(waits.iter().all(|w| within(*w, at_least)), "{waits:?}");
            assert!(waits.iter().any(|w| *w != waits[0]), "not all the same");
        }
        // Within the time left: less than the room, and still spread.
        let room = Duration::from_millis(400);
        let spreads: Vec<Duration> = (0..200)
            .map(|_| spread(Duration::from_secs(3), room))
            .collect();
        assert!(spreads.iter().all(|s| *s < room), "{spreads:?}");
        assert!(spreads.iter().any(|s| *s != spreads[0]), "not all the same");
    }

    #[test]
    fn a_refusal_says_no_secret_and_a_logged_endpoint_no_userinfo() {
        let key = "sk-abcdefghijklmnopqrstuvwxyz0123";
        for error in [
            classify(400, &format!("echo: Authorization: Bearer {key}")),
            classify_in_band(&format!(r#"{{"message":"bad key {key}"}}"#)),
        ] {
            assert!(!error.to_string().contains(key), "{error}");
        }
        assert_eq!(
            without_userinfo("openai|https://me:sk-secret@host:8/v1"),
            "openai|https://…@host:8/v1"
        );
        assert_eq!(without_userinfo("p|http://host/v1"), "p|http://host/v1");
        assert_eq!(without_userinfo("echo|"), "echo|");
    }

    #[test]
    fn a_refusal_to_stream_is_told_from_other_refusals() {
        for m in [
            "Streaming is not supported for this model",
            "stream: unsupported parameter",
            "This endpoint does not support streaming",
            r#"HTTP 422: {"object":"error","message":{"detail":[{"type":"extra_forbidden","loc":["body","stream_options","include_usage"],"msg":"Extra inputs are not permitted"}]}}"#,
            "Unrecognized request argument supplied: stream_options",
        ] {
            assert!(refuses_streaming(m), "{m}");
        }
        for m in [
            "bad field temperature",
            "model not found",
            "stream_options must be an object",
            "upstream model not available",
        ] {
            assert!(!refuses_streaming(m), "{m}");
        }
    }

    #[actix_rt::test]
    async fn endpoints_without_calls_in_flight_are_forgotten() {
        let mut client = ModelClient::new(ModelClientConfig {
            connect_timeout: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(1),
            max_concurrent: 2,
            max_retries: 0,
            max_response_bytes: 1024,
            retry_base: Duration::from_millis(1),
            metrics: None,
        });
        let busy = client.limit_for("custom|http://busy".into());
        let again = client.limit_for("custom|http://busy".into());
        assert!(Arc::ptr_eq(&busy, &again), "one limit per endpoint");
        drop(again);
        for i in 0..MAX_IDLE_ENDPOINTS * 3 {
            drop(client.limit_for(format!("custom|http://idle-{i}")));
        }
        assert!(
            client.limits.len() <= MAX_IDLE_ENDPOINTS,
            "{}",
            client.limits.len()
        );
        // The endpoint with a call in flight kept its limit (and its permits).
        assert!(Arc::ptr_eq(
            &busy,
            &client.limit_for("custom|http://busy".into())
        ));
    }

    /// A call's wait for its cancel ends when it is cancelled, or when its sender is gone;
    /// not while the sender lives.
    #[actix_rt::test]
    async fn a_call_is_cancelled_when_its_turn_is_gone() {
        let (tx, mut rx) = watch::channel(false);
        let waited = tokio::time::timeout(Duration::from_millis(50), wait_cancel(&mut rx)).await;
        assert!(waited.is_err(), "no cancel yet");
        drop(tx);
        let waited = tokio::time::timeout(Duration::from_secs(5), wait_cancel(&mut rx)).await;
        assert!(waited.is_ok(), "the sender is gone");
        let (tx, mut rx) = watch::channel(false);
        let _ = tx.send(true);
        let waited = tokio::time::timeout(Duration::from_secs(5), wait_cancel(&mut rx)).await;
        assert!(waited.is_ok(), "cancelled");
    }

    /// A model endpoint on a local port: each request's body is kept, and answered with what
    /// `reply` writes for it (the whole response, as it goes on the wire). A response left open
    /// (chunked, without its last chunk) holds its connection until the test ends.
    struct FakeEndpoint {
        url: String,
        requests: std::rc::Rc<std::cell::RefCell<Vec<Value>>>,
    }

    async fn fake_endpoint(reply: impl Fn(&Value) -> String + 'static) -> FakeEndpoint {
        use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("http://{}/v1", listener.local_addr().expect("addr"));
        let requests = std::rc::Rc::<std::cell::RefCell<Vec<Value>>>::default();
        let (seen, reply) = (requests.clone(), std::rc::Rc::new(reply));
        actix_rt::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                let (seen, reply) = (seen.clone(), reply.clone());
                actix_rt::spawn(async move {
                    let mut conn = tokio::io::BufReader::new(conn);
                    // Every request of the connection (the client keeps it for the next).
                    loop {
                        let mut length = 0;
                        loop {
                            let mut line = String::new();
                            if conn.read_line(&mut line).await.unwrap_or(0) == 0 {
                                return;
                            }
                            let line = line.trim_end().to_ascii_lowercase();
                            if line.is_empty() {
                                break;
                            }
                            if let Some(n) = line.strip_prefix("content-length:") {
                                length = n.trim().parse().expect("a length");
                            }
                        }
                        let mut body = vec![0; length];
                        conn.read_exact(&mut body).await.expect("a body");
                        let body: Value = serde_json::from_slice(&body).expect("json");
                        let response = reply(&body);
                        seen.borrow_mut().push(body);
                        if conn.get_mut().write_all(response.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        FakeEndpoint { url, requests }
    }

    /// A 200 response of `kind` whose body is `body`, in one chunk; the body ends when `end`,
    /// else the response is left open.
    fn chunked(kind: &str, body: &str, end: bool) -> String {
        format!(
            "HTTP/1.1 200 OK\r\ncontent-type: {kind}\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{body}\r\n{}",
            body.len(),
            if end { "0\r\n\r\n" } else { "" }
        )
    }

    /// One event of a streamed answer `text`, its finish_reason with it.
    fn finished_event(text: &str) -> String {
        let chunk = serde_json::json!({"choices": [{"index": 0, "delta": {"content": text},
            "finish_reason": "stop"}]});
        format!("data: {chunk}\n\n")
    }

    fn test_config() -> ModelClientConfig {
        ModelClientConfig {
            connect_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(10),
            max_concurrent: 4,
            max_retries: 0,
            max_response_bytes: 1 << 20,
            retry_base: Duration::from_millis(1),
            metrics: None,
        }
    }

    /// A streamed call of model `model` at `url`, within `timeout`; the returned sender keeps it
    /// from being taken as cancelled.
    fn streamed_call(url: &str, model: &str, timeout: Duration) -> (ChatCall, watch::Sender<bool>) {
        let (tx, cancel) = watch::channel(false);
        let call = ChatCall {
            provider: "custom".into(),
            base_url: Some(url.to_string()),
            api_key: None,
            body: serde_json::json!({"model": model, "messages": [{"role": "user", "content": "hi"}]}),
            stream: true,
            deltas: None,
            cancel,
            timeout,
            retry: true,
        };
        (call, tx)
    }

    /// One streamed call of `model` at `url` (no retries), within `timeout`.
    async fn stream_once(
        url: &str,
        model: &str,
        timeout: Duration,
    ) -> Result<ChatResponse, ModelError> {
        let client = ModelClient::new(test_config());
        let (call, _tx) = streamed_call(url, model, timeout);
        let deadline = tokio::time::Instant::now() + timeout;
        call_with_retries(&client.client, &client.config, &call, true, deadline)
            .await
            .map(|(response, _)| response)
    }

    /// One model of an endpoint that refuses to stream is asked plainly from then on; another
    /// model of the same endpoint still streams (it was asked plainly too, its live output
    /// lost).
    #[actix_rt::test]
    async fn a_model_that_refuses_to_stream_is_asked_plainly_alone() {
        let endpoint = fake_endpoint(|body| {
            let streamed = body["stream"] == true;
            if streamed && body["model"] == "plain" {
                let refusal = r#"{"error":{"message":"Streaming is not supported for this model"}}"#;
                return format!(
                    "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{refusal}",
                    refusal.len()
                );
            }
            if streamed {
                return chunked(
                    "text/event-stream",
                    &format!("{}data: [DONE]\n\n", finished_event("hi")),
                    true,
                );
            }
            let answer = serde_json::json!({"choices": [{"message": {"content": "hi"},
                "finish_reason": "stop"}]})
            .to_string();
            format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{answer}",
                answer.len()
            )
        })
        .await;
        let client = ModelClient::new(test_config()).start();
        for model in ["plain", "streams", "plain"] {
            let (call, _tx) = streamed_call(&endpoint.url, model, Duration::from_secs(30));
            let answer = client.send(call).await.expect("sent").expect("an answer");
            assert_eq!(answer.content.as_deref(), Some("hi"), "{model}");
        }
        let asked: Vec<(String, bool)> = endpoint
            .requests
            .borrow()
            .iter()
            .map(|b| {
                (
                    b["model"].as_str().unwrap_or("").to_string(),
                    b["stream"] == true,
                )
            })
            .collect();
        let want = [
            ("plain", true),
            ("plain", false),
            ("streams", true),
            ("plain", false),
        ]
        .map(|(m, s)| (m.to_string(), s));
        assert_eq!(asked, want);
    }

    /// An event whose data is empty or blank (a proxy's keep-alive) is skipped as a comment
    /// is: it ended the stream as malformed.
    #[actix_rt::test]
    async fn a_blank_event_is_skipped_as_a_comment_is() {
        let body = format!(
            "data: \n\ndata:\t \n\n{}data: [DONE]\n\n",
            finished_event("hi")
        );
        let endpoint = fake_endpoint(move |_| chunked("text/event-stream", &body, true)).await;
        let answer = stream_once(&endpoint.url, "m", Duration::from_secs(30))
            .await
            .expect("an answer");
        assert_eq!(answer.content.as_deref(), Some("hi"));
    }

    /// A stream whose answer has finished, and that then falls silent past the call's
    /// deadline (within its grace for usage and `[DONE]`), has answered: the deadline passing
    /// in that wait failed the call with a time-out.
    #[actix_rt::test]
    async fn a_finished_answer_is_kept_when_the_deadline_passes_after_it() {
        let endpoint =
            fake_endpoint(|_| chunked("text/event-stream", &finished_event("hi"), false)).await;
        let timeout = Duration::from_millis(300);
        assert!(timeout < FINISHED_GRACE);
        let answer = stream_once(&endpoint.url, "m", timeout)
            .await
            .expect("the finished answer");
        assert_eq!(answer.content.as_deref(), Some("hi"));
    }

    /// A stream not labelled as one is read as one when it opens with a byte-order mark, or
    /// with an `id:` or `retry:` field, and its first event is kept.
    #[actix_rt::test]
    async fn a_stream_opening_with_a_mark_or_another_field_is_read_whole() {
        for opening in ["\u{FEFF}", "id: 1\n", "retry: 1000\n", "\u{FEFF}: hello\n"] {
            let body = format!("{opening}{}data: [DONE]\n\n", finished_event("hi"));
            let endpoint = fake_endpoint(move |_| chunked("text/plain", &body, true)).await;
            let answer = stream_once(&endpoint.url, "m", Duration::from_secs(30))
                .await
                .unwrap_or_else(|e| panic!("{opening:?}: {e}"));
            assert_eq!(answer.content.as_deref(), Some("hi"), "{opening:?}");
        }
        assert!(!looks_like_events(b"\xEF\xBB\xBF{\"choices\": []}"));
    }

    /// The request's bytes are the turn's body, with the streaming options when the call
    /// streams; a body that names them already has them replaced, as before.
    #[test]
    fn a_request_body_is_the_turns_body_with_the_streaming_options() {
        let call = |body: Value, stream: bool| ChatCall {
            provider: "custom".into(),
            base_url: None,
            api_key: None,
            body,
            stream,
            deltas: None,
            cancel: watch::channel(false).1,
            timeout: Duration::from_secs(1),
            retry: true,
        };
        let body = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "é \" \\"}],
            "tools": [{"type": "function"}], "temperature": 0.5});
        let sent = |c: &ChatCall| -> Value {
            serde_json::from_slice(&request_body(c, c.stream).expect("bytes")).expect("json")
        };
        assert_eq!(sent(&call(body.clone(), false)), body);
        let mut streamed = body.clone();
        streamed["stream"] = Value::Bool(true);
        streamed["stream_options"] = serde_json::json!({"include_usage": true});
        assert_eq!(sent(&call(body.clone(), true)), streamed);
        let mut named = body.clone();
        named["stream"] = Value::Bool(false);
        named["stream_options"] = serde_json::json!({"include_usage": false});
        assert_eq!(sent(&call(named, true)), streamed);
        // The options come once, after the body's own fields.
        let text =
            String::from_utf8(request_body(&call(body, true), true).expect("bytes")).expect("utf8");
        assert_eq!(text.matches("\"stream\"").count(), 1, "{text}");
        assert!(
            text.ends_with(r#""stream":true,"stream_options":{"include_usage":true}}"#),
            "{text}"
        );
    }
}
