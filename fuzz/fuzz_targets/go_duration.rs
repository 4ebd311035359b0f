//! Go duration strings of NPD configs ("30s", "1h30m", "500ms").
#![no_main]
use libfuzzer_sys::fuzz_target;
use nodeguard::policy::npd::go_duration_seconds;

fuzz_target!(|data: &[u8]| {
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = go_duration_seconds(s);
    }
});
