//! Which of the process's pages can be dropped: the ranges the loader
//! mapped read-only from the executable (its program headers, less the
//! RELRO segment the loader wrote), where `/proc/self/smaps` shows them
//! read-only, private and with no page of their own (`Anonymous` and `Swap`
//! both 0 kB). Where the executable is loaded comes from the mapping that
//! holds its code, not from the loader: for a static PIE without a
//! `PT_PHDR` header (the shipped musl binary) musl's `dl_iterate_phdr`
//! reports a load bias of 0. Pure: the headers and the text in, the ranges
//! out.

use std::ops::Range;

/// A mapped file, as `/proc/self/smaps` names it: the device's major and
/// minor numbers and the inode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FileId {
    major: u32,
    minor: u32,
    inode: u64,
}

/// One of the executable's program headers, as far as it matters here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Segment {
    /// `PT_LOAD`: `filesz` bytes of the file from `offset`, mapped at
    /// `vaddr`; `writable` with `PF_W`.
    Load {
        offset: usize,
        vaddr: usize,
        filesz: usize,
        writable: bool,
    },
    /// `PT_GNU_RELRO`: written by the loader's relocations, then made
    /// read-only: its pages are not the file's.
    Relro { vaddr: usize, memsz: usize },
}

/// The executable's load bias: `code` (an address in its own code) lies in
/// the smaps mapping that maps the file from some offset, which places the
/// `PT_LOAD` segment holding that offset. `None` when no mapping holds
/// `code` or no segment holds its offset in the file.
pub fn load_bias(smaps: &str, code: usize, segments: &[Segment]) -> Option<usize> {
    let m = parse(smaps)
        .into_iter()
        .find(|m| (m.start..m.end).contains(&code))?;
    let file_offset = m.offset.checked_add(code - m.start)?;
    segments.iter().find_map(|s| match *s {
        Segment::Load {
            offset,
            vaddr,
            filesz,
            ..
        } if (offset..offset.saturating_add(filesz)).contains(&file_offset) => {
            code.checked_sub(vaddr.checked_add(file_offset - offset)?)
        }
        _ => None,
    })
}

/// The address ranges of the executable's read-only `PT_LOAD` segments
/// loaded at `bias`, in whole pages of `page` bytes inside the file-backed
/// part of each segment, without any page that touches the RELRO segment.
/// A segment whose addresses would overflow is left out.
pub fn read_only_ranges(bias: usize, segments: &[Segment], page: usize) -> Vec<Range<usize>> {
    let down = |a: usize| a / page * page;
    let span = |vaddr: usize, len: usize| {
        let start = bias.checked_add(vaddr)?;
        Some((start, start.checked_add(len)?))
    };
    let relro: Vec<Range<usize>> = segments
        .iter()
        .filter_map(|s| match *s {
            Segment::Relro { vaddr, memsz } => Some(match span(vaddr, memsz) {
                Some((start, end)) => {
                    down(start)..end.checked_next_multiple_of(page).unwrap_or(usize::MAX)
                }
                // Bounds that overflow: every address is taken for RELRO's.
                None => 0..usize::MAX,
            }),
            _ => None,
        })
        .collect();
    let mut out = Vec::new();
    for s in segments {
        let Segment::Load {
            vaddr,
            filesz,
            writable: false,
            ..
        } = *s
        else {
            continue;
        };
        let Some((start, end)) = span(vaddr, filesz) else {
            continue;
        };
        let Some(start) = start.checked_next_multiple_of(page) else {
            continue;
        };
        let mut pieces: Vec<Range<usize>> = std::iter::once(start..down(end)).collect();
        for r in &relro {
            pieces = pieces
                .into_iter()
                .flat_map(|p| [p.start..p.end.min(r.start), p.start.max(r.end)..p.end])
                .filter(|p| p.start < p.end)
                .collect();
        }
        out.extend(pieces.into_iter().filter(|p| p.start < p.end));
    }
    out
}

/// The parts of the executable's clean mappings in `smaps` that lie in
/// `allowed` ([`read_only_ranges`]), for the file mapped at `code` (an
/// address in the executable's own code).
pub fn releasable(smaps: &str, code: usize, allowed: &[Range<usize>]) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    for m in clean_mappings(smaps, code) {
        for a in allowed {
            let (start, end) = (m.start.max(a.start), (m.start + m.len).min(a.end));
            if start < end {
                out.push(start..end);
            }
        }
    }
    out
}

/// One mapping whose resident pages can be dropped and read back from the
/// page cache when touched again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Clean {
    pub start: usize,
    pub len: usize,
    /// `Rss` of the mapping, in KiB.
    pub resident_kib: u64,
}

/// The clean mappings in `smaps`, with pages resident, of the file mapped at
/// `code` (an address in the executable's own code).
///
/// The file is found by the address rather than by `stat` on
/// `/proc/self/exe`: in a container on overlayfs, smaps names the file of
/// the layer below, whose device and inode `stat` does not show.
/// A mapping qualifies only when all of these hold, so that dropping its
/// pages loses nothing: it maps that file; it is readable, not writable and
/// private (a shared mapping's pages are another process's too); and it
/// holds no page of its own, resident (`Anonymous`) or swapped out
/// (`Swap`), which a private file mapping has once a page of it was written
/// (the loader's relocations in the RELRO segment before it became
/// read-only, a debugger's breakpoint). A mapping whose `Anonymous` or
/// `Swap` line is missing or unreadable does not qualify.
fn clean_mappings(smaps: &str, code: usize) -> Vec<Clean> {
    let mappings = parse(smaps);
    let Some(file) = mappings
        .iter()
        .find(|m| (m.start..m.end).contains(&code))
        .and_then(|m| m.file)
    else {
        return Vec::new();
    };
    mappings.into_iter().filter_map(|m| m.clean(file)).collect()
}

fn parse(smaps: &str) -> Vec<Mapping> {
    let mut out = Vec::new();
    let mut current: Option<Mapping> = None;
    for line in smaps.lines() {
        if is_header(line) {
            out.extend(current.take());
            // A header that does not parse starts no mapping, and its
            // fields complete none.
            current = Mapping::header(line);
        } else if let Some(m) = current.as_mut() {
            m.field(line);
        }
    }
    out.extend(current);
    out
}

/// A mapping's header: its first word is a range (`start-end`); a field's
/// is a name and a colon, never with a hyphen.
fn is_header(line: &str) -> bool {
    line.split_ascii_whitespace()
        .next()
        .is_some_and(|w| w.contains('-') && !w.ends_with(':'))
}

struct Mapping {
    start: usize,
    end: usize,
    /// Where in the file the mapping begins.
    offset: usize,
    readable: bool,
    writable: bool,
    private: bool,
    file: Option<FileId>,
    rss_kib: Option<u64>,
    anonymous_kib: Option<u64>,
    swap_kib: Option<u64>,
}

impl Mapping {
    /// `start-end perms offset major:minor inode [path]`; `None` when it
    /// does not parse.
    fn header(line: &str) -> Option<Mapping> {
        let mut fields = line.split_ascii_whitespace();
        let (start, end) = fields.next()?.split_once('-')?;
        let start = usize::from_str_radix(start, 16).ok()?;
        let end = usize::from_str_radix(end, 16).ok()?;
        let perms = fields.next()?.as_bytes();
        let offset = usize::from_str_radix(fields.next()?, 16).ok()?;
        let (major, minor) = fields.next()?.split_once(':')?;
        let major = u32::from_str_radix(major, 16).ok()?;
        let minor = u32::from_str_radix(minor, 16).ok()?;
        let inode: u64 = fields.next()?.parse().ok()?;
        if perms.len() != 4 || end <= start {
            return None;
        }
        Some(Mapping {
            start,
            end,
            offset,
            readable: perms[0] == b'r',
            writable: perms[1] != b'-',
            private: perms[3] == b'p',
            file: (inode != 0).then_some(FileId {
                major,
                minor,
                inode,
            }),
            rss_kib: None,
            anonymous_kib: None,
            swap_kib: None,
        })
    }

    fn field(&mut self, line: &str) {
        let Some((key, value)) = line.split_once(':') else {
            return;
        };
        let kib = || {
            value
                .trim()
                .strip_suffix("kB")
                .and_then(|v| v.trim().parse::<u64>().ok())
        };
        match key {
            "Rss" => self.rss_kib = kib(),
            "Anonymous" => self.anonymous_kib = kib(),
            "Swap" => self.swap_kib = kib(),
            _ => {}
        }
    }

    fn clean(&self, file: FileId) -> Option<Clean> {
        let resident_kib = self.rss_kib.filter(|&r| r > 0)?;
        (self.file == Some(file)
            && self.readable
            && !self.writable
            && self.private
            && self.anonymous_kib == Some(0)
            && self.swap_kib == Some(0))
        .then_some(Clean {
            start: self.start,
            len: self.end - self.start,
            resident_kib,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An address in the executable's text, which [`text`] maps.
    const CODE: usize = 0x600000;

    /// A mapping's header and fields as the kernel prints them.
    fn mapping(range: &str, perms: &str, dev: &str, inode: u64, rss: u64, anon: u64) -> String {
        format!(
            "{range} {perms} 00001000 {dev} {inode}   /usr/local/bin/nodeguard\n\
             Size:               1024 kB\n\
             KernelPageSize:        4 kB\n\
             Rss:                {rss} kB\n\
             Pss:                {rss} kB\n\
             Shared_Clean:          0 kB\n\
             Private_Clean:      {rss} kB\n\
             Referenced:         {rss} kB\n\
             Anonymous:          {anon} kB\n\
             LazyFree:              0 kB\n\
             Swap:                  0 kB\n\
             VmFlags: rd ex mr mw me sd \n"
        )
    }

    /// The executable's text, holding [`CODE`]: device fd:01, inode 1234.
    fn text(rss: u64, anon: u64) -> String {
        mapping("500000-a00000", "r-xp", "fd:01", 1234, rss, anon)
    }

    fn load(offset: usize, vaddr: usize, filesz: usize, writable: bool) -> Segment {
        Segment::Load {
            offset,
            vaddr,
            filesz,
            writable,
        }
    }

    /// `other` beside the agent's clean text mapping: only the text is clean.
    fn only_the_text_beside(other: String, case: &str) {
        assert_eq!(
            clean_mappings(&[text(4000, 0), other].concat(), CODE),
            vec![at(0x500000, 0x500000, 4000)],
            "{case}"
        );
    }

    fn at(start: usize, len: usize, resident_kib: u64) -> Clean {
        Clean {
            start,
            len,
            resident_kib,
        }
    }

    #[test]
    fn the_executables_text_and_read_only_data_qualify() {
        let smaps = [
            mapping("400000-500000", "r--p", "fd:01", 1234, 100, 0),
            text(4000, 0),
        ]
        .concat();
        assert_eq!(
            clean_mappings(&smaps, CODE),
            vec![at(0x400000, 0x100000, 100), at(0x500000, 0x500000, 4000)]
        );
    }

    #[test]
    fn a_mapping_with_a_written_page_does_not() {
        // RELRO: read-only now, relocated by the loader before.
        only_the_text_beside(
            mapping("a00000-a10000", "r--p", "fd:01", 1234, 64, 60),
            "relro",
        );
        // A breakpoint's copy in the text.
        assert_eq!(clean_mappings(&text(4000, 4), CODE), vec![]);
    }

    #[test]
    fn writable_shared_and_unreadable_mappings_do_not() {
        for perms in ["rw-p", "r-xs", "r--s", "---p", "-w-p", "rwxp"] {
            only_the_text_beside(
                mapping("a00000-b00000", perms, "fd:01", 1234, 100, 0),
                perms,
            );
        }
    }

    #[test]
    fn other_files_do_not_even_with_the_same_inode() {
        for (dev, inode) in [("fd:01", 99), ("fd:02", 1234), ("08:01", 1234)] {
            only_the_text_beside(
                mapping("7f0000000-7f0100000", "r-xp", dev, inode, 100, 0),
                &format!("{dev} {inode}"),
            );
        }
    }

    #[test]
    fn the_file_is_the_one_mapped_at_the_code_address() {
        // On overlayfs smaps names the layer's file: whatever its device and
        // inode, the mapping holding the code says which file it is.
        let smaps = [
            mapping("400000-500000", "r--p", "00:2a", 77, 100, 0),
            mapping("500000-a00000", "r-xp", "00:2a", 77, 4000, 0),
            mapping("7f0000000-7f0100000", "r-xp", "fd:01", 1234, 100, 0),
        ]
        .concat();
        assert_eq!(
            clean_mappings(&smaps, CODE),
            vec![at(0x400000, 0x100000, 100), at(0x500000, 0x500000, 4000)]
        );
        // An address in no mapping, or in an anonymous one: nothing.
        assert_eq!(clean_mappings(&smaps, 0x100), vec![]);
        let anon = "500000-a00000 r-xp 00000000 00:00 0\nRss: 4 kB\nAnonymous: 0 kB\n";
        assert_eq!(clean_mappings(anon, CODE), vec![]);
    }

    #[test]
    fn nothing_resident_is_nothing_to_release() {
        assert_eq!(clean_mappings(&text(0, 0), CODE), vec![]);
    }

    #[test]
    fn a_mapping_without_its_anonymous_line_does_not() {
        let smaps = "500000-a00000 r-xp 00001000 fd:01 1234 /x\nRss: 100 kB\n";
        assert_eq!(clean_mappings(smaps, CODE), vec![]);
        let smaps = "500000-a00000 r-xp 00001000 fd:01 1234 /x\nRss: 100 kB\nAnonymous: lots\n";
        assert_eq!(clean_mappings(smaps, CODE), vec![]);
    }

    #[test]
    fn anonymous_mappings_and_the_kernels_own_do_not() {
        only_the_text_beside(
            [
                "7ffd000-7fff000 rw-p 00000000 00:00 0 [stack]\nRss: 8 kB\nAnonymous: 8 kB\n",
                "7fff000-8000000 r-xp 00000000 00:00 0 [vdso]\nRss: 4 kB\nAnonymous: 0 kB\n",
                "8000000-8001000 r--p 00000000 00:00 0\nRss: 4 kB\nAnonymous: 0 kB\n",
            ]
            .concat(),
            "anonymous",
        );
    }

    #[test]
    fn a_deleted_executable_is_still_its_file() {
        // An upgrade replaced the binary on disk: the path says "(deleted)",
        // the device and inode are still the running file's.
        let smaps = "500000-a00000 r-xp 00001000 fd:01 1234 /usr/local/bin/nodeguard (deleted)\nRss: 100 kB\nAnonymous: 0 kB\nSwap: 0 kB\n";
        assert_eq!(
            clean_mappings(smaps, CODE),
            vec![at(0x500000, 0x500000, 100)]
        );
    }

    #[test]
    fn headers_that_do_not_parse_are_no_mappings() {
        let smaps = [
            "garbage\n",
            "zz-500000 r-xp 00001000 fd:01 1234 /x\nRss: 100 kB\nAnonymous: 0 kB\n",
            "a00000-500000 r-xp 00001000 fd:01 1234 /x\nRss: 100 kB\nAnonymous: 0 kB\n",
            "500000-a00000 r-x 00001000 fd:01 1234 /x\nRss: 100 kB\nAnonymous: 0 kB\n",
            "500000-a00000 r-xp 00001000 fd01 1234 /x\nRss: 100 kB\nAnonymous: 0 kB\n",
            "500000-a00000 r-xp 00001000 fd:01 x /x\nRss: 100 kB\nAnonymous: 0 kB\n",
        ]
        .concat();
        assert_eq!(clean_mappings(&smaps, CODE), vec![]);
    }

    #[test]
    fn a_header_that_does_not_parse_ends_the_mapping_before_it() {
        // Its fields belong to no mapping: they must not overwrite those of
        // the good mapping before it.
        let smaps = [
            text(100, 0),
            "a00000-a10000 r--p 0000zz00 fd:01 1234 /x\nRss: 64 kB\nAnonymous: 64 kB\n".into(),
            mapping("b00000-b10000", "r--p", "fd:01", 1234, 8, 0),
            "b10000-b20000 r--p 00001000 fd:01 1234 /x\nAnonymous: 0 kB\nSwap: 0 kB\nRss: 4 kB\n"
                .into(),
        ]
        .concat();
        assert_eq!(
            clean_mappings(&smaps, CODE),
            vec![
                at(0x500000, 0x500000, 100),
                at(0xb00000, 0x10000, 8),
                at(0xb10000, 0x10000, 4),
            ]
        );
    }

    /// helper-72's review: smaps counts a written page that is swapped out
    /// under `Swap`, not `Anonymous`; dropping it would bring back the
    /// file's bytes (a relocated GOT: a crash).
    #[test]
    fn a_mapping_with_a_written_page_swapped_out_does_not() {
        let swapped =
            text(4000, 0).replace("Swap:                  0 kB", "Swap:                  4 kB");
        assert_eq!(clean_mappings(&swapped, CODE), vec![]);
        let no_swap_line = text(4000, 0).replace("Swap:                  0 kB\n", "");
        assert_eq!(clean_mappings(&no_swap_line, CODE), vec![]);
    }

    const PAGE: usize = 0x1000;

    #[test]
    fn read_only_segments_in_whole_pages_without_relro() {
        let segments = [
            // .rodata, from a page boundary; its last page is partly the
            // next segment's, so it is left.
            load(0x0, 0x0, 0x2800, false),
            // .text, starting mid-page: its first page is left.
            load(0x2800, 0x2800, 0x7800, false),
            // .data.rel.ro, .got (RELRO), .data, .bss.
            load(0xa000, 0xa000, 0x3000, true),
            Segment::Relro {
                vaddr: 0xa000,
                memsz: 0x1800,
            },
        ];
        assert_eq!(
            read_only_ranges(0x5550_0000, &segments, PAGE),
            vec![0x5550_0000..0x5550_2000, 0x5550_3000..0x5550_a000]
        );
    }

    #[test]
    fn a_read_only_load_segment_holding_relro_keeps_those_pages() {
        // A layout where RELRO sits in a read-only PT_LOAD (glibc's loader
        // makes it read-only after relocating): its pages, and any page it
        // touches, are never released.
        let segments = [
            load(0x0, 0x0, 0x10000, false),
            Segment::Relro {
                vaddr: 0x4800,
                memsz: 0x1000,
            },
        ];
        assert_eq!(
            read_only_ranges(0, &segments, PAGE),
            vec![0x0..0x4000, 0x6000..0x10000]
        );
        // Nothing read-only: nothing.
        assert!(read_only_ranges(0, &[], PAGE).is_empty());
    }

    #[test]
    fn only_the_loaded_segments_of_a_clean_mapping_are_released() {
        // The text mapping 0x500000-0xa00000 is clean; a second clean
        // mapping of the same file (std's backtrace maps the executable to
        // read its debug info, and may unmap it at any time) lies outside
        // every segment and is left alone.
        let smaps = [
            text(4000, 0),
            mapping("7f0000000-7f0100000", "r--p", "fd:01", 1234, 100, 0),
        ]
        .concat();
        let allowed = [0x400000..0x600000, 0x700000..0x800000];
        assert_eq!(
            releasable(&smaps, CODE, &allowed),
            vec![0x500000..0x600000, 0x700000..0x800000]
        );
        assert!(releasable(&smaps, CODE, &[]).is_empty());
    }

    /// The shipped musl binary's layout (`readelf -l`, a static PIE with no
    /// PT_PHDR, whose loader reports a bias of 0: helper-74's review found
    /// nothing released on it). The text segment's mapping tells the bias.
    fn musl_segments() -> Vec<Segment> {
        vec![
            load(0x0, 0x0, 0x814e8, false),
            load(0x82000, 0x82000, 0x9d0bb8, false),
            load(0xa53000, 0xa53000, 0x28afc0, false),
            load(0xcde2e0, 0xcde2e0, 0x65c20, true),
            Segment::Relro {
                vaddr: 0xcde2e0,
                memsz: 0x60d20,
            },
        ]
    }

    #[test]
    fn the_load_bias_comes_from_the_mapping_that_holds_the_code() {
        let base = 0x7f12_3400_0000usize;
        let smaps = [
            mapping("7f1234000000-7f1234082000", "r--p", "00:2a", 77, 100, 0)
                .replace(" 00001000 ", " 00000000 "),
            mapping("7f1234082000-7f1234a53000", "r-xp", "00:2a", 77, 4000, 0)
                .replace(" 00001000 ", " 00082000 "),
        ]
        .concat();
        let code = base + 0x100000;
        assert_eq!(load_bias(&smaps, code, &musl_segments()), Some(base));
        let ranges = read_only_ranges(base, &musl_segments(), PAGE);
        assert_eq!(
            ranges,
            vec![
                base..base + 0x81000,
                base + 0x82000..base + 0xa52000,
                base + 0xa53000..base + 0xcdd000,
            ]
        );
        assert_eq!(
            releasable(&smaps, code, &ranges),
            vec![base..base + 0x81000, base + 0x82000..base + 0xa52000]
        );
        // The loader's 0 would have placed the segments where nothing of
        // the executable is mapped: nothing to release.
        assert!(releasable(&smaps, code, &read_only_ranges(0, &musl_segments(), PAGE)).is_empty());
    }

    #[test]
    fn the_load_bias_follows_a_segment_mapped_away_from_its_offset() {
        // vaddr 0x3000 above its file offset (a layout lld makes).
        let segments = [load(0x1000, 0x4000, 0x8000, false)];
        let smaps = mapping("555000004000-55500000c000", "r-xp", "fd:01", 1234, 8, 0);
        // The mapping starts at file offset 0x1000 (the helper's).
        assert_eq!(
            load_bias(&smaps, 0x5550_0000_5000, &segments),
            Some(0x5550_0000_0000)
        );
        // No mapping holds the address, or no segment its offset.
        assert_eq!(load_bias(&smaps, 0x10, &segments), None);
        let elsewhere = [load(0x100000, 0x100000, 0x1000, false)];
        assert_eq!(load_bias(&smaps, 0x5550_0000_5000, &elsewhere), None);
    }

    #[test]
    fn relro_is_left_out_wherever_the_executable_is_loaded() {
        let segments = [
            load(0x0, 0x0, 0x10000, false),
            Segment::Relro {
                vaddr: 0x4800,
                memsz: 0x1000,
            },
            Segment::Relro {
                vaddr: 0x9000,
                memsz: 0x1000,
            },
        ];
        let b = 0x5550_0000_0000usize;
        assert_eq!(
            read_only_ranges(b, &segments, PAGE),
            vec![
                b..b + 0x4000,
                b + 0x6000..b + 0x9000,
                b + 0xa000..b + 0x10000
            ]
        );
        // Addresses that overflow: the segment is left out, and a RELRO that
        // overflows takes everything.
        assert!(read_only_ranges(usize::MAX - 0x1000, &segments, PAGE).is_empty());
    }
}
