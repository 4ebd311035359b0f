//! A node-problem-detector config through `import-npd`: the import, name
//! deduplication across configs, validation of the result, and compiling
//! its monitors (Go patterns translated to Rust's dialect).
#![no_main]
use libfuzzer_sys::fuzz_target;
use nodeguard::monitor::engine::Engine;
use nodeguard::policy::defaults::default_policy;
use nodeguard::policy::npd::{combine, import};
use nodeguard::policy::validate;

fuzz_target!(|data: &[u8]| {
    let Ok(config) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let imported = import("fuzz.json", &config);
    let again = import("fuzz-2.json", &config);
    let (monitors, _notes) = combine(vec![
        ("fuzz.json".to_string(), imported.monitors),
        ("fuzz-2.json".to_string(), again.monitors),
    ]);
    for m in &monitors {
        let _ = Engine::new(m, "spec.monitors");
    }
    let mut policy = default_policy();
    policy.spec.monitors = monitors;
    let _ = validate(&policy);
});
