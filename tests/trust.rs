//! Node-local trust against the real control plane: a policy written by a
//! cluster admin still cannot make the agent run a command, repair a unit,
//! read a path or hold a shutdown that the node's own settings do not allow.
//! The refused item is left out with an Event and `NodeGuardPolicyInvalid`
//! naming the policy, the field and the setting; the rest of the policy runs.

mod support;

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use nodeguard::policy::NodeTrust;
use support::*;

fn events_for(node: &str) -> String {
    kubectl(&[
        "events",
        "-A",
        "--for",
        &format!("node/{node}"),
        "-o",
        "json",
    ])
}

/// An executable script at `path` that records that it ran in `marker`.
fn script(path: &std::path::Path, marker: &std::path::Path, exit: i32) {
    std::fs::write(
        path,
        format!(
            "#!/bin/sh\necho ran >> {}\necho 'checked by the allowed plugin'\nexit {exit}\n",
            marker.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

#[tokio::test]
async fn a_command_outside_the_nodes_allowlist_is_refused_and_an_allowed_one_runs() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "trust-exec").await;
    let dir = TempDir::new("trust-exec");
    let plugins = dir.path.join("plugins");
    std::fs::create_dir(&plugins).unwrap();
    let allowed = plugins.join("check.sh");
    let allowed_ran = dir.path.join("allowed-ran");
    script(&allowed, &allowed_ran, 1);
    let outside = dir.path.join("outside.sh");
    let outside_ran = dir.path.join("outside-ran");
    script(&outside, &outside_ran, 1);

    let name = unique_name("trust-exec");
    apply_policy(
        &admin,
        &name,
        serde_json::json!({
            "nodeSelector": selecting(&node.name),
            "probes": [
                {"name": "outside", "exec": {"command": [outside.display().to_string()]},
                 "conditionType": "OutsideBroken", "periodSeconds": 1, "failureThreshold": 1},
                {"name": "allowed", "exec": {"command": [allowed.display().to_string()]},
                 "conditionType": "AllowedBroken", "periodSeconds": 1, "failureThreshold": 1},
            ],
        }),
    )
    .await;
    let trust = NodeTrust {
        commands: vec![format!("{}/", plugins.display())],
        ..NodeTrust::default()
    };
    let (agent, _state) = start_agent_with(admin.clone(), &node.name, |c| c.trust = trust).await;

    eventually(
        Duration::from_secs(20),
        "the allowed command ran and set its condition",
        || async {
            condition(&admin, &node.name, "AllowedBroken")
                .await
                .is_some_and(|c| c.0 == "True" && c.2.contains("checked by the allowed plugin"))
        },
    )
    .await;
    let (status, reason, message) = condition(&admin, &node.name, "NodeGuardPolicyInvalid")
        .await
        .expect("the policy condition");
    eprintln!("NodeGuardPolicyInvalid: {status} {reason}: {message}");
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("True", "PolicyRefused")
    );
    for part in [
        name.as_str(),
        "spec.probes[0].exec.command[0]",
        &format!("runs {}", outside.display()),
        "probe outside",
        "--allow-command",
        "trust.commands",
        "the rest of the policy applies",
    ] {
        assert!(message.contains(part), "{part:?} missing from: {message}");
    }
    assert!(
        condition(&admin, &node.name, "OutsideBroken")
            .await
            .is_none(),
        "a refused probe sets no condition"
    );
    assert!(!outside_ran.exists(), "the refused command must never run");
    eventually(Duration::from_secs(15), "a PolicyRefused Event", || async {
        let events = events_for(&node.name);
        events.contains("PolicyRefused") && events.contains("spec.probes[0].exec.command[0]")
    })
    .await;

    // The author removes the refused probe: the condition clears.
    apply_policy(
        &admin,
        &name,
        serde_json::json!({
            "nodeSelector": selecting(&node.name),
            "probes": [
                {"name": "allowed", "exec": {"command": [allowed.display().to_string()]},
                 "conditionType": "AllowedBroken", "periodSeconds": 1, "failureThreshold": 1},
            ],
        }),
    )
    .await;
    eventually(Duration::from_secs(15), "PoliciesValid", || async {
        condition(&admin, &node.name, "NodeGuardPolicyInvalid")
            .await
            .is_some_and(|c| c.0 == "False" && c.1 == "PoliciesValid")
    })
    .await;
    assert!(!outside_ran.exists());
    agent.stop().await;
    delete_policy(&admin, &name).await;
}

#[tokio::test]
async fn repairs_paths_and_inhibit_delays_beyond_the_node_settings_are_refused() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "trust-paths").await;
    let logs = TempDir::new("trust-logs");
    let secrets = TempDir::new("trust-secrets");
    let allowed_log = logs.path.join("app.log");
    let secret_log = secrets.path.join("secret.log");
    std::fs::write(&allowed_log, "").unwrap();
    std::fs::write(&secret_log, "").unwrap();
    let file_monitor = |name: &str, path: &std::path::Path, condition: &str| {
        serde_json::json!({"name": name, "source": {"file": {"path": path.display().to_string()}},
            "conditions": [{"type": condition, "reason": "Fine", "message": "fine"}],
            "rules": [{"type": "permanent", "condition": condition, "reason": "Seen", "pattern": "boom"}]})
    };
    let name = unique_name("trust-paths");
    apply_policy(
        &admin,
        &name,
        serde_json::json!({
            "nodeSelector": selecting(&node.name),
            "monitors": [
                file_monitor("secret", &secret_log, "SecretSeen"),
                {"name": "sshd", "source": {"systemd": {"unit": "sshd.service", "repair": {}}},
                 "conditions": [{"type": "SshdUnhealthy", "reason": "SshdIsHealthy", "message": "fine"}],
                 "rules": [{"type": "permanent", "condition": "SshdUnhealthy", "reason": "SshdDown"}]},
                file_monitor("app", &allowed_log, "AppSeen"),
            ],
            "shutdown": {"gracePeriodSeconds": 600, "logindDropInDir": ""},
        }),
    )
    .await;
    let trust = NodeTrust {
        read_paths: vec![logs.path.display().to_string()],
        ..NodeTrust::default()
    };
    let (agent, _state) = start_agent_with(admin.clone(), &node.name, |c| c.trust = trust).await;
    eventually(
        Duration::from_secs(20),
        "the allowed monitor runs",
        || async {
            condition(&admin, &node.name, "AppSeen")
                .await
                .is_some_and(|c| c.0 == "False")
        },
    )
    .await;
    let append = |path: &std::path::Path| {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new().append(true).open(path).unwrap();
        writeln!(f, "boom").unwrap();
    };
    append(&secret_log);
    append(&allowed_log);
    eventually(
        Duration::from_secs(15),
        "the allowed file is read",
        || async {
            condition(&admin, &node.name, "AppSeen")
                .await
                .is_some_and(|c| c.0 == "True")
        },
    )
    .await;
    for t in ["SecretSeen", "SshdUnhealthy", "GracefulShutdown"] {
        assert!(
            condition(&admin, &node.name, t).await.is_none(),
            "{t}: a refused item sets no condition"
        );
    }
    let (status, reason, message) = condition(&admin, &node.name, "NodeGuardPolicyInvalid")
        .await
        .unwrap();
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("True", "PolicyRefused")
    );
    assert!(
        message.contains("spec.monitors[0].source.file.path")
            && message.contains("--allow-read-path")
            && message.contains("2 more items are refused"),
        "{message}"
    );
    let wanted = [
        ("spec.monitors[0].source.file.path", "trust.readPaths"),
        (
            "spec.monitors[1].source.systemd.repair",
            "trust.repairUnits",
        ),
        ("spec.shutdown", "trust.maxInhibitDelaySeconds"),
    ];
    eventually(Duration::from_secs(15), "one Event per refusal", || async {
        let events = events_for(&node.name);
        wanted
            .iter()
            .all(|(field, value)| events.contains(field) && events.contains(value))
    })
    .await;
    eprintln!("{}", events_for(&node.name));
    agent.stop().await;
    delete_policy(&admin, &name).await;
}

/// An HTTP probe's failure message must not carry the response body: a
/// policy author who may write only probes could otherwise point one at a
/// node-local secret (a cloud metadata token) and read it from the Node.
#[tokio::test]
async fn a_failing_http_probe_does_not_copy_the_response_body_to_the_node() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "trust-body").await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf).await;
            let body = "token=SECRET-TOKEN-VALUE";
            let _ = s
                .write_all(
                    format!(
                        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    )
                    .as_bytes(),
                )
                .await;
        }
    });
    let name = unique_name("trust-body");
    apply_policy(
        &admin,
        &name,
        serde_json::json!({
            "nodeSelector": selecting(&node.name),
            "probes": [{"name": "meta", "http": {"url": format!("http://{addr}/token"), "bodyContains": "never-there"},
                        "conditionType": "MetaBroken", "periodSeconds": 1, "failureThreshold": 1}],
        }),
    )
    .await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;
    eventually(Duration::from_secs(20), "the probe fails", || async {
        condition(&admin, &node.name, "MetaBroken")
            .await
            .is_some_and(|c| c.0 == "True")
    })
    .await;
    let (_, _, message) = condition(&admin, &node.name, "MetaBroken").await.unwrap();
    eprintln!("MetaBroken: {message}");
    assert!(message.contains("never-there"), "{message}");
    assert!(!message.contains("SECRET"), "the body leaked: {message}");
    agent.stop().await;
    delete_policy(&admin, &name).await;
}

/// A monitor's name names its state file on the node: a name that is a
/// path (`../x`, `/etc/x`) would make the agent write, as root, outside its
/// state directory. The API refuses such names (the CRD's pattern).
#[tokio::test]
async fn a_monitor_name_that_is_a_path_is_refused_by_the_api() {
    let admin = admin_client().await;
    install_crd(&admin).await;
    let api: kube::Api<nodeguard::policy::NodeGuardPolicy> = kube::Api::all(admin.clone());
    for bad in ["../shutdown-state", "/etc/docker/daemon", "Kernel"] {
        let name = unique_name("trust-name");
        let p: nodeguard::policy::NodeGuardPolicy = serde_json::from_value(serde_json::json!({
            "apiVersion": "nodeguard.io/v1alpha1", "kind": "NodeGuardPolicy",
            "metadata": {"name": name},
            "spec": {"nodeSelector": {"matchLabels": {"nodeguard.io/test-none": "none"}},
                     "monitors": [{"name": bad, "source": {"systemd": {"unit": "kubelet.service"}}}]},
        }))
        .unwrap();
        let r = api.create(&kube::api::PostParams::default(), &p).await;
        if r.is_ok() {
            delete_policy(&admin, &name).await;
        }
        let err = r.expect_err(&format!("monitor name {bad:?} must be refused"));
        assert!(
            err.to_string().contains("spec.monitors[0].name"),
            "{bad}: {err}"
        );
    }
}

/// Read roots are judged on the path a policy wrote; the kernel follows
/// links. A link under an allowed root that leads out of it is not read.
#[tokio::test]
async fn a_link_under_an_allowed_root_that_leads_out_is_not_read() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "trust-link").await;
    let logs = TempDir::new("trust-link-logs");
    let secrets = TempDir::new("trust-link-secrets");
    let secret = secrets.path.join("secret.log");
    std::fs::write(&secret, "").unwrap();
    let link = logs.path.join("app.log");
    std::os::unix::fs::symlink(&secret, &link).unwrap();
    let name = unique_name("trust-link");
    apply_policy(
        &admin,
        &name,
        serde_json::json!({
            "nodeSelector": selecting(&node.name),
            "monitors": [{"name": "app", "source": {"file": {"path": link.display().to_string()}},
                "conditions": [{"type": "LinkSeen", "reason": "Fine", "message": "fine"}],
                "rules": [{"type": "permanent", "condition": "LinkSeen", "reason": "Seen", "pattern": "boom"}]}],
        }),
    )
    .await;
    let trust = NodeTrust {
        read_paths: vec![logs.path.display().to_string()],
        ..NodeTrust::default()
    };
    let (agent, _state) = start_agent_with(admin.clone(), &node.name, |c| c.trust = trust).await;
    eventually(
        Duration::from_secs(20),
        "the monitor reports its source refused",
        || async {
            condition(&admin, &node.name, "LinkSeen")
                .await
                .is_some_and(|c| {
                    c.0 == "Unknown" && c.2.contains("outside the read paths this node allows")
                })
        },
    )
    .await;
    {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&secret)
            .unwrap();
        writeln!(f, "boom").unwrap();
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (status, _, message) = condition(&admin, &node.name, "LinkSeen").await.unwrap();
    eprintln!("LinkSeen: {status}: {message}");
    assert_eq!(status, "Unknown", "the secret file was read: {message}");
    agent.stop().await;
    delete_policy(&admin, &name).await;
}

/// A shutdown section whose logind drop-in directory the node does not
/// allow keeps the rest of the section: graceful shutdown still runs with
/// logind's own delay, and nothing is written there.
#[tokio::test]
async fn a_refused_drop_in_directory_leaves_the_shutdown_section_in_force() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "trust-dropin").await;
    let elsewhere = TempDir::new("trust-dropin");
    let name = unique_name("trust-dropin");
    apply_policy(
        &admin,
        &name,
        serde_json::json!({
            "nodeSelector": selecting(&node.name),
            "shutdown": {"gracePeriodSeconds": 10, "logindDropInDir": elsewhere.path.display().to_string()},
        }),
    )
    .await;
    let (agent, _state) = start_agent_with(admin.clone(), &node.name, |c| {
        c.trust = NodeTrust::default();
        // No logind here: the shutdown manager reports that, in force.
        c.system_bus_address = Some("unix:path=/nonexistent/bus".into());
    })
    .await;
    eventually(Duration::from_secs(20), "the drop-in refused", || async {
        condition(&admin, &node.name, "NodeGuardPolicyInvalid")
            .await
            .is_some_and(|c| {
                c.0 == "True"
                    && c.2.contains("spec.shutdown.logindDropInDir")
                    && c.2.contains("the shutdown section applies")
            })
    })
    .await;
    eventually(
        Duration::from_secs(20),
        "the shutdown section is in force",
        || async {
            condition(&admin, &node.name, "GracefulShutdownUnavailable")
                .await
                .is_some()
        },
    )
    .await;
    assert!(
        std::fs::read_dir(&elsewhere.path).unwrap().next().is_none(),
        "nothing written into the refused directory"
    );
    agent.stop().await;
    delete_policy(&admin, &name).await;
}

/// The file at a monitor's path is checked before it is opened: a link to a
/// FIFO (whose open blocks) or a device (whose open has effects: a watchdog
/// starts) is refused without opening it, and the agent stays live.
#[tokio::test]
async fn a_link_to_a_fifo_is_refused_without_opening_it() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "trust-fifo").await;
    let logs = TempDir::new("trust-fifo-logs");
    let fifo = logs.path.join("fifo");
    let c_path = std::ffi::CString::new(fifo.display().to_string()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
    let name = unique_name("trust-fifo");
    apply_policy(
        &admin,
        &name,
        serde_json::json!({
            "nodeSelector": selecting(&node.name),
            "monitors": [{"name": "app", "source": {"file": {"path": fifo.display().to_string()}},
                "conditions": [{"type": "FifoSeen", "reason": "Fine", "message": "fine"}],
                "rules": [{"type": "permanent", "condition": "FifoSeen", "reason": "Seen", "pattern": "boom"}]}],
        }),
    )
    .await;
    let trust = NodeTrust {
        read_paths: vec![logs.path.display().to_string()],
        ..NodeTrust::default()
    };
    let (agent, _state) = start_agent_with(admin.clone(), &node.name, |c| c.trust = trust).await;
    eventually(Duration::from_secs(20), "the FIFO refused", || async {
        condition(&admin, &node.name, "FifoSeen")
            .await
            .is_some_and(|c| c.0 == "Unknown" && c.2.contains("is not a regular file"))
    })
    .await;
    let (code, body) = http_get(agent.addr, "/livez").await;
    assert_eq!(code, 200, "{body}");
    agent.stop().await;
    delete_policy(&admin, &name).await;
}

/// A rotation that puts a link leading out at the monitor's path makes the
/// monitor blind (Unknown, an Event) instead of reading the target; a
/// regular file there again makes it see.
#[tokio::test]
async fn a_rotation_to_a_link_leading_out_makes_the_monitor_blind_until_a_file_returns() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "trust-rot").await;
    let logs = TempDir::new("trust-rot-logs");
    let secrets = TempDir::new("trust-rot-secrets");
    let log = logs.path.join("app.log");
    let secret = secrets.path.join("secret.log");
    std::fs::write(&log, "").unwrap();
    std::fs::write(&secret, "").unwrap();
    let name = unique_name("trust-rot");
    apply_policy(
        &admin,
        &name,
        serde_json::json!({
            "nodeSelector": selecting(&node.name),
            "monitors": [{"name": "app", "source": {"file": {"path": log.display().to_string()}},
                "conditions": [{"type": "RotSeen", "reason": "Fine", "message": "fine", "clearPattern": "fixed"}],
                "rules": [{"type": "permanent", "condition": "RotSeen", "reason": "Seen", "pattern": "boom"}]}],
        }),
    )
    .await;
    let trust = NodeTrust {
        read_paths: vec![logs.path.display().to_string()],
        ..NodeTrust::default()
    };
    let (agent, _state) = start_agent_with(admin.clone(), &node.name, |c| c.trust = trust).await;
    eventually(Duration::from_secs(20), "the monitor reads", || async {
        condition(&admin, &node.name, "RotSeen")
            .await
            .is_some_and(|c| c.0 == "False")
    })
    .await;
    // "Rotation": the path now names a link to the secret.
    std::fs::rename(&log, logs.path.join("app.log.1")).unwrap();
    std::os::unix::fs::symlink(&secret, &log).unwrap();
    {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&secret)
            .unwrap();
        writeln!(f, "boom").unwrap();
    }
    eventually(Duration::from_secs(20), "the monitor blind", || async {
        condition(&admin, &node.name, "RotSeen")
            .await
            .is_some_and(|c| c.0 == "Unknown" && c.2.contains("outside the read paths"))
    })
    .await;
    eventually(
        Duration::from_secs(15),
        "a MonitorSourceUnavailable Event",
        || async {
            let events = events_for(&node.name);
            events.contains("MonitorSourceUnavailable") && events.contains("resolves to")
        },
    )
    .await;
    // A regular file again: read from its start.
    std::fs::remove_file(&log).unwrap();
    std::fs::write(&log, "all fine\n").unwrap();
    eventually(
        Duration::from_secs(20),
        "the monitor sees again",
        || async {
            condition(&admin, &node.name, "RotSeen")
                .await
                .is_some_and(|c| c.0 == "False")
        },
    )
    .await;
    let (status, _, message) = condition(&admin, &node.name, "RotSeen").await.unwrap();
    assert_eq!(
        status, "False",
        "the secret's line was never read: {message}"
    );
    agent.stop().await;
    delete_policy(&admin, &name).await;
}

/// A probe whose command prints more than an Event note may hold: the
/// note ("Probe … failed … : <output>. It clears …") went past the API
/// server's 1024-byte limit, the Event was refused, and the failure was
/// never seen in `kubectl describe node`. Every note is now cut to fit.
#[tokio::test]
async fn a_probe_with_a_long_output_still_gets_its_event() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "long-output").await;
    let dir = TempDir::new("long-output");
    let noisy = dir.path.join("noisy.sh");
    std::fs::write(
        &noisy,
        format!(
            "#!/bin/sh\necho '{}'\nexit 1\n",
            "disk check failed; ".repeat(150)
        ),
    )
    .unwrap();
    std::fs::set_permissions(&noisy, std::fs::Permissions::from_mode(0o755)).unwrap();
    let name = unique_name("long-output");
    apply_policy(
        &admin,
        &name,
        serde_json::json!({
            "nodeSelector": selecting(&node.name),
            "probes": [
                {"name": "noisy", "exec": {"command": [noisy.display().to_string()]},
                 "conditionType": "NoisyBroken", "periodSeconds": 1, "failureThreshold": 1},
            ],
        }),
    )
    .await;
    let trust = NodeTrust {
        commands: vec![format!("{}/", dir.path.display())],
        ..NodeTrust::default()
    };
    let (agent, _state) = start_agent_with(admin.clone(), &node.name, |c| c.trust = trust).await;
    let events: kube::Api<k8s_openapi::api::events::v1::Event> =
        kube::Api::namespaced(admin.clone(), "default");
    let failed = || async {
        events
            .list(&kube::api::ListParams::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .find(|e| {
                e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(node.name.as_str())
                    && e.reason.as_deref() == Some("NoisyProbeFailed")
            })
    };
    eventually(
        Duration::from_secs(20),
        "a NoisyProbeFailed Event on the node",
        || async { failed().await.is_some() },
    )
    .await;
    let note = failed().await.unwrap().note.unwrap_or_default();
    assert!(note.len() <= 1024, "a note of {} bytes", note.len());
    assert!(note.contains("disk check failed"), "{note}");
    eventually(Duration::from_secs(10), "NoisyBroken=True", || async {
        condition(&admin, &node.name, "NoisyBroken")
            .await
            .is_some_and(|c| c.0 == "True")
    })
    .await;
    let (_, _, message) = condition(&admin, &node.name, "NoisyBroken").await.unwrap();
    // The output is cut to 1 KiB; the sentence around it is short.
    assert!(
        message.contains("…. It clears") && message.len() <= 1024 + 256,
        "a condition message of {} bytes: {message}",
        message.len()
    );
    agent.stop().await;
    delete_policy(&admin, &name).await;
}
