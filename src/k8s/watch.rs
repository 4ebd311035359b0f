//! Watches through kube-runtime's watcher: list, then watch with bookmarks,
//! relist on `410 Gone`, and back off (growing while a failure repeats)
//! while the API server is away or refuses the resource.
//!
//! [`watch_objects`] keeps a local snapshot of the watched objects and
//! hands it to a callback after every change and after every (re)list. It
//! reports to the health registry: the first completed list is the loop's
//! first sync (`/readyz`), and every change is queued then updated.
//! An API outage does not make the loop stuck: nothing is queued while the
//! watcher waits, so `/livez` (and the watchdog) never punish an outage.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::Arc;

use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::k8s::deadline::API_DEADLINE;
use crate::k8s::retry_after::WAIT_BUDGET;
use crate::server::LoopHandle;
use crate::server::backoff::Backoff;

/// Objects by `namespace/name` (by `name` when cluster-scoped).
pub type Snapshot<K> = BTreeMap<String, Arc<K>>;

/// The key of an object in a [`Snapshot`].
pub fn key<K: Resource>(obj: &K) -> String {
    match obj.meta().namespace.as_deref() {
        Some(ns) => format!("{ns}/{}", obj.name_any()),
        None => obj.name_any(),
    }
}

/// Keeps a watched object as the API server sent it.
pub fn keep_whole<K>(_: &mut K) {}

/// What the agent keeps of a watched pod: only the fields its readers use
/// (the shutdown manager's `pod_facts` and `terminating_since`, the probe
/// manager's `desired_workers` and `pod_view`, and the `nodeguard.io/`
/// annotations, which carry the uninstall hook's request to the agent's own
/// pod); a test holds each of them
/// to the same answer on a whole pod and on its trimmed copy. The rest
/// (container specs, volumes, environment, images, container states,
/// `managedFields`) was most of each pod's memory in the pod store
/// (ARCHITECTURE, "Footprint"). Code that needs any other field of a pod
/// must read it from the API, or add it here and to that test. The Node's
/// are kept whole: the condition writer reads which condition types it
/// owns from its `managedFields`. Only the store shrinks: the watch still
/// decodes whole pods, so a relist's peak is as before.
pub fn trim_pod(pod: &mut Pod) {
    use k8s_openapi::api::core::v1::{
        ContainerStatus, PodCondition, PodSpec, PodStatus, Toleration,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

    const MIRROR: &str = "kubernetes.io/config.mirror";
    const OURS: &str = "nodeguard.io/";
    let meta = std::mem::take(&mut pod.metadata);
    pod.metadata = ObjectMeta {
        name: meta.name,
        namespace: meta.namespace,
        uid: meta.uid,
        resource_version: meta.resource_version,
        labels: meta.labels,
        // The mirror-pod mark, and nodeguard's own (the uninstall hook's
        // request to retire).
        annotations: meta
            .annotations
            .map(|mut a| {
                a.retain(|k, _| k == MIRROR || k.starts_with(OURS));
                a
            })
            .filter(|a| !a.is_empty()),
        owner_references: meta.owner_references.map(|refs| {
            refs.into_iter()
                .map(|o| OwnerReference {
                    kind: o.kind,
                    controller: o.controller,
                    ..OwnerReference::default()
                })
                .collect()
        }),
        deletion_timestamp: meta.deletion_timestamp,
        deletion_grace_period_seconds: meta.deletion_grace_period_seconds,
        ..ObjectMeta::default()
    };
    pod.spec = pod.spec.take().map(|spec| PodSpec {
        priority: spec.priority,
        termination_grace_period_seconds: spec.termination_grace_period_seconds,
        restart_policy: spec.restart_policy,
        tolerations: spec.tolerations.map(|ts| {
            ts.into_iter()
                .map(|t| Toleration {
                    key: t.key,
                    operator: t.operator,
                    value: t.value,
                    effect: t.effect,
                    ..Toleration::default()
                })
                .collect()
        }),
        ..PodSpec::default()
    });
    pod.status = pod.status.take().map(|status| PodStatus {
        phase: status.phase,
        pod_ip: status.pod_ip,
        start_time: status.start_time,
        conditions: status.conditions.map(|cs| {
            cs.into_iter()
                .map(|c| PodCondition {
                    type_: c.type_,
                    status: c.status,
                    ..PodCondition::default()
                })
                .collect()
        }),
        container_statuses: status.container_statuses.map(|cs| {
            cs.into_iter()
                .map(|c| ContainerStatus {
                    name: c.name,
                    container_id: c.container_id,
                    ..ContainerStatus::default()
                })
                .collect()
        }),
        ..PodStatus::default()
    });
}

/// Runs [`watch_objects`] publishing each snapshot on a channel; `None`
/// until the first list has completed.
pub async fn publish_objects<K>(
    api: Api<K>,
    config: watcher::Config,
    trim: fn(&mut K),
    handle: LoopHandle,
    shutdown: CancellationToken,
    tx: tokio::sync::watch::Sender<Option<Snapshot<K>>>,
) where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default,
{
    watch_objects(
        api,
        config,
        trim,
        handle,
        shutdown,
        move |objects: &Snapshot<K>| {
            tx.send_replace(Some(objects.clone()));
        },
    )
    .await
}

/// Runs until `shutdown` is cancelled. `on_change` sees the whole snapshot,
/// each object as `trim` left it ([`keep_whole`], [`trim_pod`]).
///
/// A failing watch is retried after [`WatchBackoff`]'s delay, which grows
/// while the failure repeats and resets only when objects arrive (a list
/// or watch event), not when a retry merely starts. The first failure is a
/// warning with a hint; repeats are debug lines, with a warning again every
/// [`STILL_FAILING_EVERY`] saying for how long and how many attempts; the
/// recovery is logged once, when objects arrive again.
pub async fn watch_objects<K, F>(
    api: Api<K>,
    config: watcher::Config,
    trim: fn(&mut K),
    handle: LoopHandle,
    shutdown: CancellationToken,
    mut on_change: F,
) where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
    K::DynamicType: Default,
    F: FnMut(&Snapshot<K>),
{
    let what = format!(
        "{} ({})",
        K::plural(&K::DynamicType::default()),
        handle.name()
    );
    let mut stream = watcher(api, config).modify(trim).boxed();
    let mut backoff = WatchBackoff::default();
    let mut objects: Snapshot<K> = BTreeMap::new();
    let mut listing: Option<Snapshot<K>> = None;
    let mut failing: Option<Failing> = None;
    loop {
        let event = tokio::select! {
            _ = shutdown.cancelled() => return,
            e = stream.next() => e,
        };
        let Some(event) = event else {
            tracing::error!(watch = %what, "watch stream ended unexpectedly");
            return;
        };
        let event = match event {
            Ok(e) => e,
            Err(err) => {
                let code = status_code(&err);
                let now = Instant::now();
                // A watch that (re)started fine yields nothing until an
                // object changes: a quiet spell since the last failure means
                // it worked, so this is a new failure, with a fresh backoff.
                if failing.as_ref().is_some_and(|f| worked_between(f, now)) {
                    failing = None;
                    backoff.reset();
                }
                let f = failing.get_or_insert(Failing {
                    since: now,
                    last_error: now,
                    last_delay: Duration::ZERO,
                    attempts: 0,
                    last_warning: None,
                });
                f.attempts += 1;
                f.last_error = now;
                log_watch_error(&what, &err, f);
                let delay = backoff.next_delay(is_configuration_error(code));
                f.last_delay = delay;
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(delay) => {}
                }
                continue;
            }
        };
        // `Init` only says a (re)list starts: no success yet.
        if !matches!(event, watcher::Event::Init) {
            backoff.reset();
            if let Some(f) = failing.take() {
                tracing::info!(watch = %what, after = ?f.since.elapsed(), failed_attempts = f.attempts, "watch recovered");
            }
        }
        match event {
            watcher::Event::Init => listing = Some(BTreeMap::new()),
            watcher::Event::InitApply(obj) => {
                handle.queued();
                listing
                    .get_or_insert_default()
                    .insert(key(&obj), Arc::new(obj));
            }
            watcher::Event::InitDone => {
                objects = listing.take().unwrap_or_default();
                on_change(&objects);
                handle.updated();
                tracing::debug!(watch = %what, count = objects.len(), "listed");
            }
            watcher::Event::Apply(obj) => {
                handle.queued();
                objects.insert(key(&obj), Arc::new(obj));
                on_change(&objects);
                handle.updated();
            }
            watcher::Event::Delete(obj) => {
                handle.queued();
                objects.remove(&key(&obj));
                on_change(&objects);
                handle.updated();
            }
        }
    }
}

/// A watch that keeps failing is warned about again this often.
pub const STILL_FAILING_EVERY: Duration = Duration::from_secs(300);

/// Whether the watch worked between the last failure and this one: a retry
/// that fails comes back within its delay plus one request's deadline and
/// the waits the API server may ask for when it sheds the request
/// ([`WAIT_BUDGET`]), so a longer gap means an attempt succeeded (a quiet
/// watch yields no event to say so). The next failure then starts a new
/// run: fresh backoff, a new warning.
fn worked_between(f: &Failing, now: Instant) -> bool {
    now.duration_since(f.last_error)
        > f.last_delay + API_DEADLINE + WAIT_BUDGET + Duration::from_secs(1)
}

/// A run of failed attempts of one watch.
#[derive(Debug)]
struct Failing {
    since: Instant,
    last_error: Instant,
    /// The delay taken after the last failure.
    last_delay: Duration,
    attempts: u32,
    last_warning: Option<Instant>,
}

/// Backoff between failed list/watch attempts: exponential from 250 ms,
/// capped at 8 s while the API server may just be away (an outage, a
/// restart), and at 60 s once it has answered [`REFUSALS_BELIEVED`] times
/// in a row that the agent cannot have the resource (401, 403, 404: a
/// missing CRD or RBAC rule, which a retry every few seconds cannot fix).
/// A refusal or two in a row is not believed: an API server that has just
/// started answers 403 to everyone until its RBAC cache is loaded (the
/// fleet bench's restart saw a quarter of 200 agents get one). Taken for a
/// missing rule, the first refusal lifted the cap, so after an outage had
/// grown the delay to 8 s it went on doubling: 8–16 s after a second
/// refusal in a row, 16–32 s after a third.
/// `tests/outage.rs` has the real API server refuse twice after an outage
/// and times the delays. Each delay is jittered down to half
/// so thousands of agents do not retry in step. Reset when objects arrive.
///
/// kube's default (client-go's: 0.8 s up to 30 s, reset after 2 minutes)
/// could leave a node agent blind for 30 s after an API server restart;
/// eligibility must follow the Node within seconds, and our watches are
/// small (one Node, this node's Pods, the policies).
#[derive(Debug)]
pub struct WatchBackoff {
    delay: Backoff,
    seed: u64,
    /// Refusals (401, 403, 404) answered in a row.
    refusals: u32,
}

/// How many refusals in a row are taken for the agent's configuration
/// (the longer cap), not an API server still starting.
pub const REFUSALS_BELIEVED: u32 = 3;

const BACKOFF_MIN: Duration = Duration::from_millis(250);
const BACKOFF_MAX: Duration = Duration::from_secs(8);
const BACKOFF_MAX_CONFIGURATION: Duration = Duration::from_secs(60);

impl Default for WatchBackoff {
    fn default() -> Self {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
            | 1;
        WatchBackoff {
            delay: Backoff::new(BACKOFF_MIN, BACKOFF_MAX_CONFIGURATION),
            seed,
            refusals: 0,
        }
    }
}

impl WatchBackoff {
    /// The delay before the next attempt; `refused`: the API server
    /// refused the resource itself (the longer cap applies once that
    /// repeats [`REFUSALS_BELIEVED`] times in a row).
    pub fn next_delay(&mut self, refused: bool) -> Duration {
        // xorshift64: enough randomness for jitter, no dependency.
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        self.refusals = if refused { self.refusals + 1 } else { 0 };
        let cap = if self.refusals >= REFUSALS_BELIEVED {
            BACKOFF_MAX_CONFIGURATION
        } else {
            BACKOFF_MAX
        };
        let full = self.delay.next_within(cap);
        let fraction = 0.5 + (self.seed % 1000) as f64 / 2000.0;
        full.mul_f64(fraction)
    }

    pub fn reset(&mut self) {
        self.delay.reset();
        self.refusals = 0;
    }
}

fn is_configuration_error(code: Option<u16>) -> bool {
    matches!(code, Some(401 | 403 | 404))
}

/// HTTP status of a watcher error, when it came from the API server.
fn status_code(err: &watcher::Error) -> Option<u16> {
    match err {
        watcher::Error::InitialListFailed(e)
        | watcher::Error::WatchStartFailed(e)
        | watcher::Error::WatchFailed(e) => match e {
            kube::Error::Api(s) => Some(s.code),
            _ => None,
        },
        watcher::Error::WatchError(s) => Some(s.code),
        watcher::Error::NoResourceVersion => None,
    }
}

fn log_watch_error(what: &str, err: &watcher::Error, failing: &mut Failing) {
    let hint = match status_code(err) {
        Some(401) => "the agent's credentials were rejected",
        Some(403) => "RBAC forbids this watch: check the agent's ClusterRole",
        Some(404) => {
            "the resource is not served: is the NodeGuardPolicy CRD installed (kubectl apply -f crds/)?"
        }
        Some(410) => "the watch expired; relisting",
        _ => "the API server may be unreachable; retrying with backoff",
    };
    let now = Instant::now();
    match failing.last_warning {
        None => {
            tracing::warn!(watch = %what, error = %err, hint, "watch failed; retrying with backoff");
            failing.last_warning = Some(now);
        }
        Some(at) if now.duration_since(at) >= STILL_FAILING_EVERY => {
            tracing::warn!(watch = %what, error = %err, hint, failing_for = ?failing.since.elapsed(), attempts = failing.attempts, "watch still failing");
            failing.last_warning = Some(now);
        }
        Some(_) => {
            tracing::debug!(watch = %what, error = %err, attempts = failing.attempts, "watch still failing");
        }
    }
}

/// Pods as a kubelet leaves them, with every field the agent's readers
/// look at set in some pod, and much they do not: for the tests that hold
/// each reader to the same answer on a whole pod and on [`trim_pod`]'s copy.
#[cfg(test)]
pub(crate) fn realistic_pods() -> Vec<Pod> {
    let status = |phase: &str, conditions: serde_json::Value| {
        serde_json::json!({
            "phase": phase, "podIP": "10.1.2.3", "podIPs": [{"ip": "10.1.2.3"}],
            "hostIP": "192.168.1.5", "qosClass": "Burstable", "startTime": "2030-01-01T00:00:00Z",
            "conditions": conditions,
            "containerStatuses": [
                {"name": "app", "image": "registry.example/app:1", "imageID": "sha256:aa", "ready": true,
                 "restartCount": 2, "started": true, "containerID": "containerd://bbb",
                 "state": {"running": {"startedAt": "2030-01-01T00:00:01Z"}},
                 "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "finishedAt": "2030-01-01T00:00:00Z"}}},
                {"name": "side", "image": "registry.example/side:1", "imageID": "sha256:cc", "ready": false,
                 "restartCount": 0, "containerID": "containerd://aaa", "state": {"waiting": {"reason": "x"}}}
            ]
        })
    };
    let conditions = |gate: &str, gate_status: &str| {
        serde_json::json!([
            {"type": "Ready", "status": "True", "lastTransitionTime": "2030-01-01T00:00:02Z"},
            {"type": gate, "status": gate_status, "reason": "Probe", "message": "m", "lastProbeTime": null}
        ])
    };
    let spec = |extra: serde_json::Value| {
        let mut s = serde_json::json!({
            "containers": [{"name": "app", "image": "registry.example/app:1",
                "env": [{"name": "A", "value": "b"}], "ports": [{"containerPort": 8080}],
                "readinessProbe": {"httpGet": {"path": "/", "port": 8080}},
                "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
                "volumeMounts": [{"name": "v", "mountPath": "/v"}]}],
            "volumes": [{"name": "v", "emptyDir": {}}],
            "nodeName": "n", "schedulerName": "default-scheduler", "serviceAccountName": "sa",
            "readinessGates": [{"conditionType": "x/y"}]
        });
        s.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        s
    };
    let managed = serde_json::json!([{"manager": "kubelet", "operation": "Update", "apiVersion": "v1",
        "fieldsType": "FieldsV1", "fieldsV1": {"f:status": {}}}]);
    let pods = serde_json::json!([
        {"metadata": {"namespace": "a", "name": "web-1", "uid": "u1", "resourceVersion": "7",
            "labels": {"app": "web", "tier": "front"},
            "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}", "x": "y"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web", "uid": "r", "controller": true}],
            "managedFields": managed},
         "spec": spec(serde_json::json!({"priority": 1000, "terminationGracePeriodSeconds": 45,
            "tolerations": [{"key": "nodeguard.io/shutdown", "operator": "Exists", "effect": "NoSchedule"},
                            {"key": "other", "operator": "Equal", "value": "v", "effect": "NoExecute", "tolerationSeconds": 30}]})),
         "status": status("Running", conditions("x/y", "True"))},
        {"metadata": {"namespace": "kube-system", "name": "proxy-abc", "uid": "u2", "labels": {"app": "proxy"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "proxy", "uid": "d", "controller": true}],
            "managedFields": managed},
         "spec": spec(serde_json::json!({"priority": 2000001000, "priorityClassName": "system-node-critical",
            "tolerations": [{"operator": "Exists"}]})),
         "status": status("Running", conditions("other/gate", "False"))},
        {"metadata": {"namespace": "kube-system", "name": "etcd-n", "uid": "u3", "labels": {"component": "etcd"},
            "annotations": {"kubernetes.io/config.mirror": "hash", "kubernetes.io/config.source": "file"},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": "n", "uid": "n", "controller": true}]},
         "spec": spec(serde_json::json!({"priority": 2000001000, "restartPolicy": "Always"})),
         "status": status("Running", conditions("x/y", "False"))},
        {"metadata": {"namespace": "a", "name": "leaving", "uid": "u4", "labels": {"app": "web"},
            "deletionTimestamp": "2030-01-01T00:01:00Z", "deletionGracePeriodSeconds": 30,
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "ds", "uid": "d2"}]},
         "spec": spec(serde_json::json!({"terminationGracePeriodSeconds": 30,
            "tolerations": [{"key": "", "operator": "Exists", "effect": "NoSchedule"}]})),
         "status": status("Running", conditions("x/y", "True"))},
        {"metadata": {"namespace": "b", "name": "job-1", "uid": "u5", "labels": {"app": "web"}},
         "spec": spec(serde_json::json!({"restartPolicy": "Never",
            "tolerations": [{"key": "nodeguard.io/shutdown", "operator": "Exists", "effect": "NoExecute"}]})),
         "status": status("Failed", serde_json::json!([]))},
        {"metadata": {"namespace": "b", "name": "tolerates-by-value", "uid": "u8", "labels": {"app": "db"}},
         "spec": spec(serde_json::json!({"tolerations": [
            {"key": "nodeguard.io/shutdown", "operator": "Equal", "value": "shutting-down", "effect": "NoSchedule"}]})),
         "status": status("Running", serde_json::json!([]))},
        {"metadata": {"namespace": "b", "name": "another-value", "uid": "u9", "labels": {"app": "db"}},
         "spec": spec(serde_json::json!({"tolerations": [
            {"key": "nodeguard.io/shutdown", "value": "maintenance"}]})),
         "status": status("Running", serde_json::json!([]))},
        {"metadata": {"namespace": "b", "name": "new", "uid": "u6", "labels": {"app": "web"}},
         "spec": spec(serde_json::json!({})),
         "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}]}},
        {"metadata": {"namespace": "b", "name": "done", "uid": "u7", "labels": {"app": "web"}},
         "spec": spec(serde_json::json!({"restartPolicy": "OnFailure"})),
         "status": status("Succeeded", serde_json::json!([]))}
    ]);
    serde_json::from_value(pods).unwrap()
}

/// [`realistic_pods`] as a snapshot: whole, and as the pod watch keeps them.
#[cfg(test)]
pub(crate) fn realistic_snapshots() -> (Snapshot<Pod>, Snapshot<Pod>) {
    let whole: Snapshot<Pod> = realistic_pods()
        .into_iter()
        .map(|p| (key(&p), Arc::new(p)))
        .collect();
    let trimmed = whole
        .iter()
        .map(|(k, p)| {
            let mut p = (**p).clone();
            trim_pod(&mut p);
            (k.clone(), Arc::new(p))
        })
        .collect();
    (whole, trimmed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trimmed_pod_keeps_the_mirror_mark_and_nodeguards_annotations_only() {
        let mut pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "annotations": {
                "kubernetes.io/config.mirror": "h",
                "nodeguard.io/retire": "2030-01-01T00:00:00Z",
                "kubectl.kubernetes.io/last-applied-configuration": "{}",
            }},
        }))
        .unwrap();
        trim_pod(&mut pod);
        let kept: Vec<&String> = pod.metadata.annotations.as_ref().unwrap().keys().collect();
        assert_eq!(kept, ["kubernetes.io/config.mirror", "nodeguard.io/retire"]);
        let mut bare: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "annotations": {"x": "y"}},
        }))
        .unwrap();
        trim_pod(&mut bare);
        assert_eq!(bare.metadata.annotations, None, "none kept: none stored");
    }

    #[test]
    fn a_trimmed_pod_keeps_little_of_a_realistic_one() {
        for pod in realistic_pods() {
            let whole = serde_json::to_vec(&pod).unwrap().len();
            let mut trimmed = pod.clone();
            trim_pod(&mut trimmed);
            let kept = serde_json::to_vec(&trimmed).unwrap().len();
            assert!(kept * 2 < whole, "{kept} of {whole} bytes kept");
            assert_eq!(trimmed.metadata.managed_fields, None);
            let mut again = trimmed.clone();
            trim_pod(&mut again);
            assert_eq!(again, trimmed, "trimming twice changes nothing");
        }
    }

    #[test]
    fn backoff_grows_to_its_cap_with_jitter_and_resets() {
        for (configuration, caps) in [
            (
                false,
                [250, 500, 1000, 2000, 4000, 8000, 8000, 8000, 8000, 8000],
            ),
            (
                true,
                [250, 500, 1000, 2000, 4000, 8000, 16000, 32000, 60000, 60000],
            ),
        ] {
            // (Refusals from the first attempt on: the longer cap holds from
            // the third, before the delay reaches the shorter one.)
            let mut b = WatchBackoff::default();
            let delays: Vec<Duration> = (0..10).map(|_| b.next_delay(configuration)).collect();
            for (d, cap) in delays.iter().zip(caps) {
                let cap = Duration::from_millis(cap);
                assert!(
                    *d <= cap && *d >= cap / 2,
                    "{d:?} not in [{:?}, {cap:?}] ({configuration})",
                    cap / 2
                );
            }
            b.reset();
            assert!(b.next_delay(configuration) <= BACKOFF_MIN);
        }
    }

    /// An API server that has just started refuses everyone for a moment
    /// (its RBAC cache is not loaded): after an outage has grown the delay
    /// to its 8 s cap, one or two refusals keep it there; a third in a row
    /// is the agent's configuration, and the delay grows to a minute.
    #[test]
    fn refusals_after_an_outage_keep_the_short_cap_until_they_repeat() {
        let mut b = WatchBackoff::default();
        for _ in 0..8 {
            b.next_delay(false);
        }
        let cap = BACKOFF_MAX;
        for i in 0..REFUSALS_BELIEVED - 1 {
            let d = b.next_delay(true);
            assert!(d <= cap && d >= cap / 2, "refusal {i}: {d:?}");
        }
        // Anything else in between starts the count again.
        b.next_delay(false);
        for i in 0..REFUSALS_BELIEVED - 1 {
            let d = b.next_delay(true);
            assert!(d <= cap, "refusal {i} after an unreachable server: {d:?}");
        }
        let mut grown = Vec::new();
        for _ in 0..4 {
            grown.push(b.next_delay(true));
        }
        for (d, want) in grown.iter().zip([8, 16, 32, 60]) {
            let want = Duration::from_secs(want);
            assert!(*d <= want && *d >= want / 2, "{grown:?}");
        }
    }

    #[test]
    fn a_gap_longer_than_a_retry_means_the_watch_worked() {
        let t0 = Instant::now();
        let f = Failing {
            since: t0,
            last_error: t0,
            last_delay: Duration::from_secs(8),
            attempts: 5,
            last_warning: Some(t0),
        };
        // 8 s of delay, 10 s of deadline, 10 s of waits the API server asked
        // for, 1 s of slack.
        for (after, worked) in [(1, false), (8, false), (29, false), (30, true), (300, true)] {
            assert_eq!(
                worked_between(&f, t0 + Duration::from_secs(after)),
                worked,
                "{after} s"
            );
        }
    }

    #[test]
    fn which_failures_are_configuration_errors() {
        for (code, want) in [
            (Some(401), true),
            (Some(403), true),
            (Some(404), true),
            (Some(410), false),
            (Some(500), false),
            (Some(503), false),
            (Some(429), false),
            (None, false),
        ] {
            assert_eq!(is_configuration_error(code), want, "{code:?}");
        }
    }
}
