//! /proc/self/stat, read for the process metrics.
#![no_main]
use libfuzzer_sys::fuzz_target;
use nodeguard::server::metrics::parse_proc_stat;

fuzz_target!(|data: &[u8]| {
    let _ = parse_proc_stat(&String::from_utf8_lossy(data));
});
