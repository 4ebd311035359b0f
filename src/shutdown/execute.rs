//! One shutdown: the plan, the condition, the taint, the priority groups
//! (each pod stepped by the decision core within its group's window), the
//! release.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use k8s_openapi::api::core::v1::Pod;
use tokio::sync::watch;
use tokio::time::{Instant, sleep_until, timeout, timeout_at};
use tokio_util::sync::CancellationToken;

use super::ClusterPort;
use super::cluster::{self, Evicted, pod_facts};
use super::conditions::report_condition;
use super::core;
use super::keep::{self, Keeper};
use super::logind::InhibitLock;
use super::metrics::unix_seconds;
use super::state::{ShutdownRecord, StartedBy};
use super::taint::taint_for_shutdown;
use super::{Ctx, ShutdownConfig, save};
use crate::k8s::watch::Snapshot;
use crate::report::EventKind;

/// How a shutdown's groups ended, as the release's Event says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ending {
    AllGroupsDone,
    /// The plan's release point came first.
    WindowClosing,
    /// logind cancelled it, or the agent stopped: no release here.
    Cancelled,
}

impl std::fmt::Display for Ending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Ending::AllGroupsDone => "all groups done",
            Ending::WindowClosing => "the inhibit window is closing",
            Ending::Cancelled => "cancelled",
        })
    }
}

/// A shutdown: plan, condition, taint, groups, release. Returns the record.
///
/// The inhibitor is released at the plan's release point whatever the API
/// does: every API call of a group ends with the group's window, and the
/// taint request runs beside the groups (it holds nothing back).
pub(super) async fn execute<C: ClusterPort>(
    ctx: Arc<Ctx<C>>,
    cfg: ShutdownConfig,
    lock: Option<InhibitLock>,
    delay_max: Duration,
    mut record: ShutdownRecord,
    resume: bool,
    cancel: CancellationToken,
) -> ShutdownRecord {
    let now_wall = ctx.clock.now();
    let now_monotonic = ctx.clock.monotonic();
    // A resumed shutdown's start, as recorded before this process, for
    // the start's Event if its predecessor did not get it stored.
    let late = resume.then(|| Start::late(&record));
    // A resumed shutdown, or one found under way with its start known (the
    // handover unit's note): timed from when it began.
    let start = if resume || record.started_at.is_some() {
        Instant::now() - resumed_after(&ctx, &record, now_wall, now_monotonic)
    } else {
        Instant::now()
    };
    let already = if resume {
        wait_for_pods(&ctx, &cfg, delay_max).await;
        already_terminating(&ctx, &record, now_wall, delay_max)
    } else {
        BTreeSet::new()
    };
    stamp(&ctx, &cfg, &mut record, now_wall, now_monotonic, resume);
    // From here until the release, a copy of the lock outlives this
    // process (an agent killed now does not let logind go on).
    let lock = lock.map(|l| l.kept_by(&ctx.keeper));
    ctx.metrics
        .start_time
        .set(unix_seconds(record.started_at.unwrap_or(now_wall)));
    ctx.metrics.end_time.set(0.0);
    let (groups, timeline) = plan(&ctx, &cfg, &record, delay_max, start);
    let stored = announce(&ctx, &cfg, &record, late, start, &already);
    let (ending, record) = run(
        &ctx,
        &cfg,
        &groups,
        &timeline,
        record,
        resume,
        start,
        delay_max,
        &already,
        stored.clone(),
        &cancel,
    )
    .await;
    if ending == Ending::Cancelled {
        return record;
    }
    release(&ctx, &cfg, record, lock, ending, start, delay_max, &stored).await
}

/// Whether the API server stored the start's Event: `None` while its
/// publish is under way, then whether it was stored (`false`: dropped).
type StartStored = watch::Receiver<Option<bool>>;

fn start_stored(stored: &StartStored) -> bool {
    *stored.borrow() == Some(true)
}

/// How far into the shutdown a restarted agent is. Offsets are from the
/// original start: by the monotonic clock on the same boot (a wall-clock
/// step between the start and the restart changes nothing), by the wall
/// clock for a record written before the monotonic time was kept.
fn resumed_after<C>(
    ctx: &Ctx<C>,
    record: &ShutdownRecord,
    now_wall: jiff::Timestamp,
    now_monotonic: Duration,
) -> Duration {
    core::resumed_after(
        record.started_monotonic_ms,
        record.started_at,
        record.boot_id == ctx.boot_id,
        now_monotonic,
        now_wall,
    )
}

/// A resumed agent may not have its pod list yet: planning without it
/// would find every group empty and release at once.
async fn wait_for_pods<C>(ctx: &Ctx<C>, cfg: &ShutdownConfig, delay_max: Duration) {
    if ctx.pods.borrow().is_none() {
        let mut pods = ctx.pods.clone();
        let _ = timeout(
            delay_max.saturating_sub(cfg.safety_margin),
            pods.wait_for(Option::is_some),
        )
        .await;
    }
}

/// Pods whose deletion began since this shutdown started: a previous
/// process of the agent evicted them. Evicting them again would cut their
/// grace to the shorter window left, so they are only waited for.
fn already_terminating<C>(
    ctx: &Ctx<C>,
    record: &ShutdownRecord,
    now_wall: jiff::Timestamp,
    delay_max: Duration,
) -> BTreeSet<String> {
    let since = core::terminating_cutoff(record.started_at, now_wall, delay_max);
    terminating_since(&ctx.pods.borrow(), since)
}

/// The record's start, boot and plan (kept from a previous process), on
/// disk before the copy goes to the keeper and before any eviction: a
/// process killed from here on leaves a record, so its successor resumes
/// by the original start.
fn stamp<C>(
    ctx: &Ctx<C>,
    cfg: &ShutdownConfig,
    record: &mut ShutdownRecord,
    now_wall: jiff::Timestamp,
    now_monotonic: Duration,
    resume: bool,
) {
    if record.started_at.is_none() {
        record.started_at = Some(now_wall);
        record.started_monotonic_ms = Some(now_monotonic.as_millis() as u64);
        if resume {
            // Resumed with no record: found now, begun earlier.
            record.started_by = StartedBy::Found;
        }
    }
    record.boot_id = ctx.boot_id.clone();
    if record.plan.is_none() {
        record.plan = Some(cfg.clone());
    }
    save(ctx, record);
}

/// The plan, computed once: the groups with pods share what logind allows.
/// Its release point goes into the condition.
fn plan<C>(
    ctx: &Ctx<C>,
    cfg: &ShutdownConfig,
    record: &ShutdownRecord,
    delay_max: Duration,
    start: Instant,
) -> (Vec<core::Group>, core::Timeline) {
    let facts: Vec<core::PodFacts> = ctx
        .pods
        .borrow()
        .as_ref()
        .map(|s| s.values().map(|p| pod_facts(p)).collect())
        .unwrap_or_default();
    let groups = core::group_pods(&cfg.groups, &facts, cfg.include);
    let occupied: Vec<bool> = groups
        .iter()
        .map(|g| !g.pods.is_empty() && !record.groups_done.contains(&g.spec.priority))
        .collect();
    let timeline = core::timeline(
        &cfg.groups,
        &occupied,
        delay_max.saturating_sub(cfg.safety_margin),
        Instant::now().saturating_duration_since(start),
    );
    report_condition(
        ctx,
        &core::Phase::Running {
            groups: cfg.groups.len(),
            release: timeline.release,
        },
        None,
    );
    (groups, timeline)
}

/// The Event that says a shutdown began, or that a restarted agent goes on
/// with one. A restarted agent whose predecessor was killed before the
/// API server stored the start's Event says that one too, first (with the
/// recorded start): the shutdown's start is what operators and alerts
/// look for. `late` is the start to say when this process resumes (from
/// the record as it was before). The receiver says when the start's Event
/// is stored, or was before.
fn announce<C>(
    ctx: &Ctx<C>,
    cfg: &ShutdownConfig,
    record: &ShutdownRecord,
    late: Option<Start>,
    start: Instant,
    already: &BTreeSet<String>,
) -> StartStored {
    let resume = late.is_some();
    let (tx, rx) = watch::channel(record.announced.then_some(true));
    if !record.announced {
        let stored = say_started(&ctx.reporter, late.unwrap_or(Start::Now));
        tokio::spawn(async move {
            let _ = tx.send(Some(stored.await));
        });
    }
    if resume {
        let message = format!(
            "nodeguard restarted {:.1}s into the shutdown and goes on with the remaining priority groups ({} of {} done{}).",
            Instant::now()
                .saturating_duration_since(start)
                .as_secs_f64(),
            record.groups_done.len(),
            cfg.groups.len(),
            if already.is_empty() {
                String::new()
            } else {
                format!(
                    "; {} pod(s) already terminating are not evicted again",
                    already.len()
                )
            }
        );
        tracing::warn!("{message}");
        ctx.reporter.event(
            EventKind::Warning,
            "ShutdownResumed",
            "ResumeShutdown",
            message,
        );
    }
    rx
}

/// Whose `ShutdownStarted` it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Start {
    /// The shutdown begins now.
    Now,
    /// A restarted agent says it for a predecessor stopped before its
    /// Event was stored; when the shutdown began, if that was recorded.
    Late(Option<jiff::Timestamp>),
    /// The agent that took over from the handover unit says it: the
    /// shutdown began between the two agents, at the unit's note.
    HandedOver(jiff::Timestamp),
}

impl Start {
    /// The start a restarted agent says, from the record as it found it.
    pub(super) fn late(record: &ShutdownRecord) -> Start {
        match (record.started_by, record.started_at) {
            (StartedBy::Handover, Some(at)) => Start::HandedOver(at),
            (StartedBy::Found, _) => Start::Late(None),
            (_, at) => Start::Late(at),
        }
    }
}

/// Queues `ShutdownStarted`; the future says whether it was stored.
pub(super) fn say_started(
    reporter: &crate::report::Reporter,
    start: Start,
) -> impl std::future::Future<Output = bool> + use<> {
    let what = format!(
        "nodeguard taints the node {} and evicts its pods by priority",
        cluster::TAINT_KEY
    );
    let late =
        "Said by the restarted agent: the one before was stopped before its Event was stored.";
    let note = match start {
        Start::Now => format!("The host is shutting down (PrepareForShutdown); {what}."),
        Start::Late(Some(at)) => {
            format!("The host began shutting down at {at} (PrepareForShutdown); {what}. {late}")
        }
        Start::Late(None) => format!(
            "The host is shutting down (PrepareForShutdown), since a time not recorded (the shutdown was found under way); {what}. {late}"
        ),
        Start::HandedOver(at) => format!(
            "The host began shutting down at {at} (PrepareForShutdown), between two agents: the handover unit held the delay lock and noted when; {what}. Said by the agent that took over."
        ),
    };
    reporter.event_confirmed(EventKind::Warning, "ShutdownStarted", "StartShutdown", note)
}

/// The groups, with the taint request beside them, until the groups are
/// done, the release point comes or the shutdown is cancelled.
#[allow(clippy::too_many_arguments)]
async fn run<C: ClusterPort>(
    ctx: &Arc<Ctx<C>>,
    cfg: &ShutdownConfig,
    groups: &[core::Group],
    timeline: &core::Timeline,
    record: ShutdownRecord,
    resume: bool,
    start: Instant,
    delay_max: Duration,
    already: &BTreeSet<String>,
    mut stored: StartStored,
    cancel: &CancellationToken,
) -> (Ending, ShutdownRecord) {
    let limit = delay_max.saturating_sub(cfg.safety_margin);
    let record = std::sync::Mutex::new(record);
    let release_at = start + timeline.release;
    let (ending, taint_done) = {
        let lock_record = || record.lock().unwrap_or_else(|e| e.into_inner());
        // A process before this one may have had its request applied and
        // been killed before it recorded the answer: the taint found is
        // then its, not a taint someone else put there before the shutdown.
        let unanswered_before = resume && !lock_record().taint_answered;
        // The taint request runs beside the groups (see
        // `taint_for_shutdown`); its first answer (or none within
        // `CALL_HEADROOM`) lets the groups begin.
        let first_answer = tokio::sync::Notify::new();
        let taint = taint_for_shutdown(ctx, &record, unanswered_before, &first_answer);
        // A resumed shutdown whose taint request was answered before has
        // its taint: the groups go on at once.
        let wait_for_taint = !resume || unanswered_before;
        let work = async {
            if wait_for_taint {
                let _ = tokio::time::timeout(core::CALL_HEADROOM, first_answer.notified()).await;
            }
            run_groups(ctx, cfg, groups, timeline, start, &record, already).await
        };
        // The record (written before the groups) goes to disk again once
        // the taint request has answered, so a successor knows whose taint
        // it is.
        tokio::pin!(taint, work);
        let mut taint_done = false;
        let mut announced_done = false;
        let mut ending = loop {
            tokio::select! {
                _ = &mut work => break Ending::AllGroupsDone,
                _ = &mut taint, if !taint_done => taint_done = true,
                said = stored.wait_for(Option::is_some), if !announced_done => {
                    // The start's Event stored: the record says so, so a
                    // successor does not say it again.
                    announced_done = true;
                    let said = said.is_ok_and(|v| *v == Some(true));
                    let mut r = lock_record();
                    if said && !r.announced {
                        r.announced = true;
                        save(ctx, &r);
                    }
                }
                _ = sleep_until(release_at) => break Ending::WindowClosing,
                _ = cancel.cancelled() => break Ending::Cancelled,
            }
        };
        if !taint_done && ending != Ending::Cancelled {
            // Give the taint request its moment (the groups waited for it
            // up to 1 s already), so the node is tainted and the record
            // knows whose taint it is; one that does not answer holds the
            // release 1 s from the start at most, never past logind's
            // limit.
            let until = (start + limit).min(start + core::CALL_HEADROOM);
            tokio::select! {
                _ = &mut taint => taint_done = true,
                _ = sleep_until(until) => {}
                _ = cancel.cancelled() => ending = Ending::Cancelled,
            }
        }
        (ending, taint_done)
    };
    let mut record = record.into_inner().unwrap_or_else(|e| e.into_inner());
    if !taint_done {
        // The request may have reached the API server: count the taint as
        // nodeguard's, so a cancel or the next start removes it.
        tracing::warn!("the API server did not answer the taint request in time");
        record.taint_added = true;
    }
    (ending, record)
}

/// The end recorded, the last word published while the lock still holds
/// the host, then the release: logind may go on.
#[allow(clippy::too_many_arguments)]
async fn release<C>(
    ctx: &Ctx<C>,
    cfg: &ShutdownConfig,
    mut record: ShutdownRecord,
    lock: Option<InhibitLock>,
    ending: Ending,
    start: Instant,
    delay_max: Duration,
    stored: &StartStored,
) -> ShutdownRecord {
    let end = ctx.clock.now();
    record.ended_at = Some(end);
    record.announced |= start_stored(stored);
    ctx.metrics.end_time.set(unix_seconds(end));
    save(ctx, &record);
    let took = Instant::now().saturating_duration_since(start);
    let message = format!(
        "nodeguard released the shutdown inhibitor after {:.1}s ({ending}; {} of {} group(s) done).",
        took.as_secs_f64(),
        record.groups_done.len(),
        cfg.groups.len()
    );
    // The last word goes out while the lock still holds the host: once
    // logind goes on, the network may be gone before a publish after it
    // (the unit stopping the interfaces runs beside the kubelet's). At most
    // CALL_HEADROOM; a window the groups used up leaves the safety margin,
    // and logind's own limit is never passed (it would go on by itself).
    let published = ctx.reporter.event_confirmed(
        EventKind::Normal,
        "ShutdownInhibitorReleased",
        "ReleaseInhibitor",
        message.clone(),
    );
    let until = (start + delay_max).min(Instant::now() + core::CALL_HEADROOM);
    if !matches!(tokio::time::timeout_at(until, published).await, Ok(true)) {
        tracing::debug!("the release's Event is not confirmed; releasing anyway");
    }
    // The start's Event, queued before the release's, is done by now when
    // the release's is: a record that says so keeps a successor (killed
    // and restarted while the host goes down) from saying it again.
    if !record.announced && start_stored(stored) {
        record.announced = true;
        save(ctx, &record);
    }
    // Release: logind may now proceed. The keeper's copy goes too, also
    // when this process resumed without holding a lock of its own.
    let kept = lock.is_some();
    drop(lock);
    if !kept && ctx.keeper != Keeper::None {
        let _ = ctx.keeper.forget(keep::INHIBITOR);
    }
    ctx.metrics.inhibitor_held.set(0);
    tracing::info!("{message}");
    record
}

/// The groups in order, each within the window the timeline gives it.
pub(super) async fn run_groups<C: ClusterPort>(
    ctx: &Ctx<C>,
    cfg: &ShutdownConfig,
    groups: &[core::Group],
    timeline: &core::Timeline,
    start: Instant,
    record: &std::sync::Mutex<ShutdownRecord>,
    already: &BTreeSet<String>,
) {
    let lock = || record.lock().unwrap_or_else(|e| e.into_inner());
    for (i, group) in groups.iter().enumerate() {
        let priority = group.spec.priority;
        if lock().groups_done.contains(&priority) {
            continue;
        }
        // A group's window opens when the previous group is done (early
        // when its pods left early).
        let opened = Instant::now();
        let window = timeline.window(i, opened.saturating_duration_since(start));
        let skipped = core::too_short(window) && !group.pods.is_empty();
        if skipped {
            for _ in &group.pods {
                ctx.metrics.pod(priority, "skipped");
            }
            let message = format!(
                "Priority group {priority} ({} pod(s)) skipped: logind's limit leaves it less than a second after the higher-priority groups.",
                group.pods.len()
            );
            tracing::warn!("{message}");
            ctx.reporter.event(
                EventKind::Warning,
                "ShutdownGroupSkipped",
                "EvictPods",
                message,
            );
        } else {
            tracing::info!(group = priority, pods = group.pods.len(), window = ?window, "terminating priority group");
            for pod in group.pods.iter().filter(|p| already.contains(&p.key)) {
                tracing::info!(pod = %pod.key, "already terminating since this shutdown began; not evicted again");
                ctx.metrics.pod(priority, "already_terminating");
            }
            let tasks = group
                .pods
                .iter()
                .filter(|p| !already.contains(&p.key))
                .map(|pod| {
                    let plan =
                        core::PodPlan::new(window, pod, cfg.escalate, cfg.escalate_after_percent);
                    terminate(ctx, priority, plan, pod, opened)
                });
            join_all(tasks).await;
            wait_gone(ctx, &group.pods, opened + window).await;
        }
        {
            let mut r = lock();
            r.groups_done.push(priority);
            save(ctx, &r);
        }
        if !skipped {
            ctx.reporter.event(
                EventKind::Normal,
                "ShutdownGroupDone",
                "EvictPods",
                format!(
                    "Priority group {priority} done ({} pod(s)) {:.1}s into the shutdown.",
                    group.pods.len(),
                    Instant::now()
                        .saturating_duration_since(start)
                        .as_secs_f64()
                ),
            );
        }
    }
}

/// Terminates one pod as the decision core steps it: evictions, retries,
/// an escalating delete. Every call ends when the window does.
pub(super) async fn terminate<C: ClusterPort>(
    ctx: &Ctx<C>,
    group: i32,
    plan: core::PodPlan,
    pod: &core::PodFacts,
    opened: Instant,
) {
    let window_end = opened + plan.window;
    let mut attempt = 0;
    let mut pdb: Option<String> = None;
    let mut refusal = String::new();
    let mut delete: Option<i64> = None;
    loop {
        let outcome = match delete {
            None => match timeout_at(window_end, ctx.cluster.evict(&pod.key, plan.grace)).await {
                Ok(Ok(Evicted::Yes)) => core::Outcome::Evicted,
                Ok(Ok(Evicted::Gone)) => core::Outcome::Gone,
                Ok(Ok(Evicted::Blocked { pdb: p, message })) => {
                    pdb = p.or(pdb);
                    refusal = message;
                    tracing::debug!(pod = %pod.key, pdb = ?pdb, "eviction refused");
                    core::Outcome::Blocked
                }
                Ok(Err(e)) => {
                    tracing::warn!(pod = %pod.key, error = %e, "eviction failed");
                    core::Outcome::Failed
                }
                Err(_) => {
                    tracing::warn!(pod = %pod.key, "the eviction got no answer before the group's window closed");
                    core::Outcome::Failed
                }
            },
            Some(grace) => {
                match timeout_at(window_end, ctx.cluster.delete(&pod.key, grace)).await {
                    Ok(Ok(())) => core::Outcome::Deleted,
                    Ok(Err(e)) => {
                        tracing::warn!(pod = %pod.key, error = %e, "escalating delete failed");
                        core::Outcome::Failed
                    }
                    Err(_) => {
                        tracing::warn!(pod = %pod.key, "the escalating delete got no answer before the group's window closed");
                        core::Outcome::Failed
                    }
                }
            }
        };
        let now = Instant::now().saturating_duration_since(opened);
        match core::next(&plan, now, outcome, attempt) {
            core::PodStep::End(end) => {
                report_pod_end(
                    ctx,
                    group,
                    pod,
                    &plan,
                    end,
                    delete,
                    pdb.as_deref(),
                    &refusal,
                );
                return;
            }
            core::PodStep::Escalate { grace } => delete = Some(grace),
            core::PodStep::Retry { at } => {
                delete = None;
                attempt += 1;
                sleep_until(opened + at).await;
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
pub(super) fn report_pod_end<C>(
    ctx: &Ctx<C>,
    group: i32,
    pod: &core::PodFacts,
    plan: &core::PodPlan,
    end: core::PodEnd,
    delete_grace: Option<i64>,
    pdb: Option<&str>,
    refusal: &str,
) {
    if end != core::PodEnd::Gone {
        ctx.metrics.pod(group, end.label());
    }
    match end {
        core::PodEnd::Evicted => tracing::info!(pod = %pod.key, grace = plan.grace, "evicted"),
        core::PodEnd::Gone => {}
        core::PodEnd::Escalated => {
            let pdb_text = pdb
                .map(|p| format!("PodDisruptionBudget {p}"))
                .unwrap_or_else(|| "a PodDisruptionBudget".into());
            let note = format!(
                "Eviction of {} kept being refused by {pdb_text} ({refusal}); nodeguard deleted it with {}s grace so the node can shut down in time.",
                pod.key,
                delete_grace.unwrap_or(0)
            );
            tracing::warn!("{note}");
            ctx.reporter
                .event(EventKind::Warning, "EvictionEscalated", "DeletePod", note);
        }
        core::PodEnd::Blocked => ctx.reporter.event(
            EventKind::Warning,
            "EvictionBlocked",
            "EvictPod",
            format!(
                "{} stays: its eviction is refused by {} and escalation is off.",
                pod.key,
                pdb.unwrap_or("a PodDisruptionBudget")
            ),
        ),
        core::PodEnd::Failed => {
            tracing::error!(pod = %pod.key, "the pod could not be evicted before its group's window closed")
        }
    }
}

/// Keys of the pods whose deletion was asked for at or after `since`. (A
/// pod's deletionTimestamp is when its grace ends: the request came
/// deletionGracePeriodSeconds before.)
pub(super) fn terminating_since(
    pods: &Option<Snapshot<Pod>>,
    since: jiff::Timestamp,
) -> BTreeSet<String> {
    pods.as_ref()
        .map(|s| {
            s.iter()
                .filter(|(_, p)| {
                    let grace = p.metadata.deletion_grace_period_seconds.unwrap_or(0);
                    p.metadata.deletion_timestamp.as_ref().is_some_and(|t| {
                        t.0 - jiff::SignedDuration::from_secs(grace.max(0)) >= since
                    })
                })
                .map(|(k, _)| k.to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// Waits until the pods have left the node (or are terminal), or `until`.
pub(super) async fn wait_gone<C>(ctx: &Ctx<C>, pods: &[core::PodFacts], until: Instant) {
    let keys: BTreeSet<&str> = pods.iter().map(|p| p.key.as_str()).collect();
    let mut rx = ctx.pods.clone();
    loop {
        let remaining = rx
            .borrow_and_update()
            .as_ref()
            .map(|s| {
                s.iter()
                    .filter(|(k, p)| keys.contains(k.as_str()) && !pod_facts(p).terminal)
                    .count()
            })
            .unwrap_or(0);
        if remaining == 0 {
            return;
        }
        tokio::select! {
            _ = sleep_until(until) => return,
            r = rx.changed() => if r.is_err() { return },
        }
    }
}
