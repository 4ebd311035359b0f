//! nodeguard: a Kubernetes node agent. See ARCHITECTURE.md for the module map.

pub mod agent;
pub mod cli;
pub mod clock;
pub mod command;
pub mod footprint;
pub mod k8s;
pub mod monitor;
pub mod node_view;
#[cfg(test)]
mod pipes;
pub mod policy;
pub mod probe;
pub mod report;
pub mod retire;
pub mod server;
pub mod shutdown;
pub mod state_dir;
pub mod watchdog;

/// `version (commit, rustc)` as printed by `nodeguard version`.
pub fn version_string() -> String {
    format!(
        "nodeguard {} (commit {}, {})",
        env!("CARGO_PKG_VERSION"),
        env!("NODEGUARD_GIT_COMMIT"),
        env!("NODEGUARD_RUSTC_VERSION")
    )
}
