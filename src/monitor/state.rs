//! A monitor's persisted state: its conditions, where its source stands,
//! and the boot both belong to.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use super::engine::ConditionState;
use super::sources::Cursor;
use crate::state_dir::StateWrites;

/// Persisted per monitor: conditions, where the source stands, and the
/// boot both belong to.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MonitorState {
    /// The boot (`/proc/sys/kernel/random/boot_id`) the state was saved in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_id: Option<String>,
    #[serde(default)]
    pub conditions: BTreeMap<String, ConditionState>,
    #[serde(default)]
    pub cursor: Cursor,
    /// Each counting rule's matches in its window (see
    /// [`super::engine::Engine::counts_state`]).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub counts: BTreeMap<String, Vec<(jiff::Timestamp, i64)>>,
    /// When it was saved, on the wall clock and on `CLOCK_MONOTONIC`
    /// (milliseconds): a restart on the same boot sees how far the wall
    /// clock stepped while the monitor was stopped, and moves the saved
    /// times by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub saved_at: Option<(jiff::Timestamp, u64)>,
}

/// Whether a saved state belongs to this boot. A state saved before boot
/// ids were recorded counts as this boot's unless it was last written
/// before this boot began.
pub fn same_boot(saved: &MonitorState, boot_id: &str, written_before_boot: bool) -> bool {
    match &saved.boot_id {
        Some(b) => b == boot_id,
        None => !written_before_boot,
    }
}

/// The path of a monitor's state file, always inside `dir/monitors`:
/// validation admits only DNS labels as names, and anything else is
/// flattened here too (a name is never a path: `../x` or `/etc/x` would
/// otherwise write outside the state directory as root).
pub fn state_path(dir: &Path, monitor: &str) -> PathBuf {
    let file: String = monitor
        .chars()
        .map(|c| match c {
            'a'..='z' | '0'..='9' | '-' => c,
            _ => '_',
        })
        .collect();
    dir.join("monitors").join(format!("{file}.json"))
}

/// Every monitor state file in `dir` (`dir/monitors/*.json`): its path, the
/// monitor's name (the file's stem) and the state, `None` when it cannot be
/// read.
pub fn saved_states(dir: &Path) -> Vec<(PathBuf, String, Option<MonitorState>)> {
    let Ok(entries) = std::fs::read_dir(dir.join("monitors")) else {
        return Vec::new();
    };
    entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().and_then(|e| e.to_str()) == Some("json"))
        .map(|path| {
            let name = path
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or("?")
                .to_string();
            let state = std::fs::read(&path)
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok());
            (path, name, state)
        })
        .collect()
}

/// The saved state, and whether its file was last written before this boot
/// began; `None` when the monitor has none.
pub(super) fn load_state(dir: &Path, monitor: &str) -> Option<(MonitorState, bool)> {
    let p = state_path(dir, monitor);
    let text = std::fs::read_to_string(&p).ok()?;
    let state = serde_json::from_str(&text).unwrap_or_else(|e| {
        tracing::error!(path = %p.display(), error = %e, "monitor state unreadable; starting afresh");
        MonitorState::default()
    });
    let before_boot = match (
        std::fs::metadata(&p).and_then(|m| m.modified()),
        boot_time(),
    ) {
        (Ok(m), Some(b)) => m < b,
        _ => false,
    };
    Some((state, before_boot))
}

/// When this boot began (`btime` in /proc/stat).
pub(super) fn boot_time() -> Option<SystemTime> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let secs: u64 = stat
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    Some(SystemTime::UNIX_EPOCH + Duration::from_secs(secs))
}

/// Saves a monitor's state (atomically, not synced: it is written up to
/// once a second under load, and a power loss costs at most that second).
/// True when written.
pub(super) fn save_state(
    writes: &StateWrites,
    dir: &Path,
    monitor: &str,
    state: &MonitorState,
) -> bool {
    save_state_as(writes, dir, monitor, state, false)
}

/// [`save_state`], synced to disk when `durable`: whose taint is on the
/// Node must survive a power loss, or the next start takes nodeguard's
/// taint for someone else's and never removes it.
pub(super) fn save_state_as(
    writes: &StateWrites,
    dir: &Path,
    monitor: &str,
    state: &MonitorState,
    durable: bool,
) -> bool {
    let bytes = serde_json::to_vec(state).expect("state serializes");
    writes.write(&state_path(dir, monitor), &bytes, durable)
}
