//! `spec.probes`: node-local health checks that become NodeConditions, and
//! pod checks that become readiness-gate conditions.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// One probe.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "[has(self.http), has(self.tcp), has(self.grpc), has(self.exec)].filter(x, x).size() == 1",
        "message": "set exactly one of http, tcp, grpc, exec"
    },
    {
        "rule": "has(self.pods) ? has(self.readinessGate) : has(self.conditionType)",
        "message": "node probes need conditionType; pod probes need readinessGate"
    },
    {
        "rule": "self.role == 'Readiness' || self.successThreshold == 1",
        "message": "successThreshold must be 1 for Liveness and Startup probes",
        "fieldPath": ".successThreshold"
    }
]))]
pub struct ProbeSpec {
    /// Unique within the policy; lowercase letters, digits and '-'.
    #[schemars(
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"),
        length(min = 1, max = 63)
    )]
    pub name: String,
    /// What to probe: absent is this node (127.0.0.1 and the host's
    /// commands); `pods` probes each pod on the node that matches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<PodTarget>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<HttpProbe>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp: Option<TcpProbe>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grpc: Option<GrpcProbe>,
    /// Node targets only: a command run on the host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exec: Option<ExecProbe>,
    /// Readiness (default), Liveness or Startup, with the kubelet's meaning
    /// on pods. On the node (nothing to restart) no role holds after a
    /// failure: Liveness keeps probing and clears when it passes; Startup
    /// probes until its first success, then stops.
    #[serde(default)]
    pub role: ProbeRole,
    /// The name of a Startup probe of the same target kind that must have
    /// succeeded (on the same target) before this one runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gated_by: Option<String>,
    #[serde(default)]
    #[schemars(range(max = 3600))]
    pub initial_delay_seconds: u32,
    #[serde(default = "default_period")]
    #[schemars(range(min = 1, max = 3600))]
    pub period_seconds: u32,
    #[serde(default = "default_one")]
    #[schemars(range(min = 1, max = 600))]
    pub timeout_seconds: u32,
    #[serde(default = "default_one")]
    #[schemars(range(min = 1, max = 100))]
    pub success_threshold: u32,
    #[serde(default = "default_three")]
    #[schemars(range(min = 1, max = 100))]
    pub failure_threshold: u32,
    /// Node targets: the NodeCondition type to set (True while failing),
    /// for example `KubeletUnhealthy`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub condition_type: Option<String>,
    /// Pod targets: the pod condition type to set (True while passing),
    /// which pods list in `spec.readinessGates`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub readiness_gate: Option<String>,
}

fn default_period() -> u32 {
    10
}
fn default_one() -> u32 {
    1
}
fn default_three() -> u32 {
    3
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum ProbeRole {
    #[default]
    Readiness,
    Liveness,
    Startup,
}

/// Pods on this node to probe.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodTarget {
    /// Pods whose labels match (an empty selector matches every pod).
    pub selector: LabelSelector,
    /// Only these namespaces (all when empty).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub namespaces: Vec<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HttpProbe {
    /// Node targets: the full URL, e.g. `http://127.0.0.1:10248/healthz`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Pod targets: port on the pod IP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// Pod targets: path (default `/`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Pod targets: HTTP (default) or HTTPS.
    #[serde(default)]
    pub scheme: HttpScheme,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<HttpHeader>,
    /// Accepted status codes (default 200-399).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_status: Option<StatusRange>,
    /// The body must contain this text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body_contains: Option<String>,
    /// Skip TLS verification (self-signed node-local endpoints).
    #[serde(default)]
    pub insecure_skip_tls_verify: bool,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum HttpScheme {
    #[default]
    #[serde(rename = "HTTP")]
    Http,
    #[serde(rename = "HTTPS")]
    Https,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
pub struct HttpHeader {
    pub name: String,
    pub value: String,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub struct StatusRange {
    #[schemars(range(min = 100, max = 599))]
    pub min: u16,
    #[schemars(range(min = 100, max = 599))]
    pub max: u16,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
pub struct TcpProbe {
    /// Node targets: default 127.0.0.1. Pod targets: always the pod IP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    pub port: u16,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
pub struct GrpcProbe {
    /// Node targets: default 127.0.0.1. Pod targets: always the pod IP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    pub port: u16,
    /// The service name in the health request (empty: the whole server).
    #[serde(default)]
    pub service: String,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
pub struct ExecProbe {
    /// argv; exit 0 passes. Output (truncated) is the message.
    pub command: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::validate::validate_probes;

    fn node_http(name: &str) -> ProbeSpec {
        serde_json::from_value(serde_json::json!({
            "name": name, "http": {"url": "http://127.0.0.1:10248/healthz"}, "conditionType": "KubeletUnhealthy"
        }))
        .unwrap()
    }

    #[test]
    fn defaults_are_the_kubelets() {
        let p = node_http("kubelet");
        assert_eq!(
            (
                p.period_seconds,
                p.timeout_seconds,
                p.success_threshold,
                p.failure_threshold
            ),
            (10, 1, 1, 3)
        );
        assert_eq!(p.role, ProbeRole::Readiness);
        assert!(validate_probes(&[p], "spec.probes").is_empty());
    }

    #[test]
    fn problems_with_paths() {
        let mut two = node_http("a");
        two.tcp = Some(TcpProbe {
            host: None,
            port: 1,
        });
        let mut live = node_http("live");
        live.role = ProbeRole::Liveness;
        live.success_threshold = 2;
        let mut no_cond = node_http("nocond");
        no_cond.condition_type = None;
        let pod: ProbeSpec = serde_json::from_value(serde_json::json!({
            "name": "pod", "pods": {"selector": {}}, "http": {"url": "http://x"}, "exec": {"command": []}
        }))
        .unwrap();
        let mut gated = node_http("gated");
        gated.gated_by = Some("live".into());
        let dup = node_http("a");
        let problems = validate_probes(&[two, live, no_cond, pod, gated, dup], "spec.probes");
        let paths: Vec<&str> = problems.iter().map(|p| p.path.as_str()).collect();
        for want in [
            "spec.probes[0]",
            "spec.probes[1].successThreshold",
            "spec.probes[2].conditionType",
            "spec.probes[3].readinessGate",
            "spec.probes[3].exec",
            "spec.probes[3].http",
            "spec.probes[3].exec.command",
            "spec.probes[4].gatedBy",
            "spec.probes[5].name",
        ] {
            assert!(paths.contains(&want), "missing {want} in {paths:?}");
        }
    }
}
