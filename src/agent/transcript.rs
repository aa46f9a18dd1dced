//! Building the wire `messages` from stored rows: internal fields stripped, orphan tool results
//! dropped, a stub result for any tool call that never got one, so requests are always well formed.

use std::collections::HashSet;

use serde_json::{json, Value};

use crate::store::messages::NewMessage;

/// The wire form of one stored message.
pub fn to_wire(m: &NewMessage) -> Value {
    let mut v = json!({ "role": m.role, "content": m.content });
    if m.role == "assistant" {
        // The model's reasoning goes back as it came, under the name providers read.
        if let Some(r) = m.reasoning.as_deref().filter(|r| !r.is_empty()) {
            v["reasoning_content"] = json!(r);
        }
        if let Some(calls) = m.tool_calls.as_deref() {
            if let Ok(calls) = serde_json::from_str::<Value>(calls) {
                if calls.as_array().is_some_and(|a| !a.is_empty()) {
                    v["tool_calls"] = calls;
                }
            }
        }
    }
    if m.role == "tool" {
        v["tool_call_id"] = json!(m.tool_call_id.clone().unwrap_or_default());
        if v["content"].is_null() {
            v["content"] = json!("");
        }
    }
    v
}

/// `[system] + transcript`, sanitised.
pub fn wire_messages(system: Option<&str>, transcript: &[NewMessage]) -> Vec<Value> {
    let mut out = Vec::with_capacity(transcript.len() + 1);
    if let Some(s) = system {
        out.push(json!({"role": "system", "content": s}));
    }
    let mut i = 0;
    while i < transcript.len() {
        let m = &transcript[i];
        if m.role == "tool" {
            // A tool result not preceded by its call is an orphan: drop it.
            i += 1;
            continue;
        }
        let mut wire = to_wire(m);
        if m.role == "assistant" {
            // A call whose id an earlier call of the message has is left out (kept by an older
            // version, it had no result of its own); sets, as a message may hold many calls.
            let mut ids: Vec<String> = Vec::new();
            let mut seen = HashSet::new();
            if let Some(calls) = wire.get_mut("tool_calls").and_then(Value::as_array_mut) {
                calls.retain(|c| {
                    let id = c.get("id").and_then(Value::as_str).unwrap_or_default();
                    seen.insert(id.to_string())
                });
                ids = calls
                    .iter()
                    .filter_map(|c| c.get("id").and_then(Value::as_str).map(str::to_string))
                    .collect();
            }
            out.push(wire);
            let mut j = i + 1;
            let mut answered = HashSet::new();
            while j < transcript.len() && transcript[j].role == "tool" {
                let t = &transcript[j];
                let id = t.tool_call_id.as_deref().unwrap_or_default();
                if seen.contains(id) && answered.insert(id.to_string()) {
                    out.push(to_wire(t));
                }
                j += 1;
            }
            for id in ids.iter().filter(|id| !answered.contains(*id)) {
                out.push(json!({"role": "tool", "tool_call_id": id, "content": "[No result: the tool did not run]"}));
            }
            i = j;
            continue;
        }
        out.push(wire);
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> NewMessage {
        NewMessage::text(role, content)
    }

    #[test]
    fn orphans_are_dropped_and_missing_results_stubbed() {
        let mut call = msg("assistant", "");
        call.tool_calls = Some(r#"[{"id":"a","type":"function","function":{"name":"terminal","arguments":"{}"}},{"id":"b","type":"function","function":{"name":"x","arguments":"{}"}}]"#.into());
        let mut result_a = msg("tool", "ok");
        result_a.tool_call_id = Some("a".into());
        let mut orphan = msg("tool", "stray");
        orphan.tool_call_id = Some("zzz".into());
        let t = vec![
            msg("user", "hi"),
            orphan.clone(),
            call,
            result_a,
            msg("user", "next"),
        ];
        let w = wire_messages(Some("sys"), &t);
        let roles: Vec<&str> = w.iter().map(|m| m["role"].as_str().unwrap_or("")).collect();
        assert_eq!(
            roles,
            ["system", "user", "assistant", "tool", "tool", "user"]
        );
        assert_eq!(w[3]["tool_call_id"], "a");
        assert_eq!(w[4]["tool_call_id"], "b");
    }

    /// A message kept with two calls of one id (by an older version) goes out with the first
    /// of them and its one result: a call without a result of its own was a malformed request.
    #[test]
    fn a_repeated_call_id_goes_out_once() {
        let mut call = msg("assistant", "");
        call.tool_calls = Some(r#"[{"id":"dup","type":"function","function":{"name":"terminal","arguments":"{\"command\":\"ls\"}"}},{"id":"dup","type":"function","function":{"name":"terminal","arguments":"{\"command\":\"pwd\"}"}}]"#.into());
        let mut result = msg("tool", "ok");
        result.tool_call_id = Some("dup".into());
        let w = wire_messages(None, &[msg("user", "hi"), call, result.clone(), result]);
        let roles: Vec<&str> = w.iter().map(|m| m["role"].as_str().unwrap_or("")).collect();
        assert_eq!(roles, ["user", "assistant", "tool"]);
        let calls = w[1]["tool_calls"].as_array().expect("calls");
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0]["function"]["arguments"], r#"{"command":"ls"}"#);
    }
}
