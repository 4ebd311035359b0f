//! A systemd notify socket for tests: what the agent sends to
//! `NOTIFY_SOCKET` (READY=1, WATCHDOG=1, STOPPING=1), with when.

use std::os::unix::net::UnixDatagram;
use std::time::Instant;

use super::TempDir;

/// Collects notifications from a bound datagram socket on a thread.
pub struct NotifySocket {
    pub path: std::path::PathBuf,
    received: std::sync::Arc<std::sync::Mutex<Vec<(Instant, String)>>>,
    _dir: TempDir,
}

impl NotifySocket {
    pub fn bind() -> Self {
        let dir = TempDir::new("notify");
        let path = dir.path.join("notify.sock");
        let sock = UnixDatagram::bind(&path).unwrap();
        let received = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = received.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = sock.recv(&mut buf) {
                let text = String::from_utf8_lossy(&buf[..n]).into_owned();
                for line in text.lines() {
                    sink.lock()
                        .unwrap()
                        .push((Instant::now(), line.to_string()));
                }
            }
        });
        NotifySocket {
            path,
            received,
            _dir: dir,
        }
    }

    /// When each notification `what` (such as `WATCHDOG=1`) arrived.
    pub fn times(&self, what: &str) -> Vec<Instant> {
        self.received
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, m)| m == what)
            .map(|(t, _)| *t)
            .collect()
    }
}

/// An agent under a 2 s systemd watchdog, notifying a socket of its own,
/// once it said READY=1 and runs `policy` (its first generation); it
/// reaches the API server through `client`.
pub async fn agent_under_systemd_watchdog(
    client: kube::Client,
    admin: &kube::Client,
    node: &str,
    policy: &str,
) -> (nodeguard::agent::RunningAgent, TempDir, NotifySocket) {
    let socket = NotifySocket::bind();
    let path = socket.path.display().to_string();
    let (agent, state) = super::start_agent_with(client, node, |c| {
        c.notify_socket = Some(path);
        c.systemd_watchdog = Some(std::time::Duration::from_secs(2));
    })
    .await;
    super::eventually(
        std::time::Duration::from_secs(20),
        "READY=1 and the policy in force",
        || async {
            !socket.times("READY=1").is_empty()
                && super::effective_policies(admin, node).await == Some(format!("{policy}@1"))
        },
    )
    .await;
    (agent, state, socket)
}

/// The systemd pets the agent at `addr` skipped because the API server did
/// not answer (`None`: no such series in its /metrics).
pub async fn api_server_skips(addr: std::net::SocketAddr) -> Option<f64> {
    let (_, metrics) = super::http_get(addr, "/metrics").await;
    super::sample(
        &metrics,
        "nodeguard_watchdog_skipped_pets_total{target=\"systemd\",reason=\"api_server_unreachable\"}",
    )
}
