//! Which policies apply to a node, and what they add up to.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::trust::{Item, NodeTrust, Refusal};
use super::validate::Validations;
use super::{NodeGuardPolicy, Problem, Selector, validate};

/// The outcome of selecting policies for one node's labels.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Selection {
    /// Valid policies whose selector matches, by name.
    pub applied: Vec<String>,
    /// The generation of each applied policy (for the Node's annotation).
    pub generations: BTreeMap<String, i64>,
    /// Invalid policies that match the node, or whose selector cannot be
    /// read (they might), with their problems. They are not applied.
    pub invalid: Vec<(String, Vec<Problem>)>,
    /// Invalid policies whose last valid generation stays in force
    /// instead: name → that generation.
    pub kept: BTreeMap<String, i64>,
    /// Taint keys that make the node ineligible, besides the autoscaler's.
    pub ineligible_taints: Vec<String>,
    /// Probes of all applied policies; a name taken by an earlier policy
    /// (by name) is a conflict and the later probe is ignored.
    pub probes: Vec<super::probes::ProbeSpec>,
    /// Monitors of all applied policies; a name taken by an earlier policy
    /// is a conflict and the later monitor is ignored.
    pub monitors: Vec<super::monitors::MonitorSpec>,
    /// The shutdown section in force: first applied policy by name.
    pub shutdown: Option<super::ShutdownSpec>,
    /// The watchdog section in force: from the first applied policy (by
    /// name) that has one. Others that differ are listed in `conflicts`.
    pub watchdog: Option<super::WatchdogSpec>,
    /// Sections set differently by several applied policies: (section,
    /// policy whose value is used, policies ignored for it).
    pub conflicts: Vec<(String, String, Vec<String>)>,
    /// Items of applied policies that this node's trust does not allow
    /// (commands, repairs, paths, devices, inhibit delay); each is left out
    /// and the rest of its policy applies.
    pub refused: Vec<Refusal>,
    /// Probes and monitors past the node's limits ([`MAX_PROBES`],
    /// [`MAX_MONITORS`], [`MAX_CONDITIONS`] from all policies together):
    /// left out, see `apply_limits`.
    pub over_limit: Vec<OverLimit>,
    /// The limits reached, e.g. `"128 conditions"`.
    pub limits_reached: Vec<String>,
    /// Probes left out because the Startup probe that gates them is not in
    /// force (refused, over the limits, or its name or condition taken by
    /// another policy's): gated by nothing, they would never run.
    pub ungated: Vec<Ungated>,
}

/// A probe left out because its gate is not in force.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ungated {
    pub policy: String,
    pub probe: String,
    /// The Startup probe it names in `gatedBy`.
    pub gate: String,
    /// Why that probe is not in force, e.g. `refused by this node's trust`.
    pub why: String,
}

impl std::fmt::Display for Ungated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NodeGuardPolicy {}: probe {} is gated by its Startup probe {}, which is not in force here ({}), so {} is not in force either",
            self.policy, self.probe, self.gate, self.why, self.probe
        )
    }
}

/// Most probes a node runs from all its policies together (each a task per
/// target, probing on its period).
pub const MAX_PROBES: usize = 1024;
/// Most monitors a node runs from all its policies together (each a reader
/// thread, a journalctl or a plugin runner, and a state file).
pub const MAX_MONITORS: usize = 64;

/// Most NodeConditions a node's probes and monitors set, all policies
/// together (every condition is in each status write of the Node).
pub const MAX_CONDITIONS: usize = 128;

/// What one policy asks for past the node's limits.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OverLimit {
    pub policy: String,
    /// Names of its probes left out.
    pub probes: Vec<String>,
    /// Names of its monitors left out.
    pub monitors: Vec<String>,
}

/// A section that cannot be merged: the first policy (by name) that sets
/// it wins; policies that set it differently are recorded as a conflict.
struct FirstWins<T> {
    value: Option<T>,
    from: String,
    ignored: Vec<String>,
}

impl<T> Default for FirstWins<T> {
    fn default() -> Self {
        FirstWins {
            value: None,
            from: String::new(),
            ignored: Vec::new(),
        }
    }
}

impl<T: Clone + PartialEq> FirstWins<T> {
    fn offer(&mut self, policy: &str, value: Option<&T>) {
        let Some(v) = value else { return };
        match &self.value {
            None => {
                self.value = Some(v.clone());
                self.from = policy.to_string();
            }
            Some(used) if used != v => self.ignored.push(policy.to_string()),
            Some(_) => {}
        }
    }

    fn finish(
        self,
        section: &str,
        conflicts: &mut Vec<(String, String, Vec<String>)>,
    ) -> Option<T> {
        if !self.ignored.is_empty() {
            conflicts.push((section.to_string(), self.from, self.ignored));
        }
        self.value
    }
}

/// Two sources (probes, monitors) setting the same condition type would
/// overwrite each other: the first (by policy name, then order) keeps it,
/// the later source is dropped and the conflict reported.
fn drop_condition_conflicts(out: &mut Selection) {
    let mut owner: BTreeMap<String, String> = BTreeMap::new();
    let mut conflicts = Vec::new();
    out.probes.retain(|p| {
        let Some(t) = p.condition_type.clone().filter(|_| p.pods.is_none()) else {
            return true;
        };
        let me = format!("probe {}", p.name);
        match owner.get(&t) {
            Some(first) => {
                conflicts.push((format!("condition {t}"), first.clone(), vec![me]));
                false
            }
            None => {
                owner.insert(t, me);
                true
            }
        }
    });
    // A taint (key:effect) is one condition's: the first to clear would
    // remove a shared one while the other is still True.
    let mut taint_owner: BTreeMap<String, String> = BTreeMap::new();
    let taint_of = |c: &crate::policy::monitors::ConditionSpec| {
        c.taint.as_ref().map(|t| format!("{}:{}", t.key, t.effect))
    };
    out.monitors.retain(|m| {
        let me = format!("monitor {}", m.name);
        let clash = m.conditions.iter().find_map(|c| {
            owner
                .get(&c.type_)
                .map(|f| (format!("condition {}", c.type_), f.clone()))
                .or_else(|| {
                    let t = taint_of(c)?;
                    taint_owner
                        .get(&t)
                        .map(|f| (format!("taint {t}"), f.clone()))
                })
        });
        match clash {
            Some((what, first)) => {
                conflicts.push((what, first, vec![me]));
                false
            }
            None => {
                for c in &m.conditions {
                    owner.insert(c.type_.clone(), me.clone());
                    if let Some(t) = taint_of(c) {
                        taint_owner.insert(t, me.clone());
                    }
                }
                true
            }
        }
    });
    out.conflicts.extend(conflicts);
}

/// Keeps the node's limits over what selection and conflicts left. Policies
/// created first keep theirs (then by name): a policy created later never
/// takes the place of what runs, and a restart or an edit elsewhere keeps
/// the same order. Once a limit is reached, no later item that needs it is
/// taken, even a smaller one, so the order holds strictly.
fn apply_limits(
    out: &mut Selection,
    created: &BTreeMap<String, Option<jiff::Timestamp>>,
    probe_from: &BTreeMap<String, String>,
    monitor_from: &BTreeMap<String, String>,
) {
    let mut order: Vec<&String> = created.keys().collect();
    // Unknown creation times (files given to `nodeguard check`) go last.
    order.sort_by_key(|name| (created[*name].is_none(), created[*name], (*name).clone()));
    let rank: BTreeMap<&str, usize> = order
        .iter()
        .enumerate()
        .map(|(i, n)| (n.as_str(), i))
        .collect();
    let rank_of = |from: &BTreeMap<String, String>, item: &str| {
        from.get(item)
            .and_then(|p| rank.get(p.as_str()))
            .copied()
            .unwrap_or(usize::MAX)
    };
    // (rank, probe?, not a Startup probe?, index): a policy's monitors, its
    // Startup probes (the gates), then its other probes.
    let mut items: Vec<(usize, bool, bool, usize)> = Vec::new();
    items.extend(out.probes.iter().enumerate().map(|(i, p)| {
        (
            rank_of(probe_from, &p.name),
            true,
            p.role != super::probes::ProbeRole::Startup,
            i,
        )
    }));
    items.extend(
        out.monitors
            .iter()
            .enumerate()
            .map(|(i, m)| (rank_of(monitor_from, &m.name), false, false, i)),
    );
    items.sort();
    let (mut probes, mut monitors, mut conditions) = (0usize, 0usize, 0usize);
    let (mut probes_full, mut monitors_full, mut conditions_full) = (false, false, false);
    let mut keep_probe = vec![false; out.probes.len()];
    let mut keep_monitor = vec![false; out.monitors.len()];
    for (_, is_probe, _, i) in items {
        if is_probe {
            let p = &out.probes[i];
            let needs = usize::from(p.pods.is_none() && p.condition_type.is_some());
            probes_full |= probes >= MAX_PROBES;
            conditions_full |= needs > 0 && conditions + needs > MAX_CONDITIONS;
            let blocked = probes_full || (needs > 0 && conditions_full);
            if !blocked {
                keep_probe[i] = true;
                probes += 1;
                conditions += needs;
            }
        } else {
            let needs = out.monitors[i].conditions.len();
            monitors_full |= monitors >= MAX_MONITORS;
            conditions_full |= needs > 0 && conditions + needs > MAX_CONDITIONS;
            let blocked = monitors_full || (needs > 0 && conditions_full);
            if !blocked {
                keep_monitor[i] = true;
                monitors += 1;
                conditions += needs;
            }
        }
    }
    let mut over: BTreeMap<usize, OverLimit> = BTreeMap::new();
    let mut left_out = |from: &BTreeMap<String, String>, item: &str, probe: bool| {
        let policy = from.get(item).cloned().unwrap_or_default();
        let r = rank.get(policy.as_str()).copied().unwrap_or(usize::MAX);
        let o = over.entry(r).or_insert_with(|| OverLimit {
            policy,
            ..Default::default()
        });
        if probe {
            o.probes.push(item.to_string());
        } else {
            o.monitors.push(item.to_string());
        }
    };
    for (p, keep) in out.probes.iter().zip(&keep_probe) {
        if !keep {
            left_out(probe_from, &p.name, true);
        }
    }
    for (m, keep) in out.monitors.iter().zip(&keep_monitor) {
        if !keep {
            left_out(monitor_from, &m.name, false);
        }
    }
    let mut keep = keep_probe.into_iter();
    out.probes.retain(|_| keep.next().unwrap_or(false));
    let mut keep = keep_monitor.into_iter();
    out.monitors.retain(|_| keep.next().unwrap_or(false));
    out.over_limit = over.into_values().collect();
    for (full, what) in [
        (probes_full, format!("{MAX_PROBES} probes")),
        (monitors_full, format!("{MAX_MONITORS} monitors")),
        (conditions_full, format!("{MAX_CONDITIONS} conditions")),
    ] {
        if full && !out.over_limit.is_empty() {
            out.limits_reached.push(what);
        }
    }
}

/// Leaves out the probes whose gate is not in force. A gate is a Startup
/// probe of the gated probe's own policy: when that one was refused, left
/// over the limits or lost its name or condition to another policy's, the
/// gated probe would wait for ever (or, under a name another policy's probe
/// took, be gated by that one), so it is left out and said why. Repeated
/// while it finds any: a Startup probe can be gated too.
fn drop_ungated(out: &mut Selection, probe_from: &BTreeMap<String, String>) {
    loop {
        let in_force: BTreeMap<&str, &str> = out
            .probes
            .iter()
            .map(|p| {
                let from = probe_from.get(&p.name).map(String::as_str).unwrap_or("");
                (p.name.as_str(), from)
            })
            .collect();
        let mut dropped: Vec<Ungated> = Vec::new();
        for p in &out.probes {
            // The prober does not gate Startup probes (as the kubelet's).
            if p.role == super::probes::ProbeRole::Startup {
                continue;
            }
            let Some(gate) = &p.gated_by else { continue };
            let policy = probe_from.get(&p.name).cloned().unwrap_or_default();
            if in_force.get(gate.as_str()) == Some(&policy.as_str()) {
                continue;
            }
            let why = gate_missing_why(out, &policy, gate, in_force.get(gate.as_str()).copied());
            dropped.push(Ungated {
                policy,
                probe: p.name.clone(),
                gate: gate.clone(),
                why,
            });
        }
        if dropped.is_empty() {
            break;
        }
        out.probes
            .retain(|p| !dropped.iter().any(|d| d.probe == p.name));
        out.ungated.extend(dropped);
    }
}

/// Why `policy`'s Startup probe `gate` is not in force (`holder`: the
/// policy whose probe of that name is).
fn gate_missing_why(out: &Selection, policy: &str, gate: &str, holder: Option<&str>) -> String {
    let dropped = format!("probe {gate}");
    if out
        .refused
        .iter()
        .any(|r| r.policy == policy && r.dropped == dropped)
    {
        return "refused by this node's trust, see PolicyRefused".into();
    }
    if out
        .over_limit
        .iter()
        .any(|o| o.policy == policy && o.probes.iter().any(|p| p == gate))
    {
        return "over the node's limits".into();
    }
    if let Some((_, first, _)) = out.conflicts.iter().find(|(section, _, ignored)| {
        *section == format!("spec.probes[{gate}]") && ignored.iter().any(|i| i == policy)
    }) {
        return format!("the name {gate} is NodeGuardPolicy {first}'s probe on this node");
    }
    match holder {
        Some(other) if other != policy => {
            format!("the name {gate} is NodeGuardPolicy {other}'s probe on this node")
        }
        _ => "its condition type is set by another source, see PolicyConflict".into(),
    }
}

/// Selects the policies for a node with `labels`. Applied policies combine
/// by union (sorted, without duplicates); issue-specific sections add their
/// own merge rules.
/// Like [`select`], but an invalid policy that was valid before keeps its
/// last good version in force (and is still reported invalid). `last_good`
/// is updated: valid policies are remembered, deleted ones forgotten.
/// Each policy is validated once per spec (`validations`).
pub fn select_with_last_good<'a>(
    policies: impl IntoIterator<Item = &'a NodeGuardPolicy>,
    labels: &BTreeMap<String, String>,
    trust: &NodeTrust,
    last_good: &mut BTreeMap<String, NodeGuardPolicy>,
    validations: &mut Validations,
) -> Selection {
    let policies: Vec<&NodeGuardPolicy> = policies.into_iter().collect();
    let names = super::validate::listed_names(policies.iter().copied());
    last_good.retain(|name, _| names.contains(name.as_str()));
    validations.retain_listed(policies.iter().copied());
    let mut effective: Vec<(NodeGuardPolicy, Arc<Vec<Problem>>)> = Vec::new();
    let mut replaced: Vec<(String, Vec<Problem>, i64)> = Vec::new();
    for p in policies {
        let name = p.metadata.name.clone().unwrap_or_default();
        let problems = validations.problems(p);
        if problems.is_empty() {
            last_good.insert(name, p.clone());
            effective.push((p.clone(), problems));
        } else if let Some(good) = last_good
            .get(&name)
            .filter(|g| g.metadata.uid == p.metadata.uid)
        {
            // (A policy deleted and created again under its name is another
            // policy: the old one's last good version does not carry over.)
            replaced.push((
                name,
                problems.to_vec(),
                good.metadata.generation.unwrap_or_default(),
            ));
            // Valid when it was remembered.
            effective.push((good.clone(), Arc::default()));
        } else {
            effective.push((p.clone(), problems));
        }
    }
    let mut out = select_validated(
        effective
            .iter()
            .map(|(p, problems)| (p, problems.as_slice())),
        labels,
        trust,
    );
    // Only where its last good version is in force: a node it does not
    // select has nothing to say about it (a fleet's every node would
    // report one bad edit).
    for (name, problems, generation) in replaced {
        if out.applied.contains(&name) {
            out.invalid.push((name.clone(), problems));
            out.kept.insert(name, generation);
        }
    }
    out.invalid.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

pub fn select<'a>(
    policies: impl IntoIterator<Item = &'a NodeGuardPolicy>,
    labels: &BTreeMap<String, String>,
    trust: &NodeTrust,
) -> Selection {
    let validated: Vec<(&NodeGuardPolicy, Vec<Problem>)> =
        policies.into_iter().map(|p| (p, validate(p))).collect();
    select_validated(
        validated
            .iter()
            .map(|(p, problems)| (*p, problems.as_slice())),
        labels,
        trust,
    )
}

/// [`select`] of policies validated before, each with its problems.
fn select_validated<'a>(
    policies: impl IntoIterator<Item = (&'a NodeGuardPolicy, &'a [Problem])>,
    labels: &BTreeMap<String, String>,
    trust: &NodeTrust,
) -> Selection {
    let mut out = Selection::default();
    let mut watchdog = FirstWins::default();
    let mut shutdown = FirstWins::default();
    let mut probe_from: BTreeMap<String, String> = BTreeMap::new();
    let mut monitor_from: BTreeMap<String, String> = BTreeMap::new();
    // Policy name → when it was created, for the node's limits.
    let mut created: BTreeMap<String, Option<jiff::Timestamp>> = BTreeMap::new();
    let mut policies: Vec<(&NodeGuardPolicy, &[Problem])> = policies.into_iter().collect();
    policies.sort_by(|a, b| a.0.metadata.name.cmp(&b.0.metadata.name));
    for (p, problems) in policies {
        let name = p.metadata.name.clone().unwrap_or_default();
        let mut sel_problems = Vec::new();
        let matches = match &p.spec.node_selector {
            None => Some(true),
            Some(s) => Selector::parse(s, "spec.nodeSelector", &mut sel_problems)
                .map(|s| s.matches(labels)),
        };
        match (problems.is_empty(), matches) {
            (true, Some(true)) => {
                if let Some(h) = &p.spec.healthz {
                    out.ineligible_taints
                        .extend(h.ineligible_taints.iter().cloned());
                }
                let refused = trust.refusals(p);
                let allowed = |item: Item| !refused.iter().any(|r| r.item == item);
                let probes = p
                    .spec
                    .probes
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| allowed(Item::Probe(*i)))
                    .map(|(_, probe)| probe);
                let monitors = p
                    .spec
                    .monitors
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| allowed(Item::Monitor(*i)))
                    .map(|(_, m)| m);
                let watchdog_section = p.spec.watchdog.as_ref().filter(|_| allowed(Item::Watchdog));
                let shutdown_section = p
                    .spec
                    .shutdown
                    .as_ref()
                    .filter(|_| allowed(Item::Shutdown))
                    .map(|sd| {
                        let mut sd = sd.clone();
                        if !allowed(Item::ShutdownDropIn) {
                            sd.logind_drop_in_dir.clear();
                        }
                        sd
                    });
                for probe in probes {
                    match probe_from.get(&probe.name) {
                        None => {
                            probe_from.insert(probe.name.clone(), name.clone());
                            out.probes.push(probe.clone());
                        }
                        Some(first) => out.conflicts.push((
                            format!("spec.probes[{}]", probe.name),
                            first.clone(),
                            vec![name.clone()],
                        )),
                    }
                }
                for monitor in monitors {
                    match monitor_from.get(&monitor.name) {
                        None => {
                            monitor_from.insert(monitor.name.clone(), name.clone());
                            out.monitors.push(monitor.clone());
                        }
                        Some(first) => out.conflicts.push((
                            format!("spec.monitors[{}]", monitor.name),
                            first.clone(),
                            vec![name.clone()],
                        )),
                    }
                }
                created.insert(
                    name.clone(),
                    p.metadata.creation_timestamp.as_ref().map(|t| t.0),
                );
                watchdog.offer(&name, watchdog_section);
                shutdown.offer(&name, shutdown_section.as_ref());
                out.refused.extend(refused);
                out.generations
                    .insert(name.clone(), p.metadata.generation.unwrap_or_default());
                out.applied.push(name);
            }
            (false, Some(true) | None) => out.invalid.push((name, problems.to_vec())),
            _ => {}
        }
    }
    out.ineligible_taints.sort();
    out.ineligible_taints.dedup();
    drop_condition_conflicts(&mut out);
    // Before the limits, so that probes which cannot run take no place;
    // after them for gates the limits left out.
    drop_ungated(&mut out, &probe_from);
    apply_limits(&mut out, &created, &probe_from, &monitor_from);
    drop_ungated(&mut out, &probe_from);
    out.shutdown = shutdown.finish("spec.shutdown", &mut out.conflicts);
    out.watchdog = watchdog.finish("spec.watchdog", &mut out.conflicts);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{HealthzSpec, NodeGuardPolicySpec};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};

    fn policy(name: &str, labels: &[(&str, &str)], taints: &[&str]) -> NodeGuardPolicy {
        NodeGuardPolicy::new(
            name,
            NodeGuardPolicySpec {
                node_selector: (!labels.is_empty()).then(|| LabelSelector {
                    match_labels: Some(
                        labels
                            .iter()
                            .map(|(k, v)| (k.to_string(), v.to_string()))
                            .collect(),
                    ),
                    ..Default::default()
                }),
                healthz: (!taints.is_empty()).then(|| HealthzSpec {
                    ineligible_taints: taints.iter().map(|s| s.to_string()).collect(),
                }),
                ..Default::default()
            },
        )
    }

    /// A node that lets monitors read any path (these tests are about
    /// merging, not trust).
    fn reads_anything() -> NodeTrust {
        NodeTrust {
            read_paths: vec!["/".into()],
            ..NodeTrust::default()
        }
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn selection_by_labels_and_union_of_taints() {
        let ps = [
            policy("all", &[], &["b.io/drain"]),
            policy("gpu", &[("pool", "gpu")], &["a.io/drain", "b.io/drain"]),
            policy("cpu", &[("pool", "cpu")], &["c.io/drain"]),
        ];
        let s = select(&ps, &labels(&[("pool", "gpu")]), &NodeTrust::default());
        assert_eq!(s.applied, ["all", "gpu"]);
        assert_eq!(s.ineligible_taints, ["a.io/drain", "b.io/drain"]);
        assert!(s.invalid.is_empty());
    }

    #[test]
    fn invalid_policies_are_reported_when_they_may_apply_and_never_applied() {
        let mut bad_selector = policy("bad-selector", &[], &["x.io/t"]);
        bad_selector.spec.node_selector = Some(LabelSelector {
            match_expressions: Some(vec![LabelSelectorRequirement {
                key: "pool".into(),
                operator: "Equals".into(),
                values: Some(vec!["gpu".into()]),
            }]),
            ..Default::default()
        });
        let mut bad_elsewhere = policy("bad-elsewhere", &[("pool", "cpu")], &[]);
        bad_elsewhere.metadata.namespace = Some("oops".into());
        let mut bad_here = policy("bad-here", &[("pool", "gpu")], &[]);
        bad_here.metadata.namespace = Some("oops".into());
        let s = select(
            &[bad_selector, bad_elsewhere, bad_here],
            &labels(&[("pool", "gpu")]),
            &NodeTrust::default(),
        );
        assert!(s.applied.is_empty());
        let names: Vec<&str> = s.invalid.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["bad-here", "bad-selector"]);
        assert!(
            s.ineligible_taints.is_empty(),
            "nothing from invalid policies"
        );
    }

    #[test]
    fn the_first_watchdog_section_by_name_wins_and_differences_are_conflicts() {
        use crate::policy::{WatchdogMode, WatchdogSpec};
        let with = |name: &str, mode: WatchdogMode| {
            let mut p = policy(name, &[], &[]);
            p.spec.watchdog = Some(WatchdogSpec {
                mode,
                ..Default::default()
            });
            p
        };
        let s = select(
            &[
                with("b", WatchdogMode::Device),
                with("a", WatchdogMode::Systemd),
                with("c", WatchdogMode::Systemd),
            ],
            &labels(&[]),
            &NodeTrust {
                watchdog_devices: vec!["/dev/watchdog".into()],
                ..NodeTrust::default()
            },
        );
        assert_eq!(s.watchdog.unwrap().mode, WatchdogMode::Systemd);
        assert_eq!(
            s.conflicts,
            vec![(
                "spec.watchdog".to_string(),
                "a".to_string(),
                vec!["b".to_string()]
            )]
        );
    }

    /// [`select_with_last_good`] for a node labelled `node`, trusting
    /// nothing, with a fresh validation cache.
    fn with_last_good<'a>(
        policies: impl IntoIterator<Item = &'a NodeGuardPolicy>,
        node: &[(&str, &str)],
        last_good: &mut BTreeMap<String, NodeGuardPolicy>,
    ) -> Selection {
        select_with_last_good(
            policies,
            &labels(node),
            &NodeTrust::default(),
            last_good,
            &mut Validations::default(),
        )
    }

    #[test]
    fn an_invalid_update_keeps_the_last_good_generation() {
        let mut last_good = BTreeMap::new();
        let mut good = policy("p", &[], &["a.io/t"]);
        good.metadata.generation = Some(1);
        let s = with_last_good([&good], &[], &mut last_good);
        assert_eq!(s.applied, ["p"]);
        let mut bad = policy("p", &[], &["Not A Key"]);
        bad.metadata.generation = Some(2);
        let s = with_last_good([&bad], &[], &mut last_good);
        assert_eq!(s.applied, ["p"], "generation 1 stays in force");
        assert_eq!(s.ineligible_taints, ["a.io/t"]);
        assert_eq!(s.invalid.len(), 1);
        assert_eq!(s.kept.get("p"), Some(&1));
        // Never valid: not applied at all.
        let mut fresh = BTreeMap::new();
        let s = with_last_good([&bad], &[], &mut fresh);
        assert!(s.applied.is_empty() && s.kept.is_empty() && s.invalid.len() == 1);
        // Deleted and created again (a new uid) while invalid: the old
        // policy's last good version is not the new one's.
        let mut good_v1 = good.clone();
        good_v1.metadata.uid = Some("uid-1".into());
        let mut remembered = BTreeMap::new();
        with_last_good([&good_v1], &[], &mut remembered);
        let mut recreated = bad.clone();
        recreated.metadata.uid = Some("uid-2".into());
        let s = with_last_good([&recreated], &[], &mut remembered);
        assert!(s.applied.is_empty() && s.kept.is_empty(), "{s:?}");
        // Deleted: forgotten.
        let none: [&NodeGuardPolicy; 0] = [];
        with_last_good(none, &[], &mut last_good);
        assert!(last_good.is_empty());
    }

    #[test]
    fn each_spec_is_validated_once_however_often_the_node_or_a_status_changes() {
        let mut last_good = BTreeMap::new();
        let mut v = Validations::default();
        let trust = NodeTrust::default();
        let mut a = policy("a", &[], &["a.io/t"]);
        let b = policy("b", &[("tier", "x")], &[]);
        let mut pick = |policies: &[&NodeGuardPolicy], v: &mut Validations| {
            select_with_last_good(
                policies.iter().copied(),
                &labels(&[]),
                &trust,
                &mut last_good,
                v,
            )
        };
        let first = pick(&[&a, &b], &mut v);
        assert_eq!(v.validated(), 2, "both policies, once each");
        // The Node's heartbeats, the status the lease holder writes, new
        // labels: nothing of the specs changed.
        a.status = Some(Default::default());
        a.metadata.resource_version = Some("7".into());
        for _ in 0..5 {
            assert_eq!(pick(&[&a, &b], &mut v), first);
        }
        assert_eq!(v.validated(), 2);
        // An invalid edit is validated, and its last good version is in
        // force without validating either again.
        a.spec.healthz.as_mut().unwrap().ineligible_taints = vec!["Not A Key".into()];
        let s = pick(&[&a, &b], &mut v);
        assert_eq!((s.applied.len(), s.invalid.len()), (1, 1), "{s:?}");
        assert_eq!(v.validated(), 3);
        assert_eq!(pick(&[&a, &b], &mut v), s);
        assert_eq!(v.validated(), 3);
        // Deleted: forgotten; created again with the same spec: validated.
        pick(&[&b], &mut v);
        pick(&[&a, &b], &mut v);
        assert_eq!(v.validated(), 4);
    }

    #[test]
    fn an_invalid_update_is_reported_only_where_its_last_good_generation_is_in_force() {
        let mut here = BTreeMap::new();
        let mut elsewhere = BTreeMap::new();
        let mut good = policy("p", &[("tier", "a")], &["a.io/t"]);
        good.metadata.generation = Some(1);
        let mut bad = policy("p", &[("tier", "a")], &["Not A Key"]);
        bad.metadata.generation = Some(2);
        for (labels_, remembered) in [
            (&[("tier", "a")], &mut here),
            (&[("tier", "b")], &mut elsewhere),
        ] {
            with_last_good([&good], labels_, remembered);
        }
        let s = with_last_good([&bad], &[("tier", "a")], &mut here);
        assert_eq!(
            (s.applied.len(), s.invalid.len(), s.kept.get("p")),
            (1, 1, Some(&1))
        );
        // A node the policy does not select says nothing of it.
        let s = with_last_good([&bad], &[("tier", "b")], &mut elsewhere);
        assert!(
            s.applied.is_empty() && s.invalid.is_empty() && s.kept.is_empty(),
            "{s:?}"
        );
    }

    #[test]
    fn probes_and_monitors_add_up_and_duplicate_names_conflict() {
        let mut a = policy("a", &[], &[]);
        a.spec.probes = vec![
            serde_json::from_value(serde_json::json!(
            {"name": "kubelet", "tcp": {"port": 1}, "conditionType": "A"}))
            .unwrap(),
        ];
        let mut b = policy("b", &[], &[]);
        b.spec.probes = vec![
            serde_json::from_value(
                serde_json::json!({"name": "kubelet", "tcp": {"port": 2}, "conditionType": "B"}),
            )
            .unwrap(),
            serde_json::from_value(
                serde_json::json!({"name": "proxy", "tcp": {"port": 3}, "conditionType": "C"}),
            )
            .unwrap(),
        ];
        let s = select(&[b, a], &labels(&[]), &NodeTrust::default());
        let names: Vec<&str> = s.probes.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["kubelet", "proxy"]);
        assert_eq!(
            s.probes[0].condition_type.as_deref(),
            Some("A"),
            "policy a wins by name"
        );
        assert_eq!(s.conflicts[0].0, "spec.probes[kubelet]");
    }

    fn probe(v: serde_json::Value) -> super::super::probes::ProbeSpec {
        serde_json::from_value(v).unwrap()
    }

    fn startup(name: &str, port: u16) -> super::super::probes::ProbeSpec {
        probe(
            serde_json::json!({"name": name, "role": "Startup", "tcp": {"port": port},
                                 "conditionType": format!("NotStarted{port}")}),
        )
    }

    fn gated(name: &str, gate: &str, condition: &str) -> super::super::probes::ProbeSpec {
        probe(
            serde_json::json!({"name": name, "gatedBy": gate, "tcp": {"port": 9},
                                 "conditionType": condition}),
        )
    }

    fn ungated(s: &Selection) -> Vec<(String, String, String, String)> {
        s.ungated
            .iter()
            .map(|u| {
                (
                    u.policy.clone(),
                    u.probe.clone(),
                    u.gate.clone(),
                    u.why.clone(),
                )
            })
            .collect()
    }

    fn names(s: &Selection) -> Vec<&str> {
        s.probes.iter().map(|p| p.name.as_str()).collect()
    }

    #[test]
    fn a_gated_probe_runs_with_its_own_policys_gate() {
        let mut a = policy("a", &[], &[]);
        a.spec.probes = vec![startup("warmup", 1), gated("checked", "warmup", "CheckedA")];
        let s = select(&[a], &labels(&[]), &NodeTrust::default());
        assert!(s.invalid.is_empty(), "{:?}", s.invalid);
        assert_eq!(names(&s), ["warmup", "checked"]);
        assert!(s.ungated.is_empty());
    }

    #[test]
    fn a_gate_refused_by_the_nodes_trust_leaves_its_gated_probes_out() {
        let mut a = policy("a", &[], &[]);
        a.spec.probes = vec![
            probe(
                serde_json::json!({"name": "warmup", "role": "Startup", "conditionType": "NotStarted",
                                     "exec": {"command": ["/bin/sh", "-c", "true"]}}),
            ),
            gated("checked", "warmup", "Checked"),
            probe(
                serde_json::json!({"name": "other", "tcp": {"port": 2}, "conditionType": "Other"}),
            ),
        ];
        let s = select(&[a], &labels(&[]), &NodeTrust::default());
        assert_eq!(names(&s), ["other"], "the rest of the policy applies");
        assert_eq!(s.refused.len(), 1);
        assert_eq!(
            ungated(&s),
            [(
                "a".into(),
                "checked".into(),
                "warmup".into(),
                "refused by this node's trust, see PolicyRefused".into()
            )]
        );
        let text = s.ungated[0].to_string();
        assert!(
            text.contains("probe checked is gated by its Startup probe warmup"),
            "{text}"
        );
    }

    #[test]
    fn a_gate_named_like_another_policys_probe_is_not_that_probe() {
        // a's warmup wins the name; b's own warmup is not in force, and b's
        // gated probe does not follow a's.
        let mut a = policy("a", &[], &[]);
        a.spec.probes = vec![startup("warmup", 1)];
        let mut b = policy("b", &[], &[]);
        b.spec.probes = vec![startup("warmup", 2), gated("checked", "warmup", "CheckedB")];
        let s = select(&[b, a], &labels(&[]), &NodeTrust::default());
        assert_eq!(names(&s), ["warmup"]);
        assert_eq!(s.conflicts[0].0, "spec.probes[warmup]");
        assert_eq!(
            ungated(&s),
            [(
                "b".into(),
                "checked".into(),
                "warmup".into(),
                "the name warmup is NodeGuardPolicy a's probe on this node".into()
            )]
        );
    }

    #[test]
    fn a_gate_whose_condition_is_taken_or_over_the_limits_leaves_its_gated_probes_out() {
        // The gate's condition type is a's: b's gate is dropped as a conflict.
        let mut a = policy("a", &[], &[]);
        a.spec.probes = vec![probe(
            serde_json::json!({"name": "first", "tcp": {"port": 1}, "conditionType": "Warm"}),
        )];
        let mut b = policy("b", &[], &[]);
        let mut warm = startup("warmup", 2);
        warm.condition_type = Some("Warm".into());
        b.spec.probes = vec![warm, gated("checked", "warmup", "CheckedB")];
        let s = select(&[a, b], &labels(&[]), &NodeTrust::default());
        assert_eq!(names(&s), ["first"]);
        assert_eq!(
            ungated(&s)[0].3,
            "its condition type is set by another source, see PolicyConflict"
        );

        // Past the limit of conditions: the gate (after its gated probe in
        // the spec) is left out, so the gated probe is too.
        let mut big = policy("a", &[], &[]);
        big.spec.probes = (0..MAX_CONDITIONS - 1)
            .map(|i| {
                probe(
                    serde_json::json!({"name": format!("p{i}"), "tcp": {"port": 1},
                                         "conditionType": format!("P{i}")}),
                )
            })
            .collect();
        let mut b = policy("b", &[], &[]);
        b.spec.probes = vec![gated("checked", "warmup", "CheckedB"), startup("warmup", 2)];
        // The gate goes first (Startup probes before the others of their
        // policy): it takes the last condition, and its gated probe is over
        // the limit, not left waiting.
        let s = select(&[big, b], &labels(&[]), &NodeTrust::default());
        assert_eq!(s.probes.len(), MAX_CONDITIONS);
        assert_eq!(s.probes.last().unwrap().name, "warmup");
        assert!(s.ungated.is_empty(), "{:?}", s.ungated);
        assert_eq!(s.over_limit[0].probes, ["checked"]);

        // A Startup probe gated by a refused one still runs (the prober
        // gates no Startup probe), and so does what it gates.
        let mut c = policy("c", &[], &[]);
        let mut net = startup("net-ready", 3);
        net.gated_by = Some("disk-ready".into());
        c.spec.probes = vec![
            probe(
                serde_json::json!({"name": "disk-ready", "role": "Startup", "conditionType": "DiskNotReady",
                                     "exec": {"command": ["/bin/sh", "-c", "true"]}}),
            ),
            net,
            gated("app", "net-ready", "AppNotReady"),
        ];
        let s = select(&[c], &labels(&[]), &NodeTrust::default());
        assert_eq!(names(&s), ["net-ready", "app"]);
        assert!(s.ungated.is_empty(), "{:?}", s.ungated);
    }

    #[test]
    fn two_sources_of_one_condition_type_conflict_and_the_later_is_dropped() {
        let mut a = policy("a", &[], &[]);
        a.spec.probes = vec![
            serde_json::from_value(serde_json::json!(
            {"name": "kubelet", "tcp": {"port": 1}, "conditionType": "KubeletUnhealthy"}))
            .unwrap(),
        ];
        let mut b = policy("b", &[], &[]);
        b.spec.monitors = vec![
            serde_json::from_value(serde_json::json!({
            "name": "k", "source": {"file": {"path": "/x"}},
            "conditions": [{"type": "KubeletUnhealthy", "reason": "Fine", "message": "fine"}],
            "rules": []}))
            .unwrap(),
        ];
        let s = select(&[a, b], &labels(&[]), &reads_anything());
        assert_eq!(s.probes.len(), 1);
        assert!(s.monitors.is_empty(), "the later source is dropped");
        assert_eq!(
            s.conflicts,
            vec![(
                "condition KubeletUnhealthy".to_string(),
                "probe kubelet".to_string(),
                vec!["monitor k".to_string()]
            )]
        );
        assert_eq!(s.generations.len(), 2);
    }

    #[test]
    fn two_monitors_with_one_taint_conflict_and_the_later_is_dropped() {
        let mon = |name: &str, type_: &str| -> crate::policy::monitors::MonitorSpec {
            serde_json::from_value(serde_json::json!({
            "name": name, "source": {"file": {"path": "/x"}},
            "conditions": [{"type": type_, "reason": "Fine", "message": "fine",
                            "taint": {"key": "example.com/unhealthy", "effect": "NoSchedule"}}],
            "rules": []}))
            .unwrap()
        };
        let mut a = policy("a", &[], &[]);
        a.spec.monitors = vec![mon("ma", "ABroken")];
        let mut b = policy("b", &[], &[]);
        b.spec.monitors = vec![mon("mb", "BBroken")];
        let s = select(&[a, b], &labels(&[]), &reads_anything());
        assert_eq!(s.monitors.len(), 1, "the later monitor is dropped");
        assert_eq!(s.monitors[0].name, "ma");
        assert_eq!(
            s.conflicts,
            vec![(
                "taint example.com/unhealthy:NoSchedule".to_string(),
                "monitor ma".to_string(),
                vec!["monitor mb".to_string()]
            )]
        );
    }

    #[test]
    fn an_item_the_node_does_not_trust_is_left_out_and_the_rest_applies() {
        let mut a = policy("a", &[], &["a.io/t"]);
        a.spec.probes = vec![
            serde_json::from_value(serde_json::json!(
                {"name": "shell", "exec": {"command": ["/bin/sh", "-c", "id"]}, "conditionType": "Shell"}))
            .unwrap(),
            serde_json::from_value(serde_json::json!(
                {"name": "kubelet", "tcp": {"port": 1}, "conditionType": "Kubelet"}))
            .unwrap(),
        ];
        a.spec.monitors = vec![
            serde_json::from_value(serde_json::json!({
                "name": "shadow", "source": {"file": {"path": "/etc/shadow"}},
                "conditions": [{"type": "Shadow", "reason": "Fine", "message": "fine"}], "rules": []}))
            .unwrap(),
        ];
        a.spec.shutdown = Some(crate::policy::ShutdownSpec {
            grace_period_seconds: Some(600),
            ..Default::default()
        });
        let mut b = policy("b", &[], &[]);
        b.spec.shutdown = Some(crate::policy::ShutdownSpec {
            grace_period_seconds: Some(20),
            ..Default::default()
        });
        let s = select(&[a.clone(), b], &labels(&[]), &NodeTrust::default());
        assert_eq!(
            s.applied,
            ["a", "b"],
            "refused items do not refuse the policy"
        );
        assert!(s.invalid.is_empty());
        assert_eq!(s.ineligible_taints, ["a.io/t"]);
        let probes: Vec<&str> = s.probes.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(probes, ["kubelet"]);
        assert!(s.monitors.is_empty());
        assert_eq!(
            s.shutdown.as_ref().and_then(|sd| sd.grace_period_seconds),
            Some(20),
            "b's shutdown section is the first allowed one"
        );
        assert!(s.conflicts.is_empty(), "a refused section is no conflict");
        let refused: Vec<(String, String, String)> = s
            .refused
            .iter()
            .map(|r| (r.policy.clone(), r.field.clone(), r.dropped.clone()))
            .collect();
        assert_eq!(
            refused,
            [
                (
                    "a".into(),
                    "spec.probes[0].exec.command[0]".into(),
                    "probe shell".into()
                ),
                (
                    "a".into(),
                    "spec.monitors[0].source.file.path".into(),
                    "monitor shadow".into()
                ),
                (
                    "a".into(),
                    "spec.shutdown".into(),
                    "shutdown section".into()
                ),
            ]
        );
        // The node's owner allows them: all of it applies.
        let wide = NodeTrust {
            commands: vec!["/bin/sh".into()],
            read_paths: vec!["/etc/shadow".into()],
            max_inhibit_delay_seconds: 3600,
            ..NodeTrust::default()
        };
        let s = select(&[a], &labels(&[]), &wide);
        assert!(s.refused.is_empty(), "{:?}", s.refused);
        assert_eq!((s.probes.len(), s.monitors.len()), (2, 1));
        assert!(s.shutdown.is_some());
    }
}
