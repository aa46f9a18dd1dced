//! Context compression: which messages are kept verbatim (a protected head and tail, never
//! splitting a tool call from its results), how the middle is put to the summary model, and how
//! the compacted transcript is assembled.

use serde_json::{json, Value};

use crate::store::messages::NewMessage;

pub const SUMMARY_PREFIX: &str =
    "[CONTEXT COMPACTION] Earlier turns of this conversation were compacted into the \
summary below. Treat it as background reference only; respond to the latest user message.";

/// `display_kind` of a summary stored as its own message.
pub const SUMMARY_KIND: &str = "compaction_summary";

/// The three parts of a transcript to compact.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub head: Vec<NewMessage>,
    pub middle: Vec<NewMessage>,
    pub tail: Vec<NewMessage>,
}

fn rough(m: &NewMessage) -> usize {
    m.content.as_deref().map_or(0, str::len) / 4
        + m.tool_calls.as_deref().map_or(0, str::len) / 4
        + m.reasoning.as_deref().map_or(0, str::len) / 4
        + 10
}

/// Split `t` into head / middle / tail, or `None` when there is nothing worth compacting.
pub fn plan(
    t: &[NewMessage],
    first_n: usize,
    last_n: usize,
    tail_budget_tokens: usize,
) -> Option<Plan> {
    let n = t.len();
    if n <= first_n + last_n + 1 {
        return None;
    }
    let mut start = first_n;
    while start < n && t[start].role == "tool" {
        start += 1;
    }
    // Walk back from the end within the budget, keeping at least `last_n` messages.
    let mut kept = 0usize;
    let mut used = 0usize;
    let mut end = n;
    while end > 0 {
        let cost = rough(&t[end - 1]);
        if kept >= last_n && used + cost > tail_budget_tokens {
            break;
        }
        used += cost;
        kept += 1;
        end -= 1;
    }
    // The tail keeps one message at least, whatever `last_n` (at 0 the running turn's latest
    // results were summarised and the transcript ended on the summary).
    let last_n = last_n.max(1);
    end = end.min(n.saturating_sub(last_n));
    if end <= start {
        end = n.saturating_sub(last_n);
    }
    // The latest user message is what the model must answer: it always stays verbatim in the
    // tail, however small `last_n` or the budget. An earlier summary stored as a user message
    // of its own is not it (taken for it, it kept everything after it from being summarised
    // again); a user message a summary was merged into is (it is the question asked).
    if let Some(last_user) = t
        .iter()
        .rposition(|m| m.role == "user" && m.display_kind.as_deref() != Some(SUMMARY_KIND))
    {
        if last_user >= start {
            end = end.min(last_user);
        }
    }
    // Never split an assistant's tool calls from their results: move the cut back to the call.
    while end > start && end < n && t[end].role == "tool" {
        end -= 1;
    }
    if end <= start {
        return None;
    }
    // Only an earlier summary in the middle: summarising it again would shrink nothing.
    if t[start..end].iter().all(is_summary) {
        return None;
    }
    Some(Plan {
        head: t[..start].to_vec(),
        middle: t[start..end].to_vec(),
        tail: t[end..].to_vec(),
    })
}

/// Can a summary of `plan`'s middle win room: is the middle larger than the least a summary
/// takes (its prefix, as a message of its own)? A smaller one (a short answer between the head
/// and the latest user message) is replaced by a longer message, whatever the summary says.
pub fn summary_can_shrink(plan: &Plan) -> bool {
    let least = NewMessage::text("assistant", format!("{SUMMARY_PREFIX}\n\n"));
    plan.middle.iter().map(rough).sum::<usize>() > rough(&least)
}

/// Is `m` an earlier summary: stored as its own message, or merged into the message it was put
/// before (which then starts with [`SUMMARY_PREFIX`])?
fn is_summary(m: &NewMessage) -> bool {
    m.display_kind.as_deref() == Some(SUMMARY_KIND)
        || m.content
            .as_deref()
            .is_some_and(|c| c.starts_with(SUMMARY_PREFIX))
}

/// Tool results longer than this, outside the protected tail, become one line before compaction.
pub const OLD_TOOL_OUTPUT_CHARS: usize = 200;

/// The cheap pre-pass of a compaction: every tool result older than the protected tail (the
/// last `3 × protect_last_n` messages) and longer than [`OLD_TOOL_OUTPUT_CHARS`] becomes one line
/// saying what ran and how it ended, e.g. ``[terminal] ran `ls -la /srv` -> exit 0, 40 lines
/// output``. Roles, ids and the pairing of calls and results are kept, and a line is short, so a
/// second pass changes nothing. Applies to what the summary model is sent and to what is kept.
pub fn clear_old_tool_output(t: &[NewMessage], protect_last_n: usize) -> Vec<NewMessage> {
    // The results that end the transcript are the latest round's, which the model has not yet
    // read: kept whatever their place (a response of more calls than the protected tail had
    // its first results cleared before they were ever sent, and the model ran them again).
    let unread = t
        .iter()
        .rposition(|m| m.role != "tool")
        .map_or(0, |last| last + 1);
    let old = t
        .len()
        .saturating_sub(protect_last_n.saturating_mul(3))
        .min(unread);
    // Each result's call (its tool name and arguments), found by id among the calls of the
    // assistant message before it: ids repeat across responses (a provider that sends none
    // gets `call_0` for every response's first call), and one map of the whole transcript
    // named the last such call for every result.
    let mut call_of: Vec<Option<(String, Value)>> = vec![None; old];
    let mut calls: std::collections::HashMap<String, (String, Value)> = Default::default();
    for (i, m) in t[..old].iter().enumerate() {
        if m.role == "tool" {
            call_of[i] = m
                .tool_call_id
                .as_deref()
                .and_then(|id| calls.get(id))
                .cloned();
            continue;
        }
        if m.role == "assistant" {
            calls.clear();
        }
        let Some(list) = m.tool_calls.as_deref() else {
            continue;
        };
        for c in serde_json::from_str::<Vec<Value>>(list).unwrap_or_default() {
            let (Some(id), Some(name)) = (
                c.get("id").and_then(Value::as_str),
                c.pointer("/function/name").and_then(Value::as_str),
            ) else {
                continue;
            };
            let args = c
                .pointer("/function/arguments")
                .and_then(Value::as_str)
                .and_then(|a| serde_json::from_str::<Value>(a).ok())
                .unwrap_or(Value::Null);
            calls.insert(id.to_string(), (name.to_string(), args));
        }
    }
    let mut out = t.to_vec();
    for (m, call) in out[..old].iter_mut().zip(&call_of) {
        if m.role != "tool" {
            continue;
        }
        let Some(content) = m.content.as_deref() else {
            continue;
        };
        let chars = content.chars().count();
        if chars <= OLD_TOOL_OUTPUT_CHARS {
            continue;
        }
        let call = call.as_ref();
        let name = call
            .map(|(n, _)| n.as_str())
            .or(m.tool_name.as_deref())
            .unwrap_or("tool");
        let line = match (name, call) {
            ("terminal", Some((_, args))) => {
                let command: String = args
                    .get("command")
                    .and_then(Value::as_str)
                    .unwrap_or("?")
                    .chars()
                    .take(120)
                    .collect();
                let result: Value = serde_json::from_str(content).unwrap_or(Value::Null);
                match (
                    result.get("exit_code").and_then(Value::as_i64),
                    result.get("output").and_then(Value::as_str),
                ) {
                    (Some(code), Some(output)) => format!(
                        "[terminal] ran `{command}` -> exit {code}, {} lines output",
                        output.lines().count()
                    ),
                    _ => format!("[terminal] ran `{command}` -> {chars} chars of output cleared"),
                }
            }
            _ => format!("[{name}] {chars} chars of output cleared to save context space"),
        };
        m.content = Some(line);
    }
    out
}

fn clip(text: &str) -> String {
    if text.chars().count() <= 3000 {
        return text.to_string();
    }
    let head: String = text.chars().take(2000).collect();
    let tail: String = text
        .chars()
        .rev()
        .take(800)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    format!("{head}...[truncated]...{tail}")
}

/// The most of an earlier summary put to the summary model (it is the model's own output, so
/// this only guards against a runaway one).
const MAX_PREVIOUS_SUMMARY_CHARS: usize = 40_000;

fn bound_summary(text: &str) -> String {
    if text.chars().count() <= MAX_PREVIOUS_SUMMARY_CHARS {
        return text.to_string();
    }
    let kept: String = text.chars().take(MAX_PREVIOUS_SUMMARY_CHARS).collect();
    format!("{kept}...[truncated]")
}

/// The body of the summary request (non-streaming) for `middle`: it may answer in twice the
/// summary's budget, a fifth of the middle's size kept between 2,000 tokens and `max_summary`.
pub fn summary_request(
    model: &str,
    middle: &[NewMessage],
    previous_summary: Option<&str>,
    max_summary: u64,
) -> Value {
    summary_request_within(model, middle, previous_summary, max_summary, Within::WHOLE)
}

/// What a summary request may hold, in characters: its turns (the oldest are left out past
/// this) and the earlier summaries it updates (their ends are left out past this).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Within {
    pub turns: usize,
    pub earlier: usize,
}

impl Within {
    pub const WHOLE: Within = Within {
        turns: usize::MAX,
        earlier: usize::MAX,
    };
}

/// How many characters a summary request's prompt has.
pub fn turn_chars(body: &Value) -> usize {
    body["messages"][0]["content"]
        .as_str()
        .map_or(0, |t| t.chars().count())
}

/// [`summary_request`] whose turns take at most `within.turns` characters: past that the
/// oldest are left out, and the request says so (a summary model with a smaller window than
/// the session's refused the whole middle every time, and the session failed every turn once
/// its own window overflowed); and whose earlier summaries take at most `within.earlier`
/// (whole, one filled a small window by itself, and the session never compacted again).
pub fn summary_request_within(
    model: &str,
    middle: &[NewMessage],
    previous_summary: Option<&str>,
    max_summary: u64,
    within: Within,
) -> Value {
    let max_turn_chars = within.turns;
    let budget = ((middle.iter().map(rough).sum::<usize>() as f64 * 0.2) as u64)
        .max(2_000)
        .min(max_summary)
        .max(1);
    let mut turns = String::new();
    // An earlier compaction's summary in the middle is the summary to update, whole (up to its
    // own bound), not a turn to clip to 2,800 characters: clipped, each compaction would keep
    // less of what the ones before it kept.
    let mut earlier: Vec<String> = previous_summary.map(str::to_string).into_iter().collect();
    for m in middle {
        let raw = m.content.as_deref().unwrap_or("");
        let content =
            if m.display_kind.as_deref() == Some(SUMMARY_KIND) || raw.starts_with(SUMMARY_PREFIX) {
                earlier.push(bound_summary(raw.trim_start_matches(SUMMARY_PREFIX).trim()));
                // A summary merged into a message with tool calls (its text, after the summary's,
                // went with it): the calls are still turns, or their results would answer nothing.
                if m.tool_calls.is_none() {
                    continue;
                }
                String::new()
            } else {
                clip(raw)
            };
        match m.role.as_str() {
            "user" => turns.push_str(&format!("[USER]: {content}\n\n")),
            "assistant" => {
                turns.push_str(&format!("[ASSISTANT]: {content}\n"));
                if let Some(calls) = m.tool_calls.as_deref() {
                    let calls: Vec<Value> = serde_json::from_str(calls).unwrap_or_default();
                    let list: Vec<String> = calls
                        .iter()
                        .map(|c| {
                            let name = c
                                .pointer("/function/name")
                                .and_then(|v| v.as_str())
                                .unwrap_or("?");
                            let args = c
                                .pointer("/function/arguments")
                                .and_then(|v| v.as_str())
                                .unwrap_or("");
                            let args: String = args.chars().take(400).collect();
                            format!("{name}({args})")
                        })
                        .collect();
                    if !list.is_empty() {
                        turns.push_str(&format!("[Tool calls: {}]\n", list.join(", ")));
                    }
                }
                turns.push('\n');
            }
            "tool" => turns.push_str(&format!(
                "[TOOL RESULT {}]: {content}\n\n",
                m.tool_call_id.as_deref().unwrap_or("")
            )),
            _ => {}
        }
    }
    let total = turns.chars().count();
    if total > max_turn_chars {
        let cut = turns
            .char_indices()
            .nth(total - max_turn_chars)
            .map_or(turns.len(), |(at, _)| at);
        turns = format!(
            "[The oldest {} characters of these turns did not fit the summary model and are left \
             out.]\n\n{}",
            total - max_turn_chars,
            &turns[cut..]
        );
    }
    let previous = if earlier.is_empty() {
        String::new()
    } else {
        let mut earlier = earlier.join("\n\n");
        if let Some((cut, _)) = earlier.char_indices().nth(within.earlier) {
            earlier.truncate(cut);
            earlier.push_str("\n[The rest of the earlier summary did not fit the summary model.]");
        }
        format!(
            "An earlier summary exists; update it with the new turns rather than starting over:\n{earlier}\n\n"
        )
    };
    let prompt = format!(
        "Summarise the conversation turns below so that work can continue without them. Use these headings: \
         Goal, Constraints, Progress (Done / In Progress / Blocked), Key Decisions, Relevant Files, Next Steps, \
         Critical Context. Be specific and keep every fact needed to continue.\n\n{previous}TURNS:\n\n{turns}"
    );
    json!({
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0.3,
        "max_tokens": 2 * budget,
    })
}

/// Head, then the summary (as its own message, or merged into the first tail message when its role
/// would clash on both sides), then the tail.
pub fn assemble(plan: &Plan, summary: &str) -> Vec<NewMessage> {
    let text = format!("{SUMMARY_PREFIX}\n\n{}", summary.trim());
    let last_head = plan.head.last().map(|m| m.role.as_str());
    let first_tail = plan.tail.first().map(|m| m.role.as_str());
    let mut role = if matches!(last_head, Some("assistant") | Some("tool")) {
        "user"
    } else {
        "assistant"
    };
    let mut merge = false;
    if Some(role) == first_tail {
        role = if role == "user" { "assistant" } else { "user" };
        if Some(role) == last_head {
            merge = true;
        }
    }
    let mut out = plan.head.clone();
    let mut tail = plan.tail.clone();
    if merge {
        if let Some(first) = tail.first_mut() {
            let original = first.content.clone().unwrap_or_default();
            first.content = Some(format!("{text}\n\n{original}"));
        }
    } else {
        out.push(NewMessage {
            role: role.into(),
            content: Some(text),
            display_kind: Some(SUMMARY_KIND.into()),
            ..Default::default()
        });
    }
    out.extend(tail);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(role: &str, content: &str) -> NewMessage {
        NewMessage::text(role, content)
    }

    fn call(id: &str) -> NewMessage {
        NewMessage {
            role: "assistant".into(),
            tool_calls: Some(format!(
                r#"[{{"id":"{id}","type":"function","function":{{"name":"terminal","arguments":"{{}}"}}}}]"#
            )),
            ..Default::default()
        }
    }

    fn result(id: &str) -> NewMessage {
        NewMessage {
            role: "tool".into(),
            content: Some("out".into()),
            tool_call_id: Some(id.into()),
            ..Default::default()
        }
    }

    #[test]
    fn too_short_is_left_alone() {
        let t = vec![m("user", "a"), m("assistant", "b"), m("user", "c")];
        assert!(plan(&t, 1, 2, 100).is_none());
    }

    #[test]
    fn head_and_tail_are_protected_and_the_summary_merges_when_roles_clash() {
        let t = vec![
            m("user", "P0"),
            m("assistant", "A0"),
            m("user", "P1"),
            m("assistant", "A1"),
            m("user", "P2"),
        ];
        let p = plan(&t, 1, 2, 1).expect("plan");
        assert_eq!(p.head, vec![m("user", "P0")]);
        assert_eq!(p.tail, vec![m("assistant", "A1"), m("user", "P2")]);
        assert_eq!(p.middle.len(), 2);
        let out = assemble(&p, "FACTS");
        assert_eq!(out.len(), 3);
        assert!(out[1]
            .content
            .as_deref()
            .is_some_and(|c| c.contains("FACTS") && c.ends_with("A1")));
    }

    #[test]
    fn a_tool_pair_at_the_boundary_is_never_split() {
        // The tail would start at the tool result; the cut moves back to its call.
        let t = vec![
            m("user", "P0"),
            m("assistant", "A0"),
            m("user", "P1"),
            call("x"),
            result("x"),
            m("user", "P2"),
        ];
        let p = plan(&t, 1, 2, 1).expect("plan");
        assert_eq!(p.tail.first().map(|m| m.role.as_str()), Some("assistant"));
        assert!(p.tail.first().is_some_and(|m| m.tool_calls.is_some()));
        assert!(p.middle.iter().all(|m| m.role != "tool"));
        let out = assemble(&p, "S");
        assert!(out
            .iter()
            .any(|m| m.content.as_deref().is_some_and(|c| c.contains("S"))));
    }

    #[test]
    fn head_never_starts_the_middle_with_a_tool_result() {
        let t = vec![
            call("x"),
            result("x"),
            m("user", "P1"),
            m("assistant", "A1"),
            m("user", "P2"),
            m("assistant", "A2"),
            m("user", "P3"),
        ];
        let p = plan(&t, 1, 2, 1).expect("plan");
        assert_eq!(
            p.head.len(),
            2,
            "the call's result stays with its call in the head"
        );
        assert_ne!(p.middle.first().map(|m| m.role.as_str()), Some("tool"));
    }

    #[test]
    fn the_latest_user_message_stays_in_the_tail() {
        let t = vec![
            m("user", "P0"),
            m("assistant", "A0"),
            m("user", "P1"),
            m("assistant", "A1"),
            m("user", &"P2".repeat(1000)),
        ];
        // No protected tail and a budget smaller than the last message alone.
        let p = plan(&t, 1, 0, 1).expect("plan");
        assert_eq!(p.tail.first().map(|m| m.role.as_str()), Some("user"));
        assert_eq!(p.tail.len(), 1);
        assert_eq!(p.middle.len(), 3);
        // A turn in progress: the user message and everything after it are kept.
        let t = vec![
            m("user", "P0"),
            m("assistant", "A0"),
            m("user", "P1"),
            m("assistant", "A1"),
            m("user", "P2"),
            call("x"),
            result("x"),
            call("y"),
            result("y"),
        ];
        let p = plan(&t, 1, 2, 1).expect("plan");
        assert_eq!(
            p.tail.first().and_then(|m| m.content.as_deref()),
            Some("P2")
        );
        assert_eq!(p.tail.len(), 5);
    }

    #[test]
    fn a_lone_earlier_summary_is_not_compacted_again() {
        let mut t = vec![m("user", "P0"), m("assistant", "A0"), m("user", "P1")];
        for i in 0..4 {
            t.push(m("assistant", &format!("A{i}")));
            t.push(m("user", &format!("Q{i}")));
        }
        let p = plan(&t, 1, 2, 30).expect("plan");
        let once = assemble(&p, "S");
        assert!(once
            .iter()
            .any(|m| m.display_kind.as_deref() == Some(SUMMARY_KIND)));
        assert!(plan(&once, 1, 2, 30).is_none(), "{once:?}");
    }

    fn terminal_call(id: &str, command: &str) -> NewMessage {
        let args = json!({ "command": command }).to_string();
        NewMessage {
            role: "assistant".into(),
            tool_calls: Some(
                json!([{"id": id, "type": "function", "function": {"name": "terminal", "arguments": args}}])
                    .to_string(),
            ),
            ..Default::default()
        }
    }

    fn tool_output(id: &str, name: &str, content: String) -> NewMessage {
        NewMessage {
            role: "tool".into(),
            content: Some(content),
            tool_call_id: Some(id.into()),
            tool_name: Some(name.into()),
            ..Default::default()
        }
    }

    #[test]
    fn old_long_tool_output_becomes_one_line_and_the_tail_is_kept() {
        let listing: String = (0..40).map(|i| format!("file-{i}\n")).collect();
        let big = json!({"output": listing, "exit_code": 0, "error": null}).to_string();
        let mut t = vec![
            m("user", "P0"),
            terminal_call("a", "ls -la /srv"),
            tool_output("a", "terminal", big.clone()),
            NewMessage {
                role: "assistant".into(),
                tool_calls: Some(
                    json!([{"id": "b", "type": "function", "function": {"name": "fetch", "arguments": "{}"}}])
                        .to_string(),
                ),
                ..Default::default()
            },
            tool_output("b", "fetch", "w".repeat(500)),
            tool_output("s", "terminal", "short".into()),
        ];
        // The protected tail: 3 × protect_last_n = 3 messages, one of them a long result.
        t.push(terminal_call("c", "cat big"));
        t.push(tool_output("c", "terminal", big.clone()));
        t.push(m("user", "P1"));
        let out = clear_old_tool_output(&t, 1);
        assert_eq!(
            out[2].content.as_deref(),
            Some("[terminal] ran `ls -la /srv` -> exit 0, 40 lines output")
        );
        assert_eq!(
            out[4].content.as_deref(),
            Some("[fetch] 500 chars of output cleared to save context space")
        );
        assert_eq!(out[5].content.as_deref(), Some("short"));
        assert_eq!(
            out[7].content.as_deref(),
            Some(big.as_str()),
            "the tail is untouched"
        );
        // Roles, ids and pairing are kept; a second pass changes nothing.
        assert!(out.iter().zip(&t).all(|(a, b)| a.role == b.role
            && a.tool_call_id == b.tool_call_id
            && a.tool_calls == b.tool_calls));
        assert_eq!(clear_old_tool_output(&out, 1), out);
    }

    /// The results that end the transcript, the latest round's, are the model's yet to read:
    /// none is cleared, however many there are beside the protected tail.
    #[test]
    fn the_latest_rounds_results_are_never_cleared() {
        let big = json!({"output": "x\n".repeat(200), "exit_code": 0}).to_string();
        let ids: Vec<String> = (0..8).map(|i| format!("c{i}")).collect();
        let calls: Vec<Value> = ids
            .iter()
            .map(|id| json!({"id": id, "type": "function",
                             "function": {"name": "terminal", "arguments": "{\"command\":\"cat f\"}"}}))
            .collect();
        let mut t = vec![
            m("user", "P0"),
            terminal_call("a", "ls"),
            tool_output("a", "terminal", big.clone()),
            m("assistant", "read it"),
            m("user", "P1"),
            NewMessage {
                role: "assistant".into(),
                tool_calls: Some(Value::from(calls).to_string()),
                ..Default::default()
            },
        ];
        for id in &ids {
            t.push(tool_output(id, "terminal", big.clone()));
        }
        let out = clear_old_tool_output(&t, 1);
        // The earlier round's result, read by the model, is cleared; the latest round's are not.
        assert_eq!(
            out[2].content.as_deref(),
            Some("[terminal] ran `ls` -> exit 0, 200 lines output")
        );
        assert!(out[6..]
            .iter()
            .all(|r| r.content.as_deref() == Some(big.as_str())));
    }

    /// Each cleared result names the call of its own response: ids repeat across responses (a
    /// provider that sends none gets `call_0` for each response's first call), and every result
    /// was named after the last call with its id.
    #[test]
    fn a_cleared_result_names_the_call_of_its_own_response() {
        let big = json!({"output": "x\n".repeat(200), "exit_code": 0}).to_string();
        let mut t = vec![m("user", "P0")];
        for command in ["ls", "rm -rf build", "cat cfg"] {
            t.push(terminal_call("call_0", command));
            t.push(tool_output("call_0", "terminal", big.clone()));
        }
        t.push(m("user", "P1"));
        let out = clear_old_tool_output(&t, 0);
        for (i, command) in [(2, "ls"), (4, "rm -rf build"), (6, "cat cfg")] {
            assert_eq!(
                out[i].content.as_deref(),
                Some(format!("[terminal] ran `{command}` -> exit 0, 200 lines output").as_str())
            );
        }
    }

    /// After a compaction that stored its summary as a user message (the head ended on a tool
    /// result, the tail began with a call), the summary is not taken for the latest user message:
    /// it kept the rest of the turn from ever being summarised again.
    #[test]
    fn a_summary_stored_as_a_user_message_is_not_the_message_to_answer() {
        let mut t = vec![m("user", "P0"), call("a"), result("a")];
        t.push(NewMessage {
            display_kind: Some(SUMMARY_KIND.into()),
            ..m("user", &format!("{SUMMARY_PREFIX}\nS"))
        });
        for i in 0..8 {
            let id = format!("c{i}");
            t.push(call(&id));
            t.push(result(&id));
        }
        let p = plan(&t, 3, 2, 0).expect("a plan");
        assert!(p.middle.len() > 1, "{p:?}");
    }

    /// A middle no larger than a summary's prefix is not worth a summary: any summary of it
    /// is longer.
    #[test]
    fn a_middle_smaller_than_a_summary_is_not_worth_one() {
        let t = vec![
            m("user", "hi"),
            m("assistant", "ACK"),
            m("user", "run tests"),
            call("a"),
            result("a"),
        ];
        let p = plan(&t, 1, 2, 0).expect("a plan");
        assert_eq!(p.middle, vec![m("assistant", "ACK")]);
        assert!(!summary_can_shrink(&p));
        let long = Plan {
            middle: vec![m("assistant", &"a".repeat(2000))],
            ..p
        };
        assert!(summary_can_shrink(&long));
    }

    /// A summary merged into the message after it counts as a summary: alone in the middle, it
    /// is not summarised again.
    #[test]
    fn a_lone_merged_summary_is_not_compacted_again() {
        let t = vec![
            m("user", "P0"),
            m("assistant", &format!("{SUMMARY_PREFIX}\nS\n\nA0")),
            m("user", "P1"),
            call("a"),
            result("a"),
            call("b"),
            result("b"),
        ];
        assert!(plan(&t, 1, 2, 0).is_none());
    }

    /// A summary merged into a message with tool calls is sent as an earlier summary, and its
    /// calls as turns: their results answered calls that were not in the request.
    #[test]
    fn the_calls_of_a_message_with_a_merged_summary_are_summarised() {
        let merged = NewMessage {
            content: Some(format!("{SUMMARY_PREFIX}\n\nS-EARLIER\n\nA0")),
            ..call("merged-call")
        };
        let middle = [merged, result("merged-call"), m("user", "P1")];
        let request = summary_request("aux", &middle, None, 10_000);
        let prompt = request["messages"][0]["content"].as_str().unwrap_or("");
        assert!(prompt.contains("S-EARLIER"), "{prompt}");
        assert!(prompt.contains("[Tool calls: terminal({})]"), "{prompt}");
        assert!(prompt.contains("[TOOL RESULT merged-call]"), "{prompt}");
        let earlier = prompt.find("S-EARLIER").unwrap_or(usize::MAX);
        let turns = prompt.find("TURNS:").unwrap_or(0);
        assert!(
            earlier < turns,
            "the summary is sent as the earlier one: {prompt}"
        );
        assert_eq!(prompt.matches(SUMMARY_PREFIX).count(), 0, "{prompt}");
    }

    /// The user message a summary was merged into is still the message to answer: it stays in
    /// the tail of the next compaction.
    #[test]
    fn a_user_message_with_a_merged_summary_stays_the_message_to_answer() {
        let mut t = vec![m("user", "P0"), m("assistant", "A0")];
        t.push(m("user", &format!("{SUMMARY_PREFIX}\nS\n\nQUESTION")));
        for i in 0..8 {
            let id = format!("c{i}");
            t.push(call(&id));
            t.push(result(&id));
        }
        // Nothing before it but the head: nothing to summarise (the question was summarised
        // away, its text sent as an earlier summary).
        assert_eq!(plan(&t, 2, 2, 0), None);
        // With a turn before it, that turn is the middle, and the question heads the tail.
        t.splice(2..2, [m("user", "P1"), m("assistant", "A1")]);
        let p = plan(&t, 2, 2, 0).expect("a plan");
        assert_eq!(p.middle.len(), 2, "{p:?}");
        assert!(
            p.tail[0]
                .content
                .as_deref()
                .is_some_and(|c| c.ends_with("QUESTION")),
            "{p:?}"
        );
    }

    /// The tail keeps the last message at least, even with `protect_last_n` 0.
    #[test]
    fn the_tail_is_never_empty() {
        let mut t = vec![m("user", "P0")];
        for i in 0..6 {
            let id = format!("c{i}");
            t.push(call(&id));
            t.push(result(&id));
        }
        let p = plan(&t, 1, 0, 0).expect("a plan");
        assert!(!p.tail.is_empty(), "{p:?}");
    }

    /// The summary stands as a message of its own when its role clashes with neither side:
    /// `user` after a head that ends with the assistant or a tool, `assistant` after a user, and
    /// the other role when the first tail message has the one it would take.
    #[test]
    fn a_standalone_summary_takes_the_role_that_clashes_with_neither_side() {
        let roles_of = |head: Vec<NewMessage>, tail: Vec<NewMessage>| -> Vec<String> {
            let p = Plan {
                head,
                middle: vec![m("user", "M")],
                tail,
            };
            let out = assemble(&p, "FACTS");
            let summary = out
                .iter()
                .find(|x| x.display_kind.as_deref() == Some(SUMMARY_KIND))
                .expect("a summary of its own");
            assert!(summary
                .content
                .as_deref()
                .is_some_and(|c| c.contains("FACTS")));
            out.iter().map(|x| x.role.clone()).collect()
        };
        assert_eq!(
            roles_of(vec![m("user", "P0")], vec![m("user", "P2")]),
            ["user", "assistant", "user"]
        );
        assert_eq!(
            roles_of(
                vec![m("user", "P0"), m("assistant", "A0")],
                vec![m("assistant", "A1")]
            ),
            ["user", "assistant", "user", "assistant"]
        );
        assert_eq!(
            roles_of(vec![call("c"), result("c")], vec![m("assistant", "A1")]),
            ["assistant", "tool", "user", "assistant"]
        );
        // After a tool result, before a user message: `user` would clash with the tail, and
        // `assistant` clashes with neither.
        assert_eq!(
            roles_of(vec![call("c"), result("c")], vec![m("user", "P2")]),
            ["assistant", "tool", "assistant", "user"]
        );
    }

    /// Turns past what the summary model can take are left out, the oldest first, and the
    /// request says so.
    #[test]
    fn turns_past_the_summary_models_room_are_left_out_oldest_first() {
        let turns: Vec<NewMessage> = (0..50)
            .map(|i| m("user", &format!("turn {i} {}", "x".repeat(500))))
            .collect();
        let whole = summary_request("s", &turns, None, 3_200);
        let within = summary_request_within(
            "s",
            &turns,
            None,
            3_200,
            Within {
                turns: 5_000,
                earlier: usize::MAX,
            },
        );
        let text = |b: &Value| {
            b["messages"][0]["content"]
                .as_str()
                .unwrap_or("")
                .to_string()
        };
        assert!(text(&whole).contains("turn 0 "));
        let cut = text(&within);
        assert!(cut.len() < 6_500, "{}", cut.len());
        assert!(cut.contains("turn 49 "), "the newest kept");
        assert!(!cut.contains("turn 0 "), "the oldest left out");
        assert!(cut.contains("did not fit the summary model"));
    }

    /// A long turn is put to the summary model as its first 2,000 and last 800 characters, and
    /// a call's arguments as their first 400.
    #[test]
    fn long_turns_and_arguments_are_clipped_in_the_summary_request() {
        let long = format!(
            "{}{}{}",
            "h".repeat(2000),
            "m".repeat(2000),
            "t".repeat(800)
        );
        let mut asked = call("q");
        asked.tool_calls = Some(
            json!([{"id": "q", "type": "function",
                    "function": {"name": "terminal", "arguments": "a".repeat(1000)}}])
            .to_string(),
        );
        let body = summary_request("s", &[m("user", &long), asked], None, 3_200);
        let text = body["messages"][0]["content"].as_str().unwrap_or_default();
        let clipped = format!("{}...[truncated]...{}", "h".repeat(2000), "t".repeat(800));
        assert!(text.contains(&format!("[USER]: {clipped}\n")), "{text}");
        assert!(!text.contains('m'.to_string().repeat(10).as_str()));
        assert!(text.contains(&format!("terminal({})", "a".repeat(400))));
        assert!(!text.contains(&"a".repeat(401)));
        // At 3,000 characters a turn is kept whole.
        let whole = "w".repeat(3000);
        let body = summary_request("s", &[m("user", &whole)], None, 3_200);
        let text = body["messages"][0]["content"].as_str().unwrap_or_default();
        assert!(text.contains(&format!("[USER]: {whole}\n")));
    }

    #[test]
    fn the_summary_request_carries_the_middle() {
        let body = summary_request("summary", &[m("user", "hello"), call("q")], None, 3_200);
        assert_eq!(body["model"], "summary");
        // A small middle still gets the 2,000-token floor of budget, twice over.
        assert_eq!(body["max_tokens"], 4_000);
        // A fifth of a big middle, bounded by the window's summary budget.
        let big = m("user", &"x".repeat(100_000));
        assert_eq!(
            summary_request("s", std::slice::from_ref(&big), None, 10_000)["max_tokens"],
            10_004
        );
        assert_eq!(
            summary_request("s", &[big], None, 3_200)["max_tokens"],
            6_400
        );
        let text = body["messages"][0]["content"].as_str().unwrap_or_default();
        assert!(text.contains("[USER]: hello") && text.contains("terminal("));
    }

    #[test]
    fn an_earlier_summary_is_updated_whole_not_clipped_as_a_turn() {
        // A second compaction finds the first one's summary in its middle.
        let long = format!("{}FACT_AT_5000{}", "a".repeat(5000), "b".repeat(5000));
        let earlier = NewMessage {
            role: "assistant".into(),
            content: Some(format!("{SUMMARY_PREFIX}\n\n{long}")),
            display_kind: Some(SUMMARY_KIND.into()),
            ..Default::default()
        };
        let body = summary_request(
            "summary",
            &[earlier.clone(), m("user", "next")],
            None,
            3_200,
        );
        let text = body["messages"][0]["content"].as_str().unwrap_or_default();
        assert!(
            text.contains("FACT_AT_5000"),
            "the earlier summary was clipped"
        );
        assert!(text.contains("An earlier summary exists"));
        assert!(
            !text.contains("[ASSISTANT]: [CONTEXT COMPACTION]"),
            "not a turn"
        );
        assert!(text.contains("[USER]: next"));
        // Within a small window it keeps its start, up to the bound, and says so.
        let within = Within {
            turns: usize::MAX,
            earlier: 4_000,
        };
        let body = summary_request_within(
            "summary",
            &[earlier, m("user", "next")],
            None,
            3_200,
            within,
        );
        let text = body["messages"][0]["content"].as_str().unwrap_or_default();
        assert!(text.contains(&"a".repeat(4_000)), "its start is kept");
        assert!(!text.contains("FACT_AT_5000"), "cut at 4,000 characters");
        assert!(text.contains("did not fit the summary model"));
        assert!(text.contains("[USER]: next"));
    }
}
