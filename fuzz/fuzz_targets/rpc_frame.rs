//! The WebSocket JSON-RPC frame decoder: never panics, and what it accepts is well-formed.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match gatehouse::api::ws::parse_request(text, 1 << 20) {
        Ok(req) => assert!(req.params.is_object()),
        Err((id, _)) => assert!(id.is_null() || id.is_string() || id.is_number()),
    }
});
