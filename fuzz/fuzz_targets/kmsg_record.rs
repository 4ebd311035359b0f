//! One /dev/kmsg record, as the kernel hands it (bytes read lossily).
#![no_main]
use libfuzzer_sys::fuzz_target;
use nodeguard::monitor::kmsg;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Some(r) = kmsg::parse(&text) {
        assert!(r.level() <= 7);
    }
});
