//! The shutdown taint's whole life: added as a shutdown begins (retried
//! until the API server answers), removed after a cancel or the reboot,
//! and, when the API server does not take the removal in time, removed in
//! the background by this process or the next.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::{sleep, timeout};
use tokio_util::sync::CancellationToken;

use super::ClusterPort;
use super::cluster::{self};
use super::core;
use super::state::{self, ShutdownRecord};
use super::{CALL_TIMEOUT, Ctx, save};
use crate::report::EventKind;
use crate::server::backoff::Backoff;

/// The shutdown taint's request is retried from this delay, doubling up
/// to [`TAINT_RETRY_MAX`], until the API server answers or the plan ends.
const TAINT_RETRY_MIN: Duration = Duration::from_millis(250);
const TAINT_RETRY_MAX: Duration = Duration::from_secs(2);
/// How often a shutdown taint left behind is tried again.
pub(super) const TAINT_CLEANUP_EVERY: Duration = Duration::from_secs(10);

impl<C> Ctx<C> {
    /// The shutdown taint is still on the Node: removed in the background
    /// from now on, by this process or the next.
    pub(super) fn remember_left_taint(&self) {
        self.taint_left
            .store(true, std::sync::atomic::Ordering::SeqCst);
        state::mark_taint_left(&self.state_writes, &self.state_dir, true);
    }

    /// The taint left behind is gone or is a new shutdown's: the background
    /// removal stops. True when one was left.
    pub(super) fn forget_left_taint(&self) -> bool {
        let was = self
            .taint_left
            .swap(false, std::sync::atomic::Ordering::SeqCst);
        if was {
            state::mark_taint_left(&self.state_writes, &self.state_dir, false);
        }
        was
    }
}

/// The shutdown's taint request, retried from [`TAINT_RETRY_MIN`] until the
/// API server answers (the caller ends it with the plan): an API server
/// restarting as the shutdown begins must not leave the node open to the
/// scheduler for the whole shutdown. A failed request may still have been
/// applied (the answer lost), so the taint a later attempt finds is then
/// nodeguard's, as after a predecessor killed with its request in flight
/// (`unanswered_before`); the record says so until an answer comes, and
/// goes to disk again with the answer. `first_answer` is notified at the
/// first answer: the groups wait for it (up to `CALL_HEADROOM`), since a
/// pod evicted before the node is tainted may be replaced on this very
/// node.
pub(super) async fn taint_for_shutdown<C: ClusterPort>(
    ctx: &Ctx<C>,
    record: &std::sync::Mutex<ShutdownRecord>,
    unanswered_before: bool,
    first_answer: &tokio::sync::Notify,
) {
    let lock_record = || record.lock().unwrap_or_else(|e| e.into_inner());
    // A taint left by an earlier shutdown is this one's now: the
    // background removal stops, and one in flight is waited out.
    // The taint found there is then nodeguard's: this shutdown's
    // record says so.
    let took_over = ctx.forget_left_taint();
    drop(ctx.taint_cleanup.lock().await);
    let mut maybe_applied = unanswered_before || took_over;
    let mut backoff = Backoff::new(TAINT_RETRY_MIN, TAINT_RETRY_MAX);
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        let answer = ctx.cluster.add_taint().await;
        if answer.is_ok() {
            first_answer.notify_one();
        }
        match answer {
            Ok(added) => {
                if attempts > 1 {
                    tracing::info!(attempts, "the node is tainted");
                }
                let mut r = lock_record();
                r.taint_added |= added || maybe_applied;
                r.taint_answered = true;
                save(ctx, &r);
                return;
            }
            Err(e) => {
                maybe_applied |= e.maybe_applied();
                if attempts == 1 {
                    tracing::error!(error = %e, "cannot taint the node; evicting anyway and retrying the taint");
                } else {
                    tracing::debug!(error = %e, attempts, "cannot taint the node yet");
                }
                sleep(backoff.next_delay()).await;
            }
        }
    }
}

/// Removes nodeguard's taint if it added it.
pub(super) async fn undo_taint<C: ClusterPort>(
    ctx: &Ctx<C>,
    taint_added: bool,
) -> core::TaintAfter {
    if !taint_added {
        core::TaintAfter::NotOurs
    } else if remove_taint_until_done(ctx).await {
        core::TaintAfter::Removed
    } else {
        core::TaintAfter::Left
    }
}

/// Removes a shutdown taint left behind (see [`Ctx::taint_left`]) while
/// the manager runs.
pub(super) async fn clean_up_left_taint<C: ClusterPort>(ctx: Arc<Ctx<C>>, stop: CancellationToken) {
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = sleep(TAINT_CLEANUP_EVERY) => {}
        }
        if !ctx.taint_left.load(std::sync::atomic::Ordering::SeqCst) {
            continue;
        }
        let _turn = ctx.taint_cleanup.lock().await;
        // A shutdown that began meanwhile owns the taint now.
        if !ctx.taint_left.load(std::sync::atomic::Ordering::SeqCst) {
            continue;
        }
        match timeout(CALL_TIMEOUT, ctx.cluster.remove_taint()).await {
            Ok(Ok(())) => {
                ctx.forget_left_taint();
                report_taint_removed(
                    &ctx,
                    format!(
                        "nodeguard removed its shutdown taint {}, left on the node while the API server did not take its removal.",
                        cluster::TAINT_KEY
                    ),
                );
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "cannot remove the shutdown taint left behind yet")
            }
            Err(_) => tracing::debug!("the API server did not answer the taint removal"),
        }
    }
}

/// Retries removing the taint a while (about 10 s), each call bounded;
/// `false` when it gave up, and the removal goes on in the background
/// ([`clean_up_left_taint`]), so a cancel or a start-up after a reboot
/// does not wait on the API server to take the inhibitor again.
pub(super) async fn remove_taint_until_done<C: ClusterPort>(ctx: &Ctx<C>) -> bool {
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
    for _ in 0..6 {
        match timeout(CALL_TIMEOUT, ctx.cluster.remove_taint()).await {
            Ok(Ok(())) => {
                ctx.forget_left_taint();
                return true;
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "cannot remove the shutdown taint yet; retrying")
            }
            Err(_) => tracing::warn!(
                "the API server did not answer the taint removal within {CALL_TIMEOUT:?}; retrying"
            ),
        }
        sleep(backoff.next_delay()).await;
    }
    tracing::error!(node = %ctx.node_name, every = ?TAINT_CLEANUP_EVERY, "cannot remove the shutdown taint {} yet; trying again in the background", cluster::TAINT_KEY);
    ctx.remember_left_taint();
    false
}

/// A shutdown taint left behind is gone: logged and a `ShutdownTaintRemoved` Event.
pub(super) fn report_taint_removed<C>(ctx: &Ctx<C>, message: String) {
    tracing::info!("{message}");
    ctx.reporter.event(
        EventKind::Normal,
        "ShutdownTaintRemoved",
        "RemoveTaint",
        message,
    );
}
