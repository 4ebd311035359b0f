//! One line of `journalctl --output=json`: the entry and its MESSAGE, a
//! string or an array of bytes; and the same line cut short at every
//! point, as the reader cuts an entry over its limit: what is salvaged
//! must be the entry's own cursor (whole) or none, and a prefix of its
//! message.
#![no_main]
use libfuzzer_sys::fuzz_target;
use nodeguard::monitor::sources::lines::{journal_message, salvage_journal_line};

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let _ = salvage_journal_line(&text);
    let Ok(entry) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let message = journal_message(&entry);
    // Only lines as journalctl prints them: an object, compact, whose
    // cursor and message are not nested deeper.
    let Some(line) = std::str::from_utf8(data)
        .ok()
        .filter(|l| l.starts_with('{'))
    else {
        return;
    };
    if serde_json::to_string(&entry).ok().as_deref() != Some(line) {
        return;
    }
    let cursor = entry.get("__CURSOR").and_then(|c| c.as_str());
    for n in (1..line.len()).filter(|&n| line.is_char_boundary(n)) {
        let Some((c, m)) = salvage_journal_line(&line[..n]) else {
            continue;
        };
        assert!(
            c.is_none() || c.as_deref() == cursor,
            "cursor {c:?} of {line:?} cut at {n}"
        );
        if let (Some(whole), Some(Some(part)), Some(serde_json::Value::String(_))) =
            (&message, Some(m), entry.get("MESSAGE"))
        {
            assert!(
                whole.starts_with(&part),
                "{part:?} is no prefix of {whole:?}"
            );
        }
    }
});
