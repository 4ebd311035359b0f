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

mod apply;
mod cleanup;
pub mod engine;
pub mod kmsg;
pub mod kube;
mod metrics;
pub mod npd_metrics;
mod plugin;
pub mod replay;
mod run;
pub mod sources;
mod state;
mod systemd;
mod tasks;

use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use crate::report::Reporter;
use crate::server::Health;
use crate::state_dir::StateWrites;
pub use metrics::MonitorMetrics;
pub use state::{MonitorState, same_boot, saved_states, state_path};
pub use tasks::run_monitors;

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
    /// Where plugin monitors' commands run (`--command-root`).
    pub command_root: crate::command::CommandRoot,
}

#[cfg(test)]
mod tests {
    use super::run::run_monitor;
    use super::state::{load_state, save_state};
    use super::tasks::loop_name;
    use super::*;
    use crate::policy::monitors::MonitorSpec;
    use crate::server::LoopHandle;
    use prometheus_client::registry::Registry;
    use std::path::Path;
    use std::sync::Arc;
    use std::sync::atomic::Ordering;
    use std::sync::atomic::{AtomicBool, AtomicU32};
    use tokio_util::sync::CancellationToken;

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
            command_root: Default::default(),
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

    /// Lines that match nothing move only the monitor's position: it is
    /// saved within CURSOR_SAVE, not written every second (a crash reads
    /// those lines again and they match nothing again); a line that
    /// matches is saved within a second.
    #[tokio::test(start_paused = true)]
    async fn a_position_alone_is_saved_within_half_a_minute_a_match_within_a_second() {
        let dir = scratch("cursor-save");
        let (spec, ctx, handle) = clearable(&dir, Arc::new(Flaky::default()));
        let stop = CancellationToken::new();
        let task = tokio::spawn(run_monitor(spec, ctx, handle, stop.clone()));
        let append = |line: &str| {
            let mut f = std::fs::OpenOptions::new()
                .append(true)
                .open(dir.join("app.log"))
                .unwrap();
            std::io::Write::write_all(&mut f, line.as_bytes()).unwrap();
            // The reader is a real thread: let it hand the line over
            // before paused time moves on.
            std::thread::sleep(Duration::from_millis(500));
        };
        let cursor = || load_state(&dir, "m").map(|(s, _)| s.cursor);
        tokio::time::sleep(Duration::from_secs(2)).await;
        let at_start = cursor();
        append("nothing to see\n");
        tokio::time::sleep(Duration::from_secs(5)).await;
        let after_5s = cursor();
        tokio::time::sleep(Duration::from_secs(30)).await;
        let after_35s = cursor();
        append("app crashed again\n");
        tokio::time::sleep(Duration::from_secs(2)).await;
        let after_match = cursor();
        stop.cancel();
        let _ = task.await;
        let _ = std::fs::remove_dir_all(&dir);
        assert!(at_start.is_some());
        assert_eq!(after_5s, at_start, "a position alone is not saved at once");
        assert_ne!(after_35s, at_start, "a position alone is saved in the end");
        assert_ne!(after_match, after_35s, "a match is saved within a second");
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
