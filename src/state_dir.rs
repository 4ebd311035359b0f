//! Writes to the agent's state directory (each monitor's state, the
//! shutdown record). A write is atomic: a temporary file beside the target,
//! renamed over it, the temporary file removed when any step fails, so a
//! full or read-only filesystem leaves the last state written whole. A
//! directory that stops taking writes is said once (a Warning Event, an
//! error log) and once again when it takes them again, not at every write;
//! every failed write is counted in `nodeguard_state_write_errors_total`.
//! [`write_atomic`] also writes the logind drop-in.

use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;

use crate::report::{EventKind, Reporter};

/// Writes `bytes` to `path` through a temporary file and a rename. With
/// `durable`, the file and then its directory are synced before and after
/// the rename (a power loss keeps the old file or the new one); without,
/// the rename still keeps a crash of the agent from leaving a part.
pub fn write_atomic(path: &Path, bytes: &[u8], durable: bool) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    // Per process: the handover unit's holder writes in the same folder.
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        if durable {
            f.sync_all()?;
        }
        drop(f);
        std::fs::rename(&tmp, path)
    })();
    match result {
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
        Ok(()) => {
            if durable && let Ok(d) = std::fs::File::open(dir) {
                let _ = d.sync_all();
            }
            Ok(())
        }
    }
}

/// The outcome of the state writes, shared by every writer. Clone freely.
#[derive(Clone)]
pub struct StateWrites {
    shared: Arc<Shared>,
}

struct Shared {
    reporter: Reporter,
    /// Failed writes since the last one that worked (0: writes work).
    failing: Mutex<u64>,
    errors: Counter,
}

impl StateWrites {
    pub fn new(reporter: Reporter) -> Self {
        StateWrites {
            shared: Arc::new(Shared {
                reporter,
                failing: Mutex::new(0),
                errors: Counter::default(),
            }),
        }
    }

    /// Registers `nodeguard_state_write_errors_total`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "nodeguard_state_write_errors",
            "Writes to the state directory that failed (full or read-only filesystem, permissions); the last state written stays whole",
            self.shared.errors.clone(),
        );
    }

    /// Failed writes so far.
    pub fn errors(&self) -> u64 {
        self.shared.errors.get()
    }

    /// [`write_atomic`], its outcome said as the type describes. True when
    /// the write worked.
    pub fn write(&self, path: &Path, bytes: &[u8], durable: bool) -> bool {
        self.outcome(path, write_atomic(path, bytes, durable), true)
    }

    /// Removes `path` (gone already is fine). A failure is said likewise;
    /// a removal that works is no sign that writes do (unlinking needs no
    /// space), so it never says the directory recovered.
    pub fn remove(&self, path: &Path) -> bool {
        let result = match std::fs::remove_file(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            other => other,
        };
        self.outcome(path, result, false)
    }

    fn outcome(&self, path: &Path, result: std::io::Result<()>, proves_writes: bool) -> bool {
        let mut failing = self
            .shared
            .failing
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let dir = path.parent().unwrap_or(path).display();
        match result {
            Ok(()) => {
                if *failing > 0 && proves_writes {
                    tracing::info!(path = %path.display(), failed = *failing, "state directory writable again");
                    self.shared.reporter.event(
                        EventKind::Normal,
                        "StateWriteRecovered",
                        "SaveState",
                        format!(
                            "nodeguard writes its state under {dir} again, after {} failed writes.",
                            *failing
                        ),
                    );
                    *failing = 0;
                }
                true
            }
            Err(e) => {
                self.shared.errors.inc();
                if *failing == 0 {
                    tracing::error!(path = %path.display(), error = %e, "cannot write state; going on with the state in memory");
                    self.shared.reporter.event(
                        EventKind::Warning,
                        "StateWriteFailed",
                        "SaveState",
                        format!(
                            "Cannot write {}: {e}. nodeguard goes on reporting from what it holds in memory; the last state written stays whole, and an agent restart now would go back to it. Free space on the filesystem of {dir} or make it writable.",
                            path.display()
                        ),
                    );
                } else {
                    tracing::debug!(path = %path.display(), error = %e, "cannot write state (said already)");
                }
                *failing += 1;
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_replaces_the_file_whole_and_leaves_no_temporary_file() {
        let dir = std::env::temp_dir().join(format!("ng-state-{}", std::process::id()));
        let path = dir.join("sub/state.json");
        write_atomic(&path, b"one", true).unwrap();
        write_atomic(&path, b"two", false).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        let names: Vec<_> = std::fs::read_dir(dir.join("sub"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("state.json")]);
        // A directory in the way: the rename fails, the temporary file goes.
        std::fs::create_dir_all(dir.join("sub/blocked/x")).unwrap();
        assert!(write_atomic(&dir.join("sub/blocked"), b"three", false).is_err());
        assert_eq!(
            std::fs::read_dir(dir.join("sub")).unwrap().count(),
            2,
            "the temporary file goes (state.json and blocked stay)"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
