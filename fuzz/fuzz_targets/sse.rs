//! The SSE parser: never panics, and any split of the bytes yields the same events.
#![no_main]

use gatehouse::model::sse::SseParser;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&cut, bytes)) = data.split_first() else {
        return;
    };
    let mut whole = SseParser::new();
    let mut a = whole.feed(bytes);
    a.extend(whole.finish());
    let at = (cut as usize).min(bytes.len());
    let mut split = SseParser::new();
    let mut b = split.feed(&bytes[..at]);
    b.extend(split.feed(&bytes[at..]));
    b.extend(split.finish());
    assert_eq!(a, b);
});
