//! Command-line interface.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::policy::NodeTrust;

/// nodeguard keeps a Kubernetes node honest with its cluster: probes,
/// graceful shutdown through systemd-logind, the host watchdog, problem
/// detection, and NodeConditions and Events you read in `kubectl describe node`.
#[derive(Debug, Parser)]
#[command(name = "nodeguard", version, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the agent for one node (as a DaemonSet pod or a host service).
    Run(Box<RunArgs>),
    /// Print the NodeGuardPolicy CustomResourceDefinition generated from the code.
    Crd,
    /// Validate policy files offline, with the same rules the agent applies.
    ///
    /// Prints every problem with its field path; exits 1 when there is any.
    Check {
        /// Policy files (YAML, one or more documents each); `-` reads stdin.
        #[arg(short = 'f', long = "filename", required = true, num_args = 1..)]
        files: Vec<PathBuf>,
        /// Also run the valid policies' log monitors over this log and print
        /// what they would have done, line by line (journalctl -o json,
        /// /dev/kmsg records, syslog or dmesg lines, plain text). Exit 0 when
        /// a rule fired, 1 when none did.
        #[arg(long)]
        replay: Option<PathBuf>,
        /// The year of syslog time stamps, which carry none (default: this year).
        #[arg(long, requires = "replay")]
        year: Option<i16>,
    },
    /// Convert node-problem-detector monitor configs (JSON) into a
    /// NodeGuardPolicy printed as YAML; what cannot be expressed is listed
    /// on stderr.
    ImportNpd {
        /// NPD monitor configs (system-log-monitor, custom-plugin-monitor).
        #[arg(required = true, num_args = 1..)]
        files: Vec<PathBuf>,
        /// metadata.name of the policy.
        #[arg(long, default_value = "imported-npd")]
        name: String,
    },
    /// One node at a glance: nodeguard's conditions, the policies in force,
    /// the taints they may add, the last Events, shutdown readiness, the
    /// watchdog and the agent's pod. Also a kubectl plugin: install the
    /// binary (or a link to it) as `kubectl-nodeguard` and run
    /// `kubectl nodeguard status NODE`.
    Status {
        /// The Node's name.
        node: String,
        /// table or json.
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Table)]
        output: Output,
        /// How many of the newest Events to show.
        #[arg(long, default_value_t = 10)]
        events: usize,
        /// Kubeconfig to use (default: KUBECONFIG, which may list several
        /// files, then ~/.kube/config).
        #[arg(long)]
        kubeconfig: Option<PathBuf>,
    },
    /// Hold descriptors for the agent beyond its process: the DaemonSet's
    /// sidecar. The agent leaves a copy of logind's delay inhibitor here, so
    /// that an agent killed during a shutdown does not let the host go down
    /// before the remaining priority groups ran; the restarted agent takes
    /// it back. Runs until killed; its descriptors close with it.
    Keep {
        /// The Unix socket to serve (a volume shared with the agent).
        #[arg(
            long,
            env = "NODEGUARD_INHIBITOR_KEEPER",
            default_value = "/run/nodeguard/keep.sock"
        )]
        socket: PathBuf,
        #[command(flatten)]
        log: LogArgs,
    },
    /// The handover unit's process (run by systemd from the copy the
    /// stopping agent left in its state directory; see
    /// `--host-state-dir`): holds a delay inhibitor for shutdown until the
    /// next agent stops it or `--seconds` pass, and records when a shutdown
    /// that begins meanwhile began.
    #[command(hide = true)]
    HandoverHold {
        /// The state directory (as the host sees it).
        #[arg(long)]
        state_dir: PathBuf,
        /// The longest it holds the lock.
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..=3600))]
        seconds: u64,
        /// logind's `why` for the lock.
        #[arg(long, default_value = "nodeguard: between two agent pods")]
        why: String,
        #[command(flatten)]
        log: LogArgs,
    },
    /// Ask every agent of a release to remove what it put on its node, and
    /// wait until each running one has (the chart's pre-delete hook, run by
    /// `helm uninstall`). A node whose agent did not answer in time, or
    /// left something behind, gets a Warning Event `NodeguardNotRetired`
    /// saying what; with `--strict` the command then exits 1 (failing the
    /// uninstall), otherwise 0.
    Retire {
        /// The release's namespace.
        #[arg(long, env = "POD_NAMESPACE")]
        namespace: String,
        /// Label selector of the release's agent pods.
        #[arg(long)]
        selector: String,
        /// How long to wait for the agents.
        #[arg(long, default_value_t = 120)]
        timeout_seconds: u64,
        /// Exit 1 when a node is left with anything of nodeguard's.
        #[arg(long)]
        strict: bool,
        /// Kubeconfig to use (default: the in-cluster service account).
        #[arg(long, env = "KUBECONFIG")]
        kubeconfig: Option<PathBuf>,
    },
    /// Print the default policy shipped with the chart (NPD's standard
    /// monitors, kubelet and kube-proxy probes, kubelet-like shutdown).
    DefaultPolicy,
    /// Print the version, git commit and compiler.
    Version,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Name of the Node this agent guards. In a DaemonSet, set NODE_NAME from
    /// the downward API (spec.nodeName).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,

    /// Kubeconfig to use. Without it: the in-cluster service account, then
    /// the default kubeconfig.
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    /// Address of the HTTP server for /healthz, /livez, /readyz and /metrics.
    #[arg(long, env = "NODEGUARD_LISTEN", default_value = "0.0.0.0:9909")]
    pub listen: SocketAddr,

    /// Directory for state that must survive restarts (shutdown records,
    /// problem state). A hostPath in the DaemonSet.
    #[arg(
        long,
        env = "NODEGUARD_STATE_DIR",
        default_value = "/var/lib/nodeguard"
    )]
    pub state_dir: PathBuf,

    /// Re-write nodeguard's NodeConditions at least this often (their
    /// lastHeartbeatTime), so a stale agent is visible on the Node.
    #[arg(long, env = "NODEGUARD_CONDITION_HEARTBEAT_SECONDS", default_value_t = 300,
          value_parser = clap::value_parser!(u64).range(10..=86400))]
    pub condition_heartbeat_seconds: u64,

    /// After a policy edit, each node writes its status (the policy
    /// condition, new conditions, the effective-policies annotation) at its
    /// own point in this window, fixed by its name, so a fleet's writes
    /// spread over it instead of reaching the API server at once. A problem
    /// found meanwhile is written at once. 0: no wait.
    #[arg(long, env = "NODEGUARD_POLICY_WRITE_SPREAD_SECONDS", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(0..=300))]
    pub policy_write_spread_seconds: u64,

    /// The socket of `nodeguard keep`, which holds a copy of logind's delay
    /// inhibitor so that a killed agent does not release it (the chart's
    /// sidecar). Without it, a host service keeps the copy in systemd's
    /// file descriptor store (the unit's FileDescriptorStoreMax=).
    #[arg(long, env = "NODEGUARD_INHIBITOR_KEEPER")]
    pub inhibitor_keeper: Option<PathBuf>,

    /// On a stop that is not an uninstall (most often a rollout, which
    /// replaces the pod and its keeper), leave a delay inhibitor with a
    /// transient host unit (`nodeguard-inhibitor-handover.service`: this
    /// binary with `--host-state-dir`, else the host's `systemd-inhibit`)
    /// for at most this long, so the node is not
    /// without one until the next agent holds its own; that agent stops
    /// the unit. 0: no handover (the default, and the host service's: there
    /// a `systemctl restart` leaves the node without nodeguard's lock for
    /// the restart's seconds, as the keeper holds a copy only during a
    /// shutdown; set this in the unit to close that too). An agent finds
    /// and ends a predecessor's unit whatever this is.
    #[arg(long, env = "NODEGUARD_INHIBITOR_HANDOVER_SECONDS", default_value_t = 0,
          value_parser = clap::value_parser!(u64).range(0..=3600))]
    pub inhibitor_handover_seconds: u64,

    /// Where `--state-dir` is on the host (the chart's `host.stateDir.path`;
    /// a host service: the same path). With it, the handover unit runs this
    /// binary, copied to `<state-dir>/handover/nodeguard`, which also
    /// records a shutdown that begins before the next agent takes over, so
    /// that agent plans it from when it began. Without it, or when the copy
    /// cannot run (a state directory mounted `noexec`), the unit runs the
    /// host's `systemd-inhibit`, and such a shutdown is planned from when
    /// the next agent finds it.
    #[arg(long, env = "NODEGUARD_HOST_STATE_DIR", value_parser = absolute_path)]
    pub host_state_dir: Option<PathBuf>,

    /// Run exec probes' and plugin monitors' commands changed into this
    /// root (chroot, working directory `/`): the node's root file system
    /// mounted into the pod (the chart's `host.plugins.hostRoot`, at
    /// /host). A command's path, a script's interpreter and what it runs
    /// are then the node's, so shell scripts written for the node
    /// (node-problem-detector's plugins) run unchanged. The allowed
    /// commands (`--allow-command`) are paths on the node. Needs
    /// CAP_SYS_CHROOT.
    #[arg(long, env = "NODEGUARD_COMMAND_ROOT", value_parser = absolute_path)]
    pub command_root: Option<PathBuf>,

    /// Keep the executable's pages that only the start touched mapped. By
    /// default, 60 to 120 s after it is first ready, once it has had no
    /// shutdown under way and its API calls have gone through for 30 to 60
    /// s, the agent drops them from its RSS
    /// (`madvise(MADV_DONTNEED)`; they stay in the page cache and what
    /// runs again maps them back by a minor fault). For comparing, or a
    /// kernel where that misbehaves. In the environment, empty, 0, no, off
    /// and false mean off; any other value on.
    #[arg(long, env = "NODEGUARD_KEEP_EXECUTABLE_PAGES",
          value_parser = clap::builder::FalseyValueParser::new())]
    pub keep_executable_pages: bool,

    #[command(flatten)]
    pub trust: TrustArgs,

    #[command(flatten)]
    pub log: LogArgs,
}

/// Node-local trust: what policies (written through the API) may make this
/// agent do on this node. Lists take repeated flags or comma-separated
/// environment values; an empty value (`--allow-read-path=`) allows none.
#[derive(Debug, Args)]
#[command(next_help_heading = "Node-local trust (what policies may make this agent do)")]
pub struct TrustArgs {
    /// Executables exec probes and plugin monitors may run: an absolute path,
    /// or a directory ending in '/' (everything under it). List scripts,
    /// not interpreters: allowing /bin/sh allows anything.
    #[arg(long = "allow-command", env = "NODEGUARD_ALLOW_COMMANDS", value_delimiter = ',',
          default_values_t = NodeTrust::default().commands)]
    pub commands: Vec<String>,

    /// systemd units monitors may repair (KillUnit on the main process).
    #[arg(long = "allow-repair-unit", env = "NODEGUARD_ALLOW_REPAIR_UNITS", value_delimiter = ',',
          default_values_t = NodeTrust::default().repair_units)]
    pub repair_units: Vec<String>,

    /// Path roots monitors may read (kernel log, files, journal
    /// directories). Their lines can reach Events and conditions.
    #[arg(long = "allow-read-path", env = "NODEGUARD_ALLOW_READ_PATHS", value_delimiter = ',',
          default_values_t = NodeTrust::default().read_paths)]
    pub read_paths: Vec<String>,

    /// Watchdog devices a policy may pet.
    #[arg(long = "allow-watchdog-device", env = "NODEGUARD_ALLOW_WATCHDOG_DEVICES", value_delimiter = ',',
          default_values_t = NodeTrust::default().watchdog_devices)]
    pub watchdog_devices: Vec<String>,

    /// Directories nodeguard may write its logind drop-in
    /// (InhibitDelayMaxSec) into.
    #[arg(long = "allow-logind-drop-in-dir", env = "NODEGUARD_ALLOW_LOGIND_DROP_IN_DIRS", value_delimiter = ',',
          default_values_t = NodeTrust::default().logind_drop_in_dirs)]
    pub logind_drop_in_dirs: Vec<String>,

    /// The longest inhibit delay (priority groups' windows plus the safety
    /// margin) a shutdown section may ask logind for.
    #[arg(long, env = "NODEGUARD_MAX_INHIBIT_DELAY_SECONDS",
          default_value_t = NodeTrust::default().max_inhibit_delay_seconds,
          value_parser = clap::value_parser!(u32).range(1..=86400))]
    pub max_inhibit_delay_seconds: u32,
}

impl TrustArgs {
    pub fn trust(&self) -> NodeTrust {
        let list = |v: &[String]| -> Vec<String> {
            v.iter()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect()
        };
        NodeTrust {
            commands: list(&self.commands),
            repair_units: list(&self.repair_units),
            read_paths: list(&self.read_paths),
            watchdog_devices: list(&self.watchdog_devices),
            logind_drop_in_dirs: list(&self.logind_drop_in_dirs),
            max_inhibit_delay_seconds: self.max_inhibit_delay_seconds,
        }
    }
}

#[derive(Debug, Args)]
pub struct LogArgs {
    /// Log format. Filter with RUST_LOG (default: info).
    #[arg(long, env = "NODEGUARD_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// Sections of aligned columns.
    Table,
    /// The whole view, with full messages.
    Json,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// A path the host's systemd can use as it is: absolute.
fn absolute_path(s: &str) -> Result<PathBuf, String> {
    let p = PathBuf::from(s);
    if p.is_absolute() {
        Ok(p)
    } else {
        Err(format!("{s:?} is not an absolute path"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn run_defaults() {
        let cli = Cli::try_parse_from(["nodeguard", "run", "--node-name", "n1"]).unwrap();
        let Command::Run(args) = cli.command else {
            panic!()
        };
        assert_eq!(args.listen, "0.0.0.0:9909".parse().unwrap());
        assert_eq!(args.state_dir, PathBuf::from("/var/lib/nodeguard"));
        assert_eq!(args.log.log_format, LogFormat::Text);
    }

    #[test]
    fn trust_defaults_are_the_codes_and_flags_replace_them() {
        let run = |args: &[&str]| {
            let mut all = vec!["nodeguard", "run", "--node-name", "n1"];
            all.extend(args);
            let Command::Run(a) = Cli::try_parse_from(all).unwrap().command else {
                panic!()
            };
            a.trust.trust()
        };
        assert_eq!(run(&[]), NodeTrust::default());
        let t = run(&[
            "--allow-command",
            "/opt/plugins/,/usr/bin/check",
            "--allow-command=/usr/bin/other",
            "--allow-read-path=",
            "--allow-repair-unit",
            "containerd.service",
            "--max-inhibit-delay-seconds",
            "120",
        ]);
        assert_eq!(
            t.commands,
            ["/opt/plugins/", "/usr/bin/check", "/usr/bin/other"]
        );
        assert!(t.read_paths.is_empty(), "an empty value allows none");
        assert_eq!(t.repair_units, ["containerd.service"]);
        assert_eq!(t.max_inhibit_delay_seconds, 120);
        assert_eq!(t.watchdog_devices, NodeTrust::default().watchdog_devices);
    }

    #[test]
    fn check_needs_a_file() {
        assert!(Cli::try_parse_from(["nodeguard", "check"]).is_err());
        let cli = Cli::try_parse_from(["nodeguard", "check", "-f", "a.yaml", "b.yaml"]).unwrap();
        assert!(matches!(cli.command, Command::Check { files, .. } if files.len() == 2));
    }
}
