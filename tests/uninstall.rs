//! `helm uninstall`, against the real API server and a logind on a private
//! D-Bus. The chart's pre-delete hook (`nodeguard retire`, the binary) asks
//! the agent's pod to retire; the agent (the binary, with `POD_NAMESPACE`
//! and `POD_NAME` as the chart sets them) releases logind's delay
//! inhibitor, removes the taint it added, its conditions and annotation,
//! its logind drop-in (logind reloaded) and its state files, says so on the
//! Node and on its pod, and idles; restarted, it starts nothing. An
//! ordinary stop before that removes nothing. A hook whose agent does not
//! answer fails, naming the node.

mod support;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use support::dbus::{LogindPeer, PrivateBus};
use support::pods::{ensure_priority_class, running_pod};
use support::*;

const DROP_IN: &str = "99-nodeguard-inhibit-delay.conf";
const TAINT: &str = "example.com/app-broken";
const CLASS: &str = "nodeguard-uninstall-test";

/// The agent binary as the chart runs it in its pod; killed when dropped.
struct Agent {
    child: std::process::Child,
    listen: SocketAddr,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Agent {
    fn spawn(node: &str, pod: &str, state: &Path, allow: &[&Path], bus: &str) -> Agent {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let listen: SocketAddr = ([127, 0, 0, 1], port).into();
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_nodeguard"));
        cmd.args(["run", "--node-name", node])
            .arg(format!("--listen={listen}"))
            .arg("--kubeconfig")
            .arg(kubeconfig_path())
            .arg("--state-dir")
            .arg(state)
            .arg(format!("--allow-read-path={}", allow[0].display()));
        for dir in &allow[1..] {
            cmd.arg(format!("--allow-logind-drop-in-dir={}", dir.display()));
        }
        cmd.env("POD_NAMESPACE", TEST_NAMESPACE)
            .env("POD_NAME", pod)
            .env("DBUS_SYSTEM_BUS_ADDRESS", bus)
            .env("RUST_LOG", "info")
            .env_remove("NOTIFY_SOCKET")
            .stdout(std::process::Stdio::null());
        Agent {
            child: cmd.spawn().unwrap(),
            listen,
        }
    }

    async fn answering(&self) {
        eventually(Duration::from_secs(30), "the agent answers", || async {
            tokio::net::TcpStream::connect(self.listen).await.is_ok()
        })
        .await;
    }

    /// SIGTERM, as the kubelet stops a container; waits for the exit.
    fn stop(mut self) {
        // SAFETY: a signal to the child this test started.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while std::time::Instant::now() < deadline {
            if self.child.try_wait().unwrap().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("the agent did not stop within 30 s of SIGTERM");
    }
}

/// `nodeguard retire`, as the hook's Job runs it: (exit code, output).
async fn retire(instance: &str, timeout_seconds: u64, strict: bool) -> (i32, String) {
    let selector =
        format!("app.kubernetes.io/name=nodeguard,app.kubernetes.io/instance={instance}");
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_nodeguard"))
        .args([
            "retire",
            "--namespace",
            TEST_NAMESPACE,
            "--selector",
            &selector,
        ])
        .arg(format!("--timeout-seconds={timeout_seconds}"))
        .args(strict.then_some("--strict"))
        .arg("--kubeconfig")
        .arg(kubeconfig_path())
        .output()
        .await
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

/// A monitor of `log` whose condition `AppBroken` sets [`TAINT`].
fn app_monitor(log: &Path) -> serde_json::Value {
    serde_json::json!({
        "name": "app", "source": {"file": {"path": log.display().to_string()}},
        "conditions": [{"type": "AppBroken", "reason": "AppIsFine", "message": "The app is fine.",
                        "taint": {"key": TAINT, "value": "true", "effect": "NoSchedule"}}],
        "rules": [{"type": "permanent", "condition": "AppBroken", "reason": "AppCrashed",
                   "pattern": "app crashed"}],
    })
}

fn agent_labels(instance: &str) -> serde_json::Value {
    serde_json::json!({"app.kubernetes.io/name": "nodeguard", "app.kubernetes.io/instance": instance})
}

async fn node_of(admin: &kube::Client, node: &str) -> Node {
    Api::<Node>::all(admin.clone()).get(node).await.unwrap()
}

fn state_files(dir: &Path) -> Vec<String> {
    let mut files = Vec::new();
    for d in [dir.to_path_buf(), dir.join("monitors")] {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            if e.path().is_file() {
                files.push(e.path().display().to_string());
            }
        }
    }
    files
}

/// Everything on the Node that says nodeguard: its conditions (by
/// managedFields), its taints, its annotation.
fn nodeguard_on(node: &Node) -> (Vec<String>, bool, bool) {
    let owned: Vec<String> = nodeguard::report::kube::owned_condition_types(node)
        .into_iter()
        .collect();
    let annotated = node
        .metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key("nodeguard.io/effective-policies"));
    (owned, has_taint(node, TAINT), annotated)
}

#[tokio::test]
async fn retiring_removes_what_nodeguard_put_on_the_node_and_an_ordinary_stop_does_not() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "retire").await;
    let bus = PrivateBus::start();
    let drop_in = TempDir::new("retire-logind.conf.d");
    // A drop-in of nodeguard's name in another directory the node allows,
    // written by someone else: it stays.
    let foreign = TempDir::new("retire-foreign.conf.d");
    std::fs::write(
        foreign.path.join(DROP_IN),
        "[Login]\nInhibitDelayMaxSec=90\n",
    )
    .unwrap();
    let peer = LogindPeer::start(&bus.address, Duration::from_secs(5), Some(&drop_in.path)).await;
    let logs = TempDir::new("retire-logs");
    let app_log = logs.path.join("app.log");
    std::fs::write(&app_log, "").unwrap();
    let policy = unique_name("retire");
    apply_policy(
        &admin,
        &policy,
        serde_json::json!({
            "nodeSelector": selecting(&node.name),
            "shutdown": {"gracePeriodByPriority": [{"priority": 0, "gracePeriodSeconds": 20}],
                         "logindDropInDir": drop_in.path.display().to_string(), "safetyMarginSeconds": 2},
            "monitors": [app_monitor(&app_log)],
        }),
    )
    .await;
    ensure_priority_class(&admin, CLASS, 1000).await;
    let instance = unique_name("release");
    let pod = unique_name("agent");
    running_pod(&admin, &node.name, &pod, CLASS, agent_labels(&instance)).await;
    let state = TempDir::new("retire-state");
    let allow = [
        logs.path.as_path(),
        drop_in.path.as_path(),
        foreign.path.as_path(),
    ];

    // Armed, with logind's delay raised by the drop-in, and the monitor's
    // condition True with its taint.
    let agent = Agent::spawn(&node.name, &pod, &state.path, &allow, &bus.address);
    agent.answering().await;
    eventually(Duration::from_secs(20), "the delay inhibitor held", || {
        std::future::ready(peer.held() == 1)
    })
    .await;
    assert!(
        drop_in.path.join(DROP_IN).exists(),
        "the agent wrote its drop-in"
    );
    std::fs::write(&app_log, "app crashed: disk full\n").unwrap();
    eventually(
        Duration::from_secs(20),
        "AppBroken=True with its taint",
        || async {
            condition_is(&admin, &node.name, "AppBroken", "True").await
                && has_taint(&node_of(&admin, &node.name).await, TAINT)
        },
    )
    .await;
    let owned_before = nodeguard_on(&node_of(&admin, &node.name).await).0;
    assert!(
        owned_before.contains(&"AppBroken".to_string())
            && owned_before.contains(&"GracefulShutdownUnavailable".to_string()),
        "{owned_before:?}"
    );

    // An ordinary stop (a rollout, a restart): everything stays for the
    // next agent.
    agent.stop();
    let (owned, tainted, annotated) = nodeguard_on(&node_of(&admin, &node.name).await);
    assert_eq!(owned, owned_before, "a stop keeps nodeguard's conditions");
    assert!(
        tainted && annotated,
        "a stop keeps the taint and the annotation"
    );
    assert!(
        drop_in.path.join(DROP_IN).exists(),
        "a stop keeps the drop-in"
    );
    assert!(
        !state_files(&state.path).is_empty(),
        "a stop keeps the state"
    );

    // Again, then `helm uninstall`'s hook.
    let agent = Agent::spawn(&node.name, &pod, &state.path, &allow, &bus.address);
    agent.answering().await;
    eventually(
        Duration::from_secs(20),
        "the delay inhibitor held again",
        || std::future::ready(peer.held() == 1),
    )
    .await;
    let reloads_before = peer.state.lock().unwrap().reloads;
    let (code, out) = retire(&instance, 60, true).await;
    assert_eq!(code, 0, "the hook succeeds:\n{out}");
    // A handover unit a rollout may have left is stopped (none runs here:
    // systemd says NoSuchUnit, which is no failure).
    assert!(
        peer.state
            .lock()
            .unwrap()
            .stop_units
            .iter()
            .any(|u| u == nodeguard::shutdown::logind::HANDOVER_UNIT),
        "the retiring agent did not stop the handover unit"
    );
    assert!(out.contains("1 of 1 running agent(s) retired"), "{out}");

    let after = node_of(&admin, &node.name).await;
    let (owned, tainted, annotated) = nodeguard_on(&after);
    assert!(owned.is_empty(), "nodeguard's conditions stay: {owned:?}");
    assert!(!tainted, "the taint nodeguard added stays");
    assert!(!annotated, "the effective-policies annotation stays");
    for t in [
        "AppBroken",
        "GracefulShutdownUnavailable",
        "NodeGuardPolicyInvalid",
    ] {
        assert!(
            node_conditions(&admin, &node.name, t).await.is_empty(),
            "{t} is still on the Node"
        );
    }
    assert_eq!(peer.held(), 0, "the delay inhibitor is released");
    assert!(
        !drop_in.path.join(DROP_IN).exists(),
        "nodeguard's drop-in stays"
    );
    assert!(
        foreign.path.join(DROP_IN).exists(),
        "someone else's drop-in went"
    );
    assert!(
        peer.state.lock().unwrap().reloads > reloads_before,
        "logind was not reloaded after the drop-in went"
    );
    assert_eq!(state_files(&state.path), Vec::<String>::new());
    let event = node_event(&admin, &node.name, "NodeguardRetired")
        .await
        .expect("a NodeguardRetired Event on the Node");
    let note = event.note.unwrap_or_default();
    assert!(
        note.contains(&format!("removed 1 taint(s) ({TAINT}:NoSchedule)"))
            && note.contains("(logind reloaded)"),
        "{note}"
    );
    assert_eq!(event.type_.as_deref(), Some("Normal"), "{note}");
    let agent_pod = Api::<Pod>::namespaced(admin.clone(), TEST_NAMESPACE)
        .get(&pod)
        .await
        .unwrap();
    let retired = agent_pod
        .status
        .and_then(|s| s.conditions)
        .into_iter()
        .flatten()
        .find(|c| c.type_ == "nodeguard.io/retired")
        .expect("the retired condition on the agent's pod");
    assert_eq!(
        (retired.status.as_str(), retired.reason.as_deref()),
        ("True", Some("Retired"))
    );
    // Alive (the kubelet does not restart it), not ready.
    assert_eq!(http_get(agent.listen, "/livez").await.0, 200);
    assert_eq!(http_get(agent.listen, "/readyz").await.0, 503);

    // Its container restarted: nothing of the agent starts again.
    agent.stop();
    let agent = Agent::spawn(&node.name, &pod, &state.path, &allow, &bus.address);
    agent.answering().await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        peer.held(),
        0,
        "a retired pod's agent took the inhibitor again"
    );
    let (owned, tainted, _) = nodeguard_on(&node_of(&admin, &node.name).await);
    assert!(
        owned.is_empty() && !tainted,
        "a retired pod's agent wrote again: {owned:?}"
    );
    assert_eq!(http_get(agent.listen, "/readyz").await.0, 503);
    drop(agent);
    delete_policy(&admin, &policy).await;
}

/// The Warning Event the hook left on `node`, as `type: note`.
async fn not_retired_event(admin: &kube::Client, node: &str) -> Option<String> {
    node_event(admin, node, "NodeguardNotRetired")
        .await
        .map(|e| {
            format!(
                "{}: {}",
                e.type_.unwrap_or_default(),
                e.note.unwrap_or_default()
            )
        })
}

#[tokio::test]
async fn a_node_whose_agent_does_not_answer_is_named_on_the_node_and_the_uninstall_goes_on() {
    let admin = admin_client().await;
    let silent = TestNode::selectable(&admin, "retire-silent").await;
    ensure_priority_class(&admin, CLASS, 1000).await;
    let instance = unique_name("release");
    // Running on its node, but no agent answers (its node is down).
    running_pod(
        &admin,
        &silent.name,
        &unique_name("agent"),
        CLASS,
        agent_labels(&instance),
    )
    .await;
    // Never ran (Pending on a node without a kubelet): skipped.
    let pending: Pod = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": unique_name("agent-pending"), "labels": agent_labels(&instance)},
        "spec": {"nodeName": silent.name, "containers": [{"name": "c", "image": "example.invalid/x"}]},
    }))
    .unwrap();
    Api::<Pod>::namespaced(admin.clone(), TEST_NAMESPACE)
        .create(&Default::default(), &pending)
        .await
        .unwrap();
    // A pod the DaemonSet makes while the hook waits is asked too.
    let late_node = TestNode::selectable(&admin, "retire-late").await;
    let late = unique_name("agent-late");
    let hook = tokio::spawn({
        let instance = instance.clone();
        async move { retire(&instance, 6, false).await }
    });
    tokio::time::sleep(Duration::from_millis(2500)).await;
    running_pod(
        &admin,
        &late_node.name,
        &late,
        CLASS,
        agent_labels(&instance),
    )
    .await;
    let t = std::time::Instant::now();
    let (code, out) = hook.await.unwrap();
    assert_eq!(code, 0, "the uninstall goes on:\n{out}");
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
    assert!(
        out.contains("0 of 2 running agent(s) retired")
            && out.contains(&format!("{}: nodeguard was uninstalled, but its agent on this node did not answer within 6s", silent.name))
            && out.contains("not running (phase Pending)")
            && out.contains("2 node(s) keep something of nodeguard's"),
        "{out}"
    );
    let late_pod = Api::<Pod>::namespaced(admin.clone(), TEST_NAMESPACE)
        .get(&late)
        .await
        .unwrap();
    assert!(
        late_pod
            .metadata
            .annotations
            .is_some_and(|a| a.contains_key("nodeguard.io/retire")),
        "a pod created while the hook waited was not asked"
    );
    let event = not_retired_event(&admin, &silent.name)
        .await
        .unwrap_or_else(|| {
            panic!("a NodeguardNotRetired Event on the node whose agent did not answer:\n{out}")
        });
    assert!(
        event.starts_with("Warning: nodeguard was uninstalled, but its agent"),
        "{event}"
    );

    // Strict: the hook fails the uninstall.
    let (code, out) = retire(&instance, 3, true).await;
    assert_eq!(code, 1, "strict fails:\n{out}");
    assert!(out.contains("helm uninstall --no-hooks"), "{out}");
}

/// A taint a policy declares that no saved state says nodeguard added (its
/// state directory was not kept across pods) may be someone else's: it
/// stays, and the agent's report names it, so the hook names the node.
#[tokio::test]
async fn a_policy_taint_no_state_records_is_named_not_removed() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "retire-stateless").await;
    let logs = TempDir::new("retire-stateless-logs");
    let app_log = logs.path.join("app.log");
    std::fs::write(&app_log, "").unwrap();
    // An earlier pod added it; its state went with its emptyDir.
    Api::<Node>::all(admin.clone())
        .patch(
            &node.name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({"spec": {"taints": [
                {"key": TAINT, "value": "true", "effect": "NoSchedule"}]}})),
        )
        .await
        .unwrap();
    let policy = unique_name("retire-stateless");
    apply_policy(
        &admin,
        &policy,
        serde_json::json!({
            "nodeSelector": selecting(&node.name),
            "monitors": [app_monitor(&app_log)],
        }),
    )
    .await;
    ensure_priority_class(&admin, CLASS, 1000).await;
    let instance = unique_name("release");
    let pod = unique_name("agent");
    running_pod(&admin, &node.name, &pod, CLASS, agent_labels(&instance)).await;
    let state = TempDir::new("retire-stateless-state");
    let agent = Agent::spawn(
        &node.name,
        &pod,
        &state.path,
        &[logs.path.as_path()],
        "unix:path=/nonexistent/bus",
    );
    agent.answering().await;
    eventually(Duration::from_secs(20), "AppBroken=False", || async {
        condition_is(&admin, &node.name, "AppBroken", "False").await
    })
    .await;
    let (code, out) = retire(&instance, 60, false).await;
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains(&format!(
            "the taint {TAINT}:NoSchedule that a policy's monitor sets is still on the node"
        )),
        "{out}"
    );
    assert!(
        has_taint(&node_of(&admin, &node.name).await, TAINT),
        "it may be someone else's: it stays"
    );
    let event = not_retired_event(&admin, &node.name)
        .await
        .unwrap_or_else(|| panic!("a NodeguardNotRetired Event naming the taint:\n{out}"));
    assert!(event.contains(TAINT), "{event}");
    let agent_pod = Api::<Pod>::namespaced(admin.clone(), TEST_NAMESPACE)
        .get(&pod)
        .await
        .unwrap();
    let reason = agent_pod
        .status
        .and_then(|s| s.conditions)
        .into_iter()
        .flatten()
        .find(|c| c.type_ == "nodeguard.io/retired")
        .and_then(|c| c.reason);
    assert_eq!(reason.as_deref(), Some("RetiredWithProblems"));
    drop(agent);
    delete_policy(&admin, &policy).await;
}
