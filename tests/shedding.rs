//! The API server sheds load: API Priority and Fairness turns requests
//! away with 429 and `Retry-After`, and the agent's client waits as asked
//! and sends them again, while a PodDisruptionBudget's 429 still reaches
//! the shutdown manager at once, and the watchdog's API check is answered
//! at once while its account is shed (by the `exempt` level). Against the real API server, with a
//! priority level of its own for the test's ServiceAccount that rejects
//! what it cannot seat.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::flowcontrol::v1::{FlowSchema, PriorityLevelConfiguration};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::RoleBinding;
use kube::api::{DeleteParams, EvictParams, ListParams, PostParams};
use kube::{Api, Client};
use nodeguard::k8s::deadline::{API_DEADLINE, with_deadline};
use nodeguard::k8s::retry_after::{ShedMetrics, with_retry_after};
use nodeguard::watchdog::{ApiProbe, KubeApiProbe};
use support::pods::{delete_pdb, ensure_priority_class, pdb_keeping_one, running_pod};
use support::*;
use tokio_util::sync::CancellationToken;

/// The tests run one after the other: the flood of one would slow the
/// others' timing, and one stops the controller manager.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// `client` with the agent's request deadline, each answer shown to
/// `look` before the caller (or a wrapper) gets it.
fn looked_at<F>(client: Client, look: F) -> Client
where
    F: Fn(&http::Response<kube::client::Body>) + Clone + Send + Sync + 'static,
{
    let deadline = with_deadline(client, API_DEADLINE);
    let service = tower::service_fn(move |req: http::Request<kube::client::Body>| {
        let (client, look) = (deadline.clone(), look.clone());
        async move {
            let resp = client.send(req).await?;
            look(&resp);
            Ok::<_, kube::Error>(resp)
        }
    });
    Client::new(service, "default")
}

/// The agent's client as `agent::start` makes it for its loops, with a
/// look at each answer before the wrapper sees it: `on_shed` gets each
/// 429's `Retry-After`.
fn agents_client<F>(client: Client, metrics: &ShedMetrics, on_shed: F) -> Client
where
    F: Fn(Option<String>) + Clone + Send + Sync + 'static,
{
    let look = looked_at(client, move |resp| {
        if resp.status() == 429 {
            on_shed(
                resp.headers()
                    .get("retry-after")
                    .map(|v| v.to_str().unwrap_or("?").to_string()),
            );
        }
    });
    with_retry_after(look, metrics.clone(), CancellationToken::new())
}

/// A priority level with one nominal share, that neither lends nor
/// borrows seats and rejects (no queues) what it cannot seat, and a
/// FlowSchema putting `account`'s requests in it. Deleted on drop.
struct SheddingLevel {
    name: String,
    /// The level's UID, as the API server names it in each answer's
    /// `X-Kubernetes-PF-PriorityLevel-UID`.
    uid: String,
}

impl SheddingLevel {
    async fn create(admin: &Client, account: &str) -> SheddingLevel {
        let name = unique_name("shed");
        let levels: Api<PriorityLevelConfiguration> = Api::all(admin.clone());
        let level: PriorityLevelConfiguration = serde_json::from_value(serde_json::json!({
            "apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "PriorityLevelConfiguration",
            "metadata": {"name": name},
            "spec": {"type": "Limited", "limited": {
                "nominalConcurrencyShares": 1, "lendablePercent": 0, "borrowingLimitPercent": 0,
                "limitResponse": {"type": "Reject"}}},
        }))
        .unwrap();
        let uid = levels
            .create(&PostParams::default(), &level)
            .await
            .unwrap()
            .metadata
            .uid
            .unwrap();
        let schemas: Api<FlowSchema> = Api::all(admin.clone());
        let schema: FlowSchema = serde_json::from_value(serde_json::json!({
            "apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "FlowSchema",
            "metadata": {"name": name},
            "spec": {
                "priorityLevelConfiguration": {"name": name},
                "matchingPrecedence": 50,
                "distinguisherMethod": {"type": "ByUser"},
                "rules": [{
                    "subjects": [{"kind": "ServiceAccount",
                                  "serviceAccount": {"name": account, "namespace": TEST_NAMESPACE}}],
                    "resourceRules": [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"],
                                       "namespaces": ["*"], "clusterScope": true}],
                    "nonResourceRules": [{"verbs": ["get"], "nonResourceURLs": ["/version", "/livez"]}],
                }],
            },
        }))
        .unwrap();
        schemas
            .create(&PostParams::default(), &schema)
            .await
            .unwrap();
        SheddingLevel { name, uid }
    }
}

impl Drop for SheddingLevel {
    fn drop(&mut self) {
        let name = self.name.clone();
        with_admin_blocking(|client| async move {
            let dp = DeleteParams::default();
            let _ = Api::<FlowSchema>::all(client.clone())
                .delete(&name, &dp)
                .await;
            let _ = Api::<PriorityLevelConfiguration>::all(client)
                .delete(&name, &dp)
                .await;
        });
    }
}

/// A ServiceAccount allowed to read the test namespace (`view`).
async fn viewer(admin: &Client) -> (String, Client) {
    let account = unique_name("shed-viewer");
    let client = service_account_client(admin, &account).await;
    let bindings: Api<RoleBinding> = Api::namespaced(admin.clone(), TEST_NAMESPACE);
    let binding: RoleBinding = serde_json::from_value(serde_json::json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": account},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "view"},
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": TEST_NAMESPACE}],
    }))
    .unwrap();
    bindings
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), TEST_NAMESPACE);
    eventually(Duration::from_secs(20), "the binding in force", || async {
        pods.list(&ListParams::default().limit(1)).await.is_ok()
    })
    .await;
    (account, client)
}

/// Requests from `client` in a loop on `tasks` tasks until `stop`: GETs of
/// the test namespace's pods, each answer's code read raw (no retries).
/// Counts the 429s.
fn flood(
    client: &Client,
    tasks: usize,
    stop: &Arc<AtomicBool>,
    shed: &Arc<AtomicU64>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..tasks)
        .map(|_| {
            let (client, stop, shed) = (client.clone(), stop.clone(), shed.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let req =
                        http::Request::get(format!("/api/v1/namespaces/{TEST_NAMESPACE}/pods"))
                            .body(Vec::new())
                            .unwrap();
                    // An error ends the task: once a failing test's
                    // runtime shuts down, every send fails at once, and a
                    // loop that never waits would hold the shutdown forever.
                    let Ok(resp) = client.send(req.map(Into::into)).await else {
                        break;
                    };
                    if resp.status() == 429 {
                        shed.fetch_add(1, Ordering::Relaxed);
                    }
                    // Read to its end, the connection serves the next.
                    let _ = resp.into_body().collect_bytes().await;
                }
            })
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_the_api_server_sheds_goes_again_after_the_wait_it_asked_for() {
    let _one = ONE_AT_A_TIME.lock().await;
    let admin = admin_client().await;
    let (account, raw) = viewer(&admin).await;
    let _level = SheddingLevel::create(&admin, &account).await;
    // The flood fills the level's seats until the API server sheds it.
    let (stop, shed) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicU64::new(0)),
    );
    let flooding = flood(&raw, 24, &stop, &shed);
    eventually(
        Duration::from_secs(30),
        "the API server sheds the flood (429)",
        || async { shed.load(Ordering::Relaxed) > 0 },
    )
    .await;

    // The same account through the agent's client, while the flood goes
    // on, until one of its requests is shed: the flood stops then (before
    // the wrapper decides to wait), and that request goes again after the
    // wait asked for and gets its answer.
    let metrics = ShedMetrics::default();
    let asked = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let on_shed = {
        let (stop, asked) = (stop.clone(), asked.clone());
        move |after: Option<String>| {
            stop.store(true, Ordering::Relaxed);
            asked.lock().unwrap().push(after.unwrap_or_default());
        }
    };
    let client = agents_client(raw.clone(), &metrics, on_shed);
    let pods: Api<Pod> = Api::namespaced(client, TEST_NAMESPACE);
    let deadline = Instant::now() + Duration::from_secs(60);
    let (answer, took) = loop {
        assert!(
            Instant::now() < deadline,
            "no request through the agent's client was shed in 60 s ({} of the flood were)",
            shed.load(Ordering::Relaxed)
        );
        let sent = Instant::now();
        let answer = pods.list(&ListParams::default()).await;
        if asked.lock().unwrap().is_empty() {
            answer.expect("an answer that was not shed is a list");
            continue;
        }
        break (answer, sent.elapsed());
    };
    for task in flooding {
        task.await.unwrap();
    }
    let asked = asked.lock().unwrap().clone();
    assert!(
        answer.is_ok(),
        "the shed request failed (Retry-After {asked:?}): {:?}",
        answer.err()
    );
    let (waits, waited) = (metrics.waited(), metrics.wait_seconds());
    assert_eq!(waits as usize, asked.len(), "one wait per 429 ({asked:?})");
    assert_eq!(metrics.handed_over(), 0);
    // Each wait is at least what its 429 asked, and the answer came after.
    let asked_secs: u64 = asked.iter().map(|a| a.parse::<u64>().unwrap().max(1)).sum();
    assert!(
        waited >= asked_secs as f64 && took.as_secs_f64() >= waited,
        "answered after {took:?}, {waits} waits of {waited} s in all, asked {asked:?}"
    );
    eprintln!(
        "shed: {} flood requests answered 429; the agent's request was shed {} time(s) (Retry-After {asked:?}), waited {waited:.2} s, answered after {took:?}",
        shed.load(Ordering::Relaxed),
        asked.len()
    );
}

/// An eviction through the agent's client, refused by a PDB: its error,
/// how long it took, and the waits the client made.
async fn evict(client: &Client, pod: &str) -> (kube::Error, Duration, u64) {
    let metrics = ShedMetrics::default();
    let client = agents_client(client.clone(), &metrics, |_| {});
    let pods: Api<Pod> = Api::namespaced(client, TEST_NAMESPACE);
    let sent = Instant::now();
    let refused = pods.evict(pod, &EvictParams::default()).await;
    let took = sent.elapsed();
    (
        refused.expect_err("the PDB refuses the eviction"),
        took,
        metrics.waited() + metrics.handed_over(),
    )
}

/// The eviction of `pod` sent raw: the answer's code, content type and
/// Retry-After.
async fn evict_raw(client: &Client, pod: &str) -> (u16, Option<String>, Option<String>) {
    let body = serde_json::json!({
        "apiVersion": "policy/v1", "kind": "Eviction",
        "metadata": {"name": pod, "namespace": TEST_NAMESPACE}});
    let req = http::Request::post(format!(
        "/api/v1/namespaces/{TEST_NAMESPACE}/pods/{pod}/eviction"
    ))
    .header("content-type", "application/json")
    .body(serde_json::to_vec(&body).unwrap())
    .unwrap();
    let resp = client.send(req.map(Into::into)).await.unwrap();
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .map(|v| v.to_str().unwrap().to_string())
    };
    (
        resp.status().as_u16(),
        header("content-type"),
        header("retry-after"),
    )
}

#[tokio::test]
async fn a_disruption_budgets_refusal_reaches_the_caller_at_once() {
    let _one = ONE_AT_A_TIME.lock().await;
    let admin = admin_client().await;
    let node = TestNode::create(&admin, "shed-pdb", &[]).await;
    ensure_priority_class(&admin, "nodeguard-test-low", 0).await;
    let (app, pod) = (unique_name("shed-app"), unique_name("shed-kept"));
    running_pod(
        &admin,
        &node.name,
        &pod,
        "nodeguard-test-low",
        serde_json::json!({"app": app}),
    )
    .await;

    // No disruption allowed: a JSON Status, no Retry-After.
    let pdb = pdb_keeping_one(&admin, "shed-pdb", &app).await;
    let (code, kind, after) = evict_raw(&admin, &pod).await;
    assert_eq!(code, 429);
    assert!(
        kind.as_deref()
            .is_some_and(|k| k.starts_with("application/json")),
        "{kind:?}"
    );
    eprintln!("a PDB allowing no disruption: Retry-After {after:?}");
    let (err, took, waits) = evict(&admin, &pod).await;
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 429),
        "{err:?}"
    );
    assert_eq!(waits, 0);
    // At once: a wait would take the 10 s asked.
    assert!(took < Duration::from_secs(5), "the refusal took {took:?}");
    delete_pdb(&admin, &pdb).await;

    // A budget the controller manager has not processed yet (it is
    // stopped): the API server asks for 10 s, and the eviction's caller
    // still gets the refusal at once.
    cluster_ctl("stop", "kube-controller-manager");
    let restart = RestartOnDrop("kube-controller-manager");
    let unprocessed = unique_name("shed-pdb");
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(admin.clone(), TEST_NAMESPACE);
    let budget: PodDisruptionBudget = serde_json::from_value(serde_json::json!({
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": {"name": unprocessed},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": app}}},
    }))
    .unwrap();
    pdbs.create(&PostParams::default(), &budget).await.unwrap();
    let (code, kind, after) = evict_raw(&admin, &pod).await;
    assert_eq!(
        (code, after.as_deref()),
        (429, Some("10")),
        "a budget being processed asks for 10 s ({kind:?})"
    );
    let (err, took, waits) = evict(&admin, &pod).await;
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 429),
        "{err:?}"
    );
    assert_eq!(waits, 0, "a PDB's refusal was waited out");
    // At once: a wait would take the 10 s asked.
    assert!(took < Duration::from_secs(5), "the refusal took {took:?}");
    drop(restart);
    delete_pdb(&admin, &unprocessed).await;
    let _ = Api::<Pod>::namespaced(admin, TEST_NAMESPACE)
        .delete(&pod, &DeleteParams::default().grace_period(0))
        .await;
}

/// The priority level that served an answer, as the API server names it.
fn priority_level(resp: &http::Response<kube::client::Body>) -> Option<String> {
    resp.headers()
        .get("x-kubernetes-pf-prioritylevel-uid")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

/// The UID of a priority level the API server keeps itself (`exempt`).
async fn level_uid(admin: &Client, name: &str) -> String {
    Api::<PriorityLevelConfiguration>::all(admin.clone())
        .get(name)
        .await
        .unwrap()
        .metadata
        .uid
        .unwrap()
}

/// Each answer's code and the priority level that served it, as the
/// watchdog's probe got them: the probe as the agent makes it (the client
/// with its deadline, no waits) with a look at each answer.
type Answers = Arc<std::sync::Mutex<Vec<(u16, Option<String>)>>>;

fn watched_probe(client: &Client) -> (KubeApiProbe, Answers) {
    let answers = Answers::default();
    let seen = answers.clone();
    let client = looked_at(client.clone(), move |resp| {
        seen.lock()
            .unwrap()
            .push((resp.status().as_u16(), priority_level(resp)));
    });
    (KubeApiProbe(client), answers)
}

/// `requireApiServer` withholds the watchdog's pets while the API server
/// does not answer. An API server shedding load answers: a fleet
/// reconnecting at once after a control-plane restart must not reset its
/// nodes. The test's level takes the account's `/version` and `/livez`
/// too, but the API server's own `probes` FlowSchema comes first (its
/// precedence is 2) and exempts `/livez`: each answer names the level that
/// served it, and the test checks it is `exempt` for the probe and its own
/// for the shed `/version`. While the account's `/version` is shed, the
/// probe is answered, 200, at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_watchdogs_api_check_is_answered_while_the_agents_account_is_shed() {
    let _one = ONE_AT_A_TIME.lock().await;
    let admin = admin_client().await;
    let (account, raw) = viewer(&admin).await;
    let level = SheddingLevel::create(&admin, &account).await;
    let exempt = level_uid(&admin, "exempt").await;
    let (stop, shed) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicU64::new(0)),
    );
    let flooding = flood(&raw, 24, &stop, &shed);
    eventually(
        Duration::from_secs(30),
        "the API server sheds the flood (429)",
        || async { shed.load(Ordering::Relaxed) > 0 },
    )
    .await;

    let (probe, answers) = watched_probe(&raw);
    let deadline = with_deadline(raw.clone(), API_DEADLINE);
    let version = || async {
        let req = http::Request::get("/version").body(Vec::new()).unwrap();
        let resp = deadline.send(req.map(Into::into)).await.unwrap();
        let answer = (resp.status().as_u16(), priority_level(&resp));
        let _ = resp.into_body().collect_bytes().await;
        answer
    };
    let until = Instant::now() + Duration::from_secs(60);
    let (mut probes, mut version_shed, mut slowest) = (0, 0, Duration::ZERO);
    while version_shed == 0 || probes < 20 {
        assert!(
            Instant::now() < until,
            "{probes} probes; the account's /version shed {version_shed} times in 60 s ({} of the flood were)",
            shed.load(Ordering::Relaxed)
        );
        let (code, served_by) = version().await;
        if code == 429 {
            assert_eq!(
                served_by.as_deref(),
                Some(level.uid.as_str()),
                "the shed /version was served by the test's level"
            );
            version_shed += 1;
        }
        let before = answers.lock().unwrap().len();
        let sent = Instant::now();
        let reachable = probe.reachable().await;
        slowest = slowest.max(sent.elapsed());
        let answer = answers.lock().unwrap()[before..].last().cloned();
        assert!(
            reachable && answer == Some((200, Some(exempt.clone()))),
            "probe {probes}: the API server answered {answer:?}, exempt is {exempt} (reachable: {reachable})"
        );
        probes += 1;
    }
    stop.store(true, Ordering::Relaxed);
    for task in flooding {
        task.await.unwrap();
    }
    // Exempt from queuing, but the API server's own work on a loaded
    // 2-core machine still counts.
    assert!(slowest < Duration::from_secs(4), "a probe took {slowest:?}");
    eprintln!(
        "watchdog API check: {probes} probes answered 200 by the exempt level (slowest {slowest:?}) while the account's /version was shed {version_shed} times and the flood {} times",
        shed.load(Ordering::Relaxed)
    );
}
