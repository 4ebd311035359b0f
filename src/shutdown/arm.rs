//! Arming: connect to logind, subscribe, make sure its inhibit delay is
//! long enough (a drop-in and a reload when the policy needs more), take
//! the delay inhibitor.

use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::sleep;

use super::ClusterPort;
use super::core;
use super::logind::{self, InhibitLock, LogindEvent};
use super::startup::shutdown_under_way;
use super::{Ctx, ShutdownConfig, ShutdownError};
use super::{LogindConnector, LogindPort};
use crate::report::EventKind;

/// Connects to logind, subscribes, makes sure the inhibit delay suffices
/// and takes the lock; on failure, the condition reason and message. The
/// last part is `true` when logind refused a lock because a shutdown has
/// begun, and the lock returned is the handed-over one it waits on: the
/// caller begins that shutdown.
#[allow(clippy::type_complexity)]
pub(super) async fn connect_and_arm<L: LogindConnector, C: ClusterPort>(
    ctx: &Ctx<C>,
    logind: &L,
    cfg: &ShutdownConfig,
    take_lock: bool,
    reclaimed: &mut Option<InhibitLock>,
) -> Result<
    (
        L::Port,
        mpsc::Receiver<LogindEvent>,
        Duration,
        Option<InhibitLock>,
        bool,
    ),
    (&'static str, String),
> {
    let port = logind.connect().await.map_err(|e| {
        ("LogindUnavailable", format!(
            "nodeguard cannot reach systemd-logind on the system bus ({e}); without it a shutdown would not wait for pods. Mount /run/dbus/system_bus_socket and check that logind runs."
        ))
    })?;
    let events = port.events().await.map_err(|e| {
        ("LogindUnavailable", format!(
            "nodeguard cannot subscribe to systemd-logind's signals ({e}); a shutdown would not wait for pods."
        ))
    })?;
    let delay_max = ensure_delay(ctx, &port, cfg).await.map_err(|e| {
        ("LogindUnavailable", format!(
            "systemd-logind does not answer on the system bus ({e}); a shutdown would not wait for pods."
        ))
    })?;
    if let Some(lock) = reclaimed.take() {
        if !(take_lock && lock.is_handed_over()) {
            return Ok((port, events, delay_max, Some(lock), false));
        }
        // The handover unit's: this process's own first, then the unit
        // goes (the node is never without one). Kept on a refusal.
        match port.inhibit(&why(cfg)).await {
            Ok(own) => {
                drop(lock);
                // The handover is over: a holder on its way out notes
                // nothing more (this process sees a shutdown itself now).
                super::holder::forget(&ctx.state_dir, &ctx.state_writes);
                return Ok((port, events, delay_max, Some(own), false));
            }
            Err(e) => {
                // Refused because a shutdown began since start-up (logind
                // takes no new delay lock then): the handed-over lock is
                // the one logind waits on, and the caller begins it.
                if shutdown_under_way(&port).await {
                    return Ok((port, events, delay_max, Some(lock), true));
                }
                *reclaimed = Some(lock);
                return Err((
                    "InhibitorRefused",
                    format!(
                        "systemd-logind refused nodeguard's delay inhibitor ({e}); the one the previous agent handed over is held until it ends, then a shutdown would not wait for pods."
                    ),
                ));
            }
        }
    }
    if !take_lock {
        return Ok((port, events, delay_max, None, false));
    }
    // Its copy goes to the keeper only once a shutdown starts: an agent
    // crash-looping while armed must not hold every shutdown of the node
    // for logind's whole delay.
    let lock = port.inhibit(&why(cfg)).await.map_err(|e| {
        ("InhibitorRefused", format!(
            "systemd-logind refused nodeguard's delay inhibitor ({e}); a shutdown would not wait for pods."
        ))
    })?;
    Ok((port, events, delay_max, Some(lock), false))
}

pub(super) fn why(cfg: &ShutdownConfig) -> String {
    format!(
        "nodeguard moves pods off the node in {} priority group(s) within {}s",
        cfg.groups.len(),
        core::total_grace(&cfg.groups).as_secs()
    )
}

/// Reads logind's maximum delay and, when the policy needs more, writes
/// the drop-in, makes logind reload, and reads it back.
pub(super) async fn ensure_delay<P: LogindPort, C: ClusterPort>(
    ctx: &Ctx<C>,
    port: &P,
    cfg: &ShutdownConfig,
) -> Result<Duration, ShutdownError> {
    let needed = cfg.needed_delay();
    ctx.metrics.inhibit_delay_needed.set(needed.as_secs_f64());
    ctx.metrics.declare_groups(cfg);
    let mut current = port.inhibit_delay_max().await?;
    if current < needed
        && let Some(dir) = &cfg.drop_in_dir
    {
        match logind::write_drop_in(dir, needed) {
            Ok(path) => {
                tracing::info!(path = %path.display(), current = ?current, needed = ?needed, "raising logind's InhibitDelayMaxSec");
                if let Err(e) = port.reload().await {
                    tracing::warn!(error = %e, "cannot make logind reload its configuration");
                }
                // logind applies the drop-in when it handles SIGHUP.
                for _ in 0..20 {
                    sleep(Duration::from_millis(100)).await;
                    current = port.inhibit_delay_max().await?;
                    if current >= needed {
                        break;
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot write the logind drop-in"),
        }
    }
    ctx.metrics.inhibit_delay_max.set(current.as_secs_f64());
    if current < needed {
        let message =
            core::availability(&cfg.readiness(current), cfg.drop_in_dir.as_deref()).message;
        tracing::warn!("{message}");
        ctx.reporter.event(
            EventKind::Warning,
            "InhibitDelayTooShort",
            "CheckLogind",
            message,
        );
    }
    Ok(current)
}
