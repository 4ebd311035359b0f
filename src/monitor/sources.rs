//! Log sources on their own threads (blocking reads), feeding a bounded
//! queue, so memory stays bounded and the async loops are never delayed.
//! When the queue is full, sources whose data stays on disk (files, the
//! journal) wait for room: a flood delays their detection but loses nothing,
//! and the saved cursor only moves past lines the engine has seen. The
//! kernel's ring buffer does not wait for anyone, so kmsg records that find
//! the queue full are counted and dropped.
//!
//! Lines are bytes: one that is not UTF-8 is decoded lossily (U+FFFD for the
//! bad bytes), and file offsets count bytes. A reader whose reads keep
//! failing gives up (the queue closes and the monitor reports its source
//! ended) rather than stay blind while looking alive.

use std::fs::File;
use std::io::{BufRead, BufReader, Seek, SeekFrom};
use std::mem::MaybeUninit;
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use rustix::event::{PollFd, PollFlags, Timespec, poll};
use rustix::fs::inotify;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use super::kmsg;

/// Where a source stands, persisted so a restart neither re-reports old
/// lines nor misses new ones.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Cursor {
    /// The last kernel record sequence processed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kmsg_sequence: Option<u64>,
    /// The followed file's inode and the offset after the last line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<(u64, u64)>,
    /// The journal cursor of the last entry processed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub journal: Option<String>,
}

/// Where a kmsg reader starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KmsgStart {
    /// After the newest record: only what the kernel logs from now on.
    End,
    /// The oldest record still in the ring buffer (a new boot's records).
    Beginning,
    /// After this boot's record with this sequence number (a restart).
    After(u64),
}

/// Where each source resumes, from the saved cursor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resume {
    pub kmsg: KmsgStart,
    pub file: Option<(u64, u64)>,
    pub journal: JournalStart,
}

/// Where a journald reader starts. Every run reads only the current boot
/// (`--boot=<this boot's id>`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JournalStart {
    /// After the newest entry: only what is logged from now on.
    End,
    /// The current boot's first entry: a new boot (what it logged before
    /// the agent started is read; a cursor of the earlier boot cannot be
    /// followed into this one: journalctl skipped the first entry after it).
    BootStart,
    /// After this entry (a restart in the same boot).
    After(String),
}

impl Resume {
    /// `saved` is `None` when the monitor never ran here (its sources start
    /// at the end); `same_boot` says whether the cursor was saved during
    /// this boot. Kernel sequence numbers restart at each boot, so a
    /// cursor of an earlier boot means nothing now: the new boot's ring
    /// buffer is read from its start, and so is the journal's new boot. A
    /// file's inode and offset stay valid across a reboot.
    pub fn plan(saved: Option<&Cursor>, same_boot: bool) -> Resume {
        let Some(c) = saved else {
            return Resume {
                kmsg: KmsgStart::End,
                file: None,
                journal: JournalStart::End,
            };
        };
        let kmsg = match (same_boot, c.kmsg_sequence) {
            (false, _) => KmsgStart::Beginning,
            (true, Some(seq)) => KmsgStart::After(seq),
            (true, None) => KmsgStart::End,
        };
        let journal = match (same_boot, &c.journal) {
            (false, _) => JournalStart::BootStart,
            (true, Some(cursor)) => JournalStart::After(cursor.clone()),
            (true, None) => JournalStart::End,
        };
        Resume {
            kmsg,
            file: c.file,
            journal,
        }
    }
}

/// Lines for the engine, read together: their text back to back and the
/// cursor after each. A flood costs one allocation and one hand-over (one
/// wake-up of the engine) per batch, not per line; a reader sends what it
/// has as soon as its source has nothing more at once, so a quiet log's
/// line goes alone and at once.
#[derive(Debug)]
pub struct Batch {
    text: String,
    /// Where each line ends in `text`.
    ends: Vec<usize>,
    cursors: Vec<Cursor>,
    /// The batch's share of the queue's bytes, given back when it is
    /// dropped (the engine is done with it).
    _held: Held,
}

impl Batch {
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// The `i`th line.
    pub fn line(&self, i: usize) -> &str {
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        &self.text[start..self.ends[i]]
    }

    /// Where the source stands after the `i`th line.
    pub fn cursor(&self, i: usize) -> &Cursor {
        &self.cursors[i]
    }

    /// Where the source stands after the batch.
    pub fn into_last_cursor(mut self) -> Option<Cursor> {
        self.cursors.pop()
    }
}

/// The most lines, and about the most bytes, one batch holds.
const BATCH_LINES: usize = 256;
const BATCH_BYTES: usize = 64 * 1024;

/// A reader's batch being filled.
#[derive(Debug, Default)]
struct Batcher {
    text: String,
    ends: Vec<usize>,
    cursors: Vec<Cursor>,
    /// What the lines count against the queue's bytes.
    bytes: usize,
}

impl Batcher {
    fn push(&mut self, counters: &SourceCounters, line: &str, cursor: Cursor) {
        counters.lines.fetch_add(1, Ordering::Relaxed);
        self.bytes += item_bytes(line, &cursor);
        self.text.push_str(line);
        self.ends.push(self.text.len());
        self.cursors.push(cursor);
    }

    /// A line as read: a newline at its end dropped, bytes that are not
    /// UTF-8 replaced.
    fn push_bytes(&mut self, counters: &SourceCounters, bytes: &[u8], cursor: Cursor) {
        self.push(counters, &text(bytes), cursor);
    }

    fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    fn full(&self) -> bool {
        self.ends.len() >= BATCH_LINES || self.bytes >= BATCH_BYTES
    }

    fn take(&mut self, counters: &Arc<SourceCounters>) -> Batch {
        let bytes = std::mem::take(&mut self.bytes);
        Batch {
            text: std::mem::take(&mut self.text),
            ends: std::mem::take(&mut self.ends),
            cursors: std::mem::take(&mut self.cursors),
            _held: Held(counters.clone(), bytes),
        }
    }
}

/// The most bytes of lines (and their cursors) that may wait for one
/// monitor's rules. Beyond, file and journal readers wait and kmsg records
/// are dropped and counted, as when the queue's count is reached: a flood
/// of long lines meeting a slow engine (a taint request retried, a large
/// NPD buffer) holds 1 MiB, not `QUEUE` batches of up to 256 KiB lines.
/// One batch alone is always let through. 1 MiB is 16 full batches: enough
/// for the reader to run ahead of the engine (about 6,000 kernel records),
/// and what a flood adds to the agent's peak RSS per monitor.
pub const QUEUE_BYTES: usize = 1 << 20;

/// The bytes a queue holds now, and a reader waiting for room.
#[derive(Debug, Default)]
pub struct QueuedBytes {
    bytes: std::sync::Mutex<usize>,
    room: std::sync::Condvar,
}

impl QueuedBytes {
    fn lock(&self) -> std::sync::MutexGuard<'_, usize> {
        self.bytes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes `n` bytes when they fit now.
    fn try_take(&self, n: usize) -> bool {
        let mut b = self.lock();
        if *b > 0 && *b + n > QUEUE_BYTES {
            return false;
        }
        *b += n;
        true
    }

    /// Takes `n` bytes, waiting for room; false once `gone` says the
    /// engine is gone.
    fn take(&self, n: usize, gone: impl Fn() -> bool) -> bool {
        let mut b = self.lock();
        while *b > 0 && *b + n > QUEUE_BYTES {
            if gone() {
                return false;
            }
            b = self
                .room
                .wait_timeout(b, Duration::from_millis(100))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        *b += n;
        true
    }

    fn give_back(&self, n: usize) {
        let mut b = self.lock();
        *b = b.saturating_sub(n);
        drop(b);
        self.room.notify_one();
    }

    /// The bytes held now.
    pub fn held(&self) -> usize {
        *self.lock()
    }
}

/// Gives a batch's bytes back to its queue when the batch goes.
#[derive(Debug)]
struct Held(Arc<SourceCounters>, usize);

impl Drop for Held {
    fn drop(&mut self) {
        self.0.queued.give_back(self.1);
    }
}

/// What a line counts against the queue's bytes: its text and cursor, and
/// a little for its place in the batch.
fn item_bytes(line: &str, cursor: &Cursor) -> usize {
    line.len() + cursor.journal.as_ref().map_or(0, String::len) + 64
}

/// Counters shared with the metrics, and why the reader gave up.
#[derive(Debug, Default)]
pub struct SourceCounters {
    pub lines: AtomicU64,
    pub dropped: AtomicU64,
    pub malformed: AtomicU64,
    /// File lines longer than `MAX_LINE`, matched on their first
    /// `MAX_LINE` bytes.
    pub truncated: AtomicU64,
    /// Set by a reader thread that gave up, just before its queue closes.
    pub ended: std::sync::Mutex<Option<String>>,
    /// Set while the source's current file is refused by the node's read
    /// roots (a link leading out appeared, or a rotation put one there);
    /// cleared when a later open is allowed. The reader keeps running.
    pub refused: std::sync::Mutex<Option<String>>,
    /// The bytes of lines waiting in the queue ([`QUEUE_BYTES`] at most).
    pub queued: QueuedBytes,
}

impl SourceCounters {
    fn give_up(&self, why: String) {
        *self.ended.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
    }

    fn set_refused(&self, why: Option<String>) {
        *self.refused.lock().unwrap_or_else(|e| e.into_inner()) = why;
    }

    /// Why the source's current file is refused, while it is.
    pub fn refused_reason(&self) -> Option<String> {
        self.refused
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Why the reader gave up, if it said.
    pub fn end_reason(&self) -> Option<String> {
        self.ended.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// A reader whose reads fail this many times in a row (a second apart)
/// gives up.
const FAILED_READS: u32 = 5;

/// Counts failed reads in a row; `Some(reason)` once the reader should give
/// up.
#[derive(Debug)]
struct Failures {
    in_a_row: u32,
    pause: Duration,
}

impl Default for Failures {
    fn default() -> Self {
        Failures {
            in_a_row: 0,
            pause: Duration::from_secs(1),
        }
    }
}

impl Failures {
    fn ok(&mut self) {
        self.in_a_row = 0;
    }

    fn failed(&mut self, what: &str, path: &Path, e: &std::io::Error) -> Option<String> {
        self.in_a_row += 1;
        if self.in_a_row >= FAILED_READS {
            tracing::error!(path = %path.display(), error = %e, "{what} read failed {} times in a row; giving up", self.in_a_row);
            return Some(format!(
                "reading {what} {} failed {} times in a row: {e}",
                path.display(),
                self.in_a_row
            ));
        }
        tracing::warn!(path = %path.display(), error = %e, "{what} read failed; retrying");
        std::thread::sleep(self.pause);
        None
    }
}

/// The most of one file line that is kept and matched (64 KiB; journald
/// cuts its own stream lines at 48 KiB). The rest of a longer line is read
/// past, not held: a writer that never ends its line costs no memory.
pub const MAX_LINE: usize = 64 * 1024;

/// Reads up to and including the next newline into `line`, keeping at most
/// `MAX_LINE` bytes of it (`truncated` is set when more came). Returns the
/// bytes consumed and whether the line is complete (false at the end of the
/// data: the writer is mid-line, and the next call goes on with it).
pub fn read_line_capped(
    reader: &mut impl BufRead,
    line: &mut Vec<u8>,
    truncated: &mut bool,
) -> std::io::Result<(usize, bool)> {
    read_line_capped_to(reader, line, truncated, MAX_LINE)
}

/// [`read_line_capped`] keeping at most `max` bytes.
fn read_line_capped_to(
    reader: &mut impl BufRead,
    line: &mut Vec<u8>,
    truncated: &mut bool,
    max: usize,
) -> std::io::Result<(usize, bool)> {
    let mut consumed = 0;
    loop {
        let available = match reader.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if available.is_empty() {
            return Ok((consumed, false));
        }
        let (take, complete) = match available.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (available.len(), false),
        };
        let room = max.saturating_sub(line.len());
        let chunk = &available[..take];
        let body = chunk.strip_suffix(b"\n").unwrap_or(chunk);
        if body.len() > room {
            *truncated = true;
        }
        line.extend_from_slice(&body[..body.len().min(room)]);
        reader.consume(take);
        consumed += take;
        if complete {
            return Ok((consumed, true));
        }
    }
}

fn text(bytes: &[u8]) -> std::borrow::Cow<'_, str> {
    let bytes = bytes.strip_suffix(b"\n").unwrap_or(bytes);
    String::from_utf8_lossy(bytes)
}

/// Stops the reader thread (at its next record or wake-up, within a second;
/// a journalctl child is killed).
#[derive(Clone, Debug, Default)]
pub struct StopFlag(Arc<AtomicBool>, Arc<std::sync::Mutex<Option<u32>>>);

impl StopFlag {
    pub fn stop(&self) {
        self.0.store(true, Ordering::SeqCst);
        if let Some(pid) = *self.1.lock().unwrap_or_else(|e| e.into_inner()) {
            // SAFETY: signalling our own child process.
            unsafe {
                libc::kill(pid as i32, libc::SIGTERM);
            }
        }
    }
    fn stopped(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// Hands the batch over, waiting for room (files, the journal). False once
/// the engine is gone.
fn deliver(tx: &mpsc::Sender<Batch>, counters: &Arc<SourceCounters>, batch: &mut Batcher) -> bool {
    if batch.is_empty() {
        return !tx.is_closed();
    }
    if !counters.queued.take(batch.bytes, || tx.is_closed()) {
        return false;
    }
    tx.blocking_send(batch.take(counters)).is_ok()
}

/// Hands kmsg records over, or counts them dropped when the queue is full.
fn offer(tx: &mpsc::Sender<Batch>, counters: &Arc<SourceCounters>, batch: &mut Batcher) -> bool {
    if batch.is_empty() {
        return !tx.is_closed();
    }
    let n = batch.ends.len() as u64;
    if !counters.queued.try_take(batch.bytes) {
        counters.dropped.fetch_add(n, Ordering::Relaxed);
        *batch = Batcher::default();
        return !tx.is_closed();
    }
    match tx.try_send(batch.take(counters)) {
        Ok(()) => true,
        Err(mpsc::error::TrySendError::Full(_)) => {
            counters.dropped.fetch_add(n, Ordering::Relaxed);
            true
        }
        Err(mpsc::error::TrySendError::Closed(_)) => false,
    }
}

/// How often a file follower looks again when it cannot use inotify, and a
/// kmsg stand-in file at its end.
const POLL: Duration = Duration::from_millis(100);
/// The longest a file follower sleeps with inotify: a missed event (network
/// filesystems do not send them) then costs at most this much latency.
const RECHECK: Duration = Duration::from_secs(1);

/// Puts a file follower to sleep until its file may have changed, instead of
/// waking it every `POLL`: inotify on the followed inode (written, truncated,
/// renamed, deleted) and on its directory (a file created or moved in, which
/// is how rotation and a file that appears late show up). Without inotify
/// (no directory yet, the watch limit reached) it falls back to polling.
struct ChangeWaiter {
    inotify: Option<OwnedFd>,
    file_watch: Option<i32>,
    buf: Vec<MaybeUninit<u8>>,
}

impl ChangeWaiter {
    fn new(path: &Path) -> ChangeWaiter {
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
    fn watch_file(&mut self, path: &Path) {
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
    fn wait(&mut self) {
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

/// Reads the records already in the ring buffer without delivering them;
/// the sequence number of the newest (`None`: there were none).
fn skip_to_end(reader: &mut BufReader<File>) -> std::io::Result<Option<u64>> {
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
                // Waits for a record a second at a time, so that a stop is
                // seen within a second on a quiet kernel log, not at its
                // next record.
                if reader.buffer().is_empty() && !readable_within(fd, POLL_STOP) {
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
                            counters
                                .dropped
                                .fetch_add(rec.sequence - l - 1, Ordering::Relaxed);
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
fn readable_now(fd: std::os::fd::RawFd) -> bool {
    readable_within(fd, Duration::ZERO)
}

/// How long the kernel log reader waits for a record before it looks at
/// its stop flag again.
const POLL_STOP: Duration = Duration::from_secs(1);

/// Whether a read of `fd` would return within `wait` (a record, an error
/// such as overwritten records, or the end of a regular file).
fn readable_within(fd: std::os::fd::RawFd, wait: Duration) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll on one descriptor this reader owns.
    let r = unsafe { libc::poll(&mut p, 1, wait.as_millis() as libc::c_int) };
    // An error other than a signal: the read says what it is.
    r > 0 || (r < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted)
}

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
enum Expect {
    /// A log file.
    Regular,
    /// `/dev/kmsg` (a character device), or a file of its records.
    KernelLog,
}

fn refused(message: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::PermissionDenied, message)
}

/// Opens `path` for reading only once it is known to be the right kind of
/// file under the node's read roots. The node's trust judges the path a
/// policy wrote (`policy::trust`); the kernel follows links, so the file
/// is first resolved without being opened (`O_PATH`: a device's open has
/// effects, a watchdog starts; a FIFO's blocks), its type and real path
/// checked, and only then that very file opened through its descriptor.
fn open_checked(
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

fn open_at(
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

/// The text of a journal entry in `journalctl --output=json`: MESSAGE is a
/// string, or an array of bytes when it is not valid UTF-8.
pub fn journal_message(entry: &serde_json::Value) -> Option<String> {
    match entry.get("MESSAGE")? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(bytes) => {
            let b: Vec<u8> = bytes
                .iter()
                .filter_map(|v| v.as_u64().map(|n| n as u8))
                .collect();
            Some(String::from_utf8_lossy(&b).into_owned())
        }
        _ => None,
    }
}

/// The most of one `journalctl --output=json` line that is kept: room for
/// a `MAX_LINE` message even where JSON escapes it, and the few other
/// fields. A longer entry is read up to here, its message salvaged.
const MAX_JOURNAL_LINE: usize = 4 * MAX_LINE;

/// The cursor and the message of a JSON entry cut short at
/// `MAX_JOURNAL_LINE`: the message up to the cut (a text or an array of
/// bytes), the cursor if all of it came before the cut (else the reader
/// keeps the previous one, and a restart reads this entry again). `None`
/// without a message.
pub fn salvage_journal_line(line: &str) -> Option<(Option<String>, Option<String>)> {
    // A JSON string's body starting at `s`, up to its closing quote or the
    // cut, decoded (a partial escape at the cut is dropped); and whether
    // its closing quote was read.
    fn string_at(s: &str) -> (String, bool) {
        let mut end = s.len();
        let mut escaped = false;
        for (i, b) in s.bytes().enumerate() {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => {
                    end = i;
                    break;
                }
                _ => {}
            }
        }
        let body = &s[..end];
        // Up to 6 bytes (`\uXXXX`) of a cut escape are dropped.
        let text = (0..=6.min(body.len()))
            .filter(|k| body.is_char_boundary(body.len() - k))
            .find_map(|k| {
                serde_json::from_str::<String>(&format!("\"{}\"", &body[..body.len() - k])).ok()
            })
            .unwrap_or_default();
        (text, end < s.len())
    }
    // journalctl orders an entry's fields at random (per run): the cursor
    // may come after the cut, or be cut itself. Only a whole one is taken.
    let cursor = line
        .find("\"__CURSOR\":\"")
        .map(|i| string_at(&line[i + "\"__CURSOR\":\"".len()..]))
        .and_then(|(c, whole)| whole.then_some(c));
    let at = line.find("\"MESSAGE\":")? + "\"MESSAGE\":".len();
    let value = &line[at..];
    let message = if let Some(s) = value.strip_prefix('"') {
        string_at(s).0
    } else if let Some(a) = value.strip_prefix('[') {
        let bytes: Vec<u8> = a
            .split([',', ']'])
            .map_while(|n| n.trim().parse::<u8>().ok())
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    } else {
        return None;
    };
    Some((cursor, Some(message)))
}

/// Follows the journal with a supervised `journalctl --follow --output=json`
/// child (restarted with a pause when it exits), from `start`. Returns the
/// cursor to save: with none, a restart before the first entry was read
/// starts at the end again.
///
/// journalctl rather than a library binding: it reads every journal format
/// the host's systemd writes (compression, compact mode) with no C
/// dependency in the agent, and the cursor gives exact resumption.
pub fn spawn_journald(
    source: crate::policy::monitors::JournaldSource,
    program: &Path,
    roots: &[PathBuf],
    start: JournalStart,
    tx: mpsc::Sender<Batch>,
    counters: Arc<SourceCounters>,
    stop: StopFlag,
) -> std::io::Result<Cursor> {
    let started = Cursor {
        journal: match &start {
            JournalStart::After(c) => Some(c.clone()),
            _ => None,
        },
        ..Default::default()
    };
    spawn_journalctl(
        Journalctl {
            program: program.to_path_buf(),
            restart_min: JOURNAL_RESTART_MIN,
            source,
            roots: roots.to_vec(),
        },
        start,
        tx,
        counters,
        stop,
    )?;
    Ok(started)
}

/// How long journalctl waits before a restart: doubling from 1 s to 60 s
/// while it keeps exiting without delivering anything (a journal with no
/// data for this boot makes it exit at once), back to 1 s after it delivered.
const JOURNAL_RESTART_MIN: Duration = Duration::from_secs(1);
/// A journalctl run shorter than this that read nothing failed at start.
const RUN_FAILED_AT_ONCE: Duration = Duration::from_secs(2);
const JOURNAL_RESTART_MAX: Duration = Duration::from_secs(60);
/// The longest pause while the journal has no entry of this boot yet.
const NO_ENTRY_RETRY_MAX: Duration = Duration::from_secs(5);

/// Kills and reaps a journalctl child, forgetting its pid first (under the
/// lock [`StopFlag::stop`] signals it with): once reaped the pid may be
/// another process's, and a stop must not signal that one.
fn end_journalctl(stop: &StopFlag, child: &mut std::process::Child) {
    let _ = child.kill();
    *stop.1.lock().unwrap_or_else(|e| e.into_inner()) = None;
    let _ = child.wait();
}

/// This boot's id as journalctl's `--boot` takes it (32 hex digits), from
/// the kernel; `None` when it cannot be read (then `--boot` is left out).
fn journal_boot_id() -> Option<String> {
    let raw = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let id: String = raw.trim().chars().filter(|c| *c != '-').collect();
    (id.len() == 32 && id.chars().all(|c| c.is_ascii_hexdigit())).then_some(id)
}

/// What the journal reader runs, and what it may read.
struct Journalctl {
    program: PathBuf,
    restart_min: Duration,
    source: crate::policy::monitors::JournaldSource,
    /// The node's resolved read roots (`--directory` must lie under one).
    roots: Vec<PathBuf>,
}

fn spawn_journalctl(
    Journalctl {
        program,
        restart_min,
        source,
        roots,
    }: Journalctl,
    start: JournalStart,
    tx: mpsc::Sender<Batch>,
    counters: Arc<SourceCounters>,
    stop: StopFlag,
) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("nodeguard-journal".into())
        .spawn(move || {
            let (mut cursor, mut whole_boot) = match start {
                JournalStart::End => (None, false),
                JournalStart::BootStart => (None, true),
                JournalStart::After(c) => (Some(c), false),
            };
            let mut backoff = crate::server::backoff::Backoff::new(restart_min, JOURNAL_RESTART_MAX);
            let mut last_err: Option<String> = None;
            // The kernel's boot id, as journald writes it in `_BOOT_ID` (in
            // a container too: the kernel is the host's).
            let this_boot = journal_boot_id();
            if this_boot.is_none() {
                tracing::warn!("cannot read this boot's id (/proc/sys/kernel/random/boot_id): journalctl runs without --boot, and before systemd 250 reads earlier boots too");
            }
            while !stop.stopped() {
                let mut delivered = false;
                let mut cmd = std::process::Command::new(&program);
                // --all: without it a field over 4,096 bytes is printed as
                // null, and the entry (its problem too) would be lost.
                // --output-fields: only what is read, so a line is mostly
                // its message.
                cmd.args([
                    "--follow",
                    "--output=json",
                    "--all",
                    "--output-fields=MESSAGE",
                    "--no-pager",
                    "--quiet",
                ]);
                if let Some(d) = &source.directory {
                    // journalctl follows links in --directory: judge where
                    // this one leads now (each run), and hand it that.
                    match std::fs::canonicalize(d) {
                        Ok(real) if beneath(&real, &roots) => {
                            counters.set_refused(None);
                            cmd.arg(format!("--directory={}", real.display()));
                        }
                        Ok(real) => {
                            let why = format!(
                                "{d} resolves to {}, outside the read paths this node allows (--allow-read-path)",
                                real.display()
                            );
                            if counters.refused_reason().is_none() {
                                tracing::warn!(directory = %d, "journal directory refused: {why}");
                            }
                            counters.set_refused(Some(why));
                            std::thread::sleep(Duration::from_secs(5));
                            continue;
                        }
                        // Not there (yet): journalctl says so and is retried.
                        Err(_) => {
                            cmd.arg(format!("--directory={d}"));
                        }
                    }
                }
                if let Some(u) = &source.unit {
                    cmd.arg(format!("--unit={u}"));
                }
                if let Some(i) = &source.identifier {
                    cmd.arg(format!("--identifier={i}"));
                }
                // This boot, named on every run: before systemd 250
                // `--follow` does not keep to the current boot (and
                // `--lines=all` would replay every earlier one), and with
                // `--directory` a newer one takes the directory's newest
                // boot, which need not be the running kernel's.
                if let Some(boot) = &this_boot {
                    cmd.arg(format!("--boot={boot}"));
                }
                match &cursor {
                    Some(c) => cmd.arg(format!("--after-cursor={c}")),
                    None if whole_boot => cmd.arg("--lines=all"),
                    None => cmd.arg("--lines=0"),
                };
                let run_started = std::time::Instant::now();
                cmd.stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped());
                let mut child = match cmd.spawn() {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::error!(error = %e, "cannot run journalctl; retrying in 5 s");
                        std::thread::sleep(Duration::from_secs(5));
                        continue;
                    }
                };
                *stop.1.lock().unwrap_or_else(|e| e.into_inner()) = Some(child.id());
                // A stop between the check above and the pid's record
                // signalled nothing: seen now.
                if stop.stopped() {
                    end_journalctl(&stop, &mut child);
                    break;
                }
                let mut reader =
                    BufReader::with_capacity(64 * 1024, child.stdout.take().expect("piped"));
                let mut buf = Vec::new();
                let mut batch = Batcher::default();
                loop {
                    // Entries go to the engine once no more is buffered (the
                    // next read may wait for journalctl) or the batch is full.
                    if (batch.full() || reader.buffer().is_empty())
                        && !deliver(&tx, &counters, &mut batch)
                    {
                        end_journalctl(&stop, &mut child);
                        return;
                    }
                    buf.clear();
                    let mut truncated = false;
                    match read_line_capped_to(&mut reader, &mut buf, &mut truncated, MAX_JOURNAL_LINE) {
                        Ok((0, _)) | Err(_) => break,
                        Ok(_) => {}
                    }
                    let line = String::from_utf8_lossy(&buf);
                    let parsed = if truncated {
                        counters.truncated.fetch_add(1, Ordering::Relaxed);
                        salvage_journal_line(&line)
                    } else {
                        serde_json::from_str::<serde_json::Value>(&line)
                            .ok()
                            .map(|entry| {
                                let c = entry
                                    .get("__CURSOR")
                                    .and_then(|c| c.as_str())
                                    .map(str::to_string);
                                (c, journal_message(&entry))
                            })
                    };
                    let Some((c, message)) = parsed else {
                        counters.malformed.fetch_add(1, Ordering::Relaxed);
                        continue;
                    };
                    // An entry without a whole cursor (cut short) keeps the
                    // last one: a restart reads it again rather than start
                    // at the journal's end.
                    if c.is_some() {
                        cursor = c;
                    }
                    let Some(message) = message else {
                        counters.malformed.fetch_add(1, Ordering::Relaxed);
                        continue;
                    };
                    let item_cursor = Cursor {
                        journal: cursor.clone(),
                        ..Default::default()
                    };
                    batch.push(&counters, &message, item_cursor);
                    delivered = true;
                }
                if !deliver(&tx, &counters, &mut batch) {
                    end_journalctl(&stop, &mut child);
                    return;
                }
                let _ = child.kill();
                let mut err = String::new();
                if let Some(mut e) = child.stderr.take() {
                    use std::io::Read;
                    let _ = (&mut e).take(4096).read_to_string(&mut err);
                }
                end_journalctl(&stop, &mut child);
                if stop.stopped() {
                    break;
                }
                if delivered {
                    backoff.reset();
                }
                // A run that ends at once having read nothing found no entry
                // of this boot (journalctl exits so on a journal that has
                // none yet, or a directory not there yet): every entry of
                // this boot it finds later came after the monitor started,
                // so the next runs read the boot from its start. No clock
                // is involved, so a wall-clock step cannot hide entries.
                let no_entry_yet =
                    cursor.is_none() && !delivered && run_started.elapsed() < RUN_FAILED_AT_ONCE;
                if no_entry_yet {
                    whole_boot = true;
                }
                // Said once per distinct error, not once per restart.
                let err = err.trim().to_string();
                let delay = backoff.peek();
                if last_err.as_deref() != Some(err.as_str()) {
                    tracing::warn!(stderr = %err, retry_in = ?delay, "journalctl exited; restarting it (backing off up to 60 s while it keeps failing)");
                } else {
                    tracing::debug!(stderr = %err, retry_in = ?delay, "journalctl exited again");
                }
                last_err = Some(err);
                let until = std::time::Instant::now() + delay;
                while !stop.stopped() && std::time::Instant::now() < until {
                    std::thread::sleep(
                        until
                            .saturating_duration_since(std::time::Instant::now())
                            .min(Duration::from_millis(100)),
                    );
                }
                // Waiting for this boot's first entry (journalctl exits at
                // once until there is one): looked for every 5 s, not once
                // a minute, so a new boot's first problems are not late.
                let most = if no_entry_yet {
                    NO_ENTRY_RETRY_MAX
                } else {
                    JOURNAL_RESTART_MAX
                };
                // The next wait: twice this one, up to `most`.
                backoff.next_within(most);
            }
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A fresh directory under the temp dir, removed on drop.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(name: &str) -> Scratch {
            let dir = std::env::temp_dir().join(format!("ng-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Scratch(dir)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// Roots are resolved once, at start: replacing a root by a link
    /// afterwards does not move it, and a link under it leading out stays
    /// refused; devices and FIFOs are refused without being opened.
    #[test]
    fn roots_are_resolved_once_and_only_right_kinds_of_files_open() {
        let scratch = Scratch::new("roots");
        let root = scratch.0.join("logs");
        std::fs::create_dir(&root).unwrap();
        std::fs::write(root.join("app.log"), "x\n").unwrap();
        let roots = resolve_roots(&[root.display().to_string()]);
        assert!(open_checked(&root.join("app.log"), &roots, Expect::Regular, 0).is_ok());
        // Swap the root for a link to / (as whoever may write its parent).
        std::fs::rename(&root, scratch.0.join("logs.old")).unwrap();
        std::os::unix::fs::symlink("/", &root).unwrap();
        let err = open_checked(&root.join("etc/hostname"), &roots, Expect::Regular, 0).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::PermissionDenied);
        assert!(
            err.to_string().contains("resolves to /etc/hostname"),
            "{err}"
        );
        // A device is not a log file, and is not opened to find out.
        let all = [PathBuf::from("/")];
        let err = open_checked(Path::new("/dev/null"), &all, Expect::Regular, 0).unwrap_err();
        assert!(err.to_string().contains("is not a regular file"), "{err}");
        assert!(open_checked(Path::new("/dev/null"), &all, Expect::KernelLog, 0).is_ok());
    }

    fn append(path: &Path) -> File {
        std::fs::OpenOptions::new().append(true).open(path).unwrap()
    }

    /// Follows `path` (every path readable) from `resume` with a queue of
    /// `capacity` lines: the lines, and the reader's counters.
    fn follow(
        path: &Path,
        resume: Option<(u64, u64)>,
        capacity: usize,
        counters: Arc<SourceCounters>,
        stop: &StopFlag,
    ) -> Lines {
        let (tx, rx) = mpsc::channel(capacity);
        spawn_file(
            path.to_path_buf(),
            vec![PathBuf::from("/")],
            resume,
            tx,
            counters,
            stop.clone(),
        )
        .unwrap();
        Lines::new(rx)
    }

    /// One line as the engine gets it, with the cursor after it.
    struct Item {
        line: String,
        cursor: Cursor,
    }

    /// A reader's queue of batches, line by line.
    struct Lines {
        rx: mpsc::Receiver<Batch>,
        pending: std::collections::VecDeque<Item>,
    }

    impl Lines {
        fn new(rx: mpsc::Receiver<Batch>) -> Lines {
            Lines {
                rx,
                pending: Default::default(),
            }
        }

        /// Batches waiting in the queue.
        fn len(&self) -> usize {
            self.rx.len()
        }
    }

    async fn next(rx: &mut Lines) -> Item {
        while rx.pending.is_empty() {
            let batch = tokio::time::timeout(Duration::from_secs(5), rx.rx.recv())
                .await
                .expect("a line within 5 s")
                .expect("channel open");
            assert!(!batch.is_empty(), "an empty batch was sent");
            for i in 0..batch.len() {
                rx.pending.push_back(Item {
                    line: batch.line(i).to_string(),
                    cursor: batch.cursor(i).clone(),
                });
            }
        }
        rx.pending.pop_front().unwrap()
    }

    /// Seen on a host whose journal has no data for the current boot:
    /// journalctl exits at once, and restarting it every second flooded the
    /// log and cost CPU. It now backs off (1 s, 2 s, 4 s, …; here from
    /// 50 ms): each pause is at least twice the one before.
    #[test]
    fn a_journalctl_that_keeps_exiting_is_restarted_with_backoff() {
        let scratch = Scratch::new("journal-backoff");
        let dir = &scratch.0;
        let runs = dir.join("runs");
        let fake = dir.join("journalctl");
        std::fs::write(
            &fake,
            format!(
                "#!/bin/sh\ndate +%s%N >> {}\necho \"$@\" >> {}\necho 'No such boot ID in journal' >&2\nexit 1\n",
                runs.display(),
                dir.join("args").display()
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        let (tx, _rx) = mpsc::channel(4);
        let stop = StopFlag::default();
        let min = Duration::from_millis(50);
        spawn_journalctl(
            Journalctl {
                program: fake,
                restart_min: min,
                source: Default::default(),
                roots: vec![PathBuf::from("/")],
            },
            JournalStart::End,
            tx,
            Arc::new(SourceCounters::default()),
            stop.clone(),
        )
        .unwrap();
        let starts = || -> Vec<u64> {
            std::fs::read_to_string(&runs)
                .unwrap_or_default()
                .lines()
                .filter_map(|l| l.trim().parse().ok())
                .collect()
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while starts().len() < 5 {
            assert!(std::time::Instant::now() < deadline, "{:?}", starts());
            std::thread::sleep(Duration::from_millis(20));
        }
        stop.stop();
        let t = starts();
        // The pause before start i+1 is at least min × 2^i (sleeping never
        // ends early; a busy machine only makes the gaps longer).
        for i in 0..4 {
            let gap = Duration::from_nanos(t[i + 1] - t[i]);
            assert!(gap >= min * 2u32.pow(i as u32), "gap {i}: {gap:?} in {t:?}");
        }
        // The first run starts at the end; it found no entry of this boot,
        // so every one that comes later is new: the next runs read the boot
        // from its start (no --since: a clock step cannot hide entries).
        let args = std::fs::read_to_string(dir.join("args")).unwrap();
        let runs: Vec<&str> = args.lines().collect();
        assert!(runs[0].contains("--lines=0"), "{args}");
        assert!(
            runs[1..]
                .iter()
                .all(|r| r.contains("--lines=all") && !r.contains("--since")),
            "{args}"
        );
    }

    /// A line that is not UTF-8 is decoded lossily; the line after it is
    /// read whole (it used to be skipped), and the offset counts bytes.
    #[tokio::test]
    async fn a_line_that_is_not_utf8_loses_no_neighbour_and_offsets_count_bytes() {
        let scratch = Scratch::new("not-utf8");
        let path = scratch.0.join("app.log");
        std::fs::write(&path, "").unwrap();
        let stop = StopFlag::default();
        let mut rx = follow(&path, None, 16, Default::default(), &stop);
        let lines: [&[u8]; 3] = [
            b"before\n",
            b"bad \xff\xfe byte\n",
            b"EXT4-fs error (device sda1): x\n",
        ];
        let mut f = append(&path);
        for l in lines {
            f.write_all(l).unwrap();
        }
        f.flush().unwrap();
        let mut offset = 0;
        for (l, want) in lines.iter().zip([
            "before",
            "bad \u{fffd}\u{fffd} byte",
            "EXT4-fs error (device sda1): x",
        ]) {
            offset += l.len() as u64;
            let item = next(&mut rx).await;
            assert_eq!(item.line, want);
            assert_eq!(item.cursor.file.unwrap().1, offset, "after {want:?}");
        }
        assert_eq!(offset, std::fs::metadata(&path).unwrap().len());
        // A multi-byte character split across two writes is one character.
        f.write_all("caf\u{e9}".as_bytes().split_at(4).0).unwrap();
        f.flush().unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        f.write_all(&"caf\u{e9}\n".as_bytes()[4..]).unwrap();
        f.flush().unwrap();
        assert_eq!(next(&mut rx).await.line, "caf\u{e9}");
        stop.stop();
    }

    #[test]
    fn where_sources_resume() {
        let saved = Cursor {
            kmsg_sequence: Some(1000),
            file: Some((7, 120)),
            journal: Some("s=abc".into()),
        };
        assert_eq!(
            Resume::plan(None, true),
            Resume {
                kmsg: KmsgStart::End,
                file: None,
                journal: JournalStart::End
            },
            "a monitor that never ran starts at the end"
        );
        assert_eq!(
            Resume::plan(Some(&saved), true),
            Resume {
                kmsg: KmsgStart::After(1000),
                file: Some((7, 120)),
                journal: JournalStart::After("s=abc".into())
            }
        );
        assert_eq!(
            Resume::plan(Some(&saved), false),
            Resume {
                kmsg: KmsgStart::Beginning,
                file: Some((7, 120)),
                journal: JournalStart::BootStart
            },
            "a cursor of boot A is not applied in boot B (the kernel's and the journal's new boot are read from its start); files keep theirs"
        );
        assert_eq!(
            Resume::plan(Some(&Cursor::default()), false).kmsg,
            KmsgStart::Beginning
        );
        assert_eq!(
            Resume::plan(Some(&Cursor::default()), true).kmsg,
            KmsgStart::End
        );
    }

    /// Boot A's reader stopped at record 1000; boot B's records start again
    /// at 0: all of them are read (they used to be skipped up to 1000).
    #[tokio::test]
    async fn a_new_boots_kmsg_records_with_low_sequence_numbers_are_read() {
        let scratch = Scratch::new("kmsg-boot");
        let path = scratch.0.join("kmsg");
        std::fs::write(
            &path,
            "6,0,0,-;Linux version 6.1\n3,1,500,-;INFO: task docker:1 blocked for more than 120 seconds.\n",
        )
        .unwrap();
        let saved = Cursor {
            kmsg_sequence: Some(1000),
            ..Default::default()
        };
        let (tx, rx) = mpsc::channel(16);
        let mut rx = Lines::new(rx);
        let stop = StopFlag::default();
        let start = Resume::plan(Some(&saved), false).kmsg;
        spawn_kmsg(
            path.clone(),
            &[PathBuf::from("/")],
            start,
            tx,
            Default::default(),
            stop.clone(),
        )
        .unwrap();
        let first = next(&mut rx).await;
        assert_eq!(first.line, "Linux version 6.1");
        assert_eq!(first.cursor.kmsg_sequence, Some(0));
        assert_eq!(
            next(&mut rx).await.line,
            "INFO: task docker:1 blocked for more than 120 seconds."
        );
        stop.stop();
    }

    #[test]
    fn a_reader_gives_up_after_failing_reads_in_a_row() {
        let mut f = Failures {
            in_a_row: 0,
            pause: Duration::ZERO,
        };
        let e = std::io::Error::from_raw_os_error(libc::EIO);
        let p = Path::new("/dev/kmsg");
        for _ in 0..FAILED_READS - 1 {
            assert_eq!(f.failed("the kernel log", p, &e), None);
        }
        f.ok();
        for _ in 0..FAILED_READS - 1 {
            assert_eq!(f.failed("the kernel log", p, &e), None);
        }
        let why = f.failed("the kernel log", p, &e).unwrap();
        assert!(
            why.contains("/dev/kmsg") && why.contains("5 times in a row"),
            "{why}"
        );
    }

    #[tokio::test]
    async fn a_file_flood_waits_for_room_and_loses_nothing() {
        let scratch = Scratch::new("file-flood");
        let dir = &scratch.0;
        let path = dir.join("app.log");
        std::fs::write(&path, "").unwrap();
        let counters = Arc::new(SourceCounters::default());
        let stop = StopFlag::default();
        let mut rx = follow(&path, None, 4, counters.clone(), &stop);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut f = append(&path);
        for i in 0..10_000u64 {
            writeln!(f, "flood {i}").unwrap();
        }
        f.flush().unwrap();
        // Nobody drains for a while: the queue stays at its bound.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(rx.len() <= 4);
        for i in 0..10_000u64 {
            let item = next(&mut rx).await;
            assert_eq!(item.line, format!("flood {i}"));
        }
        assert_eq!(counters.dropped.load(Ordering::Relaxed), 0);
        assert_eq!(counters.lines.load(Ordering::Relaxed), 10_000);
        // The engine goes away: the reader thread ends instead of waiting.
        writeln!(f, "one more").unwrap();
        writeln!(f, "and another").unwrap();
        f.flush().unwrap();
        drop(rx);
        stop.stop();
    }

    /// Long lines meet an engine that does not drain (a slow rule, a taint
    /// request being retried): the queue holds at most QUEUE_BYTES of
    /// them, not its count of batches (8,192 batches of 60 KiB lines are 480 MiB),
    /// and every line comes whole once the engine drains again.
    #[tokio::test]
    async fn a_flood_of_long_lines_is_bounded_by_bytes_and_loses_nothing() {
        let scratch = Scratch::new("long-flood");
        let path = scratch.0.join("app.log");
        std::fs::write(&path, "").unwrap();
        let counters = Arc::new(SourceCounters::default());
        let stop = StopFlag::default();
        let mut rx = follow(&path, None, crate::monitor::QUEUE, counters.clone(), &stop);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let long = 60 * 1024;
        let lines = 400usize;
        {
            let mut f = std::io::BufWriter::new(append(&path));
            for i in 0..lines {
                writeln!(f, "{i:05} {}", "x".repeat(long)).unwrap();
            }
            f.flush().unwrap();
        }
        // Nobody drains: the reader stops at the byte bound.
        let mut last = usize::MAX;
        while rx.len() != last {
            last = rx.len();
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        let held = counters.queued.held();
        assert!(
            held <= QUEUE_BYTES + long + 128 && rx.len() <= QUEUE_BYTES / long + 1,
            "{} lines ({held} bytes) wait in the queue",
            rx.len()
        );
        assert!(
            held > QUEUE_BYTES - 2 * (long + 128),
            "the queue fills to its bound: {held} bytes"
        );
        for i in 0..lines {
            let item = next(&mut rx).await;
            assert_eq!(item.line.len(), long + 6);
            assert!(item.line.starts_with(&format!("{i:05} ")));
        }
        assert_eq!(counters.queued.held(), 0, "every line's bytes given back");
        assert_eq!(counters.dropped.load(Ordering::Relaxed), 0);
        drop(rx);
        stop.stop();
    }

    /// A line longer than MAX_LINE, written in pieces without its newline
    /// for a while (a writer stuck mid-line), is delivered as its first
    /// MAX_LINE bytes and counted; the line after it is whole, and the
    /// offset counts every byte read past.
    #[tokio::test]
    async fn a_giant_line_is_cut_at_max_line_and_its_neighbours_are_whole() {
        let scratch = Scratch::new("giant");
        let path = scratch.0.join("app.log");
        std::fs::write(&path, "").unwrap();
        let counters = Arc::new(SourceCounters::default());
        let stop = StopFlag::default();
        let mut rx = follow(&path, None, 16, counters.clone(), &stop);
        let mut f = append(&path);
        writeln!(f, "before").unwrap();
        assert_eq!(next(&mut rx).await.line, "before");
        let chunk = vec![b'x'; 1024 * 1024];
        write!(f, "PANIC ").unwrap();
        for _ in 0..8 {
            f.write_all(&chunk).unwrap();
            f.flush().unwrap();
            std::thread::sleep(Duration::from_millis(20));
        }
        writeln!(f, " END").unwrap();
        writeln!(f, "after").unwrap();
        let giant = next(&mut rx).await;
        assert_eq!(giant.line.len(), MAX_LINE);
        assert!(giant.line.starts_with("PANIC xxx"));
        assert_eq!(counters.truncated.load(Ordering::Relaxed), 1);
        let after = next(&mut rx).await;
        assert_eq!(after.line, "after");
        let total = ("before\n".len()
            + "PANIC ".len()
            + 8 * chunk.len()
            + " END\n".len()
            + "after\n".len()) as u64;
        assert_eq!(after.cursor.file.unwrap().1, total);
        stop.stop();
    }

    #[tokio::test]
    async fn file_follow_rotation_truncation_and_resume() {
        let scratch = Scratch::new("follow");
        let dir = &scratch.0;
        let path = dir.join("app.log");
        std::fs::write(&path, "old line before start\n").unwrap();
        let counters = Arc::new(SourceCounters::default());
        let stop = StopFlag::default();
        let mut rx = follow(&path, None, 16, counters.clone(), &stop);
        let mut f = append(&path);
        writeln!(f, "first").unwrap();
        write!(f, "half").unwrap();
        f.flush().unwrap();
        assert_eq!(
            next(&mut rx).await.line,
            "first",
            "old lines are not re-read"
        );
        writeln!(f, " and the rest").unwrap();
        assert_eq!(next(&mut rx).await.line, "half and the rest");
        // Rotation: rename and create anew.
        std::fs::rename(&path, dir.join("app.log.1")).unwrap();
        std::fs::write(&path, "after rotation\n").unwrap();
        let item = next(&mut rx).await;
        assert_eq!(item.line, "after rotation");
        let cursor = item.cursor.file.unwrap();
        // Truncation.
        std::fs::write(&path, "").unwrap();
        std::thread::sleep(Duration::from_millis(300));
        let mut f = append(&path);
        writeln!(f, "after truncation").unwrap();
        assert_eq!(next(&mut rx).await.line, "after truncation");
        stop.stop();
        // Resume from a cursor: only what follows it.
        let mut f = append(&path);
        writeln!(f, "while away").unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.ino(), cursor.0);
        let mut rx = follow(
            &path,
            Some((meta.ino(), "after truncation\n".len() as u64)),
            16,
            counters,
            &StopFlag::default(),
        );
        assert_eq!(next(&mut rx).await.line, "while away");
    }

    /// Review finding: a follower that reached the end while the queue was
    /// full waited to hand its batch over, then looked for a rotation: the
    /// lines appended to the old file meanwhile were never read. It reads
    /// the old file to its end again before it looks.
    #[tokio::test]
    async fn lines_appended_while_the_queue_is_full_are_read_before_a_rotation() {
        let scratch = Scratch::new("full-rotation");
        let dir = &scratch.0;
        let path = dir.join("app.log");
        std::fs::write(&path, "").unwrap();
        let counters = Arc::new(SourceCounters::default());
        let stop = StopFlag::default();
        // A queue of one batch nobody drains for now.
        let mut rx = follow(&path, None, 1, counters.clone(), &stop);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut f = append(&path);
        // One full batch (queued), and 44 lines the reader holds at the end
        // of the file, waiting for room.
        for i in 0..300 {
            writeln!(f, "early {i}").unwrap();
        }
        f.flush().unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        for i in 0..50 {
            writeln!(f, "late {i}").unwrap();
        }
        f.flush().unwrap();
        drop(f);
        std::fs::rename(&path, dir.join("app.log.1")).unwrap();
        std::fs::write(&path, "after rotation\n").unwrap();
        for i in 0..300 {
            assert_eq!(next(&mut rx).await.line, format!("early {i}"));
        }
        for i in 0..50 {
            assert_eq!(next(&mut rx).await.line, format!("late {i}"));
        }
        assert_eq!(next(&mut rx).await.line, "after rotation");
        stop.stop();
    }

    /// An idle follower sleeps until its file changes (it used to wake every
    /// 100 ms to look): a write, a rotation or the file appearing wakes it
    /// at once; nothing wakes it only for the safety recheck.
    #[test]
    fn an_idle_file_follower_sleeps_until_the_file_changes() {
        let scratch = Scratch::new("waiter");
        let path = scratch.0.join("app.log");
        std::fs::write(&path, "").unwrap();
        let mut waiter = ChangeWaiter::new(&path);
        assert!(waiter.inotify.is_some() && waiter.file_watch.is_some());
        // How long `wait` takes when `change` runs 100 ms into it.
        let timed = |waiter: &mut ChangeWaiter, change: Box<dyn FnOnce() + Send>| {
            let t = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(100));
                change();
            });
            let start = std::time::Instant::now();
            waiter.wait();
            t.join().unwrap();
            start.elapsed()
        };
        let prompt = RECHECK - Duration::from_millis(300);
        let slept = timed(&mut waiter, Box::new(|| {}));
        assert!(
            slept >= RECHECK - Duration::from_millis(50),
            "woke after {slept:?} with no change"
        );
        let p = path.clone();
        let woke = timed(
            &mut waiter,
            Box::new(move || writeln!(append(&p), "a line").unwrap()),
        );
        assert!(woke < prompt, "a write woke it after {woke:?}");
        let (p, rotated) = (path.clone(), scratch.0.join("app.log.1"));
        let woke = timed(
            &mut waiter,
            Box::new(move || {
                std::fs::rename(&p, rotated).unwrap();
                std::fs::write(&p, "").unwrap();
            }),
        );
        assert!(woke < prompt, "a rotation woke it after {woke:?}");
        // The follower reopens the new file and points the watch at it.
        waiter.watch_file(&path);
        waiter.wait(); // whatever the rotation left queued
        let p = path.clone();
        let woke = timed(
            &mut waiter,
            Box::new(move || writeln!(append(&p), "new file").unwrap()),
        );
        assert!(
            woke < prompt,
            "a write to the new file woke it after {woke:?}"
        );
    }

    #[test]
    fn without_inotify_a_follower_polls() {
        let scratch = Scratch::new("waiter-poll");
        let mut waiter = ChangeWaiter::new(&scratch.0.join("no-such-dir/app.log"));
        assert!(waiter.inotify.is_none());
        let start = std::time::Instant::now();
        waiter.wait();
        let slept = start.elapsed();
        assert!(slept >= POLL && slept < RECHECK, "polled after {slept:?}");
    }

    #[tokio::test]
    async fn a_file_that_appears_late_is_read_from_its_start() {
        let scratch = Scratch::new("late");
        let path = scratch.0.join("app.log");
        let stop = StopFlag::default();
        let mut rx = follow(&path, None, 16, Default::default(), &stop);
        tokio::time::sleep(Duration::from_millis(200)).await;
        std::fs::write(&path, "written before the follower looked\n").unwrap();
        writeln!(append(&path), "and after").unwrap();
        assert_eq!(
            next(&mut rx).await.line,
            "written before the follower looked"
        );
        assert_eq!(next(&mut rx).await.line, "and after");
        stop.stop();
    }

    #[test]
    fn journal_messages_as_text_or_bytes() {
        let e = serde_json::json!({"MESSAGE": "hello"});
        assert_eq!(journal_message(&e).as_deref(), Some("hello"));
        let e = serde_json::json!({"MESSAGE": [104, 105, 255]});
        assert_eq!(journal_message(&e).as_deref(), Some("hi\u{fffd}"));
        assert_eq!(journal_message(&serde_json::json!({"X": 1})), None);
    }

    #[test]
    fn a_journal_line_cut_short_keeps_its_cursor_and_message_up_to_the_cut() {
        let whole = r#"{"__CURSOR":"s=1;i=2","__REALTIME_TIMESTAMP":"1","MESSAGE":"app hung \"x\" \u00e9 tail","_BOOT_ID":"b"}"#;
        let cut = |n: usize| salvage_journal_line(&whole[..n]);
        let at = whole.find("tail").unwrap();
        assert_eq!(
            cut(at + 2),
            Some((Some("s=1;i=2".into()), Some("app hung \"x\" é ta".into())))
        );
        // Cut inside an escape: the partial escape is dropped.
        let esc = whole.find("\\u00e9").unwrap();
        for n in esc + 1..esc + 6 {
            assert_eq!(
                cut(n).unwrap().1.as_deref(),
                Some("app hung \"x\" "),
                "cut at {n}"
            );
        }
        // Bytes, cut inside the array.
        let bytes = r#"{"__CURSOR":"c","MESSAGE":[104,105,32,10"#;
        assert_eq!(
            salvage_journal_line(bytes),
            Some((Some("c".into()), Some("hi \n".into())))
        );
        // The cursor cut, or after the message: none is taken.
        let late = r#"{"MESSAGE":"app hung","__CURSOR":"s=1;i=2"}"#;
        for n in late.find("__CURSOR").unwrap()..late.len() - 2 {
            assert_eq!(
                salvage_journal_line(&late[..n]).unwrap().0,
                None,
                "cut at {n}"
            );
        }
        assert_eq!(
            salvage_journal_line(&late[..late.len() - 1])
                .unwrap()
                .0
                .as_deref(),
            Some("s=1;i=2")
        );
        // Cut before the message: nothing to match.
        assert_eq!(salvage_journal_line(r#"{"__CURSOR":"c","MESS"#), None);
    }

    #[tokio::test]
    async fn kmsg_stand_in_resume_and_floods_stay_bounded() {
        let scratch = Scratch::new("kmsg");
        let dir = &scratch.0;
        let path = dir.join("kmsg");
        std::fs::write(&path, "6,1,100,-;old\n6,2,200,-;seen\n 3,bad continuation\n6,3,300,-;new after restart\nnot a record\n").unwrap();
        let (tx, rx) = mpsc::channel(4);
        let mut rx = Lines::new(rx);
        let counters = Arc::new(SourceCounters::default());
        let stop = StopFlag::default();
        spawn_kmsg(
            path.clone(),
            &[PathBuf::from("/")],
            KmsgStart::After(2),
            tx,
            counters.clone(),
            stop.clone(),
        )
        .unwrap();
        let item = next(&mut rx).await;
        assert_eq!(item.line, "new after restart");
        assert_eq!(item.cursor.kmsg_sequence, Some(3));
        let read = |n: u64| {
            let counters = counters.clone();
            async move {
                let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
                while counters.lines.load(Ordering::Relaxed)
                    + counters.malformed.load(Ordering::Relaxed)
                    < n
                {
                    assert!(tokio::time::Instant::now() < deadline, "{counters:?}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        };
        // "new after restart" and "not a record".
        read(2).await;
        assert_eq!(counters.malformed.load(Ordering::Relaxed), 1);
        // A flood into a queue of 4 nobody drains: bounded, counted.
        let mut f = append(&path);
        // Sequence numbers go on from 3: a gap would count as records the
        // kernel overwrote.
        for i in 0..10_000u64 {
            writeln!(f, "4,{},{},-;flood {i}", 4 + i, i).unwrap();
        }
        f.flush().unwrap();
        // Until the reader has seen every flood record.
        read(2 + 10_000).await;
        // Nobody drained the queue of 4 batches: full, the rest dropped.
        assert_eq!(rx.len(), 4);
        assert!(counters.dropped.load(Ordering::Relaxed) >= 10_000 - 4 * BATCH_LINES as u64);
        // Every record is either queued or counted (the last, partial
        // batch is handed over when the reader reaches the end).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        let mut queued = 0;
        loop {
            while let Ok(batch) = rx.rx.try_recv() {
                queued += batch.len() as u64;
            }
            let dropped = counters.dropped.load(Ordering::Relaxed);
            if dropped + queued == 10_000 {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "dropped {dropped}, queued {queued}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        stop.stop();
    }
}
