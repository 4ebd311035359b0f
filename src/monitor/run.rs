//! One monitor's run: restore its state, catch up, read its source, and
//! apply what the engine decides.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::apply::{Voice, apply};
use super::cleanup::remove_stale_taint;
use super::engine::{Action, Engine, PluginStatus};
use super::plugin::run_plugins;
use super::sources;
use super::sources::{Resume, SourceCounters, StopFlag};
use super::state::{MonitorState, load_state, same_boot, save_state_as};
use super::systemd::run_service_checks;
use super::{MonitorContext, MonitorError, QUEUE, TAINT_RETRY, TaintPort};
use crate::clock::WallClock;
use crate::policy::monitors::{MonitorSpec, Source};
use crate::report::EventKind;
use crate::server::LoopHandle;

/// A monitor's wall clock. The engine keeps wall times (they are saved and
/// read back after a restart); when the system clock steps (NTP, `date -s`),
/// the engine's times move by the step, so a counting window or a quiet
/// period measures the time that passed, not the jump.
pub(super) struct EngineClock {
    pub(super) clock: WallClock,
    /// The step the engine's times already follow.
    pub(super) followed: jiff::SignedDuration,
    /// The engine's times moved since the last save.
    pub(super) shifted: bool,
    pub(super) monitor: String,
}

/// Steps smaller than this are left alone (a window off by less than a
/// second does not matter; the readings differ by microseconds).
pub(super) const FOLLOWED_STEP: jiff::SignedDuration = jiff::SignedDuration::from_secs(1);

impl EngineClock {
    pub(super) fn new(monitor: &str) -> Self {
        EngineClock {
            clock: WallClock::new(),
            followed: jiff::SignedDuration::ZERO,
            shifted: false,
            monitor: monitor.to_string(),
        }
    }

    /// Wall time now, after moving the engine's times by any new step.
    pub(super) fn now(&mut self, engine: &mut Engine) -> jiff::Timestamp {
        let step = self.clock.step();
        let by = step - self.followed;
        if by.abs() >= FOLLOWED_STEP {
            tracing::info!(monitor = %self.monitor, step_seconds = by.as_secs_f64(), "the wall clock stepped; counting windows and quiet periods go on by elapsed time");
            engine.shift(by);
            self.followed = step;
            self.shifted = true;
        }
        self.clock.now()
    }

    /// Whether the engine's times moved since this was last asked: the
    /// state on disk must follow (a crash would read the old times back).
    pub(super) fn take_shifted(&mut self) -> bool {
        std::mem::take(&mut self.shifted)
    }
}

/// How long a position moved by lines that matched nothing waits to be
/// saved (a crash reads those lines again; they match nothing again).
const CURSOR_SAVE: Duration = Duration::from_secs(30);

/// The shortest time between two saves of a changed state (a rule that
/// matches every line of a flood is not an fsync per line), between two
/// looks at timed conditions, and between two Events saying lines were
/// lost.
const EVERY_SECOND: Duration = Duration::from_secs(1);

/// When the state is next due on disk: a change within a second of the
/// last save, a position alone within [`CURSOR_SAVE`]; `None` when nothing
/// waits. The loop's wake-up and its check read this one answer.
fn save_due(
    dirty: bool,
    cursor_moved: bool,
    last_save: tokio::time::Instant,
) -> Option<tokio::time::Instant> {
    if dirty {
        Some(last_save + EVERY_SECOND)
    } else if cursor_moved {
        Some(last_save + CURSOR_SAVE)
    } else {
        None
    }
}

/// When lost lines may next be said: at once the first time, then a
/// second after the last time (`since` is any instant already past).
fn lost_said_due(
    last_said: Option<tokio::time::Instant>,
    since: tokio::time::Instant,
) -> tokio::time::Instant {
    last_said.map_or(since, |t| t + EVERY_SECOND)
}

/// Whether `due` has come.
fn is_due(due: tokio::time::Instant) -> bool {
    due <= tokio::time::Instant::now()
}

/// Until `wake`, or until the source has news (lost lines, a refusal);
/// with no `wake`, until news.
async fn until_due(wake: Option<tokio::time::Instant>, news: &tokio::sync::Notify) {
    match wake {
        Some(at) => {
            tokio::select! {
                _ = tokio::time::sleep_until(at) => {}
                _ = news.notified() => {}
            }
        }
        None => news.notified().await,
    }
}

/// Runs until `stop`; `Err` says why it ended otherwise.
pub(super) async fn run_monitor<T: TaintPort>(
    spec: MonitorSpec,
    ctx: Arc<MonitorContext<T>>,
    handle: Arc<LoopHandle>,
    stop: CancellationToken,
) -> Result<(), String> {
    let mut clock = EngineClock::new(&spec.name);
    let mut engine = match Engine::new(&spec, &format!("monitor {}", spec.name)) {
        Ok(e) => e,
        Err(bad) => {
            // The policy validation rejects these; never crash on them.
            tracing::error!(monitor = %spec.name, problems = ?bad, "monitor rules do not compile; monitor not started");
            stop.cancelled().await;
            return Ok(());
        }
    };
    let saved = load_state(&ctx.state_dir, &spec.name);
    let new_boot = saved
        .as_ref()
        .is_some_and(|(s, before)| !same_boot(s, &ctx.boot_id, *before));
    let resume = Resume::plan(saved.as_ref().map(|(s, _)| &s.cursor), !new_boot);
    let mut state = saved.map(|(s, _)| s).unwrap_or_default();
    if new_boot {
        tracing::info!(monitor = %spec.name, "state from an earlier boot: kernel log read from this boot's start, conditions that reset at boot reset");
        // Nothing of the old boot's kernel log is left to resume after.
        state.cursor.kmsg_sequence = None;
    }
    state.boot_id = Some(ctx.boot_id.clone());
    for t in engine.restore(std::mem::take(&mut state.conditions)) {
        // The policy was edited while the agent was not running (or while
        // it was applying the edit): the old spec is gone, the state says
        // which taint nodeguard added.
        remove_stale_taint(&ctx, &spec.name, &t).await;
    }
    engine.restore_counts(std::mem::take(&mut state.counts));
    let now = clock.now(&mut engine);
    if !new_boot && let Some((wall, monotonic_ms)) = state.saved_at {
        // Wall time passed since the save, less the time that really passed.
        let really = clock
            .clock
            .monotonic()
            .saturating_sub(Duration::from_millis(monotonic_ms));
        let stepped =
            now.duration_since(wall) - jiff::SignedDuration::try_from(really).unwrap_or_default();
        if stepped.abs() >= FOLLOWED_STEP {
            tracing::info!(monitor = %spec.name, step_seconds = stepped.as_secs_f64(), "the wall clock stepped while the monitor was stopped; its saved times move with it");
            engine.shift(stepped);
        }
    }
    engine.clamp_to(now);
    ctx.metrics.declare(&spec, &engine);
    let counters = Arc::new(SourceCounters::default());
    ctx.metrics
        .sources
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(spec.name.clone(), counters.clone());
    let (tx, mut rx) = mpsc::channel(QUEUE);
    let source_stop = StopFlag::default();
    // However this run ends (it returns, panics or is aborted), its reader
    // thread is stopped, and a journalctl child killed.
    let _stop_reader = source_stop.stop_on_drop();
    // One source (validation rejects none and more). A line source is
    // started here; `started` names it with its result.
    let source = spec.source.one();
    let started = match source {
        Some(Source::Kmsg(k)) => {
            let r = sources::spawn_kmsg(
                PathBuf::from(&k.path),
                &ctx.read_roots,
                resume.kmsg,
                tx,
                counters.clone(),
                source_stop.clone(),
            );
            Some((k.path.clone(), r))
        }
        Some(Source::File(f)) => {
            let r = sources::spawn_file(
                PathBuf::from(&f.path),
                ctx.read_roots.clone(),
                resume.file,
                tx,
                counters.clone(),
                source_stop.clone(),
            );
            Some((f.path.clone(), r))
        }
        Some(Source::Journald(j)) => {
            let r = sources::spawn_journald(
                j.clone(),
                &ctx.journalctl,
                &ctx.read_roots,
                resume.journal.clone(),
                tx,
                counters.clone(),
                source_stop.clone(),
            );
            Some(("journalctl".to_string(), r))
        }
        Some(Source::Plugin(_) | Source::Systemd(_)) | None => {
            drop(tx);
            None
        }
    };
    // Whether lines come: a line source runs. Its queue closing means it ended.
    let lines_open = matches!(started, Some((_, Ok(_))));
    // Where it starts is saved at once: a restart before the first line
    // resumes there instead of at the (then later) end.
    if let Some((_, Ok(start))) = &started {
        state.cursor = start.clone();
    }
    let (plugin_tx, mut plugin_rx) = mpsc::channel::<(usize, PluginStatus, String)>(64);
    // Plugin and systemd checkers: one ending while the monitor runs is the
    // monitor's failure too.
    let mut checkers = JoinSet::new();
    match source {
        Some(Source::Plugin(p)) => {
            checkers.spawn(run_plugins(
                spec.clone(),
                p.clone(),
                plugin_tx.clone(),
                counters.clone(),
                ctx.command_root.clone(),
                stop.clone(),
            ));
        }
        Some(Source::Systemd(s)) => {
            checkers.spawn(run_service_checks(
                spec.clone(),
                s.clone(),
                plugin_tx,
                ctx.system_bus.clone(),
                ctx.reporter.clone(),
                counters.clone(),
                stop.clone(),
            ));
        }
        Some(Source::Kmsg(_) | Source::File(_) | Source::Journald(_)) | None => {}
    }
    // Set while the line source could not be opened: its conditions are
    // Unknown (blind is not "all clear"), with this message.
    let mut blind: Option<String> = None;
    if let Some((path, Err(source))) = started {
        let e = MonitorError::Source { path, source };
        tracing::error!(monitor = %spec.name, error = %e, "monitor source unavailable");
        blind = Some(format!(
            "Monitor {} cannot read its source: {e}; the condition is unknown until it can.",
            spec.name
        ));
        ctx.reporter.event(
            EventKind::Warning,
            "MonitorSourceUnavailable",
            "StartMonitor",
            format!("Monitor {} cannot read its source: {e}. Mount it into the pod (chart values host.kmsg / host.journal) or fix the path.", spec.name),
        );
    }
    let voice = Voice {
        defaults: spec
            .conditions
            .iter()
            .map(|c| (c.type_.clone(), c.reason.clone()))
            .collect(),
        source: spec.event_source.clone(),
    };
    let wall = clock.clock;
    let save_as = |state: &mut MonitorState, engine: &Engine, durable: bool| {
        state.conditions = engine.state().clone();
        state.counts = engine.counts_state();
        state.saved_at = Some((wall.now(), wall.monotonic().as_millis() as u64));
        save_state_as(
            &ctx.state_writes,
            &ctx.state_dir,
            &spec.name,
            state,
            durable,
        )
    };
    let save = |state: &mut MonitorState, engine: &Engine| save_as(state, engine, false);
    handle.queued();
    if new_boot {
        let reset = {
            let now = clock.now(&mut engine);
            engine.on_new_boot(now)
        };
        apply(&reset, &mut engine, &ctx, &handle, &voice, blind.as_deref()).await;
    }
    let initial = {
        let now = clock.now(&mut engine);
        engine.current(now)
    };
    apply(
        &initial,
        &mut engine,
        &ctx,
        &handle,
        &voice,
        blind.as_deref(),
    )
    .await;
    // A save that fails leaves the state dirty: the tick tries again each
    // second, so what changed while the directory was full or read-only is
    // written once it can be, with no new line to prompt it.
    let mut dirty = !save(&mut state, &engine);
    // Lines that matched nothing moved only the position: saved within
    // CURSOR_SAVE (a crash reads them again, and they match nothing again).
    let mut cursor_moved = false;
    handle.updated();
    let mut last_tick = tokio::time::Instant::now();
    let mut last_save = tokio::time::Instant::now();
    let mut last_taint_retry = tokio::time::Instant::now();
    let mut last_dropped_said: Option<tokio::time::Instant> = None;
    // What the reader last said about a refused file (after the start).
    let mut refused_seen: Option<String> = None;
    // Lines lost so far (a full queue, records the kernel overwrote), said
    // in an Event when it grows.
    // (The counters are this run's: what was lost before the first tick,
    // records overwritten while the agent was down among them, is said too.)
    let mut dropped_seen = 0;
    let ended = loop {
        // The loop looks again with no line or check to prompt it only
        // while something waits on time: a timed condition, a save, a
        // taint retry, lost lines not said yet. An idle monitor sleeps
        // until its source says something.
        let wake = {
            let mut at: Option<tokio::time::Instant> = None;
            let mut by = |t: tokio::time::Instant| at = Some(at.map_or(t, |a| a.min(t)));
            if engine.has_timed_work() {
                by(last_tick + EVERY_SECOND);
            }
            if let Some(t) = save_due(dirty, cursor_moved, last_save) {
                by(t);
            }
            if engine.has_taint_retries() {
                by(last_taint_retry + TAINT_RETRY);
            }
            if counters.dropped.load(std::sync::atomic::Ordering::Relaxed) > dropped_seen {
                by(lost_said_due(last_dropped_said, last_tick));
            }
            at
        };
        tokio::select! {
            _ = stop.cancelled() => break None,
            batch = rx.recv(), if lines_open => {
                let Some(batch) = batch else {
                    let why = counters
                        .end_reason()
                        .unwrap_or_else(|| "its reader stopped".to_string());
                    break Some(format!("its log source ended: {why}"));
                };
                handle.queued();
                // One clock reading per batch (its lines arrived together),
                // read again after anything that waited on the API.
                let mut now = clock.now(&mut engine);
                for i in 0..batch.len() {
                    let actions = engine.on_line(batch.line(i), now);
                    if !actions.is_empty() {
                        apply(&actions, &mut engine, &ctx, &handle, &voice, blind.as_deref()).await;
                        // Whose taint it is goes to disk at once: a restart
                        // that replayed the line would find the taint there
                        // and take it for someone else's. The rest (Events,
                        // condition changes the replay recomputes) waits for
                        // the once-a-second save: a rule matching every line
                        // of a flood is not an fsync per line.
                        if actions.iter().any(|a| matches!(a, Action::Taint { .. })) {
                            state.cursor = batch.cursor(i).clone();
                            dirty = !save_as(&mut state, &engine, true);
                            last_save = tokio::time::Instant::now();
                        }
                        now = clock.now(&mut engine);
                    }
                }
                // A source's first position (a journal read from its end
                // had none) is saved as a match is: until then a restart
                // would start at the end again, past what was logged
                // meanwhile.
                let first = state.cursor == Default::default();
                if let Some(cursor) = batch.into_last_cursor() {
                    state.cursor = cursor;
                }
                if engine.take_matched() || first {
                    dirty = true;
                } else {
                    cursor_moved = true;
                }
                handle.updated();
            }
            Some((rule, status, output)) = plugin_rx.recv() => {
                handle.queued();
                let actions = { let now = clock.now(&mut engine); engine.on_plugin(rule, status, &output, now) };
                if !actions.is_empty() {
                    apply(&actions, &mut engine, &ctx, &handle, &voice, blind.as_deref()).await;
                    let taint = actions.iter().any(|a| matches!(a, Action::Taint { .. }));
                    dirty = !save_as(&mut state, &engine, taint);
                }
                handle.updated();
            }
            Some(done) = checkers.join_next(), if !checkers.is_empty() => {
                if stop.is_cancelled() {
                    break None;
                }
                break Some(match done {
                    Err(e) if e.is_panic() => "its checker panicked".to_string(),
                    _ => "its checker ended".to_string(),
                });
            }
            _ = until_due(wake, &counters.news) => {
                let dropped_now = counters.dropped.load(std::sync::atomic::Ordering::Relaxed);
                // Said at most once a second, however fast lines are lost.
                if dropped_now > dropped_seen && is_due(lost_said_due(last_dropped_said, last_tick)) {
                    last_dropped_said = Some(tokio::time::Instant::now());
                    let message = format!(
                        "Monitor {} lost {} line(s) ({dropped_now} since it started): its queue was full or the kernel overwrote records before they were read, so problems in them were not seen.",
                        spec.name,
                        dropped_now - dropped_seen
                    );
                    tracing::warn!(monitor = %spec.name, lost = dropped_now - dropped_seen, "monitor lines lost");
                    ctx.reporter.event(EventKind::Warning, "MonitorLinesDropped", "ReadSource", message);
                    dropped_seen = dropped_now;
                }
                let refused_now = counters.refused_reason();
                if refused_now != refused_seen {
                    // The file now at the path is refused by the node's read
                    // roots, or allowed again: blind (Unknown) or not.
                    handle.queued();
                    blind = match &refused_now {
                        Some(why) => {
                            tracing::error!(monitor = %spec.name, error = %why, "monitor source refused");
                            ctx.reporter.event(
                                EventKind::Warning,
                                "MonitorSourceUnavailable",
                                "ReadSource",
                                format!("Monitor {} cannot read its source: {why}.", spec.name),
                            );
                            Some(format!(
                                "Monitor {} cannot read its source: {why}; the condition is unknown until it can.",
                                spec.name
                            ))
                        }
                        None => {
                            tracing::info!(monitor = %spec.name, "monitor source readable again");
                            None
                        }
                    };
                    refused_seen = refused_now;
                    let current = { let now = clock.now(&mut engine); engine.current(now) };
                    apply(&current, &mut engine, &ctx, &handle, &voice, blind.as_deref()).await;
                    handle.updated();
                }
                last_tick = tokio::time::Instant::now();
                let mut actions = { let now = clock.now(&mut engine); engine.on_tick(now) };
                if clock.take_shifted() {
                    dirty = true;
                }
                if is_due(last_taint_retry + TAINT_RETRY) {
                    last_taint_retry = tokio::time::Instant::now();
                    actions.extend(engine.taint_retries());
                }
                if !actions.is_empty() {
                    handle.queued();
                    apply(&actions, &mut engine, &ctx, &handle, &voice, blind.as_deref()).await;
                    handle.updated();
                    dirty = true;
                    // A taint added (a retry after an API outage): whose it
                    // is goes to disk at once, synced.
                    if actions.iter().any(|a| matches!(a, Action::Taint { .. })) {
                        dirty = !save_as(&mut state, &engine, true);
                        last_save = tokio::time::Instant::now();
                    }
                }
                // The state is saved at most once a second under load, a
                // position alone once in CURSOR_SAVE.
                if save_due(dirty, cursor_moved, last_save).is_some_and(is_due) {
                    dirty = !save(&mut state, &engine);
                    cursor_moved = false;
                    last_save = tokio::time::Instant::now();
                }
            }
        }
    };
    source_stop.stop();
    // The engine's times follow any clock step before they are saved with
    // the wall time of the save (an idle loop may not have read the clock
    // since the step).
    clock.now(&mut engine);
    save(&mut state, &engine);
    match ended {
        None => Ok(()),
        Some(why) => Err(why),
    }
}
