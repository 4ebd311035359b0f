//! Editing the Node's taints. Taints are an atomic list, so a blind patch
//! could drop someone else's: read, edit, and write back with a JSON patch
//! whose `test` operation requires the list to be as read, retrying when it
//! is not. The precondition is on the taints alone: the Node's
//! resourceVersion would also fail on every status write (the kubelet's,
//! nodeguard's own condition writer), which under load made the shutdown
//! taint land seconds late.

use k8s_openapi::api::core::v1::{Node, Taint};
use kube::api::{ApiResource, DynamicObject, Patch, PatchParams};
use kube::{Api, Client};

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
    /// The Node's taints (as read) could not be taken apart.
    #[error("cannot read the Node's taints: {0}")]
    Unreadable(String),
    /// The edit (its reads, writes and conflict rounds) did not finish in
    /// time; a write may have gone out.
    #[error("the taint edit did not finish within {0:?}")]
    TimedOut(std::time::Duration),
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
            TaintError::Read(_) | TaintError::Conflict(_) | TaintError::Unreadable(_) => false,
            TaintError::Api(e) => may_have_landed(e),
            TaintError::TimedOut(_) => true,
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
    // Read as sent, so the `test` compares the server's own JSON (fields
    // this client's types do not know included).
    let nodes: Api<DynamicObject> = Api::all_with(client.clone(), &ApiResource::erase::<Node>(&()));
    for _ in 0..10 {
        let read = taints_as_sent(&nodes, node).await?;
        let mut taints: Vec<Taint> =
            serde_json::from_value(read.clone().unwrap_or_else(|| serde_json::json!([])))
                .map_err(|e| TaintError::Unreadable(e.to_string()))?;
        if !edit(&mut taints) {
            return Ok(false);
        }
        let patch: json_patch::Patch = serde_json::from_value(serde_json::json!([
            // An absent list tests as null.
            {"op": "test", "path": "/spec/taints", "value": read},
            {"op": "add", "path": "/spec/taints", "value": taints},
        ]))
        .map_err(|e| TaintError::Unreadable(e.to_string()))?;
        match nodes
            .patch(node, &PatchParams::default(), &Patch::<()>::Json(patch))
            .await
        {
            Ok(_) => return Ok(true),
            // The `test` failed (422): the taints changed since the read.
            // A 422 with the taints as read is a real refusal.
            Err(kube::Error::Api(s))
                if s.code == 422 && taints_as_sent(&nodes, node).await? != read =>
            {
                continue;
            }
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(TaintError::Conflict(node.to_string()))
}

/// The Node's `spec.taints` as the server sent it (`None` when absent).
async fn taints_as_sent(
    nodes: &Api<DynamicObject>,
    node: &str,
) -> Result<Option<serde_json::Value>, TaintError> {
    let n = nodes.get(node).await.map_err(TaintError::Read)?;
    Ok(n.data
        .get("spec")
        .and_then(|s| s.get("taints"))
        .filter(|t| !t.is_null())
        .cloned())
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
