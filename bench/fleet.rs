//! A fleet of agents against one API server: what a DaemonSet of nodeguard
//! costs the control plane, beside the same fleet of node-problem-detector.
//! Run with `cargo bench --bench fleet` (or `make bench`).
//!
//! Each run starts, for one side, `NODEGUARD_FLEET_AGENTS` processes (default
//! 200), each for a Node of its own created for the run with
//! `NODEGUARD_FLEET_PODS` pods bound to it (default 30), against the real test
//! control plane (`e2e/cluster/up`). Every process authenticates as a service
//! account of namespace `nodeguard-fleet`, whose every request the audit log
//! keeps (`e2e/cluster/up`'s audit policy), so the fleet's requests are
//! counted by verb and resource apart from everyone else's.
//! - nodeguard: the shipped binary (`e2e/image`'s static build, as
//!   `bench/npd.rs`) with the shipped default policy (`nodeguard
//!   default-policy`: /dev/kmsg, two journald monitors, the kubelet and
//!   kube-proxy healthz probes, which this bench answers on
//!   127.0.0.1:10248 and :10256 like a healthy node would).
//! - node-problem-detector: its release build with the journald plugin
//!   (`bench/npd-build`), with its kernel-monitor.json (/dev/kmsg),
//!   docker-monitor.json and systemd-monitor.json (journald), the monitors
//!   of its own DaemonSet.
//!
//! Each side's journald monitors (nodeguard's two, NPD's docker and systemd
//! monitors) read one journal the bench writes as a node's journald would
//! (systemd-journal-remote, as `bench/idle.rs`), fresh for each side and
//! run, with an entry of this boot every `NODEGUARD_FLEET_JOURNAL_MS` (500)
//! ms that no rule matches: every reader on the host reads that one file,
//! as every monitor on a node reads the node's. With
//! `NODEGUARD_FLEET_JOURNAL_MS=0` they read the host's /var/log/journal as
//! the sections measured before the bench wrote a journal did: on a host
//! with no entry of this boot there, every `journalctl` exits at once and
//! nodeguard restarts it (after 1, 2, 4 s, then every 5 s for a minute,
//! then less often), which no node does.
//!
//! Both sides' condition heartbeat is `NODEGUARD_FLEET_HEARTBEAT_SECONDS`
//! (default 60; each ships with 300) so the steady window sees heartbeats.
//! Measured per run:
//! - startup: all processes started at once, from the first start until
//!   every one is ready (nodeguard's `/readyz`, NPD's `/healthz`), and
//!   where that time went: how long starting the processes took, the CPU
//!   (core-seconds) of the processes, the API server, etcd and the whole
//!   host against what the host's cores had, the side's requests, those
//!   answered 429 and those by verb, resource and answer (a success, or
//!   its code), and how long the API
//!   server took to answer them (the audit log's received and completed
//!   times); the same for the rollout;
//! - steady state over `NODEGUARD_FLEET_STEADY_SECONDS` (default 120),
//!   from 15 s after every member is ready (nodeguard: after every agent's
//!   log says it released its start's pages, 60-120 s after it was ready or
//!   later, `footprint`, unless `NODEGUARD_KEEP_EXECUTABLE_PAGES` is on):
//!   requests per second by verb, resource and answer (audit log), writes per node
//!   per heartbeat, watches open (the API server's
//!   `apiserver_longrunning_requests`), the API server's and etcd's CPU and
//!   RSS above their level just before the processes started (the run's
//!   Nodes and pods already there), the agents' own CPU and RSS;
//! - a policy edit (nodeguard only: NPD's configuration is a file, changed by
//!   a rollout): writes per node, peak writes per second at the API server,
//!   the spread from first to last write, and the time until every Node
//!   shows the new generation in `nodeguard.io/effective-policies`;
//! - a rollout: every process stopped (SIGTERM) and started again at once:
//!   LIST requests, how many of them the API server served from its watch
//!   cache (`apiserver_cache_list_total`; from 1.34
//!   `apiserver_storage_list_total{storage="watchcache"}`) and how many
//!   reached etcd (`etcd_requests_total{operation="list"}`), the time until all are
//!   ready;
//! - an API server restart: the API server stopped under the running fleet
//!   for `NODEGUARD_FLEET_OUTAGE_SECONDS` (default 30, `e2e/cluster/ctl`)
//!   and started again (its own start until ready, waited for up to 300 s):
//!   the fleet's requests in the first minute from its
//!   start (the most in one second, those answered 429, the LISTs and when
//!   the last one came), LISTs of the agents' resources served from the
//!   watch cache and sent to etcd since its start (every client's: the
//!   node-problem-detector column, whose fleet lists nothing, shows the
//!   control plane's own), the time until every fleet Node's conditions
//!   carry a heartbeat written after the start (those still kept before
//!   the stop: heartbeated within two heartbeats; the stale ones are
//!   counted apart), and conditions (type and status) present before the
//!   stop and missing or changed after it.
//!   Each side starts against a freshly started API server, as the side
//!   after a restart does, so the order of the sides does not change the
//!   steady figures.
//!
//! Memory three ways: one agent's RSS (the binary and libraries shared with
//! every other copy counted in full), its private pages (what one more agent
//! costs the host; size a larger run by it) and the whole fleet's PSS.
//!
//! Then a projection to 5,000 nodes from the per-node figures, which is a
//! projection, not a measurement. With `NODEGUARD_FLEET_BASELINE` naming a
//! markdown file with this bench's table from a run at another size (`bench/run
//! fleet-large` passes the fleet section of bench/RESULTS.md), a last table
//! puts each figure beside the baseline's, per node where it is the whole
//! fleet's, with their ratio: whether the projection holds.
//!
//! `NODEGUARD_FLEET_ONLY_START=1` runs the start only, and reports where its
//! time went (a profile of the start-up storm in minutes).
//! `NODEGUARD_FLEET_WITHOUT_JOURNALD=1` leaves the two journald monitors out
//! of nodeguard's policy (NPD keeps its own), to measure what they cost a
//! start: their `journalctl` children, and their four conditions; the
//! caption says so.
//!
//! `NODEGUARD_BENCH_RUNS` runs (default 3) alternate which side goes first;
//! each figure is the median over runs. The co-located processes share one
//! host's inotify instances (journald readers use one each): the bench
//! raises `fs.inotify.max_user_instances` when it is lower than the fleet
//! needs, as a node would never need to. Artifacts: target/bench/fleet/.

#[path = "common.rs"]
mod common;
#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures::{FutureExt, StreamExt};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};

use common::*;
use support::*;

/// How long a restarted API server may take to answer ready. e2e/cluster/ctl
/// allows 60 s, which a thousand agents reconnecting have passed (at
/// fcc64d8, with a journal: 48 s in one run, over 60 s in another); the
/// restart's figure reports what it took.
const APISERVER_READY_WITHIN: Duration = Duration::from_secs(300);

const NS: &str = "nodeguard-fleet";
const FLEET_LABEL: &str = "nodeguard.io/fleet";
const POLICY: &str = "fleet-default";
/// The kubelet's condition types.
const KUBELET_CONDITIONS: [&str; 5] = [
    "Ready",
    "MemoryPressure",
    "DiskPressure",
    "PIDPressure",
    "NetworkUnavailable",
];

#[derive(Clone, Copy, PartialEq, Debug)]
enum Side {
    Nodeguard,
    Npd,
}

impl Side {
    fn label(self) -> &'static str {
        match self {
            Side::Nodeguard => "nodeguard",
            Side::Npd => "node-problem-detector",
        }
    }
    fn account(self) -> &'static str {
        match self {
            Side::Nodeguard => "agent",
            Side::Npd => "npd",
        }
    }
    fn user(self) -> String {
        format!("system:serviceaccount:{NS}:{}", self.account())
    }
    /// The `FLEET_LABEL` value of this side's Nodes in run `run` (and the
    /// middle of their names).
    fn group(self, run: usize) -> String {
        let short = match self {
            Side::Nodeguard => "ng",
            Side::Npd => "npd",
        };
        format!("{short}{run}")
    }
}

struct Settings {
    agents: usize,
    pods: usize,
    steady: Duration,
    heartbeat: u64,
    outage: Duration,
    /// Only the first start, then the report of it (a profile of the
    /// start-up storm in minutes instead of the whole bench).
    only_start: bool,
    /// nodeguard's policy without its journald monitors: what they cost a
    /// start, their `journalctl` children and their four conditions (a
    /// diagnosis; NPD keeps its own).
    without_journald: bool,
    /// A journal entry of this boot every this long in each side's journal
    /// (`NODEGUARD_FLEET_JOURNAL_MS`); zero: the host's /var/log/journal.
    journal_every: Duration,
}

/// One fleet process; killed on drop whatever happened.
struct Member {
    child: Child,
    port: u16,
    /// Its stdout and stderr.
    log: PathBuf,
}

impl Drop for Member {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One request in the audit log.
struct Audited {
    verb: String,
    /// `resource` or `resource/subresource`; for a request with no object
    /// (discovery, /version), its path.
    resource: String,
    name: String,
    /// Seconds since the epoch.
    at: f64,
    /// When the API server received it (seconds since the epoch).
    received: f64,
    /// From the API server receiving the request until this entry's stage
    /// (s): for anything but a watch, the time it took to answer.
    took: f64,
    /// The response's status code (0 when the log has none).
    code: u64,
}

impl Audited {
    /// Its verb and resource, and the answer's code unless a success (a
    /// 429 is a request the client makes again: counted apart, the
    /// retried and the first tries tell apart).
    fn kind(&self) -> String {
        match self.code {
            0 | 200..=299 => format!("{} {}", self.verb, self.resource),
            code => format!("{} {} answered {code}", self.verb, self.resource),
        }
    }
}

/// A place in the audit log: the file (its inode) and a byte in it.
#[derive(Clone, Copy)]
struct AuditMark {
    inode: u64,
    offset: u64,
}

/// The end of the audit log now.
fn audit_mark(log: &Path) -> AuditMark {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(log).unwrap();
    AuditMark {
        inode: m.ino(),
        offset: m.len(),
    }
}

/// The fleet's requests in the audit log after `mark`: one entry a request
/// (a watch when it starts, anything else when it completes). The API
/// server rotates the log at 200 MB (`e2e/cluster/up`), about every half
/// hour at 1,000 agents: a mark in a file rotated since is read on in the
/// rotated file (the same inode, renamed beside it), then the new one.
fn audited(log: &Path, mark: AuditMark, user: &str) -> Vec<Audited> {
    use std::io::{Read, Seek};
    use std::os::unix::fs::MetadataExt;
    let read_from = |path: &Path, offset: u64, text: &mut String| {
        let mut f = std::fs::File::open(path).unwrap();
        f.seek(std::io::SeekFrom::Start(offset)).unwrap();
        f.read_to_string(text).unwrap();
    };
    let mut text = String::new();
    if std::fs::metadata(log).unwrap().ino() == mark.inode {
        read_from(log, mark.offset, &mut text);
    } else {
        let rotated: Vec<PathBuf> = std::fs::read_dir(log.parent().unwrap())
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.metadata().is_ok_and(|m| m.ino() == mark.inode))
            .collect();
        assert!(
            rotated.len() == 1,
            "the audit log was rotated during the bench and its old file is gone; rerun"
        );
        read_from(&rotated[0], mark.offset, &mut text);
        read_from(log, 0, &mut text);
    }
    let needle = format!("\"username\":\"{user}\"");
    text.lines()
        .filter(|l| l.contains(&needle))
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| {
            let watch = e["verb"] == "watch";
            (watch && e["stage"] == "ResponseStarted")
                || (!watch && e["stage"] == "ResponseComplete")
        })
        .map(|e| {
            let o = &e["objectRef"];
            // A request with no object (discovery, /version): its path.
            let path = || {
                let uri = e["requestURI"].as_str().unwrap_or("?");
                uri.split('?').next().unwrap_or(uri).to_string()
            };
            let mut resource = o["resource"].as_str().map_or_else(path, str::to_string);
            if let Some(sub) = o["subresource"].as_str() {
                resource = format!("{resource}/{sub}");
            }
            let seconds = |field: &str| {
                e[field]
                    .as_str()
                    .and_then(|t| t.parse::<jiff::Timestamp>().ok())
                    .map(|t| t.as_microsecond() as f64 / 1e6)
            };
            let at = seconds("stageTimestamp").unwrap_or(0.0);
            Audited {
                verb: e["verb"].as_str().unwrap_or("?").to_string(),
                resource,
                name: o["name"].as_str().unwrap_or("").to_string(),
                at,
                received: seconds("requestReceivedTimestamp").unwrap_or(at),
                took: seconds("requestReceivedTimestamp").map_or(0.0, |r| (at - r).max(0.0)),
                code: e["responseStatus"]["code"].as_u64().unwrap_or(0),
            }
        })
        .collect()
}

/// Seconds since the epoch, as the audit log's timestamps.
fn epoch_now() -> f64 {
    jiff::Timestamp::now().as_microsecond() as f64 / 1e6
}

/// The whole host's CPU since boot (core-seconds, /proc/stat's first line).
#[derive(Clone, Copy, Default)]
struct HostCpu {
    /// All but idle, iowait and steal.
    busy: f64,
    /// Of which serving interrupts (irq and softirq). A kernel without
    /// `CONFIG_IRQ_TIME_ACCOUNTING` (this test bed's) also counts those ticks
    /// in the interrupted process's system time.
    interrupts: f64,
    /// Taken by the hypervisor: the cores did not have it.
    steal: f64,
    cores: usize,
}

fn host_cpu() -> HostCpu {
    let stat = std::fs::read_to_string("/proc/stat").unwrap();
    let ticks: Vec<u64> = stat
        .lines()
        .next()
        .unwrap()
        .split_whitespace()
        .skip(1)
        .map(|t| t.parse().unwrap())
        .collect();
    // SAFETY: sysconf reads a constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    // user nice system idle iowait irq softirq steal (guest time is in user).
    HostCpu {
        busy: (ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6]) as f64 / hz,
        interrupts: (ticks[5] + ticks[6]) as f64 / hz,
        steal: ticks[7] as f64 / hz,
        cores: stat
            .lines()
            .filter(|l| l.starts_with("cpu") && !l.starts_with("cpu "))
            .count(),
    }
}

/// The `q` quantile of `v` (nearest rank); 0 for none.
fn percentile(v: &[f64], q: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return 0.0;
    }
    v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1]
}

fn is_write(verb: &str) -> bool {
    matches!(verb, "create" | "update" | "patch" | "delete")
}

/// Sum of the samples of `metric` whose labels contain every one of `labels`.
fn metric_sum(text: &str, metric: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(metric) && l[metric.len()..].starts_with('{'))
        .filter(|l| labels.iter().all(|x| l.contains(x)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .fold(0.0, |a, b| a + b)
}

async fn apiserver_metrics(client: &Client) -> String {
    let req = http::Request::get("/metrics").body(Vec::new()).unwrap();
    client.request_text(req).await.unwrap_or_default()
}

/// The resources the agents list, as the API server's storage names them:
/// up to 1.33 by key prefix and type, from 1.34 by group and resource.
const LISTED: [(&str, &str, &str, &str); 3] = [
    ("/pods", "pods", "", "pods"),
    ("/minions", "nodes", "", "nodes"),
    (
        "/nodeguard.io/nodeguardpolicies",
        "nodeguardpolicies.nodeguard.io",
        "nodeguard.io",
        "nodeguardpolicies",
    ),
];

/// LISTs of the agents' resources served from the watch cache, and those
/// sent to etcd, so far (every client's). The API server names these
/// series one way up to 1.33 and another from 1.34; one of the two sums
/// is zero.
fn list_counters(metrics: &str) -> (f64, f64) {
    let mut cache = 0.0;
    let mut etcd = 0.0;
    for (prefix, etcd_type, group, resource) in LISTED {
        cache += metric_sum(
            metrics,
            "apiserver_cache_list_total",
            &[&format!("resource_prefix=\"{prefix}\"")],
        );
        etcd += metric_sum(
            metrics,
            "etcd_requests_total",
            &["operation=\"list", &format!("type=\"{etcd_type}\"")],
        );
        let named = [
            format!("group=\"{group}\""),
            format!("resource=\"{resource}\""),
        ];
        cache += metric_sum(
            metrics,
            "apiserver_storage_list_total",
            &[&named[0], &named[1], "storage=\"watchcache\""],
        );
        etcd += metric_sum(
            metrics,
            "etcd_requests_total",
            &["operation=\"list\"", &named[0], &named[1]],
        );
    }
    (cache, etcd)
}

fn watches(metrics: &str) -> f64 {
    metric_sum(
        metrics,
        "apiserver_longrunning_requests",
        &["verb=\"WATCH\""],
    )
}

/// The control plane's processes: CPU seconds and RSS (MiB) of each. The
/// process ids are read at each look: the restart phase starts a new API
/// server.
struct ControlPlane {
    dir: PathBuf,
}

impl ControlPlane {
    fn find() -> ControlPlane {
        ControlPlane {
            dir: kubeconfig_path().parent().unwrap().to_path_buf(),
        }
    }
    /// The pid of the control plane's process `name` (`e2e/cluster/ctl`'s
    /// names).
    fn pid(&self, name: &str) -> u32 {
        std::fs::read_to_string(self.dir.join(format!("{name}.pid")))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }
    fn pids(&self) -> (u32, u32) {
        (self.pid("kube-apiserver"), self.pid("etcd"))
    }
    fn cpu(&self) -> (f64, f64) {
        let (apiserver, etcd) = self.pids();
        (cpu_seconds(apiserver), cpu_seconds(etcd))
    }
    fn rss(&self) -> (f64, f64) {
        let (apiserver, etcd) = self.pids();
        (status_mib(apiserver, "VmRSS:"), status_mib(etcd, "VmRSS:"))
    }
}

/// CPU (% of one core) and RSS (MiB) of the control plane over `window`.
async fn control_plane_load(cp: &ControlPlane, window: Duration) -> ((f64, f64), (f64, f64)) {
    let (a0, e0) = cp.cpu();
    let t0 = Instant::now();
    tokio::time::sleep(window).await;
    let secs = t0.elapsed().as_secs_f64();
    let (a1, e1) = cp.cpu();
    (
        ((a1 - a0) / secs * 100.0, (e1 - e0) / secs * 100.0),
        cp.rss(),
    )
}

#[derive(Default, Clone, Debug)]
struct Sample {
    start: StartSample,
    /// [`Audited::kind`] → requests per second.
    steady_rps: BTreeMap<String, f64>,
    steady_writes_per_node_per_heartbeat: f64,
    steady_reads_per_node_per_min: f64,
    /// Entries the bench wrote to the side's journal per minute of the
    /// steady window.
    steady_journal_per_min: f64,
    apiserver_cpu: f64,
    apiserver_rss: f64,
    etcd_cpu: f64,
    watches: f64,
    member_rss: f64,
    /// One agent's private pages (with children), median: what one more
    /// agent costs the host.
    member_private: f64,
    /// The whole fleet's proportional set size: what all of it costs the
    /// host together (shared pages counted once).
    fleet_pss: f64,
    member_cpu: f64,
    edit: Option<EditSample>,
    rollout_lists: f64,
    rollout_cache_lists: f64,
    rollout_etcd_lists: f64,
    rollout: StartSample,
    restart: RestartSample,
}

/// All of one side's processes started at once, until every one is ready:
/// where the time went. CPU figures are core-seconds over that time.
#[derive(Default, Clone, Debug)]
struct StartSample {
    /// From before the first start until every one answered ready (s).
    ready: f64,
    /// Of which starting the processes (s).
    spawn: f64,
    /// The processes' own CPU until ready, with their children: alive ones,
    /// and those reaped in their own figure.
    fleet_cpu: f64,
    /// One process's, median (ms).
    agent_cpu_ms: f64,
    apiserver_cpu: f64,
    etcd_cpu: f64,
    /// kube-controller-manager's and kube-scheduler's.
    controllers_cpu: f64,
    /// The bench's own (starting the processes, asking each if it is
    /// ready), its reaped children's (kubectl) included.
    bench_cpu: f64,
    /// Of the host's busy CPU, serving interrupts (/proc/stat's irq and
    /// softirq); on a kernel that does not account interrupt time apart,
    /// also inside the figures of the processes interrupted.
    interrupts: f64,
    /// The host's busy CPU less the processes above: other processes,
    /// processes gone unreaped, and interrupts where accounted apart.
    rest_cpu: f64,
    /// Every process on the host (/proc/stat: all but idle, iowait and
    /// steal), the bench's own included.
    host_busy: f64,
    /// The host's cores times the time until ready, less what the
    /// hypervisor took (steal): what there was.
    host_capacity: f64,
    /// The side's requests received from before the first start until
    /// all were ready, per process (those answered within 12 s of it).
    requests_per_agent: f64,
    /// Of those, answered 429.
    throttled: f64,
    /// How long the API server took to answer them (watches and 429s left
    /// out), median and 99th percentile (s).
    answer_p50: f64,
    answer_p99: f64,
    /// Those requests by [`Audited::kind`] (`verb resource`, and the
    /// answer's code unless a success), whole fleet.
    by_kind: BTreeMap<String, f64>,
    /// Entries the bench wrote to the side's journal meanwhile.
    journal_entries: f64,
}

/// The API server stopped under the fleet and started again.
#[derive(Default, Clone, Debug)]
struct RestartSample {
    /// From the API server's start until it answered `/readyz`.
    apiserver_ready: f64,
    /// The fleet's requests in the first minute from the API server's start.
    requests_first_minute: f64,
    /// The most in one second.
    peak_requests_per_s: f64,
    /// From the API server's start until the fleet's last LIST (s); none
    /// when it listed nothing.
    last_list: Option<f64>,
    /// The fleet's LISTs from the start until the measures ended.
    lists: f64,
    /// Of the fleet's requests from the start until the measures ended
    /// (at least 63 s), how many were answered 429 (the API
    /// server's "too many requests", also its answer while a watch cache
    /// initializes).
    throttled: f64,
    /// LISTs of pods, nodes and policies sent to etcd from the API server's
    /// start to 63 s after it (every client's, its own watch caches'
    /// included).
    etcd_lists: f64,
    cache_lists: f64,
    /// From the API server's start until every fleet Node's kept
    /// conditions carry a heartbeat written after it; none when some did
    /// not within 300 s.
    conditions_current: Option<f64>,
    /// Kept conditions with no heartbeat from after the start when the
    /// look ended.
    not_current: f64,
    /// Conditions whose heartbeat was already more than two heartbeats
    /// old when the API server stopped (their process no longer keeps
    /// them: a monitor that did not start); left out of
    /// `conditions_current`.
    stale_before: f64,
    /// Conditions (type and status) present before the stop and missing or
    /// changed after it, over all the fleet's Nodes.
    lost: f64,
}

#[derive(Default, Clone, Debug)]
struct EditSample {
    writes_per_node_max: f64,
    writes_per_node_mean: f64,
    peak_writes_per_s: f64,
    first_to_last: f64,
    converged: f64,
}

struct Fleet {
    settings: Settings,
    nodeguard: PathBuf,
    npd_dir: PathBuf,
    npd_configs: PathBuf,
    work: PathBuf,
    audit_log: PathBuf,
    kubeconfigs: BTreeMap<&'static str, PathBuf>,
    control_plane: ControlPlane,
    /// Where the journal writer writes: the running side's journal.
    journal: JournalTarget,
}

impl Fleet {
    fn nodes(&self, side: Side, run: usize) -> Vec<String> {
        (0..self.settings.agents)
            .map(|i| format!("fleet-{}-{i:03}", side.group(run)))
            .collect()
    }

    /// Creates the run's Nodes and their pods.
    async fn create_nodes(&self, admin: &Client, side: Side, run: usize, nodes: &[String]) {
        let t0 = Instant::now();
        let group = side.group(run);
        let node_api: Api<Node> = Api::all(admin.clone());
        let pod_api: Api<Pod> = Api::namespaced(admin.clone(), NS);
        let creates = nodes.iter().flat_map(|node| {
            let n: Node = serde_json::from_value(serde_json::json!({
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": node, "labels": {FLEET_LABEL: group}},
            }))
            .unwrap();
            let node_api = node_api.clone();
            let (group, pod_api) = (group.clone(), pod_api.clone());
            let first = async move {
                node_api.create(&PostParams::default(), &n).await.unwrap();
            };
            let pods = (0..self.settings.pods).map(move |i| {
                let group = group.clone();
                let pod: Pod = serde_json::from_value(serde_json::json!({
                    "apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": format!("{node}-{i:02}"), "labels": {FLEET_LABEL: group}},
                    "spec": {"nodeName": node, "automountServiceAccountToken": false,
                             "tolerations": [{"operator": "Exists"}],
                             "containers": [{"name": "c", "image": "example.invalid/app"}]},
                }))
                .unwrap();
                let pod_api = pod_api.clone();
                async move {
                    pod_api.create(&PostParams::default(), &pod).await.unwrap();
                }
            });
            std::iter::once(futures::future::Either::Left(first))
                .chain(pods.map(futures::future::Either::Right))
        });
        // Nodes first (each node's creation comes before its pods in the
        // stream, and 16 in flight keep that order close).
        futures::stream::iter(creates)
            .buffer_unordered(16)
            .collect::<Vec<()>>()
            .await;
        eprintln!(
            "fleet: {} nodes with {} pods each created in {:.1} s",
            nodes.len(),
            self.settings.pods,
            t0.elapsed().as_secs_f64()
        );
    }

    async fn delete_nodes(&self, admin: &Client, side: Side, run: usize) {
        delete_until_gone(admin, &format!("{FLEET_LABEL}={}", side.group(run))).await;
    }

    /// The journal the side's journald monitors read in run `run`: one for
    /// the whole side, as every monitor on a node reads the node's; none
    /// with `NODEGUARD_FLEET_JOURNAL_MS=0` (the host's).
    fn journal_dir(&self, side: Side, run: usize) -> Option<PathBuf> {
        (!self.settings.journal_every.is_zero())
            .then(|| self.work.join(format!("journal-{}-run{run}", side.label())))
    }

    /// NPD's three configs for run `run`, comma-separated: its own, or
    /// when the bench writes a journal the copies [`Self::write_npd_configs`]
    /// wrote.
    fn npd_config_list(&self, run: usize) -> String {
        let dir = match self.journal_dir(Side::Npd, run) {
            Some(_) => self.npd_config_dir(run),
            None => self.npd_configs.clone(),
        };
        NPD_CONFIGS
            .map(|c| dir.join(c).display().to_string())
            .join(",")
    }

    /// NPD's configs for run `run` with their `logPath` the side's journal,
    /// written once before any process of the run starts (each reads them
    /// at its start).
    fn write_npd_configs(&self, run: usize) {
        let Some(journal) = self.journal_dir(Side::Npd, run) else {
            return;
        };
        npd_configs_reading(&self.npd_configs, &journal, &self.npd_config_dir(run));
    }

    /// Where run `run`'s copies of NPD's configs go.
    fn npd_config_dir(&self, run: usize) -> PathBuf {
        self.work.join(format!("npd-configs-run{run}"))
    }

    /// Member `i`'s port: fixed, below the ephemeral range, so two members
    /// never draw the same one (a free port picked by binding :0 can be
    /// handed out twice before either member binds it).
    fn port(i: usize) -> u16 {
        20_000 + i as u16
    }

    fn start_member(&self, side: Side, run: usize, node: &str, dir: &Path, port: u16) -> Member {
        std::fs::create_dir_all(dir).unwrap();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("log"))
            .unwrap();
        let kubeconfig = &self.kubeconfigs[side.account()];
        let mut cmd = match side {
            Side::Nodeguard => {
                let mut c = Command::new(&self.nodeguard);
                c.arg("run")
                    .arg("--kubeconfig")
                    .arg(kubeconfig)
                    .args(["--listen", &format!("127.0.0.1:{port}")])
                    .arg("--state-dir")
                    .arg(dir.join("state"))
                    .arg(format!(
                        "--condition-heartbeat-seconds={}",
                        self.settings.heartbeat
                    ))
                    .env("NODE_NAME", node)
                    .env("POD_NAMESPACE", NS)
                    .env("RUST_LOG", AGENT_LOG);
                if let Some(journal) = self.journal_dir(side, run) {
                    c.arg(format!(
                        "--allow-read-path={},/dev/kmsg,/var/log/journal",
                        journal.display()
                    ));
                }
                c
            }
            Side::Npd => {
                let apiserver = std::fs::read_to_string(kubeconfig_path())
                    .unwrap()
                    .lines()
                    .find_map(|l| l.trim().strip_prefix("server: ").map(str::to_string))
                    .unwrap();
                let configs = self.npd_config_list(run);
                let mut c = Command::new(self.npd_dir.join("nodeproblemdetector-journald"));
                c.arg(format!("--hostname-override={node}"))
                    .arg(format!(
                        "--apiserver-override={apiserver}?inClusterConfig=false&auth={}",
                        kubeconfig.display()
                    ))
                    .arg(format!("--config.system-log-monitor={configs}"))
                    .arg(format!(
                        "--k8s-exporter-heartbeat-period={}s",
                        self.settings.heartbeat
                    ))
                    .args(["--address=127.0.0.1", &format!("--port={port}")])
                    .args(["--prometheus-address=127.0.0.1", "--prometheus-port=0"]);
                c
            }
        };
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        Member {
            child,
            port,
            log: dir.join("log"),
        }
    }

    fn start_all(&self, side: Side, run: usize, nodes: &[String]) -> Vec<Member> {
        nodes
            .iter()
            .enumerate()
            .map(|(i, n)| {
                self.start_member(
                    side,
                    run,
                    n,
                    &self.work.join(format!("{}-run{run}", side.label())).join(n),
                    Self::port(i),
                )
            })
            .collect()
    }

    /// Starts every member at once, and the seconds from before the first
    /// start (on a loaded host starting 1,000 processes takes a minute and
    /// more) until every one answers ready, with where the time went.
    async fn start_until_ready(
        &self,
        side: Side,
        run: usize,
        nodes: &[String],
    ) -> (Vec<Member>, StartSample) {
        let offset = audit_mark(&self.audit_log);
        let journal0 = self.journal.written();
        // The host's window holds the processes' (each look at /proc takes
        // a while).
        let host0 = host_cpu();
        let procs0 = host_processes();
        let epoch0 = epoch_now();
        let t0 = Instant::now();
        let mut members = self.start_all(side, run, nodes);
        let spawn = t0.elapsed().as_secs_f64();
        eprintln!("fleet: {} started in {spawn:.1} s", members.len());
        let ready = self.until_ready(side, &mut members, t0).await;
        let journal_entries =
            self.journal
                .written_since(journal0, t0.elapsed().as_secs_f64()) as f64;
        let epoch1 = epoch_now();
        let procs1 = host_processes();
        let host1 = host_cpu();
        // Each member with its children (alive ones here, reaped ones in
        // its own figure).
        let links: Vec<(u32, u64)> = procs1
            .iter()
            .map(|(&pid, p)| (pid, u64::from(p.ppid)))
            .collect();
        let pids: Vec<u32> = members.iter().map(|m| m.child.id()).collect();
        let member_cpu: Vec<f64> = descendants(&links, &pids)
            .into_iter()
            .map(|tree| cpu_between(&procs0, &procs1, tree))
            .collect();
        let pid = |name: &str| self.control_plane.pid(name);
        let cpu = |pids: &[u32]| cpu_between(&procs0, &procs1, pids.iter().copied());
        let fleet_cpu: f64 = member_cpu.iter().sum();
        let apiserver_cpu = cpu(&[pid("kube-apiserver")]);
        let etcd_cpu = cpu(&[pid("etcd")]);
        let controllers_cpu = cpu(&[pid("kube-controller-manager"), pid("kube-scheduler")]);
        let bench_cpu = cpu(&[std::process::id()]);
        let host_busy = host1.busy - host0.busy;
        let interrupts = host1.interrupts - host0.interrupts;
        let by_command = cpu_by_command(&procs0, &procs1);
        eprintln!(
            "fleet: start: CPU by command (core-seconds; a process's reaped children in its own): {:?}",
            by_command
                .iter()
                .filter(|c| c.1 > 0.0)
                .take(12)
                .collect::<Vec<_>>()
        );
        // The requests received until all were ready, as the audit log
        // has them once answered: a request still queued when the last one
        // was ready is answered (or given up by its client, 10 s) after it.
        tokio::time::sleep(Duration::from_secs(12)).await;
        let requests: Vec<Audited> = audited(&self.audit_log, offset, &side.user())
            .into_iter()
            .filter(|q| q.received >= epoch0 && q.received <= epoch1)
            .collect();
        let answered: Vec<f64> = requests
            .iter()
            .filter(|q| q.verb != "watch" && q.code != 429)
            .map(|q| q.took)
            .collect();
        let n = members.len() as f64;
        let mut by_kind: BTreeMap<String, f64> = BTreeMap::new();
        for q in &requests {
            *by_kind.entry(q.kind()).or_default() += 1.0;
        }
        let s = StartSample {
            ready,
            spawn,
            fleet_cpu,
            agent_cpu_ms: median(member_cpu) * 1000.0,
            apiserver_cpu,
            etcd_cpu,
            controllers_cpu,
            bench_cpu,
            interrupts,
            rest_cpu: host_busy
                - fleet_cpu
                - apiserver_cpu
                - etcd_cpu
                - controllers_cpu
                - bench_cpu,
            host_busy,
            host_capacity: ready * host0.cores as f64 - (host1.steal - host0.steal),
            requests_per_agent: requests.len() as f64 / n,
            throttled: requests.iter().filter(|q| q.code == 429).count() as f64,
            answer_p50: percentile(&answered, 0.5),
            answer_p99: percentile(&answered, 0.99),
            by_kind,
            journal_entries,
        };
        eprintln!("fleet: start: {s:?}");
        (members, s)
    }

    /// Seconds from `t0` until every member answers ready.
    async fn until_ready(&self, side: Side, members: &mut [Member], t0: Instant) -> f64 {
        let path = match side {
            Side::Nodeguard => "/readyz",
            Side::Npd => "/healthz",
        };
        let mut waiting: Vec<usize> = (0..members.len()).collect();
        while !waiting.is_empty() {
            let ports: Vec<u16> = waiting.iter().map(|&i| members[i].port).collect();
            let ready: Vec<bool> = futures::stream::iter(ports)
                .map(|p| async move { matches!(try_get(p, path).await, Some((200, _))) })
                .buffered(32)
                .collect()
                .await;
            waiting = waiting
                .into_iter()
                .zip(ready)
                .filter(|(_, r)| !r)
                .map(|(i, _)| i)
                .collect();
            for &i in &waiting {
                if let Ok(Some(status)) = members[i].child.try_wait() {
                    panic!(
                        "a {} process exited ({status}); its log is under {}",
                        side.label(),
                        self.work.display()
                    );
                }
            }
            assert!(
                t0.elapsed() < Duration::from_secs(300),
                "{} of the fleet not ready after 300 s",
                waiting.len()
            );
            if !waiting.is_empty() {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        let took = t0.elapsed().as_secs_f64();
        for m in members.iter_mut() {
            if let Ok(Some(status)) = m.child.try_wait() {
                panic!(
                    "a {} process on port {} exited ({status}); its log is under {}",
                    side.label(),
                    m.port,
                    self.work.display()
                );
            }
        }
        took
    }

    async fn run_side(&self, admin: &Client, side: Side, run: usize) -> Sample {
        let n = self.settings.agents;
        let nodes = self.nodes(side, run);
        self.delete_nodes(admin, side, run).await;
        self.create_nodes(admin, side, run, &nodes).await;
        let mut s = Sample::default();
        if let Some(journal) = self.journal_dir(side, run) {
            fresh_journal(&self.journal, &journal);
        }
        if side == Side::Npd {
            self.write_npd_configs(run);
        }
        if side == Side::Nodeguard {
            self.apply_policy(run, "The kernel has no deadlock.");
        }

        // A freshly started API server for every side (the restart phase
        // leaves one for the next), then the control plane's level with
        // this run's Nodes and pods, before any of the processes (once the
        // controllers have seen the pods).
        cluster_ctl("stop", "kube-apiserver");
        cluster_ctl_within("start", "kube-apiserver", APISERVER_READY_WITHIN);
        tokio::time::sleep(Duration::from_secs(20)).await;
        let idle = control_plane_load(&self.control_plane, Duration::from_secs(15)).await;
        let watches_before = watches(&apiserver_metrics(admin).await);
        eprintln!("fleet: run {run}, {}: starting {n} processes", side.label());
        let (mut members, start) = self.start_until_ready(side, run, &nodes).await;
        s.start = start;
        eprintln!("fleet: all {n} ready in {:.1} s", s.start.ready);
        if self.settings.only_start {
            drop(members);
            self.delete_nodes(admin, side, run).await;
            return s;
        }

        // Steady state: once every agent has released its start's pages
        // (60-120 s after it was ready, later if its calls were still shed:
        // footprint), so the window holds what an agent at rest does.
        if side == Side::Nodeguard && agents_release_pages() {
            let logs: Vec<&Path> = members.iter().map(|m| m.log.as_path()).collect();
            // Every 2 s: a thousand logs read at each look.
            let waited =
                wait_for_page_release(&logs, Duration::from_secs(600), Duration::from_secs(2))
                    .await;
            eprintln!(
                "fleet: every agent released its start's pages {:.0} s after all were ready",
                waited.as_secs_f64()
            );
        }
        tokio::time::sleep(Duration::from_secs(15)).await;
        let offset = audit_mark(&self.audit_log);
        let m0 = apiserver_metrics(admin).await;
        let pids: Vec<u32> = members.iter().map(|m| m.child.id()).collect();
        let member_cpu0: f64 = trees(&pids).into_iter().flatten().map(cpu_seconds).sum();
        let journal0 = self.journal.written();
        let t0 = Instant::now();
        let ((api_cpu, etcd_cpu), (api_rss, _)) =
            control_plane_load(&self.control_plane, self.settings.steady).await;
        let secs = t0.elapsed().as_secs_f64();
        s.steady_journal_per_min =
            self.journal.written_since(journal0, secs) as f64 / (secs / 60.0);
        let member_trees = trees(&pids);
        let member_cpu1: f64 = member_trees
            .iter()
            .flatten()
            .copied()
            .map(cpu_seconds)
            .sum();
        let m1 = apiserver_metrics(admin).await;
        let requests = audited(&self.audit_log, offset, &side.user());
        for r in &requests {
            *s.steady_rps.entry(r.kind()).or_default() += 1.0 / secs;
        }
        // The elected policy-status writer's Lease renewals are one
        // writer's per cluster, not a node's: in the by-resource rows.
        let writes = requests
            .iter()
            .filter(|r| is_write(&r.verb) && r.resource != "leases")
            .count() as f64;
        let heartbeats = secs / self.settings.heartbeat as f64;
        s.steady_writes_per_node_per_heartbeat = writes / n as f64 / heartbeats;
        let reads = requests.iter().filter(|r| !is_write(&r.verb)).count() as f64;
        s.steady_reads_per_node_per_min = reads / n as f64 / (secs / 60.0);
        s.apiserver_cpu = api_cpu - idle.0.0;
        s.etcd_cpu = etcd_cpu - idle.0.1;
        s.apiserver_rss = api_rss - idle.1.0;
        s.watches = watches(&m1).max(watches(&m0)) - watches_before;
        let rss: Vec<f64> = member_trees
            .iter()
            .map(|t| t.iter().map(|&p| status_mib(p, "VmRSS:")).sum())
            .collect();
        s.member_rss = median(rss);
        // Each process's smaps_rollup read once, for both figures.
        let rollups: Vec<Vec<Rollup>> = member_trees
            .iter()
            .map(|t| t.iter().map(|&p| rollup(p)).collect())
            .collect();
        s.member_private = median(
            rollups
                .iter()
                .map(|t| t.iter().map(|r| r.private).sum())
                .collect(),
        );
        s.fleet_pss = rollups.iter().flatten().map(|r| r.pss).sum();
        s.member_cpu = (member_cpu1 - member_cpu0) / secs * 100.0 / n as f64;
        eprintln!("fleet: steady: {s:?}");

        // A policy edit.
        if side == Side::Nodeguard {
            s.edit = Some(self.policy_edit(admin, run, &nodes).await);
        }

        // A rollout: all stopped, all started.
        let offset = audit_mark(&self.audit_log);
        let (cache0, etcd0) = list_counters(&apiserver_metrics(admin).await);
        for m in &members {
            // SAFETY: a signal to a child of ours.
            unsafe { libc::kill(m.child.id() as i32, libc::SIGTERM) };
        }
        for m in &mut members {
            let _ = m.child.wait();
        }
        drop(members);
        let (mut members, rollout) = self.start_until_ready(side, run, &nodes).await;
        s.rollout = rollout;
        let (cache1, etcd1) = list_counters(&apiserver_metrics(admin).await);
        let requests = audited(&self.audit_log, offset, &side.user());
        s.rollout_lists = requests.iter().filter(|r| r.verb == "list").count() as f64;
        s.rollout_cache_lists = cache1 - cache0;
        s.rollout_etcd_lists = etcd1 - etcd0;
        eprintln!(
            "fleet: rollout: ready in {:.1} s, {} LISTs ({} from the watch cache, {} to etcd, all clients)",
            s.rollout.ready, s.rollout_lists, s.rollout_cache_lists, s.rollout_etcd_lists
        );
        let journal0 = self.journal.written();
        let t0 = Instant::now();
        s.restart = self.restart(admin, side, run, &nodes).await;
        self.journal
            .written_since(journal0, t0.elapsed().as_secs_f64());
        for m in &mut members {
            if let Ok(Some(status)) = m.child.try_wait() {
                panic!(
                    "a {} process on port {} exited during the API server's restart ({status}); its log is under {}",
                    side.label(),
                    m.port,
                    self.work.display()
                );
            }
        }
        drop(members);
        self.delete_nodes(admin, side, run).await;
        s
    }

    /// Each fleet Node's conditions: (type, status) pairs, and each one's
    /// last heartbeat (seconds since the epoch).
    async fn conditions(
        &self,
        admin: &Client,
        side: Side,
        run: usize,
    ) -> BTreeMap<String, Vec<(String, String, f64)>> {
        let group = side.group(run);
        let list = Api::<Node>::all(admin.clone())
            .list(&ListParams::default().labels(&format!("{FLEET_LABEL}={group}")))
            .await
            .unwrap();
        list.items
            .into_iter()
            .map(|n| {
                let name = n.metadata.name.unwrap_or_default();
                let mut cs: Vec<(String, String, f64)> = n
                    .status
                    .and_then(|s| s.conditions)
                    .unwrap_or_default()
                    .into_iter()
                    // The kubelet's types, which the node lifecycle
                    // controller sets Unknown once on a Node whose kubelet
                    // never posted (these have none): no side's to keep.
                    .filter(|c| !KUBELET_CONDITIONS.contains(&c.type_.as_str()))
                    .map(|c| {
                        let beat = c
                            .last_heartbeat_time
                            .map_or(0.0, |t| t.0.as_millisecond() as f64 / 1000.0);
                        (c.type_, c.status, beat)
                    })
                    .collect();
                cs.sort_by(|a, b| a.0.cmp(&b.0));
                (name, cs)
            })
            .collect()
    }

    /// The API server stopped for `NODEGUARD_FLEET_OUTAGE_SECONDS` under the
    /// running fleet and started again: the fleet's requests from its start,
    /// LISTs that reached etcd, until the API server holds its watches
    /// again, until every Node's conditions are current, and any condition
    /// lost. Nothing else happens meanwhile (no edit), so both sides do the
    /// same: only what the restart makes them do.
    async fn restart(
        &self,
        admin: &Client,
        side: Side,
        run: usize,
        nodes: &[String],
    ) -> RestartSample {
        let before = self.conditions(admin, side, run).await;
        let with_conditions = before.values().filter(|c| !c.is_empty()).count();
        assert_eq!(
            with_conditions,
            nodes.len(),
            "every fleet Node has conditions before the API server stops"
        );
        let offset = audit_mark(&self.audit_log);
        // Conditions their process keeps: heartbeated within two
        // heartbeats. One it no longer keeps (a monitor that did not start)
        // is stale already, and no restart makes it current.
        let kept_since = epoch_now() - 2.0 * self.settings.heartbeat as f64;
        let kept = |node: &str, type_: &str| {
            before
                .get(node)
                .and_then(|cs| cs.iter().find(|c| c.0 == type_))
                .is_some_and(|c| c.2 >= kept_since)
        };
        let stale_before = before
            .values()
            .flatten()
            .filter(|c| c.2 < kept_since)
            .count() as f64;
        eprintln!(
            "fleet: run {run}, {}: stopping the API server for {} s",
            side.label(),
            self.settings.outage.as_secs()
        );
        cluster_ctl("stop", "kube-apiserver");
        tokio::time::sleep(self.settings.outage).await;
        let started = epoch_now();
        cluster_ctl_within("start", "kube-apiserver", APISERVER_READY_WITHIN);
        let ready = epoch_now();
        let mut r = RestartSample {
            apiserver_ready: ready - started,
            stale_before,
            ..RestartSample::default()
        };
        // Two looks at once from here: the Nodes' heartbeats, and the
        // counters at the end of the first minute.
        let current = async {
            loop {
                let now = self.conditions(admin, side, run).await;
                // Heartbeats have whole seconds.
                let behind: Vec<(String, String)> = now
                    .iter()
                    .flat_map(|(node, cs)| {
                        cs.iter()
                            .filter(|c| kept(node, &c.0) && c.2 < started.floor())
                            .map(move |c| (node.clone(), c.0.clone()))
                    })
                    .collect();
                if behind.is_empty() {
                    break (Some(epoch_now() - started), 0.0, now);
                }
                if epoch_now() - started > 300.0 {
                    eprintln!(
                        "fleet: restart: {} kept condition(s) with no heartbeat 300 s after the start: {behind:?}",
                        behind.len()
                    );
                    break (None, behind.len() as f64, now);
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        };
        let minute = started + 60.0;
        let counters = async {
            tokio::time::sleep(Duration::from_secs_f64(
                (minute + 3.0 - epoch_now()).max(0.0),
            ))
            .await;
            list_counters(&apiserver_metrics(admin).await)
        };
        let ((current, not_current, after), (cache, etcd)) = tokio::join!(current, counters);
        r.conditions_current = current;
        r.not_current = not_current;
        r.cache_lists = cache;
        r.etcd_lists = etcd;
        for (node, cs) in &before {
            let now = after.get(node).map(Vec::as_slice).unwrap_or_default();
            r.lost += cs
                .iter()
                .filter(|c| !now.iter().any(|n| n.0 == c.0 && n.1 == c.1))
                .count() as f64;
        }
        // The audit log to now: requests in the first minute; LISTs to
        // now (an agent in a long backoff may come later).
        let requests: Vec<Audited> = audited(&self.audit_log, offset, &side.user())
            .into_iter()
            .filter(|q| q.at >= started)
            .collect();
        let mut per_second: BTreeMap<i64, usize> = BTreeMap::new();
        for q in requests.iter().filter(|q| q.at < minute) {
            *per_second
                .entry((q.at - started).floor() as i64)
                .or_default() += 1;
        }
        r.requests_first_minute = per_second.values().sum::<usize>() as f64;
        r.peak_requests_per_s = per_second.values().copied().max().unwrap_or(0) as f64;
        r.throttled = requests.iter().filter(|q| q.code == 429).count() as f64;
        let lists: Vec<&Audited> = requests.iter().filter(|q| q.verb == "list").collect();
        r.lists = lists.len() as f64;
        r.last_list = lists.iter().map(|q| q.at - started).reduce(f64::max);
        let mut kinds: BTreeMap<String, usize> = BTreeMap::new();
        for q in &requests {
            *kinds
                .entry(format!("{} {} {}", q.verb, q.resource, q.code))
                .or_default() += 1;
        }
        eprintln!("fleet: restart: {r:?}; requests {kinds:?}; per second {per_second:?}");
        r
    }

    /// The shipped default policy, selecting this run's fleet, with one
    /// condition message set (an edit changes it).
    fn apply_policy(&self, run: usize, message: &str) {
        let out = Command::new(&self.nodeguard)
            .arg("default-policy")
            .output()
            .unwrap();
        assert!(out.status.success());
        let mut policy: serde_json::Value =
            serde_yaml_from(&String::from_utf8(out.stdout).unwrap());
        policy["metadata"]["name"] = serde_json::json!(POLICY);
        policy["spec"]["nodeSelector"] =
            serde_json::json!({"matchLabels": {FLEET_LABEL: Side::Nodeguard.group(run)}});
        let monitors = policy["spec"]["monitors"].as_array_mut().unwrap();
        if self.settings.without_journald {
            monitors.retain(|m| m["source"].get("journald").is_none());
        }
        if let Some(journal) = self.journal_dir(Side::Nodeguard, run) {
            for m in monitors.iter_mut() {
                if let Some(j) = m["source"].get_mut("journald") {
                    j["directory"] = journal.display().to_string().into();
                }
            }
        }
        monitors[0]["conditions"][0]["message"] = serde_json::json!(message);
        let path = self.work.join("policy.json");
        std::fs::write(&path, serde_json::to_vec(&policy).unwrap()).unwrap();
        kubectl(&[
            "apply",
            "--server-side",
            "--force-conflicts",
            "-f",
            path.to_str().unwrap(),
        ]);
    }

    async fn policy_edit(&self, admin: &Client, run: usize, nodes: &[String]) -> EditSample {
        let policies: Api<nodeguard::policy::NodeGuardPolicy> = Api::all(admin.clone());
        let before = policies
            .get(POLICY)
            .await
            .unwrap()
            .metadata
            .generation
            .unwrap();
        let offset = audit_mark(&self.audit_log);
        let t0 = Instant::now();
        let epoch0 = epoch_now();
        self.apply_policy(
            run,
            &format!("The kernel has no deadlock (edit of run {run})."),
        );
        let generation = policies
            .get(POLICY)
            .await
            .unwrap()
            .metadata
            .generation
            .unwrap();
        assert_eq!(generation, before + 1, "the edit made a new generation");
        let want = format!("{POLICY}@{generation}");
        let node_api: Api<Node> = Api::all(admin.clone());
        let group = Side::Nodeguard.group(run);
        let converged = loop {
            let list = node_api
                .list(&ListParams::default().labels(&format!("{FLEET_LABEL}={group}")))
                .await
                .unwrap();
            let shown = list
                .items
                .iter()
                .filter(|n| {
                    n.metadata
                        .annotations
                        .as_ref()
                        .and_then(|a| a.get(nodeguard::agent::EFFECTIVE_ANNOTATION))
                        .is_some_and(|v| v.split(',').any(|p| p == want))
                })
                .count();
            if shown == nodes.len() {
                break t0.elapsed().as_secs_f64();
            }
            assert!(
                t0.elapsed() < Duration::from_secs(120),
                "{shown} of {} nodes show {want} after 120 s",
                nodes.len()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        };
        // Writes still in flight, then the audit log.
        tokio::time::sleep(Duration::from_secs(5)).await;
        let writes: Vec<Audited> = audited(&self.audit_log, offset, &Side::Nodeguard.user())
            .into_iter()
            .filter(|r| is_write(&r.verb) && r.resource != "leases")
            .collect();
        let mut per_node: BTreeMap<&str, usize> = nodes.iter().map(|n| (n.as_str(), 0)).collect();
        let mut per_second: BTreeMap<i64, usize> = BTreeMap::new();
        for w in &writes {
            if let Some(c) = per_node.get_mut(w.name.as_str()) {
                *c += 1;
            }
            *per_second
                .entry((w.at - epoch0).floor() as i64)
                .or_default() += 1;
        }
        let first = writes.iter().map(|w| w.at).fold(f64::INFINITY, f64::min);
        let last = writes.iter().map(|w| w.at).fold(0.0, f64::max);
        let e = EditSample {
            writes_per_node_max: per_node.values().copied().max().unwrap_or(0) as f64,
            writes_per_node_mean: writes.len() as f64 / nodes.len() as f64,
            peak_writes_per_s: per_second.values().copied().max().unwrap_or(0) as f64,
            first_to_last: if writes.is_empty() { 0.0 } else { last - first },
            converged,
        };
        let mut kinds: BTreeMap<String, usize> = BTreeMap::new();
        for w in &writes {
            *kinds
                .entry(format!("{} {}", w.verb, w.resource))
                .or_default() += 1;
        }
        eprintln!("fleet: policy edit: {e:?}; writes {kinds:?}; per second {per_second:?}");
        e
    }
}

/// YAML to JSON through the API server's own parser would need a request;
/// `nodeguard default-policy` prints YAML that `kubectl` turns into JSON.
fn serde_yaml_from(yaml: &str) -> serde_json::Value {
    let dir = std::env::temp_dir().join(unique_name("fleet-policy"));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("p.yaml");
    std::fs::write(&path, yaml).unwrap();
    let json = kubectl(&[
        "create",
        "--dry-run=client",
        "-o",
        "json",
        "-f",
        path.to_str().unwrap(),
    ]);
    let _ = std::fs::remove_dir_all(&dir);
    serde_json::from_str(&json).unwrap()
}

/// A kubeconfig for service account `name` of the fleet namespace.
async fn account_kubeconfig(admin: &Client, name: &str, path: &Path) {
    let sas: Api<ServiceAccount> = Api::namespaced(admin.clone(), NS);
    let sa: ServiceAccount = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}
    }))
    .unwrap();
    sas.patch(
        name,
        &PatchParams::apply("nodeguard-bench").force(),
        &Patch::Apply(&sa),
    )
    .await
    .unwrap();
    let req = k8s_openapi::api::authentication::v1::TokenRequest {
        spec: k8s_openapi::api::authentication::v1::TokenRequestSpec {
            expiration_seconds: Some(86_400),
            ..Default::default()
        },
        ..Default::default()
    };
    let token = sas
        .create_token_request(name, &PostParams::default(), &req)
        .await
        .unwrap()
        .status
        .unwrap()
        .token;
    kubeconfig_with_token(&token, path);
}

async fn prepare_namespace(admin: &Client) {
    let ns: Namespace = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}
    }))
    .unwrap();
    Api::<Namespace>::all(admin.clone())
        .patch(
            NS,
            &PatchParams::apply("nodeguard-bench").force(),
            &Patch::Apply(&ns),
        )
        .await
        .unwrap();
    let crb: ClusterRoleBinding = serde_json::from_value(serde_json::json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": "nodeguard-fleet-bench"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
        "subjects": [{"kind": "Group", "name": format!("system:serviceaccounts:{NS}"), "apiGroup": "rbac.authorization.k8s.io"}],
    }))
    .unwrap();
    Api::<ClusterRoleBinding>::all(admin.clone())
        .patch(
            "nodeguard-fleet-bench",
            &PatchParams::apply("nodeguard-bench").force(),
            &Patch::Apply(&crb),
        )
        .await
        .unwrap();
    // Pods need the namespace's default service account.
    let sas: Api<ServiceAccount> = Api::namespaced(admin.clone(), NS);
    let t0 = Instant::now();
    while sas.get_opt("default").await.unwrap().is_none() {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no default service account in {NS}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The fleet's journald readers take an inotify instance each.
fn raise_inotify_instances(need: u64) {
    let path = "/proc/sys/fs/inotify/max_user_instances";
    let now: u64 = std::fs::read_to_string(path)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    if now < need {
        std::fs::write(path, need.to_string()).unwrap_or_else(|e| {
            panic!("cannot raise {path} from {now} to {need} (run as root): {e}")
        });
        eprintln!("fleet: {path} raised from {now} to {need} for the co-located fleet");
    }
}

fn main() {
    let runs: usize = env_or("NODEGUARD_BENCH_RUNS", 3);
    let settings = Settings {
        agents: env_or("NODEGUARD_FLEET_AGENTS", 200),
        pods: env_or("NODEGUARD_FLEET_PODS", 30),
        steady: Duration::from_secs(env_or("NODEGUARD_FLEET_STEADY_SECONDS", 120)),
        heartbeat: env_or("NODEGUARD_FLEET_HEARTBEAT_SECONDS", 60),
        outage: Duration::from_secs(env_or("NODEGUARD_FLEET_OUTAGE_SECONDS", 30)),
        only_start: env_or("NODEGUARD_FLEET_ONLY_START", 0) == 1,
        without_journald: env_or("NODEGUARD_FLEET_WITHOUT_JOURNALD", 0) == 1,
        journal_every: Duration::from_millis(env_or("NODEGUARD_FLEET_JOURNAL_MS", 500)),
    };
    let journal_every = settings.journal_every;
    let baseline = baseline(&settings, runs);
    let repo = repo_root();
    let policy = kubeconfig_path().with_file_name("audit-policy.yaml");
    assert!(
        std::fs::read_to_string(&policy)
            .unwrap_or_default()
            .contains(NS),
        "the running control plane's audit policy ({}) does not log the fleet's requests: restart it (e2e/cluster/down; e2e/cluster/up)",
        policy.display()
    );
    let npd_dir = npd_build_dir();
    raise_inotify_instances(settings.agents as u64 * 4 + 256);
    let work = repo.join("target/bench/fleet");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let samples: Vec<(Side, Sample)> = rt.block_on(async {
        let admin = admin_client().await;
        install_crd(&admin).await;
        prepare_namespace(&admin).await;
        let mut kubeconfigs = BTreeMap::new();
        for side in [Side::Nodeguard, Side::Npd] {
            let path = work.join(format!("{}.kubeconfig", side.account()));
            account_kubeconfig(&admin, side.account(), &path).await;
            kubeconfigs.insert(side.account(), path);
        }
        serve_node_health().await;
        let control_plane = ControlPlane::find();
        let fleet = Fleet {
            settings,
            nodeguard: shipped_binary(&repo),
            npd_dir,
            npd_configs: npd_configs(),
            work: work.clone(),
            audit_log: kubeconfig_path().with_file_name("logs").join("audit.log"),
            kubeconfigs,
            control_plane,
            journal: journal_writer(journal_every),
        };
        // A run that panicked leaves nothing behind: 200 Nodes without a
        // kubelet would make every DaemonSet of the test suite wait on
        // them (a rolling update counts their pending pods unavailable).
        delete_fleet(&admin).await;
        let runs_all = async {
            let mut samples = Vec::new();
            for run in 1..=runs {
                let order = if run % 2 == 1 {
                    [Side::Nodeguard, Side::Npd]
                } else {
                    [Side::Npd, Side::Nodeguard]
                };
                for side in order {
                    let s = fleet.run_side(&admin, side, run).await;
                    samples.push((side, s));
                }
            }
            samples
        };
        let samples = match std::panic::AssertUnwindSafe(runs_all).catch_unwind().await {
            Ok(samples) => samples,
            Err(panic) => {
                eprintln!("fleet: the bench failed; deleting the fleet's Nodes and pods");
                delete_fleet(&admin).await;
                std::panic::resume_unwind(panic)
            }
        };
        delete_fleet(&admin).await;
        let _ = kubectl_status(&["delete", "--ignore-not-found", "nodeguardpolicy", POLICY]);
        report(&fleet, runs, &samples, baseline);
        samples
    });
    drop(samples);
}

/// Every fleet Node and pod, whichever run made them.
async fn delete_fleet(admin: &Client) {
    delete_until_gone(admin, FLEET_LABEL).await;
}

/// Deletes the fleet's pods and Nodes that `selector` selects until none is
/// left: one delete of 30,000 pods can end (its deadline) before all are
/// gone, and the next side creates the same names.
async fn delete_until_gone(admin: &Client, selector: &str) {
    let lp = ListParams::default().labels(selector);
    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    let pods = Api::<Pod>::namespaced(admin.clone(), NS);
    let nodes = Api::<Node>::all(admin.clone());
    let t0 = Instant::now();
    loop {
        let _ = pods.delete_collection(&now, &lp).await;
        let _ = nodes.delete_collection(&DeleteParams::default(), &lp).await;
        let one = lp.clone().limit(1);
        let left = match (
            pods.list_metadata(&one).await,
            nodes.list_metadata(&one).await,
        ) {
            (Ok(p), Ok(n)) => p.items.len() + n.items.len(),
            _ => 1,
        };
        if left == 0 {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(300),
            "the fleet's Nodes and pods ({selector}) are still there after 300 s"
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

fn report(fleet: &Fleet, runs: usize, samples: &[(Side, Sample)], baseline: Option<Baseline>) {
    let st = &fleet.settings;
    let n = st.agents as f64;
    let col = |side: Side, f: &dyn Fn(&Sample) -> Option<f64>| -> Option<f64> {
        let v: Vec<f64> = samples
            .iter()
            .filter(|(s, _)| *s == side)
            .filter_map(|(_, s)| f(s))
            .collect();
        (!v.is_empty()).then(|| median(v))
    };
    let cell = |v: Option<f64>, digits: usize| match v {
        Some(v) => format!("{v:.digits$}"),
        None => "—".to_string(),
    };
    // Every row printed, for the comparison with a baseline of another size.
    let printed: std::cell::RefCell<Vec<Printed>> = Default::default();
    let put = |name: &str, f: &dyn Fn(&Sample) -> Option<f64>, digits: usize, scale| {
        let (ng, npd) = (col(Side::Nodeguard, f), col(Side::Npd, f));
        println!("| {name} | {} | {} |", cell(ng, digits), cell(npd, digits));
        printed.borrow_mut().push(Printed {
            name: name.to_string(),
            values: [ng, npd],
            scale,
        });
    };
    // A figure of one agent, one node or one moment.
    let row = |name: &str, f: &dyn Fn(&Sample) -> Option<f64>, digits: usize| {
        put(name, f, digits, Scale::Each)
    };
    // A figure of the whole fleet: per node when compared across sizes.
    let total = |name: &str, f: &dyn Fn(&Sample) -> Option<f64>, digits: usize| {
        put(name, f, digits, Scale::Fleet)
    };
    // A figure of every client of the API server, the control plane's own
    // among them: compared whole.
    let cluster = |name: &str, f: &dyn Fn(&Sample) -> Option<f64>, digits: usize| {
        put(name, f, digits, Scale::Cluster)
    };
    // Where a start's time went: the same rows for the first start and the
    // rollout.
    let start_rows = |phase: &str| {
        let pick: fn(&Sample) -> &StartSample = if phase == "startup" {
            |s| &s.start
        } else {
            |s| &s.rollout
        };
        let rows: [StartRow; 15] = [
            (
                "of which starting the processes, one after another (s)",
                |t| t.spawn,
                1,
                Scale::Fleet,
            ),
            (
                "the host's cores × that time, less what the hypervisor took (core-seconds there were)",
                |t| t.host_capacity,
                1,
                Scale::Fleet,
            ),
            (
                "the host's busy CPU meanwhile, every process (core-seconds)",
                |t| t.host_busy,
                1,
                Scale::Fleet,
            ),
            (
                "of which the processes started, with their children (alive and reaped; core-seconds)",
                |t| t.fleet_cpu,
                1,
                Scale::Fleet,
            ),
            (
                "likewise, one process, median (ms)",
                |t| t.agent_cpu_ms,
                0,
                Scale::Each,
            ),
            (
                "of which the API server (core-seconds)",
                |t| t.apiserver_cpu,
                1,
                Scale::Fleet,
            ),
            (
                "of which etcd (core-seconds)",
                |t| t.etcd_cpu,
                1,
                Scale::Fleet,
            ),
            (
                "of which the controller-manager and the scheduler (core-seconds)",
                |t| t.controllers_cpu,
                1,
                Scale::Fleet,
            ),
            (
                "of which the bench itself: starting the processes, asking each if it is ready, writing the journal (core-seconds)",
                |t| t.bench_cpu,
                1,
                Scale::Fleet,
            ),
            (
                "of which the rest: other processes, processes gone unreaped (core-seconds)",
                |t| t.rest_cpu,
                1,
                Scale::Fleet,
            ),
            (
                "of the busy CPU, serving interrupts (core-seconds; this kernel also counts it in the processes above)",
                |t| t.interrupts,
                1,
                Scale::Fleet,
            ),
            (
                "the side's requests received until all were ready, per process",
                |t| t.requests_per_agent,
                1,
                Scale::Each,
            ),
            (
                "of those answered 429, whole fleet",
                |t| t.throttled,
                0,
                Scale::Fleet,
            ),
            (
                "the API server's time to answer the rest (watches left out), median (s)",
                |t| t.answer_p50,
                3,
                Scale::Each,
            ),
            (
                "likewise, 99th percentile (s)",
                |t| t.answer_p99,
                2,
                Scale::Each,
            ),
        ];
        for (name, f, digits, scale) in rows {
            put(
                &format!("{phase}: {name}"),
                &move |s| Some(f(pick(s))),
                digits,
                scale,
            );
        }
        let mut kinds: Vec<String> = samples
            .iter()
            .flat_map(|(_, s)| pick(s).by_kind.keys().cloned())
            .collect();
        kinds.sort();
        kinds.dedup();
        for k in kinds {
            let scale = Scale::of_kind(&k);
            put(
                &format!("{phase}: of the requests, `{k}`, whole fleet"),
                &move |s| Some(pick(s).by_kind.get(&k).copied().unwrap_or(0.0)),
                0,
                scale,
            );
        }
        if !st.journal_every.is_zero() {
            put(
                &format!("{phase}: entries the bench wrote to the side's journal meanwhile"),
                &move |s| Some(pick(s).journal_entries),
                0,
                Scale::Each,
            );
        }
    };
    let caption = caption(st, runs);
    println!("\n{caption}\n");
    if st.only_start {
        println!(
            "(NODEGUARD_FLEET_ONLY_START=1: the start only, all processes started at once against a freshly started API server; no steady window.)\n"
        );
    }
    if st.without_journald {
        println!(
            "(NODEGUARD_FLEET_WITHOUT_JOURNALD=1: nodeguard's policy without its two journald monitors, so without their journalctl children and their four conditions; node-problem-detector with its own: not the same work.)\n"
        );
    }
    println!("| figure | nodeguard | node-problem-detector |\n|---|---:|---:|");
    row(
        "startup: all started at once, until every one is ready (s)",
        &|s| Some(s.start.ready),
        1,
    );
    start_rows("startup");
    if st.only_start {
        return;
    }
    let mut keys: Vec<String> = samples
        .iter()
        .flat_map(|(_, s)| s.steady_rps.keys().cloned())
        .collect();
    keys.sort();
    keys.dedup();
    for k in &keys {
        let k2 = k.clone();
        let scale = Scale::of_kind(k);
        put(
            &format!("steady: `{k}` per second, whole fleet"),
            &move |s| Some(s.steady_rps.get(&k2).copied().unwrap_or(0.0)),
            2,
            scale,
        );
    }
    total(
        "steady: all requests per second, whole fleet",
        &|s| Some(s.steady_rps.values().fold(0.0, |a, b| a + b)),
        2,
    );
    row(
        "steady: writes per node per heartbeat",
        &|s| Some(s.steady_writes_per_node_per_heartbeat),
        2,
    );
    row(
        "steady: reads and watches per node per minute",
        &|s| Some(s.steady_reads_per_node_per_min),
        2,
    );
    if !st.journal_every.is_zero() {
        row(
            "steady: entries the bench wrote to the side's journal per minute",
            &|s| Some(s.steady_journal_per_min),
            0,
        );
    }
    total(
        "steady: watches the fleet holds open at the API server",
        &|s| Some(s.watches),
        0,
    );
    total(
        "steady: API server CPU above idle (% of one core)",
        &|s| Some(s.apiserver_cpu),
        1,
    );
    total(
        "steady: etcd CPU above idle (% of one core)",
        &|s| Some(s.etcd_cpu),
        1,
    );
    total(
        "steady: API server RSS above idle (MiB)",
        &|s| Some(s.apiserver_rss),
        0,
    );
    row(
        "steady: one agent's RSS, median (MiB, with children)",
        &|s| Some(s.member_rss),
        1,
    );
    row(
        "steady: one agent's private memory, median (MiB, with children; what one more agent costs the host)",
        &|s| Some(s.member_private),
        1,
    );
    total(
        "steady: the whole fleet's PSS (MiB; what it costs the host, shared pages counted once)",
        &|s| Some(s.fleet_pss),
        0,
    );
    row(
        "steady: one agent's CPU (% of one core)",
        &|s| Some(s.member_cpu),
        2,
    );
    row(
        "policy edit: writes per node, most on one node",
        &|s| s.edit.as_ref().map(|e| e.writes_per_node_max),
        0,
    );
    row(
        "policy edit: writes per node, mean",
        &|s| s.edit.as_ref().map(|e| e.writes_per_node_mean),
        2,
    );
    total(
        "policy edit: peak writes per second at the API server",
        &|s| s.edit.as_ref().map(|e| e.peak_writes_per_s),
        0,
    );
    row(
        "policy edit: first to last write (s)",
        &|s| s.edit.as_ref().map(|e| e.first_to_last),
        1,
    );
    row(
        "policy edit: until every Node shows the new generation (s)",
        &|s| s.edit.as_ref().map(|e| e.converged),
        1,
    );
    total(
        "rollout: LIST requests from the fleet",
        &|s| Some(s.rollout_lists),
        0,
    );
    cluster(
        "rollout: LISTs of pods, nodes, policies served from the watch cache (all clients)",
        &|s| Some(s.rollout_cache_lists),
        0,
    );
    cluster(
        "rollout: LISTs of pods, nodes, policies sent to etcd (all clients)",
        &|s| Some(s.rollout_etcd_lists),
        0,
    );
    row(
        "rollout: until every one is ready again (s)",
        &|s| Some(s.rollout.ready),
        1,
    );
    start_rows("rollout");
    let out = st.outage.as_secs();
    row(
        &format!("restart (API server away {out} s): from its start until it is ready (s)"),
        &|s| Some(s.restart.apiserver_ready),
        1,
    );
    total(
        "restart: the fleet's requests in the first minute from the API server's start",
        &|s| Some(s.restart.requests_first_minute),
        0,
    );
    total(
        "restart: the fleet's requests, the most in one second",
        &|s| Some(s.restart.peak_requests_per_s),
        0,
    );
    total(
        "restart: the fleet's requests answered 429 (from the start until the measures end, at least 63 s)",
        &|s| Some(s.restart.throttled),
        0,
    );
    total(
        "restart: LIST requests from the fleet (likewise)",
        &|s| Some(s.restart.lists),
        0,
    );
    row(
        "restart: from the API server's start until the fleet's last LIST (s)",
        &|s| s.restart.last_list,
        1,
    );
    cluster(
        "restart: LISTs of pods, nodes, policies served from the watch cache in the first 63 s (all clients)",
        &|s| Some(s.restart.cache_lists),
        0,
    );
    cluster(
        "restart: LISTs of pods, nodes, policies sent to etcd in the first 63 s (all clients, the API server's own watch caches included)",
        &|s| Some(s.restart.etcd_lists),
        0,
    );
    row(
        "restart: until every Node's kept conditions carry a heartbeat from after the start (s; both heartbeat every minute; — when not all within 300 s)",
        &|s| s.restart.conditions_current,
        1,
    );
    total(
        "restart: conditions still without a heartbeat from after the start 300 s after it, whole fleet",
        &|s| Some(s.restart.not_current),
        0,
    );
    total(
        "restart: conditions already two heartbeats stale before the stop (left out above), whole fleet",
        &|s| Some(s.restart.stale_before),
        0,
    );
    total(
        "restart: conditions lost or changed, whole fleet",
        &|s| Some(s.restart.lost),
        0,
    );

    // The projection.
    let per_node = |side: Side, f: &dyn Fn(&Sample) -> Option<f64>| col(side, f).map(|v| v / n);
    println!(
        "\n**Projected to 5,000 nodes** from the per-node figures above (a projection: request rates scale with nodes; the API server's CPU and memory do not scale linearly and are not projected)\n"
    );
    println!("| figure | nodeguard | node-problem-detector |\n|---|---:|---:|");
    let proj = |name: &str, f: &dyn Fn(&Sample) -> Option<f64>, digits: usize| {
        println!(
            "| {name} | {} | {} |",
            cell(per_node(Side::Nodeguard, f).map(|v| v * 5000.0), digits),
            cell(per_node(Side::Npd, f).map(|v| v * 5000.0), digits)
        );
    };
    proj(
        "steady: requests per second",
        &|s| Some(s.steady_rps.values().fold(0.0, |a, b| a + b)),
        0,
    );
    proj(
        "steady: writes per second",
        &|s| {
            Some(
                s.steady_rps
                    .iter()
                    .filter(|(k, _)| is_write(k.split(' ').next().unwrap_or("")))
                    .map(|(_, v)| v)
                    .fold(0.0, |a, b| a + b),
            )
        },
        0,
    );
    proj("steady: watches open", &|s| Some(s.watches), 0);
    proj(
        "policy edit: writes",
        &|s| s.edit.as_ref().map(|e| e.writes_per_node_mean * n),
        0,
    );
    let spread = col(Side::Nodeguard, &|s| {
        s.edit.as_ref().map(|e| e.first_to_last)
    });
    let writes = per_node(Side::Nodeguard, &|s| {
        s.edit.as_ref().map(|e| e.writes_per_node_mean * n)
    });
    println!(
        "| policy edit: writes per second, spread as measured | {} | — |",
        cell(writes.zip(spread).map(|(w, s)| w * 5000.0 / s.max(1.0)), 0)
    );
    proj("rollout: LIST requests", &|s| Some(s.rollout_lists), 0);

    if let Some(baseline) = baseline {
        compare(&baseline, st.agents, &printed.into_inner());
    }
}

/// The table's caption: what was run, with which settings.
fn caption(st: &Settings, runs: usize) -> String {
    format!(
        "A fleet of {} agents, each its own Node with {} pods, against one API server (real kube-apiserver, etcd, kube-controller-manager); \
         nodeguard with its shipped default policy beside node-problem-detector with its kernel, docker and systemd monitors; \
         condition heartbeat {} s on both;{}{} median of {runs} runs",
        st.agents,
        st.pods,
        st.heartbeat,
        // Nothing with the host's journal: the caption of the sections
        // measured before the bench wrote one.
        if st.journal_every.is_zero() {
            String::new()
        } else {
            format!(
                " each side's journald monitors reading one journal, a node's as journald writes it, with an entry of this boot every {} ms that no rule matches;",
                st.journal_every.as_millis()
            )
        },
        if st.only_start {
            String::new()
        } else {
            format!(" steady window {} s;", st.steady.as_secs())
        }
    )
}

/// The baseline named by `NODEGUARD_FLEET_BASELINE`, checked to have been
/// measured with this run's settings but the size (pods, heartbeat,
/// journal, steady window; the number of runs aside) before any run, not
/// after an hour of them.
fn baseline(st: &Settings, runs: usize) -> Option<Baseline> {
    let path = std::env::var("NODEGUARD_FLEET_BASELINE").ok()?;
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("NODEGUARD_FLEET_BASELINE {path}: {e}"));
    let baseline = Baseline::parse(&text)
        .unwrap_or_else(|| panic!("NODEGUARD_FLEET_BASELINE {path}: no fleet table in it"));
    let settings = |c: &str| c.split("; median of").next().unwrap_or("").to_string();
    let caption = caption(st, runs);
    assert_eq!(
        settings(&baseline.settings),
        settings(caption.split_once(" with ").map_or("", |c| c.1)),
        "NODEGUARD_FLEET_BASELINE {path}: measured with other settings than this run"
    );
    Some(baseline)
}

/// A row of the start's figures: its name, its figure, its digits, how it
/// compares across fleet sizes.
type StartRow = (&'static str, fn(&StartSample) -> f64, usize, Scale);

/// How a figure compares across fleet sizes.
#[derive(Clone, Copy, PartialEq)]
enum Scale {
    /// One agent's, one node's or one moment's: as it is.
    Each,
    /// The whole fleet's: per node.
    Fleet,
    /// Every client's, the control plane's own among them, or one
    /// cluster-wide writer's: as it is (it grows with the fleet only in
    /// part, if at all).
    Cluster,
}

impl Scale {
    /// How the requests of kind `k` ([`Audited::kind`]) compare.
    fn of_kind(k: &str) -> Scale {
        // The elected policy-status writer's (its status patches, its
        // Lease's renewals): one per cluster, whatever the fleet's size. So
        // are the Lease's create or takeover races, and the GETs answered
        // 404 that lead to its creates: as many as the agents that looked
        // before one won, not one a node.
        if k.starts_with("patch nodeguardpolicies")
            || k.starts_with("create leases")
            || k.starts_with("update leases")
            || k == "get leases answered 404"
        {
            Scale::Cluster
        } else {
            Scale::Fleet
        }
    }
}

/// The request kind a by-kind row (a start's, a rollout's or the steady
/// window's) counts: what is between its backquotes.
fn row_kind(name: &str) -> Option<&str> {
    let (_, rest) = name.split_once('`')?;
    rest.split_once('`').map(|(k, _)| k)
}

/// A row of the table as printed, medians of both sides.
struct Printed {
    name: String,
    values: [Option<f64>; 2],
    scale: Scale,
}

/// The table of an earlier run of this bench at another size, as
/// `bench/run` keeps it in bench/RESULTS.md.
struct Baseline {
    agents: usize,
    /// Its caption from " with ": pods, heartbeat, steady window, runs.
    settings: String,
    /// What follows the `#` of its command line: settings, commit.
    command: String,
    rows: BTreeMap<String, [Option<f64>; 2]>,
}

impl Baseline {
    fn parse(markdown: &str) -> Option<Baseline> {
        let command = markdown
            .lines()
            .find(|l| l.contains("cargo bench --bench fleet"))?
            .split_once('#')?
            .1
            .trim()
            .to_string();
        let caption = markdown.lines().find(|l| l.starts_with("A fleet of "))?;
        let agents = caption
            .strip_prefix("A fleet of ")?
            .split_whitespace()
            .next()?
            .replace(',', "")
            .parse()
            .ok()?;
        let settings = caption.split_once(" with ")?.1.to_string();
        let mut rows = BTreeMap::new();
        let table = markdown
            .lines()
            .skip_while(|l| !l.starts_with("A fleet of "))
            .skip_while(|l| *l != "| figure | nodeguard | node-problem-detector |")
            .skip(2)
            .take_while(|l| l.starts_with("| "));
        for line in table {
            let cells: Vec<&str> = line.trim_matches('|').split(" | ").map(str::trim).collect();
            if let [name, ng, npd] = cells[..] {
                rows.insert(name.to_string(), [ng.parse().ok(), npd.parse().ok()]);
            }
        }
        (!rows.is_empty()).then_some(Baseline {
            agents,
            settings,
            command,
            rows,
        })
    }
}

/// Three significant digits, for per-node figures that range from
/// thousandths to hundreds.
fn significant(v: f64) -> String {
    if v == 0.0 {
        return "0".to_string();
    }
    let digits = (2 - v.abs().log10().floor() as i32).max(0) as usize;
    format!("{v:.digits$}")
}

/// Each figure at this size beside the baseline's, per node where it is the
/// whole fleet's, and their ratio: whether the per-node figures (and so the
/// projection) hold from the baseline's size to this one.
fn compare(baseline: &Baseline, agents: usize, rows: &[Printed]) {
    let (b, n) = (baseline.agents, agents);
    println!(
        "\n**{n} agents against {b}**: each figure of the table above beside the same figure of the {b}-agent table \
         (its command line: `{}`), per node where it is the whole fleet's; rows of every client of the API server \
         (the control plane's own requests among them) and of the one policy-status writer are compared whole. \
         The ratio is {n}'s over {b}'s: 1.00 where a per-node figure holds, and so the projection; \
         \"new\" where the {b}-agent figure was 0 (a kind of request or answer seen at one size only is 0 at the other). The {b}-agent figures are read as that table prints them, \
         rounded: a ratio of a figure printed with one or two significant digits is good to about ±10 %.\n",
        baseline.command
    );
    println!(
        "| figure | nodeguard at {b} | at {n} | ratio | node-problem-detector at {b} | at {n} | ratio |\n|---|---:|---:|---:|---:|---:|---:|"
    );
    // A request kind counted at one size only (429s, say, at the larger)
    // is a count of 0 at the other, compared as such: the answers that
    // grow with the fleet are what the comparison is for. The baseline's
    // other rows this run lacks are listed by name below.
    let (mut missing, mut only_there) = (Vec::new(), Vec::new());
    for k in baseline.rows.keys() {
        if rows.iter().any(|r| &r.name == k) {
            continue;
        }
        match row_kind(k) {
            Some(kind) => missing.push(Printed {
                name: k.clone(),
                values: [Some(0.0); 2],
                scale: Scale::of_kind(kind),
            }),
            None => only_there.push(k.as_str()),
        }
    }
    let mut only_here = Vec::new();
    for row in rows.iter().chain(&missing) {
        let none_then = [Some(0.0); 2];
        let old = match baseline.rows.get(&row.name) {
            Some(old) => old,
            None if row_kind(&row.name).is_some() => &none_then,
            None => {
                only_here.push(row.name.as_str());
                continue;
            }
        };
        let scale = |v: Option<f64>, nodes: usize| {
            v.map(|v| {
                if row.scale == Scale::Fleet {
                    v / nodes as f64
                } else {
                    v
                }
            })
        };
        let mut cells = Vec::new();
        for (then, now) in old.iter().zip(row.values) {
            let (then, now) = (scale(*then, b), scale(now, n));
            cells.push(then.map_or("—".into(), significant));
            cells.push(now.map_or("—".into(), significant));
            cells.push(match (then, now) {
                (Some(t), Some(v)) if t > 0.0 && v >= 0.0 => format!("{:.2}", v / t),
                (Some(t), Some(v)) if t == 0.0 && v > 0.0 => "new".into(),
                _ => "—".into(),
            });
        }
        let name = if row.scale == Scale::Fleet {
            format!("{}, per node", row.name.replace(", whole fleet", ""))
        } else {
            row.name.clone()
        };
        println!("| {name} | {} |", cells.join(" | "));
    }
    let quoted = |names: &[&str]| {
        names
            .iter()
            .map(|m| format!("“{m}”"))
            .collect::<Vec<_>>()
            .join("; ")
    };
    if !only_here.is_empty() {
        println!("\nOnly in the table above: {}.", quoted(&only_here));
    }
    if !only_there.is_empty() {
        println!("\nOnly in the {b}-agent table: {}.", quoted(&only_there));
    }
}
