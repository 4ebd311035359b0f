//! Wiring: builds the health registry, metrics, HTTP server and the
//! long-running loops, and stops them together.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::runtime::watcher;
use kube::{Api, Client};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::k8s::node::{Eligibility, NodeFacts, eligibility};
use crate::k8s::watch::{Snapshot, watch_objects};
use crate::policy::{NodeGuardPolicy, validate};
use crate::server::{Health, Server, ServerError, metrics};

/// How long a watch loop may hold unapplied changes before `/livez` fails.
pub const WATCH_LOOP_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub node_name: String,
    pub listen: SocketAddr,
    pub state_dir: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Server(#[from] ServerError),
    #[error(
        "state directory {path} is not usable: {source} (set --state-dir to a writable directory)"
    )]
    StateDir {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// A started agent. Dropping it does not stop it; call [`RunningAgent::stop`].
pub struct RunningAgent {
    pub health: Health,
    /// The address the HTTP server listens on (useful with port 0).
    pub addr: SocketAddr,
    /// The Node as last seen by the node watch (`None`: not found).
    pub node: watch::Receiver<Option<Arc<Node>>>,
    /// The policies as last seen by the policy watch.
    pub policies: watch::Receiver<Snapshot<NodeGuardPolicy>>,
    shutdown: CancellationToken,
    tasks: JoinSet<()>,
}

impl RunningAgent {
    /// Cancels every loop and waits for them and the HTTP server to finish.
    pub async fn stop(mut self) {
        self.shutdown.cancel();
        while self.tasks.join_next().await.is_some() {}
    }

    /// A token that stops the agent when cancelled.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }
}

fn ensure_state_dir(path: &std::path::Path) -> Result<(), AgentError> {
    let err = |source| AgentError::StateDir {
        path: path.display().to_string(),
        source,
    };
    std::fs::create_dir_all(path).map_err(err)?;
    let probe = path.join(".nodeguard-write-test");
    std::fs::write(&probe, b"ok").map_err(err)?;
    std::fs::remove_file(&probe).map_err(err)?;
    Ok(())
}

/// Starts the agent's loops and HTTP server, returning once it is listening.
pub async fn start(config: AgentConfig, client: Client) -> Result<RunningAgent, AgentError> {
    ensure_state_dir(&config.state_dir)?;
    let health = Health::new();
    let (registry, server_metrics) = metrics::new_registry(&health);
    let shutdown = CancellationToken::new();
    let mut tasks = JoinSet::new();

    // Register every loop before serving, so /readyz cannot pass early.
    let node_loop = health.register("node-watch", WATCH_LOOP_TIMEOUT);
    let policy_loop = health.register("policy-watch", WATCH_LOOP_TIMEOUT);

    let server = Server::bind(
        config.listen,
        health.clone(),
        Arc::new(registry),
        server_metrics,
    )
    .await?;
    let addr = server.local_addr();
    tracing::info!(%addr, node = %config.node_name, "serving /healthz /livez /readyz /metrics");
    let token = shutdown.clone();
    tasks.spawn(async move {
        if let Err(err) = server.serve(token).await {
            tracing::error!(error = %err, "HTTP server stopped");
        }
    });

    let (node_tx, node_rx) = watch::channel(None);
    {
        let api: Api<Node> = Api::all(client.clone());
        let cfg = watcher::Config::default().fields(&format!("metadata.name={}", config.node_name));
        let health = health.clone();
        let node_name = config.node_name.clone();
        let token = shutdown.clone();
        tasks.spawn(async move {
            watch_objects(api, cfg, node_loop, token, move |nodes: &Snapshot<Node>| {
                let node = nodes.get(&node_name).cloned();
                let facts = node.as_deref().map(NodeFacts::from_node).unwrap_or_default();
                let (eligible, reason) = match eligibility(&facts, &[]) {
                    Eligibility::Eligible => (true, None),
                    Eligibility::Ineligible(r) => (false, Some(r)),
                };
                if health.set_node_eligible(eligible, reason.clone()) {
                    match &reason {
                        None => tracing::info!(node = %node_name, "node is eligible again"),
                        Some(r) => tracing::warn!(node = %node_name, reason = %r, "node is no longer eligible; /healthz answers 503"),
                    }
                }
                node_tx.send_replace(node);
            })
            .await;
        });
    }

    let (policy_tx, policy_rx) = watch::channel(Snapshot::new());
    {
        let api: Api<NodeGuardPolicy> = Api::all(client.clone());
        let token = shutdown.clone();
        tasks.spawn(async move {
            let mut seen: std::collections::BTreeMap<String, Option<i64>> = Default::default();
            watch_objects(
                api,
                watcher::Config::default(),
                policy_loop,
                token,
                move |policies: &Snapshot<NodeGuardPolicy>| {
                    seen.retain(|name, _| policies.contains_key(name));
                    for (name, p) in policies {
                        let generation = p.metadata.generation;
                        if seen.insert(name.clone(), generation) == Some(generation) {
                            continue;
                        }
                        let problems = validate(p);
                        if problems.is_empty() {
                            tracing::info!(policy = %name, ?generation, "policy loaded");
                        } else {
                            let list: Vec<String> = problems.iter().map(ToString::to_string).collect();
                            tracing::warn!(policy = %name, ?generation, problems = ?list, "policy is invalid");
                        }
                    }
                    policy_tx.send_replace(policies.clone());
                },
            )
            .await;
        });
    }

    Ok(RunningAgent {
        health,
        addr,
        node: node_rx,
        policies: policy_rx,
        shutdown,
        tasks,
    })
}
