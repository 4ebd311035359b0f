//! The kernel log reader: `/dev/kmsg` (or a file of such records) on its
//! own thread, records dropped and counted when the queue is full.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::mpsc;

use super::super::kmsg;
use super::file_follower::POLL;
use super::lines::text;
use super::paths::{Expect, open_checked};
use super::queue::{Batch, Batcher, offer};
use super::{Cursor, Failures, KmsgStart, SourceCounters, StopFlag};

/// Reads the records already in the ring buffer without delivering them;
/// the sequence number of the newest (`None`: there were none).
pub(super) fn skip_to_end(reader: &mut BufReader<File>) -> std::io::Result<Option<u64>> {
    let mut newest = None;
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match reader.read_until(b'\n', &mut buf) {
            Ok(0) => return Ok(newest),
            Ok(_) => {
                if let Some(rec) = kmsg::parse(&text(&buf)) {
                    newest = Some(rec.sequence);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(newest),
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => {}
            Err(e) => return Err(e),
        }
    }
}

/// Reads kmsg-format records from `path` (`/dev/kmsg`, or a file of such
/// records as a stand-in), from `start`. Returns where it starts, to be
/// saved before any record is read: starting at the end, the newest
/// record's sequence number, so that a restart in the same boot resumes
/// after it rather than at the (then later) end.
pub fn spawn_kmsg(
    path: PathBuf,
    roots: &[PathBuf],
    start: KmsgStart,
    tx: mpsc::Sender<Batch>,
    counters: Arc<SourceCounters>,
    stop: StopFlag,
) -> std::io::Result<Cursor> {
    use std::os::fd::AsRawFd;
    // Non-blocking while skipping what is there (/dev/kmsg answers EAGAIN
    // at its end), blocking afterwards.
    let file = open_checked(&path, roots, Expect::KernelLog, libc::O_NONBLOCK)?;
    let mut reader = BufReader::with_capacity(64 * 1024, file);
    let skip_to = match start {
        KmsgStart::After(seq) => Some(seq),
        KmsgStart::End => skip_to_end(&mut reader)?,
        KmsgStart::Beginning => None,
    };
    let fd = reader.get_ref().as_raw_fd();
    // SAFETY: fcntl on a descriptor this function owns.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags < 0 || libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    let started = Cursor {
        kmsg_sequence: skip_to,
        ..Default::default()
    };
    std::thread::Builder::new()
        .name("nodeguard-kmsg".into())
        .spawn(move || {
            let mut buf = Vec::new();
            let mut batch = Batcher::default();
            let mut failures = Failures::default();
            // The last record's sequence number: a gap after it is records
            // the kernel overwrote before they were read (EPIPE), counted.
            let mut last_seq = skip_to;
            while !stop.stopped() {
                // Records go to the engine as soon as no more is there at
                // once (or the batch is full).
                if (batch.full() || (reader.buffer().is_empty() && !readable_now(fd)))
                    && !offer(&tx, &counters, &mut batch)
                {
                    return;
                }
                // Waits for a record or the stop, whichever comes first: a
                // quiet kernel log costs no wake-ups.
                if reader.buffer().is_empty() && !readable_or_stopped(fd, &stop) {
                    continue;
                }
                buf.clear();
                match reader.read_until(b'\n', &mut buf) {
                    Ok(0) => {
                        failures.ok();
                        // A stand-in file at its end.
                        if !offer(&tx, &counters, &mut batch) {
                            return;
                        }
                        std::thread::sleep(POLL);
                    }
                    Ok(_) => {
                        failures.ok();
                        if buf.starts_with(b" ") {
                            continue; // a dictionary continuation line
                        }
                        let Some(rec) = kmsg::parse(&text(&buf)) else {
                            counters.malformed.fetch_add(1, Ordering::Relaxed);
                            continue;
                        };
                        if skip_to.is_some_and(|l| rec.sequence <= l) {
                            continue; // seen before the restart
                        }
                        if let Some(l) = last_seq
                            && rec.sequence > l + 1
                        {
                            counters.lost(rec.sequence - l - 1);
                        }
                        last_seq = Some(rec.sequence);
                        let cursor = Cursor {
                            kmsg_sequence: Some(rec.sequence),
                            ..Default::default()
                        };
                        batch.push(&counters, &rec.message, cursor);
                    }
                    // Records overwritten before we read them: carry on
                    // (the next record's sequence tells how many).
                    Err(e) if e.raw_os_error() == Some(libc::EPIPE) => {}
                    Err(e) => {
                        // What was read goes before the pause.
                        if !offer(&tx, &counters, &mut batch) {
                            return;
                        }
                        if let Some(why) = failures.failed("the kernel log", &path, &e) {
                            counters.give_up(why);
                            return;
                        }
                    }
                }
            }
        })?;
    Ok(started)
}

/// Whether a read of `fd` would return at once (a record is waiting, or
/// the end of a regular file).
pub(super) fn readable_now(fd: std::os::fd::RawFd) -> bool {
    readable(fd, None, Some(Duration::ZERO))
}

/// How long the kernel log reader waits for a record before it looks at
/// its stop flag again, when the flag has no descriptor to wait on.
pub(super) const POLL_STOP: Duration = Duration::from_secs(1);

/// Waits until a read of `fd` would return (true) or `stop` is stopped
/// (false); without the stop's descriptor, at most [`POLL_STOP`].
pub(super) fn readable_or_stopped(fd: std::os::fd::RawFd, stop: &StopFlag) -> bool {
    use std::os::fd::AsRawFd;
    match stop.wake_fd() {
        Some(wake) => readable(fd, Some(wake.as_raw_fd()), None),
        None => readable(fd, None, Some(POLL_STOP)),
    }
}

/// Whether a read of `fd` would return (a record, an error such as
/// overwritten records, or the end of a regular file) within `wait`
/// (`None`: however long it takes), before `or_else` becomes readable.
fn readable(
    fd: std::os::fd::RawFd,
    or_else: Option<std::os::fd::RawFd>,
    wait: Option<Duration>,
) -> bool {
    let poll_fd = |fd| libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // poll(2) leaves out an entry whose descriptor is negative.
    let mut p = [poll_fd(fd), poll_fd(or_else.unwrap_or(-1))];
    let timeout = wait.map_or(-1, |w| w.as_millis() as libc::c_int);
    // SAFETY: poll on descriptors this reader holds open.
    let r = unsafe { libc::poll(p.as_mut_ptr(), 2, timeout) };
    // An error other than a signal: the read says what it is.
    (r > 0 && p[0].revents != 0)
        || (r < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted)
}
