//! Decision core of the watchdog: intervals and whether to pet.

use std::time::Duration;

use super::WatchdogError;
use crate::server::HealthReport;

/// systemd's watchdog timeout must exceed this, as for the kubelet: a
/// shorter one cannot be served reliably.
pub const MIN_SYSTEMD_TIMEOUT: Duration = Duration::from_secs(1);

/// The systemd watchdog timeout from `WATCHDOG_USEC` / `WATCHDOG_PID`, as
/// sd_watchdog_enabled(3) reads them: `None` when the watchdog is off or
/// meant for another process.
pub fn systemd_timeout(
    watchdog_usec: Option<&str>,
    watchdog_pid: Option<&str>,
    my_pid: u32,
) -> Result<Option<Duration>, WatchdogError> {
    let Some(usec) = watchdog_usec else {
        return Ok(None);
    };
    if let Some(pid) = watchdog_pid {
        let pid: u32 = pid.trim().parse().map_err(|_| {
            WatchdogError::BadEnvironment(format!("WATCHDOG_PID={pid:?} is not a process id"))
        })?;
        if pid != my_pid {
            return Ok(None);
        }
    }
    let usec: u64 = usec.trim().parse().map_err(|_| {
        WatchdogError::BadEnvironment(format!(
            "WATCHDOG_USEC={usec:?} is not a number of microseconds"
        ))
    })?;
    if usec == 0 {
        return Ok(None);
    }
    let timeout = Duration::from_micros(usec);
    if timeout <= MIN_SYSTEMD_TIMEOUT {
        return Err(WatchdogError::TimeoutTooShort(timeout));
    }
    Ok(Some(timeout))
}

/// systemd is sent `WATCHDOG=1` every half of its timeout.
pub fn systemd_pet_interval(timeout: Duration) -> Duration {
    timeout / 2
}

/// The device is petted every `percent` of its timeout (at least 1 s).
pub fn device_pet_interval(timeout_seconds: u32, percent: u8) -> Duration {
    let ms = u64::from(timeout_seconds) * 1000 * u64::from(percent.clamp(1, 100)) / 100;
    Duration::from_millis(ms.max(1000))
}

/// Why a pet was skipped; the label of `nodeguard_watchdog_skipped_pets_total`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Skip {
    /// Loops stuck past their timeout (the `/livez` rule).
    StuckLoops(Vec<String>),
    /// `requireApiServer` is on and the API server did not answer.
    ApiServerUnreachable,
}

impl Skip {
    /// Every value [`Skip::label`] returns.
    pub const LABELS: [&'static str; 2] = ["stuck_loop", "api_server_unreachable"];

    pub fn label(&self) -> &'static str {
        match self {
            Skip::StuckLoops(_) => "stuck_loop",
            Skip::ApiServerUnreachable => "api_server_unreachable",
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Skip::StuckLoops(loops) => {
                format!(
                    "loops stuck past their timeout or stopped: {}",
                    loops.join(", ")
                )
            }
            Skip::ApiServerUnreachable => {
                "the API server does not answer and requireApiServer is on".into()
            }
        }
    }
}

/// What the `requireApiServer` probe asks: the API server's liveness
/// without its etcd check. The question is whether this node reaches the
/// API server, not whether the control plane is healthy: `/livez` alone
/// fails (500) on every API server while etcd is down or slow (its check
/// allows 2 s), so a control-plane outage would withhold the pets of every
/// node that set the flag. RBAC and API Priority and Fairness match the
/// path only, so the query keeps `/livez`'s access and exemption; a name
/// an API server does not know is ignored by it (a warning line only in a
/// failing or verbose answer), not refused.
pub const API_PROBE_PATH: &str = "/livez?exclude=etcd";

/// How long the probe waits for the answer to [`API_PROBE_PATH`]. No pet
/// waits for it (see [`ApiVerdict`]), but an answer counts for one probe
/// interval plus this.
pub const API_PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Whether the API server's answer to [`API_PROBE_PATH`] means it is there
/// for `requireApiServer`, which fences a node cut off from the control
/// plane: any answer that only a live API server gives.
/// - A 2xx.
/// - A 429: shedding load, up and busy.
/// - A 401 or 403: the agent's token refused (its Pod deleted, its
///   ServiceAccount's token revoked), or RBAC not loaded yet just after a
///   restart. The API server answered, the node is not cut off, and a
///   reset would not mend the token.
/// - A 500 whose body is the API server's own report of a failing liveness
///   check (`livez check failed`, such as a post-start hook not done while
///   a restarted API server catches up under a reconnecting fleet): the
///   API server wrote it, so it is there.
///
/// Not any other 5xx (a load balancer in front of the API server with
/// nothing behind it), a redirect or a 404 (not an API server).
pub fn api_answered(status: u16, body: &[u8]) -> bool {
    const CHECK_FAILED: &[u8] = b"livez check failed";
    (200..300).contains(&status)
        || matches!(status, 401 | 403 | 429)
        || (status == 500 && body.windows(CHECK_FAILED.len()).any(|w| w == CHECK_FAILED))
}

/// Whether a pet may go, by the `requireApiServer` probe. The probe runs
/// on its own schedule (one probe per pet interval, the next begun once
/// the last answered) and no pet waits for it: a slow answer, within
/// [`API_PROBE_TIMEOUT`], delays no pet. From `last` (`Some((answered,
/// when))`), when the probe in flight began (`probing_since`) and the
/// probe's interval:
/// - an answer counts for one interval plus the probe's timeout, the
///   longest a live API server leaves between two answers; a failed
///   answer is a skip at once;
/// - before the first answer (the agent's start, the flag set by a policy
///   edit) pets go on for the first probe's timeout: waiting for it could
///   outlast a short watchdog timeout, and the next pets skip if the
///   probe fails.
pub fn api_ok(
    last: Option<(bool, tokio::time::Instant)>,
    probing_since: Option<tokio::time::Instant>,
    now: tokio::time::Instant,
    interval: Duration,
) -> bool {
    match last {
        Some((answered, at)) => {
            answered && now.saturating_duration_since(at) <= interval + API_PROBE_TIMEOUT
        }
        None => now < probing_since.unwrap_or(now) + API_PROBE_TIMEOUT,
    }
}

/// The first retry after a failed probe; each further failure doubles
/// it, up to the probe's interval.
pub const API_PROBE_RETRY: Duration = Duration::from_secs(1);

/// When the next `requireApiServer` probe begins, from the last answer
/// (`Some((answered, when))`), the failed answers in a row and the probe's
/// interval in force now (a policy edit that shortens it moves the next
/// probe forward with it, so the last answer never expires before the next
/// one is asked for). After a failure it asks again soon (1 s, doubling up
/// to the interval): one brief error skips no more than the pets until
/// the retry's answer, and a long outage is asked once an interval.
pub fn api_probe_due(
    last: Option<(bool, tokio::time::Instant)>,
    failures: u32,
    interval: Duration,
    now: tokio::time::Instant,
) -> tokio::time::Instant {
    match last {
        None => now,
        Some((true, at)) => at + interval,
        Some((false, at)) => {
            let retry =
                API_PROBE_RETRY.saturating_mul(1 << failures.clamp(1, 16).saturating_sub(1));
            at + retry.min(interval)
        }
    }
}

/// How often the `requireApiServer` probe asks: one pet interval after the
/// last answer, the shortest of the targets petted (`None` when nothing is
/// petted).
pub fn api_probe_interval(systemd: Option<Duration>, device: Option<Duration>) -> Option<Duration> {
    match (systemd, device) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Pet only when every check passes: the health registry is live and,
/// when required, the API server answered (`api_ok` is `None` when not
/// required). Node eligibility does not gate petting: a node being drained
/// is still a healthy node.
pub fn gate(report: &HealthReport, api_ok: Option<bool>) -> Result<(), Skip> {
    if !report.live {
        return Err(Skip::StuckLoops(
            report
                .stuck_loops()
                .into_iter()
                .map(str::to_string)
                .collect(),
        ));
    }
    if api_ok == Some(false) {
        return Err(Skip::ApiServerUnreachable);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::Health;

    #[test]
    fn systemd_timeout_from_the_environment() {
        let me = 4242;
        assert_eq!(systemd_timeout(None, None, me).unwrap(), None);
        assert_eq!(
            systemd_timeout(Some("30000000"), None, me).unwrap(),
            Some(Duration::from_secs(30))
        );
        assert_eq!(
            systemd_timeout(Some("30000000"), Some("4242"), me).unwrap(),
            Some(Duration::from_secs(30))
        );
        assert_eq!(
            systemd_timeout(Some("30000000"), Some("1"), me).unwrap(),
            None,
            "another process's"
        );
        assert_eq!(systemd_timeout(Some("0"), None, me).unwrap(), None);
        assert!(matches!(
            systemd_timeout(Some("1000000"), None, me),
            Err(WatchdogError::TimeoutTooShort(_))
        ));
        assert!(matches!(
            systemd_timeout(Some("500000"), None, me),
            Err(WatchdogError::TimeoutTooShort(_))
        ));
        assert!(
            systemd_timeout(Some("1000001"), None, me)
                .unwrap()
                .is_some()
        );
        assert!(matches!(
            systemd_timeout(Some("ten"), None, me),
            Err(WatchdogError::BadEnvironment(_))
        ));
        assert!(matches!(
            systemd_timeout(Some("10"), Some("x"), me),
            Err(WatchdogError::BadEnvironment(_))
        ));
    }

    #[test]
    fn intervals() {
        assert_eq!(
            systemd_pet_interval(Duration::from_secs(30)),
            Duration::from_secs(15)
        );
        assert_eq!(
            systemd_pet_interval(Duration::from_millis(2500)),
            Duration::from_millis(1250)
        );
        assert_eq!(device_pet_interval(60, 33), Duration::from_millis(19_800));
        assert_eq!(device_pet_interval(60, 50), Duration::from_secs(30));
        assert_eq!(
            device_pet_interval(2, 10),
            Duration::from_secs(1),
            "never below 1 s"
        );
        assert_eq!(device_pet_interval(3600, 10), Duration::from_secs(360));
    }

    #[test]
    fn what_counts_as_the_api_server_answering() {
        let failed = b"[+]ping ok\n[+]log ok\n[-]poststarthook/rbac/bootstrap-roles failed: reason withheld\nlivez check failed\n";
        for (status, body, answered) in [
            (200, &b"ok"[..], true),
            (204, b"", true),
            (429, b"Too many requests, please try again later.\n", true),
            (401, b"{\"kind\":\"Status\"}", true),
            (403, b"{\"kind\":\"Status\"}", true),
            (500, &failed[..], true),
            (500, b"livez check failed", true),
            (500, b"", false),
            (500, b"Internal Server Error", false),
            (502, &failed[..], false),
            (503, b"no healthy upstream", false),
            (504, b"", false),
            (301, b"", false),
            (404, b"404 page not found\n", false),
        ] {
            assert_eq!(
                api_answered(status, body),
                answered,
                "{status} {:?}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn the_probe_asks_as_often_as_the_most_frequent_pet() {
        let s = Duration::from_secs;
        assert_eq!(api_probe_interval(None, None), None);
        assert_eq!(api_probe_interval(Some(s(15)), None), Some(s(15)));
        assert_eq!(api_probe_interval(None, Some(s(20))), Some(s(20)));
        assert_eq!(api_probe_interval(Some(s(15)), Some(s(10))), Some(s(10)));
        assert_eq!(api_probe_interval(Some(s(1)), Some(s(10))), Some(s(1)));
    }

    #[tokio::test(start_paused = true)]
    async fn when_the_next_probe_begins() {
        let s = Duration::from_secs;
        let t0 = tokio::time::Instant::now();
        let now = t0 + s(100);
        for (last, failures, interval, due) in [
            // None yet: at once.
            (None, 0, s(15), now),
            // One interval after an answer, the interval in force now: a
            // policy edit that shortened it moves the probe forward.
            (Some((true, t0)), 0, s(15), t0 + s(15)),
            (Some((true, t0)), 0, s(300), t0 + s(300)),
            (Some((true, t0)), 0, s(30), t0 + s(30)),
            // After failures: 1 s, doubling, never past the interval.
            (Some((false, t0)), 1, s(15), t0 + s(1)),
            (Some((false, t0)), 2, s(15), t0 + s(2)),
            (Some((false, t0)), 4, s(15), t0 + s(8)),
            (Some((false, t0)), 5, s(15), t0 + s(15)),
            (Some((false, t0)), 40, s(15), t0 + s(15)),
            (Some((false, t0)), 3, s(1), t0 + s(1)),
        ] {
            assert_eq!(
                api_probe_due(last, failures, interval, now),
                due,
                "{last:?} {failures} {interval:?}"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn what_a_pet_makes_of_the_probes_last_answer() {
        let s = Duration::from_secs;
        let t0 = tokio::time::Instant::now();
        let interval = s(1);
        let fresh = interval + API_PROBE_TIMEOUT;
        for (last, probing, now, ok) in [
            // An answer counts for an interval plus the probe's timeout.
            (Some((true, t0)), None, t0, true),
            (Some((true, t0)), Some(t0), t0 + fresh, true),
            (Some((true, t0)), None, t0 + fresh + s(1), false),
            // A slow probe in flight: the last answer still counts.
            (Some((true, t0)), Some(t0 + s(1)), t0 + s(5), true),
            // A failed answer is a skip at once, however recent.
            (Some((false, t0)), None, t0, false),
            (Some((false, t0)), Some(t0 + s(1)), t0 + s(2), false),
            // None yet: pets go on for the first probe's timeout.
            (None, None, t0, true),
            (None, Some(t0), t0 + s(2), true),
            (None, Some(t0), t0 + API_PROBE_TIMEOUT, false),
            (None, Some(t0), t0 + s(9), false),
        ] {
            assert_eq!(
                api_ok(last, probing, now, interval),
                ok,
                "{last:?} {probing:?} {:?}",
                now - t0
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn gating_on_a_stuck_loop_and_the_api_server() {
        let h = Health::new();
        let l = h.register("probe-manager", Duration::from_secs(5));
        assert_eq!(gate(&h.report(), None), Ok(()));
        assert_eq!(gate(&h.report(), Some(true)), Ok(()));
        assert_eq!(
            gate(&h.report(), Some(false)),
            Err(Skip::ApiServerUnreachable)
        );
        l.queued();
        tokio::time::advance(Duration::from_secs(5)).await;
        let skip = gate(&h.report(), Some(true)).unwrap_err();
        assert_eq!(skip, Skip::StuckLoops(vec!["probe-manager".into()]));
        assert_eq!(skip.label(), "stuck_loop");
        for s in [Skip::StuckLoops(vec![]), Skip::ApiServerUnreachable] {
            assert!(Skip::LABELS.contains(&s.label()), "{s:?}");
        }
        assert!(skip.describe().contains("probe-manager"));
        l.updated();
        assert_eq!(gate(&h.report(), None), Ok(()));
        // Ineligibility does not stop petting.
        h.set_node_eligible("node", false, None);
        assert_eq!(gate(&h.report(), None), Ok(()));
    }
}
