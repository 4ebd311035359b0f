//! The shutdown capability's errors and the policy's shutdown section,
//! resolved.

use std::path::PathBuf;
use std::time::Duration;

use super::core::{self, GroupSpec, Include};
use crate::policy::{Escalation, ShutdownSpec};

#[derive(Debug, thiserror::Error)]
pub enum ShutdownError {
    #[error("D-Bus: {0}")]
    Bus(#[from] zbus::Error),
    #[error("API request failed: {0}")]
    Api(#[from] kube::Error),
    #[error("conflicting updates to {0}; gave up after retries")]
    Conflict(String),
    /// The host (systemd, logind) did not do what the handover needs.
    #[error("{0}")]
    Host(String),
    #[error("the API server throttles requests (429: {0})")]
    Throttled(String),
    #[error(transparent)]
    Taint(#[from] crate::k8s::taints::TaintError),
    #[error("cannot write the shutdown state {path}: {source}")]
    State {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the shutdown state {path} is corrupt ({message}); moved it to {aside} and started afresh"
    )]
    CorruptState {
        path: PathBuf,
        aside: PathBuf,
        message: String,
    },
    #[error("cannot write the logind drop-in {path}: {source}")]
    DropIn {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl ShutdownError {
    /// Whether a failed write may have been applied (its answer lost).
    pub fn maybe_applied(&self) -> bool {
        match self {
            ShutdownError::Taint(t) => t.maybe_applied(),
            ShutdownError::Api(e) => crate::k8s::taints::may_have_landed(e),
            _ => true,
        }
    }
}

/// The policy's shutdown section, resolved. The shutdown record keeps the
/// one a shutdown began with (`ShutdownRecord::plan`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ShutdownConfig {
    pub groups: Vec<GroupSpec>,
    pub include: Include,
    pub escalate: bool,
    pub escalate_after_percent: u8,
    pub safety_margin: Duration,
    /// `None`: never write a drop-in.
    pub drop_in_dir: Option<PathBuf>,
}

impl ShutdownConfig {
    pub fn from_spec(s: &ShutdownSpec) -> Self {
        let groups = if s.grace_period_by_priority.is_empty() {
            core::migrate(
                Duration::from_secs(s.grace_period_seconds.unwrap_or(0).into()),
                Duration::from_secs(s.critical_pods_grace_period_seconds.unwrap_or(0).into()),
            )
        } else {
            s.grace_period_by_priority
                .iter()
                .map(|g| GroupSpec {
                    priority: g.priority,
                    grace: Duration::from_secs(g.grace_period_seconds.into()),
                })
                .collect()
        };
        ShutdownConfig {
            groups: core::sorted(groups),
            include: Include {
                daemonsets: s.evict_daemon_set_pods,
                mirror: s.evict_mirror_pods,
                tolerating: s.evict_tolerating_pods,
            },
            escalate: s.escalation == Escalation::Delete,
            escalate_after_percent: s.escalate_after_percent,
            safety_margin: Duration::from_secs(s.safety_margin_seconds.into()),
            drop_in_dir: (!s.logind_drop_in_dir.is_empty())
                .then(|| PathBuf::from(&s.logind_drop_in_dir)),
        }
    }

    /// The inhibit delay this configuration needs from logind.
    pub fn needed_delay(&self) -> Duration {
        core::total_grace(&self.groups) + self.safety_margin
    }

    /// What a shutdown would get with logind's maximum delay `allowed`.
    pub fn readiness(&self, allowed: Duration) -> core::Readiness {
        core::Readiness::new(&self.groups, allowed, self.safety_margin)
    }
}
