//! The VM as a real Kubernetes node: its kubelet and containerd (both built
//! by e2e/cluster/build) register the Node as `system:node:<name>`, and
//! nodeguard is installed the way users install it, `helm install` of
//! charts/nodeguard, running as the DaemonSet's pod.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::ListParams;
use kube::{Api, Client};

use crate::qemu::{Disk, GUEST_APISERVER, Vm};
use crate::support::*;
use crate::{Env, Rows, kubework, node_dir, secs};

/// A Kubernetes node gets 2 GiB (kubelet, containerd, the agent's pod).
const KUBE_MEMORY_MIB: u32 = 2048;
/// The sandbox image e2e/vm/images packs from the upstream pause.c.
const PAUSE_IMAGE: &str = "localhost/e2e/pause:node";
const NODE_READY_TIMEOUT: Duration = Duration::from_secs(300);
const POD_READY_TIMEOUT: Duration = Duration::from_secs(240);

pub(crate) fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A script of e2e/ that prints a directory (building what is missing).
fn e2e_dir(script: &str) -> PathBuf {
    let out = Command::new(repo_root().join(script))
        .stderr(std::process::Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("{script}: {e}"));
    assert!(out.status.success(), "{script} failed");
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// `. e2e/cluster/lib.sh; FN`: where the pinned binaries are.
pub(crate) fn lib_dir(function: &str) -> PathBuf {
    let out = run(Command::new("bash").arg("-c").arg(format!(
        ". {}/e2e/cluster/lib.sh && {function}",
        repo_root().display()
    )));
    PathBuf::from(out.trim())
}

/// The static agent binary `e2e/image` put into the image of `arch`.
fn static_binary(arch: &str) -> PathBuf {
    let target = match arch {
        "arm64" => "aarch64-unknown-linux-musl",
        _ => "x86_64-unknown-linux-musl",
    };
    let p = repo_root().join(format!("target/{target}/release/nodeguard"));
    assert!(
        p.is_file(),
        "the static binary of e2e/image is missing (run e2e/image; make test does)"
    );
    p
}

/// What e2e/release/publish pushed to the test registry, as users get it:
/// the image index by tag, the chart as an OCI artifact.
pub struct Published {
    /// The registry's loopback address (`127.0.0.1:PORT`).
    pub registry: String,
    /// The tag and chart version (the crate's version).
    pub version: String,
    /// The image index's digest that e2e/image built from these sources.
    pub digest: String,
}

impl Published {
    /// The chart's `oci://` reference, as README's install line has it.
    pub fn chart(&self) -> String {
        format!("oci://{}/nodeguard/charts/nodeguard", self.registry)
    }
}

/// The release e2e/image built (target/image/image.env) and
/// e2e/release/publish pushed; fails when the build is older than the
/// sources or the registry's tag names another index.
pub fn published() -> Published {
    let BuiltImage {
        env_file,
        version,
        digest,
        ..
    } = built_image();
    // The pod must run the agent as it is now: an image older than the
    // sources would test an earlier agent and pass or fail for it.
    // (NODEGUARD_STALE_IMAGE_OK=1 runs an older one on purpose, e.g. to
    // see a scenario fail before a fix.)
    if std::env::var_os("NODEGUARD_STALE_IMAGE_OK").is_none() {
        let built = env_file.metadata().unwrap().modified().unwrap();
        if let Some((path, at)) = newest_source(&repo_root())
            && at > built
        {
            panic!(
                "the image in target/image is older than {} (changed since it was built): run e2e/image and e2e/release/publish (make test does), or set NODEGUARD_STALE_IMAGE_OK=1",
                path.display()
            );
        }
    }
    let registry = registry_addr().expect(
        "the test registry is not up: run e2e/registry/up and e2e/release/publish (make test does)",
    );
    let crane = e2e_dir("e2e/release/tools").join("crane");
    let tag = format!("{registry}/nodeguard/nodeguard:{version}");
    let in_registry = run(Command::new(&crane).args(["digest", "--insecure", &tag]));
    assert_eq!(
        in_registry.trim(),
        digest,
        "{tag} is not the image e2e/image built: run e2e/release/publish (make test does)"
    );
    Published {
        registry,
        version,
        digest,
    }
}

/// The most recently modified file the agent's image is built from
/// (`src/`, `Cargo.toml`, `Cargo.lock`, `build.rs`).
pub fn newest_source(repo: &Path) -> Option<(PathBuf, std::time::SystemTime)> {
    fn walk(dir: &Path, best: &mut Option<(PathBuf, std::time::SystemTime)>) {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, best);
            } else if let Ok(t) = e.metadata().and_then(|m| m.modified())
                && best.as_ref().is_none_or(|(_, b)| t > *b)
            {
                *best = Some((p, t));
            }
        }
    }
    let mut best = None;
    walk(&repo.join("src"), &mut best);
    for f in ["Cargo.toml", "Cargo.lock", "build.rs"] {
        let p = repo.join(f);
        if let Ok(t) = p.metadata().and_then(|m| m.modified())
            && best.as_ref().is_none_or(|(_, b)| t > *b)
        {
            best = Some((p, t));
        }
    }
    best
}

/// A client certificate for `system:node:<node>` (group system:nodes) signed
/// by the test CA: the kubelet's identity, as the Node authorizer expects.
fn kubelet_kubeconfig(node: &str, dir: &Path) -> String {
    let pki = kubeconfig_path().with_file_name("pki");
    let (key, csr, crt, ext) = (
        dir.join("kubelet.key"),
        dir.join("kubelet.csr"),
        dir.join("kubelet.crt"),
        dir.join("kubelet.ext"),
    );
    run(Command::new("openssl")
        .args(["req", "-newkey", "rsa:2048", "-nodes", "-subj"])
        .arg(format!("/O=system:nodes/CN=system:node:{node}"))
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&csr));
    std::fs::write(&ext, "extendedKeyUsage=clientAuth\n").unwrap();
    run(Command::new("openssl")
        .args(["x509", "-req", "-days", "2", "-CAcreateserial", "-in"])
        .arg(&csr)
        .arg("-CA")
        .arg(pki.join("ca.crt"))
        .arg("-CAkey")
        .arg(pki.join("ca.key"))
        .arg("-extfile")
        .arg(&ext)
        .arg("-out")
        .arg(&crt));
    use base64::Engine as _;
    let b64 =
        |p: PathBuf| base64::engine::general_purpose::STANDARD.encode(std::fs::read(p).unwrap());
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: https://{GUEST_APISERVER}\n    certificate-authority-data: {}\nusers:\n- name: kubelet\n  user:\n    client-certificate-data: {}\n    client-key-data: {}\ncontexts:\n- name: node\n  context: {{cluster: test, user: kubelet}}\ncurrent-context: node\n",
        b64(pki.join("ca.crt")),
        b64(crt),
        b64(key)
    )
}

/// The Node the kubelet registers, deleted with the scenario.
pub struct KubeNode(pub String);

impl Drop for KubeNode {
    fn drop(&mut self) {
        let _ = kubectl_status(&[
            "delete",
            "node",
            "--ignore-not-found",
            "--wait=false",
            &self.0,
        ]);
    }
}

/// The helm release, uninstalled (with its policy `default`, and its namespace
/// deleted) with the scenario.
pub(crate) struct Release {
    pub(crate) name: String,
    pub(crate) namespace: String,
    pub(crate) helm: PathBuf,
}

impl Release {
    /// `helm upgrade` of this release to the published chart, its values
    /// reused, with `args` (`--set …`, `--wait`) added; helm's output.
    pub(crate) fn upgrade(&self, published: &Published, args: &[&str]) -> String {
        run(Command::new(&self.helm)
            .arg("--kubeconfig")
            .arg(kubeconfig_path())
            .args(["upgrade", &self.name, &published.chart()])
            .args(["--version", &published.version, "--plain-http"])
            .args(["-n", &self.namespace, "--reuse-values"])
            .args(args))
    }
}

impl Drop for Release {
    fn drop(&mut self) {
        let _ = Command::new(&self.helm)
            .arg("--kubeconfig")
            .arg(kubeconfig_path())
            .args([
                "uninstall",
                &self.name,
                "-n",
                &self.namespace,
                "--wait=false",
                // The scenario is over: the pre-delete hook's Job could be
                // scheduled to one of the shared cluster's kubelet-less
                // Nodes and hold the teardown for Helm's timeout.
                // `kube-install` runs the hook.
                "--no-hooks",
            ])
            .output();
        let _ = kubectl_status(&[
            "delete",
            "namespace",
            "--ignore-not-found",
            "--wait=false",
            &self.namespace,
        ]);
    }
}

/// A disk that boots as a Kubernetes node named `node`: hostname, kubelet,
/// containerd, its identity and the CA, the pause and busybox archives, ghcr.io's
/// hosts.toml (the registry mirror), kubelet.service enabled
/// (it pulls in containerd and the image import).
fn kube_disk(env: &Env, node: &str, dir: &Path, shutdown_by: ShutdownBy) -> Disk {
    let disk = Disk::copy_of(&env.image, dir);
    if shutdown_by == ShutdownBy::Kubelet {
        // The kubelet's graceful node shutdown with nodeguard's groups (the
        // last one also gets nodeguard's margin: the same total), as a
        // KubeletConfiguration drop-in (--config-dir), the way operators
        // layer node settings.
        let [a, b, c] = kubework::KUBELET_GROUP_SECS;
        disk.mkdir("/etc/kubernetes/kubelet.conf.d");
        disk.write(
            "/etc/kubernetes/kubelet.conf.d/50-graceful-shutdown.conf",
            format!("apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\nshutdownGracePeriodByPodPriority:\n- {{priority: 0, shutdownGracePeriodSeconds: {a}}}\n- {{priority: 1000, shutdownGracePeriodSeconds: {b}}}\n- {{priority: 2000000000, shutdownGracePeriodSeconds: {c}}}\n").as_bytes(),
            0o644,
        );
        disk.mkdir("/etc/systemd/system/kubelet.service.d");
        disk.write(
            "/etc/systemd/system/kubelet.service.d/10-config-dir.conf",
            b"[Service]\nExecStart=\nExecStart=/usr/local/bin/kubelet --config=/var/lib/kubelet/config.yaml --config-dir=/etc/kubernetes/kubelet.conf.d --kubeconfig=/etc/kubernetes/kubelet.kubeconfig --node-ip=10.0.2.15 --v=1\n",
            0o644,
        );
    }
    disk.write("/etc/hostname", format!("{node}\n").as_bytes(), 0o644);
    // A node-local plugin for host.plugins (kube-trust): the image's own
    // static binary, which runs in the pod without a shell or libc.
    disk.mkdir("/usr/local/lib/nodeguard");
    disk.mkdir("/usr/local/lib/nodeguard/plugins");
    disk.write(
        kubework::PLUGIN,
        &std::fs::read(static_binary(env.image.arch)).unwrap(),
        0o755,
    );
    // An arm64 node's kubelet and images come from e2e/vm/arm64's kit.
    let arm64_kit = (env.image.arch == "arm64").then(|| e2e_dir("e2e/vm/arm64"));
    let kubelet = match &arm64_kit {
        Some(kit) => kit.join("kubelet"),
        None => lib_dir("node_bin_dir").join("kubelet"),
    };
    assert!(
        kubelet.is_file(),
        "{} is missing: run e2e/cluster/build",
        kubelet.display()
    );
    disk.write(
        "/usr/local/bin/kubelet",
        &std::fs::read(&kubelet).unwrap(),
        0o755,
    );
    write_containerd(&disk, env.image.arch);
    disk.write(
        "/etc/kubernetes/kubelet.kubeconfig",
        kubelet_kubeconfig(node, dir).as_bytes(),
        0o600,
    );
    let ca = std::fs::read(kubeconfig_path().with_file_name("pki").join("ca.crt")).unwrap();
    disk.write("/etc/kubernetes/pki/ca.crt", &ca, 0o644);
    let images = match &arm64_kit {
        Some(kit) => kit.join("images"),
        None => e2e_dir("e2e/vm/images"),
    };
    for name in ["pause", "busybox"] {
        let bytes = std::fs::read(images.join(format!("{name}.oci.tar"))).unwrap();
        disk.write(&format!("/var/lib/e2e-images/{name}.tar"), &bytes, 0o644);
    }
    // nodeguard's image comes from a registry, as on any node: ghcr.io's
    // pulls go to the test registry (plain HTTP), which holds what
    // e2e/release/publish pushed; nothing else answers for ghcr.io here, so
    // a pull that misses the mirror fails.
    disk.mkdir("/etc/containerd/certs.d/ghcr.io");
    disk.write(
        "/etc/containerd/certs.d/ghcr.io/hosts.toml",
        format!(
            "server = \"https://ghcr.io\"\n\n[host.\"http://{}\"]\n  capabilities = [\"pull\", \"resolve\"]\n",
            crate::qemu::GUEST_REGISTRY
        )
        .as_bytes(),
        0o644,
    );
    disk.symlink(
        "/etc/systemd/system/multi-user.target.wants/kubelet.service",
        "/etc/systemd/system/kubelet.service",
    );
    disk
}

/// The node's container runtime: containerd, its runc shim and ctr from
/// e2e/cluster/containerd (CONTAINERD_VERSION) in /usr/local/bin, with its
/// unit and a version 3 config: runc with systemd cgroups (Debian's runc),
/// the imported pause image, Debian's CNI plugins, registries per host in
/// certs.d. The image has no containerd of its own (bookworm's 1.6 is too
/// old for the kubelet from 1.36 on); the kubelet's unit pulls this one in.
fn write_containerd(disk: &Disk, arch: &str) {
    let dir = lib_dir(&format!("containerd_dir {arch}"));
    for name in ["containerd", "containerd-shim-runc-v2", "ctr"] {
        let bin = dir.join(name);
        assert!(
            bin.is_file(),
            "{} is missing: run e2e/cluster/containerd {arch}",
            bin.display()
        );
        disk.write(
            &format!("/usr/local/bin/{name}"),
            &std::fs::read(&bin).unwrap(),
            0o755,
        );
    }
    disk.write(
        "/etc/containerd/config.toml",
        format!(
            r#"version = 3
[plugins."io.containerd.cri.v1.images"]
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{PAUSE_IMAGE}"
  [plugins."io.containerd.cri.v1.images".registry]
    config_path = "/etc/containerd/certs.d"
[plugins."io.containerd.cri.v1.runtime"]
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        SystemdCgroup = true
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "/etc/cni/net.d"
"#
        )
        .as_bytes(),
        0o644,
    );
    // The description is the one systemd prints in "Starting
    // containerd.service - containerd container runtime..." (the
    // kube-journald scenario's restart lines). Delegate: containerd's shims
    // manage their pods' cgroups; KillMode=process: a restart of containerd
    // leaves the running containers alone.
    disk.write(
        "/etc/systemd/system/containerd.service",
        b"[Unit]\nDescription=containerd container runtime\nAfter=network.target local-fs.target\n\n[Service]\nType=notify\nExecStartPre=-/sbin/modprobe overlay\nExecStart=/usr/local/bin/containerd\nDelegate=yes\nKillMode=process\nRestart=always\nRestartSec=5\nLimitNOFILE=infinity\nTasksMax=infinity\nOOMScoreAdjust=-999\n",
        0o644,
    );
}

pub fn node_ready(n: &Node) -> bool {
    n.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

pub fn pod_ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// What the guest shows about the node's services and the agent's pod.
async fn guest_diagnostics(vm: &mut Vm) -> String {
    let out = vm
        .exec("systemctl --no-pager status kubelet containerd e2e-images 2>&1 | head -40; journalctl -b --no-pager -u kubelet | tail -40; for f in /var/log/pods/*/*/*.log; do echo \"== $f\"; tail -30 \"$f\"; done")
        .await;
    out.stdout
}

/// The real node's scenarios, in the order they run on its boots.
pub const STEPS: [&str; 13] = [
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
];

/// Boot → Node Ready → helm install → the DaemonSet pod Running and Ready →
/// the agent's NodeGuardPolicyInvalid=False → a /dev/kmsg line becomes the
/// default policy's KernelDeadlock condition; then the `steps` wanted, from
/// the pod, on this boot and (kube-reboot) the next.
pub async fn daemonset_node(env: &Env, rows: &Rows, steps: &[&'static str]) {
    let admin = env.admin.clone();
    let node = KubeNode(unique_name("vm-kube"));
    let dir = node_dir(&node.0);
    let published = published();
    let disk = kube_disk(env, &node.0, &dir, ShutdownBy::Nodeguard);
    if steps.contains(&"kube-npd") || steps.contains(&"kube-npd-plugins") {
        // node-problem-detector's binary (static, CGO off), as bench/npd
        // builds it from its Go module.
        let out = std::process::Command::new(repo_root().join("bench/npd-build"))
            .output()
            .expect("run bench/npd-build");
        assert!(out.status.success(), "bench/npd-build: {out:?}");
        let npd = PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
            .join("nodeproblemdetector");
        disk.mkdir("/usr/local/lib/npd");
        disk.write(kubework::NPD_BINARY, &std::fs::read(&npd).unwrap(), 0o755);
    }
    let release = Release {
        // Not "nodeguard": Env applies that RBAC (manifests/nodeguard.yaml) for the host-service nodes.
        name: "nodeguard-kube".to_string(),
        namespace: unique_name("nodeguard-vm"),
        helm: lib_dir("bin_dir").join("helm"),
    };
    let work = kubework::Namespace::create(&admin, "vm-work").await;
    let mut vm = Vm::boot_with_memory(
        &env.image,
        &disk,
        env.apiserver_port,
        &dir,
        1,
        KUBE_MEMORY_MIB,
    )
    .await;
    let mut boot = 1;
    let result = std::panic::AssertUnwindSafe(async {
        let wants = |s: &str| steps.contains(&s);
        let mut earlier = if wants("kube-install") {
            Some(readme_install(&mut vm, &admin, &node.0, &dir, &published, rows).await)
        } else {
            None
        };
        if wants("kube-upgrade") {
            let up =
                crate::upgrade::from_previous(&mut vm, &admin, &node.0, &dir, &published, rows)
                    .await;
            earlier.get_or_insert(up);
        }
        daemonset(
            &mut vm,
            &admin,
            &node.0,
            &dir,
            &release,
            &published,
            env.image.arch,
            earlier,
            rows,
        )
        .await;
        let agent_ns = release.namespace.as_str();
        if wants("kube-probe") {
            kubework::kubelet_probe(&mut vm, &admin, &node.0, rows).await;
        }
        if wants("kube-journald") {
            kubework::journald_restarts(&mut vm, &admin, &node.0, rows).await;
        }
        if wants("kube-node-restriction") {
            kubework::node_restriction(&mut vm, &admin, &node.0, agent_ns, &work.0, rows).await;
        }
        if wants("kube-readiness-gate") {
            kubework::readiness_gate(&mut vm, &admin, &node.0, &work.0, rows).await;
        }
        if wants("kube-trust") {
            kubework::trust(&admin, &node.0, rows).await;
        }
        if wants("kube-alerts") {
            kubework::alerts(&mut vm, &admin, &node.0, &dir, agent_ns, rows).await;
        }
        if wants("kube-npd") {
            kubework::npd_oracle(&mut vm, &admin, &dir, rows).await;
        }
        if wants("kube-npd-plugins") {
            kubework::npd_plugins(&mut vm, &admin, &node.0, &dir, &release, &published, rows)
                .await;
        }
        if wants("kube-reboot") {
            let kernel = vm
                .exec("journalctl -b --no-pager -o short-monotonic -u kubelet -u containerd | tail -200")
                .await;
            let _ = std::fs::write(dir.join("journal-kube-boot-1.txt"), kernel.stdout);
            let shutdown = kubework::graceful_reboot(&mut vm, &admin, &node.0, &dir, &work.0, agent_ns).await;
            boot = 2;
            vm = Vm::boot_with_memory(
                &env.image,
                &disk,
                env.apiserver_port,
                &dir,
                2,
                KUBE_MEMORY_MIB,
            )
            .await;
            kubework::after_reboot(&mut vm, &admin, &node.0, &work.0, agent_ns, shutdown, rows)
                .await;
            kubework::record_after(kubework::phases(&admin, &work.0).await);
            kubework::save_view(&dir, &node.0, "after-reboot");
        }
        if wants("kube-device-watchdog") {
            kubework::device_watchdog(&mut vm, &admin, &node.0, agent_ns, rows).await;
        }
    })
    .catch_unwind()
    .await;
    if result.is_err() && vm.exited().is_none() {
        let d = guest_diagnostics(&mut vm).await;
        let _ = std::fs::write(dir.join("guest-diagnostics.txt"), &d);
        eprintln!("vm: {}: guest diagnostics:\n{d}", node.0);
    }
    let tag = format!("boot-{boot}");
    crate::artifacts(Some(&mut vm), &dir, &node.0, &tag).await;
    let _ = std::fs::write(
        dir.join(format!("pods-{tag}.txt")),
        kubectl_status(&[
            "get",
            "pods",
            "-A",
            "-o",
            "wide",
            "--field-selector",
            &format!("spec.nodeName={}", node.0),
        ])
        .unwrap_or_else(|e| e),
    );
    if vm.exited().is_none() {
        let j = vm
            .exec("journalctl -b --no-pager -o short-monotonic -u kubelet -u containerd -u e2e-images; cat /var/log/pods/*/nodeguard/*.log")
            .await;
        let _ = std::fs::write(dir.join(format!("journal-kube-{tag}.txt")), j.stdout);
    }
    vm.power_off().await;
    drop(work);
    drop(release);
    if let Err(p) = result {
        std::panic::resume_unwind(p);
    }
}

/// kube-gns: a second real node with the kubelet's graceful node shutdown
/// and nodeguard's off (the chart's pod still runs its monitors and
/// probes), the same workloads, `systemctl reboot`, and boot 2.
pub async fn gns_node(env: &Env, rows: &Rows) {
    let admin = env.admin.clone();
    let node = KubeNode(unique_name("vm-gns"));
    let dir = node_dir(&node.0);
    let published = published();
    let disk = kube_disk(env, &node.0, &dir, ShutdownBy::Kubelet);
    let release = Release {
        name: "nodeguard-gns".to_string(),
        namespace: unique_name("nodeguard-vm"),
        helm: lib_dir("bin_dir").join("helm"),
    };
    let work = kubework::Namespace::create(&admin, "vm-work").await;
    let mut vm = Vm::boot_with_memory(
        &env.image,
        &disk,
        env.apiserver_port,
        &dir,
        1,
        KUBE_MEMORY_MIB,
    )
    .await;
    let mut boot = 1;
    let result = std::panic::AssertUnwindSafe(async {
        install(
            &mut vm,
            &admin,
            &node.0,
            &dir,
            &release,
            &published,
            ShutdownBy::Kubelet,
            None,
        )
        .await;
        let observed = kubework::kubelet_gns(&mut vm, &admin, &node.0, &dir, &work.0).await;
        boot = 2;
        vm = Vm::boot_with_memory(
            &env.image,
            &disk,
            env.apiserver_port,
            &dir,
            2,
            KUBE_MEMORY_MIB,
        )
        .await;
        vm.wait_guest_agent(crate::BOOT_TIMEOUT).await;
        let nodes: Api<Node> = Api::all(admin.clone());
        eventually(NODE_READY_TIMEOUT, "the Node Ready on boot 2", || async {
            nodes.get(&node.0).await.is_ok_and(|n| node_ready(&n))
        })
        .await;
        // Give the kubelet time to sync the pods it finds after the reboot.
        let pods: Api<Pod> = Api::namespaced(admin.clone(), &release.namespace);
        eventually(
            POD_READY_TIMEOUT,
            "the agent's pod Ready on boot 2",
            || async {
                pods.list(&ListParams::default())
                    .await
                    .is_ok_and(|l| l.items.iter().any(pod_ready))
            },
        )
        .await;
        // The kubelet's report of the last group's end can be lost at power
        // off; its own journal of that boot must then show it stopped the pod.
        if !observed.exit_reported(2) {
            let j = vm
                .exec("journalctl -b -1 --no-pager -u kubelet | grep 'Shutdown manager finished killing pod'")
                .await;
            assert!(
                j.stdout.contains(&format!("pod=\"{}/critical\"", work.0)),
                "the kubelet did not report critical's end, nor log that it stopped it:\n{}",
                j.stdout
            );
        }
        let detail = kubework::gns_after(&admin, &work.0, observed).await;
        rows.pass("kube-gns", detail);
    })
    .catch_unwind()
    .await;
    if result.is_err() && vm.exited().is_none() {
        let d = guest_diagnostics(&mut vm).await;
        let _ = std::fs::write(dir.join("guest-diagnostics.txt"), &d);
        eprintln!("vm: {}: guest diagnostics:\n{d}", node.0);
    }
    let tag = format!("boot-{boot}");
    crate::artifacts(Some(&mut vm), &dir, &node.0, &tag).await;
    if vm.exited().is_none() {
        let j = vm
            .exec("journalctl -b -1 --no-pager -o short-monotonic -u kubelet -u systemd-logind | tail -300")
            .await;
        let _ = std::fs::write(dir.join("journal-kubelet-shutdown.txt"), j.stdout);
        // Every unit's end of boot 1 (containerd's StopContainer, the CNI
        // teardown, each unit's CPU): where a slow pod stop went.
        let j = vm
            .exec("journalctl -b -1 --no-pager -o short-monotonic | tail -3000")
            .await;
        let _ = std::fs::write(dir.join("journal-shutdown-boot-1.txt"), j.stdout);
    }
    vm.power_off().await;
    drop(work);
    drop(release);
    if let Err(p) = result {
        std::panic::resume_unwind(p);
    }
}

use futures::FutureExt as _;

/// How long the node and the install took (since qemu started / helm install).
struct Installed {
    booted: Duration,
    registered: Duration,
    ready: Duration,
    running: Duration,
    pod_ready: Duration,
    policy_written: Duration,
    /// How the image came: its digest and the kubelet's pull time.
    pulled: String,
}

/// Whose graceful shutdown the node runs.
#[derive(Clone, Copy, PartialEq)]
enum ShutdownBy {
    /// nodeguard's (the scenarios' three groups).
    Nodeguard,
    /// The kubelet's (kube-gns): the policy has no shutdown section.
    Kubelet,
}

/// When the node came up, since qemu started.
#[derive(Clone, Copy)]
pub(crate) struct NodeUp {
    booted: Duration,
    registered: Duration,
    ready: Duration,
}

/// Boot → the guest agent answers → the kubelet registers the Node → Ready
/// with the not-ready taint gone. Returns at once (same figures) if it is.
pub(crate) async fn node_up(vm: &mut Vm, admin: &Client, node: &str) -> NodeUp {
    let booted = vm.wait_guest_agent(crate::BOOT_TIMEOUT).await;
    let nodes: Api<Node> = Api::all(admin.clone());
    let mut registered = None;
    let deadline = Instant::now() + NODE_READY_TIMEOUT;
    let ready = loop {
        if let Some(n) = nodes.get_opt(node).await.unwrap() {
            registered.get_or_insert_with(|| vm.started.elapsed());
            if node_ready(&n) && !has_taint(&n, "node.kubernetes.io/not-ready") {
                break vm.started.elapsed();
            }
        }
        assert!(
            Instant::now() < deadline,
            "Node {node} not Ready (and untainted) {NODE_READY_TIMEOUT:?} after boot (registered: {registered:?})"
        );
        assert!(vm.exited().is_none(), "the VM stopped");
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let registered = registered.unwrap();
    eprintln!(
        "vm: {node}: guest agent {}, Node registered {}, Ready {}",
        secs(booted),
        secs(registered),
        secs(ready)
    );
    NodeUp {
        booted,
        registered,
        ready,
    }
}

/// Boot → Node Ready → `helm install` of the chart with the shipped
/// default policy (scoped to this node) → the DaemonSet pod Running and
/// Ready, its policy in force and its kubelet probe passing.
#[allow(clippy::too_many_arguments)]
async fn install(
    vm: &mut Vm,
    admin: &Client,
    node: &str,
    dir: &Path,
    release: &Release,
    published: &Published,
    shutdown_by: ShutdownBy,
    earlier: Option<NodeUp>,
) -> Installed {
    // After kube-install the node is up, and the image on it.
    let image_present = earlier.is_some();
    let NodeUp {
        booted,
        registered,
        ready,
    } = match earlier {
        Some(up) => up,
        None => node_up(vm, admin, node).await,
    };

    // helm install as users do, scoped to this Node so the shared cluster's
    // other (kubelet-less) Nodes get no pods and no policy.
    let default_policy = shipped_default_policy();
    let mut spec = default_policy["spec"].clone();
    spec["nodeSelector"] = serde_json::json!({"matchLabels": {"kubernetes.io/hostname": node}});
    // The scenarios' shutdown: three priority groups (the shipped policy has
    // two), and the device watchdog (off in the shipped policy).
    match shutdown_by {
        ShutdownBy::Nodeguard => {
            spec["shutdown"] = kubework::shutdown_spec();
            spec["watchdog"] = kubework::watchdog_spec();
        }
        ShutdownBy::Kubelet => {
            spec.as_object_mut().unwrap().remove("shutdown");
        }
    }
    let values = serde_json::json!({
        "apiServer": {"host": GUEST_APISERVER.split(':').next().unwrap(), "port": 6443},
        "nodeSelector": {"kubernetes.io/hostname": node},
        "logFormat": "text",
        "logLevel": "info,nodeguard=debug",
        "host": {
            "kmsg": {"enabled": true},
            "journal": {"enabled": true},
            "dbus": {"enabled": true},
            "logindDropIn": {"enabled": true},
            "watchdog": {"enabled": shutdown_by == ShutdownBy::Nodeguard},
            "plugins": {"enabled": true},
        },
        // The scenarios' wider groups need more than the chart's 32 s.
        "trust": {"maxInhibitDelaySeconds": kubework::KUBE_NEEDED_DELAY_SECS},
        "terminationGracePeriodSeconds": kubework::KUBE_NEEDED_DELAY_SECS + 15,
        "defaultPolicy": {"enabled": true, "spec": spec},
    });
    let values_file = dir.join("values.json");
    std::fs::write(&values_file, serde_json::to_string_pretty(&values).unwrap()).unwrap();
    labelled_namespace(&release.namespace);
    let t_install = Instant::now();
    // The chart from the registry, as README's install line has it; its
    // image is the chart's own reference (ghcr.io/nodeguard/nodeguard:<appVersion>).
    run(Command::new(&release.helm)
        .arg("--kubeconfig")
        .arg(kubeconfig_path())
        .args(["install", &release.name, &published.chart()])
        .args(["--version", &published.version, "--plain-http"])
        .args(["-n", &release.namespace, "-f"])
        .arg(&values_file));
    let (pod, running, pod_ready_at) = running_and_ready(
        admin,
        &release.namespace,
        &ListParams::default(),
        t_install,
        "the DaemonSet pod",
    )
    .await;
    assert_eq!(
        pod.spec.as_ref().and_then(|s| s.node_name.as_deref()),
        Some(node),
        "the DaemonSet pod runs on the VM's Node"
    );
    let pod_name = pod.metadata.name.unwrap();
    let pulled = pulled_from_registry(
        admin,
        &release.namespace,
        &pod_name,
        published,
        image_present,
    )
    .await;
    eprintln!(
        "vm: {node}: pod {pod_name} Running {} and Ready {} after helm install",
        secs(running),
        secs(pod_ready_at)
    );
    wait_condition(
        admin,
        node,
        "NodeGuardPolicyInvalid",
        "False",
        Duration::from_secs(60),
        "NodeGuardPolicyInvalid=False written by the agent in the pod",
    )
    .await;
    let policy_written = t_install.elapsed();
    // The default policy's kubelet probe targets 127.0.0.1:10248: it passes
    // only from the node's network (the chart's hostNetwork).
    wait_condition(
        admin,
        node,
        "KubeletUnhealthy",
        "False",
        Duration::from_secs(60),
        "KubeletUnhealthy=False (the kubelet's healthz probed from the pod)",
    )
    .await;

    Installed {
        booted,
        registered,
        ready,
        running,
        pod_ready: pod_ready_at,
        policy_written,
        pulled,
    }
}

/// The pod's containers run the index e2e/release/publish pushed, pulled by
/// the node's containerd from the registry (not imported): every
/// container's imageID is the chart's reference at that digest, and the
/// kubelet's `Pulled` Event says how long the pull took.
async fn pulled_from_registry(
    admin: &Client,
    namespace: &str,
    pod_name: &str,
    published: &Published,
    image_present: bool,
) -> String {
    let pods: Api<Pod> = Api::namespaced(admin.clone(), namespace);
    let pod = pods.get(pod_name).await.unwrap();
    let statuses = pod
        .status
        .and_then(|s| s.container_statuses)
        .unwrap_or_default();
    assert!(
        !statuses.is_empty(),
        "pod {pod_name} has no container statuses"
    );
    let want = format!("ghcr.io/nodeguard/nodeguard@{}", published.digest);
    for c in &statuses {
        assert_eq!(
            c.image_id, want,
            "container {} runs {} ({}), not the published index",
            c.name, c.image, c.image_id
        );
    }
    if image_present {
        return format!(
            "the published index ({}), already on the node from an earlier step's pull; chart from oci://",
            &published.digest[..19]
        );
    }
    let events: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(admin.clone(), namespace);
    let pulled = events
        .list(
            &ListParams::default().fields(&format!("involvedObject.name={pod_name},reason=Pulled")),
        )
        .await
        .unwrap();
    let message = pulled
        .items
        .iter()
        .filter_map(|e| e.message.clone())
        .find(|m| m.starts_with("Successfully pulled image"))
        .unwrap_or_else(|| {
            panic!(
                "no 'Successfully pulled image' Event for {pod_name}: the image was not pulled from the registry ({:?})",
                pulled.items.iter().map(|e| e.message.clone()).collect::<Vec<_>>()
            )
        });
    // "Successfully pulled image "X" in 1.905s (1.905s including waiting). Image size: N bytes."
    let took = message
        .split(" in ")
        .nth(1)
        .and_then(|t| t.split_whitespace().next())
        .unwrap_or("?");
    format!(
        "image pulled by tag from the registry in {took} ({}), chart from oci://",
        &published.digest[..19]
    )
}

/// The install, then a kernel problem line from /dev/kmsg becomes the
/// default policy's KernelDeadlock condition, read in the pod.
#[allow(clippy::too_many_arguments)]
async fn daemonset(
    vm: &mut Vm,
    admin: &Client,
    node: &str,
    dir: &Path,
    release: &Release,
    published: &Published,
    arch: &str,
    earlier: Option<NodeUp>,
    rows: &Rows,
) {
    // The same install and kmsg check on an arm64 node is its own row.
    let row = if arch == "arm64" {
        "kube-arm64"
    } else {
        "daemonset"
    };
    let Installed {
        booted,
        registered,
        ready,
        running,
        pod_ready: pod_ready_at,
        policy_written,
        pulled,
    } = install(
        vm,
        admin,
        node,
        dir,
        release,
        published,
        ShutdownBy::Nodeguard,
        earlier,
    )
    .await;
    // The kubelet says which architecture the node is (and so which of the
    // index's images containerd pulled).
    let reported = Api::<Node>::all(admin.clone())
        .get(node)
        .await
        .unwrap()
        .status
        .and_then(|s| s.node_info)
        .map(|i| i.architecture)
        .unwrap_or_default();
    assert_eq!(reported, arch, "the Node's status.nodeInfo.architecture");
    // A kernel problem, from the pod: the default policy's kernel monitor.
    wait_condition(
        admin,
        node,
        "KernelDeadlock",
        "False",
        Duration::from_secs(60),
        "KernelDeadlock=False (the kernel monitor started in the pod)",
    )
    .await;
    let t0 = Instant::now();
    vm.sh("echo '<3>INFO: task docker:4242 blocked for more than 120 seconds.' > /dev/kmsg")
        .await;
    eventually(
        Duration::from_secs(20),
        "KernelDeadlock=True from the pod",
        || condition_is(admin, node, "KernelDeadlock", "True"),
    )
    .await;
    let kmsg = t0.elapsed();
    let c = node_conditions(admin, node, "KernelDeadlock")
        .await
        .remove(0);
    assert_eq!(c.reason.as_deref(), Some("DockerHung"));
    let logs = vm.exec("cat /var/log/pods/*/nodeguard/*.log").await.stdout;
    std::fs::write(dir.join("agent-pod.log"), &logs).unwrap();
    // Every monitor of the default policy reads its source from the pod.
    let events = kubectl(&["events", "-A", "--for", &format!("node/{node}")]);
    assert!(
        !events.contains("MonitorSourceUnavailable"),
        "a monitor cannot read its source from the pod:\n{events}"
    );
    std::fs::write(
        dir.join("describe-pod.txt"),
        kubectl_status(&["describe", "pods", "-n", &release.namespace]).unwrap_or_else(|e| e),
    )
    .unwrap();
    rows.pass(
        row,
        format!(
            "boot: guest agent {}, Node registered {}, Ready {}; helm install → {pulled}; pod Running {}, Ready {}, NodeGuardPolicyInvalid=False {}, KubeletUnhealthy=False; /dev/kmsg line → KernelDeadlock=True (DockerHung) from the pod {}",
            secs(booted),
            secs(registered),
            secs(ready),
            secs(running),
            secs(pod_ready_at),
            secs(policy_written),
            secs(kmsg)
        ),
    );
}

/// The chart's shipped default policy (YAML, converted by kubectl).
fn shipped_default_policy() -> serde_json::Value {
    let out = kubectl(&[
        "create",
        "--dry-run=client",
        "-o",
        "json",
        "-f",
        repo_root()
            .join("charts/nodeguard/files/default-policy.yaml")
            .to_str()
            .unwrap(),
    ]);
    serde_json::from_str(&out).unwrap()
}

/// The Pod Security label README has users put on the namespace before
/// `helm install` (the chart stops the install without it).
const PRIVILEGED: &str = "pod-security.kubernetes.io/enforce=privileged";

/// `kubectl create namespace NS` then `kubectl label namespace NS …`, as
/// README "Installing it" has it.
pub(crate) fn labelled_namespace(ns: &str) {
    kubectl(&["create", "namespace", ns]);
    kubectl(&["label", "namespace", ns, PRIVILEGED]);
}

/// README "Installing it" as printed: the namespace created and labelled,
/// then `helm install` with README's one value, `defaultPolicy.enabled=true`
/// (the chart from this test bed's registry, so over plain HTTP; a release
/// and namespace name of its own, since the host-mode scenarios' RBAC holds
/// `nodeguard` in nodeguard-system). The shipped default policy is then in
/// force from the pod: valid, every condition it declares has a verdict
/// read from its source (none `MonitorSourceUnavailable`), logind's delay
/// raised by the drop-in and the delay inhibitor held. Then `helm
/// uninstall`, and the pod is gone before the scenarios' own install.
async fn readme_install(
    vm: &mut Vm,
    admin: &Client,
    node: &str,
    dir: &Path,
    published: &Published,
    rows: &Rows,
) -> NodeUp {
    let up = node_up(vm, admin, node).await;
    // No service proxy runs on this node: kube-proxy's rule for the
    // in-cluster address is added by hand, so the pod uses the in-cluster
    // defaults the kubelet injects, as on any cluster (README's install
    // sets no apiServer.host).
    in_cluster_route(vm).await;
    let release = Release {
        name: "nodeguard-readme".to_string(),
        namespace: unique_name("nodeguard-system"),
        helm: lib_dir("bin_dir").join("helm"),
    };
    labelled_namespace(&release.namespace);
    let t_install = Instant::now();
    let notes = run(Command::new(&release.helm)
        .arg("--kubeconfig")
        .arg(kubeconfig_path())
        .args(["install", &release.name, &published.chart()])
        .args(["--version", &published.version, "--plain-http"])
        .args(["-n", &release.namespace])
        .args(["--set", "defaultPolicy.enabled=true"]));
    std::fs::write(dir.join("readme-install-notes.txt"), &notes).unwrap();
    for on in ["kmsg", "journal", "dbus", "logindDropIn"] {
        assert!(
            notes.contains(&format!("host.{on}: on  (auto: ")),
            "NOTES say host.{on} is on for the default policy:\n{notes}"
        );
    }
    assert!(notes.contains("host.watchdog: off (auto: "), "{notes}");

    // The pod on this node (the DaemonSet also makes pods for the shared
    // cluster's kubelet-less Nodes; they stay Pending).
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &release.namespace);
    let on_node = ListParams::default().fields(&format!("spec.nodeName={node}"));
    let (pod, _, pod_ready_at) = running_and_ready(
        admin,
        &release.namespace,
        &on_node,
        t_install,
        &format!("README's install: the pod on {node}"),
    )
    .await;
    let pod_name = pod.metadata.name.unwrap();
    let pulled = pulled_from_registry(admin, &release.namespace, &pod_name, published, false).await;

    wait_condition(
        admin,
        node,
        "NodeGuardPolicyInvalid",
        "False",
        Duration::from_secs(60),
        "NodeGuardPolicyInvalid=False (README's install)",
    )
    .await;
    // Every condition the shipped default policy declares gets a verdict
    // from its own source: the kernel log, the journal, the probes.
    let policy = shipped_default_policy();
    let mut declared: Vec<String> = Vec::new();
    for m in policy["spec"]["monitors"].as_array().unwrap() {
        for c in m["conditions"].as_array().unwrap() {
            declared.push(c["type"].as_str().unwrap().to_string());
        }
    }
    for p in policy["spec"]["probes"].as_array().unwrap() {
        declared.push(p["conditionType"].as_str().unwrap().to_string());
    }
    declared.push("GracefulShutdownUnavailable".to_string());
    let mut verdicts = Vec::new();
    for t in &declared {
        let deadline = Instant::now() + Duration::from_secs(90);
        let c = loop {
            let c = node_conditions(admin, node, t).await;
            if let Some(c) = c
                .into_iter()
                .find(|c| c.status == "True" || c.status == "False")
            {
                break c;
            }
            assert!(
                Instant::now() < deadline,
                "{t} has no verdict (True or False) 90 s after README's install"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        };
        assert_ne!(
            c.reason.as_deref(),
            Some("MonitorSourceUnavailable"),
            "{t}: a monitor cannot read its source from the pod: {c:?}"
        );
        verdicts.push(format!("{t}={}", c.status));
    }
    assert!(condition_is(admin, node, "GracefulShutdownUnavailable", "False").await);
    let events = kubectl(&["events", "-A", "--for", &format!("node/{node}")]);
    assert!(
        !events.contains("MonitorSourceUnavailable"),
        "a monitor cannot read its source from the pod:\n{events}"
    );
    // Graceful shutdown armed: the delay lock held, logind's limit raised
    // from Debian's 5 s to the default policy's 30 s + 2 s margin.
    let logind = kubework::inhibitor_held(vm, "nodeguard").await;
    let secs_allowed: u64 = logind.trim_end_matches(" s").parse().unwrap();
    assert!(
        secs_allowed >= 32,
        "logind allows {logind}; the default policy needs 32 s (its drop-in was not written)"
    );
    let dropin = vm.sh("cat /etc/systemd/logind.conf.d/*nodeguard* 2>/dev/null || ls -la /etc/systemd/logind.conf.d").await;
    std::fs::write(dir.join("readme-install-dropin.txt"), &dropin).unwrap();

    // An install made before the chart checked Pod Security, in a
    // namespace without the label: its upgrade goes on, since the namespace
    // evidently admits the pod (the DaemonSet has pods from a template
    // that needed privileged).
    kubectl(&[
        "label",
        "namespace",
        &release.namespace,
        "pod-security.kubernetes.io/enforce-",
    ]);
    // The upgrade also keeps the uninstall hook's pod on this node: the
    // shared cluster's other Nodes have no kubelet, and a Job scheduled to
    // one would never run (on a real cluster every node has one).
    kubectl(&[
        "label",
        "node",
        node,
        "nodeguard-test/kubelet=true",
        "--overwrite",
    ]);
    release.upgrade(
        published,
        &[
            "--set-string",
            "uninstall.nodeSelector.nodeguard-test/kubelet=true",
        ],
    );

    // What the agent put on the node, before `helm uninstall`.
    let before = Api::<Node>::all(admin.clone()).get(node).await.unwrap();
    let owned_before = nodeguard::report::kube::owned_condition_types(&before).len();
    assert!(
        owned_before >= declared.len(),
        "{owned_before} conditions owned before uninstall"
    );
    // Out again (README "What `helm uninstall` removes"), before the
    // scenarios' own release (same host port): the pre-delete hook asks the
    // agent to retire first.
    let t_uninstall = Instant::now();
    let uninstalled = uninstall_with_hook(&release, &pods, "README install's pods gone").await;
    let uninstall_took = t_uninstall.elapsed();
    std::fs::write(dir.join("readme-uninstall.txt"), &uninstalled).unwrap();
    let after = Api::<Node>::all(admin.clone()).get(node).await.unwrap();
    let owned_after: Vec<String> = nodeguard::report::kube::owned_condition_types(&after)
        .into_iter()
        .collect();
    assert!(
        owned_after.is_empty(),
        "conditions left after helm uninstall: {owned_after:?}"
    );
    assert!(
        !after
            .metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key("nodeguard.io/effective-policies")),
        "the effective-policies annotation is left after helm uninstall"
    );
    let dropins = vm
        .sh("ls /etc/systemd/logind.conf.d/ 2>/dev/null; true")
        .await;
    assert!(
        !dropins.contains("nodeguard"),
        "the drop-in is left: {dropins}"
    );
    let delay = vm
        .sh("busctl get-property org.freedesktop.login1 /org/freedesktop/login1 org.freedesktop.login1.Manager InhibitDelayMaxUSec")
        .await;
    assert_eq!(
        delay.trim(),
        "t 5000000",
        "logind's delay is back to Debian's 5 s"
    );
    let locks = vm
        .exec("systemd-inhibit --list --no-pager --mode=delay")
        .await
        .stdout;
    assert!(
        !locks.contains("nodeguard"),
        "a delay lock is left:\n{locks}"
    );
    let state_left = vm
        .sh("find /var/lib/nodeguard -type f 2>/dev/null | wc -l")
        .await;
    assert_eq!(
        state_left.trim(),
        "0",
        "state files left in /var/lib/nodeguard"
    );
    let event = kubectl(&["events", "-A", "--for", &format!("node/{node}")]);
    assert!(
        event.contains("NodeguardRetired"),
        "no NodeguardRetired Event:\n{event}"
    );
    let crd = kubectl(&["get", "crd", "nodeguardpolicies.nodeguard.io", "-o", "name"]);
    assert!(
        crd.contains("nodeguardpolicies.nodeguard.io"),
        "the CRD stays"
    );
    drop(release);
    rows.pass(
        "kube-install",
        format!(
            "README's install (namespace labelled privileged, `helm install … --set defaultPolicy.enabled=true`, nothing else; in-cluster API address): NOTES list kmsg, journal, dbus, logindDropIn on (auto), watchdog off; {pulled}; pod Ready {} after helm install; NodeGuardPolicyInvalid=False, every declared condition has a verdict ({}), none MonitorSourceUnavailable; delay inhibitor held, logind allows {logind}; `helm upgrade` with the label removed goes on (the DaemonSet has pods from a template that needed privileged); `helm uninstall --wait` took {} (its pre-delete hook included): none of the {owned_before} conditions nodeguard owned is left, nor its annotation, drop-in, delay lock or state files, logind's delay is back to 5 s, a NodeguardRetired Event says so, the CRD stays",
            secs(pod_ready_at),
            verdicts.join(", "),
            secs(uninstall_took)
        ),
    );
    up
}

/// `helm uninstall --wait` with the chart's pre-delete hook (the agents
/// retire), then waits until `pods` (the release's namespace) has none;
/// helm's output.
pub(crate) async fn uninstall_with_hook(release: &Release, pods: &Api<Pod>, what: &str) -> String {
    let out = run(Command::new(&release.helm)
        .arg("--kubeconfig")
        .arg(kubeconfig_path())
        .args([
            "uninstall",
            &release.name,
            "-n",
            &release.namespace,
            "--wait",
        ]));
    eventually(Duration::from_secs(90), what, || async {
        pods.list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
    })
    .await;
    out
}

/// The rules kube-proxy would make for the in-cluster API address (the
/// `kubernetes` Service, 10.0.0.1:443) on a node that runs none: DNAT to
/// the API server's address on the VM's network, for the node's own
/// connections (OUTPUT, the agent's host-network pod) and for pods on the
/// pod network (PREROUTING, the uninstall hook's Job). The VM's network has
/// no default route, so the service range gets one. Idempotent.
pub(crate) async fn in_cluster_route(vm: &mut Vm) {
    vm.sh(&format!(
        "ip route replace 10.0.0.0/24 via 10.0.2.2 && for chain in OUTPUT PREROUTING; do rule=\"-d 10.0.0.1/32 -p tcp --dport 443 -j DNAT --to-destination {GUEST_APISERVER}\"; iptables -t nat -C $chain $rule 2>/dev/null || iptables -t nat -A $chain $rule; done"
    ))
    .await;
}

/// Polls `ns` (pods matching `list`) until one is Running and Ready, at most
/// POD_READY_TIMEOUT: that pod, when a pod was first Running and when it
/// was Ready (both since `t_install`). On time-out, panics naming `what`
/// with `kubectl describe pods`.
pub(crate) async fn running_and_ready(
    admin: &Client,
    ns: &str,
    list: &ListParams,
    t_install: Instant,
    what: &str,
) -> (Pod, Duration, Duration) {
    let pods: Api<Pod> = Api::namespaced(admin.clone(), ns);
    let deadline = Instant::now() + POD_READY_TIMEOUT;
    let mut running = None;
    loop {
        let items = pods.list(list).await.unwrap().items;
        let is_running =
            |p: &Pod| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
        if items.iter().any(is_running) {
            running.get_or_insert_with(|| t_install.elapsed());
        }
        if let Some(p) = items.into_iter().find(|p| is_running(p) && pod_ready(p)) {
            let ready = t_install.elapsed();
            return (p, running.unwrap_or(ready), ready);
        }
        if Instant::now() > deadline {
            let describe = kubectl_status(&["describe", "pods", "-n", ns]).unwrap_or_else(|e| e);
            panic!(
                "{what} was not Running and Ready {POD_READY_TIMEOUT:?} after helm install:\n{describe}"
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
