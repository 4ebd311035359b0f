//! The chart's alerts as the tests read them: rendered by the real `helm`,
//! judged by the real `promtool` (e2e/promtool builds it), and compared with
//! what a real agent's /metrics exposes.
#![allow(dead_code)] // each test binary uses a part

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};

use super::{helm_binary, repo_root};

/// Release and namespace the rules are rendered for; the unit tests in
/// tests/fixtures/alerts/ expect job="nodeguard/nodeguard".
pub const RELEASE: &str = "nodeguard";

/// Labels Prometheus adds to every series of a PodMonitor target (the
/// chart's PodMonitor relabels the pod's node into `node`).
pub const TARGET_LABELS: [&str; 5] = ["job", "instance", "namespace", "pod", "node"];

/// The promtool e2e/promtool built; fails (never skips) when it is missing.
pub fn promtool() -> PathBuf {
    super::cached_path("e2e/promtool")
}

/// `helm template` of the chart's PrometheusRule with `sets`; None when the
/// chart renders none. `api` says whether the Prometheus Operator's API is
/// served.
pub fn render_rule(api: bool, sets: &[&str]) -> Option<Value> {
    render_rule_for(RELEASE, RELEASE, api, sets).expect("helm template")
}

/// [`render_rule`] for a release in a namespace; Err(helm's error).
pub fn render_rule_for(
    release: &str,
    namespace: &str,
    api: bool,
    sets: &[&str],
) -> Result<Option<Value>, String> {
    let chart = repo_root().join("charts/nodeguard");
    let mut cmd = Command::new(helm_binary());
    cmd.args(["template", release])
        .arg(&chart)
        .args(["-n", namespace])
        .args(["--kube-version", &super::template_kube_version()]);
    if api {
        cmd.args(["--api-versions", "monitoring.coreos.com/v1/PrometheusRule"]);
    }
    for s in sets {
        cmd.args(["--set", s]);
    }
    let out = cmd.output().expect("run helm");
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    Ok(document_of(
        &String::from_utf8(out.stdout).unwrap(),
        "PrometheusRule",
    ))
}

/// The first document of `kind` in rendered YAML, as JSON.
pub fn document_of(rendered: &str, kind: &str) -> Option<Value> {
    rendered
        .split("\n---")
        .find(|d| d.contains(&format!("kind: {kind}")))
        .map(|d| serde_saphyr::from_str::<Value>(d).expect("a rendered document is YAML"))
}

/// The rendered rule with the alerts (and the PodMonitor they read) on, as
/// a promtool rule file's content.
pub fn rule_groups(sets: &[&str]) -> Value {
    rule_groups_for(RELEASE, RELEASE, sets)
}

/// [`rule_groups`] for a release in a namespace.
pub fn rule_groups_for(release: &str, namespace: &str, sets: &[&str]) -> Value {
    let mut all = vec![
        "metrics.prometheusRule.enabled=true",
        "metrics.podMonitor.enabled=true",
    ];
    all.extend_from_slice(sets);
    let rule = render_rule_for(release, namespace, true, &all)
        .expect("helm template")
        .expect("the chart renders a PrometheusRule");
    rule["spec"].clone()
}

/// (alert name, expression) of every alert in `groups`.
pub fn alerts(groups: &Value) -> Vec<(String, String)> {
    groups["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap())
        .filter_map(|r| {
            Some((
                r["alert"].as_str()?.to_string(),
                r["expr"].as_str()?.to_string(),
            ))
        })
        .collect()
}

/// What one alert expression reads of nodeguard's own metrics: each series
/// name with the labels the expression needs on it (its own matchers, the
/// `by (...)` of an aggregation around it, and any `on (...)`), without the
/// target's labels.
pub fn reads(expr: &str) -> std::collections::BTreeMap<String, BTreeSet<String>> {
    let metric = regex::Regex::new(r"\b(nodeguard_[a-z_]+)(\{([^}]*)\})?").unwrap();
    let matcher = regex::Regex::new(r"([a-z_]+)\s*(=~|!~|!=|=)").unwrap();
    let grouping = regex::Regex::new(r"\b(by|on)\s*\(([^)]*)\)").unwrap();
    let labels_of = |list: &str| -> Vec<String> {
        list.split(',')
            .map(|l| l.trim().to_string())
            .filter(|l| !l.is_empty())
            .collect()
    };
    // (span of the aggregated expression, labels) for every `by (...)`;
    // `on (...)` applies to the whole expression.
    let mut scoped: Vec<(std::ops::Range<usize>, Vec<String>)> = Vec::new();
    for c in grouping.captures_iter(expr) {
        let labels = labels_of(&c[2]);
        if &c[1] == "on" {
            scoped.push((0..expr.len(), labels));
            continue;
        }
        let after = c.get(0).unwrap().end();
        let rest = &expr[after..];
        let Some(open) = rest.find('(') else { continue };
        let mut depth = 0;
        let mut close = rest.len();
        for (i, ch) in rest[open..].char_indices() {
            match ch {
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth == 0 {
                        close = open + i;
                        break;
                    }
                }
                _ => {}
            }
        }
        scoped.push((after + open..after + close, labels));
    }
    let mut out: std::collections::BTreeMap<String, BTreeSet<String>> = Default::default();
    for c in metric.captures_iter(expr) {
        let at = c.get(1).unwrap().start();
        let labels = out.entry(c[1].to_string()).or_default();
        if let Some(m) = c.get(3) {
            for l in matcher.captures_iter(m.as_str()) {
                labels.insert(l[1].to_string());
            }
        }
        for (span, ls) in &scoped {
            if span.contains(&at) {
                labels.extend(ls.iter().cloned());
            }
        }
        labels.retain(|l| !TARGET_LABELS.contains(&l.as_str()));
    }
    out
}

/// One sample of an exposition: series name, labels, value.
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

/// The samples of an OpenMetrics / Prometheus text exposition (the subset
/// the agent writes: no timestamps, no exemplars).
pub fn samples(text: &str) -> Vec<Sample> {
    let line = regex::Regex::new(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$").unwrap();
    let label = regex::Regex::new(r#"([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)""#).unwrap();
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let c = line.captures(l)?;
            let labels = c
                .get(3)
                .map(|m| {
                    label
                        .captures_iter(m.as_str())
                        .map(|l| (l[1].to_string(), l[2].to_string()))
                        .collect()
                })
                .unwrap_or_default();
            Some(Sample {
                name: c[1].to_string(),
                labels,
                value: c[4].parse().ok()?,
            })
        })
        .collect()
}

/// What is wrong between the alerts in `groups` and an agent's /metrics
/// `text`: every nodeguard metric an alert reads must be exposed with at
/// least one series, and every label the alert matches on or keeps must be
/// on those series. Empty when all is well.
pub fn missing_from(groups: &Value, text: &str) -> Vec<String> {
    let samples = samples(text);
    let mut problems = Vec::new();
    for (alert, expr) in alerts(groups) {
        for (name, labels) in reads(&expr) {
            let series: Vec<&Sample> = samples.iter().filter(|s| s.name == name).collect();
            if series.is_empty() {
                problems.push(format!("{alert}: no series {name} in /metrics"));
                continue;
            }
            for l in &labels {
                if !series.iter().all(|s| s.labels.iter().any(|(k, _)| k == l)) {
                    problems.push(format!("{alert}: {name} has no label {l:?}"));
                }
            }
        }
    }
    problems
}

/// Writes `groups` as rules.yaml into `dir` (JSON is YAML) and runs
/// `promtool check rules` on it; promtool's output.
pub fn check_rules(dir: &Path, groups: &Value) -> String {
    std::fs::write(
        dir.join("rules.yaml"),
        serde_json::to_vec_pretty(groups).unwrap(),
    )
    .unwrap();
    let out = Command::new(promtool())
        .args(["check", "rules", "rules.yaml"])
        .current_dir(dir)
        .output()
        .expect("run promtool");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "promtool check rules:\n{text}");
    text
}

/// `promtool test rules FILE` in `dir` (where rules.yaml is); (passed, output).
pub fn test_rules(dir: &Path, file: &str) -> (bool, String) {
    let out = Command::new(promtool())
        .args(["test", "rules", file])
        .current_dir(dir)
        .output()
        .expect("run promtool");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// A promtool unit test that feeds scraped expositions, one minute apart, as
/// one target with `target` labels, the last one held until `minutes`, and
/// expects no alert at all at the end: what a healthy agent's series must
/// give. A series missing from a scrape is a gap there.
pub fn quiet_test(
    groups: &Value,
    scrapes: &[&str],
    target: &[(&str, &str)],
    minutes: u32,
) -> Value {
    let mut by_series: std::collections::BTreeMap<String, Vec<Option<f64>>> = Default::default();
    let mut up = target.to_vec();
    up.sort();
    by_series.insert(
        format!("up{{{}}}", render_labels(&up)),
        vec![Some(1.0); scrapes.len()],
    );
    by_series.extend(series_of(scrapes, target));
    let hold = minutes.saturating_sub(scrapes.len() as u32 - 1);
    let series: Vec<Value> = by_series
        .into_iter()
        .map(|(series, values)| {
            let last = values.iter().rev().flatten().next().copied().unwrap_or(0.0);
            let mut v: Vec<String> = values[..values.len() - 1]
                .iter()
                .map(|x| x.map_or("_".to_string(), |x| x.to_string()))
                .collect();
            v.push(format!("{last}x{hold}"));
            json!({"series": series, "values": v.join(" ")})
        })
        .collect();
    let tests: Vec<Value> = alerts(groups)
        .into_iter()
        .map(|(name, _)| json!({"eval_time": format!("{minutes}m"), "alertname": name, "exp_alerts": []}))
        .collect();
    json!({
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": tests}],
    })
}

/// Every finite sample of `scrapes` as a promtool series of one target
/// with `target` labels, and its value in each scrape (`None` where a
/// scrape lacks it).
fn series_of(
    scrapes: &[&str],
    target: &[(&str, &str)],
) -> std::collections::BTreeMap<String, Vec<Option<f64>>> {
    let mut by_series: std::collections::BTreeMap<String, Vec<Option<f64>>> = Default::default();
    for (i, text) in scrapes.iter().enumerate() {
        for s in samples(text) {
            if !s.value.is_finite() {
                continue;
            }
            let mut labels: Vec<(&str, &str)> = s
                .labels
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            labels.extend_from_slice(target);
            let key = format!("{}{{{}}}", s.name, render_labels(&labels));
            by_series
                .entry(key)
                .or_insert_with(|| vec![None; scrapes.len()])[i] = Some(s.value);
        }
    }
    by_series
}

fn render_labels(labels: &[(&str, &str)]) -> String {
    labels
        .iter()
        .map(|(k, v)| format!("{k}={}", serde_json::to_string(v).unwrap()))
        .collect::<Vec<_>>()
        .join(",")
}

/// One alert of the shape node-problem-detector's users write on its
/// exporter: the community chart's PrometheusRule has only two, a rule per
/// reason on `increase(problem_counter{reason="R"}[2m]) > 0` and a rule per
/// permanent problem on `increase(problem_gauge{reason="R",type="T"}[2m]) > 0`,
/// both `for: 1s`.
pub struct NpdAlert {
    pub name: String,
    pub metric: &'static str,
    pub matchers: Vec<(String, String)>,
    pub severity: &'static str,
}

/// The NPD-shaped alerts for every rule of an NPD monitor config (its
/// `rules`: a counter alert per reason, a gauge alert per permanent rule).
pub fn npd_style_alerts(config: &Value) -> Vec<NpdAlert> {
    let mut out: Vec<NpdAlert> = Vec::new();
    for rule in config["rules"].as_array().expect("an NPD config's rules") {
        let reason = rule["reason"]
            .as_str()
            .expect("a rule's reason")
            .to_string();
        let counter = format!("Counter{reason}");
        if !out.iter().any(|a| a.name == counter) {
            out.push(NpdAlert {
                name: counter,
                metric: "problem_counter",
                matchers: vec![("reason".into(), reason.clone())],
                severity: "warning",
            });
        }
        if rule["type"] == "permanent" {
            let condition = rule["condition"]
                .as_str()
                .expect("a permanent rule's condition");
            let gauge = format!("Gauge{condition}{reason}");
            if !out.iter().any(|a| a.name == gauge) {
                out.push(NpdAlert {
                    name: gauge,
                    metric: "problem_gauge",
                    matchers: vec![
                        ("reason".into(), reason),
                        ("type".into(), condition.to_string()),
                    ],
                    severity: "critical",
                });
            }
        }
    }
    out
}

/// `alerts` as a promtool rule file's content.
pub fn npd_alert_groups(alerts: &[NpdAlert]) -> Value {
    let rules: Vec<Value> = alerts
        .iter()
        .map(|a| {
            let selector = a
                .matchers
                .iter()
                .map(|(k, v)| format!("{k}={}", serde_json::to_string(v).unwrap()))
                .collect::<Vec<_>>()
                .join(",");
            json!({
                "alert": a.name,
                "expr": format!("increase({}{{{selector}}}[2m]) > 0", a.metric),
                "for": "1s",
                "labels": {"severity": a.severity},
            })
        })
        .collect();
    json!({"groups": [{"name": "npd", "rules": rules}]})
}

/// The alerts of `alerts` that fire when an exporter's series step from
/// the scrape `before` to `after`: every series an alert selects that is in
/// both scrapes and larger after, with the labels Prometheus gives the alert
/// (the series', the target's, the rule's), sorted.
pub fn npd_alerts_firing(
    alerts: &[NpdAlert],
    before: &str,
    after: &str,
    target: &[(&str, &str)],
) -> Vec<(String, std::collections::BTreeMap<String, String>)> {
    let (before, after) = (samples(before), samples(after));
    let selected = |s: &&Sample, a: &NpdAlert| {
        s.name == a.metric
            && a.matchers
                .iter()
                .all(|(k, v)| s.labels.iter().any(|(l, w)| l == k && w == v))
    };
    let mut out = Vec::new();
    for a in alerts {
        for s in after.iter().filter(|s| selected(s, a)) {
            let was = before
                .iter()
                .filter(|b| selected(b, a))
                .find(|b| b.labels == s.labels);
            if was.is_some_and(|b| s.value > b.value) {
                let mut labels: std::collections::BTreeMap<String, String> =
                    s.labels.iter().cloned().collect();
                for (k, v) in target {
                    labels.insert(k.to_string(), v.to_string());
                }
                labels.insert("severity".into(), a.severity.into());
                out.push((a.name.clone(), labels));
            }
        }
    }
    out.sort();
    out
}

/// A promtool unit test of the rules in rules.yaml over one target's two
/// scrapes as Prometheus would store them at a 15 s scrape and evaluation
/// interval: `before` at 0 to 45 s, `after` from 60 s to 6 min (a series
/// missing from a scrape is a gap there). At 2 min exactly the alerts in
/// `firing` fire, and every other alert of `alerts` is quiet.
pub fn step_test(
    alerts: &[NpdAlert],
    before: &str,
    after: &str,
    target: &[(&str, &str)],
    firing: &[(String, std::collections::BTreeMap<String, String>)],
) -> Value {
    const BEFORE: usize = 4;
    const AFTER: usize = 21;
    let series: Vec<Value> = series_of(&[before, after], target)
        .into_iter()
        .map(|(series, values)| {
            let (b, a) = (values[0], values[1]);
            let value = |x: Option<f64>| x.map_or("_".to_string(), |x| x.to_string());
            let values: Vec<String> = std::iter::repeat_n(value(b), BEFORE)
                .chain(std::iter::repeat_n(value(a), AFTER))
                .collect();
            json!({"series": series, "values": values.join(" ")})
        })
        .collect();
    let cases: Vec<Value> = alerts
        .iter()
        .map(|a| {
            let exp: Vec<Value> = firing
                .iter()
                .filter(|(name, _)| *name == a.name)
                .map(|(_, labels)| json!({"exp_labels": labels}))
                .collect();
            json!({"eval_time": "2m", "alertname": a.name, "exp_alerts": exp})
        })
        .collect();
    json!({
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "15s",
        "tests": [{"interval": "15s", "input_series": series, "alert_rule_test": cases}],
    })
}
