//! The one doubling delay between attempts, used by every retry loop of
//! the agent (watches, status and Event writes, logind reconnects, taint
//! requests, journalctl restarts). Beside the supervisor and the health
//! registry, as the other piece every loop shares; `k8s` uses it too, and
//! imports nothing above `server`.

use std::time::Duration;

/// A delay that doubles from `min` up to `max` with each attempt, and
/// starts again from `min` on [`Backoff::reset`].
#[derive(Clone, Debug)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    pub const fn new(min: Duration, max: Duration) -> Self {
        Backoff {
            min,
            max,
            next: min,
        }
    }

    /// The delay before the next attempt; the one after is twice it, up to
    /// the maximum.
    pub fn next_delay(&mut self) -> Duration {
        self.next_within(self.max)
    }

    /// As [`Backoff::next_delay`], with `cap` as the maximum for this attempt and
    /// the one it sets (a loop whose cap depends on what just failed).
    pub fn next_within(&mut self, cap: Duration) -> Duration {
        let delay = self.next.min(cap);
        self.next = (delay * 2).min(cap);
        delay
    }

    /// The delay [`Backoff::next_delay`] would give, without taking it.
    pub fn peek(&self) -> Duration {
        self.next.min(self.max)
    }

    pub fn reset(&mut self) {
        self.next = self.min;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn doubles_to_its_maximum_and_resets() {
        let mut b = Backoff::new(ms(200), ms(1000));
        let delays: Vec<Duration> = (0..5).map(|_| b.next_delay()).collect();
        assert_eq!(delays, [ms(200), ms(400), ms(800), ms(1000), ms(1000)]);
        assert_eq!(b.peek(), ms(1000));
        b.reset();
        assert_eq!(b.next_delay(), ms(200));
    }

    #[test]
    fn a_cap_of_the_moment_holds_for_this_attempt_and_the_next() {
        let mut b = Backoff::new(ms(250), ms(60_000));
        for _ in 0..6 {
            b.next_within(ms(8000));
        }
        assert_eq!(b.next_within(ms(8000)), ms(8000));
        // A larger cap lets it grow again from where it was.
        assert_eq!(b.next_within(ms(60_000)), ms(8000));
        assert_eq!(b.next_within(ms(60_000)), ms(16_000));
        // A smaller one cuts it at once.
        assert_eq!(b.next_within(ms(5000)), ms(5000));
        assert_eq!(b.peek(), ms(5000));
    }
}
