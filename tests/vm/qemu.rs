//! The node VM: a per-session copy of the cached Debian image (files written
//! into it with debugfs, no loop mount), qemu under TCG with user networking
//! (`restrict=on`, guest forwards to the host's loopback API server and, when
//! it is up, the test registry), the
//! QEMU Machine Protocol for power events and the qemu guest agent as the
//! command channel into the guest.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

/// Where the guest reaches the API server (qemu's guest forward). The test
/// cluster's serving certificate names this address.
pub const GUEST_APISERVER: &str = "10.0.2.100:6443";

/// Where the guest reaches the test registry (e2e/registry/up), forwarded
/// to its loopback address; the node's containerd uses it as ghcr.io's
/// mirror (hosts.toml), so the chart's own image reference is pulled.
pub const GUEST_REGISTRY: &str = "10.0.2.101:5000";

/// The cached image from `e2e/vm/build`: disk, kernel, initramfs.
pub struct Image {
    pub dir: PathBuf,
    /// `amd64` (qemu-system-x86_64) or `arm64` (qemu-system-aarch64, `virt`).
    pub arch: &'static str,
}

impl Image {
    /// Builds the image when missing (e2e/setup normally has) and returns it.
    pub fn locate(repo: &Path) -> Image {
        Image::locate_arch(repo, "amd64")
    }

    /// The image of a node of `arch` (`NODEGUARD_VM_ARCH` of e2e/vm/build).
    pub fn locate_arch(repo: &Path, arch: &'static str) -> Image {
        let out = Command::new(repo.join("e2e/vm/build"))
            .env("NODEGUARD_VM_ARCH", arch)
            .stderr(Stdio::inherit())
            .output()
            .expect("run e2e/vm/build");
        assert!(
            out.status.success(),
            "e2e/vm/build failed: the node VM image is needed (run e2e/setup as root)"
        );
        let dir = PathBuf::from(String::from_utf8(out.stdout).unwrap().trim());
        for f in ["disk.img", "vmlinuz", "initrd.img"] {
            assert!(
                dir.join(f).is_file(),
                "{} is missing",
                dir.join(f).display()
            );
        }
        Image { dir, arch }
    }
}

/// A writable copy of the image's disk for one node.
pub struct Disk {
    pub path: PathBuf,
}

impl Disk {
    pub fn copy_of(image: &Image, dir: &Path) -> Disk {
        let path = dir.join("disk.img");
        let status = Command::new("cp")
            .arg("--sparse=always")
            .arg(image.dir.join("disk.img"))
            .arg(&path)
            .status()
            .unwrap();
        assert!(status.success(), "copy the VM disk");
        Disk { path }
    }
}

/// The copy is removed with the scenario (≈340 MiB each, three per run);
/// `KEEP_VM_DISK=1` keeps it for inspection with `debugfs`.
impl Drop for Disk {
    fn drop(&mut self) {
        if std::env::var_os("KEEP_VM_DISK").is_none_or(|v| v != "1") {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

impl Disk {
    fn debugfs(&self, script: &str) -> String {
        let out = Command::new("debugfs")
            .arg("-w")
            .arg("-f")
            .arg("-")
            .arg(&self.path)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .and_then(|mut child| {
                use std::io::Write;
                child.stdin.take().unwrap().write_all(script.as_bytes())?;
                child.wait_with_output()
            })
            .expect("run debugfs (e2fsprogs)");
        assert!(out.status.success(), "debugfs: {out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
    }

    /// Writes `contents` to `guest_path` (parents must exist) with `mode`.
    pub fn write(&self, guest_path: &str, contents: &[u8], mode: u32) {
        let tmp = self.path.with_extension("upload");
        std::fs::write(&tmp, contents).unwrap();
        self.debugfs(&format!(
            "rm {guest_path}\nwrite {} {guest_path}\nsif {guest_path} mode 0{:o}\nsif {guest_path} uid 0\nsif {guest_path} gid 0\n",
            tmp.display(),
            0o100000 | mode
        ));
        std::fs::remove_file(&tmp).unwrap();
        let stat = self.debugfs(&format!("stat {guest_path}\n"));
        assert!(
            stat.contains(&format!("Size: {}", contents.len())),
            "{guest_path} was not written: {stat}"
        );
    }

    pub fn mkdir(&self, guest_path: &str) {
        self.debugfs(&format!("mkdir {guest_path}\n"));
    }

    pub fn symlink(&self, guest_path: &str, target: &str) {
        self.debugfs(&format!("rm {guest_path}\nsymlink {guest_path} {target}\n"));
    }
}

/// What a command in the guest printed.
#[derive(Debug)]
pub struct Output {
    pub code: i64,
    pub stdout: String,
    #[allow(dead_code)] // read through Debug in failure messages
    pub stderr: String,
}

/// One running qemu process (one boot: `-no-reboot` makes a guest reset end it).
pub struct Vm {
    child: tokio::process::Child,
    pub started: Instant,
    pub serial: PathBuf,
    events: Arc<Mutex<Vec<(Instant, Value)>>>,
    qmp: OwnedWriteHalf,
    qga: Option<(BufReader<OwnedReadHalf>, OwnedWriteHalf)>,
    qga_path: PathBuf,
    sync_id: u64,
    launch: Launch,
}

/// How a boot was started, to start it again after a hang.
#[derive(Clone)]
struct Launch {
    image_dir: PathBuf,
    arch: &'static str,
    disk: PathBuf,
    apiserver_port: u16,
    dir: PathBuf,
    boot: u32,
    memory_mib: u32,
    attempt: u32,
}

/// No guest agent this long after qemu started: the boot hung.
/// `VM_HUNG_BOOT_SECS` overrides it (a tiny value exercises the power cycle).
fn hung_boot() -> Duration {
    let secs = std::env::var("VM_HUNG_BOOT_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(90);
    Duration::from_secs(secs)
}

/// The last `n` lines of a serial log, for a failure message.
fn serial_tail(path: &Path, n: usize) -> String {
    let text = std::fs::read(path).unwrap_or_default();
    let text = String::from_utf8_lossy(&text);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

async fn connect(path: &Path) -> UnixStream {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match UnixStream::connect(path).await {
            Ok(s) => return s,
            Err(e) if Instant::now() > deadline => panic!("connect {}: {e}", path.display()),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

impl Vm {
    /// Starts qemu on `disk` with 1 GiB; `boot` numbers the serial logs in `dir`.
    pub async fn boot(
        image: &Image,
        disk: &Disk,
        apiserver_port: u16,
        dir: &Path,
        boot: u32,
    ) -> Vm {
        Vm::boot_with_memory(image, disk, apiserver_port, dir, boot, 1024).await
    }

    /// `boot` with `memory_mib` of RAM (a Kubernetes node gets 2 GiB).
    pub async fn boot_with_memory(
        image: &Image,
        disk: &Disk,
        apiserver_port: u16,
        dir: &Path,
        boot: u32,
        memory_mib: u32,
    ) -> Vm {
        Vm::launch(Launch {
            image_dir: image.dir.clone(),
            arch: image.arch,
            disk: disk.path.clone(),
            apiserver_port,
            dir: dir.to_path_buf(),
            boot,
            memory_mib,
            attempt: 1,
        })
        .await
    }

    async fn launch(l: Launch) -> Vm {
        let suffix = if l.attempt == 1 {
            l.boot.to_string()
        } else {
            format!("{}-try{}", l.boot, l.attempt)
        };
        let serial = l.dir.join(format!("serial-{suffix}.log"));
        let qemu_log = l.dir.join(format!("qemu-{suffix}.log"));
        let qmp_path = l.dir.join("qmp.sock");
        let qga_path = l.dir.join("qga.sock");
        let _ = std::fs::remove_file(&qmp_path);
        let _ = std::fs::remove_file(&qga_path);
        let (guest_ip, guest_port) = GUEST_APISERVER.split_once(':').unwrap();
        // arm64: the `virt` board, PL011 console; the kernel is Debian's
        // (gzip'd Image, which qemu unpacks).
        // (pauth-impdef: TCG's pointer authentication without the slow
        // architected algorithm.)
        let (qemu, machine, console): (&str, &[&str], &str) = match l.arch {
            "arm64" => (
                "qemu-system-aarch64",
                &["-M", "virt", "-cpu", "max,pauth-impdef=on"],
                "ttyAMA0",
            ),
            _ => ("qemu-system-x86_64", &["-cpu", "max"], "ttyS0"),
        };
        let child = tokio::process::Command::new(qemu)
            .args(machine)
            .args(["-accel", "tcg,thread=multi", "-smp", "2"])
            .args(["-m", &l.memory_mib.to_string()])
            .args(["-display", "none", "-monitor", "none", "-no-reboot"])
            .arg("-kernel")
            .arg(l.image_dir.join("vmlinuz"))
            .arg("-initrd")
            .arg(l.image_dir.join("initrd.img"))
            .args(["-append", &format!("root=/dev/vda rw console={console}")])
            .arg("-drive")
            .arg(format!("file={},if=virtio,format=raw", l.disk.display()))
            .arg("-serial")
            .arg(format!("file:{}", serial.display()))
            // The only network: user mode, no way out but one forward per
            // connection to the loopback API server (and the test registry).
            .arg("-netdev")
            .arg(format!(
                "user,id=n0,restrict=on,guestfwd=tcp:{guest_ip}:{guest_port}-cmd:socat STDIO TCP:127.0.0.1:{}{}",
                l.apiserver_port,
                crate::support::registry_addr()
                    .map(|addr| format!(",guestfwd=tcp:{GUEST_REGISTRY}-cmd:socat STDIO TCP:{addr}"))
                    .unwrap_or_default()
            ))
            .args(["-device", "virtio-net-pci,netdev=n0"])
            .arg("-chardev")
            .arg(format!("socket,path={},server=on,wait=off,id=qga0", qga_path.display()))
            .args(["-device", "virtio-serial-pci"])
            .args(["-device", "virtserialport,chardev=qga0,name=org.qemu.guest_agent.0"])
            .arg("-qmp")
            .arg(format!("unix:{},server=on,wait=off", qmp_path.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::from(std::fs::File::create(&qemu_log).unwrap()))
            .stderr(Stdio::from(
                std::fs::OpenOptions::new().append(true).open(&qemu_log).unwrap(),
            ))
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("start {qemu}: {e} (apt-get install qemu-system-x86 or qemu-system-arm; e2e/setup installs the first)"));
        let started = Instant::now();
        let (r, mut w) = connect(&qmp_path).await.into_split();
        let mut lines = BufReader::new(r).lines();
        let greeting = lines.next_line().await.unwrap().expect("QMP greeting");
        assert!(greeting.contains("QMP"), "{greeting}");
        w.write_all(b"{\"execute\":\"qmp_capabilities\"}\n")
            .await
            .unwrap();
        let events = Arc::new(Mutex::new(Vec::new()));
        let sink = events.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                if let Ok(v) = serde_json::from_str::<Value>(&line)
                    && v.get("event").is_some()
                {
                    sink.lock().unwrap().push((Instant::now(), v));
                }
            }
        });
        Vm {
            child,
            started,
            serial,
            events,
            qmp: w,
            qga: None,
            qga_path,
            sync_id: 0,
            launch: l,
        }
    }

    /// Waits until the guest agent answers (systemd has reached it); the
    /// time since qemu started. A boot that shows no guest agent within
    /// [`hung_boot`] (boots take 12–30 s here) is taken for a hung TCG boot:
    /// its serial log is kept, its tail printed, and the VM is power-cycled
    /// once on the same disk, as an operator would. A second hang fails.
    pub async fn wait_guest_agent(&mut self, timeout: Duration) -> Duration {
        let hung = hung_boot();
        if self.launch.attempt == 1 && timeout > hung {
            if let Some(booted) = self.try_wait_guest_agent(hung).await {
                return booted;
            }
            eprintln!(
                "vm: boot {} in {}: no guest agent after {hung:?}; power-cycling once. The serial log ({}) ends:\n{}",
                self.launch.boot,
                self.launch.dir.display(),
                self.serial.display(),
                serial_tail(&self.serial, 15)
            );
            let _ = self.child.kill().await;
            let mut again = self.launch.clone();
            again.attempt += 1;
            *self = Vm::launch(again).await;
        }
        match self.try_wait_guest_agent(timeout).await {
            Some(booted) => booted,
            None => panic!(
                "the guest agent did not answer within {timeout:?} (serial log: {}); it ends:\n{}",
                self.serial.display(),
                serial_tail(&self.serial, 30)
            ),
        }
    }

    async fn try_wait_guest_agent(&mut self, timeout: Duration) -> Option<Duration> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.sync(Duration::from_secs(2)).await {
                return Some(self.started.elapsed());
            }
            if Instant::now() >= deadline {
                return None;
            }
            assert!(
                self.exited().is_none(),
                "the VM stopped while booting: {}; it ends:\n{}",
                self.serial.display(),
                serial_tail(&self.serial, 30)
            );
        }
    }

    /// guest-sync with a fresh id; drops stale replies. False on timeout.
    async fn sync(&mut self, timeout: Duration) -> bool {
        if self.qga.is_none() {
            let (r, w) = connect(&self.qga_path).await.into_split();
            self.qga = Some((BufReader::new(r), w));
        }
        self.sync_id += 1;
        let id = self.sync_id;
        let (r, w) = self.qga.as_mut().unwrap();
        let req = json!({"execute": "guest-sync", "arguments": {"id": id}}).to_string() + "\n";
        if w.write_all(req.as_bytes()).await.is_err() {
            self.qga = None;
            return false;
        }
        let wait = async {
            let mut line = String::new();
            loop {
                line.clear();
                if r.read_line(&mut line).await.ok()? == 0 {
                    return None;
                }
                let v: Value = match serde_json::from_str(line.trim_start_matches('\u{ff}')) {
                    Ok(v) => v,
                    Err(_) => continue,
                };
                if v["return"] == json!(id) {
                    return Some(());
                }
            }
        };
        matches!(tokio::time::timeout(timeout, wait).await, Ok(Some(())))
    }

    async fn qga_call(&mut self, execute: &str, arguments: Value) -> Value {
        assert!(
            self.sync(Duration::from_secs(10)).await,
            "the guest agent stopped answering"
        );
        let (r, w) = self.qga.as_mut().unwrap();
        let req = json!({"execute": execute, "arguments": arguments}).to_string() + "\n";
        w.write_all(req.as_bytes()).await.unwrap();
        let mut line = String::new();
        r.read_line(&mut line).await.unwrap();
        let v: Value =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("{execute}: {e}: {line}"));
        assert!(v.get("error").is_none(), "{execute}: {v}");
        v["return"].clone()
    }

    /// Starts `bash -c script` in the guest; its guest pid.
    pub async fn spawn(&mut self, script: &str) -> i64 {
        let r = self
            .qga_call(
                "guest-exec",
                json!({"path": "/bin/bash", "arg": ["-c", script], "capture-output": true}),
            )
            .await;
        r["pid"].as_i64().unwrap()
    }

    /// Runs `bash -c script` in the guest to completion.
    pub async fn exec(&mut self, script: &str) -> Output {
        let pid = self.spawn(script).await;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let st = self
                .qga_call("guest-exec-status", json!({"pid": pid}))
                .await;
            if st["exited"] == json!(true) {
                let text = |k: &str| {
                    let b = base64::engine::general_purpose::STANDARD
                        .decode(st[k].as_str().unwrap_or(""))
                        .unwrap();
                    String::from_utf8_lossy(&b).into_owned()
                };
                return Output {
                    code: st["exitcode"].as_i64().unwrap_or(-1),
                    stdout: text("out-data"),
                    stderr: text("err-data"),
                };
            }
            assert!(
                Instant::now() < deadline,
                "`{script}` ran over 60 s in the guest"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `exec` that must succeed; its stdout.
    pub async fn sh(&mut self, script: &str) -> String {
        let out = self.exec(script).await;
        assert_eq!(out.code, 0, "`{script}` in the guest: {out:?}");
        out.stdout
    }

    /// The power event that ended this VM, if it has ended: (when, reason),
    /// reason being qemu's `guest-shutdown`, `guest-reset`, …
    pub fn exited(&self) -> Option<(Instant, String)> {
        self.events.lock().unwrap().iter().find_map(|(at, v)| {
            (v["event"] == "SHUTDOWN")
                .then(|| (*at, v["data"]["reason"].as_str().unwrap_or("").to_string()))
        })
    }

    /// Waits for the VM to stop by itself; (when, reason) or None on timeout.
    pub async fn wait_exit(&mut self, timeout: Duration) -> Option<(Instant, String)> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(e) = self.exited() {
                let _ = tokio::time::timeout(Duration::from_secs(10), self.child.wait()).await;
                return Some(e);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        None
    }

    /// Powers the VM off: ACPI power button, then qemu's quit if it hangs.
    pub async fn power_off(&mut self) {
        if self.exited().is_none() {
            let _ = self
                .qmp
                .write_all(b"{\"execute\":\"system_powerdown\"}\n")
                .await;
            if self.wait_exit(Duration::from_secs(60)).await.is_none() {
                let _ = self.qmp.write_all(b"{\"execute\":\"quit\"}\n").await;
            }
        }
        if tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.start_kill();
            let _ = self.child.wait().await;
        }
    }

    pub fn serial_log(&self) -> String {
        String::from_utf8_lossy(&std::fs::read(&self.serial).unwrap_or_default()).into_owned()
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        // Never leave a VM running, whatever happened to the scenario.
        let _ = self.child.start_kill();
    }
}
