//! Command-line interface.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

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
    Run(RunArgs),
    /// Print the NodeGuardPolicy CustomResourceDefinition generated from the code.
    Crd,
    /// Validate policy files offline, with the same rules the agent applies.
    ///
    /// Prints every problem with its field path; exits 1 when there is any.
    Check {
        /// Policy files (YAML, one or more documents each); `-` reads stdin.
        #[arg(short = 'f', long = "filename", required = true, num_args = 1..)]
        files: Vec<PathBuf>,
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

    #[command(flatten)]
    pub log: LogArgs,
}

#[derive(Debug, Args)]
pub struct LogArgs {
    /// Log format. Filter with RUST_LOG (default: info).
    #[arg(long, env = "NODEGUARD_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, for log collectors.
    Json,
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
    fn check_needs_a_file() {
        assert!(Cli::try_parse_from(["nodeguard", "check"]).is_err());
        let cli = Cli::try_parse_from(["nodeguard", "check", "-f", "a.yaml", "b.yaml"]).unwrap();
        assert!(matches!(cli.command, Command::Check { files } if files.len() == 2));
    }
}
