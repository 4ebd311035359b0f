//! Decision core of graceful shutdown: priority groups with the kubelet's
//! boundary rules, per-pod grace, which pods to leave alone, the timeline
//! (group windows, escalation points, when to release the inhibitor).

use std::time::Duration;

/// The priority of `system-cluster-critical`/`system-node-critical` pods'
/// lower bound (`SystemCriticalPriority` in Kubernetes).
pub const SYSTEM_CRITICAL_PRIORITY: i32 = 2_000_000_000;

/// One priority group: pods with priority ≥ `priority` (and below the next
/// group's) get `grace` to terminate, in order from lowest priority.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupSpec {
    pub priority: i32,
    pub grace: Duration,
}

/// The kubelet's simple form (`shutdownGracePeriod`,
/// `shutdownGracePeriodCriticalPods`) as priority groups: regular pods get
/// the total minus the critical period, critical pods the rest.
pub fn migrate(total: Duration, critical: Duration) -> Vec<GroupSpec> {
    if total.is_zero() {
        return Vec::new();
    }
    let regular = total.saturating_sub(critical);
    let critical = total - regular;
    vec![
        GroupSpec {
            priority: 0,
            grace: regular,
        },
        GroupSpec {
            priority: SYSTEM_CRITICAL_PRIORITY,
            grace: critical,
        },
    ]
}

/// Groups sorted by priority, lowest first.
pub fn sorted(mut groups: Vec<GroupSpec>) -> Vec<GroupSpec> {
    groups.sort_by_key(|g| g.priority);
    groups
}

/// Sum of every group's window: the inhibit delay the policy needs.
pub fn total_grace(groups: &[GroupSpec]) -> Duration {
    groups.iter().map(|g| g.grace).sum()
}

/// The index of the group a pod of `priority` belongs to, as the kubelet
/// decides: the highest group whose priority is ≤ the pod's; below the
/// lowest group → the lowest; above the highest → the highest.
/// `groups` must be sorted and non-empty.
pub fn group_index(groups: &[GroupSpec], priority: i32) -> usize {
    let above = groups.partition_point(|g| g.priority <= priority);
    above.saturating_sub(1)
}

/// What the decisions need to know of a pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodFacts {
    /// `namespace/name`.
    pub key: String,
    pub priority: i32,
    pub termination_grace_seconds: Option<i64>,
    pub daemonset: bool,
    /// Mirror (static) pods: the kubelet owns them, the API cannot evict them.
    pub mirror: bool,
    /// Tolerates nodeguard's shutdown taint, so it means to stay.
    pub tolerates_shutdown: bool,
    /// Succeeded or Failed.
    pub terminal: bool,
}

/// Which kinds of pods the policy wants terminated too.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Include {
    pub daemonsets: bool,
    pub mirror: bool,
    pub tolerating: bool,
}

/// Why a pod is left alone, or `None` when it is to be terminated.
pub fn leave_alone(pod: &PodFacts, include: Include) -> Option<&'static str> {
    if pod.terminal {
        Some("terminal")
    } else if pod.mirror && !include.mirror {
        Some("mirror pod")
    } else if pod.daemonset && !include.daemonsets {
        Some("DaemonSet pod")
    } else if pod.tolerates_shutdown && !include.tolerating {
        Some("tolerates the shutdown taint")
    } else {
        None
    }
}

/// The grace a pod gets in its group: the group's window, or the pod's own
/// terminationGracePeriodSeconds when shorter.
pub fn pod_grace(group: &GroupSpec, pod: &PodFacts) -> i64 {
    let window = group.grace.as_secs() as i64;
    match pod.termination_grace_seconds {
        Some(own) if own >= 0 && own < window => own,
        _ => window,
    }
}

/// Pods in groups, lowest priority first. Pods left alone are dropped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Group {
    pub spec: GroupSpec,
    pub pods: Vec<PodFacts>,
}

pub fn group_pods(groups: &[GroupSpec], pods: &[PodFacts], include: Include) -> Vec<Group> {
    let mut out: Vec<Group> = groups
        .iter()
        .map(|spec| Group {
            spec: *spec,
            pods: Vec::new(),
        })
        .collect();
    if out.is_empty() {
        return out;
    }
    for pod in pods {
        if leave_alone(pod, include).is_none() {
            out[group_index(groups, pod.priority)]
                .pods
                .push(pod.clone());
        }
    }
    for g in &mut out {
        g.pods.sort_by(|a, b| a.key.cmp(&b.key));
    }
    out
}

/// When everything happens, as offsets from the start of the shutdown.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Timeline {
    /// The latest each group's window may end (cumulative), clipped to
    /// `release`. A group starts as soon as the previous one is done and
    /// gets its own grace from then, within this bound.
    pub group_ends: Vec<Duration>,
    /// When the inhibitor must be released at the latest: the end of the
    /// last window or logind's maximum delay minus the safety margin,
    /// whichever comes first.
    pub release: Duration,
}

pub fn timeline(
    groups: &[GroupSpec],
    inhibit_delay_max: Duration,
    safety_margin: Duration,
) -> Timeline {
    let limit = inhibit_delay_max.saturating_sub(safety_margin);
    let mut end = Duration::ZERO;
    let mut group_ends = Vec::with_capacity(groups.len());
    for g in groups {
        end += g.grace;
        group_ends.push(end.min(limit));
    }
    Timeline {
        release: end.min(limit),
        group_ends,
    }
}

/// When a pod whose eviction keeps being refused (a PodDisruptionBudget)
/// is escalated: after `percent` of its group's window, as an offset from
/// the window's start.
pub fn escalate_after(window: Duration, percent: u8) -> Duration {
    window.mul_f64(f64::from(percent.min(100)) / 100.0)
}

/// The grace of an escalating delete: what is left of the window, never
/// more than the pod's own grace, at least 0.
pub fn escalation_grace(remaining: Duration, pod_grace: i64) -> i64 {
    (remaining.as_secs() as i64).min(pod_grace).max(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(priority: i32, secs: u64) -> GroupSpec {
        GroupSpec {
            priority,
            grace: Duration::from_secs(secs),
        }
    }

    fn pod(key: &str, priority: i32) -> PodFacts {
        PodFacts {
            key: key.into(),
            priority,
            termination_grace_seconds: None,
            daemonset: false,
            mirror: false,
            tolerates_shutdown: false,
            terminal: false,
        }
    }

    #[test]
    fn migrate_like_the_kubelet() {
        let cases = [
            // (total, critical) -> (regular, critical)
            ((30, 10), Some((20, 10))),
            ((30, 0), Some((30, 0))),
            ((10, 30), Some((0, 10))),
            ((30, 30), Some((0, 30))),
            ((0, 10), None),
        ];
        for ((total, critical), want) in cases {
            let got = migrate(Duration::from_secs(total), Duration::from_secs(critical));
            match want {
                None => assert!(got.is_empty()),
                Some((r, c)) => assert_eq!(
                    got,
                    vec![g(0, r), g(SYSTEM_CRITICAL_PRIORITY, c)],
                    "{total}/{critical}"
                ),
            }
        }
    }

    #[test]
    fn group_boundaries_follow_the_kubelet() {
        let groups = sorted(vec![g(100_000, 30), g(0, 10), g(10_000, 20)]);
        assert_eq!(
            groups.iter().map(|g| g.priority).collect::<Vec<_>>(),
            [0, 10_000, 100_000]
        );
        let cases = [
            (-5, 0), // below the lowest: lowest
            (0, 0),  // exact: that group
            (1, 0),  // between: the lower group
            (9_999, 0),
            (10_000, 1), // boundary belongs to the group it names
            (10_001, 1),
            (99_999, 1),
            (100_000, 2),
            (i32::MAX, 2), // above the highest: highest
            (i32::MIN, 0),
        ];
        for (priority, want) in cases {
            assert_eq!(group_index(&groups, priority), want, "priority {priority}");
        }
        assert_eq!(group_index(&[g(5, 1)], -100), 0);
        assert_eq!(group_index(&[g(5, 1)], 100), 0);
    }

    #[test]
    fn per_pod_grace_is_the_shorter_of_window_and_own() {
        let group = g(0, 30);
        let mut p = pod("a/b", 0);
        assert_eq!(pod_grace(&group, &p), 30);
        p.termination_grace_seconds = Some(10);
        assert_eq!(pod_grace(&group, &p), 10);
        p.termination_grace_seconds = Some(30);
        assert_eq!(pod_grace(&group, &p), 30);
        p.termination_grace_seconds = Some(120);
        assert_eq!(pod_grace(&group, &p), 30);
        p.termination_grace_seconds = Some(0);
        assert_eq!(pod_grace(&group, &p), 0);
        p.termination_grace_seconds = Some(-1);
        assert_eq!(pod_grace(&group, &p), 30, "a negative value is ignored");
    }

    #[test]
    fn pods_left_alone_unless_the_policy_includes_them() {
        let base = pod("ns/p", 0);
        let ds = PodFacts {
            daemonset: true,
            ..base.clone()
        };
        let mirror = PodFacts {
            mirror: true,
            ..base.clone()
        };
        let tol = PodFacts {
            tolerates_shutdown: true,
            ..base.clone()
        };
        let done = PodFacts {
            terminal: true,
            ..base.clone()
        };
        let none = Include::default();
        assert_eq!(leave_alone(&base, none), None);
        assert_eq!(leave_alone(&ds, none), Some("DaemonSet pod"));
        assert_eq!(leave_alone(&mirror, none), Some("mirror pod"));
        assert_eq!(
            leave_alone(&tol, none),
            Some("tolerates the shutdown taint")
        );
        assert_eq!(leave_alone(&done, none), Some("terminal"));
        let all = Include {
            daemonsets: true,
            mirror: true,
            tolerating: true,
        };
        for p in [&ds, &mirror, &tol] {
            assert_eq!(leave_alone(p, all), None);
        }
        assert_eq!(
            leave_alone(&done, all),
            Some("terminal"),
            "terminal pods are never touched"
        );
    }

    #[test]
    fn grouping_puts_each_pod_in_one_group_sorted() {
        let groups = sorted(vec![g(0, 10), g(1000, 20)]);
        let pods = vec![
            pod("ns/z-low", 0),
            pod("ns/a-low", -10),
            pod("ns/high", 5000),
            PodFacts {
                daemonset: true,
                ..pod("ns/ds", 0)
            },
        ];
        let out = group_pods(&groups, &pods, Include::default());
        let keys: Vec<Vec<&str>> = out
            .iter()
            .map(|g| g.pods.iter().map(|p| p.key.as_str()).collect())
            .collect();
        assert_eq!(keys, vec![vec!["ns/a-low", "ns/z-low"], vec!["ns/high"]]);
        assert!(group_pods(&[], &pods, Include::default()).is_empty());
    }

    #[test]
    fn timeline_with_and_without_a_short_inhibit_delay() {
        let groups = [g(0, 10), g(1000, 20), g(2000, 5)];
        let t = timeline(&groups, Duration::from_secs(60), Duration::from_secs(2));
        assert_eq!(t.group_ends, [10, 30, 35].map(Duration::from_secs).to_vec());
        assert_eq!(t.release, Duration::from_secs(35));
        // logind allows only 25 s: everything is clipped to 23 s.
        let t = timeline(&groups, Duration::from_secs(25), Duration::from_secs(2));
        assert_eq!(t.group_ends, [10, 23, 23].map(Duration::from_secs).to_vec());
        assert_eq!(t.release, Duration::from_secs(23));
        // A margin larger than the delay: release at once.
        let t = timeline(&groups, Duration::from_secs(1), Duration::from_secs(2));
        assert_eq!(t.release, Duration::ZERO);
        assert_eq!(total_grace(&groups), Duration::from_secs(35));
    }

    #[test]
    fn escalation_timing_and_grace() {
        assert_eq!(
            escalate_after(Duration::from_secs(20), 50),
            Duration::from_secs(10)
        );
        assert_eq!(
            escalate_after(Duration::from_secs(20), 100),
            Duration::from_secs(20)
        );
        assert_eq!(
            escalate_after(Duration::from_secs(20), 200),
            Duration::from_secs(20)
        );
        assert_eq!(escalation_grace(Duration::from_secs(9), 30), 9);
        assert_eq!(escalation_grace(Duration::from_secs(9), 3), 3);
        assert_eq!(escalation_grace(Duration::from_millis(400), 3), 0);
    }
}
