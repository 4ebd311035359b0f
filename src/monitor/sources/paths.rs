//! Which files a source may open: the node's read roots, resolved once,
//! and a file opened only once its kind and real path are checked.

use std::fs::File;
use std::io::{Seek, SeekFrom};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// The node's read roots with their links resolved, once, when the agent
/// starts (a root that does not exist is kept as written). Resolving them
/// at each open would let whoever can replace a root, or a directory above
/// it, by a link move the root itself.
pub fn resolve_roots(roots: &[String]) -> Vec<PathBuf> {
    roots
        .iter()
        .map(|r| std::fs::canonicalize(r).unwrap_or_else(|_| PathBuf::from(r)))
        .collect()
}

/// Whether `real` (a path with its links resolved) lies under one of the
/// resolved `roots`.
pub fn beneath(real: &Path, roots: &[PathBuf]) -> bool {
    roots.iter().any(|root| real.starts_with(root))
}

/// What a source's file must be.
#[derive(Clone, Copy, Debug)]
pub(super) enum Expect {
    /// A log file.
    Regular,
    /// `/dev/kmsg` (a character device), or a file of its records.
    KernelLog,
}

pub(super) fn refused(message: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::PermissionDenied, message)
}

/// Opens `path` for reading only once it is known to be the right kind of
/// file under the node's read roots. The node's trust judges the path a
/// policy wrote (`policy::trust`); the kernel follows links, so the file
/// is first resolved without being opened (`O_PATH`: a device's open has
/// effects, a watchdog starts; a FIFO's blocks), its type and real path
/// checked, and only then that very file opened through its descriptor.
pub(super) fn open_checked(
    path: &Path,
    roots: &[PathBuf],
    expect: Expect,
    flags: i32,
) -> std::io::Result<File> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let handle = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_CLOEXEC)
        .open(path)?;
    let kind = handle.metadata()?.file_type();
    let right_kind = match expect {
        Expect::Regular => kind.is_file(),
        Expect::KernelLog => kind.is_char_device() || kind.is_file(),
    };
    if !right_kind {
        return Err(refused(format!(
            "{} is not a {}",
            path.display(),
            match expect {
                Expect::Regular => "regular file",
                Expect::KernelLog => "kernel log device or file",
            }
        )));
    }
    let fd = format!("/proc/self/fd/{}", handle.as_raw_fd());
    let real = std::fs::read_link(&fd)?;
    if !beneath(&real, roots) {
        return Err(refused(format!(
            "{} resolves to {}, outside the read paths this node allows (--allow-read-path)",
            path.display(),
            real.display()
        )));
    }
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(flags | libc::O_NOCTTY | libc::O_CLOEXEC)
        .open(&fd)
}

pub(super) fn open_at(
    path: &Path,
    roots: &[PathBuf],
    resume: Option<(u64, u64)>,
) -> std::io::Result<(File, u64, u64)> {
    let mut f = open_checked(path, roots, Expect::Regular, 0)?;
    let meta = f.metadata()?;
    let offset = match resume {
        Some((inode, off)) if inode == meta.ino() && off <= meta.len() => off,
        // Rotated while we were away: the new file from its start.
        Some(_) => 0,
        // First start: only what comes from now on.
        None => meta.len(),
    };
    f.seek(SeekFrom::Start(offset))?;
    Ok((f, meta.ino(), offset))
}
