//! Server-sent events, parsed through a buffer: bytes arrive split at arbitrary boundaries, with
//! comments, CRLF line ends and several `data:` lines per event.

/// Incremental SSE parser: feed bytes, take complete `data` payloads.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
    data: Vec<String>,
}

impl SseParser {
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes buffered but not yet parsed into an event.
    pub fn pending_len(&self) -> usize {
        self.buf.len()
    }

    /// Feed bytes; return the `data` payloads of every event completed by them.
    pub fn feed(&mut self, bytes: &[u8]) -> Vec<String> {
        // What was buffered before holds no line end (each feed takes every complete line): only
        // the new bytes are searched, and the lines taken are dropped from the buffer at once.
        // (Searching the whole buffer and draining line by line was quadratic in a response of
        // many short lines, or one long line arriving in small pieces.)
        let mut search = self.buf.len();
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        let mut start = 0;
        while let Some(found) = self.buf[search..].iter().position(|b| *b == b'\n') {
            let end = search + found;
            let line = &self.buf[start..end];
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            Self::line(&mut self.data, line, &mut out);
            start = end + 1;
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
            Self::line(&mut self.data, &line, &mut out);
        }
        if !self.data.is_empty() {
            out.push(self.data.join("\n"));
            self.data.clear();
        }
        out
    }

    fn line(data: &mut Vec<String>, line: &[u8], out: &mut Vec<String>) {
        if line.is_empty() {
            if !data.is_empty() {
                out.push(data.join("\n"));
                data.clear();
            }
            return;
        }
        if line.first() == Some(&b':') {
            return;
        }
        let text = String::from_utf8_lossy(line);
        if let Some(rest) = text.strip_prefix("data:") {
            data.push(rest.strip_prefix(' ').unwrap_or(rest).to_string());
        }
        // `event:`, `id:`, `retry:` and unknown fields are ignored.
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
