//! The chart's alerts (templates/prometheusrule.yaml) with the real `helm`
//! and the real `promtool`: `promtool check rules`, the unit tests in
//! tests/fixtures/alerts/ (series shaped like the agent's /metrics), every
//! alert with a test that fires it and a runbook in the README, when the
//! chart renders the rule, and a real agent against the real control plane
//! exposing every series and label the alerts read. The VM scenario
//! kube-alerts does the last on the chart's pod on a real node.

mod support;

use std::collections::BTreeSet;
use std::io::Write;
use std::time::Duration;

use support::alerts::*;
use support::notify::NotifySocket;
use support::*;

/// A directory with the rendered rules and the unit tests beside them.
fn rules_dir(sets: &[&str]) -> (TempDir, serde_json::Value) {
    let dir = TempDir::new("alerts");
    let groups = rule_groups(sets);
    let out = check_rules(&dir.path, &groups);
    let count = alerts(&groups).len();
    assert!(
        out.contains(&format!("SUCCESS: {count} rules found")),
        "promtool check rules:\n{out}"
    );
    std::fs::copy(
        repo_root().join("tests/fixtures/alerts/nodeguard_test.yaml"),
        dir.path.join("nodeguard_test.yaml"),
    )
    .unwrap();
    (dir, groups)
}

#[test]
fn the_alerts_pass_promtool_check_and_their_unit_tests() {
    let (dir, _) = rules_dir(&[]);
    let (ok, out) = test_rules(&dir.path, "nodeguard_test.yaml");
    assert!(ok, "promtool test rules:\n{out}");
    assert!(out.contains("SUCCESS"), "{out}");
}

#[test]
fn the_unit_tests_fail_when_an_alert_changes() {
    // The tests can fail: a threshold that no longer fires, or a changed
    // description, breaks them.
    let (dir, mut groups) = rules_dir(&[]);
    for rule in groups["groups"][0]["rules"].as_array_mut().unwrap() {
        if rule["alert"] == "NodeguardLoopStuck" {
            rule["for"] = "30m".into();
        }
    }
    check_rules(&dir.path, &groups);
    let (ok, out) = test_rules(&dir.path, "nodeguard_test.yaml");
    assert!(
        !ok,
        "a 30 m `for:` must break NodeguardLoopStuck's test:\n{out}"
    );
    assert!(out.contains("NodeguardLoopStuck"), "{out}");
}

#[test]
fn every_alert_has_a_firing_test_and_a_runbook() {
    let groups = rule_groups(&[]);
    let tests: serde_json::Value = serde_saphyr::from_str(
        &std::fs::read_to_string(repo_root().join("tests/fixtures/alerts/nodeguard_test.yaml"))
            .unwrap(),
    )
    .unwrap();
    let fired: BTreeSet<String> = tests["tests"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|t| t["alert_rule_test"].as_array().unwrap())
        .filter(|a| a["exp_alerts"].as_array().is_some_and(|e| !e.is_empty()))
        .map(|a| a["alertname"].as_str().unwrap().to_string())
        .collect();
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let rules: Vec<serde_json::Value> = groups["groups"][0]["rules"].as_array().unwrap().clone();
    assert!(rules.len() >= 13, "{rules:?}");
    for rule in &rules {
        let name = rule["alert"].as_str().unwrap();
        assert!(fired.contains(name), "no unit test makes {name} fire");
        assert!(
            readme.contains(&format!("#### {name}\n")),
            "README has no runbook heading for {name}"
        );
        let url = rule["annotations"]["runbook_url"].as_str().unwrap();
        assert!(
            url.ends_with(&format!("README.md#{}", name.to_lowercase())),
            "{name}: {url}"
        );
        assert!(
            ["critical", "warning", "info"].contains(&rule["labels"]["severity"].as_str().unwrap()),
            "{name}: {rule}"
        );
        assert!(rule["for"].as_str().is_some(), "{name} has no `for:`");
    }
}

#[test]
fn the_rule_renders_only_when_enabled_and_served_and_follows_its_values() {
    assert!(
        render_rule(false, &["metrics.prometheusRule.enabled=true"]).is_none(),
        "no PrometheusRule without the Prometheus Operator's API"
    );
    assert!(render_rule(true, &[]).is_none(), "off by default");
    // Without the PodMonitor nothing has the job the alerts select: every
    // alert would be silent, so the chart refuses it unless told the job.
    let err = render_rule_for(
        RELEASE,
        RELEASE,
        true,
        &["metrics.prometheusRule.enabled=true"],
    )
    .unwrap_err();
    assert!(
        err.contains("metrics.podMonitor.enabled=true") && err.contains("jobSelector"),
        "{err}"
    );
    let own_scrape = render_rule_for(
        RELEASE,
        RELEASE,
        true,
        &[
            "metrics.prometheusRule.enabled=true",
            "metrics.prometheusRule.jobSelector=job=\"node-agents\"",
        ],
    )
    .unwrap();
    assert!(
        own_scrape.is_some(),
        "a jobSelector stands for the PodMonitor"
    );
    let groups = rule_groups(&[
        "metrics.prometheusRule.jobSelector=job=\"node-agents\"",
        "metrics.prometheusRule.kubeStateMetrics=false",
        "metrics.prometheusRule.additionalLabels.team=infra",
        "metrics.prometheusRule.runbookURL=https://runbooks.example/nodeguard/",
    ]);
    let names: Vec<String> = alerts(&groups).into_iter().map(|(n, _)| n).collect();
    assert!(!names.contains(&"NodeguardAgentMissing".to_string()));
    for (name, expr) in alerts(&groups) {
        assert!(
            expr.contains("job=\"node-agents\"") && !expr.contains("nodeguard/nodeguard"),
            "{name}: {expr}"
        );
    }
    for rule in groups["groups"][0]["rules"].as_array().unwrap() {
        assert_eq!(rule["labels"]["team"], "infra", "{rule}");
        assert!(
            rule["annotations"]["runbook_url"]
                .as_str()
                .unwrap()
                .starts_with("https://runbooks.example/nodeguard#"),
            "{rule}"
        );
    }
    // The PodMonitor gives every series the node the agent guards.
    let text = render_with_pod_monitor(&["--set", "metrics.podMonitor.enabled=true"]);
    assert!(
        text.contains("sourceLabels: [__meta_kubernetes_pod_node_name]")
            && text.contains("targetLabel: node"),
        "{text}"
    );
}

/// `helm template` of the chart with the Prometheus Operator's PodMonitor
/// API served and `args` (values); what it rendered.
fn render_with_pod_monitor(args: &[&str]) -> String {
    let out = std::process::Command::new(helm_binary())
        .args(["template", "x"])
        .arg(repo_root().join("charts/nodeguard"))
        .args(["--kube-version", &template_kube_version()])
        .args(["--api-versions", "monitoring.coreos.com/v1/PodMonitor"])
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The PodMonitor takes relabelings after its own (NPD's ServiceMonitor's
/// `host_ip`, which a migrated rule or dashboard may group by) and
/// metricRelabelings, as the migration guide says.
#[test]
fn the_pod_monitor_takes_npds_relabelings_after_its_own() {
    let dir = TempDir::new("podmonitor-values");
    let values = dir.path.join("values.yaml");
    std::fs::write(
        &values,
        "metrics:\n  podMonitor:\n    enabled: true\n    relabelings:\n      - sourceLabels: [__meta_kubernetes_pod_host_ip]\n        targetLabel: host_ip\n    metricRelabelings:\n      - sourceLabels: [__name__]\n        regex: go_.*\n        action: drop\n",
    )
    .unwrap();
    let text = render_with_pod_monitor(&["-f", values.to_str().unwrap()]);
    let monitor = document_of(&text, "PodMonitor").expect("a PodMonitor");
    let endpoint = &monitor["spec"]["podMetricsEndpoints"][0];
    assert_eq!(
        endpoint["relabelings"],
        serde_json::json!([
            {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"},
            {"sourceLabels": ["__meta_kubernetes_pod_host_ip"], "targetLabel": "host_ip"},
        ]),
        "{text}"
    );
    assert_eq!(
        endpoint["metricRelabelings"],
        serde_json::json!([{"sourceLabels": ["__name__"], "regex": "go_.*", "action": "drop"}]),
        "{text}"
    );
    // Neither by default.
    let plain = render_with_pod_monitor(&["--set", "metrics.podMonitor.enabled=true"]);
    assert!(
        !plain.contains("metricRelabelings") && !plain.contains("host_ip"),
        "{plain}"
    );
}

#[test]
fn the_reads_of_an_expression_are_its_metrics_and_labels() {
    let reads_of = |expr: &str| -> Vec<(String, Vec<String>)> {
        reads(expr)
            .into_iter()
            .map(|(m, l)| (m, l.into_iter().collect()))
            .collect()
    };
    assert_eq!(
        reads_of(
            "sum by (namespace, pod, node, target, reason) (increase(nodeguard_watchdog_skipped_pets_total{job=\"a/b\"}[5m])) > 0"
        ),
        [(
            "nodeguard_watchdog_skipped_pets_total".to_string(),
            vec!["reason".to_string(), "target".to_string()]
        )]
    );
    assert_eq!(
        reads_of("nodeguard_condition{job=\"x\", type=\"T\", status!=\"False\"} == 1"),
        [(
            "nodeguard_condition".to_string(),
            vec!["status".to_string(), "type".to_string()]
        )]
    );
    // Each aggregation's labels go to the series inside it; `on` to all.
    assert_eq!(
        reads_of(
            "sum by (job, resource) (increase(nodeguard_a_total{resource=\"x\"}[5m])) > 0 unless on (job, loop) sum by (job) (nodeguard_b_total)"
        ),
        [
            (
                "nodeguard_a_total".to_string(),
                vec!["loop".to_string(), "resource".to_string()]
            ),
            ("nodeguard_b_total".to_string(), vec!["loop".to_string()]),
        ]
    );
    let problems = missing_from(
        &serde_json::json!({"groups": [{"name": "g", "rules": [
            {"alert": "A", "expr": "nodeguard_condition{type=\"T\"} == 1"},
            {"alert": "B", "expr": "nodeguard_gone == 1"}]}]}),
        "# TYPE nodeguard_condition gauge\nnodeguard_condition{status=\"True\"} 1\n",
    );
    assert_eq!(
        problems,
        [
            "A: nodeguard_condition has no label \"type\"",
            "B: no series nodeguard_gone in /metrics"
        ]
    );
}

/// A real agent on the real control plane, serving the systemd watchdog,
/// with a file monitor whose Events a burst of lines rate-limits: every
/// series and label the alerts read is in its /metrics, and promtool finds
/// no alert in two of its scrapes (taken as a minute apart) with the second
/// held for 30 minutes.
#[tokio::test]
async fn a_real_agent_exposes_every_series_the_alerts_read_and_none_fires() {
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "alerts").await;
    let logs = TempDir::new("alert-logs");
    let app_log = logs.path.join("app.log");
    std::fs::write(&app_log, "").unwrap();
    let policy = unique_name("alerts");
    apply_policy(
        &admin,
        &policy,
        serde_json::json!({
            "nodeSelector": selecting(&node.name),
            "monitors": [{
                "name": "app", "source": {"file": {"path": app_log.display().to_string()}},
                "rules": [{"type": "temporary", "reason": "AppCrashed", "pattern": "app crashed (\\d+)"}],
            }],
        }),
    )
    .await;
    let notify = NotifySocket::bind();
    let path = notify.path.display().to_string();
    let (agent, _state) = start_agent_with(admin.clone(), &node.name, |c| {
        c.notify_socket = Some(path);
        c.systemd_watchdog = Some(Duration::from_secs(10));
    })
    .await;
    eventually(Duration::from_secs(20), "agent ready", || async {
        http_get(agent.addr, "/readyz").await.0 == 200
    })
    .await;
    // More Events of one reason than the burst (10): the rest are dropped
    // as rate_limited, which makes nodeguard_events_dropped_total appear.
    {
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&app_log)
            .unwrap();
        for i in 0..15 {
            writeln!(f, "app crashed {i}").unwrap();
        }
    }
    eventually(Duration::from_secs(10), "rate-limited Events", || async {
        http_get(agent.addr, "/metrics").await.1.contains(
            "nodeguard_events_dropped_total{reason=\"AppCrashed\",cause=\"rate_limited\"}",
        )
    })
    .await;
    let (_, first) = http_get(agent.addr, "/metrics").await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (_, text) = http_get(agent.addr, "/metrics").await;
    let (dir, groups) = rules_dir(&[]);
    let problems = missing_from(&groups, &text);
    assert!(
        problems.is_empty(),
        "the alerts read what the agent does not expose:\n{}\n\n/metrics:\n{text}",
        problems.join("\n")
    );
    let target = [
        ("job", "nodeguard/nodeguard"),
        ("instance", "127.0.0.1:9909"),
        ("namespace", "nodeguard"),
        ("pod", "nodeguard-test"),
        ("node", node.name.as_str()),
    ];
    let quiet = quiet_test(&groups, &[&first, &text], &target, 30);
    std::fs::write(
        dir.path.join("quiet_test.yaml"),
        serde_json::to_vec_pretty(&quiet).unwrap(),
    )
    .unwrap();
    let (ok, out) = test_rules(&dir.path, "quiet_test.yaml");
    assert!(ok, "an alert fires on a healthy agent's series:\n{out}");
    agent.stop().await;
    delete_policy(&admin, &policy).await;
}

/// The chart's Grafana dashboard, rendered by the real `helm`: every
/// panel's query (Grafana's variables set to "all"), run by the real
/// `promtool` over two scrapes of a real agent that has seen problems, a
/// failing probe, the systemd watchdog and a graceful shutdown (logind over
/// a private bus, one pod evicted), returns series: no panel that selects
/// nothing. Each query is wrapped in an alert `count(<query>) > 0` that
/// must fire. The first scrape comes before any of it: the panels of
/// problems, probe results and a shutdown's pods must show what happened
/// between the two (`sum(<query>) > 0` a minute in), which a counter born
/// at its first increment would not.
#[tokio::test]
async fn every_dashboard_panel_selects_series_of_a_real_agent() {
    use support::dbus::{LogindPeer, PrivateBus};
    use support::pods::{ensure_priority_class, kubelet_sim, running_pod};

    let queries = dashboard_queries();
    assert!(queries.len() >= 15, "{queries:?}");
    let admin = admin_client().await;
    let node = TestNode::selectable(&admin, "dashboard").await;
    let bus = PrivateBus::start();
    let drop_in = TempDir::new("dashboard-logind.conf.d");
    let peer = LogindPeer::start(&bus.address, Duration::from_secs(30), Some(&drop_in.path)).await;
    let logs = TempDir::new("dashboard-logs");
    let app_log = logs.path.join("app.log");
    std::fs::write(&app_log, "").unwrap();
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let policy = unique_name("dashboard");
    apply_policy(
        &admin,
        &policy,
        serde_json::json!({
            "nodeSelector": selecting(&node.name),
            "monitors": [{
                "name": "app", "source": {"file": {"path": app_log.display().to_string()}},
                "conditions": [{"type": "AppBroken", "reason": "AppFine", "message": "fine"}],
                "rules": [
                    {"type": "temporary", "reason": "AppCrashed", "pattern": "app crashed (\\d+)"},
                    {"type": "permanent", "condition": "AppBroken", "reason": "AppWedged", "pattern": "app wedged"},
                ],
            }],
            "probes": [{"name": "closed", "tcp": {"port": closed}, "periodSeconds": 1,
                        "failureThreshold": 1, "conditionType": "ClosedPortUnhealthy"}],
            "shutdown": {"gracePeriodByPriority": [{"priority": 0, "gracePeriodSeconds": 4}],
                         "logindDropInDir": drop_in.path.display().to_string(),
                         "safetyMarginSeconds": 2},
        }),
    )
    .await;
    ensure_priority_class(&admin, "nodeguard-test-low", 0).await;
    let pod = unique_name("dash-low");
    running_pod(
        &admin,
        &node.name,
        &pod,
        "nodeguard-test-low",
        serde_json::json!({"app": "dash"}),
    )
    .await;
    let (_marked, sim) = kubelet_sim(admin.clone(), node.name.clone());
    let notify = NotifySocket::bind();
    let path = notify.path.display().to_string();
    let address = bus.address.clone();
    let (agent, _state) = start_agent_with(admin.clone(), &node.name, |c| {
        c.notify_socket = Some(path);
        c.systemd_watchdog = Some(Duration::from_secs(10));
        c.system_bus_address = Some(address);
        c.boot_id = "test-boot".into();
    })
    .await;
    eventually(Duration::from_secs(20), "inhibitor taken", || {
        std::future::ready(peer.held() == 1)
    })
    .await;
    // The first scrape before any problem, probe run or shutdown: what
    // happens after it must show as an increase.
    let (_, first) = http_get(agent.addr, "/metrics").await;
    {
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&app_log)
            .unwrap();
        for i in 0..15 {
            writeln!(f, "app crashed {i}").unwrap();
        }
        writeln!(f, "app wedged").unwrap();
    }
    wait_condition(
        &admin,
        &node.name,
        "AppBroken",
        "True",
        Duration::from_secs(10),
        "AppBroken=True",
    )
    .await;
    wait_condition(
        &admin,
        &node.name,
        "ClosedPortUnhealthy",
        "True",
        Duration::from_secs(10),
        "ClosedPortUnhealthy=True",
    )
    .await;
    peer.prepare_for_shutdown(true).await;
    eventually(Duration::from_secs(20), "the shutdown's release", || {
        std::future::ready(peer.held() == 0)
    })
    .await;
    eventually(
        Duration::from_secs(5),
        "the shutdown's pods counted",
        || async {
            http_get(agent.addr, "/metrics")
                .await
                .1
                .contains("nodeguard_shutdown_pods_total{group=\"0\",outcome=\"evicted\"} 1")
        },
    )
    .await;
    // The probe runs every second from the agent's start, so one run may
    // come before the first scrape and none between it and this point (a
    // quick run took all of the above in 0.8 s, and the probe panel showed
    // no increase): wait for a run after the first scrape.
    let failures = "nodeguard_probe_total{probe=\"closed\",target=\"node\",result=\"failure\"}";
    let before = sample(&first, failures).unwrap_or(0.0);
    eventually(
        Duration::from_secs(5),
        "a probe run after the first scrape",
        || async {
            sample(&http_get(agent.addr, "/metrics").await.1, failures).is_some_and(|n| n > before)
        },
    )
    .await;
    let (_, second) = http_get(agent.addr, "/metrics").await;
    sim.abort();
    agent.stop().await;
    delete_policy(&admin, &policy).await;

    // One alert per query, as promtool runs rules: it must fire.
    let dir = TempDir::new("dashboard-rules");
    let mut rules: Vec<serde_json::Value> = queries
        .iter()
        .enumerate()
        .map(|(i, (_, q))| serde_json::json!({"alert": format!("Panel{i}"), "expr": format!("count({q}) > 0")}))
        .collect();
    let target = [
        ("job", "nodeguard/nodeguard"),
        ("instance", "127.0.0.1:9909"),
        ("namespace", "nodeguard"),
        ("pod", "nodeguard-test"),
        ("node", node.name.as_str()),
    ];
    // The panels of what happened between the scrapes must show it: a
    // first problem, probe failures, a shutdown's pods (a counter born at 1
    // in the second scrape shows no increase).
    let happened = [
        "Problems found",
        "Probe results",
        "Pods by priority group and outcome",
    ];
    for (i, (title, q)) in queries.iter().enumerate() {
        if happened.contains(&title.as_str()) {
            rules.push(
                serde_json::json!({"alert": format!("Shows{i}"), "expr": format!("sum({q}) > 0")}),
            );
        }
    }
    let groups = serde_json::json!({"groups": [{"name": "dashboard", "rules": rules}]});
    check_rules(&dir.path, &groups);
    let mut test = quiet_test(&groups, &[&first, &second], &target, 5);
    let mut cases: Vec<serde_json::Value> = queries
        .iter()
        .enumerate()
        .map(|(i, _)| {
            serde_json::json!({"eval_time": "5m", "alertname": format!("Panel{i}"),
                               "exp_alerts": [{"exp_labels": {}}]})
        })
        .collect();
    let shows = queries
        .iter()
        .enumerate()
        .filter(|(_, (title, _))| happened.contains(&title.as_str()))
        .map(|(i, _)| {
            serde_json::json!({"eval_time": "1m", "alertname": format!("Shows{i}"),
                               "exp_alerts": [{"exp_labels": {}}]})
        });
    cases.extend(shows);
    assert_eq!(cases.len(), queries.len() + happened.len());
    test["tests"][0]["alert_rule_test"] = cases.into();
    std::fs::write(
        dir.path.join("dashboard_test.yaml"),
        serde_json::to_vec_pretty(&test).unwrap(),
    )
    .unwrap();
    let (ok, out) = test_rules(&dir.path, "dashboard_test.yaml");
    let names: Vec<String> = queries
        .iter()
        .enumerate()
        .map(|(i, (title, q))| format!("Panel{i}: {title}: {q}"))
        .collect();
    assert!(
        ok,
        "a dashboard panel selects nothing:\n{out}\n{}",
        names.join("\n")
    );
    eprintln!(
        "{} dashboard queries each return series over two scrapes",
        queries.len()
    );
}

/// The queries of the chart's dashboard, rendered with `dashboard.enabled`:
/// (panel title, query with Grafana's variables set to "all").
fn dashboard_queries() -> Vec<(String, String)> {
    let out = std::process::Command::new(helm_binary())
        .args(["template", "nodeguard"])
        .arg(repo_root().join("charts/nodeguard"))
        .args(["--kube-version", &template_kube_version()])
        .args(["--set", "dashboard.enabled=true"])
        .args(["-s", "templates/dashboard.yaml"])
        .output()
        .expect("run helm");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cm: serde_json::Value =
        serde_saphyr::from_str(String::from_utf8_lossy(&out.stdout).trim_start_matches("---"))
            .expect("the ConfigMap is YAML");
    assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
    let dash: serde_json::Value =
        serde_json::from_str(cm["data"]["nodeguard.json"].as_str().unwrap())
            .expect("the dashboard is JSON");
    let mut queries = Vec::new();
    let mut panels: Vec<serde_json::Value> = dash["panels"].as_array().unwrap().clone();
    while let Some(p) = panels.pop() {
        if let Some(inner) = p["panels"].as_array() {
            panels.extend(inner.iter().cloned());
        }
        for t in p["targets"].as_array().into_iter().flatten() {
            let q = t["expr"]
                .as_str()
                .unwrap()
                .replace("$job", ".*")
                .replace("$node", ".*")
                .replace("$__rate_interval", "2m")
                .replace("$__range", "5m");
            assert!(!q.contains('$'), "a variable left in {q}");
            queries.push((p["title"].as_str().unwrap_or("").to_string(), q));
        }
    }
    queries
}
