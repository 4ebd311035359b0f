//! The condition manager and event recorder against the real control plane:
//! what `kubectl describe node` shows, concurrent writers, removal and
//! restarts, coalescing, and eligibility Events.

mod support;

use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use nodeguard::report::{EventKind, Status};
use support::*;

#[tokio::test]
async fn describe_node_shows_the_condition_row_and_the_event() {
    let admin = admin_client().await;
    let node = TestNode::create(&admin, "describe", &[]).await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;
    agent.reporter.set(
        "FrobnicatorProblem",
        desired(
            Status::True,
            "FrobnicatorStuck",
            "The frobnicator on /dev/frob0 has been stuck since 10:00 UTC; restart frob.service to clear it.",
        ),
    );
    agent.reporter.event(
        EventKind::Warning,
        "FrobnicatorStuck",
        "Detect",
        "The frobnicator on /dev/frob0 is stuck.",
    );
    let mut out = String::new();
    eventually(
        Duration::from_secs(15),
        "condition and event in kubectl describe node",
        || {
            out = kubectl(&["describe", "node", &node.name]);
            let ok = out.contains("FrobnicatorStuck    The frobnicator on /dev/frob0 is stuck.")
                || out.lines().any(|l| {
                    l.contains("Warning")
                        && l.contains("FrobnicatorStuck")
                        && l.contains("is stuck.")
                });
            let row = out.lines().any(|l| {
                l.trim_start().starts_with("FrobnicatorProblem")
                    && l.contains("True")
                    && l.contains("FrobnicatorStuck")
                    && l.contains("restart frob.service to clear it.")
            });
            std::future::ready(ok && row)
        },
    )
    .await;
    // The agent's own policy condition is there too.
    assert!(
        out.lines()
            .any(|l| l.trim_start().starts_with("NodeGuardPolicyInvalid") && l.contains("False")),
        "{out}"
    );
    eprintln!("{out}");
    // `kubectl events --for node/X` finds it as well.
    let events = kubectl(&["events", "-A", "--for", &format!("node/{}", node.name)]);
    assert!(events.contains("FrobnicatorStuck"), "{events}");
    agent.stop().await;
}

/// Writes Ready and a foreign condition the way the kubelet does (strategic
/// merge patch on nodes/status), `rounds` times.
async fn kubelet_like_writer(client: kube::Client, node: String, rounds: usize) {
    let nodes: Api<Node> = Api::all(client);
    for i in 0..rounds {
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        let status = if i % 2 == 0 { "True" } else { "False" };
        let patch = serde_json::json!({"status": {"conditions": [
            {"type": "Ready", "status": status, "reason": "KubeletReady", "message": format!("round {i}"),
             "lastHeartbeatTime": now, "lastTransitionTime": now},
            {"type": "OtherAgentProblem", "status": "False", "reason": "AllGood", "message": format!("round {i}"),
             "lastHeartbeatTime": now, "lastTransitionTime": now},
        ]}});
        nodes
            .patch_status(&node, &PatchParams::default(), &Patch::Strategic(&patch))
            .await
            .expect("kubelet-like status patch");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn concurrent_writers_keep_each_others_conditions() {
    let admin = admin_client().await;
    let node = TestNode::create(&admin, "concurrent", &[]).await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;

    kubelet_like_writer(admin.clone(), node.name.clone(), 1).await;
    let writer = tokio::spawn(kubelet_like_writer(admin.clone(), node.name.clone(), 60));
    for i in 0..60 {
        let status = if i % 3 == 0 {
            Status::True
        } else {
            Status::False
        };
        agent.reporter.set(
            "NodeGuardFlap",
            desired(status, "Flap", format!("nodeguard round {i}.")),
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    writer.await.unwrap();
    eventually(
        Duration::from_secs(10),
        "final nodeguard state written",
        || async {
            node_conditions(&admin, &node.name, "NodeGuardFlap")
                .await
                .first()
                .is_some_and(|c| c.message.as_deref() == Some("nodeguard round 59."))
        },
    )
    .await;
    let ready = node_conditions(&admin, &node.name, "Ready").await;
    assert_eq!(ready.len(), 1);
    assert_eq!(
        ready[0].message.as_deref(),
        Some("round 59"),
        "the kubelet's last write stands"
    );
    assert_eq!(
        node_conditions(&admin, &node.name, "OtherAgentProblem")
            .await
            .len(),
        1
    );
    let ours = node_conditions(&admin, &node.name, "NodeGuardFlap").await;
    assert_eq!(ours.len(), 1);
    assert_eq!(ours[0].status, "False");
    agent.stop().await;
}

#[tokio::test]
async fn every_version_of_the_node_keeps_foreign_conditions() {
    let admin = admin_client().await;
    let node = TestNode::create(&admin, "versions", &[]).await;
    kubelet_like_writer(admin.clone(), node.name.clone(), 1).await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;

    let api: Api<Node> = Api::all(admin.clone());
    let cfg = watcher::Config::default().fields(&format!("metadata.name={}", node.name));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let watch_task = tokio::spawn(async move {
        let mut stream = watcher(api, cfg).applied_objects().boxed();
        while let Some(Ok(n)) = stream.next().await {
            let _ = tx.send(n);
        }
    });
    let writer = tokio::spawn(kubelet_like_writer(admin.clone(), node.name.clone(), 40));
    for i in 0..40 {
        agent.reporter.set(
            "NodeGuardFlap",
            desired(Status::True, "Flap", format!("round {i}.")),
        );
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    writer.await.unwrap();
    eventually(Duration::from_secs(10), "last nodeguard write", || async {
        node_conditions(&admin, &node.name, "NodeGuardFlap")
            .await
            .first()
            .is_some_and(|c| c.message.as_deref() == Some("round 39."))
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    watch_task.abort();
    let mut versions = 0;
    let mut with_ours = 0;
    while let Ok(n) = rx.try_recv() {
        versions += 1;
        let types: Vec<String> = n
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .into_iter()
            .map(|c| c.type_)
            .collect();
        assert!(
            types.contains(&"Ready".to_string())
                && types.contains(&"OtherAgentProblem".to_string()),
            "a Node version lost a foreign condition: {types:?}"
        );
        with_ours += usize::from(types.contains(&"NodeGuardFlap".to_string()));
        assert!(
            types.iter().filter(|t| *t == "Ready").count() == 1,
            "duplicate Ready: {types:?}"
        );
    }
    eprintln!("{versions} versions observed, {with_ours} with nodeguard's condition");
    assert!(
        versions >= 40 && with_ours >= 2,
        "{versions} versions, {with_ours} with ours"
    );
    agent.stop().await;
}

#[tokio::test]
async fn removed_sources_are_deleted_and_restarts_neither_duplicate_nor_drop() {
    let admin = admin_client().await;
    let node = TestNode::create(&admin, "restart", &[]).await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;
    agent.reporter.set(
        "KeepProblem",
        desired(Status::True, "Broken", "Keep is broken."),
    );
    agent.reporter.set(
        "DropProblem",
        desired(Status::True, "Broken", "Drop is broken."),
    );
    eventually(
        Duration::from_secs(10),
        "both conditions on the node",
        || async {
            node_conditions(&admin, &node.name, "KeepProblem")
                .await
                .len()
                == 1
                && node_conditions(&admin, &node.name, "DropProblem")
                    .await
                    .len()
                    == 1
        },
    )
    .await;
    let keep_before = node_conditions(&admin, &node.name, "KeepProblem")
        .await
        .remove(0);
    agent.stop().await;

    // A new agent whose sources still include KeepProblem but not DropProblem.
    tokio::time::sleep(Duration::from_millis(1100)).await; // a new second, so a rewrite would show
    let (agent, _state2) = start_agent_with(admin.clone(), &node.name, |c| {
        c.declared_conditions = vec!["KeepProblem".into()];
    })
    .await;
    eventually(Duration::from_secs(10), "DropProblem removed", || async {
        node_conditions(&admin, &node.name, "DropProblem")
            .await
            .is_empty()
    })
    .await;
    let keep = node_conditions(&admin, &node.name, "KeepProblem").await;
    assert_eq!(keep.len(), 1, "no duplicate after restart");
    assert_eq!(keep[0].status, "True");
    assert_eq!(
        keep[0].last_transition_time,
        keep_before.last_transition_time
    );
    assert_eq!(
        node_conditions(&admin, &node.name, "NodeGuardPolicyInvalid")
            .await
            .len(),
        1
    );

    // Its source evaluates again: status changes, transition time moves.
    agent.reporter.set(
        "KeepProblem",
        desired(Status::False, "Fixed", "Keep is fine again."),
    );
    eventually(Duration::from_secs(10), "KeepProblem False", || async {
        node_conditions(&admin, &node.name, "KeepProblem")
            .await
            .first()
            .is_some_and(|c| c.status == "False")
    })
    .await;
    let keep = node_conditions(&admin, &node.name, "KeepProblem").await;
    assert!(keep[0].last_transition_time > keep_before.last_transition_time);
    // The source goes away: the condition goes too.
    agent.reporter.remove("KeepProblem");
    eventually(Duration::from_secs(10), "KeepProblem removed", || async {
        node_conditions(&admin, &node.name, "KeepProblem")
            .await
            .is_empty()
    })
    .await;
    agent.stop().await;
}

const HEARTBEAT: Duration = Duration::from_secs(8);

/// Starts an agent for `node` whose `SteadyCheck` condition stays False,
/// heartbeating every [`HEARTBEAT`], and waits until the Node shows it.
async fn steady_agent(
    admin: &kube::Client,
    node: &str,
) -> (nodeguard::agent::RunningAgent, TempDir) {
    let (agent, state) = start_agent_with(admin.clone(), node, |c| {
        c.report.heartbeat = HEARTBEAT;
        c.declared_conditions = vec!["SteadyCheck".into()];
    })
    .await;
    agent.reporter.set(
        "SteadyCheck",
        desired(Status::False, "Steady", "Nothing wrong."),
    );
    eventually(
        Duration::from_secs(10),
        "SteadyCheck on the node",
        || async { node_conditions(admin, node, "SteadyCheck").await.len() == 1 },
    )
    .await;
    (agent, state)
}

async fn steady_heartbeat(
    admin: &kube::Client,
    node: &str,
) -> Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time> {
    node_conditions(admin, node, "SteadyCheck")
        .await
        .remove(0)
        .last_heartbeat_time
}

/// Starts the agent again on a Node whose `SteadyCheck` heartbeat reads
/// `before`, and checks what the restart tests are about: it found nothing
/// to write.
async fn restart_finding_nothing_to_write(
    admin: &kube::Client,
    node: &str,
    before: &Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
) -> (nodeguard::agent::RunningAgent, TempDir) {
    let restarted = steady_agent(admin, node).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        &steady_heartbeat(admin, node).await,
        before,
        "the restarted agent wrote at once: this test needs it to find its conditions current"
    );
    restarted
}

/// An agent restarted within a heartbeat of its last write finds its
/// conditions current and writes nothing; it must still heartbeat when they
/// fall due, though nothing else changes the Node (no kubelet here, as on a
/// node whose status the kubelet writes only every few minutes).
#[tokio::test]
async fn a_restarted_agent_whose_conditions_are_current_keeps_heartbeating() {
    let admin = admin_client().await;
    let node = TestNode::create(&admin, "restart-heartbeat", &[]).await;
    let (agent, _state) = steady_agent(&admin, &node.name).await;
    agent.stop().await;

    let before = steady_heartbeat(&admin, &node.name).await;
    // A new second, so that a write at the start would show.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (agent, _state2) = restart_finding_nothing_to_write(&admin, &node.name, &before).await;
    eventually(
        HEARTBEAT * 3,
        "a heartbeat from the restarted agent",
        || async { steady_heartbeat(&admin, &node.name).await > before },
    )
    .await;
    agent.stop().await;
}

/// The clock set back across a restart: the Node's heartbeats read as later
/// than now. The restarted agent heartbeats one interval after its start,
/// not one interval after the clock has caught up with them.
#[tokio::test]
async fn a_restarted_agent_finding_heartbeats_from_the_future_heartbeats_within_one_interval() {
    let admin = admin_client().await;
    let node = TestNode::create(&admin, "future-heartbeat", &[]).await;
    let (agent, _state) = steady_agent(&admin, &node.name).await;
    agent.stop().await;

    // Every condition on this Node is the agent's (no kubelet): each one's
    // heartbeat 6 s ahead of the clock.
    let ahead = jiff::Timestamp::now() + jiff::SignedDuration::from_secs(6);
    let nodes = Api::<Node>::all(admin.clone());
    let conditions: Vec<serde_json::Value> = nodes
        .get_status(&node.name)
        .await
        .unwrap()
        .status
        .and_then(|s| s.conditions)
        .unwrap_or_default()
        .iter()
        .map(|c| serde_json::json!({"type": c.type_, "lastHeartbeatTime": ahead.round(jiff::Unit::Second).unwrap().to_string()}))
        .collect();
    nodes
        .patch_status(
            &node.name,
            &PatchParams::default(),
            &Patch::Strategic(serde_json::json!({"status": {"conditions": conditions}})),
        )
        .await
        .unwrap();
    let before = steady_heartbeat(&admin, &node.name).await;

    let started = std::time::Instant::now();
    let (agent, _state2) = restart_finding_nothing_to_write(&admin, &node.name, &before).await;
    // Due one heartbeat (8 s) after the start; waiting for the clock to pass
    // the Node's heartbeats first would make it 14 s.
    eventually(
        Duration::from_secs(20),
        "a heartbeat from the restarted agent",
        || async { steady_heartbeat(&admin, &node.name).await != before },
    )
    .await;
    let took = started.elapsed();
    assert!(
        took < Duration::from_millis(11_500),
        "the heartbeat came {took:?} after the start, over one interval ({HEARTBEAT:?}) and the start's time"
    );
    agent.stop().await;
}

/// PATCHes of `nodes/<node>/status` in the API server's audit log.
fn audit_status_patches(node: &str) -> usize {
    audit_completed(&[node])
        .iter()
        .filter(|e| {
            e["verb"] == "patch"
                && e["objectRef"]["resource"] == "nodes"
                && e["objectRef"]["name"] == node
                && e["objectRef"]["subresource"] == "status"
        })
        .count()
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test]
async fn a_thousand_changes_in_one_second_make_a_handful_of_patches() {
    let admin = admin_client().await;
    let node = TestNode::create(&admin, "coalesce", &[]).await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;
    eventually(Duration::from_secs(10), "initial write", || async {
        node_conditions(&admin, &node.name, "NodeGuardPolicyInvalid")
            .await
            .len()
            == 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let audit_before = audit_status_patches(&node.name);
    let writes_before = metric(
        &http_get(agent.addr, "/metrics").await.1,
        "nodeguard_condition_writes_total",
    );

    let start = std::time::Instant::now();
    for i in 0..1000u32 {
        let status = if i % 2 == 0 {
            Status::True
        } else {
            Status::False
        };
        agent
            .reporter
            .set("Flood", desired(status, "Flooding", format!("change {i}.")));
        if i % 10 == 9 {
            tokio::time::sleep(Duration::from_millis(9)).await;
        }
    }
    // About a second; longer when the machine is busy, and the bound on
    // patches below follows the time actually taken.
    let took = start.elapsed();
    eprintln!("1000 changes in {took:?}");
    eventually(Duration::from_secs(10), "last change written", || async {
        node_conditions(&admin, &node.name, "Flood")
            .await
            .first()
            .is_some_and(|c| c.message.as_deref() == Some("change 999."))
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await; // the audit log is written after the response
    let patches = audit_status_patches(&node.name) - audit_before;
    let writes = metric(
        &http_get(agent.addr, "/metrics").await.1,
        "nodeguard_condition_writes_total",
    ) - writes_before;
    eprintln!(
        "1000 changes -> {patches} PATCH nodes/status in the audit log, {writes} writes in metrics"
    );
    // Writes are at least 250 ms apart: one per window while changes
    // arrive, plus the first and the last, plus one of slack.
    let bound = (took.as_millis() as f64 / 250.0).ceil() as usize + 3;
    assert!(
        (1..=bound).contains(&patches),
        "{patches} patches for 1000 changes over {took:?} (at most {bound})"
    );
    assert_eq!(patches as f64, writes, "audit log and metrics agree");
    agent.stop().await;
}

#[tokio::test]
async fn eligibility_changes_are_events_on_the_node() {
    let admin = admin_client().await;
    let node = TestNode::create(&admin, "eligible-event", &[]).await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;
    eventually(Duration::from_secs(10), "agent ready", || async {
        http_get(agent.addr, "/readyz").await.0 == 200
    })
    .await;
    let nodes: Api<Node> = Api::all(admin.clone());
    let taint = serde_json::json!({"spec": {"taints": [
        {"key": "ToBeDeletedByClusterAutoscaler", "value": "1", "effect": "NoSchedule"}]}});
    nodes
        .patch(&node.name, &PatchParams::default(), &Patch::Merge(&taint))
        .await
        .unwrap();
    eventually(Duration::from_secs(10), "NodeIneligible event", || async {
        kubectl(&["events", "-A", "--for", &format!("node/{}", node.name)])
            .contains("NodeIneligible")
    })
    .await;
    agent.stop().await;
}

#[tokio::test]
async fn the_pod_watch_sees_only_this_nodes_pods() {
    let admin = admin_client().await;
    let here = TestNode::create(&admin, "pods-here", &[]).await;
    let there = TestNode::create(&admin, "pods-there", &[]).await;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), TEST_NAMESPACE);
    let mut names = Vec::new();
    for (i, node) in [&here.name, &there.name, &here.name].iter().enumerate() {
        let name = unique_name(&format!("p{i}"));
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "example.invalid/none"}]},
        }))
        .unwrap();
        pods.create(&PostParams::default(), &pod).await.unwrap();
        names.push(name);
    }
    let (agent, _state) = start_agent(admin.clone(), &here.name).await;
    let mut rx = agent.pods.clone();
    let want: Vec<String> = vec![
        format!("{TEST_NAMESPACE}/{}", names[0]),
        format!("{TEST_NAMESPACE}/{}", names[2]),
    ];
    let mut got = Vec::new();
    eventually(Duration::from_secs(10), "pods of this node", || {
        got = rx
            .borrow_and_update()
            .as_ref()
            .map(|s| s.keys().cloned().collect())
            .unwrap_or_default();
        std::future::ready(got.len() == 2)
    })
    .await;
    let mut want_sorted = want.clone();
    want_sorted.sort();
    assert_eq!(got, want_sorted);
    for n in names {
        let _ = pods.delete(&n, &Default::default()).await;
    }
    agent.stop().await;
}

/// Exact repeats become a series on the first Event, also for an Event
/// that names its source component (a monitor imported from NPD: written
/// through core/v1, read back through both APIs).
#[tokio::test]
async fn repeated_events_aggregate_into_a_series() {
    let admin = admin_client().await;
    let node = TestNode::create(&admin, "series", &[]).await;
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;
    for (reason, source) in [
        ("RepeatedThing", None),
        ("RepeatedKernelThing", Some("kernel-monitor")),
    ] {
        for _ in 0..4 {
            agent.reporter.event_from(
                source,
                EventKind::Warning,
                reason,
                "Detect",
                "The same thing happened again.",
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let events: Api<k8s_openapi::api::events::v1::Event> =
            Api::namespaced(admin.clone(), "default");
        let mine = || {
            let events = events.clone();
            let node = node.name.clone();
            async move {
                let list = events.list(&Default::default()).await.unwrap();
                list.items
                    .into_iter()
                    .filter(|e| {
                        e.reason.as_deref() == Some(reason)
                            && e.regarding.as_ref().and_then(|r| r.name.as_deref())
                                == Some(node.as_str())
                    })
                    .collect::<Vec<_>>()
            }
        };
        eventually(
            Duration::from_secs(10),
            &format!("one {reason} event with a series of 4"),
            || async {
                let mine = mine().await;
                mine.len() == 1 && mine[0].series.as_ref().is_some_and(|s| s.count == 4)
            },
        )
        .await;
        let ev = mine().await.remove(0);
        let regarding = ev.regarding.unwrap();
        assert_eq!(regarding.kind.as_deref(), Some("Node"));
        assert_eq!(regarding.api_version.as_deref(), Some("v1"));
        assert!(regarding.uid.is_some());
        assert_eq!(
            ev.reporting_controller.as_deref(),
            Some("nodeguard.io/agent")
        );
        assert_eq!(
            ev.reporting_instance,
            Some(format!("nodeguard-{}", node.name))
        );
        let core: Api<k8s_openapi::api::core::v1::Event> =
            Api::namespaced(admin.clone(), "default");
        let core = core
            .get(ev.metadata.name.as_deref().unwrap())
            .await
            .unwrap();
        assert_eq!(
            core.source.clone().and_then(|s| s.component),
            source.map(str::to_string),
            "{reason}: the source component kubectl shows"
        );
        if source.is_some() {
            // As on NPD's Events: the legacy count and times that readers
            // of core Events (kubectl's sort, event exporters) go by.
            assert_eq!(core.count, Some(4), "{reason}: {core:?}");
            let (first, last) = (
                core.first_timestamp.clone().expect("firstTimestamp").0,
                core.last_timestamp.clone().expect("lastTimestamp").0,
            );
            assert!(last >= first, "{reason}: {first} then {last}");
        }
    }
    agent.stop().await;
}

/// Review finding: a Node name over 118 characters (names may have 253)
/// made every Event's reportingInstance (128 at most) or name (253 at most)
/// too long: the API server refused them all with 422. Both are cut now.
#[tokio::test]
async fn events_reach_a_node_whose_name_is_long() {
    let admin = admin_client().await;
    let prefix = format!(
        "long-{}.{}.{}",
        "a".repeat(60),
        "b".repeat(60),
        "c".repeat(60)
    );
    let node = TestNode::create(&admin, &prefix, &[]).await;
    assert!(node.name.len() > 190, "{}", node.name.len());
    let (agent, _state) = start_agent(admin.clone(), &node.name).await;
    agent.reporter.event(
        EventKind::Warning,
        "FrobnicatorStuck",
        "Detect",
        "The frobnicator on /dev/frob0 is stuck.",
    );
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(admin.clone(), "default");
    eventually(
        Duration::from_secs(15),
        "the Event on the long-named node",
        || async {
            events
                .list(&kube::api::ListParams::default())
                .await
                .is_ok_and(|l| {
                    l.items.iter().any(|e| {
                        e.reason.as_deref() == Some("FrobnicatorStuck")
                            && e.regarding.as_ref().and_then(|r| r.name.as_deref())
                                == Some(node.name.as_str())
                    })
                })
        },
    )
    .await;
    agent.stop().await;
}

/// Review of the core/v1 Events: with RBAC from before the chart granted
/// them (an image bumped without the chart, hand-written roles), an Event
/// with a source was refused with 403 and retried for seconds, holding up
/// every Event behind it (a shutdown's among them), then lost. Now it goes
/// through events.k8s.io without its source, at once, and nothing waits.
#[tokio::test]
async fn an_event_whose_source_rbac_refuses_goes_without_it_and_holds_nothing_up() {
    use nodeguard::report::{ReportConfig, Reporter, kube::KubeEvents, run_event_publisher};
    let admin = admin_client().await;
    let node = TestNode::create(&admin, "core-refused", &[]).await;
    let sa = unique_name("old-rbac");
    let client = service_account_client(&admin, &sa).await;
    let _grant = Grant::new(
        &admin,
        "old-rbac",
        serde_json::json!([{"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]}]),
        &sa,
    )
    .await;
    let node_obj = Api::<Node>::all(admin.clone())
        .get(&node.name)
        .await
        .unwrap();
    let (_node_tx, node_rx) = tokio::sync::watch::channel(Some(std::sync::Arc::new(node_obj)));
    let mut registry = prometheus_client::registry::Registry::default();
    let config = ReportConfig::default();
    let (reporter, queue) = Reporter::new(&config, &mut registry);
    let stop = tokio_util::sync::CancellationToken::new();
    tokio::spawn(run_event_publisher(
        reporter.clone(),
        queue,
        KubeEvents::new(client, &node.name, node_rx),
        config,
        nodeguard::server::Health::new().register("events", Duration::from_secs(60)),
        stop.clone(),
    ));
    // The role is in force once an Event of the agent's own gets through.
    eventually(Duration::from_secs(10), "RBAC in force", || async {
        reporter
            .event_confirmed(EventKind::Normal, "Warmup", "Check", "warm-up".into())
            .await
    })
    .await;
    let t0 = std::time::Instant::now();
    reporter.event_from(
        Some("kernel-monitor"),
        EventKind::Warning,
        "SourceRefused",
        "DetectProblem",
        "An imported monitor's Event.",
    );
    let behind = reporter.event_confirmed(
        EventKind::Normal,
        "BehindIt",
        "Check",
        "queued behind it".into(),
    );
    assert!(
        tokio::time::timeout(Duration::from_secs(5), behind)
            .await
            .unwrap_or(false),
        "the Event queued behind it is stored"
    );
    let took = t0.elapsed();
    assert!(
        took < Duration::from_millis(800),
        "the Event behind it waited {took:?}"
    );
    let refused = node_event(&admin, &node.name, "SourceRefused")
        .await
        .expect("the refused source's Event is stored without its source");
    assert_eq!(
        refused.reporting_controller.as_deref(),
        Some("nodeguard.io/agent")
    );
    stop.cancel();
}
