//! Adapters of the report ports onto the API: server-side apply of
//! nodeguard's conditions on `nodes/status`, and Events through kube's
//! recorder (events.k8s.io/v1, with series aggregation).

use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use std::collections::HashMap;

use k8s_openapi::api::core::v1::{Event as CoreEvent, EventSource};
use k8s_openapi::api::events::v1::Event as K8sEvent;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client, Resource};
use tokio::sync::watch;

use crate::report::conditions::owned_types;
use crate::report::{
    EventKind, EventPort, EventRequest, NodeState, Observation, Observed, ReportError, StatusPort,
    Written,
};

/// Field manager of every nodeguard write.
pub const FIELD_MANAGER: &str = "nodeguard";

/// The condition types nodeguard's field manager applied to the Node's
/// status (from its managedFields).
pub fn owned_condition_types(node: &Node) -> std::collections::BTreeSet<String> {
    node.metadata
        .managed_fields
        .iter()
        .flatten()
        .filter(|m| {
            m.manager.as_deref() == Some(FIELD_MANAGER)
                && m.subresource.as_deref() == Some("status")
                && m.operation.as_deref() == Some("Apply")
        })
        .filter_map(|m| m.fields_v1.as_ref())
        .flat_map(|f| owned_types(&f.0))
        .collect()
}
/// `reportingController` of nodeguard's Events.
pub const REPORTING_CONTROLLER: &str = "nodeguard.io/agent";

/// What the condition writer needs to know of a Node.
pub fn observe(node: &Node) -> Observation {
    let conditions = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .map(|cs| {
            cs.iter()
                .map(|c| Observed {
                    type_: c.type_.clone(),
                    status: c.status.clone(),
                    reason: c.reason.clone().unwrap_or_default(),
                    message: c.message.clone().unwrap_or_default(),
                    last_transition: c.last_transition_time.as_ref().map(|t| t.0),
                    last_heartbeat: c.last_heartbeat_time.as_ref().map(|t| t.0),
                })
                .collect()
        })
        .unwrap_or_default();
    let owned = owned_condition_types(node);
    let effective = node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(EFFECTIVE_ANNOTATION))
        .cloned();
    Observation {
        state: NodeState {
            conditions,
            owned,
            effective,
        },
        resource_version: node
            .metadata
            .resource_version
            .as_deref()
            .and_then(|v| v.parse().ok()),
    }
}

/// The annotation that shows which policies (and generations) are in force
/// on a node, applied with the conditions through `nodes/status`.
pub const EFFECTIVE_ANNOTATION: &str = "nodeguard.io/effective-policies";

/// The apply body: exactly nodeguard's conditions and, once known, its
/// effective-policies annotation; nothing else. (The Node's status
/// subresource takes metadata changes, so one apply writes both.)
pub fn apply_body(
    node_name: &str,
    conditions: &[Written],
    effective: Option<&str>,
) -> serde_json::Value {
    let time = |t: &Option<jiff::Timestamp>| {
        t.map(|t| serde_json::to_value(Time(t)).expect("a time serializes"))
    };
    let conditions: Vec<serde_json::Value> = conditions
        .iter()
        .map(|c| {
            serde_json::json!({
                "type": c.type_,
                "status": c.status,
                "reason": c.reason,
                "message": c.message,
                "lastTransitionTime": time(&c.last_transition),
                "lastHeartbeatTime": time(&c.last_heartbeat),
            })
        })
        .collect();
    let mut metadata = serde_json::json!({"name": node_name});
    if let Some(e) = effective {
        metadata["annotations"] = serde_json::json!({EFFECTIVE_ANNOTATION: e});
    }
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": metadata,
        "status": {"conditions": conditions},
    })
}

/// Writes conditions with server-side apply on `nodes/status`.
#[derive(Clone)]
pub struct KubeStatus {
    api: Api<Node>,
    node_name: String,
}

impl KubeStatus {
    pub fn new(client: Client, node_name: &str) -> Self {
        KubeStatus {
            api: Api::all(client),
            node_name: node_name.to_string(),
        }
    }
}

impl StatusPort for KubeStatus {
    async fn apply(
        &self,
        conditions: &[Written],
        effective: Option<&str>,
    ) -> Result<Observation, ReportError> {
        let body = apply_body(&self.node_name, conditions, effective);
        let node = self
            .api
            .patch_status(
                &self.node_name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&body),
            )
            .await?;
        Ok(observe(&node))
    }
}

/// Publishes Events regarding the Node (apiVersion, kind, name and uid set,
/// so `kubectl describe node` and `kubectl events --for node/X` find them).
///
/// An Event that repeats exactly (same type, reason, action and note)
/// within [`SERIES_WINDOW`] becomes a series on the first one (count and
/// lastObservedTime patched) instead of a new object. Events that differ
/// only in their note are kept apart: kube's own recorder would fold them
/// into the first note, which loses what happened.
pub struct KubeEvents {
    client: Client,
    node_name: String,
    instance: String,
    node: watch::Receiver<Option<Arc<Node>>>,
    recent: std::sync::Mutex<HashMap<SeriesKey, Recent>>,
    /// When core/v1 last refused an Event with a source (403: RBAC from
    /// before the chart granted it). Until [`CORE_RETRY`] later such Events
    /// go through events.k8s.io without their source: the Event is kept,
    /// its source component is lost.
    core_refused: std::sync::Mutex<Option<std::time::Instant>>,
}

/// How long after a refusal core/v1 is tried again (RBAC fixed by an
/// upgrade that did not restart the pod).
const CORE_RETRY: std::time::Duration = std::time::Duration::from_secs(600);

/// How long a published Event can absorb exact repeats.
pub const SERIES_WINDOW: std::time::Duration = std::time::Duration::from_secs(6 * 60);

type SeriesKey = (EventKind, String, String, String, Option<String>);

#[derive(Clone)]
struct Recent {
    name: String,
    count: i32,
    first: jiff::Timestamp,
    /// Created through core/v1 (its series is patched there too).
    core: bool,
}

impl KubeEvents {
    pub fn new(client: Client, node_name: &str, node: watch::Receiver<Option<Arc<Node>>>) -> Self {
        KubeEvents {
            client,
            node_name: node_name.to_string(),
            // The API server takes at most 128 characters here; a Node's
            // name may have 253.
            instance: clip_name(&format!("nodeguard-{node_name}"), 128).to_string(),
            node,
            recent: Default::default(),
            core_refused: Default::default(),
        }
    }

    /// Whether an Event with a source goes through core/v1 now.
    fn core_allowed(&self) -> bool {
        let refused = self.core_refused.lock().unwrap_or_else(|e| e.into_inner());
        refused.is_none_or(|at| at.elapsed() >= CORE_RETRY)
    }
}

impl EventPort for KubeEvents {
    async fn publish(&self, ev: &EventRequest) -> Result<(), ReportError> {
        let node = self.node.borrow().clone();
        let Some(node) = node else {
            return Err(ReportError::NodeUnknown(self.node_name.clone()));
        };
        let now = jiff::Timestamp::now();
        let key: SeriesKey = (
            ev.kind,
            ev.reason.clone(),
            ev.action.clone(),
            ev.note.clone(),
            ev.source.clone(),
        );
        let previous = {
            let mut recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
            recent.retain(|_, r| now.duration_since(r.first).unsigned_abs() < SERIES_WINDOW);
            recent.get(&key).cloned()
        };
        // An Event naming its source component goes through core/v1:
        // events.k8s.io/v1 refuses `deprecatedSource` on create ("needs to
        // be unset"). Either way it is the same object, with
        // `reportingController` (core/v1: `reportingComponent`) set.
        if let Some(r) = previous {
            let count = r.count + 1;
            let patch =
                serde_json::json!({"series": {"count": count, "lastObservedTime": MicroTime(now)}});
            let patched = if r.core {
                // And the legacy count and last time that readers of core
                // Events (kubectl's sort, event exporters) go by, as on
                // node-problem-detector's Events.
                let mut patch = patch;
                patch["count"] = count.into();
                patch["lastTimestamp"] =
                    serde_json::to_value(Time(now)).expect("a time serializes");
                Api::<CoreEvent>::namespaced(self.client.clone(), "default")
                    .patch(&r.name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map(drop)
            } else {
                Api::<K8sEvent>::namespaced(self.client.clone(), "default")
                    .patch(&r.name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map(drop)
            };
            match patched {
                Ok(()) => {
                    if let Some(e) = self
                        .recent
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .get_mut(&key)
                    {
                        e.count = count;
                    }
                    return Ok(());
                }
                // Gone (expired or deleted): start a new one below.
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => return Err(e.into()),
            }
        }
        let name = event_name(&self.node_name, now.as_nanosecond());
        let metadata = ObjectMeta {
            name: Some(name.clone()),
            namespace: Some("default".into()),
            ..Default::default()
        };
        let type_ = match ev.kind {
            EventKind::Normal => "Normal",
            EventKind::Warning => "Warning",
        };
        let mut core = false;
        if let Some(component) = ev.source.as_ref().filter(|_| self.core_allowed()) {
            let event = CoreEvent {
                metadata: metadata.clone(),
                event_time: Some(MicroTime(now)),
                action: Some(ev.action.clone()),
                reason: Some(ev.reason.clone()),
                message: Some(ev.note.clone()),
                involved_object: node.object_ref(&()),
                // What `kubectl get events` shows as the source, and what
                // NPD's users route and filter on.
                source: Some(EventSource {
                    component: Some(component.clone()),
                    host: Some(self.node_name.clone()),
                }),
                reporting_component: Some(REPORTING_CONTROLLER.into()),
                reporting_instance: Some(self.instance.clone()),
                type_: Some(type_.into()),
                // The legacy fields node-problem-detector's Events carry.
                count: Some(1),
                first_timestamp: Some(Time(now)),
                last_timestamp: Some(Time(now)),
                ..Default::default()
            };
            match Api::<CoreEvent>::namespaced(self.client.clone(), "default")
                .create(&PostParams::default(), &event)
                .await
            {
                Ok(_) => core = true,
                Err(kube::Error::Api(s)) if s.code == 403 => {
                    tracing::warn!(
                        error = %s.message,
                        "cannot create core/v1 Events (the chart's RBAC grants create and patch on events in the core group): Events of imported monitors go without their source component for the next 10 minutes"
                    );
                    *self.core_refused.lock().unwrap_or_else(|e| e.into_inner()) =
                        Some(std::time::Instant::now());
                }
                Err(e) => return Err(e.into()),
            }
        }
        if !core {
            let event = K8sEvent {
                metadata,
                event_time: Some(MicroTime(now)),
                action: Some(ev.action.clone()),
                reason: Some(ev.reason.clone()),
                note: Some(ev.note.clone()),
                regarding: Some(node.object_ref(&())),
                reporting_controller: Some(REPORTING_CONTROLLER.into()),
                reporting_instance: Some(self.instance.clone()),
                type_: Some(type_.into()),
                ..Default::default()
            };
            Api::<K8sEvent>::namespaced(self.client.clone(), "default")
                .create(&PostParams::default(), &event)
                .await?;
        }
        self.recent
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(
                key,
                Recent {
                    name,
                    count: 1,
                    first: now,
                    core,
                },
            );
        Ok(())
    }
}

/// The first `max` bytes of a name (Kubernetes names are ASCII), without
/// a `-` or `.` left at the cut, so it stays a valid DNS name.
fn clip_name(name: &str, max: usize) -> &str {
    if name.len() <= max {
        return name;
    }
    name[..max].trim_end_matches(['-', '.'])
}

/// An Event's name: the Node's name and the time, within the 253
/// characters of a DNS subdomain (a Node's name may use all of them).
fn event_name(node: &str, nanos: i128) -> String {
    let suffix = format!(".{nanos:x}");
    format!("{}{suffix}", clip_name(node, 253 - suffix.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_stay_within_the_api_servers_limits() {
        assert_eq!(clip_name("node-1", 128), "node-1");
        assert_eq!(clip_name("abc-def", 4), "abc");
        assert_eq!(clip_name("abc.def", 4), "abc");
        let node = format!(
            "{}.{}.{}.{}",
            "a".repeat(63),
            "b".repeat(63),
            "c".repeat(63),
            "d".repeat(61)
        );
        assert_eq!(node.len(), 253);
        let name = event_name(&node, i128::from(u64::MAX));
        assert!(name.len() <= 253, "{}", name.len());
        assert!(name.ends_with(".ffffffffffffffff"), "{name}");
        assert!(!name.contains(".."), "{name}");
        assert_eq!(event_name("n1", 255), "n1.ff");
    }

    #[test]
    fn observe_reads_conditions_times_and_only_our_applied_status_fields() {
        let node: Node = serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": "n", "resourceVersion": "42",
                "managedFields": [
                    {"manager": "nodeguard", "operation": "Apply", "subresource": "status",
                     "fieldsType": "FieldsV1",
                     "fieldsV1": {"f:status": {"f:conditions": {"k:{\"type\":\"Mine\"}": {}}}}},
                    {"manager": "kubelet", "operation": "Update", "subresource": "status",
                     "fieldsType": "FieldsV1",
                     "fieldsV1": {"f:status": {"f:conditions": {"k:{\"type\":\"Ready\"}": {}}}}},
                    {"manager": "nodeguard", "operation": "Apply",
                     "fieldsType": "FieldsV1",
                     "fieldsV1": {"f:status": {"f:conditions": {"k:{\"type\":\"NotStatus\"}": {}}}}},
                ],
            },
            "status": {"conditions": [
                {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "ok",
                 "lastTransitionTime": "2026-01-01T00:00:00Z", "lastHeartbeatTime": "2026-01-01T00:01:00Z"},
                {"type": "Mine", "status": "False"},
            ]},
        }))
        .unwrap();
        let o = observe(&node);
        assert_eq!(o.resource_version, Some(42));
        assert_eq!(o.state.owned.iter().collect::<Vec<_>>(), ["Mine"]);
        assert_eq!(o.state.conditions.len(), 2);
        assert_eq!(
            o.state.conditions[0].last_heartbeat,
            Some("2026-01-01T00:01:00Z".parse().unwrap())
        );
        assert_eq!(o.state.conditions[1].reason, "");
    }

    #[test]
    fn apply_body_has_only_our_conditions_and_rfc3339_times() {
        let body = apply_body(
            "n",
            &[Written {
                type_: "KernelDeadlock".into(),
                status: "False".into(),
                reason: "KernelHasNoDeadlock".into(),
                message: "Kernel has no deadlock.".into(),
                last_transition: Some("2026-01-01T00:00:00Z".parse().unwrap()),
                last_heartbeat: Some("2026-01-01T00:05:00Z".parse().unwrap()),
            }],
            None,
        );
        assert_eq!(body["metadata"], serde_json::json!({"name": "n"}));
        assert!(body.get("spec").is_none());
        let c = &body["status"]["conditions"][0];
        assert_eq!(c["lastTransitionTime"], "2026-01-01T00:00:00Z");
        assert_eq!(c["lastHeartbeatTime"], "2026-01-01T00:05:00Z");
        assert_eq!(body["status"]["conditions"].as_array().unwrap().len(), 1);
        // With the effective policies: that one annotation, and no other.
        let body = apply_body("n", &[], Some("a@1,b@3"));
        assert_eq!(
            body["metadata"],
            serde_json::json!({"name": "n", "annotations": {EFFECTIVE_ANNOTATION: "a@1,b@3"}})
        );
    }
}
