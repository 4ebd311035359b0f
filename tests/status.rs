//! `nodeguard status NODE` against the real control plane, with a real
//! agent writing the node's conditions, taint and Events; also run the way
//! kubectl runs plugins (`kubectl nodeguard status NODE`).

mod support;

use std::process::Command;
use std::time::Duration;

use support::*;

fn status(args: &[&str], path_dir: Option<&std::path::Path>) -> (bool, String, String) {
    let mut cmd = match path_dir {
        None => Command::new(env!("CARGO_BIN_EXE_nodeguard")),
        Some(dir) => {
            let mut c = Command::new("kubectl");
            let path = format!("{}:{}", dir.display(), std::env::var("PATH").unwrap());
            c.env("PATH", path).arg("nodeguard");
            c
        }
    };
    let out = cmd
        .args(args)
        .env("KUBECONFIG", kubeconfig_path())
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn status_shows_conditions_policies_taints_and_events_of_one_node() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "status").await;
    let logs = TempDir::new("status");
    let log = logs.path.join("app.log");
    std::fs::write(&log, "").unwrap();
    let name = unique_name("status");
    apply_policy(
        &admin,
        &name,
        serde_json::json!({
            "nodeSelector": selecting(&node.name),
            "probes": [{"name": "closed", "tcp": {"port": 1}, "conditionType": "ClosedPortUnhealthy",
                        "periodSeconds": 1, "failureThreshold": 1}],
            "monitors": [{"name": "app", "source": {"file": {"path": log.display().to_string()}},
                "conditions": [{"type": "AppBroken", "reason": "AppIsFine", "message": "The app is fine.",
                                "taint": {"key": "example.com/app-broken", "effect": "NoSchedule"}}],
                "rules": [{"type": "permanent", "condition": "AppBroken", "reason": "AppCrashed", "pattern": "app crashed"}]}],
        }),
    )
    .await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;
    eventually(Duration::from_secs(20), "the probe's condition", || async {
        condition_is(&admin, &node.name, "ClosedPortUnhealthy", "True").await
            && condition_is(&admin, &node.name, "AppBroken", "False").await
    })
    .await;
    {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
        writeln!(f, "app crashed: disk full").unwrap();
    }
    eventually(
        Duration::from_secs(20),
        "the taint, the condition and the annotation",
        || async {
            if !condition_is(&admin, &node.name, "AppBroken", "True").await {
                return false;
            }
            let n: k8s_openapi::api::core::v1::Node =
                kube::Api::all(admin.clone()).get(&node.name).await.unwrap();
            has_taint(&n, "example.com/app-broken")
                && n.metadata
                    .annotations
                    .as_ref()
                    .is_some_and(|a| a.contains_key(nodeguard::agent::EFFECTIVE_ANNOTATION))
        },
    )
    .await;
    eventually(Duration::from_secs(15), "the Events", || async {
        let (ok, out, _) = status(&["status", &node.name], None);
        ok && out.contains("AppCrashed") && out.contains("ClosedProbeFailed")
    })
    .await;

    let (ok, out, err) = status(&["status", &node.name], None);
    assert!(ok, "{err}");
    println!("{out}");
    for want in [
        format!("Node:      {}", node.name),
        format!("Policies:  {name}@1"),
        "Shutdown:  not configured on this node".to_string(),
        "Agent:     no nodeguard pod on this node".to_string(),
        "NodeGuardPolicyInvalid".to_string(),
        "example.com/app-broken:NoSchedule  on the node  monitor app (AppBroken True)".to_string(),
    ] {
        assert!(out.contains(&want), "{want:?} missing:\n{out}");
    }
    let row = |t: &str| {
        out.lines()
            .find(|l| l.trim_start().starts_with(&format!("{t} ")))
            .unwrap_or_else(|| panic!("no {t} row:\n{out}"))
            .to_string()
    };
    assert!(row("ClosedPortUnhealthy").contains("True"), "{out}");
    assert!(row("AppBroken").contains("True"), "{out}");
    // Only nodeguard's conditions: none of the node controller's (Ready).
    assert!(
        !out.lines().any(|l| l.trim_start().starts_with("Ready ")),
        "{out}"
    );

    let (ok, json, err) = status(&["status", &node.name, "-o", "json", "--events", "2"], None);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["node"], node.name.as_str());
    assert_eq!(v["policies"][0]["name"], name.as_str());
    assert_eq!(v["policies"][0]["generation"], 1);
    assert_eq!(v["events"].as_array().unwrap().len(), 2, "--events 2");
    let app = v["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "AppBroken")
        .unwrap();
    assert_eq!(app["status"], "True");
    assert!(app["since"].as_str().is_some_and(|s| s.starts_with("20")));
    assert_eq!(v["taints"][0]["present"], true);

    // As a kubectl plugin: kubectl finds `kubectl-nodeguard` on PATH.
    let bin = TempDir::new("plugin-path");
    std::os::unix::fs::symlink(
        env!("CARGO_BIN_EXE_nodeguard"),
        bin.path.join("kubectl-nodeguard"),
    )
    .unwrap();
    let (ok, out, err) = status(&["status", &node.name], Some(&bin.path));
    assert!(ok, "kubectl nodeguard status: {err}");
    assert!(out.contains(&format!("Node:      {}", node.name)), "{out}");

    // An agent pod on the node: found by the chart's label, its /healthz
    // asked through the API server's pod proxy (nothing listens at this
    // pod's address here, and the answer says it is the API server's).
    let pods: kube::Api<k8s_openapi::api::core::v1::Pod> =
        kube::Api::namespaced(admin.clone(), TEST_NAMESPACE);
    let pod_name = unique_name("nodeguard-agent");
    let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": pod_name, "labels": {"app.kubernetes.io/name": "nodeguard"}},
        "spec": {"nodeName": node.name, "automountServiceAccountToken": false,
                 "containers": [{"name": "nodeguard", "image": "example.invalid/nodeguard",
                                 "ports": [{"name": "http", "containerPort": 1}]}]},
    }))
    .unwrap();
    pods.create(&kube::api::PostParams::default(), &pod)
        .await
        .unwrap();
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    pods.patch_status(
        &pod_name,
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(
            serde_json::json!({"status": {"phase": "Running", "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}]}}),
        ),
    )
    .await
    .unwrap();
    let (ok, out, err) = status(&["status", &node.name], None);
    assert!(ok, "{err}");
    let agent_line = out.lines().find(|l| l.starts_with("Agent:")).unwrap();
    println!("{agent_line}");
    assert!(
        agent_line.contains(&format!("pod {TEST_NAMESPACE}/{pod_name} Running, Ready"))
            && agent_line.contains("/healthz not reachable"),
        "{agent_line}"
    );
    let _ = pods
        .delete(
            &pod_name,
            &kube::api::DeleteParams::default().grace_period(0),
        )
        .await;

    // A node that does not exist: a clear error, exit code not 0.
    let (ok, _, err) = status(&["status", "no-such-node-x"], None);
    assert!(
        !ok && err.contains("node no-such-node-x not found"),
        "{err}"
    );

    agent.stop().await;
    delete_policy(&admin, &name).await;
}
