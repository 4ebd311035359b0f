//! The writer and publisher loops against in-memory ports, with paused time.

use super::*;
use crate::server::Health;
use std::collections::BTreeSet;
use std::sync::atomic::AtomicUsize;

/// A Node status that behaves like server-side apply for one manager.
#[derive(Default)]
struct FakeNode {
    state: NodeState,
    rv: u64,
    applies: usize,
    down: bool,
    /// Each apply takes this long (a slow API server).
    slow: Duration,
}

#[derive(Clone, Default)]
struct FakeStatus(Arc<Mutex<FakeNode>>);

impl FakeStatus {
    fn with<R>(&self, f: impl FnOnce(&mut FakeNode) -> R) -> R {
        f(&mut self.0.lock().unwrap())
    }
    fn observation(&self) -> Observation {
        self.with(|n| Observation {
            state: n.state.clone(),
            resource_version: Some(n.rv),
        })
    }
    fn effective(&self) -> Option<String> {
        self.with(|n| n.state.effective.clone())
    }
    fn get(&self, type_: &str) -> Option<Observed> {
        self.with(|n| {
            n.state
                .conditions
                .iter()
                .find(|c| c.type_ == type_)
                .cloned()
        })
    }
}

impl StatusPort for FakeStatus {
    async fn apply(
        &self,
        conditions: &[Written],
        effective: Option<&str>,
    ) -> Result<Observation, ReportError> {
        let slow = self.with(|n| n.slow);
        tokio::time::sleep(slow).await;
        self.with(|n| {
            if n.down {
                return Err(ReportError::NodeUnknown("apiserver down".into()));
            }
            n.applies += 1;
            let owned = n.state.owned.clone();
            n.state.conditions.retain(|c| {
                !owned.contains(&c.type_) && !conditions.iter().any(|w| w.type_ == c.type_)
            });
            n.state.conditions.extend(conditions.iter().cloned());
            n.state.owned = conditions
                .iter()
                .map(|c| c.type_.clone())
                .collect::<BTreeSet<_>>();
            // Server-side apply: an owned annotation left out is removed.
            n.state.effective = effective.map(str::to_string);
            n.rv += 1;
            Ok(Observation {
                state: n.state.clone(),
                resource_version: Some(n.rv),
            })
        })
    }
}

fn desired(status: Status, reason: &str) -> Desired {
    Desired {
        status,
        reason: reason.into(),
        message: format!("{reason}."),
    }
}

struct Harness {
    reporter: Reporter,
    port: FakeStatus,
    observed: watch::Sender<Option<Observation>>,
    health: Health,
    shutdown: CancellationToken,
    _queue: EventQueue,
}

fn start(config: ReportConfig) -> Harness {
    let mut registry = Registry::default();
    let (reporter, queue) = Reporter::new(&config, &mut registry);
    let port = FakeStatus::default();
    let (tx, rx) = watch::channel(Some(port.observation()));
    let health = Health::new();
    let handle = health.register("conditions", Duration::from_secs(60));
    let shutdown = CancellationToken::new();
    tokio::spawn(run_condition_writer(
        reporter.clone(),
        port.clone(),
        rx,
        handle,
        config,
        shutdown.clone(),
    ));
    Harness {
        reporter,
        port,
        observed: tx,
        health,
        shutdown,
        _queue: queue,
    }
}

async fn settle() {
    tokio::time::sleep(Duration::from_secs(1)).await;
}

#[tokio::test(start_paused = true)]
async fn nothing_is_written_before_initialization() {
    let h = start(ReportConfig::default());
    h.reporter.set("A", desired(Status::True, "Bad"));
    settle().await;
    assert_eq!(h.port.with(|n| n.applies), 0);
    h.reporter.mark_initialized();
    settle().await;
    assert_eq!(h.port.with(|n| n.applies), 1);
    assert_eq!(h.port.get("A").unwrap().status, "True");
    h.shutdown.cancel();
}

#[tokio::test(start_paused = true)]
async fn a_thousand_changes_in_one_second_become_a_handful_of_writes() {
    let h = start(ReportConfig::default());
    h.reporter.mark_initialized();
    for i in 0..1000 {
        let status = if i % 2 == 0 {
            Status::True
        } else {
            Status::False
        };
        h.reporter
            .set("Flappy", desired(status, &format!("Step{i}")));
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    settle().await;
    let applies = h.port.with(|n| n.applies);
    assert!(
        (1..=6).contains(&applies),
        "{applies} writes for 1000 changes"
    );
    let last = h.port.get("Flappy").unwrap();
    assert_eq!(
        (last.status.as_str(), last.reason.as_str()),
        ("False", "Step999")
    );
    h.shutdown.cancel();
}

#[tokio::test(start_paused = true)]
async fn an_outage_loses_nothing_and_converges_within_five_seconds_of_recovery() {
    let h = start(ReportConfig::default());
    h.reporter.mark_initialized();
    h.port.with(|n| n.down = true);
    h.reporter.set("A", desired(Status::True, "First"));
    for i in 0..30 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        h.reporter
            .set("A", desired(Status::True, &format!("During{i}")));
        assert!(
            h.health.report().live,
            "waiting on the API must not fail /livez"
        );
    }
    h.reporter.set("B", desired(Status::False, "Fine"));
    h.port.with(|n| n.down = false);
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(h.port.get("A").unwrap().reason, "During29");
    assert_eq!(h.port.get("B").unwrap().status, "False");
    h.shutdown.cancel();
}

/// A policy edit as the agent makes it: spread first, then the changes.
fn policy_edit(h: &Harness, spread: Duration, effective: &str) {
    h.reporter
        .spread_writes(spread, &["NodeGuardPolicyInvalid"]);
    h.reporter.set(
        "NodeGuardPolicyInvalid",
        desired(Status::False, "PoliciesValid"),
    );
    h.reporter.set_effective(effective.into());
    h.reporter.edit_done();
}

/// A writer whose first write, with policy `p@1` in force, is done.
async fn started_with_policy() -> Harness {
    let h = start(ReportConfig::default());
    h.reporter.mark_initialized();
    policy_edit(&h, Duration::ZERO, "p@1");
    settle().await;
    h
}

#[tokio::test(start_paused = true)]
async fn a_policy_edit_is_one_write_at_the_end_of_its_spread() {
    let h = start(ReportConfig::default());
    policy_edit(&h, Duration::ZERO, "p@1");
    h.reporter.mark_initialized();
    settle().await;
    assert_eq!(
        h.port.with(|n| n.applies),
        1,
        "the start is written at once"
    );
    assert_eq!(h.port.effective().as_deref(), Some("p@1"));
    let t0 = Instant::now();
    policy_edit(&h, Duration::from_secs(7), "p@2");
    // The edit's consequences: a new monitor's condition, moments later.
    tokio::time::sleep(Duration::from_millis(300)).await;
    h.reporter.set(
        "KernelDeadlock",
        desired(Status::False, "KernelHasNoDeadlock"),
    );
    while h.port.with(|n| n.applies) == 1 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_secs(7) && took < Duration::from_millis(7100),
        "{took:?}"
    );
    settle().await;
    assert_eq!(h.port.with(|n| n.applies), 2, "one write for the edit");
    assert_eq!(h.port.effective().as_deref(), Some("p@2"));
    assert!(h.port.get("KernelDeadlock").is_some());
    // A heartbeat keeps the annotation (the apply would drop it otherwise).
    tokio::time::sleep(Duration::from_secs(300)).await;
    assert_eq!(h.port.with(|n| n.applies), 3);
    assert_eq!(h.port.effective().as_deref(), Some("p@2"));
    h.shutdown.cancel();
}

#[tokio::test(start_paused = true)]
async fn a_problem_found_during_a_spread_is_written_at_once_with_the_edit() {
    let h = started_with_policy().await;
    assert_eq!(h.port.with(|n| n.applies), 1);
    // An edit that makes the policy invalid is spread like any other.
    h.reporter
        .spread_writes(Duration::from_secs(9), &["NodeGuardPolicyInvalid"]);
    h.reporter.set(
        "NodeGuardPolicyInvalid",
        desired(Status::True, "PolicyInvalid"),
    );
    h.reporter.set_effective("p@1".into());
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(h.port.with(|n| n.applies), 1, "still spread");
    // A kernel problem meanwhile: out at once, and the edit with it.
    h.reporter
        .set("KernelDeadlock", desired(Status::True, "DockerHung"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(h.port.with(|n| n.applies), 2);
    assert_eq!(h.port.get("KernelDeadlock").unwrap().status, "True");
    assert_eq!(h.port.get("NodeGuardPolicyInvalid").unwrap().status, "True");
    // Nothing is left to write when the spread would have ended.
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(h.port.with(|n| n.applies), 2);
    // An urgent change cuts a spread short too.
    h.reporter
        .spread_writes(Duration::from_secs(9), &["NodeGuardPolicyInvalid"]);
    h.reporter.set_effective("p@2".into());
    h.reporter.edit_done();
    tokio::time::sleep(Duration::from_secs(1)).await;
    h.reporter.set_urgent(
        "GracefulShutdown",
        desired(Status::True, "ShutdownInProgress"),
    );
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(h.port.with(|n| n.applies), 3);
    assert_eq!(h.port.effective().as_deref(), Some("p@2"));
    h.shutdown.cancel();
}

#[tokio::test(start_paused = true)]
async fn a_long_spread_is_not_a_stuck_writer_and_a_stop_ends_it_with_the_write() {
    let h = started_with_policy().await;
    policy_edit(&h, Duration::from_secs(300), "p@2");
    // Past the loops' stuck timeout (60 s): waiting is not being stuck,
    // so /livez (and the watchdog) stay good.
    tokio::time::sleep(Duration::from_secs(150)).await;
    assert!(h.health.report().live, "{:?}", h.health.report());
    assert_eq!(h.port.with(|n| n.applies), 1, "still held");
    // A stop (a rollout) meanwhile: the held write goes out on the way.
    h.shutdown.cancel();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(h.port.with(|n| n.applies), 2);
    assert_eq!(h.port.effective().as_deref(), Some("p@2"));
}

#[tokio::test(start_paused = true)]
async fn edits_in_a_row_do_not_push_the_write_back() {
    let h = started_with_policy().await;
    let t0 = Instant::now();
    // A GitOps loop edits every 5 s; this node's point is 8 s.
    for g in 2..=6 {
        policy_edit(&h, Duration::from_secs(8), &format!("p@{g}"));
        if h.port.with(|n| n.applies) == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
    let took = t0.elapsed();
    assert_eq!(h.port.with(|n| n.applies), 2);
    assert!(
        took <= Duration::from_secs(10),
        "written {took:?} after the first edit"
    );
    h.shutdown.cancel();
}

#[tokio::test(start_paused = true)]
async fn a_problem_waiting_when_the_spread_begins_is_not_held() {
    let h = started_with_policy().await;
    // The problem is set, and the edit arrives within the coalesce window.
    h.reporter
        .set("KernelDeadlock", desired(Status::True, "DockerHung"));
    tokio::time::sleep(Duration::from_millis(20)).await;
    policy_edit(&h, Duration::from_secs(9), "p@2");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(h.port.with(|n| n.applies), 2);
    assert_eq!(h.port.get("KernelDeadlock").unwrap().status, "True");
    h.shutdown.cancel();
}

#[tokio::test(start_paused = true)]
async fn a_spread_with_nothing_to_write_holds_nothing_after_it() {
    let h = start(ReportConfig::default());
    h.reporter.mark_initialized();
    policy_edit(&h, Duration::ZERO, "p@1");
    h.reporter.set("App", desired(Status::True, "Crashed"));
    settle().await;
    assert_eq!(h.port.with(|n| n.applies), 1);
    // An edit that changes nothing written (same verdict, same value).
    policy_edit(&h, Duration::from_secs(9), "p@1");
    tokio::time::sleep(Duration::from_secs(1)).await;
    // A recovery a moment later goes out at the ordinary pace.
    h.reporter.set("App", desired(Status::False, "Fine"));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(h.port.with(|n| n.applies), 2);
    assert_eq!(h.port.get("App").unwrap().status, "False");
    h.shutdown.cancel();
}

#[tokio::test(start_paused = true)]
async fn an_edit_made_while_a_write_is_in_flight_is_still_spread() {
    let h = started_with_policy().await;
    h.port.with(|n| n.slow = Duration::from_secs(2));
    // A change whose write takes 2 s; the edit lands meanwhile.
    h.reporter.set("App", desired(Status::False, "Fine"));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let t0 = Instant::now();
    policy_edit(&h, Duration::from_secs(6), "p@2");
    while h.port.effective().as_deref() != Some("p@2") {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_secs(6),
        "the edit written after {took:?}"
    );
    h.shutdown.cancel();
}

#[tokio::test(start_paused = true)]
async fn urgent_changes_skip_the_write_interval() {
    let config = ReportConfig {
        min_write_interval: Duration::from_secs(10),
        ..Default::default()
    };
    let h = start(config);
    h.reporter.mark_initialized();
    h.reporter.set("A", desired(Status::False, "Fine"));
    settle().await;
    assert_eq!(h.port.with(|n| n.applies), 1);
    h.reporter.set_urgent(
        "GracefulShutdown",
        desired(Status::True, "ShutdownInProgress"),
    );
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(
        h.port.with(|n| n.applies),
        2,
        "urgent write went out at once"
    );
    h.reporter.set("A", desired(Status::True, "Bad"));
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        h.port.with(|n| n.applies),
        2,
        "normal writes wait for the interval"
    );
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(h.port.with(|n| n.applies), 3);
    // An urgent change that arrives while an ordinary one waits for the
    // interval goes out at once, with it.
    h.reporter.set("A", desired(Status::False, "FineAgain"));
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(h.port.with(|n| n.applies), 3, "ordinary change waits");
    h.reporter.set_urgent(
        "GracefulShutdown",
        desired(Status::False, "ShutdownCancelled"),
    );
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(
        h.port.with(|n| n.applies),
        4,
        "urgent write during an ordinary wait went out at once"
    );
    h.shutdown.cancel();
}

#[tokio::test(start_paused = true)]
async fn heartbeats_refresh_and_keep_transition_times() {
    let config = ReportConfig {
        heartbeat: Duration::from_secs(60),
        ..Default::default()
    };
    let h = start(config);
    h.reporter.mark_initialized();
    h.reporter.set("A", desired(Status::False, "Fine"));
    settle().await;
    let first = h.port.get("A").unwrap();
    tokio::time::sleep(Duration::from_secs(61)).await;
    let second = h.port.get("A").unwrap();
    assert_eq!(h.port.with(|n| n.applies), 2);
    assert_eq!(first.last_transition, second.last_transition);
    assert!(second.last_heartbeat > first.last_heartbeat);
    h.shutdown.cancel();
}

/// A `False`/`Fine` condition of `type_` on the Node, owned by the writer,
/// with both times at `at` (a previous agent's write).
fn found(type_: &str, at: jiff::Timestamp) -> Observed {
    let want = desired(Status::False, "Fine");
    Observed {
        type_: type_.into(),
        status: "False".into(),
        reason: want.reason,
        message: want.message,
        last_transition: Some(at),
        last_heartbeat: Some(at),
    }
}

/// A writer whose Node holds `conditions` (owned) when it starts.
fn start_on(config: ReportConfig, conditions: Vec<Observed>) -> Harness {
    let h = start(config);
    h.port.with(|n| {
        n.state.owned = conditions.iter().map(|c| c.type_.clone()).collect();
        n.state.conditions = conditions;
        n.rv += 1;
    });
    h.observed.send_replace(Some(h.port.observation()));
    h
}

/// A writer that starts on a Node whose conditions already say what it
/// wants (an agent restarted within a heartbeat of its last write) writes
/// nothing at first, and still heartbeats once the Node's heartbeat falls
/// due, with nothing else happening to wake it.
#[tokio::test(start_paused = true)]
async fn a_new_writer_that_finds_its_conditions_current_still_heartbeats() {
    let config = ReportConfig {
        heartbeat: Duration::from_secs(60),
        ..Default::default()
    };
    // The previous agent's write, 20 s ago.
    let written = jiff::Timestamp::now() - jiff::SignedDuration::from_secs(20);
    let h = start_on(config, vec![found("A", written)]);
    h.reporter.set("A", desired(Status::False, "Fine"));
    h.reporter.mark_initialized();
    settle().await;
    assert_eq!(h.port.with(|n| n.applies), 0, "nothing is due yet");
    // Due 40 s after the start; a second of slack.
    tokio::time::sleep(Duration::from_secs(40)).await;
    assert_eq!(
        h.port.with(|n| n.applies),
        1,
        "the heartbeat that fell due was written"
    );
    let after = h.port.get("A").unwrap();
    assert!(after.last_heartbeat > Some(written));
    assert_eq!(after.last_transition, Some(written));
    // And from then on, one a heartbeat.
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(h.port.with(|n| n.applies), 2);
    h.shutdown.cancel();
}

/// A type evaluated after the first plan, whose heartbeat on the Node is
/// older than those the writer timed its first heartbeat by, is heartbeated
/// when it falls due, not when the others do.
#[tokio::test(start_paused = true)]
async fn a_type_evaluated_later_with_an_older_heartbeat_brings_the_first_heartbeat_forward() {
    let config = ReportConfig {
        heartbeat: Duration::from_secs(60),
        ..Default::default()
    };
    let ago = |secs| jiff::Timestamp::now() - jiff::SignedDuration::from_secs(secs);
    let h = start_on(config, vec![found("A", ago(5)), found("B", ago(40))]);
    // B is declared, not evaluated yet: carried over, not timed.
    h.reporter.declare("B");
    h.reporter.set("A", desired(Status::False, "Fine"));
    h.reporter.mark_initialized();
    settle().await;
    assert_eq!(h.port.with(|n| n.applies), 0, "nothing is due yet");
    // B evaluates to what the Node already says: due 20 s after the start,
    // A only at 55 s.
    h.reporter.set("B", desired(Status::False, "Fine"));
    settle().await;
    assert_eq!(h.port.with(|n| n.applies), 0, "still nothing due");
    tokio::time::sleep(Duration::from_secs(20)).await;
    assert_eq!(
        h.port.with(|n| n.applies),
        1,
        "B's heartbeat was written when it fell due"
    );
    h.shutdown.cancel();
}

/// A heartbeat on the Node that reads as later than the clock (the wall
/// clock set back across a restart) is due one heartbeat from the start,
/// not one heartbeat after the clock has caught up with it.
#[tokio::test(start_paused = true)]
async fn a_new_writer_that_finds_a_heartbeat_from_the_future_heartbeats_within_one_interval() {
    let config = ReportConfig {
        heartbeat: Duration::from_secs(60),
        ..Default::default()
    };
    let ahead = jiff::Timestamp::now() + jiff::SignedDuration::from_secs(30);
    let h = start_on(config, vec![found("A", ahead)]);
    h.reporter.set("A", desired(Status::False, "Fine"));
    h.reporter.mark_initialized();
    settle().await;
    assert_eq!(h.port.with(|n| n.applies), 0, "nothing is due yet");
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(
        h.port.with(|n| n.applies),
        1,
        "written one heartbeat after the start, not 30 s later"
    );
    h.shutdown.cancel();
}

#[tokio::test(start_paused = true)]
async fn a_condition_removed_by_someone_else_is_reasserted() {
    let h = start(ReportConfig::default());
    h.reporter.mark_initialized();
    h.reporter.set("A", desired(Status::True, "Bad"));
    settle().await;
    // Someone deletes it; the watch tells the writer.
    h.port.with(|n| {
        n.state.conditions.clear();
        n.rv += 1;
    });
    h.observed.send_replace(Some(h.port.observation()));
    settle().await;
    assert_eq!(h.port.get("A").unwrap().reason, "Bad");
    assert_eq!(h.port.with(|n| n.applies), 2);
    h.shutdown.cancel();
}

#[tokio::test(start_paused = true)]
async fn removed_types_are_deleted_and_declared_ones_survive_a_restart() {
    let h = start(ReportConfig::default());
    h.reporter.mark_initialized();
    h.reporter.set("Keep", desired(Status::True, "Bad"));
    h.reporter.set("Drop", desired(Status::True, "Bad"));
    settle().await;
    let keep_before = h.port.get("Keep").unwrap();
    h.shutdown.cancel();

    // A new agent: declares Keep (not evaluated yet), not Drop.
    let mut registry = Registry::default();
    let (reporter, _queue) = Reporter::new(&ReportConfig::default(), &mut registry);
    let (tx, rx) = watch::channel(Some(h.port.observation()));
    let health = Health::new();
    let shutdown = CancellationToken::new();
    tokio::spawn(run_condition_writer(
        reporter.clone(),
        h.port.clone(),
        rx,
        health.register("c", Duration::from_secs(60)),
        ReportConfig::default(),
        shutdown.clone(),
    ));
    reporter.declare("Keep");
    reporter.mark_initialized();
    settle().await;
    assert_eq!(
        h.port.get("Drop"),
        None,
        "an undeclared owned type is deleted"
    );
    assert_eq!(
        h.port.get("Keep"),
        Some(keep_before),
        "a declared type is carried over verbatim"
    );
    reporter.remove("Keep");
    settle().await;
    assert_eq!(h.port.get("Keep"), None);
    drop(tx);
    shutdown.cancel();
}

#[derive(Clone, Default)]
struct FakeEvents {
    published: Arc<Mutex<Vec<EventRequest>>>,
    failures_left: Arc<AtomicUsize>,
}

impl EventPort for FakeEvents {
    async fn publish(&self, event: &EventRequest) -> Result<(), ReportError> {
        if self
            .failures_left
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(ReportError::NodeUnknown("flaky".into()));
        }
        self.published.lock().unwrap().push(event.clone());
        Ok(())
    }
}

#[tokio::test(start_paused = true)]
async fn events_are_rate_limited_per_reason_and_retried() {
    let config = ReportConfig {
        event_burst: 3,
        event_refill: Duration::from_secs(60),
        ..Default::default()
    };
    let mut registry = Registry::default();
    let (reporter, queue) = Reporter::new(&config, &mut registry);
    let port = FakeEvents::default();
    port.failures_left.store(2, Ordering::SeqCst);
    let shutdown = CancellationToken::new();
    tokio::spawn(run_event_publisher(
        reporter.clone(),
        queue,
        port.clone(),
        config,
        crate::server::Health::new().register("events", Duration::from_secs(60)),
        shutdown.clone(),
    ));
    for i in 0..20 {
        reporter.event(
            EventKind::Warning,
            "Flapping",
            "Detect",
            format!("flap {i}"),
        );
    }
    reporter.event(EventKind::Normal, "Other", "Detect", "other");
    settle().await;
    let published = port.published.lock().unwrap().clone();
    let notes: Vec<&str> = published.iter().map(|e| e.note.as_str()).collect();
    assert_eq!(notes, ["flap 0", "flap 1", "flap 2", "other"]);
    let text = crate::server::metrics::encode(&registry).unwrap();
    assert!(
        text.contains(
            "nodeguard_events_dropped_total{reason=\"Flapping\",cause=\"rate_limited\"} 17"
        ),
        "{text}"
    );
    assert!(
        text.contains("nodeguard_api_write_errors_total{resource=\"events\"} 2"),
        "{text}"
    );
    shutdown.cancel();
}

#[tokio::test(start_paused = true)]
async fn the_condition_gauge_follows_the_desired_state() {
    let mut registry = Registry::default();
    let (reporter, _q) = Reporter::new(&ReportConfig::default(), &mut registry);
    reporter.set("KernelDeadlock", desired(Status::True, "DockerHung"));
    reporter.set(
        "KernelDeadlock",
        desired(Status::False, "KernelHasNoDeadlock"),
    );
    let text = crate::server::metrics::encode(&registry).unwrap();
    assert!(text.contains(
        "nodeguard_condition{type=\"KernelDeadlock\",status=\"False\",reason=\"KernelHasNoDeadlock\"} 1"
    ));
    assert!(
        !text.contains("DockerHung"),
        "the previous reason's series is removed:\n{text}"
    );
    reporter.remove("KernelDeadlock");
    let text = crate::server::metrics::encode(&registry).unwrap();
    assert!(!text.contains("type=\"KernelDeadlock\""), "{text}");
}

/// Events queued when the agent stops (the last of a shutdown it waited
/// for) are still published, within the drain deadline.
#[tokio::test(start_paused = true)]
async fn events_queued_at_stop_are_published() {
    let mut registry = Registry::default();
    let config = ReportConfig::default();
    let (reporter, queue) = Reporter::new(&config, &mut registry);
    let port = FakeEvents::default();
    // The first publish fails: the stop comes during the retry's backoff.
    port.failures_left.store(1, Ordering::SeqCst);
    let shutdown = CancellationToken::new();
    reporter.event(
        EventKind::Normal,
        "ShutdownGroupDone",
        "Shutdown",
        "group 0",
    );
    reporter.event(
        EventKind::Normal,
        "ShutdownInhibitorReleased",
        "Shutdown",
        "released",
    );
    shutdown.cancel();
    let publisher = tokio::spawn(run_event_publisher(
        reporter.clone(),
        queue,
        port.clone(),
        config,
        crate::server::Health::new().register("events", Duration::from_secs(60)),
        shutdown.clone(),
    ));
    tokio::time::timeout(DRAIN_DEADLINE + Duration::from_secs(1), publisher)
        .await
        .expect("the publisher ends within the drain deadline")
        .unwrap();
    let notes: Vec<String> = port
        .published
        .lock()
        .unwrap()
        .iter()
        .map(|e| e.note.clone())
        .collect();
    assert_eq!(notes, ["group 0", "released"]);
}

/// A change made just before the agent stops (a shutdown's outcome when a
/// deferred stop goes on) is still written, without waiting for the
/// coalescing delay; an unchanged set is not written on stop.
#[tokio::test(start_paused = true)]
async fn a_change_right_before_stop_is_written() {
    let h = start(ReportConfig::default());
    h.reporter.mark_initialized();
    h.reporter.set("A", desired(Status::False, "Fine"));
    settle().await;
    let before = h.port.with(|n| n.applies);
    h.reporter.set("A", desired(Status::True, "Cancelled"));
    h.shutdown.cancel();
    settle().await;
    assert_eq!(h.port.get("A").unwrap().status, "True");
    assert_eq!(h.port.with(|n| n.applies), before + 1);

    let h = start(ReportConfig::default());
    h.reporter.mark_initialized();
    h.reporter.set("A", desired(Status::False, "Fine"));
    settle().await;
    let before = h.port.with(|n| n.applies);
    h.shutdown.cancel();
    settle().await;
    assert_eq!(
        h.port.with(|n| n.applies),
        before,
        "nothing changed: no write"
    );
}

#[test]
fn clip_keeps_the_mark_within_the_limit() {
    // (input, max) → the result is at most max bytes, a prefix plus `…`
    let cases = [
        ("short", 10, "short"),
        ("exactly10!", 10, "exactly10!"),
        ("eleven char", 10, "eleven …"),
        ("ééééé", 7, "éé…"),
        ("ééééé", 8, "éé…"),
        ("abc", 2, "…"),
    ];
    for (input, max, want) in cases {
        let got = crate::report::clip(input, max);
        assert_eq!(got, want, "{input:?} at {max}");
        assert!(got.len() <= max.max(3), "{got:?} is {} bytes", got.len());
    }
    let long = "x".repeat(5000);
    assert_eq!(crate::report::clip(&long, 1024).len(), 1024);
}

/// A confirmed Event tells its sender its fate: true once stored (after a
/// retry here), false when rate-limited, or when no publisher will ever
/// take it.
#[tokio::test(start_paused = true)]
async fn a_confirmed_event_says_whether_it_was_published() {
    let config = ReportConfig {
        event_burst: 1,
        event_refill: Duration::from_secs(3600),
        ..Default::default()
    };
    let mut registry = Registry::default();
    let (reporter, queue) = Reporter::new(&config, &mut registry);
    let port = FakeEvents::default();
    port.failures_left.store(1, Ordering::SeqCst);
    let shutdown = CancellationToken::new();
    let publisher = tokio::spawn(run_event_publisher(
        reporter.clone(),
        queue,
        port.clone(),
        config,
        crate::server::Health::new().register("events", Duration::from_secs(60)),
        shutdown.clone(),
    ));
    let first = reporter.event_confirmed(EventKind::Normal, "Last", "Do", "one".into());
    assert!(first.await, "stored after one failed attempt");
    assert_eq!(port.published.lock().unwrap().len(), 1);
    let limited = reporter.event_confirmed(EventKind::Normal, "Last", "Do", "two".into());
    assert!(!limited.await, "the reason's burst is spent");
    shutdown.cancel();
    publisher.await.unwrap();
    let orphan = reporter.event_confirmed(EventKind::Normal, "Other", "Do", "three".into());
    assert!(!orphan.await, "no publisher: not stored, and the wait ends");
}
