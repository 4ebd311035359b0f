//! Graceful shutdown end to end against a real dbus-daemon with a logind
//! peer, and the real control plane (the controller manager's disruption
//! controller computes the PDB): condition and taint within 300 ms, groups
//! in order, a PDB-protected pod escalated with an Event naming the PDB,
//! the inhibitor released in time; cancel; logind restarts.

mod support;

use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::{DeleteParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use nodeguard::policy::NodeGuardPolicy;
use support::dbus::{LogindPeer, PrivateBus};
use support::pods::{PodsInThreeGroups, delete_pdb, kubelet_sim, pods_in_three_groups};
use support::*;

async fn shutdown_policy(
    client: &Client,
    node: &str,
    drop_in: &std::path::Path,
    groups: serde_json::Value,
) -> String {
    let name = unique_name("shutdown");
    apply_policy(
        client,
        &name,
        serde_json::json!({
            "nodeSelector": selecting(node),
            "shutdown": {"gracePeriodByPriority": groups, "logindDropInDir": drop_in.display().to_string(),
                         "safetyMarginSeconds": 2, "escalateAfterPercent": 50},
        }),
    )
    .await;
    name
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

struct Setup {
    admin: Client,
    node: TestNode,
    bus: PrivateBus,
    peer: LogindPeer,
    drop_in: TempDir,
    policy: String,
}

async fn setup(prefix: &str, logind_delay: Duration, groups: serde_json::Value) -> Setup {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, prefix).await;
    let bus = PrivateBus::start();
    let drop_in = TempDir::new("logind.conf.d");
    let peer = LogindPeer::start(&bus.address, logind_delay, Some(&drop_in.path)).await;
    let policy = shutdown_policy(&admin, &node.name, &drop_in.path, groups).await;
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
    let mut pods_rx = agent.pods.clone();
    eventually(Duration::from_secs(10), "agent sees the three pods", || {
        std::future::ready(
            pods_rx
                .borrow_and_update()
                .as_ref()
                .is_some_and(|p| p.len() == 3),
        )
    })
    .await;

    // Timestamp the Node's versions as the API server sends them (a watch),
    // rather than by polling, so the measurement adds no load or delay.
    let (seen_tx, mut seen_rx) = tokio::sync::mpsc::unbounded_channel();
    let watch_nodes: Api<Node> = Api::all(s.admin.clone());
    let node_name = s.node.name.clone();
    let watching = tokio::spawn(async move {
        let cfg = watcher::Config::default().fields(&format!("metadata.name={node_name}"));
        let mut stream = watcher(watch_nodes, cfg).applied_objects().boxed();
        while let Some(Ok(n)) = stream.next().await {
            if node_has(&n, "GracefulShutdown", "True") && tainted(&n) {
                let _ = seen_tx.send(Instant::now());
                return;
            }
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await; // the watch is established
    let t0 = Instant::now();
    s.peer.prepare_for_shutdown(true).await;
    let seen = tokio::time::timeout(Duration::from_secs(5), seen_rx.recv())
        .await
        .expect("condition and taint appear")
        .expect("watch ran");
    watching.abort();
    let seen_at = seen - t0;
    assert!(
        seen_at <= Duration::from_millis(300),
        "condition and taint took {seen_at:?} (at most 300 ms)"
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
    let (_, metrics) = http_get(agent.addr, "/metrics").await;
    assert!(
        metrics.contains("nodeguard_shutdown_pods_total{group=\"1000\",outcome=\"escalated\"} 1"),
        "{metrics}"
    );
    assert!(metrics.contains("nodeguard_shutdown_pods_total{group=\"0\",outcome=\"evicted\"} 1"));
    assert!(metrics.contains("nodeguard_shutdown_inhibitor_held 0"));

    sim.abort();
    agent.stop().await;
    delete_pdb(&s.admin, &pdb_name).await;
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
    let (agent, _state) = s.start_agent().await;
    eventually(Duration::from_secs(15), "inhibitor taken", || {
        std::future::ready(s.peer.held() == 1)
    })
    .await;
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
    // An operator's own taint must survive the cancel.
    let mut n = nodes.get(&s.node.name).await.unwrap();
    n.spec.as_mut().unwrap().taints.as_mut().unwrap().push(
        serde_json::from_value(
            serde_json::json!({"key": "example.com/mine", "effect": "NoSchedule"}),
        )
        .unwrap(),
    );
    nodes
        .replace(&s.node.name, &PostParams::default(), &n)
        .await
        .unwrap();
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
    let (agent, _state) = s.start_agent().await;
    eventually(Duration::from_secs(15), "inhibitor taken", || {
        std::future::ready(s.peer.held() == 1)
    })
    .await;
    s.peer.kill().await;
    tokio::time::sleep(Duration::from_secs(3)).await;
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
