//! Chat-completions wire types and the accumulation of streamed chunks.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type", default = "function_type")]
    pub kind: String,
    pub function: FunctionCall,
    /// What a provider sent with the call for itself, sent back with it as it came: Gemini's
    /// OpenAI-compatible endpoint puts the call's thought signature there, and refuses the next
    /// request of the turn when the call comes back without it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extra_content: Option<Value>,
}

fn function_type() -> String {
    "function".into()
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub arguments: String,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    #[serde(default)]
    pub prompt_tokens: i64,
    #[serde(default)]
    pub completion_tokens: i64,
    #[serde(default)]
    pub total_tokens: i64,
}

/// One finished model response (streamed or not).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChatResponse {
    pub content: Option<String>,
    pub reasoning: Option<String>,
    pub tool_calls: Vec<ToolCall>,
    pub finish_reason: String,
    pub usage: Option<Usage>,
    pub model: Option<String>,
}

/// Text of a content field that may be a string, a list of parts, or an object.
pub fn flatten_content(v: &Value) -> Option<String> {
    match v {
        Value::Null => None,
        Value::String(s) => Some(s.clone()),
        Value::Array(parts) => Some(
            parts
                .iter()
                .filter_map(|p| {
                    p.get("text")
                        .and_then(|t| t.as_str())
                        .or_else(|| p.as_str())
                })
                .collect::<Vec<_>>()
                .join(""),
        ),
        other => Some(other.to_string()),
    }
}

/// A call's arguments as JSON text: a string as it is, an object or list (some servers send them
/// parsed) written out, nothing for null.
fn arguments_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// The error a reply or a streamed chunk reports, if it reports one. `"error": null` is none,
/// and so is an empty `"error": {}` beside choices (some servers write the field on every
/// reply): taken for an error, an answered request was sent again (a whole new generation each
/// time), or a streamed turn failed. The plain reply, its parse and each chunk keep to this one
/// rule: the client let an empty error through that the parse then refused.
pub fn reported_error(body: &Value) -> Option<&Value> {
    let error = body.get("error")?;
    let answered = body
        .get("choices")
        .and_then(Value::as_array)
        .is_some_and(|c| !c.is_empty());
    let none = error.is_null() || (answered && error.as_object().is_some_and(|o| o.is_empty()));
    (!none).then_some(error)
}

/// Parse a non-streaming response body.
pub fn parse_response(body: &Value) -> Result<ChatResponse, String> {
    if let Some(err) = reported_error(body) {
        return Err(err.to_string());
    }
    let choice = body
        .get("choices")
        .and_then(|c| c.get(0))
        .ok_or_else(|| "response has no choices".to_string())?;
    let message = choice.get("message").cloned().unwrap_or(Value::Null);
    // Each call on its own terms: one call without an `id`, or with its arguments as an object,
    // must not lose the others (they would all be dropped, and the turn "complete" silently).
    let tool_calls: Vec<ToolCall> = message
        .get("tool_calls")
        .and_then(Value::as_array)
        .map(|calls| {
            calls
                .iter()
                .enumerate()
                .map(|(i, c)| ToolCall {
                    id: c
                        .get("id")
                        .and_then(Value::as_str)
                        .filter(|id| !id.is_empty())
                        .map_or_else(|| format!("call_{i}"), str::to_string),
                    kind: "function".into(),
                    function: FunctionCall {
                        name: c
                            .pointer("/function/name")
                            .and_then(Value::as_str)
                            .unwrap_or("")
                            .to_string(),
                        arguments: c
                            .pointer("/function/arguments")
                            .map(arguments_text)
                            .unwrap_or_default(),
                    },
                    extra_content: c.get("extra_content").filter(|x| !x.is_null()).cloned(),
                })
                .collect()
        })
        .unwrap_or_default();
    Ok(ChatResponse {
        content: message.get("content").and_then(flatten_content),
        reasoning: reasoning_of(&message).map(str::to_string),
        tool_calls,
        finish_reason: finish_reason_of(choice).unwrap_or("stop").to_string(),
        usage: body
            .get("usage")
            .and_then(|u| serde_json::from_value(u.clone()).ok())
            .map(fix_total),
        model: body
            .get("model")
            .and_then(|m| m.as_str())
            .map(str::to_string),
    })
}

/// The most tokens one response's usage may count (a trillion): a server's absurd figure is
/// clamped, so the session's running totals stay integers.
const MAX_USAGE_TOKENS: i64 = 1_000_000_000_000;

fn fix_total(mut u: Usage) -> Usage {
    for n in [
        &mut u.prompt_tokens,
        &mut u.completion_tokens,
        &mut u.total_tokens,
    ] {
        *n = (*n).clamp(0, MAX_USAGE_TOKENS);
    }
    if u.total_tokens == 0 {
        u.total_tokens = u.prompt_tokens + u.completion_tokens;
    }
    u
}

/// Accumulates streamed chunks into a [`ChatResponse`].
#[derive(Debug, Default)]
pub struct StreamAccumulator {
    content: String,
    saw_content: bool,
    reasoning: String,
    /// The calls by slot, in order; looked up per fragment, so a map (a response may stream
    /// thousands of fragments). A slot is a fragment's `index` and how many calls used that
    /// index before (see `current`): slots made for reused indexes are apart from every index,
    /// so a later call's fragments are never taken into one of them.
    slots: BTreeMap<(i64, u32), ToolCall>,
    /// The slot a fragment's `index` now means: a new call (another id) that reuses an index gets
    /// a fresh slot, and that index's later fragments belong to it.
    current: HashMap<i64, u32>,
    /// Where a slot made for a reused index comes in the answer: after every call there was
    /// when it came (the largest index then, and how many such slots before it: that largest
    /// index never falls), as the calls were streamed. Slots of their own index come in index
    /// order.
    reused_at: HashMap<(i64, u32), (i64, u64)>,
    finish_reason: Option<String>,
    usage: Option<Usage>,
    model: Option<String>,
    /// Bytes of the answer kept so far (its text, reasoning and calls; see [`Self::kept_bytes`]).
    kept: usize,
}

/// What a new tool call's slot is counted as, before its name and arguments.
const SLOT_BYTES: usize = 64;

/// A choice's `finish_reason`, if it gives one. Some servers send `""` (or the text `"null"`)
/// on every chunk before the last: no reason yet. Taken as one, a streamed answer counted as
/// ended at its first chunk, and a pause or a dropped connection after it stored what had come
/// as the whole answer.
fn finish_reason_of(choice: &Value) -> Option<&str> {
    choice
        .get("finish_reason")
        .and_then(Value::as_str)
        .filter(|f| !f.is_empty() && *f != "null")
}

/// What a chunk contributed, for live deltas.
#[derive(Debug, Default, PartialEq)]
pub struct ChunkDelta {
    pub content: Option<String>,
    pub reasoning: Option<String>,
    pub tool_names: Vec<String>,
}

/// A message's or delta's reasoning: `reasoning_content` (DeepSeek, most servers) or
/// `reasoning` (vLLM's newer name, OpenRouter), whichever holds text: a server that writes
/// every field may send one of them `null` or empty beside the other.
fn reasoning_of(v: &Value) -> Option<&str> {
    ["reasoning_content", "reasoning"]
        .iter()
        .filter_map(|k| v.get(k).and_then(|r| r.as_str()))
        .find(|r| !r.is_empty())
}

/// Whether `call`, a fragment at the index of the call `existing` whose id one of them lacks,
/// starts another call: `existing` already has its name and arguments that parse whole, and
/// the fragment names a tool and brings arguments, or names another tool than `existing`'s
/// (its arguments may come in later fragments). Some servers (Gemini's OpenAI-compatible ones
/// among them) stream parallel calls all at index 0, without ids; joined, two calls became one
/// named `terminalclarify` with two argument objects run together. A name streamed in pieces
/// comes while the call's arguments are still empty (they do not parse), so its pieces are
/// joined; the same name again with no arguments is a server repeating it, not another call.
fn starts_another(existing: &ToolCall, call: &Value) -> bool {
    let Some(f) = call.get("function") else {
        return false;
    };
    let Some(name) = f
        .get("name")
        .and_then(|n| n.as_str())
        .filter(|n| !n.is_empty())
    else {
        return false;
    };
    let brings_arguments = f
        .get("arguments")
        .is_some_and(|a| !arguments_text(a).trim().is_empty());
    (brings_arguments || name != existing.function.name)
        && !existing.function.name.is_empty()
        && serde_json::from_str::<serde::de::IgnoredAny>(&existing.function.arguments).is_ok()
}

impl StreamAccumulator {
    /// Has a chunk said why the answer ended (`finish_reason`)?
    pub fn finished(&self) -> bool {
        self.finish_reason.is_some()
    }

    /// Bytes of the answer kept so far: its text, its reasoning, and its tool calls (ids, names,
    /// arguments, and [`SLOT_BYTES`] for each call). What bounds a streamed reply, not the
    /// bytes of its events, whose framing (ids, model names, `logprobs: null`, …) is most of
    /// what a server sends for an answer streamed a token at a time.
    pub fn kept_bytes(&self) -> usize {
        self.kept
    }

    /// Apply one chunk (`data:` payload already parsed as JSON).
    pub fn apply(&mut self, chunk: &Value) -> Result<ChunkDelta, String> {
        if let Some(err) = reported_error(chunk) {
            return Err(err.to_string());
        }
        let mut delta_out = ChunkDelta::default();
        if let Some(m) = chunk.get("model").and_then(|m| m.as_str()) {
            self.model = Some(m.to_string());
        }
        if let Some(u) = chunk.get("usage").filter(|u| !u.is_null()) {
            if let Ok(u) = serde_json::from_value::<Usage>(u.clone()) {
                self.usage = Some(fix_total(u));
            }
        }
        let Some(choice) = chunk.get("choices").and_then(|c| c.get(0)) else {
            return Ok(delta_out);
        };
        if let Some(f) = finish_reason_of(choice) {
            self.finish_reason = Some(f.to_string());
        }
        let Some(delta) = choice.get("delta").or_else(|| choice.get("message")) else {
            return Ok(delta_out);
        };
        if let Some(text) = delta.get("content").and_then(flatten_content) {
            self.saw_content = true;
            self.kept += text.len();
            self.content.push_str(&text);
            if !text.is_empty() {
                delta_out.content = Some(text);
            }
        }
        if let Some(r) = reasoning_of(delta) {
            self.kept += r.len();
            self.reasoning.push_str(r);
            if !r.is_empty() {
                delta_out.reasoning = Some(r.to_string());
            }
        }
        if let Some(calls) = delta.get("tool_calls").and_then(|t| t.as_array()) {
            for call in calls {
                let raw_index = call.get("index").and_then(|i| i.as_i64()).unwrap_or(0);
                let id = call.get("id").and_then(|i| i.as_str()).unwrap_or("");
                let mut slot_index = (
                    raw_index,
                    self.current.get(&raw_index).copied().unwrap_or(0),
                );
                if let Some(existing) = self.slots.get(&slot_index) {
                    let another_id = !id.is_empty() && !existing.id.is_empty() && existing.id != id;
                    if another_id
                        || ((id.is_empty() || existing.id.is_empty())
                            && starts_another(existing, call))
                    {
                        // A new call reusing an index: give it a fresh slot, after the index's
                        // earlier calls and before the next index's.
                        let reuse = slot_index.1.checked_add(1).ok_or_else(|| {
                            format!("tool call index {raw_index} is reused too often")
                        })?;
                        slot_index = (raw_index, reuse);
                        self.current.insert(raw_index, reuse);
                        let last = self.slots.keys().next_back().map_or(raw_index, |k| k.0);
                        let place = (last, self.reused_at.len() as u64 + 1);
                        self.reused_at.insert(slot_index, place);
                    }
                }
                let kept = &mut self.kept;
                let slot = self.slots.entry(slot_index).or_insert_with(|| {
                    *kept += SLOT_BYTES;
                    ToolCall {
                        kind: "function".into(),
                        ..Default::default()
                    }
                });
                if !id.is_empty() && slot.id != id {
                    *kept += id.len();
                    slot.id = id.to_string();
                }
                if let Some(extra) = call.get("extra_content").filter(|x| !x.is_null()) {
                    *kept += serde_json::to_string(extra).map_or(0, |t| t.len());
                    slot.extra_content = Some(extra.clone());
                }
                if let Some(f) = call.get("function") {
                    if let Some(n) = f.get("name").and_then(|n| n.as_str()) {
                        if !n.is_empty() && slot.function.name.is_empty() {
                            delta_out.tool_names.push(n.to_string());
                        }
                        // Some servers repeat the whole name in every fragment of a call.
                        if slot.function.name != n {
                            *kept += n.len();
                            slot.function.name.push_str(n);
                        }
                    }
                    if let Some(a) = f.get("arguments") {
                        let a = arguments_text(a);
                        *kept += a.len();
                        slot.function.arguments.push_str(&a);
                    }
                }
            }
        }
        Ok(delta_out)
    }

    pub fn finish(self) -> ChatResponse {
        let reused_at = self.reused_at;
        let mut placed: Vec<((i64, u64), ToolCall)> = self
            .slots
            .into_iter()
            .map(|((i, reuse), mut c)| {
                if c.id.is_empty() {
                    c.id = match reuse {
                        0 => format!("call_{i}"),
                        n => format!("call_{i}_{n}"),
                    };
                }
                (reused_at.get(&(i, reuse)).copied().unwrap_or((i, 0)), c)
            })
            .collect();
        placed.sort_by_key(|(place, _)| *place);
        let tool_calls: Vec<ToolCall> = placed.into_iter().map(|(_, c)| c).collect();
        ChatResponse {
            content: if self.saw_content && !self.content.is_empty() {
                Some(self.content)
            } else {
                None
            },
            reasoning: if self.reasoning.is_empty() {
                None
            } else {
                Some(self.reasoning)
            },
            tool_calls,
            finish_reason: self.finish_reason.unwrap_or_else(|| "stop".into()),
            usage: self.usage,
            model: self.model,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The calls of a finished stream, as (id, name, arguments).
    fn calls_of(acc: StreamAccumulator) -> Vec<(String, String, String)> {
        acc.finish()
            .tool_calls
            .into_iter()
            .map(|c| (c.id, c.function.name, c.function.arguments))
            .collect()
    }

    fn call(id: &str, name: &str, args: &str) -> (String, String, String) {
        (id.to_string(), name.to_string(), args.to_string())
    }

    /// An answer whose chunks each stream one of `deltas` (a tool call's fragment), in order.
    fn streamed(deltas: impl IntoIterator<Item = Value>) -> StreamAccumulator {
        let mut acc = StreamAccumulator::default();
        for delta in deltas {
            acc.apply(&json!({"choices":[{"index":0,"delta":{"tool_calls":[delta]}}]}))
                .expect("chunk");
        }
        acc
    }

    /// `"error": null` beside an answer is no error: it was taken for one (a malformed reply),
    /// and the answered request sent again.
    #[test]
    fn a_null_error_is_no_error() {
        let answered = parse_response(&json!({"error": null,
            "choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}]}))
        .expect("an answer");
        assert_eq!(answered.content.as_deref(), Some("hi"));
        assert!(parse_response(&json!({"error": {"message": "no"}})).is_err());
        let mut acc = StreamAccumulator::default();
        acc.apply(&json!({"error": null, "choices":[{"index":0,"delta":{"content":"A"}}]}))
            .expect("a chunk");
        assert!(acc.apply(&json!({"error": "boom"})).is_err());
    }

    #[test]
    fn fragments_accumulate_by_index_and_finish_defaults_to_stop() {
        let mut acc = StreamAccumulator::default();
        acc.apply(&json!({"choices":[{"index":0,"delta":{"content":"A"}}]}))
            .expect("a");
        acc.apply(&json!({"choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"id":"c2","function":{"name":"clarify","arguments":"{\"q"}}]}}]}))
            .expect("b");
        acc.apply(&json!({"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c1","function":{"name":"terminal","arguments":"{}"}}]}}]}))
            .expect("c");
        acc.apply(&json!({"choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"function":{"arguments":"\":1}"}}]}}],
            "usage":{"prompt_tokens":3,"completion_tokens":4}}))
            .expect("d");
        let r = acc.finish();
        assert_eq!(r.content.as_deref(), Some("A"));
        assert_eq!(r.finish_reason, "stop");
        assert_eq!(r.tool_calls.len(), 2);
        assert_eq!(r.tool_calls[0].id, "c1");
        assert_eq!(r.tool_calls[1].function.arguments, "{\"q\":1}");
        assert_eq!(r.usage.map(|u| u.total_tokens), Some(7));
    }

    #[test]
    fn a_call_reusing_an_index_keeps_its_later_fragments() {
        let call = |index: i64, id: &str, args: &str| {
            let mut c = json!({"index": index, "function": {"arguments": args}});
            if !id.is_empty() {
                c["id"] = json!(id);
                c["function"]["name"] = json!("terminal");
            }
            c
        };
        let acc = streamed([
            call(0, "a", "{\"command\":"),
            call(0, "", "\"ls\"}"),
            call(0, "b", "{\"command\":"),
            call(0, "", "\"pwd\"}"),
            call(1, "c", "{}"),
        ]);
        let calls: Vec<(String, String)> = acc
            .finish()
            .tool_calls
            .into_iter()
            .map(|c| (c.id, c.function.arguments))
            .collect();
        assert_eq!(
            calls,
            [
                ("a".to_string(), r#"{"command":"ls"}"#.to_string()),
                ("b".to_string(), r#"{"command":"pwd"}"#.to_string()),
                ("c".to_string(), "{}".to_string()),
            ]
        );
    }

    /// Parallel calls streamed all at index 0 without ids (as some Gemini servers do) stay
    /// apart: a fragment naming a tool with arguments, after a named call whose arguments are
    /// whole, is another call. A name repeated with the rest of a call's arguments is not.
    #[test]
    fn parallel_calls_at_one_index_without_ids_stay_apart() {
        let acc = streamed(
            [
                ("terminal", "{\"command\":\"ls\"}"),
                ("clarify", "{\"question\":"),
                ("clarify", "\"why\"}"),
                ("terminal", "{\"command\":\"pwd\"}"),
            ]
            .map(|(name, args)| json!({"function": {"name": name, "arguments": args}})),
        );
        assert_eq!(
            calls_of(acc),
            [
                call("call_0", "terminal", r#"{"command":"ls"}"#),
                call("call_0_1", "clarify", r#"{"question":"why"}"#),
                call("call_0_2", "terminal", r#"{"command":"pwd"}"#),
            ]
        );
    }

    /// Another tool's name at index 0, without ids, after a call whose arguments are whole, is
    /// another call even when its arguments come in later fragments: they were joined into one
    /// call `terminalclarify` with `{}{"q":1}`. A name streamed in pieces is still one name, and
    /// the same name repeated without arguments is still the same call.
    #[test]
    fn another_name_after_a_whole_call_starts_another_without_its_arguments() {
        let fragment = |name: Option<&str>, args: Option<&str>| {
            let mut f = json!({});
            if let Some(name) = name {
                f["name"] = json!(name);
            }
            if let Some(args) = args {
                f["arguments"] = json!(args);
            }
            json!({"index": 0, "function": f})
        };
        let acc = streamed([
            fragment(Some("terminal"), Some("{}")),
            fragment(Some("clarify"), None),
            fragment(None, Some("{\"q\":1}")),
        ]);
        assert_eq!(
            calls_of(acc),
            [
                call("call_0", "terminal", "{}"),
                call("call_0_1", "clarify", r#"{"q":1}"#),
            ]
        );
        let acc = streamed([
            fragment(Some("ter"), None),
            fragment(Some("minal"), Some("")),
            fragment(None, Some("{\"command\":\"ls\"}")),
            fragment(Some("terminal"), None),
        ]);
        assert_eq!(
            calls_of(acc),
            [call("call_0", "terminal", r#"{"command":"ls"}"#)]
        );
    }

    /// An empty `"error": {}` beside choices is no error, in a plain reply and in a chunk, as
    /// the client already took it: the parse refused the reply (a malformed one, asked for
    /// again) and the chunk failed the turn. Without choices it is still an error.
    #[test]
    fn an_empty_error_beside_choices_is_no_error() {
        let answered = parse_response(&json!({"error": {},
            "choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}]}))
        .expect("an answer");
        assert_eq!(answered.content.as_deref(), Some("hi"));
        assert!(parse_response(&json!({"error": {}})).is_err());
        assert!(reported_error(&json!({"error": {}, "choices": []})).is_some());
        let mut acc = StreamAccumulator::default();
        acc.apply(&json!({"error": {}, "choices":[{"index":0,"delta":{"content":"A"}}]}))
            .expect("a chunk");
        assert!(acc.apply(&json!({"error": {}})).is_err());
        assert_eq!(acc.finish().content.as_deref(), Some("A"));
    }

    /// A call's `extra_content` (Gemini's thought signature) is kept, streamed or plain, and
    /// written back with the call; a call without one is written as before.
    #[test]
    fn a_calls_extra_content_is_kept_and_sent_back() {
        let extra = json!({"google": {"thought_signature": "c2lnbmF0dXJl"}});
        let mut acc = StreamAccumulator::default();
        acc.apply(&json!({"choices":[{"index":0,"delta":{"tool_calls":[
            {"index": 0, "id": "a", "extra_content": extra, "function": {"name": "terminal", "arguments": "{\"command\":"}}]}}]}))
            .expect("first");
        acc.apply(&json!({"choices":[{"index":0,"delta":{"tool_calls":[
            {"index": 0, "function": {"arguments": "\"ls\"}"}}]}}]}))
            .expect("rest");
        acc.apply(&json!({"choices":[{"index":0,"delta":{"tool_calls":[
            {"index": 1, "id": "b", "function": {"name": "clarify", "arguments": "{}"}}]}}]}))
            .expect("other");
        let calls = acc.finish().tool_calls;
        let written = serde_json::to_value(&calls).expect("calls");
        assert_eq!(written[0]["extra_content"], extra, "{written}");
        assert_eq!(written[0]["function"]["arguments"], r#"{"command":"ls"}"#);
        assert!(written[1].get("extra_content").is_none(), "{written}");
        let plain = parse_response(&json!({"choices":[{"message":{"content":null,"tool_calls":[
            {"id": "p", "type": "function", "extra_content": extra,
             "function": {"name": "terminal", "arguments": "{}"}}]},"finish_reason":"tool_calls"}]}))
        .expect("an answer");
        assert_eq!(plain.tool_calls[0].extra_content.as_ref(), Some(&extra));
        let back: Vec<ToolCall> = serde_json::from_value(written).expect("read back");
        assert_eq!(back, calls);
    }

    /// Reasoning is read from whichever of `reasoning_content` and `reasoning` holds text.
    #[test]
    fn a_null_reasoning_content_does_not_hide_reasoning() {
        let mut acc = StreamAccumulator::default();
        acc.apply(&json!({"choices":[{"index":0,"delta":{"reasoning_content":null,"reasoning":"think"}}]}))
            .expect("a");
        acc.apply(
            &json!({"choices":[{"index":0,"delta":{"reasoning_content":"","reasoning":"ing"}}]}),
        )
        .expect("b");
        assert_eq!(acc.finish().reasoning.as_deref(), Some("thinking"));
        let plain = parse_response(&json!({"choices":[{"message":
            {"content":"hi","reasoning_content":null,"reasoning":"because"},"finish_reason":"stop"}]}))
        .expect("an answer");
        assert_eq!(plain.reasoning.as_deref(), Some("because"));
    }

    /// Calls come in the order they were streamed when an index is reused after a later
    /// index's call: a reused slot comes after every call there was when it came.
    #[test]
    fn a_reused_index_after_a_later_one_keeps_the_streamed_order() {
        let acc = streamed(
            [(0, "a"), (1, "c"), (0, "b"), (2, "d"), (0, "e")].map(|(index, id)| {
                json!({"index": index, "id": id, "function": {"name": "terminal", "arguments": "{}"}})
            }),
        );
        let ids: Vec<String> = acc.finish().tool_calls.into_iter().map(|c| c.id).collect();
        assert_eq!(ids, ["a", "c", "b", "d", "e"]);
    }

    /// A slot made for a reused index is no index's: the next index's fragments, before its
    /// id came, went into the reused index's second call (its name and arguments merged).
    #[test]
    fn a_reused_index_does_not_take_the_next_indexs_fragments() {
        let acc = streamed([
            json!({"index": 0, "id": "a", "function": {"name": "terminal", "arguments": "{\"command\":\"ls\"}"}}),
            json!({"index": 0, "id": "b", "function": {"name": "terminal", "arguments": "{\"command\":\"pwd\"}"}}),
            json!({"index": 1, "function": {"name": "clarify", "arguments": "{\"question\":"}}),
            json!({"index": 1, "id": "c", "function": {"arguments": "\"why\"}"}}),
        ]);
        assert_eq!(
            calls_of(acc),
            [
                call("a", "terminal", r#"{"command":"ls"}"#),
                call("b", "terminal", r#"{"command":"pwd"}"#),
                call("c", "clarify", r#"{"question":"why"}"#),
            ]
        );
    }

    /// `finish_reason: ""` (or the text `"null"`) on the chunks before the last is no reason:
    /// the answer has not ended until a real one comes. It counted as ended at the first chunk.
    #[test]
    fn an_empty_finish_reason_is_none() {
        let mut acc = StreamAccumulator::default();
        for (text, reason) in [("Hel", ""), ("lo", "null")] {
            acc.apply(&json!({"choices":[{"delta":{"content":text},"finish_reason":reason}]}))
                .expect("chunk");
            assert!(!acc.finished(), "{reason:?} is no finish_reason");
        }
        acc.apply(&json!({"choices":[{"delta":{},"finish_reason":"length"}]}))
            .expect("chunk");
        assert!(acc.finished());
        let r = acc.finish();
        assert_eq!(
            (r.content.as_deref(), r.finish_reason.as_str()),
            (Some("Hello"), "length")
        );
        let plain =
            parse_response(&json!({"choices":[{"message":{"content":"hi"},"finish_reason":""}]}))
                .expect("reply");
        assert_eq!(plain.finish_reason, "stop");
    }

    #[test]
    fn a_plain_reply_keeps_every_call_even_one_without_an_id() {
        let r = parse_response(&json!({"choices":[{"finish_reason":"tool_calls","message":{"role":"assistant","tool_calls":[
            {"type":"function","function":{"name":"terminal","arguments":"{\"command\":\"ls\"}"}},
            {"id":"b","function":{"name":"terminal","arguments":{"command":"pwd"}}},
            {"id":"c","type":"function","function":{"name":"clarify"}}
        ]}}]}))
        .expect("parsed");
        let calls: Vec<(&str, &str, &str)> = r
            .tool_calls
            .iter()
            .map(|c| {
                (
                    c.id.as_str(),
                    c.function.name.as_str(),
                    c.function.arguments.as_str(),
                )
            })
            .collect();
        assert_eq!(
            calls,
            [
                ("call_0", "terminal", r#"{"command":"ls"}"#),
                ("b", "terminal", r#"{"command":"pwd"}"#),
                ("c", "clarify", ""),
            ]
        );
        let mut acc = StreamAccumulator::default();
        acc.apply(&json!({"choices":[{"delta":{"tool_calls":[{"index":0,"id":"x","function":{"name":"terminal","arguments":{"command":"ls"}}}]}}]}))
            .expect("chunk");
        assert_eq!(
            acc.finish().tool_calls[0].function.arguments,
            r#"{"command":"ls"}"#
        );
    }

    /// What a careless or hostile server streams does not merge calls or wrap numbers: the
    /// largest index reused is a call of its own (a fresh slot past it wrapped round and merged
    /// two calls), a name repeated in every fragment is the name once, and absurd token counts
    /// are clamped.
    #[test]
    fn odd_streams_do_not_merge_calls_or_overflow() {
        let call = |index: i64, id: &str| {
            json!({"choices":[{"delta":{"tool_calls":[
                {"index": index, "id": id, "function": {"name": "terminal", "arguments": "{}"}}
            ]}}]})
        };
        let mut acc = StreamAccumulator::default();
        acc.apply(&call(i64::MAX, "a")).expect("a");
        acc.apply(&call(i64::MAX, "b")).expect("b");
        let ids: Vec<String> = acc.finish().tool_calls.into_iter().map(|c| c.id).collect();
        assert_eq!(ids, ["a", "b"]);

        let mut acc = StreamAccumulator::default();
        for args in ["{\"command\":", "\"ls\"}"] {
            acc.apply(&json!({"choices":[{"delta":{"tool_calls":[
                {"index": 0, "id": "x", "function": {"name": "terminal", "arguments": args}}
            ]}}]}))
            .expect("fragment");
        }
        acc.apply(
            &json!({"choices":[], "usage": {"prompt_tokens": i64::MAX, "completion_tokens": -5}}),
        )
        .expect("usage");
        let r = acc.finish();
        assert_eq!(r.tool_calls.len(), 1);
        assert_eq!(r.tool_calls[0].function.name, "terminal");
        assert_eq!(r.tool_calls[0].function.arguments, r#"{"command":"ls"}"#);
        let usage = r.usage.expect("usage");
        assert_eq!(usage.prompt_tokens, MAX_USAGE_TOKENS);
        assert_eq!(usage.completion_tokens, 0);
        assert_eq!(usage.total_tokens, MAX_USAGE_TOKENS);
    }

    #[test]
    fn error_chunks_and_missing_choices_are_errors() {
        let mut acc = StreamAccumulator::default();
        assert!(acc.apply(&json!({"error":{"message":"boom"}})).is_err());
        assert!(parse_response(&json!({"id":"x"})).is_err());
        let r = parse_response(
            &json!({"choices":[{"message":{"content":[{"type":"text","text":"hi"}]}}]}),
        )
        .expect("ok");
        assert_eq!(r.content.as_deref(), Some("hi"));
    }
}
