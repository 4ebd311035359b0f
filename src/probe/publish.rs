//! A changed result, written where the probe's results go: a
//! NodeCondition with its Event (node probes), or the pod's readiness-gate
//! condition (pod probes).

use super::PodConditionPort;
use super::core::ProbeResult;
use super::targets::{Def, Output, WorkerKey, action};
use crate::policy::probes::ProbeRole;
use crate::report::{Desired, EventKind, Reporter, Status};

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

/// A result to write, with what the last probe said and since when the
/// probe fails (`None` while it passes).
pub(super) struct Verdict<'a> {
    pub(super) result: ProbeResult,
    pub(super) detail: &'a str,
    pub(super) failing_since: Option<jiff::Timestamp>,
}

/// Writes a changed result; `false` when it must be retried.
pub(super) async fn publish<P: PodConditionPort>(
    reporter: &Reporter,
    pod_port: &P,
    key: &WorkerKey,
    def: &Def,
    out: Option<&Output>,
    verdict: Verdict<'_>,
) -> bool {
    let Verdict {
        result,
        detail,
        failing_since,
    } = verdict;
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
            reporter.event(kind, &reason, "Probe", message.clone());
            reporter.set(
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
            match pod_port
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
