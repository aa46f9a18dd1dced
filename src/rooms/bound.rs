//! Bounding terminal text: replies are cut to 64 KiB on a character boundary, with a notice;
//! errors to 4 KiB. The bound is of the text as stored, inside a JSON string (a control
//! character takes six bytes there): a reply of 40,000 control characters was 64 KiB as text and
//! 390 KiB stored, over the store's bound, and the task's result could never be recorded.

/// Largest reply text, in UTF-8 bytes (notice included).
pub const MAX_TERMINAL_TEXT_BYTES: usize = 65536;
/// Largest error text, in UTF-8 bytes (notice included).
pub const MAX_TERMINAL_ERROR_BYTES: usize = 4096;
/// Appended to a truncated reply.
pub const TRUNCATION_NOTICE: &str =
    "\n\n[Reply truncated. Ask the Bot to share the full result as a file.]";

/// The bytes `c` takes inside a JSON string as serde_json writes it.
fn escaped_len(c: char) -> usize {
    match c {
        '"' | '\\' | '\n' | '\r' | '\t' | '\u{8}' | '\u{c}' => 2,
        c if (c as u32) < 0x20 => 6,
        c => c.len_utf8(),
    }
}

/// The bytes `text` takes inside a JSON string.
pub fn stored_len(text: &str) -> usize {
    text.chars().map(escaped_len).sum()
}

/// Cut `text` so that it takes at most `limit` bytes inside a JSON string, the notice included.
/// Returns the text and whether it was cut.
pub fn bound_text(text: &str, limit: usize) -> (String, bool) {
    if text.len() <= limit && stored_len(text) <= limit {
        return (text.to_string(), false);
    }
    let room = limit.saturating_sub(stored_len(TRUNCATION_NOTICE));
    let (mut end, mut used) = (0, 0);
    for (at, c) in text.char_indices() {
        used += escaped_len(c);
        if used > room {
            break;
        }
        end = at + c.len_utf8();
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

    /// The bound is of the text as stored: a reply of control characters, quotes and
    /// backslashes takes no more than the bound inside its JSON string, and the result of the
    /// longest reply with the longest error fits the store's bound.
    #[test]
    fn the_bound_is_of_the_text_as_stored() {
        for reply in ["\u{1}", "\"", "\\", "\n", "é\u{7}"] {
            let text = reply.repeat(MAX_TERMINAL_TEXT_BYTES);
            let (cut, truncated) = bound_text(&text, MAX_TERMINAL_TEXT_BYTES);
            assert!(truncated);
            let stored = serde_json::Value::from(cut.as_str()).to_string().len() - 2;
            assert_eq!(stored, stored_len(&cut), "{reply:?}");
            assert!(stored <= MAX_TERMINAL_TEXT_BYTES, "{reply:?}: {stored}");
            assert!(stored > MAX_TERMINAL_TEXT_BYTES - 8, "{reply:?}: {stored}");
        }
        let short = "\u{1}".repeat(100);
        assert_eq!(bound_text(&short, 1000), (short.clone(), false));
        let result = bounded_result(
            "m",
            &"\u{1}".repeat(MAX_TERMINAL_TEXT_BYTES),
            Some(&"\u{2}".repeat(MAX_TERMINAL_ERROR_BYTES)),
        );
        assert!(result.to_string().len() <= crate::store::room_tasks::MAX_RESULT_BYTES);
    }
}
