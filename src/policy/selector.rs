//! Label selectors as a plain decision type: parsed once from the API's
//! `LabelSelector`, checked with field paths, matched against label maps.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use super::problem::Problem;

/// One requirement of a selector.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Requirement {
    In(String, BTreeSet<String>),
    NotIn(String, BTreeSet<String>),
    Exists(String),
    DoesNotExist(String),
}

/// A validated label selector. The empty selector matches everything,
/// as in Kubernetes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selector {
    requirements: Vec<Requirement>,
}

impl Selector {
    /// Parses `selector`, reporting every problem under `path` (for example
    /// `spec.nodeSelector`). Returns `None` when there was any problem.
    pub fn parse(
        selector: &LabelSelector,
        path: &str,
        problems: &mut Vec<Problem>,
    ) -> Option<Self> {
        let before = problems.len();
        let mut requirements = Vec::new();
        for (key, value) in selector.match_labels.iter().flatten() {
            let at = format!("{path}.matchLabels[{key}]");
            check_label_key(key, &at, problems);
            check_label_value(value, &at, problems);
            requirements.push(Requirement::In(
                key.clone(),
                BTreeSet::from([value.clone()]),
            ));
        }
        for (i, expr) in selector.match_expressions.iter().flatten().enumerate() {
            let at = format!("{path}.matchExpressions[{i}]");
            check_label_key(&expr.key, &format!("{at}.key"), problems);
            let values: BTreeSet<String> = expr.values.iter().flatten().cloned().collect();
            for (j, v) in expr.values.iter().flatten().enumerate() {
                check_label_value(v, &format!("{at}.values[{j}]"), problems);
            }
            let key = expr.key.clone();
            let requirement = match expr.operator.as_str() {
                "In" | "NotIn" if values.is_empty() => {
                    problems.push(Problem::new(
                        format!("{at}.values"),
                        format!("operator {} needs at least one value", expr.operator),
                    ));
                    continue;
                }
                "Exists" | "DoesNotExist" if !values.is_empty() => {
                    problems.push(Problem::new(
                        format!("{at}.values"),
                        format!("operator {} takes no values; remove them", expr.operator),
                    ));
                    continue;
                }
                "In" => Requirement::In(key, values),
                "NotIn" => Requirement::NotIn(key, values),
                "Exists" => Requirement::Exists(key),
                "DoesNotExist" => Requirement::DoesNotExist(key),
                other => {
                    problems.push(Problem::new(
                        format!("{at}.operator"),
                        format!(
                            "unknown operator {other:?}; use In, NotIn, Exists or DoesNotExist"
                        ),
                    ));
                    continue;
                }
            };
            requirements.push(requirement);
        }
        (problems.len() == before).then_some(Selector { requirements })
    }

    /// Whether a set of labels satisfies every requirement.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.requirements.iter().all(|r| match r {
            Requirement::In(k, vs) => labels.get(k).is_some_and(|v| vs.contains(v)),
            Requirement::NotIn(k, vs) => labels.get(k).is_none_or(|v| !vs.contains(v)),
            Requirement::Exists(k) => labels.contains_key(k),
            Requirement::DoesNotExist(k) => !labels.contains_key(k),
        })
    }

    /// True when the selector selects every node.
    pub fn is_everything(&self) -> bool {
        self.requirements.is_empty()
    }
}

/// A DNS label (RFC 1123): what probe and monitor names must be, since
/// they name files and metric labels.
pub fn is_dns_label(s: &str) -> bool {
    is_dns_subdomain(s) && !s.contains('.') && s.len() <= 63
}

/// A DNS-1123 subdomain: what Kubernetes accepts as most object names and
/// as the prefix of a label key.
pub fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|part| {
            !part.is_empty()
                && part
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !part.starts_with('-')
                && !part.ends_with('-')
        })
}

/// The "name" part of a qualified name, also the shape of a label value.
fn is_qualified_name_part(s: &str) -> bool {
    let bytes = s.as_bytes();
    !s.is_empty()
        && s.len() <= 63
        && bytes[0].is_ascii_alphanumeric()
        && bytes[bytes.len() - 1].is_ascii_alphanumeric()
        && bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// Taint keys have the shape of label keys.
pub(crate) fn check_label_key(key: &str, path: &str, problems: &mut Vec<Problem>) {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    if let Some(prefix) = prefix
        && !is_dns_subdomain(prefix)
    {
        problems.push(Problem::new(
            path,
            format!("label key {key:?} has an invalid prefix {prefix:?}: it must be a lowercase DNS subdomain"),
        ));
    }
    if !is_qualified_name_part(name) {
        problems.push(Problem::new(
            path,
            format!(
                "label key {key:?} is invalid: the name part must be 1-63 characters of [A-Za-z0-9-_.], starting and ending alphanumeric"
            ),
        ));
    }
}

fn check_label_value(value: &str, path: &str, problems: &mut Vec<Problem>) {
    if !value.is_empty() && !is_qualified_name_part(value) {
        problems.push(Problem::new(
            path,
            format!(
                "label value {value:?} is invalid: at most 63 characters of [A-Za-z0-9-_.], starting and ending alphanumeric"
            ),
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn expr(key: &str, op: &str, values: &[&str]) -> LabelSelectorRequirement {
        LabelSelectorRequirement {
            key: key.into(),
            operator: op.into(),
            values: (!values.is_empty()).then(|| values.iter().map(|v| v.to_string()).collect()),
        }
    }

    fn parse(sel: LabelSelector) -> Result<Selector, Vec<Problem>> {
        let mut problems = Vec::new();
        Selector::parse(&sel, "spec.nodeSelector", &mut problems).ok_or(problems)
    }

    #[test]
    fn empty_selector_matches_everything() {
        let s = parse(LabelSelector::default()).unwrap();
        assert!(s.is_everything());
        assert!(s.matches(&labels(&[])));
        assert!(s.matches(&labels(&[("a", "b")])));
    }

    #[test]
    fn match_labels_and_expressions_are_anded() {
        let s = parse(LabelSelector {
            match_labels: Some(labels(&[("pool", "gpu")])),
            match_expressions: Some(vec![
                expr("zone", "In", &["a", "b"]),
                expr("spot", "DoesNotExist", &[]),
            ]),
        })
        .unwrap();
        let cases = [
            (labels(&[("pool", "gpu"), ("zone", "a")]), true),
            (labels(&[("pool", "gpu"), ("zone", "b")]), true),
            (labels(&[("pool", "gpu"), ("zone", "c")]), false),
            (labels(&[("pool", "gpu")]), false),
            (labels(&[("pool", "cpu"), ("zone", "a")]), false),
            (
                labels(&[("pool", "gpu"), ("zone", "a"), ("spot", "")]),
                false,
            ),
        ];
        for (l, want) in cases {
            assert_eq!(s.matches(&l), want, "labels {l:?}");
        }
    }

    #[test]
    fn not_in_matches_absent_key_and_exists_requires_it() {
        let not_in = parse(LabelSelector {
            match_expressions: Some(vec![expr("tier", "NotIn", &["db"])]),
            ..Default::default()
        })
        .unwrap();
        assert!(not_in.matches(&labels(&[])));
        assert!(not_in.matches(&labels(&[("tier", "web")])));
        assert!(!not_in.matches(&labels(&[("tier", "db")])));

        let exists = parse(LabelSelector {
            match_expressions: Some(vec![expr("tier", "Exists", &[])]),
            ..Default::default()
        })
        .unwrap();
        assert!(!exists.matches(&labels(&[])));
        assert!(exists.matches(&labels(&[("tier", "")])));
    }

    #[test]
    fn bad_selectors_report_each_problem_with_its_path() {
        let problems = parse(LabelSelector {
            match_labels: Some(labels(&[("Bad_Prefix.io/x", "ok"), ("ok", "-bad")])),
            match_expressions: Some(vec![
                expr("zone", "Equals", &["a"]),
                expr("zone", "In", &[]),
                expr("zone", "Exists", &["a"]),
                expr("", "Exists", &[]),
            ]),
        })
        .unwrap_err();
        let paths: Vec<&str> = problems.iter().map(|p| p.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "spec.nodeSelector.matchLabels[Bad_Prefix.io/x]",
                "spec.nodeSelector.matchLabels[ok]",
                "spec.nodeSelector.matchExpressions[0].operator",
                "spec.nodeSelector.matchExpressions[1].values",
                "spec.nodeSelector.matchExpressions[2].values",
                "spec.nodeSelector.matchExpressions[3].key",
            ]
        );
        assert!(
            problems[2].message.contains("\"Equals\""),
            "{}",
            problems[2].message
        );
    }

    #[test]
    fn label_syntax_limits() {
        assert!(is_qualified_name_part("a"));
        assert!(is_qualified_name_part("a.b-c_d"));
        assert!(!is_qualified_name_part(&"a".repeat(64)));
        assert!(is_qualified_name_part(&"a".repeat(63)));
        assert!(!is_qualified_name_part("a-"));
        assert!(is_dns_subdomain("nodeguard.io"));
        assert!(!is_dns_subdomain("Nodeguard.io"));
        assert!(!is_dns_subdomain("a..b"));
        let mut p = Vec::new();
        check_label_key("kubernetes.io/hostname", "x", &mut p);
        check_label_key("a/b/c", "x", &mut p);
        assert_eq!(p.len(), 1, "{p:?}");
    }
}
