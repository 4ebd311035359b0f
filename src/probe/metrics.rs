//! The probes' metrics.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use super::prober::{Outcome, ProberError};
use super::targets::WorkerKey;

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
    pub(super) workers: Gauge,
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

    pub(super) fn panicked(&self, probe: &str) {
        self.panics
            .get_or_create(&ProbeLabels {
                probe: probe.to_string(),
            })
            .inc();
    }

    pub(super) fn observe(
        &self,
        key: &WorkerKey,
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
    pub(super) fn started(&self, key: &WorkerKey) {
        for result in ["success", "failure"] {
            let _ = self.total.get_or_create(&ResultLabels {
                probe: key.0.clone(),
                target: key.1.clone(),
                result: result.into(),
            });
        }
    }

    /// Drops a stopped worker's series (pods come and go).
    pub(super) fn forget(&self, key: &WorkerKey) {
        for result in ["success", "failure", "unknown", "error"] {
            self.total.remove(&ResultLabels {
                probe: key.0.clone(),
                target: key.1.clone(),
                result: result.into(),
            });
        }
    }
}
