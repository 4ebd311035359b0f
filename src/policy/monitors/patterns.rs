//! Compiling a monitor's regular expressions: one `RegexSet` for the pass
//! over each line, the single regexes for captures, and every bad pattern
//! reported with its field path. A leaf: both the policy validation
//! (`nodeguard check`, the agent's policy checks) and the monitor engine
//! use it, and it uses neither.

use regex::{Regex, RegexSet};

/// A pattern that does not compile.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {message}")]
pub struct BadPattern {
    /// The field path, e.g. `spec.monitors[0].rules[1].pattern`.
    pub path: String,
    pub message: String,
}

/// Compiled patterns, in the order given.
#[derive(Clone, Debug)]
pub struct Patterns {
    set: RegexSet,
    regexes: Vec<Regex>,
}

impl Patterns {
    /// Compiles `(field path, pattern)` pairs; every bad one is reported.
    /// `whole` is the path reported when they compile alone but not
    /// together (the set's size limit).
    pub fn compile<'a>(
        whole: &str,
        patterns: impl IntoIterator<Item = (String, &'a str)>,
    ) -> Result<Patterns, Vec<BadPattern>> {
        let mut bad = Vec::new();
        let mut sources = Vec::new();
        let mut regexes = Vec::new();
        for (path, pattern) in patterns {
            match Regex::new(pattern) {
                Ok(r) => {
                    sources.push(pattern);
                    regexes.push(r);
                }
                Err(e) => bad.push(BadPattern {
                    path,
                    message: format!("invalid regular expression: {e}"),
                }),
            }
        }
        if !bad.is_empty() {
            return Err(bad);
        }
        let set = RegexSet::new(&sources).map_err(|e| {
            vec![BadPattern {
                path: whole.to_string(),
                message: e.to_string(),
            }]
        })?;
        Ok(Patterns { set, regexes })
    }

    /// Indices of the patterns matching `line`, in order.
    pub fn matches(&self, line: &str) -> Vec<usize> {
        // Most lines match nothing: one search that stops early, and no
        // allocation, before the search that names every match.
        if !self.set.is_match(line) {
            return Vec::new();
        }
        self.set.matches(line).into_iter().collect()
    }

    /// The pattern at `index` (for captures).
    pub fn regex(&self, index: usize) -> &Regex {
        &self.regexes[index]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compiles_matches_in_order_and_reports_every_bad_pattern() {
        let p = Patterns::compile("m", [("a".to_string(), "foo"), ("b".to_string(), r"f(o+)")])
            .unwrap();
        assert_eq!(p.matches("fooo"), [0, 1]);
        assert_eq!(p.matches("bar"), Vec::<usize>::new());
        assert_eq!(&p.regex(1).captures("foo").unwrap()[1], "oo");
        let bad = Patterns::compile(
            "m",
            [
                ("x.pattern".to_string(), "("),
                ("ok".to_string(), "fine"),
                ("y.clearPattern".to_string(), "["),
            ],
        )
        .unwrap_err();
        let paths: Vec<&str> = bad.iter().map(|b| b.path.as_str()).collect();
        assert_eq!(paths, ["x.pattern", "y.clearPattern"]);
        assert!(bad[0].message.starts_with("invalid regular expression"));
        assert!(bad[0].to_string().starts_with("x.pattern: invalid"));
    }

    #[test]
    fn no_patterns_match_nothing() {
        let p = Patterns::compile("m", std::iter::empty()).unwrap();
        assert!(p.matches("anything").is_empty());
    }
}
