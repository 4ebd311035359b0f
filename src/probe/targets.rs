//! Which workers should run and what each one probes: the probes and the
//! pods in, worker definitions, targets and actions out. Pure: the pods
//! come as a snapshot and the time as an argument.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;

use super::core::{self, Role, TargetView};
use super::prober::{Action, join_host_port};
use crate::k8s::watch::Snapshot;
use crate::policy::Selector;
use crate::policy::probes::{HttpScheme, ProbeRole, ProbeSpec};

/// A worker's key: the probe's name and its target (`node`, or the pod's
/// `namespace/name`).
pub type WorkerKey = (String, String);

pub(super) const NODE: &str = "node";

/// Where the results of a probe go.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Output {
    NodeCondition(String),
    ReadinessGate(String),
}

/// A worker's definition; a change restarts the worker.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Def {
    pub(super) spec: ProbeSpec,
    /// For pod targets: the resolved target (its IP and status are read
    /// live).
    pub(super) pod: Option<String>,
    /// For pod targets: the pod's UID, so a pod recreated under the same
    /// name gets a fresh worker.
    pub(super) uid: Option<String>,
}

/// The NodeCondition of a stopped worker's definition that no desired
/// worker writes any more (its probe was removed, or its `conditionType`
/// renamed): it is removed from the Node. (A pod's readiness gate is left
/// as it is: the pod asked for it and removing it would not make the pod
/// ready.)
pub(super) fn stale_condition(def: &Def, desired: &HashSet<String>) -> Option<String> {
    match output(&def.spec) {
        Some(Output::NodeCondition(t)) if !desired.contains(&t) => Some(t),
        _ => None,
    }
}

pub(super) fn output(spec: &ProbeSpec) -> Option<Output> {
    match (&spec.pods, &spec.condition_type, &spec.readiness_gate) {
        (None, Some(t), _) => Some(Output::NodeCondition(t.clone())),
        (Some(_), _, Some(g)) => Some(Output::ReadinessGate(g.clone())),
        _ => None,
    }
}

/// The workers that should run: node probes once, pod probes per matching
/// pod that is not terminal.
pub(super) fn desired_workers(
    specs: &[ProbeSpec],
    pods: Option<&Snapshot<Pod>>,
) -> HashMap<WorkerKey, Def> {
    let mut out = HashMap::new();
    for spec in specs {
        match &spec.pods {
            None => {
                out.insert(
                    (spec.name.clone(), NODE.to_string()),
                    Def {
                        spec: spec.clone(),
                        pod: None,
                        uid: None,
                    },
                );
            }
            Some(target) => {
                let mut problems = Vec::new();
                let Some(selector) = Selector::parse(&target.selector, "selector", &mut problems)
                else {
                    continue;
                };
                for (key, pod) in pods.into_iter().flatten() {
                    let ns = pod.metadata.namespace.as_deref().unwrap_or_default();
                    if !target.namespaces.is_empty() && !target.namespaces.iter().any(|n| n == ns) {
                        continue;
                    }
                    let labels = pod.metadata.labels.clone().unwrap_or_default();
                    if !selector.matches(&labels) {
                        continue;
                    }
                    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
                    if !core::probes_pod(phase) {
                        continue;
                    }
                    out.insert(
                        (spec.name.clone(), key.clone()),
                        Def {
                            spec: spec.clone(),
                            pod: Some(key.clone()),
                            uid: pod.metadata.uid.clone(),
                        },
                    );
                }
            }
        }
    }
    out
}

pub(super) fn role(r: ProbeRole) -> Role {
    match r {
        ProbeRole::Readiness => Role::Readiness,
        ProbeRole::Liveness => Role::Liveness,
        ProbeRole::Startup => Role::Startup,
    }
}

/// The action against a concrete target (`ip` for pod probes).
pub(super) fn action(spec: &ProbeSpec, ip: Option<&str>) -> Option<Action> {
    let host = |h: &Option<String>| match ip {
        Some(ip) => ip.to_string(),
        None => h.clone().unwrap_or_else(|| "127.0.0.1".into()),
    };
    if let Some(h) = &spec.http {
        let url = match (ip, &h.url) {
            (None, Some(u)) => u.clone(),
            (Some(ip), _) => format!(
                "{}://{}{}",
                if h.scheme == HttpScheme::Https {
                    "https"
                } else {
                    "http"
                },
                join_host_port(ip, h.port.unwrap_or(80)),
                h.path.as_deref().unwrap_or("/")
            ),
            (None, None) => return None,
        };
        let status = h
            .expected_status
            .map(|r| (r.min, r.max))
            .unwrap_or((200, 399));
        return Some(Action::Http {
            url,
            headers: h
                .headers
                .iter()
                .map(|h| (h.name.clone(), h.value.clone()))
                .collect(),
            status,
            body_contains: h.body_contains.clone(),
            insecure: h.insecure_skip_tls_verify,
        });
    }
    if let Some(t) = &spec.tcp {
        return Some(Action::Tcp {
            host: host(&t.host),
            port: t.port,
        });
    }
    if let Some(g) = &spec.grpc {
        return Some(Action::Grpc {
            host: host(&g.host),
            port: g.port,
            service: g.service.clone(),
        });
    }
    spec.exec.as_ref().map(|e| Action::Exec {
        command: e.command.clone(),
    })
}

/// [`view`] of a pod target, from the pod in the snapshot (`None`: not
/// there). A pod with another UID than the worker's is a different pod
/// recreated under the same name: for this worker it is gone. The
/// identity is the pod's UID, IP and container IDs, so a container the
/// kubelet restarted is a new target (it ends an on-hold).
pub(super) fn pod_view(
    def: &Def,
    pod: Option<&Pod>,
    gate: Option<&str>,
    now: jiff::Timestamp,
    gate_open: bool,
) -> (TargetView, Option<String>, bool) {
    let pod = pod.filter(|p| def.uid.is_none() || p.metadata.uid == def.uid);
    let Some(pod) = pod else {
        // Gone from the node (or replaced): the worker ends.
        return (
            TargetView {
                known: true,
                terminal: true,
                identity: None,
                running: false,
                running_for: Duration::ZERO,
                finished_for_good: true,
                deleting: true,
                gate_open,
            },
            None,
            false,
        );
    };
    let status = pod.status.as_ref();
    let phase = status.and_then(|s| s.phase.as_deref()).unwrap_or("Pending");
    let ip = status.and_then(|s| s.pod_ip.clone());
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let mut containers: Vec<&str> = status
        .and_then(|s| s.container_statuses.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|c| c.container_id.as_deref())
        .filter(|id| !id.is_empty())
        .collect();
    containers.sort_unstable();
    let containers = containers.join(",");
    let running_for = status
        .and_then(|s| s.start_time.as_ref())
        .map(|t| {
            let secs = (now - t.0).get_seconds().max(0);
            Duration::from_secs(secs as u64)
        })
        .unwrap_or_default();
    let restart = pod.spec.as_ref().and_then(|s| s.restart_policy.as_deref()) != Some("Never");
    let carried = gate.is_some_and(|g| {
        status
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == g))
    });
    (
        TargetView {
            known: true,
            terminal: matches!(phase, "Succeeded" | "Failed"),
            identity: ip.as_ref().map(|ip| format!("{uid}/{ip}/{containers}")),
            running: phase == "Running",
            running_for,
            finished_for_good: phase != "Running" && phase != "Pending" && !restart,
            deleting: pod.metadata.deletion_timestamp.is_some(),
            gate_open,
        },
        ip,
        carried,
    )
}
