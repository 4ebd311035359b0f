//! Probes against real local HTTP, TCP and gRPC (tonic-health) servers and
//! the real control plane: NodeConditions from node probes (seen in
//! `kubectl describe node`), a pod readiness gate that follows its probe,
//! and policy edits that restart only the changed worker.

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use support::*;

/// An HTTP server whose /healthz answers 200 or 503.
async fn http_server(healthy: Arc<AtomicBool>) -> SocketAddr {
    use axum::routing::get;
    let app = axum::Router::new().route(
        "/healthz",
        get(move || {
            let healthy = healthy.clone();
            async move {
                if healthy.load(Ordering::SeqCst) {
                    (axum::http::StatusCode::OK, "ok")
                } else {
                    (axum::http::StatusCode::SERVICE_UNAVAILABLE, "sick")
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// A real gRPC health server (tonic-health); returns its address and the
/// reporter that flips its status.
async fn grpc_server() -> (SocketAddr, tonic_health::server::HealthReporter) {
    let (reporter, service) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = tokio_stream_compat(listener);
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(incoming)
            .await
            .unwrap();
    });
    (addr, reporter)
}

fn tokio_stream_compat(
    listener: tokio::net::TcpListener,
) -> impl futures::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    futures::stream::unfold(listener, |l| async move {
        let r = l.accept().await.map(|(s, _)| s);
        Some((r, l))
    })
}

async fn labelled_node(admin: &Client, prefix: &str) -> TestNode {
    TestNode::selectable(admin, prefix).await
}

async fn apply_probes(admin: &Client, name: &str, node: &str, probes: serde_json::Value) {
    apply_policy(
        admin,
        name,
        serde_json::json!({"nodeSelector": selecting(node), "probes": probes}),
    )
    .await;
}

/// The conditions of the three node-local probes in the first test.
const LOCAL_PROBE_CONDITIONS: [&str; 3] = [
    "LocalHttpUnhealthy",
    "LocalTcpUnhealthy",
    "LocalGrpcUnhealthy",
];

#[tokio::test]
async fn node_probes_flip_their_conditions_visible_in_describe() {
    let admin = admin_client().await;
    let node = labelled_node(&admin, "nodeprobe").await;
    let healthy = Arc::new(AtomicBool::new(true));
    let http = http_server(healthy.clone()).await;
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let tcp_port = tcp.local_addr().unwrap().port();
    let (grpc, grpc_health) = grpc_server().await;
    let policy = unique_name("probes");
    apply_probes(
        &admin,
        &policy,
        &node.name,
        serde_json::json!([
            {"name": "local-http", "http": {"url": format!("http://{http}/healthz")}, "periodSeconds": 1,
             "failureThreshold": 2, "conditionType": "LocalHttpUnhealthy"},
            {"name": "local-tcp", "tcp": {"port": tcp_port}, "periodSeconds": 1, "failureThreshold": 1,
             "conditionType": "LocalTcpUnhealthy"},
            {"name": "local-grpc", "grpc": {"port": grpc.port()}, "periodSeconds": 1, "failureThreshold": 1,
             "conditionType": "LocalGrpcUnhealthy"},
        ]),
    )
    .await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;
    for t in LOCAL_PROBE_CONDITIONS {
        wait_condition(
            &admin,
            &node.name,
            t,
            "False",
            Duration::from_secs(15),
            &format!("{t}=False"),
        )
        .await;
    }
    // Break all three.
    healthy.store(false, Ordering::SeqCst);
    drop(tcp);
    grpc_health
        .set_service_status("", tonic_health::ServingStatus::NotServing)
        .await;
    for t in LOCAL_PROBE_CONDITIONS {
        wait_condition(
            &admin,
            &node.name,
            t,
            "True",
            Duration::from_secs(10),
            &format!("{t}=True"),
        )
        .await;
    }
    let out = kubectl(&["describe", "node", &node.name]);
    let row = out
        .lines()
        .find(|l| l.trim_start().starts_with("LocalHttpUnhealthy"))
        .unwrap_or_else(|| panic!("no row:\n{out}"));
    assert!(
        row.contains("True") && row.contains("LocalHttpProbeFailed") && row.contains("HTTP 503"),
        "{row}"
    );
    let grpc_row = out
        .lines()
        .find(|l| l.trim_start().starts_with("LocalGrpcUnhealthy"))
        .unwrap();
    assert!(grpc_row.contains("NOT_SERVING"), "{grpc_row}");
    eprintln!("{row}\n{grpc_row}");
    // Heal the HTTP one: it clears.
    healthy.store(true, Ordering::SeqCst);
    wait_condition(
        &admin,
        &node.name,
        "LocalHttpUnhealthy",
        "False",
        Duration::from_secs(10),
        "LocalHttpUnhealthy=False again",
    )
    .await;
    let (_, metrics) = http_get(agent.addr, "/metrics").await;
    assert!(
        metrics.contains(
            "nodeguard_probe_total{probe=\"local-http\",target=\"node\",result=\"failure\"}"
        ),
        "{metrics}"
    );
    assert!(metrics.contains("nodeguard_probe_duration_seconds_bucket{"));

    // Removing a probe from the policy removes its condition.
    apply_probes(
        &admin,
        &policy,
        &node.name,
        serde_json::json!([
            {"name": "local-http", "http": {"url": format!("http://{http}/healthz")}, "periodSeconds": 1,
             "failureThreshold": 2, "conditionType": "LocalHttpUnhealthy"},
        ]),
    )
    .await;
    eventually(
        Duration::from_secs(10),
        "LocalTcpUnhealthy removed",
        || async {
            condition_status(&admin, &node.name, "LocalTcpUnhealthy")
                .await
                .is_none()
                && condition_status(&admin, &node.name, "LocalGrpcUnhealthy")
                    .await
                    .is_none()
        },
    )
    .await;
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

async fn pod_gate(admin: &Client, pod: &str, gate: &str) -> Option<String> {
    let pods: Api<Pod> = Api::namespaced(admin.clone(), TEST_NAMESPACE);
    pods.get_status(pod)
        .await
        .ok()?
        .status?
        .conditions?
        .into_iter()
        .find(|c| c.type_ == gate)
        .map(|c| c.status)
}

#[tokio::test]
async fn a_pod_readiness_gate_follows_its_probe() {
    let admin = admin_client().await;
    let node = labelled_node(&admin, "gate").await;
    let healthy = Arc::new(AtomicBool::new(true));
    let http = http_server(healthy.clone()).await;
    let gate = "nodeguard.io/deep-check";
    let app = unique_name("app");
    let pod_name = unique_name("gated");
    let pods: Api<Pod> = Api::namespaced(admin.clone(), TEST_NAMESPACE);
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": pod_name, "labels": {"app": app}},
        "spec": {"nodeName": node.name, "readinessGates": [{"conditionType": gate}],
                 "containers": [{"name": "c", "image": "example.invalid/app"}]},
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    // As a kubelet would: running, with an IP (loopback, where the server is).
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let status = serde_json::json!({"status": {"phase": "Running", "podIP": "127.0.0.1", "startTime": now,
        "conditions": [{"type": "ContainersReady", "status": "True", "lastTransitionTime": now}]}});
    pods.patch_status(&pod_name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
    let policy = unique_name("gate");
    apply_probes(
        &admin,
        &policy,
        &node.name,
        serde_json::json!([
            {"name": "deep", "pods": {"selector": {"matchLabels": {"app": app}}},
             "http": {"port": http.port(), "path": "/healthz"}, "periodSeconds": 1, "failureThreshold": 2,
             "readinessGate": gate},
        ]),
    )
    .await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;
    eventually(Duration::from_secs(15), "gate True", || async {
        pod_gate(&admin, &pod_name, gate).await.as_deref() == Some("True")
    })
    .await;
    healthy.store(false, Ordering::SeqCst);
    let broke = std::time::Instant::now();
    eventually(
        Duration::from_secs(10),
        "gate False after 2 failures",
        || async { pod_gate(&admin, &pod_name, gate).await.as_deref() == Some("False") },
    )
    .await;
    let took = broke.elapsed();
    eprintln!("gate False {took:?} after the server broke (period 1 s, failureThreshold 2)");
    assert!(
        took >= Duration::from_millis(900),
        "not before the second failure: {took:?}"
    );
    healthy.store(true, Ordering::SeqCst);
    eventually(Duration::from_secs(10), "gate True again", || async {
        pod_gate(&admin, &pod_name, gate).await.as_deref() == Some("True")
    })
    .await;
    // Only our condition type was written: the kubelet's stays.
    let conds = pods
        .get_status(&pod_name)
        .await
        .unwrap()
        .status
        .unwrap()
        .conditions
        .unwrap();
    assert!(conds.iter().any(|c| c.type_ == "ContainersReady"));
    agent.stop().await;
    let _ = pods
        .delete(&pod_name, &DeleteParams::default().grace_period(0))
        .await;
    delete_policy(&admin, &policy).await;
}

#[tokio::test]
async fn changing_one_probe_restarts_only_its_worker() {
    let admin = admin_client().await;
    let node = labelled_node(&admin, "restart-one").await;
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = tcp.local_addr().unwrap().port();
    let policy = unique_name("two");
    let probes = |period_b: u32| {
        serde_json::json!([
            {"name": "a", "tcp": {"port": port}, "periodSeconds": 5, "conditionType": "ProbeAUnhealthy"},
            {"name": "b", "tcp": {"port": port}, "periodSeconds": period_b, "conditionType": "ProbeBUnhealthy"},
        ])
    };
    apply_probes(&admin, &policy, &node.name, probes(5)).await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;
    let key = |p: &str| (p.to_string(), "node".to_string());
    eventually(Duration::from_secs(15), "two workers", || {
        std::future::ready(agent.probes.workers().len() == 2)
    })
    .await;
    let before = agent.probes.workers();
    apply_probes(&admin, &policy, &node.name, probes(7)).await;
    eventually(Duration::from_secs(10), "worker b restarted", || {
        let w = agent.probes.workers();
        std::future::ready(
            w.get(&key("b"))
                .is_some_and(|g| Some(g) != before.get(&key("b"))),
        )
    })
    .await;
    let after = agent.probes.workers();
    assert_eq!(
        after.get(&key("a")),
        before.get(&key("a")),
        "worker a untouched: {before:?} -> {after:?}"
    );
    assert!(
        agent.probes.trigger("a", "node"),
        "a manual trigger reaches the worker"
    );
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

/// An HTTP endpoint that logs every request (when, and whether it passed):
/// it answers 503 to its first `fail_first` requests and while unhealthy,
/// 200 otherwise.
#[derive(Clone)]
struct Endpoint {
    healthy: Arc<AtomicBool>,
    fail_first: usize,
    log: Arc<std::sync::Mutex<Vec<(std::time::Instant, bool)>>>,
}

impl Endpoint {
    fn new(healthy: bool, fail_first: usize) -> Self {
        Endpoint {
            healthy: Arc::new(AtomicBool::new(healthy)),
            fail_first,
            log: Arc::default(),
        }
    }

    async fn serve(&self) -> SocketAddr {
        use axum::routing::get;
        let this = self.clone();
        let app = axum::Router::new().route(
            "/healthz",
            get(move || {
                let this = this.clone();
                async move {
                    let mut log = this.log.lock().unwrap();
                    let pass = this.healthy.load(Ordering::SeqCst) && log.len() >= this.fail_first;
                    log.push((std::time::Instant::now(), pass));
                    if pass {
                        (axum::http::StatusCode::OK, "ok")
                    } else {
                        (axum::http::StatusCode::SERVICE_UNAVAILABLE, "sick")
                    }
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        addr
    }

    fn set_healthy(&self, healthy: bool) {
        self.healthy.store(healthy, Ordering::SeqCst);
    }

    fn requests(&self) -> Vec<(std::time::Instant, bool)> {
        self.log.lock().unwrap().clone()
    }

    fn first_pass(&self) -> Option<std::time::Instant> {
        self.requests()
            .iter()
            .find(|(_, pass)| *pass)
            .map(|(t, _)| *t)
    }

    fn passes(&self) -> usize {
        self.requests().iter().filter(|(_, pass)| *pass).count()
    }

    /// Requests served at or after `since`: (all, failed).
    fn since(&self, since: std::time::Instant) -> (usize, usize) {
        let r: Vec<_> = self
            .requests()
            .into_iter()
            .filter(|(t, _)| *t >= since)
            .collect();
        (r.len(), r.iter().filter(|(_, pass)| !pass).count())
    }
}

#[tokio::test]
async fn a_node_startup_probe_runs_until_it_passes_then_opens_its_gate() {
    let admin = admin_client().await;
    let node = labelled_node(&admin, "startup").await;
    let boot = Endpoint::new(false, 0);
    let boot_addr = boot.serve().await;
    let app = Endpoint::new(true, 0);
    let app_addr = app.serve().await;
    let policy = unique_name("startup");
    apply_probes(
        &admin,
        &policy,
        &node.name,
        serde_json::json!([
            {"name": "boot", "role": "Startup", "http": {"url": format!("http://{boot_addr}/healthz")},
             "periodSeconds": 1, "failureThreshold": 2, "conditionType": "BootNotStarted"},
            {"name": "app", "gatedBy": "boot", "http": {"url": format!("http://{app_addr}/healthz")},
             "periodSeconds": 1, "failureThreshold": 1, "conditionType": "AppUnhealthy"},
        ]),
    )
    .await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;
    // The startup probe runs, and on a node it keeps running after
    // failing past its threshold (nothing to restart).
    wait_condition(
        &admin,
        &node.name,
        "BootNotStarted",
        "True",
        Duration::from_secs(20),
        "the startup probe failed twice: BootNotStarted=True",
    )
    .await;
    assert_eq!(app.requests().len(), 0, "the gated probe waits");
    assert_eq!(
        condition_status(&admin, &node.name, "AppUnhealthy").await,
        None,
        "nothing written for a probe that has not run"
    );
    boot.set_healthy(true);
    wait_condition(
        &admin,
        &node.name,
        "AppUnhealthy",
        "False",
        Duration::from_secs(15),
        "the gated probe ran and passed: AppUnhealthy=False",
    )
    .await;
    assert!(condition_is(&admin, &node.name, "BootNotStarted", "False").await);
    let opened = boot.first_pass().expect("the startup probe passed");
    let (first_app, _) = app.requests()[0];
    assert!(
        first_app > opened,
        "the gated probe ran only after the startup probe passed"
    );
    // Started: the startup probe is not run again while the gated one is.
    let seen = app.requests().len();
    eventually(Duration::from_secs(15), "three more gated probes", || {
        std::future::ready(app.requests().len() >= seen + 3)
    })
    .await;
    assert_eq!(boot.passes(), 1, "{:?}", boot.requests());
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

/// Creates a pod on `node` listing `gates`, then makes it Running on
/// 127.0.0.1 as a kubelet would.
async fn running_gated_pod(admin: &Client, node: &str, name: &str, app: &str, gates: &[&str]) {
    let pods: Api<Pod> = Api::namespaced(admin.clone(), TEST_NAMESPACE);
    let gates: Vec<serde_json::Value> = gates
        .iter()
        .map(|g| serde_json::json!({"conditionType": g}))
        .collect();
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": app}},
        "spec": {"nodeName": node, "readinessGates": gates,
                 "containers": [{"name": "c", "image": "example.invalid/app"}]},
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    set_pod_phase(admin, name, "Running").await;
}

async fn set_pod_phase(admin: &Client, name: &str, phase: &str) {
    let pods: Api<Pod> = Api::namespaced(admin.clone(), TEST_NAMESPACE);
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let status =
        serde_json::json!({"status": {"phase": phase, "podIP": "127.0.0.1", "startTime": now}});
    pods.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
}

async fn delete_pod(admin: &Client, name: &str) {
    let pods: Api<Pod> = Api::namespaced(admin.clone(), TEST_NAMESPACE);
    let _ = pods
        .delete(name, &DeleteParams::default().grace_period(0))
        .await;
}

#[tokio::test]
async fn a_pod_startup_probe_opens_the_readiness_gate_probe_after_it() {
    let admin = admin_client().await;
    let node = labelled_node(&admin, "pod-startup").await;
    let boot = Endpoint::new(true, 3); // fails 3 times, then passes
    let boot_port = boot.serve().await.port();
    let ready = Endpoint::new(true, 0);
    let ready_port = ready.serve().await.port();
    let app = unique_name("app");
    let pod_name = unique_name("starting");
    let (started, deep) = ("nodeguard.io/started", "nodeguard.io/deep");
    running_gated_pod(&admin, &node.name, &pod_name, &app, &[started, deep]).await;
    let policy = unique_name("pod-startup");
    apply_probes(
        &admin,
        &policy,
        &node.name,
        serde_json::json!([
            {"name": "boot", "role": "Startup", "pods": {"selector": {"matchLabels": {"app": app}}},
             "http": {"port": boot_port, "path": "/healthz"}, "periodSeconds": 1, "failureThreshold": 10,
             "readinessGate": started},
            {"name": "deep", "gatedBy": "boot", "pods": {"selector": {"matchLabels": {"app": app}}},
             "http": {"port": ready_port, "path": "/healthz"}, "periodSeconds": 1, "failureThreshold": 1,
             "readinessGate": deep},
        ]),
    )
    .await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;
    eventually(
        Duration::from_secs(30),
        "the gated readiness gate True",
        || async { pod_gate(&admin, &pod_name, deep).await.as_deref() == Some("True") },
    )
    .await;
    assert_eq!(
        pod_gate(&admin, &pod_name, started).await.as_deref(),
        Some("True")
    );
    let opened = boot.first_pass().expect("the startup probe passed");
    assert_eq!(boot.requests().len(), 4, "3 failures, then one pass");
    let (first_deep, _) = ready.requests()[0];
    assert!(
        first_deep > opened,
        "the gated probe ran only after the startup probe passed"
    );
    agent.stop().await;
    delete_pod(&admin, &pod_name).await;
    delete_policy(&admin, &policy).await;
}

#[tokio::test]
async fn a_liveness_probe_on_the_node_clears_when_the_endpoint_recovers() {
    let admin = admin_client().await;
    let node = labelled_node(&admin, "liveness").await;
    let ep = Endpoint::new(true, 0);
    let addr = ep.serve().await;
    let policy = unique_name("liveness");
    apply_probes(
        &admin,
        &policy,
        &node.name,
        serde_json::json!([
            {"name": "live", "role": "Liveness", "http": {"url": format!("http://{addr}/healthz")},
             "periodSeconds": 1, "failureThreshold": 2, "conditionType": "LiveUnhealthy"},
        ]),
    )
    .await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;
    let t = "LiveUnhealthy";
    wait_condition(
        &admin,
        &node.name,
        t,
        "False",
        Duration::from_secs(15),
        "passing",
    )
    .await;
    ep.set_healthy(false);
    wait_condition(
        &admin,
        &node.name,
        t,
        "True",
        Duration::from_secs(15),
        "failing",
    )
    .await;
    ep.set_healthy(true);
    wait_condition(
        &admin,
        &node.name,
        t,
        "False",
        Duration::from_secs(15),
        "cleared when the endpoint recovered (no on-hold on a node)",
    )
    .await;
    let c = &node_conditions(&admin, &node.name, t).await[0];
    assert_eq!(c.reason.as_deref(), Some("LiveProbePassed"));
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

/// Runs a first agent until the probe's condition says the endpoint
/// passes, stops it, breaks the endpoint and starts a second agent at
/// `restart`. Polls the condition until it turns True and returns the
/// endpoint's requests after the restart (all, failed) read right after
/// seeing it; asserts it said False (carried over) at every poll before.
async fn restart_with_a_failing_endpoint(
    prefix: &str,
    initial_delay: u32,
    failure_threshold: u32,
) -> (std::time::Instant, Endpoint, (usize, usize)) {
    let admin = admin_client().await;
    let node = labelled_node(&admin, prefix).await;
    let ep = Endpoint::new(true, 0);
    let addr = ep.serve().await;
    let policy = unique_name(prefix);
    let t = "RestartedUnhealthy";
    apply_probes(
        &admin,
        &policy,
        &node.name,
        serde_json::json!([
            {"name": "restarted", "http": {"url": format!("http://{addr}/healthz")}, "periodSeconds": 1,
             "initialDelaySeconds": initial_delay, "failureThreshold": failure_threshold, "conditionType": t},
        ]),
    )
    .await;
    let (first, _state) = start_agent(admin.clone(), &node.name).await;
    wait_condition(
        &admin,
        &node.name,
        t,
        "False",
        Duration::from_secs(20),
        "passing",
    )
    .await;
    first.stop().await;
    ep.set_healthy(false);
    let restart = std::time::Instant::now();
    let (second, _state2) = start_agent(admin.clone(), &node.name).await;
    let when_true = std::sync::Mutex::new(None);
    eventually(
        Duration::from_secs(30),
        "the condition turns True",
        || async {
            match condition_status(&admin, &node.name, t).await.as_deref() {
                Some("True") => {
                    // Read after: at least what made the agent write True.
                    *when_true.lock().unwrap() = Some(ep.since(restart));
                    true
                }
                Some("False") => false,
                other => panic!("{t} was {other:?} before turning True"),
            }
        },
    )
    .await;
    let when_true = when_true.into_inner().unwrap();
    second.stop().await;
    delete_policy(&admin, &policy).await;
    (restart, ep, when_true.unwrap())
}

#[tokio::test]
async fn one_failure_after_a_restart_does_not_flip_a_carried_over_condition() {
    let (_, _, (_, failed)) = restart_with_a_failing_endpoint("one-failure", 0, 3).await;
    assert!(
        failed >= 3,
        "the condition turned True after {failed} failure(s) since the restart; the threshold is 3"
    );
}

#[tokio::test]
async fn after_the_initial_delay_a_result_equal_to_the_initial_value_is_written() {
    // Readiness starts as Failure; the endpoint fails after the restart: the
    // carried-over False stays through the delay, then the real failure
    // replaces it.
    let (restart, ep, (_, failed)) = restart_with_a_failing_endpoint("delay", 3, 1).await;
    assert!(failed >= 1);
    let (first, _) = *ep.requests().iter().find(|(t, _)| *t >= restart).unwrap();
    assert!(
        first - restart >= Duration::from_secs(3),
        "probed {:?} after the restart, before the initial delay",
        first - restart
    );
}

#[tokio::test]
async fn renaming_a_conditiontype_removes_the_old_condition() {
    let admin = admin_client().await;
    let node = labelled_node(&admin, "rename").await;
    let ep = Endpoint::new(true, 0);
    let addr = ep.serve().await;
    let policy = unique_name("rename");
    let probes = |t: &str| {
        serde_json::json!([
            {"name": "renamed", "http": {"url": format!("http://{addr}/healthz")}, "periodSeconds": 1,
             "failureThreshold": 1, "conditionType": t},
        ])
    };
    apply_probes(&admin, &policy, &node.name, probes("OldNameUnhealthy")).await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;
    wait_condition(
        &admin,
        &node.name,
        "OldNameUnhealthy",
        "False",
        Duration::from_secs(15),
        "the old condition",
    )
    .await;
    apply_probes(&admin, &policy, &node.name, probes("NewNameUnhealthy")).await;
    wait_condition(
        &admin,
        &node.name,
        "NewNameUnhealthy",
        "False",
        Duration::from_secs(15),
        "the new condition",
    )
    .await;
    eventually(
        Duration::from_secs(10),
        "the old condition removed",
        || async {
            condition_status(&admin, &node.name, "OldNameUnhealthy")
                .await
                .is_none()
        },
    )
    .await;
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

#[tokio::test]
async fn a_terminal_pods_worker_is_not_restarted() {
    let admin = admin_client().await;
    let node = labelled_node(&admin, "terminal").await;
    let ep = Endpoint::new(true, 0);
    let port = ep.serve().await.port();
    let app = unique_name("app");
    let gate = "nodeguard.io/terminal-check";
    let (done, other) = (unique_name("done"), unique_name("other"));
    running_gated_pod(&admin, &node.name, &done, &app, &[gate]).await;
    let policy = unique_name("terminal");
    apply_probes(
        &admin,
        &policy,
        &node.name,
        serde_json::json!([
            {"name": "check", "pods": {"selector": {"matchLabels": {"app": app}}},
             "http": {"port": port, "path": "/healthz"}, "periodSeconds": 1, "readinessGate": gate},
        ]),
    )
    .await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;
    let key = |pod: &str| ("check".to_string(), format!("{TEST_NAMESPACE}/{pod}"));
    eventually(Duration::from_secs(15), "gate True", || async {
        pod_gate(&admin, &done, gate).await.as_deref() == Some("True")
    })
    .await;
    let before = agent.probes.workers();
    assert!(before.contains_key(&key(&done)), "{before:?}");
    set_pod_phase(&admin, &done, "Succeeded").await;
    // Another matching pod makes the manager pass again (and again).
    running_gated_pod(&admin, &node.name, &other, &app, &[gate]).await;
    eventually(
        Duration::from_secs(15),
        "the other pod's gate True",
        || async { pod_gate(&admin, &other, gate).await.as_deref() == Some("True") },
    )
    .await;
    eventually(
        Duration::from_secs(10),
        "the terminal pod's worker stopped for good",
        || {
            let w = agent.probes.workers();
            std::future::ready(w.contains_key(&key(&other)) && !w.contains_key(&key(&done)))
        },
    )
    .await;
    // More passes: still no worker for the terminal pod.
    set_pod_phase(&admin, &other, "Running").await;
    let passes_before = agent.probes.workers();
    let pods: Api<Pod> = Api::namespaced(admin.clone(), TEST_NAMESPACE);
    pods.patch(
        &other,
        &PatchParams::default(),
        &Patch::Merge(&serde_json::json!({"metadata": {"labels": {"touched": "yes"}}})),
    )
    .await
    .unwrap();
    eventually(Duration::from_secs(10), "the pod change seen", || {
        std::future::ready(
            agent
                .pods
                .borrow()
                .as_ref()
                .and_then(|p| p.get(&format!("{TEST_NAMESPACE}/{other}")).cloned())
                .is_some_and(|p| {
                    p.metadata
                        .labels
                        .as_ref()
                        .is_some_and(|l| l.contains_key("touched"))
                }),
        )
    })
    .await;
    let after = agent.probes.workers();
    assert!(
        !after.contains_key(&key(&done)),
        "{passes_before:?} -> {after:?}"
    );
    assert_eq!(
        after.get(&key(&other)),
        passes_before.get(&key(&other)),
        "a running pod's worker is left alone"
    );
    agent.stop().await;
    delete_pod(&admin, &done).await;
    delete_pod(&admin, &other).await;
    delete_policy(&admin, &policy).await;
}

/// What [`holding_server`] saw, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Seen {
    /// A request held unanswered.
    Held,
    /// The client of a held request gave up (closed the connection).
    Abandoned,
    /// A request answered 200.
    Served,
}

/// A bare HTTP/1.1 endpoint on loopback: holds the next `hold` requests
/// unanswered until their client gives up, answers the others 200, and
/// logs what it did with the time.
async fn holding_server(
    hold: Arc<std::sync::atomic::AtomicUsize>,
) -> (
    SocketAddr,
    Arc<std::sync::Mutex<Vec<(std::time::Instant, Seen)>>>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let log: Arc<std::sync::Mutex<Vec<(std::time::Instant, Seen)>>> = Arc::default();
    let log2 = log.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                return;
            };
            let (hold, log) = (hold.clone(), log2.clone());
            tokio::spawn(async move {
                let note = |s| log.lock().unwrap().push((std::time::Instant::now(), s));
                let mut head = Vec::new();
                let mut chunk = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&chunk[..n]),
                    }
                }
                let held = hold
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                    .is_ok();
                if held {
                    note(Seen::Held);
                    loop {
                        match conn.read(&mut chunk).await {
                            Ok(0) | Err(_) => break,
                            Ok(_) => {}
                        }
                    }
                    note(Seen::Abandoned);
                    return;
                }
                note(Seen::Served);
                let _ = conn
                    .write_all(
                        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok",
                    )
                    .await;
            });
        }
    });
    (addr, log)
}

#[tokio::test]
async fn a_replaced_worker_abandons_its_probe_before_the_new_one_runs() {
    let admin = admin_client().await;
    let node = labelled_node(&admin, "replace").await;
    let hold = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (addr, log) = holding_server(hold.clone()).await;
    let policy = unique_name("replace");
    let probes = |t: &str| {
        serde_json::json!([
            {"name": "slow", "http": {"url": format!("http://{addr}/healthz")}, "periodSeconds": 1,
             "timeoutSeconds": 60, "failureThreshold": 1, "conditionType": t},
        ])
    };
    apply_probes(&admin, &policy, &node.name, probes("SlowOldUnhealthy")).await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;
    wait_condition(
        &admin,
        &node.name,
        "SlowOldUnhealthy",
        "False",
        Duration::from_secs(15),
        "the first condition",
    )
    .await;
    // The next probe hangs (it would time out after 60 s)...
    hold.store(1, Ordering::SeqCst);
    eventually(Duration::from_secs(10), "a probe held", || {
        std::future::ready(log.lock().unwrap().iter().any(|(_, s)| *s == Seen::Held))
    })
    .await;
    // ...when the probe is changed: the old worker gives it up at once.
    apply_probes(&admin, &policy, &node.name, probes("SlowNewUnhealthy")).await;
    eventually(
        Duration::from_secs(10),
        "the old worker abandoned its probe",
        || {
            std::future::ready(
                log.lock()
                    .unwrap()
                    .iter()
                    .any(|(_, s)| *s == Seen::Abandoned),
            )
        },
    )
    .await;
    wait_condition(
        &admin,
        &node.name,
        "SlowNewUnhealthy",
        "False",
        Duration::from_secs(15),
        "the new condition",
    )
    .await;
    assert_eq!(
        condition_status(&admin, &node.name, "SlowOldUnhealthy").await,
        None
    );
    let log = log.lock().unwrap().clone();
    let abandoned = log.iter().position(|(_, s)| *s == Seen::Abandoned).unwrap();
    let held = log.iter().position(|(_, s)| *s == Seen::Held).unwrap();
    assert!(
        log[held + 1..abandoned].is_empty(),
        "nothing probed while the old worker's probe was in flight: {log:?}"
    );
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

/// The readiness-gate condition `gate` of a pod (status, lastTransitionTime).
async fn gate_condition(
    admin: &Client,
    pod: &str,
    gate: &str,
) -> Option<(String, Option<k8s_openapi::jiff::Timestamp>)> {
    let pods: Api<Pod> = Api::namespaced(admin.clone(), TEST_NAMESPACE);
    pods.get_status(pod)
        .await
        .ok()?
        .status?
        .conditions?
        .into_iter()
        .find(|c| c.type_ == gate)
        .map(|c| (c.status, c.last_transition_time.map(|t| t.0)))
}

/// Sets the pod's one container status, as a kubelet does when it
/// (re)starts the container.
async fn set_container_id(admin: &Client, name: &str, id: &str) {
    let pods: Api<Pod> = Api::namespaced(admin.clone(), TEST_NAMESPACE);
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let status = serde_json::json!({"status": {"containerStatuses": [{
        "name": "c", "image": "example.invalid/app", "imageID": "", "ready": true, "restartCount": 0,
        "containerID": id, "state": {"running": {"startedAt": now}}}]}});
    pods.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
}

/// A gate condition's statuses in order, each with its lastTransitionTime.
type GateLog = Arc<std::sync::Mutex<Vec<(String, Option<k8s_openapi::jiff::Timestamp>)>>>;

/// Every status the pod's `gate` condition had, in order, from a watch on
/// the pod (with each one's lastTransitionTime).
fn record_gate(admin: &Client, pod: &str, gate: &str) -> (GateLog, tokio::task::JoinHandle<()>) {
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, watcher};
    let seen: Arc<std::sync::Mutex<Vec<_>>> = Arc::default();
    let (pods, cfg) = (
        Api::<Pod>::namespaced(admin.clone(), TEST_NAMESPACE),
        watcher::Config::default().fields(&format!("metadata.name={pod}")),
    );
    let (gate, log) = (gate.to_string(), seen.clone());
    let task = tokio::spawn(async move {
        let mut stream = watcher(pods, cfg).applied_objects().boxed();
        while let Some(Ok(p)) = stream.next().await {
            let c = p
                .status
                .and_then(|s| s.conditions)
                .into_iter()
                .flatten()
                .find(|c| c.type_ == gate);
            if let Some(c) = c {
                let entry = (c.status, c.last_transition_time.map(|t| t.0));
                let mut log = log.lock().unwrap();
                if log.last() != Some(&entry) {
                    log.push(entry);
                }
            }
        }
    });
    (seen, task)
}

#[tokio::test]
async fn a_held_pod_liveness_probe_resumes_on_a_new_container() {
    let admin = admin_client().await;
    let node = labelled_node(&admin, "live-restart").await;
    let ep = Endpoint::new(true, 0);
    let port = ep.serve().await.port();
    let app = unique_name("app");
    let gate = "nodeguard.io/alive";
    let pod_name = unique_name("alive");
    running_gated_pod(&admin, &node.name, &pod_name, &app, &[gate]).await;
    set_container_id(&admin, &pod_name, "containerd://first").await;
    let policy = unique_name("live-restart");
    apply_probes(
        &admin,
        &policy,
        &node.name,
        serde_json::json!([
            {"name": "alive", "role": "Liveness", "pods": {"selector": {"matchLabels": {"app": app}}},
             "http": {"port": port, "path": "/healthz"}, "periodSeconds": 1, "failureThreshold": 2,
             "readinessGate": gate},
        ]),
    )
    .await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;
    eventually(Duration::from_secs(15), "gate True", || async {
        pod_gate(&admin, &pod_name, gate).await.as_deref() == Some("True")
    })
    .await;
    ep.set_healthy(false);
    eventually(Duration::from_secs(15), "gate False", || async {
        pod_gate(&admin, &pod_name, gate).await.as_deref() == Some("False")
    })
    .await;
    // Held: the endpoint is not probed any more, even once it passes.
    ep.set_healthy(true);
    let held = ep.requests().len();
    assert!(
        agent
            .probes
            .trigger("alive", &format!("{TEST_NAMESPACE}/{pod_name}")),
        "the worker runs"
    );
    // The kubelet restarts the container (a new container ID): the hold
    // ends, the probe runs again and the gate follows it.
    set_container_id(&admin, &pod_name, "containerd://second").await;
    eventually(
        Duration::from_secs(15),
        "gate True again on the new container",
        || async { pod_gate(&admin, &pod_name, gate).await.as_deref() == Some("True") },
    )
    .await;
    assert!(ep.requests().len() > held, "probed again");
    agent.stop().await;
    delete_pod(&admin, &pod_name).await;
    delete_policy(&admin, &policy).await;
}

#[tokio::test]
async fn an_agent_restart_does_not_make_a_held_pod_ready() {
    let admin = admin_client().await;
    let node = labelled_node(&admin, "live-agent").await;
    let ep = Endpoint::new(false, 0); // fails throughout
    let port = ep.serve().await.port();
    let app = unique_name("app");
    let gate = "nodeguard.io/alive-across";
    let pod_name = unique_name("alive");
    running_gated_pod(&admin, &node.name, &pod_name, &app, &[gate]).await;
    let policy = unique_name("live-agent");
    apply_probes(
        &admin,
        &policy,
        &node.name,
        serde_json::json!([
            {"name": "alive", "role": "Liveness", "pods": {"selector": {"matchLabels": {"app": app}}},
             "http": {"port": port, "path": "/healthz"}, "periodSeconds": 1, "failureThreshold": 3,
             "readinessGate": gate},
        ]),
    )
    .await;
    let (first, _state) = start_agent(admin.clone(), &node.name).await;
    eventually(
        Duration::from_secs(20),
        "gate False after the failures",
        || async { pod_gate(&admin, &pod_name, gate).await.as_deref() == Some("False") },
    )
    .await;
    first.stop().await;
    let (_, before) = gate_condition(&admin, &pod_name, gate).await.unwrap();
    let before = before.expect("a lastTransitionTime");
    let (seen, watch) = record_gate(&admin, &pod_name, gate);
    let (second, _state2) = start_agent(admin.clone(), &node.name).await;
    // The second agent's own verdict (False, written anew) is the signal
    // it has run; nothing it wrote before may say True.
    eventually(
        Duration::from_secs(20),
        "the second agent's verdict written",
        || {
            let seen = seen.lock().unwrap().clone();
            assert!(
                seen.iter().all(|(s, _)| s == "False"),
                "the gate turned True after the agent restart: {seen:?}"
            );
            std::future::ready(seen.iter().any(|(_, t)| t.is_some_and(|t| t > before)))
        },
    )
    .await;
    watch.abort();
    second.stop().await;
    delete_pod(&admin, &pod_name).await;
    delete_policy(&admin, &policy).await;
}

#[tokio::test]
async fn a_gate_write_for_a_deleted_pod_does_not_land_on_its_namesake() {
    use nodeguard::probe::{KubePodConditions, PodConditionPort, ProbeError};
    let admin = admin_client().await;
    let node = labelled_node(&admin, "uid").await;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), TEST_NAMESPACE);
    let (app, name, gate) = (unique_name("app"), unique_name("same"), "nodeguard.io/uid");
    let uid = |p: Pod| p.metadata.uid.unwrap();
    running_gated_pod(&admin, &node.name, &name, &app, &[gate]).await;
    let old = uid(pods.get(&name).await.unwrap());
    pods.delete(&name, &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    eventually(Duration::from_secs(10), "the pod gone", || async {
        pods.get_opt(&name).await.unwrap().is_none()
    })
    .await;
    running_gated_pod(&admin, &node.name, &name, &app, &[gate]).await;
    let new = uid(pods.get(&name).await.unwrap());
    assert_ne!(old, new);
    let port = KubePodConditions::new(admin.clone());
    let key = format!("{TEST_NAMESPACE}/{name}");
    // The predecessor's write: refused by the API server (422: the UID of
    // the pod under that name cannot change).
    let late = port.set_on(&key, Some(&old), gate, true, "late").await;
    match &late {
        Err(ProbeError::Api(kube::Error::Api(e))) => {
            assert_eq!((e.code, e.reason.as_str()), (422, "Invalid"), "{e:?}");
            assert!(e.message.contains("metadata.uid"), "{e:?}");
        }
        other => panic!("a write with the old pod's UID must be refused: {other:?}"),
    }
    assert_eq!(pod_gate(&admin, &name, gate).await, None, "nothing landed");
    // The new pod's own write goes through.
    port.set_on(&key, Some(&new), gate, true, "mine")
        .await
        .unwrap();
    assert_eq!(pod_gate(&admin, &name, gate).await.as_deref(), Some("True"));
    delete_pod(&admin, &name).await;
}

/// The processes (pid, state) whose command name is `comm`, zombies
/// included.
fn processes_named(comm: &str) -> Vec<(u32, char)> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        if &stat[open + 1..close] == comm {
            let state = stat[close + 1..].trim_start().chars().next().unwrap_or('?');
            found.push((pid, state));
        }
    }
    found
}

/// A script that hangs in a child of its own (the child loops in the
/// script, so both carry its name), at `dir/comm`.
fn hanging_script(dir: &std::path::Path, comm: &str) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let script = dir.join(comm);
    std::fs::write(
        &script,
        "#!/bin/sh\nif [ \"$1\" = child ]; then while :; do sleep 1; done; fi\n\"$0\" child &\nwait\n",
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    script
}

/// An exec probe and a plugin whose scripts hang in a child: at the
/// timeout only the script was killed, and its child ran on for ever, one
/// more per period. In the DaemonSet the agent may be PID 1 (the chart
/// shares the pod's process namespace, so there the pause container is),
/// and what a command leaves behind becomes its own to reap. The shipped
/// binary runs here as PID 1 of its own PID namespace: after each timed-out
/// run nothing of either script is left, running or zombie.
#[tokio::test]
async fn a_timed_out_exec_probe_leaves_no_process_behind_when_the_agent_is_pid_1() {
    let admin = admin_client().await;
    let node = labelled_node(&admin, "exec-orphans").await;
    let dir = TempDir::new("exec-orphans");
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    // The kernel names a script's process after its file (up to 15 bytes).
    let tag = (nanos ^ std::process::id()) & 0xffffff;
    let (probe_comm, plugin_comm) = (format!("ngp{tag:x}"), format!("ngq{tag:x}"));
    let probe_script = hanging_script(&dir.path, &probe_comm);
    let plugin_script = hanging_script(&dir.path, &plugin_comm);
    let policy = unique_name("exec-orphans");
    apply_policy(
        &admin,
        &policy,
        serde_json::json!({
            "nodeSelector": selecting(&node.name),
            "probes": [
                {"name": "hangs", "exec": {"command": [probe_script.display().to_string()]},
                 "timeoutSeconds": 1, "periodSeconds": 2, "failureThreshold": 1,
                 "conditionType": "HangingCheckFailed"},
            ],
            "monitors": [{
                "name": "hangs", "source": {"plugin": {"intervalSeconds": 2, "timeoutSeconds": 1}},
                "conditions": [{"type": "HangingPluginProblem", "reason": "Fine", "message": "fine"}],
                "rules": [{"type": "permanent", "condition": "HangingPluginProblem", "reason": "Hung",
                           "command": [plugin_script.display().to_string()]}],
            }],
        }),
    )
    .await;
    let state = TempDir::new("exec-orphans-state");
    let mut agent = std::process::Command::new("unshare")
        .args(["--pid", "--fork", "--kill-child"])
        .arg(env!("CARGO_BIN_EXE_nodeguard"))
        .args(["run", "--listen", "127.0.0.1:0", "--node-name", &node.name])
        .arg("--kubeconfig")
        .arg(kubeconfig_path())
        .arg("--state-dir")
        .arg(&state.path)
        .arg(format!("--allow-command={}/", dir.path.display()))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("unshare (util-linux) runs the agent as PID 1 of a new PID namespace");
    wait_condition(
        &admin,
        &node.name,
        "HangingCheckFailed",
        "True",
        Duration::from_secs(30),
        "HangingCheckFailed=True from the timed-out probe",
    )
    .await;
    let (_, _, message) = condition(&admin, &node.name, "HangingCheckFailed")
        .await
        .unwrap();
    assert!(message.contains("timed out"), "{message}");
    // Three more timed-out runs of each.
    tokio::time::sleep(Duration::from_secs(6)).await;
    // A run may be under way: what is left of a script must be at most its
    // own two processes, and never a zombie that stays (one that is one for
    // a few milliseconds, until reaped, is fine).
    let mut most = [0usize; 2];
    let mut zombies_seen: std::collections::BTreeMap<u32, std::time::Instant> = Default::default();
    let mut lasting_zombies = Vec::new();
    for _ in 0..30 {
        for (i, comm) in [&probe_comm, &plugin_comm].into_iter().enumerate() {
            let left = processes_named(comm);
            most[i] = most[i].max(left.len());
            for (pid, state) in left {
                if state != 'Z' {
                    continue;
                }
                let first = *zombies_seen
                    .entry(pid)
                    .or_insert_with(std::time::Instant::now);
                if first.elapsed() >= Duration::from_millis(200) {
                    lasting_zombies.push((comm.clone(), pid));
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = agent.kill();
    let _ = agent.wait();
    assert!(
        most[0] <= 2 && most[1] <= 2 && lasting_zombies.is_empty(),
        "processes of the timed-out scripts left behind: at most {} of the probe's and {} of the plugin's at once, zombies that stayed {lasting_zombies:?}",
        most[0],
        most[1]
    );
    // With the agent gone, so is its namespace: nothing of the scripts stays.
    eventually(Duration::from_secs(5), "no process of the scripts", || {
        std::future::ready(
            processes_named(&probe_comm).is_empty() && processes_named(&plugin_comm).is_empty(),
        )
    })
    .await;
    delete_policy(&admin, &policy).await;
}

/// A probe gated by a Startup probe that is not in force waited for ever
/// without a word, or, when another policy's probe had the gate's name,
/// ran behind that probe instead. Policy b's `warmup` loses its name to
/// policy a's: b's gated probe is left out and the policy condition says
/// why; then b's renamed gate is refused by the node's trust, said the same
/// way; then b's gate is allowed and the gated probe runs behind it.
#[tokio::test]
async fn a_probe_whose_gate_is_not_in_force_is_left_out_and_said_why() {
    let admin = admin_client().await;
    let node = labelled_node(&admin, "gate-missing").await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let tcp = |name: &str, extra: serde_json::Value| {
        let mut p = serde_json::json!({"name": name, "tcp": {"port": port}, "periodSeconds": 1});
        p.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        p
    };
    let a = unique_name("a-gate");
    let b = unique_name("b-gate");
    apply_probes(
        &admin,
        &a,
        &node.name,
        serde_json::json!([tcp(
            "warmup",
            serde_json::json!({"role": "Startup", "conditionType": "WarmupA"})
        )]),
    )
    .await;
    let b_probes = |gate: serde_json::Value| {
        serde_json::json!([
            gate,
            tcp(
                "checked",
                serde_json::json!({"gatedBy": "warmup", "conditionType": "CheckedB"})
            ),
        ])
    };
    apply_probes(
        &admin,
        &b,
        &node.name,
        b_probes(tcp(
            "warmup",
            serde_json::json!({"role": "Startup", "conditionType": "WarmupB"}),
        )),
    )
    .await;
    // The node's own trust, as shipped: /bin/sh is not a command it allows.
    let (agent, _state) = start_agent_with(admin.clone(), &node.name, |c| {
        c.trust = nodeguard::policy::NodeTrust::default()
    })
    .await;
    wait_condition(
        &admin,
        &node.name,
        "WarmupA",
        "False",
        Duration::from_secs(15),
        "a's Startup probe passed",
    )
    .await;
    let said = |wanted: &'static [&'static str]| {
        let admin = admin.clone();
        let node = node.name.clone();
        async move {
            condition(&admin, &node, "NodeGuardPolicyInvalid")
                .await
                .is_some_and(|(status, reason, message)| {
                    status == "True"
                        && reason == "PolicyGateNotInForce"
                        && wanted.iter().all(|w| message.contains(w))
                })
        }
    };
    eventually(
        Duration::from_secs(15),
        "NodeGuardPolicyInvalid=True (PolicyGateNotInForce) naming b's gated probe",
        || {
            said(&[
                "probe checked is gated by its Startup probe warmup",
                "is NodeGuardPolicy a-gate",
            ])
        },
    )
    .await;
    // Periods go by: b's gated probe never follows a's warmup.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        condition(&admin, &node.name, "CheckedB").await.is_none(),
        "b's gated probe ran behind a's Startup probe"
    );

    // b's own gate, under its own name, refused by the node's trust.
    apply_probes(
        &admin,
        &b,
        &node.name,
        serde_json::json!([
            {"name": "warm-b", "role": "Startup", "conditionType": "WarmupB",
             "exec": {"command": ["/bin/sh", "-c", "true"]}},
            tcp("checked", serde_json::json!({"gatedBy": "warm-b", "conditionType": "CheckedB"})),
        ]),
    )
    .await;
    eventually(
        Duration::from_secs(15),
        "the refused gate named",
        || async {
            condition(&admin, &node.name, "NodeGuardPolicyInvalid")
                .await
                .is_some_and(|(status, _, message)| {
                    status == "True"
                        && message.contains("probe checked is gated by its Startup probe warm-b")
                        && message.contains("refused by this node's trust")
                })
        },
    )
    .await;
    assert!(condition(&admin, &node.name, "CheckedB").await.is_none());

    // A gate in force: the gated probe runs behind it.
    apply_probes(
        &admin,
        &b,
        &node.name,
        b_probes(tcp(
            "warm-b",
            serde_json::json!({"role": "Startup", "conditionType": "WarmupB"}),
        ))
        .as_array()
        .map(|v| {
            let mut v = v.clone();
            v[1]["gatedBy"] = "warm-b".into();
            serde_json::Value::Array(v)
        })
        .unwrap(),
    )
    .await;
    wait_condition(
        &admin,
        &node.name,
        "CheckedB",
        "False",
        Duration::from_secs(15),
        "b's gated probe runs once its own gate passed",
    )
    .await;
    wait_condition(
        &admin,
        &node.name,
        "NodeGuardPolicyInvalid",
        "False",
        Duration::from_secs(15),
        "the policies are valid again",
    )
    .await;
    agent.stop().await;
    drop(listener);
    delete_policy(&admin, &a).await;
    delete_policy(&admin, &b).await;
}

/// A root file system with `bash` and `sleep` (and the libraries they
/// load) and nothing else of this machine's: what `--command-root` runs
/// commands in, standing for the node's root mounted into the pod.
fn minimal_root(root: &std::path::Path) {
    let mut files: Vec<std::path::PathBuf> = Vec::new();
    for program in ["/bin/bash", "/bin/sleep"] {
        files.push(program.into());
        let ldd = std::process::Command::new("ldd")
            .arg(program)
            .output()
            .expect("ldd");
        for line in String::from_utf8_lossy(&ldd.stdout).lines() {
            // "libc.so.6 => /lib/…/libc.so.6 (0x…)" or "/lib64/ld-linux… (0x…)"
            let path = line
                .split("=>")
                .last()
                .and_then(|s| s.split_whitespace().next())
                .unwrap_or("");
            if path.starts_with('/') {
                files.push(path.into());
            }
        }
    }
    for f in files {
        let to = root.join(f.strip_prefix("/").unwrap());
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        // The file itself where the path is a link (/lib64/ld-linux…).
        std::fs::copy(std::fs::canonicalize(&f).unwrap(), &to).unwrap();
    }
}

/// The chart's `host.plugins.hostRoot`: commands run changed into the
/// node's root. Here a root holding bash, sleep and a marker file this
/// machine does not have: a plugin script and an exec probe, named by
/// their paths in that root (which are not paths here, and are what
/// `--allow-command` allows), run with the root's own `#!/bin/bash` and see
/// the marker. A plugin that forks and times out there leaves nothing
/// behind over several runs, the agent being PID 1 of its PID namespace.
#[tokio::test]
async fn commands_run_in_the_command_root_with_its_own_interpreter() {
    use std::os::unix::fs::PermissionsExt;
    let admin = admin_client().await;
    let node = labelled_node(&admin, "command-root").await;
    let root = TempDir::new("command-root");
    minimal_root(&root.path);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    let marker = format!("root-{:x}", nanos ^ std::process::id());
    std::fs::write(root.path.join("etc-marker"), &marker).unwrap();
    // Node paths, which do not exist on this machine.
    let plugins = "/usr/local/lib/nodeguard-root-test/plugins";
    assert!(!std::path::Path::new(plugins).exists());
    let dir = root.path.join(plugins.strip_prefix('/').unwrap());
    std::fs::create_dir_all(&dir).unwrap();
    let check = "#!/bin/bash\nif [[ -e /etc-marker && $PWD == / ]]; then echo \"in the root: $(< /etc-marker) PATH=$PATH\"; exit 1; fi\necho \"not in the root\"\nexit 0\n";
    let tag = (nanos ^ std::process::id()) & 0xffffff;
    let hang_comm = format!("ngr{tag:x}");
    let hang = "#!/bin/bash\nif [[ $1 == child ]]; then while :; do /bin/sleep 1; done; fi\n\"$0\" child &\nwait\n";
    for (name, body) in [("check.sh", check), (hang_comm.as_str(), hang)] {
        std::fs::write(dir.join(name), body).unwrap();
        std::fs::set_permissions(dir.join(name), std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    // A link under the allowed directory to the root's /bin: allowed as
    // written, `…/tools/bash` is the root's shell.
    std::os::unix::fs::symlink("/bin", dir.join("tools")).unwrap();
    let policy = unique_name("command-root");
    apply_policy(
        &admin,
        &policy,
        serde_json::json!({
            "nodeSelector": selecting(&node.name),
            "probes": [
                {"name": "in-root", "exec": {"command": [format!("{plugins}/check.sh")]},
                 "timeoutSeconds": 5, "periodSeconds": 2, "failureThreshold": 1,
                 "conditionType": "RootCheckFailed"},
                {"name": "link-out", "exec": {"command": [format!("{plugins}/tools/bash"), "-c", "exit 0"]},
                 "timeoutSeconds": 5, "periodSeconds": 2, "failureThreshold": 1,
                 "conditionType": "RootLinkOutFailed"},
            ],
            "monitors": [
                {"name": "in-root", "source": {"plugin": {"intervalSeconds": 2, "timeoutSeconds": 5}},
                 "conditions": [{"type": "RootPluginProblem", "reason": "Fine", "message": "fine"}],
                 "rules": [{"type": "permanent", "condition": "RootPluginProblem", "reason": "InRoot",
                            "command": [format!("{plugins}/check.sh")]}]},
                {"name": "hangs-in-root", "source": {"plugin": {"intervalSeconds": 2, "timeoutSeconds": 1}},
                 "conditions": [{"type": "RootHangProblem", "reason": "Fine", "message": "fine"}],
                 "rules": [{"type": "permanent", "condition": "RootHangProblem", "reason": "Hung",
                            "command": [format!("{plugins}/{hang_comm}")]}]},
            ],
        }),
    )
    .await;
    let state = TempDir::new("command-root-state");
    let mut agent = std::process::Command::new("unshare")
        .args(["--pid", "--fork", "--kill-child"])
        .arg(env!("CARGO_BIN_EXE_nodeguard"))
        .args(["run", "--listen", "127.0.0.1:0", "--node-name", &node.name])
        .arg("--kubeconfig")
        .arg(kubeconfig_path())
        .arg("--state-dir")
        .arg(&state.path)
        .arg(format!("--allow-command={plugins}/"))
        .arg(format!("--command-root={}", root.path.display()))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("unshare (util-linux) runs the agent as PID 1 of a new PID namespace");
    for (condition_type, what) in [
        ("RootCheckFailed", "the exec probe"),
        ("RootPluginProblem", "the plugin"),
    ] {
        wait_condition(
            &admin,
            &node.name,
            condition_type,
            "True",
            Duration::from_secs(30),
            &format!("{condition_type}=True: {what} ran in the root"),
        )
        .await;
        let (_, _, message) = condition(&admin, &node.name, condition_type).await.unwrap();
        assert!(
            message.contains(&format!("in the root: {marker}")),
            "{what}: {message}"
        );
        // A root shell's search path, not the image's /usr/bin:/bin.
        assert!(message.contains(":/usr/sbin:"), "{what}: {message}");
    }
    // The link out of the allowed directory runs nothing: the probe fails
    // naming the file it would have run.
    wait_condition(
        &admin,
        &node.name,
        "RootLinkOutFailed",
        "True",
        Duration::from_secs(30),
        "RootLinkOutFailed=True: a link under the allowed directory to /bin refused",
    )
    .await;
    let (_, _, message) = condition(&admin, &node.name, "RootLinkOutFailed")
        .await
        .unwrap();
    assert!(
        message.contains("is /bin/bash, which this node does not allow"),
        "{message}"
    );
    // The hanging plugin runs (an Unknown verdict leaves its condition as
    // it was, as node-problem-detector does).
    eventually(
        Duration::from_secs(30),
        "the hanging plugin running in the root",
        || std::future::ready(!processes_named(&hang_comm).is_empty()),
    )
    .await;
    // Three more timed-out runs; then at most one run's two processes,
    // never a zombie that stays.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let mut most = 0usize;
    let mut zombies_seen: std::collections::BTreeMap<u32, std::time::Instant> = Default::default();
    let mut lasting_zombies = Vec::new();
    for _ in 0..30 {
        let left = processes_named(&hang_comm);
        most = most.max(left.len());
        for (pid, state) in left {
            if state == 'Z' {
                let first = *zombies_seen
                    .entry(pid)
                    .or_insert_with(std::time::Instant::now);
                if first.elapsed() >= Duration::from_millis(200) {
                    lasting_zombies.push(pid);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = agent.kill();
    let _ = agent.wait();
    assert!(
        most <= 2 && lasting_zombies.is_empty(),
        "processes of the timed-out plugin left behind in the root: at most {most} at once, zombies that stayed {lasting_zombies:?}"
    );
    delete_policy(&admin, &policy).await;
}
