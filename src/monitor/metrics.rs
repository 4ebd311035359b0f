//! The monitors' metrics: nodeguard's own problem counters and active
//! conditions, node-problem-detector's `problem_counter` and
//! `problem_gauge`, and the sources' counters.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::engine::Engine;
use super::npd_metrics;
use super::sources::SourceCounters;
use crate::policy::monitors::MonitorSpec;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ReasonLabels {
    pub(super) reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ActiveLabels {
    r#type: String,
    pub(super) reason: String,
}

/// NPD-style problem metrics plus the sources' counters.
#[derive(Clone, Debug, Default)]
pub struct MonitorMetrics {
    pub(super) problems: Family<ReasonLabels, Counter>,
    pub(super) active: Family<ActiveLabels, Gauge>,
    pub(super) active_reason: Arc<std::sync::Mutex<HashMap<String, String>>>,
    pub(super) sources: Arc<std::sync::Mutex<BTreeMap<String, Arc<SourceCounters>>>>,
    /// node-problem-detector's names and semantics, beside ours.
    pub(super) npd: Arc<std::sync::Mutex<npd_metrics::NpdProblems>>,
}

impl MonitorMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = MonitorMetrics::default();
        registry.register(
            "nodeguard_problem",
            "Problems detected, by reason (Events and condition activations)",
            m.problems.clone(),
        );
        registry.register(
            "nodeguard_problem_active",
            "1 while a condition is True with this reason; the previous reason of a type is cleared",
            m.active.clone(),
        );
        registry.register_collector(Box::new(SourceCollector(m.sources.clone())));
        registry.register_collector(Box::new(NpdCollector(m.npd.clone())));
        m
    }

    /// A monitor's start: each rule's reason at 0, in ours as in NPD's, so
    /// a first problem is an increase (a series born at 1 shows none); and
    /// what NPD runs as a custom plugin monitor (a plugin source here;
    /// counting rules, NPD's log-counter, imported or in the default
    /// policy) shows its conditions' no-problem reason from the first run.
    pub(super) fn declare(&self, spec: &MonitorSpec, engine: &Engine) {
        for (reason, _) in engine.rule_reasons() {
            let _ = self.problems.get_or_create(&ReasonLabels {
                reason: reason.to_string(),
            });
        }
        let mut npd = self.npd();
        npd.declare(engine.rule_reasons());
        for c in &spec.conditions {
            let counted = spec
                .rules
                .iter()
                .any(|r| r.condition.as_deref() == Some(c.type_.as_str()) && r.count.is_some());
            if spec.source.plugin.is_some() || counted {
                npd.declare_no_problem(&c.type_, &c.reason);
            }
        }
    }

    pub(super) fn npd(&self) -> std::sync::MutexGuard<'_, npd_metrics::NpdProblems> {
        self.npd.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn problem(&self, reason: &str) {
        self.npd().problem(reason);
        self.problems
            .get_or_create(&ReasonLabels {
                reason: reason.to_string(),
            })
            .inc();
    }

    pub(super) fn set_active(&self, type_: &str, reason: &str, active: bool) {
        self.npd().condition(type_, reason, active);
        let mut last = self.active_reason.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(prev) = last.insert(type_.to_string(), reason.to_string())
            && prev != reason
        {
            self.active.remove(&ActiveLabels {
                r#type: type_.into(),
                reason: prev,
            });
        }
        self.active
            .get_or_create(&ActiveLabels {
                r#type: type_.into(),
                reason: reason.into(),
            })
            .set(i64::from(active));
    }

    pub(super) fn forget(&self, type_: &str) {
        self.npd().forget(type_);
        let mut last = self.active_reason.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(prev) = last.remove(type_) {
            self.active.remove(&ActiveLabels {
                r#type: type_.into(),
                reason: prev,
            });
        }
    }
}

/// node-problem-detector's `problem_counter` and `problem_gauge`, as its
/// Prometheus exporter names them: no `_total` (OpenMetrics would add it to
/// a counter, so the counter is typed `unknown`, as an exporter's untyped
/// samples are).
#[derive(Debug)]
pub(super) struct NpdCollector(Arc<std::sync::Mutex<npd_metrics::NpdProblems>>);

impl Collector for NpdCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let npd = self.0.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut e = encoder.encode_descriptor(
            "problem_counter",
            "Number of times a specific type of problem have occurred (node-problem-detector's metric).",
            None,
            prometheus_client::metrics::MetricType::Unknown,
        )?;
        for (reason, v) in npd.counters() {
            e.encode_family(&[("reason", reason)])?
                .encode_gauge(&(v as i64))?;
        }
        let mut e = encoder.encode_descriptor(
            "problem_gauge",
            "Whether a specific type of problem is affecting the node or not (node-problem-detector's metric).",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for (type_, reason, v) in npd.gauges() {
            e.encode_family(&[("reason", reason), ("type", type_)])?
                .encode_gauge(&v)?;
        }
        Ok(())
    }
}

#[derive(Debug)]
pub(super) struct SourceCollector(Arc<std::sync::Mutex<BTreeMap<String, Arc<SourceCounters>>>>);

impl Collector for SourceCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let sources = self.0.lock().unwrap_or_else(|e| e.into_inner()).clone();
        for (name, help, pick) in [
            (
                "nodeguard_monitor_lines",
                "Log lines read, by monitor",
                (|c: &SourceCounters| c.lines.load(Ordering::Relaxed))
                    as fn(&SourceCounters) -> u64,
            ),
            (
                "nodeguard_monitor_lines_dropped",
                "Log lines dropped because the monitor's queue was full (floods) or the kernel overwrote them",
                |c: &SourceCounters| c.dropped.load(Ordering::Relaxed),
            ),
            (
                "nodeguard_monitor_lines_malformed",
                "Log records that could not be parsed",
                |c: &SourceCounters| c.malformed.load(Ordering::Relaxed),
            ),
            (
                "nodeguard_monitor_lines_truncated",
                "Log lines over 64 KiB (files) and journal entries over 256 KiB as JSON, matched on their first part; the rest is read past, not held",
                |c: &SourceCounters| c.truncated.load(Ordering::Relaxed),
            ),
        ] {
            let sample = ConstCounter::new(0u64);
            let mut e = encoder.encode_descriptor(name, help, None, sample.metric_type())?;
            for (monitor, c) in &sources {
                ConstCounter::new(pick(c))
                    .encode(e.encode_family(&[("monitor", monitor.as_str())])?)?;
            }
        }
        Ok(())
    }
}
