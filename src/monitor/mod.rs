//! The problem detector: log monitors (kernel log, files) whose rules set
//! NodeConditions that clear, emit Events, and add taints, with state that
//! survives restarts.
//!
//! [`engine`] is the decision core, [`kmsg`] the record parser, [`sources`]
//! the bounded readers; [`run_monitors`] keeps one task per monitor and
//! restarts only the monitors whose spec changed.

pub mod engine;
pub mod kmsg;
pub mod sources;

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::clock::WallClock;
use crate::policy::monitors::MonitorSpec;
use crate::report::{Desired, EventKind, Reporter, Status};
use engine::{Action, ConditionState, Engine, PluginStatus};
use sources::{Cursor, SourceCounters, StopFlag};

#[derive(Debug, thiserror::Error)]
pub enum MonitorError {
    #[error("API request failed: {0}")]
    Api(#[from] kube::Error),
    #[error("cannot open log source {path}: {source}")]
    Source {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Taint(#[from] crate::k8s::taints::TaintError),
}

/// Port: the monitor's taints on this Node.
pub trait TaintPort: Send + Sync + 'static {
    /// `true` when nodeguard added it (it was not there).
    fn add(
        &self,
        key: &str,
        value: &str,
        effect: &str,
    ) -> impl Future<Output = Result<bool, MonitorError>> + Send;
    fn remove(
        &self,
        key: &str,
        effect: &str,
    ) -> impl Future<Output = Result<(), MonitorError>> + Send;
}

/// How many lines may wait for a monitor's rules; beyond, file and journal
/// readers wait and kmsg records are dropped and counted
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
        m
    }

    fn problem(&self, reason: &str) {
        self.problems
            .get_or_create(&ReasonLabels {
                reason: reason.to_string(),
            })
            .inc();
    }

    fn set_active(&self, type_: &str, reason: &str, active: bool) {
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
        let mut last = self.active_reason.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(prev) = last.remove(type_) {
            self.active.remove(&ActiveLabels {
                r#type: type_.into(),
                reason: prev,
            });
        }
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

/// Persisted per monitor: conditions and where the source stands.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MonitorState {
    #[serde(default)]
    pub conditions: BTreeMap<String, ConditionState>,
    #[serde(default)]
    pub cursor: Cursor,
}

fn state_path(dir: &Path, monitor: &str) -> PathBuf {
    dir.join("monitors").join(format!("{monitor}.json"))
}

fn load_state(dir: &Path, monitor: &str) -> MonitorState {
    let p = state_path(dir, monitor);
    match std::fs::read_to_string(&p) {
        Ok(t) => serde_json::from_str(&t).unwrap_or_else(|e| {
            tracing::error!(path = %p.display(), error = %e, "monitor state unreadable; starting afresh");
            MonitorState::default()
        }),
        Err(_) => MonitorState::default(),
    }
}

fn save_state(dir: &Path, monitor: &str, state: &MonitorState) {
    let p = state_path(dir, monitor);
    let write = || -> std::io::Result<()> {
        std::fs::create_dir_all(p.parent().expect("a state path has a parent"))?;
        let tmp = p.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_vec(state).expect("state serializes"))?;
        std::fs::rename(&tmp, &p)
    };
    if let Err(e) = write() {
        tracing::error!(path = %p.display(), error = %e, "cannot save monitor state");
    }
}

struct Running {
    spec: MonitorSpec,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

/// Keeps one task per monitor; a changed spec restarts that monitor, a
/// removed one has its conditions and taints removed and its state dropped.
#[allow(clippy::too_many_arguments)]
pub async fn run_monitors<T: TaintPort + Clone>(
    mut specs: watch::Receiver<Vec<MonitorSpec>>,
    reporter: Reporter,
    taints: T,
    state_dir: PathBuf,
    system_bus: Option<String>,
    metrics: MonitorMetrics,
    stop: CancellationToken,
) {
    let mut running: HashMap<String, Running> = HashMap::new();
    loop {
        let desired: HashMap<String, MonitorSpec> = specs
            .borrow_and_update()
            .iter()
            .map(|m| (m.name.clone(), m.clone()))
            .collect();
        let mut removed = Vec::new();
        running.retain(|name, r| {
            let keep = desired.get(name) == Some(&r.spec);
            if !keep {
                r.stop.cancel();
                if !desired.contains_key(name) {
                    removed.push((name.clone(), r.spec.clone()));
                }
            }
            keep
        });
        for (name, spec) in removed {
            tracing::info!(monitor = %name, "monitor removed; removing its conditions and taints");
            let state = load_state(&state_dir, &name);
            for c in &spec.conditions {
                reporter.remove(&c.type_);
                metrics.forget(&c.type_);
                if let (Some(t), Some(s)) = (&c.taint, state.conditions.get(&c.type_))
                    && s.taint_added
                    && let Err(e) = taints.remove(&t.key, &t.effect).await
                {
                    tracing::warn!(monitor = %name, error = %e, "cannot remove the monitor's taint");
                }
            }
            let _ = std::fs::remove_file(state_path(&state_dir, &name));
        }
        for (name, spec) in desired {
            if running.contains_key(&name) {
                continue;
            }
            let token = stop.child_token();
            let task = tokio::spawn(run_monitor(
                spec.clone(),
                reporter.clone(),
                taints.clone(),
                state_dir.clone(),
                system_bus.clone(),
                metrics.clone(),
                token.clone(),
            ));
            running.insert(
                name,
                Running {
                    spec,
                    stop: token,
                    task,
                },
            );
        }
        tokio::select! {
            _ = stop.cancelled() => break,
            r = specs.changed() => if r.is_err() { break },
        }
    }
    for r in running.into_values() {
        r.stop.cancel();
        let _ = r.task.await;
    }
}

async fn run_monitor<T: TaintPort>(
    spec: MonitorSpec,
    reporter: Reporter,
    taints: T,
    state_dir: PathBuf,
    system_bus: Option<String>,
    metrics: MonitorMetrics,
    stop: CancellationToken,
) {
    let clock = WallClock::new();
    let mut engine = match Engine::new(&spec, &format!("monitor {}", spec.name)) {
        Ok(e) => e,
        Err(bad) => {
            // The policy validation rejects these; never crash on them.
            tracing::error!(monitor = %spec.name, problems = ?bad, "monitor rules do not compile; monitor not started");
            return;
        }
    };
    let mut state = load_state(&state_dir, &spec.name);
    engine.restore(state.conditions.clone());
    let counters = Arc::new(SourceCounters::default());
    metrics
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
            state.cursor.kmsg_sequence,
            tx,
            counters.clone(),
            source_stop.clone(),
        );
        Some((k.path.clone(), r))
    } else if let Some(f) = &spec.source.file {
        let r = sources::spawn_file(
            PathBuf::from(&f.path),
            state.cursor.file,
            tx,
            counters.clone(),
            source_stop.clone(),
        );
        Some((f.path.clone(), r))
    } else if let Some(j) = &spec.source.journald {
        let r = sources::spawn_journald(
            j.clone(),
            state.cursor.journal.clone(),
            tx,
            counters.clone(),
            source_stop.clone(),
        );
        Some(("journalctl".to_string(), r))
    } else {
        None
    };
    let (plugin_tx, mut plugin_rx) = mpsc::channel::<(usize, PluginStatus, String)>(64);
    if let Some(p) = &spec.source.plugin {
        tokio::spawn(run_plugins(
            spec.clone(),
            p.clone(),
            plugin_tx.clone(),
            counters.clone(),
            stop.clone(),
        ));
    }
    if let Some(s) = &spec.source.systemd {
        tokio::spawn(run_service_checks(
            spec.clone(),
            s.clone(),
            plugin_tx,
            system_bus.clone(),
            reporter.clone(),
            counters.clone(),
            stop.clone(),
        ));
    }
    if let Some((path, Err(source))) = started {
        let e = MonitorError::Source { path, source };
        tracing::error!(monitor = %spec.name, error = %e, "monitor source unavailable");
        reporter.event(
            EventKind::Warning,
            "MonitorSourceUnavailable",
            "StartMonitor",
            format!("Monitor {} cannot read its source: {e}. Mount it into the pod (chart values host.kmsg / host.journal) or fix the path.", spec.name),
        );
    }
    let defaults: BTreeMap<String, String> = spec
        .conditions
        .iter()
        .map(|c| (c.type_.clone(), c.reason.clone()))
        .collect();
    let initial = engine.current(clock.now());
    apply(&initial, &reporter, &taints, &metrics, &defaults).await;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut dirty = false;
    let mut lines_open = true;
    let mut last_save = tokio::time::Instant::now();
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            item = rx.recv(), if lines_open => {
                // Plugin monitors have no line source: the channel closes at once.
                let Some(item) = item else { lines_open = false; continue };
                let actions = engine.on_line(&item.line, clock.now());
                state.cursor = item.cursor;
                dirty = true;
                if !actions.is_empty() {
                    apply(&actions, &reporter, &taints, &metrics, &defaults).await;
                    state.conditions = engine.state().clone();
                    save_state(&state_dir, &spec.name, &state);
                    dirty = false;
                    last_save = tokio::time::Instant::now();
                }
            }
            Some((rule, status, output)) = plugin_rx.recv() => {
                let actions = engine.on_plugin(rule, status, &output, clock.now());
                if !actions.is_empty() {
                    apply(&actions, &reporter, &taints, &metrics, &defaults).await;
                    state.conditions = engine.state().clone();
                    save_state(&state_dir, &spec.name, &state);
                }
            }
            _ = tick.tick() => {
                let actions = engine.on_tick(clock.now());
                if !actions.is_empty() {
                    apply(&actions, &reporter, &taints, &metrics, &defaults).await;
                    dirty = true;
                }
                // The cursor is saved at most once a second under load.
                if dirty && last_save.elapsed() >= Duration::from_secs(1) {
                    state.conditions = engine.state().clone();
                    save_state(&state_dir, &spec.name, &state);
                    dirty = false;
                    last_save = tokio::time::Instant::now();
                }
            }
        }
    }
    source_stop.stop();
    state.conditions = engine.state().clone();
    save_state(&state_dir, &spec.name, &state);
}

/// What one look at a unit found.
struct UnitHealth {
    healthy: bool,
    message: String,
    /// Realtime microseconds of the unit's last start (0: never started).
    started_usec: u64,
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
        let now_usec = jiff::Timestamp::now().as_microsecond().max(0) as u64;
        let up = Duration::from_micros(now_usec.saturating_sub(health.started_usec));
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
            .kill_unit(src.unit.clone(), "main".into(), libc::SIGKILL)
            .await
        {
            Ok(()) => {
                last_repair = Some(tokio::time::Instant::now());
                let note = format!(
                    "nodeguard repaired {}: it was unhealthy ({}) after {}s up, so its main process was killed for systemd to restart it; no further repair for {}s.",
                    src.unit,
                    health.message.trim_end_matches('.'),
                    up.as_secs(),
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

async fn apply<T: TaintPort>(
    actions: &[Action],
    reporter: &Reporter,
    taints: &T,
    metrics: &MonitorMetrics,
    defaults: &BTreeMap<String, String>,
) {
    for a in actions {
        match a {
            Action::Event { reason, message } => {
                let clearing = defaults.values().any(|d| d == reason);
                if !clearing {
                    metrics.problem(reason);
                }
                let kind = if clearing {
                    EventKind::Normal
                } else {
                    EventKind::Warning
                };
                reporter.event(kind, reason, "DetectProblem", message.clone());
            }
            Action::Condition {
                type_,
                active,
                reason,
                message,
            } => {
                metrics.set_active(type_, reason, *active);
                reporter.set(
                    type_,
                    Desired {
                        status: if *active { Status::True } else { Status::False },
                        reason: reason.clone(),
                        message: message.clone(),
                    },
                );
            }
            Action::Taint {
                key,
                value,
                effect,
                add,
            } => {
                let mut backoff = Duration::from_millis(200);
                for attempt in 1..=5 {
                    let r = if *add {
                        taints.add(key, value, effect).await.map(|_| ())
                    } else {
                        taints.remove(key, effect).await
                    };
                    match r {
                        Ok(()) => break,
                        Err(e) => {
                            tracing::warn!(taint = %key, add, attempt, error = %e, "taint update failed");
                            tokio::time::sleep(backoff).await;
                            backoff *= 2;
                        }
                    }
                }
            }
        }
    }
}
