//! What a policy change leaves behind, removed: the taints and state of
//! conditions and monitors the policy no longer has.

use std::collections::HashMap;
use std::path::PathBuf;

use super::engine;
use super::engine::OwnedTaint;
use super::sources::Cursor;
use super::state::{load_state, save_state, saved_states, state_path};
use super::{MonitorContext, TaintPort};
use crate::policy::monitors::MonitorSpec;

/// Removes a taint nodeguard added for a condition the policy no longer
/// has (or no longer taints), saying so either way.
pub(super) async fn remove_stale_taint<T: TaintPort>(
    ctx: &MonitorContext<T>,
    monitor: &str,
    t: &OwnedTaint,
) -> bool {
    match ctx.taints.remove(&t.key, &t.effect).await {
        Ok(()) => {
            tracing::info!(monitor, taint = %t.key, effect = %t.effect, "removed the taint nodeguard added for a condition the policy no longer taints (edited while the agent was not running)");
            true
        }
        Err(e) => {
            tracing::warn!(monitor, taint = %t.key, effect = %t.effect, error = %e, "cannot remove the taint nodeguard added for a condition the policy no longer taints; remove it with kubectl taint");
            false
        }
    }
}

/// The first time the policy is known: state files of monitors that are
/// no longer in it (removed while the agent was not running, or while it
/// was removing them). Their taints go, then the file.
pub(super) async fn sweep_orphans<T: TaintPort>(
    ctx: &MonitorContext<T>,
    desired: &HashMap<String, MonitorSpec>,
) {
    let wanted: std::collections::HashSet<PathBuf> = desired
        .keys()
        .map(|n| state_path(&ctx.state_dir, n))
        .collect();
    for (path, name, state) in saved_states(&ctx.state_dir) {
        if wanted.contains(&path) {
            continue;
        }
        let Some(state) = state else {
            tracing::warn!(path = %path.display(), "unreadable state of a monitor no longer in the policy; removed");
            ctx.state_writes.remove(&path);
            continue;
        };
        tracing::info!(monitor = %name, "state of a monitor no longer in the policy: removing its taints and state");
        let mut failed = false;
        for s in state.conditions.values().filter(|s| s.taint_added) {
            match &s.taint {
                Some(t) => failed |= !remove_stale_taint(ctx, &name, t).await,
                None => {
                    tracing::warn!(monitor = %name, "a taint this monitor added is not recorded in its state (saved by an older nodeguard); remove it with kubectl taint if it is still there")
                }
            }
        }
        // Kept when a removal failed: the next start tries again.
        if !failed {
            ctx.state_writes.remove(&path);
        }
    }
}

/// After `old`'s task has finished: removes what `new` (`None`: the monitor
/// is gone) no longer has, per the state the task left.
pub(super) async fn undo<T: TaintPort>(
    ctx: &MonitorContext<T>,
    old: &MonitorSpec,
    new: Option<&MonitorSpec>,
) {
    let mut state = load_state(&ctx.state_dir, &old.name)
        .map(|(s, _)| s)
        .unwrap_or_default();
    let plan = engine::cleanup(old, new, &state.conditions);
    let mut kept = false;
    for (type_, key, effect) in &plan.taints {
        match ctx.taints.remove(key, effect).await {
            Ok(()) => {
                if let Some(s) = state.conditions.get_mut(type_) {
                    s.taint_added = false;
                    s.taint = None;
                }
            }
            Err(e) => {
                kept = true;
                if let Some(s) = state.conditions.get_mut(type_) {
                    s.taint = Some(OwnedTaint {
                        key: key.clone(),
                        effect: effect.clone(),
                    });
                }
                tracing::warn!(monitor = %old.name, taint = %key, error = %e, "cannot remove the monitor's taint; the next start of the agent tries again")
            }
        }
    }
    if new.is_none() {
        // After its taints: an agent killed in between finds the file and
        // removes them on its next start. Kept (with what is still
        // owned) when a removal failed, for the same reason.
        let path = state_path(&ctx.state_dir, &old.name);
        if kept {
            state.conditions.retain(|_, s| s.taint_added);
            save_state(&ctx.state_writes, &ctx.state_dir, &old.name, &state);
        } else {
            ctx.state_writes.remove(&path);
        }
    }
    for type_ in &plan.conditions {
        ctx.reporter.remove(type_);
        ctx.metrics.forget(type_);
        state.conditions.remove(type_);
    }
    if new.is_some() {
        if plan.reset_cursor {
            state.cursor = Cursor::default();
        }
        save_state(&ctx.state_writes, &ctx.state_dir, &old.name, &state);
    }
}
