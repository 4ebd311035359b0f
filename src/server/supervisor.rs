//! The agent's loops under watch: one that ends or panics while the agent
//! runs fails `/livez` by name.

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::Health;

/// Runs the agent's long-running loops and notices when one of them stops.
///
/// Every loop is meant to run until the agent stops. One that returns or
/// panics while the agent runs is a loop that no longer does its job (a
/// closed kernel-log channel, a watch that gave up): the supervisor marks it
/// failed in the health registry, so `/livez` fails naming it and the
/// watchdog stops being petted, and logs it as an error.
pub struct Supervisor {
    health: Health,
    stop: CancellationToken,
    tasks: JoinSet<()>,
}

impl Supervisor {
    pub fn new(health: Health, stop: CancellationToken) -> Self {
        Supervisor {
            health,
            stop,
            tasks: JoinSet::new(),
        }
    }

    /// Spawns `fut` as the loop `name`.
    pub fn spawn<F>(&mut self, name: &'static str, fut: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let (health, stop) = (self.health.clone(), self.stop.clone());
        let inner = tokio::spawn(fut);
        self.tasks.spawn(async move {
            let outcome = inner.await;
            if stop.is_cancelled() {
                return;
            }
            let reason = stop_reason(outcome.map(Ok));
            tracing::error!(loop_name = name, %reason, "a nodeguard loop stopped while the agent runs; /livez fails and the watchdog is no longer petted until the agent restarts");
            health.fail(name, reason);
        });
    }

    /// The loops' tasks, for the owner that stops them.
    pub fn into_tasks(self) -> JoinSet<()> {
        self.tasks
    }

    /// Waits for every loop (after the stop token was cancelled).
    pub async fn join(mut self) {
        while self.tasks.join_next().await.is_some() {}
    }
}

/// Why a loop's task ended: its own error, its end, or its panic.
pub fn stop_reason(outcome: Result<Result<(), String>, tokio::task::JoinError>) -> String {
    match outcome {
        Ok(Err(why)) => why,
        Ok(Ok(())) => "ended unexpectedly".to_string(),
        Err(e) if e.is_panic() => format!("panicked: {}", panic_text(e.into_panic())),
        Err(e) => format!("was cancelled: {e}"),
    }
}

/// A panic's message, as `std` prints it when the payload is text.
pub fn panic_text(payload: Box<dyn std::any::Any + Send>) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_loop_that_ends_or_panics_fails_livez_by_name_and_a_stop_does_not() {
        let health = Health::new();
        let stop = CancellationToken::new();
        let mut sup = Supervisor::new(health.clone(), stop.clone());
        let forever = stop.clone();
        sup.spawn("steady", async move { forever.cancelled().await });
        sup.spawn("returns", async {});
        sup.spawn("panics", async { panic!("kmsg channel closed") });
        for _ in 0..200 {
            if health.report().stuck_loops().len() == 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let report = health.report();
        assert!(!report.live);
        assert_eq!(report.stuck_loops(), ["panics", "returns"]);
        assert_eq!(
            report.loops["panics"].failed.as_deref(),
            Some("panicked: kmsg channel closed")
        );
        assert_eq!(
            report.loops["returns"].failed.as_deref(),
            Some("ended unexpectedly")
        );
        // The watchdog gate refuses to pet, naming both loops.
        let skip = crate::watchdog::core::gate(&report, None).unwrap_err();
        assert!(
            skip.describe().contains("panics, returns"),
            "{}",
            skip.describe()
        );

        // Loops ending because the agent stops are not failures.
        let health = Health::new();
        let stop = CancellationToken::new();
        let mut sup = Supervisor::new(health.clone(), stop.clone());
        let token = stop.clone();
        sup.spawn("steady", async move { token.cancelled().await });
        stop.cancel();
        sup.join().await;
        assert!(health.report().live);
    }
}
