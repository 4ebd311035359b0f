//! Which policies apply to a node, and what they add up to.

use std::collections::BTreeMap;

use super::{NodeGuardPolicy, Problem, Selector, validate};

/// The outcome of selecting policies for one node's labels.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Selection {
    /// Valid policies whose selector matches, by name.
    pub applied: Vec<String>,
    /// Invalid policies that match the node, or whose selector cannot be
    /// read (they might), with their problems. They are not applied.
    pub invalid: Vec<(String, Vec<Problem>)>,
    /// Taint keys that make the node ineligible, besides the autoscaler's.
    pub ineligible_taints: Vec<String>,
    /// Probes of all applied policies; a name taken by an earlier policy
    /// (by name) is a conflict and the later probe is ignored.
    pub probes: Vec<super::probes::ProbeSpec>,
    /// Monitors of all applied policies; a name taken by an earlier policy
    /// is a conflict and the later monitor is ignored.
    pub monitors: Vec<super::monitors::MonitorSpec>,
    /// The shutdown section in force: first applied policy by name.
    pub shutdown: Option<super::ShutdownSpec>,
    /// The watchdog section in force: from the first applied policy (by
    /// name) that has one. Others that differ are listed in `conflicts`.
    pub watchdog: Option<super::WatchdogSpec>,
    /// Sections set differently by several applied policies: (section,
    /// policy whose value is used, policies ignored for it).
    pub conflicts: Vec<(String, String, Vec<String>)>,
}

/// A section that cannot be merged: the first policy (by name) that sets
/// it wins; policies that set it differently are recorded as a conflict.
struct FirstWins<T> {
    value: Option<T>,
    from: String,
    ignored: Vec<String>,
}

impl<T> Default for FirstWins<T> {
    fn default() -> Self {
        FirstWins {
            value: None,
            from: String::new(),
            ignored: Vec::new(),
        }
    }
}

impl<T: Clone + PartialEq> FirstWins<T> {
    fn offer(&mut self, policy: &str, value: Option<&T>) {
        let Some(v) = value else { return };
        match &self.value {
            None => {
                self.value = Some(v.clone());
                self.from = policy.to_string();
            }
            Some(used) if used != v => self.ignored.push(policy.to_string()),
            Some(_) => {}
        }
    }

    fn finish(
        self,
        section: &str,
        conflicts: &mut Vec<(String, String, Vec<String>)>,
    ) -> Option<T> {
        if !self.ignored.is_empty() {
            conflicts.push((section.to_string(), self.from, self.ignored));
        }
        self.value
    }
}

/// Selects the policies for a node with `labels`. Applied policies combine
/// by union (sorted, without duplicates); issue-specific sections add their
/// own merge rules.
pub fn select<'a>(
    policies: impl IntoIterator<Item = &'a NodeGuardPolicy>,
    labels: &BTreeMap<String, String>,
) -> Selection {
    let mut out = Selection::default();
    let mut watchdog = FirstWins::default();
    let mut shutdown = FirstWins::default();
    let mut probe_from: BTreeMap<String, String> = BTreeMap::new();
    let mut monitor_from: BTreeMap<String, String> = BTreeMap::new();
    let mut policies: Vec<&NodeGuardPolicy> = policies.into_iter().collect();
    policies.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    for p in policies {
        let name = p.metadata.name.clone().unwrap_or_default();
        let mut sel_problems = Vec::new();
        let matches = match &p.spec.node_selector {
            None => Some(true),
            Some(s) => Selector::parse(s, "spec.nodeSelector", &mut sel_problems)
                .map(|s| s.matches(labels)),
        };
        let problems = validate(p);
        match (problems.is_empty(), matches) {
            (true, Some(true)) => {
                if let Some(h) = &p.spec.healthz {
                    out.ineligible_taints
                        .extend(h.ineligible_taints.iter().cloned());
                }
                for probe in &p.spec.probes {
                    match probe_from.get(&probe.name) {
                        None => {
                            probe_from.insert(probe.name.clone(), name.clone());
                            out.probes.push(probe.clone());
                        }
                        Some(first) => out.conflicts.push((
                            format!("spec.probes[{}]", probe.name),
                            first.clone(),
                            vec![name.clone()],
                        )),
                    }
                }
                for monitor in &p.spec.monitors {
                    match monitor_from.get(&monitor.name) {
                        None => {
                            monitor_from.insert(monitor.name.clone(), name.clone());
                            out.monitors.push(monitor.clone());
                        }
                        Some(first) => out.conflicts.push((
                            format!("spec.monitors[{}]", monitor.name),
                            first.clone(),
                            vec![name.clone()],
                        )),
                    }
                }
                watchdog.offer(&name, p.spec.watchdog.as_ref());
                shutdown.offer(&name, p.spec.shutdown.as_ref());
                out.applied.push(name);
            }
            (false, Some(true) | None) => out.invalid.push((name, problems)),
            _ => {}
        }
    }
    out.ineligible_taints.sort();
    out.ineligible_taints.dedup();
    out.shutdown = shutdown.finish("spec.shutdown", &mut out.conflicts);
    out.watchdog = watchdog.finish("spec.watchdog", &mut out.conflicts);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{HealthzSpec, NodeGuardPolicySpec};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};

    fn policy(name: &str, labels: &[(&str, &str)], taints: &[&str]) -> NodeGuardPolicy {
        NodeGuardPolicy::new(
            name,
            NodeGuardPolicySpec {
                node_selector: (!labels.is_empty()).then(|| LabelSelector {
                    match_labels: Some(
                        labels
                            .iter()
                            .map(|(k, v)| (k.to_string(), v.to_string()))
                            .collect(),
                    ),
                    ..Default::default()
                }),
                healthz: (!taints.is_empty()).then(|| HealthzSpec {
                    ineligible_taints: taints.iter().map(|s| s.to_string()).collect(),
                }),
                ..Default::default()
            },
        )
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn selection_by_labels_and_union_of_taints() {
        let ps = [
            policy("all", &[], &["b.io/drain"]),
            policy("gpu", &[("pool", "gpu")], &["a.io/drain", "b.io/drain"]),
            policy("cpu", &[("pool", "cpu")], &["c.io/drain"]),
        ];
        let s = select(&ps, &labels(&[("pool", "gpu")]));
        assert_eq!(s.applied, ["all", "gpu"]);
        assert_eq!(s.ineligible_taints, ["a.io/drain", "b.io/drain"]);
        assert!(s.invalid.is_empty());
    }

    #[test]
    fn invalid_policies_are_reported_when_they_may_apply_and_never_applied() {
        let mut bad_selector = policy("bad-selector", &[], &["x.io/t"]);
        bad_selector.spec.node_selector = Some(LabelSelector {
            match_expressions: Some(vec![LabelSelectorRequirement {
                key: "pool".into(),
                operator: "Equals".into(),
                values: Some(vec!["gpu".into()]),
            }]),
            ..Default::default()
        });
        let mut bad_elsewhere = policy("bad-elsewhere", &[("pool", "cpu")], &[]);
        bad_elsewhere.metadata.namespace = Some("oops".into());
        let mut bad_here = policy("bad-here", &[("pool", "gpu")], &[]);
        bad_here.metadata.namespace = Some("oops".into());
        let s = select(
            &[bad_selector, bad_elsewhere, bad_here],
            &labels(&[("pool", "gpu")]),
        );
        assert!(s.applied.is_empty());
        let names: Vec<&str> = s.invalid.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["bad-here", "bad-selector"]);
        assert!(
            s.ineligible_taints.is_empty(),
            "nothing from invalid policies"
        );
    }
}
