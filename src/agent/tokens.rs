//! Rough token estimates (chars / 4) and the context limit of a model.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use serde_json::Value;

/// Default context window when nothing else is known.
pub const DEFAULT_CONTEXT: u64 = 128_000;

/// `(len(system) + Σ len(json(msg)) + len(json(tools))) / 4`.
pub fn estimate_request(messages: &[Value], tools: Option<&Value>) -> u64 {
    let mut chars: usize = messages.iter().map(|m| m.to_string().len()).sum();
    if let Some(t) = tools {
        chars += t.to_string().len();
    }
    (chars / 4) as u64
}

/// The context limit: config, else `models_dev_cache.json` (exact then case-insensitive id),
/// else [`DEFAULT_CONTEXT`].
pub fn context_limit(configured: Option<u64>, home: &Path, provider: &str, model: &str) -> u64 {
    if let Some(c) = configured.filter(|c| *c > 0) {
        return c;
    }
    lookup_cache(home, provider, model).unwrap_or(DEFAULT_CONTEXT)
}

/// Context limits by provider, then model id, as `models_dev_cache.json` lists them.
type Limits = HashMap<String, HashMap<String, u64>>;

/// The parsed file, with what identifies the version it was read from.
struct CachedLimits {
    stamp: Option<(SystemTime, u64)>,
    limits: Arc<Limits>,
}

/// Parsed once per change of the file (a turn only `stat`s it): the file can be megabytes, and
/// reading it per turn on the supervisors' thread would stall every session.
static LIMITS: Mutex<Option<HashMap<PathBuf, CachedLimits>>> = Mutex::new(None);

fn limits(home: &Path) -> Arc<Limits> {
    let path = home.join("models_dev_cache.json");
    let stamp = std::fs::metadata(&path)
        .ok()
        .and_then(|m| Some((m.modified().ok()?, m.len())));
    let Ok(mut guard) = LIMITS.lock() else {
        return Arc::new(parse_limits(&path));
    };
    let cache = guard.get_or_insert_with(HashMap::new);
    if let Some(c) = cache.get(&path).filter(|c| c.stamp == stamp) {
        return c.limits.clone();
    }
    let limits = Arc::new(if stamp.is_some() {
        parse_limits(&path)
    } else {
        Limits::new()
    });
    cache.insert(
        path,
        CachedLimits {
            stamp,
            limits: limits.clone(),
        },
    );
    limits
}

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

fn lookup_cache(home: &Path, provider: &str, model: &str) -> Option<u64> {
    let limits = limits(home);
    let models = limits.get(provider)?;
    models.get(model).copied().or_else(|| {
        models
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(model))
            .map(|(_, c)| *c)
    })
}

/// The compression threshold: `threshold × context`, capped by `threshold_tokens`.
pub fn threshold(context: u64, fraction: f64, cap: Option<u64>) -> u64 {
    let t = ((context as f64) * fraction) as u64;
    match cap.filter(|c| *c > 0) {
        Some(c) => t.min(c.min(context)),
        None => t,
    }
    .max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threshold_arithmetic() {
        assert_eq!(threshold(64_000, 0.5, Some(12_000)), 12_000);
        assert_eq!(threshold(64_000, 0.5, None), 32_000);
        assert_eq!(threshold(10_000, 0.5, Some(50_000)), 5_000);
        assert_eq!(threshold(128_000, 0.75, Some(0)), 96_000);
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
        // A new version of the file (another length) is read again.
        std::fs::write(
            dir.join("models_dev_cache.json"),
            r#"{"custom":{"id":"custom","models":{"Original":{"limit":{"context":32000}},"other":{"limit":{"context":8000}}}}}"#,
        )
        .expect("rewrite");
        assert_eq!(context_limit(None, &dir, "custom", "original"), 32_000);
        assert_eq!(context_limit(None, &dir, "custom", "other"), 8_000);
        std::fs::remove_file(dir.join("models_dev_cache.json")).expect("remove");
        assert_eq!(
            context_limit(None, &dir, "custom", "original"),
            DEFAULT_CONTEXT
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn estimate_counts_tools() {
        let m = vec![serde_json::json!({"role":"user","content":"x".repeat(400)})];
        let base = estimate_request(&m, None);
        let with = estimate_request(&m, Some(&serde_json::json!([{"name":"y".repeat(400)}])));
        assert!(base >= 100 && with >= base + 100, "{base} {with}");
    }
}
