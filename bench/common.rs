//! What the benchmarks against the real control plane share: settings from
//! the environment, /proc readings, loopback HTTP, the shipped binary.

#![allow(dead_code)] // each bench uses its own part

use std::path::PathBuf;
use std::time::Duration;

use nodeguard::server::metrics::{ProcStat, parse_proc_stat};

pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

pub fn proc_stat(pid: u32) -> Option<ProcStat> {
    parse_proc_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// `pid` and its descendants (nodeguard's journald monitors run
/// `journalctl` children; their cost is the agent's cost), from one pass
/// over /proc for the parent links.
pub fn tree(pid: u32) -> Vec<u32> {
    trees(&[pid]).remove(0)
}

/// [`tree`] of each of `pids`, from one pass over /proc.
pub fn trees(pids: &[u32]) -> Vec<Vec<u32>> {
    let links: Vec<(u32, u64)> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let p = e.file_name().to_str()?.parse().ok()?;
            Some((p, proc_stat(p)?.ppid))
        })
        .collect();
    descendants(&links, pids)
}

/// Each of `pids` with its descendants, from (pid, parent pid) `links`.
pub fn descendants(links: &[(u32, u64)], pids: &[u32]) -> Vec<Vec<u32>> {
    pids.iter()
        .map(|&pid| {
            let mut out = vec![pid];
            let mut i = 0;
            while i < out.len() {
                let parent = u64::from(out[i]);
                out.extend(links.iter().filter(|l| l.1 == parent).map(|l| l.0));
                i += 1;
            }
            out
        })
        .collect()
}

/// Utime + stime of `pid` and its descendants, in seconds.
pub fn tree_cpu_seconds(pid: u32) -> f64 {
    tree(pid).into_iter().map(cpu_seconds).sum()
}

/// `VmRSS` of `pid` and its descendants, in MiB.
pub fn tree_rss_mib(pid: u32) -> f64 {
    tree(pid).into_iter().map(|p| status_mib(p, "VmRSS:")).sum()
}

/// Utime + stime of `pid`, in seconds (0 once it is gone).
pub fn cpu_seconds(pid: u32) -> f64 {
    proc_stat(pid).map_or(0.0, |s| {
        // SAFETY: sysconf reads a constant.
        (s.utime_ticks + s.stime_ticks) as f64 / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64
    })
}

/// One process's CPU at one moment, in seconds.
#[derive(Clone, Debug)]
pub struct ProcCpu {
    pub command: String,
    pub ppid: u32,
    /// Its start, in clock ticks since boot: tells a reused pid apart.
    pub start: u64,
    /// Its own utime + stime.
    pub own: f64,
    /// Its reaped children's (cutime + cstime): a child that exited and was
    /// waited for counts here.
    pub reaped: f64,
}

/// Every process on the host, by pid, from one pass over /proc.
pub fn host_processes() -> std::collections::BTreeMap<u32, ProcCpu> {
    // SAFETY: sysconf reads a constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let command = text[text.find('(')? + 1..text.rfind(')')?].to_string();
            let f: Vec<&str> = text[text.rfind(')')? + 1..].split_whitespace().collect();
            // f[0] is field 3 (state); field N is f[N - 3].
            let num = |n: usize| f.get(n - 3).and_then(|v| v.parse::<u64>().ok());
            Some((
                pid,
                ProcCpu {
                    command,
                    ppid: num(4)? as u32,
                    start: num(22)?,
                    own: (num(14)? + num(15)?) as f64 / hz,
                    reaped: (num(16)? + num(17)?) as f64 / hz,
                },
            ))
        })
        .collect()
}

/// The CPU (seconds) `pids` used between two [`host_processes`], their
/// reaped children's included: a process new since `before` counts whole.
pub fn cpu_between(
    before: &std::collections::BTreeMap<u32, ProcCpu>,
    after: &std::collections::BTreeMap<u32, ProcCpu>,
    pids: impl IntoIterator<Item = u32>,
) -> f64 {
    pids.into_iter()
        .filter_map(|pid| {
            let a = after.get(&pid)?;
            let (own, reaped) = match before.get(&pid) {
                Some(b) if b.start == a.start => (b.own, b.reaped),
                _ => (0.0, 0.0),
            };
            Some(a.own - own + a.reaped - reaped)
        })
        .sum()
}

/// [`cpu_between`] of every process alive at `after`, by command name.
pub fn cpu_by_command(
    before: &std::collections::BTreeMap<u32, ProcCpu>,
    after: &std::collections::BTreeMap<u32, ProcCpu>,
) -> Vec<(String, f64)> {
    let mut by: std::collections::BTreeMap<&str, f64> = Default::default();
    for (&pid, p) in after {
        *by.entry(p.command.as_str()).or_default() += cpu_between(before, after, [pid]);
    }
    let mut v: Vec<(String, f64)> = by.into_iter().map(|(c, s)| (c.to_string(), s)).collect();
    v.sort_by(|a, b| b.1.total_cmp(&a.1));
    v
}

/// A `VmRSS`/`VmHWM` line of /proc/PID/status, in MiB.
pub fn status_mib(pid: u32, key: &str) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    kb / 1024.0
}

/// A process's memory from /proc/PID/smaps_rollup, in MiB (0 once the
/// process is gone). RSS counts the pages a process shares with every other
/// copy of the same binary and libraries in full: what one more process
/// costs is its private pages, and what a set of processes costs together
/// is the sum of their `Pss`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Rollup {
    pub private: f64,
    pub pss: f64,
}

pub fn rollup(pid: u32) -> Rollup {
    let text = match std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")) {
        Ok(r) => r,
        // Gone since it was listed (a zombie reads as empty).
        Err(e)
            if e.kind() == std::io::ErrorKind::NotFound
                || e.raw_os_error() == Some(libc::ESRCH) =>
        {
            return Rollup::default();
        }
        Err(e) => panic!("/proc/{pid}/smaps_rollup: {e} (the bench needs to own the process)"),
    };
    let mut r = Rollup::default();
    for line in text.lines() {
        let Some((key, rest)) = line.split_once(char::is_whitespace) else {
            continue;
        };
        let Some(kb) = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        else {
            continue;
        };
        match key {
            "Private_Clean:" | "Private_Dirty:" => r.private += kb / 1024.0,
            "Pss:" => r.pss += kb / 1024.0,
            _ => {}
        }
    }
    r
}

/// Forgets which of `pid`'s pages were touched (`/proc/PID/clear_refs`),
/// so that [`executable_pages_mib`] then counts those touched since.
pub fn clear_touched(pid: u32) {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "1").unwrap_or_else(|e| {
        panic!("/proc/{pid}/clear_refs: {e} (the bench needs to own the process)")
    });
}

/// Of `pid`'s mappings of its own executable (the file `/proc/PID/exe`
/// names, matched by inode: its path may carry " (deleted)" or a space):
/// the file's pages resident, and of them those touched since
/// [`clear_touched`], in MiB: smaps `Rss` and `Referenced`, each less the
/// mapping's `Anonymous` (a static-pie binary's relocated data is copied on
/// write: anonymous, counted with the heap; of a mapping with such pages,
/// the touched ones are taken to be those first). The kernel maps a file's
/// pages around each one faulted (64 KiB by default), so resident counts
/// pages never run. Touched is an upper bound of what ran: on x86 the pages
/// mapped around a fault within the window count as touched too.
pub fn executable_pages_mib(pid: u32) -> (f64, f64) {
    use std::os::unix::fs::MetadataExt;
    let inode = std::fs::metadata(format!("/proc/{pid}/exe"))
        .unwrap_or_else(|e| panic!("/proc/{pid}/exe: {e}"))
        .ino()
        .to_string();
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap_or_default();
    // Per mapping of the executable: Rss, Referenced, Anonymous (KiB).
    let mut mappings: Vec<[f64; 3]> = Vec::new();
    let mut ours = false;
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        match words.next() {
            // A mapping's header: "start-end perms offset dev inode [path]".
            Some(w) if w.contains('-') && !w.ends_with(':') => {
                ours = words.nth(3) == Some(inode.as_str());
                if ours {
                    mappings.push([0.0; 3]);
                }
            }
            Some(key) if ours => {
                let slot = match key {
                    "Rss:" => 0,
                    "Referenced:" => 1,
                    "Anonymous:" => 2,
                    _ => continue,
                };
                let m = mappings.last_mut().expect("a header came first");
                m[slot] = words.next().and_then(|v| v.parse().ok()).unwrap_or(0.0);
            }
            _ => {}
        }
    }
    let rss: f64 = mappings.iter().map(|[r, _, a]| r - a).sum();
    let touched: f64 = mappings.iter().map(|[_, t, a]| (t - a).max(0.0)).sum();
    assert!(
        mappings.iter().any(|m| m[0] > 0.0),
        "no resident page of {pid}'s executable (inode {inode}) in its smaps"
    );
    (rss / 1024.0, touched / 1024.0)
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A plain HTTP/1.0 GET on loopback: (status, body), None while nothing
/// listens yet.
pub async fn try_get(port: u16, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let io = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        s.write_all(format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").as_bytes())
            .await?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await?;
        std::io::Result::Ok(String::from_utf8_lossy(&buf).into_owned())
    };
    let text = tokio::time::timeout(Duration::from_secs(5), io)
        .await
        .ok()?
        .ok()?;
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
    Some((status, body))
}

pub async fn scrape(port: u16, path: &str) -> String {
    match try_get(port, path).await {
        Some((200, body)) => body,
        _ => String::new(),
    }
}

/// What the benches' agents log: warnings, and what they did with their
/// start's pages ([`wait_for_page_release`] reads it).
pub const AGENT_LOG: &str = "warn,nodeguard::footprint=info";

/// Whether the agents this bench starts release their start's pages: not
/// when `NODEGUARD_KEEP_EXECUTABLE_PAGES` (which they inherit) is on, read
/// as the agent reads it (clap's `FalseyValueParser`: unset, empty, `n`,
/// `no`, `f`, `false`, `off` and `0` in any case are off).
pub fn agents_release_pages() -> bool {
    match std::env::var("NODEGUARD_KEEP_EXECUTABLE_PAGES") {
        Err(_) => true,
        Ok(v) => {
            let v = v.to_ascii_lowercase();
            v.is_empty() || ["n", "no", "f", "false", "off", "0"].contains(&v.as_str())
        }
    }
}

/// Whether a nodeguard's log text says it released its start's pages;
/// panics on a line saying they were not.
pub fn says_released(log: &str, what: &std::path::Path) -> bool {
    for line in log.lines() {
        if line.contains(nodeguard::footprint::RELEASED) {
            return true;
        }
        assert!(
            !nodeguard::footprint::NOT_RELEASED
                .iter()
                .any(|l| line.contains(l)),
            "{}: {line}",
            what.display()
        );
    }
    false
}

/// Waits, up to `within`, for every nodeguard whose log is one of `logs` to
/// say it released its executable's pages (`footprint`: 60-120 s after it
/// is first ready, once its API calls have gone through for 30-60 s), so an
/// idle or steady window measures what ships, and returns how long it
/// waited. Reads the logs not yet done every `every`. Returns at once when the agents keep them
/// ([`agents_release_pages`]). Panics when a line does not come (a
/// `NODEGUARD_BENCH_BINARY` from before the release: run it with
/// `NODEGUARD_KEEP_EXECUTABLE_PAGES=1`), or a line says the pages were not
/// released.
pub async fn wait_for_page_release(
    logs: &[&std::path::Path],
    within: Duration,
    every: Duration,
) -> Duration {
    let start = tokio::time::Instant::now();
    if !agents_release_pages() {
        return Duration::ZERO;
    }
    let mut left: Vec<&std::path::Path> = logs.to_vec();
    loop {
        left.retain(|log| !says_released(&std::fs::read_to_string(log).unwrap_or_default(), log));
        let Some(first) = left.first() else {
            return start.elapsed();
        };
        assert!(
            start.elapsed() < within,
            "{} of {} agent(s) had not said they released the executable's pages {} s on \
             (the first: {})",
            left.len(),
            logs.len(),
            within.as_secs(),
            first.display()
        );
        tokio::time::sleep(every).await;
    }
}

/// The binary the image ships (see the header); fails, never falls back
/// to another build.
pub fn shipped_binary(repo: &std::path::Path) -> PathBuf {
    let path = std::env::var_os("NODEGUARD_BENCH_BINARY")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo.join("target/x86_64-unknown-linux-musl/release/nodeguard"));
    assert!(
        path.is_file(),
        "{} is missing: build the shipped binary with e2e/image (bench/run does)",
        path.display()
    );
    path
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// A syslog `kern.log` line, as rsyslog writes the kernel's records.
pub fn kern_line(host: &str, uptime: f64, msg: &str) -> String {
    let ts = jiff::Zoned::now()
        .with_time_zone(jiff::tz::TimeZone::UTC)
        .strftime("%b %e %H:%M:%S")
        .to_string();
    format!("{ts} {host} kernel: [{uptime:>12.6}] {msg}\n")
}

/// `n` kernel log lines (syslog `kern.log`), one in 200 an OOM kill (a
/// temporary problem NPD's kernel-monitor-filelog.json and its import
/// count); the rest the noise a busy node logs.
pub fn flood(host: &str, n: u64, start_uptime: f64) -> (String, u64) {
    let noise = [
        "IPv6: ADDRCONF(NETDEV_CHANGE): veth{}: link becomes ready",
        "cni0: port {}(veth3f2a9c1e) entered forwarding state",
        "EXT4-fs (nvme0n1p1): mounted filesystem with ordered data mode. Quota mode: none.",
        "audit: type=1400 audit({}.123:456): apparmor=\"STATUS\" operation=\"profile_replace\" name=\"cri-containerd.apparmor.d\"",
        "TCP: request_sock_TCP: Possible SYN flooding on port {}. Sending cookies.  Check SNMP counters.",
        "overlayfs: upperdir is in-use as upperdir/workdir of another mount, accessing files from both mounts will result in undefined behavior.",
        "device veth{} entered promiscuous mode",
        "xt_CT: netfilter: NOTRACK target is deprecated, use CT instead or upgrade iptables",
    ];
    let mut out = String::with_capacity(n as usize * 120);
    let mut problems = 0;
    for i in 0..n {
        let up = start_uptime + i as f64 * 0.0001;
        let msg = if i % 200 == 199 {
            problems += 1;
            format!(
                "Out of memory: Killed process {} (java) total-vm:{}kB, anon-rss:{}kB, file-rss:0kB, shmem-rss:0kB, UID:1000 pgtables:2048kB oom_score_adj:999",
                10_000 + i,
                4_000_000 + i,
                2_000_000 + i
            )
        } else {
            noise[(i % noise.len() as u64) as usize].replace("{}", &(i % 997).to_string())
        };
        out.push_str(&kern_line(host, up, &msg));
    }
    (out, problems)
}

/// Answers the default policy's kubelet and kube-proxy healthz probes the
/// way a healthy node does.
pub async fn serve_node_health() {
    for port in [10248u16, 10256] {
        match tokio::net::TcpListener::bind(("127.0.0.1", port)).await {
            Ok(l) => {
                tokio::spawn(async move {
                    loop {
                        let Ok((mut s, _)) = l.accept().await else {
                            continue;
                        };
                        tokio::spawn(async move {
                            use tokio::io::{AsyncReadExt, AsyncWriteExt};
                            let mut buf = [0u8; 1024];
                            let _ = s.read(&mut buf).await;
                            let _ = s
                                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
                                .await;
                        });
                    }
                });
            }
            Err(e) => {
                eprintln!("bench: 127.0.0.1:{port} taken ({e}); its server answers the probes")
            }
        }
    }
}

/// What a [`journal_writer`] writes to, and how it is doing.
#[derive(Default)]
pub struct Journal {
    /// The directory it writes to; none: it waits.
    target: std::sync::Mutex<Option<std::path::PathBuf>>,
    /// Entries written so far, in any directory.
    written: std::sync::atomic::AtomicU64,
    /// Why it stopped, if it did.
    failed: std::sync::Mutex<Option<String>>,
    /// One entry every so often; zero: no writer (nothing grows).
    every: Duration,
}

pub type JournalTarget = std::sync::Arc<Journal>;

impl Journal {
    /// Entries written so far; panics if the writer stopped (a journal that
    /// no longer grows is not what the caption says).
    pub fn written(&self) -> u64 {
        if let Some(why) = &*self.failed.lock().unwrap() {
            panic!("the bench's journal writer stopped: {why}");
        }
        self.written.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How often the writer writes; zero: there is no writer.
    pub fn every(&self) -> Duration {
        self.every
    }

    /// Entries written since `before` (an earlier [`Journal::written`]);
    /// panics when none were over a window of `secs` that should hold
    /// several (the writer hung: a `systemd-journal-remote` that never
    /// exits stops it without failing). Zero without a writer.
    pub fn written_since(&self, before: u64, secs: f64) -> u64 {
        if self.every.is_zero() {
            return 0;
        }
        let n = self.written() - before;
        assert!(
            n > 0 || secs < 4.0 * self.every.as_secs_f64(),
            "the bench's journal writer wrote nothing in {secs:.1} s (one entry every {:?}): it hung",
            self.every
        );
        n
    }
}

/// Writes a journal entry of this boot every `every` (the kubelet and
/// systemd in turn, saying what they say at rest) to the directory the
/// returned target names (none: no writes), until the process ends. On a
/// fixed schedule: an entry late (systemd-journal-remote is a process
/// started for each, slower on a loaded host) is followed by the next at
/// its own time, so the rate holds while one write takes less than
/// `every`. Ticks missed by more are skipped, not made up in a burst (a
/// burst after a start's storm would wake every reader at once and land
/// in the window after it, on the side whose start loaded the host the
/// longest).
pub fn journal_writer(every: Duration) -> JournalTarget {
    let journal = JournalTarget::new(Journal {
        every,
        ..Journal::default()
    });
    if every.is_zero() {
        return journal;
    }
    let to = journal.clone();
    std::thread::spawn(move || {
        let mut next = std::time::Instant::now();
        for n in 0u64.. {
            next = (next + every).max(std::time::Instant::now());
            std::thread::sleep(next.saturating_duration_since(std::time::Instant::now()));
            let Some(dir) = to.target.lock().unwrap().clone() else {
                continue;
            };
            let (identifier, message) = if n % 2 == 0 {
                (
                    "kubelet",
                    format!(
                        "I1129 12:00:00.000000    1234 kubelet_volumes.go:163] \"Cleaned up orphaned pod volumes dir\" podUID=\"{n:08x}\""
                    ),
                )
            } else {
                (
                    "systemd",
                    format!("Started session-{n}.scope - Session {n} of User root."),
                )
            };
            let wrote = std::panic::catch_unwind(|| {
                crate::support::journal_entry(
                    &dir,
                    identifier,
                    &message,
                    crate::support::dbus::now_usec(),
                )
            });
            if wrote.is_err() {
                *to.failed.lock().unwrap() = Some(format!("writing an entry to {}", dir.display()));
                return;
            }
            to.written
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    });
    journal
}

/// A fresh journal at `dir` for `target`'s writer, its first entry written
/// now, before any reader starts, so journalctl finds this boot in it (a
/// journal of other boots only: journalctl exits at once). Each measured
/// peer gets its own: one growing over the whole bench would favour
/// whoever runs first.
pub fn fresh_journal(target: &JournalTarget, dir: &std::path::Path) {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).unwrap();
    crate::support::journal_entry(
        dir,
        "systemd",
        "Started session-0.scope - Session 0 of User root.",
        crate::support::dbus::now_usec(),
    );
    *target.target.lock().unwrap() = Some(dir.to_path_buf());
}

/// node-problem-detector's monitors, as its own DaemonSet runs them.
pub const NPD_CONFIGS: [&str; 3] = [
    "kernel-monitor.json",
    "docker-monitor.json",
    "systemd-monitor.json",
];

/// NPD's [`NPD_CONFIGS`] from `from`, written to `to` with the journal
/// monitors' `logPath` the journal at `journal`: their paths.
pub fn npd_configs_reading(
    from: &std::path::Path,
    journal: &std::path::Path,
    to: &std::path::Path,
) -> Vec<PathBuf> {
    std::fs::create_dir_all(to).unwrap();
    NPD_CONFIGS
        .iter()
        .map(|c| {
            let raw = std::fs::read_to_string(from.join(c)).unwrap();
            let mut config: serde_json::Value = serde_json::from_str(&raw).unwrap();
            if config["logPath"] == "/var/log/journal" {
                config["logPath"] = journal.display().to_string().into();
            }
            let path = to.join(c);
            std::fs::write(&path, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
            path
        })
        .collect()
}
