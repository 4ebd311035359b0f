//! The shutdown record in the state directory: written atomically at each
//! step so a restart of the agent resumes a shutdown, and the first start
//! after a reboot can clean up and report how the last shutdown went.

use std::path::{Path, PathBuf};

use jiff::Timestamp;
use serde::{Deserialize, Serialize};

use super::ShutdownError;
use crate::state_dir::StateWrites;

pub const FILE_NAME: &str = "shutdown-state.json";

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ShutdownRecord {
    /// `/proc/sys/kernel/random/boot_id` when the shutdown started.
    pub boot_id: String,
    pub started_at: Option<Timestamp>,
    /// The monotonic clock (`CLOCK_MONOTONIC`, milliseconds) when the
    /// shutdown started: a restart on the same boot measures how far the
    /// shutdown has gone by it, so a wall-clock step between the start and
    /// the restart moves nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_monotonic_ms: Option<u64>,
    pub ended_at: Option<Timestamp>,
    /// Priorities of the groups whose window is over.
    #[serde(default)]
    pub groups_done: Vec<i32>,
    /// nodeguard added the shutdown taint (so it may remove it).
    #[serde(default)]
    pub taint_added: bool,
    /// The API server answered the taint request, so `taint_added` is
    /// known. A record saved before the answer (the agent killed with the
    /// request in flight) leaves the taint nodeguard's: the request may
    /// have been applied.
    #[serde(default)]
    pub taint_answered: bool,
    /// The API server stored the Event that says this shutdown began
    /// (`ShutdownStarted`). A process killed before that (the OOM killer
    /// at logind's signal) leaves it unsaid: its successor says it.
    #[serde(default)]
    pub announced: bool,
    /// Who recorded `startedAt`: absent, the agent that saw the shutdown
    /// begin. A start found late is never said to be when the shutdown
    /// began.
    #[serde(default, skip_serializing_if = "StartedBy::is_agent")]
    pub started_by: StartedBy,
    /// The shutdown section in force when the shutdown began. A restarted
    /// agent finishes the shutdown with it, whatever the policy says by
    /// then (edited, made invalid, or without a shutdown section: the lock
    /// taken back from the keeper is not dropped with the groups left).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<super::ShutdownConfig>,
}

/// Who recorded a shutdown's start ([`ShutdownRecord::started_by`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum StartedBy {
    /// The agent that saw `PrepareForShutdown`.
    #[default]
    Agent,
    /// The handover unit, which held the delay lock between two agents
    /// and noted when the shutdown began.
    Handover,
    /// An agent that found the shutdown under way with no record of its
    /// start (its predecessor stopped before the first save, or the
    /// shutdown began before it subscribed to logind): `startedAt` is when
    /// it found it, not when it began. Also what a name this version does
    /// not know reads as (a record from a newer one).
    #[serde(other)]
    Found,
}

impl StartedBy {
    fn is_agent(&self) -> bool {
        *self == StartedBy::Agent
    }
}

impl ShutdownRecord {
    /// Whether the shutdown taint is (or may be) nodeguard's, so a cancel
    /// or the next boot removes it.
    pub fn taint_ours(&self) -> bool {
        self.taint_added || !self.taint_answered
    }
}

/// What to do with a record found at start-up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OnStart {
    /// No shutdown on record.
    Nothing,
    /// The agent restarted during a shutdown of this boot: carry on.
    Resume,
    /// The agent restarted after its shutdown of this boot was done, and
    /// logind is still preparing for shutdown: the host is going down.
    /// Nothing to undo; the record stays for the next boot's report.
    GoingDown,
    /// A shutdown of this boot is on record but logind prepares for none:
    /// it was cancelled while the agent was not running. Undo it.
    CancelledMeanwhile { taint_added: bool },
    /// The node rebooted after a shutdown: clean up and report.
    AfterReboot {
        took: Option<std::time::Duration>,
        taint_added: bool,
    },
}

/// `preparing`: logind's `PreparingForShutdown` now (`None`: unknown, logind
/// unreachable). Only a record of this boot needs it: a restart during or
/// right after a shutdown looks the same on disk as a shutdown cancelled
/// while the agent was away, and only logind knows which it is.
pub fn on_start(
    record: Option<&ShutdownRecord>,
    boot_id: &str,
    preparing: Option<bool>,
) -> OnStart {
    let Some(r) = record.filter(|r| r.started_at.is_some()) else {
        return OnStart::Nothing;
    };
    if r.boot_id == boot_id {
        match (preparing, r.ended_at.is_some()) {
            (Some(false), _) => {
                return OnStart::CancelledMeanwhile {
                    taint_added: r.taint_ours(),
                };
            }
            (_, false) => return OnStart::Resume,
            (Some(true), true) => return OnStart::GoingDown,
            // Finished, logind unknown: cleaned up like after a reboot
            // (the node is up, or going down regardless).
            (None, true) => {}
        }
    }
    let took = match (r.started_at, r.ended_at) {
        (Some(s), Some(e)) => Some((e - s).try_into().unwrap_or_default()),
        _ => None,
    };
    OnStart::AfterReboot {
        took,
        taint_added: r.taint_ours(),
    }
}

fn path(dir: &Path) -> PathBuf {
    dir.join(FILE_NAME)
}

/// Loads the record; a missing file is `None`. A corrupt file is moved
/// aside (kept for inspection) and reported, never a crash.
pub fn load(dir: &Path) -> Result<Option<ShutdownRecord>, ShutdownError> {
    let p = path(dir);
    let text = match std::fs::read_to_string(&p) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(ShutdownError::State { path: p, source }),
    };
    match serde_json::from_str(&text) {
        Ok(r) => Ok(Some(r)),
        Err(e) => {
            let aside = dir.join(format!("{FILE_NAME}.corrupt"));
            let _ = std::fs::rename(&p, &aside);
            Err(ShutdownError::CorruptState {
                path: p,
                aside,
                message: e.to_string(),
            })
        }
    }
}

/// Writes the record atomically and durably (synced: it must outlive the
/// power-off it records). A failure is said through `writes`; the shutdown
/// goes on from memory. True when written.
pub fn save(writes: &StateWrites, dir: &Path, record: &ShutdownRecord) -> bool {
    let bytes = serde_json::to_vec_pretty(record).expect("a record serializes");
    writes.write(&path(dir), &bytes, true)
}

/// A file that says nodeguard's shutdown taint is still on the Node (its
/// removal after a cancel or a reboot did not get through), so an agent
/// restarted before the background removal worked goes on with it.
pub const TAINT_LEFT_FILE: &str = "shutdown-taint-left";

/// Marks or unmarks the shutdown taint as left on the Node.
pub fn mark_taint_left(writes: &StateWrites, dir: &Path, left: bool) -> bool {
    let path = dir.join(TAINT_LEFT_FILE);
    if left {
        writes.write(&path, b"nodeguard.io/shutdown\n", true)
    } else {
        writes.remove(&path)
    }
}

/// Whether the shutdown taint was marked as left.
pub fn taint_left(dir: &Path) -> bool {
    dir.join(TAINT_LEFT_FILE).exists()
}

/// Removes the record (none is fine); a failure is said through `writes`.
pub fn clear(writes: &StateWrites, dir: &Path) -> bool {
    writes.remove(&path(dir))
}

/// This boot's id, from the kernel.
pub fn current_boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ts(s: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + s).unwrap()
    }

    #[test]
    fn start_up_decisions() {
        for preparing in [None, Some(true), Some(false)] {
            assert_eq!(on_start(None, "b1", preparing), OnStart::Nothing);
            assert_eq!(
                on_start(Some(&ShutdownRecord::default()), "b1", preparing),
                OnStart::Nothing
            );
        }
        let running = ShutdownRecord {
            boot_id: "b1".into(),
            started_at: Some(ts(0)),
            taint_added: true,
            ..Default::default()
        };
        let done = ShutdownRecord {
            ended_at: Some(ts(42)),
            ..running.clone()
        };
        let rebooted = |took| OnStart::AfterReboot {
            took,
            taint_added: true,
        };
        let cancelled = OnStart::CancelledMeanwhile { taint_added: true };
        let secs = |s| Some(std::time::Duration::from_secs(s));
        // (record, this boot, logind's PreparingForShutdown) → decision
        let cases: [(&ShutdownRecord, &str, Option<bool>, OnStart, &str); 9] = [
            (
                &running,
                "b1",
                Some(true),
                OnStart::Resume,
                "restarted mid-shutdown",
            ),
            (
                &running,
                "b1",
                None,
                OnStart::Resume,
                "logind unknown: carry on",
            ),
            (
                &running,
                "b1",
                Some(false),
                cancelled.clone(),
                "cancelled while away: never evict on a node that stays up",
            ),
            (
                &running,
                "b2",
                Some(false),
                rebooted(None),
                "went down before the record was finished",
            ),
            (&done, "b2", None, rebooted(secs(42)), "the usual reboot"),
            (
                &done,
                "b2",
                Some(true),
                rebooted(secs(42)),
                "a new boot is a new boot",
            ),
            (
                &done,
                "b1",
                Some(true),
                OnStart::GoingDown,
                "restarted after its groups, the host going down: keep the taint",
            ),
            (
                &done,
                "b1",
                Some(false),
                cancelled.clone(),
                "cancelled late while away",
            ),
            (
                &done,
                "b1",
                None,
                rebooted(secs(42)),
                "logind unknown: cleaned up as before",
            ),
        ];
        for (record, boot, preparing, want, why) in cases {
            assert_eq!(on_start(Some(record), boot, preparing), want, "{why}");
        }
    }

    #[test]
    fn a_taint_request_never_answered_leaves_the_taint_nodeguards() {
        // (taint_added, taint_answered) → whether the next boot removes it
        let cases = [
            (true, true, true, "added, and the record says so"),
            (
                false,
                true,
                false,
                "the API server said it was there before: someone else's",
            ),
            (
                false,
                false,
                true,
                "killed with the request in flight: it may have been applied",
            ),
            (
                true,
                false,
                true,
                "unanswered, counted as added after the release",
            ),
        ];
        for (added, answered, ours, why) in cases {
            let r = ShutdownRecord {
                boot_id: "b1".into(),
                started_at: Some(ts(0)),
                ended_at: Some(ts(20)),
                taint_added: added,
                taint_answered: answered,
                ..Default::default()
            };
            assert_eq!(r.taint_ours(), ours, "{why}");
            assert_eq!(
                on_start(Some(&r), "b2", None),
                OnStart::AfterReboot {
                    took: Some(std::time::Duration::from_secs(20)),
                    taint_added: ours
                },
                "{why}"
            );
            assert_eq!(
                on_start(Some(&r), "b1", Some(false)),
                OnStart::CancelledMeanwhile { taint_added: ours },
                "{why}"
            );
        }
        // A record written before the field existed reads as unanswered.
        let old: ShutdownRecord = serde_json::from_str(
            r#"{"bootId":"b1","startedAt":"2026-11-25T00:00:00Z","endedAt":null,"taintAdded":false}"#,
        )
        .unwrap();
        assert!(old.taint_ours());
    }

    #[test]
    fn save_load_clear_and_corruption() {
        let dir = std::env::temp_dir().join(format!("ng-state-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(load(&dir).unwrap(), None);
        let r = ShutdownRecord {
            boot_id: "b".into(),
            started_at: Some(ts(1)),
            started_monotonic_ms: None,
            ended_at: None,
            groups_done: vec![0, 1000],
            taint_added: true,
            taint_answered: true,
            announced: true,
            started_by: Default::default(),
            plan: None,
        };
        let (reporter, _events) = crate::report::Reporter::new(
            &Default::default(),
            &mut prometheus_client::registry::Registry::default(),
        );
        let writes = StateWrites::new(reporter);
        assert!(save(&writes, &dir, &r));
        assert_eq!(load(&dir).unwrap(), Some(r));
        assert!(!dir.join(format!(".{FILE_NAME}.tmp")).exists());
        assert!(clear(&writes, &dir));
        assert!(clear(&writes, &dir));
        assert_eq!(writes.errors(), 0);
        assert_eq!(load(&dir).unwrap(), None);
        std::fs::write(dir.join(FILE_NAME), b"{not json").unwrap();
        assert!(matches!(
            load(&dir),
            Err(ShutdownError::CorruptState { .. })
        ));
        assert!(dir.join(format!("{FILE_NAME}.corrupt")).exists());
        assert_eq!(load(&dir).unwrap(), None, "moved aside");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_boot_id_is_read() {
        assert_eq!(current_boot_id().len(), 36);
    }
}
