//! Compiling a monitor's regular expressions: one `RegexSet` for the pass
//! over each line, a single pattern's regex (for captures) only when a rule
//! first needs it, and every bad pattern reported with its field path. A
//! leaf: both the policy validation (`nodeguard check`, the agent's policy
//! checks) and the monitor engine use it, and it uses neither.

use std::sync::OnceLock;

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
///
/// Only the set is compiled up front. A pattern's own regex is compiled the
/// first time a caller asks for it: most rules never fire on a healthy node,
/// and compiling every pattern twice held about half of the monitors'
/// memory and start-up time (ARCHITECTURE.md, "Footprint").
#[derive(Clone, Debug)]
pub struct Patterns {
    set: RegexSet,
    single: Vec<OnceLock<Option<Regex>>>,
}

impl Patterns {
    /// Compiles `(field path, pattern)` pairs; every bad one is reported.
    /// `whole` is the path reported when they compile alone but not
    /// together (the set's size limit).
    pub fn compile<'a>(
        whole: &str,
        patterns: impl IntoIterator<Item = (String, &'a str)>,
    ) -> Result<Patterns, Vec<BadPattern>> {
        let patterns: Vec<(String, &str)> = patterns.into_iter().collect();
        let set_error = match RegexSet::new(patterns.iter().map(|(_, p)| p)) {
            Ok(set) => {
                let single = patterns.iter().map(|_| OnceLock::new()).collect();
                return Ok(Patterns { set, single });
            }
            Err(e) => e,
        };
        // Only on failure: which patterns are bad, each by its own path.
        let bad: Vec<BadPattern> = patterns
            .into_iter()
            .filter_map(|(path, pattern)| {
                Regex::new(pattern).err().map(|e| BadPattern {
                    path,
                    message: format!("invalid regular expression: {e}"),
                })
            })
            .collect();
        if bad.is_empty() {
            return Err(vec![BadPattern {
                path: whole.to_string(),
                message: set_error.to_string(),
            }]);
        }
        Err(bad)
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

    /// The pattern at `index` alone (for captures), compiled on first use.
    /// `None` only if it compiled within the set but not alone, which the
    /// regex crate's limits do not allow (a set is at least as large as
    /// each of its patterns); callers then do without captures.
    pub fn regex(&self, index: usize) -> Option<&Regex> {
        self.single[index]
            .get_or_init(|| Regex::new(&self.set.patterns()[index]).ok())
            .as_ref()
    }

    /// How many patterns have their own regex compiled (for tests).
    #[cfg(test)]
    fn compiled_alone(&self) -> usize {
        self.single.iter().filter(|s| s.get().is_some()).count()
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
        assert_eq!(p.compiled_alone(), 0);
        assert_eq!(&p.regex(1).unwrap().captures("foo").unwrap()[1], "oo");
        assert_eq!(p.compiled_alone(), 1);
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

    #[test]
    fn patterns_fine_alone_but_too_large_together_are_reported_as_the_whole() {
        // Each alone is under the size limit; 40 of them are not.
        let big = "[a-c]{20000}";
        let paths: Vec<String> = (0..40).map(|i| format!("r[{i}]")).collect();
        assert!(Regex::new(big).is_ok());
        let bad = Patterns::compile("spec.monitors[3]", paths.iter().map(|p| (p.clone(), big)))
            .unwrap_err();
        assert_eq!(bad.len(), 1);
        assert_eq!(bad[0].path, "spec.monitors[3]");
    }
}
