//! Wiring: builds the health registry, metrics, reporter, HTTP server and
//! the long-running loops, and stops them together.
//!
//! ```text
//! watch Node ──┐
//! watch Policy ┼─► node-state loop ─► eligibility (/healthz), policy::policy_report ─► condition, Events
//! watch Pods ──┤                    ├► probes, monitors, shutdown, watchdog: their specs (trusted, limited)
//!              │                    └► observation ─► condition writer ─► nodes/status (SSA)
//!              └─► pod snapshot ─► probe manager, shutdown manager
//! Reporter events ─► event publisher ─► events.k8s.io
//! ```

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::runtime::watcher;
use kube::{Api, Client};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::k8s::node::{Eligibility, NodeFacts, eligibility};
use crate::k8s::retry_after::ShedMetrics;
use crate::k8s::watch::{Snapshot, keep_whole, publish_objects, trim_pod};
use crate::monitor::kube::KubeTaints;
use crate::monitor::{MonitorContext, MonitorMetrics, run_monitors};
use crate::policy::monitors::MonitorSpec;
use crate::policy::probes::ProbeSpec;
use crate::policy::{
    NodeGuardPolicy, NodeTrust, Selection, WatchdogMode, WatchdogSpec, policy_report,
    select_with_last_good,
};
use crate::probe::{KubePodConditions, ProbeHandle, ProbeMetrics, run_probe_manager};
use crate::report::kube::{KubeEvents, KubeStatus, observe};
use crate::report::{
    EventKind, Observation, ReportConfig, Reporter, Status, run_condition_writer,
    run_event_publisher,
};
use crate::server::supervisor::Supervisor;
use crate::server::{Health, LoopHandle, Server, ServerError, metrics};
use crate::shutdown::cluster::KubeCluster;
use crate::shutdown::keep::Keeper;
use crate::shutdown::logind::ZbusConnector;
use crate::shutdown::{self, ShutdownConfig, ShutdownHost, ShutdownMetrics, run_shutdown_manager};
use crate::state_dir::StateWrites;
use crate::watchdog::{
    self, KubeApiProbe, SysDeviceOpener, SystemdNotifier, WatchdogHost, WatchdogMetrics,
    run_watchdog,
};

/// How long a loop may hold unapplied changes before `/livez` fails.
pub const LOOP_TIMEOUT: Duration = Duration::from_secs(60);

pub use crate::policy::{POLICY_CONDITION, POLICY_INVALID};

#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub node_name: String,
    pub listen: SocketAddr,
    pub state_dir: PathBuf,
    pub report: ReportConfig,
    /// Condition types owned by in-process sources outside the policy,
    /// declared at start so that a restart carries their values over.
    pub declared_conditions: Vec<String>,
    /// `NOTIFY_SOCKET`, when running as a systemd service.
    pub notify_socket: Option<String>,
    /// The systemd watchdog timeout (`WATCHDOG_USEC`), when the unit sets one.
    pub systemd_watchdog: Option<Duration>,
    /// The system bus (`DBUS_SYSTEM_BUS_ADDRESS`); `None`: the default socket.
    pub system_bus_address: Option<String>,
    /// This boot's id (to tell a restart of the agent from a reboot).
    pub boot_id: String,
    /// Namespace of the Lease that elects the one agent writing the
    /// policies' status (the DaemonSet's namespace).
    pub lease_namespace: String,
    /// What this node's owner lets policies make the agent do (commands,
    /// repairs, paths, devices, inhibit delay); see `policy::trust`.
    pub trust: NodeTrust,
    /// Where a copy of logind's delay inhibitor outlives this process
    /// (systemd's file descriptor store, or `nodeguard keep`).
    pub keeper: Keeper,
    /// The inhibitor a previous process left with the keeper, taken back
    /// before any thread started (so no child process inherits it).
    pub reclaimed_inhibitor: Arc<std::sync::Mutex<Option<std::os::fd::OwnedFd>>>,
    /// Handing the delay inhibitor over to the next pod's agent on a stop
    /// (the chart's pods); see [`shutdown::Handover`].
    pub handover: shutdown::Handover,
    /// The `journalctl` journald monitors run; by default the one on PATH
    /// (the image's own, or the host's in host mode).
    pub journalctl: PathBuf,
    /// Where exec probes and plugin monitors run their commands
    /// (`--command-root`: the node's root file system mounted into the pod).
    pub command_root: crate::command::CommandRoot,
    /// Drop the executable's pages the start touched from the RSS once the
    /// agent is ready (`footprint`); `--keep-executable-pages` turns it off.
    pub release_executable_pages: bool,
}

impl AgentConfig {
    pub fn new(
        node_name: impl Into<String>,
        listen: SocketAddr,
        state_dir: impl Into<PathBuf>,
    ) -> Self {
        AgentConfig {
            node_name: node_name.into(),
            listen,
            state_dir: state_dir.into(),
            report: ReportConfig::default(),
            declared_conditions: Vec::new(),
            notify_socket: None,
            systemd_watchdog: None,
            system_bus_address: None,
            boot_id: shutdown::state::current_boot_id(),
            lease_namespace: "default".into(),
            trust: NodeTrust::default(),
            keeper: Keeper::None,
            reclaimed_inhibitor: Arc::default(),
            handover: shutdown::Handover::default(),
            journalctl: "journalctl".into(),
            command_root: Default::default(),
            release_executable_pages: true,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Server(#[from] ServerError),
    #[error("the node-local trust settings are not usable: {}", .0.join("; "))]
    Trust(Vec<String>),
}

/// A started agent. Dropping it does not stop it; call [`RunningAgent::stop`].
pub struct RunningAgent {
    pub health: Health,
    pub reporter: Reporter,
    /// The address the HTTP server listens on (useful with port 0).
    pub addr: SocketAddr,
    /// This node as last seen (`None` before the first list).
    pub node: watch::Receiver<Option<Snapshot<Node>>>,
    /// Pods bound to this node, by `namespace/name`.
    pub pods: watch::Receiver<Option<Snapshot<Pod>>>,
    /// All policies as last seen.
    pub policies: watch::Receiver<Option<Snapshot<NodeGuardPolicy>>>,
    /// The probe workers (identities, manual triggers).
    pub probes: ProbeHandle,
    /// True while the node's graceful shutdown runs.
    pub node_shutdown: watch::Receiver<bool>,
    stop_check: crate::shutdown::StopCheck,
    shutdown: CancellationToken,
    tasks: JoinSet<()>,
    _senders: Senders,
}

/// Clones of the agent's channel senders, held until the agent is dropped.
#[derive(Default)]
struct Senders(Vec<Box<dyn std::any::Any + Send + Sync>>);

impl Senders {
    fn hold<T: Send + Sync + 'static>(&mut self, tx: watch::Sender<T>) -> watch::Sender<T> {
        self.0.push(Box::new(tx.clone()));
        tx
    }
}

impl RunningAgent {
    /// Stops the agent, but not in the middle of the node's graceful
    /// shutdown: its delay inhibitor dies with the process, and logind then
    /// goes on at once, so the remaining priority groups would never be
    /// evicted. (A rollout of the DaemonSet, a drain tool deleting the pod
    /// or `systemctl restart` can ask for a stop at that moment.) The
    /// shutdown ends within the inhibit window; `interrupt` (a second
    /// signal) stops at once.
    pub async fn stop_after_node_shutdown(self, interrupt: impl std::future::Future<Output = ()>) {
        tokio::pin!(interrupt);
        let mut running = self.node_shutdown.clone();
        // Before anything is cancelled: a shutdown logind has begun but
        // the manager has not handled yet, or one a restarted agent is
        // about to resume, starts now and is waited for.
        if !*running.borrow() {
            tokio::select! {
                _ = self.stop_check.ask() => {}
                _ = &mut interrupt => {
                    tracing::warn!("stopping at once (second signal)");
                    self.stop().await;
                    return;
                }
            }
        }
        if *running.borrow_and_update() {
            let message = "nodeguard was asked to stop during the node's graceful shutdown; it finishes the shutdown's remaining priority groups first (within the inhibit window), then stops.";
            tracing::warn!("{message}");
            self.reporter
                .event(EventKind::Warning, "StopDeferred", "Stop", message);
            tokio::select! {
                _ = running.wait_for(|r| !*r) => tracing::info!("the node's shutdown is done; stopping"),
                _ = &mut interrupt => tracing::warn!("stopping in the middle of the node's shutdown (second signal)"),
            }
        }
        self.stop().await;
    }

    /// Cancels every loop and waits for them and the HTTP server to finish.
    pub async fn stop(mut self) {
        self.shutdown.cancel();
        while self.tasks.join_next().await.is_some() {}
    }

    /// A token that stops the agent when cancelled.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }
}

/// Checks that the state directory takes writes. One that does not (full,
/// read-only) is said as every failed state write is (one Warning Event),
/// and the agent starts anyway: refusing would leave the node with no
/// monitors, no shutdown inhibitor and frozen conditions until the disk is
/// fixed, while from memory it protects the node as usual.
fn check_state_dir(path: &std::path::Path, writes: &StateWrites) {
    let probe = path.join(".nodeguard-write-test");
    if writes.write(&probe, b"ok", false) {
        writes.remove(&probe);
    }
}

/// Starts the agent's loops and HTTP server, returning once it is listening.
pub async fn start(config: AgentConfig, client: Client) -> Result<RunningAgent, AgentError> {
    let trust_problems = config.trust.problems();
    if !trust_problems.is_empty() {
        return Err(AgentError::Trust(trust_problems));
    }
    tracing::info!(trust = %config.trust.describe(), "node-local trust: what policies may make this agent do");
    let resolved = crate::monitor::sources::resolve_roots(&config.trust.read_paths);
    if resolved
        .iter()
        .zip(&config.trust.read_paths)
        .any(|(r, w)| r.as_os_str() != w.as_str())
    {
        tracing::info!(roots = ?resolved, "read paths with their links resolved (a link under them that leads out is refused)");
    }
    for warning in config.trust.warnings() {
        tracing::warn!(
            "node-local trust: {warning}: any policy author who may use host access gets that on this node"
        );
    }
    // Every request of every loop gets a deadline: a connection that stops
    // answering must not hold a loop forever (see k8s::deadline). A request
    // the API server sheds (429 with Retry-After) goes again after the wait
    // it asks for, jittered (see k8s::retry_after).
    // The shutdown manager and the watchdog's API probe see every 429 at
    // once (`direct`): they run against their own short clocks.
    // Once the agent stops, no wait for the API server starts and one under
    // way ends: the loops' last writes go out at once.
    let shutdown = CancellationToken::new();
    let direct = crate::k8s::deadline::with_deadline(client, crate::k8s::deadline::API_DEADLINE);
    let shed_metrics = ShedMetrics::default();
    let client = crate::k8s::retry_after::with_retry_after(
        direct.clone(),
        shed_metrics.clone(),
        shutdown.clone(),
    );
    let health = Health::new();
    let (mut registry, server_metrics) = metrics::new_registry(&health);
    shed_metrics.register(&mut registry);
    let (reporter, event_queue) = Reporter::new(&config.report, &mut registry);
    let watchdog_metrics = WatchdogMetrics::register(&mut registry);
    let shutdown_metrics = ShutdownMetrics::register(&mut registry);
    let probe_metrics = ProbeMetrics::register(&mut registry);
    let monitor_metrics = MonitorMetrics::register(&mut registry);
    let state_writes = StateWrites::new(reporter.clone());
    state_writes.register(&mut registry);
    check_state_dir(&config.state_dir, &state_writes);
    reporter.declare(POLICY_CONDITION);
    for type_ in &config.declared_conditions {
        reporter.declare(type_);
    }
    let mut sup = Supervisor::new(health.clone(), shutdown.clone());
    // Every channel between loops stays open while the agent runs, whatever
    // happens to the loop that feeds it: a loop that dies is failed by the
    // supervisor, and the loops it fed keep their last input (the shutdown
    // manager its inhibitor, the watchdog its armed device) instead of
    // taking a closed channel for a stop.
    let mut keep = Senders::default();

    // Register every loop before serving, so /readyz cannot pass early.
    let node_loop = health.register("node-watch", LOOP_TIMEOUT);
    let pod_loop = health.register("pod-watch", LOOP_TIMEOUT);
    let policy_loop = health.register("policy-watch", LOOP_TIMEOUT);
    let state_loop = health.register("node-state", LOOP_TIMEOUT);
    let writer_loop = health.register("condition-writer", LOOP_TIMEOUT);
    let shutdown_loop = health.register("shutdown-manager", LOOP_TIMEOUT);
    let probe_loop = health.register("probe-manager", LOOP_TIMEOUT);
    let event_loop = health.register("event-publisher", LOOP_TIMEOUT);

    let server = Server::bind(
        config.listen,
        health.clone(),
        Arc::new(registry),
        server_metrics,
    )
    .await?;
    let addr = server.local_addr();
    tracing::info!(%addr, node = %config.node_name, "serving /healthz /livez /readyz /metrics");
    let token = shutdown.clone();
    sup.spawn("http-server", async move {
        if let Err(err) = server.serve(token).await {
            tracing::error!(error = %err, "HTTP server stopped");
        }
    });

    let (node_tx, node_rx) = watch::channel(None);
    sup.spawn(
        "node-watch",
        publish_objects(
            Api::<Node>::all(client.clone()),
            watcher::Config::default().fields(&format!("metadata.name={}", config.node_name)),
            keep_whole,
            node_loop,
            shutdown.clone(),
            keep.hold(node_tx),
        ),
    );
    let (pod_tx, pod_rx) = watch::channel(None);
    let (node_shutdown_tx, node_shutdown) = watch::channel(false);
    let (stop_check, stop_questions) = crate::shutdown::stop_check(
        config
            .reclaimed_inhibitor
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some(),
    );
    sup.spawn(
        "pod-watch",
        publish_objects(
            Api::<Pod>::all(client.clone()),
            watcher::Config::default().fields(&format!("spec.nodeName={}", config.node_name)),
            trim_pod,
            pod_loop,
            shutdown.clone(),
            keep.hold(pod_tx),
        ),
    );
    let (policy_tx, policy_rx) = watch::channel(None);
    sup.spawn(
        "policy-watch",
        publish_objects(
            Api::<NodeGuardPolicy>::all(client.clone()),
            watcher::Config::default(),
            keep_whole,
            policy_loop,
            shutdown.clone(),
            keep.hold(policy_tx),
        ),
    );

    let (obs_tx, obs_rx) = watch::channel(None);
    let (watchdog_tx, watchdog_rx) = watch::channel(None);
    let (shutdown_tx, shutdown_rx) = watch::channel(None);
    let (probes_tx, probes_rx) = watch::channel(Vec::new());
    let (monitors_tx, monitors_rx) = watch::channel(Vec::new());
    sup.spawn(
        "node-state",
        node_state_loop(NodeStateLoop {
            policy_spread: config.report.policy_spread,
            monitors: keep.hold(monitors_tx),
            probes: keep.hold(probes_tx),
            watchdog: keep.hold(watchdog_tx),
            shutdown_config: keep.hold(shutdown_tx),
            node_name: config.node_name.clone(),
            trust: config.trust.clone(),
            node: node_rx.clone(),
            policies: policy_rx.clone(),
            observation: keep.hold(obs_tx),
            health: health.clone(),
            reporter: reporter.clone(),
            handle: state_loop,
            shutdown: shutdown.clone(),
        }),
    );
    sup.spawn(
        "condition-writer",
        run_condition_writer(
            reporter.clone(),
            KubeStatus::new(client.clone(), &config.node_name),
            obs_rx,
            writer_loop,
            config.report.clone(),
            shutdown.clone(),
        ),
    );
    let (node_obj_tx, node_obj_rx) = watch::channel(None);
    let node_obj_tx = keep.hold(node_obj_tx);
    {
        let mut node_rx = node_rx.clone();
        let name = config.node_name.clone();
        let token = shutdown.clone();
        sup.spawn("node-forwarder", async move {
            loop {
                let node = node_rx
                    .borrow_and_update()
                    .as_ref()
                    .and_then(|s| s.get(&name).cloned());
                node_obj_tx.send_replace(node);
                tokio::select! {
                    _ = token.cancelled() => return,
                    r = node_rx.changed() => if r.is_err() { return },
                }
            }
        });
    }
    sup.spawn(
        "event-publisher",
        run_event_publisher(
            reporter.clone(),
            event_queue,
            KubeEvents::new(client.clone(), &config.node_name, node_obj_rx),
            config.report.clone(),
            event_loop,
            shutdown.clone(),
        ),
    );

    sup.spawn(
        "watchdog",
        run_watchdog(
            WatchdogHost {
                notifier: SystemdNotifier::new(config.notify_socket.clone()),
                systemd_timeout: config.systemd_watchdog,
                opener: SysDeviceOpener,
                api: KubeApiProbe(direct.clone()),
            },
            watchdog_rx,
            health.clone(),
            reporter.clone(),
            watchdog_metrics,
            shutdown.clone(),
        ),
    );

    sup.spawn(
        "shutdown-manager",
        run_shutdown_manager(
            ShutdownHost {
                logind: ZbusConnector {
                    address: config.system_bus_address.clone(),
                },
                cluster: KubeCluster::new(direct.clone(), &config.node_name),
                state_dir: config.state_dir.clone(),
                state_writes: state_writes.clone(),
                boot_id: config.boot_id.clone(),
                node_name: config.node_name.clone(),
                in_progress: node_shutdown_tx,
                stop_questions,
                keeper: config.keeper.clone(),
                reclaimed: config
                    .reclaimed_inhibitor
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .take(),
                handover: config.handover.clone(),
            },
            shutdown_rx,
            pod_rx.clone(),
            reporter.clone(),
            shutdown_metrics,
            shutdown_loop,
            shutdown.clone(),
        ),
    );

    sup.spawn(
        "monitors",
        run_monitors(
            monitors_rx,
            MonitorContext {
                reporter: reporter.clone(),
                taints: KubeTaints::new(client.clone(), &config.node_name),
                state_dir: config.state_dir.clone(),
                state_writes: state_writes.clone(),
                system_bus: config.system_bus_address.clone(),
                metrics: monitor_metrics,
                health: health.clone(),
                boot_id: config.boot_id.clone(),
                read_roots: resolved,
                journalctl: config.journalctl.clone(),
                command_root: config.command_root.clone(),
            },
            shutdown.clone(),
        ),
    );
    sup.spawn(
        "policy-status",
        crate::policy::kube::run_policy_status(
            client.clone(),
            config.lease_namespace.clone(),
            config.node_name.clone(),
            policy_rx.clone(),
            shutdown.clone(),
        ),
    );
    let probe_handle = ProbeHandle::default();
    sup.spawn(
        "probe-manager",
        run_probe_manager(
            probes_rx,
            pod_rx.clone(),
            reporter.clone(),
            KubePodConditions::new(client.clone()),
            probe_metrics,
            probe_handle.clone(),
            probe_loop,
            config.command_root.clone(),
            shutdown.clone(),
        ),
    );
    if config.release_executable_pages {
        // Once, after the start: not a loop, so not supervised.
        let (reporter, shed) = (reporter.clone(), shed_metrics.clone());
        tokio::spawn(crate::footprint::release_when_ready(
            health.clone(),
            move || reporter.api_write_errors() + shed.troubles(),
            node_shutdown.clone(),
            shutdown.clone(),
        ));
    }

    Ok(RunningAgent {
        probes: probe_handle,
        health,
        reporter,
        addr,
        node: node_rx,
        pods: pod_rx,
        node_shutdown,
        stop_check,
        policies: policy_rx,
        shutdown,
        tasks: sup.into_tasks(),
        _senders: keep,
    })
}

struct NodeStateLoop {
    policy_spread: Duration,
    monitors: watch::Sender<Vec<MonitorSpec>>,
    probes: watch::Sender<Vec<ProbeSpec>>,
    watchdog: watch::Sender<Option<WatchdogSpec>>,
    shutdown_config: watch::Sender<Option<ShutdownConfig>>,
    node_name: String,
    trust: NodeTrust,
    node: watch::Receiver<Option<Snapshot<Node>>>,
    policies: watch::Receiver<Option<Snapshot<NodeGuardPolicy>>>,
    observation: watch::Sender<Option<Observation>>,
    health: Health,
    reporter: Reporter,
    handle: LoopHandle,
    shutdown: CancellationToken,
}

/// Reacts to the Node and the policies: eligibility, the policy condition,
/// and what the condition writer observes of the Node.
async fn node_state_loop(mut s: NodeStateLoop) {
    let mut last_selection: Option<Selection> = None;
    let mut last_labels = None;
    let mut last_good = std::collections::BTreeMap::new();
    let mut validations = crate::policy::Validations::default();
    let spread = crate::report::conditions::spread_offset(&s.node_name, s.policy_spread);
    loop {
        let node_snapshot = s.node.borrow_and_update().clone();
        let policy_snapshot = s.policies.borrow_and_update().clone();
        if let (Some(nodes), Some(policies)) = (node_snapshot, policy_snapshot) {
            s.handle.queued();
            let node = nodes.get(&s.node_name).cloned();
            s.observation.send_replace(node.as_deref().map(observe));
            let labels = node
                .as_ref()
                .and_then(|n| n.metadata.labels.clone())
                .unwrap_or_default();
            let selection = select_with_last_good(
                policies.values().map(|p| p.as_ref()),
                &labels,
                &s.trust,
                &mut last_good,
                &mut validations,
            );
            if last_selection.as_ref() != Some(&selection) {
                // A policy edit changes every selected node at once: their
                // writes wait each node's share of the spread window. (A
                // relabel or a start changes one node: written at once.)
                // Set before the changes, so the writer sees it with them.
                if last_selection.is_some() && last_labels.as_ref() == Some(&labels) {
                    s.reporter.spread_writes(spread, &[POLICY_CONDITION]);
                }
                report_selection(&s.reporter, &s.node_name, &selection);
                s.reporter.set_effective(effective_value(&selection));
                if selection
                    .watchdog
                    .as_ref()
                    .is_some_and(|w| w.mode != WatchdogMode::Off)
                {
                    s.reporter.declare(watchdog::CONDITION);
                }
                for p in &selection.probes {
                    if p.pods.is_none()
                        && let Some(t) = &p.condition_type
                    {
                        s.reporter.declare(t);
                    }
                }
                s.probes.send_replace(selection.probes.clone());
                for m in &selection.monitors {
                    for c in &m.conditions {
                        s.reporter.declare(&c.type_);
                    }
                }
                s.monitors.send_replace(selection.monitors.clone());
                s.watchdog.send_replace(selection.watchdog.clone());
                if selection.shutdown.is_some() {
                    s.reporter.declare(shutdown::CONDITION);
                    s.reporter.declare(shutdown::UNAVAILABLE);
                }
                s.shutdown_config
                    .send_replace(selection.shutdown.as_ref().map(ShutdownConfig::from_spec));
                s.reporter.edit_done();
                if !s.reporter.is_initialized() {
                    // Every condition source has now declared its types.
                    s.reporter.mark_initialized();
                }
            }
            let facts = node
                .as_deref()
                .map(NodeFacts::from_node)
                .unwrap_or_default();
            update_eligibility(&s, &facts, &selection.ineligible_taints);
            last_selection = Some(selection);
            last_labels = Some(labels);
            s.handle.updated();
        }
        tokio::select! {
            _ = s.shutdown.cancelled() => return,
            r = s.node.changed() => if r.is_err() { return },
            r = s.policies.changed() => if r.is_err() { return },
        }
    }
}

pub use crate::report::kube::EFFECTIVE_ANNOTATION;

/// `name@generation` of each applied policy, comma-separated, sorted.
pub fn effective_value(selection: &Selection) -> String {
    let mut v: Vec<String> = selection
        .applied
        .iter()
        .map(|n| {
            let g = selection
                .kept
                .get(n)
                .or(selection.generations.get(n))
                .copied()
                .unwrap_or_default();
            format!("{n}@{g}")
        })
        .collect();
    v.sort();
    v.join(",")
}

fn update_eligibility(s: &NodeStateLoop, facts: &NodeFacts, extra_taints: &[String]) {
    let (eligible, reason) = match eligibility(facts, extra_taints) {
        Eligibility::Eligible => (true, None),
        Eligibility::Ineligible(r) => (false, Some(r)),
    };
    if !s.health.set_node_eligible("node", eligible, reason.clone()) {
        return;
    }
    match reason {
        None => {
            tracing::info!(node = %s.node_name, "node is eligible again; /healthz answers 200");
            s.reporter.event(
                EventKind::Normal,
                "NodeEligible",
                "UpdateHealthz",
                "The node is eligible again: nodeguard's /healthz answers 200 so load balancers may send traffic.",
            );
        }
        Some(r) => {
            tracing::warn!(node = %s.node_name, reason = %r, "node is no longer eligible; /healthz answers 503");
            s.reporter.event(
                EventKind::Warning,
                "NodeIneligible",
                "UpdateHealthz",
                format!("The node is no longer eligible ({r}): nodeguard's /healthz answers 503 so load balancers drain it."),
            );
        }
    }
}

/// Logs what the selection says, then sends the policy condition and the
/// Events [`policy_report`] decides.
fn report_selection(reporter: &Reporter, node: &str, selection: &Selection) {
    for (section, used, ignored) in &selection.conflicts {
        tracing::warn!(%node, %section, %used, ?ignored, "conflicting policies");
    }
    if let Some((name, problems)) = selection.invalid.first() {
        tracing::warn!(%node, policy = %name, problems = ?problems.iter().map(ToString::to_string).collect::<Vec<_>>(), "invalid policy ignored");
    }
    for r in &selection.refused {
        tracing::warn!(%node, policy = %r.policy, field = %r.field, setting = r.setting.flag(), "policy item refused by the node-local trust");
    }
    if !selection.over_limit.is_empty() {
        let (probes, monitors) = selection.over_limit.iter().fold((0, 0), |(p, m), o| {
            (p + o.probes.len(), m + o.monitors.len())
        });
        tracing::warn!(%node, probes, monitors, policies = selection.over_limit.len(), "policies ask for more than the node's limits; the rest is not in force");
    }
    for u in &selection.ungated {
        tracing::warn!(%node, policy = %u.policy, probe = %u.probe, gate = %u.gate, why = %u.why, "gated probe left out: its gate is not in force");
    }
    let report = policy_report(selection);
    if report.condition.status == Status::False {
        tracing::info!(%node, applied = ?selection.applied, "policies selected");
    }
    for (reason, message) in report.events {
        reporter.event(EventKind::Warning, reason, "LoadPolicy", message);
    }
    reporter.set(POLICY_CONDITION, report.condition);
}
