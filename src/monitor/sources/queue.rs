//! The bounded queue between a reader thread and its monitor: lines handed
//! over in batches, and the bytes they hold counted against
//! [`QUEUE_BYTES`].

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::mpsc;

use super::lines::text;
use super::{Cursor, SourceCounters};

/// Lines for the engine, read together: their text back to back and the
/// cursor after each. A flood costs one allocation and one hand-over (one
/// wake-up of the engine) per batch, not per line; a reader sends what it
/// has as soon as its source has nothing more at once, so a quiet log's
/// line goes alone and at once.
#[derive(Debug)]
pub struct Batch {
    pub(super) text: String,
    /// Where each line ends in `text`.
    pub(super) ends: Vec<usize>,
    pub(super) cursors: Vec<Cursor>,
    /// The batch's share of the queue's bytes, given back when it is
    /// dropped (the engine is done with it).
    pub(super) _held: Held,
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
pub(super) const BATCH_LINES: usize = 256;
pub(super) const BATCH_BYTES: usize = 64 * 1024;

/// A reader's batch being filled.
#[derive(Debug, Default)]
pub(super) struct Batcher {
    pub(super) text: String,
    pub(super) ends: Vec<usize>,
    pub(super) cursors: Vec<Cursor>,
    /// What the lines count against the queue's bytes.
    pub(super) bytes: usize,
}

impl Batcher {
    pub(super) fn push(&mut self, counters: &SourceCounters, line: &str, cursor: Cursor) {
        counters.lines.fetch_add(1, Ordering::Relaxed);
        self.bytes += item_bytes(line, &cursor);
        self.text.push_str(line);
        self.ends.push(self.text.len());
        self.cursors.push(cursor);
    }

    /// A line as read: a newline at its end dropped, bytes that are not
    /// UTF-8 replaced.
    pub(super) fn push_bytes(&mut self, counters: &SourceCounters, bytes: &[u8], cursor: Cursor) {
        self.push(counters, &text(bytes), cursor);
    }

    pub(super) fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    pub(super) fn full(&self) -> bool {
        self.ends.len() >= BATCH_LINES || self.bytes >= BATCH_BYTES
    }

    pub(super) fn take(&mut self, counters: &Arc<SourceCounters>) -> Batch {
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
    pub(super) bytes: std::sync::Mutex<usize>,
    pub(super) room: std::sync::Condvar,
}

impl QueuedBytes {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, usize> {
        self.bytes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes `n` bytes when they fit now.
    pub(super) fn try_take(&self, n: usize) -> bool {
        let mut b = self.lock();
        if *b > 0 && *b + n > QUEUE_BYTES {
            return false;
        }
        *b += n;
        true
    }

    /// Takes `n` bytes, waiting for room; false once `gone` says the
    /// engine is gone.
    pub(super) fn take(&self, n: usize, gone: impl Fn() -> bool) -> bool {
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

    pub(super) fn give_back(&self, n: usize) {
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
pub(super) struct Held(Arc<SourceCounters>, usize);

impl Drop for Held {
    fn drop(&mut self) {
        self.0.queued.give_back(self.1);
    }
}

/// What a line counts against the queue's bytes: its text and cursor, and
/// a little for its place in the batch.
pub(super) fn item_bytes(line: &str, cursor: &Cursor) -> usize {
    line.len() + cursor.journal.as_ref().map_or(0, String::len) + 64
}

/// Hands the batch over, waiting for room (files, the journal). False once
/// the engine is gone.
pub(super) fn deliver(
    tx: &mpsc::Sender<Batch>,
    counters: &Arc<SourceCounters>,
    batch: &mut Batcher,
) -> bool {
    if batch.is_empty() {
        return !tx.is_closed();
    }
    if !counters.queued.take(batch.bytes, || tx.is_closed()) {
        return false;
    }
    tx.blocking_send(batch.take(counters)).is_ok()
}

/// Hands kmsg records over, or counts them dropped when the queue is full.
pub(super) fn offer(
    tx: &mpsc::Sender<Batch>,
    counters: &Arc<SourceCounters>,
    batch: &mut Batcher,
) -> bool {
    if batch.is_empty() {
        return !tx.is_closed();
    }
    let n = batch.ends.len() as u64;
    if !counters.queued.try_take(batch.bytes) {
        counters.lost(n);
        *batch = Batcher::default();
        return !tx.is_closed();
    }
    match tx.try_send(batch.take(counters)) {
        Ok(()) => true,
        Err(mpsc::error::TrySendError::Full(_)) => {
            counters.lost(n);
            true
        }
        Err(mpsc::error::TrySendError::Closed(_)) => false,
    }
}
