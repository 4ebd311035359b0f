//! Decision core of the condition manager: given what nodeguard wants on
//! the Node and what is there now, decide whether to write and exactly what.
//!
//! nodeguard writes its conditions with server-side apply (field manager
//! `nodeguard`, subresource `status`). Every apply carries the *whole* set of
//! conditions nodeguard owns, so a type left out of an apply is removed by
//! the API server, and only if nodeguard owned it: conditions of the kubelet
//! and of other agents are never touched. The types nodeguard owned before
//! are read back from the Node's managedFields.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::Duration;

use jiff::Timestamp;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Status {
    True,
    False,
    Unknown,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::True => "True",
            Status::False => "False",
            Status::Unknown => "Unknown",
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a source wants a condition to say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Desired {
    pub status: Status,
    /// CamelCase, e.g. `KernelHasNoDeadlock`.
    pub reason: String,
    /// One human sentence with the key facts.
    pub message: String,
}

/// A condition as it stands on the Node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observed {
    pub type_: String,
    pub status: String,
    pub reason: String,
    pub message: String,
    pub last_transition: Option<Timestamp>,
    pub last_heartbeat: Option<Timestamp>,
}

/// The Node's conditions and the types nodeguard owns there.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeState {
    pub conditions: Vec<Observed>,
    /// Condition types in nodeguard's managedFields on the status.
    pub owned: BTreeSet<String>,
    /// The Node's `nodeguard.io/effective-policies` annotation, written in
    /// the same apply as the conditions.
    pub effective: Option<String>,
}

impl NodeState {
    fn get(&self, type_: &str) -> Option<&Observed> {
        self.conditions.iter().find(|c| c.type_ == type_)
    }
}

/// A condition to write, with its times decided.
pub type Written = Observed;

/// Why a write is needed (for logs and tests).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reasons {
    pub changed: Vec<String>,
    pub removed: Vec<String>,
    pub heartbeat: bool,
    /// The effective-policies annotation differs from the wanted value.
    pub effective: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The whole set nodeguard will own after the write, sorted by type.
    pub conditions: Vec<Written>,
    /// The effective-policies annotation to apply with them (`None`: none
    /// was ever set, so the apply leaves annotations alone).
    pub effective: Option<String>,
    pub why: Reasons,
}

/// The desired set: `Some` is an evaluated condition; `None` is a type a
/// source has declared but not evaluated yet (right after a restart), whose
/// current value on the Node is carried over unchanged rather than dropped.
pub type DesiredSet = BTreeMap<String, Option<Desired>>;

/// Decides the next write, or `None` when the Node already says what we want
/// and no heartbeat is due. `effective` is the wanted effective-policies
/// annotation: once set it is part of every apply (server-side apply would
/// remove an owned field left out).
pub fn plan(
    desired: &DesiredSet,
    effective: Option<&str>,
    node: &NodeState,
    now: Timestamp,
    heartbeat: Duration,
) -> Option<Plan> {
    let mut why = Reasons::default();
    let mut conditions = Vec::new();
    for (type_, want) in desired {
        let observed = node.get(type_);
        match (want, observed) {
            (Some(want), observed) => {
                let status_changed = observed.is_none_or(|o| o.status != want.status.as_str());
                let changed = status_changed
                    || observed
                        .is_some_and(|o| o.reason != want.reason || o.message != want.message);
                let heartbeat_due = observed
                    .and_then(|o| o.last_heartbeat)
                    .is_none_or(|h| now.duration_since(h).unsigned_abs() >= heartbeat);
                if changed {
                    why.changed.push(type_.clone());
                } else if heartbeat_due {
                    why.heartbeat = true;
                }
                let last_transition = match observed {
                    Some(o) if !status_changed => o.last_transition.or(Some(now)),
                    _ => Some(now),
                };
                conditions.push(Written {
                    type_: type_.clone(),
                    status: want.status.as_str().to_string(),
                    reason: want.reason.clone(),
                    message: want.message.clone(),
                    last_transition,
                    last_heartbeat: Some(now),
                });
            }
            // Declared, not evaluated: keep what the Node says, times
            // included, if it is ours. Another writer's condition of the
            // same type is left alone until we have a value of our own.
            (None, Some(o)) if node.owned.contains(type_) => conditions.push(o.clone()),
            (None, _) => {}
        }
    }
    why.removed = node
        .owned
        .iter()
        .filter(|t| !desired.contains_key(*t))
        .cloned()
        .collect();
    why.effective = effective.is_some_and(|e| node.effective.as_deref() != Some(e));
    if why.changed.is_empty() && why.removed.is_empty() && !why.heartbeat && !why.effective {
        return None;
    }
    Some(Plan {
        conditions,
        effective: effective.map(str::to_string),
        why,
    })
}

/// How long until a heartbeat of the evaluated conditions in `desired` falls
/// due on `node` (the soonest of them), when [`plan`] found nothing to write:
/// a writer that has not written yet (an agent restarted within a heartbeat
/// of its last write) times its first heartbeat by this, not by a write of
/// its own. `None` when no evaluated condition is on the Node. A heartbeat
/// that reads as later than `now` (the wall clock set back) is taken as
/// written `now`: due in at most one `heartbeat`.
pub fn heartbeat_due_in(
    desired: &DesiredSet,
    node: &NodeState,
    now: Timestamp,
    heartbeat: Duration,
) -> Option<Duration> {
    desired
        .iter()
        .filter(|(_, want)| want.is_some())
        .filter_map(|(type_, _)| node.get(type_))
        .map(|o| match o.last_heartbeat {
            None => Duration::ZERO,
            Some(h) if h > now => heartbeat,
            Some(h) => heartbeat.saturating_sub(now.duration_since(h).unsigned_abs()),
        })
        .min()
}

/// Whether a condition is `True` in `desired` and not on the Node (types
/// in `exempt` aside): a problem waiting to be written, which must not
/// wait for a policy edit's spread.
pub fn problem_pending(desired: &DesiredSet, node: &NodeState, exempt: &BTreeSet<String>) -> bool {
    desired.iter().any(|(t, d)| {
        d.as_ref().is_some_and(|d| d.status == Status::True)
            && !exempt.contains(t)
            && node.get(t).is_none_or(|o| o.status != "True")
    })
}

/// This node's delay in `window` for writes that follow a policy edit, so
/// that a fleet's writes after one edit spread evenly over the window
/// instead of reaching the API server in the same second. Fixed per node
/// name (FNV-1a), so it is the same after a restart and can be predicted.
pub fn spread_offset(node: &str, window: Duration) -> Duration {
    let window_ms = window.as_millis() as u64;
    if window_ms == 0 {
        return Duration::ZERO;
    }
    let hash = node.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    Duration::from_millis(hash % window_ms)
}

/// Condition types owned by `manager` on the status subresource, from a
/// managedFields `fieldsV1` object (`{"f:status":{"f:conditions":{"k:{\"type\":\"X\"}":…}}}`).
pub fn owned_types(fields_v1: &serde_json::Value) -> BTreeSet<String> {
    let Some(conditions) = fields_v1
        .pointer("/f:status/f:conditions")
        .and_then(|v| v.as_object())
    else {
        return BTreeSet::new();
    };
    conditions
        .keys()
        .filter_map(|k| k.strip_prefix("k:"))
        .filter_map(|k| serde_json::from_str::<serde_json::Value>(k).ok())
        .filter_map(|k| k.get("type")?.as_str().map(str::to_string))
        .collect()
}

/// Whether `s` is CamelCase as Kubernetes expects of reasons: starts with an
/// uppercase ASCII letter, then letters and digits only.
pub fn is_camel_case(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_uppercase()) && chars.all(|c| c.is_ascii_alphanumeric())
}

#[cfg(test)]
mod tests {
    use super::*;

    const HB: Duration = Duration::from_secs(300);

    fn t(secs: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + secs).unwrap()
    }

    fn want(status: Status, reason: &str) -> Option<Desired> {
        Some(Desired {
            status,
            reason: reason.into(),
            message: format!("{reason} message."),
        })
    }

    fn obs(type_: &str, status: &str, reason: &str, transition: i64, heartbeat: i64) -> Observed {
        Observed {
            type_: type_.into(),
            status: status.into(),
            reason: reason.into(),
            message: format!("{reason} message."),
            last_transition: Some(t(transition)),
            last_heartbeat: Some(t(heartbeat)),
        }
    }

    fn node(conditions: Vec<Observed>, owned: &[&str]) -> NodeState {
        NodeState {
            effective: None,
            conditions,
            owned: owned.iter().map(|s| s.to_string()).collect(),
        }
    }

    fn set(items: Vec<(&str, Option<Desired>)>) -> DesiredSet {
        items.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
    }

    #[test]
    fn a_new_condition_is_written_with_both_times_now() {
        let p = plan(
            &set(vec![("A", want(Status::True, "Bad"))]),
            None,
            &NodeState::default(),
            t(10),
            HB,
        )
        .unwrap();
        assert_eq!(p.why.changed, ["A"]);
        assert_eq!(p.conditions[0].last_transition, Some(t(10)));
        assert_eq!(p.conditions[0].last_heartbeat, Some(t(10)));
        assert_eq!(p.conditions[0].status, "True");
    }

    #[test]
    fn nothing_to_do_when_the_node_agrees_and_no_heartbeat_is_due() {
        let d = set(vec![("A", want(Status::False, "Fine"))]);
        let n = node(vec![obs("A", "False", "Fine", 0, 100)], &["A"]);
        assert_eq!(plan(&d, None, &n, t(399), HB), None);
    }

    fn node_with(conds: Vec<Observed>) -> NodeState {
        NodeState {
            owned: conds.iter().map(|c| c.type_.clone()).collect(),
            conditions: conds,
            effective: None,
        }
    }

    #[test]
    fn heartbeat_due_in_counts_from_the_oldest_evaluated_heartbeat() {
        let desired: DesiredSet = [
            ("A".to_string(), want(Status::False, "Fine")),
            ("B".to_string(), want(Status::False, "Fine")),
            // Declared, not evaluated: carried over, never heartbeated.
            ("C".to_string(), None),
        ]
        .into();
        let node = node_with(vec![
            obs("A", "False", "Fine", 0, 100),
            obs("B", "False", "Fine", 0, 40),
            obs("C", "False", "Fine", 0, 0),
        ]);
        assert_eq!(
            heartbeat_due_in(&desired, &node, t(200), HB),
            Some(Duration::from_secs(140)),
            "B, heartbeated at 40, is due at 340"
        );
        assert_eq!(
            heartbeat_due_in(&desired, &node, t(400), HB),
            Some(Duration::ZERO),
            "overdue is due now"
        );
    }

    #[test]
    fn heartbeat_due_in_without_anything_to_heartbeat() {
        let declared: DesiredSet = [("C".to_string(), None)].into();
        let node = node_with(vec![obs("C", "False", "Fine", 0, 0)]);
        assert_eq!(heartbeat_due_in(&declared, &node, t(10), HB), None);
        let desired: DesiredSet = [("A".to_string(), want(Status::True, "Bad"))].into();
        assert_eq!(
            heartbeat_due_in(&desired, &NodeState::default(), t(10), HB),
            None,
            "not on the Node: the plan writes it, no heartbeat to time"
        );
    }

    #[test]
    fn heartbeat_due_in_a_heartbeat_without_time_or_from_the_future() {
        let desired: DesiredSet = [("A".to_string(), want(Status::False, "Fine"))].into();
        let mut no_time = obs("A", "False", "Fine", 0, 0);
        no_time.last_heartbeat = None;
        assert_eq!(
            heartbeat_due_in(&desired, &node_with(vec![no_time]), t(10), HB),
            Some(Duration::ZERO)
        );
        // The wall clock was set back below the heartbeat on the Node: one
        // heartbeat from now, not the time until the clock catches up.
        let ahead = node_with(vec![obs("A", "False", "Fine", 0, 5_000)]);
        assert_eq!(heartbeat_due_in(&desired, &ahead, t(10), HB), Some(HB));
    }

    #[test]
    fn heartbeat_refreshes_times_but_keeps_transition() {
        let d = set(vec![("A", want(Status::False, "Fine"))]);
        let n = node(vec![obs("A", "False", "Fine", 0, 100)], &["A"]);
        let p = plan(&d, None, &n, t(400), HB).unwrap();
        assert!(p.why.heartbeat && p.why.changed.is_empty());
        assert_eq!(p.conditions[0].last_transition, Some(t(0)));
        assert_eq!(p.conditions[0].last_heartbeat, Some(t(400)));
    }

    #[test]
    fn transition_time_moves_only_when_status_changes() {
        let n = node(vec![obs("A", "False", "Fine", 0, 100)], &["A"]);
        // Reason/message change, same status: transition kept.
        let p = plan(
            &set(vec![("A", want(Status::False, "StillFine"))]),
            None,
            &n,
            t(150),
            HB,
        )
        .unwrap();
        assert_eq!(p.why.changed, ["A"]);
        assert_eq!(p.conditions[0].last_transition, Some(t(0)));
        // Status change: transition now.
        let p = plan(
            &set(vec![("A", want(Status::True, "Broken"))]),
            None,
            &n,
            t(150),
            HB,
        )
        .unwrap();
        assert_eq!(p.conditions[0].last_transition, Some(t(150)));
        // Unknown counts as a status change too.
        let p = plan(
            &set(vec![("A", want(Status::Unknown, "NoData"))]),
            None,
            &n,
            t(150),
            HB,
        )
        .unwrap();
        assert_eq!(p.conditions[0].last_transition, Some(t(150)));
    }

    #[test]
    fn owned_types_no_longer_desired_are_removed_and_foreign_ones_ignored() {
        let n = node(
            vec![
                obs("Ready", "True", "KubeletReady", 0, 100),
                obs("Old", "True", "Bad", 0, 100),
            ],
            &["Old"],
        );
        let p = plan(&DesiredSet::new(), None, &n, t(200), HB).unwrap();
        assert_eq!(p.why.removed, ["Old"]);
        assert!(
            p.conditions.is_empty(),
            "an empty apply removes what we owned"
        );
        // Ready is not ours: never written, never removed.
        let p = plan(
            &set(vec![("A", want(Status::False, "Fine"))]),
            None,
            &n,
            t(200),
            HB,
        )
        .unwrap();
        assert!(p.conditions.iter().all(|c| c.type_ != "Ready"));
    }

    #[test]
    fn declared_but_unevaluated_types_are_carried_over_unchanged() {
        let n = node(vec![obs("A", "True", "Bad", 5, 50)], &["A"]);
        let d = set(vec![("A", None), ("B", want(Status::False, "Fine"))]);
        let p = plan(&d, None, &n, t(100), HB).unwrap();
        assert_eq!(p.why.changed, ["B"]);
        assert_eq!(p.conditions[0], n.conditions[0], "A carried over verbatim");
        // Nothing else to do: no write just for a carried-over type.
        let only_a = set(vec![("A", None)]);
        assert_eq!(plan(&only_a, None, &n, t(100_000), HB), None);
        // A declared type absent from the Node is simply not written.
        let p = plan(
            &set(vec![("Z", None)]),
            None,
            &NodeState::default(),
            t(1),
            HB,
        );
        assert_eq!(p, None);
    }

    #[test]
    fn another_writers_condition_of_a_declared_type_is_left_alone_until_evaluated() {
        let n = node(vec![obs("A", "True", "Bad", 5, 50)], &[]);
        assert_eq!(plan(&set(vec![("A", None)]), None, &n, t(60), HB), None);
        let d = set(vec![("A", None), ("B", want(Status::False, "Fine"))]);
        let p = plan(&d, None, &n, t(60), HB).unwrap();
        let types: Vec<&str> = p.conditions.iter().map(|c| c.type_.as_str()).collect();
        assert_eq!(types, ["B"]);
        // Once evaluated, ours wins (server-side apply with force).
        let p = plan(
            &set(vec![("A", want(Status::False, "Fine"))]),
            None,
            &n,
            t(60),
            HB,
        )
        .unwrap();
        assert_eq!(p.why.changed, ["A"]);
    }

    #[test]
    fn the_effective_annotation_is_written_when_it_differs_and_kept_in_every_apply() {
        let d = set(vec![("A", want(Status::False, "Fine"))]);
        let mut n = node(vec![obs("A", "False", "Fine", 0, 100)], &["A"]);
        // No annotation wanted yet: nothing to do, and none in a write.
        assert_eq!(plan(&d, None, &n, t(110), HB), None);
        // Wanted and missing on the Node: a write for it alone.
        let p = plan(&d, Some("p@2"), &n, t(110), HB).unwrap();
        assert!(p.why.effective && p.why.changed.is_empty() && !p.why.heartbeat);
        assert_eq!(p.effective.as_deref(), Some("p@2"));
        assert_eq!(p.conditions.len(), 1, "the conditions ride along unchanged");
        // On the Node already: nothing to do.
        n.effective = Some("p@2".into());
        assert_eq!(plan(&d, Some("p@2"), &n, t(110), HB), None);
        // A heartbeat still carries it, so the apply does not drop it.
        let p = plan(&d, Some("p@2"), &n, t(400), HB).unwrap();
        assert!(p.why.heartbeat && !p.why.effective);
        assert_eq!(p.effective.as_deref(), Some("p@2"));
        // An empty value (no policy selects the node) is a value too.
        let p = plan(&d, Some(""), &n, t(110), HB).unwrap();
        assert!(p.why.effective);
    }

    #[test]
    fn a_pending_problem_is_true_here_and_not_on_the_node() {
        let exempt: BTreeSet<String> = ["P".to_string()].into();
        let n = node(
            vec![
                obs("A", "False", "Fine", 0, 0),
                obs("T", "True", "Bad", 0, 0),
            ],
            &["A", "T"],
        );
        // True here and on the Node already, False, Unknown, declared:
        // nothing pending.
        let quiet = set(vec![
            ("A", want(Status::False, "Fine")),
            ("T", want(Status::True, "WorseNow")),
            ("U", want(Status::Unknown, "NotYet")),
            ("D", None),
        ]);
        assert!(!problem_pending(&quiet, &n, &exempt));
        // The edit's own verdict (exempt) True: not a problem found.
        let mut d = quiet.clone();
        d.insert("P".into(), want(Status::True, "PolicyInvalid"));
        assert!(!problem_pending(&d, &n, &exempt));
        // False on the Node, True here; or a new type True: pending.
        for t in ["A", "C"] {
            let mut d = quiet.clone();
            d.insert(t.into(), want(Status::True, "Bad"));
            assert!(problem_pending(&d, &n, &exempt), "{t}");
        }
    }

    #[test]
    fn spread_offsets_stay_in_the_window_and_spread_a_fleet_evenly() {
        let w = Duration::from_secs(10);
        assert_eq!(spread_offset("node-1", Duration::ZERO), Duration::ZERO);
        assert_eq!(spread_offset("node-1", w), spread_offset("node-1", w));
        let mut per_second = [0usize; 10];
        for i in 0..5000 {
            let o = spread_offset(&format!("ip-10-0-{}-{}.ec2.internal", i / 250, i % 250), w);
            assert!(o < w);
            per_second[o.as_secs() as usize] += 1;
        }
        // 5,000 nodes: about 500 a second, none of the ten seconds twice
        // another.
        let (min, max) = (
            per_second.iter().min().unwrap(),
            per_second.iter().max().unwrap(),
        );
        assert!(*min >= 400 && *max <= 600, "{per_second:?}");
    }

    #[test]
    fn missing_times_on_the_node_are_filled_in() {
        let mut o = obs("A", "False", "Fine", 0, 0);
        o.last_transition = None;
        o.last_heartbeat = None;
        let p = plan(
            &set(vec![("A", want(Status::False, "Fine"))]),
            None,
            &node(vec![o], &["A"]),
            t(7),
            HB,
        )
        .unwrap();
        assert!(p.why.heartbeat);
        assert_eq!(p.conditions[0].last_transition, Some(t(7)));
    }

    #[test]
    fn plan_output_is_sorted_and_complete() {
        let d = set(vec![
            ("C", want(Status::False, "Fine")),
            ("A", want(Status::True, "Bad")),
            ("B", want(Status::False, "Fine")),
        ]);
        let n = node(
            vec![
                obs("B", "False", "Fine", 0, 100),
                obs("C", "False", "Fine", 0, 100),
            ],
            &["B", "C"],
        );
        let p = plan(&d, None, &n, t(110), HB).unwrap();
        let types: Vec<&str> = p.conditions.iter().map(|c| c.type_.as_str()).collect();
        assert_eq!(types, ["A", "B", "C"]);
        assert_eq!(p.why.changed, ["A"]);
        assert_eq!(
            p.conditions[1].last_transition,
            Some(t(0)),
            "B keeps its times' transition"
        );
    }

    #[test]
    fn owned_types_from_managed_fields() {
        let fields = serde_json::json!({"f:status": {"f:conditions": {
            ".": {},
            "k:{\"type\":\"KernelDeadlock\"}": {".": {}, "f:status": {}},
            "k:{\"type\":\"NodeGuardPolicyInvalid\"}": {},
        }}});
        let owned = owned_types(&fields);
        assert_eq!(
            owned.into_iter().collect::<Vec<_>>(),
            ["KernelDeadlock", "NodeGuardPolicyInvalid"]
        );
        assert!(owned_types(&serde_json::json!({"f:metadata": {}})).is_empty());
    }

    #[test]
    fn camel_case_reasons() {
        for ok in ["KernelHasNoDeadlock", "OOMKilling", "A1"] {
            assert!(is_camel_case(ok), "{ok}");
        }
        for bad in [
            "",
            "kernelDeadlock",
            "Kernel Deadlock",
            "Kernel-Deadlock",
            "Kernel_Deadlock",
        ] {
            assert!(!is_camel_case(bad), "{bad}");
        }
    }
}
