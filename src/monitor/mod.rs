//! The problem detector: log monitors (kernel log, files) whose rules set
//! NodeConditions that clear, emit Events, and add taints, with state that
//! survives restarts (and, for what a reboot makes stale, does not survive
//! a reboot).
//!
//! [`engine`] is the decision core, [`kmsg`] the record parser, [`sources`]
//! the bounded readers; [`run_monitors`] keeps one task per monitor,
//! restarts only the monitors whose spec changed (after the old task has
//! finished), and reports each monitor to the health registry as
//! `monitor/<name>`.

pub mod engine;
pub mod kmsg;
pub mod kube;
pub mod npd_metrics;
pub mod replay;
pub mod sources;

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::clock::WallClock;
use crate::policy::monitors::MonitorSpec;
use crate::report::{Desired, EventKind, Reporter, Status};
use crate::server::backoff::Backoff;
use crate::server::{Health, LoopHandle};
use crate::state_dir::StateWrites;
use engine::{Action, ConditionState, Engine, OwnedTaint, PluginStatus, TaintOutcome};
use sources::{Cursor, Resume, SourceCounters, StopFlag};

#[derive(Debug, thiserror::Error)]
pub enum MonitorError {
    #[error("cannot open log source {path}: {source}")]
    Source {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// The taint port's adapter failed (its own error inside).
    #[error("taint update failed: {0}")]
    Taint(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl MonitorError {
    /// Whether a failed taint update may have been applied (its answer
    /// lost); an adapter that cannot tell counts as "may have".
    pub fn maybe_applied(&self) -> bool {
        match self {
            MonitorError::Taint(e) => e
                .downcast_ref::<crate::k8s::taints::TaintError>()
                .is_none_or(|t| t.maybe_applied()),
            MonitorError::Source { .. } => false,
        }
    }
}

/// Port: the monitor's taints on this Node (implemented by `k8s::taints`).
pub trait TaintPort: Send + Sync + 'static {
    /// Adds the taint unless one with this key and effect is there; `true`
    /// when this call added it.
    fn add(
        &self,
        key: &str,
        value: &str,
        effect: &str,
    ) -> impl Future<Output = Result<bool, MonitorError>> + Send;
    /// Removes the taint with this key and effect, if there.
    fn remove(
        &self,
        key: &str,
        effect: &str,
    ) -> impl Future<Output = Result<(), MonitorError>> + Send;
}

/// How long a monitor may hold lines it has not processed before `/livez`
/// fails naming it.
pub const MONITOR_TIMEOUT: Duration = Duration::from_secs(60);

/// How often a taint update that failed (after its attempts) is tried
/// again while the monitor runs, until the Node matches the condition.
pub const TAINT_RETRY: Duration = Duration::from_secs(10);

/// How many batches of lines (see [`sources::Batch`]) may wait for a
/// monitor's rules; beyond, or beyond [`sources::QUEUE_BYTES`], file and
/// journal readers wait and kmsg records are dropped and counted
/// (`nodeguard_monitor_lines_dropped_total`).
pub const QUEUE: usize = 8192;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ActiveLabels {
    r#type: String,
    reason: String,
}

/// NPD-style problem metrics plus the sources' counters.
#[derive(Clone, Debug, Default)]
pub struct MonitorMetrics {
    problems: Family<ReasonLabels, Counter>,
    active: Family<ActiveLabels, Gauge>,
    active_reason: Arc<std::sync::Mutex<HashMap<String, String>>>,
    sources: Arc<std::sync::Mutex<BTreeMap<String, Arc<SourceCounters>>>>,
    /// node-problem-detector's names and semantics, beside ours.
    npd: Arc<std::sync::Mutex<npd_metrics::NpdProblems>>,
}

impl MonitorMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = MonitorMetrics::default();
        registry.register(
            "nodeguard_problem",
            "Problems detected, by reason (Events and condition activations)",
            m.problems.clone(),
        );
        registry.register(
            "nodeguard_problem_active",
            "1 while a condition is True with this reason; the previous reason of a type is cleared",
            m.active.clone(),
        );
        registry.register_collector(Box::new(SourceCollector(m.sources.clone())));
        registry.register_collector(Box::new(NpdCollector(m.npd.clone())));
        m
    }

    /// A monitor's start: each rule's reason at 0, in ours as in NPD's, so
    /// a first problem is an increase (a series born at 1 shows none); and
    /// what NPD runs as a custom plugin monitor (a plugin source here;
    /// counting rules, NPD's log-counter, imported or in the default
    /// policy) shows its conditions' no-problem reason from the first run.
    fn declare(&self, spec: &MonitorSpec, engine: &Engine) {
        for (reason, _) in engine.rule_reasons() {
            let _ = self.problems.get_or_create(&ReasonLabels {
                reason: reason.to_string(),
            });
        }
        let mut npd = self.npd();
        npd.declare(engine.rule_reasons());
        for c in &spec.conditions {
            let counted = spec
                .rules
                .iter()
                .any(|r| r.condition.as_deref() == Some(c.type_.as_str()) && r.count.is_some());
            if spec.source.plugin.is_some() || counted {
                npd.declare_no_problem(&c.type_, &c.reason);
            }
        }
    }

    fn npd(&self) -> std::sync::MutexGuard<'_, npd_metrics::NpdProblems> {
        self.npd.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn problem(&self, reason: &str) {
        self.npd().problem(reason);
        self.problems
            .get_or_create(&ReasonLabels {
                reason: reason.to_string(),
            })
            .inc();
    }

    fn set_active(&self, type_: &str, reason: &str, active: bool) {
        self.npd().condition(type_, reason, active);
        let mut last = self.active_reason.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(prev) = last.insert(type_.to_string(), reason.to_string())
            && prev != reason
        {
            self.active.remove(&ActiveLabels {
                r#type: type_.into(),
                reason: prev,
            });
        }
        self.active
            .get_or_create(&ActiveLabels {
                r#type: type_.into(),
                reason: reason.into(),
            })
            .set(i64::from(active));
    }

    fn forget(&self, type_: &str) {
        self.npd().forget(type_);
        let mut last = self.active_reason.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(prev) = last.remove(type_) {
            self.active.remove(&ActiveLabels {
                r#type: type_.into(),
                reason: prev,
            });
        }
    }
}

/// node-problem-detector's `problem_counter` and `problem_gauge`, as its
/// Prometheus exporter names them: no `_total` (OpenMetrics would add it to
/// a counter, so the counter is typed `unknown`, as an exporter's untyped
/// samples are).
#[derive(Debug)]
struct NpdCollector(Arc<std::sync::Mutex<npd_metrics::NpdProblems>>);

impl Collector for NpdCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let npd = self.0.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut e = encoder.encode_descriptor(
            "problem_counter",
            "Number of times a specific type of problem have occurred (node-problem-detector's metric).",
            None,
            prometheus_client::metrics::MetricType::Unknown,
        )?;
        for (reason, v) in npd.counters() {
            e.encode_family(&[("reason", reason)])?
                .encode_gauge(&(v as i64))?;
        }
        let mut e = encoder.encode_descriptor(
            "problem_gauge",
            "Whether a specific type of problem is affecting the node or not (node-problem-detector's metric).",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for (type_, reason, v) in npd.gauges() {
            e.encode_family(&[("reason", reason), ("type", type_)])?
                .encode_gauge(&v)?;
        }
        Ok(())
    }
}

#[derive(Debug)]
struct SourceCollector(Arc<std::sync::Mutex<BTreeMap<String, Arc<SourceCounters>>>>);

impl Collector for SourceCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let sources = self.0.lock().unwrap_or_else(|e| e.into_inner()).clone();
        for (name, help, pick) in [
            (
                "nodeguard_monitor_lines",
                "Log lines read, by monitor",
                (|c: &SourceCounters| c.lines.load(Ordering::Relaxed))
                    as fn(&SourceCounters) -> u64,
            ),
            (
                "nodeguard_monitor_lines_dropped",
                "Log lines dropped because the monitor's queue was full (floods) or the kernel overwrote them",
                |c: &SourceCounters| c.dropped.load(Ordering::Relaxed),
            ),
            (
                "nodeguard_monitor_lines_malformed",
                "Log records that could not be parsed",
                |c: &SourceCounters| c.malformed.load(Ordering::Relaxed),
            ),
            (
                "nodeguard_monitor_lines_truncated",
                "Log lines over 64 KiB (files) and journal entries over 256 KiB as JSON, matched on their first part; the rest is read past, not held",
                |c: &SourceCounters| c.truncated.load(Ordering::Relaxed),
            ),
        ] {
            let sample = ConstCounter::new(0u64);
            let mut e = encoder.encode_descriptor(name, help, None, sample.metric_type())?;
            for (monitor, c) in &sources {
                ConstCounter::new(pick(c))
                    .encode(e.encode_family(&[("monitor", monitor.as_str())])?)?;
            }
        }
        Ok(())
    }
}

/// Persisted per monitor: conditions, where the source stands, and the
/// boot both belong to.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MonitorState {
    /// The boot (`/proc/sys/kernel/random/boot_id`) the state was saved in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_id: Option<String>,
    #[serde(default)]
    pub conditions: BTreeMap<String, ConditionState>,
    #[serde(default)]
    pub cursor: Cursor,
    /// Each counting rule's matches in its window (see
    /// [`Engine::counts_state`]).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub counts: BTreeMap<String, Vec<(jiff::Timestamp, i64)>>,
    /// When it was saved, on the wall clock and on `CLOCK_MONOTONIC`
    /// (milliseconds): a restart on the same boot sees how far the wall
    /// clock stepped while the monitor was stopped, and moves the saved
    /// times by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub saved_at: Option<(jiff::Timestamp, u64)>,
}

/// Whether a saved state belongs to this boot. A state saved before boot
/// ids were recorded counts as this boot's unless it was last written
/// before this boot began.
pub fn same_boot(saved: &MonitorState, boot_id: &str, written_before_boot: bool) -> bool {
    match &saved.boot_id {
        Some(b) => b == boot_id,
        None => !written_before_boot,
    }
}

/// The path of a monitor's state file, always inside `dir/monitors`:
/// validation admits only DNS labels as names, and anything else is
/// flattened here too (a name is never a path: `../x` or `/etc/x` would
/// otherwise write outside the state directory as root).
pub fn state_path(dir: &Path, monitor: &str) -> PathBuf {
    let file: String = monitor
        .chars()
        .map(|c| match c {
            'a'..='z' | '0'..='9' | '-' => c,
            _ => '_',
        })
        .collect();
    dir.join("monitors").join(format!("{file}.json"))
}

/// The saved state, and whether its file was last written before this boot
/// began; `None` when the monitor has none.
fn load_state(dir: &Path, monitor: &str) -> Option<(MonitorState, bool)> {
    let p = state_path(dir, monitor);
    let text = std::fs::read_to_string(&p).ok()?;
    let state = serde_json::from_str(&text).unwrap_or_else(|e| {
        tracing::error!(path = %p.display(), error = %e, "monitor state unreadable; starting afresh");
        MonitorState::default()
    });
    let before_boot = match (
        std::fs::metadata(&p).and_then(|m| m.modified()),
        boot_time(),
    ) {
        (Ok(m), Some(b)) => m < b,
        _ => false,
    };
    Some((state, before_boot))
}

/// When this boot began (`btime` in /proc/stat).
fn boot_time() -> Option<SystemTime> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let secs: u64 = stat
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    Some(SystemTime::UNIX_EPOCH + Duration::from_secs(secs))
}

/// Saves a monitor's state (atomically, not synced: it is written up to
/// once a second under load, and a power loss costs at most that second).
/// True when written.
fn save_state(writes: &StateWrites, dir: &Path, monitor: &str, state: &MonitorState) -> bool {
    save_state_as(writes, dir, monitor, state, false)
}

/// [`save_state`], synced to disk when `durable`: whose taint is on the
/// Node must survive a power loss, or the next start takes nodeguard's
/// taint for someone else's and never removes it.
fn save_state_as(
    writes: &StateWrites,
    dir: &Path,
    monitor: &str,
    state: &MonitorState,
    durable: bool,
) -> bool {
    let bytes = serde_json::to_vec(state).expect("state serializes");
    writes.write(&state_path(dir, monitor), &bytes, durable)
}

/// What the monitors share: where they report, the Node's taints, where
/// they keep state, and this boot.
pub struct MonitorContext<T> {
    pub reporter: Reporter,
    pub taints: T,
    pub state_dir: PathBuf,
    /// Where a failing state write is said.
    pub state_writes: StateWrites,
    /// The system bus (`None`: the default socket), for systemd monitors.
    pub system_bus: Option<String>,
    pub metrics: MonitorMetrics,
    pub health: Health,
    /// This boot's id: a state saved in another boot resets what a reboot
    /// makes stale.
    pub boot_id: String,
    /// The node-local read roots (`--allow-read-path`), resolved once at
    /// start (`sources::resolve_roots`): an opened source whose real path
    /// (links resolved) is outside them is refused.
    pub read_roots: Vec<PathBuf>,
    /// The `journalctl` journald monitors run (`journalctl`: found on PATH).
    pub journalctl: PathBuf,
}

struct Running {
    spec: MonitorSpec,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    handle: Arc<LoopHandle>,
}

fn loop_name(monitor: &str) -> String {
    format!("monitor/{monitor}")
}

/// Keeps one task per monitor. A changed spec stops the monitor's task,
/// waits for it (it saves its state on the way out), removes what the new
/// spec no longer has (conditions, owned taints) and starts it again; a
/// removed monitor has its conditions and owned taints removed, its state
/// file deleted and its health entry dropped. A monitor that ends while the
/// agent runs (its source ended, it panicked) fails `/livez` as
/// `monitor/<name>`.
pub async fn run_monitors<T: TaintPort>(
    mut specs: watch::Receiver<Vec<MonitorSpec>>,
    ctx: MonitorContext<T>,
    stop: CancellationToken,
) {
    let ctx = Arc::new(ctx);
    let mut running: HashMap<String, Running> = HashMap::new();
    // The channel's first value stands for "policy not known yet"; the
    // first one sent is the policy (perhaps sent already).
    let mut known = specs.has_changed().unwrap_or(false);
    let mut swept = false;
    loop {
        let desired: HashMap<String, MonitorSpec> = specs
            .borrow_and_update()
            .iter()
            .map(|m| (m.name.clone(), m.clone()))
            .collect();
        if known && !swept {
            // An invalid policy selects nothing at start (no last good
            // version yet): its monitors would look removed. Wait until
            // every policy is valid. The same condition says an item was
            // refused by the node's trust or is over the node's limits:
            // lasting states that leave the selection as it is, so they
            // do not hold the sweep back.
            let invalid = ctx
                .reporter
                .desired()
                .get(crate::policy::POLICY_CONDITION)
                .and_then(|d| d.as_ref())
                .is_some_and(|d| {
                    d.status == crate::report::Status::True
                        && d.reason == crate::policy::POLICY_INVALID
                });
            if invalid {
                tracing::info!(
                    "a policy is invalid: state of monitors not in the selection is kept until every policy is valid"
                );
            } else {
                swept = true;
                sweep_orphans(&ctx, &desired).await;
            }
        }
        let changed: Vec<String> = running
            .iter()
            .filter(|(name, r)| desired.get(*name) != Some(&r.spec))
            .map(|(name, _)| name.clone())
            .collect();
        for r in changed.iter().filter_map(|n| running.get(n)) {
            r.stop.cancel();
        }
        for name in changed {
            let r = running.remove(&name).expect("listed above");
            // It saves its state on the way out: wait, so that neither the
            // new task nor the removal races with that write.
            let _ = r.task.await;
            let new = desired.get(&name);
            undo(&ctx, &r.spec, new).await;
            if new.is_none() {
                tracing::info!(monitor = %name, "monitor removed; its conditions and taints removed");
                if let Ok(h) = Arc::try_unwrap(r.handle) {
                    h.deregister();
                }
                ctx.metrics
                    .sources
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&name);
            } else {
                tracing::info!(monitor = %name, "monitor changed; restarting it");
            }
        }
        for (name, spec) in desired {
            if running.contains_key(&name) {
                continue;
            }
            let token = stop.child_token();
            // Registered and synced at once: a monitor is ready when it runs.
            let handle = Arc::new(ctx.health.register(loop_name(&name), MONITOR_TIMEOUT));
            handle.updated();
            let task = tokio::spawn(supervise(
                name.clone(),
                run_monitor(spec.clone(), ctx.clone(), handle.clone(), token.clone()),
                ctx.health.clone(),
                token.clone(),
            ));
            running.insert(
                name,
                Running {
                    spec,
                    stop: token,
                    task,
                    handle,
                },
            );
        }
        tokio::select! {
            _ = stop.cancelled() => break,
            r = specs.changed() => if r.is_err() { break },
        }
        known = true;
    }
    for r in running.values() {
        r.stop.cancel();
    }
    for r in running.into_values() {
        let _ = r.task.await;
    }
}

/// Runs one monitor; if it ends while its token is not cancelled (its source
/// ended, it panicked), says so and fails `/livez` naming it.
async fn supervise(
    name: String,
    monitor: impl Future<Output = Result<(), String>> + Send + 'static,
    health: Health,
    token: CancellationToken,
) {
    let outcome = tokio::spawn(monitor).await;
    if token.is_cancelled() {
        return;
    }
    let reason = crate::server::supervisor::stop_reason(outcome);
    tracing::error!(monitor = %name, %reason, "monitor stopped while the agent runs; /livez fails naming it until the agent restarts or the monitor is edited");
    health.fail(&loop_name(&name), reason);
}

/// Removes a taint nodeguard added for a condition the policy no longer
/// has (or no longer taints), saying so either way.
async fn remove_stale_taint<T: TaintPort>(
    ctx: &MonitorContext<T>,
    monitor: &str,
    t: &OwnedTaint,
) -> bool {
    match ctx.taints.remove(&t.key, &t.effect).await {
        Ok(()) => {
            tracing::info!(monitor, taint = %t.key, effect = %t.effect, "removed the taint nodeguard added for a condition the policy no longer taints (edited while the agent was not running)");
            true
        }
        Err(e) => {
            tracing::warn!(monitor, taint = %t.key, effect = %t.effect, error = %e, "cannot remove the taint nodeguard added for a condition the policy no longer taints; remove it with kubectl taint");
            false
        }
    }
}

/// The first time the policy is known: state files of monitors that are
/// no longer in it (removed while the agent was not running, or while it
/// was removing them). Their taints go, then the file.
async fn sweep_orphans<T: TaintPort>(
    ctx: &MonitorContext<T>,
    desired: &HashMap<String, MonitorSpec>,
) {
    let dir = ctx.state_dir.join("monitors");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return;
    };
    let wanted: std::collections::HashSet<PathBuf> = desired
        .keys()
        .map(|n| state_path(&ctx.state_dir, n))
        .collect();
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().and_then(|e| e.to_str()) != Some("json") || wanted.contains(&path) {
            continue;
        }
        let state: MonitorState = match std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
        {
            Some(s) => s,
            None => {
                tracing::warn!(path = %path.display(), "unreadable state of a monitor no longer in the policy; removed");
                ctx.state_writes.remove(&path);
                continue;
            }
        };
        let name = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("?")
            .to_string();
        tracing::info!(monitor = %name, "state of a monitor no longer in the policy: removing its taints and state");
        let mut failed = false;
        for s in state.conditions.values().filter(|s| s.taint_added) {
            match &s.taint {
                Some(t) => failed |= !remove_stale_taint(ctx, &name, t).await,
                None => {
                    tracing::warn!(monitor = %name, "a taint this monitor added is not recorded in its state (saved by an older nodeguard); remove it with kubectl taint if it is still there")
                }
            }
        }
        // Kept when a removal failed: the next start tries again.
        if !failed {
            ctx.state_writes.remove(&path);
        }
    }
}

/// After `old`'s task has finished: removes what `new` (`None`: the monitor
/// is gone) no longer has, per the state the task left.
async fn undo<T: TaintPort>(ctx: &MonitorContext<T>, old: &MonitorSpec, new: Option<&MonitorSpec>) {
    let mut state = load_state(&ctx.state_dir, &old.name)
        .map(|(s, _)| s)
        .unwrap_or_default();
    let plan = engine::cleanup(old, new, &state.conditions);
    let mut kept = false;
    for (type_, key, effect) in &plan.taints {
        match ctx.taints.remove(key, effect).await {
            Ok(()) => {
                if let Some(s) = state.conditions.get_mut(type_) {
                    s.taint_added = false;
                    s.taint = None;
                }
            }
            Err(e) => {
                kept = true;
                if let Some(s) = state.conditions.get_mut(type_) {
                    s.taint = Some(OwnedTaint {
                        key: key.clone(),
                        effect: effect.clone(),
                    });
                }
                tracing::warn!(monitor = %old.name, taint = %key, error = %e, "cannot remove the monitor's taint; the next start of the agent tries again")
            }
        }
    }
    if new.is_none() {
        // After its taints: an agent killed in between finds the file and
        // removes them on its next start. Kept (with what is still
        // owned) when a removal failed, for the same reason.
        let path = state_path(&ctx.state_dir, &old.name);
        if kept {
            state.conditions.retain(|_, s| s.taint_added);
            save_state(&ctx.state_writes, &ctx.state_dir, &old.name, &state);
        } else {
            ctx.state_writes.remove(&path);
        }
    }
    for type_ in &plan.conditions {
        ctx.reporter.remove(type_);
        ctx.metrics.forget(type_);
        state.conditions.remove(type_);
    }
    if new.is_some() {
        if plan.reset_cursor {
            state.cursor = Cursor::default();
        }
        save_state(&ctx.state_writes, &ctx.state_dir, &old.name, &state);
    }
}

/// A monitor's wall clock. The engine keeps wall times (they are saved and
/// read back after a restart); when the system clock steps (NTP, `date -s`),
/// the engine's times move by the step, so a counting window or a quiet
/// period measures the time that passed, not the jump.
struct EngineClock {
    clock: WallClock,
    /// The step the engine's times already follow.
    followed: jiff::SignedDuration,
    /// The engine's times moved since the last save.
    shifted: bool,
    monitor: String,
}

/// Steps smaller than this are left alone (a window off by less than a
/// second does not matter; the readings differ by microseconds).
const FOLLOWED_STEP: jiff::SignedDuration = jiff::SignedDuration::from_secs(1);

impl EngineClock {
    fn new(monitor: &str) -> Self {
        EngineClock {
            clock: WallClock::new(),
            followed: jiff::SignedDuration::ZERO,
            shifted: false,
            monitor: monitor.to_string(),
        }
    }

    /// Wall time now, after moving the engine's times by any new step.
    fn now(&mut self, engine: &mut Engine) -> jiff::Timestamp {
        let step = self.clock.step();
        let by = step - self.followed;
        if by.abs() >= FOLLOWED_STEP {
            tracing::info!(monitor = %self.monitor, step_seconds = by.as_secs_f64(), "the wall clock stepped; counting windows and quiet periods go on by elapsed time");
            engine.shift(by);
            self.followed = step;
            self.shifted = true;
        }
        self.clock.now()
    }

    /// Whether the engine's times moved since this was last asked: the
    /// state on disk must follow (a crash would read the old times back).
    fn take_shifted(&mut self) -> bool {
        std::mem::take(&mut self.shifted)
    }
}

/// Runs until `stop`; `Err` says why it ended otherwise.
async fn run_monitor<T: TaintPort>(
    spec: MonitorSpec,
    ctx: Arc<MonitorContext<T>>,
    handle: Arc<LoopHandle>,
    stop: CancellationToken,
) -> Result<(), String> {
    let mut clock = EngineClock::new(&spec.name);
    let mut engine = match Engine::new(&spec, &format!("monitor {}", spec.name)) {
        Ok(e) => e,
        Err(bad) => {
            // The policy validation rejects these; never crash on them.
            tracing::error!(monitor = %spec.name, problems = ?bad, "monitor rules do not compile; monitor not started");
            stop.cancelled().await;
            return Ok(());
        }
    };
    let saved = load_state(&ctx.state_dir, &spec.name);
    let new_boot = saved
        .as_ref()
        .is_some_and(|(s, before)| !same_boot(s, &ctx.boot_id, *before));
    let resume = Resume::plan(saved.as_ref().map(|(s, _)| &s.cursor), !new_boot);
    let mut state = saved.map(|(s, _)| s).unwrap_or_default();
    if new_boot {
        tracing::info!(monitor = %spec.name, "state from an earlier boot: kernel log read from this boot's start, conditions that reset at boot reset");
        // Nothing of the old boot's kernel log is left to resume after.
        state.cursor.kmsg_sequence = None;
    }
    state.boot_id = Some(ctx.boot_id.clone());
    for t in engine.restore(std::mem::take(&mut state.conditions)) {
        // The policy was edited while the agent was not running (or while
        // it was applying the edit): the old spec is gone, the state says
        // which taint nodeguard added.
        remove_stale_taint(&ctx, &spec.name, &t).await;
    }
    engine.restore_counts(std::mem::take(&mut state.counts));
    let now = clock.now(&mut engine);
    if !new_boot && let Some((wall, monotonic_ms)) = state.saved_at {
        // Wall time passed since the save, less the time that really passed.
        let really = clock
            .clock
            .monotonic()
            .saturating_sub(Duration::from_millis(monotonic_ms));
        let stepped =
            now.duration_since(wall) - jiff::SignedDuration::try_from(really).unwrap_or_default();
        if stepped.abs() >= FOLLOWED_STEP {
            tracing::info!(monitor = %spec.name, step_seconds = stepped.as_secs_f64(), "the wall clock stepped while the monitor was stopped; its saved times move with it");
            engine.shift(stepped);
        }
    }
    engine.clamp_to(now);
    ctx.metrics.declare(&spec, &engine);
    let counters = Arc::new(SourceCounters::default());
    ctx.metrics
        .sources
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(spec.name.clone(), counters.clone());
    let (tx, mut rx) = mpsc::channel(QUEUE);
    let source_stop = StopFlag::default();
    // At most one line source (validation rejects more); `started` names it with its result.
    let started = if let Some(k) = &spec.source.kmsg {
        let r = sources::spawn_kmsg(
            PathBuf::from(&k.path),
            &ctx.read_roots,
            resume.kmsg,
            tx,
            counters.clone(),
            source_stop.clone(),
        );
        Some((k.path.clone(), r))
    } else if let Some(f) = &spec.source.file {
        let r = sources::spawn_file(
            PathBuf::from(&f.path),
            ctx.read_roots.clone(),
            resume.file,
            tx,
            counters.clone(),
            source_stop.clone(),
        );
        Some((f.path.clone(), r))
    } else if let Some(j) = &spec.source.journald {
        let r = sources::spawn_journald(
            j.clone(),
            &ctx.journalctl,
            &ctx.read_roots,
            resume.journal.clone(),
            tx,
            counters.clone(),
            source_stop.clone(),
        );
        Some(("journalctl".to_string(), r))
    } else {
        drop(tx);
        None
    };
    // Whether lines come: a line source runs. Its queue closing means it ended.
    let lines_open = matches!(started, Some((_, Ok(_))));
    // Where it starts is saved at once: a restart before the first line
    // resumes there instead of at the (then later) end.
    if let Some((_, Ok(start))) = &started {
        state.cursor = start.clone();
    }
    let (plugin_tx, mut plugin_rx) = mpsc::channel::<(usize, PluginStatus, String)>(64);
    // Plugin and systemd checkers: one ending while the monitor runs is the
    // monitor's failure too.
    let mut checkers = JoinSet::new();
    if let Some(p) = &spec.source.plugin {
        checkers.spawn(run_plugins(
            spec.clone(),
            p.clone(),
            plugin_tx.clone(),
            counters.clone(),
            stop.clone(),
        ));
    }
    if let Some(s) = &spec.source.systemd {
        checkers.spawn(run_service_checks(
            spec.clone(),
            s.clone(),
            plugin_tx,
            ctx.system_bus.clone(),
            ctx.reporter.clone(),
            counters.clone(),
            stop.clone(),
        ));
    }
    // Set while the line source could not be opened: its conditions are
    // Unknown (blind is not "all clear"), with this message.
    let mut blind: Option<String> = None;
    if let Some((path, Err(source))) = started {
        let e = MonitorError::Source { path, source };
        tracing::error!(monitor = %spec.name, error = %e, "monitor source unavailable");
        blind = Some(format!(
            "Monitor {} cannot read its source: {e}; the condition is unknown until it can.",
            spec.name
        ));
        ctx.reporter.event(
            EventKind::Warning,
            "MonitorSourceUnavailable",
            "StartMonitor",
            format!("Monitor {} cannot read its source: {e}. Mount it into the pod (chart values host.kmsg / host.journal) or fix the path.", spec.name),
        );
    }
    let voice = Voice {
        defaults: spec
            .conditions
            .iter()
            .map(|c| (c.type_.clone(), c.reason.clone()))
            .collect(),
        source: spec.event_source.clone(),
    };
    let wall = clock.clock;
    let save_as = |state: &mut MonitorState, engine: &Engine, durable: bool| {
        state.conditions = engine.state().clone();
        state.counts = engine.counts_state();
        state.saved_at = Some((wall.now(), wall.monotonic().as_millis() as u64));
        save_state_as(
            &ctx.state_writes,
            &ctx.state_dir,
            &spec.name,
            state,
            durable,
        )
    };
    let save = |state: &mut MonitorState, engine: &Engine| save_as(state, engine, false);
    handle.queued();
    if new_boot {
        let reset = {
            let now = clock.now(&mut engine);
            engine.on_new_boot(now)
        };
        apply(&reset, &mut engine, &ctx, &handle, &voice, blind.as_deref()).await;
    }
    let initial = {
        let now = clock.now(&mut engine);
        engine.current(now)
    };
    apply(
        &initial,
        &mut engine,
        &ctx,
        &handle,
        &voice,
        blind.as_deref(),
    )
    .await;
    // A save that fails leaves the state dirty: the tick tries again each
    // second, so what changed while the directory was full or read-only is
    // written once it can be, with no new line to prompt it.
    let mut dirty = !save(&mut state, &engine);
    handle.updated();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut last_save = tokio::time::Instant::now();
    let mut last_taint_retry = tokio::time::Instant::now();
    // What the reader last said about a refused file (after the start).
    let mut refused_seen: Option<String> = None;
    // Lines lost so far (a full queue, records the kernel overwrote), said
    // in an Event when it grows.
    // (The counters are this run's: what was lost before the first tick,
    // records overwritten while the agent was down among them, is said too.)
    let mut dropped_seen = 0;
    let ended = loop {
        tokio::select! {
            _ = stop.cancelled() => break None,
            batch = rx.recv(), if lines_open => {
                let Some(batch) = batch else {
                    let why = counters
                        .end_reason()
                        .unwrap_or_else(|| "its reader stopped".to_string());
                    break Some(format!("its log source ended: {why}"));
                };
                handle.queued();
                // One clock reading per batch (its lines arrived together),
                // read again after anything that waited on the API.
                let mut now = clock.now(&mut engine);
                for i in 0..batch.len() {
                    let actions = engine.on_line(batch.line(i), now);
                    dirty = true;
                    if !actions.is_empty() {
                        apply(&actions, &mut engine, &ctx, &handle, &voice, blind.as_deref()).await;
                        // Whose taint it is goes to disk at once: a restart
                        // that replayed the line would find the taint there
                        // and take it for someone else's. The rest (Events,
                        // condition changes the replay recomputes) waits for
                        // the once-a-second save: a rule matching every line
                        // of a flood is not an fsync per line.
                        if actions.iter().any(|a| matches!(a, Action::Taint { .. })) {
                            state.cursor = batch.cursor(i).clone();
                            dirty = !save_as(&mut state, &engine, true);
                            last_save = tokio::time::Instant::now();
                        }
                        now = clock.now(&mut engine);
                    }
                }
                if let Some(cursor) = batch.into_last_cursor() {
                    state.cursor = cursor;
                }
                handle.updated();
            }
            Some((rule, status, output)) = plugin_rx.recv() => {
                handle.queued();
                let actions = { let now = clock.now(&mut engine); engine.on_plugin(rule, status, &output, now) };
                if !actions.is_empty() {
                    apply(&actions, &mut engine, &ctx, &handle, &voice, blind.as_deref()).await;
                    let taint = actions.iter().any(|a| matches!(a, Action::Taint { .. }));
                    dirty = !save_as(&mut state, &engine, taint);
                }
                handle.updated();
            }
            Some(done) = checkers.join_next(), if !checkers.is_empty() => {
                if stop.is_cancelled() {
                    break None;
                }
                break Some(match done {
                    Err(e) if e.is_panic() => "its checker panicked".to_string(),
                    _ => "its checker ended".to_string(),
                });
            }
            _ = tick.tick() => {
                let dropped_now = counters.dropped.load(std::sync::atomic::Ordering::Relaxed);
                if dropped_now > dropped_seen {
                    let message = format!(
                        "Monitor {} lost {} line(s) ({dropped_now} since it started): its queue was full or the kernel overwrote records before they were read, so problems in them were not seen.",
                        spec.name,
                        dropped_now - dropped_seen
                    );
                    tracing::warn!(monitor = %spec.name, lost = dropped_now - dropped_seen, "monitor lines lost");
                    ctx.reporter.event(EventKind::Warning, "MonitorLinesDropped", "ReadSource", message);
                    dropped_seen = dropped_now;
                }
                let refused_now = counters.refused_reason();
                if refused_now != refused_seen {
                    // The file now at the path is refused by the node's read
                    // roots, or allowed again: blind (Unknown) or not.
                    handle.queued();
                    blind = match &refused_now {
                        Some(why) => {
                            tracing::error!(monitor = %spec.name, error = %why, "monitor source refused");
                            ctx.reporter.event(
                                EventKind::Warning,
                                "MonitorSourceUnavailable",
                                "ReadSource",
                                format!("Monitor {} cannot read its source: {why}.", spec.name),
                            );
                            Some(format!(
                                "Monitor {} cannot read its source: {why}; the condition is unknown until it can.",
                                spec.name
                            ))
                        }
                        None => {
                            tracing::info!(monitor = %spec.name, "monitor source readable again");
                            None
                        }
                    };
                    refused_seen = refused_now;
                    let current = { let now = clock.now(&mut engine); engine.current(now) };
                    apply(&current, &mut engine, &ctx, &handle, &voice, blind.as_deref()).await;
                    handle.updated();
                }
                let mut actions = { let now = clock.now(&mut engine); engine.on_tick(now) };
                if clock.take_shifted() {
                    dirty = true;
                }
                if last_taint_retry.elapsed() >= TAINT_RETRY {
                    last_taint_retry = tokio::time::Instant::now();
                    actions.extend(engine.taint_retries());
                }
                if !actions.is_empty() {
                    handle.queued();
                    apply(&actions, &mut engine, &ctx, &handle, &voice, blind.as_deref()).await;
                    handle.updated();
                    dirty = true;
                    // A taint added (a retry after an API outage): whose it
                    // is goes to disk at once, synced.
                    if actions.iter().any(|a| matches!(a, Action::Taint { .. })) {
                        dirty = !save_as(&mut state, &engine, true);
                        last_save = tokio::time::Instant::now();
                    }
                }
                // The cursor is saved at most once a second under load.
                if dirty && last_save.elapsed() >= Duration::from_secs(1) {
                    dirty = !save(&mut state, &engine);
                    last_save = tokio::time::Instant::now();
                }
            }
        }
    };
    source_stop.stop();
    save(&mut state, &engine);
    match ended {
        None => Ok(()),
        Some(why) => Err(why),
    }
}

/// What one look at a unit found.
struct UnitHealth {
    healthy: bool,
    message: String,
    /// Realtime microseconds of the unit's last start (0: never started).
    started_usec: u64,
    /// The same start on the monotonic clock (0: never started or not
    /// said): the repair cooldown is measured by it, so a wall-clock step
    /// neither repairs a unit that just started nor holds back one that
    /// has been failing for long.
    started_monotonic_usec: u64,
}

async fn unit_health(
    conn: &zbus::Connection,
    src: &crate::policy::monitors::SystemdUnitSource,
    probers: Option<&crate::probe::prober::Probers>,
) -> Result<UnitHealth, zbus::Error> {
    use zbus::proxy::CacheProperties;
    let manager = zbus_systemd::systemd1::ManagerProxy::new(conn).await?;
    let path = match manager.get_unit(src.unit.clone()).await {
        Ok(p) => p,
        Err(zbus::Error::MethodError(name, msg, _))
            if name.as_str() == "org.freedesktop.systemd1.NoSuchUnit" =>
        {
            return Ok(UnitHealth {
                healthy: false,
                message: format!(
                    "{} is not loaded{}",
                    src.unit,
                    msg.map(|m| format!(" ({m})")).unwrap_or_default()
                ),
                started_usec: 0,
                started_monotonic_usec: 0,
            });
        }
        Err(e) => return Err(e),
    };
    let unit = zbus_systemd::systemd1::UnitProxy::builder(conn)
        .path(path.clone())
        .cache_properties(CacheProperties::No)
        .build()
        .await?;
    let active = unit.active_state().await?;
    let sub = unit.sub_state().await.unwrap_or_default();
    let started_usec = unit.inactive_exit_timestamp().await.unwrap_or(0);
    let started_monotonic_usec = unit.inactive_exit_timestamp_monotonic().await.unwrap_or(0);
    let restarts = match zbus_systemd::systemd1::ServiceProxy::builder(conn)
        .path(path)
        .cache_properties(CacheProperties::No)
        .build()
        .await
    {
        Ok(s) => s.n_restarts().await.ok(),
        Err(_) => None,
    };
    let since = jiff::Timestamp::from_microsecond(started_usec as i64)
        .ok()
        .filter(|_| started_usec > 0)
        .map(|t| format!(", last started {}", t.strftime("%Y-%m-%dT%H:%M:%SZ")))
        .unwrap_or_default();
    let restarts = restarts
        .map(|n| format!(", restarted {n} time(s)"))
        .unwrap_or_default();
    let mut healthy = active == "active";
    let mut message = format!("{} is {active} ({sub}){restarts}{since}", src.unit);
    if healthy && let (Some(url), Some(p)) = (&src.health_url, probers) {
        let action = crate::probe::prober::Action::Http {
            url: url.clone(),
            headers: Vec::new(),
            status: (200, 299),
            body_contains: None,
            insecure: true,
        };
        match p.run(&action, Duration::from_secs(5)).await {
            Ok(o) if o.result == crate::probe::core::ProbeResult::Success => {}
            Ok(o) => {
                healthy = false;
                message = format!("{message}, but {url} answers: {}", o.detail);
            }
            Err(e) => message = format!("{message} ({url} not checked: {e})"),
        }
    }
    Ok(UnitHealth {
        healthy,
        message: format!("{message}."),
        started_usec,
        started_monotonic_usec,
    })
}

/// Checks a systemd unit on the monitor's interval, reports each verdict to
/// the monitor's rules and, when asked, repairs it once it has been up for
/// the cooldown (never in a loop: a restart resets the clock).
#[allow(clippy::too_many_arguments)]
async fn run_service_checks(
    spec: MonitorSpec,
    src: crate::policy::monitors::SystemdUnitSource,
    tx: mpsc::Sender<(usize, PluginStatus, String)>,
    system_bus: Option<String>,
    reporter: Reporter,
    counters: Arc<SourceCounters>,
    stop: CancellationToken,
) {
    let probers = src
        .health_url
        .as_ref()
        .map(|_| crate::probe::prober::Probers::new());
    let mut conn: Option<zbus::Connection> = None;
    let mut last_repair: Option<tokio::time::Instant> = None;
    let mut interval =
        tokio::time::interval(Duration::from_secs(src.interval_seconds.max(1).into()));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = interval.tick() => {}
        }
        counters.lines.fetch_add(1, Ordering::Relaxed);
        if conn.is_none() {
            let c = match &system_bus {
                Some(a) => zbus::connection::Builder::address(a.as_str()).build().await,
                None => zbus::Connection::system().await,
            };
            match c {
                Ok(c) => conn = Some(c),
                Err(e) => {
                    tracing::warn!(unit = %src.unit, error = %e, "cannot reach systemd on the system bus");
                    continue;
                }
            }
        }
        let c = conn.as_ref().expect("connected above");
        let health = match unit_health(c, &src, probers.as_ref()).await {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(unit = %src.unit, error = %e, "cannot read the unit's state; reconnecting");
                conn = None;
                continue;
            }
        };
        let status = if health.healthy {
            PluginStatus::Ok
        } else {
            PluginStatus::Problem
        };
        for i in 0..spec.rules.len() {
            let _ = tx.send((i, status, health.message.clone())).await;
        }
        let Some(repair) = &src.repair else { continue };
        if health.healthy || health.started_usec == 0 {
            continue;
        }
        let cooldown = Duration::from_secs(repair.cooldown_seconds.into());
        let up = if health.started_monotonic_usec > 0 {
            crate::clock::system_monotonic()
                .saturating_sub(Duration::from_micros(health.started_monotonic_usec))
        } else {
            let now_usec = jiff::Timestamp::now().as_microsecond().max(0) as u64;
            Duration::from_micros(now_usec.saturating_sub(health.started_usec))
        };
        let recent = last_repair.is_some_and(|t| t.elapsed() < cooldown);
        if up < cooldown || recent {
            tracing::info!(unit = %src.unit, up = ?up, cooldown = ?cooldown, "unit unhealthy; within its repair cooldown");
            continue;
        }
        let manager = match zbus_systemd::systemd1::ManagerProxy::new(c).await {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "cannot reach systemd to repair");
                continue;
            }
        };
        match manager
            .kill_unit(src.unit.clone(), "main".into(), repair.signal.number())
            .await
        {
            Ok(()) => {
                last_repair = Some(tokio::time::Instant::now());
                let note = format!(
                    "nodeguard repaired {}: it was unhealthy ({}) after {}s up, so its main process was sent {} for systemd to restart it; no further repair for {}s.",
                    src.unit,
                    health.message.trim_end_matches('.'),
                    up.as_secs(),
                    repair.signal.name(),
                    cooldown.as_secs()
                );
                tracing::warn!("{note}");
                reporter.event(EventKind::Warning, "ServiceRepaired", "RepairService", note);
            }
            Err(e) => tracing::error!(unit = %src.unit, error = %e, "repair (KillUnit) failed"),
        }
    }
}

/// Runs the plugin rules' commands on the monitor's interval, at most
/// `concurrency` at once, and reports each verdict.
async fn run_plugins(
    spec: MonitorSpec,
    source: crate::policy::monitors::PluginSource,
    tx: mpsc::Sender<(usize, PluginStatus, String)>,
    counters: Arc<SourceCounters>,
    stop: CancellationToken,
) {
    let limit = Arc::new(tokio::sync::Semaphore::new(
        source.concurrency.max(1) as usize
    ));
    let timeout = Duration::from_secs(source.timeout_seconds.max(1).into());
    let max_output = source.max_output_length.max(1) as usize;
    let mut interval =
        tokio::time::interval(Duration::from_secs(source.interval_seconds.max(1).into()));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = interval.tick() => {}
        }
        for (i, rule) in spec.rules.iter().enumerate() {
            if rule.command.is_empty() {
                continue;
            }
            let permit = limit.clone().acquire_owned().await.expect("never closed");
            let (tx, command, counters) = (tx.clone(), rule.command.clone(), counters.clone());
            tokio::spawn(async move {
                let _permit = permit;
                counters.lines.fetch_add(1, Ordering::Relaxed);
                let (status, output) = match crate::probe::prober::run_command(&command, timeout)
                    .await
                {
                    Ok(crate::probe::prober::Ran::Exited(Some(0), out)) => (PluginStatus::Ok, out),
                    Ok(crate::probe::prober::Ran::Exited(Some(1), out)) => {
                        (PluginStatus::Problem, out)
                    }
                    Ok(crate::probe::prober::Ran::Exited(_, out)) => (PluginStatus::Unknown, out),
                    Ok(crate::probe::prober::Ran::TimedOut) => (
                        PluginStatus::Unknown,
                        format!("timed out after {}s", timeout.as_secs()),
                    ),
                    Err(e) => {
                        counters.malformed.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(command = ?command, error = %e, "plugin did not run");
                        (PluginStatus::Unknown, e.to_string())
                    }
                };
                let output: String = output.chars().take(max_output).collect();
                let _ = tx.send((i, status, output)).await;
            });
        }
    }
}

/// How a monitor speaks: its conditions' no-problem reasons (an Event of
/// one is a clear, not a problem) and the source component of its Events.
struct Voice {
    defaults: BTreeMap<String, String>,
    /// `eventSource` (NPD's `source` of an imported config); `None`: the
    /// agent's own.
    source: Option<String>,
}

/// `blind`: the monitor cannot read its source (why); a condition that
/// would be written False (no problem seen) is written Unknown with reason
/// `MonitorSourceUnavailable` and this message instead.
async fn apply<T: TaintPort>(
    actions: &[Action],
    engine: &mut Engine,
    ctx: &MonitorContext<T>,
    handle: &LoopHandle,
    voice: &Voice,
    blind: Option<&str>,
) {
    for a in actions {
        match a {
            Action::Event { reason, message } => {
                let clearing = voice.defaults.values().any(|d| d == reason);
                if !clearing {
                    ctx.metrics.problem(reason);
                }
                let kind = if clearing {
                    EventKind::Normal
                } else {
                    EventKind::Warning
                };
                ctx.reporter.event_from(
                    voice.source.as_deref(),
                    kind,
                    reason,
                    "DetectProblem",
                    message.clone(),
                );
            }
            Action::Condition {
                type_,
                active,
                reason,
                message,
            } => {
                ctx.metrics.set_active(type_, reason, *active);
                let desired = match (active, blind) {
                    (true, _) => Desired {
                        status: Status::True,
                        reason: reason.clone(),
                        message: message.clone(),
                    },
                    (false, Some(why)) => Desired {
                        status: Status::Unknown,
                        reason: "MonitorSourceUnavailable".into(),
                        message: why.to_string(),
                    },
                    (false, None) => Desired {
                        status: Status::False,
                        reason: reason.clone(),
                        message: message.clone(),
                    },
                };
                ctx.reporter.set(type_, desired);
            }
            Action::Taint {
                condition,
                key,
                value,
                effect,
                add,
            } => {
                // 0.2 s doubling: the fifth wait is 3.2 s.
                let mut backoff =
                    Backoff::new(Duration::from_millis(200), Duration::from_millis(3200));
                let mut outcome = TaintOutcome::Failed;
                let mut maybe_applied = false;
                for attempt in 1..=5 {
                    let r = if *add {
                        ctx.taints.add(key, value, effect).await.map(|added| {
                            if added {
                                TaintOutcome::Added
                            } else {
                                TaintOutcome::AlreadyPresent
                            }
                        })
                    } else {
                        ctx.taints
                            .remove(key, effect)
                            .await
                            .map(|()| TaintOutcome::Removed)
                    };
                    match r {
                        // An earlier attempt may have been applied with its
                        // answer lost: the taint found now is nodeguard's.
                        Ok(TaintOutcome::AlreadyPresent) if maybe_applied => {
                            outcome = TaintOutcome::Added;
                            break;
                        }
                        Ok(o) => {
                            outcome = o;
                            break;
                        }
                        Err(e) => {
                            maybe_applied |= *add && e.maybe_applied();
                            tracing::warn!(taint = %key, add, attempt, error = %e, "taint update failed");
                            // Waiting on the API is not being stuck.
                            handle.updated();
                            tokio::time::sleep(backoff.next_delay()).await;
                            handle.queued();
                        }
                    }
                }
                if outcome == TaintOutcome::Failed && maybe_applied {
                    engine.taint_maybe_added(condition);
                }
                engine.taint_result(condition, outcome);
                let owned = engine.state().get(condition).is_some_and(|s| s.taint_added);
                if *add && outcome == TaintOutcome::AlreadyPresent && !owned {
                    tracing::info!(taint = %key, condition = %condition, "the taint was there already; nodeguard will not remove it");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicU32};

    /// A Node's taint through an API that fails its first `fails` calls.
    #[derive(Default)]
    struct Flaky {
        fails: AtomicU32,
        calls: AtomicU32,
        present: std::sync::Mutex<bool>,
        /// A failing add is applied before its error (the answer lost).
        applied_before_failing: AtomicBool,
        /// Failures say nothing was written (a failed read, conflicts).
        definite: AtomicBool,
    }

    impl Flaky {
        fn call(&self) -> Result<(), MonitorError> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            let left = self.fails.load(Ordering::SeqCst);
            if left > 0 {
                self.fails.store(left - 1, Ordering::SeqCst);
                if self.definite.load(Ordering::SeqCst) {
                    return Err(crate::k8s::taints::TaintError::Conflict("n1".into()).into());
                }
                return Err(MonitorError::Taint("the API server is down".into()));
            }
            Ok(())
        }
    }

    impl TaintPort for Arc<Flaky> {
        async fn add(&self, _key: &str, _value: &str, _effect: &str) -> Result<bool, MonitorError> {
            if let Err(e) = self.call() {
                if self.applied_before_failing.load(Ordering::SeqCst) {
                    *self.present.lock().unwrap() = true;
                }
                return Err(e);
            }
            let mut p = self.present.lock().unwrap();
            let added = !*p;
            *p = true;
            Ok(added)
        }

        async fn remove(&self, _key: &str, _effect: &str) -> Result<(), MonitorError> {
            self.call()?;
            *self.present.lock().unwrap() = false;
            Ok(())
        }
    }

    /// A taint add that fails all its attempts (an API outage longer than
    /// its backoff) is tried again while the monitor runs, not only at the
    /// next agent restart: the condition is True, so the taint gets there.
    #[tokio::test(start_paused = true)]
    async fn a_taint_update_that_failed_is_retried_until_it_succeeds() {
        taint_retry_case(false).await;
    }

    /// The same with every failing add applied before its error (a PATCH
    /// whose answer was lost): the retry finds the taint there, and it is
    /// nodeguard's all the same, so the clear removes it.
    #[tokio::test(start_paused = true)]
    async fn a_taint_whose_answer_was_lost_is_owned() {
        taint_retry_case(true).await;
    }

    async fn taint_retry_case(applied_before_failing: bool) {
        let dir = scratch(&format!("taint-retry-{applied_before_failing}"));
        // More failures than one update's attempts.
        let port = Arc::new(Flaky::default());
        port.fails.store(7, Ordering::SeqCst);
        port.applied_before_failing
            .store(applied_before_failing, Ordering::SeqCst);
        // True since before this start; its taint is not on the Node yet.
        let (spec, ctx, handle) = clearable(&dir, port.clone());
        let stop = CancellationToken::new();
        let task = tokio::spawn(run_monitor(spec, ctx, handle, stop.clone()));
        // Until the port has answered a call (the failures are used up) and
        // the taint is there.
        let tainted = tokio::time::timeout(Duration::from_secs(600), async {
            while !(*port.present.lock().unwrap() && port.calls.load(Ordering::SeqCst) > 7) {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            // The state is saved at most once a second.
            tokio::time::sleep(Duration::from_secs(2)).await;
        })
        .await;
        stop.cancel();
        let _ = task.await;
        let state = load_state(&dir, "m").map(|(s, _)| s);
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            tainted.is_ok(),
            "the taint was never added after {} failed calls",
            port.calls.load(Ordering::SeqCst)
        );
        assert!(
            port.calls.load(Ordering::SeqCst) > 5,
            "a retry after the first 5 attempts"
        );
        assert!(
            state.is_some_and(|s| s.conditions["AppBroken"].taint_added),
            "the added taint is owned and saved"
        );
    }

    /// A monitor with a taint and a clear pattern on `dir`/app.log, its
    /// condition True since before this start (its taint not recorded as
    /// added), through `port`.
    fn clearable(
        dir: &Path,
        port: Arc<Flaky>,
    ) -> (
        MonitorSpec,
        Arc<MonitorContext<Arc<Flaky>>>,
        Arc<LoopHandle>,
    ) {
        let log = dir.join("app.log");
        std::fs::write(&log, "").unwrap();
        let spec: MonitorSpec = serde_json::from_value(serde_json::json!({
            "name": "m", "source": {"file": {"path": log.display().to_string()}},
            "conditions": [{"type": "AppBroken", "reason": "AppIsFine", "message": "app is fine",
                            "clearPattern": "recovered",
                            "taint": {"key": "example.com/app-broken", "effect": "NoSchedule"}}],
            "rules": [{"type": "permanent", "condition": "AppBroken", "reason": "AppCrashed", "pattern": "crashed"}],
        }))
        .unwrap();
        let saved: MonitorState = serde_json::from_value(serde_json::json!({
            "bootId": "this-boot",
            "conditions": {"AppBroken": {"active": true, "reason": "AppCrashed", "message": "crashed",
                                         "since": "2026-01-01T00:00:00Z", "lastMatch": null, "taintAdded": false}},
        }))
        .unwrap();
        let (reporter, _events) = Reporter::new(&Default::default(), &mut Registry::default());
        let state_writes = StateWrites::new(reporter.clone());
        save_state(&state_writes, dir, "m", &saved);
        let health = Health::new();
        let handle = Arc::new(health.register(loop_name("m"), MONITOR_TIMEOUT));
        let ctx = Arc::new(MonitorContext {
            reporter,
            taints: port,
            state_dir: dir.to_path_buf(),
            state_writes,
            system_bus: None,
            metrics: MonitorMetrics::default(),
            health,
            boot_id: "this-boot".into(),
            read_roots: vec![PathBuf::from("/")],
            journalctl: "journalctl".into(),
        });
        (spec, ctx, handle)
    }

    /// Appends the clear pattern's line to the [`clearable`] monitor's log
    /// and waits until the condition is clear.
    async fn recover(dir: &Path, reporter: &Reporter) {
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(dir.join("app.log"))
            .unwrap();
        std::io::Write::write_all(&mut f, b"app recovered\n").unwrap();
        // The reader is a real thread: let it hand the line over before
        // paused time moves on.
        std::thread::sleep(Duration::from_millis(500));
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            reporter
                .desired()
                .get("AppBroken")
                .cloned()
                .flatten()
                .map(|d| d.status),
            Some(crate::report::Status::False),
            "the clear was read"
        );
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ng-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// Review finding: someone else's taint with the same key, and a taint
    /// add that failed without writing anything (a failed read, conflicts
    /// to the end): the retry found the taint and took it for nodeguard's,
    /// so the clear removed the other party's taint.
    #[tokio::test(start_paused = true)]
    async fn a_failure_that_wrote_nothing_leaves_someone_elses_taint_alone() {
        let dir = scratch("taint-theirs");
        let port = Arc::new(Flaky::default());
        *port.present.lock().unwrap() = true;
        port.fails.store(1, Ordering::SeqCst);
        port.definite.store(true, Ordering::SeqCst);
        let (spec, ctx, handle) = clearable(&dir, port.clone());
        let stop = CancellationToken::new();
        let reporter = ctx.reporter.clone();
        let task = tokio::spawn(run_monitor(spec, ctx, handle, stop.clone()));
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(
            port.calls.load(Ordering::SeqCst) >= 2,
            "failed, then found it there"
        );
        recover(&dir, &reporter).await;
        tokio::time::sleep(Duration::from_secs(30)).await;
        stop.cancel();
        let _ = task.await;
        let _ = std::fs::remove_dir_all(&dir);
        assert!(*port.present.lock().unwrap(), "someone else's taint stays");
    }

    /// Review finding: an add applied with its answer lost, the API server
    /// away for all five attempts, and the condition clearing before a
    /// retry worked: nothing removed the taint. It is removed once the API
    /// server answers.
    #[tokio::test(start_paused = true)]
    async fn a_taint_that_may_have_landed_goes_when_the_condition_clears_first() {
        let dir = scratch("taint-maybe");
        let port = Arc::new(Flaky::default());
        port.fails.store(1_000, Ordering::SeqCst);
        port.applied_before_failing.store(true, Ordering::SeqCst);
        let (spec, ctx, handle) = clearable(&dir, port.clone());
        let stop = CancellationToken::new();
        let reporter = ctx.reporter.clone();
        let task = tokio::spawn(run_monitor(spec, ctx, handle, stop.clone()));
        tokio::time::sleep(Duration::from_secs(8)).await;
        assert!(*port.present.lock().unwrap(), "the failed add landed");
        recover(&dir, &reporter).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        port.fails.store(0, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_secs(60)).await;
        stop.cancel();
        let _ = task.await;
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            !*port.present.lock().unwrap(),
            "the taint nodeguard may have added is removed"
        );
    }
}
