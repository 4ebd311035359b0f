//! A private system bus (a real `dbus-daemon`) with logind and systemd
//! peers written with zbus. The peers speak the real D-Bus protocol:
//! `Inhibit` hands out a real pipe descriptor, whose closing releases the
//! lock; `KillUnit(systemd-logind.service, SIGHUP)` makes the logind peer
//! re-read `InhibitDelayMaxSec=` from its drop-in directory, as logind does.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use zbus::object_server::SignalEmitter;

use super::TempDir;

/// A `dbus-daemon` with a system-bus configuration on a private socket.
pub struct PrivateBus {
    pub address: String,
    child: Child,
    _dir: TempDir,
}

impl PrivateBus {
    pub fn start() -> PrivateBus {
        let dir = TempDir::new("dbus");
        let socket = dir.path.join("system_bus_socket");
        let config = dir.path.join("system.conf");
        std::fs::write(
            &config,
            format!(
                r#"<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>system</type>
  <listen>unix:path={}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <allow own="*"/>
    <allow send_destination="*"/>
    <allow receive_sender="*"/>
  </policy>
</busconfig>
"#,
                socket.display()
            ),
        )
        .unwrap();
        let child = Command::new("dbus-daemon")
            .arg(format!("--config-file={}", config.display()))
            .arg("--nofork")
            .arg("--nopidfile")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect(
                "dbus-daemon is installed (apt-get install dbus-daemon); e2e/setup installs it",
            );
        // Until it accepts a connection: the socket file appears at bind(),
        // before listen(), and a peer connecting in between was refused
        // (ECONNREFUSED) once on a loaded machine.
        let accepts = || std::os::unix::net::UnixStream::connect(&socket).is_ok();
        for _ in 0..250 {
            if accepts() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(
            accepts(),
            "dbus-daemon does not accept connections on {}",
            socket.display()
        );
        PrivateBus {
            address: format!("unix:path={}", socket.display()),
            child,
            _dir: dir,
        }
    }
}

impl Drop for PrivateBus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One inhibitor handed out by the logind peer.
pub struct Inhibitor {
    pub what: String,
    pub who: String,
    pub why: String,
    pub mode: String,
    /// The caller's process, as the bus says it (logind lists it).
    pub pid: u32,
    read_end: OwnedFd,
    /// When the client closed its descriptor, as a thread blocked on the
    /// pipe saw it (wall clock, to compare with the API server's times).
    released_at: Arc<Mutex<Option<std::time::SystemTime>>>,
}

impl Inhibitor {
    /// The client closed its descriptor.
    pub fn released(&self) -> bool {
        let mut b = [0u8; 1];
        // SAFETY: a one-byte read from our own non-blocking pipe end.
        unsafe { libc::read(self.read_end.as_raw_fd(), b.as_mut_ptr().cast(), 1) == 0 }
    }

    /// When the client closed its descriptor, if it has.
    pub fn released_at(&self) -> Option<std::time::SystemTime> {
        *self.released_at.lock().unwrap()
    }

    /// Notes the moment the write end closes: a thread blocked in poll(2)
    /// on a copy of the read end, woken by the hang-up. It ends then, or
    /// once the inhibitor is dropped.
    fn watch_release(&self) {
        // SAFETY: dup of a descriptor we own; the copy is owned below.
        let copy = unsafe { libc::dup(self.read_end.as_raw_fd()) };
        assert!(copy >= 0, "dup failed");
        // SAFETY: a fresh descriptor from dup.
        let copy = unsafe { OwnedFd::from_raw_fd(copy) };
        let at = Arc::downgrade(&self.released_at);
        std::thread::spawn(move || {
            loop {
                let mut pfd = libc::pollfd {
                    fd: copy.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one pollfd of ours, 100 ms timeout.
                let n = unsafe { libc::poll(&mut pfd, 1, 100) };
                let Some(at) = at.upgrade() else { return };
                if n > 0 && pfd.revents & libc::POLLHUP != 0 {
                    *at.lock().unwrap() = Some(std::time::SystemTime::now());
                    return;
                }
            }
        });
    }
}

#[derive(Default)]
pub struct LogindState {
    pub delay_max_usec: u64,
    /// PreparingForShutdown: set by [`LogindPeer::prepare_for_shutdown`].
    pub preparing: bool,
    pub inhibitors: Vec<Inhibitor>,
    pub drop_in_dir: Option<PathBuf>,
    pub reloads: usize,
    /// How many delay inhibitors were held at each reload (a shutdown asked
    /// for while logind reloads is delayed only by those).
    pub held_at_reloads: Vec<usize>,
    /// Units the systemd peer knows, by name.
    pub units: std::collections::BTreeMap<String, UnitState>,
    /// Every `StopUnit` asked of the systemd peer, by unit name.
    pub stop_units: Vec<String>,
    /// The processes of transient units the systemd peer started (for
    /// real, on this bus), by unit name.
    pub processes: std::collections::BTreeMap<String, Child>,
    /// Every `StartTransientUnit`: the unit and its `ExecStart` argv.
    pub started: Vec<(String, Vec<String>)>,
    /// The bus's address, given to the processes it starts.
    pub bus_address: String,
    /// `PreparingForShutdown` is not answered before this moment (a
    /// logind slow to answer).
    pub answer_after: Option<std::time::Instant>,
}

/// A unit as the systemd peer reports it.
#[derive(Clone, Debug, Default)]
pub struct UnitState {
    pub active: String,
    pub sub: String,
    pub started_usec: u64,
    /// `InactiveExitTimestampMonotonic`; `None`: the same moment as
    /// `started_usec` on an unstepped clock (what systemd would say).
    pub started_monotonic_usec: Option<u64>,
    pub restarts: u32,
    /// KillUnit calls for it.
    pub kills: u32,
    /// Its main process (a transient unit's).
    pub main_pid: u32,
    /// How that process ended (203: it could not run, as systemd says).
    pub exit_status: i32,
    /// Their (whom, signal).
    pub signals: Vec<(String, i32)>,
}

/// `CLOCK_MONOTONIC` in microseconds, as systemd's *Monotonic timestamps.
pub fn monotonic_usec() -> u64 {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    ts.tv_sec as u64 * 1_000_000 + ts.tv_nsec as u64 / 1_000
}

pub fn now_usec() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

/// systemd's object path for a unit name.
pub fn unit_path(name: &str) -> String {
    let mut p = String::from("/org/freedesktop/systemd1/unit/");
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() {
            p.push(b as char);
        } else {
            p.push_str(&format!("_{b:02x}"));
        }
    }
    p
}

struct UnitIface(SharedLogind, String);

#[zbus::interface(name = "org.freedesktop.systemd1.Unit")]
impl UnitIface {
    #[zbus(property, name = "ActiveState")]
    fn active_state(&self) -> String {
        let mut s = self.0.lock().unwrap();
        s.refresh(&self.1);
        s.units
            .get(&self.1)
            .map(|u| u.active.clone())
            .unwrap_or_default()
    }
    #[zbus(property, name = "SubState")]
    fn sub_state(&self) -> String {
        self.0
            .lock()
            .unwrap()
            .units
            .get(&self.1)
            .map(|u| u.sub.clone())
            .unwrap_or_default()
    }
    #[zbus(property, name = "InactiveExitTimestamp")]
    fn inactive_exit_timestamp(&self) -> u64 {
        self.0
            .lock()
            .unwrap()
            .units
            .get(&self.1)
            .map(|u| u.started_usec)
            .unwrap_or(0)
    }
    #[zbus(property, name = "InactiveExitTimestampMonotonic")]
    fn inactive_exit_timestamp_monotonic(&self) -> u64 {
        self.0
            .lock()
            .unwrap()
            .units
            .get(&self.1)
            .filter(|u| u.started_usec > 0)
            .map(|u| {
                u.started_monotonic_usec.unwrap_or_else(|| {
                    monotonic_usec().saturating_sub(now_usec().saturating_sub(u.started_usec))
                })
            })
            .unwrap_or(0)
    }
}

struct ServiceIface(SharedLogind, String);

#[zbus::interface(name = "org.freedesktop.systemd1.Service")]
impl ServiceIface {
    #[zbus(property, name = "MainPID")]
    fn main_pid(&self) -> u32 {
        let mut s = self.0.lock().unwrap();
        s.refresh(&self.1);
        s.units.get(&self.1).map(|u| u.main_pid).unwrap_or(0)
    }
    #[zbus(property, name = "Result")]
    fn result(&self) -> String {
        let mut s = self.0.lock().unwrap();
        s.refresh(&self.1);
        match s.units.get(&self.1) {
            Some(u) if u.active == "failed" => "exit-code".into(),
            _ => "success".into(),
        }
    }
    #[zbus(property, name = "ExecMainStatus")]
    fn exec_main_status(&self) -> i32 {
        let mut s = self.0.lock().unwrap();
        s.refresh(&self.1);
        s.units.get(&self.1).map(|u| u.exit_status).unwrap_or(0)
    }
    #[zbus(property, name = "NRestarts")]
    fn n_restarts(&self) -> u32 {
        self.0
            .lock()
            .unwrap()
            .units
            .get(&self.1)
            .map(|u| u.restarts)
            .unwrap_or(0)
    }
}

impl LogindState {
    /// A transient unit whose process ended is inactive (exit 0) or failed,
    /// as systemd shows it.
    fn refresh(&mut self, name: &str) {
        let Some(child) = self.processes.get_mut(name) else {
            return;
        };
        if let Ok(Some(status)) = child.try_wait() {
            self.processes.remove(name);
            if let Some(u) = self.units.get_mut(name) {
                u.active = if status.success() {
                    "inactive"
                } else {
                    "failed"
                }
                .into();
                u.exit_status = status.code().unwrap_or(-1);
                u.sub = if status.success() { "dead" } else { "failed" }.into();
                u.main_pid = 0;
            }
        }
    }

    /// SIGTERM to a transient unit's process, as systemd's stop sends it,
    /// and the wait for its end (SIGKILL after 5 s).
    fn stop_process(&mut self, name: &str) {
        if let Some(mut child) = self.processes.remove(name) {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while child.try_wait().ok().flatten().is_none() {
                if std::time::Instant::now() > deadline {
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }

    pub fn held(&self) -> usize {
        self.inhibitors.iter().filter(|i| !i.released()).count()
    }

    /// What logind does on SIGHUP: re-read InhibitDelayMaxSec= from the drop-ins.
    fn reload(&mut self) {
        self.reloads += 1;
        let held = self.held();
        self.held_at_reloads.push(held);
        let Some(dir) = &self.drop_in_dir else { return };
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "conf"))
            .collect();
        files.sort();
        for f in files {
            let text = std::fs::read_to_string(&f).unwrap_or_default();
            for line in text.lines() {
                if let Some(v) = line.trim().strip_prefix("InhibitDelayMaxSec=")
                    && let Ok(secs) = v.trim().trim_end_matches('s').parse::<u64>()
                {
                    self.delay_max_usec = secs * 1_000_000;
                }
            }
        }
    }
}

pub type SharedLogind = Arc<Mutex<LogindState>>;

struct LoginManager(SharedLogind);

#[zbus::interface(name = "org.freedesktop.login1.Manager")]
impl LoginManager {
    async fn inhibit(
        &self,
        #[zbus(header)] header: zbus::message::Header<'_>,
        #[zbus(connection)] conn: &zbus::Connection,
        what: String,
        who: String,
        why: String,
        mode: String,
    ) -> zbus::fdo::Result<zbus::OwnedFd> {
        // As logind: the caller's pid, from the bus.
        let pid = match header.sender() {
            Some(sender) => zbus::fdo::DBusProxy::new(conn)
                .await?
                .get_connection_unix_process_id(sender.clone().into())
                .await
                .unwrap_or(0),
            None => 0,
        };
        // As logind: no new delay lock for an operation already under way.
        if mode == "delay" && what.contains("shutdown") && self.0.lock().unwrap().preparing {
            return Err(zbus::fdo::Error::Failed(
                "The operation inhibition has been requested for is already running".into(),
            ));
        }
        let mut fds = [0; 2];
        // SAFETY: pipe2 fills two descriptors we then own.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) } != 0 {
            return Err(zbus::fdo::Error::Failed("pipe2 failed".into()));
        }
        // SAFETY: fresh descriptors from pipe2.
        let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let inhibitor = Inhibitor {
            what,
            who,
            why,
            mode,
            pid,
            read_end: r,
            released_at: Default::default(),
        };
        inhibitor.watch_release();
        self.0.lock().unwrap().inhibitors.push(inhibitor);
        Ok(w.into())
    }

    fn list_inhibitors(&self) -> Vec<(String, String, String, String, u32, u32)> {
        self.0
            .lock()
            .unwrap()
            .inhibitors
            .iter()
            .filter(|i| !i.released())
            .map(|i| {
                (
                    i.what.clone(),
                    i.who.clone(),
                    i.why.clone(),
                    i.mode.clone(),
                    0,
                    i.pid,
                )
            })
            .collect()
    }

    #[zbus(property, name = "InhibitDelayMaxUSec")]
    fn inhibit_delay_max_usec(&self) -> u64 {
        self.0.lock().unwrap().delay_max_usec
    }

    #[zbus(property, name = "PreparingForShutdown")]
    async fn preparing_for_shutdown(&self) -> bool {
        let after = self.0.lock().unwrap().answer_after;
        if let Some(t) = after {
            tokio::time::sleep(t.saturating_duration_since(std::time::Instant::now())).await;
        }
        self.0.lock().unwrap().preparing
    }

    #[zbus(signal)]
    async fn prepare_for_shutdown(emitter: &SignalEmitter<'_>, start: bool) -> zbus::Result<()>;
}

struct SystemdManager(SharedLogind);

/// systemd's own error names (the ones nodeguard tells apart).
#[derive(Debug, zbus::DBusError)]
#[zbus(prefix = "org.freedesktop.systemd1")]
enum SystemdError {
    #[zbus(error)]
    ZBus(zbus::Error),
    NoSuchUnit(String),
    UnitExists(String),
}

#[zbus::interface(name = "org.freedesktop.systemd1.Manager")]
impl SystemdManager {
    /// As systemd: a unit not loaded is `NoSuchUnit`.
    fn get_unit(&self, name: String) -> Result<zbus::OwnedObjectPath, SystemdError> {
        if self.0.lock().unwrap().units.contains_key(&name) {
            Ok(zbus::OwnedObjectPath::try_from(unit_path(&name)).unwrap())
        } else {
            Err(SystemdError::NoSuchUnit(format!("Unit {name} not loaded.")))
        }
    }

    /// As systemd: a unit not loaded is `NoSuchUnit`. Every call is
    /// recorded (`LogindState::stop_units`).
    fn stop_unit(
        &self,
        name: String,
        _mode: String,
    ) -> Result<zbus::OwnedObjectPath, SystemdError> {
        let mut s = self.0.lock().unwrap();
        s.stop_units.push(name.clone());
        s.stop_process(&name);
        match s.units.get_mut(&name) {
            Some(u) => {
                u.active = "inactive".into();
                u.sub = "dead".into();
                u.main_pid = 0;
                Ok(zbus::OwnedObjectPath::try_from("/org/freedesktop/systemd1/job/1").unwrap())
            }
            None => Err(SystemdError::NoSuchUnit(format!("Unit {name} not loaded."))),
        }
    }

    /// As systemd for a transient service: its `ExecStart` runs for real
    /// (on this bus), its main process is the one started; a unit of the
    /// name still active is `UnitExists`.
    async fn start_transient_unit(
        &self,
        #[zbus(object_server)] server: &zbus::ObjectServer,
        name: String,
        _mode: String,
        properties: Vec<(String, zbus::OwnedVariant)>,
        _aux: Vec<(String, Vec<(String, zbus::OwnedVariant)>)>,
    ) -> Result<zbus::OwnedObjectPath, SystemdError> {
        // As systemd's sandbox would: a unit whose RestrictAddressFamilies
        // shuts out AF_UNIX cannot reach the bus (its program fails).
        let no_unix = properties
            .iter()
            .find(|(k, _)| k == "RestrictAddressFamilies")
            .and_then(|(_, v)| <(bool, Vec<String>)>::try_from(v.try_clone().ok()?).ok())
            .is_some_and(|(allow, families)| allow != families.iter().any(|f| f == "AF_UNIX"));
        let exec = properties
            .into_iter()
            .find(|(k, _)| k == "ExecStart")
            .and_then(|(_, v)| Vec::<(String, Vec<String>, bool)>::try_from(v).ok())
            .and_then(|mut e| e.pop())
            .ok_or_else(|| SystemdError::NoSuchUnit("no ExecStart".into()))?;
        let fresh = {
            let mut s = self.0.lock().unwrap();
            s.refresh(&name);
            if s.units
                .get(&name)
                .is_some_and(|u| u.active == "active" || u.active == "failed")
            {
                return Err(SystemdError::UnitExists(format!(
                    "Unit {name} was already loaded"
                )));
            }
            let spawned = Command::new(if no_unix { "false" } else { exec.0.as_str() })
                .args(&exec.1[1..])
                .env("DBUS_SYSTEM_BUS_ADDRESS", &s.bus_address)
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn();
            s.started.push((name.clone(), exec.1.clone()));
            let fresh = !s.units.contains_key(&name);
            let unit = s.units.entry(name.clone()).or_default();
            match spawned {
                Ok(child) => {
                    unit.active = "active".into();
                    unit.sub = "running".into();
                    unit.main_pid = child.id();
                    unit.started_usec = now_usec();
                    s.processes.insert(name.clone(), child);
                }
                // As systemd: a program that cannot run fails the unit
                // (status 203/EXEC), after the start job itself worked.
                Err(_) => {
                    unit.active = "failed".into();
                    unit.sub = "failed".into();
                    unit.main_pid = 0;
                    unit.exit_status = 203;
                }
            }
            fresh
        };
        if fresh {
            let _ = server
                .at(unit_path(&name), UnitIface(self.0.clone(), name.clone()))
                .await;
            let _ = server
                .at(unit_path(&name), ServiceIface(self.0.clone(), name.clone()))
                .await;
        }
        Ok(zbus::OwnedObjectPath::try_from("/org/freedesktop/systemd1/job/2").unwrap())
    }

    fn reset_failed_unit(&self, name: String) -> zbus::fdo::Result<()> {
        let mut s = self.0.lock().unwrap();
        if let Some(u) = s.units.get_mut(&name)
            && u.active == "failed"
        {
            u.active = "inactive".into();
            u.sub = "dead".into();
        }
        Ok(())
    }

    fn kill_unit(&self, name: String, whom: String, signal: i32) -> zbus::fdo::Result<()> {
        let mut s = self.0.lock().unwrap();
        if let Some(u) = s.units.get_mut(&name) {
            // Like systemd with Restart=always: killed, then started again.
            u.kills += 1;
            u.signals.push((whom, signal));
            u.restarts += 1;
            u.active = "active".into();
            u.sub = "running".into();
            u.started_usec = now_usec();
            return Ok(());
        }
        if name == "systemd-logind.service" && whom == "main" && signal == libc::SIGHUP {
            s.reload();
            Ok(())
        } else {
            Err(zbus::fdo::Error::Failed(format!(
                "unexpected KillUnit({name}, {whom}, {signal})"
            )))
        }
    }
}

/// The logind peer (its own connection, so it can leave and come back)
/// and a systemd peer that reloads it.
pub struct LogindPeer {
    pub state: SharedLogind,
    login: Option<zbus::Connection>,
    _systemd: zbus::Connection,
    address: String,
}

impl Drop for LogindPeer {
    /// The transient units' processes end with the peer.
    fn drop(&mut self) {
        let mut s = self.state.lock().unwrap();
        let names: Vec<String> = s.processes.keys().cloned().collect();
        for n in names {
            s.stop_process(&n);
        }
    }
}

impl LogindPeer {
    pub async fn start(
        address: &str,
        delay_max: Duration,
        drop_in_dir: Option<&Path>,
    ) -> LogindPeer {
        let state: SharedLogind = Arc::new(Mutex::new(LogindState {
            delay_max_usec: delay_max.as_micros() as u64,
            drop_in_dir: drop_in_dir.map(Path::to_path_buf),
            bus_address: address.to_string(),
            ..Default::default()
        }));
        let systemd = zbus::connection::Builder::address(address)
            .name("org.freedesktop.systemd1")
            .serve_at("/org/freedesktop/systemd1", SystemdManager(state.clone()))
            .build()
            .await
            .unwrap();
        let mut peer = LogindPeer {
            state,
            login: None,
            _systemd: systemd,
            address: address.to_string(),
        };
        peer.come_back().await;
        peer
    }

    /// Serves a unit on the systemd peer.
    pub async fn serve_unit(&self, name: &str, state: UnitState) {
        self.state
            .lock()
            .unwrap()
            .units
            .insert(name.to_string(), state);
        let server = self._systemd.object_server();
        server
            .at(
                unit_path(name),
                UnitIface(self.state.clone(), name.to_string()),
            )
            .await
            .unwrap();
        server
            .at(
                unit_path(name),
                ServiceIface(self.state.clone(), name.to_string()),
            )
            .await
            .unwrap();
    }

    /// logind (re)appears on the bus; earlier inhibitors are forgotten, as
    /// a restarted logind forgets them.
    pub async fn come_back(&mut self) {
        let conn = zbus::connection::Builder::address(self.address.as_str())
            .name("org.freedesktop.login1")
            .serve_at("/org/freedesktop/login1", LoginManager(self.state.clone()))
            .build()
            .await
            .unwrap();
        self.login = Some(conn);
    }

    /// logind leaves the bus (killed). Like the real one, what it kept in
    /// memory goes with it: a shutdown it was delaying is forgotten.
    pub async fn kill(&mut self) {
        if let Some(c) = self.login.take() {
            let _ = c.close().await;
        }
        let mut state = self.state.lock().unwrap();
        state.inhibitors.clear();
        state.preparing = false;
    }

    pub async fn prepare_for_shutdown(&self, start: bool) {
        self.state.lock().unwrap().preparing = start;
        let conn = self.login.as_ref().expect("logind is up");
        let iface = conn
            .object_server()
            .interface::<_, LoginManager>("/org/freedesktop/login1")
            .await
            .unwrap();
        LoginManager::prepare_for_shutdown(iface.signal_emitter(), start)
            .await
            .unwrap();
    }

    pub fn held(&self) -> usize {
        self.state.lock().unwrap().held()
    }

    /// When the last delay inhibitor was let go: `None` while one is held
    /// or none was ever handed out.
    pub fn delay_released_at(&self) -> Option<std::time::SystemTime> {
        let state = self.state.lock().unwrap();
        let delays: Vec<_> = state
            .inhibitors
            .iter()
            .filter(|i| i.mode == "delay")
            .map(|i| i.released_at())
            .collect();
        if delays.iter().any(Option::is_none) {
            return None;
        }
        delays.into_iter().flatten().max()
    }

    pub fn inhibitor_modes(&self) -> Vec<(String, String, String)> {
        self.state
            .lock()
            .unwrap()
            .inhibitors
            .iter()
            .filter(|i| !i.released())
            .map(|i| (i.what.clone(), i.who.clone(), i.mode.clone()))
            .collect()
    }
}
