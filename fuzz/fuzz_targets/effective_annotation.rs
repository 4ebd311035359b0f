//! The Node's effective-policies annotation, which anyone allowed to
//! patch the Node can write, as `nodeguard status` reads it.
#![no_main]
use libfuzzer_sys::fuzz_target;
use nodeguard::node_view::parse_effective;

fuzz_target!(|data: &[u8]| {
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = parse_effective(s);
    }
});
