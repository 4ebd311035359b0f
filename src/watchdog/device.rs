//! The watchdog device adapter: open, set and read back the timeout,
//! keep alive, and close with or without the magic character.
//!
//! Writes go to a real file descriptor; the three ioctls go through
//! [`IoctlPort`], so tests use a regular file plus a recording port, and
//! the VM test uses softdog for real.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use super::{IoctlPort, WatchdogError};

// linux/watchdog.h: _IOR('W', 5, int), _IOWR('W', 6, int), _IOR('W', 7, int).
pub const WDIOC_KEEPALIVE: u64 = 0x8004_5705;
pub const WDIOC_SETTIMEOUT: u64 = 0xC004_5706;
pub const WDIOC_GETTIMEOUT: u64 = 0x8004_5707;

/// The real ioctl(2).
#[derive(Debug, Default)]
pub struct SysIoctl;

impl IoctlPort for SysIoctl {
    fn ioctl_int(&mut self, fd: RawFd, request: u64, value: i32) -> io::Result<i32> {
        let mut v: libc::c_int = value;
        // SAFETY: fd is an open descriptor owned by the caller; the watchdog
        // ioctls read or write exactly one int at the pointer.
        let rc = unsafe { libc::ioctl(fd, request as _, &mut v as *mut libc::c_int) };
        if rc < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(v)
        }
    }
}

/// An open, armed watchdog device.
pub struct Device {
    path: PathBuf,
    file: Option<File>,
    ioctl: Box<dyn IoctlPort>,
    timeout_seconds: u32,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("path", &self.path)
            .field("timeout_seconds", &self.timeout_seconds)
            .finish()
    }
}

impl Device {
    /// Opens `path` (which arms most watchdogs), sets the timeout and reads
    /// it back: a driver may round or clamp it.
    pub fn open(
        path: &Path,
        timeout_seconds: u32,
        ioctl: Box<dyn IoctlPort>,
    ) -> Result<Self, WatchdogError> {
        let file = OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(|source| WatchdogError::open(path, source))?;
        let fd = file.as_raw_fd();
        let mut device = Device {
            path: path.to_path_buf(),
            file: Some(file),
            ioctl,
            timeout_seconds,
        };
        let set = device
            .ioctl
            .ioctl_int(fd, WDIOC_SETTIMEOUT, timeout_seconds as i32)
            .map_err(|source| WatchdogError::Ioctl {
                path: path.display().to_string(),
                what: "WDIOC_SETTIMEOUT",
                source,
            })?;
        let read_back = device
            .ioctl
            .ioctl_int(fd, WDIOC_GETTIMEOUT, 0)
            .map_err(|source| WatchdogError::Ioctl {
                path: path.display().to_string(),
                what: "WDIOC_GETTIMEOUT",
                source,
            })?;
        if read_back <= 0 {
            return Err(WatchdogError::TimeoutRejected {
                path: path.display().to_string(),
                wanted: timeout_seconds,
                got: read_back,
            });
        }
        if read_back != set || read_back as u32 != timeout_seconds {
            tracing::warn!(device = %path.display(), wanted = timeout_seconds, got = read_back, "the watchdog driver adjusted the timeout");
        }
        device.timeout_seconds = read_back as u32;
        Ok(device)
    }

    /// The timeout in force, as read back from the driver.
    pub fn timeout_seconds(&self) -> u32 {
        self.timeout_seconds
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One keep-alive.
    pub fn pet(&mut self) -> io::Result<()> {
        let fd = self
            .file
            .as_ref()
            .map(|f| f.as_raw_fd())
            .ok_or(io::ErrorKind::NotConnected)?;
        self.ioctl.ioctl_int(fd, WDIOC_KEEPALIVE, 0).map(|_| ())
    }

    /// Closes the device. With `magic`, writes `V` first so the driver
    /// disarms; without, the timer keeps running and the host resets after
    /// the timeout (fencing).
    pub fn close(mut self, magic: bool) -> io::Result<()> {
        let Some(mut file) = self.file.take() else {
            return Ok(());
        };
        if magic {
            file.write_all(b"V")?;
            file.flush()?;
        }
        drop(file);
        Ok(())
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // Dropped without close(): close without the magic character. Never
        // disarm by accident.
        self.file.take();
    }
}
