//! Node-local trust: what the node's owner lets policies make this agent do.
//!
//! A `NodeGuardPolicy` is written through the API, by whoever RBAC lets
//! write one, and the agent acts on it as root on every node it selects.
//! The capabilities that reach into the host (running commands, killing a
//! unit's process, reading host files, petting a watchdog device, rewriting
//! logind's configuration and holding its shutdown back) are therefore
//! bounded by settings that live on the node, in the agent's flags (the
//! chart renders them from its values into the DaemonSet; a host service
//! reads them from its unit). A policy that asks for more loses only the
//! item that asks (the probe, the monitor, the shutdown or watchdog
//! section): the rest of it applies, and the node says why in an Event and
//! its `NodeGuardPolicyInvalid` condition.
//!
//! Everything here is a lexical decision on plain values: no file system,
//! no API. Paths must be absolute and normal (no `.`, `..` or empty
//! components), so `/var/log/../../etc/shadow` is not "under /var/log".

use std::fmt;

use super::monitors::{MonitorSpec, Source};
use super::probes::ProbeSpec;
use super::{ShutdownSpec, WatchdogSpec};

/// The node-local settings. [`NodeTrust::default`] allows exactly what the
/// shipped default policy needs and nothing else.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeTrust {
    /// Executables policies may run (exec probes, plugin monitors): absolute
    /// paths; an entry ending in `/` allows everything under that directory.
    /// The command's first word must be an absolute path (no `$PATH` search).
    pub commands: Vec<String>,
    /// systemd units policies may repair (KillUnit on the main process): a
    /// unit name, or a prefix ending in `*` (`kube*` allows `kubelet.service`).
    pub repair_units: Vec<String>,
    /// Path roots monitors may read: the kernel log device, log files,
    /// journal directories (a journald monitor without `directory` reads
    /// `/var/log/journal` and `/run/log/journal`).
    pub read_paths: Vec<String>,
    /// Watchdog devices policies may pet: device paths (an entry ending in
    /// `/` allows everything under it; never list `/dev/`).
    pub watchdog_devices: Vec<String>,
    /// Directories nodeguard may write its logind drop-in into (roots).
    pub logind_drop_in_dirs: Vec<String>,
    /// The longest inhibit delay a shutdown section may ask logind for: its
    /// priority groups' windows plus the safety margin.
    pub max_inhibit_delay_seconds: u32,
}

/// The journal directories a journald monitor without `directory` reads
/// (journalctl's own default: the persistent and the volatile journal).
pub const LOCAL_JOURNAL: [&str; 2] = ["/var/log/journal", "/run/log/journal"];

impl Default for NodeTrust {
    fn default() -> Self {
        NodeTrust {
            commands: Vec::new(),
            repair_units: Vec::new(),
            read_paths: vec!["/dev/kmsg".into(), "/var/log/journal".into()],
            // The default policy pets no device.
            watchdog_devices: Vec::new(),
            logind_drop_in_dirs: vec!["/etc/systemd/logind.conf.d".into()],
            // The shipped default: 30 s of groups and a 2 s margin.
            max_inhibit_delay_seconds: 32,
        }
    }
}

/// The node-local setting that would allow a refused request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Setting {
    Commands,
    RepairUnits,
    ReadPaths,
    WatchdogDevices,
    LogindDropInDirs,
    MaxInhibitDelay,
}

impl Setting {
    /// The agent's flag.
    pub fn flag(self) -> &'static str {
        match self {
            Setting::Commands => "--allow-command",
            Setting::RepairUnits => "--allow-repair-unit",
            Setting::ReadPaths => "--allow-read-path",
            Setting::WatchdogDevices => "--allow-watchdog-device",
            Setting::LogindDropInDirs => "--allow-logind-drop-in-dir",
            Setting::MaxInhibitDelay => "--max-inhibit-delay-seconds",
        }
    }

    /// The Helm chart's value that renders the flag.
    pub fn chart_value(self) -> &'static str {
        match self {
            Setting::Commands => "trust.commands",
            Setting::RepairUnits => "trust.repairUnits",
            Setting::ReadPaths => "trust.readPaths",
            Setting::WatchdogDevices => "host.watchdog.enabled and .device",
            Setting::LogindDropInDirs => "host.logindDropIn.path",
            Setting::MaxInhibitDelay => "trust.maxInhibitDelaySeconds",
        }
    }
}

/// The part of a policy a refusal leaves out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Item {
    /// `spec.probes[i]`.
    Probe(usize),
    /// `spec.monitors[i]`.
    Monitor(usize),
    Shutdown,
    /// Only the logind drop-in of the shutdown section: the section applies
    /// and nodeguard never writes logind's configuration.
    ShutdownDropIn,
    Watchdog,
}

/// One request of one policy that this node's trust does not cover. The
/// item holding it (`dropped`) is not put in force on this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub policy: String,
    pub item: Item,
    /// Field path of the request, e.g. `spec.probes[2].exec.command[0]`.
    pub field: String,
    /// What it asks for, e.g. `runs /bin/sh`.
    pub asks: String,
    pub setting: Setting,
    /// What is not put in force, e.g. `probe disk-check`.
    pub dropped: String,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "NodeGuardPolicy {}: {} {}, which this node does not allow, so its {} is not in force here (node-local setting {}, chart value {})",
            self.policy,
            self.field,
            self.asks,
            self.dropped,
            self.setting.flag(),
            self.setting.chart_value()
        )
    }
}

/// What a policy asks for, cut to a length an Event note (1 KiB) and a
/// condition message can carry along with the rest of the sentence.
fn clip(s: &str) -> String {
    crate::report::clip(s, 300)
}

/// `path` split into its components when it is absolute and normal.
fn components(path: &str) -> Option<Vec<&str>> {
    let rest = path.strip_prefix('/')?;
    let parts: Vec<&str> = rest.split('/').collect();
    let trailing = parts.last() == Some(&"");
    let body = if trailing {
        &parts[..parts.len() - 1]
    } else {
        &parts[..]
    };
    if body.iter().any(|c| c.is_empty() || *c == "." || *c == "..") {
        return None;
    }
    Some(body.to_vec())
}

/// Whether `path` is `root` or lies under it (component-wise, so `/var/logx`
/// is not under `/var/log`).
pub fn under(path: &str, root: &str) -> bool {
    match (components(path), components(root)) {
        (Some(p), Some(r)) => p.len() >= r.len() && p[..r.len()] == r[..],
        _ => false,
    }
}

/// Whether `path` is one of `entries`: an entry equal to it, or an entry
/// ending in `/` that it lies under.
pub(crate) fn listed(entries: &[String], path: &str) -> bool {
    if path.ends_with('/') || components(path).is_none() {
        return false;
    }
    entries.iter().any(|entry| {
        if entry.ends_with('/') {
            under(path, entry) && path.len() > entry.len()
        } else {
            components(entry).is_some() && entry == path
        }
    })
}

impl NodeTrust {
    fn command_allowed(&self, program: &str) -> bool {
        listed(&self.commands, program)
    }

    fn unit_allowed(&self, unit: &str) -> bool {
        self.repair_units.iter().any(|u| match u.strip_suffix('*') {
            Some(prefix) => unit.starts_with(prefix),
            None => u == unit,
        })
    }

    fn readable(&self, path: &str) -> bool {
        self.read_paths.iter().any(|root| under(path, root))
    }

    fn check_command(&self, command: &[String], field: &str) -> Option<(String, String, Setting)> {
        let program = command.first().map(String::as_str).unwrap_or("");
        if self.command_allowed(program) {
            return None;
        }
        let asks = if program.starts_with('/') {
            format!("runs {program}")
        } else {
            format!("runs {program:?}, which is not an absolute path")
        };
        Some((format!("{field}[0]"), asks, Setting::Commands))
    }

    /// Whether a probe may run here.
    pub fn check_probe(&self, probe: &ProbeSpec, at: &str) -> Option<(String, String, Setting)> {
        let exec = probe.exec.as_ref()?;
        self.check_command(&exec.command, &format!("{at}.exec.command"))
    }

    /// Whether a monitor may run here: the first request it makes that the
    /// node does not allow.
    pub fn check_monitor(&self, m: &MonitorSpec, at: &str) -> Option<(String, String, Setting)> {
        let src = &m.source;
        let read = |path: &str, field: String| {
            (!self.readable(path)).then(|| (field, format!("reads {path}"), Setting::ReadPaths))
        };
        // One source: validation refuses none and several, so a monitor
        // that runs has one.
        match src.one()? {
            Source::Kmsg(k) => read(&k.path, format!("{at}.source.kmsg.path")),
            Source::File(f) => read(&f.path, format!("{at}.source.file.path")),
            Source::Journald(j) => match &j.directory {
                Some(d) => read(d, format!("{at}.source.journald.directory")),
                None => LOCAL_JOURNAL
                    .iter()
                    .find_map(|d| read(d, format!("{at}.source.journald"))),
            },
            Source::Systemd(s) => (s.repair.is_some() && !self.unit_allowed(&s.unit)).then(|| {
                (
                    format!("{at}.source.systemd.repair"),
                    format!("repairs {} (kills its main process)", s.unit),
                    Setting::RepairUnits,
                )
            }),
            Source::Plugin(_) => m.rules.iter().enumerate().find_map(|(i, r)| {
                self.check_command(&r.command, &format!("{at}.rules[{i}].command"))
            }),
        }
    }

    /// Whether a shutdown section may be put in force here (its inhibit
    /// delay; the drop-in is [`NodeTrust::check_drop_in`]'s).
    pub fn check_shutdown(&self, s: &ShutdownSpec, at: &str) -> Option<(String, String, Setting)> {
        let delay = s.inhibit_delay_seconds();
        if delay > self.max_inhibit_delay_seconds {
            return Some((
                at.to_string(),
                format!(
                    "asks logind to hold the shutdown for {delay} s (its windows plus the safety margin), more than the {} s allowed",
                    self.max_inhibit_delay_seconds
                ),
                Setting::MaxInhibitDelay,
            ));
        }
        None
    }

    /// Whether the shutdown section's logind drop-in may be written here.
    pub fn check_drop_in(&self, s: &ShutdownSpec, at: &str) -> Option<(String, String, Setting)> {
        let dir = &s.logind_drop_in_dir;
        if !dir.is_empty() && !self.logind_drop_in_dirs.iter().any(|r| under(dir, r)) {
            return Some((
                format!("{at}.logindDropInDir"),
                format!("writes logind's configuration into {dir}"),
                Setting::LogindDropInDirs,
            ));
        }
        None
    }

    /// Whether a watchdog section may be put in force here.
    pub fn check_watchdog(&self, w: &WatchdogSpec, at: &str) -> Option<(String, String, Setting)> {
        if !w.mode.device() || listed(&self.watchdog_devices, &w.device) {
            return None;
        }
        Some((
            format!("{at}.device"),
            format!("pets the device {}", w.device),
            Setting::WatchdogDevices,
        ))
    }

    /// Every item of `policy` this node does not allow, in spec order.
    pub fn refusals(&self, policy: &super::NodeGuardPolicy) -> Vec<Refusal> {
        let name = policy.metadata.name.clone().unwrap_or_default();
        let spec = &policy.spec;
        let mut out = Vec::new();
        let mut push = |found: Option<(String, String, Setting)>, item: Item, dropped: String| {
            if let Some((field, asks, setting)) = found {
                out.push(Refusal {
                    policy: name.clone(),
                    item,
                    field,
                    asks: clip(&asks),
                    setting,
                    dropped,
                });
            }
        };
        for (i, p) in spec.probes.iter().enumerate() {
            let found = self.check_probe(p, &format!("spec.probes[{i}]"));
            push(found, Item::Probe(i), format!("probe {}", p.name));
        }
        for (i, m) in spec.monitors.iter().enumerate() {
            let found = self.check_monitor(m, &format!("spec.monitors[{i}]"));
            push(found, Item::Monitor(i), format!("monitor {}", m.name));
        }
        if let Some(sd) = &spec.shutdown {
            let found = self.check_shutdown(sd, "spec.shutdown");
            let whole = found.is_some();
            push(found, Item::Shutdown, "shutdown section".into());
            if !whole {
                let found = self.check_drop_in(sd, "spec.shutdown");
                push(
                    found,
                    Item::ShutdownDropIn,
                    "logind drop-in (the shutdown section applies with logind's own InhibitDelayMaxSec)".into(),
                );
            }
        }
        if let Some(w) = &spec.watchdog {
            let found = self.check_watchdog(w, "spec.watchdog");
            push(found, Item::Watchdog, "watchdog section".into());
        }
        out
    }

    /// One line for the agent's start-up log.
    pub fn describe(&self) -> String {
        let list = |v: &[String]| {
            if v.is_empty() {
                "none".to_string()
            } else {
                v.join(", ")
            }
        };
        format!(
            "commands: {}; repair units: {}; read paths: {}; watchdog devices: {}; logind drop-in dirs: {}; max inhibit delay: {} s",
            list(&self.commands),
            list(&self.repair_units),
            list(&self.read_paths),
            list(&self.watchdog_devices),
            list(&self.logind_drop_in_dirs),
            self.max_inhibit_delay_seconds
        )
    }

    /// Settings that allow everything of their kind, for a start-up warning.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        let all = |v: &[String]| v.iter().any(|p| p.trim_end_matches('/').is_empty());
        if all(&self.commands) {
            out.push("--allow-command allows every executable on the node".to_string());
        }
        if all(&self.read_paths) {
            out.push("--allow-read-path allows reading every file into Events".to_string());
        }
        if all(&self.watchdog_devices) || self.watchdog_devices.iter().any(|d| d == "/dev/") {
            out.push("--allow-watchdog-device allows writing to every device".to_string());
        }
        if all(&self.logind_drop_in_dirs) {
            out.push("--allow-logind-drop-in-dir allows writing a file anywhere".to_string());
        }
        if self.repair_units.iter().any(|u| u == "*") {
            out.push("--allow-repair-unit allows killing every unit".to_string());
        }
        out
    }

    /// Problems with the settings themselves (relative or non-normal paths),
    /// for the agent to refuse at start.
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut paths = |setting: Setting, v: &[String]| {
            for p in v {
                if components(p).is_none() {
                    out.push(format!(
                        "{} {p:?}: use an absolute path without '.', '..' or '//'",
                        setting.flag()
                    ));
                }
            }
        };
        paths(Setting::Commands, &self.commands);
        paths(Setting::ReadPaths, &self.read_paths);
        paths(Setting::WatchdogDevices, &self.watchdog_devices);
        paths(Setting::LogindDropInDirs, &self.logind_drop_in_dirs);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::defaults::default_policy;
    use serde_json::json;

    fn probe(v: serde_json::Value) -> ProbeSpec {
        serde_json::from_value(v).unwrap()
    }
    fn monitor(v: serde_json::Value) -> MonitorSpec {
        serde_json::from_value(v).unwrap()
    }
    fn trust() -> NodeTrust {
        NodeTrust {
            commands: vec![
                "/usr/local/lib/nodeguard/plugins/".into(),
                "/usr/bin/check-disk".into(),
            ],
            repair_units: vec!["containerd.service".into(), "kube*".into()],
            read_paths: vec!["/var/log".into(), "/run/log".into(), "/dev/kmsg".into()],
            ..NodeTrust::default()
        }
    }
    fn exec(cmd: &[&str]) -> Option<Setting> {
        let p = probe(json!({"name": "p", "exec": {"command": cmd}, "conditionType": "X"}));
        trust().check_probe(&p, "spec.probes[0]").map(|r| r.2)
    }

    #[test]
    fn under_is_component_wise_and_refuses_dot_dot() {
        let cases = [
            ("/var/log", "/var/log", true),
            ("/var/log/syslog", "/var/log", true),
            ("/var/log/", "/var/log", true),
            ("/var/logx", "/var/log", false),
            ("/var/log/../../etc/shadow", "/var/log", false),
            ("/var/log/./syslog", "/var/log", false),
            ("/var//log/syslog", "/var/log", false),
            ("var/log/syslog", "/var/log", false),
            ("/etc/shadow", "/", true),
            ("/var", "/var/log", false),
        ];
        for (path, root, want) in cases {
            assert_eq!(under(path, root), want, "{path} under {root}");
        }
    }

    #[test]
    fn commands_must_be_listed_absolute_paths_or_under_a_listed_directory() {
        assert_eq!(exec(&["/usr/bin/check-disk", "--all"]), None);
        assert_eq!(exec(&["/usr/local/lib/nodeguard/plugins/ntp.sh"]), None);
        assert_eq!(exec(&["/usr/local/lib/nodeguard/plugins/sub/x"]), None);
        for refused in [
            &["/bin/sh", "-c", "true"][..],
            &["check-disk"],
            &["/usr/bin/check-disk2"],
            &["/usr/local/lib/nodeguard/plugins/../../../../bin/sh"],
            &["/usr/local/lib/nodeguard/plugins/"],
            &["/usr/local/lib/nodeguard/plugins"],
            &[],
        ] {
            assert_eq!(exec(refused), Some(Setting::Commands), "{refused:?}");
        }
        // Not exec: nothing to allow.
        let http = probe(
            json!({"name": "h", "http": {"url": "http://127.0.0.1:1/"}, "conditionType": "X"}),
        );
        assert_eq!(NodeTrust::default().check_probe(&http, "p"), None);
    }

    #[test]
    fn a_refused_command_names_the_field_and_what_it_runs() {
        let p = probe(
            json!({"name": "p", "exec": {"command": ["sh", "-c", "id"]}, "conditionType": "X"}),
        );
        let (field, asks, setting) = trust().check_probe(&p, "spec.probes[3]").unwrap();
        assert_eq!(field, "spec.probes[3].exec.command[0]");
        assert_eq!(asks, "runs \"sh\", which is not an absolute path");
        assert_eq!(setting.flag(), "--allow-command");
    }

    #[test]
    fn monitors_read_only_under_the_roots_and_repair_only_listed_units() {
        let t = trust();
        let check = |v| t.check_monitor(&monitor(v), "m").map(|r| (r.0, r.2));
        let src = |s: serde_json::Value| json!({"name": "m", "source": s, "rules": []});
        assert_eq!(
            check(src(json!({"file": {"path": "/var/log/syslog"}}))),
            None
        );
        assert_eq!(
            check(src(json!({"file": {"path": "/etc/shadow"}}))),
            Some(("m.source.file.path".into(), Setting::ReadPaths))
        );
        assert_eq!(check(src(json!({"kmsg": {}}))), None);
        assert_eq!(
            check(src(json!({"kmsg": {"path": "/dev/mem"}}))),
            Some(("m.source.kmsg.path".into(), Setting::ReadPaths))
        );
        assert_eq!(
            check(src(json!({"journald": {}}))),
            None,
            "the local journal (/var/log/journal, /run/log/journal) under /var/log and /run/log"
        );
        let only_var = NodeTrust {
            read_paths: vec!["/var/log/journal".into()],
            ..NodeTrust::default()
        };
        assert_eq!(
            only_var
                .check_monitor(&monitor(src(json!({"journald": {}}))), "m")
                .map(|r| r.1),
            Some("reads /run/log/journal".into()),
            "journalctl without --directory reads the volatile journal too"
        );
        assert_eq!(
            check(src(json!({"journald": {"directory": "/home/x"}}))),
            Some(("m.source.journald.directory".into(), Setting::ReadPaths))
        );
        assert_eq!(
            check(src(
                json!({"systemd": {"unit": "containerd.service", "repair": {}}})
            )),
            None
        );
        assert_eq!(
            check(src(
                json!({"systemd": {"unit": "kubelet.service", "repair": {}}})
            )),
            None,
            "a prefix ending in *"
        );
        assert_eq!(
            check(src(
                json!({"systemd": {"unit": "sshd.service", "repair": {}}})
            )),
            Some(("m.source.systemd.repair".into(), Setting::RepairUnits))
        );
        assert_eq!(
            check(src(json!({"systemd": {"unit": "sshd.service"}}))),
            None,
            "health only: no repair, nothing to allow"
        );
        let plugin = json!({"name": "m", "source": {"plugin": {}}, "rules": [
            {"type": "temporary", "reason": "A", "command": ["/usr/bin/check-disk"]},
            {"type": "temporary", "reason": "B", "command": ["/tmp/x"]}]});
        assert_eq!(
            check(plugin),
            Some(("m.rules[1].command[0]".into(), Setting::Commands))
        );
    }

    #[test]
    fn shutdown_is_bounded_by_the_inhibit_delay_and_the_drop_in_directory() {
        let t = NodeTrust::default();
        let spec = |v| serde_json::from_value::<ShutdownSpec>(v).unwrap();
        let ok = spec(json!({"gracePeriodSeconds": 30, "criticalPodsGracePeriodSeconds": 10}));
        assert_eq!(ok.inhibit_delay_seconds(), 32);
        assert_eq!(t.check_shutdown(&ok, "spec.shutdown"), None);
        let long = spec(json!({"gracePeriodByPriority": [
            {"priority": 0, "gracePeriodSeconds": 20},
            {"priority": 1000, "gracePeriodSeconds": 11}], "safetyMarginSeconds": 2}));
        assert_eq!(long.inhibit_delay_seconds(), 33);
        let r = t.check_shutdown(&long, "spec.shutdown").unwrap();
        assert_eq!(
            (r.0.as_str(), r.2),
            ("spec.shutdown", Setting::MaxInhibitDelay)
        );
        assert!(r.1.contains("33 s") && r.1.contains("32 s"), "{}", r.1);
        let elsewhere = spec(json!({"gracePeriodSeconds": 10, "logindDropInDir": "/etc/cron.d"}));
        assert_eq!(t.check_shutdown(&elsewhere, "s"), None, "the delay is fine");
        assert_eq!(
            t.check_drop_in(&elsewhere, "s").map(|r| (r.0, r.2)),
            Some(("s.logindDropInDir".into(), Setting::LogindDropInDirs))
        );
        let never = spec(json!({"gracePeriodSeconds": 10, "logindDropInDir": ""}));
        assert_eq!(t.check_drop_in(&never, "s"), None, "never writes");
        // A refused drop-in leaves the section in force; a refused delay
        // refuses the section and says nothing more of it.
        let policy = |sd: ShutdownSpec| {
            let mut p = crate::policy::NodeGuardPolicy::new("p", Default::default());
            p.spec.shutdown = Some(sd);
            p
        };
        let items: Vec<Item> = t
            .refusals(&policy(elsewhere))
            .iter()
            .map(|r| r.item)
            .collect();
        assert_eq!(items, [Item::ShutdownDropIn]);
        let mut both = long.clone();
        both.logind_drop_in_dir = "/etc/cron.d".into();
        let items: Vec<Item> = t.refusals(&policy(both)).iter().map(|r| r.item).collect();
        assert_eq!(items, [Item::Shutdown]);
    }

    #[test]
    fn only_listed_watchdog_devices_are_petted() {
        let w = |v| serde_json::from_value::<WatchdogSpec>(v).unwrap();
        assert_eq!(
            NodeTrust::default()
                .check_watchdog(&w(json!({"mode": "Device"})), "w")
                .map(|r| r.2),
            Some(Setting::WatchdogDevices),
            "the default policy pets no device, so the default allows none"
        );
        let t = NodeTrust {
            watchdog_devices: vec!["/dev/watchdog".into()],
            ..NodeTrust::default()
        };
        assert_eq!(t.check_watchdog(&w(json!({"mode": "Device"})), "w"), None);
        assert_eq!(
            t.check_watchdog(&w(json!({"mode": "Both", "device": "/dev/sda"})), "w")
                .map(|r| (r.0, r.2)),
            Some(("w.device".into(), Setting::WatchdogDevices))
        );
        assert_eq!(
            t.check_watchdog(&w(json!({"mode": "Systemd", "device": "/dev/sda"})), "w"),
            None,
            "no device petted"
        );
    }

    #[test]
    fn the_default_trust_allows_the_shipped_default_policy_and_nothing_more() {
        let t = NodeTrust::default();
        let p = default_policy();
        for (i, m) in p.spec.monitors.iter().enumerate() {
            assert_eq!(t.check_monitor(m, &format!("m{i}")), None, "{}", m.name);
        }
        for (i, probe) in p.spec.probes.iter().enumerate() {
            assert_eq!(t.check_probe(probe, &format!("p{i}")), None);
        }
        let s = p.spec.shutdown.as_ref().unwrap();
        assert_eq!(t.check_shutdown(s, "s"), None);
        // Tight: the delay is exactly what the default asks for; no
        // commands, no repairs.
        assert_eq!(s.inhibit_delay_seconds(), t.max_inhibit_delay_seconds);
        assert!(t.commands.is_empty() && t.repair_units.is_empty());
        assert!(t.problems().is_empty());
    }

    #[test]
    fn a_long_request_is_clipped_and_catch_all_settings_are_warned_about() {
        let long = format!("/usr/{}", "x".repeat(5000));
        let p = probe(json!({"name": "p", "exec": {"command": [long]}, "conditionType": "X"}));
        let mut policy = crate::policy::NodeGuardPolicy::new("p", Default::default());
        policy.spec.probes = vec![p];
        let r = &NodeTrust::default().refusals(&policy)[0];
        assert!(r.to_string().len() < 1000, "{}", r.to_string().len());
        assert!(r.asks.ends_with('…'));
        // Bytes, not characters: an Event note is limited to 1 KiB.
        let wide_chars = format!("/usr/{}", "語".repeat(2000));
        let mut policy = crate::policy::NodeGuardPolicy::new("p", Default::default());
        policy.spec.probes = vec![probe(
            json!({"name": "p", "exec": {"command": [wide_chars]}, "conditionType": "X"}),
        )];
        let r = &NodeTrust::default().refusals(&policy)[0];
        assert!(r.to_string().len() < 1000, "{}", r.to_string().len());
        assert!(NodeTrust::default().warnings().is_empty());
        let wide = NodeTrust {
            commands: vec!["/".into()],
            repair_units: vec!["*".into()],
            watchdog_devices: vec!["/dev/".into()],
            ..NodeTrust::default()
        };
        assert_eq!(wide.warnings().len(), 3, "{:?}", wide.warnings());
    }

    #[test]
    fn settings_with_relative_or_dotted_paths_are_problems() {
        let t = NodeTrust {
            commands: vec!["plugins/".into()],
            read_paths: vec!["/var/log/..".into()],
            ..NodeTrust::default()
        };
        let p = t.problems();
        assert_eq!(p.len(), 2, "{p:?}");
        assert!(p[0].starts_with("--allow-command \"plugins/\""), "{}", p[0]);
    }
}
