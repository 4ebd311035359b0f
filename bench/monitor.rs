//! Log-monitor benchmark: parse + match on one thread, no reader, queue or
//! API: the engine's own rate, which `bench/npd.rs`'s end-to-end flood is
//! compared with. Two cases:
//! - the default kernel rules over a generated kmsg-format stream;
//! - the npd bench's flood exactly: NPD's `kernel-monitor-filelog.json`
//!   (from the module `bench/npd-build` fetched) as `import-npd` converts it,
//!   over the same generated `kern.log` lines (NPD matching: a ring of the
//!   last lines joined, the filelog message pattern on every line).
//!
//!   cargo bench --bench monitor
//!   NODEGUARD_BENCH_LINES=2000000 NODEGUARD_BENCH_RUNS=5 cargo bench --bench monitor
//!
//! Prints a markdown table: lines per second per core (CPU time of the one
//! thread doing the work), problems found, peak RSS; medians of the runs.

#[path = "common.rs"]
mod common;
#[path = "../tests/support/mod.rs"]
mod support;

use nodeguard::monitor::engine::Engine;
use nodeguard::monitor::kmsg;
use nodeguard::policy::defaults::default_kernel_monitor;
use nodeguard::policy::monitors::MonitorSpec;

/// A realistic mix: mostly noise, about 1 line in 200 a problem.
fn stream(n: usize) -> Vec<String> {
    let noise = [
        "IPv6: ADDRCONF(NETDEV_CHANGE): eth0: link becomes ready",
        "EXT4-fs (sda1): mounted filesystem with ordered data mode. Opts: (null)",
        "audit: type=1400 audit(1700000000.000:2): apparmor=\"STATUS\" operation=\"profile_load\" profile=\"unconfined\" name=\"nvidia_modprobe\" pid=812 comm=\"apparmor_parser\"",
        "cni0: port 3(veth8f2a1c3e) entered forwarding state",
        "IPVS: rr: TCP 10.96.0.10:53 - no destination available",
        "eth0: renamed from veth1d2c3b4a",
        "device veth8f2a1c3e entered promiscuous mode",
        "nf_conntrack: default automatic helper assignment has been turned off for security reasons",
    ];
    let problems = [
        "Out of memory: Killed process 12345 (java) total-vm:9823012kB, anon-rss:7340032kB, file-rss:0kB, shmem-rss:0kB",
        "INFO: task kworker/u8:2:1234 blocked for more than 120 seconds.",
        "EXT4-fs error (device sda1): ext4_find_entry:1455: inode #2: comm ls: reading directory lblock 0",
        "watchdog: BUG: soft lockup - CPU#3 stuck for 23s! [kworker/3:1:123]",
    ];
    (0..n)
        .map(|i| {
            let msg = if i % 200 == 199 {
                problems[(i / 200) % problems.len()]
            } else {
                noise[i % noise.len()]
            };
            format!("6,{},{},-;{msg}", i + 1, i * 1000)
        })
        .collect()
}

fn thread_cpu_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

/// Lines per CPU-second through a fresh engine for `spec` (median of
/// `runs`), and the actions the last run produced. `feed` hands the engine
/// every line and returns (lines, actions).
fn rate(
    spec: &MonitorSpec,
    runs: usize,
    feed: impl Fn(&mut Engine, jiff::Timestamp) -> (usize, usize),
) -> (f64, usize) {
    let now = jiff::Timestamp::now();
    let mut rates = Vec::new();
    let mut found = 0;
    for _ in 0..runs {
        let mut engine = Engine::new(spec, "bench").unwrap();
        engine.current(now);
        let cpu0 = thread_cpu_seconds();
        let (n, actions) = feed(&mut engine, now);
        let cpu = thread_cpu_seconds() - cpu0;
        rates.push(n as f64 / cpu);
        found = actions;
    }
    (common::median(rates), found)
}

fn main() {
    let env = |k: &str, d: &str| std::env::var(k).unwrap_or_else(|_| d.into());
    let n: usize = env("NODEGUARD_BENCH_LINES", "1000000").parse().unwrap();
    let runs: usize = env("NODEGUARD_BENCH_RUNS", "5").parse().unwrap();
    let records = stream(n);
    let rss_input = common::status_mib(std::process::id(), "VmRSS:");
    let kernel = default_kernel_monitor();
    // kmsg::parse is part of the rate: the reader parses each record.
    let (kmsg_rate, kmsg_found) = rate(&kernel, runs, |engine, now| {
        let mut actions = 0;
        for raw in &records {
            if let Some(rec) = kmsg::parse(raw) {
                actions += engine.on_line(&rec.message, now).len();
            }
        }
        (records.len(), actions)
    });
    let rss_kmsg = common::status_mib(std::process::id(), "VmRSS:") - rss_input;
    drop(records);

    let raw = std::fs::read_to_string(support::npd_build_dir().join("kernel-monitor-filelog.json"))
        .expect("NPD's kernel-monitor-filelog.json (bench/npd-build)");
    let config: serde_json::Value = serde_json::from_str(&raw).unwrap();
    let imported = nodeguard::policy::npd::import("kernel-monitor-filelog.json", &config);
    let npd = &imported.monitors[0];
    let (text, _) = common::flood("bench-node", n as u64, 200.0);
    // A file source's parse is splitting the lines.
    let (npd_rate, npd_found) = rate(npd, runs, |engine, now| {
        let mut n = 0;
        let mut actions = 0;
        for line in text.lines() {
            actions += engine.on_line(line, now).len();
            n += 1;
        }
        (n, actions)
    });

    println!(
        "log monitor benchmark: parse + match on one thread (no reader, queue or API), {n} generated lines (1 in 200 a problem), median of {runs} runs\n"
    );
    println!("| rules and lines | lines/s per core | actions produced |");
    println!("|---|---:|---:|");
    println!(
        "| default kernel rules ({} rules), kmsg records | {kmsg_rate:.0} | {kmsg_found} |",
        kernel.rules.len()
    );
    println!(
        "| NPD's kernel-monitor-filelog.json imported ({} rules, NPD matching: {} lines joined, message pattern), kern.log lines: the npd bench's flood | {npd_rate:.0} | {npd_found} |",
        npd.rules.len(),
        npd.npd_matching.as_ref().map_or(0, |m| m.buffer_lines)
    );
    println!(
        "\nRSS growth while matching the kmsg records: {rss_kmsg:.1} MiB; peak RSS (with the generated input): {:.1} MiB",
        common::status_mib(std::process::id(), "VmHWM:")
    );
}
