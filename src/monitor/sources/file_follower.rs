//! The file follower: new lines as they come, across rotation, woken by
//! inotify (or a poll where it cannot be used).

use std::fs::File;
use std::io::{BufReader, Seek, SeekFrom};
use std::mem::MaybeUninit;
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use rustix::event::{PollFd, PollFlags, Timespec, poll};
use rustix::fs::inotify;
use tokio::sync::mpsc;

use super::lines::read_line_capped;
use super::paths::open_at;
use super::queue::{Batch, Batcher, deliver};
use super::{Cursor, Failures, SourceCounters, StopFlag};

/// How often a file follower looks again when it cannot use inotify, and a
/// kmsg stand-in file at its end.
pub(super) const POLL: Duration = Duration::from_millis(100);
/// The longest a file follower sleeps with inotify: a missed event (network
/// filesystems do not send them) then costs at most this much latency.
pub(super) const RECHECK: Duration = Duration::from_secs(1);

/// Puts a file follower to sleep until its file may have changed, instead of
/// waking it every `POLL`: inotify on the followed inode (written, truncated,
/// renamed, deleted) and on its directory (a file created or moved in, which
/// is how rotation and a file that appears late show up). Without inotify
/// (no directory yet, the watch limit reached) it falls back to polling.
pub(super) struct ChangeWaiter {
    pub(super) inotify: Option<OwnedFd>,
    pub(super) file_watch: Option<i32>,
    pub(super) buf: Vec<MaybeUninit<u8>>,
}

impl ChangeWaiter {
    pub(super) fn new(path: &Path) -> ChangeWaiter {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let inotify = inotify::init(inotify::CreateFlags::CLOEXEC | inotify::CreateFlags::NONBLOCK)
            .and_then(|fd| {
                inotify::add_watch(
                    &fd,
                    dir,
                    inotify::WatchFlags::CREATE | inotify::WatchFlags::MOVED_TO,
                )?;
                Ok(fd)
            });
        if let Err(e) = &inotify {
            tracing::warn!(path = %path.display(), error = %e, "cannot watch the log file's directory with inotify; polling it every 100 ms instead");
        }
        let mut waiter = ChangeWaiter {
            inotify: inotify.ok(),
            file_watch: None,
            buf: vec![MaybeUninit::uninit(); 4096],
        };
        waiter.watch_file(path);
        waiter
    }

    /// Points the file watch at the inode `path` names now (after a rotation
    /// or once the file exists).
    pub(super) fn watch_file(&mut self, path: &Path) {
        let Some(fd) = &self.inotify else { return };
        if let Some(wd) = self.file_watch.take() {
            let _ = inotify::remove_watch(fd, wd);
        }
        let flags = inotify::WatchFlags::MODIFY
            | inotify::WatchFlags::ATTRIB
            | inotify::WatchFlags::MOVE_SELF
            | inotify::WatchFlags::DELETE_SELF;
        self.file_watch = inotify::add_watch(fd, path, flags).ok();
    }

    /// Returns when something changed, or after `RECHECK` at the latest.
    pub(super) fn wait(&mut self) {
        let Some(fd) = &self.inotify else {
            std::thread::sleep(POLL);
            return;
        };
        let timeout = Timespec {
            tv_sec: RECHECK.as_secs() as i64,
            tv_nsec: RECHECK.subsec_nanos() as i64,
        };
        let _ = poll(&mut [PollFd::new(fd, PollFlags::IN)], Some(&timeout));
        // The events only mean "look again": drain them.
        let mut events = inotify::Reader::new(fd, &mut self.buf);
        while events.next().is_ok() {}
    }
}

/// Follows a text file: new lines as they come, across rotation (the path
/// names a new inode: read the rest of the old one, then the new one from
/// its start) and truncation (the file shrank: start over). Returns where
/// it starts (inode and offset; inode 0 for a file not there yet, read
/// from its start once it is), to be saved before any line is read.
pub fn spawn_file(
    path: PathBuf,
    roots: Vec<PathBuf>,
    resume: Option<(u64, u64)>,
    tx: mpsc::Sender<Batch>,
    counters: Arc<SourceCounters>,
    stop: StopFlag,
) -> std::io::Result<Cursor> {
    let (file, inode, offset) = match open_at(&path, &roots, resume) {
        Ok(x) => x,
        // Not there yet: wait for it and read it from the start.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            tracing::warn!(path = %path.display(), "log file does not exist yet; waiting for it");
            (File::open("/dev/null")?, 0, 0)
        }
        Err(e) => return Err(e),
    };
    let started = Cursor {
        file: Some((inode, offset)),
        ..Default::default()
    };
    std::thread::Builder::new()
        .name("nodeguard-file".into())
        .spawn(move || {
            let mut waiter = ChangeWaiter::new(&path);
            let mut reader = BufReader::with_capacity(64 * 1024, file);
            let mut inode = inode;
            let mut offset = offset;
            // The line being read (at most MAX_LINE bytes of it), across
            // reads that end mid-line.
            let mut line = Vec::new();
            let mut truncated = false;
            let mut batch = Batcher::default();
            let mut failures = Failures::default();
            while !stop.stopped() {
                if batch.full() && !deliver(&tx, &counters, &mut batch) {
                    return;
                }
                match read_line_capped(&mut reader, &mut line, &mut truncated) {
                    Ok((0, _)) => {
                        failures.ok();
                        // At the end: what was read goes to the engine
                        // before anything waits. Handing it over may wait
                        // for room while the writer goes on: read this file
                        // to its end again before looking for a rotation,
                        // or what it gained meanwhile would be lost.
                        if !batch.is_empty() {
                            if !deliver(&tx, &counters, &mut batch) {
                                return;
                            }
                            continue;
                        }
                        // Rotated or truncated?
                        match std::fs::metadata(&path) {
                            Ok(m) if m.ino() != inode => {
                                match open_at(&path, &roots, Some((m.ino(), 0))) {
                                    Ok((f, ino, _)) => {
                                        counters.set_refused(None);
                                        waiter.watch_file(&path);
                                        reader = BufReader::with_capacity(64 * 1024, f);
                                        inode = ino;
                                        offset = 0;
                                        line.clear();
                                        truncated = false;
                                        continue;
                                    }
                                    // A new file the node does not allow (a
                                    // link leading out): say so and keep
                                    // watching; the monitor goes blind.
                                    Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
                                        if counters.refused_reason().is_none() {
                                            tracing::warn!(path = %path.display(), error = %e, "log file refused");
                                        }
                                        counters.set_refused(Some(e.to_string()));
                                    }
                                    Err(_) => {}
                                }
                            }
                            Ok(m)
                                if m.len() < offset && reader.seek(SeekFrom::Start(0)).is_ok() =>
                            {
                                offset = 0;
                                line.clear();
                                truncated = false;
                                continue;
                            }
                            _ => {}
                        }
                        waiter.wait();
                    }
                    Ok((n, complete)) => {
                        failures.ok();
                        offset += n as u64;
                        if !complete {
                            continue; // the writer is mid-line
                        }
                        if std::mem::take(&mut truncated) {
                            counters.truncated.fetch_add(1, Ordering::Relaxed);
                        }
                        let cursor = Cursor {
                            file: Some((inode, offset)),
                            ..Default::default()
                        };
                        batch.push_bytes(&counters, &line, cursor);
                        line.clear();
                    }
                    Err(e) => {
                        if !deliver(&tx, &counters, &mut batch) {
                            return;
                        }
                        if let Some(why) = failures.failed("the log file", &path, &e) {
                            counters.give_up(why);
                            return;
                        }
                    }
                }
            }
        })?;
    Ok(started)
}
