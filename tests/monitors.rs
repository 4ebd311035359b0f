//! The problem detector against the real control plane: lines in a file
//! log and in a kmsg stand-in (the same parser as /dev/kmsg) set a condition
//! and its taint, seen in `kubectl describe node`; a restart keeps the
//! active condition; a clear line clears it and its taint; removing the
//! monitor removes its condition.

mod support;

use std::io::Write;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::{Api, Client};
use support::*;

fn append(path: &std::path::Path, line: &str) {
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)
        .unwrap();
    writeln!(f, "{line}").unwrap();
}

async fn apply_monitors(admin: &Client, name: &str, node: &str, monitors: serde_json::Value) {
    apply_policy(
        admin,
        name,
        serde_json::json!({"nodeSelector": selecting(node), "monitors": monitors}),
    )
    .await;
}

async fn node_tainted(admin: &Client, node: &str, key: &str) -> bool {
    has_taint(
        &Api::<Node>::all(admin.clone()).get(node).await.unwrap(),
        key,
    )
}

#[tokio::test]
async fn log_lines_set_and_clear_conditions_and_taints_across_restarts() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "monitor").await;
    let logs = TempDir::new("logs");
    let app_log = logs.path.join("app.log");
    let kmsg = logs.path.join("kmsg");
    std::fs::write(
        &app_log,
        "app crashed: before the agent started (must not count)\n",
    )
    .unwrap();
    std::fs::write(&kmsg, "6,1,1,-;boot\n").unwrap();
    let app = serde_json::json!({
        "name": "app", "source": {"file": {"path": app_log.display().to_string()}},
        "conditions": [{"type": "AppBroken", "reason": "AppIsFine", "message": "The app is fine.",
                        "clearPattern": "app recovered",
                        "taint": {"key": "example.com/app-broken", "value": "true", "effect": "NoSchedule"}}],
        "rules": [{"type": "permanent", "condition": "AppBroken", "reason": "AppCrashed",
                   "pattern": "app crashed: (.+)", "message": "The app crashed ($1)."}],
    });
    let kernel = serde_json::json!({
        "name": "kernel", "source": {"kmsg": {"path": kmsg.display().to_string()}},
        "conditions": [{"type": "KernelDeadlock", "reason": "KernelHasNoDeadlock", "message": "kernel has no deadlock"}],
        "rules": [{"type": "permanent", "condition": "KernelDeadlock", "reason": "DockerHung",
                   "pattern": "task docker:\\w+ blocked for more than \\w+ seconds\\."}],
    });
    let policy = unique_name("monitors");
    apply_monitors(
        &admin,
        &policy,
        &node.name,
        serde_json::json!([app, kernel]),
    )
    .await;
    let state = TempDir::new("persistent-state");
    let state_path = state.path.clone();
    let (agent, _unused) = start_agent_with(admin.clone(), &node.name, |c| {
        c.state_dir = state_path.clone()
    })
    .await;
    eventually(
        Duration::from_secs(15),
        "AppBroken=False at start",
        || async {
            condition_is(&admin, &node.name, "AppBroken", "False").await
                && condition_is(&admin, &node.name, "KernelDeadlock", "False").await
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;

    append(&app_log, "2026-11-21T10:00:00Z app crashed: disk full");
    eventually(
        Duration::from_secs(5),
        "AppBroken=True with its taint",
        || async {
            condition_is(&admin, &node.name, "AppBroken", "True").await
                && node_tainted(&admin, &node.name, "example.com/app-broken").await
        },
    )
    .await;
    let t0 = Instant::now();
    append(
        &kmsg,
        "3,1001,5000000,-;INFO: task docker:20744 blocked for more than 120 seconds.",
    );
    wait_condition(
        &admin,
        &node.name,
        "KernelDeadlock",
        "True",
        Duration::from_secs(2),
        "KernelDeadlock=True within 2 s",
    )
    .await;
    eprintln!("kernel line to condition in the API: {:?}", t0.elapsed());
    let out = kubectl(&["describe", "node", &node.name]);
    let row = out
        .lines()
        .find(|l| l.trim_start().starts_with("AppBroken"))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(
        row.contains("True")
            && row.contains("AppCrashed")
            && row.contains("The app crashed (disk full)."),
        "{row}"
    );
    assert!(
        out.contains("example.com/app-broken=true:NoSchedule"),
        "{out}"
    );

    let (_, metrics) = http_get(agent.addr, "/metrics").await;
    assert!(
        metrics.contains("nodeguard_problem_total{reason=\"AppCrashed\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("nodeguard_problem_active{type=\"AppBroken\",reason=\"AppCrashed\"} 1"),
        "{metrics}"
    );

    // Restart: the active condition stays, nothing is re-reported.
    agent.stop().await;
    let before = node_conditions(&admin, &node.name, "AppBroken")
        .await
        .remove(0);
    let state_path = state.path.clone();
    let (agent, _unused2) = start_agent_with(admin.clone(), &node.name, |c| {
        c.state_dir = state_path.clone()
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = node_conditions(&admin, &node.name, "AppBroken")
        .await
        .remove(0);
    assert_eq!(after.status, "True", "a restart keeps the active condition");
    assert_eq!(after.last_transition_time, before.last_transition_time);
    assert!(node_tainted(&admin, &node.name, "example.com/app-broken").await);

    // A clear line clears the condition and removes the taint we added.
    append(&app_log, "app recovered");
    eventually(
        Duration::from_secs(5),
        "AppBroken=False, taint gone",
        || async {
            condition_is(&admin, &node.name, "AppBroken", "False").await
                && !node_tainted(&admin, &node.name, "example.com/app-broken").await
        },
    )
    .await;

    // Removing the kernel monitor removes its condition.
    apply_monitors(&admin, &policy, &node.name, serde_json::json!([app])).await;
    eventually(Duration::from_secs(5), "KernelDeadlock removed", || async {
        condition_status(&admin, &node.name, "KernelDeadlock")
            .await
            .is_none()
    })
    .await;
    let (_, metrics) = http_get(agent.addr, "/metrics").await;
    assert!(
        !metrics.contains("nodeguard_problem_total{reason=\"AppCrashed\"}"),
        "the restarted agent did not re-report the old crash:\n{metrics}"
    );
    assert!(
        metrics.contains("nodeguard_monitor_lines_total{monitor=\"app\"} 1"),
        "{metrics}"
    );
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

#[tokio::test]
async fn a_bad_regex_is_reported_by_check_with_its_path() {
    let dir = TempDir::new("check");
    let f = dir.path.join("p.yaml");
    std::fs::write(
        &f,
        "apiVersion: nodeguard.io/v1alpha1\nkind: NodeGuardPolicy\nmetadata: {name: bad}\nspec:\n  monitors:\n  - name: m\n    source: {file: {path: /var/log/x}}\n    rules:\n    - {type: temporary, reason: Oops, pattern: 'broken ('}\n",
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_nodeguard"))
        .args(["check", "-f", f.to_str().unwrap()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("spec.monitors[0].rules[0].pattern: invalid regular expression"),
        "{text}"
    );
}

#[tokio::test]
async fn a_plugin_check_sets_and_clears_its_condition() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "plugin").await;
    let dir = TempDir::new("plugin");
    let flag = dir.path.join("broken");
    let script = format!(
        "if [ -f {0} ]; then echo \"clock offset is 3.2s\"; exit 1; else echo ok; exit 0; fi",
        flag.display()
    );
    let policy = unique_name("plugin");
    apply_monitors(
        &admin,
        &policy,
        &node.name,
        serde_json::json!([{
            "name": "ntp",
            "source": {"plugin": {"intervalSeconds": 1, "timeoutSeconds": 5}},
            "conditions": [{"type": "NTPProblem", "reason": "NTPIsUp", "message": "ntp service is up"}],
            "rules": [{"type": "permanent", "condition": "NTPProblem", "reason": "NTPIsDown",
                       "command": ["sh", "-c", script]}],
        }]),
    )
    .await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;
    wait_condition(
        &admin,
        &node.name,
        "NTPProblem",
        "False",
        Duration::from_secs(15),
        "NTPProblem=False",
    )
    .await;
    std::fs::write(&flag, "").unwrap();
    eventually(
        Duration::from_secs(5),
        "NTPProblem=True from exit 1",
        || async {
            node_conditions(&admin, &node.name, "NTPProblem")
                .await
                .first()
                .is_some_and(|c| {
                    c.status == "True" && c.message.as_deref() == Some("clock offset is 3.2s")
                })
        },
    )
    .await;
    std::fs::remove_file(&flag).unwrap();
    wait_condition(
        &admin,
        &node.name,
        "NTPProblem",
        "False",
        Duration::from_secs(5),
        "NTPProblem=False after exit 0",
    )
    .await;
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

#[tokio::test]
async fn an_unreadable_source_is_a_warning_event_on_the_node() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "nosource").await;
    let missing = "/nonexistent/nodeguard-test/kmsg";
    let kernel = serde_json::json!({
        "name": "kernel", "source": {"kmsg": {"path": missing}},
        "conditions": [{"type": "KernelDeadlock", "reason": "KernelHasNoDeadlock", "message": "kernel has no deadlock"}],
        "rules": [{"type": "permanent", "condition": "KernelDeadlock", "reason": "DockerHung",
                   "pattern": "task docker:\\w+ blocked"}],
    });
    let policy = unique_name("nosource");
    apply_monitors(&admin, &policy, &node.name, serde_json::json!([kernel])).await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;
    let mut events = String::new();
    eventually(
        Duration::from_secs(15),
        "a MonitorSourceUnavailable event naming the path",
        || {
            events = kubectl(&["events", "-A", "--for", &format!("node/{}", node.name)]);
            let found = events.contains("MonitorSourceUnavailable") && events.contains(missing);
            async move { found }
        },
    )
    .await;
    assert!(events.contains("Warning"), "{events}");
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

/// Writes one journal entry into a new journal file in `dir`, as a real
/// journald would (systemd-journal-remote writes the same format).
fn journal_entry(dir: &std::path::Path, n: u32, identifier: &str, message: &str) {
    use std::process::{Command, Stdio};
    let export = format!(
        "__REALTIME_TIMESTAMP={}\nMESSAGE={message}\nSYSLOG_IDENTIFIER={identifier}\n_BOOT_ID={}\n_HOSTNAME=test\n\n",
        1_700_000_000_000_000u64 + u64::from(n),
        // journalctl --follow reads the current boot, as on a real node.
        std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .unwrap()
            .trim()
            .replace('-', "")
    );
    let mut child = Command::new("/lib/systemd/systemd-journal-remote")
        .arg(format!("--output={}/remote-{n}.journal", dir.display()))
        .arg("-")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("systemd-journal-remote is installed (e2e/setup installs it)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(export.as_bytes())
        .unwrap();
    assert!(child.wait().unwrap().success());
}

#[tokio::test]
async fn journal_entries_of_one_identifier_set_a_condition() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "journal").await;
    let journal = TempDir::new("journal");
    journal_entry(
        &journal.path,
        1,
        "dockerd",
        "old: returned error: readlink /var/lib/docker/overlay2/x: invalid argument",
    );
    let policy = unique_name("journal");
    apply_monitors(
        &admin,
        &policy,
        &node.name,
        serde_json::json!([{
            "name": "docker",
            "source": {"journald": {"directory": journal.path.display().to_string(), "identifier": "dockerd"}},
            "conditions": [{"type": "CorruptDockerOverlay2", "reason": "NoCorruptDockerOverlay2",
                            "message": "docker overlay2 is functioning properly"}],
            "rules": [{"type": "permanent", "condition": "CorruptDockerOverlay2", "reason": "CorruptDockerOverlay2",
                       "pattern": "returned error: readlink /var/lib/docker/overlay2.*: invalid argument.*"}],
        }]),
    )
    .await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;
    wait_condition(
        &admin,
        &node.name,
        "CorruptDockerOverlay2",
        "False",
        Duration::from_secs(15),
        "CorruptDockerOverlay2=False (old entries ignored)",
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    journal_entry(
        &journal.path,
        2,
        "containerd",
        "returned error: readlink /var/lib/docker/overlay2/y: invalid argument",
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        condition_status(&admin, &node.name, "CorruptDockerOverlay2")
            .await
            .as_deref(),
        Some("False"),
        "another identifier's entries do not count"
    );
    journal_entry(
        &journal.path,
        3,
        "dockerd",
        "returned error: readlink /var/lib/docker/overlay2/z: invalid argument",
    );
    wait_condition(
        &admin,
        &node.name,
        "CorruptDockerOverlay2",
        "True",
        Duration::from_secs(10),
        "CorruptDockerOverlay2=True",
    )
    .await;
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

#[tokio::test]
async fn an_unhealthy_unit_sets_its_condition_and_is_repaired_once_after_its_cooldown() {
    use support::dbus::{LogindPeer, PrivateBus, UnitState, now_usec};
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "service").await;
    let bus = PrivateBus::start();
    let peer = LogindPeer::start(&bus.address, Duration::from_secs(5), None).await;
    peer.serve_unit(
        "kubelet.service",
        UnitState {
            active: "active".into(),
            sub: "running".into(),
            started_usec: now_usec(),
            ..Default::default()
        },
    )
    .await;
    let policy = unique_name("service");
    apply_monitors(
        &admin,
        &policy,
        &node.name,
        serde_json::json!([{
            "name": "kubelet-service",
            "source": {"systemd": {"unit": "kubelet.service", "intervalSeconds": 1, "repair": {"cooldownSeconds": 2}}},
            "conditions": [{"type": "KubeletServiceUnhealthy", "reason": "KubeletServiceIsHealthy", "message": "kubelet.service is active"}],
            "rules": [{"type": "permanent", "condition": "KubeletServiceUnhealthy", "reason": "KubeletServiceIsDown"}],
        }]),
    )
    .await;
    let address = bus.address.clone();
    let (agent, _state) = start_agent_with(admin.clone(), &node.name, move |c| {
        c.system_bus_address = Some(address)
    })
    .await;
    wait_condition(
        &admin,
        &node.name,
        "KubeletServiceUnhealthy",
        "False",
        Duration::from_secs(15),
        "KubeletServiceUnhealthy=False",
    )
    .await;
    // It fails right after a (re)start: within the cooldown, no repair.
    {
        let mut s = peer.state.lock().unwrap();
        let u = s.units.get_mut("kubelet.service").unwrap();
        u.active = "failed".into();
        u.sub = "failed".into();
        u.started_usec = now_usec();
    }
    eventually(
        Duration::from_secs(5),
        "KubeletServiceUnhealthy=True",
        || async {
            node_conditions(&admin, &node.name, "KubeletServiceUnhealthy")
                .await
                .first()
                .is_some_and(|c| {
                    c.status == "True"
                        && c.message
                            .as_deref()
                            .is_some_and(|m| m.contains("kubelet.service is failed"))
                })
        },
    )
    .await;
    let kills = || peer.state.lock().unwrap().units["kubelet.service"].kills;
    assert_eq!(
        kills(),
        0,
        "not repaired within the cooldown since its start"
    );
    // Past the cooldown: repaired once, and the restarted unit is healthy.
    eventually(Duration::from_secs(6), "repaired", || {
        std::future::ready(kills() == 1)
    })
    .await;
    wait_condition(
        &admin,
        &node.name,
        "KubeletServiceUnhealthy",
        "False",
        Duration::from_secs(5),
        "KubeletServiceUnhealthy=False after the repair",
    )
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(kills(), 1, "a healthy unit is not repaired again");
    eventually(Duration::from_secs(10), "ServiceRepaired event", || async {
        kubectl(&["events", "-A", "--for", &format!("node/{}", node.name)])
            .contains("ServiceRepaired")
    })
    .await;
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}
