//! kube-upgrade: `helm upgrade` from the previous chart version to this one
//! on the real node, the way README "Upgrading" has it, with graceful
//! shutdown armed and a monitor condition True (with its taint).
//!
//! The previous release is this tree's chart, packaged as an older version
//! (`<version>-previous`, which sorts before `<version>`) whose CRD lacks
//! one field (`spec.healthz`) and whose image is referenced by tag only (the
//! release's is pinned by digest), so the upgrade changes the pod template
//! and the DaemonSet rolls the pod, as a release with a new image does. The
//! agent's binary is the same on both sides, and its image is on the node
//! already: what is tested is the chart's path (the CRD, the rollout, the
//! handover of the node), not a change of the agent's own state format, and
//! the measured gap has no image pull in it (a real release's has).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{ListParams, PostParams};
use kube::{Api, Client};

use crate::kubenode::{
    NodeUp, Published, Release, in_cluster_route, labelled_namespace, lib_dir, node_up, pod_ready,
    run, running_and_ready, uninstall_with_hook,
};
use crate::qemu::Vm;
use crate::support::*;
use crate::{Rows, kubework, secs};
use nodeguard::policy::NodeGuardPolicy;

/// The field the previous chart's CRD does not have.
const NEW_FIELD: &str = "healthz";
const CANARY_TAINT: &str = "example.com/upgrade-canary";
const CRD_NAME: &str = "nodeguardpolicies.nodeguard.io";
/// How often the guest samples logind's delay inhibitors during the upgrade.
const SAMPLE_MS: u32 = 50;

/// This tree's packaged chart (e2e/image's copy, image pinned by digest)
/// rebuilt as the previous release: version `<version>-previous`, the image
/// by tag only, the CRD without [`NEW_FIELD`] (stamped with its own schema
/// digest), packaged and pushed to the test registry. Returns the previous
/// CRD's file and the previous version.
fn previous_chart(dir: &Path, published: &Published, helm: &Path) -> (PathBuf, String) {
    let src = repo_root().join("target/image/chart/nodeguard");
    assert!(
        src.join("Chart.yaml").is_file(),
        "{} is missing: run e2e/image",
        src.display()
    );
    let work = dir.join("previous-chart");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    run(Command::new("cp").arg("-r").arg(&src).arg(&work));
    let chart = work.join("nodeguard");
    let version = format!("{}-previous", published.version);

    let path = chart.join("Chart.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let old_line = format!("version: {}\n", published.version);
    assert!(text.contains(&old_line), "Chart.yaml: {text}");
    std::fs::write(
        &path,
        text.replace(&old_line, &format!("version: {version}\n")),
    )
    .unwrap();

    let path = chart.join("values.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let pinned = format!("  digest: \"{}\"\n", published.digest);
    assert!(text.contains(&pinned), "the packaged values pin the image");
    std::fs::write(&path, text.replace(&pinned, "  digest: \"\"\n")).unwrap();

    let crd_path = chart.join("crds/nodeguard.io_nodeguardpolicies.yaml");
    let mut crd: CustomResourceDefinition =
        serde_saphyr::from_str(&std::fs::read_to_string(&crd_path).unwrap()).unwrap();
    let spec = crd.spec.versions[0]
        .schema
        .as_mut()
        .and_then(|s| s.open_api_v3_schema.as_mut())
        .and_then(|s| s.properties.as_mut())
        .and_then(|p| p.get_mut("spec"))
        .and_then(|s| s.properties.as_mut())
        .expect("the CRD's spec schema");
    assert!(
        spec.remove(NEW_FIELD).is_some(),
        "the CRD has spec.{NEW_FIELD}"
    );
    let digest = nodeguard::policy::schema_digest(&crd.spec);
    let annotations = crd.metadata.annotations.get_or_insert_default();
    annotations.insert(nodeguard::policy::SCHEMA_ANNOTATION.to_string(), digest);
    annotations.insert(
        nodeguard::policy::VERSION_ANNOTATION.to_string(),
        version.clone(),
    );
    std::fs::write(&crd_path, serde_saphyr::to_string(&crd).unwrap()).unwrap();

    run(Command::new(helm)
        .args(["package"])
        .arg(&chart)
        .arg("-d")
        .arg(&work));
    let tgz = work.join(format!("nodeguard-{version}.tgz"));
    run(Command::new(helm)
        .arg("push")
        .arg(&tgz)
        .arg(format!("oci://{}/nodeguard/charts", published.registry))
        .arg("--plain-http"));
    (crd_path, version)
}

fn helm_cmd(helm: &Path) -> Command {
    let mut c = Command::new(helm);
    c.arg("--kubeconfig").arg(kubeconfig_path());
    c
}

/// The CRD's schema digest in the cluster.
fn cluster_crd_digest() -> String {
    kubectl(&[
        "get",
        "crd",
        CRD_NAME,
        "-o",
        "jsonpath={.metadata.annotations.nodeguard\\.io/schema-sha256}",
    ])
    .trim()
    .to_string()
}

/// Conditions nodeguard owns on the Node: type → (status, lastTransitionTime).
fn owned(node: &Node) -> BTreeMap<String, (String, String)> {
    let types = nodeguard::report::kube::owned_condition_types(node);
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .filter(|c| types.contains(&c.type_))
        .map(|c| {
            let ltt = c
                .last_transition_time
                .as_ref()
                .map(|t| t.0.to_string())
                .unwrap_or_default();
            (c.type_.clone(), (c.status.clone(), ltt))
        })
        .collect()
}

/// The monitors' conditions whose transition time must survive the
/// upgrade (restored from the state files); the probes' and the shutdown
/// manager's are compared by status.
const MONITOR_CONDITIONS: [&str; 3] = ["UpgradeCanary", "KernelDeadlock", "ReadonlyFilesystem"];

/// Each condition's lastHeartbeatTime.
fn heartbeats(node: &Node) -> Vec<(String, Option<jiff::Timestamp>)> {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .map(|c| (c.type_.clone(), c.last_heartbeat_time.as_ref().map(|t| t.0)))
        .collect()
}

fn canary_taints(node: &Node) -> Vec<String> {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .into_iter()
        .flatten()
        .filter(|t| t.key == CANARY_TAINT || t.key.starts_with("nodeguard.io/"))
        .map(|t| format!("{}:{}", t.key, t.effect))
        .collect()
}

/// What the delay-inhibitor samples show (each: seconds, nodeguard's
/// delay locks held, of which the handover unit's).
struct Samples {
    /// The longest run without one, from the last sample that had one to
    /// the first that had one again.
    longest_gap: Option<f64>,
    /// How many such runs there were.
    gaps: usize,
    samples: usize,
    /// How long the handover unit's lock was seen, first to last sample.
    handover: Option<f64>,
}

fn read_samples(samples: &str) -> Samples {
    let rows: Vec<(f64, u32, u32)> = samples
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            Some((
                f.next()?.parse().ok()?,
                f.next()?.parse().ok()?,
                f.next()?.parse().ok()?,
            ))
        })
        .collect();
    let handover_at: Vec<f64> = rows.iter().filter(|r| r.2 > 0).map(|r| r.0).collect();
    let handover = match (handover_at.first(), handover_at.last()) {
        (Some(a), Some(b)) => Some(b - a),
        _ => None,
    };
    let mut longest: Option<f64> = None;
    let mut runs = 0;
    let mut last_held: Option<f64> = None;
    let mut in_gap = false;
    for &(t, n, _) in &rows {
        if n > 0 {
            if in_gap && let Some(from) = last_held {
                let g = t - from;
                longest = Some(longest.map_or(g, |l: f64| l.max(g)));
                runs += 1;
            }
            in_gap = false;
            last_held = Some(t);
        } else {
            in_gap = true;
        }
    }
    Samples {
        longest_gap: longest,
        gaps: runs,
        samples: rows.len(),
        handover,
    }
}

pub async fn from_previous(
    vm: &mut Vm,
    admin: &Client,
    node: &str,
    dir: &Path,
    published: &Published,
    rows: &Rows,
) -> NodeUp {
    let up = node_up(vm, admin, node).await;
    in_cluster_route(vm).await;
    let helm = lib_dir("bin_dir").join("helm");
    let chart = published.chart();
    let (old_crd, previous) = previous_chart(dir, published, &helm);

    // The cluster as the previous release left it: its CRD. (Helm
    // installs crds/ only where the CRD is missing; this shared cluster has
    // this tree's, so it is applied here, and put back at the end.)
    let _restore = CommittedCrd;
    kubectl(&[
        "apply",
        "--server-side",
        "--force-conflicts",
        "-f",
        old_crd.to_str().unwrap(),
    ]);
    let old_digest = cluster_crd_digest();

    let release = Release {
        name: "nodeguard-upgrade".to_string(),
        namespace: unique_name("nodeguard-system"),
        helm: helm.clone(),
    };
    let ns = release.namespace.clone();
    labelled_namespace(&ns);
    // The uninstall hook's pod on this node (the shared cluster's other
    // Nodes have no kubelet).
    kubectl(&[
        "label",
        "node",
        node,
        "nodeguard-test/kubelet=true",
        "--overwrite",
    ]);
    let t_install = Instant::now();
    run(helm_cmd(&helm)
        .args(["install", &release.name, &chart])
        .args(["--version", &previous, "--plain-http", "-n", &ns])
        .args(["--set", "defaultPolicy.enabled=true"])
        // Conditions re-written every 10 s (not 300): after the upgrade the
        // new agent's own writes are waited for before they are compared.
        .args(["--set", "conditionHeartbeatSeconds=10"])
        .args([
            "--set-string",
            "uninstall.nodeSelector.nodeguard-test/kubelet=true",
        ]));
    let on_node = ListParams::default().fields(&format!("spec.nodeName={node}"));
    let (old_pod, _, _) = running_and_ready(
        admin,
        &ns,
        &on_node,
        t_install,
        &format!("the previous release's pod on {node}"),
    )
    .await;
    let old_pod = old_pod.metadata.name.unwrap();
    kubework::inhibitor_held(vm, "nodeguard").await;
    wait_condition(
        admin,
        node,
        "GracefulShutdownUnavailable",
        "False",
        Duration::from_secs(90),
        "graceful shutdown armed by the previous release",
    )
    .await;

    // A monitor condition True, with a taint.
    let canary = unique_name("vm-upgrade-canary");
    apply_policy(
        admin,
        &canary,
        serde_json::json!({
            "nodeSelector": {"matchLabels": {"kubernetes.io/hostname": node}},
            "monitors": [{
                "name": "upgrade-canary", "source": {"kmsg": {}},
                "conditions": [{"type": "UpgradeCanary", "reason": "NoCanary", "message": "no canary line",
                                "taint": {"key": CANARY_TAINT, "effect": "NoSchedule"}}],
                "rules": [{"type": "permanent", "condition": "UpgradeCanary", "reason": "CanarySeen",
                           "pattern": "nodeguard upgrade canary \\d+"}],
            }],
        }),
    )
    .await;
    wait_condition(
        admin,
        node,
        "UpgradeCanary",
        "False",
        Duration::from_secs(90),
        "the canary monitor running in the previous release",
    )
    .await;
    vm.sh("echo '<3>nodeguard upgrade canary 1' > /dev/kmsg")
        .await;
    wait_condition(
        admin,
        node,
        "UpgradeCanary",
        "True",
        Duration::from_secs(60),
        "UpgradeCanary=True from the kmsg line",
    )
    .await;
    let nodes: Api<Node> = Api::all(admin.clone());
    eventually(Duration::from_secs(60), "the canary's taint", || async {
        has_taint(&nodes.get(node).await.unwrap(), CANARY_TAINT)
    })
    .await;

    // What the previous CRD does to the new field. A server-side apply
    // (and kubectl's strict validation) is refused; a plain create or
    // update, as Helm and controllers send, is stored without it, with
    // only a warning in the response (why the chart checks the CRD).
    let new_field = unique_name("vm-upgrade-new-field");
    let new_field_spec = serde_json::json!({
        "nodeSelector": {"matchLabels": {"kubernetes.io/hostname": node}},
        "healthz": {"ineligibleTaints": ["example.com/drain"]},
    });
    let policies: Api<NodeGuardPolicy> = Api::all(admin.clone());
    let p: NodeGuardPolicy = serde_json::from_value(serde_json::json!({
        "apiVersion": "nodeguard.io/v1alpha1", "kind": "NodeGuardPolicy",
        "metadata": {"name": new_field}, "spec": new_field_spec.clone(),
    }))
    .unwrap();
    let created = policies.create(&PostParams::default(), &p).await.unwrap();
    assert!(
        created.spec.healthz.is_none(),
        "the previous CRD would have pruned spec.healthz, but it is stored: {:?}",
        created.spec.healthz
    );

    // The node before the upgrade.
    let before = nodes.get(node).await.unwrap();
    let owned_before = owned(&before);
    let taints_before = canary_taints(&before);
    assert!(owned_before.contains_key("UpgradeCanary"));
    let files_before = vm.sh("find /var/lib/nodeguard -type f | sort").await;
    assert!(
        !files_before.trim().is_empty(),
        "the previous release wrote no state file"
    );
    std::fs::write(dir.join("upgrade-state-before.txt"), &files_before).unwrap();

    // logind's delay inhibitors sampled in the guest from here to the end
    // of the rollout.
    vm.sh(&format!(
        "cat > /run/e2e-inhibit-watch.sh <<'EOF'\nwhile :; do l=$(systemd-inhibit --list --no-pager --mode=delay | grep nodeguard | grep shutdown); n=$(printf '%s' \"$l\" | grep -c nodeguard); h=$(printf '%s' \"$l\" | grep -c nodeguard-handover); echo \"$(date +%s.%N) $n $h\"; sleep 0.{SAMPLE_MS:03}; done\nEOF\nsystemd-run --unit=e2e-inhibit-watch -p StandardOutput=file:/run/e2e-inhibit-watch.log /bin/sh /run/e2e-inhibit-watch.sh"
    ))
    .await;

    // `helm upgrade` as a user would run it first: without applying the
    // CRD. The chart stops it and names the command.
    let refused = helm_cmd(&helm)
        .args(["upgrade", &release.name, &chart])
        .args(["--version", &published.version, "--plain-http", "-n", &ns])
        .arg("--reset-then-reuse-values")
        .output()
        .unwrap();
    let refused_err = String::from_utf8_lossy(&refused.stderr).to_string();
    std::fs::write(dir.join("upgrade-refused.txt"), &refused_err).unwrap();
    assert!(
        !refused.status.success(),
        "helm upgrade went on over the previous CRD"
    );
    assert!(
        refused_err.contains("is not this chart's")
            && refused_err.contains(&format!(
                "helm show crds oci://ghcr.io/nodeguard/charts/nodeguard --version {} | kubectl apply --server-side --force-conflicts -f -",
                published.version
            )),
        "the refusal names the command that applies the CRD:\n{refused_err}"
    );

    // README "Upgrading", its first command, with this test bed's registry.
    run(Command::new("bash").arg("-c").arg(format!(
        "set -o pipefail; {} show crds {chart} --version {} --plain-http | kubectl --kubeconfig {} apply --server-side --force-conflicts -f -",
        helm.display(),
        published.version,
        kubeconfig_path().display()
    )));
    let new_digest = cluster_crd_digest();
    assert_ne!(new_digest, old_digest);
    let t_upgrade = Instant::now();
    run(helm_cmd(&helm)
        .args(["upgrade", &release.name, &chart])
        .args(["--version", &published.version, "--plain-http", "-n", &ns])
        .arg("--reset-then-reuse-values"));
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &ns);
    let deadline = Instant::now() + Duration::from_secs(240);
    let (new_pod, new_ready) = loop {
        let items = pods.list(&on_node).await.unwrap().items;
        if let Some(p) = items
            .iter()
            .find(|p| p.metadata.name.as_deref() != Some(old_pod.as_str()) && pod_ready(p))
        {
            break (p.metadata.name.clone().unwrap(), t_upgrade.elapsed());
        }
        assert!(
            Instant::now() < deadline,
            "no new Ready pod on {node} 240 s after helm upgrade:\n{}",
            kubectl_status(&["describe", "pods", "-n", &ns]).unwrap_or_else(|e| e)
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    kubework::inhibitor_held(vm, "nodeguard").await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    vm.sh("systemctl stop e2e-inhibit-watch").await;
    // Where the new agent's part of the gap goes: its start → its lock.
    // (Read on the node: the API server here cannot reach the kubelet by
    // the node's name for `kubectl logs`.) Lines in the CRI log format, each
    // beginning with the time the container runtime logged it.
    let log = vm
        .sh(&format!(
            "cat /var/log/pods/{ns}_{new_pod}_*/nodeguard/*.log 2>/dev/null; true"
        ))
        .await;
    std::fs::write(dir.join("upgrade-new-agent.log"), &log).unwrap();
    let at = |needle: &str| {
        log.lines()
            .find(|l| l.contains(needle))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|t| t.parse::<jiff::Timestamp>().ok())
    };
    let agent_part = match (
        // The chart's JSON log lines.
        at("\"message\":\"starting\""),
        at("\"message\":\"holding a logind delay inhibitor"),
    ) {
        (Some(a), Some(b)) => format!(
            "{:.2} s of it from the new agent's start to its lock",
            (b - a).total(jiff::Unit::Second).unwrap()
        ),
        _ => "the new agent's start and lock lines not found (upgrade-new-agent.log)".to_string(),
    };
    let samples = vm.sh("cat /run/e2e-inhibit-watch.log").await;
    std::fs::write(dir.join("upgrade-inhibitor-samples.txt"), &samples).unwrap();
    let seen = read_samples(&samples);
    let n_samples = seen.samples;
    // The old agent left a lock with the handover unit before its own went;
    // the new one took its own before it stopped the unit: never none.
    assert_eq!(
        (seen.gaps, seen.longest_gap),
        (0, None),
        "the node was without a delay inhibitor of nodeguard's during the rollout (samples in upgrade-inhibitor-samples.txt)"
    );
    let handover = seen.handover.expect(
        "the handover unit's inhibitor never showed in logind's list (samples in upgrade-inhibitor-samples.txt)",
    );
    // And the unit is gone once the new agent holds its own.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let left = vm
            .sh("systemctl is-active nodeguard-inhibitor-handover.service; systemd-inhibit --list --no-pager | grep -c nodeguard-handover; true")
            .await;
        let mut l = left.lines();
        if l.next() != Some("active") && l.next() == Some("0") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the handover unit still runs 20 s after the new agent took its lock:\n{left}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // The unit ran the agent's own binary (copied to the state directory),
    // which would have recorded a shutdown begun meanwhile, and ended when
    // the new agent stopped it.
    let holder_log = vm
        .sh("journalctl -b -u nodeguard-inhibitor-handover.service -o cat --no-pager | tail -20; ls -l /var/lib/nodeguard/handover/")
        .await;
    let _ = std::fs::write(dir.join("upgrade-handover-unit.log"), &holder_log);
    assert!(
        holder_log.contains("holding the delay inhibitor for the next agent")
            && holder_log.contains("stopped (the next agent holds its own delay inhibitor)"),
        "the handover unit did not run nodeguard's holder from /var/lib/nodeguard/handover:\n{holder_log}"
    );

    // The node after: conditions, taints and state files as they were.
    wait_condition(
        admin,
        node,
        "GracefulShutdownUnavailable",
        "False",
        Duration::from_secs(60),
        "graceful shutdown armed by the upgraded release",
    )
    .await;
    // Compared once the new agent has written every one of them (a
    // heartbeat after its pod started): had it lost a monitor's state, its
    // write would say so (a permanent condition starts False).
    let new_started = pods
        .get(&new_pod)
        .await
        .unwrap()
        .status
        .and_then(|s| s.start_time)
        .expect("the new pod's start time")
        .0;
    let mut after = nodes.get(node).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let stale: Vec<String> = heartbeats(&after)
            .into_iter()
            .filter(|(t, hb)| owned_before.contains_key(t) && hb.is_none_or(|hb| hb <= new_started))
            .map(|(t, _)| t)
            .collect();
        if stale.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the new agent wrote none of {stale:?} within 90 s (heartbeat 10 s)"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
        after = nodes.get(node).await.unwrap();
    }
    let owned_after = owned(&after);
    let mut same_transition = 0;
    for (t, (status, ltt)) in &owned_before {
        let now = owned_after.get(t);
        assert_eq!(
            now.map(|(s, _)| s),
            Some(status),
            "{t} was {status} before the upgrade, now {now:?}"
        );
        if now.map(|(_, l)| l) == Some(ltt) {
            same_transition += 1;
        } else {
            assert!(
                !MONITOR_CONDITIONS.contains(&t.as_str()),
                "{t}, a monitor's condition, changed its lastTransitionTime: {ltt} → {now:?}"
            );
        }
    }
    assert_eq!(canary_taints(&after), taints_before, "taints kept");
    let missing = vm
        .sh(&format!(
            "for f in {}; do [ -f \"$f\" ] || echo \"$f\"; done; true",
            files_before
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
        ))
        .await;
    assert!(
        missing.trim().is_empty(),
        "state files lost in the upgrade: {missing}"
    );

    // The new field, accepted now.
    apply_policy(admin, &new_field, new_field_spec).await;
    let stored = kubectl(&[
        "get",
        "nodeguardpolicy",
        &new_field,
        "-o",
        "jsonpath={.spec.healthz.ineligibleTaints[0]}",
    ]);
    assert_eq!(stored.trim(), "example.com/drain", "spec.healthz stored");
    eventually(
        Duration::from_secs(60),
        "the policy using the new field Accepted by the upgraded agent",
        || async {
            let out = kubectl(&[
                "get",
                "nodeguardpolicy",
                &new_field,
                "-o",
                "jsonpath={.metadata.generation} {.status.observedGeneration} {.status.conditions[?(@.type==\"Accepted\")].status}",
            ]);
            let f: Vec<&str> = out.split_whitespace().collect();
            f.len() == 3 && f[0] == f[1] && f[2] == "True"
        },
    )
    .await;

    // And in force: the taint it names makes the node ineligible in the
    // new agent's /healthz (the chart's port 9909 on the node's network).
    let healthz = "exec 3<>/dev/tcp/127.0.0.1/9909 && printf 'GET /healthz HTTP/1.0\\r\\n\\r\\n' >&3 && timeout 5 cat <&3; true";
    let before_taint = vm.sh(healthz).await;
    assert!(
        !before_taint.contains("example.com/drain"),
        "/healthz before the taint: {before_taint}"
    );
    kubectl(&[
        "taint",
        "node",
        node,
        "example.com/drain=upgrade:NoSchedule",
    ]);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let response = vm.sh(healthz).await;
        if response
            .lines()
            .next()
            .is_some_and(|l| l.starts_with("HTTP/1.") && l.contains(" 503"))
            && response.contains("the Node has the taint example.com/drain")
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "/healthz 30 s after the taint spec.healthz names: {response}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    kubectl(&["taint", "node", node, "example.com/drain-"]);

    delete_policy(admin, &new_field).await;
    delete_policy(admin, &canary).await;
    // Out with its hook, so the scenarios after this one start on a clean node.
    uninstall_with_hook(&release, &pods, "the upgraded release's pods gone").await;
    // Going for good hands nothing over: no lock stays behind.
    let left = vm
        .sh("systemctl is-active nodeguard-inhibitor-handover.service; systemd-inhibit --list --no-pager | grep -c nodeguard; test -e /var/lib/nodeguard/handover && echo holder-left || echo holder-gone")
        .await;
    assert_eq!(
        left.lines().collect::<Vec<_>>(),
        ["inactive", "0", "holder-gone"],
        "after helm uninstall, a delay inhibitor of nodeguard's (or the handover's binary) is left on the node"
    );
    drop(release);
    rows.pass(
        "kube-upgrade",
        format!(
            "previous chart {previous} (its CRD without spec.{NEW_FIELD}, image by tag) installed with the default policy: inhibitor held, UpgradeCanary=True with its taint, spec.{NEW_FIELD} dropped from a plain create by its CRD; `helm upgrade --reset-then-reuse-values` to {} refused until the CRD is applied, naming README's command; after `helm show crds … | kubectl apply --server-side --force-conflicts`, the upgrade rolled the pod ({old_pod} → {new_pod} Ready {} after helm upgrade); a delay inhibitor of nodeguard's held throughout ({n_samples} samples, one per `systemd-inhibit --list`): the handover unit's (nodeguard's holder from the state directory) for {handover:.2} s, between the old agent's stop and the new agent's own lock ({agent_part}), then the unit stopped; after the new agent re-wrote them, the {} owned conditions kept their status ({same_transition} their transition time, the monitors' all), the taints and {} state files kept; a policy using spec.{NEW_FIELD} stored, Accepted and in force (its taint turns /healthz 503)",
            published.version,
            secs(new_ready),
            owned_before.len(),
            files_before.lines().count(),
        ),
    );
    up
}
