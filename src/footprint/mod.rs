//! The agent's own memory: once it is ready, the executable's pages that
//! only the start touched stop counting in its RSS.
//!
//! Starting touches code spread over the whole executable (argument
//! parsing, TLS set-up, the first LISTs, the policy's compilation), and the
//! kernel maps 64 KiB of the file around each page faulted, so about 10 MiB
//! of a 14 MB binary stay mapped, of which the agent at rest touches under
//! 3 MiB (ARCHITECTURE, "Footprint"). [`release_when_ready`] waits until the
//! agent is ready and has settled, then drops the resident pages of the
//! executable's read-only segments with `madvise(MADV_DONTNEED)`
//! ([`core::read_only_ranges`], [`core::releasable`]): the file's pages stay
//! in the page cache, and
//! a page touched again (the next heartbeat, a shutdown's code) is mapped
//! back by a minor fault, with no read from disk while the page cache holds
//! it. Nothing else changes: no readahead setting, no eviction from the page
//! cache (`MADV_PAGEOUT` would make a rare path such as the graceful
//! shutdown read the disk again).

pub mod core;
pub mod settle;

use std::ops::Range;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::server::Health;
use core::{Segment, load_bias, read_only_ranges, releasable};

/// The least time from `/readyz` first passing to the release: the start's
/// last work (the first condition write, the first Events, the first probe
/// results) is done by then.
pub const DELAY: Duration = Duration::from_secs(60);

/// The least time before the release the agent must have been ready, with
/// no shutdown under way and its API calls going through (no request
/// without an answer, no 429 or 5xx, no failed write): see [`settle`].
pub const QUIET: Duration = Duration::from_secs(30);

/// The start of the line [`release_when_ready`] logs (info, target
/// `nodeguard::footprint`) once the pages are released: what the benches
/// and the tests wait for.
pub const RELEASED: &str = "released the executable's resident pages";

/// The lines it logs (warn) instead when the pages stay mapped, in whole or
/// in part.
pub const NOT_RELEASED: [&str; 3] = [
    "found none of the executable's pages to release",
    "not all of the executable's pages were released",
    "the executable's pages were not released",
];

/// How often [`release_when_ready`] looks at the agent, until it releases.
const LOOK_EVERY: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum FootprintError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: &'static str,
        source: std::io::Error,
    },
    #[error("the executable's program headers were not found")]
    NoHeaders,
    #[error(
        "where the executable is loaded is not clear (smaps: {}, the loader: {from_loader:#x})",
        from_smaps.map_or("none".to_string(), |b| format!("{b:#x}"))
    )]
    Where {
        from_smaps: Option<usize>,
        from_loader: usize,
    },
    #[error(
        "cannot release the executable's pages at {start:#x} ({len} bytes): {source}; {done} of {of} range(s) were released before"
    )]
    Advise {
        start: usize,
        len: usize,
        done: usize,
        of: usize,
        source: std::io::Error,
    },
}

/// What [`release_executable_pages`] dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Released {
    /// The address ranges released.
    pub ranges: Vec<Range<usize>>,
    /// The process's `RssFile` before and after, in KiB.
    pub rss_file_kib: (u64, u64),
}

/// Waits until the agent has been ready for [`DELAY`], the last [`QUIET`]
/// of it with no shutdown under way (`shutting_down`) and no new API
/// trouble (`troubles`: the count of requests without an answer, answered
/// 429 or 5xx, and failed writes so far), each stretched by one random part
/// of up to as much again per agent, so that agents started together, or
/// troubled by the same outage, do not all fault their code back in the
/// same second. Then releases the executable's pages once and logs what it
/// did. Ends then, or when `stop` is cancelled. A failure is logged and
/// changes nothing else: the pages not released stay mapped, as without
/// this.
pub async fn release_when_ready(
    health: Health,
    troubles: impl Fn() -> u64 + Send,
    shutting_down: watch::Receiver<bool>,
    stop: CancellationToken,
) {
    let stretch = 1.0 + fastrand::f64();
    let (delay, quiet) = (DELAY.mul_f64(stretch), QUIET.mul_f64(stretch));
    let mut settle = settle::Settle::new(delay, quiet);
    let mut held = false;
    loop {
        let look = settle::Look {
            at: tokio::time::Instant::now(),
            ready: health.report().ready,
            shutting_down: *shutting_down.borrow(),
            troubles: troubles(),
        };
        if settle.look(look) {
            break;
        }
        if !held
            && settle
                .first_ready()
                .is_some_and(|t| look.at.saturating_duration_since(t) >= delay)
        {
            held = true;
            tracing::debug!(
                quiet_s = quiet.as_secs(),
                "the start's pages stay mapped until the agent has been ready, with no \
                 shutdown under way and its API calls going through, for the quiet time"
            );
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(LOOK_EVERY) => {}
        }
    }
    match release_executable_pages() {
        Ok(r) if r.ranges.is_empty() => {
            tracing::warn!("{}: they stay mapped", NOT_RELEASED[0])
        }
        Ok(r) => tracing::info!(
            ranges = r.ranges.len(),
            rss_file_mib_before = (r.rss_file_kib.0 as f64 / 102.4).round() / 10.0,
            rss_file_mib_after = (r.rss_file_kib.1 as f64 / 102.4).round() / 10.0,
            "{RELEASED} (kept in the page cache; what runs again maps them back)"
        ),
        Err(e @ FootprintError::Advise { .. }) => {
            tracing::warn!(error = %e, "{}", NOT_RELEASED[1])
        }
        Err(e) => tracing::warn!(error = %e, "{}", NOT_RELEASED[2]),
    }
}

/// Drops this process's resident pages of its executable's read-only
/// segments, where they are clean.
pub fn release_executable_pages() -> Result<Released, FootprintError> {
    let (from_loader, segments) = program_headers().ok_or(FootprintError::NoHeaders)?;
    let smaps =
        std::fs::read_to_string("/proc/self/smaps").map_err(|source| FootprintError::Read {
            path: "/proc/self/smaps",
            source,
        })?;
    // An address in the executable's own code names its file and where it
    // is loaded.
    let code = release_executable_pages as fn() -> Result<Released, FootprintError> as usize;
    let from_smaps = load_bias(&smaps, code, &segments);
    // The loader's bias is 0 for a static PIE without PT_PHDR (musl); any
    // other answer must agree.
    let bias = match from_smaps {
        Some(b) if from_loader == 0 || from_loader == b => b,
        _ => {
            return Err(FootprintError::Where {
                from_smaps,
                from_loader,
            });
        }
    };
    // SAFETY: sysconf reads a constant.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
    let allowed = read_only_ranges(bias, &segments, page.max(1));
    let ranges = releasable(&smaps, code, &allowed);
    let before = rss_file_kib();
    for (done, r) in ranges.iter().enumerate() {
        // SAFETY: the range lies in one of the executable's read-only
        // PT_LOAD segments, outside its RELRO segment, in a mapping that
        // smaps showed private, read-only and with no written page
        // (resident or swapped): no Rust object lives there, and every page
        // dropped reads back from the file unchanged when touched again.
        // The loader maps those segments for the life of the process, and
        // nothing here calls mprotect on them.
        let rc = unsafe {
            libc::madvise(
                r.start as *mut libc::c_void,
                r.end - r.start,
                libc::MADV_DONTNEED,
            )
        };
        if rc != 0 {
            return Err(FootprintError::Advise {
                start: r.start,
                len: r.end - r.start,
                done,
                of: ranges.len(),
                source: std::io::Error::last_os_error(),
            });
        }
    }
    Ok(Released {
        ranges,
        rss_file_kib: (before, rss_file_kib()),
    })
}

/// `RssFile` of this process, in KiB (0 when unreadable: for the log only).
fn rss_file_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("RssFile:"))
                .and_then(|v| v.trim().strip_suffix("kB"))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(0)
}

/// The main program's load bias as the loader says it (0 for a static PIE
/// without PT_PHDR: musl) and its PT_LOAD and PT_GNU_RELRO headers
/// (`dl_iterate_phdr`: the first object is the program, static or
/// dynamic).
fn program_headers() -> Option<(usize, Vec<Segment>)> {
    struct Found(Option<(usize, Vec<Segment>)>);
    unsafe extern "C" fn first(
        info: *mut libc::dl_phdr_info,
        _size: libc::size_t,
        data: *mut libc::c_void,
    ) -> libc::c_int {
        // SAFETY: the loader passes a valid info for the call's duration,
        // whose dlpi_phdr points at dlpi_phnum headers; data is the
        // `Found` below.
        let (info, found) = unsafe { (&*info, &mut *(data as *mut Found)) };
        let headers = if info.dlpi_phdr.is_null() {
            &[][..]
        } else {
            unsafe { std::slice::from_raw_parts(info.dlpi_phdr, info.dlpi_phnum as usize) }
        };
        let segments = headers
            .iter()
            .filter_map(|h| match h.p_type {
                libc::PT_LOAD => Some(Segment::Load {
                    offset: h.p_offset as usize,
                    vaddr: h.p_vaddr as usize,
                    filesz: h.p_filesz as usize,
                    writable: h.p_flags & libc::PF_W != 0,
                }),
                libc::PT_GNU_RELRO => Some(Segment::Relro {
                    vaddr: h.p_vaddr as usize,
                    memsz: h.p_memsz as usize,
                }),
                _ => None,
            })
            .collect();
        found.0 = Some((info.dlpi_addr as usize, segments));
        1 // the first object only
    }
    let mut found = Found(None);
    // SAFETY: the callback only reads what the loader passes and writes
    // `found`, which outlives the call.
    unsafe { libc::dl_iterate_phdr(Some(first), (&mut found as *mut Found).cast()) };
    found.0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One release at a time in this process: another's release between a
    /// test's two RSS reads would hide its own.
    static RELEASING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

    /// No shutdown under way.
    fn running() -> watch::Receiver<bool> {
        watch::channel(false).1
    }

    /// API troubles every 10 s until 200 s after the start, the agent ready
    /// throughout: whatever the random part (delay 60-120 s, quiet 30-60
    /// s), the release waits for a quiet time after the last one (230-260
    /// s), then comes within a look.
    #[tokio::test(start_paused = true)]
    async fn the_release_waits_for_the_api_calls_to_go_through() {
        let _one = RELEASING.lock().await;
        let t0 = tokio::time::Instant::now();
        let troubles = move || t0.elapsed().as_secs().min(200) / 10;
        let release =
            release_when_ready(Health::new(), troubles, running(), CancellationToken::new());
        tokio::pin!(release);
        let early = tokio::time::timeout(Duration::from_secs(229), &mut release).await;
        assert!(
            early.is_err(),
            "released {:?} after the start",
            t0.elapsed()
        );
        tokio::time::timeout(Duration::from_secs(37), &mut release)
            .await
            .expect("released within a look of 60 s without trouble");
    }

    /// Ready from the start and no trouble: the release comes between 60
    /// and 120 s (the delay and its random part) and a look, and agents
    /// started together do not all release at the same look.
    #[tokio::test(start_paused = true)]
    async fn the_release_comes_after_the_delay_spread_over_its_random_part() {
        let _one = RELEASING.lock().await;
        let mut at = Vec::new();
        for _ in 0..8 {
            let t0 = tokio::time::Instant::now();
            release_when_ready(Health::new(), || 0, running(), CancellationToken::new()).await;
            let secs = t0.elapsed().as_secs();
            assert!((60..=125).contains(&secs), "released {secs} s after ready");
            at.push(secs);
        }
        at.sort_unstable();
        at.dedup();
        assert!(at.len() > 1, "all eight released {at:?} s after ready");
    }

    /// A shutdown under way from 30 s to 300 s after ready: no release
    /// meanwhile; once it is over, after the quiet time (30-60 s).
    #[tokio::test(start_paused = true)]
    async fn a_shutdown_under_way_holds_the_release() {
        let _one = RELEASING.lock().await;
        let (tx, rx) = watch::channel(false);
        let release = release_when_ready(Health::new(), || 0, rx, CancellationToken::new());
        tokio::pin!(release);
        assert!(
            tokio::time::timeout(Duration::from_secs(30), &mut release)
                .await
                .is_err()
        );
        tx.send_replace(true);
        assert!(
            tokio::time::timeout(Duration::from_secs(270), &mut release)
                .await
                .is_err(),
            "released during the shutdown"
        );
        tx.send_replace(false);
        assert!(
            tokio::time::timeout(Duration::from_secs(29), &mut release)
                .await
                .is_err(),
            "released less than the quiet time after the shutdown"
        );
        tokio::time::timeout(Duration::from_secs(37), &mut release)
            .await
            .expect("released a quiet time after the shutdown");
    }

    /// Never ready: no release; the agent's stop ends the wait.
    #[tokio::test(start_paused = true)]
    async fn never_ready_means_no_release_and_the_stop_ends_the_wait() {
        let _one = RELEASING.lock().await;
        let health = Health::new();
        let _never = health.register("never-synced", Duration::from_secs(3600));
        let stop = CancellationToken::new();
        let release = release_when_ready(health, || 0, running(), stop.clone());
        tokio::pin!(release);
        assert!(
            tokio::time::timeout(Duration::from_secs(600), &mut release)
                .await
                .is_err()
        );
        stop.cancel();
        tokio::time::timeout(Duration::from_secs(1), &mut release)
            .await
            .expect("ended at the stop");
    }

    /// On this test process, for real: its executable's pages go from its
    /// RSS, and it runs on (formatting goes through vtables in the RELRO
    /// segment, which must not be dropped; the code is read back).
    #[test]
    fn the_executables_pages_leave_the_rss_and_the_process_runs_on() {
        let _one = RELEASING.blocking_lock();
        let (_, segments) = program_headers().expect("the program's headers");
        assert!(
            segments.iter().any(|s| matches!(
                s,
                Segment::Load {
                    writable: false,
                    ..
                }
            )),
            "{segments:?}"
        );
        let released = release_executable_pages().unwrap();
        let (before, after) = released.rss_file_kib;
        assert!(!released.ranges.is_empty(), "{released:?}");
        assert!(
            after < before,
            "RssFile {before} kB before, {after} kB after, {released:?}"
        );
        let text = format!("{released:?} {}", std::hint::black_box(41) + 1);
        assert!(text.ends_with(" 42"), "{text}");
        // What ran since was mapped back, and can go again.
        release_executable_pages().unwrap();
    }
}
