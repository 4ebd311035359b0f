//! The two shutdown conditions, written as the decision core says.

use std::time::Duration;

use tokio::time::Instant;

use super::core;
use super::{CONDITION, Ctx, ShutdownConfig, UNAVAILABLE};
use crate::report::{Desired, EventKind, Status};

/// Both conditions while the inhibitor is held and no shutdown runs.
pub(super) fn report_armed<C>(
    ctx: &Ctx<C>,
    cfg: &ShutdownConfig,
    delay_max: Duration,
    last: Option<&core::LastShutdown>,
) {
    let readiness = cfg.readiness(delay_max);
    ctx.reporter.set(
        UNAVAILABLE,
        core::availability(&readiness, cfg.drop_in_dir.as_deref()),
    );
    report_condition(ctx, &core::Phase::Armed(readiness), last);
}

/// Writes `GracefulShutdown` as the decision core says.
pub(super) fn report_condition<C>(
    ctx: &Ctx<C>,
    phase: &core::Phase,
    last: Option<&core::LastShutdown>,
) {
    match core::condition(phase, last) {
        core::ConditionUpdate::Keep => {}
        core::ConditionUpdate::Remove => ctx.reporter.remove(CONDITION),
        core::ConditionUpdate::Set(d) => ctx.reporter.set(CONDITION, d),
        core::ConditionUpdate::Urgent(d) => {
            // Only a change is urgent.
            if !matches!(ctx.reporter.desired().get(CONDITION), Some(Some(now)) if *now == d) {
                ctx.reporter.set_urgent(CONDITION, d);
            }
        }
    }
}

pub(super) fn report_unavailable<C>(
    ctx: &Ctx<C>,
    failing_since: &mut Option<Instant>,
    reason: &str,
    message: &str,
) {
    if failing_since.is_none() {
        tracing::warn!("{message}");
        ctx.reporter
            .event(EventKind::Warning, reason, "CheckLogind", message);
        *failing_since = Some(Instant::now());
    }
    ctx.metrics.inhibitor_held.set(0);
    ctx.reporter.set(
        UNAVAILABLE,
        Desired {
            status: Status::True,
            reason: reason.into(),
            message: message.into(),
        },
    );
}
