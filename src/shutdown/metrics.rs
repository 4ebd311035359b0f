//! `nodeguard_shutdown_*` metrics.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::ShutdownConfig;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct PodLabels {
    group: i32,
    outcome: String,
}

type FloatGauge = Gauge<f64, std::sync::atomic::AtomicU64>;

/// `nodeguard_shutdown_*` metrics.
#[derive(Clone, Debug, Default)]
pub struct ShutdownMetrics {
    pub(super) start_time: FloatGauge,
    pub(super) end_time: FloatGauge,
    pub(super) last_duration: FloatGauge,
    pub(super) pods: Family<PodLabels, Counter>,
    pub(super) inhibitor_held: Gauge,
    pub(super) inhibit_delay_max: FloatGauge,
    pub(super) inhibit_delay_needed: FloatGauge,
}

impl ShutdownMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = ShutdownMetrics::default();
        registry.register(
            "nodeguard_shutdown_start_time_seconds",
            "Unix time the last graceful shutdown started, or was found under way when its start was not recorded (0: none in this process)",
            m.start_time.clone(),
        );
        registry.register(
            "nodeguard_shutdown_end_time_seconds",
            "Unix time the last graceful shutdown released the inhibitor",
            m.end_time.clone(),
        );
        registry.register(
            "nodeguard_shutdown_last_duration_seconds",
            "How long the last graceful shutdown took, as recorded before the reboot",
            m.last_duration.clone(),
        );
        registry.register(
            "nodeguard_shutdown_pods",
            "Pods handled during shutdown, by priority group and outcome (evicted, escalated, blocked, failed, skipped, already_terminating)",
            m.pods.clone(),
        );
        registry.register(
            "nodeguard_shutdown_inhibitor_held",
            "1 while nodeguard holds its logind delay inhibitor",
            m.inhibitor_held.clone(),
        );
        registry.register(
            "nodeguard_shutdown_inhibit_delay_max_seconds",
            "logind's InhibitDelayMaxUSec as last read",
            m.inhibit_delay_max.clone(),
        );
        registry.register(
            "nodeguard_shutdown_inhibit_delay_needed_seconds",
            "The inhibit delay the shutdown policy in force needs from logind (0: graceful shutdown off)",
            m.inhibit_delay_needed.clone(),
        );
        m
    }

    /// Each group's `evicted` and `escalated` series at 0 while the plan is
    /// armed, so a shutdown's first pods are an increase on a dashboard (a
    /// series born at 1 shows none); the rarer outcomes appear when they
    /// happen, which keeps a fleet's series few.
    pub(super) fn declare_groups(&self, cfg: &ShutdownConfig) {
        for g in &cfg.groups {
            for outcome in ["evicted", "escalated"] {
                let _ = self.pods.get_or_create(&PodLabels {
                    group: g.priority,
                    outcome: outcome.into(),
                });
            }
        }
    }

    pub(super) fn pod(&self, group: i32, outcome: &str) {
        self.pods
            .get_or_create(&PodLabels {
                group,
                outcome: outcome.into(),
            })
            .inc();
    }
}

pub(super) fn unix_seconds(t: jiff::Timestamp) -> f64 {
    t.as_millisecond() as f64 / 1000.0
}
