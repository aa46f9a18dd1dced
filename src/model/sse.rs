//! Server-sent events, parsed through a buffer: bytes arrive split at arbitrary boundaries, with
//! comments, CRLF, LF or CR line ends and several `data:` lines per event.

/// Incremental SSE parser: feed bytes, take complete `data` payloads.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
    data: Vec<String>,
    /// What `data` holds, counted as its bytes and [`LINE_COST`] a line.
    data_len: usize,
    /// The last line ended with a CR that ended the bytes fed: an LF first in the next bytes
    /// ends the same line (CRLF), not an empty one.
    after_cr: bool,
    /// The stream's first bytes have been looked at for a byte-order mark (see [`BOM`]).
    started: bool,
}

/// A UTF-8 byte-order mark, which the SSE specification lets a stream begin with (and some
/// servers send): left in, the first line read `\u{FEFF}data: …`, no field, and the first event
/// was lost.
const BOM: &[u8] = b"\xEF\xBB\xBF";

/// What one `data:` line of an unfinished event costs beside its bytes (its `String` and its
/// place in the list): a stream of empty `data:` lines with no blank line to end the event
/// held gigabytes against a bound that counted only the bytes.
const LINE_COST: usize = 32;

impl SseParser {
    pub fn new() -> Self {
        Self::default()
    }

    /// What is held for the event not yet complete: the bytes not yet parsed into lines, and
    /// the event's `data:` lines so far (each at its bytes and [`LINE_COST`]).
    pub fn pending_len(&self) -> usize {
        self.buf.len().saturating_add(self.data_len)
    }

    /// Feed bytes; return the `data` payloads of every event completed by them.
    pub fn feed(&mut self, bytes: &[u8]) -> Vec<String> {
        // What was buffered before holds no line end (each feed takes every complete line): only
        // the new bytes are searched, and the lines taken are dropped from the buffer at once.
        // (Searching the whole buffer and draining line by line was quadratic in a response of
        // many short lines, or one long line arriving in small pieces.)
        // A line ends at CR, LF or CRLF (the SSE specification's three).
        let mut bytes = bytes;
        if self.after_cr && !bytes.is_empty() {
            self.after_cr = false;
            bytes = bytes.strip_prefix(b"\n").unwrap_or(bytes);
        }
        let mut search = self.buf.len();
        self.buf.extend_from_slice(bytes);
        if !self.started {
            // A mark split over feeds is waited for whole (what is held so far has no line end).
            if self.buf.len() < BOM.len() && BOM.starts_with(&self.buf) {
                return Vec::new();
            }
            self.started = true;
            if self.buf.starts_with(BOM) {
                self.buf.drain(..BOM.len());
            }
            search = 0;
        }
        let mut out = Vec::new();
        let mut start = 0;
        while let Some(found) = self.buf[search..]
            .iter()
            .position(|b| *b == b'\n' || *b == b'\r')
        {
            let end = search + found;
            let line = &self.buf[start..end];
            self.data_len = Self::line(&mut self.data, self.data_len, line, &mut out);
            start = end + 1;
            if self.buf[end] == b'\r' {
                match self.buf.get(start) {
                    Some(b'\n') => start += 1,
                    Some(_) => {}
                    None => self.after_cr = true,
                }
            }
            search = start;
        }
        self.buf.drain(..start);
        out
    }

    /// End of stream: a final event without its blank line still counts.
    pub fn finish(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        if !self.buf.is_empty() {
            let line = std::mem::take(&mut self.buf);
            self.data_len = Self::line(&mut self.data, self.data_len, &line, &mut out);
        }
        if !self.data.is_empty() {
            out.push(self.data.join("\n"));
            self.data.clear();
        }
        self.data_len = 0;
        self.after_cr = false;
        out
    }

    /// Take one line into the event `data` (of `len`, see [`SseParser::pending_len`]): what
    /// the event holds after it.
    fn line(data: &mut Vec<String>, len: usize, line: &[u8], out: &mut Vec<String>) -> usize {
        if line.is_empty() {
            if !data.is_empty() {
                out.push(data.join("\n"));
                data.clear();
            }
            return 0;
        }
        if line.first() == Some(&b':') {
            return len;
        }
        // A field name alone is that field with an empty value.
        if line == b"data" {
            data.push(String::new());
            return len.saturating_add(LINE_COST);
        }
        let text = String::from_utf8_lossy(line);
        if let Some(rest) = text.strip_prefix("data:") {
            let rest = rest.strip_prefix(' ').unwrap_or(rest);
            data.push(rest.to_string());
            return len.saturating_add(rest.len() + LINE_COST);
        }
        // `event:`, `id:`, `retry:` and unknown fields are ignored.
        len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_anywhere_parse_the_same() {
        let stream = b": keep-alive\r\ndata: {\"a\":1}\r\n\r\nevent: x\ndata:{\"b\":2}\ndata: more\n\ndata: [DONE]\n\n";
        let whole = SseParser::new().feed(stream);
        assert_eq!(whole, vec!["{\"a\":1}", "{\"b\":2}\nmore", "[DONE]"]);
        for split in 0..stream.len() {
            let mut p = SseParser::new();
            let mut got = p.feed(&stream[..split]);
            got.extend(p.feed(&stream[split..]));
            got.extend(p.finish());
            assert_eq!(got, whole, "split at {split}");
        }
    }

    /// `stream` fed in two parts, split at each of its bytes (and an empty feed between), gives
    /// `whole`.
    fn same_at_every_split(stream: &[u8], whole: &[String]) {
        for split in 0..stream.len() {
            let mut p = SseParser::new();
            let mut got = p.feed(&stream[..split]);
            got.extend(p.feed(&[]));
            got.extend(p.feed(&stream[split..]));
            got.extend(p.finish());
            assert_eq!(got, whole, "split at {split}");
        }
    }

    /// Lines may end with a bare CR, as with CRLF or LF, wherever the bytes are split (a CR
    /// at the end of one feed and the LF at the start of the next are one line end); a `data`
    /// field without its colon is an empty line of data.
    #[test]
    fn lines_may_end_with_a_bare_cr() {
        let stream = b"data: a\r\rdata: b\r\ndata\rdata: c\r\r\n: note\rdata: d\n\r";
        let whole = SseParser::new().feed(stream);
        assert_eq!(whole, vec!["a", "b\n\nc", "d"]);
        same_at_every_split(stream, &whole);
    }

    /// An event's `data:` lines count toward what is pending, each beside its bytes, until
    /// the event ends.
    #[test]
    fn an_unfinished_events_lines_are_pending() {
        let mut p = SseParser::new();
        assert!(p.feed(&b"data:\n".repeat(1000)).is_empty());
        assert_eq!(p.pending_len(), 1000 * LINE_COST);
        assert!(p.feed(b"data: abc\nda").is_empty());
        assert_eq!(p.pending_len(), 1001 * LINE_COST + 3 + 2);
        assert_eq!(p.feed(b"ta: x\n\n").len(), 1);
        assert_eq!(p.pending_len(), 0);
    }

    /// A byte-order mark that starts the stream is skipped, wherever the bytes are split (the
    /// first event was lost); one anywhere else is no part of a field name, as before.
    #[test]
    fn a_leading_byte_order_mark_is_skipped() {
        let stream = b"\xEF\xBB\xBFdata: a\n\n\xEF\xBB\xBFdata: b\n\ndata: c\n\n";
        let whole = SseParser::new().feed(stream);
        assert_eq!(whole, vec!["a", "c"]);
        same_at_every_split(stream, &whole);
        for (a, b) in [(1, 2), (1, 3), (2, 3)] {
            let mut p = SseParser::new();
            let mut got = p.feed(&stream[..a]);
            got.extend(p.feed(&stream[a..b]));
            got.extend(p.feed(&stream[b..]));
            assert_eq!(got, whole, "split at {a} and {b}");
        }
    }

    #[test]
    fn a_final_event_without_blank_line_counts() {
        let mut p = SseParser::new();
        assert!(p.feed(b"data: x").is_empty());
        assert_eq!(p.finish(), vec!["x"]);
    }

    #[test]
    fn pseudo_random_chunkings_agree() {
        // A small deterministic LCG drives many chunkings (property-style, no extra dependency).
        let stream = b"data: {\"choices\":[{\"delta\":{\"content\":\"h\xc3\xa9\"}}]}\n\n: c\n\ndata: [DONE]\n\n";
        let expected = SseParser::new().feed(stream);
        let mut seed: u64 = 42;
        for _ in 0..500 {
            let mut p = SseParser::new();
            let mut got = Vec::new();
            let mut i = 0;
            while i < stream.len() {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let n = 1 + (seed >> 33) as usize % 7;
                let j = (i + n).min(stream.len());
                got.extend(p.feed(&stream[i..j]));
                i = j;
            }
            got.extend(p.finish());
            assert_eq!(got, expected);
        }
    }
}
