//! Stamps the binary with its git commit and compiler version for
//! `nodeguard version` and the `nodeguard_build_info` metric.
use std::process::Command;

fn output(cmd: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(cmd).args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    let commit = std::env::var("NODEGUARD_GIT_COMMIT")
        .ok()
        .or_else(|| output("git", &["rev-parse", "--short=12", "HEAD"]))
        .unwrap_or_else(|| "unknown".into());
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let rustc_version = output(&rustc, &["--version"]).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=NODEGUARD_GIT_COMMIT={commit}");
    println!("cargo:rustc-env=NODEGUARD_RUSTC_VERSION={rustc_version}");
    println!("cargo:rerun-if-env-changed=NODEGUARD_GIT_COMMIT");
    println!("cargo:rerun-if-changed=.git/HEAD");
    println!("cargo:rerun-if-changed=.git/refs/heads");
}
