//! node-problem-detector's problem metrics, `problem_counter{reason}` and
//! `problem_gauge{type,reason}`, with NPD's semantics (its
//! `pkg/problemmetrics` and the monitors that feed it), so that alerts and
//! dashboards written for NPD keep working after the switch:
//!
//! - a monitor's start declares each rule: its reason's counter at 0 and,
//!   for a permanent rule, its condition's gauge at 0 for that reason;
//! - a problem found (an Event of a temporary rule, or a condition turning
//!   True) adds one to its reason's counter;
//! - a condition's gauge has at most one reason at 1: setting a reason
//!   first sets the type's previous reason to 0, which stays as a series
//!   (NPD never removes one);
//! - a condition that clears sets its reason (the no-problem reason) to 0.
//!
//! Pure: the monitor adapter feeds it; the collector in `mod.rs` encodes it.

use std::collections::BTreeMap;

/// The two families' values.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NpdProblems {
    /// `problem_counter` by reason.
    counter: BTreeMap<String, u64>,
    /// `problem_gauge` by (type, reason).
    gauge: BTreeMap<(String, String), i64>,
    /// The reason each type's gauge was last set for.
    last: BTreeMap<String, String>,
}

impl NpdProblems {
    /// A monitor's rules at its start: `(reason, condition type of a
    /// permanent rule)`.
    pub fn declare<'a>(&mut self, rules: impl IntoIterator<Item = (&'a str, Option<&'a str>)>) {
        for (reason, condition) in rules {
            // A series at 0; a gauge already set (a monitor restarted with
            // its state) is left as it is.
            if let Some(type_) = condition {
                self.gauge
                    .entry((type_.to_string(), reason.to_string()))
                    .or_insert(0);
                self.last
                    .entry(type_.to_string())
                    .or_insert_with(|| reason.to_string());
            }
            self.counter.entry(reason.to_string()).or_insert(0);
        }
    }

    /// What NPD's custom plugin monitors do at their first run, and every
    /// run after: each condition's gauge set for its reason, the
    /// no-problem one too (a series at 0). For a condition not active.
    pub fn declare_no_problem(&mut self, type_: &str, reason: &str) {
        if !self.active(type_) {
            self.set(type_, reason, false);
        }
    }

    /// A problem found: an Event of a temporary rule or a condition's turn
    /// to True.
    pub fn problem(&mut self, reason: &str) {
        *self.counter.entry(reason.to_string()).or_insert(0) += 1;
    }

    /// A condition's state. True sets its reason to 1 (and the type's
    /// previous reason to 0). False changes the gauge only when the type
    /// has a reason at 1: a no-problem state at the start, or one
    /// repeated, is not a change NPD records.
    pub fn condition(&mut self, type_: &str, reason: &str, active: bool) {
        if active || self.active(type_) {
            self.set(type_, reason, active);
        }
    }

    /// A monitor removed with its conditions: their series go (NPD has no
    /// such change; an alert on a condition nothing reports any more
    /// should not hold on to it).
    pub fn forget(&mut self, type_: &str) {
        self.gauge.retain(|(t, _), _| t != type_);
        self.last.remove(type_);
    }

    fn active(&self, type_: &str) -> bool {
        self.last
            .get(type_)
            .is_some_and(|reason| self.gauge.get(&(type_.to_string(), reason.clone())) == Some(&1))
    }

    fn set(&mut self, type_: &str, reason: &str, active: bool) {
        if let Some(previous) = self.last.insert(type_.to_string(), reason.to_string()) {
            self.gauge.insert((type_.to_string(), previous), 0);
        }
        self.gauge
            .insert((type_.to_string(), reason.to_string()), i64::from(active));
    }

    /// `problem_counter` series, by reason.
    pub fn counters(&self) -> impl Iterator<Item = (&str, u64)> {
        self.counter.iter().map(|(r, v)| (r.as_str(), *v))
    }

    /// `problem_gauge` series, by (type, reason).
    pub fn gauges(&self) -> impl Iterator<Item = (&str, &str, i64)> {
        self.gauge
            .iter()
            .map(|((t, r), v)| (t.as_str(), r.as_str(), *v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gauges(p: &NpdProblems) -> Vec<(String, String, i64)> {
        p.gauges()
            .map(|(t, r, v)| (t.to_string(), r.to_string(), v))
            .collect()
    }

    fn counters(p: &NpdProblems) -> Vec<(String, u64)> {
        p.counters().map(|(r, v)| (r.to_string(), v)).collect()
    }

    fn g(t: &str, r: &str, v: i64) -> (String, String, i64) {
        (t.into(), r.into(), v)
    }

    /// NPD's kernel-monitor.json in short: two temporary rules, two
    /// permanent ones on one condition.
    fn kernel() -> NpdProblems {
        let mut p = NpdProblems::default();
        p.declare([
            ("OOMKilling", None),
            ("TaskHung", None),
            ("DockerHung", Some("KernelDeadlock")),
            ("AUFSUmountHung", Some("KernelDeadlock")),
        ]);
        p
    }

    #[test]
    fn the_start_declares_every_reason_at_zero() {
        let p = kernel();
        assert_eq!(
            counters(&p),
            [
                ("AUFSUmountHung".to_string(), 0),
                ("DockerHung".to_string(), 0),
                ("OOMKilling".to_string(), 0),
                ("TaskHung".to_string(), 0),
            ]
        );
        // No series for the no-problem reason, none for temporary rules.
        assert_eq!(
            gauges(&p),
            [
                g("KernelDeadlock", "AUFSUmountHung", 0),
                g("KernelDeadlock", "DockerHung", 0)
            ]
        );
    }

    #[test]
    fn the_no_problem_state_at_the_start_changes_nothing() {
        let mut p = kernel();
        let before = p.clone();
        p.condition("KernelDeadlock", "KernelHasNoDeadlock", false);
        p.condition("KernelDeadlock", "KernelHasNoDeadlock", false);
        assert_eq!(p, before);
    }

    #[test]
    fn one_reason_at_one_per_type_and_the_previous_kept_at_zero() {
        let mut p = kernel();
        p.problem("DockerHung");
        p.condition("KernelDeadlock", "DockerHung", true);
        assert_eq!(
            gauges(&p),
            [
                g("KernelDeadlock", "AUFSUmountHung", 0),
                g("KernelDeadlock", "DockerHung", 1)
            ]
        );
        // The same again (NPD sets it at every match): no change.
        p.condition("KernelDeadlock", "DockerHung", true);
        p.condition("KernelDeadlock", "AUFSUmountHung", true);
        assert_eq!(
            gauges(&p),
            [
                g("KernelDeadlock", "AUFSUmountHung", 1),
                g("KernelDeadlock", "DockerHung", 0)
            ]
        );
    }

    #[test]
    fn a_clear_sets_the_no_problem_reason_to_zero() {
        let mut p = kernel();
        p.condition("KernelDeadlock", "DockerHung", true);
        p.condition("KernelDeadlock", "KernelHasNoDeadlock", false);
        assert_eq!(
            gauges(&p),
            [
                g("KernelDeadlock", "AUFSUmountHung", 0),
                g("KernelDeadlock", "DockerHung", 0),
                g("KernelDeadlock", "KernelHasNoDeadlock", 0)
            ]
        );
        // Cleared already: a repeat changes nothing.
        let before = p.clone();
        p.condition("KernelDeadlock", "KernelHasNoDeadlock", false);
        assert_eq!(p, before);
    }

    /// NPD's systemd-monitor-counter.json: a custom plugin monitor (its
    /// log-counter) sets the no-problem reason at its first run.
    #[test]
    fn a_plugin_monitor_shows_its_no_problem_reason() {
        let mut p = NpdProblems::default();
        p.declare([("FrequentKubeletRestart", Some("FrequentKubeletRestart"))]);
        p.declare_no_problem("FrequentKubeletRestart", "NoFrequentKubeletRestart");
        let t = "FrequentKubeletRestart";
        assert_eq!(
            gauges(&p),
            [
                g(t, "FrequentKubeletRestart", 0),
                g(t, "NoFrequentKubeletRestart", 0)
            ]
        );
        p.condition(t, "FrequentKubeletRestart", true);
        assert_eq!(
            gauges(&p),
            [
                g(t, "FrequentKubeletRestart", 1),
                g(t, "NoFrequentKubeletRestart", 0)
            ]
        );
        // Started again while the problem holds: it stays at 1.
        p.declare_no_problem(t, "NoFrequentKubeletRestart");
        assert_eq!(gauges(&p)[0], g(t, "FrequentKubeletRestart", 1));
    }

    #[test]
    fn problems_count_up_by_reason() {
        let mut p = kernel();
        for _ in 0..3 {
            p.problem("OOMKilling");
        }
        p.problem("Unheard");
        assert_eq!(
            counters(&p),
            [
                ("AUFSUmountHung".to_string(), 0),
                ("DockerHung".to_string(), 0),
                ("OOMKilling".to_string(), 3),
                ("TaskHung".to_string(), 0),
                ("Unheard".to_string(), 1),
            ]
        );
    }

    #[test]
    fn a_monitor_started_again_keeps_its_counts() {
        let mut p = kernel();
        p.problem("OOMKilling");
        p.condition("KernelDeadlock", "DockerHung", true);
        p.declare([("OOMKilling", None), ("DockerHung", Some("KernelDeadlock"))]);
        assert_eq!(counters(&p)[2], ("OOMKilling".to_string(), 1));
        assert!(gauges(&p).contains(&g("KernelDeadlock", "DockerHung", 1)));
    }

    #[test]
    fn a_removed_monitors_conditions_go() {
        let mut p = kernel();
        p.declare([("ReadonlyFilesystem", Some("ReadonlyFilesystem"))]);
        p.condition("KernelDeadlock", "DockerHung", true);
        p.forget("KernelDeadlock");
        assert_eq!(
            gauges(&p),
            [g("ReadonlyFilesystem", "ReadonlyFilesystem", 0)]
        );
        // Counters stay: a counter never goes back.
        assert_eq!(counters(&p).len(), 5);
    }
}
