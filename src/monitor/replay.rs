//! Trying a policy's monitors on a log before rolling them out
//! (`nodeguard check -f policy.yaml --replay LOG`): the same [`Engine`] the
//! agent runs, fed the log's lines at the log's own times, so counting
//! windows and quiet periods play out as they would have on the node.
//!
//! Pure: lines in, a timeline out. Formats are recognised per line:
//! `journalctl -o json` entries, `/dev/kmsg` records, syslog lines (RFC 3339
//! or `Nov 23 10:00:00` stamps, the kernel's `[ 12.345678]` stripped),
//! `dmesg` lines, and anything else as plain text at the previous time.

use std::collections::BTreeMap;
use std::time::Duration;

use jiff::Timestamp;

use super::engine::{Action, Engine, TaintOutcome};
use crate::policy::monitors::MonitorSpec;

/// One line of the log, as far as its format tells.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogLine {
    /// When it was written (`None`: the format has no time).
    pub time: Option<Timestamp>,
    /// The message, without the syslog or kernel prefix.
    pub message: String,
    /// The whole line as it stands in the file (what file monitors match).
    pub raw: String,
    /// The syslog identifier (`kernel`, `systemd`, `dockerd`), if known.
    pub identifier: Option<String>,
    /// The systemd unit (journal entries only).
    pub unit: Option<String>,
    /// Which format it was read as.
    pub format: &'static str,
}

impl LogLine {
    fn kernel(&self) -> bool {
        self.identifier.as_deref() == Some("kernel")
    }
}

fn boot_relative(secs: u64, micros: u64) -> Option<Timestamp> {
    Timestamp::from_microsecond((secs * 1_000_000 + micros) as i64).ok()
}

/// Strips a leading `[ 123.456789] ` (the kernel's time since boot).
fn strip_kernel_time(s: &str) -> (&str, Option<Timestamp>) {
    let Some(rest) = s.strip_prefix('[') else {
        return (s, None);
    };
    let Some((stamp, after)) = rest.split_once(']') else {
        return (s, None);
    };
    let Some((secs, frac)) = stamp.trim().split_once('.') else {
        return (s, None);
    };
    let (Ok(secs), Ok(frac_n)) = (secs.parse::<u64>(), frac.parse::<u64>()) else {
        return (s, None);
    };
    let micros = frac_n * 10u64.pow(6u32.saturating_sub(frac.len() as u32));
    (after.trim_start(), boot_relative(secs, micros))
}

/// `ident[pid]: message` → (ident, message).
fn split_ident(rest: &str) -> (Option<String>, &str) {
    match rest.split_once(": ") {
        Some((tag, msg)) if !tag.contains(' ') && !tag.is_empty() => {
            let ident = tag.split('[').next().unwrap_or(tag);
            (Some(ident.to_string()), msg)
        }
        _ => (None, rest),
    }
}

const MONTHS: [&str; 12] = [
    "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
];

/// Reads one line; `year` dates BSD syslog stamps, which carry none.
pub fn parse_line(raw: &str, year: i16) -> LogLine {
    let mut line = LogLine {
        time: None,
        message: raw.to_string(),
        raw: raw.to_string(),
        identifier: None,
        unit: None,
        format: "plain",
    };
    let t = raw.trim_start();
    // journalctl -o json
    if t.starts_with('{')
        && let Ok(entry) = serde_json::from_str::<serde_json::Value>(t)
        && let Some(message) = super::sources::journal_message(&entry)
    {
        let field = |k: &str| entry.get(k).and_then(|v| v.as_str()).map(str::to_string);
        line.time = field("__REALTIME_TIMESTAMP")
            .and_then(|us| us.parse::<i64>().ok())
            .and_then(|us| Timestamp::from_microsecond(us).ok());
        line.identifier = if field("_TRANSPORT").as_deref() == Some("kernel") {
            Some("kernel".into())
        } else {
            field("SYSLOG_IDENTIFIER")
        };
        line.unit = field("_SYSTEMD_UNIT");
        line.message = message;
        line.format = "journal";
        return line;
    }
    // /dev/kmsg: "6,1234,5678901,-;message"
    if let Some(rec) = super::kmsg::parse(t)
        && t.split(';')
            .next()
            .is_some_and(|p| p.split(',').count() >= 3)
    {
        line.time = boot_relative(rec.timestamp_us / 1_000_000, rec.timestamp_us % 1_000_000);
        line.message = rec.message;
        line.identifier = Some("kernel".into());
        line.format = "kmsg";
        return line;
    }
    // dmesg: "[  12.345678] message"
    let (after, boot) = strip_kernel_time(t);
    if boot.is_some() {
        line.time = boot;
        line.message = after.to_string();
        line.identifier = Some("kernel".into());
        line.format = "dmesg";
        return line;
    }
    // RFC 3339 syslog: "2026-11-23T10:00:00.123456+00:00 host ident[pid]: message"
    let mut words = t.splitn(3, ' ');
    if let (Some(stamp), Some(_host), Some(rest)) = (words.next(), words.next(), words.next())
        && let Ok(time) = stamp.parse::<Timestamp>()
    {
        let (ident, msg) = split_ident(rest);
        let (msg, _) = strip_kernel_time(msg);
        line.time = Some(time);
        line.identifier = ident;
        line.message = msg.to_string();
        line.format = "syslog";
        return line;
    }
    // BSD syslog: "Nov 23 10:00:00 host ident[pid]: message"
    if let Some(stamp) = t.get(..15).filter(|s| s.is_ascii())
        && let Some(month) = MONTHS.iter().position(|m| stamp.starts_with(m))
        && let Some(after) = t.get(16..)
    {
        let month = month + 1;
        let day = stamp[4..6].trim().parse::<i8>().ok();
        let hms: Vec<i8> = stamp[7..15]
            .split(':')
            .filter_map(|x| x.parse().ok())
            .collect();
        if let (Some(day), [h, m, s]) = (day, hms.as_slice())
            && let Ok(dt) = jiff::civil::date(year, month as i8, day)
                .at(*h, *m, *s, 0)
                .to_zoned(jiff::tz::TimeZone::UTC)
            && let Some((_host, rest)) = after.split_once(' ')
        {
            let (ident, msg) = split_ident(rest);
            let (msg, _) = strip_kernel_time(msg);
            line.time = Some(dt.timestamp());
            line.identifier = ident;
            line.message = msg.to_string();
            line.format = "syslog";
            return line;
        }
    }
    line
}

/// What a monitor reads of a line, or `None` when the line is not its.
fn input_for<'a>(m: &MonitorSpec, line: &'a LogLine) -> Option<&'a str> {
    let src = &m.source;
    if src.file.is_some() {
        return Some(&line.raw);
    }
    if src.kmsg.is_some() {
        // The kernel's lines, and lines that do not say where they are from.
        return (line.kernel() || line.identifier.is_none()).then_some(line.message.as_str());
    }
    if let Some(j) = &src.journald {
        let ident_ok = j
            .identifier
            .as_ref()
            .is_none_or(|want| line.identifier.as_ref() == Some(want));
        // Only journal entries carry a unit; other lines pass a unit filter.
        let unit_ok = j
            .unit
            .as_ref()
            .is_none_or(|want| line.unit.as_ref().is_none_or(|u| u == want));
        return (ident_ok && unit_ok).then_some(line.message.as_str());
    }
    None
}

/// One thing the monitors did, at a line or at a tick between lines.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    /// The log line (1-based) that caused it; `None` for a quiet period
    /// running out between lines.
    pub line: Option<usize>,
    pub time: Timestamp,
    pub monitor: String,
    pub what: String,
    /// A problem (an Event of a rule, a condition turning True, a taint
    /// added), as opposed to a clearing.
    pub fired: bool,
}

/// The whole replay.
#[derive(Clone, Debug, Default)]
pub struct Replay {
    pub steps: Vec<Step>,
    pub lines: usize,
    /// Lines per format.
    pub formats: BTreeMap<&'static str, usize>,
    /// Monitors that cannot be replayed (plugins, systemd units).
    pub skipped: Vec<String>,
    /// Each condition's state after the last line.
    pub end: BTreeMap<String, String>,
}

impl Replay {
    /// Whether any rule fired.
    pub fn fired(&self) -> bool {
        self.steps.iter().any(|s| s.fired)
    }
}

fn describe(a: &Action) -> (String, bool) {
    match a {
        Action::Event { reason, message } => (format!("Event {reason}: {message}"), true),
        Action::Condition {
            type_,
            active,
            reason,
            message,
        } => (
            format!(
                "{type_}={} ({reason}): {message}",
                if *active { "True" } else { "False" }
            ),
            *active,
        ),
        Action::Taint {
            key,
            value,
            effect,
            add,
            ..
        } => {
            let v = if value.is_empty() {
                String::new()
            } else {
                format!("={value}")
            };
            (
                format!(
                    "taint {} {key}{v}:{effect}",
                    if *add { "added" } else { "removed" }
                ),
                *add,
            )
        }
    }
}

/// Runs `monitors` over `lines` (the log's text, one entry per line).
pub fn replay(monitors: &[MonitorSpec], lines: &[String], year: i16) -> Replay {
    let mut out = Replay::default();
    let mut engines: Vec<(&MonitorSpec, Engine)> = Vec::new();
    for m in monitors {
        if m.source.plugin.is_some() || m.source.systemd.is_some() {
            out.skipped.push(m.name.clone());
            continue;
        }
        if let Ok(e) = Engine::new(m, "spec.monitors") {
            engines.push((m, e));
        }
    }
    let mut last: Option<Timestamp> = None;
    let record = |out: &mut Replay,
                  engine: &mut Engine,
                  m: &MonitorSpec,
                  line: Option<usize>,
                  time: Timestamp,
                  actions: Vec<Action>| {
        for a in actions {
            if let Action::Taint { condition, add, .. } = &a {
                let outcome = if *add {
                    TaintOutcome::Added
                } else {
                    TaintOutcome::Removed
                };
                engine.taint_result(condition, outcome);
            }
            // The engine restates a condition's value at times; show changes.
            if let Action::Condition { type_, active, .. } = &a {
                let now = if *active { "True" } else { "False" };
                if out.end.get(type_).map(String::as_str) == Some(now) {
                    continue;
                }
                out.end.insert(type_.clone(), now.to_string());
            }
            let (what, mut fired) = describe(&a);
            // A condition's clearing Event carries its no-problem reason.
            if let Action::Event { reason, .. } = &a
                && m.conditions.iter().any(|c| &c.reason == reason)
            {
                fired = false;
            }
            out.steps.push(Step {
                line,
                time,
                monitor: m.name.clone(),
                what,
                fired,
            });
        }
    };
    // Every condition starts at its no-problem state.
    for (m, _) in &engines {
        for c in &m.conditions {
            out.end.insert(c.type_.clone(), "False".into());
        }
    }
    for (i, raw) in lines.iter().enumerate() {
        let line = parse_line(raw, year);
        out.lines += 1;
        *out.formats.entry(line.format).or_default() += 1;
        let time = line.time.or(last).unwrap_or(Timestamp::UNIX_EPOCH);
        // Quiet periods that ran out before this line, second by second
        // (minute by minute across gaps of more than a day).
        if let Some(prev) = last
            && time > prev
        {
            let gap = time.duration_since(prev).unsigned_abs();
            let step = if gap > Duration::from_secs(86_400) {
                Duration::from_secs(60)
            } else {
                Duration::from_secs(1)
            };
            let mut t = prev;
            while let Ok(next) = t.checked_add(step) {
                if next >= time {
                    break;
                }
                t = next;
                for (m, e) in engines.iter_mut() {
                    let actions = e.on_tick(t);
                    if !actions.is_empty() {
                        record(&mut out, e, m, None, t, actions);
                    }
                }
            }
        }
        last = Some(time.max(last.unwrap_or(time)));
        for (m, e) in engines.iter_mut() {
            let Some(input) = input_for(m, &line) else {
                continue;
            };
            let mut actions = e.on_tick(time);
            actions.extend(e.on_line(input, time));
            if !actions.is_empty() {
                record(&mut out, e, m, Some(i + 1), time, actions);
            }
        }
    }
    out
}

/// The replay as `nodeguard check --replay` prints it.
pub fn render(r: &Replay) -> String {
    let mut s = String::new();
    for step in &r.steps {
        let at = match step.line {
            Some(n) => format!("line {n}"),
            None => "(quiet)".to_string(),
        };
        s.push_str(&format!(
            "{at:>10}  {}  {}: {}\n",
            step.time, step.monitor, step.what
        ));
    }
    let formats: Vec<String> = r.formats.iter().map(|(f, n)| format!("{f} {n}")).collect();
    let fired = r.steps.iter().filter(|s| s.fired).count();
    s.push_str(&format!(
        "\n{} lines ({}); {} problem step(s), {} clearing(s)\n",
        r.lines,
        formats.join(", "),
        fired,
        r.steps.len() - fired
    ));
    let end: Vec<String> = r.end.iter().map(|(t, v)| format!("{t}={v}")).collect();
    if !end.is_empty() {
        s.push_str(&format!("after the last line: {}\n", end.join(", ")));
    }
    if !r.skipped.is_empty() {
        s.push_str(&format!(
            "not replayed (they check the node, not a log): {}\n",
            r.skipped.join(", ")
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_are_recognised_line_by_line() {
        let j = parse_line(
            r#"{"__REALTIME_TIMESTAMP":"1763892000000000","MESSAGE":"Started kubelet.service","SYSLOG_IDENTIFIER":"systemd","_SYSTEMD_UNIT":"init.scope"}"#,
            2026,
        );
        assert_eq!(
            (j.format, j.identifier.as_deref()),
            ("journal", Some("systemd"))
        );
        assert_eq!(j.time.unwrap().as_second(), 1_763_892_000);
        let k = parse_line("6,1234,5000000,-;Out of memory: Killed process 42", 2026);
        assert_eq!(
            (k.format, k.message.as_str()),
            ("kmsg", "Out of memory: Killed process 42")
        );
        assert_eq!(k.time.unwrap().as_second(), 5);
        let d = parse_line("[   12.500000] EXT4-fs error (device sda1)", 2026);
        assert_eq!(
            (d.format, d.message.as_str()),
            ("dmesg", "EXT4-fs error (device sda1)")
        );
        assert_eq!(d.time.unwrap().as_millisecond(), 12_500);
        let r = parse_line(
            "2026-11-23T10:00:00.5+00:00 node-a kernel: [  3.1] task docker:12 blocked for more than 120 seconds.",
            2026,
        );
        assert_eq!(r.format, "syslog");
        assert_eq!(r.identifier.as_deref(), Some("kernel"));
        assert_eq!(
            r.message,
            "task docker:12 blocked for more than 120 seconds."
        );
        let b = parse_line(
            "Nov 23 10:00:07 node-a dockerd[812]: level=error msg=\"x\"",
            2026,
        );
        assert_eq!(b.format, "syslog");
        assert_eq!(b.identifier.as_deref(), Some("dockerd"));
        assert_eq!(b.time.unwrap().to_string(), "2026-11-23T10:00:07Z");
        let p = parse_line("app crashed: disk full", 2026);
        assert_eq!((p.format, p.time), ("plain", None));
        // Hostile lines are plain text, never a panic.
        for odd in [
            "Ñov 23 10:00:00 x y: z",
            "Nov",
            "[",
            "[1.x] a",
            "{\"MESSAGE\": 5}",
            "1,2,x;y",
            "",
        ] {
            assert_eq!(parse_line(odd, 2026).format, "plain", "{odd:?}");
        }
    }
}
