//! The handover unit's own process (`nodeguard handover-hold`): the
//! agent's binary, copied into the state directory on the host, run by
//! systemd between two agent pods. It holds a delay inhibitor of its own
//! and, should the host begin shutting down before the next agent has
//! taken over, writes the shutdown record the way an agent does when a
//! shutdown begins: this boot, the plan the stopping agent had, and when
//! it began (wall clock and `CLOCK_MONOTONIC`). The next agent then resumes
//! that shutdown from when it began, not from when it found it, so
//! logind's window is not overrun by the time the rollout took.
//!
//! The stopping agent writes [`PLAN_FILE`] (a record with this boot and its
//! plan, no start) before it starts the unit; the holder fills in the start.
//! A record of this boot's shutdown already there (the next agent saw the
//! signal itself) is left as it is.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::ShutdownConfig;
use super::logind::{HANDOVER_WHO, LogindEvent, ZbusConnector};
use super::state::{self, OnStart, ShutdownRecord};
use super::{LogindConnector, LogindPort, ShutdownError};

/// The plan the holder records should a shutdown begin: written by the
/// stopping agent beside the shutdown record.
pub const PLAN_FILE: &str = "shutdown-handover-plan.json";

/// Where the stopping agent copies its binary for the unit, under the
/// state directory.
pub const BINARY: &str = "handover/nodeguard";

/// What the handover unit runs: the binary's path and the state directory,
/// both as the host sees them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HolderCommand {
    pub binary: PathBuf,
    pub state_dir: PathBuf,
}

impl HolderCommand {
    /// The unit's argv (argv[0] first).
    pub fn argv(&self, why: &str, life: Duration) -> Vec<String> {
        vec![
            "nodeguard".into(),
            "handover-hold".into(),
            format!("--state-dir={}", self.state_dir.display()),
            format!("--seconds={}", life.as_secs().max(1)),
            format!("--why={why}"),
        ]
    }
}

/// Readies the holder for a handover: the binary at `source` copied to
/// `state_dir`/[`BINARY`] (unless the same bytes are there already; a new
/// file is renamed into place, so a holder still running keeps its own)
/// and the plan written. `state_dir` is this process's view of the state
/// directory, `host_state_dir` the host's.
pub fn prepare(
    source: &Path,
    state_dir: &Path,
    host_state_dir: &Path,
    boot_id: &str,
    plan: &ShutdownConfig,
) -> std::io::Result<HolderCommand> {
    let target = state_dir.join(BINARY);
    let bytes = std::fs::read(source)?;
    if std::fs::read(&target).ok().as_deref() != Some(&bytes[..]) {
        let tmp = target.with_extension("new");
        std::fs::create_dir_all(target.parent().unwrap_or(state_dir))?;
        let _ = std::fs::remove_file(&tmp);
        {
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o755)
                .open(&tmp)?;
            f.write_all(&bytes)?;
            f.sync_all()?;
        }
        if let Err(e) = std::fs::rename(&tmp, &target) {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
    }
    let template = ShutdownRecord {
        boot_id: boot_id.to_string(),
        plan: Some(plan.clone()),
        ..Default::default()
    };
    let json = serde_json::to_vec_pretty(&template).expect("a record serializes");
    crate::state_dir::write_atomic(&state_dir.join(PLAN_FILE), &json, true)?;
    Ok(HolderCommand {
        binary: host_state_dir.join(BINARY),
        state_dir: host_state_dir.to_path_buf(),
    })
}

/// Records that a shutdown began now, unless a record of this boot's
/// shutdown is there already. `true` when written.
pub fn record_began(
    state_dir: &Path,
    boot_id: &str,
    now: jiff::Timestamp,
    monotonic: Duration,
) -> Result<bool, ShutdownError> {
    let current = state::load(state_dir).ok().flatten();
    if state::on_start(current.as_ref(), boot_id, Some(true)) == OnStart::Resume {
        return Ok(false);
    }
    // The stopping agent's plan; without it (unreadable), the next agent
    // plans with its policy, still from this start.
    let mut record = std::fs::read(state_dir.join(PLAN_FILE))
        .ok()
        .and_then(|b| serde_json::from_slice::<ShutdownRecord>(&b).ok())
        .filter(|r| r.boot_id == boot_id)
        .unwrap_or_default();
    record.boot_id = boot_id.to_string();
    record.started_at = Some(now);
    record.started_monotonic_ms = Some(monotonic.as_millis() as u64);
    let json = serde_json::to_vec_pretty(&record).expect("a record serializes");
    crate::state_dir::write_atomic(&super::state_file(state_dir), &json, true).map_err(
        |source| ShutdownError::State {
            path: super::state_file(state_dir),
            source,
        },
    )?;
    Ok(true)
}

/// The holder's life: subscribe to `PrepareForShutdown`, take the delay
/// inhibitor, then hold it until `life` is over or a stop (SIGTERM from
/// systemd when the next agent stops the unit), recording a shutdown that
/// begins meanwhile. Logs to stderr (the unit's journal).
pub async fn hold(state_dir: &Path, life: Duration, why: &str) -> Result<(), ShutdownError> {
    let port = ZbusConnector { address: None }.connect().await?;
    // Subscribed before the lock is taken: no signal can fall between.
    let mut events = port.events().await?;
    let _lock = port.inhibit_as(HANDOVER_WHO, why).await?;
    let boot_id = state::current_boot_id();
    tracing::info!(life = ?life, "holding the delay inhibitor for the next agent");
    if port.preparing_for_shutdown().await.unwrap_or(false) {
        // Begun before this process subscribed: the stopping agent asked
        // logind after it started this unit, and runs it itself.
        tracing::warn!("the host is already shutting down; the stopping agent runs the shutdown");
    }
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| ShutdownError::Host(format!("cannot handle SIGTERM: {e}")))?;
    let end = tokio::time::sleep(life);
    tokio::pin!(end);
    loop {
        tokio::select! {
            _ = &mut end => {
                tracing::info!("no agent took the delay inhibitor over within its life; releasing it");
                return Ok(());
            }
            _ = term.recv() => {
                tracing::info!("stopped (the next agent holds its own delay inhibitor); releasing");
                return Ok(());
            }
            e = events.recv() => match e {
                Some(LogindEvent::PrepareForShutdown(true)) => {
                    match record_began(state_dir, &boot_id, jiff::Timestamp::now(), crate::clock::system_monotonic()) {
                        Ok(true) => tracing::warn!("PrepareForShutdown(true) between two agents: recorded when it began, for the next agent to plan from"),
                        Ok(false) => tracing::info!("PrepareForShutdown(true): this boot's shutdown is on record already"),
                        Err(e) => tracing::error!(error = %e, "PrepareForShutdown(true): cannot record when it began; the next agent plans from when it finds it"),
                    }
                }
                Some(LogindEvent::PrepareForShutdown(false)) => {
                    tracing::info!("PrepareForShutdown(false): the shutdown was cancelled (the next agent reports it)");
                }
                Some(LogindEvent::Gone) | None => {
                    return Err(ShutdownError::Host(
                        "systemd-logind or the system bus went away: the delay inhibitor went with it".into(),
                    ));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ng-holder-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn plan() -> ShutdownConfig {
        ShutdownConfig {
            groups: vec![super::super::core::GroupSpec {
                priority: 0,
                grace: Duration::from_secs(10),
            }],
            include: Default::default(),
            escalate: true,
            escalate_after_percent: 50,
            safety_margin: Duration::from_secs(2),
            drop_in_dir: None,
        }
    }

    #[test]
    fn the_binary_is_copied_once_and_the_plan_written() {
        let dir = scratch("prepare");
        let src = dir.join("source");
        std::fs::write(&src, b"binary one").unwrap();
        let cmd = prepare(
            &src,
            &dir,
            Path::new("/var/lib/nodeguard"),
            "boot-1",
            &plan(),
        )
        .unwrap();
        assert_eq!(
            cmd.binary,
            Path::new("/var/lib/nodeguard/handover/nodeguard")
        );
        assert_eq!(std::fs::read(dir.join(BINARY)).unwrap(), b"binary one");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.join(BINARY))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o755);
        let ino = |p: &Path| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(p).unwrap());
        let first = ino(&dir.join(BINARY));
        prepare(&src, &dir, Path::new("/h"), "boot-1", &plan()).unwrap();
        assert_eq!(
            ino(&dir.join(BINARY)),
            first,
            "the same bytes are not written again"
        );
        std::fs::write(&src, b"binary two").unwrap();
        prepare(&src, &dir, Path::new("/h"), "boot-1", &plan()).unwrap();
        assert_eq!(std::fs::read(dir.join(BINARY)).unwrap(), b"binary two");
        assert_ne!(ino(&dir.join(BINARY)), first, "a new binary is a new file");
        let template: ShutdownRecord =
            serde_json::from_slice(&std::fs::read(dir.join(PLAN_FILE)).unwrap()).unwrap();
        assert_eq!(template.boot_id, "boot-1");
        assert_eq!(template.plan, Some(plan()));
        assert!(template.started_at.is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_shutdown_between_two_agents_is_recorded_with_its_start_and_plan() {
        let dir = scratch("record");
        prepare(
            &std::env::current_exe().unwrap(),
            &dir,
            Path::new("/h"),
            "boot-1",
            &plan(),
        )
        .unwrap();
        let at = jiff::Timestamp::from_second(1_800_000_000).unwrap();
        assert!(record_began(&dir, "boot-1", at, Duration::from_millis(123_456)).unwrap());
        let r = state::load(&dir).unwrap().unwrap();
        assert_eq!(r.boot_id, "boot-1");
        assert_eq!(r.started_at, Some(at));
        assert_eq!(r.started_monotonic_ms, Some(123_456));
        assert_eq!(r.plan, Some(plan()));
        assert!(
            !r.taint_answered,
            "the next agent sets the taint and waits for it"
        );
        // The next agent's own record (or this one) is not overwritten.
        let later = jiff::Timestamp::from_second(1_800_000_100).unwrap();
        assert!(!record_began(&dir, "boot-1", later, Duration::from_millis(999_999)).unwrap());
        assert_eq!(state::load(&dir).unwrap().unwrap().started_at, Some(at));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_earlier_boots_or_finished_record_is_replaced_and_a_stale_plan_ignored() {
        let dir = scratch("replace");
        let old = ShutdownRecord {
            boot_id: "boot-0".into(),
            started_at: Some(jiff::Timestamp::from_second(1_700_000_000).unwrap()),
            ended_at: Some(jiff::Timestamp::from_second(1_700_000_030).unwrap()),
            ..Default::default()
        };
        std::fs::write(
            super::super::state_file(&dir),
            serde_json::to_vec(&old).unwrap(),
        )
        .unwrap();
        // A plan left by a handover of the previous boot.
        let stale = ShutdownRecord {
            boot_id: "boot-0".into(),
            plan: Some(plan()),
            ..Default::default()
        };
        std::fs::write(dir.join(PLAN_FILE), serde_json::to_vec(&stale).unwrap()).unwrap();
        let at = jiff::Timestamp::from_second(1_800_000_000).unwrap();
        assert!(record_began(&dir, "boot-1", at, Duration::from_secs(5)).unwrap());
        let r = state::load(&dir).unwrap().unwrap();
        assert_eq!(
            (r.boot_id.as_str(), r.started_at, r.ended_at),
            ("boot-1", Some(at), None)
        );
        assert_eq!(r.plan, None, "another boot's plan is not this shutdown's");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
