//! An API server outage while conditions change: the agent keeps running,
//! stays live, loses nothing, and converges soon after the API returns. An
//! API server restart during a shutdown: the groups go on, each pod ends
//! once, the inhibitor is released within the plan. etcd down under the
//! API server: the watchdog's pets go on with `requireApiServer`.
//! (Its own test binary: it stops the shared API server or etcd; its tests
//! take turns.)

mod support;

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::Api;
use nodeguard::report::Status;
use support::notify::{agent_under_systemd_watchdog, api_server_skips};
use support::*;

/// The tests of this binary stop the shared API server: one at a time.
static API_DOWN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test]
async fn conditions_converge_within_5s_after_a_30s_api_outage() {
    let _turn = API_DOWN.lock().await;
    let admin = admin_client().await;
    let node = TestNode::create(&admin, "outage", &[]).await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;
    agent.reporter.set(
        "OutageProbe",
        desired(Status::False, "Before", "before the outage."),
    );
    eventually(Duration::from_secs(10), "first write", || async {
        node_conditions(&admin, &node.name, "OutageProbe")
            .await
            .len()
            == 1
    })
    .await;

    let outage = Outage::begin("kube-apiserver");
    for i in 0..30 {
        let status = if i % 2 == 0 {
            Status::True
        } else {
            Status::False
        };
        agent.reporter.set(
            "OutageProbe",
            desired(status, "During", format!("change {i} during the outage.")),
        );
        assert_eq!(
            http_get(agent.addr, "/livez").await.0,
            200,
            "an API outage must not fail /livez"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    agent.reporter.set(
        "OutageSecond",
        desired(Status::True, "Late", "set just before the API returned."),
    );
    outage.end();
    let back = Instant::now();
    eventually(
        Duration::from_secs(5),
        "latest desired state on the Node",
        || async {
            let a = node_conditions(&admin, &node.name, "OutageProbe").await;
            let b = node_conditions(&admin, &node.name, "OutageSecond").await;
            a.len() == 1
                && a[0].message.as_deref() == Some("change 29 during the outage.")
                && a[0].status == "False"
                && b.len() == 1
        },
    )
    .await;
    eprintln!(
        "converged {:?} after the API server was ready again",
        back.elapsed()
    );
    let (code, body) = http_get(agent.addr, "/livez").await;
    assert_eq!(code, 200, "{body}");

    // The Node watch resumed too: a taint added now still drains /healthz.
    // (Watches retry with a jittered backoff of up to 8 s, and a relist after
    // a 410 or a 503 from a starting API server can take one more round.)
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(admin.clone());
    let taint = serde_json::json!({"spec": {"taints": [
        {"key": "ToBeDeletedByClusterAutoscaler", "value": "1", "effect": "NoSchedule"}]}});
    nodes
        .patch(
            &node.name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&taint),
        )
        .await
        .unwrap();
    eventually(
        Duration::from_secs(25),
        "/healthz 503 after the watch resumed",
        || async { http_get(agent.addr, "/healthz").await.0 == 503 },
    )
    .await;
    let (_, metrics) = http_get(agent.addr, "/metrics").await;
    assert!(
        sample(
            &metrics,
            "nodeguard_api_write_errors_total{resource=\"nodes/status\"}"
        )
        .is_some_and(|v| v >= 1.0),
        "write errors are counted:\n{metrics}"
    );
    agent.stop().await;
}

/// A node with one pod in each of three priority groups (the mid one behind
/// a PDB allowing no disruption, windows 6 s, `mid_secs`, 6 s), a logind
/// peer with a 60 s delay, a kubelet stand-in, and the agent armed with its
/// delay inhibitor and seeing the pods.
struct ArmedNode {
    admin: kube::Client,
    node: TestNode,
    _bus: support::dbus::PrivateBus,
    peer: support::dbus::LogindPeer,
    policy: String,
    pods: support::pods::PodsInThreeGroups,
    marked: std::sync::Arc<std::sync::Mutex<std::collections::BTreeMap<String, Instant>>>,
    sim: tokio::task::JoinHandle<()>,
    agent: nodeguard::agent::RunningAgent,
    _state: TempDir,
}

impl ArmedNode {
    async fn start(prefix: &str, mid_secs: u32, escalate_after_percent: u32) -> ArmedNode {
        let admin = admin_client().await;
        let node = TestNode::selectable(&admin, prefix).await;
        let bus = support::dbus::PrivateBus::start();
        let peer =
            support::dbus::LogindPeer::start(&bus.address, Duration::from_secs(60), None).await;
        let policy = unique_name(prefix);
        apply_policy(
            &admin,
            &policy,
            serde_json::json!({
                "nodeSelector": selecting(&node.name),
                "shutdown": {"gracePeriodByPriority": [
                    {"priority": 0, "gracePeriodSeconds": 6},
                    {"priority": 1000, "gracePeriodSeconds": mid_secs},
                    {"priority": 2000000000, "gracePeriodSeconds": 6},
                ], "safetyMarginSeconds": 2, "escalateAfterPercent": escalate_after_percent},
            }),
        )
        .await;
        let pods = support::pods::pods_in_three_groups(&admin, &node.name).await;
        let (marked, sim) = support::pods::kubelet_sim(admin.clone(), node.name.clone());
        let address = bus.address.clone();
        let (agent, state) = start_agent_with(admin.clone(), &node.name, move |c| {
            c.system_bus_address = Some(address);
            c.boot_id = "test-boot".into();
        })
        .await;
        eventually(Duration::from_secs(15), "inhibitor taken", || {
            std::future::ready(peer.held() == 1)
        })
        .await;
        agent_sees_pods(&agent, 3).await;
        ArmedNode {
            admin,
            node,
            _bus: bus,
            peer,
            policy,
            pods,
            marked,
            sim,
            agent,
            _state: state,
        }
    }

    /// Stops the agent and removes the pods, the PDB and the policy.
    async fn clean_up(self) {
        self.sim.abort();
        self.agent.stop().await;
        let pods: Api<k8s_openapi::api::core::v1::Pod> =
            Api::namespaced(self.admin.clone(), TEST_NAMESPACE);
        for p in [&self.pods.low, &self.pods.mid, &self.pods.high] {
            let _ = pods
                .delete(p, &kube::api::DeleteParams::default().grace_period(0))
                .await;
        }
        support::pods::delete_pdb(&self.admin, &self.pods.pdb).await;
        let api: Api<nodeguard::policy::NodeGuardPolicy> = Api::all(self.admin.clone());
        let _ = api.delete(&self.policy, &Default::default()).await;
    }
}

/// The API server restarted in the middle of a shutdown (during the mid
/// group's wait on its PodDisruptionBudget): the agent stays live, the
/// escalation and the last group happen once it is back, each pod ends
/// exactly once, and the inhibitor goes within the plan's window.
#[tokio::test]
async fn a_shutdown_goes_on_through_an_api_server_restart() {
    let _turn = API_DOWN.lock().await;
    let r = ArmedNode::start("api-restart", 20, 50).await;
    let (admin, node, peer, agent, marked) = (&r.admin, &r.node, &r.peer, &r.agent, &r.marked);
    let (low, mid, high) = (&r.pods.low, &r.pods.mid, &r.pods.high);

    peer.prepare_for_shutdown(true).await;
    let t0 = Instant::now();
    eventually(Duration::from_secs(5), "the low pod evicted", || {
        std::future::ready(marked.lock().unwrap().contains_key(low))
    })
    .await;
    // The mid group has begun (the low pod is gone 300 ms after its
    // eviction): its pod waits on the PDB until the escalation, half of
    // its 20 s window in; the API server has until its window ends to be
    // back.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let outage = tokio::task::spawn_blocking(|| Outage::begin("kube-apiserver"))
        .await
        .unwrap();
    let stopped = t0.elapsed();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        http_get(agent.addr, "/livez").await.0,
        200,
        "an API outage during a shutdown must not fail /livez"
    );
    tokio::task::spawn_blocking(move || outage.end())
        .await
        .unwrap();
    let back = t0.elapsed();
    eventually(
        Duration::from_secs(40),
        "the inhibitor released after the last group",
        || std::future::ready(peer.held() == 0),
    )
    .await;
    let released = t0.elapsed();
    // 6 + 20 + 6 s of windows and the 2 s margin.
    assert!(
        released <= Duration::from_secs(34) + Duration::from_millis(500),
        "released {released:?} into the shutdown: past the plan's 34 s"
    );
    let metrics = http_get(agent.addr, "/metrics").await.1;
    let ends = |group: &str| -> Vec<(String, f64)> {
        metrics
            .lines()
            .filter(|l| l.starts_with(&format!("nodeguard_shutdown_pods_total{{group=\"{group}\"")))
            .filter_map(|l| {
                let (series, v) = l.rsplit_once(' ')?;
                Some((series.to_string(), v.parse().ok()?))
            })
            .filter(|(_, v)| *v > 0.0)
            .collect()
    };
    for (group, outcome) in [
        ("0", "evicted"),
        ("1000", "escalated"),
        ("2000000000", "evicted"),
    ] {
        let e = ends(group);
        assert_eq!(e.len(), 1, "one outcome in group {group}: {e:?}\n{metrics}");
        assert!(
            e[0].0.contains(&format!("outcome=\"{outcome}\"")) && e[0].1 == 1.0,
            "group {group}: one pod {outcome}: {e:?}"
        );
    }
    let node_now = Api::<k8s_openapi::api::core::v1::Node>::all(admin.clone())
        .get(&node.name)
        .await
        .unwrap();
    assert!(
        has_taint(&node_now, "nodeguard.io/shutdown"),
        "the taint stays while the host goes down"
    );
    // The kubelet stand-in's watch ended with the outage: ask the API.
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(admin.clone(), TEST_NAMESPACE);
    for p in [&mid, &high] {
        let deleting = pods
            .get_opt(p)
            .await
            .unwrap()
            .is_none_or(|p| p.metadata.deletion_timestamp.is_some());
        assert!(deleting, "{p} was never deleted");
    }
    eprintln!(
        "API server stopped {stopped:?} into the shutdown, ready again at {back:?}; inhibitor released at {released:?}"
    );
    r.clean_up().await;
}

/// The API server down as the shutdown begins: the taint request fails,
/// is retried, and lands once the API server is back (the node is not left
/// open to the scheduler for the whole shutdown); the taint is then
/// nodeguard's, so a cancel removes it.
#[tokio::test]
async fn a_shutdown_that_begins_during_an_api_outage_taints_the_node_once_it_is_back() {
    let _turn = API_DOWN.lock().await;
    let r = ArmedNode::start("api-down-taint", 30, 90).await;
    let (admin, node, peer) = (&r.admin, &r.node, &r.peer);

    let outage = tokio::task::spawn_blocking(|| Outage::begin("kube-apiserver"))
        .await
        .unwrap();
    peer.prepare_for_shutdown(true).await;
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    tokio::task::spawn_blocking(move || outage.end())
        .await
        .unwrap();
    let back = t0.elapsed();
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(admin.clone());
    eventually(
        Duration::from_secs(15),
        "the node tainted once the API server is back",
        || async {
            nodes
                .get(&node.name)
                .await
                .is_ok_and(|n| has_taint(&n, "nodeguard.io/shutdown"))
        },
    )
    .await;
    let tainted = t0.elapsed();
    assert_eq!(peer.held(), 1, "the shutdown is still in its groups");
    // A cancel: the taint is nodeguard's and goes.
    peer.prepare_for_shutdown(false).await;
    eventually(
        Duration::from_secs(15),
        "the cancel removes nodeguard's taint",
        || async {
            nodes
                .get(&node.name)
                .await
                .is_ok_and(|n| !has_taint(&n, "nodeguard.io/shutdown"))
        },
    )
    .await;
    eprintln!(
        "API server back {back:?} into the shutdown; node tainted at {tainted:?}; untainted after the cancel"
    );
    r.clean_up().await;
}

/// Review finding: the first start after a reboot, with the API server
/// away for longer than the taint removal's retries (a whole-cluster or
/// control-plane reboot). The agent gave up, deleted its record, and the
/// node kept `nodeguard.io/shutdown` for good. Now it gives up waiting
/// (about 10 s), arms, and removes the taint in the background once the
/// API server is back.
#[tokio::test]
async fn a_shutdown_taint_the_api_server_was_away_for_is_removed_once_it_is_back() {
    use support::dbus::{LogindPeer, PrivateBus};

    let _turn = API_DOWN.lock().await;
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "api-away-untaint").await;
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(admin.clone());
    nodes
        .patch(
            &node.name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({"spec": {"taints": [
                {"key": "nodeguard.io/shutdown", "value": "shutting-down", "effect": "NoSchedule"}
            ]}})),
        )
        .await
        .unwrap();
    let bus = PrivateBus::start();
    let peer = LogindPeer::start(&bus.address, Duration::from_secs(60), None).await;
    let policy = unique_name("api-away-untaint");
    apply_policy(
        &admin,
        &policy,
        serde_json::json!({
            "nodeSelector": selecting(&node.name),
            "shutdown": {"gracePeriodByPriority": [{"priority": 0, "gracePeriodSeconds": 5}]},
        }),
    )
    .await;
    let outage = tokio::task::spawn_blocking(|| Outage::begin("kube-apiserver"))
        .await
        .unwrap();
    let address = bus.address.clone();
    // The record of the previous boot's shutdown, whose taint it added.
    let (agent, _state) = start_agent_with(admin.clone(), &node.name, move |c| {
        c.system_bus_address = Some(address);
        c.boot_id = "this-boot".into();
        std::fs::write(
            c.state_dir.join("shutdown-state.json"),
            serde_json::json!({
                "bootId": "previous-boot", "startedAt": "2026-11-01T00:00:00Z",
                "endedAt": "2026-11-01T00:00:09Z", "groupsDone": [0],
                "taintAdded": true, "taintAnswered": true,
            })
            .to_string(),
        )
        .unwrap();
    })
    .await;
    // Longer than the removal's retries at start: about 10 s now, 81 s
    // before (whose record then went, and the taint stayed).
    tokio::time::sleep(Duration::from_secs(95)).await;
    tokio::task::spawn_blocking(move || outage.end())
        .await
        .unwrap();
    let back = Instant::now();
    eventually(
        Duration::from_secs(30),
        "the taint removed once the API server is back",
        || async {
            nodes
                .get(&node.name)
                .await
                .is_ok_and(|n| !has_taint(&n, "nodeguard.io/shutdown"))
        },
    )
    .await;
    let removed = back.elapsed();
    eventually(Duration::from_secs(15), "inhibitor taken", || {
        std::future::ready(peer.held() == 1)
    })
    .await;
    eprintln!("taint removed {removed:?} after the API server was back");
    agent.stop().await;
    let api: Api<nodeguard::policy::NodeGuardPolicy> = Api::all(admin.clone());
    let _ = api.delete(&policy, &Default::default()).await;
}

/// A list or watch of nodes as [`RefuseNodes`] saw it.
#[derive(Clone, Debug)]
struct NodesRequest {
    sent: Instant,
    /// Sent as a user without rights.
    impersonated: bool,
    /// When its response's head came, and its status.
    answered: Option<(Instant, u16)>,
}

/// Once armed, sends each list or watch of nodes as a user the API server
/// gives no rights, until `refusals` of them have been answered 403: real
/// refusals from the real API server, the way one that has just started
/// answers until its RBAC cache is loaded. Requests that reach no server
/// (an outage) use none up. Logs every request for nodes.
#[derive(Clone, Default)]
struct Refusals {
    armed: Arc<AtomicBool>,
    refusals: u32,
    refused: Arc<AtomicU32>,
    log: Arc<Mutex<Vec<NodesRequest>>>,
}

#[derive(Clone)]
struct RefuseNodes<S> {
    inner: S,
    refusals: Refusals,
}

impl<S, B> tower::Service<http::Request<kube::client::Body>> for RefuseNodes<S>
where
    S: tower::Service<http::Request<kube::client::Body>, Response = http::Response<B>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = futures::future::BoxFuture<'static, Result<S::Response, S::Error>>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<kube::client::Body>) -> Self::Future {
        if req.uri().path() != "/api/v1/nodes" {
            return Box::pin(self.inner.call(req));
        }
        let r = self.refusals.clone();
        let impersonated = r.armed.load(SeqCst) && r.refused.load(SeqCst) < r.refusals;
        if impersonated {
            req.headers_mut().insert(
                "Impersonate-User",
                http::HeaderValue::from_static("nodeguard-test:no-rights"),
            );
        }
        let index = {
            let mut log = r.log.lock().unwrap();
            log.push(NodesRequest {
                sent: Instant::now(),
                impersonated,
                answered: None,
            });
            log.len() - 1
        };
        let response = self.inner.call(req);
        Box::pin(async move {
            let response = response.await;
            if let Ok(resp) = &response {
                let status = resp.status().as_u16();
                r.log.lock().unwrap()[index].answered = Some((Instant::now(), status));
                if impersonated && status == 403 {
                    r.refused.fetch_add(1, SeqCst);
                }
            }
            response
        })
    }
}

/// An API server that has just started refuses a request or two (403 to
/// everyone until its RBAC cache is loaded; here made certain by sending
/// those requests as a user without rights). After a 30 s outage has grown
/// the watch's backoff to its 8 s cap, two refusals in a row keep it there:
/// 4–8 s before each next attempt. Taking each refusal for a missing RBAC
/// rule (the 60 s cap from the first) made the delay after the second
/// 8–16 s, and 16–32 s after a third.
#[tokio::test]
async fn refusals_from_a_just_restarted_api_server_keep_the_short_backoff() {
    use k8s_openapi::api::core::v1::Node;
    use kube::runtime::watcher;
    use nodeguard::k8s::watch::{Snapshot, keep_whole, watch_objects};

    let _turn = API_DOWN.lock().await;
    let admin = admin_client().await;
    let node = TestNode::create(&admin, "refused", &[]).await;

    let refusals = Refusals {
        refusals: 2,
        ..Refusals::default()
    };
    let layer = {
        let refusals = refusals.clone();
        tower::layer::layer_fn(move |inner| RefuseNodes {
            inner,
            refusals: refusals.clone(),
        })
    };
    let client: kube::Client = kube::client::ClientBuilder::try_from(admin_config().await)
        .unwrap()
        .with_layer(&layer)
        .build();
    // The mark label of the Node as the watch last delivered it.
    let seen = Arc::new(Mutex::new(None::<String>));
    let health = nodeguard::server::Health::new();
    let stop = tokio_util::sync::CancellationToken::new();
    let task = {
        let (handle, stop, seen) = (
            health.register("refused", Duration::from_secs(300)),
            stop.clone(),
            seen.clone(),
        );
        let fields = format!("metadata.name={}", node.name);
        tokio::spawn(async move {
            watch_objects(
                Api::<Node>::all(client),
                watcher::Config::default().fields(&fields),
                keep_whole,
                handle,
                stop,
                move |nodes: &Snapshot<Node>| {
                    *seen.lock().unwrap() = nodes
                        .values()
                        .next()
                        .and_then(|n| n.metadata.labels.as_ref())
                        .and_then(|l| l.get("nodeguard.io/mark").cloned());
                },
            )
            .await
        })
    };
    eventually(Duration::from_secs(20), "first list", || {
        std::future::ready(health.report().loops["refused"].synced)
    })
    .await;

    let outage = Outage::begin("kube-apiserver");
    tokio::time::sleep(Duration::from_secs(30)).await;
    // Armed before the start: the first requests the new server answers
    // are the refused ones.
    let outage_requests = refusals.log.lock().unwrap().len();
    refusals.armed.store(true, SeqCst);
    outage.end();

    // Two refusals in a row, then a request sent as the agent.
    let pair = |log: &[NodesRequest]| {
        let refused = |r: &NodesRequest| r.impersonated && r.answered.is_some_and(|a| a.1 == 403);
        (0..log.len().saturating_sub(2))
            .find(|&i| refused(&log[i]) && refused(&log[i + 1]) && !log[i + 2].impersonated)
    };
    eventually(
        Duration::from_secs(60),
        "two refusals in a row, then the agent's own request",
        || std::future::ready(pair(&refusals.log.lock().unwrap()).is_some()),
    )
    .await;
    let log = refusals.log.lock().unwrap().clone();
    let i = pair(&log).unwrap();
    let answered = |r: &NodesRequest| r.answered.unwrap().0;
    let after_first = log[i + 1].sent - answered(&log[i]);
    let after_second = log[i + 2].sent - answered(&log[i + 1]);
    eprintln!(
        "{outage_requests} requests before the outage ended; then: {:?}; delay after the first refusal {after_first:?}, after the second {after_second:?}",
        log[outage_requests..]
            .iter()
            .map(|r| (r.impersonated, r.answered.map(|a| a.1)))
            .collect::<Vec<_>>()
    );
    // The short cap (8 s, jittered down to half at most) after each.
    assert!(
        after_first <= Duration::from_millis(8100),
        "delay after the first refusal: {after_first:?}, over the 8 s cap"
    );
    assert!(
        after_second <= Duration::from_millis(8100),
        "delay after the second refusal: {after_second:?}, over the 8 s cap"
    );
    // And at that cap: the backoff the outage grew was kept, not reset.
    assert!(
        after_second >= Duration::from_millis(3900),
        "delay after the second refusal: {after_second:?}, under half the 8 s cap: the backoff was reset"
    );

    // The watch works again: a label set now reaches it (the agent's own
    // watch may first be told its revision is gone, and relist after one
    // more short delay).
    let nodes: Api<Node> = Api::all(admin.clone());
    nodes
        .patch(
            &node.name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(
                serde_json::json!({"metadata": {"labels": {"nodeguard.io/mark": "after"}}}),
            ),
        )
        .await
        .unwrap();
    eventually(
        Duration::from_secs(15),
        "the label through the watch",
        || std::future::ready(seen.lock().unwrap().as_deref() == Some("after")),
    )
    .await;
    stop.cancel();
    task.await.unwrap();
}

/// `requireApiServer` fences a node cut off from the API server; it does
/// not judge the control plane. While etcd is down, every API server's
/// plain `/livez` fails (500, `[-]etcd failed`), and a probe of it would
/// withhold every such node's pets, resetting the fleet once the outage
/// outlasts the watchdog's timeout. The agent's pets go on here through an
/// outage of four times its systemd watchdog's timeout (2 s), none skipped
/// for the API server, the probe's own path is answered 200, and the 500
/// the API server writes itself counts as an answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watchdogs_pets_go_on_while_etcd_is_down() {
    let _turn = API_DOWN.lock().await;
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "etcd-down").await;
    let policy = unique_name("etcd-down");
    apply_policy(
        &admin,
        &policy,
        serde_json::json!({
            "nodeSelector": selecting(&node.name),
            "watchdog": {"requireApiServer": true},
        }),
    )
    .await;
    let (agent, _state, notify) =
        agent_under_systemd_watchdog(admin.clone(), &admin, &node.name, &policy).await;
    let skipped = || api_server_skips(agent.addr);
    assert_eq!(skipped().await, Some(0.0), "served, and no pet skipped yet");

    // etcd brought back however the test ends (`start etcd` waits for the
    // API server's /readyz): the tests after this one find the control
    // plane whole.
    let outage = tokio::task::spawn_blocking(|| Outage::begin("etcd"))
        .await
        .unwrap();
    let get = |path: &'static str| {
        let admin = admin.clone();
        async move {
            let req = http::Request::get(path).body(Vec::new()).unwrap();
            let resp = admin.send(req.map(Into::into)).await.unwrap();
            let code = resp.status().as_u16();
            (
                code,
                resp.into_body().collect_bytes().await.unwrap_or_default(),
            )
        }
    };
    let until = Instant::now() + Duration::from_secs(30);
    let (code, body) = loop {
        let (code, body) = get("/livez").await;
        if code == 500 && String::from_utf8_lossy(&body).contains("[-]etcd failed") {
            break (code, body);
        }
        assert!(
            Instant::now() < until,
            "/livez still answers {code} 30 s after etcd stopped: {:?}",
            String::from_utf8_lossy(&body)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // Four times the watchdog's timeout with etcd down, /livez failing;
    // each gap counted, the one after the last pet too, so a probe that
    // began to hang inside the window shows.
    let down = Instant::now();
    let window = Duration::from_secs(8);
    tokio::time::sleep(window).await;
    let end = Instant::now();
    let pets: Vec<Instant> = notify
        .times("WATCHDOG=1")
        .into_iter()
        .filter(|t| *t >= down && *t <= end)
        .collect();
    let mut gaps = vec![pets.first().map_or(end - down, |t| *t - down)];
    gaps.extend(pets.windows(2).map(|w| w[1] - w[0]));
    gaps.push(pets.last().map_or(Duration::ZERO, |t| end - *t));
    let skipped_down = skipped().await;
    // What the agent's probe asks, answered 200 with etcd down; plain
    // /livez still failing.
    let (probe_path, _) = get(nodeguard::watchdog::core::API_PROBE_PATH).await;
    let (still, _) = get("/livez").await;

    tokio::task::spawn_blocking(move || outage.end())
        .await
        .unwrap();
    eprintln!(
        "etcd down: /livez answered {code} then {still}, {} {probe_path}; {} WATCHDOG=1 in {window:?}, gaps {gaps:?}; skipped for the API server: {skipped_down:?}",
        nodeguard::watchdog::core::API_PROBE_PATH,
        pets.len()
    );
    assert_eq!(still, 500, "etcd still down at the end of the window");
    assert!(
        pets.len() >= 6 && gaps.iter().all(|g| *g < Duration::from_secs(2)),
        "the pets must go on with etcd down: {} in {window:?}, gaps {gaps:?}",
        pets.len()
    );
    assert_eq!(skipped_down, Some(0.0), "no pet skipped for the API server");
    assert_eq!(probe_path, 200, "the probe's path with etcd down");
    assert!(
        nodeguard::watchdog::core::api_answered(code, &body),
        "the API server's own failing /livez counts as an answer: {:?}",
        String::from_utf8_lossy(&body)
    );
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}
