//! Decisions of retiring, without I/O: which taints are nodeguard's (from
//! the monitors' saved state), what the report says, and how far the
//! uninstall hook is.

use std::collections::BTreeSet;
use std::path::PathBuf;

use crate::monitor::MonitorState;

/// What one agent removed from its node when it retired, and what it could
/// not remove.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Retired {
    /// `key:effect` of each taint removed.
    pub taints: Vec<String>,
    /// Condition types removed (those nodeguard owned).
    pub conditions: Vec<String>,
    /// The logind drop-ins removed.
    pub drop_ins: Vec<PathBuf>,
    /// Whether logind reloaded after its drop-in went (`None`: none went).
    pub logind_reloaded: Option<bool>,
    /// State files removed.
    pub state_files: usize,
    /// What is left on the node, each one sentence saying what to do.
    pub failures: Vec<String>,
}

impl Retired {
    /// Nothing was left behind.
    pub fn complete(&self) -> bool {
        self.failures.is_empty()
    }

    /// The report, as the Node Event and the pod's condition say it.
    pub fn message(&self, node: &str) -> String {
        let mut removed = Vec::new();
        if !self.taints.is_empty() {
            removed.push(format!(
                "{} taint(s) ({})",
                self.taints.len(),
                self.taints.join(", ")
            ));
        }
        if !self.conditions.is_empty() {
            removed.push(format!("{} condition(s)", self.conditions.len()));
        }
        for d in &self.drop_ins {
            removed.push(format!(
                "the logind drop-in {}{}",
                d.display(),
                match self.logind_reloaded {
                    Some(true) => " (logind reloaded)",
                    _ => "",
                }
            ));
        }
        if self.state_files > 0 {
            removed.push(format!("{} state file(s)", self.state_files));
        }
        let removed = if removed.is_empty() {
            "nothing of nodeguard's was left on it".to_string()
        } else {
            format!("removed {}", removed.join(", "))
        };
        let mut message =
            format!("nodeguard was uninstalled and no longer guards node {node}: {removed}.");
        if !self.failures.is_empty() {
            message.push_str(" Left behind: ");
            message.push_str(&self.failures.join("; "));
            message.push('.');
        }
        message
    }
}

/// The taints nodeguard added, as the monitors' saved states record them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OwnedTaints {
    /// `(key, effect)`, each once.
    pub taints: Vec<(String, String)>,
    /// Taints a state says were added without saying which (saved by a
    /// nodeguard from before the key was recorded): left, with what to do.
    pub unrecorded: Vec<String>,
}

/// Which taints the monitors (by name) added and still hold.
pub fn owned_taints(states: &[(String, MonitorState)]) -> OwnedTaints {
    let mut taints = BTreeSet::new();
    let mut unrecorded = Vec::new();
    for (monitor, state) in states {
        for (type_, c) in &state.conditions {
            if !c.taint_added {
                continue;
            }
            match &c.taint {
                Some(t) => {
                    taints.insert((t.key.clone(), t.effect.clone()));
                }
                None => unrecorded.push(format!(
                    "monitor {monitor} added a taint for {type_} without recording which (saved by an older nodeguard): remove it with kubectl taint if it is still there"
                )),
            }
        }
    }
    OwnedTaints {
        taints: taints.into_iter().collect(),
        unrecorded,
    }
}

/// A taint as `(key, value, effect)`.
pub type Taint = (String, Option<String>, String);

/// Taints still on the node that a policy's monitor declares but that no
/// saved state says nodeguard added (the state directory was not kept, or
/// someone else set them): not removed, since they may be someone else's,
/// but said, each with what to do.
pub fn policy_taints_left(on_node: &[Taint], declared: &[Taint]) -> Vec<String> {
    let value = |v: &Option<String>| v.clone().unwrap_or_default();
    let mut left = BTreeSet::new();
    for (key, v, effect) in on_node {
        if declared
            .iter()
            .any(|(dk, dv, de)| dk == key && de == effect && value(dv) == value(v))
        {
            left.insert(format!(
                "the taint {key}:{effect} that a policy's monitor sets is still on the node, and no saved state says nodeguard added it (its state directory was not kept, or someone else set it): remove it with kubectl taint if nodeguard did"
            ));
        }
    }
    left.into_iter().collect()
}

/// One agent pod, as the uninstall hook sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AgentPod {
    /// It retired; `complete`: nothing was left behind.
    Retired { complete: bool, message: String },
    /// It runs and has not answered yet.
    Waiting,
    /// Nothing of it runs on a node, so there is nothing to wait for.
    Skipped(String),
}

/// Where an agent pod stands: `node` is its `spec.nodeName`, `phase` its
/// phase, `retired` its [`super::RETIRED_CONDITION`] (status, reason,
/// message) when set.
pub fn agent_pod(
    node: Option<&str>,
    phase: Option<&str>,
    retired: Option<(&str, &str, &str)>,
) -> AgentPod {
    if let Some(("True", reason, message)) = retired {
        return AgentPod::Retired {
            complete: reason == "Retired",
            message: message.to_string(),
        };
    }
    if node.is_none() {
        return AgentPod::Skipped("not scheduled to a node".into());
    }
    match phase {
        Some("Running") => AgentPod::Waiting,
        other => AgentPod::Skipped(format!(
            "not running (phase {}): it has put nothing on its node",
            other.unwrap_or("unknown")
        )),
    }
}

/// The hook's view of every agent pod, by node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    pub retired: Vec<String>,
    /// Retired with something left behind: node and the agent's report.
    pub incomplete: Vec<(String, String)>,
    pub waiting: Vec<String>,
    pub skipped: Vec<(String, String)>,
}

impl Progress {
    pub fn of(pods: &[(String, AgentPod)]) -> Self {
        let mut p = Progress::default();
        for (node, pod) in pods {
            match pod {
                AgentPod::Retired { complete: true, .. } => p.retired.push(node.clone()),
                AgentPod::Retired { message, .. } => {
                    p.incomplete.push((node.clone(), message.clone()))
                }
                AgentPod::Waiting => p.waiting.push(node.clone()),
                AgentPod::Skipped(why) => p.skipped.push((node.clone(), why.clone())),
            }
        }
        p
    }

    /// Every running agent answered.
    pub fn done(&self) -> bool {
        self.waiting.is_empty()
    }

    /// Every node is clean of nodeguard (as far as running agents can tell).
    pub fn clean(&self) -> bool {
        self.done() && self.incomplete.is_empty()
    }

    /// One line of progress.
    pub fn line(&self) -> String {
        let answered = self.retired.len() + self.incomplete.len();
        let mut line = format!(
            "{answered} of {} running agent(s) retired",
            answered + self.waiting.len()
        );
        if !self.waiting.is_empty() {
            line.push_str(&format!("; waiting for {}", self.waiting.join(", ")));
        }
        line
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::monitor::engine::{ConditionState, OwnedTaint};

    /// A condition type, whether its taint was added, and which taint.
    type Row<'a> = (&'a str, bool, Option<(&'a str, &'a str)>);

    fn state(conditions: &[Row<'_>]) -> MonitorState {
        let mut s = MonitorState::default();
        for (type_, added, taint) in conditions {
            s.conditions.insert(
                type_.to_string(),
                ConditionState {
                    active: *added,
                    unknown: false,
                    reason: "Fine".into(),
                    message: "fine".into(),
                    since: jiff::Timestamp::UNIX_EPOCH,
                    last_match: None,
                    taint_added: *added,
                    taint: taint.map(|(k, e)| OwnedTaint {
                        key: k.into(),
                        effect: e.into(),
                    }),
                },
            );
        }
        s
    }

    #[test]
    fn owned_taints_come_from_the_saved_states_once_each() {
        let states = vec![
            (
                "kernel".to_string(),
                state(&[
                    (
                        "KernelDeadlock",
                        true,
                        Some(("example.com/dead", "NoSchedule")),
                    ),
                    ("ReadonlyFilesystem", false, None),
                ]),
            ),
            (
                "app".to_string(),
                state(&[
                    ("AppBroken", true, Some(("example.com/dead", "NoSchedule"))),
                    (
                        "AppSlow",
                        true,
                        Some(("example.com/slow", "PreferNoSchedule")),
                    ),
                    ("AppOld", true, None),
                ]),
            ),
        ];
        let owned = owned_taints(&states);
        assert_eq!(
            owned.taints,
            vec![
                ("example.com/dead".to_string(), "NoSchedule".to_string()),
                (
                    "example.com/slow".to_string(),
                    "PreferNoSchedule".to_string()
                ),
            ]
        );
        assert_eq!(owned.unrecorded.len(), 1);
        assert!(
            owned.unrecorded[0].contains("monitor app") && owned.unrecorded[0].contains("AppOld"),
            "{:?}",
            owned.unrecorded
        );
        assert_eq!(owned_taints(&[]), OwnedTaints::default());
    }

    #[test]
    fn a_declared_taint_left_on_the_node_is_said() {
        let t = |k: &str, v: Option<&str>, e: &str| {
            (k.to_string(), v.map(str::to_string), e.to_string())
        };
        let declared = [
            t("example.com/app-broken", Some("true"), "NoSchedule"),
            t("example.com/dead", None, "NoExecute"),
        ];
        let on_node = [
            t("example.com/app-broken", Some("true"), "NoSchedule"),
            // Another value or effect: not the policy's.
            t("example.com/app-broken", Some("other"), "NoSchedule"),
            t("example.com/app-broken", Some("true"), "NoExecute"),
            // No value and an empty one are the same taint.
            t("example.com/dead", Some(""), "NoExecute"),
            t("node.kubernetes.io/unschedulable", None, "NoSchedule"),
        ];
        let left = policy_taints_left(&on_node, &declared);
        assert_eq!(left.len(), 2, "{left:?}");
        assert!(
            left[0].starts_with("the taint example.com/app-broken:NoSchedule "),
            "{left:?}"
        );
        assert!(
            left[1].starts_with("the taint example.com/dead:NoExecute "),
            "{left:?}"
        );
        assert!(policy_taints_left(&[], &declared).is_empty());
    }

    #[test]
    fn the_report_says_what_went_and_what_stays() {
        let mut r = Retired::default();
        assert_eq!(
            r.message("n1"),
            "nodeguard was uninstalled and no longer guards node n1: nothing of nodeguard's was left on it."
        );
        assert!(r.complete());
        r.taints = vec!["example.com/dead:NoSchedule".into()];
        r.conditions = vec!["KernelDeadlock".into(), "NodeGuardPolicyInvalid".into()];
        r.drop_ins = vec!["/etc/systemd/logind.conf.d/99-nodeguard-inhibit-delay.conf".into()];
        r.logind_reloaded = Some(true);
        r.state_files = 3;
        assert_eq!(
            r.message("n1"),
            "nodeguard was uninstalled and no longer guards node n1: removed 1 taint(s) (example.com/dead:NoSchedule), 2 condition(s), the logind drop-in /etc/systemd/logind.conf.d/99-nodeguard-inhibit-delay.conf (logind reloaded), 3 state file(s)."
        );
        r.logind_reloaded = Some(false);
        r.failures = vec![
            "cannot make logind reload (no bus): it keeps the raised delay until its next restart"
                .into(),
        ];
        let m = r.message("n1");
        assert!(!r.complete());
        assert!(
            m.contains("99-nodeguard-inhibit-delay.conf, 3 state"),
            "{m}"
        );
        assert!(m.ends_with("Left behind: cannot make logind reload (no bus): it keeps the raised delay until its next restart."), "{m}");
    }

    #[test]
    fn the_hook_waits_only_for_agents_that_run() {
        use AgentPod::*;
        let cases = [
            (Some("a"), Some("Running"), None, Waiting),
            (
                Some("a"),
                Some("Running"),
                Some(("True", "Retired", "m")),
                Retired {
                    complete: true,
                    message: "m".into(),
                },
            ),
            (
                Some("a"),
                Some("Running"),
                Some(("True", "RetiredWithProblems", "m")),
                Retired {
                    complete: false,
                    message: "m".into(),
                },
            ),
            // A condition not True yet is not an answer.
            (
                Some("a"),
                Some("Running"),
                Some(("False", "Retiring", "m")),
                Waiting,
            ),
            // Pending on its node (image pull): it never ran, nothing of it
            // is on the node.
            (
                Some("a"),
                Some("Pending"),
                None,
                Skipped("not running (phase Pending): it has put nothing on its node".into()),
            ),
            (None, None, None, Skipped("not scheduled to a node".into())),
            // Retired, then its container ended: still retired.
            (
                Some("a"),
                Some("Failed"),
                Some(("True", "Retired", "m")),
                Retired {
                    complete: true,
                    message: "m".into(),
                },
            ),
        ];
        for (i, (node, phase, retired, want)) in cases.into_iter().enumerate() {
            assert_eq!(agent_pod(node, phase, retired), want, "case {i}");
        }
        let p = Progress::of(&[
            ("n1".into(), Waiting),
            (
                "n2".into(),
                Retired {
                    complete: true,
                    message: "m".into(),
                },
            ),
            ("n3".into(), Skipped("x".into())),
            (
                "n4".into(),
                Retired {
                    complete: false,
                    message: "left a taint".into(),
                },
            ),
        ]);
        assert_eq!(p.line(), "2 of 3 running agent(s) retired; waiting for n1");
        assert!(!p.done() && !p.clean());
        let p = Progress::of(&[(
            "n2".into(),
            Retired {
                complete: true,
                message: "m".into(),
            },
        )]);
        assert!(p.done() && p.clean());
        assert_eq!(p.line(), "1 of 1 running agent(s) retired");
    }
}
