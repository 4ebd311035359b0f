//! Running a host command, for exec probes and plugin monitors: in its own
//! process group, with a timeout, its output bounded, and what it leaves
//! behind reaped; under the command root when there is one.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncReadExt;

/// Why a command could not be run (not how it ended: see [`Ran`]).
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error("no command")]
    Empty,
    #[error("cannot run {program}{root}: {source}")]
    Spawn {
        program: String,
        /// ` in the node's root <dir>` under a command root, else empty.
        root: String,
        source: std::io::Error,
    },
    #[error(
        "{program}{root} is {resolved}, which this node does not allow (node-local setting --allow-command): a link may not lead out of what is allowed"
    )]
    Refused {
        program: String,
        root: String,
        resolved: String,
    },
    #[error("waiting for {program}: {source}")]
    Wait {
        program: String,
        source: std::io::Error,
    },
}

/// How a command ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ran {
    /// Exited (`code` `None`: killed by a signal). `output`: stdout, or
    /// stderr when stdout is empty; `stdout`: stdout alone (what
    /// node-problem-detector keeps). Both trimmed; the caller cuts them to
    /// what it keeps.
    Exited {
        code: Option<i32>,
        output: String,
        stdout: String,
    },
    /// Ran past its timeout, and its whole process group was killed.
    /// `code`: the command's own exit code when it had exited before and
    /// what it started held its output open (`None`: the kill ended it);
    /// `stdout`: what it wrote until then, trimmed.
    TimedOut { code: Option<i32>, stdout: String },
}

/// Where commands run (`--command-root`): in the agent's own file system,
/// or changed into a root directory first (chroot(2), then `/` as their
/// working directory), so that a command's path, a script's interpreter
/// (`#!/bin/bash`) and every program and file it uses are the root's. The
/// chart mounts the node's root file system read-only there, so scripts
/// written for the node (node-problem-detector's plugins) run with the
/// node's own shell and tools, as from a process on the node.
///
/// It also holds the node-local allowed commands (`--allow-command`): the
/// policy's paths are judged as written when a policy is selected, and a
/// command is judged again here on the file exec will run, its links
/// resolved (under the root), so a link under an allowed directory that
/// leads to `/bin/bash` runs nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CommandRoot {
    root: Option<Arc<Path>>,
    /// `None` (tests of one module): not judged again.
    allowed: Option<Arc<[String]>>,
}

/// The search path of commands run in the node's root: the usual one of a
/// root shell (the image's own, `/usr/bin:/bin`, lacks the sbin
/// directories, where `iptables-save`, `sysctl` and `fsck` live).
pub const NODE_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

impl CommandRoot {
    /// `root` `None`: the agent's own file system. `allowed`: the node's
    /// `--allow-command` entries.
    pub fn new(root: Option<PathBuf>, allowed: Vec<String>) -> Self {
        CommandRoot {
            root: root.map(Arc::from),
            allowed: Some(allowed.into()),
        }
    }

    pub fn path(&self) -> Option<&Path> {
        self.root.as_deref()
    }

    /// How a message names it: ` in the node's root /host`, or nothing.
    fn said(&self) -> String {
        match &self.root {
            Some(root) => format!(" in the node's root {}", root.display()),
            None => String::new(),
        }
    }

    /// `program` judged on the file it is, its links resolved (under the
    /// root): it, or an allowed entry resolved the same way, must be
    /// allowed. A program that is not there is for exec to say.
    fn judge(&self, program: &str) -> Result<(), CommandError> {
        let Some(allowed) = &self.allowed else {
            return Ok(());
        };
        let root = self.path();
        let resolved = match resolve(root, program) {
            Ok(resolved) => resolved,
            // Not there: exec says so.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            // What it is cannot be told: it does not run.
            Err(e) => {
                return Err(CommandError::Refused {
                    program: program.to_string(),
                    root: self.said(),
                    resolved: format!("not to be resolved ({e})"),
                });
            }
        };
        if resolved == program {
            return Ok(());
        }
        let mut entries: Vec<String> = allowed.to_vec();
        for entry in allowed.iter() {
            let (body, dir) = match entry.strip_suffix('/') {
                Some(body) => (body, "/"),
                None => (entry.as_str(), ""),
            };
            if let Ok(r) = resolve(root, body) {
                entries.push(format!("{}{dir}", r.trim_end_matches('/')));
            }
        }
        if crate::policy::trust::listed(&entries, &resolved) {
            Ok(())
        } else {
            Err(CommandError::Refused {
                program: program.to_string(),
                root: self.said(),
                resolved,
            })
        }
    }
}

/// `path` with every link resolved, as a path of `root` (links resolve
/// inside it, as they do for a process changed into it: an absolute link
/// starts again at the root, `..` stops there), or of this file system.
/// Done here component by component (as openat2's RESOLVE_IN_ROOT would,
/// which kernels before 5.6 and older seccomp profiles lack).
fn resolve(root: Option<&Path>, path: &str) -> std::io::Result<String> {
    let Some(root) = root else {
        return Ok(std::fs::canonicalize(path)?.to_string_lossy().into_owned());
    };
    let mut done: Vec<std::ffi::OsString> = Vec::new();
    let mut todo: Vec<std::ffi::OsString> = components_of(Path::new(path));
    todo.reverse();
    let mut links = 0;
    while let Some(c) = todo.pop() {
        if c == ".." {
            done.pop();
            continue;
        }
        let mut here = root.to_path_buf();
        here.extend(&done);
        here.push(&c);
        let meta = std::fs::symlink_metadata(&here)?;
        if meta.file_type().is_symlink() {
            links += 1;
            if links > 40 {
                return Err(std::io::Error::other("too many levels of links"));
            }
            let target = std::fs::read_link(&here)?;
            if target.is_absolute() {
                done.clear();
            }
            let mut more = components_of(&target);
            more.reverse();
            todo.extend(more);
        } else {
            done.push(c);
        }
    }
    let mut out = String::new();
    for c in &done {
        out.push('/');
        out.push_str(&c.to_string_lossy());
    }
    if out.is_empty() {
        out.push('/');
    }
    Ok(out)
}

/// A path's normal and `..` components (`.` and the root dropped).
fn components_of(path: &Path) -> Vec<std::ffi::OsString> {
    use std::path::Component;
    path.components()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(n.to_os_string()),
            Component::ParentDir => Some("..".into()),
            _ => None,
        })
        .collect()
}

/// Runs a host command with a timeout, capturing its output (bounded, so a
/// chatty command cannot exhaust memory).
pub async fn run_command(
    command: &[String],
    timeout: Duration,
    root: &CommandRoot,
) -> Result<Ran, CommandError> {
    let Some((program, args)) = command.split_first() else {
        return Err(CommandError::Empty);
    };
    let spawn_error = |source: std::io::Error| CommandError::Spawn {
        program: program.clone(),
        root: root.said(),
        // There, but exec says "not found": its #! interpreter is missing
        // (a node without bash, a script saved with CRLF line ends).
        source: if source.kind() == std::io::ErrorKind::NotFound
            && resolve(root.path(), program).is_ok()
        {
            std::io::Error::new(
                source.kind(),
                "it is there, but what runs it is not: its interpreter (its #! line) or, for a dynamically linked program, its loader and libraries",
            )
        } else {
            source
        },
    };
    root.judge(program)?;
    let mut cmd = tokio::process::Command::new(program);
    // Its own process group: what the command starts (a script's
    // children) is ended with it.
    cmd.args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    if let Some(dir) = root.path() {
        cmd.env("PATH", NODE_PATH);
        let dir = CString::new(dir.as_os_str().as_bytes()).map_err(|_| {
            spawn_error(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "the command root has a NUL byte",
            ))
        })?;
        // SAFETY: runs in the forked child before exec, and only makes two
        // system calls (async-signal-safe) on memory allocated before the
        // fork. The program's path is then looked up under the root.
        unsafe {
            cmd.pre_exec(move || {
                if libc::chroot(dir.as_ptr()) != 0 || libc::chdir(c"/".as_ptr()) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    // SAFETY: runs in the forked child before exec (after the chroot
    // above, when there is one) and only makes system calls.
    unsafe {
        cmd.pre_exec(marking_for_exec());
    }
    let mut child = cmd.spawn().map_err(spawn_error)?;
    let group = EndGroup(child.id());
    let mut stdout = child.stdout.take().expect("piped");
    let mut stderr = child.stderr.take().expect("piped");
    let deadline = tokio::time::Instant::now() + timeout;
    let read = async { tokio::join!(read_capped(&mut stdout), read_capped(&mut stderr)) };
    let mut read = std::pin::pin!(read);
    // Its output until the pipes close (every writer gone), then its exit,
    // both within the timeout. Past it, the whole group is killed (as
    // node-problem-detector does), which closes the pipes: what it wrote
    // is still read, and its exit status is what it was (a command that
    // had exited while what it started kept its output open keeps its
    // code, as in node-problem-detector).
    let (out, err, ended) = match tokio::time::timeout_at(deadline, &mut read).await {
        Ok((out, err)) => match tokio::time::timeout_at(deadline, child.wait()).await {
            Ok(status) => (out, err, Some(status)),
            Err(_) => {
                group.kill();
                (out, err, None)
            }
        },
        Err(_) => {
            group.kill();
            let (out, err) = tokio::time::timeout(REAP_WAIT, &mut read)
                .await
                .unwrap_or_default();
            (out, err, None)
        }
    };
    let Some(status) = ended else {
        let code = match tokio::time::timeout(REAP_WAIT, child.wait()).await {
            Ok(Ok(status)) => status.code(),
            _ => None,
        };
        group.reap().await;
        return Ok(Ran::TimedOut {
            code,
            stdout: String::from_utf8_lossy(&out).trim().to_string(),
        });
    };
    // Exited: what it left running goes on (as with node-problem-
    // detector); what of it has ended already is reaped.
    group.reap_ended();
    let status = status.map_err(|source| CommandError::Wait {
        program: program.clone(),
        source,
    })?;
    let stdout = String::from_utf8_lossy(&out).trim().to_string();
    let output = if stdout.is_empty() {
        String::from_utf8_lossy(&err).trim().to_string()
    } else {
        stdout.clone()
    };
    Ok(Ran::Exited {
        code: status.code(),
        output,
        stdout,
    })
}

/// For a forked child, before its exec: `cmd.pre_exec(marking_for_exec())`
/// makes every descriptor from 3 up close-on-exec, so the program starts
/// with its standard streams only. The agent opens its own descriptors
/// close-on-exec, but not every library does: zbus receives logind's delay
/// inhibitor without it and keeps that copy until its message is dropped,
/// and a child forked in that moment would hold the lock for its whole life
/// (journalctl follows for hours), so a shutdown would wait logind's whole
/// InhibitDelayMaxSec after the agent released it.
///
/// One close_range(2) where it takes CLOSE_RANGE_CLOEXEC (Linux 5.11, and a
/// seccomp profile that allows it). Elsewhere, fcntl(2) on each descriptor
/// up to 64 above the highest this process has open now (one opened
/// meanwhile takes the lowest free number), read here, in the parent. The
/// child makes system calls only: async-signal-safe.
pub(crate) fn marking_for_exec() -> impl FnMut() -> std::io::Result<()> + Send + Sync + 'static {
    let below = (!close_range_marks()).then(each_bound);
    move || {
        match below {
            None if close_range_cloexec(3) == 0 => {}
            None => mark_each_below(65_536),
            Some(below) => mark_each_below(below),
        }
        Ok(())
    }
}

/// close_range(first, ~0, CLOSE_RANGE_CLOEXEC): 0, or -1 with errno set.
fn close_range_cloexec(first: libc::c_uint) -> libc::c_long {
    // SAFETY: marks descriptors of this process's own table close-on-exec;
    // nothing is closed.
    unsafe {
        libc::syscall(
            libc::SYS_close_range,
            first,
            libc::c_uint::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        )
    }
}

/// Whether close_range takes CLOSE_RANGE_CLOEXEC here: asked once, on a
/// range that holds no descriptor, and said once when it does not.
fn close_range_marks() -> bool {
    static MARKS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *MARKS.get_or_init(|| {
        if close_range_cloexec(libc::c_uint::MAX) == 0 {
            return true;
        }
        tracing::info!(
            error = %std::io::Error::last_os_error(),
            "close_range(2) cannot mark descriptors close-on-exec here (Linux before 5.11, or a seccomp profile without it): each command's descriptors are marked one by one"
        );
        false
    })
}

/// 64 above the highest descriptor this process has open; without
/// /proc, the soft RLIMIT_NOFILE, at most 65,536.
fn each_bound() -> libc::c_int {
    let highest = std::fs::read_dir("/proc/self/fd").ok().and_then(|d| {
        d.flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<libc::c_int>().ok())
            .max()
    });
    if let Some(h) = highest {
        return h.saturating_add(64);
    }
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit fills the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0 {
        limit.rlim_cur.min(65_536) as libc::c_int
    } else {
        65_536
    }
}

/// fcntl(F_SETFD, FD_CLOEXEC) on each descriptor from 3 below `below`.
fn mark_each_below(below: libc::c_int) {
    for fd in 3..below {
        // SAFETY: fcntl on a descriptor number; one not open is EBADF.
        unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFD);
            if flags >= 0 && flags & libc::FD_CLOEXEC == 0 {
                libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC);
            }
        }
    }
}

/// How long the end of a command's process group is waited for.
const REAP_WAIT: Duration = Duration::from_secs(2);

/// The process group of one command (its pid; `None` once it was reaped
/// before its id was read, or once it was dealt with). Dropped before that
/// (a cancelled run), it kills the group and reaps it.
struct EndGroup(Option<u32>);

impl EndGroup {
    /// SIGKILL to every process of the group.
    fn kill(&self) {
        if let Some(pgid) = self.0 {
            kill_group(pgid);
        }
    }

    /// Reaps the group's processes handed to this process, waiting (up to
    /// [`REAP_WAIT`]) for those still ending. After [`EndGroup::kill`].
    async fn reap(mut self) {
        if let Some(pgid) = self.0.take() {
            reap_group(pgid).await;
        }
    }

    /// Reaps those of the group's processes handed to this process that
    /// have ended, without waiting for the others.
    fn reap_ended(mut self) {
        if let Some(pgid) = self.0.take() {
            while reap_one(pgid) > 0 {}
        }
    }
}

impl Drop for EndGroup {
    fn drop(&mut self) {
        if let Some(pgid) = self.0.take() {
            kill_group(pgid);
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(reap_group(pgid));
            }
        }
    }
}

fn kill_group(pgid: u32) {
    // SAFETY: a signal to the group one run created. Its id is the
    // command's pid, held while the command is unreaped or the group has a
    // member, and otherwise reused only after the pids wrapped around.
    unsafe {
        libc::kill(-(pgid as libc::pid_t), libc::SIGKILL);
    }
}

/// Reaps the group's processes that were handed to this process: when the
/// agent is PID 1 of its container (without the chart's shared process
/// namespace) or a subreaper, a command's orphans become its children, and
/// unreaped they stay zombies. Only this group's: tokio reaps the children
/// it spawned.
async fn reap_group(pgid: u32) {
    let deadline = tokio::time::Instant::now() + REAP_WAIT;
    loop {
        match reap_one(pgid) {
            r if r > 0 => continue,
            // Members not ended yet (the signal is on its way).
            0 if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(10)).await
            }
            // None left that is ours (ECHILD), or out of time.
            _ => return,
        }
    }
}

/// One `waitpid` of the group, without blocking: a pid reaped, 0 while
/// members of ours are still running, -1 when none is ours.
fn reap_one(pgid: u32) -> libc::pid_t {
    let mut status = 0;
    // SAFETY: waitpid on one run's process group, without blocking.
    unsafe { libc::waitpid(-(pgid as libc::pid_t), &mut status, libc::WNOHANG) }
}

/// Reads up to 64 KiB, then drains the rest so the child never blocks on
/// a full pipe.
async fn read_capped<R: tokio::io::AsyncRead + Unpin>(r: &mut R) -> Vec<u8> {
    let mut buf = Vec::new();
    let _ = r.take(64 * 1024).read_to_end(&mut buf).await;
    let _ = tokio::io::copy(r, &mut tokio::io::sink()).await;
    buf
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A descriptor open without close-on-exec in the agent reaches the
    /// program unless marked, and either way of marking (close_range, or
    /// each descriptor up to the bound, for kernels before 5.11) keeps it
    /// out. This machine's kernel (and qemu-aarch64's) takes
    /// CLOSE_RANGE_CLOEXEC, so the first way is the one tested.
    #[test]
    fn a_descriptor_without_close_on_exec_reaches_no_program_once_marked() {
        use std::os::fd::AsRawFd;
        use std::os::unix::process::CommandExt;
        assert!(
            close_range_marks(),
            "close_range(2) with CLOSE_RANGE_CLOEXEC: this test bed needs Linux 5.11 or later"
        );
        for way in ["unmarked", "close_range", "each"] {
            let (read, write) = std::io::pipe().unwrap();
            let ino = crate::pipes::inode(&std::os::fd::OwnedFd::from(read));
            let fd = write.as_raw_fd();
            let below = each_bound();
            let mut cmd = std::process::Command::new("/bin/sh");
            cmd.args(["-c", "ls -l /proc/$$/fd"]);
            // SAFETY: fcntl, and the marking (system calls only), in the
            // child before its exec. The parent's write end stays
            // close-on-exec, so no other test's child gets it.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    match way {
                        "close_range" if close_range_cloexec(3) != 0 => {
                            return Err(std::io::Error::last_os_error());
                        }
                        "each" => mark_each_below(below),
                        _ => {}
                    }
                    Ok(())
                });
            }
            let out = cmd.output().unwrap();
            assert!(out.status.success(), "{way}: {out:?}");
            let listed = String::from_utf8_lossy(&out.stdout);
            assert_eq!(
                listed.contains(&crate::pipes::link(ino)),
                way == "unmarked",
                "{way}: {listed}"
            );
            drop(write);
        }
    }

    /// Links resolve inside the root, as for a process changed into it:
    /// an absolute link is the root's path, `..` stops at the root.
    #[test]
    fn a_path_resolves_inside_the_root() {
        let root = std::env::temp_dir().join(format!("ng-resolve-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("bin")).unwrap();
        std::fs::create_dir_all(root.join("plugins")).unwrap();
        std::fs::write(root.join("bin/bash"), "").unwrap();
        std::os::unix::fs::symlink("/bin", root.join("plugins/tools")).unwrap();
        std::os::unix::fs::symlink("../../../../bin", root.join("plugins/up")).unwrap();
        let r = Some(root.as_path());
        assert_eq!(resolve(r, "/plugins/tools/bash").unwrap(), "/bin/bash");
        assert_eq!(resolve(r, "/plugins/up/bash").unwrap(), "/bin/bash");
        assert_eq!(resolve(r, "/bin/bash").unwrap(), "/bin/bash");
        assert!(resolve(r, "/plugins/none").is_err());
        let judge = |allowed: &[&str], program: &str| {
            CommandRoot::new(
                Some(root.clone()),
                allowed.iter().map(|s| s.to_string()).collect(),
            )
            .judge(program)
        };
        assert!(matches!(
            judge(&["/plugins/"], "/plugins/tools/bash"),
            Err(CommandError::Refused { resolved, .. }) if resolved == "/bin/bash"
        ));
        assert!(judge(&["/plugins/", "/bin/bash"], "/plugins/tools/bash").is_ok());
        // An allowed entry that is a link allows what it leads to.
        assert!(judge(&["/plugins/tools/"], "/plugins/tools/bash").is_ok());
        assert!(
            judge(&["/plugins/"], "/plugins/none").is_ok(),
            "exec says it"
        );
        // What cannot be resolved (a file taken for a directory) runs not.
        assert!(matches!(
            judge(&["/plugins/"], "/plugins/tools/bash/x"),
            Err(CommandError::Refused { .. })
        ));
        // A loop of links.
        std::os::unix::fs::symlink("/plugins/loop", root.join("plugins/loop")).unwrap();
        assert!(resolve(r, "/plugins/loop").is_err());
        let _ = std::fs::remove_dir_all(&root);
    }
}
