//! Policy lifecycle against the real control plane: an invalid update keeps
//! the last good generation running and says so; fixing it clears that;
//! agents on differently labelled nodes get different policies; relabelling
//! a node drops the conditions of a policy that no longer selects it.

mod support;

use std::io::Write;
use std::time::{Duration, Instant};

use kube::Api;
use kube::api::DeleteParams;
use nodeguard::policy::NodeGuardPolicy;
use support::*;

#[tokio::test]
async fn an_invalid_regex_keeps_the_last_good_policy_running_until_fixed() {
    let admin = admin_client().await;
    let node = TestNode::create(&admin, "lastgood", &[]).await;
    let key = unique_name("sel");
    label_node(&admin, &node.name, "nodeguard.io/test-policy", &key).await;
    let logs = TempDir::new("lastgood");
    let log = logs.path.join("app.log");
    std::fs::write(&log, "").unwrap();
    let spec = |pattern: &str| {
        serde_json::json!({
            "nodeSelector": {"matchLabels": {"nodeguard.io/test-policy": key}},
            "monitors": [{"name": "app", "source": {"file": {"path": log.display().to_string()}},
                "conditions": [{"type": "AppBroken", "reason": "AppIsFine", "message": "The app is fine."}],
                "rules": [{"type": "permanent", "condition": "AppBroken", "reason": "AppCrashed", "pattern": pattern}]}],
        })
    };
    let name = unique_name("lastgood");
    apply_policy(&admin, &name, spec("app crashed")).await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;
    eventually(Duration::from_secs(15), "policy in force", || async {
        condition(&admin, &node.name, "AppBroken")
            .await
            .is_some_and(|c| c.0 == "False")
            && condition(&admin, &node.name, "NodeGuardPolicyInvalid")
                .await
                .is_some_and(|c| c.0 == "False")
    })
    .await;

    // A broken regular expression passes the schema (it is a string).
    apply_policy(&admin, &name, spec("app crashed (")).await;
    let t0 = Instant::now();
    eventually(
        Duration::from_secs(5),
        "NodeGuardPolicyInvalid=True",
        || async {
            condition(&admin, &node.name, "NodeGuardPolicyInvalid")
                .await
                .is_some_and(|c| {
                    c.0 == "True" && c.2.contains("last valid generation (1) stays in force")
                })
        },
    )
    .await;
    eprintln!(
        "invalid policy reported {:?} after the update",
        t0.elapsed()
    );
    let (_, _, msg) = condition(&admin, &node.name, "NodeGuardPolicyInvalid")
        .await
        .unwrap();
    assert!(msg.contains("spec.monitors[0].rules[0].pattern"), "{msg}");
    eventually(Duration::from_secs(10), "PolicyInvalid event", || async {
        kubectl(&["events", "-A", "--for", &format!("node/{}", node.name)])
            .contains("PolicyInvalid")
    })
    .await;
    // The last good generation still runs: its monitor still works.
    let mut f = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
    writeln!(f, "app crashed").unwrap();
    eventually(
        Duration::from_secs(5),
        "AppBroken=True from the kept generation",
        || async {
            condition(&admin, &node.name, "AppBroken")
                .await
                .is_some_and(|c| c.0 == "True")
        },
    )
    .await;
    // Fixed: the invalid condition clears.
    apply_policy(&admin, &name, spec("app (crashed|died)")).await;
    eventually(
        Duration::from_secs(5),
        "NodeGuardPolicyInvalid=False",
        || async {
            condition(&admin, &node.name, "NodeGuardPolicyInvalid")
                .await
                .is_some_and(|c| c.0 == "False")
        },
    )
    .await;
    agent.stop().await;
    delete_policy(&admin, &name).await;
}

#[tokio::test]
async fn two_nodes_two_policies_and_relabelling_moves_a_node_between_them() {
    let admin = admin_client().await;
    let tier = unique_name("tier");
    let a = TestNode::create(&admin, "tier-a", &[]).await;
    let b = TestNode::create(&admin, "tier-b", &[]).await;
    label_node(&admin, &a.name, &format!("nodeguard.io/{tier}"), "a").await;
    label_node(&admin, &b.name, &format!("nodeguard.io/{tier}"), "b").await;
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = tcp.local_addr().unwrap().port();
    let policy = |value: &str, cond: &str| {
        serde_json::json!({
            "nodeSelector": {"matchLabels": {format!("nodeguard.io/{tier}"): value}},
            "probes": [{"name": format!("probe-{value}"), "tcp": {"port": port}, "periodSeconds": 1, "conditionType": cond}],
        })
    };
    let (pa, pb) = (unique_name("pa"), unique_name("pb"));
    apply_policy(&admin, &pa, policy("a", "TierAProbeFailing")).await;
    apply_policy(&admin, &pb, policy("b", "TierBProbeFailing")).await;
    let (agent_a, _sa) = start_agent(admin.clone(), &a.name).await;
    let (agent_b, _sb) = start_agent(admin.clone(), &b.name).await;
    eventually(
        Duration::from_secs(15),
        "each node has its own policy's condition",
        || async {
            condition(&admin, &a.name, "TierAProbeFailing")
                .await
                .is_some()
                && condition(&admin, &b.name, "TierBProbeFailing")
                    .await
                    .is_some()
        },
    )
    .await;
    assert!(
        condition(&admin, &a.name, "TierBProbeFailing")
            .await
            .is_none()
    );
    assert!(
        condition(&admin, &b.name, "TierAProbeFailing")
            .await
            .is_none()
    );

    label_node(&admin, &a.name, &format!("nodeguard.io/{tier}"), "b").await;
    let t0 = Instant::now();
    eventually(
        Duration::from_secs(5),
        "node A dropped policy a's condition",
        || async {
            condition(&admin, &a.name, "TierAProbeFailing")
                .await
                .is_none()
        },
    )
    .await;
    eprintln!("relabel to condition removed: {:?}", t0.elapsed());
    eventually(
        Duration::from_secs(5),
        "node A now runs policy b",
        || async {
            condition(&admin, &a.name, "TierBProbeFailing")
                .await
                .is_some()
        },
    )
    .await;
    let want = format!("{pb}@1");
    let annotation = || effective_policies(&admin, &a.name);
    eventually(
        Duration::from_secs(5),
        "the effective-policies annotation follows",
        || async { annotation().await.as_deref() == Some(want.as_str()) },
    )
    .await;
    agent_a.stop().await;
    agent_b.stop().await;
    for p in [pa, pb] {
        delete_policy(&admin, &p).await;
    }
}

#[tokio::test]
async fn one_elected_agent_writes_accepted_and_observed_generation() {
    use k8s_openapi::api::core::v1::Namespace;
    let admin = admin_client().await;
    let ns = unique_name("lease");
    let nsobj: Namespace =
        serde_json::from_value(serde_json::json!({"metadata": {"name": ns}})).unwrap();
    Api::<Namespace>::all(admin.clone())
        .create(&kube::api::PostParams::default(), &nsobj)
        .await
        .unwrap();
    let node = TestNode::create(&admin, "status", &[]).await;
    let good = unique_name("good");
    let bad = unique_name("bad");
    let never = serde_json::json!({"matchLabels": {"nodeguard.io/none": "none"}});
    apply_policy(&admin, &good, serde_json::json!({"nodeSelector": never})).await;
    apply_policy(
        &admin,
        &bad,
        serde_json::json!({"nodeSelector": never, "monitors": [{"name": "m", "source": {"file": {"path": "/x"}},
            "rules": [{"type": "temporary", "reason": "Oops", "pattern": "("}]}]}),
    )
    .await;
    let ns2 = ns.clone();
    let (agent, _state) =
        start_agent_with(admin.clone(), &node.name, move |c| c.lease_namespace = ns2).await;
    let api: Api<NodeGuardPolicy> = Api::all(admin.clone());
    let accepted = |p: &NodeGuardPolicy| {
        p.status.as_ref().and_then(|s| {
            let c = s.conditions.iter().find(|c| c.type_ == "Accepted")?;
            Some((c.status.clone(), c.reason.clone(), s.observed_generation))
        })
    };
    eventually(Duration::from_secs(20), "status written", || async {
        let g = api.get(&good).await.unwrap();
        let b = api.get(&bad).await.unwrap();
        accepted(&g) == Some(("True".into(), "Valid".into(), Some(1)))
            && accepted(&b) == Some(("False".into(), "Invalid".into(), Some(1)))
    })
    .await;
    let out = kubectl(&["get", "ngp", &good, &bad]);
    assert!(
        out.lines()
            .any(|l| l.starts_with(&good) && l.contains("True") && l.contains("Valid")),
        "{out}"
    );
    assert!(
        out.lines()
            .any(|l| l.starts_with(&bad) && l.contains("False") && l.contains("Invalid")),
        "{out}"
    );
    eprintln!("{out}");
    // Agents of the tests running beside this one (lease namespace
    // "default") may have written the status first; this agent takes the
    // lease of its own namespace within moments.
    eventually(
        Duration::from_secs(20),
        "this agent holds its lease",
        || async {
            kubectl_status(&[
                "-n",
                &ns,
                "get",
                "lease",
                "nodeguard-policy-status",
                "-o",
                "jsonpath={.spec.holderIdentity}",
            ])
            .is_ok_and(|holder| holder == node.name)
        },
    )
    .await;
    agent.stop().await;
    for p in [good, bad] {
        let _ = api.delete(&p, &DeleteParams::default()).await;
    }
    let _ = Api::<Namespace>::all(admin)
        .delete(&ns, &DeleteParams::default())
        .await;
}

/// After a policy edit every selected node writes at once; at 5,000 nodes
/// that is 5,000 writes in one second. Each agent writes the edit's
/// consequences (its policy condition, new conditions, the effective-policies
/// annotation) in one apply, at its own point of the default spread window.
#[tokio::test]
async fn a_policy_edit_is_one_write_per_node_at_its_point_of_the_spread() {
    let admin = admin_client().await;
    let window = nodeguard::report::ReportConfig::default().policy_spread;
    assert_eq!(window, Duration::from_secs(10), "the default spread");
    // A node whose point is not at the start of the window, so that the
    // wait shows.
    let node = loop {
        let n = TestNode::selectable(&admin, "spread").await;
        if nodeguard::report::conditions::spread_offset(&n.name, window) >= Duration::from_secs(2) {
            break n;
        }
    };
    let offset = nodeguard::report::conditions::spread_offset(&node.name, window);
    let logs = TempDir::new("spread");
    let log = logs.path.join("app.log");
    std::fs::write(&log, "").unwrap();
    let monitor = |name: &str, condition: &str| {
        serde_json::json!({"name": name, "source": {"file": {"path": log.display().to_string()}},
            "conditions": [{"type": condition, "reason": "AppIsFine", "message": "The app is fine."}],
            "rules": [{"type": "permanent", "condition": condition, "reason": "AppCrashed", "pattern": "crashed"}]})
    };
    let name = unique_name("spread");
    apply_policy(
        &admin,
        &name,
        serde_json::json!({"nodeSelector": selecting(&node.name), "monitors": [monitor("a", "SpreadA")]}),
    )
    .await;
    let (agent, _state) = start_agent_with(admin.clone(), &node.name, |c| {
        c.report.policy_spread = window;
    })
    .await;
    let annotation = || effective_policies(&admin, &node.name);
    eventually(Duration::from_secs(15), "the policy in force", || async {
        annotation().await == Some(format!("{name}@1"))
            && condition_is(&admin, &node.name, "SpreadA", "False").await
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = audit_node_writes(&node.name).len();

    // The edit adds a monitor: a new condition and a new generation.
    apply_policy(
        &admin,
        &name,
        serde_json::json!({"nodeSelector": selecting(&node.name),
            "monitors": [monitor("a", "SpreadA"), monitor("b", "SpreadB")]}),
    )
    .await;
    let t0 = Instant::now();
    eventually(
        offset + Duration::from_secs(5),
        "the new generation shown",
        || async { annotation().await == Some(format!("{name}@2")) },
    )
    .await;
    let took = t0.elapsed();
    assert!(
        condition_is(&admin, &node.name, "SpreadB", "False").await,
        "the new condition came with it"
    );
    tokio::time::sleep(Duration::from_secs(2)).await; // the audit log follows the response
    let writes = audit_node_writes(&node.name)[before..].to_vec();
    eprintln!("spread point {offset:?}: edit shown after {took:?}; node writes {writes:?}");
    assert_eq!(writes.len(), 1, "one write for the edit: {writes:?}");
    assert_eq!(writes[0].0, "status", "through the status subresource");
    assert!(
        took + Duration::from_millis(300) >= offset,
        "shown after {took:?}, before its point {offset:?} of the window"
    );
    agent.stop().await;
    delete_policy(&admin, &name).await;
}

/// A policy that turns invalid is reported (`NodeGuardPolicyInvalid=True`,
/// a `PolicyInvalid` Event) on the nodes where its last good generation is
/// in force, and nowhere else: one bad edit must not make every node of a
/// fleet write a condition and an Event.
#[tokio::test]
async fn an_invalid_edit_is_reported_only_on_the_nodes_the_policy_selects() {
    let admin = admin_client().await;
    let selected = TestNode::selectable(&admin, "bad-sel").await;
    let other = TestNode::selectable(&admin, "bad-other").await;
    let name = unique_name("badedit");
    let spec = |pattern: &str| {
        serde_json::json!({"nodeSelector": selecting(&selected.name),
            "monitors": [{"name": "m", "source": {"file": {"path": "/var/log/nodeguard-test-absent.log"}},
                "conditions": [{"type": "BadEditProblem", "reason": "Fine", "message": "Fine."}],
                "rules": [{"type": "permanent", "condition": "BadEditProblem", "reason": "Broken", "pattern": pattern}]}]})
    };
    apply_policy(&admin, &name, spec("broken")).await;
    let (agent_s, _state_s) = start_agent(admin.clone(), &selected.name).await;
    let (agent_o, _state_o) = start_agent(admin.clone(), &other.name).await;
    for n in [&selected.name, &other.name] {
        eventually(Duration::from_secs(15), "PoliciesValid", || async {
            condition(&admin, n, "NodeGuardPolicyInvalid")
                .await
                .is_some_and(|c| c.0 == "False")
        })
        .await;
    }
    apply_policy(&admin, &name, spec("broken (")).await;
    eventually(
        Duration::from_secs(10),
        "the selected node reports the invalid edit",
        || async {
            condition(&admin, &selected.name, "NodeGuardPolicyInvalid")
                .await
                .is_some_and(|c| c.0 == "True")
        },
    )
    .await;
    // The other agent has seen the edit by now; give it as long again.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let c = condition(&admin, &other.name, "NodeGuardPolicyInvalid")
        .await
        .unwrap();
    assert_eq!(c.0, "False", "the other node: {c:?}");
    let (events, notes) = node_event_count(&other.name, "PolicyInvalid");
    assert_eq!(events, 0, "PolicyInvalid Events on the other node: {notes}");
    assert!(node_event_count(&selected.name, "PolicyInvalid").0 >= 1);
    agent_s.stop().await;
    agent_o.stop().await;
    delete_policy(&admin, &name).await;
}
