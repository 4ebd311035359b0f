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
