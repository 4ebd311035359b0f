//! Probe workers with the kubelet prober's semantics, against node-local
//! endpoints (results as NodeConditions) and pods on this node (results as
//! readiness-gate pod conditions).
//!
//! - [`core`]: the per-worker decision core (thresholds, initial delay,
//!   on-hold, startup gating).
//! - [`targets`]: which workers should run and what each one probes.
//! - [`manager`]: the reconciler that keeps one task per (probe, target).
//! - `worker`: one worker's task; `publish` writes its results.
//! - [`prober`]: the HTTP/TCP/gRPC/exec clients.
//! - [`kube`]: the pods/status adapter ([`KubePodConditions`]).
//! - `metrics`: the `nodeguard_probe_*` series.

pub mod core;
pub mod kube;
pub mod manager;
mod metrics;
pub mod prober;
mod publish;
pub mod targets;
mod worker;

use std::future::Future;

pub use kube::{KubePodConditions, gate_manager};
pub use manager::{ProbeHandle, run_probe_manager};
pub use metrics::ProbeMetrics;

#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("API request failed: {0}")]
    Api(#[from] ::kube::Error),
}

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

#[cfg(test)]
mod tests;
