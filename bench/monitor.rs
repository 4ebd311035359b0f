//! Log-monitor benchmark: the default kernel rules over a generated
//! kmsg-format stream, parse + match on one thread.
//!
//!   cargo bench --bench monitor
//!   NODEGUARD_BENCH_LINES=2000000 NODEGUARD_BENCH_RUNS=5 cargo bench --bench monitor
//!
//! Prints a markdown table: lines per second per core (CPU time of the one
//! thread doing the work), problems found, peak RSS; medians of the runs.

use std::time::Instant;

use nodeguard::monitor::engine::Engine;
use nodeguard::monitor::kmsg;
use nodeguard::policy::monitors::default_kernel_monitor;

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

fn status_mib(field: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        .unwrap_or(0.0)
        / 1024.0
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    let env = |k: &str, d: &str| std::env::var(k).unwrap_or_else(|_| d.into());
    let n: usize = env("NODEGUARD_BENCH_LINES", "1000000").parse().unwrap();
    let runs: usize = env("NODEGUARD_BENCH_RUNS", "5").parse().unwrap();
    let lines = stream(n);
    let rss_input = status_mib("VmRSS:");
    let now = jiff::Timestamp::now();
    let mut rates = Vec::new();
    let mut found = 0;
    for _ in 0..runs {
        let mut engine = Engine::new(&default_kernel_monitor(), "bench").unwrap();
        engine.current(now);
        let cpu0 = thread_cpu_seconds();
        let wall0 = Instant::now();
        let mut problems = 0usize;
        for raw in &lines {
            if let Some(rec) = kmsg::parse(raw) {
                problems += engine.on_line(&rec.message, now).len();
            }
        }
        let cpu = thread_cpu_seconds() - cpu0;
        let _ = wall0.elapsed();
        rates.push(n as f64 / cpu);
        found = problems;
    }
    println!(
        "log monitor benchmark: default kernel rules ({} rules), {n} generated kmsg records (1 in 200 a problem), parse + match on one thread, median of {runs} runs\n",
        default_kernel_monitor().rules.len()
    );
    println!(
        "| lines | lines/s per core | actions produced | RSS growth while matching | peak RSS (incl. the generated input) |"
    );
    println!("|---:|---:|---:|---:|---:|");
    println!(
        "| {n} | {:.0} | {found} | {:.1} MiB | {:.1} MiB |",
        median(rates),
        status_mib("VmRSS:") - rss_input,
        status_mib("VmHWM:")
    );
}
