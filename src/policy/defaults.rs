//! The default policy shipped with the chart: node-problem-detector's
//! standard monitors and conditions, kubelet and kube-proxy health probes,
//! graceful shutdown with common kubelet settings, the watchdog off.

use super::monitors::{
    ConditionSpec, CountSpec, JournaldSource, KmsgSource, LogSource, MonitorSpec, ProblemKind,
    RuleSpec, default_kmsg,
};
use super::probes::ProbeSpec;
use super::{NodeGuardPolicy, NodeGuardPolicySpec, ShutdownSpec};

fn journald(identifier: &str) -> LogSource {
    LogSource {
        kmsg: None,
        file: None,
        journald: Some(JournaldSource {
            directory: Some("/var/log/journal".into()),
            unit: None,
            identifier: Some(identifier.into()),
        }),
        plugin: None,
        systemd: None,
    }
}

fn condition(type_: &str, reason: &str, message: &str, clear_after: Option<u32>) -> ConditionSpec {
    ConditionSpec {
        type_: type_.into(),
        reason: reason.into(),
        message: message.into(),
        clear_after_seconds: clear_after,
        clear_pattern: None,
        taint: None,
    }
}

fn rule(kind: ProblemKind, condition: Option<&str>, reason: &str, pattern: &str) -> RuleSpec {
    RuleSpec {
        kind,
        condition: condition.map(str::to_string),
        reason: reason.into(),
        pattern: pattern.into(),
        command: Vec::new(),
        timeout_seconds: None,
        message: None,
        count: None,
    }
}

/// NPD's systemd-monitor-counter, natively: 5 starts in 20 minutes, each
/// clean stop taking one off (log-counter's `--revert-pattern`), so an
/// operator's restarts are not counted as crashes.
fn restart_counter() -> MonitorSpec {
    let counted = |c: &str, start: &str, stop: &str| RuleSpec {
        count: Some(CountSpec {
            revert_pattern: Some(stop.into()),
            threshold: 5,
            window_seconds: 1200,
        }),
        ..rule(ProblemKind::Permanent, Some(c), c, start)
    };
    MonitorSpec {
        // NPD's source for the same monitor (systemd-monitor-counter.json):
        // Events are routed as NPD's were.
        event_source: Some("systemd-monitor".into()),
        npd_matching: None,
        name: "systemd-restarts".into(),
        source: journald("systemd"),
        conditions: vec![
            condition(
                "FrequentKubeletRestart",
                "NoFrequentKubeletRestart",
                "kubelet is functioning properly",
                Some(1200),
            ),
            condition(
                "FrequentDockerRestart",
                "NoFrequentDockerRestart",
                "docker is functioning properly",
                Some(1200),
            ),
            condition(
                "FrequentContainerdRestart",
                "NoFrequentContainerdRestart",
                "containerd is functioning properly",
                Some(1200),
            ),
        ],
        // systemd before v247 writes the unit's description ("Starting
        // Docker Application Container Engine..."); since, the unit's name
        // first ("Starting containerd.service - containerd container
        // runtime...", Debian 12 on the real node); a unit without a
        // description, only its name. Each pattern takes all three.
        rules: vec![
            counted(
                "FrequentKubeletRestart",
                r"Started (Kubernetes kubelet|kubelet\.service)",
                r"Stopping (Kubernetes kubelet|kubelet\.service)",
            ),
            counted(
                "FrequentDockerRestart",
                r"Starting (Docker Application Container Engine|docker\.service)",
                r"Stopping (Docker Application Container Engine|docker\.service)",
            ),
            counted(
                "FrequentContainerdRestart",
                r"Starting (containerd container runtime|containerd\.service)",
                r"Stopping (containerd container runtime|containerd\.service)",
            ),
        ],
    }
}

/// NPD's docker-monitor.
fn docker_monitor() -> MonitorSpec {
    MonitorSpec {
        event_source: Some("docker-monitor".into()),
        npd_matching: None,
        name: "docker".into(),
        source: journald("dockerd"),
        conditions: vec![condition(
            "CorruptDockerOverlay2",
            "NoCorruptDockerOverlay2",
            "docker overlay2 is functioning properly",
            None,
        )],
        rules: vec![
            rule(
                ProblemKind::Temporary,
                None,
                "CorruptDockerImage",
                r"Error trying v2 registry: failed to register layer: rename /var/lib/docker/image/(.+) /var/lib/docker/image/(.+): directory not empty.*",
            ),
            rule(
                ProblemKind::Permanent,
                Some("CorruptDockerOverlay2"),
                "CorruptDockerOverlay2",
                r"returned error: readlink /var/lib/docker/overlay2.*: invalid argument.*",
            ),
            rule(
                ProblemKind::Temporary,
                None,
                "DockerContainerStartupFailure",
                r"OCI runtime start failed: container process is already dead: unknown",
            ),
        ],
    }
}

fn probe(name: &str, url: &str, condition_type: &str) -> ProbeSpec {
    serde_json::from_value(serde_json::json!({
        "name": name, "http": {"url": url}, "conditionType": condition_type,
        "periodSeconds": 10, "failureThreshold": 3,
    }))
    .expect("a valid probe")
}

/// The default policy's spec.
pub fn default_spec() -> NodeGuardPolicySpec {
    NodeGuardPolicySpec {
        probes: vec![
            probe(
                "kubelet",
                "http://127.0.0.1:10248/healthz",
                "KubeletUnhealthy",
            ),
            probe(
                "kube-proxy",
                "http://127.0.0.1:10256/healthz",
                "KubeProxyUnhealthy",
            ),
        ],
        monitors: vec![
            default_kernel_monitor(),
            restart_counter(),
            docker_monitor(),
        ],
        shutdown: Some(ShutdownSpec {
            grace_period_seconds: Some(30),
            critical_pods_grace_period_seconds: Some(10),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The default policy, named `default`.
pub fn default_policy() -> NodeGuardPolicy {
    NodeGuardPolicy::new("default", default_spec())
}

/// The kernel monitor shipped as the default: node-problem-detector's
/// kernel-monitor conditions and reasons, with quiet-period clearing.
pub fn default_kernel_monitor() -> MonitorSpec {
    let temp = |reason: &str, pattern: &str| RuleSpec {
        kind: ProblemKind::Temporary,
        condition: None,
        reason: reason.into(),
        pattern: pattern.into(),
        command: Vec::new(),
        timeout_seconds: None,
        message: None,
        count: None,
    };
    let perm = |condition: &str, reason: &str, pattern: &str| RuleSpec {
        kind: ProblemKind::Permanent,
        condition: Some(condition.into()),
        reason: reason.into(),
        pattern: pattern.into(),
        command: Vec::new(),
        timeout_seconds: None,
        message: None,
        count: None,
    };
    MonitorSpec {
        // NPD's kernel-monitor's source (its readonly-monitor's conditions,
        // held here too, say readonly-monitor in NPD).
        event_source: Some("kernel-monitor".into()),
        npd_matching: None,
        name: "kernel".into(),
        source: LogSource {
            kmsg: Some(KmsgSource {
                path: default_kmsg(),
            }),
            file: None,
            journald: None,
            plugin: None,
            systemd: None,
        },
        conditions: vec![
            ConditionSpec {
                type_: "KernelDeadlock".into(),
                reason: "KernelHasNoDeadlock".into(),
                message: "kernel has no deadlock".into(),
                clear_after_seconds: Some(3600),
                clear_pattern: None,
                taint: None,
            },
            ConditionSpec {
                type_: "ReadonlyFilesystem".into(),
                reason: "FilesystemIsNotReadOnly".into(),
                message: "Filesystem is not read-only".into(),
                clear_after_seconds: None,
                clear_pattern: None,
                taint: None,
            },
            // A shut-down XFS stays down until it is unmounted and repaired
            // (or the node reboots, which resets the condition).
            ConditionSpec {
                type_: "XfsShutdown".into(),
                reason: "XfsHasNotShutDown".into(),
                message: "XFS has not shutdown".into(),
                clear_after_seconds: None,
                clear_pattern: None,
                taint: None,
            },
            ConditionSpec {
                type_: "CperHardwareErrorFatal".into(),
                reason: "CperHardwareHasNoFatalError".into(),
                message: "UEFI CPER has no fatal error".into(),
                clear_after_seconds: None,
                clear_pattern: None,
                taint: None,
            },
            // NPD's kernel-monitor-counter: unregister_netdevice hangs three
            // times in 20 minutes; clears after 20 minutes without one.
            ConditionSpec {
                type_: "FrequentUnregisterNetDevice".into(),
                reason: "NoFrequentUnregisterNetDevice".into(),
                message: "node is functioning properly".into(),
                clear_after_seconds: Some(1200),
                clear_pattern: None,
                taint: None,
            },
        ],
        rules: vec![
            temp(
                "OOMKilling",
                r"Killed process \d+ (.+) total-vm:\d+kB, anon-rss:\d+kB, file-rss:\d+kB.*",
            ),
            temp(
                "TaskHung",
                r"task [\S ]+:\w+ blocked for more than \w+ seconds\.",
            ),
            temp(
                "UnregisterNetDevice",
                r"unregister_netdevice: waiting for \w+ to become free. Usage count = \d+",
            ),
            RuleSpec {
                count: Some(CountSpec {
                    revert_pattern: None,
                    threshold: 3,
                    window_seconds: 1200,
                }),
                ..perm(
                    "FrequentUnregisterNetDevice",
                    "UnregisterNetDevice",
                    r"unregister_netdevice: waiting for \w+ to become free. Usage count = \d+",
                )
            },
            temp(
                "KernelOops",
                r"BUG: unable to handle kernel NULL pointer dereference at .*",
            ),
            temp("KernelOops", r"divide error: 0000 \[#\d+\] SMP"),
            temp("Ext4Error", r"EXT4-fs error .*"),
            temp("Ext4Warning", r"EXT4-fs warning .*"),
            temp("IOError", r"Buffer I/O error .*"),
            temp("MemoryReadError", r"CE memory read error .*"),
            perm(
                "XfsShutdown",
                "XfsHasShutdown",
                r"XFS .* Shutting down filesystem",
            ),
            // UEFI CPER records end with their severity (NPD trims and
            // anchors; kmsg may carry trailing blanks).
            temp(
                "CperHardwareErrorCorrected",
                r"\[Hardware Error\]: event severity: corrected\s*$",
            ),
            temp(
                "CperHardwareErrorRecoverable",
                r"\[Hardware Error\]: event severity: recoverable\s*$",
            ),
            perm(
                "CperHardwareErrorFatal",
                "CperHardwareErrorFatal",
                r"\[Hardware Error\]: event severity: fatal\s*$",
            ),
            temp(
                "XfsError",
                r"XFS \(\S+\): (Corruption|metadata I/O error|Filesystem has been shut down).*",
            ),
            temp(
                "SoftLockup",
                r"watchdog: BUG: soft lockup - CPU#\d+ stuck for \d+s!.*",
            ),
            temp(
                "NICTransmitTimeout",
                r"NETDEV WATCHDOG: \S+ \(\S+\): transmit queue \d+ timed out.*",
            ),
            temp("GPUXidError", r"NVRM: Xid \(.*\): \d+,.*"),
            perm(
                "KernelDeadlock",
                "AUFSUmountHung",
                r"task umount\.aufs:\w+ blocked for more than \w+ seconds\.",
            ),
            perm(
                "KernelDeadlock",
                "DockerHung",
                r"task docker:\w+ blocked for more than \w+ seconds\.",
            ),
            perm(
                "ReadonlyFilesystem",
                "FilesystemIsReadOnly",
                r"Remounting filesystem read-only",
            ),
        ],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_policy_is_valid_and_covers_npds_standard_conditions() {
        let p = default_policy();
        assert_eq!(crate::policy::validate(&p), vec![]);
        let types: Vec<&str> = p
            .spec
            .monitors
            .iter()
            .flat_map(|m| m.conditions.iter().map(|c| c.type_.as_str()))
            .collect();
        for want in [
            "KernelDeadlock",
            "ReadonlyFilesystem",
            "FrequentKubeletRestart",
            "FrequentDockerRestart",
            "FrequentContainerdRestart",
            "CorruptDockerOverlay2",
            "XfsShutdown",
            "CperHardwareErrorFatal",
            "FrequentUnregisterNetDevice",
        ] {
            assert!(types.contains(&want), "{want} missing from {types:?}");
        }
        assert!(p.spec.watchdog.is_none(), "watchdog off by default");
    }

    /// The systemd-restarts rules against what systemd writes for a start,
    /// before v247 (NPD's patterns were written for it) and since (the
    /// unit's name first; Debian 12's systemd 252 on the real node).
    #[test]
    fn restart_rules_match_old_and_new_systemd_start_lines() {
        let spec = default_spec();
        let m = spec
            .monitors
            .iter()
            .find(|m| m.name == "systemd-restarts")
            .unwrap();
        let (patterns, _) = m.compile_patterns("spec.monitors[1]").unwrap();
        let rule_of = |line: &str| -> Vec<String> {
            patterns
                .matches(line)
                .into_iter()
                .map(|i| m.rules[i].reason.clone())
                .collect()
        };
        for (line, reason) in [
            ("Started Kubernetes kubelet.", "FrequentKubeletRestart"),
            (
                "Started kubelet.service - Kubernetes kubelet.",
                "FrequentKubeletRestart",
            ),
            (
                "Starting Docker Application Container Engine...",
                "FrequentDockerRestart",
            ),
            (
                "Starting docker.service - Docker Application Container Engine...",
                "FrequentDockerRestart",
            ),
            (
                "Starting containerd container runtime...",
                "FrequentContainerdRestart",
            ),
            (
                "Starting containerd.service - containerd container runtime...",
                "FrequentContainerdRestart",
            ),
        ] {
            assert_eq!(rule_of(line), [reason], "{line}");
        }
        assert!(rule_of("Stopped containerd.service - containerd container runtime.").is_empty());
    }
}
