//! Policies that ask for more than a node runs, against the real control
//! plane. Its own test binary: a hundred large policies in the cluster slow
//! every other agent's selection while they exist, so nothing else runs
//! beside them.

mod support;

use std::io::Write;
use std::time::{Duration, Instant};

use futures::FutureExt;
use kube::Api;
use nodeguard::policy::NodeGuardPolicy;
use support::*;

/// A hundred policies select one node and ask for 10,000 probes (each a
/// NodeCondition) and 1,000 monitors: the node runs its limits (128
/// conditions, 64 monitors; the policies created first), says what is left
/// out, and what runs works; a policy created later takes nothing from it.
#[tokio::test]
async fn a_hundred_policies_asking_for_too_much_get_the_nodes_limits_and_say_so() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "limits").await;
    let logs = TempDir::new("limits");
    let log = logs.path.join("app.log");
    std::fs::write(&log, "").unwrap();
    let prefix = unique_name("limits");
    let names: Vec<String> = (0..100).map(|i| format!("{prefix}-{i:03}")).collect();
    let late = format!("aaa-{prefix}");
    let t0 = Instant::now();
    for (i, name) in names.iter().enumerate() {
        let probes: Vec<serde_json::Value> = (0..100)
            .map(|j| {
                serde_json::json!({"name": format!("p{i}-{j}"), "tcp": {"port": 1}, "periodSeconds": 60,
                                   "conditionType": format!("LimitsProbe{i}x{j}")})
            })
            .collect();
        let monitors: Vec<serde_json::Value> = (0..10)
            .map(|j| {
                let mut m = serde_json::json!({
                    "name": format!("m{i}-{j}"), "source": {"file": {"path": log.display().to_string()}},
                    "rules": [{"type": "temporary", "reason": "LimitsLine", "pattern": "limits line"}],
                });
                if i == 0 && j == 0 {
                    m["conditions"] = serde_json::json!([{"type": "LimitsCanary", "reason": "NoCanary", "message": "no canary line"}]);
                    m["rules"] = serde_json::json!([{"type": "permanent", "condition": "LimitsCanary", "reason": "CanarySeen", "pattern": "limits canary"}]);
                }
                m
            })
            .collect();
        apply_policy(
            &admin,
            name,
            serde_json::json!({"nodeSelector": selecting(&node.name), "probes": probes, "monitors": monitors}),
        )
        .await;
    }
    eprintln!("100 policies applied in {:?}", t0.elapsed());
    let checked = std::panic::AssertUnwindSafe(async {
        let t0 = Instant::now();
        let (agent, _state) = start_agent(admin.clone(), &node.name).await;
        eventually(
            Duration::from_secs(60),
            "NodeGuardPolicyInvalid=True (PolicyOverLimit)",
            || async {
                condition(&admin, &node.name, "NodeGuardPolicyInvalid")
                    .await
                    .is_some_and(|c| c.0 == "True" && c.1 == "PolicyOverLimit")
            },
        )
        .await;
        eprintln!("over-limit reported {:?} after the start", t0.elapsed());
        let (_, _, message) = condition(&admin, &node.name, "NodeGuardPolicyInvalid")
            .await
            .unwrap();
        // Conditions: policy 0's 100 probes and its canary monitor, then 27 of
        // policy 1's probes (128 in all); monitors: the first 64 (policies 0 to
        // 6); every policy after the first loses some.
        assert!(
            message.contains(
                "the limit of 64 monitors and 128 conditions from all policies together is reached, so 9873 probes and 936 monitors of 99 policies"
            ),
            "{message}"
        );
        assert!(
            message.contains(&format!("({}, {}, {}, …)", names[1], names[2], names[3])),
            "{message}"
        );
        eventually(
            Duration::from_secs(10),
            "a PolicyOverLimit Event",
            || async {
                kubectl(&["events", "-A", "--for", &format!("node/{}", node.name)])
                    .contains("PolicyOverLimit")
            },
        )
        .await;
        // What is in force runs: 127 probe workers, the first policy's monitor.
        let workers = || async {
            http_get(agent.addr, "/metrics")
                .await
                .1
                .lines()
                .find_map(|l| {
                    l.strip_prefix("nodeguard_probe_workers ")?
                        .trim()
                        .parse::<u64>()
                        .ok()
                })
        };
        eventually(Duration::from_secs(30), "127 probe workers", || async {
            workers().await == Some(127)
        })
        .await;
        let mut f = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
        writeln!(f, "limits canary").unwrap();
        eventually(Duration::from_secs(10), "LimitsCanary=True", || async {
            condition(&admin, &node.name, "LimitsCanary")
                .await
                .is_some_and(|c| c.0 == "True")
        })
        .await;
        assert_eq!(http_get(agent.addr, "/readyz").await.0, 200, "ready");
        // A policy created later, first by name, asking for 128 conditions:
        // it takes nothing from what runs (by name it would take every
        // condition, the canary's too).
        let probes: Vec<serde_json::Value> = (0..128)
            .map(|j| {
                serde_json::json!({"name": format!("late-{j}"), "tcp": {"port": 1}, "periodSeconds": 60,
                                   "conditionType": format!("LimitsLate{j}")})
            })
            .collect();
        apply_policy(
            &admin,
            &late,
            serde_json::json!({"nodeSelector": selecting(&node.name), "probes": probes}),
        )
        .await;
        eventually(Duration::from_secs(30), "the late policy over the limit", || async {
            condition(&admin, &node.name, "NodeGuardPolicyInvalid")
                .await
                .is_some_and(|c| c.2.contains("10001 probes and 936 monitors of 100 policies"))
        })
        .await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(
            condition(&admin, &node.name, "LimitsCanary")
                .await
                .is_some_and(|c| c.0 == "True"),
            "the canary stays"
        );
        assert!(
            condition(&admin, &node.name, "LimitsLate0").await.is_none(),
            "the late policy's probes do not run"
        );
        assert_eq!(workers().await, Some(127));
        agent.stop().await;
    })
    .catch_unwind()
    .await;
    // Gone whatever happened: left behind, they would slow every later test.
    for name in names.iter().chain([&late]) {
        delete_policy(&admin, name).await;
    }
    if let Err(p) = checked {
        std::panic::resume_unwind(p);
    }
}

/// The API server refuses a monitor with more rules, or a pattern longer,
/// than a node runs, naming the field.
#[tokio::test]
async fn the_api_server_refuses_monitors_past_their_bounds() {
    let admin = admin_client().await;
    let api: Api<NodeGuardPolicy> = Api::all(admin.clone());
    let create = async |rules: serde_json::Value| {
        let name = unique_name("bounds");
        let p: NodeGuardPolicy = serde_json::from_value(serde_json::json!({
            "apiVersion": "nodeguard.io/v1alpha1", "kind": "NodeGuardPolicy",
            "metadata": {"name": name},
            "spec": {"monitors": [{"name": "m", "source": {"file": {"path": "/var/log/x.log"}}, "rules": rules}]},
        }))
        .unwrap();
        match api.create(&Default::default(), &p).await {
            Ok(_) => {
                delete_policy(&admin, &name).await;
                panic!("accepted: {rules:.200}")
            }
            Err(e) => e.to_string(),
        }
    };
    let rule = |pattern: String| serde_json::json!({"type": "temporary", "reason": "Seen", "pattern": pattern});
    let many: Vec<serde_json::Value> = (0..257).map(|i| rule(format!("line {i}"))).collect();
    let err = create(serde_json::json!(many)).await;
    assert!(
        err.contains("spec.monitors[0].rules") && err.contains("256"),
        "{err}"
    );
    let err = create(serde_json::json!([rule("a".repeat(4097))])).await;
    assert!(
        err.contains("spec.monitors[0].rules[0].pattern") && err.contains("4096"),
        "{err}"
    );
}
