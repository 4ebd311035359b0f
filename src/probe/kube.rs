//! The pods/status adapter: readiness-gate conditions written to the API
//! server.

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};

use super::{PodConditionPort, ProbeError};

/// Writes readiness-gate conditions with server-side apply on
/// `pods/status`, one field manager per condition type, so each gate is
/// owned separately and the kubelet's conditions are never touched. With a
/// UID ([`PodConditionPort::set_on`]) the apply carries it, and the API
/// server refuses it (422 Invalid: `metadata.uid` is immutable) when the
/// pod under that name is another one.
#[derive(Clone)]
pub struct KubePodConditions {
    client: Client,
}

impl KubePodConditions {
    pub fn new(client: Client) -> Self {
        KubePodConditions { client }
    }
}

/// The field manager for a readiness gate.
pub fn gate_manager(condition: &str) -> String {
    let mut m = format!("nodeguard-gate-{condition}");
    m.truncate(128);
    m
}

impl PodConditionPort for KubePodConditions {
    async fn set(
        &self,
        pod: &str,
        condition: &str,
        passing: bool,
        message: &str,
    ) -> Result<(), ProbeError> {
        self.set_on(pod, None, condition, passing, message).await
    }

    async fn set_on(
        &self,
        pod: &str,
        uid: Option<&str>,
        condition: &str,
        passing: bool,
        message: &str,
    ) -> Result<(), ProbeError> {
        let (ns, name) = pod.split_once('/').unwrap_or(("default", pod));
        let api: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::now());
        let mut metadata = serde_json::json!({"name": name, "namespace": ns});
        if let Some(uid) = uid {
            metadata["uid"] = uid.into();
        }
        let body = serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": metadata,
            "status": {"conditions": [{
                "type": condition,
                "status": if passing { "True" } else { "False" },
                "reason": if passing { "ProbePassed" } else { "ProbeFailed" },
                "message": message,
                "lastTransitionTime": now,
            }]},
        });
        api.patch_status(
            name,
            &PatchParams::apply(&gate_manager(condition)).force(),
            &Patch::Apply(&body),
        )
        .await?;
        Ok(())
    }
}
