//! The watchdog loop with stand-ins and paused time: a recording notifier,
//! a regular file plus a recording ioctl port as the device.

use super::*;
use crate::policy::WatchdogMode;
use crate::report::ReportConfig;
use std::os::fd::RawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

#[derive(Clone, Default)]
struct Notes {
    sent: Arc<Mutex<Vec<(Instant, String)>>>,
    /// Every attempt, delivered or not.
    attempts: Arc<Mutex<Vec<(Instant, String)>>>,
    failures_left: Arc<AtomicUsize>,
}

impl Notes {
    fn count(&self, what: &str) -> usize {
        self.times(what).len()
    }
    fn times(&self, what: &str) -> Vec<Instant> {
        self.sent
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, m)| m == what)
            .map(|(t, _)| *t)
            .collect()
    }
}

impl NotifyPort for Notes {
    fn notify(&self, states: &[NotifyState<'_>]) -> io::Result<()> {
        let msg = notify::message(states);
        self.attempts
            .lock()
            .unwrap()
            .push((Instant::now(), msg.trim_end().to_string()));
        if self
            .failures_left
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionRefused,
                "systemd away",
            ));
        }
        self.sent
            .lock()
            .unwrap()
            .push((Instant::now(), msg.trim_end().to_string()));
        Ok(())
    }
}

/// Records every ioctl; behaves like a driver that accepts any timeout.
#[derive(Clone, Default)]
struct Ioctls {
    calls: Arc<Mutex<Vec<(u64, i32, Instant)>>>,
    timeout: Arc<Mutex<i32>>,
}

impl IoctlPort for Ioctls {
    fn ioctl_int(&mut self, _fd: RawFd, request: u64, value: i32) -> io::Result<i32> {
        self.calls
            .lock()
            .unwrap()
            .push((request, value, Instant::now()));
        let mut t = self.timeout.lock().unwrap();
        match request {
            device::WDIOC_SETTIMEOUT => {
                *t = value;
                Ok(value)
            }
            device::WDIOC_GETTIMEOUT => Ok(*t),
            device::WDIOC_KEEPALIVE => Ok(0),
            _ => Err(io::Error::from_raw_os_error(libc::ENOTTY)),
        }
    }
}

impl Ioctls {
    fn count(&self, request: u64) -> usize {
        self.calls
            .lock()
            .unwrap()
            .iter()
            .filter(|(r, _, _)| *r == request)
            .count()
    }
}

#[derive(Clone)]
struct StandIn {
    ioctls: Ioctls,
    busy: Arc<AtomicBool>,
    opened: Arc<Mutex<Vec<PathBuf>>>,
}

impl DeviceOpener for StandIn {
    fn open(&self, path: &Path, timeout_seconds: u32) -> Result<Device, WatchdogError> {
        if self.busy.load(Ordering::SeqCst) {
            return Err(WatchdogError::open(
                path,
                io::Error::from_raw_os_error(libc::EBUSY),
            ));
        }
        self.opened.lock().unwrap().push(path.to_path_buf());
        Device::open(path, timeout_seconds, Box::new(self.ioctls.clone()))
    }
}

/// The API server as the probe finds it: whether it answers (as it is
/// when asked), how long each answer takes, and when it was asked.
#[derive(Clone, Default)]
struct Api(
    Arc<AtomicBool>,
    Arc<Mutex<Duration>>,
    Arc<Mutex<Vec<Instant>>>,
);

impl ApiProbe for Api {
    async fn reachable(&self) -> bool {
        self.2.lock().unwrap().push(Instant::now());
        let answer = self.0.load(Ordering::SeqCst);
        let delay = *self.1.lock().unwrap();
        tokio::time::sleep(delay).await;
        answer
    }
}

impl Api {
    fn asked(&self) -> Vec<Instant> {
        self.2.lock().unwrap().clone()
    }
}

struct Rig {
    notes: Notes,
    ioctls: Ioctls,
    busy: Arc<AtomicBool>,
    api: Api,
    health: Health,
    reporter: Reporter,
    registry: Registry,
    settings: watch::Sender<Option<WatchdogSpec>>,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    dir: PathBuf,
}

fn device_spec(dir: &Path, timeout: u32, magic: bool) -> WatchdogSpec {
    WatchdogSpec {
        mode: WatchdogMode::Device,
        device: dir.join("watchdog").display().to_string(),
        timeout_seconds: timeout,
        pet_interval_percent: 25,
        require_api_server: false,
        magic_close: magic,
    }
}

fn rig(systemd_timeout: Option<Duration>, spec: Option<WatchdogSpec>, dir: PathBuf) -> Rig {
    std::fs::create_dir_all(&dir).unwrap();
    if let Some(s) = &spec {
        std::fs::write(&s.device, b"").unwrap();
    }
    let notes = Notes::default();
    let ioctls = Ioctls::default();
    let busy = Arc::new(AtomicBool::new(false));
    let api = Api(
        Arc::new(AtomicBool::new(true)),
        Default::default(),
        Default::default(),
    );
    let health = Health::new();
    let mut registry = Registry::default();
    let (reporter, _q) = Reporter::new(&ReportConfig::default(), &mut registry);
    let metrics = WatchdogMetrics::register(&mut registry);
    let (tx, rx) = watch::channel(spec);
    let shutdown = CancellationToken::new();
    let host = WatchdogHost {
        notifier: Some(notes.clone()),
        systemd_timeout,
        opener: StandIn {
            ioctls: ioctls.clone(),
            busy: busy.clone(),
            opened: Default::default(),
        },
        api: api.clone(),
    };
    let task = tokio::spawn(run_watchdog(
        host,
        rx,
        health.clone(),
        reporter.clone(),
        metrics,
        shutdown.clone(),
    ));
    Rig {
        notes,
        ioctls,
        busy,
        api,
        health,
        reporter,
        registry,
        settings: tx,
        shutdown,
        task,
        dir,
    }
}

fn tmp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("nodeguard-wd-{name}-{}", std::process::id()))
}

async fn secs(n: u64) {
    tokio::time::sleep(Duration::from_secs(n)).await;
}

fn metrics_text(r: &Rig) -> String {
    crate::server::metrics::encode(&r.registry).unwrap()
}

#[tokio::test(start_paused = true)]
async fn systemd_ready_cadence_and_stopping() {
    let r = rig(Some(Duration::from_secs(10)), None, tmp("systemd"));
    let l = r.health.register("watch", Duration::from_secs(60));
    secs(1).await;
    assert_eq!(
        r.notes.count("READY=1"),
        0,
        "not ready before the first sync"
    );
    l.updated();
    secs(1).await;
    assert_eq!(r.notes.count("READY=1"), 1);
    secs(28).await;
    let pets = r.notes.times("WATCHDOG=1");
    // At 0, 5, 10, 15, 20, 25 and 30 s.
    assert!((6..=7).contains(&pets.len()), "{} pets", pets.len());
    for w in pets.windows(2) {
        assert_eq!(w[1] - w[0], Duration::from_secs(5), "half of WatchdogSec");
    }
    r.shutdown.cancel();
    r.task.await.unwrap();
    assert_eq!(r.notes.count("STOPPING=1"), 1);
    assert_eq!(r.notes.count("READY=1"), 1, "READY=1 once");
}

#[tokio::test(start_paused = true)]
async fn a_stuck_loop_stops_every_pet_and_each_skip_is_counted() {
    let dir = tmp("stuck");
    let r = rig(
        Some(Duration::from_secs(10)),
        Some(device_spec(&dir, 20, true)),
        dir,
    );
    let l = r.health.register("probe-manager", Duration::from_secs(5));
    l.updated();
    secs(11).await;
    let systemd_before = r.notes.count("WATCHDOG=1");
    let device_before = r.ioctls.count(device::WDIOC_KEEPALIVE);
    assert!(systemd_before >= 2 && device_before >= 2);
    l.queued(); // stuck from now, past its 5 s timeout
    secs(6).await;
    let systemd_at_stuck = r.notes.count("WATCHDOG=1");
    let device_at_stuck = r.ioctls.count(device::WDIOC_KEEPALIVE);
    secs(30).await;
    assert_eq!(
        r.notes.count("WATCHDOG=1"),
        systemd_at_stuck,
        "no systemd pets while stuck"
    );
    assert_eq!(
        r.ioctls.count(device::WDIOC_KEEPALIVE),
        device_at_stuck,
        "no device pets while stuck"
    );
    let text = metrics_text(&r);
    assert!(
        text.contains(
            "nodeguard_watchdog_skipped_pets_total{target=\"systemd\",reason=\"stuck_loop\"} 6"
        ),
        "{text}"
    );
    let device_skips = text.lines().find_map(|l| {
        l.strip_prefix(
            "nodeguard_watchdog_skipped_pets_total{target=\"device\",reason=\"stuck_loop\"} ",
        )?
        .parse::<u64>()
        .ok()
    });
    assert!(device_skips.is_some_and(|n| n > 0), "{text}");
    // Served targets start at 0 for every reason.
    assert!(
        text.contains(
            "nodeguard_watchdog_skipped_pets_total{target=\"device\",reason=\"api_server_unreachable\"} 0"
        ),
        "{text}"
    );
    l.updated();
    secs(6).await;
    assert!(
        r.notes.count("WATCHDOG=1") > systemd_at_stuck,
        "pets resume"
    );
    assert!(r.ioctls.count(device::WDIOC_KEEPALIVE) > device_at_stuck);
    r.shutdown.cancel();
    r.task.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn device_is_armed_petted_at_its_fraction_and_magic_closed() {
    let dir = tmp("device");
    let spec = device_spec(&dir, 20, true);
    let path = spec.device.clone();
    let r = rig(None, Some(spec), dir.clone());
    secs(61).await;
    let calls = r.ioctls.calls.lock().unwrap().clone();
    assert_eq!((calls[0].0, calls[0].1), (device::WDIOC_SETTIMEOUT, 20));
    assert_eq!(calls[1].0, device::WDIOC_GETTIMEOUT);
    let pets: Vec<Instant> = calls
        .iter()
        .filter(|c| c.0 == device::WDIOC_KEEPALIVE)
        .map(|c| c.2)
        .collect();
    assert_eq!(
        pets.len(),
        13,
        "every 5 s (25% of 20 s) over 61 s, from t=0"
    );
    for w in pets.windows(2) {
        assert_eq!(w[1] - w[0], Duration::from_secs(5));
    }
    assert!(metrics_text(&r).contains("nodeguard_watchdog_device_timeout_seconds 20"));
    assert_eq!(
        std::fs::read(&path).unwrap(),
        b"",
        "nothing written while running"
    );
    let cond = r.reporter.desired()[CONDITION].clone().unwrap();
    assert_eq!(
        (cond.status, cond.reason.as_str()),
        (Status::False, "WatchdogArmed")
    );
    r.shutdown.cancel();
    r.task.await.unwrap();
    assert_eq!(
        std::fs::read(&path).unwrap(),
        b"V",
        "magic close on a clean stop"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_dead_settings_source_stops_the_pets_and_keeps_the_device_armed() {
    let dir = tmp("deadsource");
    let spec = device_spec(&dir, 20, true);
    let path = spec.device.clone();
    let Rig {
        notes,
        ioctls,
        health,
        settings,
        shutdown,
        task,
        ..
    } = rig(Some(Duration::from_secs(20)), Some(spec), dir.clone());
    secs(11).await;
    let pets = |ioctls: &Ioctls| {
        ioctls
            .calls
            .lock()
            .unwrap()
            .iter()
            .filter(|c| c.0 == device::WDIOC_KEEPALIVE)
            .count()
    };
    assert!(pets(&ioctls) >= 2);
    // The node-state loop that owns the sender died (not a stop).
    drop(settings);
    secs(1).await;
    let (device_pets, systemd_pets) = (pets(&ioctls), notes.count("WATCHDOG=1"));
    secs(60).await;
    assert_eq!(
        pets(&ioctls),
        device_pets,
        "no device pets after the source died"
    );
    assert_eq!(
        notes.count("WATCHDOG=1"),
        systemd_pets,
        "no systemd pets either"
    );
    assert_eq!(std::fs::read(&path).unwrap(), b"", "the device stays armed");
    assert_eq!(notes.count("STOPPING=1"), 0, "systemd is not told we stop");
    assert!(!health.report().live);
    // A real stop later still closes cleanly.
    shutdown.cancel();
    task.await.unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), b"V");
    assert_eq!(notes.count("STOPPING=1"), 1);
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test(start_paused = true)]
async fn fencing_mode_closes_without_the_magic_character() {
    let dir = tmp("fence");
    let spec = device_spec(&dir, 20, false);
    let path = spec.device.clone();
    let r = rig(None, Some(spec), dir.clone());
    secs(1).await;
    r.shutdown.cancel();
    r.task.await.unwrap();
    assert_eq!(
        std::fs::read(&path).unwrap(),
        b"",
        "no V: the host resets after the timeout"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_busy_device_is_a_condition_and_event_then_retried() {
    let dir = tmp("busy");
    let spec = device_spec(&dir, 20, true);
    let r = {
        // Busy from the first attempt.
        let r = rig(None, None, dir.clone());
        r.busy.store(true, Ordering::SeqCst);
        std::fs::write(&spec.device, b"").unwrap();
        r.settings.send_replace(Some(spec.clone()));
        r
    };
    secs(1).await;
    let cond = r.reporter.desired()[CONDITION].clone().unwrap();
    assert_eq!(
        (cond.status, cond.reason.as_str()),
        (Status::True, "DeviceBusy")
    );
    assert!(
        cond.message.contains("RuntimeWatchdogSec"),
        "{}",
        cond.message
    );
    assert_eq!(r.ioctls.count(device::WDIOC_KEEPALIVE), 0);
    r.busy.store(false, Ordering::SeqCst);
    secs(DEVICE_RETRY.as_secs()).await;
    let cond = r.reporter.desired()[CONDITION].clone().unwrap();
    assert_eq!(
        cond.status,
        Status::False,
        "armed after the retry: {cond:?}"
    );
    assert!(r.ioctls.count(device::WDIOC_KEEPALIVE) >= 1);
    r.shutdown.cancel();
    r.task.await.unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test(start_paused = true)]
async fn the_api_server_gates_petting_only_when_required() {
    let r = rig(Some(Duration::from_secs(4)), None, tmp("api"));
    r.api.0.store(false, Ordering::SeqCst);
    secs(10).await;
    let pets = r.notes.count("WATCHDOG=1");
    assert!(
        pets >= 5,
        "an API outage does not stop pets by default ({pets})"
    );
    let mut spec = WatchdogSpec {
        mode: WatchdogMode::Systemd,
        require_api_server: true,
        ..Default::default()
    };
    r.settings.send_replace(Some(spec.clone()));
    secs(10).await;
    assert!(r.notes.count("WATCHDOG=1") <= pets + 1);
    assert!(metrics_text(&r).contains("reason=\"api_server_unreachable\""));
    // Back: the probe asks again within its interval (2 s, the retry's
    // cap) and the pet goes with the answer, not at the slot after it
    // (this failed now and then while the pet waited for its slot).
    r.api.0.store(true, Ordering::SeqCst);
    let back = Instant::now();
    secs(3).await;
    let first = r.notes.times("WATCHDOG=1").into_iter().find(|t| *t > back);
    assert!(
        first.is_some_and(|t| t - back <= Duration::from_millis(2100)),
        "{:?}",
        first.map(|t| t - back)
    );
    let asked = r.api.asked();
    assert!(
        asked.iter().any(|t| Some(*t) == first),
        "the pet went with the probe's answer: asked {asked:?}, pet {first:?}"
    );
    spec.require_api_server = false;
    r.settings.send_replace(Some(spec));
    r.shutdown.cancel();
    r.task.await.unwrap();
}

/// Review of issue 39's probe: each pet waited for the probe, so an API
/// server answering in 3 s (within the probe's 5 s) spread a 2 s systemd
/// watchdog's pets 4 s apart and the service was killed. The probe now
/// runs beside the pets; a probe that fails still stops them, within one
/// probe cycle.
#[tokio::test(start_paused = true)]
async fn a_slow_api_server_delays_no_pet_and_a_silent_one_stops_them() {
    let r = rig(Some(Duration::from_secs(2)), None, tmp("slow-api"));
    r.api.0.store(true, Ordering::SeqCst);
    *r.api.1.lock().unwrap() = Duration::from_secs(3);
    r.settings.send_replace(Some(WatchdogSpec {
        mode: WatchdogMode::Systemd,
        require_api_server: true,
        ..Default::default()
    }));
    secs(12).await;
    let times = r.notes.times("WATCHDOG=1");
    let gaps: Vec<Duration> = times.windows(2).map(|w| w[1] - w[0]).collect();
    assert!(times.len() >= 11, "{} pets in 12 s: {gaps:?}", times.len());
    assert!(
        gaps.iter().all(|g| *g <= Duration::from_millis(1100)),
        "every pet 1 s after the last: {gaps:?}"
    );
    assert_eq!(api_skips(&r, "systemd"), "0", "{}", metrics_text(&r));
    // The API server stops answering at all. The answer in flight (yes,
    // 3 s late) still counts for an interval plus 5 s; the next probe
    // never answers, and its own timeout (6 s) comes after that: the last
    // answer's expiry stops the pets, 3 + 1 + 5 s after the cut at most.
    r.api.0.store(false, Ordering::SeqCst);
    *r.api.1.lock().unwrap() = Duration::from_secs(3600);
    let cut = Instant::now();
    secs(20).await;
    let last = *r.notes.times("WATCHDOG=1").last().unwrap();
    assert!(
        last - cut <= Duration::from_secs(3 + 1) + core::API_PROBE_TIMEOUT,
        "the last pet {:?} after the cut",
        last - cut
    );
    let skips = api_skips(&r, "systemd");
    assert!(
        skips.parse::<f64>().is_ok_and(|n| n > 0.0),
        "the pets after are skipped, counted: {skips}"
    );
    r.shutdown.cancel();
    r.task.await.unwrap();
}

fn api_skips(r: &Rig, target: &str) -> String {
    let text = metrics_text(r);
    let key = format!(
        "nodeguard_watchdog_skipped_pets_total{{target=\"{target}\",reason=\"api_server_unreachable\"}} "
    );
    text.lines()
        .find_map(|l| l.strip_prefix(key.as_str()))
        .unwrap_or("absent")
        .to_string()
}

/// Review finding: the next probe was set when an answer came, from the
/// interval then. A policy edit that shortened the device's interval
/// (600 s timeout at 50 %: probes 300 s apart; then 60 s: pets every
/// 30 s) left the next probe minutes away while each pet judged the last
/// answer by the new interval: every pet skipped, and the host would have
/// reset with the API server answering throughout.
#[tokio::test(start_paused = true)]
async fn a_shorter_interval_by_a_policy_edit_moves_the_next_probe_with_it() {
    let dir = tmp("api-shorter");
    let mut spec = device_spec(&dir, 600, true);
    spec.pet_interval_percent = 50;
    spec.require_api_server = true;
    let r = rig(None, Some(spec.clone()), dir);
    secs(10).await;
    let pets = r.ioctls.count(device::WDIOC_KEEPALIVE);
    assert!(pets >= 1, "armed and petted");
    secs(50).await;
    spec.timeout_seconds = 60;
    r.settings.send_replace(Some(spec));
    secs(120).await;
    assert_eq!(api_skips(&r, "device"), "0", "{}", metrics_text(&r));
    assert!(
        r.ioctls.count(device::WDIOC_KEEPALIVE) >= pets + 4,
        "a pet every 30 s after the edit"
    );
    r.shutdown.cancel();
    r.task.await.unwrap();
}

/// Review finding: while nothing was petted (the device off by an edit,
/// or busy and retried) the last answer stayed, and the first pets after
/// the device was armed again were skipped for an answer that expired
/// meanwhile, with the API server there.
#[tokio::test(start_paused = true)]
async fn an_answer_from_before_a_pause_does_not_skip_the_pets_after_it() {
    let dir = tmp("api-pause");
    let mut spec = device_spec(&dir, 20, true);
    spec.require_api_server = true;
    let r = rig(None, Some(spec.clone()), dir);
    secs(10).await;
    let mut off = spec.clone();
    off.mode = WatchdogMode::Off;
    r.settings.send_replace(Some(off));
    secs(600).await;
    let pets = r.ioctls.count(device::WDIOC_KEEPALIVE);
    r.settings.send_replace(Some(spec));
    secs(20).await;
    assert_eq!(api_skips(&r, "device"), "0", "{}", metrics_text(&r));
    assert!(r.ioctls.count(device::WDIOC_KEEPALIVE) >= pets + 3);
    r.shutdown.cancel();
    r.task.await.unwrap();
}

/// Review finding: after a failed answer the next probe waited a whole
/// interval, so one brief error (a load balancer's 502) could skip the
/// pets of two intervals. It asks again after 1 s, doubling while it
/// fails, up to the interval.
#[tokio::test(start_paused = true)]
async fn a_failed_answer_is_asked_again_soon_then_less_often() {
    let r = rig(Some(Duration::from_secs(20)), None, tmp("api-retry"));
    r.api.0.store(false, Ordering::SeqCst);
    r.settings.send_replace(Some(WatchdogSpec {
        mode: WatchdogMode::Systemd,
        require_api_server: true,
        ..Default::default()
    }));
    secs(60).await;
    let asked = r.api.asked();
    let gaps: Vec<u64> = asked.windows(2).map(|w| (w[1] - w[0]).as_secs()).collect();
    assert_eq!(gaps[..6], [1, 2, 4, 8, 10, 10], "{gaps:?}");
    // Back: the retry's answer lets the next pet go.
    r.api.0.store(true, Ordering::SeqCst);
    let back = Instant::now();
    secs(25).await;
    let first = r
        .notes
        .times("WATCHDOG=1")
        .into_iter()
        .find(|t| *t > back)
        .unwrap();
    assert!(
        first - back <= Duration::from_secs(20),
        "{:?}",
        first - back
    );
    r.shutdown.cancel();
    r.task.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn failed_notifications_are_retried_with_backoff() {
    let r = rig(Some(Duration::from_secs(20)), None, tmp("retry"));
    secs(1).await;
    let ready_at = r.notes.times("READY=1");
    assert_eq!(ready_at.len(), 1, "READY=1 first, delivered");
    let pets_before = r.notes.count("WATCHDOG=1");
    r.notes.failures_left.store(2, Ordering::SeqCst);
    secs(30).await;
    let attempts: Vec<Instant> = r
        .notes
        .attempts
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, m)| m == "WATCHDOG=1")
        .map(|(t, _)| *t)
        .skip(pets_before)
        .collect();
    // Two failures, retried after 1 s and then 2 s (not at once, not at the
    // 10 s pet interval), then the regular interval again.
    let gaps: Vec<Duration> = attempts.windows(2).map(|w| w[1] - w[0]).collect();
    assert_eq!(
        gaps[..3],
        [
            Duration::from_secs(1),
            Duration::from_secs(2),
            Duration::from_secs(10)
        ],
        "{gaps:?}"
    );
    assert_eq!(
        r.notes.count("WATCHDOG=1"),
        attempts.len() - 2 + pets_before,
        "all but the two failed attempts delivered"
    );
    r.shutdown.cancel();
    r.task.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn changing_the_device_disarms_the_old_one_cleanly() {
    let dir = tmp("switch");
    let first = device_spec(&dir, 20, false);
    let r = rig(None, Some(first.clone()), dir.clone());
    secs(1).await;
    let mut second = first.clone();
    second.device = dir.join("watchdog1").display().to_string();
    std::fs::write(&second.device, b"").unwrap();
    r.settings.send_replace(Some(second.clone()));
    secs(1).await;
    assert_eq!(
        std::fs::read(&first.device).unwrap(),
        b"V",
        "reconfiguration disarms, even in fencing mode"
    );
    r.settings.send_replace(None);
    secs(1).await;
    assert_eq!(
        std::fs::read(&second.device).unwrap(),
        b"V",
        "turning it off disarms"
    );
    assert!(
        !r.reporter.desired().contains_key(CONDITION),
        "condition removed when off"
    );
    r.shutdown.cancel();
    r.task.await.unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test(start_paused = true)]
async fn systemd_mode_without_a_unit_watchdog_is_reported() {
    let r = rig(None, None, tmp("nosd"));
    r.settings.send_replace(Some(WatchdogSpec {
        mode: WatchdogMode::Systemd,
        ..Default::default()
    }));
    secs(1).await;
    let cond = r.reporter.desired()[CONDITION].clone().unwrap();
    assert_eq!(
        (cond.status, cond.reason.as_str()),
        (Status::True, "SystemdWatchdogOff")
    );
    r.shutdown.cancel();
    r.task.await.unwrap();
    let _ = &r.dir;
}
