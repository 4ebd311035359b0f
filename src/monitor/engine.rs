//! Decision core of the problem detector: rules matched in one pass (a
//! `RegexSet`), temporary problems as Events, permanent ones as conditions
//! that clear (after a quiet period, on a clear pattern, or at a new boot),
//! "N matches within W" counting, taints that follow their condition (only
//! the ones nodeguard added are removed), and a state that survives
//! restarts.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::Duration;

use jiff::{SignedDuration, Timestamp};
use serde::{Deserialize, Serialize};

pub use crate::policy::monitors::patterns::BadPattern;
use crate::policy::monitors::patterns::Patterns;
use crate::policy::monitors::{MonitorSpec, PatternOf, ProblemKind, TaintSpec};

/// What the engine asks the adapters to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// A temporary problem (or a permanent one's transition): an Event.
    Event { reason: String, message: String },
    /// A condition's state; `active` is status True.
    Condition {
        type_: String,
        active: bool,
        reason: String,
        message: String,
    },
    /// A condition is Unknown: its check could not tell (a plugin monitor
    /// judging as node-problem-detector does, `npdResults`).
    Unknown {
        type_: String,
        reason: String,
        message: String,
    },
    /// Add (or remove) the taint of condition `condition`; the adapter
    /// reports the outcome with [`Engine::taint_result`].
    Taint {
        condition: String,
        key: String,
        value: String,
        effect: String,
        add: bool,
    },
}

/// What became of a taint action on the Node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaintOutcome {
    /// nodeguard added it (it was not there): nodeguard owns it.
    Added,
    /// An identical taint was there already (someone else's, or ours from
    /// before a restart): ownership unchanged.
    AlreadyPresent,
    /// Removed (or already gone).
    Removed,
    /// The API call failed: ownership unchanged.
    Failed,
}

/// A condition's persisted state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConditionState {
    pub active: bool,
    /// Status Unknown (`active` false): its check could not tell.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unknown: bool,
    pub reason: String,
    pub message: String,
    pub since: Timestamp,
    pub last_match: Option<Timestamp>,
    /// nodeguard added the condition's taint and owns it: only then does it
    /// remove it (on clear, on a policy edit, when the monitor goes).
    #[serde(default)]
    pub taint_added: bool,
    /// Which taint it added (key and effect): an agent that starts with a
    /// policy edited meanwhile (or killed while applying an edit) removes
    /// it even though the policy no longer names it. Absent in state saved
    /// before it was recorded: the policy's taint is taken then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub taint: Option<OwnedTaint>,
}

/// A taint nodeguard added, as the Node lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OwnedTaint {
    pub key: String,
    pub effect: String,
}

#[derive(Clone, Debug)]
struct Condition {
    type_: String,
    default_reason: String,
    default_message: String,
    clear_after: Option<Duration>,
    taint: Option<(String, String, String)>,
    /// A new boot sets it back to its no-problem state.
    resets_at_boot: bool,
}

impl Condition {
    /// Its no-problem state, as first seen at `now`.
    fn initial(&self, now: Timestamp) -> ConditionState {
        ConditionState {
            active: false,
            unknown: false,
            reason: self.default_reason.clone(),
            message: self.default_message.clone(),
            since: now,
            last_match: None,
            taint_added: false,
            taint: None,
        }
    }

    /// The removal of its taint, when nodeguard added it (`owned`).
    fn untaint(&self, owned: bool, out: &mut Vec<Action>) {
        if let Some((key, value, effect)) = &self.taint
            && owned
        {
            out.push(Action::Taint {
                condition: self.type_.clone(),
                key: key.clone(),
                value: value.clone(),
                effect: effect.clone(),
                add: false,
            });
        }
    }

    /// A change of it worded as node-problem-detector's Event, within an
    /// Event note's 1024 bytes (quotes and all).
    fn npd_event(&self, status: &str, reason: &str, message: &str) -> String {
        crate::report::clip(
            &format!(
                "Node condition {} is now: {status}, reason: {reason}, message: {}",
                self.type_,
                go_quote(message)
            ),
            1024,
        )
    }
}

#[derive(Clone, Debug)]
struct Rule {
    kind: ProblemKind,
    /// Index into `conditions` (permanent rules).
    condition: Option<usize>,
    reason: String,
    message: Option<String>,
    count: Option<(usize, Duration)>,
}

/// A monitor's compiled rules and live state. A clone shares the compiled
/// patterns (cheap) and copies the state.
#[derive(Clone, Debug)]
pub struct Engine {
    patterns: Patterns,
    /// What each compiled pattern belongs to.
    pattern_of: Vec<PatternOf>,
    rules: Vec<Rule>,
    conditions: Vec<Condition>,
    state: BTreeMap<String, ConditionState>,
    /// Per counting rule: its matches (+1) and revert matches (-1) in the
    /// window, summed per second (at most one entry per second of the
    /// window, however fast the lines come).
    counts: HashMap<usize, VecDeque<(Timestamp, i64)>>,
    /// Plugin rules whose last run found a problem, with its message: a
    /// condition several checks set stays True while any of them fails.
    failing: BTreeMap<usize, String>,
    /// node-problem-detector's matching, when the monitor asks for it.
    npd: Option<NpdBuffer>,
    /// A plugin monitor judging results as node-problem-detector's custom
    /// plugin monitor does (`npdResults`).
    npd_plugin: bool,
    /// Conditions whose last taint update failed: retried by
    /// [`Engine::taint_retries`] until the Node matches.
    taint_failed: BTreeSet<String>,
    /// A line matched a pattern since [`Engine::take_matched`].
    matched: bool,
    /// Conditions whose failed taint add may have been applied: the taint
    /// is then nodeguard's, also to remove once the condition clears.
    taint_maybe_added: BTreeSet<String>,
}

/// The last lines of an NPD-matching monitor (see
/// [`crate::policy::monitors::NpdMatching`]).
#[derive(Clone, Debug)]
struct NpdBuffer {
    /// Always `bufferLines` entries, oldest first; empty until filled, as
    /// NPD's ring starts (so `^` matches only with one line held).
    lines: VecDeque<String>,
    /// kmsg and journald messages are trimmed, file lines are not.
    trim: bool,
    /// File monitors: the message is this pattern's last capture group (its
    /// whole match without one); a line it does not match is skipped. With
    /// the pattern, its capture slots, reused line after line.
    message: Option<(regex::Regex, regex::CaptureLocations)>,
    /// The ring joined with newlines: what the rules match.
    joined: String,
    /// File monitors: lines containing any of these are skipped.
    skip: Vec<String>,
    /// Kernel records with an empty message are skipped, as NPD does.
    kmsg: bool,
    /// NPD's `patternGeneratedMessageSuffix`.
    suffix: Option<String>,
}

impl NpdBuffer {
    /// Takes `line` in; false when NPD would skip the line, else `joined`
    /// holds the text to match. The ring's strings, the joined text and the
    /// capture slots are reused: no allocation per line once they have
    /// grown to the lines' size.
    fn push(&mut self, line: &str) -> bool {
        if self.skip.iter().any(|s| line.contains(s.as_str())) || (self.kmsg && line.is_empty()) {
            return false;
        }
        let message = match &mut self.message {
            Some((re, locs)) => {
                if re.captures_read(locs, line).is_none() {
                    return false;
                }
                locs.get(locs.len() - 1).map_or("", |(a, b)| &line[a..b])
            }
            None => line,
        };
        let message = if self.trim { message.trim() } else { message };
        let mut oldest = self.lines.pop_front().unwrap_or_default();
        oldest.clear();
        oldest.push_str(message);
        self.lines.push_back(oldest);
        self.joined.clear();
        for (i, l) in self.lines.iter().enumerate() {
            if i > 0 {
                self.joined.push('\n');
            }
            self.joined.push_str(l);
        }
        true
    }
}

/// A plugin command's verdict: exit 0, exit 1, anything else.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PluginStatus {
    Ok,
    Problem,
    Unknown,
}

/// What to undo on the Node when a monitor is removed (`new` is `None`) or
/// its spec changes, given the state the old monitor left.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Cleanup {
    /// Condition types the monitor no longer owns: removed from the Node.
    pub conditions: Vec<String>,
    /// Owned taints the new spec does not keep, as (condition type, key,
    /// effect): removed from the Node.
    pub taints: Vec<(String, String, String)>,
    /// The source changed: the saved cursor points into something else.
    pub reset_cursor: bool,
}

pub fn cleanup(
    old: &MonitorSpec,
    new: Option<&MonitorSpec>,
    state: &BTreeMap<String, ConditionState>,
) -> Cleanup {
    let mut out = Cleanup {
        reset_cursor: new.is_some_and(|n| n.source != old.source),
        ..Default::default()
    };
    for c in &old.conditions {
        let kept = new.and_then(|n| n.conditions.iter().find(|x| x.type_ == c.type_));
        if kept.is_none() {
            out.conditions.push(c.type_.clone());
        }
        let same_taint = |t: &TaintSpec| kept.is_some_and(|k| k.taint.as_ref() == Some(t));
        if let Some(t) = &c.taint
            && state.get(&c.type_).is_some_and(|s| s.taint_added)
            && !same_taint(t)
        {
            out.taints
                .push((c.type_.clone(), t.key.clone(), t.effect.clone()));
        }
    }
    out
}

const MESSAGE_LIMIT: usize = 512;

/// `s` quoted as Go's `%q` quotes it (node-problem-detector's Event
/// wording): `\"`, `\\`, the C escapes, `\xNN` for other ASCII control
/// characters and `\uNNNN` for other control and non-ASCII space characters;
/// everything else as it is.
pub fn go_quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{07}' => out.push_str("\\a"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{0b}' => out.push_str("\\v"),
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\x{:02x}", c as u32))
            }
            c if c.is_control() || (c.is_whitespace() && c != ' ') => {
                if (c as u32) < 0x10000 {
                    out.push_str(&format!("\\u{:04x}", c as u32))
                } else {
                    out.push_str(&format!("\\U{:08x}", c as u32))
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The most entries a counting window keeps: one per second up to a
/// 20-minute window (node-problem-detector's usual), wider buckets beyond
/// (72 s for a day), so a long window on a chatty rule stays a few KiB in
/// memory and in the state file saved each second.
pub const MAX_COUNT_BUCKETS: u64 = 1200;

/// How many seconds one entry of `window` covers.
fn bucket_seconds(window: Duration) -> i64 {
    window.as_secs().div_ceil(MAX_COUNT_BUCKETS).max(1) as i64
}

/// Adds `delta` at `now` (to the entry of the same bucket when there is
/// one: the same second, or for a window over 20 minutes the same
/// `window / 1200`) and drops what is older than `window`; the net count in
/// the window. An entry carries the time of its first match, so a bucket
/// leaves the window up to its width early.
fn count(q: &mut VecDeque<(Timestamp, i64)>, now: Timestamp, delta: i64, window: Duration) -> i64 {
    let width = bucket_seconds(window);
    match q.back_mut() {
        Some((t, d)) if t.as_second().div_euclid(width) == now.as_second().div_euclid(width) => {
            *d += delta
        }
        _ => q.push_back((now, delta)),
    }
    net(q, now, window)
}

/// Saved entries merged into `window`'s buckets (a state file written with
/// a narrower bucket, or by hand), in time order.
fn rebucket(saved: &[(Timestamp, i64)], window: Duration) -> VecDeque<(Timestamp, i64)> {
    let width = bucket_seconds(window);
    let mut sorted = saved.to_vec();
    sorted.sort_by_key(|(t, _)| *t);
    let mut q: VecDeque<(Timestamp, i64)> = VecDeque::new();
    for (t, d) in sorted {
        match q.back_mut() {
            Some((b, n)) if b.as_second().div_euclid(width) == t.as_second().div_euclid(width) => {
                *n += d
            }
            _ => q.push_back((t, d)),
        }
    }
    q
}

/// Drops what is older than `window`; the net count left.
fn net(q: &mut VecDeque<(Timestamp, i64)>, now: Timestamp, window: Duration) -> i64 {
    while q
        .front()
        .is_some_and(|(t, _)| now.duration_since(*t).unsigned_abs() > window)
    {
        q.pop_front();
    }
    q.iter().map(|(_, d)| d).sum()
}

fn truncate(s: &str) -> String {
    crate::report::clip(s.trim(), MESSAGE_LIMIT)
}

impl Engine {
    /// Compiles `spec`; every bad pattern is reported with its path.
    pub fn new(spec: &MonitorSpec, path: &str) -> Result<Engine, Vec<BadPattern>> {
        let (patterns, pattern_of) = spec.compile_patterns(path)?;
        let conditions: Vec<Condition> = spec
            .conditions
            .iter()
            .map(|c| Condition {
                type_: c.type_.clone(),
                default_reason: c.reason.clone(),
                default_message: c.message.clone(),
                clear_after: c.clear_after_seconds.map(|s| Duration::from_secs(s.into())),
                taint: c.taint.as_ref().map(|t| {
                    (
                        t.key.clone(),
                        t.value.clone().unwrap_or_default(),
                        t.effect.clone(),
                    )
                }),
                resets_at_boot: spec.resets_at_boot(c),
            })
            .collect();
        let rules = spec
            .rules
            .iter()
            .map(|r| Rule {
                kind: r.kind,
                condition: r
                    .condition
                    .as_ref()
                    .and_then(|t| conditions.iter().position(|c| &c.type_ == t)),
                reason: r.reason.clone(),
                message: r.message.clone(),
                count: r.count.as_ref().map(|c| {
                    (
                        c.threshold.max(1) as usize,
                        Duration::from_secs(c.window_seconds.into()),
                    )
                }),
            })
            .collect();
        let npd = match &spec.npd_matching {
            None => None,
            Some(m) => {
                let message = match &m.message_pattern {
                    Some(p) => {
                        let re = crate::policy::goregex::translate(p)
                            .and_then(|r| regex::Regex::new(&r).map_err(|e| e.to_string()))
                            .map_err(|e| {
                                vec![BadPattern {
                                    path: format!("{path}.npdMatching.messagePattern"),
                                    message: e,
                                }]
                            })?;
                        let locs = re.capture_locations();
                        Some((re, locs))
                    }
                    None => None,
                };
                Some(NpdBuffer {
                    lines: std::iter::repeat_n(String::new(), m.buffer_lines.max(1) as usize)
                        .collect(),
                    trim: spec.source.kmsg.is_some() || spec.source.journald.is_some(),
                    message,
                    joined: String::new(),
                    skip: m.skip.clone(),
                    kmsg: spec.source.kmsg.is_some(),
                    suffix: m.message_suffix.clone(),
                })
            }
        };
        Ok(Engine {
            patterns,
            pattern_of,
            rules,
            conditions,
            state: BTreeMap::new(),
            counts: HashMap::new(),
            failing: BTreeMap::new(),
            npd,
            npd_plugin: spec.source.plugin.as_ref().is_some_and(|p| p.npd_results),
            taint_failed: BTreeSet::new(),
            matched: false,
            taint_maybe_added: BTreeSet::new(),
        })
    }

    /// Restores persisted state for the conditions that still exist, and
    /// returns the taints nodeguard added that this spec no longer has (the
    /// condition gone, or its taint changed): the saved state is all that
    /// is left of the spec that added them, after a restart.
    pub fn restore(&mut self, state: BTreeMap<String, ConditionState>) -> Vec<OwnedTaint> {
        let mut stale = Vec::new();
        for (t, mut s) in state {
            let cond = self.conditions.iter().find(|c| c.type_ == t);
            if s.taint_added {
                let now = cond
                    .and_then(|c| c.taint.as_ref())
                    .map(|(key, _, effect)| OwnedTaint {
                        key: key.clone(),
                        effect: effect.clone(),
                    });
                match (&s.taint, &now) {
                    // Saved before the taint was recorded: the spec's.
                    (None, _) => s.taint = now,
                    (Some(had), Some(now)) if had == now => {}
                    (Some(had), _) => {
                        stale.push(had.clone());
                        s.taint_added = false;
                        s.taint = None;
                    }
                }
            }
            if cond.is_some() {
                self.state.insert(t, s);
            }
        }
        stale
    }

    /// The wall clock stepped by `by` (an NTP step, `date -s`): every kept
    /// time moves with it, so a counting window or a quiet period goes on
    /// measuring the time that passed, not the jump, and the times kept
    /// (shown, saved) stay on the clock as it reads now.
    pub fn shift(&mut self, by: SignedDuration) {
        let moved = |t: Timestamp| t.checked_add(by).unwrap_or(t);
        for s in self.state.values_mut() {
            s.since = moved(s.since);
            s.last_match = s.last_match.map(moved);
        }
        for q in self.counts.values_mut() {
            for (t, _) in q.iter_mut() {
                *t = moved(*t);
            }
        }
    }

    /// Restored times later than `now` are taken as `now`: the clock was set
    /// back while the monitor was stopped (no step to follow), and a time in
    /// the future would otherwise read as long ago.
    pub fn clamp_to(&mut self, now: Timestamp) {
        for s in self.state.values_mut() {
            s.since = s.since.min(now);
            s.last_match = s.last_match.map(|m| m.min(now));
        }
        for q in self.counts.values_mut() {
            for (t, _) in q.iter_mut() {
                *t = (*t).min(now);
            }
        }
    }

    pub fn state(&self) -> &BTreeMap<String, ConditionState> {
        &self.state
    }

    /// A counting rule's key in the saved state: its reason, and its place
    /// among the rules of that reason when there are several.
    fn count_key(&self, r: usize) -> String {
        let reason = &self.rules[r].reason;
        match self.rules[..r]
            .iter()
            .filter(|x| &x.reason == reason)
            .count()
        {
            0 => reason.clone(),
            n => format!("{reason}#{n}"),
        }
    }

    /// Each counting rule's matches in its window, to be saved: a restart
    /// goes on counting where it was, as log-counter, which reads its whole
    /// lookback on every run, does.
    pub fn counts_state(&self) -> BTreeMap<String, Vec<(Timestamp, i64)>> {
        self.counts
            .iter()
            .filter(|(_, q)| !q.is_empty())
            .map(|(r, q)| (self.count_key(*r), q.iter().copied().collect()))
            .collect()
    }

    /// Restores saved counts (after [`Engine::restore`]). An NPD-matching
    /// counting rule that holds its condition with no saved counts (a state
    /// written before counts were saved) is taken to have reached its
    /// threshold at the condition's last match, so it clears a window after
    /// that, not at once.
    pub fn restore_counts(&mut self, saved: BTreeMap<String, Vec<(Timestamp, i64)>>) {
        for r in 0..self.rules.len() {
            let Some((threshold, window)) = self.rules[r].count else {
                continue;
            };
            match saved.get(&self.count_key(r)) {
                Some(q) => {
                    self.counts.insert(r, rebucket(q, window));
                }
                None if self.npd.is_some() => {
                    let held = self.rules[r].condition.and_then(|c| {
                        (self.holder(c) == Some(r))
                            .then(|| self.state.get(&self.conditions[c].type_))
                            .flatten()
                    });
                    if let Some(s) = held {
                        let at = s.last_match.unwrap_or(s.since);
                        self.counts
                            .insert(r, VecDeque::from([(at, threshold as i64)]));
                    }
                }
                None => {}
            }
        }
    }

    /// Each rule's reason, with the condition type of a permanent rule.
    pub fn rule_reasons(&self) -> impl Iterator<Item = (&str, Option<&str>)> {
        self.rules.iter().map(|r| {
            (
                r.reason.as_str(),
                r.condition.map(|c| self.conditions[c].type_.as_str()),
            )
        })
    }

    /// Condition types this monitor owns.
    pub fn condition_types(&self) -> impl Iterator<Item = &str> {
        self.conditions.iter().map(|c| c.type_.as_str())
    }

    /// The current state of every condition (restored or default), for the
    /// start and after a reload: an active condition's taint is put back if
    /// it went missing, and an owned taint of a clear condition (its removal
    /// failed before) is removed.
    pub fn current(&mut self, now: Timestamp) -> Vec<Action> {
        let mut out = Vec::new();
        for c in &self.conditions {
            let s = self
                .state
                .entry(c.type_.clone())
                .or_insert_with(|| c.initial(now));
            if s.unknown {
                out.push(Action::Unknown {
                    type_: c.type_.clone(),
                    reason: s.reason.clone(),
                    message: s.message.clone(),
                });
            } else {
                out.push(Action::Condition {
                    type_: c.type_.clone(),
                    active: s.active,
                    reason: s.reason.clone(),
                    message: s.message.clone(),
                });
            }
            if let Some((key, value, effect)) = &c.taint
                && (s.active || s.taint_added)
            {
                out.push(Action::Taint {
                    condition: c.type_.clone(),
                    key: key.clone(),
                    value: value.clone(),
                    effect: effect.clone(),
                    add: s.active,
                });
            }
        }
        out
    }

    /// A taint add failed in a way that may have been applied (its answer
    /// lost): the taint a later attempt finds there is nodeguard's.
    pub fn taint_maybe_added(&mut self, condition: &str) {
        self.taint_maybe_added.insert(condition.to_string());
    }

    /// Records what a [`Action::Taint`] did: nodeguard owns the taint only
    /// when its add put it there (or may have, see
    /// [`Engine::taint_maybe_added`]).
    pub fn taint_result(&mut self, condition: &str, outcome: TaintOutcome) {
        let maybe_added = if outcome == TaintOutcome::Failed {
            self.taint_failed.insert(condition.to_string());
            false
        } else {
            self.taint_failed.remove(condition);
            self.taint_maybe_added.remove(condition)
        };
        let Some(s) = self.state.get_mut(condition) else {
            return;
        };
        // Left as someone else's, a taint nodeguard's failed add put there
        // would stay on the node after the condition clears.
        let outcome = match outcome {
            TaintOutcome::AlreadyPresent if maybe_added && s.active => TaintOutcome::Added,
            o => o,
        };
        match outcome {
            TaintOutcome::Added => {
                s.taint_added = true;
                s.taint = self
                    .conditions
                    .iter()
                    .find(|c| c.type_ == condition)
                    .and_then(|c| c.taint.as_ref())
                    .map(|(key, _, effect)| OwnedTaint {
                        key: key.clone(),
                        effect: effect.clone(),
                    });
            }
            TaintOutcome::Removed => {
                s.taint_added = false;
                s.taint = None;
            }
            TaintOutcome::AlreadyPresent | TaintOutcome::Failed => {}
        }
    }

    /// The taint updates to try again: for each condition whose last one
    /// failed, what its taint should be now (added while the condition is
    /// True, removed while it is clear and nodeguard added it). A condition
    /// that needs nothing any more is forgotten.
    pub fn taint_retries(&mut self) -> Vec<Action> {
        let mut out = Vec::new();
        let failed = std::mem::take(&mut self.taint_failed);
        for type_ in failed {
            let Some(c) = self.conditions.iter().find(|c| c.type_ == type_) else {
                continue;
            };
            let (Some((key, value, effect)), Some(s)) = (&c.taint, self.state.get(&type_)) else {
                continue;
            };
            if !s.active && !s.taint_added && !self.taint_maybe_added.contains(&type_) {
                continue;
            }
            out.push(Action::Taint {
                condition: type_.clone(),
                key: key.clone(),
                value: value.clone(),
                effect: effect.clone(),
                add: s.active,
            });
            // Still pending until its outcome says otherwise.
            self.taint_failed.insert(type_);
        }
        out
    }

    /// This is a new boot (the saved state is from an earlier one): the
    /// conditions that reset at boot go back to their no-problem state.
    pub fn on_new_boot(&mut self, now: Timestamp) -> Vec<Action> {
        let mut out = Vec::new();
        for i in 0..self.conditions.len() {
            if self.conditions[i].resets_at_boot {
                self.clear(i, "the node rebooted", now, &mut out);
            }
        }
        self.counts.clear();
        out
    }

    /// One log line.
    pub fn on_line(&mut self, line: &str, now: Timestamp) -> Vec<Action> {
        let mut out = Vec::new();
        // The joined text is taken out of the buffer while the rules run
        // (they need the engine), and put back for the next line.
        let mut joined = String::new();
        let text = match &mut self.npd {
            None => line,
            Some(buffer) => {
                if !buffer.push(line) {
                    return out;
                }
                std::mem::swap(&mut joined, &mut buffer.joined);
                joined.as_str()
            }
        };
        // A line's revert matches count before its matches (log-counter
        // applies both before it compares with the threshold).
        let mut matched = self.patterns.matches(text);
        self.matched |= !matched.is_empty();
        matched.sort_by_key(|i| !matches!(self.pattern_of[*i], PatternOf::Revert(_)));
        for idx in matched {
            match self.pattern_of[idx] {
                PatternOf::Clear(c) => {
                    self.clear(c, "cleared by a matching log line", now, &mut out)
                }
                PatternOf::Revert(r) => self.revert(r, now),
                PatternOf::Rule(r) => {
                    let message = match &self.rules[r].message {
                        // Without `$` there is nothing to expand.
                        Some(template) if !template.contains('$') => template.clone(),
                        Some(template) => {
                            let mut m = String::new();
                            match self.patterns.regex(idx).and_then(|re| re.captures(text)) {
                                Some(caps) => caps.expand(template, &mut m),
                                None => m = template.clone(),
                            }
                            m
                        }
                        // NPD's message: the lines the match spans.
                        None if self.npd.is_some() => {
                            let start = self
                                .patterns
                                .regex(idx)
                                .and_then(|re| re.find(text))
                                .map_or(0, |m| m.start());
                            // A match starting at a newline starts on the next line.
                            let from = if text.as_bytes().get(start) == Some(&b'\n') {
                                start + 1
                            } else {
                                text[..start].rfind('\n').map_or(0, |i| i + 1)
                            };
                            let lines = &text[from..];
                            match self.npd.as_ref().and_then(|b| b.suffix.as_deref()) {
                                Some(suffix) => format!("{lines}; {suffix}"),
                                None => lines.to_string(),
                            }
                        }
                        None => line.to_string(),
                    };
                    self.fire(r, message, now, &mut out)
                }
            }
        }
        if let Some(buffer) = &mut self.npd {
            buffer.joined = joined;
        }
        out
    }

    /// A counting rule's revert pattern matched: one match fewer in its
    /// window (NPD log-counter's `--revert-pattern`).
    fn revert(&mut self, r: usize, now: Timestamp) {
        let Some((_, window)) = self.rules[r].count else {
            return;
        };
        count(self.counts.entry(r).or_default(), now, -1, window);
    }

    /// A plugin rule's result (rule index in the monitor's `rules`).
    pub fn on_plugin(
        &mut self,
        rule: usize,
        status: PluginStatus,
        output: &str,
        now: Timestamp,
    ) -> Vec<Action> {
        let mut out = Vec::new();
        let Some(r) = self.rules.get(rule).cloned() else {
            return out;
        };
        match status {
            PluginStatus::Problem => {
                let message = match &r.message {
                    Some(m) => m.clone(),
                    // NPD: the output as it is, empty or not.
                    None if self.npd_plugin => output.to_string(),
                    None if output.trim().is_empty() => {
                        format!("The {} check reported a problem.", r.reason)
                    }
                    None => output.to_string(),
                };
                self.failing.insert(rule, message.clone());
                // Another failing check of the same condition holds it:
                // it keeps its reason (no flip-flop between two failures).
                // NPD: the last result wins.
                if let Some(c) = r.condition
                    && !self.npd_plugin
                    && let Some(holder) = self.holder(c)
                    && holder != rule
                    && self.failing.contains_key(&holder)
                {
                    return out;
                }
                self.fire(rule, message, now, &mut out);
            }
            PluginStatus::Ok => {
                self.failing.remove(&rule);
                if let Some(c) = r.condition
                    && self.npd_plugin
                {
                    // NPD: the last result wins, from True or Unknown
                    // (its first and third cases).
                    self.clear(c, "its check passes again", now, &mut out);
                } else if let Some(c) = r.condition
                    && self.holder(c) == Some(rule)
                {
                    // Another check of the condition still fails: it takes
                    // the condition over; otherwise the condition clears.
                    let other = self
                        .failing
                        .iter()
                        .find(|(i, _)| self.rules[**i].condition == Some(c))
                        .map(|(i, m)| (*i, m.clone()));
                    match other {
                        Some((i, message)) => self.fire(i, message, now, &mut out),
                        None => self.clear(c, "its check passes again", now, &mut out),
                    }
                }
            }
            // NPD: a temporary rule reports an unknown result as a problem
            // (exit status at or above NonOK); a permanent one makes its
            // condition Unknown.
            PluginStatus::Unknown if self.npd_plugin => {
                self.failing.remove(&rule);
                match r.condition {
                    None => self.fire(rule, output.to_string(), now, &mut out),
                    Some(c) => self.unknown(c, output, now, &mut out),
                }
            }
            PluginStatus::Unknown => {}
        }
        out
    }

    /// Condition `c` becomes Unknown, as node-problem-detector's custom
    /// plugin monitor makes it: the condition's own reason, the check's
    /// output as its message (Unknown stays Unknown without a change).
    fn unknown(&mut self, c: usize, output: &str, now: Timestamp, out: &mut Vec<Action>) {
        let cond = self.conditions[c].clone();
        let s = self
            .state
            .entry(cond.type_.clone())
            .or_insert_with(|| cond.initial(now));
        if s.unknown {
            return;
        }
        let untaint = s.taint_added;
        s.active = false;
        s.unknown = true;
        s.reason = cond.default_reason.clone();
        // Clipped as a True condition's message is.
        s.message = crate::report::clip(output, MESSAGE_LIMIT);
        s.since = now;
        out.push(Action::Unknown {
            type_: cond.type_.clone(),
            reason: s.reason.clone(),
            message: s.message.clone(),
        });
        out.push(Action::Event {
            reason: cond.default_reason.clone(),
            message: cond.npd_event("Unknown", &cond.default_reason, &s.message),
        });
        // Not True: its taint goes (as a restatement would remove it).
        cond.untaint(untaint, out);
    }

    /// Whether condition changes are worded as node-problem-detector's
    /// Events.
    fn npd_words(&self) -> bool {
        self.npd.is_some() || self.npd_plugin
    }

    /// The rule whose reason an active condition `c` shows.
    fn holder(&self, c: usize) -> Option<usize> {
        let s = self.state.get(&self.conditions[c].type_)?;
        if !s.active {
            return None;
        }
        self.rules
            .iter()
            .position(|x| x.condition == Some(c) && x.reason == s.reason)
    }

    fn fire(&mut self, r: usize, message: String, now: Timestamp, out: &mut Vec<Action>) {
        let rule = self.rules[r].clone();
        if let Some((threshold, window)) = rule.count {
            let q = self.counts.entry(r).or_default();
            if count(q, now, 1, window) < threshold as i64 {
                return;
            }
            // NPD's log-counter counts its whole window on every run, so an
            // imported counter stays True while the window holds enough
            // matches (and clears when it no longer does, see `on_tick`);
            // a native counting rule starts counting again after it fires.
            if self.npd.is_none() {
                q.clear();
            }
        }
        // NPD keeps a plugin's output as its cut left it (a space at the
        // end too); other messages are trimmed.
        let message = if self.npd_plugin {
            crate::report::clip(&message, MESSAGE_LIMIT)
        } else {
            truncate(&message)
        };
        match (rule.kind, rule.condition) {
            (ProblemKind::Temporary, _) | (ProblemKind::Permanent, None) => {
                out.push(Action::Event {
                    reason: rule.reason.clone(),
                    message,
                })
            }
            (ProblemKind::Permanent, Some(c)) => {
                let cond = self.conditions[c].clone();
                let s = self
                    .state
                    .entry(cond.type_.clone())
                    .or_insert_with(|| cond.initial(now));
                s.last_match = Some(now);
                let was_active = s.active;
                if !was_active || s.reason != rule.reason {
                    if !was_active {
                        s.since = now;
                    }
                    s.active = true;
                    s.unknown = false;
                    s.reason = rule.reason.clone();
                    s.message = message.clone();
                    out.push(Action::Condition {
                        type_: cond.type_.clone(),
                        active: true,
                        reason: rule.reason.clone(),
                        message: message.clone(),
                    });
                    // An NPD-matching monitor words the change as NPD does,
                    // for alerts and tooling keyed on NPD's Events.
                    let message = if self.npd_words() {
                        cond.npd_event("True", &rule.reason, &message)
                    } else {
                        message
                    };
                    out.push(Action::Event {
                        reason: rule.reason.clone(),
                        message,
                    });
                    if let Some((key, value, effect)) = &cond.taint
                        && !was_active
                    {
                        out.push(Action::Taint {
                            condition: cond.type_.clone(),
                            key: key.clone(),
                            value: value.clone(),
                            effect: effect.clone(),
                            add: true,
                        });
                    }
                }
            }
        }
    }

    fn clear(&mut self, c: usize, why: &str, now: Timestamp, out: &mut Vec<Action>) {
        let cond = self.conditions[c].clone();
        let npd_words = self.npd_words();
        let Some(s) = self.state.get_mut(&cond.type_) else {
            return;
        };
        if !s.active && !s.unknown {
            return;
        }
        let was = s.reason.clone();
        s.active = false;
        s.unknown = false;
        s.reason = cond.default_reason.clone();
        s.since = now;
        // An NPD-matching monitor clears as NPD does: the condition's own
        // message, and the change worded as NPD words it (alerts keyed on
        // NPD's "is now: False" Events keep working). Others say why.
        let event = if npd_words {
            s.message = cond.default_message.clone();
            cond.npd_event("False", &cond.default_reason, &cond.default_message)
        } else {
            s.message = format!(
                "{} (was {was}: {why} at {})",
                cond.default_message,
                now.strftime("%Y-%m-%dT%H:%M:%SZ")
            );
            s.message.clone()
        };
        out.push(Action::Condition {
            type_: cond.type_.clone(),
            active: false,
            reason: s.reason.clone(),
            message: s.message.clone(),
        });
        out.push(Action::Event {
            reason: cond.default_reason.clone(),
            message: event,
        });
        cond.untaint(s.taint_added, out);
    }

    /// Whether [`Engine::on_tick`] may have something to do as time
    /// passes: a True condition that clears after a quiet period, or one
    /// held by an NPD counting rule whose window may empty. Otherwise time
    /// alone changes nothing, and the monitor need not tick.
    pub fn has_timed_work(&self) -> bool {
        let counted = self.npd.is_some()
            && self.rules.iter().enumerate().any(|(r, rule)| {
                rule.count.is_some() && rule.condition.is_some_and(|c| self.holder(c) == Some(r))
            });
        counted
            || self.conditions.iter().any(|c| {
                c.clear_after.is_some()
                    && self
                        .state
                        .get(&c.type_)
                        .is_some_and(|s| s.active && s.last_match.is_some())
            })
    }

    /// Whether a taint change failed and waits for
    /// [`Engine::taint_retries`].
    pub fn has_taint_retries(&self) -> bool {
        !self.taint_failed.is_empty()
    }

    /// Whether a line since the last call matched a pattern (the engine's
    /// state may have changed); lines that matched nothing moved only the
    /// monitor's position.
    pub fn take_matched(&mut self) -> bool {
        std::mem::take(&mut self.matched)
    }

    /// Clears conditions whose quiet period has passed, and NPD-matching
    /// counted conditions whose window no longer holds enough matches (as
    /// log-counter reports OK again: the oldest aged out, or a revert line
    /// took one off).
    pub fn on_tick(&mut self, now: Timestamp) -> Vec<Action> {
        let mut out = Vec::new();
        if self.npd.is_some() {
            for r in 0..self.rules.len() {
                let (Some((threshold, window)), Some(c)) =
                    (self.rules[r].count, self.rules[r].condition)
                else {
                    continue;
                };
                if self.holder(c) != Some(r) {
                    continue;
                }
                let q = self.counts.entry(r).or_default();
                if net(q, now, window) < threshold as i64 {
                    let why = format!(
                        "fewer than {threshold} matches in the last {}s",
                        window.as_secs()
                    );
                    self.clear(c, &why, now, &mut out);
                }
            }
        }
        for i in 0..self.conditions.len() {
            let Some(quiet) = self.conditions[i].clear_after else {
                continue;
            };
            let due = self.state.get(&self.conditions[i].type_).is_some_and(|s| {
                s.active
                    && s.last_match
                        .is_some_and(|m| now.duration_since(m).unsigned_abs() >= quiet)
            });
            if due {
                let why = format!("no matching line for {}s", quiet.as_secs());
                self.clear(i, &why, now, &mut out);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests;
