//! Decision core of a probe worker, with the kubelet prober's semantics:
//! thresholds, initial delay, on-hold after a liveness-style failure until
//! the target changes, startup gating, quiet success on deletion, stopping
//! on terminal targets, prober errors dropped. Also the manager's pure
//! decisions: when a result is written ([`should_write`]), when a worker
//! has started ([`started`], [`gate_open`]) and which pods get workers
//! ([`probes_pod`]).

use std::time::Duration;

/// A probe's verdict (or the published state of a worker).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProbeResult {
    Success,
    Failure,
    Unknown,
}

impl ProbeResult {
    pub fn as_str(self) -> &'static str {
        match self {
            ProbeResult::Success => "success",
            ProbeResult::Failure => "failure",
            ProbeResult::Unknown => "unknown",
        }
    }
}

/// How the result is used, as the kubelet's readiness/liveness/startup.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// Starts as Failure; keeps probing after failures.
    Readiness,
    /// Starts as Success; on a pod, after a published failure, holds until
    /// the target changes (a new container ID, pod IP or UID). On the node
    /// (nothing to restart) it keeps probing, as readiness does.
    Liveness,
    /// Starts as Unknown; gates the probes that name it; stops probing
    /// once successful. On a pod it holds after a published failure; on
    /// the node it keeps probing until its first success.
    Startup,
}

/// What a worker probes: the node cannot be replaced, a pod can (a
/// restarted container, a new pod IP or UID), which is what ends an
/// on-hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TargetKind {
    Node,
    Pod,
}

/// Where a worker's result goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Sink {
    /// A NodeCondition: it changes only when real results cross a
    /// threshold; until then what the Node says stands (it may have been
    /// carried over from before a restart).
    NodeCondition,
    /// A pod's readiness-gate condition: follows the published result,
    /// the role's initial value included, on a pod that does not carry the
    /// condition yet (a new pod starts not-ready). On a pod that carries
    /// it (written before an agent restart or a container restart), what
    /// it says stands until real results cross a threshold.
    ReadinessGate,
}

/// The result a worker has to write to its sink now, if any.
///
/// `published` is the worker's published result (initial values
/// included), `verdict` the last result that crossed its threshold on the
/// current target, `written` what the sink last accepted for the current
/// target. A failed write leaves `written` alone, so it is retried.
/// `carried`: the pod already carries the readiness-gate condition (only
/// read for [`Sink::ReadinessGate`]); before a verdict on the current target
/// what it says stands, so an agent restart does not replace a held False
/// with a Liveness probe's initial True.
pub fn should_write(
    sink: Sink,
    published: Option<ProbeResult>,
    verdict: Option<ProbeResult>,
    written: Option<ProbeResult>,
    carried: bool,
) -> Option<ProbeResult> {
    let want = match sink {
        Sink::NodeCondition => verdict,
        Sink::ReadinessGate if carried && verdict.is_none() => None,
        Sink::ReadinessGate => published,
    }?;
    (written != Some(want)).then_some(want)
}

/// Whether the Startup probe a worker is gated by lets it run: `None`
/// without `gatedBy`, else that probe's published result on the same
/// target (`None` while it has none, for example not started yet).
pub fn gate_open(gate: Option<Option<ProbeResult>>) -> bool {
    match gate {
        None => true,
        Some(result) => result == Some(ProbeResult::Success),
    }
}

/// Whether a worker's target counts as started: a Startup probe is
/// started by its own success (and then stops probing); the others by
/// their gate.
pub fn started(role: Role, own: Option<ProbeResult>, gate_open: bool) -> bool {
    match role {
        Role::Startup => own == Some(ProbeResult::Success),
        Role::Readiness | Role::Liveness => gate_open,
    }
}

/// Whether a pod in `phase` gets probe workers: not once it Succeeded or
/// Failed (it never runs again).
pub fn probes_pod(phase: Option<&str>) -> bool {
    !matches!(phase, Some("Succeeded" | "Failed"))
}

/// What the manager does with the worker of one key on a pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    Start,
    Stop,
}

/// The worker a key has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Existing {
    /// Its definition is the desired one.
    pub same: bool,
    /// Its task panicked (it ended, but not on its own decision).
    pub panicked: bool,
}

/// `running`: the key's worker, if any; `desired`: whether the key should
/// have a worker. A worker that ended on its own (a deleted pod's liveness
/// probe) is kept, not restarted, while its definition is unchanged; a
/// changed one, or one whose task panicked, is stopped, then started again
/// on the same pass.
pub fn reconcile(running: Option<Existing>, desired: bool) -> Option<Step> {
    match (running, desired) {
        (None, true) => Some(Step::Start),
        (None, false) => None,
        (
            Some(Existing {
                same: true,
                panicked: false,
            }),
            true,
        ) => None,
        (Some(_), _) => Some(Step::Stop),
    }
}

impl Role {
    pub fn initial(self) -> ProbeResult {
        match self {
            Role::Readiness => ProbeResult::Failure,
            Role::Liveness => ProbeResult::Success,
            Role::Startup => ProbeResult::Unknown,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Thresholds {
    pub initial_delay: Duration,
    pub success: u32,
    pub failure: u32,
}

/// What the worker knows of its target at one tick.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TargetView {
    /// The target's status is known (for a pod: it exists in the watch).
    pub known: bool,
    /// The pod Succeeded or Failed.
    pub terminal: bool,
    /// Changes when the target is replaced (for a pod: its UID, IP and
    /// container IDs, so a restarted container is a new target); `None`
    /// while it does not exist yet.
    pub identity: Option<String>,
    /// The target is running.
    pub running: bool,
    /// How long it has been running (for the initial delay).
    pub running_for: Duration,
    /// It stopped and will not be restarted.
    pub finished_for_good: bool,
    /// Deletion requested.
    pub deleting: bool,
    /// The Startup probe gating this one has succeeded (true when no gate;
    /// see [`gate_open`]). Startup probes ignore it.
    pub gate_open: bool,
}

/// What to do at this tick.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Tick {
    /// Do not probe; wait for the next tick.
    Wait,
    /// Run the probe, then call [`Worker::record`].
    Probe,
    /// The worker is done; the manager removes it.
    Stop,
}

/// A worker's state. `published` is the role's state (what gating and
/// readiness gates see); `verdict` the last threshold crossing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Worker {
    role: Role,
    thresholds: Thresholds,
    kind: TargetKind,
    identity: Option<String>,
    on_hold: bool,
    last: Option<ProbeResult>,
    run: u32,
    published: Option<ProbeResult>,
    verdict: Option<ProbeResult>,
    written: Option<ProbeResult>,
}

impl Worker {
    pub fn new(role: Role, thresholds: Thresholds, kind: TargetKind) -> Self {
        Worker {
            role,
            thresholds,
            kind,
            identity: None,
            on_hold: false,
            last: None,
            run: 0,
            published: None,
            verdict: None,
            written: None,
        }
    }

    /// The published result; `None` before the target first appeared.
    pub fn published(&self) -> Option<ProbeResult> {
        self.published
    }

    /// The last result real probes confirmed (crossed its threshold) on
    /// the current target; `None` before that.
    pub fn verdict(&self) -> Option<ProbeResult> {
        self.verdict
    }

    /// What to write to `sink` now ([`should_write`]; `carried`: the pod
    /// carries the readiness-gate condition already); call
    /// [`Worker::wrote`] once the sink accepted it.
    pub fn to_write(&self, sink: Sink, carried: bool) -> Option<ProbeResult> {
        should_write(sink, self.published, self.verdict, self.written, carried)
    }

    /// The sink accepted `result`.
    pub fn wrote(&mut self, result: ProbeResult) {
        self.written = Some(result);
    }

    /// Whether this worker's target has started (see [`started`]).
    pub fn started(&self, gate_open: bool) -> bool {
        started(self.role, self.published, gate_open)
    }

    /// Liveness and Startup hold after a failure until the target is
    /// replaced, which only a pod can be.
    fn holds_after_failure(&self) -> bool {
        self.kind == TargetKind::Pod && matches!(self.role, Role::Liveness | Role::Startup)
    }

    pub fn on_hold(&self) -> bool {
        self.on_hold
    }

    /// Decides a tick; may publish (identity change, not running, deletion).
    pub fn tick(&mut self, view: &TargetView) -> Tick {
        if !view.known {
            return Tick::Wait;
        }
        if view.terminal {
            return Tick::Stop;
        }
        let Some(identity) = &view.identity else {
            return Tick::Wait;
        };
        if self.identity.as_ref() != Some(identity) {
            // A new target: start over from the role's initial value.
            self.identity = Some(identity.clone());
            self.published = Some(self.role.initial());
            self.verdict = None;
            self.written = None;
            self.on_hold = false;
            self.last = None;
            self.run = 0;
        }
        if self.on_hold {
            return Tick::Wait;
        }
        if !view.running {
            self.published = Some(ProbeResult::Failure);
            return if view.finished_for_good {
                Tick::Stop
            } else {
                Tick::Wait
            };
        }
        if view.deleting && matches!(self.role, Role::Liveness | Role::Startup) {
            // A quiet shutdown: nothing should act on this target any more.
            self.published = Some(ProbeResult::Success);
            return Tick::Stop;
        }
        if view.running_for < self.thresholds.initial_delay {
            return Tick::Wait;
        }
        match (self.role, self.started(view.gate_open)) {
            // Done; kept for a replaced target.
            (Role::Startup, true) => Tick::Wait,
            (Role::Startup, false) => Tick::Probe,
            (_, true) => Tick::Probe,
            // Gated until the startup probe succeeds.
            (_, false) => Tick::Wait,
        }
    }

    /// Records a probe's outcome; `Err` (the prober itself failed, not the
    /// target) is dropped. Returns the new published result when it changed.
    pub fn record<E>(&mut self, outcome: Result<ProbeResult, E>) -> Option<ProbeResult> {
        let Ok(result) = outcome else {
            return None;
        };
        if self.last == Some(result) {
            self.run = self.run.saturating_add(1);
        } else {
            self.last = Some(result);
            self.run = 1;
        }
        let below = match result {
            ProbeResult::Failure => self.run < self.thresholds.failure,
            ProbeResult::Success => self.run < self.thresholds.success,
            ProbeResult::Unknown => false,
        };
        if below {
            return None;
        }
        self.verdict = Some(result);
        let before = self.published.replace(result);
        if result == ProbeResult::Failure && self.holds_after_failure() {
            self.on_hold = true;
            self.run = 0;
        }
        (before != Some(result)).then_some(result)
    }
}

/// The first probe of a worker started shortly after the agent waits a
/// random part of the period, so a restart does not fire every probe at
/// once. `unit` is a uniform random number in [0, 1).
pub fn first_delay(period: Duration, since_agent_start: Duration, unit: f64) -> Duration {
    if since_agent_start >= period {
        return Duration::ZERO;
    }
    period.mul_f64(unit.clamp(0.0, 0.999_999))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ProbeResult::*;

    fn th(delay: u64, success: u32, failure: u32) -> Thresholds {
        Thresholds {
            initial_delay: Duration::from_secs(delay),
            success,
            failure,
        }
    }

    fn pod(role: Role, thresholds: Thresholds) -> Worker {
        Worker::new(role, thresholds, TargetKind::Pod)
    }

    fn node(role: Role, thresholds: Thresholds) -> Worker {
        Worker::new(role, thresholds, TargetKind::Node)
    }

    fn running(id: &str, for_secs: u64) -> TargetView {
        TargetView {
            known: true,
            terminal: false,
            identity: Some(id.into()),
            running: true,
            running_for: Duration::from_secs(for_secs),
            finished_for_good: false,
            deleting: false,
            gate_open: true,
        }
    }

    /// Feeds results; returns the published state after each.
    fn feed(
        w: &mut Worker,
        view: &TargetView,
        results: &[ProbeResult],
    ) -> Vec<Option<ProbeResult>> {
        results
            .iter()
            .map(|r| {
                if w.tick(view) == Tick::Probe {
                    w.record::<()>(Ok(*r));
                }
                w.published()
            })
            .collect()
    }

    /// Feeds results as the manager does (tick, probe if asked, write what
    /// [`Worker::to_write`] says, the sink accepting it); returns the
    /// write after each.
    fn writes(
        w: &mut Worker,
        sink: Sink,
        view: &TargetView,
        results: &[ProbeResult],
    ) -> Vec<Option<ProbeResult>> {
        results
            .iter()
            .map(|r| {
                if w.tick(view) == Tick::Probe {
                    w.record::<()>(Ok(*r));
                }
                let out = w.to_write(sink, false);
                if let Some(r) = out {
                    w.wrote(r);
                }
                out
            })
            .collect()
    }

    #[test]
    fn initial_values_by_role() {
        for (role, want) in [
            (Role::Readiness, Failure),
            (Role::Liveness, Success),
            (Role::Startup, Unknown),
        ] {
            let mut w = pod(role, th(0, 1, 3));
            assert_eq!(w.published(), None);
            w.tick(&running("c1", 0));
            assert_eq!(w.published(), Some(want), "{role:?}");
            assert_eq!(w.verdict(), None, "{role:?}: no real result yet");
        }
    }

    #[test]
    fn thresholds_table() {
        // (success threshold, failure threshold, results, published after each)
        let cases: &[(u32, u32, &[ProbeResult], &[ProbeResult])] = &[
            (1, 3, &[Success], &[Success]),
            (1, 3, &[Failure, Failure], &[Failure, Failure]), // readiness starts as Failure
            (
                1,
                3,
                &[Success, Failure, Failure, Failure],
                &[Success, Success, Success, Failure],
            ),
            (
                1,
                3,
                &[Success, Failure, Failure, Success, Failure, Failure],
                &[Success; 6],
            ),
            (2, 1, &[Success, Success], &[Failure, Success]),
            (
                3,
                1,
                &[Success, Success, Failure, Success, Success, Success],
                &[Failure, Failure, Failure, Failure, Failure, Success],
            ),
            (
                1,
                1,
                &[Success, Failure, Success],
                &[Success, Failure, Success],
            ),
            (1, 2, &[Success, Unknown], &[Success, Unknown]), // Unknown has no threshold
        ];
        for (s, f, results, want) in cases {
            let mut w = pod(Role::Readiness, th(0, *s, *f));
            let got = feed(&mut w, &running("c", 10), results);
            let want: Vec<Option<ProbeResult>> = want.iter().map(|r| Some(*r)).collect();
            assert_eq!(got, want, "success={s} failure={f} results={results:?}");
        }
    }

    #[test]
    fn record_reports_only_changes() {
        let mut w = pod(Role::Readiness, th(0, 1, 1));
        w.tick(&running("c", 1));
        assert_eq!(w.record::<()>(Ok(Success)), Some(Success));
        assert_eq!(w.record::<()>(Ok(Success)), None);
        assert_eq!(w.record::<()>(Ok(Failure)), Some(Failure));
    }

    #[test]
    fn prober_errors_are_dropped_not_counted() {
        let mut w = pod(Role::Readiness, th(0, 1, 2));
        let v = running("c", 1);
        feed(&mut w, &v, &[Success]);
        w.tick(&v);
        w.record::<()>(Ok(Failure));
        w.tick(&v);
        assert_eq!(w.record::<&str>(Err("exec: no such file")), None);
        assert_eq!(
            w.published(),
            Some(Success),
            "the error did not count as a failure"
        );
        w.tick(&v);
        w.record::<()>(Ok(Failure));
        assert_eq!(w.published(), Some(Failure), "two real failures in a row");
    }

    #[test]
    fn initial_delay_holds_probing() {
        let mut w = pod(Role::Readiness, th(10, 1, 1));
        assert_eq!(w.tick(&running("c", 9)), Tick::Wait);
        assert_eq!(w.tick(&running("c", 10)), Tick::Probe);
    }

    #[test]
    fn should_write_table() {
        use Sink::*;
        // (sink, published, verdict, written, carried, want)
        type Case = (
            Sink,
            Option<ProbeResult>,
            Option<ProbeResult>,
            Option<ProbeResult>,
            bool,
            Option<ProbeResult>,
        );
        let cases: &[Case] = &[
            // A node condition waits for a real threshold crossing...
            (NodeCondition, Some(Failure), None, None, false, None),
            (NodeCondition, Some(Success), None, None, false, None),
            (NodeCondition, Some(Unknown), None, None, false, None),
            (NodeCondition, None, None, None, false, None),
            // ...then writes it, even when it equals the initial value
            // (it replaces whatever the Node carried over)...
            (
                NodeCondition,
                Some(Failure),
                Some(Failure),
                None,
                false,
                Some(Failure),
            ),
            (
                NodeCondition,
                Some(Success),
                Some(Success),
                None,
                false,
                Some(Success),
            ),
            (
                NodeCondition,
                Some(Unknown),
                Some(Unknown),
                None,
                false,
                Some(Unknown),
            ),
            // ...once.
            (
                NodeCondition,
                Some(Failure),
                Some(Failure),
                Some(Failure),
                false,
                None,
            ),
            (
                NodeCondition,
                Some(Success),
                Some(Success),
                Some(Failure),
                false,
                Some(Success),
            ),
            // Not-running / deletion publish without a verdict: not for nodes.
            (
                NodeCondition,
                Some(Success),
                Some(Failure),
                Some(Failure),
                false,
                None,
            ),
            // `carried` is only for readiness gates.
            (NodeCondition, Some(Success), None, None, true, None),
            (
                NodeCondition,
                Some(Failure),
                Some(Failure),
                None,
                true,
                Some(Failure),
            ),
            // A new pod's readiness gate follows the published result,
            // initial included.
            (
                ReadinessGate,
                Some(Failure),
                None,
                None,
                false,
                Some(Failure),
            ),
            (
                ReadinessGate,
                Some(Unknown),
                None,
                None,
                false,
                Some(Unknown),
            ),
            (
                ReadinessGate,
                Some(Success),
                None,
                None,
                false,
                Some(Success),
            ),
            (
                ReadinessGate,
                Some(Success),
                Some(Success),
                Some(Failure),
                false,
                Some(Success),
            ),
            (
                ReadinessGate,
                Some(Success),
                Some(Success),
                Some(Success),
                false,
                None,
            ),
            (
                ReadinessGate,
                Some(Failure),
                Some(Success),
                Some(Success),
                false,
                Some(Failure),
            ),
            (ReadinessGate, None, None, None, false, None),
            // A gate the pod carries (from before an agent restart, or from
            // the previous container) stands until a verdict: a Liveness
            // probe's initial Success does not turn a held False True...
            (ReadinessGate, Some(Success), None, None, true, None),
            (ReadinessGate, Some(Failure), None, None, true, None),
            (ReadinessGate, Some(Unknown), None, None, true, None),
            // ...nor does a worker's own earlier write change that.
            (
                ReadinessGate,
                Some(Success),
                None,
                Some(Failure),
                true,
                None,
            ),
            // A verdict is written, even one equal to the initial value...
            (
                ReadinessGate,
                Some(Success),
                Some(Success),
                None,
                true,
                Some(Success),
            ),
            (
                ReadinessGate,
                Some(Failure),
                Some(Failure),
                None,
                true,
                Some(Failure),
            ),
            // ...once; after it the gate follows the published result.
            (
                ReadinessGate,
                Some(Failure),
                Some(Failure),
                Some(Failure),
                true,
                None,
            ),
            (
                ReadinessGate,
                Some(Failure),
                Some(Success),
                Some(Success),
                true,
                Some(Failure),
            ),
        ];
        for &(sink, published, verdict, written, carried, want) in cases {
            assert_eq!(
                should_write(sink, published, verdict, written, carried),
                want,
                "{sink:?} published={published:?} verdict={verdict:?} written={written:?} carried={carried}"
            );
        }
    }

    #[test]
    fn a_restarted_agent_leaves_a_held_liveness_gate_until_its_verdict() {
        // A fresh worker on a pod whose gate a previous agent set False.
        let mut w = pod(Role::Liveness, th(5, 1, 2));
        let v = running("uid/10.0.0.1/containerd://a", 3);
        assert_eq!(w.tick(&v), Tick::Wait, "initial delay");
        assert_eq!(w.published(), Some(Success), "the role's initial value");
        assert_eq!(
            w.to_write(Sink::ReadinessGate, true),
            None,
            "carried: stands"
        );
        let v = running("uid/10.0.0.1/containerd://a", 10);
        assert_eq!(
            writes_carried(&mut w, &v, &[Failure, Failure]),
            [None, Some(Failure)],
            "the real verdict, equal to what the pod says, is written"
        );
        // A restarted container is a new target: the hold ends, the gate
        // the pod carries stands until the new container's verdict.
        let v2 = running("uid/10.0.0.1/containerd://b", 10);
        assert_eq!(w.tick(&v2), Tick::Probe);
        assert_eq!(w.to_write(Sink::ReadinessGate, true), None);
        w.record::<()>(Ok(Success));
        assert_eq!(w.to_write(Sink::ReadinessGate, true), Some(Success));
    }

    /// As [`writes`], for a readiness gate the pod carries already.
    fn writes_carried(
        w: &mut Worker,
        view: &TargetView,
        results: &[ProbeResult],
    ) -> Vec<Option<ProbeResult>> {
        results
            .iter()
            .map(|r| {
                if w.tick(view) == Tick::Probe {
                    w.record::<()>(Ok(*r));
                }
                let out = w.to_write(Sink::ReadinessGate, true);
                if let Some(r) = out {
                    w.wrote(r);
                }
                out
            })
            .collect()
    }

    #[test]
    fn node_conditions_change_only_when_real_results_cross_a_threshold() {
        // (role, success, failure, results, NodeCondition writes after each)
        type Case<'a> = (Role, u32, u32, &'a [ProbeResult], &'a [Option<ProbeResult>]);
        let cases: &[Case] = &[
            // One failure after a restart writes nothing (failure threshold 3).
            (
                Role::Readiness,
                1,
                3,
                &[Failure, Failure, Failure, Failure],
                &[None, None, Some(Failure), None],
            ),
            // successThreshold 2 on a healthy node: no True, then False.
            (
                Role::Readiness,
                2,
                3,
                &[Success, Success, Success],
                &[None, Some(Success), None],
            ),
            // Liveness starts as Success: one failure is not written either.
            (
                Role::Liveness,
                1,
                2,
                &[Success, Failure, Failure, Success],
                &[Some(Success), None, Some(Failure), Some(Success)],
            ),
            // Startup: the first success is written; nothing before.
            (
                Role::Startup,
                1,
                3,
                &[Failure, Success, Success],
                &[None, Some(Success), None],
            ),
        ];
        for (role, s, f, results, want) in cases {
            let mut w = node(*role, th(0, *s, *f));
            let got = writes(&mut w, Sink::NodeCondition, &running("node", 100), results);
            assert_eq!(got, *want, "{role:?} s={s} f={f} {results:?}");
        }
    }

    #[test]
    fn initial_delay_then_a_result_equal_to_the_initial_value_is_written() {
        let mut w = node(Role::Readiness, th(10, 1, 1));
        // Before the delay: the role's initial value is published (Failure)
        // but a NodeCondition is not written; a readiness gate would be.
        assert_eq!(w.tick(&running("node", 3)), Tick::Wait);
        assert_eq!(w.published(), Some(Failure));
        assert_eq!(w.to_write(Sink::NodeCondition, false), None);
        assert_eq!(w.to_write(Sink::ReadinessGate, false), Some(Failure));
        // After it: a real failure equals the initial value, and is written.
        assert_eq!(w.tick(&running("node", 10)), Tick::Probe);
        assert_eq!(w.record::<()>(Ok(Failure)), None, "published unchanged");
        assert_eq!(w.to_write(Sink::NodeCondition, false), Some(Failure));
    }

    #[test]
    fn a_failed_write_is_retried_and_a_new_target_writes_again() {
        let mut w = pod(Role::Readiness, th(0, 1, 1));
        let v = running("uid1/10.0.0.1", 1);
        w.tick(&v);
        assert_eq!(w.to_write(Sink::ReadinessGate, false), Some(Failure));
        // The write failed (not acknowledged): still to write.
        assert_eq!(w.to_write(Sink::ReadinessGate, false), Some(Failure));
        w.wrote(Failure);
        assert_eq!(w.to_write(Sink::ReadinessGate, false), None);
        // A new pod under the same name: its gate is written afresh.
        w.tick(&running("uid2/10.0.0.2", 1));
        assert_eq!(w.to_write(Sink::ReadinessGate, false), Some(Failure));
        assert_eq!(w.verdict(), None);
    }

    #[test]
    fn gate_and_started_tables() {
        for (gate, want) in [
            (None, true),
            (Some(None), false),
            (Some(Some(Unknown)), false),
            (Some(Some(Failure)), false),
            (Some(Some(Success)), true),
        ] {
            assert_eq!(gate_open(gate), want, "{gate:?}");
        }
        // (role, own published, gate open, started)
        let cases = [
            // A Startup probe is started by its own success, whatever the gate.
            (Role::Startup, None, true, false),
            (Role::Startup, Some(Unknown), true, false),
            (Role::Startup, Some(Failure), true, false),
            (Role::Startup, Some(Success), true, true),
            (Role::Startup, Some(Success), false, true),
            // The others by their gate.
            (Role::Readiness, Some(Failure), true, true),
            (Role::Readiness, Some(Success), false, false),
            (Role::Liveness, Some(Success), false, false),
            (Role::Liveness, None, true, true),
        ];
        for (role, own, gate, want) in cases {
            assert_eq!(started(role, own, gate), want, "{role:?} {own:?} {gate:?}");
        }
    }

    #[test]
    fn probes_pod_table() {
        for (phase, want) in [
            (None, true),
            (Some("Pending"), true),
            (Some("Running"), true),
            (Some("Unknown"), true),
            (Some("Succeeded"), false),
            (Some("Failed"), false),
        ] {
            assert_eq!(probes_pod(phase), want, "{phase:?}");
        }
    }

    #[test]
    fn reconcile_table() {
        let w = |same, panicked| Some(Existing { same, panicked });
        // (the key's worker, desired, step)
        for (running, desired, want) in [
            (None, true, Some(Step::Start)),
            (None, false, None),
            (w(true, false), true, None), // unchanged, ended on its own or not
            (w(false, false), true, Some(Step::Stop)), // then started afresh
            (w(true, false), false, Some(Step::Stop)),
            (w(false, false), false, Some(Step::Stop)),
            // A panicked worker is replaced even when unchanged...
            (w(true, true), true, Some(Step::Stop)),
            (w(false, true), true, Some(Step::Stop)),
            // ...and forgotten when no longer desired.
            (w(true, true), false, Some(Step::Stop)),
        ] {
            assert_eq!(reconcile(running, desired), want, "{running:?} {desired}");
        }
    }

    #[test]
    fn a_startup_probe_without_gate_probes_until_its_own_success() {
        for kind in [TargetKind::Node, TargetKind::Pod] {
            let mut s = Worker::new(Role::Startup, th(0, 1, 3), kind);
            let v = running("c", 1); // gate_open: no gatedBy
            assert_eq!(s.tick(&v), Tick::Probe, "{kind:?}: not started yet");
            assert_eq!(s.record::<()>(Ok(Failure)), None);
            assert_eq!(s.tick(&v), Tick::Probe, "{kind:?}");
            assert_eq!(s.record::<()>(Ok(Success)), Some(Success));
            for _ in 0..3 {
                assert_eq!(s.tick(&v), Tick::Wait, "{kind:?}: done, no more probes");
            }
            assert!(s.started(true));
        }
    }

    #[test]
    fn liveness_failure_holds_a_pod_until_it_changes() {
        let mut w = pod(Role::Liveness, th(0, 1, 2));
        let v = running("c1", 5);
        assert_eq!(
            feed(&mut w, &v, &[Failure, Failure]),
            [Some(Success), Some(Failure)]
        );
        assert!(w.on_hold());
        for _ in 0..5 {
            assert_eq!(w.tick(&v), Tick::Wait, "on hold");
        }
        // A new container: back to the initial value, probing again.
        let v2 = running("c2", 5);
        assert_eq!(w.tick(&v2), Tick::Probe);
        assert_eq!(w.published(), Some(Success));
        assert!(!w.on_hold());
        // Readiness never holds.
        let mut r = pod(Role::Readiness, th(0, 1, 1));
        feed(&mut r, &v, &[Failure]);
        assert!(!r.on_hold());
        assert_eq!(r.tick(&v), Tick::Probe);
    }

    #[test]
    fn node_targets_never_hold() {
        // The node is never replaced: Liveness keeps probing after a
        // failure and clears when the probe passes.
        let v = running("node", 100);
        let mut l = node(Role::Liveness, th(0, 1, 2));
        assert_eq!(
            writes(
                &mut l,
                Sink::NodeCondition,
                &v,
                &[Failure, Failure, Failure, Success]
            ),
            [None, Some(Failure), None, Some(Success)]
        );
        assert!(!l.on_hold());
        // Startup keeps probing after failures until its first success,
        // then stops.
        let mut s = node(Role::Startup, th(0, 1, 1));
        assert_eq!(feed(&mut s, &v, &[Failure, Failure]), [Some(Failure); 2]);
        assert!(!s.on_hold());
        assert!(!s.started(true));
        assert_eq!(s.tick(&v), Tick::Probe);
        s.record::<()>(Ok(Success));
        assert!(s.started(true));
        assert_eq!(s.tick(&v), Tick::Wait);
    }

    #[test]
    fn startup_gates_the_others_and_stops_once_started() {
        let mut startup = pod(Role::Startup, th(0, 1, 3));
        let mut ready = pod(Role::Readiness, th(0, 1, 3));
        let mut gated = running("c", 1);
        gated.gate_open = gate_open(Some(startup.published()));
        assert_eq!(ready.tick(&gated), Tick::Wait, "gated");
        assert_eq!(startup.tick(&gated), Tick::Probe);
        assert_eq!(startup.record::<()>(Ok(Success)), Some(Success));
        let open = TargetView {
            gate_open: gate_open(Some(startup.published())),
            ..running("c", 2)
        };
        assert!(open.gate_open);
        assert_eq!(startup.tick(&open), Tick::Wait, "startup done");
        assert_eq!(ready.tick(&open), Tick::Probe);
        // Startup failing past its threshold holds a pod, like liveness.
        let mut s = pod(Role::Startup, th(0, 1, 2));
        feed(&mut s, &gated, &[Failure, Failure]);
        assert!(s.on_hold());
        assert_eq!(s.published(), Some(Failure));
    }

    #[test]
    fn deletion_is_a_quiet_success_for_liveness_and_startup_only() {
        let mut v = running("c", 5);
        v.deleting = true;
        for role in [Role::Liveness, Role::Startup] {
            let mut w = pod(role, th(0, 1, 1));
            feed(&mut w, &running("c", 5), &[Failure]);
            w.on_hold = false; // even a held worker ends quietly
            assert_eq!(w.tick(&v), Tick::Stop, "{role:?}");
            assert_eq!(w.published(), Some(Success));
        }
        let mut w = pod(Role::Readiness, th(0, 1, 1));
        assert_eq!(
            w.tick(&v),
            Tick::Probe,
            "readiness keeps probing during deletion"
        );
    }

    #[test]
    fn terminal_unknown_missing_and_stopped_targets() {
        let mut w = pod(Role::Readiness, th(0, 1, 1));
        let unknown = TargetView {
            known: false,
            ..running("c", 1)
        };
        assert_eq!(w.tick(&unknown), Tick::Wait);
        let not_created = TargetView {
            identity: None,
            ..running("c", 1)
        };
        assert_eq!(w.tick(&not_created), Tick::Wait);
        assert_eq!(w.published(), None);
        let mut stopped = running("c", 1);
        stopped.running = false;
        assert_eq!(w.tick(&stopped), Tick::Wait, "will restart");
        assert_eq!(w.published(), Some(Failure));
        stopped.finished_for_good = true;
        assert_eq!(w.tick(&stopped), Tick::Stop);
        let terminal = TargetView {
            terminal: true,
            ..running("c", 1)
        };
        assert_eq!(
            pod(Role::Readiness, th(0, 1, 1)).tick(&terminal),
            Tick::Stop
        );
    }

    #[test]
    fn jitter_only_right_after_start_and_within_the_period() {
        let p = Duration::from_secs(10);
        assert_eq!(first_delay(p, Duration::from_secs(11), 0.5), Duration::ZERO);
        assert_eq!(
            first_delay(p, Duration::from_secs(1), 0.5),
            Duration::from_secs(5)
        );
        assert!(first_delay(p, Duration::ZERO, 1.0) < p);
        assert_eq!(first_delay(p, Duration::ZERO, 0.0), Duration::ZERO);
        for i in 0..100 {
            let d = first_delay(p, Duration::ZERO, i as f64 / 100.0);
            assert!(d < p);
        }
    }
}
