//! The API side of retiring: nodeguard's conditions and shutdown taint
//! removed, the Node Event, the agent pod's retired condition.

use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};

use super::core::Retired;
use super::{RETIRE_ANNOTATION, RETIRED_CONDITION};
use crate::k8s::taints::{self, TaintError};
use crate::policy::NodeGuardPolicy;
use crate::report::kube::{FIELD_MANAGER, KubeEvents, apply_body, owned_condition_types};
use crate::report::{EventKind, EventPort, EventRequest, ReportError};
use crate::shutdown::core::{TAINT_EFFECT, TAINT_KEY, TAINT_VALUE};

/// The field manager of the retired condition on the agent's pod.
const RETIRE_MANAGER: &str = "nodeguard-retire";

/// Removes the shutdown taint when it carries nodeguard's value (nobody
/// else sets that value); its `key:effect` when one was there.
pub(super) async fn remove_shutdown_taint(
    client: &Client,
    node: &str,
) -> Result<Option<String>, TaintError> {
    let removed = taints::remove_valued(client, node, TAINT_KEY, TAINT_VALUE, TAINT_EFFECT).await?;
    Ok(removed.then(|| format!("{TAINT_KEY}:{TAINT_EFFECT}")))
}

/// Removes every condition nodeguard owns on the Node, and its
/// effective-policies annotation: an apply of none by nodeguard's field
/// manager (the API server drops what that manager alone owned). The types
/// removed.
pub(super) async fn remove_conditions(
    client: &Client,
    node: &str,
) -> Result<Vec<String>, kube::Error> {
    let api: Api<Node> = Api::all(client.clone());
    let before = api.get(node).await?;
    let owned = owned_condition_types(&before);
    api.patch_status(
        node,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&apply_body(node, &[], None)),
    )
    .await?;
    Ok(owned.into_iter().collect())
}

/// The Node Event that says nodeguard retired and what it removed.
pub(super) async fn announce(
    client: &Client,
    node: &str,
    retired: &Retired,
    message: &str,
) -> Result<(), ReportError> {
    let obj = Api::<Node>::all(client.clone()).get(node).await?;
    let (_tx, rx) = tokio::sync::watch::channel(Some(Arc::new(obj)));
    let events = KubeEvents::new(client.clone(), node, rx);
    events
        .publish(&EventRequest {
            kind: if retired.complete() {
                EventKind::Normal
            } else {
                EventKind::Warning
            },
            reason: "NodeguardRetired".into(),
            action: "Retire".into(),
            note: message.to_string(),
            source: None,
        })
        .await
}

/// Sets the retired condition on the agent's pod (`namespace/name`), what
/// the uninstall hook waits for.
pub(super) async fn mark_retired(
    client: &Client,
    pod: &str,
    retired: &Retired,
    message: &str,
) -> Result<(), kube::Error> {
    let (ns, name) = pod.split_once('/').unwrap_or(("default", pod));
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::now());
    let body = serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns},
        "status": {"conditions": [{
            "type": RETIRED_CONDITION,
            "status": "True",
            "reason": if retired.complete() { "Retired" } else { "RetiredWithProblems" },
            "message": crate::report::clip(message, 32 * 1024),
            "lastTransitionTime": now,
        }]},
    });
    api.patch_status(
        name,
        &PatchParams::apply(RETIRE_MANAGER).force(),
        &Patch::Apply(&body),
    )
    .await?;
    Ok(())
}

/// Whether the agent's pod (`namespace/name`) was asked to retire already
/// (a container restarted after its agent retired). `false` when the pod
/// cannot be read: the agent then starts as usual and the pod watch tells.
pub async fn asked_already(client: &Client, pod: &str) -> bool {
    let (ns, name) = pod.split_once('/').unwrap_or(("default", pod));
    match Api::<Pod>::namespaced(client.clone(), ns).get(name).await {
        Ok(p) => super::asked(&p),
        Err(e) => {
            tracing::debug!(error = %e, "cannot read the agent's own pod at start");
            false
        }
    }
}

/// Asks an agent pod to retire (the hook's request).
pub(super) async fn ask(api: &Api<Pod>, name: &str) -> Result<(), kube::Error> {
    let now = jiff::Timestamp::now().to_string();
    api.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"metadata": {"annotations": {RETIRE_ANNOTATION: now}}})),
    )
    .await?;
    Ok(())
}

/// The taints the policies' monitors declare, as `(key, value, effect)`.
pub(super) async fn declared_taints(
    client: &Client,
) -> Result<Vec<(String, Option<String>, String)>, kube::Error> {
    let policies = Api::<NodeGuardPolicy>::all(client.clone())
        .list(&Default::default())
        .await?;
    Ok(policies
        .items
        .iter()
        .flat_map(|p| &p.spec.monitors)
        .flat_map(|m| &m.conditions)
        .filter_map(|c| c.taint.as_ref())
        .map(|t| (t.key.clone(), t.value.clone(), t.effect.clone()))
        .collect())
}

/// The Node's taints, as `(key, value, effect)`.
pub(super) async fn node_taints(
    client: &Client,
    node: &str,
) -> Result<Vec<(String, Option<String>, String)>, kube::Error> {
    let node = Api::<Node>::all(client.clone()).get(node).await?;
    Ok(node
        .spec
        .and_then(|s| s.taints)
        .unwrap_or_default()
        .into_iter()
        .map(|t| (t.key, t.value, t.effect))
        .collect())
}
