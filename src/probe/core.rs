//! Decision core of a probe worker, with the kubelet prober's semantics:
//! thresholds, initial delay, on-hold after a liveness-style failure until
//! the target changes, startup gating, quiet success on deletion, stopping
//! on terminal targets, prober errors dropped.

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
    /// Starts as Success; after a published failure, holds until the
    /// target changes (a new container or pod IP).
    Liveness,
    /// Starts as Unknown; gates the probes that name it; stops probing
    /// once successful; holds after a published failure.
    Startup,
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
    /// Changes when the target is replaced (container ID, pod UID + IP);
    /// `None` while it does not exist yet.
    pub identity: Option<String>,
    /// The target is running.
    pub running: bool,
    /// How long it has been running (for the initial delay).
    pub running_for: Duration,
    /// It stopped and will not be restarted.
    pub finished_for_good: bool,
    /// Deletion requested.
    pub deleting: bool,
    /// The startup probe gating this one has succeeded (true when no gate).
    pub started: bool,
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

/// A worker's state. `published` is what the outside world sees.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Worker {
    role: Role,
    thresholds: Thresholds,
    identity: Option<String>,
    on_hold: bool,
    last: Option<ProbeResult>,
    run: u32,
    published: Option<ProbeResult>,
}

impl Worker {
    pub fn new(role: Role, thresholds: Thresholds) -> Self {
        Worker {
            role,
            thresholds,
            identity: None,
            on_hold: false,
            last: None,
            run: 0,
            published: None,
        }
    }

    /// The published result; `None` before the target first appeared.
    pub fn published(&self) -> Option<ProbeResult> {
        self.published
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
        if view.started {
            if self.role == Role::Startup {
                return Tick::Wait; // done; kept for a replaced target
            }
        } else if self.role != Role::Startup {
            return Tick::Wait; // gated until the startup probe succeeds
        }
        Tick::Probe
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
        let before = self.published.replace(result);
        if result == ProbeResult::Failure && matches!(self.role, Role::Liveness | Role::Startup) {
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

    fn running(id: &str, for_secs: u64) -> TargetView {
        TargetView {
            known: true,
            terminal: false,
            identity: Some(id.into()),
            running: true,
            running_for: Duration::from_secs(for_secs),
            finished_for_good: false,
            deleting: false,
            started: true,
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

    #[test]
    fn initial_values_by_role() {
        for (role, want) in [
            (Role::Readiness, Failure),
            (Role::Liveness, Success),
            (Role::Startup, Unknown),
        ] {
            let mut w = Worker::new(role, th(0, 1, 3));
            let mut view = running("c1", 0);
            view.started = role != Role::Startup;
            assert_eq!(w.published(), None);
            w.tick(&view);
            assert_eq!(w.published(), Some(want), "{role:?}");
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
            let mut w = Worker::new(Role::Readiness, th(0, *s, *f));
            let got = feed(&mut w, &running("c", 10), results);
            let want: Vec<Option<ProbeResult>> = want.iter().map(|r| Some(*r)).collect();
            assert_eq!(got, want, "success={s} failure={f} results={results:?}");
        }
    }

    #[test]
    fn record_reports_only_changes() {
        let mut w = Worker::new(Role::Readiness, th(0, 1, 1));
        w.tick(&running("c", 1));
        assert_eq!(w.record::<()>(Ok(Success)), Some(Success));
        assert_eq!(w.record::<()>(Ok(Success)), None);
        assert_eq!(w.record::<()>(Ok(Failure)), Some(Failure));
    }

    #[test]
    fn prober_errors_are_dropped_not_counted() {
        let mut w = Worker::new(Role::Readiness, th(0, 1, 2));
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
        let mut w = Worker::new(Role::Readiness, th(10, 1, 1));
        assert_eq!(w.tick(&running("c", 9)), Tick::Wait);
        assert_eq!(w.tick(&running("c", 10)), Tick::Probe);
    }

    #[test]
    fn liveness_failure_holds_until_the_target_changes() {
        let mut w = Worker::new(Role::Liveness, th(0, 1, 2));
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
        let mut r = Worker::new(Role::Readiness, th(0, 1, 1));
        feed(&mut r, &v, &[Failure]);
        assert!(!r.on_hold());
        assert_eq!(r.tick(&v), Tick::Probe);
    }

    #[test]
    fn startup_gates_the_others_and_stops_once_started() {
        let mut startup = Worker::new(Role::Startup, th(0, 1, 3));
        let mut ready = Worker::new(Role::Readiness, th(0, 1, 3));
        let mut not_started = running("c", 1);
        not_started.started = false;
        assert_eq!(ready.tick(&not_started), Tick::Wait, "gated");
        assert_eq!(startup.tick(&not_started), Tick::Probe);
        assert_eq!(startup.record::<()>(Ok(Success)), Some(Success));
        let started = running("c", 2);
        assert_eq!(startup.tick(&started), Tick::Wait, "startup done");
        assert_eq!(ready.tick(&started), Tick::Probe);
        // Startup failing past its threshold holds, like liveness.
        let mut s = Worker::new(Role::Startup, th(0, 1, 2));
        let v = not_started.clone();
        feed(&mut s, &v, &[Failure, Failure]);
        assert!(s.on_hold());
        assert_eq!(s.published(), Some(Failure));
    }

    #[test]
    fn deletion_is_a_quiet_success_for_liveness_and_startup_only() {
        let mut v = running("c", 5);
        v.deleting = true;
        for role in [Role::Liveness, Role::Startup] {
            let mut w = Worker::new(role, th(0, 1, 1));
            let mut before = running("c", 5);
            before.started = role != Role::Startup;
            feed(&mut w, &before, &[Failure]);
            let mut v = v.clone();
            v.started = before.started;
            w.on_hold = false; // even a held worker ends quietly
            assert_eq!(w.tick(&v), Tick::Stop, "{role:?}");
            assert_eq!(w.published(), Some(Success));
        }
        let mut w = Worker::new(Role::Readiness, th(0, 1, 1));
        assert_eq!(
            w.tick(&v),
            Tick::Probe,
            "readiness keeps probing during deletion"
        );
    }

    #[test]
    fn terminal_unknown_missing_and_stopped_targets() {
        let mut w = Worker::new(Role::Readiness, th(0, 1, 1));
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
            Worker::new(Role::Readiness, th(0, 1, 1)).tick(&terminal),
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
