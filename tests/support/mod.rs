//! Test support for integration tests against the real control plane
//! started by `e2e/cluster/up`. Tests that need it fail (never skip) with a
//! message saying how to start it.
#![allow(dead_code)] // each test binary uses a different part of this module

pub mod alerts;
pub mod dbus;
pub mod notify;
pub mod pods;
pub mod proxy;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Node, ServiceAccount};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::OnceCell;

/// A desired condition, as the agent's sources set it.
pub fn desired(
    status: nodeguard::report::Status,
    reason: &str,
    message: impl Into<String>,
) -> nodeguard::report::Desired {
    nodeguard::report::Desired {
        status,
        reason: reason.into(),
        message: message.into(),
    }
}

/// Namespace the tests create their namespaced objects in.
pub const TEST_NAMESPACE: &str = "nodeguard-test";

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The admin kubeconfig written by `e2e/cluster/up`.
pub fn kubeconfig_path() -> PathBuf {
    if let Ok(p) = std::env::var("NODEGUARD_TEST_KUBECONFIG") {
        return PathBuf::from(p);
    }
    let cache = std::env::var("NODEGUARD_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(std::env::var("HOME").expect("HOME is set")).join(".cache/nodeguard")
        });
    // NODEGUARD_KUBE=oldest: the oldest supported control plane, which
    // e2e/cluster/lib.sh keeps in a state directory of its own.
    let name = match std::env::var("NODEGUARD_KUBE").as_deref() {
        Ok("oldest") => "cluster-oldest",
        _ => "cluster",
    };
    let state = std::env::var("NODEGUARD_CLUSTER_STATE")
        .map(PathBuf::from)
        .unwrap_or_else(|_| cache.join(name));
    state.join("admin.kubeconfig")
}

pub async fn admin_config() -> Config {
    let path = kubeconfig_path();
    let kc = Kubeconfig::read_from(&path).unwrap_or_else(|e| {
        panic!(
            "the test control plane is not up ({}: {e}).\n\
             Start it with `e2e/cluster/up` (after `e2e/cluster/build`), or run everything with `make test`.",
            path.display()
        )
    });
    let mut config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .expect("admin kubeconfig is usable");
    // As the agent's own client: no automatic retries of 429s; but named
    // apart, so audit logs (and bench/npd.rs) tell test requests from an
    // agent process's.
    nodeguard::k8s::agent_config(&mut config);
    config
        .headers
        .retain(|(n, _)| n != http::header::USER_AGENT);
    config.headers.push((
        http::header::USER_AGENT,
        http::HeaderValue::from_static("nodeguard-tests"),
    ));
    config
}

static SETUP: OnceCell<()> = OnceCell::const_new();

/// An admin client; on first use per test binary also checks the API server
/// answers, installs the CRD from `crds/` and creates the test namespace.
pub async fn admin_client() -> Client {
    let client = Client::try_from(admin_config().await).expect("client");
    SETUP
        .get_or_init(|| async {
            client.apiserver_version().await.unwrap_or_else(|e| {
                panic!(
                    "the test control plane at {} does not answer: {e}\nStart it with `e2e/cluster/up`.",
                    kubeconfig_path().display()
                )
            });
            install_crd(&client).await;
            let ns: Api<Namespace> = Api::all(client.clone());
            let ns_obj: Namespace = serde_json::from_value(serde_json::json!({
                "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": TEST_NAMESPACE}
            }))
            .unwrap();
            ns.patch(TEST_NAMESPACE, &PatchParams::apply("nodeguard-tests").force(), &Patch::Apply(&ns_obj))
                .await
                .expect("create test namespace");
            // The ServiceAccount admission plugin rejects pods until the
            // controller manager has created the namespace's default account.
            let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), TEST_NAMESPACE);
            eventually(Duration::from_secs(30), "default service account", || async {
                sas.get_opt("default").await.ok().flatten().is_some()
            })
            .await;
        })
        .await;
    client
}

/// Applies the committed CRD file and waits until it is established.
pub async fn install_crd(client: &Client) {
    let text =
        std::fs::read_to_string(repo_root().join("crds/nodeguard.io_nodeguardpolicies.yaml"))
            .unwrap();
    let crd: CustomResourceDefinition = serde_saphyr::from_str(&text).unwrap();
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    api.patch(
        "nodeguardpolicies.nodeguard.io",
        &PatchParams::apply("nodeguard-tests").force(),
        &Patch::Apply(&crd),
    )
    .await
    .expect("the committed CRD applies to the real API server");
    eventually(Duration::from_secs(30), "CRD established", || async {
        api.get("nodeguardpolicies.nodeguard.io")
            .await
            .ok()
            .and_then(|c| c.status)
            .and_then(|s| s.conditions)
            .is_some_and(|cs| {
                cs.iter()
                    .any(|c| c.type_ == "Established" && c.status == "True")
            })
    })
    .await;
}

/// Puts the committed CRD (and its annotations) back on the cluster when
/// dropped, however the test ends: the tests and scenarios after one that
/// changes or deletes it need this tree's schema.
pub struct CommittedCrd;

impl Drop for CommittedCrd {
    fn drop(&mut self) {
        let committed = repo_root().join("crds/nodeguard.io_nodeguardpolicies.yaml");
        let _ = kubectl_status(&[
            "apply",
            "--server-side",
            "--force-conflicts",
            "-f",
            committed.to_str().unwrap(),
        ]);
    }
}

/// Polls `check` every 50 ms until it is true; panics after `timeout`.
pub async fn eventually<F, Fut>(timeout: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if check().await {
            return;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A name unique across tests and runs: `prefix-<pid>-<n>-<nanos>`.
pub fn unique_name(prefix: &str) -> String {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!("{prefix}-{}-{n}-{:x}", std::process::id(), nanos & 0xffff)
}

/// A Node object created for one test and deleted when dropped.
pub struct TestNode {
    pub name: String,
}

impl TestNode {
    pub async fn create(client: &Client, prefix: &str, labels: &[(&str, &str)]) -> TestNode {
        let name = unique_name(prefix);
        let labels: serde_json::Map<String, serde_json::Value> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), serde_json::json!(v)))
            .collect();
        let node: Node = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": labels},
        }))
        .unwrap();
        Api::<Node>::all(client.clone())
            .create(&PostParams::default(), &node)
            .await
            .expect("create test node");
        TestNode { name }
    }
}

impl Drop for TestNode {
    fn drop(&mut self) {
        let name = self.name.clone();
        with_admin_blocking(|client| async move {
            let _ = Api::<Node>::all(client)
                .delete(&name, &DeleteParams::default())
                .await;
        });
    }
}

/// Runs `clean_up` with an admin client to its end, from a `Drop`: on a
/// fresh runtime on its own thread (the test's runtime may be gone).
pub fn with_admin_blocking<F, Fut>(clean_up: F)
where
    F: FnOnce(Client) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()>,
{
    let _ = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            clean_up(Client::try_from(admin_config().await).unwrap()).await;
        });
    })
    .join();
}

/// The path a cached tool's script prints with `--path` (e2e/promtool,
/// e2e/npd-configs); fails, never skips, when the script says it is
/// missing.
pub fn cached_path(script: &str) -> PathBuf {
    let out = std::process::Command::new(repo_root().join(script))
        .arg("--path")
        .output()
        .unwrap_or_else(|e| panic!("run {script} --path: {e}"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// nodeguard's cache directory (`$NODEGUARD_CACHE`, default ~/.cache/nodeguard).
pub fn cache_dir() -> PathBuf {
    std::env::var("NODEGUARD_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/nodeguard"))
}

/// The test registry's loopback address (`127.0.0.1:PORT`) from
/// e2e/registry/up's state, when it is up.
pub fn registry_addr() -> Option<String> {
    std::fs::read_to_string(cache_dir().join("registry/addr"))
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

/// What e2e/image built, from target/image/image.env.
pub struct BuiltImage {
    /// The file itself (its mtime is the build's).
    pub env_file: PathBuf,
    /// The tag and chart version (the crate's version).
    pub version: String,
    /// The image index's digest.
    pub digest: String,
    /// The platforms in the index (`amd64`, `arm64`).
    pub platforms: Vec<String>,
}

pub fn built_image() -> BuiltImage {
    let env_file = repo_root().join("target/image/image.env");
    let text = std::fs::read_to_string(&env_file).unwrap_or_else(|e| {
        panic!(
            "{}: {e}: run e2e/image and e2e/release/publish (make test does)",
            env_file.display()
        )
    });
    let field = |k: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{k}=")))
            .unwrap_or_else(|| panic!("{k} in {}", env_file.display()))
            .trim_matches('"')
            .to_string()
    };
    BuiltImage {
        version: field("VERSION"),
        digest: field("DIGEST"),
        platforms: field("PLATFORMS")
            .split_whitespace()
            .map(String::from)
            .collect(),
        env_file,
    }
}

/// node-problem-detector's own configs (`config/*.json` of the release
/// bench/npd/go.mod pins), fetched by e2e/npd-configs.
pub fn npd_configs() -> PathBuf {
    cached_path("e2e/npd-configs")
}

/// systemd 247's journalctl (Debian bullseye's), fetched by
/// e2e/old-journalctl: the oldest systemd the journald monitors are tested on.
pub fn old_journalctl() -> PathBuf {
    cached_path("e2e/old-journalctl")
}

/// The helm e2e/cluster/build installed (or `NODEGUARD_HELM`).
/// The Kubernetes version `helm template` and client-side dry runs render
/// for (`--kube-version`): the oldest supported one, KUBE_OLDEST_VERSION in
/// e2e/cluster/versions.env. Without one Helm 3 assumes v1.20.0, which the
/// chart's `kubeVersion` refuses.
pub fn template_kube_version() -> String {
    let env = std::fs::read_to_string(repo_root().join("e2e/cluster/versions.env")).unwrap();
    env.lines()
        .find_map(|l| l.strip_prefix("KUBE_OLDEST_VERSION="))
        .expect("KUBE_OLDEST_VERSION in e2e/cluster/versions.env")
        .trim()
        .to_string()
}

pub fn helm_binary() -> PathBuf {
    if let Ok(h) = std::env::var("NODEGUARD_HELM") {
        return PathBuf::from(h);
    }
    let cache = std::env::var("NODEGUARD_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/nodeguard"));
    let helm = cache.join("bin/current/helm");
    assert!(
        helm.exists(),
        "helm is not built: run e2e/cluster/build (it installs helm into {})",
        helm.display()
    );
    helm
}

/// Runs the `nodeguard` binary: (exit code, stdout, stderr).
pub fn nodeguard(args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_nodeguard"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The value of one sample (`name{labels}` exactly as exposed) in a
/// /metrics text; None when the series is absent.
pub fn sample(metrics: &str, series: &str) -> Option<f64> {
    metrics.lines().find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .split(' ')
            .next()?
            .parse()
            .ok()
    })
}

/// A plain HTTP/1.0 GET against the agent: (status, body).
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect to agent");
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut buf = Vec::new();
    stream.read_to_end(&mut buf).await.unwrap();
    let text = String::from_utf8_lossy(&buf).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// Runs kubectl against the test cluster and returns stdout; panics with
/// stderr on failure.
pub fn kubectl(args: &[&str]) -> String {
    kubectl_status(args).unwrap_or_else(|e| panic!("kubectl {args:?} failed: {e}"))
}

/// Runs kubectl against the test cluster: stdout, or stderr on failure.
pub fn kubectl_status(args: &[&str]) -> Result<String, String> {
    let out = std::process::Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(kubeconfig_path())
        .args(args)
        .output()
        .expect("kubectl is installed");
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// A client that authenticates as a fresh ServiceAccount in the test
/// namespace (token from the TokenRequest API), with no permissions until
/// the test grants them.
pub async fn service_account_client(admin: &Client, name: &str) -> Client {
    let token = service_account_token(admin, name).await;
    let mut config = admin_config().await;
    config.auth_info = kube::config::AuthInfo {
        token: Some(token.into()),
        ..Default::default()
    };
    Client::try_from(config).unwrap()
}

/// Creates service account `name` in the test namespace; a token for it,
/// valid for an hour.
pub async fn service_account_token(admin: &Client, name: &str) -> String {
    let sas: Api<ServiceAccount> = Api::namespaced(admin.clone(), TEST_NAMESPACE);
    let sa: ServiceAccount = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}
    }))
    .unwrap();
    sas.create(&PostParams::default(), &sa)
        .await
        .expect("create service account");
    let req = k8s_openapi::api::authentication::v1::TokenRequest {
        spec: k8s_openapi::api::authentication::v1::TokenRequestSpec {
            audiences: vec![],
            expiration_seconds: Some(3600),
            ..Default::default()
        },
        ..Default::default()
    };
    sas.create_token_request(name, &PostParams::default(), &req)
        .await
        .expect("TokenRequest works against the test API server")
        .status
        .expect("token status")
        .token
}

/// Writes to `path` the test cluster's kubeconfig with `token` as its
/// credentials (for a binary run as a service account).
pub fn kubeconfig_with_token(token: &str, path: &std::path::Path) {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig_path()).unwrap();
    // Kubeconfig leaves secrets out when serialized: the token by hand.
    let mut v = serde_json::to_value(&kc).unwrap();
    for a in v["users"].as_array_mut().unwrap() {
        a["user"] = serde_json::json!({ "token": token });
    }
    std::fs::write(path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
}

/// A temporary directory removed on drop.
pub struct TempDir {
    pub path: PathBuf,
}

impl TempDir {
    pub fn new(prefix: &str) -> Self {
        let path = std::env::temp_dir().join(unique_name(prefix));
        std::fs::create_dir_all(&path).unwrap();
        TempDir { path }
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// A node-local trust that allows every request of a policy.
pub fn trust_everything() -> nodeguard::policy::NodeTrust {
    nodeguard::policy::NodeTrust {
        commands: vec!["/".into()],
        repair_units: vec!["*".into()],
        read_paths: vec!["/".into()],
        watchdog_devices: vec!["/".into()],
        logind_drop_in_dirs: vec!["/".into()],
        max_inhibit_delay_seconds: 86_400,
    }
}

/// Starts the real agent in-process for `node`, listening on a free port.
pub async fn start_agent(client: Client, node: &str) -> (nodeguard::agent::RunningAgent, TempDir) {
    start_agent_with(client, node, |_| {}).await
}

pub async fn start_agent_with(
    client: Client,
    node: &str,
    adjust: impl FnOnce(&mut nodeguard::agent::AgentConfig),
) -> (nodeguard::agent::RunningAgent, TempDir) {
    init_logs();
    let state = TempDir::new("nodeguard-state");
    let mut config = nodeguard::agent::AgentConfig::new(
        node,
        "127.0.0.1:0".parse().unwrap(),
        state.path.clone(),
    );
    // Tests of other capabilities run commands, read and write temporary
    // paths and hold long inhibitors; tests/trust.rs starts the agent with
    // the node-local trust it is about.
    config.trust = trust_everything();
    // Tests of other capabilities edit policies and wait for what follows
    // on the Node: they do not wait a policy edit's write spread, which
    // tests/policy.rs measures at its default.
    config.report.policy_spread = Duration::ZERO;
    adjust(&mut config);
    let agent = nodeguard::agent::start(config, client)
        .await
        .expect("agent starts");
    (agent, state)
}

/// Waits until the agent's pod view holds `n` pods (a shutdown plans from
/// it, so a test signals only after).
pub async fn agent_sees_pods(agent: &nodeguard::agent::RunningAgent, n: usize) {
    let mut pods = agent.pods.clone();
    eventually(
        Duration::from_secs(10),
        &format!("the agent sees {n} pod(s)"),
        || {
            std::future::ready(
                pods.borrow_and_update()
                    .as_ref()
                    .is_some_and(|p| p.len() == n),
            )
        },
    )
    .await;
}

/// The Node's conditions of `type_` (a list, to catch duplicates).
pub async fn node_conditions(
    client: &Client,
    node: &str,
    type_: &str,
) -> Vec<k8s_openapi::api::core::v1::NodeCondition> {
    Api::<Node>::all(client.clone())
        .get_status(node)
        .await
        .unwrap()
        .status
        .and_then(|s| s.conditions)
        .unwrap_or_default()
        .into_iter()
        .filter(|c| c.type_ == type_)
        .collect()
}

/// Runs `e2e/cluster/ctl ACTION COMPONENT` (stop/start a control-plane
/// component of the running test cluster).
pub fn cluster_ctl(action: &str, component: &str) {
    cluster_ctl_within(action, component, Duration::from_secs(60));
}

/// [`cluster_ctl`], waiting up to `ready` for a started API server's
/// `/readyz` (e2e/cluster/ctl's `NODEGUARD_APISERVER_READY_SECONDS`).
pub fn cluster_ctl_within(action: &str, component: &str, ready: Duration) {
    assert!(
        try_cluster_ctl(action, component, ready),
        "e2e/cluster/ctl {action} {component} failed"
    );
}

/// [`cluster_ctl_within`], saying whether it went through instead of
/// asserting it.
fn try_cluster_ctl(action: &str, component: &str, ready: Duration) -> bool {
    std::process::Command::new(repo_root().join("e2e/cluster/ctl"))
        .args([action, component])
        .env(
            "NODEGUARD_APISERVER_READY_SECONDS",
            ready.as_secs().max(1).to_string(),
        )
        .status()
        .is_ok_and(|s| s.success())
}

/// What brings the control plane back after `stopped` (the API server or
/// etcd) was stopped: `stopped` started again, and the controller manager
/// restarted, since its informers back off for up to 30 s after an outage
/// and the next test's PDB would wait on that.
fn back_steps(stopped: &'static str) -> [(&'static str, &'static str); 3] {
    [
        ("start", stopped),
        ("stop", "kube-controller-manager"),
        ("start", "kube-controller-manager"),
    ]
}

/// Brings the control plane back after `stopped` was stopped ([`back_steps`]).
pub fn back(stopped: &'static str) {
    for (action, component) in back_steps(stopped) {
        cluster_ctl(action, component);
    }
}

/// `component` (the API server or etcd) stopped until this is dropped;
/// then the control plane is brought back as [`back`] does, also when the
/// test fails. A step that fails on drop is said, not asserted: a panic
/// while the test unwinds would abort before the other guards run.
pub struct Outage(&'static str);

impl Outage {
    /// Stops `component`; brought back on drop also when the stop itself
    /// fails part way.
    pub fn begin(component: &'static str) -> Outage {
        let outage = Outage(component);
        cluster_ctl("stop", component);
        outage
    }

    /// Ends the outage as [`back`] does, asserting each step; a step that
    /// fails leaves the drop to try them all again.
    pub fn end(self) {
        back(self.0);
        std::mem::forget(self);
    }
}

impl Drop for Outage {
    fn drop(&mut self) {
        for (action, component) in back_steps(self.0) {
            if !try_cluster_ctl(action, component, Duration::from_secs(60)) {
                eprintln!("e2e/cluster/ctl {action} {component} failed");
            }
        }
    }
}

/// A child process (an agent, a lock holder), killed and reaped however
/// the test ends.
pub struct Killed(pub std::process::Child);

impl Killed {
    pub fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Killed {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Whether an agent listening on `addr` answers `/readyz` with 200 (false
/// while nothing listens there yet).
pub async fn is_ready(addr: std::net::SocketAddr) -> bool {
    tokio::net::TcpStream::connect(addr).await.is_ok() && http_get(addr, "/readyz").await.0 == 200
}

/// A ClusterRole with `rules`, bound to service account `sa` of the test
/// namespace by a ClusterRoleBinding of the same name; both deleted on
/// drop, also when the test fails.
pub struct Grant {
    pub name: String,
    binding: k8s_openapi::api::rbac::v1::ClusterRoleBinding,
    bindings: Api<k8s_openapi::api::rbac::v1::ClusterRoleBinding>,
}

impl Grant {
    pub async fn new(admin: &Client, prefix: &str, rules: serde_json::Value, sa: &str) -> Grant {
        use k8s_openapi::api::rbac::v1::ClusterRole;
        let name = unique_name(prefix);
        let role: ClusterRole = serde_json::from_value(serde_json::json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": {"name": name},
            "rules": rules,
        }))
        .unwrap();
        let binding = serde_json::from_value(serde_json::json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": TEST_NAMESPACE}],
        }))
        .unwrap();
        Api::<ClusterRole>::all(admin.clone())
            .create(&PostParams::default(), &role)
            .await
            .unwrap();
        let grant = Grant {
            name,
            binding,
            bindings: Api::all(admin.clone()),
        };
        grant.bind().await;
        grant
    }

    /// Binds the role again after [`Grant::unbind`].
    pub async fn bind(&self) {
        self.bindings
            .create(&PostParams::default(), &self.binding)
            .await
            .unwrap();
    }

    /// Takes the role away (the binding deleted, the role kept).
    pub async fn unbind(&self) {
        self.bindings
            .delete(&self.name, &DeleteParams::default())
            .await
            .unwrap();
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
        let name = self.name.clone();
        with_admin_blocking(|client| async move {
            let _ = Api::<ClusterRoleBinding>::all(client.clone())
                .delete(&name, &DeleteParams::default())
                .await;
            let _ = Api::<ClusterRole>::all(client)
                .delete(&name, &DeleteParams::default())
                .await;
        });
    }
}

/// Restarts the API server when dropped, so a failing outage test does not
/// leave it down for the tests after it.
pub struct RestartOnDrop(pub &'static str);

impl Drop for RestartOnDrop {
    fn drop(&mut self) {
        cluster_ctl("start", self.0);
    }
}

/// Agent logs in test output (shown for failing tests), filtered by RUST_LOG
/// (default: nodeguard at info).
pub fn init_logs() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("nodeguard=info"));
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_test_writer()
            .try_init();
    });
}

/// The label the policy tests select their node by (value: the node's name).
pub const TEST_NODE_LABEL: &str = "nodeguard.io/test-node";

impl TestNode {
    /// A node labelled so a policy can select it alone (see [`selecting`]).
    pub async fn selectable(client: &Client, prefix: &str) -> TestNode {
        let node = TestNode::create(client, prefix, &[]).await;
        label_node(client, &node.name, TEST_NODE_LABEL, &node.name).await;
        node
    }
}

/// A nodeSelector that matches only `node` (made by [`TestNode::selectable`]).
pub fn selecting(node: &str) -> serde_json::Value {
    serde_json::json!({"matchLabels": {TEST_NODE_LABEL: node}})
}

/// Sets one label on a Node.
pub async fn label_node(client: &Client, node: &str, key: &str, value: &str) {
    Api::<Node>::all(client.clone())
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(&serde_json::json!({"metadata": {"labels": {key: value}}})),
        )
        .await
        .expect("label the test node");
}

/// The Node's `nodeguard.io/effective-policies` annotation (the policies
/// its agent has in force, `name@generation`), if any.
pub async fn effective_policies(client: &Client, node: &str) -> Option<String> {
    Api::<Node>::all(client.clone())
        .get(node)
        .await
        .unwrap()
        .metadata
        .annotations
        .and_then(|m| m.get(nodeguard::agent::EFFECTIVE_ANNOTATION).cloned())
}

/// Creates or updates a policy (server-side apply) with `spec`.
pub async fn apply_policy(client: &Client, name: &str, spec: serde_json::Value) {
    let api: Api<nodeguard::policy::NodeGuardPolicy> = Api::all(client.clone());
    let p: nodeguard::policy::NodeGuardPolicy = serde_json::from_value(serde_json::json!({
        "apiVersion": "nodeguard.io/v1alpha1", "kind": "NodeGuardPolicy",
        "metadata": {"name": name}, "spec": spec,
    }))
    .expect("a policy");
    api.patch(
        name,
        &PatchParams::apply("nodeguard-tests").force(),
        &Patch::Apply(&p),
    )
    .await
    .expect("apply the test policy");
}

/// Deletes a test policy; best effort, for the end of a test.
pub async fn delete_policy(client: &Client, name: &str) {
    let api: Api<nodeguard::policy::NodeGuardPolicy> = Api::all(client.clone());
    let _ = api.delete(name, &DeleteParams::default()).await;
}

/// Status of a Node condition, if present.
pub async fn condition_status(client: &Client, node: &str, type_: &str) -> Option<String> {
    node_conditions(client, node, type_)
        .await
        .first()
        .map(|c| c.status.clone())
}

/// The Node's condition `type_` as (status, reason, message).
pub async fn condition(
    client: &Client,
    node: &str,
    type_: &str,
) -> Option<(String, String, String)> {
    node_conditions(client, node, type_).await.first().map(|c| {
        (
            c.status.clone(),
            c.reason.clone().unwrap_or_default(),
            c.message.clone().unwrap_or_default(),
        )
    })
}

/// Waits until the Node's condition `type_` has `status`; panics with `what` after `timeout`.
pub async fn wait_condition(
    client: &Client,
    node: &str,
    type_: &str,
    status: &str,
    timeout: Duration,
    what: &str,
) {
    eventually(timeout, what, || condition_is(client, node, type_, status)).await;
}

/// Whether the Node's condition `type_` is present with `status`.
pub async fn condition_is(client: &Client, node: &str, type_: &str, status: &str) -> bool {
    condition_status(client, node, type_).await.as_deref() == Some(status)
}

/// Whether the Node carries a taint with `key`.
pub fn has_taint(node: &Node, key: &str) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|ts| ts.iter().any(|t| t.key == key))
}

/// What a Node shows of a monitor: its Events of `reasons` (reason:
/// message) and the conditions of `types` (type=status reason: message),
/// sorted.
pub async fn shown(
    admin: &kube::Client,
    node: &str,
    types: &[String],
    reasons: &[String],
) -> (Vec<String>, Vec<String>) {
    use k8s_openapi::api::core::v1::{Event, Node};
    let events: kube::Api<Event> = kube::Api::all(admin.clone());
    let list = events
        .list(&kube::api::ListParams::default().fields(&format!("involvedObject.name={node}")))
        .await
        .unwrap();
    let mut ev: Vec<String> = list
        .items
        .iter()
        .filter(|e| e.reason.as_ref().is_some_and(|r| reasons.contains(r)))
        .map(|e| {
            // The source component too: NPD's users route and filter on it.
            format!(
                "{}: {} (from {})",
                e.reason.clone().unwrap_or_default(),
                e.message.clone().unwrap_or_default(),
                e.source
                    .as_ref()
                    .and_then(|s| s.component.as_deref())
                    .unwrap_or("-")
            )
        })
        .collect();
    ev.sort();
    ev.dedup();
    let n = kube::Api::<Node>::all(admin.clone())
        .get(node)
        .await
        .unwrap();
    let mut conds: Vec<String> = n
        .status
        .and_then(|s| s.conditions)
        .unwrap_or_default()
        .into_iter()
        .filter(|c| types.contains(&c.type_))
        .map(|c| {
            format!(
                "{}={} {}: {}",
                c.type_,
                c.status,
                c.reason.unwrap_or_default(),
                c.message.unwrap_or_default()
            )
        })
        .collect();
    conds.sort();
    (ev, conds)
}

/// The directory bench/npd-build fills with node-problem-detector's
/// binaries (building them when they are missing).
pub fn npd_build_dir() -> PathBuf {
    let out = std::process::Command::new(repo_root().join("bench/npd-build"))
        .output()
        .expect("run bench/npd-build");
    assert!(
        out.status.success(),
        "bench/npd-build: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// node-problem-detector running for `node` on the test control plane
/// (with the admin kubeconfig), killed however the test ends.
pub struct Npd {
    child: std::process::Child,
    pub log: PathBuf,
    /// Its Prometheus exporter (`--prometheus-port`).
    pub metrics: std::net::SocketAddr,
}

impl Npd {
    /// Starts `binary` with `monitors` (NPD's `--config.*` flags); its
    /// output goes to `log`.
    pub fn start(binary: &std::path::Path, node: &str, monitors: &[String], log: PathBuf) -> Npd {
        let kubeconfig = kubeconfig_path();
        let apiserver = std::fs::read_to_string(&kubeconfig)
            .unwrap()
            .lines()
            .find_map(|l| l.trim().strip_prefix("server: ").map(str::to_string))
            .unwrap();
        let free = || {
            std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port()
        };
        let out = std::fs::File::create(&log).unwrap();
        let metrics_port = free();
        let child = std::process::Command::new(binary)
            .arg(format!("--hostname-override={node}"))
            .arg(format!(
                "--apiserver-override={apiserver}?inClusterConfig=false&auth={}",
                kubeconfig.display()
            ))
            .args(monitors)
            .args(["--address=127.0.0.1", &format!("--port={}", free())])
            .args([
                "--prometheus-address=127.0.0.1",
                &format!("--prometheus-port={metrics_port}"),
            ])
            .stdin(std::process::Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .expect("start node-problem-detector");
        Npd {
            child,
            log,
            metrics: ([127, 0, 0, 1], metrics_port).into(),
        }
    }

    /// What it logged so far.
    pub fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Npd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The samples of metric `name` in a Prometheus or OpenMetrics scrape, as
/// `name{labels sorted} value` lines, sorted (label order and the
/// exposition format's details aside, two exporters' series compare).
pub fn samples_of(scrape: &str, name: &str) -> Vec<String> {
    let mut out: Vec<String> = scrape
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (metric, labels) = match series.split_once('{') {
                Some((m, rest)) => (m, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            if metric != name {
                return None;
            }
            let mut labels: Vec<&str> = labels.split(',').filter(|l| !l.is_empty()).collect();
            labels.sort();
            let value: f64 = value.parse().ok()?;
            Some(format!("{name}{{{}}} {value}", labels.join(",")))
        })
        .collect();
    out.sort();
    out
}

/// What node-problem-detector and nodeguard each wrote (`shown`), row by
/// row: yes/no on each side and the verdict, as a Markdown table.
pub fn oracle_table(npd: &(Vec<String>, Vec<String>), ng: &(Vec<String>, Vec<String>)) -> String {
    let mut all: Vec<&String> = npd
        .0
        .iter()
        .chain(&ng.0)
        .chain(&npd.1)
        .chain(&ng.1)
        .collect();
    all.sort();
    all.dedup();
    let mut table = String::from(
        "| what | node-problem-detector | nodeguard (import-npd) | verdict |\n|---|---|---|---|\n",
    );
    for row in all {
        let in_npd = npd.0.contains(row) || npd.1.contains(row);
        let in_ng = ng.0.contains(row) || ng.1.contains(row);
        table.push_str(&format!(
            "| {} | {} | {} | {} |\n",
            row.replace('|', "\\|"),
            if in_npd { "yes" } else { "no" },
            if in_ng { "yes" } else { "no" },
            if in_npd == in_ng { "same" } else { "DIFFERENT" }
        ));
    }
    table
}

/// Appends one journal entry of this boot, from `identifier` at `at_usec`
/// (microseconds since the epoch), to the journal file `remote.journal` in
/// `dir`, as journald would write it (systemd-journal-remote writes the
/// same format). One file, as journald keeps: entries of separate files
/// have separate sequence-number ids, and journalctl's `--after-cursor`
/// then gave again entries of other files written before the cursor's.
pub fn journal_entry(dir: &std::path::Path, identifier: &str, message: &str, at_usec: u64) {
    // journalctl --follow reads the current boot, as on a real node.
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .unwrap()
        .trim()
        .replace('-', "");
    journal_entry_of_boot(dir, identifier, message, at_usec, &boot);
}

/// `journal_entry` of boot `boot` (32 hex digits).
pub fn journal_entry_of_boot(
    dir: &std::path::Path,
    identifier: &str,
    message: &str,
    at_usec: u64,
    boot: &str,
) {
    use std::io::Write as _;
    use std::process::{Command, Stdio};
    let export = format!(
        "__REALTIME_TIMESTAMP={at_usec}\nMESSAGE={message}\nSYSLOG_IDENTIFIER={identifier}\n_BOOT_ID={boot}\n_HOSTNAME=test\n\n"
    );
    // Without compact mode (systemd 252's default), which journalctl before
    // 252 cannot read: the files are readable by systemd 247 too.
    let mut child = Command::new("/lib/systemd/systemd-journal-remote")
        .env("SYSTEMD_JOURNAL_COMPACT", "0")
        .arg(format!("--output={}/remote.journal", dir.display()))
        .arg("-")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("systemd-journal-remote is installed (e2e/setup installs it)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(export.as_bytes())
        .unwrap();
    assert!(child.wait().unwrap().success());
}

/// A tmpfs of `size` mounted on a new directory, unmounted when dropped:
/// a state directory that can really fill up or turn read-only.
pub struct SmallFs {
    pub dir: TempDir,
}

impl SmallFs {
    pub fn mount(size: &str) -> Self {
        let dir = TempDir::new("small-fs");
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&dir.path)
            .output()
            .expect("mount is installed");
        assert!(
            out.status.success(),
            "this test mounts a tmpfs (root with CAP_SYS_ADMIN, as make test runs): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        SmallFs { dir }
    }

    pub fn remount(&self, option: &str) {
        let out = std::process::Command::new("mount")
            .args(["-o", &format!("remount,{option}")])
            .arg(&self.dir.path)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Fills the filesystem with one file; returns it.
    pub fn fill(&self) -> std::path::PathBuf {
        let filler = self.dir.path.join("filler");
        let mut f = std::fs::File::create(&filler).unwrap();
        let block = vec![0u8; 4096];
        loop {
            if let Err(e) = std::io::Write::write_all(&mut f, &block) {
                assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}");
                break;
            }
        }
        let _ = std::io::Write::flush(&mut f);
        filler
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg(&self.dir.path)
            .status();
    }
}

/// How many times the Node got Events of `reason` (repeats folded into a
/// series count as their count).
pub fn node_event_count(node: &str, reason: &str) -> (u64, String) {
    let out = kubectl(&[
        "get",
        "events",
        "-A",
        "--field-selector",
        &format!("reason={reason},involvedObject.name={node}"),
        "-o",
        "json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let items = v["items"].as_array().cloned().unwrap_or_default();
    let count = items
        .iter()
        .map(|e| {
            e["series"]["count"]
                .as_u64()
                .or(e["count"].as_u64())
                .unwrap_or(1)
        })
        .sum();
    let notes = items
        .iter()
        .map(|e| e["message"].as_str().unwrap_or_default().to_string())
        .collect::<Vec<_>>()
        .join("\n");
    (count, notes)
}

/// Writes what an agent of an earlier run or boot saved for `monitor`
/// under `state_dir` (the agent's own layout: `monitors/<name>.json`).
pub fn write_saved_state(state_dir: &std::path::Path, monitor: &str, state: serde_json::Value) {
    let dir = state_dir.join("monitors");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(format!("{monitor}.json")), state.to_string()).unwrap();
}

/// The API server's audit log entries of completed requests.
/// The Event of `reason` about Node `node` (events.k8s.io view), if stored.
pub async fn node_event(
    admin: &kube::Client,
    node: &str,
    reason: &str,
) -> Option<k8s_openapi::api::events::v1::Event> {
    let events: kube::Api<k8s_openapi::api::events::v1::Event> =
        kube::Api::namespaced(admin.clone(), "default");
    events
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .find(|e| {
            e.reason.as_deref() == Some(reason)
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(node)
        })
}

/// The completed requests in the API server's audit log whose line names
/// one of `about` (a Node's, a pod's or an Event's name): only those lines
/// are parsed. After a fleet bench the log holds hundreds of MB (it
/// rotates at 200 MB), and parsing all of it took longer than the tests'
/// waits for an entry.
pub fn audit_completed(about: &[&str]) -> Vec<serde_json::Value> {
    let log = kubeconfig_path().parent().unwrap().join("logs/audit.log");
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    text.lines()
        .filter(|l| about.iter().any(|name| l.contains(name)))
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| e["stage"] == "ResponseComplete")
        .collect()
}

/// Writes (create, update, patch) of Node `node`, any subresource, in the
/// API server's audit log: `(subresource, stageTimestamp)` of each.
pub fn audit_node_writes(node: &str) -> Vec<(String, String)> {
    audit_completed(&[node])
        .into_iter()
        .filter(|e| {
            ["create", "update", "patch"].contains(&e["verb"].as_str().unwrap_or(""))
                && e["objectRef"]["resource"] == "nodes"
                && e["objectRef"]["name"] == node
        })
        .map(|e| {
            (
                e["objectRef"]["subresource"]
                    .as_str()
                    .unwrap_or("")
                    .to_string(),
                e["stageTimestamp"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect()
}
