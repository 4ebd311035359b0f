//! Probe benchmark: N node HTTP probe workers at a 1 s period against a
//! local server in another process, measured against the floor (a minimal
//! loop of the same requests with the same client settings).
//!
//!   cargo bench --bench probes                      # 1,000 and 10,000 workers
//!   NODEGUARD_BENCH_WORKERS=1000 NODEGUARD_BENCH_SECONDS=10 NODEGUARD_BENCH_RUNS=3 cargo bench --bench probes
//!
//! Prints a markdown table; each figure is the median of the runs. CPU is
//! the agent process's user+system time over the measured window divided
//! by the probes the server saw; lateness is each request's arrival at the
//! server minus its worker's schedule (first arrival + k periods).

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use nodeguard::policy::probes::ProbeSpec;
use nodeguard::probe::{
    PodConditionPort, ProbeError, ProbeHandle, ProbeMetrics, run_probe_manager,
};
use nodeguard::report::{ReportConfig, Reporter};
use nodeguard::server::Health;
use nodeguard::server::metrics::parse_proc_stat;

const PERIOD: Duration = Duration::from_secs(1);

// ---------------------------------------------------------------- server

#[derive(Default)]
struct Arrivals(Mutex<HashMap<u32, Vec<Instant>>>);

fn serve(port_file: &str) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        use axum::extract::{Path, State};
        use axum::routing::get;
        let arrivals = Arc::new(Arrivals::default());
        let app = axum::Router::new()
            .route(
                "/w/{id}",
                get(
                    |State(a): State<Arc<Arrivals>>, Path(id): Path<u32>| async move {
                        a.0.lock()
                            .unwrap()
                            .entry(id)
                            .or_default()
                            .push(Instant::now());
                        "ok"
                    },
                ),
            )
            .route(
                "/reset",
                get(|State(a): State<Arc<Arrivals>>| async move {
                    a.0.lock().unwrap().clear();
                    "reset"
                }),
            )
            .route(
                "/report",
                get(|State(a): State<Arc<Arrivals>>| async move { report(&a.0.lock().unwrap()) }),
            )
            .with_state(arrivals);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        std::fs::write(port_file, listener.local_addr().unwrap().port().to_string()).unwrap();
        axum::serve(listener, app).await.unwrap();
    });
}

/// `count p50_ms p99_ms`: lateness of every arrival after each worker's first.
fn report(arrivals: &HashMap<u32, Vec<Instant>>) -> String {
    let mut late = Vec::new();
    let mut count = 0usize;
    for times in arrivals.values() {
        count += times.len();
        let Some(first) = times.first() else { continue };
        for t in &times[1..] {
            let since = t.duration_since(*first).as_secs_f64();
            let k = (since / PERIOD.as_secs_f64()).round();
            late.push((since - k * PERIOD.as_secs_f64()).max(0.0) * 1000.0);
        }
    }
    late.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let pct = |p: f64| {
        late.get(((late.len() as f64 - 1.0) * p) as usize)
            .copied()
            .unwrap_or(0.0)
    };
    format!("{count} {:.3} {:.3}", pct(0.5), pct(0.99))
}

struct Server {
    child: Option<Child>,
    port: u16,
}

impl Server {
    fn start() -> Server {
        let dir = std::env::temp_dir().join(format!("nodeguard-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let port_file = dir.join("port");
        let _ = std::fs::remove_file(&port_file);
        let child = Command::new(std::env::current_exe().unwrap())
            .arg("--server")
            .arg(&port_file)
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let port = loop {
            if let Ok(p) = std::fs::read_to_string(&port_file)
                && let Ok(p) = p.trim().parse()
            {
                break p;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        Server {
            child: Some(child),
            port,
        }
    }

    async fn get(&self, path: &str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .unwrap();
        s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out.split("\r\n\r\n").nth(1).unwrap_or_default().to_string()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(c) = self.child.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

// ---------------------------------------------------------------- client

fn cpu_seconds() -> f64 {
    let stat = parse_proc_stat(&std::fs::read_to_string("/proc/self/stat").unwrap()).unwrap();
    // SAFETY: sysconf reads a constant.
    (stat.utime_ticks + stat.stime_ticks) as f64
        / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64
}

fn status_kib(field: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0.0)
}

#[derive(Clone)]
struct NoPods;

impl PodConditionPort for NoPods {
    async fn set(&self, _: &str, _: &str, _: bool, _: &str) -> Result<(), ProbeError> {
        Ok(())
    }
}

struct Sample {
    probes_per_s: f64,
    cpu_ms_per_probe: f64,
    rss_mib: f64,
    p50_ms: f64,
    p99_ms: f64,
}

async fn measure(
    server: &Server,
    seconds: u64,
    start: impl FnOnce() -> CancellationToken,
) -> Sample {
    let stop = start();
    // Let the jittered first probes settle into their schedule.
    tokio::time::sleep(Duration::from_secs(3)).await;
    server.get("/reset").await;
    let cpu0 = cpu_seconds();
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    let cpu = cpu_seconds() - cpu0;
    let elapsed = t0.elapsed().as_secs_f64();
    let rss = status_kib("VmRSS:") / 1024.0;
    let report = server.get("/report").await;
    stop.cancel();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut parts = report.split_whitespace();
    let count: f64 = parts.next().unwrap().parse().unwrap();
    let p50: f64 = parts.next().unwrap().parse().unwrap();
    let p99: f64 = parts.next().unwrap().parse().unwrap();
    Sample {
        probes_per_s: count / elapsed,
        cpu_ms_per_probe: cpu * 1000.0 / count.max(1.0),
        rss_mib: rss,
        p50_ms: p50,
        p99_ms: p99,
    }
}

fn start_agent_probes(workers: usize, port: u16) -> CancellationToken {
    let specs: Vec<ProbeSpec> = (0..workers)
        .map(|i| {
            serde_json::from_value(serde_json::json!({
                "name": format!("p{i}"),
                "http": {"url": format!("http://127.0.0.1:{port}/w/{i}")},
                "periodSeconds": 1,
                "conditionType": format!("Bench{i}Unhealthy"),
            }))
            .unwrap()
        })
        .collect();
    let mut registry = prometheus_client::registry::Registry::default();
    let (reporter, _queue) = Reporter::new(&ReportConfig::default(), &mut registry);
    let metrics = ProbeMetrics::register(&mut registry);
    let (_specs_tx, specs_rx) = watch::channel(specs);
    let (_pods_tx, pods_rx) = watch::channel(None);
    let health = Health::new();
    let stop = CancellationToken::new();
    let token = stop.clone();
    tokio::spawn(async move {
        // Keep the senders alive for the run.
        let _keep = (_specs_tx, _pods_tx, _queue, registry);
        run_probe_manager(
            specs_rx,
            pods_rx,
            reporter,
            NoPods,
            metrics,
            ProbeHandle::default(),
            health.register("probe-manager", Duration::from_secs(60)),
            Default::default(),
            token,
        )
        .await;
    });
    stop
}

/// The floor: each worker a bare interval loop doing the same GET with the
/// same client settings (HTTP/1.1, Connection: close, no pooling).
fn start_floor(workers: usize, port: u16) -> CancellationToken {
    use http_body_util::Full;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;
    let client: Client<_, Full<bytes::Bytes>> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(0)
        .build_http();
    let stop = CancellationToken::new();
    for i in 0..workers {
        let client = client.clone();
        let token = stop.clone();
        let url: hyper::Uri = format!("http://127.0.0.1:{port}/w/{i}").parse().unwrap();
        tokio::spawn(async move {
            tokio::time::sleep(PERIOD.mul_f64(fastrand::f64())).await;
            let mut ticker = tokio::time::interval(PERIOD);
            loop {
                tokio::select! {
                    _ = token.cancelled() => return,
                    _ = ticker.tick() => {}
                }
                let req = hyper::Request::get(url.clone())
                    .header("Connection", "close")
                    .body(Full::new(bytes::Bytes::new()))
                    .unwrap();
                let _ = client.request(req).await;
            }
        });
    }
    stop
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// One measurement in a fresh process, so RSS is this mode's alone.
fn one(mode: &str, workers: usize, seconds: u64, port: u16) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let server = Server { child: None, port };
    let s = rt.block_on(measure(&server, seconds, || {
        if mode == "floor" {
            start_floor(workers, port)
        } else {
            start_agent_probes(workers, port)
        }
    }));
    println!(
        "{} {} {} {} {}",
        s.probes_per_s, s.cpu_ms_per_probe, s.rss_mib, s.p50_ms, s.p99_ms
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("--server") => return serve(&args[2]),
        Some("--one") => {
            return one(
                &args[2],
                args[3].parse().unwrap(),
                args[4].parse().unwrap(),
                args[5].parse().unwrap(),
            );
        }
        _ => {}
    }
    let env = |k: &str, d: &str| std::env::var(k).unwrap_or_else(|_| d.into());
    let worker_counts: Vec<usize> = env("NODEGUARD_BENCH_WORKERS", "1000,10000")
        .split(',')
        .map(|s| s.trim().parse().unwrap())
        .collect();
    let seconds: u64 = env("NODEGUARD_BENCH_SECONDS", "10").parse().unwrap();
    let runs: usize = env("NODEGUARD_BENCH_RUNS", "3").parse().unwrap();
    let server = Server::start();
    println!(
        "probe benchmark: HTTP workers at a 1 s period, {seconds} s measured per run, median of {runs} runs;\n\
         each run in a fresh process on 1 runtime thread, the server in its own process\n"
    );
    println!("| workers | what | probes/s | CPU per probe | RSS | lateness p50 | lateness p99 |");
    println!("|---:|---|---:|---:|---:|---:|---:|");
    for &n in &worker_counts {
        for (name, mode) in [
            ("nodeguard probe manager", "agent"),
            ("floor: bare request loop", "floor"),
        ] {
            let mut samples: Vec<Vec<f64>> = Vec::new();
            for _ in 0..runs {
                let out = Command::new(std::env::current_exe().unwrap())
                    .args([
                        "--one",
                        mode,
                        &n.to_string(),
                        &seconds.to_string(),
                        &server.port.to_string(),
                    ])
                    .output()
                    .unwrap();
                assert!(
                    out.status.success(),
                    "{}",
                    String::from_utf8_lossy(&out.stderr)
                );
                let line = String::from_utf8_lossy(&out.stdout);
                samples.push(
                    line.split_whitespace()
                        .map(|v| v.parse().unwrap())
                        .collect(),
                );
            }
            let m = |i: usize| median(samples.iter().map(|s| s[i]).collect());
            println!(
                "| {n} | {name} | {:.0} | {:.3} ms | {:.1} MiB | {:.2} ms | {:.2} ms |",
                m(0),
                m(1),
                m(2),
                m(3),
                m(4)
            );
        }
    }
}
