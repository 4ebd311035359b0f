//! The probe manager: one lightweight task per (probe, target), started,
//! restarted and stopped as policies and pods change; unchanged workers are
//! left alone. Results go to NodeConditions (node probes) or pod
//! readiness-gate conditions (pod probes).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use tokio::sync::{Notify, Semaphore, watch};
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep};
use tokio_util::sync::CancellationToken;

use super::core::{
    self, ProbeResult, Role, Sink, Step, TargetKind, TargetView, Thresholds, Tick, Worker,
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
    fn set(
        &self,
        pod: &str,
        condition: &str,
        passing: bool,
        message: &str,
    ) -> impl Future<Output = Result<(), ProbeError>> + Send;
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
    def: Def,
    trigger: Arc<Notify>,
    stop: CancellationToken,
    task: JoinHandle<()>,
    /// Increments each time a worker for this key is (re)started.
    generation: u64,
}

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
        // Stop removed and changed workers. One that ended on its own (a
        // deleted pod's liveness probe) stays ended while it is unchanged.
        let stopping: Vec<WorkerKey> = running
            .iter()
            .filter(|(key, r)| {
                let same = desired.get(*key) == Some(&r.def);
                core::reconcile(Some(same), desired.contains_key(*key)) == Some(Step::Stop)
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
            if core::reconcile(running.get(&key).map(|r| r.def == def), true) != Some(Step::Start) {
                continue;
            }
            generation += 1;
            let trigger = Arc::new(Notify::new());
            let stop_worker = stop.child_token();
            let task = tokio::spawn(run_worker(
                shared.clone(),
                key.clone(),
                def.clone(),
                trigger.clone(),
                stop_worker.clone(),
                retiring.remove(&key),
            ));
            running.insert(
                key,
                Running {
                    def,
                    trigger,
                    stop: stop_worker,
                    task,
                    generation,
                },
            );
        }
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

/// The target as the decision core sees it, plus the pod IP.
fn view<P>(shared: &Shared<P>, key: &WorkerKey, def: &Def) -> (TargetView, Option<String>) {
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
        );
    };
    let pods = shared.pods.borrow();
    let Some(pod) = pods.as_ref().and_then(|p| p.get(pod_key)) else {
        // Gone from the node: the worker ends.
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
        );
    };
    let status = pod.status.as_ref();
    let phase = status.and_then(|s| s.phase.as_deref()).unwrap_or("Pending");
    let ip = status.and_then(|s| s.pod_ip.clone());
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let running_for = status
        .and_then(|s| s.start_time.as_ref())
        .map(|t| {
            let secs = (jiff::Timestamp::now() - t.0).get_seconds().max(0);
            Duration::from_secs(secs as u64)
        })
        .unwrap_or_default();
    let restart = pod.spec.as_ref().and_then(|s| s.restart_policy.as_deref()) != Some("Never");
    (
        TargetView {
            known: true,
            terminal: matches!(phase, "Succeeded" | "Failed"),
            identity: ip.as_ref().map(|ip| format!("{uid}/{ip}")),
            running: phase == "Running",
            running_for,
            finished_for_good: phase != "Running" && phase != "Pending" && !restart,
            deleting: pod.metadata.deletion_timestamp.is_some(),
            gate_open,
        },
        ip,
    )
}

/// One worker: probes its target on its schedule and writes what the
/// decision core says. `after` is the task of the worker it replaces (or of
/// that worker's retirement): nothing is probed or written before it ended.
async fn run_worker<P: PodConditionPort>(
    shared: Arc<Shared<P>>,
    key: WorkerKey,
    def: Def,
    trigger: Arc<Notify>,
    stop: CancellationToken,
    after: Option<JoinHandle<()>>,
) {
    if let Some(predecessor) = after {
        // Already told to stop: it ends at its next await.
        let _ = predecessor.await;
    }
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
        let (target, ip) = view(&shared, &key, &def);
        let tick = worker.tick(&target);
        if tick == Tick::Probe
            && let Some(action) = action(spec, ip.as_deref())
        {
            let probe = async {
                let _permit = shared.concurrency.acquire().await;
                let started = Instant::now();
                let outcome = shared.probers.run(&action, timeout).await;
                (outcome, started.elapsed())
            };
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
            && let Some(result) = worker.to_write(sink)
        {
            if result == ProbeResult::Failure {
                failing_since.get_or_insert_with(jiff::Timestamp::now);
            } else {
                failing_since = None;
            }
            if publish(
                &shared,
                &key,
                spec,
                out.as_ref(),
                result,
                &detail,
                failing_since,
            )
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
    spec: &ProbeSpec,
    out: Option<&Output>,
    result: ProbeResult,
    detail: &str,
    failing_since: Option<jiff::Timestamp>,
) -> bool {
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
            match shared.pod_port.set(&key.1, gate, passing, &message).await {
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
}
