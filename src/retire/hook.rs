//! `nodeguard retire`: the chart's pre-delete hook. Asks every agent pod of
//! the release to retire (again on every pass, so a pod created meanwhile
//! is asked too), then waits until each running one has said so (its
//! [`super::RETIRED_CONDITION`]), printing progress as it goes. What is
//! left on a node that did not answer, or answered with problems, goes on
//! that Node as a Warning Event, where `kubectl describe node` shows it
//! after the release is gone.

use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use kube::api::{ListParams, PostParams};
use kube::{Api, Client};
use tokio::time::Instant;

use super::RETIRED_CONDITION;
use super::RetireError;
use super::core::{AgentPod, Progress, agent_pod};

/// How often the pods are read again while waiting.
const POLL: Duration = Duration::from_secs(2);
/// How often progress is printed while waiting.
const PROGRESS_EVERY: Duration = Duration::from_secs(10);
/// Pods per list request: a fleet's pods are read in pages, not at once.
const PAGE: u32 = 500;
/// Asks in flight at once.
const ASKS_AT_ONCE: usize = 16;

/// Asks the agent pods in `namespace` matching `selector`, then waits until
/// every running one answered or `timeout` (from the start, asks included)
/// passed. A request that fails is tried again on the next pass. The final
/// [`Progress`]: [`Progress::clean`] when every running agent removed
/// everything it had put on its node.
pub async fn run(
    client: &Client,
    namespace: &str,
    selector: &str,
    timeout: Duration,
    mut say: impl FnMut(&str),
) -> Result<Progress, RetireError> {
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let start = Instant::now();
    let deadline = start + timeout;
    let mut said = start;
    let mut read_once = false;
    let mut last = Progress::default();
    loop {
        match pass(&api, selector).await {
            Ok((asked, progress)) => {
                if asked > 0 {
                    say(&format!(
                        "asked {asked} agent pod(s) in {namespace} ({selector}) to remove what nodeguard put on their nodes"
                    ));
                }
                read_once = true;
                last = progress;
            }
            Err(e) => say(&format!(
                "cannot read or ask the agent pods ({e}); trying again"
            )),
        }
        let over = Instant::now() >= deadline;
        if (read_once && last.done()) || over {
            say(&last.line());
            for (node, why) in &last.skipped {
                say(&format!("{node}: skipped, {why}"));
            }
            return Ok(last);
        }
        if said.elapsed() >= PROGRESS_EVERY {
            say(&last.line());
            said = Instant::now();
        }
        tokio::time::sleep(POLL.min(deadline.saturating_duration_since(Instant::now()))).await;
    }
}

/// One pass: every agent pod read (in pages), those not asked yet asked;
/// how many were asked now, and where all stand.
async fn pass(api: &Api<Pod>, selector: &str) -> Result<(usize, Progress), kube::Error> {
    let mut views = Vec::new();
    let mut to_ask = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let mut lp = ListParams::default().labels(selector).limit(PAGE);
        if let Some(t) = &token {
            lp = lp.continue_token(t);
        }
        let page = api.list(&lp).await?;
        for pod in &page.items {
            if !super::asked(pod) {
                to_ask.push(pod.metadata.name.clone().unwrap_or_default());
            }
            views.push(view(pod));
        }
        token = page.metadata.continue_.filter(|t| !t.is_empty());
        if token.is_none() {
            break;
        }
    }
    let asked = to_ask.len();
    futures::stream::iter(to_ask)
        .map(|name| async move {
            match super::kube::ask(api, &name).await {
                // Gone meanwhile: nothing to ask.
                Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
                other => other,
            }
        })
        .buffer_unordered(ASKS_AT_ONCE)
        .try_collect::<Vec<()>>()
        .await?;
    Ok((asked, Progress::of(&views)))
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

/// A Warning Event on `node`: what nodeguard left there. In `default`, as
/// every Event about a cluster-scoped object; `kubectl describe node` shows
/// it once the release is gone.
pub async fn warn_node(client: &Client, node: &str, note: &str) -> Result<(), kube::Error> {
    let namespace = "default";
    let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(jiff::Timestamp::now());
    let event: Event = serde_json::from_value(serde_json::json!({
        "apiVersion": "events.k8s.io/v1", "kind": "Event",
        "metadata": {"generateName": "nodeguard-retire-", "namespace": namespace},
        "eventTime": now,
        "reportingController": "nodeguard.io/retire",
        "reportingInstance": "nodeguard-retire",
        "action": "Retire",
        "reason": "NodeguardNotRetired",
        "type": "Warning",
        "regarding": {"apiVersion": "v1", "kind": "Node", "name": node},
        "note": crate::report::clip(note, 1024),
    }))
    .expect("an Event");
    Api::<Event>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &event)
        .await?;
    Ok(())
}
