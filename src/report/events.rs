//! Decision core of the event recorder: a token bucket per reason, so a
//! flapping source cannot flood the API server with Events.

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

#[derive(Debug)]
pub struct RateLimiter {
    burst: u32,
    refill: Duration,
    buckets: HashMap<String, Bucket>,
}

#[derive(Debug)]
struct Bucket {
    tokens: u32,
    last_refill: Instant,
}

impl RateLimiter {
    /// Each reason may send `burst` events at once, then one per `refill`.
    pub fn new(burst: u32, refill: Duration) -> Self {
        RateLimiter {
            burst: burst.max(1),
            refill: refill.max(Duration::from_millis(1)),
            buckets: HashMap::new(),
        }
    }

    /// Takes a token for `reason` if one is left.
    pub fn allow(&mut self, reason: &str, now: Instant) -> bool {
        let burst = self.burst;
        let bucket = self.buckets.entry(reason.to_string()).or_insert(Bucket {
            tokens: burst,
            last_refill: now,
        });
        let elapsed = now.saturating_duration_since(bucket.last_refill);
        let earned = (elapsed.as_nanos() / self.refill.as_nanos()) as u32;
        if earned > 0 {
            bucket.tokens = bucket.tokens.saturating_add(earned).min(burst);
            bucket.last_refill += self.refill * earned;
            if bucket.tokens == burst {
                bucket.last_refill = now;
            }
        }
        if bucket.tokens > 0 {
            bucket.tokens -= 1;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burst_then_one_per_refill_per_reason() {
        let t0 = Instant::now();
        let mut rl = RateLimiter::new(3, Duration::from_secs(10));
        assert!((0..3).all(|_| rl.allow("A", t0)));
        assert!(!rl.allow("A", t0));
        assert!(rl.allow("B", t0), "reasons are independent");
        assert!(!rl.allow("A", t0 + Duration::from_secs(9)));
        assert!(rl.allow("A", t0 + Duration::from_secs(10)));
        assert!(!rl.allow("A", t0 + Duration::from_secs(11)));
        assert!(rl.allow("A", t0 + Duration::from_secs(20)));
    }

    #[test]
    fn tokens_never_exceed_the_burst_after_a_long_quiet() {
        let t0 = Instant::now();
        let mut rl = RateLimiter::new(2, Duration::from_secs(1));
        assert!(rl.allow("A", t0));
        let later = t0 + Duration::from_secs(3600);
        assert!(rl.allow("A", later) && rl.allow("A", later));
        assert!(!rl.allow("A", later));
    }

    #[test]
    fn a_flood_is_cut_to_burst_plus_refills() {
        let t0 = Instant::now();
        let mut rl = RateLimiter::new(10, Duration::from_secs(30));
        // 10,000 events over 60 s.
        let allowed = (0..10_000)
            .filter(|i| rl.allow("Flood", t0 + Duration::from_millis(*i as u64 * 6)))
            .count();
        assert_eq!(allowed, 10 + 1); // burst, plus one refill at 30 s (60 s is not reached)
    }
}
