//! Property-based fuzzing (proptest) of the parsers that read untrusted bytes: the JSON-RPC frame
//! decoder, the SSE parser and chunk accumulator of the model client, and the config loader.
//!
//! They run in `cargo test` with a moderate number of cases; `GATEHOUSE_FUZZ_CASES=100000 cargo
//! test --test it fuzz` runs them longer.

use std::path::Path;
use std::time::Duration;

use gatehouse::api::ws::{parse_request, RpcRequest};
use gatehouse::config::{Config, ConfigError};
use gatehouse::model::sse::SseParser;
use gatehouse::model::wire::{parse_response, StreamAccumulator};
use proptest::prelude::*;
use proptest::test_runner::{Config as PropConfig, TestRunner};
use serde_json::{json, Map, Value};

fn cases(default: u32) -> u32 {
    std::env::var("GATEHOUSE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn runner(default_cases: u32) -> TestRunner {
    TestRunner::new(PropConfig {
        cases: cases(default_cases),
        failure_persistence: None,
        ..PropConfig::default()
    })
}

/// Any JSON value, nested a few levels.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| json!(f)),
        ".{0,24}".prop_map(Value::String),
        prop_oneof![
            Just("2.0"),
            Just("session.resume"),
            Just("prompt.submit"),
            Just("jsonrpc"),
            Just("method"),
            Just("params"),
            Just("id")
        ]
        .prop_map(|s| Value::String(s.to_string())),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((key(), inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<String, Value>>())),
        ]
    })
}

fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("jsonrpc".to_string()),
        Just("id".to_string()),
        Just("method".to_string()),
        Just("params".to_string()),
        "[a-z_]{1,10}",
    ]
}

/// What the decoder must answer for a JSON value, written independently of the decoder.
fn expected(v: &Value) -> Result<RpcRequest, (Value, &'static str)> {
    let Value::Object(o) = v else {
        return Err((Value::Null, "invalid_request"));
    };
    let id = o.get("id").cloned();
    let reply_id = match &id {
        // Numbers outside the 64-bit integer range (wider integers arrive as floats).
        Some(Value::Number(n))
            if !(n.is_i64() || n.is_u64())
                && n.as_f64()
                    .is_some_and(|f| f < i64::MIN as f64 || f >= u64::MAX as f64) =>
        {
            return Err((Value::Null, "invalid_request"))
        }
        None | Some(Value::Null | Value::String(_) | Value::Number(_)) => {
            id.clone().unwrap_or(Value::Null)
        }
        Some(_) => return Err((Value::Null, "invalid_request")),
    };
    if o.get("jsonrpc") != Some(&json!("2.0")) {
        return Err((reply_id, "invalid_request"));
    }
    let Some(Value::String(method)) = o.get("method") else {
        return Err((reply_id, "invalid_request"));
    };
    let params = match o.get("params") {
        None | Some(Value::Null) => json!({}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => return Err((reply_id, "invalid_params")),
    };
    Ok(RpcRequest {
        id,
        method: method.clone(),
        params,
    })
}

#[test]
fn rpc_decoder_agrees_with_the_envelope_rules_for_any_json() {
    runner(2000)
        .run(&any_json(), |v| {
            let text = v.to_string();
            // Compare against the value as read back (floats need not round-trip exactly).
            let v: Value = serde_json::from_str(&text).expect("own output parses");
            let got = parse_request(&text, 1 << 20).map_err(|(id, e)| (id, e.reason()));
            prop_assert_eq!(got, expected(&v), "frame {}", text);
            Ok(())
        })
        .expect("decoder property");
}

#[test]
fn rpc_decoder_accepts_every_well_formed_request() {
    let id = prop_oneof![
        Just(None),
        Just(Some(Value::Null)),
        any::<i64>().prop_map(|n| Some(json!(n))),
        ".{0,16}".prop_map(|s| Some(json!(s))),
    ];
    let strategy = (id, ".{0,32}", prop::option::of(any_json()));
    runner(1000)
        .run(&strategy, |(id, method, extra)| {
            let mut req = json!({"jsonrpc": "2.0", "method": method, "params": {"x": extra}});
            if let Some(id) = &id {
                req["id"] = id.clone();
            }
            let text = req.to_string();
            let req: Value = serde_json::from_str(&text).expect("own output parses");
            let got = parse_request(&text, 1 << 20).expect("well-formed request");
            prop_assert_eq!(got.id, id);
            prop_assert_eq!(got.method, method);
            prop_assert_eq!(got.params, req["params"].clone());
            Ok(())
        })
        .expect("well-formed property");
}

#[test]
fn rpc_decoder_never_panics_on_arbitrary_text_and_bounds_size() {
    let strategy = prop_oneof![
        ".{0,200}",
        // Near-JSON: fragments of a request, cut or mangled.
        (0usize..120, any::<u8>()).prop_map(|(cut, b)| {
            let full = r#"{"jsonrpc":"2.0","id":{"a":[1,2,{"b":null}]},"method":"session.resume","params":{"session_id":"é\u0000"}}"#;
            let mut s: String = full.chars().take(cut).collect();
            s.push(char::from(b % 128));
            s
        }),
        (1usize..300).prop_map(|depth| format!("{}{}", "[".repeat(depth), "]".repeat(depth))),
        (1usize..300).prop_map(|depth| format!("{}1{}", "{\"a\":".repeat(depth), "}".repeat(depth))),
    ];
    runner(2000)
        .run(&strategy, |text| {
            match parse_request(&text, 64) {
                Ok(r) => {
                    prop_assert!(text.len() <= 64);
                    prop_assert!(r.params.is_object());
                }
                Err((id, e)) => {
                    prop_assert!(matches!(
                        e.reason(),
                        "parse_error" | "invalid_request" | "invalid_params" | "payload_too_large"
                    ));
                    prop_assert!(id.is_null() || id.is_string() || id.is_number());
                    if text.len() > 64 {
                        prop_assert_eq!(e.reason(), "payload_too_large");
                    }
                }
            }
            Ok(())
        })
        .expect("decoder robustness");
}

/// Serialise events the way servers do, with comments, other fields and CRLF/LF line ends.
fn encode_sse(events: &[(Vec<String>, bool, bool)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (lines, crlf, comment) in events {
        let nl: &[u8] = if *crlf { b"\r\n" } else { b"\n" };
        if *comment {
            out.extend_from_slice(b": keep-alive");
            out.extend_from_slice(nl);
            out.extend_from_slice(b"event: chunk");
            out.extend_from_slice(nl);
        }
        for l in lines {
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(l.as_bytes());
            out.extend_from_slice(nl);
        }
        out.extend_from_slice(nl);
    }
    out
}

#[test]
fn sse_parser_recovers_the_events_whatever_the_chunking() {
    let line = "[^\r\n]{0,20}".prop_filter("no leading space", |s: &String| !s.starts_with(' '));
    let event = (
        prop::collection::vec(line, 1..4),
        any::<bool>(),
        any::<bool>(),
    );
    let strategy = (
        prop::collection::vec(event, 0..8),
        prop::collection::vec(1usize..17, 1..40),
    );
    runner(1500)
        .run(&strategy, |(events, cuts)| {
            let bytes = encode_sse(&events);
            let want: Vec<String> = events.iter().map(|(l, _, _)| l.join("\n")).collect();
            let mut p = SseParser::new();
            let mut got = Vec::new();
            let (mut i, mut k) = (0, 0);
            while i < bytes.len() {
                let j = (i + cuts[k % cuts.len()]).min(bytes.len());
                got.extend(p.feed(&bytes[i..j]));
                i = j;
                k += 1;
            }
            got.extend(p.finish());
            prop_assert_eq!(got, want);
            prop_assert_eq!(p.pending_len(), 0);
            Ok(())
        })
        .expect("SSE chunking property");
}

#[test]
fn sse_parser_never_panics_and_holds_only_an_unfinished_line() {
    let strategy = (prop::collection::vec(any::<u8>(), 0..400), 1usize..64);
    runner(2000)
        .run(&strategy, |(bytes, step)| {
            let mut p = SseParser::new();
            let mut fed = 0;
            for chunk in bytes.chunks(step) {
                for data in p.feed(chunk) {
                    // Lossy UTF-8: always valid text, never longer than the whole input allows.
                    prop_assert!(data.len() <= bytes.len() * 3);
                }
                fed += chunk.len();
                // Only the bytes after the last line end (LF or CR) fed so far stay buffered.
                let tail = bytes[..fed]
                    .iter()
                    .rev()
                    .take_while(|b| **b != b'\n' && **b != b'\r')
                    .count();
                prop_assert_eq!(p.pending_len(), tail);
            }
            let _ = p.finish();
            prop_assert_eq!(p.pending_len(), 0);
            Ok(())
        })
        .expect("SSE robustness");
}

#[test]
fn chunk_accumulator_and_response_parser_never_panic() {
    let chunk = prop_oneof![
        any_json(),
        (any_json(), any_json(), ".{0,8}").prop_map(|(content, args, name)| json!({
            "choices": [{"index": 0, "delta": {"content": content, "tool_calls": [
                {"index": 0, "id": "c", "function": {"name": name, "arguments": args}}]}, "finish_reason": null}]
        })),
    ];
    let strategy = prop::collection::vec(chunk, 0..12);
    runner(1000)
        .run(&strategy, |chunks| {
            let mut acc = StreamAccumulator::default();
            for c in &chunks {
                let _ = acc.apply(c);
                let _ = parse_response(c);
            }
            let _ = acc.finish();
            Ok(())
        })
        .expect("accumulator robustness");
}

/// Known config sections and some of their keys, to aim values at the validators.
const KEYS: &[(&str, &[&str])] = &[
    (
        "gateway",
        &[
            "host",
            "port",
            "max_frame_bytes",
            "drain_timeout_seconds",
            "ticket_ttl_seconds",
            "max_connections",
            "outbound_queue_frames",
            "api_keys",
            "allowed_cwd_roots",
        ],
    ),
    (
        "model",
        &[
            "provider",
            "base_url",
            "stream",
            "timeout_seconds",
            "idle_timeout_seconds",
            "max_retries",
            "max_response_bytes",
            "max_concurrent_requests",
        ],
    ),
    (
        "compression",
        &["enabled", "threshold", "max_attempts", "protect_last_n"],
    ),
    ("approvals", &["mode", "timeout"]),
    ("agent", &["clarify_timeout", "max_iterations"]),
    ("session", &["max_queued_admissions", "max_text_bytes"]),
    ("terminal", &["timeout", "cwd"]),
    ("platform_toolsets", &["cli", "api"]),
    ("profiles", &["a"]),
    ("rooms", &["enabled"]),
    ("unknown_section", &["x"]),
];

fn scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        (-5i64..100_000).prop_map(|n| json!(n)),
        any::<i64>().prop_map(|n| json!(n)),
        (-10.0f64..1e6).prop_map(|f| json!(f)),
        prop_oneof![
            Just("manual"),
            Just("off"),
            Just("http://127.0.0.1:9/v1"),
            Just("ftp://x"),
            Just("/tmp"),
            Just("")
        ]
        .prop_map(|s| json!(s)),
        ".{0,12}".prop_map(Value::String),
        prop::collection::vec(".{0,6}", 0..3).prop_map(|v| json!(v)),
    ]
}

/// YAML's printable set (`c-printable`): the loader reads JSON as YAML, which refuses the rest
/// (control characters and the noncharacters U+FFFE and U+FFFF) anywhere in the text.
fn yaml_printable(c: char) -> bool {
    matches!(c, '\t' | '\n' | '\r' | '\u{20}'..='\u{7E}' | '\u{85}' | '\u{A0}'..='\u{D7FF}')
        || matches!(c, '\u{E000}'..='\u{FFFD}' | '\u{10000}'..)
}

fn config_value() -> impl Strategy<Value = Value> {
    let entry = (0..KEYS.len(), 0usize..16, scalar());
    prop::collection::vec(entry, 0..10).prop_map(|entries| {
        let mut root = json!({});
        for (s, k, v) in entries {
            let (section, keys) = KEYS[s];
            let key = keys[k % keys.len()];
            if !root[section].is_object() {
                root[section] = json!({});
            }
            root[section][key] = v;
        }
        root
    })
}

#[test]
fn config_loader_accepts_or_names_the_bad_key_never_panics() {
    runner(1500)
        .run(&config_value(), |v| {
            // As JSON text and as YAML text: the same outcome.
            let as_json = Config::parse(&v.to_string(), Path::new("config.yaml"));
            let yaml = serde_norway::to_string(&v).expect("yaml");
            // YAML cannot carry every string JSON can (control characters): compare only when the
            // YAML text reads back as the same value.
            let representable = serde_norway::from_str::<Value>(&yaml).ok().as_ref() == Some(&v)
                && v.to_string().chars().all(yaml_printable);
            if representable {
                let as_yaml = Config::parse(&yaml, Path::new("config.yaml"));
                prop_assert_eq!(as_json.is_ok(), as_yaml.is_ok(), "{} / {}", v, yaml);
            }
            match as_json {
                Ok(c) => {
                    prop_assert!(c.gateway.max_frame_bytes >= 1024);
                    prop_assert!(c.model.timeout_seconds > 0.0);
                    // Every duration the daemon builds from the config is representable.
                    for v in [
                        c.model.timeout_seconds,
                        c.approvals.timeout,
                        c.agent.clarify_timeout,
                        c.terminal.timeout * 10.0,
                        c.gateway.drain_timeout_seconds,
                    ] {
                        prop_assert!(Duration::try_from_secs_f64(v).is_ok(), "{}", v);
                    }
                }
                Err(ConfigError::Invalid { key, .. }) => {
                    let top = key.split('.').next().unwrap_or("");
                    prop_assert!(
                        v.get(top).is_some(),
                        "error names {key}, which is not in {v}"
                    );
                }
                // The loader reads JSON as YAML, which refuses characters outside its printable set.
                Err(ConfigError::Parse { .. }) if !representable => {}
                Err(e) => prop_assert!(false, "unexpected error kind for {}: {}", v, e),
            }
            Ok(())
        })
        .expect("config property");
}

#[test]
fn config_loader_never_panics_on_arbitrary_text() {
    let strategy = prop_oneof![
        ".{0,120}",
        "[a-z_:\\- \n\t\\[\\]{}0-9\"']{0,200}",
        (1usize..200).prop_map(|d| format!("{}x", "- ".repeat(d))),
        (1usize..200).prop_map(|d| format!("{}1{}", "[".repeat(d), "]".repeat(d))),
    ];
    runner(1500)
        .run(&strategy, |text| {
            let _ = Config::parse(&text, Path::new("config.yaml"));
            Ok(())
        })
        .expect("config robustness");
}
