//! systemd-logind over D-Bus (zbus): the delay inhibitor, the maximum
//! inhibit delay, `PrepareForShutdown`, and making logind reload a drop-in
//! (SIGHUP through systemd's `KillUnit`).

use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::mpsc;
use zbus::proxy::CacheProperties;
use zbus_systemd::login1::ManagerProxy as LoginManager;
use zbus_systemd::systemd1::ManagerProxy as SystemdManager;
use zbus_systemd::systemd1::{ServiceProxy, UnitProxy};

use super::keep::{self, Keeper};
use super::{LogindConnector, LogindPort, ShutdownError};

/// Something logind told us.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogindEvent {
    /// `PrepareForShutdown(true)`: the host is going down; `false`: cancelled.
    PrepareForShutdown(bool),
    /// logind left the bus, or the bus connection broke.
    Gone,
}

/// A held delay inhibitor. Dropping it releases the lock: it closes this
/// process's descriptor and takes the copy out of the keeper, if one holds
/// it. A process killed without dropping it leaves the keeper's copy, so
/// logind keeps waiting until the restarted agent takes it back.
///
/// A lock handed over by the previous pod ([`HANDOVER_UNIT`]) has no
/// descriptor here: the holder is a host unit, and dropping the lock stops
/// that unit.
pub struct InhibitLock {
    fd: Option<OwnedFd>,
    kept: Option<Keeper>,
    end: Option<Box<dyn FnOnce() + Send + Sync>>,
}

impl std::fmt::Debug for InhibitLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InhibitLock")
            .field("fd", &self.fd)
            .field("kept", &self.kept)
            .field("handed_over", &self.end.is_some())
            .finish()
    }
}

impl InhibitLock {
    /// A lock only this process holds.
    pub fn new(fd: OwnedFd) -> Self {
        InhibitLock {
            fd: Some(fd),
            kept: None,
            end: None,
        }
    }

    /// Leaves a copy with `keeper` unless it holds one already (a failure
    /// is logged: the lock is still held, only not beyond this process).
    /// A handed-over lock has no copy to leave: its holder outlives the
    /// agent anyway.
    pub fn kept_by(mut self, keeper: &Keeper) -> Self {
        let Some(fd) = &self.fd else { return self };
        if *keeper == Keeper::None || self.kept.is_some() {
            return self;
        }
        match keeper.keep(keep::INHIBITOR, fd.as_fd()) {
            Ok(()) => {
                tracing::debug!(%keeper, "the delay inhibitor is kept beyond this process");
                self.kept = Some(keeper.clone());
            }
            Err(e) => tracing::warn!(
                %keeper, error = %e,
                "cannot leave the delay inhibitor with its keeper: should the agent be killed during a shutdown, logind goes on at once"
            ),
        }
        self
    }

    /// A lock a previous process of the agent left with `keeper`.
    pub fn reclaimed(fd: OwnedFd, keeper: &Keeper) -> Self {
        InhibitLock {
            fd: Some(fd),
            kept: Some(keeper.clone()),
            end: None,
        }
    }

    /// The lock the previous pod's agent handed over to a host unit;
    /// `end` stops that unit (called when the lock is dropped).
    pub fn handed_over(end: impl FnOnce() + Send + Sync + 'static) -> Self {
        InhibitLock {
            fd: None,
            kept: None,
            end: Some(Box::new(end)),
        }
    }

    /// Held by the handover unit, not by this process.
    pub fn is_handed_over(&self) -> bool {
        self.end.is_some()
    }

    /// Lets go of a handed-over lock without stopping its unit: this
    /// agent stops before it took one of its own, and the next agent takes
    /// the unit's over as this one did.
    pub fn leave(mut self) {
        self.end = None;
    }
}

impl Drop for InhibitLock {
    fn drop(&mut self) {
        if let Some(k) = self.kept.take()
            && let Err(e) = k.forget(keep::INHIBITOR)
        {
            tracing::warn!(keeper = %k, error = %e, "cannot take the delay inhibitor out of its keeper");
        }
        if let Some(end) = self.end.take() {
            end();
        }
    }
}

/// The transient unit an agent whose pod is going away (a rollout, not an
/// uninstall) leaves holding a delay inhibitor of its own, so the node is
/// not without one until the next pod's agent has taken its lock; that
/// agent stops it. It ends by itself after its life (the agent's
/// `--inhibitor-handover-seconds`) should no agent come.
pub const HANDOVER_UNIT: &str = "nodeguard-inhibitor-handover.service";

/// The `who` of the handover unit's inhibitor, as logind lists it.
pub const HANDOVER_WHO: &str = "nodeguard-handover";

/// The host's `systemd-inhibit`, which the handover unit runs.
const SYSTEMD_INHIBIT: &str = "/usr/bin/systemd-inhibit";

/// How long nodeguard's holder may take to show in logind's list, at most;
/// the host's `systemd-inhibit` keeps at least `FALLBACK_WAIT` of the
/// handover's time (the caller's `within`, inside the stop's question).
const HOLDER_WAIT: Duration = Duration::from_millis(2500);
const FALLBACK_WAIT: Duration = Duration::from_millis(1500);

/// The holder runs as root on the host: no more than it needs (the system
/// bus's socket, its state directory).
fn holder_sandbox(h: &super::HolderCommand) -> Vec<(String, zbus::OwnedVariant)> {
    let b = |v: bool| zbus::OwnedVariant::from(v);
    let s = |v: &str| zbus::OwnedVariant::from(zbus::Str::from(v.to_string()));
    let list = |v: Vec<String>| {
        zbus::OwnedVariant::try_from(zbus::Variant::from(v)).expect("a string array is a variant")
    };
    vec![
        ("NoNewPrivileges".into(), b(true)),
        (
            // CAP_SYS_BOOT only: logind lets a caller with it take a
            // shutdown inhibitor without asking polkit (which a host may
            // not have).
            "CapabilityBoundingSet".into(),
            zbus::OwnedVariant::from(1u64 << 22),
        ),
        ("ProtectSystem".into(), s("strict")),
        (
            "ReadWritePaths".into(),
            list(vec![h.state_dir.display().to_string()]),
        ),
        ("ProtectHome".into(), s("yes")),
        ("PrivateTmp".into(), b(true)),
        ("PrivateNetwork".into(), b(true)),
        // (allow-list, families): systemd's `true` is an allow-list.
        ("RestrictAddressFamilies".into(), {
            zbus::OwnedVariant::try_from(zbus::Variant::from((true, vec!["AF_UNIX".to_string()])))
                .expect("(bas) is a variant")
        }),
    ]
}

/// Connects to the system bus at `address` (`DBUS_SYSTEM_BUS_ADDRESS`), or
/// the default system bus.
#[derive(Clone, Debug)]
pub struct ZbusConnector {
    pub address: Option<String>,
}

impl LogindConnector for ZbusConnector {
    type Port = ZbusLogind;

    async fn connect(&self) -> Result<ZbusLogind, ShutdownError> {
        let conn = match &self.address {
            Some(a) => {
                zbus::connection::Builder::address(a.as_str())
                    .build()
                    .await?
            }
            None => zbus::Connection::system().await?,
        };
        let manager = LoginManager::builder(&conn)
            .cache_properties(CacheProperties::No)
            .build()
            .await?;
        Ok(ZbusLogind { conn, manager })
    }
}

/// logind through zbus_systemd's proxies.
pub struct ZbusLogind {
    conn: zbus::Connection,
    manager: LoginManager<'static>,
}

impl LogindPort for ZbusLogind {
    async fn inhibit_delay_max(&self) -> Result<Duration, ShutdownError> {
        // Not cached: the value changes when logind reloads its config.
        let usec = self.manager.inhibit_delay_max_u_sec().await?;
        Ok(Duration::from_micros(usec))
    }

    async fn inhibit(&self, why: &str) -> Result<InhibitLock, ShutdownError> {
        self.inhibit_as("nodeguard", why).await
    }

    async fn preparing_for_shutdown(&self) -> Result<bool, ShutdownError> {
        Ok(self.manager.preparing_for_shutdown().await?)
    }

    async fn hand_over(
        &self,
        why: &str,
        life: Duration,
        holder: Option<super::HolderCommand>,
        within: Duration,
    ) -> Result<(), ShutdownError> {
        let deadline = tokio::time::Instant::now() + within;
        let systemd = SystemdManager::new(&self.conn).await?;
        // One holder at a time: an earlier one nobody took (a rollout
        // whose next agent never armed) makes way, and a failed one is
        // reset. This process still holds its own lock meanwhile.
        let _ = clear_handover_unit(&systemd).await;
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let holder = match holder {
            Some(_) if left < FALLBACK_WAIT + Duration::from_secs(1) => {
                tracing::warn!(left = ?left, "too little of the handover's time left for nodeguard's holder; the host's systemd-inhibit holds the lock");
                None
            }
            h => h,
        };
        if let Some(h) = holder {
            let path = h.binary.display().to_string();
            // The rest, at least FALLBACK_WAIT, is systemd-inhibit's.
            let wait = HOLDER_WAIT.min(
                deadline
                    .saturating_duration_since(tokio::time::Instant::now())
                    .saturating_sub(FALLBACK_WAIT),
            );
            match self
                .run_holder(&systemd, &path, h.argv.clone(), holder_sandbox(&h), wait)
                .await
            {
                Ok(()) => {
                    tracing::info!(unit = HANDOVER_UNIT, holder = %path, "the handover unit holds the delay inhibitor (nodeguard's holder: a shutdown begun before the next agent takes over is noted with its start)");
                    return Ok(());
                }
                Err(e) => tracing::warn!(
                    unit = HANDOVER_UNIT,
                    error = %e,
                    "the handover unit could not hold the lock with nodeguard's copy; trying the host's systemd-inhibit (without it, a shutdown that begins before the next agent takes over is planned from when that agent finds it)"
                ),
            }
        }
        let argv = vec![
            "systemd-inhibit".to_string(),
            "--what=shutdown".into(),
            "--mode=delay".into(),
            format!("--who={HANDOVER_WHO}"),
            format!("--why={why}"),
            "sleep".into(),
            life.as_secs().max(1).to_string(),
        ];
        let wait = deadline.saturating_duration_since(tokio::time::Instant::now());
        self.run_holder(&systemd, SYSTEMD_INHIBIT, argv, Vec::new(), wait)
            .await?;
        tracing::info!(
            unit = HANDOVER_UNIT,
            holder = SYSTEMD_INHIBIT,
            "the handover unit holds the delay inhibitor (the host's systemd-inhibit)"
        );
        Ok(())
    }

    async fn take_handover(&self) -> Result<Option<InhibitLock>, ShutdownError> {
        if !self.handover_listed(None).await? {
            return Ok(None);
        }
        let conn = self.conn.clone();
        Ok(Some(InhibitLock::handed_over(move || {
            let Ok(rt) = tokio::runtime::Handle::try_current() else {
                return;
            };
            rt.spawn(async move {
                let stop = async {
                    SystemdManager::new(&conn)
                        .await?
                        .stop_unit(HANDOVER_UNIT.into(), "replace".into())
                        .await
                };
                match stop.await {
                    Ok(_) => tracing::info!(unit = HANDOVER_UNIT, "the handed-over delay inhibitor released"),
                    Err(e) => tracing::warn!(unit = HANDOVER_UNIT, error = %e, "cannot stop the handover unit; it ends by itself after its life (or, holding a noted shutdown, once logind no longer prepares it)"),
                }
            });
        })))
    }

    async fn reload(&self) -> Result<(), ShutdownError> {
        let systemd = SystemdManager::new(&self.conn).await?;
        systemd
            .kill_unit("systemd-logind.service".into(), "main".into(), libc::SIGHUP)
            .await?;
        Ok(())
    }

    async fn events(&self) -> Result<mpsc::Receiver<LogindEvent>, ShutdownError> {
        let mut shutdown = self.manager.receive_prepare_for_shutdown().await?;
        let mut owner = self.manager.inner().receive_owner_changed().await?;
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(async move {
            loop {
                let event = tokio::select! {
                    s = shutdown.next() => match s.map(|s| s.args().map(|a| a.start)) {
                        Some(Ok(start)) => LogindEvent::PrepareForShutdown(start),
                        Some(Err(e)) => {
                            tracing::warn!(error = %e, "malformed PrepareForShutdown signal ignored");
                            continue;
                        }
                        None => LogindEvent::Gone,
                    },
                    o = owner.next() => match o {
                        Some(Some(_)) => continue, // a new owner: we reconnect on Gone anyway
                        Some(None) | None => LogindEvent::Gone,
                    },
                    _ = tx.closed() => return,
                };
                let gone = event == LogindEvent::Gone;
                if tx.send(event).await.is_err() || gone {
                    return;
                }
            }
        });
        Ok(rx)
    }
}

/// Stops the handover unit and resets it should it have failed (so no
/// `systemctl --failed` entry stays); the stop's answer.
async fn clear_handover_unit(systemd: &SystemdManager<'_>) -> zbus::Result<()> {
    let stopped = systemd
        .stop_unit(HANDOVER_UNIT.into(), "replace".into())
        .await;
    let _ = systemd.reset_failed_unit(HANDOVER_UNIT.into()).await;
    stopped.map(drop)
}

impl ZbusLogind {
    /// Starts the handover unit running `path` with `argv`, and waits until
    /// logind lists the delay inhibitor of its main process (not a stopping
    /// predecessor's). A unit that fails or ends first, or is not listed
    /// within `wait`, is said (as systemd says it) and cleared.
    async fn run_holder(
        &self,
        systemd: &SystemdManager<'_>,
        path: &str,
        argv: Vec<String>,
        extra: Vec<(String, zbus::OwnedVariant)>,
        wait: Duration,
    ) -> Result<(), ShutdownError> {
        let result = self.start_and_wait(systemd, path, argv, extra, wait).await;
        if result.is_err() {
            // Said in the error; not left running (it would block the next
            // try) nor failed (`systemctl --failed`, a degraded system).
            let _ = clear_handover_unit(systemd).await;
        }
        result
    }

    async fn start_and_wait(
        &self,
        systemd: &SystemdManager<'_>,
        path: &str,
        argv: Vec<String>,
        extra: Vec<(String, zbus::OwnedVariant)>,
        wait: Duration,
    ) -> Result<(), ShutdownError> {
        let exec = vec![(path.to_string(), argv, false)];
        let mut props = vec![
            (
                "Description".to_string(),
                zbus::OwnedVariant::from(zbus::Str::from(
                    "nodeguard: the delay inhibitor between two agent pods",
                )),
            ),
            (
                "ExecStart".to_string(),
                zbus::OwnedVariant::try_from(zbus::Variant::from(exec))?,
            ),
        ];
        props.extend(extra);
        // The stopped unit may still be on its way out: a few tries.
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let props = props
                .iter()
                .map(|(k, v)| Ok((k.clone(), v.try_clone()?)))
                .collect::<Result<_, zbus::Error>>()?;
            match systemd
                .start_transient_unit(HANDOVER_UNIT.into(), "replace".into(), props, vec![])
                .await
            {
                Ok(_) => break,
                Err(zbus::Error::MethodError(name, ..))
                    if name.as_str() == "org.freedesktop.systemd1.UnitExists"
                        && tokio::time::Instant::now() < deadline =>
                {
                    let _ = systemd.reset_failed_unit(HANDOVER_UNIT.into()).await;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => return Err(e.into()),
            }
        }
        let unit_path = systemd.get_unit(HANDOVER_UNIT.into()).await?;
        let service = ServiceProxy::builder(&self.conn)
            .path(unit_path.clone())
            .cache_properties(CacheProperties::No)
            .build()
            .await?;
        let unit = UnitProxy::builder(&self.conn)
            .path(unit_path)
            .cache_properties(CacheProperties::No)
            .build()
            .await?;
        // Only once logind lists this unit's inhibitor (its main process's,
        // not a stopping predecessor's) may this process's go.
        while tokio::time::Instant::now() < deadline {
            let pid = service.main_pid().await.unwrap_or(0);
            if pid != 0 && self.handover_listed(Some(pid)).await? {
                return Ok(());
            }
            // Failed to start (a missing or non-executable file: systemd's
            // exit status 203) or ended in failure: no use waiting. Not
            // "inactive": the start job may still be queued.
            if unit.active_state().await.as_deref() == Ok("failed") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Why, as systemd says it.
        let state = async {
            let status = service.exec_main_status().await?;
            Ok::<_, zbus::Error>(format!(
                "{}, result {}, main process status {status}{}",
                unit.active_state().await?,
                service.result().await?,
                match status {
                    203 => " (the program could not be run: missing, or on a noexec mount)",
                    _ => "",
                }
            ))
        };
        let state = state
            .await
            .unwrap_or_else(|e| format!("state unknown: {e}"));
        Err(ShutdownError::Host(format!(
            "{HANDOVER_UNIT} ({path} on the host) did not hold a delay inhibitor within {wait:?}: {state}"
        )))
    }

    /// Takes a delay inhibitor for shutdown as `who` (the handover unit's
    /// holder takes it as [`HANDOVER_WHO`]).
    pub async fn inhibit_as(&self, who: &str, why: &str) -> Result<InhibitLock, ShutdownError> {
        let fd = self
            .manager
            .inhibit("shutdown".into(), who.into(), why.into(), "delay".into())
            .await?;
        Ok(InhibitLock::new(fd.into()))
    }

    /// Stops the handover unit, if one runs (an uninstall that came
    /// during a rollout); `true` when one held a lock (a failed one is
    /// only reset).
    pub async fn stop_handover(&self) -> Result<bool, ShutdownError> {
        let systemd = SystemdManager::new(&self.conn).await?;
        let held = self.handover_listed(None).await.unwrap_or(false);
        match clear_handover_unit(&systemd).await {
            Ok(_) => Ok(held),
            Err(zbus::Error::MethodError(name, ..))
                // No such unit, or no systemd on this bus (a test bus):
                // nothing to stop.
                if matches!(
                    name.as_str(),
                    "org.freedesktop.systemd1.NoSuchUnit"
                        | "org.freedesktop.DBus.Error.ServiceUnknown"
                        | "org.freedesktop.DBus.Error.NameHasNoOwner"
                ) =>
            {
                Ok(false)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// logind lists a delay inhibitor of the handover unit (of process
    /// `pid`, when given).
    async fn handover_listed(&self, pid: Option<u32>) -> Result<bool, ShutdownError> {
        Ok(self
            .manager
            .list_inhibitors()
            .await?
            .iter()
            .any(|(what, who, _, mode, _, p)| {
                who == HANDOVER_WHO
                    && mode == "delay"
                    && what.split(':').any(|w| w == "shutdown")
                    && pid.is_none_or(|pid| *p == pid)
            }))
    }
}

/// The drop-in nodeguard writes when logind's `InhibitDelayMaxSec` is
/// shorter than the policy needs.
pub const DROP_IN_NAME: &str = "99-nodeguard-inhibit-delay.conf";

/// How the drop-in begins: a file of its name that does not begin so is
/// someone else's (an uninstall leaves it).
pub const DROP_IN_MARK: &str = "# Written by nodeguard";

/// Writes `InhibitDelayMaxSec=` into `dir` atomically; returns the path.
pub fn write_drop_in(dir: &Path, delay: Duration) -> Result<PathBuf, ShutdownError> {
    let path = dir.join(DROP_IN_NAME);
    let err = |source| ShutdownError::DropIn {
        path: path.clone(),
        source,
    };
    let text = format!(
        "{DROP_IN_MARK}: its shutdown policy needs this much time to move pods off the node.\n\
         [Login]\nInhibitDelayMaxSec={}\n",
        delay.as_secs().max(1)
    );
    crate::state_dir::write_atomic(&path, text.as_bytes(), false).map_err(err)?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drop_in_content() {
        let dir = std::env::temp_dir().join(format!("ng-dropin-{}", std::process::id()));
        let p = write_drop_in(&dir, Duration::from_secs(47)).unwrap();
        let text = std::fs::read_to_string(&p).unwrap();
        assert!(text.contains("[Login]\nInhibitDelayMaxSec=47\n"), "{text}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
