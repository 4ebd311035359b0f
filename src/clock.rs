//! Wall-clock timestamps beside tokio's monotonic clock.
//!
//! Decisions use [`tokio::time::Instant`] so tests can pause and advance
//! time. What we show to people (JSON bodies, condition times, Events) and
//! what we keep across restarts needs wall time. [`WallClock`] gives the
//! system's wall time, stepped clock included (an NTP step, `date -s`), and
//! says how far the wall clock has stepped since it was made
//! ([`WallClock::step`]), so a component that keeps wall times for its
//! decisions (a monitor's counting window, a quiet period) can move them by
//! the same amount and keep measuring elapsed time, not clock readings.
//!
//! Paused tests: the wall clock moves with tokio's clock, so advancing a
//! paused test clock moves the reported times too; a step is the wall
//! clock's distance from the real monotonic clock (`std::time::Instant`),
//! which a paused tokio clock does not affect.

use std::time::SystemTime;

use jiff::{SignedDuration, Timestamp};
use tokio::time::Instant;

/// Differences between the wall and the monotonic clock smaller than this
/// are not shown (reading noise; NTP slews both clocks alike, only a step
/// moves one against the other).
const STEP_NOISE: SignedDuration = SignedDuration::from_millis(100);

#[derive(Clone, Copy, Debug)]
pub struct WallClock {
    anchor_instant: Instant,
    anchor_real: std::time::Instant,
    anchor_system: SystemTime,
}

impl Default for WallClock {
    fn default() -> Self {
        Self::new()
    }
}

impl WallClock {
    /// Anchors tokio's clock to the system clock now.
    pub fn new() -> Self {
        WallClock {
            anchor_instant: Instant::now(),
            anchor_real: std::time::Instant::now(),
            anchor_system: SystemTime::now(),
        }
    }

    /// How far the system's wall clock has stepped since this clock was
    /// made: positive when it was set forward, negative when set back. Read
    /// as it comes (a few microseconds of noise between the two readings):
    /// a user compares it with what it last acted on, by a margin.
    pub fn step(&self) -> SignedDuration {
        let real = std::time::Instant::now().duration_since(self.anchor_real);
        let expected = self.anchor_system + real;
        match SystemTime::now().duration_since(expected) {
            Ok(ahead) => SignedDuration::try_from(ahead).unwrap_or(SignedDuration::MAX),
            Err(e) => -SignedDuration::try_from(e.duration()).unwrap_or(SignedDuration::MAX),
        }
    }

    /// Wall time of a tokio instant, on the wall clock as it reads now (a
    /// step since then moves it too).
    pub fn at(&self, instant: Instant) -> Timestamp {
        let since_anchor = if instant >= self.anchor_instant {
            SignedDuration::try_from(instant - self.anchor_instant).unwrap_or(SignedDuration::MAX)
        } else {
            -SignedDuration::try_from(self.anchor_instant - instant).unwrap_or(SignedDuration::MAX)
        };
        let anchor = Timestamp::try_from(self.anchor_system).unwrap_or(Timestamp::UNIX_EPOCH);
        anchor
            .checked_add(since_anchor)
            .and_then(|t| {
                let step = self.step();
                t.checked_add(if step.abs() < STEP_NOISE {
                    SignedDuration::ZERO
                } else {
                    step
                })
            })
            .unwrap_or(Timestamp::UNIX_EPOCH)
    }

    /// Wall time now, by tokio's clock, stepped as the system clock was.
    pub fn now(&self) -> Timestamp {
        self.at(Instant::now())
    }

    /// The system's monotonic clock (`CLOCK_MONOTONIC`, the one logind
    /// times inhibitor delays by) now, moved by tokio's clock: the same in
    /// every process on this boot and never stepped, so a record kept across
    /// a restart can say how long ago something started.
    pub fn monotonic(&self) -> std::time::Duration {
        let system = system_monotonic();
        let real = std::time::Instant::now().duration_since(self.anchor_real);
        let tokio = Instant::now().duration_since(self.anchor_instant);
        (system + tokio).saturating_sub(real)
    }
}

/// The system's `CLOCK_MONOTONIC` now, as systemd's `*Monotonic`
/// timestamps and logind read it (not moved by a paused test clock).
pub fn system_monotonic() -> std::time::Duration {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    std::time::Duration::new(ts.tv_sec.max(0) as u64, ts.tv_nsec.max(0) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn paused_time_moves_wall_time() {
        let clock = WallClock::new();
        let t0 = clock.now();
        tokio::time::advance(Duration::from_secs(90)).await;
        let t1 = clock.now();
        assert_eq!((t1 - t0).get_seconds(), 90);
        let earlier = clock.at(Instant::now() - Duration::from_secs(120));
        assert_eq!((t1 - earlier).get_seconds(), 120);
        assert!(clock.step().abs() < STEP_NOISE, "{:?}", clock.step());
    }

    #[tokio::test(start_paused = true)]
    async fn paused_time_moves_the_monotonic_clock() {
        let clock = WallClock::new();
        let m0 = clock.monotonic();
        tokio::time::advance(Duration::from_secs(90)).await;
        let m1 = clock.monotonic();
        let moved = m1 - m0;
        assert!(
            moved >= Duration::from_secs(90) && moved < Duration::from_secs(91),
            "{moved:?}"
        );
    }

    #[test]
    fn a_stepped_wall_clock_is_seen_and_shown() {
        // A clock made an hour "earlier" on the wall clock than on the
        // monotonic clock reads as a step forward of an hour since then.
        let now = WallClock::new();
        let mut stepped = now;
        stepped.anchor_system -= Duration::from_secs(3600);
        let step = stepped.step();
        assert!(
            (step - SignedDuration::from_secs(3600)).abs() < SignedDuration::from_secs(1),
            "{step:?}"
        );
        // Shown time is the system's, not the anchor's.
        assert!(stepped.now().duration_since(now.now()).abs() < SignedDuration::from_secs(1));
        let mut back = now;
        back.anchor_system += Duration::from_secs(600);
        assert!(back.step() < SignedDuration::from_secs(-599));
    }
}
