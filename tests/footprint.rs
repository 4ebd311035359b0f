//! The agent's own pages (`src/footprint`), as the shipped binary does it
//! against the real control plane: the start's pages are released only once
//! the agent has been ready, with its API calls going through, for a while.
//! (Its own test binary: it stops the shared API server.)

mod support;

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::*;

use nodeguard::footprint::RELEASED;

/// Failed writes so far, Events and the Node's status.
async fn write_errors(addr: SocketAddr) -> f64 {
    let (_, metrics) = http_get(addr, "/metrics").await;
    ["nodes/status", "events"]
        .iter()
        .map(|r| {
            sample(
                &metrics,
                &format!("nodeguard_api_write_errors_total{{resource=\"{r}\"}}"),
            )
            .unwrap_or(0.0)
        })
        .sum()
}

/// Holds until `until` (from `since`), failing if the agent's log says it
/// released its pages meanwhile.
async fn no_release(log: &std::path::Path, since: Instant, until: Duration, why: &str) {
    while since.elapsed() < until {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        assert!(
            !text.contains(RELEASED),
            "released while {why} ({:?} in):\n{text}",
            since.elapsed()
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// What holds the release, each for longer than it could wait without it
/// (the delay's random part reaches 120 s, the quiet time's 60 s), the
/// agent ready throughout:
/// 1. its condition write refused (its account may not PATCH) from just
///    after it is ready until 130 s after: a failed write every 3 s or so;
/// 2. then, its write through, the API server stopped for 80 s with nothing
///    to write (the default 300 s heartbeat): its watches failing to
///    reconnect, no write failing.
///
/// Once the API server is back, the release follows within the quiet time
/// and a look.
#[tokio::test]
async fn the_start_pages_stay_while_the_agents_calls_fail_and_go_once_they_pass() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "footprint").await;
    let dir = TempDir::new("footprint");
    let app_log = dir.path.join("app.log");
    std::fs::write(&app_log, "").unwrap();
    let policy = unique_name("footprint");
    apply_policy(
        &admin,
        &policy,
        serde_json::json!({
            "nodeSelector": selecting(&node.name),
            "monitors": [{"name": "app", "source": {"file": {"path": app_log.display().to_string()}},
                "conditions": [{"type": "AppBroken", "reason": "AppIsFine", "message": "The app is fine."}],
                "rules": [{"type": "permanent", "condition": "AppBroken", "reason": "AppCrashed", "pattern": "app crashed"}]}],
        }),
    )
    .await;
    let sa = unique_name("footprint");
    let token = service_account_token(&admin, &sa).await;
    let kubeconfig = dir.path.join("kubeconfig");
    kubeconfig_with_token(&token, &kubeconfig);
    let everything = |verbs: &[&str]| serde_json::json!([{"apiGroups": ["*"], "resources": ["*"], "verbs": verbs}]);
    let _but_patch = Grant::new(
        &admin,
        "footprint-all-but-patch",
        everything(&["get", "list", "watch", "create", "update", "delete"]),
        &sa,
    )
    .await;
    let patch = Grant::new(&admin, "footprint-patch", everything(&["patch"]), &sa).await;

    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let log = dir.path.join("agent.log");
    let _agent = Killed(
        Command::new(env!("CARGO_BIN_EXE_nodeguard"))
            .args(["run", "--node-name", &node.name])
            .arg(format!("--listen={addr}"))
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .arg("--state-dir")
            .arg(dir.path.join("state"))
            .arg(format!("--allow-read-path={}", dir.path.display()))
            .env("RUST_LOG", "info")
            .env_remove("NODEGUARD_KEEP_EXECUTABLE_PAGES")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    eventually(
        Duration::from_secs(30),
        "the agent ready, AppBroken written",
        || async {
            is_ready(addr).await && condition_is(&admin, &node.name, "AppBroken", "False").await
        },
    )
    .await;
    let ready_at = Instant::now();

    // 1. The problem found, its write refused until 130 s after ready.
    patch.unbind().await;
    {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&app_log)
            .unwrap();
        writeln!(f, "app crashed: disk full").unwrap();
    }
    no_release(
        &log,
        ready_at,
        Duration::from_secs(130),
        "its writes were refused",
    )
    .await;
    assert!(is_ready(addr).await, "the agent stays ready");
    let (_, metrics) = http_get(addr, "/metrics").await;
    let refused = sample(
        &metrics,
        "nodeguard_api_write_errors_total{resource=\"nodes/status\"}",
    )
    .unwrap_or(0.0);
    assert!(
        refused >= 10.0,
        "its write was refused all along (the test's premise): {refused} failed"
    );

    // 2. The write through, then the API server away for 80 s.
    patch.bind().await;
    eventually(
        Duration::from_secs(20),
        "AppBroken=True written once PATCH is allowed",
        || async { condition_is(&admin, &node.name, "AppBroken", "True").await },
    )
    .await;
    let before = write_errors(addr).await;
    let down = Outage::begin("kube-apiserver");
    let down_at = Instant::now();
    no_release(
        &log,
        down_at,
        Duration::from_secs(80),
        "the API server was down",
    )
    .await;
    assert!(
        is_ready(addr).await,
        "the agent stays ready while the API server is away (the test's premise)"
    );
    assert_eq!(
        write_errors(addr).await,
        before,
        "no write failed while the API server was away (the test's premise)"
    );
    down.end();
    let back_at = Instant::now();
    eventually(
        Duration::from_secs(120),
        "the release once the API server is back",
        || {
            std::future::ready(
                std::fs::read_to_string(&log)
                    .unwrap_or_default()
                    .contains(RELEASED),
            )
        },
    )
    .await;
    eprintln!(
        "released {:?} after the API server was back",
        back_at.elapsed()
    );
    delete_policy(&admin, &policy).await;
}
