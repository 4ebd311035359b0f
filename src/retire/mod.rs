//! Going away for good. `helm uninstall` deletes the agent's RBAC in the
//! same breath as its DaemonSet, so by the time a pod hears SIGTERM it may
//! no longer be allowed to touch its Node. The chart's pre-delete hook
//! (`nodeguard retire`, [`hook`]) therefore asks first, while everything
//! is still in place: it annotates each agent pod with
//! [`RETIRE_ANNOTATION`] and waits for the pod's [`RETIRED_CONDITION`].
//!
//! An agent that sees the annotation on its own pod finishes a node
//! shutdown in progress, stops every loop (the delay inhibitor goes with
//! the shutdown manager), then removes what it put on the node, in this
//! order: the taints it added (a `NoSchedule` left behind would keep the
//! node empty), the conditions it owns and its effective-policies
//! annotation, the logind drop-in it wrote (logind reloaded), and its state
//! files; says so in a Node Event and in its pod's condition; and idles
//! until its pod is deleted. An ordinary stop (a rollout, a restart, a
//! drain) removes nothing: the next agent carries the conditions on.
//!
//! What stays, by design: the CRD and the NodeGuardPolicies (Helm never
//! deletes `crds/`), readiness-gate conditions on pods (the pods asked for
//! them), and Events (they expire).
//!
//! `core` decides (which taints are nodeguard's, what the report says, how
//! far the hook is); `kube` and `host` do the I/O.

pub mod core;
pub mod hook;
mod host;
pub mod kube;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use tokio::sync::watch;

use crate::k8s::watch::Snapshot;
pub use core::Retired;

/// Set on an agent pod by the pre-delete hook: remove what you put on the
/// node, then say so.
pub const RETIRE_ANNOTATION: &str = "nodeguard.io/retire";

/// The pod condition an agent sets once it retired (True, with what it
/// removed; reason `RetiredWithProblems` when something could not be).
pub const RETIRED_CONDITION: &str = "nodeguard.io/retired";

#[derive(Debug, thiserror::Error)]
pub enum RetireError {
    #[error("API request failed: {0}")]
    Api(#[from] ::kube::Error),
    #[error("cannot serve {addr} while retired: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// What an agent needs to retire.
#[derive(Clone)]
pub struct RetireCtx {
    pub client: ::kube::Client,
    pub node_name: String,
    /// The agent's own pod, `namespace/name`.
    pub pod: String,
    pub state_dir: PathBuf,
    /// The directories this node lets policies write logind drop-ins to
    /// (the node-local trust): nodeguard's drop-in can only be in one.
    pub drop_in_dirs: Vec<String>,
    /// The system bus (`DBUS_SYSTEM_BUS_ADDRESS`); `None`: the default.
    pub system_bus_address: Option<String>,
}

/// Waits until the agent's own pod (`namespace/name`) carries
/// [`RETIRE_ANNOTATION`] in the pod watch. Never returns if it does not.
pub async fn requested(mut pods: watch::Receiver<Option<Snapshot<Pod>>>, own: &str) {
    loop {
        let asked = pods
            .borrow_and_update()
            .as_ref()
            .and_then(|s| s.get(own))
            .is_some_and(|p| asked(p));
        if asked {
            return;
        }
        if pods.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// Whether this pod was asked to retire.
pub fn asked(pod: &Pod) -> bool {
    pod.metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(RETIRE_ANNOTATION))
}

/// Removes what nodeguard put on the node (see the module's text), then
/// reports it on the Node and on the pod. Safe to run again: what is gone
/// is not found the second time.
pub async fn clean_up(ctx: &RetireCtx) -> Retired {
    let mut retired = Retired::default();
    let (states, unreadable) = host::monitor_states(&ctx.state_dir);
    retired.failures.extend(unreadable);
    let owned = core::owned_taints(&states);
    retired.failures.extend(owned.unrecorded);
    let mut taint_left = false;
    for (key, effect) in &owned.taints {
        match crate::k8s::taints::remove(&ctx.client, &ctx.node_name, key, effect).await {
            Ok(()) => retired.taints.push(format!("{key}:{effect}")),
            Err(e) => {
                taint_left = true;
                retired.failures.push(format!(
                    "cannot remove the taint {key}:{effect} ({e}): remove it with kubectl taint"
                ))
            }
        }
    }
    match kube::remove_shutdown_taint(&ctx.client, &ctx.node_name).await {
        Ok(Some(t)) => retired.taints.push(t),
        Ok(None) => {}
        Err(e) => retired.failures.push(format!(
            "cannot remove the shutdown taint ({e}): remove it with kubectl taint"
        )),
    }
    match tokio::try_join!(
        kube::node_taints(&ctx.client, &ctx.node_name),
        kube::declared_taints(&ctx.client)
    ) {
        Ok((on_node, declared)) => retired
            .failures
            .extend(core::policy_taints_left(&on_node, &declared)),
        Err(e) => retired.failures.push(format!(
            "cannot check the node for policy taints left ({e}): check its taints"
        )),
    }
    match kube::remove_conditions(&ctx.client, &ctx.node_name).await {
        Ok(types) => retired.conditions = types,
        Err(e) => retired.failures.push(format!(
            "cannot remove nodeguard's conditions ({e}): they stay on the Node, stale"
        )),
    }
    let (drop_ins, failed) = host::remove_drop_ins(&ctx.drop_in_dirs);
    retired.failures.extend(failed);
    if !drop_ins.is_empty() {
        retired.logind_reloaded = Some(match host::reload_logind(&ctx.system_bus_address).await {
            Ok(()) => true,
            Err(e) => {
                retired.failures.push(format!(
                    "cannot make logind reload ({e}): it keeps the raised delay until its next restart"
                ));
                false
            }
        });
    }
    retired.drop_ins = drop_ins;
    // A lock handed over by a rollout's agent, should the uninstall have
    // come during one: nothing of nodeguard's holds a shutdown after it.
    // Not a failure when systemd cannot be asked (that unit, if any, ends
    // by itself within inhibitorHandoverSeconds); quiet without a system
    // bus (no graceful shutdown ran here).
    if ctx.system_bus_address.is_some()
        || std::path::Path::new("/run/dbus/system_bus_socket").exists()
    {
        let unit = crate::shutdown::logind::HANDOVER_UNIT;
        match tokio::time::timeout(
            std::time::Duration::from_secs(5),
            host::stop_handover(&ctx.system_bus_address),
        )
        .await
        {
            Ok(Ok(true)) => tracing::info!(
                unit,
                "retiring: stopped the delay inhibitor handed over during a rollout"
            ),
            Ok(Ok(false)) => {}
            Ok(Err(e)) => tracing::warn!(
                unit, error = %e,
                "retiring: cannot ask systemd to stop a handover unit; if one runs, it ends by itself within inhibitorHandoverSeconds"
            ),
            Err(_) => tracing::warn!(
                unit,
                "retiring: systemd did not answer in 5 s; a handover unit, if one runs, ends by itself within inhibitorHandoverSeconds"
            ),
        }
    }
    // Last: the state records which taints are nodeguard's. Kept when a
    // taint could not be removed, so a retry (the container restarted)
    // still knows.
    if !taint_left {
        let (removed, failed) = host::clear_state(&ctx.state_dir);
        retired.state_files = removed;
        retired.failures.extend(failed);
    }
    let message = retired.message(&ctx.node_name);
    for f in &retired.failures {
        tracing::warn!(problem = %f, "retiring: left on the node");
    }
    tracing::info!("{message}");
    if let Err(e) = kube::announce(&ctx.client, &ctx.node_name, &retired, &message).await {
        tracing::warn!(error = %e, "cannot write the Event that says nodeguard retired");
    }
    if let Err(e) = kube::mark_retired(&ctx.client, &ctx.pod, &retired, &message).await {
        tracing::warn!(error = %e, "cannot set the retired condition on the agent's pod; the uninstall hook waits for it");
    }
    retired
}

/// After retiring: answers `/livez` (so the kubelet does not restart the
/// container) and fails `/readyz` and `/healthz` saying why, until the pod
/// is deleted (`stop` resolves).
pub async fn idle(
    listen: SocketAddr,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), RetireError> {
    use axum::http::StatusCode;
    use axum::routing::get;
    const WHY: &str = "nodeguard retired (helm uninstall): it no longer guards this node\n";
    let router = axum::Router::new()
        .route("/livez", get(|| async { (StatusCode::OK, WHY) }))
        .route(
            "/readyz",
            get(|| async { (StatusCode::SERVICE_UNAVAILABLE, WHY) }),
        )
        .route(
            "/healthz",
            get(|| async { (StatusCode::SERVICE_UNAVAILABLE, WHY) }),
        );
    // The agent's own server has only just closed its socket.
    let mut tries = 0;
    let listener = loop {
        match tokio::net::TcpListener::bind(listen).await {
            Ok(l) => break l,
            Err(_) if tries < 20 => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(source) => {
                return Err(RetireError::Listen {
                    addr: listen,
                    source,
                });
            }
        }
    };
    axum::serve(listener, router)
        .with_graceful_shutdown(stop)
        .await
        .map_err(|source| RetireError::Listen {
            addr: listen,
            source,
        })
}
