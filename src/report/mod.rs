//! The agent's voice in the cluster: the one place that writes nodeguard's
//! NodeConditions, and the Event recorder.
//!
//! Sources (eligibility, policy, probes, monitors, shutdown) call the cheap,
//! never-blocking [`Reporter`] methods. Two loops do the I/O through small
//! ports ([`StatusPort`], [`EventPort`]) so they can be tested with paused
//! time: [`run_condition_writer`] coalesces changes into few server-side
//! applies, retries with backoff and re-asserts after outages;
//! [`run_event_publisher`] rate-limits per reason and publishes.

pub mod conditions;
pub mod events;
pub mod kube;

/// `s` cut to at most `max` bytes at a character boundary, with `…` when
/// cut: what a condition message, an Event note or a probe's output keeps.
pub fn clip(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    // The mark counts: the result, `…` and all, is at most `max` bytes.
    let mut end = max.saturating_sub(ELLIPSIS.len());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{ELLIPSIS}", &s[..end])
}

const ELLIPSIS: &str = "…";

/// The API server refuses an Event whose note is longer (422, "can have at
/// most 1024 characters", counted in bytes).
pub const NOTE_LIMIT: usize = 1024;

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::{Notify, mpsc, oneshot, watch};
use tokio::time::{Instant, sleep, sleep_until};
use tokio_util::sync::CancellationToken;

use crate::clock::WallClock;
use crate::server::LoopHandle;
use crate::server::backoff::Backoff;
pub use conditions::{Desired, DesiredSet, NodeState, Observed, Status, Written};

#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("API request failed: {0}")]
    Api(#[from] ::kube::Error),
    #[error("the Node {0} is not known yet")]
    NodeUnknown(String),
}

impl ReportError {
    /// Whether the same request may succeed if sent again: not after the
    /// API server refused it as such (400, 403, 422), which would hold the
    /// Events queued behind it for seconds of retries.
    pub fn retryable(&self) -> bool {
        !matches!(self, ReportError::Api(::kube::Error::Api(s)) if [400, 403, 422].contains(&s.code))
    }
}

/// Tunables of the condition writer and event recorder.
#[derive(Clone, Debug)]
pub struct ReportConfig {
    /// Re-write owned conditions at least this often so stale agents show.
    pub heartbeat: Duration,
    /// Wait this long after a change for more changes before writing.
    pub coalesce: Duration,
    /// At most one write per this interval (urgent changes excepted).
    pub min_write_interval: Duration,
    /// Retry backoff bounds for failed writes.
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    /// Events per reason: a burst, then one per refill interval.
    pub event_burst: u32,
    pub event_refill: Duration,
    /// Events waiting to be published; beyond this they are dropped and counted.
    pub event_queue: usize,
    /// Writes that follow a policy edit wait this node's share of this
    /// window ([`conditions::spread_offset`]), so a fleet's writes after
    /// one edit spread over it. Zero: no wait.
    pub policy_spread: Duration,
}

impl Default for ReportConfig {
    fn default() -> Self {
        ReportConfig {
            heartbeat: Duration::from_secs(300),
            coalesce: Duration::from_millis(50),
            min_write_interval: Duration::from_millis(250),
            backoff_initial: Duration::from_millis(200),
            backoff_max: Duration::from_secs(3),
            event_burst: 10,
            event_refill: Duration::from_secs(30),
            event_queue: 1024,
            policy_spread: Duration::from_secs(10),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventKind {
    Normal,
    Warning,
}

/// An Event about this node, as a source asks for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventRequest {
    pub kind: EventKind,
    /// CamelCase reason, e.g. `NodeIneligible`.
    pub reason: String,
    /// What nodeguard did or noticed, CamelCase, e.g. `Detect`.
    pub action: String,
    /// One human sentence.
    pub note: String,
    /// The source component the Event names (`deprecatedSource`, what
    /// `kubectl get events` shows as its source): a monitor imported from
    /// node-problem-detector speaks as NPD's monitor did. `None`: the
    /// agent's own (`reportingController`).
    pub source: Option<String>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ConditionLabels {
    r#type: String,
    status: String,
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DroppedLabels {
    reason: String,
    cause: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResourceLabels {
    resource: String,
}

#[derive(Clone, Debug, Default)]
struct ReportMetrics {
    condition: Family<ConditionLabels, Gauge>,
    condition_writes: Counter,
    events: Family<ReasonLabels, Counter>,
    events_dropped: Family<DroppedLabels, Counter>,
    api_write_errors: Family<ResourceLabels, Counter>,
}

/// Every `resource` of `nodeguard_api_write_errors_total`.
const WRITTEN_RESOURCES: [&str; 2] = ["nodes/status", "events"];

impl ReportMetrics {
    fn register(&self, registry: &mut Registry) {
        // At 0 from the start: the first failure is then an increase that
        // Prometheus sees, and the series an alert reads always exists.
        for resource in WRITTEN_RESOURCES {
            let _ = self.api_write_errors.get_or_create(&ResourceLabels {
                resource: resource.to_string(),
            });
        }
        registry.register(
            "nodeguard_condition",
            "1 for each condition nodeguard owns, labelled with its current status and reason",
            self.condition.clone(),
        );
        registry.register(
            "nodeguard_condition_writes",
            "Server-side applies of nodeguard's NodeConditions that succeeded",
            self.condition_writes.clone(),
        );
        registry.register(
            "nodeguard_events",
            "Events published, by reason",
            self.events.clone(),
        );
        registry.register(
            "nodeguard_events_dropped",
            "Events not published, by reason and cause (rate_limited, queue_full, api_error)",
            self.events_dropped.clone(),
        );
        registry.register(
            "nodeguard_api_write_errors",
            "Failed API writes, by resource",
            self.api_write_errors.clone(),
        );
    }

    fn published(&self, reason: &str) {
        self.events
            .get_or_create(&ReasonLabels {
                reason: reason.to_string(),
            })
            .inc();
    }

    fn dropped(&self, reason: &str, cause: &str) {
        self.events_dropped
            .get_or_create(&DroppedLabels {
                reason: reason.to_string(),
                cause: cause.to_string(),
            })
            .inc();
    }

    fn write_error(&self, resource: &str) {
        self.api_write_errors
            .get_or_create(&ResourceLabels {
                resource: resource.to_string(),
            })
            .inc();
    }
}

struct Shared {
    desired: Mutex<DesiredSet>,
    /// The effective-policies annotation, once known.
    effective: Mutex<Option<String>>,
    /// Ordinary writes wait for it (a policy edit's spread).
    spread: Mutex<Option<Spread>>,
    initialized: AtomicBool,
    urgent: AtomicBool,
    changed: Notify,
    events: mpsc::Sender<Queued>,
    metrics: ReportMetrics,
    clock: WallClock,
}

/// Cheap handle that every source uses. Clone freely.
#[derive(Clone)]
pub struct Reporter {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Reporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reporter")
            .field("desired", &*self.lock())
            .finish()
    }
}

/// An Event in the queue, with who waits for its fate (published: true;
/// dropped: false).
struct Queued {
    req: EventRequest,
    done: Option<oneshot::Sender<bool>>,
}

impl Queued {
    fn settle(self, published: bool) {
        if let Some(done) = self.done {
            let _ = done.send(published);
        }
    }
}

/// The receiving end of the event queue, for [`run_event_publisher`].
pub struct EventQueue(mpsc::Receiver<Queued>);

#[cfg(test)]
impl EventQueue {
    /// The Events queued so far (tests that run no publisher).
    pub fn drain(&mut self) -> Vec<EventRequest> {
        std::iter::from_fn(|| self.0.try_recv().ok().map(|q| q.req)).collect()
    }
}

impl Reporter {
    /// A reporter with its metrics registered; the event queue goes to
    /// [`run_event_publisher`].
    pub fn new(config: &ReportConfig, registry: &mut Registry) -> (Reporter, EventQueue) {
        let (tx, rx) = mpsc::channel(config.event_queue.max(1));
        let metrics = ReportMetrics::default();
        metrics.register(registry);
        let reporter = Reporter {
            shared: Arc::new(Shared {
                desired: Mutex::new(DesiredSet::new()),
                effective: Mutex::new(None),
                spread: Mutex::new(None),
                initialized: AtomicBool::new(false),
                urgent: AtomicBool::new(false),
                changed: Notify::new(),
                events: tx,
                metrics,
                clock: WallClock::new(),
            }),
        };
        (reporter, EventQueue(rx))
    }

    fn lock(&self) -> MutexGuard<'_, DesiredSet> {
        self.shared
            .desired
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    fn update_gauge(&self, type_: &str, old: Option<&Desired>, new: Option<&Desired>) {
        let labels = |d: &Desired| ConditionLabels {
            r#type: type_.to_string(),
            status: d.status.as_str().to_string(),
            reason: d.reason.clone(),
        };
        if let Some(old) = old {
            self.shared.metrics.condition.remove(&labels(old));
        }
        if let Some(new) = new {
            self.shared
                .metrics
                .condition
                .get_or_create(&labels(new))
                .set(1);
        }
    }

    /// Claims a condition type whose value is not known yet: whatever the
    /// Node says for it (from before a restart) is kept until [`Reporter::set`].
    pub fn declare(&self, type_: &str) {
        let mut d = self.lock();
        if !d.contains_key(type_) {
            d.insert(type_.to_string(), None);
        }
    }

    /// Sets a condition. Writes are coalesced; this never blocks.
    pub fn set(&self, type_: &str, desired: Desired) {
        debug_assert!(
            conditions::is_camel_case(&desired.reason),
            "reason {:?}",
            desired.reason
        );
        let old = self.lock().insert(type_.to_string(), Some(desired.clone()));
        if old.as_ref() == Some(&Some(desired.clone())) {
            return;
        }
        self.update_gauge(type_, old.flatten().as_ref(), Some(&desired));
        self.confirm_spread();
        self.shared.changed.notify_one();
    }

    /// Like [`Reporter::set`] but written without waiting for the write
    /// interval (for shutdown, where every 100 ms counts).
    pub fn set_urgent(&self, type_: &str, desired: Desired) {
        self.shared.urgent.store(true, Ordering::SeqCst);
        self.set(type_, desired);
    }

    /// Stops owning a condition type: it is deleted from the Node.
    pub fn remove(&self, type_: &str) {
        let old = self.lock().remove(type_);
        if let Some(old) = old {
            self.update_gauge(type_, old.as_ref(), None);
            self.confirm_spread();
            self.shared.changed.notify_one();
        }
    }

    /// Sets the effective-policies annotation, written with the conditions.
    pub fn set_effective(&self, value: String) {
        let mut e = self
            .shared
            .effective
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if e.as_deref() != Some(value.as_str()) {
            *e = Some(value);
            drop(e);
            self.confirm_spread();
            self.shared.changed.notify_one();
        }
    }

    fn effective(&self) -> Option<String> {
        self.shared
            .effective
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Holds ordinary writes for `delay` (the changes of a policy edit,
    /// spread over a fleet). Urgent changes, and conditions `True` here
    /// and not on the Node (other than the `exempt` types, the edit's own
    /// verdict), are written at once with everything pending. Call it
    /// before making the edit's changes. A spread already pending keeps
    /// its earlier end, and one that arrives while the writer waits for
    /// another does not push the write back.
    pub fn spread_writes(&self, delay: Duration, exempt: &[&str]) {
        if delay.is_zero() {
            return;
        }
        let until = Instant::now() + delay;
        let mut s = self.shared.spread.lock().unwrap_or_else(|e| e.into_inner());
        if s.as_ref().is_none_or(|s| s.until > until) {
            *s = Some(Spread {
                since: Instant::now(),
                until,
                confirmed: false,
                exempt: exempt.iter().map(|t| t.to_string()).collect(),
            });
        }
    }

    /// The end of the edit [`Reporter::spread_writes`] began: if it
    /// changed nothing, nothing is held.
    pub fn edit_done(&self) {
        let mut s = self.shared.spread.lock().unwrap_or_else(|e| e.into_inner());
        if s.as_ref().is_some_and(|s| !s.confirmed) {
            *s = None;
        }
    }

    /// A change was made: a pending spread holds it.
    fn confirm_spread(&self) {
        if let Some(s) = self
            .shared
            .spread
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
        {
            s.confirmed = true;
        }
    }

    /// The spread to wait for, once its edit changed something.
    fn take_spread(&self) -> Option<Spread> {
        let mut s = self.shared.spread.lock().unwrap_or_else(|e| e.into_inner());
        if s.as_ref().is_some_and(|s| s.confirmed) {
            s.take()
        } else {
            None
        }
    }

    /// Drops a spread whose edit began before `planned` (a write planned
    /// then has carried its changes); one that began later still holds.
    fn clear_spread(&self, planned: Instant) {
        let mut s = self.shared.spread.lock().unwrap_or_else(|e| e.into_inner());
        if s.as_ref().is_some_and(|s| s.since <= planned) {
            *s = None;
        }
    }

    /// Every source has declared its types: the writer may now write (and
    /// so delete owned types nobody declared).
    pub fn mark_initialized(&self) {
        self.shared.initialized.store(true, Ordering::SeqCst);
        self.shared.changed.notify_one();
    }

    pub fn is_initialized(&self) -> bool {
        self.shared.initialized.load(Ordering::SeqCst)
    }

    /// Failed API writes so far (`nodeguard_api_write_errors_total`, every
    /// resource).
    pub fn api_write_errors(&self) -> u64 {
        WRITTEN_RESOURCES
            .iter()
            .map(|resource| {
                self.shared
                    .metrics
                    .api_write_errors
                    .get_or_create(&ResourceLabels {
                        resource: resource.to_string(),
                    })
                    .get()
            })
            .sum()
    }

    /// The desired set now.
    pub fn desired(&self) -> DesiredSet {
        self.lock().clone()
    }

    /// Queues an Event about the node. Never blocks; a full queue drops
    /// the event and counts it.
    pub fn event(&self, kind: EventKind, reason: &str, action: &str, note: impl Into<String>) {
        self.queue(None, kind, reason, action, note.into(), None);
    }

    /// Queues an Event like [`Reporter::event`], naming `source` as its
    /// source component (see [`EventRequest::source`]).
    pub fn event_from(
        &self,
        source: Option<&str>,
        kind: EventKind,
        reason: &str,
        action: &str,
        note: impl Into<String>,
    ) {
        self.queue(source, kind, reason, action, note.into(), None);
    }

    /// Queues an Event like [`Reporter::event`]; the future resolves once
    /// the publisher is done with it: true when the API server stored it,
    /// false when it was dropped (full queue, rate limit, errors, a
    /// publisher that has stopped). For a last word that must be out
    /// before something ends, awaited within a deadline.
    pub fn event_confirmed(
        &self,
        kind: EventKind,
        reason: &str,
        action: &str,
        note: String,
    ) -> impl std::future::Future<Output = bool> + use<> {
        let (tx, rx) = oneshot::channel();
        self.queue(None, kind, reason, action, note, Some(tx));
        async move { rx.await.unwrap_or(false) }
    }

    fn queue(
        &self,
        source: Option<&str>,
        kind: EventKind,
        reason: &str,
        action: &str,
        note: String,
        done: Option<oneshot::Sender<bool>>,
    ) {
        debug_assert!(conditions::is_camel_case(reason), "reason {reason:?}");
        let req = EventRequest {
            kind,
            reason: reason.to_string(),
            action: action.to_string(),
            note: clip(&note, NOTE_LIMIT),
            source: source.map(str::to_string),
        };
        if self.shared.events.try_send(Queued { req, done }).is_err() {
            self.shared.metrics.dropped(reason, "queue_full");
        }
    }
}

/// A policy edit's hold on ordinary writes ([`Reporter::spread_writes`]).
struct Spread {
    /// When the edit began.
    since: Instant,
    until: Instant,
    /// The edit changed something to write (until then the writer leaves
    /// the spread alone, and [`Reporter::edit_done`] drops it if never).
    confirmed: bool,
    /// Condition types the edit itself sets: not a problem found meanwhile.
    exempt: std::collections::BTreeSet<String>,
}

/// What the writer knows of the Node: its conditions and ownership, and
/// the resourceVersion they were read at (to tell newer from older).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Observation {
    pub state: NodeState,
    pub resource_version: Option<u64>,
}

/// Port: writes nodeguard's whole condition set to the Node's status and
/// returns the Node as it is after the write.
pub trait StatusPort: Send + Sync + 'static {
    /// `effective`: the effective-policies annotation to apply with them.
    fn apply(
        &self,
        conditions: &[Written],
        effective: Option<&str>,
    ) -> impl Future<Output = Result<Observation, ReportError>> + Send;
}

/// Port: publishes one Event about the node.
pub trait EventPort: Send + Sync + 'static {
    fn publish(&self, event: &EventRequest)
    -> impl Future<Output = Result<(), ReportError>> + Send;
}

fn newest(watched: Option<Observation>, applied: Option<Observation>) -> Option<Observation> {
    match (watched, applied) {
        (Some(w), Some(a)) => match (w.resource_version, a.resource_version) {
            (Some(wv), Some(av)) if av > wv => Some(a),
            _ => Some(w),
        },
        (w, a) => w.or(a),
    }
}

/// The condition writer loop. Runs until `shutdown`.
///
/// Wakes on a desired change, a change of the Node (someone removed or
/// rewrote our condition: re-assert), or a heartbeat; waits `coalesce` and
/// the write interval so bursts become one apply; retries failures with
/// capped exponential backoff, re-planning from the latest desired state
/// each time, so nothing is lost and the newest state wins.
pub async fn run_condition_writer<P: StatusPort>(
    reporter: Reporter,
    port: P,
    mut observed: watch::Receiver<Option<Observation>>,
    health: LoopHandle,
    config: ReportConfig,
    shutdown: CancellationToken,
) {
    let shared = &reporter.shared;
    let mut applied: Option<Observation> = None;
    let mut last_write: Option<Instant> = None;
    // Before this writer's first write: when the heartbeats it found on the
    // Node fall due (a restarted agent that found them current), read from
    // the Node's wall times once and kept on the monotonic clock, so a step
    // of the wall clock afterwards moves it no more than it moves a
    // heartbeat after a write of our own.
    let mut found_due: Option<Instant> = None;
    let mut failing = false;
    health.updated();
    loop {
        let heartbeat_at = last_write.map(|t| t + config.heartbeat).or(found_due);
        tokio::select! {
            _ = shutdown.cancelled() => {
                final_write(&reporter, &port, &observed, &applied, config.heartbeat).await;
                return;
            }
            _ = shared.changed.notified() => {}
            r = observed.changed() => if r.is_err() { return },
            _ = async { sleep_until(heartbeat_at.unwrap()).await }, if heartbeat_at.is_some() => {}
        }
        if !reporter.is_initialized() {
            continue;
        }
        health.queued();
        let urgent = shared.urgent.swap(false, Ordering::SeqCst);
        if urgent {
            // This write carries whatever a spread held back.
            reporter.clear_spread(Instant::now());
        } else {
            // Coalesce and space out ordinary writes (and hold those of a
            // policy edit for this node's spread), but an urgent change (a
            // shutdown starting) or a problem found meanwhile goes out at
            // once.
            let mut until = Instant::now() + config.coalesce;
            if let Some(t) = last_write {
                until = until.max(t + config.min_write_interval);
            }
            let node = || newest(observed.borrow().clone(), applied.clone()).map(|o| o.state);
            // Whether a condition is True here and not on the Node.
            let problem_pending = |spread: &Spread| {
                node().is_some_and(|n| {
                    conditions::problem_pending(&reporter.desired(), &n, &spread.exempt)
                })
            };
            let mut spread: Option<Spread> = None;
            loop {
                if let Some(s) = reporter.take_spread()
                    && spread.is_none()
                {
                    // Held only when the edit changed something to write
                    // (a leftover hold must not delay what follows it) and
                    // no problem is already waiting to go out.
                    let to_write = node().is_none_or(|n| {
                        conditions::plan(
                            &reporter.desired(),
                            reporter.effective().as_deref(),
                            &n,
                            shared.clock.now(),
                            config.heartbeat,
                        )
                        .is_some()
                    });
                    if to_write && !problem_pending(&s) {
                        tracing::debug!(wait = ?s.until.saturating_duration_since(Instant::now()), "policy edit: node status write spread");
                        until = until.max(s.until);
                        spread = Some(s);
                        // Waiting for the spread is not being stuck.
                        health.updated();
                    }
                }
                tokio::select! {
                    _ = shutdown.cancelled() => {
                        final_write(&reporter, &port, &observed, &applied, config.heartbeat).await;
                        return;
                    }
                    _ = sleep_until(until) => break,
                    _ = shared.changed.notified() => {
                        if shared.urgent.swap(false, Ordering::SeqCst) {
                            break;
                        }
                        if spread.as_ref().is_some_and(problem_pending) {
                            tracing::debug!("a problem found during the spread: written now");
                            break;
                        }
                    }
                }
            }
            if spread.is_some() {
                health.queued();
            }
        }
        let mut backoff = Backoff::new(config.backoff_initial, config.backoff_max);
        loop {
            let Some(obs) = newest(observed.borrow_and_update().clone(), applied.clone()) else {
                tracing::debug!("the Node is not known yet; conditions are written once it is");
                // A time past would wake this loop again and again.
                found_due = found_due.filter(|t| *t > Instant::now());
                break;
            };
            let planned = Instant::now();
            let desired = reporter.desired();
            let now = shared.clock.now();
            // A heartbeat is due by the monotonic clock since our last
            // write (before the first, since those found on the Node fell
            // due), whatever the wall clock did meanwhile (set back, the
            // Node's heartbeat would read as recent and the timer would
            // spin until the wall clock caught up).
            let found_passed =
                last_write.is_none() && found_due.is_some_and(|t| t <= Instant::now());
            let heartbeat =
                if found_passed || last_write.is_some_and(|t| t.elapsed() >= config.heartbeat) {
                    Duration::ZERO
                } else {
                    config.heartbeat
                };
            let effective = reporter.effective();
            let Some(plan) =
                conditions::plan(&desired, effective.as_deref(), &obs.state, now, heartbeat)
            else {
                if last_write.is_none() {
                    // Nothing written yet and nothing due: wake when what
                    // the Node holds falls due (at least a second on, so
                    // second-granular times on the Node cannot spin this).
                    // Past it, nothing was due even so: nothing of ours to
                    // heartbeat is on the Node, and none is set. Before it,
                    // a type evaluated since may fall due sooner; the wall
                    // clock read again only ever brings it forward.
                    let due =
                        conditions::heartbeat_due_in(&desired, &obs.state, now, config.heartbeat)
                            .map(|d| Instant::now() + d.max(Duration::from_secs(1)));
                    found_due = match found_due {
                        Some(t) if !found_passed => Some(due.map_or(t, |d| d.min(t))),
                        _ => due,
                    };
                }
                break;
            };
            match port
                .apply(&plan.conditions, plan.effective.as_deref())
                .await
            {
                Ok(after) => {
                    shared.metrics.condition_writes.inc();
                    if failing {
                        tracing::info!("node conditions written again after failures");
                        failing = false;
                    }
                    tracing::debug!(changed = ?plan.why.changed, removed = ?plan.why.removed, heartbeat = plan.why.heartbeat, effective = plan.why.effective, "node conditions written");
                    applied = Some(after);
                    last_write = Some(Instant::now());
                    // What a spread asked for has just been written.
                    reporter.clear_spread(planned);
                    break;
                }
                Err(err) => {
                    shared.metrics.write_error("nodes/status");
                    let delay = backoff.next_delay();
                    if failing {
                        tracing::debug!(error = %err, retry_in = ?delay, "node conditions still not written");
                    } else {
                        tracing::warn!(error = %err, retry_in = ?delay, "cannot write node conditions; retrying (nothing is lost)");
                    }
                    failing = true;
                    // Waiting on the API is not being stuck.
                    health.updated();
                    tokio::select! {
                        _ = shutdown.cancelled() => {
                            final_write(&reporter, &port, &observed, &applied, config.heartbeat).await;
                            return;
                        }
                        _ = sleep(delay) => {}
                    }
                    health.queued();
                }
            }
        }
        health.updated();
    }
}

/// The event publisher loop: rate limit per reason, publish, retry briefly.
pub async fn run_event_publisher<P: EventPort>(
    reporter: Reporter,
    EventQueue(mut queue): EventQueue,
    port: P,
    config: ReportConfig,
    health: LoopHandle,
    shutdown: CancellationToken,
) {
    let metrics = &reporter.shared.metrics;
    let mut limiter = events::RateLimiter::new(config.event_burst, config.event_refill);
    health.updated();
    loop {
        let queued = tokio::select! {
            _ = shutdown.cancelled() => {
                drain_events(None, &mut queue, &port, metrics).await;
                return;
            }
            ev = queue.recv() => match ev { Some(ev) => ev, None => return },
        };
        let ev = &queued.req;
        // Each event is handled (published or dropped) within its bounded
        // retries; one that takes longer than the loop's timeout is a stall.
        health.queued();
        if !limiter.allow(&ev.reason, Instant::now()) {
            metrics.dropped(&ev.reason, "rate_limited");
            tracing::debug!(reason = %ev.reason, "event rate-limited");
            queued.settle(false);
            health.updated();
            continue;
        }
        let mut backoff = Backoff::new(config.backoff_initial, config.backoff_max);
        let mut published = false;
        for attempt in 1..=4 {
            match port.publish(ev).await {
                Ok(()) => {
                    published = true;
                    break;
                }
                Err(err) => {
                    metrics.write_error("events");
                    tracing::warn!(reason = %ev.reason, attempt, error = %err, "cannot publish event");
                    if !err.retryable() {
                        break;
                    }
                    // Waiting on the API is not being stuck: each attempt
                    // (its calls may wait out a shedding API server, up to
                    // k8s::retry_after::WAIT_BUDGET each) is a span of its own.
                    health.updated();
                    tokio::select! {
                        _ = shutdown.cancelled() => {
                            // This one first, then the rest.
                            drain_events(Some(queued), &mut queue, &port, metrics).await;
                            return;
                        }
                        _ = sleep(backoff.next_delay()) => {}
                    }
                    health.queued();
                }
            }
        }
        if published {
            metrics.published(&ev.reason);
        } else {
            metrics.dropped(&ev.reason, "api_error");
        }
        queued.settle(published);
        health.updated();
    }
}

/// On stop: one last write, within [`DRAIN_DEADLINE`], when a condition
/// changed since the last write (a shutdown's or a cancel's outcome, just
/// before a deferred stop goes on). Never a heartbeat-only write.
async fn final_write<P: StatusPort>(
    reporter: &Reporter,
    port: &P,
    observed: &watch::Receiver<Option<Observation>>,
    applied: &Option<Observation>,
    heartbeat: Duration,
) {
    if !reporter.is_initialized() {
        return;
    }
    let Some(obs) = newest(observed.borrow().clone(), applied.clone()) else {
        return;
    };
    let desired = reporter.desired();
    let now = reporter.shared.clock.now();
    let effective = reporter.effective();
    let Some(plan) = conditions::plan(&desired, effective.as_deref(), &obs.state, now, heartbeat)
    else {
        return;
    };
    if plan.why.changed.is_empty() && plan.why.removed.is_empty() && !plan.why.effective {
        return;
    }
    match tokio::time::timeout(
        DRAIN_DEADLINE,
        port.apply(&plan.conditions, plan.effective.as_deref()),
    )
    .await
    {
        Ok(Ok(_)) => {
            reporter.shared.metrics.condition_writes.inc();
            tracing::debug!(changed = ?plan.why.changed, "node conditions written on stop");
        }
        Ok(Err(e)) => tracing::warn!(error = %e, "cannot write node conditions on stop"),
        Err(_) => tracing::warn!(
            "node conditions not written on stop: the API server did not answer in time"
        ),
    }
}

/// How long a stopping agent spends publishing the Events still queued
/// (those of a shutdown it has just finished, a final reason to stop).
pub const DRAIN_DEADLINE: Duration = Duration::from_secs(3);

/// On stop: `first` (an Event being retried), then each queued Event is
/// published, retried every 100 ms, all within [`DRAIN_DEADLINE`]; what is
/// left then is counted as dropped.
async fn drain_events<P: EventPort>(
    mut first: Option<Queued>,
    queue: &mut mpsc::Receiver<Queued>,
    port: &P,
    metrics: &ReportMetrics,
) {
    let deadline = Instant::now() + DRAIN_DEADLINE;
    while let Some(queued) = first.take().or_else(|| queue.try_recv().ok()) {
        let ev = &queued.req;
        let published = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break false;
            }
            if let Ok(Ok(())) = tokio::time::timeout(left, port.publish(ev)).await {
                break true;
            }
            sleep(Duration::from_millis(100).min(left)).await;
        };
        if published {
            metrics.published(&ev.reason);
        } else {
            metrics.dropped(&ev.reason, "stopping");
        }
        queued.settle(published);
    }
}

#[cfg(test)]
mod tests;
