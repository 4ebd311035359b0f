//! Reading policies from YAML files (for `nodeguard check`): structural
//! errors and unknown fields with their paths, then the same semantic
//! [`validate`](super::validate) the agent applies to policies from the API,
//! and the CRD schema's rules that `validate` leaves to the API server.

use super::{NodeGuardPolicy, PolicyError, Problem, validate};

/// One policy document from a file, with everything wrong with it.
#[derive(Debug)]
pub struct PolicyDocument {
    /// Position of the document in its file, from 0.
    pub index: usize,
    /// `metadata.name` when it could be read.
    pub name: Option<String>,
    /// The parsed policy; `None` when it could not be parsed at all.
    pub policy: Option<NodeGuardPolicy>,
    pub problems: Vec<Problem>,
}

const API_VERSION: &str = "nodeguard.io/v1alpha1";

/// Parses every YAML document of `text` (from `origin`, used in messages).
/// Documents of other kinds are an error: a policy file holds policies.
pub fn load_policies(origin: &str, text: &str) -> Result<Vec<PolicyDocument>, PolicyError> {
    let docs: Vec<serde_json::Value> =
        serde_saphyr::from_multiple(text).map_err(|e| PolicyError::Yaml {
            origin: origin.to_string(),
            message: e.to_string(),
        })?;
    if docs.is_empty() {
        return Err(PolicyError::Empty {
            origin: origin.to_string(),
        });
    }
    docs.into_iter()
        .enumerate()
        .map(|(index, value)| load_one(origin, index, value))
        .collect()
}

fn load_one(
    origin: &str,
    index: usize,
    value: serde_json::Value,
) -> Result<PolicyDocument, PolicyError> {
    let api_version = value
        .get("apiVersion")
        .and_then(|v| v.as_str())
        .unwrap_or("");
    let kind = value.get("kind").and_then(|v| v.as_str()).unwrap_or("");
    if kind != "NodeGuardPolicy" || !api_version.starts_with("nodeguard.io/") {
        return Err(PolicyError::WrongKind {
            origin: origin.to_string(),
            index,
            kind: format!("{kind:?} ({api_version:?})"),
        });
    }
    let name = value
        .pointer("/metadata/name")
        .and_then(|v| v.as_str())
        .map(str::to_string);
    let mut problems = Vec::new();
    if api_version != API_VERSION {
        problems.push(Problem::new(
            "apiVersion",
            format!("{api_version:?} is not served; use {API_VERSION:?}"),
        ));
    }
    let mut unknown = Vec::new();
    let mut record = |path: serde_ignored::Path| unknown.push(path.to_string());
    let parsed: Result<NodeGuardPolicy, _> =
        serde_path_to_error::deserialize(serde_ignored::Deserializer::new(value, &mut record));
    for path in unknown
        .into_iter()
        .filter(|p| p != "apiVersion" && p != "kind")
    {
        problems.push(Problem::new(
            path,
            "unknown field (the API server would reject or drop it); check its spelling and indentation",
        ));
    }
    let policy = match parsed {
        Ok(policy) => {
            problems.extend(validate(&policy));
            problems.extend(schema_refusals(&policy));
            Some(policy)
        }
        Err(err) => {
            let path = err.path().to_string();
            problems.push(Problem::new(
                if path == "." {
                    "(document)".into()
                } else {
                    path
                },
                err.inner().to_string(),
            ));
            None
        }
    };
    Ok(PolicyDocument {
        index,
        name,
        policy,
        problems,
    })
}

/// What the CRD's schema refuses on a write that [`validate`] leaves to it
/// (the agent runs a policy stored before the schema said so, rather than
/// drop it whole): said here, so a file is not found wrong only when it is
/// applied.
fn schema_refusals(policy: &NodeGuardPolicy) -> Vec<Problem> {
    static URL: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
        regex::Regex::new(super::monitors::HEALTH_URL_PATTERN)
            .expect("the healthUrl pattern compiles")
    });
    let url = &*URL;
    policy
        .spec
        .monitors
        .iter()
        .enumerate()
        .filter_map(|(i, m)| {
            let health = m.source.systemd.as_ref()?.health_url.as_ref()?;
            (!url.is_match(health)).then(|| {
                Problem::new(
                    format!("spec.monitors[{i}].source.systemd.healthUrl"),
                    format!(
                        "{health:?} is not an absolute http:// or https:// URL with a host; the API server refuses it"
                    ),
                )
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_valid_file_with_two_policies() {
        let docs = load_policies(
            "t.yaml",
            "apiVersion: nodeguard.io/v1alpha1\nkind: NodeGuardPolicy\nmetadata: {name: a}\nspec: {}\n---\n\
             apiVersion: nodeguard.io/v1alpha1\nkind: NodeGuardPolicy\nmetadata: {name: b}\n\
             spec:\n  nodeSelector:\n    matchLabels: {pool: gpu}\n",
        )
        .unwrap();
        assert_eq!(docs.len(), 2);
        assert!(docs.iter().all(|d| d.problems.is_empty()), "{docs:?}");
        assert_eq!(docs[1].name.as_deref(), Some("b"));
    }

    /// What the CRD's pattern refuses on a write, `check` refuses in a
    /// file, with its path; the agent's own `validate` does not.
    #[test]
    fn a_health_url_the_api_server_refuses_is_a_problem_of_the_file() {
        let file = |url: &str| {
            format!(
                "apiVersion: nodeguard.io/v1alpha1\nkind: NodeGuardPolicy\nmetadata: {{name: a}}\n\
                 spec:\n  monitors:\n  - name: kubelet\n    source: {{systemd: {{unit: kubelet.service, healthUrl: {url:?}}}}}\n\
                 \x20   conditions: [{{type: KubeletUnhealthy, reason: KubeletIsHealthy, message: fine}}]\n\
                 \x20   rules: [{{type: permanent, condition: KubeletUnhealthy, reason: KubeletUnhealthy}}]\n"
            )
        };
        let docs = load_policies("t.yaml", &file("http://127.0.0.1:10248/healthz")).unwrap();
        assert!(docs[0].problems.is_empty(), "{:?}", docs[0].problems);
        let docs = load_policies("t.yaml", &file("127.0.0.1:10248/healthz")).unwrap();
        let paths: Vec<&str> = docs[0].problems.iter().map(|p| p.path.as_str()).collect();
        assert_eq!(paths, ["spec.monitors[0].source.systemd.healthUrl"]);
        assert!(validate(docs[0].policy.as_ref().unwrap()).is_empty());
    }

    #[test]
    fn type_errors_and_unknown_fields_have_paths() {
        let docs = load_policies(
            "t.yaml",
            "apiVersion: nodeguard.io/v1alpha1\nkind: NodeGuardPolicy\nmetadata: {name: a}\n\
             spec:\n  nodeSelectr: {}\n  nodeSelector:\n    matchLabels: [1, 2]\n",
        )
        .unwrap();
        let paths: Vec<&str> = docs[0].problems.iter().map(|p| p.path.as_str()).collect();
        assert!(
            paths.contains(&"spec.nodeSelector.matchLabels"),
            "{paths:?}"
        );
        assert!(docs[0].policy.is_none());

        let docs = load_policies(
            "t.yaml",
            "apiVersion: nodeguard.io/v1alpha1\nkind: NodeGuardPolicy\nmetadata: {name: a, lables: {}}\nspec:\n  nodeSelectr: {}\n",
        )
        .unwrap();
        let paths: Vec<&str> = docs[0].problems.iter().map(|p| p.path.as_str()).collect();
        assert_eq!(paths, ["metadata.lables", "spec.nodeSelectr"]);
    }

    #[test]
    fn wrong_kind_bad_yaml_and_empty_input_are_errors() {
        assert!(matches!(
            load_policies("t", "apiVersion: v1\nkind: ConfigMap\n"),
            Err(PolicyError::WrongKind { index: 0, .. })
        ));
        assert!(matches!(
            load_policies("t", "a: [1, 2\n"),
            Err(PolicyError::Yaml { .. })
        ));
        assert!(matches!(
            load_policies("t", "\n"),
            Err(PolicyError::Empty { .. })
        ));
    }

    #[test]
    fn an_unserved_version_is_a_problem() {
        let docs = load_policies(
            "t",
            "apiVersion: nodeguard.io/v1\nkind: NodeGuardPolicy\nmetadata: {name: a}\nspec: {}\n",
        )
        .unwrap();
        assert_eq!(docs[0].problems[0].path, "apiVersion");
    }
}
