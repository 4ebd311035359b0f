//! The state files under the state directory, as a restart reads them
//! (a disk error or a hand edit can leave anything there): a monitor's
//! saved conditions and counts restored into the default policy's engines
//! and driven on, and the shutdown record judged at start-up.
#![no_main]
use jiff::Timestamp;
use libfuzzer_sys::fuzz_target;
use nodeguard::monitor::MonitorState;
use nodeguard::monitor::engine::Engine;
use nodeguard::policy::defaults::default_spec;
use nodeguard::shutdown::state::{ShutdownRecord, on_start};

fuzz_target!(|data: &[u8]| {
    if let Ok(state) = serde_json::from_slice::<MonitorState>(data) {
        let now = Timestamp::from_second(1_800_000_000).unwrap();
        for m in &default_spec().monitors {
            let Ok(mut e) = Engine::new(m, "spec.monitors") else {
                continue;
            };
            e.restore(state.conditions.clone());
            e.restore_counts(state.counts.clone());
            let _ = e.current(now);
            let _ = e.on_tick(now);
            let _ = e.on_line("Out of memory: Killed process 42 (java)", now);
            let _ = e.on_tick(now + jiff::SignedDuration::from_secs(3600));
            let _ = e.counts_state();
            let _ = e.on_new_boot(now);
        }
    }
    if let Ok(r) = serde_json::from_slice::<ShutdownRecord>(data) {
        for preparing in [None, Some(true), Some(false)] {
            let _ = on_start(Some(&r), &r.boot_id, preparing);
            let _ = on_start(Some(&r), "another-boot", preparing);
        }
    }
});
