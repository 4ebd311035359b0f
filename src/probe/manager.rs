//! The probe manager: one lightweight task per (probe, target), started,
//! restarted and stopped as policies and pods change; unchanged workers are
//! left alone. Which workers should run is `targets`' decision; what one
//! does is `worker`'s.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use tokio::sync::{Notify, Semaphore, watch};
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep};
use tokio_util::sync::CancellationToken;

use super::core::{self, Existing, Step};
use super::prober::Probers;
use super::targets::{Def, Output, WorkerKey, desired_workers, output, stale_condition};
use super::worker::{Shared, worker_task};
use super::{PodConditionPort, ProbeMetrics};
use crate::k8s::watch::Snapshot;
use crate::policy::probes::ProbeSpec;
use crate::report::Reporter;
use crate::server::LoopHandle;

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
    command_root: crate::command::CommandRoot,
    stop: CancellationToken,
) {
    let shared = Arc::new(Shared {
        probers: Probers::new().with_command_root(command_root),
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
