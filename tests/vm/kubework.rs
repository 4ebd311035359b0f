//! The real node's scenarios after `helm install`: each drives the node the
//! way an operator or a failure would (systemctl, real workload pods, a
//! reboot, a frozen agent) and checks what the agent in the DaemonSet pod
//! wrote, and what the kubelet did with it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use kube::{Api, Client};

use crate::kubenode::{node_ready, pod_ready};
use crate::qemu::Vm;
use crate::support::pods::ensure_priority_class;
use crate::support::*;
use crate::{PolicyName, Rows, secs};

/// The kubelet node's shutdown groups: priority 0, 1000, critical pods.
///
/// Wider than the host-service scenarios' 10, 10, 8 s: on this TCG node the
/// kubelet and containerd take 8 to 10 s beyond the pod's own 3 s to stop
/// one and report it (shim exit, the pause container, the CNI teardown;
/// measured in kube-gns's `journal-shutdown-boot-1.txt`), so 10 s windows
/// tested the node's speed, not the groups. The first is the longest:
/// kube-reboot SIGKILLs the agent as the shutdown begins, and the kubelet's
/// restart of its container took 20 s here, which must leave the resumed
/// agent some of the first window. The kubelet's own graceful shutdown in
/// kube-gns gets the same windows.
pub const GROUP_SECS: [u64; 3] = [30, 20, 16];
const MARGIN_SECS: u64 = 2;
/// What logind must allow: the groups and the margin (the chart's logind
/// drop-in mount lets the agent raise it).
pub const KUBE_NEEDED_DELAY_SECS: u64 = GROUP_SECS[0] + GROUP_SECS[1] + GROUP_SECS[2] + MARGIN_SECS;
/// The kubelet's `shutdownGracePeriodByPodPriority` in kube-gns: the same
/// windows, the last one taking nodeguard's margin too (the same total).
pub const KUBELET_GROUP_SECS: [u64; 3] =
    [GROUP_SECS[0], GROUP_SECS[1], GROUP_SECS[2] + MARGIN_SECS];

pub fn shutdown_spec() -> serde_json::Value {
    serde_json::json!({
        "gracePeriodByPriority": [
            {"priority": 0, "gracePeriodSeconds": GROUP_SECS[0]},
            {"priority": 1000, "gracePeriodSeconds": GROUP_SECS[1]},
            {"priority": 2000000000, "gracePeriodSeconds": GROUP_SECS[2]},
        ],
        "safetyMarginSeconds": MARGIN_SECS,
        "escalateAfterPercent": 50,
        "escalation": "Delete",
        "logindDropInDir": "/etc/systemd/logind.conf.d",
    })
}
const INHIBIT_DELAY: Duration = Duration::from_secs(KUBE_NEEDED_DELAY_SECS);

/// softdog through the chart's `host.watchdog` mount.
pub fn watchdog_spec() -> serde_json::Value {
    serde_json::json!({
        "mode": "Device", "device": "/dev/watchdog",
        "timeoutSeconds": WATCHDOG_TIMEOUT.as_secs(), "petIntervalPercent": 33,
    })
}
/// Long enough that a slow TCG guest under a parallel build never misses a
/// pet by accident; the freeze step waits for it.
const WATCHDOG_TIMEOUT: Duration = Duration::from_secs(30);

const BUSYBOX: &str = "localhost/e2e/busybox:1.35";
/// A container that takes 3 s to exit on SIGTERM and says so in its log.
const SLOW_TO_STOP: &str =
    "trap 'echo SIGTERM; sleep 3; echo bye; exit 0' TERM; echo up; while true; do sleep 1; done";

/// A namespace for the workload pods, deleted with the scenario.
pub struct Namespace(pub String);

impl Namespace {
    pub async fn create(admin: &Client, prefix: &str) -> Namespace {
        let name = unique_name(prefix);
        kubectl(&["create", "namespace", &name]);
        let ns = Namespace(name);
        // Pods are admitted once the controller manager made its account.
        let sas: Api<k8s_openapi::api::core::v1::ServiceAccount> =
            Api::namespaced(admin.clone(), &ns.0);
        eventually(
            Duration::from_secs(30),
            "the namespace's default service account",
            || async { sas.get_opt("default").await.ok().flatten().is_some() },
        )
        .await;
        ns
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        let _ = kubectl_status(&[
            "delete",
            "namespace",
            "--ignore-not-found",
            "--wait=false",
            &self.0,
        ]);
    }
}

fn has_condition(
    conditions: Option<&Vec<k8s_openapi::api::core::v1::PodCondition>>,
    type_: &str,
    status: &str,
) -> bool {
    conditions.is_some_and(|cs| cs.iter().any(|c| c.type_ == type_ && c.status == status))
}

async fn wait_pod(
    pods: &Api<Pod>,
    name: &str,
    timeout: Duration,
    what: &str,
    check: impl Fn(&Pod) -> bool,
) {
    eventually(timeout, what, || async {
        pods.get_opt(name)
            .await
            .ok()
            .flatten()
            .is_some_and(|p| check(&p))
    })
    .await;
}

/// The agent's pod (the release's only one).
async fn agent_pod(admin: &Client, agent_ns: &str) -> Pod {
    let pods: Api<Pod> = Api::namespaced(admin.clone(), agent_ns);
    let mut list = pods.list(&ListParams::default()).await.unwrap().items;
    assert_eq!(list.len(), 1, "one DaemonSet pod");
    list.remove(0)
}

/// Waits until the Node is Ready and the kubelet probe passes again.
async fn kubelet_back(admin: &Client, node: &str) {
    let nodes: Api<Node> = Api::all(admin.clone());
    eventually(Duration::from_secs(120), "the Node Ready again", || async {
        nodes.get(node).await.is_ok_and(|n| node_ready(&n))
    })
    .await;
    wait_condition(
        admin,
        node,
        "KubeletUnhealthy",
        "False",
        Duration::from_secs(60),
        "KubeletUnhealthy=False once the kubelet is back",
    )
    .await;
}

/// The default policy's kubelet probe (127.0.0.1:10248, period 10 s,
/// failureThreshold 3) from the pod: the kubelet stopped, then started.
pub async fn kubelet_probe(vm: &mut Vm, admin: &Client, node: &str, rows: &Rows) {
    assert!(condition_is(admin, node, "KubeletUnhealthy", "False").await);
    let t0 = Instant::now();
    vm.sh("systemctl stop kubelet").await;
    wait_condition(
        admin,
        node,
        "KubeletUnhealthy",
        "True",
        Duration::from_secs(60),
        "KubeletUnhealthy=True with the kubelet stopped",
    )
    .await;
    let down = t0.elapsed();
    // Three failures 10 s apart: never before the third.
    assert!(
        down >= Duration::from_secs(19),
        "True after {down:?}: before failureThreshold 3 × periodSeconds 10"
    );
    let c = node_conditions(admin, node, "KubeletUnhealthy")
        .await
        .remove(0);
    let t1 = Instant::now();
    vm.sh("systemctl start kubelet").await;
    wait_condition(
        admin,
        node,
        "KubeletUnhealthy",
        "False",
        Duration::from_secs(60),
        "KubeletUnhealthy=False with the kubelet started again",
    )
    .await;
    let up = t1.elapsed();
    kubelet_back(admin, node).await;
    rows.pass(
        "kube-probe",
        format!(
            "`systemctl stop kubelet` → KubeletUnhealthy=True ({}) {} later (failureThreshold 3, period 10 s); `systemctl start kubelet` → False {} later",
            c.reason.unwrap_or_default(),
            secs(down),
            secs(up)
        ),
    );
}

/// The default policy's systemd-restarts monitor (journald, identifier
/// systemd, 5 starts in 20 minutes, a clean stop taking one off as NPD's
/// log-counter `--revert-pattern` does) read from the pod through the
/// chart's journal mount and the image's journalctl: an operator's clean
/// restarts are not counted, crashes (systemd restarting a killed unit,
/// with no "Stopping" line) are.
pub async fn journald_restarts(vm: &mut Vm, admin: &Client, node: &str, rows: &Rows) {
    // The kubelet started at boot and was stopped and started in
    // kube-probe: one start counted.
    wait_condition(
        admin,
        node,
        "FrequentKubeletRestart",
        "False",
        Duration::from_secs(30),
        "FrequentKubeletRestart=False before the restarts",
    )
    .await;
    // Apart enough for systemd's start limit (5 in 10 s).
    for _ in 0..5 {
        vm.sh("systemctl restart kubelet").await;
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert!(
        condition_is(admin, node, "FrequentKubeletRestart", "False").await,
        "5 clean `systemctl restart kubelet` were counted as crashes"
    );
    kubelet_back(admin, node).await;
    /// Kills the unit's main process and waits until systemd has started
    /// it again (`Restart=always`).
    async fn crash(vm: &mut Vm, unit: &str) {
        vm.sh(&format!(
            "systemctl kill --kill-who=main --signal=SIGKILL {unit}"
        ))
        .await;
        let back = vm
            .sh(&format!(
                "for i in $(seq 60); do sleep 0.5; systemctl is-active --quiet {unit} && echo up && break; done"
            ))
            .await;
        assert!(
            back.contains("up"),
            "{unit} did not come back after SIGKILL"
        );
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    let t0 = Instant::now();
    let mut crashes = 0;
    while !condition_is(admin, node, "FrequentKubeletRestart", "True").await {
        assert!(
            crashes < 5,
            "FrequentKubeletRestart is not True 20 s after the 5th crash of the kubelet"
        );
        crash(vm, "kubelet").await;
        crashes += 1;
        if crashes == 5 {
            eventually(
                Duration::from_secs(20),
                "FrequentKubeletRestart=True after 5 crashes",
                || condition_is(admin, node, "FrequentKubeletRestart", "True"),
            )
            .await;
        }
    }
    let took = t0.elapsed();
    let c = node_conditions(admin, node, "FrequentKubeletRestart")
        .await
        .remove(0);
    assert_eq!(c.reason.as_deref(), Some("FrequentKubeletRestart"));
    let journal = |what: &str| {
        format!(
            "journalctl -b --no-pager -o cat SYSLOG_IDENTIFIER=systemd | grep -c '{what}' || true"
        )
    };
    let starts = vm.sh(&journal("Started kubelet.service")).await;
    let stops = vm.sh(&journal("Stopping kubelet.service")).await;
    kubelet_back(admin, node).await;
    // containerd: systemd 252 writes "Starting containerd.service -
    // containerd container runtime...", which NPD's older patterns never
    // matched.
    assert!(condition_is(admin, node, "FrequentContainerdRestart", "False").await);
    let t1 = Instant::now();
    for _ in 0..5 {
        crash(vm, "containerd").await;
    }
    wait_condition(
        admin,
        node,
        "FrequentContainerdRestart",
        "True",
        Duration::from_secs(20),
        "FrequentContainerdRestart=True after 5 crashes of containerd",
    )
    .await;
    let containerd = t1.elapsed();
    let line = vm
        .sh("journalctl -b --no-pager -o cat SYSLOG_IDENTIFIER=systemd | grep -m1 'Starting containerd' || true")
        .await;
    kubelet_back(admin, node).await;
    rows.pass(
        "kube-journald",
        format!(
            "5 × `systemctl restart kubelet` → FrequentKubeletRestart still False; {crashes} × SIGKILL (systemd restarts it) → True {} after the first crash ({} kubelet starts and {} clean stops in this boot's journal; threshold 5 in 1200 s); 5 × SIGKILL of containerd (\"{}\") → FrequentContainerdRestart=True {}",
            secs(took),
            starts.trim(),
            stops.trim(),
            line.trim(),
            secs(containerd)
        ),
    );
}

/// The agent's own credentials (the pod's projected token, read on the
/// node) may change its Node and its pods, never another Node's.
pub async fn node_restriction(
    vm: &mut Vm,
    admin: &Client,
    node: &str,
    agent_ns: &str,
    work_ns: &str,
    rows: &Rows,
) {
    let pod = agent_pod(admin, agent_ns).await;
    let uid = pod.metadata.uid.unwrap();
    let token = vm
        .sh(&format!(
            "cat /var/lib/kubelet/pods/{uid}/volumes/kubernetes.io~projected/*/token"
        ))
        .await;
    let mut config = admin_config().await;
    config.auth_info = kube::config::AuthInfo {
        token: Some(token.trim().to_string().into()),
        ..Default::default()
    };
    let agent = Client::try_from(config).unwrap();

    // Node B: another Node object, with a pod bound to it.
    let other = crate::kubenode::KubeNode(unique_name("vm-other"));
    let nodes_admin: Api<Node> = Api::all(admin.clone());
    let n: Node = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": other.0},
    }))
    .unwrap();
    nodes_admin
        .create(&PostParams::default(), &n)
        .await
        .unwrap();
    let pods_admin: Api<Pod> = Api::namespaced(admin.clone(), work_ns);
    let p: Pod = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "on-node-b"},
        "spec": {"nodeName": other.0, "automountServiceAccountToken": false,
                 "containers": [{"name": "c", "image": BUSYBOX}]},
    }))
    .unwrap();
    pods_admin.create(&PostParams::default(), &p).await.unwrap();

    let nodes: Api<Node> = Api::all(agent.clone());
    let mark = |v: &str| {
        Patch::Merge(
            serde_json::json!({"metadata": {"annotations": {"e2e.nodeguard.io/restriction": v}}}),
        )
    };
    nodes
        .patch(node, &PatchParams::default(), &mark("own"))
        .await
        .expect("the agent's pod token may patch its own Node");
    let denied = |r: Result<Node, kube::Error>, what: &str| match r {
        Err(kube::Error::Api(e)) => {
            assert_eq!(e.code, 403, "{what}: {e:?}");
            assert!(
                e.message
                    .contains(&format!("nodeguard on node {node} may not change")),
                "{what}: {}",
                e.message
            );
            e.message
        }
        other => panic!("{what}: not denied: {other:?}"),
    };
    let msg = denied(
        nodes
            .patch(&other.0, &PatchParams::default(), &mark("forged"))
            .await,
        "patch node B",
    );
    let forged = serde_json::json!({"status": {"conditions": [{
        "type": "KernelDeadlock", "status": "True", "reason": "Forged", "message": "written from node A",
        "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}});
    denied(
        nodes
            .patch_status(&other.0, &PatchParams::default(), &Patch::Merge(&forged))
            .await,
        "a condition on node B",
    );
    let pods: Api<Pod> = Api::namespaced(agent.clone(), work_ns);
    // RBAC lets the agent delete pods (shutdown escalation): the
    // admission policy is what keeps it to its node's.
    match pods.delete("on-node-b", &DeleteParams::default()).await {
        Err(kube::Error::Api(e)) => {
            assert_eq!(e.code, 403, "delete node B's pod: {e:?}");
            assert!(
                e.message.contains("may not change pods of node"),
                "{}",
                e.message
            );
        }
        other => panic!("the agent deleted a pod of node B: {other:?}"),
    }
    let back = nodes_admin.get(&other.0).await.unwrap();
    assert!(
        !back
            .metadata
            .annotations
            .unwrap_or_default()
            .contains_key("e2e.nodeguard.io/restriction")
    );
    nodes_admin
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"annotations": {"e2e.nodeguard.io/restriction": null}}})),
        )
        .await
        .unwrap();
    let _ = pods_admin
        .delete("on-node-b", &DeleteParams::default().grace_period(0))
        .await;
    rows.pass(
        "kube-node-restriction",
        format!(
            "with the pod's bound token: own Node patched; node B's metadata, status and pod refused (403: \"{}\")",
            msg.replace('|', "/")
        ),
    );
}

/// A pod probe of a second policy on a real workload pod with a readiness
/// gate: the kubelet's Ready follows the probe both ways.
pub async fn readiness_gate(vm: &mut Vm, admin: &Client, node: &str, work_ns: &str, rows: &Rows) {
    const GATE: &str = "nodeguard.io/web-healthy";
    let policy = PolicyName(unique_name("vm-gate"));
    apply_policy(
        admin,
        &policy,
        serde_json::json!({
            "nodeSelector": {"matchLabels": {"kubernetes.io/hostname": node}},
            "probes": [{
                "name": "web", "pods": {"selector": {"matchLabels": {"app": "web"}}, "namespaces": [work_ns]},
                "http": {"port": 8080, "path": "/healthz"},
                "periodSeconds": 2, "failureThreshold": 2, "successThreshold": 1, "timeoutSeconds": 1,
                "readinessGate": GATE,
            }],
        }),
    )
    .await;
    vm.sh("mkdir -p /var/lib/e2e-www && echo ok > /var/lib/e2e-www/healthz")
        .await;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), work_ns);
    let p: Pod = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web", "labels": {"app": "web"}},
        "spec": {
            "nodeName": node, "automountServiceAccountToken": false, "terminationGracePeriodSeconds": 1,
            "readinessGates": [{"conditionType": GATE}],
            "containers": [{"name": "httpd", "image": BUSYBOX, "imagePullPolicy": "Never",
                "command": ["httpd", "-f", "-p", "8080", "-h", "/www"],
                "volumeMounts": [{"name": "www", "mountPath": "/www"}]}],
            "volumes": [{"name": "www", "hostPath": {"path": "/var/lib/e2e-www", "type": "Directory"}}],
        },
    }))
    .unwrap();
    let t0 = Instant::now();
    pods.create(&PostParams::default(), &p).await.unwrap();
    let gate = |p: &Pod, status: &str| {
        has_condition(
            p.status.as_ref().and_then(|s| s.conditions.as_ref()),
            GATE,
            status,
        )
    };
    wait_pod(
        &pods,
        "web",
        Duration::from_secs(120),
        "the web pod Ready (containers and gate)",
        |p| pod_ready(p) && gate(p, "True"),
    )
    .await;
    let ready = t0.elapsed();
    // The container stays ready: only the gate can make the pod unready.
    let t1 = Instant::now();
    vm.sh("rm /var/lib/e2e-www/healthz").await;
    wait_pod(
        &pods,
        "web",
        Duration::from_secs(30),
        "the web pod not Ready after its health page went",
        |p| !pod_ready(p) && gate(p, "False"),
    )
    .await;
    let unready = t1.elapsed();
    let p = pods.get("web").await.unwrap();
    assert!(
        has_condition(
            p.status.as_ref().and_then(|s| s.conditions.as_ref()),
            "ContainersReady",
            "True"
        ),
        "the kubelet's ContainersReady stays True: the gate alone made the pod unready"
    );
    let t2 = Instant::now();
    vm.sh("echo ok > /var/lib/e2e-www/healthz").await;
    wait_pod(
        &pods,
        "web",
        Duration::from_secs(30),
        "the web pod Ready again",
        |p| pod_ready(p) && gate(p, "True"),
    )
    .await;
    let again = t2.elapsed();
    pods.delete("web", &DeleteParams::default()).await.unwrap();
    eventually(Duration::from_secs(60), "the web pod gone", || async {
        pods.get_opt("web").await.ok().flatten().is_none()
    })
    .await;
    drop(policy);
    rows.pass(
        "kube-readiness-gate",
        format!(
            "web pod (httpd) Ready with the gate {} after create; health page removed → gate False, Ready False (ContainersReady True) {}; back → Ready {} (period 2 s, failureThreshold 2)",
            secs(ready),
            secs(unready),
            secs(again)
        ),
    );
}

/// What the test saw of one workload pod during a shutdown.
#[derive(Clone, Debug, Default)]
pub struct Seen {
    /// deletionTimestamp first seen (an eviction or a delete).
    marked: Option<Instant>,
    /// The pod object gone: the kubelet confirmed its termination.
    gone: Option<Instant>,
    /// Its container first reported terminated, or the pod Failed.
    stopped: Option<Instant>,
    /// Its container's exit code, when the kubelet reported it.
    exit: Option<i32>,
    /// Every deletionGracePeriodSeconds seen: a second eviction or delete
    /// with a shorter grace shows as a second value.
    graces: Vec<i64>,
}

/// One shutdown of the real node with the three workload pods.
pub struct Observed {
    t0: Instant,
    /// low, mid, critical.
    pods: [Seen; 3],
    /// Node signals, first seen: (when, what).
    signals: Vec<(Duration, String)>,
    down: Duration,
    reason: String,
    /// When the agent's pod was deleted (kube-reboot deletes it once the
    /// first group is done, as a rollout or a drain tool would).
    agent_deleted: Option<Duration>,
}

impl Observed {
    /// Whether pod `i`'s (low, mid, critical) exit code reached the API.
    pub fn exit_reported(&self, i: usize) -> bool {
        self.pods[i].exit.is_some()
    }
}

impl Observed {
    fn at(&self, t: Option<Instant>) -> Option<Duration> {
        t.map(|t| t - self.t0)
    }
    /// When the pod stopped, as far as the API showed it.
    fn stopped(&self, i: usize) -> Option<Duration> {
        let p = &self.pods[i];
        [p.stopped, p.gone]
            .into_iter()
            .flatten()
            .min()
            .map(|t| t - self.t0)
    }
}

/// What a watch task has seen so far, shared with the test.
type Shared<T> = Arc<Mutex<T>>;

/// Watches the pods of `ns`, by name.
fn track(
    admin: &Client,
    ns: &str,
) -> (Shared<BTreeMap<String, Seen>>, tokio::task::JoinHandle<()>) {
    let seen: Arc<Mutex<BTreeMap<String, Seen>>> = Arc::default();
    let s = seen.clone();
    let pods: Api<Pod> = Api::namespaced(admin.clone(), ns);
    let task = tokio::spawn(async move {
        let mut stream = watcher(pods, watcher::Config::default()).boxed();
        while let Some(ev) = stream.next().await {
            let (p, deleted) = match ev {
                Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) => (p, false),
                Ok(watcher::Event::Delete(p)) => (p, true),
                _ => continue,
            };
            let now = Instant::now();
            let mut s = s.lock().unwrap();
            let e = s.entry(p.metadata.name.clone().unwrap()).or_default();
            if p.metadata.deletion_timestamp.is_some() {
                e.marked.get_or_insert(now);
            }
            if let Some(g) = p.metadata.deletion_grace_period_seconds
                && !e.graces.contains(&g)
            {
                e.graces.push(g);
            }
            if deleted {
                e.gone.get_or_insert(now);
            }
            let status = p.status.as_ref();
            let exit = status
                .and_then(|s| s.container_statuses.as_ref())
                .and_then(|cs| cs.first())
                .and_then(|c| c.state.as_ref())
                .and_then(|st| st.terminated.as_ref())
                .map(|t| t.exit_code);
            if let Some(x) = exit {
                e.exit.get_or_insert(x);
                e.stopped.get_or_insert(now);
            }
            if status.and_then(|s| s.phase.as_deref()) == Some("Failed") {
                e.stopped.get_or_insert(now);
            }
        }
    });
    (seen, task)
}

/// Watches the Node for what tells an operator it is going down.
fn watch_node(
    admin: &Client,
    node: &str,
    t0: Instant,
) -> (Shared<Vec<(Duration, String)>>, tokio::task::JoinHandle<()>) {
    let signals: Arc<Mutex<Vec<(Duration, String)>>> = Arc::default();
    let out = signals.clone();
    let nodes: Api<Node> = Api::all(admin.clone());
    let name = node.to_string();
    let task = tokio::spawn(async move {
        let cfg = watcher::Config::default().fields(&format!("metadata.name={name}"));
        let mut stream =
            kube::runtime::WatchStreamExt::applied_objects(watcher(nodes, cfg)).boxed();
        while let Some(Ok(n)) = stream.next().await {
            let mut now: Vec<String> = Vec::new();
            for c in n
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .into_iter()
                .flatten()
            {
                if c.type_ == "Ready" && c.status != "True" {
                    now.push(format!(
                        "Ready={} ({})",
                        c.status,
                        c.message.as_deref().unwrap_or("")
                    ));
                }
                if c.type_ == "GracefulShutdown" && c.status == "True" {
                    now.push("GracefulShutdown=True".into());
                }
            }
            for t in n
                .spec
                .as_ref()
                .and_then(|s| s.taints.as_ref())
                .into_iter()
                .flatten()
            {
                now.push(format!("taint {}:{}", t.key, t.effect));
            }
            if n.spec
                .as_ref()
                .and_then(|s| s.unschedulable)
                .unwrap_or(false)
            {
                now.push("cordoned".into());
            }
            let mut s = out.lock().unwrap();
            for w in now {
                if !s.iter().any(|(_, x)| *x == w) {
                    s.push((t0.elapsed(), w));
                }
            }
        }
    });
    (signals, task)
}

fn workload(name: &str, class: &str, app: &str) -> serde_json::Value {
    serde_json::json!({
        "metadata": {"name": name, "labels": {"app": app}},
        "spec": {
            "priorityClassName": class, "terminationGracePeriodSeconds": 30,
            "automountServiceAccountToken": false,
            "containers": [{"name": "app", "image": BUSYBOX, "imagePullPolicy": "Never",
                            "command": ["sh", "-c", SLOW_TO_STOP]}],
        },
    })
}

/// Real pods in three priority groups on `node`: `low` owned by a
/// Deployment (it must come back after a reboot), `mid` behind a
/// PodDisruptionBudget that allows no disruption, `critical`
/// (system-node-critical). Returns the low pod's name once all run.
async fn start_workloads(admin: &Client, node: &str, work_ns: &str) -> String {
    ensure_priority_class(admin, "nodeguard-test-low", 0).await;
    ensure_priority_class(admin, "nodeguard-test-mid", 1000).await;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), work_ns);
    let mut low = workload("", "nodeguard-test-low", "low");
    low["metadata"].as_object_mut().unwrap().remove("name");
    low["spec"]["nodeSelector"] = serde_json::json!({"kubernetes.io/hostname": node});
    let deployment = serde_json::json!({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "low"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "low"}}, "template": low},
    });
    let deployments: Api<k8s_openapi::api::apps::v1::Deployment> =
        Api::namespaced(admin.clone(), work_ns);
    deployments
        .create(
            &PostParams::default(),
            &serde_json::from_value(deployment).unwrap(),
        )
        .await
        .unwrap();
    for (name, class, app) in [
        ("mid", "nodeguard-test-mid", "mid"),
        ("critical", "system-node-critical", "critical"),
    ] {
        let mut p = workload(name, class, app);
        p["apiVersion"] = "v1".into();
        p["kind"] = "Pod".into();
        p["spec"]["nodeName"] = node.into();
        pods.create(&PostParams::default(), &serde_json::from_value(p).unwrap())
            .await
            .unwrap();
    }
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(admin.clone(), work_ns);
    let pdb: PodDisruptionBudget = serde_json::from_value(serde_json::json!({
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "mid"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "mid"}}},
    }))
    .unwrap();
    pdbs.create(&PostParams::default(), &pdb).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(180);
    let low_pod = loop {
        let list = pods.list(&ListParams::default()).await.unwrap().items;
        let running = |app: &str| {
            list.iter().find(|p| {
                p.metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get("app"))
                    .map(String::as_str)
                    == Some(app)
                    && pod_ready(p)
            })
        };
        if let (Some(l), Some(_), Some(_)) = (running("low"), running("mid"), running("critical")) {
            break l.metadata.name.clone().unwrap();
        }
        assert!(
            Instant::now() < deadline,
            "the three workload pods Running and Ready within 180 s: {:?}",
            list.iter()
                .map(|p| (
                    p.metadata.name.clone(),
                    p.status.as_ref().and_then(|s| s.phase.clone())
                ))
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    eventually(
        Duration::from_secs(30),
        "the PDB computed: no disruption allowed",
        || async {
            pdbs.get("mid")
                .await
                .ok()
                .and_then(|p| p.status)
                .is_some_and(|s| {
                    s.observed_generation == Some(1)
                        && s.current_healthy == 1
                        && s.disruptions_allowed == 0
                })
        },
    )
    .await;
    low_pod
}

/// Waits for a delay inhibitor whose `who` contains `who`; logind's maximum.
pub(crate) async fn inhibitor_held(vm: &mut Vm, who: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let l = vm
            .exec("systemd-inhibit --list --no-pager --mode=delay")
            .await
            .stdout;
        if l.lines().any(|l| l.contains(who) && l.contains("shutdown")) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{who}'s delay inhibitor within 60 s:\n{l}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let max = vm
        .sh("busctl get-property org.freedesktop.login1 /org/freedesktop/login1 org.freedesktop.login1.Manager InhibitDelayMaxUSec")
        .await;
    let usec: u64 = max.trim().trim_start_matches("t ").parse().unwrap_or(0);
    format!("{} s", usec / 1_000_000)
}

/// `systemctl reboot`, watching the pods and the Node until the VM is down.
async fn reboot_watched(
    vm: &mut Vm,
    admin: &Client,
    node: &str,
    work_ns: &str,
    low_pod: &str,
    delete_agent_in: Option<&str>,
    dir: &std::path::Path,
) -> Observed {
    // With the agent's namespace (nodeguard's own shutdown), the agent is
    // also SIGKILLed at the shutdown's start.
    let kill_agent = delete_agent_in.is_some();
    let t0 = Instant::now() + Duration::from_secs(1);
    let (seen, tracker) = track(admin, work_ns);
    let (signals, node_watch) = watch_node(admin, node, t0);
    let deleter = delete_agent_in.map(|ns| {
        let (seen, admin, ns, low) = (
            seen.clone(),
            admin.clone(),
            ns.to_string(),
            low_pod.to_string(),
        );
        tokio::spawn(async move {
            loop {
                let first_done = seen
                    .lock()
                    .unwrap()
                    .get(&low)
                    .is_some_and(|s| s.stopped.is_some() || s.gone.is_some());
                if first_done {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let agent = agent_pod(&admin, &ns).await;
            let pods: Api<Pod> = Api::namespaced(admin.clone(), &ns);
            pods.delete(&agent.metadata.name.unwrap(), &DeleteParams::default())
                .await
                .unwrap();
            Instant::now()
        })
    });
    // What an operator sees a few seconds into the shutdown (make demo DEMO=vm).
    let snapshot = {
        let (signals, node, dir) = (signals.clone(), node.to_string(), dir.to_path_buf());
        tokio::spawn(async move {
            while signals.lock().unwrap().is_empty() {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            tokio::time::sleep(Duration::from_secs(4)).await;
            tokio::task::spawn_blocking(move || save_view(&dir, &node, "shutting-down")).await
        })
    };
    if kill_agent {
        // SIGKILL the agent's process (as the OOM killer would) the moment
        // logind prepares for the shutdown: between its taint and its
        // first eviction, or just after. (`[ ]`: not this script itself.)
        vm.spawn(&format!(
            "for i in $(seq 1 1200); do [ \"$(busctl get-property {LOGIN1} PreparingForShutdown)\" = 'b true' ] && break; sleep 0.05; done; pkill -9 -f 'nodeguard[ ]run' && echo 'e2e: SIGKILL nodeguard run' > /dev/kmsg"
        ))
        .await;
    }
    tokio::time::sleep_until(t0.into()).await;
    vm.spawn("systemctl reboot").await;
    let (down_at, reason) = vm
        .wait_exit(INHIBIT_DELAY + Duration::from_secs(90))
        .await
        .expect("the VM goes down after `systemctl reboot`");
    tokio::time::sleep(Duration::from_secs(1)).await;
    tracker.abort();
    node_watch.abort();
    snapshot.abort();
    let agent_deleted = match deleter {
        Some(d) if d.is_finished() => Some(d.await.expect("delete the agent's pod") - t0),
        Some(d) => {
            d.abort();
            None
        }
        None => None,
    };
    let seen = seen.lock().unwrap().clone();
    let get = |n: &str| seen.get(n).cloned().unwrap_or_default();
    let signals = signals.lock().unwrap().clone();
    Observed {
        t0,
        pods: [get(low_pod), get("mid"), get("critical")],
        signals,
        down: down_at - t0,
        reason,
        agent_deleted,
    }
}

const NAMES: [&str; 3] = ["low", "mid", "critical"];

/// logind's manager object, for `busctl get-property`.
const LOGIN1: &str =
    "org.freedesktop.login1 /org/freedesktop/login1 org.freedesktop.login1.Manager";

/// `kubectl get pods -o wide` on the node and `kubectl describe node`, as
/// the operator would look, into the node's artifacts (`<what>` names the
/// moment: before-reboot, shutting-down, after-reboot).
pub fn save_view(dir: &std::path::Path, node: &str, what: &str) {
    let pods = kubectl_status(&[
        "get",
        "pods",
        "-A",
        "-o",
        "wide",
        "--field-selector",
        &format!("spec.nodeName={node}"),
    ]);
    let _ = std::fs::write(
        dir.join(format!("pods-{what}.txt")),
        pods.unwrap_or_else(|e| e),
    );
    let describe = kubectl_status(&["describe", "node", node]);
    let _ = std::fs::write(
        dir.join(format!("describe-node-{what}.txt")),
        describe.unwrap_or_else(|e| e),
    );
}

/// `systemctl reboot` with nodeguard's shutdown in charge: evicted in
/// order, the kubelet terminating each pod within its grace, the PDB held
/// until the policy's escalation, the VM down after the last group and
/// before logind's limit. Returns, once the VM is down, what it saw.
pub async fn graceful_reboot(
    vm: &mut Vm,
    admin: &Client,
    node: &str,
    dir: &std::path::Path,
    work_ns: &str,
    agent_ns: &str,
) -> String {
    let low_pod = start_workloads(admin, node, work_ns).await;
    let logind_delay = inhibitor_held(vm, "nodeguard").await;
    save_view(dir, node, "before-reboot");
    let o = reboot_watched(vm, admin, node, work_ns, &low_pod, Some(agent_ns), dir).await;
    std::fs::write(
        dir.join("shutdown-pods.txt"),
        format!("{:#?}\n{:#?}", o.pods, o.signals),
    )
    .unwrap();
    // The agent's pod was deleted once the first group was done: the
    // agent must finish the shutdown it started (its inhibitor goes with
    // its process, and logind would go on at once).
    let deleted = o.agent_deleted.unwrap_or_else(|| {
        panic!(
            "the agent's pod was not deleted during the shutdown: {:?}",
            o.pods
        )
    });
    let visible = o
        .signals
        .iter()
        .find(|(_, s)| s == "GracefulShutdown=True")
        .map(|(t, _)| *t)
        .expect("GracefulShutdown=True seen during the shutdown");
    assert!(
        o.signals
            .iter()
            .any(|(t, s)| s.starts_with("taint nodeguard.io/shutdown")
                && *t < Duration::from_secs(15)),
        "the shutdown taint within 15 s: {:?}",
        o.signals
    );
    // When each was deleted (evicted, or deleted on escalation) and when
    // the API showed it stopped (container terminated or the pod gone).
    let times: Vec<(Duration, Duration)> = (0..3)
        .map(|i| {
            (
                o.at(o.pods[i].marked)
                    .unwrap_or_else(|| panic!("{} was never deleted: {:?}", NAMES[i], o.pods)),
                o.stopped(i).unwrap_or_else(|| {
                    panic!(
                        "{} was never stopped by the kubelet: {:?}",
                        NAMES[i], o.pods
                    )
                }),
            )
        })
        .collect();
    let [(l_m, l_s), (m_m, m_s), (c_m, c_s)] = [times[0], times[1], times[2]];
    assert!(
        l_m < m_m && m_m < c_m,
        "groups in order: low {l_m:?}, mid {m_m:?}, critical {c_m:?}"
    );
    // A group begins when the one before is done or its window is over
    // (the kubelet's rule too): never earlier.
    let window = Duration::from_secs(GROUP_SECS[0]);
    let mid_window = Duration::from_secs(GROUP_SECS[1]);
    let slack = Duration::from_millis(500);
    let mid_group = l_s.min(l_m + window);
    assert!(
        m_m + slack >= mid_group,
        "mid deleted at {m_m:?}, before the low group was over ({mid_group:?})"
    );
    assert!(
        c_m + slack >= m_s.min(mid_group + mid_window),
        "critical deleted at {c_m:?}, before the mid group was over"
    );
    // The PDB held the mid pod until the escalation (half its window).
    assert!(
        m_m + Duration::from_secs(1) >= mid_group + mid_window / 2,
        "the PDB held mid: deleted {m_m:?}, its group began {mid_group:?}"
    );
    // Each pod got its grace: SLOW_TO_STOP exits 0, 3 s after SIGTERM.
    let mut exits = Vec::new();
    for (i, (marked, stopped)) in times.iter().enumerate() {
        assert!(
            *stopped >= *marked + Duration::from_secs(3),
            "{} stopped {:?} after its deletion: it did not get its grace",
            NAMES[i],
            *stopped - *marked
        );
        let x = o.pods[i]
            .exit
            .unwrap_or_else(|| panic!("{}'s exit code never reported: {:?}", NAMES[i], o.pods));
        assert_eq!(x, 0, "{} exited {x}: killed rather than stopped", NAMES[i]);
        exits.push(format!("{} 0", NAMES[i]));
    }
    // The kubelet removed the earlier groups' pods; the last one's object
    // may outlive the shutdown (its container stopped, the kubelet itself
    // is stopped before it deletes the object; boot 2's kubelet does).
    for (name, p) in NAMES.iter().zip(&o.pods).take(2) {
        assert!(
            p.gone.is_some(),
            "{name} deleted by the kubelet before the VM went down: {:?}",
            o.pods
        );
    }
    assert!(
        o.down > c_s,
        "down ({:?}) only after the last group ({c_s:?})",
        o.down
    );
    assert!(
        o.down < INHIBIT_DELAY + Duration::from_secs(15),
        "down {:?} after `systemctl reboot`: the inhibitor was held past logind's limit",
        o.down
    );
    // Killed at the shutdown's start, the agent was restarted by the
    // kubelet and went on: each pod deleted once (one grace seen; 0 is
    // the kubelet's own final delete once its containers stopped).
    for (name, p) in NAMES.iter().zip(&o.pods) {
        assert!(
            p.graces.iter().filter(|g| **g > 0).count() == 1,
            "{name} evicted or deleted more than once (graces {:?}): {:?}",
            p.graces,
            o.pods
        );
    }
    let events = crate::events_for(node).await;
    std::fs::write(dir.join("events-reboot.txt"), &events).unwrap();
    let resumed = events
        .lines()
        .find(|l| l.contains("ShutdownResumed"))
        .and_then(|l| l.split("nodeguard ").nth(1))
        .map(|m| format!("nodeguard {}", m.trim()))
        .unwrap_or_else(|| {
            panic!("the agent killed at the shutdown's start resumed it:\n{events}")
        });
    for e in [
        "ShutdownStarted",
        "ShutdownInhibitorReleased",
        "Priority group 0 done",
        "Priority group 1000 done",
        "Priority group 2000000000 done",
    ] {
        assert!(events.contains(e), "Event {e} on the node:\n{events}");
    }
    assert!(
        events.contains("StopDeferred"),
        "the agent said it deferred its stop until the shutdown was done:\n{events}"
    );
    assert!(
        events
            .lines()
            .any(|l| l.contains("EvictionEscalated") && l.contains("mid")),
        "the PDB escalation's Event:\n{events}"
    );
    let detail = format!(
        "logind delay {logind_delay}; `systemctl reboot` → GracefulShutdown=True {}; agent SIGKILLed as logind began, restarted by the kubelet, the inhibitor kept by the sidecar ({}); agent pod deleted at {} (after the first group), the shutdown went on; deleted → stopped: low {}→{}, mid (PDB, escalated) {}→{}, critical {}→{}; exit codes {}; VM down {} ({})",
        secs(visible),
        resumed,
        secs(deleted),
        secs(l_m),
        secs(l_s),
        secs(m_m),
        secs(m_s),
        secs(c_m),
        secs(c_s),
        exits.join(", "),
        secs(o.down),
        o.reason
    );
    *COMPARISON.lock().unwrap() = Some(Run {
        observed: o,
        after: String::new(),
    });
    detail
}

/// One column of the side-by-side table.
struct Run {
    observed: Observed,
    /// The workload pods after the reboot.
    after: String,
}

/// nodeguard's run (kube-reboot) for the side-by-side table with kube-gns.
static COMPARISON: Mutex<Option<Run>> = Mutex::new(None);

/// The workload pods' phases, one line.
pub async fn phases(admin: &Client, work_ns: &str) -> String {
    let pods: Api<Pod> = Api::namespaced(admin.clone(), work_ns);
    let mut out: Vec<String> = pods
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(|p| {
            let st = p.status.as_ref();
            let name = p.metadata.name.clone().unwrap_or_default();
            let name = if name.starts_with("low-") {
                "low (Deployment)".to_string()
            } else {
                name
            };
            let phase = st.and_then(|s| s.phase.clone()).unwrap_or_default();
            let ready = if pod_ready(p) { " Ready" } else { "" };
            match st.and_then(|s| s.reason.clone()) {
                Some(r) => format!("{name} {phase} ({r})"),
                None => format!("{name} {phase}{ready}"),
            }
        })
        .collect();
    out.sort();
    out.join(", ")
}

/// The real node with the kubelet's own graceful node shutdown
/// (shutdownGracePeriodByPodPriority: the same windows, the last one taking
/// nodeguard's 2 s margin too; the same total) and nodeguard's
/// shutdown off: the same pods and PDB, `systemctl reboot`, boot 2. Returns
/// the row's detail; writes the side-by-side table when kube-reboot ran.
pub async fn kubelet_gns(
    vm: &mut Vm,
    admin: &Client,
    node: &str,
    dir: &std::path::Path,
    work_ns: &str,
) -> Observed {
    let low_pod = start_workloads(admin, node, work_ns).await;
    inhibitor_held(vm, "kubelet").await;
    let o = reboot_watched(vm, admin, node, work_ns, &low_pod, None, dir).await;
    std::fs::write(
        dir.join("shutdown-pods.txt"),
        format!("{:#?}\n{:#?}", o.pods, o.signals),
    )
    .unwrap();
    o
}

/// After kube-gns's boot 2: the pods left, and the table beside nodeguard's
/// run (when kube-reboot ran in this invocation), written to
/// target/e2e/vm/gns-comparison.md. Returns the row's detail.
pub async fn gns_after(admin: &Client, work_ns: &str, o: Observed) -> String {
    // What the table compares must have been seen: each pod stopped by the
    // kubelet, by priority, with its exit code, before the VM went down.
    // The kubelet reports a pod's end through the API; the last group's
    // report can be lost when the node goes down right after it ("node will
    // shutdown shortly"; seen once in CI): that group is then shown as not
    // reported in the table instead of failing the comparison.
    let last = NAMES.len() - 1;
    for (name, pod) in NAMES.iter().zip(&o.pods).take(last) {
        assert!(
            pod.exit.is_some(),
            "{name}'s exit code was never reported: {:?}",
            o.pods
        );
    }
    if o.pods[last].exit.is_none() {
        eprintln!(
            "vm: kube-gns: the kubelet's report of {}'s end did not reach the API before the VM went down",
            NAMES[last]
        );
    }
    let stopped: Vec<Duration> = (0..NAMES.len())
        .filter_map(|i| {
            let s = o.stopped(i);
            assert!(
                s.is_some() || i == last,
                "{} never stopped: {:?}",
                NAMES[i],
                o.pods
            );
            s
        })
        .collect();
    assert!(
        stopped.windows(2).all(|w| w[0] <= w[1]),
        "the kubelet's groups in order: {stopped:?}"
    );
    assert!(
        stopped.last().is_some_and(|s| *s < o.down),
        "all stopped before the VM went down"
    );
    let after = phases(admin, work_ns).await;
    let stopped: Vec<String> = (0..3)
        .map(|i| {
            format!(
                "{} {}",
                NAMES[i],
                o.stopped(i).map(secs).unwrap_or_else(|| "unseen".into())
            )
        })
        .collect();
    let detail = format!(
        "kubelet GNS: stopped {}; exit codes {}; VM down {}; after the reboot: {after}",
        stopped.join(", "),
        exit_codes(&o),
        secs(o.down)
    );
    let gns = Run { observed: o, after };
    let ours = COMPARISON.lock().unwrap().take();
    let out = repo_root().join("target/e2e/vm/gns-comparison.md");
    match ours {
        Some(n) => std::fs::write(&out, table(&gns, &n)).unwrap(),
        None => {
            let _ = std::fs::remove_file(&out);
        }
    }
    detail
}

fn exit_codes(o: &Observed) -> String {
    (0..3)
        .map(|i| match o.pods[i].exit {
            Some(0) => format!("{} 0 (stopped on SIGTERM)", NAMES[i]),
            Some(137) => format!("{} 137 (SIGKILL)", NAMES[i]),
            Some(x) => format!("{} {x}", NAMES[i]),
            None => format!("{} not reported", NAMES[i]),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// kube-reboot's after-reboot phases for the table.
pub fn record_after(after: String) {
    if let Some(r) = COMPARISON.lock().unwrap().as_mut() {
        r.after = after;
    }
}

fn table(gns: &Run, ours: &Run) -> String {
    let how = |r: &Run| {
        let o = &r.observed;
        let deleted = o.pods.iter().filter(|p| p.marked.is_some()).count();
        if deleted == 3 {
            "evicted through the API (PDB checked), deleted on escalation; the kubelet terminates them".to_string()
        } else {
            format!(
                "{} of 3 deleted through the API; the others stopped by the kubelet itself, no eviction (it reports their status)",
                deleted
            )
        }
    };
    let order = |r: &Run| {
        let o = &r.observed;
        (0..3)
            .map(|i| {
                format!(
                    "{} {}",
                    NAMES[i],
                    o.stopped(i).map(secs).unwrap_or_else(|| "—".into())
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let pdb = |r: &Run| {
        let o = &r.observed;
        let low = o.stopped(0);
        match (o.at(o.pods[1].marked), o.stopped(1), low) {
            (Some(m), _, Some(l)) => format!(
                "evictions refused; deleted {} after the low pod stopped (the policy escalates after 50 % of the {} s window)",
                secs(m.saturating_sub(l)),
                GROUP_SECS[1]
            ),
            (None, Some(s), _) => format!(
                "not consulted: mid stopped at {} with 0 disruptions allowed",
                secs(s)
            ),
            _ => "mid not seen stopping".into(),
        }
    };
    let signals = |r: &Run| {
        r.observed
            .signals
            .iter()
            .map(|(t, s)| format!("{} {}", secs(*t), s.replace('|', "/")))
            .collect::<Vec<_>>()
            .join("; ")
    };
    let [a, b, c] = GROUP_SECS;
    let [ka, kb, kc] = KUBELET_GROUP_SECS;
    let mut t = format!(
        "| | kubelet graceful node shutdown ({ka} s, {kb} s, {kc} s) | nodeguard ({a} s, {b} s, {c} s + {MARGIN_SECS} s margin; its own pod deleted after the first group) |\n|---|---|---|\n",
    );
    type Cell<'a> = &'a dyn Fn(&Run) -> String;
    let rows: [(&str, Cell); 7] = [
        ("how pods were stopped", &how),
        ("stopped (s after `systemctl reboot`)", &order),
        ("PodDisruptionBudget (mid, minAvailable 1)", &pdb),
        ("exit codes (0: got its grace, 137: killed)", &|r: &Run| {
            exit_codes(&r.observed)
        }),
        ("`systemctl reboot` → VM down", &|r: &Run| {
            secs(r.observed.down)
        }),
        ("what the Node showed during the shutdown", &signals),
        (
            "workload pod objects after the reboot (bare pods are gone for good either way; the Deployment's comes back)",
            &|r: &Run| r.after.clone(),
        ),
    ];
    for (name, f) in rows {
        t.push_str(&format!("| {name} | {} | {} |\n", f(gns), f(ours)));
    }
    t
}

/// Boot 2 of the real node: the agent's pod back, the shutdown's taint and
/// cordon gone, GracefulShutdown=False (NodeRebooted), the Deployment's pod
/// back on the node, the kernel monitor reset and reading the new boot.
pub async fn after_reboot(
    vm: &mut Vm,
    admin: &Client,
    node: &str,
    work_ns: &str,
    agent_ns: &str,
    shutdown: String,
    rows: &Rows,
) {
    let booted = vm.wait_guest_agent(crate::BOOT_TIMEOUT).await;
    let t0 = Instant::now();
    eventually(
        Duration::from_secs(180),
        "GracefulShutdown=False (NodeRebooted) from the agent's pod on boot 2",
        || async {
            node_conditions(admin, node, "GracefulShutdown")
                .await
                .first()
                .is_some_and(|c| c.status == "False" && c.reason.as_deref() == Some("NodeRebooted"))
        },
    )
    .await;
    let rebooted = t0.elapsed();
    let nodes: Api<Node> = Api::all(admin.clone());
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let n = nodes.get(node).await.unwrap();
        let spec = n.spec.clone().unwrap_or_default();
        if !has_taint(&n, "nodeguard.io/shutdown") && !spec.unschedulable.unwrap_or(false) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the shutdown taint removed, the node schedulable, within 30 s of NodeRebooted: taints {:?}, unschedulable {:?}, GracefulShutdown {:?}",
            spec.taints,
            spec.unschedulable,
            node_conditions(admin, node, "GracefulShutdown").await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The pod deleted during the shutdown was replaced (by the DaemonSet
    // controller, once it was gone): exactly one, Ready, on this boot.
    let agent_pods: Api<Pod> = Api::namespaced(admin.clone(), agent_ns);
    eventually(
        Duration::from_secs(120),
        "one agent pod, Ready, on boot 2",
        || async {
            agent_pods
                .list(&ListParams::default())
                .await
                .is_ok_and(|l| l.items.len() == 1 && pod_ready(&l.items[0]))
        },
    )
    .await;
    let agent = agent_pod(admin, agent_ns)
        .await
        .metadata
        .name
        .unwrap_or_default();
    let pods: Api<Pod> = Api::namespaced(admin.clone(), work_ns);
    let deadline = Instant::now() + Duration::from_secs(180);
    let back = loop {
        let list = pods
            .list(&ListParams::default().labels("app=low"))
            .await
            .unwrap()
            .items;
        if let Some(p) = list.iter().find(|p| {
            pod_ready(p) && p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node)
        }) {
            break p.metadata.name.clone().unwrap();
        }
        assert!(
            Instant::now() < deadline,
            "the Deployment's pod back on the node within 180 s: {list:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let back_at = t0.elapsed();
    wait_condition(
        admin,
        node,
        "KernelDeadlock",
        "False",
        Duration::from_secs(30),
        "KernelDeadlock reset by the new boot",
    )
    .await;
    let t1 = Instant::now();
    vm.sh("echo '<3>INFO: task docker:4343 blocked for more than 120 seconds.' > /dev/kmsg")
        .await;
    wait_condition(
        admin,
        node,
        "KernelDeadlock",
        "True",
        Duration::from_secs(20),
        "KernelDeadlock=True from a kernel line of the new boot",
    )
    .await;
    let kmsg = t1.elapsed();
    eventually(Duration::from_secs(10), "a NodeRebooted Event", || async {
        crate::events_for(node).await.contains("NodeRebooted")
    })
    .await;
    rows.pass(
        "kube-reboot",
        format!(
            "{shutdown}. Boot 2: guest agent {}; NodeRebooted {} later, taint gone, node schedulable; agent pod {agent} (the DaemonSet's replacement) Ready; Deployment's pod {back} Running on the node {}; KernelDeadlock reset, new /dev/kmsg line → True {}",
            secs(booted), secs(rebooted), secs(back_at), secs(kmsg)
        ),
    );
}

/// The agent in the pod pets softdog; frozen, it stops and the node resets.
pub async fn device_watchdog(vm: &mut Vm, admin: &Client, node: &str, agent_ns: &str, rows: &Rows) {
    let timeout = WATCHDOG_TIMEOUT.as_secs().to_string();
    let deadline = Instant::now() + Duration::from_secs(60);
    while crate::armed(vm).await != ["active", timeout.as_str()] {
        assert!(
            Instant::now() < deadline,
            "softdog armed by the pod with a {timeout} s timeout"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let pod = agent_pod(admin, agent_ns).await;
    assert!(pod_ready(&pod), "the agent's pod is Ready");
    // The agent, not the pod's `nodeguard keep` sidecar (`[ ]`: not this
    // script itself).
    let pid = vm.sh("pgrep -f 'nodeguard[ ]run'").await;
    let pid = pid.trim();
    assert!(
        !pid.is_empty() && !pid.contains(char::is_whitespace),
        "one `nodeguard run` process: {pid:?}"
    );
    // Still petting well past one timeout.
    tokio::time::sleep(WATCHDOG_TIMEOUT + Duration::from_secs(5)).await;
    assert!(
        vm.exited().is_none(),
        "the node reset while the agent was healthy"
    );
    let t0 = Instant::now();
    vm.sh(&format!("kill -STOP {pid}")).await;
    let (at, reason) = vm
        .wait_exit(WATCHDOG_TIMEOUT + Duration::from_secs(30))
        .await
        .expect("the frozen agent's watchdog resets the node");
    let reset = at - t0;
    assert_eq!(reason, "guest-reset");
    assert!(
        reset <= WATCHDOG_TIMEOUT + Duration::from_secs(3),
        "reset after {reset:?}"
    );
    assert!(reset >= WATCHDOG_TIMEOUT / 2, "reset too early: {reset:?}");
    assert!(
        vm.serial_log()
            .contains("softdog: Initiating system reboot")
    );
    rows.pass(
        "kube-device-watchdog",
        format!(
            "{node}: armed from the pod (timeout {timeout} s, pet every ~10 s), no reset in {} s; agent SIGSTOPped → softdog reset {} later",
            WATCHDOG_TIMEOUT.as_secs() + 5,
            secs(reset)
        ),
    );
}

/// Where the disk puts the node-local plugin (`host.plugins`): the agent's
/// own static binary, which `version` runs without a shell or libc.
pub const PLUGIN: &str = "/usr/local/lib/nodeguard/plugins/nodeguard";

/// Node-local trust from the chart's pod: a policy (written by a cluster
/// admin, so admission lets it through) with an exec probe of a node-local
/// plugin under `host.plugins` and one of `/bin/sh`. The plugin runs; the
/// shell is refused on the node with `NodeGuardPolicyInvalid=True` naming
/// the field and the chart value, and the rest of the policy applies.
pub async fn trust(admin: &Client, node: &str, rows: &Rows) {
    let policy = PolicyName(unique_name("vm-trust"));
    let t0 = Instant::now();
    apply_policy(
        admin,
        &policy,
        serde_json::json!({
            "nodeSelector": {"matchLabels": {"kubernetes.io/hostname": node}},
            "probes": [
                {"name": "plugin", "exec": {"command": [PLUGIN, "version"]},
                 "conditionType": "PluginCheckFailed", "periodSeconds": 2, "failureThreshold": 1},
                {"name": "shell", "exec": {"command": ["/bin/sh", "-c", "id"]},
                 "conditionType": "ShellCheckFailed", "periodSeconds": 2, "failureThreshold": 1},
            ],
        }),
    )
    .await;
    let c = |t: &'static str| async move {
        node_conditions(admin, node, t).await.first().map(|c| {
            (
                c.status.clone(),
                c.reason.clone().unwrap_or_default(),
                c.message.clone().unwrap_or_default(),
            )
        })
    };
    eventually(
        Duration::from_secs(60),
        "the plugin probe passes",
        || async {
            c("PluginCheckFailed").await.is_some_and(|(s, _, m)| {
                s == "False" && m.contains("passes") && m.contains("nodeguard")
            })
        },
    )
    .await;
    let ran = t0.elapsed();
    eventually(
        Duration::from_secs(30),
        "the shell probe refused",
        || async {
            c("NodeGuardPolicyInvalid").await.is_some_and(|(s, r, m)| {
                s == "True"
                    && r == "PolicyRefused"
                    && m.contains("spec.probes[1].exec.command[0] runs /bin/sh")
                    && m.contains("trust.commands")
            })
        },
    )
    .await;
    assert!(
        c("ShellCheckFailed").await.is_none(),
        "a refused probe sets no condition"
    );
    let (_, _, refused) = c("NodeGuardPolicyInvalid").await.unwrap();
    delete_policy(admin, &policy).await;
    eventually(Duration::from_secs(30), "PoliciesValid again", || async {
        c("NodeGuardPolicyInvalid")
            .await
            .is_some_and(|(s, _, _)| s == "False")
    })
    .await;
    rows.pass(
        "kube-trust",
        format!(
            "exec of the node-local plugin ({PLUGIN}, host.plugins) passed {} after the policy; `/bin/sh` refused on the node: \"{}\"",
            secs(ran),
            refused.replace('|', "/")
        ),
    );
}

/// The agent pod's /metrics, read in the guest on the node's network (the
/// pod uses the host network; the API server cannot reach the VM's address
/// for a pod proxy). bash's /dev/tcp: the image has no curl.
async fn pod_metrics(vm: &mut Vm) -> String {
    let raw = vm
        .sh("exec 3<>/dev/tcp/127.0.0.1/9909 && printf 'GET /metrics HTTP/1.0\\r\\nHost: localhost\\r\\n\\r\\n' >&3 && cat <&3")
        .await;
    let (head, body) = raw
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("an HTTP answer from :9909: {raw:?}"));
    assert!(
        head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"),
        "{head}"
    );
    body.to_string()
}

/// kube-alerts: the chart's alerts against the chart's pod on this node
/// (graceful shutdown, the device watchdog and the default policy's
/// monitors in force). More OOM kills than the Event burst make the
/// rate-limited drops appear; then every series and label the alerts read
/// must be in the pod's /metrics, and promtool, fed two of its scrapes 10 s
/// apart (as a minute apart), the second held for 30 minutes, with the job
/// the chart's PodMonitor gives this install, must find no alert firing on
/// this healthy node.
pub async fn alerts(
    vm: &mut Vm,
    admin: &Client,
    node: &str,
    node_dir: &std::path::Path,
    agent_ns: &str,
    rows: &Rows,
) {
    use crate::support::alerts::{missing_from, quiet_test, rule_groups_for, test_rules};
    let pod = agent_pod(admin, agent_ns).await;
    let pod_name = pod.metadata.name.clone().unwrap();
    vm.sh("for i in $(seq 1 15); do echo \"Killed process $((4000 + i)) (stress-ng) total-vm:10240kB, anon-rss:8192kB, file-rss:0kB, shmem-rss:0kB\" > /dev/kmsg; done")
        .await;
    let dropped = "nodeguard_events_dropped_total{reason=\"OOMKilling\",cause=\"rate_limited\"}";
    let deadline = Instant::now() + Duration::from_secs(30);
    let text = loop {
        let text = pod_metrics(vm).await;
        if text.contains(dropped) {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "no {dropped} 30 s after 15 OOM kills:\n{text}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    // Beside the node's disk and logs (`crate::node_dir` would wipe them).
    let dir = node_dir.join("alerts");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("metrics.txt"), &text).unwrap();
    // The rules of this install (its release and namespace: its job).
    let release = pod
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get("app.kubernetes.io/instance"))
        .cloned()
        .expect("the pod's app.kubernetes.io/instance label");
    let groups = rule_groups_for(&release, agent_ns, &[]);
    let job = format!("{agent_ns}/{release}");
    crate::support::alerts::check_rules(&dir, &groups);
    let problems = missing_from(&groups, &text);
    assert!(
        problems.is_empty(),
        "the alerts read what the chart's pod does not expose:\n{}\n(its /metrics: {})",
        problems.join("\n"),
        dir.join("metrics.txt").display()
    );
    let target = [
        ("job", job.as_str()),
        ("instance", "10.0.2.15:9909"),
        ("namespace", agent_ns),
        ("pod", pod_name.as_str()),
        ("node", node),
    ];
    tokio::time::sleep(Duration::from_secs(10)).await;
    let later = pod_metrics(vm).await;
    std::fs::write(dir.join("metrics-later.txt"), &later).unwrap();
    let quiet = quiet_test(&groups, &[&text, &later], &target, 30);
    std::fs::write(
        dir.join("quiet_test.yaml"),
        serde_json::to_vec_pretty(&quiet).unwrap(),
    )
    .unwrap();
    let (ok, out) = test_rules(&dir, "quiet_test.yaml");
    assert!(ok, "an alert fires on the healthy node's series:\n{out}");
    let value = |series: &str| {
        sample(&text, series).unwrap_or_else(|| panic!("{series} in the pod's /metrics"))
    };
    let held = value("nodeguard_shutdown_inhibitor_held");
    let needed = value("nodeguard_shutdown_inhibit_delay_needed_seconds");
    let delay_max = value("nodeguard_shutdown_inhibit_delay_max_seconds");
    assert_eq!(held, 1.0, "the pod holds logind's delay inhibitor");
    assert_eq!(
        needed, KUBE_NEEDED_DELAY_SECS as f64,
        "the policy's groups and margin"
    );
    assert!(
        delay_max >= needed,
        "logind allows {delay_max} s of {needed} s"
    );
    let skipped =
        value("nodeguard_watchdog_skipped_pets_total{target=\"device\",reason=\"stuck_loop\"}");
    // The image's binary, once it had been ready for a while, dropped its
    // executable's resident pages (helper-74's review: on this static PIE,
    // musl's loader gives a load bias of 0, and the first version released
    // nothing while its log said it had).
    // The line comes 60-120 s after the pod is first ready, once its API
    // calls have gone through for 30 s (footprint::settle): asked for last,
    // up to 240 s from here.
    // Text logs (this install) say `ranges=3`, JSON logs `"ranges":3`.
    // Read on the node: the API server here cannot reach the kubelet by
    // the VM's name (`kubectl logs` fails with "no such host").
    let deadline = Instant::now() + Duration::from_secs(240);
    let line = loop {
        let logs = vm
            .sh(&format!(
                "cat /var/log/pods/{agent_ns}_{pod_name}_*/nodeguard/*.log 2>/dev/null; true"
            ))
            .await;
        if let Some(l) = logs.lines().find(|l| l.contains("the executable's")) {
            break l.to_string();
        }
        assert!(
            Instant::now() < deadline,
            "no line about the executable's pages in the agent's log 240 s on:\n{logs}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    let ranges: u32 = ["ranges=", "\"ranges\":"]
        .iter()
        .find_map(|key| {
            let (_, rest) = line.split_once(key)?;
            rest.split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or(0);
    assert!(
        line.contains(nodeguard::footprint::RELEASED) && ranges > 0,
        "{line}"
    );
    eprintln!("kube-alerts: {line}");
    let alerts = crate::support::alerts::alerts(&groups).len();
    let series = crate::support::alerts::samples(&text).len();
    rows.pass(
        "kube-alerts",
        format!(
            "the pod's /metrics ({series} series) has every series and label the {alerts} alerts read; promtool: none fires over 30 min of them; inhibitor held, logind {delay_max} s ≥ {needed} s needed, device pets skipped {skipped}; 15 OOM kills → {} rate-limited Events",
            value(dropped)
        ),
    );
}

/// Where the kube node's disk holds node-problem-detector for `kube-npd`.
pub const NPD_BINARY: &str = "/usr/local/lib/npd/nodeproblemdetector";

/// node-problem-detector as the oracle on a real kernel: NPD's own binary
/// (bench/npd-build) runs on the node with its kernel-monitor.json and
/// readonly-monitor.json (the GCE set's kernel monitors), reading
/// the node's real `/dev/kmsg`, for a Node of its own; the agent runs the
/// config's `import-npd` for another Node and reads the same kernel records
/// (dumped from the node's `/dev/kmsg` after they were written). The lines
/// written are the ones NPD's kernel rules are about, with what differs
/// (a line that goes on past the pattern, trailing blanks, empty records).
/// The Events and conditions written for both Nodes must be the same.
pub async fn npd_oracle(vm: &mut Vm, admin: &Client, dir: &std::path::Path, rows: &Rows) {
    let npd_node = TestNode::create(admin, "npd-oracle", &[]).await;
    let ng_node = TestNode::selectable(admin, "ng-oracle").await;
    let account = npd_credentials(vm, "npd-oracle").await;
    use base64::Engine as _;
    let b64 = |s: &[u8]| base64::engine::general_purpose::STANDARD.encode(s);
    // NPD's two kernel monitors of the GCE set.
    const CONFIGS: [&str; 2] = ["kernel-monitor.json", "readonly-monitor.json"];
    let mut types: Vec<String> = Vec::new();
    let mut reasons: Vec<String> = Vec::new();
    let mut install = String::from("mkdir -p /etc/npd");
    for file in CONFIGS {
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(npd_configs().join(file)).unwrap())
                .unwrap();
        // Only records written from now on (NPD drops older ones).
        config["lookback"] = "0s".into();
        types.extend(
            config["conditions"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c["type"].as_str().unwrap().to_string()),
        );
        reasons.extend(
            config["rules"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r["reason"].as_str().unwrap().to_string()),
        );
        install.push_str(&format!(
            " && echo {} | base64 -d > /etc/npd/{file}",
            b64(config.to_string().as_bytes())
        ));
    }
    vm.sh(&install).await;
    // The last kernel record before the lines: the agent gets those after it.
    let last_seq = |dump: &str| -> u64 {
        dump.lines()
            .filter_map(|l| l.split(',').nth(1)?.parse().ok())
            .max()
            .unwrap_or(0)
    };
    // The whole ring is more than the guest agent returns: cut on the node.
    let dump = |after: u64| {
        format!("dd if=/dev/kmsg iflag=nonblock bs=8192 2>/dev/null | awk -F, '$2 > {after}'")
    };
    let before = last_seq(&vm.sh(&format!("{} | tail -1", dump(0))).await);
    assert!(before > 0, "the node's /dev/kmsg has records");
    vm.sh(&format!(
        "systemd-run --unit=npd-oracle {NPD_BINARY} --hostname-override={} --apiserver-override='https://{}?inClusterConfig=false&auth=/etc/npd/kubeconfig' --config.system-log-monitor=/etc/npd/kernel-monitor.json,/etc/npd/readonly-monitor.json --address=127.0.0.1 --port=20256 --prometheus-address=127.0.0.1 --prometheus-port=20257 --v=3",
        npd_node.name,
        crate::qemu::GUEST_APISERVER
    ))
    .await;

    // The agent, with the import, on a kmsg file it gets the records in.
    let paths: Vec<String> = CONFIGS
        .iter()
        .map(|f| npd_configs().join(f).display().to_string())
        .collect();
    let mut args = vec!["import-npd"];
    args.extend(paths.iter().map(String::as_str));
    let (code, yaml, notes) = nodeguard(&args);
    assert_eq!(code, 0, "{notes}");
    let docs = nodeguard::policy::load_policies("imported", &yaml).unwrap();
    let mut monitors = docs[0].policy.as_ref().unwrap().spec.monitors.clone();
    assert_eq!(monitors.len(), CONFIGS.len(), "{yaml}");
    let kmsg = dir.join("npd-oracle-kmsg");
    std::fs::write(&kmsg, "").unwrap();
    for m in &mut monitors {
        m.source.kmsg.as_mut().unwrap().path = kmsg.display().to_string();
    }
    let policy = unique_name("npd-oracle");
    apply_policy(
        admin,
        &policy,
        serde_json::json!({"nodeSelector": selecting(&ng_node.name), "monitors": monitors}),
    )
    .await;
    let (agent, _state) = start_agent(admin.clone(), &ng_node.name).await;
    for n in [&npd_node.name, &ng_node.name] {
        wait_condition(
            admin,
            n,
            "KernelDeadlock",
            "False",
            Duration::from_secs(90),
            "KernelDeadlock=False at start (NPD on the node, the agent here)",
        )
        .await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    // What NPD's kernel rules are about, as a kernel prints it, and noise.
    let corpus = [
        "divide error: 0000 [#1] SMP PTI",
        "divide error: 0000 [#2] SMP",
        "BUG: unable to handle kernel NULL pointer dereference at 0000000000000010",
        "IPv6: ADDRCONF(NETDEV_CHANGE): veth1a2b3c: link becomes ready",
        "INFO: task kworker/u8:2:1234 blocked for more than 120 seconds.",
        "INFO: task docker:20744 blocked for more than 120 seconds.   ",
        "unregister_netdevice: waiting for lo to become free. Usage count = 1",
        "Memory cgroup out of memory: Killed process 77 (python3) total-vm:1048576kB, anon-rss:524288kB, file-rss:2048kB, shmem-rss:0kB, UID:0 pgtables:1024kB oom_score_adj:0",
        "EXT4-fs error (device sda1): ext4_lookup:1855: inode #2: comm ls: deleted inode referenced: 12",
        "XFS (dm-0): Log I/O Error Detected. Shutting down filesystem",
        "{1}[Hardware Error]: event severity: corrected",
        "{2}[Hardware Error]: event severity: fatal",
        "EXT4-fs (sda1): Remounting filesystem read-only",
    ];
    // One write per record, ending in a newline: the kernel holds a record
    // written without one as a continuation until the next write.
    let script: String = corpus
        .iter()
        .map(|l| format!("printf '%s\\n' {} > /dev/kmsg; sleep 0.2\n", b64_quote(l)))
        .collect();
    vm.sh(&script).await;
    let records: String = vm
        .sh(&dump(before))
        .await
        .lines()
        .filter(|l| {
            l.split(',')
                .nth(1)
                .and_then(|s| s.parse::<u64>().ok())
                .is_some_and(|seq| seq > before)
        })
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(
        corpus.iter().all(|c| records.contains(c.trim_end())),
        "the node's kernel log holds the lines:\n{records}"
    );
    {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&kmsg)
            .unwrap();
        f.write_all(records.as_bytes()).unwrap();
    }
    // Until both show the same, or 60 s (NPD writes conditions on its
    // resync period).
    let deadline = Instant::now() + Duration::from_secs(60);
    let (npd_seen, ng_seen) = loop {
        let a = shown(admin, &npd_node.name, &types, &reasons).await;
        let b = shown(admin, &ng_node.name, &types, &reasons).await;
        let settled = a.0.len() >= 5 && a.1.iter().filter(|c| c.contains("=True")).count() >= 4;
        if (settled && a == b) || Instant::now() > deadline {
            break (a, b);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    let npd_log = vm
        .sh("journalctl -u npd-oracle --no-pager -o cat | tail -60; systemctl stop npd-oracle")
        .await;
    let _ = std::fs::write(dir.join("npd-oracle.log"), &npd_log);
    agent.stop().await;
    delete_policy(admin, &policy).await;
    kubectl(&["delete", "clusterrolebinding", &account]);
    kubectl(&["delete", "serviceaccount", &account, "-n", "default"]);
    let table = oracle_table(&npd_seen, &ng_seen);
    let _ = std::fs::write(dir.join("npd-oracle.md"), &table);
    assert!(
        npd_seen.1.iter().any(|c| c.contains("KernelDeadlock=True")),
        "NPD did not act on the node's kernel log (its log follows):\n{table}\n{npd_log}"
    );
    assert_eq!(
        npd_seen, ng_seen,
        "nodeguard differs from node-problem-detector on the node's kernel records:\n{table}"
    );
    rows.pass(
        "kube-npd",
        format!(
            "NPD's binary on the node (its kernel-monitor.json and readonly-monitor.json, the real /dev/kmsg) and the agent with their import, {} kernel lines: {} Events and {} conditions, all the same",
            corpus.len(),
            npd_seen.0.len(),
            npd_seen.1.len()
        ),
    );
}

/// NPD's credentials on the node, `/etc/npd/kubeconfig`: a token of a new
/// account bound to cluster-admin, whose name is returned (to delete).
async fn npd_credentials(vm: &mut Vm, prefix: &str) -> String {
    let account = unique_name(prefix);
    kubectl(&["create", "serviceaccount", &account, "-n", "default"]);
    kubectl(&[
        "create",
        "clusterrolebinding",
        &account,
        "--clusterrole=cluster-admin",
        &format!("--serviceaccount=default:{account}"),
    ]);
    let token = kubectl(&[
        "create",
        "token",
        &account,
        "-n",
        "default",
        "--duration",
        "1h",
    ]);
    let ca =
        std::fs::read_to_string(kubeconfig_path().with_file_name("pki").join("ca.crt")).unwrap();
    use base64::Engine as _;
    let b64 = |s: &[u8]| base64::engine::general_purpose::STANDARD.encode(s);
    let kubeconfig = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: https://{}\n    certificate-authority-data: {}\nusers:\n- name: npd\n  user:\n    token: {}\ncontexts:\n- name: npd\n  context: {{cluster: test, user: npd}}\ncurrent-context: npd\n",
        crate::qemu::GUEST_APISERVER,
        b64(ca.as_bytes()),
        token.trim()
    );
    vm.sh(&format!(
        "mkdir -p /etc/npd && echo {} | base64 -d > /etc/npd/kubeconfig",
        b64(kubeconfig.as_bytes())
    ))
    .await;
    account
}

/// Where the node keeps NPD's plugin scripts: under the chart's
/// `host.plugins.path`, so the agent may run them.
pub const NPD_PLUGINS: &str = "/usr/local/lib/nodeguard/plugins/npd";

/// Our own plugin that forks and hangs until its timeout kills it.
const HANG_SCRIPT: &str = "ngvm-hang.sh";

/// Diagnostics of what a command from the pod sees.
const DIAG_SCRIPT: &str = "ngvm-diag.sh";

/// Our own plugin using what scripts expect of a node (run by both).
const TOOLS_SCRIPT: &str = "ngvm-tools.sh";

/// NPD's plugin scripts, unchanged, from the chart's pod (issue: NPD's
/// users' shell plugins). NPD's binary runs on the node with its release's
/// `custom-plugin-monitor.json` (check_ntp.sh, through the node's
/// `systemctl`) and `network-problem-monitor.json` (network_problem.sh,
/// the node's conntrack table), for a Node of its own; the chart is
/// upgraded to `host.plugins.hostRoot=true` and the agent runs their
/// `import-npd` for the node itself. Both give the same conditions and
/// Events, with `ntp.service` missing and then running, and on a script of
/// ours using mktemp, a here-string and an sbin tool. A plugin of ours
/// that forks and times out leaves nothing behind on the node over ten runs.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn npd_plugins(
    vm: &mut Vm,
    admin: &Client,
    node: &str,
    dir: &std::path::Path,
    release: &crate::kubenode::Release,
    published: &crate::kubenode::Published,
    rows: &Rows,
) {
    use base64::Engine as _;
    let b64 = |s: &[u8]| base64::engine::general_purpose::STANDARD.encode(s);
    let npd_node = TestNode::create(admin, "npd-plugins", &[]).await;
    let account = npd_credentials(vm, "npd-plugins").await;
    // NPD's scripts as its release has them, and the configs naming them
    // where the node has them (their paths are relative to NPD's working
    // directory in the release), run every 5 s: the same files for both.
    let mut install = format!("mkdir -p {NPD_PLUGINS} /etc/npd");
    for script in ["check_ntp.sh", "network_problem.sh"] {
        let body = std::fs::read(npd_configs().join("plugin").join(script)).unwrap();
        install.push_str(&format!(
            " && echo {} | base64 -d > {NPD_PLUGINS}/{script} && chmod 0755 {NPD_PLUGINS}/{script}",
            b64(&body)
        ));
    }
    let hang = "#!/bin/bash\nif [[ $1 == child ]]; then while :; do sleep 1; done; fi\n\"$0\" child &\nwait\n";
    install.push_str(&format!(
        " && echo {} | base64 -d > {NPD_PLUGINS}/{HANG_SCRIPT} && chmod 0755 {NPD_PLUGINS}/{HANG_SCRIPT}",
        b64(hang.as_bytes())
    ));
    let diag = "#!/bin/bash\necho \"journald $(systemctl is-active systemd-journald.service 2>&1) ntp $(systemctl is-active ntp.service 2>&1) rc=$?; $(SYSTEMD_LOG_LEVEL=debug systemctl is-active systemd-journald.service 2>&1 | tr '\\n' '|' | cut -c1-500); $(grep -E 'NoNewPrivs|Seccomp:|CapEff' /proc/self/status | tr '\\n' ' '); $(env | grep -iE 'systemd|dbus|container' | tr '\\n' ' ')\"\nexit 1\n";
    install.push_str(&format!(
        " && echo {} | base64 -d > {NPD_PLUGINS}/{DIAG_SCRIPT} && chmod 0755 {NPD_PLUGINS}/{DIAG_SCRIPT}",
        b64(diag.as_bytes())
    ));
    // And one of ours, in NPD's format, for what scripts written for a
    // node expect of it: a writable /tmp (mktemp, a here-string) and the
    // sbin directories on PATH (util-linux's fsck, always installed).
    let tools = "#!/bin/bash\nt=$(mktemp) || { echo \"no writable /tmp\"; exit 1; }\ntrap 'rm -f \"$t\"' EXIT\ncat > \"$t\" <<< here || exit 1\ncommand -v fsck > /dev/null || { echo \"no fsck on PATH $PATH\"; exit 1; }\necho \"tools work\"\n";
    install.push_str(&format!(
        " && echo {} | base64 -d > {NPD_PLUGINS}/{TOOLS_SCRIPT} && chmod 0755 {NPD_PLUGINS}/{TOOLS_SCRIPT}",
        b64(tools.as_bytes())
    ));
    let tools_config = serde_json::json!({
        "plugin": "custom",
        "pluginConfig": {"invoke_interval": "5s", "timeout": "5s", "max_output_length": 80, "concurrency": 1},
        "source": "ngvm-tools-monitor",
        "conditions": [{"type": "NodeToolsProblem", "reason": "ToolsWork", "message": "tools work"}],
        "rules": [{"type": "permanent", "condition": "NodeToolsProblem", "reason": "ToolsBroken",
                   "path": format!("./config/plugin/{TOOLS_SCRIPT}"), "timeout": "5s"}],
    });
    const CONFIGS: [&str; 3] = [
        "custom-plugin-monitor.json",
        "network-problem-monitor.json",
        "ngvm-tools-monitor.json",
    ];
    let mut types: Vec<String> = Vec::new();
    let mut reasons: Vec<String> = Vec::new();
    let mut local = Vec::new();
    for file in CONFIGS {
        let mut config: serde_json::Value = match std::fs::read_to_string(npd_configs().join(file))
        {
            Ok(text) => serde_json::from_str(&text).unwrap(),
            Err(_) => tools_config.clone(),
        };
        config["pluginConfig"]["invoke_interval"] = "5s".into();
        // The emulated node (TCG, its 2 host cores shared with the run's
        // builds) takes 2 to 2.5 s for check_ntp.sh's systemctl, and NPD's
        // 3 s rule timeout then turned one side Unknown at random (the
        // CI run on ccdbd7d: NPD's). Both sides get 30 s; the timeout's
        // Unknown is compared in tests/npd.rs, where the hang is certain.
        config["pluginConfig"]["timeout"] = "30s".into();
        for rule in config["rules"].as_array_mut().unwrap() {
            if rule.get("timeout").is_some() {
                rule["timeout"] = "30s".into();
            }
            let script = rule["path"]
                .as_str()
                .unwrap()
                .rsplit('/')
                .next()
                .unwrap()
                .to_string();
            rule["path"] = format!("{NPD_PLUGINS}/{script}").into();
            reasons.push(rule["reason"].as_str().unwrap().to_string());
        }
        for c in config["conditions"].as_array().unwrap() {
            types.push(c["type"].as_str().unwrap().to_string());
            reasons.push(c["reason"].as_str().unwrap().to_string());
        }
        let text = serde_json::to_string_pretty(&config).unwrap();
        install.push_str(&format!(
            " && echo {} | base64 -d > /etc/npd/{file}",
            b64(text.as_bytes())
        ));
        let path = dir.join(format!("npd-plugins-{file}"));
        std::fs::write(&path, &text).unwrap();
        local.push(path.display().to_string());
    }
    reasons.sort();
    reasons.dedup();
    vm.sh(&install).await;
    vm.sh(&format!(
        "systemd-run --unit=npd-plugins {NPD_BINARY} --hostname-override={} --apiserver-override='https://{}?inClusterConfig=false&auth=/etc/npd/kubeconfig' --config.custom-plugin-monitor={} --address=127.0.0.1 --port=20258 --prometheus-address=127.0.0.1 --prometheus-port=20259 --v=3",
        npd_node.name,
        crate::qemu::GUEST_APISERVER,
        CONFIGS.map(|f| format!("/etc/npd/{f}")).join(",")
    ))
    .await;

    // The agent: the chart's pod, now running commands in the node's root.
    let mut args = vec!["import-npd"];
    args.extend(local.iter().map(String::as_str));
    let (code, yaml, notes) = nodeguard(&args);
    assert_eq!(code, 0, "{notes}");
    let docs = nodeguard::policy::load_policies("imported", &yaml).unwrap();
    let mut monitors =
        serde_json::to_value(&docs[0].policy.as_ref().unwrap().spec.monitors).unwrap();
    monitors.as_array_mut().unwrap().push(serde_json::json!({
        "name": "hangs", "source": {"plugin": {"intervalSeconds": 2, "timeoutSeconds": 1}},
        "conditions": [{"type": "HangingPluginProblem", "reason": "Fine", "message": "fine"}],
        "rules": [{"type": "permanent", "condition": "HangingPluginProblem", "reason": "Hung",
                   "command": [format!("{NPD_PLUGINS}/{HANG_SCRIPT}")]}],
    }));
    // What a command of the pod sees of the node's systemd (diagnostics,
    // an Event each run).
    monitors.as_array_mut().unwrap().push(serde_json::json!({
        "name": "diag", "source": {"plugin": {"intervalSeconds": 30, "timeoutSeconds": 5, "maxOutputLength": 1024}},
        "rules": [{"type": "temporary", "reason": "PodSideDiag",
                   "command": [format!("{NPD_PLUGINS}/{DIAG_SCRIPT}")]}],
    }));
    let t_upgrade = Instant::now();
    release.upgrade(
        published,
        &[
            "--set",
            "host.plugins.hostRoot=true",
            "--wait",
            "--timeout",
            "5m",
        ],
    );
    let rolled = t_upgrade.elapsed();
    let policy = unique_name("npd-plugins");
    apply_policy(
        admin,
        &policy,
        serde_json::json!({
            "nodeSelector": {"matchLabels": {"kubernetes.io/hostname": node}},
            "monitors": monitors,
        }),
    )
    .await;

    // Until both Nodes show the same, with NPD's condition set (or 90 s).
    async fn settle(
        admin: &Client,
        npd: &str,
        ng: &str,
        types: &[String],
        reasons: &[String],
        want: &str,
    ) -> ((Vec<String>, Vec<String>), (Vec<String>, Vec<String>)) {
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let a = shown(admin, npd, types, reasons).await;
            let b = shown(admin, ng, types, reasons).await;
            let settled = a.1.iter().any(|c| c.starts_with(want));
            if (settled && a == b) || Instant::now() > deadline {
                return (a, b);
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
    let down = settle(
        admin,
        &npd_node.name,
        node,
        &types,
        &reasons,
        "NTPProblem=True",
    )
    .await;
    let tools_work = |seen: &(Vec<String>, Vec<String>)| {
        seen.1
            .iter()
            .any(|c| c.starts_with("NodeToolsProblem=False ToolsWork"))
    };
    // ntp.service running on the node: check_ntp.sh asks the node's systemd.
    vm.sh("systemd-run --unit=ntp.service sleep infinity").await;
    let up = settle(
        admin,
        &npd_node.name,
        node,
        &types,
        &reasons,
        "NTPProblem=False",
    )
    .await;
    vm.sh("systemctl stop ntp.service").await;

    let npd_log = vm
        .sh("journalctl -u npd-plugins --no-pager -o cat | tail -60; systemctl stop npd-plugins")
        .await;
    let _ = std::fs::write(dir.join("npd-plugins.log"), &npd_log);
    // The agent's side, for a difference: its log, and check_ntp.sh's
    // systemctl run by hand in the agent container's mount namespace and
    // root (nsenter), stderr included.
    let agent_side = vm
        .exec(&format!(
            "tail -n 200 /var/log/pods/{ns}_*/nodeguard/*.log; pid=$(pgrep -o -f 'run --listen'); echo \"agent pid $pid\"; chroot /proc/$pid/root/host /bin/sh -c 'ls -la /run/systemd/private; systemctl is-active ntp.service; echo \"rc=$?\"; SYSTEMD_LOG_LEVEL=debug systemctl is-active ntp.service 2>&1 | tail -15' 2>&1",
            ns = release.namespace
        ))
        .await;
    let diag_events = kubectl_status(&[
        "get",
        "events",
        "-A",
        "--field-selector",
        "reason=PodSideDiag",
        "-o",
        "custom-columns=MSG:.message",
    ])
    .unwrap_or_else(|e| e);
    let _ = std::fs::write(
        dir.join("npd-plugins-agent.log"),
        format!(
            "{}{}\n== diag Events\n{diag_events}",
            agent_side.stdout, agent_side.stderr
        ),
    );
    let table = format!(
        "## ntp.service missing\n\n{}\n## ntp.service running\n\n{}",
        oracle_table(&down.0, &down.1),
        oracle_table(&up.0, &up.1)
    );
    let _ = std::fs::write(dir.join("npd-plugins.md"), &table);
    assert!(
        down.0
            .1
            .iter()
            .any(|c| c.starts_with("NTPProblem=True NTPIsDown"))
            && up.0.1.iter().any(|c| c.starts_with("NTPProblem=False"))
            && tools_work(&down.0),
        "NPD's check_ntp.sh did not follow ntp.service on the node (its log follows):\n{table}\n{npd_log}"
    );
    assert_eq!(
        down.0, down.1,
        "nodeguard's pod differs from node-problem-detector with ntp.service missing:\n{table}"
    );
    assert_eq!(
        up.0, up.1,
        "nodeguard's pod differs from node-problem-detector with ntp.service running:\n{table}"
    );
    // The hanging plugin, sampled on the node 15 times, 0.3 s apart, after
    // at least ten timed-out runs: "sample pid state" lines.
    tokio::time::sleep(Duration::from_secs(20)).await;
    let samples = vm
        .sh(&format!(
            "for i in $(seq 15); do cat /proc/[0-9]*/stat 2>/dev/null | awk -v i=$i '$2 == \"({HANG_SCRIPT})\" {{ print i, $1, $3 }}'; sleep 0.3; done"
        ))
        .await;
    let mut per_sample: BTreeMap<u32, usize> = BTreeMap::new();
    let mut zombie_since: BTreeMap<u32, u32> = BTreeMap::new();
    let mut lasting = Vec::new();
    let mut seen_pids = std::collections::BTreeSet::new();
    for line in samples.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (Ok(i), Ok(pid)) = (f[0].parse::<u32>(), f[1].parse::<u32>()) else {
            continue;
        };
        seen_pids.insert(pid);
        *per_sample.entry(i).or_default() += 1;
        if f[2].starts_with('Z') {
            let first = *zombie_since.entry(pid).or_insert(i);
            if i >= first + 2 {
                lasting.push(pid);
            }
        }
    }
    let most = per_sample.values().copied().max().unwrap_or(0);

    delete_policy(admin, &policy).await;
    kubectl(&["delete", "clusterrolebinding", &account]);
    kubectl(&["delete", "serviceaccount", &account, "-n", "default"]);
    // The later scenarios run on the chart's values as before.
    release.upgrade(
        published,
        &[
            "--set",
            "host.plugins.hostRoot=false",
            "--wait",
            "--timeout",
            "5m",
        ],
    );
    assert!(
        !seen_pids.is_empty(),
        "the hanging plugin never ran from the pod:\n{samples}"
    );
    assert!(
        most <= 2 && lasting.is_empty(),
        "the timed-out plugin's processes left on the node: at most {most} at once (one run has 2), zombies that stayed {lasting:?}:\n{samples}"
    );
    rows.pass(
        "kube-npd-plugins",
        format!(
            "NPD's binary on the node and the chart's pod (helm upgrade to host.plugins.hostRoot=true, rolled in {}) run NPD's release scripts check_ntp.sh and network_problem.sh unchanged from custom-plugin-monitor.json and network-problem-monitor.json (every 5 s, their timeouts 30 s on both sides for the emulated node), and one of ours (mktemp, a here-string, fsck on PATH): with ntp.service missing {} Events and {} conditions, with it running {} and {}, all the same; a forking plugin timed out 10+ times left at most {most} processes at once on the node, no zombie",
            secs(rolled),
            down.0.0.len(),
            down.0.1.len(),
            up.0.0.len(),
            up.0.1.len()
        ),
    );
}

/// `s` as a shell word that cannot be misread: `"$(echo … | base64 -d)"`.
fn b64_quote(s: &str) -> String {
    use base64::Engine as _;
    format!(
        "\"$(echo {} | base64 -d)\"",
        base64::engine::general_purpose::STANDARD.encode(s)
    )
}
