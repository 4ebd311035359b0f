//! An API server outage while conditions change: the agent keeps running,
//! stays live, loses nothing, and converges soon after the API returns.
//! (Its own test binary: it stops the shared API server for 30 s.)

mod support;

use std::time::{Duration, Instant};

use nodeguard::report::Status;
use support::*;

#[tokio::test]
async fn conditions_converge_within_5s_after_a_30s_api_outage() {
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

    cluster_ctl("stop", "kube-apiserver");
    let guard = RestartOnDrop("kube-apiserver");
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
    cluster_ctl("start", "kube-apiserver");
    std::mem::forget(guard);
    // The controller manager's informers back off for up to 30 s after an
    // outage; restart it so the test binaries after this one (the PDB in
    // tests/shutdown.rs) do not wait on that.
    cluster_ctl("stop", "kube-controller-manager");
    cluster_ctl("start", "kube-controller-manager");
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
