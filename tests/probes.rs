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
