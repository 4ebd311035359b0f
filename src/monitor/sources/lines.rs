//! Lines as read: capped at [`MAX_LINE`], decoded lossily, and journal
//! JSON entries taken apart. Pure: the replay (`nodeguard check --replay`)
//! uses it without the readers.

use std::io::BufRead;

/// The most of one file line that is kept and matched (64 KiB; journald
/// cuts its own stream lines at 48 KiB). The rest of a longer line is read
/// past, not held: a writer that never ends its line costs no memory.
pub const MAX_LINE: usize = 64 * 1024;

/// Reads up to and including the next newline into `line`, keeping at most
/// `MAX_LINE` bytes of it (`truncated` is set when more came). Returns the
/// bytes consumed and whether the line is complete (false at the end of the
/// data: the writer is mid-line, and the next call goes on with it).
pub fn read_line_capped(
    reader: &mut impl BufRead,
    line: &mut Vec<u8>,
    truncated: &mut bool,
) -> std::io::Result<(usize, bool)> {
    read_line_capped_to(reader, line, truncated, MAX_LINE)
}

/// [`read_line_capped`] keeping at most `max` bytes.
pub(super) fn read_line_capped_to(
    reader: &mut impl BufRead,
    line: &mut Vec<u8>,
    truncated: &mut bool,
    max: usize,
) -> std::io::Result<(usize, bool)> {
    let mut consumed = 0;
    loop {
        let available = match reader.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if available.is_empty() {
            return Ok((consumed, false));
        }
        let (take, complete) = match available.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (available.len(), false),
        };
        let room = max.saturating_sub(line.len());
        let chunk = &available[..take];
        let body = chunk.strip_suffix(b"\n").unwrap_or(chunk);
        if body.len() > room {
            *truncated = true;
        }
        line.extend_from_slice(&body[..body.len().min(room)]);
        reader.consume(take);
        consumed += take;
        if complete {
            return Ok((consumed, true));
        }
    }
}

pub(super) fn text(bytes: &[u8]) -> std::borrow::Cow<'_, str> {
    let bytes = bytes.strip_suffix(b"\n").unwrap_or(bytes);
    String::from_utf8_lossy(bytes)
}

/// The text of a journal entry in `journalctl --output=json`: MESSAGE is a
/// string, or an array of bytes when it is not valid UTF-8.
pub fn journal_message(entry: &serde_json::Value) -> Option<String> {
    match entry.get("MESSAGE")? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(bytes) => {
            let b: Vec<u8> = bytes
                .iter()
                .filter_map(|v| v.as_u64().map(|n| n as u8))
                .collect();
            Some(String::from_utf8_lossy(&b).into_owned())
        }
        _ => None,
    }
}

/// The most of one `journalctl --output=json` line that is kept: room for
/// a `MAX_LINE` message even where JSON escapes it, and the few other
/// fields. A longer entry is read up to here, its message salvaged.
pub(super) const MAX_JOURNAL_LINE: usize = 4 * MAX_LINE;

/// The cursor and the message of a JSON entry cut short at
/// `MAX_JOURNAL_LINE`: the message up to the cut (a text or an array of
/// bytes), the cursor if all of it came before the cut (else the reader
/// keeps the previous one, and a restart reads this entry again). `None`
/// without a message.
pub fn salvage_journal_line(line: &str) -> Option<(Option<String>, Option<String>)> {
    // A JSON string's body starting at `s`, up to its closing quote or the
    // cut, decoded (a partial escape at the cut is dropped); and whether
    // its closing quote was read.
    pub(super) fn string_at(s: &str) -> (String, bool) {
        let mut end = s.len();
        let mut escaped = false;
        for (i, b) in s.bytes().enumerate() {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => {
                    end = i;
                    break;
                }
                _ => {}
            }
        }
        let body = &s[..end];
        // Up to 6 bytes (`\uXXXX`) of a cut escape are dropped.
        let text = (0..=6.min(body.len()))
            .filter(|k| body.is_char_boundary(body.len() - k))
            .find_map(|k| {
                serde_json::from_str::<String>(&format!("\"{}\"", &body[..body.len() - k])).ok()
            })
            .unwrap_or_default();
        (text, end < s.len())
    }
    // journalctl orders an entry's fields at random (per run): the cursor
    // may come after the cut, or be cut itself. Only a whole one is taken.
    let cursor = line
        .find("\"__CURSOR\":\"")
        .map(|i| string_at(&line[i + "\"__CURSOR\":\"".len()..]))
        .and_then(|(c, whole)| whole.then_some(c));
    let at = line.find("\"MESSAGE\":")? + "\"MESSAGE\":".len();
    let value = &line[at..];
    let message = if let Some(s) = value.strip_prefix('"') {
        string_at(s).0
    } else if let Some(a) = value.strip_prefix('[') {
        let bytes: Vec<u8> = a
            .split([',', ']'])
            .map_while(|n| n.trim().parse::<u8>().ok())
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    } else {
        return None;
    };
    Some((cursor, Some(message)))
}
