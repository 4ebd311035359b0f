//! Log text of any format the agent reads (syslog, journal JSON, kmsg
//! records, dmesg, plain) through the default policy's monitors: line
//! parsing, time stamps, the matching engine and the rendered report. The
//! policy is compiled once; each input replays through a fresh clone.
#![no_main]
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use nodeguard::monitor::replay::{Compiled, render, replay_compiled};
use nodeguard::policy::defaults::default_spec;
use nodeguard::policy::monitors::MonitorSpec;

fn monitors() -> &'static [MonitorSpec] {
    static MONITORS: OnceLock<Vec<MonitorSpec>> = OnceLock::new();
    MONITORS.get_or_init(|| default_spec().monitors)
}

fn compiled() -> &'static Compiled<'static> {
    static COMPILED: OnceLock<Compiled<'static>> = OnceLock::new();
    COMPILED.get_or_init(|| Compiled::new(monitors()))
}

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let lines: Vec<String> = text.lines().map(str::to_string).collect();
    let n = lines.len();
    let r = replay_compiled(compiled().clone(), lines, 2026);
    assert!(r.lines <= n);
    let _ = render(&r);
});
