//! Kubernetes adapters: the client, and the watches on this node and on the
//! policies. (Named `k8s` rather than `kube` so it does not shadow the
//! `kube` crate inside this crate.)

pub mod deadline;
pub mod node;
pub mod retry_after;
pub mod taints;
pub mod watch;

use std::path::Path;

use kube::Client;
use kube::config::{Config, KubeConfigOptions, Kubeconfig};

#[derive(Debug, thiserror::Error)]
pub enum K8sError {
    #[error("cannot load kubeconfig {path}: {source}")]
    Kubeconfig {
        path: String,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error(
        "no Kubernetes configuration found: not running in a pod and no kubeconfig ({source}); pass --kubeconfig or set KUBECONFIG"
    )]
    Infer {
        #[source]
        source: kube::config::InferConfigError,
    },
    #[error("cannot build a Kubernetes client: {0}")]
    Client(#[source] kube::Error),
}

/// A client from an explicit kubeconfig, or else the in-cluster config
/// (service account) or the default kubeconfig, in kube's usual order.
///
/// kube's automatic retries are turned off ([`agent_config`]): every loop
/// of the agent has its own backoff and must see a 429 at once (an eviction
/// refused by a PodDisruptionBudget is a 429, which kube would otherwise
/// retry for minutes while the shutdown window runs out).
pub async fn client(kubeconfig: Option<&Path>) -> Result<Client, K8sError> {
    let mut config = match kubeconfig {
        Some(path) => {
            let err = |source| K8sError::Kubeconfig {
                path: path.display().to_string(),
                source,
            };
            let kc = Kubeconfig::read_from(path).map_err(err)?;
            Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .map_err(err)?
        }
        None => Config::infer()
            .await
            .map_err(|source| K8sError::Infer { source })?,
    };
    agent_config(&mut config);
    Client::try_from(config).map_err(K8sError::Client)
}

/// Adjusts a client configuration the way the agent needs it: no automatic
/// retries, and a `User-Agent` naming the agent and its version, so audit
/// logs and API server logs tell nodeguard's requests apart (kube-rs sends
/// none of its own).
pub fn agent_config(config: &mut Config) {
    config.default_retry = false;
    let agent = format!("nodeguard/{}", env!("CARGO_PKG_VERSION"));
    config
        .headers
        .retain(|(name, _)| name != http::header::USER_AGENT);
    config.headers.push((
        http::header::USER_AGENT,
        http::HeaderValue::from_str(&agent).expect("a version is a valid header value"),
    ));
}

#[cfg(test)]
mod agent_config_tests {
    use super::*;

    #[test]
    fn the_agent_names_itself_and_does_not_retry() {
        let mut config = Config::new("https://127.0.0.1:6443".parse().unwrap());
        agent_config(&mut config);
        agent_config(&mut config);
        assert!(!config.default_retry);
        let agents: Vec<_> = config
            .headers
            .iter()
            .filter(|(n, _)| n == http::header::USER_AGENT)
            .map(|(_, v)| v.to_str().unwrap().to_string())
            .collect();
        assert_eq!(agents, [format!("nodeguard/{}", env!("CARGO_PKG_VERSION"))]);
    }
}
