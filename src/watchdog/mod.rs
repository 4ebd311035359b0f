//! Petting the host watchdog, only while the agent is really healthy.
//!
//! - systemd: when the unit sets `WatchdogSec=` (so `WATCHDOG_USEC` is in
//!   the environment), `WATCHDOG=1` every half of the timeout; `READY=1`
//!   once the agent is ready, `STOPPING=1` on shutdown.
//! - device (`spec.watchdog.mode: Device|Both`): open `/dev/watchdog` (or
//!   the configured path), set and read back the timeout, `WDIOC_KEEPALIVE`
//!   every `petIntervalPercent` of it, and on a clean stop write the magic
//!   `V` (unless `magicClose: false`, for fencing).
//!
//! Every pet is gated by [`core::gate`]: the health registry must be live
//! (the `/livez` rule) and, only when `requireApiServer` is set, the API
//! server must have answered its last probe ([`core::api_ok`]; the probe
//! runs beside the pets, which never wait for it). Skipped pets are logged with the failing check and
//! counted.

pub mod core;
pub mod device;
pub mod notify;

use std::future::Future;
use std::io;
use std::path::Path;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use sd_notify::NotifyState;
use tokio::sync::watch;
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;

use crate::clock::WallClock;
use crate::policy::WatchdogSpec;
use crate::report::{Desired, EventKind, Reporter, Status};
use crate::server::Health;
pub use device::{Device, SysIoctl};
pub use notify::SystemdNotifier;

/// Port: delivers notifications to the service manager.
pub trait NotifyPort: Send + Sync + 'static {
    fn notify(&self, states: &[NotifyState<'_>]) -> std::io::Result<()>;
}

/// The ioctls the device needs, on an open descriptor.
pub trait IoctlPort: Send {
    /// `ioctl(fd, request, &mut value)`; returns the value after the call.
    fn ioctl_int(
        &mut self,
        fd: std::os::fd::RawFd,
        request: u64,
        value: i32,
    ) -> std::io::Result<i32>;
}

/// The condition nodeguard owns while a watchdog is requested.
pub const CONDITION: &str = "WatchdogUnavailable";

#[derive(Debug, thiserror::Error)]
pub enum WatchdogError {
    #[error("bad systemd watchdog environment: {0}")]
    BadEnvironment(String),
    #[error(
        "the systemd watchdog timeout {0:?} is too short: it must exceed 1 s (set WatchdogSec= to 2s or more in the unit)"
    )]
    TimeoutTooShort(Duration),
    #[error("cannot open watchdog device {path}: {source} ({hint})")]
    Open {
        path: String,
        hint: &'static str,
        reason: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("{what} on watchdog device {path} failed: {source}")]
    Ioctl {
        path: String,
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("watchdog device {path} rejected the timeout {wanted}s (it reads back {got})")]
    TimeoutRejected { path: String, wanted: u32, got: i32 },
}

impl WatchdogError {
    fn open(path: &Path, source: io::Error) -> Self {
        let (reason, hint) = match source.raw_os_error() {
            Some(libc::EBUSY) => (
                "DeviceBusy",
                "another process holds it open: systemd's RuntimeWatchdogSec= or a watchdog daemon; use mode Systemd, or free the device",
            ),
            Some(libc::ENOENT) | Some(libc::ENODEV) | Some(libc::ENXIO) => (
                "DeviceMissing",
                "no such device: load a watchdog driver (for example softdog) and mount the device into the pod",
            ),
            Some(libc::EACCES) | Some(libc::EPERM) => (
                "DevicePermissionDenied",
                "permission denied: the agent needs write access to the device",
            ),
            _ => ("DeviceOpenFailed", "see the error"),
        };
        WatchdogError::Open {
            path: path.display().to_string(),
            hint,
            reason,
            source,
        }
    }

    /// CamelCase reason for the condition and Event.
    pub fn reason(&self) -> &'static str {
        match self {
            WatchdogError::BadEnvironment(_) | WatchdogError::TimeoutTooShort(_) => {
                "SystemdWatchdogMisconfigured"
            }
            WatchdogError::Open { reason, .. } => reason,
            WatchdogError::Ioctl { .. } => "DeviceIoctlFailed",
            WatchdogError::TimeoutRejected { .. } => "DeviceTimeoutRejected",
        }
    }
}

/// Port: opens and arms a watchdog device.
pub trait DeviceOpener: Send + Sync + 'static {
    fn open(&self, path: &Path, timeout_seconds: u32) -> Result<Device, WatchdogError>;
}

/// Opens real devices with ioctl(2).
#[derive(Debug, Default)]
pub struct SysDeviceOpener;

impl DeviceOpener for SysDeviceOpener {
    fn open(&self, path: &Path, timeout_seconds: u32) -> Result<Device, WatchdogError> {
        Device::open(path, timeout_seconds, Box::new(SysIoctl))
    }
}

/// Port: does the API server answer right now?
pub trait ApiProbe: Send + Sync + 'static {
    fn reachable(&self) -> impl Future<Output = bool> + Send;
}

/// Asks the API server for [`core::API_PROBE_PATH`] (`/livez` without its
/// etcd check), with a short timeout. `/livez` is what every authenticated
/// client may read (`system:public-info-viewer`) and what API Priority and
/// Fairness exempts from queuing and shedding (the API server's suggested
/// `probes` FlowSchema), so an overloaded API server still answers it at
/// once; `/version` or a resource would queue behind the whole fleet's
/// requests (all agents share one ServiceAccount, so one flow) for up to
/// 15 s. What counts as an answer is [`core::api_answered`]; anything else
/// is logged with what came back.
#[derive(Clone)]
pub struct KubeApiProbe(pub kube::Client);

impl ApiProbe for KubeApiProbe {
    async fn reachable(&self) -> bool {
        let path = core::API_PROBE_PATH;
        let ask = async {
            let req = http::Request::get(path)
                .body(Vec::new())
                .expect("a constant request");
            let resp = self.0.send(req.map(Into::into)).await?;
            let status = resp.status().as_u16();
            // Read to its end, so the connection serves the next probe.
            let body = resp.into_body().collect_bytes().await?;
            Ok::<_, kube::Error>((status, body))
        };
        let why = match tokio::time::timeout(core::API_PROBE_TIMEOUT, ask).await {
            Ok(Ok((status, body))) if core::api_answered(status, &body) => return true,
            Ok(Ok((status, body))) => {
                let text = String::from_utf8_lossy(&body[..body.len().min(200)]);
                format!("{path} answered {status}: {:?}", text.trim_end())
            }
            Ok(Err(e)) => format!("{path}: {e}"),
            Err(_) => format!(
                "{path}: no answer within {} s",
                core::API_PROBE_TIMEOUT.as_secs()
            ),
        };
        tracing::warn!(%why, "the API server does not answer (requireApiServer)");
        false
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TargetLabels {
    target: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SkipLabels {
    target: String,
    reason: String,
}

/// `nodeguard_watchdog_*` metrics.
#[derive(Clone, Debug, Default)]
pub struct WatchdogMetrics {
    pets: Family<TargetLabels, Counter>,
    skipped: Family<SkipLabels, Counter>,
    last_pet: Family<TargetLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    device_timeout: Gauge,
}

impl WatchdogMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = WatchdogMetrics::default();
        registry.register(
            "nodeguard_watchdog_pets",
            "Watchdog pets sent, by target (systemd, device)",
            m.pets.clone(),
        );
        registry.register(
            "nodeguard_watchdog_skipped_pets",
            "Watchdog pets skipped because a health check failed, by target and reason",
            m.skipped.clone(),
        );
        registry.register(
            "nodeguard_watchdog_last_pet_timestamp_seconds",
            "Unix time of the last watchdog pet, by target",
            m.last_pet.clone(),
        );
        registry.register(
            "nodeguard_watchdog_device_timeout_seconds",
            "Timeout of the armed watchdog device as read back from the driver (0 when none is armed)",
            m.device_timeout.clone(),
        );
        m
    }

    fn pet(&self, target: &str, clock: &WallClock) {
        let labels = TargetLabels {
            target: target.into(),
        };
        self.pets.get_or_create(&labels).inc();
        self.last_pet
            .get_or_create(&labels)
            .set(clock.now().as_millisecond() as f64 / 1000.0);
    }

    /// Creates a target's counters at 0 when it starts being served, so the
    /// first skipped pet is an increase Prometheus can see (a series that
    /// appears at 1 shows none) and alerts can rely on the series existing.
    fn serve(&self, target: &str) {
        let _ = self.pets.get_or_create(&TargetLabels {
            target: target.into(),
        });
        for reason in core::Skip::LABELS {
            let _ = self.skipped.get_or_create(&SkipLabels {
                target: target.into(),
                reason: reason.into(),
            });
        }
    }

    fn skip(&self, target: &str, reason: &str) {
        self.skipped
            .get_or_create(&SkipLabels {
                target: target.into(),
                reason: reason.into(),
            })
            .inc();
    }
}

/// What the host gives the watchdog loop, read once at start-up.
pub struct WatchdogHost<N, O, A> {
    /// `NOTIFY_SOCKET`, when running under systemd.
    pub notifier: Option<N>,
    /// From `WATCHDOG_USEC`/`WATCHDOG_PID` ([`core::systemd_timeout`]).
    pub systemd_timeout: Option<Duration>,
    pub opener: O,
    pub api: A,
}

/// How long to wait before opening a device again after a failure.
pub const DEVICE_RETRY: Duration = Duration::from_secs(30);

struct Armed {
    device: Device,
    spec: WatchdogSpec,
    next_pet: Instant,
}

/// The watchdog loop. Runs until `shutdown`, then sends `STOPPING=1` and
/// closes the device (with the magic character unless the policy says not).
pub async fn run_watchdog<N: NotifyPort, O: DeviceOpener, A: ApiProbe>(
    host: WatchdogHost<N, O, A>,
    mut settings: watch::Receiver<Option<WatchdogSpec>>,
    health: Health,
    reporter: Reporter,
    metrics: WatchdogMetrics,
    shutdown: CancellationToken,
) {
    let clock = WallClock::new();
    let systemd_interval = host.systemd_timeout.map(core::systemd_pet_interval);
    match (&host.notifier, host.systemd_timeout) {
        (Some(_), Some(t)) => {
            metrics.serve("systemd");
            tracing::info!(timeout = ?t, interval = ?systemd_interval, "serving the systemd watchdog")
        }
        (None, Some(t)) => {
            tracing::warn!(timeout = ?t, "WATCHDOG_USEC is set but NOTIFY_SOCKET is not: cannot notify systemd")
        }
        (Some(_), None) => {
            tracing::info!("running under systemd without a service watchdog (no WatchdogSec=)")
        }
        (None, None) => {}
    }
    let mut systemd_next = systemd_interval.map(|_| Instant::now());
    let mut systemd_failures: u32 = 0;
    let mut ready_sent = host.notifier.is_none();
    let mut ready_check = Instant::now();
    let mut armed: Option<Armed> = None;
    let mut spec: Option<WatchdogSpec> = settings.borrow_and_update().clone();
    let mut device_retry: Option<Instant> = spec
        .as_ref()
        .filter(|s| s.mode.device())
        .map(|_| Instant::now());
    report_systemd_requirement(&reporter, spec.as_ref(), &host, armed.is_some());
    // The requireApiServer probe, on its own schedule: the pets read its
    // last answer (`core::api_ok`) and never wait for one, so a slow
    // API server delays no pet and one target's probe holds back neither
    // the other target nor a stop.
    let mut api = ApiProbeState::default();
    let mut probing: Option<std::pin::Pin<Box<dyn Future<Output = bool> + Send + '_>>> = None;

    loop {
        let require_api = spec.as_ref().is_some_and(|s| s.require_api_server);
        let probe_interval = core::api_probe_interval(
            systemd_next.and(systemd_interval),
            armed.as_ref().map(|a| {
                core::device_pet_interval(a.device.timeout_seconds(), a.spec.pet_interval_percent)
            }),
        );
        // Nothing to ask for: the flag off, or nothing petted (an answer
        // kept meanwhile would be stale when a target is armed again, and
        // skip its first pets with the API server there).
        if !require_api || probe_interval.is_none() {
            probing = None;
            api = ApiProbeState::default();
        }
        let probe_due =
            probe_interval.map(|i| core::api_probe_due(api.last, api.failures, i, Instant::now()));
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = sleep_until(probe_due.unwrap_or_else(Instant::now)), if require_api && probing.is_none() && probe_due.is_some() => {
                api.since = Some(Instant::now());
                // The port answers within API_PROBE_TIMEOUT; one that does
                // not is an answer of no.
                let limit = core::API_PROBE_TIMEOUT + Duration::from_secs(1);
                let probe = host.api.reachable();
                probing = Some(Box::pin(async move {
                    tokio::time::timeout(limit, probe).await.unwrap_or(false)
                }));
            }
            answered = in_flight(probing.as_mut()), if probing.is_some() => {
                probing = None;
                let now = Instant::now();
                api.last = Some((answered, now));
                api.since = None;
                if answered && api.failures > 0 {
                    // Back after failed answers, whose pets were skipped:
                    // pet now rather than at the next slot, which with the
                    // retry's wait could outlast the watchdog's timeout.
                    systemd_next = systemd_next.map(|t| t.min(now));
                    if let Some(a) = armed.as_mut() {
                        a.next_pet = a.next_pet.min(now);
                    }
                }
                api.failures = if answered { 0 } else { api.failures.saturating_add(1) };
            }
            _ = sleep_until(ready_check), if !ready_sent => {
                if health.report().ready
                    && let Some(n) = &host.notifier
                {
                    match n.notify(&[NotifyState::Ready]) {
                        Ok(()) => {
                            tracing::info!("notified systemd: READY=1");
                            ready_sent = true;
                        }
                        Err(e) => tracing::warn!(error = %e, "cannot notify systemd READY=1; retrying"),
                    }
                }
                ready_check = Instant::now() + Duration::from_millis(200);
            }
            _ = sleep_until(systemd_next.unwrap_or_else(Instant::now)), if systemd_next.is_some() => {
                let interval = systemd_interval.expect("systemd_next implies an interval");
                match check(&health, require_api.then(|| api.ok(probe_interval))) {
                    Err(skip) => {
                        metrics.skip("systemd", skip.label());
                        tracing::warn!(check = %skip.describe(), "skipping systemd watchdog pet: the agent is not healthy");
                        systemd_next = Some(Instant::now() + interval);
                    }
                    Ok(()) => match host.notifier.as_ref().map(|n| n.notify(&[NotifyState::Watchdog])) {
                        Some(Ok(())) => {
                            metrics.pet("systemd", &clock);
                            systemd_failures = 0;
                            systemd_next = Some(Instant::now() + interval);
                        }
                        Some(Err(e)) => {
                            systemd_failures += 1;
                            let retry = (Duration::from_secs(1) * 2u32.pow(systemd_failures.min(5) - 1)).min(interval);
                            tracing::warn!(error = %e, retry_in = ?retry, "cannot notify systemd WATCHDOG=1; retrying");
                            systemd_next = Some(Instant::now() + retry);
                        }
                        None => {
                            // Logged at start: notification unsupported.
                            systemd_next = None;
                        }
                    },
                }
            }
            _ = sleep_until(armed.as_ref().map(|a| a.next_pet).unwrap_or_else(Instant::now)), if armed.is_some() => {
                let a = armed.as_mut().expect("guarded");
                let interval = core::device_pet_interval(a.device.timeout_seconds(), a.spec.pet_interval_percent);
                a.next_pet = Instant::now() + interval;
                match check(&health, require_api.then(|| api.ok(probe_interval))) {
                    Err(skip) => {
                        metrics.skip("device", skip.label());
                        tracing::warn!(device = %a.device.path().display(), check = %skip.describe(), "skipping watchdog device pet: the agent is not healthy; the host resets if this lasts {}s", a.device.timeout_seconds());
                    }
                    Ok(()) => match a.device.pet() {
                        Ok(()) => metrics.pet("device", &clock),
                        Err(e) => tracing::error!(device = %a.device.path().display(), error = %e, "WDIOC_KEEPALIVE failed"),
                    },
                }
            }
            _ = sleep_until(device_retry.unwrap_or_else(Instant::now)), if device_retry.is_some() => {
                device_retry = None;
                if let Some(s) = spec.clone().filter(|s| s.mode.device()) {
                    match host.opener.open(Path::new(&s.device), s.timeout_seconds) {
                        Ok(device) => {
                            let timeout = device.timeout_seconds();
                            metrics.device_timeout.set(i64::from(timeout));
                            tracing::info!(device = %s.device, timeout_seconds = timeout, magic_close = s.magic_close, "watchdog device armed");
                            reporter.event(EventKind::Normal, "WatchdogArmed", "ArmWatchdog", format!(
                                "nodeguard armed the watchdog device {} with a {timeout}s timeout; it pets it while healthy.", s.device));
                            metrics.serve("device");
                            armed = Some(Armed { device, spec: s.clone(), next_pet: Instant::now() });
                            report_systemd_requirement(&reporter, spec.as_ref(), &host, true);
                        }
                        Err(err) => {
                            tracing::error!(error = %err, retry_in = ?DEVICE_RETRY, "watchdog device unavailable");
                            let message = format!("The watchdog device {} cannot be used: {err}. nodeguard retries every {}s.", s.device, DEVICE_RETRY.as_secs());
                            reporter.set(CONDITION, Desired { status: Status::True, reason: err.reason().into(), message: message.clone() });
                            reporter.event(EventKind::Warning, err.reason(), "ArmWatchdog", message);
                            device_retry = Some(Instant::now() + DEVICE_RETRY);
                        }
                    }
                }
            }
            r = settings.changed() => {
                if r.is_err() {
                    if shutdown.is_cancelled() { break; }
                    // The loop that hands us the policy died while the agent
                    // runs: a broken agent. Stop petting but keep the device
                    // armed (no magic close, no STOPPING=1), so the host or
                    // systemd acts on it, until the agent is stopped.
                    tracing::error!("the watchdog's settings source stopped while the agent runs; no more pets, the device stays armed");
                    health.fail("watchdog", "its settings source stopped");
                    shutdown.cancelled().await;
                    break;
                }
                let new = settings.borrow_and_update().clone();
                if new == spec { continue; }
                let device_changed = device_key(new.as_ref()) != device_key(spec.as_ref());
                spec = new;
                if device_changed {
                    if let Some(a) = armed.take() {
                        // A deliberate reconfiguration: disarm cleanly.
                        close(a, true, &metrics);
                    }
                    device_retry = spec.as_ref().filter(|s| s.mode.device()).map(|_| Instant::now());
                } else if let (Some(a), Some(s)) = (armed.as_mut(), spec.as_ref()) {
                    a.spec = s.clone();
                }
                report_systemd_requirement(&reporter, spec.as_ref(), &host, armed.is_some());
            }
        }
    }
    if let Some(n) = &host.notifier {
        match n.notify(&[NotifyState::Stopping]) {
            Ok(()) => tracing::info!("notified systemd: STOPPING=1"),
            Err(e) => tracing::warn!(error = %e, "cannot notify systemd STOPPING=1"),
        }
    }
    if let Some(a) = armed.take() {
        let magic = a.spec.magic_close;
        close(a, magic, &metrics);
    }
}

/// The parts of the spec that need the device reopened when they change.
fn device_key(spec: Option<&WatchdogSpec>) -> Option<(String, u32)> {
    spec.filter(|s| s.mode.device())
        .map(|s| (s.device.clone(), s.timeout_seconds))
}

fn close(a: Armed, magic: bool, metrics: &WatchdogMetrics) {
    let path = a.device.path().display().to_string();
    metrics.device_timeout.set(0);
    match a.device.close(magic) {
        Ok(()) if magic => tracing::info!(device = %path, "watchdog device disarmed (magic close)"),
        Ok(()) => {
            tracing::warn!(device = %path, "watchdog device closed WITHOUT magic close (magicClose: false): the host resets when the timeout expires unless something pets it")
        }
        Err(e) => {
            tracing::error!(device = %path, error = %e, "closing the watchdog device failed; the host may reset")
        }
    }
}

/// The `requireApiServer` probe's state in the watchdog loop.
#[derive(Default)]
struct ApiProbeState {
    /// The last answer: whether the API server answered, and when.
    last: Option<(bool, Instant)>,
    /// When the probe in flight began.
    since: Option<Instant>,
    /// Failed answers in a row.
    failures: u32,
}

impl ApiProbeState {
    /// Whether the probe lets a pet go now ([`core::api_ok`]).
    fn ok(&self, interval: Option<Duration>) -> bool {
        core::api_ok(
            self.last,
            self.since,
            Instant::now(),
            interval.unwrap_or(Duration::ZERO),
        )
    }
}

/// The probe in flight (never polled when there is none).
async fn in_flight<F: Future<Output = bool> + Unpin>(probe: Option<&mut F>) -> bool {
    match probe {
        Some(p) => p.await,
        None => std::future::pending().await,
    }
}

/// Whether to pet now: the health registry is live and, when the API
/// server is required (`api_ok` is `Some`), the probe lets it.
fn check(health: &Health, api_ok: Option<bool>) -> Result<(), core::Skip> {
    core::gate(&health.report(), api_ok)
}

/// Keeps `WatchdogUnavailable` in step with what the policy asks for.
fn report_systemd_requirement<N: NotifyPort, O, A>(
    reporter: &Reporter,
    spec: Option<&WatchdogSpec>,
    host: &WatchdogHost<N, O, A>,
    device_armed: bool,
) {
    let Some(spec) = spec.filter(|s| s.mode != crate::policy::WatchdogMode::Off) else {
        reporter.remove(CONDITION);
        return;
    };
    let systemd_ok = host.systemd_timeout.is_some() && host.notifier.is_some();
    if spec.mode.systemd() && !systemd_ok {
        reporter.set(
            CONDITION,
            Desired {
                status: Status::True,
                reason: "SystemdWatchdogOff".into(),
                message: "The policy asks for the systemd watchdog but nodeguard does not run under a unit with WatchdogSec= (no WATCHDOG_USEC/NOTIFY_SOCKET); install manifests/systemd/nodeguard.service.".into(),
            },
        );
        return;
    }
    if spec.mode.device() && !device_armed {
        return; // the open attempt reports its own outcome
    }
    let mut what = Vec::new();
    if spec.mode.systemd() {
        what.push("the systemd watchdog".to_string());
    }
    if spec.mode.device() {
        what.push(format!("the watchdog device {}", spec.device));
    }
    reporter.set(
        CONDITION,
        Desired {
            status: Status::False,
            reason: "WatchdogArmed".into(),
            message: format!("nodeguard pets {} while it is healthy.", what.join(" and ")),
        },
    );
}

#[cfg(test)]
mod tests;
