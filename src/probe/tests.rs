//! The manager, its workers and their targets.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use tokio::sync::{Notify, Semaphore, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::core::{Role, Sink, TargetKind, Thresholds, Tick, Worker};
use super::manager::MAX_CONCURRENT_PROBES;
use super::prober::{Action, Probers};
use super::publish::camel;
use super::targets::{Def, WorkerKey, action, desired_workers, pod_view, stale_condition};
use super::worker::{PANIC_RESTART_DELAY, Shared, run_worker, worker_task};
use super::{PodConditionPort, ProbeError, ProbeHandle, ProbeMetrics, run_probe_manager};
use crate::k8s::watch::Snapshot;
use crate::policy::probes::ProbeSpec;

#[test]
fn camel_names() {
    assert_eq!(camel("kube-proxy"), "KubeProxy");
    assert_eq!(camel("kubelet"), "Kubelet");
    assert_eq!(camel("dns_check.v2"), "DnsCheckV2");
}

fn spec(v: serde_json::Value) -> ProbeSpec {
    serde_json::from_value(v).unwrap()
}

#[test]
fn actions_against_node_and_pods() {
    let s = spec(serde_json::json!({"name": "web", "pods": {"selector": {}},
        "http": {"port": 8080, "path": "/ready", "scheme": "HTTPS", "headers": [{"name": "X", "value": "1"}]},
        "readinessGate": "example.com/deep"}));
    assert_eq!(
        action(&s, Some("10.1.2.3")),
        Some(Action::Http {
            url: "https://10.1.2.3:8080/ready".into(),
            headers: vec![("X".into(), "1".into())],
            status: (200, 399),
            body_contains: None,
            insecure: false,
        })
    );
    let t = spec(serde_json::json!({"name": "t", "tcp": {"port": 10256}, "conditionType": "X"}));
    assert_eq!(
        action(&t, None),
        Some(Action::Tcp {
            host: "127.0.0.1".into(),
            port: 10256
        })
    );
    let g = spec(
        serde_json::json!({"name": "g", "pods": {"selector": {}}, "grpc": {"port": 9000, "host": "ignored"}, "readinessGate": "x/y"}),
    );
    assert_eq!(
        action(&g, Some("fd00::1")),
        Some(Action::Grpc {
            host: "fd00::1".into(),
            port: 9000,
            service: String::new()
        })
    );
}

fn pod(ns: &str, name: &str, labels: serde_json::Value) -> (String, Arc<Pod>) {
    pod_in(ns, name, labels, "Running")
}

fn pod_in(ns: &str, name: &str, labels: serde_json::Value, phase: &str) -> (String, Arc<Pod>) {
    let p: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"namespace": ns, "name": name, "labels": labels}, "spec": {"containers": []},
        "status": {"phase": phase}
    }))
    .unwrap();
    (format!("{ns}/{name}"), Arc::new(p))
}

#[test]
fn probes_see_a_trimmed_pod_as_the_whole_one() {
    let (whole, trimmed) = crate::k8s::watch::realistic_snapshots();
    let specs = vec![
        spec(
            serde_json::json!({"name": "web", "pods": {"selector": {"matchLabels": {"app": "web"}}, "namespaces": ["a", "b"]},
            "tcp": {"port": 80}, "readinessGate": "x/y"}),
        ),
        spec(
            serde_json::json!({"name": "all", "pods": {"selector": {"matchExpressions": [{"key": "tier", "operator": "DoesNotExist"}]}},
            "httpGet": {"port": 80}, "readinessGate": "x/y"}),
        ),
    ];
    let keys = |pods: &Snapshot<Pod>| {
        let mut d: Vec<(WorkerKey, Option<String>)> = desired_workers(&specs, Some(pods))
            .into_iter()
            .map(|(k, d)| (k, d.uid))
            .collect();
        d.sort();
        d
    };
    assert_eq!(keys(&trimmed), keys(&whole));
    assert!(keys(&whole).len() >= 4, "{:?}", keys(&whole));
    let now: jiff::Timestamp = "2030-01-01T00:00:30Z".parse().unwrap();
    for (key, pod) in &whole {
        for uid in [None, pod.metadata.uid.clone(), Some("other".to_string())] {
            let def = Def {
                spec: specs[0].clone(),
                pod: Some(key.clone()),
                uid,
            };
            for gate in [Some("x/y"), Some("other/gate"), None] {
                assert_eq!(
                    pod_view(&def, Some(&trimmed[key]), gate, now, true),
                    pod_view(&def, Some(pod), gate, now, true),
                    "{key}"
                );
            }
        }
    }
}

#[test]
fn desired_workers_follow_selectors_and_namespaces() {
    let specs = vec![
        spec(serde_json::json!({"name": "node", "tcp": {"port": 1}, "conditionType": "X"})),
        spec(
            serde_json::json!({"name": "web", "pods": {"selector": {"matchLabels": {"app": "web"}}, "namespaces": ["a"]},
            "tcp": {"port": 80}, "readinessGate": "x/y"}),
        ),
    ];
    let pods: Snapshot<Pod> = [
        pod("a", "w1", serde_json::json!({"app": "web"})),
        pod("b", "w2", serde_json::json!({"app": "web"})),
        pod("a", "db", serde_json::json!({"app": "db"})),
        pod_in("a", "done", serde_json::json!({"app": "web"}), "Succeeded"),
        pod_in("a", "crashed", serde_json::json!({"app": "web"}), "Failed"),
        pod_in("a", "new", serde_json::json!({"app": "web"}), "Pending"),
    ]
    .into_iter()
    .collect();
    let mut keys: Vec<WorkerKey> = desired_workers(&specs, Some(&pods)).into_keys().collect();
    keys.sort();
    assert_eq!(
        keys,
        vec![
            ("node".into(), "node".into()),
            ("web".into(), "a/new".into()),
            ("web".into(), "a/w1".into())
        ],
        "terminal pods get no workers"
    );
    assert_eq!(desired_workers(&specs, None).len(), 1);
}

#[test]
fn a_stopped_workers_condition_goes_unless_another_probe_writes_it() {
    let def = |t: &str| Def {
        spec: spec(serde_json::json!({"name": "p", "tcp": {"port": 1}, "conditionType": t})),
        pod: None,
        uid: None,
    };
    let desired: HashSet<String> = ["B".to_string()].into();
    assert_eq!(stale_condition(&def("A"), &desired), Some("A".into()));
    assert_eq!(stale_condition(&def("B"), &desired), None);
    let gate = Def {
        spec: spec(
            serde_json::json!({"name": "g", "pods": {"selector": {}}, "tcp": {"port": 1}, "readinessGate": "x/y"}),
        ),
        pod: Some("a/p".into()),
        uid: None,
    };
    assert_eq!(stale_condition(&gate, &HashSet::new()), None);
}

fn gated_pod(uid: &str, containers: &[&str], gate: Option<&str>) -> Pod {
    let statuses: Vec<serde_json::Value> = containers
        .iter()
        .enumerate()
        .map(|(i, id)| {
            serde_json::json!({"name": format!("c{i}"), "image": "x", "imageID": "", "ready": true,
                "restartCount": 0, "containerID": id})
        })
        .collect();
    let conditions: Vec<serde_json::Value> = gate
        .into_iter()
        .map(|g| serde_json::json!({"type": g, "status": "False"}))
        .collect();
    serde_json::from_value(serde_json::json!({
        "metadata": {"namespace": "a", "name": "p", "uid": uid},
        "spec": {"containers": []},
        "status": {"phase": "Running", "podIP": "10.0.0.1", "startTime": "2030-01-01T00:00:00Z",
                   "containerStatuses": statuses, "conditions": conditions}
    }))
    .unwrap()
}

fn gate_def(uid: &str) -> Def {
    Def {
        spec: spec(
            serde_json::json!({"name": "g", "pods": {"selector": {}}, "tcp": {"port": 1}, "readinessGate": "x/y"}),
        ),
        pod: Some("a/p".into()),
        uid: Some(uid.into()),
    }
}

#[test]
fn a_pods_identity_has_its_container_ids_and_another_uid_is_gone() {
    let now: jiff::Timestamp = "2030-01-01T00:00:30Z".parse().unwrap();
    let def = gate_def("u1");
    let id = |pod: &Pod| pod_view(&def, Some(pod), Some("x/y"), now, true).0.identity;
    let first = id(&gated_pod(
        "u1",
        &["containerd://b", "containerd://a"],
        None,
    ));
    assert_eq!(
        first.as_deref(),
        Some("u1/10.0.0.1/containerd://a,containerd://b")
    );
    assert_eq!(
        id(&gated_pod(
            "u1",
            &["containerd://a", "containerd://b"],
            None
        )),
        first,
        "the order of the statuses does not matter"
    );
    assert_ne!(
        id(&gated_pod(
            "u1",
            &["containerd://a", "containerd://c"],
            None
        )),
        first,
        "a restarted container is a new target"
    );
    let (v, _, _) = pod_view(&def, Some(&gated_pod("u1", &[], None)), None, now, true);
    assert_eq!(v.running_for, Duration::from_secs(30));
    assert!(!v.terminal);
    // A pod recreated under the same name is not this worker's pod.
    for pod in [Some(gated_pod("u2", &[], None)), None] {
        let (v, ip, _) = pod_view(&def, pod.as_ref(), Some("x/y"), now, true);
        assert!(v.terminal && v.identity.is_none() && ip.is_none(), "{v:?}");
        let mut w = Worker::new(
            Role::Readiness,
            Thresholds {
                initial_delay: Duration::ZERO,
                success: 1,
                failure: 1,
            },
            TargetKind::Pod,
        );
        assert_eq!(w.tick(&v), Tick::Stop);
        assert_eq!(
            w.to_write(Sink::ReadinessGate, false),
            None,
            "nothing written"
        );
    }
    // Whether the pod carries the gate condition already.
    let carried = |pod: &Pod| pod_view(&def, Some(pod), Some("x/y"), now, true).2;
    assert!(carried(&gated_pod("u1", &[], Some("x/y"))));
    assert!(!carried(&gated_pod("u1", &[], Some("x/other"))));
    assert!(!carried(&gated_pod("u1", &[], None)));
}

/// A pod-condition port whose first write panics; later writes are sent
/// to the test.
#[derive(Clone)]
struct PanicsOnce {
    calls: Arc<std::sync::atomic::AtomicUsize>,
    writes: tokio::sync::mpsc::UnboundedSender<(String, Option<String>, bool)>,
}

impl PodConditionPort for PanicsOnce {
    async fn set(&self, pod: &str, c: &str, passing: bool, m: &str) -> Result<(), ProbeError> {
        self.set_on(pod, None, c, passing, m).await
    }

    async fn set_on(
        &self,
        pod: &str,
        uid: Option<&str>,
        _: &str,
        passing: bool,
        _: &str,
    ) -> Result<(), ProbeError> {
        if self.calls.fetch_add(1, Ordering::SeqCst) == 0 {
            panic!("injected panic in the pod-condition port");
        }
        let _ = self
            .writes
            .send((pod.to_string(), uid.map(str::to_string), passing));
        Ok(())
    }
}

/// A task is as large as the largest state its future can wait in. A
/// worker spends nearly all its life waiting for its next tick; the
/// HTTP client's and the API client's requests (several KiB) must not
/// be part of that state, or 10,000 workers hold them all the time.
#[tokio::test]
async fn a_worker_task_is_small_between_probes() {
    use crate::report::{ReportConfig, Reporter};
    let client =
        kube::Client::try_from(kube::Config::new("http://127.0.0.1:9".parse().unwrap())).unwrap();
    let mut registry = prometheus_client::registry::Registry::default();
    let (reporter, _queue) = Reporter::new(&ReportConfig::default(), &mut registry);
    let (_pods_tx, pods) = watch::channel(None);
    let shared = Arc::new(Shared {
        probers: Probers::new(),
        reporter,
        pod_port: crate::probe::KubePodConditions::new(client),
        metrics: ProbeMetrics::register(&mut registry),
        pods,
        startup: Mutex::new(HashMap::new()),
        concurrency: Semaphore::new(MAX_CONCURRENT_PROBES),
        agent_start: Instant::now(),
        respawn: Notify::new(),
    });
    let key = || -> WorkerKey { ("web".into(), "a/p".into()) };
    let def = Arc::new(Def {
        spec: spec(serde_json::json!({"name": "web", "pods": {"selector": {}},
            "httpGet": {"port": 80}, "readinessGate": "x/y"})),
        pod: Some("a/p".into()),
        uid: None,
    });
    let stop = CancellationToken::new();
    let trigger = Arc::new(Notify::new());
    let worker = run_worker(
        shared.clone(),
        key(),
        def.clone(),
        trigger.clone(),
        stop.clone(),
        None,
    );
    let task = worker_task(
        shared,
        key(),
        def,
        trigger,
        stop,
        None,
        Arc::new(AtomicBool::new(false)),
    );
    // The worker is boxed inside the task: together what one worker
    // holds while it waits.
    let bytes = std::mem::size_of_val(&worker) + std::mem::size_of_val(&task);
    assert!(bytes <= 1536, "a worker holds {bytes} bytes of task state");
}

#[tokio::test(start_paused = true)]
async fn a_panicked_worker_is_restarted_after_a_delay() {
    use crate::report::{ReportConfig, Reporter};
    let mut registry = prometheus_client::registry::Registry::default();
    let (reporter, _queue) = Reporter::new(&ReportConfig::default(), &mut registry);
    let metrics = ProbeMetrics::register(&mut registry);
    // A readiness gate on a new pod: its initial False is written at the
    // first tick, without probing (the initial delay is long).
    let probe = spec(serde_json::json!({"name": "gate", "pods": {"selector": {}},
        "tcp": {"port": 1}, "initialDelaySeconds": 3600, "readinessGate": "x/y"}));
    let mut pod = gated_pod("u1", &["containerd://a"], None);
    pod.status.as_mut().unwrap().start_time = Some(
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::now()),
    );
    let pods: Snapshot<Pod> = [("a/p".to_string(), Arc::new(pod))].into_iter().collect();
    let (_specs_tx, specs_rx) = watch::channel(vec![probe]);
    let (_pods_tx, pods_rx) = watch::channel(Some(pods));
    let (tx, mut writes) = tokio::sync::mpsc::unbounded_channel();
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let port = PanicsOnce {
        calls: calls.clone(),
        writes: tx,
    };
    let health = crate::server::Health::new();
    let handle = ProbeHandle::default();
    let stop = CancellationToken::new();
    let manager = tokio::spawn(run_probe_manager(
        specs_rx,
        pods_rx,
        reporter,
        port,
        metrics,
        handle.clone(),
        health.register("probe-manager", Duration::from_secs(60)),
        Default::default(),
        stop.clone(),
    ));
    let t0 = Instant::now();
    let write = tokio::time::timeout(Duration::from_secs(300), writes.recv())
        .await
        .expect("the panicked worker was restarted and wrote the gate");
    assert_eq!(write, Some(("a/p".into(), Some("u1".into()), false)));
    assert_eq!(calls.load(Ordering::SeqCst), 2, "one panic, one write");
    assert!(
        t0.elapsed() >= PANIC_RESTART_DELAY,
        "restarted after the delay, not at once: {:?}",
        t0.elapsed()
    );
    let key = ("gate".to_string(), "a/p".to_string());
    assert_eq!(handle.workers().get(&key), Some(&2), "a second worker");
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(
        text.contains("nodeguard_probe_worker_panics_total{probe=\"gate\"} 1"),
        "{text}"
    );
    stop.cancel();
    manager.await.unwrap();
}
