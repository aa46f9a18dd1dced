//! Tools and prompts: tool-call batches and streamed fragments, dangerous-command approvals,
//! clarify questions, prompt fencing by generation and connection, interrupts and SIGTERM while
//! a turn is parked.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::helpers::*;

/// A daemon on `model`, a session of it named `name`, and the input `input` (its text the
/// same) submitted there.
async fn submitted(model: &FakeModel, name: &str, input: &str) -> (Home, Daemon, Ws, String) {
    let (home, d) = Daemon::with_model(model, json!({}));
    let mut ws = d.ws().await;
    let sid = ws.session(name, &home.path).await;
    ws.submit(&sid, input, input).await;
    (home, d, ws, sid)
}

const T: Duration = Duration::from_secs(30);

/// A model that answers a user text from `script` with that assistant message (a tool call), then
/// `DONE_<text>` once the last message is a tool result; anything else gets `ACK_<text>`.
fn scripted(script: Vec<(&str, Value)>) -> FakeModel {
    FakeModel::start(scripted_calls(script))
}

/// [`scripted`]'s answers: a user text's tool calls, then `DONE_<text>` after the tool (and
/// `ACK_<text>` for a text the script does not name).
fn scripted_calls(script: Vec<(&str, Value)>) -> impl Fn(&Value) -> Reply + Send + Sync + 'static {
    let script: HashMap<String, Value> = script
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    move |body| {
        let text = last_user(body);
        if after_tool(body) {
            return Reply::Message(
                json!({"role": "assistant", "content": format!("DONE_{text}")}),
                "stop",
            );
        }
        match script.get(&text) {
            Some(m) => Reply::Message(m.clone(), "tool_calls"),
            None => Reply::Message(
                json!({"role": "assistant", "content": format!("ACK_{text}")}),
                "stop",
            ),
        }
    }
}

fn terminal(id: &str, command: &str) -> Value {
    tool_call(id, "terminal", json!({"command": command}))
}

fn rm(dir: &Path) -> String {
    format!("rm -rf -- {}", dir.display())
}

fn victim(home: &Home, name: &str) -> PathBuf {
    let p = home.path.join(name);
    std::fs::create_dir_all(p.join("inside")).expect("victim dir");
    p
}

/// A connection of the test's own holding the database's write lock, until it rolls back.
fn hold_write_lock(home: &Home) -> diesel::SqliteConnection {
    use diesel::connection::SimpleConnection;
    use diesel::Connection;
    let mut holder =
        diesel::SqliteConnection::establish(&home.path.join("state.db").to_string_lossy())
            .expect("open");
    holder.batch_execute("BEGIN IMMEDIATE").expect("write lock");
    holder
}

/// A home whose model answers `RM` with a terminal call removing the directory `v` in it.
fn rm_home() -> (Home, PathBuf, FakeModel) {
    let home = Home::new();
    let v = victim(&home, "victim");
    let model = scripted(vec![("RM", terminal("call_rm", &rm(&v)))]);
    home.write_config(&config(&model.url, json!({})));
    (home, v, model)
}

/// A daemon whose model answers `RM` with a terminal call removing the directory `v`, and a
/// session (`request_id`) that has submitted `RM` and is parked on its approval `p`.
struct ParkedOnRm {
    home: Home,
    v: PathBuf,
    model: FakeModel,
    d: Daemon,
    ws: Ws,
    sid: String,
    p: Value,
}

async fn parked_on_rm(request_id: &str) -> ParkedOnRm {
    let (home, v, model) = rm_home();
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.session(request_id, &home.path).await;
    ws.submit(&sid, "RM", "RM").await;
    let p = ws.wait_prompt(&sid, "approval").await;
    ParkedOnRm {
        home,
        v,
        model,
        d,
        ws,
        sid,
        p,
    }
}

/// `RM`'s turn carried on to its final answer without running its command, and the model was
/// told the command was blocked, and `why`: the tool result it was given.
async fn assert_blocked(home: &Home, model: &FakeModel, v: &Path, why: &str) -> Value {
    let row = settled(home, "RM").await;
    assert_eq!(
        row.outcome.as_deref(),
        Some("completed"),
        "the loop carries on to a final answer"
    );
    assert!(v.exists(), "a blocked command ran");
    let result = tool_result(model, "RM");
    let error = result["error"].as_str().unwrap_or("");
    assert!(
        error.starts_with("BLOCKED:") && error.contains(why),
        "{result}"
    );
    result
}

/// The tool result the model was given for the turn of user text `text` (the last one).
fn tool_result(model: &FakeModel, text: &str) -> Value {
    let reqs = model.requests();
    let body = reqs
        .iter()
        .rev()
        .find(|b| last_user(b) == text && after_tool(b))
        .expect("a request after the tool");
    let content = last_tool_result(body).expect("tool content");
    serde_json::from_str(&content).unwrap_or(Value::String(content))
}

fn requests_after_tool(model: &FakeModel, text: &str) -> usize {
    model
        .requests()
        .iter()
        .filter(|b| last_user(b) == text && after_tool(b))
        .count()
}

/// Is process `pid` running (a zombie is not)?
fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit(')')
                .next()
                .and_then(|rest| rest.split_whitespace().next())
                .map(|st| st != "Z")
        })
        .unwrap_or(false)
}

/// Is a process of group `pgid` running (zombies are not)?
fn group_alive(pgid: i32) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return false;
    };
    entries.flatten().any(|e| {
        std::fs::read_to_string(e.path().join("stat"))
            .ok()
            .and_then(|s| {
                let mut fields = s.rsplit_once(')')?.1.split_whitespace();
                let state = fields.next()?;
                let group = fields.nth(1)?.parse::<i32>().ok()?;
                Some(state != "Z" && group == pgid)
            })
            .unwrap_or(false)
    })
}

async fn settled(home: &Home, input_id: &str) -> gatehouse::store::admissions::AdmissionRow {
    wait_until(&format!("{input_id} settled"), T, || {
        home.admission(input_id).status == "terminal"
    })
    .await;
    home.admission(input_id)
}

async fn respond(ws: &mut Ws, sid: &str, prompt: &Value, choice: &str) -> Value {
    ws.ok(
        "approval.respond",
        json!({"session_id": sid, "execution_generation": prompt["execution_generation"], "prompt_id": prompt["prompt_id"], "choice": choice}),
    )
    .await
}

async fn answer(ws: &mut Ws, sid: &str, prompt: &Value, text: &str) -> Value {
    ws.ok(
        "clarify.respond",
        json!({"session_id": sid, "execution_generation": prompt["execution_generation"], "prompt_id": prompt["prompt_id"], "answer": text}),
    )
    .await
}

#[actix_rt::test]
async fn two_tool_calls_in_one_response_run_in_order_before_the_next_request() {
    let two = tool_calls(&[
        ("call_one", "terminal", json!({"command": "echo one"})),
        ("call_two", "terminal", json!({"command": "echo two"})),
    ]);
    let model = scripted(vec![("TWO", two)]);
    let (home, _d, mut ws, sid) = submitted(&model, "two", "TWO").await;
    let row = settled(&home, "TWO").await;
    assert_eq!(row.outcome.as_deref(), Some("completed"));
    let reqs = model.requests();
    assert_eq!(
        reqs.len(),
        2,
        "one request for the calls, one with both results"
    );
    let msgs = reqs[1]["messages"].as_array().expect("messages");
    let n = msgs.len();
    assert_eq!(msgs[n - 3]["role"], "assistant");
    let ids: Vec<&str> = msgs[n - 3]["tool_calls"]
        .as_array()
        .expect("calls")
        .iter()
        .filter_map(|c| c["id"].as_str())
        .collect();
    assert_eq!(ids, ["call_one", "call_two"]);
    assert_eq!(
        (
            msgs[n - 2]["role"].as_str(),
            msgs[n - 2]["tool_call_id"].as_str()
        ),
        (Some("tool"), Some("call_one"))
    );
    assert_eq!(
        (
            msgs[n - 1]["role"].as_str(),
            msgs[n - 1]["tool_call_id"].as_str()
        ),
        (Some("tool"), Some("call_two"))
    );
    let out = |m: &Value| -> Value {
        serde_json::from_str(m["content"].as_str().unwrap_or("")).unwrap_or(Value::Null)
    };
    assert_eq!(
        (
            out(&msgs[n - 2])["output"].as_str(),
            out(&msgs[n - 2])["exit_code"].as_i64()
        ),
        (Some("one"), Some(0))
    );
    assert_eq!(
        (
            out(&msgs[n - 1])["output"].as_str(),
            out(&msgs[n - 1])["exit_code"].as_i64()
        ),
        (Some("two"), Some(0))
    );
    // Run in order: the first call completes before the second starts.
    let mut seqs = Vec::new();
    for (kind, id) in [
        ("tool.start", "call_one"),
        ("tool.complete", "call_one"),
        ("tool.start", "call_two"),
        ("tool.complete", "call_two"),
    ] {
        let e = ws
            .event(T, |e| {
                e["type"] == kind && e["payload"]["tool_call_id"] == id
            })
            .await;
        seqs.push(e["seq"].as_u64().expect("seq"));
    }
    assert!(
        seqs.windows(2).all(|w| w[0] < w[1]),
        "tool events out of order: {seqs:?}"
    );
    let roles: Vec<(String, Option<String>)> = home
        .transcript(&sid)
        .iter()
        .map(|m| (m.role.clone(), m.tool_call_id.clone()))
        .collect();
    assert_eq!(
        roles,
        vec![
            ("user".into(), None),
            ("assistant".into(), None),
            ("tool".into(), Some("call_one".into())),
            ("tool".into(), Some("call_two".into())),
            ("assistant".into(), None),
        ]
    );
    let r = ws
        .ok(
            "prompt.receipt",
            json!({"session_id": sid, "admission_id": row.admission_id}),
        )
        .await;
    assert_eq!(r["result"]["final_response"], "DONE_TWO");
}

#[actix_rt::test]
async fn streamed_tool_call_fragments_are_concatenated_by_index() {
    let parts = ["{\"comm", "and\": \"echo frag", "mented-", "arguments\"}"];
    let whole: String = parts.concat();
    let model = FakeModel::start(move |body| {
        if after_tool(body) {
            return Reply::Message(json!({"role": "assistant", "content": "DONE"}), "stop");
        }
        let mut events = vec![json!({"choices": [{"index": 0, "delta": {"role": "assistant", "tool_calls": [
            {"index": 0, "id": "call_frag", "type": "function", "function": {"name": "terminal", "arguments": ""}}]}}]})
        .to_string()];
        for p in parts {
            events.push(
                json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": p}}]}}]})
                    .to_string(),
            );
        }
        events.push(
            json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
                .to_string(),
        );
        Reply::Sse(events)
    });
    let (home, _d, _ws, _sid) = submitted(&model, "frag", "FRAG").await;
    assert_eq!(
        settled(&home, "FRAG").await.outcome.as_deref(),
        Some("completed")
    );
    let reqs = model.requests();
    assert_eq!(reqs.len(), 2);
    let msgs = reqs[1]["messages"].as_array().expect("messages");
    let call = &msgs[msgs.len() - 2]["tool_calls"][0];
    assert_eq!(call["id"], "call_frag");
    assert_eq!(call["function"]["name"], "terminal");
    assert_eq!(call["function"]["arguments"].as_str(), Some(whole.as_str()));
    let result = tool_result(&model, "FRAG");
    assert_eq!(result["output"], "fragmented-arguments", "{result}");
    assert_eq!(result["exit_code"], 0);
}

/// A stream's content split over frames is kept whole; a stream that ends (`[DONE]`) without any
/// finish_reason has finished with `stop`; the usage a frame with choices carries counts toward
/// the session's totals, for every request of the turn.
#[actix_rt::test]
async fn split_content_a_missing_finish_reason_and_usage_beside_choices() {
    use diesel::prelude::*;
    use gatehouse::store::schema::sessions;
    let model = FakeModel::start(|body| {
        let frame = |delta: Value, finish: Value, usage: Value| {
            let mut f = json!({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
            if !usage.is_null() {
                f["usage"] = usage;
            }
            f.to_string()
        };
        if !after_tool(body) {
            return Reply::Sse(vec![frame(
                json!({"role": "assistant", "tool_calls": tool_call("call_u", "terminal", json!({"command": "echo u"}))["tool_calls"]}),
                json!("tool_calls"),
                json!({"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}),
            )]);
        }
        Reply::Sse(vec![
            frame(
                json!({"role": "assistant", "content": "A"}),
                Value::Null,
                Value::Null,
            ),
            frame(json!({"content": "B"}), Value::Null, Value::Null),
            frame(
                json!({"content": "C"}),
                Value::Null,
                json!({"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}),
            ),
        ])
    });
    let (home, _d, _ws, sid) = submitted(&model, "frames", "FRAMES").await;
    assert_eq!(
        settled(&home, "FRAMES").await.outcome.as_deref(),
        Some("completed")
    );
    let last = home.transcript(&sid).pop().expect("a reply");
    assert_eq!(
        (last.role.as_str(), last.content.as_deref()),
        ("assistant", Some("ABC"))
    );
    assert_eq!(last.finish_reason.as_deref(), Some("stop"));
    let totals: (i64, i64) = sessions::table
        .filter(sessions::id.eq(&sid))
        .select((sessions::prompt_tokens, sessions::completion_tokens))
        .first(&mut home.db())
        .expect("the session's totals");
    assert_eq!(totals, (12, 5), "both requests' usage");
}

#[actix_rt::test]
async fn reasoning_is_streamed_stored_and_sent_back() {
    // Round 1 streams its reasoning in two fragments with a tool call; round 2 answers plainly
    // with reasoning of its own; the next turn's request must carry both back.
    let model = FakeModel::start(|body| {
        if last_user(body) == "AGAIN" {
            // Thinking in the content, as some models do: kept as the reasoning.
            return Reply::Message(
                json!({"role": "assistant", "content": "<think>second thoughts</think>AGAIN_DONE"}),
                "stop",
            );
        }
        if after_tool(body) {
            return Reply::Message(
                json!({"role": "assistant", "content": "DONE", "reasoning_content": "then answer"}),
                "stop",
            );
        }
        let frame = |delta: Value, finish: Value| {
            json!({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}).to_string()
        };
        Reply::Sse(vec![
            frame(
                json!({"role": "assistant", "reasoning_content": "first "}),
                Value::Null,
            ),
            frame(json!({"reasoning": "look"}), Value::Null),
            frame(
                json!({"tool_calls": tool_call("call_r", "terminal", json!({"command": "echo r"}))["tool_calls"]}),
                json!("tool_calls"),
            ),
        ])
    });
    let (home, _d, mut ws, sid) = submitted(&model, "reason", "THINK").await;
    let delta = ws
        .event(Duration::from_secs(20), |e| {
            e["type"] == "message.delta" && e["payload"]["reasoning"].is_string()
        })
        .await;
    assert_eq!(delta["payload"]["reasoning"], "first ");
    assert_eq!(
        settled(&home, "THINK").await.outcome.as_deref(),
        Some("completed")
    );
    let kept: Vec<(String, Option<String>)> = home
        .transcript(&sid)
        .into_iter()
        .filter(|m| m.role == "assistant")
        .map(|m| (m.content.unwrap_or_default(), m.reasoning))
        .collect();
    assert_eq!(
        kept,
        [
            (String::new(), Some("first look".to_string())),
            ("DONE".to_string(), Some("then answer".to_string())),
        ]
    );
    ws.submit(&sid, "AGAIN", "AGAIN").await;
    assert_eq!(
        settled(&home, "AGAIN").await.outcome.as_deref(),
        Some("completed")
    );
    let reqs = model.requests();
    // One field of each assistant message in a list of messages.
    let of_assistants = |messages: &Value, field: &str| -> Vec<Value> {
        messages
            .as_array()
            .expect("messages")
            .iter()
            .filter(|m| m["role"] == "assistant")
            .map(|m| m[field].clone())
            .collect()
    };
    assert_eq!(
        of_assistants(&reqs[reqs.len() - 1]["messages"], "reasoning_content"),
        [json!("first look"), json!("then answer")]
    );
    let snapshot = ws.ok("session.resume", json!({"session_id": sid})).await;
    assert_eq!(
        of_assistants(&snapshot["messages"], "reasoning"),
        [
            json!("first look"),
            json!("then answer"),
            json!("second thoughts")
        ]
    );
    assert_eq!(
        of_assistants(&snapshot["messages"], "content").last(),
        Some(&json!("AGAIN_DONE"))
    );
}

/// A command sees the daemon's environment without what is the daemon's alone: the gateway's
/// own variables, and what systemd hands the service (its credentials directory, watchdog and
/// passed sockets).
#[actix_rt::test]
async fn a_command_does_not_see_the_daemons_own_variables() {
    let home = Home::new();
    let model = scripted(vec![("ENV", terminal("call_env", "env"))]);
    home.write_config(&config(&model.url, json!({})));
    let d = Daemon::start_with_env(
        &home,
        &[
            (
                "CREDENTIALS_DIRECTORY",
                "/run/credentials/gatehouse.service",
            ),
            ("LISTEN_FDNAMES", "api"),
            ("GATEHOUSE_PROBE", "1"),
            ("KEPT_FOR_COMMANDS", "yes"),
        ],
    );
    let mut ws = d.ws().await;
    let sid = ws.session("env", &home.path).await;
    ws.submit(&sid, "ENV", "ENV").await;
    settled(&home, "ENV").await;
    let result = tool_result(&model, "ENV").to_string();
    assert!(result.contains("KEPT_FOR_COMMANDS=yes"), "{result}");
    for name in ["CREDENTIALS_DIRECTORY", "LISTEN_FDNAMES", "GATEHOUSE_PROBE"] {
        assert!(
            !result.contains(name),
            "{name} reached the command: {result}"
        );
    }
}

/// The approval prompt shows the command with its secrets masked (it reaches the event log,
/// every follower and each snapshot); the command that runs once approved is the one the model
/// sent, secret and all.
#[actix_rt::test]
async fn an_approval_prompt_masks_the_secrets_of_its_command() {
    let home = Home::new();
    let v = victim(&home, "victim");
    let secret = "ghp_0123456789abcdefghijklmnopqrstuvwxyzAB";
    let kept = home.path.join("kept");
    let command = format!("echo {secret} > {} && {}", kept.display(), rm(&v));
    let model = scripted(vec![("RM", terminal("call_rm", &command))]);
    home.write_config(&config(&model.url, json!({})));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.session("masked", &home.path).await;
    ws.submit(&sid, "RM", "RM").await;
    let p = ws.wait_prompt(&sid, "approval").await;
    let shown = p["command"].as_str().expect("command");
    assert!(!shown.contains(secret), "{shown}");
    assert!(shown.contains("ghp_") && shown.contains(&rm(&v)), "{shown}");
    let snapshot = ws.ok("session.resume", json!({"session_id": sid})).await;
    let prompts = snapshot["prompts"].to_string();
    assert!(
        prompts.contains("ghp_") && !prompts.contains(secret),
        "{prompts}"
    );
    // So is the call's `tool.start` (the transcript keeps the model's call as it made it).
    let start = ws.event(T, |e| e["type"] == "tool.start").await;
    let args = start["payload"]["arguments"].to_string();
    assert!(args.contains("ghp_") && !args.contains(secret), "{args}");
    respond(&mut ws, &sid, &p, "once").await;
    assert_eq!(
        settled(&home, "RM").await.outcome.as_deref(),
        Some("completed")
    );
    assert!(!v.exists(), "the approved command ran");
    assert_eq!(
        std::fs::read_to_string(&kept).expect("written").trim(),
        secret
    );
}

#[actix_rt::test]
async fn approval_once_runs_the_command_and_does_not_remember_it() {
    let home = Home::new();
    let (v1, v2) = (victim(&home, "victim"), victim(&home, "victim2"));
    let model = scripted(vec![
        ("RM", terminal("call_rm", &rm(&v1))),
        ("RM2", terminal("call_rm2", &rm(&v2))),
    ]);
    home.write_config(&config(&model.url, json!({})));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.session("once", &home.path).await;
    let receipt = ws.submit(&sid, "RM", "RM").await;
    let p = ws.wait_prompt(&sid, "approval").await;
    assert_eq!(p["command"].as_str(), Some(rm(&v1).as_str()));
    assert_eq!(p["description"], "delete in root path");
    assert_eq!(p["choices"], json!(["once", "session", "always", "deny"]));
    assert_eq!(p["admission_id"], receipt["admission_id"]);
    let gen = home
        .admission("RM")
        .execution_generation
        .expect("generation");
    assert_eq!(p["execution_generation"], gen);
    let req = ws.event(T, |e| e["type"] == "approval.request").await;
    assert_eq!(req["payload"]["prompt_id"], p["prompt_id"]);
    assert!(v1.exists(), "nothing runs before the answer");
    assert_eq!(model.requests().len(), 1, "no model request while parked");
    assert_eq!(home.admission("RM").status, "started");
    let r = respond(&mut ws, &sid, &p, "once").await;
    assert_eq!(
        r,
        json!({"status": "resolved", "prompt_id": p["prompt_id"]})
    );
    let row = settled(&home, "RM").await;
    assert_eq!(row.outcome.as_deref(), Some("completed"));
    assert!(!v1.exists(), "the approved command ran");
    assert_eq!(tool_result(&model, "RM")["exit_code"], 0);
    let s = ws.event(T, |e| e["type"] == "approval.settled").await;
    assert_eq!(s["payload"]["resolution"], "choice:once");
    // The log tells it in the order it happened: the call, its prompt, the answer, its end.
    let log = gatehouse::store::events::since(&mut home.db(), &sid, 0, 10_000).expect("events");
    let order: Vec<&str> = log
        .events
        .iter()
        .map(|e| e.kind.as_str())
        .filter(|k| k.starts_with("tool.") || k.starts_with("approval."))
        .collect();
    assert_eq!(
        order,
        [
            "tool.start",
            "approval.request",
            "approval.settled",
            "tool.complete"
        ]
    );
    // `once` is not remembered: the same pattern prompts again.
    ws.submit(&sid, "RM2", "RM2").await;
    let p2 = ws.wait_prompt(&sid, "approval").await;
    assert_ne!(p2["prompt_id"], p["prompt_id"]);
    assert!(v2.exists());
    respond(&mut ws, &sid, &p2, "deny").await;
    settled(&home, "RM2").await;
    assert!(v2.exists());
    let audit: Vec<Option<String>> = home
        .prompt_rows(&sid)
        .into_iter()
        .map(|r| r.resolution)
        .collect();
    assert_eq!(
        audit,
        vec![
            Some("choice:once".to_string()),
            Some("choice:deny".to_string())
        ]
    );
}

#[actix_rt::test]
async fn approval_deny_blocks_the_command_and_tells_the_model() {
    let ParkedOnRm {
        home,
        v,
        model,
        d: _d,
        mut ws,
        sid,
        p,
    } = parked_on_rm("deny").await;
    assert_eq!(
        respond(&mut ws, &sid, &p, "deny").await["status"],
        "resolved"
    );
    let result = assert_blocked(&home, &model, &v, "denied").await;
    assert_eq!(
        (result["exit_code"].as_i64(), result["status"].as_str()),
        (Some(-1), Some("blocked"))
    );
    assert_eq!(model.reached("RM"), 1);
    assert_eq!(requests_after_tool(&model, "RM"), 1);
}

/// The attempt records an answer, fenced in the store, before it acts on it. An answer the
/// store cannot record (another process holds the database's write lock) is refused
/// `storage_unavailable` and not acted on; the prompt stays open, and the same answer given
/// again once the store takes writes is taken. The answer used to be acted on at once, with only
/// its audit written after.
#[actix_rt::test]
async fn an_answer_the_store_cannot_record_is_refused_and_can_be_given_again() {
    use diesel::connection::SimpleConnection;
    let ParkedOnRm {
        home,
        v,
        model,
        d: _d,
        mut ws,
        sid,
        p,
    } = parked_on_rm("unrecorded").await;
    let mut holder = hold_write_lock(&home);
    let params = json!({"session_id": sid, "execution_generation": p["execution_generation"],
                        "prompt_id": p["prompt_id"], "choice": "once"});
    ws.refused("approval.respond", params.clone(), "storage_unavailable")
        .await;
    assert!(v.exists(), "an unrecorded approval ran the command");
    holder.batch_execute("ROLLBACK").expect("release");
    let snapshot = ws.ok("session.resume", json!({"session_id": sid})).await;
    assert_eq!(
        snapshot["prompts"][0]["prompt_id"], p["prompt_id"],
        "the prompt is still open: {snapshot}"
    );
    assert!(v.exists(), "an unrecorded approval ran the command");
    assert_eq!(
        ws.ok("approval.respond", params).await["status"],
        "resolved"
    );
    let row = settled(&home, "RM").await;
    assert_eq!(row.outcome.as_deref(), Some("completed"));
    assert!(!v.exists(), "the recorded approval ran the command");
    assert_eq!(tool_result(&model, "RM")["exit_code"], 0);
    let audit: Vec<(Option<String>, Option<String>)> = home
        .prompt_rows(&sid)
        .into_iter()
        .map(|r| (r.resolution, r.resolved_by))
        .collect();
    assert_eq!(audit.len(), 1, "{audit:?}");
    assert_eq!(audit[0].0.as_deref(), Some("choice:once"));
}

/// An interrupt sent right behind an answer, on the same connection, reaches the turn at once:
/// it used to wait until the answer was answered, and the answer waits for the turn to record
/// it (here until another process lets go of the database's write lock). The interrupt wins:
/// the command never runs, the turn ends interrupted, and neither the answerer nor the audit is
/// told the answer was taken (the answer, recorded once the lock went, had been said `resolved`
/// and audited `choice:once`).
#[actix_rt::test]
async fn an_interrupt_behind_an_answer_being_recorded_is_not_held_by_it() {
    use diesel::connection::SimpleConnection;
    let ParkedOnRm {
        home,
        v,
        model: _model,
        d: _d,
        mut ws,
        sid,
        p,
    } = parked_on_rm("held").await;
    let mut holder = hold_write_lock(&home);
    let generation = p["execution_generation"].clone();
    ws.send_raw(
        json!({"jsonrpc": "2.0", "id": "answer", "method": "approval.respond",
               "params": {"session_id": sid, "execution_generation": generation,
                          "prompt_id": p["prompt_id"], "choice": "once"}})
        .to_string(),
    )
    .await;
    ws.send_raw(
        json!({"jsonrpc": "2.0", "id": "stop", "method": "session.interrupt",
               "params": {"session_id": sid, "execution_generation": generation}})
        .to_string(),
    )
    .await;
    let first = ws.recv_reply().await;
    assert_eq!(
        first["id"], "stop",
        "the interrupt waited for the answer: {first}"
    );
    assert_eq!(first["result"]["interrupted"], true, "{first}");
    holder.batch_execute("ROLLBACK").expect("release");
    let second = ws.recv_reply().await;
    assert_eq!(second["id"], "answer", "{second}");
    // The answer is not said to be taken: the attempt it was for stopped before acting on it.
    assert_eq!(
        second["error"]["data"]["reason"], "stale_generation",
        "{second}"
    );
    let row = settled(&home, "RM").await;
    assert_eq!(row.outcome.as_deref(), Some("interrupted"), "{row:?}");
    assert!(v.exists(), "an interrupted turn ran the command");
    // And the audit says so, not that the command was approved.
    let audit: Vec<Option<String>> = home
        .prompt_rows(&sid)
        .into_iter()
        .map(|r| r.resolution)
        .collect();
    assert_eq!(audit, [Some("interrupted".to_string())]);
}

/// A prompt is recorded open before anyone is asked: one the store cannot record is never
/// shown, and its command does not run (the model is told why). It used to be shown from
/// memory, and its answer refused `stale_generation` with the turn ended `interrupted`.
#[actix_rt::test]
async fn an_approval_request_the_store_cannot_record_is_not_asked_and_blocks_the_command() {
    use diesel::connection::SimpleConnection;
    use diesel::{Connection, SqliteConnection};
    let (home, v, model) = rm_home();
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.session("unasked", &home.path).await;
    let mut other =
        SqliteConnection::establish(&home.path.join("state.db").to_string_lossy()).expect("open");
    other
        .batch_execute(
            "CREATE TRIGGER no_prompts BEFORE INSERT ON prompts BEGIN SELECT RAISE(ABORT, 'no'); END",
        )
        .expect("trigger");
    ws.submit(&sid, "RM", "RM").await;
    assert_blocked(&home, &model, &v, "could not be recorded").await;
    assert!(home.prompt_rows(&sid).is_empty());
    let snapshot = ws.ok("session.resume", json!({"session_id": sid})).await;
    assert_eq!(snapshot["prompts"], json!([]), "{snapshot}");
}

#[actix_rt::test]
async fn approval_session_remembers_the_pattern_for_that_session_only() {
    let home = Home::new();
    let (v1, v2, v3) = (
        victim(&home, "victim1"),
        victim(&home, "victim2"),
        victim(&home, "victim3"),
    );
    let model = scripted(vec![
        ("FIRST", terminal("call_1", &rm(&v1))),
        ("SECOND", terminal("call_2", &rm(&v2))),
        ("OTHER", terminal("call_3", &rm(&v3))),
    ]);
    home.write_config(&config(&model.url, json!({})));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.session("sess", &home.path).await;
    ws.submit(&sid, "FIRST", "FIRST").await;
    let p = ws.wait_prompt(&sid, "approval").await;
    respond(&mut ws, &sid, &p, "session").await;
    settled(&home, "FIRST").await;
    assert!(!v1.exists());
    // The same pattern (delete in root path) again in this session: no prompt, it runs.
    ws.submit(&sid, "SECOND", "SECOND").await;
    let row = settled(&home, "SECOND").await;
    assert_eq!(row.outcome.as_deref(), Some("completed"));
    assert!(!v2.exists(), "the remembered pattern ran without a prompt");
    assert_eq!(
        home.prompt_rows(&sid).len(),
        1,
        "only the first command prompted"
    );
    assert_eq!(tool_result(&model, "SECOND")["exit_code"], 0);
    // Another session still prompts.
    let other = ws.session("sess-other", &home.path).await;
    ws.submit(&other, "OTHER", "OTHER").await;
    let p3 = ws.wait_prompt(&other, "approval").await;
    assert!(v3.exists());
    respond(&mut ws, &other, &p3, "deny").await;
    settled(&home, "OTHER").await;
    assert!(v3.exists());
}

/// A session approval of an interpreter's inline code covers that code, not any code: the same
/// one-liner runs unasked, another is asked about (it ran unasked: any code, once one was
/// approved).
#[actix_rt::test]
async fn a_session_approval_of_inline_code_covers_that_code_only() {
    let home = Home::new();
    let touch = |name: &str| {
        format!(
            "python3 -c \"import pathlib; pathlib.Path('{}').touch()\"",
            home.path.join(name).display()
        )
    };
    let model = scripted(vec![
        ("FIRST", terminal("call_1", &touch("one"))),
        ("AGAIN", terminal("call_2", &touch("one"))),
        ("OTHER", terminal("call_3", &touch("two"))),
    ]);
    home.write_config(&config(&model.url, json!({})));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.session("inline", &home.path).await;
    ws.submit(&sid, "FIRST", "FIRST").await;
    let p = ws.wait_prompt(&sid, "approval").await;
    assert_eq!(p["pattern_key"], "script_dash_e");
    respond(&mut ws, &sid, &p, "session").await;
    settled(&home, "FIRST").await;
    assert!(home.path.join("one").exists());
    std::fs::remove_file(home.path.join("one")).expect("remove");
    // The same code again: no prompt, it runs.
    ws.submit(&sid, "AGAIN", "AGAIN").await;
    assert_eq!(
        settled(&home, "AGAIN").await.outcome.as_deref(),
        Some("completed")
    );
    assert!(home.path.join("one").exists(), "the approved code ran");
    assert_eq!(home.prompt_rows(&sid).len(), 1);
    // Other code under the same rule is asked about.
    ws.submit(&sid, "OTHER", "OTHER").await;
    let p3 = ws.wait_prompt(&sid, "approval").await;
    assert_eq!(p3["pattern_key"], "script_dash_e");
    assert!(
        !home.path.join("two").exists(),
        "nothing runs before the answer"
    );
    respond(&mut ws, &sid, &p3, "deny").await;
    settled(&home, "OTHER").await;
    assert!(!home.path.join("two").exists());
}

/// An approval nobody answers denies its command; the turn asks nobody again (its next
/// dangerous call is blocked at once: 64 of them each waited out the timeout).
#[actix_rt::test]
async fn approval_timeout_denies_fail_closed() {
    let home = Home::new();
    let v = victim(&home, "victim");
    let v2 = victim(&home, "victim2");
    let model = scripted(vec![(
        "RM",
        tool_calls(&[
            ("call_rm", "terminal", json!({"command": rm(&v)})),
            ("call_rm2", "terminal", json!({"command": rm(&v2)})),
        ]),
    )]);
    home.write_config(&config(&model.url, json!({"approvals": {"timeout": 2}})));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.session("timeout", &home.path).await;
    ws.submit(&sid, "RM", "RM").await;
    // From its event, which stays in the log: a poll of the open prompts could come after
    // the timeout had closed it.
    let p = ws.event(T, |e| e["type"] == "approval.request").await["payload"].clone();
    // Waiting out the configured two-second approval timeout.
    let row = settled(&home, "RM").await;
    assert_eq!(row.outcome.as_deref(), Some("completed"));
    assert!(v.exists(), "silence is not consent");
    assert!(v2.exists(), "nor for the next call");
    let after = model
        .requests()
        .into_iter()
        .rev()
        .find(|b| last_user(b) == "RM" && after_tool(b))
        .expect("a request after the tools");
    let results: Vec<Value> = after["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| serde_json::from_str(m["content"].as_str().unwrap_or("")).unwrap_or_default())
        .collect();
    assert_eq!(results.len(), 2);
    let error = results[0]["error"].as_str().unwrap_or("");
    assert!(
        error.starts_with("BLOCKED:") && error.contains("timed out"),
        "{results:?}"
    );
    assert_eq!(results[0]["status"], "blocked");
    let unasked = results[1]["error"].as_str().unwrap_or("");
    assert!(unasked.contains("went unanswered"), "{results:?}");
    assert_eq!(results[1]["status"], "blocked");
    let s = ws.event(T, |e| e["type"] == "approval.settled").await;
    assert_eq!(
        (
            s["payload"]["prompt_id"].clone(),
            s["payload"]["resolution"].clone()
        ),
        (p["prompt_id"].clone(), json!("timeout"))
    );
    // A late answer finds nothing to resolve and runs nothing.
    ws.refused(
        "approval.respond",
        json!({"session_id": sid, "execution_generation": p["execution_generation"], "prompt_id": p["prompt_id"], "choice": "once"}),
        "stale_generation",
    )
    .await;
    assert!(v.exists());
    let audit: Vec<Option<String>> = home
        .prompt_rows(&sid)
        .into_iter()
        .map(|r| r.resolution)
        .collect();
    assert_eq!(audit, vec![Some("timeout".to_string())]);
}

#[actix_rt::test]
async fn clarify_answers_reach_the_tool_result() {
    let single = tool_call(
        "call_q",
        "clarify",
        json!({"question": "Pick a color", "choices": ["BLUE", "GREEN"]}),
    );
    let batch = tool_call(
        "call_b",
        "clarify",
        json!({"questions": [{"question": "Pick a color", "choices": ["BLUE", "GREEN"]}]}),
    );
    let many = tool_call(
        "call_m",
        "clarify",
        json!({"questions": [
            {"id": "colors", "question": "Which colors?", "choices": ["RED", "GREEN", "BLUE"], "multi_select": true},
            {"question": "Sure?", "multi_select": true},
            {"id": "colors", "question": "Again?"},
        ]}),
    );
    let model = scripted(vec![("ASK", single), ("BATCH", batch), ("MANY", many)]);
    let (home, _d, mut ws, sid) = submitted(&model, "clarify", "ASK").await;
    let p = ws.wait_prompt(&sid, "clarify").await;
    assert_eq!(p["question"], "Pick a color");
    assert_eq!(p["choices"], json!(["BLUE", "GREEN"]));
    assert_eq!(model.requests().len(), 1, "parked: no model request yet");
    // A label in another case picks the choice as offered; a number picks by position.
    assert_eq!(
        answer(&mut ws, &sid, &p, "blue").await["status"],
        "resolved"
    );
    assert_eq!(
        settled(&home, "ASK").await.outcome.as_deref(),
        Some("completed")
    );
    let result = tool_result(&model, "ASK");
    assert_eq!(
        result,
        json!({"question": "Pick a color", "choices_offered": ["BLUE", "GREEN"], "user_response": "BLUE"})
    );
    // The log has the call before the question it asks (nothing is awaited between them: the
    // question was written first, a client filing it under the last `tool.start` misfiled it).
    let log = gatehouse::store::events::since(&mut home.db(), &sid, 0, 10_000).expect("events");
    let order: Vec<&str> = log
        .events
        .iter()
        .map(|e| e.kind.as_str())
        .filter(|k| k.starts_with("tool.") || k.starts_with("clarify."))
        .collect();
    assert_eq!(
        order,
        [
            "tool.start",
            "clarify.request",
            "clarify.settled",
            "tool.complete"
        ]
    );
    ws.submit(&sid, "BATCH", "BATCH").await;
    let p = ws.wait_prompt(&sid, "clarify").await;
    answer(&mut ws, &sid, &p, "2").await;
    settled(&home, "BATCH").await;
    let result = tool_result(&model, "BATCH");
    assert_eq!(result["responses"][0]["user_response"], "GREEN", "{result}");
    assert!(result.get("timed_out").is_none());
    // Several picked where the model asks for it, and a question keeps the id it was given.
    ws.submit(&sid, "MANY", "MANY").await;
    let p = ws.wait_prompt(&sid, "clarify").await;
    assert_eq!(p["multi_select"], true, "{p}");
    assert_eq!(p["questions"][0]["id"], "colors", "{p}");
    answer(&mut ws, &sid, &p, r#"["1,3", "yes", "no"]"#).await;
    settled(&home, "MANY").await;
    let result = tool_result(&model, "MANY");
    assert_eq!(
        result["responses"],
        json!([
            {"id": "colors", "question": "Which colors?", "choices_offered": ["RED", "GREEN", "BLUE"],
             "user_response": ["RED", "BLUE"]},
            {"id": "q1", "question": "Sure?", "choices_offered": [], "user_response": "yes"},
            // An id given twice is the first's: the second is told apart.
            {"id": "q2", "question": "Again?", "choices_offered": [], "user_response": "no"},
        ]),
        "{result}"
    );
}

/// An answer sent as soon as its prompt's request is in the log (read with
/// `session.events.since`, which may be before the attempt has handed the prompt to its
/// session) is taken. Before, such an answer was told `already_resolved` and lost: the prompt
/// then waited out its time and the tool was told nobody answered.
#[actix_rt::test]
async fn an_answer_read_off_the_log_at_once_is_taken() {
    const ROUNDS: usize = 40;
    let ask = tool_call("call_q", "clarify", json!({"question": "Now?"}));
    let model = scripted(vec![("ASK", ask)]);
    let (home, d) = Daemon::with_model(&model, json!({}));
    let mut ws = d.ws().await;
    let sid = ws.session("log-reader", &home.path).await;
    let mut reader = d.ws().await;
    reader
        .ok("session.resume", json!({"session_id": sid}))
        .await;
    let mut after = 0;
    for round in 0..ROUNDS {
        let id = format!("ASK-{round}");
        ws.submit(&sid, &id, "ASK").await;
        let deadline = Instant::now() + T;
        let prompt = loop {
            assert!(
                Instant::now() < deadline,
                "round {round}: no clarify.request"
            );
            let events = reader.events_after(&sid, after).await;
            if let Some(last) = events.last().and_then(|e| e["seq"].as_i64()) {
                after = last;
            }
            if let Some(req) = events.iter().find(|e| e["type"] == "clarify.request") {
                break req["payload"].clone();
            }
        };
        let r = answer(&mut reader, &sid, &prompt, "yes").await;
        assert_eq!(r["status"], "resolved", "round {round}: {r}");
        let row = settled(&home, &id).await;
        assert_eq!(row.outcome.as_deref(), Some("completed"), "round {round}");
        let result = tool_result(&model, "ASK");
        assert_eq!(result["user_response"], "yes", "round {round}: {result}");
    }
}

/// An answer longer than `session.max_text_bytes` is refused `payload_too_large`, as an input
/// that long is, and the prompt stays open for one that fits. Before, it was taken whole: kept
/// in the transcript and sent with every later model request. An answer for another attempt is
/// stale, whatever its length.
#[actix_rt::test]
async fn a_clarify_answer_over_the_text_bound_is_refused() {
    let ask = tool_call("call_q", "clarify", json!({"question": "Why?"}));
    let model = scripted(vec![("ASK", ask)]);
    let (home, d) = Daemon::with_model(&model, json!({"session": {"max_text_bytes": 1024}}));
    let mut ws = d.ws().await;
    let sid = ws.session("clarify-bound", &home.path).await;
    ws.submit(&sid, "ASK", "ASK").await;
    let p = ws.wait_prompt(&sid, "clarify").await;
    let params = |text: String| {
        json!({"session_id": sid, "execution_generation": p["execution_generation"],
               "prompt_id": p["prompt_id"], "answer": text})
    };
    let refused = ws
        .refused(
            "clarify.respond",
            params("x".repeat(1025)),
            "payload_too_large",
        )
        .await;
    assert!(refused.to_string().contains("1024"), "{refused}");
    // For another attempt, however long, it is stale.
    let mut stale = params("x".repeat(1025));
    stale["execution_generation"] = json!(p["execution_generation"].as_i64().unwrap_or(0) + 1);
    ws.refused("clarify.respond", stale, "stale_generation")
        .await;
    assert_eq!(home.admission("ASK").status, "started", "still waiting");
    assert_eq!(
        ws.ok("clarify.respond", params("y".repeat(1024))).await["status"],
        "resolved"
    );
    settled(&home, "ASK").await;
    let result = tool_result(&model, "ASK");
    assert_eq!(result["user_response"], "y".repeat(1024), "{result}");
}

#[actix_rt::test]
async fn clarify_skip_is_an_empty_answer() {
    let model = scripted(vec![(
        "ASK",
        tool_call("call_q", "clarify", json!({"question": "Anything else?"})),
    )]);
    let (home, _d, mut ws, sid) = submitted(&model, "skip", "ASK").await;
    let p = ws.wait_prompt(&sid, "clarify").await;
    assert_eq!(answer(&mut ws, &sid, &p, "").await["status"], "resolved");
    assert_eq!(
        settled(&home, "ASK").await.outcome.as_deref(),
        Some("completed")
    );
    let result = tool_result(&model, "ASK");
    assert_eq!(result["user_response"], "", "{result}");
    let s = ws.event(T, |e| e["type"] == "clarify.settled").await;
    assert_eq!(s["payload"]["resolution"], "skipped");
}

#[actix_rt::test]
async fn clarify_timeout_gives_the_sentinel_and_the_turn_continues() {
    let single = tool_call(
        "call_q",
        "clarify",
        json!({"question": "Pick a color", "choices": ["BLUE", "GREEN"]}),
    );
    let batch = tool_call(
        "call_b",
        "clarify",
        json!({"questions": [{"question": "Pick a size"}]}),
    );
    let model = scripted(vec![("ASK", single), ("BATCH", batch)]);
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({"agent": {"clarify_timeout": 2}}),
    ));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.session("clarify-timeout", &home.path).await;
    ws.submit(&sid, "ASK", "ASK").await;
    ws.submit(&sid, "BATCH", "BATCH").await;
    // Waiting out the configured two-second clarify timeout, twice.
    wait_until("both turns", T, || all_terminal(&home)).await;
    assert_eq!(home.admission("ASK").outcome.as_deref(), Some("completed"));
    assert_eq!(
        home.admission("BATCH").outcome.as_deref(),
        Some("completed")
    );
    let result = tool_result(&model, "ASK");
    assert_eq!(
        result["user_response"],
        "The user did not provide a response within the time limit. Use your best judgement to make the choice and proceed."
    );
    let result = tool_result(&model, "BATCH");
    assert_eq!(result["timed_out"], true, "{result}");
    assert_eq!(result["responses"][0]["user_response"], "");
    let audit: Vec<Option<String>> = home
        .prompt_rows(&sid)
        .into_iter()
        .map(|r| r.resolution)
        .collect();
    assert_eq!(
        audit,
        vec![Some("timeout".to_string()), Some("timeout".to_string())]
    );
}

#[actix_rt::test]
async fn prompt_answers_are_fenced_by_the_running_generation() {
    let home = Home::new();
    let v = victim(&home, "victim");
    let model = scripted(vec![
        ("RM", terminal("call_rm", &rm(&v))),
        (
            "LATER",
            tool_call("call_q", "clarify", json!({"question": "Still there?"})),
        ),
    ]);
    home.write_config(&config(&model.url, json!({})));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.session("stale", &home.path).await;
    ws.submit(&sid, "RM", "RM").await;
    let p = ws.wait_prompt(&sid, "approval").await;
    let gen = p["execution_generation"].as_i64().expect("generation");
    let with = |gen: Value, prompt: Value, choice: &str| json!({"session_id": sid, "execution_generation": gen, "prompt_id": prompt, "choice": choice});
    ws.refused(
        "approval.respond",
        with(json!(gen + 1), p["prompt_id"].clone(), "once"),
        "stale_generation",
    )
    .await;
    ws.refused(
        "approval.respond",
        with(json!(gen - 1), p["prompt_id"].clone(), "once"),
        "stale_generation",
    )
    .await;
    // The generation is checked first: an answer for another attempt is stale even when it
    // names no prompt; for the running one an empty prompt id is invalid.
    ws.refused(
        "approval.respond",
        with(json!(gen + 1), json!(""), "once"),
        "stale_generation",
    )
    .await;
    ws.refused(
        "approval.respond",
        with(json!(gen), json!(""), "once"),
        "invalid_params",
    )
    .await;
    let r = ws
        .ok(
            "approval.respond",
            with(json!(gen), json!("no-such-prompt"), "once"),
        )
        .await;
    assert_eq!(
        r,
        json!({"status": "already_resolved", "prompt_id": "no-such-prompt"})
    );
    ws.refused(
        "approval.respond",
        with(json!(gen), p["prompt_id"].clone(), "maybe"),
        "invalid_params",
    )
    .await;
    ws.refused(
        "clarify.respond",
        json!({"session_id": sid, "execution_generation": gen, "prompt_id": p["prompt_id"], "answer": "yes"}),
        "invalid_params",
    )
    .await;
    // None of that ran anything, and the prompt is still open.
    assert!(v.exists());
    assert_eq!(
        ws.wait_prompt(&sid, "approval").await["prompt_id"],
        p["prompt_id"]
    );
    assert_eq!(home.admission("RM").status, "started");
    // End the attempt without answering; the FIFO moves on to a later input that parks too.
    ws.submit(&sid, "LATER", "LATER").await;
    assert_eq!(
        ws.ok(
            "session.interrupt",
            json!({"session_id": sid, "execution_generation": gen})
        )
        .await["interrupted"],
        true
    );
    assert_eq!(
        settled(&home, "RM").await.outcome.as_deref(),
        Some("interrupted")
    );
    // The log says how the parked tool ended, before the attempt's `message.complete`.
    let log = gatehouse::store::events::since(&mut home.db(), &sid, 0, 10_000).expect("events");
    let at = |kind: &str| {
        log.events
            .iter()
            .position(|e| e.kind == kind && e.payload()["tool_call_id"] == "call_rm")
    };
    let (start, complete) = (at("tool.start"), at("tool.complete"));
    let finished = log.events.iter().position(|e| {
        e.kind == "message.complete" && e.payload()["admission_id"] == p["admission_id"]
    });
    assert!(start.is_some() && finished.is_some(), "{:?}", log.events);
    assert!(
        complete.is_some_and(|c| start < Some(c) && Some(c) < finished),
        "{:?}",
        log.events
    );
    let ended = log.events[complete.unwrap_or_default()].payload();
    assert_eq!(ended["interrupted"], true, "{ended}");
    let later = ws.wait_prompt(&sid, "clarify").await;
    let later_gen = later["execution_generation"].as_i64().expect("generation");
    assert_eq!(later_gen, gen + 1);
    // The interrupted attempt's prompt is no longer counted open (it was, for good).
    assert_eq!(metric(&d.origin(), "gatehouse_prompts_open").await, 1.0);
    let snap = ws.ok("session.resume", json!({"session_id": sid})).await;
    assert_eq!(
        snap["prompts"].as_array().map(Vec::len),
        Some(1),
        "the old prompt is gone: {snap}"
    );
    ws.refused(
        "approval.respond",
        with(json!(gen), p["prompt_id"].clone(), "once"),
        "stale_generation",
    )
    .await;
    // Under the new generation the old prompt id names nothing.
    let r = ws
        .ok(
            "approval.respond",
            with(json!(later_gen), p["prompt_id"].clone(), "once"),
        )
        .await;
    assert_eq!(r["status"], "already_resolved");
    answer(&mut ws, &sid, &later, "yes").await;
    assert_eq!(
        settled(&home, "LATER").await.outcome.as_deref(),
        Some("completed")
    );
    // After the turn ended and nothing runs, the old prompt is still stale.
    ws.refused(
        "approval.respond",
        with(json!(gen), p["prompt_id"].clone(), "once"),
        "stale_generation",
    )
    .await;
    assert!(v.exists(), "the gated command never ran");
    assert_eq!(requests_after_tool(&model, "RM"), 0);
}

#[actix_rt::test]
async fn a_parked_session_does_not_hold_up_other_sessions() {
    let (home, v, model) = rm_home();
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let parked = ws.session("parked", &home.path).await;
    let busy = ws.session("busy", &home.path).await;
    ws.submit(&parked, "RM", "RM").await;
    let p = ws.wait_prompt(&parked, "approval").await;
    let names: Vec<String> = (0..4).map(|i| format!("B{i}")).collect();
    for n in &names {
        ws.submit(&busy, n, n).await;
    }
    wait_until("the other session's turns", T, || {
        names.iter().all(|n| home.admission(n).status == "terminal")
    })
    .await;
    for n in &names {
        assert_eq!(home.admission(n).outcome.as_deref(), Some("completed"));
        assert_eq!(model.reached(n), 1);
    }
    // Still parked, untouched.
    assert_eq!(home.admission("RM").status, "started");
    assert_eq!(
        ws.wait_prompt(&parked, "approval").await["prompt_id"],
        p["prompt_id"]
    );
    assert!(v.exists());
    respond(&mut ws, &parked, &p, "once").await;
    assert_eq!(
        settled(&home, "RM").await.outcome.as_deref(),
        Some("completed")
    );
    assert!(!v.exists());
}

#[actix_rt::test]
async fn only_a_subscribed_connection_may_answer_a_prompt() {
    let ParkedOnRm {
        home,
        v,
        model: _model,
        d,
        mut ws,
        sid,
        p,
    } = parked_on_rm("owner").await;
    let mut stranger = d.ws().await;
    let params = json!({"session_id": sid, "execution_generation": p["execution_generation"], "prompt_id": p["prompt_id"], "choice": "once"});
    stranger
        .refused("approval.respond", params.clone(), "permission_denied")
        .await;
    stranger
        .refused(
            "clarify.respond",
            json!({"session_id": sid, "execution_generation": p["execution_generation"], "prompt_id": p["prompt_id"], "answer": "x"}),
            "permission_denied",
        )
        .await;
    assert!(v.exists());
    assert_eq!(
        ws.wait_prompt(&sid, "approval").await["prompt_id"],
        p["prompt_id"],
        "still open"
    );
    // Once it resumes the session, the same connection may answer.
    stranger
        .ok("session.resume", json!({"session_id": sid}))
        .await;
    assert_eq!(
        stranger.ok("approval.respond", params).await["status"],
        "resolved"
    );
    settled(&home, "RM").await;
    assert!(!v.exists());
}

#[actix_rt::test]
async fn interrupt_kills_a_running_command_and_settles_interrupted() {
    let home = Home::new();
    let pidfile = home.path.join("sleep.pid");
    let command = format!("echo $$ > {}; exec sleep 30", pidfile.display());
    let model = scripted(vec![("SLEEP", terminal("call_sleep", &command))]);
    home.write_config(&config(&model.url, json!({})));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.session("interrupt", &home.path).await;
    ws.submit(&sid, "SLEEP", "SLEEP").await;
    let mut pid = 0i32;
    wait_until("the command to start", T, || {
        pid = std::fs::read_to_string(&pidfile)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0);
        pid > 0
            && std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.starts_with("sleep"))
    })
    .await;
    let gen = home
        .admission("SLEEP")
        .execution_generation
        .expect("generation");
    ws.refused(
        "session.interrupt",
        json!({"session_id": sid, "execution_generation": gen + 1}),
        "stale_generation",
    )
    .await;
    // An interrupt that does not say which attempt it stops is refused: sent late, it would
    // stop whatever turn came next.
    ws.refused(
        "session.interrupt",
        json!({"session_id": sid}),
        "invalid_params",
    )
    .await;
    let asked = Instant::now();
    assert_eq!(
        ws.ok(
            "session.interrupt",
            json!({"session_id": sid, "execution_generation": gen})
        )
        .await["interrupted"],
        true
    );
    let row = settled(&home, "SLEEP").await;
    assert!(
        asked.elapsed() < Duration::from_secs(10),
        "settled in {:?}",
        asked.elapsed()
    );
    assert_eq!(row.outcome.as_deref(), Some("interrupted"));
    wait_until("the sleep to be killed", Duration::from_secs(5), || {
        !alive(pid)
    })
    .await;
    assert_eq!(
        requests_after_tool(&model, "SLEEP"),
        0,
        "no model call after an interrupt"
    );
    let done = ws.event(T, |e| e["type"] == "message.complete").await;
    assert_eq!(done["payload"]["status"], "interrupted");
    // The session goes on; the next input is its own user turn.
    ws.submit(&sid, "NEXT", "NEXT").await;
    assert_eq!(
        settled(&home, "NEXT").await.outcome.as_deref(),
        Some("completed")
    );
    let reqs = model.requests();
    let next = reqs
        .iter()
        .find(|b| last_user(b) == "NEXT")
        .expect("NEXT request");
    assert_eq!(
        user_texts(next),
        vec!["SLEEP".to_string(), "NEXT".to_string()]
    );
    // The model is told the command started and was stopped (it may have done part of its
    // work), not that it never ran.
    let result = next["messages"]
        .as_array()
        .and_then(|m| m.iter().find(|m| m["tool_call_id"] == "call_sleep"))
        .and_then(|m| m["content"].as_str())
        .expect("the interrupted call's result");
    let result: Value = serde_json::from_str(result).expect("tool json");
    assert_eq!(result["exit_code"], 130, "{result}");
    assert!(
        result["error"]
            .as_str()
            .is_some_and(|e| e.contains("after it started")),
        "{result}"
    );
}

#[actix_rt::test]
async fn sigterm_while_parked_on_an_approval_never_runs_the_command() {
    let (home, v, model) = rm_home();
    let mut d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.session("term", &home.path).await;
    ws.submit(&sid, "RM", "RM").await;
    ws.wait_prompt(&sid, "approval").await;
    ws.submit(&sid, "AFTER", "AFTER").await;
    assert_eq!(d.term(), Some(0));
    let row = home.admission("RM");
    assert_eq!(
        (row.status.as_str(), row.outcome.as_deref()),
        ("terminal", Some("interrupted"))
    );
    assert!(v.exists(), "the gated command never ran");
    assert_eq!(
        requests_after_tool(&model, "RM"),
        0,
        "no model request after the tool"
    );
    assert_eq!(home.admission("AFTER").status, "queued");
    let audit: Vec<Option<String>> = home
        .prompt_rows(&sid)
        .into_iter()
        .map(|r| r.resolution)
        .collect();
    assert_eq!(audit, vec![Some("shutdown".to_string())]);
    // After the next boot the follower runs by itself; no prompt is open and the old one is gone.
    let d2 = Daemon::start(&home);
    wait_until("the follower", T, || all_terminal(&home)).await;
    assert_eq!(
        home.admission("AFTER").outcome.as_deref(),
        Some("completed")
    );
    let mut ws = d2.ws().await;
    let snap = ws.ok("session.resume", json!({"session_id": sid})).await;
    assert_eq!(snap["prompts"], json!([]));
    assert!(v.exists());
    assert_eq!(requests_after_tool(&model, "RM"), 0);
}

/// `always` is remembered across the principal's sessions, and only its: another API key's
/// session is still asked (it ran unasked there too).
#[actix_rt::test]
async fn approval_always_is_remembered_across_sessions() {
    const STRANGER: &str = "gk_always_stranger";
    let home = Home::new();
    let (v1, v2, v3) = (
        victim(&home, "victim1"),
        victim(&home, "victim2"),
        victim(&home, "victim3"),
    );
    let model = scripted(vec![
        ("FIRST", terminal("call_1", &rm(&v1))),
        ("SECOND", terminal("call_2", &rm(&v2))),
        ("THIRD", terminal("call_3", &rm(&v3))),
    ]);
    home.write_config(&config(
        &model.url,
        json!({"gateway": {"api_keys": [format!("sha256:{}", gatehouse::api::auth::key_digest(STRANGER))]}}),
    ));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let a = ws.session("always-a", &home.path).await;
    let b = ws.session("always-b", &home.path).await;
    ws.submit(&a, "FIRST", "FIRST").await;
    let p = ws.wait_prompt(&a, "approval").await;
    respond(&mut ws, &a, &p, "always").await;
    settled(&home, "FIRST").await;
    assert!(!v1.exists());
    ws.submit(&b, "SECOND", "SECOND").await;
    assert_eq!(
        settled(&home, "SECOND").await.outcome.as_deref(),
        Some("completed")
    );
    assert!(
        !v2.exists(),
        "an `always` pattern runs in another session without a prompt"
    );
    assert!(home.prompt_rows(&b).is_empty());
    let mut stranger = keyed_ws(&d, STRANGER).await;
    let c = stranger.session("always-c", &home.path).await;
    stranger.submit(&c, "THIRD", "THIRD").await;
    let p = stranger.wait_prompt(&c, "approval").await;
    assert!(v3.exists(), "another principal is asked");
    respond(&mut stranger, &c, &p, "deny").await;
    settled(&home, "THIRD").await;
    assert!(v3.exists());
}

#[actix_rt::test]
async fn interrupting_a_parked_prompt_runs_nothing() {
    let home = Home::new();
    let v = victim(&home, "victim");
    let model = scripted(vec![
        ("RM", terminal("call_rm", &rm(&v))),
        (
            "ASK",
            tool_call("call_q", "clarify", json!({"question": "Sure?"})),
        ),
    ]);
    home.write_config(&config(&model.url, json!({})));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.session("int-parked", &home.path).await;
    ws.submit(&sid, "RM", "RM").await;
    let p = ws.wait_prompt(&sid, "approval").await;
    ws.ok(
        "session.interrupt",
        json!({"session_id": sid, "execution_generation": p["execution_generation"]}),
    )
    .await;
    assert_eq!(
        settled(&home, "RM").await.outcome.as_deref(),
        Some("interrupted")
    );
    ws.refused(
        "approval.respond",
        json!({"session_id": sid, "execution_generation": p["execution_generation"], "prompt_id": p["prompt_id"], "choice": "once"}),
        "stale_generation",
    )
    .await;
    ws.submit(&sid, "ASK", "ASK").await;
    let q = ws.wait_prompt(&sid, "clarify").await;
    ws.ok(
        "session.interrupt",
        json!({"session_id": sid, "execution_generation": q["execution_generation"]}),
    )
    .await;
    assert_eq!(
        settled(&home, "ASK").await.outcome.as_deref(),
        Some("interrupted")
    );
    assert!(v.exists());
    assert_eq!(
        requests_after_tool(&model, "RM") + requests_after_tool(&model, "ASK"),
        0
    );
    let audit: Vec<Option<String>> = home
        .prompt_rows(&sid)
        .into_iter()
        .map(|r| r.resolution)
        .collect();
    assert_eq!(
        audit,
        vec![
            Some("interrupted".to_string()),
            Some("interrupted".to_string())
        ]
    );
    // The transcript is closed: stub results, then the next input is its own turn.
    ws.submit(&sid, "NEXT", "NEXT").await;
    settled(&home, "NEXT").await;
    let reqs = model.requests();
    let next = reqs.iter().find(|b| last_user(b) == "NEXT").expect("NEXT");
    assert_eq!(user_texts(next), ["RM", "ASK", "NEXT"]);
}

#[actix_rt::test]
async fn a_crash_while_parked_leaves_no_open_prompt_and_old_answers_are_stale() {
    let ParkedOnRm {
        home,
        v,
        model,
        mut d,
        ws: _ws,
        sid,
        p,
    } = parked_on_rm("crash-parked").await;
    d.kill();
    let (_d2, mut ws) = restarted_with_no_prompt(&home, &sid).await;
    ws.refused(
        "approval.respond",
        json!({"session_id": sid, "execution_generation": p["execution_generation"], "prompt_id": p["prompt_id"], "choice": "once"}),
        "stale_generation",
    )
    .await;
    assert_eq!(home.admission("RM").status, "unknown");
    assert!(v.exists());
    assert_eq!(requests_after_tool(&model, "RM"), 0);
    // Settled by the operator: the call it was parked on is closed as never run (it waited for
    // its approval), not as lost.
    let closed = resolve_and_read(&mut ws, &home, &sid, "RM", "call_rm").await;
    assert!(closed.contains("did not run"), "{closed}");
}

/// A question open at a crash is gone after it, and its answer is refused `stale_generation`,
/// as an approval's is: the answer reaches no turn, and nothing is asked of the model.
#[actix_rt::test]
async fn a_crash_while_a_question_is_open_makes_its_answer_stale() {
    let model = scripted(vec![(
        "ASK",
        tool_call("call_q", "clarify", json!({"question": "Which one?"})),
    )]);
    let (home, mut d, mut ws, sid) = submitted(&model, "crash-asking", "ASK").await;
    let q = ws.wait_prompt(&sid, "clarify").await;
    d.kill();
    let (_d2, mut ws) = restarted_with_no_prompt(&home, &sid).await;
    ws.refused(
        "clarify.respond",
        json!({"session_id": sid, "execution_generation": q["execution_generation"],
               "prompt_id": q["prompt_id"], "answer": "the first"}),
        "stale_generation",
    )
    .await;
    assert_eq!(home.admission("ASK").status, "unknown");
    assert_eq!(requests_after_tool(&model, "ASK"), 0);
}

/// A new daemon on `home` after a crash, and a connection that has resumed `sid` and found no
/// open prompt in its snapshot.
async fn restarted_with_no_prompt(home: &Home, sid: &str) -> (Daemon, Ws) {
    let d = Daemon::start(home);
    let mut ws = d.ws().await;
    let snap = ws.ok("session.resume", json!({"session_id": sid})).await;
    assert_eq!(snap["prompts"], json!([]));
    (d, ws)
}

/// Settle the unknown input `input_id` as its operator would; the result its call `call_id` was
/// closed with.
async fn resolve_and_read(
    ws: &mut Ws,
    home: &Home,
    sid: &str,
    input_id: &str,
    call_id: &str,
) -> String {
    let row = home.admission(input_id);
    assert_eq!(row.status, "unknown");
    ws.ok(
        "prompt.resolve_unknown",
        json!({"session_id": sid, "admission_id": row.admission_id,
               "execution_generation": row.execution_generation}),
    )
    .await;
    home.transcript(sid)
        .into_iter()
        .find(|m| m.tool_call_id.as_deref() == Some(call_id))
        .and_then(|m| m.content)
        .expect("the call's result")
}

/// A crash while a command ran leaves its call without a result; settled by the operator, the
/// call is not said to have not run (it may have: the next turn's model was told it did not,
/// and could run it again).
#[actix_rt::test]
async fn a_command_running_at_a_crash_is_not_said_to_have_not_run() {
    let home = Home::new();
    let model = scripted(vec![(
        "LONG",
        terminal("call_long", "touch started.txt && sleep 30"),
    )]);
    home.write_config(&config(&model.url, json!({})));
    let mut d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.session("crash-running", &home.path).await;
    ws.submit(&sid, "LONG", "LONG").await;
    wait_until("the command runs", T, || {
        home.path.join("started.txt").exists()
    })
    .await;
    d.kill();
    let d2 = Daemon::start(&home);
    let mut ws = d2.ws().await;
    ws.ok("session.resume", json!({"session_id": sid})).await;
    let closed = resolve_and_read(&mut ws, &home, &sid, "LONG", "call_long").await;
    assert!(!closed.contains("did not run"), "{closed}");
    assert!(closed.contains("may have run"), "{closed}");
}

#[actix_rt::test]
async fn approval_modes_off_and_deny() {
    let home = Home::new();
    let v = victim(&home, "victim");
    let model = scripted(vec![("RM", terminal("call_rm", &rm(&v)))]);
    home.write_config(&config(&model.url, json!({"approvals": {"mode": "deny"}})));
    let mut d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.session("modes", &home.path).await;
    ws.submit(&sid, "RM", "RM").await;
    settled(&home, "RM").await;
    assert!(v.exists());
    assert_eq!(tool_result(&model, "RM")["status"], "blocked");
    drop(ws);
    d.term();
    home.write_config(&config(&model.url, json!({"approvals": {"mode": "off"}})));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    ws.ok("session.resume", json!({"session_id": sid})).await;
    ws.submit(&sid, "RM-again", "RM").await;
    settled(&home, "RM-again").await;
    assert!(!v.exists(), "mode off runs it without a prompt");
    assert!(home.prompt_rows(&sid).is_empty());
}

#[actix_rt::test]
async fn tool_failures_become_results_and_the_loop_carries_on() {
    let model = scripted(vec![
        (
            "SLOW",
            tool_call(
                "call_slow",
                "terminal",
                json!({"command": "sleep 5", "timeout": 1}),
            ),
        ),
        ("GHOST", tool_call("call_ghost", "rocket", json!({}))),
        (
            "BROKEN",
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"index": 0, "id": "call_broken", "type": "function", "function": {"name": "terminal", "arguments": "{\"command\": "}}]}),
        ),
        ("FAIL", terminal("call_fail", "echo oops >&2; exit 3")),
        // The model may ask for less than `terminal.timeout`, never for more.
        (
            "LONG",
            tool_call(
                "call_long",
                "terminal",
                json!({"command": "sleep 8", "timeout": 100000}),
            ),
        ),
    ]);
    let (home, d) = Daemon::with_model(&model, json!({"terminal": {"timeout": 2}}));
    let mut ws = d.ws().await;
    let sid = ws.session("failures", &home.path).await;
    for t in ["SLOW", "GHOST", "BROKEN", "FAIL", "LONG"] {
        ws.submit(&sid, t, t).await;
    }
    wait_until("all turns", T, || all_terminal(&home)).await;
    for t in ["SLOW", "GHOST", "BROKEN", "FAIL"] {
        assert_eq!(
            home.admission(t).outcome.as_deref(),
            Some("completed"),
            "{t}"
        );
    }
    let long = tool_result(&model, "LONG");
    assert!(
        long["error"]
            .as_str()
            .is_some_and(|e| e.contains("timed out after 2 seconds")),
        "{long}"
    );
    let slow = tool_result(&model, "SLOW");
    assert_eq!(slow["exit_code"], 124, "{slow}");
    assert!(
        slow["error"]
            .as_str()
            .is_some_and(|e| e.contains("timed out after 1 seconds")),
        "{slow}"
    );
    let ghost = tool_result(&model, "GHOST");
    assert!(
        ghost.as_str().is_some_and(|s| s.contains("does not exist")),
        "{ghost}"
    );
    let broken = tool_result(&model, "BROKEN");
    assert!(
        broken
            .as_str()
            .is_some_and(|s| s.contains("not valid JSON")),
        "{broken}"
    );
    let fail = tool_result(&model, "FAIL");
    assert_eq!(
        (fail["exit_code"].as_i64(), fail["output"].as_str()),
        (Some(3), Some("oops")),
        "{fail}"
    );
}

/// A call whose arguments are not a JSON object (a model that kept writing a Python dict, or a
/// bare string) is kept with arguments that are one: sent back as written, a provider that reads
/// every call's arguments refused every later request of the session. Its result still says
/// what was wrong, and nothing runs.
#[actix_rt::test]
async fn calls_with_arguments_that_are_no_object_are_sent_back_as_one() {
    let script = scripted_calls(vec![
        (
            "DICT",
            json!({"role": "assistant", "content": null, "tool_calls": [{"index": 0,
                "id": "call_dict", "type": "function",
                "function": {"name": "terminal", "arguments": "{'command': 'touch dict'}"}}]}),
        ),
        (
            "STRING",
            json!({"role": "assistant", "content": null, "tool_calls": [{"index": 0,
                "id": "call_string", "type": "function",
                "function": {"name": "terminal", "arguments": "\"touch string\""}}]}),
        ),
    ]);
    // A provider that reads the arguments of every call it is sent.
    let model = FakeModel::start(move |body| {
        let calls = body["messages"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|m| m["tool_calls"].as_array().cloned().unwrap_or_default());
        let unreadable = calls.clone().any(|c| {
            let args = c["function"]["arguments"].as_str().unwrap_or("");
            serde_json::from_str::<serde_json::Map<String, Value>>(args).is_err()
        });
        if unreadable {
            return Reply::Status(
                400,
                json!({"error": {"message": "tool call arguments must be a JSON object"}}),
            );
        }
        script(body)
    });
    let (home, d) = Daemon::with_model(&model, json!({}));
    let mut ws = d.ws().await;
    let sid = ws.session("not-objects", &home.path).await;
    for t in ["DICT", "STRING", "NEXT"] {
        ws.submit(&sid, t, t).await;
        settled(&home, t).await;
        assert_eq!(
            home.admission(t).outcome.as_deref(),
            Some("completed"),
            "{t}"
        );
    }
    let dict = tool_result(&model, "DICT");
    assert!(
        dict.as_str().is_some_and(|s| s.contains("not valid JSON")),
        "{dict}"
    );
    let string = tool_result(&model, "STRING");
    assert!(
        string
            .as_str()
            .is_some_and(|s| s.contains("must be a JSON object")),
        "{string}"
    );
    for file in ["dict", "string"] {
        assert!(
            !home.path.join("workspace").join(file).exists(),
            "{file} ran"
        );
    }
}

#[actix_rt::test]
async fn the_iteration_limit_forces_a_final_answer_without_tools() {
    // A model that calls a tool whenever it may.
    let model = FakeModel::start(|body| {
        if body.get("tools").is_some() {
            Reply::Message(terminal("call_again", "echo again"), "tool_calls")
        } else {
            Reply::Message(json!({"role": "assistant", "content": "FINAL"}), "stop")
        }
    });
    let (home, d) = Daemon::with_model(&model, json!({"agent": {"max_iterations": 2}}));
    let mut ws = d.ws().await;
    let sid = ws.session("limit", &home.path).await;
    let r = ws.submit(&sid, "LOOP", "LOOP").await;
    assert_eq!(
        settled(&home, "LOOP").await.outcome.as_deref(),
        Some("completed")
    );
    let reqs = model.requests();
    assert_eq!(
        reqs.len(),
        3,
        "two tool rounds, then one request without tools"
    );
    assert!(reqs[2].get("tools").is_none());
    assert!(last_user(&reqs[2]).contains("maximum number of tool-calling iterations"));
    let receipt = ws
        .ok(
            "prompt.receipt",
            json!({"session_id": sid, "admission_id": r["admission_id"]}),
        )
        .await;
    assert_eq!(receipt["result"]["final_response"], "FINAL");
}

/// A dangerous command is asked about wherever it hides: on a later line of a script (the shell
/// runs every line), or chained after one whose rule this session already approved. Before, the
/// first ran with no prompt (no rule looked past the first line) and so did the second (only
/// the first matching rule was checked against the session's approvals).
#[actix_rt::test]
async fn a_dangerous_command_on_a_later_line_or_riding_along_is_asked_about() {
    let home = Home::new();
    let (lines, first, ride) = (
        victim(&home, "lines"),
        victim(&home, "first"),
        victim(&home, "ride"),
    );
    let model = scripted(vec![
        (
            "LINES",
            terminal("call_l", &format!("true\n{}", rm(&lines))),
        ),
        ("FIRST", terminal("call_f", &rm(&first))),
        (
            "RIDE",
            terminal(
                "call_r",
                &format!("chmod 777 {} && {}", ride.display(), rm(&ride)),
            ),
        ),
    ]);
    home.write_config(&config(&model.url, json!({})));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.session("hidden", &home.path).await;

    ws.submit(&sid, "LINES", "LINES").await;
    let p = ws.wait_prompt(&sid, "approval").await;
    let keys = p["pattern_keys"].to_string();
    assert!(keys.contains("recursive_delete"), "{p}");
    assert_eq!(p["workdir"], home.path.to_string_lossy().as_ref(), "{p}");
    respond(&mut ws, &sid, &p, "deny").await;
    settled(&home, "LINES").await;
    assert!(lines.exists(), "the second line never ran");

    ws.submit(&sid, "FIRST", "FIRST").await;
    let p = ws.wait_prompt(&sid, "approval").await;
    respond(&mut ws, &sid, &p, "session").await;
    settled(&home, "FIRST").await;
    assert!(!first.exists());

    // Its delete is approved for the session; the chmod riding along is not.
    ws.submit(&sid, "RIDE", "RIDE").await;
    let p = ws.wait_prompt(&sid, "approval").await;
    assert!(
        p["pattern_keys"].to_string().contains("world_writable"),
        "{p}"
    );
    respond(&mut ws, &sid, &p, "deny").await;
    let row = settled(&home, "RIDE").await;
    assert_eq!(row.outcome.as_deref(), Some("completed"));
    assert!(ride.exists(), "the chained command never ran");
    assert_eq!(home.prompt_rows(&sid).len(), 3);
}

/// A response may make at most 64 tool calls: the rest are neither run nor kept (the last
/// result says how many were left out), so later requests do not carry them; calls that share
/// an id each get their own (two calls `call_0` ran, and one result stood for both from then
/// on); a command over 64 KiB is refused before any check.
#[actix_rt::test]
async fn a_response_runs_at_most_64_tool_calls_and_no_huge_command() {
    let marks = Home::new();
    let calls: Vec<(String, String)> = (0..70)
        .map(|i| {
            (
                format!("call_{}", if i == 1 { 0 } else { i }),
                format!("touch {}", marks.path.join(format!("m{i}")).display()),
            )
        })
        .collect();
    let many = tool_calls(
        &calls
            .iter()
            .map(|(id, cmd)| (id.as_str(), "terminal", json!({"command": cmd})))
            .collect::<Vec<_>>(),
    );
    let huge = terminal("call_huge", &format!("echo {}", "x".repeat(70_000)));
    let model = scripted(vec![("MANY", many), ("HUGE", huge)]);
    let (home, _d, mut ws, sid) = submitted(&model, "many", "MANY").await;
    assert_eq!(
        settled(&home, "MANY").await.outcome.as_deref(),
        Some("completed")
    );
    let ran = (0..70)
        .filter(|i| marks.path.join(format!("m{i}")).exists())
        .count();
    assert_eq!(ran, 64);
    let reqs = model.requests();
    let after = reqs
        .iter()
        .find(|b| last_user(b) == "MANY" && after_tool(b))
        .expect("the request after the calls");
    let messages = after["messages"].as_array().expect("messages");
    let asked = messages
        .iter()
        .rev()
        .find(|m| m["role"] == "assistant")
        .and_then(|m| m["tool_calls"].as_array())
        .expect("the calls");
    assert_eq!(asked.len(), 64);
    let results: Vec<&Value> = messages.iter().filter(|m| m["role"] == "tool").collect();
    assert_eq!(results.len(), 64);
    let ids: std::collections::HashSet<&str> = results
        .iter()
        .filter_map(|m| m["tool_call_id"].as_str())
        .collect();
    assert_eq!(ids.len(), 64, "one result per call, each its own id");
    assert!(results
        .iter()
        .all(|m| !m["content"].as_str().unwrap_or("").contains("did not run")));
    let last = results[63]["content"].as_str().unwrap_or("");
    assert!(
        last.contains("6 more tool calls of this response were not run"),
        "{last}"
    );
    ws.submit(&sid, "HUGE", "HUGE").await;
    settled(&home, "HUGE").await;
    let result = tool_result(&model, "HUGE");
    assert!(
        result["error"]
            .as_str()
            .is_some_and(|e| e.contains("over 65536 bytes")),
        "{result}"
    );
}

/// Prompt `p` offers `once` and `deny` only, and a `session` answer is refused.
async fn offers_once_only(ws: &mut Ws, sid: &str, p: &Value) {
    assert_eq!(p["choices"], json!(["once", "deny"]), "{p}");
    ws.refused(
        "approval.respond",
        json!({"session_id": sid, "execution_generation": p["execution_generation"],
               "prompt_id": p["prompt_id"], "choice": "session"}),
        "invalid_params",
    )
    .await;
}

/// A command that touches the gateway's own files (its ledger holds the approvals) is asked
/// about, however harmless its verb: a session runs in the gateway's home by default, where
/// `rm -f state.db` matched no rule and ran unasked.
#[actix_rt::test]
async fn a_command_on_the_gateways_own_files_is_asked_about() {
    let model = scripted(vec![
        ("LEDGER", terminal("call_db", "cp state.db stolen.db")),
        ("PLAIN", terminal("call_plain", "echo fine > notes.txt")),
    ]);
    let (home, _d, mut ws, sid) = submitted(&model, "own", "LEDGER").await;
    let p = ws.wait_prompt(&sid, "approval").await;
    assert!(
        p["pattern_keys"].to_string().contains("gateway_state"),
        "{p}"
    );
    // Approved one command at a time: what one approval of the gateway's state lets through is
    // not one kind of act (a session approval of a read let a truncation of the ledger pass).
    offers_once_only(&mut ws, &sid, &p).await;
    respond(&mut ws, &sid, &p, "deny").await;
    settled(&home, "LEDGER").await;
    assert!(!home.path.join("stolen.db").exists());
    // Other files of the same directory are nobody's business.
    ws.submit(&sid, "PLAIN", "PLAIN").await;
    assert_eq!(
        settled(&home, "PLAIN").await.outcome.as_deref(),
        Some("completed")
    );
    assert!(home.path.join("notes.txt").exists());
    assert_eq!(home.prompt_rows(&sid).len(), 1);
}

/// A delete of everything in the directory a command runs in is never allowed where that
/// directory is the user's home (or `/`, or a system directory), whatever the approvals: `rm
/// -rf *` with `workdir` the home is `rm -rf ~/*`. It was read as any recursive delete, and with
/// approvals off it ran.
#[actix_rt::test]
async fn a_delete_of_everything_in_the_users_home_is_never_allowed() {
    let user_home = Home::new();
    let keep = user_home.path.join("notes.txt");
    std::fs::write(&keep, "keep").expect("write");
    let model = scripted(vec![(
        "RM",
        tool_call(
            "call_rm",
            "terminal",
            json!({"command": "rm -rf *", "workdir": user_home.path}),
        ),
    )]);
    let home = Home::new();
    home.write_config(&config(&model.url, json!({"approvals": {"mode": "off"}})));
    let d = Daemon::start_with_env(&home, &[("HOME", &user_home.path.to_string_lossy())]);
    let mut ws = d.ws().await;
    let sid = ws.session("kept", &home.path).await;
    ws.submit(&sid, "RM", "RM").await;
    assert_eq!(
        settled(&home, "RM").await.outcome.as_deref(),
        Some("completed")
    );
    assert!(keep.exists(), "the delete ran");
    let result = tool_result(&model, "RM");
    let error = result["error"].as_str().unwrap_or("");
    assert!(
        error.starts_with("BLOCKED:") && error.contains("never allowed"),
        "{result}"
    );
}

/// A command that runs what cannot be read from it (text piped into a shell, a command name
/// computed at run time) is approved one at a time: approved for the session, `cat setup.sh |
/// bash` let any later `… | sh` run unasked, whatever it carried.
#[actix_rt::test]
async fn a_command_that_runs_unread_text_is_approved_one_at_a_time() {
    let model = scripted(vec![
        (
            "PIPE",
            terminal("call_pipe", "echo 'echo piped > piped.txt' | sh"),
        ),
        (
            "AGAIN",
            terminal("call_again", "echo 'echo again > again.txt' | sh"),
        ),
        (
            "NAMED",
            terminal("call_named", "x=echo; $x named > named.txt"),
        ),
    ]);
    let (home, _d, mut ws, sid) = submitted(&model, "unread", "PIPE").await;
    let p = ws.wait_prompt(&sid, "approval").await;
    assert!(
        p["pattern_keys"].to_string().contains("pipe_to_shell"),
        "{p}"
    );
    offers_once_only(&mut ws, &sid, &p).await;
    respond(&mut ws, &sid, &p, "once").await;
    assert_eq!(
        settled(&home, "PIPE").await.outcome.as_deref(),
        Some("completed")
    );
    assert!(home.path.join("piped.txt").exists());
    // The next one is asked about again.
    ws.submit(&sid, "AGAIN", "AGAIN").await;
    let p = ws.wait_prompt(&sid, "approval").await;
    assert_eq!(p["choices"], json!(["once", "deny"]), "{p}");
    respond(&mut ws, &sid, &p, "deny").await;
    settled(&home, "AGAIN").await;
    assert!(!home.path.join("again.txt").exists());
    ws.submit(&sid, "NAMED", "NAMED").await;
    let p = ws.wait_prompt(&sid, "approval").await;
    assert!(
        p["pattern_keys"].to_string().contains("dynamic_command"),
        "{p}"
    );
    assert_eq!(p["choices"], json!(["once", "deny"]), "{p}");
    respond(&mut ws, &sid, &p, "deny").await;
    settled(&home, "NAMED").await;
    assert!(!home.path.join("named.txt").exists());
}

/// A dangerous command with a part masked as a secret in its prompt (a "private key block"
/// can hold any text, shell lines included) is asked about each time, once or deny, and its
/// prompt says part of it is hidden: approved for the session, the hidden part rode along.
#[actix_rt::test]
async fn a_command_partly_masked_in_its_prompt_is_asked_once_and_says_so() {
    let hidden = "rm -rf /srv/data";
    let command = format!(
        "rm -rf build; : '-----BEGIN RSA PRIVATE KEY-----\n{hidden}\n-----END RSA PRIVATE KEY-----'"
    );
    let model = scripted(vec![
        ("MASKED", terminal("call_masked", &command)),
        ("CLEAR", terminal("call_clear", "rm -rf build")),
    ]);
    let (home, _d, mut ws, sid) = submitted(&model, "masked", "MASKED").await;
    let p = ws.wait_prompt(&sid, "approval").await;
    assert_eq!(p["masked"], true, "{p}");
    assert!(!p["command"].to_string().contains(hidden), "{p}");
    assert_eq!(p["choices"], json!(["once", "deny"]), "{p}");
    respond(&mut ws, &sid, &p, "deny").await;
    settled(&home, "MASKED").await;
    // Nothing masked: the usual choices, and no flag set.
    ws.submit(&sid, "CLEAR", "CLEAR").await;
    let p = ws.wait_prompt(&sid, "approval").await;
    assert_eq!(p["masked"], false, "{p}");
    assert_eq!(
        p["choices"],
        json!(["once", "session", "always", "deny"]),
        "{p}"
    );
    respond(&mut ws, &sid, &p, "deny").await;
    settled(&home, "CLEAR").await;
}

/// Identical calls in one response run once: the kept assistant message has the call once, with
/// its one result.
#[actix_rt::test]
async fn identical_tool_calls_in_one_response_run_once() {
    let out = Home::new();
    let counter = out.path.join("counter");
    let cmd = format!("echo once >> {}", counter.display());
    let twice = tool_calls(&[
        ("call_a", "terminal", json!({"command": cmd})),
        ("call_b", "terminal", json!({"command": cmd})),
        ("call_c", "terminal", json!({"command": "echo other"})),
    ]);
    let model = scripted(vec![("TWICE", twice)]);
    let (home, _d, _ws, _sid) = submitted(&model, "twice", "TWICE").await;
    assert_eq!(
        settled(&home, "TWICE").await.outcome.as_deref(),
        Some("completed")
    );
    assert_eq!(
        std::fs::read_to_string(&counter).expect("counter"),
        "once\n"
    );
    let reqs = model.requests();
    let after = reqs
        .iter()
        .find(|b| last_user(b) == "TWICE" && after_tool(b))
        .expect("the request after the calls");
    let msgs = after["messages"].as_array().expect("messages");
    let ids: Vec<&str> = msgs
        .iter()
        .filter(|m| m["role"] == "tool")
        .filter_map(|m| m["tool_call_id"].as_str())
        .collect();
    assert_eq!(ids, ["call_a", "call_c"]);
}

/// Bad answers are asked for again, as many as three times: an answer cut off by the output
/// limit goes on where it stopped (one cut off before any answer came fails), an empty one is asked again, unparsable tool arguments are
/// asked again before anything runs or is kept; a tool named in another case runs; calls only to
/// tools that do not exist end the turn after three rounds; a cut-off tool call never runs.
#[actix_rt::test]
async fn bad_model_answers_are_asked_for_again_within_bounds() {
    use std::sync::{Arc, Mutex};
    let counts: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let seen = counts.clone();
    let out = Home::new();
    let marker = out.path.join("cut-call-ran");
    let cut = format!("touch {}", marker.display());
    let model = FakeModel::start(move |body| {
        let text = last_user(body);
        let say = |content: &str, finish: &'static str| {
            Reply::Message(json!({"role": "assistant", "content": content}), finish)
        };
        if text == "NOPE" {
            // Whatever it is told, it calls a tool that does not exist.
            let round = body["messages"]
                .as_array()
                .map_or(0, |m| m.iter().filter(|m| m["role"] == "tool").count());
            return Reply::Message(
                tool_call(&format!("n{round}"), "nope", json!({})),
                "tool_calls",
            );
        }
        if after_tool(body) {
            return say(&format!("DONE_{text}"), "stop");
        }
        if text.starts_with("[Your previous response was cut off") {
            let users = user_texts(body);
            if users.len() >= 2 && users[users.len() - 2] == "LONGTOOL" {
                return Reply::Message(
                    tool_call("lt1", "terminal", json!({"command": "echo went-on"})),
                    "tool_calls",
                );
            }
            return say("part two.", "stop");
        }
        let n = {
            let mut c = seen.lock().expect("counts");
            let n = c.entry(text.clone()).or_insert(0);
            *n += 1;
            *n
        };
        match (text.as_str(), n) {
            ("LONG" | "LONGTOOL", _) => say("part one, ", "length"),
            ("EMPTY", 1 | 2) => say("", "stop"),
            ("FILTERED", _) => say("", "content_filter"),
            // A reasoning model that spends the whole output limit thinking.
            ("THINK", _) => Reply::Message(
                json!({"role": "assistant", "content": "", "reasoning_content": "hmm, let me see"}),
                "length",
            ),
            ("EMPTY", _) => say("at last", "stop"),
            ("BADJSON", 1) => Reply::Message(
                json!({"role": "assistant", "content": null, "tool_calls": [{"index": 0, "id": "b1",
                    "type": "function", "function": {"name": "terminal", "arguments": "{\"command\": \"echo ba"}}]}),
                "tool_calls",
            ),
            ("BADJSON", _) => Reply::Message(
                tool_call("b2", "terminal", json!({"command": "echo fixed"})),
                "tool_calls",
            ),
            ("CASE", _) => Reply::Message(
                tool_call("c1", "Terminal", json!({"command": "echo cased"})),
                "tool_calls",
            ),
            ("CUT", _) => Reply::Message(
                tool_call("x1", "terminal", json!({"command": cut})),
                "length",
            ),
            _ => say(&format!("ACK_{text}"), "stop"),
        }
    });
    let (home, d) = Daemon::with_model(&model, json!({}));
    let mut ws = d.ws().await;
    let sid = ws.session("retries", &home.path).await;
    let mut results = HashMap::new();
    for id in [
        "LONG", "LONGTOOL", "EMPTY", "BADJSON", "CASE", "NOPE", "CUT", "FILTERED", "THINK",
    ] {
        ws.submit(&sid, id, id).await;
        let row = settled(&home, id).await;
        let r = ws
            .ok(
                "prompt.receipt",
                json!({"session_id": sid, "admission_id": row.admission_id}),
            )
            .await;
        results.insert(id, (row.outcome.clone(), r["result"].clone()));
    }
    let count = |t: &str| counts.lock().expect("counts").get(t).copied().unwrap_or(0);
    let answer = |id: &str| results[id].1["final_response"].as_str().map(str::to_string);

    // Cut off: the partial answer and a note to go on, then the whole answer as one message.
    assert_eq!(answer("LONG").as_deref(), Some("part one, part two."));
    assert_eq!(count("LONG"), 1);
    let go_on = model
        .requests()
        .into_iter()
        .find(|b| last_user(b).starts_with("[Your previous response was cut off"))
        .expect("a continuation request");
    let msgs = go_on["messages"].as_array().expect("messages");
    assert_eq!(
        msgs[msgs.len() - 2],
        json!({"role": "assistant", "content": "part one, "})
    );

    // Cut off, then tool calls: the text so far is that message's, and nothing after the tool
    // round is told it was cut off.
    assert_eq!(answer("LONGTOOL").as_deref(), Some("DONE_LONGTOOL"));
    let with_call = home
        .transcript(&sid)
        .into_iter()
        .find(|m| {
            m.tool_calls
                .as_deref()
                .is_some_and(|c| c.contains("\"lt1\""))
        })
        .expect("the tool call");
    assert_eq!(with_call.content.as_deref(), Some("part one, "));
    let after_tool: Vec<Value> = model
        .requests()
        .into_iter()
        .filter(|b| after_tool(b) && last_user(b) == "LONGTOOL")
        .collect();
    assert_eq!(after_tool.len(), 1);
    assert!(
        !after_tool[0].to_string().contains("was cut off"),
        "{}",
        after_tool[0]
    );

    // Cut off before any answer came: asking again would send the same request (there is no
    // text to go on from), so the turn fails at once.
    assert_eq!(results["THINK"].0.as_deref(), Some("failed"));
    assert_eq!(results["THINK"].1["reason"], "model_error");
    assert!(
        results["THINK"].1["error"]
            .as_str()
            .is_some_and(|e| e.contains("output limit")),
        "{}",
        results["THINK"].1
    );
    assert_eq!(count("THINK"), 1);

    assert_eq!(answer("EMPTY").as_deref(), Some("at last"));
    assert_eq!(count("EMPTY"), 3, "two empty answers asked again");

    assert_eq!(answer("BADJSON").as_deref(), Some("DONE_BADJSON"));
    assert_eq!(count("BADJSON"), 2);
    // A client that showed the streamed attempts is told which ones were void (among the
    // deltas, in order): two empty answers, one call with bad arguments.
    let retries = |admission: &Value| {
        let admission = admission.clone();
        move |e: &Value| {
            e["type"] == "message.delta"
                && e["payload"]["admission_id"] == admission
                && e["payload"].get("retry").is_some()
        }
    };
    for (id, why, n) in [
        ("EMPTY", "empty_answer", 2),
        ("BADJSON", "unparsable_tool_arguments", 1),
    ] {
        let admission = json!(home.admission(id).admission_id);
        for _ in 0..n {
            let said = ws.event(T, retries(&admission)).await;
            assert_eq!(said["payload"]["retry"], why, "{said}");
        }
    }
    let kept: Vec<String> = home
        .transcript(&sid)
        .iter()
        .filter_map(|m| m.tool_calls.clone())
        .collect();
    assert!(
        kept.iter()
            .all(|c| !c.contains("echo ba\"") && !c.contains("\"b1\"")),
        "the unparsable call is not kept: {kept:?}"
    );

    assert_eq!(answer("CASE").as_deref(), Some("DONE_CASE"));
    let cased = home
        .transcript(&sid)
        .into_iter()
        .find(|m| m.tool_call_id.as_deref() == Some("c1"))
        .and_then(|m| m.content)
        .unwrap_or_default();
    assert!(cased.contains("cased"), "{cased}");

    assert_eq!(results["NOPE"].0.as_deref(), Some("failed"));
    assert_eq!(results["NOPE"].1["reason"], "model_error");
    let nope_requests = model
        .requests()
        .iter()
        .filter(|b| last_user(b) == "NOPE")
        .count();
    assert_eq!(nope_requests, 3, "three rounds, then the turn ends");
    let nope_rounds = home
        .transcript(&sid)
        .iter()
        .filter(|m| m.tool_name.as_deref() == Some("nope"))
        .count();
    assert_eq!(nope_rounds, 3);

    assert_eq!(results["CUT"].0.as_deref(), Some("failed"));
    assert_eq!(results["CUT"].1["reason"], "model_error");
    assert!(home
        .transcript(&sid)
        .iter()
        .all(|m| m.tool_call_id.as_deref() != Some("x1")));
    assert!(!marker.exists(), "the cut-off call never ran");

    // A withheld answer is not asked for again, nor "completed" blank: the turn says why.
    assert_eq!(results["FILTERED"].0.as_deref(), Some("failed"));
    assert_eq!(results["FILTERED"].1["reason"], "model_error");
    assert!(results["FILTERED"].1["error"]
        .as_str()
        .is_some_and(|e| e.contains("content filter")));
    assert_eq!(count("FILTERED"), 1);
}

/// A relative `workdir` is under the session's directory; an absolute one stands as it is.
#[actix_rt::test]
async fn a_relative_workdir_is_under_the_session_directory() {
    let home = Home::new();
    let sub = home.path.join("sub");
    std::fs::create_dir_all(&sub).expect("sub");
    let elsewhere = Home::new();
    let model = scripted(vec![
        (
            "REL",
            tool_call("r", "terminal", json!({"command": "pwd", "workdir": "sub"})),
        ),
        (
            "ABS",
            tool_call(
                "a",
                "terminal",
                json!({"command": "pwd", "workdir": elsewhere.path}),
            ),
        ),
    ]);
    home.write_config(&config(&model.url, json!({})));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.session("workdir", &home.path).await;
    for (id, dir) in [("REL", &sub), ("ABS", &elsewhere.path)] {
        ws.submit(&sid, id, id).await;
        settled(&home, id).await;
        let out = tool_result(&model, id);
        let ran = std::path::PathBuf::from(out["output"].as_str().unwrap_or(""));
        assert_eq!(
            ran.canonicalize().ok(),
            dir.canonicalize().ok(),
            "{id}: {out}"
        );
    }
}

/// A command's output reaches the model (and the transcript) with secrets masked.
#[actix_rt::test]
async fn secrets_in_a_commands_output_are_masked() {
    let model = scripted(vec![(
        "ENV",
        terminal(
            "call_env",
            "printf 'API_KEY=sk-proj-abcdefghijklmnopqrstuvwxyz012345\\nplain line\\n'",
        ),
    )]);
    let (home, _d, _ws, sid) = submitted(&model, "env", "ENV").await;
    settled(&home, "ENV").await;
    let out = tool_result(&model, "ENV");
    assert_eq!(
        out["output"], "API_KEY=sk-p…[redacted]\nplain line",
        "{out}"
    );
    let kept = home
        .transcript(&sid)
        .into_iter()
        .filter_map(|m| m.content)
        .collect::<Vec<_>>()
        .join("\n");
    assert!(!kept.contains("abcdefghijklmnop"), "{kept}");
}

/// The commands the terminal tool runs (the daemon's children, as its user) cannot reach into
/// the daemon through `/proc/$PPID`: not its open files (the ledger, where a command wrote an
/// approval and then ran unasked), not its environment (the model's key). Run as `nobody`, so
/// it needs root to start; skipped otherwise.
#[actix_rt::test]
async fn a_tool_cannot_reach_into_the_daemon_through_proc() {
    use std::os::unix::process::CommandExt;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!("skipped: starting the daemon as another user needs root");
        return;
    }
    const NOBODY: u32 = 65534;
    let model = scripted(vec![(
        "PEEK",
        terminal(
            "call_peek",
            "cat /proc/$PPID/environ; ls /proc/$PPID/fd; echo exit=$?",
        ),
    )]);
    let home = Home::new();
    const KEY: &str = "gk_nobody_peek";
    home.write_config(&config(
        &model.url,
        json!({"approvals": {"mode": "off"},
               "gateway": {"api_keys": [format!("sha256:{}", gatehouse::api::auth::key_digest(KEY))]}}),
    ));
    // A copy of the binary it can run (the build's may be in a directory only root enters).
    let program = home.path.join("gatehouse-as-nobody");
    std::fs::copy(bin(), &program).expect("copy the binary");
    let chown = Command::new("chown")
        .args(["-R", &format!("{NOBODY}:{NOBODY}")])
        .arg(&home.path)
        .status()
        .expect("chown");
    assert!(chown.success());
    let d = Daemon::start_program(&home, &program, |cmd| {
        cmd.uid(NOBODY).gid(NOBODY);
    });
    // A ticket is minted only for the daemon's own user: a key it is.
    let mut ws = keyed_ws(&d, KEY).await;
    let sid = ws.session("peek", &home.path).await;
    ws.submit(&sid, "PEEK", "PEEK").await;
    settled(&home, "PEEK").await;
    let result = tool_result(&model, "PEEK");
    let output = result["output"].as_str().unwrap_or("").to_string();
    assert!(!output.contains("OPENAI_API_KEY"), "{output}");
    assert!(output.contains("Permission denied"), "{output}");
    assert!(!output.contains("state.db"), "{output}");
}

/// A command that ran but whose result could not be written (the store refused the write) is
/// closed with the result it had, not a stub saying it did not run: told so, the model of the
/// next turn could run a non-idempotent command again.
#[actix_rt::test]
async fn a_tool_result_that_could_not_be_written_is_not_said_to_have_not_run() {
    use diesel::{Connection, RunQueryDsl};
    let model = scripted(vec![(
        "RUN",
        terminal("c1", "touch ran.txt && echo FAILWRITE-OUTPUT"),
    )]);
    let (home, d) = Daemon::with_model(&model, json!({}));
    let mut ws = d.ws().await;
    let sid = ws.session("unrecorded", &home.path).await;
    // The first write of this command's result fails, as a full disk would fail it.
    let mut db = diesel::SqliteConnection::establish(&home.path.join("state.db").to_string_lossy())
        .expect("open state.db");
    diesel::sql_query("PRAGMA busy_timeout = 10000")
        .execute(&mut db)
        .expect("busy timeout");
    diesel::sql_query(
        "CREATE TRIGGER fail_tool_write BEFORE INSERT ON messages \
         WHEN NEW.role = 'tool' AND NEW.content LIKE '%FAILWRITE%' AND NEW.display_kind IS NULL \
         BEGIN SELECT RAISE(ABORT, 'injected write failure'); END",
    )
    .execute(&mut db)
    .expect("trigger");
    drop(db);
    ws.submit(&sid, "RUN", "RUN").await;
    let row = settled(&home, "RUN").await;
    assert_eq!(row.outcome.as_deref(), Some("failed"), "{row:?}");
    assert!(home.path.join("ran.txt").exists(), "the command ran");
    ws.submit(&sid, "NEXT", "NEXT").await;
    settled(&home, "NEXT").await;
    let next = model
        .requests()
        .into_iter()
        .find(|b| last_user(b) == "NEXT")
        .expect("the next turn's request");
    let told = next.to_string();
    assert!(told.contains("FAILWRITE-OUTPUT"), "{told}");
    assert!(!told.contains("did not run"), "{told}");
}

/// The events recorded for `session`, as `type` names in log order.
fn event_types(home: &Home, session: &str) -> Vec<String> {
    gatehouse::store::events::since(&mut home.db(), session, 0, 10_000)
        .expect("the event log")
        .events
        .into_iter()
        .map(|e| e.kind)
        .collect()
}

/// A daemon whose authority another process took writes nothing more, tool activity included:
/// the end of a command that was running when the home's epoch moved on is not recorded (the
/// log says the write was refused). Before, the deposed daemon still appended the command's
/// `tool.complete` event to the log the new authority owns.
#[actix_rt::test]
async fn a_deposed_daemon_records_no_tool_activity() {
    let home = Home::new();
    let (started, go) = (home.path.join("started"), home.path.join("go"));
    let command = format!(
        "touch {}; while [ ! -e {} ]; do sleep 0.05; done",
        started.display(),
        go.display()
    );
    let model = scripted(vec![("WAIT", terminal("call_wait", &command))]);
    home.write_config(&config(&model.url, json!({})));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.session("deposed-tool", &home.path).await;
    ws.submit(&sid, "WAIT", "WAIT").await;
    wait_until("the command runs, its start recorded", T, || {
        started.exists() && event_types(&home, &sid).iter().any(|t| t == "tool.start")
    })
    .await;
    home.move_epoch_on();
    std::fs::write(&go, "").expect("let the command end");
    wait_until("the refused write is logged", T, || {
        home.log().lines().any(|line| {
            line.contains("event write failed") && line.contains(&sid) && line.contains("epoch")
        })
    })
    .await;
    let recorded = event_types(&home, &sid);
    assert!(
        !recorded.iter().any(|t| t == "tool.complete"),
        "{recorded:?}"
    );
}

/// A foreground command that leaves a process running itself (a job whose output let go of the
/// call's pipes) is asked about as `background: true` is, one at a time: it went past that
/// question. Denied, nothing of it runs.
#[actix_rt::test]
async fn a_foreground_command_that_leaves_a_process_running_is_asked_about() {
    let home = Home::new();
    let marker = home.path.join("started");
    let command = format!("touch {} && sleep 600 >/dev/null 2>&1 &", marker.display());
    let model = scripted(vec![("DETACH", terminal("call_detach", &command))]);
    home.write_config(&config(&model.url, json!({})));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.session("detach", &home.path).await;
    ws.submit(&sid, "DETACH", "DETACH").await;
    let p = ws.wait_prompt(&sid, "approval").await;
    assert_eq!(p["background"], true, "{p}");
    assert_eq!(p["pattern_keys"], json!(["background_process"]), "{p}");
    assert_eq!(p["choices"], json!(["once", "deny"]), "{p}");
    respond(&mut ws, &sid, &p, "deny").await;
    settled(&home, "DETACH").await;
    assert!(!marker.exists(), "the denied command ran");
}

/// `background: true` starts the command, once a human approved that start (each one, whatever
/// the command), and returns at once with its pid and log: it runs on after its turn (also what
/// its shell left running in its group once the shell ended), its output reaches the log, at
/// most `terminal.max_background` run at once, and a graceful stop kills it. Logs of processes
/// that ended age out with the events. Before, the flag was ignored: the command ran in the
/// foreground until `terminal.timeout` killed it, and the turn waited for it.
#[actix_rt::test]
async fn a_background_command_runs_on_after_its_call_until_the_gateway_stops() {
    let bg = |id: &str| {
        tool_call(
            id,
            "terminal",
            // The shell ends at once; what it left running in its group is the process.
            json!({"command": "echo bg-up; sleep 600 >/dev/null 2>&1 &", "background": true}),
        )
    };
    let target = Home::new();
    let kept = victim(&target, "keep");
    let dangerous = tool_call(
        "call_rm",
        "terminal",
        json!({"command": format!("{}; exec sleep 600", rm(&kept)), "background": true}),
    );
    let model = scripted(vec![
        ("BGRM", dangerous),
        ("BG", bg("call_bg")),
        ("BG2", bg("call_bg2")),
    ]);
    let home = Home::new();
    // Logs of processes from before this boot: an old one ages out, a recent one is kept, and
    // an old file the tool did not name is left alone.
    let logs = home.path.join("background");
    std::fs::create_dir_all(&logs).expect("logs");
    let (old_log, recent_log, other) = (
        logs.join("bg-0000000000a1.log"),
        logs.join("bg-0000000000a2.log"),
        logs.join("notes.log"),
    );
    for log in [&old_log, &recent_log, &other] {
        std::fs::write(log, "earlier output\n").expect("log");
    }
    for aged in [&old_log, &other] {
        let touched = Command::new("touch")
            .args(["-d", "2000-01-01"])
            .arg(aged)
            .status()
            .expect("touch");
        assert!(touched.success());
    }
    home.write_config(&config(
        &model.url,
        json!({"terminal": {"max_background": 1, "timeout": 30}}),
    ));
    let mut d = Daemon::start(&home);
    wait_until("the old log removed", T, || !old_log.exists()).await;
    assert!(recent_log.exists(), "a recent log is kept");
    assert!(other.exists(), "a file the tool did not name is kept");
    let mut ws = d.ws().await;
    let sid = ws.session("bg", &home.path).await;
    // Approved as any other command, and the approval says it would be left running.
    ws.submit(&sid, "BGRM", "BGRM").await;
    let p = ws.wait_prompt(&sid, "approval").await;
    assert_eq!(p["background"], true, "{p}");
    respond(&mut ws, &sid, &p, "deny").await;
    settled(&home, "BGRM").await;
    let blocked = tool_result(&model, "BGRM");
    assert!(
        blocked["error"]
            .as_str()
            .is_some_and(|e| e.contains("denied")),
        "{blocked}"
    );
    assert!(kept.exists(), "the denied command never ran");
    let asked = std::time::Instant::now();
    ws.submit(&sid, "BG", "BG").await;
    // However harmless the command, a process left running is asked about, one at a time.
    let p = ws.wait_prompt(&sid, "approval").await;
    assert_eq!(p["choices"], json!(["once", "deny"]), "{p}");
    assert_eq!(p["pattern_keys"], json!(["background_process"]), "{p}");
    respond(&mut ws, &sid, &p, "once").await;
    let row = settled(&home, "BG").await;
    assert_eq!(row.outcome.as_deref(), Some("completed"));
    assert!(
        asked.elapsed() < Duration::from_secs(20),
        "the turn waited for its background command: {:?}",
        asked.elapsed()
    );
    let started = tool_result(&model, "BG");
    assert_eq!(started["output"], "Background process started", "{started}");
    assert_eq!(started["exit_code"], 0, "{started}");
    let pid = started["pid"].as_i64().expect("pid") as i32;
    let log = PathBuf::from(started["log"].as_str().expect("log"));
    assert!(log.starts_with(&home.path), "{}", log.display());
    wait_until("the background output in its log", T, || {
        std::fs::read_to_string(&log).is_ok_and(|t| t.contains("bg-up"))
    })
    .await;
    assert!(
        group_alive(pid),
        "the background process runs on after its turn"
    );
    // One at a time here, also once its shell has ended: the next is refused, and runs nothing.
    wait_until("the background shell ended", T, || !alive(pid)).await;
    ws.submit(&sid, "BG2", "BG2").await;
    let p = ws.wait_prompt(&sid, "approval").await;
    respond(&mut ws, &sid, &p, "once").await;
    settled(&home, "BG2").await;
    let refused = tool_result(&model, "BG2");
    assert!(
        refused["error"]
            .as_str()
            .is_some_and(|e| e.contains("terminal.max_background")),
        "{refused}"
    );
    assert_eq!(refused["exit_code"], -1, "{refused}");
    // The gateway's graceful stop kills it.
    assert!(group_alive(pid));
    assert_eq!(d.term(), Some(0));
    wait_until("the background process killed", T, || !group_alive(pid)).await;
}

/// A command the gateway runs (as the daemon's user) is no operator on the control socket: its
/// operator verbs are refused, whether it carries the terminal's run mark or cleared it (found
/// then as a process the gateway started). The guard reads a command's text only, and a
/// socket path built at run time passed it.
#[actix_rt::test]
async fn a_command_the_gateway_runs_is_no_operator_on_the_control_socket() {
    let home = Home::new();
    let bin = env!("CARGO_BIN_EXE_gatehouse");
    let ask = format!("{bin} sessions --home {}", home.path.display());
    // As the command's own child; with the mark cleared; and orphaned (its parent gone at once,
    // the mark kept), its output read once it ends.
    let command = format!("{ask} 2>&1; env -u GATEHOUSE_RUN {ask} 2>&1; ({ask} 2>&1 &); true");
    let model = scripted(vec![("CTL", terminal("call_ctl", &command))]);
    home.write_config(&config(&model.url, json!({})));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.session("ctl", &home.path).await;
    ws.submit(&sid, "CTL", "CTL").await;
    // Naming the home, it is asked about first (the guard's speed bump).
    let p = ws.wait_prompt(&sid, "approval").await;
    respond(&mut ws, &sid, &p, "once").await;
    settled(&home, "CTL").await;
    let output = tool_result(&model, "CTL")["output"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert_eq!(
        output
            .matches("operator commands need the daemon's user")
            .count(),
        3,
        "{output}"
    );
    // The operator's own command, run beside the daemon, is answered.
    let own = std::process::Command::new(bin)
        .args(["sessions", "--home"])
        .arg(&home.path)
        .output()
        .expect("gatehouse sessions");
    assert!(own.status.success(), "{own:?}");
}
