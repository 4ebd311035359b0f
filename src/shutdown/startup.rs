//! What the manager asks logind at start-up, after logind left the bus
//! during a shutdown, and while the host should be going down: resume this
//! boot's shutdown, report the one before the reboot, undo one cancelled
//! while the agent was away or forgotten by a restarted logind.

use std::time::Duration;

use tokio::time::{sleep, timeout};
use tokio_util::sync::CancellationToken;

use super::ClusterPort;
use super::cluster::{self};
use super::conditions::report_condition;
use super::core;
use super::state::{self, OnStart, ShutdownRecord};
use super::taint::{report_taint_removed, undo_taint};
use super::{CALL_TIMEOUT, Ctx, ShutdownError};
use super::{LogindConnector, LogindPort};
use crate::report::EventKind;

/// At start-up: resume an unfinished shutdown of this boot, or clean up
/// after the reboot that followed one. Returns the record to resume and
/// the last shutdown to report.
/// The record to resume, the last shutdown to report, and — when this
/// boot's shutdown is done and the host going down — whether nodeguard
/// added the taint.
pub(super) async fn start_up<C: ClusterPort, L: LogindConnector>(
    ctx: &Ctx<C>,
    logind: &L,
) -> (
    Option<ShutdownRecord>,
    Option<core::LastShutdown>,
    Option<bool>,
) {
    let record = match state::load(&ctx.state_dir) {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(error = %e, "shutdown state unreadable");
            ctx.reporter.event(
                EventKind::Warning,
                "ShutdownStateCorrupt",
                "LoadState",
                e.to_string(),
            );
            None
        }
    };
    // A record of this boot: only logind knows whether the host is still
    // going down (a restart during or after the shutdown) or not (it was
    // cancelled while the agent was away).
    let this_boot = record
        .as_ref()
        .is_some_and(|r| r.boot_id == ctx.boot_id && r.started_at.is_some());
    let preparing = if this_boot {
        preparing_for_shutdown(logind).await
    } else {
        None
    };
    match state::on_start(record.as_ref(), &ctx.boot_id, preparing) {
        OnStart::Nothing if record.is_none() => {
            remove_unrecorded_taint(ctx, logind).await;
            (None, None, None)
        }
        OnStart::Nothing => (None, None, None),
        OnStart::Resume => (record, None, None),
        OnStart::GoingDown => {
            tracing::info!(
                "restarted after this boot's shutdown was done; the host is going down: the taint and the record stay for the next boot"
            );
            if let Some(r) = record.as_ref().filter(|r| !r.announced) {
                // Killed after its end was recorded and before its start's
                // Event was stored (a slow API server retrying it): said
                // now, or the node never shows the shutdown began.
                drop(super::execute::say_started(
                    &ctx.reporter,
                    super::execute::Start::late(r),
                ));
            }
            let taint_added = record.is_some_and(|r| r.taint_ours());
            (None, None, Some(taint_added))
        }
        OnStart::CancelledMeanwhile { taint_added } => (
            None,
            Some(cancelled_meanwhile(ctx, taint_added, core::CancelCause::Logind).await),
            None,
        ),
        OnStart::AfterReboot { took, taint_added } => {
            let taint = undo_taint(ctx, taint_added).await;
            // A start found under way makes the duration a lower bound:
            // not exported as the shutdown's duration.
            let found = record
                .as_ref()
                .is_some_and(|r| r.started_by == state::StartedBy::Found);
            if let Some(d) = took.filter(|_| !found) {
                ctx.metrics.last_duration.set(d.as_secs_f64());
            }
            let started_at = record
                .as_ref()
                .and_then(|r| r.started_at)
                .map(|t| t.to_string())
                .unwrap_or_default();
            let message = core::rebooted_message(&started_at, found, took, taint);
            tracing::info!("{message}");
            ctx.reporter.event(
                EventKind::Normal,
                "NodeRebooted",
                "CompleteShutdown",
                message,
            );
            let last = core::LastShutdown::Rebooted {
                started_at,
                found,
                took,
                taint,
            };
            report_condition(ctx, &core::Phase::Waiting, Some(&last));
            state::clear(&ctx.state_writes, &ctx.state_dir);
            (None, Some(last), None)
        }
    }
}

/// No shutdown on record, but the Node may carry nodeguard's own shutdown
/// taint (`nodeguard.io/shutdown=shutting-down`): one a shutdown added
/// while the state directory was full or read-only, so no record said it
/// was nodeguard's. While logind prepares for no shutdown it is removed
/// (a taint of that key with another value is someone else's and stays).
pub(super) async fn remove_unrecorded_taint<C: ClusterPort, L: LogindConnector>(
    ctx: &Ctx<C>,
    logind: &L,
) {
    // A taint a previous process could not remove is removed in the
    // background already (and said once, by that path).
    if ctx.taint_left.load(std::sync::atomic::Ordering::SeqCst) {
        return;
    }
    // Quietly: a node whose policy wants no graceful shutdown may have no
    // system bus mounted.
    match ask_logind(logind).await {
        Ok((_, false)) => {}
        Ok((_, true)) => return,
        Err(why) => {
            tracing::debug!(
                "cannot ask logind whether a shutdown taint left without a record may go: {why}"
            );
            return;
        }
    }
    match timeout(CALL_TIMEOUT, ctx.cluster.remove_left_taint()).await {
        Ok(Ok(true)) => report_taint_removed(
            ctx,
            format!(
                "nodeguard removed its shutdown taint {}={}, which a shutdown left with no record of it (the state directory could not be written then).",
                cluster::TAINT_KEY,
                cluster::TAINT_VALUE
            ),
        ),
        Ok(Ok(false)) => {}
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "cannot look for a shutdown taint left without a record")
        }
        Err(_) => tracing::warn!(
            "the API server did not answer the look for a shutdown taint left without a record"
        ),
    }
}

/// How often an agent that found its shutdown done on a host going down
/// asks logind whether that is still so.
const GOING_DOWN_POLL: Duration = Duration::from_secs(5);

/// logind's `PreparingForShutdown` (`None`: logind unreachable or slow).
pub(super) async fn preparing_for_shutdown<L: LogindConnector>(logind: &L) -> Option<bool> {
    match ask_logind(logind).await {
        Ok((_, p)) => Some(p),
        Err(why) => {
            tracing::warn!("cannot ask logind whether the host is shutting down: {why}");
            None
        }
    }
}

/// On a connection already made: logind says, within `CALL_TIMEOUT`, that
/// a shutdown is under way (`false` also when it does not answer).
pub(super) async fn shutdown_under_way<P: LogindPort>(port: &P) -> bool {
    matches!(
        timeout(CALL_TIMEOUT, port.preparing_for_shutdown()).await,
        Ok(Ok(true))
    )
}

/// A new connection to logind and its `PreparingForShutdown`, within
/// `CALL_TIMEOUT`.
async fn ask_logind<L: LogindConnector>(logind: &L) -> Result<(L::Port, bool), String> {
    let ask = async {
        let port = logind.connect().await?;
        let preparing = port.preparing_for_shutdown().await?;
        Ok::<_, ShutdownError>((port, preparing))
    };
    match tokio::time::timeout(CALL_TIMEOUT, ask).await {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer within {CALL_TIMEOUT:?}")),
    }
}

/// The shutdown's groups are done and the host should be going down:
/// polls logind until it says it is not (a failed or cancelled shutdown
/// job, a restarted logind), then undoes the shutdown as after a cancel.
/// `None` when the agent stops first (the machine going down stops it).
pub(super) async fn watch_going_down<L: LogindConnector, C: ClusterPort>(
    ctx: &Ctx<C>,
    logind: &L,
    stop: &CancellationToken,
    taint_added: bool,
    cause: core::CancelCause,
) -> Option<core::LastShutdown> {
    loop {
        tokio::select! {
            _ = stop.cancelled() => return None,
            _ = sleep(GOING_DOWN_POLL) => {}
        }
        if preparing_for_shutdown(logind).await == Some(false) {
            return Some(cancelled_meanwhile(ctx, taint_added, cause).await);
        }
    }
}

/// Undoes a shutdown of this boot that logind no longer prepares for (it
/// was cancelled while the agent was not running, or failed): nodeguard's
/// taint, the record, a `ShutdownCancelled` report. The inhibitor is
/// taken again by the armed loop that follows.
pub(super) async fn cancelled_meanwhile<C: ClusterPort>(
    ctx: &Ctx<C>,
    taint_added: bool,
    cause: core::CancelCause,
) -> core::LastShutdown {
    let taint = undo_taint(ctx, taint_added).await;
    state::clear(&ctx.state_writes, &ctx.state_dir);
    super::holder::forget_note(&ctx.state_dir, &ctx.state_writes);
    let message = core::cancel_message(cause, taint, core::AfterCancel::Held);
    let message = match cause {
        core::CancelCause::Logind => {
            format!("{message} (cancelled while nodeguard was not running)")
        }
        core::CancelCause::LogindRestarted => message,
    };
    tracing::info!("{message}");
    ctx.reporter.event(
        EventKind::Normal,
        "ShutdownCancelled",
        "CancelShutdown",
        message,
    );
    let last = core::LastShutdown::Cancelled {
        cause,
        taint,
        inhibitor: core::AfterCancel::Held,
    };
    report_condition(ctx, &core::Phase::Waiting, Some(&last));
    last
}

/// How long an agent whose logind left during a shutdown waits for it to
/// answer again (a restart takes well under a second; activation on the
/// system bus starts it if needed) before it takes the host as going down.
const LOGIND_BACK_WAIT: Duration = Duration::from_secs(10);

/// After logind left the bus during a shutdown: a new connection and
/// whether the logind answering now prepares for a shutdown. `None` when
/// none answered within `LOGIND_BACK_WAIT`. (Not cut short by a stop: a
/// stop waits for the shutdown's outcome, and this is bounded.)
pub(super) async fn logind_after_restart<L: LogindConnector>(
    logind: &L,
) -> Option<(L::Port, bool)> {
    let deadline = tokio::time::Instant::now() + LOGIND_BACK_WAIT;
    loop {
        match ask_logind(logind).await {
            Ok(answer) => return Some(answer),
            Err(why) => tracing::debug!("logind does not answer yet: {why}"),
        }
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        sleep(Duration::from_millis(250)).await;
    }
}
