//! The `NodeGuardPolicy` custom resource (group `nodeguard.io`, version
//! `v1alpha1`, cluster-scoped) and everything that decides whether a policy
//! is valid and which nodes it selects.
//!
//! The Rust types here are the single source of truth: `nodeguard crd`
//! prints the CRD generated from them and `crds/` holds that output.
//! Capability issues add their own sections to [`NodeGuardPolicySpec`].

mod load;
mod select;
pub mod selector;
mod validate;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub use load::{PolicyDocument, load_policies};
pub use select::{Selection, select};
pub use selector::Selector;
pub use validate::{Problem, validate};

/// API group of every nodeguard resource.
pub const GROUP: &str = "nodeguard.io";

/// Errors of the policy module: reading, parsing and validating policies.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{origin}: not valid YAML: {message}")]
    Yaml { origin: String, message: String },
    #[error(
        "{origin}: document {index} is a {kind}, not a NodeGuardPolicy (apiVersion nodeguard.io/v1alpha1)"
    )]
    WrongKind {
        origin: String,
        index: usize,
        kind: String,
    },
    #[error("{origin}: no NodeGuardPolicy documents found")]
    Empty { origin: String },
}

/// Desired behaviour of nodeguard on the nodes this policy selects.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "nodeguard.io",
    version = "v1alpha1",
    kind = "NodeGuardPolicy",
    plural = "nodeguardpolicies",
    singular = "nodeguardpolicy",
    shortname = "ngp",
    category = "nodeguard",
    doc = "NodeGuardPolicy configures the nodeguard agent on the nodes its nodeSelector matches.",
    status = "NodeGuardPolicyStatus",
    printcolumn = r#"{"name":"Accepted","type":"string","jsonPath":".status.conditions[?(@.type==\"Accepted\")].status","description":"Whether the agents accepted this generation of the policy"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","jsonPath":".status.conditions[?(@.type==\"Accepted\")].reason","description":"Why the policy is (not) accepted"}"#,
    printcolumn = r#"{"name":"Observed","type":"integer","jsonPath":".status.observedGeneration","description":"Generation the status describes","priority":1}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct NodeGuardPolicySpec {
    /// Nodes this policy applies to, matched against the Node's labels.
    /// An absent or empty selector selects every node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<LabelSelector>,

    /// How `/healthz` judges whether the node should keep receiving traffic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub healthz: Option<HealthzSpec>,
}

/// `/healthz` settings. The node is always ineligible while it is being
/// deleted or tainted `ToBeDeletedByClusterAutoscaler`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HealthzSpec {
    /// Further taint keys that make the node ineligible (for example a
    /// drain taint of your own tooling). Policies that select the node add up.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub ineligible_taints: Vec<String>,
}

/// What the agents observed of this policy.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeGuardPolicyStatus {
    /// The `metadata.generation` the conditions describe.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Standard conditions; `Accepted` tells whether the policy is in force.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

impl NodeGuardPolicy {
    /// The CRD as YAML, exactly as committed under `crds/`.
    pub fn crd_yaml() -> String {
        use kube::CustomResourceExt;
        let crd = Self::crd();
        serde_saphyr::to_string(&crd).expect("a CRD always serializes to YAML")
    }
}
