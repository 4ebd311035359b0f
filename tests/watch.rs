//! The agent's watch loop against the real API server when the resource is
//! not served (as with the NodeGuardPolicy CRD not installed): the retries
//! slow down while the failure repeats, and the log says so once. And what
//! the pod watch keeps of each pod.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::runtime::watcher;
use kube::{Api, Client, CustomResource};
use nodeguard::k8s::watch::{keep_whole, publish_objects, trim_pod, watch_objects};
use nodeguard::server::Health;
use serde::{Deserialize, Serialize};
use support::*;
use tokio_util::sync::CancellationToken;

/// A cluster-scoped resource that no API server serves.
#[derive(CustomResource, Clone, Debug, Deserialize, Serialize, schemars::JsonSchema)]
#[kube(group = "missing.nodeguard.io", version = "v1", kind = "Missing")]
struct MissingSpec {}

/// Log lines written while the guard lives (this test's thread only).
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    /// Captures this thread's log lines, debug level up, while the guard lives.
    fn install() -> (Captured, tracing::subscriber::DefaultGuard) {
        let logs = Captured::default();
        let sink = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .with_writer(move || sink.clone())
            .finish();
        (logs, tracing::subscriber::set_default(subscriber))
    }

    fn lines(&self) -> Vec<String> {
        String::from_utf8_lossy(&self.0.lock().unwrap())
            .lines()
            .map(str::to_string)
            .collect()
    }
}

#[tokio::test]
async fn a_resource_that_is_not_served_is_retried_ever_more_slowly_and_logged_once() {
    let _ = admin_client().await;
    let (logs, _guard) = Captured::install();

    // Count the requests for the missing resource on the wire.
    let requests = Arc::new(AtomicUsize::new(0));
    let counter = requests.clone();
    let layer = tower::util::MapRequestLayer::new(move |req: http::Request<kube::client::Body>| {
        if req.uri().path().contains("/apis/missing.nodeguard.io/") {
            counter.fetch_add(1, Ordering::SeqCst);
        }
        req
    });
    let client = kube::client::ClientBuilder::try_from(admin_config().await)
        .unwrap()
        .with_layer(&layer)
        .build();
    let client: Client = client;
    let api: Api<Missing> = Api::all(client);
    let health = Health::new();
    let stop = CancellationToken::new();
    let watch = {
        let (health, stop) = (health.clone(), stop.clone());
        async move {
            watch_objects(
                api,
                watcher::Config::default(),
                keep_whole,
                health.register("missing-watch", Duration::from_secs(60)),
                stop,
                |_: &nodeguard::k8s::watch::Snapshot<Missing>| {},
            )
            .await
        }
    };
    let seconds = 12;
    let _ = tokio::time::timeout(Duration::from_secs(seconds), watch).await;
    stop.cancel();

    let sent = requests.load(Ordering::SeqCst);
    let lines = logs.lines();
    let warnings: Vec<&String> = lines
        .iter()
        .filter(|l| l.contains("WARN") && l.contains("missing-watch"))
        .collect();
    let repeats = lines
        .iter()
        .filter(|l| l.contains("watch still failing"))
        .count();
    eprintln!(
        "{sent} requests in {seconds} s; {} warning(s), {repeats} debug repeat(s)",
        warnings.len()
    );
    // Backoff from 250 ms doubling (jittered down to half at most): at most
    // 8 attempts in 12 s. Resetting on every retry sent ~5 per second.
    assert!(
        (3..=9).contains(&sent),
        "{sent} list requests in {seconds} s for a resource that is not served"
    );
    assert_eq!(warnings.len(), 1, "one warning, then quiet: {warnings:#?}");
    assert!(
        warnings[0].contains("CRD installed"),
        "the warning says what to do: {}",
        warnings[0]
    );
    assert_eq!(repeats + 1, sent, "every failed attempt is logged once");
    assert!(
        !lines.iter().any(|l| l.contains("watch recovered")),
        "nothing recovered: {lines:#?}"
    );
    assert!(!health.report().loops["missing-watch"].synced);
    assert!(health.report().live, "a failing watch is not a stuck loop");
}

#[tokio::test]
async fn a_failure_after_the_watch_worked_again_starts_a_fresh_backoff_and_warns_again() {
    let admin = admin_client().await;
    let node = TestNode::create(&admin, "rewatch", &[]).await;
    let (logs, _guard) = Captured::install();

    // While `broken`, requests for nodes go to a path the API server does
    // not serve (a 404, as a flaky proxy or a CRD briefly gone would give).
    let broken = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let failed_at = Arc::new(Mutex::new(Vec::<std::time::Instant>::new()));
    let (b, f) = (broken.clone(), failed_at.clone());
    let layer =
        tower::util::MapRequestLayer::new(move |mut req: http::Request<kube::client::Body>| {
            if b.load(Ordering::SeqCst) && req.uri().path() == "/api/v1/nodes" {
                f.lock().unwrap().push(std::time::Instant::now());
                let q = req
                    .uri()
                    .query()
                    .map(|q| format!("?{q}"))
                    .unwrap_or_default();
                *req.uri_mut() = format!("/apis/missing.nodeguard.io/v1/missings{q}")
                    .parse()
                    .unwrap();
            }
            req
        });
    let client: Client = kube::client::ClientBuilder::try_from(admin_config().await)
        .unwrap()
        .with_layer(&layer)
        .build();
    let health = Health::new();
    let stop = CancellationToken::new();
    let handle = health.register("rewatch", Duration::from_secs(60));
    let (h, s) = (handle, stop.clone());
    let name = node.name.clone();
    let task = tokio::spawn(async move {
        watch_objects(
            Api::<k8s_openapi::api::core::v1::Node>::all(client),
            // Short server-side timeouts: the watch is re-issued every 2 s,
            // so the failures hit re-watches, not lists.
            watcher::Config::default()
                .fields(&format!("metadata.name={name}"))
                .timeout(2),
            keep_whole,
            h,
            s,
            |_: &nodeguard::k8s::watch::Snapshot<k8s_openapi::api::core::v1::Node>| {},
        )
        .await
    });
    eventually(Duration::from_secs(20), "first list", || {
        std::future::ready(health.report().loops["rewatch"].synced)
    })
    .await;
    broken.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(8)).await;
    broken.store(false, Ordering::SeqCst);
    let first_run = failed_at.lock().unwrap().len();
    // The node stays quiet: the re-watches succeed and yield nothing. (A
    // failure comes back within its delay, a request's deadline and the
    // waits a shedding API server may ask for: 10 + 10 s past the delay;
    // a gap longer than that is a watch that worked.)
    tokio::time::sleep(Duration::from_secs(35)).await;
    broken.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(5)).await;
    stop.cancel();
    task.await.unwrap();
    let times = failed_at.lock().unwrap().clone();
    let second: Vec<_> = times[first_run..].to_vec();
    let warnings = logs
        .lines()
        .into_iter()
        .filter(|l| l.contains("WARN") && l.contains("rewatch") && l.contains("watch failed"))
        .count();
    eprintln!(
        "first run {first_run} failed requests; second run {} failed requests, first gap {:?}; {warnings} warnings",
        second.len(),
        second.get(1).map(|t| *t - second[0])
    );
    assert!(first_run >= 4, "the first outage was retried ({first_run})");
    assert!(
        second.len() >= 2 && second[1] - second[0] <= Duration::from_millis(600),
        "a new failure after the watch worked again is retried after a fresh, short delay: {:?}",
        second.windows(2).map(|w| w[1] - w[0]).collect::<Vec<_>>()
    );
    assert_eq!(warnings, 2, "one warning per failure run");
}

/// The pod store held whole pods, managedFields a third of them (heaptrack
/// of the idle agent, 110 pods): the agent's pod watch keeps only what its
/// readers use, while the API server still has all of it.
#[tokio::test]
async fn the_pod_watch_keeps_only_what_the_agent_reads_of_a_pod() {
    let client = admin_client().await;
    let node = TestNode::selectable(&client, "trim").await;
    let name = unique_name("trim");
    support::pods::running_pod(&client, &node.name, &name, "", serde_json::json!({})).await;
    let pods: Api<k8s_openapi::api::core::v1::Pod> =
        Api::namespaced(client.clone(), TEST_NAMESPACE);
    let served = pods.get(&name).await.unwrap();
    assert!(
        served
            .metadata
            .managed_fields
            .as_ref()
            .is_some_and(|m| !m.is_empty()),
        "the API server keeps managedFields"
    );
    let (tx, mut rx) = tokio::sync::watch::channel(None);
    let health = Health::new();
    let stop = CancellationToken::new();
    let task = tokio::spawn(publish_objects(
        Api::<k8s_openapi::api::core::v1::Pod>::all(client.clone()),
        watcher::Config::default().fields(&format!("spec.nodeName={}", node.name)),
        trim_pod,
        health.register("pod-watch", Duration::from_secs(60)),
        stop.clone(),
        tx,
    ));
    let pod = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let found = rx
                .borrow_and_update()
                .as_ref()
                .and_then(|s| s.get(&format!("{TEST_NAMESPACE}/{name}")).cloned());
            if let Some(p) = found {
                return p;
            }
            rx.changed().await.unwrap();
        }
    })
    .await
    .expect("the pod in the watch's snapshot");
    assert_eq!(pod.metadata.managed_fields, None);
    assert!(
        pod.spec.as_ref().unwrap().containers.is_empty(),
        "container specs are not kept"
    );
    assert_eq!(pod.metadata.uid, served.metadata.uid);
    assert_eq!(
        nodeguard::shutdown::cluster::pod_facts(&pod),
        nodeguard::shutdown::cluster::pod_facts(&served)
    );
    stop.cancel();
    let _ = task.await;
}
