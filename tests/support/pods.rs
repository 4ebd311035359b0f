//! Pods on test Nodes, with no kubelet: created running and ready, and
//! removed when marked for deletion, as a kubelet would.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};

use super::{TEST_NAMESPACE, eventually, unique_name};

/// Creates or updates a PriorityClass with `value`.
pub async fn ensure_priority_class(client: &Client, name: &str, value: i32) {
    let pcs: Api<PriorityClass> = Api::all(client.clone());
    let pc: PriorityClass = serde_json::from_value(serde_json::json!({
        "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
        "metadata": {"name": name}, "value": value,
    }))
    .unwrap();
    pcs.patch(
        name,
        &PatchParams::apply("nodeguard-tests").force(),
        &Patch::Apply(&pc),
    )
    .await
    .unwrap();
}

/// Creates a running, ready pod on `node`, as if a kubelet ran it.
pub async fn running_pod(
    client: &Client,
    node: &str,
    name: &str,
    class: &str,
    labels: serde_json::Value,
) {
    running_pod_with(client, node, name, class, labels, serde_json::json!({})).await
}

/// [`running_pod`] with more fields in its spec (`spec`, an object).
pub async fn running_pod_with(
    client: &Client,
    node: &str,
    name: &str,
    class: &str,
    labels: serde_json::Value,
    spec: serde_json::Value,
) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), TEST_NAMESPACE);
    let mut value = serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"nodeName": node, "priorityClassName": class, "terminationGracePeriodSeconds": 30,
                 "containers": [{"name": "c", "image": "example.invalid/app"}]},
    });
    if let (Some(base), Some(more)) = (value["spec"].as_object_mut(), spec.as_object()) {
        base.extend(more.clone());
    }
    let pod: Pod = serde_json::from_value(value).unwrap();
    // The API server's priority admission reads PriorityClasses from its
    // cache: one created a moment ago may not be there yet.
    let mut tries = 0;
    loop {
        match pods.create(&PostParams::default(), &pod).await {
            Ok(_) => break,
            Err(kube::Error::Api(e))
                if e.code == 403 && e.message.contains("no PriorityClass") && tries < 50 =>
            {
                tries += 1;
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            Err(e) => panic!("create pod {name}: {e}"),
        }
    }
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let status = serde_json::json!({"status": {"phase": "Running", "podIP": "127.0.0.1",
        "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}]}});
    pods.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
}

/// Plays the kubelet's part in termination: a pod marked for deletion is
/// removed (grace 0) after a short moment. Records when each was marked.
pub fn kubelet_sim(
    client: Client,
    node: String,
) -> (
    Arc<Mutex<BTreeMap<String, Instant>>>,
    tokio::task::JoinHandle<()>,
) {
    let marked = Arc::new(Mutex::new(BTreeMap::new()));
    let m = marked.clone();
    let task = tokio::spawn(async move {
        let pods: Api<Pod> = Api::all(client.clone());
        let cfg = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
        let mut stream = watcher(pods, cfg).applied_objects().boxed();
        while let Some(Ok(p)) = stream.next().await {
            if p.metadata.deletion_timestamp.is_none() {
                continue;
            }
            let name = p.metadata.name.clone().unwrap();
            let ns = p.metadata.namespace.clone().unwrap();
            if m.lock()
                .unwrap()
                .insert(name.clone(), Instant::now())
                .is_some()
            {
                continue;
            }
            let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                let _ = api
                    .delete(&name, &DeleteParams::default().grace_period(0))
                    .await;
            });
        }
    });
    (marked, task)
}

/// A PodDisruptionBudget with `minAvailable: 1` over the pods labelled
/// `app=<app>` (one running pod: no disruption allowed), returned once the
/// controller manager's disruption controller has computed it.
pub async fn pdb_keeping_one(client: &Client, prefix: &str, app: &str) -> String {
    let name = unique_name(prefix);
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), TEST_NAMESPACE);
    let pdb: PodDisruptionBudget = serde_json::from_value(serde_json::json!({
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": {"name": name},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": app}}},
    }))
    .unwrap();
    pdbs.create(&PostParams::default(), &pdb).await.unwrap();
    eventually(
        Duration::from_secs(20),
        "the disruption controller processed the PDB",
        || async {
            pdbs.get(&name)
                .await
                .ok()
                .and_then(|p| p.status)
                .is_some_and(|st| {
                    st.observed_generation == Some(1)
                        && st.current_healthy == 1
                        && st.disruptions_allowed == 0
                })
        },
    )
    .await;
    name
}

/// Deletes a PDB made by [`pdb_keeping_one`]; best effort.
pub async fn delete_pdb(client: &Client, name: &str) {
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), TEST_NAMESPACE);
    let _ = pdbs.delete(name, &DeleteParams::default()).await;
}

/// The pods of a graceful-shutdown scenario, by name.
pub struct PodsInThreeGroups {
    pub low: String,
    pub mid: String,
    pub high: String,
    /// The PDB keeping `mid` (no disruption allowed).
    pub pdb: String,
}

/// One running pod per shutdown priority group on `node`: priority 0, 1000
/// (behind a PDB that allows no disruption) and `system-node-critical`.
pub async fn pods_in_three_groups(client: &Client, node: &str) -> PodsInThreeGroups {
    ensure_priority_class(client, "nodeguard-test-low", 0).await;
    ensure_priority_class(client, "nodeguard-test-mid", 1000).await;
    let tag = unique_name("app");
    let (low, mid, high) = (
        unique_name("low"),
        unique_name("mid-pdb"),
        unique_name("critical"),
    );
    for (name, class, app) in [
        (&low, "nodeguard-test-low", "low"),
        (&mid, "nodeguard-test-mid", tag.as_str()),
        (&high, "system-node-critical", "high"),
    ] {
        running_pod(client, node, name, class, serde_json::json!({"app": app})).await;
    }
    let pdb = pdb_keeping_one(client, "mid-pdb", &tag).await;
    PodsInThreeGroups {
        low,
        mid,
        high,
        pdb,
    }
}
