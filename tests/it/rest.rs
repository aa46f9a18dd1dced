//! The HTTP API: REST endpoints and their refusals, one admission whatever the transport, the
//! resumable SSE event stream and pruning, the chat-completions facade in OpenAI's wire shapes,
//! API keys on every route, and a whole approval journey driven with a plain HTTP client.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::{json, Value};

use crate::helpers::*;

const T: Duration = Duration::from_secs(30);
const KEY: &str = "gk_test_key_one";
const OTHER_KEY: &str = "gk_test_key_two";

fn digest(key: &str) -> String {
    format!("sha256:{}", gatehouse::api::auth::key_digest(key))
}

fn keyed(model: &FakeModel, extra: Value) -> Value {
    let mut c = config(
        &model.url,
        json!({"gateway": {"api_keys": [digest(KEY), digest(OTHER_KEY)]}}),
    );
    merge(&mut c, extra);
    c
}

// ---------- a plain HTTP client ----------

#[derive(Clone)]
struct Api {
    origin: String,
    auth: Vec<(String, String)>,
}

struct Resp {
    status: u16,
    body: Value,
    headers: awc::http::header::HeaderMap,
}

fn client() -> awc::Client {
    awc::Client::builder()
        .timeout(Duration::from_secs(90))
        .max_http_version(awc::http::Version::HTTP_11)
        .finish()
}

impl Api {
    fn new(d: &Daemon, key: &str) -> Api {
        Api {
            origin: d.origin(),
            auth: vec![("authorization".into(), format!("Bearer {key}"))],
        }
    }

    fn anonymous(d: &Daemon) -> Api {
        Api {
            origin: d.origin(),
            auth: Vec::new(),
        }
    }

    fn with(&self, name: &str, value: &str) -> Api {
        let mut a = self.clone();
        a.auth.push((name.to_string(), value.to_string()));
        a
    }

    async fn raw(&self, method: &str, path: &str, body: Option<String>) -> Resp {
        let method = awc::http::Method::from_bytes(method.as_bytes()).expect("method");
        let mut req = client().request(method, format!("{}{path}", self.origin));
        for (k, v) in &self.auth {
            req = req.insert_header((k.as_str(), v.as_str()));
        }
        let sent = match body {
            Some(b) => {
                req.insert_header(("content-type", "application/json"))
                    .send_body(b)
                    .await
            }
            None => req.send().await,
        };
        let mut resp = sent.unwrap_or_else(|e| panic!("{path}: {e}"));
        let bytes = resp.body().limit(16 << 20).await.expect("body");
        Resp {
            status: resp.status().as_u16(),
            body: serde_json::from_slice(&bytes)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into())),
            headers: resp.headers().clone(),
        }
    }

    async fn get(&self, path: &str) -> Resp {
        self.raw("GET", path, None).await
    }

    async fn post(&self, path: &str, body: Value) -> Resp {
        self.raw("POST", path, Some(body.to_string())).await
    }

    /// A call that must answer `status`; its body.
    async fn expect(&self, method: &str, path: &str, body: Option<Value>, status: u16) -> Value {
        let r = self.raw(method, path, body.map(|b| b.to_string())).await;
        assert_eq!(r.status, status, "{method} {path}: {}", r.body);
        r.body
    }

    /// Create (201) or find again (200) the session of `request_id`.
    async fn session(&self, request_id: &str, cwd: &Path) -> String {
        let r = self
            .with("idempotency-key", request_id)
            .raw(
                "POST",
                "/v1/sessions",
                Some(json!({"cwd": cwd.to_string_lossy()}).to_string()),
            )
            .await;
        assert!(matches!(r.status, 200 | 201), "{}", r.body);
        r.body["session_id"]
            .as_str()
            .expect("session id")
            .to_string()
    }

    async fn submit(&self, sid: &str, input_id: &str, text: &str) -> Value {
        self.expect(
            "POST",
            &format!("/v1/sessions/{sid}/inputs"),
            Some(json!({"input_id": input_id, "text": text})),
            202,
        )
        .await
    }

    async fn wait(&self, sid: &str, admission: &Value) -> Value {
        let a = admission.as_str().expect("admission id");
        let r = self
            .expect(
                "GET",
                &format!("/v1/sessions/{sid}/inputs/{a}?wait=30"),
                None,
                200,
            )
            .await;
        assert_eq!(r["status"], "terminal", "{r}");
        r
    }
}

/// A refusal body is exactly `{"error": {"reason", "message"}}`.
fn assert_refusal(body: &Value, reason: &str) {
    assert_eq!(body["error"]["reason"], reason, "{body}");
    assert!(body["error"]["message"].is_string(), "{body}");
    assert_eq!(body.as_object().map(|o| o.len()), Some(1), "{body}");
    assert_eq!(
        body["error"].as_object().map(|o| o.len()),
        Some(2),
        "{body}"
    );
}

// ---------- an SSE client ----------

#[derive(Debug, Clone)]
struct Ev {
    id: Option<i64>,
    event: String,
    data: Value,
}

struct Sse {
    resp: awc::ClientResponse,
    buf: String,
    /// Comment blocks (keep-alives) read so far.
    comments: usize,
    /// The server ended the stream.
    ended: bool,
}

impl Sse {
    async fn open(api: &Api, path: &str, last_event_id: Option<i64>) -> Sse {
        let mut req = client().get(format!("{}{path}", api.origin));
        for (k, v) in &api.auth {
            req = req.insert_header((k.as_str(), v.as_str()));
        }
        if let Some(id) = last_event_id {
            req = req.insert_header(("last-event-id", id.to_string()));
        }
        let resp = req.send().await.expect("sse");
        assert_eq!(resp.status().as_u16(), 200);
        assert_eq!(
            resp.headers()
                .get("content-type")
                .and_then(|v| v.to_str().ok()),
            Some("text/event-stream")
        );
        Sse {
            resp,
            buf: String::new(),
            comments: 0,
            ended: false,
        }
    }

    /// The next event (comments skipped); `None` when the stream ends or `timeout` passes.
    async fn next(&mut self, timeout: Duration) -> Option<Ev> {
        let deadline = Instant::now() + timeout;
        loop {
            while let Some(end) = self.buf.find("\n\n") {
                let block: String = self.buf.drain(..end + 2).collect();
                let mut lines = block.lines().filter(|l| !l.is_empty()).peekable();
                if lines.peek().is_some() && lines.all(|l| l.starts_with(':')) {
                    self.comments += 1;
                    continue;
                }
                let (mut id, mut event, mut data) = (None, "message".to_string(), None);
                for line in block.lines() {
                    if let Some(v) = line.strip_prefix("id: ") {
                        id = Some(v.parse::<i64>().expect("numeric id"));
                    } else if let Some(v) = line.strip_prefix("event: ") {
                        event = v.to_string();
                    } else if let Some(v) = line.strip_prefix("data: ") {
                        data = Some(serde_json::from_str(v).expect("json data"));
                    }
                }
                if let Some(data) = data {
                    return Some(Ev { id, event, data });
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let Some(chunk) = tokio::time::timeout(left, self.resp.next()).await.ok()? else {
                self.ended = true;
                return None;
            };
            self.buf
                .push_str(&String::from_utf8_lossy(&chunk.expect("sse chunk")));
        }
    }

    /// Events until (and with) one matching `pred`.
    async fn until(&mut self, pred: impl Fn(&Ev) -> bool) -> Vec<Ev> {
        let mut seen = Vec::new();
        loop {
            let ev = self
                .next(T)
                .await
                .unwrap_or_else(|| panic!("stream ended; saw {seen:?}"));
            let done = pred(&ev);
            seen.push(ev);
            if done {
                return seen;
            }
        }
    }
}

fn completes(admission: &Value) -> impl Fn(&Ev) -> bool + '_ {
    move |e: &Ev| e.event == "message.complete" && e.data["payload"]["admission_id"] == *admission
}

/// `(seq, type)` of every stored event of `session`.
fn stored_events(home: &Home, session: &str) -> Vec<(i64, String)> {
    let stored =
        gatehouse::store::events::since(&mut home.db(), session, 0, 100_000).expect("events");
    assert!(!stored.has_more);
    stored.events.into_iter().map(|e| (e.seq, e.kind)).collect()
}

fn durable(events: &[Ev]) -> Vec<(i64, String)> {
    events
        .iter()
        .filter_map(|e| e.id.map(|id| (id, e.event.clone())))
        .collect()
}

// ---------- tests ----------

#[actix_rt::test]
async fn rest_endpoints_answer_and_refuse_with_fitting_statuses() {
    let model = FakeModel::start(|body| {
        let text = last_user(body);
        if text == "SLOW" {
            Reply::Hang
        } else {
            Reply::Message(
                json!({"role": "assistant", "content": format!("ACK_{text}")}),
                "stop",
            )
        }
    });
    let home = Home::new();
    home.write_config(&keyed(&model, json!({"session": {"max_text_bytes": 2000}})));
    let d = Daemon::start(&home);
    let api = Api::new(&d, KEY);
    let cwd = home.path.to_string_lossy().to_string();

    // Create: idempotent by Idempotency-Key (or request_id), 201 when new and 200 with the same
    // session after; other params with the same id are refused.
    let first = api
        .with("idempotency-key", "s1")
        .expect(
            "POST",
            "/v1/sessions",
            Some(json!({"cwd": cwd, "title": "t"})),
            201,
        )
        .await;
    let sid = first["session_id"].as_str().expect("sid").to_string();
    assert_eq!(first["info"]["source"], "cli");
    assert_eq!(first["messages"], json!([]));
    let again = api
        .expect(
            "POST",
            "/v1/sessions",
            Some(json!({"cwd": cwd, "title": "t", "request_id": "s1"})),
            200,
        )
        .await;
    assert_eq!(again["session_id"], sid);
    let b = api
        .with("idempotency-key", "s1")
        .expect(
            "POST",
            "/v1/sessions",
            Some(json!({"cwd": cwd, "title": "other"})),
            400,
        )
        .await;
    assert_refusal(&b, "invalid_params");
    let b = api
        .with("idempotency-key", "s2")
        .expect(
            "POST",
            "/v1/sessions",
            Some(json!({"request_id": "s3"})),
            400,
        )
        .await;
    assert_refusal(&b, "invalid_params");
    let b = api
        .expect(
            "POST",
            "/v1/sessions",
            Some(json!({"cwd": "relative"})),
            400,
        )
        .await;
    assert_refusal(&b, "invalid_params");
    let b = api
        .expect("POST", "/v1/sessions", Some(json!({"colour": "red"})), 400)
        .await;
    assert_refusal(&b, "invalid_params");
    let r = api
        .raw("POST", "/v1/sessions", Some("{not json".into()))
        .await;
    assert_eq!(r.status, 400);
    assert_refusal(&r.body, "invalid_params");
    // A body that is not an object says so (not how a struct reads from an array).
    let r = api.raw("POST", "/v1/sessions", Some(" []".into())).await;
    assert_eq!(r.status, 400);
    assert_refusal(&r.body, "invalid_params");
    assert_eq!(
        r.body["error"]["message"], "bad request body: expected a JSON object",
        "{}",
        r.body
    );

    // Snapshot: the owner only.
    let snap = api
        .expect("GET", &format!("/v1/sessions/{sid}"), None, 200)
        .await;
    assert_eq!(snap["session_id"], sid);
    assert_eq!(snap["last_sequence"], 0);
    // Another principal's session is not found, as one that does not exist (ids can be
    // computed: a refusal that said whose it was confirmed it existed).
    let other = Api::new(&d, OTHER_KEY);
    let b = other
        .expect("GET", &format!("/v1/sessions/{sid}"), None, 404)
        .await;
    assert_refusal(&b, "not_found");
    let b = other
        .expect(
            "POST",
            &format!("/v1/sessions/{sid}/inputs"),
            Some(json!({"input_id": "x", "text": "x"})),
            404,
        )
        .await;
    assert_refusal(&b, "not_found");
    let b = api.expect("GET", "/v1/sessions/nope", None, 404).await;
    assert_refusal(&b, "not_found");
    // The message does not repeat the reason beside it.
    let message = b["error"]["message"].as_str().unwrap_or_default();
    assert!(
        !message.starts_with("not_found") && !message.is_empty(),
        "{b}"
    );

    // Submit: 202 with the receipt; the same id gives the same receipt; other text 409.
    let inputs = format!("/v1/sessions/{sid}/inputs");
    let b = api
        .expect("POST", &inputs, Some(json!({"text": "A"})), 400)
        .await;
    assert_refusal(&b, "invalid_params");
    let r = api
        .with("idempotency-key", "in-a")
        .expect("POST", &inputs, Some(json!({"text": "A"})), 202)
        .await;
    assert_eq!(r["input_id"], "in-a");
    assert_eq!(r["session_id"], sid);
    assert!(r["sequence"].is_i64() && r["authority_epoch"].is_i64());
    let same = api.submit(&sid, "in-a", "A").await;
    assert_eq!(same["admission_id"], r["admission_id"]);
    let b = api
        .with("idempotency-key", "in-a")
        .expect("POST", &inputs, Some(json!({"text": "B"})), 409)
        .await;
    assert_refusal(&b, "admission_conflict");
    let b = api
        .with("idempotency-key", "in-b")
        .expect(
            "POST",
            &inputs,
            Some(json!({"input_id": "in-c", "text": "B"})),
            400,
        )
        .await;
    assert_refusal(&b, "invalid_params");
    let b = api
        .expect(
            "POST",
            &inputs,
            Some(json!({"input_id": "big", "text": "x".repeat(3000)})),
            413,
        )
        .await;
    assert_refusal(&b, "payload_too_large");
    // Nothing to say is not an input (it was admitted, and sent as an empty user turn).
    for text in ["", " \n\t"] {
        let b = api
            .expect(
                "POST",
                &inputs,
                Some(json!({"input_id": "empty", "text": text})),
                400,
            )
            .await;
        assert_refusal(&b, "invalid_params");
        assert_eq!(b["error"]["message"], "text is empty", "{b}");
    }

    // Receipt: long-polled until terminal, with the result.
    let done = api.wait(&sid, &r["admission_id"]).await;
    assert_eq!(done["outcome"], "completed");
    assert_eq!(done["result"]["final_response"], "ACK_A");
    let b = api
        .expect("GET", &format!("{inputs}/nope"), None, 404)
        .await;
    assert_refusal(&b, "not_found");
    let b = api
        .expect("GET", &format!("{inputs}/x?wait=soon"), None, 400)
        .await;
    assert_refusal(&b, "invalid_params");

    // Cancel: a queued input only; interrupt the running one.
    let slow = api.submit(&sid, "slow", "SLOW").await;
    let queued = api.submit(&sid, "queued", "Q").await;
    wait_until("SLOW reached the model", T, || model.reached("SLOW") == 1).await;
    let slow_id = slow["admission_id"].as_str().expect("id");
    let started = Instant::now();
    let pending = api
        .expect("GET", &format!("{inputs}/{slow_id}?wait=0.5"), None, 200)
        .await;
    assert_eq!(pending["status"], "started");
    assert!(started.elapsed() >= Duration::from_millis(400));
    let b = api
        .expect("POST", &format!("{inputs}/{slow_id}/cancel"), None, 409)
        .await;
    assert_refusal(&b, "stale_generation");
    let q_id = queued["admission_id"].as_str().expect("id");
    let c = api
        .expect("POST", &format!("{inputs}/{q_id}/cancel"), None, 200)
        .await;
    assert_eq!(
        (c["status"].as_str(), c["outcome"].as_str()),
        (Some("terminal"), Some("cancelled"))
    );

    // Prompts: an answer needs the running generation; choice xor answer.
    let generation = pending["execution_generation"]
        .as_i64()
        .expect("generation");
    let prompts = format!("/v1/sessions/{sid}/prompts/nope");
    let b = api
        .expect(
            "POST",
            &prompts,
            Some(json!({"execution_generation": generation + 7, "choice": "once"})),
            409,
        )
        .await;
    assert_refusal(&b, "stale_generation");
    let ok = api
        .expect(
            "POST",
            &prompts,
            Some(json!({"execution_generation": generation, "choice": "once"})),
            200,
        )
        .await;
    assert_eq!(
        ok,
        json!({"status": "already_resolved", "prompt_id": "nope"})
    );
    let b = api
        .expect(
            "POST",
            &prompts,
            Some(json!({"execution_generation": generation, "choice": "once", "answer": "x"})),
            400,
        )
        .await;
    assert_refusal(&b, "invalid_params");

    // Resolve-unknown: only an unknown admission.
    let b = api
        .expect(
            "POST",
            &format!("/v1/sessions/{sid}/resolve-unknown"),
            Some(json!({"admission_id": slow_id, "execution_generation": generation})),
            409,
        )
        .await;
    assert_refusal(&b, "stale_generation");
    let b = api
        .expect(
            "POST",
            &format!("/v1/sessions/{sid}/resolve-unknown"),
            Some(json!({"admission_id": slow_id})),
            400,
        )
        .await;
    assert_refusal(&b, "invalid_params");

    // An interrupt must name the attempt it stops.
    let b = api
        .expect(
            "POST",
            &format!("/v1/sessions/{sid}/interrupt"),
            Some(json!({})),
            400,
        )
        .await;
    assert_refusal(&b, "invalid_params");
    // Interrupt the running turn: it settles interrupted.
    let i = api
        .expect(
            "POST",
            &format!("/v1/sessions/{sid}/interrupt"),
            Some(json!({"execution_generation": generation})),
            200,
        )
        .await;
    assert_eq!(i, json!({"interrupted": true}));
    let r = api.wait(&sid, &slow["admission_id"]).await;
    assert_eq!(r["outcome"], "interrupted");
    model.release();

    // Unknown routes are refused; a known route asked with another method says which it takes.
    let b = api.expect("GET", "/v1/nothing-here", None, 404).await;
    assert_refusal(&b, "not_found");
    // Outside /v1 too, with the same body and no key needed (it was an empty 404).
    let r = Api::new(&d, "not-a-key")
        .raw("GET", "/nothing-here", None)
        .await;
    assert_eq!(r.status, 404, "{}", r.body);
    assert_refusal(&r.body, "not_found");
    let r = api.get("/v1/sessions").await;
    assert_eq!(r.status, 405, "{}", r.body);
    assert_refusal(&r.body, "method_not_allowed");
    assert_eq!(
        r.headers.get("allow").and_then(|v| v.to_str().ok()),
        Some("POST")
    );
    let r = api
        .raw("DELETE", &format!("/v1/sessions/{sid}/inputs"), None)
        .await;
    assert_eq!(r.status, 405, "{}", r.body);
    assert_eq!(
        r.headers.get("allow").and_then(|v| v.to_str().ok()),
        Some("POST")
    );
    // The WebSocket's route too (it was an empty 405).
    let r = Api::new(&d, "not-a-key").raw("POST", "/api/ws", None).await;
    assert_eq!(r.status, 405, "{}", r.body);
    assert_refusal(&r.body, "method_not_allowed");
    assert_eq!(
        r.headers.get("allow").and_then(|v| v.to_str().ok()),
        Some("GET")
    );
    // Authentication comes first: without credentials a wrong method is a 401.
    let anonymous = Api::anonymous(&d);
    let r = anonymous.get("/v1/sessions").await;
    assert_eq!(r.status, 401, "{}", r.body);
}

#[actix_rt::test]
async fn the_same_input_over_rest_and_websocket_is_one_admission() {
    let model = FakeModel::ack();
    let home = Home::new();
    home.write_config(&keyed(&model, json!({})));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.session("shared", &home.path).await;
    // The WebSocket's ticket and a token from a ticket carry the same local principal.
    let anon = Api::anonymous(&d);
    let b = anon
        .with("x-gatehouse-ticket", "forged")
        .expect("POST", "/v1/auth/token", None, 401)
        .await;
    assert_refusal(&b, "permission_denied");
    let t = anon
        .with("x-gatehouse-ticket", &ticket(&home.path))
        .expect("POST", "/v1/auth/token", None, 200)
        .await;
    assert_eq!(t["token_type"], "bearer");
    let api = Api::new(&d, t["token"].as_str().expect("token"));

    let over_rest = api.submit(&sid, "same-input", "X").await;
    let over_ws = ws.submit(&sid, "same-input", "X").await;
    assert_eq!(over_ws["admission_id"], over_rest["admission_id"]);
    let over_ws = ws.submit(&sid, "ws-first", "Y").await;
    let over_rest = api.submit(&sid, "ws-first", "Y").await;
    assert_eq!(over_ws["admission_id"], over_rest["admission_id"]);
    ws.refused(
        "prompt.submit",
        json!({"session_id": sid, "input_id": "same-input", "text": "Z"}),
        "admission_conflict",
    )
    .await;
    let b = api
        .expect(
            "POST",
            &format!("/v1/sessions/{sid}/inputs"),
            Some(json!({"input_id": "ws-first", "text": "Z"})),
            409,
        )
        .await;
    assert_refusal(&b, "admission_conflict");
    let done = api.wait(&sid, &over_rest["admission_id"]).await;
    assert_eq!(done["result"]["final_response"], "ACK_Y");
    let rows = home.admissions();
    assert_eq!(rows.len(), 2, "one admission per input id");
    assert_eq!(model.reached("X"), 1);
    assert_eq!(model.reached("Y"), 1);

    // WebSocket notifications carry the durable seq: every stored event arrives, with its type.
    let stored = stored_events(&home, &sid);
    assert!(stored.len() >= 10, "{stored:?}");
    for (seq, kind) in &stored {
        let e = ws.event(T, |e| e["seq"] == *seq).await;
        assert_eq!(e["type"], *kind, "seq {seq}");
    }
    let page = ws
        .ok(
            "session.events.since",
            json!({"session_id": sid, "last_sequence": 3}),
        )
        .await;
    let seqs: Vec<i64> = page["events"]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| e["seq"].as_i64().expect("seq"))
        .collect();
    assert_eq!(seqs, (4..=stored.len() as i64).collect::<Vec<_>>());
    assert_eq!(page["last_sequence"], stored.len() as i64);
    assert_eq!(page["truncated"], false);
    let snap = ws.ok("session.resume", json!({"session_id": sid})).await;
    assert_eq!(snap["last_sequence"], stored.len() as i64);
    for bad in [
        json!({"session_id": sid, "last_sequence": -1}),
        json!({"session_id": sid, "last_sequence": stored.len() as i64 + 1}),
        json!({"session_id": sid, "last_sequence": 0, "limit": 0}),
    ] {
        ws.refused("session.events.since", bad, "invalid_params")
            .await;
    }
    let page = ws
        .ok(
            "session.events.since",
            json!({"session_id": sid, "last_sequence": 0, "limit": 2}),
        )
        .await;
    assert_eq!(page["last_sequence"], 2);
    assert_eq!(page["has_more"], true);
}

#[actix_rt::test]
async fn a_rest_snapshot_says_when_a_pending_text_is_only_its_start() {
    let model = FakeModel::ack_or_hang();
    let home = Home::new();
    home.write_config(&keyed(&model, json!({})));
    let d = Daemon::start(&home);
    let api = Api::new(&d, KEY);
    let cwd = home.path.to_string_lossy().to_string();
    let created = api
        .expect("POST", "/v1/sessions", Some(json!({"cwd": cwd})), 201)
        .await;
    let sid = created["session_id"].as_str().expect("sid").to_string();
    api.submit(&sid, "head", "HANG").await;
    let long = "é".repeat(10_000);
    api.submit(&sid, "long", &long).await;
    api.submit(&sid, "short", "short").await;
    let snap = api
        .expect("GET", &format!("/v1/sessions/{sid}"), None, 200)
        .await;
    let pending = snap["pending"].as_array().expect("pending");
    let by_id = |id: &str| {
        pending
            .iter()
            .find(|p| p["input_id"] == id)
            .unwrap_or_else(|| panic!("{id} is pending: {snap}"))
    };
    let cut = by_id("long");
    assert_eq!(cut["text"], "é".repeat(4096), "the start of the text");
    assert_eq!(cut["text_truncated"], true, "{cut}");
    assert_eq!(cut["text_chars"], 10_000, "{cut}");
    let whole = by_id("short");
    assert_eq!(whole["text"], "short");
    assert!(whole.get("text_truncated").is_none(), "{whole}");
    assert!(whole.get("text_chars").is_none(), "{whole}");
    // The document describes both.
    let doc = api.expect("GET", "/v1/openapi.json", None, 200).await;
    let props = &doc["components"]["schemas"]["PendingInput"]["properties"];
    assert!(props.get("text_truncated").is_some(), "{props}");
    assert!(props.get("text_chars").is_some(), "{props}");
}

#[actix_rt::test]
async fn sse_resumes_after_a_dropped_connection_with_every_event_once_in_order() {
    let model = FakeModel::ack();
    let home = Home::new();
    home.write_config(&keyed(
        &model,
        json!({"http": {"sse_keepalive_seconds": 0.3}}),
    ));
    let d = Daemon::start(&home);
    let api = Api::new(&d, KEY);
    let sid = api.session("sse", &home.path).await;
    let path = format!("/v1/sessions/{sid}/events");
    let mut first = Sse::open(&api, &path, None).await;
    let a1 = api.submit(&sid, "i1", "one").await;
    let mut seen = first.until(completes(&a1["admission_id"])).await;
    let a2 = api.submit(&sid, "i2", "two").await;
    seen.extend(first.until(|e| e.event == "message.start").await);
    drop(first);
    // While nobody listens: the rest of i2, and two more inputs.
    api.wait(&sid, &a2["admission_id"]).await;
    let a3 = api.submit(&sid, "i3", "three").await;
    api.wait(&sid, &a3["admission_id"]).await;
    let last = durable(&seen).last().map(|(id, _)| *id).expect("an id");
    let mut second = Sse::open(&api, &path, Some(last)).await;
    let mut resumed = second.until(completes(&a3["admission_id"])).await;
    // Then live, with its deltas.
    let a4 = api.submit(&sid, "i4", "four").await;
    resumed.extend(second.until(completes(&a4["admission_id"])).await);
    assert!(
        resumed
            .iter()
            .any(|e| e.id.is_none() && e.event == "message.delta" && e.data["after_seq"].is_i64()),
        "live deltas come without an id: {resumed:?}"
    );
    let mut all = durable(&seen);
    all.extend(durable(&resumed));
    assert_eq!(
        all,
        stored_events(&home, &sid),
        "every committed event once, in order"
    );
    let ids: Vec<i64> = all.iter().map(|(id, _)| *id).collect();
    assert_eq!(ids, (1..=ids.len() as i64).collect::<Vec<_>>());
    // Keep-alive comments flow while idle (every 0.3 s here), and the stream stays open.
    let before = second.comments;
    let quiet = second.next(Duration::from_millis(1500)).await;
    assert!(quiet.is_none(), "{quiet:?}");
    assert!(!second.ended, "the idle stream stays open");
    assert!(
        second.comments >= before + 2,
        "keep-alives while idle: {} then {}",
        before,
        second.comments
    );
    // `?after=` is the same as Last-Event-ID; a bad one is refused.
    let mut third = Sse::open(&api, &format!("{path}?after={}", ids.len() - 1), None).await;
    let e = third.next(T).await.expect("the last event");
    assert_eq!(e.id, Some(ids.len() as i64));
    let r = api.get(&format!("{path}?after=-3")).await;
    assert_eq!(r.status, 400);
    let r = api.with("last-event-id", "x").get(&path).await;
    assert_eq!(r.status, 400);
    // Past the head: refused (it was followed in silence, everything up to it taken as seen).
    // The head itself is fine: the stream waits for what comes next.
    let past = ids.len() + 5;
    let r = api.get(&format!("{path}?after={past}")).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_refusal(&r.body, "invalid_params");
    assert!(
        r.body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("past this session's last event")),
        "{}",
        r.body
    );
    let r = api
        .with("last-event-id", &past.to_string())
        .get(&path)
        .await;
    assert_eq!(r.status, 400, "{}", r.body);
    let at_head = Sse::open(&api, &path, Some(ids.len() as i64)).await;
    assert!(!at_head.ended);
}

#[actix_rt::test]
async fn pruned_events_are_reported_truncated() {
    let model = FakeModel::ack();
    let home = Home::new();
    home.write_config(&keyed(
        &model,
        json!({"events": {"max_per_session": 4, "prune_interval_seconds": 0.1}}),
    ));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.session("pruned", &home.path).await;
    // The session belongs to the local user: REST uses a token from a ticket.
    let token = Api::anonymous(&d)
        .with("x-gatehouse-ticket", &ticket(&home.path))
        .expect("POST", "/v1/auth/token", None, 200)
        .await;
    let api = Api::new(&d, token["token"].as_str().expect("token"));
    for i in 0..2 {
        let r = ws.submit(&sid, &format!("p{i}"), "hi").await;
        wait_until("settled", T, || {
            home.admission_by_id(r["admission_id"].as_str().unwrap_or(""))
                .status
                == "terminal"
        })
        .await;
    }
    wait_until("pruned", T, || stored_events(&home, &sid).len() == 4).await;
    let head = stored_events(&home, &sid)
        .last()
        .map(|e| e.0)
        .expect("head");
    let page = ws
        .ok(
            "session.events.since",
            json!({"session_id": sid, "last_sequence": 0}),
        )
        .await;
    assert_eq!(page["truncated"], true);
    assert_eq!(page["events"][0]["seq"], head - 3);
    assert_eq!(page["last_sequence"], head);
    let page = ws
        .ok(
            "session.events.since",
            json!({"session_id": sid, "last_sequence": head - 4}),
        )
        .await;
    assert_eq!(
        page["truncated"],
        false,
        "nothing after {} was pruned",
        head - 4
    );
    // Over SSE: a `truncated` event whose id is where the stream picks up, then the rest.
    let mut sse = Sse::open(&api, &format!("/v1/sessions/{sid}/events"), Some(1)).await;
    let t = sse.next(T).await.expect("truncated");
    assert_eq!(t.event, "truncated");
    assert_eq!(t.id, Some(head - 4));
    assert_eq!(t.data["requested_after"], 1);
    let rest: Vec<Option<i64>> = [sse.next(T).await, sse.next(T).await]
        .into_iter()
        .map(|e| e.and_then(|e| e.id))
        .collect();
    assert_eq!(rest, vec![Some(head - 3), Some(head - 2)]);
    let mut fresh = Sse::open(&api, &format!("/v1/sessions/{sid}/events"), Some(head - 1)).await;
    let e = fresh.next(T).await.expect("the head");
    assert_eq!((e.event.as_str(), e.id), ("message.complete", Some(head)));
}

// ---------- the chat-completions facade ----------

/// Mirrors of the official OpenAI client's models: what it requires to parse a response (the
/// fields exist to be parsed, not read).
#[allow(dead_code)]
mod openai {
    use serde::Deserialize;
    use serde_json::Value;

    #[derive(Debug, Deserialize)]
    pub enum CompletionObject {
        #[serde(rename = "chat.completion")]
        Completion,
    }

    #[derive(Debug, Deserialize)]
    pub enum ChunkObject {
        #[serde(rename = "chat.completion.chunk")]
        Chunk,
    }

    #[derive(Debug, Deserialize, PartialEq)]
    #[serde(rename_all = "snake_case")]
    pub enum FinishReason {
        Stop,
        Length,
        ToolCalls,
        ContentFilter,
        FunctionCall,
    }

    #[derive(Debug, Deserialize)]
    pub enum Assistant {
        #[serde(rename = "assistant")]
        Assistant,
    }

    #[derive(Debug, Deserialize)]
    pub struct Usage {
        pub prompt_tokens: u64,
        pub completion_tokens: u64,
        pub total_tokens: u64,
    }

    #[derive(Debug, Deserialize)]
    pub struct Message {
        pub role: Assistant,
        pub content: Option<String>,
        #[serde(default)]
        pub refusal: Option<String>,
    }

    #[derive(Debug, Deserialize)]
    pub struct Choice {
        pub index: u32,
        pub message: Message,
        pub finish_reason: FinishReason,
        #[serde(default)]
        pub logprobs: Option<Value>,
    }

    #[derive(Debug, Deserialize)]
    pub struct ChatCompletion {
        pub id: String,
        pub object: CompletionObject,
        pub created: i64,
        pub model: String,
        pub choices: Vec<Choice>,
        pub usage: Option<Usage>,
        #[serde(default)]
        pub system_fingerprint: Option<String>,
    }

    #[derive(Debug, Deserialize)]
    pub struct Delta {
        #[serde(default)]
        pub role: Option<Assistant>,
        #[serde(default)]
        pub content: Option<String>,
    }

    #[derive(Debug, Deserialize)]
    pub struct ChunkChoice {
        pub index: u32,
        pub delta: Delta,
        #[serde(default)]
        pub finish_reason: Option<FinishReason>,
    }

    #[derive(Debug, Deserialize)]
    pub struct ChatCompletionChunk {
        pub id: String,
        pub object: ChunkObject,
        pub created: i64,
        pub model: String,
        pub choices: Vec<ChunkChoice>,
        #[serde(default)]
        pub usage: Option<Usage>,
    }

    /// Recorded from OpenAI's API reference.
    pub const RECORDED_COMPLETION: &str = r#"{
      "id": "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT", "object": "chat.completion", "created": 1741569952,
      "model": "gpt-4.1-2025-04-14",
      "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello! How can I assist you today?",
                   "refusal": null, "annotations": []}, "logprobs": null, "finish_reason": "stop"}],
      "usage": {"prompt_tokens": 19, "completion_tokens": 10, "total_tokens": 29,
                "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                  "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}},
      "service_tier": "default"}"#;

    /// Recorded from OpenAI's streaming reference (`data:` payloads).
    pub const RECORDED_CHUNKS: [&str; 3] = [
        r#"{"id":"chatcmpl-123","object":"chat.completion.chunk","created":1694268190,"model":"gpt-4o-mini","system_fingerprint":"fp_44709d6fcb","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}"#,
        r#"{"id":"chatcmpl-123","object":"chat.completion.chunk","created":1694268190,"model":"gpt-4o-mini","system_fingerprint":"fp_44709d6fcb","choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,"finish_reason":null}]}"#,
        r#"{"id":"chatcmpl-123","object":"chat.completion.chunk","created":1694268190,"model":"gpt-4o-mini","system_fingerprint":"fp_44709d6fcb","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}]}"#,
    ];
}

/// Every key of `recorded` that a client reads is in `ours`, with the same JSON type (or null
/// where the recording has null).
fn same_shape(recorded: &Value, ours: &Value, keys: &[&str], at: &str) {
    for k in keys {
        let (r, o) = (&recorded[*k], &ours[*k]);
        assert!(ours.get(*k).is_some(), "{at}.{k} missing in {ours}");
        let kind = |v: &Value| match v {
            Value::Null => "null",
            Value::Bool(_) => "bool",
            Value::Number(_) => "number",
            Value::String(_) => "string",
            Value::Array(_) => "array",
            Value::Object(_) => "object",
        };
        assert!(
            kind(r) == kind(o) || r.is_null() || o.is_null() && *k != "content",
            "{at}.{k}: recorded {r}, ours {o}"
        );
    }
}

async fn chat(api: &Api, body: Value) -> Resp {
    api.post("/v1/chat/completions", body).await
}

/// The session a chat completion reached (its `x-gatehouse-session` header; empty if none).
fn session_of(r: &Resp) -> String {
    r.headers
        .get("x-gatehouse-session")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string()
}

/// Branches of a conversation sent at the same time (or two end users' identical openings)
/// do not all go on in the session where it left off: one does, each other one starts a session
/// of its own. Before, each found that session where the conversation left off, and each went
/// on in it, so every branch's turn saw the others' messages.
#[actix_rt::test]
async fn branches_sent_at_once_go_on_in_one_session_only() {
    let model = FakeModel::ack();
    let home = Home::new();
    home.write_config(&keyed(&model, json!({})));
    let d = Daemon::start(&home);
    let api = Api::new(&d, KEY);
    let hello = json!({"role": "user", "content": "hello"});
    let first = chat(&api, json!({"messages": [hello]})).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let acked = json!({"role": "assistant", "content": "ACK_hello"});
    let branches = (0..6).map(|n| {
        let api = api.clone();
        let body =
            json!({"messages": [hello, acked, {"role": "user", "content": format!("branch {n}")}]});
        async move { chat(&api, body).await }
    });
    let answered = futures_util::future::join_all(branches).await;
    let mut went_on = 0;
    for (n, r) in answered.iter().enumerate() {
        assert_eq!(r.status, 200, "{}", r.body);
        if session_of(r) == session_of(&first) {
            went_on += 1;
        }
        // Each branch's turn sees its own conversation only.
        let seen = model
            .requests()
            .into_iter()
            .find(|b| last_user(b) == format!("branch {n}"))
            .expect("its request");
        assert_eq!(
            user_texts(&seen),
            ["hello".to_string(), format!("branch {n}")]
        );
    }
    assert_eq!(
        went_on, 1,
        "one branch goes on in the conversation's session"
    );
}

/// A chat-completions request is refused in OpenAI's error shape when its credentials are, and
/// when its conversation does not end with its user message (a client's own tool result, or an
/// assistant prefill, would be dropped): before, the first got the REST routes' shape, and the
/// second was answered with the earlier answer to the conversation up to its user message,
/// without the model seeing the tool result.
#[actix_rt::test]
async fn chat_completions_refuse_in_openais_shape_and_take_no_trailing_tool_results() {
    let model = FakeModel::ack_or_hang();
    let home = Home::new();
    home.write_config(&keyed(&model, json!({})));
    let d = Daemon::start(&home);
    let question = json!({"role": "user", "content": "weather?"});
    for (key, why) in [("", "no credentials"), ("gk_not-a-key", "a bad key")] {
        let r = if key.is_empty() {
            Api::anonymous(&d)
        } else {
            Api::new(&d, key)
        }
        .post("/v1/chat/completions", json!({"messages": [question]}))
        .await;
        assert_eq!(r.status, 401, "{why}: {}", r.body);
        let error = &r.body["error"];
        assert_eq!(error["type"], "authentication_error", "{why}: {}", r.body);
        assert_eq!(error["code"], "permission_denied", "{why}: {}", r.body);
        assert_eq!(error["reason"], "permission_denied", "{why}: {}", r.body);
        assert!(error["message"].is_string(), "{why}: {}", r.body);
    }

    let api = Api::new(&d, KEY);
    // So is the wrong method, after its credentials.
    let r = api.get("/v1/chat/completions").await;
    assert_eq!(r.status, 405, "{}", r.body);
    assert_eq!(r.body["error"]["type"], "api_error", "{}", r.body);
    assert_eq!(
        r.body["error"]["reason"], "method_not_allowed",
        "{}",
        r.body
    );
    assert_eq!(
        r.headers.get("allow").and_then(|v| v.to_str().ok()),
        Some("POST")
    );
    let r = Api::anonymous(&d).get("/v1/chat/completions").await;
    assert_eq!(r.status, 401, "{}", r.body);
    assert_eq!(
        r.body["error"]["type"], "authentication_error",
        "{}",
        r.body
    );
    let first = chat(&api, json!({"messages": [question]})).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let client_tools = json!([
        question,
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18C and sunny"},
    ]);
    let r = chat(&api, json!({"messages": client_tools})).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(
        r.body["error"]["type"], "invalid_request_error",
        "{}",
        r.body
    );
    assert_eq!(r.body["error"]["reason"], "invalid_params", "{}", r.body);
    assert!(
        r.body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("\"tool\"")),
        "{}",
        r.body
    );
    let prefill = json!([question, {"role": "assistant", "content": "It is"}]);
    let r = chat(&api, json!({"messages": prefill})).await;
    assert_eq!(r.status, 400, "{}", r.body);
    // Too long a question, or too long a history, is refused before a session is made for it.
    let sessions = || {
        use diesel::prelude::*;
        gatehouse::store::schema::sessions::table
            .count()
            .get_result::<i64>(&mut home.db())
            .expect("count sessions")
    };
    let before = sessions();
    let long = "x".repeat(300 * 1024);
    let r = chat(
        &api,
        json!({"messages": [{"role": "system", "content": "brief"}, {"role": "user", "content": long}]}),
    )
    .await;
    assert_eq!(r.status, 413, "{}", r.body);
    assert_eq!(r.body["error"]["reason"], "payload_too_large", "{}", r.body);
    // So is a history message the new session would store past an input's bound, and system
    // messages past it together.
    for messages in [
        json!([{"role": "user", "content": long}, {"role": "assistant", "content": "ok"},
               {"role": "user", "content": "short"}]),
        json!([{"role": "system", "content": "y".repeat(200 * 1024)},
               {"role": "system", "content": "z".repeat(200 * 1024)},
               {"role": "user", "content": "short"}]),
    ] {
        let r = chat(&api, json!({ "messages": messages })).await;
        assert_eq!(r.status, 413, "{}", r.body);
        assert_eq!(r.body["error"]["reason"], "payload_too_large", "{}", r.body);
    }
    // A last user message of blanks is no input, nor is an empty Idempotency-Key a key.
    let blank = chat(
        &api,
        json!({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
                            {"role": "user", "content": " \n\t "}]}),
    )
    .await;
    assert_eq!(blank.status, 400, "{}", blank.body);
    assert_eq!(
        blank.body["error"]["reason"], "invalid_params",
        "{}",
        blank.body
    );
    let unkeyed = chat(
        &api.with("idempotency-key", &"k".repeat(1025)),
        json!({"messages": [{"role": "user", "content": "a key too long"}]}),
    )
    .await;
    assert_eq!(unkeyed.status, 400, "{}", unkeyed.body);
    let mut history: Vec<Value> = (0..gatehouse::api::openai::MAX_MESSAGES)
        .flat_map(|i| {
            [
                json!({"role": "user", "content": format!("q{i}")}),
                json!({"role": "assistant", "content": format!("a{i}")}),
            ]
        })
        .collect();
    history.push(json!({"role": "user", "content": "and now?"}));
    let r = chat(&api, json!({"messages": history})).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.body["error"]["reason"], "invalid_params", "{}", r.body);
    // Messages that are not turns (tool results, unknown roles) count too, as they are parsed:
    // a body of them was parsed whole, then estimated at some 700 bytes of memory each.
    let mut others: Vec<Value> = (0..=gatehouse::api::openai::MAX_PARSED_MESSAGES)
        .map(|_| json!({"role": "x"}))
        .collect();
    others.push(json!({"role": "user", "content": "behind many others"}));
    let r = chat(&api, json!({"messages": others})).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.body["error"]["reason"], "invalid_params", "{}", r.body);
    assert!(
        r.body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("messages")),
        "{}",
        r.body
    );
    assert_eq!(
        sessions(),
        before,
        "no session was made for a refused request"
    );
    assert_eq!(
        model.reached("weather?"),
        1,
        "only the first request reached the model"
    );

    let doc = api.get("/v1/openapi.json").await;
    let refusal = &doc.body["paths"]["/v1/chat/completions"]["post"]["responses"]["401"];
    assert_eq!(
        refusal["content"]["application/json"]["schema"]["$ref"], "#/components/schemas/ChatError",
        "{refusal}"
    );
}

/// A `model` naming a profile runs the conversation under that profile, in a session of its
/// own; a named session is not answered by another profile than its own.
#[actix_rt::test]
async fn chat_completions_keep_each_profile_to_its_own_session() {
    let model = FakeModel::start(|body| {
        Reply::Message(
            json!({"role": "assistant", "content": format!("{}:{}", body["model"].as_str().unwrap_or(""), last_user(body))}),
            "stop",
        )
    });
    let home = Home::new();
    home.write_config(&keyed(
        &model,
        json!({"profiles": {"ops": {"model": "ops-model", "toolsets": ["terminal", "clarify"]},
                            "dev": {"model": "dev-model"}}}),
    ));
    let d = Daemon::start(&home);
    let api = Api::new(&d, KEY);
    let conversation = json!([{"role": "user", "content": "hello"}]);
    let mut seen = Vec::new();
    for (name, answer) in [
        ("ops", "ops-model:hello"),
        ("dev", "dev-model:hello"),
        ("gpt-4o", "fake-model:hello"),
    ] {
        let r = chat(&api, json!({"model": name, "messages": conversation})).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.body["choices"][0]["message"]["content"], answer, "{name}");
        let session = r
            .headers
            .get("x-gatehouse-session")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        assert!(
            !seen.contains(&session),
            "{name} shares a session: {seen:?}"
        );
        seen.push(session);
    }
    // A profile that offers `clarify` does not offer it to a chat completion's session, which
    // has nobody to answer it (its turn waited out `agent.clarify_timeout`).
    let tools: Vec<String> = model
        .requests()
        .iter()
        .filter(|b| b["model"] == "ops-model")
        .flat_map(|b| b["tools"].as_array().cloned().unwrap_or_default())
        .filter_map(|t| t["function"]["name"].as_str().map(str::to_string))
        .collect();
    assert!(tools.iter().any(|t| t == "terminal"), "{tools:?}");
    assert!(!tools.iter().any(|t| t == "clarify"), "{tools:?}");

    let named = api.with("x-gatehouse-session", "work");
    let first = chat(&named, json!({"model": "ops", "messages": conversation})).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let other = chat(
        &named,
        json!({"model": "dev", "messages": [{"role": "user", "content": "next"}]}),
    )
    .await;
    assert_eq!(other.status, 409, "{}", other.body);
    assert_eq!(other.body["error"]["reason"], "profile_mismatch");
    assert_eq!(model.reached("next"), 0, "no profile answered it");
    // Its own profile, or a model that names no profile, goes on in the session.
    for name in ["ops", "gpt-4o"] {
        let r = chat(
            &named,
            json!({"model": name, "messages": [{"role": "user", "content": name}]}),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(
            r.body["choices"][0]["message"]["content"],
            format!("ops-model:{name}")
        );
    }
}

/// A keyed request sent again naming its session by the id the first answer gave (as a
/// timed-out answer asks), not by the name it was first sent with, is the same request: it was
/// refused `admission_conflict` with its own key, whatever it did.
#[actix_rt::test]
async fn a_keyed_retry_naming_its_session_by_id_is_the_same_request() {
    let model = FakeModel::ack_or_hang();
    let home = Home::new();
    home.write_config(&keyed(&model, json!({})));
    let d = Daemon::start(&home);
    let api = Api::new(&d, KEY).with("idempotency-key", "k-1");
    let body = json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "once"}]});
    let first = chat(&api.with("x-gatehouse-session", "support"), body.clone()).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let session = session_of(&first);
    let again = chat(&api.with("x-gatehouse-session", &session), body).await;
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(again.body["choices"], first.body["choices"]);
    assert_eq!(model.reached("once"), 1, "the turn ran once");
}

/// In a named session, another end user's same message is a new input of its own: it joined
/// the first one's input (the id was the message's hash alone) and got that one's answer, its
/// own message never reaching the model.
#[actix_rt::test]
async fn another_end_users_same_message_in_a_named_session_is_its_own_input() {
    let model = FakeModel::ack_or_hang();
    let home = Home::new();
    home.write_config(&keyed(&model, json!({})));
    let d = Daemon::start(&home);
    let api = Api::new(&d, KEY);
    let named = api.with("x-gatehouse-session", "shared");
    for user in ["alice", "bob"] {
        let r = chat(
            &named,
            json!({"model": "gpt-4o", "user": user, "messages": [{"role": "user", "content": "yes"}]}),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    assert_eq!(
        model.reached("yes"),
        2,
        "each end user's message asked the model"
    );
}

#[actix_rt::test]
async fn chat_completions_speak_the_openai_wire_format() {
    let model = FakeModel::ack_or_hang();
    let home = Home::new();
    home.write_config(&keyed(
        &model,
        // Every completion of the test must end within it, on a loaded machine too.
        json!({"http": {"completion_timeout_seconds": 5}}),
    ));
    let d = Daemon::start(&home);
    let api = Api::new(&d, KEY);
    let recorded: Value = serde_json::from_str(openai::RECORDED_COMPLETION).expect("recorded");
    serde_json::from_value::<openai::ChatCompletion>(recorded.clone())
        .expect("the mirror parses the recording");

    // Non-streaming.
    let conversation =
        json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]);
    let r = chat(
        &api,
        json!({"model": "gpt-4o", "messages": conversation, "temperature": 0.2}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let parsed: openai::ChatCompletion =
        serde_json::from_value(r.body.clone()).expect("an OpenAI client parses it");
    assert!(matches!(
        parsed.object,
        openai::CompletionObject::Completion
    ));
    assert_eq!(parsed.choices.len(), 1);
    assert_eq!(parsed.choices[0].index, 0);
    assert_eq!(parsed.choices[0].finish_reason, openai::FinishReason::Stop);
    assert_eq!(
        parsed.choices[0].message.content.as_deref(),
        Some("ACK_hello")
    );
    assert!(parsed.id.starts_with("chatcmpl-") && parsed.created > 1_700_000_000);
    assert_eq!(parsed.model, "fake-model");
    let usage = parsed.usage.expect("usage");
    assert_eq!(
        usage.total_tokens,
        usage.prompt_tokens + usage.completion_tokens
    );
    same_shape(
        &recorded,
        &r.body,
        &["id", "object", "created", "model", "choices", "usage"],
        "completion",
    );
    same_shape(
        &recorded["choices"][0],
        &r.body["choices"][0],
        &["index", "message", "logprobs", "finish_reason"],
        "choice",
    );
    same_shape(
        &recorded["choices"][0]["message"],
        &r.body["choices"][0]["message"],
        &["role", "content", "refusal"],
        "message",
    );
    same_shape(
        &recorded["usage"],
        &r.body["usage"],
        &["prompt_tokens", "completion_tokens", "total_tokens"],
        "usage",
    );
    let session = r
        .headers
        .get("x-gatehouse-session")
        .and_then(|v| v.to_str().ok())
        .expect("session header")
        .to_string();

    // The same request again joins the same admission (a retry never runs twice).
    let again = chat(&api, json!({"model": "gpt-4o", "messages": conversation})).await;
    assert_eq!(again.body["id"], r.body["id"]);
    assert_eq!(model.reached("hello"), 1);

    // Two end users of one app whose conversations open alike are two sessions: neither gets
    // the other's answer (nor, later, its history).
    let mut per_user = Vec::new();
    for user in ["alice", "bob"] {
        let r = chat(
            &api,
            json!({"model": "gpt-4o", "messages": conversation, "user": user}),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        let header = |name: &str| {
            r.headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        per_user.push((header("x-gatehouse-session"), r.body["id"].clone()));
    }
    assert_ne!(per_user[0], per_user[1], "{per_user:?}");
    assert!(per_user
        .iter()
        .all(|(s, _)| s.as_deref() != Some(&*session)));
    assert_eq!(model.reached("hello"), 3);

    // The conversation goes on in the same session; the model sees the transcript.
    let mut longer = conversation.as_array().cloned().expect("array");
    longer.push(json!({"role": "assistant", "content": "ACK_hello"}));
    longer.push(json!({"role": "user", "content": [{"type": "text", "text": "more"}]}));
    let r2 = chat(
        &api,
        json!({"model": "gpt-4o", "messages": longer, "stream": true,
                                "stream_options": {"include_usage": true}}),
    )
    .await;
    assert_eq!(r2.status, 200);
    assert_eq!(
        r2.headers.get("content-type").and_then(|v| v.to_str().ok()),
        Some("text/event-stream")
    );
    assert_eq!(
        r2.headers
            .get("x-gatehouse-session")
            .and_then(|v| v.to_str().ok()),
        Some(session.as_str())
    );
    let body = r2.body.as_str().expect("an event stream").to_string();
    let lines: Vec<&str> = body.lines().filter(|l| l.starts_with("data: ")).collect();
    assert_eq!(lines.last(), Some(&"data: [DONE]"), "{body}");
    let mut text = String::new();
    let mut finish = Vec::new();
    let mut usage = None;
    let mut ids = std::collections::HashSet::new();
    for (i, line) in lines[..lines.len() - 1].iter().enumerate() {
        let v: Value = serde_json::from_str(&line["data: ".len()..]).expect("chunk json");
        let chunk: openai::ChatCompletionChunk =
            serde_json::from_value(v.clone()).expect("an OpenAI client parses the chunk");
        assert!(matches!(chunk.object, openai::ChunkObject::Chunk));
        ids.insert(chunk.id.clone());
        if let Some(c) = chunk.choices.first() {
            let recorded: Value =
                serde_json::from_str(openai::RECORDED_CHUNKS[i.min(2)]).expect("recorded");
            serde_json::from_value::<openai::ChatCompletionChunk>(recorded.clone())
                .expect("the mirror parses the recording");
            same_shape(
                &recorded,
                &v,
                &["id", "object", "created", "model", "choices"],
                "chunk",
            );
            same_shape(
                &recorded["choices"][0],
                &v["choices"][0],
                &["index", "delta", "finish_reason"],
                "chunk choice",
            );
            assert_eq!(c.index, 0);
            text.push_str(c.delta.content.as_deref().unwrap_or(""));
            finish.extend(
                c.finish_reason
                    .as_ref()
                    .map(|f| f == &openai::FinishReason::Stop),
            );
        }
        usage = usage.or(chunk.usage);
    }
    assert_eq!(text, "ACK_more");
    assert_eq!(finish, vec![true]);
    assert_eq!(ids.len(), 1);
    assert!(usage.is_some(), "include_usage gives a usage chunk");
    let last = model.requests().last().cloned().expect("a request");
    assert_eq!(user_texts(&last), vec!["hello", "more"]);

    // A named session is its own.
    let named = api.with("x-gatehouse-session", "work");
    let r3 = chat(
        &named,
        json!({"messages": [{"role": "user", "content": "hello"}]}),
    )
    .await;
    assert_eq!(r3.status, 200);
    assert_ne!(
        r3.headers
            .get("x-gatehouse-session")
            .and_then(|v| v.to_str().ok()),
        Some(session.as_str())
    );

    // Refusals in OpenAI's shape (plus the reason); a stuck turn answers 504 in time.
    let bad = chat(
        &api,
        json!({"messages": [{"role": "system", "content": "x"}]}),
    )
    .await;
    assert_eq!(bad.status, 400);
    assert!(bad.body["error"]["message"].is_string());
    assert_eq!(bad.body["error"]["type"], "invalid_request_error");
    assert_eq!(bad.body["error"]["reason"], "invalid_params");
    // Two answers cannot be given (one was sent for the two asked); one can.
    let two = chat(
        &api,
        json!({"n": 2, "messages": [{"role": "user", "content": "two answers"}]}),
    )
    .await;
    assert_eq!(two.status, 400, "{}", two.body);
    assert_eq!(two.body["error"]["reason"], "invalid_params");
    assert!(model.reached("two answers") == 0);
    let one = chat(
        &api,
        json!({"n": 1, "messages": [{"role": "user", "content": "one answer"}]}),
    )
    .await;
    assert_eq!(one.status, 200, "{}", one.body);
    let started = Instant::now();
    let slow = chat(
        &named,
        json!({"messages": [{"role": "user", "content": "HANG"}]}),
    )
    .await;
    assert_eq!(slow.status, 504, "{}", slow.body);
    assert!(started.elapsed() < Duration::from_secs(12));
    // The refusal names the session and the input it reached, so the client can follow it up.
    let header = |r: &Resp, name: &str| {
        r.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let work = header(&r3, "x-gatehouse-session").expect("named session");
    assert_eq!(header(&slow, "x-gatehouse-session"), Some(work.clone()));
    let admission = header(&slow, "x-gatehouse-admission").expect("admission header");
    let receipt = named
        .expect(
            "GET",
            &format!("/v1/sessions/{work}/inputs/{admission}"),
            None,
            200,
        )
        .await;
    assert_eq!(receipt["status"], "started", "{receipt}");
    assert_eq!(header(&bad, "x-gatehouse-session"), None, "it reached none");
    let started = Instant::now();
    let slow = chat(
        &named,
        json!({"messages": [{"role": "user", "content": "HANG"}], "stream": true}),
    )
    .await;
    let body = slow.body.as_str().unwrap_or("").to_string();
    assert!(
        body.contains("\"timeout\"") && body.trim_end().ends_with("data: [DONE]"),
        "{body}"
    );
    assert!(started.elapsed() < Duration::from_secs(12));
    assert_eq!(model.reached("HANG"), 1, "the retry joined the same turn");
    model.release();
}

#[actix_rt::test]
async fn unattended_chat_sessions_deny_approvals_instead_of_waiting() {
    let home = Home::new();
    let victim = home.path.join("victim");
    std::fs::create_dir_all(victim.join("inside")).expect("victim");
    let command = format!("rm -rf -- {}", victim.display());
    let model = FakeModel::start(move |body| {
        if after_tool(body) {
            return Reply::Message(json!({"role": "assistant", "content": "DONE"}), "stop");
        }
        Reply::Message(
            tool_call("call_rm", "terminal", json!({"command": command})),
            "tool_calls",
        )
    });
    home.write_config(&keyed(&model, json!({})));
    let d = Daemon::start(&home);
    let api = Api::new(&d, KEY);
    let started = Instant::now();
    let r = chat(
        &api,
        json!({"messages": [{"role": "user", "content": "clean up"}]}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body["choices"][0]["message"]["content"], "DONE");
    assert!(started.elapsed() < Duration::from_secs(20));
    assert!(victim.exists(), "the gated command never ran");
    let tool = model
        .requests()
        .iter()
        .find_map(last_tool_result)
        .expect("a tool result");
    assert!(tool.contains("BLOCKED"), "{tool}");
    let sid = r
        .headers
        .get("x-gatehouse-session")
        .and_then(|v| v.to_str().ok())
        .expect("sid")
        .to_string();
    let snap = api
        .expect("GET", &format!("/v1/sessions/{sid}"), None, 200)
        .await;
    assert_eq!(snap["info"]["source"], "api");
    assert_eq!(
        snap["info"]["toolsets"],
        json!(["terminal"]),
        "nobody to clarify with"
    );
}

// ---------- keys ----------

fn cli(home: &Home, args: &[&str]) -> std::process::Output {
    Command::new(bin())
        .args(args)
        .arg("--home")
        .arg(&home.path)
        .output()
        .expect("run gatehouse")
}

/// A new key that cannot be shown (its standard output closed) is revoked, and the command
/// says so and fails: it is shown only this once (a panic left it working, unseen).
#[test]
fn a_key_that_cannot_be_shown_is_revoked() {
    let home = Home::new();
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let out = Command::new(bin())
        .args(["key", "create", "unseen", "--home"])
        .arg(&home.path)
        .stdout(writer)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run gatehouse")
        .wait_with_output()
        .expect("its end");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("it was revoked"), "{err}");
    let listed = cli(&home, &["key", "list", "--json"]);
    let keys: Value = serde_json::from_slice(&listed.stdout).expect("keys JSON");
    assert_eq!(keys["keys"], json!([]), "{keys}");
}

#[actix_rt::test]
async fn every_route_refuses_missing_wrong_and_revoked_keys() {
    let model = FakeModel::ack();
    let home = Home::new();
    home.write_config(&keyed(&model, json!({})));
    let out = cli(&home, &["key", "create", "laptop"]);
    assert!(out.status.success(), "{out:?}");
    let minted = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(minted.starts_with("gk_"), "{minted}");
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("created the home"),
        "the home existed: {out:?}"
    );
    // A key for a home nobody has used (a mistyped --home, say) says that it made the home.
    let elsewhere = Home::new();
    let fresh = Home {
        path: elsewhere.path.join("never-used"),
    };
    // Listing or revoking there makes no home (it did).
    for words in [&["key", "list"][..], &["key", "revoke", "x"]] {
        let out = cli(&fresh, words);
        assert_eq!(out.status.code(), Some(1), "{out:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("no home at"),
            "{out:?}"
        );
        assert!(!fresh.path.exists(), "{words:?} made the home");
    }
    let out = cli(&fresh, &["key", "create", "x"]);
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("created the home"),
        "{out:?}"
    );
    let stored = std::fs::read_to_string(home.path.join("api_keys")).expect("keys file");
    assert!(!stored.contains(&minted), "only the hash is stored");
    let d = Daemon::start(&home);
    let good = Api::new(&d, KEY);
    let doc = good.expect("GET", "/v1/openapi.json", None, 200).await;
    assert_eq!(doc["openapi"], "3.1.0");
    let laptop = Api::new(&d, &minted);
    laptop.expect("GET", "/v1/openapi.json", None, 200).await;
    let listed = cli(&home, &["key", "list", "--json"]);
    let listed: Value = serde_json::from_slice(&listed.stdout).expect("list json");
    assert_eq!(listed["keys"][0]["name"], "laptop");
    let out = cli(&home, &["key", "revoke", "laptop"]);
    assert!(out.status.success(), "{out:?}");

    let mut routes: Vec<(String, String)> = Vec::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for method in item.as_object().expect("item").keys() {
            let concrete = path
                .split('/')
                .map(|s| if s.starts_with('{') { "x" } else { s })
                .collect::<Vec<_>>()
                .join("/");
            routes.push((method.to_uppercase(), concrete));
        }
    }
    assert!(routes.len() >= 12, "{routes:?}");
    let callers = [
        ("missing", Api::anonymous(&d)),
        ("wrong", Api::new(&d, "gk_not_a_key")),
        ("revoked", laptop.clone()),
        (
            "malformed",
            Api::anonymous(&d).with("authorization", "Basic Zm9vOmJhcg=="),
        ),
        (
            "bad ticket",
            Api::anonymous(&d).with("x-gatehouse-ticket", "nope"),
        ),
    ];
    for (who, api) in &callers {
        for (method, path) in &routes {
            let body = (method == "POST").then(|| "{}".to_string());
            let r = api.raw(method, path, body).await;
            assert_eq!(r.status, 401, "{who} {method} {path}: {}", r.body);
            if path == "/v1/chat/completions" {
                // OpenAI's shape, as every refusal of the facade.
                assert_eq!(
                    r.body["error"]["type"], "authentication_error",
                    "{}",
                    r.body
                );
                assert_eq!(r.body["error"]["reason"], "permission_denied", "{}", r.body);
            } else {
                assert_refusal(&r.body, "permission_denied");
            }
            assert!(r.headers.contains_key("www-authenticate"));
        }
    }
    // The WebSocket too.
    for key in ["gk_not_a_key", minted.as_str()] {
        let res = client()
            .ws(format!("{}/api/ws", d.origin().replacen("http", "ws", 1)))
            .protocols(["gatehouse.v1"])
            .bearer_auth(key)
            .connect()
            .await;
        assert!(
            matches!(res, Err(awc::error::WsClientError::InvalidResponseStatus(s)) if s.as_u16() == 401)
        );
    }
    // A ticket authenticates exactly one request.
    let t = ticket(&home.path);
    let once = Api::anonymous(&d).with("x-gatehouse-ticket", &t);
    once.expect("GET", "/v1/openapi.json", None, 200).await;
    once.expect("GET", "/v1/openapi.json", None, 401).await;
    // Health and readiness need nothing; /metrics on a loopback listener neither.
    let anon = Api::anonymous(&d);
    for p in ["/healthz", "/readyz", "/metrics"] {
        assert_eq!(anon.get(p).await.status, 200, "{p}");
    }
    // Without a key, only to a loopback name: a page whose name was rebound to this address
    // (DNS rebinding) sends its own name, and read the counters.
    assert_eq!(
        anon.with("host", "localhost").get("/metrics").await.status,
        200
    );
    let rebound = anon.with("host", "evil.example");
    assert_eq!(rebound.get("/metrics").await.status, 403);
    assert_eq!(rebound.get("/healthz").await.status, 200);
    // With a valid key, whatever the Host (a scrape through a proxy that keeps its own name),
    // and the scheme in any case (RFC 9110: `BEARER`, and a tab after it, were refused); a
    // wrong key is not.
    for scheme in ["Bearer ", "BEARER ", "bearer\t"] {
        let keyed = rebound.with("authorization", &format!("{scheme}{KEY}"));
        assert_eq!(keyed.get("/metrics").await.status, 200, "{scheme:?}");
        keyed.expect("GET", "/v1/openapi.json", None, 200).await;
    }
    let wrong = rebound.with("authorization", "Bearer gk_not_a_key");
    assert_eq!(wrong.get("/metrics").await.status, 403);
    let unknown_scheme = rebound.with("authorization", &format!("Token {KEY}"));
    assert_eq!(unknown_scheme.get("/metrics").await.status, 403);
}

#[actix_rt::test]
async fn a_public_listener_needs_a_key() {
    let model = FakeModel::ack();
    let home = Home::new();
    home.write_config(&config(&model.url, json!({"gateway": {"host": "0.0.0.0"}})));
    let out = Command::new(bin())
        .args(["serve", "--home"])
        .arg(&home.path)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("not a loopback address") && err.contains("key create"),
        "{err}"
    );
    let created = cli(&home, &["key", "create", "ops"]);
    assert!(created.status.success(), "{created:?}");
    let key = String::from_utf8_lossy(&created.stdout).trim().to_string();
    let d = Daemon::start(&home);
    let port = d.origin().rsplit(':').next().expect("port").to_string();
    assert!(d.origin().starts_with("http://0.0.0.0:"), "{}", d.origin());
    let local = Api {
        origin: format!("http://127.0.0.1:{port}"),
        auth: Vec::new(),
    };
    // Off loopback, /metrics needs a key as well.
    assert_eq!(local.get("/metrics").await.status, 401);
    assert_eq!(local.get("/healthz").await.status, 200);
    let keyed = local.with("authorization", &format!("Bearer {key}"));
    assert_eq!(keyed.get("/metrics").await.status, 200);
    assert_eq!(keyed.get("/v1/openapi.json").await.status, 200);
}

// ---------- a whole journey with a plain HTTP client ----------

#[actix_rt::test]
async fn an_approval_journey_over_rest_and_sse() {
    let home = Home::new();
    let victim = home.path.join("victim");
    std::fs::create_dir_all(victim.join("inside")).expect("victim");
    let command = format!("rm -rf -- {}", victim.display());
    let model = FakeModel::start(move |body| {
        if after_tool(body) {
            return Reply::Message(json!({"role": "assistant", "content": "CLEANED"}), "stop");
        }
        Reply::Message(
            tool_call("call_rm", "terminal", json!({"command": command})),
            "tool_calls",
        )
    });
    home.write_config(&keyed(&model, json!({})));
    let d = Daemon::start(&home);
    let api = Api::new(&d, KEY);
    let sid = api.session("journey", &home.path).await;
    let mut sse = Sse::open(&api, &format!("/v1/sessions/{sid}/events"), None).await;
    let receipt = api.submit(&sid, "clean", "please clean up").await;
    assert_eq!(receipt["status"], "started", "claimed as it was admitted");
    let seen = sse.until(|e| e.event == "approval.request").await;
    let request = seen.last().cloned().expect("request");
    let prompt = &request.data["payload"];
    assert_eq!(prompt["admission_id"], receipt["admission_id"]);
    assert_eq!(
        prompt["choices"],
        json!(["once", "session", "always", "deny"])
    );
    assert!(victim.exists(), "nothing runs before the answer");
    let pid = prompt["prompt_id"].as_str().expect("prompt id");
    let answer = api
        .expect(
            "POST",
            &format!("/v1/sessions/{sid}/prompts/{pid}"),
            Some(json!({"execution_generation": prompt["execution_generation"], "choice": "once"})),
            200,
        )
        .await;
    assert_eq!(answer["status"], "resolved");
    let rest = sse.until(completes(&receipt["admission_id"])).await;
    let mut all = durable(&seen);
    all.extend(durable(&rest));
    let at = |kind: &str| {
        all.iter()
            .position(|(_, k)| k == kind)
            .unwrap_or_else(|| panic!("{kind} missing from {all:?}"))
    };
    let order: Vec<usize> = [
        "message.start",
        "tool.start",
        "approval.request",
        "approval.settled",
        "tool.complete",
        "message.complete",
    ]
    .iter()
    .map(|k| at(k))
    .collect();
    assert!(order.windows(2).all(|w| w[0] < w[1]), "{all:?}");
    let complete = rest.last().expect("complete");
    assert_eq!(complete.data["payload"]["text"], "CLEANED");
    assert_eq!(complete.data["payload"]["outcome"], "completed");
    let settled = rest
        .iter()
        .find(|e| e.event == "approval.settled")
        .expect("settled");
    assert_eq!(settled.data["payload"]["resolution"], "choice:once");
    assert!(!victim.exists(), "the approved command ran");
    let done = api.wait(&sid, &receipt["admission_id"]).await;
    assert_eq!(done["result"]["final_response"], "CLEANED");
    assert_eq!(all, stored_events(&home, &sid));
    let snap = api
        .expect("GET", &format!("/v1/sessions/{sid}"), None, 200)
        .await;
    assert_eq!(snap["prompts"], json!([]));
    let roles: Vec<&str> = snap["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .map(|m| m["role"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(roles, vec!["user", "assistant", "tool", "assistant"]);
}

/// A graceful stop stays within its drain timeout with an event stream open: the open request
/// gets what is left of the drain, not the HTTP server's own five-second shutdown wait on top of
/// it (which could carry the stop past systemd's TimeoutStopSec, and into a SIGKILL).
#[actix_rt::test]
async fn a_graceful_stop_with_an_event_stream_open_stays_within_the_drain_timeout() {
    let model = FakeModel::ack();
    let home = Home::new();
    home.write_config(&keyed(
        &model,
        json!({"gateway": {"drain_timeout_seconds": 1}, "http": {"sse_keepalive_seconds": 0.3}}),
    ));
    let mut d = Daemon::start(&home);
    let api = Api::new(&d, KEY);
    let sid = api.session("stop", &home.path).await;
    let a = api.submit(&sid, "i1", "one").await;
    let mut sse = Sse::open(&api, &format!("/v1/sessions/{sid}/events"), None).await;
    sse.until(completes(&a["admission_id"])).await;
    let stopping = Instant::now();
    assert_eq!(d.term(), Some(0));
    let took = stopping.elapsed();
    // The server's own wait on top of the drain made it 6 s or more.
    assert!(
        took < Duration::from_millis(5500),
        "the stop took {took:?} with a 1 s drain timeout"
    );
}

/// A text within the session's limit is taken however its client escapes it: Python's
/// `json.dumps` (ensure_ascii) writes each Cyrillic character as six bytes (`\u0436`), three
/// times its UTF-8 size. The body limit once allowed only twice the text limit, so such a text
/// was refused over REST (413) while the same text went through the WebSocket.
#[actix_rt::test]
async fn an_escaped_text_within_the_limit_is_taken_over_rest() {
    let model = FakeModel::ack();
    let home = Home::new();
    home.write_config(&keyed(
        &model,
        json!({"session": {"max_text_bytes": 65536}}),
    ));
    let d = Daemon::start(&home);
    let api = Api::new(&d, KEY);
    let sid = api.session("escaped", &home.path).await;
    let text = "ж".repeat(32_768);
    assert_eq!(text.len(), 65_536);
    let escaped = "\\u0436".repeat(32_768);
    let body = format!(r#"{{"input_id": "cyrillic", "text": "{escaped}"}}"#);
    let r = api
        .raw("POST", &format!("/v1/sessions/{sid}/inputs"), Some(body))
        .await;
    assert_eq!(r.status, 202, "{}", r.body);
    api.wait(&sid, &r.body["admission_id"]).await;
    assert_eq!(model.reached(&text), 1);
    // One byte over the text's own limit is still refused, for what it is.
    let over = format!(r#"{{"input_id": "over", "text": "{escaped}x"}}"#);
    let r = api
        .raw("POST", &format!("/v1/sessions/{sid}/inputs"), Some(over))
        .await;
    assert_eq!(r.status, 413, "{}", r.body);
    assert!(r.body.to_string().contains("text is over"), "{}", r.body);
}

/// `gatehouse key revoke` ends what the key already opened: its WebSocket closes (1008) and its
/// event stream ends with a permission_denied error, within a heartbeat. Before, both went on
/// for as long as the client kept them open (the key was checked only when they opened).
#[actix_rt::test]
async fn a_revoked_key_ends_the_connections_it_opened() {
    use crate::hostile::{raw_upgrade, RawWs};
    let model = FakeModel::ack_or_hang();
    let home = Home::new();
    home.write_config(&keyed(
        &model,
        json!({"gateway": {"heartbeat_seconds": 0.3}, "http": {"sse_keepalive_seconds": 0.3}}),
    ));
    let out = cli(&home, &["key", "create", "laptop"]);
    assert!(out.status.success(), "{out:?}");
    let minted = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let d = Daemon::start(&home);
    let laptop = Api::new(&d, &minted);
    let sid = laptop.session("revoked", &home.path).await;
    let mut sse = Sse::open(&laptop, &format!("/v1/sessions/{sid}/events"), None).await;
    let bearer = format!("Bearer {minted}");
    let mut ws = RawWs::from_upgrade(raw_upgrade(
        &d.origin(),
        &["gatehouse.v1".to_string()],
        &[("Authorization", &bearer)],
    ));
    ws.text(
        json!({"jsonrpc": "2.0", "id": 1, "method": "session.resume", "params": {"session_id": sid}})
            .to_string()
            .as_bytes(),
    );
    assert_eq!(ws.reply()["result"]["session_id"], sid);
    // A streamed chat completion waiting for its answer.
    let streaming = {
        let laptop = Api::new(&d, &minted);
        actix_rt::spawn(async move {
            let started = Instant::now();
            let r = chat(
                &laptop,
                json!({"messages": [{"role": "user", "content": "HANG"}], "stream": true}),
            )
            .await;
            (r.body.as_str().unwrap_or("").to_string(), started.elapsed())
        })
    };
    wait_until("the completion's turn runs", T, || {
        model.reached("HANG") == 1
    })
    .await;
    // A plain completion and a receipt's long poll, each waiting for its answer.
    let plain = {
        let laptop = Api::new(&d, &minted);
        actix_rt::spawn(async move {
            let started = Instant::now();
            let r = chat(
                &laptop,
                json!({"messages": [{"role": "system", "content": "plain"},
                                    {"role": "user", "content": "HANG"}]}),
            )
            .await;
            (r.status, r.body, started.elapsed())
        })
    };
    let waited = laptop.submit(&sid, "waited", "HANG").await;
    let polling = {
        let laptop = Api::new(&d, &minted);
        let path = format!(
            "/v1/sessions/{sid}/inputs/{}?wait=100",
            waited["admission_id"].as_str().unwrap_or_default()
        );
        actix_rt::spawn(async move {
            let started = Instant::now();
            let r = laptop.get(&path).await;
            (r.status, r.body, started.elapsed())
        })
    };
    wait_until("every turn runs", T, || model.reached("HANG") == 3).await;
    // Another key's connection is not touched.
    let other = Api::new(&d, KEY);
    let kept = other.session("kept", &home.path).await;
    let mut kept_sse = Sse::open(&other, &format!("/v1/sessions/{kept}/events"), None).await;

    let out = cli(&home, &["key", "revoke", "laptop"]);
    assert!(out.status.success(), "{out:?}");
    let (code, reason) = ws
        .close_code_within(Duration::from_secs(10))
        .expect("a close frame");
    assert_eq!(code, 1008, "{reason}");
    assert!(reason.contains("revoked"), "{reason}");
    let ended = sse.until(|e| e.event == "error").await;
    let error = &ended.last().expect("the error").data;
    assert_eq!(error["error"]["reason"], "permission_denied", "{error}");
    // The completion's stream ends too, saying why (it went on to its answer, or to the
    // completion timeout: 300 s).
    let (body, took) = streaming.await.expect("the completion");
    assert!(body.contains("revoked"), "{body}");
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
    assert!(took < Duration::from_secs(20), "{took:?}");
    // So are the plain completion and the long poll: refused, not answered minutes later.
    for (what, waiting) in [("plain", plain), ("poll", polling)] {
        let (status, body, took) = waiting.await.expect(what);
        assert_eq!(status, 401, "{what}: {body}");
        assert!(body.to_string().contains("revoked"), "{what}: {body}");
        assert!(took < Duration::from_secs(20), "{what}: {took:?}");
    }
    // The other key's stream still carries its session's events.
    let a = other.submit(&kept, "still", "still").await;
    kept_sse.until(completes(&a["admission_id"])).await;
    model.release();
}

/// A request sent on a WebSocket after its key was revoked is refused and ends the connection
/// at once, not at the next heartbeat: nothing it asks is admitted. Before, a `prompt.submit`
/// sent right after `gatehouse key revoke` was admitted and its turn ran commands until the
/// heartbeat closed the connection.
#[actix_rt::test]
async fn a_request_after_its_key_was_revoked_is_refused_at_once() {
    use crate::hostile::{raw_upgrade, RawWs};
    let model = FakeModel::ack_or_hang();
    let home = Home::new();
    home.write_config(&keyed(
        &model,
        json!({"gateway": {"heartbeat_seconds": 120, "client_timeout_seconds": 300}}),
    ));
    let out = cli(&home, &["key", "create", "laptop"]);
    assert!(out.status.success(), "{out:?}");
    let minted = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let d = Daemon::start(&home);
    let sid = Api::new(&d, &minted).session("revoked", &home.path).await;
    let bearer = format!("Bearer {minted}");
    let mut ws = RawWs::from_upgrade(raw_upgrade(
        &d.origin(),
        &["gatehouse.v1".to_string()],
        &[("Authorization", &bearer)],
    ));
    ws.text(
        json!({"jsonrpc": "2.0", "id": 1, "method": "session.resume", "params": {"session_id": sid}})
            .to_string()
            .as_bytes(),
    );
    assert_eq!(ws.reply()["result"]["session_id"], sid);

    let out = cli(&home, &["key", "revoke", "laptop"]);
    assert!(out.status.success(), "{out:?}");
    ws.text(
        json!({"jsonrpc": "2.0", "id": 2, "method": "prompt.submit",
               "params": {"session_id": sid, "input_id": "after-revoke", "text": "after revoke"}})
        .to_string()
        .as_bytes(),
    );
    let refused = ws.reply();
    assert_eq!(refused["id"], 2, "{refused}");
    assert_eq!(
        refused["error"]["data"]["reason"], "permission_denied",
        "{refused}"
    );
    let (code, reason) = ws
        .close_code_within(Duration::from_secs(5))
        .expect("a close frame");
    assert_eq!(code, 1008, "{reason}");
    assert!(home.admissions().is_empty(), "{:?}", home.admissions());
    assert_eq!(model.reached("after revoke"), 0);
}

/// A chat-completions client sends the whole conversation each time. Two conversations that
/// open alike are two sessions (the second was answered from the first's history, secrets
/// included); a conversation goes on in its session while it is exactly where it left off; a
/// history the client wrote reaches the model as written, its system message too; the session
/// id from the response names the session back; a request whose turn failed asks again when
/// sent again, and a retry of one that completed joins it.
#[actix_rt::test]
async fn chat_completion_conversations_are_kept_apart_and_go_on_where_they_left_off() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let fails = std::sync::Arc::new(AtomicUsize::new(0));
    let failing = fails.clone();
    let model = FakeModel::start(move |body| {
        let text = last_user(body);
        if text == "FAIL_ONCE" && failing.fetch_add(1, Ordering::SeqCst) == 0 {
            return Reply::Status(500, json!({"error": {"message": "down"}}));
        }
        Reply::Message(
            json!({"role": "assistant", "content": format!("ACK_{text}")}),
            "stop",
        )
    });
    let home = Home::new();
    home.write_config(&keyed(&model, json!({"model": {"max_retries": 0}})));
    let d = Daemon::start(&home);
    let api = Api::new(&d, KEY);
    // The request the model got for the user text `text` (the last one).
    let asked = |text: &str| -> Value {
        model
            .requests()
            .into_iter()
            .rev()
            .find(|b| last_user(b) == text)
            .unwrap_or_else(|| panic!("no request for {text}"))
    };
    let sys = json!({"role": "system", "content": "Answer as SYS_PIRATE."});
    let hello = json!({"role": "user", "content": "Hello!"});
    let acked = json!({"role": "assistant", "content": "ACK_Hello!"});

    let first = chat(&api, json!({"messages": [sys, hello]})).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let a = session_of(&first);
    let system = asked("Hello!")["messages"][0]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        system.contains("SYS_PIRATE"),
        "the client's system message: {system}"
    );

    let secret = json!({"messages": [sys, hello, acked, {"role": "user", "content": "my secret is SWORDFISH"}]});
    let second = chat(&api, secret.clone()).await;
    assert_eq!(second.status, 200, "{}", second.body);
    assert_eq!(
        session_of(&second),
        a,
        "the conversation goes on in its session"
    );
    assert_eq!(
        user_texts(&asked("my secret is SWORDFISH")),
        ["Hello!", "my secret is SWORDFISH"]
    );
    // The same request again joins its input: one turn.
    let again = chat(&api, secret).await;
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(
        again.headers.get("x-gatehouse-admission"),
        second.headers.get("x-gatehouse-admission")
    );
    assert_eq!(model.reached("my secret is SWORDFISH"), 1);

    // Another conversation that opened alike: its own session, and nothing of the first's.
    let other = chat(
        &api,
        json!({"messages": [sys, hello, acked, {"role": "user", "content": "what did I tell you?"}]}),
    )
    .await;
    assert_eq!(other.status, 200, "{}", other.body);
    assert_ne!(session_of(&other), a);
    let seen = asked("what did I tell you?");
    assert!(!seen.to_string().contains("SWORDFISH"), "{seen}");
    assert_eq!(user_texts(&seen), ["Hello!", "what did I tell you?"]);
    assert!(
        seen.to_string().contains("ACK_Hello!"),
        "its history as sent: {seen}"
    );

    // A history the client wrote reaches the model as written.
    let written = chat(
        &api,
        json!({"messages": [{"role": "user", "content": "x1"}, {"role": "assistant", "content": "MADE_UP"},
                            {"role": "user", "content": "x2"}]}),
    )
    .await;
    assert_eq!(written.status, 200, "{}", written.body);
    let seen = asked("x2");
    assert_eq!(user_texts(&seen), ["x1", "x2"]);
    assert!(seen.to_string().contains("MADE_UP"), "{seen}");

    // The session id the response gives names that session back.
    let named = api
        .with("x-gatehouse-session", &a)
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "what fruit?"}]}),
        )
        .await;
    assert_eq!(named.status, 200, "{}", named.body);
    assert_eq!(session_of(&named), a);
    assert!(asked("what fruit?").to_string().contains("SWORDFISH"));
    // A named session's client sends only the new message: the same request again at once is
    // a retry (joined), but the same text after another input is a new input (it was answered
    // with the earlier reply, and the model never saw it).
    let in_a = api.with("x-gatehouse-session", &a);
    let say = |text: &str| json!({"messages": [{"role": "user", "content": text}]});
    for text in ["continue", "continue", "something else", "continue"] {
        let r = in_a.post("/v1/chat/completions", say(text)).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    assert_eq!(
        model.reached("continue"),
        2,
        "the retry joined, the later one ran"
    );
    assert_eq!(model.reached("something else"), 1);

    // An Idempotency-Key names one request: used again with other messages, it is a conflict
    // (two completions were run and answered).
    let keyed_api = api.with("idempotency-key", "one-request");
    let first_body = chat(
        &keyed_api,
        json!({"messages": [{"role": "user", "content": "first body"}]}),
    )
    .await;
    assert_eq!(first_body.status, 200, "{}", first_body.body);
    let second_body = chat(
        &keyed_api,
        json!({"messages": [{"role": "user", "content": "second body"}]}),
    )
    .await;
    assert_eq!(second_body.status, 409, "{}", second_body.body);
    assert_eq!(second_body.body["error"]["reason"], "admission_conflict");
    assert_eq!(model.reached("second body"), 0);
    // So with the same last message after another history (it was answered with the first
    // request's completion); the same request again is answered as the first was.
    let other_history = chat(
        &keyed_api,
        json!({"messages": [{"role": "system", "content": "be terse"},
                            {"role": "user", "content": "first body"}]}),
    )
    .await;
    assert_eq!(other_history.status, 409, "{}", other_history.body);
    assert_eq!(other_history.body["error"]["reason"], "admission_conflict");
    let again = chat(
        &keyed_api,
        json!({"messages": [{"role": "user", "content": "first body"}]}),
    )
    .await;
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(again.body["id"], first_body.body["id"]);
    assert_eq!(model.reached("first body"), 1);
    // A client that sends each request under a key of its own goes on where its conversation
    // left off, as one sending none does (each such request started a new session, holding a
    // copy of the conversation so far).
    let next = chat(
        &api.with("idempotency-key", "another-request"),
        json!({"messages": [{"role": "user", "content": "first body"},
                            {"role": "assistant", "content": "ACK_first body"},
                            {"role": "user", "content": "keyed follow-up"}]}),
    )
    .await;
    assert_eq!(next.status, 200, "{}", next.body);
    assert_eq!(session_of(&next), session_of(&first_body));
    assert_eq!(
        user_texts(&asked("keyed follow-up")),
        ["first body", "keyed follow-up"]
    );
    // That session moved on by another way in (the same text again, sent to it by name): the
    // conversation does not go on there, whose last input is not its own.
    let s = session_of(&first_body);
    let by_name = chat(
        &api.with("x-gatehouse-session", &s),
        json!({"messages": [{"role": "user", "content": "keyed follow-up"}]}),
    )
    .await;
    assert_eq!(by_name.status, 200, "{}", by_name.body);
    assert_eq!(model.reached("keyed follow-up"), 2);
    let after = chat(
        &api.with("idempotency-key", "a-third-request"),
        json!({"messages": [{"role": "user", "content": "first body"},
                            {"role": "assistant", "content": "ACK_first body"},
                            {"role": "user", "content": "keyed follow-up"},
                            {"role": "assistant", "content": "ACK_keyed follow-up"},
                            {"role": "user", "content": "after it"}]}),
    )
    .await;
    assert_eq!(after.status, 200, "{}", after.body);
    assert_ne!(session_of(&after), s);
    assert_eq!(
        user_texts(&asked("after it")),
        ["first body", "keyed follow-up", "after it"]
    );

    // A keyed request sent again without its key is admitted under the conversation's own id:
    // the conversation goes on from that input all the same (only the keyed one was looked for).
    let opening = json!({"messages": [{"role": "user", "content": "keyed once"}]});
    let once = chat(&api.with("idempotency-key", "keyed-once"), opening.clone()).await;
    assert_eq!(once.status, 200, "{}", once.body);
    let unkeyed = chat(&api, opening).await;
    assert_eq!(unkeyed.status, 200, "{}", unkeyed.body);
    assert_eq!(session_of(&unkeyed), session_of(&once));
    let on = chat(
        &api,
        json!({"messages": [{"role": "user", "content": "keyed once"},
                            {"role": "assistant", "content": "ACK_keyed once"},
                            {"role": "user", "content": "and on"}]}),
    )
    .await;
    assert_eq!(on.status, 200, "{}", on.body);
    assert_eq!(session_of(&on), session_of(&once));
    // The unkeyed request was another input of the session (no key named it the keyed one).
    assert_eq!(
        user_texts(&asked("and on")),
        ["keyed once", "keyed once", "and on"]
    );

    // A turn that failed is asked again when the same request comes again.
    let body = json!({"messages": [{"role": "user", "content": "FAIL_ONCE"}]});
    let failed = chat(&api, body.clone()).await;
    assert_eq!(failed.status, 502, "{}", failed.body);
    // OpenAI's SDKs retry a 5xx on their own unless told not to: each retry would run the
    // turn again.
    told_not_to_retry(&failed);
    let retried = chat(&api, body).await;
    assert_eq!(retried.status, 200, "{}", retried.body);
    assert_eq!(
        retried.body["choices"][0]["message"]["content"],
        "ACK_FAIL_ONCE"
    );
    assert_eq!(model.reached("FAIL_ONCE"), 2);
}

/// A chat completion whose turn was running when the gateway was killed is refused at once when
/// sent again, with the command that settles it (the request hung until its timeout, every
/// time); once settled, the same request asks again.
#[actix_rt::test]
async fn a_chat_completion_lost_to_a_crash_names_the_command_that_settles_it() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let calls = std::sync::Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let model = FakeModel::start(move |body| {
        if last_user(body) == "LOST" && counted.fetch_add(1, Ordering::SeqCst) == 0 {
            return Reply::Hang;
        }
        Reply::Message(
            json!({"role": "assistant", "content": format!("ACK_{}", last_user(body))}),
            "stop",
        )
    });
    let home = Home::new();
    home.write_config(&keyed(&model, json!({})));
    let mut d = Daemon::start(&home);
    let body = json!({"messages": [{"role": "user", "content": "LOST"}]});
    let api = Api::new(&d, KEY);
    let pending = {
        let (api, body) = (api.clone(), body.clone());
        actix_rt::spawn(async move { chat(&api, body).await })
    };
    wait_until("the turn reaches the model", T, || {
        model.reached("LOST") == 1
    })
    .await;
    d.kill();
    pending.abort();
    let d = Daemon::start(&home);
    let api = Api::new(&d, KEY);
    let started = Instant::now();
    let r = chat(&api, body.clone()).await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "refused at once"
    );
    assert_eq!(r.status, 409, "{}", r.body);
    assert_eq!(r.body["error"]["reason"], "unknown_execution", "{}", r.body);
    let (lost, command) = unknown_admission(&home);
    let message = r.body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains(&command), "{message}");
    let settled = control(
        &home.path,
        "resolve-unknown",
        json!({"session_id": lost.target_session_id, "admission_id": lost.admission_id,
               "execution_generation": lost.execution_generation}),
    )
    .expect("resolve");
    assert!(settled.get("error").is_none(), "{settled}");
    let r = chat(&api, body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body["choices"][0]["message"]["content"], "ACK_LOST");
    assert_eq!(model.reached("LOST"), 2);
}

/// The daemon's HTTP address (`host:port`) and its port.
fn address_of(d: &Daemon) -> (String, u16) {
    let addr = d.origin().trim_start_matches("http://").to_string();
    let port: u16 = addr
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("port");
    (addr, port)
}

/// Does process `pid` hold the socket of the TCP connection between its `port` and the peer's
/// `peer_port` (found by its inode in /proc/net/tcp)?
fn holds_connection(pid: u32, port: u16, peer_port: u16) -> bool {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    let port_of = |addr: &str| {
        addr.rsplit(':')
            .next()
            .and_then(|p| u16::from_str_radix(p, 16).ok())
    };
    let inodes: Vec<String> = table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            (f.len() > 9 && port_of(f[1]) == Some(port) && port_of(f[2]) == Some(peer_port))
                .then(|| f[9].to_string())
        })
        .collect();
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.flatten().any(|fd| {
        std::fs::read_link(fd.path()).is_ok_and(|target| {
            inodes
                .iter()
                .any(|inode| target.to_string_lossy() == format!("socket:[{inode}]"))
        })
    })
}

/// Requests that wait (event streams, long polls) count against `gateway.max_connections`
/// with the WebSockets: past it one is refused `rate_limited`, and a place is given back when
/// its request ends. Before, one client's waiting requests could take every connection the
/// server accepts.
#[actix_rt::test]
async fn waiting_requests_count_against_the_connection_bound() {
    let model = FakeModel::ack_or_hang();
    let home = Home::new();
    home.write_config(&keyed(&model, json!({"gateway": {"max_connections": 3}})));
    let d = Daemon::start(&home);
    let api = Api::new(&d, KEY);
    let sid = api.session("bounded", &home.path).await;
    let other = api.session("settled", &home.path).await;
    let done = api.submit(&other, "done", "hello").await;
    api.wait(&other, &done["admission_id"]).await;
    let events = format!("/v1/sessions/{sid}/events");
    let first = Sse::open(&api, &events, None).await;
    let _second = Sse::open(&api, &events, None).await;
    let _ws = d.ws().await;
    let refused = api.get(&events).await;
    assert_eq!(refused.status, 429, "{}", refused.body);
    assert_refusal(&refused.body, "rate_limited");
    let a = api.submit(&sid, "waited", "HANG").await;
    let receipt = |query: &str| {
        format!(
            "/v1/sessions/{sid}/inputs/{}{query}",
            a["admission_id"].as_str().unwrap_or_default()
        )
    };
    let poll = api.get(&receipt("?wait=5")).await;
    assert_eq!(poll.status, 429, "{}", poll.body);
    // A receipt read without waiting takes no place, nor one that asks to wait for an input
    // already settled.
    let now = api.get(&receipt("")).await;
    assert_eq!(now.status, 200, "{}", now.body);
    let settled = api
        .get(&format!(
            "/v1/sessions/{other}/inputs/{}?wait=5",
            done["admission_id"].as_str().unwrap_or_default()
        ))
        .await;
    assert_eq!(settled.status, 200, "{}", settled.body);
    drop(first);
    let deadline = Instant::now() + T;
    while api.get(&receipt("?wait=0.1")).await.status != 200 {
        assert!(
            Instant::now() < deadline,
            "the ended stream's place was never given back"
        );
        actix_rt::time::sleep(Duration::from_millis(50)).await;
    }
    model.release();
}

/// A long poll whose client has closed its side of the connection ends then, connection and
/// all. Before, it went on to its deadline (100 s here), its subscription and its session's
/// supervisor kept, and a client could pile such polls up without keeping a socket open.
#[actix_rt::test]
async fn a_long_poll_whose_client_left_ends_with_it() {
    use std::io::Write;
    let model = FakeModel::start(|_| Reply::Hang);
    let home = Home::new();
    home.write_config(&keyed(&model, json!({})));
    let d = Daemon::start(&home);
    let api = Api::new(&d, KEY);
    let sid = api.session("left", &home.path).await;
    let a = api.submit(&sid, "waited", "HANG").await;
    wait_until("the turn runs", T, || model.reached("HANG") == 1).await;
    let (addr, port) = address_of(&d);
    let mut poll = std::net::TcpStream::connect(&addr).expect("connect");
    write!(
        poll,
        "GET /v1/sessions/{sid}/inputs/{}?wait=100 HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {KEY}\r\n\r\n",
        a["admission_id"].as_str().unwrap_or_default()
    )
    .expect("request");
    let peer_port = poll.local_addr().expect("local").port();
    let pid = d.child.id();
    wait_until("the poll is open", T, || {
        holds_connection(pid, port, peer_port)
    })
    .await;
    poll.shutdown(std::net::Shutdown::Write)
        .expect("half close");
    wait_until(
        "the poll ends with its client",
        Duration::from_secs(10),
        || !holds_connection(pid, port, peer_port),
    )
    .await;
    model.release();
}

/// An event stream whose reader takes nothing is cut off, connection and all, once a write has
/// waited four keep-alives (at least 30 s): the daemon no longer holds its socket. Before, the
/// stream's producer gave up but the connection stayed, with what its body still held (up to
/// 64 frames) and the kernel's send queue, for as long as its peer answered TCP's probes (30
/// such readers held 150 MB).
#[actix_rt::test]
async fn a_stalled_event_stream_reader_is_cut_off_with_its_connection() {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    let big = "x".repeat(300_000);
    let model = FakeModel::start(move |_| {
        Reply::Message(json!({"role": "assistant", "content": big}), "stop")
    });
    let home = Home::new();
    home.write_config(&keyed(
        &model,
        json!({"http": {"sse_keepalive_seconds": 1}}),
    ));
    let d = Daemon::start(&home);
    let api = Api::new(&d, KEY);
    let sid = api.session("stalled", &home.path).await;
    let (addr, port) = address_of(&d);
    let mut reader = std::net::TcpStream::connect(&addr).expect("connect");
    let small: libc::c_int = 4096;
    // SAFETY: setsockopt on a socket this test owns, with a c_int of the size given.
    unsafe {
        libc::setsockopt(
            reader.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&small as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
    write!(
        reader,
        "GET /v1/sessions/{sid}/events HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {KEY}\r\n\r\n"
    )
    .expect("request");
    let peer_port = reader.local_addr().expect("local").port();
    let pid = d.child.id();
    wait_until("the stream is open", T, || {
        holds_connection(pid, port, peer_port)
    })
    .await;
    // Far more than the socket buffers and the stream's channel hold, never read.
    for i in 0..40 {
        let a = api.submit(&sid, &format!("big-{i}"), "go").await;
        api.wait(&sid, &a["admission_id"]).await;
    }
    assert!(holds_connection(pid, port, peer_port), "cut off too soon");
    wait_until(
        "the stalled reader is cut off",
        Duration::from_secs(90),
        || !holds_connection(pid, port, peer_port),
    )
    .await;
    assert!(home.log().contains("reader took nothing; cut off"));
    drop(reader);
}

/// A model endpoint that still limits the rate after the retries fails the turn with reason
/// `rate_limited`, and a chat completion answers it 429, not 502, telling the client not to
/// send it again on its own (`x-should-retry: false`): sent again, the request runs a new turn,
/// and OpenAI's clients retried a 429 twice unasked, running the turn's tools each time.
#[actix_rt::test]
async fn a_rate_limited_model_is_a_429_to_a_chat_client() {
    let model = FakeModel::start(|_| {
        Reply::Status(
            429,
            json!({"error": {"message": "slow down", "type": "rate_limit_error"}}),
        )
    });
    let (_home, _d, _api, r) = chatted_once(&model, "hello").await;
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.body["error"]["code"], "rate_limited", "{}", r.body);
    assert_eq!(retry_after(&r), Some("1"), "{:?}", r.headers);
    told_not_to_retry(&r);
}

/// An answer the model cut at its output limit (its continuations spent) says so, as
/// OpenAI's do: `finish_reason` `length`, plain and streamed. It said `stop`, and a client
/// checking for a truncated answer never saw one.
#[actix_rt::test]
async fn an_answer_cut_at_the_models_limit_finishes_with_length() {
    let model = FakeModel::start(|_| {
        Reply::Message(json!({"role": "assistant", "content": "part"}), "length")
    });
    let (_home, _d, api, r) = chatted_once(&model, "long answer").await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        r.body["choices"][0]["finish_reason"], "length",
        "{}",
        r.body
    );
    assert!(
        r.body["choices"][0]["message"]["content"]
            .as_str()
            .is_some_and(|c| c.starts_with("part")),
        "{}",
        r.body
    );
    let streamed = chat(
        &api,
        json!({"stream": true, "messages": [{"role": "user", "content": "long again"}]}),
    )
    .await;
    assert_eq!(streamed.status, 200, "{}", streamed.body);
    let text = streamed.body.as_str().expect("an event stream").to_string();
    assert!(text.contains(r#""finish_reason":"length""#), "{text}");
    assert!(!text.contains(r#""finish_reason":"stop""#), "{text}");
}

/// A conversation too long for the model (and nothing to compress) is answered as OpenAI
/// answers one: 400 with `code` `context_length_exceeded`, and not to be retried as it is.
#[actix_rt::test]
async fn a_conversation_too_long_for_the_model_is_a_400_context_length_exceeded() {
    let model = FakeModel::start(|_| {
        Reply::Status(
            400,
            json!({"error": {"message": "This model's maximum context length is 8192 tokens.",
                             "type": "invalid_request_error", "code": "context_length_exceeded"}}),
        )
    });
    let (_home, _d, _api, r) = chatted_once(&model, "too long").await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(
        r.body["error"]["code"], "context_length_exceeded",
        "{}",
        r.body
    );
    assert_eq!(r.body["error"]["reason"], "context_overflow", "{}", r.body);
    told_not_to_retry(&r);
}

/// A daemon on `model` that takes [`KEY`] (its home, the daemon and its API), and its answer to
/// one chat completion of `text`.
async fn chatted_once(model: &FakeModel, text: &str) -> (Home, Daemon, Api, Resp) {
    let home = Home::new();
    home.write_config(&keyed(model, json!({})));
    let d = Daemon::start(&home);
    let api = Api::new(&d, KEY);
    let r = chat(
        &api,
        json!({"messages": [{"role": "user", "content": text}]}),
    )
    .await;
    (home, d, api, r)
}

fn retry_after(r: &Resp) -> Option<&str> {
    r.headers.get("retry-after").and_then(|v| v.to_str().ok())
}

/// `r` tells OpenAI's clients not to send the request again on their own (`x-should-retry:
/// false`): sent again, it would run a new turn.
fn told_not_to_retry(r: &Resp) {
    assert_eq!(
        r.headers
            .get("x-should-retry")
            .and_then(|v| v.to_str().ok()),
        Some("false"),
        "{:?}",
        r.headers
    );
}

/// A session whose queue is full refuses another input with 429 `session_busy` and says when to
/// come back (`Retry-After`), as a load refusal should to an HTTP client; other refusals do not.
#[actix_rt::test]
async fn a_full_queue_is_a_429_that_says_when_to_come_back() {
    let model = FakeModel::ack_or_hang();
    let home = Home::new();
    home.write_config(&keyed(
        &model,
        json!({"session": {"max_queued_admissions": 1}}),
    ));
    let d = Daemon::start(&home);
    let api = Api::new(&d, KEY);
    let sid = api.session("full", &home.path).await;
    api.submit(&sid, "head", "HANG").await;
    wait_until("HANG at the model", Duration::from_secs(20), || {
        model.reached("HANG") == 1
    })
    .await;
    api.submit(&sid, "q1", "Q1").await;
    let inputs = format!("/v1/sessions/{sid}/inputs");
    let r = api
        .post(&inputs, json!({"input_id": "q2", "text": "Q2"}))
        .await;
    assert_eq!(r.status, 429, "{}", r.body);
    assert_refusal(&r.body, "session_busy");
    assert_eq!(retry_after(&r), Some("1"), "{:?}", r.headers);
    // A refusal that waiting does not cure says nothing of coming back.
    let r = api
        .post(&inputs, json!({"input_id": "q1", "text": "other"}))
        .await;
    assert_eq!(r.status, 409, "{}", r.body);
    assert_eq!(retry_after(&r), None, "{:?}", r.headers);
}

/// A request body that does not arrive within `http.body_timeout_seconds` of its headers is
/// answered 408 and its connection closed: a client trickling one in (or stopping half way)
/// held the connection and its handler for as long as it kept the socket open.
#[actix_rt::test]
async fn a_body_that_does_not_arrive_in_time_is_a_408() {
    use std::io::{Read, Write};
    let model = FakeModel::ack_or_hang();
    let home = Home::new();
    home.write_config(&keyed(&model, json!({"http": {"body_timeout_seconds": 1}})));
    let d = Daemon::start(&home);
    let address = d.origin().trim_start_matches("http://").to_string();
    let mut tcp = std::net::TcpStream::connect(&address).expect("connect");
    tcp.set_read_timeout(Some(T)).expect("read timeout");
    let head = format!(
        "POST /v1/sessions HTTP/1.1\r\nHost: {address}\r\nAuthorization: Bearer {KEY}\r\n\
         Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"request_id\":"
    );
    tcp.write_all(head.as_bytes()).expect("write");
    let sent = Instant::now();
    let mut answer = Vec::new();
    // To the end: the connection is closed after the answer (its body's rest is never read).
    let _ = tcp.read_to_end(&mut answer);
    let waited = sent.elapsed();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("\"invalid_params\""), "{answer}");
    assert!(
        waited < T,
        "answered only when the client gave up: {waited:?}"
    );
    // A body that arrives whole is read as ever.
    let api = Api::new(&d, KEY);
    let r = api
        .post(
            "/v1/sessions",
            json!({"request_id": "whole", "cwd": home.path.to_string_lossy()}),
        )
        .await;
    assert!(
        r.status == 200 || r.status == 201,
        "{} {}",
        r.status,
        r.body
    );
}
