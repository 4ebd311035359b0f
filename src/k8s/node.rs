//! Node eligibility: whether this node should keep receiving traffic from
//! load balancers that health-check it. A pure decision on plain inputs.

/// Taint the cluster autoscaler puts on a node it is about to delete.
pub const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

/// What the eligibility decision looks at, taken from the Node object.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeFacts {
    /// The Node exists in the API.
    pub exists: bool,
    /// `metadata.deletionTimestamp` is set.
    pub deleting: bool,
    /// Keys of `spec.taints`.
    pub taint_keys: Vec<String>,
}

impl NodeFacts {
    pub fn from_node(node: &k8s_openapi::api::core::v1::Node) -> Self {
        NodeFacts {
            exists: true,
            deleting: node.metadata.deletion_timestamp.is_some(),
            taint_keys: node
                .spec
                .as_ref()
                .and_then(|s| s.taints.as_ref())
                .map(|ts| ts.iter().map(|t| t.key.clone()).collect())
                .unwrap_or_default(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Eligibility {
    Eligible,
    Ineligible(String),
}

/// A node is ineligible while it is being deleted, is gone, or carries the
/// autoscaler's deletion taint or any of `extra_taint_keys`.
pub fn eligibility(facts: &NodeFacts, extra_taint_keys: &[String]) -> Eligibility {
    if !facts.exists {
        return Eligibility::Ineligible("the Node object does not exist".into());
    }
    if facts.deleting {
        return Eligibility::Ineligible("the Node is being deleted".into());
    }
    let tainted = facts
        .taint_keys
        .iter()
        .find(|k| k.as_str() == TO_BE_DELETED_TAINT || extra_taint_keys.contains(k));
    match tainted {
        Some(key) => Eligibility::Ineligible(format!("the Node has the taint {key}")),
        None => Eligibility::Eligible,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(deleting: bool, taints: &[&str]) -> NodeFacts {
        NodeFacts {
            exists: true,
            deleting,
            taint_keys: taints.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn eligibility_cases() {
        let extra = vec!["example.com/draining".to_string()];
        let cases: &[(NodeFacts, &[String], bool)] = &[
            (facts(false, &[]), &[], true),
            (
                facts(false, &["node.kubernetes.io/unschedulable"]),
                &[],
                true,
            ),
            (facts(true, &[]), &[], false),
            (facts(false, &[TO_BE_DELETED_TAINT]), &[], false),
            (facts(false, &["example.com/draining"]), &[], true),
            (facts(false, &["example.com/draining"]), &extra, false),
            (NodeFacts::default(), &[], false),
        ];
        for (f, extra, want) in cases {
            assert_eq!(
                eligibility(f, extra) == Eligibility::Eligible,
                *want,
                "{f:?} extra={extra:?}"
            );
        }
        assert_eq!(
            eligibility(&facts(false, &[TO_BE_DELETED_TAINT]), &[]),
            Eligibility::Ineligible("the Node has the taint ToBeDeletedByClusterAutoscaler".into())
        );
    }
}
