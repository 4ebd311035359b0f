//! The metrics registry served on `/metrics` (OpenMetrics text), with the
//! standard `process_*` metrics, build info and the health registry's state.
//! Capabilities register their own families at start-up.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::{Registry, Unit};

use super::health::Health;

/// Labels of `nodeguard_health_requests_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct HealthRequestLabels {
    pub endpoint: String,
    pub code: u16,
}

/// Metrics owned by the HTTP server itself.
#[derive(Clone, Debug)]
pub struct ServerMetrics {
    pub health_requests: Family<HealthRequestLabels, prometheus_client::metrics::counter::Counter>,
}

/// Builds the process-wide registry with the server's own metrics.
pub fn new_registry(health: &Health) -> (Registry, ServerMetrics) {
    let mut registry = Registry::default();
    registry.register(
        "nodeguard_build",
        "nodeguard build information",
        Info::new(vec![
            ("version", env!("CARGO_PKG_VERSION").to_string()),
            ("commit", env!("NODEGUARD_GIT_COMMIT").to_string()),
            ("rustc", env!("NODEGUARD_RUSTC_VERSION").to_string()),
        ]),
    );
    let server = ServerMetrics {
        health_requests: Family::default(),
    };
    registry.register(
        "nodeguard_health_requests",
        "Requests to the health endpoints by endpoint and HTTP status code",
        server.health_requests.clone(),
    );
    registry.register_collector(Box::new(ProcessCollector));
    registry.register_collector(Box::new(HealthCollector(health.clone())));
    (registry, server)
}

/// Encodes the registry as OpenMetrics text.
pub fn encode(registry: &Registry) -> Result<String, std::fmt::Error> {
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, registry)?;
    Ok(out)
}

/// Per-loop state from the health registry, computed at scrape time.
#[derive(Debug)]
struct HealthCollector(Health);

impl Collector for HealthCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let report = self.0.report();
        let gauge = |v: bool| ConstGauge::new(i64::from(v));
        let mut e = encoder.encode_descriptor(
            "nodeguard_loop_synced",
            "1 when the loop has completed its first sync",
            None,
            gauge(true).metric_type(),
        )?;
        for (name, l) in &report.loops {
            gauge(l.synced).encode(e.encode_family(&[("loop", name.as_str())])?)?;
        }
        let mut e = encoder.encode_descriptor(
            "nodeguard_loop_stuck",
            "1 when the loop has had work pending for longer than its timeout",
            None,
            gauge(true).metric_type(),
        )?;
        for (name, l) in &report.loops {
            gauge(l.stuck).encode(e.encode_family(&[("loop", name.as_str())])?)?;
        }
        let mut e = encoder.encode_descriptor(
            "nodeguard_loop_failed",
            "1 when the loop ended or panicked while the agent runs (/livez fails until it is registered again)",
            None,
            gauge(true).metric_type(),
        )?;
        for (name, l) in &report.loops {
            gauge(l.failed.is_some()).encode(e.encode_family(&[("loop", name.as_str())])?)?;
        }
        let e = encoder.encode_descriptor(
            "nodeguard_node_eligible",
            "1 when the node is eligible (not being deleted, not tainted for removal)",
            None,
            gauge(true).metric_type(),
        )?;
        gauge(report.node_eligible).encode(e)?;
        Ok(())
    }
}

/// The standard `process_*` metrics, read from `/proc/self` at scrape time.
#[derive(Debug)]
struct ProcessCollector;

/// Fields of `/proc/<pid>/stat` that the process metrics (and the
/// benchmarks, which watch other processes) need.
#[derive(Debug, PartialEq)]
pub struct ProcStat {
    pub ppid: u64,
    pub utime_ticks: u64,
    pub stime_ticks: u64,
    pub threads: u64,
    pub start_ticks: u64,
    pub vsize_bytes: u64,
    pub rss_pages: u64,
}

/// Parses `/proc/<pid>/stat`. The command name (field 2) may contain
/// spaces and parentheses, so fields are counted from the last `)`.
pub fn parse_proc_stat(text: &str) -> Option<ProcStat> {
    let rest = &text[text.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // f[0] is field 3 (state); field N is f[N - 3].
    let num = |n: usize| f.get(n - 3)?.parse::<u64>().ok();
    Some(ProcStat {
        ppid: num(4)?,
        utime_ticks: num(14)?,
        stime_ticks: num(15)?,
        threads: num(20)?,
        start_ticks: num(22)?,
        vsize_bytes: num(23)?,
        rss_pages: num(24)?,
    })
}

fn boot_time_seconds() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    stat.lines()
        .find_map(|l| l.strip_prefix("btime ")?.trim().parse().ok())
}

fn max_open_files() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(stat) = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|s| parse_proc_stat(&s))
        else {
            return Ok(());
        };
        // SAFETY: sysconf only reads a system constant.
        let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        // SAFETY: as above.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as u64;

        let cpu = ConstCounter::new((stat.utime_ticks + stat.stime_ticks) as f64 / ticks);
        cpu.encode(encoder.encode_descriptor(
            "process_cpu",
            "Total user and system CPU time spent in seconds",
            Some(&Unit::Seconds),
            cpu.metric_type(),
        )?)?;
        let gauges: [(&str, &str, Option<Unit>, Option<f64>); 5] = [
            (
                "process_resident_memory",
                "Resident memory size in bytes",
                Some(Unit::Bytes),
                Some((stat.rss_pages * page) as f64),
            ),
            (
                "process_virtual_memory",
                "Virtual memory size in bytes",
                Some(Unit::Bytes),
                Some(stat.vsize_bytes as f64),
            ),
            (
                "process_start_time",
                "Start time of the process since unix epoch in seconds",
                Some(Unit::Seconds),
                boot_time_seconds().map(|b| b as f64 + stat.start_ticks as f64 / ticks),
            ),
            (
                "process_open_fds",
                "Number of open file descriptors",
                None,
                std::fs::read_dir("/proc/self/fd")
                    .ok()
                    .map(|d| d.count() as f64),
            ),
            (
                "process_max_fds",
                "Maximum number of open file descriptors",
                None,
                max_open_files().map(|m| m as f64),
            ),
        ];
        for (name, help, unit, value) in gauges {
            if let Some(v) = value {
                let g = ConstGauge::new(v);
                g.encode(encoder.encode_descriptor(name, help, unit.as_ref(), g.metric_type())?)?;
            }
        }
        let threads = ConstGauge::new(stat.threads as i64);
        threads.encode(encoder.encode_descriptor(
            "process_threads",
            "Number of OS threads in the process",
            None,
            threads.metric_type(),
        )?)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn proc_stat_with_spaces_and_parens_in_the_name() {
        let line = "1234 (node guard) (x)) S 1 1234 1234 0 -1 4194560 500 0 0 0 \
                    250 50 0 0 20 0 7 0 98765 123456789 4321 18446744073709551615 \
                    1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0";
        let s = parse_proc_stat(line).unwrap();
        assert_eq!(
            s,
            ProcStat {
                ppid: 1,
                utime_ticks: 250,
                stime_ticks: 50,
                threads: 7,
                start_ticks: 98765,
                vsize_bytes: 123456789,
                rss_pages: 4321,
            }
        );
        assert_eq!(parse_proc_stat("garbage"), None);
        assert_eq!(parse_proc_stat("1 (x) S 1 2"), None);
    }

    #[test]
    fn real_proc_self_stat_parses() {
        let s = parse_proc_stat(&std::fs::read_to_string("/proc/self/stat").unwrap()).unwrap();
        assert!(s.threads >= 1 && s.rss_pages > 0);
        assert_eq!(s.ppid, u64::from(std::os::unix::process::parent_id()));
    }

    #[tokio::test(start_paused = true)]
    async fn exposition_has_standard_names_and_loop_state() {
        let health = Health::new();
        let l = health.register("node-watcher", Duration::from_secs(5));
        l.queued();
        health.fail("monitors", "the task panicked");
        tokio::time::advance(Duration::from_secs(6)).await;
        let (registry, server) = new_registry(&health);
        server
            .health_requests
            .get_or_create(&HealthRequestLabels {
                endpoint: "livez".into(),
                code: 503,
            })
            .inc();
        let text = encode(&registry).unwrap();
        for want in [
            "process_cpu_seconds_total ",
            "process_resident_memory_bytes ",
            "process_start_time_seconds ",
            "process_open_fds ",
            "nodeguard_build_info{version=\"",
            "nodeguard_loop_synced{loop=\"node-watcher\"} 0",
            "nodeguard_loop_stuck{loop=\"node-watcher\"} 1",
            "nodeguard_loop_failed{loop=\"node-watcher\"} 0",
            "nodeguard_loop_failed{loop=\"monitors\"} 1",
            "nodeguard_loop_stuck{loop=\"monitors\"} 0",
            "nodeguard_node_eligible 1",
            "nodeguard_health_requests_total{endpoint=\"livez\",code=\"503\"} 1",
            "# EOF",
        ] {
            assert!(text.contains(want), "missing {want:?} in:\n{text}");
        }
    }
}
