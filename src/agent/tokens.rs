//! Rough token estimates (chars / 4) and the context limit of a model.

use std::path::Path;

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

fn lookup_cache(home: &Path, provider: &str, model: &str) -> Option<u64> {
    let text = std::fs::read_to_string(home.join("models_dev_cache.json")).ok()?;
    let v: Value = serde_json::from_str(&text).ok()?;
    let models = v.get(provider)?.get("models")?.as_object()?;
    let entry = models.get(model).or_else(|| {
        models
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(model))
            .map(|(_, v)| v)
    })?;
    entry.pointer("/limit/context")?.as_u64().filter(|c| *c > 0)
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
