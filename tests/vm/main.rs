//! End to end on a real node: a Debian VM (systemd, logind, softdog) under
//! qemu/TCG running nodeguard from its systemd unit against the real test
//! control plane. A plain program (`harness = false`): the scenarios share
//! boots, run in order and end with a summary table.
//!
//! `cargo test --test vm` runs every scenario; `cargo test --test vm --
//! --scenario poweroff` runs one (and what it needs first: `reboot` boots the
//! disk `poweroff` left). Artifacts (serial logs, journals, `kubectl describe
//! node`, Events) go to `target/e2e/vm/<node>/`.

mod kubenode;
mod kubework;
mod qemu;
#[path = "../support/mod.rs"]
mod support;
mod upgrade;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{FutureExt, StreamExt};
use k8s_openapi::api::core::v1::Node;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use qemu::{Disk, GUEST_APISERVER, Image, Vm};
use support::pods::{PodsInThreeGroups, delete_pdb, kubelet_sim, pods_in_three_groups};
use support::*;

const SCENARIOS: [&str; 23] = [
    "inhibit-delay",
    "kernel-problem",
    "clock-step",
    "systemd-watchdog",
    "logind-restart",
    "poweroff",
    "reboot",
    "device-watchdog",
    "kube-install",
    "kube-upgrade",
    "daemonset",
    "kube-probe",
    "kube-journald",
    "kube-node-restriction",
    "kube-readiness-gate",
    "kube-trust",
    "kube-alerts",
    "kube-npd",
    "kube-npd-plugins",
    "kube-reboot",
    "kube-device-watchdog",
    "kube-gns",
    "kube-arm64",
];
/// Run only when named with `--scenario`: the arm64 node (qemu-system-aarch64
/// under TCG, its own image and cross-built kubelet) is too slow for CI;
/// README says what it measured.
const OPT_IN: [&str; 1] = ["kube-arm64"];
/// The shutdown policy's groups need 10 + 10 + 8 s plus the 2 s margin.
const NEEDED_DELAY_SECS: u64 = 30;
/// The unit's WatchdogSec=30s, shortened by a drop-in so the scenario is quick.
const UNIT_WATCHDOG_SECS: u64 = 10;
const DEVICE_TIMEOUT_SECS: u64 = 10;
const BOOT_TIMEOUT: Duration = Duration::from_secs(180);

struct Row {
    scenario: &'static str,
    passed: bool,
    detail: String,
}

#[derive(Clone, Default)]
struct Rows(Arc<Mutex<Vec<Row>>>);

impl Rows {
    fn pass(&self, scenario: &'static str, detail: String) {
        eprintln!("vm: {scenario}: ok: {detail}");
        self.0.lock().unwrap().push(Row {
            scenario,
            passed: true,
            detail,
        });
    }
    fn done(&self, scenario: &str) -> bool {
        self.0
            .lock()
            .unwrap()
            .iter()
            .any(|r| r.scenario == scenario)
    }
}

fn main() {
    let mut wanted: Vec<String> = Vec::new();
    let mut filters: Vec<String> = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--scenario" => wanted.push(args.next().expect("--scenario NAME")),
            "--list" => {
                for s in SCENARIOS {
                    println!("{s}: test");
                }
                return;
            }
            // libtest's flags that cargo may pass along; nothing to do here.
            a if a.starts_with('-') => {}
            a => filters.push(a.to_string()),
        }
    }
    for w in &wanted {
        assert!(
            SCENARIOS.contains(&w.as_str()),
            "unknown scenario {w:?}; one of {SCENARIOS:?}"
        );
    }
    let selected: Vec<&'static str> = SCENARIOS
        .into_iter()
        .filter(|s| {
            if wanted.is_empty() {
                !OPT_IN.contains(s)
            } else {
                wanted.iter().any(|w| w == s)
            }
        })
        .filter(|s| {
            filters.is_empty()
                || filters
                    .iter()
                    .any(|f| s.contains(f.as_str()) || "vm".contains(f.as_str()))
        })
        .collect();
    if selected.is_empty() {
        println!(
            "\nrunning 0 tests\n\ntest result: ok. 0 passed; 0 failed; 0 ignored; 0 measured; {} filtered out\n",
            SCENARIOS.len()
        );
        return;
    }
    support::init_logs();
    let started = Instant::now();
    let rows = Rows::default();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let ok = rt.block_on(run(&selected, &rows));
    let rows = std::mem::take(&mut *rows.0.lock().unwrap());

    let mut table = String::from("| scenario | result | key timings |\n|---|---|---|\n");
    for s in &selected {
        match rows.iter().find(|r| r.scenario == *s) {
            Some(r) => {
                let result = if r.passed { "ok" } else { "FAILED" };
                writeln!(table, "| {} | {result} | {} |", r.scenario, r.detail).unwrap();
            }
            None => writeln!(
                table,
                "| {s} | FAILED | not reached (an earlier step of its boot failed) |"
            )
            .unwrap(),
        }
    }
    let passed = rows
        .iter()
        .filter(|r| r.passed && selected.contains(&r.scenario))
        .count();
    let failed = selected.len() - passed;
    let out = repo_root().join("target/e2e/vm");
    std::fs::create_dir_all(&out).unwrap();
    // kube-gns beside kube-reboot: the kubelet's graceful node shutdown
    // and nodeguard's on the same pods (written when both ran).
    let gns = out.join("gns-comparison.md");
    if selected.contains(&"kube-gns")
        && let Ok(side_by_side) = std::fs::read_to_string(&gns)
    {
        write!(
            table,
            "\nGraceful shutdown of the real node, the kubelet's beside nodeguard's (kube-gns, kube-reboot):\n\n{side_by_side}"
        )
        .unwrap();
    }
    std::fs::write(out.join("summary.md"), &table).unwrap();
    println!(
        "\nnode VM scenarios ({:.0} s; artifacts in target/e2e/vm/):\n\n{table}",
        started.elapsed().as_secs_f64()
    );
    let verdict = if ok && failed == 0 { "ok" } else { "FAILED" };
    println!(
        "test result: {verdict}. {passed} passed; {failed} failed; 0 ignored; 0 measured; 0 filtered out\n"
    );
    if verdict != "ok" {
        std::process::exit(1);
    }
}

/// Runs the boots the selected scenarios need; false when any panicked.
async fn run(selected: &[&'static str], rows: &Rows) -> bool {
    let wants = |s: &str| selected.contains(&s);
    let mut ok = true;
    let mut record = |scenarios: &[&'static str],
                      result: Result<(), Box<dyn std::any::Any + Send>>| {
        if let Err(p) = result {
            ok = false;
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            for s in scenarios {
                if !rows.done(s) {
                    let first_line = msg.lines().next().unwrap_or("").replace('|', "/");
                    rows.0.lock().unwrap().push(Row {
                        scenario: s,
                        passed: false,
                        detail: first_line,
                    });
                    break;
                }
            }
        }
    };
    let shutdown_steps: Vec<&'static str> = [
        "inhibit-delay",
        "kernel-problem",
        "clock-step",
        "systemd-watchdog",
        "logind-restart",
        "poweroff",
    ]
    .into_iter()
    .filter(|s| wants(s) || (*s == "poweroff" && wants("reboot")))
    .collect();
    let env = match std::panic::AssertUnwindSafe(Env::new())
        .catch_unwind()
        .await
    {
        Ok(env) => Arc::new(env),
        Err(p) => {
            record(selected, Err(p));
            return false;
        }
    };
    if !shutdown_steps.is_empty() {
        let (e, r, steps) = (env.clone(), rows.clone(), shutdown_steps.clone());
        let then_reboot = wants("reboot");
        let res =
            tokio::spawn(async move { shutdown_node(&e, &r, &steps, then_reboot).await }).await;
        let mut scen = shutdown_steps.clone();
        scen.push("reboot");
        record(&scen, res.map_err(|e| e.into_panic()));
    }
    if wants("device-watchdog") {
        let (e, r) = (env.clone(), rows.clone());
        let res = tokio::spawn(async move { device_watchdog_node(&e, &r).await }).await;
        record(&["device-watchdog"], res.map_err(|e| e.into_panic()));
    }
    // The real node's scenarios share its boots; each needs the install.
    let kube_steps: Vec<&'static str> = kubenode::STEPS.into_iter().filter(|s| wants(s)).collect();
    if !kube_steps.is_empty() {
        let (e, r, steps) = (env.clone(), rows.clone(), kube_steps.clone());
        let res = tokio::spawn(async move { kubenode::daemonset_node(&e, &r, &steps).await }).await;
        let mut scen: Vec<&str> = kube_steps
            .iter()
            .copied()
            .filter(|s| *s == "kube-install" || *s == "kube-upgrade")
            .collect();
        scen.push("daemonset");
        scen.extend(
            kube_steps
                .into_iter()
                .filter(|s| !matches!(*s, "daemonset" | "kube-install" | "kube-upgrade")),
        );
        record(&scen, res.map_err(|e| e.into_panic()));
    }
    if wants("kube-gns") {
        let (e, r) = (env.clone(), rows.clone());
        let res = tokio::spawn(async move { kubenode::gns_node(&e, &r).await }).await;
        record(&["kube-gns"], res.map_err(|e| e.into_panic()));
    }
    if wants("kube-arm64") {
        let (r, repo) = (rows.clone(), repo_root());
        let e = Arc::new(Env {
            image: Image::locate_arch(&repo, "arm64"),
            binary: env.binary.clone(),
            admin: env.admin.clone(),
            apiserver_port: env.apiserver_port,
            rbac: env.rbac.clone(),
        });
        let res = tokio::spawn(async move { kubenode::daemonset_node(&e, &r, &[]).await }).await;
        record(&["kube-arm64"], res.map_err(|e| e.into_panic()));
    }
    env.cleanup();
    ok
}

/// What every boot needs: the image, the agent binary, the cluster's address
/// and an identity for the agent with the chart's RBAC.
struct Env {
    image: Image,
    binary: PathBuf,
    admin: Client,
    apiserver_port: u16,
    rbac: PathBuf,
}

const RBAC_KINDS: [&str; 5] = [
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
];

impl Env {
    async fn new() -> Env {
        let repo = repo_root();
        let admin = admin_client().await;
        let image = Image::locate(&repo);
        let binary = agent_binary(&repo);
        let ports = std::fs::read_to_string(kubeconfig_path().with_file_name("ports.env"))
            .expect("cluster ports.env");
        let apiserver_port = ports
            .lines()
            .find_map(|l| l.strip_prefix("APISERVER_PORT="))
            .expect("APISERVER_PORT")
            .parse()
            .unwrap();
        // The agent runs as the chart's ServiceAccount with the chart's
        // ClusterRole and Role (from the rendered manifest), not as admin.
        let manifest = std::fs::read_to_string(repo.join("manifests/nodeguard.yaml")).unwrap();
        // (The policy-editor and -admin ClusterRoles are for people.)
        let docs: Vec<&str> = manifest
            .split("\n---")
            .filter(|d| {
                d.lines()
                    .any(|l| RBAC_KINDS.iter().any(|k| *l == format!("kind: {k}")))
                    && !d.contains("-policy-editor\n")
                    && !d.contains("-policy-admin\n")
            })
            .collect();
        assert_eq!(
            docs.len(),
            RBAC_KINDS.len(),
            "RBAC objects in manifests/nodeguard.yaml"
        );
        let dir = repo.join("target/e2e/vm");
        // Artifacts are those of the last run: node names are unique per run,
        // so earlier runs' directories would pile up.
        if let Ok(entries) = std::fs::read_dir(&dir) {
            for e in entries.flatten() {
                if e.file_name().to_string_lossy().starts_with("vm-") {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        let _ = std::fs::remove_file(dir.join("gns-comparison.md"));
        std::fs::create_dir_all(&dir).unwrap();
        let rbac = dir.join("rbac.yaml");
        std::fs::write(&rbac, docs.join("\n---\n")).unwrap();
        if kubectl_status(&["get", "namespace", "nodeguard-system"]).is_err() {
            kubectl(&["create", "namespace", "nodeguard-system"]);
        }
        kubectl(&["apply", "-f", rbac.to_str().unwrap()]);
        Env {
            image,
            binary,
            admin,
            apiserver_port,
            rbac,
        }
    }

    fn cleanup(&self) {
        let _ = kubectl_status(&[
            "delete",
            "--ignore-not-found",
            "-f",
            self.rbac.to_str().unwrap(),
        ]);
    }

    /// A disk for `node`: hostname, the agent binary, the repo's unit with
    /// a drop-in, and a kubeconfig holding a token of the agent's account.
    fn disk_for(&self, node: &str, dir: &Path, unit_watchdog: Option<u64>) -> Disk {
        let disk = Disk::copy_of(&self.image, dir);
        disk.write("/etc/hostname", format!("{node}\n").as_bytes(), 0o644);
        disk.write(
            "/usr/local/bin/nodeguard",
            &std::fs::read(&self.binary).unwrap(),
            0o755,
        );
        let unit = std::fs::read(repo_root().join("manifests/systemd/nodeguard.service")).unwrap();
        disk.write("/etc/systemd/system/nodeguard.service", &unit, 0o644);
        disk.symlink(
            "/etc/systemd/system/multi-user.target.wants/nodeguard.service",
            "/etc/systemd/system/nodeguard.service",
        );
        disk.mkdir("/etc/systemd/system/nodeguard.service.d");
        let mut drop_in = String::from(
            "[Service]\n# The Lease of the policy status writer lives in the chart's namespace.\nEnvironment=POD_NAMESPACE=nodeguard-system\nEnvironment=RUST_LOG=info,nodeguard=debug\n# The node's owner lets policies pet softdog (device-watchdog).\nEnvironment=NODEGUARD_ALLOW_WATCHDOG_DEVICES=/dev/watchdog\n",
        );
        if let Some(s) = unit_watchdog {
            writeln!(drop_in, "WatchdogSec={s}s").unwrap();
        }
        disk.write(
            "/etc/systemd/system/nodeguard.service.d/10-e2e.conf",
            drop_in.as_bytes(),
            0o644,
        );
        let token = kubectl(&[
            "create",
            "token",
            "nodeguard",
            "-n",
            "nodeguard-system",
            "--duration",
            "2h",
        ]);
        let ca = std::fs::read_to_string(kubeconfig_path().with_file_name("pki").join("ca.crt"))
            .unwrap();
        use base64::Engine as _;
        let kubeconfig = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: https://{GUEST_APISERVER}\n    certificate-authority-data: {}\nusers:\n- name: nodeguard\n  user:\n    token: {}\ncontexts:\n- name: node\n  context: {{cluster: test, user: nodeguard}}\ncurrent-context: node\n",
            base64::engine::general_purpose::STANDARD.encode(ca),
            token.trim()
        );
        disk.write("/etc/nodeguard/kubeconfig", kubeconfig.as_bytes(), 0o600);
        disk
    }
}

/// The release binary `e2e/image` builds (static, so it runs on the guest);
/// `make test` builds it first, a development loop runs `e2e/image` itself.
fn agent_binary(repo: &Path) -> PathBuf {
    let candidates = [
        "target/x86_64-unknown-linux-musl/release/nodeguard",
        "target/x86_64-unknown-linux-gnu/release/nodeguard",
    ];
    candidates
        .iter()
        .map(|c| repo.join(c))
        .filter(|p| p.is_file())
        .max_by_key(|p| p.metadata().unwrap().modified().unwrap())
        .inspect(|p| {
            let built = p.metadata().unwrap().modified().unwrap();
            if std::env::var_os("NODEGUARD_STALE_IMAGE_OK").is_none()
                && let Some((src, at)) = kubenode::newest_source(repo)
                && at > built
            {
                panic!(
                    "{} is older than {}: run e2e/image (make test does), or set NODEGUARD_STALE_IMAGE_OK=1",
                    p.display(),
                    src.display()
                );
            }
        })
        .unwrap_or_else(|| {
            panic!(
                "no static nodeguard binary: run e2e/image (make test does) to build {}",
                candidates[0]
            )
        })
}

fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

/// Boots `disk` and waits until the agent is up in the guest and has
/// announced `policy` on its Node; returns the VM and (boot, agent) times.
async fn boot_node(
    env: &Env,
    disk: &Disk,
    dir: &Path,
    boot: u32,
    node: &str,
    policy: &str,
) -> (Vm, Duration, Duration) {
    let mut vm = Vm::boot(&env.image, disk, env.apiserver_port, dir, boot).await;
    let booted = vm.wait_guest_agent(BOOT_TIMEOUT).await;
    let nodes: Api<Node> = Api::all(env.admin.clone());
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let n = nodes.get(node).await.unwrap();
        let effective = n
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(nodeguard::agent::EFFECTIVE_ANNOTATION));
        if effective.is_some_and(|e| {
            e.split(',')
                .any(|p| p.trim().split('@').next() == Some(policy))
        }) {
            break;
        }
        if Instant::now() > deadline {
            panic!(
                "the agent on {node} did not announce policy {policy} within 120 s; status and journal:\n{}",
                unit_report(&mut vm).await
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // Type=notify: active once the agent sent READY=1 (its watches synced).
    // The annotation alone may be left from an earlier boot.
    while vm.exec("systemctl is-active nodeguard").await.stdout.trim() != "active" {
        if Instant::now() > deadline {
            panic!(
                "the nodeguard unit on {node} did not become active within 120 s; status and journal:\n{}",
                unit_report(&mut vm).await
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let ready = vm.started.elapsed();
    eprintln!(
        "vm: {node} boot {boot}: guest agent after {}, agent ready in the API after {}",
        secs(booted),
        secs(ready)
    );
    (vm, booted, ready)
}

/// The agent unit's status and the end of this boot's journal, for a
/// failure message.
async fn unit_report(vm: &mut Vm) -> String {
    vm.exec(
        "systemctl status --no-pager nodeguard; journalctl -b --no-pager -u nodeguard | tail -60",
    )
    .await
    .stdout
}

/// Saves what an operator would look at: the node, its Events, the journal.
async fn artifacts(vm: Option<&mut Vm>, dir: &Path, node: &str, tag: &str) {
    let _ = std::fs::write(
        dir.join(format!("describe-node-{tag}.txt")),
        kubectl_status(&["describe", "node", node]).unwrap_or_else(|e| e),
    );
    let _ = std::fs::write(
        dir.join(format!("events-{tag}.txt")),
        kubectl_status(&["events", "-A", "--for", &format!("node/{node}")]).unwrap_or_else(|e| e),
    );
    if let Some(vm) = vm
        && vm.exited().is_none()
    {
        let j = vm
            .exec("journalctl -b --no-pager -o short-monotonic -u nodeguard -u systemd-logind")
            .await;
        let _ = std::fs::write(dir.join(format!("journal-{tag}.txt")), j.stdout);
    }
}

/// A test policy's name; the policy is deleted when this is dropped,
/// whatever happened to the scenario.
struct PolicyName(String);

impl std::ops::Deref for PolicyName {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl Drop for PolicyName {
    fn drop(&mut self) {
        let _ = kubectl_status(&["delete", "--ignore-not-found", "nodeguardpolicy", &self.0]);
    }
}

/// A fresh Node for one boot, its artifact directory, and a policy with
/// `spec` (plus a selector for that Node alone).
async fn node_with_policy(
    admin: &Client,
    prefix: &str,
    mut spec: serde_json::Value,
) -> (TestNode, PathBuf, PolicyName) {
    let node = TestNode::selectable(admin, "vm").await;
    let dir = node_dir(&node.name);
    let policy = PolicyName(unique_name(prefix));
    spec["nodeSelector"] = selecting(&node.name);
    apply_policy(admin, &policy, spec).await;
    (node, dir, policy)
}

fn node_dir(node: &str) -> PathBuf {
    let dir = repo_root().join("target/e2e/vm").join(node);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn has_condition(n: &Node, type_: &str, status: &str) -> bool {
    n.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == type_ && c.status == status))
}

async fn events_for(node: &str) -> String {
    kubectl(&["events", "-A", "--for", &format!("node/{node}")])
}

/// The node with the shutdown policy: inhibit delay, kernel problem, systemd
/// watchdog and poweroff on one boot, then reboot on the same disk.
async fn shutdown_node(env: &Env, rows: &Rows, steps: &[&'static str], then_reboot: bool) {
    let admin = env.admin.clone();
    let (node, dir, policy) = node_with_policy(
        &admin,
        "vm-shutdown",
        serde_json::json!({
            "shutdown": {
                "gracePeriodByPriority": [
                    {"priority": 0, "gracePeriodSeconds": 10},
                    {"priority": 1000, "gracePeriodSeconds": 10},
                    {"priority": 2000000000, "gracePeriodSeconds": 8},
                ],
                "safetyMarginSeconds": 2, "escalateAfterPercent": 50,
            },
            "watchdog": {"mode": "Systemd"},
            "monitors": [{
                "name": "kernel", "source": {"kmsg": {"path": "/dev/kmsg"}},
                "conditions": [{"type": "KernelDeadlock", "reason": "KernelHasNoDeadlock", "message": "kernel has no deadlock"}],
                "rules": [
                    {"type": "temporary", "reason": "KernelOops", "pattern": "BUG: unable to handle kernel NULL pointer dereference at .*"},
                    {"type": "permanent", "condition": "KernelDeadlock", "reason": "DockerHung",
                     "pattern": "task docker:\\w+ blocked for more than \\w+ seconds\\."},
                ],
            }, {
                // clock-step: quiet periods running across wall-clock steps.
                "name": "clock", "source": {"kmsg": {"path": "/dev/kmsg"}},
                "conditions": [
                    {"type": "ClockProbe", "reason": "NoClockProbe", "message": "no probe line", "clearAfterSeconds": 40},
                    {"type": "ClockShown", "reason": "NoClockShown", "message": "no shown line", "clearAfterSeconds": 60},
                ],
                "rules": [
                    {"type": "permanent", "condition": "ClockProbe", "reason": "ClockProbeSeen", "pattern": "nodeguard clock probe"},
                    {"type": "permanent", "condition": "ClockShown", "reason": "ClockShownSeen", "pattern": "nodeguard clock shown"},
                ],
            }],
        }),
    )
    .await;
    let disk = env.disk_for(&node.name, &dir, Some(UNIT_WATCHDOG_SECS));
    let (mut vm, booted, ready) = boot_node(env, &disk, &dir, 1, &node.name, &policy).await;
    let boot_note = format!(
        "boot {} (agent in the API at {})",
        secs(booted),
        secs(ready)
    );
    let result = std::panic::AssertUnwindSafe(async {
        for step in steps {
            match *step {
                "inhibit-delay" => {
                    inhibit_delay(&mut vm, &admin, &node.name, rows, &boot_note).await
                }
                "kernel-problem" => kernel_problem(&mut vm, &admin, &node.name, rows).await,
                "clock-step" => clock_step(&mut vm, &admin, &node.name, rows).await,
                "systemd-watchdog" => systemd_watchdog(&mut vm, &admin, &node.name, rows).await,
                "logind-restart" => logind_restart(&mut vm, &admin, &node.name, &dir, rows).await,
                "poweroff" => poweroff(&mut vm, &admin, &node.name, &dir, rows).await,
                other => unreachable!("{other}"),
            }
        }
    })
    .catch_unwind()
    .await;
    artifacts(Some(&mut vm), &dir, &node.name, "boot-1").await;
    vm.power_off().await;
    if let Err(p) = result {
        std::panic::resume_unwind(p);
    }
    if then_reboot && rows.done("poweroff") {
        let result =
            std::panic::AssertUnwindSafe(reboot(env, &disk, &dir, &node.name, &policy, rows))
                .catch_unwind()
                .await;
        if let Err(p) = result {
            std::panic::resume_unwind(p);
        }
    }
}

async fn inhibit_delay(vm: &mut Vm, admin: &Client, node: &str, rows: &Rows, boot_note: &str) {
    // The image keeps logind's default (5 s); the policy needs 30 s. The
    // unit is active (READY=1), so the agent has armed: drop-in written,
    // logind reloaded, delay lock held. Read once, no waiting: READY must
    // mean that (CI once read the drop-in 0.7 s before it was written, when
    // READY came before the shutdown loop armed).
    let drop_in = vm
        .sh("cat /etc/systemd/logind.conf.d/99-nodeguard-inhibit-delay.conf")
        .await;
    assert!(
        drop_in.contains(&format!("InhibitDelayMaxSec={NEEDED_DELAY_SECS}")),
        "{drop_in}"
    );
    let prop = vm
        .sh("busctl get-property org.freedesktop.login1 /org/freedesktop/login1 org.freedesktop.login1.Manager InhibitDelayMaxUSec")
        .await;
    assert_eq!(
        prop.trim(),
        format!("t {}", NEEDED_DELAY_SECS * 1_000_000),
        "logind's value after the reload"
    );
    let locks = vm
        .sh("systemd-inhibit --list --no-pager --mode=delay")
        .await;
    assert!(
        locks
            .lines()
            .any(|l| l.contains("nodeguard") && l.contains("shutdown") && l.contains("delay")),
        "{locks}"
    );
    wait_condition(
        admin,
        node,
        "GracefulShutdownUnavailable",
        "False",
        Duration::from_secs(10),
        "GracefulShutdownUnavailable=False",
    )
    .await;
    // Nothing else configures it: logind.conf has only the commented default.
    let conf = vm
        .sh("grep -rh InhibitDelayMaxSec /etc/systemd/logind.conf /etc/systemd/logind.conf.d/")
        .await;
    let expected = format!("InhibitDelayMaxSec={NEEDED_DELAY_SECS}");
    assert_eq!(
        conf.lines().map(str::trim).collect::<Vec<_>>(),
        ["#InhibitDelayMaxSec=5", expected.as_str()],
        "{conf}"
    );
    rows.pass(
        "inhibit-delay",
        format!("logind 5 s → drop-in, reload, read back {NEEDED_DELAY_SECS} s; delay lock held; {boot_note}"),
    );
}

async fn kernel_problem(vm: &mut Vm, admin: &Client, node: &str, rows: &Rows) {
    assert!(!condition_is(admin, node, "KernelDeadlock", "True").await);
    let t0 = Instant::now();
    vm.sh("echo '<3>INFO: task docker:4242 blocked for more than 120 seconds.' > /dev/kmsg")
        .await;
    let written = t0.elapsed();
    eventually(Duration::from_secs(10), "KernelDeadlock=True", || {
        condition_is(admin, node, "KernelDeadlock", "True")
    })
    .await;
    let seen = t0.elapsed();
    assert!(
        seen <= Duration::from_secs(2),
        "the condition took {seen:?} (at most 2 s)"
    );
    let c = node_conditions(admin, node, "KernelDeadlock")
        .await
        .remove(0);
    assert_eq!(c.reason.as_deref(), Some("DockerHung"));
    let describe = kubectl(&["describe", "node", node]);
    assert!(
        describe.lines().any(|l| l.contains("KernelDeadlock")
            && l.contains("True")
            && l.contains("DockerHung")),
        "{describe}"
    );
    rows.pass(
        "kernel-problem",
        format!("/dev/kmsg line → KernelDeadlock=True (DockerHung) in the API after {} (exec round trip {})", secs(seen), secs(written)),
    );
}

/// The guest's wall clock stepped an hour forward and back (as an NTP step
/// or `date -s` does) while quiet periods run, with the agent restarted
/// after each step: a quiet period measures the time that passed since the
/// line, and condition times are on the clock as it reads.
async fn clock_step(vm: &mut Vm, admin: &Client, node: &str, rows: &Rows) {
    let guest_clock = async |vm: &mut Vm| -> i64 {
        let out = vm.sh("date +%s").await;
        out.trim()
            .parse()
            .unwrap_or_else(|_| panic!("date +%s: {out:?}"))
    };
    let transition_of = async |type_: &str| -> i64 {
        node_conditions(admin, node, type_)
            .await
            .first()
            .and_then(|c| c.last_transition_time.as_ref())
            .map(|t| t.0.as_second())
            .unwrap_or_else(|| panic!("{type_} has no lastTransitionTime"))
    };
    let restart = async |vm: &mut Vm| {
        // Type=notify: back when the new agent said READY=1.
        vm.sh("systemctl restart nodeguard && systemctl is-active nodeguard")
            .await;
    };
    let held_until = async |type_: &str, since: Instant, until: Duration| {
        while since.elapsed() < until {
            assert!(
                condition_is(admin, node, type_, "True").await,
                "{type_} cleared {} after its line (quiet period not over)",
                secs(since.elapsed())
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    };
    let cleared_after = async |type_: &str, since: Instant, at_most: Duration| -> Duration {
        eventually(
            at_most.saturating_sub(since.elapsed()),
            &format!("{type_}=False"),
            || condition_is(admin, node, type_, "False"),
        )
        .await;
        since.elapsed()
    };

    assert!(!condition_is(admin, node, "ClockProbe", "True").await);
    vm.sh("echo '<3>nodeguard clock probe' > /dev/kmsg").await;
    let probe_line = Instant::now();
    wait_condition(
        admin,
        node,
        "ClockProbe",
        "True",
        Duration::from_secs(10),
        "ClockProbe=True",
    )
    .await;

    // Forward an hour. What is written after the step is on the new clock.
    vm.sh("date -s @$(( $(date +%s) + 3600 )) >/dev/null").await;
    vm.sh("echo '<3>nodeguard clock shown' > /dev/kmsg").await;
    let shown_line = Instant::now();
    wait_condition(
        admin,
        node,
        "ClockShown",
        "True",
        Duration::from_secs(10),
        "ClockShown=True",
    )
    .await;
    let guest = guest_clock(vm).await;
    let shown = transition_of("ClockShown").await;
    assert!(
        (guest - shown).abs() <= 30,
        "ClockShown's lastTransitionTime {shown} is not on the guest's clock {guest} (stepped +3600 s)"
    );
    // A restart after the step: the probe's quiet period still counts from
    // its line (the saved time moved with the step), not an hour earlier.
    restart(vm).await;
    held_until("ClockProbe", probe_line, Duration::from_secs(34)).await;
    let probe_cleared = cleared_after("ClockProbe", probe_line, Duration::from_secs(60)).await;

    // Back an hour, to the real time; the shown line's quiet period runs on.
    vm.sh("date -s @$(( $(date +%s) - 3600 )) >/dev/null").await;
    let back = guest_clock(vm).await;
    let host = jiff::Timestamp::now().as_second();
    assert!((back - host).abs() <= 30, "guest {back} vs host {host}");
    restart(vm).await;
    held_until("ClockShown", shown_line, Duration::from_secs(54)).await;
    let shown_cleared = cleared_after("ClockShown", shown_line, Duration::from_secs(80)).await;
    let cleared_at = transition_of("ClockShown").await;
    assert!(
        (cleared_at - back).abs() <= 120,
        "the clear's lastTransitionTime {cleared_at} is on the guest's clock ({back} at the step back)"
    );
    rows.pass(
        "clock-step",
        format!(
            "+1 h step, restart: 40 s quiet period cleared {} after its line; −1 h step, restart: 60 s one cleared {} after; condition times on the stepped clock (±30 s)",
            secs(probe_cleared),
            secs(shown_cleared)
        ),
    );
}

async fn unit_state(vm: &mut Vm) -> (i64, u64, String) {
    let out = vm
        .sh("systemctl show -p MainPID -p NRestarts -p ActiveState nodeguard")
        .await;
    let get = |k: &str| {
        out.lines()
            .find_map(|l| l.strip_prefix(&format!("{k}=")))
            .unwrap_or("")
            .to_string()
    };
    (
        get("MainPID").parse().unwrap(),
        get("NRestarts").parse().unwrap(),
        get("ActiveState"),
    )
}

/// A `*Monotonic` timestamp property of the nodeguard unit (µs; 0: unset).
async fn monotonic_property(vm: &mut Vm, property: &str) -> u64 {
    let out = vm
        .sh(&format!("systemctl show -p {property} --value nodeguard"))
        .await;
    out.trim()
        .parse()
        .unwrap_or_else(|_| panic!("{property}: {out:?}"))
}

async fn systemd_watchdog(vm: &mut Vm, admin: &Client, node: &str, rows: &Rows) {
    let (pid, restarts, state) = unit_state(vm).await;
    assert_eq!(state, "active");
    assert!(pid > 0);
    let t0 = Instant::now();
    vm.sh(&format!("kill -STOP {pid}")).await;
    // The frozen agent pets no more: its last WATCHDOG=1 is where systemd's
    // WatchdogSec counts from (up to one pet interval before the freeze).
    let last_pet = monotonic_property(vm, "WatchdogTimestampMonotonic").await;
    let deadline = Instant::now() + Duration::from_secs(UNIT_WATCHDOG_SECS + 60);
    let (new_pid, new_restarts) = loop {
        let (p, n, s) = unit_state(vm).await;
        if n > restarts && p != pid && s == "active" {
            break (p, n);
        }
        assert!(
            Instant::now() < deadline,
            "systemd did not restart the frozen agent (pid {p}, NRestarts {n}, {s})"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let back = t0.elapsed();
    assert_eq!(new_restarts, restarts + 1, "one restart");
    let started = monotonic_property(vm, "ExecMainStartTimestampMonotonic").await;
    let after_pet = Duration::from_micros(started.saturating_sub(last_pet));
    assert!(
        last_pet > 0 && after_pet >= Duration::from_secs(UNIT_WATCHDOG_SECS + 2),
        "restarted {after_pet:?} after the last pet, before WatchdogSec and RestartSec=2s ({back:?} after the freeze)"
    );
    let journal = vm.sh("journalctl -b --no-pager -u nodeguard").await;
    assert!(
        journal.contains("Watchdog timeout"),
        "systemd's watchdog fired: {journal}"
    );
    // Back to serving: the lock is held again and the Node is still fine.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !vm
        .exec("systemd-inhibit --list --no-pager --mode=delay")
        .await
        .stdout
        .contains("nodeguard")
    {
        assert!(
            Instant::now() < deadline,
            "the inhibitor is taken again within 20 s"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(condition_is(admin, node, "GracefulShutdownUnavailable", "False").await);
    rows.pass(
        "systemd-watchdog",
        format!("SIGSTOP → \"Watchdog timeout\", NRestarts {restarts}→{new_restarts}, new pid active (READY=1) {} after the freeze, started {} after the last pet (WatchdogSec={UNIT_WATCHDOG_SECS}s, RestartSec=2s)", secs(back), secs(after_pet)),
    );
    let _ = new_pid;
}

/// How many shutdown delay inhibitors `who` holds (`systemd-inhibit`).
async fn delay_locks(vm: &mut Vm, who: &str) -> usize {
    vm.exec("systemd-inhibit --list --no-pager --mode=delay")
        .await
        .stdout
        .lines()
        .filter(|l| l.contains(who) && l.contains("shutdown"))
        .count()
}

/// `systemctl restart systemd-logind` during a shutdown's delay. The new
/// logind does not know the shutdown the old one was delaying (logind
/// keeps inhibitors across a restart, not a pending shutdown), so the
/// machine stays up: the agent must undo the shutdown (taint, record,
/// `ShutdownCancelled` naming the restart) instead of emptying a node that
/// is not going down, and hold its inhibitor from the new logind.
async fn logind_restart(vm: &mut Vm, admin: &Client, node: &str, dir: &Path, rows: &Rows) {
    let PodsInThreeGroups {
        low,
        mid,
        high,
        pdb: pdb_name,
    } = pods_in_three_groups(admin, node).await;
    let (marked, sim) = kubelet_sim(admin.clone(), node.to_string());
    // The agent's pod watch has the three pods well before the signal.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        delay_locks(vm, "nodeguard").await,
        1,
        "the agent's inhibitor before the reboot"
    );
    let t0 = Instant::now();
    vm.spawn("systemctl reboot").await;
    eventually(Duration::from_secs(10), "the low pod evicted", || {
        std::future::ready(marked.lock().unwrap().contains_key(&low))
    })
    .await;
    let preparing = vm
        .sh("busctl get-property org.freedesktop.login1 /org/freedesktop/login1 org.freedesktop.login1.Manager PreparingForShutdown")
        .await;
    assert_eq!(preparing.trim(), "b true", "logind delays the reboot");
    vm.sh("systemctl restart systemd-logind && echo 'e2e: restarted systemd-logind' > /dev/kmsg")
        .await;
    let restarted = t0.elapsed();
    let preparing = vm
        .sh("busctl get-property org.freedesktop.login1 /org/freedesktop/login1 org.freedesktop.login1.Manager PreparingForShutdown")
        .await;
    assert_eq!(
        preparing.trim(),
        "b false",
        "the restarted logind forgot the reboot it was delaying"
    );
    let nodes: Api<Node> = Api::all(admin.clone());
    eventually(
        Duration::from_secs(10),
        "the taint removed and GracefulShutdown=False (ShutdownCancelled) naming logind's restart",
        || async {
            !has_taint(&nodes.get(node).await.unwrap(), "nodeguard.io/shutdown")
                && node_conditions(admin, node, "GracefulShutdown")
                    .await
                    .iter()
                    .any(|c| {
                        c.status == "False"
                            && c.reason.as_deref() == Some("ShutdownCancelled")
                            && c.message
                                .as_deref()
                                .is_some_and(|m| m.contains("systemd-logind restarted"))
                    })
        },
    )
    .await;
    let undone = t0.elapsed();
    let deadline = Instant::now() + Duration::from_secs(10);
    // One: the old lock (which the new logind kept) released, a new one
    // taken.
    while delay_locks(vm, "nodeguard").await != 1 {
        assert!(
            Instant::now() < deadline,
            "exactly one inhibitor of the agent's within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // Past the whole plan and logind's limit: the machine is up, the
    // later groups untouched.
    tokio::time::sleep_until((t0 + Duration::from_secs(NEEDED_DELAY_SECS + 5)).into()).await;
    assert!(
        vm.exited().is_none(),
        "the machine went down after logind's restart"
    );
    let marked = marked.lock().unwrap().clone();
    for p in [&mid, &high] {
        assert!(
            !marked.contains_key(p),
            "{p} was deleted after the shutdown was undone: {marked:?}"
        );
    }
    let events = events_for(node).await;
    std::fs::write(dir.join("events-logind-restart.txt"), &events).unwrap();
    assert!(
        events
            .lines()
            .any(|l| l.contains("ShutdownCancelled") && l.contains("restarted")),
        "{events}"
    );
    sim.abort();
    delete_pdb(admin, &pdb_name).await;
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(admin.clone(), TEST_NAMESPACE);
    for p in [&mid, &high] {
        let _ = pods
            .delete(p, &kube::api::DeleteParams::default().grace_period(0))
            .await;
    }
    rows.pass(
        "logind-restart",
        format!(
            "`systemctl reboot`, the low pod evicted, then `systemctl restart systemd-logind` {} in: the new logind's PreparingForShutdown {}; the agent removed its taint and reported ShutdownCancelled {} in, held its inhibitor from the new logind; the machine still up {NEEDED_DELAY_SECS} s later, mid and critical pods untouched",
            secs(restarted),
            preparing.trim(),
            secs(undone),
        ),
    );
}

async fn poweroff(vm: &mut Vm, admin: &Client, node: &str, dir: &Path, rows: &Rows) {
    let PodsInThreeGroups {
        low,
        mid,
        high,
        pdb: pdb_name,
    } = pods_in_three_groups(admin, node).await;
    let (marked, sim) = kubelet_sim(admin.clone(), node.to_string());
    // The agent's pod watch has the three pods well before the signal.
    tokio::time::sleep(Duration::from_secs(3)).await;

    let (seen_tx, mut seen_rx) = tokio::sync::mpsc::unbounded_channel();
    let nodes: Api<Node> = Api::all(admin.clone());
    let name = node.to_string();
    let watching = tokio::spawn(async move {
        let cfg = watcher::Config::default().fields(&format!("metadata.name={name}"));
        let mut stream = watcher(nodes, cfg).applied_objects().boxed();
        while let Some(Ok(n)) = stream.next().await {
            if has_condition(&n, "GracefulShutdown", "True")
                && has_taint(&n, "nodeguard.io/shutdown")
            {
                let _ = seen_tx.send(Instant::now());
                return;
            }
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let t0 = Instant::now();
    vm.spawn("systemctl poweroff").await;
    let seen = tokio::time::timeout(Duration::from_secs(10), seen_rx.recv())
        .await
        .expect("GracefulShutdown=True and the taint within 10 s")
        .unwrap()
        - t0;
    watching.abort();
    // SIGKILL (as the OOM killer would): systemd restarts the unit and
    // hands the new process the inhibitor it kept in its descriptor store.
    vm.spawn("systemctl kill --signal=KILL nodeguard.service && echo 'e2e: SIGKILL nodeguard.service' > /dev/kmsg")
        .await;
    let (off_at, reason) = vm
        .wait_exit(Duration::from_secs(NEEDED_DELAY_SECS + 60))
        .await
        .expect("the VM powers off");
    let off = off_at - t0;
    sim.abort();
    assert_eq!(reason, "guest-shutdown");
    let marked = marked.lock().unwrap().clone();
    let at = |n: &str| {
        *marked
            .get(n)
            .unwrap_or_else(|| panic!("{n} was never terminated: {marked:?}"))
            - t0
    };
    let (t_low, t_mid, t_high) = (at(&low), at(&mid), at(&high));
    assert!(
        t_low < t_mid && t_mid < t_high,
        "groups in order: {t_low:?} {t_mid:?} {t_high:?}"
    );
    assert!(
        t_mid >= t_low + Duration::from_secs(4),
        "the PDB held the mid pod until escalation: {t_mid:?}"
    );
    // Each group within the latest end the plan gives it (10 s, then 10,
    // then 8): the agent is SIGKILLed once the taint is seen, and a slow
    // restart (6 s once, in a cold CI run) delays the groups after it, but
    // never past those ends. Measured from `systemctl poweroff`, since the
    // plan starts there (low's eviction may come late for the same reason).
    assert!(
        t_mid <= Duration::from_secs(10 + 10),
        "the mid pod went within its group's latest end (20 s): {t_mid:?}"
    );
    assert!(
        t_high <= Duration::from_secs(10 + 10 + 8),
        "the critical pod went within its group's latest end (28 s): {t_high:?}"
    );
    // logind waited for the agent: the machine went down after the last
    // group, and well before logind's own limit.
    assert!(
        off > t_high,
        "powered off ({off:?}) only after the last group ({t_high:?})"
    );
    assert!(
        off < Duration::from_secs(NEEDED_DELAY_SECS),
        "powered off after {off:?}, before InhibitDelayMaxSec"
    );
    let complete = |events: &str| {
        [
            "ShutdownStarted",
            "ShutdownInhibitorReleased",
            "Priority group 0 done",
            "Priority group 1000 done",
            "Priority group 2000000000 done",
            "ShutdownResumed",
        ]
        .iter()
        .all(|e| events.contains(e))
            && events
                .lines()
                .any(|l| l.contains("EvictionEscalated") && l.contains(&pdb_name))
    };
    eventually(
        Duration::from_secs(10),
        "the shutdown's Events on the node",
        || async { complete(&events_for(node).await) },
    )
    .await;
    let serial = std::fs::read_to_string(vm.serial.clone()).unwrap_or_default();
    std::fs::write(dir.join("events-poweroff.txt"), events_for(node).await).unwrap();
    delete_pdb(admin, &pdb_name).await;
    rows.pass(
        "poweroff",
        format!(
            "condition+taint {}; the agent SIGKILLed then, restarted by systemd with the inhibitor from its descriptor store (ShutdownResumed); evicted low {}, mid (PDB, escalated) {}, critical {}; powered off {} after `systemctl poweroff` (InhibitDelayMaxSec {NEEDED_DELAY_SECS} s){}",
            secs(seen),
            secs(t_low),
            secs(t_mid),
            secs(t_high),
            secs(off),
            if serial.contains("reboot: Power down") { "; serial: reboot: Power down" } else { "" }
        ),
    );
}

async fn reboot(env: &Env, disk: &Disk, dir: &Path, node: &str, policy: &str, rows: &Rows) {
    let (mut vm, booted, _) = boot_node(env, disk, dir, 2, node, policy).await;
    let admin = &env.admin;
    let result = std::panic::AssertUnwindSafe(async {
        eventually(Duration::from_secs(30), "GracefulShutdown=False (NodeRebooted)", || async {
            node_conditions(admin, node, "GracefulShutdown")
                .await
                .first()
                .is_some_and(|c| c.status == "False" && c.reason.as_deref() == Some("NodeRebooted"))
        })
        .await;
        let c = node_conditions(admin, node, "GracefulShutdown").await.remove(0);
        let n = Api::<Node>::all(admin.clone()).get(node).await.unwrap();
        assert!(!has_taint(&n, "nodeguard.io/shutdown"), "nodeguard removed its taint");
        let took = c.message.as_deref().unwrap_or("").split("took ").nth(1).and_then(|s| s.split(';').next()).unwrap_or("?").to_string();
        assert!(took.ends_with('s') && took != "?", "{:?}", c.message);
        eventually(Duration::from_secs(10), "a NodeRebooted Event", || async { events_for(node).await.contains("NodeRebooted") }).await;
        // The kernel monitor is not blind after the reboot: boot 1's saved
        // kmsg sequence number does not hide boot 2's records, and boot 1's
        // kernel condition was reset by the new boot.
        eventually(Duration::from_secs(30), "KernelDeadlock=False after the reboot", || condition_is(admin, node, "KernelDeadlock", "False")).await;
        vm.sh("echo '<3>INFO: task docker:4343 blocked for more than 120 seconds.' > /dev/kmsg").await;
        eventually(Duration::from_secs(10), "KernelDeadlock=True from a kernel line of the new boot", || condition_is(admin, node, "KernelDeadlock", "True")).await;
        let previous = vm.exec("journalctl -b -1 --no-pager -o short-monotonic -u nodeguard -u systemd-logind").await;
        std::fs::write(dir.join("journal-boot-1-from-boot-2.txt"), previous.stdout).unwrap();
        rows.pass("reboot", format!("boot {}; taint removed, GracefulShutdown=False (NodeRebooted), last shutdown took {took}; KernelDeadlock reset, a new /dev/kmsg line detected", secs(booted)));
    })
    .catch_unwind()
    .await;
    artifacts(Some(&mut vm), dir, node, "boot-2").await;
    vm.power_off().await;
    if let Err(p) = result {
        std::panic::resume_unwind(p);
    }
}

/// softdog's sysfs state and timeout, e.g. ["active", "10"].
async fn armed(vm: &mut Vm) -> Vec<String> {
    let out = vm
        .exec("cat /sys/class/watchdog/watchdog0/state /sys/class/watchdog/watchdog0/timeout")
        .await;
    out.stdout.split_whitespace().map(str::to_string).collect()
}

/// The node with the device watchdog: a clean stop disarms it, a frozen
/// agent resets the VM.
async fn device_watchdog_node(env: &Env, rows: &Rows) {
    let admin = env.admin.clone();
    let (node, dir, policy) = node_with_policy(
        &admin,
        "vm-watchdog",
        serde_json::json!({
            "watchdog": {"mode": "Device", "device": "/dev/watchdog", "timeoutSeconds": DEVICE_TIMEOUT_SECS, "petIntervalPercent": 33},
        }),
    )
    .await;
    let disk = env.disk_for(&node.name, &dir, None);
    let (mut vm, booted, _) = boot_node(env, &disk, &dir, 1, &node.name, &policy).await;
    let result = std::panic::AssertUnwindSafe(async {
        let deadline = Instant::now() + Duration::from_secs(30);
        while armed(&mut vm).await != ["active", &DEVICE_TIMEOUT_SECS.to_string()] {
            assert!(Instant::now() < deadline, "softdog armed with a {DEVICE_TIMEOUT_SECS} s timeout");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        // A clean stop writes the magic close: the node must not reset.
        vm.sh("systemctl stop nodeguard").await;
        assert_eq!(armed(&mut vm).await[0], "inactive", "disarmed by the magic close");
        tokio::time::sleep(Duration::from_secs(DEVICE_TIMEOUT_SECS + 5)).await;
        assert!(vm.exited().is_none(), "the VM reset after a clean stop");
        vm.sh("true").await;
        vm.sh("systemctl start nodeguard").await;
        let deadline = Instant::now() + Duration::from_secs(30);
        while armed(&mut vm).await[0] != "active" {
            assert!(Instant::now() < deadline, "re-armed after the restart");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let (pid, _, _) = unit_state(&mut vm).await;
        let t0 = Instant::now();
        vm.sh(&format!("kill -STOP {pid}")).await;
        let (at, reason) = vm
            .wait_exit(Duration::from_secs(DEVICE_TIMEOUT_SECS + 30))
            .await
            .expect("the frozen agent's watchdog resets the VM");
        let reset = at - t0;
        assert_eq!(reason, "guest-reset");
        assert!(reset <= Duration::from_secs(DEVICE_TIMEOUT_SECS + 2), "reset after {reset:?}");
        assert!(reset >= Duration::from_secs(DEVICE_TIMEOUT_SECS / 2), "reset too early: {reset:?}");
        let serial = vm.serial_log();
        assert!(serial.contains("softdog: Initiating system reboot"), "softdog's message on the console");
        rows.pass(
            "device-watchdog",
            format!(
                "boot {}; clean stop: disarmed, no reset in {} s; SIGSTOP → softdog reset after {} (timeout {DEVICE_TIMEOUT_SECS} s, pet every 3.3 s)",
                secs(booted),
                DEVICE_TIMEOUT_SECS + 5,
                secs(reset)
            ),
        );
    })
    .catch_unwind()
    .await;
    artifacts(Some(&mut vm), &dir, &node.name, "boot-1").await;
    vm.power_off().await;
    if let Err(p) = result {
        std::panic::resume_unwind(p);
    }
}
