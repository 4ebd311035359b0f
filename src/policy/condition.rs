//! The `NodeGuardPolicyInvalid` condition and the Warning Events about a
//! node's policies, decided from its [`Selection`]: what is worst first
//! (an invalid policy, a refused item, the node's limits, a gated probe
//! left out), every sentence an operator reads in `kubectl describe node`.

use super::{OverLimit, POLICY_INVALID, Selection};
use crate::report::{Desired, Status};

/// What a selection puts on the node.
#[derive(Clone, Debug, PartialEq)]
pub struct PolicyReport {
    /// The `NodeGuardPolicyInvalid` condition.
    pub condition: Desired,
    /// Warning Events (action `LoadPolicy`), in order: reason, message.
    pub events: Vec<(&'static str, String)>,
}

/// The policy condition and Events for `selection`.
pub fn policy_report(selection: &Selection) -> PolicyReport {
    let mut events: Vec<(&'static str, String)> = Vec::new();
    for (section, used, ignored) in &selection.conflicts {
        events.push((
            "PolicyConflict",
            format!(
                "Policies {} set {section} differently from {used}; nodeguard uses {used}'s. Keep one policy per section for this node.",
                ignored.join(", ")
            ),
        ));
    }
    // Sentences of the condition's message, worst first.
    let mut problems_here: Vec<String> = Vec::new();
    let mut reason = None;
    if let Some((name, problems)) = selection.invalid.first() {
        let first = problems
            .first()
            .map(ToString::to_string)
            .unwrap_or_default();
        let more = match problems.len() {
            0 | 1 => String::new(),
            n => format!(
                " (and {} more problem{})",
                n - 1,
                if n == 2 { "" } else { "s" }
            ),
        };
        let others = match selection.invalid.len() {
            1 => String::new(),
            n => format!(" {} other invalid policies are ignored too.", n - 1),
        };
        let fate = match selection.kept.get(name) {
            Some(generation) => {
                format!("its last valid generation ({generation}) stays in force on this node")
            }
            None => "it is ignored on this node".to_string(),
        };
        let message = format!(
            "NodeGuardPolicy {name} is invalid and {fate}: {first}{more}. Fix it and check with `nodeguard check -f`.{others}"
        );
        events.push(("PolicyInvalid", message.clone()));
        problems_here.push(message);
        reason = Some(POLICY_INVALID);
    }
    for r in &selection.refused {
        events.push((
            "PolicyRefused",
            format!("{r}. The rest of the policy applies."),
        ));
    }
    if let Some(first) = selection.refused.first() {
        let more = match selection.refused.len() {
            1 => String::new(),
            n => format!(
                " {} more item{} refused (PolicyRefused Events).",
                n - 1,
                if n == 2 { " is" } else { "s are" }
            ),
        };
        problems_here.push(format!("{first}; the rest of the policy applies.{more}"));
        reason.get_or_insert("PolicyRefused");
    }
    if !selection.over_limit.is_empty() {
        let message = over_limit_message(&selection.over_limit, &selection.limits_reached);
        events.push(("PolicyOverLimit", message.clone()));
        problems_here.push(message);
        reason.get_or_insert("PolicyOverLimit");
    }
    for u in &selection.ungated {
        events.push((
            "PolicyGateNotInForce",
            format!("{u}. Fix the Startup probe or remove gatedBy."),
        ));
    }
    if let Some(first) = selection.ungated.first() {
        let more = match selection.ungated.len() {
            1 => String::new(),
            n => format!(
                " {} more gated probe{} left out (PolicyGateNotInForce Events).",
                n - 1,
                if n == 2 { " is" } else { "s are" }
            ),
        };
        problems_here.push(format!("{first}.{more}"));
        reason.get_or_insert("PolicyGateNotInForce");
    }
    let condition = if let Some(reason) = reason {
        Desired {
            status: Status::True,
            reason: reason.into(),
            message: problems_here.join(" "),
        }
    } else {
        let message = match selection.applied.as_slice() {
            [] => "No NodeGuardPolicy selects this node; nodeguard runs with defaults.".to_string(),
            names => format!(
                "{} NodeGuardPolic{} in force on this node: {}.",
                names.len(),
                if names.len() == 1 { "y is" } else { "ies are" },
                names.join(", ")
            ),
        };
        Desired {
            status: Status::False,
            reason: "PoliciesValid".into(),
            message,
        }
    };
    PolicyReport { condition, events }
}

/// What the node's limits leave out, naming the limits reached and a few
/// policies.
fn over_limit_message(over: &[OverLimit], reached: &[String]) -> String {
    let count =
        |n: usize, one: &str, many: &str| format!("{n} {}", if n == 1 { one } else { many });
    let probes: usize = over.iter().map(|o| o.probes.len()).sum();
    let monitors: usize = over.iter().map(|o| o.monitors.len()).sum();
    let what = match (probes, monitors) {
        (p, 0) => count(p, "probe", "probes"),
        (0, m) => count(m, "monitor", "monitors"),
        (p, m) => format!(
            "{} and {}",
            count(p, "probe", "probes"),
            count(m, "monitor", "monitors")
        ),
    };
    let mut names: Vec<&str> = over.iter().map(|o| o.policy.as_str()).take(3).collect();
    if over.len() > 3 {
        names.push("…");
    }
    let verb = if probes + monitors == 1 { "is" } else { "are" };
    format!(
        "Policies ask for more than this node runs: the limit of {} from all policies together is reached, so {what} of {} ({}) {verb} not in force here; the policies created first keep theirs. Select fewer for this node.",
        reached.join(" and "),
        count(over.len(), "policy", "policies"),
        names.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::trust::{Item, Refusal, Setting};
    use crate::policy::{Problem, Ungated};

    fn refusal(policy: &str, probe: &str) -> Refusal {
        Refusal {
            policy: policy.into(),
            item: Item::Probe(0),
            field: "spec.probes[0].exec.command[0]".into(),
            asks: "runs /bin/sh".into(),
            setting: Setting::Commands,
            dropped: format!("probe {probe}"),
        }
    }

    fn ungated(probe: &str) -> Ungated {
        Ungated {
            policy: "p".into(),
            probe: probe.into(),
            gate: "boot".into(),
            why: "refused by this node's trust".into(),
        }
    }

    fn over(policy: &str, probes: usize, monitors: usize) -> OverLimit {
        OverLimit {
            policy: policy.into(),
            probes: (0..probes).map(|i| format!("p{i}")).collect(),
            monitors: (0..monitors).map(|i| format!("m{i}")).collect(),
        }
    }

    /// A case, its selection, the condition's status and reason, what its
    /// message contains, and the Events' reasons.
    type Case = (
        &'static str,
        Selection,
        Status,
        &'static str,
        Vec<&'static str>,
        Vec<&'static str>,
    );

    #[test]
    fn the_worst_problem_names_the_reason_and_every_one_is_said() {
        let invalid = |kept: Option<i64>| {
            let mut s = Selection {
                invalid: vec![(
                    "bad".into(),
                    vec![
                        Problem::new("spec.probes[0].periodSeconds", "must be at least 1"),
                        Problem::new("spec.monitors[0].name", "must be a DNS label"),
                    ],
                )],
                ..Default::default()
            };
            if let Some(g) = kept {
                s.kept.insert("bad".into(), g);
            }
            s
        };
        let cases: Vec<Case> = vec![
            (
                "nothing selects the node",
                Selection::default(),
                Status::False,
                "PoliciesValid",
                vec!["No NodeGuardPolicy selects this node; nodeguard runs with defaults."],
                vec![],
            ),
            (
                "two in force",
                Selection {
                    applied: vec!["a".into(), "b".into()],
                    ..Default::default()
                },
                Status::False,
                "PoliciesValid",
                vec!["2 NodeGuardPolicies are in force on this node: a, b."],
                vec![],
            ),
            (
                "a conflict is an Event, not a problem",
                Selection {
                    applied: vec!["a".into()],
                    conflicts: vec![("spec.watchdog".into(), "a".into(), vec!["b".into()])],
                    ..Default::default()
                },
                Status::False,
                "PoliciesValid",
                vec!["1 NodeGuardPolicy is in force on this node: a."],
                vec!["PolicyConflict"],
            ),
            (
                "invalid, ignored",
                invalid(None),
                Status::True,
                POLICY_INVALID,
                vec![
                    "NodeGuardPolicy bad is invalid and it is ignored on this node: spec.probes[0].periodSeconds: must be at least 1 (and 1 more problem).",
                ],
                vec!["PolicyInvalid"],
            ),
            (
                "invalid, its last valid generation kept",
                invalid(Some(3)),
                Status::True,
                POLICY_INVALID,
                vec!["its last valid generation (3) stays in force on this node"],
                vec!["PolicyInvalid"],
            ),
            (
                "two refused items",
                Selection {
                    refused: vec![refusal("p", "a"), refusal("p", "b")],
                    ..Default::default()
                },
                Status::True,
                "PolicyRefused",
                vec![
                    "so its probe a is not in force here",
                    "; the rest of the policy applies. 1 more item is refused (PolicyRefused Events).",
                ],
                vec!["PolicyRefused", "PolicyRefused"],
            ),
            (
                "over the limits",
                Selection {
                    over_limit: vec![
                        over("a", 2, 1),
                        over("b", 1, 0),
                        over("c", 1, 0),
                        over("d", 1, 0),
                    ],
                    limits_reached: vec!["1024 probes".into(), "64 monitors".into()],
                    ..Default::default()
                },
                Status::True,
                "PolicyOverLimit",
                vec![
                    "the limit of 1024 probes and 64 monitors from all policies together is reached, so 5 probes and 1 monitor of 4 policies (a, b, c, …) are not in force here",
                ],
                vec!["PolicyOverLimit"],
            ),
            (
                "one over the limit",
                Selection {
                    over_limit: vec![over("a", 0, 1)],
                    limits_reached: vec!["64 monitors".into()],
                    ..Default::default()
                },
                Status::True,
                "PolicyOverLimit",
                vec!["so 1 monitor of 1 policy (a) is not in force here"],
                vec!["PolicyOverLimit"],
            ),
            (
                "three gated probes left out",
                Selection {
                    ungated: vec![ungated("x"), ungated("y"), ungated("z")],
                    ..Default::default()
                },
                Status::True,
                "PolicyGateNotInForce",
                vec![
                    "probe x is gated by its Startup probe boot, which is not in force here (refused by this node's trust), so x is not in force either. 2 more gated probes are left out (PolicyGateNotInForce Events).",
                ],
                vec!["PolicyGateNotInForce"; 3],
            ),
            (
                "worst first: invalid, then refused, then limits, then gates",
                Selection {
                    ungated: vec![ungated("x")],
                    over_limit: vec![over("a", 1, 0)],
                    limits_reached: vec!["1024 probes".into()],
                    refused: vec![refusal("p", "a")],
                    ..invalid(None)
                },
                Status::True,
                POLICY_INVALID,
                vec![
                    "NodeGuardPolicy bad is invalid",
                    "; the rest of the policy applies. Policies ask for more",
                    "Select fewer for this node. NodeGuardPolicy p: probe x",
                ],
                vec![
                    "PolicyInvalid",
                    "PolicyRefused",
                    "PolicyOverLimit",
                    "PolicyGateNotInForce",
                ],
            ),
        ];
        for (case, selection, status, reason, says, events) in cases {
            let r = policy_report(&selection);
            assert_eq!(r.condition.status, status, "{case}");
            assert_eq!(r.condition.reason, reason, "{case}");
            for s in says {
                assert!(
                    r.condition.message.contains(s),
                    "{case}: {s:?} not in {:?}",
                    r.condition.message
                );
            }
            let reasons: Vec<&str> = r.events.iter().map(|(reason, _)| *reason).collect();
            assert_eq!(reasons, events, "{case}");
        }
    }
}
