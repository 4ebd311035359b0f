//! The monitors' Kubernetes peer: their taint port on the Node.

use std::time::Duration;

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

/// How long one taint edit may take: its reads, writes and conflict
/// rounds, each call of which may wait out a shedding API server
/// (`k8s::retry_after`). Under the monitor loop's timeout
/// ([`super::MONITOR_TIMEOUT`]), so an edit never makes the loop stuck; one
/// cut short counts as possibly written, and the monitor's next attempt
/// reads what landed.
pub const EDIT_TIMEOUT: Duration = Duration::from_secs(40);
const _: () = assert!(EDIT_TIMEOUT.as_secs() < super::MONITOR_TIMEOUT.as_secs());

impl TaintPort for KubeTaints {
    async fn add(&self, key: &str, value: &str, effect: &str) -> Result<bool, MonitorError> {
        let edit = add(&self.client, &self.node, key, value, effect);
        match tokio::time::timeout(EDIT_TIMEOUT, edit).await {
            Ok(r) => Ok(r?),
            Err(_) => Err(TaintError::TimedOut(EDIT_TIMEOUT).into()),
        }
    }
    async fn remove(&self, key: &str, effect: &str) -> Result<(), MonitorError> {
        let edit = remove(&self.client, &self.node, key, effect);
        match tokio::time::timeout(EDIT_TIMEOUT, edit).await {
            Ok(r) => Ok(r?),
            Err(_) => Err(TaintError::TimedOut(EDIT_TIMEOUT).into()),
        }
    }
}
