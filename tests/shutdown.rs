//! Graceful shutdown end to end against a real dbus-daemon with a logind
//! peer, and the real control plane (the controller manager's disruption
//! controller computes the PDB): condition and taint within 1 s, groups
//! in order, a PDB-protected pod escalated with an Event naming the PDB,
//! the inhibitor released in time; cancel; logind restarts; a logind
//! limit shorter than the policy needs; policy edits during a shutdown.

mod support;

use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use nodeguard::policy::NodeGuardPolicy;
use support::dbus::{LogindPeer, PrivateBus};
use support::pods::{
    PodsInThreeGroups, delete_pdb, ensure_priority_class, kubelet_sim, pods_in_three_groups,
    running_pod, running_pod_with,
};
use support::*;

/// The policy's spec: `groups`, nodeguard's drop-in going to `drop_in`
/// (`None`: writing a drop-in is disabled).
fn shutdown_spec(
    node: &str,
    drop_in: Option<&std::path::Path>,
    groups: serde_json::Value,
) -> serde_json::Value {
    let drop_in = drop_in.map(|d| d.display().to_string()).unwrap_or_default();
    serde_json::json!({
        "nodeSelector": selecting(node),
        "shutdown": {"gracePeriodByPriority": groups, "logindDropInDir": drop_in,
                     "safetyMarginSeconds": 2, "escalateAfterPercent": 50},
    })
}

fn node_has(node: &Node, condition: &str, status: &str) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| {
            cs.iter()
                .any(|c| c.type_ == condition && c.status == status)
        })
}

fn tainted(node: &Node) -> bool {
    has_taint(node, "nodeguard.io/shutdown")
}

async fn events_for(node: &str) -> String {
    kubectl(&["events", "-A", "--for", &format!("node/{node}")])
}

/// When the API server finished storing the Event of `reason` about
/// `node` (its audit log's ResponseComplete for the create).
async fn event_created_at(admin: &Client, node: &str, reason: &str) -> jiff::Timestamp {
    let name = node_event(admin, node, reason)
        .await
        .and_then(|e| e.metadata.name)
        .unwrap_or_else(|| panic!("no {reason} Event about {node}"));
    let mut at = None;
    eventually(
        Duration::from_secs(5),
        "the Event's create in the audit log",
        || {
            at = audit_completed(&[&name])
                .into_iter()
                .find(|e| {
                    e["verb"] == "create"
                        && e["objectRef"]["resource"] == "events"
                        && e["objectRef"]["name"] == name.as_str()
                })
                .and_then(|e| e["stageTimestamp"].as_str()?.parse().ok());
            std::future::ready(at.is_some())
        },
    )
    .await;
    at.unwrap()
}

/// `ShutdownInhibitorReleased` was stored before the test's logind saw the
/// delay inhibitor let go; how long before.
async fn release_event_stored_first(s: &Setup) -> jiff::SignedDuration {
    let released_at = jiff::Timestamp::try_from(
        s.peer
            .delay_released_at()
            .expect("logind saw the inhibitor let go"),
    )
    .unwrap();
    let created = event_created_at(&s.admin, &s.node.name, "ShutdownInhibitorReleased").await;
    assert!(
        created <= released_at,
        "ShutdownInhibitorReleased stored at {created}, after logind was let go at {released_at}"
    );
    released_at.duration_since(created)
}

struct Setup {
    admin: Client,
    node: TestNode,
    bus: PrivateBus,
    peer: LogindPeer,
    drop_in: TempDir,
    policy: String,
}

async fn setup(prefix: &str, logind_delay: Duration, groups: serde_json::Value) -> Setup {
    setup_with(prefix, logind_delay, groups, true).await
}

/// `raise`: the policy may write a drop-in that raises logind's delay.
async fn setup_with(
    prefix: &str,
    logind_delay: Duration,
    groups: serde_json::Value,
    raise: bool,
) -> Setup {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, prefix).await;
    let bus = PrivateBus::start();
    let drop_in = TempDir::new("logind.conf.d");
    let peer = LogindPeer::start(&bus.address, logind_delay, Some(&drop_in.path)).await;
    let policy = unique_name("shutdown");
    apply_policy(
        &admin,
        &policy,
        shutdown_spec(&node.name, raise.then_some(drop_in.path.as_path()), groups),
    )
    .await;
    Setup {
        admin,
        node,
        bus,
        peer,
        drop_in,
        policy,
    }
}

impl Setup {
    async fn start_agent(&self) -> (nodeguard::agent::RunningAgent, TempDir) {
        let address = self.bus.address.clone();
        start_agent_with(self.admin.clone(), &self.node.name, move |c| {
            c.system_bus_address = Some(address);
            c.boot_id = "test-boot".into();
        })
        .await
    }

    /// The agent, once it holds its delay inhibitor.
    async fn start_armed(&self) -> (nodeguard::agent::RunningAgent, TempDir) {
        let started = self.start_agent().await;
        eventually(Duration::from_secs(15), "inhibitor taken", || {
            std::future::ready(self.peer.held() == 1)
        })
        .await;
        started
    }

    /// A running pod of priority 0 on the node (class `nodeguard-test-low`),
    /// named from `prefix`. No kubelet here: evicted, it stays, terminating,
    /// so its group takes its whole window.
    async fn low_pod(&self, prefix: &str, labels: serde_json::Value) -> String {
        ensure_priority_class(&self.admin, "nodeguard-test-low", 0).await;
        let name = unique_name(prefix);
        running_pod(
            &self.admin,
            &self.node.name,
            &name,
            "nodeguard-test-low",
            labels,
        )
        .await;
        name
    }

    /// The node's `reason` Event, waited for up to `within`; the panic
    /// lists the node's Events.
    async fn event_within(
        &self,
        within: Duration,
        reason: &str,
        what: &str,
    ) -> k8s_openapi::api::events::v1::Event {
        let deadline = Instant::now() + within;
        loop {
            if let Some(e) = node_event(&self.admin, &self.node.name, reason).await {
                return e;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: no {reason} within {within:?}:\n{}",
                events_for(&self.node.name).await
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Waits until an agent process working from `record_path` has
    /// recorded the shutdown's end and logind holds no lock of it.
    async fn finished_and_released(&self, record_path: &std::path::Path, who: &str) {
        eventually(
            Duration::from_secs(20),
            &format!("{who} finished the shutdown and released the lock"),
            || async {
                self.peer.held() == 0
                    && try_read_record(record_path).is_some_and(|r| !r["endedAt"].is_null())
            },
        )
        .await;
    }

    /// The reboot: logind restarted, knowing no shutdown, then an agent of
    /// the next boot on the state the processes before it kept.
    async fn agent_after_reboot(
        &mut self,
        state_dir: &std::path::Path,
    ) -> (nodeguard::agent::RunningAgent, TempDir) {
        self.peer.kill().await;
        self.peer.come_back().await;
        let state_dir = state_dir.to_path_buf();
        let address = self.bus.address.clone();
        start_agent_with(self.admin.clone(), &self.node.name, move |c| {
            c.system_bus_address = Some(address);
            c.boot_id = "the-next-boot".into();
            c.state_dir = state_dir;
        })
        .await
    }

    async fn cleanup(self) {
        let api: Api<NodeGuardPolicy> = Api::all(self.admin.clone());
        let _ = api.delete(&self.policy, &DeleteParams::default()).await;
    }
}

#[tokio::test]
async fn poweroff_evicts_by_priority_honours_the_pdb_and_releases_in_time() {
    let s = setup(
        "poweroff",
        Duration::from_secs(5),
        serde_json::json!([
            {"priority": 0, "gracePeriodSeconds": 4},
            {"priority": 1000, "gracePeriodSeconds": 6},
            {"priority": 2000000000, "gracePeriodSeconds": 3},
        ]),
    )
    .await;
    let PodsInThreeGroups {
        low,
        mid,
        high,
        pdb: pdb_name,
    } = pods_in_three_groups(&s.admin, &s.node.name).await;
    // In the first group too: one pod tolerating the shutdown taint by its
    // value (left alone, as the scheduler would let it stay), one whose
    // toleration names another value (terminated with its group).
    let (tolerating, other_value) = (unique_name("tolerating"), unique_name("other-value"));
    for (name, value) in [
        (&tolerating, "shutting-down"),
        (&other_value, "maintenance"),
    ] {
        running_pod_with(
            &s.admin,
            &s.node.name,
            name,
            "nodeguard-test-low",
            serde_json::json!({"app": "low"}),
            serde_json::json!({"tolerations": [
                {"key": "nodeguard.io/shutdown", "operator": "Equal", "value": value, "effect": "NoSchedule"}]}),
        )
        .await;
    }

    let (sim_marked, sim) = kubelet_sim(s.admin.clone(), s.node.name.clone());
    let (agent, _state) = s.start_agent().await;

    // logind allowed 5 s; the policy needs 13 + 2 s: drop-in, reload, read back.
    eventually(
        Duration::from_secs(20),
        "inhibitor taken after raising the delay",
        || std::future::ready(s.peer.held() == 1),
    )
    .await;
    let drop_in =
        std::fs::read_to_string(s.drop_in.path.join("99-nodeguard-inhibit-delay.conf")).unwrap();
    assert!(drop_in.contains("InhibitDelayMaxSec=15"), "{drop_in}");
    assert_eq!(
        s.peer.state.lock().unwrap().delay_max_usec,
        15_000_000,
        "logind reloaded"
    );
    assert_eq!(
        s.peer.inhibitor_modes(),
        vec![(
            "shutdown".to_string(),
            "nodeguard".to_string(),
            "delay".to_string()
        )]
    );
    let nodes: Api<Node> = Api::all(s.admin.clone());
    eventually(
        Duration::from_secs(10),
        "GracefulShutdownUnavailable=False",
        || async {
            node_has(
                &nodes.get(&s.node.name).await.unwrap(),
                "GracefulShutdownUnavailable",
                "False",
            )
        },
    )
    .await;
    // Pods must be in the agent's view before the signal.
    agent_sees_pods(&agent, 5).await;

    // Timestamp the Node's versions as the API server sends them (a watch),
    // rather than by polling, so the measurement adds no load or delay.
    let (seen_tx, mut seen_rx) = tokio::sync::mpsc::unbounded_channel();
    let watch_nodes: Api<Node> = Api::all(s.admin.clone());
    let node_name = s.node.name.clone();
    let (listed_tx, listed_rx) = tokio::sync::oneshot::channel();
    let watching = tokio::spawn(async move {
        let cfg = watcher::Config::default().fields(&format!("metadata.name={node_name}"));
        let mut stream = watcher(watch_nodes, cfg).applied_objects().boxed();
        let mut listed = Some(listed_tx);
        while let Some(Ok(n)) = stream.next().await {
            if let Some(tx) = listed.take() {
                let _ = tx.send(());
            }
            if node_has(&n, "GracefulShutdown", "True") && tainted(&n) {
                let _ = seen_tx.send(Instant::now());
                return;
            }
        }
    });
    // The watch is established once it has delivered the Node.
    tokio::time::timeout(Duration::from_secs(10), listed_rx)
        .await
        .expect("the Node watch delivers the Node")
        .expect("watch ran");
    let t0 = Instant::now();
    s.peer.prepare_for_shutdown(true).await;
    let seen = tokio::time::timeout(Duration::from_secs(5), seen_rx.recv())
        .await
        .expect("condition and taint appear")
        .expect("watch ran");
    watching.abort();
    let seen_at = seen - t0;
    // Usually about 50 ms (bench/RESULTS.md). The bound is 1 s: with the
    // binary's other tests beside it on 2 cores, `make test` once measured
    // 305 ms. What it guards is "at once", before any group's evictions
    // (seconds), not the latency figure.
    assert!(
        seen_at <= Duration::from_secs(1),
        "condition and taint took {seen_at:?} (at most 1 s)"
    );
    eprintln!("condition and taint visible {seen_at:?} after PrepareForShutdown");

    eventually(Duration::from_secs(14), "inhibitor released", || {
        std::future::ready(s.peer.held() == 0)
    })
    .await;
    let released = t0.elapsed();
    eprintln!("inhibitor released {released:?} after PrepareForShutdown");
    assert!(
        released < Duration::from_secs(13),
        "before the window (15 s - 2 s margin) closed"
    );

    let marked = sim_marked.lock().unwrap().clone();
    let at = |n: &str| {
        *marked
            .get(n)
            .unwrap_or_else(|| panic!("{n} was never terminated: {marked:?}"))
            - t0
    };
    let (t_low, t_mid, t_high) = (at(&low), at(&mid), at(&high));
    eprintln!("terminated: low {t_low:?}, mid (PDB) {t_mid:?}, critical {t_high:?}");
    assert!(t_low < t_mid && t_mid < t_high, "groups in order");
    assert!(
        at(&other_value) < t_mid,
        "a toleration of another value does not tolerate the taint"
    );
    assert!(
        !marked.contains_key(&tolerating),
        "the pod tolerating the taint was left alone: {marked:?}"
    );
    // Escalated at 50 % of its 6 s window, which opened when the low pod was gone.
    assert!(
        t_mid >= t_low + Duration::from_millis(2_500),
        "the PDB held the pod for a while: {t_mid:?}"
    );
    let complete = |events: &str| {
        events.contains("ShutdownStarted")
            && events.contains("ShutdownInhibitorReleased")
            && events
                .lines()
                .any(|l| l.contains("EvictionEscalated") && l.contains(&pdb_name))
            && [
                "Priority group 0 done",
                "Priority group 1000 done",
                "Priority group 2000000000 done",
            ]
            .iter()
            .all(|g| events.contains(g))
    };
    eventually(
        Duration::from_secs(10),
        "the shutdown's Events on the node",
        || async { complete(&events_for(&s.node.name).await) },
    )
    .await;
    eprintln!("{}", events_for(&s.node.name).await);
    // The last word reaches the API server while the lock still holds the
    // host: once logind goes on, the network may go down (kube-reboot lost
    // this Event once, its publish racing the reboot).
    eprintln!(
        "ShutdownInhibitorReleased stored {:?} before logind was let go",
        release_event_stored_first(&s).await
    );
    let (_, metrics) = http_get(agent.addr, "/metrics").await;
    assert!(
        metrics.contains("nodeguard_shutdown_pods_total{group=\"1000\",outcome=\"escalated\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("nodeguard_shutdown_pods_total{group=\"0\",outcome=\"evicted\"} 2"),
        "the low pod and the one tolerating another value: {metrics}"
    );
    assert!(metrics.contains("nodeguard_shutdown_inhibitor_held 0"));

    sim.abort();
    agent.stop().await;
    delete_pdb(&s.admin, &pdb_name).await;
    force_delete(&s.admin, &[&tolerating]).await;
    s.cleanup().await;
}

/// Review of the release's Event: when the groups take the whole window
/// (a pod that does not go), the release comes as the window closes and
/// the Event was not waited for at all, published after logind was let go.
/// It is stored before the release, within the safety margin that is left.
#[tokio::test]
async fn the_release_event_is_stored_first_also_when_the_window_closes() {
    // logind allows 5 s; the policy needs 4 + 2: raised to exactly 6 s, so
    // the group's window ends where the release must come.
    let s = setup(
        "window-closes",
        Duration::from_secs(5),
        serde_json::json!([{"priority": 0, "gracePeriodSeconds": 4}]),
    )
    .await;
    // No kubelet: the evicted pod stays, terminating, past the window.
    let low = s.low_pod("stays", serde_json::json!({})).await;
    let (agent, _state) = s.start_armed().await;
    agent_sees_pods(&agent, 1).await;
    s.peer.prepare_for_shutdown(true).await;
    let t0 = Instant::now();
    eventually(Duration::from_secs(12), "inhibitor released", || {
        std::future::ready(s.peer.held() == 0)
    })
    .await;
    assert!(
        t0.elapsed() >= Duration::from_millis(3_900),
        "released {:?} after PrepareForShutdown: the group's 4 s window was used up",
        t0.elapsed()
    );
    release_event_stored_first(&s).await;
    agent.stop().await;
    force_delete(&s.admin, &[&low]).await;
    s.cleanup().await;
}

#[tokio::test]
async fn a_cancelled_shutdown_restores_the_node() {
    let s = setup(
        "cancel",
        Duration::from_secs(60),
        serde_json::json!([{"priority": 0, "gracePeriodSeconds": 20}]),
    )
    .await;
    let (agent, _state) = s.start_armed().await;
    let nodes: Api<Node> = Api::all(s.admin.clone());
    s.peer.prepare_for_shutdown(true).await;
    eventually(
        Duration::from_secs(2),
        "tainted and GracefulShutdown=True",
        || async {
            let n = nodes.get(&s.node.name).await.unwrap();
            tainted(&n) && node_has(&n, "GracefulShutdown", "True")
        },
    )
    .await;
    // An operator's own taint must survive the cancel. (Read-modify-write
    // as kubectl does: the agent writes the Node meanwhile, so a 409 means
    // read again.)
    for attempt in 1.. {
        let mut n = nodes.get(&s.node.name).await.unwrap();
        n.spec.as_mut().unwrap().taints.as_mut().unwrap().push(
            serde_json::from_value(
                serde_json::json!({"key": "example.com/mine", "effect": "NoSchedule"}),
            )
            .unwrap(),
        );
        match nodes
            .replace(&s.node.name, &PostParams::default(), &n)
            .await
        {
            Ok(_) => break,
            Err(kube::Error::Api(e)) if e.code == 409 && attempt < 10 => continue,
            Err(e) => panic!("cannot add the operator's taint: {e}"),
        }
    }
    s.peer.prepare_for_shutdown(false).await;
    eventually(Duration::from_secs(5), "restored", || async {
        let n = nodes.get(&s.node.name).await.unwrap();
        let cancelled = n
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| {
                cs.iter().any(|c| {
                    c.type_ == "GracefulShutdown"
                        && c.status == "False"
                        && c.reason.as_deref() == Some("ShutdownCancelled")
                })
            });
        !tainted(&n) && cancelled
    })
    .await;
    let n = nodes.get(&s.node.name).await.unwrap();
    let keys: Vec<String> = n
        .spec
        .unwrap()
        .taints
        .unwrap_or_default()
        .into_iter()
        .map(|t| t.key)
        .collect();
    assert!(keys.contains(&"example.com/mine".to_string()), "{keys:?}");
    let reason = n
        .status
        .unwrap()
        .conditions
        .unwrap()
        .into_iter()
        .find(|c| c.type_ == "GracefulShutdown")
        .unwrap()
        .reason;
    assert_eq!(reason.as_deref(), Some("ShutdownCancelled"));
    eventually(Duration::from_secs(2), "lock held again", || {
        std::future::ready(s.peer.held() == 1)
    })
    .await;
    assert!(events_for(&s.node.name).await.contains("ShutdownCancelled"));
    agent.stop().await;
    s.cleanup().await;
}

#[tokio::test]
async fn the_lock_is_retaken_within_2s_after_logind_restarts() {
    let mut s = setup(
        "relogind",
        Duration::from_secs(60),
        serde_json::json!([{"priority": 0, "gracePeriodSeconds": 10}]),
    )
    .await;
    let (agent, _state) = s.start_armed().await;
    s.peer.kill().await;
    let nodes: Api<Node> = Api::all(s.admin.clone());
    eventually(
        Duration::from_secs(10),
        "the agent reports logind unavailable",
        || async {
            node_has(
                &nodes.get(&s.node.name).await.unwrap(),
                "GracefulShutdownUnavailable",
                "True",
            )
        },
    )
    .await;
    let back = Instant::now();
    s.peer.come_back().await;
    eventually(
        Duration::from_secs(2),
        "lock re-taken within 2 s of logind's return",
        || std::future::ready(s.peer.held() == 1),
    )
    .await;
    eprintln!("lock re-taken {:?} after logind came back", back.elapsed());
    agent.stop().await;
    assert_eq!(s.peer.held(), 0, "released when the agent stops");
    s.cleanup().await;
}

/// systemd-logind restarted during the delay forgets the shutdown it was
/// delaying (it keeps no record of it, as the node VM's scenario
/// logind-restart shows): the host stays up. The agent must not go on
/// emptying a node that is not going down: it undoes the shutdown as after
/// a cancel and holds a lock from the new logind.
#[tokio::test]
async fn a_logind_restart_during_a_shutdown_undoes_it_when_the_new_logind_forgot_it() {
    let mut s = setup(
        "relogind-mid",
        Duration::from_secs(60),
        serde_json::json!([
            {"priority": 0, "gracePeriodSeconds": 12},
            {"priority": 1000, "gracePeriodSeconds": 6},
        ]),
    )
    .await;
    ensure_priority_class(&s.admin, "nodeguard-test-low", 0).await;
    ensure_priority_class(&s.admin, "nodeguard-test-mid", 1000).await;
    let (low, mid) = (unique_name("low"), unique_name("mid"));
    // No kubelet: the evicted low pod stays (terminating) for its window.
    for (name, class) in [(&low, "nodeguard-test-low"), (&mid, "nodeguard-test-mid")] {
        running_pod(&s.admin, &s.node.name, name, class, serde_json::json!({})).await;
    }
    let (agent, _state) = s.start_armed().await;
    agent_sees_pods(&agent, 2).await;
    let pods: Api<Pod> = Api::namespaced(s.admin.clone(), TEST_NAMESPACE);
    let nodes: Api<Node> = Api::all(s.admin.clone());
    s.peer.prepare_for_shutdown(true).await;
    let t0 = Instant::now();
    eventually(
        Duration::from_secs(5),
        "tainted, the low pod evicted",
        || async {
            tainted(&nodes.get(&s.node.name).await.unwrap())
                && pods
                    .get(&low)
                    .await
                    .unwrap()
                    .metadata
                    .deletion_timestamp
                    .is_some()
        },
    )
    .await;
    s.peer.kill().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    s.peer.come_back().await;
    let restarted = t0.elapsed();
    eventually(
        Duration::from_secs(5),
        "the taint removed, GracefulShutdown=False (ShutdownCancelled) naming logind's restart",
        || async {
            let n = nodes.get(&s.node.name).await.unwrap();
            let c = condition_of(&nodes, &s.node.name, "GracefulShutdown").await;
            !tainted(&n)
                && c.is_some_and(|(status, reason, message)| {
                    status == "False"
                        && reason == "ShutdownCancelled"
                        && message.contains("systemd-logind restarted during it")
                })
        },
    )
    .await;
    let undone = t0.elapsed();
    eventually(
        Duration::from_secs(2),
        "a lock held from the new logind",
        || std::future::ready(s.peer.held() == 1),
    )
    .await;
    // Past the low group's 12 s window: the mid pod stays.
    tokio::time::sleep_until((t0 + Duration::from_secs(14)).into()).await;
    assert!(
        pods.get(&mid)
            .await
            .unwrap()
            .metadata
            .deletion_timestamp
            .is_none(),
        "the mid pod was evicted after logind's restart had cancelled the shutdown"
    );
    assert_eq!(s.peer.held(), 1);
    let events = events_for(&s.node.name).await;
    assert!(
        events
            .lines()
            .any(|l| l.contains("ShutdownCancelled") && l.contains("restarted")),
        "{events}"
    );
    eprintln!("logind restarted {restarted:?} into the shutdown; undone at {undone:?}");
    agent.stop().await;
    force_delete(&s.admin, &[&low, &mid]).await;
    s.cleanup().await;
}

/// The Node's condition `type_` as (status, reason, message).
async fn condition_of(
    nodes: &Api<Node>,
    node: &str,
    type_: &str,
) -> Option<(String, String, String)> {
    let n = nodes.get(node).await.unwrap();
    n.status
        .and_then(|s| s.conditions)
        .unwrap_or_default()
        .into_iter()
        .find(|c| c.type_ == type_)
        .map(|c| {
            (
                c.status,
                c.reason.unwrap_or_default(),
                c.message.unwrap_or_default(),
            )
        })
}

/// The `why` of the inhibitors the logind peer holds.
fn held_whys(peer: &LogindPeer) -> Vec<String> {
    peer.state
        .lock()
        .unwrap()
        .inhibitors
        .iter()
        .filter(|i| !i.released())
        .map(|i| i.why.clone())
        .collect()
}

/// Removes test pods that no kubelet will finish terminating.
async fn force_delete(client: &Client, names: &[&str]) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), TEST_NAMESPACE);
    for n in names {
        let _ = pods
            .delete(n, &DeleteParams::default().grace_period(0))
            .await;
    }
}

/// Issue 15, item 7: logind allows 5 s, the policy needs 12 s and may not
/// write a drop-in. GracefulShutdown was never written; now it says why.
#[tokio::test]
async fn a_too_short_inhibit_delay_is_reported_on_graceful_shutdown() {
    let s = setup_with(
        "shortdelay",
        Duration::from_secs(5),
        serde_json::json!([
            {"priority": 0, "gracePeriodSeconds": 4},
            {"priority": 2000000000, "gracePeriodSeconds": 6},
        ]),
        false,
    )
    .await;
    let (agent, _state) = s.start_armed().await;
    let nodes: Api<Node> = Api::all(s.admin.clone());
    eventually(
        Duration::from_secs(10),
        "GracefulShutdown=False (InhibitDelayTooShort)",
        || async {
            condition_of(&nodes, &s.node.name, "GracefulShutdown")
                .await
                .is_some_and(|(st, reason, _)| st == "False" && reason == "InhibitDelayTooShort")
        },
    )
    .await;
    let (_, _, message) = condition_of(&nodes, &s.node.name, "GracefulShutdown")
        .await
        .unwrap();
    assert_eq!(
        message,
        "No shutdown in progress. logind allows 5s of delay but the policy needs 12s: a shutdown would get 3s, lowest-priority groups shortened first (priority: window 0: 0s of 4s, 2000000000: 3s of 6s)."
    );
    let (status, reason, _) = condition_of(&nodes, &s.node.name, "GracefulShutdownUnavailable")
        .await
        .unwrap();
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("True", "InhibitDelayTooShort")
    );
    agent.stop().await;
    s.cleanup().await;
}

/// Issue 15, item 12: logind allows 8 s (6 s after the margin) for groups
/// that need 10 + 4 s. The critical group keeps its 4 s; the low group gets
/// the 2 s left and its pod is asked for 2 s, not 10. Neither pod leaves
/// (no kubelet finishes them), so each group takes its whole window.
#[tokio::test]
async fn a_short_window_keeps_the_critical_groups_time_and_clips_pod_grace() {
    let s = setup_with(
        "shortwindow",
        Duration::from_secs(8),
        serde_json::json!([
            {"priority": 0, "gracePeriodSeconds": 10},
            {"priority": 2000000000, "gracePeriodSeconds": 4},
        ]),
        false,
    )
    .await;
    ensure_priority_class(&s.admin, "nodeguard-test-low", 0).await;
    let (low, critical) = (unique_name("low"), unique_name("critical"));
    running_pod(
        &s.admin,
        &s.node.name,
        &low,
        "nodeguard-test-low",
        serde_json::json!({"app": "low"}),
    )
    .await;
    running_pod(
        &s.admin,
        &s.node.name,
        &critical,
        "system-node-critical",
        serde_json::json!({"app": "high"}),
    )
    .await;

    // When each pod was marked for deletion, and with what grace.
    let marked = std::sync::Arc::new(std::sync::Mutex::new(std::collections::BTreeMap::new()));
    let m = marked.clone();
    let pods_api: Api<Pod> = Api::all(s.admin.clone());
    let node_name = s.node.name.clone();
    let (listed_tx, listed_rx) = tokio::sync::oneshot::channel();
    let watching = tokio::spawn(async move {
        let cfg = watcher::Config::default().fields(&format!("spec.nodeName={node_name}"));
        let mut stream = watcher(pods_api, cfg).applied_objects().boxed();
        let mut listed = Some(listed_tx);
        while let Some(Ok(p)) = stream.next().await {
            if let Some(tx) = listed.take() {
                let _ = tx.send(());
            }
            if p.metadata.deletion_timestamp.is_some() {
                m.lock()
                    .unwrap()
                    .entry(p.metadata.name.clone().unwrap())
                    .or_insert((Instant::now(), p.metadata.deletion_grace_period_seconds));
            }
        }
    });
    tokio::time::timeout(Duration::from_secs(10), listed_rx)
        .await
        .expect("the pod watch delivers the pods")
        .expect("watch ran");

    let (agent, _state) = s.start_armed().await;
    agent_sees_pods(&agent, 2).await;
    let t0 = Instant::now();
    s.peer.prepare_for_shutdown(true).await;
    eventually(Duration::from_secs(15), "inhibitor released", || {
        std::future::ready(s.peer.held() == 0)
    })
    .await;
    let released = t0.elapsed();
    eventually(
        Duration::from_secs(5),
        "both pods marked for deletion",
        || std::future::ready(marked.lock().unwrap().len() == 2),
    )
    .await;
    watching.abort();
    let marked = marked.lock().unwrap().clone();
    let (t_low, grace_low) = marked[&low];
    let (t_critical, grace_critical) = marked[&critical];
    eprintln!(
        "low marked {:?} (grace {grace_low:?}), critical {:?} (grace {grace_critical:?}), released {released:?} after PrepareForShutdown",
        t_low - t0,
        t_critical - t0
    );
    // What is left of its 2 s window when it is evicted, to the nearest
    // second: the groups first wait (up to 1 s) for the taint's answer,
    // which under a loaded `make test` took 0.6 s once (grace 1). Never its
    // own 10 s.
    assert!(
        matches!(grace_low, Some(1) | Some(2)),
        "the low pod's grace is its group's shortened window: {grace_low:?}"
    );
    assert_eq!(
        grace_critical,
        Some(4),
        "the critical group keeps its full window"
    );
    assert!(
        t_critical >= t0 + Duration::from_millis(1_900),
        "the critical group opened when the low group's 2 s were over"
    );
    assert!(
        released >= Duration::from_millis(5_900),
        "the critical pods had their 4 s before the release ({released:?})"
    );
    agent.stop().await;
    force_delete(&s.admin, &[&low, &critical]).await;
    s.cleanup().await;
}

/// Issue 15, item 7: the policy is deleted while a shutdown runs. The
/// shutdown goes on; after the cancel nodeguard does not take the
/// inhibitor again and gives up its conditions (before, the change was
/// lost and the old policy re-armed).
#[tokio::test]
async fn shutdown_turned_off_during_a_shutdown_is_not_re_armed_after_the_cancel() {
    let s = setup(
        "offmidway",
        Duration::from_secs(60),
        serde_json::json!([{"priority": 0, "gracePeriodSeconds": 30}]),
    )
    .await;
    let slow = s.low_pod("slow", serde_json::json!({"app": "slow"})).await;
    let (agent, _state) = s.start_armed().await;
    agent_sees_pods(&agent, 1).await;
    let nodes: Api<Node> = Api::all(s.admin.clone());
    s.peer.prepare_for_shutdown(true).await;
    eventually(Duration::from_secs(5), "GracefulShutdown=True", || async {
        node_has(
            &nodes.get(&s.node.name).await.unwrap(),
            "GracefulShutdown",
            "True",
        )
    })
    .await;
    let policies: Api<NodeGuardPolicy> = Api::all(s.admin.clone());
    policies
        .delete(&s.policy, &DeleteParams::default())
        .await
        .unwrap();
    // The agent saw the deletion (it hands the selection to the shutdown
    // manager before it annotates the Node).
    eventually(
        Duration::from_secs(10),
        "no effective policy on the node",
        || async {
            !effective_policies(&s.admin, &s.node.name)
                .await
                .unwrap_or_default()
                .contains(&s.policy)
        },
    )
    .await;
    s.peer.prepare_for_shutdown(false).await;
    eventually(
        Duration::from_secs(10),
        "GracefulShutdown removed",
        || async {
            condition_of(&nodes, &s.node.name, "GracefulShutdown")
                .await
                .is_none()
        },
    )
    .await;
    assert_eq!(s.peer.held(), 0, "no inhibitor for a policy that is gone");
    assert_eq!(
        s.peer.state.lock().unwrap().inhibitors.len(),
        1,
        "taken once"
    );
    assert!(!tainted(&nodes.get(&s.node.name).await.unwrap()));
    eventually(
        Duration::from_secs(10),
        "the ShutdownPolicyDeferred Event",
        || async {
            events_for(&s.node.name)
                .await
                .contains("ShutdownPolicyDeferred")
        },
    )
    .await;
    agent.stop().await;
    force_delete(&s.admin, &[&slow]).await;
    s.cleanup().await;
}

/// Issue 15, item 7: an edit during a shutdown is applied after it: the
/// inhibitor is taken again for the edited policy.
#[tokio::test]
async fn a_policy_edit_during_a_shutdown_applies_after_the_cancel() {
    policy_edit_during_a_shutdown_case(12).await;
}

/// An edit during a shutdown that needs more than logind's delay: after the
/// cancel the agent wrote the drop-in, made logind reload and polled for up
/// to 2 s before it took its inhibitor again, so a reboot asked for in that
/// gap got no delay. The inhibitor is now held when logind reloads.
#[tokio::test]
async fn after_a_cancel_the_inhibitor_is_held_before_logind_reloads_for_an_edit() {
    policy_edit_during_a_shutdown_case(90).await;
}

async fn policy_edit_during_a_shutdown_case(edited_grace: u64) {
    let s = setup(
        "editmidway",
        Duration::from_secs(60),
        serde_json::json!([{"priority": 0, "gracePeriodSeconds": 30}]),
    )
    .await;
    let (agent, _state) = s.start_armed().await;
    assert_eq!(
        held_whys(&s.peer),
        vec!["nodeguard moves pods off the node in 1 priority group(s) within 30s".to_string()]
    );
    let nodes: Api<Node> = Api::all(s.admin.clone());
    s.peer.prepare_for_shutdown(true).await;
    eventually(Duration::from_secs(5), "GracefulShutdown=True", || async {
        node_has(
            &nodes.get(&s.node.name).await.unwrap(),
            "GracefulShutdown",
            "True",
        )
    })
    .await;
    apply_policy(
        &s.admin,
        &s.policy,
        shutdown_spec(
            &s.node.name,
            Some(&s.drop_in.path),
            serde_json::json!([{"priority": 0, "gracePeriodSeconds": edited_grace}]),
        ),
    )
    .await;
    eventually(
        Duration::from_secs(10),
        "the edit is in force on the node",
        || async {
            effective_policies(&s.admin, &s.node.name)
                .await
                .unwrap_or_default()
                .contains(&format!("{}@2", s.policy))
        },
    )
    .await;
    s.peer.prepare_for_shutdown(false).await;
    eventually(
        Duration::from_secs(10),
        "the inhibitor taken for the edited policy",
        || {
            std::future::ready(
                held_whys(&s.peer)
                    == vec![format!(
                        "nodeguard moves pods off the node in 1 priority group(s) within {edited_grace}s"
                    )],
            )
        },
    )
    .await;
    let within = format!("within {edited_grace}s");
    eventually(
        Duration::from_secs(10),
        "GracefulShutdownUnavailable says the edited window",
        || async {
            condition_of(&nodes, &s.node.name, "GracefulShutdownUnavailable")
                .await
                .is_some_and(|(st, _, message)| st == "False" && message.contains(&within))
        },
    )
    .await;
    let held_at_reloads = s.peer.state.lock().unwrap().held_at_reloads.clone();
    if edited_grace > 60 {
        // The edit needs more than logind's 60 s: one reload, after the
        // cancel, with the inhibitor held.
        assert_eq!(
            held_at_reloads.last(),
            Some(&1),
            "inhibitors held at logind's reloads: {held_at_reloads:?}"
        );
    }
    agent.stop().await;
    s.cleanup().await;
}

/// Found on the real node (the agent's pod deleted after the first group
/// left the other groups on the node): asked to stop during a shutdown,
/// the agent finishes it first. And an agent started again while logind
/// still prepares for that shutdown (the DaemonSet's replacement, or
/// `systemctl restart`) keeps nodeguard's taint and the record for the
/// next boot instead of taking it for a cancel.
#[tokio::test]
async fn a_stop_during_a_shutdown_waits_for_its_groups_and_a_restart_keeps_the_taint() {
    let s = setup(
        "stop-deferred",
        Duration::from_secs(60),
        serde_json::json!([{"priority": 0, "gracePeriodSeconds": 6}]),
    )
    .await;
    // No kubelet: the evicted pod stays, so the group takes its 6 s window.
    let low = s.low_pod("low", serde_json::json!({"app": "low"})).await;
    let (agent, state) = s.start_armed().await;
    // The agent knows the pod before the signal (else its plan is empty).
    let key = format!("{TEST_NAMESPACE}/{low}");
    eventually(
        Duration::from_secs(15),
        "the pod in the agent's watch",
        || {
            std::future::ready(
                agent
                    .pods
                    .borrow()
                    .as_ref()
                    .is_some_and(|p| p.contains_key(&key)),
            )
        },
    )
    .await;
    let nodes: Api<Node> = Api::all(s.admin.clone());
    s.peer.prepare_for_shutdown(true).await;
    eventually(Duration::from_secs(2), "tainted", || async {
        tainted(&nodes.get(&s.node.name).await.unwrap())
    })
    .await;
    let t0 = Instant::now();
    // SIGTERM, as the kubelet sends it for a deleted pod.
    let (never_tx, never) = tokio::sync::oneshot::channel::<()>();
    let stopping = tokio::spawn(agent.stop_after_node_shutdown(async {
        let _ = never.await;
    }));
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        s.peer.held(),
        1,
        "the inhibitor is held while the group runs"
    );
    assert!(
        !stopping.is_finished(),
        "the agent stopped in the middle of the shutdown"
    );
    tokio::time::timeout(Duration::from_secs(15), stopping)
        .await
        .expect("the agent stops once the shutdown's groups are done")
        .unwrap();
    let stopped = t0.elapsed();
    assert!(
        stopped >= Duration::from_secs(4),
        "stopped {stopped:?} after the signal: before the 6 s group was over"
    );
    assert_eq!(s.peer.held(), 0, "released");
    let record: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(state.path.join("shutdown-state.json")).unwrap(),
    )
    .unwrap();
    assert!(
        !record["endedAt"].is_null(),
        "the first agent finished the shutdown: {record}"
    );
    assert!(
        events_for(&s.node.name).await.contains("StopDeferred"),
        "the deferral is an Event"
    );
    drop(never_tx);

    // The same boot, logind still preparing for the shutdown: a new agent.
    let dir = state.path.clone();
    let address = s.bus.address.clone();
    let (again, _state2) = start_agent_with(s.admin.clone(), &s.node.name, move |c| {
        c.system_bus_address = Some(address);
        c.boot_id = "test-boot".into();
        c.state_dir = dir;
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let n = nodes.get(&s.node.name).await.unwrap();
    assert!(tainted(&n), "the node going down keeps nodeguard's taint");
    assert!(
        !node_has(&n, "GracefulShutdown", "False"),
        "no reboot or cancel reported on the boot that is going down"
    );
    assert!(
        state.path.join("shutdown-state.json").exists(),
        "the record stays for the next boot's report"
    );
    assert_eq!(
        s.peer.held(),
        0,
        "no lock: logind refuses one during its shutdown"
    );
    again.stop().await;
    force_delete(&s.admin, &[&low]).await;
    s.cleanup().await;
    eprintln!("stop deferred {stopped:?} until the 6 s group was done");
}

/// Ready means protected: the first time `/readyz` answers 200 (what the
/// host unit's READY=1 and the pod's readiness follow), the agent already
/// holds logind's delay inhibitor, after raising logind's too-short delay.
/// Before, the shutdown loop counted as synced before it armed, and CI once
/// read the node's drop-in 0.7 s before it was written.
#[tokio::test]
async fn ready_means_the_delay_inhibitor_is_held() {
    let s = setup(
        "readyarmed",
        Duration::from_secs(5),
        serde_json::json!([{"priority": 0, "gracePeriodSeconds": 10}]),
    )
    .await;
    let (agent, _state) = s.start_agent().await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while http_get(agent.addr, "/readyz").await.0 != 200 {
        assert!(Instant::now() < deadline, "never ready");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let held = s.peer.held();
    let drop_in = std::fs::read_dir(&s.drop_in.path).unwrap().count();
    agent.stop().await;
    s.cleanup().await;
    assert_eq!(held, 1, "ready before the delay inhibitor was held");
    assert_eq!(drop_in, 1, "ready before logind's delay was raised");
}

/// A graceful shutdown under way holds the release of the agent's start
/// pages (`footprint`): the shutdown runs code the start never ran, once,
/// within the inhibit window. The shipped binary; logind announces the
/// shutdown once the agent is ready; its group waits 170 s for a pod that
/// never ends (no kubelet here). No release meanwhile, though the delay (at
/// most 120 s) and a quiet time since the start have passed. Cancelled at
/// 150 s: the release follows within the quiet time (at most 60 s) and a
/// look.
#[tokio::test]
async fn the_start_pages_stay_mapped_while_a_shutdown_is_under_way() {
    use nodeguard::footprint::RELEASED;
    let s = setup(
        "pages-shutdown",
        Duration::from_secs(220),
        serde_json::json!([{"priority": 0, "gracePeriodSeconds": 170}]),
    )
    .await;
    s.low_pod("pages", serde_json::json!({})).await;
    let state = TempDir::new("pages-shutdown-state");
    let log = state.path.join("agent.log");
    // The group's 170 s and the margin, beyond the default trust's 32 s.
    let agent = AgentProcess::start_logged(
        &s,
        &state.path.join("state"),
        &["--max-inhibit-delay-seconds=300".into()],
        &log,
    );
    agent.ready().await;
    let ready_at = Instant::now();
    let logged = || std::fs::read_to_string(&log).unwrap_or_default();
    s.peer.prepare_for_shutdown(true).await;
    let nodes: Api<Node> = Api::all(s.admin.clone());
    eventually(Duration::from_secs(10), "tainted", || async {
        tainted(&nodes.get(&s.node.name).await.unwrap())
    })
    .await;
    while ready_at.elapsed() < Duration::from_secs(150) {
        assert!(
            !logged().contains(RELEASED),
            "released {:?} after ready, the shutdown under way:\n{}",
            ready_at.elapsed(),
            logged()
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    assert_eq!(
        s.peer.held(),
        1,
        "the shutdown still under way (the test's premise)"
    );
    s.peer.prepare_for_shutdown(false).await;
    let cancelled_at = Instant::now();
    eventually(
        Duration::from_secs(90),
        "the release after the cancelled shutdown",
        || std::future::ready(logged().contains(RELEASED)),
    )
    .await;
    eprintln!("released {:?} after the cancel", cancelled_at.elapsed());
    drop(agent);
    s.cleanup().await;
}

/// The state directory full when logind announces the shutdown: the
/// shutdown runs from memory (taint, groups, release in time), the failed
/// record write is one Warning naming the file, no part of a record is
/// left, and a cancel still removes the taint nodeguard added.
#[tokio::test]
async fn a_full_state_directory_neither_stops_a_shutdown_nor_leaves_its_taint() {
    let s = setup(
        "fullstate-shutdown",
        Duration::from_secs(15),
        serde_json::json!([{"priority": 0, "gracePeriodSeconds": 2}]),
    )
    .await;
    let fs = SmallFs::mount("64k");
    let dir = fs.dir.path.clone();
    let address = s.bus.address.clone();
    let (agent, _unused) = start_agent_with(s.admin.clone(), &s.node.name, move |c| {
        c.system_bus_address = Some(address);
        c.boot_id = "test-boot".into();
        c.state_dir = dir;
    })
    .await;
    eventually(Duration::from_secs(15), "inhibitor taken", || {
        std::future::ready(s.peer.held() == 1)
    })
    .await;
    let filler = fs.fill();
    let nodes: Api<Node> = Api::all(s.admin.clone());
    s.peer.prepare_for_shutdown(true).await;
    eventually(Duration::from_secs(2), "tainted", || async {
        tainted(&nodes.get(&s.node.name).await.unwrap())
    })
    .await;
    eventually(
        Duration::from_secs(10),
        "the inhibitor released after the group",
        || std::future::ready(s.peer.held() == 0),
    )
    .await;
    eventually(Duration::from_secs(10), "a StateWriteFailed Event", || {
        let (n, _) = node_event_count(&s.node.name, "StateWriteFailed");
        std::future::ready(n >= 1)
    })
    .await;
    let (n, notes) = node_event_count(&s.node.name, "StateWriteFailed");
    assert_eq!(n, 1, "{notes}");
    assert!(
        notes.contains("shutdown-state.json") && notes.contains("No space left on device"),
        "{notes}"
    );
    let left: Vec<_> = std::fs::read_dir(&fs.dir.path)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != "filler")
        .collect();
    assert!(
        left.iter().all(|n| n == "monitors"),
        "no record, and no part of one: {left:?}"
    );
    // Cancelled: the taint goes although no record of it could be written.
    s.peer.prepare_for_shutdown(false).await;
    eventually(
        Duration::from_secs(5),
        "untainted after the cancel",
        || async { !tainted(&nodes.get(&s.node.name).await.unwrap()) },
    )
    .await;
    // Clearing a record that was never written is no sign the disk works.
    let (recovered, notes) = node_event_count(&s.node.name, "StateWriteRecovered");
    assert_eq!(recovered, 0, "recovered while still full: {notes}");
    std::fs::remove_file(filler).unwrap();
    agent.stop().await;
    s.cleanup().await;
}

/// An agent process of the real binary, for the tests that kill one.
struct AgentProcess {
    process: Killed,
    listen: std::net::SocketAddr,
}

impl AgentProcess {
    fn start(s: &Setup, state: &std::path::Path, keeper: Option<&std::path::Path>) -> Self {
        Self::start_with(s, state, keeper, &[])
    }

    fn start_with(
        s: &Setup,
        state: &std::path::Path,
        keeper: Option<&std::path::Path>,
        extra: &[std::ffi::OsString],
    ) -> Self {
        Self::spawn(s, state, keeper, extra, std::process::Stdio::inherit())
    }

    /// [`AgentProcess::start_with`], its log (stderr) to `log`.
    fn start_logged(
        s: &Setup,
        state: &std::path::Path,
        extra: &[std::ffi::OsString],
        log: &std::path::Path,
    ) -> Self {
        let file = std::fs::File::create(log).unwrap();
        Self::spawn(s, state, None, extra, file.into())
    }

    fn spawn(
        s: &Setup,
        state: &std::path::Path,
        keeper: Option<&std::path::Path>,
        extra: &[std::ffi::OsString],
        stderr: std::process::Stdio,
    ) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let listen: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_nodeguard"));
        cmd.args(["run", "--node-name", &s.node.name])
            .arg(format!("--listen={listen}"))
            .arg("--kubeconfig")
            .arg(kubeconfig_path())
            .arg("--state-dir")
            .arg(state)
            .env("DBUS_SYSTEM_BUS_ADDRESS", &s.bus.address)
            .env("RUST_LOG", "info")
            .env_remove("NOTIFY_SOCKET")
            // The shipped default, whatever the shell running the tests says.
            .env_remove("NODEGUARD_KEEP_EXECUTABLE_PAGES")
            .stdout(std::process::Stdio::null())
            .stderr(stderr);
        if let Some(k) = keeper {
            cmd.arg("--inhibitor-keeper").arg(k);
        }
        cmd.args(extra);
        AgentProcess {
            process: Killed(cmd.spawn().unwrap()),
            listen,
        }
    }

    async fn ready(&self) {
        eventually(Duration::from_secs(30), "the agent process ready", || {
            is_ready(self.listen)
        })
        .await;
    }

    /// SIGKILL, as the OOM killer sends it.
    fn kill(&mut self) {
        self.process.kill();
    }

    /// SIGTERM, as the kubelet sends it to a deleted pod.
    fn terminate(&self) {
        // SAFETY: kill(2) on our own child's pid; no memory is involved.
        assert_eq!(
            unsafe { libc::kill(self.process.0.id() as libc::pid_t, libc::SIGTERM) },
            0
        );
    }

    /// The exit status once the process has ended; panics after `within`.
    async fn exited(&mut self, within: Duration) -> std::process::ExitStatus {
        let end = Instant::now() + within;
        loop {
            if let Some(status) = self.process.0.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < end,
                "the agent still runs after {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// `nodeguard keep` on a socket in `dir`, which holds the copy of the lock
/// that outlives a killed agent; killed when dropped.
fn keeper(dir: &TempDir) -> (Killed, std::path::PathBuf) {
    let socket = dir.path.join("keep.sock");
    let keeper = Killed(
        std::process::Command::new(env!("CARGO_BIN_EXE_nodeguard"))
            .arg("keep")
            .arg("--socket")
            .arg(&socket)
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    (keeper, socket)
}

/// The shutdown record at `path`, as JSON.
fn read_record(path: &std::path::Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The record at `path`, if there is one whole.
fn try_read_record(path: &std::path::Path) -> Option<serde_json::Value> {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
}

/// Writes the record at `path` back without `field`, as a process killed
/// before it saved that field leaves it; returns the record as it was.
fn strip_record_field(path: &std::path::Path, field: &str) -> serde_json::Value {
    let record = read_record(path);
    let mut stripped = record.clone();
    stripped.as_object_mut().unwrap().remove(field);
    std::fs::write(path, stripped.to_string()).unwrap();
    record
}

/// Deletes the node's Events of `reason`, as if they were never stored.
async fn delete_node_events(admin: &Client, node: &str, reason: &str) {
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(admin.clone(), "default");
    while let Some(e) = node_event(admin, node, reason).await {
        events
            .delete(&e.metadata.name.unwrap(), &DeleteParams::default())
            .await
            .unwrap();
    }
}

/// Issue 18, item 5: the agent SIGKILLed (the OOM killer, a crash) during a
/// shutdown, its first group evicted. Before, its delay inhibitor went with
/// its process and logind went on at once: the remaining groups never ran.
/// Now `nodeguard keep` holds a copy: logind keeps waiting, the restarted
/// agent takes the lock back, does not evict the first group's pod again
/// (which would cut its grace), runs the second group and releases the
/// lock at the end.
#[tokio::test]
async fn an_agent_killed_during_a_shutdown_leaves_the_lock_with_its_keeper_and_its_successor_finishes()
 {
    killed_agent_case(Successor::Runs).await;
}

/// Review finding: the same, with the policy's shutdown section removed
/// between the kill and the restart. The successor dropped the lock it
/// took back from the keeper (graceful shutdown "off") and logind went on
/// with the mid group never evicted; it now finishes with the plan the
/// shutdown began with, which the record keeps.
#[tokio::test]
async fn a_killed_agents_successor_finishes_the_shutdown_after_the_policy_dropped_it() {
    killed_agent_case(Successor::PolicyDropped).await;
}

/// Review of issue 37's stop fix: the successor holds the lock it took
/// back from the keeper while it asks logind whether to resume, and a
/// SIGTERM comes then (the pod deleted by a drain tool or a rollout, as in
/// the `kube-reboot` scenario). Before, its stop went on at once: the lock
/// and the keeper's copy were released and logind went on, the mid group
/// never evicted. Now the stop waits for the decision, then for the
/// resumed groups, and the process exits after the last one.
#[tokio::test]
async fn a_stop_while_the_successor_decides_to_resume_waits_for_the_groups() {
    killed_agent_case(Successor::StoppedWhileDeciding).await;
}

#[derive(Clone, Copy, PartialEq)]
enum Successor {
    Runs,
    /// The policy's shutdown section removed before it starts.
    PolicyDropped,
    /// SIGTERMed while logind is slow to answer its start-up question.
    StoppedWhileDeciding,
}

async fn killed_agent_case(successor: Successor) {
    let drop_shutdown_from_policy = successor == Successor::PolicyDropped;
    let s = setup_with(
        match successor {
            Successor::Runs => "killed",
            Successor::PolicyDropped => "killed-nopol",
            Successor::StoppedWhileDeciding => "killed-stop",
        },
        Duration::from_secs(60),
        serde_json::json!([
            {"priority": 0, "gracePeriodSeconds": 6},
            {"priority": 1000, "gracePeriodSeconds": 6},
        ]),
        false,
    )
    .await;
    ensure_priority_class(&s.admin, "nodeguard-test-low", 0).await;
    ensure_priority_class(&s.admin, "nodeguard-test-mid", 1000).await;
    let (low, mid) = (unique_name("low"), unique_name("mid"));
    // No kubelet: evicted pods stay (terminating), each group takes its window.
    for (name, class) in [(&low, "nodeguard-test-low"), (&mid, "nodeguard-test-mid")] {
        running_pod(&s.admin, &s.node.name, name, class, serde_json::json!({})).await;
    }
    let dir = TempDir::new("keep");
    let (keeper, socket) = keeper(&dir);
    let state = TempDir::new("state");
    let mut first = AgentProcess::start(&s, &state.path, Some(&socket));
    first.ready().await;
    assert_eq!(s.peer.held(), 1, "ready means the inhibitor is held");

    let pods: Api<Pod> = Api::namespaced(s.admin.clone(), TEST_NAMESPACE);
    let deletion = |p: &Pod| {
        (
            p.metadata.deletion_timestamp.clone(),
            p.metadata.deletion_grace_period_seconds,
        )
    };
    s.peer.prepare_for_shutdown(true).await;
    let t0 = Instant::now();
    eventually(Duration::from_secs(5), "the low pod evicted", || async {
        pods.get(&low)
            .await
            .unwrap()
            .metadata
            .deletion_timestamp
            .is_some()
    })
    .await;
    first.kill();
    let killed = t0.elapsed();
    let low_evicted = deletion(&pods.get(&low).await.unwrap());
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        s.peer.held(),
        1,
        "after the agent was killed, its keeper still holds the delay inhibitor"
    );
    if drop_shutdown_from_policy {
        let policies: Api<nodeguard::policy::NodeGuardPolicy> = Api::all(s.admin.clone());
        policies
            .patch(
                &s.policy,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(serde_json::json!({"spec": {"shutdown": null}})),
            )
            .await
            .unwrap();
    }

    let stall_ends = Instant::now() + Duration::from_secs(3);
    if successor == Successor::StoppedWhileDeciding {
        s.peer.state.lock().unwrap().answer_after = Some(stall_ends);
    }
    let mut second = AgentProcess::start(&s, &state.path, Some(&socket));
    if successor == Successor::StoppedWhileDeciding {
        eventually(
            Duration::from_secs(10),
            "the successor listening",
            || async { tokio::net::TcpStream::connect(second.listen).await.is_ok() },
        )
        .await;
        // Its signal handlers are installed as soon as it serves.
        tokio::time::sleep(Duration::from_millis(300)).await;
        second.terminate();
        assert!(
            Instant::now() + Duration::from_secs(1) < stall_ends,
            "the SIGTERM came too late to find the successor deciding"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(
            s.peer.held(),
            1,
            "the lock kept while the successor decides"
        );
    }
    eventually(
        Duration::from_secs(20),
        "the mid group evicted by the restarted agent",
        || async {
            pods.get(&mid)
                .await
                .unwrap()
                .metadata
                .deletion_timestamp
                .is_some()
        },
    )
    .await;
    let mid_evicted = t0.elapsed();
    eventually(
        Duration::from_secs(20),
        "the lock released after the last group",
        || std::future::ready(s.peer.held() == 0),
    )
    .await;
    let released = t0.elapsed();
    assert_eq!(
        deletion(&pods.get(&low).await.unwrap()),
        low_evicted,
        "the low pod was evicted again (its deletion moved)"
    );
    // The plan counts from the first start: low's 6 s window, then mid's.
    assert!(
        mid_evicted >= Duration::from_secs(5) && mid_evicted < Duration::from_secs(12),
        "mid evicted {mid_evicted:?} into the shutdown"
    );
    assert!(
        released >= mid_evicted + Duration::from_secs(4) && released < Duration::from_secs(20),
        "released {released:?} (mid evicted at {mid_evicted:?})"
    );
    if successor == Successor::StoppedWhileDeciding {
        let status = second.exited(Duration::from_secs(10)).await;
        assert!(status.success(), "{status:?}");
        let record: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(state.path.join("shutdown-state.json")).unwrap(),
        )
        .unwrap();
        assert!(!record["endedAt"].is_null(), "{record}");
        drop(keeper);
        force_delete(&s.admin, &[&low, &mid]).await;
        s.cleanup().await;
        return;
    }
    let metrics = http_get(second.listen, "/metrics").await.1;
    assert_eq!(
        sample(
            &metrics,
            "nodeguard_shutdown_pods_total{group=\"0\",outcome=\"already_terminating\"}"
        ),
        Some(1.0),
        "{metrics}"
    );
    let record: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(state.path.join("shutdown-state.json")).unwrap(),
    )
    .unwrap();
    assert!(!record["endedAt"].is_null(), "{record}");
    assert!(
        tainted(
            &Api::<Node>::all(s.admin.clone())
                .get(&s.node.name)
                .await
                .unwrap()
        ),
        "the taint stays while the host goes down"
    );
    second.kill();
    drop(keeper);
    force_delete(&s.admin, &[&low, &mid]).await;
    s.cleanup().await;
    eprintln!(
        "killed {killed:?} into the shutdown; mid evicted {mid_evicted:?}; released {released:?}"
    );
}

/// Found on the real node (CI, kube-reboot): the agent SIGKILLed as logind
/// began, after the API server applied its taint and before its record
/// said so. The successor's taint request found the taint there and took
/// it for someone else's; after the reboot the node kept
/// `nodeguard.io/shutdown` and no pod could be scheduled on it. A record
/// saved before the taint request was answered now leaves the taint
/// nodeguard's.
#[tokio::test]
async fn a_taint_applied_just_before_the_agent_was_killed_is_removed_after_the_reboot() {
    let mut s = setup_with(
        "killed-taint",
        Duration::from_secs(60),
        serde_json::json!([{"priority": 0, "gracePeriodSeconds": 4}]),
        false,
    )
    .await;
    let low = s.low_pod("low", serde_json::json!({})).await;
    let dir = TempDir::new("keep");
    let (keeper, socket) = keeper(&dir);
    let state = TempDir::new("state");
    let record_path = state.path.join("shutdown-state.json");
    let mut first = AgentProcess::start(&s, &state.path, Some(&socket));
    first.ready().await;
    let nodes: Api<Node> = Api::all(s.admin.clone());
    s.peer.prepare_for_shutdown(true).await;
    eventually(Duration::from_secs(5), "the node tainted", || async {
        tainted(&nodes.get(&s.node.name).await.unwrap())
    })
    .await;
    first.kill();
    // The record as the first process saved it before sending the taint
    // request (a kill between the API server's answer and the next save
    // leaves exactly this): the shutdown started, no answer recorded.
    let mut record = read_record(&record_path);
    assert!(!record["startedAt"].is_null(), "{record}");
    let fields = record.as_object_mut().unwrap();
    fields.insert("taintAdded".into(), serde_json::json!(false));
    fields.remove("taintAnswered");
    std::fs::write(&record_path, record.to_string()).unwrap();

    let mut second = AgentProcess::start(&s, &state.path, Some(&socket));
    s.finished_and_released(&record_path, "the successor").await;
    second.kill();
    drop(keeper);

    // The reboot: a new boot id, a logind that knows no shutdown.
    let (agent, _state) = s.agent_after_reboot(&state.path).await;
    eventually(
        Duration::from_secs(15),
        "GracefulShutdown=False (NodeRebooted) and nodeguard's taint removed",
        || async {
            let n = nodes.get(&s.node.name).await.unwrap();
            node_has(&n, "GracefulShutdown", "False") && !tainted(&n)
        },
    )
    .await;
    let (_, reason, message) = condition_of(&nodes, &s.node.name, "GracefulShutdown")
        .await
        .unwrap();
    assert_eq!(reason, "NodeRebooted", "{message}");
    assert!(
        message.contains("removed its shutdown taint"),
        "the report says whose taint it was: {message}"
    );
    agent.stop().await;
    force_delete(&s.admin, &[&low]).await;
    s.cleanup().await;
}

/// Found on the real node (CI, kube-reboot): the agent SIGKILLed at
/// logind's signal, after it saved its record and before the API server
/// stored its `ShutdownStarted` Event. The successor said only
/// `ShutdownResumed`, so `kubectl events` never showed that a shutdown
/// began. The record now says whether the start's Event was stored; a
/// successor whose record does not says it, before `ShutdownResumed`.
#[tokio::test]
async fn a_start_event_lost_with_the_killed_agent_is_said_by_its_successor() {
    let s = setup_with(
        "killed-start",
        Duration::from_secs(60),
        serde_json::json!([{"priority": 0, "gracePeriodSeconds": 6}]),
        false,
    )
    .await;
    let low = s.low_pod("low", serde_json::json!({})).await;
    let dir = TempDir::new("keep");
    let (keeper, socket) = keeper(&dir);
    let state = TempDir::new("state");
    let record_path = state.path.join("shutdown-state.json");
    let mut first = AgentProcess::start(&s, &state.path, Some(&socket));
    first.ready().await;
    s.peer.prepare_for_shutdown(true).await;
    s.event_within(
        Duration::from_secs(5),
        "ShutdownStarted",
        "the first ShutdownStarted",
    )
    .await;
    first.kill();
    // What a kill between the record's first save and the Event's store
    // leaves: the record without the store, no Event on the node.
    let record = strip_record_field(&record_path, "announced");
    assert!(!record["startedAt"].is_null(), "{record}");
    delete_node_events(&s.admin, &s.node.name, "ShutdownStarted").await;

    let mut second = AgentProcess::start(&s, &state.path, Some(&socket));
    s.event_within(
        Duration::from_secs(15),
        "ShutdownResumed",
        "the successor said the shutdown resumed",
    )
    .await;
    let started = node_event(&s.admin, &s.node.name, "ShutdownStarted").await;
    let resumed = node_event(&s.admin, &s.node.name, "ShutdownResumed")
        .await
        .unwrap();
    let Some(started) = started else {
        panic!(
            "the successor said the start its predecessor did not:\n{}",
            events_for(&s.node.name).await
        )
    };
    assert!(
        started.event_time.as_ref().map(|t| t.0) <= resumed.event_time.as_ref().map(|t| t.0),
        "the start first: {started:?} {resumed:?}"
    );
    let note = started.note.clone().unwrap_or_default();
    assert!(
        note.contains(&format!(
            "began shutting down at {}",
            record["startedAt"].as_str().unwrap()
        )) && note.contains("Said by the restarted agent"),
        "the late start says when the shutdown began: {note}"
    );
    eventually(
        Duration::from_secs(5),
        "the record says the start's Event was stored",
        || {
            std::future::ready(
                try_read_record(&record_path).is_some_and(|r| r["announced"] == true),
            )
        },
    )
    .await;
    s.finished_and_released(&record_path, "the successor").await;
    second.kill();

    // Review finding: killed again after the end was recorded and before
    // the start's Event was stored (a slow API server retrying it), the
    // next process found the host going down and said nothing.
    let record = strip_record_field(&record_path, "announced");
    assert_eq!(record["announced"], true, "{record}");
    delete_node_events(&s.admin, &s.node.name, "ShutdownStarted").await;
    let mut third = AgentProcess::start(&s, &state.path, Some(&socket));
    let late = s
        .event_within(
            Duration::from_secs(15),
            "ShutdownStarted",
            "the start said by the agent restarted while the host goes down",
        )
        .await;
    let note = late.note.unwrap_or_default();
    assert!(note.contains("Said by the restarted agent"), "{note}");
    third.kill();
    drop(keeper);
    force_delete(&s.admin, &[&low]).await;
    s.cleanup().await;
}

/// Two kills in a row (helper-70's review): the first agent killed before
/// its record's first save, so its successor found the shutdown under way
/// with no record and stamped its own time as the start; the successor
/// killed in turn before its `ShutdownStarted` was stored. The third
/// process then said "began shutting down at" the second one's restart,
/// off by the restart's delay. A start found late is never claimed as when
/// the shutdown began. This is also the agent-level test of the path that
/// resumes with no record.
#[tokio::test]
async fn a_start_found_late_is_never_said_as_when_the_shutdown_began() {
    let mut s = setup_with(
        "found-late",
        Duration::from_secs(60),
        serde_json::json!([{"priority": 0, "gracePeriodSeconds": 8}]),
        false,
    )
    .await;
    let low = s.low_pod("low", serde_json::json!({})).await;
    let dir = TempDir::new("keep");
    let (keeper, socket) = keeper(&dir);
    let state = TempDir::new("state");
    let record_path = state.path.join("shutdown-state.json");
    let mut first = AgentProcess::start(&s, &state.path, Some(&socket));
    first.ready().await;
    s.peer.prepare_for_shutdown(true).await;
    s.event_within(
        Duration::from_secs(5),
        "ShutdownStarted",
        "the first ShutdownStarted",
    )
    .await;
    first.kill();
    // Killed before its record's first save: no record, no Event.
    std::fs::remove_file(&record_path).unwrap();
    delete_node_events(&s.admin, &s.node.name, "ShutdownStarted").await;

    let mut second = AgentProcess::start(&s, &state.path, Some(&socket));
    eventually(
        Duration::from_secs(15),
        "the second process said the start, its time not recorded",
        || async {
            node_event(&s.admin, &s.node.name, "ShutdownStarted")
                .await
                .and_then(|e| e.note)
                .is_some_and(|n| n.contains("since a time not recorded"))
        },
    )
    .await;
    eventually(
        Duration::from_secs(5),
        "the second process's record: its stamped start, the Event stored",
        || {
            std::future::ready(
                try_read_record(&record_path)
                    .is_some_and(|r| !r["startedAt"].is_null() && r["announced"] == true),
            )
        },
    )
    .await;
    second.kill();
    // Killed before its Event was stored.
    let stamped = strip_record_field(&record_path, "announced");
    assert!(
        stamped["endedAt"].is_null(),
        "killed with its group under way: {stamped}"
    );
    delete_node_events(&s.admin, &s.node.name, "ShutdownStarted").await;

    let mut third = AgentProcess::start(&s, &state.path, Some(&socket));
    let late = s
        .event_within(
            Duration::from_secs(15),
            "ShutdownStarted",
            "the third process said the start",
        )
        .await;
    let note = late.note.unwrap_or_default();
    assert!(
        note.contains("since a time not recorded") && !note.contains("began shutting down at"),
        "the second process's restart is not when the shutdown began \
         (it stamped {}): {note}",
        stamped["startedAt"]
    );
    s.finished_and_released(&record_path, "the third process")
        .await;
    third.kill();
    drop(keeper);

    // helper-71's review: after the reboot, the report and the duration
    // metric took the found time for the start (the duration too short).
    let (agent, _state) = s.agent_after_reboot(&state.path).await;
    let nodes: Api<Node> = Api::all(s.admin.clone());
    eventually(
        Duration::from_secs(15),
        "GracefulShutdown=False (NodeRebooted)",
        || async {
            node_has(
                &nodes.get(&s.node.name).await.unwrap(),
                "GracefulShutdown",
                "False",
            )
        },
    )
    .await;
    let (_, reason, message) = condition_of(&nodes, &s.node.name, "GracefulShutdown")
        .await
        .unwrap();
    assert_eq!(reason, "NodeRebooted", "{message}");
    assert!(
        message.contains("found under way at") && message.contains("took at least"),
        "the report does not claim the time found as the start: {message}"
    );
    let metrics = http_get(agent.addr, "/metrics").await.1;
    assert_eq!(
        sample(&metrics, "nodeguard_shutdown_last_duration_seconds"),
        Some(0.0),
        "a lower bound is not exported as the duration:\n{}",
        metrics
            .lines()
            .filter(|l| l.starts_with("nodeguard_shutdown_"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    agent.stop().await;
    force_delete(&s.admin, &[&low]).await;
    s.cleanup().await;
}

/// An agent killed during a shutdown that was then cancelled while logind
/// did not answer its successor at start: the successor resumed the
/// shutdown (taint kept, groups run) on a node that stayed up, holding no
/// inhibitor, and ignored the next PrepareForShutdown(true) (a shutdown
/// was "running"), so that one went through unprotected. Once logind
/// answers, the successor sees there is no shutdown, undoes it
/// (`ShutdownCancelled`, the taint removed), holds its inhibitor and
/// protects the next shutdown.
#[tokio::test]
async fn a_resumed_shutdown_that_was_cancelled_while_logind_did_not_answer_is_undone() {
    let mut s = setup(
        "resume-cancelled",
        Duration::from_secs(60),
        serde_json::json!([{"priority": 0, "gracePeriodSeconds": 4}]),
    )
    .await;
    // No kubelet: the evicted pod stays, so the group takes its 4 s window.
    let low = s.low_pod("low", serde_json::json!({})).await;
    let state = TempDir::new("state");
    let record_path = state.path.join("shutdown-state.json");
    let mut first = AgentProcess::start(&s, &state.path, None);
    first.ready().await;
    let nodes: Api<Node> = Api::all(s.admin.clone());
    s.peer.prepare_for_shutdown(true).await;
    eventually(Duration::from_secs(5), "the node tainted", || async {
        tainted(&nodes.get(&s.node.name).await.unwrap())
    })
    .await;
    first.kill();
    let record = read_record(&record_path);
    assert!(
        record["endedAt"].is_null(),
        "killed with its group under way: {record}"
    );
    // The shutdown is cancelled, and logind is away when the successor
    // starts (its start-up question gets no answer).
    s.peer.prepare_for_shutdown(false).await;
    s.peer.kill().await;
    let second = AgentProcess::start(&s, &state.path, None);
    // Its start-up is over well within this (it asks logind first).
    tokio::time::sleep(Duration::from_secs(8)).await;
    s.peer.come_back().await;
    eventually(
        Duration::from_secs(20),
        "the inhibitor held and the taint removed",
        || async { s.peer.held() == 1 && !tainted(&nodes.get(&s.node.name).await.unwrap()) },
    )
    .await;
    eventually(
        Duration::from_secs(10),
        "a ShutdownCancelled Event",
        || async { events_for(&s.node.name).await.contains("ShutdownCancelled") },
    )
    .await;
    // The next shutdown is seen and protected.
    s.peer.prepare_for_shutdown(true).await;
    eventually(
        Duration::from_secs(5),
        "the next shutdown taints the node",
        || async { tainted(&nodes.get(&s.node.name).await.unwrap()) },
    )
    .await;
    drop(second);
    force_delete(&s.admin, &[&low]).await;
    s.cleanup().await;
}

/// The shutdown's taint request and its first evictions went out at once,
/// so a pod could be evicted while the node was still open to the
/// scheduler and its replacement land on this very node. The groups now
/// wait for the taint to land, 1 s at most: in the API server's own audit
/// log, the first eviction is received after the taint PATCH completed, or
/// (an API server slower than that, as on a loaded machine) at least the
/// 1 s cap after the signal. The order itself is pinned with paused time by
/// the unit test `evictions_wait_for_the_taint_that_lands_not_a_failed_attempt`.
#[tokio::test]
async fn the_node_is_tainted_before_the_first_eviction() {
    let s = setup(
        "taint-first",
        Duration::from_secs(60),
        serde_json::json!([{"priority": 0, "gracePeriodSeconds": 4}]),
    )
    .await;
    let low = s.low_pod("low", serde_json::json!({})).await;
    let (agent, _state) = s.start_armed().await;
    let key = format!("{TEST_NAMESPACE}/{low}");
    eventually(
        Duration::from_secs(15),
        "the pod in the agent's watch",
        || {
            std::future::ready(
                agent
                    .pods
                    .borrow()
                    .as_ref()
                    .is_some_and(|p| p.contains_key(&key)),
            )
        },
    )
    .await;
    let signalled = jiff::Timestamp::now();
    s.peer.prepare_for_shutdown(true).await;
    let at = |e: &serde_json::Value, field: &str| -> jiff::Timestamp {
        e[field].as_str().unwrap().parse().unwrap()
    };
    let mut order = None;
    eventually(
        Duration::from_secs(10),
        "the taint and the eviction in the audit log",
        || {
            let entries = audit_completed(&[&s.node.name, &low]);
            let after = |e: &&serde_json::Value| at(e, "requestReceivedTimestamp") >= signalled;
            // The PATCH that landed (an attempt refused with a conflict is
            // not the taint).
            let taint = entries.iter().filter(after).find(|e| {
                e["verb"] == "patch"
                    && e["responseStatus"]["code"] == 200
                    && e["objectRef"]["resource"] == "nodes"
                    && e["objectRef"]["name"] == s.node.name.as_str()
                    && e["objectRef"]["subresource"].is_null()
            });
            let eviction = entries.iter().filter(after).find(|e| {
                e["verb"] == "create"
                    && e["objectRef"]["resource"] == "pods"
                    && e["objectRef"]["name"] == low.as_str()
                    && e["objectRef"]["subresource"] == "eviction"
            });
            // The first PATCH of the node after the signal: when the taint
            // request began (an attempt refused with a conflict included).
            let asked = entries.iter().filter(after).find(|e| {
                e["verb"] == "patch"
                    && e["objectRef"]["resource"] == "nodes"
                    && e["objectRef"]["name"] == s.node.name.as_str()
                    && e["objectRef"]["subresource"].is_null()
            });
            if let (Some(a), Some(t), Some(e)) = (asked, taint, eviction) {
                order = Some((
                    at(a, "requestReceivedTimestamp"),
                    at(t, "stageTimestamp"),
                    at(e, "requestReceivedTimestamp"),
                ));
            }
            std::future::ready(order.is_some())
        },
    )
    .await;
    let (asked_at, tainted_at, evicted_at) = order.unwrap();
    eprintln!(
        "taint PATCH received {:?} and completed {:?} after the signal, eviction received {:?} after it",
        asked_at.duration_since(signalled),
        tainted_at.duration_since(signalled),
        evicted_at.duration_since(signalled)
    );
    // The cap: the agent waits 1 s at most from when it handled the signal,
    // which is after the test sent it (on a loaded machine its GET and
    // PATCH may take longer than that).
    let waited_the_cap = evicted_at.duration_since(signalled) >= jiff::SignedDuration::from_secs(1);
    assert!(
        tainted_at <= evicted_at || waited_the_cap,
        "the eviction reached the API server ({evicted_at}) before the taint had landed ({tainted_at}), {:?} after the taint request ({asked_at})",
        evicted_at.duration_since(asked_at)
    );
    agent.stop().await;
    force_delete(&s.admin, &[&low]).await;
    s.cleanup().await;
}

/// A shutdown that began while the state directory was full tainted the
/// node but could write no record of it: after the reboot nothing said the
/// taint was nodeguard's, and the node came back NoSchedule for good. The
/// next start now removes nodeguard's own taint (`shutting-down`) while
/// logind prepares for no shutdown, with an Event; an operator's taint of
/// the same key with another value stays.
#[tokio::test]
async fn a_shutdown_taint_that_could_not_be_recorded_is_removed_after_the_reboot() {
    let s = setup(
        "unrecorded-taint",
        Duration::from_secs(15),
        serde_json::json!([{"priority": 0, "gracePeriodSeconds": 2}]),
    )
    .await;
    let fs = SmallFs::mount("64k");
    let start = |boot: &'static str| {
        let dir = fs.dir.path.clone();
        let address = s.bus.address.clone();
        start_agent_with(s.admin.clone(), &s.node.name, move |c| {
            c.system_bus_address = Some(address);
            c.boot_id = boot.into();
            c.state_dir = dir;
        })
    };
    let (agent, _unused) = start("boot-1").await;
    eventually(Duration::from_secs(15), "inhibitor taken", || {
        std::future::ready(s.peer.held() == 1)
    })
    .await;
    let filler = fs.fill();
    let nodes: Api<Node> = Api::all(s.admin.clone());
    s.peer.prepare_for_shutdown(true).await;
    eventually(Duration::from_secs(2), "tainted", || async {
        tainted(&nodes.get(&s.node.name).await.unwrap())
    })
    .await;
    eventually(
        Duration::from_secs(10),
        "the inhibitor released after the group",
        || std::future::ready(s.peer.held() == 0),
    )
    .await;
    assert!(
        !fs.dir.path.join("shutdown-state.json").exists(),
        "no record could be written"
    );
    // The host goes down with the agent; the next boot's logind prepares
    // for nothing, and the disk has room again.
    agent.stop().await;
    s.peer.state.lock().unwrap().preparing = false;
    std::fs::remove_file(filler).unwrap();
    let (again, _unused) = start("boot-2").await;
    eventually(
        Duration::from_secs(10),
        "nodeguard's unrecorded taint removed",
        || async { !tainted(&nodes.get(&s.node.name).await.unwrap()) },
    )
    .await;
    eventually(
        Duration::from_secs(10),
        "a ShutdownTaintRemoved Event",
        || async {
            events_for(&s.node.name)
                .await
                .contains("ShutdownTaintRemoved")
        },
    )
    .await;
    again.stop().await;

    // An operator's taint of that key, with its own value, is not nodeguard's.
    let patch = serde_json::json!({"spec": {"taints": [
        {"key": "nodeguard.io/shutdown", "value": "maintenance", "effect": "NoSchedule"}]}});
    nodes
        .patch(&s.node.name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    let (third, _unused) = start("boot-3").await;
    eventually(Duration::from_secs(15), "inhibitor taken", || {
        std::future::ready(s.peer.held() == 1)
    })
    .await;
    assert!(
        tainted(&nodes.get(&s.node.name).await.unwrap()),
        "the operator's maintenance taint stays"
    );
    third.stop().await;
    s.cleanup().await;
}

/// Issue 37's leftover: a stop (a rollout, a drain tool deleting the pod,
/// `systemctl restart`) in the instant the host begins shutting down, after
/// logind's `PrepareForShutdown(true)` but before the agent handled it.
/// Here logind prepares for the shutdown and its signal never reaches the
/// agent, so only the stop's question can find it. Before, the SIGTERMed
/// binary stopped at once: its inhibitor went with it, logind went on and
/// no group ran. Now it asks logind before cancelling anything, runs the
/// shutdown (taint, the group's window) and stops after it.
#[tokio::test]
async fn a_stop_as_the_host_begins_shutting_down_runs_the_shutdown_first() {
    let s = setup(
        "stop-race",
        Duration::from_secs(60),
        serde_json::json!([{"priority": 0, "gracePeriodSeconds": 4}]),
    )
    .await;
    // No kubelet: the evicted pod stays, so the group takes its 4 s window.
    let low = s.low_pod("low", serde_json::json!({})).await;
    let state = TempDir::new("state");
    let mut agent = AgentProcess::start(&s, &state.path, None);
    agent.ready().await;
    assert_eq!(s.peer.held(), 1, "ready means armed");
    // Not taken for a shutdown when there is none: the stop is prompt.
    let mut idle = AgentProcess::start(&s, &TempDir::new("state-idle").path, None);
    idle.ready().await;
    let t = Instant::now();
    idle.terminate();
    assert!(idle.exited(Duration::from_secs(10)).await.success());
    let idle_stop = t.elapsed();
    // As prompt as before the question (its Events and conditions are
    // flushed within 3 s on every stop).
    assert!(
        idle_stop < Duration::from_secs(3),
        "an idle stop took {idle_stop:?}"
    );
    assert!(!tainted(
        &Api::<Node>::all(s.admin.clone())
            .get(&s.node.name)
            .await
            .unwrap()
    ));

    s.peer.state.lock().unwrap().preparing = true;
    let t0 = Instant::now();
    agent.terminate();
    let nodes: Api<Node> = Api::all(s.admin.clone());
    eventually(Duration::from_secs(5), "the node tainted", || async {
        tainted(&nodes.get(&s.node.name).await.unwrap())
    })
    .await;
    assert_eq!(
        s.peer.held(),
        1,
        "the inhibitor is held while the group runs"
    );
    let status = agent.exited(Duration::from_secs(20)).await;
    let stopped = t0.elapsed();
    assert!(status.success(), "{status:?}");
    assert!(
        stopped >= Duration::from_secs(3),
        "stopped {stopped:?} after the signal: before the 4 s group was over"
    );
    assert_eq!(s.peer.held(), 0, "released at the end");
    let record: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(state.path.join("shutdown-state.json")).unwrap(),
    )
    .unwrap();
    assert!(
        !record["endedAt"].is_null(),
        "the shutdown ran to its end: {record}"
    );
    assert!(
        events_for(&s.node.name).await.contains("StopDeferred"),
        "the deferral is an Event"
    );
    force_delete(&s.admin, &[&low]).await;
    s.cleanup().await;
    eprintln!("idle stop {idle_stop:?}; stop during the shutdown {stopped:?}");
}

/// The PATCHes of Node `node` itself (not its status) received from
/// `since` on, from the API server's audit log: whether nodeguard sent it
/// (its taint edits; else the node lifecycle controller, tainting the new
/// Node), and the response code.
fn node_patches(node: &str, since: jiff::Timestamp) -> Vec<(bool, i64)> {
    audit_completed(&[node])
        .iter()
        .filter(|e| {
            e["verb"] == "patch"
                && e["objectRef"]["resource"] == "nodes"
                && e["objectRef"]["name"] == node
                && e["objectRef"]["subresource"].is_null()
                && e["requestReceivedTimestamp"]
                    .as_str()
                    .and_then(|t| t.parse::<jiff::Timestamp>().ok())
                    .is_some_and(|t| t >= since)
        })
        .map(|e| {
            (
                e["userAgent"]
                    .as_str()
                    .is_some_and(|a| a.starts_with("nodeguard")),
                e["responseStatus"]["code"].as_i64().unwrap_or_default(),
            )
        })
        .collect()
}

/// Review of issue 37: the shutdown taint's PATCH carried the Node's
/// resourceVersion, so every status write in between (the kubelet's
/// heartbeats, nodeguard's own condition writer) failed it with a 409 and
/// sent it round again; under load the taint landed up to 5 s late. The
/// precondition is now on the taints alone (a JSON patch `test`): with the
/// Node's status written continuously (at least once per taint edit: the
/// edits go on until it has been, so a loaded machine cannot thin the
/// churn out, as a CI run did), the taint edits get no 409.
#[tokio::test]
async fn taint_edits_are_not_refused_for_status_writes() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "taint-churn").await;
    let stop = tokio_util::sync::CancellationToken::new();
    let written = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let churn = {
        let (admin, name, stop) = (admin.clone(), node.name.clone(), stop.clone());
        let written = written.clone();
        tokio::spawn(async move {
            let nodes: Api<Node> = Api::all(admin);
            let mut writes = 0u32;
            while !stop.is_cancelled() {
                let patch = serde_json::json!({"status": {"conditions": [{
                    "type": "ChurnTest", "status": "False", "reason": "Churn",
                    "message": format!("write {writes}"),
                    "lastHeartbeatTime": jiff::Timestamp::now().to_string(),
                }]}});
                nodes
                    .patch_status(&name, &PatchParams::default(), &Patch::Strategic(&patch))
                    .await
                    .unwrap();
                writes += 1;
                written.store(writes, std::sync::atomic::Ordering::Relaxed);
            }
            writes
        })
    };
    let t0 = Instant::now();
    let since = jiff::Timestamp::now();
    let mut pairs = 0u32;
    while pairs < 10
        || (written.load(std::sync::atomic::Ordering::Relaxed) < 2 * pairs && pairs < 100)
    {
        pairs += 1;
        assert!(
            nodeguard::k8s::taints::add(
                &admin,
                &node.name,
                "nodeguard.io/churn",
                "x",
                "NoSchedule"
            )
            .await
            .unwrap()
        );
        nodeguard::k8s::taints::remove(&admin, &node.name, "nodeguard.io/churn", "NoSchedule")
            .await
            .unwrap();
    }
    let took = t0.elapsed();
    stop.cancel();
    let writes = churn.await.unwrap();
    assert!(
        writes >= 2 * pairs,
        "the status was written {writes} times beside {pairs} taint adds and removes"
    );
    // The audit log is written as requests complete; give it a moment.
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Each edit one PATCH, taken; a retry only after another writer's
    // taint edit (the node lifecycle controller tainting the new Node may
    // land in between: its own PATCHes conflict with the status writes).
    let patches = node_patches(&node.name, since);
    let ours: Vec<i64> = patches
        .iter()
        .filter(|(o, _)| *o)
        .map(|(_, c)| *c)
        .collect();
    let theirs = patches.iter().filter(|(o, c)| !*o && *c == 200).count();
    let retried = ours.iter().filter(|c| **c != 200).count();
    assert!(
        ours.iter().filter(|c| **c == 200).count() == 2 * pairs as usize
            && ours.iter().all(|c| *c == 200 || *c == 422)
            && retried <= theirs,
        "taint PATCHes {ours:?} beside {writes} status writes and {theirs} taint edits of others"
    );
    eprintln!(
        "{} taint edits in {took:?} beside {writes} status writes: {} PATCHes, {retried} retried after another writer's edit",
        2 * pairs,
        ours.len()
    );
}

/// Taints are one list: an edit must not drop a taint someone else added
/// between its read and its write. Here an operator's taint is added the
/// moment after nodeguard read the list; nodeguard's write is refused by
/// its `test` and made again on the list with the operator's taint. Both
/// ways: adding to an absent list, and removing from a list that exists.
#[tokio::test]
async fn a_taint_added_between_the_read_and_the_write_is_kept() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "taint-race").await;
    let ours = || k8s_openapi::api::core::v1::Taint {
        key: "nodeguard.io/race".into(),
        value: Some("x".into()),
        effect: "NoSchedule".into(),
        time_added: None,
    };
    let reads = edit_racing_an_operator(&admin, &node.name, "example.com/a", |taints| {
        taints.push(ours());
        true
    })
    .await;
    assert_eq!(
        node_taint_keys(&admin, &node.name).await,
        ["example.com/a", "nodeguard.io/race"],
        "both taints, after {reads} reads"
    );
    assert!(reads >= 2, "{reads} reads");
    let reads = edit_racing_an_operator(&admin, &node.name, "example.com/b", |taints| {
        let before = taints.len();
        taints.retain(|t| t.key != "nodeguard.io/race");
        taints.len() != before
    })
    .await;
    assert_eq!(
        node_taint_keys(&admin, &node.name).await,
        ["example.com/a", "example.com/b"],
        "ours removed, the operator's new one kept, after {reads} reads"
    );
    assert!(reads >= 2, "{reads} reads");
}

/// Runs `edit` through nodeguard's taint edit while an operator appends
/// the taint `key` right after nodeguard's first read; how many reads the
/// edit took.
async fn edit_racing_an_operator(
    admin: &Client,
    node: &str,
    key: &'static str,
    edit: impl Fn(&mut Vec<k8s_openapi::api::core::v1::Taint>) -> bool,
) -> usize {
    let reads = std::sync::atomic::AtomicUsize::new(0);
    let wrote = nodeguard::k8s::taints::edit(admin, node, |taints| {
        if reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
            let (node, mut now) = (node.to_string(), taints.clone());
            now.push(k8s_openapi::api::core::v1::Taint {
                key: key.into(),
                value: Some("op".into()),
                effect: "NoSchedule".into(),
                time_added: None,
            });
            // Another client, on its own runtime, while this edit waits.
            std::thread::spawn(move || {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap()
                    .block_on(async {
                        let nodes: Api<Node> = Api::all(admin_client().await);
                        let patch = serde_json::json!({"spec": {"taints": now}});
                        nodes
                            .patch(&node, &PatchParams::default(), &Patch::Merge(&patch))
                            .await
                            .unwrap();
                    })
            })
            .join()
            .unwrap();
        }
        edit(taints)
    })
    .await
    .unwrap();
    assert!(wrote);
    reads.load(std::sync::atomic::Ordering::SeqCst)
}

/// The Node's taint keys, but the node lifecycle controller's own
/// (`node.kubernetes.io/…`, which it adds to a new Node at a moment of its
/// choosing).
async fn node_taint_keys(admin: &Client, node: &str) -> Vec<String> {
    let n: Node = Api::all(admin.clone()).get(node).await.unwrap();
    n.spec
        .and_then(|s| s.taints)
        .unwrap_or_default()
        .into_iter()
        .map(|t| t.key)
        .filter(|k| !k.starts_with("node.kubernetes.io/"))
        .collect()
}

/// Review of issue 37's stop fix: while the stop waits for the manager's
/// answer (here logind answers only after 3 s), a second SIGTERM stops at
/// once, as it does during a shutdown's groups. Before, the second
/// signal's listener was made only after the answer, so that signal was
/// lost and the agent went on to wait for the whole shutdown.
#[tokio::test]
async fn a_second_signal_during_the_stops_question_stops_at_once() {
    let s = setup(
        "stop-twice",
        Duration::from_secs(60),
        serde_json::json!([{"priority": 0, "gracePeriodSeconds": 6}]),
    )
    .await;
    let low = s.low_pod("low", serde_json::json!({})).await;
    let state = TempDir::new("state");
    let mut agent = AgentProcess::start(&s, &state.path, None);
    agent.ready().await;
    {
        // Longer than the question's own 5 s timeout: before, the stop
        // went on only when that ran out.
        let mut l = s.peer.state.lock().unwrap();
        l.preparing = true;
        l.answer_after = Some(std::time::Instant::now() + Duration::from_secs(8));
    }
    agent.terminate();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t = Instant::now();
    agent.terminate();
    let status = agent.exited(Duration::from_secs(15)).await;
    let took = t.elapsed();
    assert!(status.success(), "{status:?}");
    // Within the 3 s every stop may take to flush its Events.
    assert!(
        took < Duration::from_secs(3),
        "stopped {took:?} after the second signal"
    );
    force_delete(&s.admin, &[&low]).await;
    s.cleanup().await;
}

/// Review of the stop question: logind left the bus during a shutdown and
/// its groups finished (the host is taken to be going down, nothing left
/// to delay). A stop then, as the host stops the agent on its way down,
/// waited for the manager: while it waited up to 10 s for logind to come
/// back (7.7 s measured before), and after, with no loop to answer the
/// question, the question's 15 s limit. It goes on at once in both.
#[tokio::test]
async fn a_stop_while_logind_is_gone_after_the_groups_is_prompt() {
    stop_with_logind_gone(Duration::from_millis(500)).await;
}

#[tokio::test]
async fn a_stop_once_the_agent_watches_the_host_go_down_is_prompt() {
    // logind's 10 s to come back are over: the manager watches the host
    // go down.
    stop_with_logind_gone(Duration::from_secs(11)).await;
}

/// The agent SIGTERMed `after` the shutdown's groups are done, logind
/// having left the bus during them; it must exit within 3 s.
async fn stop_with_logind_gone(after: Duration) {
    let mut s = setup(
        "stop-going-down",
        Duration::from_secs(60),
        serde_json::json!([{"priority": 0, "gracePeriodSeconds": 2}]),
    )
    .await;
    let low = s.low_pod("low", serde_json::json!({})).await;
    let state = TempDir::new("state");
    let record_path = state.path.join("shutdown-state.json");
    let mut agent = AgentProcess::start(&s, &state.path, None);
    agent.ready().await;
    let nodes: Api<Node> = Api::all(s.admin.clone());
    s.peer.prepare_for_shutdown(true).await;
    eventually(Duration::from_secs(5), "the node tainted", || async {
        tainted(&nodes.get(&s.node.name).await.unwrap())
    })
    .await;
    s.peer.kill().await;
    let killed = Instant::now();
    eventually(Duration::from_secs(20), "the groups done", || async {
        try_read_record(&record_path).is_some_and(|r| !r["endedAt"].is_null())
    })
    .await;
    tokio::time::sleep_until((killed + after).max(Instant::now()).into()).await;
    let t = Instant::now();
    agent.terminate();
    let status = agent.exited(Duration::from_secs(30)).await;
    let took = t.elapsed();
    assert!(status.success(), "{status:?}");
    assert!(
        took < Duration::from_secs(3),
        "stopped {took:?} after the signal"
    );
    force_delete(&s.admin, &[&low]).await;
    s.cleanup().await;
}

/// Issue 35's review: a shutdown that begins between two agent pods of a
/// rollout (the handover unit holding the lock) was planned by the next
/// agent from when it found it, so logind's window, running since the
/// signal, ended before the last group's. Now the handover unit runs the
/// agent's own binary (copied into the state directory), which records
/// when the shutdown began and the plan in force; the next agent resumes
/// it from there. Two agent processes and the unit's process (started by
/// the test bus's systemd, for real) over the private bus.
#[tokio::test]
async fn a_shutdown_begun_between_two_agents_is_planned_from_when_it_began() {
    let s = setup_with(
        "between",
        // 2 s more than the plan needs (6 + 6 + the 2 s margin): logind's
        // window, running from the signal, is what binds.
        Duration::from_secs(16),
        serde_json::json!([
            {"priority": 0, "gracePeriodSeconds": 6},
            {"priority": 1000, "gracePeriodSeconds": 6},
        ]),
        false,
    )
    .await;
    ensure_priority_class(&s.admin, "nodeguard-test-low", 0).await;
    ensure_priority_class(&s.admin, "nodeguard-test-mid", 1000).await;
    let (low, mid) = (unique_name("low"), unique_name("mid"));
    for (name, class) in [(&low, "nodeguard-test-low"), (&mid, "nodeguard-test-mid")] {
        running_pod(&s.admin, &s.node.name, name, class, serde_json::json!({})).await;
    }
    let state = TempDir::new("state");
    // The test's host is this machine: the state directory is where it is.
    let handover: Vec<std::ffi::OsString> = vec![
        "--inhibitor-handover-seconds=60".into(),
        format!("--host-state-dir={}", state.path.display()).into(),
    ];
    let first = AgentProcess::start_with(&s, &state.path, None, &handover);
    first.ready().await;
    holder_copied(&state.path).await;
    first.terminate();
    let mut first = first;
    let status = first.exited(Duration::from_secs(20)).await;
    assert!(status.success(), "{status:?}");
    let started = s.peer.state.lock().unwrap().started.clone();
    assert!(
        started.iter().any(
            |(unit, argv)| unit == "nodeguard-inhibitor-handover.service"
                && argv.get(1).map(String::as_str) == Some("handover-hold")
        ),
        "the handover unit runs nodeguard's holder: {started:?}"
    );
    assert_eq!(
        s.peer.inhibitor_modes(),
        vec![(
            "shutdown".to_string(),
            "nodeguard-handover".to_string(),
            "delay".to_string()
        )],
        "only the unit's lock is held between the two agents"
    );

    s.peer.prepare_for_shutdown(true).await;
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let mut second = AgentProcess::start_with(&s, &state.path, None, &handover);
    let pods: Api<Pod> = Api::namespaced(s.admin.clone(), TEST_NAMESPACE);
    let evicted = |name: String| {
        let pods = pods.clone();
        async move {
            pods.get(&name)
                .await
                .unwrap()
                .metadata
                .deletion_timestamp
                .is_some()
        }
    };
    eventually(Duration::from_secs(20), "the mid group evicted", || {
        evicted(mid.clone())
    })
    .await;
    let mid_evicted = t0.elapsed();
    assert!(evicted(low.clone()).await, "the low group evicted first");
    eventually(
        Duration::from_secs(20),
        "every delay inhibitor released after the last group",
        || std::future::ready(s.peer.held() == 0),
    )
    .await;
    let released = t0.elapsed();
    let resumed = node_event(&s.admin, &s.node.name, "ShutdownResumed")
        .await
        .and_then(|e| e.note)
        .unwrap_or_default();
    eprintln!("mid evicted {mid_evicted:?}, released {released:?} after the signal; {resumed}");
    // Planned from the signal, logind's 16 s end 16 s after it: low's
    // window is what is left before mid's 6 s and the 2 s margin, so mid
    // comes at about 8 s and the lock goes at about 14 s. Planned from when
    // the second agent found it (5 s later), mid would come at 11 s and the
    // lock go at 17 s, after logind went on.
    assert!(
        mid_evicted >= Duration::from_secs(7) && mid_evicted < Duration::from_secs(10),
        "mid evicted {mid_evicted:?} after the signal (planned from the second agent's start?)"
    );
    assert!(
        released < Duration::from_millis(15_500),
        "released {released:?} after the signal, logind's window being 16 s"
    );
    assert!(
        resumed.contains("restarted 5.") || resumed.contains("restarted 6."),
        "the second agent says how far into the shutdown it came: {resumed:?}"
    );
    // No agent ran when it began: the second says the start, and whose
    // note it is (helper-70's review: it said "the one before was
    // stopped before its Event was stored").
    let started = node_event(&s.admin, &s.node.name, "ShutdownStarted")
        .await
        .and_then(|e| e.note)
        .unwrap_or_default();
    assert!(
        started.contains("between two agents") && !started.contains("restarted agent"),
        "the start, noted by the handover unit: {started:?}"
    );
    // The unit's process ended: the second agent stopped it.
    assert!(
        s.peer.state.lock().unwrap().processes.is_empty(),
        "the holder still runs"
    );
    second.kill();
    force_delete(&s.admin, &[&low, &mid]).await;
    s.cleanup().await;
}

/// The same handover where the copied holder cannot run (a state directory
/// mounted `noexec` on the host, here a host path with nothing there): the
/// unit fails to start it, and the host's `systemd-inhibit` holds the lock
/// instead, so the node is still never without one between the two agents.
#[tokio::test]
async fn a_holder_that_cannot_run_falls_back_to_systemd_inhibit() {
    let s = setup_with(
        "holder-noexec",
        Duration::from_secs(30),
        serde_json::json!([{"priority": 0, "gracePeriodSeconds": 6}]),
        false,
    )
    .await;
    let state = TempDir::new("state");
    let nowhere = TempDir::new("noexec");
    let handover: Vec<std::ffi::OsString> = vec![
        "--inhibitor-handover-seconds=60".into(),
        format!(
            "--host-state-dir={}",
            nowhere.path.join("missing").display()
        )
        .into(),
    ];
    let mut first = AgentProcess::start_with(&s, &state.path, None, &handover);
    first.ready().await;
    holder_copied(&state.path).await;
    first.terminate();
    let status = first.exited(Duration::from_secs(20)).await;
    assert!(status.success(), "{status:?}");
    let started: Vec<String> = s
        .peer
        .state
        .lock()
        .unwrap()
        .started
        .iter()
        .map(|(_, argv)| argv[..2].join(" "))
        .collect();
    assert_eq!(
        started,
        vec!["nodeguard handover-hold", "systemd-inhibit --what=shutdown"],
        "the holder first, then systemd-inhibit"
    );
    assert_eq!(
        s.peer.inhibitor_modes(),
        vec![(
            "shutdown".to_string(),
            "nodeguard-handover".to_string(),
            "delay".to_string()
        )],
        "systemd-inhibit holds the lock between the two agents"
    );
    let mut second = AgentProcess::start_with(&s, &state.path, None, &handover);
    second.ready().await;
    eventually(
        Duration::from_secs(10),
        "the second agent's own lock, and the unit's ended",
        || {
            std::future::ready(
                s.peer.inhibitor_modes()
                    == vec![(
                        "shutdown".to_string(),
                        "nodeguard".to_string(),
                        "delay".to_string(),
                    )],
            )
        },
    )
    .await;
    second.kill();
    s.cleanup().await;
}

/// The agent's copy of itself for the handover unit is in place (made in
/// the background from its start; the debug binary is large).
async fn holder_copied(state: &std::path::Path) {
    let size = std::fs::metadata(env!("CARGO_BIN_EXE_nodeguard"))
        .unwrap()
        .len();
    let copy = state.join("handover/nodeguard");
    eventually(Duration::from_secs(30), "the holder copied", || {
        std::future::ready(std::fs::metadata(&copy).is_ok_and(|m| m.len() == size))
    })
    .await;
}

/// Found by the fifth review: a copy of the holder that fails at start
/// (here `handover` is a file of someone else's in the state directory)
/// was retried in a blocking thread asleep for five minutes, and the
/// runtime waited for it at exit: a stopped agent lived on until the
/// kubelet killed it. The agent now exits at once, and the handover uses
/// the host's systemd-inhibit.
#[tokio::test]
async fn an_agent_whose_holder_copy_failed_still_stops_at_once() {
    let s = setup_with(
        "holder-copy-fails",
        Duration::from_secs(30),
        serde_json::json!([{"priority": 0, "gracePeriodSeconds": 6}]),
        false,
    )
    .await;
    let state = TempDir::new("state");
    std::fs::write(state.path.join("handover"), "not a folder").unwrap();
    let handover: Vec<std::ffi::OsString> = vec![
        "--inhibitor-handover-seconds=60".into(),
        format!("--host-state-dir={}", state.path.display()).into(),
    ];
    let mut first = AgentProcess::start_with(&s, &state.path, None, &handover);
    first.ready().await;
    // The copy was tried (and failed) by now.
    tokio::time::sleep(Duration::from_secs(1)).await;
    first.terminate();
    let t0 = Instant::now();
    let status = first.exited(Duration::from_secs(20)).await;
    let took = t0.elapsed();
    assert!(status.success(), "{status:?}");
    assert!(took < Duration::from_secs(10), "stopped after {took:?}");
    let started: Vec<String> = s
        .peer
        .state
        .lock()
        .unwrap()
        .started
        .iter()
        .map(|(_, argv)| argv[..2].join(" "))
        .collect();
    assert_eq!(started, vec!["systemd-inhibit --what=shutdown"]);
    assert_eq!(
        std::fs::read_to_string(state.path.join("handover")).unwrap(),
        "not a folder",
        "someone else's file is left as it is"
    );
    s.cleanup().await;
}

/// Found by the sixth review: a holder that noted a shutdown held its lock
/// past its life for good when that shutdown ended without a cancel it saw
/// (a restarted logind forgets the shutdown it was delaying and says
/// nothing). It now holds past its life only while logind still prepares
/// for the shutdown, asking every 10 s. The holder process on the private
/// bus, no agent.
#[tokio::test]
async fn a_holder_past_its_life_keeps_a_noted_shutdown_only_while_logind_prepares_it() {
    let bus = PrivateBus::start();
    let peer = LogindPeer::start(&bus.address, Duration::from_secs(60), None).await;
    let state = TempDir::new("holder");
    let plan = nodeguard::shutdown::ShutdownConfig {
        groups: vec![nodeguard::shutdown::core::GroupSpec {
            priority: 0,
            grace: Duration::from_secs(6),
        }],
        include: Default::default(),
        escalate: true,
        escalate_after_percent: 50,
        safety_margin: Duration::from_secs(2),
        drop_in_dir: None,
    };
    nodeguard::shutdown::holder::write_plan(
        &state.path,
        &nodeguard::shutdown::state::current_boot_id(),
        &plan,
    )
    .unwrap();
    let _holder = Killed(
        std::process::Command::new(env!("CARGO_BIN_EXE_nodeguard"))
            .args(["handover-hold", "--seconds=2", "--state-dir"])
            .arg(&state.path)
            .env("DBUS_SYSTEM_BUS_ADDRESS", &bus.address)
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let handover = || {
        peer.inhibitor_modes()
            == vec![(
                "shutdown".to_string(),
                "nodeguard-handover".to_string(),
                "delay".to_string(),
            )]
    };
    eventually(Duration::from_secs(10), "the holder's lock", || {
        std::future::ready(handover())
    })
    .await;
    peer.prepare_for_shutdown(true).await;
    let note = state.path.join("shutdown-handover-began.json");
    eventually(Duration::from_secs(5), "the holder's note", || {
        std::future::ready(note.exists())
    })
    .await;
    // Past its 2 s life, logind still preparing: held.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(
        handover(),
        "a noted shutdown still under way keeps the lock past the life"
    );
    // logind forgets the shutdown without a word (as a restarted one does).
    peer.state.lock().unwrap().preparing = false;
    let t0 = Instant::now();
    eventually(
        Duration::from_secs(15),
        "the lock released once logind prepares no shutdown",
        || std::future::ready(peer.held() == 0),
    )
    .await;
    eprintln!("released {:?} after logind stopped preparing", t0.elapsed());
    assert!(
        !note.exists(),
        "the note of a shutdown no longer under way goes"
    );
}
