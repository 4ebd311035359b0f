//! When the start's pages may go: the agent has been ready for a while and
//! its API calls have gone through for a while. Pure: what the agent looked
//! like at each look in, whether to release now out.
//!
//! A page dropped and touched again costs a fault. Right after the start,
//! while the API server is still shedding the agent's calls (a fleet
//! started at once, a control-plane upgrade), the start's code runs again
//! and again: each retry, each first write. Dropping its pages then makes
//! every one of those a fault, and on a machine where the agents share the
//! cores (the fleet bench: 1,000 on 2) it slowed the whole start 1.6-2.1
//! times (ARCHITECTURE.md, "The release waits for a quiet start"). A
//! graceful node shutdown runs code the start never ran, once, within the
//! inhibit window: no moment to drop pages either. So the release waits
//! until the agent has been ready for at least [`Settle::new`]'s `delay`
//! and, for the last `quiet` of it, was ready with no shutdown under way
//! at every look and saw no API trouble (a request without an answer, a
//! 429 or 5xx, a failed write) in between.

use std::time::Duration;

use tokio::time::Instant;

/// What the agent looked like at one look.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Look {
    pub at: Instant,
    /// `/readyz` would pass.
    pub ready: bool,
    /// A graceful node shutdown is under way.
    pub shutting_down: bool,
    /// The API troubles counted so far: each try of a request that the API
    /// server did not serve (no answer, or 429 or 5xx) and each failed
    /// condition or Event write. Only a change counts.
    pub troubles: u64,
}

/// Whether the pages may go, from one look to the next.
#[derive(Debug)]
pub struct Settle {
    delay: Duration,
    quiet: Duration,
    first_ready: Option<Instant>,
    /// Ready at every look since, with no new trouble.
    quiet_since: Option<Instant>,
    troubles: Option<u64>,
}

impl Settle {
    /// Release no sooner than `delay` after the first ready look, and only
    /// after `quiet` of ready looks with no new trouble.
    pub fn new(delay: Duration, quiet: Duration) -> Self {
        Self {
            delay,
            quiet,
            first_ready: None,
            quiet_since: None,
            troubles: None,
        }
    }

    /// Takes one look; true when the pages may go now.
    pub fn look(&mut self, look: Look) -> bool {
        let troubled = self.troubles.is_some_and(|t| t != look.troubles);
        self.troubles = Some(look.troubles);
        if !look.ready {
            self.quiet_since = None;
            return false;
        }
        // Ready counts from here, shutting down or not.
        let first_ready = *self.first_ready.get_or_insert(look.at);
        if look.shutting_down {
            self.quiet_since = None;
            return false;
        }
        let quiet_since = match self.quiet_since {
            Some(since) if !troubled => since,
            _ => *self.quiet_since.insert(look.at),
        };
        look.at.saturating_duration_since(first_ready) >= self.delay
            && look.at.saturating_duration_since(quiet_since) >= self.quiet
    }

    /// The first ready look, if any.
    pub fn first_ready(&self) -> Option<Instant> {
        self.first_ready
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DELAY: Duration = Duration::from_secs(60);
    const QUIET: Duration = Duration::from_secs(30);

    /// Looks once a second from `t0`, `script(second)` giving readiness and
    /// the trouble count; the second of the first release, if any within
    /// `until` seconds.
    fn first_release(until: u64, script: impl Fn(u64) -> (bool, u64)) -> Option<u64> {
        first_release_shutting(until, |sec| {
            let (ready, troubles) = script(sec);
            (ready, false, troubles)
        })
    }

    /// As [`first_release`], the script also saying whether a shutdown is
    /// under way.
    fn first_release_shutting(
        until: u64,
        script: impl Fn(u64) -> (bool, bool, u64),
    ) -> Option<u64> {
        let t0 = Instant::now();
        let mut s = Settle::new(DELAY, QUIET);
        (0..=until).find(|&sec| {
            let (ready, shutting_down, troubles) = script(sec);
            s.look(Look {
                at: t0 + Duration::from_secs(sec),
                ready,
                shutting_down,
                troubles,
            })
        })
    }

    #[test]
    fn a_shutdown_under_way_holds_the_release() {
        // Shutting down from second 50 to 200: nothing until 30 s after.
        assert_eq!(
            first_release_shutting(600, |s| (true, (50..200).contains(&s), 0)),
            Some(230)
        );
    }

    #[test]
    fn a_shutdown_that_never_ends_never_releases() {
        assert_eq!(first_release_shutting(600, |s| (true, s >= 30, 0)), None);
    }

    #[test]
    fn the_delay_counts_from_ready_even_while_shutting_down() {
        // Ready and shutting down from the start until second 100: the
        // delay has passed by then, the quiet time has not.
        assert_eq!(
            first_release_shutting(600, |s| (true, s < 100, 0)),
            Some(130)
        );
    }

    #[test]
    fn ready_and_quiet_from_the_start_releases_at_the_delay() {
        assert_eq!(first_release(300, |_| (true, 0)), Some(60));
    }

    #[test]
    fn the_delay_counts_from_the_first_ready_look() {
        assert_eq!(first_release(300, |s| (s >= 12, 0)), Some(72));
    }

    #[test]
    fn never_ready_never_releases() {
        assert_eq!(first_release(600, |_| (false, 0)), None);
    }

    #[test]
    fn troubles_before_ready_do_not_count() {
        // A start shed many times, then ready and quiet.
        assert_eq!(
            first_release(300, |s| if s < 20 { (false, s * 3) } else { (true, 60) }),
            Some(80)
        );
    }

    #[test]
    fn a_trouble_near_the_delay_waits_for_a_quiet_window() {
        // One shed answer seen at second 50: quiet from 50, release at 80.
        assert_eq!(first_release(300, |s| (true, u64::from(s >= 50))), Some(80));
    }

    #[test]
    fn a_trouble_long_before_the_delay_does_not_hold_it() {
        assert_eq!(first_release(300, |s| (true, u64::from(s >= 5))), Some(60));
    }

    #[test]
    fn troubles_that_go_on_hold_the_release_until_they_stop() {
        // Shed every 10 s until second 200.
        assert_eq!(first_release(400, |s| (true, s.min(200) / 10)), Some(230));
    }

    #[test]
    fn troubles_that_never_stop_never_release() {
        assert_eq!(first_release(1_000, |s| (true, s / 20)), None);
    }

    #[test]
    fn a_look_not_ready_restarts_the_quiet_window() {
        // Not ready at second 45 only: quiet again from 46.
        assert_eq!(first_release(300, |s| (s != 45, 0)), Some(76));
    }

    #[test]
    fn not_ready_past_the_delay_waits_for_a_whole_quiet_window_after() {
        assert_eq!(
            first_release(300, |s| (!(55..100).contains(&s), 0)),
            Some(130)
        );
    }

    #[test]
    fn a_count_that_goes_down_is_a_change_too() {
        // Counters do not go down; if one were reset, that is news as well.
        assert_eq!(
            first_release(300, |s| (true, if s < 50 { 5 } else { 0 })),
            Some(80)
        );
    }

    #[test]
    fn looks_far_apart_release_at_the_first_look_past_both() {
        let t0 = Instant::now();
        let mut s = Settle::new(DELAY, QUIET);
        let look = |sec: u64, troubles| Look {
            at: t0 + Duration::from_secs(sec),
            ready: true,
            shutting_down: false,
            troubles,
        };
        assert!(!s.look(look(0, 0)));
        // A trouble between the two looks: quiet from the second.
        assert!(!s.look(look(70, 1)));
        assert!(!s.look(look(99, 1)));
        assert!(s.look(look(100, 1)));
        assert_eq!(s.first_ready(), Some(t0));
    }

    #[test]
    fn a_zero_delay_and_quiet_releases_at_the_first_ready_look() {
        let t0 = Instant::now();
        let mut s = Settle::new(Duration::ZERO, Duration::ZERO);
        assert!(!s.look(Look {
            at: t0,
            ready: false,
            shutting_down: false,
            troubles: 0
        }));
        assert!(s.look(Look {
            at: t0 + Duration::from_secs(1),
            ready: true,
            shutting_down: false,
            troubles: 0
        }));
    }
}
