//! The shutdown manager's lifecycle: start-up, arming, the armed loop that
//! answers logind's signals, policy changes and a stop's question, and
//! the undo after a cancel.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use tokio::sync::{mpsc, watch};
use tokio::time::{Instant, sleep, timeout};
use tokio_util::sync::CancellationToken;

use super::ClusterPort;
use super::arm::{connect_and_arm, ensure_delay, why};
use super::conditions::{report_armed, report_condition, report_unavailable};
use super::core;
use super::execute::execute;
use super::keep::Keeper;
use super::logind::{self, InhibitLock, LogindEvent};
use super::startup::{
    cancelled_meanwhile, logind_after_restart, preparing_for_shutdown, shutdown_under_way,
    start_up, watch_going_down,
};
use super::state::{self, ShutdownRecord, StartedBy};
use super::stop::{ArmedMark, StopPhase, StopQuestions};
use super::taint::{clean_up_left_taint, undo_taint};
use super::{CALL_TIMEOUT, Ctx, ShutdownConfig, ShutdownMetrics, UNAVAILABLE};
use super::{LogindConnector, LogindPort};
use crate::clock::WallClock;
use crate::k8s::watch::Snapshot;
use crate::report::{EventKind, Reporter};
use crate::server::LoopHandle;
use crate::server::backoff::Backoff;
use crate::state_dir::StateWrites;

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
    /// Handing the lock over to the next pod's agent.
    pub handover: super::Handover,
}

/// Backoff between reconnects to the bus or logind: short, so the lock is
/// back within about two seconds of logind's return.
const RECONNECT_MIN: Duration = Duration::from_millis(100);
const RECONNECT_MAX: Duration = Duration::from_millis(1000);

/// The shutdown manager loop. Runs until `stop`; then releases the lock.
pub async fn run_shutdown_manager<L: LogindConnector, C: ClusterPort>(
    host: ShutdownHost<L, C>,
    config: watch::Receiver<Option<ShutdownConfig>>,
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
        handover: host.handover,
        holder_ready: Arc::new(watch::Sender::new(None)),
    });
    install_holder(&ctx);
    // A taint a previous process could not remove: removed from here on.
    if state::taint_left(&ctx.state_dir) {
        tracing::info!(
            "nodeguard's shutdown taint was left on the node by a previous process; removing it in the background"
        );
        ctx.taint_left
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }
    tokio::spawn(clean_up_left_taint(ctx.clone(), stop.clone()));
    let mut manager = Manager {
        ctx,
        logind: host.logind,
        config,
        handle,
        stop,
        questions: host.stop_questions,
        last: None,
        backoff: Backoff::new(RECONNECT_MIN, RECONNECT_MAX),
        failing_since: None,
        policy_known: false,
    };
    // A lock left by a previous process of this agent (killed while it
    // held one): held from here, so logind keeps waiting for this process.
    let reclaimed = host.reclaimed.map(|fd| {
        tracing::info!(keeper = %host.keeper, "took back the delay inhibitor a previous process of the agent left with its keeper");
        InhibitLock::reclaimed(fd, &host.keeper)
    });
    tracing::debug!("shutdown manager started");
    let mut stage = manager.start(reclaimed).await;
    while !matches!(stage, Stage::Stopped) {
        stage = manager.step(stage).await;
    }
    manager.questions.set(StopPhase::Free);
    manager.ctx.metrics.inhibitor_held.set(0);
}

/// Where the shutdown manager stands between two steps. What a stage
/// carries is what the next one needs: the shutdown to resume, and a lock
/// carried into the next arming.
enum Stage {
    /// Choose the plan: the one a resumed shutdown began with, or the
    /// policy's (waiting for a policy that wants graceful shutdown).
    Choose {
        resume: Option<ShutdownRecord>,
        /// Taken back from the keeper, or from a restarted logind: held
        /// until the armed loop answers a stop's question.
        lock: Option<InhibitLock>,
        /// `lock` was taken from a restarted logind that had forgotten
        /// the shutdown: the subscription is new, so a reboot asked for in
        /// between would go unseen; ask once subscribed.
        carried: bool,
    },
    /// Connect to logind, arm for `cfg`, then run the armed loop.
    Arm {
        cfg: ShutdownConfig,
        resume: Option<ShutdownRecord>,
        lock: Option<InhibitLock>,
        carried: bool,
    },
    /// This boot's shutdown is done and the host should be going down:
    /// watch that it does, and undo the shutdown (as after a cancel) if it
    /// does not.
    GoingDown {
        taint_added: bool,
        cause: core::CancelCause,
    },
    /// The agent stops.
    Stopped,
}

/// What the manager keeps across its stages.
struct Manager<L, C> {
    ctx: Arc<Ctx<C>>,
    logind: L,
    config: watch::Receiver<Option<ShutdownConfig>>,
    handle: LoopHandle,
    stop: CancellationToken,
    questions: StopQuestions,
    /// The last shutdown, as the condition reports it.
    last: Option<core::LastShutdown>,
    /// Between failed attempts to reach logind.
    backoff: Backoff,
    /// Since when logind has been unreachable (said once).
    failing_since: Option<Instant>,
    /// Until the first policy selection arrives, "no config" means "not
    /// known yet", not "off": what start-up reported (NodeRebooted) must
    /// stay.
    policy_known: bool,
}

impl<L: LogindConnector, C: ClusterPort> Manager<L, C> {
    async fn step(&mut self, stage: Stage) -> Stage {
        match stage {
            Stage::Choose {
                resume,
                lock,
                carried,
            } => self.choose(resume, lock, carried).await,
            Stage::Arm {
                cfg,
                resume,
                lock,
                carried,
            } => self.arm(cfg, resume, lock, carried).await,
            Stage::GoingDown { taint_added, cause } => self.going_down(taint_added, cause).await,
            Stage::Stopped => Stage::Stopped,
        }
    }

    /// Start-up: resume this boot's shutdown, report the one before the
    /// reboot, or find the host going down already.
    async fn start(&mut self, mut reclaimed: Option<InhibitLock>) -> Stage {
        // The lock the previous pod's agent handed over: held from here, as
        // one taken back from the keeper (a shutdown begun meanwhile is
        // resumed, logind waiting on it); released once this agent holds
        // its own, or the policy wants none.
        // (With a lock taken back from the keeper, the handover's goes.)
        // Looked for even with the handover off here: a unit left by a
        // predecessor that had it on goes once this agent decides.
        // `None`: logind could not be asked (a note, if any, is kept).
        let found = take_handover(&self.logind).await;
        let listed = found.as_ref().map(Option::is_some);
        if let Some(Some(lock)) = found
            && reclaimed.is_none()
        {
            tracing::info!(
                unit = logind::HANDOVER_UNIT,
                "took over the delay inhibitor the previous agent handed over"
            );
            reclaimed = Some(lock);
        }
        // Holding a lock taken back from the keeper, the manager decides
        // (resume or not) before a stop may release it.
        if reclaimed.is_some() {
            self.questions.set(StopPhase::Holding);
        }
        // The loop counts as synced (so /readyz and systemd's READY=1) only
        // once it has decided for the policy in force: armed (the delay
        // inhibitor held), off, or unavailable and reported. A restarted
        // agent that says it is ready therefore protects the next shutdown.
        // A shutdown begun while only the handover unit held the lock: its
        // note becomes the record start-up reads, so it is resumed from
        // when it began. Without the unit's lock in hand, a note is stale.
        let handed_over = reclaimed.as_ref().is_some_and(|l| l.is_handed_over());
        if handed_over {
            let _ = adopt(&self.ctx);
        } else if listed.is_some() {
            // No unit (or a keeper's lock won): not this agent's to take.
            super::holder::forget_note(&self.ctx.state_dir, &self.ctx.state_writes);
        }
        let (mut resume, last, going_down) = start_up(&self.ctx, &self.logind).await;
        self.last = last;
        if resume.is_none() && going_down.is_none() && reclaimed.is_some() {
            // The previous process was killed after PrepareForShutdown but
            // before it wrote its record: logind still waits on the
            // reclaimed lock, and will not say PrepareForShutdown again.
            if preparing_for_shutdown(&self.logind).await == Some(true) {
                // Noted by the handover unit since start-up read the state?
                let noted = if handed_over { adopt(&self.ctx) } else { None };
                resume = Some(noted.unwrap_or_else(|| {
                    tracing::warn!(
                        "the host is shutting down and the previous process left no record: starting the shutdown's groups now"
                    );
                    ShutdownRecord {
                        boot_id: self.ctx.boot_id.clone(),
                        ..Default::default()
                    }
                }));
            }
        }
        match going_down {
            Some(taint_added) => {
                // This boot's shutdown is done: a lock still kept goes now.
                // Nothing to arm (logind refuses new delay locks now) and
                // nothing to undo while the machine goes down: the taint
                // goes with it and the next boot reports the shutdown.
                // Should logind's shutdown end without the machine going
                // down (a failed or cancelled job), undo it then, as after
                // a cancel.
                drop(reclaimed);
                Stage::GoingDown {
                    taint_added,
                    cause: core::CancelCause::Logind,
                }
            }
            // Carried: once subscribed, logind is asked whether a shutdown
            // began between this check and the subscription.
            None => Stage::Choose {
                resume,
                carried: reclaimed.is_some(),
                lock: reclaimed,
            },
        }
    }

    /// A shutdown resumed goes on with the plan it began with, whatever the
    /// policy says now (edited, invalid, or without a shutdown section);
    /// otherwise, wait for a policy that wants graceful shutdown.
    async fn choose(
        &mut self,
        resume: Option<ShutdownRecord>,
        mut lock: Option<InhibitLock>,
        carried: bool,
    ) -> Stage {
        // A lock carried into this pass is held until the armed loop
        // answers; a handed-over one only with a shutdown to resume (a
        // stop otherwise leaves it to the next agent, see `let_go`).
        self.questions.set(
            if lock
                .as_ref()
                .is_some_and(|l| !l.is_handed_over() || resume.is_some())
            {
                StopPhase::Holding
            } else {
                StopPhase::Free
            },
        );
        let recorded = resume.as_ref().and_then(|r| r.plan.clone());
        let cfg = if let Some(c) = recorded {
            tracing::info!("resuming the shutdown with the plan it began with");
            c
        } else {
            loop {
                // A selection sent before this first look (the agent's
                // first one may come while start-up still asks logind) is
                // known too, though `changed()` below will not say so.
                if self.config.has_changed().unwrap_or(false) {
                    self.policy_known = true;
                }
                if let Some(c) = self.config.borrow_and_update().clone() {
                    self.policy_known = true;
                    self.ctx
                        .metrics
                        .inhibit_delay_needed
                        .set(c.needed_delay().as_secs_f64());
                    break c;
                }
                if self.policy_known {
                    // No shutdown wanted: a carried lock goes too.
                    lock = None;
                    self.questions.set(StopPhase::Free);
                    self.handle.updated();
                    self.ctx.metrics.inhibit_delay_needed.set(0.0);
                    self.ctx.reporter.remove(UNAVAILABLE);
                    self.last = None;
                    report_condition(&self.ctx, &core::Phase::Off, None);
                    tracing::debug!("graceful shutdown is off; waiting for a policy");
                }
                tokio::select! {
                    _ = self.stop.cancelled() => {
                        let_go(lock, &self.ctx.handover);
                        return Stage::Stopped;
                    }
                    r = self.config.changed() => {
                        if r.is_err() { return Stage::Stopped }
                        self.policy_known = true;
                    }
                }
            }
        };
        Stage::Arm {
            cfg,
            resume,
            lock,
            carried,
        }
    }

    /// Connects and arms (resuming: logind is delaying its shutdown already
    /// and refuses new delay locks, OperationInProgress; the remaining
    /// groups run in the time left of the plan without one), then runs the
    /// armed loop.
    async fn arm(
        &mut self,
        mut cfg: ShutdownConfig,
        mut resume: Option<ShutdownRecord>,
        mut reclaimed: Option<InhibitLock>,
        carried: bool,
    ) -> Stage {
        let ctx = &self.ctx;
        let (port, events, delay_max, lock, began) = match connect_and_arm(
            ctx,
            &self.logind,
            &cfg,
            resume.is_none(),
            &mut reclaimed,
        )
        .await
        {
            Ok(parts) => parts,
            Err((reason, message)) => {
                report_unavailable(ctx, &mut self.failing_since, reason, &message);
                self.handle.updated();
                tokio::select! {
                    _ = self.stop.cancelled() => {
                        let_go(reclaimed, &self.ctx.handover);
                        return Stage::Stopped;
                    }
                    _ = sleep(self.backoff.next_delay()) => {}
                }
                return Stage::Choose {
                    resume,
                    lock: reclaimed,
                    carried,
                };
            }
        };
        self.backoff.reset();
        // A shutdown resumed because logind did not answer at start-up (or
        // was asked before it ended): logind answers now. If it prepares for
        // no shutdown, that one was cancelled meanwhile and its signal is
        // gone: undo it rather than evict pods on a node that stays up (and
        // then, holding no inhibitor, let the next shutdown through).
        if let Some(r) = &resume
            && matches!(
                timeout(CALL_TIMEOUT, port.preparing_for_shutdown()).await,
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
            self.last =
                Some(cancelled_meanwhile(ctx, taint_added, core::CancelCause::Logind).await);
            return Stage::Choose {
                resume: None,
                carried: lock.is_some(),
                lock,
            };
        }
        self.handle.updated();
        if self.failing_since.take().is_some() {
            tracing::info!("logind reachable again; delay inhibitor taken");
        }
        if lock.is_some() {
            ctx.metrics.inhibitor_held.set(1);
        }
        let mut fresh = began
            || (carried && resume.is_none() && lock.is_some() && shutdown_under_way(&port).await);
        // Begun between two agents, after this one read the state at
        // start: the handover unit's holder recorded when (and the plan in
        // force then), so it is resumed from there, not begun anew.
        if fresh
            && resume.is_none()
            && lock.as_ref().is_some_and(|l| l.is_handed_over())
            && let Some(r) = adopt(ctx)
        {
            if let Some(plan) = r.plan.clone() {
                cfg = plan;
            }
            resume = Some(r);
            fresh = false;
        }
        if fresh {
            tracing::warn!(
                "a shutdown began before nodeguard subscribed to logind (a restarted logind, or a lock taken over at start): the shutdown runs now"
            );
        }
        if lock.is_some() && resume.is_none() && !fresh {
            tracing::info!(delay_max = ?delay_max, needed = ?cfg.needed_delay(), groups = cfg.groups.len(), "holding a logind delay inhibitor for shutdown");
            report_armed(ctx, &cfg, delay_max, self.last.as_ref());
        }
        let mut armed_state = ArmedState {
            cfg,
            lock,
            delay_max,
            last: &mut self.last,
        };
        let ended = armed(
            ctx,
            &self.logind,
            &port,
            &mut self.config,
            &mut armed_state,
            events,
            resume.take(),
            fresh,
            &self.handle,
            &self.stop,
            &mut self.questions,
        )
        .await;
        match ended {
            Armed::Stop => Stage::Stopped,
            Armed::Reconnect(lock) => {
                ctx.metrics.inhibitor_held.set(0);
                Stage::Choose {
                    resume: None,
                    carried: lock.is_some(),
                    lock,
                }
            }
            Armed::GoingDown { taint_added } => Stage::GoingDown {
                taint_added,
                cause: core::CancelCause::LogindRestarted,
            },
        }
    }

    /// No lock, and no loop to answer: a stop goes on at once.
    async fn going_down(&mut self, taint_added: bool, cause: core::CancelCause) -> Stage {
        self.ctx.metrics.inhibitor_held.set(0);
        self.questions.set(StopPhase::Free);
        self.handle.updated();
        match watch_going_down(&self.ctx, &self.logind, &self.stop, taint_added, cause).await {
            Some(l) => {
                self.last = Some(l);
                Stage::Choose {
                    resume: None,
                    lock: None,
                    carried: false,
                }
            }
            None => Stage::Stopped,
        }
    }
}

pub(super) enum Armed {
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
    // The lock was handed over (or tried) when a stop asked; the stop
    // follows, and does not try again.
    let mut handover_tried = false;
    // Found under way: its start was not seen, so not recorded as seen,
    // unless its signal is already queued (it began after the
    // subscription: seen, and that signal is this shutdown's).
    let mut pending = None;
    let mut running: Option<Running> = fresh.then(|| {
        let seen = match events.try_recv() {
            Ok(LogindEvent::PrepareForShutdown(true)) => true,
            Ok(other) => {
                pending = Some(other);
                false
            }
            Err(_) => false,
        };
        begin_shutdown(ctx, st, !seen)
    });
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
                } else if let Some(life) = handover_due(&ctx.handover, st, handover_tried) {
                    hand_over(ctx, port, &st.cfg, life).await;
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
            e = next_event(&mut pending, &mut events) => match e {
                Some(LogindEvent::PrepareForShutdown(true)) => {
                    if running.is_some() { continue; }
                    tracing::warn!("PrepareForShutdown(true): the host is shutting down");
                    running = Some(begin_shutdown(ctx, st, false));
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
                let mut interrupted = false;
                let mut preparing = false;
                // When logind was last asked and said no: the earliest a
                // shutdown found later can have begun.
                let asked_at = Instant::now();
                if running.is_none() {
                    tokio::select! {
                        biased;
                        _ = stop.cancelled() => interrupted = true,
                        r = timeout(CALL_TIMEOUT, port.preparing_for_shutdown()) => preparing = matches!(r, Ok(Ok(true))),
                    }
                }
                // The stop goes on: hand the lock over now, while still
                // subscribed and holding this process's own (a handed-over
                // one stays with its unit), then ask once more. A shutdown
                // begun during the handover is this agent's to run, from
                // when it began (the unit's note, or the last "no"); the
                // unit's lock goes once the stop waits for it. Unless the
                // stop no longer waits (a second signal, or its question
                // gave up): then the unit keeps the lock and its note for
                // the next agent. At most three calls in all
                // (`STOP_DECIDE_MAX` covers them).
                let mut handed = false;
                let mut during_handover = false;
                if !preparing
                    && !interrupted
                    && running.is_none()
                    && let Some(life) = handover_due(&ctx.handover, st, handover_tried)
                {
                    handover_tried = true;
                    handed = hand_over(ctx, port, &st.cfg, life).await;
                    if !stop.is_cancelled() && !answer.is_closed() {
                        let again = async { matches!(port.preparing_for_shutdown().await, Ok(true)) };
                        during_handover = timeout(CALL_TIMEOUT, again).await.unwrap_or(false)
                            && !stop.is_cancelled()
                            && !answer.is_closed();
                    }
                }
                if during_handover {
                    // Only a note of this handover: none begun before the
                    // last "no".
                    let asked_ms = ctx
                        .clock
                        .monotonic()
                        .saturating_sub(Instant::now().saturating_duration_since(asked_at))
                        .as_millis() as u64;
                    let record = super::holder::adopt(&ctx.state_dir, &ctx.boot_id, &ctx.state_writes, Some(asked_ms))
                        .unwrap_or_else(|| began_at(ctx, asked_at));
                    tracing::warn!(
                        began_before = ?Instant::now().saturating_duration_since(asked_at),
                        noted = handed,
                        "the host began shutting down during the inhibitor's handover: the shutdown runs first, from when it began"
                    );
                    *st.last = None;
                    running = Some(spawn_shutdown(ctx, &st.cfg, st.lock.take(), st.delay_max, record, false));
                } else if preparing {
                    tracing::warn!("asked to stop as the host begins shutting down (PrepareForShutdown not handled yet): the shutdown runs first");
                    running = Some(begin_shutdown(ctx, st, false));
                }
                let answered = answer.send(*ctx.in_progress.borrow()).is_ok();
                // The stop now waits for the shutdown: the unit's lock may go
                // (also one whose handover timed out after systemd started it).
                if during_handover
                    && answered
                    && let Ok(Ok(Some(unit))) = timeout(CALL_TIMEOUT, port.take_handover()).await
                {
                    drop(unit);
                }
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
    super::holder::forget_note(&ctx.state_dir, &ctx.state_writes);
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

/// The event looked at before the loop, then the subscription's.
async fn next_event(
    pending: &mut Option<LogindEvent>,
    events: &mut mpsc::Receiver<LogindEvent>,
) -> Option<LogindEvent> {
    match pending.take() {
        Some(e) => Some(e),
        None => events.recv().await,
    }
}

/// A shutdown logind has just begun: a new record, the lock handed to it.
/// A record of a shutdown that began at `since` (by this process's clock),
/// for one found under way later without a note of its start.
fn began_at<C>(ctx: &Ctx<C>, since: Instant) -> ShutdownRecord {
    let ago = Instant::now().saturating_duration_since(since);
    ShutdownRecord {
        boot_id: ctx.boot_id.clone(),
        started_at: Some(ctx.clock.at(since)),
        started_monotonic_ms: Some(ctx.clock.monotonic().saturating_sub(ago).as_millis() as u64),
        ..Default::default()
    }
}

/// `found`: the shutdown began before this agent subscribed, so its
/// start is when it was found ([`StartedBy::Found`]).
fn begin_shutdown<C: ClusterPort>(
    ctx: &Arc<Ctx<C>>,
    st: &mut ArmedState<'_>,
    found: bool,
) -> Running {
    *st.last = None;
    let record = ShutdownRecord {
        boot_id: ctx.boot_id.clone(),
        started_by: if found {
            StartedBy::Found
        } else {
            StartedBy::Agent
        },
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

/// The handover unit's lock, when logind lists one; `None` when logind
/// cannot be asked (the unit then ends by itself).
async fn take_handover<L: LogindConnector>(logind: &L) -> Option<Option<InhibitLock>> {
    let take = async { logind.connect().await?.take_handover().await };
    match timeout(CALL_TIMEOUT, take).await {
        Ok(Ok(lock)) => Some(lock),
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "cannot look for a handed-over delay inhibitor");
            None
        }
        Err(_) => {
            tracing::debug!("logind did not say whether a handed-over delay inhibitor is held");
            None
        }
    }
}

/// The handover unit's note of a shutdown begun between two agents, taken
/// into the record ([`super::holder::adopt`]).
fn adopt<C>(ctx: &Ctx<C>) -> Option<ShutdownRecord> {
    super::holder::adopt(&ctx.state_dir, &ctx.boot_id, &ctx.state_writes, None)
}

/// Copies this binary into the state directory for the handover unit, in
/// the background (once per process; the same bytes are only compared),
/// when the agent hands over with a host path for it; otherwise removes a
/// copy an earlier configuration left.
fn install_holder<C: Send + Sync + 'static>(ctx: &Arc<Ctx<C>>) {
    let dir = ctx.state_dir.clone();
    let wanted = ctx.handover.life.is_some() && ctx.handover.host_state_dir.is_some();
    let source = ctx
        .handover
        .holder_source
        .clone()
        .unwrap_or_else(|| "/proc/self/exe".into());
    // Only a weak hold on the sender: the retries end with the manager,
    // and the runtime never waits on them (a sleeping blocking thread
    // would hold the process's exit for minutes).
    let ready = Arc::downgrade(&ctx.holder_ready);
    tokio::spawn(async move {
        if !wanted {
            let d = dir.clone();
            let _ = tokio::task::spawn_blocking(move || super::holder::uninstall(&d)).await;
            if let Some(r) = ready.upgrade() {
                r.send_replace(Some(false));
            }
            return;
        }
        // Tried again every few minutes: a full disk at start is not
        // weeks of handovers without the holder.
        loop {
            let (s, d) = (source.clone(), dir.clone());
            let copied = tokio::task::spawn_blocking(move || super::holder::install(&s, &d)).await;
            let Some(r) = ready.upgrade() else { return };
            match copied {
                Ok(Ok(())) => {
                    tracing::debug!(dir = %dir.display(), "nodeguard's holder in place for the inhibitor's handover");
                    r.send_replace(Some(true));
                    return;
                }
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, dir = %dir.display(), retry_in = ?HOLDER_COPY_RETRY, "cannot copy nodeguard's holder into the state directory; a handover meanwhile uses the host's systemd-inhibit");
                    r.send_replace(Some(false));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "the holder's copy failed");
                    r.send_replace(Some(false));
                }
            }
            drop(r);
            tokio::time::sleep(HOLDER_COPY_RETRY).await;
        }
    });
}

/// How long a stop waits for the holder's copy still being made, and for
/// the holder's plan to be written (within the handover's `CALL_TIMEOUT`).
const HOLDER_COPY_WAIT: Duration = Duration::from_millis(500);
const PLAN_WRITE_WAIT: Duration = Duration::from_millis(300);
/// How long after a failed copy the holder's copy is tried again.
const HOLDER_COPY_RETRY: Duration = Duration::from_secs(300);

/// Leaves a delay inhibitor with the handover unit before this process's
/// lock goes (a stop that is not an uninstall: most often a rollout, whose
/// next pod takes it over). Said either way.
/// `true` when handed over.
async fn hand_over<C, P: LogindPort>(
    ctx: &Arc<Ctx<C>>,
    port: &P,
    cfg: &ShutdownConfig,
    life: Duration,
) -> bool {
    // The plan and the unit's start share one bound: a state directory
    // that hangs cannot hold the stop's question.
    // Everything within one deadline, inside the stop's question's share;
    // what is left goes to systemd and logind (the fallback keeps a part).
    let deadline = Instant::now() + CALL_TIMEOUT - Duration::from_millis(200);
    let handover = async {
        // A stop soon after the start may find the copy under way.
        let ready = match &ctx.handover.host_state_dir {
            Some(_) => {
                let mut rx = ctx.holder_ready.subscribe();
                matches!(
                    timeout(HOLDER_COPY_WAIT, rx.wait_for(Option::is_some)).await,
                    Ok(Ok(r)) if *r == Some(true)
                )
            }
            None => false,
        };
        // A stale note goes before a new holder may write one, and the
        // plan is written for it; a slow disk holds neither the stop's
        // question.
        let plan = ready.then(|| (ctx.boot_id.clone(), cfg.clone()));
        let (dir, writes) = (ctx.state_dir.clone(), ctx.state_writes.clone());
        let written = timeout(
            PLAN_WRITE_WAIT,
            tokio::task::spawn_blocking(move || {
                super::holder::forget_note(&dir, &writes);
                plan.map(|(boot, plan)| super::holder::write_plan(&dir, &boot, &plan))
            }),
        )
        .await;
        let holder = match (&ctx.handover.host_state_dir, written) {
            (Some(host), Ok(Ok(Some(Ok(()))))) => {
                Some(super::holder::command(host, &why(cfg), life))
            }
            (_, Ok(Ok(None))) | (None, _) => None,
            (_, Ok(Ok(Some(Err(e))))) => {
                tracing::warn!(error = %e, "cannot write the plan for nodeguard's holder; the handover uses the host's systemd-inhibit");
                None
            }
            (_, Ok(Err(e))) => {
                tracing::warn!(error = %e, "cannot write the plan for nodeguard's holder; the handover uses the host's systemd-inhibit");
                None
            }
            (_, Err(_)) => {
                tracing::warn!(wait = ?PLAN_WRITE_WAIT, "the state directory did not answer in time (a slow disk): the handover uses the host's systemd-inhibit");
                None
            }
        };
        let within = deadline.saturating_duration_since(Instant::now());
        port.hand_over(&why(cfg), life, holder, within).await
    };
    match timeout(CALL_TIMEOUT, handover).await {
        Ok(Ok(())) => {
            tracing::info!(
                unit = logind::HANDOVER_UNIT,
                life = ?life,
                "handed the delay inhibitor over for the next agent (the unit ends by itself after its life)"
            );
            true
        }
        Ok(Err(e)) => {
            tracing::warn!(
                unit = logind::HANDOVER_UNIT,
                error = %e,
                "cannot hand the delay inhibitor over: unless a shutdown begins before this agent stops, the node has none until the next agent takes its own"
            );
            false
        }
        Err(_) => {
            tracing::warn!(
                unit = logind::HANDOVER_UNIT,
                "systemd or logind did not answer the handover in time: the unit may hold a lock (it ends by itself), or the node has none until the next agent takes its own"
            );
            false
        }
    }
}

/// How long the handover unit is to hold the lock, when this stop hands
/// it over: the handover is on and not retiring, this process holds a lock
/// of its own (a handed-over one stays with its unit), and no handover was
/// tried yet.
fn handover_due(handover: &super::Handover, st: &ArmedState<'_>, tried: bool) -> Option<Duration> {
    let own = st.lock.as_ref().is_some_and(|l| !l.is_handed_over());
    handover.wanted().filter(|_| own && !tried)
}

/// A stop before this agent took a lock of its own: a handed-over lock is
/// left to the next agent (its unit keeps running), unless the agent goes
/// for good; any other lock goes with it.
fn let_go(lock: Option<InhibitLock>, handover: &super::Handover) {
    match lock {
        Some(l) if l.is_handed_over() && handover.wanted().is_some() => {
            tracing::info!(
                unit = logind::HANDOVER_UNIT,
                "stopping before holding a delay inhibitor of its own: the handed-over one is left for the next agent"
            );
            l.leave();
        }
        other => drop(other),
    }
}
