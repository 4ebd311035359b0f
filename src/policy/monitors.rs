//! `spec.monitors`: log monitors in node-problem-detector's shape (a
//! source, conditions, temporary and permanent rules), plus what NPD lacks:
//! conditions that clear, counting rules, and taints.

pub mod patterns;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use patterns::{BadPattern, Patterns};

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MonitorSpec {
    /// Unique among the node's monitors; lowercase letters, digits and '-'
    /// (it names the monitor's state file on the node).
    #[schemars(
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"),
        length(min = 1, max = 63)
    )]
    pub name: String,
    pub source: LogSource,
    /// The conditions this monitor owns, with their no-problem state.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub conditions: Vec<ConditionSpec>,
    #[serde(default)]
    #[schemars(length(max = 256))]
    pub rules: Vec<RuleSpec>,
    /// Match lines the way node-problem-detector's log monitors do (set by
    /// `nodeguard import-npd`); unset: each pattern is searched anywhere in
    /// one line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub npd_matching: Option<NpdMatching>,
    /// The source component of this monitor's Events (what `kubectl get
    /// events` shows as their source). `nodeguard import-npd` sets NPD's
    /// `source` of the config (`kernel-monitor`, `systemd-monitor`, …), so
    /// Events are routed and filtered as NPD's were. Unset: the agent's own
    /// (`nodeguard.io/agent`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 128))]
    pub event_source: Option<String>,
}

/// node-problem-detector's matching. Every pattern of the monitor (rules,
/// `clearPattern`, `revertPattern`, `messagePattern`) is a Go regular
/// expression (RE2 syntax, as in NPD's configs), read as Go reads it:
/// `\d`, `\w`, `\s` and `\b` are ASCII, `\<` is the character `<`,
/// `[a&&b]` holds `&`, `a{,3}` is text, `\Q…\E` and octal escapes work.
/// Each new line (kmsg and journald
/// messages trimmed of surrounding whitespace, as NPD does) joins the last
/// `bufferLines` lines, joined with newlines, and a rule, clear or revert
/// pattern matches when it matches text that ends at the end of the newest
/// line (NPD appends `\z`). So a pattern may span lines (`\n`), `^` is the
/// start of the oldest line held (with more than one line: never, as in NPD),
/// and "divide error: 0000 \[#\d+\] SMP" does not match a line that goes
/// on with " PTI".
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NpdMatching {
    /// NPD's `bufferSize`: lines held for matching.
    #[schemars(range(min = 1, max = 100))]
    pub buffer_lines: u32,
    /// File monitors: NPD's filelog `pluginConfig.message`; its last capture
    /// group (its whole match without one) is the message rules are matched
    /// against, and a line it does not match is skipped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message_pattern: Option<String>,
    /// File monitors: NPD's filelog `skipList`; a line containing any of
    /// these is skipped.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skip: Vec<String>,
    /// NPD's `patternGeneratedMessageSuffix`: appended to the matched lines,
    /// after "; " (often a runbook link).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message_suffix: Option<String>,
}

/// What a monitor's regular expression belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PatternOf {
    /// `rules[i].pattern`.
    Rule(usize),
    /// `conditions[i].clearPattern`.
    Clear(usize),
    /// `rules[i].count.revertPattern`.
    Revert(usize),
}

impl MonitorSpec {
    /// Every regular expression of this monitor (log rules' patterns, then
    /// clear patterns), with what it belongs to and its field path under
    /// `path`.
    pub fn patterns(&self, path: &str) -> Vec<(PatternOf, String, &str)> {
        let rules = self
            .rules
            .iter()
            .enumerate()
            .filter(|(_, r)| r.command.is_empty())
            .map(|(i, r)| {
                (
                    PatternOf::Rule(i),
                    format!("{path}.rules[{i}].pattern"),
                    r.pattern.as_str(),
                )
            });
        let clears = self.conditions.iter().enumerate().filter_map(|(i, c)| {
            let p = c.clear_pattern.as_deref()?;
            Some((
                PatternOf::Clear(i),
                format!("{path}.conditions[{i}].clearPattern"),
                p,
            ))
        });
        let reverts = self.rules.iter().enumerate().filter_map(|(i, r)| {
            let p = r.count.as_ref()?.revert_pattern.as_deref()?;
            Some((
                PatternOf::Revert(i),
                format!("{path}.rules[{i}].count.revertPattern"),
                p,
            ))
        });
        rules.chain(clears).chain(reverts).collect()
    }

    /// Whether a new boot resets `condition` (one of this monitor's):
    /// - every condition of a kernel-log (kmsg) monitor: the kernel's state
    ///   (a deadlock, a read-only remount) does not survive a reboot;
    /// - a file or journald monitor's condition that nothing else clears (no
    ///   `clearAfterSeconds`, no `clearPattern`): node-problem-detector keeps
    ///   such a condition until it restarts, which is at the latest the next
    ///   boot, so nodeguard, which keeps it across its own restarts, resets
    ///   it there.
    ///
    /// - a file or journald monitor's condition that only counting rules set:
    ///   counts start again at each boot (as NPD's log-counter never counts
    ///   what an earlier boot logged), so "N times in the window" from the
    ///   last boot no longer holds.
    ///
    /// Plugin and systemd conditions are checked again on their interval and
    /// clear when their check passes, so a reboot leaves them as they were.
    pub fn resets_at_boot(&self, condition: &ConditionSpec) -> bool {
        let log = match self.source.one() {
            Some(Source::Kmsg(_)) => return true,
            Some(Source::File(_) | Source::Journald(_)) => true,
            Some(Source::Plugin(_) | Source::Systemd(_)) | None => false,
        };
        let mut setters = self
            .rules
            .iter()
            .filter(|r| r.condition.as_deref() == Some(condition.type_.as_str()))
            .peekable();
        let counted_only = setters.peek().is_some() && setters.all(|r| r.count.is_some());
        log && (counted_only
            || (condition.clear_after_seconds.is_none() && condition.clear_pattern.is_none()))
    }

    /// Compiles [`MonitorSpec::patterns`]; the `PatternOf` of each index.
    pub fn compile_patterns(
        &self,
        path: &str,
    ) -> Result<(Patterns, Vec<PatternOf>), Vec<BadPattern>> {
        let all = self.patterns(path);
        let of = all.iter().map(|(o, _, _)| *o).collect();
        // A rule's pattern runs alone when the rule fires with captures in
        // its message, or, NPD-style, to find where its match starts.
        let alone = |of: &PatternOf| match *of {
            PatternOf::Rule(r) => match &self.rules[r].message {
                Some(m) => m.contains('$'),
                None => self.npd_matching.is_some(),
            },
            PatternOf::Clear(_) | PatternOf::Revert(_) => false,
        };
        let compiled = match &self.npd_matching {
            None => Patterns::compile(path, all.into_iter().map(|(o, at, p)| (at, p, alone(&o))))?,
            Some(_) => {
                // NPD's patterns are Go's (RE2): translated so they match
                // what they matched there. A bad pattern is reported as
                // written.
                let mut bad = Vec::new();
                let mut anchored: Vec<(String, String, bool)> = Vec::new();
                for (o, at, p) in all {
                    match super::goregex::translate(p) {
                        // NPD appends `\z`: the match must end where the
                        // newest line does. Appended as NPD appends it,
                        // without a group: in `A|B` only B is anchored, in
                        // NPD and here.
                        Ok(rust) => anchored.push((at, format!("{rust}\\z"), alone(&o))),
                        Err(e) => bad.push(BadPattern {
                            path: at,
                            message: e,
                        }),
                    }
                }
                if !bad.is_empty() {
                    return Err(bad);
                }
                Patterns::compile(
                    path,
                    anchored
                        .iter()
                        .map(|(at, p, alone)| (at.clone(), p.as_str(), *alone)),
                )?
            }
        };
        Ok((compiled, of))
    }
}

/// The kinds of monitor source, as a policy names them: the fields of
/// [`LogSource`], the arms of [`Source`], the CRD's rule and the validation
/// message all follow this list (a test holds them to it).
pub const SOURCE_KINDS: [&str; 5] = ["kmsg", "file", "journald", "plugin", "systemd"];

/// The API server's check that a monitor has one source.
const ONE_SOURCE_RULE: &str = "[has(self.kmsg), has(self.file), has(self.journald), has(self.plugin), has(self.systemd)].filter(x, x).size() == 1";

/// What the API server and `nodeguard check` say of a monitor without one
/// source.
pub const ONE_SOURCE_MESSAGE: &str = "set exactly one of kmsg, file, journald, plugin or systemd";

/// Exactly one source.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": ONE_SOURCE_RULE,
        "message": ONE_SOURCE_MESSAGE
    }
]))]
pub struct LogSource {
    /// The kernel log (`/dev/kmsg`-format records).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kmsg: Option<KmsgSource>,
    /// A text log file, followed across rotation and truncation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<FileSource>,
    /// A systemd unit's health over D-Bus (ActiveState, restarts, uptime),
    /// with an optional HTTP health endpoint and optional repair.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub systemd: Option<SystemdUnitSource>,
    /// The systemd journal, read with `journalctl --follow --output=json`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub journald: Option<JournaldSource>,
    /// Checks run on an interval (NPD's custom plugins): each rule names a
    /// command; exit 0 is OK, 1 a problem, anything else unknown; the
    /// output (truncated) is the message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plugin: Option<PluginSource>,
}

/// A monitor's one source, borrowed: what code that acts on the source
/// matches on, so a new kind is one more arm the compiler asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source<'a> {
    Kmsg(&'a KmsgSource),
    File(&'a FileSource),
    Journald(&'a JournaldSource),
    Plugin(&'a PluginSource),
    Systemd(&'a SystemdUnitSource),
}

impl LogSource {
    /// The source that is set; `None` when none or several are (validation
    /// refuses both, so a monitor that runs has one).
    pub fn one(&self) -> Option<Source<'_>> {
        let set = [
            self.kmsg.as_ref().map(Source::Kmsg),
            self.file.as_ref().map(Source::File),
            self.journald.as_ref().map(Source::Journald),
            self.plugin.as_ref().map(Source::Plugin),
            self.systemd.as_ref().map(Source::Systemd),
        ];
        let mut set = set.into_iter().flatten();
        match (set.next(), set.next()) {
            (Some(one), None) => Some(one),
            _ => None,
        }
    }
}

impl Source<'_> {
    /// Whether it gives lines to match (a log), rather than verdicts of
    /// checks run on an interval.
    pub fn lines(self) -> bool {
        match self {
            Source::Kmsg(_) | Source::File(_) | Source::Journald(_) => true,
            Source::Plugin(_) | Source::Systemd(_) => false,
        }
    }

    /// Its name in [`SOURCE_KINDS`].
    pub fn kind(self) -> &'static str {
        match self {
            Source::Kmsg(_) => SOURCE_KINDS[0],
            Source::File(_) => SOURCE_KINDS[1],
            Source::Journald(_) => SOURCE_KINDS[2],
            Source::Plugin(_) => SOURCE_KINDS[3],
            Source::Systemd(_) => SOURCE_KINDS[4],
        }
    }
}

/// What the API server lets `healthUrl` be on a write: an http:// or
/// https:// URL with a host in printable ASCII, and no space or ASCII
/// control character after it, as the prober (`http::Uri`) can request it
/// (NPD's flags take `127.0.0.1:10248`, without the scheme). Spelled in
/// byte ranges, not `\s` and `\S`: the API server's regular expressions
/// (Go's) take `\s` for ASCII white space only, Rust's for Unicode's, and
/// `nodeguard check` must refuse what the API server refuses, no more. The agent does not refuse a policy stored before the
/// schema said so (an upgrade would drop the whole policy): its unit's
/// state decides, and the condition's message says the URL was not
/// checked.
pub const HEALTH_URL_PATTERN: &str =
    r##"^[Hh][Tt][Tt][Pp][Ss]?://[!-"$-.0->@-~]+([/?#][^\x00-\x20\x7F]*)?$"##;

/// A service checked like node-problem-detector's health checker.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SystemdUnitSource {
    /// The unit, e.g. `kubelet.service`.
    pub unit: String,
    #[serde(default = "default_service_interval")]
    #[schemars(range(min = 1, max = 3600))]
    pub interval_seconds: u32,
    /// Also require this URL to answer 2xx (e.g. the kubelet's healthz): an
    /// absolute http:// or https:// URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = HEALTH_URL_PATTERN))]
    pub health_url: Option<String>,
    /// How long `healthUrl` has to answer (node-problem-detector's
    /// `--health-check-timeout`); unset: 5 s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 300))]
    pub health_timeout_seconds: Option<u32>,
    /// Whether the unit must be active to be healthy (the default). False,
    /// with a `healthUrl`: the URL alone decides, as node-problem-detector's
    /// health checker judges the kubelet and kube-proxy, and the unit is
    /// read for the repair's cooldown only (a kubelet run by another unit,
    /// or none, is judged by its healthz; without the unit nothing is
    /// repaired).
    #[serde(default = "default_require_active", skip_serializing_if = "is_true")]
    pub require_active: bool,
    /// Repair an unhealthy unit by signalling its main process (as
    /// `systemctl kill --kill-who=main`; systemd restarts it), only once it
    /// has run for `cooldownSeconds` since its last start, so a unit that
    /// fails at start is never killed in a loop.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repair: Option<RepairSpec>,
}

fn default_service_interval() -> u32 {
    10
}

fn default_require_active() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RepairSpec {
    #[serde(default = "default_cooldown")]
    #[schemars(range(min = 1))]
    pub cooldown_seconds: u32,
    /// The signal sent to the unit's main process. SIGTERM (the default,
    /// as NPD's health checker's `systemctl kill`) lets the service stop
    /// cleanly, but systemd counts a SIGTERM, SIGINT or SIGHUP exit as
    /// clean: only `Restart=always` units come back from it. For
    /// `Restart=on-failure` units use SIGKILL or SIGABRT.
    #[serde(default)]
    pub signal: RepairSignal,
}

/// The signals a repair may send.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum RepairSignal {
    #[default]
    #[serde(rename = "SIGTERM")]
    Term,
    #[serde(rename = "SIGKILL")]
    Kill,
    #[serde(rename = "SIGINT")]
    Int,
    #[serde(rename = "SIGHUP")]
    Hup,
    #[serde(rename = "SIGQUIT")]
    Quit,
    #[serde(rename = "SIGABRT")]
    Abrt,
    #[serde(rename = "SIGUSR1")]
    Usr1,
    #[serde(rename = "SIGUSR2")]
    Usr2,
}

impl RepairSignal {
    /// The signal's number.
    pub fn number(self) -> i32 {
        match self {
            Self::Term => libc::SIGTERM,
            Self::Kill => libc::SIGKILL,
            Self::Int => libc::SIGINT,
            Self::Hup => libc::SIGHUP,
            Self::Quit => libc::SIGQUIT,
            Self::Abrt => libc::SIGABRT,
            Self::Usr1 => libc::SIGUSR1,
            Self::Usr2 => libc::SIGUSR2,
        }
    }

    /// Its name, as systemd and `kill -l` write it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Term => "SIGTERM",
            Self::Kill => "SIGKILL",
            Self::Int => "SIGINT",
            Self::Hup => "SIGHUP",
            Self::Quit => "SIGQUIT",
            Self::Abrt => "SIGABRT",
            Self::Usr1 => "SIGUSR1",
            Self::Usr2 => "SIGUSR2",
        }
    }
}

fn default_cooldown() -> u32 {
    600
}

/// Which journal entries to read.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct JournaldSource {
    /// A journal directory (a host mount such as `/var/log/journal`);
    /// default: the local journal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub directory: Option<String>,
    /// Only entries of this systemd unit (`journalctl --unit`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unit: Option<String>,
    /// Only entries with this SYSLOG_IDENTIFIER (`journalctl --identifier`),
    /// as NPD's journald plugin `source`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identifier: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PluginSource {
    #[serde(default = "default_interval")]
    #[schemars(range(min = 1, max = 86400))]
    pub interval_seconds: u32,
    #[serde(default = "default_plugin_timeout")]
    #[schemars(range(min = 1, max = 3600))]
    pub timeout_seconds: u32,
    /// Commands of this monitor that may run at once.
    #[serde(default = "default_concurrency")]
    #[schemars(range(min = 1, max = 64))]
    pub concurrency: u32,
    /// Characters of output kept for the message.
    #[serde(default = "default_output")]
    #[schemars(range(min = 1, max = 4096))]
    pub max_output_length: u32,
    /// Judge results as node-problem-detector's custom plugin monitor does
    /// (set by `nodeguard import-npd`): a check that exits with another
    /// code than 0 or 1, cannot start or is killed at its timeout makes its
    /// condition Unknown (NPD's reason and message rules) and, for a
    /// temporary rule, an Event; one that exited while a child it left kept
    /// its output open past the timeout is judged by its exit code; a
    /// check's output is its stdout alone, cut at `maxOutputLength` bytes; a
    /// timeout says "Timeout when running plugin …"; every condition change
    /// is an Event worded as NPD's ("Node condition X is now: …"). Unset:
    /// an unknown result changes nothing, a timeout is one, a check's
    /// output falls back to stderr.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub npd_results: bool,
}

fn default_interval() -> u32 {
    30
}
fn default_plugin_timeout() -> u32 {
    5
}
fn default_concurrency() -> u32 {
    3
}
fn default_output() -> u32 {
    80
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KmsgSource {
    #[serde(default = "default_kmsg")]
    pub path: String,
}

pub(super) fn default_kmsg() -> String {
    "/dev/kmsg".into()
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FileSource {
    pub path: String,
}

/// A condition's no-problem state, and how it clears and taints.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ConditionSpec {
    /// The NodeCondition type, e.g. `KernelDeadlock`.
    #[serde(rename = "type")]
    pub type_: String,
    /// Reason while there is no problem, e.g. `KernelHasNoDeadlock`.
    pub reason: String,
    /// Message while there is no problem.
    pub message: String,
    /// Back to False after this long without a matching line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub clear_after_seconds: Option<u32>,
    /// Back to False when a line matches this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096))]
    pub clear_pattern: Option<String>,
    /// A taint nodeguard adds while the condition is True.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub taint: Option<TaintSpec>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
pub struct TaintSpec {
    pub key: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// NoSchedule, PreferNoSchedule or NoExecute.
    #[schemars(regex(pattern = r"^(NoSchedule|PreferNoSchedule|NoExecute)$"))]
    pub effect: String,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ProblemKind {
    /// An Event.
    Temporary,
    /// Sets its condition True.
    Permanent,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "self.type == 'temporary' ? !has(self.condition) : has(self.condition)",
        "message": "permanent rules name the condition they set; temporary rules set none",
        "fieldPath": ".condition"
    }
]))]
pub struct RuleSpec {
    #[serde(rename = "type")]
    pub kind: ProblemKind,
    /// Permanent rules: the condition they set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub condition: Option<String>,
    /// CamelCase reason, e.g. `OOMKilling`.
    pub reason: String,
    /// Log monitors: a regular expression (Rust `regex` syntax) matched
    /// against each line.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(max = 4096))]
    pub pattern: String,
    /// Plugin monitors: the command (argv) to run.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub command: Vec<String>,
    /// Plugin monitors: this command's timeout (node-problem-detector's
    /// per-rule `timeout`); unset: the source's `timeoutSeconds`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 3600))]
    pub timeout_seconds: Option<u32>,
    /// The message; `$1`, `${name}` insert captures. Default: the line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Only fire after `threshold` matches within `windowSeconds`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<CountSpec>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CountSpec {
    #[schemars(range(min = 1))]
    pub threshold: u32,
    /// At most 86400 (one day) for new writes. Matches are counted per
    /// second up to 1200 seconds, in `windowSeconds / 1200`-second buckets
    /// beyond (a longer window stored earlier runs the same way).
    #[schemars(range(min = 1, max = 86400))]
    pub window_seconds: u32,
    /// A line matching this cancels one match in the window (NPD
    /// log-counter's `--revert-pattern`: a clean "Stopping" before a
    /// "Started" is a restart, not a crash).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096))]
    pub revert_pattern: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The schema's `healthUrl` pattern lets through what the prober can
    /// request (an absolute http or https URI with a host, as `http::Uri`
    /// parses it for hyper) and refuses the rest.
    #[test]
    fn the_health_url_pattern_is_what_the_prober_can_request() {
        let pattern = regex::Regex::new(HEALTH_URL_PATTERN).unwrap();
        let requestable = |u: &str| {
            u.parse::<http::Uri>().is_ok_and(|uri| {
                matches!(uri.scheme_str(), Some("http" | "https"))
                    && uri.host().is_some_and(|h| !h.is_empty())
            })
        };
        for (url, ok) in [
            ("http://127.0.0.1:10248/healthz", true),
            ("https://localhost:10256/healthz", true),
            ("http://[::1]:10248/healthz", true),
            ("http://127.0.0.1:10248", true),
            ("http://127.0.0.1:10248?verbose", true),
            ("HTTP://127.0.0.1:10248/healthz", true),
            ("http://user:pw@127.0.0.1:10248/healthz", true),
            ("127.0.0.1:10248/healthz", false),
            ("localhost:10248", false),
            ("/healthz", false),
            ("tcp://127.0.0.1:10248/healthz", false),
            ("http:///healthz", false),
            ("http://127.0.0.1:10248/health z", false),
            ("http://127.0.0.1:10248/healthz ", false),
            ("http://127.0.0.1:10248/health\u{a0}z", true),
            ("http://127.0.0.1:10248/health\u{b}z", false),
            ("http://h\u{e9}te:10248/healthz", false),
            ("http://127.0.0.1:10248/healthz\t", false),
            ("", false),
        ] {
            assert_eq!(requestable(url), ok, "the prober, {url:?}");
            assert_eq!(pattern.is_match(url), ok, "the pattern, {url:?}");
        }
    }

    /// The list of kinds, the fields of `LogSource` in the CRD, the CRD's
    /// rule and the message say the same.
    #[test]
    fn one_list_of_source_kinds() {
        let schema = serde_json::to_value(schemars::schema_for!(LogSource)).unwrap();
        let mut fields: Vec<&str> = schema["properties"]
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        let mut kinds = SOURCE_KINDS.to_vec();
        fields.sort_unstable();
        kinds.sort_unstable();
        assert_eq!(fields, kinds, "LogSource's fields are the kinds");
        let has: Vec<String> = SOURCE_KINDS
            .iter()
            .map(|k| format!("has(self.{k})"))
            .collect();
        assert_eq!(
            ONE_SOURCE_RULE,
            format!("[{}].filter(x, x).size() == 1", has.join(", "))
        );
        let (last, rest) = SOURCE_KINDS.split_last().unwrap();
        assert_eq!(
            ONE_SOURCE_MESSAGE,
            format!("set exactly one of {} or {last}", rest.join(", "))
        );
        let rule = &schema["x-kubernetes-validations"][0];
        assert_eq!(rule["rule"], ONE_SOURCE_RULE);
        assert_eq!(rule["message"], ONE_SOURCE_MESSAGE);
    }

    #[test]
    fn one_source_names_its_kind() {
        let least = |kind: &str| match kind {
            "file" => serde_json::json!({"path": "/x"}),
            "systemd" => serde_json::json!({"unit": "x.service"}),
            _ => serde_json::json!({}),
        };
        for kind in SOURCE_KINDS {
            let source: LogSource = serde_json::from_value(serde_json::json!({kind: least(kind)}))
                .unwrap_or_else(|e| panic!("{kind}: {e}"));
            assert_eq!(source.one().map(Source::kind), Some(kind));
        }
        let none: LogSource = serde_json::from_value(serde_json::json!({})).unwrap();
        assert_eq!(none.one(), None);
        let two: LogSource =
            serde_json::from_value(serde_json::json!({"kmsg": {}, "plugin": {}})).unwrap();
        assert_eq!(two.one(), None, "two sources are none");
    }
}
