//! Keeping the delay inhibitor beyond the agent's own process.
//!
//! logind lets a shutdown go on as soon as the last copy of a delay
//! inhibitor's descriptor is closed. An agent killed during a shutdown
//! (SIGKILL, the OOM killer, a crash) loses its copy with its process, and
//! logind would power off at once: the remaining priority groups never run.
//! So the agent leaves a copy with a *keeper* that outlives it, takes it
//! back when it starts again, and takes it out of the keeper when it
//! releases the lock itself:
//!
//! - **systemd** (host mode): the service's file descriptor store
//!   (`FDSTORE=1`, needs `FileDescriptorStoreMax=` in the unit); systemd
//!   hands the copy back to the restarted service in `LISTEN_FDS`.
//! - **`nodeguard keep`** (the DaemonSet): a sidecar in the agent's pod,
//!   reached over a Unix socket in a volume both share. It survives the
//!   agent container's restarts and stops only after the agent's container
//!   during the pod's termination.
//!
//! A keeper holds at most one descriptor per name; keeping a new one
//! closes the old. Every call is a short local exchange with a timeout.

use std::collections::BTreeMap;
use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::{UnixDatagram, UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

/// The name the delay inhibitor is kept under.
pub const INHIBITOR: &str = "logind-inhibitor";

/// How long one exchange with a keeper may take.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(1);

/// Longest request or reply line.
const MAX_LINE: usize = 256;

/// Most names a `nodeguard keep` holds (it serves one agent).
const MAX_NAMES: usize = 8;

/// Where a copy of the inhibitor outlives the agent's process.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Keeper {
    /// Nowhere: the lock goes with the process.
    #[default]
    None,
    /// systemd's file descriptor store, through this `NOTIFY_SOCKET`.
    Systemd { notify_socket: String },
    /// `nodeguard keep` listening on this Unix socket.
    Socket(PathBuf),
}

impl std::fmt::Display for Keeper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Keeper::None => write!(f, "no keeper"),
            Keeper::Systemd { .. } => write!(f, "systemd's file descriptor store"),
            Keeper::Socket(p) => write!(f, "nodeguard keep at {}", p.display()),
        }
    }
}

impl Keeper {
    /// Leaves a copy of `fd` with the keeper under `name` (replacing what
    /// it held under that name).
    pub fn keep(&self, name: &str, fd: BorrowedFd<'_>) -> io::Result<()> {
        match self {
            Keeper::None => Ok(()),
            Keeper::Systemd { notify_socket } => {
                // systemd removes by name; storing again under the same
                // name would keep both.
                notify(
                    notify_socket,
                    &format!("FDSTOREREMOVE=1\nFDNAME={name}\n"),
                    None,
                )?;
                notify(
                    notify_socket,
                    &format!("FDSTORE=1\nFDNAME={name}\n"),
                    Some(fd),
                )
            }
            Keeper::Socket(path) => request(path, &format!("keep {name}"), Some(fd)).map(|_| ()),
        }
    }

    /// Takes `name` out of the keeper, which closes its copy.
    pub fn forget(&self, name: &str) -> io::Result<()> {
        match self {
            Keeper::None => Ok(()),
            Keeper::Systemd { notify_socket } => notify(
                notify_socket,
                &format!("FDSTOREREMOVE=1\nFDNAME={name}\n"),
                None,
            ),
            Keeper::Socket(path) => request(path, &format!("forget {name}"), None).map(|_| ()),
        }
    }

    /// A copy of what the keeper holds under `name`; the keeper keeps its
    /// own. systemd's store is read once at start ([`from_listen_fds`]),
    /// so here it has nothing.
    pub fn reclaim(&self, name: &str) -> io::Result<Option<OwnedFd>> {
        match self {
            Keeper::None | Keeper::Systemd { .. } => Ok(None),
            Keeper::Socket(path) => request(path, &format!("reclaim {name}"), None),
        }
    }
}

/// The keeper this process uses and the inhibitor a killed predecessor
/// left with it: `nodeguard keep` at `socket` when given, else systemd's
/// store when there is a `notify_socket`. Call once, before any other
/// thread starts: whatever systemd passed is taken close-on-exec (or
/// closed), so no probe or plugin inherits it.
pub fn at_start(socket: Option<&Path>, notify_socket: Option<&str>) -> (Keeper, Option<OwnedFd>) {
    let env = |k: &str| std::env::var(k).ok();
    let from_systemd = from_listen_fds(
        INHIBITOR,
        env("LISTEN_PID").as_deref(),
        env("LISTEN_FDS").as_deref(),
        env("LISTEN_FDNAMES").as_deref(),
    );
    match (socket, notify_socket) {
        (Some(path), _) => {
            let keeper = Keeper::Socket(path.to_path_buf());
            let fd = match keeper.reclaim(INHIBITOR) {
                Ok(fd) => fd,
                // The sidecar may still be binding its socket on the pod's
                // first start, when there is nothing to take back.
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused
                    ) =>
                {
                    tracing::info!(%keeper, error = %e, "no keeper yet; nothing to take back");
                    None
                }
                Err(e) => {
                    tracing::warn!(%keeper, error = %e, "cannot ask the keeper for a delay inhibitor left by a previous process");
                    None
                }
            };
            (keeper, fd)
        }
        (None, Some(notify_socket)) if !notify_socket.is_empty() => (
            Keeper::Systemd {
                notify_socket: notify_socket.to_string(),
            },
            from_systemd,
        ),
        _ => (Keeper::None, None),
    }
}

/// The descriptor systemd passed back under `name` (`LISTEN_FDS`,
/// `LISTEN_FDNAMES`, for this process by `LISTEN_PID`). Call once, before
/// any other thread starts: the others are closed.
pub fn from_listen_fds(
    name: &str,
    listen_pid: Option<&str>,
    listen_fds: Option<&str>,
    listen_fdnames: Option<&str>,
) -> Option<OwnedFd> {
    let pid: u32 = listen_pid?.trim().parse().ok()?;
    if pid != std::process::id() {
        return None;
    }
    let n: i32 = listen_fds?.trim().parse().ok()?;
    let names: Vec<&str> = listen_fdnames.unwrap_or_default().split(':').collect();
    let mut found = None;
    for i in 0..n.clamp(0, 64) {
        let raw = 3 + i;
        // SAFETY: systemd passes descriptors 3.. LISTEN_FDS to this
        // process (LISTEN_PID checked above) and nothing else owns them.
        let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
        let _ = rustix::io::fcntl_setfd(&fd, rustix::io::FdFlags::CLOEXEC);
        if found.is_none() && names.get(i as usize) == Some(&name) {
            found = Some(fd);
        }
    }
    found
}

/// One datagram to systemd's notify socket, with `fd` attached.
fn notify(socket: &str, message: &str, fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
    let sock = UnixDatagram::unbound()?;
    match socket.strip_prefix('@') {
        Some(name) => {
            use std::os::linux::net::SocketAddrExt;
            sock.connect_addr(&std::os::unix::net::SocketAddr::from_abstract_name(
                name.as_bytes(),
            )?)?
        }
        None => sock.connect(socket)?,
    }
    send(&sock, message.as_bytes(), fd)
}

fn send(sock: &impl AsFd, bytes: &[u8], fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds: Vec<BorrowedFd<'_>> = fd.into_iter().collect();
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(io::Error::other("no room for the descriptor"));
    }
    let sent = rustix::net::sendmsg(
        sock,
        &[IoSlice::new(bytes)],
        &mut control,
        SendFlags::empty(),
    )?;
    if sent != bytes.len() {
        return Err(io::Error::new(io::ErrorKind::WriteZero, "short write"));
    }
    Ok(())
}

/// One message and the descriptor that came with it (close-on-exec from
/// the start, so no child process of the agent inherits it).
fn receive(sock: &impl AsFd) -> io::Result<(String, Option<OwnedFd>)> {
    let mut bytes = [0u8; MAX_LINE];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = rustix::net::recvmsg(
        sock,
        &mut [IoSliceMut::new(&mut bytes)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    let mut fd = None;
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = m {
            for f in fds {
                // More than one: keep the first, close the rest.
                fd.get_or_insert(f);
            }
        }
    }
    let text = String::from_utf8_lossy(&bytes[..got.bytes.min(MAX_LINE)])
        .trim()
        .to_string();
    Ok((text, fd))
}

/// One exchange with `nodeguard keep`: a request line (and a descriptor),
/// then `ok` (with a descriptor for `reclaim`), `none` or `error …`.
fn request(path: &Path, line: &str, fd: Option<BorrowedFd<'_>>) -> io::Result<Option<OwnedFd>> {
    let sock = UnixStream::connect(path)?;
    sock.set_read_timeout(Some(EXCHANGE_TIMEOUT))?;
    sock.set_write_timeout(Some(EXCHANGE_TIMEOUT))?;
    send(&sock, format!("{line}\n").as_bytes(), fd)?;
    let (reply, got) = receive(&sock)?;
    match reply.as_str() {
        "ok" => Ok(got),
        "none" => Ok(None),
        other => Err(io::Error::other(format!(
            "the keeper at {} answered {other:?}",
            path.display()
        ))),
    }
}

/// What a keeper does with one request; its descriptors by name.
#[derive(Debug, Default)]
pub struct Store {
    held: BTreeMap<String, OwnedFd>,
}

/// A keeper's answer: the reply line and a descriptor (a copy of what it
/// keeps) to send with it.
pub type Reply = (String, Option<OwnedFd>);

impl Store {
    /// Serves one request line (with the descriptor that came with it).
    pub fn serve(&mut self, line: &str, fd: Option<OwnedFd>) -> Reply {
        let (verb, name) = line.split_once(' ').unwrap_or((line, ""));
        let name = name.trim();
        if name.is_empty()
            || name.len() > 64
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
        {
            return (format!("error bad name {name:?}"), None);
        }
        match verb {
            "keep" => match fd {
                None => ("error keep without a descriptor".into(), None),
                Some(_) if self.held.len() >= MAX_NAMES && !self.held.contains_key(name) => {
                    (format!("error already holding {MAX_NAMES} names"), None)
                }
                Some(fd) => {
                    self.held.insert(name.to_string(), fd);
                    ("ok".into(), None)
                }
            },
            "forget" => {
                self.held.remove(name);
                ("ok".into(), None)
            }
            "reclaim" => match self.held.get(name).map(OwnedFd::try_clone) {
                Some(Ok(fd)) => ("ok".into(), Some(fd)),
                Some(Err(e)) => (format!("error {e}"), None),
                None => ("none".into(), None),
            },
            _ => (format!("error unknown request {verb:?}"), None),
        }
    }

    /// Names held now.
    pub fn names(&self) -> Vec<&str> {
        self.held.keys().map(String::as_str).collect()
    }
}

/// `nodeguard keep`: serves the socket at `path` until the process ends
/// (its descriptors close with it). Requests come one at a time, each on
/// its own connection.
pub fn serve(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    // PID 1 of its container: the kernel drops SIGTERM unless a handler is
    // installed, and the pod's deletion (or the host's shutdown) would wait
    // out its whole grace. The kubelet signals this sidecar only after the
    // agent's container has exited, so it just ends.
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: the handler only calls _exit, which is async-signal-safe.
        unsafe { libc::signal(sig, exit_now as *const () as libc::sighandler_t) };
    }
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    tracing::info!(socket = %path.display(), "keeping descriptors for the agent");
    let mut store = Store::default();
    for conn in listener.incoming() {
        let conn = match conn {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let _ = conn.set_read_timeout(Some(EXCHANGE_TIMEOUT));
        let _ = conn.set_write_timeout(Some(EXCHANGE_TIMEOUT));
        let (line, fd) = match receive(&conn) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "a request could not be read");
                continue;
            }
        };
        let before = store.names().len();
        let (reply, out) = store.serve(&line, fd);
        if reply.starts_with("error") {
            tracing::warn!(request = %line, %reply, "refused");
        } else if store.names().len() != before || line.starts_with("keep") {
            tracing::info!(request = %line, held = ?store.names(), "done");
        }
        if let Err(e) = send(
            &conn,
            format!("{reply}\n").as_bytes(),
            out.as_ref().map(AsFd::as_fd),
        ) {
            tracing::warn!(error = %e, "the reply could not be sent");
        }
    }
    Ok(())
}

extern "C" fn exit_now(_: libc::c_int) {
    // SAFETY: _exit is async-signal-safe; the descriptors close with us.
    unsafe { libc::_exit(0) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    fn pipe() -> (OwnedFd, OwnedFd) {
        rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap()
    }

    /// Whether this process (the sender, and the keeper serving in a thread
    /// here) holds no write end any more, whatever another test's child
    /// holds until its exec.
    fn all_writers_closed(r: &OwnedFd) -> bool {
        crate::pipes::others_here(r, crate::pipes::inode(r)).is_empty()
    }

    fn serving(name: &str) -> (PathBuf, std::thread::JoinHandle<()>) {
        let dir =
            std::env::temp_dir().join(format!("nodeguard-keep-{name}-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let path = dir.join("keep.sock");
        let p = path.clone();
        let t = std::thread::spawn(move || {
            let _ = serve(&p);
        });
        for _ in 0..100 {
            if UnixStream::connect(&path).is_ok() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        (path, t)
    }

    #[test]
    fn a_kept_descriptor_outlives_the_senders_copy_until_forgotten() {
        let (path, _t) = serving("outlives");
        let keeper = Keeper::Socket(path);
        let (r, w) = pipe();
        keeper.keep(INHIBITOR, w.as_fd()).unwrap();
        drop(w);
        assert!(!all_writers_closed(&r), "the keeper holds a copy");
        let back = keeper.reclaim(INHIBITOR).unwrap().expect("reclaimed");
        let flags = rustix::io::fcntl_getfd(&back).unwrap();
        assert!(
            flags.contains(rustix::io::FdFlags::CLOEXEC),
            "a reclaimed descriptor is close-on-exec"
        );
        drop(back);
        assert!(!all_writers_closed(&r), "reclaim leaves the keeper's copy");
        keeper.forget(INHIBITOR).unwrap();
        assert!(all_writers_closed(&r), "forget closes the keeper's copy");
        assert!(keeper.reclaim(INHIBITOR).unwrap().is_none());
    }

    #[test]
    fn keeping_again_replaces_the_old_copy() {
        let (path, _t) = serving("replace");
        let keeper = Keeper::Socket(path);
        let (r1, w1) = pipe();
        let (r2, w2) = pipe();
        keeper.keep(INHIBITOR, w1.as_fd()).unwrap();
        keeper.keep(INHIBITOR, w2.as_fd()).unwrap();
        drop((w1, w2));
        assert!(all_writers_closed(&r1), "the first lock is not held twice");
        assert!(!all_writers_closed(&r2));
    }

    #[test]
    fn bad_requests_are_refused_by_name() {
        let mut s = Store::default();
        assert!(s.serve("keep", None).0.starts_with("error bad name"));
        assert!(s.serve("keep x", None).0.contains("without a descriptor"));
        assert!(
            s.serve("keep ../x", Some(pipe().1))
                .0
                .starts_with("error bad name")
        );
        assert!(s.serve("steal x", None).0.contains("unknown request"));
        for i in 0..MAX_NAMES {
            assert_eq!(s.serve(&format!("keep n{i}"), Some(pipe().1)).0, "ok");
        }
        assert!(
            s.serve("keep more", Some(pipe().1))
                .0
                .contains("already holding")
        );
        assert_eq!(
            s.serve("keep n0", Some(pipe().1)).0,
            "ok",
            "replacing is fine"
        );
        assert_eq!(s.serve("reclaim nothing", None).0, "none");
    }

    #[test]
    fn no_keeper_answers_a_clear_error() {
        let keeper = Keeper::Socket("/nonexistent/keep.sock".into());
        let (_r, w) = pipe();
        assert!(keeper.keep(INHIBITOR, w.as_fd()).is_err());
        assert!(Keeper::None.keep(INHIBITOR, w.as_fd()).is_ok());
    }

    #[test]
    fn systemd_hands_back_only_this_process_named_descriptor() {
        let me = std::process::id().to_string();
        assert!(from_listen_fds(INHIBITOR, Some("1"), Some("1"), Some(INHIBITOR)).is_none());
        assert!(from_listen_fds(INHIBITOR, Some(&me), Some("0"), Some("")).is_none());
        assert!(from_listen_fds(INHIBITOR, None, Some("1"), Some(INHIBITOR)).is_none());
        // A descriptor at 3.. cannot be arranged in a test process that
        // has others open there; systemd's side runs in the node VM.
    }

    #[test]
    fn systemd_notifications_carry_the_descriptor() {
        let dir = std::env::temp_dir().join(format!("nodeguard-notify-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let path = dir.join("notify.sock");
        let _ = std::fs::remove_file(&path);
        let server = UnixDatagram::bind(&path).unwrap();
        let keeper = Keeper::Systemd {
            notify_socket: path.to_string_lossy().into(),
        };
        let (_r, w) = pipe();
        keeper.keep(INHIBITOR, w.as_fd()).unwrap();
        let (first, none) = receive(&server).unwrap();
        assert_eq!(first, format!("FDSTOREREMOVE=1\nFDNAME={INHIBITOR}"));
        assert!(none.is_none());
        let (second, fd) = receive(&server).unwrap();
        assert_eq!(second, format!("FDSTORE=1\nFDNAME={INHIBITOR}"));
        assert!(fd.is_some_and(|f| f.as_raw_fd() >= 0));
        keeper.forget(INHIBITOR).unwrap();
        assert_eq!(
            receive(&server).unwrap().0,
            format!("FDSTOREREMOVE=1\nFDNAME={INHIBITOR}")
        );
    }
}
