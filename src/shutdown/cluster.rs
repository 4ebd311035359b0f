//! The cluster side of shutdown: nodeguard's taint on the Node, the
//! Eviction API (PodDisruptionBudgets honoured), deletes for escalation,
//! and the facts the decision core needs from a Pod.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::policy::v1::{Eviction, PodDisruptionBudget};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{DeleteOptions, ObjectMeta};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client};

use super::core::PodFacts;
use super::{ClusterPort, ShutdownError};
use crate::k8s::taints;
use crate::policy::Selector;

pub use super::core::{TAINT_EFFECT, TAINT_KEY, TAINT_VALUE};

/// The outcome of one eviction request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Evicted {
    /// Accepted: the pod is terminating with the grace we asked for.
    Yes,
    /// The pod no longer exists.
    Gone,
    /// Refused (429): a PodDisruptionBudget does not allow it now.
    Blocked {
        pdb: Option<String>,
        message: String,
    },
}

/// The decision core's view of a Pod.
pub fn pod_facts(pod: &Pod) -> PodFacts {
    let spec = pod.spec.as_ref();
    let meta = &pod.metadata;
    PodFacts {
        key: format!(
            "{}/{}",
            meta.namespace.as_deref().unwrap_or_default(),
            meta.name.as_deref().unwrap_or_default()
        ),
        priority: spec.and_then(|s| s.priority).unwrap_or(0),
        termination_grace_seconds: spec.and_then(|s| s.termination_grace_period_seconds),
        daemonset: meta
            .owner_references
            .iter()
            .flatten()
            .any(|o| o.kind == "DaemonSet" && o.controller == Some(true)),
        mirror: meta
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key("kubernetes.io/config.mirror")),
        // As the scheduler matches a toleration to a taint: the effect and
        // the key when given (no key: operator Exists, every taint), then
        // Exists takes any value and Equal (the default) only the same.
        tolerates_shutdown: spec.and_then(|s| s.tolerations.as_ref()).is_some_and(|ts| {
            ts.iter().any(|t| {
                let exists = t.operator.as_deref() == Some("Exists");
                let key_ok = match t.key.as_deref() {
                    None | Some("") => exists,
                    Some(k) => k == TAINT_KEY,
                };
                let effect_ok = t
                    .effect
                    .as_deref()
                    .is_none_or(|e| e.is_empty() || e == TAINT_EFFECT);
                let value_ok = match t.operator.as_deref() {
                    Some("Exists") => true,
                    None | Some("") | Some("Equal") => {
                        t.value.as_deref().unwrap_or_default() == TAINT_VALUE
                    }
                    Some(_) => false,
                };
                key_ok && effect_ok && value_ok
            })
        }),
        terminal: matches!(
            pod.status.as_ref().and_then(|s| s.phase.as_deref()),
            Some("Succeeded") | Some("Failed")
        ),
    }
}

/// Whether a 429 answer to an eviction is a PodDisruptionBudget's refusal
/// (its cause `DisruptionBudget`, or the API server's wording), not API
/// Priority and Fairness throttling ("Too many requests").
pub fn is_budget_refusal(status: &kube::core::Status) -> bool {
    status
        .details
        .as_ref()
        .is_some_and(|d| d.causes.iter().any(|c| c.reason == "DisruptionBudget"))
        || status.message.contains("disruption budget")
}

/// The PodDisruptionBudget name in an eviction refusal, when the API
/// server names it ("The disruption budget NAME needs …").
pub fn pdb_from_message(message: &str) -> Option<String> {
    let rest = message.split("disruption budget ").nth(1)?;
    let name = rest.split_whitespace().next()?;
    Some(name.trim_end_matches([',', '.', ':']).to_string()).filter(|n| !n.is_empty())
}

/// The Eviction for the pod `namespace/name` with `grace`. Posted as is:
/// kube's `Api::evict` sends its delete options as `delete_options`, a key
/// the API server ignores, so the pod would get its own grace period.
pub fn eviction(key: &str, grace: i64) -> Eviction {
    let (ns, name) = key.split_once('/').unwrap_or(("default", key));
    Eviction {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(ns.into()),
            ..Default::default()
        },
        delete_options: Some(DeleteOptions {
            grace_period_seconds: Some(grace.max(0)),
            ..Default::default()
        }),
    }
}

/// The API adapter.
#[derive(Clone)]
pub struct KubeCluster {
    client: Client,
    node_name: String,
}

impl KubeCluster {
    pub fn new(client: Client, node_name: &str) -> Self {
        KubeCluster {
            client,
            node_name: node_name.to_string(),
        }
    }

    fn pods(&self, key: &str) -> (Api<Pod>, String) {
        let (ns, name) = key.split_once('/').unwrap_or(("default", key));
        (Api::namespaced(self.client.clone(), ns), name.to_string())
    }

    async fn pdb_matching(&self, key: &str) -> Option<String> {
        let (pods, name) = self.pods(key);
        let pod = pods.get(&name).await.ok()?;
        let labels = pod.metadata.labels.unwrap_or_default();
        let ns = pod.metadata.namespace?;
        let pdbs: Api<PodDisruptionBudget> = Api::namespaced(self.client.clone(), &ns);
        let list = pdbs.list(&ListParams::default()).await.ok()?;
        list.items.into_iter().find_map(|pdb| {
            let sel = pdb.spec.as_ref()?.selector.as_ref()?;
            let mut problems = Vec::new();
            let s = Selector::parse(sel, "selector", &mut problems)?;
            (!s.is_everything() && s.matches(&labels))
                .then(|| pdb.metadata.name.unwrap_or_default())
        })
    }
}

impl ClusterPort for KubeCluster {
    async fn add_taint(&self) -> Result<bool, ShutdownError> {
        Ok(taints::add(
            &self.client,
            &self.node_name,
            TAINT_KEY,
            TAINT_VALUE,
            TAINT_EFFECT,
        )
        .await?)
    }

    async fn remove_taint(&self) -> Result<(), ShutdownError> {
        Ok(taints::remove(&self.client, &self.node_name, TAINT_KEY, TAINT_EFFECT).await?)
    }

    async fn remove_left_taint(&self) -> Result<bool, ShutdownError> {
        Ok(taints::remove_valued(
            &self.client,
            &self.node_name,
            TAINT_KEY,
            TAINT_VALUE,
            TAINT_EFFECT,
        )
        .await?)
    }

    async fn evict(&self, key: &str, grace: i64) -> Result<Evicted, ShutdownError> {
        let (pods, name) = self.pods(key);
        match pods
            .create_subresource::<_, kube::core::Status>(
                "eviction",
                &name,
                &PostParams::default(),
                &eviction(key, grace),
            )
            .await
        {
            Ok(_) => Ok(Evicted::Yes),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(Evicted::Gone),
            // API Priority and Fairness answers 429 to any request when it
            // sheds load: a failure to retry, not a budget's refusal (no
            // escalation, no PDB named).
            Err(kube::Error::Api(s)) if s.code == 429 && !is_budget_refusal(&s) => {
                Err(ShutdownError::Throttled(s.message.clone()))
            }
            Err(kube::Error::Api(s)) if s.code == 429 => {
                let from_causes = s
                    .details
                    .as_ref()
                    .and_then(|d| d.causes.iter().find_map(|c| pdb_from_message(&c.message)));
                let pdb = match from_causes.or_else(|| pdb_from_message(&s.message)) {
                    Some(p) => Some(p),
                    None => self.pdb_matching(key).await,
                };
                Ok(Evicted::Blocked {
                    pdb,
                    message: s.message.clone(),
                })
            }
            Err(e) => Err(e.into()),
        }
    }

    async fn delete(&self, key: &str, grace: i64) -> Result<(), ShutdownError> {
        let (pods, name) = self.pods(key);
        let params = DeleteParams {
            grace_period_seconds: Some(grace.max(0) as u32),
            ..Default::default()
        };
        match pods.delete(&name, &params).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The two 429s an eviction gets, as the API server writes them: a
    /// budget's refusal (pkg/registry/core/pod/storage/eviction.go) and API
    /// Priority and Fairness shedding load. Only the first is a refusal.
    #[test]
    fn a_429_is_a_budget_refusal_only_when_it_says_so() {
        let status =
            |v: serde_json::Value| -> kube::core::Status { serde_json::from_value(v).unwrap() };
        let budget = status(serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 429,
            "reason": "TooManyRequests",
            "message": "Cannot evict pod as it would violate the pod's disruption budget.",
            "details": {"causes": [{"reason": "DisruptionBudget",
                "message": "The disruption budget web needs 2 healthy pods and has 2 currently"}]}
        }));
        assert!(is_budget_refusal(&budget));
        let wording_only = status(serde_json::json!({
            "kind": "Status", "status": "Failure", "code": 429, "reason": "TooManyRequests",
            "message": "Cannot evict pod as it would violate the pod's disruption budget."
        }));
        assert!(is_budget_refusal(&wording_only));
        let throttled = status(serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 429,
            "reason": "TooManyRequests", "message": "Too many requests, please try again later.",
            "details": {"retryAfterSeconds": 1}
        }));
        assert!(!is_budget_refusal(&throttled));
    }

    fn pod(v: serde_json::Value) -> Pod {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn a_trimmed_pod_gives_the_same_facts() {
        for pod in crate::k8s::watch::realistic_pods() {
            let mut trimmed = pod.clone();
            crate::k8s::watch::trim_pod(&mut trimmed);
            assert_eq!(
                pod_facts(&trimmed),
                pod_facts(&pod),
                "{:?}",
                pod.metadata.name
            );
        }
    }

    #[test]
    fn facts_from_pods() {
        let p = pod(serde_json::json!({
            "metadata": {"namespace": "ns", "name": "web",
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "ds", "uid": "u", "controller": true}]},
            "spec": {"priority": 1000, "terminationGracePeriodSeconds": 15, "containers": [],
                "tolerations": [{"key": "nodeguard.io/shutdown", "operator": "Exists", "effect": "NoSchedule"}]},
            "status": {"phase": "Running"},
        }));
        let f = pod_facts(&p);
        assert_eq!(f.key, "ns/web");
        assert_eq!(f.priority, 1000);
        assert_eq!(f.termination_grace_seconds, Some(15));
        assert!(f.daemonset && f.tolerates_shutdown && !f.mirror && !f.terminal);

        let p = pod(serde_json::json!({
            "metadata": {"namespace": "kube-system", "name": "etcd-n1",
                "annotations": {"kubernetes.io/config.mirror": "abc"}},
            "spec": {"containers": [], "tolerations": [{"operator": "Exists"}]},
            "status": {"phase": "Succeeded"},
        }));
        let f = pod_facts(&p);
        assert_eq!(f.priority, 0);
        assert!(
            f.mirror && f.terminal && f.tolerates_shutdown,
            "tolerate-everything counts"
        );

        let p = pod(serde_json::json!({
            "metadata": {"namespace": "ns", "name": "x"},
            "spec": {"containers": [], "tolerations": [
                {"key": "nodeguard.io/shutdown", "operator": "Exists", "effect": "NoExecute"},
                {"key": "other", "operator": "Exists"}]},
        }));
        assert!(
            !pod_facts(&p).tolerates_shutdown,
            "another effect or key does not count"
        );

        // Equal (the default operator) needs the taint's value.
        let with = |toleration: serde_json::Value| {
            pod_facts(&pod(serde_json::json!({
                "metadata": {"namespace": "ns", "name": "x"},
                "spec": {"containers": [], "tolerations": [toleration]},
            })))
            .tolerates_shutdown
        };
        assert!(with(
            serde_json::json!({"key": "nodeguard.io/shutdown", "operator": "Equal", "value": "shutting-down"})
        ));
        assert!(with(
            serde_json::json!({"key": "nodeguard.io/shutdown", "value": "shutting-down", "effect": "NoSchedule"})
        ));
        assert!(!with(
            serde_json::json!({"key": "nodeguard.io/shutdown", "operator": "Equal", "value": "maintenance"})
        ));
        assert!(!with(serde_json::json!({"key": "nodeguard.io/shutdown"})));
        assert!(!with(
            serde_json::json!({"key": "nodeguard.io/shutdown", "operator": "Lt", "value": "shutting-down"})
        ));
    }

    #[test]
    fn the_eviction_carries_the_grace_where_the_api_server_reads_it() {
        assert_eq!(
            serde_json::to_value(eviction("ns/web", 4)).unwrap(),
            serde_json::json!({
                "apiVersion": "policy/v1",
                "kind": "Eviction",
                "metadata": {"name": "web", "namespace": "ns"},
                "deleteOptions": {"gracePeriodSeconds": 4},
            })
        );
        assert_eq!(
            serde_json::to_value(eviction("ns/web", -3)).unwrap()["deleteOptions"],
            serde_json::json!({"gracePeriodSeconds": 0})
        );
    }

    #[test]
    fn pdb_names_from_refusals() {
        assert_eq!(
            pdb_from_message(
                "The disruption budget web-pdb needs 2 healthy pods and has 2 currently"
            ),
            Some("web-pdb".into())
        );
        assert_eq!(
            pdb_from_message("Cannot evict pod as it would violate the pod's disruption budget."),
            None
        );
        assert_eq!(pdb_from_message("nothing"), None);
    }
}
