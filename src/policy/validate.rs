//! Semantic validation of a policy: what the CRD schema cannot express.
//! `nodeguard check` and the agent call the same [`validate`].

use super::NodeGuardPolicy;
use super::problem::Problem;
use super::selector::{Selector, check_label_key, is_dns_subdomain};

/// Every problem of `policy`; empty when the policy can be put in force.
pub fn validate(policy: &NodeGuardPolicy) -> Vec<Problem> {
    let mut problems = Vec::new();
    match policy.metadata.name.as_deref() {
        None | Some("") => problems.push(Problem::new("metadata.name", "a policy needs a name")),
        Some(name) if !is_dns_subdomain(name) => problems.push(Problem::new(
            "metadata.name",
            format!("{name:?} is not a valid name: use lowercase letters, digits, '-' and '.'"),
        )),
        Some(_) => {}
    }
    if policy.metadata.namespace.is_some() {
        problems.push(Problem::new(
            "metadata.namespace",
            "NodeGuardPolicy is cluster-scoped; remove the namespace",
        ));
    }
    if let Some(sel) = &policy.spec.node_selector {
        Selector::parse(sel, "spec.nodeSelector", &mut problems);
    }
    if let Some(h) = &policy.spec.healthz {
        for (i, key) in h.ineligible_taints.iter().enumerate() {
            check_label_key(
                key,
                &format!("spec.healthz.ineligibleTaints[{i}]"),
                &mut problems,
            );
        }
    }
    if let Some(w) = &policy.spec.watchdog {
        problems.extend(validate_watchdog(w, "spec.watchdog"));
    }
    if let Some(s) = &policy.spec.shutdown {
        problems.extend(validate_shutdown(s, "spec.shutdown"));
    }
    problems.extend(super::probes::validate_probes(
        &policy.spec.probes,
        "spec.probes",
    ));
    problems.extend(super::monitors::validate_monitors(
        &policy.spec.monitors,
        "spec.monitors",
    ));
    problems
}

/// Cross-field rules of `spec.shutdown`.
pub fn validate_shutdown(s: &super::ShutdownSpec, path: &str) -> Vec<Problem> {
    let mut problems = Vec::new();
    let by_priority = !s.grace_period_by_priority.is_empty();
    let simple = s.grace_period_seconds.is_some() || s.critical_pods_grace_period_seconds.is_some();
    if by_priority && simple {
        problems.push(Problem::new(
            path,
            "set either gracePeriodByPriority or gracePeriodSeconds/criticalPodsGracePeriodSeconds, not both",
        ));
    }
    if !by_priority && s.grace_period_seconds.is_none() {
        problems.push(Problem::new(
            path,
            "no grace periods: set gracePeriodByPriority, or gracePeriodSeconds (with criticalPodsGracePeriodSeconds)",
        ));
    }
    if let (Some(total), Some(critical)) =
        (s.grace_period_seconds, s.critical_pods_grace_period_seconds)
        && critical > total
    {
        problems.push(Problem::new(
            format!("{path}.criticalPodsGracePeriodSeconds"),
            format!("{critical} is more than gracePeriodSeconds ({total}): critical pods get part of the total"),
        ));
    }
    let mut seen = std::collections::BTreeSet::new();
    for (i, g) in s.grace_period_by_priority.iter().enumerate() {
        if !seen.insert(g.priority) {
            problems.push(Problem::new(
                format!("{path}.gracePeriodByPriority[{i}].priority"),
                format!("priority {} appears twice", g.priority),
            ));
        }
        if g.grace_period_seconds == 0 {
            problems.push(Problem::new(
                format!("{path}.gracePeriodByPriority[{i}].gracePeriodSeconds"),
                "must be at least 1",
            ));
        }
    }
    if !(10..=100).contains(&s.escalate_after_percent) {
        problems.push(Problem::new(
            format!("{path}.escalateAfterPercent"),
            format!("{} is out of range: 10 to 100", s.escalate_after_percent),
        ));
    }
    if !s.logind_drop_in_dir.is_empty() && !s.logind_drop_in_dir.starts_with('/') {
        problems.push(Problem::new(
            format!("{path}.logindDropInDir"),
            format!("{:?} is not an absolute path", s.logind_drop_in_dir),
        ));
    }
    problems
}

/// Bounds the schema also states, checked again for files and old CRDs.
pub fn validate_watchdog(w: &super::WatchdogSpec, path: &str) -> Vec<Problem> {
    let mut problems = Vec::new();
    if !(2..=3600).contains(&w.timeout_seconds) {
        problems.push(Problem::new(
            format!("{path}.timeoutSeconds"),
            format!(
                "{} is out of range: use 2 to 3600 seconds",
                w.timeout_seconds
            ),
        ));
    }
    if !(10..=50).contains(&w.pet_interval_percent) {
        problems.push(Problem::new(
            format!("{path}.petIntervalPercent"),
            format!(
                "{} is out of range: pet every 10 to 50 percent of the timeout",
                w.pet_interval_percent
            ),
        ));
    }
    if !w.device.starts_with('/') {
        problems.push(Problem::new(
            format!("{path}.device"),
            format!("{:?} is not an absolute path", w.device),
        ));
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::NodeGuardPolicySpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};

    fn policy(name: &str, spec: NodeGuardPolicySpec) -> NodeGuardPolicy {
        NodeGuardPolicy::new(name, spec)
    }

    #[test]
    fn a_minimal_policy_is_valid() {
        assert_eq!(
            validate(&policy("default", NodeGuardPolicySpec::default())),
            vec![]
        );
    }

    #[test]
    fn names_and_namespaces_are_checked() {
        let p = validate(&policy("Bad Name", NodeGuardPolicySpec::default()));
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].path, "metadata.name");

        let mut namespaced = policy("ok", NodeGuardPolicySpec::default());
        namespaced.metadata.namespace = Some("default".into());
        assert_eq!(validate(&namespaced)[0].path, "metadata.namespace");

        let mut unnamed = policy("x", NodeGuardPolicySpec::default());
        unnamed.metadata.name = None;
        assert_eq!(validate(&unnamed)[0].path, "metadata.name");
    }

    #[test]
    fn selector_problems_carry_the_spec_path() {
        let spec = NodeGuardPolicySpec {
            node_selector: Some(LabelSelector {
                match_expressions: Some(vec![LabelSelectorRequirement {
                    key: "zone".into(),
                    operator: "Like".into(),
                    values: Some(vec!["a".into()]),
                }]),
                ..Default::default()
            }),
            ..Default::default()
        };
        let p = validate(&policy("p", spec));
        assert_eq!(p.len(), 1);
        assert_eq!(
            p[0].to_string().split(':').next().unwrap(),
            "spec.nodeSelector.matchExpressions[0].operator"
        );
    }

    #[test]
    fn a_counting_window_stored_before_the_schemas_bound_stays_valid() {
        // The CRD refuses windows over a day on new writes; a policy stored
        // before (or through an older CRD) must not be switched off whole by
        // an agent upgrade: its window runs in wider buckets.
        let mut m = crate::policy::monitors::default_kernel_monitor();
        let counted = m.rules.iter_mut().find(|r| r.count.is_some()).unwrap();
        counted.count.as_mut().unwrap().window_seconds = 604_800;
        let spec = NodeGuardPolicySpec {
            monitors: vec![m],
            ..Default::default()
        };
        assert_eq!(validate(&policy("p", spec)), vec![]);
    }

    #[test]
    fn watchdog_bounds_are_checked_with_paths() {
        let w = crate::policy::WatchdogSpec {
            timeout_seconds: 1,
            pet_interval_percent: 60,
            device: "dev/watchdog".into(),
            ..Default::default()
        };
        let paths: Vec<String> = validate_watchdog(&w, "spec.watchdog")
            .into_iter()
            .map(|p| p.path)
            .collect();
        assert_eq!(
            paths,
            [
                "spec.watchdog.timeoutSeconds",
                "spec.watchdog.petIntervalPercent",
                "spec.watchdog.device"
            ]
        );
        assert!(validate_watchdog(&Default::default(), "spec.watchdog").is_empty());
    }

    #[test]
    fn shutdown_cross_field_rules() {
        use crate::policy::{PriorityGracePeriod, ShutdownSpec};
        let pg = |priority, secs| PriorityGracePeriod {
            priority,
            grace_period_seconds: secs,
        };
        let ok = ShutdownSpec {
            grace_period_by_priority: vec![pg(0, 10), pg(1000, 20)],
            ..Default::default()
        };
        assert!(validate_shutdown(&ok, "s").is_empty());
        let simple = ShutdownSpec {
            grace_period_seconds: Some(30),
            critical_pods_grace_period_seconds: Some(10),
            ..Default::default()
        };
        assert!(validate_shutdown(&simple, "s").is_empty());
        let cases: Vec<(ShutdownSpec, &str)> = vec![
            (ShutdownSpec::default(), "s"),
            (
                ShutdownSpec {
                    grace_period_seconds: Some(5),
                    ..ok.clone()
                },
                "s",
            ),
            (
                ShutdownSpec {
                    critical_pods_grace_period_seconds: Some(40),
                    ..simple.clone()
                },
                "s.criticalPodsGracePeriodSeconds",
            ),
            (
                ShutdownSpec {
                    grace_period_by_priority: vec![pg(0, 10), pg(0, 20)],
                    ..Default::default()
                },
                "s.gracePeriodByPriority[1].priority",
            ),
            (
                ShutdownSpec {
                    grace_period_by_priority: vec![pg(0, 0)],
                    ..Default::default()
                },
                "s.gracePeriodByPriority[0].gracePeriodSeconds",
            ),
            (
                ShutdownSpec {
                    escalate_after_percent: 5,
                    ..ok.clone()
                },
                "s.escalateAfterPercent",
            ),
            (
                ShutdownSpec {
                    logind_drop_in_dir: "etc".into(),
                    ..ok.clone()
                },
                "s.logindDropInDir",
            ),
        ];
        for (spec, path) in cases {
            let problems = validate_shutdown(&spec, "s");
            assert_eq!(problems.len(), 1, "{spec:?}: {problems:?}");
            assert_eq!(problems[0].path, path);
        }
    }
}
