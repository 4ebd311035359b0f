//! Foundation integration tests against the real control plane
//! (`e2e/cluster/up`): the committed CRD, health endpoints of a running
//! agent, RBAC-gated first sync, stuck loops and node eligibility.

mod support;

use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use nodeguard::policy::NodeGuardPolicy;
use support::*;

#[test]
fn committed_crd_matches_the_types() {
    let committed =
        std::fs::read_to_string(repo_root().join("crds/nodeguard.io_nodeguardpolicies.yaml"))
            .unwrap();
    assert!(
        committed == NodeGuardPolicy::crd_yaml(),
        "crds/nodeguard.io_nodeguardpolicies.yaml is out of date: regenerate it with\n  \
         cargo run -- crd > crds/nodeguard.io_nodeguardpolicies.yaml"
    );
}

#[tokio::test]
async fn crd_applies_and_kubectl_shows_printer_columns() {
    let client = admin_client().await; // installs the committed CRD
    let name = unique_name("columns");
    let api: Api<NodeGuardPolicy> = Api::all(client.clone());
    let policy = NodeGuardPolicy::new(&name, Default::default());
    api.create(&PostParams::default(), &policy).await.unwrap();
    let out = kubectl(&["get", "ngp", &name]);
    let header: Vec<&str> = out.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(header, ["NAME", "ACCEPTED", "REASON", "AGE"], "{out}");
    let wide = kubectl(&["get", "nodeguardpolicies.nodeguard.io", &name, "-o", "wide"]);
    assert!(wide.lines().next().unwrap().contains("OBSERVED"), "{wide}");
    api.delete(&name, &DeleteParams::default()).await.unwrap();
}

#[tokio::test]
async fn the_api_server_rejects_a_policy_that_is_not_an_object() {
    let _ = admin_client().await;
    let name = unique_name("typed");
    let api: Api<kube::api::DynamicObject> = Api::all_with(
        admin_client().await,
        &kube::api::ApiResource::erase::<NodeGuardPolicy>(&()),
    );
    let bad: kube::api::DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": "nodeguard.io/v1alpha1", "kind": "NodeGuardPolicy",
        "metadata": {"name": name},
        "spec": {"nodeSelector": "everything"},
    }))
    .unwrap();
    let err = api.create(&PostParams::default(), &bad).await.unwrap_err();
    assert!(err.to_string().contains("spec.nodeSelector"), "{err}");
}

#[tokio::test]
async fn readyz_turns_200_only_after_the_first_sync() {
    let admin = admin_client().await;
    let node = TestNode::create(&admin, "ready", &[]).await;
    let sa = unique_name("agent");
    // The agent's identity may not list anything yet, so no watch can sync.
    let client = service_account_client(&admin, &sa).await;
    let (agent, _state) = start_agent(client, &node.name).await;

    for _ in 0..20 {
        let (code, body) = http_get(agent.addr, "/readyz").await;
        assert_eq!(code, 503, "ready before any watch synced: {body}");
        assert_eq!(
            http_get(agent.addr, "/livez").await.0,
            200,
            "an unsynced watch is not stuck"
        );
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    let (_, body) = http_get(agent.addr, "/readyz").await;
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["loops"]["node-watch"]["synced"], false);
    assert_eq!(v["loops"]["policy-watch"]["synced"], false);

    // Grant the permissions: the watches sync after their backoff.
    let _grant = Grant::new(
        &admin,
        "nodeguard-test-reader",
        serde_json::json!([
            {"apiGroups": [""], "resources": ["nodes", "pods"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": ["nodeguard.io"], "resources": ["nodeguardpolicies"], "verbs": ["get", "list", "watch"]},
        ]),
        &sa,
    )
    .await;

    eventually(
        Duration::from_secs(45),
        "/readyz 200 after RBAC is granted",
        || async { http_get(agent.addr, "/readyz").await.0 == 200 },
    )
    .await;
    let (_, body) = http_get(agent.addr, "/readyz").await;
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["loops"]["node-watch"]["synced"], true);
    assert_eq!(v["loops"]["policy-watch"]["synced"], true);

    agent.stop().await;
}

#[tokio::test]
async fn a_stuck_loop_fails_livez_and_recovers() {
    let admin = admin_client().await;
    let node = TestNode::create(&admin, "stuck", &[]).await;
    let (agent, _state) = start_agent(admin, &node.name).await;
    eventually(Duration::from_secs(20), "agent ready", || async {
        http_get(agent.addr, "/readyz").await.0 == 200
    })
    .await;

    let work = agent.health.register("test-loop", Duration::from_secs(1));
    work.updated();
    work.queued();
    assert_eq!(
        http_get(agent.addr, "/livez").await.0,
        200,
        "not stuck before its timeout"
    );
    eventually(
        Duration::from_secs(3),
        "/livez 503 for the stuck loop",
        || async { http_get(agent.addr, "/livez").await.0 == 503 },
    )
    .await;
    let (code, body) = http_get(agent.addr, "/healthz").await;
    assert_eq!(code, 503);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["loops"]["test-loop"]["stuck"], true, "{body}");
    assert_eq!(v["nodeEligible"], true);
    let (_, metrics) = http_get(agent.addr, "/metrics").await;
    assert!(
        metrics.contains("nodeguard_loop_stuck{loop=\"test-loop\"} 1"),
        "{metrics}"
    );

    work.updated();
    assert_eq!(http_get(agent.addr, "/livez").await.0, 200);
    assert_eq!(http_get(agent.addr, "/healthz").await.0, 200);
    agent.stop().await;
}

#[tokio::test]
async fn eligibility_turns_healthz_503_while_livez_stays_200() {
    let admin = admin_client().await;
    let node = TestNode::create(&admin, "eligible", &[]).await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;
    eventually(Duration::from_secs(20), "agent ready", || async {
        http_get(agent.addr, "/readyz").await.0 == 200
    })
    .await;

    // The setter, as other capabilities use it: its own source, which the
    // node-state loop (recomputing on every Node event, its own start-up
    // condition writes among them) never overrides.
    agent
        .health
        .set_node_eligible("test", false, Some("test".into()));
    // Node events while the setter's verdict stands: a label change.
    label_node(&admin, &node.name, "nodeguard-test/touch", "1").await;
    let nodes: Api<Node> = Api::all(admin.clone());
    eventually(
        Duration::from_secs(20),
        "the agent saw the label",
        || async {
            agent
                .node
                .borrow()
                .as_ref()
                .and_then(|s| s.get(&node.name))
                .is_some_and(|n| {
                    n.metadata
                        .labels
                        .as_ref()
                        .is_some_and(|l| l.contains_key("nodeguard-test/touch"))
                })
        },
    )
    .await;
    let (code, body) = http_get(agent.addr, "/healthz").await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("\"nodeEligible\":false"), "{body}");
    assert_eq!(http_get(agent.addr, "/livez").await.0, 200);
    agent.health.set_node_eligible("test", true, None);
    assert_eq!(http_get(agent.addr, "/healthz").await.0, 200);

    // The real input: the autoscaler's deletion taint on the Node.
    let taint = serde_json::json!({"spec": {"taints": [
        {"key": "ToBeDeletedByClusterAutoscaler", "value": "1700000000", "effect": "NoSchedule"}
    ]}});
    nodes
        .patch(&node.name, &PatchParams::default(), &Patch::Merge(&taint))
        .await
        .unwrap();
    let started = std::time::Instant::now();
    // The agent follows its Node's watch within milliseconds (printed);
    // the bound leaves room for two busy cores.
    eventually(
        Duration::from_secs(10),
        "/healthz 503 after the taint",
        || async { http_get(agent.addr, "/healthz").await.0 == 503 },
    )
    .await;
    eprintln!("healthz turned 503 {:?} after the taint", started.elapsed());
    assert_eq!(http_get(agent.addr, "/livez").await.0, 200);
    nodes
        .patch(
            &node.name,
            &PatchParams::default(),
            &Patch::Merge(&serde_json::json!({"spec": {"taints": null}})),
        )
        .await
        .unwrap();
    let started = std::time::Instant::now();
    eventually(
        Duration::from_secs(10),
        "/healthz 200 after removing the taint",
        || async { http_get(agent.addr, "/healthz").await.0 == 200 },
    )
    .await;
    eprintln!(
        "healthz turned 200 {:?} after the taint went",
        started.elapsed()
    );
    agent.stop().await;
}

#[tokio::test]
async fn the_api_server_rejects_cross_field_mistakes_naming_the_field() {
    let admin = admin_client().await;
    let api: Api<kube::api::DynamicObject> = Api::all_with(
        admin.clone(),
        &kube::api::ApiResource::erase::<NodeGuardPolicy>(&()),
    );
    let bad: kube::api::DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": "nodeguard.io/v1alpha1", "kind": "NodeGuardPolicy",
        "metadata": {"name": unique_name("cel")},
        "spec": {
            "nodeSelector": {"matchExpressions": [{"key": "pool", "operator": "Equals", "values": ["a"]}]},
            "shutdown": {"gracePeriodSeconds": 30, "gracePeriodByPriority": [{"priority": 0, "gracePeriodSeconds": 5}]},
            "probes": [{"name": "x", "http": {"url": "http://x"}, "tcp": {"port": 1}, "conditionType": "X"}],
            "monitors": [{"name": "m", "source": {"kmsg": {}, "file": {"path": "/x"}},
                          "rules": [{"type": "permanent", "reason": "R", "pattern": "x"}]}],
        },
    }))
    .unwrap();
    let err = api
        .create(&PostParams::default(), &bad)
        .await
        .unwrap_err()
        .to_string();
    for want in [
        "spec.nodeSelector: Invalid value",
        "spec.shutdown: Invalid value",
        "spec.probes[0]: Invalid value",
        "spec.monitors[0].source: Invalid value",
        "spec.monitors[0].rules[0].condition: Invalid value",
    ] {
        assert!(err.contains(want), "{want} missing in: {err}");
    }
}
