//! nodeguard as a drop-in for node-problem-detector, judged by NPD's own
//! material: every monitor config of the NPD release bench/npd pins (from
//! its Go module, e2e/npd-configs) is imported with `nodeguard import-npd`,
//! alone and in the sets NPD's deployments use, and the imported rules are
//! replayed over kernel and journal lines with the outcome NPD's matching
//! gives them (its pattern + `\z` over the last `bufferSize` trimmed lines,
//! log-counter's `--revert-pattern`); then the agent runs an imported config
//! against the real control plane.

mod support;

use std::io::Write;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use support::*;

/// `import-npd` of NPD config files (names under the release's config/).
fn import(files: &[&str]) -> (i32, String, String) {
    let dir = npd_configs();
    let paths: Vec<String> = files
        .iter()
        .map(|f| dir.join(f).display().to_string())
        .collect();
    let mut args = vec!["import-npd"];
    args.extend(paths.iter().map(String::as_str));
    nodeguard(&args)
}

/// Writes `yaml` and runs `nodeguard check -f` on it (with `--replay log`).
fn check(dir: &Path, yaml: &str, replay: Option<&str>) -> (i32, String, String) {
    let policy = dir.join("imported.yaml");
    std::fs::write(&policy, yaml).unwrap();
    let mut args = vec!["check", "-f", policy.to_str().unwrap()];
    let log = dir.join("replay.log");
    if let Some(lines) = replay {
        std::fs::write(&log, lines).unwrap();
        args.extend(["--replay", log.to_str().unwrap(), "--year", "2026"]);
    }
    nodeguard(&args)
}

#[test]
fn every_npd_config_of_the_release_imports_alone_and_in_npds_sets() {
    let dir = npd_configs();
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".json"))
        .collect();
    names.sort();
    assert!(names.len() >= 20, "{names:?}");
    let tmp = TempDir::new("npd-import");
    let mut table = String::from(
        "| NPD config | import-npd | monitors | nodeguard check |\n|---|---|---|---|\n",
    );
    for name in &names {
        let (code, yaml, notes) = import(&[name]);
        let text = std::fs::read_to_string(dir.join(name)).unwrap();
        let valid_json = serde_json::from_str::<serde_json::Value>(&text).is_ok();
        if !valid_json {
            // NPD's own loader (Go's encoding/json) refuses it too.
            assert_ne!(code, 0, "{name} is not JSON, yet imported");
            assert!(
                notes.contains(name.as_str()),
                "the error names the file: {notes}"
            );
            table.push_str(&format!(
                "| {name} | refused: not JSON (NPD refuses it too) | | |\n"
            ));
            continue;
        }
        let config: serde_json::Value = serde_json::from_str(&text).unwrap();
        if config.get("plugin").is_none() {
            // system-stats-monitor: metrics for NPD's exporters, no problems.
            assert_ne!(code, 0, "{name}: {yaml}");
            assert!(
                notes.contains("a system-stats-monitor config"),
                "{name}: {notes}"
            );
            table.push_str(&format!(
                "| {name} | refused: system-stats (NPD's node metrics) | | |\n"
            ));
            continue;
        }
        if name.starts_with("windows-") {
            // NPD's Windows configs (C:\ paths, .exe and .ps1 plugins).
            assert_ne!(code, 0, "{name}: {yaml}");
            assert!(
                notes.contains("a Windows config") && notes.contains("nothing imported"),
                "{name}: {notes}"
            );
            table.push_str(&format!("| {name} | refused: Windows | | |\n"));
            continue;
        }
        assert_eq!(code, 0, "{name}: {notes}");
        // The imported policy's monitors (its YAML orders keys
        // alphabetically, so a text count of "- name:" missed most).
        let monitors = nodeguard::policy::load_policies("imported", &yaml)
            .unwrap()
            .iter()
            .map(|d| d.policy.as_ref().map_or(0, |p| p.spec.monitors.len()))
            .sum::<usize>();
        assert!(
            monitors > 0,
            "{name}: imported no monitor:\n{yaml}\n{notes}"
        );
        let (ccode, out, err) = check(&tmp.path, &yaml, None);
        assert_eq!(
            ccode, 0,
            "{name}: the imported policy is invalid:\n{out}{err}\n{yaml}"
        );
        table.push_str(&format!(
            "| {name} | ok ({} note(s)) | {monitors} | valid |\n",
            notes.lines().filter(|l| !l.trim().is_empty()).count()
        ));
    }
    println!(
        "conformance: every config of the NPD release, imported alone by `nodeguard import-npd` and checked by `nodeguard check`\n\n{table}"
    );
    // The sets NPD's own deployments load together: the GCE e2e set and
    // the health checkers.
    for set in [
        &[
            "kernel-monitor.json",
            "readonly-monitor.json",
            "docker-monitor.json",
            "systemd-monitor.json",
            "kernel-monitor-counter.json",
            "systemd-monitor-counter.json",
        ][..],
        // A node runs one container runtime: NPD's deployments pair the
        // kubelet's checker with docker's or containerd's (both write
        // ContainerRuntimeUnhealthy).
        &[
            "health-checker-kubelet.json",
            "health-checker-containerd.json",
        ][..],
        &["health-checker-kubelet.json", "health-checker-docker.json"][..],
    ] {
        let (code, yaml, notes) = import(set);
        assert_eq!(code, 0, "{set:?}: {notes}");
        if set[0].starts_with("health-checker") {
            // NPD's health checker becomes a systemd monitor of its unit,
            // with the component's health URL and NPD's repair: SIGTERM to
            // the main process after the cooldown.
            let docs = nodeguard::policy::load_policies("imported", &yaml).unwrap();
            let monitors = &docs[0].policy.as_ref().unwrap().spec.monitors;
            /// (unit, health URL, cooldown, signal, condition)
            type Unit<'a> = (String, Option<String>, u32, &'a str, Option<String>);
            let units: Vec<Unit> = monitors
                .iter()
                .map(|m| {
                    let s = m.source.systemd.as_ref().expect("a systemd monitor");
                    let r = s.repair.as_ref().expect("NPD's --enable-repair=true");
                    (
                        s.unit.clone(),
                        s.health_url.clone(),
                        r.cooldown_seconds,
                        r.signal.name(),
                        m.rules[0].condition.clone(),
                    )
                })
                .collect();
            let runtime = if set[1].contains("docker") {
                ("docker", "docker ps")
            } else {
                ("containerd", "crictl pods")
            };
            assert_eq!(
                units,
                [
                    (
                        "kubelet.service".to_string(),
                        Some("http://127.0.0.1:10248/healthz".to_string()),
                        60,
                        "SIGTERM",
                        Some("KubeletUnhealthy".to_string())
                    ),
                    (
                        format!("{}.service", runtime.0),
                        None,
                        120,
                        "SIGTERM",
                        Some("ContainerRuntimeUnhealthy".to_string())
                    ),
                ]
            );
            assert!(
                notes.contains(runtime.1)
                    && notes.contains(&format!("{}.service's state", runtime.0)),
                "{notes}"
            );
            assert!(notes.contains("--allow-repair-unit"), "{notes}");
        }
        let (ccode, out, err) = check(&tmp.path, &yaml, None);
        assert_eq!(ccode, 0, "{set:?}: {out}{err}\n{yaml}");
    }
}

/// Configs NPD loads side by side that write one condition (the journald
/// and the counter flavour of the docker monitor) cannot share one policy:
/// the import says which monitor owns it already and what to do.
#[test]
fn configs_owning_one_condition_are_named_with_what_to_do() {
    let (code, _, notes) = import(&["docker-monitor.json", "docker-monitor-counter.json"]);
    assert_eq!(code, 1, "{notes}");
    assert!(
        notes.contains(
            "condition CorruptDockerOverlay2 is also owned by monitor \"docker-monitor\""
        ) && notes.contains("separate policies"),
        "{notes}"
    );
}

/// NPD's kernel rules over kernel lines, with the outcome NPD's matching
/// gives each (pattern + `\z` on the trimmed message).
#[test]
fn npds_kernel_rules_fire_where_npd_fires_them() {
    let (code, yaml, notes) = import(&["kernel-monitor.json"]);
    assert_eq!(code, 0, "{notes}");
    let tmp = TempDir::new("npd-kernel");
    let lines = [
        // NPD: the pattern ends at "SMP"; this line goes on, so no match.
        "4,100,1000000,-;divide error: 0000 [#1] SMP PTI",
        "4,101,1000001,-;divide error: 0000 [#1] SMP",
        "4,102,1000002,-;BUG: unable to handle kernel NULL pointer dereference at 0000000000000010",
        "3,103,1000003,-;XFS (dm-0): Log I/O Error Detected. Shutting down filesystem",
        "3,104,1000004,-;{1}[Hardware Error]: event severity: fatal",
        // Trailing spaces are trimmed, as NPD trims kmsg messages.
        "3,105,1000005,-;INFO: task docker:1234 blocked for more than 120 seconds.   ",
        "6,106,1000006,-;unregister_netdevice: waiting for lo to become free. Usage count = 1",
        "6,107,1000007,-;Killed process 4242 (java) total-vm:123456kB, anon-rss:65432kB, file-rss:123kB, shmem-rss:0kB",
    ];
    let (code, out, err) = check(&tmp.path, &yaml, Some(&(lines.join("\n") + "\n")));
    println!("{out}");
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        !out.contains("line 1 "),
        "NPD does not fire on line 1:\n{out}"
    );
    for want in [
        "line 2  ",
        "kernel-monitor: Event KernelOops: divide error: 0000 [#1] SMP",
        "kernel-monitor: Event KernelOops: BUG: unable to handle kernel NULL pointer dereference",
        "kernel-monitor: XfsShutdown=True (XfsHasShutdown)",
        "kernel-monitor: CperHardwareErrorFatal=True (CperHardwareErrorFatal)",
        "kernel-monitor: Event TaskHung: INFO: task docker:1234 blocked for more than 120 seconds.",
        "kernel-monitor: KernelDeadlock=True (DockerHung)",
        "kernel-monitor: Event UnregisterNetDevice",
        "kernel-monitor: Event OOMKilling: Killed process 4242 (java)",
    ] {
        assert!(out.contains(want), "{want:?} missing:\n{out}");
    }
}

/// A rule that spans two lines, as NPD's kernel monitor had for the OOM
/// killer's "Kill process … or sacrifice child" followed by "Killed
/// process …": it fires on the pair, in order, and on neither line alone.
#[test]
fn a_two_line_npd_rule_fires_on_the_pair_only() {
    let config = serde_json::json!({
        "plugin": "kmsg",
        "logPath": "/dev/kmsg",
        "lookback": "5m",
        "bufferSize": 10,
        "source": "kernel-monitor",
        "conditions": [],
        "rules": [{
            "type": "temporary",
            "reason": "OOMKilling",
            "pattern": "Kill process \\d+ (.+) score \\d+ or sacrifice child\\nKilled process \\d+ (.+) total-vm:\\d+kB, anon-rss:\\d+kB, file-rss:\\d+kB.*"
        }]
    });
    let tmp = TempDir::new("npd-two-lines");
    let file = tmp.path.join("kernel-monitor.json");
    std::fs::write(&file, config.to_string()).unwrap();
    let (code, yaml, notes) = nodeguard(&["import-npd", file.to_str().unwrap()]);
    assert_eq!(code, 0, "{notes}");
    let lines = [
        "6,1,1000000,-;Killed process 11 (a) total-vm:1kB, anon-rss:1kB, file-rss:0kB",
        "3,2,1000001,-;Kill process 4242 (java) score 900 or sacrifice child",
        "6,3,1000002,-;Killed process 4242 (java) total-vm:123456kB, anon-rss:65432kB, file-rss:123kB, shmem-rss:0kB",
        "3,4,1000003,-;Kill process 77 (b) score 1 or sacrifice child",
    ];
    let (code, out, err) = check(&tmp.path, &yaml, Some(&(lines.join("\n") + "\n")));
    println!("{out}");
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("line 3  ")
            && out.contains(
                "Event OOMKilling: Kill process 4242 (java) score 900 or sacrifice child"
            ),
        "the pair fires, with both lines as the message:\n{out}"
    );
    for quiet in ["line 1  ", "line 2  ", "line 4  "] {
        assert!(!out.contains(quiet), "{quiet} alone must not fire:\n{out}");
    }
}

fn journal(at_secs: u64, message: &str) -> String {
    serde_json::json!({
        "__REALTIME_TIMESTAMP": (at_secs * 1_000_000).to_string(),
        "_TRANSPORT": "journal",
        "SYSLOG_IDENTIFIER": "systemd",
        "_SYSTEMD_UNIT": "init.scope",
        "MESSAGE": message,
    })
    .to_string()
}

/// NPD's systemd-monitor-counter.json: log-counter counts "Started" lines
/// and `--revert-pattern` takes one off for each clean "Stopping", so five
/// clean restarts are not frequent restarts, and five crashes (starts with
/// no stop) are.
#[test]
fn npds_restart_counter_counts_crashes_not_clean_restarts() {
    let (code, yaml, notes) = import(&["systemd-monitor-counter.json"]);
    assert_eq!(code, 0, "{notes}");
    let tmp = TempDir::new("npd-counter");
    let t0 = 1_795_428_000u64;
    let mut clean = Vec::new();
    for i in 0..6 {
        clean.push(journal(
            t0 + i * 60,
            "Stopping kubelet.service - Kubernetes kubelet...",
        ));
        clean.push(journal(
            t0 + i * 60 + 5,
            "Started kubelet.service - Kubernetes kubelet.",
        ));
    }
    let (code, out, err) = check(&tmp.path, &yaml, Some(&(clean.join("\n") + "\n")));
    println!("{out}");
    assert_eq!(code, 1, "clean restarts fire nothing:\n{out}{err}");
    let crashes: Vec<String> = (0..5)
        .map(|i| journal(t0 + i * 60, "Started kubelet.service - Kubernetes kubelet."))
        .collect();
    let (code, out, err) = check(&tmp.path, &yaml, Some(&(crashes.join("\n") + "\n")));
    println!("{out}");
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("line 5  ") && out.contains("FrequentKubeletRestart=True"),
        "the fifth start in 20 minutes:\n{out}"
    );
}

/// The imported kernel-monitor.json in the agent against the real control
/// plane: a line NPD would not fire on (it goes on past the pattern's end)
/// makes no Event, the one it fires on does, and XFS's shutdown line sets
/// the condition on the Node.
#[tokio::test]
async fn the_agent_runs_npds_kernel_monitor_as_npd_matches_it() {
    let (code, yaml, notes) = import(&["kernel-monitor.json"]);
    assert_eq!(code, 0, "{notes}");
    let docs = nodeguard::policy::load_policies("imported", &yaml).unwrap();
    let mut monitors = docs[0].policy.as_ref().unwrap().spec.monitors.clone();
    let logs = TempDir::new("npd-kmsg");
    let kmsg = logs.path.join("kmsg");
    std::fs::write(&kmsg, "6,1,1,-;boot\n").unwrap();
    monitors[0].source.kmsg.as_mut().unwrap().path = kmsg.display().to_string();
    // An NPD rule in Go's syntax: `\<`, `\>` are the characters, `\w` and
    // `\d` ASCII (Rust's regex alone reads word boundaries and Unicode).
    monitors[0].rules.push(
        serde_json::from_value(serde_json::json!({
            "type": "temporary", "reason": "GoSyntax", "pattern": r"\<\w+\> stuck for \d+s",
        }))
        .unwrap(),
    );
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "npd").await;
    let policy = unique_name("npd");
    apply_policy(
        &admin,
        &policy,
        serde_json::json!({"nodeSelector": selecting(&node.name), "monitors": monitors}),
    )
    .await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;
    wait_condition(
        &admin,
        &node.name,
        "XfsShutdown",
        "False",
        Duration::from_secs(20),
        "XfsShutdown=False at start",
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    {
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&kmsg)
            .unwrap();
        writeln!(f, "4,100,1000000,-;divide error: 0000 [#1] SMP PTI").unwrap();
        writeln!(f, "4,101,1000001,-;divide error: 0000 [#2] SMP").unwrap();
        writeln!(f, "4,103,1000003,-;<kwörker> stuck for 5s").unwrap();
        writeln!(f, "4,104,1000004,-;<kworker> stuck for ٥s").unwrap();
        writeln!(f, "4,105,1000005,-;<kworker> stuck for 5s").unwrap();
        writeln!(
            f,
            "3,106,1000006,-;XFS (dm-0): Log I/O Error Detected. Shutting down filesystem"
        )
        .unwrap();
    }
    wait_condition(
        &admin,
        &node.name,
        "XfsShutdown",
        "True",
        Duration::from_secs(10),
        "XfsShutdown=True from the XFS line",
    )
    .await;
    let events = kubectl(&[
        "get",
        "events",
        "-A",
        "--field-selector",
        &format!("involvedObject.name={},reason=KernelOops", node.name),
        "-o",
        "jsonpath={range .items[*]}{.message}{\"\\n\"}{end}",
    ]);
    assert!(
        events.contains("divide error: 0000 [#2] SMP") && !events.contains("PTI"),
        "one KernelOops Event, for the line NPD fires on:\n{events}"
    );
    let go_events = || {
        kubectl(&[
            "get",
            "events",
            "-A",
            "--field-selector",
            &format!("involvedObject.name={},reason=GoSyntax", node.name),
            "-o",
            "jsonpath={range .items[*]}{.message}{\"\\n\"}{end}",
        ])
    };
    eventually(Duration::from_secs(10), "the GoSyntax Event", || {
        std::future::ready(!go_events().trim().is_empty())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let go = go_events();
    assert_eq!(
        go.trim(),
        "<kworker> stuck for 5s",
        "the Go pattern fires as in Go: on the ASCII line only"
    );
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

/// One kernel log line as syslog writes it, timed now (NPD parses the time
/// with its `timestamp` pattern and skips lines it cannot).
fn kern_line(uptime: f64, msg: &str) -> String {
    let ts = jiff::Zoned::now()
        .with_time_zone(jiff::tz::TimeZone::system())
        .strftime("%b %e %H:%M:%S")
        .to_string();
    format!("{ts} oracle kernel: [{uptime:>12.6}] {msg}\n")
}

/// The oracle: node-problem-detector itself (its binary, built from its Go
/// module by bench/npd-build) and nodeguard with `import-npd` of the same
/// config (NPD's kernel-monitor-filelog.json) read the same kern.log, each
/// for its own Node on the real control plane; the Events and conditions
/// they write must be the same. The table is printed.
#[tokio::test]
async fn npd_and_nodeguard_write_the_same_events_and_conditions_for_one_kern_log() {
    let npd_dir = npd_build_dir();
    let admin = admin_client().await;
    let npd_node = TestNode::create(&admin, "oracle-npd", &[]).await;
    let ng_node = TestNode::selectable(&admin, "oracle-ng").await;
    let tmp = TempDir::new("npd-oracle");
    let log = tmp.path.join("kern.log");
    std::fs::write(&log, "").unwrap();
    let mut config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(npd_configs().join("kernel-monitor-filelog.json")).unwrap(),
    )
    .unwrap();
    config["logPath"] = log.display().to_string().into();
    let config_path = tmp.path.join("kernel-monitor-filelog.json");
    std::fs::write(&config_path, config.to_string()).unwrap();
    let types: Vec<String> = config["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["type"].as_str().unwrap().to_string())
        .collect();
    let reasons: Vec<String> = config["rules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["reason"].as_str().unwrap().to_string())
        .collect();

    // NPD, as bench/npd.rs runs it.
    let npd = Npd::start(
        &npd_dir.join("nodeproblemdetector"),
        &npd_node.name,
        &[format!(
            "--config.system-log-monitor={}",
            config_path.display()
        )],
        tmp.path.join("npd.log"),
    );

    // nodeguard with the imported config.
    let (code, yaml, notes) = nodeguard(&["import-npd", config_path.to_str().unwrap()]);
    assert_eq!(code, 0, "{notes}");
    let docs = nodeguard::policy::load_policies("imported", &yaml).unwrap();
    let monitors = docs[0].policy.as_ref().unwrap().spec.monitors.clone();
    let policy = unique_name("oracle");
    apply_policy(
        &admin,
        &policy,
        serde_json::json!({"nodeSelector": selecting(&ng_node.name), "monitors": monitors}),
    )
    .await;
    let (agent, _state) = start_agent(admin.clone(), &ng_node.name).await;

    // Both have written their conditions' no-problem state.
    for node in [&npd_node.name, &ng_node.name] {
        wait_condition(
            &admin,
            node,
            "KernelDeadlock",
            "False",
            Duration::from_secs(60),
            "KernelDeadlock=False at start",
        )
        .await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Both exporters before any problem: every reason's counter and every
    // permanent rule's gauge at 0 (what an alert's increase() starts from).
    let before = same_problem_scrapes(npd.metrics, agent.addr).await;
    // Lines NPD's own rules are about, with what the kernel really prints
    // around them, and noise.
    let corpus = [
        "divide error: 0000 [#1] SMP PTI",
        "divide error: 0000 [#2] SMP",
        "BUG: unable to handle kernel NULL pointer dereference at 0000000000000010",
        "IPv6: ADDRCONF(NETDEV_CHANGE): veth1a2b3c: link becomes ready",
        "INFO: task kworker/u8:2:1234 blocked for more than 120 seconds.",
        "unregister_netdevice: waiting for lo to become free. Usage count = 1",
        "Out of memory: Killed process 4242 (java) total-vm:123456kB, anon-rss:65432kB, file-rss:123kB, shmem-rss:0kB",
        "Memory cgroup out of memory: Killed process 77 (python3) total-vm:1048576kB, anon-rss:524288kB, file-rss:2048kB, shmem-rss:0kB, UID:0 pgtables:1024kB oom_score_adj:0",
        "INFO: task docker:20744 blocked for more than 120 seconds.",
        "INFO: task docker:20745 blocked for more than 121 seconds.",
        "EXT4-fs error (device sda1): ext4_lookup:1855: inode #2: comm ls: deleted inode referenced: 12",
    ];
    {
        let mut f = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
        for (i, line) in corpus.iter().enumerate() {
            f.write_all(kern_line(1000.0 + i as f64, line).as_bytes())
                .unwrap();
        }
    }
    // Until both show the same, or 40 s (NPD writes conditions on its
    // resync period).
    let deadline = std::time::Instant::now() + Duration::from_secs(40);
    let (npd_seen, ng_seen) = loop {
        let a = shown(&admin, &npd_node.name, &types, &reasons).await;
        let b = shown(&admin, &ng_node.name, &types, &reasons).await;
        let settled = !a.0.is_empty() && a.1.iter().any(|c| c.contains("=True"));
        if (settled && a == b) || std::time::Instant::now() > deadline {
            break (a, b);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    // NPD's problem metrics, under NPD's names, from each one's scrape.
    let after = same_problem_scrapes(npd.metrics, agent.addr).await;
    let (npd_metrics, ng_metrics) = (problem_samples(&after.0), problem_samples(&after.1));
    let npd_log = npd.output();
    drop(npd);
    agent.stop().await;
    delete_policy(&admin, &policy).await;
    let metrics_table = oracle_table(
        &(npd_metrics.clone(), vec![]),
        &(ng_metrics.clone(), vec![]),
    );
    println!(
        "conformance: NPD's problem metrics from node-problem-detector's Prometheus exporter and from the agent's /metrics, same kern.log\n\n{metrics_table}"
    );
    assert!(
        npd_metrics.iter().any(
            |s| s.starts_with("problem_gauge{reason=\"DockerHung\",type=\"KernelDeadlock\"} 1")
        ),
        "NPD's exporter did not show the problem:\n{metrics_table}"
    );
    assert_eq!(
        npd_metrics, ng_metrics,
        "NPD's problem metrics differ:\n{metrics_table}"
    );
    // Alerts written for NPD, of the community chart's two shapes, for
    // every rule of this config: promtool fires on the agent's scrapes the
    // ones NPD's scrapes fire.
    let alerts = support::alerts::npd_style_alerts(&config);
    let firing = npd_alerts_fire_alike(&alerts, &before, &after);
    println!(
        "conformance: alerts of the NPD community chart's shape over each exporter's two scrapes, by promtool: {} of {} fire on both: {}",
        firing.len(),
        alerts.len(),
        firing.join(", ")
    );
    let table = oracle_table(&npd_seen, &ng_seen);
    println!(
        "conformance: node-problem-detector's binary and the agent side by side on one kern.log (NPD's kernel-monitor-filelog.json and its import), each for its own Node on the real control plane: what each wrote\n\n{table}"
    );
    assert!(
        npd_seen.1.iter().any(|c| c.contains("KernelDeadlock=True")),
        "NPD did not act on the log (its log follows):\n{table}\n{npd_log}"
    );
    assert_eq!(
        npd_seen, ng_seen,
        "nodeguard differs from node-problem-detector on the same lines:\n{table}"
    );
}

/// `problem_counter` and `problem_gauge` samples from NPD's exporter at
/// `npd` and the agent at `agent`, scraped until they agree or 20 s pass
/// (NPD's exporter aggregates its views as it is scraped).
async fn same_problem_metrics(
    npd: std::net::SocketAddr,
    agent: std::net::SocketAddr,
) -> (Vec<String>, Vec<String>) {
    let (a, b) = same_problem_scrapes(npd, agent).await;
    (problem_samples(&a), problem_samples(&b))
}

/// The `problem_counter` and `problem_gauge` samples of a scrape.
fn problem_samples(body: &str) -> Vec<String> {
    let mut s = samples_of(body, "problem_counter");
    s.extend(samples_of(body, "problem_gauge"));
    s
}

/// Whole /metrics of NPD's exporter at `npd` and of the agent at `agent`,
/// scraped until their `problem_counter` and `problem_gauge` samples agree
/// or 20 s pass; (NPD's, the agent's).
async fn same_problem_scrapes(
    npd: std::net::SocketAddr,
    agent: std::net::SocketAddr,
) -> (String, String) {
    let scrape = |addr| async move {
        let (code, body) = http_get(addr, "/metrics").await;
        assert_eq!(code, 200, "{body}");
        body
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (a, b) = (scrape(npd).await, scrape(agent).await);
        let (sa, sb) = (problem_samples(&a), problem_samples(&b));
        if (!sa.is_empty() && sa == sb) || std::time::Instant::now() > deadline {
            return (a, b);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Runs `alerts` (NPD-shaped, support::alerts::npd_style_alerts) with the
/// real promtool over NPD's scrapes (`before.0` then `after.0`) and over the
/// agent's (`.1`), as one target with the same labels: on each side exactly
/// the alerts NPD's series step fires, and at least one. The names of the
/// alerts that fire.
fn npd_alerts_fire_alike(
    rules: &[support::alerts::NpdAlert],
    before: &(String, String),
    after: &(String, String),
) -> Vec<String> {
    use support::alerts::{
        check_rules, npd_alert_groups, npd_alerts_firing, step_test, test_rules,
    };
    let target = [
        ("job", "monitoring/node-problem-detector"),
        ("instance", "10.0.0.7:20257"),
        ("namespace", "monitoring"),
        ("pod", "node-problem-detector-x7k2p"),
        ("node", "node-7"),
    ];
    let firing = npd_alerts_firing(rules, &before.0, &after.0, &target);
    assert!(
        !firing.is_empty(),
        "no NPD-shaped alert fires on NPD's own scrapes:\nbefore:\n{}\nafter:\n{}",
        before.0,
        after.0
    );
    let dir = TempDir::new("npd-alerts");
    check_rules(&dir.path, &npd_alert_groups(rules));
    for (side, b, a) in [
        ("node-problem-detector", &before.0, &after.0),
        ("nodeguard", &before.1, &after.1),
    ] {
        let test = step_test(rules, b, a, &target, &firing);
        std::fs::write(
            dir.path.join("step_test.yaml"),
            serde_json::to_vec_pretty(&test).unwrap(),
        )
        .unwrap();
        let (ok, out) = test_rules(&dir.path, "step_test.yaml");
        assert!(
            ok,
            "NPD's alerts on {side}'s scrapes do not fire as on NPD's:\n{out}"
        );
    }
    let mut names: Vec<String> = firing.into_iter().map(|(name, _)| name).collect();
    names.dedup();
    names
}

/// Microseconds since the epoch, now.
fn now_usec() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

/// The oracle for NPD's journal configs of the GCE set: node-problem-detector
/// built with its journald plugin (bench/npd-build), running docker-monitor
/// and systemd-monitor as system-log-monitors and kernel-monitor-counter and
/// systemd-monitor-counter as custom-plugin-monitors with NPD's own
/// log-counter binary, and the agent with `import-npd` of the same four
/// files, each for its own Node on the real control plane, read one journal
/// directory; the Events and conditions they write must be the same.
///
/// The configs are NPD's, with what points at the host changed: the journal
/// directory (`logPath`, `--log-path`), log-counter's path, the counters'
/// `invoke_interval` (5 s instead of 5 min, so the test does not wait
/// minutes for NPD's next look), log-counter's `--delay` (time after
/// boot to ignore; the node under test booted long ago, this machine
/// perhaps not) and kernel-monitor-counter's `--lookback` (30 s instead of
/// 20 min, so its condition clears within the test: the clear is compared
/// too).
#[tokio::test]
async fn npd_and_nodeguard_write_the_same_for_npds_journal_configs() {
    let npd_dir = npd_build_dir();
    let admin = admin_client().await;
    let npd_node = TestNode::create(&admin, "oracle-jnpd", &[]).await;
    let ng_node = TestNode::selectable(&admin, "oracle-jng").await;
    let tmp = TempDir::new("npd-journal-oracle");
    let journal = tmp.path.join("journal");
    std::fs::create_dir(&journal).unwrap();
    let journal_path = journal.display().to_string();
    let log_counter = npd_dir.join("log-counter").display().to_string();
    let mut types = Vec::new();
    let mut reasons = Vec::new();
    let mut written = Vec::new();
    for (file, custom) in [
        ("docker-monitor.json", false),
        ("systemd-monitor.json", false),
        ("kernel-monitor-counter.json", true),
        ("systemd-monitor-counter.json", true),
    ] {
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(npd_configs().join(file)).unwrap())
                .unwrap();
        if custom {
            config["pluginConfig"]["invoke_interval"] = "5s".into();
            for rule in config["rules"].as_array_mut().unwrap() {
                assert!(rule["path"].as_str().unwrap().ends_with("/log-counter"));
                rule["path"] = log_counter.clone().into();
                let args: Vec<serde_json::Value> = rule["args"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .filter(|a| !a.as_str().unwrap().starts_with("--delay="))
                    .map(|a| match a.as_str().unwrap() {
                        a if a.starts_with("--log-path=") => {
                            format!("--log-path={journal_path}").into()
                        }
                        a if a.starts_with("--lookback=") && file.starts_with("kernel-") => {
                            "--lookback=30s".into()
                        }
                        a => a.into(),
                    })
                    .collect();
                rule["args"] = args.into();
            }
        } else {
            config["logPath"] = journal_path.clone().into();
        }
        for c in config["conditions"].as_array().unwrap() {
            types.push(c["type"].as_str().unwrap().to_string());
            // The reason of a clear's Event.
            reasons.push(c["reason"].as_str().unwrap().to_string());
        }
        for r in config["rules"].as_array().unwrap() {
            reasons.push(r["reason"].as_str().unwrap().to_string());
        }
        let path = tmp.path.join(file);
        std::fs::write(&path, config.to_string()).unwrap();
        written.push((path.display().to_string(), custom));
    }
    let list = |custom: bool| {
        written
            .iter()
            .filter(|(_, c)| *c == custom)
            .map(|(p, _)| p.as_str())
            .collect::<Vec<_>>()
            .join(",")
    };
    let npd = Npd::start(
        &npd_dir.join("nodeproblemdetector-journald"),
        &npd_node.name,
        &[
            format!("--config.system-log-monitor={}", list(false)),
            format!("--config.custom-plugin-monitor={}", list(true)),
        ],
        tmp.path.join("npd.log"),
    );

    let mut args = vec!["import-npd"];
    args.extend(written.iter().map(|(p, _)| p.as_str()));
    let (code, yaml, notes) = nodeguard(&args);
    assert_eq!(code, 0, "{notes}");
    let docs = nodeguard::policy::load_policies("imported", &yaml).unwrap();
    let monitors = docs[0].policy.as_ref().unwrap().spec.monitors.clone();
    let policy = unique_name("oracle-journal");
    apply_policy(
        &admin,
        &policy,
        serde_json::json!({"nodeSelector": selecting(&ng_node.name), "monitors": monitors}),
    )
    .await;
    let (agent, _state) = start_agent(admin.clone(), &ng_node.name).await;
    for node in [&npd_node.name, &ng_node.name] {
        for t in ["CorruptDockerOverlay2", "FrequentKubeletRestart"] {
            wait_condition(
                &admin,
                node,
                t,
                "False",
                Duration::from_secs(60),
                &format!("{t}=False at start"),
            )
            .await;
        }
    }
    // Both readers are at the journal's end (NPD's log-counter reads its
    // 20-minute lookback on every run, which holds nothing yet).
    tokio::time::sleep(Duration::from_secs(3)).await;
    // What dockerd, systemd (systemd >= 252 names units with their
    // description) and the kernel write into the journal around the
    // problems these configs are about; containerd's line is another
    // identifier's.
    let corpus = [
        (
            "dockerd",
            "time=\"2026-11-24T10:00:00.000000000Z\" level=error msg=\"Handler for GET /v1.41/containers/3f2a/json returned error: readlink /var/lib/docker/overlay2/l/ZK3QWE5Y: invalid argument\"",
        ),
        (
            "containerd",
            "returned error: readlink /var/lib/docker/overlay2/l/ABC: invalid argument",
        ),
        (
            "dockerd",
            "Error trying v2 registry: failed to register layer: rename /var/lib/docker/image/overlay2/layerdb/tmp/write-set-1 /var/lib/docker/image/overlay2/layerdb/sha256/5f70: directory not empty",
        ),
        (
            "systemd",
            "Starting docker.service - Docker Application Container Engine...",
        ),
        ("systemd", "Started kubelet.service - Kubernetes kubelet."),
        (
            "systemd",
            "Stopping kubelet.service - Kubernetes kubelet...",
        ),
        ("systemd", "kubelet.service: Deactivated successfully."),
        ("systemd", "Started kubelet.service - Kubernetes kubelet."),
        (
            "systemd",
            "Starting containerd.service - containerd container runtime...",
        ),
        (
            "kernel",
            "unregister_netdevice: waiting for lo to become free. Usage count = 1",
        ),
        (
            "systemd",
            "kubelet.service: Main process exited, code=killed, status=9/KILL",
        ),
        ("systemd", "Started kubelet.service - Kubernetes kubelet."),
        (
            "kernel",
            "unregister_netdevice: waiting for eth0 to become free. Usage count = 2",
        ),
        ("systemd", "Started kubelet.service - Kubernetes kubelet."),
        (
            "systemd",
            "Starting containerd.service - containerd container runtime...",
        ),
        ("systemd", "Started kubelet.service - Kubernetes kubelet."),
        (
            "kernel",
            "unregister_netdevice: waiting for lo to become free. Usage count = 1",
        ),
        // Six starts, one of them after a clean stop (log-counter's
        // --revert-pattern takes it off): five crashes.
        ("systemd", "Started kubelet.service - Kubernetes kubelet."),
    ];
    for (identifier, message) in corpus {
        journal_entry(&journal, identifier, message, now_usec());
        std::thread::sleep(Duration::from_millis(20));
    }
    // Until both show the same, or 100 s (NPD runs log-counter every 5 s;
    // the netdevice counter clears 30 s after its lines).
    let deadline = std::time::Instant::now() + Duration::from_secs(100);
    let (npd_seen, ng_seen) = loop {
        let a = shown(&admin, &npd_node.name, &types, &reasons).await;
        let b = shown(&admin, &ng_node.name, &types, &reasons).await;
        let settled = ["CorruptDockerOverlay2", "FrequentKubeletRestart"]
            .iter()
            .all(|t| a.1.iter().any(|c| c.starts_with(&format!("{t}=True"))))
            && a.0
                .iter()
                .any(|e| e.contains("Node condition FrequentUnregisterNetDevice is now: False"));
        if (settled && a == b) || std::time::Instant::now() > deadline {
            break (a, b);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    let (npd_metrics, ng_metrics) = same_problem_metrics(npd.metrics, agent.addr).await;
    let npd_log = npd.output();
    drop(npd);
    agent.stop().await;
    delete_policy(&admin, &policy).await;
    let metrics_table = oracle_table(
        &(npd_metrics.clone(), vec![]),
        &(ng_metrics.clone(), vec![]),
    );
    println!(
        "conformance: NPD's problem metrics from node-problem-detector's Prometheus exporter and from the agent's /metrics, same journal\n\n{metrics_table}"
    );
    let table = oracle_table(&npd_seen, &ng_seen);
    println!(
        "conformance: node-problem-detector's binary (journald plugin, log-counter) and the agent side by side on one journal (NPD's docker-monitor, systemd-monitor, kernel-monitor-counter and systemd-monitor-counter, and their import), each for its own Node on the real control plane: what each wrote\n\n{table}"
    );
    assert!(
        npd_seen
            .1
            .iter()
            .any(|c| c.starts_with("FrequentKubeletRestart=True"))
            && npd_seen
                .0
                .iter()
                .any(|e| { e.contains("Node condition FrequentUnregisterNetDevice is now: True") }),
        "NPD did not act on the journal (its log follows):\n{table}\n{npd_log}"
    );
    assert_eq!(
        npd_seen, ng_seen,
        "nodeguard differs from node-problem-detector on the same journal:\n{table}\n{npd_log}"
    );
    assert!(
        npd_metrics.iter().any(|s| s.starts_with(
            "problem_gauge{reason=\"FrequentKubeletRestart\",type=\"FrequentKubeletRestart\"} 1"
        )),
        "NPD's exporter did not show the problem:\n{metrics_table}"
    );
    assert_eq!(
        npd_metrics, ng_metrics,
        "NPD's problem metrics differ:\n{metrics_table}"
    );
}

/// NPD's systemd-monitor-counter.json with its log-counter reading the
/// journal directory `journal`, written under `dir` and imported: the
/// policy's YAML and its monitors.
fn import_systemd_counter(
    dir: &std::path::Path,
    journal: &std::path::Path,
) -> (String, Vec<nodeguard::policy::monitors::MonitorSpec>) {
    let mut config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(npd_configs().join("systemd-monitor-counter.json")).unwrap(),
    )
    .unwrap();
    for rule in config["rules"].as_array_mut().unwrap() {
        let args: Vec<serde_json::Value> = rule["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| match a.as_str().unwrap() {
                a if a.starts_with("--log-path=") => {
                    format!("--log-path={}", journal.display()).into()
                }
                a => a.into(),
            })
            .collect();
        rule["args"] = args.into();
    }
    let path = dir.join("systemd-monitor-counter.json");
    std::fs::write(&path, config.to_string()).unwrap();
    let (code, yaml, notes) = nodeguard(&["import-npd", path.to_str().unwrap()]);
    assert_eq!(code, 0, "{notes}");
    let docs = nodeguard::policy::load_policies("imported", &yaml).unwrap();
    let monitors = docs[0].policy.as_ref().unwrap().spec.monitors.clone();
    (yaml, monitors)
}

/// NPD's log-counter never counts what an earlier boot logged, so NPD
/// starts each boot with its counter conditions False. An imported counter
/// condition (it has `clearAfterSeconds`, the counter's lookback) was kept
/// True across a reboot for up to that window, with its taint; it now
/// resets at the new boot.
#[tokio::test]
async fn an_imported_counter_condition_starts_a_new_boot_false_as_in_npd() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "counter-boot").await;
    let tmp = TempDir::new("counter-boot");
    let journal = tmp.path.join("journal");
    std::fs::create_dir(&journal).unwrap();
    let (yaml, monitors) = import_systemd_counter(&tmp.path, &journal);
    let kubelet = monitors
        .iter()
        .find(|m| {
            m.conditions
                .iter()
                .any(|c| c.type_ == "FrequentKubeletRestart")
        })
        .unwrap();
    assert!(
        kubelet.conditions[0].clear_after_seconds.is_some(),
        "the import clears it after its lookback: {yaml}"
    );
    let policy = unique_name("counter-boot");
    apply_policy(
        &admin,
        &policy,
        serde_json::json!({"nodeSelector": selecting(&node.name), "monitors": monitors}),
    )
    .await;
    // What boot A's agent left: the kubelet restarted five times.
    let state = TempDir::new("counter-boot-state");
    let now = jiff::Timestamp::now().to_string();
    write_saved_state(
        &state.path,
        &kubelet.name,
        serde_json::json!({"bootId": "boot-a", "conditions": {"FrequentKubeletRestart": {
            "active": true, "reason": "FrequentKubeletRestart",
            "message": "Found 5 matching logs, which meets the threshold of 5",
            "since": now, "lastMatch": now, "taintAdded": false}}, "cursor": {}}),
    );
    let state_dir = state.path.clone();
    let (agent, _unused) = start_agent_with(admin.clone(), &node.name, |c| {
        c.state_dir = state_dir;
        c.boot_id = "boot-b".into();
    })
    .await;
    wait_condition(
        &admin,
        &node.name,
        "FrequentKubeletRestart",
        "False",
        Duration::from_secs(15),
        "FrequentKubeletRestart=False in the new boot",
    )
    .await;
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

/// log-counter counts its whole lookback on every run. So NPD's counter
/// condition goes False at the next run after a clean stop takes the count
/// under the threshold, and crashes before an NPD restart still count after
/// it. The agent with the import cleared it only a whole window after the
/// last match, and forgot its counts when it restarted.
#[tokio::test]
async fn an_imported_counter_counts_across_restarts_and_clears_as_log_counter_does() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "counter-window").await;
    let tmp = TempDir::new("counter-window");
    let journal = tmp.path.join("journal");
    std::fs::create_dir(&journal).unwrap();
    let (_, monitors) = import_systemd_counter(&tmp.path, &journal);
    let policy = unique_name("counter-window");
    apply_policy(
        &admin,
        &policy,
        serde_json::json!({"nodeSelector": selecting(&node.name), "monitors": monitors}),
    )
    .await;
    let state = TempDir::new("counter-window-state");
    let start = |admin: kube::Client| {
        let state_dir = state.path.clone();
        let node = node.name.clone();
        async move {
            start_agent_with(admin, &node, |c| c.state_dir = state_dir)
                .await
                .0
        }
    };
    let agent = start(admin.clone()).await;
    wait_condition(
        &admin,
        &node.name,
        "FrequentKubeletRestart",
        "False",
        Duration::from_secs(15),
        "FrequentKubeletRestart=False at start",
    )
    .await;
    let log = |message: &str| {
        journal_entry(&journal, "systemd", message, now_usec());
        std::thread::sleep(Duration::from_millis(20));
    };
    for _ in 0..4 {
        log("Started kubelet.service - Kubernetes kubelet.");
    }
    // Let the agent read and save them, then restart it.
    tokio::time::sleep(Duration::from_secs(3)).await;
    agent.stop().await;
    let agent = start(admin.clone()).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    log("Started kubelet.service - Kubernetes kubelet.");
    wait_condition(
        &admin,
        &node.name,
        "FrequentKubeletRestart",
        "True",
        Duration::from_secs(15),
        "FrequentKubeletRestart=True: four starts before the agent's restart and one after",
    )
    .await;
    // A clean stop: four in the window, under the threshold.
    log("Stopping kubelet.service - Kubernetes kubelet...");
    wait_condition(
        &admin,
        &node.name,
        "FrequentKubeletRestart",
        "False",
        Duration::from_secs(15),
        "FrequentKubeletRestart=False once a clean stop leaves four",
    )
    .await;
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

/// A kernel record as `/dev/kmsg` gives it.
fn kmsg(seq: u32, msg: &str) -> String {
    format!("4,{seq},{},-;{msg}", 1_000_000 + seq)
}

/// A journal entry of `identifier` at `at_secs`.
fn journal_of(identifier: &str, at_secs: u64, message: &str) -> String {
    serde_json::json!({
        "__REALTIME_TIMESTAMP": (at_secs * 1_000_000).to_string(),
        "_TRANSPORT": if identifier == "kernel" { "kernel" } else { "journal" },
        "SYSLOG_IDENTIFIER": identifier,
        "MESSAGE": message,
    })
    .to_string()
}

/// The problem steps of a `check --replay` output: (line, what) with the
/// monitor's name and the message left out, as "Event R" or "C=True (R)".
fn steps(out: &str) -> std::collections::BTreeSet<(usize, String)> {
    out.lines()
        .filter_map(|l| {
            let rest = l.trim_start().strip_prefix("line ")?;
            let (n, rest) = rest.split_once(' ')?;
            let (_, what) = rest.split_once(": ")?;
            let what = match what.split_once(": ") {
                Some((w, _)) => w,
                None => what,
            };
            (what.starts_with("Event ") || what.contains("=True"))
                .then(|| (n.parse().unwrap(), what.to_string()))
        })
        .collect()
}

/// `nodeguard default-policy` holds NPD's standard problem monitors (the
/// GCE set: kernel-monitor, readonly-monitor, docker-monitor and the kernel
/// and systemd counters of the release): each NPD condition with its
/// healthy reason and message, each rule's reason with its condition and
/// kind; and on lines NPD's rules are about, the default policy takes every
/// step the imported NPD configs take (it may take more: its own extra
/// rules, and kernel patterns that do not need NPD's end anchor).
#[test]
fn the_default_policy_holds_npds_standard_monitors() {
    let set = [
        "kernel-monitor.json",
        "readonly-monitor.json",
        "docker-monitor.json",
        "kernel-monitor-counter.json",
        "systemd-monitor-counter.json",
    ];
    let (code, default_yaml, err) = nodeguard(&["default-policy"]);
    assert_eq!(code, 0, "{err}");
    let docs = nodeguard::policy::load_policies("default", &default_yaml).unwrap();
    let spec = &docs[0].policy.as_ref().unwrap().spec;
    let conditions: Vec<(String, String, String)> = spec
        .monitors
        .iter()
        .flat_map(|m| &m.conditions)
        .map(|c| (c.type_.clone(), c.reason.clone(), c.message.clone()))
        .collect();
    let rules: Vec<(String, Option<String>, bool)> = spec
        .monitors
        .iter()
        .flat_map(|m| &m.rules)
        .map(|r| {
            (
                r.reason.clone(),
                r.condition.clone(),
                r.kind == nodeguard::policy::monitors::ProblemKind::Permanent,
            )
        })
        .collect();
    let mut missing = Vec::new();
    for name in set {
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(npd_configs().join(name)).unwrap())
                .unwrap();
        for c in config["conditions"].as_array().unwrap() {
            let want = (
                c["type"].as_str().unwrap().to_string(),
                c["reason"].as_str().unwrap().to_string(),
                c["message"].as_str().unwrap().to_string(),
            );
            if !conditions.contains(&want) {
                missing.push(format!("{name}: condition {want:?}"));
            }
        }
        for r in config["rules"].as_array().unwrap() {
            let want = (
                r["reason"].as_str().unwrap().to_string(),
                r["condition"].as_str().map(str::to_string),
                r["type"] == "permanent",
            );
            if !rules.contains(&want) {
                missing.push(format!("{name}: rule {want:?}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "the default policy lacks NPD's:\n{}",
        missing.join("\n")
    );

    // The same lines through the imported set and the default policy.
    let t0 = 1_795_428_000u64;
    let mut lines = vec![
        kmsg(1, "divide error: 0000 [#1] SMP"),
        kmsg(2, "divide error: 0000 [#2] SMP PTI"),
        kmsg(
            3,
            "BUG: unable to handle kernel NULL pointer dereference at 0000000000000010",
        ),
        kmsg(
            4,
            "Out of memory: Killed process 4242 (java) total-vm:123456kB, anon-rss:65432kB, file-rss:123kB, shmem-rss:0kB",
        ),
        kmsg(
            5,
            "INFO: task docker:20744 blocked for more than 120 seconds.",
        ),
        kmsg(
            6,
            "INFO: task kworker/u8:2:1234 blocked for more than 120 seconds.",
        ),
        kmsg(
            7,
            "EXT4-fs error (device sda1): ext4_lookup:1855: inode #2: comm ls: deleted inode referenced: 12",
        ),
        kmsg(
            8,
            "EXT4-fs warning (device sda1): ext4_dx_add_entry:2461: Directory index full!",
        ),
        kmsg(
            9,
            "Buffer I/O error on dev sdb1, logical block 0, async page read",
        ),
        kmsg(
            10,
            "XFS (dm-0): Log I/O Error Detected. Shutting down filesystem",
        ),
        kmsg(11, "EXT4-fs (sda1): Remounting filesystem read-only"),
        kmsg(12, "CE memory read error on CPU_SrcID#0_Ha#0_Chan#1_DIMM#0"),
        kmsg(13, "{1}[Hardware Error]: event severity: corrected"),
        kmsg(14, "{2}[Hardware Error]: event severity: recoverable"),
        kmsg(15, "{3}[Hardware Error]: event severity: fatal"),
        kmsg(
            16,
            "task umount.aufs:123 blocked for more than 120 seconds.",
        ),
        journal_of(
            "dockerd",
            t0,
            "Handler for POST /containers/abc/start returned error: readlink /var/lib/docker/overlay2/l: invalid argument",
        ),
        journal_of(
            "dockerd",
            t0 + 1,
            "Error trying v2 registry: failed to register layer: rename /var/lib/docker/image/overlay2/layerdb/tmp/write-set-1 /var/lib/docker/image/overlay2/layerdb/sha256/abc: directory not empty",
        ),
        journal_of(
            "dockerd",
            t0 + 2,
            "starting container failed: OCI runtime start failed: container process is already dead: unknown",
        ),
    ];
    for i in 0..3 {
        lines.push(journal_of(
            "kernel",
            t0 + 10 + i * 60,
            "unregister_netdevice: waiting for eth0 to become free. Usage count = 2",
        ));
    }
    // Clean restarts (a stop before each start) and then crashes.
    for (i, unit) in ["kubelet", "docker", "containerd"].iter().enumerate() {
        let (start, stop) = match *unit {
            "kubelet" => (
                "Started kubelet.service - Kubernetes kubelet.",
                "Stopping kubelet.service - Kubernetes kubelet...",
            ),
            "docker" => (
                "Starting docker.service - Docker Application Container Engine...",
                "Stopping docker.service - Docker Application Container Engine...",
            ),
            _ => (
                "Starting containerd.service - containerd container runtime...",
                "Stopping containerd.service - containerd container runtime...",
            ),
        };
        let base = t0 + 300 + i as u64 * 1000;
        for k in 0..3 {
            lines.push(journal_of("systemd", base + k * 20, stop));
            lines.push(journal_of("systemd", base + k * 20 + 5, start));
        }
        for k in 0..5 {
            lines.push(journal_of("systemd", base + 100 + k * 20, start));
        }
    }
    let log = lines.join("\n") + "\n";
    let tmp = TempDir::new("npd-defaults");
    let (code, imported, notes) = import(&set);
    assert_eq!(code, 0, "{notes}");
    let (_, npd_out, err) = check(&tmp.path, &imported, Some(&log));
    println!("imported NPD set:\n{npd_out}{err}");
    let (_, ng_out, err) = check(&tmp.path, &default_yaml, Some(&log));
    println!("default policy:\n{ng_out}{err}");
    let npd = steps(&npd_out);
    let ng = steps(&ng_out);
    let mut table = String::from(
        "| line | step | NPD's configs (imported) | default policy | verdict |\n|---|---|---|---|---|\n",
    );
    let mut all: Vec<&(usize, String)> = npd.iter().chain(&ng).collect();
    all.sort();
    all.dedup();
    for step in &all {
        let (a, b) = (npd.contains(step), ng.contains(step));
        table.push_str(&format!(
            "| {} | {} | {} | {} | {} |\n",
            step.0,
            step.1,
            if a { "yes" } else { "no" },
            if b { "yes" } else { "no" },
            match (a, b) {
                (true, true) => "same",
                (false, true) => "nodeguard's own",
                _ => "MISSING",
            }
        ));
    }
    println!(
        "conformance: `nodeguard default-policy` beside NPD's standard set (kernel-monitor, readonly-monitor, docker-monitor, kernel-monitor-counter, systemd-monitor-counter, imported) on the same kernel and journal lines: the steps each takes\n\n{table}"
    );
    assert!(
        npd.len() >= 20,
        "the corpus exercises NPD's rules:\n{table}"
    );
    assert!(
        npd.is_subset(&ng),
        "the default policy misses steps NPD's configs take:\n{table}"
    );
}

/// Every pattern of NPD's configs in the release, NPD's (Go) patterns that
/// Rust reads differently, and inputs around them.
fn go_patterns() -> Vec<String> {
    let mut out = Vec::new();
    let dir = npd_configs();
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    names.sort();
    for path in names {
        let Ok(config) =
            serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(&path).unwrap())
        else {
            continue;
        };
        if let Some(m) = config
            .pointer("/pluginConfig/message")
            .and_then(|v| v.as_str())
        {
            out.push(m.to_string());
        }
        for r in config["rules"].as_array().into_iter().flatten() {
            if let Some(p) = r["pattern"].as_str() {
                out.push(p.to_string());
            }
            for a in r["args"].as_array().into_iter().flatten() {
                let a = a.as_str().unwrap_or_default();
                for flag in ["--pattern=", "--revert-pattern="] {
                    if let Some(p) = a.strip_prefix(flag) {
                        out.push(p.to_string());
                    }
                }
            }
        }
    }
    assert!(out.len() >= 40, "NPD's configs hold patterns: {out:?}");
    for p in [
        r"\d+ kB",
        r"^\w+$",
        r"\s+$",
        r"error\b",
        r"\bé",
        r"\<html\>",
        r"[a&&b]",
        r"[x~~y]",
        r"[a--b]",
        r"[[]",
        r"[]a]",
        r"a{,3}",
        r"x{foo}",
        r"a{2}b",
        r"\Q1+1=2\E",
        r"\Q(unclosed",
        r"\101\012",
        r"\p{^Greek}",
        r"[\d\s]",
        r"[^\D]",
        r"[[:alpha:][:^digit:]]+",
        r"(?i)KILLED process",
        r"(?U)a+",
        r"(?s)a.b",
        r"(?m)^b$",
        r"\1",
        r"\e",
        r"(?x) a",
        r"a{1001}",
        r"\C",
        r"^*",
        r"\#\&\~\-",
        r"\x{1F600}",
        r"[\x00-\x1F]+",
        r"\pL+",
        r"[^\n]+",
    ] {
        out.push(p.to_string());
    }
    out
}

fn go_inputs() -> Vec<String> {
    let mut out: Vec<String> = [
        "divide error: 0000 [#1] SMP",
        "divide error: 0000 [#1] SMP PTI",
        "INFO: task docker:20744 blocked for more than 120 seconds.",
        "Out of memory: Killed process 4242 (java) total-vm:123456kB, anon-rss:65432kB, file-rss:123kB, shmem-rss:0kB",
        "XFS (dm-0): Log I/O Error Detected. Shutting down filesystem",
        "{1}[Hardware Error]: event severity: fatal",
        "Started kubelet.service - Kubernetes kubelet.",
        "Stopping containerd.service - containerd container runtime...",
        "unregister_netdevice: waiting for eth0 to become free. Usage count = 2",
        "time=\"2026-11-24T01:00:00Z\" level=error msg=\"failed to pull and unpack image\"",
        "42 kB",
        "٣ kB",
        "word",
        "wörd",
        "é",
        "error.",
        "errors",
        "<html>",
        "html",
        "&",
        "~",
        "-",
        "[",
        "]",
        "a{,3}",
        "aaa",
        "x{foo}",
        "aab",
        "1+1=2",
        "(unclosed",
        "A\n",
        "a",
        "α",
        "1 2",
        "ab-",
        "a\nb",
        "\x0B",
        "\u{a0}",
        "\u{1F600}",
        "#&~-",
        "",
    ]
    .map(str::to_string)
    .to_vec();
    out.push("a".repeat(3));
    out
}

/// NPD's patterns are Go regular expressions. The agent reads them as Go
/// does (`nodeguard::policy::goregex::translate`), checked against Go's own
/// `regexp` (e2e/goregex, built with the machine's Go toolchain): for every
/// pattern of the release's configs and the constructs the two dialects
/// read differently, over every input, the same refusal or the same
/// leftmost match. Compiled untranslated, Rust differs on some of them.
#[test]
fn npds_go_patterns_match_what_go_matches() {
    let oracle = std::env::temp_dir().join(format!("nodeguard-goregex-{}", std::process::id()));
    let build = Command::new("go")
        .args(["build", "-o"])
        .arg(&oracle)
        .arg(repo_root().join("e2e/goregex/main.go"))
        .env("GOTOOLCHAIN", "local")
        .env("CGO_ENABLED", "0")
        .env_remove("GOFLAGS")
        .output()
        .expect("run `go build` (the Go toolchain is a test dependency)");
    assert!(
        build.status.success(),
        "go build e2e/goregex: {}",
        String::from_utf8_lossy(&build.stderr)
    );
    let patterns = go_patterns();
    let inputs = go_inputs();
    let mut queries = String::new();
    for p in &patterns {
        for i in &inputs {
            queries.push_str(&serde_json::json!({"pattern": p, "input": i}).to_string());
            queries.push('\n');
        }
    }
    let mut child = Command::new(&oracle)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let feeder = std::thread::spawn(move || stdin.write_all(queries.as_bytes()).unwrap());
    let out = child.wait_with_output().unwrap();
    feeder.join().unwrap();
    let _ = std::fs::remove_file(&oracle);
    assert!(out.status.success());
    let answers: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(answers.len(), patterns.len() * inputs.len());
    let rust = |p: &str, translated: bool| -> Result<regex::Regex, String> {
        let p = if translated {
            nodeguard::policy::goregex::translate(p)?
        } else {
            p.to_string()
        };
        regex::Regex::new(&p).map_err(|e| e.to_string())
    };
    let (mut differ, mut raw_differ, mut refused) = (Vec::new(), 0usize, 0usize);
    let mut raw_patterns = std::collections::BTreeSet::new();
    let mut k = 0;
    for p in &patterns {
        let (ours, raw) = (rust(p, true), rust(p, false));
        for i in &inputs {
            let go = &answers[k];
            k += 1;
            let go_match: Option<(usize, usize)> = match go.get("error") {
                Some(_) => None,
                None => go["match"].as_array().map(|m| {
                    (
                        m[0].as_u64().unwrap() as usize,
                        m[1].as_u64().unwrap() as usize,
                    )
                }),
            };
            let go_refuses = go.get("error").is_some();
            let find = |re: &Result<regex::Regex, String>| -> Result<Option<(usize, usize)>, ()> {
                match re {
                    Ok(re) => Ok(re.find(i).map(|m| (m.start(), m.end()))),
                    Err(_) => Err(()),
                }
            };
            let want = if go_refuses { Err(()) } else { Ok(go_match) };
            if go_refuses {
                refused += 1;
            }
            if find(&ours) != want {
                differ.push(format!(
                    "{p:?} on {i:?}: Go {}, nodeguard {:?} (as {:?})",
                    go,
                    find(&ours),
                    nodeguard::policy::goregex::translate(p)
                ));
            }
            if find(&raw) != want {
                raw_differ += 1;
                raw_patterns.insert(p.clone());
            }
        }
    }
    println!(
        "conformance: NPD's Go patterns against Go's own regexp (e2e/goregex)\n\n{} patterns (every pattern of the release's configs and the constructs Go and Rust read differently) × {} inputs: nodeguard differs from Go on {}, Rust's regex untranslated on {} ({} patterns: {:?}); Go refuses {} pairs\n",
        patterns.len(),
        inputs.len(),
        differ.len(),
        raw_differ,
        raw_patterns.len(),
        raw_patterns,
        refused
    );
    assert!(
        differ.is_empty(),
        "nodeguard reads these Go patterns differently from Go:\n{}",
        differ.join("\n")
    );
    assert!(
        raw_patterns.len() >= 15,
        "the cases reach the constructs the dialects differ on: {raw_patterns:?}"
    );
}

/// Review of NPD's names: the default policy holds NPD's kernel, docker
/// and systemd-restart monitors, and a team migrating with it routes on
/// NPD's source components and graphs NPD's metrics. Its Events name NPD's
/// source (`kernel-monitor`), and its restart counters (NPD runs them as a
/// custom plugin, log-counter) show the no-problem reason in
/// `problem_gauge` from the start, as NPD's do.
#[tokio::test]
async fn the_default_policys_monitors_speak_as_npds() {
    let mut monitors = nodeguard::policy::defaults::default_spec().monitors;
    let logs = TempDir::new("default-npd");
    let kmsg = logs.path.join("kmsg");
    std::fs::write(&kmsg, "6,1,1,-;boot\n").unwrap();
    let journal = logs.path.join("journal");
    std::fs::create_dir_all(&journal).unwrap();
    for m in &mut monitors {
        if let Some(k) = m.source.kmsg.as_mut() {
            k.path = kmsg.display().to_string();
        }
        if let Some(j) = m.source.journald.as_mut() {
            j.directory = Some(journal.display().to_string());
        }
    }
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "default-npd").await;
    let policy = unique_name("default-npd");
    apply_policy(
        &admin,
        &policy,
        serde_json::json!({"nodeSelector": selecting(&node.name), "monitors": monitors}),
    )
    .await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;
    wait_condition(
        &admin,
        &node.name,
        "KernelDeadlock",
        "False",
        Duration::from_secs(30),
        "KernelDeadlock=False at start",
    )
    .await;
    {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&kmsg)
            .unwrap();
        writeln!(
            f,
            "3,2,2,-;INFO: task kworker/u8:2:1234 blocked for more than 120 seconds."
        )
        .unwrap();
    }
    let reasons = vec!["TaskHung".to_string()];
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    let seen = loop {
        let seen = shown(&admin, &node.name, &[], &reasons).await;
        if !seen.0.is_empty() || std::time::Instant::now() > deadline {
            break seen;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert!(!seen.0.is_empty(), "the TaskHung Event");
    assert!(
        seen.0.iter().all(|e| e.ends_with("(from kernel-monitor)")),
        "{seen:?}"
    );
    let (_, metrics) = http_get(agent.addr, "/metrics").await;
    let gauges = samples_of(&metrics, "problem_gauge");
    for t in [
        "FrequentKubeletRestart",
        "FrequentDockerRestart",
        "FrequentContainerdRestart",
    ] {
        let want = format!("problem_gauge{{reason=\"No{t}\",type=\"{t}\"}} 0");
        assert!(gauges.contains(&want), "{want} in {gauges:?}");
    }
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

/// The oracle for NPD's custom plugin monitor (its `custom-plugin-monitor`
/// configs, which `import-npd` turns into plugin monitors): NPD's binary
/// and the agent run the same script through the same config, each for its
/// own Node, while the script passes, fails, exits with another code,
/// hangs past its timeout, passes again, fails saying nothing on stdout
/// (only on stderr), and exits 0 or 1 leaving a child that holds its
/// output open past the timeout. After each, the conditions and the Events of
/// both Nodes are the same: NPD sets the condition Unknown for an unknown
/// result or a timeout, its temporary rule reports those too, only stdout
/// is a check's output, and every change is an Event worded as NPD's.
#[tokio::test]
async fn npd_and_nodeguard_judge_a_custom_plugin_alike_through_every_result() {
    use std::os::unix::fs::PermissionsExt;
    let npd_dir = npd_build_dir();
    let admin = admin_client().await;
    let npd_node = TestNode::create(&admin, "plugin-npd", &[]).await;
    let ng_node = TestNode::selectable(&admin, "plugin-ng").await;
    let tmp = TempDir::new("npd-plugin-oracle");
    let state = tmp.path.join("state");
    std::fs::write(&state, "ok").unwrap();
    let script = tmp.path.join("check.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/bash\ncase $(< {}) in\n  ok) echo \"all fine\"; exit 0 ;;\n  bad) echo \"it broke\"; exit 1 ;;\n  odd) echo \"cannot tell\"; exit 3 ;;\n  hang) echo \"waiting\"; sleep 30 ;;\n  quiet) echo \"only on stderr\" >&2; exit 1 ;;\n  outlived) echo \"left a child\"; sleep 30 & exit 0 ;;\n  outlived-bad) echo \"broke, left a child\"; sleep 30 & exit 1 ;;\nesac\n",
            state.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    // NPD cuts a timeout's message at `max_output_length` bytes and keeps
    // what the cut leaves, a space at its end too: cut right after
    // "state " (this test's run went wrong on 3-digit pids, whose shorter
    // path put the cut there).
    let max_output = format!(
        "Timeout when running plugin {:?}: state ",
        script.display().to_string()
    )
    .len();
    let config = serde_json::json!({
        "plugin": "custom",
        "pluginConfig": {"invoke_interval": "1s", "timeout": "2s", "max_output_length": max_output, "concurrency": 2},
        "source": "script-plugin-monitor",
        "metricsReporting": true,
        "conditions": [{"type": "ScriptProblem", "reason": "ScriptFine", "message": "the script is fine"}],
        "rules": [
            {"type": "temporary", "reason": "ScriptHiccup", "path": script.display().to_string(), "timeout": "2s"},
            {"type": "permanent", "condition": "ScriptProblem", "reason": "ScriptBroken",
             "path": script.display().to_string(), "timeout": "2s"},
        ],
    });
    let config_path = tmp.path.join("script-plugin-monitor.json");
    std::fs::write(&config_path, config.to_string()).unwrap();
    let types = vec!["ScriptProblem".to_string()];
    let reasons: Vec<String> = ["ScriptHiccup", "ScriptBroken", "ScriptFine"]
        .map(String::from)
        .to_vec();

    let npd = Npd::start(
        &npd_dir.join("nodeproblemdetector"),
        &npd_node.name,
        &[format!(
            "--config.custom-plugin-monitor={}",
            config_path.display()
        )],
        tmp.path.join("npd.log"),
    );
    let (code, yaml, notes) = nodeguard(&["import-npd", config_path.to_str().unwrap()]);
    assert_eq!(code, 0, "{notes}");
    let docs = nodeguard::policy::load_policies("imported", &yaml).unwrap();
    let monitors = docs[0].policy.as_ref().unwrap().spec.monitors.clone();
    let policy = unique_name("plugin-oracle");
    apply_policy(
        &admin,
        &policy,
        serde_json::json!({"nodeSelector": selecting(&ng_node.name), "monitors": monitors}),
    )
    .await;
    let (agent, _state) = start_agent(admin.clone(), &ng_node.name).await;

    // Each phase: the script's state, and the condition NPD shows then.
    let phases = [
        ("ok", "ScriptProblem=False ScriptFine"),
        ("bad", "ScriptProblem=True ScriptBroken"),
        ("odd", "ScriptProblem=Unknown ScriptFine"),
        ("ok", "ScriptProblem=False ScriptFine"),
        (
            "hang",
            "ScriptProblem=Unknown ScriptFine: Timeout when running plugin",
        ),
        ("bad", "ScriptProblem=True ScriptBroken"),
        ("ok", "ScriptProblem=False ScriptFine"),
        // A failure saying nothing on stdout: NPD's message is empty. Its
        // Events say so; its patch of the Node leaves an empty message out,
        // so NPD's condition keeps the False state's message, where
        // nodeguard writes the empty one (README).
        ("quiet", "ScriptProblem=True ScriptBroken"),
        ("ok", "ScriptProblem=False ScriptFine"),
        // Exited at once, but a child it left holds its output open past
        // the timeout: NPD kills the group and judges the script's own
        // exit code, with its timeout words and what it wrote.
        ("bad", "ScriptProblem=True ScriptBroken"),
        ("outlived", "ScriptProblem=False ScriptFine"),
        (
            "outlived-bad",
            "ScriptProblem=True ScriptBroken: Timeout when running plugin",
        ),
        ("ok", "ScriptProblem=False ScriptFine"),
    ];
    let mut tables = String::new();
    let mut differ = Vec::new();
    // The conditions with their messages, or (the quiet phase) without.
    let alike = |a: &(Vec<String>, Vec<String>), b: &(Vec<String>, Vec<String>), quiet: bool| {
        let status = |c: &Vec<String>| -> Vec<String> {
            c.iter()
                .map(|s| s.split(':').next().unwrap_or("").to_string())
                .collect()
        };
        a.0 == b.0
            && if quiet {
                status(&a.1) == status(&b.1)
                    && b.1.iter().any(|c| c == "ScriptProblem=True ScriptBroken: ")
            } else {
                a.1 == b.1
            }
    };
    for (i, (what, want)) in phases.iter().enumerate() {
        std::fs::write(&state, what).unwrap();
        let quiet = *what == "quiet";
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let (a, b) = loop {
            let a = shown(&admin, &npd_node.name, &types, &reasons).await;
            let b = shown(&admin, &ng_node.name, &types, &reasons).await;
            let settled = a.1.iter().any(|c| c.starts_with(want))
                && (!quiet
                    || a.0
                        .iter()
                        .any(|e| e == "ScriptHiccup:  (from script-plugin-monitor)"));
            if (settled && alike(&a, &b, quiet)) || std::time::Instant::now() > deadline {
                break (a, b);
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        };
        tables.push_str(&format!(
            "\n### phase {i}: {what}\n\n{}",
            oracle_table(&a, &b)
        ));
        if !a.1.iter().any(|c| c.starts_with(want)) {
            panic!(
                "NPD did not show {want} in phase {i} ({what}):\n{tables}\n{}",
                npd.output()
            );
        }
        if !alike(&a, &b, quiet) {
            differ.push(format!("phase {i} ({what})"));
        }
    }
    println!("{tables}");
    agent.stop().await;
    delete_policy(&admin, &policy).await;
    assert!(
        differ.is_empty(),
        "nodeguard differs from NPD's custom plugin monitor in {differ:?}:\n{tables}"
    );
}

/// The migration guide's step 5 (README), with the real helm against the
/// real API server: NPD's PrometheusRule, rendered by a release of a
/// stand-in for NPD's chart (a rule with the labels a Prometheus
/// `ruleSelector` matches), outlives `helm uninstall` of that release as the
/// copy the guide's commands make, with the same rules and labels. Annotating
/// the live rule with `helm.sh/resource-policy=keep`, as the guide said
/// before, does not keep it: Helm reads the policy from the release's
/// manifest (helm/helm#8132). The PrometheusRule API is a stand-in CRD
/// (no Prometheus Operator runs here), removed at the end.
#[test]
fn npds_alerts_outlive_its_uninstall_as_the_migration_guide_keeps_them() {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let step = readme
        .split("```sh\n")
        .skip(1)
        .filter_map(|b| b.split_once("\n   ```").map(|(code, _)| code))
        .find(|code| code.contains("kubectl get prometheusrule"))
        .expect("README's migration step 5 has the commands that keep NPD's alerts");
    let crd = serde_json::json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "prometheusrules.monitoring.coreos.com"},
        "spec": {
            "group": "monitoring.coreos.com", "scope": "Namespaced",
            "names": {"kind": "PrometheusRule", "plural": "prometheusrules", "singular": "prometheusrule", "listKind": "PrometheusRuleList"},
            "versions": [{"name": "v1", "served": true, "storage": true,
                          "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}}],
        },
    });
    let tmp = TempDir::new("npd-keep-alerts");
    let crd_file = tmp.path.join("crd.json");
    std::fs::write(&crd_file, crd.to_string()).unwrap();
    // Another test bed's real Prometheus Operator CRD is left alone.
    let ours = kubectl_status(&["get", "crd", "prometheusrules.monitoring.coreos.com"]).is_err();
    if ours {
        kubectl(&["create", "-f", crd_file.to_str().unwrap()]);
        kubectl(&[
            "wait",
            "--for=condition=Established",
            "--timeout=30s",
            "crd/prometheusrules.monitoring.coreos.com",
        ]);
    }
    struct Cleanup(bool, String);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let _ = kubectl_status(&["delete", "namespace", &self.1, "--wait=false"]);
            if self.0 {
                let _ = kubectl_status(&[
                    "delete",
                    "crd",
                    "prometheusrules.monitoring.coreos.com",
                    "--wait=false",
                ]);
            }
        }
    }
    let ns = unique_name("npd-alerts");
    let _cleanup = Cleanup(ours, ns.clone());
    kubectl(&["create", "namespace", &ns]);
    // The stand-in chart: its rule as NPD's chart renders one.
    let chart = tmp.path.join("node-problem-detector");
    std::fs::create_dir_all(chart.join("templates")).unwrap();
    std::fs::write(
        chart.join("Chart.yaml"),
        "apiVersion: v2\nname: node-problem-detector\nversion: 2.4.1\n",
    )
    .unwrap();
    std::fs::write(
        chart.join("templates/prometheusrule.yaml"),
        r#"apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: {{ .Release.Name }}-node-problem-detector
  labels:
    app.kubernetes.io/name: node-problem-detector
    app.kubernetes.io/instance: {{ .Release.Name }}
    app.kubernetes.io/managed-by: {{ .Release.Service }}
    helm.sh/chart: node-problem-detector-2.4.1
    release: kube-prometheus-stack
spec:
  groups:
    - name: npd
      rules:
        - alert: NodeProblemOOMKilling
          expr: increase(problem_counter{reason="OOMKilling"}[2m]) > 0
          for: 1s
          labels:
            severity: warning
"#,
    )
    .unwrap();
    let helm = |args: &[&str]| {
        let out = Command::new(helm_binary())
            .arg("--kubeconfig")
            .arg(kubeconfig_path())
            .args(args)
            .output()
            .expect("run helm");
        assert!(
            out.status.success(),
            "helm {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let rule = |name: &str| -> Option<serde_json::Value> {
        kubectl_status(&["get", "prometheusrule", "-n", &ns, name, "-o", "json"])
            .ok()
            .map(|j| serde_json::from_str(&j).unwrap())
    };
    let chart_arg = chart.to_str().unwrap();

    // What the guide said before: the live annotation is not Helm's policy.
    helm(&["install", "annotated", chart_arg, "-n", &ns]);
    kubectl(&[
        "annotate",
        "prometheusrule",
        "-n",
        &ns,
        "annotated-node-problem-detector",
        "helm.sh/resource-policy=keep",
    ]);
    helm(&["uninstall", "annotated", "-n", &ns, "--wait"]);
    assert!(
        rule("annotated-node-problem-detector").is_none(),
        "helm uninstall left a rule annotated only in the cluster: Helm now reads the live policy, and the guide can say so"
    );

    // The guide's commands, as README has them.
    helm(&["install", "npd", chart_arg, "-n", &ns]);
    let original = rule("npd-node-problem-detector").expect("the release's rule");
    let script = step
        .lines()
        .map(|l| l.trim_start())
        .collect::<Vec<_>>()
        .join("\n")
        .replace("NS", &ns)
        .replace("NAME", "npd-node-problem-detector")
        .replace("RELEASE", "npd");
    let helm_dir = helm_binary().parent().unwrap().to_path_buf();
    let path = format!(
        "{}:{}",
        helm_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = Command::new("bash")
        .args(["-euo", "pipefail", "-c", &script])
        .env("KUBECONFIG", kubeconfig_path())
        .env("PATH", path)
        .output()
        .expect("run bash");
    assert!(
        out.status.success(),
        "README's step 5 failed:\n{script}\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        rule("npd-node-problem-detector").is_none(),
        "the release's own rule is gone with it"
    );
    let kept = rule("npd-node-problem-detector-kept")
        .expect("NPD's alerts outlive its uninstall as the guide's copy");
    assert_eq!(kept["spec"], original["spec"], "the same rules");
    let mut labels = original["metadata"]["labels"].clone();
    let labels_map = labels.as_object_mut().unwrap();
    labels_map.remove("app.kubernetes.io/managed-by");
    labels_map.remove("helm.sh/chart");
    assert_eq!(
        kept["metadata"]["labels"], labels,
        "the labels a ruleSelector matches, without Helm's"
    );
    assert_eq!(
        kept["metadata"]["labels"]["release"], "kube-prometheus-stack",
        "{kept}"
    );
}
