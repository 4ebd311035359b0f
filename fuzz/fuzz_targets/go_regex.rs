//! NPD's Go (RE2) patterns translated to Rust's dialect; what the
//! translation accepts is compiled as the agent compiles it.
#![no_main]
use libfuzzer_sys::fuzz_target;
use nodeguard::policy::goregex::translate;

fuzz_target!(|data: &[u8]| {
    let Ok(go) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(rust) = translate(go) {
        let _ = regex::Regex::new(&rust);
    }
});
