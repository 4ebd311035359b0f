//! Editing the Node's taints. Taints are an atomic list, so a blind patch
//! could drop someone else's: read, edit, and write back with the
//! resourceVersion as a precondition, retrying on conflict.

use k8s_openapi::api::core::v1::{Node, Taint};
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};

use crate::monitor::{MonitorError, TaintPort};

#[derive(Debug, thiserror::Error)]
pub enum TaintError {
    /// Reading the Node failed: nothing was written.
    #[error("cannot read the Node: {0}")]
    Read(kube::Error),
    /// The write failed.
    #[error("API request failed: {0}")]
    Api(#[from] kube::Error),
    #[error("the taints of Node {0} kept changing under us; gave up after retries")]
    Conflict(String),
}

/// Whether a write that failed with `e` may have been applied all the
/// same: a request sent whose answer was lost, or the server's own error
/// after it took it (5xx). A refusal (4xx) wrote nothing.
pub fn may_have_landed(e: &kube::Error) -> bool {
    match e {
        kube::Error::Api(s) => s.code >= 500,
        _ => true,
    }
}

impl TaintError {
    /// Whether the write may have been applied though it failed
    /// ([`may_have_landed`]). A failed read or conflicts to the last
    /// attempt wrote nothing.
    pub fn maybe_applied(&self) -> bool {
        match self {
            TaintError::Read(_) | TaintError::Conflict(_) => false,
            TaintError::Api(e) => may_have_landed(e),
        }
    }
}

/// Applies `edit` (which returns whether it changed anything); returns
/// whether a write happened.
pub async fn edit(
    client: &Client,
    node: &str,
    edit: impl Fn(&mut Vec<Taint>) -> bool,
) -> Result<bool, TaintError> {
    let nodes: Api<Node> = Api::all(client.clone());
    for _ in 0..10 {
        let n = nodes.get(node).await.map_err(TaintError::Read)?;
        let mut taints = n.spec.and_then(|s| s.taints).unwrap_or_default();
        if !edit(&mut taints) {
            return Ok(false);
        }
        let patch = serde_json::json!({
            "metadata": {"resourceVersion": n.metadata.resource_version},
            "spec": {"taints": taints},
        });
        match nodes
            .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => return Ok(true),
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(TaintError::Conflict(node.to_string()))
}

/// Adds a taint unless one with the same key and effect is there; `true`
/// when this call added it.
pub async fn add(
    client: &Client,
    node: &str,
    key: &str,
    value: &str,
    effect: &str,
) -> Result<bool, TaintError> {
    edit(client, node, |taints| {
        if taints.iter().any(|t| t.key == key && t.effect == effect) {
            return false;
        }
        taints.push(Taint {
            key: key.into(),
            value: (!value.is_empty()).then(|| value.to_string()),
            effect: effect.into(),
            time_added: None,
        });
        true
    })
    .await
}

/// Removes the taint with this key and effect, if present.
pub async fn remove(
    client: &Client,
    node: &str,
    key: &str,
    effect: &str,
) -> Result<(), TaintError> {
    remove_where(client, node, |t| t.key == key && t.effect == effect)
        .await
        .map(|_| ())
}

/// Removes the taint with this key, value and effect, if present; `true`
/// when it was there. A taint of the same key with another value is
/// someone else's and stays.
pub async fn remove_valued(
    client: &Client,
    node: &str,
    key: &str,
    value: &str,
    effect: &str,
) -> Result<bool, TaintError> {
    remove_where(client, node, |t| {
        t.key == key && t.effect == effect && t.value.as_deref().unwrap_or_default() == value
    })
    .await
}

/// Removes the taints `matches` picks; `true` when there were any.
async fn remove_where(
    client: &Client,
    node: &str,
    matches: impl Fn(&Taint) -> bool,
) -> Result<bool, TaintError> {
    edit(client, node, |taints| {
        let before = taints.len();
        taints.retain(|t| !matches(t));
        taints.len() != before
    })
    .await
}

/// The monitor's taint port ([`TaintPort`], defined by the monitor that
/// uses it) on the API.
#[derive(Clone)]
pub struct KubeTaints {
    client: Client,
    node: String,
}

impl KubeTaints {
    pub fn new(client: Client, node: &str) -> Self {
        KubeTaints {
            client,
            node: node.to_string(),
        }
    }
}

impl From<TaintError> for MonitorError {
    fn from(e: TaintError) -> Self {
        MonitorError::Taint(Box::new(e))
    }
}

impl TaintPort for KubeTaints {
    async fn add(&self, key: &str, value: &str, effect: &str) -> Result<bool, MonitorError> {
        Ok(add(&self.client, &self.node, key, value, effect).await?)
    }
    async fn remove(&self, key: &str, effect: &str) -> Result<(), MonitorError> {
        Ok(remove(&self.client, &self.node, key, effect).await?)
    }
}
