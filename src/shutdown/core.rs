//! Decision core of graceful shutdown: priority groups with the kubelet's
//! boundary rules, per-pod grace, which pods to leave alone, the timeline
//! (group windows within logind's limit, escalation points, when to release
//! the inhibitor), each pod's next step, and what the conditions say.

use std::time::Duration;

use crate::report::{Desired, Status};

/// The taint nodeguard puts on a node that is shutting down.
pub const TAINT_KEY: &str = crate::policy::SHUTDOWN_TAINT_KEY;
pub const TAINT_VALUE: &str = "shutting-down";
pub const TAINT_EFFECT: &str = "NoSchedule";

/// The priority of `system-cluster-critical`/`system-node-critical` pods'
/// lower bound (`SystemCriticalPriority` in Kubernetes).
pub const SYSTEM_CRITICAL_PRIORITY: i32 = 2_000_000_000;

/// One priority group: pods with priority ≥ `priority` (and below the next
/// group's) get `grace` to terminate, in order from lowest priority.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
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
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
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

/// The grace a pod gets: its group's window in this shutdown (to the
/// nearest second: a window opens a few milliseconds after its slot), or
/// the pod's own terminationGracePeriodSeconds when shorter.
///
/// Never 0 unless the pod itself asks for 0: a grace of 0 is a force-kill
/// (the API server removes the object at once). A group whose window is
/// under [`MIN_GROUP_WINDOW`] is skipped instead of evicted.
pub fn pod_grace(window: Duration, pod: &PodFacts) -> i64 {
    let window = ((window + Duration::from_millis(500)).as_secs() as i64).max(1);
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

/// The plan of one shutdown, as offsets from its start.
///
/// logind lets a shutdown wait at most `InhibitDelayMaxSec`; nodeguard
/// releases its inhibitor the safety margin before that: the *limit*. When
/// the groups that have pods need more than the limit, the time is handed
/// out from the highest-priority group down, so the lowest-priority groups
/// are shortened first (to nothing, if need be) and the most critical pods
/// keep their full grace. Groups without pods reserve no time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Timeline {
    /// The groups, sorted, with their configured grace.
    pub groups: Vec<GroupSpec>,
    /// The time reserved for each group: its grace, shortened when the
    /// limit is short; zero for a group without pods.
    pub windows: Vec<Duration>,
    /// The latest each group's window may end: the reserved windows laid
    /// end to end. A group starts as soon as the previous one is done and
    /// gets its grace from then, but never past this point, so it never
    /// takes time reserved for the groups after it.
    pub group_ends: Vec<Duration>,
    /// When the inhibitor is released at the latest: the end of the last
    /// window, never past the limit.
    pub release: Duration,
}

/// Plans a shutdown that is `elapsed` into its time (zero, or how long it
/// ran before the agent restarted). `occupied[i]`: group `i` has pods to
/// terminate. `groups` must be sorted.
pub fn timeline(
    groups: &[GroupSpec],
    occupied: &[bool],
    limit: Duration,
    elapsed: Duration,
) -> Timeline {
    let mut budget = limit.saturating_sub(elapsed);
    let mut windows = vec![Duration::ZERO; groups.len()];
    for (i, g) in groups.iter().enumerate().rev() {
        if occupied.get(i).copied().unwrap_or(false) {
            windows[i] = g.grace.min(budget);
            budget -= windows[i];
        }
    }
    let mut end = elapsed;
    let group_ends: Vec<Duration> = windows
        .iter()
        .map(|w| {
            end += *w;
            end
        })
        .collect();
    Timeline {
        groups: groups.to_vec(),
        windows,
        group_ends,
        release: end,
    }
}

impl Timeline {
    /// The window of group `i` when it opens `opens_at` into the shutdown:
    /// its grace, but never past its latest end.
    pub fn window(&self, i: usize, opens_at: Duration) -> Duration {
        self.groups[i]
            .grace
            .min(self.group_ends[i].saturating_sub(opens_at))
    }
}

/// What a shutdown would look like with the inhibit delay logind allows:
/// the plan with pods in every group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Readiness {
    /// logind's `InhibitDelayMaxSec`.
    pub allowed: Duration,
    pub safety_margin: Duration,
    pub plan: Timeline,
}

impl Readiness {
    pub fn new(groups: &[GroupSpec], allowed: Duration, safety_margin: Duration) -> Self {
        let occupied = vec![true; groups.len()];
        Readiness {
            allowed,
            safety_margin,
            plan: timeline(
                groups,
                &occupied,
                allowed.saturating_sub(safety_margin),
                Duration::ZERO,
            ),
        }
    }

    /// The inhibit delay the policy needs: every group's grace plus the
    /// margin.
    pub fn needed(&self) -> Duration {
        total_grace(&self.plan.groups) + self.safety_margin
    }

    /// logind allows less than the policy needs.
    pub fn short(&self) -> bool {
        self.allowed < self.needed()
    }

    /// "0: 4s of 10s, 2000000000: 6s", lowest priority first.
    fn windows_text(&self) -> String {
        self.plan
            .groups
            .iter()
            .zip(&self.plan.windows)
            .map(|(g, w)| {
                if *w == g.grace {
                    format!("{}: {}s", g.priority, w.as_secs())
                } else {
                    format!("{}: {}s of {}s", g.priority, w.as_secs(), g.grace.as_secs())
                }
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The longest a restarted agent counts as already spent of a shutdown: a
/// record older than this is from a shutdown that never ended.
pub const RESUME_LIMIT: Duration = Duration::from_secs(24 * 3600);

/// How far into a shutdown a restarted agent is, from its record: by the
/// monotonic clock on the same boot (a wall-clock step between the start
/// and the restart changes nothing), else by the wall clock (a record
/// written before the monotonic time was kept); at most [`RESUME_LIMIT`].
pub fn resumed_after(
    started_monotonic_ms: Option<u64>,
    started_at: Option<jiff::Timestamp>,
    same_boot: bool,
    now_monotonic: Duration,
    now_wall: jiff::Timestamp,
) -> Duration {
    let elapsed = match (started_monotonic_ms, started_at) {
        (Some(ms), _) if same_boot => now_monotonic.saturating_sub(Duration::from_millis(ms)),
        (_, Some(s)) => now_wall.duration_since(s).try_into().unwrap_or_default(),
        _ => Duration::ZERO,
    };
    elapsed.min(RESUME_LIMIT)
}

/// Since when a pod's deletion counts as this shutdown's doing (a previous
/// process of the agent evicted it): a second before the recorded start,
/// or, for a process killed before its first record, logind's whole delay
/// back from now.
pub fn terminating_cutoff(
    started_at: Option<jiff::Timestamp>,
    now_wall: jiff::Timestamp,
    delay_max: Duration,
) -> jiff::Timestamp {
    match started_at {
        Some(t) => t - jiff::SignedDuration::from_secs(1),
        None => now_wall - jiff::SignedDuration::try_from(delay_max).unwrap_or_default(),
    }
}

/// How long an escalating delete has at least to reach the API server: a
/// refused eviction escalates at the latest this long before its window
/// closes, since no API call of a group outlives the group's window.
pub const CALL_HEADROOM: Duration = Duration::from_secs(1);

/// When a pod whose eviction keeps being refused (a PodDisruptionBudget)
/// is escalated: after `percent` of its group's window, as an offset from
/// the window's start, and at the latest [`CALL_HEADROOM`] before its end.
pub fn escalate_after(window: Duration, percent: u8) -> Duration {
    window
        .mul_f64(f64::from(percent.min(100)) / 100.0)
        .min(window.saturating_sub(CALL_HEADROOM))
}

/// The grace of an escalating delete: what is left of the window, never
/// more than the pod's own grace, and at least 1 s unless the pod's own
/// grace is 0 (a delete with grace 0 is a force-kill).
pub fn escalation_grace(remaining: Duration, pod_grace: i64) -> i64 {
    let floor = pod_grace.clamp(0, 1);
    (remaining.as_secs() as i64).min(pod_grace).max(floor)
}

/// A group with less time than this is skipped (Event
/// `ShutdownGroupSkipped`): there is no whole second to give its pods.
pub const MIN_GROUP_WINDOW: Duration = Duration::from_secs(1);

/// Whether a group's window is too short to evict its pods gracefully.
pub fn too_short(window: Duration) -> bool {
    window < MIN_GROUP_WINDOW
}

/// One pod's termination within its group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PodPlan {
    /// The group's window in this shutdown.
    pub window: Duration,
    /// When a refused eviction turns into a delete; `None`: never.
    pub escalate_at: Option<Duration>,
    /// The grace asked for in the eviction.
    pub grace: i64,
}

impl PodPlan {
    pub fn new(window: Duration, pod: &PodFacts, escalate: bool, percent: u8) -> Self {
        PodPlan {
            window,
            escalate_at: escalate.then(|| escalate_after(window, percent)),
            grace: pod_grace(window, pod),
        }
    }
}

/// What the last API call for a pod came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The eviction was accepted.
    Evicted,
    /// The pod no longer exists.
    Gone,
    /// A PodDisruptionBudget refused the eviction.
    Blocked,
    /// The escalating delete was accepted.
    Deleted,
    /// The call failed, or did not answer before the window closed.
    Failed,
}

/// How a pod's termination ended; all but `Gone` are the `outcome` label
/// of `nodeguard_shutdown_pods_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodEnd {
    Evicted,
    Gone,
    Escalated,
    /// Still refused when the window closed, and escalation is off.
    Blocked,
    /// The API failed or did not answer until the window closed.
    Failed,
}

impl PodEnd {
    pub fn label(self) -> &'static str {
        match self {
            PodEnd::Evicted => "evicted",
            PodEnd::Gone => "gone",
            PodEnd::Escalated => "escalated",
            PodEnd::Blocked => "blocked",
            PodEnd::Failed => "failed",
        }
    }
}

/// The executor's next step for a pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodStep {
    End(PodEnd),
    /// Delete the pod with this grace.
    Escalate {
        grace: i64,
    },
    /// Ask for the eviction again this far into the window.
    Retry {
        at: Duration,
    },
}

/// The wait before retry number `attempt + 1`: 250 ms, doubling, at most 2 s.
pub fn retry_backoff(attempt: u32) -> Duration {
    Duration::from_millis(250u64 << attempt.min(3)).min(Duration::from_secs(2))
}

/// What to do after `outcome`, `now` into the group's window, when
/// `attempt` retries were made before. No call is planned at or past the
/// window's end: what has not worked by then ends there.
pub fn next(plan: &PodPlan, now: Duration, outcome: Outcome, attempt: u32) -> PodStep {
    let give_up = |outcome| match outcome {
        Outcome::Blocked if plan.escalate_at.is_none() => PodEnd::Blocked,
        _ => PodEnd::Failed,
    };
    match outcome {
        Outcome::Evicted => return PodStep::End(PodEnd::Evicted),
        Outcome::Gone => return PodStep::End(PodEnd::Gone),
        Outcome::Deleted => return PodStep::End(PodEnd::Escalated),
        Outcome::Blocked | Outcome::Failed if now >= plan.window => {
            return PodStep::End(give_up(outcome));
        }
        Outcome::Blocked if plan.escalate_at.is_some_and(|at| now >= at) => {
            return PodStep::Escalate {
                grace: escalation_grace(plan.window - now, plan.grace),
            };
        }
        Outcome::Blocked | Outcome::Failed => {}
    }
    let mut at = now + retry_backoff(attempt);
    if let Some(e) = plan.escalate_at.filter(|e| *e > now) {
        at = at.min(e);
    }
    if at >= plan.window {
        PodStep::End(give_up(outcome))
    } else {
        PodStep::Retry { at }
    }
}

/// What the taint came to, for the reports after a shutdown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaintAfter {
    /// nodeguard did not add it (someone else's, or never set).
    NotOurs,
    Removed,
    /// nodeguard added it and could not remove it.
    Left,
}

/// Whether nodeguard holds its inhibitor after a cancelled shutdown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AfterCancel {
    Held,
    /// The policy turned graceful shutdown off during the shutdown.
    PolicyOff,
    /// logind refused; nodeguard reconnects.
    Reconnecting,
}

/// Who cancelled a shutdown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CancelCause {
    /// logind said `PrepareForShutdown(false)` (or no longer prepared for
    /// it when the agent started).
    Logind,
    /// systemd-logind restarted during the delay: the new instance does not
    /// know the shutdown the old one was delaying, so the host stays up.
    LogindRestarted,
}

/// The last shutdown, as the condition reports it until the next one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LastShutdown {
    Cancelled {
        cause: CancelCause,
        taint: TaintAfter,
        inhibitor: AfterCancel,
    },
    /// The node is back after a shutdown of an earlier boot.
    Rebooted {
        started_at: String,
        /// The start is when an agent found the shutdown under way, not
        /// when it began (`StartedBy::Found`): `took` is a lower bound.
        found: bool,
        /// `None`: it did not finish before the machine went down.
        took: Option<Duration>,
        taint: TaintAfter,
    },
}

/// Where the shutdown manager is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Phase {
    /// The policy is not known yet, or logind cannot be reached: nothing
    /// new to say about a shutdown.
    Waiting,
    /// The policy has no shutdown section: the condition is not nodeguard's.
    Off,
    /// The inhibitor is held and no shutdown runs.
    Armed(Readiness),
    /// A shutdown runs (or ran, and the host is going down).
    Running { groups: usize, release: Duration },
}

/// What to do with the `GracefulShutdown` condition.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConditionUpdate {
    Keep,
    Remove,
    Set(Desired),
    /// Set, written without waiting for the write interval.
    Urgent(Desired),
}

fn desired(status: Status, reason: &str, message: String) -> Desired {
    Desired {
        status,
        reason: reason.into(),
        message,
    }
}

fn taint_text(taint: TaintAfter) -> String {
    match taint {
        TaintAfter::NotOurs => String::new(),
        TaintAfter::Removed => "; nodeguard removed its shutdown taint".into(),
        TaintAfter::Left => format!(
            "; nodeguard could not remove its shutdown taint {} yet and tries again every 10s",
            TAINT_KEY
        ),
    }
}

/// The message of a cancelled shutdown (the condition's and the Event's).
pub fn cancel_message(cause: CancelCause, taint: TaintAfter, inhibitor: AfterCancel) -> String {
    let then = match inhibitor {
        AfterCancel::Held => "nodeguard holds its inhibitor again",
        AfterCancel::PolicyOff => {
            "graceful shutdown is off by policy now, so nodeguard does not take its inhibitor again"
        }
        AfterCancel::Reconnecting => {
            "nodeguard cannot take its inhibitor again yet and reconnects to systemd-logind"
        }
    };
    let why = match cause {
        CancelCause::Logind => "",
        CancelCause::LogindRestarted => {
            ": systemd-logind restarted during it and no longer shuts the host down"
        }
    };
    format!(
        "The shutdown was cancelled{why}{}; {then}.",
        taint_text(taint)
    )
}

/// The message of the first start after a reboot (the condition's and the
/// Event's).
pub fn rebooted_message(
    started_at: &str,
    found: bool,
    took: Option<Duration>,
    taint: TaintAfter,
) -> String {
    let (start, took) = match (found, took) {
        (false, Some(d)) => (
            format!("that started at {started_at}"),
            format!("took {}s", d.as_secs()),
        ),
        (true, Some(d)) => (
            format!("found under way at {started_at} (its start was not recorded)"),
            format!("took at least {}s", d.as_secs()),
        ),
        (false, None) => (
            format!("that started at {started_at}"),
            "did not finish before the machine went down".into(),
        ),
        (true, None) => (
            format!("found under way at {started_at} (its start was not recorded)"),
            "did not finish before the machine went down".into(),
        ),
    };
    format!(
        "The node is back after a shutdown {start} and {took}{}.",
        taint_text(taint)
    )
}

/// The `GracefulShutdown` condition for the manager's phase and the last
/// shutdown. A shutdown in progress wins; then the last shutdown's outcome
/// stays until the next one (or until the policy turns shutdown off); an
/// armed node without history reports `NoShutdown`, or
/// `InhibitDelayTooShort` when logind allows less than the policy needs.
pub fn condition(phase: &Phase, last: Option<&LastShutdown>) -> ConditionUpdate {
    match (phase, last) {
        (Phase::Off, _) => ConditionUpdate::Remove,
        (Phase::Running { groups, release }, _) => ConditionUpdate::Urgent(desired(
            Status::True,
            "ShutdownInProgress",
            format!(
                "The host is shutting down; nodeguard is moving pods off in {groups} priority group(s) and releases the shutdown in at most {}s.",
                release.as_secs()
            ),
        )),
        (
            _,
            Some(LastShutdown::Cancelled {
                cause,
                taint,
                inhibitor,
            }),
        ) => ConditionUpdate::Urgent(desired(
            Status::False,
            "ShutdownCancelled",
            cancel_message(*cause, *taint, *inhibitor),
        )),
        (
            _,
            Some(LastShutdown::Rebooted {
                started_at,
                found,
                took,
                taint,
            }),
        ) => ConditionUpdate::Set(desired(
            Status::False,
            "NodeRebooted",
            rebooted_message(started_at, *found, *took, *taint),
        )),
        (Phase::Armed(r), None) if r.short() => ConditionUpdate::Set(desired(
            Status::False,
            "InhibitDelayTooShort",
            format!(
                "No shutdown in progress. logind allows {}s of delay but the policy needs {}s: a shutdown would get {}s, lowest-priority groups shortened first (priority: window {}).",
                r.allowed.as_secs(),
                r.needed().as_secs(),
                r.plan.release.as_secs(),
                r.windows_text()
            ),
        )),
        (Phase::Armed(_), None) => ConditionUpdate::Set(desired(
            Status::False,
            "NoShutdown",
            "No shutdown in progress.".into(),
        )),
        (Phase::Waiting, None) => ConditionUpdate::Keep,
    }
}

/// `GracefulShutdownUnavailable` while the inhibitor is held: `False`, or
/// `True` (`InhibitDelayTooShort`) when logind allows less than the policy
/// needs. `drop_in_dir`: where nodeguard wrote its drop-in (`None`:
/// disabled).
pub fn availability(r: &Readiness, drop_in_dir: Option<&std::path::Path>) -> Desired {
    if !r.short() {
        return desired(
            Status::False,
            "InhibitorHeld",
            format!(
                "nodeguard holds a logind delay inhibitor: on shutdown it moves pods off in {} priority group(s) within {}s (logind allows {}s).",
                r.plan.groups.len(),
                total_grace(&r.plan.groups).as_secs(),
                r.allowed.as_secs()
            ),
        );
    }
    desired(
        Status::True,
        "InhibitDelayTooShort",
        format!(
            "logind allows shutdown to be delayed {}s but the policy needs {}s ({}); nodeguard will release its inhibitor after {}s and shortens the lowest-priority groups first (priority: window {}). Raise InhibitDelayMaxSec= in /etc/systemd/logind.conf.d/ (or mount it for nodeguard's drop-in) and restart systemd-logind.",
            r.allowed.as_secs(),
            r.needed().as_secs(),
            match drop_in_dir {
                Some(d) => format!("the drop-in in {} did not take effect", d.display()),
                None => "writing a drop-in is disabled".into(),
            },
            r.plan.release.as_secs(),
            r.windows_text()
        ),
    )
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
        // (window in ms, terminationGracePeriodSeconds) -> grace asked for
        let cases = [
            (30_000, None, 30),
            (30_000, Some(10), 10),
            (30_000, Some(30), 30),
            (30_000, Some(120), 30),
            (30_000, Some(0), 0),
            (30_000, Some(-1), 30), // a negative value is ignored
            (3_998, None, 4),       // to the nearest second
            (4_400, Some(30), 4),   // clipped to a shortened window
            (0, Some(30), 1),       // never 0 (a force-kill); such a group is skipped
            (290, None, 1),         // a fractional window rounding to 0
            (290, Some(0), 0),      // the pod's own 0 stands
        ];
        for (window_ms, own, want) in cases {
            let mut p = pod("a/b", 0);
            p.termination_grace_seconds = own;
            assert_eq!(
                pod_grace(Duration::from_millis(window_ms), &p),
                want,
                "window {window_ms} ms, own {own:?}"
            );
        }
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

    fn secs(v: &[u64]) -> Vec<Duration> {
        v.iter().map(|s| Duration::from_secs(*s)).collect()
    }

    #[test]
    fn windows_are_handed_out_from_the_highest_priority_group_down() {
        let groups = [g(0, 10), g(1000, 20), g(2000, 5)];
        // (occupied, limit, elapsed) -> (windows, latest ends, release)
        type Case = (
            &'static [bool],
            u64,
            u64,
            &'static [u64],
            &'static [u64],
            u64,
        );
        let cases: [Case; 9] = [
            // Enough time: every group gets its grace.
            (&[true, true, true], 58, 0, &[10, 20, 5], &[10, 30, 35], 35),
            (&[true, true, true], 35, 0, &[10, 20, 5], &[10, 30, 35], 35),
            // logind allows 23 s: the critical group keeps 5, the middle
            // one 18, the lowest nothing.
            (&[true, true, true], 23, 0, &[0, 18, 5], &[0, 18, 23], 23),
            (&[true, true, true], 30, 0, &[5, 20, 5], &[5, 25, 30], 30),
            (&[true, true, true], 3, 0, &[0, 0, 3], &[0, 0, 3], 3),
            // A margin larger than the delay: nothing, release at once.
            (&[true, true, true], 0, 0, &[0, 0, 0], &[0, 0, 0], 0),
            // Groups without pods reserve nothing: the lowest group gets
            // what the empty middle one would have taken.
            (&[true, false, true], 23, 0, &[10, 0, 5], &[10, 10, 15], 15),
            (&[false, false, false], 23, 0, &[0, 0, 0], &[0, 0, 0], 0),
            // Resumed 4 s in with the lowest group done: 19 s left.
            (&[false, true, true], 23, 4, &[0, 14, 5], &[4, 18, 23], 23),
        ];
        for (occupied, limit, elapsed, windows, ends, release) in cases {
            let t = timeline(
                &groups,
                occupied,
                Duration::from_secs(limit),
                Duration::from_secs(elapsed),
            );
            let what = format!("{occupied:?} limit {limit} elapsed {elapsed}");
            assert_eq!(t.windows, secs(windows), "windows, {what}");
            assert_eq!(t.group_ends, secs(ends), "ends, {what}");
            assert_eq!(t.release, Duration::from_secs(release), "release, {what}");
        }
    }

    #[test]
    fn a_group_opening_early_uses_the_slack_but_not_the_time_reserved_after_it() {
        let groups = [g(0, 10), g(1000, 20), g(2000, 5)];
        let t = timeline(
            &groups,
            &[true, true, true],
            Duration::from_secs(23),
            Duration::ZERO,
        );
        // (group, opens at ms) -> window ms
        let cases = [
            (0, 0, 0),          // shortened to nothing
            (1, 0, 18_000),     // opens at once: up to its latest end
            (1, 2_500, 15_500), // opens late: what is left before 18 s
            (2, 18_000, 5_000), // the critical group keeps its 5 s
            (2, 3_000, 5_000),  // opening early never gives more than the grace
            (2, 21_000, 2_000), // a late start is cut at the release
            (2, 30_000, 0),
        ];
        for (i, opens_ms, want_ms) in cases {
            assert_eq!(
                t.window(i, Duration::from_millis(opens_ms)),
                Duration::from_millis(want_ms),
                "group {i} opening at {opens_ms} ms"
            );
        }
        let full = timeline(
            &groups,
            &[true, true, true],
            Duration::from_secs(60),
            Duration::ZERO,
        );
        assert_eq!(
            full.window(1, Duration::from_secs(3)),
            Duration::from_secs(20)
        );
        assert_eq!(total_grace(&groups), Duration::from_secs(35));
    }

    #[test]
    fn escalation_timing_and_grace() {
        // (window s, percent) -> escalate after (ms)
        let cases = [
            (20, 50, 10_000),
            (20, 10, 2_000),
            (20, 100, 19_000), // at the latest 1 s before the window closes
            (20, 200, 19_000),
            (1, 50, 0),
            (0, 50, 0),
        ];
        for (window, percent, want_ms) in cases {
            assert_eq!(
                escalate_after(Duration::from_secs(window), percent),
                Duration::from_millis(want_ms),
                "{window} s at {percent} %"
            );
        }
        assert_eq!(escalation_grace(Duration::from_secs(9), 30), 9);
        assert_eq!(escalation_grace(Duration::from_secs(9), 3), 3);
        // Less than a second left: still a graceful second, never 0.
        assert_eq!(escalation_grace(Duration::from_millis(400), 3), 1);
        assert_eq!(escalation_grace(Duration::ZERO, 30), 1);
        assert_eq!(escalation_grace(Duration::from_millis(400), 0), 0);
        for (ms, want) in [
            (0, true),
            (290, true),
            (999, true),
            (1000, false),
            (5000, false),
        ] {
            assert_eq!(too_short(Duration::from_millis(ms)), want, "{ms} ms");
        }
    }

    #[test]
    fn each_pods_next_step() {
        let ms = Duration::from_millis;
        let escalating = PodPlan {
            window: ms(20_000),
            escalate_at: Some(ms(10_000)),
            grace: 30,
        };
        let never = PodPlan {
            escalate_at: None,
            ..escalating
        };
        use Outcome::*;
        use PodStep::*;
        // (plan, now ms, outcome, earlier retries) -> step
        let cases = [
            (escalating, 0, Evicted, 0, End(PodEnd::Evicted)),
            (escalating, 0, Gone, 0, End(PodEnd::Gone)),
            (escalating, 12_000, Deleted, 5, End(PodEnd::Escalated)),
            // Refused: retried with a growing backoff ...
            (escalating, 0, Blocked, 0, Retry { at: ms(250) }),
            (escalating, 1_000, Blocked, 1, Retry { at: ms(1_500) }),
            (escalating, 1_000, Blocked, 2, Retry { at: ms(2_000) }),
            (escalating, 1_000, Blocked, 9, Retry { at: ms(3_000) }),
            // ... never past the escalation point ...
            (escalating, 9_900, Blocked, 9, Retry { at: ms(10_000) }),
            // ... where it turns into a delete with what is left.
            (escalating, 10_000, Blocked, 9, Escalate { grace: 10 }),
            (escalating, 17_500, Blocked, 9, Escalate { grace: 2 }),
            // Without escalation it is retried until the window closes.
            (never, 10_000, Blocked, 9, Retry { at: ms(12_000) }),
            (never, 18_500, Blocked, 9, End(PodEnd::Blocked)),
            (never, 20_000, Blocked, 9, End(PodEnd::Blocked)),
            // Errors (and calls that got no answer) likewise.
            (escalating, 9_000, Failed, 3, Retry { at: ms(10_000) }),
            (escalating, 12_000, Failed, 3, Retry { at: ms(14_000) }),
            (escalating, 19_000, Failed, 3, End(PodEnd::Failed)),
            (escalating, 20_000, Failed, 0, End(PodEnd::Failed)),
            // A refusal once the window is over: nothing more is tried.
            (escalating, 20_000, Blocked, 0, End(PodEnd::Failed)),
        ];
        for (plan, now, outcome, attempt, want) in cases {
            assert_eq!(
                next(&plan, ms(now), outcome, attempt),
                want,
                "{outcome:?} at {now} ms after {attempt} retries, escalating: {}",
                plan.escalate_at.is_some()
            );
        }
        let p = PodPlan::new(ms(20_000), &pod("a/b", 0), true, 50);
        assert_eq!(
            p,
            PodPlan {
                window: ms(20_000),
                escalate_at: Some(ms(10_000)),
                grace: 20
            }
        );
        assert_eq!(
            PodPlan::new(ms(20_000), &pod("a/b", 0), false, 50).escalate_at,
            None
        );
    }

    fn d(status: Status, reason: &str, message: &str) -> Desired {
        Desired {
            status,
            reason: reason.into(),
            message: message.into(),
        }
    }

    #[test]
    fn the_graceful_shutdown_condition_for_each_state() {
        let groups = [g(0, 10), g(2_000_000_000, 20)];
        let ok = Phase::Armed(Readiness::new(
            &groups,
            Duration::from_secs(60),
            Duration::from_secs(2),
        ));
        let short = Phase::Armed(Readiness::new(
            &groups,
            Duration::from_secs(24),
            Duration::from_secs(2),
        ));
        let running = Phase::Running {
            groups: 2,
            release: Duration::from_secs(22),
        };
        let cancelled = LastShutdown::Cancelled {
            cause: CancelCause::Logind,
            taint: TaintAfter::Removed,
            inhibitor: AfterCancel::Held,
        };
        let rebooted = LastShutdown::Rebooted {
            started_at: "2027-01-15T08:00:00Z".into(),
            found: false,
            took: Some(Duration::from_secs(17)),
            taint: TaintAfter::Removed,
        };
        use ConditionUpdate::*;
        let cases = [
            (Phase::Off, None, Remove),
            (Phase::Off, Some(&rebooted), Remove),
            (Phase::Waiting, None, Keep),
            (
                ok.clone(),
                None,
                Set(d(Status::False, "NoShutdown", "No shutdown in progress.")),
            ),
            (
                short.clone(),
                None,
                Set(d(
                    Status::False,
                    "InhibitDelayTooShort",
                    "No shutdown in progress. logind allows 24s of delay but the policy needs 32s: a shutdown would get 22s, lowest-priority groups shortened first (priority: window 0: 2s of 10s, 2000000000: 20s).",
                )),
            ),
            (
                running.clone(),
                Some(&cancelled),
                Urgent(d(
                    Status::True,
                    "ShutdownInProgress",
                    "The host is shutting down; nodeguard is moving pods off in 2 priority group(s) and releases the shutdown in at most 22s.",
                )),
            ),
            (
                ok.clone(),
                Some(&cancelled),
                Urgent(d(
                    Status::False,
                    "ShutdownCancelled",
                    "The shutdown was cancelled; nodeguard removed its shutdown taint; nodeguard holds its inhibitor again.",
                )),
            ),
            (
                short.clone(),
                Some(&rebooted),
                Set(d(
                    Status::False,
                    "NodeRebooted",
                    "The node is back after a shutdown that started at 2027-01-15T08:00:00Z and took 17s; nodeguard removed its shutdown taint.",
                )),
            ),
            (
                Phase::Waiting,
                Some(&rebooted),
                Set(d(
                    Status::False,
                    "NodeRebooted",
                    "The node is back after a shutdown that started at 2027-01-15T08:00:00Z and took 17s; nodeguard removed its shutdown taint.",
                )),
            ),
        ];
        for (phase, last, want) in cases {
            assert_eq!(condition(&phase, last), want, "{phase:?} after {last:?}");
        }
    }

    #[test]
    fn messages_after_a_shutdown() {
        let cases = [
            (
                CancelCause::Logind,
                TaintAfter::NotOurs,
                AfterCancel::Held,
                "The shutdown was cancelled; nodeguard holds its inhibitor again.",
            ),
            (
                CancelCause::LogindRestarted,
                TaintAfter::Removed,
                AfterCancel::Held,
                "The shutdown was cancelled: systemd-logind restarted during it and no longer shuts the host down; nodeguard removed its shutdown taint; nodeguard holds its inhibitor again.",
            ),
            (
                CancelCause::Logind,
                TaintAfter::Removed,
                AfterCancel::PolicyOff,
                "The shutdown was cancelled; nodeguard removed its shutdown taint; graceful shutdown is off by policy now, so nodeguard does not take its inhibitor again.",
            ),
            (
                CancelCause::Logind,
                TaintAfter::Left,
                AfterCancel::Reconnecting,
                "The shutdown was cancelled; nodeguard could not remove its shutdown taint nodeguard.io/shutdown yet and tries again every 10s; nodeguard cannot take its inhibitor again yet and reconnects to systemd-logind.",
            ),
        ];
        for (cause, taint, inhibitor, want) in cases {
            assert_eq!(cancel_message(cause, taint, inhibitor), want);
        }
        assert_eq!(
            rebooted_message("T", false, None, TaintAfter::NotOurs),
            "The node is back after a shutdown that started at T and did not finish before the machine went down."
        );
        // A start found under way: not claimed, and its time a lower bound.
        assert_eq!(
            rebooted_message(
                "T",
                true,
                Some(Duration::from_secs(12)),
                TaintAfter::NotOurs
            ),
            "The node is back after a shutdown found under way at T (its start was not recorded) and took at least 12s."
        );
        assert_eq!(
            rebooted_message("T", true, None, TaintAfter::NotOurs),
            "The node is back after a shutdown found under way at T (its start was not recorded) and did not finish before the machine went down."
        );
    }

    #[test]
    fn unavailable_while_armed() {
        let groups = [g(0, 10), g(1000, 20)];
        let ok = Readiness::new(&groups, Duration::from_secs(32), Duration::from_secs(2));
        assert_eq!(
            availability(&ok, None),
            d(
                Status::False,
                "InhibitorHeld",
                "nodeguard holds a logind delay inhibitor: on shutdown it moves pods off in 2 priority group(s) within 30s (logind allows 32s)."
            )
        );
        let short = Readiness::new(&groups, Duration::from_secs(12), Duration::from_secs(2));
        assert_eq!(
            availability(
                &short,
                Some(std::path::Path::new("/etc/systemd/logind.conf.d"))
            ),
            d(
                Status::True,
                "InhibitDelayTooShort",
                "logind allows shutdown to be delayed 12s but the policy needs 32s (the drop-in in /etc/systemd/logind.conf.d did not take effect); nodeguard will release its inhibitor after 10s and shortens the lowest-priority groups first (priority: window 0: 0s of 10s, 1000: 10s of 20s). Raise InhibitDelayMaxSec= in /etc/systemd/logind.conf.d/ (or mount it for nodeguard's drop-in) and restart systemd-logind."
            )
        );
        assert!(
            availability(&short, None)
                .message
                .contains("(writing a drop-in is disabled)")
        );
    }

    #[test]
    fn a_restarted_agent_counts_from_the_original_start() {
        let wall = |s: &str| -> jiff::Timestamp { s.parse().unwrap() };
        let now = wall("2030-01-01T00:01:00Z");
        let secs = Duration::from_secs;
        // (monotonic start ms, wall start, same boot, now monotonic) -> elapsed
        let cases = [
            // Same boot: the monotonic clock, whatever the wall clock says.
            (
                Some(5_000),
                Some(wall("2030-01-01T00:00:00Z")),
                true,
                secs(35),
                secs(30),
            ),
            (
                Some(5_000),
                Some(wall("2029-12-31T00:00:00Z")),
                true,
                secs(35),
                secs(30),
            ),
            // Another boot: the monotonic time means nothing; the wall clock.
            (
                Some(5_000),
                Some(wall("2030-01-01T00:00:00Z")),
                false,
                secs(35),
                secs(60),
            ),
            // A record from before the monotonic time was kept.
            (
                None,
                Some(wall("2030-01-01T00:00:50Z")),
                true,
                secs(35),
                secs(10),
            ),
            // A wall start in the future (the clock stepped back): none.
            (
                None,
                Some(wall("2030-01-01T00:02:00Z")),
                true,
                secs(35),
                secs(0),
            ),
            // A monotonic start after now cannot be: none.
            (Some(90_000), None, true, secs(35), secs(0)),
            // Nothing recorded (killed before the first record).
            (None, None, true, secs(35), secs(0)),
            (Some(5_000), None, false, secs(35), secs(0)),
            // A record from a shutdown that never ended: capped.
            (
                None,
                Some(wall("2029-01-01T00:00:00Z")),
                true,
                secs(35),
                RESUME_LIMIT,
            ),
        ];
        for (i, (ms, at, same_boot, mono, want)) in cases.into_iter().enumerate() {
            assert_eq!(
                resumed_after(ms, at, same_boot, mono, now),
                want,
                "case {i}"
            );
        }
    }

    #[test]
    fn pods_terminating_since_the_shutdown_began() {
        let wall = |s: &str| -> jiff::Timestamp { s.parse().unwrap() };
        let now = wall("2030-01-01T00:01:00Z");
        assert_eq!(
            terminating_cutoff(
                Some(wall("2030-01-01T00:00:30Z")),
                now,
                Duration::from_secs(90)
            ),
            wall("2030-01-01T00:00:29Z"),
            "a second before the recorded start"
        );
        assert_eq!(
            terminating_cutoff(None, now, Duration::from_secs(90)),
            wall("2029-12-31T23:59:30Z"),
            "no record: logind's whole delay back"
        );
    }
}
