//! nodeguard beside node-problem-detector, measured in the same run against
//! the real test control plane (`e2e/cluster/up`), and the agent's own
//! footprint. Run with `cargo bench --bench npd` (or `make bench`).
//!
//! Both peers get the same kernel log file (syslog `kern.log` lines,
//! generated: realistic noise with 1 problem line in 200) and the same
//! rules: NPD reads its own `kernel-monitor-filelog.json` (from the Go
//! module it was built from, `bench/npd-build`); nodeguard reads
//! `nodeguard import-npd` of that same file. Each run starts each peer fresh
//! on its own Node carrying 110 pods, then measures:
//! - startup: process start to the peer's KernelDeadlock condition in the
//!   API (both) and, for nodeguard, to `/readyz` 200;
//! - idle: CPU, RSS and API writes per minute (from the audit log, by the
//!   peer's user agent) over `NODEGUARD_BENCH_IDLE_SECONDS`, from 5 s after
//!   ready (nodeguard: after its log says it released its start's pages,
//!   60-120 s after ready);
//! - detection latency: one hung-task line appended to a quiet log, to the
//!   condition `True` in the API; for nodeguard also a series of
//!   `NODEGUARD_BENCH_LATENCY_LINES` (100) lines, each setting a condition
//!   that the next line clears (median and p99);
//! - flood: `NODEGUARD_BENCH_FLOOD_LINES` appended at once; CPU per line and
//!   wall time until the peer's problem counter has seen every problem line;
//!   peak RSS (VmHWM).
//!
//! A third column runs nodeguard with the shipped default policy on this
//! host (its own /dev/kmsg and journal, the kubelet and kube-proxy probes):
//! startup and idle only.
//!
//! Each figure is the median over `NODEGUARD_BENCH_RUNS` runs; the peers
//! alternate which goes first. CPU and RSS include the peer's children.
//!
//! nodeguard is the binary the image ships: the static musl release build
//! `e2e/image` leaves in `target/x86_64-unknown-linux-musl/release/`
//! (`bench/run` builds it first), or `NODEGUARD_BENCH_BINARY`. The idle RSS
//! is also split into the agent's own process (and of it, anonymous memory:
//! heap and stacks; and its executable's pages, resident and touched within
//! the idle window) and its children.

#[path = "common.rs"]
mod common;
#[path = "../tests/support/mod.rs"]
mod support;

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use support::pods::running_pod;
use support::*;

#[derive(Clone, Copy, PartialEq, Debug)]
enum Peer {
    Nodeguard,
    Npd,
    /// nodeguard with the shipped default policy (`nodeguard default-policy`:
    /// /dev/kmsg, journald monitors, kubelet and kube-proxy probes) on this
    /// host: startup and idle only, its inputs being the host's own.
    NodeguardDefault,
}

impl Peer {
    fn label(self) -> &'static str {
        match self {
            Peer::Nodeguard => "nodeguard",
            Peer::Npd => "node-problem-detector",
            Peer::NodeguardDefault => "nodeguard-default-policy",
        }
    }
}

#[derive(Default, Clone, Debug)]
struct Sample {
    startup_condition: f64,
    startup_ready: Option<f64>,
    idle_cpu_percent: f64,
    idle_rss_mib: f64,
    /// The peer's own process, without its children.
    idle_rss_self_mib: f64,
    /// Of that, anonymous memory (heap, stacks): `RssAnon`.
    idle_rss_anon_mib: f64,
    /// The executable's own pages: resident at the window's end, and of
    /// them those touched within the window.
    idle_exe_rss_mib: f64,
    idle_exe_touched_mib: f64,
    idle_writes_per_min: f64,
    idle_lease_writes_per_min: f64,
    latency: f64,
    /// nodeguard only: line to condition True over `latency_lines` lines
    /// (median, p99), each cleared again before the next.
    latency_p50: Option<f64>,
    latency_p99: Option<f64>,
    flood_lines_per_cpu_s: f64,
    flood_wall: f64,
    flood_problems_seen: u64,
    flood_problems_sent: u64,
    peak_rss_mib: f64,
}

fn append(path: &Path, text: &str) {
    let mut f = std::fs::OpenOptions::new().append(true).open(path).unwrap();
    f.write_all(text.as_bytes()).unwrap();
    f.flush().unwrap();
}

/// The value of the first sample of `metric` whose labels contain `label`.
fn metric_value(text: &str, metric: &str, label: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(metric) && l.contains(label))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
}

/// Audit-log writes (ResponseComplete) in `text` whose user agent starts
/// with `agent` (the bench's own client is `nodeguard-tests`) and whose
/// request URI contains `uri`.
fn audit_writes(text: &str, agent: &str, uri: &str) -> usize {
    text.lines()
        .filter(|l| l.contains("\"stage\":\"ResponseComplete\""))
        .filter(|l| l.contains(&format!("\"userAgent\":\"{agent}/")))
        .filter(|l| l.contains(uri))
        .count()
}

struct Running {
    child: Child,
    /// Just before the process was spawned: startup is measured from here,
    /// not from before the policy was applied.
    spawned: Instant,
    metrics_port: u16,
    ready_port: Option<u16>,
    user_agent: &'static str,
    problem_metric: &'static str,
    /// nodeguard's policy, deleted with the process whatever happened.
    policy: Option<String>,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(p) = &self.policy {
            let _ = kubectl_status(&["delete", "--ignore-not-found", "nodeguardpolicy", p]);
        }
    }
}

struct Bench {
    nodeguard: PathBuf,
    npd_dir: PathBuf,
    work: PathBuf,
    audit_log: PathBuf,
    pods: usize,
    idle: Duration,
    flood_lines: u64,
    latency_lines: usize,
}

impl Bench {
    /// Writes NPD's config for `log`, applies nodeguard's import of it for
    /// `node`, and starts `peer`.
    async fn start(&self, peer: Peer, node: &str, log: &Path, dir: &Path) -> Running {
        let raw =
            std::fs::read_to_string(self.npd_dir.join("kernel-monitor-filelog.json")).unwrap();
        let mut config: serde_json::Value = serde_json::from_str(&raw).unwrap();
        config["logPath"] = serde_json::json!(log.display().to_string());
        let config_path = dir.join("kernel-monitor-filelog.json");
        std::fs::write(&config_path, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
        let log_file = std::fs::File::create(dir.join(format!("{}.log", peer.label()))).unwrap();
        let kubeconfig = kubeconfig_path();
        match peer {
            Peer::Nodeguard | Peer::NodeguardDefault => {
                let policy = format!("bench-{node}");
                let out = if peer == Peer::Nodeguard {
                    Command::new(&self.nodeguard)
                        .args(["import-npd", "--name", &policy])
                        .arg(&config_path)
                        .output()
                        .unwrap()
                } else {
                    Command::new(&self.nodeguard)
                        .arg("default-policy")
                        .output()
                        .unwrap()
                };
                assert!(out.status.success(), "policy: {out:?}");
                let mut text = String::from_utf8(out.stdout).unwrap();
                if peer == Peer::NodeguardDefault {
                    text = text.replacen("  name: default\n", &format!("  name: {policy}\n"), 1);
                }
                let yaml = dir.join("policy.yaml");
                std::fs::write(&yaml, text).unwrap();
                kubectl(&["apply", "-f", yaml.to_str().unwrap()]);
                let selector = serde_json::json!({"spec": {"nodeSelector": selecting(node)}});
                kubectl(&[
                    "patch",
                    "nodeguardpolicy",
                    &policy,
                    "--type",
                    "merge",
                    "-p",
                    &selector.to_string(),
                ]);
                let port = free_port();
                let mut command = Command::new(&self.nodeguard);
                command
                    .arg("run")
                    .arg("--kubeconfig")
                    .arg(&kubeconfig)
                    .args(["--listen", &format!("127.0.0.1:{port}")])
                    .arg("--state-dir")
                    .arg(dir.join("state"))
                    // The generated kern.log is outside the default read
                    // roots, which the default policy's sources need.
                    .arg(format!(
                        "--allow-read-path={},/dev/kmsg,/var/log/journal",
                        dir.display()
                    ))
                    .env("NODE_NAME", node)
                    .env("RUST_LOG", AGENT_LOG)
                    .stdin(Stdio::null())
                    .stdout(log_file.try_clone().unwrap())
                    .stderr(log_file);
                let spawned = Instant::now();
                let child = command.spawn().unwrap();
                Running {
                    child,
                    spawned,
                    metrics_port: port,
                    ready_port: Some(port),
                    user_agent: "nodeguard",
                    problem_metric: "nodeguard_problem_total",
                    policy: Some(policy),
                }
            }
            Peer::Npd => {
                let port = free_port();
                let prom = free_port();
                let apiserver = std::fs::read_to_string(&kubeconfig)
                    .unwrap()
                    .lines()
                    .find_map(|l| l.trim().strip_prefix("server: ").map(str::to_string))
                    .unwrap();
                let mut command = Command::new(self.npd_dir.join("nodeproblemdetector"));
                command
                    .arg(format!("--hostname-override={node}"))
                    .arg(format!(
                        "--apiserver-override={apiserver}?inClusterConfig=false&auth={}",
                        kubeconfig.display()
                    ))
                    .arg(format!(
                        "--config.system-log-monitor={}",
                        config_path.display()
                    ))
                    .args(["--address=127.0.0.1", &format!("--port={port}")])
                    .args([
                        "--prometheus-address=127.0.0.1",
                        &format!("--prometheus-port={prom}"),
                    ])
                    .stdin(Stdio::null())
                    .stdout(log_file.try_clone().unwrap())
                    .stderr(log_file);
                let spawned = Instant::now();
                let child = command.spawn().unwrap();
                Running {
                    child,
                    spawned,
                    metrics_port: prom,
                    ready_port: None,
                    user_agent: "nodeproblemdetector",
                    problem_metric: "problem_counter",
                    policy: None,
                }
            }
        }
    }

    async fn run_peer(&self, peer: Peer, run: usize) -> Sample {
        let admin = admin_client().await;
        let node = TestNode::selectable(&admin, &format!("bench-{}", &peer.label()[..3])).await;
        let dir = self.work.join(format!("run{run}-{}", peer.label()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("kern.log");
        std::fs::write(
            &log,
            kern_line(&node.name, 1.0, "Linux version 6.1.0-bench"),
        )
        .unwrap();
        eprintln!(
            "bench: run {run}, {}: {} pods on node {}",
            peer.label(),
            self.pods,
            node.name
        );
        for i in 0..self.pods {
            running_pod(
                &admin,
                &node.name,
                &format!("{}-{i}", node.name),
                "",
                serde_json::json!({"bench": "yes"}),
            )
            .await;
        }

        // Startup, from the spawn: `/readyz` polled every 5 ms, and the
        // condition in the API every 20 ms, side by side.
        let mut p = self.start(peer, &node.name, &log, &dir).await;
        let pid = p.child.id();
        let t0 = p.spawned;
        let deadline = t0 + Duration::from_secs(120);
        let ready_port = p.ready_port;
        let label = peer.label();
        // Both polls check that the peer is still running (the borrow is
        // never held across an await).
        let child = std::cell::RefCell::new(&mut p.child);
        let running = || {
            assert!(
                child.borrow_mut().try_wait().unwrap().is_none(),
                "{label} exited; log in {}",
                dir.display()
            );
            assert!(
                Instant::now() < deadline,
                "{label} did not start within 120 s; log in {}",
                dir.display()
            );
        };
        let ready = async {
            let port = ready_port?;
            loop {
                if let Some((200, _)) = try_get(port, "/readyz").await {
                    return Some(t0.elapsed().as_secs_f64());
                }
                running();
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        let condition = async {
            loop {
                if condition_status(&admin, &node.name, "KernelDeadlock")
                    .await
                    .is_some()
                {
                    return t0.elapsed().as_secs_f64();
                }
                running();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        let (ready, condition) = tokio::join!(ready, condition);
        let mut s = Sample {
            startup_ready: ready,
            startup_condition: condition,
            ..Sample::default()
        };

        // Idle: once nodeguard has released its start's pages (as it does
        // 60-120 s after ready, footprint), then 5 s more.
        if ready_port.is_some() {
            let log = dir.join(format!("{}.log", peer.label()));
            wait_for_page_release(
                &[&log],
                Duration::from_secs(240),
                Duration::from_millis(500),
            )
            .await;
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
        let audit_start = std::fs::metadata(&self.audit_log).unwrap().len();
        let cpu0 = tree_cpu_seconds(pid);
        clear_touched(pid);
        let i0 = Instant::now();
        tokio::time::sleep(self.idle).await;
        let idle = i0.elapsed().as_secs_f64();
        s.idle_cpu_percent = (tree_cpu_seconds(pid) - cpu0) / idle * 100.0;
        s.idle_rss_mib = tree_rss_mib(pid);
        s.idle_rss_self_mib = status_mib(pid, "VmRSS:");
        s.idle_rss_anon_mib = status_mib(pid, "RssAnon:");
        (s.idle_exe_rss_mib, s.idle_exe_touched_mib) = executable_pages_mib(pid);
        let audit = std::fs::read(&self.audit_log).unwrap();
        let window = String::from_utf8_lossy(&audit[audit_start as usize..]);
        s.idle_writes_per_min = audit_writes(&window, p.user_agent, "") as f64 * 60.0 / idle;
        s.idle_lease_writes_per_min =
            audit_writes(&window, p.user_agent, "/leases/") as f64 * 60.0 / idle;
        if peer == Peer::NodeguardDefault {
            s.peak_rss_mib = status_mib(pid, "VmHWM:");
            return self.finish(p, &admin, &node.name, s).await;
        }

        // Detection latency on a quiet log.
        let t0 = Instant::now();
        append(
            &log,
            &kern_line(
                &node.name,
                100.0,
                "INFO: task docker:4242 blocked for more than 120 seconds.",
            ),
        );
        loop {
            if condition_is(&admin, &node.name, "KernelDeadlock", "True").await {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "{}: no KernelDeadlock=True",
                peer.label()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        s.latency = t0.elapsed().as_secs_f64();

        // Flood.
        let (text, problems) = flood(&node.name, self.flood_lines, 200.0);
        s.flood_problems_sent = problems;
        let counted =
            |m: &str| metric_value(m, p.problem_metric, "OOMKilling").unwrap_or(0.0) as u64;
        let before = counted(&scrape(p.metrics_port, "/metrics").await);
        let cpu0 = cpu_seconds(pid);
        let t0 = Instant::now();
        append(&log, &text);
        drop(text);
        let deadline = t0 + Duration::from_secs(120);
        let mut last_change = (Instant::now(), before);
        loop {
            let seen = counted(&scrape(p.metrics_port, "/metrics").await) - before;
            if seen != last_change.1 {
                last_change = (Instant::now(), seen);
            }
            s.flood_problems_seen = seen;
            if seen >= problems {
                break;
            }
            // Stalled for 10 s short of the total: report what it saw.
            if Instant::now() > deadline || last_change.0.elapsed() > Duration::from_secs(10) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        s.flood_wall = last_change.0.duration_since(t0).as_secs_f64();
        let cpu = cpu_seconds(pid) - cpu0;
        s.flood_lines_per_cpu_s = self.flood_lines as f64 / cpu.max(1e-9);
        s.peak_rss_mib = status_mib(pid, "VmHWM:");
        if peer == Peer::Nodeguard {
            let (p50, p99) = self.latency_series(&admin, &node.name, &dir).await;
            s.latency_p50 = Some(p50);
            s.latency_p99 = Some(p99);
        }
        self.finish(p, &admin, &node.name, s).await
    }

    /// Line to condition `True` in the API, `latency_lines` times: a second
    /// policy gives the node a file monitor whose condition a line sets and
    /// another line clears (NPD's kernel monitor has no condition that
    /// clears, so a series needs its own). Each problem line is appended,
    /// the Node read every 5 ms until the condition is `True` (the figure
    /// includes up to one read's wait), then cleared and read until `False`,
    /// and the next line follows 300 ms later.
    /// Returns (median, p99) in seconds.
    async fn latency_series(&self, admin: &kube::Client, node: &str, dir: &Path) -> (f64, f64) {
        let log = dir.join("latency.log");
        std::fs::write(&log, "").unwrap();
        let name = format!("bench-{node}-latency");
        apply_policy(
            admin,
            &name,
            serde_json::json!({"nodeSelector": selecting(node), "monitors": [{
                "name": "latency", "source": {"file": {"path": log.display().to_string()}},
                "conditions": [{"type": "BenchLatency", "reason": "BenchClear", "message": "clear",
                                "clearPattern": "latency clear"}],
                "rules": [{"type": "permanent", "condition": "BenchLatency", "reason": "BenchProblem",
                           "pattern": "latency problem"}],
            }]}),
        )
        .await;
        // The monitor runs once its condition is in the API, and the
        // edit's write (held at the node's point of the policy write
        // spread) is done once the Node names the new policy.
        let t = Instant::now();
        loop {
            let n = kube::Api::<k8s_openapi::api::core::v1::Node>::all(admin.clone())
                .get(node)
                .await
                .unwrap();
            let named = n
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(nodeguard::agent::EFFECTIVE_ANNOTATION))
                .is_some_and(|v| v.contains(&name));
            if named && condition_is(admin, node, "BenchLatency", "False").await {
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "the latency monitor never started"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let wait_for = |status: &'static str| async move {
            let t0 = Instant::now();
            while !condition_is(admin, node, "BenchLatency", status).await {
                assert!(
                    t0.elapsed() < Duration::from_secs(30),
                    "BenchLatency never {status}"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            t0.elapsed().as_secs_f64()
        };
        let mut samples = Vec::new();
        for i in 0..self.latency_lines {
            append(&log, &format!("latency problem {i}\n"));
            samples.push(wait_for("True").await);
            append(&log, "latency clear\n");
            wait_for("False").await;
            // The agent writes a node's status at most once per 250 ms
            // (`min_write_interval`; urgent changes aside): the next problem
            // comes after that, so each sample is a problem's own latency,
            // not the interval left by the previous write.
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        kubectl(&["delete", "nodeguardpolicy", &name, "--wait=false"]);
        samples.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let p99 = samples[((samples.len() * 99).div_ceil(100)).saturating_sub(1)];
        (median(samples), p99)
    }

    /// Stops the peer (SIGTERM, so nodeguard ends its journalctl children),
    /// removes the node's pods, and returns the sample.
    async fn finish(&self, mut p: Running, admin: &kube::Client, node: &str, s: Sample) -> Sample {
        unsafe { libc::kill(p.child.id() as i32, libc::SIGTERM) };
        for _ in 0..100 {
            if p.child.try_wait().unwrap().is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let pods: kube::Api<k8s_openapi::api::core::v1::Pod> =
            kube::Api::namespaced(admin.clone(), TEST_NAMESPACE);
        let _ = pods
            .delete_collection(
                &kube::api::DeleteParams::default().grace_period(0),
                &kube::api::ListParams::default().fields(&format!("spec.nodeName={node}")),
            )
            .await;
        drop(p);
        s
    }
}

fn main() {
    // `cargo bench` passes `--bench`; nothing else is expected.
    let runs: usize = env_or("NODEGUARD_BENCH_RUNS", 3);
    let idle: u64 = env_or("NODEGUARD_BENCH_IDLE_SECONDS", 60);
    let flood_lines: u64 = env_or("NODEGUARD_BENCH_FLOOD_LINES", 200_000);
    // While working on one peer: `NODEGUARD_BENCH_PEERS=nodeguard` (any of
    // nodeguard, node-problem-detector, nodeguard-default-policy, comma
    // separated); the others' columns then read "—".
    let only: Option<Vec<String>> = std::env::var("NODEGUARD_BENCH_PEERS")
        .ok()
        .map(|v| v.split(',').map(|s| s.trim().to_string()).collect());
    let wanted = |p: Peer| {
        only.as_ref()
            .is_none_or(|o| o.iter().any(|x| x == p.label()))
    };
    let repo = repo_root();
    let npd_dir = npd_build_dir();
    let bench = Bench {
        nodeguard: shipped_binary(&repo),
        npd_dir,
        work: repo.join("target/bench/npd"),
        audit_log: kubeconfig_path().with_file_name("logs").join("audit.log"),
        pods: 110,
        idle: Duration::from_secs(idle),
        flood_lines,
        latency_lines: env_or("NODEGUARD_BENCH_LATENCY_LINES", 100),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut samples: Vec<(Peer, Sample)> = Vec::new();
    rt.block_on(async {
        for run in 1..=runs {
            let order = if run % 2 == 1 {
                [Peer::Nodeguard, Peer::Npd]
            } else {
                [Peer::Npd, Peer::Nodeguard]
            };
            for peer in order
                .into_iter()
                .chain([Peer::NodeguardDefault])
                .filter(|p| wanted(*p))
            {
                let s = bench.run_peer(peer, run).await;
                eprintln!("bench: run {run}, {}: {s:?}", peer.label());
                samples.push((peer, s));
            }
        }
    });
    let col = |peer: Peer, f: &dyn Fn(&Sample) -> f64| {
        median(
            samples
                .iter()
                .filter(|(p, _)| *p == peer)
                .map(|(_, s)| f(s))
                .collect(),
        )
    };
    println!(
        "\nnodeguard beside node-problem-detector: same kern.log stream and rules (NPD's kernel-monitor-filelog.json; nodeguard: its import-npd), \
         110 pods on each peer's Node, real API server; median of {runs} runs (idle window {idle} s, flood {flood_lines} lines, 1 in 200 a problem)\n"
    );
    println!(
        "| figure | nodeguard | node-problem-detector | nodeguard, shipped default policy (host's own kmsg and journal) |\n|---|---:|---:|---:|"
    );
    let names = [
        "startup: process start to its condition in the API",
        "startup: process start to `/readyz` 200",
        "idle CPU (% of one core)",
        "idle RSS",
        "… the agent's own process / of it, anonymous (heap, stacks)",
        "… of it, the executable's pages: resident / touched in the idle window",
        "idle API writes per minute (audit log)",
        "… of which Lease renewals (the one elected policy-status writer per cluster)",
        "detection latency: line to condition True in the API",
        "… over a series of lines (a condition set, then cleared, each time): median / p99",
        "flood: lines per CPU-second",
        "flood: wall time until every problem line was counted",
        "flood: problem lines counted / sent",
        "peak RSS (VmHWM)",
    ];
    let cells = |p: Peer| -> Vec<String> {
        if !wanted(p) {
            return vec!["—".to_string(); 14];
        }
        vec![
            format!("{:.2} s", col(p, &|s| s.startup_condition)),
            match p {
                Peer::Npd => "(no readiness endpoint)".into(),
                _ => format!("{:.2} s", col(p, &|s| s.startup_ready.unwrap_or(f64::NAN))),
            },
            format!("{:.2} %", col(p, &|s| s.idle_cpu_percent)),
            format!("{:.1} MiB", col(p, &|s| s.idle_rss_mib)),
            format!(
                "{:.1} / {:.1} MiB",
                col(p, &|s| s.idle_rss_self_mib),
                col(p, &|s| s.idle_rss_anon_mib)
            ),
            format!(
                "{:.1} / {:.1} MiB",
                col(p, &|s| s.idle_exe_rss_mib),
                col(p, &|s| s.idle_exe_touched_mib)
            ),
            format!("{:.1}", col(p, &|s| s.idle_writes_per_min)),
            format!("{:.1}", col(p, &|s| s.idle_lease_writes_per_min)),
            format!("{:.3} s", col(p, &|s| s.latency)),
            match p {
                Peer::Nodeguard => format!(
                    "{:.3} / {:.3} s",
                    col(p, &|s| s.latency_p50.unwrap_or(f64::NAN)),
                    col(p, &|s| s.latency_p99.unwrap_or(f64::NAN))
                ),
                _ => "(no condition that clears)".into(),
            },
            format!("{:.0}", col(p, &|s| s.flood_lines_per_cpu_s)),
            format!("{:.2} s", col(p, &|s| s.flood_wall)),
            format!(
                "{:.0} / {:.0}",
                col(p, &|s| s.flood_problems_seen as f64),
                col(p, &|s| s.flood_problems_sent as f64)
            ),
            format!("{:.1} MiB", col(p, &|s| s.peak_rss_mib)),
        ]
    };
    let (ng, npd, def) = (
        cells(Peer::Nodeguard),
        cells(Peer::Npd),
        cells(Peer::NodeguardDefault),
    );
    for (i, name) in names.iter().enumerate() {
        // The default-policy run measures startup and idle only (rows 0-7)
        // and its peak; its log sources are the host's.
        let d = if (8..13).contains(&i) {
            "—"
        } else {
            def[i].as_str()
        };
        println!("| {name} | {} | {} | {d} |", ng[i], npd[i]);
    }
    println!(
        "\nCPU is utime+stime of the peer's process and its children (nodeguard's journald monitors run journalctl) over the window, RSS their sum; the flood's CPU includes everything the process did meanwhile (reading, matching, Events, condition writes). \
         The executable's pages are the smaps `Rss` of the mappings of the peer's own binary less their anonymous (copied-on-write) pages, and of them `Referenced` after the window began with `/proc/PID/clear_refs`: \
         the kernel maps a file's pages around each one faulted (64 KiB), so what is resident exceeds what runs; touched is an upper bound (pages mapped around a fault within the window count too). \
         API writes are the audit log's ResponseComplete entries with the peer's user agent. Artifacts and logs: target/bench/npd/."
    );
}
