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

mod file_follower;
mod journalctl;
mod kmsg_reader;
pub mod lines;
mod paths;
mod queue;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use file_follower::spawn_file;
pub use journalctl::spawn_journald;
pub use kmsg_reader::spawn_kmsg;
pub use lines::MAX_LINE;
pub use paths::{beneath, resolve_roots};
pub use queue::{Batch, QUEUE_BYTES, QueuedBytes};

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
    /// Notified when lines are lost or the refusal changes: the monitor's
    /// loop says so without looking every second.
    pub news: tokio::sync::Notify,
}

impl SourceCounters {
    fn give_up(&self, why: String) {
        *self.ended.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
    }

    fn set_refused(&self, why: Option<String>) {
        let mut refused = self.refused.lock().unwrap_or_else(|e| e.into_inner());
        if *refused != why {
            *refused = why;
            self.news.notify_one();
        }
    }

    /// `n` lines were lost before the monitor saw them.
    pub(super) fn lost(&self, n: u64) {
        self.dropped.fetch_add(n, Ordering::Relaxed);
        self.news.notify_one();
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

/// Stops the reader thread: at once where it waits (a pause in
/// [`StopFlag::sleep`], the kernel log reader's wait for a record), at its
/// next line elsewhere; a journalctl child is killed.
#[derive(Clone, Debug, Default)]
pub struct StopFlag(Arc<Stop>);

#[derive(Debug)]
struct Stop {
    stopped: AtomicBool,
    /// The running journalctl child's pid.
    child: std::sync::Mutex<Option<u32>>,
    /// Wakes a sleeper; notified under `child`'s lock.
    woken: std::sync::Condvar,
    /// An eventfd made readable by the stop, for a reader waiting in
    /// poll(2); None when none could be made (that reader then looks at the
    /// flag every [`kmsg_reader::POLL_STOP`]).
    wake: Option<std::os::fd::OwnedFd>,
}

impl Default for Stop {
    fn default() -> Self {
        use rustix::event::{EventfdFlags, eventfd};
        Stop {
            stopped: AtomicBool::new(false),
            child: Default::default(),
            woken: Default::default(),
            wake: eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK).ok(),
        }
    }
}

impl StopFlag {
    pub fn stop(&self) {
        self.0.stopped.store(true, Ordering::SeqCst);
        if let Some(fd) = &self.0.wake {
            // Only a full counter refuses, and then it is readable already.
            let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
        }
        let child = self.0.child.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(pid) = *child {
            // SAFETY: signalling our own child process.
            unsafe {
                libc::kill(pid as i32, libc::SIGTERM);
            }
        }
        // Under the lock: a sleeper checks the flag under it before it
        // waits, so it either sees the flag or gets this.
        self.0.woken.notify_all();
    }
    fn stopped(&self) -> bool {
        self.0.stopped.load(Ordering::SeqCst)
    }

    /// A guard that stops the reader when it is dropped.
    pub fn stop_on_drop(&self) -> StopOnDrop {
        StopOnDrop(self.clone())
    }

    /// Records the journalctl child a stop must kill (None once reaped).
    fn set_child(&self, pid: Option<u32>) {
        *self.0.child.lock().unwrap_or_else(|e| e.into_inner()) = pid;
    }

    /// The descriptor that becomes readable when stopped, if there is one.
    fn wake_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        self.0.wake.as_ref().map(|fd| fd.as_fd())
    }

    /// Sleeps `pause`, or less when stopped meanwhile (without waking in
    /// between: a reader backing off costs no wake-ups). True when stopped.
    fn sleep(&self, pause: Duration) -> bool {
        let until = std::time::Instant::now() + pause;
        let mut guard = self.0.child.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if self.stopped() {
                return true;
            }
            let left = until.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return false;
            }
            guard = self
                .0
                .woken
                .wait_timeout(guard, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// Stops its reader when dropped ([`StopFlag::stop_on_drop`]).
#[must_use = "the reader is stopped when this is dropped"]
pub struct StopOnDrop(StopFlag);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::file_follower::{ChangeWaiter, POLL, RECHECK};
    use super::journalctl::{Journalctl, spawn_journalctl};
    use super::lines::{journal_message, salvage_journal_line};
    use super::paths::{Expect, open_checked};
    use super::queue::BATCH_LINES;
    use super::*;
    use std::fs::File;
    use std::io::Write;
    use std::os::unix::fs::MetadataExt;
    use std::path::PathBuf;
    use tokio::sync::mpsc;

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

    /// Held by the tests that start kernel log readers, so one test can
    /// tell its reader's thread from the others'.
    static KMSG_READERS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

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

    /// A journalctl that exits at once, as on a journal with no entry of
    /// this boot: each run appends its start (ns) to `dir/runs` and its
    /// arguments to `dir/args`.
    fn exiting_journalctl(dir: &std::path::Path) -> PathBuf {
        let fake = dir.join("journalctl");
        std::fs::write(
            &fake,
            format!(
                "#!/bin/sh\ndate +%s%N >> {}\necho \"$@\" >> {}\necho 'No such boot ID in journal' >&2\nexit 1\n",
                dir.join("runs").display(),
                dir.join("args").display()
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        fake
    }

    /// The starts [`exiting_journalctl`] recorded in `dir`, in ns.
    fn run_starts(dir: &std::path::Path) -> Vec<u64> {
        std::fs::read_to_string(dir.join("runs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    /// Seen on a host whose journal has no data for the current boot:
    /// journalctl exits at once, and restarting it every second flooded the
    /// log and cost CPU. It now backs off (1 s, 2 s, 4 s, …; here from
    /// 50 ms): each pause is at least twice the one before.
    #[test]
    fn a_journalctl_that_keeps_exiting_is_restarted_with_backoff() {
        let scratch = Scratch::new("journal-backoff");
        let dir = &scratch.0;
        let fake = exiting_journalctl(dir);
        let (tx, _rx) = mpsc::channel(4);
        let stop = StopFlag::default();
        let min = Duration::from_millis(50);
        spawn_journalctl(
            Journalctl {
                program: fake,
                restart_min: min,
                no_entry_most: journalctl::NO_ENTRY_RETRY_MAX,
                no_entry_patience: journalctl::NO_ENTRY_PATIENCE,
                source: Default::default(),
                roots: vec![PathBuf::from("/")],
            },
            JournalStart::End,
            tx,
            Arc::new(SourceCounters::default()),
            stop.clone(),
        )
        .unwrap();
        let starts = || -> Vec<u64> { run_starts(dir) };
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

    /// A host whose journal never has an entry of this boot (none there, or
    /// only in /run/log/journal) had journalctl started every 5 s for ever:
    /// 0.6 % of a core for two journal monitors (`bench/run idle`). Past
    /// its patience (here 600 ms, pauses capped at 100 ms until then) the
    /// pauses grow again as for any failure (doubling, up to a minute).
    #[test]
    fn a_journal_without_entries_is_looked_for_less_often_after_a_while() {
        let scratch = Scratch::new("journal-patience");
        let dir = &scratch.0;
        let fake = exiting_journalctl(dir);
        let (tx, _rx) = mpsc::channel(4);
        let stop = StopFlag::default();
        let (most, patience) = (Duration::from_millis(100), Duration::from_millis(600));
        spawn_journalctl(
            Journalctl {
                program: fake,
                restart_min: Duration::from_millis(25),
                no_entry_most: most,
                no_entry_patience: patience,
                source: Default::default(),
                roots: vec![PathBuf::from("/")],
            },
            JournalStart::End,
            tx,
            Arc::new(SourceCounters::default()),
            stop.clone(),
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(3500));
        stop.stop();
        let t = run_starts(dir);
        let at = |i: usize| Duration::from_nanos(t[i] - t[0]);
        let gap = |i: usize| Duration::from_nanos(t[i + 1] - t[i]);
        // Within the patience, at most `most` apart (a run itself takes a
        // few milliseconds; a loaded machine adds more, hence the slack).
        let patient: Vec<usize> = (0..t.len() - 1)
            .filter(|&i| at(i + 1) + Duration::from_millis(150) < patience)
            .collect();
        assert!(patient.len() >= 3, "runs at {t:?}");
        for &i in &patient {
            assert!(
                gap(i) < most * 3,
                "gap {i} within the patience: {:?}",
                gap(i)
            );
        }
        // After it, doubling past `most` (the pause already set when it
        // ran out is the last at `most`): 100 ms, 200 ms, 400 ms, 800 ms…
        let later: Vec<Duration> = (0..t.len() - 1)
            .filter(|&i| at(i) > patience)
            .map(gap)
            .collect();
        assert!(
            later.len() >= 3 && later[later.len() - 1] > most * 6,
            "pauses after the patience: {later:?} (runs at {t:?})"
        );
        assert!(
            later.windows(2).all(|w| w[1] >= w[0] * 3 / 2),
            "pauses after the patience grow: {later:?}"
        );
    }

    /// Review of the patience: time the journal directory was refused (a
    /// link leading outside the read paths) counted as time without an
    /// entry, so once it was mended the first runs were already past their
    /// patience (pauses doubling towards a minute, and a warning saying
    /// the journal had no entry). Refusal now starts the patience afresh.
    #[test]
    fn a_refused_journal_directory_starts_the_patience_afresh() {
        let scratch = Scratch::new("journal-refused");
        let dir = &scratch.0;
        let allowed = dir.join("allowed");
        std::fs::create_dir_all(&allowed).unwrap();
        let link = allowed.join("journal");
        let fake = exiting_journalctl(dir);
        // Not there yet: journalctl runs (and finds nothing).
        std::os::unix::fs::symlink(allowed.join("not-yet"), &link).unwrap();
        let (tx, _rx) = mpsc::channel(4);
        let stop = StopFlag::default();
        let (most, patience) = (Duration::from_millis(100), Duration::from_millis(600));
        spawn_journalctl(
            Journalctl {
                program: fake,
                restart_min: Duration::from_millis(25),
                no_entry_most: most,
                no_entry_patience: patience,
                source: crate::policy::monitors::JournaldSource {
                    directory: Some(link.display().to_string()),
                    ..Default::default()
                },
                roots: vec![allowed.clone()],
            },
            JournalStart::End,
            tx,
            Arc::new(SourceCounters::default()),
            stop.clone(),
        )
        .unwrap();
        // Past the patience: pauses of 200, 400, 800 ms…
        std::thread::sleep(Duration::from_millis(1500));
        // Refused (outside the read paths), then mended.
        let swap = |to: &std::path::Path| {
            let tmp = allowed.join("swap");
            std::os::unix::fs::symlink(to, &tmp).unwrap();
            std::fs::rename(&tmp, &link).unwrap();
        };
        swap(dir);
        let refused_at = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64;
        // Longer than the pause under way (at most 1.6 s by now), so the
        // next look finds it refused, and pauses 5 s.
        std::thread::sleep(Duration::from_millis(2000));
        swap(&allowed.join("not-yet"));
        std::thread::sleep(Duration::from_millis(6000));
        stop.stop();
        let t = run_starts(dir);
        let after: Vec<Duration> = t
            .windows(2)
            .filter(|w| w[0] > refused_at)
            .map(|w| Duration::from_nanos(w[1] - w[0]))
            .collect();
        // Mended: a fresh patience, pauses capped at `most` again.
        assert!(
            after.len() >= 3 && after.iter().take(3).all(|g| *g < most * 3),
            "pauses once mended: {after:?} (runs at {t:?}, refused at {refused_at})"
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
        let _readers = KMSG_READERS.lock().await;
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
        let _readers = KMSG_READERS.lock().await;
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

    /// A reader backing off (journalctl restarting) sleeps through its
    /// pause without waking (it woke every 100 ms to look at the stop flag:
    /// 20 wake-ups a second for the default policy's two journal readers on
    /// a node without a journal, `bench/run idle`), and a stop still ends
    /// the pause at once.
    #[test]
    fn a_stop_flag_sleep_wakes_only_for_the_stop() {
        let stop = StopFlag::default();
        let switches = |tid: i32| -> u64 {
            std::fs::read_to_string(format!("/proc/self/task/{tid}/status"))
                .unwrap()
                .lines()
                .filter(|l| l.contains("ctxt_switches:"))
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .sum()
        };
        let (tx, rx) = std::sync::mpsc::channel();
        let sleeper = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                // SAFETY: gettid has no preconditions.
                tx.send(unsafe { libc::gettid() }).unwrap();
                let t = std::time::Instant::now();
                (stop.sleep(Duration::from_secs(60)), t.elapsed())
            })
        };
        let tid = rx.recv().unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let before = switches(tid);
        std::thread::sleep(Duration::from_millis(1000));
        let woke = switches(tid) - before;
        assert!(woke <= 1, "the sleeping thread woke {woke} times in 1 s");
        stop.stop();
        let (stopped, slept) = sleeper.join().unwrap();
        assert!(stopped, "a stop ends the sleep as stopped");
        assert!(
            slept < Duration::from_secs(5),
            "the stop ended a 60 s sleep after {slept:?}"
        );
        // Without a stop, the whole pause; after one, none.
        let calm = StopFlag::default();
        let t = std::time::Instant::now();
        assert!(!calm.sleep(Duration::from_millis(300)));
        assert!(t.elapsed() >= Duration::from_millis(300));
        let t = std::time::Instant::now();
        assert!(stop.sleep(Duration::from_secs(60)));
        assert!(t.elapsed() < Duration::from_secs(1));
    }

    /// The kernel log reader on the real /dev/kmsg, from its end: on a quiet
    /// kernel log its thread does not wake to look at its stop (it did,
    /// every second), and a stop ends it at once.
    #[test]
    fn a_quiet_kernel_log_costs_its_reader_no_wake_ups_and_a_stop_ends_it_at_once() {
        let _readers = KMSG_READERS.blocking_lock();
        let kmsg_threads = || -> std::collections::BTreeSet<i32> {
            std::fs::read_dir("/proc/self/task")
                .unwrap()
                .filter_map(|t| {
                    let t = t.ok()?;
                    let comm = std::fs::read_to_string(t.path().join("comm")).ok()?;
                    (comm.trim() == "nodeguard-kmsg")
                        .then(|| t.file_name().to_str()?.parse().ok())?
                })
                .collect()
        };
        let switches = |tid: i32| -> Option<u64> {
            let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).ok()?;
            Some(
                status
                    .lines()
                    .filter(|l| l.contains("ctxt_switches:"))
                    .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                    .sum(),
            )
        };
        // Readers of earlier tests end within their 100 ms pause.
        let t = std::time::Instant::now();
        while !kmsg_threads().is_empty() && t.elapsed() < Duration::from_secs(3) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let others = kmsg_threads();
        let (tx, mut rx) = mpsc::channel(1024);
        let stop = StopFlag::default();
        spawn_kmsg(
            PathBuf::from("/dev/kmsg"),
            &[PathBuf::from("/dev")],
            KmsgStart::End,
            tx,
            Default::default(),
            stop.clone(),
        )
        .expect("the test reads /dev/kmsg");
        // The thread names itself once it runs.
        let t = std::time::Instant::now();
        let mut ours: Vec<i32> = Vec::new();
        while ours.is_empty() && t.elapsed() < Duration::from_secs(3) {
            std::thread::sleep(Duration::from_millis(10));
            ours = kmsg_threads().difference(&others).copied().collect();
        }
        assert_eq!(ours.len(), 1, "one new reader thread: {ours:?}");
        let tid = ours[0];
        std::thread::sleep(Duration::from_millis(200));
        while rx.try_recv().is_ok() {}
        let before = switches(tid).unwrap();
        std::thread::sleep(Duration::from_secs(3));
        let woke = switches(tid).unwrap() - before;
        // Each batch of records the kernel prints meanwhile wakes it.
        let mut batches = 0;
        while rx.try_recv().is_ok() {
            batches += 1;
        }
        assert!(
            woke <= batches + 1,
            "the reader woke {woke} times in 3 s for {batches} batch(es) of records"
        );
        let t = std::time::Instant::now();
        stop.stop();
        while switches(tid).is_some() && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(5));
        }
        let ended = t.elapsed();
        assert!(
            ended < Duration::from_millis(500),
            "the reader ended {ended:?} after the stop"
        );
    }
}
