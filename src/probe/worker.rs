//! One worker's task: it probes its target on its schedule, feeds the
//! decision core and writes what the core says (through `publish`); a
//! worker that panics is reported and handed back to the manager for a
//! restart.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use tokio::sync::{Notify, Semaphore, watch};
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep};
use tokio_util::sync::CancellationToken;

use super::core::{self, ProbeResult, Sink, TargetKind, TargetView, Thresholds, Tick, Worker};
use super::prober::{Outcome, Probers};
use super::publish::{Verdict, publish};
use super::targets::{Def, NODE, Output, WorkerKey, action, output, pod_view, role};
use super::{PodConditionPort, ProbeMetrics};
use crate::k8s::watch::Snapshot;
use crate::policy::probes::ProbeRole;
use crate::report::Reporter;

/// How long a panicked worker stays down before the manager restarts it,
/// so one that panics at once again does not spin.
pub const PANIC_RESTART_DELAY: Duration = Duration::from_secs(10);

/// Shared by every worker.
pub(super) struct Shared<P> {
    pub(super) probers: Probers,
    pub(super) reporter: Reporter,
    pub(super) pod_port: P,
    pub(super) metrics: ProbeMetrics,
    pub(super) pods: watch::Receiver<Option<Snapshot<Pod>>>,
    /// Published results of Startup probes, for gating.
    pub(super) startup: Mutex<HashMap<WorkerKey, ProbeResult>>,
    pub(super) concurrency: Semaphore,
    pub(super) agent_start: Instant,
    /// Wakes the manager when a panicked worker is due for a restart.
    pub(super) respawn: Notify,
}

/// A worker's task: [`run_worker`] under [`supervised`]. The worker is
/// boxed: an async fn's future keeps its argument both as given and as
/// moved into its own state, and the worker's is the bulk of the task.
#[allow(clippy::too_many_arguments)]
pub(super) fn worker_task<P: PodConditionPort>(
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

/// One worker: probes its target on its schedule and writes what the
/// decision core says. `after` is the task of the worker it replaces (or of
/// that worker's retirement): nothing is probed or written before it ended.
pub(super) async fn run_worker<P: PodConditionPort>(
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
                &shared.reporter,
                &shared.pod_port,
                &key,
                &def,
                out.as_ref(),
                Verdict {
                    result,
                    detail: &detail,
                    failing_since,
                },
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
