//! The systemd watchdog protocol end to end on a real notify socket:
//! the `nodeguard` binary with NOTIFY_SOCKET/WATCHDOG_USEC (READY=1, pets at
//! half the timeout, STOPPING=1 on SIGTERM), and the in-process agent whose
//! pets stop while a loop is stuck, and go on at their pace with
//! `requireApiServer` while the API server is slow to answer.

mod support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::notify::{NotifySocket, agent_under_systemd_watchdog, api_server_skips};
use support::proxy::BlackholeProxy;
use support::*;

#[tokio::test]
async fn the_binary_speaks_the_systemd_notify_protocol() {
    let admin = admin_client().await;
    let node = TestNode::create(&admin, "sdnotify", &[]).await;
    let socket = NotifySocket::bind();
    let state = TempDir::new("state");
    let child = Command::new(env!("CARGO_BIN_EXE_nodeguard"))
        .args(["run", "--listen", "127.0.0.1:0", "--node-name", &node.name])
        .arg("--kubeconfig")
        .arg(kubeconfig_path())
        .arg("--state-dir")
        .arg(&state.path)
        .env("NOTIFY_SOCKET", &socket.path)
        .env("WATCHDOG_USEC", "2000000")
        .env_remove("WATCHDOG_PID")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    eventually(Duration::from_secs(20), "READY=1", || {
        std::future::ready(!socket.times("READY=1").is_empty())
    })
    .await;
    eprintln!("READY=1 after {:?}", started.elapsed());
    tokio::time::sleep(Duration::from_secs(5)).await;
    let pets = socket.times("WATCHDOG=1");
    assert!(
        pets.len() >= 5,
        "only {} pets in {:?}",
        pets.len(),
        started.elapsed()
    );
    let mut gaps: Vec<Duration> = pets.windows(2).map(|w| w[1] - w[0]).collect();
    eprintln!("WATCHDOG=1 gaps: {gaps:?}");
    // What systemd enforces: never a gap of WatchdogSec (2 s). The schedule
    // is half of it; the median shows it without failing on one late wake-up
    // of a busy machine.
    assert!(
        gaps.iter().all(|g| *g < Duration::from_secs(2)),
        "a gap reached WatchdogSec: {gaps:?}"
    );
    gaps.sort();
    let median = gaps[gaps.len() / 2];
    assert!(
        median >= Duration::from_millis(800) && median <= Duration::from_millis(1300),
        "WATCHDOG=1 must come every half of WatchdogSec (1 s): median {median:?} of {gaps:?}"
    );
    // SIGTERM: STOPPING=1 and a clean exit.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let status = tokio::task::spawn_blocking(move || child.wait_with_output().unwrap())
        .await
        .unwrap();
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    // The datagram may reach the reading thread a moment after the sender returned.
    eventually(Duration::from_secs(2), "STOPPING=1", || {
        std::future::ready(socket.times("STOPPING=1").len() == 1)
    })
    .await;
    assert_eq!(socket.times("READY=1").len(), 1);
}

#[tokio::test]
async fn a_too_short_watchdog_is_refused_with_a_clear_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_nodeguard"))
        .args(["run", "--node-name", "x", "--listen", "127.0.0.1:0"])
        .env("WATCHDOG_USEC", "500000")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("too short") && err.contains("WatchdogSec="),
        "{err}"
    );
}

#[tokio::test]
async fn pets_stop_while_a_loop_is_stuck_and_resume_after() {
    let admin = admin_client().await;
    let node = TestNode::create(&admin, "sdstuck", &[]).await;
    let socket = NotifySocket::bind();
    let path = socket.path.display().to_string();
    let (agent, _state) = start_agent_with(admin, &node.name, |c| {
        c.notify_socket = Some(path);
        c.systemd_watchdog = Some(Duration::from_secs(2));
    })
    .await;
    eventually(Duration::from_secs(20), "READY=1", || {
        std::future::ready(!socket.times("READY=1").is_empty())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let stuck = agent
        .health
        .register("test-stuck-loop", Duration::from_millis(500));
    stuck.updated();
    stuck.queued();
    tokio::time::sleep(Duration::from_millis(600)).await;
    let at_stuck = socket.times("WATCHDOG=1").len();
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(
        socket.times("WATCHDOG=1").len(),
        at_stuck,
        "no WATCHDOG=1 while a loop is stuck"
    );
    let (_, metrics) = http_get(agent.addr, "/metrics").await;
    assert!(
        sample(
            &metrics,
            "nodeguard_watchdog_skipped_pets_total{target=\"systemd\",reason=\"stuck_loop\"}"
        )
        .is_some_and(|v| v >= 1.0),
        "{metrics}"
    );
    stuck.updated();
    eventually(Duration::from_secs(5), "pets resume", || {
        std::future::ready(socket.times("WATCHDOG=1").len() > at_stuck)
    })
    .await;

    // A loop that ended (as the supervisor reports a panicked or returned
    // loop): /livez names it and the pets stop for good.
    agent.health.fail("test-dead-loop", "panicked: test");
    let (code, body) = http_get(agent.addr, "/livez").await;
    assert_eq!(code, 503, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        v["loops"]["test-dead-loop"]["failed"], "panicked: test",
        "{body}"
    );
    // A pet already decided may still arrive; none after that.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let at_dead = socket.times("WATCHDOG=1").len();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        socket.times("WATCHDOG=1").len(),
        at_dead,
        "no WATCHDOG=1 after a loop died"
    );
    agent.stop().await;
    // The datagram may reach the reading thread a moment after the sender returned.
    eventually(Duration::from_secs(2), "STOPPING=1", || {
        std::future::ready(socket.times("STOPPING=1").len() == 1)
    })
    .await;
}

/// Review of issue 39's watchdog probe: each pet waited for the
/// `requireApiServer` probe (up to its 5 s timeout), so an API server
/// answering in 3 s spread a 2 s systemd watchdog's pets 4 s apart and
/// systemd would have killed a healthy agent. The probe now runs beside
/// the pets, which read its last answer: here every pet comes 1 s after
/// the last while each answer takes 3 s, none skipped; once the API server
/// is cut off the pets stop within a probe cycle, counted as skipped.
#[tokio::test]
async fn a_slow_api_server_delays_no_pet_and_a_cut_off_one_stops_them() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "sdslow").await;
    let policy = unique_name("sdslow");
    apply_policy(
        &admin,
        &policy,
        serde_json::json!({
            "nodeSelector": selecting(&node.name),
            "watchdog": {"requireApiServer": true},
        }),
    )
    .await;
    let proxy = BlackholeProxy::in_front_of_the_api_server().await;
    let through_proxy = proxy.client().await;
    let (agent, _state, socket) =
        agent_under_systemd_watchdog(through_proxy, &admin, &node.name, &policy).await;
    let skipped = || async { api_server_skips(agent.addr).await.unwrap_or(-1.0) };
    let skipped_before = skipped().await;

    // What the agent's probe asks takes 3 s to answer now, on a
    // connection already open, as the agent's (the proxy slows those).
    let probe_client = proxy.client().await;
    let ask = || {
        let req = http::Request::get(nodeguard::watchdog::core::API_PROBE_PATH)
            .body(Vec::new())
            .unwrap();
        let client = probe_client.clone();
        async move {
            let resp = client.send(req.map(Into::into)).await.unwrap();
            let code = resp.status().as_u16();
            resp.into_body().collect_bytes().await.unwrap();
            code
        }
    };
    assert_eq!(ask().await, 200);
    proxy.slow_down(Duration::from_secs(3));
    let asked = Instant::now();
    let code = ask().await;
    let took = asked.elapsed();
    assert!(
        code == 200 && took >= Duration::from_secs(3) && took < Duration::from_secs(5),
        "the probe's path through the proxy: {code} in {took:?}"
    );
    let from = Instant::now();
    let window = Duration::from_secs(10);
    tokio::time::sleep(window).await;
    let end = Instant::now();
    let pets: Vec<Instant> = socket
        .times("WATCHDOG=1")
        .into_iter()
        .filter(|t| *t >= from && *t <= end)
        .collect();
    let mut gaps = vec![pets.first().map_or(end - from, |t| *t - from)];
    gaps.extend(pets.windows(2).map(|w| w[1] - w[0]));
    gaps.push(pets.last().map_or(end - from, |t| end - *t));
    let worst = gaps.iter().max().copied().unwrap();
    let skipped_slow = skipped().await;
    assert!(
        worst <= Duration::from_millis(1500),
        "a pet every 1 s with each answer 3 s late; gaps {gaps:?}"
    );
    assert_eq!(
        skipped_slow, skipped_before,
        "no pet skipped for the API server while it answers, slowly"
    );

    // Cut off: what is sent on every connection, open or new, is lost.
    proxy.freeze();
    let cut = Instant::now();
    tokio::time::sleep(Duration::from_secs(13)).await;
    let last = socket.times("WATCHDOG=1").last().copied().unwrap();
    let stopped_after = last.saturating_duration_since(cut);
    // An answer already on its way when the link was cut still arrives
    // (3 s), and counts for a probe cycle (1 s + the probe's 5 s).
    assert!(
        stopped_after <= Duration::from_millis(9500),
        "the pets stop within a probe cycle of the last answer: the last {stopped_after:?} after the cut"
    );
    let skipped_cut = skipped().await;
    assert!(
        skipped_cut >= skipped_slow + 2.0,
        "skipped pets counted: {skipped_slow} → {skipped_cut}"
    );
    proxy.thaw();
    proxy.slow_down(Duration::ZERO);
    agent.stop().await;
    eprintln!(
        "each answer 3 s late: {} pets in {window:?}, the longest gap {worst:?}; cut off: the last pet {stopped_after:?} after, {} skipped",
        pets.len(),
        skipped_cut - skipped_slow
    );
}
