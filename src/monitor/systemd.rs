//! systemd monitors: a unit's health on the monitor's interval, and its
//! repair.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::engine::PluginStatus;
use super::sources::SourceCounters;
use crate::policy::monitors::MonitorSpec;
use crate::report::{EventKind, Reporter};

/// What one look at a unit found.
pub(super) struct UnitHealth {
    pub(super) healthy: bool,
    pub(super) message: String,
    /// Realtime microseconds of the unit's last start (0: never started).
    pub(super) started_usec: u64,
    /// The same start on the monotonic clock (0: never started or not
    /// said): the repair cooldown is measured by it, so a wall-clock step
    /// neither repairs a unit that just started nor holds back one that
    /// has been failing for long.
    pub(super) started_monotonic_usec: u64,
}

pub(super) async fn unit_health(
    conn: &zbus::Connection,
    src: &crate::policy::monitors::SystemdUnitSource,
    probers: Option<&crate::probe::prober::Probers>,
) -> Result<UnitHealth, zbus::Error> {
    let manager = zbus_systemd::systemd1::ManagerProxy::new(conn).await?;
    let (active, mut message, started_usec, started_monotonic_usec) =
        match manager.get_unit(src.unit.clone()).await {
            Ok(path) => unit_state(conn, &src.unit, path).await?,
            Err(zbus::Error::MethodError(name, msg, _))
                if name.as_str() == "org.freedesktop.systemd1.NoSuchUnit" =>
            {
                let message = format!(
                    "{} is not loaded{}",
                    src.unit,
                    msg.map(|m| format!(" ({m})")).unwrap_or_default()
                );
                (false, message, 0, 0)
            }
            Err(e) => return Err(e),
        };
    // The unit's state decides, unless the health URL alone does.
    let mut healthy = active || (!src.require_active && src.health_url.is_some());
    if healthy && let (Some(url), Some(p)) = (&src.health_url, probers) {
        let action = crate::probe::prober::Action::Http {
            url: url.clone(),
            headers: Vec::new(),
            status: (200, 299),
            body_contains: None,
            insecure: true,
        };
        let timeout = Duration::from_secs(src.health_timeout_seconds.unwrap_or(5).max(1).into());
        match p.run(&action, timeout).await {
            Ok(o) if o.result == crate::probe::core::ProbeResult::Success => {}
            Ok(o) => {
                healthy = false;
                message = format!("{message}, but {url} answers: {}", o.detail);
            }
            Err(e) => {
                // Not checked: the unit's state stands, when it decides;
                // when the URL alone decides, nothing says healthy.
                healthy = active;
                message = format!("{message} ({url} not checked: {e})");
            }
        }
    }
    Ok(UnitHealth {
        healthy,
        message: format!("{message}."),
        started_usec,
        started_monotonic_usec,
    })
}

/// A loaded unit's state: (active, what to say of it, its last start in
/// realtime and monotonic microseconds).
async fn unit_state(
    conn: &zbus::Connection,
    name: &str,
    path: zbus::OwnedObjectPath,
) -> Result<(bool, String, u64, u64), zbus::Error> {
    use zbus::proxy::CacheProperties;
    let unit = zbus_systemd::systemd1::UnitProxy::builder(conn)
        .path(path.clone())
        .cache_properties(CacheProperties::No)
        .build()
        .await?;
    let active = unit.active_state().await?;
    let sub = unit.sub_state().await.unwrap_or_default();
    let started_usec = unit.inactive_exit_timestamp().await.unwrap_or(0);
    let started_monotonic_usec = unit.inactive_exit_timestamp_monotonic().await.unwrap_or(0);
    let restarts = match zbus_systemd::systemd1::ServiceProxy::builder(conn)
        .path(path)
        .cache_properties(CacheProperties::No)
        .build()
        .await
    {
        Ok(s) => s.n_restarts().await.ok(),
        Err(_) => None,
    };
    let since = jiff::Timestamp::from_microsecond(started_usec as i64)
        .ok()
        .filter(|_| started_usec > 0)
        .map(|t| format!(", last started {}", t.strftime("%Y-%m-%dT%H:%M:%SZ")))
        .unwrap_or_default();
    let restarts = restarts
        .map(|n| format!(", restarted {n} time(s)"))
        .unwrap_or_default();
    Ok((
        active == "active",
        format!("{name} is {active} ({sub}){restarts}{since}"),
        started_usec,
        started_monotonic_usec,
    ))
}

/// Checks a systemd unit on the monitor's interval, reports each verdict to
/// the monitor's rules and, when asked, repairs it once it has been up for
/// the cooldown (never in a loop: a restart resets the clock).
#[allow(clippy::too_many_arguments)]
pub(super) async fn run_service_checks(
    spec: MonitorSpec,
    src: crate::policy::monitors::SystemdUnitSource,
    tx: mpsc::Sender<(usize, PluginStatus, String)>,
    system_bus: Option<String>,
    reporter: Reporter,
    counters: Arc<SourceCounters>,
    stop: CancellationToken,
) {
    let probers = src
        .health_url
        .as_ref()
        .map(|_| crate::probe::prober::Probers::new());
    let mut conn: Option<zbus::Connection> = None;
    let mut last_repair: Option<tokio::time::Instant> = None;
    let mut interval =
        tokio::time::interval(Duration::from_secs(src.interval_seconds.max(1).into()));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = interval.tick() => {}
        }
        counters.lines.fetch_add(1, Ordering::Relaxed);
        if conn.is_none() {
            let c = match &system_bus {
                Some(a) => zbus::connection::Builder::address(a.as_str()).build().await,
                None => zbus::Connection::system().await,
            };
            match c {
                Ok(c) => conn = Some(c),
                Err(e) => {
                    tracing::warn!(unit = %src.unit, error = %e, "cannot reach systemd on the system bus");
                    continue;
                }
            }
        }
        let c = conn.as_ref().expect("connected above");
        let health = match unit_health(c, &src, probers.as_ref()).await {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(unit = %src.unit, error = %e, "cannot read the unit's state; reconnecting");
                conn = None;
                continue;
            }
        };
        let status = if health.healthy {
            PluginStatus::Ok
        } else {
            PluginStatus::Problem
        };
        for i in 0..spec.rules.len() {
            let _ = tx.send((i, status, health.message.clone())).await;
        }
        let Some(repair) = &src.repair else { continue };
        if health.healthy || health.started_usec == 0 {
            continue;
        }
        let cooldown = Duration::from_secs(repair.cooldown_seconds.into());
        let up = if health.started_monotonic_usec > 0 {
            crate::clock::system_monotonic()
                .saturating_sub(Duration::from_micros(health.started_monotonic_usec))
        } else {
            let now_usec = jiff::Timestamp::now().as_microsecond().max(0) as u64;
            Duration::from_micros(now_usec.saturating_sub(health.started_usec))
        };
        let recent = last_repair.is_some_and(|t| t.elapsed() < cooldown);
        if up < cooldown || recent {
            tracing::info!(unit = %src.unit, up = ?up, cooldown = ?cooldown, "unit unhealthy; within its repair cooldown");
            continue;
        }
        let manager = match zbus_systemd::systemd1::ManagerProxy::new(c).await {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "cannot reach systemd to repair");
                continue;
            }
        };
        match manager
            .kill_unit(src.unit.clone(), "main".into(), repair.signal.number())
            .await
        {
            Ok(()) => {
                last_repair = Some(tokio::time::Instant::now());
                let note = format!(
                    "nodeguard repaired {}: it was unhealthy ({}) after {}s up, so its main process was sent {} for systemd to restart it; no further repair for {}s.",
                    src.unit,
                    health.message.trim_end_matches('.'),
                    up.as_secs(),
                    repair.signal.name(),
                    cooldown.as_secs()
                );
                tracing::warn!("{note}");
                reporter.event(EventKind::Warning, "ServiceRepaired", "RepairService", note);
            }
            Err(e) => tracing::error!(unit = %src.unit, error = %e, "repair (KillUnit) failed"),
        }
    }
}
