//! The journal reader: a supervised `journalctl --follow --output=json`,
//! restarted with a backoff, resumed by cursor.

use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::mpsc;

use super::lines::{MAX_JOURNAL_LINE, journal_message, read_line_capped_to, salvage_journal_line};
use super::paths::beneath;
use super::queue::{Batch, Batcher, deliver};
use super::{Cursor, JournalStart, SourceCounters, StopFlag};

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
            no_entry_most: NO_ENTRY_RETRY_MAX,
            no_entry_patience: NO_ENTRY_PATIENCE,
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
pub(super) const JOURNAL_RESTART_MIN: Duration = Duration::from_secs(1);
/// A journalctl run shorter than this that read nothing failed at start.
pub(super) const RUN_FAILED_AT_ONCE: Duration = Duration::from_secs(2);
/// A journalctl run at least this long was following the journal, even if
/// nothing it printed matched: its exit starts the back-off afresh.
pub(super) const RUN_HEALTHY: Duration = Duration::from_secs(30);
pub(super) const JOURNAL_RESTART_MAX: Duration = Duration::from_secs(60);
/// The longest pause while the journal has no entry of this boot yet.
pub(super) const NO_ENTRY_RETRY_MAX: Duration = Duration::from_secs(5);
/// How long the journal may hold no entry of this boot before it is looked
/// for with the usual back-off (up to once a minute) instead of every 5 s.
/// A node's journald writes entries of its boot from its first seconds, so
/// a minute without one is a host whose journal is not there (one kept
/// only in /run/log/journal, `Storage=volatile`, is not under
/// /var/log/journal), and starting journalctl every 5 s there cost two
/// journal monitors 0.6 % of a core (`bench/run idle`, an empty journal).
pub(super) const NO_ENTRY_PATIENCE: Duration = Duration::from_secs(60);

/// Kills and reaps a journalctl child, forgetting its pid first (under the
/// lock [`StopFlag::stop`] signals it with): once reaped the pid may be
/// another process's, and a stop must not signal that one.
pub(super) fn end_journalctl(stop: &StopFlag, child: &mut std::process::Child) {
    let _ = child.kill();
    stop.set_child(None);
    let _ = child.wait();
}

/// This boot's id as journalctl's `--boot` takes it (32 hex digits), from
/// the kernel; `None` when it cannot be read (then `--boot` is left out).
pub(super) fn journal_boot_id() -> Option<String> {
    let raw = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let id: String = raw.trim().chars().filter(|c| *c != '-').collect();
    (id.len() == 32 && id.chars().all(|c| c.is_ascii_hexdigit())).then_some(id)
}

/// What the journal reader runs, and what it may read.
pub(super) struct Journalctl {
    pub(super) program: PathBuf,
    pub(super) restart_min: Duration,
    /// The longest pause while there is no entry of this boot yet, for
    /// `no_entry_patience`: [`NO_ENTRY_RETRY_MAX`], [`NO_ENTRY_PATIENCE`].
    pub(super) no_entry_most: Duration,
    pub(super) no_entry_patience: Duration,
    pub(super) source: crate::policy::monitors::JournaldSource,
    /// The node's resolved read roots (`--directory` must lie under one).
    pub(super) roots: Vec<PathBuf>,
}

pub(super) fn spawn_journalctl(
    Journalctl {
        program,
        restart_min,
        no_entry_most,
        no_entry_patience,
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
            // Since when the runs have found no entry of this boot.
            let mut no_entry_since: Option<std::time::Instant> = None;
            let mut said_no_entry = false;
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
                            // Refused is not "no entry": the patience
                            // starts when journalctl runs again.
                            no_entry_since = None;
                            said_no_entry = false;
                            stop.sleep(Duration::from_secs(5));
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
                // Nothing of the agent's but its pipes: journalctl runs for
                // hours, and a descriptor it kept (logind's delay lock, in
                // the moment zbus holds it without close-on-exec) would
                // be held as long.
                // SAFETY: runs in the forked child before exec; system
                // calls only.
                unsafe {
                    std::os::unix::process::CommandExt::pre_exec(
                        &mut cmd,
                        crate::command::marking_for_exec(),
                    );
                }
                let mut child = match cmd.spawn() {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::error!(error = %e, "cannot run journalctl; retrying in 5 s");
                        no_entry_since = None;
                        said_no_entry = false;
                        stop.sleep(Duration::from_secs(5));
                        continue;
                    }
                };
                stop.set_child(Some(child.id()));
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
                let healthy = delivered || run_started.elapsed() >= RUN_HEALTHY;
                if healthy {
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
                // Since when no run found an entry of this boot: kept
                // through a run that failed slowly (neither at once nor
                // after following), ended by one that found the journal.
                if no_entry_yet {
                    whole_boot = true;
                    no_entry_since.get_or_insert_with(std::time::Instant::now);
                } else if healthy || cursor.is_some() {
                    no_entry_since = None;
                    said_no_entry = false;
                }
                let waited = no_entry_since.map(|t| t.elapsed());
                let patient = waited.is_none_or(|w| w < no_entry_patience);
                let err = err.trim().to_string();
                if no_entry_yet && !patient && !said_no_entry {
                    said_no_entry = true;
                    let journal = match source.directory.as_deref() {
                        Some(d) => d.to_string(),
                        None => "the journal (/var/log/journal and /run/log/journal)".into(),
                    };
                    let volatile = if source.directory.as_deref() == Some("/var/log/journal") {
                        " A journal kept only in /run/log/journal (Storage=volatile) is not under /var/log/journal."
                    } else {
                        ""
                    };
                    tracing::warn!(
                        stderr = %err,
                        "{journal} has had no entry of this boot for {} s: looked for up to once a minute from now on.{volatile}",
                        waited.unwrap_or_default().as_secs()
                    );
                }
                // Waiting for this boot's first entry (journalctl exits at
                // once until there is one): looked for every 5 s for the
                // patience, not once a minute, so a new boot's first
                // problems are not late; the wait is twice the last, up to
                // that.
                let most = if no_entry_yet && patient {
                    no_entry_most
                } else {
                    JOURNAL_RESTART_MAX
                };
                let delay = backoff.next_within(most);
                // Said once per distinct error, not once per restart.
                if last_err.as_deref() != Some(err.as_str()) {
                    tracing::warn!(stderr = %err, retry_in = ?delay, "journalctl exited; restarting it (backing off up to 60 s while it keeps failing)");
                } else {
                    tracing::debug!(stderr = %err, retry_in = ?delay, "journalctl exited again");
                }
                last_err = Some(err);
                if stop.sleep(delay) {
                    break;
                }
            }
        })?;
    Ok(())
}
