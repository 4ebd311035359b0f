//! What the engine decided, applied: conditions, Events and taints.

use std::collections::BTreeMap;
use std::time::Duration;

use super::engine::{Action, Engine, TaintOutcome};
use super::{MonitorContext, TaintPort};
use crate::report::{Desired, EventKind, Status};
use crate::server::LoopHandle;
use crate::server::backoff::Backoff;

/// How a monitor speaks: its conditions' no-problem reasons (an Event of
/// one is a clear, not a problem) and the source component of its Events.
pub(super) struct Voice {
    pub(super) defaults: BTreeMap<String, String>,
    /// `eventSource` (NPD's `source` of an imported config); `None`: the
    /// agent's own.
    pub(super) source: Option<String>,
}

/// `blind`: the monitor cannot read its source (why); a condition that
/// would be written False (no problem seen) is written Unknown with reason
/// `MonitorSourceUnavailable` and this message instead.
pub(super) async fn apply<T: TaintPort>(
    actions: &[Action],
    engine: &mut Engine,
    ctx: &MonitorContext<T>,
    handle: &LoopHandle,
    voice: &Voice,
    blind: Option<&str>,
) {
    for a in actions {
        match a {
            Action::Event { reason, message } => {
                let clearing = voice.defaults.values().any(|d| d == reason);
                if !clearing {
                    ctx.metrics.problem(reason);
                }
                let kind = if clearing {
                    EventKind::Normal
                } else {
                    EventKind::Warning
                };
                ctx.reporter.event_from(
                    voice.source.as_deref(),
                    kind,
                    reason,
                    "DetectProblem",
                    message.clone(),
                );
            }
            Action::Condition {
                type_,
                active,
                reason,
                message,
            } => {
                ctx.metrics.set_active(type_, reason, *active);
                let desired = match (active, blind) {
                    (true, _) => Desired {
                        status: Status::True,
                        reason: reason.clone(),
                        message: message.clone(),
                    },
                    (false, Some(why)) => Desired {
                        status: Status::Unknown,
                        reason: "MonitorSourceUnavailable".into(),
                        message: why.to_string(),
                    },
                    (false, None) => Desired {
                        status: Status::False,
                        reason: reason.clone(),
                        message: message.clone(),
                    },
                };
                ctx.reporter.set(type_, desired);
            }
            Action::Unknown {
                type_,
                reason,
                message,
            } => {
                ctx.metrics.set_active(type_, reason, false);
                ctx.reporter.set(
                    type_,
                    Desired {
                        status: Status::Unknown,
                        reason: reason.clone(),
                        message: message.clone(),
                    },
                );
            }
            Action::Taint {
                condition,
                key,
                value,
                effect,
                add,
            } => {
                // 0.2 s doubling: the fifth wait is 3.2 s.
                let mut backoff =
                    Backoff::new(Duration::from_millis(200), Duration::from_millis(3200));
                let mut outcome = TaintOutcome::Failed;
                let mut maybe_applied = false;
                for attempt in 1..=5 {
                    let r = if *add {
                        ctx.taints.add(key, value, effect).await.map(|added| {
                            if added {
                                TaintOutcome::Added
                            } else {
                                TaintOutcome::AlreadyPresent
                            }
                        })
                    } else {
                        ctx.taints
                            .remove(key, effect)
                            .await
                            .map(|()| TaintOutcome::Removed)
                    };
                    match r {
                        // An earlier attempt may have been applied with its
                        // answer lost: the taint found now is nodeguard's.
                        Ok(TaintOutcome::AlreadyPresent) if maybe_applied => {
                            outcome = TaintOutcome::Added;
                            break;
                        }
                        Ok(o) => {
                            outcome = o;
                            break;
                        }
                        Err(e) => {
                            maybe_applied |= *add && e.maybe_applied();
                            tracing::warn!(taint = %key, add, attempt, error = %e, "taint update failed");
                            // Waiting on the API is not being stuck.
                            handle.updated();
                            tokio::time::sleep(backoff.next_delay()).await;
                            handle.queued();
                        }
                    }
                }
                if outcome == TaintOutcome::Failed && maybe_applied {
                    engine.taint_maybe_added(condition);
                }
                engine.taint_result(condition, outcome);
                // One taint edit done: the next is a span of its own (each
                // call may wait out a shedding API server).
                handle.updated();
                handle.queued();
                let owned = engine.state().get(condition).is_some_and(|s| s.taint_added);
                if *add && outcome == TaintOutcome::AlreadyPresent && !owned {
                    tracing::info!(taint = %key, condition = %condition, "the taint was there already; nodeguard will not remove it");
                }
            }
        }
    }
}
