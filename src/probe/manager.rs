//! The probe manager: one lightweight task per (probe, target), started,
//! restarted and stopped as policies and pods change; unchanged workers are
//! left alone. Results go to NodeConditions (node probes) or pod
//! readiness-gate conditions (pod probes).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use tokio::sync::{Notify, Semaphore, watch};
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep};
use tokio_util::sync::CancellationToken;

use super::core::{
    self, Existing, ProbeResult, Role, Sink, Step, TargetKind, TargetView, Thresholds, Tick, Worker,
};
use super::prober::{Action, Outcome, Probers, join_host_port};
use super::{ProbeError, ProbeMetrics};
use crate::k8s::watch::Snapshot;
use crate::policy::Selector;
use crate::policy::probes::{HttpScheme, ProbeRole, ProbeSpec};
use crate::report::{Desired, EventKind, Reporter, Status};
use crate::server::LoopHandle;

/// Port: writes a pod's readiness-gate condition.
pub trait PodConditionPort: Send + Sync + 'static {
    /// Writes to the pod named `pod` (`namespace/name`), whichever it is.
    fn set(
        &self,
        pod: &str,
        condition: &str,
        passing: bool,
        message: &str,
    ) -> impl Future<Output = Result<(), ProbeError>> + Send;

    /// Writes to the pod named `pod` only while it is the one with UID
    /// `uid` (when given), so a write meant for a deleted pod never lands
    /// on a pod recreated under its name. The manager writes through this.
    /// The default, for ports that cannot check, writes by name.
    fn set_on(
        &self,
        pod: &str,
        uid: Option<&str>,
        condition: &str,
        passing: bool,
        message: &str,
    ) -> impl Future<Output = Result<(), ProbeError>> + Send {
        let _ = uid;
        self.set(pod, condition, passing, message)
    }
}

/// A worker's key: the probe's name and its target (`node`, or the pod's
/// `namespace/name`).
pub type WorkerKey = (String, String);

const NODE: &str = "node";

/// Where the results of a probe go.
#[derive(Clone, Debug, PartialEq)]
enum Output {
    NodeCondition(String),
    ReadinessGate(String),
}

/// A worker's definition; a change restarts the worker.
#[derive(Clone, Debug, PartialEq)]
struct Def {
    spec: ProbeSpec,
    /// For pod targets: the resolved target (its IP and status are read
    /// live).
    pod: Option<String>,
    /// For pod targets: the pod's UID, so a pod recreated under the same
    /// name gets a fresh worker.
    uid: Option<String>,
}

struct Running {
    /// Shared with the worker's task.
    def: Arc<Def>,
    trigger: Arc<Notify>,
    stop: CancellationToken,
    task: JoinHandle<()>,
    /// Set once the worker's task panicked (and its restart delay passed).
    panicked: Arc<AtomicBool>,
    /// Increments each time a worker for this key is (re)started.
    generation: u64,
}

/// How long a panicked worker stays down before the manager restarts it,
/// so one that panics at once again does not spin.
pub const PANIC_RESTART_DELAY: Duration = Duration::from_secs(10);

/// Shared by every worker.
struct Shared<P> {
    probers: Probers,
    reporter: Reporter,
    pod_port: P,
    metrics: ProbeMetrics,
    pods: watch::Receiver<Option<Snapshot<Pod>>>,
    /// Published results of Startup probes, for gating.
    startup: Mutex<HashMap<WorkerKey, ProbeResult>>,
    concurrency: Semaphore,
    agent_start: Instant,
    /// Wakes the manager when a panicked worker is due for a restart.
    respawn: Notify,
}

/// Handle for tests and shutdown: trigger a worker, see worker identities.
#[derive(Clone, Default)]
pub struct ProbeHandle {
    inner: Arc<Mutex<HandleState>>,
}

#[derive(Default)]
struct HandleState {
    triggers: HashMap<WorkerKey, Arc<Notify>>,
    generations: BTreeMap<WorkerKey, u64>,
}

impl ProbeHandle {
    /// Runs a worker's probe now instead of at its next period.
    pub fn trigger(&self, probe: &str, target: &str) -> bool {
        let state = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        match state.triggers.get(&(probe.to_string(), target.to_string())) {
            Some(n) => {
                n.notify_one();
                true
            }
            None => false,
        }
    }

    /// Running workers and how many times each was (re)started.
    pub fn workers(&self) -> BTreeMap<WorkerKey, u64> {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .generations
            .clone()
    }
}

/// Most probes in flight at once, whatever the number of workers.
pub const MAX_CONCURRENT_PROBES: usize = 512;

/// The manager loop: reconciles workers with the probes and the pods.
#[allow(clippy::too_many_arguments)]
pub async fn run_probe_manager<P: PodConditionPort + Clone>(
    mut specs: watch::Receiver<Vec<ProbeSpec>>,
    mut pods: watch::Receiver<Option<Snapshot<Pod>>>,
    reporter: Reporter,
    pod_port: P,
    metrics: ProbeMetrics,
    handle: ProbeHandle,
    health: LoopHandle,
    stop: CancellationToken,
) {
    let shared = Arc::new(Shared {
        probers: Probers::new(),
        reporter,
        pod_port,
        metrics,
        pods: pods.clone(),
        startup: Mutex::new(HashMap::new()),
        concurrency: Semaphore::new(MAX_CONCURRENT_PROBES),
        agent_start: Instant::now(),
        respawn: Notify::new(),
    });
    let mut running: HashMap<WorkerKey, Running> = HashMap::new();
    // Workers being stopped, by key: a replacement starts only once its
    // predecessor has ended (and its stale condition is gone), so the two
    // never write at the same time.
    let mut retiring: HashMap<WorkerKey, JoinHandle<()>> = HashMap::new();
    let mut generation = 0u64;
    health.updated();
    loop {
        health.queued();
        let desired = desired_workers(
            &specs.borrow_and_update(),
            pods.borrow_and_update().as_ref(),
        );
        retiring.retain(|_, t| !t.is_finished());
        let conditions: HashSet<String> = desired
            .values()
            .filter_map(|d| match output(&d.spec) {
                Some(Output::NodeCondition(t)) => Some(t),
                _ => None,
            })
            .collect();
        // Stop removed and changed workers, and those that panicked. One
        // that ended on its own (a deleted pod's liveness probe) stays ended
        // while it is unchanged.
        let stopping: Vec<WorkerKey> = running
            .iter()
            .filter(|(key, r)| {
                let existing = Existing {
                    same: desired.get(*key) == Some(&*r.def),
                    panicked: r.panicked.load(Ordering::SeqCst),
                };
                core::reconcile(Some(existing), desired.contains_key(*key)) == Some(Step::Stop)
            })
            .map(|(key, _)| key.clone())
            .collect();
        for key in stopping {
            let Some(old) = running.remove(&key) else {
                continue;
            };
            old.stop.cancel();
            let stale = stale_condition(&old.def, &conditions);
            let shared = shared.clone();
            retiring.insert(
                key.clone(),
                tokio::spawn(async move {
                    let _ = old.task.await;
                    if let Some(t) = stale {
                        tracing::info!(probe = %key.0, condition = %t, "probe removed or its condition renamed; removing the condition");
                        shared.reporter.remove(&t);
                    }
                }),
            );
        }
        // Start new and changed ones.
        for (key, def) in desired {
            let existing = running.get(&key).map(|r| Existing {
                same: *r.def == def,
                panicked: r.panicked.load(Ordering::SeqCst),
            });
            if core::reconcile(existing, true) != Some(Step::Start) {
                continue;
            }
            generation += 1;
            let trigger = Arc::new(Notify::new());
            let stop_worker = stop.child_token();
            let panicked = Arc::new(AtomicBool::new(false));
            let def = Arc::new(def);
            let task = tokio::spawn(worker_task(
                shared.clone(),
                key.clone(),
                def.clone(),
                trigger.clone(),
                stop_worker.clone(),
                retiring.remove(&key),
                panicked.clone(),
            ));
            running.insert(
                key,
                Running {
                    def,
                    trigger,
                    stop: stop_worker,
                    task,
                    panicked,
                    generation,
                },
            );
        }
        // Not those that ended on their own or panicked (restarted later).
        shared
            .metrics
            .workers
            .set(running.values().filter(|r| !r.task.is_finished()).count() as i64);
        {
            let mut h = handle.inner.lock().unwrap_or_else(|e| e.into_inner());
            h.triggers = running
                .iter()
                .map(|(k, r)| (k.clone(), r.trigger.clone()))
                .collect();
            h.generations = running
                .iter()
                .map(|(k, r)| (k.clone(), r.generation))
                .collect();
        }
        health.updated();
        tokio::select! {
            _ = stop.cancelled() => break,
            r = specs.changed() => if r.is_err() { break },
            r = pods.changed() => if r.is_err() { break },
            _ = shared.respawn.notified() => {}
            // A periodic pass all the same (it also forgets retirements
            // that ended).
            _ = sleep(Duration::from_secs(30)) => {}
        }
    }
    for r in running.into_values() {
        r.stop.cancel();
        let _ = r.task.await;
    }
    for t in retiring.into_values() {
        let _ = t.await;
    }
}

/// A worker's task: [`run_worker`] under [`supervised`]. The worker is
/// boxed: an async fn's future keeps its argument both as given and as
/// moved into its own state, and the worker's is the bulk of the task.
#[allow(clippy::too_many_arguments)]
fn worker_task<P: PodConditionPort>(
    shared: Arc<Shared<P>>,
    key: WorkerKey,
    def: Arc<Def>,
    trigger: Arc<Notify>,
    stop: CancellationToken,
    after: Option<JoinHandle<()>>,
    panicked: Arc<AtomicBool>,
) -> impl Future<Output = ()> {
    let worker = Box::pin(run_worker(
        shared.clone(),
        key.clone(),
        def,
        trigger,
        stop.clone(),
        after,
    ));
    supervised(shared, key, panicked, stop, worker)
}

/// Runs a worker's task; when it panics: an ERROR naming the probe and its
/// target, `nodeguard_probe_worker_panics_total`, and after
/// [`PANIC_RESTART_DELAY`] the flag that has the manager restart it (a
/// worker that ends normally is not restarted).
async fn supervised<P>(
    shared: Arc<Shared<P>>,
    key: WorkerKey,
    panicked: Arc<AtomicBool>,
    stop: CancellationToken,
    worker: impl Future<Output = ()>,
) {
    use futures::FutureExt;
    let Err(panic) = std::panic::AssertUnwindSafe(worker).catch_unwind().await else {
        return;
    };
    let what = crate::server::supervisor::panic_text(panic);
    tracing::error!(probe = %key.0, target = %key.1, panic = %what, delay = ?PANIC_RESTART_DELAY, "probe worker panicked; restarting it after the delay");
    shared.metrics.panicked(&key.0);
    // What the worker would have cleaned up on its way out.
    shared.metrics.forget(&key);
    shared
        .startup
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&key);
    tokio::select! {
        _ = stop.cancelled() => return,
        _ = sleep(PANIC_RESTART_DELAY) => {}
    }
    panicked.store(true, Ordering::SeqCst);
    shared.respawn.notify_one();
}

/// The NodeCondition of a stopped worker's definition that no desired
/// worker writes any more (its probe was removed, or its `conditionType`
/// renamed): it is removed from the Node. (A pod's readiness gate is left
/// as it is: the pod asked for it and removing it would not make the pod
/// ready.)
fn stale_condition(def: &Def, desired: &HashSet<String>) -> Option<String> {
    match output(&def.spec) {
        Some(Output::NodeCondition(t)) if !desired.contains(&t) => Some(t),
        _ => None,
    }
}

fn output(spec: &ProbeSpec) -> Option<Output> {
    match (&spec.pods, &spec.condition_type, &spec.readiness_gate) {
        (None, Some(t), _) => Some(Output::NodeCondition(t.clone())),
        (Some(_), _, Some(g)) => Some(Output::ReadinessGate(g.clone())),
        _ => None,
    }
}

/// The workers that should run: node probes once, pod probes per matching
/// pod that is not terminal.
fn desired_workers(specs: &[ProbeSpec], pods: Option<&Snapshot<Pod>>) -> HashMap<WorkerKey, Def> {
    let mut out = HashMap::new();
    for spec in specs {
        match &spec.pods {
            None => {
                out.insert(
                    (spec.name.clone(), NODE.to_string()),
                    Def {
                        spec: spec.clone(),
                        pod: None,
                        uid: None,
                    },
                );
            }
            Some(target) => {
                let mut problems = Vec::new();
                let Some(selector) = Selector::parse(&target.selector, "selector", &mut problems)
                else {
                    continue;
                };
                for (key, pod) in pods.into_iter().flatten() {
                    let ns = pod.metadata.namespace.as_deref().unwrap_or_default();
                    if !target.namespaces.is_empty() && !target.namespaces.iter().any(|n| n == ns) {
                        continue;
                    }
                    let labels = pod.metadata.labels.clone().unwrap_or_default();
                    if !selector.matches(&labels) {
                        continue;
                    }
                    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
                    if !core::probes_pod(phase) {
                        continue;
                    }
                    out.insert(
                        (spec.name.clone(), key.clone()),
                        Def {
                            spec: spec.clone(),
                            pod: Some(key.clone()),
                            uid: pod.metadata.uid.clone(),
                        },
                    );
                }
            }
        }
    }
    out
}

fn role(r: ProbeRole) -> Role {
    match r {
        ProbeRole::Readiness => Role::Readiness,
        ProbeRole::Liveness => Role::Liveness,
        ProbeRole::Startup => Role::Startup,
    }
}

/// The action against a concrete target (`ip` for pod probes).
fn action(spec: &ProbeSpec, ip: Option<&str>) -> Option<Action> {
    let host = |h: &Option<String>| match ip {
        Some(ip) => ip.to_string(),
        None => h.clone().unwrap_or_else(|| "127.0.0.1".into()),
    };
    if let Some(h) = &spec.http {
        let url = match (ip, &h.url) {
            (None, Some(u)) => u.clone(),
            (Some(ip), _) => format!(
                "{}://{}{}",
                if h.scheme == HttpScheme::Https {
                    "https"
                } else {
                    "http"
                },
                join_host_port(ip, h.port.unwrap_or(80)),
                h.path.as_deref().unwrap_or("/")
            ),
            (None, None) => return None,
        };
        let status = h
            .expected_status
            .map(|r| (r.min, r.max))
            .unwrap_or((200, 399));
        return Some(Action::Http {
            url,
            headers: h
                .headers
                .iter()
                .map(|h| (h.name.clone(), h.value.clone()))
                .collect(),
            status,
            body_contains: h.body_contains.clone(),
            insecure: h.insecure_skip_tls_verify,
        });
    }
    if let Some(t) = &spec.tcp {
        return Some(Action::Tcp {
            host: host(&t.host),
            port: t.port,
        });
    }
    if let Some(g) = &spec.grpc {
        return Some(Action::Grpc {
            host: host(&g.host),
            port: g.port,
            service: g.service.clone(),
        });
    }
    spec.exec.as_ref().map(|e| Action::Exec {
        command: e.command.clone(),
    })
}

/// The target as the decision core sees it, the pod IP, and whether the
/// pod carries the worker's readiness-gate condition already.
fn view<P>(shared: &Shared<P>, key: &WorkerKey, def: &Def) -> (TargetView, Option<String>, bool) {
    let gate_open = core::gate_open(def.spec.gated_by.as_ref().map(|g| {
        shared
            .startup
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&(g.clone(), key.1.clone()))
            .copied()
    }));
    let Some(pod_key) = &def.pod else {
        return (
            TargetView {
                known: true,
                terminal: false,
                identity: Some(NODE.into()),
                running: true,
                running_for: shared.agent_start.elapsed(),
                finished_for_good: false,
                deleting: false,
                gate_open,
            },
            None,
            false,
        );
    };
    let pods = shared.pods.borrow();
    let pod = pods.as_ref().and_then(|p| p.get(pod_key));
    let gate = match output(&def.spec) {
        Some(Output::ReadinessGate(g)) => Some(g),
        _ => None,
    };
    pod_view(
        def,
        pod.map(|p| &**p),
        gate.as_deref(),
        jiff::Timestamp::now(),
        gate_open,
    )
}

/// [`view`] of a pod target, from the pod in the snapshot (`None`: not
/// there). A pod with another UID than the worker's is a different pod
/// recreated under the same name: for this worker it is gone. The
/// identity is the pod's UID, IP and container IDs, so a container the
/// kubelet restarted is a new target (it ends an on-hold).
fn pod_view(
    def: &Def,
    pod: Option<&Pod>,
    gate: Option<&str>,
    now: jiff::Timestamp,
    gate_open: bool,
) -> (TargetView, Option<String>, bool) {
    let pod = pod.filter(|p| def.uid.is_none() || p.metadata.uid == def.uid);
    let Some(pod) = pod else {
        // Gone from the node (or replaced): the worker ends.
        return (
            TargetView {
                known: true,
                terminal: true,
                identity: None,
                running: false,
                running_for: Duration::ZERO,
                finished_for_good: true,
                deleting: true,
                gate_open,
            },
            None,
            false,
        );
    };
    let status = pod.status.as_ref();
    let phase = status.and_then(|s| s.phase.as_deref()).unwrap_or("Pending");
    let ip = status.and_then(|s| s.pod_ip.clone());
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let mut containers: Vec<&str> = status
        .and_then(|s| s.container_statuses.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|c| c.container_id.as_deref())
        .filter(|id| !id.is_empty())
        .collect();
    containers.sort_unstable();
    let containers = containers.join(",");
    let running_for = status
        .and_then(|s| s.start_time.as_ref())
        .map(|t| {
            let secs = (now - t.0).get_seconds().max(0);
            Duration::from_secs(secs as u64)
        })
        .unwrap_or_default();
    let restart = pod.spec.as_ref().and_then(|s| s.restart_policy.as_deref()) != Some("Never");
    let carried = gate.is_some_and(|g| {
        status
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == g))
    });
    (
        TargetView {
            known: true,
            terminal: matches!(phase, "Succeeded" | "Failed"),
            identity: ip.as_ref().map(|ip| format!("{uid}/{ip}/{containers}")),
            running: phase == "Running",
            running_for,
            finished_for_good: phase != "Running" && phase != "Pending" && !restart,
            deleting: pod.metadata.deletion_timestamp.is_some(),
            gate_open,
        },
        ip,
        carried,
    )
}

/// One worker: probes its target on its schedule and writes what the
/// decision core says. `after` is the task of the worker it replaces (or of
/// that worker's retirement): nothing is probed or written before it ended.
async fn run_worker<P: PodConditionPort>(
    shared: Arc<Shared<P>>,
    key: WorkerKey,
    def: Arc<Def>,
    trigger: Arc<Notify>,
    stop: CancellationToken,
    after: Option<JoinHandle<()>>,
) {
    if let Some(predecessor) = after {
        // Already told to stop: it ends at its next await.
        let _ = predecessor.await;
    }
    shared.metrics.started(&key);
    let spec = &def.spec;
    let period = Duration::from_secs(spec.period_seconds.max(1).into());
    let timeout = Duration::from_secs(spec.timeout_seconds.max(1).into());
    let kind = if def.pod.is_some() {
        TargetKind::Pod
    } else {
        TargetKind::Node
    };
    let mut worker = Worker::new(
        role(spec.role),
        Thresholds {
            initial_delay: Duration::from_secs(spec.initial_delay_seconds.into()),
            success: spec.success_threshold.max(1),
            failure: spec.failure_threshold.max(1),
        },
        kind,
    );
    let jitter = core::first_delay(period, shared.agent_start.elapsed(), fastrand::f64());
    tokio::select! {
        _ = stop.cancelled() => return,
        _ = sleep(jitter) => {}
    }
    let out = output(spec);
    let sink = match &out {
        Some(Output::NodeCondition(_)) => Some(Sink::NodeCondition),
        Some(Output::ReadinessGate(_)) => Some(Sink::ReadinessGate),
        None => None,
    };
    // A fixed schedule like the kubelet's ticker: a slow probe does not
    // push the next ones back; missed ticks are skipped, not bunched.
    let mut ticker = tokio::time::interval(period);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.tick().await;
    let mut failing_since: Option<jiff::Timestamp> = None;
    let mut detail = String::new();
    loop {
        let (target, ip, carried) = view(&shared, &key, &def);
        let tick = worker.tick(&target);
        if tick == Tick::Probe
            && let Some(action) = action(spec, ip.as_deref())
        {
            // Boxed, here and for the write below: a task is as large as
            // the largest state it can wait in, and an HTTP client's or the
            // API client's request is several KiB. Inline, every worker
            // would hold that between probes too.
            let probe = Box::pin(async {
                let _permit = shared.concurrency.acquire().await;
                let started = Instant::now();
                let outcome = shared.probers.run(&action, timeout).await;
                (outcome, started.elapsed())
            });
            // A stopped worker abandons its probe at once: its successor
            // is waiting for it to end.
            let (outcome, took) = tokio::select! {
                _ = stop.cancelled() => break,
                r = probe => r,
            };
            shared.metrics.observe(&key, &outcome, took);
            match &outcome {
                Ok(o) => detail = o.detail.clone(),
                Err(e) => {
                    tracing::warn!(probe = %key.0, target = %key.1, error = %e, "prober error; result dropped")
                }
            }
            worker.record(outcome.map(|o: Outcome| o.result));
        }
        if spec.role == ProbeRole::Startup
            && let Some(r) = worker.published()
        {
            shared
                .startup
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(key.clone(), r);
        }
        if stop.is_cancelled() {
            break; // replaced or removed: the output is no longer ours
        }
        if let Some(sink) = sink
            && let Some(result) = worker.to_write(sink, carried)
        {
            if result == ProbeResult::Failure {
                failing_since.get_or_insert_with(jiff::Timestamp::now);
            } else {
                failing_since = None;
            }
            if Box::pin(publish(
                &shared,
                &key,
                &def,
                out.as_ref(),
                result,
                &detail,
                failing_since,
            ))
            .await
            {
                worker.wrote(result);
            } // else retried next tick
        }
        if tick == Tick::Stop {
            tracing::debug!(probe = %key.0, target = %key.1, "probe worker done");
            break;
        }
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = ticker.tick() => {}
            _ = trigger.notified() => {}
        }
    }
    shared.metrics.forget(&key);
    shared
        .startup
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&key);
}

/// CamelCase from a probe name: `kube-proxy` → `KubeProxy`.
pub fn camel(name: &str) -> String {
    name.split(['-', '_', '.'])
        .filter(|p| !p.is_empty())
        .map(|p| {
            let mut c = p.chars();
            match c.next() {
                Some(f) => f.to_ascii_uppercase().to_string() + c.as_str(),
                None => String::new(),
            }
        })
        .collect()
}

/// Writes a changed result; `false` when it must be retried.
async fn publish<P: PodConditionPort>(
    shared: &Shared<P>,
    key: &WorkerKey,
    def: &Def,
    out: Option<&Output>,
    result: ProbeResult,
    detail: &str,
    failing_since: Option<jiff::Timestamp>,
) -> bool {
    let spec = &def.spec;
    let what = action(spec, Some("<pod IP>").filter(|_| spec.pods.is_some()))
        .map(|a| a.describe())
        .unwrap_or_default();
    let detail = if detail.is_empty() {
        String::new()
    } else {
        format!(": {detail}")
    };
    match out {
        Some(Output::NodeCondition(t)) => {
            let name = camel(&spec.name);
            let (status, reason, message) = match result {
                ProbeResult::Failure => (
                    Status::True,
                    format!("{name}ProbeFailed"),
                    format!(
                        "Probe {} ({what}) failed {} time(s) in a row since {}{detail}. It clears when the probe passes {} time(s).",
                        spec.name,
                        spec.failure_threshold,
                        failing_since
                            .map(|t| t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string())
                            .unwrap_or_default(),
                        spec.success_threshold
                    ),
                ),
                ProbeResult::Success if spec.role == ProbeRole::Startup => (
                    Status::False,
                    format!("{name}ProbePassed"),
                    format!(
                        "Startup probe {} ({what}) passed{detail}; the probes gated by it run now, and it is not run again until the agent restarts or the probe changes.",
                        spec.name
                    ),
                ),
                ProbeResult::Success => (
                    Status::False,
                    format!("{name}ProbePassed"),
                    format!("Probe {} ({what}) passes{detail}.", spec.name),
                ),
                ProbeResult::Unknown => (
                    Status::Unknown,
                    format!("{name}ProbeUnknown"),
                    format!("Probe {} ({what}) has no verdict yet{detail}.", spec.name),
                ),
            };
            let kind = if status == Status::True {
                EventKind::Warning
            } else {
                EventKind::Normal
            };
            shared
                .reporter
                .event(kind, &reason, "Probe", message.clone());
            shared.reporter.set(
                t,
                Desired {
                    status,
                    reason,
                    message,
                },
            );
            true
        }
        Some(Output::ReadinessGate(gate)) => {
            let passing = result == ProbeResult::Success;
            let message = format!(
                "nodeguard probe {} ({what}) {}{detail}",
                spec.name,
                if passing { "passes" } else { "does not pass" }
            );
            match shared
                .pod_port
                .set_on(&key.1, def.uid.as_deref(), gate, passing, &message)
                .await
            {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(probe = %key.0, pod = %key.1, error = %e, "cannot write the readiness gate; retrying");
                    false
                }
            }
        }
        None => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn camel_names() {
        assert_eq!(camel("kube-proxy"), "KubeProxy");
        assert_eq!(camel("kubelet"), "Kubelet");
        assert_eq!(camel("dns_check.v2"), "DnsCheckV2");
    }

    fn spec(v: serde_json::Value) -> ProbeSpec {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn actions_against_node_and_pods() {
        let s = spec(serde_json::json!({"name": "web", "pods": {"selector": {}},
            "http": {"port": 8080, "path": "/ready", "scheme": "HTTPS", "headers": [{"name": "X", "value": "1"}]},
            "readinessGate": "example.com/deep"}));
        assert_eq!(
            action(&s, Some("10.1.2.3")),
            Some(Action::Http {
                url: "https://10.1.2.3:8080/ready".into(),
                headers: vec![("X".into(), "1".into())],
                status: (200, 399),
                body_contains: None,
                insecure: false,
            })
        );
        let t =
            spec(serde_json::json!({"name": "t", "tcp": {"port": 10256}, "conditionType": "X"}));
        assert_eq!(
            action(&t, None),
            Some(Action::Tcp {
                host: "127.0.0.1".into(),
                port: 10256
            })
        );
        let g = spec(
            serde_json::json!({"name": "g", "pods": {"selector": {}}, "grpc": {"port": 9000, "host": "ignored"}, "readinessGate": "x/y"}),
        );
        assert_eq!(
            action(&g, Some("fd00::1")),
            Some(Action::Grpc {
                host: "fd00::1".into(),
                port: 9000,
                service: String::new()
            })
        );
    }

    fn pod(ns: &str, name: &str, labels: serde_json::Value) -> (String, Arc<Pod>) {
        pod_in(ns, name, labels, "Running")
    }

    fn pod_in(ns: &str, name: &str, labels: serde_json::Value, phase: &str) -> (String, Arc<Pod>) {
        let p: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": ns, "name": name, "labels": labels}, "spec": {"containers": []},
            "status": {"phase": phase}
        }))
        .unwrap();
        (format!("{ns}/{name}"), Arc::new(p))
    }

    #[test]
    fn probes_see_a_trimmed_pod_as_the_whole_one() {
        let (whole, trimmed) = crate::k8s::watch::realistic_snapshots();
        let specs = vec![
            spec(
                serde_json::json!({"name": "web", "pods": {"selector": {"matchLabels": {"app": "web"}}, "namespaces": ["a", "b"]},
                "tcp": {"port": 80}, "readinessGate": "x/y"}),
            ),
            spec(
                serde_json::json!({"name": "all", "pods": {"selector": {"matchExpressions": [{"key": "tier", "operator": "DoesNotExist"}]}},
                "httpGet": {"port": 80}, "readinessGate": "x/y"}),
            ),
        ];
        let keys = |pods: &Snapshot<Pod>| {
            let mut d: Vec<(WorkerKey, Option<String>)> = desired_workers(&specs, Some(pods))
                .into_iter()
                .map(|(k, d)| (k, d.uid))
                .collect();
            d.sort();
            d
        };
        assert_eq!(keys(&trimmed), keys(&whole));
        assert!(keys(&whole).len() >= 4, "{:?}", keys(&whole));
        let now: jiff::Timestamp = "2030-01-01T00:00:30Z".parse().unwrap();
        for (key, pod) in &whole {
            for uid in [None, pod.metadata.uid.clone(), Some("other".to_string())] {
                let def = Def {
                    spec: specs[0].clone(),
                    pod: Some(key.clone()),
                    uid,
                };
                for gate in [Some("x/y"), Some("other/gate"), None] {
                    assert_eq!(
                        pod_view(&def, Some(&trimmed[key]), gate, now, true),
                        pod_view(&def, Some(pod), gate, now, true),
                        "{key}"
                    );
                }
            }
        }
    }

    #[test]
    fn desired_workers_follow_selectors_and_namespaces() {
        let specs = vec![
            spec(serde_json::json!({"name": "node", "tcp": {"port": 1}, "conditionType": "X"})),
            spec(
                serde_json::json!({"name": "web", "pods": {"selector": {"matchLabels": {"app": "web"}}, "namespaces": ["a"]},
                "tcp": {"port": 80}, "readinessGate": "x/y"}),
            ),
        ];
        let pods: Snapshot<Pod> = [
            pod("a", "w1", serde_json::json!({"app": "web"})),
            pod("b", "w2", serde_json::json!({"app": "web"})),
            pod("a", "db", serde_json::json!({"app": "db"})),
            pod_in("a", "done", serde_json::json!({"app": "web"}), "Succeeded"),
            pod_in("a", "crashed", serde_json::json!({"app": "web"}), "Failed"),
            pod_in("a", "new", serde_json::json!({"app": "web"}), "Pending"),
        ]
        .into_iter()
        .collect();
        let mut keys: Vec<WorkerKey> = desired_workers(&specs, Some(&pods)).into_keys().collect();
        keys.sort();
        assert_eq!(
            keys,
            vec![
                ("node".into(), "node".into()),
                ("web".into(), "a/new".into()),
                ("web".into(), "a/w1".into())
            ],
            "terminal pods get no workers"
        );
        assert_eq!(desired_workers(&specs, None).len(), 1);
    }

    #[test]
    fn a_stopped_workers_condition_goes_unless_another_probe_writes_it() {
        let def = |t: &str| Def {
            spec: spec(serde_json::json!({"name": "p", "tcp": {"port": 1}, "conditionType": t})),
            pod: None,
            uid: None,
        };
        let desired: HashSet<String> = ["B".to_string()].into();
        assert_eq!(stale_condition(&def("A"), &desired), Some("A".into()));
        assert_eq!(stale_condition(&def("B"), &desired), None);
        let gate = Def {
            spec: spec(
                serde_json::json!({"name": "g", "pods": {"selector": {}}, "tcp": {"port": 1}, "readinessGate": "x/y"}),
            ),
            pod: Some("a/p".into()),
            uid: None,
        };
        assert_eq!(stale_condition(&gate, &HashSet::new()), None);
    }

    fn gated_pod(uid: &str, containers: &[&str], gate: Option<&str>) -> Pod {
        let statuses: Vec<serde_json::Value> = containers
            .iter()
            .enumerate()
            .map(|(i, id)| {
                serde_json::json!({"name": format!("c{i}"), "image": "x", "imageID": "", "ready": true,
                    "restartCount": 0, "containerID": id})
            })
            .collect();
        let conditions: Vec<serde_json::Value> = gate
            .into_iter()
            .map(|g| serde_json::json!({"type": g, "status": "False"}))
            .collect();
        serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "a", "name": "p", "uid": uid},
            "spec": {"containers": []},
            "status": {"phase": "Running", "podIP": "10.0.0.1", "startTime": "2030-01-01T00:00:00Z",
                       "containerStatuses": statuses, "conditions": conditions}
        }))
        .unwrap()
    }

    fn gate_def(uid: &str) -> Def {
        Def {
            spec: spec(
                serde_json::json!({"name": "g", "pods": {"selector": {}}, "tcp": {"port": 1}, "readinessGate": "x/y"}),
            ),
            pod: Some("a/p".into()),
            uid: Some(uid.into()),
        }
    }

    #[test]
    fn a_pods_identity_has_its_container_ids_and_another_uid_is_gone() {
        let now: jiff::Timestamp = "2030-01-01T00:00:30Z".parse().unwrap();
        let def = gate_def("u1");
        let id = |pod: &Pod| pod_view(&def, Some(pod), Some("x/y"), now, true).0.identity;
        let first = id(&gated_pod(
            "u1",
            &["containerd://b", "containerd://a"],
            None,
        ));
        assert_eq!(
            first.as_deref(),
            Some("u1/10.0.0.1/containerd://a,containerd://b")
        );
        assert_eq!(
            id(&gated_pod(
                "u1",
                &["containerd://a", "containerd://b"],
                None
            )),
            first,
            "the order of the statuses does not matter"
        );
        assert_ne!(
            id(&gated_pod(
                "u1",
                &["containerd://a", "containerd://c"],
                None
            )),
            first,
            "a restarted container is a new target"
        );
        let (v, _, _) = pod_view(&def, Some(&gated_pod("u1", &[], None)), None, now, true);
        assert_eq!(v.running_for, Duration::from_secs(30));
        assert!(!v.terminal);
        // A pod recreated under the same name is not this worker's pod.
        for pod in [Some(gated_pod("u2", &[], None)), None] {
            let (v, ip, _) = pod_view(&def, pod.as_ref(), Some("x/y"), now, true);
            assert!(v.terminal && v.identity.is_none() && ip.is_none(), "{v:?}");
            let mut w = Worker::new(
                Role::Readiness,
                Thresholds {
                    initial_delay: Duration::ZERO,
                    success: 1,
                    failure: 1,
                },
                TargetKind::Pod,
            );
            assert_eq!(w.tick(&v), Tick::Stop);
            assert_eq!(
                w.to_write(Sink::ReadinessGate, false),
                None,
                "nothing written"
            );
        }
        // Whether the pod carries the gate condition already.
        let carried = |pod: &Pod| pod_view(&def, Some(pod), Some("x/y"), now, true).2;
        assert!(carried(&gated_pod("u1", &[], Some("x/y"))));
        assert!(!carried(&gated_pod("u1", &[], Some("x/other"))));
        assert!(!carried(&gated_pod("u1", &[], None)));
    }

    /// A pod-condition port whose first write panics; later writes are sent
    /// to the test.
    #[derive(Clone)]
    struct PanicsOnce {
        calls: Arc<std::sync::atomic::AtomicUsize>,
        writes: tokio::sync::mpsc::UnboundedSender<(String, Option<String>, bool)>,
    }

    impl PodConditionPort for PanicsOnce {
        async fn set(&self, pod: &str, c: &str, passing: bool, m: &str) -> Result<(), ProbeError> {
            self.set_on(pod, None, c, passing, m).await
        }

        async fn set_on(
            &self,
            pod: &str,
            uid: Option<&str>,
            _: &str,
            passing: bool,
            _: &str,
        ) -> Result<(), ProbeError> {
            if self.calls.fetch_add(1, Ordering::SeqCst) == 0 {
                panic!("injected panic in the pod-condition port");
            }
            let _ = self
                .writes
                .send((pod.to_string(), uid.map(str::to_string), passing));
            Ok(())
        }
    }

    /// A task is as large as the largest state its future can wait in. A
    /// worker spends nearly all its life waiting for its next tick; the
    /// HTTP client's and the API client's requests (several KiB) must not
    /// be part of that state, or 10,000 workers hold them all the time.
    #[tokio::test]
    async fn a_worker_task_is_small_between_probes() {
        use crate::report::{ReportConfig, Reporter};
        let client =
            kube::Client::try_from(kube::Config::new("http://127.0.0.1:9".parse().unwrap()))
                .unwrap();
        let mut registry = prometheus_client::registry::Registry::default();
        let (reporter, _queue) = Reporter::new(&ReportConfig::default(), &mut registry);
        let (_pods_tx, pods) = watch::channel(None);
        let shared = Arc::new(Shared {
            probers: Probers::new(),
            reporter,
            pod_port: crate::probe::KubePodConditions::new(client),
            metrics: ProbeMetrics::register(&mut registry),
            pods,
            startup: Mutex::new(HashMap::new()),
            concurrency: Semaphore::new(MAX_CONCURRENT_PROBES),
            agent_start: Instant::now(),
            respawn: Notify::new(),
        });
        let key = || -> WorkerKey { ("web".into(), "a/p".into()) };
        let def = Arc::new(Def {
            spec: spec(serde_json::json!({"name": "web", "pods": {"selector": {}},
                "httpGet": {"port": 80}, "readinessGate": "x/y"})),
            pod: Some("a/p".into()),
            uid: None,
        });
        let stop = CancellationToken::new();
        let trigger = Arc::new(Notify::new());
        let worker = run_worker(
            shared.clone(),
            key(),
            def.clone(),
            trigger.clone(),
            stop.clone(),
            None,
        );
        let task = worker_task(
            shared,
            key(),
            def,
            trigger,
            stop,
            None,
            Arc::new(AtomicBool::new(false)),
        );
        // The worker is boxed inside the task: together what one worker
        // holds while it waits.
        let bytes = std::mem::size_of_val(&worker) + std::mem::size_of_val(&task);
        assert!(bytes <= 1536, "a worker holds {bytes} bytes of task state");
    }

    #[tokio::test(start_paused = true)]
    async fn a_panicked_worker_is_restarted_after_a_delay() {
        use crate::report::{ReportConfig, Reporter};
        let mut registry = prometheus_client::registry::Registry::default();
        let (reporter, _queue) = Reporter::new(&ReportConfig::default(), &mut registry);
        let metrics = ProbeMetrics::register(&mut registry);
        // A readiness gate on a new pod: its initial False is written at the
        // first tick, without probing (the initial delay is long).
        let probe = spec(serde_json::json!({"name": "gate", "pods": {"selector": {}},
            "tcp": {"port": 1}, "initialDelaySeconds": 3600, "readinessGate": "x/y"}));
        let mut pod = gated_pod("u1", &["containerd://a"], None);
        pod.status.as_mut().unwrap().start_time = Some(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::now()),
        );
        let pods: Snapshot<Pod> = [("a/p".to_string(), Arc::new(pod))].into_iter().collect();
        let (_specs_tx, specs_rx) = watch::channel(vec![probe]);
        let (_pods_tx, pods_rx) = watch::channel(Some(pods));
        let (tx, mut writes) = tokio::sync::mpsc::unbounded_channel();
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let port = PanicsOnce {
            calls: calls.clone(),
            writes: tx,
        };
        let health = crate::server::Health::new();
        let handle = ProbeHandle::default();
        let stop = CancellationToken::new();
        let manager = tokio::spawn(run_probe_manager(
            specs_rx,
            pods_rx,
            reporter,
            port,
            metrics,
            handle.clone(),
            health.register("probe-manager", Duration::from_secs(60)),
            stop.clone(),
        ));
        let t0 = Instant::now();
        let write = tokio::time::timeout(Duration::from_secs(300), writes.recv())
            .await
            .expect("the panicked worker was restarted and wrote the gate");
        assert_eq!(write, Some(("a/p".into(), Some("u1".into()), false)));
        assert_eq!(calls.load(Ordering::SeqCst), 2, "one panic, one write");
        assert!(
            t0.elapsed() >= PANIC_RESTART_DELAY,
            "restarted after the delay, not at once: {:?}",
            t0.elapsed()
        );
        let key = ("gate".to_string(), "a/p".to_string());
        assert_eq!(handle.workers().get(&key), Some(&2), "a second worker");
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains("nodeguard_probe_worker_panics_total{probe=\"gate\"} 1"),
            "{text}"
        );
        stop.cancel();
        manager.await.unwrap();
    }
}
