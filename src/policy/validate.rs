//! Semantic validation of a policy: what the CRD schema cannot express.
//! `nodeguard check` and the agent call the same [`validate`].

use super::NodeGuardPolicy;
use super::monitors::{MonitorSpec, ONE_SOURCE_MESSAGE, ProblemKind, Source};
use super::probes::{ProbeRole, ProbeSpec};
use super::problem::Problem;
use super::selector::{Selector, check_label_key, is_dns_label, is_dns_subdomain};

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
    problems.extend(validate_probes(&policy.spec.probes, "spec.probes"));
    problems.extend(validate_monitors(&policy.spec.monitors, "spec.monitors"));
    problems
}

/// Each policy's problems, validated once per name, namespace and spec:
/// validating compiles every monitor's patterns (milliseconds for NPD's
/// kernel rules), and the agent looks at every policy of the cluster again
/// on each change of its Node (its own condition heartbeats among them) and
/// of any policy (status writes among them), the status writer on each
/// lease renewal.
#[derive(Default)]
pub struct Validations {
    /// Name → (the namespace and spec validated, as JSON; their problems).
    known: std::collections::BTreeMap<String, (String, std::sync::Arc<Vec<Problem>>)>,
    validated: u64,
}

impl Validations {
    /// [`validate`]`(p)`, from the last validation of the same name,
    /// namespace and spec if there was one.
    pub fn problems(&mut self, p: &NodeGuardPolicy) -> std::sync::Arc<Vec<Problem>> {
        let name = p.metadata.name.clone().unwrap_or_default();
        let key =
            serde_json::to_string(&(&p.metadata.namespace, &p.spec)).expect("a policy serializes");
        if let Some((k, problems)) = self.known.get(&name)
            && *k == key
        {
            return problems.clone();
        }
        let problems = std::sync::Arc::new(validate(p));
        self.validated += 1;
        self.known.insert(name, (key, problems.clone()));
        problems
    }

    /// Forgets the policies not in `listed` (deleted ones).
    pub fn retain_listed<'a>(&mut self, listed: impl IntoIterator<Item = &'a NodeGuardPolicy>) {
        let names = listed_names(listed);
        self.known.retain(|name, _| names.contains(name.as_str()));
    }

    /// How many validations ran (not answered from an earlier one).
    pub fn validated(&self) -> u64 {
        self.validated
    }
}

/// The names of `policies`.
pub fn listed_names<'a>(
    policies: impl IntoIterator<Item = &'a NodeGuardPolicy>,
) -> std::collections::BTreeSet<&'a str> {
    policies
        .into_iter()
        .filter_map(|p| p.metadata.name.as_deref())
        .collect()
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

/// Rules for `spec.probes` beyond the schema.
pub fn validate_probes(probes: &[ProbeSpec], path: &str) -> Vec<Problem> {
    let mut problems = Vec::new();
    let mut names = std::collections::BTreeSet::new();
    for (i, p) in probes.iter().enumerate() {
        let at = format!("{path}[{i}]");
        if !is_dns_label(&p.name) {
            problems.push(Problem::new(
                format!("{at}.name"),
                format!(
                    "{:?} must be a DNS label (lowercase letters, digits, '-')",
                    p.name
                ),
            ));
        }
        if !names.insert(p.name.as_str()) {
            problems.push(Problem::new(
                format!("{at}.name"),
                format!("probe {:?} appears twice", p.name),
            ));
        }
        let actions = [
            p.http.is_some(),
            p.tcp.is_some(),
            p.grpc.is_some(),
            p.exec.is_some(),
        ]
        .iter()
        .filter(|a| **a)
        .count();
        if actions != 1 {
            problems.push(Problem::new(
                at.clone(),
                "set exactly one of http, tcp, grpc, exec",
            ));
        }
        if p.role != ProbeRole::Readiness && p.success_threshold != 1 {
            problems.push(Problem::new(
                format!("{at}.successThreshold"),
                "must be 1 for Liveness and Startup probes, as for the kubelet",
            ));
        }
        match &p.pods {
            None => {
                match &p.condition_type {
                    None => problems.push(Problem::new(
                        format!("{at}.conditionType"),
                        "node probes need the NodeCondition type to set",
                    )),
                    Some(t) => {
                        check_condition_type(t, &format!("{at}.conditionType"), &mut problems)
                    }
                }
                if p.readiness_gate.is_some() {
                    problems.push(Problem::new(
                        format!("{at}.readinessGate"),
                        "only pod probes set readiness gates",
                    ));
                }
                if let Some(h) = &p.http {
                    match &h.url {
                        Some(u) if u.starts_with("http://") || u.starts_with("https://") => {}
                        Some(u) => problems.push(Problem::new(
                            format!("{at}.http.url"),
                            format!("{u:?} is not an http:// or https:// URL"),
                        )),
                        None => problems.push(Problem::new(
                            format!("{at}.http.url"),
                            "node probes need a url",
                        )),
                    }
                }
            }
            Some(target) => {
                Selector::parse(
                    &target.selector,
                    &format!("{at}.pods.selector"),
                    &mut problems,
                );
                match &p.readiness_gate {
                    None => problems.push(Problem::new(
                        format!("{at}.readinessGate"),
                        "pod probes need the readiness gate condition type to set",
                    )),
                    Some(t) => {
                        check_condition_type(t, &format!("{at}.readinessGate"), &mut problems)
                    }
                }
                if p.condition_type.is_some() {
                    problems.push(Problem::new(
                        format!("{at}.conditionType"),
                        "only node probes set NodeConditions",
                    ));
                }
                if p.exec.is_some() {
                    problems.push(Problem::new(
                        format!("{at}.exec"),
                        "exec probes run on the host: node probes only",
                    ));
                }
                if let Some(h) = &p.http
                    && (h.port.is_none() || h.url.is_some())
                {
                    problems.push(Problem::new(
                        format!("{at}.http"),
                        "pod probes take a port (and path), not a url",
                    ));
                }
            }
        }
        if let Some(h) = &p.http
            && let Some(r) = h.expected_status
            && r.min > r.max
        {
            problems.push(Problem::new(
                format!("{at}.http.expectedStatus"),
                format!("min {} is above max {}", r.min, r.max),
            ));
        }
        if let Some(e) = &p.exec
            && e.command.is_empty()
        {
            problems.push(Problem::new(
                format!("{at}.exec.command"),
                "an empty command",
            ));
        }
        if p.period_seconds == 0
            || p.timeout_seconds == 0
            || p.failure_threshold == 0
            || p.success_threshold == 0
        {
            problems.push(Problem::new(
                at.clone(),
                "periodSeconds, timeoutSeconds and thresholds must be at least 1",
            ));
        }
    }
    for (i, p) in probes.iter().enumerate() {
        if let Some(g) = &p.gated_by {
            let gate = probes.iter().find(|q| &q.name == g);
            match gate {
                None => problems.push(Problem::new(
                    format!("{path}[{i}].gatedBy"),
                    format!("no probe named {g:?}"),
                )),
                Some(q) if q.role != ProbeRole::Startup => problems.push(Problem::new(
                    format!("{path}[{i}].gatedBy"),
                    format!("{g:?} is not a Startup probe"),
                )),
                Some(q) if q.pods != p.pods => problems.push(Problem::new(
                    format!("{path}[{i}].gatedBy"),
                    format!("{g:?} probes other targets"),
                )),
                Some(_) => {}
            }
        }
    }
    problems
}

fn check_condition_type(t: &str, path: &str, problems: &mut Vec<Problem>) {
    check_label_key(t, path, problems);
}

fn camel(s: &str) -> bool {
    crate::report::conditions::is_camel_case(s)
}

/// Rules beyond the schema (regular expressions are compiled by the agent
/// and by `nodeguard check`, which reports them with their paths).
pub fn validate_monitors(monitors: &[MonitorSpec], path: &str) -> Vec<Problem> {
    let mut problems = Vec::new();
    let mut names = std::collections::BTreeSet::new();
    let mut types = std::collections::BTreeSet::new();
    // (key, effect) -> the condition whose taint it is.
    let mut taints: std::collections::BTreeMap<(&str, &str), &str> = Default::default();
    for (i, m) in monitors.iter().enumerate() {
        let at = format!("{path}[{i}]");
        if !is_dns_label(&m.name) {
            problems.push(Problem::new(
                format!("{at}.name"),
                format!(
                    "{:?} must be a DNS label (lowercase letters, digits, '-'; at most 63): it names the monitor's state file",
                    m.name
                ),
            ));
        }
        if !names.insert(m.name.as_str()) {
            problems.push(Problem::new(
                format!("{at}.name"),
                format!("monitor {:?} appears twice", m.name),
            ));
        }
        if m.source.one().is_none() {
            problems.push(Problem::new(format!("{at}.source"), ONE_SOURCE_MESSAGE));
        }
        let plugin = m.source.plugin.is_some();
        for (j, c) in m.conditions.iter().enumerate() {
            let cat = format!("{at}.conditions[{j}]");
            check_label_key(&c.type_, &format!("{cat}.type"), &mut problems);
            if !types.insert(c.type_.as_str()) {
                problems.push(Problem::new(
                    format!("{cat}.type"),
                    format!("condition {:?} is owned twice", c.type_),
                ));
            }
            if !camel(&c.reason) {
                problems.push(Problem::new(
                    format!("{cat}.reason"),
                    format!("{:?} must be CamelCase", c.reason),
                ));
            }
            if let Some(t) = &c.taint {
                if let Some(first) = taints.insert((&t.key, &t.effect), &c.type_) {
                    problems.push(Problem::new(
                        format!("{cat}.taint"),
                        format!(
                            "taint {}:{} of condition {:?} is condition {first:?}'s too: the first to clear would remove it while the other is True; give each condition its own taint key",
                            t.key, t.effect, c.type_
                        ),
                    ));
                }
                check_label_key(&t.key, &format!("{cat}.taint.key"), &mut problems);
                if t.key == super::SHUTDOWN_TAINT_KEY {
                    // The shutdown's taint: which pods tolerate it is decided by
                    // its value, and a monitor's would stand in its place.
                    problems.push(Problem::new(
                        format!("{cat}.taint.key"),
                        format!(
                            "{} is the graceful shutdown's taint; give the condition its own taint key",
                            super::SHUTDOWN_TAINT_KEY
                        ),
                    ));
                }
                if !matches!(
                    t.effect.as_str(),
                    "NoSchedule" | "PreferNoSchedule" | "NoExecute"
                ) {
                    problems.push(Problem::new(
                        format!("{cat}.taint.effect"),
                        "use NoSchedule, PreferNoSchedule or NoExecute",
                    ));
                }
            }
        }
        for (j, r) in m.rules.iter().enumerate() {
            let rat = format!("{at}.rules[{j}]");
            let service = m.source.systemd.is_some();
            match (plugin, service, r.pattern.is_empty(), r.command.is_empty()) {
                (_, true, false, _) | (_, true, _, false) => problems.push(Problem::new(
                    rat.clone(),
                    "systemd monitor rules take neither pattern nor command: they name the reason and condition of an unhealthy unit",
                )),
                (_, true, _, _) => {}
                (true, _, _, true) => problems.push(Problem::new(format!("{rat}.command"), "plugin rules run a command")),
                (true, _, false, _) => problems.push(Problem::new(
                    format!("{rat}.pattern"),
                    "plugin rules take a command, not a pattern",
                )),
                (false, _, true, _) => problems.push(Problem::new(format!("{rat}.pattern"), "log rules need a pattern")),
                (false, _, _, false) => problems.push(Problem::new(
                    format!("{rat}.command"),
                    "only plugin monitors run commands",
                )),
                _ => {}
            }
            if r.timeout_seconds.is_some() && !plugin {
                problems.push(Problem::new(
                    format!("{rat}.timeoutSeconds"),
                    "only plugin rules run a command to time out",
                ));
            }
            if r.timeout_seconds.is_some_and(|s| s == 0 || s > 3600) {
                problems.push(Problem::new(
                    format!("{rat}.timeoutSeconds"),
                    "from 1 to 3600 seconds",
                ));
            }
            if !camel(&r.reason) {
                problems.push(Problem::new(
                    format!("{rat}.reason"),
                    format!("{:?} must be CamelCase", r.reason),
                ));
            }
            match (r.kind, &r.condition) {
                (ProblemKind::Permanent, None) => problems.push(Problem::new(
                    format!("{rat}.condition"),
                    "permanent rules name the condition they set",
                )),
                (ProblemKind::Permanent, Some(c))
                    if !m.conditions.iter().any(|x| &x.type_ == c) =>
                {
                    problems.push(Problem::new(
                        format!("{rat}.condition"),
                        format!("{c:?} is not among this monitor's conditions"),
                    ))
                }
                (ProblemKind::Temporary, Some(_)) => problems.push(Problem::new(
                    format!("{rat}.condition"),
                    "temporary rules set no condition",
                )),
                _ => {}
            }
        }
        if let Err(bad) = m.compile_patterns(&at) {
            problems.extend(bad.into_iter().map(|b| Problem::new(b.path, b.message)));
        }
        if let Some(n) = &m.npd_matching {
            if !m.source.one().is_some_and(Source::lines) {
                problems.push(Problem::new(
                    format!("{at}.npdMatching"),
                    "only kmsg, file and journald monitors match lines",
                ));
            }
            if n.buffer_lines == 0 || n.buffer_lines > 100 {
                problems.push(Problem::new(
                    format!("{at}.npdMatching.bufferLines"),
                    "from 1 to 100 lines",
                ));
            }
            if (n.message_pattern.is_some() || !n.skip.is_empty()) && m.source.file.is_none() {
                problems.push(Problem::new(
                    format!("{at}.npdMatching"),
                    "messagePattern and skip are for file monitors (NPD's filelog)",
                ));
            }
            if let Some(p) = &n.message_pattern
                && let Err(e) = super::goregex::translate(p)
            {
                problems.push(Problem::new(format!("{at}.npdMatching.messagePattern"), e));
            }
        }
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
        let mut m = crate::policy::defaults::default_kernel_monitor();
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
