//! The config loader: never panics; a config it accepts passes its own validation.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(c) = gatehouse::config::Config::parse(text, std::path::Path::new("config.yaml")) {
        assert!(c.gateway.max_frame_bytes >= 1024);
    }
});
