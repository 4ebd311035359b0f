//! `/dev/kmsg` records: `PRI,SEQ,TS_USEC,FLAGS[,...];MESSAGE`, followed
//! by continuation lines (dictionary `KEY=VALUE` lines) that start with a
//! space. One read(2) returns one record.

/// One kernel log record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KmsgRecord {
    /// Syslog priority (facility × 8 + level).
    pub priority: u32,
    /// Monotonic sequence number: survives agent restarts, not reboots.
    pub sequence: u64,
    /// Microseconds since boot.
    pub timestamp_us: u64,
    /// `c` marks a fragment of a longer message.
    pub continued: bool,
    pub message: String,
}

impl KmsgRecord {
    /// The log level (0 emergency … 7 debug).
    pub fn level(&self) -> u32 {
        self.priority & 7
    }
}

/// Parses one record; `None` for a malformed one (counted, never fatal).
/// Continuation (dictionary) lines are dropped; escaped bytes (`\x0a`)
/// are decoded.
pub fn parse(record: &str) -> Option<KmsgRecord> {
    let first = record.lines().next()?;
    let (prefix, message) = first.split_once(';')?;
    let mut fields = prefix.split(',');
    let priority = fields.next()?.trim().parse().ok()?;
    let sequence = fields.next()?.trim().parse().ok()?;
    let timestamp_us = fields.next()?.trim().parse().ok()?;
    let continued = fields.next().is_some_and(|f| f.contains('c'));
    Some(KmsgRecord {
        priority,
        sequence,
        timestamp_us,
        continued,
        message: unescape(message),
    })
}

fn unescape(s: &str) -> String {
    if !s.contains("\\x") {
        return s.to_string();
    }
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && bytes.get(i + 1) == Some(&b'x')
            && let Some(h) = s.get(i + 2..i + 4)
            && let Ok(b) = u8::from_str_radix(h, 16)
        {
            out.push(b);
            i += 4;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_with_continuations_flags_and_escapes() {
        let r = parse(
            "6,339,5140900,-;NET: Registered protocol family 10\n SUBSYSTEM=net\n DEVICE=+net:lo\n",
        )
        .unwrap();
        assert_eq!(
            r,
            KmsgRecord {
                priority: 6,
                sequence: 339,
                timestamp_us: 5140900,
                continued: false,
                message: "NET: Registered protocol family 10".into(),
            }
        );
        assert_eq!(r.level(), 6);
        let r = parse("3,1000,99,c,caller=T1;line one\\x0aline two").unwrap();
        assert!(r.continued);
        assert_eq!(r.message, "line one\nline two");
        assert_eq!(
            parse("12,5,1,-;a;b with semicolons").unwrap().message,
            "a;b with semicolons"
        );
    }

    #[test]
    fn malformed_records_are_none() {
        for bad in ["", "no separator", "x,1,2,-;msg", "6,1;msg", "6,-1,2,-;msg"] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }
}
