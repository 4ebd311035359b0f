//! `nodeguard status NODE`: one node at a glance, for an operator.
//!
//! A pure view (plain values, no API types) and its rendering as a table or
//! JSON; `kube` fills it from the API: the conditions nodeguard owns
//! on the Node (by managedFields), the policies in force (the
//! effective-policies annotation), the taints its policies may add, its
//! last Events, and the agent's pod with its `/healthz` answer.

pub mod kube;

use serde::Serialize;

/// Everything `nodeguard status` shows about one node.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeView {
    pub node: String,
    /// The policies in force on the node, with their generations.
    pub policies: Vec<PolicyRef>,
    /// The NodeConditions nodeguard writes (field manager `nodeguard`).
    pub conditions: Vec<ConditionRow>,
    /// Taints nodeguard's policies may add, and whether each is on the node.
    pub taints: Vec<TaintRow>,
    /// nodeguard's Events about the node, oldest first.
    pub events: Vec<EventRow>,
    /// The agent's pod on the node; `None` in host mode or when absent.
    pub agent: Option<AgentRow>,
    /// Sections that could not be read, and why (the rest is shown).
    pub errors: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PolicyRef {
    pub name: String,
    pub generation: i64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ConditionRow {
    #[serde(rename = "type")]
    pub type_: String,
    pub status: String,
    pub reason: String,
    pub message: String,
    /// lastTransitionTime (RFC 3339).
    pub since: Option<String>,
    /// lastHeartbeatTime: when the agent last wrote it.
    pub heartbeat: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TaintRow {
    pub key: String,
    pub effect: String,
    /// What adds it: `graceful shutdown` or `monitor NAME (CONDITION)`.
    pub source: String,
    pub present: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EventRow {
    /// When it last happened (RFC 3339).
    pub time: String,
    #[serde(rename = "type")]
    pub type_: String,
    pub reason: String,
    pub note: String,
    /// How often it happened (1 without a series).
    pub count: i32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentRow {
    pub pod: String,
    pub namespace: String,
    pub phase: String,
    pub ready: bool,
    /// `/healthz` through the API server's pod proxy.
    pub healthz: Healthz,
}

/// The agent's `/healthz` answer: its status code and body, or no code and
/// why it could not be reached.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Healthz {
    pub code: Option<u16>,
    pub body: String,
}

/// Parses the `nodeguard.io/effective-policies` annotation
/// (`name@generation,…`).
pub fn parse_effective(value: &str) -> Vec<PolicyRef> {
    value
        .split(',')
        .filter(|s| !s.is_empty())
        .filter_map(|s| {
            let (name, generation) = s.rsplit_once('@')?;
            Some(PolicyRef {
                name: name.to_string(),
                generation: generation.parse().ok()?,
            })
        })
        .collect()
}

/// The condition nodeguard writes about graceful shutdown's readiness, and
/// the watchdog's; shown on their own lines.
const SHUTDOWN: &str = crate::shutdown::UNAVAILABLE;
const WATCHDOG: &str = crate::watchdog::CONDITION;

fn cut(s: &str, max: usize) -> String {
    let one_line = s.replace('\n', " ");
    match one_line.char_indices().nth(max) {
        Some((at, _)) => format!("{}…", &one_line[..at]),
        None => one_line,
    }
}

/// Columns padded to their widest cell; the last column is not padded.
fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            widths[i] = widths[i].max(cell.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let last = cells.len() - 1;
        let mut out = String::new();
        for (i, cell) in cells.into_iter().enumerate() {
            if i == last {
                out.push_str(&cell);
            } else {
                let pad = widths[i] - cell.chars().count();
                out.push_str(&cell);
                out.push_str(&" ".repeat(pad + 2));
            }
        }
        out.trim_end().to_string() + "\n"
    };
    let mut out = line(headers.iter().map(|h| h.to_string()).collect());
    for row in rows {
        out.push_str(&line(row.clone()));
    }
    out
}

/// The view as the table `nodeguard status` prints.
pub fn render(v: &NodeView) -> String {
    let mut out = format!("Node:      {}\n", v.node);
    let policies = if v.policies.is_empty() {
        "none (no NodeGuardPolicy selects this node, or its agent has not said yet)".to_string()
    } else {
        v.policies
            .iter()
            .map(|p| format!("{}@{}", p.name, p.generation))
            .collect::<Vec<_>>()
            .join(", ")
    };
    out.push_str(&format!("Policies:  {policies}\n"));
    // These conditions say what is *unavailable*: False is good news.
    let about = |t: &str| {
        v.conditions
            .iter()
            .find(|c| c.type_ == t)
            .map(|c| {
                let verdict = match c.status.as_str() {
                    "False" => "ready",
                    "True" => "NOT ready",
                    _ => "unknown",
                };
                format!(
                    "{verdict} ({t}={}, {}): {}",
                    c.status,
                    c.reason,
                    cut(&c.message, 160)
                )
            })
            .unwrap_or_else(|| "not configured on this node".to_string())
    };
    // When the agent last wrote its conditions (it rewrites them every
    // heartbeat interval, 300 s by default): an old time is a stale agent.
    if let Some(newest) = v
        .conditions
        .iter()
        .filter_map(|c| c.heartbeat.as_deref())
        .max()
    {
        out.push_str(&format!(
            "Written:   {newest} (newest heartbeat of its conditions)\n"
        ));
    }
    out.push_str(&format!("Shutdown:  {}\n", about(SHUTDOWN)));
    out.push_str(&format!("Watchdog:  {}\n", about(WATCHDOG)));
    match &v.agent {
        None => out.push_str(
            "Agent:     no nodeguard pod on this node (a host service, or not scheduled here)\n",
        ),
        Some(a) => {
            let health = match a.healthz.code {
                Some(code) => format!("/healthz {code} {}", cut(a.healthz.body.trim(), 120)),
                None => format!("/healthz not reachable: {}", cut(&a.healthz.body, 120)),
            };
            out.push_str(&format!(
                "Agent:     pod {}/{} {}{}; {health}\n",
                a.namespace,
                a.pod,
                a.phase,
                if a.ready { ", Ready" } else { ", not Ready" }
            ));
        }
    }

    for e in &v.errors {
        out.push_str(&format!("Not shown: {e}\n"));
    }
    out.push_str("\nConditions (written by nodeguard):\n");
    if v.conditions.is_empty() {
        out.push_str("  none\n");
    } else {
        let rows: Vec<Vec<String>> = v
            .conditions
            .iter()
            .map(|c| {
                vec![
                    c.type_.clone(),
                    c.status.clone(),
                    c.since.clone().unwrap_or_default(),
                    c.reason.clone(),
                    cut(&c.message, 100),
                ]
            })
            .collect();
        out.push_str(&indent(&table(
            &["TYPE", "STATUS", "SINCE", "REASON", "MESSAGE"],
            &rows,
        )));
    }

    out.push_str("\nTaints nodeguard may add:\n");
    if v.taints.is_empty() {
        out.push_str("  none\n");
    } else {
        let rows: Vec<Vec<String>> = v
            .taints
            .iter()
            .map(|t| {
                vec![
                    format!("{}:{}", t.key, t.effect),
                    if t.present { "on the node" } else { "-" }.to_string(),
                    t.source.clone(),
                ]
            })
            .collect();
        out.push_str(&indent(&table(&["TAINT", "NOW", "ADDED BY"], &rows)));
    }

    out.push_str("\nEvents (nodeguard's, oldest first):\n");
    if v.events.is_empty() {
        out.push_str("  none\n");
    } else {
        let rows: Vec<Vec<String>> = v
            .events
            .iter()
            .map(|e| {
                vec![
                    to_second(&e.time),
                    e.type_.clone(),
                    e.reason.clone(),
                    if e.count > 1 {
                        format!("x{}", e.count)
                    } else {
                        String::new()
                    },
                    cut(&e.note, 120),
                ]
            })
            .collect();
        out.push_str(&indent(&table(
            &["LAST SEEN", "TYPE", "REASON", "COUNT", "MESSAGE"],
            &rows,
        )));
    }
    out
}

/// An RFC 3339 time to the second, for the table (JSON keeps it whole).
fn to_second(t: &str) -> String {
    match t.split_once('.') {
        Some((whole, _)) if t.ends_with('Z') => format!("{whole}Z"),
        _ => t.to_string(),
    }
}

fn indent(s: &str) -> String {
    s.lines().map(|l| format!("  {l}\n")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view() -> NodeView {
        NodeView {
            node: "node-a".into(),
            policies: parse_effective("default@3,gpu@1"),
            conditions: vec![
                ConditionRow {
                    type_: "KernelDeadlock".into(),
                    status: "False".into(),
                    reason: "KernelHasNoDeadlock".into(),
                    message: "kernel has no deadlock".into(),
                    since: Some("2026-11-23T10:00:00Z".into()),
                    heartbeat: None,
                },
                ConditionRow {
                    type_: SHUTDOWN.into(),
                    status: "False".into(),
                    reason: "InhibitorHeld".into(),
                    message: "logind allows 30 s\nthe policy needs 32 s".into(),
                    since: None,
                    heartbeat: None,
                },
            ],
            taints: vec![TaintRow {
                key: "nodeguard.io/shutdown".into(),
                effect: "NoSchedule".into(),
                source: "graceful shutdown".into(),
                present: true,
            }],
            events: vec![EventRow {
                time: "2026-11-23T10:01:00.93861Z".into(),
                type_: "Warning".into(),
                reason: "DockerHung".into(),
                note: "task docker:123 blocked".into(),
                count: 3,
            }],
            agent: None,
            errors: vec![
                "Events: forbidden (needs list events.events.k8s.io in namespace default)".into(),
            ],
        }
    }

    #[test]
    fn the_effective_annotation_is_read_and_bad_entries_skipped() {
        assert_eq!(
            parse_effective("a@1,b.c@12,broken,d@x,"),
            vec![
                PolicyRef {
                    name: "a".into(),
                    generation: 1
                },
                PolicyRef {
                    name: "b.c".into(),
                    generation: 12
                }
            ]
        );
        assert!(parse_effective("").is_empty());
    }

    #[test]
    fn the_table_has_every_section_aligned_and_one_line_per_row() {
        let out = render(&view());
        assert!(out.contains("Policies:  default@3, gpu@1"), "{out}");
        assert!(
            out.contains(
                "Shutdown:  ready (GracefulShutdownUnavailable=False, InhibitorHeld): logind allows 30 s the policy needs 32 s"
            ),
            "{out}"
        );
        assert!(
            out.contains("Watchdog:  not configured on this node"),
            "{out}"
        );
        assert!(out.contains("Agent:     no nodeguard pod"), "{out}");
        assert!(
            out.contains("Not shown: Events: forbidden (needs list"),
            "{out}"
        );
        let conditions: Vec<&str> = out
            .lines()
            .skip_while(|l| !l.starts_with("Conditions"))
            .skip(1)
            .take(3)
            .collect();
        assert!(conditions[0].starts_with("  TYPE "), "{out}");
        // Columns line up: STATUS starts where the type column ends.
        let col = conditions[0].find("STATUS").unwrap();
        assert_eq!(&conditions[1][col..col + 5], "False", "{out}");
        assert!(
            out.contains("nodeguard.io/shutdown:NoSchedule  on the node  graceful shutdown"),
            "{out}"
        );
        assert!(out.contains("DockerHung  x3"), "{out}");
        assert!(out.contains("  2026-11-23T10:01:00Z  Warning"), "{out}");
        let empty = render(&NodeView {
            node: "n".into(),
            ..Default::default()
        });
        assert_eq!(empty.matches("  none\n").count(), 3, "{empty}");
    }

    #[test]
    fn json_carries_full_messages() {
        let v = serde_json::to_value(view()).unwrap();
        assert_eq!(v["policies"][1]["name"], "gpu");
        assert_eq!(
            v["conditions"][1]["message"],
            "logind allows 30 s\nthe policy needs 32 s"
        );
        assert_eq!(v["conditions"][0]["type"], "KernelDeadlock");
        assert_eq!(v["events"][0]["count"], 3);
        assert!(v["agent"].is_null());
    }
}
