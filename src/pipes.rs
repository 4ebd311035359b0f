//! For tests: who holds a pipe's write end, read from `/proc`. A pipe
//! reading EOF is not "this process let go of it": a child another test
//! forked holds a copy of every descriptor until its exec (close-on-exec
//! acts at the exec), which is not the code under test holding it.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::MetadataExt;

/// The pipe's inode, which both its ends show in `/proc/<pid>/fd`.
pub fn inode(end: &OwnedFd) -> u64 {
    std::fs::File::from(end.try_clone().unwrap())
        .metadata()
        .unwrap()
        .ino()
}

/// What `/proc/<pid>/fd/<n>` links to for the pipe of inode `ino`.
pub fn link(ino: u64) -> String {
    format!("pipe:[{ino}]")
}

/// The descriptors of process `pid` (`self`) on the pipe of inode `ino`.
pub fn descriptors(pid: &str, ino: u64) -> Vec<RawFd> {
    let link = link(ino);
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.flatten()
                .filter(|e| {
                    std::fs::read_link(e.path()).is_ok_and(|l| l.as_os_str() == link.as_str())
                })
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// The descriptors this process has on `read`'s pipe (of inode `ino`)
/// besides `read`: its write ends, unless something here holds a second
/// read end.
pub fn others_here(read: &OwnedFd, ino: u64) -> Vec<RawFd> {
    let own = read.as_raw_fd();
    descriptors("self", ino)
        .into_iter()
        .filter(|fd| *fd != own)
        .collect()
}
