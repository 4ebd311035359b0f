//! The monitors' Kubernetes peer: their taint port on the Node.

use kube::Client;

use crate::k8s::taints::{TaintError, add, remove};

use super::{MonitorError, TaintPort};

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
