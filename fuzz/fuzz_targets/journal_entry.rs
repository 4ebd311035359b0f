//! One line of `journalctl --output=json`: the entry and its MESSAGE, a
//! string or an array of bytes; and the same line as if cut short at the
//! line limit (its cursor and message salvaged).
#![no_main]
use libfuzzer_sys::fuzz_target;
use nodeguard::monitor::sources::{journal_message, salvage_journal_line};

fuzz_target!(|data: &[u8]| {
    let _ = salvage_journal_line(&String::from_utf8_lossy(data));
    let Ok(entry) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let _ = journal_message(&entry);
});
