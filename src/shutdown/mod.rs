//! Graceful node shutdown with systemd-logind.
//!
//! While `spec.shutdown` is set, nodeguard holds a *delay* inhibitor lock
//! for `shutdown` (raising logind's `InhibitDelayMaxSec` with a drop-in when
//! the policy needs more). On `PrepareForShutdown(true)` it sets
//! `GracefulShutdown=True` and its `NoSchedule` taint at once, then
//! terminates pods by priority group, lowest first, through the Eviction
//! API (PodDisruptionBudgets honoured; a refusal is retried and, when the
//! group's window is running out, escalated to a delete with the remaining
//! grace and an Event naming the PDB). The decision core plans the group
//! windows within logind's limit (the highest-priority groups keep their
//! time, the lowest are shortened first) and steps each pod; every API call
//! ends with its group's window, and the inhibitor is released after the
//! last group or at the plan's end, whatever the API does. On
//! `PrepareForShutdown(false)` it applies the policy as it is now, takes the
//! lock again (unless the policy turned shutdown off meanwhile) and removes
//! its own taint. A state file lets a restarted agent resume, and the first
//! start after a reboot clean up and report.

pub mod cluster;
pub mod core;
pub mod keep;
pub mod logind;
pub mod state;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use k8s_openapi::api::core::v1::Pod;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::{mpsc, watch};
use tokio::time::{Instant, sleep, sleep_until, timeout, timeout_at};
use tokio_util::sync::CancellationToken;

use crate::clock::WallClock;
use crate::k8s::watch::Snapshot;
use crate::policy::{Escalation, ShutdownSpec};
use crate::report::{Desired, EventKind, Reporter, Status};
use crate::server::LoopHandle;
use crate::server::backoff::Backoff;
use crate::state_dir::StateWrites;
use cluster::{ClusterPort, Evicted, pod_facts};
use core::{GroupSpec, Include};
use keep::Keeper;
use logind::{InhibitLock, LogindConnector, LogindEvent, LogindPort};
use state::{OnStart, ShutdownRecord};

/// True while a shutdown is in progress.
pub const CONDITION: &str = "GracefulShutdown";
/// True while nodeguard cannot guarantee a graceful shutdown.
pub const UNAVAILABLE: &str = "GracefulShutdownUnavailable";

#[derive(Debug, thiserror::Error)]
pub enum ShutdownError {
    #[error("D-Bus: {0}")]
    Bus(#[from] zbus::Error),
    #[error("API request failed: {0}")]
    Api(#[from] kube::Error),
    #[error("conflicting updates to {0}; gave up after retries")]
    Conflict(String),
    #[error("the API server throttles requests (429: {0})")]
    Throttled(String),
    #[error(transparent)]
    Taint(#[from] crate::k8s::taints::TaintError),
    #[error("cannot write the shutdown state {path}: {source}")]
    State {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the shutdown state {path} is corrupt ({message}); moved it to {aside} and started afresh"
    )]
    CorruptState {
        path: PathBuf,
        aside: PathBuf,
        message: String,
    },
    #[error("cannot write the logind drop-in {path}: {source}")]
    DropIn {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl ShutdownError {
    /// Whether a failed write may have been applied (its answer lost).
    pub fn maybe_applied(&self) -> bool {
        match self {
            ShutdownError::Taint(t) => t.maybe_applied(),
            ShutdownError::Api(e) => crate::k8s::taints::may_have_landed(e),
            _ => true,
        }
    }
}

/// The policy's shutdown section, resolved. The shutdown record keeps the
/// one a shutdown began with (`ShutdownRecord::plan`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ShutdownConfig {
    pub groups: Vec<GroupSpec>,
    pub include: Include,
    pub escalate: bool,
    pub escalate_after_percent: u8,
    pub safety_margin: Duration,
    /// `None`: never write a drop-in.
    pub drop_in_dir: Option<PathBuf>,
}

impl ShutdownConfig {
    pub fn from_spec(s: &ShutdownSpec) -> Self {
        let groups = if s.grace_period_by_priority.is_empty() {
            core::migrate(
                Duration::from_secs(s.grace_period_seconds.unwrap_or(0).into()),
                Duration::from_secs(s.critical_pods_grace_period_seconds.unwrap_or(0).into()),
            )
        } else {
            s.grace_period_by_priority
                .iter()
                .map(|g| GroupSpec {
                    priority: g.priority,
                    grace: Duration::from_secs(g.grace_period_seconds.into()),
                })
                .collect()
        };
        ShutdownConfig {
            groups: core::sorted(groups),
            include: Include {
                daemonsets: s.evict_daemon_set_pods,
                mirror: s.evict_mirror_pods,
                tolerating: s.evict_tolerating_pods,
            },
            escalate: s.escalation == Escalation::Delete,
            escalate_after_percent: s.escalate_after_percent,
            safety_margin: Duration::from_secs(s.safety_margin_seconds.into()),
            drop_in_dir: (!s.logind_drop_in_dir.is_empty())
                .then(|| PathBuf::from(&s.logind_drop_in_dir)),
        }
    }

    /// The inhibit delay this configuration needs from logind.
    pub fn needed_delay(&self) -> Duration {
        core::total_grace(&self.groups) + self.safety_margin
    }

    /// What a shutdown would get with logind's maximum delay `allowed`.
    pub fn readiness(&self, allowed: Duration) -> core::Readiness {
        core::Readiness::new(&self.groups, allowed, self.safety_margin)
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PodLabels {
    group: i32,
    outcome: String,
}

type FloatGauge = Gauge<f64, std::sync::atomic::AtomicU64>;

/// `nodeguard_shutdown_*` metrics.
#[derive(Clone, Debug, Default)]
pub struct ShutdownMetrics {
    start_time: FloatGauge,
    end_time: FloatGauge,
    last_duration: FloatGauge,
    pods: Family<PodLabels, Counter>,
    inhibitor_held: Gauge,
    inhibit_delay_max: FloatGauge,
    inhibit_delay_needed: FloatGauge,
}

impl ShutdownMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = ShutdownMetrics::default();
        registry.register(
            "nodeguard_shutdown_start_time_seconds",
            "Unix time the last graceful shutdown started (0: none in this process)",
            m.start_time.clone(),
        );
        registry.register(
            "nodeguard_shutdown_end_time_seconds",
            "Unix time the last graceful shutdown released the inhibitor",
            m.end_time.clone(),
        );
        registry.register(
            "nodeguard_shutdown_last_duration_seconds",
            "How long the last graceful shutdown took, as recorded before the reboot",
            m.last_duration.clone(),
        );
        registry.register(
            "nodeguard_shutdown_pods",
            "Pods handled during shutdown, by priority group and outcome (evicted, escalated, blocked, failed, skipped, already_terminating)",
            m.pods.clone(),
        );
        registry.register(
            "nodeguard_shutdown_inhibitor_held",
            "1 while nodeguard holds its logind delay inhibitor",
            m.inhibitor_held.clone(),
        );
        registry.register(
            "nodeguard_shutdown_inhibit_delay_max_seconds",
            "logind's InhibitDelayMaxUSec as last read",
            m.inhibit_delay_max.clone(),
        );
        registry.register(
            "nodeguard_shutdown_inhibit_delay_needed_seconds",
            "The inhibit delay the shutdown policy in force needs from logind (0: graceful shutdown off)",
            m.inhibit_delay_needed.clone(),
        );
        m
    }

    /// Each group's `evicted` and `escalated` series at 0 while the plan is
    /// armed, so a shutdown's first pods are an increase on a dashboard (a
    /// series born at 1 shows none); the rarer outcomes appear when they
    /// happen, which keeps a fleet's series few.
    fn declare_groups(&self, cfg: &ShutdownConfig) {
        for g in &cfg.groups {
            for outcome in ["evicted", "escalated"] {
                let _ = self.pods.get_or_create(&PodLabels {
                    group: g.priority,
                    outcome: outcome.into(),
                });
            }
        }
    }

    fn pod(&self, group: i32, outcome: &str) {
        self.pods
            .get_or_create(&PodLabels {
                group,
                outcome: outcome.into(),
            })
            .inc();
    }
}

fn unix_seconds(t: jiff::Timestamp) -> f64 {
    t.as_millisecond() as f64 / 1000.0
}

/// What the shutdown manager is given by the agent.
pub struct ShutdownHost<L, C> {
    pub logind: L,
    pub cluster: C,
    pub state_dir: PathBuf,
    /// Where a failing state write is said.
    pub state_writes: StateWrites,
    pub boot_id: String,
    pub node_name: String,
    /// True while a shutdown runs (from PrepareForShutdown until its
    /// groups are done or it is cancelled): the agent does not stop then.
    pub in_progress: watch::Sender<bool>,
    /// Where a copy of the delay inhibitor outlives this process.
    pub keeper: Keeper,
    /// The inhibitor a previous process left with the keeper.
    pub reclaimed: Option<std::os::fd::OwnedFd>,
    /// A stop's question, asked before the stop cancels anything.
    pub stop_questions: StopQuestions,
}

/// The longest a stop waits for the manager to decide whether a shutdown
/// is under way: a lock taken back from the keeper is held while the
/// manager asks logind at start-up (5 s at most) and arms (logind's reload
/// and poll, 2 s); an answer in the armed loop is one call (5 s at most).
const STOP_DECIDE_MAX: Duration = Duration::from_secs(15);

/// Where the manager stands, for a stop's question.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StopPhase {
    /// No inhibitor held: nothing to delay, a stop goes on at once.
    Free,
    /// An inhibitor held outside the armed loop (taken back from the
    /// keeper at start, or carried to a restarted logind): the manager is
    /// deciding, the stop waits for it.
    Holding,
    /// In the armed loop, which answers questions.
    Armed,
}

/// Asked by a stop before it cancels anything: has the host begun shutting
/// down, though the manager has not yet handled logind's
/// `PrepareForShutdown(true)` (the signal in flight, or queued behind
/// another message), or is the manager still deciding whether to resume a
/// shutdown with a lock taken back from the keeper? The stop would
/// otherwise release the inhibitor (and the keeper's copy) and let logind
/// go on at once, no group run. See [`stop_check`].
#[derive(Clone)]
pub struct StopCheck {
    phase: watch::Receiver<StopPhase>,
    asks: mpsc::Sender<tokio::sync::oneshot::Sender<bool>>,
}

/// The manager's side of [`StopCheck`].
pub struct StopQuestions {
    phase: watch::Sender<StopPhase>,
    asks: mpsc::Receiver<tokio::sync::oneshot::Sender<bool>>,
}

/// A connected [`StopCheck`] and [`StopQuestions`]; `holding`: the agent
/// starts with a lock taken back from the keeper, so a stop waits for the
/// manager from the first instant.
pub fn stop_check(holding: bool) -> (StopCheck, StopQuestions) {
    let (phase_tx, phase) = watch::channel(if holding {
        StopPhase::Holding
    } else {
        StopPhase::Free
    });
    let (asks_tx, asks) = mpsc::channel(4);
    (
        StopCheck {
            phase,
            asks: asks_tx,
        },
        StopQuestions {
            phase: phase_tx,
            asks,
        },
    )
}

impl StopCheck {
    /// Returns once the manager has decided, whether a shutdown is in
    /// progress: one logind has begun, or one the agent resumes with a lock
    /// taken back from the keeper, is then running (and the agent's
    /// `node_shutdown` is true). `false` at once when the manager holds no
    /// inhibitor (nothing to delay; a shutdown resumed without a lock is not
    /// waited for, logind is not waiting for it either), and after
    /// [`STOP_DECIDE_MAX`] when it cannot decide.
    pub async fn ask(&self) -> bool {
        let deadline = Instant::now() + STOP_DECIDE_MAX;
        let mut phase = self.phase.clone();
        loop {
            let now = *phase.borrow_and_update();
            match now {
                StopPhase::Free => return false,
                StopPhase::Holding => match timeout_at(deadline, phase.changed()).await {
                    Ok(Ok(())) => {}
                    // The manager is gone, and its lock with it.
                    Ok(Err(_)) => return false,
                    Err(_) => break,
                },
                StopPhase::Armed => {
                    let (tx, rx) = tokio::sync::oneshot::channel();
                    if self.asks.try_send(tx).is_err() {
                        return false;
                    }
                    tokio::select! {
                        answer = rx => if let Ok(running) = answer { return running },
                        // Left the armed loop before answering: look again.
                        r = phase.changed() => if r.is_err() { return false },
                        _ = sleep_until(deadline) => break,
                    }
                }
            }
        }
        tracing::warn!(
            waited = ?STOP_DECIDE_MAX,
            "the shutdown manager did not decide whether the host is shutting down; stopping"
        );
        false
    }
}

impl StopQuestions {
    fn set(&self, phase: StopPhase) {
        self.phase
            .send_if_modified(|p| std::mem::replace(p, phase) != phase);
    }
}

/// Marks the manager armed while it lives; questions left unanswered when
/// it goes are dropped (their stop looks at the phase again). The phase
/// after it is set by the manager, which knows whether it keeps a lock.
struct ArmedMark<'a>(&'a mut StopQuestions);

impl<'a> ArmedMark<'a> {
    fn new(q: &'a mut StopQuestions) -> Self {
        q.set(StopPhase::Armed);
        ArmedMark(q)
    }
}

impl Drop for ArmedMark<'_> {
    fn drop(&mut self) {
        while self.0.asks.try_recv().is_ok() {}
    }
}

/// Everything the running pieces share.
struct Ctx<C> {
    cluster: C,
    reporter: Reporter,
    metrics: ShutdownMetrics,
    state_dir: PathBuf,
    state_writes: StateWrites,
    boot_id: String,
    node_name: String,
    clock: WallClock,
    pods: watch::Receiver<Option<Snapshot<Pod>>>,
    in_progress: watch::Sender<bool>,
    keeper: Keeper,
    /// nodeguard's shutdown taint is still on the Node after a cancel or a
    /// reboot (the API server did not take its removal in time): retried
    /// in the background every [`TAINT_CLEANUP_EVERY`] until it goes, and
    /// forgotten the moment a new shutdown begins.
    taint_left: std::sync::atomic::AtomicBool,
    /// Held by each background removal attempt, and taken by a new
    /// shutdown before its taint request, so an attempt in flight never
    /// removes the new shutdown's taint.
    taint_cleanup: tokio::sync::Mutex<()>,
}

impl<C> Ctx<C> {
    /// The shutdown taint is still on the Node: removed in the background
    /// from now on, by this process or the next.
    fn remember_left_taint(&self) {
        self.taint_left
            .store(true, std::sync::atomic::Ordering::SeqCst);
        state::mark_taint_left(&self.state_writes, &self.state_dir, true);
    }

    /// The taint left behind is gone or is a new shutdown's: the background
    /// removal stops. True when one was left.
    fn forget_left_taint(&self) -> bool {
        let was = self
            .taint_left
            .swap(false, std::sync::atomic::Ordering::SeqCst);
        if was {
            state::mark_taint_left(&self.state_writes, &self.state_dir, false);
        }
        was
    }
}

/// Backoff between reconnects to the bus or logind: short, so the lock is
/// back within about two seconds of logind's return.
const RECONNECT_MIN: Duration = Duration::from_millis(100);
const RECONNECT_MAX: Duration = Duration::from_millis(1000);

/// How long one API call outside a shutdown's windows may take: removing
/// the taint after a cancel or a reboot. (Calls during a shutdown end with
/// their group's window.)
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// The shutdown taint's request is retried from this delay, doubling up
/// to [`TAINT_RETRY_MAX`], until the API server answers or the plan ends.
const TAINT_RETRY_MIN: Duration = Duration::from_millis(250);
const TAINT_RETRY_MAX: Duration = Duration::from_secs(2);
/// How often a shutdown taint left behind is tried again.
const TAINT_CLEANUP_EVERY: Duration = Duration::from_secs(10);

/// The shutdown manager loop. Runs until `stop`; then releases the lock.
pub async fn run_shutdown_manager<L: LogindConnector, C: ClusterPort>(
    host: ShutdownHost<L, C>,
    mut config: watch::Receiver<Option<ShutdownConfig>>,
    pods: watch::Receiver<Option<Snapshot<Pod>>>,
    reporter: Reporter,
    metrics: ShutdownMetrics,
    handle: LoopHandle,
    stop: CancellationToken,
) {
    let ctx = Arc::new(Ctx {
        cluster: host.cluster,
        reporter,
        metrics,
        state_dir: host.state_dir,
        state_writes: host.state_writes,
        boot_id: host.boot_id,
        node_name: host.node_name,
        clock: WallClock::new(),
        pods,
        in_progress: host.in_progress,
        keeper: host.keeper.clone(),
        taint_left: Default::default(),
        taint_cleanup: Default::default(),
    });
    // A taint a previous process could not remove: removed from here on.
    if state::taint_left(&ctx.state_dir) {
        tracing::info!(
            "nodeguard's shutdown taint was left on the node by a previous process; removing it in the background"
        );
        ctx.taint_left
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }
    tokio::spawn(clean_up_left_taint(ctx.clone(), stop.clone()));
    let logind = host.logind;
    let mut questions = host.stop_questions;
    // A lock left by a previous process of this agent (killed while it
    // held one): held from here, so logind keeps waiting for this process.
    let mut reclaimed = host.reclaimed.map(|fd| {
        tracing::info!(keeper = %host.keeper, "took back the delay inhibitor a previous process of the agent left with its keeper");
        InhibitLock::reclaimed(fd, &host.keeper)
    });
    // Holding it, the manager decides (resume or not) before a stop may
    // release it.
    if reclaimed.is_some() {
        questions.set(StopPhase::Holding);
    }
    // The loop counts as synced (so /readyz and systemd's READY=1) only once
    // it has decided for the policy in force: armed (the delay inhibitor
    // held), off, or unavailable and reported. A restarted agent that says
    // it is ready therefore protects the next shutdown.
    tracing::debug!("shutdown manager started");
    let (mut resume, mut last, going_down) = start_up(&ctx, &logind).await;
    if resume.is_none() && going_down.is_none() && reclaimed.is_some() {
        // The previous process was killed after PrepareForShutdown but
        // before it wrote its record: logind still waits on the reclaimed
        // lock, and will not say PrepareForShutdown again.
        if preparing_for_shutdown(&logind).await == Some(true) {
            tracing::warn!(
                "the host is shutting down and the previous process left no record: starting the shutdown's groups now"
            );
            resume = Some(ShutdownRecord {
                boot_id: ctx.boot_id.clone(),
                ..Default::default()
            });
        }
    }
    if let Some(taint_added) = going_down {
        // This boot's shutdown is done: a lock still kept goes now.
        reclaimed = None;
        questions.set(StopPhase::Free);
        // Nothing to arm (logind refuses new delay locks now) and nothing
        // to undo while the machine goes down: the taint goes with it and
        // the next boot reports the shutdown. Should logind's shutdown end
        // without the machine going down (a failed or cancelled job), undo
        // it then, as after a cancel.
        handle.updated();
        match watch_going_down(&ctx, &logind, &stop, taint_added, core::CancelCause::Logind).await {
            Some(l) => last = Some(l),
            None => return,
        }
    }
    let mut backoff = Backoff::new(RECONNECT_MIN, RECONNECT_MAX);
    let mut failing_since: Option<Instant> = None;
    // Until the first policy selection arrives, "no config" means "not known
    // yet", not "off": what start-up reported (NodeRebooted) must stay.
    let mut policy_known = false;
    // A lock taken from a restarted logind that had forgotten the shutdown
    // (`Armed::Reconnect(Some(_))`): the subscription is new, so a reboot
    // asked for in between would go unseen; ask once subscribed.
    let mut carried = false;
    'outer: loop {
        // A lock carried into this pass (taken back from the keeper, or
        // from a restarted logind) is held until the armed loop answers.
        questions.set(if reclaimed.is_some() {
            StopPhase::Holding
        } else {
            StopPhase::Free
        });
        // A shutdown resumed goes on with the plan it began with, whatever
        // the policy says now (edited, invalid, or without a shutdown
        // section); otherwise, wait for a policy that wants graceful
        // shutdown.
        let recorded = resume.as_ref().and_then(|r| r.plan.clone());
        let cfg = if let Some(c) = recorded {
            tracing::info!("resuming the shutdown with the plan it began with");
            c
        } else {
            loop {
                if let Some(c) = config.borrow_and_update().clone() {
                    policy_known = true;
                    ctx.metrics
                        .inhibit_delay_needed
                        .set(c.needed_delay().as_secs_f64());
                    break c;
                }
                if policy_known {
                    // No shutdown wanted: a reclaimed lock goes too.
                    reclaimed = None;
                    questions.set(StopPhase::Free);
                    handle.updated();
                    ctx.metrics.inhibit_delay_needed.set(0.0);
                    ctx.reporter.remove(UNAVAILABLE);
                    last = None;
                    report_condition(&ctx, &core::Phase::Off, None);
                    tracing::debug!("graceful shutdown is off; waiting for a policy");
                }
                tokio::select! {
                    _ = stop.cancelled() => return,
                    r = config.changed() => {
                        if r.is_err() { return }
                        policy_known = true;
                    }
                }
            }
        };
        // Resuming: logind is delaying its shutdown already and refuses new
        // delay locks (OperationInProgress); the remaining groups run in the
        // time left of the plan without one.
        let (port, events, delay_max, lock) =
            match connect_and_arm(&ctx, &logind, &cfg, resume.is_none(), &mut reclaimed).await {
                Ok(parts) => parts,
                Err((reason, message)) => {
                    report_unavailable(&ctx, &mut failing_since, reason, &message);
                    handle.updated();
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = sleep(backoff.next_delay()) => {}
                    }
                    continue;
                }
            };
        backoff.reset();
        // A shutdown resumed because logind did not answer at start-up (or
        // was asked before it ended): logind answers now. If it prepares for
        // no shutdown, that one was cancelled meanwhile and its signal is
        // gone: undo it rather than evict pods on a node that stays up (and
        // then, holding no inhibitor, let the next shutdown through).
        if let Some(r) = &resume
            && matches!(
                tokio::time::timeout(CALL_TIMEOUT, port.preparing_for_shutdown()).await,
                Ok(Ok(false))
            )
        {
            tracing::warn!(
                "the shutdown on record is no longer under way (cancelled while logind did not answer); undoing it instead of resuming"
            );
            let taint_added = r.taint_ours();
            // The lock first (a lock taken back from the keeper, or a new
            // one), so a reboot asked for while the undo talks to the API
            // server is delayed; the next pass arms with it and, newly
            // subscribed, asks logind whether one began meanwhile.
            let lock = match lock {
                Some(l) => Some(l),
                None => port.inhibit(&why(&cfg)).await.ok(),
            };
            resume = None;
            last = Some(cancelled_meanwhile(&ctx, taint_added, core::CancelCause::Logind).await);
            carried = lock.is_some();
            reclaimed = lock;
            continue;
        }
        handle.updated();
        if failing_since.take().is_some() {
            tracing::info!("logind reachable again; delay inhibitor taken");
        }
        if lock.is_some() {
            ctx.metrics.inhibitor_held.set(1);
        }
        let mut fresh = false;
        if std::mem::take(&mut carried)
            && resume.is_none()
            && lock.is_some()
            && matches!(
                tokio::time::timeout(CALL_TIMEOUT, port.preparing_for_shutdown()).await,
                Ok(Ok(true))
            )
        {
            tracing::warn!("a shutdown began while nodeguard reconnected to the restarted logind");
            fresh = true;
        }
        if lock.is_some() && resume.is_none() && !fresh {
            tracing::info!(delay_max = ?delay_max, needed = ?cfg.needed_delay(), groups = cfg.groups.len(), "holding a logind delay inhibitor for shutdown");
            report_armed(&ctx, &cfg, delay_max, last.as_ref());
        }
        let mut armed_state = ArmedState {
            cfg,
            lock,
            delay_max,
            last: &mut last,
        };
        match armed(
            &ctx,
            &logind,
            &port,
            &mut config,
            &mut armed_state,
            events,
            resume.take(),
            fresh,
            &handle,
            &stop,
            &mut questions,
        )
        .await
        {
            Armed::Stop => break 'outer,
            Armed::Reconnect(lock) => {
                if lock.is_some() {
                    carried = true;
                    reclaimed = lock;
                }
                ctx.metrics.inhibitor_held.set(0);
                continue;
            }
            Armed::GoingDown { taint_added } => {
                ctx.metrics.inhibitor_held.set(0);
                // No lock, and no loop to answer: a stop goes on at once.
                questions.set(StopPhase::Free);
                handle.updated();
                match watch_going_down(
                    &ctx,
                    &logind,
                    &stop,
                    taint_added,
                    core::CancelCause::LogindRestarted,
                )
                .await
                {
                    Some(l) => last = Some(l),
                    None => break 'outer,
                }
                continue;
            }
        }
    }
    questions.set(StopPhase::Free);
    ctx.metrics.inhibitor_held.set(0);
}

/// Connects to logind, subscribes, makes sure the inhibit delay suffices
/// and takes the lock; on failure, the condition reason and message.
#[allow(clippy::type_complexity)]
async fn connect_and_arm<L: LogindConnector, C: ClusterPort>(
    ctx: &Ctx<C>,
    logind: &L,
    cfg: &ShutdownConfig,
    take_lock: bool,
    reclaimed: &mut Option<InhibitLock>,
) -> Result<
    (
        L::Port,
        mpsc::Receiver<LogindEvent>,
        Duration,
        Option<InhibitLock>,
    ),
    (&'static str, String),
> {
    let port = logind.connect().await.map_err(|e| {
        ("LogindUnavailable", format!(
            "nodeguard cannot reach systemd-logind on the system bus ({e}); without it a shutdown would not wait for pods. Mount /run/dbus/system_bus_socket and check that logind runs."
        ))
    })?;
    let events = port.events().await.map_err(|e| {
        ("LogindUnavailable", format!(
            "nodeguard cannot subscribe to systemd-logind's signals ({e}); a shutdown would not wait for pods."
        ))
    })?;
    let delay_max = ensure_delay(ctx, &port, cfg).await.map_err(|e| {
        ("LogindUnavailable", format!(
            "systemd-logind does not answer on the system bus ({e}); a shutdown would not wait for pods."
        ))
    })?;
    if let Some(lock) = reclaimed.take() {
        return Ok((port, events, delay_max, Some(lock)));
    }
    if !take_lock {
        return Ok((port, events, delay_max, None));
    }
    // Its copy goes to the keeper only once a shutdown starts: an agent
    // crash-looping while armed must not hold every shutdown of the node
    // for logind's whole delay.
    let lock = port.inhibit(&why(cfg)).await.map_err(|e| {
        ("InhibitorRefused", format!(
            "systemd-logind refused nodeguard's delay inhibitor ({e}); a shutdown would not wait for pods."
        ))
    })?;
    Ok((port, events, delay_max, Some(lock)))
}

enum Armed {
    Stop,
    /// Connect again; with a lock already taken on the new logind (after a
    /// shutdown a restarted logind forgot), arm with it.
    Reconnect(Option<InhibitLock>),
    /// The groups finished while logind was away: the host is taken to be
    /// going down; watch that it does (undo, as after a cancel, if not).
    GoingDown {
        taint_added: bool,
    },
}

fn why(cfg: &ShutdownConfig) -> String {
    format!(
        "nodeguard moves pods off the node in {} priority group(s) within {}s",
        cfg.groups.len(),
        core::total_grace(&cfg.groups).as_secs()
    )
}

/// What the armed loop works with.
struct ArmedState<'a> {
    /// The configuration the inhibitor was taken for (and a running
    /// shutdown follows).
    cfg: ShutdownConfig,
    lock: Option<InhibitLock>,
    delay_max: Duration,
    /// The last shutdown, as the condition reports it.
    last: &'a mut Option<core::LastShutdown>,
}

type Running = (CancellationToken, tokio::task::JoinHandle<ShutdownRecord>);

/// Holding the lock: wait for logind's signals and policy changes.
///
/// A policy change while a shutdown runs does not touch that shutdown: it
/// keeps the plan it started with (its windows are already promised to the
/// pods and to logind). The change is kept and applied when the shutdown is
/// cancelled: the inhibitor is then taken for the new configuration, or not
/// at all when the policy turned graceful shutdown off. (A shutdown that is
/// not cancelled ends with the reboot; the agent starts with the new
/// policy.)
#[allow(clippy::too_many_arguments)]
async fn armed<L: LogindConnector, C: ClusterPort>(
    ctx: &Arc<Ctx<C>>,
    logind: &L,
    port: &L::Port,
    config: &mut watch::Receiver<Option<ShutdownConfig>>,
    st: &mut ArmedState<'_>,
    mut events: mpsc::Receiver<LogindEvent>,
    resume: Option<ShutdownRecord>,
    fresh: bool,
    handle: &LoopHandle,
    stop: &CancellationToken,
    questions: &mut StopQuestions,
) -> Armed {
    let mark = ArmedMark::new(questions);
    let mut running: Option<Running> = fresh.then(|| begin_shutdown(ctx, st));
    // What the policy wants now; differs from `st.cfg` while a shutdown
    // runs and the policy changed meanwhile.
    let mut latest = Some(st.cfg.clone());
    if let Some(record) = resume {
        tracing::warn!("resuming the shutdown that was in progress when the agent restarted");
        running = Some(spawn_shutdown(
            ctx,
            &st.cfg,
            st.lock.take(),
            st.delay_max,
            record,
            true,
        ));
    }
    loop {
        tokio::select! {
            // In this order: a stop, then logind's signals and policy
            // changes already queued, then a stop's question.
            biased;
            _ = stop.cancelled() => {
                if let Some((token, task)) = running.take() {
                    token.cancel();
                    let _ = task.await;
                    ctx.in_progress.send_replace(false);
                }
                return Armed::Stop;
            }
            r = config.changed() => {
                if r.is_err() { return Armed::Stop; }
                latest = config.borrow_and_update().clone();
                if running.is_some() {
                    if latest.as_ref() != Some(&st.cfg) {
                        let message = "The shutdown policy changed during a shutdown: the shutdown in progress keeps its plan; the change applies if the shutdown is cancelled, otherwise after the reboot.";
                        tracing::info!("{message}");
                        ctx.reporter.event(EventKind::Normal, "ShutdownPolicyDeferred", "UpdatePolicy", message);
                    }
                    continue;
                }
                match &latest {
                    None => {
                        tracing::info!("graceful shutdown turned off by policy; releasing the inhibitor");
                        ctx.metrics.inhibitor_held.set(0);
                        return Armed::Reconnect(None);
                    }
                    Some(new) if *new != st.cfg => {
                        handle.queued();
                        st.cfg = new.clone();
                        if let Ok(d) = ensure_delay(ctx, port, &st.cfg).await {
                            st.delay_max = d;
                        }
                        report_armed(ctx, &st.cfg, st.delay_max, st.last.as_ref());
                        handle.updated();
                    }
                    Some(_) => {}
                }
            }
            e = events.recv() => match e {
                Some(LogindEvent::PrepareForShutdown(true)) => {
                    if running.is_some() { continue; }
                    tracing::warn!("PrepareForShutdown(true): the host is shutting down");
                    running = Some(begin_shutdown(ctx, st));
                }
                Some(LogindEvent::PrepareForShutdown(false)) => {
                    tracing::warn!("PrepareForShutdown(false): the shutdown was cancelled");
                    let mut record = None;
                    if let Some((token, task)) = running.take() {
                        token.cancel();
                        record = task.await.ok();
                    }
                    // A stop deferred for the shutdown also waits for the
                    // undo (taint, condition, Event) before it goes on.
                    let after = cancelled(ctx, port, st, latest.clone(), record, handle, core::CancelCause::Logind).await;
                    ctx.in_progress.send_replace(false);
                    if let Some(a) = after {
                        return a;
                    }
                }
                Some(LogindEvent::Gone) | None => {
                    let Some((token, task)) = running.take() else {
                        tracing::warn!("systemd-logind or the system bus went away; reconnecting to take the lock again");
                        return Armed::Reconnect(None);
                    };
                    // The groups go on meanwhile (a spawned task). A logind
                    // restarted during the delay has forgotten the shutdown
                    // the old one was delaying (it keeps inhibitors, not a
                    // pending shutdown): the host stays up, so undo it. On
                    // the way down, logind is stopped for good and does not
                    // answer; the groups then finish.
                    // Meanwhile (up to LOGIND_BACK_WAIT) a stop is answered
                    // and a stop goes on: the host stopping the agent on
                    // its way down must not wait for logind.
                    let back = {
                        let wait = logind_after_restart(logind);
                        tokio::pin!(wait);
                        loop {
                            tokio::select! {
                                biased;
                                _ = stop.cancelled() => {
                                    token.cancel();
                                    let _ = task.await;
                                    ctx.in_progress.send_replace(false);
                                    return Armed::Stop;
                                }
                                r = &mut wait => break r,
                                Some(answer) = mark.0.asks.recv() => {
                                    let _ = answer.send(*ctx.in_progress.borrow());
                                }
                            }
                        }
                    };
                    match back {
                        Some((new_port, false)) => {
                            tracing::warn!("systemd-logind restarted during the shutdown and no longer shuts the host down; cancelling the shutdown");
                            token.cancel();
                            let record = task.await.ok();
                            let after = cancelled(ctx, &new_port, st, latest.clone(), record, handle, core::CancelCause::LogindRestarted).await;
                            ctx.in_progress.send_replace(false);
                            // The signals came from the old connection:
                            // reconnect, keeping the lock just taken.
                            return match after {
                                Some(Armed::Stop) => Armed::Stop,
                                _ => Armed::Reconnect(st.lock.take()),
                            };
                        }
                        Some((_, true)) => tracing::warn!("systemd-logind restarted during the shutdown and still shuts the host down; the groups go on"),
                        None => tracing::warn!("systemd-logind or the system bus went away during the shutdown; the groups go on"),
                    }
                    let record = task.await.ok();
                    return Armed::GoingDown { taint_added: record.is_some_and(|r| r.taint_ours()) };
                }
            },
            Some(answer) = mark.0.asks.recv() => {
                // A stop asks before it cancels anything: logind may have
                // begun a shutdown whose signal is not handled yet. Its
                // answer comes after any signal it sent before (one
                // connection), so a shutdown begun is seen here; a signal
                // already queued was handled first (`biased`). A question
                // its stop gave up on starts nothing.
                if answer.is_closed() {
                    continue;
                }
                // A second signal while logind is asked stops at once.
                let preparing = running.is_none() && tokio::select! {
                    biased;
                    _ = stop.cancelled() => false,
                    r = timeout(CALL_TIMEOUT, port.preparing_for_shutdown()) => matches!(r, Ok(Ok(true))),
                };
                if preparing {
                    tracing::warn!("asked to stop as the host begins shutting down (PrepareForShutdown not handled yet): the shutdown runs first");
                    running = Some(begin_shutdown(ctx, st));
                }
                let _ = answer.send(*ctx.in_progress.borrow());
            }
        }
    }
}

/// PrepareForShutdown(false): apply the policy as it is now (it may have
/// changed during the shutdown), take the inhibitor again (first, so the
/// node is protected while the API is slow), then undo what the shutdown
/// did to the node. `Some` when the armed loop must end.
async fn cancelled<P: LogindPort, C: ClusterPort>(
    ctx: &Ctx<C>,
    port: &P,
    st: &mut ArmedState<'_>,
    latest: Option<ShutdownConfig>,
    record: Option<ShutdownRecord>,
    handle: &LoopHandle,
    cause: core::CancelCause,
) -> Option<Armed> {
    let inhibitor = match latest {
        None => {
            st.lock = None;
            core::AfterCancel::PolicyOff
        }
        Some(new) => {
            let changed = new != st.cfg;
            if changed {
                handle.queued();
                tracing::info!("applying the policy change made during the shutdown");
                st.cfg = new;
            }
            // The lock first: a reboot asked for while logind reloads its
            // delay (below) is delayed too. A lock the shutdown never took
            // names the old plan; it goes once the new one is held.
            let held = if changed || st.lock.is_none() {
                match port.inhibit(&why(&st.cfg)).await {
                    Ok(l) => {
                        st.lock = Some(l);
                        ctx.metrics.inhibitor_held.set(1);
                        core::AfterCancel::Held
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot take the inhibitor again; reconnecting");
                        core::AfterCancel::Reconnecting
                    }
                }
            } else {
                core::AfterCancel::Held
            };
            if changed && let Ok(d) = ensure_delay(ctx, port, &st.cfg).await {
                st.delay_max = d;
            }
            held
        }
    };
    if inhibitor != core::AfterCancel::Held {
        ctx.metrics.inhibitor_held.set(0);
    }
    let taint = undo_taint(ctx, record.as_ref().is_some_and(|r| r.taint_ours())).await;
    state::clear(&ctx.state_writes, &ctx.state_dir);
    ctx.reporter.event(
        EventKind::Normal,
        "ShutdownCancelled",
        "CancelShutdown",
        core::cancel_message(cause, taint, inhibitor),
    );
    *st.last = Some(core::LastShutdown::Cancelled {
        cause,
        taint,
        inhibitor,
    });
    match inhibitor {
        core::AfterCancel::Held => {
            report_armed(ctx, &st.cfg, st.delay_max, st.last.as_ref());
            handle.updated();
            None
        }
        // The outer loop finds the policy off and removes the conditions.
        core::AfterCancel::PolicyOff => Some(Armed::Reconnect(None)),
        core::AfterCancel::Reconnecting => {
            report_condition(ctx, &core::Phase::Waiting, st.last.as_ref());
            Some(Armed::Reconnect(None))
        }
    }
}

/// A shutdown logind has just begun: a new record, the lock handed to it.
fn begin_shutdown<C: ClusterPort>(ctx: &Arc<Ctx<C>>, st: &mut ArmedState<'_>) -> Running {
    *st.last = None;
    let record = ShutdownRecord {
        boot_id: ctx.boot_id.clone(),
        ..Default::default()
    };
    spawn_shutdown(ctx, &st.cfg, st.lock.take(), st.delay_max, record, false)
}

fn spawn_shutdown<C: ClusterPort>(
    ctx: &Arc<Ctx<C>>,
    cfg: &ShutdownConfig,
    lock: Option<InhibitLock>,
    delay_max: Duration,
    record: ShutdownRecord,
    resume: bool,
) -> Running {
    let token = CancellationToken::new();
    ctx.in_progress.send_replace(true);
    let run = execute(
        ctx.clone(),
        cfg.clone(),
        lock,
        delay_max,
        record,
        resume,
        token.clone(),
    );
    // Cleared when the task ends by itself (done or panicked): a stop that
    // waits for it must never wait forever. When the manager cancelled it
    // (logind's cancel, the agent's stop), the manager clears it once it
    // has undone the shutdown (`armed`).
    struct Clear(watch::Sender<bool>, CancellationToken);
    impl Drop for Clear {
        fn drop(&mut self) {
            if !self.1.is_cancelled() {
                self.0.send_replace(false);
            }
        }
    }
    let clear = Clear(ctx.in_progress.clone(), token.clone());
    let task = tokio::spawn(async move {
        let _clear = clear;
        run.await
    });
    (token, task)
}

/// Reads logind's maximum delay and, when the policy needs more, writes
/// the drop-in, makes logind reload, and reads it back.
async fn ensure_delay<P: LogindPort, C: ClusterPort>(
    ctx: &Ctx<C>,
    port: &P,
    cfg: &ShutdownConfig,
) -> Result<Duration, ShutdownError> {
    let needed = cfg.needed_delay();
    ctx.metrics.inhibit_delay_needed.set(needed.as_secs_f64());
    ctx.metrics.declare_groups(cfg);
    let mut current = port.inhibit_delay_max().await?;
    if current < needed
        && let Some(dir) = &cfg.drop_in_dir
    {
        match logind::write_drop_in(dir, needed) {
            Ok(path) => {
                tracing::info!(path = %path.display(), current = ?current, needed = ?needed, "raising logind's InhibitDelayMaxSec");
                if let Err(e) = port.reload().await {
                    tracing::warn!(error = %e, "cannot make logind reload its configuration");
                }
                // logind applies the drop-in when it handles SIGHUP.
                for _ in 0..20 {
                    sleep(Duration::from_millis(100)).await;
                    current = port.inhibit_delay_max().await?;
                    if current >= needed {
                        break;
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot write the logind drop-in"),
        }
    }
    ctx.metrics.inhibit_delay_max.set(current.as_secs_f64());
    if current < needed {
        let message =
            core::availability(&cfg.readiness(current), cfg.drop_in_dir.as_deref()).message;
        tracing::warn!("{message}");
        ctx.reporter.event(
            EventKind::Warning,
            "InhibitDelayTooShort",
            "CheckLogind",
            message,
        );
    }
    Ok(current)
}

/// Both conditions while the inhibitor is held and no shutdown runs.
fn report_armed<C>(
    ctx: &Ctx<C>,
    cfg: &ShutdownConfig,
    delay_max: Duration,
    last: Option<&core::LastShutdown>,
) {
    let readiness = cfg.readiness(delay_max);
    ctx.reporter.set(
        UNAVAILABLE,
        core::availability(&readiness, cfg.drop_in_dir.as_deref()),
    );
    report_condition(ctx, &core::Phase::Armed(readiness), last);
}

/// Writes `GracefulShutdown` as the decision core says.
fn report_condition<C>(ctx: &Ctx<C>, phase: &core::Phase, last: Option<&core::LastShutdown>) {
    match core::condition(phase, last) {
        core::ConditionUpdate::Keep => {}
        core::ConditionUpdate::Remove => ctx.reporter.remove(CONDITION),
        core::ConditionUpdate::Set(d) => ctx.reporter.set(CONDITION, d),
        core::ConditionUpdate::Urgent(d) => {
            // Only a change is urgent.
            if !matches!(ctx.reporter.desired().get(CONDITION), Some(Some(now)) if *now == d) {
                ctx.reporter.set_urgent(CONDITION, d);
            }
        }
    }
}

fn report_unavailable<C>(
    ctx: &Ctx<C>,
    failing_since: &mut Option<Instant>,
    reason: &str,
    message: &str,
) {
    if failing_since.is_none() {
        tracing::warn!("{message}");
        ctx.reporter
            .event(EventKind::Warning, reason, "CheckLogind", message);
        *failing_since = Some(Instant::now());
    }
    ctx.metrics.inhibitor_held.set(0);
    ctx.reporter.set(
        UNAVAILABLE,
        Desired {
            status: Status::True,
            reason: reason.into(),
            message: message.into(),
        },
    );
}

/// At start-up: resume an unfinished shutdown of this boot, or clean up
/// after the reboot that followed one. Returns the record to resume and
/// the last shutdown to report.
/// The record to resume, the last shutdown to report, and — when this
/// boot's shutdown is done and the host going down — whether nodeguard
/// added the taint.
async fn start_up<C: ClusterPort, L: LogindConnector>(
    ctx: &Ctx<C>,
    logind: &L,
) -> (
    Option<ShutdownRecord>,
    Option<core::LastShutdown>,
    Option<bool>,
) {
    let record = match state::load(&ctx.state_dir) {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(error = %e, "shutdown state unreadable");
            ctx.reporter.event(
                EventKind::Warning,
                "ShutdownStateCorrupt",
                "LoadState",
                e.to_string(),
            );
            None
        }
    };
    // A record of this boot: only logind knows whether the host is still
    // going down (a restart during or after the shutdown) or not (it was
    // cancelled while the agent was away).
    let this_boot = record
        .as_ref()
        .is_some_and(|r| r.boot_id == ctx.boot_id && r.started_at.is_some());
    let preparing = if this_boot {
        preparing_for_shutdown(logind).await
    } else {
        None
    };
    match state::on_start(record.as_ref(), &ctx.boot_id, preparing) {
        OnStart::Nothing if record.is_none() => {
            remove_unrecorded_taint(ctx, logind).await;
            (None, None, None)
        }
        OnStart::Nothing => (None, None, None),
        OnStart::Resume => (record, None, None),
        OnStart::GoingDown => {
            tracing::info!(
                "restarted after this boot's shutdown was done; the host is going down: the taint and the record stay for the next boot"
            );
            let taint_added = record.is_some_and(|r| r.taint_ours());
            (None, None, Some(taint_added))
        }
        OnStart::CancelledMeanwhile { taint_added } => (
            None,
            Some(cancelled_meanwhile(ctx, taint_added, core::CancelCause::Logind).await),
            None,
        ),
        OnStart::AfterReboot { took, taint_added } => {
            let taint = undo_taint(ctx, taint_added).await;
            if let Some(d) = took {
                ctx.metrics.last_duration.set(d.as_secs_f64());
            }
            let started_at = record
                .as_ref()
                .and_then(|r| r.started_at)
                .map(|t| t.to_string())
                .unwrap_or_default();
            let message = core::rebooted_message(&started_at, took, taint);
            tracing::info!("{message}");
            ctx.reporter.event(
                EventKind::Normal,
                "NodeRebooted",
                "CompleteShutdown",
                message,
            );
            let last = core::LastShutdown::Rebooted {
                started_at,
                took,
                taint,
            };
            report_condition(ctx, &core::Phase::Waiting, Some(&last));
            state::clear(&ctx.state_writes, &ctx.state_dir);
            (None, Some(last), None)
        }
    }
}

/// No shutdown on record, but the Node may carry nodeguard's own shutdown
/// taint (`nodeguard.io/shutdown=shutting-down`): one a shutdown added
/// while the state directory was full or read-only, so no record said it
/// was nodeguard's. While logind prepares for no shutdown it is removed
/// (a taint of that key with another value is someone else's and stays).
async fn remove_unrecorded_taint<C: ClusterPort, L: LogindConnector>(ctx: &Ctx<C>, logind: &L) {
    // A taint a previous process could not remove is removed in the
    // background already (and said once, by that path).
    if ctx.taint_left.load(std::sync::atomic::Ordering::SeqCst) {
        return;
    }
    // Quietly: a node whose policy wants no graceful shutdown may have no
    // system bus mounted.
    match ask_logind(logind).await {
        Ok((_, false)) => {}
        Ok((_, true)) => return,
        Err(why) => {
            tracing::debug!(
                "cannot ask logind whether a shutdown taint left without a record may go: {why}"
            );
            return;
        }
    }
    match timeout(CALL_TIMEOUT, ctx.cluster.remove_left_taint()).await {
        Ok(Ok(true)) => report_taint_removed(
            ctx,
            format!(
                "nodeguard removed its shutdown taint {}={}, which a shutdown left with no record of it (the state directory could not be written then).",
                cluster::TAINT_KEY,
                cluster::TAINT_VALUE
            ),
        ),
        Ok(Ok(false)) => {}
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "cannot look for a shutdown taint left without a record")
        }
        Err(_) => tracing::warn!(
            "the API server did not answer the look for a shutdown taint left without a record"
        ),
    }
}

/// A shutdown taint left behind is gone: logged and a `ShutdownTaintRemoved` Event.
fn report_taint_removed<C>(ctx: &Ctx<C>, message: String) {
    tracing::info!("{message}");
    ctx.reporter.event(
        EventKind::Normal,
        "ShutdownTaintRemoved",
        "RemoveTaint",
        message,
    );
}

/// How often an agent that found its shutdown done on a host going down
/// asks logind whether that is still so.
const GOING_DOWN_POLL: Duration = Duration::from_secs(5);

/// logind's `PreparingForShutdown` (`None`: logind unreachable or slow).
async fn preparing_for_shutdown<L: LogindConnector>(logind: &L) -> Option<bool> {
    match ask_logind(logind).await {
        Ok((_, p)) => Some(p),
        Err(why) => {
            tracing::warn!("cannot ask logind whether the host is shutting down: {why}");
            None
        }
    }
}

/// A new connection to logind and its `PreparingForShutdown`, within
/// `CALL_TIMEOUT`.
async fn ask_logind<L: LogindConnector>(logind: &L) -> Result<(L::Port, bool), String> {
    let ask = async {
        let port = logind.connect().await?;
        let preparing = port.preparing_for_shutdown().await?;
        Ok::<_, ShutdownError>((port, preparing))
    };
    match tokio::time::timeout(CALL_TIMEOUT, ask).await {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer within {CALL_TIMEOUT:?}")),
    }
}

/// How long an agent whose logind left during a shutdown waits for it to
/// answer again (a restart takes well under a second; activation on the
/// system bus starts it if needed) before it takes the host as going down.
const LOGIND_BACK_WAIT: Duration = Duration::from_secs(10);

/// After logind left the bus during a shutdown: a new connection and
/// whether the logind answering now prepares for a shutdown. `None` when
/// none answered within `LOGIND_BACK_WAIT`. (Not cut short by a stop: a
/// stop waits for the shutdown's outcome, and this is bounded.)
async fn logind_after_restart<L: LogindConnector>(logind: &L) -> Option<(L::Port, bool)> {
    let deadline = tokio::time::Instant::now() + LOGIND_BACK_WAIT;
    loop {
        match ask_logind(logind).await {
            Ok(answer) => return Some(answer),
            Err(why) => tracing::debug!("logind does not answer yet: {why}"),
        }
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        sleep(Duration::from_millis(250)).await;
    }
}

/// The shutdown's groups are done and the host should be going down:
/// polls logind until it says it is not (a failed or cancelled shutdown
/// job, a restarted logind), then undoes the shutdown as after a cancel.
/// `None` when the agent stops first (the machine going down stops it).
async fn watch_going_down<L: LogindConnector, C: ClusterPort>(
    ctx: &Ctx<C>,
    logind: &L,
    stop: &CancellationToken,
    taint_added: bool,
    cause: core::CancelCause,
) -> Option<core::LastShutdown> {
    loop {
        tokio::select! {
            _ = stop.cancelled() => return None,
            _ = sleep(GOING_DOWN_POLL) => {}
        }
        if preparing_for_shutdown(logind).await == Some(false) {
            return Some(cancelled_meanwhile(ctx, taint_added, cause).await);
        }
    }
}

/// Undoes a shutdown of this boot that logind no longer prepares for (it
/// was cancelled while the agent was not running, or failed): nodeguard's
/// taint, the record, a `ShutdownCancelled` report. The inhibitor is
/// taken again by the armed loop that follows.
async fn cancelled_meanwhile<C: ClusterPort>(
    ctx: &Ctx<C>,
    taint_added: bool,
    cause: core::CancelCause,
) -> core::LastShutdown {
    let taint = undo_taint(ctx, taint_added).await;
    state::clear(&ctx.state_writes, &ctx.state_dir);
    let message = core::cancel_message(cause, taint, core::AfterCancel::Held);
    let message = match cause {
        core::CancelCause::Logind => {
            format!("{message} (cancelled while nodeguard was not running)")
        }
        core::CancelCause::LogindRestarted => message,
    };
    tracing::info!("{message}");
    ctx.reporter.event(
        EventKind::Normal,
        "ShutdownCancelled",
        "CancelShutdown",
        message,
    );
    let last = core::LastShutdown::Cancelled {
        cause,
        taint,
        inhibitor: core::AfterCancel::Held,
    };
    report_condition(ctx, &core::Phase::Waiting, Some(&last));
    last
}

/// Removes nodeguard's taint if it added it.
async fn undo_taint<C: ClusterPort>(ctx: &Ctx<C>, taint_added: bool) -> core::TaintAfter {
    if !taint_added {
        core::TaintAfter::NotOurs
    } else if remove_taint_until_done(ctx).await {
        core::TaintAfter::Removed
    } else {
        core::TaintAfter::Left
    }
}

/// Removes a shutdown taint left behind (see [`Ctx::taint_left`]) while
/// the manager runs.
async fn clean_up_left_taint<C: ClusterPort>(ctx: Arc<Ctx<C>>, stop: CancellationToken) {
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = sleep(TAINT_CLEANUP_EVERY) => {}
        }
        if !ctx.taint_left.load(std::sync::atomic::Ordering::SeqCst) {
            continue;
        }
        let _turn = ctx.taint_cleanup.lock().await;
        // A shutdown that began meanwhile owns the taint now.
        if !ctx.taint_left.load(std::sync::atomic::Ordering::SeqCst) {
            continue;
        }
        match timeout(CALL_TIMEOUT, ctx.cluster.remove_taint()).await {
            Ok(Ok(())) => {
                ctx.forget_left_taint();
                report_taint_removed(
                    &ctx,
                    format!(
                        "nodeguard removed its shutdown taint {}, left on the node while the API server did not take its removal.",
                        cluster::TAINT_KEY
                    ),
                );
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "cannot remove the shutdown taint left behind yet")
            }
            Err(_) => tracing::debug!("the API server did not answer the taint removal"),
        }
    }
}

/// Retries removing the taint a while (about 10 s), each call bounded;
/// `false` when it gave up, and the removal goes on in the background
/// ([`clean_up_left_taint`]), so a cancel or a start-up after a reboot
/// does not wait on the API server to take the inhibitor again.
async fn remove_taint_until_done<C: ClusterPort>(ctx: &Ctx<C>) -> bool {
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
    for _ in 0..6 {
        match timeout(CALL_TIMEOUT, ctx.cluster.remove_taint()).await {
            Ok(Ok(())) => {
                ctx.forget_left_taint();
                return true;
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "cannot remove the shutdown taint yet; retrying")
            }
            Err(_) => tracing::warn!(
                "the API server did not answer the taint removal within {CALL_TIMEOUT:?}; retrying"
            ),
        }
        sleep(backoff.next_delay()).await;
    }
    tracing::error!(node = %ctx.node_name, every = ?TAINT_CLEANUP_EVERY, "cannot remove the shutdown taint {} yet; trying again in the background", cluster::TAINT_KEY);
    ctx.remember_left_taint();
    false
}

fn save<C>(ctx: &Ctx<C>, record: &ShutdownRecord) {
    state::save(&ctx.state_writes, &ctx.state_dir, record);
}

/// A shutdown: plan, condition, taint, groups, release. Returns the record.
///
/// The inhibitor is released at the plan's release point whatever the API
/// does: every API call of a group ends with the group's window, and the
/// taint request runs beside the groups (it holds nothing back).
async fn execute<C: ClusterPort>(
    ctx: Arc<Ctx<C>>,
    cfg: ShutdownConfig,
    lock: Option<InhibitLock>,
    delay_max: Duration,
    mut record: ShutdownRecord,
    resume: bool,
    cancel: CancellationToken,
) -> ShutdownRecord {
    let now_wall = ctx.clock.now();
    let now_monotonic = ctx.clock.monotonic();
    // Offsets are from the original start, also when resuming: by the
    // monotonic clock on the same boot (a wall-clock step between the start
    // and the restart changes nothing), by the wall clock for a record
    // written before the monotonic time was kept.
    let start = if resume {
        let elapsed = match (record.started_monotonic_ms, record.started_at) {
            (Some(ms), _) if record.boot_id == ctx.boot_id => {
                now_monotonic.saturating_sub(Duration::from_millis(ms))
            }
            (_, Some(s)) => now_wall.duration_since(s).try_into().unwrap_or_default(),
            _ => Duration::ZERO,
        };
        Instant::now() - elapsed.min(Duration::from_secs(24 * 3600))
    } else {
        Instant::now()
    };
    // A resumed agent may not have its pod list yet: planning without it
    // would find every group empty and release at once.
    if resume && ctx.pods.borrow().is_none() {
        let mut pods = ctx.pods.clone();
        let _ = timeout(
            delay_max.saturating_sub(cfg.safety_margin),
            pods.wait_for(Option::is_some),
        )
        .await;
    }
    // Pods whose deletion began since this shutdown started: a previous
    // process of the agent evicted them. Evicting them again would cut
    // their grace to the shorter window left, so they are only waited for.
    let already: BTreeSet<String> = if resume {
        let since = match record.started_at {
            Some(t) => t - jiff::SignedDuration::from_secs(1),
            // Killed before its first record: within logind's delay.
            None => now_wall - jiff::SignedDuration::try_from(delay_max).unwrap_or_default(),
        };
        terminating_since(&ctx.pods.borrow(), since)
    } else {
        BTreeSet::new()
    };
    if record.started_at.is_none() {
        record.started_at = Some(now_wall);
        record.started_monotonic_ms = Some(now_monotonic.as_millis() as u64);
    }
    record.boot_id = ctx.boot_id.clone();
    if record.plan.is_none() {
        record.plan = Some(cfg.clone());
    }
    // On disk before the copy goes to the keeper and before any eviction:
    // a process killed from here on leaves a record, so its successor
    // resumes by the original start.
    save(&ctx, &record);
    // From here until the release, a copy of the lock outlives this
    // process (an agent killed now does not let logind go on).
    let mut lock = lock.map(|l| l.kept_by(&ctx.keeper));
    ctx.metrics
        .start_time
        .set(unix_seconds(record.started_at.unwrap_or(now_wall)));
    ctx.metrics.end_time.set(0.0);

    // The plan, computed once: the groups with pods share what logind allows.
    let facts: Vec<core::PodFacts> = ctx
        .pods
        .borrow()
        .as_ref()
        .map(|s| s.values().map(|p| pod_facts(p)).collect())
        .unwrap_or_default();
    let groups = core::group_pods(&cfg.groups, &facts, cfg.include);
    let occupied: Vec<bool> = groups
        .iter()
        .map(|g| !g.pods.is_empty() && !record.groups_done.contains(&g.spec.priority))
        .collect();
    let limit = delay_max.saturating_sub(cfg.safety_margin);
    let timeline = core::timeline(
        &cfg.groups,
        &occupied,
        limit,
        Instant::now().saturating_duration_since(start),
    );
    report_condition(
        &ctx,
        &core::Phase::Running {
            groups: cfg.groups.len(),
            release: timeline.release,
        },
        None,
    );
    if resume {
        let message = format!(
            "nodeguard restarted {:.1}s into the shutdown and goes on with the remaining priority groups ({} of {} done{}).",
            Instant::now()
                .saturating_duration_since(start)
                .as_secs_f64(),
            record.groups_done.len(),
            cfg.groups.len(),
            if already.is_empty() {
                String::new()
            } else {
                format!(
                    "; {} pod(s) already terminating are not evicted again",
                    already.len()
                )
            }
        );
        tracing::warn!("{message}");
        ctx.reporter.event(
            EventKind::Warning,
            "ShutdownResumed",
            "ResumeShutdown",
            message,
        );
    } else {
        ctx.reporter.event(
            EventKind::Warning,
            "ShutdownStarted",
            "StartShutdown",
            format!(
                "The host is shutting down (PrepareForShutdown); nodeguard taints the node {} and evicts its pods by priority.",
                cluster::TAINT_KEY
            ),
        );
    }

    let record = std::sync::Mutex::new(record);
    let release_at = start + timeline.release;
    let (outcome, taint_done) = {
        let lock_record = || record.lock().unwrap_or_else(|e| e.into_inner());
        // A process before this one may have had its request applied and
        // been killed before it recorded the answer: the taint found is
        // then its, not a taint someone else put there before the shutdown.
        let unanswered_before = resume && !lock_record().taint_answered;
        // Retried until it answers (or the plan ends): an API server
        // restarting as the shutdown begins must not leave the node open to
        // the scheduler for the whole shutdown. A failed request may still
        // have been applied (the answer lost), so the taint a later attempt
        // finds is then nodeguard's, as after a predecessor killed with its
        // request in flight; the record says so until an answer comes.
        // The first answer to the taint request (or none within
        // `CALL_HEADROOM`) lets the groups begin: a pod evicted before the
        // node is tainted may be replaced on this very node.
        let first_answer = tokio::sync::Notify::new();
        let taint = async {
            // A taint left by an earlier shutdown is this one's now: the
            // background removal stops, and one in flight is waited out.
            // The taint found there is then nodeguard's: this shutdown's
            // record says so.
            let took_over = ctx.forget_left_taint();
            drop(ctx.taint_cleanup.lock().await);
            let mut maybe_applied = unanswered_before || took_over;
            let mut backoff = Backoff::new(TAINT_RETRY_MIN, TAINT_RETRY_MAX);
            let mut attempts = 0u32;
            loop {
                attempts += 1;
                let answer = ctx.cluster.add_taint().await;
                if answer.is_ok() {
                    first_answer.notify_one();
                }
                match answer {
                    Ok(added) => {
                        if attempts > 1 {
                            tracing::info!(attempts, "the node is tainted");
                        }
                        let mut r = lock_record();
                        r.taint_added |= added || maybe_applied;
                        r.taint_answered = true;
                        save(&ctx, &r);
                        return;
                    }
                    Err(e) => {
                        maybe_applied |= e.maybe_applied();
                        if attempts == 1 {
                            tracing::error!(error = %e, "cannot taint the node; evicting anyway and retrying the taint");
                        } else {
                            tracing::debug!(error = %e, attempts, "cannot taint the node yet");
                        }
                        sleep(backoff.next_delay()).await;
                    }
                }
            }
        };
        // A resumed shutdown whose taint request was answered before has
        // its taint: the groups go on at once.
        let wait_for_taint = !resume || unanswered_before;
        let work = async {
            if wait_for_taint {
                let _ = tokio::time::timeout(core::CALL_HEADROOM, first_answer.notified()).await;
            }
            run_groups(&ctx, &cfg, &groups, &timeline, start, &record, &already).await
        };
        // The record (written before the groups) goes to disk again once
        // the taint request has answered, so a successor knows whose taint
        // it is.
        tokio::pin!(taint, work);
        let mut taint_done = false;
        let mut outcome = loop {
            tokio::select! {
                _ = &mut work => break "all groups done",
                _ = &mut taint, if !taint_done => taint_done = true,
                _ = sleep_until(release_at) => break "the inhibit window is closing",
                _ = cancel.cancelled() => break "cancelled",
            }
        };
        if !taint_done && outcome != "cancelled" {
            // Give the taint request its moment (the groups waited for it
            // up to 1 s already), so the node is tainted and the record
            // knows whose taint it is; one that does not answer holds the
            // release 1 s from the start at most, never past logind's
            // limit.
            let until = (start + limit).min(start + core::CALL_HEADROOM);
            tokio::select! {
                _ = &mut taint => taint_done = true,
                _ = sleep_until(until) => {}
                _ = cancel.cancelled() => outcome = "cancelled",
            }
        }
        (outcome, taint_done)
    };
    let mut record = record.into_inner().unwrap_or_else(|e| e.into_inner());
    if !taint_done {
        // The request may have reached the API server: count the taint as
        // nodeguard's, so a cancel or the next start removes it.
        tracing::warn!("the API server did not answer the taint request in time");
        record.taint_added = true;
    }
    if outcome == "cancelled" {
        return record;
    }
    let end = ctx.clock.now();
    record.ended_at = Some(end);
    ctx.metrics.end_time.set(unix_seconds(end));
    save(&ctx, &record);
    let took = Instant::now().saturating_duration_since(start);
    let message = format!(
        "nodeguard released the shutdown inhibitor after {:.1}s ({outcome}; {} of {} group(s) done).",
        took.as_secs_f64(),
        record.groups_done.len(),
        cfg.groups.len()
    );
    // The last word goes out while the lock still holds the host: once
    // logind goes on, the network may be gone before a publish after it
    // (the unit stopping the interfaces runs beside the kubelet's). At most
    // CALL_HEADROOM; a window the groups used up leaves the safety margin,
    // and logind's own limit is never passed (it would go on by itself).
    let published = ctx.reporter.event_confirmed(
        EventKind::Normal,
        "ShutdownInhibitorReleased",
        "ReleaseInhibitor",
        message.clone(),
    );
    let until = (start + delay_max).min(Instant::now() + core::CALL_HEADROOM);
    if !matches!(tokio::time::timeout_at(until, published).await, Ok(true)) {
        tracing::debug!("the release's Event is not confirmed; releasing anyway");
    }
    // Release: logind may now proceed. The keeper's copy goes too, also
    // when this process resumed without holding a lock of its own.
    let kept = lock.take().is_some();
    if !kept && ctx.keeper != Keeper::None {
        let _ = ctx.keeper.forget(keep::INHIBITOR);
    }
    ctx.metrics.inhibitor_held.set(0);
    tracing::info!("{message}");
    record
}

/// The groups in order, each within the window the timeline gives it.
async fn run_groups<C: ClusterPort>(
    ctx: &Ctx<C>,
    cfg: &ShutdownConfig,
    groups: &[core::Group],
    timeline: &core::Timeline,
    start: Instant,
    record: &std::sync::Mutex<ShutdownRecord>,
    already: &BTreeSet<String>,
) {
    let lock = || record.lock().unwrap_or_else(|e| e.into_inner());
    for (i, group) in groups.iter().enumerate() {
        let priority = group.spec.priority;
        if lock().groups_done.contains(&priority) {
            continue;
        }
        // A group's window opens when the previous group is done (early
        // when its pods left early).
        let opened = Instant::now();
        let window = timeline.window(i, opened.saturating_duration_since(start));
        let skipped = core::too_short(window) && !group.pods.is_empty();
        if skipped {
            for _ in &group.pods {
                ctx.metrics.pod(priority, "skipped");
            }
            let message = format!(
                "Priority group {priority} ({} pod(s)) skipped: logind's limit leaves it less than a second after the higher-priority groups.",
                group.pods.len()
            );
            tracing::warn!("{message}");
            ctx.reporter.event(
                EventKind::Warning,
                "ShutdownGroupSkipped",
                "EvictPods",
                message,
            );
        } else {
            tracing::info!(group = priority, pods = group.pods.len(), window = ?window, "terminating priority group");
            for pod in group.pods.iter().filter(|p| already.contains(&p.key)) {
                tracing::info!(pod = %pod.key, "already terminating since this shutdown began; not evicted again");
                ctx.metrics.pod(priority, "already_terminating");
            }
            let tasks = group
                .pods
                .iter()
                .filter(|p| !already.contains(&p.key))
                .map(|pod| {
                    let plan =
                        core::PodPlan::new(window, pod, cfg.escalate, cfg.escalate_after_percent);
                    terminate(ctx, priority, plan, pod, opened)
                });
            join_all(tasks).await;
            wait_gone(ctx, &group.pods, opened + window).await;
        }
        {
            let mut r = lock();
            r.groups_done.push(priority);
            save(ctx, &r);
        }
        if !skipped {
            ctx.reporter.event(
                EventKind::Normal,
                "ShutdownGroupDone",
                "EvictPods",
                format!(
                    "Priority group {priority} done ({} pod(s)) {:.1}s into the shutdown.",
                    group.pods.len(),
                    Instant::now()
                        .saturating_duration_since(start)
                        .as_secs_f64()
                ),
            );
        }
    }
}

/// Terminates one pod as the decision core steps it: evictions, retries,
/// an escalating delete. Every call ends when the window does.
async fn terminate<C: ClusterPort>(
    ctx: &Ctx<C>,
    group: i32,
    plan: core::PodPlan,
    pod: &core::PodFacts,
    opened: Instant,
) {
    let window_end = opened + plan.window;
    let mut attempt = 0;
    let mut pdb: Option<String> = None;
    let mut refusal = String::new();
    let mut delete: Option<i64> = None;
    loop {
        let outcome = match delete {
            None => match timeout_at(window_end, ctx.cluster.evict(&pod.key, plan.grace)).await {
                Ok(Ok(Evicted::Yes)) => core::Outcome::Evicted,
                Ok(Ok(Evicted::Gone)) => core::Outcome::Gone,
                Ok(Ok(Evicted::Blocked { pdb: p, message })) => {
                    pdb = p.or(pdb);
                    refusal = message;
                    tracing::debug!(pod = %pod.key, pdb = ?pdb, "eviction refused");
                    core::Outcome::Blocked
                }
                Ok(Err(e)) => {
                    tracing::warn!(pod = %pod.key, error = %e, "eviction failed");
                    core::Outcome::Failed
                }
                Err(_) => {
                    tracing::warn!(pod = %pod.key, "the eviction got no answer before the group's window closed");
                    core::Outcome::Failed
                }
            },
            Some(grace) => {
                match timeout_at(window_end, ctx.cluster.delete(&pod.key, grace)).await {
                    Ok(Ok(())) => core::Outcome::Deleted,
                    Ok(Err(e)) => {
                        tracing::warn!(pod = %pod.key, error = %e, "escalating delete failed");
                        core::Outcome::Failed
                    }
                    Err(_) => {
                        tracing::warn!(pod = %pod.key, "the escalating delete got no answer before the group's window closed");
                        core::Outcome::Failed
                    }
                }
            }
        };
        let now = Instant::now().saturating_duration_since(opened);
        match core::next(&plan, now, outcome, attempt) {
            core::PodStep::End(end) => {
                report_pod_end(
                    ctx,
                    group,
                    pod,
                    &plan,
                    end,
                    delete,
                    pdb.as_deref(),
                    &refusal,
                );
                return;
            }
            core::PodStep::Escalate { grace } => delete = Some(grace),
            core::PodStep::Retry { at } => {
                delete = None;
                attempt += 1;
                sleep_until(opened + at).await;
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn report_pod_end<C>(
    ctx: &Ctx<C>,
    group: i32,
    pod: &core::PodFacts,
    plan: &core::PodPlan,
    end: core::PodEnd,
    delete_grace: Option<i64>,
    pdb: Option<&str>,
    refusal: &str,
) {
    if end != core::PodEnd::Gone {
        ctx.metrics.pod(group, end.label());
    }
    match end {
        core::PodEnd::Evicted => tracing::info!(pod = %pod.key, grace = plan.grace, "evicted"),
        core::PodEnd::Gone => {}
        core::PodEnd::Escalated => {
            let pdb_text = pdb
                .map(|p| format!("PodDisruptionBudget {p}"))
                .unwrap_or_else(|| "a PodDisruptionBudget".into());
            let note = format!(
                "Eviction of {} kept being refused by {pdb_text} ({refusal}); nodeguard deleted it with {}s grace so the node can shut down in time.",
                pod.key,
                delete_grace.unwrap_or(0)
            );
            tracing::warn!("{note}");
            ctx.reporter
                .event(EventKind::Warning, "EvictionEscalated", "DeletePod", note);
        }
        core::PodEnd::Blocked => ctx.reporter.event(
            EventKind::Warning,
            "EvictionBlocked",
            "EvictPod",
            format!(
                "{} stays: its eviction is refused by {} and escalation is off.",
                pod.key,
                pdb.unwrap_or("a PodDisruptionBudget")
            ),
        ),
        core::PodEnd::Failed => {
            tracing::error!(pod = %pod.key, "the pod could not be evicted before its group's window closed")
        }
    }
}

/// Keys of the pods whose deletion was asked for at or after `since`. (A
/// pod's deletionTimestamp is when its grace ends: the request came
/// deletionGracePeriodSeconds before.)
fn terminating_since(pods: &Option<Snapshot<Pod>>, since: jiff::Timestamp) -> BTreeSet<String> {
    pods.as_ref()
        .map(|s| {
            s.iter()
                .filter(|(_, p)| {
                    let grace = p.metadata.deletion_grace_period_seconds.unwrap_or(0);
                    p.metadata.deletion_timestamp.as_ref().is_some_and(|t| {
                        t.0 - jiff::SignedDuration::from_secs(grace.max(0)) >= since
                    })
                })
                .map(|(k, _)| k.to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// Waits until the pods have left the node (or are terminal), or `until`.
async fn wait_gone<C>(ctx: &Ctx<C>, pods: &[core::PodFacts], until: Instant) {
    let keys: BTreeSet<&str> = pods.iter().map(|p| p.key.as_str()).collect();
    let mut rx = ctx.pods.clone();
    loop {
        let remaining = rx
            .borrow_and_update()
            .as_ref()
            .map(|s| {
                s.iter()
                    .filter(|(k, p)| keys.contains(k.as_str()) && !pod_facts(p).terminal)
                    .count()
            })
            .unwrap_or(0);
        if remaining == 0 {
            return;
        }
        tokio::select! {
            _ = sleep_until(until) => return,
            r = rx.changed() => if r.is_err() { return },
        }
    }
}

/// Path of the shutdown state file in `dir` (for tests and docs).
pub fn state_file(dir: &Path) -> PathBuf {
    dir.join(state::FILE_NAME)
}

#[cfg(test)]
mod tests;
