//! `nodeguard import-npd`: node-problem-detector monitor configs (JSON) to
//! `spec.monitors`, with a list of what could not be expressed.
//!
//! system-log-monitor configs (`kmsg`, `journald`, `filelog`) become log
//! monitors with the same conditions and rules, matched as NPD matches them
//! (`npdMatching`: its buffer of lines, its `\z`, its trimming, filelog's
//! message pattern and skip list); custom-plugin-monitor
//! configs become plugin monitors; rules that run NPD's `log-counter`
//! become native counting rules on a journald monitor.
//!
//! How imported conditions clear: NPD keeps a log monitor's permanent
//! condition until NPD restarts (its status starts clean at each start).
//! nodeguard keeps state across its own restarts but resets such a
//! condition (one with no `clearAfterSeconds` and no `clearPattern`, and
//! every kmsg condition) at each boot, which the notes say along with how to
//! clear it sooner. A log-counter condition clears after its lookback window
//! without a match (`clearAfterSeconds`), as NPD's log-counter reports OK
//! once the window holds fewer matches. Plugin conditions clear when their
//! check passes again.

use serde_json::Value;

use super::monitors::{
    ConditionSpec, CountSpec, FileSource, JournaldSource, KmsgSource, LogSource, MonitorSpec,
    NpdMatching, PluginSource, ProblemKind, RepairSignal, RepairSpec, RuleSpec, SystemdUnitSource,
};

/// NPD's `bufferSize` when a config sets none.
const NPD_BUFFER_SIZE: u32 = 10;
/// The most lines nodeguard holds for NPD matching.
const MAX_BUFFER_LINES: u32 = 100;

/// The result of converting one NPD config.
#[derive(Debug, Default)]
pub struct Imported {
    pub monitors: Vec<MonitorSpec>,
    /// Everything that was dropped or changed, one sentence each.
    pub notes: Vec<String>,
}

/// Seconds in a Go duration ("30s", "5m", "1h30m", "500ms" → 1).
pub fn go_duration_seconds(s: &str) -> Option<u32> {
    let mut total = 0f64;
    let mut num = String::new();
    let mut chars = s.trim().chars().peekable();
    if s.trim().is_empty() {
        return None;
    }
    while let Some(c) = chars.next() {
        if c.is_ascii_digit() || c == '.' {
            num.push(c);
            continue;
        }
        let mut unit = c.to_string();
        while let Some(n) = chars.peek() {
            if n.is_ascii_alphabetic() {
                unit.push(*n);
                chars.next();
            } else {
                break;
            }
        }
        let v: f64 = num.parse().ok()?;
        num.clear();
        total += v * match unit.as_str() {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 0.001,
            "us" | "µs" => 0.000_001,
            "ns" => 0.000_000_001,
            _ => return None,
        };
    }
    if !num.is_empty() {
        return None;
    }
    Some(total.ceil().max(1.0) as u32)
}

/// `base-suffix` as a DNS label, cutting the base rather than the suffix
/// (which tells imports apart: a cut suffix once made the renaming loop
/// forever when the base was 63 characters long already).
fn label_with(base: &str, suffix: &str) -> String {
    let suffix = label(suffix);
    let mut base = label(base);
    base.truncate(62usize.saturating_sub(suffix.len()));
    match base.trim_end_matches('-') {
        "" => suffix,
        b => format!("{b}-{suffix}"),
    }
}

/// At most 40 characters of a label, so a counter after it fits in 63.
fn short(s: &str) -> String {
    let mut l = label(s);
    l.truncate(40);
    l.trim_end_matches('-').to_string()
}

/// A DNS label from an NPD `source` name.
fn label(s: &str) -> String {
    let l: String = s
        .to_ascii_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    let l = l.trim_matches('-').to_string();
    let mut l = if l.is_empty() {
        "imported".to_string()
    } else {
        l
    };
    l.truncate(63);
    l.trim_end_matches('-').to_string()
}

fn conditions(v: &Value) -> Vec<ConditionSpec> {
    v.get("conditions")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|c| {
            Some(ConditionSpec {
                type_: c.get("type")?.as_str()?.to_string(),
                reason: c.get("reason")?.as_str()?.to_string(),
                message: c
                    .get("message")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string(),
                clear_after_seconds: None,
                clear_pattern: None,
                taint: None,
            })
        })
        .collect()
}

fn kind(rule: &Value) -> ProblemKind {
    if rule.get("type").and_then(Value::as_str) == Some("permanent") {
        ProblemKind::Permanent
    } else {
        ProblemKind::Temporary
    }
}

/// Converts one NPD monitor config; `origin` names it in the notes. Its
/// monitors' Events name the config's `source` as their source component,
/// as NPD's did.
pub fn import(origin: &str, config: &Value) -> Imported {
    let mut out = import_config(origin, config);
    let source = config
        .get("source")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty() && s.len() <= 128);
    for m in &mut out.monitors {
        m.event_source = source.map(str::to_string);
    }
    out
}

fn import_config(origin: &str, config: &Value) -> Imported {
    let mut out = Imported::default();
    let plugin = config.get("plugin").and_then(Value::as_str).unwrap_or("");
    let name = label(
        config
            .get("source")
            .and_then(Value::as_str)
            .unwrap_or(origin),
    );
    let log_path = config.get("logPath").and_then(Value::as_str);
    if let Some(p) = log_path.filter(|p| windows_path(p)) {
        out.notes.push(format!(
            "{origin}: a Windows config (logPath {p:?}): nodeguard runs on Linux nodes; nothing imported"
        ));
        return out;
    }
    if config.get("lookback").is_some() {
        out.notes.push(format!(
            "{origin}: lookback has no equivalent: NPD also reports what was logged in the lookback before it starts; nodeguard starts a new monitor at its source's end, then resumes from its saved position (a new boot: from the boot's start)"
        ));
    }
    let source = match plugin {
        "kmsg" => LogSource {
            kmsg: Some(KmsgSource {
                path: log_path.unwrap_or("/dev/kmsg").to_string(),
            }),
            file: None,
            journald: None,
            plugin: None,
            systemd: None,
        },
        "journald" => LogSource {
            kmsg: None,
            file: None,
            journald: Some(JournaldSource {
                directory: log_path.map(str::to_string),
                unit: None,
                identifier: config
                    .pointer("/pluginConfig/source")
                    .and_then(Value::as_str)
                    .map(str::to_string),
            }),
            plugin: None,
            systemd: None,
        },
        "filelog" => {
            if config.pointer("/pluginConfig/timestamp").is_some() {
                out.notes.push(format!(
                    "{origin}: pluginConfig.timestamp: nodeguard times a line when it reads it; NPD skips a line whose time it cannot parse, nodeguard matches it"
                ));
            }
            LogSource {
                kmsg: None,
                file: Some(FileSource {
                    path: log_path.unwrap_or_default().to_string(),
                }),
                journald: None,
                plugin: None,
                systemd: None,
            }
        }
        "custom" => return import_custom(origin, &name, config, out),
        "" if ["cpu", "disk", "memory", "host", "net", "osFeature"]
            .iter()
            .any(|k| config.get(k).is_some()) =>
        {
            out.notes.push(format!(
                "{origin}: a system-stats-monitor config (node metrics for NPD's exporters, no conditions or Events): nodeguard does not export NPD's node metrics; nothing imported"
            ));
            return out;
        }
        other => {
            out.notes.push(format!(
                "{origin}: plugin {other:?} is not supported; nothing imported"
            ));
            return out;
        }
    };
    for (i, r) in config
        .get("rules")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
    {
        for field in ["reason", "pattern"] {
            if r.get(field).and_then(Value::as_str).is_none() {
                out.notes.push(format!(
                    "{origin}: rules[{i}] has no {field}; skipped (NPD refuses such a config)"
                ));
            }
        }
    }
    let rules: Vec<RuleSpec> = config
        .get("rules")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|r| {
            Some(RuleSpec {
                kind: kind(r),
                condition: r
                    .get("condition")
                    .and_then(Value::as_str)
                    .map(str::to_string),
                reason: r.get("reason")?.as_str()?.to_string(),
                pattern: r.get("pattern")?.as_str()?.to_string(),
                command: Vec::new(),
                timeout_seconds: None,
                message: None,
                count: None,
            })
        })
        .collect();
    for (i, r) in rules.iter().enumerate() {
        if top_level_alternation(&r.pattern) {
            out.notes.push(format!(
                "{origin}: rules[{i}] pattern {:?} has a top-level `|`: NPD appends `\\z` to the last alternative only, so the others match anywhere in its last {} lines; nodeguard matches it the same way",
                r.pattern,
                config.get("bufferSize").and_then(Value::as_u64).unwrap_or(u64::from(NPD_BUFFER_SIZE))
            ));
        }
    }
    let set: Vec<&str> = rules
        .iter()
        .filter(|r| r.kind == ProblemKind::Permanent)
        .filter_map(|r| r.condition.as_deref())
        .collect();
    let conditions = conditions(config);
    let lasting: Vec<&str> = conditions
        .iter()
        .map(|c| c.type_.as_str())
        .filter(|t| set.contains(t))
        .collect();
    if !lasting.is_empty() {
        out.notes.push(format!(
            "{origin}: {} stay True until NPD restarts; nodeguard keeps them across its own restarts and resets them at the next boot: add clearAfterSeconds or clearPattern to clear them sooner",
            lasting.join(", ")
        ));
    }
    let buffer = config
        .get("bufferSize")
        .and_then(Value::as_u64)
        .filter(|n| *n > 0)
        .map_or(NPD_BUFFER_SIZE, |n| n.min(u64::from(u32::MAX)) as u32);
    if buffer > MAX_BUFFER_LINES {
        out.notes.push(format!(
            "{origin}: bufferSize {buffer} is more than nodeguard holds; it matches the last {MAX_BUFFER_LINES} lines"
        ));
    }
    let mut message_pattern = config
        .pointer("/pluginConfig/message")
        .and_then(Value::as_str)
        .filter(|_| plugin == "filelog")
        .map(str::to_string);
    if let Some(p) = &message_pattern
        && let Err(e) = super::goregex::translate(p)
    {
        out.notes.push(format!(
            "{origin}: pluginConfig.message: {e}; rules match the whole line"
        ));
        message_pattern = None;
    }
    let skip: Vec<String> = config
        .get("skipList")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str().map(str::to_string))
        .filter(|_| plugin == "filelog")
        .collect();
    out.monitors.push(MonitorSpec {
        // NPD's matching: its buffer, its `\z`, its trimming and message.
        event_source: None,
        npd_matching: Some(NpdMatching {
            buffer_lines: buffer.min(MAX_BUFFER_LINES),
            message_pattern,
            skip,
            message_suffix: config
                .get("patternGeneratedMessageSuffix")
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map(str::to_string),
        }),
        name,
        source,
        conditions,
        rules,
    });
    out
}

/// Joins the monitors imported from several configs (`(origin, monitors)`
/// in order) into one policy's list. NPD runs each config on its own and
/// lets several write one condition; a policy needs unique monitor names
/// and one owner per condition. So plugin monitors of the same `source`
/// and the same plugin settings (NPD's health checkers: kubelet, docker,
/// containerd, all "health-checker") become one monitor, whose shared
/// condition is True while any of its checks fails; any other repeated
/// name gets its config file's name. The notes say what was joined.
pub fn combine(imported: Vec<(String, Vec<MonitorSpec>)>) -> (Vec<MonitorSpec>, Vec<String>) {
    let mut out: Vec<MonitorSpec> = Vec::new();
    let mut notes = Vec::new();
    for (origin, monitors) in imported {
        for mut m in monitors {
            if let Some(into) = out
                .iter_mut()
                .find(|o| o.name == m.name && same_plugin(&o.source, &m.source))
            {
                for c in m.conditions {
                    if into.conditions.iter().any(|x| x.type_ == c.type_) {
                        notes.push(format!(
                            "{origin}: condition {} is also set by another {} check: nodeguard keeps it True while any of them fails (NPD lets the last one to report win)",
                            c.type_, into.name
                        ));
                    } else {
                        into.conditions.push(c);
                    }
                }
                into.rules.extend(m.rules);
                // NPD runs each config's checks with its own concurrency.
                if let (Some(a), Some(b)) = (into.source.plugin.as_mut(), m.source.plugin.as_ref())
                {
                    a.concurrency = (a.concurrency + b.concurrency).min(64);
                }
                notes.push(format!(
                    "{origin}: its checks join the monitor {:?} of the same source",
                    into.name
                ));
                continue;
            }
            for c in &m.conditions {
                if let Some(owner) = out
                    .iter()
                    .find(|o| o.conditions.iter().any(|x| x.type_ == c.type_))
                {
                    notes.push(format!(
                        "{origin}: condition {} is also owned by monitor {:?}: NPD lets both write it, a policy needs one owner; import these configs into separate policies for separate nodes, or leave one out",
                        c.type_, owner.name
                    ));
                }
            }
            if out.iter().any(|o| o.name == m.name) {
                let stem = std::path::Path::new(&origin)
                    .file_stem()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default();
                let mut name = label_with(&m.name, &stem);
                let mut n = 2;
                while out.iter().any(|o| o.name == name) {
                    name = label_with(&m.name, &format!("{}-{n}", short(&stem)));
                    n += 1;
                }
                notes.push(format!(
                    "{origin}: monitor {:?} exists already; this one is {name:?}",
                    m.name
                ));
                m.name = name;
            }
            out.push(m);
        }
    }
    (out, notes)
}

/// Whether a pattern may match beyond the newest line of a buffer: an
/// anchor (`^`, `(?m)`), a newline or what matches one (`\\n`, `\\s`, a
/// negated class), or a top-level `|` (NPD anchors only its last
/// alternative).
fn may_reach_back(p: &str) -> bool {
    p.starts_with('^')
        || p.contains("(?m")
        || p.contains("(?s")
        || p.contains("\\n")
        || p.contains("\\s")
        || p.contains("[^")
        || top_level_alternation(p)
}

/// Whether `p` has a `|` outside every group and class.
fn top_level_alternation(p: &str) -> bool {
    let mut depth = 0i32;
    let mut class = false;
    let mut chars = p.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                chars.next();
            }
            '[' if !class => class = true,
            ']' if class => class = false,
            '(' if !class => depth += 1,
            ')' if !class => depth -= 1,
            '|' if !class && depth == 0 => return true,
            _ => {}
        }
    }
    false
}

/// Plugin sources that differ at most in their concurrency (which joining
/// adds up).
fn same_plugin(a: &LogSource, b: &LogSource) -> bool {
    match (&a.plugin, &b.plugin) {
        (Some(x), Some(y)) => {
            (x.interval_seconds, x.timeout_seconds, x.max_output_length)
                == (y.interval_seconds, y.timeout_seconds, y.max_output_length)
        }
        _ => false,
    }
}

/// `--flag=value` from a log-counter argument list.
/// A flag's value as Go's pflag reads it: `--name=value` or `--name value`,
/// the last one winning.
fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    let (with_value, bare) = (format!("--{name}="), format!("--{name}"));
    let mut found = None;
    let mut args = args.iter();
    while let Some(a) = args.next() {
        if let Some(v) = a.strip_prefix(&with_value) {
            found = Some(v);
        } else if *a == bare {
            found = args.next().map(String::as_str).or(found);
        }
    }
    found
}

fn import_custom(origin: &str, name: &str, config: &Value, mut out: Imported) -> Imported {
    let pc = config.get("pluginConfig");
    let get_s = |k: &str| {
        pc.and_then(|p| p.get(k))
            .and_then(Value::as_str)
            .and_then(go_duration_seconds)
    };
    let get_n = |k: &str| {
        pc.and_then(|p| p.get(k))
            .and_then(Value::as_u64)
            .map(|n| n as u32)
    };
    let plugin = PluginSource {
        interval_seconds: get_s("invoke_interval").unwrap_or(30),
        timeout_seconds: get_s("timeout").unwrap_or(5),
        concurrency: get_n("concurrency").unwrap_or(3).clamp(1, 64),
        max_output_length: get_n("max_output_length").unwrap_or(80).clamp(1, 4096),
        npd_results: true,
    };
    let conds = conditions(config);
    let rules = config
        .get("rules")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    if let Some(p) = rules
        .iter()
        .filter_map(|r| r.get("path").and_then(Value::as_str))
        .find(|p| windows_path(p))
    {
        out.notes.push(format!(
            "{origin}: a Windows config (path {p:?}): nodeguard runs on Linux nodes; nothing imported"
        ));
        return out;
    }
    if pc.and_then(|p| p.get("skip_initial_status")) == Some(&Value::Bool(true)) {
        out.notes.push(format!(
            "{origin}: skip_initial_status: nodeguard writes each condition's healthy state when the monitor starts (or keeps the state it saved)"
        ));
    }
    let mut plugin_rules = Vec::new();
    let mut counters: Vec<MonitorSpec> = Vec::new();
    let mut services: Vec<MonitorSpec> = Vec::new();
    for (i, r) in config
        .get("rules")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
    {
        let Some(reason) = r.get("reason").and_then(Value::as_str) else {
            continue;
        };
        let path = r.get("path").and_then(Value::as_str).unwrap_or_default();
        let args: Vec<String> = r
            .get("args")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|a| a.as_str().map(str::to_string))
            .collect();
        if path.ends_with("log-counter") {
            // NPD's log-counter: N matches of a journal pattern in a window.
            let Some(pattern) = flag(&args, "pattern") else {
                out.notes.push(format!(
                    "{origin}: rules[{i}] runs log-counter without --pattern; skipped"
                ));
                continue;
            };
            // log-counter's default --count is 1.
            let count = flag(&args, "count").unwrap_or("1");
            let window = flag(&args, "lookback")
                .and_then(go_duration_seconds)
                .unwrap_or(1200);
            let Ok(threshold) = count.parse::<u32>() else {
                out.notes.push(format!(
                    "{origin}: rules[{i}] log-counter --count={count} is not a whole number; skipped"
                ));
                continue;
            };
            if flag(&args, "delay").is_some() {
                out.notes.push(format!(
                    "{origin}: rules[{i}] log-counter --delay (ignore what the first minutes after boot log) has no equivalent: nodeguard counts a new boot's lines from the boot's start"
                ));
            }
            let revert = flag(&args, "revert-pattern").map(str::to_string);
            for (p, which) in [
                (Some(pattern), "--pattern"),
                (revert.as_deref(), "--revert-pattern"),
            ] {
                if let Some(p) = p
                    && may_reach_back(p)
                {
                    out.notes.push(format!(
                        "{origin}: rules[{i}] log-counter {which} {p:?} is anchored or spans lines: log-counter matches it against its last 1000 journal lines, nodeguard against the newest one"
                    ));
                }
            }
            for a in &args {
                let name = a.trim_start_matches('-').split('=').next().unwrap_or("");
                if ![
                    "journald-source",
                    "log-path",
                    "lookback",
                    "delay",
                    "count",
                    "pattern",
                    "revert-pattern",
                    "v",
                    "logtostderr",
                ]
                .contains(&name)
                {
                    out.notes.push(format!(
                        "{origin}: rules[{i}] log-counter argument {a:?} is not one of log-counter's flags; ignored"
                    ));
                }
            }
            let condition = r
                .get("condition")
                .and_then(Value::as_str)
                .map(str::to_string);
            let mon_name = label(&format!("{name}-{}", reason));
            counters.push(MonitorSpec {
                // log-counter matches like NPD's log monitors (`\z`, trimmed
                // journal messages); its last line decides for these patterns.
                event_source: None,
                npd_matching: Some(NpdMatching {
                    buffer_lines: 1,
                    message_pattern: None,
                    skip: Vec::new(),
                    message_suffix: None,
                }),
                name: mon_name,
                source: LogSource {
                    kmsg: None,
                    file: None,
                    // log-counter's own flags: the journal's SYSLOG_IDENTIFIER
                    // and directory.
                    journald: Some(JournaldSource {
                        directory: flag(&args, "log-path").map(str::to_string),
                        unit: None,
                        identifier: flag(&args, "journald-source").map(str::to_string),
                    }),
                    plugin: None,
                    systemd: None,
                },
                // log-counter reports OK again once the window holds fewer
                // matches: the condition clears after a window without one.
                conditions: conds
                    .iter()
                    .filter(|c| condition.as_ref() == Some(&c.type_))
                    .map(|c| ConditionSpec {
                        clear_after_seconds: Some(window),
                        ..c.clone()
                    })
                    .collect(),
                rules: vec![RuleSpec {
                    kind: kind(r),
                    condition,
                    reason: reason.to_string(),
                    // log-counter patterns are regular expressions already.
                    pattern: pattern.to_string(),
                    command: Vec::new(),
                    timeout_seconds: None,
                    // log-counter's own output, which NPD makes the
                    // condition's message: nodeguard fires at the match
                    // that reaches the threshold, so the count is the
                    // threshold (`$` would start a capture reference).
                    message: Some(format!(
                        "Found {n} matching logs, which meets the threshold of {n}",
                        n = threshold
                    )),
                    count: Some(CountSpec {
                        revert_pattern: revert,
                        threshold,
                        window_seconds: window,
                    }),
                }],
            });
            continue;
        }
        if path.ends_with("/health-checker") || path == "health-checker" {
            let condition = r
                .get("condition")
                .and_then(Value::as_str)
                .map(str::to_string);
            let Some(m) = health_checker(
                origin,
                i,
                name,
                &args,
                get_s("invoke_interval").unwrap_or(10),
                RuleSpec {
                    kind: kind(r),
                    condition: condition.clone(),
                    reason: reason.to_string(),
                    pattern: String::new(),
                    command: Vec::new(),
                    timeout_seconds: None,
                    message: None,
                    count: None,
                },
                conds
                    .iter()
                    .filter(|c| condition.as_ref() == Some(&c.type_))
                    .cloned()
                    .collect(),
                &mut out.notes,
            ) else {
                continue;
            };
            services.push(m);
            continue;
        }
        if path.is_empty() {
            out.notes
                .push(format!("{origin}: rules[{i}] has no path; skipped"));
            continue;
        }
        let timeout_seconds = r
            .get("timeout")
            .and_then(Value::as_str)
            .and_then(go_duration_seconds)
            .map(|s| s.clamp(1, 3600));
        if !path.starts_with('/') {
            out.notes.push(format!(
                "{origin}: rules[{i}] path {path:?} is relative to NPD's working directory: give the absolute path on the node, and its owner must allow it (--allow-command, chart value trust.commands or host.plugins)"
            ));
        }
        let mut command = vec![path.to_string()];
        command.extend(args);
        plugin_rules.push(RuleSpec {
            kind: kind(r),
            condition: r
                .get("condition")
                .and_then(Value::as_str)
                .map(str::to_string),
            reason: reason.to_string(),
            pattern: String::new(),
            command,
            timeout_seconds,
            message: None,
            count: None,
        });
    }
    // Conditions go to the monitor whose rules set them.
    let counted: Vec<String> = counters
        .iter()
        .chain(&services)
        .flat_map(|m| m.conditions.iter().map(|c| c.type_.clone()))
        .collect();
    if !plugin_rules.is_empty() {
        out.monitors.push(MonitorSpec {
            event_source: None,
            npd_matching: None,
            name: name.to_string(),
            source: LogSource {
                kmsg: None,
                file: None,
                journald: None,
                plugin: Some(plugin),
                systemd: None,
            },
            conditions: conds
                .iter()
                .filter(|c| !counted.contains(&c.type_))
                .cloned()
                .collect(),
            rules: plugin_rules,
        });
    }
    if pc
        .and_then(|p| p.get("enable_message_change_based_condition_update"))
        .and_then(Value::as_bool)
        == Some(true)
    {
        out.notes.push(format!(
            "{origin}: enable_message_change_based_condition_update: nodeguard keeps a True condition's first message while its reason stays (NPD's default, false)"
        ));
    }
    out.monitors.extend(counters);
    out.monitors.extend(services);
    out
}

/// A Windows path or script (`C:\…`, `.exe`, `.ps1`): NPD's Windows
/// configs, which have no meaning on the Linux nodes nodeguard runs on.
fn windows_path(p: &str) -> bool {
    let lower = p.to_ascii_lowercase();
    let drive = p.as_bytes().get(1) == Some(&b':') && p.as_bytes()[0].is_ascii_alphabetic();
    drive || p.contains('\\') || lower.ends_with(".exe") || lower.ends_with(".ps1")
}

/// NPD's health checker (`health-checker --component=… --enable-repair …`)
/// as a systemd monitor: the unit's state over D-Bus, the component's
/// health URL where NPD checks one, and NPD's repair (SIGTERM to the main
/// process once the unit has been up for `--cooldown-time`).
#[allow(clippy::too_many_arguments)]
fn health_checker(
    origin: &str,
    i: usize,
    source: &str,
    args: &[String],
    interval: u32,
    rule: RuleSpec,
    conditions: Vec<ConditionSpec>,
    notes: &mut Vec<String>,
) -> Option<MonitorSpec> {
    let component = flag(args, "component").unwrap_or("kubelet");
    let service = flag(args, "service")
        .or_else(|| flag(args, "systemd-service"))
        .unwrap_or(match component {
            "cri" => "containerd",
            other => other,
        });
    let unit = if service.contains('.') {
        service.to_string()
    } else {
        format!("{service}.service")
    };
    let health_url = match component {
        "kubelet" => Some("http://127.0.0.1:10248/healthz"),
        "kube-proxy" => Some("http://127.0.0.1:10256/healthz"),
        "docker" => {
            notes.push(format!(
                "{origin}: rules[{i}] health-checker --component=docker: NPD also runs `docker ps` (and sends dockerd SIGUSR1 before a repair); nodeguard checks {unit}'s state"
            ));
            None
        }
        "cri" => {
            notes.push(format!(
                "{origin}: rules[{i}] health-checker --component=cri: NPD also runs `crictl pods`; nodeguard checks {unit}'s state (add an exec probe with crictl for the CRI itself)"
            ));
            None
        }
        other => {
            notes.push(format!(
                "{origin}: rules[{i}] health-checker --component={other} is not one of NPD's (kubelet, docker, cri, kube-proxy); skipped"
            ));
            return None;
        }
    };
    let repair = !matches!(
        flag(args, "enable-repair"),
        Some("false" | "0" | "f" | "F" | "FALSE" | "False")
    );
    if flag(args, "log-pattern").is_some() {
        notes.push(format!(
            "{origin}: rules[{i}] health-checker --log-pattern is not imported: add a journald monitor of {unit} with a count rule"
        ));
    }
    for a in args {
        let name = a.trim_start_matches('-').split('=').next().unwrap_or("");
        if ![
            "component",
            "service",
            "systemd-service",
            "enable-repair",
            "cooldown-time",
            "health-check-timeout",
            "loopback-time",
            "log-pattern",
            "crictl-path",
            "cri-socket-path",
            "cri-timeout",
            "v",
            "logtostderr",
        ]
        .contains(&name)
        {
            notes.push(format!(
                "{origin}: rules[{i}] health-checker argument {a:?} is not one of its flags; ignored"
            ));
        }
    }
    notes.push(format!(
        "{origin}: rules[{i}] health-checker becomes a systemd monitor of {unit}{}{}",
        health_url
            .map(|u| format!(" with health URL {u}"))
            .unwrap_or_default(),
        if repair {
            "; its repair needs the node to allow the unit (--allow-repair-unit, chart value trust.repairUnits) and the agent the system bus (host.dbus)"
        } else {
            ""
        }
    ));
    Some(MonitorSpec {
        event_source: None,
        npd_matching: None,
        name: label(&format!("{source}-{component}")),
        source: LogSource {
            kmsg: None,
            file: None,
            journald: None,
            plugin: None,
            systemd: Some(SystemdUnitSource {
                unit,
                interval_seconds: interval.clamp(1, 3600),
                health_url: health_url.map(str::to_string),
                // NPD's health checker: the URL alone decides, within
                // --health-check-timeout (10 s by default).
                health_timeout_seconds: health_url.map(|_| {
                    flag(args, "health-check-timeout")
                        .and_then(go_duration_seconds)
                        .unwrap_or(10)
                        .clamp(1, 300)
                }),
                require_active: health_url.is_none(),
                repair: repair.then(|| RepairSpec {
                    cooldown_seconds: flag(args, "cooldown-time")
                        .and_then(go_duration_seconds)
                        .unwrap_or(120)
                        .max(1),
                    signal: RepairSignal::Term,
                }),
            }),
        },
        conditions,
        rules: vec![rule],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// As log-counter's pflag reads its flags: `=` or a separate value, the
    /// last one winning.
    #[test]
    fn flags_as_pflag_reads_them() {
        let args: Vec<String> = ["--count=3", "--lookback", "5m", "--count=4", "--pattern"]
            .map(String::from)
            .to_vec();
        assert_eq!(flag(&args, "count"), Some("4"));
        assert_eq!(flag(&args, "lookback"), Some("5m"));
        assert_eq!(flag(&args, "pattern"), None, "no value follows");
        assert_eq!(flag(&args, "delay"), None);
    }

    #[test]
    fn go_durations() {
        assert_eq!(go_duration_seconds("30s"), Some(30));
        assert_eq!(go_duration_seconds("5m"), Some(300));
        assert_eq!(go_duration_seconds("1h30m"), Some(5400));
        assert_eq!(go_duration_seconds("500ms"), Some(1));
        assert_eq!(go_duration_seconds("20m0s"), Some(1200));
        assert_eq!(go_duration_seconds("10"), None);
        assert_eq!(go_duration_seconds("5x"), None);
        assert_eq!(go_duration_seconds(""), None);
    }

    /// Custom plugins of one source (checks of several components) share
    /// a condition: one monitor; another repeated name takes its file's
    /// name.
    #[test]
    fn configs_of_one_source_join_and_other_repeated_names_are_renamed() {
        let checker = |component: &str, condition: &str| {
            serde_json::json!({
                "plugin": "custom",
                "pluginConfig": {"invoke_interval": "10s", "timeout": "3m", "max_output_length": 80, "concurrency": 1},
                "source": "health-checker",
                "conditions": [{"type": condition, "reason": format!("{condition}IsHealthy"), "message": "ok"}],
                "rules": [{"type": "permanent", "condition": condition, "reason": format!("{}Unhealthy", component.to_uppercase()),
                           "path": "/usr/local/bin/check-component", "args": [format!("--component={component}")]}],
            })
        };
        let parts = vec![
            (
                "kubelet.json".to_string(),
                import("kubelet.json", &checker("kubelet", "KubeletUnhealthy")).monitors,
            ),
            (
                "docker.json".to_string(),
                import(
                    "docker.json",
                    &checker("docker", "ContainerRuntimeUnhealthy"),
                )
                .monitors,
            ),
            (
                "cri.json".to_string(),
                import("cri.json", &checker("cri", "ContainerRuntimeUnhealthy")).monitors,
            ),
            (
                "/etc/npd/other-kernel.json".to_string(),
                import(
                    "k",
                    &serde_json::json!({"plugin": "kmsg", "source": "health-checker", "rules": []}),
                )
                .monitors,
            ),
        ];
        let (monitors, notes) = combine(parts);
        let names: Vec<&str> = monitors.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["health-checker", "health-checker-other-kernel"]);
        let types: Vec<&str> = monitors[0]
            .conditions
            .iter()
            .map(|c| c.type_.as_str())
            .collect();
        assert_eq!(types, ["KubeletUnhealthy", "ContainerRuntimeUnhealthy"]);
        assert_eq!(monitors[0].rules.len(), 3);
        // Each NPD config ran its checks with its own concurrency of 1.
        assert_eq!(monitors[0].source.plugin.as_ref().unwrap().concurrency, 3);
        assert!(
            notes.iter().any(|n| n.starts_with("cri.json: condition ContainerRuntimeUnhealthy is also set")),
            "{notes:?}"
        );
        let policy = crate::policy::NodeGuardPolicy::new(
            "p",
            crate::policy::NodeGuardPolicySpec {
                monitors,
                ..Default::default()
            },
        );
        let problems = crate::policy::validate(&policy);
        assert!(problems.is_empty(), "{problems:?}");
    }

    /// NPD's health checker becomes a systemd monitor of its unit, with
    /// NPD's repair (SIGTERM after the cooldown) unless repair is off.
    #[test]
    fn health_checkers_become_systemd_monitors() {
        let checker = |args: &[&str]| {
            serde_json::json!({
                "plugin": "custom",
                "pluginConfig": {"invoke_interval": "10s", "timeout": "3m"},
                "source": "health-checker",
                "conditions": [{"type": "X", "reason": "XOk", "message": "ok"}],
                "rules": [{"type": "permanent", "condition": "X", "reason": "XBad",
                           "path": "/home/kubernetes/bin/health-checker", "args": args}],
            })
        };
        let unit = |args: &[&str]| {
            let out = import("c.json", &checker(args));
            let m = out.monitors.first().cloned();
            (m.and_then(|m| m.source.systemd), out.notes)
        };
        let (s, notes) = unit(&["--component=kubelet", "--cooldown-time=1m"]);
        let s = s.unwrap();
        assert_eq!(s.unit, "kubelet.service");
        assert_eq!(
            s.health_url.as_deref(),
            Some("http://127.0.0.1:10248/healthz")
        );
        assert_eq!(s.interval_seconds, 10);
        // NPD judges the kubelet by its healthz alone, within 10 s unless
        // --health-check-timeout says otherwise.
        assert_eq!(
            (s.health_timeout_seconds, s.require_active),
            (Some(10), false)
        );
        let r = s.repair.unwrap();
        assert_eq!((r.cooldown_seconds, r.signal), (60, RepairSignal::Term));
        let (s, _) = unit(&["--component=kubelet", "--health-check-timeout=30s"]);
        assert_eq!(s.unwrap().health_timeout_seconds, Some(30));
        assert!(
            notes.iter().any(|n| n.contains("--allow-repair-unit")),
            "{notes:?}"
        );
        let (s, notes) = unit(&["--component=cri", "--service=containerd-custom"]);
        let s = s.unwrap();
        assert_eq!(s.unit, "containerd-custom.service");
        assert_eq!(s.health_url, None);
        assert_eq!((s.health_timeout_seconds, s.require_active), (None, true));
        assert_eq!(s.repair.unwrap().cooldown_seconds, 120, "NPD's default");
        assert!(notes.iter().any(|n| n.contains("crictl pods")), "{notes:?}");
        let (s, _) = unit(&["--component=kube-proxy", "--enable-repair=false"]);
        let s = s.unwrap();
        assert_eq!(s.unit, "kube-proxy.service");
        assert_eq!(
            s.health_url.as_deref(),
            Some("http://127.0.0.1:10256/healthz")
        );
        assert!(s.repair.is_none());
        let (s, notes) = unit(&["--component=etcd"]);
        assert!(s.is_none());
        assert!(
            notes.iter().any(|n| n.contains("--component=etcd")),
            "{notes:?}"
        );
        let (s, notes) = unit(&["--component=docker", "--log-pattern=1:OOM", "--bogus=1"]);
        assert_eq!(s.unwrap().unit, "docker.service");
        for want in ["docker ps", "--log-pattern", "\"--bogus=1\""] {
            assert!(notes.iter().any(|n| n.contains(want)), "{want}: {notes:?}");
        }
    }

    /// NPD's Windows configs are refused, not imported as Linux commands.
    #[test]
    fn windows_configs_are_refused() {
        for config in [
            serde_json::json!({"plugin": "custom", "source": "w", "rules": [{"type": "temporary", "reason": "R",
                "path": "C:\\etc\\kubernetes\\node\\bin\\health-checker.exe", "args": []}]}),
            serde_json::json!({"plugin": "custom", "source": "w", "rules": [{"type": "temporary", "reason": "R",
                "path": "./config/plugin/windows_defender_problem.ps1"}]}),
            serde_json::json!({"plugin": "filelog", "source": "w", "logPath": "C:\\etc\\kubernetes\\logs\\containerd.log", "rules": []}),
        ] {
            let out = import("w.json", &config);
            assert!(out.monitors.is_empty(), "{config}");
            assert!(
                out.notes.iter().any(|n| n.contains("a Windows config")),
                "{:?}",
                out.notes
            );
        }
        assert!(!windows_path("/home/kubernetes/bin/log-counter"));
    }

    /// A log rule NPD's loader would refuse is named, not dropped silently.
    #[test]
    fn rules_without_a_pattern_are_named() {
        let out = import(
            "k.json",
            &serde_json::json!({"plugin": "kmsg", "source": "k", "rules": [
                {"type": "temporary", "reason": "A"},
                {"type": "temporary", "reason": "B", "pattern": "b"}]}),
        );
        assert_eq!(out.monitors[0].rules.len(), 1);
        assert!(
            out.notes.iter().any(
                |n| n == "k.json: rules[0] has no pattern; skipped (NPD refuses such a config)"
            ),
            "{:?}",
            out.notes
        );
    }

    #[test]
    fn labels() {
        assert_eq!(label("kernel-monitor"), "kernel-monitor");
        assert_eq!(label("NTP custom_plugin"), "ntp-custom-plugin");
        assert_eq!(label("---"), "imported");
    }
}
