//! `nodeguard retire`: the chart's pre-delete hook. Asks every agent pod of
//! the release to retire, then waits until each running one has said so
//! (its [`super::RETIRED_CONDITION`]), printing progress as it goes.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::{Api, Client};
use tokio::time::Instant;

use super::RETIRED_CONDITION;
use super::RetireError;
use super::core::{AgentPod, Progress, agent_pod};

/// How often the pods are read again while waiting.
const POLL: Duration = Duration::from_secs(1);
/// How often progress is printed while waiting.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// Asks the agent pods in `namespace` matching `selector`, then waits at
/// most `timeout`. The final [`Progress`]: [`Progress::clean`] when every
/// running agent removed everything it had put on its node.
pub async fn run(
    client: &Client,
    namespace: &str,
    selector: &str,
    timeout: Duration,
    mut say: impl FnMut(&str),
) -> Result<Progress, RetireError> {
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let list = ListParams::default().labels(selector);
    let pods = api.list(&list).await?.items;
    for pod in &pods {
        match super::kube::ask(&api, pod).await {
            Ok(()) => {}
            // Gone meanwhile: nothing to ask.
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(e.into()),
        }
    }
    say(&format!(
        "asked {} agent pod(s) in {namespace} ({selector}) to remove what nodeguard put on their nodes",
        pods.len()
    ));
    let start = Instant::now();
    let mut said = start;
    loop {
        let pods = api.list(&list).await?.items;
        let progress = Progress::of(&pods.iter().map(view).collect::<Vec<_>>());
        if progress.done() || start.elapsed() >= timeout {
            say(&progress.line());
            for (node, why) in &progress.skipped {
                say(&format!("{node}: skipped, {why}"));
            }
            return Ok(progress);
        }
        if said.elapsed() >= PROGRESS_EVERY {
            say(&progress.line());
            said = Instant::now();
        }
        tokio::time::sleep(POLL).await;
    }
}

/// A pod's node (or its name, before it has one) and where it stands.
fn view(pod: &Pod) -> (String, AgentPod) {
    let node = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
    let status = pod.status.as_ref();
    let retired = status
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == RETIRED_CONDITION))
        .map(|c| {
            (
                c.status.as_str(),
                c.reason.as_deref().unwrap_or_default(),
                c.message.as_deref().unwrap_or_default(),
            )
        });
    let who = node
        .map(str::to_string)
        .unwrap_or_else(|| format!("pod {}", pod.metadata.name.as_deref().unwrap_or("?")));
    (
        who,
        agent_pod(node, status.and_then(|s| s.phase.as_deref()), retired),
    )
}
