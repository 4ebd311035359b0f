//! Graceful node shutdown with systemd-logind.
//!
//! While `spec.shutdown` is set, nodeguard holds a *delay* inhibitor lock
//! for `shutdown` (raising logind's `InhibitDelayMaxSec` with a drop-in when
//! the policy needs more). On `PrepareForShutdown(true)` it sets
//! `GracefulShutdown=True` and its `NoSchedule` taint at once, then
//! terminates pods by priority group, lowest first, through the Eviction
//! API (PodDisruptionBudgets honoured; a refusal is retried and, when the
//! group's window is running out, escalated to a delete with the remaining
//! grace and an Event naming the PDB). The decision core plans the group
//! windows within logind's limit (the highest-priority groups keep their
//! time, the lowest are shortened first) and steps each pod; every API call
//! ends with its group's window, and the inhibitor is released after the
//! last group or at the plan's end, whatever the API does. On
//! `PrepareForShutdown(false)` it applies the policy as it is now, takes the
//! lock again (unless the policy turned shutdown off meanwhile) and removes
//! its own taint. A state file lets a restarted agent resume, and the first
//! start after a reboot clean up and report.

//!
//! The rooms: `core` (every decision, no I/O), `manager` (the lifecycle:
//! start-up, the armed loop, a cancel), `arm` (logind's delay and the
//! lock), `startup` (what logind says at start and while going down),
//! `execute` (one shutdown: plan, groups, release), `taint` (the taint's
//! whole life), `conditions` (the two conditions), `stop` (a stop's
//! question), `state` (the record on disk), `keep` (the lock's keeper),
//! and one adapter per peer: `logind` (D-Bus) and `cluster` (the API
//! server), each behind its port here ([`LogindPort`], [`LogindConnector`],
//! [`ClusterPort`]). `config` and `metrics` hold the resolved policy and the
//! `nodeguard_shutdown_*` metrics.

mod arm;
pub mod cluster;
mod conditions;
mod config;
pub mod core;
mod execute;
pub mod holder;
pub mod keep;
pub mod logind;
mod manager;
mod metrics;
mod startup;
pub mod state;
mod stop;
mod taint;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use tokio::sync::{mpsc, watch};

use crate::clock::WallClock;
use crate::k8s::watch::Snapshot;
use crate::report::Reporter;
use crate::state_dir::StateWrites;
use cluster::Evicted;
use keep::Keeper;
use logind::{InhibitLock, LogindEvent};
use state::ShutdownRecord;

pub use config::{ShutdownConfig, ShutdownError};
pub use manager::{ShutdownHost, run_shutdown_manager};
pub use metrics::ShutdownMetrics;
pub use stop::{StopCheck, StopQuestions, stop_check};

/// True while a shutdown is in progress.
pub const CONDITION: &str = "GracefulShutdown";
/// True while nodeguard cannot guarantee a graceful shutdown.
pub const UNAVAILABLE: &str = "GracefulShutdownUnavailable";

/// Everything the running pieces share.
struct Ctx<C> {
    cluster: C,
    reporter: Reporter,
    metrics: ShutdownMetrics,
    state_dir: PathBuf,
    state_writes: StateWrites,
    boot_id: String,
    node_name: String,
    clock: WallClock,
    pods: watch::Receiver<Option<Snapshot<Pod>>>,
    in_progress: watch::Sender<bool>,
    keeper: Keeper,
    handover: Handover,
    /// nodeguard's shutdown taint is still on the Node after a cancel or a
    /// reboot (the API server did not take its removal in time): retried
    /// in the background every [`taint::TAINT_CLEANUP_EVERY`] until it goes, and
    /// forgotten the moment a new shutdown begins.
    taint_left: std::sync::atomic::AtomicBool,
    /// Held by each background removal attempt, and taken by a new
    /// shutdown before its taint request, so an attempt in flight never
    /// removes the new shutdown's taint.
    taint_cleanup: tokio::sync::Mutex<()>,
    /// Whether the handover unit's copy of this binary is in the state
    /// directory (`None`: being copied, in the background from the start,
    /// [`holder::install`]).
    holder_ready: std::sync::Arc<watch::Sender<Option<bool>>>,
}

/// Handing the delay inhibitor over between two pods of the agent (a
/// rollout replaces the pod, keeper and all): `life` is the longest the
/// handover unit holds it when no agent takes it (`None`: no handover, the
/// host service's default; a keeper holds a copy only during a shutdown);
/// `retiring` is set when the agent goes away for good (an uninstall), so
/// nothing is handed over then. With `host_state_dir` (where the state
/// directory is on the host), the unit runs this binary, copied there
/// ([`holder`]), which records a shutdown that begins before the next agent
/// takes over; otherwise, or when that fails, the host's `systemd-inhibit`.
#[derive(Clone, Debug, Default)]
pub struct Handover {
    pub life: Option<Duration>,
    pub retiring: std::sync::Arc<std::sync::atomic::AtomicBool>,
    pub host_state_dir: Option<PathBuf>,
    /// The binary copied for the unit (`None`: this process's own).
    pub holder_source: Option<PathBuf>,
}

impl Handover {
    /// Hand over on this stop.
    fn wanted(&self) -> Option<Duration> {
        self.life
            .filter(|_| !self.retiring.load(std::sync::atomic::Ordering::SeqCst))
    }
}

/// Port: what shutdown does to the cluster.
pub trait ClusterPort: Send + Sync + 'static {
    /// Adds the shutdown taint; `true` when nodeguard added it, `false`
    /// when it was already there (then nodeguard must not remove it).
    fn add_taint(&self) -> impl Future<Output = Result<bool, ShutdownError>> + Send;
    fn remove_taint(&self) -> impl Future<Output = Result<(), ShutdownError>> + Send;
    /// Removes the shutdown taint only when it carries nodeguard's own
    /// value ([`core::TAINT_VALUE`]): one left by a shutdown nodeguard could not
    /// record. `true` when one was removed.
    fn remove_left_taint(&self) -> impl Future<Output = Result<bool, ShutdownError>> + Send;
    fn evict(
        &self,
        key: &str,
        grace: i64,
    ) -> impl Future<Output = Result<Evicted, ShutdownError>> + Send;
    fn delete(
        &self,
        key: &str,
        grace: i64,
    ) -> impl Future<Output = Result<(), ShutdownError>> + Send;
}

/// What the handover unit runs when it is nodeguard's holder
/// ([`holder::command`]): the program and its argv (argv[0] first), and the
/// state directory it may write, as the host sees them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HolderCommand {
    pub binary: PathBuf,
    pub argv: Vec<String>,
    pub state_dir: PathBuf,
}

/// Port: logind as the shutdown manager needs it.
pub trait LogindPort: Send + Sync + 'static {
    fn inhibit_delay_max(&self) -> impl Future<Output = Result<Duration, ShutdownError>> + Send;
    fn inhibit(&self, why: &str)
    -> impl Future<Output = Result<InhibitLock, ShutdownError>> + Send;
    /// Makes logind re-read its configuration.
    fn reload(&self) -> impl Future<Output = Result<(), ShutdownError>> + Send;
    /// `PreparingForShutdown`: a shutdown is under way (between
    /// `PrepareForShutdown(true)` and the machine going down or a cancel).
    fn preparing_for_shutdown(&self) -> impl Future<Output = Result<bool, ShutdownError>> + Send;
    /// Leaves a delay inhibitor with a host unit that outlives this pod
    /// (for at most `life`), for the next pod's agent to take over; returns
    /// once logind lists it, within `within`. The unit runs `holder` when
    /// given and it holds the lock, otherwise the host's `systemd-inhibit`.
    fn hand_over(
        &self,
        why: &str,
        life: Duration,
        holder: Option<HolderCommand>,
        within: Duration,
    ) -> impl Future<Output = Result<(), ShutdownError>> + Send;
    /// The inhibitor a previous pod handed over, if logind lists it: a lock
    /// whose release stops the handover unit.
    fn take_handover(
        &self,
    ) -> impl Future<Output = Result<Option<InhibitLock>, ShutdownError>> + Send;
    /// Events from now on; the channel closes after [`LogindEvent::Gone`].
    fn events(
        &self,
    ) -> impl Future<Output = Result<mpsc::Receiver<LogindEvent>, ShutdownError>> + Send;
}

/// Port: makes a fresh connection (after logind or the bus went away).
pub trait LogindConnector: Send + Sync + 'static {
    type Port: LogindPort;
    fn connect(&self) -> impl Future<Output = Result<Self::Port, ShutdownError>> + Send;
}

/// How long one API call outside a shutdown's windows may take: removing
/// the taint after a cancel or a reboot. (Calls during a shutdown end with
/// their group's window.)
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

fn save<C>(ctx: &Ctx<C>, record: &ShutdownRecord) {
    state::save(&ctx.state_writes, &ctx.state_dir, record);
}

/// Path of the shutdown state file in `dir` (for tests and docs).
pub fn state_file(dir: &Path) -> PathBuf {
    dir.join(state::FILE_NAME)
}

#[cfg(test)]
mod tests;
