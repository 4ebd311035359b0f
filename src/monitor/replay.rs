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
use crate::policy::monitors::{JournaldSource, MonitorSpec, Source};

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
    /// The systemd units a journal entry is about (`_SYSTEMD_UNIT`, and
    /// `UNIT`/`OBJECT_SYSTEMD_UNIT` as `journalctl --unit` matches them);
    /// `None` for lines of other formats, which say nothing of units.
    pub units: Option<Vec<String>>,
    /// A `/dev/kmsg` dictionary continuation (` SUBSYSTEM=…`): the agent
    /// skips these.
    pub continuation: bool,
    /// Which format it was read as.
    pub format: &'static str,
}

impl LogLine {
    fn kernel(&self) -> bool {
        self.identifier.as_deref() == Some("kernel")
    }
}

fn boot_relative(secs: u64, micros: u64) -> Option<Timestamp> {
    let us = secs.checked_mul(1_000_000)?.checked_add(micros)?;
    Timestamp::from_microsecond(i64::try_from(us).ok()?).ok()
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
    // Microseconds: at most six digits of the fraction count.
    let frac6: String = frac.chars().take(6).collect();
    let (Ok(secs), Ok(frac_n)) = (secs.parse::<u64>(), frac6.parse::<u64>()) else {
        return (s, None);
    };
    if !frac.bytes().all(|b| b.is_ascii_digit()) {
        return (s, None);
    }
    let micros = frac_n * 10u64.pow(6 - frac6.len() as u32);
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
        units: None,
        continuation: raw.starts_with(' ') || raw.starts_with('\t'),
        format: "plain",
    };
    let t = raw.trim_start();
    // journalctl -o json
    if t.starts_with('{')
        && let Ok(entry) = serde_json::from_str::<serde_json::Value>(t)
        && let Some(message) = super::sources::lines::journal_message(&entry)
    {
        let field = |k: &str| entry.get(k).and_then(|v| v.as_str()).map(str::to_string);
        line.time = field("__REALTIME_TIMESTAMP")
            .and_then(|us| us.parse::<i64>().ok())
            .and_then(|us| Timestamp::from_microsecond(us).ok());
        // An entry's origin is known: the kernel's by its transport, and
        // anything else is not the kernel's even without an identifier.
        line.identifier = if field("_TRANSPORT").as_deref() == Some("kernel") {
            Some("kernel".into())
        } else {
            Some(field("SYSLOG_IDENTIFIER").unwrap_or_default())
        };
        let pid1 = field("_PID").as_deref() == Some("1");
        line.units = Some(
            [
                field("_SYSTEMD_UNIT"),
                field("UNIT").filter(|_| pid1),
                field("OBJECT_SYSTEMD_UNIT"),
                field("COREDUMP_UNIT"),
            ]
            .into_iter()
            .flatten()
            .collect(),
        );
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
        && let Some(after) = t.get(15..)
    {
        let after = after.strip_prefix(' ').unwrap_or(after);
        let month = month + 1;
        let day = stamp[4..6].trim().parse::<i8>().ok();
        let hms: Vec<i8> = stamp[7..15]
            .split(':')
            .filter_map(|x| x.parse().ok())
            .collect();
        // `journalctl -o short-precise` adds `.123456` to the second.
        let after = match after.strip_prefix('.') {
            Some(frac) => frac
                .trim_start_matches(|c: char| c.is_ascii_digit())
                .trim_start(),
            None => after,
        };
        if let (Some(day), [h, m, s]) = (day, hms.as_slice())
            && let Ok(date) = jiff::civil::Date::new(year, month as i8, day)
            && let Ok(time) = jiff::civil::Time::new(*h, *m, *s, 0)
            && let Ok(dt) = date.to_datetime(time).to_zoned(jiff::tz::TimeZone::UTC)
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
    match m.source.one()? {
        Source::File(_) => Some(&line.raw),
        // The kernel's lines, and lines that do not say where they are from
        // (never a record's dictionary continuation, which the agent skips).
        Source::Kmsg(_) => (!line.continuation && (line.kernel() || line.identifier.is_none()))
            .then_some(line.message.as_str()),
        Source::Journald(j) => journal_input(j, line),
        Source::Plugin(_) | Source::Systemd(_) => None,
    }
}

/// What a journald monitor reads of a line: its message, when the line
/// passes the monitor's identifier and unit filters.
fn journal_input<'a>(j: &JournaldSource, line: &'a LogLine) -> Option<&'a str> {
    let ident_ok = j
        .identifier
        .as_ref()
        .is_none_or(|want| line.identifier.as_ref() == Some(want));
    // As `journalctl --unit`: a bare name is a service; only journal
    // entries say which unit they are about, so other lines never pass
    // a unit filter.
    let unit_ok = j.unit.as_ref().is_none_or(|want| {
        let want = if want.contains('.') {
            want.clone()
        } else {
            format!("{want}.service")
        };
        line.units.as_ref().is_some_and(|us| us.contains(&want))
    });
    (ident_ok && unit_ok).then_some(line.message.as_str())
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
    /// Lines older than the line before them (taken at that one's time).
    pub out_of_order: usize,
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
        Action::Unknown {
            type_,
            reason,
            message,
        } => (format!("{type_}=Unknown ({reason}): {message}"), false),
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

/// At most this many quiet-period ticks between two lines: across longer
/// gaps ticks are spaced wider, so a clearing shows up to gap/100,000 late.
const MAX_TICKS_PER_GAP: u32 = 100_000;

/// Runs `monitors` over `lines` (the log's text, one entry per line).
pub fn replay(
    monitors: &[MonitorSpec],
    lines: impl IntoIterator<Item = String>,
    year: i16,
) -> Replay {
    replay_compiled(Compiled::new(monitors), lines, year)
}

/// The log monitors of a policy compiled for replays; clone it to replay
/// many logs without compiling their patterns again.
#[derive(Clone, Debug)]
pub struct Compiled<'a> {
    engines: Vec<(&'a MonitorSpec, Engine)>,
    /// Monitors that cannot be replayed (plugins, systemd units).
    skipped: Vec<String>,
}

impl<'a> Compiled<'a> {
    pub fn new(monitors: &'a [MonitorSpec]) -> Self {
        let mut c = Compiled {
            engines: Vec::new(),
            skipped: Vec::new(),
        };
        for m in monitors {
            if !m.source.one().is_some_and(Source::lines) {
                c.skipped.push(m.name.clone());
                continue;
            }
            if let Ok(e) = Engine::new(m, "spec.monitors") {
                c.engines.push((m, e));
            }
        }
        c
    }
}

/// [`replay`] with monitors compiled before.
pub fn replay_compiled(
    compiled: Compiled<'_>,
    lines: impl IntoIterator<Item = String>,
    year: i16,
) -> Replay {
    let mut year = year;
    let Compiled {
        mut engines,
        skipped,
    } = compiled;
    let mut out = Replay {
        skipped,
        ..Replay::default()
    };
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
            if let Action::Condition {
                type_,
                active,
                reason,
                ..
            } = &a
            {
                let now = format!("{} ({reason})", if *active { "True" } else { "False" });
                if out.end.get(type_) == Some(&now) {
                    continue;
                }
                out.end.insert(type_.clone(), now);
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
            out.end
                .insert(c.type_.clone(), format!("False ({})", c.reason));
        }
    }
    for (i, raw) in lines.into_iter().enumerate() {
        let mut line = parse_line(&raw, year);
        // Syslog stamps carry no year: December to January is a new one.
        if line.format == "syslog"
            && let (Some(t), Some(prev)) = (line.time, last)
            && prev.duration_since(t).unsigned_abs() > Duration::from_secs(180 * 86_400)
            && t < prev
            && year < 9999
        {
            let next = parse_line(&raw, year + 1);
            if next.time.is_some_and(|n| n >= prev) {
                year += 1;
                line = next;
            }
        }
        out.lines += 1;
        *out.formats.entry(line.format).or_default() += 1;
        // The engine's time never goes back (the agent's clock does not):
        // a line older than the one before it is taken at that one's time.
        let time = match (line.time, last) {
            (Some(t), Some(prev)) if t < prev => {
                out.out_of_order += 1;
                prev
            }
            (Some(t), _) => t,
            (None, Some(prev)) => prev,
            // Untimed lines before the first timed one: no clock yet.
            (None, None) => Timestamp::UNIX_EPOCH,
        };
        // Quiet periods that ran out before this line.
        if let Some(prev) = last
            && time > prev
        {
            let gap = time.duration_since(prev).unsigned_abs();
            let step = (gap / MAX_TICKS_PER_GAP).max(Duration::from_secs(1));
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
        if line.time.is_some() || last.is_some() {
            last = Some(time);
        }
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
    if r.out_of_order > 0 {
        s.push_str(&format!(
            "{} line(s) older than the line before them were taken at that line's time\n",
            r.out_of_order
        ));
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
        let sp = parse_line(
            "Nov 23 10:00:07.123456 node-a kubelet[9]: E1123 failed",
            2026,
        );
        assert_eq!(
            (sp.format, sp.identifier.as_deref()),
            ("syslog", Some("kubelet"))
        );
        assert_eq!(sp.message, "E1123 failed");
        // Hostile lines are plain text, never a panic.
        for odd in [
            "Ñov 23 10:00:00 x y: z",
            "Nov 31 10:00:00 host kernel: no such day",
            "Feb 29 10:00:00 host kernel: not a leap year",
            "Nov 23 99:99:99 host kernel: no such time",
            "Nov 00 10:00:00 host kernel: day zero",
            "[99999999999999999999.1] overflow",
            "[18446744073709.551615] overflow",
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

    fn monitor(v: serde_json::Value) -> MonitorSpec {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn a_unit_filter_matches_as_journalctl_and_only_journal_entries() {
        let m = monitor(serde_json::json!({
            "name": "kubelet", "source": {"journald": {"unit": "kubelet"}},
            "conditions": [{"type": "KubeletBroken", "reason": "KubeletIsFine", "message": "fine"}],
            "rules": [{"type": "permanent", "condition": "KubeletBroken", "reason": "KubeletFailed", "pattern": "failed"}]}));
        let pid1 = r#"{"__REALTIME_TIMESTAMP":"1763892000000000","_PID":"1","UNIT":"kubelet.service","_SYSTEMD_UNIT":"init.scope","SYSLOG_IDENTIFIER":"systemd","MESSAGE":"kubelet.service: Main process exited, code=exited, status=1/FAILURE; failed"}"#;
        let other = r#"{"__REALTIME_TIMESTAMP":"1763892000000000","_SYSTEMD_UNIT":"sshd.service","MESSAGE":"failed password"}"#;
        let syslog = "Nov 23 10:00:00 node-a kubelet[9]: failed to sync";
        let r = replay(
            std::slice::from_ref(&m),
            vec![other.to_string(), syslog.to_string()],
            2026,
        );
        assert!(!r.fired(), "{:?}", r.steps);
        let r = replay(&[m], vec![pid1.to_string()], 2026);
        assert!(
            r.fired(),
            "PID 1's message about the unit matches, as journalctl --unit"
        );
    }

    #[test]
    fn time_never_goes_back_years_roll_over_and_gaps_are_bounded() {
        let m = monitor(serde_json::json!({
            "name": "k", "source": {"kmsg": {}},
            "conditions": [{"type": "Hung", "reason": "NotHung", "message": "fine", "clearAfterSeconds": 60}],
            "rules": [{"type": "permanent", "condition": "Hung", "reason": "TaskHung", "pattern": "blocked"}]}));
        // An older line after a newer one does not clear the condition.
        let r = replay(
            std::slice::from_ref(&m),
            vec![
                "2026-11-23T10:00:00Z h kernel: task x blocked".to_string(),
                "2026-11-23T09:00:00Z h kernel: older".to_string(),
            ],
            2026,
        );
        assert_eq!(r.out_of_order, 1);
        assert_eq!(r.end["Hung"], "True (TaskHung)", "{:?}", r.steps);
        assert!(render(&r).contains("1 line(s) older than the line before them"));
        // December to January in a syslog file: the next year, not 11 months back.
        let r = replay(
            std::slice::from_ref(&m),
            vec![
                "Dec 31 23:59:59 h kernel: task x blocked".to_string(),
                "Jan  1 00:00:30 h kernel: later".to_string(),
                "Jan  1 00:01:30 h kernel: quiet for 91 s".to_string(),
            ],
            2026,
        );
        assert_eq!(r.out_of_order, 0);
        assert_eq!(r.end["Hung"], "False (NotHung)", "{:?}", r.steps);
        let cleared = r
            .steps
            .iter()
            .find(|s| s.what.starts_with("Hung=False"))
            .unwrap();
        assert_eq!(cleared.time.to_string(), "2027-01-01T00:00:59Z");
        // A line dated far ahead does not make the replay run for hours.
        let started = std::time::Instant::now();
        let r = replay(
            &[m],
            vec![
                "2026-11-23T10:00:00Z h kernel: task x blocked".to_string(),
                r#"{"__REALTIME_TIMESTAMP":"221845392000000000","_TRANSPORT":"kernel","MESSAGE":"far ahead"}"#.to_string(),
            ],
            2026,
        );
        assert!(
            started.elapsed() < std::time::Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(r.end["Hung"], "False (NotHung)");
    }
}
