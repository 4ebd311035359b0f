//! The systemd notification adapter (`READY=1`, `WATCHDOG=1`,
//! `STOPPING=1`), sending sd-notify's messages to an explicit socket so the
//! agent (and its tests) never depend on process-global environment after
//! start-up. Abstract sockets (`@name`) are supported as systemd uses them.

use std::io;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::path::PathBuf;

use sd_notify::NotifyState;

use super::NotifyPort;

/// `NOTIFY_SOCKET`, read once at start-up.
#[derive(Clone, Debug)]
pub struct SystemdNotifier {
    socket: String,
}

impl SystemdNotifier {
    /// `None` when there is no service manager to notify.
    pub fn new(notify_socket: Option<String>) -> Option<Self> {
        notify_socket
            .filter(|s| !s.is_empty())
            .map(|socket| SystemdNotifier { socket })
    }

    pub fn socket(&self) -> &str {
        &self.socket
    }
}

/// The wire form of a notification: one `KEY=value` per line.
pub fn message(states: &[NotifyState<'_>]) -> String {
    states.iter().map(|s| format!("{s}\n")).collect()
}

impl NotifyPort for SystemdNotifier {
    fn notify(&self, states: &[NotifyState<'_>]) -> io::Result<()> {
        let msg = message(states);
        let sock = UnixDatagram::unbound()?;
        let sent = match self.socket.strip_prefix('@') {
            Some(name) => sock.send_to_addr(
                msg.as_bytes(),
                &SocketAddr::from_abstract_name(name.as_bytes())?,
            )?,
            None => sock.send_to(msg.as_bytes(), PathBuf::from(&self.socket))?,
        };
        if sent != msg.len() {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "short write to NOTIFY_SOCKET",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_key_value_lines() {
        assert_eq!(message(&[NotifyState::Ready]), "READY=1\n");
        assert_eq!(
            message(&[NotifyState::Watchdog, NotifyState::Status("ok")]),
            "WATCHDOG=1\nSTATUS=ok\n"
        );
        assert_eq!(message(&[NotifyState::Stopping]), "STOPPING=1\n");
    }

    #[test]
    fn sends_to_a_path_and_to_an_abstract_socket() {
        let dir = std::env::temp_dir().join(format!("ng-notify-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("notify.sock");
        let server = UnixDatagram::bind(&path).unwrap();
        let n = SystemdNotifier::new(Some(path.display().to_string())).unwrap();
        n.notify(&[NotifyState::Watchdog]).unwrap();
        let mut buf = [0u8; 64];
        let len = server.recv(&mut buf).unwrap();
        assert_eq!(&buf[..len], b"WATCHDOG=1\n");
        std::fs::remove_dir_all(&dir).unwrap();

        let name = format!("nodeguard-test-{}", std::process::id());
        let server =
            UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap())
                .unwrap();
        let n = SystemdNotifier::new(Some(format!("@{name}"))).unwrap();
        n.notify(&[NotifyState::Ready]).unwrap();
        let len = server.recv(&mut buf).unwrap();
        assert_eq!(&buf[..len], b"READY=1\n");
        assert!(SystemdNotifier::new(Some(String::new())).is_none());
        assert!(SystemdNotifier::new(None).is_none());
    }

    #[test]
    fn a_missing_socket_is_an_error() {
        let n = SystemdNotifier::new(Some("/nonexistent/notify.sock".into())).unwrap();
        assert!(n.notify(&[NotifyState::Watchdog]).is_err());
    }
}
