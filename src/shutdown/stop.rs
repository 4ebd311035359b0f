//! A stop's question to the shutdown manager: may the agent stop now, or
//! has the host begun shutting down (or is the manager still deciding)?

use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::time::{Instant, sleep_until, timeout_at};

/// The longest a stop waits for the manager to decide whether a shutdown
/// is under way: a lock taken back from the keeper is held while the
/// manager asks logind at start-up (5 s at most) and arms (logind's reload
/// and poll, 2 s); an answer in the armed loop is at most three calls of
/// 5 s (logind asked, the lock handed over, logind asked again).
pub(super) const STOP_DECIDE_MAX: Duration = Duration::from_secs(20);

/// Where the manager stands, for a stop's question.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum StopPhase {
    /// No inhibitor held: nothing to delay, a stop goes on at once.
    Free,
    /// An inhibitor held outside the armed loop (taken back from the
    /// keeper at start, or carried to a restarted logind): the manager is
    /// deciding, the stop waits for it.
    Holding,
    /// In the armed loop, which answers questions.
    Armed,
}

/// Asked by a stop before it cancels anything: has the host begun shutting
/// down, though the manager has not yet handled logind's
/// `PrepareForShutdown(true)` (the signal in flight, or queued behind
/// another message), or is the manager still deciding whether to resume a
/// shutdown with a lock taken back from the keeper? The stop would
/// otherwise release the inhibitor (and the keeper's copy) and let logind
/// go on at once, no group run. See [`stop_check`].
#[derive(Clone)]
pub struct StopCheck {
    phase: watch::Receiver<StopPhase>,
    asks: mpsc::Sender<tokio::sync::oneshot::Sender<bool>>,
}

/// The manager's side of [`StopCheck`].
pub struct StopQuestions {
    phase: watch::Sender<StopPhase>,
    pub(super) asks: mpsc::Receiver<tokio::sync::oneshot::Sender<bool>>,
}

/// A connected [`StopCheck`] and [`StopQuestions`]; `holding`: the agent
/// starts with a lock taken back from the keeper, so a stop waits for the
/// manager from the first instant.
pub fn stop_check(holding: bool) -> (StopCheck, StopQuestions) {
    let (phase_tx, phase) = watch::channel(if holding {
        StopPhase::Holding
    } else {
        StopPhase::Free
    });
    let (asks_tx, asks) = mpsc::channel(4);
    (
        StopCheck {
            phase,
            asks: asks_tx,
        },
        StopQuestions {
            phase: phase_tx,
            asks,
        },
    )
}

impl StopCheck {
    /// Returns once the manager has decided, whether a shutdown is in
    /// progress: one logind has begun, or one the agent resumes with a lock
    /// taken back from the keeper, is then running (and the agent's
    /// `node_shutdown` is true). `false` at once when the manager holds no
    /// inhibitor (nothing to delay; a shutdown resumed without a lock is not
    /// waited for, logind is not waiting for it either), and after
    /// `STOP_DECIDE_MAX` (20 s) when it cannot decide.
    pub async fn ask(&self) -> bool {
        let deadline = Instant::now() + STOP_DECIDE_MAX;
        let mut phase = self.phase.clone();
        loop {
            let now = *phase.borrow_and_update();
            match now {
                StopPhase::Free => return false,
                StopPhase::Holding => match timeout_at(deadline, phase.changed()).await {
                    Ok(Ok(())) => {}
                    // The manager is gone, and its lock with it.
                    Ok(Err(_)) => return false,
                    Err(_) => break,
                },
                StopPhase::Armed => {
                    let (tx, rx) = tokio::sync::oneshot::channel();
                    if self.asks.try_send(tx).is_err() {
                        return false;
                    }
                    tokio::select! {
                        answer = rx => if let Ok(running) = answer { return running },
                        // Left the armed loop before answering: look again.
                        r = phase.changed() => if r.is_err() { return false },
                        _ = sleep_until(deadline) => break,
                    }
                }
            }
        }
        tracing::warn!(
            waited = ?STOP_DECIDE_MAX,
            "the shutdown manager did not decide whether the host is shutting down; stopping"
        );
        false
    }
}

impl StopQuestions {
    pub(super) fn set(&self, phase: StopPhase) {
        self.phase
            .send_if_modified(|p| std::mem::replace(p, phase) != phase);
    }
}

/// Marks the manager armed while it lives; questions left unanswered when
/// it goes are dropped (their stop looks at the phase again). The phase
/// after it is set by the manager, which knows whether it keeps a lock.
pub(super) struct ArmedMark<'a>(pub(super) &'a mut StopQuestions);

impl<'a> ArmedMark<'a> {
    pub(super) fn new(q: &'a mut StopQuestions) -> Self {
        q.set(StopPhase::Armed);
        ArmedMark(q)
    }
}

impl Drop for ArmedMark<'_> {
    fn drop(&mut self) {
        while self.0.asks.try_recv().is_ok() {}
    }
}
