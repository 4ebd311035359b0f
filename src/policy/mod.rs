//! The `NodeGuardPolicy` custom resource (group `nodeguard.io`, version
//! `v1alpha1`, cluster-scoped) and everything that decides whether a policy
//! is valid and which nodes it selects.
//!
//! The Rust types here are the single source of truth: `nodeguard crd`
//! prints the CRD generated from them and `crds/` holds that output.
//! Capability issues add their own sections to [`NodeGuardPolicySpec`].

pub mod condition;
pub mod defaults;
pub mod goregex;
pub mod kube;
mod load;
pub mod monitors;
pub mod npd;
pub mod probes;
mod problem;
mod select;
pub mod selector;
pub mod trust;
mod validate;

use ::kube::CustomResource;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The taint the graceful shutdown puts on its node (value `shutting-down`,
/// NoSchedule); reserved: a monitor condition may not taint with this key.
pub const SHUTDOWN_TAINT_KEY: &str = "nodeguard.io/shutdown";

pub use condition::{PolicyReport, policy_report};
pub use load::{PolicyDocument, load_policies};

/// The condition nodeguard sets about its own policies on each node.
pub const POLICY_CONDITION: &str = "NodeGuardPolicyInvalid";
/// [`POLICY_CONDITION`]'s reason while a policy selecting the node is
/// invalid (beside it: `PolicyRefused`, `PolicyOverLimit`).
pub const POLICY_INVALID: &str = "PolicyInvalid";
pub use problem::Problem;
pub use select::{
    MAX_CONDITIONS, MAX_MONITORS, MAX_PROBES, OverLimit, Selection, Ungated, select,
    select_with_last_good,
};
pub use selector::Selector;
pub use trust::{NodeTrust, Refusal};
pub use validate::validate;
pub use validate::{Validations, validate_shutdown, validate_watchdog};

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
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "!has(self.nodeSelector) || !has(self.nodeSelector.matchExpressions) || self.nodeSelector.matchExpressions.all(e, e.operator in ['In', 'NotIn', 'Exists', 'DoesNotExist'])",
        "message": "nodeSelector.matchExpressions[].operator must be In, NotIn, Exists or DoesNotExist",
        "fieldPath": ".nodeSelector"
    }
]))]
pub struct NodeGuardPolicySpec {
    /// Nodes this policy applies to, matched against the Node's labels.
    /// An absent or empty selector selects every node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<LabelSelector>,

    /// How `/healthz` judges whether the node should keep receiving traffic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub healthz: Option<HealthzSpec>,

    /// Petting the host watchdog (systemd `WatchdogSec=` and/or a watchdog
    /// device). Off unless set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub watchdog: Option<WatchdogSpec>,

    /// Graceful node shutdown through systemd-logind. Off unless set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shutdown: Option<ShutdownSpec>,

    /// Probes of node-local endpoints (NodeConditions) and of pods on the
    /// node (readiness-gate conditions). Policies that select a node add
    /// up; a probe name may appear in only one of them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 256))]
    pub probes: Vec<probes::ProbeSpec>,

    /// Log monitors (node-problem-detector's shape): rules over the kernel
    /// log or files that set NodeConditions (which clear), emit Events and
    /// may taint the node. Policies that select a node add up; a monitor
    /// name may appear in only one of them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub monitors: Vec<monitors::MonitorSpec>,
}

/// One priority group of `spec.shutdown.gracePeriodByPriority`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PriorityGracePeriod {
    /// Pods with at least this priority (and below the next group's) are
    /// in this group.
    pub priority: i32,
    /// How long the group's pods get to terminate.
    #[schemars(range(min = 1, max = 3600))]
    pub grace_period_seconds: u32,
}

/// What to do with a pod whose eviction a PodDisruptionBudget keeps refusing.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum Escalation {
    /// Delete it with the rest of the group's window as its grace, so the
    /// node still shuts down in time (an Event names the PDB).
    #[default]
    Delete,
    /// Leave it running; the node shuts down with it.
    None,
}

/// `spec.shutdown`: on PrepareForShutdown, taint the node and terminate its
/// pods by priority group (lowest first) through the Eviction API.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "!(has(self.gracePeriodByPriority) && size(self.gracePeriodByPriority) > 0 && (has(self.gracePeriodSeconds) || has(self.criticalPodsGracePeriodSeconds)))",
        "message": "set either gracePeriodByPriority or gracePeriodSeconds/criticalPodsGracePeriodSeconds, not both"
    },
    {
        "rule": "(has(self.gracePeriodByPriority) && size(self.gracePeriodByPriority) > 0) || has(self.gracePeriodSeconds)",
        "message": "no grace periods: set gracePeriodByPriority, or gracePeriodSeconds (with criticalPodsGracePeriodSeconds)"
    }
]))]
pub struct ShutdownSpec {
    /// Priority groups, like the kubelet's shutdownGracePeriodByPodPriority.
    /// Their periods add up to the inhibit delay nodeguard asks logind for.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub grace_period_by_priority: Vec<PriorityGracePeriod>,
    /// The kubelet's simple form: the total (shutdownGracePeriod) …
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 3600))]
    pub grace_period_seconds: Option<u32>,
    /// … of which critical pods get this much (shutdownGracePeriodCriticalPods).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = 3600))]
    pub critical_pods_grace_period_seconds: Option<u32>,
    /// Delete (default) or None.
    #[serde(default)]
    pub escalation: Escalation,
    /// Escalate a blocked eviction after this percentage of its group's window.
    #[serde(default = "default_escalate_percent")]
    #[schemars(range(min = 10, max = 100))]
    pub escalate_after_percent: u8,
    /// Release the inhibitor this long before logind's maximum delay runs out.
    #[serde(default = "default_safety_margin")]
    #[schemars(range(max = 60))]
    pub safety_margin_seconds: u32,
    /// Also terminate DaemonSet pods.
    #[serde(default)]
    pub evict_daemon_set_pods: bool,
    /// Also delete mirror (static) pods.
    #[serde(default)]
    pub evict_mirror_pods: bool,
    /// Also terminate pods that tolerate the shutdown taint.
    #[serde(default)]
    pub evict_tolerating_pods: bool,
    /// Where to write the logind drop-in that raises InhibitDelayMaxSec when
    /// it is too short (a host mount in the DaemonSet). Empty: never write.
    #[serde(default = "default_drop_in_dir")]
    pub logind_drop_in_dir: String,
}

fn default_escalate_percent() -> u8 {
    50
}
fn default_safety_margin() -> u32 {
    2
}
fn default_drop_in_dir() -> String {
    "/etc/systemd/logind.conf.d".into()
}

impl ShutdownSpec {
    /// The inhibit delay this section asks logind for: its priority groups'
    /// windows (or `gracePeriodSeconds`, which includes the critical pods'
    /// share) plus the safety margin.
    pub fn inhibit_delay_seconds(&self) -> u32 {
        let windows: u32 = if self.grace_period_by_priority.is_empty() {
            self.grace_period_seconds.unwrap_or(0)
        } else {
            self.grace_period_by_priority
                .iter()
                .map(|g| g.grace_period_seconds)
                .sum()
        };
        windows.saturating_add(self.safety_margin_seconds)
    }
}

impl Default for ShutdownSpec {
    fn default() -> Self {
        ShutdownSpec {
            grace_period_by_priority: Vec::new(),
            grace_period_seconds: None,
            critical_pods_grace_period_seconds: None,
            escalation: Escalation::Delete,
            escalate_after_percent: default_escalate_percent(),
            safety_margin_seconds: default_safety_margin(),
            evict_daemon_set_pods: false,
            evict_mirror_pods: false,
            evict_tolerating_pods: false,
            logind_drop_in_dir: default_drop_in_dir(),
        }
    }
}

/// Which watchdogs nodeguard pets.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum WatchdogMode {
    /// Pet no device. (In host mode, systemd's watchdog is still served
    /// when the unit sets `WatchdogSec=`, or systemd would restart nodeguard.)
    #[default]
    Off,
    /// Require the systemd service watchdog (`WatchdogSec=` in the unit).
    Systemd,
    /// Pet the watchdog device.
    Device,
    /// Both.
    Both,
}

impl WatchdogMode {
    pub fn device(self) -> bool {
        matches!(self, WatchdogMode::Device | WatchdogMode::Both)
    }
    pub fn systemd(self) -> bool {
        matches!(self, WatchdogMode::Systemd | WatchdogMode::Both)
    }
}

/// `spec.watchdog`: pet only while the agent is really healthy.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WatchdogSpec {
    /// Off, Systemd, Device or Both.
    #[serde(default)]
    pub mode: WatchdogMode,
    /// Watchdog device to pet (the DaemonSet must mount it).
    #[serde(default = "default_watchdog_device")]
    pub device: String,
    /// Device timeout set with WDIOC_SETTIMEOUT: the host resets this long
    /// after the last pet.
    #[serde(default = "default_watchdog_timeout")]
    #[schemars(range(min = 2, max = 3600))]
    pub timeout_seconds: u32,
    /// Pet the device every this percentage of its timeout.
    #[serde(default = "default_pet_percent")]
    #[schemars(range(min = 10, max = 50))]
    pub pet_interval_percent: u8,
    /// Also require that the API server answered `/livez?exclude=etcd`
    /// (within 5 s; asked one pet interval after the last answer, 1 s
    /// after a failed one and doubling, beside the pets, which never wait
    /// for it; an answer counts for one interval plus 5 s) before
    /// petting: it fences a node cut off from the API server,
    /// and does not judge the control plane's health (etcd is left out, so
    /// a node reaching only an API server without etcd quorum is not
    /// fenced).
    /// A 2xx, 401, 403, 429, or the API server's own 500 "livez check
    /// failed" is an answer; any other 5xx, a redirect or 404 is not. Off by
    /// default: an API outage must never reset a fleet.
    #[serde(default)]
    pub require_api_server: bool,
    /// On a clean stop, write the magic close character so the device is
    /// disarmed (a rollout or `kubectl delete pod` does not reset the node).
    /// Set false for fencing: any stop of nodeguard then resets the node.
    #[serde(default = "default_true")]
    pub magic_close: bool,
}

fn default_watchdog_device() -> String {
    "/dev/watchdog".into()
}
fn default_watchdog_timeout() -> u32 {
    60
}
fn default_pet_percent() -> u8 {
    33
}
fn default_true() -> bool {
    true
}

impl Default for WatchdogSpec {
    fn default() -> Self {
        WatchdogSpec {
            mode: WatchdogMode::Off,
            device: default_watchdog_device(),
            timeout_seconds: default_watchdog_timeout(),
            pet_interval_percent: default_pet_percent(),
            require_api_server: false,
            magic_close: true,
        }
    }
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

/// The annotation the generated CRD carries: the SHA-256 of its `spec` as
/// JSON, in hex. Helm installs a chart's `crds/` on the first install only,
/// so the chart compares this with the cluster's CRD and stops an install or
/// upgrade whose CRD differs (the API server would drop the fields it does
/// not know from policies written without strict field validation).
pub const SCHEMA_ANNOTATION: &str = "nodeguard.io/schema-sha256";

/// The annotation with the release whose CRD this is (the crate's version,
/// which is the chart's): a CRD of a newer release than the chart's passes
/// the chart's check (a downgrade, a canary release of a newer chart).
pub const VERSION_ANNOTATION: &str = "nodeguard.io/version";

impl NodeGuardPolicy {
    /// The CRD as YAML, exactly as committed under `crds/`, stamped with
    /// [`SCHEMA_ANNOTATION`] and [`VERSION_ANNOTATION`].
    pub fn crd_yaml() -> String {
        use ::kube::CustomResourceExt;
        let mut crd = Self::crd();
        let digest = schema_digest(&crd.spec);
        let annotations = crd.metadata.annotations.get_or_insert_default();
        annotations.insert(SCHEMA_ANNOTATION.to_string(), digest);
        annotations.insert(
            VERSION_ANNOTATION.to_string(),
            env!("CARGO_PKG_VERSION").to_string(),
        );
        serde_saphyr::to_string(&crd).expect("a CRD always serializes to YAML")
    }
}

/// The value of [`SCHEMA_ANNOTATION`] for a CRD with `spec`: SHA-256 of the
/// spec as JSON, in lowercase hex.
pub fn schema_digest(
    spec: &k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinitionSpec,
) -> String {
    let json = serde_json::to_vec(spec).expect("a CRD spec always serializes to JSON");
    let digest = ring::digest::digest(&ring::digest::SHA256, &json);
    digest.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}
