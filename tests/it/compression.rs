//! Context compression: preflight rotation into a child session, in-place compaction, the
//! overflow → compress → retry path, its circuit breaker, and a crash during the summary call.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use crate::helpers::*;

const T: Duration = Duration::from_secs(30);
const SUMMARY: &str = "SUMMARY_RETAINED_FACTS: the user is sending pressure turns.";
/// Characters of filler in every pressure message and reply.
const FILL: usize = 2000;

/// `P<i>` followed by filler.
fn pressure(i: usize) -> String {
    format!("P{i} {}", "u".repeat(FILL))
}

fn tag(text: &str) -> String {
    text.split_whitespace().next().unwrap_or("").to_string()
}

fn is_summary(body: &Value) -> bool {
    body["model"] == "summary"
}

fn ack(body: &Value) -> Reply {
    let t = tag(&last_user(body));
    Reply::Message(
        json!({"role": "assistant", "content": format!("ACK_{t} {}", "a".repeat(FILL))}),
        "stop",
    )
}

fn summary_reply() -> Reply {
    Reply::Message(json!({"role": "assistant", "content": SUMMARY}), "stop")
}

/// A model that summarises for the `summary` model and acknowledges everything else.
fn summarising_model() -> FakeModel {
    FakeModel::start(|body| {
        if is_summary(body) {
            summary_reply()
        } else {
            ack(body)
        }
    })
}

/// Main model requests (not summaries).
fn main_requests(model: &FakeModel) -> Vec<Value> {
    model
        .requests()
        .into_iter()
        .filter(|b| !is_summary(b))
        .collect()
}

fn summaries(model: &FakeModel) -> Vec<Value> {
    model.requests().into_iter().filter(is_summary).collect()
}

fn mentions(body: &Value, needle: &str) -> bool {
    body["messages"].to_string().contains(needle)
}

/// A small threshold: three pressure exchanges plus a new input pass it, two do not, and the
/// compacted history plus one more exchange stays under it. No tools, so only messages count.
fn pressure_config(url: &str, in_place: bool) -> Value {
    config(
        url,
        json!({
            "model": {"context_length": 64000},
            "compression": {"threshold_tokens": 3200, "protect_first_n": 1, "protect_last_n": 2, "in_place": in_place},
            "auxiliary": {"compression": {"model": "summary"}},
        }),
    )
}

/// A daemon on `model` with [`pressure_config`], and a session of it named `name`, without tools.
async fn pressure_session(
    model: &FakeModel,
    in_place: bool,
    name: &str,
) -> (Home, Daemon, Ws, String) {
    let home = Home::new();
    home.write_config(&pressure_config(&model.url, in_place));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.toolless(name, &home.path).await;
    (home, d, ws, sid)
}

/// A daemon on `model` that compresses past `threshold` tokens, protecting the first and last
/// `protect` messages (a 64K window, summaries by the `summary` model), and a session of it
/// named `name` with the terminal tool.
async fn tool_session(
    model: &FakeModel,
    threshold: u64,
    protect: (usize, usize),
    name: &str,
) -> (Home, Daemon, Ws, String) {
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({
            "model": {"context_length": 64000},
            "compression": {"threshold_tokens": threshold, "protect_first_n": protect.0,
                            "protect_last_n": protect.1},
            "auxiliary": {"compression": {"model": "summary"}},
        }),
    ));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws
        .create(name, &home.path, json!({"toolsets": ["terminal"]}))
        .await["session_id"]
        .as_str()
        .expect("sid")
        .to_string();
    (home, d, ws, sid)
}

/// After a tool round, the tokens the model reported for the response that called the tools
/// count toward the threshold (the post-tool trigger): a provider whose tokens outnumber the
/// estimate (a quarter of the characters) is compacted before the next request, not sent it
/// whole. Before, only the estimate was compared, and the request after the tools went as it was.
#[actix_rt::test]
async fn reported_usage_after_a_tool_round_compacts_before_the_next_request() {
    let model = FakeModel::start(|body| {
        if is_summary(body) {
            return summary_reply();
        }
        let text = last_user(body);
        if text == "BIG" && !after_tool(body) {
            let call = tool_call("call_big", "terminal", json!({"command": "echo big"}));
            return Reply::Sse(vec![json!({
                "choices": [{"index": 0, "delta": call, "finish_reason": "tool_calls"}],
                "usage": {"prompt_tokens": 30000, "completion_tokens": 20, "total_tokens": 30020},
            })
            .to_string()]);
        }
        Reply::Message(
            json!({"role": "assistant", "content": format!("ACK_{}", tag(&text))}),
            "stop",
        )
    });
    // The estimate of this short conversation is far under the threshold (its turns long
    // enough that their summary is shorter than they are).
    let (home, _d, mut ws, sid) = tool_session(&model, 20_000, (1, 2), "reported").await;
    for i in 0..3 {
        let id = format!("S{i}");
        ws.submit(&sid, &id, &format!("{id} {}", "s".repeat(400)))
            .await;
        wait_until(&id, T, || home.admission(&id).status == "terminal").await;
    }
    assert!(summaries(&model).is_empty(), "nothing compacted yet");
    ws.submit(&sid, "BIG", "BIG").await;
    wait_until("BIG", T, || home.admission("BIG").status == "terminal").await;
    assert_eq!(home.admission("BIG").outcome.as_deref(), Some("completed"));
    let requests = model.requests();
    let at = |pred: &dyn Fn(&Value) -> bool| requests.iter().position(pred);
    let called = at(&|b| !is_summary(b) && last_user(b) == "BIG" && !after_tool(b));
    let summary = at(&|b| is_summary(b));
    let after = at(&|b| !is_summary(b) && after_tool(b));
    assert!(
        called < summary && summary < after && called.is_some(),
        "the summary between the call and the request after the tools: {called:?} {summary:?} {after:?}"
    );
    assert_eq!(summaries(&model).len(), 1);
    let after = &requests[after.unwrap_or_default()];
    assert!(
        mentions(after, SUMMARY),
        "the request after the tools is the compacted one"
    );
    assert!(!mentions(after, "ACK_S0"), "the middle is summarised away");
}

async fn run(ws: &mut Ws, home: &Home, sid: &str, i: usize) {
    let id = format!("P{i}");
    ws.submit(sid, &id, &pressure(i)).await;
    wait_until(&id, T, || home.admission(&id).status == "terminal").await;
    assert_eq!(
        home.admission(&id).outcome.as_deref(),
        Some("completed"),
        "{id}"
    );
}

fn user_tags(rows: &[gatehouse::store::messages::MessageRow]) -> Vec<String> {
    rows.iter()
        .filter(|m| m.role == "user")
        .map(|m| tag(m.content.as_deref().unwrap_or("")))
        .collect()
}

/// With no `context_length` configured, a session's window is what `models_dev_cache.json` in
/// the home lists for its provider and model: four exchanges compact a session whose model it
/// gives a 4K window (the summary's budget following that window), and, without the file, the
/// same four leave it alone (the 128K default).
#[actix_rt::test]
async fn the_models_cache_gives_a_session_its_window() {
    let model = summarising_model();
    let mut children = Vec::new();
    for cached in [true, false] {
        let home = Home::new();
        home.write_config(&config(
            &model.url,
            json!({
                "compression": {"protect_first_n": 1, "protect_last_n": 2},
                "auxiliary": {"compression": {"model": "summary"}},
            }),
        ));
        if cached {
            let cache = json!({"custom": {"models": {
                "fake-model": {"limit": {"context": 4000, "output": 1000}},
                "other-model": {"limit": {"context": 1_000_000}},
            }}});
            std::fs::write(home.path.join("models_dev_cache.json"), cache.to_string())
                .expect("the cache");
        }
        let d = Daemon::start(&home);
        let mut ws = d.ws().await;
        let sid = ws.toolless("cached", &home.path).await;
        for i in 0..4 {
            run(&mut ws, &home, &sid, i).await;
        }
        children.push(home.children(&sid).len());
    }
    assert_eq!(
        children,
        [1, 0],
        "compacted with the cache's 4K window only"
    );
    let sums = summaries(&model);
    assert_eq!(sums.len(), 1);
    // 5 % of the cache's 4K window is 200 tokens, twice over.
    assert_eq!(sums[0]["max_tokens"], 400);
}

/// A profile's model compacts at its own window, not the default model's: the same four
/// exchanges compact a session on a profile whose model has a 4K window, and leave one on the
/// default model (1M) alone.
#[actix_rt::test]
async fn a_profile_model_compacts_at_its_own_context_window() {
    let model = summarising_model();
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({
            "model": {"context_length": 1_000_000},
            "profiles": {"small": {"model": "small-model", "context_length": 4000}},
            "compression": {"protect_first_n": 1, "protect_last_n": 2},
            "auxiliary": {"compression": {"model": "summary"}},
        }),
    ));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let mut sessions = Vec::new();
    for profile in ["default", "small"] {
        let sid = ws
            .create(
                profile,
                &home.path,
                json!({"toolsets": [], "profile": profile}),
            )
            .await["session_id"]
            .as_str()
            .expect("sid")
            .to_string();
        for i in 0..4 {
            let id = format!("{profile}-P{i}");
            ws.submit(&sid, &id, &pressure(i)).await;
            wait_until(&id, T, || home.admission(&id).status == "terminal").await;
            assert_eq!(home.admission(&id).outcome.as_deref(), Some("completed"));
        }
        sessions.push(sid);
    }
    assert!(
        home.children(&sessions[0]).is_empty(),
        "the default model's 1M window is far away"
    );
    assert_eq!(
        home.children(&sessions[1]).len(),
        1,
        "the 4K window compacts"
    );
    let sums = summaries(&model);
    assert_eq!(sums.len(), 1);
    // The summary's budget follows the small window: 5 % of 4K is 200 tokens, twice over.
    assert_eq!(sums[0]["max_tokens"], 400);
    assert!(main_requests(&model)
        .iter()
        .filter(|b| b["model"] == "small-model")
        .any(|b| mentions(b, SUMMARY)));
}

#[actix_rt::test]
async fn preflight_compression_rotates_into_a_child_session() {
    let model = summarising_model();
    let (home, _d, mut ws, root) = pressure_session(&model, false, "rotate").await;
    for i in 0..3 {
        run(&mut ws, &home, &root, i).await;
    }
    assert!(
        summaries(&model).is_empty(),
        "under the threshold nothing is compressed"
    );
    assert!(home.children(&root).is_empty());
    let before: Vec<(i64, Option<String>)> = home
        .all_messages(&root)
        .iter()
        .map(|m| (m.id, m.content.clone()))
        .collect();
    run(&mut ws, &home, &root, 3).await;

    // Exactly one summary, to the auxiliary model, before P3's only main request.
    let all = model.requests();
    let sums: Vec<&Value> = all.iter().filter(|b| is_summary(b)).collect();
    assert_eq!(sums.len(), 1);
    let s = sums[0];
    assert_eq!(s["temperature"], 0.3);
    // The summary's budget: 2,000 tokens for this small middle (under 5 % of 64K), twice over.
    assert_eq!(s["max_tokens"], 4000);
    let prompt = s["messages"][0]["content"].as_str().unwrap_or("");
    assert_eq!(s["messages"].as_array().map(Vec::len), Some(1));
    assert!(
        prompt.contains("[USER]: P1 ") && prompt.contains("[ASSISTANT]: ACK_P0"),
        "the middle is summarised"
    );
    assert!(
        !prompt.contains("[USER]: P0 "),
        "the protected head is not summarised"
    );
    let pos = all.iter().position(is_summary).expect("summary");
    let p3: Vec<usize> = (0..all.len())
        .filter(|&i| !is_summary(&all[i]) && tag(&last_user(&all[i])) == "P3")
        .collect();
    assert_eq!(p3.len(), 1, "P3 reached the main model once");
    assert!(pos < p3[0], "compression ran before the main request");
    let req = &all[p3[0]];
    assert!(mentions(req, SUMMARY));
    let users: Vec<String> = user_texts(req).iter().map(|u| tag(u)).collect();
    assert_eq!(
        users,
        ["P0", "P3"],
        "P0 kept verbatim, P1 and P2 only in the summary"
    );

    // Lineage: one child of the root, the root ended by compression.
    let children = home.children(&root);
    assert_eq!(children.len(), 1);
    let child = children[0].clone();
    assert_eq!(home.end_reason(&root).as_deref(), Some("compression"));
    assert_eq!(home.end_reason(&child), None);
    let root_rows: Vec<(i64, Option<String>)> = home
        .all_messages(&root)
        .iter()
        .map(|m| (m.id, m.content.clone()))
        .collect();
    assert_eq!(
        &root_rows[..before.len()],
        &before[..],
        "the root's rows are untouched"
    );
    assert!(home.all_messages(&root).iter().all(|m| m.active == 1));
    // Every reply reports one prompt and one completion token: four main requests and the
    // summary's are counted.
    let spent = [home.tokens(&root), home.tokens(&child)];
    assert_eq!(
        spent.iter().fold((0, 0), |t, s| (t.0 + s.0, t.1 + s.1)),
        (5, 5),
        "{spent:?}"
    );
    // The durable log tells of the new tip once (committed with the compaction).
    let log = ws
        .ok(
            "session.events.since",
            json!({"session_id": root, "last_sequence": 0}),
        )
        .await;
    let told: Vec<&Value> = log["events"]
        .as_array()
        .map(|evs| {
            evs.iter()
                .filter(|e| e["payload"]["compacted"] == true)
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(told.len(), 1, "{log}");
    assert_eq!(told[0]["type"], "session.info");
    assert_eq!(told[0]["payload"]["tip_session_id"], child.as_str());
    let child_rows = home.transcript(&child);
    assert_eq!(user_tags(&child_rows), ["P0", "P3"]);
    assert!(child_rows
        .iter()
        .any(|m| m.content.as_deref().is_some_and(|c| c.contains(SUMMARY))));
    assert_eq!(
        child_rows
            .last()
            .and_then(|m| m.content.as_deref())
            .map(tag)
            .as_deref(),
        Some("ACK_P3")
    );

    // A later turn: the client still names the root; the rows land in the child.
    run(&mut ws, &home, &root, 4).await;
    assert_eq!(summaries(&model).len(), 1, "no second compaction");
    assert!(home
        .admissions()
        .iter()
        .all(|r| r.target_session_id == root));
    assert_eq!(user_tags(&home.transcript(&child)), ["P0", "P3", "P4"]);
    assert!(!user_tags(&home.all_messages(&root)).contains(&"P4".to_string()));
    let p4 = main_requests(&model)
        .into_iter()
        .find(|b| tag(&last_user(b)) == "P4")
        .expect("P4 request");
    assert!(mentions(&p4, SUMMARY));
    // The system prompt: rebuilt once, by the compaction (the note added), stored on the child
    // and sent byte for byte from then on; the root keeps the one it was built with.
    let system = |b: &Value| -> String {
        assert_eq!(b["messages"][0]["role"], "system", "{b}");
        b["messages"][0]["content"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    let main = main_requests(&model);
    let of = |t: &str| {
        main.iter()
            .find(|b| tag(&last_user(b)) == t)
            .map(system)
            .unwrap_or_default()
    };
    let (first, compacted) = (of("P0"), of("P3"));
    assert_eq!(of("P2"), first);
    assert!(
        compacted.starts_with(&first) && compacted.contains("[Note: earlier turns"),
        "{compacted}"
    );
    assert_eq!(of("P4"), compacted);
    let stored = |id: &str| -> Option<String> {
        use diesel::prelude::*;
        use gatehouse::store::schema::sessions;
        sessions::table
            .filter(sessions::id.eq(id))
            .select(sessions::system_prompt)
            .first(&mut home.db())
            .expect("a session")
    };
    assert_eq!(stored(&root), Some(first));
    assert_eq!(stored(&child), Some(compacted));
    let snap = ws.ok("session.resume", json!({"session_id": root})).await;
    assert_eq!(snap["session_id"], root);
    assert_eq!(snap["stored_session_id"], child);
    let contents: Vec<String> = snap["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter_map(|m| m["content"].as_str().map(str::to_string))
        .collect();
    assert!(contents.iter().any(|c| c.contains(SUMMARY)));
    assert_eq!(contents.len(), home.transcript(&child).len());
    // The child's earlier rows are byte-identical: later turns only append.
    let now: Vec<(i64, Option<String>)> = home
        .transcript(&child)
        .iter()
        .map(|m| (m.id, m.content.clone()))
        .collect();
    let then: Vec<(i64, Option<String>)> = child_rows
        .iter()
        .map(|m| (m.id, m.content.clone()))
        .collect();
    assert_eq!(&now[..then.len()], &then[..]);
}

#[actix_rt::test]
async fn in_place_compression_soft_archives_the_old_rows() {
    let model = summarising_model();
    let home = Home::new();
    home.write_config(&pressure_config(&model.url, true));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.toolless("in-place", &home.path).await;
    for i in 0..3 {
        run(&mut ws, &home, &sid, i).await;
    }
    let before: Vec<i64> = home.all_messages(&sid).iter().map(|m| m.id).collect();
    assert_eq!(before.len(), 6);
    run(&mut ws, &home, &sid, 3).await;
    assert_eq!(summaries(&model).len(), 1);
    assert!(home.children(&sid).is_empty(), "no child in place");
    assert_eq!(home.end_reason(&sid), None);
    let rows = home.all_messages(&sid);
    // The six earlier rows and P3's first user row are archived.
    let archived: Vec<i64> = rows
        .iter()
        .filter(|m| m.active == 0)
        .map(|m| m.id)
        .collect();
    assert_eq!(&archived[..6], &before[..]);
    assert_eq!(archived.len(), 7);
    assert!(rows
        .iter()
        .filter(|m| m.active == 0)
        .all(|m| m.compacted == 1));
    let live = home.transcript(&sid);
    assert!(live
        .iter()
        .all(|m| m.compacted == 0 && m.id > *before.last().unwrap_or(&0)));
    assert_eq!(user_tags(&live), ["P0", "P3"]);
    assert!(live
        .iter()
        .any(|m| m.content.as_deref().is_some_and(|c| c.contains(SUMMARY))));
    run(&mut ws, &home, &sid, 4).await;
    assert_eq!(summaries(&model).len(), 1);
    assert_eq!(user_tags(&home.transcript(&sid)), ["P0", "P3", "P4"]);
    let snap = ws.ok("session.resume", json!({"session_id": sid})).await;
    assert_eq!(snap["stored_session_id"], sid);
    assert_eq!(
        snap["messages"].as_array().map(Vec::len),
        Some(home.transcript(&sid).len())
    );
}

/// The main model refuses requests over this many characters of messages.
const WIRE_LIMIT: usize = 9000;

fn overflow() -> Reply {
    Reply::Status(
        400,
        json!({"error": {"message": "This model's maximum context length is 4096 tokens.", "type": "invalid_request_error",
                         "code": "context_length_exceeded"}}),
    )
}

/// A model that summarises for the `summary` model, refuses other requests over `limit`
/// characters of messages ([`overflow`]) and acknowledges the rest.
fn overflowing_model(limit: usize) -> FakeModel {
    FakeModel::start(move |body| {
        if is_summary(body) {
            summary_reply()
        } else if wire_chars(body) > limit {
            overflow()
        } else {
            ack(body)
        }
    })
}

#[actix_rt::test]
async fn an_overflow_error_compresses_and_retries_the_same_step() {
    let model = overflowing_model(WIRE_LIMIT);
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({"model": {"context_length": 64000}, "compression": {"protect_first_n": 1, "protect_last_n": 2},
               "auxiliary": {"compression": {"model": "summary"}}}),
    ));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.toolless("overflow", &home.path).await;
    run(&mut ws, &home, &sid, 0).await;
    run(&mut ws, &home, &sid, 1).await;
    assert!(
        summaries(&model).is_empty(),
        "the preflight threshold is far away"
    );
    run(&mut ws, &home, &sid, 2).await;
    let all = model.requests();
    let p2: Vec<&Value> = all
        .iter()
        .filter(|b| is_summary(b) || tag(&last_user(b)) == "P2")
        .collect();
    assert_eq!(p2.len(), 3, "overflow, summary, retry");
    assert!(!is_summary(p2[0]) && wire_chars(p2[0]) > WIRE_LIMIT);
    assert!(is_summary(p2[1]));
    assert!(!is_summary(p2[2]) && wire_chars(p2[2]) <= WIRE_LIMIT);
    assert!(mentions(p2[2], SUMMARY));
    assert_eq!(
        user_texts(p2[2]).last().map(|u| tag(u)).as_deref(),
        Some("P2"),
        "the same step is retried"
    );
    let children = home.children(&sid);
    assert_eq!(children.len(), 1);
    let live = home.transcript(&children[0]);
    assert_eq!(
        user_tags(&live),
        ["P0", "P2"],
        "P2's user message is not duplicated"
    );
    let r = ws
        .ok(
            "prompt.receipt",
            json!({"session_id": sid, "admission_id": home.admission("P2").admission_id}),
        )
        .await;
    assert!(r["result"]["final_response"]
        .as_str()
        .is_some_and(|t| t.starts_with("ACK_P2")));
}

/// A summary model whose window is smaller than the session's (it refuses prompts over 5,000
/// characters, naming a 4,096-token window) is asked once more with the newest turns that fit
/// it, and the session is compacted. Before, the summary failed every time, and a session past
/// its own window failed every turn.
#[actix_rt::test]
async fn a_summary_model_with_a_smaller_window_is_asked_with_what_fits() {
    const SUMMARY_LIMIT: usize = 5_000;
    let model = FakeModel::start(|body| {
        if is_summary(body) {
            if wire_chars(body) > SUMMARY_LIMIT {
                overflow()
            } else {
                summary_reply()
            }
        } else {
            ack(body)
        }
    });
    let (home, _d, mut ws, sid) = pressure_session(&model, false, "small-summary").await;
    for i in 0..5 {
        run(&mut ws, &home, &sid, i).await;
    }
    let asked: Vec<usize> = summaries(&model).iter().map(wire_chars).collect();
    assert!(
        asked.iter().any(|&n| n > SUMMARY_LIMIT),
        "the first summary request was over the summary model's window: {asked:?}"
    );
    assert!(
        asked.iter().any(|&n| n <= SUMMARY_LIMIT),
        "asked again within it: {asked:?}"
    );
    assert!(!home.children(&sid).is_empty(), "the session was compacted");
}

/// A summary model with a small window whose summaries are long: the earlier summary a later
/// compaction has to update is cut to fit that window beside the new turns, and the session
/// compacts again. Before, the earlier summary went whole into every later prompt, left no
/// room for any turn ("leaves no room"), and the session never compacted again.
#[actix_rt::test]
async fn an_earlier_summary_is_cut_to_fit_a_small_summary_window() {
    const SUMMARY_LIMIT: usize = 5_000;
    let long_summary = format!("{SUMMARY} {}", "s".repeat(4_000));
    let model = FakeModel::start(move |body| {
        if is_summary(body) {
            if wire_chars(body) > SUMMARY_LIMIT {
                overflow()
            } else {
                Reply::Message(
                    json!({"role": "assistant", "content": long_summary}),
                    "stop",
                )
            }
        } else {
            ack(body)
        }
    });
    let (home, _d, mut ws, sid) = pressure_session(&model, false, "small-window-twice").await;
    let mut i = 0;
    while lineage_of(&home, &sid) < 3 {
        assert!(
            i < 12,
            "compacted {} times in {i} inputs",
            lineage_of(&home, &sid) - 1
        );
        run(&mut ws, &home, &sid, i).await;
        i += 1;
    }
    let asked: Vec<usize> = summaries(&model).iter().map(wire_chars).collect();
    let last = summaries(&model).pop().expect("a summary request");
    assert!(mentions(&last, SUMMARY), "the earlier summary is updated");
    assert!(
        asked.last().is_some_and(|&n| n <= SUMMARY_LIMIT),
        "{asked:?}"
    );
}

/// With compression turned off, an overflow error fails the turn `context_overflow`: the
/// summary model is not asked and no child session is made. Before, only the check before a
/// request heeded the switch, and an overflow summarised and rotated all the same.
#[actix_rt::test]
async fn an_overflow_with_compression_off_fails_without_a_summary() {
    let model = overflowing_model(WIRE_LIMIT);
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({"model": {"context_length": 64000},
               "compression": {"enabled": false, "protect_first_n": 1, "protect_last_n": 2},
               "auxiliary": {"compression": {"model": "summary"}}}),
    ));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.toolless("off", &home.path).await;
    run(&mut ws, &home, &sid, 0).await;
    run(&mut ws, &home, &sid, 1).await;
    ws.submit(&sid, "P2", &pressure(2)).await;
    wait_until("P2", T, || home.admission("P2").status == "terminal").await;
    let row = home.admission("P2");
    assert_eq!(row.outcome.as_deref(), Some("failed"), "{row:?}");
    let result = row.result_json.unwrap_or_default();
    assert!(result.contains("context_overflow"), "{result}");
    assert!(result.contains("compression.enabled"), "{result}");
    assert!(summaries(&model).is_empty());
    assert!(home.children(&sid).is_empty());
}

/// A request asks for at most half the model's window as its answer (`model.max_tokens` is one
/// setting for every model): the threshold leaves the prompt the rest, and a prompt under it
/// with all of `max_tokens` asked on top was refused, compacted and refused again, every turn.
#[actix_rt::test]
async fn a_request_asks_for_no_more_answer_than_its_window_leaves() {
    let model = summarising_model();
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({"model": {"context_length": 8192, "max_tokens": 8192}}),
    ));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.toolless("capped", &home.path).await;
    run(&mut ws, &home, &sid, 0).await;
    let asked = main_requests(&model);
    assert_eq!(
        asked.last().map(|b| b["max_tokens"].clone()),
        Some(json!(4096))
    );
}

/// A compaction whose commit meets a failure of the store that passes (the database locked past
/// the writer's busy wait) is committed on a later try: the summary made is kept, and the turn
/// completes. It failed the turn `storage_unavailable`, and the next turn asked for the same
/// summary again.
#[actix_rt::test]
async fn a_compaction_commit_the_store_refuses_for_a_while_is_tried_again() {
    let home = Home::new();
    let db = home.path.join("state.db");
    let locked_once = Arc::new(AtomicBool::new(false));
    let model = FakeModel::start(move |body| {
        if !is_summary(body) {
            return ack(body);
        }
        if !locked_once.swap(true, Ordering::SeqCst) {
            // The summary is answered while another connection holds the write lock longer
            // than the writer waits for it (5 s): the compaction's first commit fails.
            let (held_tx, held) = std::sync::mpsc::channel();
            let db = db.clone();
            std::thread::spawn(move || {
                use diesel::connection::SimpleConnection;
                use diesel::Connection;
                let mut holder =
                    diesel::SqliteConnection::establish(&db.to_string_lossy()).expect("open");
                holder.batch_execute("BEGIN IMMEDIATE").expect("write lock");
                let _ = held_tx.send(());
                std::thread::sleep(Duration::from_secs(6));
                holder.batch_execute("ROLLBACK").expect("let go");
            });
            held.recv().expect("the lock is held");
        }
        summary_reply()
    });
    home.write_config(&pressure_config(&model.url, false));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.toolless("locked", &home.path).await;
    for i in 0..4 {
        run(&mut ws, &home, &sid, i).await;
    }
    assert_eq!(summaries(&model).len(), 1);
    assert_eq!(
        home.children(&sid).len(),
        1,
        "compacted into a child session"
    );
}

/// A model whose window neither the config nor the limits file gives is taken for a 128K one;
/// its first overflow error that names its window (`maximum context length is 4096 tokens`)
/// teaches the gateway that window, and later requests are compacted before they are sent.
/// Before, every long turn began with a refused request and a summary after it.
#[actix_rt::test]
async fn an_overflow_error_that_names_the_window_is_learned() {
    // Refuses requests over 14,000 characters (about 3,500 tokens of a 4,096 window).
    const LIMIT: usize = 14_000;
    let model = overflowing_model(LIMIT);
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({"compression": {"protect_first_n": 1, "protect_last_n": 2},
               "auxiliary": {"compression": {"model": "summary"}}}),
    ));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.toolless("learned", &home.path).await;
    for i in 0..9 {
        run(&mut ws, &home, &sid, i).await;
    }
    let refused = main_requests(&model)
        .iter()
        .filter(|b| wire_chars(b) > LIMIT)
        .count();
    assert_eq!(
        refused, 1,
        "only the first overflow: the window is known after it"
    );
    assert!(
        home.log()
            .contains("the model's context window, from its overflow error"),
        "{}",
        home.log()
    );
}

#[actix_rt::test]
async fn repeated_overflow_trips_the_breaker_and_the_session_stays_usable() {
    // The main model always overflows on BOOM, whatever the size.
    let model = FakeModel::start(|body| {
        if is_summary(body) {
            summary_reply()
        } else if last_user(body).starts_with("BOOM") {
            overflow()
        } else {
            Reply::Message(
                json!({"role": "assistant", "content": format!("ACK_{}", tag(&last_user(body)))}),
                "stop",
            )
        }
    });
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({"model": {"context_length": 64000}, "compression": {"protect_first_n": 1, "protect_last_n": 2, "max_attempts": 3},
               "auxiliary": {"compression": {"model": "summary"}}}),
    ));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.toolless("breaker", &home.path).await;
    let other = ws.toolless("bystander", &home.path).await;
    for i in 0..6 {
        let id = format!("M{i}");
        ws.submit(&sid, &id, &format!("M{i} short message number {i}"))
            .await;
    }
    ws.submit(&sid, "BOOM", "BOOM overflowing input").await;
    ws.submit(&other, "BYSTANDER", "BYSTANDER").await;
    ws.submit(&sid, "AFTER", "AFTER").await;
    wait_until("all turns", T, || all_terminal(&home)).await;
    let boom = home.admission("BOOM");
    assert_eq!(boom.outcome.as_deref(), Some("failed"));
    let sums = summaries(&model).len();
    assert!((1..=3).contains(&sums), "{sums} compression attempts");
    let boom_requests = main_requests(&model)
        .iter()
        .filter(|b| last_user(b).starts_with("BOOM"))
        .count();
    assert!(
        boom_requests <= sums + 1,
        "{boom_requests} requests for {sums} compressions: no endless loop"
    );
    let result: Value =
        serde_json::from_str(boom.result_json.as_deref().unwrap_or("null")).expect("result");
    assert_eq!(result["reason"], "context_overflow", "{result}");
    assert!(
        result["error"]
            .as_str()
            .is_some_and(|e| e.contains("context_overflow")),
        "{result}"
    );
    let r = ws
        .ok(
            "prompt.receipt",
            json!({"session_id": sid, "admission_id": boom.admission_id}),
        )
        .await;
    assert_eq!(r["outcome"], "failed");
    assert_eq!(r["result"]["reason"], "context_overflow");
    // Visible in the transcript of the session's tip.
    let snap = ws.ok("session.resume", json!({"session_id": sid})).await;
    let texts: Vec<String> = snap["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter_map(|m| m["content"].as_str().map(str::to_string))
        .collect();
    let note = texts
        .iter()
        .position(|t| t.contains("context_overflow"))
        .expect("a visible failure note");
    // Usable afterwards: the next input completes as its own user turn.
    assert_eq!(
        home.admission("AFTER").outcome.as_deref(),
        Some("completed")
    );
    assert!(texts[note + 1..].iter().any(|t| t == "AFTER"));
    assert_eq!(texts.last().map(String::as_str), Some("ACK_AFTER"));
    let after = main_requests(&model)
        .into_iter()
        .find(|b| last_user(b) == "AFTER")
        .expect("AFTER request");
    let users = user_texts(&after);
    assert_eq!(
        &users[users.len() - 2..],
        ["BOOM overflowing input".to_string(), "AFTER".to_string()]
    );
    // The bystander never noticed.
    assert_eq!(
        home.admission("BYSTANDER").outcome.as_deref(),
        Some("completed")
    );
    assert!(home.children(&other).is_empty());
    assert_eq!(model.reached("BYSTANDER"), 1);
}

#[actix_rt::test]
async fn a_crash_during_the_summary_call_leaves_the_transcript_intact() {
    let hang = Arc::new(AtomicBool::new(true));
    let h = hang.clone();
    let model = FakeModel::start(move |body| {
        if is_summary(body) {
            if h.load(Ordering::SeqCst) {
                Reply::Hang
            } else {
                summary_reply()
            }
        } else {
            ack(body)
        }
    });
    let home = Home::new();
    home.write_config(&pressure_config(&model.url, false));
    let mut d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let root = ws.toolless("crash", &home.path).await;
    for i in 0..3 {
        run(&mut ws, &home, &root, i).await;
    }
    let p3 = ws.submit(&root, "P3", &pressure(3)).await;
    wait_until("the summary call", T, || !summaries(&model).is_empty()).await;
    let snapshot = |home: &Home| -> Vec<(i64, String, Option<String>, i32, i32)> {
        home.all_messages(&root)
            .iter()
            .map(|m| {
                (
                    m.id,
                    m.role.clone(),
                    m.content.clone(),
                    m.active,
                    m.compacted,
                )
            })
            .collect()
    };
    let before = snapshot(&home);
    assert_eq!(user_tags(&home.transcript(&root)), ["P0", "P1", "P2", "P3"]);
    d.kill();
    model.release();
    let d2 = Daemon::start(&home);
    assert!(home.children(&root).is_empty(), "no half-made child");
    assert_eq!(home.end_reason(&root), None);
    assert_eq!(
        snapshot(&home),
        before,
        "the root's transcript is as it was"
    );
    assert!(
        before.iter().all(|r| r.3 == 1 && r.4 == 0),
        "every row still active"
    );
    let row = home.admission("P3");
    assert_eq!(row.status, "unknown");
    assert_eq!(
        main_requests(&model)
            .iter()
            .filter(|b| tag(&last_user(b)) == "P3")
            .count(),
        0
    );
    let mut ws = d2.ws().await;
    let snap = ws.ok("session.resume", json!({"session_id": root})).await;
    assert_eq!(snap["stored_session_id"], root);
    assert_eq!(
        snap["messages"].as_array().map(Vec::len),
        Some(before.len())
    );
    // Discard the lost turn; the session compresses on its next input and carries on.
    hang.store(false, Ordering::SeqCst);
    let gen = row.execution_generation.expect("generation");
    ws.ok("prompt.resolve_unknown", json!({"session_id": root, "admission_id": p3["admission_id"], "execution_generation": gen})).await;
    run(&mut ws, &home, &root, 4).await;
    assert_eq!(home.children(&root).len(), 1);
    assert_eq!(
        main_requests(&model)
            .iter()
            .filter(|b| tag(&last_user(b)) == "P3")
            .count(),
        0,
        "the lost input never ran"
    );
}

#[actix_rt::test]
async fn the_latest_user_message_is_never_summarised_away() {
    let model = summarising_model();
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({"model": {"context_length": 64000},
               "compression": {"threshold_tokens": 3200, "protect_first_n": 1, "protect_last_n": 0},
               "auxiliary": {"compression": {"model": "summary"}}}),
    ));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.toolless("tail-user", &home.path).await;
    for i in 0..3 {
        run(&mut ws, &home, &sid, i).await;
    }
    // A pasted message larger than the whole tail budget.
    let big = format!("P3 {}", "u".repeat(4000));
    ws.submit(&sid, "P3", &big).await;
    wait_until("P3", T, || home.admission("P3").status == "terminal").await;
    assert_eq!(home.admission("P3").outcome.as_deref(), Some("completed"));
    assert_eq!(summaries(&model).len(), 1);
    let req = main_requests(&model)
        .into_iter()
        .find(|b| tag(&last_user(b)) == "P3")
        .expect("P3 request");
    let msgs = req["messages"].as_array().expect("messages");
    assert_eq!(
        msgs.last()
            .map(|m| (m["role"].clone(), m["content"].clone())),
        Some((json!("user"), json!(big)))
    );
}

#[actix_rt::test]
async fn a_summary_is_not_summarised_again_when_nothing_new_can_be_compacted() {
    // A small tail budget keeps more than `protect_last_n` short messages, so after one
    // compaction the only thing left between head and tail is the summary itself.
    let model = FakeModel::start(|body| {
        if is_summary(body) {
            summary_reply()
        } else if last_user(body).starts_with("BOOM") {
            overflow()
        } else {
            Reply::Message(
                json!({"role": "assistant", "content": format!("ACK_{}", tag(&last_user(body)))}),
                "stop",
            )
        }
    });
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({"model": {"context_length": 64000},
               "compression": {"threshold_tokens": 1000, "protect_first_n": 1, "protect_last_n": 2},
               "auxiliary": {"compression": {"model": "summary"}}}),
    ));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.toolless("no-progress", &home.path).await;
    for i in 0..6 {
        let id = format!("M{i}");
        ws.submit(&sid, &id, &format!("M{i} {}", "m".repeat(200)))
            .await;
    }
    ws.submit(&sid, "BOOM", "BOOM overflowing input").await;
    wait_until("all turns", T, || all_terminal(&home)).await;
    assert!(
        summaries(&model).len() == 1,
        "{} summary requests",
        summaries(&model).len()
    );
    assert_eq!(home.children(&sid).len(), 1);
    let child = home.children(&sid)[0].clone();
    assert!(
        home.children(&child).is_empty(),
        "no rotation that compacts nothing"
    );
    let boom = home.admission("BOOM");
    assert_eq!(boom.outcome.as_deref(), Some("failed"));
    let result: Value =
        serde_json::from_str(boom.result_json.as_deref().unwrap_or("null")).expect("result");
    assert_eq!(result["reason"], "context_overflow", "{result}");
}

/// Every tool result follows the assistant message that called it, and every call has its result.
fn well_formed(body: &Value) -> Result<(), String> {
    let msgs = body["messages"].as_array().ok_or("no messages")?;
    let mut open: Vec<String> = Vec::new();
    for (i, m) in msgs.iter().enumerate() {
        match m["role"].as_str() {
            Some("tool") => {
                let id = m["tool_call_id"].as_str().unwrap_or("").to_string();
                let pos = open
                    .iter()
                    .position(|o| *o == id)
                    .ok_or(format!("orphan tool result at {i}: {id}"))?;
                open.remove(pos);
            }
            role => {
                if !open.is_empty() {
                    return Err(format!("calls {open:?} unanswered before message {i}"));
                }
                if role == Some("assistant") {
                    open = m["tool_calls"]
                        .as_array()
                        .map(|c| {
                            c.iter()
                                .filter_map(|c| c["id"].as_str().map(str::to_string))
                                .collect()
                        })
                        .unwrap_or_default();
                }
            }
        }
    }
    Ok(())
}

#[actix_rt::test]
async fn compaction_never_splits_a_tool_call_from_its_result() {
    let model = FakeModel::start(|body| {
        if is_summary(body) {
            return summary_reply();
        }
        let t = tag(&last_user(body));
        if after_tool(body) {
            Reply::Message(
                json!({"role": "assistant", "content": format!("ACK_{t}")}),
                "stop",
            )
        } else {
            let call = tool_call(
                &format!("call_{t}"),
                "terminal",
                json!({"command": "head -c 2000 /dev/zero | tr '\\0' x"}),
            );
            Reply::Message(call, "tool_calls")
        }
    });
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({"model": {"context_length": 64000},
               "compression": {"threshold_tokens": 2000, "protect_first_n": 1, "protect_last_n": 2},
               "auxiliary": {"compression": {"model": "summary"}}}),
    ));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.session("pairs", &home.path).await;
    for i in 0..5 {
        let id = format!("T{i}");
        ws.submit(&sid, &id, &format!("T{i} run the command")).await;
    }
    wait_until("all turns", T, || all_terminal(&home)).await;
    for i in 0..5 {
        assert_eq!(
            home.admission(&format!("T{i}")).outcome.as_deref(),
            Some("completed")
        );
    }
    let sums = summaries(&model);
    assert!(
        !sums.is_empty(),
        "the tool output pushed the history over the threshold"
    );
    assert!(sums
        .iter()
        .any(|s| mentions(s, "[Tool calls: terminal(") && mentions(s, "[TOOL RESULT call_T")));
    // Old long results reach the summary model as one line each (the pre-pass), not verbatim.
    // (`mentions` reads the messages as JSON text, where the command's backslash is escaped.)
    let line = Value::from(
        r"[terminal] ran `head -c 2000 /dev/zero | tr '\0' x` -> exit 0, 1 lines output",
    )
    .to_string();
    assert!(
        sums.iter().any(|s| mentions(s, line.trim_matches('"'))),
        "{sums:?}"
    );
    for b in main_requests(&model) {
        if let Err(e) = well_formed(&b) {
            panic!("{e}: {}", b["messages"]);
        }
    }
    // Stored, too: the tip's live rows pair up.
    let snap = ws.ok("session.resume", json!({"session_id": sid})).await;
    well_formed(&snap).expect("the tip's transcript pairs calls and results");
    let last = main_requests(&model).pop().expect("requests");
    assert_eq!(tag(&last_user(&last)), "T4");
}

#[actix_rt::test]
async fn max_attempts_bounds_the_compressions_of_one_turn() {
    // P3 is compressed before its request (the one allowed attempt), then overflows anyway.
    let model = FakeModel::start(|body| {
        if is_summary(body) {
            summary_reply()
        } else if tag(&last_user(body)) == "P3" {
            overflow()
        } else {
            ack(body)
        }
    });
    let home = Home::new();
    let mut cfg = pressure_config(&model.url, false);
    merge(&mut cfg, json!({"compression": {"max_attempts": 1}}));
    home.write_config(&cfg);
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.toolless("attempts", &home.path).await;
    let result = fourth_pressed_input_overflows(&home, &mut ws, &sid).await;
    assert_eq!(summaries(&model).len(), 1);
    assert_eq!(
        main_requests(&model)
            .iter()
            .filter(|b| tag(&last_user(b)) == "P3")
            .count(),
        1
    );
    assert!(
        result["error"]
            .as_str()
            .is_some_and(|e| e.contains("max compression attempts (1) reached")),
        "{result}"
    );
}

/// Inputs P0–P2, then P3, which fails `context_overflow`: its result.
async fn fourth_pressed_input_overflows(home: &Home, ws: &mut Ws, sid: &str) -> Value {
    for i in 0..3 {
        run(ws, home, sid, i).await;
    }
    ws.submit(sid, "P3", &pressure(3)).await;
    wait_until("P3", T, || home.admission("P3").status == "terminal").await;
    let row = home.admission("P3");
    assert_eq!(row.outcome.as_deref(), Some("failed"));
    let result: Value =
        serde_json::from_str(row.result_json.as_deref().unwrap_or("null")).expect("result");
    assert_eq!(result["reason"], "context_overflow");
    result
}

/// A summary that failed before a request is not asked for again when that request overflows:
/// with no old tool output to clear, the turn fails then (it asked a second time, as long again,
/// and likely failing again).
#[actix_rt::test]
async fn an_overflow_after_a_failed_summary_fails_the_turn_without_asking_again() {
    let model = FakeModel::start(|body| {
        if is_summary(body) {
            Reply::Status(500, json!({"error": {"message": "summariser down"}}))
        } else if tag(&last_user(body)) == "P3" {
            overflow()
        } else {
            ack(body)
        }
    });
    let home = Home::new();
    home.write_config(&pressure_config(&model.url, false));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.toolless("failed-once", &home.path).await;
    let result = fourth_pressed_input_overflows(&home, &mut ws, &sid).await;
    assert_eq!(summaries(&model).len(), 1, "asked once");
    assert!(
        result["error"]
            .as_str()
            .is_some_and(|e| e.contains("the summary failed earlier in this turn")),
        "{result}"
    );
}

/// A summary that fails is asked for once, not retried, and not again after the turn's tool
/// rounds: the turn goes on as it is.
/// P0 to P3 run in a session with the terminal tool, P3 past the threshold and answering with
/// one tool round; the summary model answers `summary`. The model and the session's id.
async fn p3_with_a_tool_round(
    summary: impl Fn() -> Reply + Send + Sync + 'static,
    name: &str,
) -> (FakeModel, Home, String) {
    let model = FakeModel::start(move |body| {
        if is_summary(body) {
            return summary();
        }
        if tag(&last_user(body)) == "P3" && !after_tool(body) {
            return Reply::Message(
                tool_call("t1", "terminal", json!({"command": "echo tool-round"})),
                "tool_calls",
            );
        }
        ack(body)
    });
    let home = Home::new();
    let mut cfg = pressure_config(&model.url, false);
    merge(
        &mut cfg,
        json!({"platform_toolsets": {"cli": ["terminal"]}}),
    );
    home.write_config(&cfg);
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws
        .create(name, &home.path, json!({"toolsets": ["terminal"]}))
        .await["session_id"]
        .as_str()
        .expect("sid")
        .to_string();
    for i in 0..4 {
        run(&mut ws, &home, &sid, i).await;
    }
    (model, home, sid)
}

#[actix_rt::test]
async fn a_failing_summary_is_asked_once_per_turn() {
    let down = || Reply::Status(500, json!({"error": {"message": "summariser down"}}));
    let (model, home, sid) = p3_with_a_tool_round(down, "failing").await;
    assert_eq!(
        summaries(&model).len(),
        1,
        "one summary request in P3's turn"
    );
    assert!(home.children(&sid).is_empty(), "nothing was compacted");
    let p3 = main_requests(&model)
        .into_iter()
        .filter(|b| tag(&last_user(b)) == "P3")
        .count();
    assert_eq!(
        p3, 2,
        "the tool call and the answer after it, sent as they were"
    );
}

/// A summary made but not kept (it came back longer than the turns it summarised) is not asked
/// for again in the turn: it was taken for "nothing to compact", and asked again after every
/// tool round, each time thrown away.
#[actix_rt::test]
async fn a_summary_longer_than_its_turns_is_not_asked_again_in_the_turn() {
    let long = || {
        let long = format!("{SUMMARY} {}", "s".repeat(60_000));
        Reply::Message(json!({"role": "assistant", "content": long}), "stop")
    };
    let (model, home, sid) = p3_with_a_tool_round(long, "long").await;
    assert_eq!(
        summaries(&model).len(),
        1,
        "one summary request in P3's turn"
    );
    assert!(home.children(&sid).is_empty(), "nothing was compacted");
}

/// A model that answers `MANY` with `rounds` terminal calls, one a response, the n-th printing
/// `bytes` bytes of the n-th letter, then `DONE_MANY`; it refuses a request of more than
/// `most_chars` characters as too long. It acks anything else.
fn many_rounds_model(rounds: usize, bytes: usize, most_chars: usize) -> FakeModel {
    FakeModel::start(move |body| {
        if is_summary(body) {
            return summary_reply();
        }
        if wire_chars(body) > most_chars {
            return Reply::Status(
                400,
                json!({"error": {"message": "too long", "code": "context_length_exceeded"}}),
            );
        }
        if last_user(body) != "MANY" {
            return ack(body);
        }
        let results = body["messages"]
            .as_array()
            .map_or(0, |m| m.iter().filter(|m| m["role"] == "tool").count());
        if results < rounds {
            let letter = (b'a' + results as u8) as char;
            return Reply::Message(
                tool_call(
                    &format!("m{results}"),
                    "terminal",
                    json!({"command": format!("head -c {bytes} /dev/zero | tr '\\0' {letter}")}),
                ),
                "tool_calls",
            );
        }
        Reply::Message(json!({"role": "assistant", "content": "DONE_MANY"}), "stop")
    })
}

/// `HI`, then `MANY`, each completed.
async fn hi_then_many(home: &Home, ws: &mut Ws, sid: &str) {
    completed_in_turn(home, ws, sid, &[("HI", "HI"), ("MANY", "MANY")]).await;
}

/// Each `(input id, text)` submitted once the one before completed.
async fn completed_in_turn(home: &Home, ws: &mut Ws, sid: &str, inputs: &[(&str, &str)]) {
    for &(id, text) in inputs {
        ws.submit(sid, id, text).await;
        wait_until(id, T, || home.admission(id).status == "terminal").await;
        assert_eq!(
            home.admission(id).outcome.as_deref(),
            Some("completed"),
            "{id}"
        );
    }
}

/// A turn whose transcript has nothing to summarise (the latest user message sits right after
/// the protected head) still clears old tool output when it passes the threshold, and goes on
/// without a summary request instead of overflowing.
#[actix_rt::test]
async fn old_tool_output_is_cleared_when_nothing_can_be_summarised() {
    let model = many_rounds_model(6, 8000, 40_000);
    let (home, _d, mut ws, sid) = tool_session(&model, 6000, (2, 1), "many").await;
    hi_then_many(&home, &mut ws, &sid).await;
    assert!(summaries(&model).is_empty(), "nothing to summarise");
    let last = main_requests(&model).last().cloned().expect("a request");
    assert_eq!(
        last["messages"]
            .as_array()
            .map(|m| m.iter().filter(|m| m["role"] == "tool").count()),
        Some(6)
    );
    assert!(
        mentions(&last, "[terminal] ran `head -c 8000 /dev/zero"),
        "old output is one line"
    );
    assert!(wire_chars(&last) < 40_000);
    let children = home.children(&sid);
    assert!(!children.is_empty(), "the cleared transcript was committed");
}

/// Clearing old tool output with nothing to summarise commits a copy of the transcript (a new
/// child session): a turn of many tool rounds clears again only once it has added
/// `2 × protect_last_n` messages since, not on every round (one child per round, each a copy
/// of the whole transcript, before).
#[actix_rt::test]
async fn clearing_old_tool_output_waits_for_the_turn_to_grow() {
    let model = many_rounds_model(12, 2000, usize::MAX);
    let (home, _d, mut ws, sid) = tool_session(&model, 1000, (2, 2), "rounds").await;
    hi_then_many(&home, &mut ws, &sid).await;
    assert!(summaries(&model).is_empty(), "nothing to summarise");
    let last = main_requests(&model).last().cloned().expect("a request");
    assert!(
        mentions(&last, "[terminal] ran `head -c 2000 /dev/zero"),
        "old output is one line"
    );
    // A clear every second round at most, from the fourth (the last six messages are kept):
    // each makes the next session of the lineage.
    let lineage = lineage_of(&home, &sid);
    // (Ten, clearing on every round: 9 copies of the transcript for 12 rounds.)
    assert!(
        (2..=7).contains(&lineage),
        "{lineage} sessions in the lineage"
    );
}

/// How many sessions the lineage of root `sid` has (the root and its compactions' children).
fn lineage_of(home: &Home, sid: &str) -> i64 {
    use diesel::prelude::*;
    use gatehouse::store::schema::sessions;
    sessions::table
        .filter(sessions::root_id.eq(sid))
        .count()
        .get_result(&mut home.db())
        .expect("lineage")
}

/// Clearing old tool output with nothing to summarise happens at most
/// `compression.max_attempts` (3) times in a turn, as summaries do: each commits a copy of the
/// whole transcript (a new child session), and a long turn of tool rounds made one every few
/// rounds (eleven in this one's 24 rounds; some forty in a turn of ninety).
#[actix_rt::test]
async fn clearing_old_tool_output_is_bounded_per_turn() {
    // (Rounds `a` to `x`: each prints its own letter.)
    let summarised = many_rounds_compacted((2, 2), "bounded").await;
    assert_eq!(summarised, 0, "nothing to summarise");
}

/// Summaries and clears of old tool output together are at most `compression.max_attempts`
/// (3) in a turn: each commits a copy of the whole transcript (a new child session). Counted
/// apart, a turn summarised once, then cleared three times: five sessions for one turn.
#[actix_rt::test]
async fn summaries_and_clears_together_are_bounded_per_turn() {
    // With one message protected at the head, `HI`'s long answer is the middle of the first
    // compaction (a summary); after it, only the summary is left to summarise, and old tool
    // output is cleared instead.
    let summarised = many_rounds_compacted((1, 2), "bounded-together").await;
    assert_eq!(summarised, 1, "one summary, then clears");
}

/// A turn of 24 tool rounds in a session protecting `protect` messages: at most three
/// compactions of it (the root and a child for each), every request well formed. The
/// summaries asked for.
async fn many_rounds_compacted(protect: (usize, usize), name: &str) -> usize {
    let model = many_rounds_model(24, 2000, usize::MAX);
    let (home, _d, mut ws, sid) = tool_session(&model, 1000, protect, name).await;
    hi_then_many(&home, &mut ws, &sid).await;
    let lineage = lineage_of(&home, &sid);
    assert!(
        (2..=4).contains(&lineage),
        "{lineage} sessions in the lineage"
    );
    for body in main_requests(&model) {
        well_formed(&body).expect("well-formed request");
    }
    summaries(&model).len()
}

/// A compaction that would not shrink the transcript is not made: with the latest user message
/// right after a one-message middle (a short answer), a summary would replace three characters
/// with a longer message. Before, the summary was asked for, the longer transcript committed
/// as a new child session, and an attempt used.
#[actix_rt::test]
async fn a_compaction_that_cannot_shrink_the_transcript_is_not_made() {
    let model = hi_then_tests_model("ACK".into(), SUMMARY.into());
    // `hi`, `ACK` and `run tests` are under the threshold; the tool's output passes it.
    let (home, _d, mut ws, sid) = tool_session(&model, 4000, (1, 2), "no-shrink").await;
    hi_then_tests(&home, &mut ws, &sid).await;
    let last = main_requests(&model).last().cloned().expect("a request");
    assert!(after_tool(&last), "the request after the tool round");
    assert!(
        tokens_of(&last) >= 4000,
        "the tool round passed the threshold: {}",
        tokens_of(&last)
    );
    assert!(
        summaries(&model).is_empty(),
        "no summary of `ACK` asked for"
    );
    assert_eq!(lineage_of(&home, &sid), 1, "no child session committed");
    assert!(!mentions(&last, SUMMARY));
}

/// A summary longer than the turns it replaces is not committed: the transcript would grow.
/// Before, it was, as a new child session.
#[actix_rt::test]
async fn a_summary_longer_than_what_it_replaces_is_not_committed() {
    let model = hi_then_tests_model(
        format!("ACK {}", "a".repeat(400)),
        format!("{SUMMARY} {}", "s".repeat(4000)),
    );
    let (home, _d, mut ws, sid) = tool_session(&model, 4000, (1, 2), "longer-summary").await;
    hi_then_tests(&home, &mut ws, &sid).await;
    assert_eq!(summaries(&model).len(), 1, "the answer was worth a summary");
    assert_eq!(lineage_of(&home, &sid), 1, "no child session committed");
    let last = main_requests(&model).last().cloned().expect("a request");
    assert!(!mentions(&last, SUMMARY));
}

/// A model that answers `hi` with `hi_answer`, `run tests` with a terminal call whose output
/// is 20,000 characters (then `DONE`), and summaries with `summary`.
fn hi_then_tests_model(hi_answer: String, summary: String) -> FakeModel {
    FakeModel::start(move |body| {
        if is_summary(body) {
            return Reply::Message(json!({"role": "assistant", "content": summary}), "stop");
        }
        let text = last_user(body);
        if text == "run tests" && !after_tool(body) {
            return Reply::Message(
                tool_call(
                    "call_tests",
                    "terminal",
                    json!({"command": "head -c 20000 /dev/zero | tr '\\0' x"}),
                ),
                "tool_calls",
            );
        }
        let content = if text == "hi" {
            hi_answer.as_str()
        } else {
            "DONE"
        };
        Reply::Message(json!({"role": "assistant", "content": content}), "stop")
    })
}

/// `hi`, then `run tests`, each completed.
async fn hi_then_tests(home: &Home, ws: &mut Ws, sid: &str) {
    completed_in_turn(home, ws, sid, &[("HI", "hi"), ("TESTS", "run tests")]).await;
}

/// A request's estimate: a quarter of its messages' characters.
fn tokens_of(body: &Value) -> usize {
    wire_chars(body) / 4
}

/// A turn that finds nothing to compact at first (its calls and their results cannot be split,
/// and the user message heads the transcript) compacts once it has grown: before, the first
/// "nothing to compact" ended preflight compaction for the rest of the turn, and a turn of many
/// tool rounds sent ever larger requests (326 MB in the audit) without ever compacting.
#[actix_rt::test]
async fn a_turn_with_nothing_to_compact_at_first_compacts_once_it_has_grown() {
    let model = FakeModel::start(|body| {
        if is_summary(body) {
            return summary_reply();
        }
        let results = body["messages"]
            .as_array()
            .map_or(0, |m| m.iter().filter(|m| m["role"] == "tool").count());
        // Rounds of two calls (counted in this request: a compaction summarises earlier ones).
        let round = body["messages"].to_string().matches("round-").count() / 2;
        if results < 4 && round < 6 {
            return Reply::Message(
                tool_calls(&[
                    (
                        "a",
                        "terminal",
                        json!({"command": format!("echo round-{round}-a")}),
                    ),
                    (
                        "b",
                        "terminal",
                        json!({"command": format!("echo round-{round}-b")}),
                    ),
                ]),
                "tool_calls",
            );
        }
        Reply::Message(json!({"role": "assistant", "content": "DONE_GROW"}), "stop")
    });
    let (home, _d, mut ws, sid) = tool_session(&model, 3000, (1, 1), "grow").await;
    // The user message alone passes the threshold, and heads the transcript.
    ws.submit(&sid, "GROW", &format!("GROW {}", "u".repeat(14_000)))
        .await;
    wait_until("GROW", T, || home.admission("GROW").status == "terminal").await;
    assert_eq!(home.admission("GROW").outcome.as_deref(), Some("completed"));
    assert!(
        !summaries(&model).is_empty(),
        "the grown transcript was summarised in the same turn"
    );
    assert!(!home.children(&sid).is_empty(), "the compaction committed");
    for body in main_requests(&model) {
        well_formed(&body).expect("well-formed request");
    }
}

/// A summary model that ignores its budget does not fill the transcript: its summary is cut at
/// sixteen characters a token of the budget (400 tokens at an 8K window), saying so. Before,
/// a 7 MB summary was kept whole and every later turn overflowed.
#[actix_rt::test]
async fn an_oversized_summary_is_cut_to_its_budget() {
    let model = FakeModel::start(|body| {
        if is_summary(body) {
            let huge = format!("{SUMMARY} {}", "s".repeat(200_000));
            return Reply::Message(json!({"role": "assistant", "content": huge}), "stop");
        }
        ack(body)
    });
    // A window small enough that the summary, cut to its budget, is still shorter than the
    // turns it replaces (a longer one is not committed).
    let home = Home::new();
    let mut cfg = pressure_config(&model.url, false);
    merge(&mut cfg, json!({"model": {"context_length": 8000}}));
    home.write_config(&cfg);
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.toolless("huge-summary", &home.path).await;
    for i in 0..4 {
        run(&mut ws, &home, &sid, i).await;
    }
    let child = home.children(&sid).pop().expect("compacted into a child");
    let summary = home
        .transcript(&child)
        .into_iter()
        .filter_map(|m| m.content)
        .find(|c| c.contains(SUMMARY))
        .expect("the summary");
    // The budget's characters, and the frame the summary is kept in.
    assert!(
        (400 * 16..400 * 16 + 4_000).contains(&summary.len()),
        "{} chars",
        summary.len()
    );
    assert!(
        summary.contains("[The summary was cut here"),
        "cut, saying so"
    );
}

/// A summary model that thinks in `<think>` blocks (a reasoning model served without a
/// reasoning parser) has its summary kept without them: the thoughts were stored with it and
/// sent with every later request. One cut short by its output limit says so (it was taken for
/// the whole summary).
#[actix_rt::test]
async fn a_summary_is_kept_without_its_thinking() {
    let model = FakeModel::start(|body| {
        if is_summary(body) {
            let thought = format!(
                "<think>PRIVATE_MUSING {}</think>\n{SUMMARY}",
                "m".repeat(500)
            );
            return Reply::Message(json!({"role": "assistant", "content": thought}), "length");
        }
        ack(body)
    });
    let (home, _d, mut ws, sid) = pressure_session(&model, false, "thinking-summary").await;
    for i in 0..4 {
        run(&mut ws, &home, &sid, i).await;
    }
    let child = home.children(&sid).pop().expect("compacted into a child");
    let contents: Vec<String> = home
        .transcript(&child)
        .into_iter()
        .filter_map(|m| m.content)
        .collect();
    assert!(contents.iter().any(|c| c.contains(SUMMARY)), "{contents:?}");
    assert!(
        !contents.iter().any(|c| c.contains("PRIVATE_MUSING")),
        "{contents:?}"
    );
    // It was cut short by its output limit (`finish_reason: length`): kept, and said to be.
    assert!(
        contents
            .iter()
            .any(|c| c.contains("cut short by the model's output limit")),
        "{contents:?}"
    );
}

/// After a compression, a client may name its session by the new tip's id: inputs it pipelines
/// naming the tip and the root in turn are admitted in the order it sent them. A submit naming
/// the tip looks its session up first; one naming the followed root went straight to the
/// session and overtook it.
#[actix_rt::test]
async fn inputs_pipelined_by_tip_and_root_are_admitted_in_the_order_sent() {
    use crate::hostile::RawWs;
    let model = summarising_model();
    let (home, d, mut ws, root) = pressure_session(&model, false, "by-tip").await;
    for i in 0..4 {
        run(&mut ws, &home, &root, i).await;
    }
    let tip = home.children(&root).pop().expect("a child session");
    let mut raw = RawWs::connect(&home.path, &d.origin());
    raw.write_all(&RawWs::masked_text(
        json!({"jsonrpc": "2.0", "id": "r", "method": "session.resume", "params": {"session_id": root}})
            .to_string()
            .as_bytes(),
    ));
    assert_eq!(raw.reply()["id"], "r");
    let mut expected = Vec::new();
    let mut bytes = Vec::new();
    for i in 0..24 {
        let input = format!("by-{i:02}");
        let named = if i % 2 == 0 { &tip } else { &root };
        bytes.extend(RawWs::masked_text(
            json!({"jsonrpc": "2.0", "id": input, "method": "prompt.submit",
                   "params": {"session_id": named, "input_id": input, "text": format!("short {i}")}})
            .to_string()
            .as_bytes(),
        ));
        expected.push(input);
    }
    raw.write_all(&bytes);
    for _ in 0..expected.len() {
        let v = raw.reply();
        assert!(v.get("error").is_none(), "{v}");
    }
    let admitted: Vec<String> = home
        .admissions()
        .into_iter()
        .map(|a| a.request_id)
        .filter(|id| id.starts_with("by-"))
        .collect();
    assert_eq!(admitted, expected, "admitted in another order than sent");
}

/// A stop after a compaction committed, while the compacting turn's request hangs: the child
/// persists (one, the root ended by compression, no second summary), the compacting input is
/// never sent to the main model again, the inputs queued behind it run on the child after the
/// restart (their rows in the child, the summary in their requests, the compacted middle not),
/// and the child's transcript from before the stop is a prefix of the one after. Graceful: the
/// compacting input settles interrupted and the queue runs on its own. Crash: it is unknown and
/// holds the queue until the operator resolves it.
async fn inputs_behind_a_compaction_run_on_the_child_after(crash: bool) {
    let model = FakeModel::start(|body| {
        if is_summary(body) {
            summary_reply()
        } else if tag(&last_user(body)) == "P3" {
            Reply::Hang
        } else {
            ack(body)
        }
    });
    let (home, mut d, mut ws, root) = pressure_session(&model, false, "restarted").await;
    for i in 0..3 {
        run(&mut ws, &home, &root, i).await;
    }
    ws.submit(&root, "P3", &pressure(3)).await;
    let compacting = |m: &FakeModel| {
        main_requests(m)
            .iter()
            .filter(|b| tag(&last_user(b)) == "P3")
            .count()
    };
    wait_until("P3 at the main model, compacted", T, || {
        compacting(&model) == 1
    })
    .await;
    let child = home.children(&root).pop().expect("the child");
    for f in ["F1", "F2"] {
        ws.submit(&root, f, f).await;
    }
    let before: Vec<(i64, Option<String>)> = home
        .transcript(&child)
        .iter()
        .map(|m| (m.id, m.content.clone()))
        .collect();
    drop(ws);
    if crash {
        d.kill();
    } else {
        assert_eq!(d.term(), Some(0));
    }
    model.release();
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let p3 = home.admission("P3");
    if crash {
        assert_eq!(p3.status, "unknown");
        assert_eq!(
            home.admission("F1").status,
            "queued",
            "held by the unknown P3"
        );
        ws.ok("session.resume", json!({"session_id": root})).await;
        ws.ok(
            "prompt.resolve_unknown",
            json!({"session_id": root, "admission_id": p3.admission_id,
                   "execution_generation": p3.execution_generation}),
        )
        .await;
    } else {
        assert_eq!(
            (p3.status.as_str(), p3.outcome.as_deref()),
            ("terminal", Some("interrupted"))
        );
    }
    wait_until("the followers", T, || all_terminal(&home)).await;
    for f in ["F1", "F2"] {
        assert_eq!(
            home.admission(f).outcome.as_deref(),
            Some("completed"),
            "{f}"
        );
    }
    assert_eq!(
        home.children(&root),
        std::slice::from_ref(&child),
        "still one child"
    );
    assert_eq!(home.end_reason(&root).as_deref(), Some("compression"));
    assert_eq!(summaries(&model).len(), 1, "the summary was made once");
    assert_eq!(compacting(&model), 1, "P3 was never sent again");
    let child_users = user_tags(&home.all_messages(&child));
    assert!(
        child_users.ends_with(&["P3".to_string(), "F1".to_string(), "F2".to_string()]),
        "{child_users:?}"
    );
    assert!(!user_tags(&home.all_messages(&root)).contains(&"F1".to_string()));
    let f1 = main_requests(&model)
        .into_iter()
        .find(|b| last_user(b) == "F1")
        .expect("F1's request");
    assert!(mentions(&f1, SUMMARY), "the summary, not the middle");
    assert!(!mentions(&f1, "P1 u"), "the compacted middle is not sent");
    let after: Vec<(i64, Option<String>)> = home
        .transcript(&child)
        .iter()
        .map(|m| (m.id, m.content.clone()))
        .collect();
    assert_eq!(&after[..before.len()], &before[..], "a verbatim prefix");
    let snap = ws.ok("session.resume", json!({"session_id": root})).await;
    let shown = snap["messages"].to_string();
    assert!(shown.contains(SUMMARY) && shown.contains("ACK_F1") && shown.contains("ACK_F2"));
}

#[actix_rt::test]
async fn inputs_behind_a_compaction_run_on_the_child_after_a_graceful_restart() {
    inputs_behind_a_compaction_run_on_the_child_after(false).await;
}

#[actix_rt::test]
async fn inputs_behind_a_compaction_run_on_the_child_after_a_crash() {
    inputs_behind_a_compaction_run_on_the_child_after(true).await;
}
