//! Plugin rules: their commands on the monitor's interval, each verdict
//! reported.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::engine::PluginStatus;
use super::sources::SourceCounters;
use crate::command::{CommandRoot, Ran, run_command};
use crate::policy::monitors::MonitorSpec;

/// How much of a command's output is kept before `maxOutputLength` cuts it
/// (in bytes, as for exec probes).
const OUTPUT_LIMIT: usize = 1024;

/// Runs the plugin rules' commands on the monitor's interval, at most
/// `concurrency` at once, and reports each verdict.
pub(super) async fn run_plugins(
    spec: MonitorSpec,
    source: crate::policy::monitors::PluginSource,
    tx: mpsc::Sender<(usize, PluginStatus, String)>,
    counters: Arc<SourceCounters>,
    root: CommandRoot,
    stop: CancellationToken,
) {
    let limit = Arc::new(tokio::sync::Semaphore::new(
        source.concurrency.max(1) as usize
    ));
    let timeout = Duration::from_secs(source.timeout_seconds.max(1).into());
    let max_output = source.max_output_length.max(1) as usize;
    let npd = source.npd_results;
    // A rule whose last run has not ended yet is not started again (as
    // node-problem-detector waits for a round's runs): a late result could
    // otherwise land after a newer one.
    let running: Arc<[std::sync::atomic::AtomicBool]> = spec
        .rules
        .iter()
        .map(|_| std::sync::atomic::AtomicBool::new(false))
        .collect();
    let mut interval =
        tokio::time::interval(Duration::from_secs(source.interval_seconds.max(1).into()));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = interval.tick() => {}
        }
        for (i, rule) in spec.rules.iter().enumerate() {
            if rule.command.is_empty() || running[i].swap(true, Ordering::AcqRel) {
                continue;
            }
            let ended = Ended(running.clone(), i);
            let permit = limit.clone().acquire_owned().await.expect("never closed");
            let (tx, command, counters) = (tx.clone(), rule.command.clone(), counters.clone());
            // NPD's per-rule timeout, else the source's.
            let timeout = rule
                .timeout_seconds
                .map_or(timeout, |s| Duration::from_secs(s.max(1).into()));
            let root = root.clone();
            tokio::spawn(async move {
                let _permit = permit;
                let _ended = ended;
                counters.lines.fetch_add(1, Ordering::Relaxed);
                let ran = run_command(&command, timeout, &root).await;
                let status = plugin_status(&ran, npd);
                if let Err(e) = &ran {
                    counters.malformed.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(command = ?command, error = %e, "plugin did not run");
                }
                let output = if npd {
                    npd_output(&command[0], ran, max_output)
                } else {
                    let output = match ran {
                        Ok(Ran::Exited { output, .. }) => output,
                        Ok(Ran::TimedOut { .. }) => {
                            format!("timed out after {}s", timeout.as_secs())
                        }
                        Err(e) => e.to_string(),
                    };
                    let output = crate::report::clip(&output, OUTPUT_LIMIT);
                    output.chars().take(max_output).collect()
                };
                let _ = tx.send((i, status, output)).await;
            });
        }
    }
}

/// Marks rule `.1`'s run ended when dropped (however the task ends).
struct Ended(Arc<[std::sync::atomic::AtomicBool]>, usize);

impl Drop for Ended {
    fn drop(&mut self) {
        self.0[self.1].store(false, Ordering::Release);
    }
}

/// A check's result: exit code 0 OK, 1 a problem, anything else (another
/// code, a signal, a timeout, not run) Unknown. Monitors imported from
/// node-problem-detector (`npd`) judge a check that timed out as NPD does,
/// by the check's own exit code: one that had exited while what it started
/// kept its output open (killed with its group at the timeout) is judged
/// by its code; one the kill ended is Unknown.
fn plugin_status(ran: &Result<Ran, crate::command::CommandError>, npd: bool) -> PluginStatus {
    let code = match ran {
        Ok(Ran::Exited { code, .. }) => *code,
        Ok(Ran::TimedOut { code, .. }) if npd => *code,
        _ => None,
    };
    match code {
        Some(0) => PluginStatus::Ok,
        Some(1) => PluginStatus::Problem,
        _ => PluginStatus::Unknown,
    }
}

/// A check's output as node-problem-detector's custom plugin monitor keeps
/// it: stdout alone; on a timeout "Timeout when running plugin …" (NPD's
/// words, with the state Go prints for the check's end, and what it wrote
/// until then); "Error in starting plugin…" when it could not start; cut at
/// `max` bytes (on a character boundary).
fn npd_output(program: &str, ran: Result<Ran, crate::command::CommandError>, max: usize) -> String {
    use crate::monitor::engine::go_quote;
    let output = match ran {
        Ok(Ran::Exited { stdout, .. }) => stdout,
        Ok(Ran::TimedOut { code, stdout }) => format!(
            "Timeout when running plugin {}: state - {}. output - {}",
            go_quote(program),
            code.map_or("signal: killed".to_string(), |c| format!("exit status {c}")),
            go_quote(&stdout)
        ),
        Err(crate::command::CommandError::Wait { .. }) => {
            "Error in waiting for plugin. Please check the error log".to_string()
        }
        Err(_) => "Error in starting plugin. Please check the error log".to_string(),
    };
    let mut end = output.len().min(max);
    while !output.is_char_boundary(end) {
        end -= 1;
    }
    output[..end].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timed_out_check_is_judged_by_its_own_code_only_when_imported_from_npd() {
        let timed_out = |code| {
            Ok(Ran::TimedOut {
                code,
                stdout: String::new(),
            })
        };
        for npd in [false, true] {
            assert_eq!(plugin_status(&timed_out(None), npd), PluginStatus::Unknown);
        }
        assert_eq!(plugin_status(&timed_out(Some(0)), true), PluginStatus::Ok);
        assert_eq!(
            plugin_status(&timed_out(Some(1)), true),
            PluginStatus::Problem
        );
        assert_eq!(
            plugin_status(&timed_out(Some(3)), true),
            PluginStatus::Unknown
        );
        assert_eq!(
            plugin_status(&timed_out(Some(0)), false),
            PluginStatus::Unknown
        );
        let exited = |code| {
            Ok(Ran::Exited {
                code,
                output: String::new(),
                stdout: String::new(),
            })
        };
        for npd in [false, true] {
            assert_eq!(plugin_status(&exited(Some(0)), npd), PluginStatus::Ok);
            assert_eq!(plugin_status(&exited(Some(1)), npd), PluginStatus::Problem);
            assert_eq!(plugin_status(&exited(Some(2)), npd), PluginStatus::Unknown);
            assert_eq!(plugin_status(&exited(None), npd), PluginStatus::Unknown);
        }
    }

    #[test]
    fn npd_output_is_stdout_cut_at_bytes_and_npds_timeout_words() {
        let exited = |stdout: &str| {
            Ok(Ran::Exited {
                code: Some(1),
                output: "stderr".into(),
                stdout: stdout.into(),
            })
        };
        assert_eq!(npd_output("/p", exited(""), 80), "");
        assert_eq!(npd_output("/p", exited("broken"), 80), "broken");
        assert_eq!(npd_output("/p", exited("abcdef"), 3), "abc");
        // "é" is two bytes: never cut inside it.
        assert_eq!(npd_output("/p", exited("aé"), 2), "a");
        let killed = |stdout: &str| {
            Ok(Ran::TimedOut {
                code: None,
                stdout: stdout.into(),
            })
        };
        let full = "Timeout when running plugin \"/usr/local/check.sh\": state - signal: killed. output - \"\"";
        assert_eq!(
            npd_output("/usr/local/check.sh", killed(""), 80),
            full[..80]
        );
        assert_eq!(
            npd_output("/p", killed("waiting"), 200),
            "Timeout when running plugin \"/p\": state - signal: killed. output - \"waiting\""
        );
        // Exited, but what it started held its output past the timeout.
        let outlived = Ok(Ran::TimedOut {
            code: Some(1),
            stdout: "broke".into(),
        });
        assert_eq!(
            npd_output("/p", outlived, 200),
            "Timeout when running plugin \"/p\": state - exit status 1. output - \"broke\""
        );
        assert_eq!(
            npd_output("/p", Err(crate::command::CommandError::Empty), 80),
            "Error in starting plugin. Please check the error log"
        );
    }
}
