//! Graceful node shutdown with systemd-logind.
//!
//! While `spec.shutdown` is set, nodeguard holds a *delay* inhibitor lock
//! for `shutdown` (raising logind's `InhibitDelayMaxSec` with a drop-in when
//! the policy needs more). On `PrepareForShutdown(true)` it sets
//! `GracefulShutdown=True` and its `NoSchedule` taint at once, then
//! terminates pods by priority group, lowest first, through the Eviction
//! API (PodDisruptionBudgets honoured; a refusal is retried and, when the
//! group's window is running out, escalated to a delete with the remaining
//! grace and an Event naming the PDB). It releases the inhibitor after the
//! last group or before logind's limit, whichever is first. On
//! `PrepareForShutdown(false)` it stops, removes its own taint and takes
//! the lock again. A state file lets a restarted agent resume, and the
//! first start after a reboot clean up and report.

pub mod cluster;
pub mod core;
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
use tokio::time::{Instant, sleep, sleep_until};
use tokio_util::sync::CancellationToken;

use crate::clock::WallClock;
use crate::k8s::watch::Snapshot;
use crate::policy::{Escalation, ShutdownSpec};
use crate::report::{Desired, EventKind, Reporter, Status};
use crate::server::LoopHandle;
use cluster::{ClusterPort, Evicted, pod_facts};
use core::{GroupSpec, Include};
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

/// The policy's shutdown section, resolved.
#[derive(Clone, Debug, PartialEq, Eq)]
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
            "Pods handled during shutdown, by priority group and outcome (evicted, deleted, escalated, blocked, failed)",
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
        m
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
    pub boot_id: String,
    pub node_name: String,
}

/// Everything the running pieces share.
struct Ctx<C> {
    cluster: C,
    reporter: Reporter,
    metrics: ShutdownMetrics,
    state_dir: PathBuf,
    boot_id: String,
    node_name: String,
    clock: WallClock,
    pods: watch::Receiver<Option<Snapshot<Pod>>>,
}

/// Backoff between reconnects to the bus or logind: short, so the lock is
/// back within about two seconds of logind's return.
const RECONNECT_MIN: Duration = Duration::from_millis(100);
const RECONNECT_MAX: Duration = Duration::from_millis(1000);

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
        boot_id: host.boot_id,
        node_name: host.node_name,
        clock: WallClock::new(),
        pods,
    });
    let logind = host.logind;
    handle.updated();
    tracing::debug!("shutdown manager started");
    let mut resume = start_up(&ctx).await;
    let mut backoff = RECONNECT_MIN;
    let mut failing_since: Option<Instant> = None;
    // Until the first policy selection arrives, "no config" means "not known
    // yet", not "off": what start-up reported (NodeRebooted) must stay.
    let mut policy_known = false;
    'outer: loop {
        // Wait for a policy that wants graceful shutdown.
        let cfg = loop {
            if let Some(c) = config.borrow_and_update().clone() {
                policy_known = true;
                break c;
            }
            if policy_known {
                ctx.reporter.remove(UNAVAILABLE);
                ctx.reporter.remove(CONDITION);
                tracing::debug!("graceful shutdown is off; waiting for a policy");
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                r = config.changed() => {
                    if r.is_err() { return }
                    policy_known = true;
                }
            }
        };
        let (port, events, delay_max, lock) = match connect_and_arm(&ctx, &logind, &cfg).await {
            Ok(parts) => parts,
            Err((reason, message)) => {
                report_unavailable(&ctx, &mut failing_since, reason, &message);
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(RECONNECT_MAX);
                continue;
            }
        };
        backoff = RECONNECT_MIN;
        if failing_since.take().is_some() {
            tracing::info!("logind reachable again; delay inhibitor taken");
        }
        ctx.metrics.inhibitor_held.set(1);
        tracing::info!(delay_max = ?delay_max, needed = ?cfg.needed_delay(), groups = cfg.groups.len(), "holding a logind delay inhibitor for shutdown");
        report_armed(&ctx, &cfg, delay_max);
        match armed(
            &ctx,
            &port,
            &mut config,
            cfg,
            lock,
            events,
            delay_max,
            resume.take(),
            &handle,
            &stop,
        )
        .await
        {
            Armed::Stop => break 'outer,
            Armed::Reconnect => {
                ctx.metrics.inhibitor_held.set(0);
                continue;
            }
        }
    }
    ctx.metrics.inhibitor_held.set(0);
}

/// Connects to logind, subscribes, makes sure the inhibit delay suffices
/// and takes the lock; on failure, the condition reason and message.
async fn connect_and_arm<L: LogindConnector, C: ClusterPort>(
    ctx: &Ctx<C>,
    logind: &L,
    cfg: &ShutdownConfig,
) -> Result<(L::Port, mpsc::Receiver<LogindEvent>, Duration, InhibitLock), (&'static str, String)> {
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
    let lock = port.inhibit(&why(cfg)).await.map_err(|e| {
        ("InhibitorRefused", format!(
            "systemd-logind refused nodeguard's delay inhibitor ({e}); a shutdown would not wait for pods."
        ))
    })?;
    Ok((port, events, delay_max, lock))
}

enum Armed {
    Stop,
    Reconnect,
}

fn why(cfg: &ShutdownConfig) -> String {
    format!(
        "nodeguard moves pods off the node in {} priority group(s) within {}s",
        cfg.groups.len(),
        core::total_grace(&cfg.groups).as_secs()
    )
}

/// Holding the lock: wait for logind's signals and policy changes.
#[allow(clippy::too_many_arguments)]
async fn armed<P: LogindPort, C: ClusterPort>(
    ctx: &Arc<Ctx<C>>,
    port: &P,
    config: &mut watch::Receiver<Option<ShutdownConfig>>,
    mut cfg: ShutdownConfig,
    lock: InhibitLock,
    mut events: mpsc::Receiver<LogindEvent>,
    mut delay_max: Duration,
    resume: Option<ShutdownRecord>,
    handle: &LoopHandle,
    stop: &CancellationToken,
) -> Armed {
    let mut lock = Some(lock);
    let mut running: Option<(CancellationToken, tokio::task::JoinHandle<ShutdownRecord>)> = None;
    if let Some(record) = resume {
        tracing::warn!("resuming the shutdown that was in progress when the agent restarted");
        running = Some(spawn_shutdown(
            ctx,
            &cfg,
            lock.take(),
            delay_max,
            record,
            true,
        ));
    }
    loop {
        tokio::select! {
            _ = stop.cancelled() => {
                if let Some((token, task)) = running.take() {
                    token.cancel();
                    let _ = task.await;
                }
                return Armed::Stop;
            }
            r = config.changed() => {
                if r.is_err() { return Armed::Stop; }
                let new = config.borrow_and_update().clone();
                match new {
                    None if running.is_none() => {
                        tracing::info!("graceful shutdown turned off by policy; releasing the inhibitor");
                        ctx.metrics.inhibitor_held.set(0);
                        return Armed::Reconnect;
                    }
                    Some(new) if new != cfg && running.is_none() => {
                        handle.queued();
                        cfg = new;
                        if let Ok(d) = ensure_delay(ctx, port, &cfg).await {
                            delay_max = d;
                        }
                        report_armed(ctx, &cfg, delay_max);
                        handle.updated();
                    }
                    _ => {} // applied after the shutdown in progress
                }
            }
            e = events.recv() => match e {
                Some(LogindEvent::PrepareForShutdown(true)) => {
                    if running.is_some() { continue; }
                    tracing::warn!("PrepareForShutdown(true): the host is shutting down");
                    let record = ShutdownRecord { boot_id: ctx.boot_id.clone(), ..Default::default() };
                    running = Some(spawn_shutdown(ctx, &cfg, lock.take(), delay_max, record, false));
                }
                Some(LogindEvent::PrepareForShutdown(false)) => {
                    tracing::warn!("PrepareForShutdown(false): the shutdown was cancelled");
                    let mut record = None;
                    if let Some((token, task)) = running.take() {
                        token.cancel();
                        record = task.await.ok();
                    }
                    cancelled(ctx, record).await;
                    if lock.is_none() {
                        match port.inhibit(&why(&cfg)).await {
                            Ok(l) => {
                                lock = Some(l);
                                ctx.metrics.inhibitor_held.set(1);
                            }
                            Err(e) => {
                                tracing::warn!(error = %e, "cannot take the inhibitor again; reconnecting");
                                return Armed::Reconnect;
                            }
                        }
                    }
                }
                Some(LogindEvent::Gone) | None => {
                    tracing::warn!("systemd-logind or the system bus went away; reconnecting to take the lock again");
                    if running.is_some() {
                        // Keep evicting: the host is going down anyway.
                        if let Some((_, task)) = running.take() {
                            let _ = task.await;
                        }
                    }
                    return Armed::Reconnect;
                }
            }
        }
    }
}

fn spawn_shutdown<C: ClusterPort>(
    ctx: &Arc<Ctx<C>>,
    cfg: &ShutdownConfig,
    lock: Option<InhibitLock>,
    delay_max: Duration,
    record: ShutdownRecord,
    resume: bool,
) -> (CancellationToken, tokio::task::JoinHandle<ShutdownRecord>) {
    let token = CancellationToken::new();
    let task = tokio::spawn(execute(
        ctx.clone(),
        cfg.clone(),
        lock,
        delay_max,
        record,
        resume,
        token.clone(),
    ));
    (token, task)
}

/// Reads logind's maximum delay and, when the policy needs more, writes
/// the drop-in, makes logind reload, and reads it back.
async fn ensure_delay<P: LogindPort, C: ClusterPort>(
    ctx: &Ctx<C>,
    port: &P,
    cfg: &ShutdownConfig,
) -> Result<Duration, ShutdownError> {
    let mut current = port.inhibit_delay_max().await?;
    let needed = cfg.needed_delay();
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
        let message = format!(
            "logind allows shutdown to be delayed {}s but the policy needs {}s ({}); nodeguard will release its inhibitor after {}s and pods in the last groups may be killed. Raise InhibitDelayMaxSec= in /etc/systemd/logind.conf.d/ (or mount it for nodeguard's drop-in) and restart systemd-logind.",
            current.as_secs(),
            needed.as_secs(),
            match &cfg.drop_in_dir {
                Some(d) => format!("the drop-in in {} did not take effect", d.display()),
                None => "writing a drop-in is disabled".into(),
            },
            current.saturating_sub(cfg.safety_margin).as_secs(),
        );
        tracing::warn!("{message}");
        ctx.reporter.event(
            EventKind::Warning,
            "InhibitDelayTooShort",
            "CheckLogind",
            message.clone(),
        );
        ctx.reporter.set(
            UNAVAILABLE,
            Desired {
                status: Status::True,
                reason: "InhibitDelayTooShort".into(),
                message,
            },
        );
    }
    Ok(current)
}

fn report_armed<C>(ctx: &Ctx<C>, cfg: &ShutdownConfig, delay_max: Duration) {
    if delay_max < cfg.needed_delay() {
        return; // InhibitDelayTooShort stays
    }
    ctx.reporter.set(
        UNAVAILABLE,
        Desired {
            status: Status::False,
            reason: "InhibitorHeld".into(),
            message: format!(
                "nodeguard holds a logind delay inhibitor: on shutdown it moves pods off in {} priority group(s) within {}s (logind allows {}s).",
                cfg.groups.len(),
                core::total_grace(&cfg.groups).as_secs(),
                delay_max.as_secs()
            ),
        },
    );
    if !matches!(ctx.reporter.desired().get(CONDITION), Some(Some(d)) if d.status == Status::False)
    {
        ctx.reporter.set(
            CONDITION,
            Desired {
                status: Status::False,
                reason: "NoShutdown".into(),
                message: "No shutdown in progress.".into(),
            },
        );
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
/// after the reboot that followed one.
async fn start_up<C: ClusterPort>(ctx: &Ctx<C>) -> Option<ShutdownRecord> {
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
    match state::on_start(record.as_ref(), &ctx.boot_id) {
        OnStart::Nothing => None,
        OnStart::Resume => record,
        OnStart::AfterReboot { took, taint_added } => {
            if taint_added {
                remove_taint_until_done(ctx).await;
            }
            let took_text = match took {
                Some(d) => {
                    ctx.metrics.last_duration.set(d.as_secs_f64());
                    format!("took {}s", d.as_secs())
                }
                None => "did not finish before the machine went down".into(),
            };
            let started = record
                .as_ref()
                .and_then(|r| r.started_at)
                .map(|t| t.to_string())
                .unwrap_or_default();
            let message = format!(
                "The node is back after a shutdown that started at {started} and {took_text}; nodeguard removed its shutdown taint."
            );
            tracing::info!("{message}");
            ctx.reporter.event(
                EventKind::Normal,
                "NodeRebooted",
                "CompleteShutdown",
                message.clone(),
            );
            ctx.reporter.set(
                CONDITION,
                Desired {
                    status: Status::False,
                    reason: "NodeRebooted".into(),
                    message,
                },
            );
            if let Err(e) = state::clear(&ctx.state_dir) {
                tracing::error!(error = %e, "cannot clear the shutdown state");
            }
            None
        }
    }
}

async fn remove_taint_until_done<C: ClusterPort>(ctx: &Ctx<C>) {
    let mut backoff = Duration::from_millis(200);
    for _ in 0..20 {
        match ctx.cluster.remove_taint().await {
            Ok(()) => return,
            Err(e) => {
                tracing::warn!(error = %e, "cannot remove the shutdown taint yet; retrying");
                sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
    tracing::error!(node = %ctx.node_name, "gave up removing the shutdown taint {}; remove it with kubectl taint", cluster::TAINT_KEY);
}

fn save<C>(ctx: &Ctx<C>, record: &ShutdownRecord) {
    if let Err(e) = state::save(&ctx.state_dir, record) {
        tracing::error!(error = %e, "cannot record shutdown progress");
    }
}

/// A shutdown: condition, taint, groups, release. Returns the record.
async fn execute<C: ClusterPort>(
    ctx: Arc<Ctx<C>>,
    cfg: ShutdownConfig,
    mut lock: Option<InhibitLock>,
    delay_max: Duration,
    mut record: ShutdownRecord,
    resume: bool,
    cancel: CancellationToken,
) -> ShutdownRecord {
    let now_wall = ctx.clock.now();
    // Offsets are from the original start, also when resuming.
    let start = match record.started_at {
        Some(s) if resume => {
            let elapsed: Duration = (now_wall - s).try_into().unwrap_or_default();
            Instant::now() - elapsed.min(Duration::from_secs(24 * 3600))
        }
        _ => Instant::now(),
    };
    record.started_at.get_or_insert(now_wall);
    record.boot_id = ctx.boot_id.clone();
    ctx.metrics
        .start_time
        .set(unix_seconds(record.started_at.unwrap_or(now_wall)));
    ctx.metrics.end_time.set(0.0);
    let timeline = core::timeline(&cfg.groups, delay_max, cfg.safety_margin);
    ctx.reporter.set_urgent(
        CONDITION,
        Desired {
            status: Status::True,
            reason: "ShutdownInProgress".into(),
            message: format!(
                "The host is shutting down; nodeguard is moving pods off in {} priority group(s) and releases the shutdown in at most {}s.",
                cfg.groups.len(),
                timeline.release.as_secs()
            ),
        },
    );
    if !resume {
        ctx.reporter.event(
            EventKind::Warning,
            "ShutdownStarted",
            "StartShutdown",
            format!(
                "The host is shutting down (PrepareForShutdown); nodeguard tainted the node {} and is evicting its pods by priority.",
                cluster::TAINT_KEY
            ),
        );
    }
    match ctx.cluster.add_taint().await {
        Ok(added) => record.taint_added |= added,
        Err(e) => tracing::error!(error = %e, "cannot taint the node; evicting anyway"),
    }
    save(&ctx, &record);

    let release_at = start + timeline.release;
    let work = run_groups(&ctx, &cfg, &timeline, start, &mut record, &cancel);
    let outcome = tokio::select! {
        _ = work => "all groups done",
        _ = sleep_until(release_at) => "the inhibit window is closing",
        _ = cancel.cancelled() => "cancelled",
    };
    if outcome == "cancelled" {
        return record;
    }
    // Release: logind may now proceed.
    lock.take();
    ctx.metrics.inhibitor_held.set(0);
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
    tracing::info!("{message}");
    ctx.reporter.event(
        EventKind::Normal,
        "ShutdownInhibitorReleased",
        "ReleaseInhibitor",
        message,
    );
    record
}

async fn run_groups<C: ClusterPort>(
    ctx: &Arc<Ctx<C>>,
    cfg: &ShutdownConfig,
    timeline: &core::Timeline,
    start: Instant,
    record: &mut ShutdownRecord,
    cancel: &CancellationToken,
) {
    let facts: Vec<core::PodFacts> = ctx
        .pods
        .borrow()
        .as_ref()
        .map(|s| s.values().map(|p| pod_facts(p)).collect())
        .unwrap_or_default();
    let groups = core::group_pods(&cfg.groups, &facts, cfg.include);
    for (i, group) in groups.iter().enumerate() {
        if record.groups_done.contains(&group.spec.priority) {
            continue;
        }
        // A group's window starts when the previous group is done (early
        // when its pods left early), never past its worst-case slot.
        let group_start = Instant::now();
        let group_end = (group_start + group.spec.grace).min(start + timeline.group_ends[i]);
        let escalate_at =
            group_start + core::escalate_after(group_end - group_start, cfg.escalate_after_percent);
        tracing::info!(group = group.spec.priority, pods = group.pods.len(), window = ?(group_end - group_start), "terminating priority group");
        let tasks = group
            .pods
            .iter()
            .map(|pod| terminate(ctx, cfg, group.spec, pod, escalate_at, group_end, cancel));
        join_all(tasks).await;
        wait_gone(ctx, &group.pods, group_end, cancel).await;
        if cancel.is_cancelled() {
            return;
        }
        record.groups_done.push(group.spec.priority);
        save(ctx, record);
        ctx.reporter.event(
            EventKind::Normal,
            "ShutdownGroupDone",
            "EvictPods",
            format!(
                "Priority group {} done ({} pod(s)) {:.1}s into the shutdown.",
                group.spec.priority,
                group.pods.len(),
                Instant::now()
                    .saturating_duration_since(start)
                    .as_secs_f64()
            ),
        );
    }
}

/// Evicts one pod, retrying refusals, escalating when the window runs out.
async fn terminate<C: ClusterPort>(
    ctx: &Arc<Ctx<C>>,
    cfg: &ShutdownConfig,
    group: GroupSpec,
    pod: &core::PodFacts,
    escalate_at: Instant,
    group_end: Instant,
    cancel: &CancellationToken,
) {
    let grace = core::pod_grace(&group, pod);
    let mut backoff = Duration::from_millis(250);
    let mut last_pdb: Option<String> = None;
    loop {
        if cancel.is_cancelled() {
            return;
        }
        match ctx.cluster.evict(&pod.key, grace).await {
            Ok(Evicted::Yes) => {
                tracing::info!(pod = %pod.key, grace, "evicted");
                ctx.metrics.pod(group.priority, "evicted");
                return;
            }
            Ok(Evicted::Gone) => return,
            Ok(Evicted::Blocked { pdb, message }) => {
                last_pdb = pdb.or(last_pdb);
                let now = Instant::now();
                if cfg.escalate && now >= escalate_at {
                    let remaining = group_end.saturating_duration_since(now);
                    let g = core::escalation_grace(remaining, grace);
                    let pdb_text = last_pdb
                        .as_deref()
                        .map(|p| format!("PodDisruptionBudget {p}"))
                        .unwrap_or_else(|| "a PodDisruptionBudget".into());
                    match ctx.cluster.delete(&pod.key, g).await {
                        Ok(()) => {
                            ctx.metrics.pod(group.priority, "escalated");
                            let note = format!(
                                "Eviction of {} kept being refused by {pdb_text} ({message}); nodeguard deleted it with {g}s grace so the node can shut down in time.",
                                pod.key
                            );
                            tracing::warn!("{note}");
                            ctx.reporter.event(
                                EventKind::Warning,
                                "EvictionEscalated",
                                "DeletePod",
                                note,
                            );
                            return;
                        }
                        Err(e) => {
                            tracing::warn!(pod = %pod.key, error = %e, "escalating delete failed; retrying")
                        }
                    }
                } else if !cfg.escalate && now >= group_end {
                    ctx.metrics.pod(group.priority, "blocked");
                    ctx.reporter.event(
                        EventKind::Warning,
                        "EvictionBlocked",
                        "EvictPod",
                        format!(
                            "{} stays: its eviction is refused by {} and escalation is off.",
                            pod.key,
                            last_pdb.as_deref().unwrap_or("a PodDisruptionBudget")
                        ),
                    );
                    return;
                } else {
                    tracing::debug!(pod = %pod.key, pdb = ?last_pdb, "eviction refused; retrying");
                }
            }
            Err(e) => {
                if Instant::now() >= group_end {
                    ctx.metrics.pod(group.priority, "failed");
                    tracing::error!(pod = %pod.key, error = %e, "eviction failed until the window closed");
                    return;
                }
                tracing::warn!(pod = %pod.key, error = %e, "eviction failed; retrying");
            }
        }
        let until = if cfg.escalate {
            escalate_at.max(Instant::now())
        } else {
            group_end
        };
        let wake =
            (Instant::now() + backoff).min(until.max(Instant::now() + Duration::from_millis(50)));
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = sleep_until(wake) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// Waits until the pods have left the node (or are terminal), or `until`.
async fn wait_gone<C>(
    ctx: &Ctx<C>,
    pods: &[core::PodFacts],
    until: Instant,
    cancel: &CancellationToken,
) {
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
            _ = cancel.cancelled() => return,
            _ = sleep_until(until) => return,
            r = rx.changed() => if r.is_err() { return },
        }
    }
}

/// PrepareForShutdown(false): undo what the shutdown did to the node.
async fn cancelled<C: ClusterPort>(ctx: &Ctx<C>, record: Option<ShutdownRecord>) {
    let taint_added = record.as_ref().is_some_and(|r| r.taint_added);
    if taint_added {
        remove_taint_until_done(ctx).await;
    }
    if let Err(e) = state::clear(&ctx.state_dir) {
        tracing::error!(error = %e, "cannot clear the shutdown state");
    }
    let message = if taint_added {
        "The shutdown was cancelled; nodeguard removed its shutdown taint and holds its inhibitor again."
    } else {
        "The shutdown was cancelled; nodeguard holds its inhibitor again."
    };
    ctx.reporter.set_urgent(
        CONDITION,
        Desired {
            status: Status::False,
            reason: "ShutdownCancelled".into(),
            message: message.into(),
        },
    );
    ctx.reporter.event(
        EventKind::Normal,
        "ShutdownCancelled",
        "CancelShutdown",
        message,
    );
}

/// Path of the shutdown state file in `dir` (for tests and docs).
pub fn state_file(dir: &Path) -> PathBuf {
    dir.join(state::FILE_NAME)
}

#[cfg(test)]
mod tests;
