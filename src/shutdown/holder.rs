//! The handover unit's own process (`nodeguard handover-hold`): the
//! agent's binary, copied into the state directory on the host, run by
//! systemd between two agent pods. It holds a delay inhibitor of its own
//! and, should the host begin shutting down before the next agent has
//! taken over, writes [`BEGAN_FILE`]: this boot, the plan the stopping
//! agent had, and when the shutdown began (wall clock and
//! `CLOCK_MONOTONIC`). The agent adopts it ([`adopt`]) as its shutdown
//! record, so it resumes that shutdown from when it began, not from when it
//! found it, and logind's window is not overrun by the time the rollout
//! took. Only the agent writes the shutdown record itself.
//!
//! The agent copies its binary in the background when it starts
//! ([`install`]), and writes [`PLAN_FILE`] (this boot and its plan) when it
//! hands over; the agent that takes over removes both files once it holds
//! its own lock ([`forget`]).

use std::io::{Read, Write};
use std::path::Path;
use std::time::Duration;

use super::logind::{HANDOVER_WHO, LogindEvent, ZbusConnector};
use super::state::{self, ShutdownRecord};
use super::{HolderCommand, ShutdownConfig};
use super::{LogindConnector, LogindPort, ShutdownError};
use crate::state_dir::StateWrites;

/// The plan the holder records should a shutdown begin: written by the
/// stopping agent beside the shutdown record.
pub const PLAN_FILE: &str = "shutdown-handover-plan.json";

/// What the holder writes when a shutdown begins (removed on a cancel);
/// the agent adopts it as its shutdown record.
pub const BEGAN_FILE: &str = "shutdown-handover-began.json";

/// The folder, under the state directory, of the agent's copy for the unit.
pub const DIR: &str = "handover";

/// The copy's name in [`DIR`].
pub const BINARY: &str = "nodeguard";

/// What the handover unit runs for this holder, with the state directory
/// as the host sees it.
pub fn command(host_state_dir: &Path, why: &str, life: Duration) -> HolderCommand {
    HolderCommand {
        binary: host_state_dir.join(DIR).join(BINARY),
        argv: vec![
            "nodeguard".into(),
            "handover-hold".into(),
            format!("--state-dir={}", host_state_dir.display()),
            format!("--seconds={}", life.as_secs().max(1)),
            format!("--why={why}"),
        ],
        state_dir: host_state_dir.to_path_buf(),
    }
}

/// Whether `a` and `b` hold the same bytes (read in chunks: the binary is
/// megabytes, the agent's memory limit small).
fn same_bytes(a: &Path, b: &Path) -> std::io::Result<bool> {
    let (mut fa, mut fb) = (std::fs::File::open(a)?, std::fs::File::open(b)?);
    if fa.metadata()?.len() != fb.metadata()?.len() {
        return Ok(false);
    }
    let (mut ba, mut bb) = (vec![0u8; 64 * 1024], vec![0u8; 64 * 1024]);
    loop {
        let n = fa.read(&mut ba)?;
        if n == 0 {
            return Ok(true);
        }
        fb.read_exact(&mut bb[..n])?;
        if ba[..n] != bb[..n] {
            return Ok(false);
        }
    }
}

/// Copies the binary at `source` to `state_dir`/[`DIR`]/[`BINARY`] for the
/// handover unit, unless the same bytes are there already. A new copy is
/// renamed into place (a holder still running keeps its own file); a
/// [`DIR`] that is not a plain directory of root's (a link planted in the
/// host path) is refused. Done when the agent starts, not when it stops.
pub fn install(source: &Path, state_dir: &Path) -> std::io::Result<()> {
    let dir = state_dir.join(DIR);
    match std::fs::create_dir(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let meta = std::fs::symlink_metadata(&dir)?;
    {
        use std::os::unix::fs::MetadataExt;
        if !meta.is_dir() || meta.uid() != std::fs::metadata(state_dir)?.uid() {
            return Err(std::io::Error::other(format!(
                "{} is not a directory of the state directory's owner (a link?): not used",
                dir.display()
            )));
        }
    }
    let target = dir.join(BINARY);
    let in_place = std::fs::symlink_metadata(&target).is_ok_and(|m| {
        use std::os::unix::fs::PermissionsExt;
        m.is_file() && m.permissions().mode() & 0o7777 == 0o755
    });
    if in_place && same_bytes(source, &target)? {
        return Ok(());
    }
    let tmp = dir.join(format!(".{BINARY}.{}.tmp", std::process::id()));
    let result = (|| {
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        let _ = std::fs::remove_file(&tmp);
        let mut out = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o755)
            .open(&tmp)?;
        std::io::copy(&mut std::fs::File::open(source)?, &mut out)?;
        // Whatever the umask took away.
        out.set_permissions(std::fs::Permissions::from_mode(0o755))?;
        out.flush()?;
        out.sync_all()?;
        drop(out);
        std::fs::rename(&tmp, &target)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Removes the copy (the handover off, or no host path for it).
pub fn uninstall(state_dir: &Path) {
    let dir = state_dir.join(DIR);
    let _ = std::fs::remove_file(dir.join(BINARY));
    let _ = std::fs::remove_dir(&dir);
}

/// The plan for the holder, written when the agent hands over (small,
/// synced).
pub fn write_plan(state_dir: &Path, boot_id: &str, plan: &ShutdownConfig) -> std::io::Result<()> {
    let template = ShutdownRecord {
        boot_id: boot_id.to_string(),
        plan: Some(plan.clone()),
        ..Default::default()
    };
    let json = serde_json::to_vec_pretty(&template).expect("a record serializes");
    crate::state_dir::write_atomic(&state_dir.join(PLAN_FILE), &json, true)
}

/// The holder's note that a shutdown began now: the stopping agent's plan,
/// this boot, the start. Only while the handover's plan of this boot is
/// there (`false` otherwise): the agent that took over removes it, so a
/// holder on its way out notes nothing that agent does not see itself.
pub fn record_began(
    state_dir: &Path,
    boot_id: &str,
    now: jiff::Timestamp,
    monotonic: Duration,
) -> std::io::Result<bool> {
    let Some(mut record) = std::fs::read(state_dir.join(PLAN_FILE))
        .ok()
        .and_then(|b| serde_json::from_slice::<ShutdownRecord>(&b).ok())
        .filter(|r| r.boot_id == boot_id)
    else {
        return Ok(false);
    };
    record.boot_id = boot_id.to_string();
    record.started_at = Some(now);
    record.started_monotonic_ms = Some(monotonic.as_millis() as u64);
    record.started_by = super::state::StartedBy::Handover;
    record.ended_at = None;
    record.groups_done.clear();
    let json = serde_json::to_vec_pretty(&record).expect("a record serializes");
    crate::state_dir::write_atomic(&state_dir.join(BEGAN_FILE), &json, true)?;
    Ok(true)
}

/// The handover is over (the next agent holds its own lock): its plan and
/// any note go.
pub fn forget(state_dir: &Path, writes: &StateWrites) {
    let _ = writes.remove(&state_dir.join(PLAN_FILE));
    let _ = writes.remove(&state_dir.join(BEGAN_FILE));
}

/// A note that can no longer be of a shutdown under way (a new handover
/// begins, a shutdown was cancelled, no handed-over lock at start) goes.
pub fn forget_note(state_dir: &Path, writes: &StateWrites) {
    let _ = writes.remove(&state_dir.join(BEGAN_FILE));
}

/// The holder's note goes with a cancel: that shutdown is over.
pub fn record_cancelled(state_dir: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(state_dir.join(BEGAN_FILE)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Whether the agent's own record `own` (of this boot) is of the shutdown
/// the note `began` is about: not finished and begun at most
/// [`SAME_SHUTDOWN`] before it (a stopping agent times one found during the
/// handover from its last question, which comes before the note), or
/// finished after the note's start. By the monotonic clock, which no clock
/// step moves; by the wall clock for a record without it.
fn same_shutdown(own: &ShutdownRecord, began: &ShutdownRecord) -> bool {
    let (Some(own_start), Some(note_start)) = (own.started_at, began.started_at) else {
        return false;
    };
    let window = SAME_SHUTDOWN.as_millis() as u64;
    match (own.started_monotonic_ms, began.started_monotonic_ms) {
        (Some(o), Some(n)) => match own.ended_at {
            None => o.saturating_add(window) >= n,
            Some(end) => {
                let took = end
                    .duration_since(own_start)
                    .as_millis()
                    .clamp(0, u64::MAX as i128) as u64;
                o.saturating_add(took) >= n
            }
        },
        _ => match own.ended_at {
            None => own_start
                .checked_add(jiff::SignedDuration::from_millis(window as i64))
                .is_ok_and(|t| t >= note_start),
            Some(end) => end >= note_start,
        },
    }
}

/// How much earlier than the note an unfinished record of the same
/// shutdown may have begun: the stop's question at most, and a margin for
/// the signal's way to the holder.
const SAME_SHUTDOWN: Duration =
    super::stop::STOP_DECIDE_MAX.saturating_add(Duration::from_secs(10));

/// Takes the holder's note, if any, into the shutdown record: a shutdown
/// of this boot began while only the handover unit held the lock. The
/// agent's own record of this boot is kept when it is of the same shutdown
/// ([`same_shutdown`], seen by the agent itself); an older one is
/// replaced, and a corrupt one left for start-up to report. With
/// `not_before` (`CLOCK_MONOTONIC`, ms), a note of a shutdown begun
/// earlier is stale and dropped. Returns the record of the shutdown under way,
/// when there was a note of this boot; a note of another boot is dropped.
pub fn adopt(
    state_dir: &Path,
    boot_id: &str,
    writes: &StateWrites,
    not_before: Option<u64>,
) -> Option<ShutdownRecord> {
    let path = state_dir.join(BEGAN_FILE);
    let bytes = std::fs::read(&path).ok()?;
    let began = serde_json::from_slice::<ShutdownRecord>(&bytes)
        .ok()
        .filter(|r| r.boot_id == boot_id && r.started_at.is_some())
        .filter(|r| not_before.is_none_or(|t| r.started_monotonic_ms.is_some_and(|m| m >= t)));
    let own = match std::fs::read(super::state_file(state_dir)) {
        Ok(b) => match serde_json::from_slice::<ShutdownRecord>(&b) {
            Ok(r) => Some(r),
            // Start-up moves it aside and says so; the note waits.
            Err(_) => return None,
        },
        Err(_) => None,
    };
    let adopted = began.map(|began| {
        let current = own.filter(|r| r.boot_id == boot_id && same_shutdown(r, &began));
        match current {
            Some(own) => own,
            None => {
                // The handover unit's note, whichever version wrote it.
                let mut began = began;
                began.started_by = super::state::StartedBy::Handover;
                tracing::warn!(
                    began = ?began.started_at,
                    "a shutdown began between the previous agent and this one: the handover unit recorded when, and it goes on from there"
                );
                state::save(writes, state_dir, &began);
                began
            }
        }
    });
    let _ = writes.remove(&path);
    adopted
}

/// The holder's life: subscribe to `PrepareForShutdown`, take the delay
/// inhibitor, then hold it until `life` is over or a stop (SIGTERM from
/// systemd when the next agent stops the unit), noting a shutdown that
/// begins meanwhile. A restart of logind or the bus keeps the lock (logind
/// takes its inhibitors back from /run) and the holder subscribes again.
/// Logs to stderr (the unit's journal).
pub async fn hold(state_dir: &Path, life: Duration, why: &str) -> Result<(), ShutdownError> {
    let connector = ZbusConnector { address: None };
    let mut port = connector.connect().await?;
    // Subscribed before the lock is taken: no signal can fall between.
    let mut events = port.events().await?;
    let _lock = port.inhibit_as(HANDOVER_WHO, why).await?;
    let boot_id = state::current_boot_id();
    // A note left from before (a holder stopped as it wrote) is not of
    // this handover.
    let _ = record_cancelled(state_dir);
    tracing::info!(life = ?life, "holding the delay inhibitor for the next agent");
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| ShutdownError::Host(format!("cannot handle SIGTERM: {e}")))?;
    let end = tokio::time::sleep(life);
    tokio::pin!(end);
    // Once a shutdown is noted, its life does not end the lock while
    // logind still prepares for that shutdown (asked at the end of the
    // life, then every RECHECK): the next agent takes the note over, or
    // the host goes down. A shutdown logind forgot (a restart of logind, a
    // cancel missed while away from the bus) ends it.
    let mut noted = false;
    loop {
        tokio::select! {
            _ = &mut end => {
                if noted {
                    let preparing = tokio::time::timeout(RECHECK, port.preparing_for_shutdown()).await;
                    if !matches!(preparing, Ok(Ok(false))) {
                        end.as_mut().reset(tokio::time::Instant::now() + RECHECK);
                        continue;
                    }
                    tracing::info!("the noted shutdown is no longer under way; releasing");
                    let _ = record_cancelled(state_dir);
                }
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
                        Ok(true) => {
                            noted = true;
                            tracing::warn!("PrepareForShutdown(true) between two agents: noted when it began, for the next agent to plan from; held until the next agent takes over or the host goes down");
                        }
                        Ok(false) => tracing::info!("PrepareForShutdown(true): the next agent holds its own lock already and sees it itself"),
                        Err(e) => tracing::error!(error = %e, "PrepareForShutdown(true): cannot note when it began; the next agent plans from when it finds it"),
                    }
                }
                Some(LogindEvent::PrepareForShutdown(false)) => {
                    tracing::info!("PrepareForShutdown(false): the shutdown was cancelled");
                    noted = false;
                    if let Err(e) = record_cancelled(state_dir) {
                        tracing::error!(error = %e, "cannot remove the note of the cancelled shutdown");
                    }
                }
                Some(LogindEvent::Gone) | None => {
                    tracing::warn!("systemd-logind or the system bus went away; the lock is kept, subscribing again");
                    let mut wait = Duration::from_millis(500);
                    (port, events) = loop {
                        tokio::select! {
                            _ = &mut end, if !noted => return Ok(()),
                            _ = term.recv() => return Ok(()),
                            _ = tokio::time::sleep(wait) => {}
                        }
                        let again = async {
                            let p = connector.connect().await?;
                            let ev = p.events().await?;
                            Ok::<_, ShutdownError>((p, ev))
                        };
                        match again.await {
                            Ok(back) => break back,
                            Err(e) => {
                                tracing::debug!(error = %e, "not back yet");
                                wait = (wait * 2).min(Duration::from_secs(5));
                            }
                        }
                    };
                    // A restarted logind forgets a shutdown it was
                    // delaying, and says nothing of it.
                    if noted && matches!(port.preparing_for_shutdown().await, Ok(false)) {
                        tracing::info!("logind came back preparing no shutdown: the noted one is gone");
                        noted = false;
                        let _ = record_cancelled(state_dir);
                    }
                }
            }
        }
    }
}

/// How often a holder past its life asks logind whether the noted shutdown
/// is still under way.
const RECHECK: Duration = Duration::from_secs(10);

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

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

    fn writes() -> StateWrites {
        let mut registry = prometheus_client::registry::Registry::default();
        StateWrites::new(
            crate::report::Reporter::new(&crate::report::ReportConfig::default(), &mut registry).0,
        )
    }

    fn ts(s: i64) -> jiff::Timestamp {
        jiff::Timestamp::from_second(s).unwrap()
    }

    fn earlier_kept() -> ShutdownRecord {
        ShutdownRecord {
            boot_id: "boot-1".into(),
            started_at: Some(ts(1_799_990_000)),
            groups_done: vec![0],
            ..Default::default()
        }
    }

    #[test]
    fn the_binary_is_copied_once_and_a_link_refused() {
        let dir = scratch("install");
        let src = dir.join("source");
        std::fs::write(&src, b"binary one").unwrap();
        install(&src, &dir).unwrap();
        let target = dir.join(DIR).join(BINARY);
        assert_eq!(std::fs::read(&target).unwrap(), b"binary one");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&target).unwrap().permissions().mode() & 0o777,
            0o755
        );
        let ino = |p: &Path| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(p).unwrap());
        let first = ino(&target);
        install(&src, &dir).unwrap();
        assert_eq!(ino(&target), first, "the same bytes are not written again");
        std::fs::write(&src, b"binary two").unwrap();
        install(&src, &dir).unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"binary two");
        assert_ne!(ino(&target), first, "a new binary is a new file");
        assert_eq!(
            std::fs::read_dir(dir.join(DIR)).unwrap().count(),
            1,
            "no temporary file left"
        );
        uninstall(&dir);
        assert!(!dir.join(DIR).exists());
        // A link planted where the folder goes is not followed.
        let elsewhere = scratch("install-elsewhere");
        std::os::unix::fs::symlink(&elsewhere, dir.join(DIR)).unwrap();
        assert!(install(&src, &dir).is_err());
        assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0);
        let cmd = command(
            Path::new("/var/lib/nodeguard"),
            "why",
            Duration::from_secs(120),
        );
        assert_eq!(
            cmd.binary,
            Path::new("/var/lib/nodeguard/handover/nodeguard")
        );
        assert_eq!(
            cmd.argv,
            [
                "nodeguard",
                "handover-hold",
                "--state-dir=/var/lib/nodeguard",
                "--seconds=120",
                "--why=why"
            ]
        );
        std::fs::remove_dir_all(&dir).unwrap();
        std::fs::remove_dir_all(&elsewhere).unwrap();
    }

    #[test]
    fn a_shutdown_between_two_agents_is_noted_and_adopted_with_its_start_and_plan() {
        let dir = scratch("record");
        write_plan(&dir, "boot-1", &plan()).unwrap();
        assert!(
            record_began(
                &dir,
                "boot-1",
                ts(1_800_000_000),
                Duration::from_millis(123_456)
            )
            .unwrap()
        );
        assert!(
            state::load(&dir).unwrap().is_none(),
            "only the agent writes the record"
        );
        let r = adopt(&dir, "boot-1", &writes(), None).unwrap();
        assert_eq!(r.started_at, Some(ts(1_800_000_000)));
        assert_eq!(r.started_monotonic_ms, Some(123_456));
        assert_eq!(r.plan, Some(plan()));
        assert!(
            !r.taint_answered,
            "the agent sets the taint and waits for it"
        );
        assert_eq!(state::load(&dir).unwrap(), Some(r));
        assert!(!dir.join(BEGAN_FILE).exists(), "the note is taken");
        assert!(adopt(&dir, "boot-1", &writes(), None).is_none(), "once");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// helper-71's review: in the first rollout onto a version with
    /// `startedBy`, the handover unit runs the older agent's copy, whose
    /// note does not say it; the note is the unit's whoever wrote it.
    #[test]
    fn a_note_from_an_older_holder_is_adopted_as_the_handover_units() {
        let dir = scratch("record-older");
        let note = serde_json::json!({
            "bootId": "boot-1",
            "startedAt": ts(1_800_000_000).to_string(),
            "startedMonotonicMs": 123_456,
            "endedAt": null,
            "plan": plan(),
        });
        std::fs::write(dir.join(BEGAN_FILE), note.to_string()).unwrap();
        let r = adopt(&dir, "boot-1", &writes(), None).unwrap();
        assert_eq!(r.started_at, Some(ts(1_800_000_000)));
        assert_eq!(r.started_by, state::StartedBy::Handover);
        assert_eq!(state::load(&dir).unwrap(), Some(r), "saved as adopted");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_agents_own_record_of_the_same_shutdown_is_kept_an_earlier_finished_one_replaced() {
        let dir = scratch("own");
        write_plan(&dir, "boot-1", &plan()).unwrap();
        // Not finished (the agent runs it, or was killed running it; its
        // start may be the earlier, by the last "no"): kept.
        let running = ShutdownRecord {
            boot_id: "boot-1".into(),
            started_at: Some(ts(1_799_999_999)),
            started_monotonic_ms: Some(199_000),
            groups_done: vec![0],
            ..Default::default()
        };
        state::save(&writes(), &dir, &running);
        record_began(
            &dir,
            "boot-1",
            ts(1_800_000_000),
            Duration::from_millis(200_000),
        )
        .unwrap();
        assert_eq!(
            adopt(&dir, "boot-1", &writes(), None),
            Some(running.clone())
        );
        assert_eq!(state::load(&dir).unwrap(), Some(running.clone()));
        // Finished after the note's start: the same shutdown, kept.
        let done = ShutdownRecord {
            ended_at: Some(ts(1_800_000_010)),
            ..running.clone()
        };
        state::save(&writes(), &dir, &done);
        record_began(
            &dir,
            "boot-1",
            ts(1_800_000_000),
            Duration::from_millis(200_000),
        )
        .unwrap();
        assert_eq!(adopt(&dir, "boot-1", &writes(), None), Some(done));
        // Finished before it: an earlier shutdown, replaced.
        let earlier = ShutdownRecord {
            ended_at: Some(ts(1_799_999_000)),
            started_at: Some(ts(1_799_998_990)),
            ..running
        };
        state::save(&writes(), &dir, &earlier);
        record_began(
            &dir,
            "boot-1",
            ts(1_800_000_100),
            Duration::from_millis(300_000),
        )
        .unwrap();
        let r = adopt(&dir, "boot-1", &writes(), None).unwrap();
        assert_eq!(r.started_monotonic_ms, Some(300_000));
        assert!(r.groups_done.is_empty() && r.ended_at.is_none());
        // Not finished but begun long before the note: an earlier shutdown
        // whose agent never saw its cancel, not this one.
        let stale = ShutdownRecord {
            started_monotonic_ms: Some(100_000),
            ended_at: None,
            ..earlier_kept()
        };
        state::save(&writes(), &dir, &stale);
        record_began(
            &dir,
            "boot-1",
            ts(1_800_000_100),
            Duration::from_millis(300_000),
        )
        .unwrap();
        assert_eq!(
            adopt(&dir, "boot-1", &writes(), None)
                .unwrap()
                .started_monotonic_ms,
            Some(300_000)
        );
        // A corrupt record is left for start-up to report; the note waits.
        std::fs::write(super::super::state_file(&dir), "{not json").unwrap();
        record_began(
            &dir,
            "boot-1",
            ts(1_800_000_200),
            Duration::from_millis(400_000),
        )
        .unwrap();
        assert!(adopt(&dir, "boot-1", &writes(), None).is_none());
        assert!(dir.join(BEGAN_FILE).exists());
        assert_eq!(
            std::fs::read_to_string(super::super::state_file(&dir)).unwrap(),
            "{not json"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn no_note_without_this_handovers_plan_and_none_kept_past_a_cancel_or_a_boot() {
        let dir = scratch("cancel");
        // No plan (the next agent took over and removed it): no note.
        assert!(!record_began(&dir, "boot-1", ts(1_800_000_000), Duration::from_secs(5)).unwrap());
        assert!(!dir.join(BEGAN_FILE).exists());
        // Another boot's plan: no note either.
        write_plan(&dir, "boot-0", &plan()).unwrap();
        assert!(!record_began(&dir, "boot-1", ts(1_800_000_000), Duration::from_secs(5)).unwrap());
        write_plan(&dir, "boot-1", &plan()).unwrap();
        assert!(record_began(&dir, "boot-1", ts(1_800_000_000), Duration::from_secs(5)).unwrap());
        record_cancelled(&dir).unwrap();
        record_cancelled(&dir).unwrap();
        assert!(adopt(&dir, "boot-1", &writes(), None).is_none());
        // A note of the previous boot is dropped, nothing adopted.
        write_plan(&dir, "boot-0", &plan()).unwrap();
        record_began(&dir, "boot-0", ts(1_700_000_000), Duration::from_secs(5)).unwrap();
        assert!(dir.join(BEGAN_FILE).exists());
        assert!(adopt(&dir, "boot-1", &writes(), None).is_none());
        assert!(!dir.join(BEGAN_FILE).exists());
        // The handover over: plan and note go.
        write_plan(&dir, "boot-1", &plan()).unwrap();
        record_began(&dir, "boot-1", ts(1_800_000_000), Duration::from_secs(5)).unwrap();
        forget(&dir, &writes());
        assert!(!dir.join(BEGAN_FILE).exists() && !dir.join(PLAN_FILE).exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
