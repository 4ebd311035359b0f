//! Probe workers with the kubelet prober's semantics, against node-local
//! endpoints (results as NodeConditions) and pods on this node (results as
//! readiness-gate pod conditions).
//!
//! [`core`] is the per-worker decision core, [`prober`] the HTTP/TCP/gRPC/
//! exec clients, [`manager`] the reconciler that keeps one task per
//! (probe, target), and [`KubePodConditions`] the pods/status adapter.

pub mod core;
pub mod manager;
pub mod prober;

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

pub use manager::{PodConditionPort, ProbeHandle, run_probe_manager};
use prober::{Outcome, ProberError};

#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("API request failed: {0}")]
    Api(#[from] kube::Error),
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    probe: String,
    target: String,
    result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProbeLabels {
    probe: String,
}

/// `nodeguard_probe_total{probe,target,result}`,
/// `nodeguard_probe_duration_seconds{probe}` and
/// `nodeguard_probe_worker_panics_total{probe}` and
/// `nodeguard_probe_workers`.
#[derive(Clone, Debug)]
pub struct ProbeMetrics {
    total: Family<ResultLabels, Counter>,
    duration: Family<ProbeLabels, Histogram>,
    panics: Family<ProbeLabels, Counter>,
    workers: Gauge,
}

impl ProbeMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = ProbeMetrics {
            total: Family::default(),
            duration: Family::new_with_constructor(|| {
                Histogram::new([
                    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                ])
            }),
            panics: Family::default(),
            workers: Gauge::default(),
        };
        registry.register(
            "nodeguard_probe",
            "Probes run, by probe, target and result (success, failure, unknown, error)",
            m.total.clone(),
        );
        registry.register(
            "nodeguard_probe_duration_seconds",
            "How long probes took, by probe",
            m.duration.clone(),
        );
        registry.register(
            "nodeguard_probe_workers",
            "Probe workers running: one per probe and target",
            m.workers.clone(),
        );
        registry.register(
            "nodeguard_probe_worker_panics",
            "Probe workers that panicked (each is restarted), by probe",
            m.panics.clone(),
        );
        m
    }

    fn panicked(&self, probe: &str) {
        self.panics
            .get_or_create(&ProbeLabels {
                probe: probe.to_string(),
            })
            .inc();
    }

    fn observe(
        &self,
        key: &manager::WorkerKey,
        outcome: &Result<Outcome, ProberError>,
        took: Duration,
    ) {
        let result = match outcome {
            Ok(o) => o.result.as_str(),
            Err(_) => "error",
        };
        self.total
            .get_or_create(&ResultLabels {
                probe: key.0.clone(),
                target: key.1.clone(),
                result: result.into(),
            })
            .inc();
        self.duration
            .get_or_create(&ProbeLabels {
                probe: key.0.clone(),
            })
            .observe(took.as_secs_f64());
    }

    /// A worker's success and failure series at 0 from its start, so the
    /// first failure is an increase (`increase()` cannot see a series whose
    /// first sample is already 1).
    fn started(&self, key: &manager::WorkerKey) {
        for result in ["success", "failure"] {
            let _ = self.total.get_or_create(&ResultLabels {
                probe: key.0.clone(),
                target: key.1.clone(),
                result: result.into(),
            });
        }
    }

    /// Drops a stopped worker's series (pods come and go).
    fn forget(&self, key: &manager::WorkerKey) {
        for result in ["success", "failure", "unknown", "error"] {
            self.total.remove(&ResultLabels {
                probe: key.0.clone(),
                target: key.1.clone(),
                result: result.into(),
            });
        }
    }
}

/// Writes readiness-gate conditions with server-side apply on
/// `pods/status`, one field manager per condition type, so each gate is
/// owned separately and the kubelet's conditions are never touched. With a
/// UID ([`PodConditionPort::set_on`]) the apply carries it, and the API
/// server refuses it (422 Invalid: `metadata.uid` is immutable) when the
/// pod under that name is another one.
#[derive(Clone)]
pub struct KubePodConditions {
    client: Client,
}

impl KubePodConditions {
    pub fn new(client: Client) -> Self {
        KubePodConditions { client }
    }
}

/// The field manager for a readiness gate.
pub fn gate_manager(condition: &str) -> String {
    let mut m = format!("nodeguard-gate-{condition}");
    m.truncate(128);
    m
}

impl PodConditionPort for KubePodConditions {
    async fn set(
        &self,
        pod: &str,
        condition: &str,
        passing: bool,
        message: &str,
    ) -> Result<(), ProbeError> {
        self.set_on(pod, None, condition, passing, message).await
    }

    async fn set_on(
        &self,
        pod: &str,
        uid: Option<&str>,
        condition: &str,
        passing: bool,
        message: &str,
    ) -> Result<(), ProbeError> {
        let (ns, name) = pod.split_once('/').unwrap_or(("default", pod));
        let api: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::now());
        let mut metadata = serde_json::json!({"name": name, "namespace": ns});
        if let Some(uid) = uid {
            metadata["uid"] = uid.into();
        }
        let body = serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": metadata,
            "status": {"conditions": [{
                "type": condition,
                "status": if passing { "True" } else { "False" },
                "reason": if passing { "ProbePassed" } else { "ProbeFailed" },
                "message": message,
                "lastTransitionTime": now,
            }]},
        });
        api.patch_status(
            name,
            &PatchParams::apply(&gate_manager(condition)).force(),
            &Patch::Apply(&body),
        )
        .await?;
        Ok(())
    }
}
