//! The health registry: every long-running loop reports here, and
//! `/livez`, `/healthz`, `/readyz` (and the watchdog gate) read the verdict.
//!
//! Semantics follow kube-proxy's health server, generalised from one
//! proxier per IP family to any number of named loops:
//! - a loop calls [`LoopHandle::queued`] when work arrives and
//!   [`LoopHandle::updated`] when it has been applied;
//! - a loop is *stuck* when its oldest unapplied work is older than its
//!   timeout, and *failed* when it ended or panicked while the agent was
//!   running ([`Health::fail`], called by the agent's supervisor); the agent
//!   is *live* while no loop is stuck or failed (a loop that is idle, or
//!   waiting for an API server that is down, is neither);
//! - the agent is *ready* once every registered loop has completed its first
//!   update (its first sync), and while it is live;
//! - the agent is *healthy* (`/healthz`) when live and the node is eligible
//!   (not being deleted, not tainted for removal), so load balancers that
//!   health-check nodes drain this one before it goes away.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use jiff::Timestamp;
use serde::Serialize;
use tokio::time::Instant;

use crate::clock::WallClock;

#[derive(Clone, Debug)]
struct LoopState {
    timeout: Duration,
    synced: bool,
    last_updated: Option<Instant>,
    pending_since: Option<Instant>,
    /// Why the loop is no longer running (it ended or panicked).
    failed: Option<String>,
}

#[derive(Debug)]
struct State {
    loops: BTreeMap<String, LoopState>,
    /// Why the node is not eligible, by the source that says so; eligible
    /// while empty. Each source sets and clears only its own entry, so one
    /// source's update never overrides another's verdict.
    ineligible: BTreeMap<String, String>,
}

/// Shared handle to the registry. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Health {
    state: Arc<Mutex<State>>,
    clock: WallClock,
}

/// What one loop uses to report progress. Dropping it leaves the loop
/// registered (a loop that died mid-work must keep failing `/livez`);
/// call [`LoopHandle::deregister`] when a loop ends on purpose.
#[derive(Debug)]
pub struct LoopHandle {
    health: Health,
    name: String,
}

/// The verdict at one instant, also the JSON body of the health endpoints.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct HealthReport {
    /// Most recent update of any loop when live; the stuck loop's last
    /// update when not. `null` before any loop has updated.
    pub last_updated: Option<Timestamp>,
    pub current_time: Timestamp,
    pub node_eligible: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_ineligible_reason: Option<String>,
    pub live: bool,
    pub ready: bool,
    pub loops: BTreeMap<String, LoopReport>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LoopReport {
    pub synced: bool,
    pub stuck: bool,
    pub timeout_seconds: f64,
    pub last_updated: Option<Timestamp>,
    pub pending_since: Option<Timestamp>,
    /// Set when the loop ended or panicked: why.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failed: Option<String>,
}

impl HealthReport {
    /// `/healthz`: live and the node is eligible.
    pub fn healthy(&self) -> bool {
        self.live && self.node_eligible
    }

    /// Names of the loops that fail `/livez` (stuck past their timeout, or
    /// ended), for logs and skipped watchdog pets.
    pub fn stuck_loops(&self) -> Vec<&str> {
        self.loops
            .iter()
            .filter(|(_, l)| l.stuck || l.failed.is_some())
            .map(|(n, _)| n.as_str())
            .collect()
    }
}

impl Default for Health {
    fn default() -> Self {
        Self::new()
    }
}

impl Health {
    /// An empty registry. The node counts as eligible until told otherwise,
    /// as in kube-proxy: starting up must not drain the node.
    pub fn new() -> Self {
        Health {
            state: Arc::new(Mutex::new(State {
                loops: BTreeMap::new(),
                ineligible: BTreeMap::new(),
            })),
            clock: WallClock::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding this short lock cannot leave the map
        // half-written, so a poisoned lock is still safe to use.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a loop that must apply queued work within `timeout`.
    /// Registering a name again resets that loop's state.
    pub fn register(&self, name: impl Into<String>, timeout: Duration) -> LoopHandle {
        let name = name.into();
        self.lock().loops.insert(
            name.clone(),
            LoopState {
                timeout,
                synced: false,
                last_updated: None,
                pending_since: None,
                failed: None,
            },
        );
        LoopHandle {
            health: self.clone(),
            name,
        }
    }

    /// Marks a loop as no longer running (it ended or panicked while the
    /// agent runs): `/livez` fails, naming it and `reason`, until the loop
    /// is registered again. A loop not registered yet is added.
    pub fn fail(&self, name: &str, reason: impl Into<String>) {
        let reason = reason.into();
        let mut state = self.lock();
        let l = state
            .loops
            .entry(name.to_string())
            .or_insert_with(|| LoopState {
                timeout: Duration::ZERO,
                synced: false,
                last_updated: None,
                pending_since: None,
                failed: None,
            });
        l.failed = Some(reason);
    }

    /// Sets node eligibility; returns true when it changed.
    /// Sets one source's verdict on node eligibility (the node-state loop
    /// says `node`); the node is eligible while no source says otherwise.
    /// Returns true when that source's verdict changed.
    pub fn set_node_eligible(&self, source: &str, eligible: bool, reason: Option<String>) -> bool {
        let mut state = self.lock();
        if eligible {
            state.ineligible.remove(source).is_some()
        } else {
            let reason = reason.unwrap_or_else(|| "not eligible".into());
            state
                .ineligible
                .insert(source.to_string(), reason)
                .is_none()
        }
    }

    /// The verdict now, by tokio's clock.
    pub fn report(&self) -> HealthReport {
        let state = self.lock();
        evaluate(&state, Instant::now(), &self.clock)
    }
}

impl LoopHandle {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Work has arrived. Only the oldest pending work counts toward the
    /// timeout, so a busy loop that keeps up is never stuck.
    pub fn queued(&self) {
        let now = Instant::now();
        if let Some(l) = self.health.lock().loops.get_mut(&self.name) {
            l.pending_since.get_or_insert(now);
        }
    }

    /// All queued work is applied (for a watcher: the first call is its
    /// first sync).
    pub fn updated(&self) {
        let now = Instant::now();
        if let Some(l) = self.health.lock().loops.get_mut(&self.name) {
            l.pending_since = None;
            l.last_updated = Some(now);
            l.synced = true;
        }
    }

    /// Removes the loop from the registry (it ended on purpose).
    pub fn deregister(self) {
        self.health.lock().loops.remove(&self.name);
    }
}

fn evaluate(state: &State, now: Instant, clock: &WallClock) -> HealthReport {
    let mut loops = BTreeMap::new();
    let mut live = true;
    let mut ready = true;
    let mut newest: Option<Instant> = None;
    let mut stuck_last_updated: Option<Option<Instant>> = None;
    for (name, l) in &state.loops {
        let stuck = l
            .pending_since
            .is_some_and(|since| now.duration_since(since) >= l.timeout);
        if stuck || l.failed.is_some() {
            live = false;
            stuck_last_updated.get_or_insert(l.last_updated);
        }
        ready &= l.synced;
        newest = newest.max(l.last_updated);
        loops.insert(
            name.clone(),
            LoopReport {
                synced: l.synced,
                stuck,
                timeout_seconds: l.timeout.as_secs_f64(),
                last_updated: l.last_updated.map(|i| clock.at(i)),
                pending_since: l.pending_since.map(|i| clock.at(i)),
                failed: l.failed.clone(),
            },
        );
    }
    let last_updated = stuck_last_updated.unwrap_or(newest);
    HealthReport {
        last_updated: last_updated.map(|i| clock.at(i)),
        current_time: clock.at(now),
        node_eligible: state.ineligible.is_empty(),
        node_ineligible_reason: (!state.ineligible.is_empty()).then(|| {
            state
                .ineligible
                .values()
                .cloned()
                .collect::<Vec<_>>()
                .join("; ")
        }),
        live,
        ready: ready && live,
        loops,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::advance;

    const T: Duration = Duration::from_secs(10);

    #[tokio::test(start_paused = true)]
    async fn empty_registry_is_live_ready_and_healthy() {
        let h = Health::new();
        let r = h.report();
        assert!(r.live && r.ready && r.healthy());
        assert_eq!(r.last_updated, None);
    }

    #[tokio::test(start_paused = true)]
    async fn not_ready_until_every_loop_has_synced() {
        let h = Health::new();
        let a = h.register("a", T);
        let b = h.register("b", T);
        assert!(!h.report().ready);
        a.updated();
        assert!(!h.report().ready);
        b.queued();
        b.updated();
        let r = h.report();
        assert!(r.ready && r.live);
        assert!(r.loops["a"].synced && r.loops["b"].synced);
    }

    #[tokio::test(start_paused = true)]
    async fn a_loop_becomes_stuck_exactly_at_its_timeout() {
        let h = Health::new();
        let a = h.register("a", T);
        a.updated();
        a.queued();
        advance(T - Duration::from_millis(1)).await;
        assert!(h.report().live);
        advance(Duration::from_millis(1)).await;
        let r = h.report();
        assert!(!r.live && !r.ready && !r.healthy());
        assert_eq!(r.stuck_loops(), ["a"]);
        a.updated();
        assert!(h.report().live);
    }

    #[tokio::test(start_paused = true)]
    async fn only_the_oldest_pending_work_counts() {
        let h = Health::new();
        let a = h.register("a", T);
        a.queued();
        advance(Duration::from_secs(6)).await;
        a.queued(); // must not reset the clock
        advance(Duration::from_secs(4)).await;
        assert!(!h.report().live);
    }

    #[tokio::test(start_paused = true)]
    async fn a_loop_that_keeps_up_is_never_stuck() {
        let h = Health::new();
        let a = h.register("a", T);
        for _ in 0..100 {
            a.queued();
            advance(Duration::from_secs(5)).await;
            a.updated();
        }
        assert!(h.report().live);
    }

    #[tokio::test(start_paused = true)]
    async fn idle_or_never_started_loops_are_live() {
        let h = Health::new();
        let _a = h.register("a", T);
        advance(Duration::from_secs(3600)).await;
        let r = h.report();
        assert!(r.live);
        assert!(!r.ready);
    }

    #[tokio::test(start_paused = true)]
    async fn eligibility_affects_healthz_only() {
        let h = Health::new();
        h.register("a", T).updated();
        assert!(h.set_node_eligible(
            "node",
            false,
            Some("tainted ToBeDeletedByClusterAutoscaler".into())
        ));
        assert!(!h.set_node_eligible("node", false, None));
        let r = h.report();
        assert!(r.live && r.ready && !r.healthy());
        assert!(h.set_node_eligible("node", true, None));
        let r = h.report();
        assert!(r.healthy());
        assert_eq!(r.node_ineligible_reason, None);
    }

    #[tokio::test(start_paused = true)]
    async fn one_sources_verdict_does_not_override_anothers() {
        let h = Health::new();
        assert!(h.set_node_eligible("shutdown", false, Some("shutting down".into())));
        // The node-state loop recomputes on every Node event: eligible by it.
        assert!(!h.set_node_eligible("node", true, None));
        let r = h.report();
        assert!(!r.node_eligible);
        assert_eq!(r.node_ineligible_reason.as_deref(), Some("shutting down"));
        assert!(h.set_node_eligible("node", false, Some("being deleted".into())));
        assert_eq!(
            h.report().node_ineligible_reason.as_deref(),
            Some("being deleted; shutting down")
        );
        h.set_node_eligible("shutdown", true, None);
        h.set_node_eligible("node", true, None);
        assert!(h.report().node_eligible);
    }

    #[tokio::test(start_paused = true)]
    async fn last_updated_is_newest_when_live_and_the_stuck_loops_when_not() {
        let h = Health::new();
        let a = h.register("a", T);
        let b = h.register("b", T);
        a.updated();
        let a_time = h.report().current_time;
        advance(Duration::from_secs(5)).await;
        b.updated();
        let r = h.report();
        assert_eq!(r.last_updated, Some(r.current_time));
        a.queued();
        advance(T).await;
        let r = h.report();
        assert!(!r.live);
        assert_eq!(r.last_updated, Some(a_time));
    }

    #[tokio::test(start_paused = true)]
    async fn deregistering_removes_a_stuck_loop_and_reregistering_resets() {
        let h = Health::new();
        let a = h.register("a", T);
        a.queued();
        advance(T).await;
        assert!(!h.report().live);
        a.deregister();
        assert!(h.report().live);
        let b = h.register("b", T);
        b.updated();
        let _b2 = h.register("b", T);
        assert!(!h.report().ready);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_loop_fails_livez_until_registered_again() {
        let h = Health::new();
        let a = h.register("a", T);
        a.updated();
        h.register("b", T).updated();
        h.fail("a", "ended unexpectedly");
        let r = h.report();
        assert!(!r.live && !r.ready && !r.healthy());
        assert_eq!(r.stuck_loops(), ["a"]);
        assert_eq!(r.loops["a"].failed.as_deref(), Some("ended unexpectedly"));
        assert!(!r.loops["a"].stuck, "failed is not the same as stuck");
        // Updates from a dead loop's handle do not revive it.
        a.updated();
        assert!(!h.report().live);
        // A restarted loop registers again and starts clean.
        h.register("a", T).updated();
        assert!(h.report().live);
        // A loop that never registered is added when it fails.
        h.fail("publisher", "panicked: boom");
        let r = h.report();
        assert_eq!(r.stuck_loops(), ["publisher"]);
        let body = serde_json::to_value(&r).unwrap();
        assert_eq!(body["loops"]["publisher"]["failed"], "panicked: boom");
        assert!(body["loops"]["a"].get("failed").is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn report_serializes_with_the_kube_proxy_keys() {
        let h = Health::new();
        h.register("w", T).updated();
        let v = serde_json::to_value(h.report()).unwrap();
        for key in ["lastUpdated", "currentTime", "nodeEligible"] {
            assert!(v.get(key).is_some(), "missing {key} in {v}");
        }
        assert_eq!(v["loops"]["w"]["synced"], true);
    }
}
