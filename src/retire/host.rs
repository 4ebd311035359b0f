//! The host side of retiring: the monitors' saved states (which taints are
//! nodeguard's), the logind drop-in, and the state directory.

use std::path::{Path, PathBuf};

use crate::monitor::{MonitorState, saved_states};
use crate::shutdown::logind::{DROP_IN_MARK, DROP_IN_NAME, ZbusConnector};
use crate::shutdown::{LogindConnector, LogindPort};

/// The monitors' saved states, by monitor name, and a sentence for each
/// one that cannot be read (the taints it records cannot be removed).
pub(super) fn monitor_states(state_dir: &Path) -> (Vec<(String, MonitorState)>, Vec<String>) {
    let mut states = Vec::new();
    let mut unreadable = Vec::new();
    for (path, name, state) in saved_states(state_dir) {
        match state {
            Some(s) => states.push((name, s)),
            None => unreadable.push(format!(
                "the state {} cannot be read: a taint it records is not removed; check the node's taints",
                path.display()
            )),
        }
    }
    states.sort_by(|a, b| a.0.cmp(&b.0));
    (states, unreadable)
}

/// Removes nodeguard's logind drop-in from each directory the node lets
/// policies write one to: the paths removed, and what could not be.
pub(super) fn remove_drop_ins(dirs: &[String]) -> (Vec<PathBuf>, Vec<String>) {
    let mut removed = Vec::new();
    let mut failed = Vec::new();
    for dir in dirs {
        let path = Path::new(dir).join(DROP_IN_NAME);
        match std::fs::read_to_string(&path) {
            Ok(text) if text.starts_with(DROP_IN_MARK) => match std::fs::remove_file(&path) {
                Ok(()) => removed.push(path),
                Err(e) => failed.push(format!(
                    "cannot remove the logind drop-in {}: {e}; remove it and reload logind",
                    path.display()
                )),
            },
            Ok(_) => {
                tracing::info!(path = %path.display(), "a logind drop-in of nodeguard's name that nodeguard did not write: left as it is")
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => failed.push(format!(
                "cannot read {}: {e}; remove nodeguard's logind drop-in there by hand",
                path.display()
            )),
        }
    }
    (removed, failed)
}

/// Makes logind re-read its configuration (its delay back to what the
/// host configures without nodeguard's drop-in).
pub(super) async fn reload_logind(address: &Option<String>) -> Result<(), String> {
    let connector = ZbusConnector {
        address: address.clone(),
    };
    let logind = connector.connect().await.map_err(|e| e.to_string())?;
    logind.reload().await.map_err(|e| e.to_string())
}

/// Stops a handover unit an agent of a rollout left (an uninstall during
/// a rollout): `true` when one ran.
pub(super) async fn stop_handover(address: &Option<String>) -> Result<bool, String> {
    let connector = ZbusConnector {
        address: address.clone(),
    };
    let logind = connector.connect().await.map_err(|e| e.to_string())?;
    logind.stop_handover().await.map_err(|e| e.to_string())
}

/// Removes the files of the state directory and of its `monitors` and
/// `handover` folders (nodeguard's own directory; folders it did not make
/// stay): how many, and what could not be removed.
pub(super) fn clear_state(state_dir: &Path) -> (usize, Vec<String>) {
    let mut removed = 0;
    let mut failed = Vec::new();
    let monitors = state_dir.join("monitors");
    // The handover unit's copy of the binary.
    let handover = state_dir.join("handover");
    for dir in [monitors.as_path(), handover.as_path(), state_dir] {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        for path in entries.flatten().map(|e| e.path()) {
            if !path.symlink_metadata().is_ok_and(|m| m.is_file()) {
                continue;
            }
            match std::fs::remove_file(&path) {
                Ok(()) => removed += 1,
                Err(e) => failed.push(format!("cannot remove {}: {e}", path.display())),
            }
        }
    }
    let _ = std::fs::remove_dir(&monitors);
    let _ = std::fs::remove_dir(&handover);
    (removed, failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("nodeguard-retire-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn only_nodeguards_drop_in_goes() {
        let ours = scratch("ours");
        let theirs = scratch("theirs");
        let empty = scratch("empty");
        std::fs::write(
            ours.join(DROP_IN_NAME),
            format!("{DROP_IN_MARK}: its shutdown policy needs this much time.\n[Login]\nInhibitDelayMaxSec=32\n"),
        )
        .unwrap();
        std::fs::write(
            theirs.join(DROP_IN_NAME),
            "[Login]\nInhibitDelayMaxSec=90\n",
        )
        .unwrap();
        let dirs: Vec<String> = [&ours, &theirs, &empty]
            .iter()
            .map(|d| d.display().to_string())
            .collect();
        let (removed, failed) = remove_drop_ins(&dirs);
        assert_eq!(removed, vec![ours.join(DROP_IN_NAME)]);
        assert!(failed.is_empty(), "{failed:?}");
        assert!(!ours.join(DROP_IN_NAME).exists());
        assert!(theirs.join(DROP_IN_NAME).exists(), "someone else's stays");
        // Again: nothing left to remove.
        assert_eq!(remove_drop_ins(&dirs), (vec![], vec![]));
        for d in [ours, theirs, empty] {
            std::fs::remove_dir_all(d).unwrap();
        }
    }

    #[test]
    fn the_state_directory_is_emptied_of_files_only() {
        let dir = scratch("state");
        std::fs::create_dir_all(dir.join("monitors")).unwrap();
        std::fs::create_dir_all(dir.join("other")).unwrap();
        std::fs::write(dir.join("shutdown-state.json"), "{}").unwrap();
        std::fs::write(dir.join("monitors/kernel.json"), "{}").unwrap();
        std::fs::create_dir_all(dir.join("handover")).unwrap();
        std::fs::write(dir.join("handover/nodeguard"), "binary").unwrap();
        std::fs::write(dir.join("other/keep"), "x").unwrap();
        assert_eq!(clear_state(&dir), (3, vec![]));
        assert!(!dir.join("monitors").exists());
        assert!(!dir.join("handover").exists(), "the handover's binary goes");
        assert!(
            dir.join("other/keep").exists(),
            "folders it did not make stay"
        );
        assert_eq!(clear_state(&dir), (0, vec![]));
        std::fs::remove_dir_all(dir).unwrap();
    }
}
