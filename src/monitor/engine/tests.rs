use super::*;
use crate::policy::defaults::default_kernel_monitor;
use crate::policy::monitors::{ConditionSpec, CountSpec, RuleSpec, TaintSpec};

fn t(s: i64) -> Timestamp {
    Timestamp::from_second(1_800_000_000 + s).unwrap()
}

fn events(actions: &[Action]) -> Vec<&str> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Event { reason, .. } => Some(reason.as_str()),
            _ => None,
        })
        .collect()
}

/// Real-world kernel lines (from public bug reports and our own hosts) with
/// the Events each must produce under the default rules (comma-separated);
/// `""` marks noise that must produce nothing.
const CORPUS: &[(&str, &str)] = &[
    (
        "Out of memory: Killed process 12345 (java) total-vm:9823012kB, anon-rss:7340032kB, file-rss:0kB, shmem-rss:0kB, UID:1000 pgtables:15000kB oom_score_adj:0",
        "OOMKilling",
    ),
    (
        "Memory cgroup out of memory: Killed process 4242 (python3) total-vm:1048576kB, anon-rss:524288kB, file-rss:2048kB, shmem-rss:0kB",
        "OOMKilling",
    ),
    (
        "INFO: task kworker/u8:2:1234 blocked for more than 120 seconds.",
        "TaskHung",
    ),
    (
        "INFO: task jbd2/sda1-8:245 blocked for more than 122 seconds.",
        "TaskHung",
    ),
    (
        // Like NPD: a hung docker task is both a TaskHung event and DockerHung.
        "INFO: task docker:20744 blocked for more than 120 seconds.",
        "TaskHung,DockerHung",
    ),
    (
        "INFO: task umount.aufs:21568 blocked for more than 120 seconds.",
        "TaskHung,AUFSUmountHung",
    ),
    (
        "watchdog: BUG: soft lockup - CPU#3 stuck for 23s! [kworker/3:1:123]",
        "SoftLockup",
    ),
    (
        "EXT4-fs error (device sda1): ext4_find_entry:1455: inode #2: comm ls: reading directory lblock 0",
        "Ext4Error",
    ),
    (
        "EXT4-fs warning (device sdb1): ext4_dx_add_entry:2331: Directory (ino: 1234) index full, reach max htree level :2",
        "Ext4Warning",
    ),
    (
        "EXT4-fs (sda1): Remounting filesystem read-only",
        "FilesystemIsReadOnly",
    ),
    (
        "XFS (nvme0n1p1): metadata I/O error in \"xfs_trans_read_buf_map\" at daddr 0x1 len 1 error 5",
        "XfsError",
    ),
    (
        "XFS (dm-0): Corruption detected. Unmount and run xfs_repair",
        "XfsError",
    ),
    (
        "unregister_netdevice: waiting for eth0 to become free. Usage count = 1",
        "UnregisterNetDevice",
    ),
    (
        "NETDEV WATCHDOG: eth0 (ixgbe): transmit queue 2 timed out 5100 ms",
        "NICTransmitTimeout",
    ),
    (
        "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.",
        "GPUXidError",
    ),
    (
        "BUG: unable to handle kernel NULL pointer dereference at 0000000000000008",
        "KernelOops",
    ),
    ("divide error: 0000 [#1] SMP PTI", "KernelOops"),
    (
        "Buffer I/O error on dev sdb, logical block 0, async page read",
        "IOError",
    ),
    // Noise.
    (
        "IPv6: ADDRCONF(NETDEV_CHANGE): eth0: link becomes ready",
        "",
    ),
    (
        "EXT4-fs (sda1): mounted filesystem with ordered data mode. Opts: (null)",
        "",
    ),
    (
        "audit: type=1400 audit(1700000000.000:2): apparmor=\"STATUS\" operation=\"profile_load\"",
        "",
    ),
    (
        "oom_reaper: reaped process 12345 (java), now anon-rss:0kB, file-rss:0kB, shmem-rss:0kB",
        "",
    ),
    ("INFO: task hung detection disabled", ""),
    (
        "ixgbe 0000:01:00.0 eth0: NIC Link is Up 10 Gbps, Flow Control: RX/TX",
        "",
    ),
    ("XFS (sda1): Mounting V5 Filesystem", ""),
    ("", ""),
];

#[test]
fn the_default_rules_over_a_real_world_corpus() {
    let spec = default_kernel_monitor();
    let mut e = Engine::new(&spec, "spec.monitors[0]").unwrap();
    e.current(t(0));
    for (i, (line, want)) in CORPUS.iter().enumerate() {
        let actions = e.on_line(line, t(i as i64));
        let got = events(&actions);
        if want.is_empty() {
            assert!(
                actions.is_empty(),
                "noise produced {actions:?} for {line:?}"
            );
        } else {
            let want: Vec<&str> = want.split(',').collect();
            assert_eq!(got, want, "for {line:?}: {actions:?}");
        }
    }
    // The permanent ones set their conditions.
    let s = e.state();
    assert!(s["KernelDeadlock"].active);
    assert_eq!(
        s["KernelDeadlock"].reason, "AUFSUmountHung",
        "the latest reason"
    );
    assert!(s["ReadonlyFilesystem"].active);
}

fn monitor() -> MonitorSpec {
    MonitorSpec {
        event_source: None,
        npd_matching: None,
        name: "m".into(),
        source: crate::policy::monitors::LogSource {
            kmsg: None,
            file: Some(crate::policy::monitors::FileSource { path: "/x".into() }),
            journald: None,
            plugin: None,
            systemd: None,
        },
        conditions: vec![ConditionSpec {
            type_: "AppBroken".into(),
            reason: "AppIsFine".into(),
            message: "app is fine".into(),
            clear_after_seconds: Some(60),
            clear_pattern: Some(r"app recovered".into()),
            taint: Some(TaintSpec {
                key: "example.com/app-broken".into(),
                value: Some("true".into()),
                effect: "NoSchedule".into(),
            }),
        }],
        rules: vec![
            RuleSpec {
                kind: ProblemKind::Permanent,
                condition: Some("AppBroken".into()),
                reason: "AppCrashed".into(),
                pattern: r"app crashed: (?P<why>.+)".into(),
                command: Vec::new(),
                timeout_seconds: None,
                message: Some("The app crashed (${why}).".into()),
                count: None,
            },
            RuleSpec {
                kind: ProblemKind::Temporary,
                condition: None,
                reason: "FrequentRestarts".into(),
                pattern: r"app restarted".into(),
                command: Vec::new(),
                timeout_seconds: None,
                message: None,
                count: Some(CountSpec {
                    revert_pattern: None,
                    threshold: 3,
                    window_seconds: 60,
                }),
            },
        ],
    }
}

#[test]
fn permanent_rules_set_captures_taint_and_clear_by_pattern() {
    let mut e = Engine::new(&monitor(), "m").unwrap();
    let initial = e.current(t(0));
    assert_eq!(
        initial,
        vec![Action::Condition {
            type_: "AppBroken".into(),
            active: false,
            reason: "AppIsFine".into(),
            message: "app is fine".into()
        }]
    );
    let a = e.on_line("app crashed: disk full", t(1));
    assert!(a.contains(&Action::Condition {
        type_: "AppBroken".into(),
        active: true,
        reason: "AppCrashed".into(),
        message: "The app crashed (disk full).".into()
    }));
    assert!(a.contains(&Action::Taint {
        condition: "AppBroken".into(),
        key: "example.com/app-broken".into(),
        value: "true".into(),
        effect: "NoSchedule".into(),
        add: true
    }));
    e.taint_result("AppBroken", TaintOutcome::Added);
    // A repeat changes nothing visible.
    assert!(e.on_line("app crashed: disk full", t(2)).is_empty());
    let a = e.on_line("app recovered", t(3));
    assert!(
        matches!(&a[0], Action::Condition { active: false, reason, .. } if reason == "AppIsFine")
    );
    assert!(
        a.iter()
            .any(|x| matches!(x, Action::Taint { add: false, .. }))
    );
    assert!(e.on_line("app recovered", t(4)).is_empty(), "already clear");
}

#[test]
fn quiet_period_clears_and_restarts_keep_state() {
    let mut e = Engine::new(&monitor(), "m").unwrap();
    e.current(t(0));
    e.on_line("app crashed: x", t(10));
    assert!(e.on_tick(t(69)).is_empty(), "not quiet long enough");
    e.on_line("app crashed: x", t(60)); // a new match extends it
    assert!(e.on_tick(t(119)).is_empty());
    let saved = e.state().clone();

    // A restarted agent restores the active condition and its taint.
    let mut e2 = Engine::new(&monitor(), "m").unwrap();
    e2.restore(saved);
    let again = e2.current(t(100));
    assert!(
        again
            .iter()
            .any(|a| matches!(a, Action::Condition { active: true, .. }))
    );
    assert!(
        again
            .iter()
            .any(|a| matches!(a, Action::Taint { add: true, .. }))
    );
    let cleared = e2.on_tick(t(120));
    assert!(
        matches!(&cleared[0], Action::Condition { active: false, message, .. } if message.contains("no matching line for 60s"))
    );

    // A cleared condition is not resurrected by a restart.
    let saved = e2.state().clone();
    let mut e3 = Engine::new(&monitor(), "m").unwrap();
    e3.restore(saved);
    assert!(matches!(
        &e3.current(t(200))[0],
        Action::Condition { active: false, .. }
    ));
}

#[test]
fn counting_fires_at_the_threshold_within_the_window() {
    let mut e = Engine::new(&monitor(), "m").unwrap();
    assert!(e.on_line("app restarted", t(0)).is_empty());
    assert!(e.on_line("app restarted", t(30)).is_empty());
    assert!(
        e.on_line("app restarted", t(100)).is_empty(),
        "the first two fell out of the window"
    );
    assert!(e.on_line("app restarted", t(110)).is_empty());
    assert_eq!(
        events(&e.on_line("app restarted", t(120))),
        ["FrequentRestarts"]
    );
    assert!(
        e.on_line("app restarted", t(121)).is_empty(),
        "the count starts over"
    );
}

#[test]
fn bad_patterns_are_reported_with_their_paths() {
    let mut m = monitor();
    m.rules[0].pattern = "app crashed: (".into();
    m.conditions[0].clear_pattern = Some("[".into());
    let bad = Engine::new(&m, "spec.monitors[0]").unwrap_err();
    let paths: Vec<&str> = bad.iter().map(|b| b.path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "spec.monitors[0].rules[0].pattern",
            "spec.monitors[0].conditions[0].clearPattern"
        ]
    );
    assert!(bad[0].message.contains("invalid regular expression"));
}

#[test]
fn restore_ignores_conditions_no_longer_owned() {
    let mut e = Engine::new(&monitor(), "m").unwrap();
    let mut state = BTreeMap::new();
    state.insert(
        "Gone".to_string(),
        ConditionState {
            active: true,
            unknown: false,
            reason: "X".into(),
            message: "x".into(),
            since: t(0),
            last_match: None,
            taint_added: false,
            taint: None,
        },
    );
    e.restore(state);
    assert!(!e.state().contains_key("Gone"));
}

/// After a restart, the saved state is all that names the taints
/// nodeguard added: those the spec no longer has (condition gone, taint
/// changed) come back from `restore` to be removed; the same taint stays
/// owned; state saved before taints were recorded takes the spec's.
#[test]
fn restore_returns_the_owned_taints_the_spec_no_longer_has() {
    let owned = |key: &str| OwnedTaint {
        key: key.into(),
        effect: "NoSchedule".into(),
    };
    let saved = |taint: Option<OwnedTaint>| ConditionState {
        active: true,
        unknown: false,
        reason: "X".into(),
        message: "x".into(),
        since: t(0),
        last_match: None,
        taint_added: true,
        taint,
    };
    let spec_key = "example.com/app-broken";
    let cases: [(&str, Option<OwnedTaint>, Vec<OwnedTaint>, bool); 4] = [
        // The same taint: still owned, nothing to remove.
        ("AppBroken", Some(owned(spec_key)), vec![], true),
        // The condition's taint changed: the old one goes.
        (
            "AppBroken",
            Some(owned("example.com/old")),
            vec![owned("example.com/old")],
            false,
        ),
        // Saved by an older nodeguard: the spec's is taken as the one added.
        ("AppBroken", None, vec![], true),
        // The condition is gone from the spec: its taint goes.
        (
            "Gone",
            Some(owned("example.com/gone")),
            vec![owned("example.com/gone")],
            false,
        ),
    ];
    for (type_, taint, want, still_owned) in cases {
        let mut e = Engine::new(&monitor(), "m").unwrap();
        let stale = e.restore(BTreeMap::from([(type_.to_string(), saved(taint.clone()))]));
        assert_eq!(stale, want, "{type_} {taint:?}");
        if type_ == "AppBroken" {
            let s = &e.state()["AppBroken"];
            assert_eq!(s.taint_added, still_owned, "{taint:?}");
            assert_eq!(s.taint, still_owned.then(|| owned(spec_key)), "{taint:?}");
        }
    }
    // An add records which taint; a removal forgets it.
    let mut e = Engine::new(&monitor(), "m").unwrap();
    e.current(t(0));
    e.taint_result("AppBroken", TaintOutcome::Added);
    assert_eq!(e.state()["AppBroken"].taint, Some(owned(spec_key)));
    e.taint_result("AppBroken", TaintOutcome::Removed);
    assert_eq!(e.state()["AppBroken"].taint, None);
}

#[test]
fn long_lines_are_truncated_in_messages() {
    let mut e = Engine::new(&default_kernel_monitor(), "k").unwrap();
    let line = format!("EXT4-fs error {}", "x".repeat(5000));
    let a = e.on_line(&line, t(0));
    let Action::Event { message, .. } = &a[0] else {
        panic!()
    };
    assert!(message.len() <= MESSAGE_LIMIT + 3);
}

#[test]
fn plugin_results_set_and_clear_permanent_conditions() {
    let mut m = monitor();
    m.source = crate::policy::monitors::LogSource {
        kmsg: None,
        file: None,
        journald: None,
        plugin: Some(crate::policy::monitors::PluginSource {
            interval_seconds: 30,
            timeout_seconds: 5,
            concurrency: 1,
            max_output_length: 80,
            npd_results: false,
        }),
        systemd: None,
    };
    m.conditions[0].clear_pattern = None;
    m.rules = vec![RuleSpec {
        kind: ProblemKind::Permanent,
        condition: Some("AppBroken".into()),
        reason: "NtpUnsynced".into(),
        pattern: String::new(),
        command: vec!["/bin/check-ntp".into()],
        timeout_seconds: None,
        message: None,
        count: None,
    }];
    let mut e = Engine::new(&m, "m").unwrap();
    e.current(t(0));
    let a = e.on_plugin(0, PluginStatus::Problem, "offset 3.2s", t(1));
    assert!(a.contains(&Action::Condition {
        type_: "AppBroken".into(),
        active: true,
        reason: "NtpUnsynced".into(),
        message: "offset 3.2s".into()
    }));
    assert!(
        e.on_plugin(0, PluginStatus::Unknown, "", t(2)).is_empty(),
        "unknown changes nothing"
    );
    let a = e.on_plugin(0, PluginStatus::Ok, "ok", t(3));
    assert!(
        matches!(&a[0], Action::Condition { active: false, message, .. } if message.contains("its check passes again"))
    );
    assert!(
        e.on_plugin(9, PluginStatus::Problem, "", t(4)).is_empty(),
        "no such rule"
    );
}

/// A plugin monitor judging as node-problem-detector's custom plugin
/// monitor (`npdResults`): a temporary and a permanent rule on one check.
fn npd_plugin_engine() -> Engine {
    let mut m = monitor();
    m.source = crate::policy::monitors::LogSource {
        kmsg: None,
        file: None,
        journald: None,
        plugin: Some(crate::policy::monitors::PluginSource {
            interval_seconds: 30,
            timeout_seconds: 5,
            concurrency: 1,
            max_output_length: 80,
            npd_results: true,
        }),
        systemd: None,
    };
    m.conditions[0].clear_pattern = None;
    let rule = |kind, condition: Option<&str>, reason: &str| RuleSpec {
        kind,
        condition: condition.map(String::from),
        reason: reason.into(),
        pattern: String::new(),
        command: vec!["/bin/check".into()],
        timeout_seconds: None,
        message: None,
        count: None,
    };
    m.rules = vec![
        rule(ProblemKind::Temporary, None, "CheckHiccup"),
        rule(ProblemKind::Permanent, Some("AppBroken"), "AppCrashed"),
    ];
    let mut e = Engine::new(&m, "m").unwrap();
    e.current(t(0));
    e
}

fn worded(actions: &[Action]) -> Vec<String> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Event { reason, message } => Some(format!("{reason}: {message}")),
            _ => None,
        })
        .collect()
}

/// NPD's generateStatus, case by case: False→Unknown, Unknown stays
/// without a change, Unknown→True, True→Unknown (the default reason, the
/// check's output), Unknown→False (the default message); every change an
/// Event worded as NPD's; a temporary rule reports an unknown result.
#[test]
fn an_npd_plugins_unknown_result_makes_its_condition_unknown_as_npd_does() {
    let mut e = npd_plugin_engine();
    let unknown = |message: &str| Action::Unknown {
        type_: "AppBroken".into(),
        reason: "AppIsFine".into(),
        message: message.into(),
    };
    let a = e.on_plugin(1, PluginStatus::Unknown, "cannot tell", t(1));
    assert_eq!(a[0], unknown("cannot tell"));
    assert_eq!(
        worded(&a),
        [
            "AppIsFine: Node condition AppBroken is now: Unknown, reason: AppIsFine, message: \"cannot tell\""
        ]
    );
    assert!(
        e.on_plugin(1, PluginStatus::Unknown, "still cannot tell", t(2))
            .is_empty(),
        "Unknown stays Unknown without a change"
    );
    assert_eq!(
        e.current(t(3))[0],
        unknown("cannot tell"),
        "a restatement keeps it Unknown"
    );
    let a = e.on_plugin(1, PluginStatus::Problem, "it broke", t(4));
    assert!(a.contains(&Action::Condition {
        type_: "AppBroken".into(),
        active: true,
        reason: "AppCrashed".into(),
        message: "it broke".into()
    }));
    assert_eq!(
        worded(&a),
        [
            "AppCrashed: Node condition AppBroken is now: True, reason: AppCrashed, message: \"it broke\""
        ]
    );
    let a = e.on_plugin(1, PluginStatus::Unknown, "", t(5));
    assert_eq!(a[0], unknown(""), "True to Unknown");
    let a = e.on_plugin(1, PluginStatus::Ok, "fine", t(6));
    assert!(a.contains(&Action::Condition {
        type_: "AppBroken".into(),
        active: false,
        reason: "AppIsFine".into(),
        message: "app is fine".into()
    }));
    assert_eq!(
        worded(&a),
        [
            "AppIsFine: Node condition AppBroken is now: False, reason: AppIsFine, message: \"app is fine\""
        ]
    );
    assert!(e.on_plugin(1, PluginStatus::Ok, "fine", t(7)).is_empty());
    // The temporary rule: an Event for a problem and for an unknown result
    // (NPD: an exit status at or above NonOK), none for a pass.
    assert_eq!(
        worded(&e.on_plugin(
            0,
            PluginStatus::Unknown,
            "Timeout when running plugin",
            t(8)
        )),
        ["CheckHiccup: Timeout when running plugin"]
    );
    assert_eq!(
        worded(&e.on_plugin(0, PluginStatus::Problem, "it broke", t(9))),
        ["CheckHiccup: it broke"]
    );
    assert!(e.on_plugin(0, PluginStatus::Ok, "fine", t(10)).is_empty());
}

/// NPD's last-result-wins with two checks of one condition, an empty
/// stdout kept empty, an Unknown condition kept across a restart and its
/// taint removed as a restatement would.
#[test]
fn an_npd_plugins_condition_follows_the_last_result_and_survives_a_restart() {
    // Two permanent checks of one condition, which has a taint.
    let mut m = monitor();
    m.source = e_source();
    m.conditions[0].clear_pattern = None;
    m.conditions[0].taint = Some(crate::policy::monitors::TaintSpec {
        key: "example.com/app".into(),
        value: None,
        effect: "NoSchedule".into(),
    });
    let rule = |reason: &str| RuleSpec {
        kind: ProblemKind::Permanent,
        condition: Some("AppBroken".into()),
        reason: reason.into(),
        pattern: String::new(),
        command: vec!["/bin/check".into()],
        timeout_seconds: None,
        message: None,
        count: None,
    };
    m.rules = vec![rule("FirstBroken"), rule("SecondBroken")];
    let mut e = Engine::new(&m, "m").unwrap();
    e.current(t(0));
    e.on_plugin(0, PluginStatus::Problem, "first", t(1));
    e.taint_result("AppBroken", TaintOutcome::Added);
    let a = e.on_plugin(1, PluginStatus::Problem, "", t(2));
    assert!(
        a.contains(&Action::Condition {
            type_: "AppBroken".into(),
            active: true,
            reason: "SecondBroken".into(),
            message: "".into()
        }),
        "the second check's reason, its empty output: {a:?}"
    );
    let a = e.on_plugin(0, PluginStatus::Ok, "fine", t(3));
    assert!(
        matches!(&a[0], Action::Condition { active: false, .. }),
        "an OK of the other check clears it, as NPD: {a:?}"
    );
    e.on_plugin(0, PluginStatus::Problem, "first", t(4));
    e.taint_result("AppBroken", TaintOutcome::Added);
    let a = e.on_plugin(1, PluginStatus::Unknown, "cannot tell", t(5));
    assert!(
        a.iter()
            .any(|x| matches!(x, Action::Taint { add: false, .. })),
        "Unknown is not True: the taint goes: {a:?}"
    );
    // Saved and restored: still Unknown.
    let saved = serde_json::to_string(&e.state()).unwrap();
    let mut again = Engine::new(&m, "m").unwrap();
    again.restore(serde_json::from_str(&saved).unwrap());
    let a = again.current(t(6));
    assert!(
        matches!(&a[0], Action::Unknown { message, .. } if message == "cannot tell"),
        "{a:?}"
    );
    let a = again.on_plugin(1, PluginStatus::Ok, "fine", t(7));
    assert!(
        a.contains(&Action::Condition {
            type_: "AppBroken".into(),
            active: false,
            reason: "AppIsFine".into(),
            message: "app is fine".into()
        }),
        "{a:?}"
    );
}

fn e_source() -> crate::policy::monitors::LogSource {
    crate::policy::monitors::LogSource {
        kmsg: None,
        file: None,
        journald: None,
        plugin: Some(crate::policy::monitors::PluginSource {
            interval_seconds: 30,
            timeout_seconds: 5,
            concurrency: 1,
            max_output_length: 80,
            npd_results: true,
        }),
        systemd: None,
    }
}

fn taints(actions: &[Action]) -> Vec<bool> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Taint { add, condition, .. } => {
                assert_eq!(condition, "AppBroken");
                Some(*add)
            }
            _ => None,
        })
        .collect()
}

/// An operator's identical taint was there when the condition went True:
/// nodeguard does not own it and leaves it when the condition clears, also
/// after a restart; a taint nodeguard added is removed.
#[test]
fn only_taints_nodeguard_added_are_removed() {
    let mut e = Engine::new(&monitor(), "m").unwrap();
    e.current(t(0));
    assert_eq!(taints(&e.on_line("app crashed: x", t(1))), [true]);
    e.taint_result("AppBroken", TaintOutcome::AlreadyPresent);
    assert!(!e.state()["AppBroken"].taint_added);
    // A restart puts the taint back if it went missing, and still does not
    // own the one that is there.
    let mut e = {
        let saved = e.state().clone();
        let mut e2 = Engine::new(&monitor(), "m").unwrap();
        e2.restore(saved);
        e2
    };
    assert_eq!(taints(&e.current(t(2))), [true]);
    e.taint_result("AppBroken", TaintOutcome::AlreadyPresent);
    let cleared = e.on_line("app recovered", t(3));
    assert!(matches!(
        &cleared[0],
        Action::Condition { active: false, .. }
    ));
    assert_eq!(taints(&cleared), Vec::<bool>::new(), "not ours: left alone");

    // Now nodeguard adds it: it removes it on clear.
    assert_eq!(taints(&e.on_line("app crashed: y", t(4))), [true]);
    e.taint_result("AppBroken", TaintOutcome::Added);
    assert!(e.state()["AppBroken"].taint_added);
    // A reason change while active does not add it again.
    assert!(taints(&e.on_line("app crashed: z", t(5))).is_empty());
    assert_eq!(taints(&e.on_line("app recovered", t(6))), [false]);
    // The removal failed: still owned, and the next start removes it.
    e.taint_result("AppBroken", TaintOutcome::Failed);
    assert!(e.state()["AppBroken"].taint_added);
    assert_eq!(taints(&e.current(t(7))), [false]);
    e.taint_result("AppBroken", TaintOutcome::Removed);
    assert!(!e.state()["AppBroken"].taint_added);
    assert!(taints(&e.current(t(8))).is_empty());
}

fn kernel_with_taint() -> MonitorSpec {
    let mut k = default_kernel_monitor();
    k.conditions[0].taint = Some(TaintSpec {
        key: "example.com/deadlock".into(),
        value: None,
        effect: "NoSchedule".into(),
    });
    k
}

#[test]
fn a_new_boot_resets_kernel_conditions_and_removes_their_owned_taints() {
    let mut e = Engine::new(&kernel_with_taint(), "k").unwrap();
    e.current(t(0));
    e.on_line(
        "INFO: task docker:20744 blocked for more than 120 seconds.",
        t(1),
    );
    e.taint_result("KernelDeadlock", TaintOutcome::Added);
    e.on_line("EXT4-fs (sda1): Remounting filesystem read-only", t(2));
    let saved = e.state().clone();

    let mut e = Engine::new(&kernel_with_taint(), "k").unwrap();
    e.restore(saved);
    let a = e.on_new_boot(t(100));
    assert!(a.iter().any(|x| matches!(x,
        Action::Condition { type_, active: false, reason, message }
            if type_ == "KernelDeadlock" && reason == "KernelHasNoDeadlock" && message.contains("was DockerHung: the node rebooted"))));
    assert!(a.iter().any(|x| matches!(x,
        Action::Condition { type_, active: false, .. } if type_ == "ReadonlyFilesystem")));
    assert!(a.contains(&Action::Taint {
        condition: "KernelDeadlock".into(),
        key: "example.com/deadlock".into(),
        value: String::new(),
        effect: "NoSchedule".into(),
        add: false,
    }));
    e.taint_result("KernelDeadlock", TaintOutcome::Removed);
    let now = e.current(t(101));
    assert!(
        now.iter().all(|x| !matches!(
            x,
            Action::Condition { active: true, .. } | Action::Taint { .. }
        )),
        "{now:?}"
    );
    // The new boot's records set it again.
    let a = e.on_line(
        "INFO: task docker:1 blocked for more than 120 seconds.",
        t(102),
    );
    assert!(
        a.iter()
            .any(|x| matches!(x, Action::Condition { active: true, .. }))
    );
}

#[test]
fn which_conditions_a_new_boot_resets() {
    let kernel = default_kernel_monitor();
    assert!(kernel.conditions.iter().all(|c| kernel.resets_at_boot(c)));
    let mut file = monitor();
    // It clears by pattern and after a quiet period: kept.
    assert!(!file.resets_at_boot(&file.conditions[0]));
    file.conditions[0].clear_pattern = None;
    assert!(
        !file.resets_at_boot(&file.conditions[0]),
        "clearAfterSeconds"
    );
    file.conditions[0].clear_after_seconds = None;
    assert!(
        file.resets_at_boot(&file.conditions[0]),
        "nothing else clears it"
    );
    let mut journal = file.clone();
    journal.source.file = None;
    journal.source.journald = Some(Default::default());
    assert!(journal.resets_at_boot(&journal.conditions[0]));
    // Counts start again at each boot: a condition only counting rules set
    // resets, whatever else would clear it.
    let mut counted = journal.clone();
    counted.conditions[0].clear_after_seconds = Some(1200);
    assert!(!counted.resets_at_boot(&counted.conditions[0]));
    for r in counted.rules.iter_mut() {
        r.count = Some(crate::policy::monitors::CountSpec {
            threshold: 5,
            window_seconds: 1200,
            revert_pattern: None,
        });
    }
    assert!(
        counted.resets_at_boot(&counted.conditions[0]),
        "only counting rules set it"
    );
    let mut plugin = journal.clone();
    plugin.source.journald = None;
    plugin.source.plugin = Some(crate::policy::monitors::PluginSource {
        interval_seconds: 30,
        timeout_seconds: 5,
        concurrency: 1,
        max_output_length: 80,
        npd_results: false,
    });
    assert!(
        !plugin.resets_at_boot(&plugin.conditions[0]),
        "checked again"
    );

    // A kept condition stays active across a new boot.
    let mut e = Engine::new(&monitor(), "m").unwrap();
    e.current(t(0));
    e.on_line("app crashed: x", t(1));
    assert!(e.on_new_boot(t(2)).is_empty());
    assert!(e.state()["AppBroken"].active);
}

fn owned(active: bool) -> BTreeMap<String, ConditionState> {
    BTreeMap::from([(
        "AppBroken".to_string(),
        ConditionState {
            active,
            unknown: false,
            reason: "AppCrashed".into(),
            message: "m".into(),
            since: t(0),
            last_match: None,
            taint_added: true,
            taint: None,
        },
    )])
}

#[test]
fn cleanup_after_an_edit_or_a_removal() {
    let old = monitor();
    let taint = (
        "AppBroken".to_string(),
        "example.com/app-broken".to_string(),
        "NoSchedule".to_string(),
    );
    // Removed: its conditions and owned taints go.
    assert_eq!(
        cleanup(&old, None, &owned(true)),
        Cleanup {
            conditions: vec!["AppBroken".into()],
            taints: vec![taint.clone()],
            reset_cursor: false
        }
    );
    // A taint nodeguard does not own stays.
    let mut not_owned = owned(true);
    not_owned.get_mut("AppBroken").unwrap().taint_added = false;
    assert_eq!(cleanup(&old, None, &not_owned).taints, vec![]);
    // Unchanged conditions and taints: nothing to undo.
    let mut new = old.clone();
    new.rules[1].reason = "Other".into();
    assert_eq!(cleanup(&old, Some(&new), &owned(true)), Cleanup::default());
    // The taint changed (or went): the old one is removed.
    new.conditions[0].taint.as_mut().unwrap().key = "example.com/other".into();
    assert_eq!(
        cleanup(&old, Some(&new), &owned(true)),
        Cleanup {
            conditions: vec![],
            taints: vec![taint.clone()],
            reset_cursor: false
        }
    );
    new.conditions[0].taint = None;
    assert_eq!(
        cleanup(&old, Some(&new), &owned(true)).taints,
        vec![taint.clone()]
    );
    // The condition type changed: the old type and its taint go.
    let mut renamed = old.clone();
    renamed.conditions[0].type_ = "AppDown".into();
    renamed.rules[0].condition = Some("AppDown".into());
    assert_eq!(
        cleanup(&old, Some(&renamed), &owned(false)),
        Cleanup {
            conditions: vec!["AppBroken".into()],
            taints: vec![taint],
            reset_cursor: false
        }
    );
    // Another source: the cursor is dropped.
    let mut moved = old.clone();
    moved.source.file = Some(crate::policy::monitors::FileSource { path: "/y".into() });
    assert!(cleanup(&old, Some(&moved), &BTreeMap::new()).reset_cursor);
}

#[test]
fn a_failed_taint_update_is_retried_until_its_outcome_is_known() {
    let mut e = Engine::new(&monitor(), "m").unwrap();
    e.current(t(0));
    e.on_line("app crashed: oom", t(1));
    e.taint_result("AppBroken", TaintOutcome::Failed);
    let retry = e.taint_retries();
    assert!(
        matches!(retry.as_slice(), [Action::Taint { add: true, .. }]),
        "{retry:?}"
    );
    // Still failing: asked again.
    e.taint_result("AppBroken", TaintOutcome::Failed);
    assert_eq!(e.taint_retries().len(), 1);
    e.taint_result("AppBroken", TaintOutcome::Added);
    assert!(e.taint_retries().is_empty());
    // A removal that failed is retried as a removal; once the condition
    // neither is True nor owns a taint, nothing is left to do.
    e.on_line("app recovered", t(2));
    e.taint_result("AppBroken", TaintOutcome::Failed);
    assert!(matches!(
        e.taint_retries().as_slice(),
        [Action::Taint { add: false, .. }]
    ));
    e.taint_result("AppBroken", TaintOutcome::Removed);
    assert!(e.taint_retries().is_empty());
}

/// A monitor matching as node-problem-detector does, from JSON.
fn npd_monitor(source: serde_json::Value, buffer: u32, rules: serde_json::Value) -> MonitorSpec {
    serde_json::from_value(serde_json::json!({
        "name": "npd",
        "source": source,
        "conditions": [{"type": "KernelDeadlock", "reason": "KernelHasNoDeadlock", "message": "fine"}],
        "rules": rules,
        "npdMatching": {"bufferLines": buffer},
    }))
    .unwrap()
}

fn kmsg() -> serde_json::Value {
    serde_json::json!({"kmsg": {"path": "/dev/kmsg"}})
}

fn fired(e: &mut Engine, line: &str, at: i64) -> Vec<String> {
    e.on_line(line, t(at))
        .into_iter()
        .filter_map(|a| match a {
            Action::Event { reason, message } => Some(format!("{reason}: {message}")),
            Action::Condition {
                active: true,
                reason,
                ..
            } => Some(format!("{reason}!")),
            _ => None,
        })
        .collect()
}

/// NPD matches `pattern + \z` against its buffer: the match must end where
/// the newest line ends, may start in an earlier line, and `^` is the start
/// of the buffer. Cases from NPD's own rules and the kernel's lines.
#[test]
fn npd_matching_ends_at_the_newest_line() {
    let rules = serde_json::json!([
        {"type": "temporary", "reason": "KernelOops", "pattern": r"divide error: 0000 \[#\d+\] SMP"},
        {"type": "temporary", "reason": "Anchored", "pattern": r"^anchored"},
        {"type": "permanent", "condition": "KernelDeadlock", "reason": "DockerHung",
         "pattern": r"task docker:\w+ blocked for more than \w+ seconds\."},
        {"type": "temporary", "reason": "OOMKilling",
         "pattern": "Kill process \\d+ (.+) score \\d+ or sacrifice child\\nKilled process \\d+ (.+) total-vm:\\d+kB.*"},
    ]);
    let mut e = Engine::new(&npd_monitor(kmsg(), 10, rules.clone()), "m").unwrap();
    let cases: &[(&str, &[&str])] = &[
        ("divide error: 0000 [#1] SMP PTI", &[]),
        (
            "divide error: 0000 [#1] SMP",
            &["KernelOops: divide error: 0000 [#1] SMP"],
        ),
        // Trimmed like NPD's kmsg messages.
        (
            "  divide error: 0000 [#2] SMP \t",
            &["KernelOops: divide error: 0000 [#2] SMP"],
        ),
        // `^` is the start of the 10-line buffer: never with more than one line.
        ("anchored", &[]),
        (
            "INFO: task docker:42 blocked for more than 120 seconds.",
            &[
                "DockerHung!",
                "DockerHung: Node condition KernelDeadlock is now: True, reason: DockerHung, message: \"INFO: task docker:42 blocked for more than 120 seconds.\"",
            ],
        ),
        ("Killed process 9 (x) total-vm:1kB", &[]),
        ("Kill process 77 (java) score 900 or sacrifice child", &[]),
        (
            "Killed process 77 (java) total-vm:123kB, anon-rss:1kB",
            &[
                "OOMKilling: Kill process 77 (java) score 900 or sacrifice child\nKilled process 77 (java) total-vm:123kB, anon-rss:1kB",
            ],
        ),
    ];
    for (i, (line, want)) in cases.iter().enumerate() {
        assert_eq!(&fired(&mut e, line, i as i64), want, "{line:?}");
    }
    // With one line held, `^` is the start of that (trimmed) line.
    let mut one = Engine::new(&npd_monitor(kmsg(), 1, rules), "m").unwrap();
    assert_eq!(fired(&mut one, "  anchored", 0), ["Anchored: anchored"]);
    assert!(fired(&mut one, "not anchored", 1).is_empty());
}

/// Without npdMatching, nodeguard's own matching: anywhere in one line.
#[test]
fn nodeguards_own_matching_searches_the_line() {
    let mut m = npd_monitor(
        kmsg(),
        1,
        serde_json::json!([{"type": "temporary", "reason": "KernelOops", "pattern": r"divide error: 0000 \[#\d+\] SMP"}]),
    );
    m.npd_matching = None;
    let mut e = Engine::new(&m, "m").unwrap();
    assert_eq!(fired(&mut e, "divide error: 0000 [#1] SMP PTI", 0).len(), 1);
}

/// NPD's filelog: the message is the message pattern's last capture group,
/// lines it does not match and lines with a skip-list entry are skipped,
/// and file lines are not trimmed.
#[test]
fn npd_file_monitors_match_the_extracted_message() {
    let mut m = npd_monitor(
        serde_json::json!({"file": {"path": "/var/log/kern.log"}}),
        10,
        serde_json::json!([{"type": "temporary", "reason": "Oops", "pattern": r"^oops \d+"}]),
    );
    let n = m.npd_matching.as_mut().unwrap();
    n.buffer_lines = 1;
    n.message_pattern = Some(r"kernel: \[.*\] (.*)".into());
    n.skip = vec![" audit:".into()];
    let mut e = Engine::new(&m, "m").unwrap();
    assert_eq!(
        fired(&mut e, "Nov 23 10:00:00 node kernel: [ 12.5] oops 7", 0),
        ["Oops: oops 7"]
    );
    // No message (the pattern does not match): skipped, the buffer unchanged.
    assert!(fired(&mut e, "Nov 23 10:00:01 node sshd: oops 8", 1).is_empty());
    assert!(fired(&mut e, "Nov 23 10:00:02 node kernel: audit: [ 1] oops 9", 2).is_empty());
    // Not trimmed: a leading space keeps `^` from matching.
    assert!(fired(&mut e, "Nov 23 10:00:03 node kernel: [ 13.0]  oops 10", 3).is_empty());
}

/// log-counter's `--revert-pattern`: each match takes one off the count in
/// the window, so start/stop pairs never add up and crashes do.
#[test]
fn a_revert_pattern_takes_one_off_the_count() {
    let mut m = npd_monitor(
        serde_json::json!({"journald": {"identifier": "systemd"}}),
        1,
        serde_json::json!([{
            "type": "permanent", "condition": "KernelDeadlock", "reason": "FrequentRestart",
            "pattern": "Started kubelet.",
            "count": {"threshold": 3, "windowSeconds": 600, "revertPattern": "Stopping kubelet..."}
        }]),
    );
    m.conditions[0].clear_after_seconds = Some(600);
    let mut e = Engine::new(&m, "m").unwrap();
    let mut at = 0;
    for _ in 0..5 {
        assert!(fired(&mut e, "Stopping kubelet...", at).is_empty());
        assert!(fired(&mut e, "Started kubelet.", at + 1).is_empty());
        at += 10;
    }
    // Three starts with no stop: the third fires.
    assert!(fired(&mut e, "Started kubelet.", at).is_empty());
    assert!(fired(&mut e, "Started kubelet.", at + 1).is_empty());
    assert_eq!(
        fired(&mut e, "Started kubelet.", at + 2),
        [
            "FrequentRestart!",
            "FrequentRestart: Node condition KernelDeadlock is now: True, reason: FrequentRestart, message: \"Started kubelet.\""
        ]
    );
    // A revert outside the window no longer counts.
    let mut e = Engine::new(&m, "m").unwrap();
    assert!(fired(&mut e, "Stopping kubelet...", 0).is_empty());
    for s in 0..2 {
        assert!(fired(&mut e, "Started kubelet.", 700 + s).is_empty());
    }
    assert_eq!(
        fired(&mut e, "Started kubelet.", 702),
        [
            "FrequentRestart!",
            "FrequentRestart: Node condition KernelDeadlock is now: True, reason: FrequentRestart, message: \"Started kubelet.\""
        ]
    );
}

/// Review cases of NPD matching: a top-level `|` anchors only its last
/// alternative (as in NPD), a match starting at a newline does not take the
/// line before, an empty kernel record takes no place in the buffer, and
/// NPD's message suffix is appended.
#[test]
fn npd_matching_edge_cases() {
    let mut m = npd_monitor(
        kmsg(),
        3,
        serde_json::json!([
            {"type": "temporary", "reason": "FsError", "pattern": r"EXT4-fs error|XFS .* shutdown"},
            {"type": "temporary", "reason": "Pair", "pattern": "\\nsecond half"},
        ]),
    );
    m.npd_matching.as_mut().unwrap().message_suffix =
        Some("see https://runbooks.example/fs".into());
    let mut e = Engine::new(&m, "m").unwrap();
    // "EXT4-fs error" is not anchored: it matches while it is in the buffer.
    assert_eq!(
        fired(&mut e, "EXT4-fs error (device sda1): bad block", 0),
        ["FsError: EXT4-fs error (device sda1): bad block; see https://runbooks.example/fs"]
    );
    assert_eq!(fired(&mut e, "other", 1).len(), 1);
    assert_eq!(fired(&mut e, "other", 2).len(), 1);
    assert!(fired(&mut e, "other", 3).is_empty());
    // Empty kernel records are skipped; the pair still meets.
    assert!(fired(&mut e, "first half", 4).is_empty());
    assert!(fired(&mut e, "", 5).is_empty());
    assert_eq!(
        fired(&mut e, "second half", 6),
        ["Pair: second half; see https://runbooks.example/fs"]
    );
}

/// A line that matches a counting rule and its revert pattern nets zero
/// (log-counter applies both before comparing), and a flood of matches in
/// one second holds one entry.
#[test]
fn a_count_and_its_revert_on_one_line_net_zero_and_floods_stay_small() {
    let m = npd_monitor(
        serde_json::json!({"journald": {}}),
        1,
        serde_json::json!([{
            "type": "temporary", "reason": "Flapping", "pattern": "restart",
            "count": {"threshold": 1, "windowSeconds": 600, "revertPattern": "restart clean"}
        }]),
    );
    let mut e = Engine::new(&m, "m").unwrap();
    for i in 0..5 {
        assert!(fired(&mut e, "restart clean", i).is_empty());
    }
    let m = npd_monitor(
        serde_json::json!({"journald": {}}),
        1,
        serde_json::json!([{
            "type": "temporary", "reason": "Flapping", "pattern": "up",
            "count": {"threshold": 1_000_000, "windowSeconds": 600, "revertPattern": "down"}
        }]),
    );
    let mut e = Engine::new(&m, "m").unwrap();
    for _ in 0..10_000 {
        e.on_line("up", t(0));
        e.on_line("down", t(0));
    }
    e.on_line("up", t(1));
    assert_eq!(e.counts[&0].len(), 2, "one entry per second");
}

/// Two checks that set one condition (NPD's docker and containerd health
/// checkers): it stays True, with the first failing check's reason, while
/// either fails, hands over when that one recovers, and clears when both
/// pass; no flip-flop while both fail.
#[test]
fn a_condition_two_checks_set_stays_while_either_fails() {
    let m: MonitorSpec = serde_json::from_value(serde_json::json!({
        "name": "health-checker",
        "source": {"plugin": {}},
        "conditions": [{"type": "ContainerRuntimeUnhealthy", "reason": "ContainerRuntimeIsHealthy", "message": "ok"}],
        "rules": [
            {"type": "permanent", "condition": "ContainerRuntimeUnhealthy", "reason": "DockerUnhealthy", "command": ["/bin/docker-check"]},
            {"type": "permanent", "condition": "ContainerRuntimeUnhealthy", "reason": "ContainerdUnhealthy", "command": ["/bin/cri-check"]},
        ],
    }))
    .unwrap();
    let mut e = Engine::new(&m, "m").unwrap();
    let conds = |a: &[Action]| -> Vec<String> {
        a.iter()
            .filter_map(|a| match a {
                Action::Condition { active, reason, .. } => Some(format!("{active} {reason}")),
                _ => None,
            })
            .collect()
    };
    let docker_fails = e.on_plugin(0, PluginStatus::Problem, "docker down", t(0));
    assert_eq!(conds(&docker_fails), ["true DockerUnhealthy"]);
    for i in 1..4 {
        assert!(
            e.on_plugin(1, PluginStatus::Problem, "cri down", t(i * 10))
                .is_empty()
        );
        assert!(
            e.on_plugin(0, PluginStatus::Problem, "docker down", t(i * 10 + 1))
                .is_empty()
        );
    }
    // Docker recovers, containerd still fails: it takes the condition over.
    assert_eq!(
        conds(&e.on_plugin(0, PluginStatus::Ok, "", t(50))),
        ["true ContainerdUnhealthy"]
    );
    assert!(e.on_plugin(0, PluginStatus::Ok, "", t(60)).is_empty());
    assert_eq!(
        conds(&e.on_plugin(1, PluginStatus::Ok, "", t(70))),
        ["false ContainerRuntimeIsHealthy"]
    );
}

/// Go's `%q`, as node-problem-detector quotes a message in its Events.
#[test]
fn go_quote_quotes_as_go_does() {
    assert_eq!(go_quote("plain text"), "\"plain text\"");
    assert_eq!(
        go_quote("a\"b\\c\td\ne\u{01}f\u{7f}g\u{a0}h é"),
        "\"a\\\"b\\\\c\\td\\ne\\x01f\\x7fg\\u00a0h é\""
    );
    assert_eq!(go_quote("\u{85}"), "\"\\u0085\"");
}

/// An imported counter holds its condition as log-counter does on each run:
/// True while the window holds `threshold` matches (net of reverts), False
/// once it holds fewer: a clean stop after the fifth start clears it at the
/// next tick, and so does the oldest match leaving the window, not a whole
/// quiet window after the last match.
#[test]
fn an_npd_counter_holds_while_its_window_does() {
    let mut m = npd_monitor(
        serde_json::json!({"journald": {"identifier": "systemd"}}),
        1,
        serde_json::json!([{
            "type": "permanent", "condition": "KernelDeadlock", "reason": "FrequentRestart",
            "pattern": "Started kubelet.", "message": "Found 3 matching logs, which meets the threshold of 3",
            "count": {"threshold": 3, "windowSeconds": 600, "revertPattern": "Stopping kubelet..."}
        }]),
    );
    m.conditions[0].clear_after_seconds = Some(600);
    let mut e = Engine::new(&m, "m").unwrap();
    assert!(fired(&mut e, "Started kubelet.", 0).is_empty());
    assert!(fired(&mut e, "Started kubelet.", 100).is_empty());
    assert_eq!(
        fired(&mut e, "Started kubelet.", 200)[0],
        "FrequentRestart!"
    );
    // A fourth start: still True, nothing new said.
    assert!(fired(&mut e, "Started kubelet.", 300).is_empty());
    assert!(e.on_tick(t(301)).is_empty());
    // A clean stop: 3 left, still True; another: 2, False at the tick.
    assert!(fired(&mut e, "Stopping kubelet...", 310).is_empty());
    assert!(e.on_tick(t(311)).is_empty());
    assert!(fired(&mut e, "Stopping kubelet...", 320).is_empty());
    let cleared = e.on_tick(t(321));
    assert!(
        cleared.iter().any(
            |a| matches!(a, Action::Condition { active: false, message, .. } if message == "fine")
        ),
        "{cleared:?}"
    );
    // Two more starts reach 3 again (the window still holds 4 - 2).
    assert_eq!(
        fired(&mut e, "Started kubelet.", 330)[0],
        "FrequentRestart!"
    );
    // The oldest matches age out: at 601 the start at 0 is gone (2 left).
    assert!(e.on_tick(t(600)).is_empty());
    let aged = e.on_tick(t(601));
    assert!(
        aged.iter()
            .any(|a| matches!(a, Action::Condition { active: false, .. })),
        "{aged:?}"
    );
}

/// Counts are saved and restored: four crashes before an agent restart and
/// one after make five, as log-counter (which reads its whole lookback on
/// every run) counts them. A restored True counter with no saved counts (a
/// state from before counts were saved) is not cleared at once.
#[test]
fn counts_survive_a_restart() {
    let m = npd_monitor(
        serde_json::json!({"journald": {"identifier": "systemd"}}),
        1,
        serde_json::json!([{
            "type": "permanent", "condition": "KernelDeadlock", "reason": "FrequentRestart",
            "pattern": "Started kubelet.",
            "count": {"threshold": 5, "windowSeconds": 1200}
        }]),
    );
    let mut e = Engine::new(&m, "m").unwrap();
    for s in 0..4 {
        assert!(fired(&mut e, "Started kubelet.", s * 60).is_empty());
    }
    let saved = e.counts_state();
    assert_eq!(
        saved["FrequentRestart"].iter().map(|(_, n)| n).sum::<i64>(),
        4
    );
    let mut e = Engine::new(&m, "m").unwrap();
    e.restore_counts(saved);
    assert_eq!(
        fired(&mut e, "Started kubelet.", 300)[0],
        "FrequentRestart!"
    );

    // An old state: True, no counts. It stays until a window after its last
    // match.
    let state = e.state().clone();
    let mut e = Engine::new(&m, "m").unwrap();
    e.restore(state);
    e.restore_counts(BTreeMap::new());
    assert!(e.on_tick(t(301)).is_empty());
    assert!(e.on_tick(t(1500)).is_empty());
    assert!(
        e.on_tick(t(1501))
            .iter()
            .any(|a| matches!(a, Action::Condition { active: false, .. }))
    );
}

/// A wall-clock step (NTP, `date -s`) moves the kept times with it: a quiet
/// period and a counting window measure the time that passed.
#[test]
fn a_clock_step_moves_quiet_periods_and_windows_with_it() {
    let active = |e: &Engine| e.state()["AppBroken"].active;
    // Set back an hour 9 s after the match: the condition clears 60 s after
    // the match, not at once (an hour "since") and not an hour later.
    let mut e = Engine::new(&monitor(), "m").unwrap();
    e.current(t(0));
    e.on_line("app crashed: x", t(1));
    e.shift(jiff::SignedDuration::from_secs(-3600));
    // Kept times are on the stepped clock (what is saved and shown).
    assert_eq!(e.state()["AppBroken"].last_match, Some(t(1 - 3600)));
    assert!(e.on_tick(t(10 - 3600)).is_empty());
    assert!(active(&e));
    e.on_tick(t(60 - 3600));
    assert!(active(&e), "59 s after the match");
    e.on_tick(t(62 - 3600));
    assert!(!active(&e), "61 s after the match");

    // Set forward an hour between matches: three in 60 s still count.
    let mut e = Engine::new(&monitor(), "m").unwrap();
    e.current(t(0));
    e.on_line("app restarted", t(1));
    e.on_line("app restarted", t(2));
    e.shift(jiff::SignedDuration::from_secs(3600));
    let a = e.on_line("app restarted", t(3600 + 5));
    assert_eq!(events(&a), ["FrequentRestarts"], "{a:?}");
}

/// Restored times in the future (the clock was set back while the monitor
/// was stopped) are taken as now: not read as long ago.
#[test]
fn restored_times_in_the_future_are_taken_as_now() {
    let mut e = Engine::new(&monitor(), "m").unwrap();
    e.current(t(0));
    e.on_line("app crashed: x", t(3600));
    let saved = e.state().clone();
    let mut e = Engine::new(&monitor(), "m").unwrap();
    e.restore(saved);
    e.clamp_to(t(10));
    e.current(t(10));
    assert!(e.on_tick(t(11)).is_empty(), "not cleared at once");
    assert!(e.state()["AppBroken"].active);
    e.on_tick(t(71));
    assert!(!e.state()["AppBroken"].active, "cleared 60 s later");
}

/// A counting window keeps at most `MAX_COUNT_BUCKETS` entries: one a
/// second up to 20 minutes, wider buckets beyond, so a day-long window on
/// a rule matching every second holds 1,200 entries, not 86,400.
#[test]
fn a_long_counting_window_keeps_at_most_1200_entries() {
    let cases: [(u64, i64); 6] = [
        (1, 1),
        (60, 1),
        (1200, 1),
        (1201, 2),
        (3600, 3),
        (86_400, 72),
    ];
    for (window, width) in cases {
        assert_eq!(
            bucket_seconds(Duration::from_secs(window)),
            width,
            "window {window}"
        );
        let mut q = VecDeque::new();
        let w = Duration::from_secs(window);
        let mut total = 0;
        // A match every second for twice the window.
        for s in 0..(2 * window as i64) {
            total = count(&mut q, t(s), 1, w);
            assert!(
                q.len() as u64 <= MAX_COUNT_BUCKETS + 1,
                "window {window}: {} entries",
                q.len()
            );
        }
        // The net count is the window's, to within one bucket.
        let window = window as i64;
        assert!(
            (window - width..=window + 1).contains(&total),
            "window {window}: {total} counted"
        );
    }
}

/// A window longer than the schema allows now (a policy stored before)
/// is bounded the same way: 504-second buckets for a week.
#[test]
fn a_week_long_window_stored_earlier_keeps_at_most_1200_entries() {
    let w = Duration::from_secs(604_800);
    assert_eq!(bucket_seconds(w), 504);
    let mut q = VecDeque::new();
    let mut total = 0;
    for s in (0..2 * 604_800).step_by(60) {
        total = count(&mut q, t(s), 1, w);
        assert!(
            q.len() as u64 <= MAX_COUNT_BUCKETS + 1,
            "{} entries",
            q.len()
        );
    }
    assert!((10_080 - 9..=10_081).contains(&total), "{total} counted");
}

/// A day-long window counts a threshold of matches spread over the day,
/// and forgets them a day (to within a bucket) after the first.
#[test]
fn a_day_long_window_counts_across_the_day_and_forgets_after_it() {
    let w = Duration::from_secs(86_400);
    let mut q = VecDeque::new();
    assert_eq!(count(&mut q, t(0), 1, w), 1);
    assert_eq!(count(&mut q, t(40_000), 1, w), 2);
    assert_eq!(count(&mut q, t(86_000), 1, w), 3);
    // 86,400 s after the first match it has left; the others have not.
    assert_eq!(net(&mut q, t(86_401), w), 2);
    assert_eq!(net(&mut q, t(126_401), w), 1);
    assert_eq!(net(&mut q, t(172_401), w), 0);
    assert!(q.is_empty());
}

/// Saved entries (one a second, from an agent before buckets, or out of
/// order by hand) are merged into the window's buckets on restore, counts
/// kept.
#[test]
fn saved_counts_are_merged_into_buckets_on_restore() {
    let w = Duration::from_secs(86_400);
    let saved: Vec<(Timestamp, i64)> = (0..86_400).rev().map(|s| (t(s), 1)).collect();
    let q = rebucket(&saved, w);
    assert_eq!(q.len(), 1200);
    assert_eq!(q.iter().map(|(_, d)| d).sum::<i64>(), 86_400);
    assert!(q.iter().zip(q.iter().skip(1)).all(|(a, b)| a.0 < b.0));
    // A short window keeps its seconds.
    let saved = vec![(t(5), 1), (t(3), 2), (t(5), -1)];
    let q = rebucket(&saved, Duration::from_secs(60));
    assert_eq!(q, VecDeque::from([(t(3), 2), (t(5), 0)]));
}
