//! The `nodeguard` binary's offline subcommands.

mod support;

use std::process::Command;

fn nodeguard(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_nodeguard"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn crd_prints_the_committed_file() {
    let (code, out, _) = nodeguard(&["crd"]);
    assert_eq!(code, 0);
    let committed = std::fs::read_to_string(
        support::repo_root().join("crds/nodeguard.io_nodeguardpolicies.yaml"),
    )
    .unwrap();
    assert_eq!(out, committed);
}

#[test]
fn check_accepts_a_valid_policy() {
    let f = support::repo_root().join("tests/fixtures/policy-valid.yaml");
    let (code, out, err) = nodeguard(&["check", "-f", f.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("NodeGuardPolicy gpu-nodes: valid"), "{out}");
}

#[test]
fn check_reports_a_bad_selector_with_field_paths_and_exit_1() {
    let f = support::repo_root().join("tests/fixtures/policy-bad-selector.yaml");
    let (code, out, _) = nodeguard(&["check", "-f", f.to_str().unwrap()]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("spec.nodeSelector.matchExpressions[0].operator: unknown operator \"Equals\""),
        "{out}"
    );
    assert!(
        out.contains("spec.nodeSelector.matchExpressions[1].values"),
        "{out}"
    );
    assert!(out.contains("2 problem(s) in 1 policy"), "{out}");
}

#[test]
fn check_reports_unreadable_and_foreign_files() {
    let (code, _, err) = nodeguard(&["check", "-f", "/nonexistent/policy.yaml"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("cannot read /nonexistent/policy.yaml"),
        "{err}"
    );

    let dir = std::env::temp_dir().join(support::unique_name("check"));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("cm.yaml");
    std::fs::write(&f, "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n").unwrap();
    let (code, out, _) = nodeguard(&["check", "-f", f.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(out.contains("not a NodeGuardPolicy"), "{out}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn version_and_help() {
    let (code, out, _) = nodeguard(&["version"]);
    assert_eq!(code, 0);
    assert!(out.starts_with("nodeguard 0."), "{out}");
    let (code, out, _) = nodeguard(&["run", "--help"]);
    assert_eq!(code, 0);
    for flag in [
        "--node-name",
        "--kubeconfig",
        "--listen",
        "--state-dir",
        "--log-format",
    ] {
        assert!(out.contains(flag), "run --help lacks {flag}:\n{out}");
    }
}
