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
/// Only the set is kept compiled up front. A pattern's own regex (for
/// captures) is compiled the first time a caller asks for it: most rules
/// never fire on a healthy node, and keeping every pattern compiled twice
/// held about half of the monitors' memory (ARCHITECTURE.md, "Footprint").
#[derive(Clone, Debug)]
pub struct Patterns {
    set: RegexSet,
    single: Vec<OnceLock<Option<Regex>>>,
}

impl Patterns {
    /// Compiles `(field path, pattern, alone)` triples; every bad one is
    /// reported. `alone` marks a pattern that will be used on its own (for
    /// captures): it is compiled alone here too, and dropped, because alone
    /// it keeps the capture groups the set leaves out and can pass the size
    /// limit where the set did not. `whole` is the path reported when the
    /// patterns compile alone but not together (the set's size limit).
    pub fn compile<'a>(
        whole: &str,
        patterns: impl IntoIterator<Item = (String, &'a str, bool)>,
    ) -> Result<Patterns, Vec<BadPattern>> {
        let patterns: Vec<(String, &str, bool)> = patterns.into_iter().collect();
        let set = RegexSet::new(patterns.iter().map(|(_, p, _)| p));
        // Each pattern alone: those used alone, and every one when the set
        // failed (to name the bad ones).
        let bad: Vec<BadPattern> = patterns
            .iter()
            .filter(|(_, _, alone)| *alone || set.is_err())
            .filter_map(|(path, pattern, _)| {
                Regex::new(pattern).err().map(|e| BadPattern {
                    path: path.clone(),
                    message: format!("invalid regular expression: {e}"),
                })
            })
            .collect();
        if !bad.is_empty() {
            return Err(bad);
        }
        match set {
            Ok(set) => Ok(Patterns {
                set,
                single: patterns.iter().map(|_| OnceLock::new()).collect(),
            }),
            Err(e) => Err(vec![BadPattern {
                path: whole.to_string(),
                message: e.to_string(),
            }]),
        }
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
    /// `None` only for a pattern not marked `alone` in [`Patterns::compile`]
    /// that does not compile alone (logged once); callers then do without
    /// captures.
    pub fn regex(&self, index: usize) -> Option<&Regex> {
        self.single[index]
            .get_or_init(|| {
                let pattern = &self.set.patterns()[index];
                Regex::new(pattern)
                    .inspect_err(|e| {
                        tracing::warn!(%pattern, error = %e, "a monitor pattern does not compile on its own; its rule's message goes without captures")
                    })
                    .ok()
            })
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
        let p = Patterns::compile(
            "m",
            [
                ("a".to_string(), "foo", false),
                ("b".to_string(), r"f(o+)", true),
            ],
        )
        .unwrap();
        assert_eq!(p.matches("fooo"), [0, 1]);
        assert_eq!(p.matches("bar"), Vec::<usize>::new());
        assert_eq!(p.compiled_alone(), 0);
        assert_eq!(&p.regex(1).unwrap().captures("foo").unwrap()[1], "oo");
        assert_eq!(p.compiled_alone(), 1);
        let bad = Patterns::compile(
            "m",
            [
                ("x.pattern".to_string(), "(", false),
                ("ok".to_string(), "fine", true),
                ("y.clearPattern".to_string(), "[", false),
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
        let bad = Patterns::compile(
            "spec.monitors[3]",
            paths.iter().map(|p| (p.clone(), big, false)),
        )
        .unwrap_err();
        assert_eq!(bad.len(), 1);
        assert_eq!(bad[0].path, "spec.monitors[3]");
    }

    #[test]
    fn a_pattern_used_alone_is_checked_alone() {
        // Capture groups count alone but not in the set: this one fits the
        // size limit in the set and not alone.
        let big = "(a){150000}";
        let bad = Patterns::compile("m", [("r.pattern".to_string(), big, true)]).unwrap_err();
        assert_eq!(bad[0].path, "r.pattern");
        assert!(bad[0].message.starts_with("invalid regular expression"));
        // Not used alone: the set is all that runs, and it compiles.
        assert!(Patterns::compile("m", [("r.clearPattern".to_string(), big, false)]).is_ok());
    }
}
