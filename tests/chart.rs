//! The Helm chart with the real `helm` binary against the real API server:
//! lint, schema errors, server-side dry runs, the rendered manifests, a real
//! install, and least privilege: a token of the chart's service account
//! bound to a pod on node A lets the agent's own calls change node A and
//! nothing of node B.

mod support;

use std::process::Command;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use kube::api::{DeleteParams, PostParams};
use kube::{Api, Client};
use nodeguard::report::{StatusPort, Written};
use nodeguard::shutdown::ClusterPort;
use nodeguard::shutdown::cluster::KubeCluster;
use support::*;

/// Installs of the chart in this file, one at a time: each install's
/// ValidatingAdmissionPolicies are cluster-wide, so one release's
/// `policyAuthority.groups` would be judged by another's policy too.
static INSTALL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Uninstalls a release when dropped, so a failing test leaves no
/// cluster-wide admission policy behind for the tests after it. Without
/// the pre-delete hook, here and below: no agent runs against this API
/// server (the hook's Job would wait for a kubelet); tests/uninstall.rs and
/// the VM scenario `kube-install` run it.
struct Uninstall {
    release: String,
    namespace: String,
}

impl Drop for Uninstall {
    fn drop(&mut self) {
        let _ = helm(&[
            "uninstall",
            &self.release,
            "-n",
            &self.namespace,
            "--no-hooks",
        ]);
        admission_policies_are_gone();
    }
}

/// Returns once no release's admission policy judges NodeGuardPolicies any
/// more. The API server drops a deleted ValidatingAdmissionPolicy from its
/// cache a moment after the delete; until then the next test's writes are
/// judged by it (a stale policy of an uninstalled release once refused a
/// write naming its own ClusterRole, not the new release's). The witness is
/// a user whom RBAC alone lets write policies: its exec probe passes only
/// when no admission policy is left.
fn admission_policies_are_gone() {
    const WRITER: &str = "nodeguard-test-plain-writer";
    let _ = kubectl_status(&[
        "create",
        "clusterrole",
        WRITER,
        "--verb=get,list,create,update,patch,delete",
        "--resource=nodeguardpolicies.nodeguard.io",
    ]);
    let _ = kubectl_status(&[
        "create",
        "clusterrolebinding",
        WRITER,
        "--clusterrole",
        WRITER,
        "--user",
        WRITER,
    ]);
    let probe = unique_name("admission-gone");
    let policy = policy_yaml(
        &probe,
        "  probes:\n  - {name: x, exec: {command: [/usr/local/bin/check]}, conditionType: X}\n",
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        match apply_as(WRITER, &[], &policy) {
            Ok(()) => break,
            Err(e) if std::time::Instant::now() > deadline => {
                panic!(
                    "an uninstalled release's admission policy still judges writes after 30 s: {e}"
                )
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
    let _ = kubectl_status(&["delete", "nodeguardpolicy", &probe, "--ignore-not-found"]);
}

fn chart() -> String {
    repo_root().join("charts/nodeguard").display().to_string()
}

/// `helm ARGS` against the test cluster. A `helm template` that names no
/// `--kube-version` renders for the oldest supported one, as README tells
/// `helm template` users to.
fn helm(args: &[&str]) -> (bool, String, String) {
    let mut cmd = Command::new(helm_binary());
    cmd.arg("--kubeconfig").arg(kubeconfig_path()).args(args);
    if args.first() == Some(&"template") && !args.contains(&"--kube-version") {
        cmd.args(["--kube-version", &template_kube_version()]);
    }
    let out = cmd.output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn kubectl_stdin(args: &[&str], input: &str) -> (bool, String) {
    use std::io::Write;
    let mut child = Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(kubeconfig_path())
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

const ALL_FEATURES: &str = "host:\n  dbus: {enabled: true}\n  logindDropIn: {enabled: true}\n  watchdog: {enabled: true}\n  kmsg: {enabled: true}\n  journal: {enabled: true}\n  logs: {enabled: true}\n  plugins: {enabled: true, hostRoot: true}\ndefaultPolicy: {enabled: true}\nmetrics:\n  service: {enabled: true}\n  podMonitor: {enabled: true}\ndashboard: {enabled: true}\n";

/// A namespace as README has users make it: labelled for Pod Security's
/// privileged level, which the chart checks before it installs.
async fn namespace(client: &Client, name: &str) {
    namespace_at(client, name, Some("privileged")).await
}

async fn namespace_at(client: &Client, name: &str, enforce: Option<&str>) {
    let mut labels = serde_json::Map::new();
    if let Some(level) = enforce {
        labels.insert(
            "pod-security.kubernetes.io/enforce".into(),
            serde_json::Value::String(level.into()),
        );
    }
    let ns: Namespace =
        serde_json::from_value(serde_json::json!({"metadata": {"name": name, "labels": labels}}))
            .unwrap();
    let _ = Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await;
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), name);
    eventually(
        Duration::from_secs(30),
        "default service account",
        || async { sas.get_opt("default").await.ok().flatten().is_some() },
    )
    .await;
}

#[test]
fn lint_strict_and_schema_errors() {
    let (ok, out, err) = helm(&["lint", "--strict", &chart()]);
    assert!(ok, "{out}{err}");
    let (ok, _, err) = helm(&["template", "x", &chart(), "--set", "port=abc"]);
    assert!(
        !ok && err.contains("/port") && err.contains("want integer"),
        "{err}"
    );
    let (ok, _, err) = helm(&["template", "x", &chart(), "--set", "typo=1"]);
    assert!(
        !ok && err.contains("additional properties 'typo' not allowed"),
        "{err}"
    );
    let (ok, _, err) = helm(&[
        "template",
        "x",
        &chart(),
        "--set",
        "host.watchdog.device=/tmp/x",
    ]);
    assert!(!ok && err.contains("/host/watchdog/device"), "{err}");
}

#[test]
fn with_host_access_off_the_pod_is_unprivileged() {
    let (ok, out, err) = helm(&[
        "template",
        "x",
        &chart(),
        "--set",
        "host.stateDir.enabled=false",
    ]);
    assert!(ok, "{err}");
    for want in [
        "runAsNonRoot: true",
        "readOnlyRootFilesystem: true",
        "privileged: false",
        "allowPrivilegeEscalation: false",
        "drop: [\"ALL\"]",
    ] {
        assert!(out.contains(want), "missing {want} in:\n{out}");
    }
    assert!(!out.contains("hostPath"), "no host mounts");
}

/// host.plugins.hostRoot: the node's root read-only at /host (following
/// the node's unmounts), the agent told to run commands there, root with SYS_CHROOT and
/// nothing else added; the plugin directory is not mounted again (it is
/// under /host) and stays an allowed command root. Off, none of it.
#[test]
fn host_root_mounts_the_nodes_root_read_only_and_runs_commands_there() {
    let off = [
        "host.stateDir.enabled=false",
        "host.plugins.enabled=true",
        "host.plugins.hostRoot=true",
    ];
    let (ok, out, err) = helm(&[
        "template",
        "x",
        &chart(),
        "--set",
        off[0],
        "--set",
        off[1],
        "--set",
        off[2],
    ]);
    assert!(ok, "{err}");
    let ds = out
        .split("\n---\n")
        .find(|doc| doc.contains("\nkind: DaemonSet\n"))
        .unwrap();
    let ds: serde_json::Value = serde_saphyr::from_str(ds).unwrap();
    let pod = &ds["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    let args = daemonset_args(&out);
    assert!(
        args.contains(&"--command-root=/host".to_string()),
        "{args:?}"
    );
    assert!(
        args.contains(&"--allow-command=/usr/local/lib/nodeguard/plugins/".to_string()),
        "{args:?}"
    );
    assert_eq!(pod["securityContext"]["runAsUser"], 0);
    // The node's PID namespace (its systemd and D-Bus refuse a peer whose
    // pid they cannot see), not the pod's shared one.
    assert_eq!(pod["hostPID"], true);
    assert!(pod["shareProcessNamespace"].is_null(), "{pod}");
    assert_eq!(c["securityContext"]["privileged"], false);
    assert_eq!(
        c["securityContext"]["capabilities"],
        serde_json::json!({"drop": ["ALL"], "add": ["SYS_CHROOT"]})
    );
    let mounts = c["volumeMounts"].as_array().unwrap();
    let host = mounts.iter().find(|m| m["mountPath"] == "/host").unwrap();
    assert_eq!(host["readOnly"], true);
    assert_eq!(host["mountPropagation"], "HostToContainer");
    // The commands' /tmp is the pod's own.
    let tmp = mounts
        .iter()
        .find(|m| m["mountPath"] == "/host/tmp")
        .unwrap();
    let tmp_volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == tmp["name"])
        .unwrap();
    assert!(tmp_volume["emptyDir"].is_object(), "{tmp_volume}");
    assert!(
        !mounts
            .iter()
            .any(|m| m["mountPath"] == "/usr/local/lib/nodeguard/plugins"),
        "{mounts:?}"
    );
    let volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == host["name"])
        .unwrap();
    assert_eq!(volume["hostPath"]["path"], "/");
    // The agent's own command line takes what the chart renders.
    use clap::Parser as _;
    let mut argv = vec!["nodeguard".to_string()];
    argv.extend(args);
    argv.push("--node-name=n".into());
    let cli =
        nodeguard::cli::Cli::try_parse_from(&argv).expect("the agent accepts the chart's args");
    let nodeguard::cli::Command::Run(run) = cli.command else {
        panic!("the chart runs `nodeguard run`")
    };
    assert_eq!(
        run.command_root.as_deref(),
        Some(std::path::Path::new("/host"))
    );
    // With nothing allowed to run it is refused.
    let (ok, _, err) = helm(&["template", "x", &chart(), "--set", off[0], "--set", off[2]]);
    assert!(
        !ok && err.contains("host.plugins.hostRoot") && err.contains("none may run"),
        "{err}"
    );
    let (ok, _, err) = helm(&[
        "template",
        "x",
        &chart(),
        "--set",
        off[0],
        "--set",
        off[2],
        "--set",
        "trust.commands={/usr/local/bin/check}",
    ]);
    assert!(ok, "{err}");
    // Off: no root mount, no chroot, no extra capability.
    let (ok, out, err) = helm(&["template", "x", &chart(), "--set", off[0], "--set", off[1]]);
    assert!(ok, "{err}");
    for absent in ["--command-root", "SYS_CHROOT", "name: host-root"] {
        assert!(!out.contains(absent), "{absent} in:\n{out}");
    }
}

/// What the daemonset VM scenario (tests/vm/kubenode.rs) found on a real
/// kubelet node: /dev/kmsg is refused to an unprivileged container (device
/// cgroup, dmesg_restrict), the default policy's kubelet probe on 127.0.0.1
/// fails from the pod's own network, and without kube-proxy the in-cluster
/// service address is unreachable.
#[test]
fn kmsg_is_privileged_probes_see_the_node_and_the_api_server_is_settable() {
    let (ok, out, err) = helm(&[
        "template",
        "x",
        &chart(),
        "--set",
        "host.kmsg.enabled=true",
        "--set",
        "apiServer.host=10.0.2.100",
        "--set",
        "apiServer.port=6443",
    ]);
    assert!(ok, "{err}");
    for want in [
        "privileged: true",
        "hostNetwork: true",
        // The pause container reaps what commands leave behind, not the agent.
        "shareProcessNamespace: true",
        "name: KUBERNETES_SERVICE_HOST\n              value: \"10.0.2.100\"",
        "name: KUBERNETES_SERVICE_PORT\n              value: \"6443\"",
    ] {
        assert!(out.contains(want), "missing {want} in:\n{out}");
    }
    let (ok, out, err) = helm(&["template", "x", &chart(), "--set", "hostNetwork=false"]);
    assert!(ok, "{err}");
    assert!(!out.contains("hostNetwork") && !out.contains("KUBERNETES_SERVICE_HOST"));
}

#[test]
fn the_shipped_default_policy_is_the_codes_and_renders() {
    let out = Command::new(env!("CARGO_BIN_EXE_nodeguard"))
        .arg("default-policy")
        .output()
        .unwrap();
    let file =
        std::fs::read_to_string(repo_root().join("charts/nodeguard/files/default-policy.yaml"))
            .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout) == file,
        "charts/nodeguard/files/default-policy.yaml is stale: run `make manifests`"
    );
    let (ok, rendered, err) = helm(&[
        "template",
        "x",
        &chart(),
        "--set",
        "defaultPolicy.enabled=true",
    ]);
    assert!(ok, "{err}");
    for want in [
        "kind: NodeGuardPolicy",
        "KernelDeadlock",
        "FrequentKubeletRestart",
        "KubeletUnhealthy",
    ] {
        assert!(rendered.contains(want), "{want} not rendered");
    }
}

/// One supported range, enforced by Chart.yaml's kubeVersion: renders for
/// both ends the tests run on (versions.env), refuses the minor below it,
/// and a `helm template` without `--kube-version` (Helm 3 assumes v1.20.0)
/// stops naming the constraint.
#[test]
fn the_chart_renders_only_for_the_supported_kubernetes_versions() {
    let env = std::fs::read_to_string(repo_root().join("e2e/cluster/versions.env")).unwrap();
    let pin = |key: &str| {
        env.lines()
            .find_map(|l| l.strip_prefix(&format!("{key}=")))
            .unwrap()
            .to_string()
    };
    let (oldest, newest) = (pin("KUBE_OLDEST_VERSION"), pin("KUBE_VERSION"));
    let chart_yaml =
        std::fs::read_to_string(repo_root().join("charts/nodeguard/Chart.yaml")).unwrap();
    let minor = oldest.trim_start_matches('v').rsplit_once('.').unwrap().0;
    assert!(
        chart_yaml.contains(&format!("kubeVersion: \">={minor}.0-0\"")),
        "Chart.yaml's kubeVersion starts at the oldest tested minor {minor}"
    );
    for v in [oldest.as_str(), newest.as_str()] {
        let (ok, _, err) = helm(&["template", "x", &chart(), "--kube-version", v]);
        assert!(ok, "{v}: {err}");
    }
    let older = format!(
        "1.{}.9",
        minor.trim_start_matches("1.").parse::<u32>().unwrap() - 1
    );
    let (ok, _, err) = helm(&["template", "x", &chart(), "--kube-version", &older]);
    assert!(
        !ok && err.contains("chart requires kubeVersion: >="),
        "{older}: {err}"
    );
    let out = Command::new(helm_binary())
        .args(["template", "x", &chart()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("chart requires kubeVersion"),
        "helm template without --kube-version: {err}"
    );
}

#[test]
fn the_chart_crd_is_the_repository_crd() {
    let repo =
        std::fs::read_to_string(repo_root().join("crds/nodeguard.io_nodeguardpolicies.yaml"))
            .unwrap();
    let chart = std::fs::read_to_string(
        repo_root().join("charts/nodeguard/crds/nodeguard.io_nodeguardpolicies.yaml"),
    )
    .unwrap();
    assert!(
        repo == chart,
        "charts/nodeguard/crds/ is stale: run `make crd`"
    );
}

#[test]
fn rendered_manifests_do_not_drift() {
    let (ok, rendered, err) = helm(&[
        "template",
        "nodeguard",
        &chart(),
        "-n",
        "nodeguard-system",
        "--include-crds",
        "--no-hooks",
    ]);
    assert!(ok, "{err}");
    let committed = std::fs::read_to_string(repo_root().join("manifests/nodeguard.yaml")).unwrap();
    assert!(
        rendered == committed,
        "manifests/nodeguard.yaml drifted from the chart: run `make manifests`"
    );
}

#[test]
fn the_default_image_is_what_the_build_produces() {
    let cargo = std::fs::read_to_string(repo_root().join("Cargo.toml")).unwrap();
    let version = cargo
        .lines()
        .find_map(|l| l.strip_prefix("version = \""))
        .unwrap()
        .trim_end_matches('"');
    let values = std::fs::read_to_string(repo_root().join("charts/nodeguard/values.yaml")).unwrap();
    let chart_yaml =
        std::fs::read_to_string(repo_root().join("charts/nodeguard/Chart.yaml")).unwrap();
    let script = std::fs::read_to_string(repo_root().join("e2e/image")).unwrap();
    assert!(values.contains("repository: ghcr.io/nodeguard/nodeguard"));
    assert!(script.contains("REPO=${NODEGUARD_IMAGE_REPO:-ghcr.io/nodeguard/nodeguard}"));
    assert!(
        chart_yaml.contains(&format!("appVersion: \"{version}\"")),
        "Chart.yaml appVersion must be the crate version {version}"
    );
}

#[test]
fn image_digest_pins_every_container_and_a_malformed_one_is_refused() {
    let digest = format!("sha256:{}", "ab".repeat(32));
    let set = format!("image.digest={digest}");
    let (ok, rendered, err) = helm(&[
        "template",
        "t",
        &chart(),
        "--kube-version",
        "1.33.0",
        "--set",
        &set,
        "--set",
        "host.dbus.enabled=true",
        "--set",
        "host.logindDropIn.enabled=true",
    ]);
    assert!(ok, "{err}");
    let images: Vec<&str> = rendered
        .lines()
        .filter_map(|l| l.trim().strip_prefix("image: "))
        .collect();
    // The agent, with logind on the inhibitor keeper, and the uninstall
    // hook's Job: all the same pinned image.
    assert_eq!(images.len(), 3, "{images:?}");
    for i in images {
        assert_eq!(
            i,
            format!(
                "\"ghcr.io/nodeguard/nodeguard:{}@{digest}\"",
                env!("CARGO_PKG_VERSION")
            )
        );
    }
    let (ok, _, err) = helm(&["template", "t", &chart(), "--set", "image.digest=latest"]);
    assert!(!ok, "a digest that is not sha256:<64 hex> renders");
    assert!(err.contains("/image/digest"), "{err}");
}

#[tokio::test]
async fn default_and_all_features_pass_a_server_side_dry_run() {
    let admin = admin_client().await;
    // Its policy documents need the CRD, which the CRD test deletes.
    let _one_install = INSTALL.lock().await;
    let ns = unique_name("ng-dry");
    namespace(&admin, &ns).await;
    let dir = TempDir::new("values");
    let all = dir.path.join("all.yaml");
    std::fs::write(&all, ALL_FEATURES).unwrap();
    for extra in [vec![], vec!["-f", all.to_str().unwrap()]] {
        let chart_path = chart();
        let mut args = vec!["template", "dry", chart_path.as_str(), "-n", &ns];
        args.extend(extra.iter());
        let (ok, rendered, err) = helm(&args);
        assert!(ok, "{err}");
        // The uninstall hook's Role for Events about Nodes lives in
        // `default`; kubectl applies one namespace at a time.
        let (in_default, in_release): (Vec<&str>, Vec<&str>) = rendered
            .split("\n---\n")
            .partition(|doc| doc.contains("\n  namespace: default\n"));
        assert_eq!(
            in_default.len(),
            2,
            "the hook's events Role and RoleBinding"
        );
        let (ok, out) = kubectl_stdin(
            &["apply", "--dry-run=server", "-n", &ns, "-f", "-"],
            &in_release.join("\n---\n"),
        );
        assert!(ok, "server dry run failed:\n{out}");
        let (ok, in_default_out) = kubectl_stdin(
            &["apply", "--dry-run=server", "-n", "default", "-f", "-"],
            &in_default.join("\n---\n"),
        );
        assert!(ok, "server dry run failed:\n{in_default_out}");
        assert!(
            out.contains("daemonset.apps/dry-nodeguard created (server dry run)"),
            "{out}"
        );
    }
    let _ = Api::<Namespace>::all(admin)
        .delete(&ns, &DeleteParams::default())
        .await;
}

/// A token for `sa` bound to `pod` (so it carries the pod's node name).
async fn bound_token(admin: &Client, ns: &str, sa: &str, pod: &Pod) -> String {
    let sas: Api<ServiceAccount> = Api::namespaced(admin.clone(), ns);
    let req: k8s_openapi::api::authentication::v1::TokenRequest =
        serde_json::from_value(serde_json::json!({
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {"audiences": [], "expirationSeconds": 3600,
                     "boundObjectRef": {"apiVersion": "v1", "kind": "Pod",
                                        "name": pod.metadata.name, "uid": pod.metadata.uid}},
        }))
        .unwrap();
    sas.create_token_request(sa, &PostParams::default(), &req)
        .await
        .expect("TokenRequest bound to a pod")
        .status
        .unwrap()
        .token
}

fn is_forbidden<T: std::fmt::Debug, E: std::fmt::Display>(r: &Result<T, E>) -> bool {
    match r {
        Err(e) => {
            let s = e.to_string();
            s.contains("403") || s.contains("Forbidden") || s.contains("forbidden")
        }
        Ok(_) => false,
    }
}

#[tokio::test]
async fn install_and_a_node_bound_token_only_touches_its_own_node() {
    let _one_install = INSTALL.lock().await;
    let admin = admin_client().await;
    let ns = unique_name("ng-install");
    let release = unique_name("ng");
    namespace(&admin, &ns).await;
    let (ok, out, err) = helm(&["install", &release, &chart(), "-n", &ns, "--wait=false"]);
    assert!(ok, "helm install: {out}{err}");
    let _uninstall = Uninstall {
        release: release.clone(),
        namespace: ns.clone(),
    };
    namespace(&admin, &ns).await;
    let fullname = format!("{release}-nodeguard");
    let sa = fullname.clone();
    // What the chart created.
    for (kind, name) in [
        ("daemonset", fullname.as_str()),
        ("serviceaccount", sa.as_str()),
    ] {
        kubectl(&["-n", &ns, "get", kind, name]);
    }
    kubectl(&["get", "clusterrole", &fullname]);
    kubectl(&[
        "get",
        "validatingadmissionpolicy",
        &format!("{fullname}-node-restriction"),
    ]);

    let node_a = TestNode::create(&admin, "node-a", &[]).await;
    let node_b = TestNode::create(&admin, "node-b", &[]).await;
    // The agent's pod on node A, as the DaemonSet would place it.
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &ns);
    let agent_pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "agent-on-a"},
        "spec": {"nodeName": node_a.name, "serviceAccountName": sa, "automountServiceAccountToken": false,
                 "containers": [{"name": "c", "image": "example.invalid/nodeguard"}]},
    }))
    .unwrap();
    let agent_pod = pods
        .create(&PostParams::default(), &agent_pod)
        .await
        .unwrap();
    // A workload pod on each node.
    let mut workload = Vec::new();
    for (i, node) in [&node_a.name, &node_b.name].iter().enumerate() {
        let p: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": format!("work-{i}")},
            "spec": {"nodeName": node, "automountServiceAccountToken": false,
                     "containers": [{"name": "c", "image": "example.invalid/app"}]},
        }))
        .unwrap();
        workload.push(pods.create(&PostParams::default(), &p).await.unwrap());
    }

    let token = bound_token(&admin, &ns, &sa, &agent_pod).await;
    let mut config = admin_config().await;
    config.auth_info = kube::config::AuthInfo {
        token: Some(token.into()),
        ..Default::default()
    };
    let agent_client = Client::try_from(config).unwrap();

    // Eventually consistent: RBAC and the policy take effect within a moment.
    let cond = |t: &str| Written {
        type_: t.into(),
        status: "False".into(),
        reason: "Checked".into(),
        message: "least-privilege test.".into(),
        last_transition: Some(k8s_openapi::jiff::Timestamp::now()),
        last_heartbeat: Some(k8s_openapi::jiff::Timestamp::now()),
    };
    let status_a = nodeguard::report::kube::KubeStatus::new(agent_client.clone(), &node_a.name);
    let status_b = nodeguard::report::kube::KubeStatus::new(agent_client.clone(), &node_b.name);
    let mut last = String::new();
    for _ in 0..50 {
        match status_a.apply(&[cond("LeastPrivilege")], None).await {
            Ok(_) => {
                last.clear();
                break;
            }
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(last.is_empty(), "conditions on its own node: {last}");
    // The admission policy is loaded by the API server within moments of
    // `helm install`; until then only RBAC applies.
    let mut denied = status_b.apply(&[cond("LeastPrivilege")], None).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while !is_forbidden(&denied) && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(250)).await;
        denied = status_b.apply(&[cond("LeastPrivilege")], None).await;
    }
    assert!(
        is_forbidden(&denied),
        "node B's status must be denied within 15 s of the install: {denied:?}"
    );
    eprintln!("node B status: {}", denied.unwrap_err());

    let cluster_a = KubeCluster::new(agent_client.clone(), &node_a.name);
    let cluster_b = KubeCluster::new(agent_client.clone(), &node_b.name);
    assert!(cluster_a.add_taint().await.unwrap(), "taint its own node");
    cluster_a.remove_taint().await.unwrap();
    let denied = cluster_b.add_taint().await;
    assert!(
        is_forbidden(&denied),
        "tainting node B must be denied: {denied:?}"
    );

    // Pods: its node's pods may be deleted (shutdown escalation), others not.
    let key = |p: &Pod| format!("{}/{}", ns, p.metadata.name.clone().unwrap());
    cluster_a.delete(&key(&workload[0]), 0).await.unwrap();
    let denied = cluster_b.delete(&key(&workload[1]), 0).await;
    assert!(
        is_forbidden(&denied),
        "deleting a pod on node B must be denied: {denied:?}"
    );
    // Readiness gates: pods/status of its node only.
    let gates = nodeguard::probe::KubePodConditions::new(agent_client.clone());
    use nodeguard::probe::PodConditionPort;
    let denied = gates
        .set(&key(&workload[1]), "example.com/gate", true, "x")
        .await;
    assert!(
        is_forbidden(&denied),
        "a readiness gate on node B must be denied: {denied:?}"
    );
    // Nothing on secrets.
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(agent_client.clone(), &ns);
    assert!(
        is_forbidden(&secrets.list(&Default::default()).await),
        "no access to secrets"
    );
    // Events about its node: its own (events.k8s.io) and those of a
    // monitor imported from node-problem-detector, which name NPD's source
    // component (core/v1); a repeat of each patches its series.
    {
        use nodeguard::report::{EventKind, EventPort, EventRequest};
        let node = Api::<k8s_openapi::api::core::v1::Node>::all(admin.clone())
            .get(&node_a.name)
            .await
            .unwrap();
        let (_node_tx, node_rx) = tokio::sync::watch::channel(Some(std::sync::Arc::new(node)));
        let events =
            nodeguard::report::kube::KubeEvents::new(agent_client.clone(), &node_a.name, node_rx);
        for source in [None, Some("kernel-monitor".to_string())] {
            let ev = EventRequest {
                kind: EventKind::Warning,
                reason: "LeastPrivilege".into(),
                action: "Check".into(),
                note: format!("An Event with source {source:?}."),
                source,
            };
            for _ in 0..2 {
                events
                    .publish(&ev)
                    .await
                    .unwrap_or_else(|e| panic!("{ev:?} with the chart's RBAC: {e}"));
            }
        }
    }

    let (ok, _, err) = helm(&["uninstall", &release, "-n", &ns, "--no-hooks"]);
    assert!(ok, "{err}");
    let _ = Api::<Namespace>::all(admin)
        .delete(&ns, &DeleteParams::default())
        .await;
}

/// `kubectl auth can-i` as `user` (in `groups`): "yes" or "no".
fn can_i(user: &str, groups: &[&str], verb: &str, resource: &str) -> String {
    let mut cmd = Command::new("kubectl");
    cmd.arg("--kubeconfig")
        .arg(kubeconfig_path())
        .args(["auth", "can-i", verb, resource, "--as", user]);
    for g in groups {
        cmd.args(["--as-group", g]);
    }
    let out = cmd.output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The agent's container args in a rendered chart.
fn daemonset_args(rendered: &str) -> Vec<String> {
    let ds = rendered
        .split("\n---\n")
        .find(|doc| doc.contains("\nkind: DaemonSet\n"))
        .expect("a DaemonSet in the rendered chart");
    let ds: serde_json::Value = serde_saphyr::from_str(ds).unwrap();
    ds["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect()
}

/// The node-local trust the agent gets from the chart's args, parsed by the
/// agent's own command line.
fn rendered_trust(set: &[&str]) -> nodeguard::policy::NodeTrust {
    let out = render(set).unwrap_or_else(|err| panic!("{err}"));
    let mut argv = vec!["nodeguard".to_string()];
    argv.extend(daemonset_args(&out));
    argv.extend(["--node-name".into(), "n".into()]);
    use clap::Parser;
    let cli =
        nodeguard::cli::Cli::try_parse_from(&argv).expect("the agent accepts the chart's args");
    let nodeguard::cli::Command::Run(run) = cli.command else {
        panic!("the chart runs `nodeguard run`")
    };
    run.trust.trust()
}

/// The chart's value for `--keep-executable-pages`: off by default (the
/// agent releases its start's pages), and the agent's own command line
/// takes the rendered switch.
#[test]
fn keep_executable_pages_is_a_chart_value_the_agent_takes() {
    use clap::Parser;
    for (set, keep) in [(None, false), (Some("keepExecutablePages=true"), true)] {
        let out = render(set.as_slice()).unwrap_or_else(|err| panic!("{err}"));
        let mut argv = vec!["nodeguard".to_string()];
        argv.extend(daemonset_args(&out));
        argv.extend(["--node-name".into(), "n".into()]);
        let cli = nodeguard::cli::Cli::try_parse_from(&argv)
            .unwrap_or_else(|err| panic!("the agent refuses the chart's args {argv:?}: {err}"));
        let nodeguard::cli::Command::Run(run) = cli.command else {
            panic!("the chart runs `nodeguard run`")
        };
        assert_eq!(run.keep_executable_pages, keep, "{set:?}: {argv:?}");
    }
    let err = render(&["keepExecutablePages=maybe"]).unwrap_err();
    assert!(err.contains("keepExecutablePages"), "{err}");
}

#[test]
fn the_charts_trust_defaults_are_the_agents_and_values_widen_them() {
    use nodeguard::policy::NodeTrust;
    assert_eq!(rendered_trust(&[]), NodeTrust::default());
    let t = rendered_trust(&[
        "host.plugins.enabled=true",
        "host.journal.enabled=true",
        "host.journal.path=/run/log/journal",
        "host.watchdog.enabled=true",
        "host.watchdog.device=/dev/watchdog1",
        "host.logindDropIn.path=/run/systemd/logind.conf.d",
        "trust.commands={/opt/checks/disk}",
        "trust.repairUnits={containerd.service,kube*}",
        "trust.maxInhibitDelaySeconds=45",
    ]);
    assert_eq!(
        t.commands,
        ["/opt/checks/disk", "/usr/local/lib/nodeguard/plugins/"]
    );
    assert_eq!(t.repair_units, ["containerd.service", "kube*"]);
    assert_eq!(
        t.read_paths,
        ["/dev/kmsg", "/var/log/journal", "/run/log/journal"]
    );
    assert_eq!(t.watchdog_devices, ["/dev/watchdog1"]);
    assert_eq!(t.logind_drop_in_dirs, ["/run/systemd/logind.conf.d"]);
    assert_eq!(t.max_inhibit_delay_seconds, 45);
    // A privileged pod (host.kmsg) sees every host device: without
    // host.watchdog no watchdog device is allowed.
    assert!(
        rendered_trust(&[
            "host.kmsg.enabled=true",
            "host.watchdog.device=/dev/watchdog1"
        ])
        .watchdog_devices
        .is_empty()
    );
    // Flags are quoted: a value cannot change the YAML around it.
    assert_eq!(
        rendered_trust(&["trust.commands={/opt/odd name: #x}"]).commands,
        ["/opt/odd name: #x"]
    );
    // Nothing readable: an empty list renders as "allow none".
    assert!(
        rendered_trust(&["trust.readPaths=null"])
            .read_paths
            .is_empty()
    );

    // The pod's grace must cover a deferred stop during the longest
    // shutdown the node allows.
    let (ok, _, err) = helm(&[
        "template",
        "x",
        &chart(),
        "--set",
        "trust.maxInhibitDelaySeconds=46",
    ]);
    assert!(
        !ok && err.contains("terminationGracePeriodSeconds (60) must be at least trust.maxInhibitDelaySeconds + 15 (61)"),
        "{err}"
    );
}

/// No role of the chart is aggregated into the built-in admin, edit or view
/// roles, and after an install a user bound to `admin` or `edit` across the
/// cluster still may not write NodeGuardPolicies.
#[tokio::test]
async fn policy_write_access_is_never_aggregated_into_builtin_roles() {
    let _one_install = INSTALL.lock().await;
    let (ok, rendered, err) = helm(&["template", "x", &chart()]);
    assert!(ok, "{err}");
    let all = {
        let dir = TempDir::new("values");
        let f = dir.path.join("all.yaml");
        std::fs::write(&f, ALL_FEATURES).unwrap();
        let (ok, out, err) = helm(&["template", "x", &chart(), "-f", f.to_str().unwrap()]);
        assert!(ok, "{err}");
        out
    };
    for out in [rendered.as_str(), all.as_str()] {
        assert!(
            !out.contains("aggregate-to"),
            "a chart role is aggregated into a built-in role"
        );
    }
    let admin = admin_client().await;
    let ns = unique_name("ng-aggr");
    let release = unique_name("ng");
    namespace(&admin, &ns).await;
    let (ok, out, err) = helm(&["install", &release, &chart(), "-n", &ns, "--wait=false"]);
    assert!(ok, "helm install: {out}{err}");
    let _uninstall = Uninstall {
        release: release.clone(),
        namespace: ns.clone(),
    };
    namespace(&admin, &ns).await;
    let user = unique_name("builtin");
    for role in ["admin", "edit"] {
        let binding = format!("{user}-{role}");
        kubectl(&[
            "create",
            "clusterrolebinding",
            &binding,
            "--clusterrole",
            role,
            "--user",
            &format!("{user}-{role}"),
        ]);
        for verb in ["create", "update", "patch"] {
            assert_eq!(
                can_i(
                    &format!("{user}-{role}"),
                    &[],
                    verb,
                    "nodeguardpolicies.nodeguard.io"
                ),
                "no",
                "a user with the built-in {role} role may {verb} policies"
            );
        }
        // The check can say yes: the same user may use the role's own grants.
        assert_eq!(
            can_i(&format!("{user}-{role}"), &[], "create", "configmaps"),
            "yes"
        );
        kubectl(&["delete", "clusterrolebinding", &binding]);
    }
    let (ok, _, err) = helm(&["uninstall", &release, "-n", &ns, "--no-hooks"]);
    assert!(ok, "{err}");
    let _ = Api::<Namespace>::all(admin)
        .delete(&ns, &DeleteParams::default())
        .await;
}

/// Applies `policy` (YAML) as `user` in `groups`: Ok, or the server's refusal.
fn apply_as(user: &str, groups: &[&str], policy: &str) -> Result<(), String> {
    let mut args = vec!["apply", "-f", "-", "--as", user];
    for g in groups {
        args.extend(["--as-group", g]);
    }
    let (ok, out) = kubectl_stdin(&args, policy);
    if ok { Ok(()) } else { Err(out) }
}

/// A policy that selects no node (agents of tests running beside this one
/// must not get it), unless `spec` sets its own nodeSelector.
fn policy_yaml(name: &str, spec: &str) -> String {
    let selector = if spec.contains("nodeSelector") {
        ""
    } else {
        "  nodeSelector: {matchLabels: {nodeguard.io/test-none: none}}\n"
    };
    format!(
        "apiVersion: nodeguard.io/v1alpha1\nkind: NodeGuardPolicy\nmetadata:\n  name: {name}\nspec:\n{selector}{spec}"
    )
}

/// The chart's admission policy: a policy that uses host access (commands,
/// unit repairs, host paths, the logind drop-in, a watchdog device) can be
/// written only by an author with the `host-access` verb or in a group the
/// operator names; other policies only need RBAC's write.
#[tokio::test]
async fn only_authors_allowed_host_access_may_write_policies_that_use_it() {
    let _one_install = INSTALL.lock().await;
    let admin = admin_client().await;
    install_crd(&admin).await;
    let ns = unique_name("ng-authority");
    let release = unique_name("ng");
    let trusted_group = unique_name("trusted-authors");
    namespace(&admin, &ns).await;
    let (ok, out, err) = helm(&[
        "install",
        &release,
        &chart(),
        "-n",
        &ns,
        "--wait=false",
        "--set",
        &format!("policyAuthority.groups={{{trusted_group}}}"),
    ]);
    assert!(ok, "helm install: {out}{err}");
    let _uninstall = Uninstall {
        release: release.clone(),
        namespace: ns.clone(),
    };
    namespace(&admin, &ns).await;
    let fullname = format!("{release}-nodeguard");
    let author = unique_name("author");
    let host_admin = unique_name("host-admin");
    kubectl(&[
        "create",
        "clusterrolebinding",
        &author,
        "--clusterrole",
        &format!("{fullname}-policy-editor"),
        "--user",
        &author,
    ]);
    kubectl(&[
        "create",
        "clusterrolebinding",
        &host_admin,
        "--clusterrole",
        &format!("{fullname}-policy-admin"),
        "--user",
        &host_admin,
    ]);
    assert_eq!(
        can_i(
            &host_admin,
            &[],
            "host-access",
            "nodeguardpolicies.nodeguard.io"
        ),
        "yes"
    );
    assert_eq!(
        can_i(
            &author,
            &[],
            "host-access",
            "nodeguardpolicies.nodeguard.io"
        ),
        "no"
    );

    let name = |what: &str| unique_name(&format!("auth-{what}"));
    let exec_name = name("exec");
    let exec = policy_yaml(
        &exec_name,
        "  probes:\n  - {name: x, exec: {command: [/usr/local/bin/check]}, conditionType: X}\n",
    );
    // The admission policy takes effect within moments of the install.
    let mut denied = apply_as(&author, &[], &exec);
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while denied.is_ok() && std::time::Instant::now() < deadline {
        kubectl(&["delete", "nodeguardpolicy", &exec_name]);
        tokio::time::sleep(Duration::from_millis(250)).await;
        denied = apply_as(&author, &[], &exec);
    }
    let message = denied.expect_err("an exec probe from a policy editor must be refused");
    eprintln!("{message}");
    for part in [
        "uses host access (exec probes)",
        &author,
        "'host-access'",
        &format!("{fullname}-policy-admin"),
        "policyAuthority.groups",
    ] {
        assert!(message.contains(part), "{part:?} missing from: {message}");
    }
    let refused = [
        (
            "plugin monitors (commands)",
            "  monitors:\n  - {name: m, source: {plugin: {}}, rules: [{type: temporary, reason: A, command: [/usr/local/bin/check]}]}\n",
        ),
        (
            "monitors reading host paths",
            "  monitors:\n  - {name: m, source: {file: {path: /etc/shadow}}, rules: [{type: temporary, reason: A, pattern: x}]}\n",
        ),
        (
            "monitors reading host paths",
            "  monitors:\n  - {name: m, source: {kmsg: {}}, rules: [{type: temporary, reason: A, pattern: x}]}\n",
        ),
        (
            "unit repairs",
            "  monitors:\n  - {name: m, source: {systemd: {unit: sshd.service, repair: {}}}, rules: [{type: permanent, condition: C, reason: Down}], conditions: [{type: C, reason: Up, message: up}]}\n",
        ),
        (
            "the logind drop-in",
            "  shutdown: {gracePeriodSeconds: 10}\n",
        ),
        ("a watchdog device", "  watchdog: {mode: Device}\n"),
        (
            "probes matching response bodies (bodyContains)",
            "  probes:\n  - {name: x, http: {url: \"http://169.254.169.254/token\", bodyContains: \"ya29\"}, conditionType: X}\n",
        ),
    ];
    for (what, spec) in refused {
        let err = apply_as(&author, &[], &policy_yaml(&name("refused"), spec))
            .expect_err(&format!("{what} must be refused"));
        assert!(err.contains(what), "{what}: {err}");
    }
    // Without host access a policy editor writes what RBAC lets them.
    let allowed = [
        "  probes:\n  - {name: x, http: {url: \"http://127.0.0.1:10248/healthz\"}, conditionType: X}\n",
        "  monitors:\n  - {name: m, source: {systemd: {unit: kubelet.service}}, rules: [{type: permanent, condition: C, reason: Down}], conditions: [{type: C, reason: Up, message: up}]}\n",
        "  shutdown: {gracePeriodSeconds: 10, logindDropInDir: \"\"}\n  watchdog: {mode: Systemd}\n",
    ];
    let mut created = Vec::new();
    for spec in allowed {
        let n = name("allowed");
        apply_as(&author, &[], &policy_yaml(&n, spec)).unwrap_or_else(|e| panic!("{spec}: {e}"));
        created.push(n);
    }
    // The host-access verb, a named group and cluster admins may.
    let by_host_admin = name("exec");
    apply_as(
        &host_admin,
        &[],
        &policy_yaml(
            &by_host_admin,
            "  probes:\n  - {name: x, exec: {command: [/usr/local/bin/check]}, conditionType: X}\n",
        ),
    )
    .unwrap();
    let by_group = name("exec");
    apply_as(
        &author,
        &[&trusted_group],
        &policy_yaml(
            &by_group,
            "  probes:\n  - {name: x, exec: {command: [/usr/local/bin/check]}, conditionType: X}\n",
        ),
    )
    .unwrap();
    let by_cluster_admin = name("exec");
    let (ok, out) = kubectl_stdin(
        &["apply", "-f", "-"],
        &policy_yaml(
            &by_cluster_admin,
            "  probes:\n  - {name: x, exec: {command: [/usr/local/bin/check]}, conditionType: X}\n",
        ),
    );
    assert!(ok, "a cluster admin (system:masters): {out}");
    created.extend([by_host_admin.clone(), by_group, by_cluster_admin]);
    // An editor may not retarget an admin's host-access policy.
    let retarget = policy_yaml(
        &by_host_admin,
        "  nodeSelector: {matchLabels: {nodeguard.io/test-none: other}}\n  probes:\n  - {name: x, exec: {command: [/usr/local/bin/check]}, conditionType: X}\n",
    );
    let err =
        apply_as(&author, &[], &retarget).expect_err("an editor updating a host-access policy");
    assert!(err.contains("uses host access (exec probes)"), "{err}");
    // ...but may delete it: removing a check escalates nothing.
    let deleted = kubectl_status(&["delete", "nodeguardpolicy", &by_host_admin, "--as", &author]);
    assert!(deleted.is_ok(), "{deleted:?}");

    for n in created {
        let _ = kubectl_status(&["delete", "nodeguardpolicy", &n, "--ignore-not-found"]);
    }
    for b in [&author, &host_admin] {
        kubectl(&["delete", "clusterrolebinding", b]);
    }
    let (ok, _, err) = helm(&["uninstall", &release, "-n", &ns, "--no-hooks"]);
    assert!(ok, "{err}");
    let _ = Api::<Namespace>::all(admin)
        .delete(&ns, &DeleteParams::default())
        .await;
}

/// `helm template` of the chart for a 1.33 cluster with `--set` for each
/// of `set`: the manifests, or helm's error.
fn render(set: &[&str]) -> Result<String, String> {
    let chart_path = chart();
    let mut args = vec![
        "template",
        "x",
        chart_path.as_str(),
        "--kube-version",
        "1.33.0",
    ];
    for s in set {
        args.extend(["--set", s]);
    }
    let (ok, out, err) = helm(&args);
    if ok { Ok(out) } else { Err(err) }
}

/// Host access on `auto` (the default) follows the policy the chart
/// installs: the README's one flag gives the shipped default policy every
/// mount it uses and nothing else; without a policy nothing is mounted but
/// the state directory; an explicit false the policy needs stops the
/// install naming both; a policy path the mount would not serve too.
#[test]
fn host_access_on_auto_is_what_the_charts_policy_uses() {
    let mounts = |out: &str| -> Vec<String> {
        out.lines()
            .filter_map(|l| l.trim().strip_prefix("mountPath: "))
            .map(str::to_string)
            .collect()
    };
    let none = render(&[]).unwrap();
    assert_eq!(mounts(&none), ["/var/lib/nodeguard"], "{none}");
    assert!(none.contains("privileged: false") && !none.contains("DBUS_SYSTEM_BUS_ADDRESS"));
    assert!(
        !none.contains("inhibitor-keeper"),
        "no keeper without D-Bus"
    );

    let readme = render(&["defaultPolicy.enabled=true"]).unwrap();
    assert_eq!(
        mounts(&readme),
        [
            "/run/nodeguard",
            "/var/lib/nodeguard",
            "/run/nodeguard",
            "/run/dbus/system_bus_socket",
            "/etc/systemd/logind.conf.d",
            "/dev/kmsg",
            "/var/log/journal",
        ],
        "the shipped default policy's mounts (the keeper's socket in both containers; no watchdog: it is off there)"
    );
    assert!(readme.contains("privileged: true"), "/dev/kmsg needs it");
    assert!(readme.contains("\"--allow-watchdog-device=\""));
    assert!(readme.contains("--inhibitor-keeper=/run/nodeguard/keep.sock"));
    // The handover unit runs the agent's copy from the node's state directory.
    assert!(readme.contains("--inhibitor-handover-seconds=120"));
    assert!(readme.contains("--host-state-dir=/var/lib/nodeguard"));
    let moved = render(&[
        "defaultPolicy.enabled=true",
        "host.stateDir.path=/srv/nodeguard",
    ])
    .unwrap();
    assert!(moved.contains("--host-state-dir=/srv/nodeguard"));
    for off in ["inhibitorHandoverSeconds=0", "host.stateDir.enabled=false"] {
        let r = render(&["defaultPolicy.enabled=true", off]).unwrap();
        assert!(
            !r.contains("--host-state-dir"),
            "{off}: no host path for the holder"
        );
    }

    let err = render(&["defaultPolicy.enabled=true", "host.kmsg.enabled=false"]).unwrap_err();
    assert!(
        err.contains("host.kmsg.enabled is false, but the chart's defaultPolicy needs it (monitor kernel reads /dev/kmsg)"),
        "{err}"
    );
    let err = render(&["defaultPolicy.enabled=true", "host.dbus.enabled=false"]).unwrap_err();
    assert!(
        err.contains("shutdown holds logind's delay lock over D-Bus"),
        "{err}"
    );
    // Explicit true is kept without a policy (for policies applied later).
    let on = render(&[
        "host.journal.enabled=true",
        "host.journal.path=/run/log/journal",
    ])
    .unwrap();
    assert_eq!(mounts(&on), ["/var/lib/nodeguard", "/run/log/journal"]);
    // A value outside true, false, auto is refused by the schema.
    let err = render(&["host.kmsg.enabled=yes"]).unwrap_err();
    assert!(err.contains("/host/kmsg/enabled"), "{err}");

    // A spec of one's own: a Device watchdog pulls in the device (it must
    // be the mounted one), an empty drop-in dir leaves logind.conf.d out.
    let spec = |extra: &str| {
        format!(
            "defaultPolicy.spec.shutdown.gracePeriodSeconds=20,defaultPolicy.spec.shutdown.logindDropInDir=,defaultPolicy.enabled=true{extra}"
        )
    };
    let out = render(&[&spec(",defaultPolicy.spec.watchdog.mode=Device")]).unwrap();
    assert_eq!(
        mounts(&out),
        [
            "/run/nodeguard",
            "/var/lib/nodeguard",
            "/run/nodeguard",
            "/run/dbus/system_bus_socket",
            "/dev/watchdog"
        ]
    );
    assert!(out.contains("\"--allow-watchdog-device=/dev/watchdog\""));
    let err = render(&[&spec(
        ",defaultPolicy.spec.watchdog.mode=Device,defaultPolicy.spec.watchdog.device=/dev/watchdog1",
    )])
    .unwrap_err();
    assert!(
        err.contains("watchdog.device is /dev/watchdog1, but the pod mounts host.watchdog.device (/dev/watchdog)"),
        "{err}"
    );
    // The shipped policy follows the chart's paths; a spec of one's own
    // that the mounts would not serve is refused.
    let moved = render(&[
        "defaultPolicy.enabled=true",
        "host.logindDropIn.path=/run/systemd/logind.conf.d",
        "host.journal.path=/run/log/journal",
    ])
    .unwrap();
    assert!(
        moved.contains("logindDropInDir: /run/systemd/logind.conf.d"),
        "{moved}"
    );
    assert!(
        moved.contains("directory: /run/log/journal")
            && !moved.contains("directory: /var/log/journal")
    );
    assert!(moved.contains("\"--allow-read-path=/run/log/journal\""));
    let err = render(&[&spec(",host.logindDropIn.path=/run/systemd/logind.conf.d,defaultPolicy.spec.shutdown.logindDropInDir=/etc/systemd/logind.conf.d")]).unwrap_err();
    assert!(err.contains("shutdown.logindDropInDir is /etc/systemd/logind.conf.d, but the pod mounts host.logindDropIn.path"), "{err}");
    // /dev/kmsg is readable whatever trust.readPaths says, when mounted.
    let reads = render(&[
        "defaultPolicy.enabled=true",
        "trust.readPaths={/var/log/syslog}",
    ])
    .unwrap();
    assert!(
        reads.contains("\"--allow-read-path=/dev/kmsg\"")
            && reads.contains("\"--allow-read-path=/var/log/journal\""),
        "{reads}"
    );
    // What the pod cannot serve is refused at install, not dropped on
    // every node afterwards.
    for (set, want) in [
        (spec(",defaultPolicy.spec.watchdog.mode=Systemd"), "watchdog mode Systemd pets systemd's watchdog, which a pod has not"),
        (spec(",defaultPolicy.spec.shutdown.gracePeriodSeconds=60"), "shutdown needs an inhibit delay of 62 s"),
        (
            "defaultPolicy.enabled=true,defaultPolicy.spec.monitors[0].name=j,defaultPolicy.spec.monitors[0].source.journald.unit=kubelet.service".to_string(),
            "monitor j has no journald directory",
        ),
        (
            "defaultPolicy.enabled=true,defaultPolicy.spec.monitors[0].name=f,defaultPolicy.spec.monitors[0].source.file.path=/var/log/syslog".to_string(),
            "monitor f reads the file /var/log/syslog, which the pod does not mount: set host.logs.enabled=true",
        ),
        (
            "defaultPolicy.enabled=true,defaultPolicy.spec.monitors[0].name=f,defaultPolicy.spec.monitors[0].source.file.path=/srv/app.log,host.logs.enabled=true".to_string(),
            "monitor f reads the file /srv/app.log, which the pod does not mount",
        ),
        (
            "defaultPolicy.enabled=true,defaultPolicy.spec.monitors[0].name=k,defaultPolicy.spec.monitors[0].source.kmsg.path=/tmp/kmsg".to_string(),
            "monitor k reads kmsg records from /tmp/kmsg",
        ),
        (
            "defaultPolicy.enabled=true,defaultPolicy.spec.probes[0].name=e,defaultPolicy.spec.probes[0].conditionType=E,defaultPolicy.spec.probes[0].exec.command={/usr/local/bin/check}".to_string(),
            "probe e runs /usr/local/bin/check, which the nodes do not allow",
        ),
        (
            "defaultPolicy.enabled=true,defaultPolicy.spec.monitors[0].name=s,defaultPolicy.spec.monitors[0].source.systemd.unit=kubelet.service,defaultPolicy.spec.monitors[0].source.systemd.repair.signal=SIGKILL".to_string(),
            "monitor s repairs unit kubelet.service, which trust.repairUnits does not allow",
        ),
        ("defaultPolicy.enabled=true,hostNetwork=false".to_string(), "probe kubelet targets the node's loopback"),
    ] {
        let err = render(&[&set]).unwrap_err();
        assert!(err.contains(want), "{set}: {err}");
    }
    // Allowed, they render: the command under host.plugins, the unit in
    // trust.repairUnits (by prefix).
    render(&["defaultPolicy.enabled=true,defaultPolicy.spec.probes[0].name=e,defaultPolicy.spec.probes[0].conditionType=E,defaultPolicy.spec.probes[0].exec.command={/usr/local/lib/nodeguard/plugins/check},host.plugins.enabled=true"]).unwrap();
    render(&["defaultPolicy.enabled=true,defaultPolicy.spec.monitors[0].name=s,defaultPolicy.spec.monitors[0].source.systemd.unit=kubelet.service,defaultPolicy.spec.monitors[0].source.systemd.repair.signal=SIGKILL,trust.repairUnits={kube*}"]).unwrap();
    // A file monitor under host.logs: the directory mounted read-only and
    // readable (NPD's filelog configs, imported).
    let logs = render(&["defaultPolicy.enabled=true,defaultPolicy.spec.monitors[0].name=f,defaultPolicy.spec.monitors[0].source.file.path=/var/log/kern.log,host.logs.enabled=true"]).unwrap();
    assert!(
        logs.contains("\"--allow-read-path=/var/log\"")
            && logs.contains(
                "- name: logs\n              mountPath: /var/log\n              readOnly: true"
            )
            && logs.contains("add: [\"DAC_READ_SEARCH\"]"),
        "{logs}"
    );
    // Log files are often another user's (Ubuntu's rsyslog: syslog:adm
    // 0640): root reads them with CAP_DAC_READ_SEARCH, only with host.logs.
    assert!(!render(&[]).unwrap().contains("DAC_READ_SEARCH"));
    // One path cannot be mounted twice.
    let err =
        render(&["host.logs.enabled=true,host.journal.enabled=true,host.journal.path=/var/log"])
            .unwrap_err();
    assert!(
        err.contains("host.logs.path and host.journal.path are both /var/log"),
        "{err}"
    );
    // A value removed (null), as an upgrade with --reuse-values from an
    // older release has none: auto, and the Pod Security check's default.
    render(&[
        "defaultPolicy.enabled=true",
        "host.kmsg.enabled=null",
        "podSecurity=null",
    ])
    .unwrap();
}

/// NOTES.txt, printed after `helm install`, says what is on and why.
#[test]
fn install_notes_say_what_host_access_is_on_and_why() {
    let (ok, out, err) = helm(&[
        "install",
        "notes",
        &chart(),
        "--dry-run=client",
        "-n",
        "nodeguard-system",
        "--set",
        "defaultPolicy.enabled=true",
    ]);
    assert!(ok, "{err}");
    for want in [
        "host.kmsg: on  (auto: monitor kernel reads /dev/kmsg)",
        "host.journal: on  (auto: monitor systemd-restarts reads the journal; monitor docker reads the journal)",
        "host.dbus: on  (auto: shutdown holds logind's delay lock over D-Bus)",
        "host.logindDropIn: on  (auto: shutdown raises logind's InhibitDelayMaxSec with a drop-in in /etc/systemd/logind.conf.d)",
        "host.watchdog: off (auto: the chart's policy does not use it)",
    ] {
        assert!(out.contains(want), "NOTES lack {want:?}:\n{out}");
    }
    let (ok, out, err) = helm(&["install", "notes", &chart(), "--dry-run=client"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("host.kmsg: off (auto: the chart's policy does not use it)")
            && out.contains("set host.<access>.enabled=true for what\nthey use"),
        "{out}"
    );
}

/// The DaemonSet's pod as the API server's Pod Security admission judges it
/// in `ns`: a server-side dry-run create of its template.
async fn pod_admitted(client: &Client, ns: &str, rendered: &str) -> Result<(), String> {
    let ds = rendered
        .split("\n---")
        .find(|d| d.contains("\nkind: DaemonSet"))
        .expect("a DaemonSet is rendered");
    let mut ds: serde_json::Value = serde_saphyr::from_str(ds).unwrap();
    // The release's service account is not there (nothing is installed);
    // Pod Security does not look at it.
    ds["spec"]["template"]["spec"]["serviceAccountName"] = "default".into();
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": unique_name("psa")},
        "spec": ds["spec"]["template"]["spec"],
    }))
    .unwrap();
    let pp = PostParams {
        dry_run: true,
        ..Default::default()
    };
    Api::<Pod>::namespaced(client.clone(), ns)
        .create(&pp, &pod)
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// Pod Security on the real API server: where the namespace's level would
/// refuse the pod (baseline, or no label: the cluster's default, unknown to
/// the chart, or a namespace --create-namespace would make bare), `helm
/// install` stops at once naming the label; labelled privileged it installs
/// and the pod is admitted; with no host access the pod meets restricted
/// and installs there.
#[tokio::test]
async fn an_install_the_namespaces_pod_security_would_refuse_stops_naming_the_label() {
    let admin = admin_client().await;
    // Its server-side dry runs read the CRD, which the CRD test changes.
    let _one_install = INSTALL.lock().await;
    let readme = ["--set", "defaultPolicy.enabled=true"];
    let baseline = unique_name("ng-psa-baseline");
    let bare = unique_name("ng-psa-bare");
    let privileged = unique_name("ng-psa-privileged");
    let restricted = unique_name("ng-psa-restricted");
    let _gone = Namespaces(vec![
        baseline.clone(),
        bare.clone(),
        privileged.clone(),
        restricted.clone(),
    ]);
    namespace_at(&admin, &baseline, Some("baseline")).await;
    namespace_at(&admin, &bare, None).await;
    namespace_at(&admin, &privileged, Some("privileged")).await;
    namespace_at(&admin, &restricted, Some("restricted")).await;
    let rendered = render(&["defaultPolicy.enabled=true"]).unwrap();
    // The premise: this cluster's admission refuses the pod under baseline.
    let refused = pod_admitted(&admin, &baseline, &rendered)
        .await
        .unwrap_err();
    assert!(
        refused.contains("violates PodSecurity \"baseline"),
        "{refused}"
    );
    pod_admitted(&admin, &privileged, &rendered).await.unwrap();

    let install = |ns: &str, extra: &[&str]| {
        let chart_path = chart();
        let mut args = vec![
            "install",
            "psa",
            chart_path.as_str(),
            "-n",
            ns,
            "--dry-run=server",
        ];
        args.extend(extra);
        helm(&args)
    };
    let label = "pod-security.kubernetes.io/enforce=privileged";
    let (ok, _, err) = install(&baseline, &readme);
    assert!(
        !ok && err.contains("has Pod Security enforce level \"baseline\""),
        "{err}"
    );
    assert!(
        err.contains(&format!("kubectl label namespace {baseline} {label}")),
        "{err}"
    );
    assert!(
        err.contains("host.kmsg (/dev/kmsg, a privileged container)"),
        "{err}"
    );
    let (ok, _, err) = install(&bare, &readme);
    assert!(
        !ok && err.contains("enforce level unset (the cluster's default"),
        "{err}"
    );
    let missing = unique_name("ng-psa-missing");
    let (ok, _, err) = install(&missing, &["--create-namespace"]);
    assert!(
        !ok && err.contains(&format!("namespace {missing} does not exist yet")),
        "{err}"
    );
    assert!(
        err.contains(&format!(
            "kubectl create namespace {missing} && kubectl label namespace {missing} {label}"
        )),
        "{err}"
    );
    let (ok, _, err) = install(&privileged, &readme);
    assert!(ok, "{err}");
    let (ok, _, err) = install(&baseline, &["--set", "podSecurity.check=false"]);
    assert!(ok, "the check can be turned off: {err}");
    // No host access: the pod meets restricted, and the chart says nothing.
    let plain = [
        "--set",
        "hostNetwork=false",
        "--set",
        "host.stateDir.enabled=false",
    ];
    let (ok, _, err) = install(&restricted, &plain);
    assert!(ok, "{err}");
    let rendered = render(&["hostNetwork=false", "host.stateDir.enabled=false"]).unwrap();
    pod_admitted(&admin, &restricted, &rendered).await.unwrap();
}

/// Deletes the namespaces when dropped (a failed test too).
struct Namespaces(Vec<String>);

impl Drop for Namespaces {
    fn drop(&mut self) {
        for ns in &self.0 {
            let _ = kubectl_status(&["delete", "namespace", ns, "--wait=false"]);
        }
    }
}

/// The uninstall hook's RBAC, applied to the real API server as Helm
/// creates it before the Job: the pods of the release namespace (list,
/// annotate) and Events about Nodes (in `default`); nothing else.
#[tokio::test]
async fn the_uninstall_hooks_rbac_is_what_nodeguard_retire_calls() {
    let admin = admin_client().await;
    let ns = unique_name("nodeguard-hook");
    kubectl(&["create", "namespace", &ns]);
    let release = "hook";
    let (ok, rendered, err) = helm(&[
        "template",
        release,
        &chart(),
        "-n",
        &ns,
        "--show-only",
        "templates/uninstall.yaml",
    ]);
    assert!(ok, "{err}");
    let rbac: String = rendered
        .split("\n---\n")
        .filter(|d| !d.contains("\nkind: Job\n"))
        .collect::<Vec<_>>()
        .join("\n---\n");
    let file = std::env::temp_dir().join(format!("{ns}-hook-rbac.yaml"));
    std::fs::write(&file, &rbac).unwrap();
    kubectl(&["apply", "-f", file.to_str().unwrap()]);
    let sa = format!("system:serviceaccount:{ns}:{release}-nodeguard-retire");
    let groups = ["system:serviceaccounts", "system:authenticated"];
    let check = |verb: &str, resource: &str, namespace: &str| -> String {
        let out = Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(kubeconfig_path())
            .args([
                "auth", "can-i", verb, resource, "-n", namespace, "--as", &sa,
            ])
            .args(groups.iter().flat_map(|g| ["--as-group", g]))
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    for (verb, resource, namespace, want) in [
        ("list", "pods", ns.as_str(), "yes"),
        ("patch", "pods", ns.as_str(), "yes"),
        ("create", "events.events.k8s.io", "default", "yes"),
        // Nothing more: not other namespaces' pods, not deletes, not nodes.
        ("list", "pods", "default", "no"),
        ("delete", "pods", ns.as_str(), "no"),
        ("patch", "nodes", "", "no"),
        ("create", "events.events.k8s.io", ns.as_str(), "no"),
    ] {
        assert_eq!(
            check(verb, resource, namespace),
            want,
            "{verb} {resource} in {namespace:?}"
        );
    }
    kubectl(&["delete", "-f", file.to_str().unwrap(), "--wait=false"]);
    let _ = Api::<Namespace>::all(admin)
        .delete(&ns, &DeleteParams::default())
        .await;
    let _ = std::fs::remove_file(&file);
}

/// Helm installs crds/ on the first install only. Over a cluster CRD that
/// is not the chart's and not a newer release's (an older release's, one
/// of this version with another digest, an unstamped one, one whose version
/// is no version, this version's release candidate), `helm install` and a
/// real `helm upgrade` of an installed release stop and print the command
/// that applies this chart's CRD, and crd.check=false goes on. A newer
/// release's CRD (a downgrade; a later release candidate too) goes on; the
/// same digest goes on whatever the version annotation says; an upgrade
/// where the CRD was deleted stops.
#[tokio::test]
async fn an_install_over_another_releases_crd_stops_naming_the_command_that_applies_this_one() {
    let admin = admin_client().await;
    install_crd(&admin).await;
    let _one_install = INSTALL.lock().await;
    let restore = CommittedCrd;
    let ns = unique_name("ng-crd");
    let _gone = Namespaces(vec![ns.clone()]);
    namespace(&admin, &ns).await;
    let chart_path = chart();
    let attempt = |verb: &str, extra: &[&str]| {
        let mut args = match verb {
            "install" => vec!["install", "crd", chart_path.as_str()],
            _ => vec!["upgrade", "crd", chart_path.as_str()],
        };
        args.extend(["-n", ns.as_str(), "--dry-run=server"]);
        args.extend(extra);
        helm(&args)
    };
    let version = env!("CARGO_PKG_VERSION");
    let fix = format!(
        "helm show crds oci://ghcr.io/nodeguard/charts/nodeguard --version {version} | kubectl apply --server-side --force-conflicts -f -"
    );
    let key = nodeguard::policy::SCHEMA_ANNOTATION;
    let vkey = nodeguard::policy::VERSION_ANNOTATION;
    let mine = {
        let crd = kubectl(&[
            "get",
            "crd",
            "nodeguardpolicies.nodeguard.io",
            "-o",
            "jsonpath={.metadata.annotations.nodeguard\\.io/schema-sha256}",
        ]);
        crd.trim().to_string()
    };
    assert_eq!(mine.len(), 64, "the committed CRD is stamped: {mine:?}");
    let other = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    let (major, minor) = {
        let mut parts = version.split('.');
        let major: u64 = parts.next().unwrap().parse().unwrap();
        let minor: u64 = parts.next().unwrap().parse().unwrap();
        (major, minor)
    };
    let later_rc = format!("{major}.{}.0-rc.1", minor + 1);
    let this_rc = format!("{version}-rc.1");
    let annotate = |digest: Option<&str>, release: Option<&str>| {
        let d = digest.map_or(format!("{key}-"), |d| format!("{key}={d}"));
        let v = release.map_or(format!("{vkey}-"), |v| format!("{vkey}={v}"));
        kubectl(&[
            "annotate",
            "crd",
            "nodeguardpolicies.nodeguard.io",
            "--overwrite",
            &d,
            &v,
        ]);
    };
    let refused: [(&str, Option<&str>, Option<&str>, String); 5] = [
        (
            "an older release's CRD",
            Some(other),
            Some("0.0.1"),
            "0123456789ab…, from release 0.0.1;".to_string(),
        ),
        (
            "a CRD of this version with another digest",
            Some(other),
            Some(version),
            format!("0123456789ab…, from release {version};"),
        ),
        (
            "this version's release candidate",
            Some(other),
            Some(this_rc.as_str()),
            format!("0123456789ab…, from release {this_rc};"),
        ),
        (
            "a CRD whose version is no version",
            Some(other),
            Some("dev"),
            "0123456789ab…, from release dev;".to_string(),
        ),
        (
            "a CRD from before the annotations",
            None,
            None,
            "missing, from release unknown;".to_string(),
        ),
    ];
    // Each case as a first install, then (with the release installed) as a
    // real upgrade.
    let run_cases = |verb: &str| {
        for (what, digest, release, shown) in &refused {
            annotate(*digest, *release);
            let (ok, _, err) = attempt(verb, &[]);
            assert!(
                !ok && err.contains("the cluster's NodeGuardPolicy CRD is not this chart's")
                    && err.contains(&format!("its {key} is {shown}"))
                    && err.contains(&fix),
                "{what}, helm {verb}: {err}"
            );
            let (ok, _, err) = attempt(verb, &["--set", "crd.check=false"]);
            assert!(ok, "{what}, helm {verb} with crd.check=false: {err}");
        }
        // A newer release's CRD (a downgrade, or a canary release applied
        // it): this chart's would take its fields away, so it goes on. The
        // same digest goes on whatever the version says.
        for (what, digest, release) in [
            ("a newer release's CRD", other, "99.0.0"),
            ("a later release candidate's CRD", other, later_rc.as_str()),
            (
                "this chart's digest with a version that is none",
                mine.as_str(),
                "dev",
            ),
        ] {
            annotate(Some(digest), Some(release));
            let (ok, _, err) = attempt(verb, &[]);
            assert!(ok, "{what}, helm {verb}: {err}");
        }
    };
    run_cases("install");
    // A release to upgrade (no agent runs here: no hooks).
    annotate(Some(mine.as_str()), Some(version));
    let (ok, _, err) = helm(&["install", "crd", &chart_path, "-n", &ns, "--no-hooks"]);
    assert!(ok, "{err}");
    let _uninstall = Uninstall {
        release: "crd".into(),
        namespace: ns.clone(),
    };
    run_cases("upgrade");
    // An upgrade where the CRD is gone (deleted by hand): helm upgrade
    // never creates it.
    drop(restore);
    let restore = CommittedCrd;
    kubectl(&["delete", "crd", "nodeguardpolicies.nodeguard.io", "--wait"]);
    let (ok, _, err) = attempt("upgrade", &[]);
    assert!(
        !ok && err.contains("the cluster has no NodeGuardPolicy CRD") && err.contains(&fix),
        "helm upgrade without the CRD: {err}"
    );
    drop(restore);
    install_crd(&admin).await;
    let (ok, _, err) = attempt("upgrade", &[]);
    assert!(ok, "the chart's own CRD again: {err}");
}
