//! The policies' status: `observedGeneration` and an `Accepted` condition,
//! written by one agent at a time (a coordination.k8s.io Lease), only when
//! they change, so thousands of agents do not fight over the same object.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{GetParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::k8s::watch::Snapshot;
use crate::policy::NodeGuardPolicy;
use crate::report::kube::FIELD_MANAGER;

pub const LEASE_NAME: &str = "nodeguard-policy-status";
/// The lease's term. The writer renews it every [`RENEW`]; every other
/// agent looks at it once in [`follower_wait`] (from the API server's
/// cache), so a fleet of N agents costs N/90 reads a second, none of them
/// reaching etcd, and a writer that died unannounced is replaced within
/// two terms. (A writer that stops deletes the lease at once; the next
/// agent to look takes it.)
const LEASE_SECONDS: i32 = 60;
const RENEW: Duration = Duration::from_secs(20);

/// How long an agent that does not hold the lease waits before it looks
/// again: one to two terms, drawn anew each time so a fleet's looks
/// spread instead of following each other.
fn follower_wait() -> Duration {
    let term = Duration::from_secs(LEASE_SECONDS as u64);
    term + term.mul_f64(fastrand::f64())
}

/// What the status of a policy should say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    pub generation: i64,
    pub accepted: bool,
    pub reason: String,
    pub message: String,
}

/// The verdict for `p`, whose problems are `problems`.
fn verdict_of(p: &NodeGuardPolicy, problems: &[crate::policy::Problem]) -> Verdict {
    let generation = p.metadata.generation.unwrap_or_default();
    match problems.first() {
        None => Verdict {
            generation,
            accepted: true,
            reason: "Valid".into(),
            message: "The policy is valid; agents on the nodes it selects apply it.".into(),
        },
        Some(first) => Verdict {
            generation,
            accepted: false,
            reason: "Invalid".into(),
            message: format!(
                "{first}{}. Agents keep the last valid generation, if any.",
                if problems.len() > 1 {
                    format!(" (and {} more)", problems.len() - 1)
                } else {
                    String::new()
                }
            ),
        },
    }
}

/// Whether the status already says this.
pub fn up_to_date(p: &NodeGuardPolicy, v: &Verdict) -> bool {
    let Some(status) = &p.status else {
        return false;
    };
    status.observed_generation == Some(v.generation)
        && status.conditions.iter().any(|c| {
            c.type_ == "Accepted"
                && c.status == if v.accepted { "True" } else { "False" }
                && c.reason == v.reason
                && c.message == v.message
                && c.observed_generation == Some(v.generation)
        })
}

/// Whether a lease renewed at `renewed` is still this agent's to act on:
/// renewals that failed for all but [`RENEW`] of a term stop the writing
/// before another agent may take the lease (client-go's RenewDeadline).
fn holding(renewed: Option<tokio::time::Instant>) -> bool {
    renewed.is_some_and(|t| t.elapsed() + RENEW < Duration::from_secs(LEASE_SECONDS as u64))
}

/// Tries to hold the lease; `true` while this agent is the writer. The
/// writer reads the lease from etcd; the others from the API server's
/// cache (`resourceVersion=0`), which may be a moment old: a takeover
/// decided on a stale copy fails on its resourceVersion, never wins twice.
async fn hold_lease(leases: &Api<Lease>, me: &str, leader: bool) -> Result<bool, kube::Error> {
    let now = MicroTime(jiff::Timestamp::now());
    let fresh = |rv: Option<String>, transitions: i32| -> Lease {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": LEASE_NAME, "resourceVersion": rv},
            "spec": {"holderIdentity": me, "leaseDurationSeconds": LEASE_SECONDS,
                     "acquireTime": now, "renewTime": now, "leaseTransitions": transitions},
        }))
        .expect("a lease")
    };
    let current = if leader {
        leases.get_opt(LEASE_NAME).await?
    } else {
        match leases.get_with(LEASE_NAME, &GetParams::any()).await {
            Ok(l) => Some(l),
            Err(kube::Error::Api(s)) if s.code == 404 => None,
            Err(e) => return Err(e),
        }
    };
    match current {
        None => match leases.create(&PostParams::default(), &fresh(None, 0)).await {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
            Err(e) => Err(e),
        },
        Some(lease) => {
            let spec = lease.spec.clone().unwrap_or_default();
            let mine = spec.holder_identity.as_deref() == Some(me);
            // The term the holder wrote (an older or newer agent may use
            // another than ours).
            let term = spec.lease_duration_seconds.unwrap_or(LEASE_SECONDS);
            let expired = spec.renew_time.as_ref().is_none_or(|t| {
                jiff::Timestamp::now().duration_since(t.0).as_secs() > i64::from(term)
            });
            if !mine && !expired {
                return Ok(false);
            }
            let mut next = fresh(
                lease.metadata.resource_version.clone(),
                spec.lease_transitions.unwrap_or(0) + i32::from(!mine),
            );
            if mine && let Some(s) = next.spec.as_mut() {
                s.acquire_time = spec.acquire_time.clone();
            }
            match leases
                .replace(LEASE_NAME, &PostParams::default(), &next)
                .await
            {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
                Err(e) => Err(e),
            }
        }
    }
}

/// The status writer loop.
pub async fn run_policy_status(
    client: Client,
    lease_namespace: String,
    me: String,
    mut policies: watch::Receiver<Option<Snapshot<NodeGuardPolicy>>>,
    stop: CancellationToken,
) {
    let leases: Api<Lease> = Api::namespaced(client.clone(), &lease_namespace);
    let api: Api<NodeGuardPolicy> = Api::all(client);
    // When this agent last renewed the lease it holds.
    let mut renewed: Option<tokio::time::Instant> = None;
    let mut written: BTreeMap<String, Verdict> = BTreeMap::new();
    // Each renewal looks at every policy: validated once per spec.
    let mut validations = crate::policy::Validations::default();
    // The first look is at once: the first agent of a cluster writes.
    let mut next_look = tokio::time::Instant::now();
    loop {
        tokio::select! {
            _ = stop.cancelled() => {
                if renewed.is_some() {
                    // Hand over at once instead of after the lease expires.
                    let _ = leases.delete(LEASE_NAME, &Default::default()).await;
                }
                return;
            }
            _ = tokio::time::sleep_until(next_look) => {
                let was = renewed.is_some();
                // The renewal is as old as the renewTime it writes, taken
                // when the call begins: the call may take a while (a
                // shedding API server's waits, k8s::retry_after).
                let asked = tokio::time::Instant::now();
                // The holder renews every RENEW, and retries an error as
                // soon, so a passing API error does not cost the lease;
                // the others look again in one to two terms, errors too.
                next_look = match hold_lease(&leases, &me, was).await {
                    Ok(true) => {
                        renewed = Some(asked);
                        asked + RENEW
                    }
                    Ok(false) => {
                        renewed = None;
                        tokio::time::Instant::now() + follower_wait()
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "cannot hold the policy status lease");
                        tokio::time::Instant::now() + if was { RENEW } else { follower_wait() }
                    }
                };
                if was != renewed.is_some() {
                    tracing::info!(leader = renewed.is_some(), lease = %format!("{lease_namespace}/{LEASE_NAME}"), "policy status writer");
                    written.clear();
                }
            }
            r = policies.changed() => if r.is_err() { return },
        }
        if !holding(renewed) {
            continue;
        }
        let snapshot: Vec<Arc<NodeGuardPolicy>> = policies
            .borrow_and_update()
            .as_ref()
            .map(|s| s.values().cloned().collect())
            .unwrap_or_default();
        validations.retain_listed(snapshot.iter().map(|p| &**p));
        for p in snapshot {
            let name = p.metadata.name.clone().unwrap_or_default();
            let v = verdict_of(&p, &validations.problems(&p));
            if up_to_date(&p, &v) || written.get(&name) == Some(&v) {
                continue;
            }
            if !holding(renewed) {
                // Renewals failed for most of a term: another agent may
                // hold the lease by now.
                break;
            }
            let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::now());
            let body = serde_json::json!({
                "apiVersion": "nodeguard.io/v1alpha1", "kind": "NodeGuardPolicy",
                "metadata": {"name": name},
                "status": {
                    "observedGeneration": v.generation,
                    "conditions": [{
                        "type": "Accepted",
                        "status": if v.accepted { "True" } else { "False" },
                        "reason": v.reason,
                        "message": v.message,
                        "observedGeneration": v.generation,
                        "lastTransitionTime": now,
                    }],
                },
            });
            match api
                .patch_status(
                    &name,
                    &PatchParams::apply(FIELD_MANAGER).force(),
                    &Patch::Apply(&body),
                )
                .await
            {
                Ok(_) => {
                    written.insert(name, v);
                }
                Err(e) => {
                    tracing::warn!(policy = %name, error = %e, "cannot write the policy status")
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::validate;

    #[test]
    fn followers_look_once_in_one_to_two_terms_spread_evenly() {
        let term = Duration::from_secs(LEASE_SECONDS as u64);
        let waits: Vec<Duration> = (0..10_000).map(|_| follower_wait()).collect();
        assert!(waits.iter().all(|w| *w >= term && *w < 2 * term));
        // Spread: each tenth of the range holds about a tenth of the looks.
        let mut tenths = [0usize; 10];
        for w in &waits {
            tenths[((*w - term).as_secs_f64() / term.as_secs_f64() * 10.0) as usize] += 1;
        }
        assert!(
            tenths.iter().all(|&c| (800..1200).contains(&c)),
            "{tenths:?}"
        );
        // The writer renews well inside its term.
        assert!(RENEW * 3 <= term);
    }

    #[tokio::test(start_paused = true)]
    async fn a_writer_whose_renewals_fail_stops_writing_before_its_term_ends() {
        assert!(!holding(None));
        let renewed = Some(tokio::time::Instant::now());
        assert!(holding(renewed));
        // Two renewals failed (40 s): it still holds, a term being 60 s.
        tokio::time::sleep(Duration::from_secs(39)).await;
        assert!(holding(renewed));
        // Within RENEW of the term's end: it stops acting on it.
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(!holding(renewed));
    }

    #[test]
    fn verdicts_and_freshness() {
        let mut p = NodeGuardPolicy::new("p", Default::default());
        p.metadata.generation = Some(3);
        let v = verdict_of(&p, &validate(&p));
        assert!(v.accepted && v.generation == 3 && v.reason == "Valid");
        assert!(!up_to_date(&p, &v));
        p.status = Some(crate::policy::NodeGuardPolicyStatus {
            observed_generation: Some(3),
            conditions: vec![k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
                type_: "Accepted".into(),
                status: "True".into(),
                reason: v.reason.clone(),
                message: v.message.clone(),
                observed_generation: Some(3),
                last_transition_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                    jiff::Timestamp::now(),
                ),
            }],
        });
        assert!(up_to_date(&p, &v));
        p.metadata.namespace = Some("x".into());
        let bad = verdict_of(&p, &validate(&p));
        assert!(!bad.accepted && bad.message.contains("metadata.namespace"));
        assert!(!up_to_date(&p, &bad));
    }
}
