//! Plugin rules: their commands on the monitor's interval, each verdict
//! reported.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::engine::PluginStatus;
use super::sources::SourceCounters;
use crate::command::{CommandRoot, Ran, run_command};
use crate::policy::monitors::MonitorSpec;

/// How much of a command's output is kept before `maxOutputLength` cuts it
/// (in bytes, as for exec probes).
const OUTPUT_LIMIT: usize = 1024;

/// Runs the plugin rules' commands on the monitor's interval, at most
/// `concurrency` at once, and reports each verdict.
pub(super) async fn run_plugins(
    spec: MonitorSpec,
    source: crate::policy::monitors::PluginSource,
    tx: mpsc::Sender<(usize, PluginStatus, String)>,
    counters: Arc<SourceCounters>,
    root: CommandRoot,
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
            let root = root.clone();
            tokio::spawn(async move {
                let _permit = permit;
                counters.lines.fetch_add(1, Ordering::Relaxed);
                let (status, output) = match run_command(&command, timeout, &root).await {
                    Ok(Ran::Exited(Some(0), out)) => (PluginStatus::Ok, out),
                    Ok(Ran::Exited(Some(1), out)) => (PluginStatus::Problem, out),
                    Ok(Ran::Exited(_, out)) => (PluginStatus::Unknown, out),
                    Ok(Ran::TimedOut) => (
                        PluginStatus::Unknown,
                        format!("timed out after {}s", timeout.as_secs()),
                    ),
                    Err(e) => {
                        counters.malformed.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(command = ?command, error = %e, "plugin did not run");
                        (PluginStatus::Unknown, e.to_string())
                    }
                };
                let output = crate::report::clip(&output, OUTPUT_LIMIT);
                let output: String = output.chars().take(max_output).collect();
                let _ = tx.send((i, status, output)).await;
            });
        }
    }
}
