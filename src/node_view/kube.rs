//! Fills `NodeView` from the API for `nodeguard status NODE`.

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::events::v1::Event as K8sEvent;
use kube::api::ListParams;
use kube::{Api, Client};

use super::{AgentRow, ConditionRow, EventRow, Healthz, NodeView, TaintRow, parse_effective};
use crate::policy::NodeGuardPolicy;

use crate::report::kube::{EFFECTIVE_ANNOTATION, REPORTING_CONTROLLER};

#[derive(Debug, thiserror::Error)]
pub enum ViewError {
    #[error("node {0} not found")]
    NoNode(String),
    #[error("cannot read {what}: {source}")]
    Api {
        what: &'static str,
        #[source]
        source: kube::Error,
    },
}

fn api(what: &'static str) -> impl FnOnce(kube::Error) -> ViewError {
    move |source| ViewError::Api { what, source }
}

/// Reads what `nodeguard status` shows of `node`; at most `events` Events.
pub async fn fetch(client: &Client, node: &str, events: usize) -> Result<NodeView, ViewError> {
    let nodes: Api<Node> = Api::all(client.clone());
    let n = nodes
        .get_opt(node)
        .await
        .map_err(api("the Node"))?
        .ok_or_else(|| ViewError::NoNode(node.to_string()))?;
    let mut view = NodeView {
        node: node.to_string(),
        ..Default::default()
    };
    let annotations = n.metadata.annotations.clone().unwrap_or_default();
    view.policies = annotations
        .get(EFFECTIVE_ANNOTATION)
        .map(|v| parse_effective(v))
        .unwrap_or_default();

    // The conditions nodeguard's field manager owns on the status.
    let owned = crate::report::kube::owned_condition_types(&n);
    view.conditions = n
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .filter(|c| owned.contains(&c.type_))
        .map(|c| ConditionRow {
            type_: c.type_.clone(),
            status: c.status.clone(),
            reason: c.reason.clone().unwrap_or_default(),
            message: c.message.clone().unwrap_or_default(),
            since: c.last_transition_time.as_ref().map(|t| t.0.to_string()),
            heartbeat: c.last_heartbeat_time.as_ref().map(|t| t.0.to_string()),
        })
        .collect();

    // Taints the policies in force may add: the shutdown taint, and each
    // monitor condition's.
    let on_node: Vec<(String, String)> = n
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .into_iter()
        .flatten()
        .map(|t| (t.key.clone(), t.effect.clone()))
        .collect();
    let mut wanted: Vec<(String, String, String)> = Vec::new();
    let policies: Api<NodeGuardPolicy> = Api::all(client.clone());
    for p in &view.policies {
        let policy = match policies.get_opt(&p.name).await {
            Ok(Some(policy)) => policy,
            Ok(None) => {
                view.errors.push(format!(
                    "the taints of policy {} (in force at generation {}; since deleted)",
                    p.name, p.generation
                ));
                continue;
            }
            Err(e) => {
                view.errors.push(format!(
                    "the taints of policy {}: {e} (needs get on nodeguardpolicies.nodeguard.io)",
                    p.name
                ));
                continue;
            }
        };
        if policy.metadata.generation != Some(p.generation) {
            view.errors.push(format!(
                "policy {} is at generation {} but generation {} is in force here: taints shown are the newer one's",
                p.name,
                policy.metadata.generation.unwrap_or_default(),
                p.generation
            ));
        }
        if policy.spec.shutdown.is_some() {
            wanted.push((
                crate::shutdown::core::TAINT_KEY.into(),
                crate::shutdown::core::TAINT_EFFECT.into(),
                format!("graceful shutdown ({})", p.name),
            ));
        }
        for m in &policy.spec.monitors {
            for c in &m.conditions {
                if let Some(t) = &c.taint {
                    wanted.push((
                        t.key.clone(),
                        t.effect.clone(),
                        format!("monitor {} ({} True)", m.name, c.type_),
                    ));
                }
            }
        }
    }
    // The shutdown taint shows even when no policy in force has a shutdown
    // section any more (left behind is worth seeing).
    if !wanted
        .iter()
        .any(|(k, _, _)| k == crate::shutdown::core::TAINT_KEY)
        && on_node
            .iter()
            .any(|(k, _)| k == crate::shutdown::core::TAINT_KEY)
    {
        wanted.push((
            crate::shutdown::core::TAINT_KEY.into(),
            crate::shutdown::core::TAINT_EFFECT.into(),
            "graceful shutdown (no policy in force has one)".into(),
        ));
    }
    view.taints = wanted
        .into_iter()
        .map(|(key, effect, source)| TaintRow {
            present: on_node.iter().any(|(k, e)| *k == key && *e == effect),
            key,
            effect,
            source,
        })
        .collect();

    // nodeguard's Events about the node (it writes them in "default").
    let evs: Api<K8sEvent> = Api::namespaced(client.clone(), "default");
    let list = match evs
        .list(&ListParams::default().fields(&format!("regarding.name={node}")))
        .await
    {
        Ok(l) => l.items,
        Err(e) => {
            view.errors.push(format!(
                "Events: {e} (needs list events.events.k8s.io in namespace default)"
            ));
            Vec::new()
        }
    };
    let mut rows: Vec<(jiff::Timestamp, EventRow)> = list
        .into_iter()
        .filter(|e| e.reporting_controller.as_deref() == Some(REPORTING_CONTROLLER))
        .filter(|e| e.regarding.as_ref().and_then(|r| r.kind.as_deref()) == Some("Node"))
        .map(|e| {
            let last = e
                .series
                .as_ref()
                .map(|s| s.last_observed_time.0)
                .or(e.event_time.as_ref().map(|t| t.0))
                .unwrap_or(jiff::Timestamp::UNIX_EPOCH);
            let count = e.series.as_ref().map(|s| s.count).unwrap_or(1);
            (
                last,
                EventRow {
                    time: last.to_string(),
                    type_: e.type_.unwrap_or_default(),
                    reason: e.reason.unwrap_or_default(),
                    note: e.note.unwrap_or_default(),
                    count,
                },
            )
        })
        .collect();
    rows.sort_by_key(|r| r.0);
    let skip = rows.len().saturating_sub(events);
    view.events = rows.into_iter().skip(skip).map(|(_, r)| r).collect();

    // The agent's pod on the node (the chart's label), and its /healthz.
    let pods: Api<Pod> = Api::all(client.clone());
    let candidates = match pods
        .list(
            &ListParams::default()
                .fields(&format!("spec.nodeName={node}"))
                .labels("app.kubernetes.io/name=nodeguard"),
        )
        .await
    {
        Ok(l) => l.items,
        Err(e) => {
            view.errors.push(format!(
                "the agent's pod: {e} (needs list pods in all namespaces)"
            ));
            Vec::new()
        }
    };
    // During a rollout the old pod may be terminating beside the new one:
    // a running one that is not being deleted first.
    let rank = |p: &Pod| {
        let running = p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
        let deleting = p.metadata.deletion_timestamp.is_some();
        (!running, deleting)
    };
    let agent = candidates.into_iter().min_by_key(rank);
    if let Some(pod) = agent {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        let status = pod.status.clone().unwrap_or_default();
        let ready = status
            .conditions
            .iter()
            .flatten()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        let port = pod
            .spec
            .as_ref()
            .and_then(|s| s.containers.first())
            .and_then(|c| c.ports.as_ref())
            .and_then(|ps| ps.iter().find(|p| p.name.as_deref() == Some("http")))
            .map(|p| p.container_port)
            .unwrap_or(9909);
        let healthz = healthz(client, &namespace, &name, port).await;
        view.agent = Some(AgentRow {
            pod: name,
            namespace,
            phase: status.phase.unwrap_or_else(|| "Unknown".into()),
            ready,
            healthz,
        });
    }
    Ok(view)
}

/// `/healthz` of the agent's pod through the API server's pod proxy
/// (the status code, and the body, which says why when it is not 200).
async fn healthz(client: &Client, ns: &str, pod: &str, port: i32) -> Healthz {
    let unreachable = |why: String| Healthz {
        code: None,
        body: why,
    };
    let path = format!("/api/v1/namespaces/{ns}/pods/{pod}:{port}/proxy/healthz");
    let req = match http::Request::get(&path).body(Vec::new()) {
        Ok(r) => r,
        Err(e) => return unreachable(e.to_string()),
    };
    let call = client.send(req.map(Into::into));
    let resp = match tokio::time::timeout(std::time::Duration::from_secs(5), call).await {
        Err(_) => return unreachable("no answer within 5 s".into()),
        Ok(Err(e)) => return unreachable(e.to_string()),
        Ok(Ok(r)) => r,
    };
    let code = resp.status().as_u16();
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
        .unwrap_or_default();
    // The API server's own refusals (403 without pods/proxy, 503 when it
    // cannot reach the pod) are a metav1.Status, not the agent's answer.
    if let Ok(status) = serde_json::from_str::<serde_json::Value>(&body)
        && status.get("kind").and_then(|k| k.as_str()) == Some("Status")
    {
        let message = status
            .get("message")
            .and_then(|m| m.as_str())
            .unwrap_or("")
            .to_string();
        let hint = if code == 403 {
            " (needs get on pods/proxy)"
        } else {
            ""
        };
        return unreachable(format!("API server {code}: {message}{hint}"));
    }
    Healthz {
        code: Some(code),
        body,
    }
}
