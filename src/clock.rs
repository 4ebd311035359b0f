//! Wall-clock timestamps derived from tokio's monotonic clock.
//!
//! Decisions use [`tokio::time::Instant`] so tests can pause and advance
//! time. What we show to people (JSON bodies, condition times) needs wall
//! time; [`WallClock`] maps one to the other from a single anchor taken at
//! start-up, so a paused test clock moves the reported times too.

use std::time::SystemTime;

use jiff::Timestamp;
use tokio::time::Instant;

#[derive(Clone, Copy, Debug)]
pub struct WallClock {
    anchor_instant: Instant,
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
            anchor_system: SystemTime::now(),
        }
    }

    /// Wall time of a tokio instant.
    pub fn at(&self, instant: Instant) -> Timestamp {
        let system = if instant >= self.anchor_instant {
            self.anchor_system + (instant - self.anchor_instant)
        } else {
            self.anchor_system - (self.anchor_instant - instant)
        };
        Timestamp::try_from(system).unwrap_or(Timestamp::UNIX_EPOCH)
    }

    /// Wall time now, by tokio's clock.
    pub fn now(&self) -> Timestamp {
        self.at(Instant::now())
    }
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
    }
}
