//! Bounding terminal text: replies are cut to 64 KiB of UTF-8 on a character boundary, with a
//! notice; errors to 4 KiB. The store's bound on a result is sized for the longest reply and
//! error stored whole ([`crate::store::room_tasks::MAX_RESULT_BYTES`]: inside a JSON string a
//! control character takes six bytes), so a reply under the bound is never cut for what its
//! characters take once escaped (a 40,000-byte reply of newlines was cut to half).

/// Largest reply text, in UTF-8 bytes (notice included).
pub const MAX_TERMINAL_TEXT_BYTES: usize = 65536;
/// Largest error text, in UTF-8 bytes (notice included).
pub const MAX_TERMINAL_ERROR_BYTES: usize = 4096;
/// Appended to a truncated reply.
pub const TRUNCATION_NOTICE: &str =
    "\n\n[Reply truncated. Ask the Bot to share the full result as a file.]";

/// Cut `text` to at most `limit` UTF-8 bytes, the notice included, on a character boundary.
/// Returns the text and whether it was cut.
pub fn bound_text(text: &str, limit: usize) -> (String, bool) {
    if text.len() <= limit {
        return (text.to_string(), false);
    }
    let mut end = limit
        .saturating_sub(TRUNCATION_NOTICE.len())
        .min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let mut out = String::with_capacity(end + TRUNCATION_NOTICE.len());
    out.push_str(&text[..end]);
    out.push_str(TRUNCATION_NOTICE);
    (out, true)
}

/// The stored result of a member reply: `{message_id, text, error? (non-empty), truncated? (true)}`.
pub fn bounded_result(message_id: &str, text: &str, error: Option<&str>) -> serde_json::Value {
    let (text, truncated) = bound_text(text, MAX_TERMINAL_TEXT_BYTES);
    let mut result = serde_json::Map::new();
    result.insert("message_id".into(), message_id.into());
    result.insert("text".into(), text.into());
    if let Some(error) = error.filter(|e| !e.is_empty()) {
        let (error, error_cut) = bound_text(error, MAX_TERMINAL_ERROR_BYTES);
        result.insert("error".into(), error.into());
        if error_cut {
            result.insert("truncated".into(), true.into());
        }
    }
    if truncated {
        result.insert("truncated".into(), true.into());
    }
    serde_json::Value::Object(result)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_text_is_untouched() {
        assert_eq!(bound_text("hello", 10), ("hello".to_string(), false));
        let result = bounded_result("m", "hi", Some(""));
        assert_eq!(result, serde_json::json!({"message_id": "m", "text": "hi"}));
    }

    #[test]
    fn long_text_is_cut_on_a_char_boundary_with_the_notice() {
        let text = "é".repeat(MAX_TERMINAL_TEXT_BYTES);
        let (cut, truncated) = bound_text(&text, MAX_TERMINAL_TEXT_BYTES);
        assert!(truncated);
        assert!(cut.len() <= MAX_TERMINAL_TEXT_BYTES);
        assert!(cut.ends_with("share the full result as a file.]"));
        assert!(cut.len() > MAX_TERMINAL_TEXT_BYTES - TRUNCATION_NOTICE.len() - 4);
    }

    /// The bound is of the text's UTF-8 bytes, whatever its characters take once escaped: a
    /// reply under it is kept whole, and the longest reply and error of the characters that
    /// take the most stored (control characters, six bytes each) fit the store's bound.
    #[test]
    fn the_bound_is_of_the_texts_bytes_and_the_store_holds_the_longest() {
        for reply in ["\u{1}", "\"", "\\", "\n", "é\u{7}"] {
            let under = reply.repeat(MAX_TERMINAL_TEXT_BYTES / reply.len());
            assert_eq!(
                bound_text(&under, MAX_TERMINAL_TEXT_BYTES),
                (under.clone(), false)
            );
            let (cut, truncated) = bound_text(&format!("{under}xx"), MAX_TERMINAL_TEXT_BYTES);
            assert!(truncated, "{reply:?}");
            assert!(cut.len() <= MAX_TERMINAL_TEXT_BYTES, "{reply:?}");
            assert!(cut.len() > MAX_TERMINAL_TEXT_BYTES - 4, "{reply:?}");
        }
        let result = bounded_result(
            "m",
            &"\u{1}".repeat(MAX_TERMINAL_TEXT_BYTES + 1),
            Some(&"\u{2}".repeat(MAX_TERMINAL_ERROR_BYTES + 1)),
        );
        let stored = crate::store::rooms::canonical_json(&result).len();
        assert!(stored > 6 * MAX_TERMINAL_TEXT_BYTES, "{stored}");
        assert!(
            stored <= crate::store::room_tasks::MAX_RESULT_BYTES,
            "{stored}"
        );
    }

    /// An error is cut to its own, smaller bound, with the notice, and marked truncated, even
    /// when the reply beside it is short (the result's bound alone would have let it through).
    #[test]
    fn a_long_error_is_cut_to_its_own_bound() {
        let result = bounded_result("m", "short", Some(&"e".repeat(100_000)));
        let error = result["error"].as_str().unwrap_or_default();
        assert!(error.len() <= MAX_TERMINAL_ERROR_BYTES, "{}", error.len());
        assert!(error.len() > MAX_TERMINAL_ERROR_BYTES - TRUNCATION_NOTICE.len() - 4);
        assert!(error.ends_with(TRUNCATION_NOTICE));
        assert_eq!(result["text"], "short");
        assert_eq!(result["truncated"], true);
    }
}
