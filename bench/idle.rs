//! Same work, same idle cost: one agent at rest beside node-problem-detector
//! on exactly NPD's work, and what the shipped default policy adds. Run with
//! `cargo bench --bench idle` (or `bench/run idle`).
//!
//! The work is the fleet's NPD side (`bench/fleet.rs`): NPD's release build
//! with the journald plugin and its `kernel-monitor.json` (this host's
//! /dev/kmsg), `docker-monitor.json` and `systemd-monitor.json` (a journal).
//! The journal is one the bench writes as a node's journald would, with
//! systemd-journal-remote, fresh for each peer: an entry of this boot every
//! `NODEGUARD_IDLE_JOURNAL_MS` (500) ms, from the kubelet and systemd,
//! matching no rule (a node at rest is not silent, and a host without a
//! journal is not a node: journalctl exits at once there and is restarted
//! every 5 s). Each peer's journal monitors read it (NPD's `logPath`, the
//! default policy's `directory`). Three peers, one at a time, each on its
//! own Node with `NODEGUARD_IDLE_PODS` pods (default 30, as the fleet),
//! both sides' condition heartbeat `NODEGUARD_IDLE_HEARTBEAT_SECONDS` (60,
//! as the fleet; a window of 120 s holds two):
//! - node-problem-detector with those three configs (its Prometheus
//!   exporter on, as by default);
//! - nodeguard with `nodeguard import-npd` of the same three files;
//! - nodeguard with the shipped default policy (`nodeguard default-policy`)
//!   without its shutdown section (this host has no logind, and the
//!   shutdown manager would retry its connection every second), its
//!   kubelet and kube-proxy probes answered on 127.0.0.1 as a healthy node
//!   answers them.
//!
//! Each peer is started, waited for (nodeguard: `/readyz` 200; NPD: its
//! KernelDeadlock condition in the API; nodeguard: then its log's line that it
//! released its start's pages, 60-120 s later), left
//! `NODEGUARD_IDLE_SETTLE_SECONDS` (10) to settle, then measured
//! over `NODEGUARD_IDLE_SECONDS` (default 120):
//! - CPU: the agent's utime+stime (its exited threads included) and its
//!   children's (what it reaped, and each live child's), from /proc. The
//!   kernel keeps these exact and reports them in clock ticks (10 ms),
//!   hence the long window;
//! - wakeups: voluntary context switches per second of every thread of the
//!   agent and of its children, per task (a task begun within the window
//!   counted from its start, and tasks begun and ended reported), by
//!   thread name; involuntary ones (preemption) apart;
//! - PSS of the agent and its children.
//!
//! `NODEGUARD_BENCH_RUNS` runs (default 3), each peer first, second and
//! third once in three. The rows split from one figure (CPU, wakeups) come
//! from the peer's run with that figure's median, so they add up; the
//! others are medians. nodeguard is the binary the image ships (see
//! `bench/npd.rs`).

#[path = "common.rs"]
mod common;
#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use support::pods::running_pod;
use support::*;

#[derive(Clone, Copy, PartialEq, Debug)]
enum Peer {
    Npd,
    Import,
    Default,
}

impl Peer {
    const ALL: [Peer; 3] = [Peer::Npd, Peer::Import, Peer::Default];

    fn label(self) -> &'static str {
        match self {
            Peer::Npd => "node-problem-detector",
            Peer::Import => "nodeguard-import",
            Peer::Default => "nodeguard-default-policy",
        }
    }
}

/// One task's voluntary and involuntary context switches, and its name.
#[derive(Clone, Debug)]
struct Task {
    agent: bool,
    name: String,
    voluntary: u64,
    involuntary: u64,
}

/// One reading of a process tree.
#[derive(Default, Clone, Debug)]
struct Reading {
    /// The agent's own utime+stime (its exited threads included).
    own_cpu: f64,
    /// Its children's: those it reaped (its cutime+cstime) and each live
    /// one's (utime+stime and what it reaped), so a child reaped within the
    /// window moves from one to the other without being counted twice.
    children_cpu: f64,
    /// Every task of the tree, by (pid, tid).
    tasks: BTreeMap<(u32, u32), Task>,
    children: usize,
}

fn ticks_per_second() -> f64 {
    // SAFETY: sysconf reads a constant.
    unsafe { libc::sysconf(libc::_SC_CLK_TCK) as f64 }
}

/// utime+stime and cutime+cstime of /proc/PID/stat (fields 14-17), in
/// seconds; the name field may hold spaces, so split after its `)`.
fn stat_cpu(pid: u32) -> (f64, f64) {
    let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return (0.0, 0.0);
    };
    let rest = &text[text.rfind(')').map_or(0, |i| i + 2)..];
    // After the name: state is field 3, so utime (14) is index 11 here.
    let f: Vec<&str> = rest.split_whitespace().collect();
    let n = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    let hz = ticks_per_second();
    ((n(11) + n(12)) / hz, (n(13) + n(14)) / hz)
}

fn tasks_of(pid: u32, agent: bool, into: &mut BTreeMap<(u32, u32), Task>) {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return;
    };
    for t in tasks.flatten() {
        let Some(tid) = t.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let dir = t.path();
        let name = std::fs::read_to_string(dir.join("comm"))
            .unwrap_or_default()
            .trim()
            .to_string();
        let status = std::fs::read_to_string(dir.join("status")).unwrap_or_default();
        let field = |key: &str| -> u64 {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0)
        };
        into.insert(
            (pid, tid),
            Task {
                agent,
                name,
                voluntary: field("voluntary_ctxt_switches:"),
                involuntary: field("nonvoluntary_ctxt_switches:"),
            },
        );
    }
}

fn read(pid: u32) -> Reading {
    let (own, reaped) = stat_cpu(pid);
    let mut r = Reading {
        own_cpu: own,
        children_cpu: reaped,
        ..Reading::default()
    };
    tasks_of(pid, true, &mut r.tasks);
    for child in tree(pid).into_iter().skip(1) {
        let (cpu, its_reaped) = stat_cpu(child);
        r.children_cpu += cpu + its_reaped;
        tasks_of(child, false, &mut r.tasks);
        r.children += 1;
    }
    r
}

/// Proportional set size of `pid` and its children, in MiB: pages shared
/// between them (the executable's, a library's) counted once in all.
fn tree_pss_mib(pid: u32) -> f64 {
    tree(pid)
        .into_iter()
        .map(|p| {
            std::fs::read_to_string(format!("/proc/{p}/smaps_rollup"))
                .unwrap_or_default()
                .lines()
                .find_map(|l| l.strip_prefix("Pss:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
                .unwrap_or(0.0)
                / 1024.0
        })
        .sum()
}

#[derive(Default, Clone, Debug)]
struct Sample {
    cpu_percent: f64,
    own_cpu_percent: f64,
    children_cpu_percent: f64,
    /// Voluntary context switches per second: the tree's threads going to
    /// sleep, each to be woken again (a timer, a socket, a pipe).
    wakeups: f64,
    own_wakeups: f64,
    children_wakeups: f64,
    /// Involuntary context switches per second (preemption: contention on
    /// this shared machine, not the peer's own timers).
    preempted: f64,
    /// Wakeups per second by "agent: name" / "children: name".
    by_thread: BTreeMap<String, f64>,
    /// Tasks (threads, and children's) that began and that ended within
    /// the window: a count at both ends hides such churn.
    tasks_born: usize,
    tasks_ended: usize,
    threads: usize,
    children: usize,
    pss_mib: f64,
}

impl Sample {
    fn of(before: &Reading, after: &Reading, secs: f64) -> Sample {
        let mut s = Sample {
            own_cpu_percent: (after.own_cpu - before.own_cpu) / secs * 100.0,
            children_cpu_percent: (after.children_cpu - before.children_cpu) / secs * 100.0,
            threads: after.tasks.values().filter(|t| t.agent).count(),
            children: after.children,
            ..Sample::default()
        };
        s.cpu_percent = s.own_cpu_percent + s.children_cpu_percent;
        for (key, t) in &after.tasks {
            // A task born within the window: all it did was in it.
            let (v0, i0) = before
                .tasks
                .get(key)
                .map_or((0, 0), |b| (b.voluntary, b.involuntary));
            if !before.tasks.contains_key(key) {
                s.tasks_born += 1;
            }
            let v = t.voluntary.saturating_sub(v0) as f64 / secs;
            s.preempted += t.involuntary.saturating_sub(i0) as f64 / secs;
            if t.agent {
                s.own_wakeups += v;
            } else {
                s.children_wakeups += v;
            }
            let whose = if t.agent { "agent" } else { "children" };
            *s.by_thread
                .entry(format!("{whose}: {}", t.name))
                .or_insert(0.0) += v;
        }
        s.tasks_ended = before
            .tasks
            .keys()
            .filter(|k| !after.tasks.contains_key(k))
            .count();
        s.wakeups = s.own_wakeups + s.children_wakeups;
        s
    }
}

/// A peer killed with the bench, however the bench ends (its `Drop`s do
/// not run on a signal).
trait DiesWithBench {
    fn dies_with_bench(&mut self) -> &mut Self;
}

impl DiesWithBench for Command {
    fn dies_with_bench(&mut self) -> &mut Self {
        use std::os::unix::process::CommandExt as _;
        // SAFETY: prctl is async-signal-safe. The peers are spawned from
        // the thread running `block_on` (the main thread), which lives as
        // long as the bench.
        unsafe {
            self.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            })
        }
    }
}

struct Running {
    child: Child,
    port: Option<u16>,
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
    npd_configs: PathBuf,
    work: PathBuf,
    /// Where the journal writer writes: each peer's own fresh journal.
    journal: JournalTarget,
    pods: usize,
    window: Duration,
    /// Both sides' condition heartbeat, in seconds.
    heartbeat: u64,
    /// From ready to the window (`NODEGUARD_IDLE_SETTLE_SECONDS`).
    settle: Duration,
}

impl Bench {
    /// Starts `peer` for `node`, its journal monitors reading `journal`.
    fn start(&self, peer: Peer, node: &str, dir: &Path, journal: &Path) -> Running {
        let log = std::fs::File::create(dir.join(format!("{}.log", peer.label()))).unwrap();
        let kubeconfig = kubeconfig_path();
        // NPD's configs, their journal the bench's.
        let configs = npd_configs_reading(&self.npd_configs, journal, dir);
        if peer == Peer::Npd {
            let apiserver = std::fs::read_to_string(&kubeconfig)
                .unwrap()
                .lines()
                .find_map(|l| l.trim().strip_prefix("server: ").map(str::to_string))
                .unwrap();
            let child = Command::new(self.npd_dir.join("nodeproblemdetector-journald"))
                .arg(format!("--hostname-override={node}"))
                .arg(format!(
                    "--apiserver-override={apiserver}?inClusterConfig=false&auth={}",
                    kubeconfig.display()
                ))
                .arg(format!(
                    "--config.system-log-monitor={}",
                    configs
                        .iter()
                        .map(|c| c.display().to_string())
                        .collect::<Vec<_>>()
                        .join(",")
                ))
                .args(["--address=127.0.0.1", &format!("--port={}", free_port())])
                .arg(format!(
                    "--k8s-exporter-heartbeat-period={}s",
                    self.heartbeat
                ))
                .args([
                    "--prometheus-address=127.0.0.1",
                    &format!("--prometheus-port={}", free_port()),
                ])
                .stdin(Stdio::null())
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .dies_with_bench()
                .spawn()
                .unwrap();
            return Running {
                child,
                port: None,
                policy: None,
            };
        }
        let policy = format!("idle-{node}");
        let out = if peer == Peer::Import {
            Command::new(&self.nodeguard)
                .args(["import-npd", "--name", &policy])
                .args(&configs)
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
        if peer == Peer::Default {
            text = text.replacen("  name: default\n", &format!("  name: {policy}\n"), 1);
            assert!(text.contains("directory: /var/log/journal\n"), "{text}");
            text = text.replace(
                "directory: /var/log/journal\n",
                &format!("directory: {}\n", journal.display()),
            );
            // Without logind (none on this host) the shutdown manager
            // retries its connection every second: not what a node has.
            let at = text
                .find("\n  shutdown:\n")
                .expect("the default policy's shutdown");
            let section = &text[at + "\n  shutdown:\n".len()..];
            assert!(
                section.lines().all(|l| l.starts_with("    ")),
                "the shutdown section is not the spec's last:\n{text}"
            );
            text.truncate(at + 1);
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
        let child = Command::new(&self.nodeguard)
            .arg("run")
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .arg("--state-dir")
            .arg(dir.join("state"))
            .arg(format!(
                "--allow-read-path={},/dev/kmsg,/var/log/journal",
                journal.display()
            ))
            .arg(format!("--condition-heartbeat-seconds={}", self.heartbeat))
            .env("NODE_NAME", node)
            .env("RUST_LOG", AGENT_LOG)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .dies_with_bench()
            .spawn()
            .unwrap();
        Running {
            child,
            port: Some(port),
            policy: Some(policy),
        }
    }

    async fn run_peer(&self, peer: Peer, run: usize) -> Sample {
        let admin = admin_client().await;
        let node = TestNode::selectable(&admin, &format!("idle-{}", &peer.label()[..3])).await;
        let dir = self.work.join(format!("run{run}-{}", peer.label()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for i in 0..self.pods {
            running_pod(
                &admin,
                &node.name,
                &format!("{}-{i}", node.name),
                "",
                serde_json::json!({"bench": "idle"}),
            )
            .await;
        }
        // A fresh journal for each peer. With `NODEGUARD_IDLE_JOURNAL_MS=0`
        // it stays empty: a host without a journal.
        let journal = dir.join("journal");
        if self.journal.every().is_zero() {
            std::fs::create_dir_all(&journal).unwrap();
        } else {
            fresh_journal(&self.journal, &journal);
        }
        let mut p = self.start(peer, &node.name, &dir, &journal);
        let pid = p.child.id();
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            assert!(
                p.child.try_wait().unwrap().is_none(),
                "{} exited; its log is in {}",
                peer.label(),
                dir.display()
            );
            assert!(
                Instant::now() < deadline,
                "{} not ready within 120 s; its log is in {}",
                peer.label(),
                dir.display()
            );
            let ready = match p.port {
                Some(port) => matches!(try_get(port, "/readyz").await, Some((200, _))),
                None => condition_status(&admin, &node.name, "KernelDeadlock")
                    .await
                    .is_some(),
            };
            if ready {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // nodeguard releases its start's pages 60-120 s after ready
        // (footprint): the window measures it after that.
        if p.port.is_some() {
            let log = dir.join(format!("{}.log", peer.label()));
            wait_for_page_release(
                &[&log],
                Duration::from_secs(240),
                Duration::from_millis(500),
            )
            .await;
        }
        tokio::time::sleep(self.settle).await;
        let before = read(pid);
        let journal0 = self.journal.written();
        let t0 = Instant::now();
        tokio::time::sleep(self.window).await;
        let after = read(pid);
        let secs = t0.elapsed().as_secs_f64();
        // The journal grew meanwhile (this panics if its writer stopped or
        // hung).
        self.journal.written_since(journal0, secs);
        let pss_mib = tree_pss_mib(pid);
        assert!(
            p.child.try_wait().unwrap().is_none(),
            "{} exited during the window; its log is in {}",
            peer.label(),
            dir.display()
        );
        let s = Sample {
            pss_mib,
            ..Sample::of(&before, &after, secs)
        };
        // SAFETY: signalling our own child.
        unsafe { libc::kill(pid as i32, libc::SIGTERM) };
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
                &kube::api::ListParams::default().fields(&format!("spec.nodeName={}", node.name)),
            )
            .await;
        drop(p);
        s
    }
}

fn main() {
    // `cargo bench` passes `--bench`; nothing else is expected.
    let runs: usize = env_or("NODEGUARD_BENCH_RUNS", 3);
    let window: u64 = env_or("NODEGUARD_IDLE_SECONDS", 120);
    let heartbeat: u64 = env_or("NODEGUARD_IDLE_HEARTBEAT_SECONDS", 60);
    let repo = repo_root();
    let every = Duration::from_millis(env_or("NODEGUARD_IDLE_JOURNAL_MS", 500));
    let bench = Bench {
        nodeguard: shipped_binary(&repo),
        npd_dir: npd_build_dir(),
        npd_configs: npd_configs(),
        work: repo.join("target/bench/idle"),
        journal: journal_writer(every),
        pods: env_or("NODEGUARD_IDLE_PODS", 30),
        window: Duration::from_secs(window),
        heartbeat,
        settle: Duration::from_secs(env_or("NODEGUARD_IDLE_SETTLE_SECONDS", 10)),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut samples: Vec<(Peer, Sample)> = Vec::new();
    rt.block_on(async {
        serve_node_health().await;
        for run in 1..=runs {
            // Each peer first, second and third once in three runs.
            let mut order = Peer::ALL;
            order.rotate_left((run - 1) % Peer::ALL.len());
            for peer in order {
                let s = bench.run_peer(peer, run).await;
                eprintln!("bench: idle: run {run}, {}: {s:?}", peer.label());
                samples.push((peer, s));
            }
        }
    });
    // A peer's run with the median of `f`: the rows split from one figure
    // are read from that one run, so they add up.
    let median_run = |peer: Peer, f: &dyn Fn(&Sample) -> f64| -> Sample {
        let mut of: Vec<&Sample> = samples
            .iter()
            .filter(|(p, _)| *p == peer)
            .map(|(_, s)| s)
            .collect();
        of.sort_by(|a, b| f(a).total_cmp(&f(b)));
        of[(of.len() - 1) / 2].clone()
    };
    let col = |peer: Peer, f: &dyn Fn(&Sample) -> f64| {
        median(
            samples
                .iter()
                .filter(|(p, _)| *p == peer)
                .map(|(_, s)| f(s))
                .collect(),
        )
    };
    let pods = bench.pods;
    let journal = if every.is_zero() {
        "an empty journal directory (a host without a journal)".to_string()
    } else {
        format!(
            "a journal of the bench's getting an entry every {} ms that no rule matches",
            every.as_millis()
        )
    };
    println!(
        "\nOne agent at rest, {pods} pods on its Node, real API server, condition heartbeat {heartbeat} s on both sides; \
         this host's /dev/kmsg, and {journal}; \
         NPD (journald build, Prometheus exporter on) with its kernel-monitor.json, docker-monitor.json and systemd-monitor.json; \
         nodeguard with `import-npd` of the same three files, and with its shipped default policy without its shutdown section (this host has no logind); \
         {runs} runs, each peer first, second and third once in three; {window} s window each\n"
    );
    println!(
        "| figure | node-problem-detector | nodeguard, NPD's work (import-npd) | nodeguard, shipped default policy |\n|---|---:|---:|---:|"
    );
    type Figure<'a> = (&'a str, &'a dyn Fn(&Sample) -> f64, usize);
    let print_rows = |rows: &[Figure], from: Option<&dyn Fn(&Sample) -> f64>| {
        for (name, f, digits) in rows {
            let cells: Vec<String> = Peer::ALL
                .iter()
                .map(|p| match from {
                    Some(key) => format!("{:.*}", digits, f(&median_run(*p, key))),
                    None => format!("{:.*}", digits, col(*p, *f)),
                })
                .collect();
            println!("| {name} | {} |", cells.join(" | "));
        }
    };
    let cpu: &dyn Fn(&Sample) -> f64 = &|s| s.cpu_percent;
    print_rows(
        &[
            ("CPU, with children (% of one core; the median run)", cpu, 3),
            ("… the agent's own process", &|s| s.own_cpu_percent, 3),
            (
                "… its children, live and reaped (journalctl)",
                &|s| s.children_cpu_percent,
                3,
            ),
        ],
        Some(cpu),
    );
    let wakeups: &dyn Fn(&Sample) -> f64 = &|s| s.wakeups;
    print_rows(
        &[
            (
                "wakeups per second, with children (voluntary context switches; the median run)",
                wakeups,
                1,
            ),
            ("… the agent's own threads", &|s| s.own_wakeups, 1),
            ("… its children's", &|s| s.children_wakeups, 1),
        ],
        Some(wakeups),
    );
    print_rows(
        &[
            (
                "preempted per second (involuntary switches: contention here, not the peer's timers)",
                &|s| s.preempted,
                1,
            ),
            ("threads of the agent", &|s| s.threads as f64, 0),
            ("child processes", &|s| s.children as f64, 0),
            ("PSS, with children (MiB)", &|s| s.pss_mib, 1),
        ],
        None,
    );
    let churn: Vec<String> = Peer::ALL
        .iter()
        .map(|p| {
            samples
                .iter()
                .filter(|(q, _)| q == p)
                .map(|(_, s)| format!("{}/{}", s.tasks_born, s.tasks_ended))
                .collect::<Vec<_>>()
                .join(", ")
        })
        .collect();
    println!(
        "| tasks begun/ended within the window, each run | {} |",
        churn.join(" | ")
    );
    // Where the wakeups go: every thread name any peer has, from each
    // peer's median run.
    let runs_of: Vec<Sample> = Peer::ALL.iter().map(|p| median_run(*p, wakeups)).collect();
    let mut names: Vec<&String> = runs_of.iter().flat_map(|s| s.by_thread.keys()).collect();
    names.sort();
    names.dedup();
    println!(
        "\nWakeups per second by thread name, from each peer's median run (a name shared by several threads is their sum)\n"
    );
    println!(
        "| thread | node-problem-detector | nodeguard, NPD's work | nodeguard, default policy |\n|---|---:|---:|---:|"
    );
    for name in names {
        let cells: Vec<String> = runs_of
            .iter()
            .map(|s| {
                s.by_thread
                    .get(name)
                    .map_or("—".into(), |v| format!("{v:.2}"))
            })
            .collect();
        println!("| {name} | {} |", cells.join(" | "));
    }
    println!(
        "\nCPU is utime+stime from /proc/PID/stat: the agent's own (its exited threads included), and its children's (what it reaped, cutime+cstime, and each live child's); \
         it is exact in the kernel and reported in clock ticks (10 ms), hence the long window. \
         Wakeups are voluntary context switches per thread (/proc/PID/task/TID/status), a thread's counted from its start when it began within the window. \
         PSS counts a page shared by the agent and its children once. Artifacts and logs: target/bench/idle/."
    );
}
