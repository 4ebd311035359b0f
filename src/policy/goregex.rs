//! node-problem-detector's patterns are Go regular expressions (RE2 syntax,
//! Go's `regexp` with its Perl flags); nodeguard compiles Rust's `regex`.
//! The two read some of the same text differently without either one
//! complaining:
//!
//! | Go text | Go | Rust |
//! |---|---|---|
//! | `\d`, `\w`, `\s`, `\b` | ASCII | Unicode |
//! | `\<`, `\>` | the characters `<`, `>` | word start, word end |
//! | `[a&&b]`, `[a--b]`, `[a~~b]` | the characters | set operations |
//! | `[[]` | a class holding `[` | a nested class (unclosed) |
//! | `a{,3}`, `x{foo}` | literal text | a repetition, an error |
//! | `\Q…\E`, `\012` | literal text, octal | errors |
//! | `\p{^Greek}` | negated class | an error |
//!
//! [`translate`] rewrites a Go pattern into a Rust pattern that matches
//! the same text, token by token, so a pattern means in nodeguard what it
//! meant in NPD. Text Go refuses is refused, with Go's reason.

use std::fmt::Write as _;

/// Go's largest repetition count (`{n,m}` with n or m above it is refused).
const GO_MAX_REPEAT: u32 = 1000;

/// Go's ASCII classes, as Rust class items (no brackets).
fn perl_class(c: char) -> Option<(&'static str, bool)> {
    Some(match c {
        'd' => ("0-9", false),
        'D' => ("0-9", true),
        's' => (r"\t\n\x0C\r ", false),
        'S' => (r"\t\n\x0C\r ", true),
        'w' => ("0-9A-Za-z_", false),
        'W' => ("0-9A-Za-z_", true),
        _ => return None,
    })
}

/// A literal character, escaped for use outside or inside a Rust class.
fn literal(out: &mut String, c: char) {
    match c {
        // Escapes Rust reads differently (`\<` is a word boundary) are not
        // needed for these: they are plain characters unescaped.
        '<' | '>' => out.push(c),
        '\\' | '.' | '+' | '*' | '?' | '(' | ')' | '|' | '[' | ']' | '{' | '}' | '^' | '$'
        | '#' | '&' | '-' | '~' => {
            out.push('\\');
            out.push(c);
        }
        '\n' => out.push_str(r"\n"),
        '\t' => out.push_str(r"\t"),
        '\r' => out.push_str(r"\r"),
        ' ' => out.push(' '),
        c if c.is_control() => {
            let _ = write!(out, r"\x{{{:X}}}", c as u32);
        }
        c => out.push(c),
    }
}

struct Parser<'a> {
    chars: Vec<char>,
    at: usize,
    source: &'a str,
}

impl Parser<'_> {
    fn peek(&self) -> Option<char> {
        self.chars.get(self.at).copied()
    }

    fn peek_at(&self, n: usize) -> Option<char> {
        self.chars.get(self.at + n).copied()
    }

    fn rest(&self) -> String {
        self.chars[self.at..].iter().collect()
    }

    fn error(&self, what: &str) -> String {
        format!("{what} in Go regular expression {:?}", self.source)
    }

    /// After a `\` (consumed): an escape that stands for one character
    /// (Go's `parseEscape`): octal, hex, control letters, punctuation.
    fn escaped_char(&mut self) -> Result<char, String> {
        let Some(c) = self.peek() else {
            return Err(self.error("trailing backslash"));
        };
        self.at += 1;
        match c {
            '1'..='7' if !matches!(self.peek(), Some('0'..='7')) => {
                Err(self.error(&format!("invalid escape \\{c} (Go has no backreferences)")))
            }
            '0'..='7' => {
                // Up to two more octal digits.
                let mut v = c.to_digit(8).unwrap();
                for _ in 0..2 {
                    match self.peek().and_then(|d| d.to_digit(8)) {
                        Some(d) => {
                            v = v * 8 + d;
                            self.at += 1;
                        }
                        None => break,
                    }
                }
                char::from_u32(v).ok_or_else(|| self.error("invalid octal escape"))
            }
            'x' => {
                let v = if self.peek() == Some('{') {
                    self.at += 1;
                    let mut s = String::new();
                    loop {
                        match self.peek() {
                            Some('}') => {
                                self.at += 1;
                                break;
                            }
                            Some(h) if h.is_ascii_hexdigit() => {
                                s.push(h);
                                self.at += 1;
                            }
                            _ => return Err(self.error("invalid escape \\x{…}")),
                        }
                    }
                    u32::from_str_radix(&s, 16).ok()
                } else {
                    let s: String = self.chars[self.at..].iter().take(2).collect();
                    if s.len() != 2 || !s.chars().all(|h| h.is_ascii_hexdigit()) {
                        return Err(self.error("invalid escape \\x"));
                    }
                    self.at += 2;
                    u32::from_str_radix(&s, 16).ok()
                };
                v.filter(|v| *v <= 0x10FFFF)
                    .and_then(char::from_u32)
                    .ok_or_else(|| self.error("invalid escape \\x"))
            }
            'a' => Ok('\x07'),
            'f' => Ok('\x0C'),
            'n' => Ok('\n'),
            'r' => Ok('\r'),
            't' => Ok('\t'),
            'v' => Ok('\x0B'),
            c if c.is_ascii() && !c.is_ascii_alphanumeric() => Ok(c),
            c => Err(self.error(&format!("invalid escape \\{c}"))),
        }
    }

    /// After `\p` or `\P` (consumed): the class in Rust's syntax.
    fn unicode_class(&mut self, negated: bool) -> Result<String, String> {
        let name = match self.peek() {
            Some('{') => {
                let end = self.chars[self.at..]
                    .iter()
                    .position(|c| *c == '}')
                    .ok_or_else(|| self.error("missing } in \\p{…}"))?;
                let name: String = self.chars[self.at + 1..self.at + end].iter().collect();
                self.at += end + 1;
                name
            }
            Some(c) => {
                self.at += 1;
                c.to_string()
            }
            None => return Err(self.error("trailing \\p")),
        };
        let (name, negated) = match name.strip_prefix('^') {
            Some(n) => (n.to_string(), !negated),
            None => (name, negated),
        };
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(self.error(&format!("invalid character class \\p{{{name}}}")));
        }
        Ok(format!(r"\{}{{{name}}}", if negated { 'P' } else { 'p' }))
    }

    /// After `[` (consumed): a class, in Rust's syntax.
    fn class(&mut self) -> Result<String, String> {
        let mut out = String::from("[");
        if self.peek() == Some('^') {
            self.at += 1;
            out.push('^');
        }
        let mut first = true;
        loop {
            let Some(c) = self.peek() else {
                return Err(self.error("missing closing ]"));
            };
            if c == ']' && !first {
                self.at += 1;
                break;
            }
            first = false;
            // POSIX [:alpha:] and [:^alpha:].
            if c == '[' && self.peek_at(1) == Some(':') {
                let rest = self.rest();
                if let Some(end) = rest[2..].find(":]") {
                    let name = &rest[2..2 + end];
                    let bare = name.strip_prefix('^').unwrap_or(name);
                    const NAMES: [&str; 14] = [
                        "alnum", "alpha", "ascii", "blank", "cntrl", "digit", "graph", "lower",
                        "print", "punct", "space", "upper", "word", "xdigit",
                    ];
                    if !NAMES.contains(&bare) {
                        return Err(self.error(&format!("invalid character class [:{name}:]")));
                    }
                    let _ = write!(out, "[:{name}:]");
                    self.at += 2 + end + 2;
                    continue;
                }
            }
            if c == '\\' {
                match self.peek_at(1) {
                    Some(p @ ('p' | 'P')) => {
                        self.at += 2;
                        out.push_str(&self.unicode_class(p == 'P')?);
                        continue;
                    }
                    Some(k) if perl_class(k).is_some() => {
                        self.at += 2;
                        let (items, negated) = perl_class(k).unwrap();
                        if negated {
                            let _ = write!(out, "[^{items}]");
                        } else {
                            out.push_str(items);
                        }
                        continue;
                    }
                    _ => {}
                }
            }
            let lo = self.class_char()?;
            if self.peek() == Some('-') && self.peek_at(1).is_some_and(|n| n != ']') {
                self.at += 1;
                let hi = self.class_char()?;
                if hi < lo {
                    return Err(self.error("invalid character class range"));
                }
                literal(&mut out, lo);
                out.push('-');
                literal(&mut out, hi);
            } else {
                literal(&mut out, lo);
            }
        }
        out.push(']');
        Ok(out)
    }

    fn class_char(&mut self) -> Result<char, String> {
        match self.peek() {
            None => Err(self.error("missing closing ]")),
            Some('\\') => {
                self.at += 1;
                self.escaped_char()
            }
            Some(c) => {
                self.at += 1;
                Ok(c)
            }
        }
    }

    /// At `{`: Go's `{n}`, `{n,}`, `{n,m}` as written, or `None` (then
    /// the `{` is a literal character in Go).
    fn repeat(&mut self) -> Result<Option<String>, String> {
        let rest = self.rest();
        let Some(end) = rest.find('}') else {
            return Ok(None);
        };
        let body = &rest[1..end];
        let (min, max) = match body.split_once(',') {
            Some((a, b)) => (a, Some(b)),
            None => (body, None),
        };
        let number = |s: &str| -> Option<u32> {
            (!s.is_empty() && s.chars().all(|c| c.is_ascii_digit()))
                .then(|| s.parse().unwrap_or(u32::MAX))
        };
        let Some(lo) = number(min) else {
            return Ok(None);
        };
        let hi = match max {
            None => Some(lo),
            Some("") => None,
            Some(m) => match number(m) {
                Some(h) => Some(h),
                None => return Ok(None),
            },
        };
        if lo > GO_MAX_REPEAT || hi.is_some_and(|h| h > GO_MAX_REPEAT || h < lo) {
            return Err(self.error(&format!("invalid repeat count {{{body}}}")));
        }
        self.at += end + 1;
        Ok(Some(format!("{{{body}}}")))
    }

    fn translate(&mut self) -> Result<String, String> {
        let mut out = String::new();
        // Whether the last thing written can take a repetition.
        let mut operand = false;
        while let Some(c) = self.peek() {
            match c {
                '\\' => {
                    self.at += 1;
                    match self.peek() {
                        Some('Q') => {
                            self.at += 1;
                            let rest = self.rest();
                            let (lit, skip) = match rest.find(r"\E") {
                                Some(i) => (&rest[..i], i + 2),
                                None => (rest.as_str(), rest.len()),
                            };
                            for ch in lit.chars() {
                                literal(&mut out, ch);
                                operand = true;
                            }
                            self.at += rest[..skip].chars().count();
                        }
                        Some(a @ ('A' | 'z')) => {
                            self.at += 1;
                            out.push('\\');
                            out.push(a);
                            operand = true;
                        }
                        Some(b @ ('b' | 'B')) => {
                            self.at += 1;
                            let _ = write!(out, r"(?-u:\{b})");
                            operand = true;
                        }
                        Some(p @ ('p' | 'P')) => {
                            self.at += 1;
                            let class = self.unicode_class(p == 'P')?;
                            out.push_str(&class);
                            operand = true;
                        }
                        Some(k) if perl_class(k).is_some() => {
                            self.at += 1;
                            let (items, negated) = perl_class(k).unwrap();
                            let _ = write!(out, "[{}{items}]", if negated { "^" } else { "" });
                            operand = true;
                        }
                        Some('C') => return Err(self.error(r"invalid escape \C")),
                        _ => {
                            let ch = self.escaped_char()?;
                            literal(&mut out, ch);
                            operand = true;
                        }
                    }
                }
                '[' => {
                    self.at += 1;
                    out.push_str(&self.class()?);
                    operand = true;
                }
                '(' => {
                    self.at += 1;
                    if self.peek() == Some('?') {
                        // (?flags), (?flags:, (?P<name>, (?<name>: Go's
                        // flags are i, m, s, U; Rust reads them the same.
                        let rest = self.rest();
                        let end = rest
                            .find([')', ':', '>'])
                            .ok_or_else(|| self.error("missing closing )"))?;
                        let head = &rest[..=end];
                        let named = head.starts_with("?P<") || head.starts_with("?<");
                        let flags = head[1..end].chars().all(|f| "imsU-".contains(f));
                        if !(named && head.ends_with('>') || flags && !head.ends_with('>')) {
                            return Err(self.error(&format!(
                                "invalid or unsupported Perl syntax (?{}",
                                &head[1..]
                            )));
                        }
                        out.push('(');
                        out.push_str(head);
                        self.at += head.chars().count();
                    } else {
                        out.push('(');
                    }
                    operand = false;
                }
                ')' => {
                    self.at += 1;
                    out.push(')');
                    operand = true;
                }
                '{' => match self.repeat()? {
                    Some(r) if operand => {
                        out.push_str(&r);
                        if self.peek() == Some('?') {
                            self.at += 1;
                            out.push('?');
                        }
                    }
                    Some(r) => {
                        return Err(
                            self.error(&format!("missing argument to repetition operator {r}"))
                        );
                    }
                    None => {
                        self.at += 1;
                        out.push_str(r"\{");
                        operand = true;
                    }
                },
                '*' | '+' | '?' => {
                    self.at += 1;
                    if !operand {
                        return Err(
                            self.error(&format!("missing argument to repetition operator {c}"))
                        );
                    }
                    out.push(c);
                    if self.peek() == Some('?') {
                        self.at += 1;
                        out.push('?');
                    }
                }
                '|' => {
                    self.at += 1;
                    out.push(c);
                    operand = false;
                }
                // Go repeats an empty-width assertion (`^*`); so does Rust.
                '^' | '$' => {
                    self.at += 1;
                    out.push(c);
                    operand = true;
                }
                '.' => {
                    self.at += 1;
                    out.push('.');
                    operand = true;
                }
                c => {
                    self.at += 1;
                    literal(&mut out, c);
                    operand = true;
                }
            }
        }
        Ok(out)
    }
}

/// The Rust `regex` pattern that matches what the Go pattern `go` matches
/// (Go's `regexp.Compile`), or why Go refuses it.
pub fn translate(go: &str) -> Result<String, String> {
    let rust = Parser {
        chars: go.chars().collect(),
        at: 0,
        source: go,
    }
    .translate()?;
    // What is left (unbalanced parentheses, nested repetitions) Rust reads
    // as Go does: let it say so.
    regex::Regex::new(&rust)
        .map(|_| rust)
        .map_err(|e| format!("invalid Go regular expression {go:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(go: &str, text: &str) -> bool {
        regex::Regex::new(&translate(go).unwrap())
            .unwrap()
            .is_match(text)
    }

    #[test]
    fn npds_patterns_mean_what_they_meant() {
        // ASCII classes and boundaries.
        assert!(m(r"\d+", "42"));
        assert!(!m(r"^\d$", "٣"), "Arabic-Indic digit: not \\d in Go");
        assert!(!m(r"^\w$", "é"));
        assert!(!m(r"^\s$", "\u{a0}"));
        assert!(!m(r"^\s$", "\x0B"), "Go's \\s has no vertical tab");
        assert!(m(r"\bfoo\b", "a foo b"));
        assert!(m(r"é\b", "éa"), "é is not an ASCII word character");
        // Punctuation escapes Rust reads as assertions.
        assert!(m(r"\<html\>", "<html>"));
        assert!(!m(r"\<html\>", "html"));
        // Set operations are characters in Go.
        assert!(m(r"^[a&&b]$", "&"));
        assert!(m(r"^[x~~y]$", "~"));
        assert!(m(r"^[a-]$", "-"));
        assert!(m(r"^[[]$", "["));
        assert!(m(r"^[]a]$", "]"));
        // Braces that are not repetitions are text.
        assert!(m(r"^a{,3}$", "a{,3}"));
        assert!(m(r"^x{foo}$", "x{foo}"));
        assert!(m(r"^a{2}$", "aa"));
        assert!(m(r"^a{2,}?$", "aaa"));
        // Go-only syntax.
        assert!(m(r"^\Q1+1=2\E$", "1+1=2"));
        assert!(m(r"^\Q(a)", "(a)"));
        assert!(m(r"^\101\012?$", "A"));
        assert!(m(r"^\p{^Greek}$", "a"));
        assert!(!m(r"^\P{^Greek}$", "a"));
        assert!(m(r"^[\d\s]+$", "1 2"));
        assert!(!m(r"^[\D]$", "1"));
        assert!(m(r"^[[:alpha:][:^digit:]]+$", "ab-"));
        assert!(m(r"(?i)KILLED process", "Killed process"));
        assert!(m(r"(?P<pid>\d+) (?<name>\w+)", "12 java"));
        assert!(m(r"^a\.b$", "a.b"));
        assert!(m(r"^\#\&\~\-$", "#&~-"));
    }

    #[test]
    fn go_refuses_these_so_nodeguard_does() {
        for bad in [
            r"\1",
            r"a\C",
            r"\e",
            r"[a",
            r"a{1001}",
            r"a{3,2}",
            r"(?x)a",
            r"\p{Not A Class}",
            r"[[:nope:]]",
            r"*a",
            r"(a",
            r"a\",
        ] {
            assert!(translate(bad).is_err(), "{bad:?} → {:?}", translate(bad));
        }
    }

    #[test]
    fn npds_release_patterns_keep_their_text() {
        // The kernel monitor's patterns come through with their meaning
        // and, where no construct differs, nearly as written.
        let p = translate(r"task [\S ]+:\w+ blocked for more than \w+ seconds\.").unwrap();
        assert!(
            regex::Regex::new(&p)
                .unwrap()
                .is_match("task docker:1234 blocked for more than 120 seconds.")
        );
        let p = translate(r"divide error: 0000 \[#\d+\] SMP").unwrap();
        assert_eq!(p, r"divide error: 0000 \[\#[0-9]+\] SMP");
    }
}
