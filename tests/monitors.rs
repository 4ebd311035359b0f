//! The problem detector against the real control plane: lines in a file
//! log and in a kmsg stand-in (the same parser as /dev/kmsg) set a condition
//! and its taint, seen in `kubectl describe node`; a restart keeps the
//! active condition; a clear line clears it and its taint; removing the
//! monitor removes its condition. A new boot resets the kernel's conditions
//! and reads its log from the start; only taints nodeguard added are
//! removed; an edit removes what the new spec dropped; a line that is not
//! UTF-8 loses no neighbour; a monitor whose source ends fails `/livez`.

mod support;

use std::io::Write;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::{Api, Client};
use nodeguard::report::Status;
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

/// Sets the Node's taints (as an operator would with `kubectl taint`).
async fn set_taints(admin: &Client, node: &str, taints: serde_json::Value) {
    Api::<Node>::all(admin.clone())
        .patch(
            node,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&serde_json::json!({"spec": {"taints": taints}})),
        )
        .await
        .expect("set the test node's taints");
}

/// The agent's current /metrics text.
async fn metrics(agent: &nodeguard::agent::RunningAgent) -> String {
    http_get(agent.addr, "/metrics").await.1
}

/// Waits until /metrics has `line`.
async fn wait_metric(agent: &nodeguard::agent::RunningAgent, line: &str) {
    eventually(Duration::from_secs(10), line, || async {
        metrics(agent).await.contains(line)
    })
    .await;
}

/// The value of one sample in /metrics (0 when absent).
async fn metric_value(agent: &nodeguard::agent::RunningAgent, sample: &str) -> u64 {
    metrics(agent)
        .await
        .lines()
        .find_map(|l| l.strip_prefix(sample)?.trim().parse().ok())
        .unwrap_or(0)
}

/// Whether the agent wants condition `type_` with `status` (what the
/// monitors told its reporter).
fn desired_is(agent: &nodeguard::agent::RunningAgent, type_: &str, status: Status) -> bool {
    agent
        .reporter
        .desired()
        .get(type_)
        .and_then(|d| d.as_ref())
        .is_some_and(|d| d.status == status)
}

/// A monitor's saved state, as JSON.
fn saved_state(state_dir: &std::path::Path, monitor: &str) -> Option<serde_json::Value> {
    let text =
        std::fs::read_to_string(state_dir.join("monitors").join(format!("{monitor}.json"))).ok()?;
    serde_json::from_str(&text).ok()
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
    // The restarted agent restored the active condition (its reporter
    // wants it True) and resumed after the saved cursor: a new line is the
    // first it reads.
    eventually(
        Duration::from_secs(15),
        "the restored AppBroken=True",
        || std::future::ready(desired_is(&agent, "AppBroken", Status::True)),
    )
    .await;
    append(&app_log, "an ordinary line");
    wait_metric(&agent, "nodeguard_monitor_lines_total{monitor=\"app\"} 1").await;
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
    // The counter exists from the monitor's start, at 0.
    assert_eq!(
        sample(&metrics, "nodeguard_problem_total{reason=\"AppCrashed\"}"),
        Some(0.0),
        "the restarted agent did not re-report the old crash:\n{metrics}"
    );
    assert!(
        metrics.contains("nodeguard_monitor_lines_total{monitor=\"app\"} 2"),
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
                       "command": ["/bin/sh", "-c", script]}],
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
    // Blind is not "all clear": the condition is Unknown, naming the path.
    wait_condition(
        &admin,
        &node.name,
        "KernelDeadlock",
        "Unknown",
        Duration::from_secs(15),
        "KernelDeadlock Unknown while the source cannot be read",
    )
    .await;
    let c = node_conditions(&admin, &node.name, "KernelDeadlock").await;
    assert_eq!(
        c[0].reason.as_deref(),
        Some("MonitorSourceUnavailable"),
        "{c:?}"
    );
    assert!(
        c[0].message
            .as_deref()
            .unwrap_or_default()
            .contains(missing),
        "{c:?}"
    );
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

/// Same boot, agent restarted before the monitor read any line: a kernel
/// record logged while the agent was down is read after the restart (the
/// first start saves where it began reading, not an empty cursor).
#[tokio::test]
async fn a_kernel_record_logged_while_the_agent_was_down_is_read_after_a_restart() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "kmsggap").await;
    let logs = TempDir::new("kmsggap-logs");
    let kmsg = logs.path.join("kmsg");
    std::fs::write(&kmsg, "6,1,100,-;Linux version (this boot)\n").unwrap();
    let kernel = serde_json::json!({
        "name": "kernel", "source": {"kmsg": {"path": kmsg.display().to_string()}},
        "conditions": [{"type": "KernelDeadlock", "reason": "KernelHasNoDeadlock", "message": "kernel has no deadlock"}],
        "rules": [{"type": "permanent", "condition": "KernelDeadlock", "reason": "DockerHung",
                   "pattern": "task docker:\\w+ blocked for more than \\w+ seconds\\."}],
    });
    let policy = unique_name("kmsggap");
    apply_monitors(&admin, &policy, &node.name, serde_json::json!([kernel])).await;
    let state = TempDir::new("kmsggap-state");
    let sd = state.path.clone();
    let (agent, _u) = start_agent_with(admin.clone(), &node.name, move |c| c.state_dir = sd).await;
    wait_condition(
        &admin,
        &node.name,
        "KernelDeadlock",
        "False",
        Duration::from_secs(15),
        "False at start",
    )
    .await;
    agent.stop().await;
    let saved = saved_state(&state.path, "kernel").expect("state saved");
    // Logged while the agent was down (e.g. during a rolling upgrade).
    append(
        &kmsg,
        "3,2,5000000,-;INFO: task docker:20744 blocked for more than 120 seconds.",
    );
    let sd = state.path.clone();
    let (agent, _u2) = start_agent_with(admin.clone(), &node.name, move |c| c.state_dir = sd).await;
    wait_condition(
        &admin,
        &node.name,
        "KernelDeadlock",
        "True",
        Duration::from_secs(15),
        &format!(
            "the record logged while the agent was down read after the restart (saved {saved})"
        ),
    )
    .await;
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

/// NPD's docker-monitor rule for a corrupt overlay2 as a journald monitor
/// of dockerd's entries in the journal directory `dir`.
fn docker_journal_monitor(dir: &std::path::Path) -> serde_json::Value {
    serde_json::json!({
        "name": "docker",
        "source": {"journald": {"directory": dir.display().to_string(), "identifier": "dockerd"}},
        "conditions": [{"type": "CorruptDockerOverlay2", "reason": "NoCorruptDockerOverlay2",
                        "message": "docker overlay2 is functioning properly"}],
        "rules": [{"type": "permanent", "condition": "CorruptDockerOverlay2", "reason": "CorruptDockerOverlay2",
                   "pattern": "returned error: readlink /var/lib/docker/overlay2.*: invalid argument.*"}],
    })
}

/// A journal entry in `dir` at a fixed time of this boot.
fn journal_entry(dir: &std::path::Path, n: u32, identifier: &str, message: &str) {
    support::journal_entry(
        dir,
        identifier,
        message,
        1_700_000_000_000_000 + u64::from(n),
    );
}

/// A journald monitor that has read nothing yet has no position saved (a
/// restart starts at the journal's end). Its first entry's position is
/// saved within a second, not with the half-minute saves of a position
/// that only moved: a crash right after resumes there, and reads what was
/// logged meanwhile.
#[tokio::test]
async fn a_journald_monitors_first_position_is_saved_within_a_second() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "jfirst").await;
    let journal = TempDir::new("jfirst");
    journal_entry(&journal.path, 1, "dockerd", "an old entry");
    let policy = unique_name("jfirst");
    apply_monitors(
        &admin,
        &policy,
        &node.name,
        serde_json::json!([docker_journal_monitor(&journal.path)]),
    )
    .await;
    let (agent, state) = start_agent(admin.clone(), &node.name).await;
    wait_condition(
        &admin,
        &node.name,
        "CorruptDockerOverlay2",
        "False",
        Duration::from_secs(15),
        "CorruptDockerOverlay2=False",
    )
    .await;
    let position = || saved_state(&state.path, "docker").map(|s| s["cursor"]["journal"].clone());
    assert_eq!(
        position(),
        Some(serde_json::Value::Null),
        "nothing read yet"
    );
    journal_entry(&journal.path, 2, "dockerd", "all is well");
    eventually(
        Duration::from_secs(5),
        "the first entry's position on disk",
        || {
            let saved = position().is_some_and(|c| c.is_string());
            async move { saved }
        },
    )
    .await;
    agent.stop().await;
    delete_policy(&admin, &policy).await;
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
        serde_json::json!([docker_journal_monitor(&journal.path)]),
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
    // The entry that set it is the only one the monitor read: the other
    // identifier's entry, written before it, never reached the rules.
    assert_eq!(
        metric_value(&agent, "nodeguard_monitor_lines_total{monitor=\"docker\"}").await,
        1,
        "another identifier's entries do not count"
    );
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

/// journalctl exits at once while a journal holds no entry of this boot (a
/// journal directory that is new or empty when the agent starts) and is
/// retried with backoff. What is logged before a retry succeeds was lost:
/// with no cursor each run started at the journal's end. A run now starts
/// where the monitor started, so that entry sets the condition
/// (node-problem-detector, which reads from its lookback, sees it too).
/// After a reboot a journald monitor resumed after the journal cursor it
/// saved in the earlier boot; `journalctl --follow` reads only the current
/// boot and skipped its first entry after that cursor, so the first entry of
/// the monitor's identifier the new boot logged (here the problem) was lost.
/// A new boot's journal is now read from its start.
#[tokio::test]
async fn a_journald_monitor_reads_a_new_boots_first_entry() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "journal-boot").await;
    let journal = TempDir::new("journal-boot");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64;
    let earlier_boot = "0123456789abcdef0123456789abcdef";
    let problem = "returned error: readlink /var/lib/docker/overlay2/b: invalid argument";
    // Boot A: the line the agent read last (its cursor), and one more.
    support::journal_entry_of_boot(
        &journal.path,
        "dockerd",
        problem,
        now - 60_000_000,
        earlier_boot,
    );
    support::journal_entry_of_boot(
        &journal.path,
        "systemd",
        "Stopping docker.service...",
        now - 59_000_000,
        earlier_boot,
    );
    // This boot, before the agent started: the problem.
    support::journal_entry(&journal.path, "dockerd", problem, now - 10_000_000);
    support::journal_entry(
        &journal.path,
        "systemd",
        "Started docker.service.",
        now - 9_000_000,
    );
    let out = std::process::Command::new("journalctl")
        .arg(format!("--directory={}", journal.path.display()))
        .args([
            "--output=json",
            "--identifier=dockerd",
            "--lines=all",
            "--no-pager",
        ])
        .output()
        .unwrap();
    let first: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().next().unwrap()).unwrap();
    let cursor = first["__CURSOR"].as_str().unwrap().to_string();

    let policy = unique_name("journal-boot");
    apply_monitors(
        &admin,
        &policy,
        &node.name,
        serde_json::json!([docker_journal_monitor(&journal.path)]),
    )
    .await;
    let state = TempDir::new("journal-boot-state");
    write_saved_state(
        &state.path,
        "docker",
        serde_json::json!({"bootId": "boot-a", "conditions": {}, "cursor": {"journal": cursor}}),
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
        "CorruptDockerOverlay2",
        "True",
        Duration::from_secs(15),
        "CorruptDockerOverlay2=True from the new boot's first dockerd entry",
    )
    .await;
    assert_eq!(
        metric_value(&agent, "nodeguard_monitor_lines_total{monitor=\"docker\"}").await,
        1,
        "only this boot's entry was read (boot A's line is not read again)"
    );
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

/// Before systemd 250, `journalctl --follow` does not keep to the current
/// boot: a journald monitor starting a new boot's journal from its start
/// (`--lines=all`) read every earlier boot too, so after each reboot a
/// problem logged months ago set its condition again (and counting windows
/// filled from history). With systemd 247's own journalctl (Debian 11's,
/// as in host mode there), the new boot is read from its start and nothing
/// of the earlier boot is.
#[tokio::test]
async fn a_journald_monitor_on_systemd_247_reads_no_earlier_boot_after_a_reboot() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "journal-247").await;
    let journal = TempDir::new("journal-247");
    let journalctl = support::old_journalctl();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64;
    let earlier_boot = "0123456789abcdef0123456789abcdef";
    let problem = "returned error: readlink /var/lib/docker/overlay2/b: invalid argument";
    // Boot A: the entry the agent read last (its cursor), then the problem.
    support::journal_entry_of_boot(
        &journal.path,
        "dockerd",
        "Daemon has completed initialization",
        now - 60_000_000,
        earlier_boot,
    );
    support::journal_entry_of_boot(
        &journal.path,
        "dockerd",
        problem,
        now - 59_000_000,
        earlier_boot,
    );
    // This boot, before the agent started: a harmless entry.
    support::journal_entry(
        &journal.path,
        "dockerd",
        "API listen on /run/docker.sock",
        now - 10_000_000,
    );
    let out = std::process::Command::new(&journalctl)
        .arg(format!("--directory={}", journal.path.display()))
        .args([
            "--output=json",
            "--identifier=dockerd",
            "--lines=all",
            "--no-pager",
        ])
        .output()
        .unwrap();
    let entries: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(entries.len(), 3, "systemd 247 reads the journal: {:?}", out);
    let cursor = entries[0]["__CURSOR"].as_str().unwrap().to_string();

    let policy = unique_name("journal-247");
    apply_monitors(
        &admin,
        &policy,
        &node.name,
        serde_json::json!([docker_journal_monitor(&journal.path)]),
    )
    .await;
    let state = TempDir::new("journal-247-state");
    write_saved_state(
        &state.path,
        "docker",
        serde_json::json!({"bootId": "boot-a", "conditions": {}, "cursor": {"journal": cursor}}),
    );
    let state_dir = state.path.clone();
    let (agent, _unused) = start_agent_with(admin.clone(), &node.name, |c| {
        c.state_dir = state_dir;
        c.boot_id = "boot-b".into();
        c.journalctl = journalctl;
    })
    .await;
    eventually(
        Duration::from_secs(15),
        "this boot's entry read",
        || async {
            metric_value(&agent, "nodeguard_monitor_lines_total{monitor=\"docker\"}").await >= 1
        },
    )
    .await;
    // Time for more to come, were any earlier boot read.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        metric_value(&agent, "nodeguard_monitor_lines_total{monitor=\"docker\"}").await,
        1,
        "only this boot's entry is read, not boot A's"
    );
    let (status, reason, _) = condition(&admin, &node.name, "CorruptDockerOverlay2")
        .await
        .expect("the monitor's condition");
    assert_eq!(
        status, "False",
        "boot A's problem set the condition ({reason})"
    );
    // The monitor follows this boot: a new problem is seen.
    support::journal_entry(&journal.path, "dockerd", problem, now);
    wait_condition(
        &admin,
        &node.name,
        "CorruptDockerOverlay2",
        "True",
        Duration::from_secs(15),
        "CorruptDockerOverlay2=True from this boot's problem",
    )
    .await;
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

/// The names of `pid`'s threads.
fn threads(pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.flatten()
                .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
                .map(|c| c.trim().to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// `pid`'s child processes, each with its pid, name and state (`Z`: a
/// zombie).
fn children(pid: u32) -> Vec<(u32, String, char)> {
    let mut children = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(child) = entry.file_name().to_str().and_then(|p| p.parse().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let rest: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        if rest.get(1).and_then(|p| p.parse::<u32>().ok()) == Some(pid) {
            let state = rest[0].chars().next().unwrap_or('?');
            children.push((child, stat[open + 1..close].to_string(), state));
        }
    }
    children
}

/// Removing a monitor stops its reader: the kernel log reader's thread
/// waited in `read()` for the next record, so on a quiet kernel log it and
/// its /dev/kmsg descriptor stayed for ever, one more per policy edit; the
/// journal reader killed journalctl without reaping it, a zombie per edit.
/// The shipped binary, a kmsg and a journald monitor, the policy deleted:
/// within 3 s neither reader thread nor journalctl is left, zombie or not.
#[tokio::test]
async fn a_removed_monitor_leaves_no_reader_thread_and_no_journalctl_behind() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "reader-stop").await;
    let journal = TempDir::new("reader-stop-journal");
    support::journal_entry(
        &journal.path,
        "dockerd",
        "API listen on /run/docker.sock",
        1_700_000_000_000_000,
    );
    let policy = unique_name("reader-stop");
    apply_monitors(
        &admin,
        &policy,
        &node.name,
        serde_json::json!([
            docker_journal_monitor(&journal.path),
            {"name": "kernel", "source": {"kmsg": {"path": "/dev/kmsg"}},
             "conditions": [{"type": "QuietKernelProblem", "reason": "NoProblem", "message": "fine"}],
             "rules": [{"type": "permanent", "condition": "QuietKernelProblem", "reason": "Never",
                        "pattern": "nodeguard test pattern that never matches 7f3a"}]},
        ]),
    )
    .await;
    let state = TempDir::new("reader-stop-state");
    let mut agent = std::process::Command::new(env!("CARGO_BIN_EXE_nodeguard"))
        .args(["run", "--listen", "127.0.0.1:0", "--node-name", &node.name])
        .arg("--kubeconfig")
        .arg(kubeconfig_path())
        .arg("--state-dir")
        .arg(&state.path)
        .arg(format!(
            "--allow-read-path=/dev/kmsg,{}",
            journal.path.display()
        ))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pid = agent.id();
    eventually(Duration::from_secs(20), "both readers running", || {
        std::future::ready(
            threads(pid).iter().any(|t| t == "nodeguard-kmsg")
                && children(pid)
                    .iter()
                    .any(|(_, c, s)| c == "journalctl" && *s != 'Z'),
        )
    })
    .await;
    delete_policy(&admin, &policy).await;
    let started = std::time::Instant::now();
    let mut left = (threads(pid), children(pid));
    while started.elapsed() < Duration::from_secs(3) {
        left = (threads(pid), children(pid));
        if !left.0.iter().any(|t| t.starts_with("nodeguard-")) && left.1.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = agent.kill();
    let _ = agent.wait();
    let readers: Vec<&String> = left
        .0
        .iter()
        .filter(|t| t.starts_with("nodeguard-"))
        .collect();
    assert!(
        readers.is_empty() && left.1.is_empty(),
        "3 s after the monitors were removed: reader threads {readers:?}, child processes {:?}",
        left.1
    );
}

/// Whether process `pid` has a descriptor on the pipe of inode `ino`.
fn holds_pipe(pid: u32, ino: u64) -> bool {
    let link = format!("pipe:[{ino}]");
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.flatten()
                .any(|e| std::fs::read_link(e.path()).is_ok_and(|l| l.as_os_str() == link.as_str()))
        })
        .unwrap_or(false)
}

/// zbus receives logind's delay inhibitor without close-on-exec and keeps
/// that copy until its message is dropped: journalctl or a plugin started
/// in that moment kept the lock for its life (journalctl for hours), and a
/// shutdown waited logind's whole InhibitDelayMaxSec after the agent had
/// released it. The shipped binary, started with a pipe's write end open
/// without close-on-exec (the lock as zbus leaves it), runs a journald and
/// a plugin monitor: neither journalctl nor the plugin holds the pipe.
#[tokio::test]
async fn a_descriptor_open_without_close_on_exec_reaches_no_child() {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    use std::os::unix::process::CommandExt;
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "no-inherit").await;
    let journal = TempDir::new("no-inherit-journal");
    support::journal_entry(
        &journal.path,
        "dockerd",
        "API listen on /run/docker.sock",
        1_700_000_000_000_000,
    );
    let plugin = journal.path.join("check.sh");
    std::fs::write(&plugin, "#!/bin/sh\nsleep 2\necho ok\n").unwrap();
    std::fs::set_permissions(&plugin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let policy = unique_name("no-inherit");
    apply_monitors(
        &admin,
        &policy,
        &node.name,
        serde_json::json!([
            docker_journal_monitor(&journal.path),
            {"name": "check", "source": {"plugin": {"intervalSeconds": 1, "timeoutSeconds": 5}},
             "conditions": [{"type": "CheckProblem", "reason": "CheckIsFine", "message": "fine"}],
             "rules": [{"type": "permanent", "condition": "CheckProblem", "reason": "CheckFailed",
                        "command": [plugin.display().to_string()]}]},
        ]),
    )
    .await;
    let (read, write) = std::io::pipe().unwrap();
    let ino = std::fs::File::from(std::os::fd::OwnedFd::from(read.try_clone().unwrap()))
        .metadata()
        .unwrap()
        .ino();
    let lock = write.as_raw_fd();
    let state = TempDir::new("no-inherit-state");
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_nodeguard"));
    cmd.args(["run", "--listen", "127.0.0.1:0", "--node-name", &node.name])
        .arg("--kubeconfig")
        .arg(kubeconfig_path())
        .arg("--state-dir")
        .arg(&state.path)
        .arg(format!("--allow-read-path={}", journal.path.display()))
        .arg(format!("--allow-command={}", plugin.display()))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    // SAFETY: one fcntl in the child before its exec: the write end stays
    // open in the agent, without close-on-exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::fcntl(lock, libc::F_SETFD, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut agent = cmd.spawn().unwrap();
    drop(write);
    let pid = agent.id();
    let mut seen: Vec<(u32, String)> = Vec::new();
    let mut holding: Vec<(u32, String)> = Vec::new();
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(30) {
        // Judged once it is journalctl or the plugin: a child between its
        // fork and its exec still has every descriptor and the forking
        // thread's name (the exec marks close-on-exec ones closed first).
        for (child, name, _) in children(pid).into_iter().filter(|c| c.2 != 'Z') {
            if name != "journalctl" && name != "check.sh" {
                continue;
            }
            if holds_pipe(child, ino) && !holding.iter().any(|(p, _)| *p == child) {
                holding.push((child, name.clone()));
            }
            if !seen.iter().any(|(p, _)| *p == child) {
                seen.push((child, name));
            }
        }
        if seen.iter().any(|(_, n)| n == "journalctl")
            && seen.iter().filter(|(_, n)| n == "check.sh").count() >= 2
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let agent_held = holds_pipe(pid, ino);
    // The monitors removed first, so that journalctl and the plugin end
    // with them, as an agent ends them.
    delete_policy(&admin, &policy).await;
    eventually(
        Duration::from_secs(10),
        "the monitors' children gone",
        || std::future::ready(children(pid).iter().all(|c| c.2 == 'Z')),
    )
    .await;
    let _ = agent.kill();
    let _ = agent.wait();
    assert!(
        agent_held,
        "the agent itself holds the pipe, or this test shows nothing"
    );
    assert!(
        seen.iter().any(|(_, n)| n == "journalctl")
            && seen.iter().filter(|(_, n)| n == "check.sh").count() >= 2,
        "journalctl and two plugin runs within 30 s: saw {seen:?}"
    );
    assert!(
        holding.is_empty(),
        "children holding the agent's descriptor: {holding:?} (of {seen:?})"
    );
}

/// A counting window had no bound and one entry per matching second: a
/// day-long window on a rule that matches every second held 86,400 entries,
/// summed on every match and rewritten into the state file every second
/// (2.3 MB each time, measured). The API server now refuses a window over a day, and
/// a window over 20 minutes keeps wider buckets: the agent that restores a
/// day of per-second counts saves at most 1,200 entries, the count kept.
#[tokio::test]
async fn a_day_long_counting_window_saves_at_most_1200_entries() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "count-window").await;
    let logs = TempDir::new("count-window");
    let app_log = logs.path.join("app.log");
    std::fs::write(&app_log, "").unwrap();
    let monitor = |window: u32| {
        serde_json::json!([{
            "name": "chatty", "source": {"file": {"path": app_log.display().to_string()}},
            "conditions": [{"type": "AppRetrying", "reason": "AppIsFine", "message": "fine"}],
            "rules": [{"type": "permanent", "condition": "AppRetrying", "reason": "Retries",
                       "pattern": "retrying", "count": {"threshold": 1000000, "windowSeconds": window}}],
        }])
    };
    let policy = unique_name("count-window");
    // A week is refused where the author writes it (this chart's CRD).
    let api: Api<nodeguard::policy::NodeGuardPolicy> = Api::all(admin.clone());
    let week: nodeguard::policy::NodeGuardPolicy = serde_json::from_value(serde_json::json!({
        "apiVersion": "nodeguard.io/v1alpha1", "kind": "NodeGuardPolicy",
        "metadata": {"name": policy},
        "spec": {"nodeSelector": selecting(&node.name), "monitors": monitor(604_800)},
    }))
    .unwrap();
    let refused = api
        .create(&Default::default(), &week)
        .await
        .expect_err("a week-long window is refused");
    let text = refused.to_string();
    assert!(
        text.contains("windowSeconds") && text.contains("86400"),
        "{text}"
    );
    apply_monitors(&admin, &policy, &node.name, monitor(86_400)).await;

    // A day of one match a second, as saved by an agent before buckets:
    // restored, they fill the window's 1,200 buckets.
    let now = jiff::Timestamp::now().as_second();
    let counts: Vec<serde_json::Value> = (1..86_400)
        .map(|s| serde_json::json!([jiff::Timestamp::from_second(now - 86_400 + s).unwrap(), 1]))
        .collect();
    let state = TempDir::new("count-window-state");
    write_saved_state(
        &state.path,
        "chatty",
        serde_json::json!({"bootId": "this-boot", "conditions": {}, "counts": {"Retries": counts}}),
    );
    let file = state.path.join("monitors/chatty.json");
    let before = std::fs::metadata(&file).unwrap().len();
    let state_dir = state.path.clone();
    let (agent, _unused) = start_agent_with(admin.clone(), &node.name, |c| {
        c.state_dir = state_dir;
        c.boot_id = "this-boot".into();
    })
    .await;
    // Lines go on matching, in eight different seconds: they go into the
    // newest bucket (72 s wide), not an entry each.
    let mut log = std::fs::OpenOptions::new()
        .append(true)
        .open(&app_log)
        .unwrap();
    let mut saved = serde_json::Value::Null;
    for _ in 0..8 {
        writeln!(log, "connection reset, retrying").unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    eventually(
        Duration::from_secs(10),
        "the state saved with the new lines",
        || {
            saved = std::fs::read_to_string(&file)
                .ok()
                .and_then(|t| serde_json::from_str(&t).ok())
                .unwrap_or_default();
            let total: i64 = saved["counts"]["Retries"]
                .as_array()
                .map(|a| a.iter().map(|e| e[1].as_i64().unwrap_or(0)).sum())
                .unwrap_or(0);
            // (the oldest bucket, 72 s of them, may have left the window)
            std::future::ready(total >= 86_000)
        },
    )
    .await;
    let entries = saved["counts"]["Retries"].as_array().unwrap().len();
    let after = std::fs::metadata(&file).unwrap().len();
    eprintln!(
        "state file: {before} bytes with 86,399 entries before, {after} bytes with {entries} after"
    );
    // 1,200 restored buckets, plus at most two for the new lines (a bucket
    // boundary among them).
    assert!(
        entries <= 1202,
        "{entries} entries saved for a day-long window"
    );
    assert!(after < 100_000, "the state file is {after} bytes");
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

/// The kernel overwrote records before the agent read them (its ring
/// buffer wrapped: `read()` answers EPIPE): the loss was counted as one,
/// whatever its size, and said nowhere but a counter. The gap in sequence
/// numbers is now counted in `nodeguard_monitor_lines_dropped_total` and
/// said in a `MonitorLinesDropped` Event.
#[tokio::test]
async fn kernel_records_overwritten_before_they_were_read_are_counted_and_said() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "kmsg-gap").await;
    let logs = TempDir::new("kmsg-gap");
    let kmsg = logs.path.join("kmsg");
    std::fs::write(&kmsg, "6,9,1,-;boot\n").unwrap();
    let policy = unique_name("kmsg-gap");
    apply_monitors(
        &admin,
        &policy,
        &node.name,
        serde_json::json!([{
            "name": "kernel", "source": {"kmsg": {"path": kmsg.display().to_string()}},
            "conditions": [{"type": "KernelDeadlock", "reason": "KernelHasNoDeadlock", "message": "fine"}],
            "rules": [{"type": "permanent", "condition": "KernelDeadlock", "reason": "DockerHung",
                       "pattern": "task docker:\\w+ blocked for more than \\w+ seconds\\."}],
        }]),
    )
    .await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;
    wait_condition(
        &admin,
        &node.name,
        "KernelDeadlock",
        "False",
        Duration::from_secs(15),
        "the monitor runs",
    )
    .await;
    // Records 10 and 13: 11 and 12 were overwritten before they were read.
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&kmsg)
        .unwrap();
    writeln!(f, "6,10,2,-;eth0: link up").unwrap();
    writeln!(f, "6,13,3,-;eth0: link down").unwrap();
    drop(f);
    eventually(Duration::from_secs(10), "both records read", || async {
        metric_value(&agent, "nodeguard_monitor_lines_total{monitor=\"kernel\"}").await >= 2
    })
    .await;
    assert_eq!(
        metric_value(
            &agent,
            "nodeguard_monitor_lines_dropped_total{monitor=\"kernel\"}"
        )
        .await,
        2,
        "the two records the kernel overwrote"
    );
    eventually(
        Duration::from_secs(10),
        "a MonitorLinesDropped Event",
        || async {
            let (n, notes) = node_event_count(&node.name, "MonitorLinesDropped");
            n >= 1 && notes.contains("lost 2 line(s)")
        },
    )
    .await;
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

/// The agent's peak resident memory (VmHWM) in KiB, after resetting it when
/// `reset` (Linux: "5" to /proc/self/clear_refs).
fn peak_rss_kib(reset: bool) -> u64 {
    if reset {
        std::fs::write("/proc/self/clear_refs", "5").unwrap();
    }
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// A followed file gets a 256 MiB line with no newline in sight (a program
/// writing binary junk or a runaway log line): the reader held all of it,
/// twice over, before it matched a byte. Now it keeps the first 64 KiB,
/// reads past the rest, counts it, and the problem line after it still
/// sets the condition; the agent's peak memory grows by far less than the
/// line.
#[tokio::test]
async fn a_256_mib_line_costs_no_memory_and_hides_nothing_after_it() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "giant-line").await;
    let logs = TempDir::new("giant-line");
    let app_log = logs.path.join("app.log");
    std::fs::write(&app_log, "").unwrap();
    let policy = unique_name("giant-line");
    apply_monitors(
        &admin,
        &policy,
        &node.name,
        serde_json::json!([{
            "name": "app", "source": {"file": {"path": app_log.display().to_string()}},
            "conditions": [{"type": "AppBroken", "reason": "AppIsFine", "message": "The app is fine."}],
            "rules": [{"type": "permanent", "condition": "AppBroken", "reason": "AppCrashed",
                       "pattern": "app crashed: (.+)", "message": "The app crashed ($1)."}],
        }]),
    )
    .await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;
    wait_condition(
        &admin,
        &node.name,
        "AppBroken",
        "False",
        Duration::from_secs(15),
        "AppBroken=False at start",
    )
    .await;
    let before = peak_rss_kib(true);
    const MIB: usize = 1024 * 1024;
    let chunk = vec![b'x'; MIB];
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&app_log)
        .unwrap();
    for _ in 0..256 {
        f.write_all(&chunk).unwrap();
    }
    f.write_all(b"\napp crashed: right after the giant line\n")
        .unwrap();
    f.flush().unwrap();
    wait_condition(
        &admin,
        &node.name,
        "AppBroken",
        "True",
        Duration::from_secs(60),
        "AppBroken=True from the line after 256 MiB without a newline",
    )
    .await;
    let grew = peak_rss_kib(false).saturating_sub(before);
    assert!(
        grew < 64 * 1024,
        "peak memory grew by {} MiB while the agent read a 256 MiB line",
        grew / 1024
    );
    assert_eq!(
        metric_value(
            &agent,
            "nodeguard_monitor_lines_truncated_total{monitor=\"app\"}"
        )
        .await,
        1,
        "the giant line is counted as truncated"
    );
    eprintln!("peak RSS grew by {grew} KiB over a 256 MiB line");
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

#[tokio::test]
async fn an_entry_logged_before_journalctl_can_start_is_not_lost() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "journal-late").await;
    let journal = TempDir::new("journal-late");
    let policy = unique_name("journal-late");
    apply_monitors(
        &admin,
        &policy,
        &node.name,
        serde_json::json!([docker_journal_monitor(&journal.path)]),
    )
    .await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;
    wait_condition(
        &admin,
        &node.name,
        "CorruptDockerOverlay2",
        "False",
        Duration::from_secs(15),
        "CorruptDockerOverlay2=False at start",
    )
    .await;
    // journalctl has failed on the empty directory by now, and waits.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64;
    support::journal_entry(
        &journal.path,
        "dockerd",
        "returned error: readlink /var/lib/docker/overlay2/q: invalid argument",
        now,
    );
    // journalctl's retries back off 1, 2, 4 s: the next one reads it.
    wait_condition(
        &admin,
        &node.name,
        "CorruptDockerOverlay2",
        "True",
        Duration::from_secs(20),
        "CorruptDockerOverlay2=True from the entry logged before journalctl could start",
    )
    .await;
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

/// A systemd-monitor test's pieces: a node, a private bus serving
/// `kubelet.service` as `unit`, a policy watching it (repaired past
/// `cooldown_seconds` of uptime) and an agent on that bus.
struct UnitRig {
    node: TestNode,
    _bus: support::dbus::PrivateBus,
    peer: support::dbus::LogindPeer,
    policy: String,
    agent: nodeguard::agent::RunningAgent,
    _state: TempDir,
}

async fn kubelet_unit_rig(
    admin: &Client,
    prefix: &str,
    unit: support::dbus::UnitState,
    cooldown_seconds: u32,
) -> UnitRig {
    use support::dbus::{LogindPeer, PrivateBus};
    let node = TestNode::selectable(admin, prefix).await;
    let bus = PrivateBus::start();
    let peer = LogindPeer::start(&bus.address, Duration::from_secs(5), None).await;
    peer.serve_unit("kubelet.service", unit).await;
    let policy = unique_name(prefix);
    apply_monitors(
        admin,
        &policy,
        &node.name,
        serde_json::json!([{
            "name": "kubelet-service",
            "source": {"systemd": {"unit": "kubelet.service", "intervalSeconds": 1, "repair": {"cooldownSeconds": cooldown_seconds}}},
            "conditions": [{"type": "KubeletServiceUnhealthy", "reason": "KubeletServiceIsHealthy", "message": "kubelet.service is active"}],
            "rules": [{"type": "permanent", "condition": "KubeletServiceUnhealthy", "reason": "KubeletServiceIsDown"}],
        }]),
    )
    .await;
    let address = bus.address.clone();
    let (agent, state) = start_agent_with(admin.clone(), &node.name, move |c| {
        c.system_bus_address = Some(address)
    })
    .await;
    UnitRig {
        node,
        _bus: bus,
        peer,
        policy,
        agent,
        _state: state,
    }
}

/// node-problem-detector's health checker for the kubelet
/// (`health-checker-kubelet.json` of its release), imported: the kubelet's
/// healthz alone decides, within NPD's `--health-check-timeout` (10 s in
/// that config), as NPD's health checker judges it. No `kubelet.service` is
/// loaded (a kubelet run by another unit, or none): a healthz answering at
/// once is healthy, and so is one answering in 6 s (both were unhealthy:
/// the unit was required, and the healthz had 5 s); a 500 is not.
#[tokio::test]
async fn an_imported_kubelet_health_checker_judges_by_healthz_within_npds_timeout() {
    use std::sync::atomic::{AtomicU8, Ordering};
    use support::dbus::{LogindPeer, PrivateBus};
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "npd-healthz").await;
    let bus = PrivateBus::start();
    let _peer = LogindPeer::start(&bus.address, Duration::from_secs(5), None).await;
    // 0: 200 at once, 1: 200 after 6 s, 2: 500.
    let mode = std::sync::Arc::new(AtomicU8::new(2));
    let app = {
        let mode = mode.clone();
        axum::Router::new().route(
            "/healthz",
            axum::routing::get(move || {
                let mode = mode.clone();
                async move {
                    match mode.load(Ordering::SeqCst) {
                        0 => (axum::http::StatusCode::OK, "ok"),
                        1 => {
                            tokio::time::sleep(Duration::from_secs(6)).await;
                            (axum::http::StatusCode::OK, "ok")
                        }
                        _ => (axum::http::StatusCode::INTERNAL_SERVER_ERROR, "sick"),
                    }
                }
            }),
        )
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let config = npd_configs().join("health-checker-kubelet.json");
    let (code, yaml, notes) = nodeguard(&["import-npd", config.to_str().unwrap()]);
    assert_eq!(code, 0, "{notes}");
    let docs = nodeguard::policy::load_policies("imported", &yaml).unwrap();
    let mut monitors =
        serde_json::to_value(&docs[0].policy.as_ref().unwrap().spec.monitors).unwrap();
    let systemd = &mut monitors[0]["source"]["systemd"];
    assert_eq!(systemd["healthTimeoutSeconds"], 10, "{yaml}");
    // The kubelet's healthz here is this test's; checked every second.
    systemd["healthUrl"] = format!("http://{addr}/healthz").into();
    systemd["intervalSeconds"] = 1.into();
    let policy = unique_name("npd-healthz");
    apply_monitors(&admin, &policy, &node.name, monitors).await;
    let address = bus.address.clone();
    let (agent, _state) = start_agent_with(admin.clone(), &node.name, move |c| {
        c.system_bus_address = Some(address)
    })
    .await;
    // Checked: a 500 is unhealthy (and no kubelet.service is loaded).
    wait_condition(
        &admin,
        &node.name,
        "KubeletUnhealthy",
        "True",
        Duration::from_secs(20),
        "KubeletUnhealthy=True: the healthz answers 500",
    )
    .await;
    // The healthz answers: healthy, with no kubelet.service.
    mode.store(0, Ordering::SeqCst);
    wait_condition(
        &admin,
        &node.name,
        "KubeletUnhealthy",
        "False",
        Duration::from_secs(20),
        "KubeletUnhealthy=False: the healthz answers, no kubelet.service loaded",
    )
    .await;
    // Three slow answers and more: never unhealthy.
    mode.store(1, Ordering::SeqCst);
    let until = Instant::now() + Duration::from_secs(20);
    while Instant::now() < until {
        let c = node_conditions(&admin, &node.name, "KubeletUnhealthy").await;
        assert!(
            c.first().is_some_and(|c| c.status == "False"),
            "a healthz answering in 6 s, within NPD's 10 s: {c:?}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

/// The repair cooldown is measured on the monotonic clock: a unit that
/// started long ago and fails is repaired even when the wall clock was set
/// back since its start (its realtime start reads as in the future).
#[tokio::test]
async fn a_unit_failing_after_the_clock_was_set_back_is_still_repaired() {
    use support::dbus::{UnitState, monotonic_usec, now_usec};
    let admin = admin_client().await;
    // Every piece bound till the end (the bus and the node go with theirs).
    let UnitRig {
        node: _node,
        _bus,
        peer,
        policy,
        agent,
        _state,
    } = kubelet_unit_rig(
        &admin,
        "service-step",
        UnitState {
            active: "failed".into(),
            sub: "failed".into(),
            // Started 30 s ago; the wall clock was set back an hour since.
            started_usec: now_usec() + 3_600_000_000 - 30_000_000,
            started_monotonic_usec: Some(monotonic_usec() - 30_000_000),
            ..Default::default()
        },
        10,
    )
    .await;
    let kills = || peer.state.lock().unwrap().units["kubelet.service"].kills;
    eventually(
        Duration::from_secs(20),
        "repaired: up 30 s by the monotonic clock, past its 10 s cooldown",
        || std::future::ready(kills() == 1),
    )
    .await;
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

#[tokio::test]
async fn an_unhealthy_unit_sets_its_condition_and_is_repaired_once_after_its_cooldown() {
    use support::dbus::{UnitState, now_usec};
    let admin = admin_client().await;
    let UnitRig {
        node,
        _bus,
        peer,
        policy,
        agent,
        _state,
    } = kubelet_unit_rig(
        &admin,
        "service",
        UnitState {
            active: "active".into(),
            sub: "running".into(),
            started_usec: now_usec(),
            ..Default::default()
        },
        2,
    )
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
    // Checked again a few times (every second, past the 2 s cooldown)
    // while healthy: not repaired again.
    let checks = "nodeguard_monitor_lines_total{monitor=\"kubelet-service\"}";
    let seen = metric_value(&agent, checks).await;
    eventually(Duration::from_secs(15), "four more checks", || async {
        metric_value(&agent, checks).await >= seen + 4
    })
    .await;
    assert_eq!(kills(), 1, "a healthy unit is not repaired again");
    // As NPD's health checker (`systemctl kill --kill-who=main`): SIGTERM
    // to the main process unless the policy names another signal.
    assert_eq!(
        peer.state.lock().unwrap().units["kubelet.service"].signals,
        [("main".to_string(), libc::SIGTERM)]
    );
    eventually(Duration::from_secs(10), "ServiceRepaired event", || async {
        kubectl(&["events", "-A", "--for", &format!("node/{}", node.name)])
            .contains("ServiceRepaired")
    })
    .await;
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

/// A state file saved in an earlier boot ("boot-a"): the kernel monitor's
/// sequence number 1000 means nothing in boot B, whose records start again
/// at 1. The agent reads boot B's ring buffer from its start, resets the
/// kernel condition (and removes the taint it had added), detects a new
/// problem record, and keeps a file monitor's condition (it has a clear
/// pattern of its own) and cursor.
#[tokio::test]
async fn a_new_boot_resets_kernel_conditions_and_reads_the_kernel_log_from_its_start() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "reboot").await;
    let logs = TempDir::new("reboot-logs");
    let kmsg = logs.path.join("kmsg");
    // Boot B's ring buffer when the agent starts: low sequence numbers.
    std::fs::write(
        &kmsg,
        "6,1,100,-;Linux version 6.1 (boot B)\n4,2,2000,-;Out of memory: Killed process 4242 (java) total-vm:1024kB, anon-rss:512kB, file-rss:0kB, shmem-rss:0kB\n",
    )
    .unwrap();
    let app_log = logs.path.join("app.log");
    std::fs::write(&app_log, "app crashed: in boot A\n").unwrap();
    let app_inode = {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(&app_log).unwrap().ino()
    };
    let app_offset = std::fs::metadata(&app_log).unwrap().len();
    let kernel = serde_json::json!({
        "name": "kernel", "source": {"kmsg": {"path": kmsg.display().to_string()}},
        "conditions": [{"type": "KernelDeadlock", "reason": "KernelHasNoDeadlock", "message": "kernel has no deadlock",
                        "taint": {"key": "example.com/kernel-deadlock", "effect": "NoSchedule"}}],
        "rules": [
            {"type": "temporary", "reason": "OOMKilling", "pattern": "Killed process \\d+ (.+) total-vm:\\d+kB"},
            {"type": "permanent", "condition": "KernelDeadlock", "reason": "DockerHung",
             "pattern": "task docker:\\w+ blocked for more than \\w+ seconds\\."},
        ],
    });
    let app = serde_json::json!({
        "name": "app", "source": {"file": {"path": app_log.display().to_string()}},
        "conditions": [{"type": "AppBroken", "reason": "AppIsFine", "message": "The app is fine.",
                        "clearPattern": "app recovered"}],
        "rules": [{"type": "permanent", "condition": "AppBroken", "reason": "AppCrashed", "pattern": "app crashed: (.+)"}],
    });
    let policy = unique_name("reboot");
    apply_monitors(
        &admin,
        &policy,
        &node.name,
        serde_json::json!([kernel, app]),
    )
    .await;
    // What boot A's agent left: both conditions True, the kernel taint
    // added by nodeguard, and the cursors.
    let state = TempDir::new("reboot-state");
    let active = |reason: &str| {
        serde_json::json!({"active": true, "reason": reason, "message": "in boot A",
                           "since": "2026-11-20T10:00:00Z", "lastMatch": "2026-11-20T10:00:00Z",
                           "taintAdded": reason == "DockerHung"})
    };
    write_saved_state(
        &state.path,
        "kernel",
        serde_json::json!({"bootId": "boot-a", "conditions": {"KernelDeadlock": active("DockerHung")},
                           "cursor": {"kmsgSequence": 1000}}),
    );
    write_saved_state(
        &state.path,
        "app",
        serde_json::json!({"bootId": "boot-a", "conditions": {"AppBroken": active("AppCrashed")},
                           "cursor": {"file": [app_inode, app_offset]}}),
    );
    set_taints(
        &admin,
        &node.name,
        serde_json::json!([{"key": "example.com/kernel-deadlock", "effect": "NoSchedule"}]),
    )
    .await;

    let state_dir = state.path.clone();
    let (agent, _unused) = start_agent_with(admin.clone(), &node.name, |c| {
        c.state_dir = state_dir;
        c.boot_id = "boot-b".into();
    })
    .await;
    eventually(
        Duration::from_secs(15),
        "KernelDeadlock reset to False by the new boot, its taint removed",
        || async {
            node_conditions(&admin, &node.name, "KernelDeadlock")
                .await
                .first()
                .is_some_and(|c| {
                    c.status == "False"
                        && c.message
                            .as_deref()
                            .is_some_and(|m| m.contains("the node rebooted"))
                })
                && !node_tainted(&admin, &node.name, "example.com/kernel-deadlock").await
        },
    )
    .await;
    // Boot B's records from before the agent started were read.
    wait_metric(&agent, "nodeguard_problem_total{reason=\"OOMKilling\"} 1").await;
    // The file monitor's condition has its own clearing: kept.
    wait_condition(
        &admin,
        &node.name,
        "AppBroken",
        "True",
        Duration::from_secs(5),
        "AppBroken kept",
    )
    .await;

    append(
        &kmsg,
        "3,3,5000000,-;INFO: task docker:20744 blocked for more than 120 seconds.",
    );
    wait_condition(
        &admin,
        &node.name,
        "KernelDeadlock",
        "True",
        Duration::from_secs(5),
        "a new problem record of boot B detected",
    )
    .await;
    eventually(Duration::from_secs(5), "the taint added again", || {
        node_tainted(&admin, &node.name, "example.com/kernel-deadlock")
    })
    .await;
    // The file monitor resumed where boot A left it.
    append(&app_log, "app recovered");
    wait_condition(
        &admin,
        &node.name,
        "AppBroken",
        "False",
        Duration::from_secs(5),
        "AppBroken cleared",
    )
    .await;
    // Its counters exist from the monitor's start, at 0 (NPD's and ours):
    // still 0.
    let text = metrics(&agent).await;
    assert!(
        text.contains("problem_counter{reason=\"AppCrashed\"} 0")
            && !text.contains("nodeguard_problem_total{reason=\"AppCrashed\"} 1"),
        "boot A's line was not read again:\n{text}"
    );
    let saved = saved_state(&state.path, "kernel").unwrap();
    assert_eq!(saved["bootId"], "boot-b", "{saved}");
    assert_eq!(saved["cursor"]["kmsgSequence"], 3, "{saved}");
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

/// An operator put the same taint on the Node before the condition went
/// True: nodeguard does not own it and leaves it when the condition clears,
/// also across a restart. A taint nodeguard added itself is removed.
#[tokio::test]
async fn only_taints_nodeguard_added_are_removed_when_the_condition_clears() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "owned").await;
    let logs = TempDir::new("owned-logs");
    let app_log = logs.path.join("app.log");
    std::fs::write(&app_log, "").unwrap();
    let app = serde_json::json!({
        "name": "app", "source": {"file": {"path": app_log.display().to_string()}},
        "conditions": [{"type": "AppBroken", "reason": "AppIsFine", "message": "The app is fine.",
                        "clearPattern": "app recovered",
                        "taint": {"key": "example.com/app-broken", "value": "true", "effect": "NoSchedule"}}],
        "rules": [
            {"type": "permanent", "condition": "AppBroken", "reason": "AppCrashed", "pattern": "app crashed"},
            {"type": "temporary", "reason": "AppWarning", "pattern": "app warning"},
        ],
    });
    let policy = unique_name("owned");
    apply_monitors(&admin, &policy, &node.name, serde_json::json!([app])).await;
    let operator_taint = serde_json::json!([{"key": "example.com/app-broken", "value": "true", "effect": "NoSchedule"}]);
    set_taints(&admin, &node.name, operator_taint).await;
    let state = TempDir::new("owned-state");
    let state_dir = state.path.clone();
    let start = || {
        let state_dir = state_dir.clone();
        start_agent_with(admin.clone(), &node.name, move |c| c.state_dir = state_dir)
    };
    let (agent, _unused) = start().await;
    wait_condition(
        &admin,
        &node.name,
        "AppBroken",
        "False",
        Duration::from_secs(15),
        "AppBroken=False at start",
    )
    .await;
    append(&app_log, "app crashed");
    wait_condition(
        &admin,
        &node.name,
        "AppBroken",
        "True",
        Duration::from_secs(5),
        "AppBroken=True",
    )
    .await;
    eventually(Duration::from_secs(5), "the state saved: not ours", || {
        std::future::ready(
            saved_state(&state.path, "app")
                .is_some_and(|s| s["conditions"]["AppBroken"]["taintAdded"] == false),
        )
    })
    .await;
    // Ownership is in the saved state: a restart does not claim the taint.
    agent.stop().await;
    let (agent, _unused) = start().await;
    eventually(Duration::from_secs(15), "AppBroken=True restored", || {
        std::future::ready(desired_is(&agent, "AppBroken", Status::True))
    })
    .await;
    append(&app_log, "app recovered");
    // Lines are handled in order, each with its taint calls done: once the
    // next line's Event is counted, the clear's taint decision is made.
    append(&app_log, "app warning");
    wait_metric(&agent, "nodeguard_problem_total{reason=\"AppWarning\"} 1").await;
    wait_condition(
        &admin,
        &node.name,
        "AppBroken",
        "False",
        Duration::from_secs(5),
        "AppBroken=False",
    )
    .await;
    assert!(
        node_tainted(&admin, &node.name, "example.com/app-broken").await,
        "the operator's taint stays"
    );

    // Without the operator's taint, nodeguard adds it and removes it again.
    set_taints(&admin, &node.name, serde_json::json!([])).await;
    append(&app_log, "app crashed");
    eventually(
        Duration::from_secs(5),
        "AppBroken=True with nodeguard's taint",
        || async {
            condition_is(&admin, &node.name, "AppBroken", "True").await
                && node_tainted(&admin, &node.name, "example.com/app-broken").await
        },
    )
    .await;
    append(&app_log, "app recovered");
    eventually(
        Duration::from_secs(5),
        "AppBroken=False, nodeguard's taint removed",
        || async {
            condition_is(&admin, &node.name, "AppBroken", "False").await
                && !node_tainted(&admin, &node.name, "example.com/app-broken").await
        },
    )
    .await;
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

/// Editing a monitor's condition type or taint removes the old condition
/// and the old taint nodeguard added; removing the monitor removes its
/// conditions and its state file, which stays removed.
#[tokio::test]
async fn editing_a_monitor_removes_what_the_new_spec_dropped() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "edit").await;
    let logs = TempDir::new("edit-logs");
    let app_log = logs.path.join("app.log");
    std::fs::write(&app_log, "").unwrap();
    let app = |type_: &str, taint: &str| {
        serde_json::json!({
            "name": "app", "source": {"file": {"path": app_log.display().to_string()}},
            "conditions": [{"type": type_, "reason": "AppIsFine", "message": "The app is fine.",
                            "clearPattern": "app recovered",
                            "taint": {"key": taint, "effect": "NoSchedule"}}],
            "rules": [{"type": "permanent", "condition": type_, "reason": "AppCrashed", "pattern": "app crashed"}],
        })
    };
    let policy = unique_name("edit");
    apply_monitors(
        &admin,
        &policy,
        &node.name,
        serde_json::json!([app("AppBroken", "example.com/app-broken")]),
    )
    .await;
    let (agent, state) = start_agent(admin.clone(), &node.name).await;
    wait_condition(
        &admin,
        &node.name,
        "AppBroken",
        "False",
        Duration::from_secs(15),
        "AppBroken=False at start",
    )
    .await;
    append(&app_log, "app crashed");
    eventually(
        Duration::from_secs(5),
        "AppBroken=True with its taint",
        || async {
            condition_is(&admin, &node.name, "AppBroken", "True").await
                && node_tainted(&admin, &node.name, "example.com/app-broken").await
        },
    )
    .await;

    // Another condition type and taint: the old ones go.
    apply_monitors(
        &admin,
        &policy,
        &node.name,
        serde_json::json!([app("AppDown", "example.com/app-down")]),
    )
    .await;
    eventually(
        Duration::from_secs(10),
        "AppBroken and its taint removed, AppDown=False",
        || async {
            condition_status(&admin, &node.name, "AppBroken")
                .await
                .is_none()
                && !node_tainted(&admin, &node.name, "example.com/app-broken").await
                && condition_is(&admin, &node.name, "AppDown", "False").await
        },
    )
    .await;
    append(&app_log, "app crashed");
    eventually(
        Duration::from_secs(5),
        "AppDown=True with its taint",
        || async {
            condition_is(&admin, &node.name, "AppDown", "True").await
                && node_tainted(&admin, &node.name, "example.com/app-down").await
        },
    )
    .await;
    // Only the taint changes, the condition stays True: the old taint is
    // removed and the new one added.
    apply_monitors(
        &admin,
        &policy,
        &node.name,
        serde_json::json!([app("AppDown", "example.com/app-down-2")]),
    )
    .await;
    eventually(Duration::from_secs(10), "the taint replaced", || async {
        !node_tainted(&admin, &node.name, "example.com/app-down").await
            && node_tainted(&admin, &node.name, "example.com/app-down-2").await
            && condition_is(&admin, &node.name, "AppDown", "True").await
    })
    .await;
    append(&app_log, "app recovered");
    eventually(
        Duration::from_secs(5),
        "AppDown=False, taint removed",
        || async {
            condition_is(&admin, &node.name, "AppDown", "False").await
                && !node_tainted(&admin, &node.name, "example.com/app-down-2").await
        },
    )
    .await;

    // Removed: its condition goes, and so does its state file (the old
    // task's last save must not bring it back).
    apply_monitors(&admin, &policy, &node.name, serde_json::json!([])).await;
    eventually(Duration::from_secs(10), "AppDown removed", || async {
        condition_status(&admin, &node.name, "AppDown")
            .await
            .is_none()
    })
    .await;
    assert!(
        saved_state(&state.path, "app").is_none(),
        "the removed monitor's state file stays removed"
    );
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

/// A line that is not UTF-8 does not take the next line with it, and the
/// saved offset counts bytes.
#[tokio::test]
async fn a_line_that_is_not_utf8_does_not_hide_the_next_one() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "utf8").await;
    let logs = TempDir::new("utf8-logs");
    let log = logs.path.join("kern.log");
    std::fs::write(&log, "").unwrap();
    let policy = unique_name("utf8");
    apply_monitors(
        &admin,
        &policy,
        &node.name,
        serde_json::json!([{
            "name": "fs", "source": {"file": {"path": log.display().to_string()}},
            "conditions": [{"type": "FilesystemCorrupt", "reason": "FilesystemIsFine", "message": "no ext4 errors"}],
            "rules": [{"type": "permanent", "condition": "FilesystemCorrupt", "reason": "Ext4Error", "pattern": "EXT4-fs error .*"}],
        }]),
    )
    .await;
    let (agent, state) = start_agent(admin.clone(), &node.name).await;
    wait_condition(
        &admin,
        &node.name,
        "FilesystemCorrupt",
        "False",
        Duration::from_secs(15),
        "FilesystemCorrupt=False at start",
    )
    .await;
    {
        let mut f = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
        f.write_all(b"kernel: bad byte \xff here\n").unwrap();
        f.write_all(b"EXT4-fs error (device sda1): ext4_find_entry\n")
            .unwrap();
    }
    let len = std::fs::metadata(&log).unwrap().len();
    wait_condition(
        &admin,
        &node.name,
        "FilesystemCorrupt",
        "True",
        Duration::from_secs(5),
        "the line after the bad byte detected",
    )
    .await;
    eventually(
        Duration::from_secs(5),
        "the saved offset at the end of the file",
        || {
            std::future::ready(
                saved_state(&state.path, "fs").is_some_and(|s| s["cursor"]["file"][1] == len),
            )
        },
    )
    .await;
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

/// NPD's open bug (#1168): the kernel log channel closes and the detector
/// keeps running blind. Here a monitor whose source keeps failing gives up,
/// and `/livez` fails naming it; removing the monitor on purpose clears it.
#[tokio::test]
async fn a_monitor_whose_source_ends_fails_livez_naming_it() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "ended").await;
    // A regular file every read of which fails (EIO: nothing is mapped at
    // address 0 of the reading process): a reader that cannot go on. (A
    // directory, used before, is now refused at the open: not a file.)
    let policy = unique_name("ended");
    apply_monitors(
        &admin,
        &policy,
        &node.name,
        serde_json::json!([{
            "name": "broken", "source": {"file": {"path": "/proc/self/mem"}},
            "conditions": [{"type": "AppBroken", "reason": "AppIsFine", "message": "The app is fine."}],
            "rules": [{"type": "permanent", "condition": "AppBroken", "reason": "AppCrashed", "pattern": "app crashed"}],
        }]),
    )
    .await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;
    eventually(
        Duration::from_secs(30),
        "/livez 503 naming monitor/broken",
        || async {
            let (status, body) = http_get(agent.addr, "/livez").await;
            status == 503 && body.contains("monitor/broken")
        },
    )
    .await;
    let (_, body) = http_get(agent.addr, "/livez").await;
    assert!(
        body.contains("its log source ended") && body.contains("times in a row"),
        "{body}"
    );
    // Removed on purpose: no longer a failure.
    apply_monitors(&admin, &policy, &node.name, serde_json::json!([])).await;
    eventually(Duration::from_secs(10), "/livez 200 again", || async {
        http_get(agent.addr, "/livez").await.0 == 200
    })
    .await;
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

/// Two conditions must not share a taint (key and effect): the first to
/// clear would remove it while the other is still True. Within a policy it
/// is a validation problem naming both; across policies the later monitor
/// is dropped with a PolicyConflict Event, as for a shared condition type.
/// An imported plugin whose check cannot tell (exit 3) makes its condition
/// Unknown with the check's output as the message, clipped as a True
/// condition's message is, however long `maxOutputLength` lets it be.
#[tokio::test]
async fn an_unknown_plugin_result_is_clipped_like_a_problem() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "unkclip").await;
    let policy = unique_name("unkclip");
    let script = "printf 'x%.0s' $(seq 2000); exit 3";
    apply_monitors(
        &admin,
        &policy,
        &node.name,
        serde_json::json!([{
            "name": "chatty",
            "source": {"plugin": {"intervalSeconds": 1, "timeoutSeconds": 5,
                                  "maxOutputLength": 4096, "npdResults": true}},
            "conditions": [{"type": "ChattyProblem", "reason": "ChattyIsFine", "message": "fine"}],
            "rules": [{"type": "permanent", "condition": "ChattyProblem", "reason": "ChattyIsDown",
                       "command": ["/bin/sh", "-c", script]}],
        }]),
    )
    .await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;
    wait_condition(
        &admin,
        &node.name,
        "ChattyProblem",
        "Unknown",
        Duration::from_secs(15),
        "ChattyProblem=Unknown from exit 3",
    )
    .await;
    let c = node_conditions(&admin, &node.name, "ChattyProblem").await;
    let message = c[0].message.clone().unwrap_or_default();
    assert!(
        message.len() <= 512 && message.starts_with("xxxx") && message.ends_with('…'),
        "{} bytes: {message}",
        message.len()
    );
    // Its Event (NPD's words) quotes the same clipped message.
    let mut note = String::new();
    eventually(Duration::from_secs(10), "the Unknown Event", || {
        note = node_event_count(&node.name, "ChattyIsFine").1;
        let found = note.contains("is now: Unknown");
        async move { found }
    })
    .await;
    assert!(
        note.contains(&format!("message: \"{message}\"")),
        "the Event quotes the condition's message: {note}"
    );
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

/// A `healthUrl` the prober cannot request (no scheme, as NPD's flags take
/// a host:port) is refused by the API server with its path, where the
/// operator applies it, instead of run with the check undone.
#[tokio::test]
async fn a_health_url_that_cannot_be_requested_is_refused_with_its_path() {
    let admin = admin_client().await;
    let api: kube::Api<nodeguard::policy::NodeGuardPolicy> = kube::Api::all(admin.clone());
    let monitor = |url: &str| {
        serde_json::json!([{
            "name": "kubelet",
            "source": {"systemd": {"unit": "kubelet.service", "healthUrl": url}},
            "conditions": [{"type": "KubeletUnhealthy", "reason": "KubeletIsHealthy", "message": "fine"}],
            "rules": [{"type": "permanent", "condition": "KubeletUnhealthy", "reason": "KubeletUnhealthy"}],
        }])
    };
    let policy = |name: &str, url: &str| {
        serde_json::from_value::<nodeguard::policy::NodeGuardPolicy>(serde_json::json!({
            "apiVersion": "nodeguard.io/v1alpha1", "kind": "NodeGuardPolicy",
            "metadata": {"name": name},
            "spec": {"nodeSelector": {"matchLabels": {"nodeguard.io/none": "none"}}, "monitors": monitor(url)},
        }))
        .unwrap()
    };
    for url in ["127.0.0.1:10248/healthz", "tcp://127.0.0.1:10248/healthz"] {
        let name = unique_name("badhealth");
        let err = api
            .create(&Default::default(), &policy(&name, url))
            .await
            .expect_err(&format!("{url:?} must be refused"));
        let text = err.to_string();
        assert!(
            text.contains("spec.monitors[0].source.systemd.healthUrl"),
            "{url:?}: {text}"
        );
        // `nodeguard check` says so of the same file before it is applied.
        let dir = TempDir::new("badhealth");
        let file = dir.path.join("policy.json");
        std::fs::write(&file, serde_json::to_vec(&policy(&name, url)).unwrap()).unwrap();
        let (code, out, _) = nodeguard(&["check", "-f", file.to_str().unwrap()]);
        assert!(
            code == 1 && out.contains("spec.monitors[0].source.systemd.healthUrl"),
            "`nodeguard check` of {url:?}: exit {code}, {out}"
        );
    }
    let name = unique_name("goodhealth");
    let dir = TempDir::new("goodhealth");
    let file = dir.path.join("policy.json");
    std::fs::write(
        &file,
        serde_json::to_vec(&policy(&name, "http://127.0.0.1:10248/healthz")).unwrap(),
    )
    .unwrap();
    let (code, out, _) = nodeguard(&["check", "-f", file.to_str().unwrap()]);
    assert_eq!(code, 0, "`nodeguard check` of an http URL: {out}");
    api.create(
        &Default::default(),
        &policy(&name, "http://127.0.0.1:10248/healthz"),
    )
    .await
    .expect("an http URL is taken");
    delete_policy(&admin, &name).await;
}

#[tokio::test]
async fn conditions_sharing_a_taint_are_rejected() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "shtaint").await;
    let logs = TempDir::new("shtaint-logs");
    let a_log = logs.path.join("a.log");
    let b_log = logs.path.join("b.log");
    std::fs::write(&a_log, "").unwrap();
    std::fs::write(&b_log, "").unwrap();
    let taint = serde_json::json!({"key": "example.com/unhealthy", "effect": "NoSchedule"});
    let mon = |name: &str, path: &std::path::Path, t: &str| {
        serde_json::json!({
            "name": name, "source": {"file": {"path": path.display().to_string()}},
            "conditions": [{"type": t, "reason": "Fine", "message": "fine", "clearPattern": "recovered", "taint": taint}],
            "rules": [{"type": "permanent", "condition": t, "reason": "Broken", "pattern": "crashed"}],
        })
    };
    // Within one policy: `nodeguard check` names both conditions.
    let dir = TempDir::new("shtaint-check");
    let f = dir.path.join("p.json");
    let both = serde_json::json!({
        "apiVersion": "nodeguard.io/v1alpha1", "kind": "NodeGuardPolicy", "metadata": {"name": "shared"},
        "spec": {"monitors": [mon("a", &a_log, "ABroken"), mon("b", &b_log, "BBroken")]},
    });
    std::fs::write(&f, both.to_string()).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_nodeguard"))
        .args(["check", "-f", f.to_str().unwrap()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("spec.monitors[1].conditions[0].taint")
            && text.contains("ABroken")
            && text.contains("BBroken"),
        "{text}"
    );
    // Across policies: the agent runs one of them and says why not the other.
    let base = unique_name("shtaint");
    let (pa, pb) = (format!("{base}-a"), format!("{base}-b"));
    apply_monitors(
        &admin,
        &pa,
        &node.name,
        serde_json::json!([mon("a", &a_log, "ABroken")]),
    )
    .await;
    apply_monitors(
        &admin,
        &pb,
        &node.name,
        serde_json::json!([mon("b", &b_log, "BBroken")]),
    )
    .await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;
    let mut events = String::new();
    eventually(
        Duration::from_secs(15),
        "a PolicyConflict event naming the shared taint",
        || {
            events = kubectl(&["events", "-A", "--for", &format!("node/{}", node.name)]);
            let found = events.contains("PolicyConflict")
                && events.contains("example.com/unhealthy:NoSchedule");
            async move { found }
        },
    )
    .await;
    wait_condition(
        &admin,
        &node.name,
        "ABroken",
        "False",
        Duration::from_secs(15),
        "the first policy's monitor runs",
    )
    .await;
    assert!(
        !agent.reporter.desired().contains_key("BBroken"),
        "the second monitor must not run: {events}"
    );
    agent.stop().await;
    delete_policy(&admin, &pa).await;
    delete_policy(&admin, &pb).await;
}

/// The state directory fills up, then turns read-only, while a monitor's
/// condition flips: the agent goes on reporting to the API, says so once
/// per episode (a Warning Event, a counter), keeps the last state it wrote
/// whole (no truncated or stray file), and writes again once it can,
/// saying that too.
#[tokio::test]
async fn a_full_or_read_only_state_directory_is_said_once_and_loses_nothing() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "fullstate").await;
    let logs = TempDir::new("logs");
    let app_log = logs.path.join("app.log");
    std::fs::write(&app_log, "").unwrap();
    let app = serde_json::json!({
        "name": "app", "source": {"file": {"path": app_log.display().to_string()}},
        "conditions": [{"type": "AppBroken", "reason": "AppIsFine", "message": "The app is fine.",
                        "clearPattern": "app recovered"}],
        "rules": [{"type": "permanent", "condition": "AppBroken", "reason": "AppCrashed",
                   "pattern": "app crashed: (.+)", "message": "The app crashed ($1)."}],
    });
    let policy = unique_name("fullstate");
    apply_monitors(&admin, &policy, &node.name, serde_json::json!([app])).await;
    let fs = SmallFs::mount("256k");
    let state_dir = fs.dir.path.clone();
    let (agent, _unused) = start_agent_with(admin.clone(), &node.name, |c| {
        c.state_dir = state_dir.clone()
    })
    .await;
    let flip = |line: &str, status: &'static str| {
        append(&app_log, line);
        let (admin, node) = (admin.clone(), node.name.clone());
        async move {
            wait_condition(
                &admin,
                &node,
                "AppBroken",
                status,
                Duration::from_secs(10),
                &format!("AppBroken={status}"),
            )
            .await
        }
    };
    wait_condition(
        &admin,
        &node.name,
        "AppBroken",
        "False",
        Duration::from_secs(15),
        "AppBroken=False at start",
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    flip("app crashed: one", "True").await;
    eventually(Duration::from_secs(5), "the True state saved", || {
        let saved = saved_state(&state_dir, "app");
        async move { saved.is_some_and(|s| s["conditions"]["AppBroken"]["active"] == true) }
    })
    .await;
    let saved_before = std::fs::read(state_dir.join("monitors/app.json")).unwrap();

    // Full: the API still hears of every change; the file keeps the last
    // state written, whole.
    let filler = fs.fill();
    flip("app recovered", "False").await;
    flip("app crashed: two", "True").await;
    flip("app recovered", "False").await;
    eventually(Duration::from_secs(10), "a StateWriteFailed Event", || {
        let (n, _) = node_event_count(&node.name, "StateWriteFailed");
        async move { n >= 1 }
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (failed, notes) = node_event_count(&node.name, "StateWriteFailed");
    assert_eq!(
        failed, 1,
        "one Warning for the episode, not one per write:\n{notes}"
    );
    assert!(notes.contains("No space left on device"), "{notes}");
    assert!(notes.contains(&state_dir.display().to_string()), "{notes}");
    assert_eq!(
        std::fs::read(state_dir.join("monitors/app.json")).unwrap(),
        saved_before,
        "the last state written stays as it was"
    );
    let stray: Vec<_> = std::fs::read_dir(state_dir.join("monitors"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != "app.json")
        .collect();
    assert!(stray.is_empty(), "partial files left behind: {stray:?}");
    // Writes are at most once a second; a failed one is tried again the
    // next second while the state is unwritten.
    assert!(
        metric_value(&agent, "nodeguard_state_write_errors_total").await >= 2,
        "{}",
        metrics(&agent).await
    );

    // Space again: the state that could not be written is written within
    // seconds, with no new line to prompt it, and that is said.
    std::fs::remove_file(&filler).unwrap();
    eventually(
        Duration::from_secs(5),
        "the state held in memory written once there is room",
        || {
            let saved = saved_state(&state_dir, "app");
            async move { saved.is_some_and(|s| s["conditions"]["AppBroken"]["active"] == false) }
        },
    )
    .await;
    flip("app crashed: three", "True").await;
    eventually(
        Duration::from_secs(10),
        "a StateWriteRecovered Event",
        || {
            let (n, _) = node_event_count(&node.name, "StateWriteRecovered");
            async move { n == 1 }
        },
    )
    .await;
    // Saved within the second (writes are at most once a second).
    eventually(Duration::from_secs(3), "the state (three) saved", || {
        let saved = saved_state(&state_dir, "app");
        async move {
            saved.is_some_and(|s| {
                s["conditions"]["AppBroken"]["message"] == "The app crashed (three)."
            })
        }
    })
    .await;

    // Read-only: a second episode, a second Warning naming its cause.
    fs.remount("ro");
    flip("app recovered", "False").await;
    eventually(
        Duration::from_secs(10),
        "a second StateWriteFailed Event",
        || {
            let (n, notes) = node_event_count(&node.name, "StateWriteFailed");
            async move { n == 2 && notes.contains("Read-only file system") }
        },
    )
    .await;
    fs.remount("rw");
    flip("app crashed: four", "True").await;
    eventually(Duration::from_secs(10), "the state written again", || {
        let saved = saved_state(&state_dir, "app");
        async move {
            saved.is_some_and(|s| {
                s["conditions"]["AppBroken"]["message"] == "The app crashed (four)."
            })
        }
    })
    .await;
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

/// journalctl's JSON prints a field longer than 4,096 bytes as null unless
/// told `--all`: a journal entry with a long message (a stack trace on one
/// line, a long command line) was dropped as malformed, problem and all.
/// Now it is read; an entry far past the line limit is read up to the
/// limit (counted as truncated), and the entries after it are read too.
#[tokio::test]
async fn long_journal_messages_are_matched_not_dropped() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "journal-long").await;
    let journal = TempDir::new("journal-long");
    let policy = unique_name("journal-long");
    apply_monitors(
        &admin,
        &policy,
        &node.name,
        serde_json::json!([{
            "name": "app",
            "source": {"journald": {"directory": journal.path.display().to_string(), "identifier": "app"}},
            "conditions": [
                {"type": "AppBroken", "reason": "AppIsFine", "message": "fine"},
                {"type": "AppStuck", "reason": "AppIsMoving", "message": "moving"},
            ],
            "rules": [
                {"type": "permanent", "condition": "AppBroken", "reason": "AppCrashed", "pattern": "app crashed: (\\w+)"},
                {"type": "permanent", "condition": "AppStuck", "reason": "AppHung", "pattern": "app hung"},
            ],
        }]),
    )
    .await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;
    wait_condition(
        &admin,
        &node.name,
        "AppBroken",
        "False",
        Duration::from_secs(15),
        "AppBroken=False at start",
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    // 5 KiB: past journalctl's 4,096-byte default, within the agent's limit.
    let long = format!("{} app crashed: long", "x".repeat(5000));
    journal_entry(&journal.path, 1, "app", &long);
    wait_condition(
        &admin,
        &node.name,
        "AppBroken",
        "True",
        Duration::from_secs(10),
        "AppBroken=True from a 5 KiB message",
    )
    .await;
    // 3 MiB: the problem at its start is matched, memory stays bounded, and
    // the next entry is read.
    let huge = format!("app hung {}", "y".repeat(3 << 20));
    journal_entry(&journal.path, 2, "app", &huge);
    journal_entry(&journal.path, 3, "app", "after the huge one");
    wait_condition(
        &admin,
        &node.name,
        "AppStuck",
        "True",
        Duration::from_secs(15),
        "AppStuck=True from the start of a 3 MiB message",
    )
    .await;
    eventually(
        Duration::from_secs(10),
        "all three entries read",
        || async {
            metric_value(&agent, "nodeguard_monitor_lines_total{monitor=\"app\"}").await == 3
        },
    )
    .await;
    assert_eq!(
        metric_value(
            &agent,
            "nodeguard_monitor_lines_truncated_total{monitor=\"app\"}"
        )
        .await,
        1,
        "{}",
        metrics(&agent).await
    );
    assert_eq!(
        metric_value(
            &agent,
            "nodeguard_monitor_lines_malformed_total{monitor=\"app\"}"
        )
        .await,
        0
    );
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

/// A state directory read-only when the agent starts (a restart while the
/// disk is in trouble): the agent used to refuse to start, leaving the node
/// with no monitors, no shutdown inhibitor and frozen conditions until the
/// disk was fixed. It starts, says so once, and works from memory.
#[tokio::test]
async fn the_agent_starts_on_a_read_only_state_directory_and_says_so() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "rostate").await;
    let logs = TempDir::new("logs");
    let app_log = logs.path.join("app.log");
    std::fs::write(&app_log, "").unwrap();
    let app = serde_json::json!({
        "name": "app", "source": {"file": {"path": app_log.display().to_string()}},
        "conditions": [{"type": "AppBroken", "reason": "AppIsFine", "message": "The app is fine."}],
        "rules": [{"type": "permanent", "condition": "AppBroken", "reason": "AppCrashed",
                   "pattern": "app crashed: (.+)"}],
    });
    let policy = unique_name("rostate");
    apply_monitors(&admin, &policy, &node.name, serde_json::json!([app])).await;
    let fs = SmallFs::mount("256k");
    fs.remount("ro");
    let state_dir = fs.dir.path.clone();
    let (agent, _unused) = start_agent_with(admin.clone(), &node.name, |c| {
        c.state_dir = state_dir.clone()
    })
    .await;
    wait_condition(
        &admin,
        &node.name,
        "AppBroken",
        "False",
        Duration::from_secs(15),
        "AppBroken=False at start",
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    append(&app_log, "app crashed: read-only disk");
    wait_condition(
        &admin,
        &node.name,
        "AppBroken",
        "True",
        Duration::from_secs(10),
        "AppBroken=True with the state directory read-only",
    )
    .await;
    eventually(Duration::from_secs(10), "a StateWriteFailed Event", || {
        let (n, notes) = node_event_count(&node.name, "StateWriteFailed");
        async move { n == 1 && notes.contains("Read-only file system") }
    })
    .await;
    let (code, body) = http_get(agent.addr, "/readyz").await;
    assert_eq!(code, 200, "{body}");
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

/// The wall clock set forward an hour while the agent was stopped (on the
/// same boot): the saved quiet period goes on from the line, it does not
/// end at start (the saved times read an hour old).
#[tokio::test]
async fn a_clock_set_forward_while_the_agent_was_stopped_keeps_the_quiet_period() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "step-stopped").await;
    let logs = TempDir::new("step-stopped");
    let app_log = logs.path.join("app.log");
    std::fs::write(&app_log, "").unwrap();
    let policy = unique_name("step-stopped");
    apply_monitors(
        &admin,
        &policy,
        &node.name,
        serde_json::json!([{
            "name": "app", "source": {"file": {"path": app_log.display().to_string()}},
            "conditions": [{"type": "AppBroken", "reason": "AppIsFine", "message": "The app is fine.", "clearAfterSeconds": 40}],
            "rules": [{"type": "permanent", "condition": "AppBroken", "reason": "AppCrashed", "pattern": "app crashed"}],
        }]),
    )
    .await;
    // The line came 10 s ago and the state was saved 5 s ago, while the
    // wall clock read an hour behind; it was set forward since.
    let now = jiff::Timestamp::now();
    let hour = jiff::SignedDuration::from_secs(3600);
    let matched = now - hour - jiff::SignedDuration::from_secs(10);
    let saved = now - hour - jiff::SignedDuration::from_secs(5);
    let monotonic_ms = support::dbus::monotonic_usec() / 1000 - 5_000;
    let state = TempDir::new("step-stopped-state");
    write_saved_state(
        &state.path,
        "app",
        serde_json::json!({
            "bootId": "boot-step",
            "conditions": {"AppBroken": {"active": true, "reason": "AppCrashed", "message": "app crashed",
                                         "since": matched, "lastMatch": matched}},
            "savedAt": [saved, monotonic_ms],
        }),
    );
    let state_dir = state.path.clone();
    let started = Instant::now();
    let (agent, _unused) = start_agent_with(admin.clone(), &node.name, |c| {
        c.state_dir = state_dir;
        c.boot_id = "boot-step".into();
    })
    .await;
    wait_condition(
        &admin,
        &node.name,
        "AppBroken",
        "True",
        Duration::from_secs(15),
        "AppBroken=True from the saved state",
    )
    .await;
    // 40 s from the line, 10 s before the start: True until ~30 s after it.
    while started.elapsed() < Duration::from_secs(20) {
        assert!(
            condition_is(&admin, &node.name, "AppBroken", "True").await,
            "AppBroken cleared {:?} after the start: the step was taken as time that passed",
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

/// A policy edited while the agent was not running (stopped for an
/// upgrade, or killed while it applied the edit): the restarted agent never
/// saw the old spec, so what it added under it is known only from its saved
/// state. The taint of a removed monitor and the old taint of a condition
/// whose taint changed go; the new taint comes; someone else's stays.
#[tokio::test]
async fn taints_of_a_policy_edited_while_the_agent_was_down_are_not_left_behind() {
    edited_while_down_case(false).await;
}

/// Review finding: the same where the node's trust refuses an item of the
/// edited policy (an exec probe), so NodeGuardPolicyInvalid is True with
/// reason PolicyRefused. The sweep waited for that condition to clear,
/// which a refusal never does: the removed monitor's taint stayed for as
/// long as the refusal. Only an invalid policy holds the sweep back now.
#[tokio::test]
async fn taints_of_a_policy_edited_while_the_agent_was_down_go_on_a_node_that_refuses_an_item() {
    edited_while_down_case(true).await;
}

async fn edited_while_down_case(refused: bool) {
    let admin = admin_client().await;
    let node = TestNode::selectable(
        &admin,
        if refused {
            "edit-down-ref"
        } else {
            "edit-down"
        },
    )
    .await;
    let logs = TempDir::new("logs");
    let (app_log, disk_log) = (logs.path.join("app.log"), logs.path.join("disk.log"));
    std::fs::write(&app_log, "").unwrap();
    std::fs::write(&disk_log, "").unwrap();
    let monitor = |name: &str, log: &std::path::Path, type_: &str, taint: &str| {
        serde_json::json!({
            "name": name, "source": {"file": {"path": log.display().to_string()}},
            "conditions": [{"type": type_, "reason": "Fine", "message": "fine",
                            "taint": {"key": taint, "effect": "NoSchedule"}}],
            "rules": [{"type": "permanent", "condition": type_, "reason": "Broken", "pattern": "broken"}],
        })
    };
    let policy = unique_name("edit-down");
    apply_monitors(
        &admin,
        &policy,
        &node.name,
        serde_json::json!([
            monitor("app", &app_log, "AppBroken", "example.com/app-broken"),
            monitor("disk", &disk_log, "DiskBroken", "example.com/disk-broken"),
        ]),
    )
    .await;
    set_taints(
        &admin,
        &node.name,
        serde_json::json!([{"key": "example.com/operators", "effect": "NoSchedule"}]),
    )
    .await;
    let state = TempDir::new("persistent-state");
    let state_path = state.path.clone();
    let (agent, _unused) = start_agent_with(admin.clone(), &node.name, |c| {
        c.state_dir = state_path.clone()
    })
    .await;
    eventually(Duration::from_secs(15), "both monitors running", || async {
        condition_is(&admin, &node.name, "AppBroken", "False").await
            && condition_is(&admin, &node.name, "DiskBroken", "False").await
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    append(&app_log, "app broken");
    append(&disk_log, "disk broken");
    eventually(
        Duration::from_secs(10),
        "both tainted by nodeguard",
        || async {
            node_tainted(&admin, &node.name, "example.com/app-broken").await
                && node_tainted(&admin, &node.name, "example.com/disk-broken").await
        },
    )
    .await;
    agent.stop().await;

    // The edit the agent never applied: "disk" removed, "app" taints
    // another key; with `refused`, a probe this node's trust refuses.
    let mut edited = serde_json::json!({
        "nodeSelector": selecting(&node.name),
        "monitors": [monitor("app", &app_log, "AppBroken", "example.com/app-broken-v2")],
    });
    if refused {
        edited["probes"] = serde_json::json!([{
            "name": "refused", "exec": {"command": ["/bin/true"]},
            "conditionType": "RefusedProbe", "periodSeconds": 1, "failureThreshold": 1,
        }]);
    }
    apply_policy(&admin, &policy, edited).await;
    let state_path = state.path.clone();
    let (agent, _unused) = start_agent_with(admin.clone(), &node.name, |c| {
        c.state_dir = state_path.clone();
        if refused {
            c.trust.commands.clear();
        }
    })
    .await;
    if refused {
        eventually(
            Duration::from_secs(10),
            "NodeGuardPolicyInvalid=True (PolicyRefused)",
            || async {
                support::condition(&admin, &node.name, "NodeGuardPolicyInvalid")
                    .await
                    .is_some_and(|(status, reason, _)| {
                        status == "True" && reason == "PolicyRefused"
                    })
            },
        )
        .await;
    }
    let t0 = Instant::now();
    eventually(
        Duration::from_secs(10),
        "the removed monitor's taint and the old taint gone, the new one there",
        || async {
            let n = Api::<Node>::all(admin.clone())
                .get(&node.name)
                .await
                .unwrap();
            !has_taint(&n, "example.com/disk-broken")
                && !has_taint(&n, "example.com/app-broken")
                && has_taint(&n, "example.com/app-broken-v2")
        },
    )
    .await;
    let converged = t0.elapsed();
    eventually(
        Duration::from_secs(10),
        "DiskBroken removed from the Node, AppBroken still True",
        || async {
            node_conditions(&admin, &node.name, "DiskBroken")
                .await
                .is_empty()
                && condition_is(&admin, &node.name, "AppBroken", "True").await
        },
    )
    .await;
    assert!(
        node_tainted(&admin, &node.name, "example.com/operators").await,
        "someone else's taint stays"
    );
    assert!(
        saved_state(&state.path, "disk").is_none(),
        "the removed monitor's state is gone"
    );
    assert_eq!(
        saved_state(&state.path, "app").unwrap()["conditions"]["AppBroken"]["taint"]["key"],
        "example.com/app-broken-v2"
    );
    eprintln!("converged {converged:?} after the restart");
    agent.stop().await;
}

/// A rule whose pattern matches every line, and a million distinct problem
/// lines (each its own message) appended at once. Each match used to write
/// the monitor's state file (an fsync per line): 100,000 lines were not
/// read in 5 minutes. Now the agent reads them all in seconds, keeps its
/// memory bounded, publishes Events within its per-reason rate limit and
/// counts every one it did not publish, keeps each Event note within
/// 1 KiB and the condition message within 512 bytes, and the line after
/// the flood still sets its condition.
#[tokio::test]
async fn a_million_distinct_matches_keep_memory_events_and_messages_bounded() {
    // A million by default; NODEGUARD_FLOOD_LINES changes it.
    let lines: u64 = std::env::var("NODEGUARD_FLOOD_LINES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "million").await;
    let logs = TempDir::new("million");
    let app_log = logs.path.join("app.log");
    std::fs::write(&app_log, "").unwrap();
    let policy = unique_name("million");
    apply_monitors(
        &admin,
        &policy,
        &node.name,
        serde_json::json!([{
            "name": "flood", "source": {"file": {"path": app_log.display().to_string()}},
            "conditions": [
                {"type": "FloodBroken", "reason": "FloodIsFine", "message": "Fine."},
                {"type": "FloodOver", "reason": "FloodGoesOn", "message": "Not over."},
            ],
            "rules": [
                {"type": "temporary", "reason": "AnyLine", "pattern": ".*", "message": "line: $0"},
                {"type": "permanent", "condition": "FloodBroken", "reason": "FloodFailed",
                 "pattern": "fail (.+)", "message": "failed: $1"},
                {"type": "permanent", "condition": "FloodOver", "reason": "FloodEnded",
                 "pattern": "fail LAST (.+)", "message": "ended: $1"},
            ],
        }]),
    )
    .await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;
    wait_condition(
        &admin,
        &node.name,
        "FloodBroken",
        "False",
        Duration::from_secs(15),
        "FloodBroken=False at start",
    )
    .await;
    let before = peak_rss_kib(true);
    let t0 = Instant::now();
    {
        let mut f = std::io::BufWriter::new(
            std::fs::OpenOptions::new()
                .append(true)
                .open(&app_log)
                .unwrap(),
        );
        for i in 0..lines {
            writeln!(f, "fail {i:07} distinct problem").unwrap();
        }
        // The last one is long: its message is clipped, its Event note too.
        writeln!(f, "fail LAST {}", "z".repeat(4000)).unwrap();
        f.flush().unwrap();
    }
    let last_message = || async {
        support::condition(&admin, &node.name, "FloodOver")
            .await
            .map(|(_, _, message)| message)
            .unwrap_or_default()
    };
    // Progress every 10 s: how far the monitor has read.
    let mut next_report = Instant::now() + Duration::from_secs(10);
    let deadline = Instant::now() + Duration::from_secs(300);
    while !last_message().await.starts_with("ended: zzz") {
        let read = metric_value(&agent, "nodeguard_monitor_lines_total{monitor=\"flood\"}").await;
        assert!(
            Instant::now() < deadline,
            "the line after {lines} distinct problems did not set the condition within 300 s ({read} lines read)"
        );
        if Instant::now() >= next_report {
            eprintln!(
                "flood: {read} of {} lines read after {:?}",
                lines + 1,
                t0.elapsed()
            );
            next_report += Duration::from_secs(10);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let took = t0.elapsed();
    let grew = peak_rss_kib(false).saturating_sub(before);
    // As NPD: a True condition keeps the message of the match that set it.
    assert_eq!(
        support::condition(&admin, &node.name, "FloodBroken").await,
        Some((
            "True".to_string(),
            "FloodFailed".to_string(),
            "failed: 0000000 distinct problem".to_string()
        ))
    );
    let message = last_message().await;
    assert!(
        message.len() <= 512,
        "condition message of {} bytes",
        message.len()
    );
    assert_eq!(
        metric_value(&agent, "nodeguard_monitor_lines_total{monitor=\"flood\"}").await,
        lines + 1,
        "every line read"
    );
    // Published beside counted-as-dropped: every match accounted for.
    let text = metrics(&agent).await;
    let published = sample(&text, "nodeguard_events_total{reason=\"AnyLine\"}").unwrap_or(0.0);
    let dropped: f64 = text
        .lines()
        .filter(|l| {
            l.starts_with("nodeguard_events_dropped_total{") && l.contains("reason=\"AnyLine\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(
        published + dropped,
        (lines + 1) as f64,
        "published {published} + dropped {dropped}"
    );
    // The default limit: a burst of 10 per reason, then one per 30 s.
    let allowed = 10.0 + (took.as_secs_f64() / 30.0).ceil() + 1.0;
    assert!(
        published <= allowed,
        "{published} AnyLine Events in {took:?}"
    );
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(admin.clone(), "default");
    let ours: Vec<_> = events
        .list(&kube::api::ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| {
            e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(node.name.as_str())
        })
        .collect();
    let any_line = ours
        .iter()
        .filter(|e| e.reason.as_deref() == Some("AnyLine"))
        .count();
    assert!(
        any_line as f64 <= allowed,
        "{any_line} AnyLine Events on the node"
    );
    for e in &ours {
        let note = e.note.as_deref().unwrap_or_default();
        assert!(note.len() <= 1024, "an Event note of {} bytes", note.len());
    }
    assert!(
        grew < 64 * 1024,
        "peak memory grew by {} MiB over a million distinct matches",
        grew / 1024
    );
    eprintln!(
        "{} lines in {took:?}; peak RSS grew {} KiB; {published} AnyLine Events published, {dropped} counted as dropped; {} FloodFailed/AnyLine Events on the node",
        lines + 1,
        grew,
        ours.len()
    );
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}
