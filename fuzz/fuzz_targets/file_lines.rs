//! A followed file read line by line with the 64 KiB cap. The input is
//! expanded (0xFF k: k KiB of 'x', up to 256 KiB in all), so short inputs
//! make lines far past the cap; the reader's buffer size comes from the
//! first byte. The lines read
//! must be the stream's lines cut at the cap, every byte consumed once.
#![no_main]
use std::io::BufReader;

use libfuzzer_sys::fuzz_target;
use nodeguard::monitor::sources::lines::{MAX_LINE, read_line_capped};

fuzz_target!(|data: &[u8]| {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let mut stream = Vec::new();
    let mut bytes = rest.iter();
    while let Some(&b) = bytes.next() {
        match (b, bytes.clone().next()) {
            (0xFF, Some(&k)) if stream.len() < 256 << 10 => {
                bytes.next();
                stream.resize(stream.len() + usize::from(k) * 1024, b'x');
            }
            _ => stream.push(b),
        }
    }
    let mut reader = BufReader::with_capacity(1 + usize::from(first) * 37, &stream[..]);
    let mut expected = stream.split(|&b| b == b'\n').peekable();
    let (mut line, mut truncated, mut consumed) = (Vec::new(), false, 0);
    loop {
        let (n, complete) = read_line_capped(&mut reader, &mut line, &mut truncated).unwrap();
        consumed += n;
        let want = expected.next().expect("no more lines than the stream has");
        assert_eq!(line, &want[..want.len().min(MAX_LINE)]);
        assert_eq!(truncated, want.len() > MAX_LINE);
        if !complete {
            assert!(expected.peek().is_none());
            break;
        }
        line.clear();
        truncated = false;
    }
    assert_eq!(consumed, stream.len());
});
