//! One line of `journalctl --output=json`: the entry and its MESSAGE, a
//! string or an array of bytes.
#![no_main]
use libfuzzer_sys::fuzz_target;
use nodeguard::monitor::sources::journal_message;

fuzz_target!(|data: &[u8]| {
    let Ok(entry) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let _ = journal_message(&entry);
});
