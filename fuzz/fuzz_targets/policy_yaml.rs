//! Policy YAML as `nodeguard check` and the agent take it: parsing, the
//! schema, validation, the node's trust, selection with the last good
//! version, and compiling the selected monitors.
#![no_main]
use std::collections::BTreeMap;

use libfuzzer_sys::fuzz_target;
use nodeguard::monitor::engine::Engine;
use nodeguard::policy::{NodeTrust, Validations, load_policies, select_with_last_good};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(docs) = load_policies("fuzz.yaml", text) else {
        return;
    };
    let policies: Vec<_> = docs.into_iter().filter_map(|d| d.policy).collect();
    let trust = NodeTrust::default();
    for p in &policies {
        let _ = trust.refusals(p);
    }
    let labels = BTreeMap::from([
        ("kubernetes.io/hostname".to_string(), "node-a".to_string()),
        ("node-role.kubernetes.io/worker".to_string(), String::new()),
    ]);
    let mut last_good = BTreeMap::new();
    let mut validations = Validations::default();
    let selection = select_with_last_good(
        policies.iter(),
        &labels,
        &trust,
        &mut last_good,
        &mut validations,
    );
    // Validated once: the same policies selected from the cache select the same.
    let again = select_with_last_good(
        policies.iter(),
        &labels,
        &trust,
        &mut BTreeMap::new(),
        &mut validations,
    );
    assert_eq!(selection, again);
    for m in &selection.monitors {
        let _ = Engine::new(m, "spec.monitors");
    }
});
