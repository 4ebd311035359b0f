//! One task per monitor: started, restarted when its spec changes (after
//! the old task has finished); what a removed or changed monitor leaves
//! behind goes through `cleanup`.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::cleanup::{sweep_orphans, undo};
use super::run::run_monitor;
use super::{MONITOR_TIMEOUT, MonitorContext, TaintPort};
use crate::policy::monitors::MonitorSpec;
use crate::server::{Health, LoopHandle};

pub(super) struct Running {
    pub(super) spec: MonitorSpec,
    pub(super) stop: CancellationToken,
    pub(super) task: tokio::task::JoinHandle<()>,
    pub(super) handle: Arc<LoopHandle>,
}

pub(super) fn loop_name(monitor: &str) -> String {
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
pub(super) async fn supervise(
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
