//! Rough token estimates (chars / 4) and the context limit of a model.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use serde_json::Value;

/// Default context window when nothing else is known.
pub const DEFAULT_CONTEXT: u64 = 128_000;

/// `(len(system) + Σ len(json(msg)) + len(json(tools))) / 4`.
pub fn estimate_request<M: serde::Serialize>(messages: &[M], tools: Option<&Value>) -> u64 {
    let mut chars: usize = messages.iter().map(json_len).sum();
    if let Some(t) = tools {
        chars += json_len(t);
    }
    (chars / 4) as u64
}

/// The length of `v.to_string()`, counted as it is written instead of built: a turn estimates
/// every request before sending it, and the whole transcript was copied into strings each time.
fn json_len<T: serde::Serialize + ?Sized>(v: &T) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0 += bytes.len();
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    // A `Value` (or a message of strings) always serializes, and the counter never fails.
    let _ = serde_json::to_writer(&mut count, v);
    count.0
}

/// The context limit: config, else `models_dev_cache.json` (exact then case-insensitive id),
/// else [`DEFAULT_CONTEXT`].
pub fn context_limit(configured: Option<u64>, home: &Path, provider: &str, model: &str) -> u64 {
    context_limit_within(configured, home, provider, model, RECHECK)
}

/// [`context_limit`], trusting a read of the file for `recheck`.
fn context_limit_within(
    configured: Option<u64>,
    home: &Path,
    provider: &str,
    model: &str,
    recheck: Duration,
) -> u64 {
    if let Some(c) = configured.filter(|c| *c > 0) {
        return c;
    }
    lookup_cache(home, provider, model, recheck).unwrap_or(DEFAULT_CONTEXT)
}

/// A model endpoint's window as its own overflow errors gave it (`maximum context length is 4096
/// tokens`), by provider, base URL and model: for a model whose window neither the config nor
/// the limits file gives, which was taken for [`DEFAULT_CONTEXT`], so its sessions never
/// compacted before a request and every long turn began with a refused one.
static LEARNED: Mutex<Option<HashMap<Endpoint, u64>>> = Mutex::new(None);

/// A model endpoint: provider, base URL, model.
type Endpoint = (String, String, String);

/// The key of a learned window.
fn endpoint(provider: &str, base_url: &str, model: &str) -> Endpoint {
    (
        provider.to_string(),
        base_url.to_string(),
        model.to_string(),
    )
}

/// Most endpoints whose window is learned (sessions may name their own).
const MAX_LEARNED: usize = 1024;

/// The window learned for `(provider, base_url, model)`, if any.
pub fn learned(provider: &str, base_url: &str, model: &str) -> Option<u64> {
    let key = endpoint(provider, base_url, model);
    LEARNED.lock().ok()?.as_ref()?.get(&key).copied()
}

/// Learn that `(provider, base_url, model)` has a window of `limit` tokens, if that is less than
/// what was known; whether it was.
pub fn learn(provider: &str, base_url: &str, model: &str, limit: u64) -> bool {
    let Ok(mut guard) = LEARNED.lock() else {
        return false;
    };
    let map = guard.get_or_insert_with(HashMap::new);
    let key = endpoint(provider, base_url, model);
    match map.get(&key) {
        Some(known) if *known <= limit => false,
        Some(_) => {
            map.insert(key, limit);
            true
        }
        None if map.len() >= MAX_LEARNED => false,
        None => {
            map.insert(key, limit);
            true
        }
    }
}

/// The window an overflow error names (`maximum context length is 8192 tokens`, `context
/// size (4096 tokens)`, `max_model_len 32768`), if it names one: the first number soon after
/// the words that introduce it.
pub fn limit_in_error(detail: &str) -> Option<u64> {
    let lower = detail.to_ascii_lowercase();
    [
        "context length",
        "context window",
        "context size",
        "max_model_len",
        "n_ctx",
        // Gemini: "... exceeds the maximum number of tokens allowed (131072)"; xAI: "This
        // model's maximum prompt length is 131072 but the request contains 136973 tokens".
        "tokens allowed",
        "prompt length",
    ]
    .iter()
    .filter_map(|words| {
        let at = lower.find(words)? + words.len();
        let near: String = lower[at..].chars().take(40).collect();
        // "exceeded max context length by 4021 tokens" (Ollama) names the excess, not the
        // window: learned, it shrank the window to a few thousand tokens or fewer.
        let before: String = near.chars().take_while(|c| !c.is_ascii_digit()).collect();
        if before.split_whitespace().any(|w| w == "by") {
            return None;
        }
        let digits: String = near
            .chars()
            .skip_while(|c| !c.is_ascii_digit())
            .take_while(|c| c.is_ascii_digit() || *c == ',')
            .filter(|c| *c != ',')
            .collect();
        digits.parse::<u64>().ok().filter(|n| *n >= 256)
    })
    .next()
}

/// How long a read of the limits file is trusted before the file is `stat`ed again: every model
/// call of a turn asks, and the `stat` per call was 2-3 % of the supervisors' thread's CPU.
const RECHECK: Duration = Duration::from_secs(1);

/// Context limits by provider, then model id, as `models_dev_cache.json` lists them.
type Limits = HashMap<String, HashMap<String, u64>>;

/// The parsed file, with what identifies the version it was read from and when that was checked.
struct CachedLimits {
    stamp: Option<(SystemTime, u64)>,
    checked: Instant,
    limits: Arc<Limits>,
}

/// Parsed once per change of the file (a turn only `stat`s it, at most once per [`RECHECK`]):
/// the file can be megabytes, and reading it per turn on the supervisors' thread would stall
/// every session. Keyed by the home directory.
static LIMITS: Mutex<Option<HashMap<PathBuf, CachedLimits>>> = Mutex::new(None);

fn limits(home: &Path, recheck: Duration) -> Arc<Limits> {
    let Ok(mut guard) = LIMITS.lock() else {
        return Arc::new(parse_limits(&home.join(LIMITS_FILE)));
    };
    let cache = guard.get_or_insert_with(HashMap::new);
    if let Some(c) = cache.get(home).filter(|c| c.checked.elapsed() < recheck) {
        return c.limits.clone();
    }
    let path = home.join(LIMITS_FILE);
    let stamp = std::fs::metadata(&path)
        .ok()
        .and_then(|m| Some((m.modified().ok()?, m.len())));
    if let Some(c) = cache.get_mut(home).filter(|c| c.stamp == stamp) {
        c.checked = Instant::now();
        return c.limits.clone();
    }
    let limits = Arc::new(if stamp.is_some() {
        parse_limits(&path)
    } else {
        Limits::new()
    });
    cache.insert(
        home.to_path_buf(),
        CachedLimits {
            stamp,
            checked: Instant::now(),
            limits: limits.clone(),
        },
    );
    limits
}

const LIMITS_FILE: &str = "models_dev_cache.json";

fn parse_limits(path: &Path) -> Limits {
    let Some(v) = std::fs::read_to_string(path)
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
    else {
        return Limits::new();
    };
    let Some(providers) = v.as_object() else {
        return Limits::new();
    };
    providers
        .iter()
        .filter_map(|(provider, p)| {
            let models = p.get("models")?.as_object()?;
            let limits = models
                .iter()
                .filter_map(|(id, m)| {
                    let c = m.pointer("/limit/context")?.as_u64().filter(|c| *c > 0)?;
                    Some((id.clone(), c))
                })
                .collect();
            Some((provider.clone(), limits))
        })
        .collect()
}

fn lookup_cache(home: &Path, provider: &str, model: &str, recheck: Duration) -> Option<u64> {
    let limits = limits(home, recheck);
    let models = limits.get(provider)?;
    models.get(model).copied().or_else(|| {
        models
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(model))
            .map(|(_, c)| *c)
    })
}

/// Below this window a configured threshold fraction is raised to [`SMALL_WINDOW_FRACTION`]:
/// half of a small window leaves too little room to work before every turn compacts again.
pub const SMALL_WINDOW: u64 = 512_000;
/// The least fraction of a window under [`SMALL_WINDOW`] that triggers compaction.
pub const SMALL_WINDOW_FRACTION: f64 = 0.75;
/// The least threshold (in tokens) before the window itself bounds it.
pub const MIN_THRESHOLD: u64 = 64_000;

/// The compression threshold of a model with a `context`-token window that may answer with up to
/// `max_tokens` (at most half the window): `fraction` of what is left of the window once an answer fits (at least 0.75 of a
/// window under 512K), at least 64K, but below the window (85 % of it when 64K would not fit),
/// and capped by `threshold_tokens` (itself at most the window).
pub fn threshold(context: u64, fraction: f64, cap: Option<u64>, max_tokens: Option<u64>) -> u64 {
    let fraction = if context < SMALL_WINDOW {
        fraction.max(SMALL_WINDOW_FRACTION)
    } else {
        fraction
    };
    // Room for the answer, but never more than half the window: `model.max_tokens` is one
    // setting for every model, and a profile model with a small window would be left nothing.
    let answer = max_tokens.unwrap_or(0).min(context / 2);
    let window = context.saturating_sub(answer).max(1);
    let mut t = (((window as f64) * fraction) as u64).max(MIN_THRESHOLD);
    if t >= window {
        t = (((window as f64) * 0.85) as u64).min(window - 1).max(1);
    }
    match cap.filter(|c| *c > 0) {
        Some(c) => t.min(c.min(context)),
        None => t,
    }
    .max(1)
}

/// The most tokens a compaction summary may be written in, for a model with a `context`-token
/// window: 5 % of the window, at most 10,000.
pub fn max_summary_tokens(context: u64) -> u64 {
    ((context as f64 * 0.05) as u64).clamp(1, 10_000)
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_overflow_error_names_its_window() {
        for (detail, want) in [
            ("HTTP 400: This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens.", Some(8192)),
            ("request (5000 tokens) exceeds the available context size (4096 tokens), try increasing it", Some(4096)),
            ("prompt is longer than max_model_len 32,768", Some(32768)),
            ("context_length_exceeded", None),
            ("prompt too long; exceeded max context length by 4021 tokens", None),
            ("too many tokens", None),
            ("HTTP 400: The input token count (134123) exceeds the maximum number of tokens allowed (131072).", Some(131072)),
            ("HTTP 400: This model's maximum prompt length is 131072 but the request contains 136973 tokens.", Some(131072)),
        ] {
            assert_eq!(limit_in_error(detail), want, "{detail}");
        }
        assert!(learn("p", "http://learned.test", "m", 8192));
        assert!(
            !learn("p", "http://learned.test", "m", 9000),
            "not a larger one"
        );
        assert!(learn("p", "http://learned.test", "m", 4096));
        assert_eq!(learned("p", "http://learned.test", "m"), Some(4096));
        assert_eq!(learned("p", "http://learned.test", "other"), None);
    }

    use super::*;

    #[test]
    fn threshold_arithmetic() {
        // A 64K window: 0.75 of it is under the 64K floor, which is the whole window, so 85 %.
        assert_eq!(threshold(64_000, 0.5, None, None), 54_400);
        assert_eq!(threshold(64_000, 0.5, Some(12_000), None), 12_000);
        // The cap is at most the window; a zero cap is none.
        assert_eq!(threshold(10_000, 0.5, Some(50_000), None), 8_500);
        assert_eq!(threshold(128_000, 0.5, Some(0), None), 96_000);
        // Under 512K the fraction is raised to 0.75, never lowered; from 512K it stands.
        assert_eq!(threshold(200_000, 0.9, None, None), 180_000);
        assert_eq!(threshold(1_000_000, 0.5, None, None), 500_000);
        assert_eq!(threshold(1_000_000, 0.01, None, None), 64_000);
        // Room for the answer comes off the window first.
        assert_eq!(threshold(128_000, 0.5, None, Some(28_000)), 75_000);
        assert_eq!(threshold(70_000, 0.5, None, Some(10_000)), 51_000);
        // The answer's room is at most half the window: an 8K model under a max_tokens of 8192
        // keeps 4K to work in (it was left 1 token, and compacted before every request).
        assert_eq!(threshold(8_000, 0.5, None, Some(8_192)), 3_400);
        assert_eq!(threshold(4_000, 0.5, None, Some(8_000)), 1_700);
        // Degenerate windows still give a threshold of at least one token.
        assert_eq!(threshold(1, 0.5, None, None), 1);
        assert_eq!(threshold(0, 0.5, None, Some(10)), 1);
    }

    #[test]
    fn summary_budget_is_five_percent_of_the_window_up_to_ten_thousand() {
        assert_eq!(max_summary_tokens(64_000), 3_200);
        assert_eq!(max_summary_tokens(1_000_000), 10_000);
        assert_eq!(max_summary_tokens(0), 1);
    }

    #[test]
    fn context_limit_order() {
        let dir = std::env::temp_dir().join(format!("gh-tokens-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("dir");
        std::fs::write(
            dir.join("models_dev_cache.json"),
            r#"{"custom":{"id":"custom","models":{"Original":{"limit":{"context":64000}}}}}"#,
        )
        .expect("write");
        assert_eq!(context_limit(Some(5), &dir, "custom", "original"), 5);
        assert_eq!(context_limit(None, &dir, "custom", "original"), 64_000);
        assert_eq!(
            context_limit(None, &dir, "custom", "other"),
            DEFAULT_CONTEXT
        );
        // A new version of the file (another length) is read again once the last read is older
        // than the recheck interval; within it, the last read stands.
        std::fs::write(
            dir.join("models_dev_cache.json"),
            r#"{"custom":{"id":"custom","models":{"Original":{"limit":{"context":32000}},"other":{"limit":{"context":8000}}}}}"#,
        )
        .expect("rewrite");
        let hour = Duration::from_secs(3600);
        assert_eq!(
            context_limit_within(None, &dir, "custom", "original", hour),
            64_000
        );
        let now = Duration::ZERO;
        assert_eq!(
            context_limit_within(None, &dir, "custom", "original", now),
            32_000
        );
        assert_eq!(
            context_limit_within(None, &dir, "custom", "other", now),
            8_000
        );
        std::fs::remove_file(dir.join("models_dev_cache.json")).expect("remove");
        assert_eq!(
            context_limit_within(None, &dir, "custom", "original", now),
            DEFAULT_CONTEXT
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn json_len_is_the_length_of_the_json_text() {
        for v in [
            serde_json::json!(null),
            serde_json::json!({"role": "user", "content": "tab\t, quote \", é, 🦀, \u{1}"}),
            serde_json::json!([1, 2.5, -3, {"a": [true, false]}, "x".repeat(5000)]),
        ] {
            assert_eq!(json_len(&v), v.to_string().len(), "{v}");
        }
    }

    #[test]
    fn estimate_counts_tools() {
        let m = vec![serde_json::json!({"role":"user","content":"x".repeat(400)})];
        let base = estimate_request(&m, None);
        let with = estimate_request(&m, Some(&serde_json::json!([{"name":"y".repeat(400)}])));
        assert!(base >= 100 && with >= base + 100, "{base} {with}");
    }
}
