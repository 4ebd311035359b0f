//! Waiting as long as the API server asks when it sheds load.
//!
//! When API Priority and Fairness (or the max-in-flight filter) turns a
//! request away, the API server answers 429 with `Retry-After` in seconds:
//! from 1 s, doubled while it keeps shedding (up to 32 s), the same value
//! for every client of a priority level. So does a restarted API server
//! whose caches are still loading (a JSON Status, `Retry-After: 1`).
//! client-go waits exactly that long and sends the request again.
//! nodeguard's loops have backoffs of their own (from 200 ms), which brings
//! a whole fleet back to a restarted API server sooner and more often than
//! it asked.
//!
//! [`with_retry_after`] wraps a client so that such a request is sent again
//! after the time asked plus a random part of it (so a thousand agents told
//! "1 s" come back over a second, not in the same millisecond), at most
//! [`MAX_RETRIES`] times, and only while the wait ends within
//! [`WAIT_BUDGET`] of the call's start; otherwise the 429 goes to the
//! caller and its own backoff. The budget keeps a call within what its loop
//! allows: a call used to take at most one request deadline, and a loop
//! held by one call for a minute is stuck (`/livez` fails). Now a call
//! takes at most the budget plus one deadline.
//!
//! Two kinds of request get their 429 at once, because the caller decides:
//! - an eviction: a PodDisruptionBudget's refusal is a 429 (with
//!   `Retry-After: 10` while the budget is being processed); the shutdown
//!   manager retries it on its own schedule within the window (it uses a
//!   client without this wrapper, `agent::start`; this is the second
//!   guard);
//! - anything through the API server's proxy (`…/proxy/…`): that is the
//!   proxied pod's or node's own answer.
//!
//! The wait is part of the call, so a caller's timeout cancels it, and so
//! does the agent's stop.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use http::header::RETRY_AFTER;
use http::{HeaderMap, Method, Request, Response, StatusCode};
use kube::Client;
use kube::client::Body;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How many times one request is sent again after a 429 that asked for a
/// wait (client-go: 10).
pub const MAX_RETRIES: u32 = 3;

/// How long one call may take before its last try: a wait starts only when
/// it ends within this much of the call's start, so a call takes at most
/// this plus one request deadline. Longer waits are left to the caller's
/// backoff.
pub const WAIT_BUDGET: Duration = Duration::from_secs(10);

/// What to do with an answer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Verdict {
    /// Not the API server shedding the request (another status, no
    /// `Retry-After`, an eviction, the proxy): the caller's.
    Answer,
    /// Shed: send it again after this wait.
    Wait(Duration),
    /// Shed, but the wait does not fit (no retries left, or past the
    /// budget): the caller's backoff.
    HandOver,
}

/// What to do with the answer (`status`, `headers`) to a request
/// (`method`, `path`) that has had `retries` retries and began `elapsed`
/// ago; `unit` is a random number in `[0, 1)`.
///
/// The wait is at least what `Retry-After` asks (at least 1 s), spread
/// uniformly up to twice that or the end of [`WAIT_BUDGET`], whichever
/// comes first.
pub fn verdict(
    method: &Method,
    path: &str,
    status: StatusCode,
    headers: &HeaderMap,
    retries: u32,
    elapsed: Duration,
    unit: f64,
) -> Verdict {
    if status != StatusCode::TOO_MANY_REQUESTS || is_eviction(method, path) || is_proxied(path) {
        return Verdict::Answer;
    }
    // Only delay-seconds: the API server never sends an HTTP date.
    let Some(asked) = headers
        .get(RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
    else {
        return Verdict::Answer;
    };
    let asked = Duration::from_secs(asked.max(1));
    let left = WAIT_BUDGET.saturating_sub(elapsed);
    if retries >= MAX_RETRIES || asked > left {
        return Verdict::HandOver;
    }
    let spread = asked.min(left - asked);
    Verdict::Wait(asked + spread.mul_f64(unit.clamp(0.0, 1.0)))
}

/// Whether the request asks to evict a pod (`POST
/// /api/v1/namespaces/<ns>/pods/<name>/eviction`).
fn is_eviction(method: &Method, path: &str) -> bool {
    let mut segments = path.trim_end_matches('/').rsplit('/');
    *method == Method::POST
        && segments.next() == Some("eviction")
        && segments.next().is_some()
        && segments.next() == Some("pods")
}

/// Whether `path` goes through the API server's proxy to a pod, service or
/// node (`/api/v1/namespaces/<ns>/pods/<name>/proxy/…`,
/// `/api/v1/nodes/<name>/proxy/…`): the answer is theirs, not the API
/// server's.
fn is_proxied(path: &str) -> bool {
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    // After the group and version: /api/<v>/…, /apis/<group>/<v>/…
    let rest = match segments.first() {
        Some(&"api") => segments.get(2..),
        Some(&"apis") => segments.get(3..),
        _ => None,
    };
    let Some(mut rest) = rest else {
        return false;
    };
    // namespaces/<ns>/<resource>/…: the namespace's own subresources
    // (namespaces/<ns>/status) stay as they are.
    if rest.first() == Some(&"namespaces") && rest.len() >= 3 {
        rest = &rest[2..];
    }
    // <resource>/<name>/proxy/…
    rest.get(2) == Some(&"proxy")
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

/// `nodeguard_api_shed_*`: what [`with_retry_after`] did with the API
/// server's load shedding.
#[derive(Clone, Debug, Default)]
pub struct ShedMetrics {
    responses: Family<OutcomeLabels, Counter>,
    wait_seconds: Counter<f64, AtomicU64>,
    /// Requests that went wrong on the API server's side: no answer (a
    /// connection refused or reset, a deadline), a 429 or a 5xx. Not a
    /// metric: what `footprint` waits to see stop.
    troubles: Arc<AtomicU64>,
}

impl ShedMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "nodeguard_api_shed_responses",
            "Answers of 429 with Retry-After from the API server (load shedding), by what the agent did: waited as asked and sent the request again, or handed over to the loop's own backoff (the wait did not fit the budget, no retries left, or the agent is stopping)",
            self.responses.clone(),
        );
        registry.register(
            "nodeguard_api_shed_wait_seconds",
            "Time spent waiting as the API server's Retry-After asked before sending a shed request again",
            self.wait_seconds.clone(),
        );
    }

    fn count(&self, outcome: &'static str) {
        self.responses
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    }

    /// Waits made (each counted once it is over).
    pub fn waited(&self) -> u64 {
        self.responses
            .get_or_create(&OutcomeLabels { outcome: "waited" })
            .get()
    }

    /// Shed answers handed to the caller.
    pub fn handed_over(&self) -> u64 {
        self.responses
            .get_or_create(&OutcomeLabels {
                outcome: "handed_over",
            })
            .get()
    }

    /// Seconds waited in all.
    pub fn wait_seconds(&self) -> f64 {
        self.wait_seconds.get()
    }

    /// Requests without an answer, or answered 429 or 5xx, so far
    /// (each try of a request counts).
    pub fn troubles(&self) -> u64 {
        self.troubles.load(Ordering::Relaxed)
    }

    fn trouble(&self) {
        self.troubles.fetch_add(1, Ordering::Relaxed);
    }
}

/// `client`, sending a request again when the API server sheds it with a
/// 429 and `Retry-After` (see the module docs), counted in `metrics`. Once
/// `stop` is cancelled, no wait starts and one under way ends: the 429 goes
/// to the caller, so a stopping agent's last writes are not held.
pub fn with_retry_after(client: Client, metrics: ShedMetrics, stop: CancellationToken) -> Client {
    let namespace = client.default_namespace().to_string();
    Client::new(
        RetryAfter {
            inner: client,
            metrics,
            stop,
        },
        namespace,
    )
}

#[derive(Clone)]
struct RetryAfter {
    inner: Client,
    metrics: ShedMetrics,
    stop: CancellationToken,
}

/// A copy of `req` to send again, when its body can be copied (every
/// request the agent makes: kube builds them from bytes).
fn copy(req: &Request<Body>) -> Option<Request<Body>> {
    let mut again = Request::new(req.body().try_clone()?);
    *again.method_mut() = req.method().clone();
    *again.uri_mut() = req.uri().clone();
    *again.version_mut() = req.version();
    *again.headers_mut() = req.headers().clone();
    *again.extensions_mut() = req.extensions().clone();
    Some(again)
}

/// How long a shed answer's body may take to be read (it is a line of text
/// or a small Status): read to its end, its connection can be used again.
const DRAIN: Duration = Duration::from_secs(1);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl tower_service::Service<Request<Body>> for RetryAfter {
    type Response = Response<Body>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, BoxError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut req: Request<Body>) -> Self::Future {
        let (client, metrics, stop) = (self.inner.clone(), self.metrics.clone(), self.stop.clone());
        Box::pin(async move {
            let started = Instant::now();
            let mut retries = 0;
            loop {
                let again = copy(&req);
                let (method, path) = (req.method().clone(), req.uri().path().to_string());
                let mut response = match client.send(req).await {
                    Ok(response) => response,
                    Err(e) => {
                        metrics.trouble();
                        return Err(Box::new(e) as BoxError);
                    }
                };
                if response.status() == StatusCode::TOO_MANY_REQUESTS
                    || response.status().is_server_error()
                {
                    metrics.trouble();
                }
                if response.status() == StatusCode::TOO_MANY_REQUESTS {
                    // Read to its end (a line of text or a small Status;
                    // a watch's too), so the connection can serve the
                    // retry, and before the budget is reckoned.
                    let (parts, body) = response.into_parts();
                    let bytes = tokio::time::timeout(DRAIN, body.collect_bytes())
                        .await
                        .ok()
                        .and_then(Result::ok)
                        .unwrap_or_default();
                    response = Response::from_parts(parts, Body::from(bytes));
                }
                let verdict = verdict(
                    &method,
                    &path,
                    response.status(),
                    response.headers(),
                    retries,
                    started.elapsed(),
                    fastrand::f64(),
                );
                let wait = match (verdict, again) {
                    (Verdict::Answer, _) => return Ok(response),
                    (Verdict::Wait(wait), Some(again)) if !stop.is_cancelled() => (wait, again),
                    // Shed, but not waited for here.
                    _ => {
                        metrics.count("handed_over");
                        return Ok(response);
                    }
                };
                let (wait, again) = wait;
                retries += 1;
                tracing::debug!(
                    %method,
                    path,
                    retry = retries,
                    wait_ms = wait.as_millis() as u64,
                    retry_after = ?response.headers().get(RETRY_AFTER),
                    "the API server shed the request (429): sending it again after the wait it asked for"
                );
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = stop.cancelled() => {
                        metrics.count("handed_over");
                        return Ok(response);
                    }
                }
                metrics.count("waited");
                metrics.wait_seconds.inc_by(wait.as_secs_f64());
                req = again;
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    const NODE: &str = "/api/v1/nodes/n1/status";
    const PLAIN: (&str, &str) = ("content-type", "text/plain; charset=utf-8");
    const JSON: (&str, &str) = ("content-type", "application/json");
    const TOO_MANY: StatusCode = StatusCode::TOO_MANY_REQUESTS;
    use Verdict::{Answer, HandOver, Wait};

    /// The verdict on a node status PATCH's first answer.
    fn first(h: &HeaderMap, unit: f64) -> Verdict {
        verdict(&Method::PATCH, NODE, TOO_MANY, h, 0, Duration::ZERO, unit)
    }

    #[test]
    fn a_shed_request_waits_what_was_asked_stretched_by_at_most_as_much_again() {
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        let after = |v: &str| headers(&[PLAIN, ("retry-after", v)]);
        for (h, unit, want) in [
            (after("1"), 0.0, Wait(s(1))),
            (after("1"), 0.5, Wait(ms(1500))),
            (after("4"), 0.999, Wait(ms(7996))),
            // Near the budget the spread narrows, still from what was asked
            // and still spread: 6 s asked, 4 s left to spread over.
            (after("6"), 0.0, Wait(s(6))),
            (after("6"), 0.5, Wait(s(8))),
            (after("6"), 0.999, Wait(ms(9996))),
            (after("10"), 0.5, Wait(s(10))),
            // Spaces, no content type: the max-in-flight filter's answer.
            (headers(&[("retry-after", " 2 ")]), 0.0, Wait(s(2))),
            // A JSON Status: a restarted API server whose caches load.
            (headers(&[JSON, ("retry-after", "1")]), 0.0, Wait(s(1))),
            // 0 would bring the fleet back at once: at least 1 s.
            (after("0"), 0.0, Wait(s(1))),
            // More than the budget (APF asks up to 32 s): the caller's.
            (after("11"), 0.0, HandOver),
            (after("32"), 0.0, HandOver),
            (after("18446744073709551615"), 0.0, HandOver),
            // An out-of-range random number is clamped.
            (after("2"), -1.0, Wait(s(2))),
            (after("2"), 7.0, Wait(s(4))),
            // No Retry-After, or one that is not delay-seconds: not the
            // API server asking for a wait.
            (headers(&[PLAIN]), 0.0, Answer),
            (headers(&[JSON]), 0.0, Answer),
            (after(""), 0.0, Answer),
            (after("-1"), 0.0, Answer),
            (after("1.5"), 0.0, Answer),
            (after("Wed, 21 Oct 2026 07:28:00 GMT"), 0.0, Answer),
        ] {
            assert_eq!(first(&h, unit), want, "{h:?} {unit}");
        }
    }

    #[test]
    fn a_call_waits_only_within_the_budget_from_its_start() {
        let h = |after: &str| headers(&[PLAIN, ("retry-after", after)]);
        let v = |after: &str, retries, elapsed_ms, unit| {
            let elapsed = Duration::from_millis(elapsed_ms);
            verdict(
                &Method::GET,
                "/api/v1/pods",
                TOO_MANY,
                &h(after),
                retries,
                elapsed,
                unit,
            )
        };
        let s = Duration::from_secs;
        assert_eq!(v("1", 1, 1_900, 0.0), Wait(s(1)));
        assert_eq!(v("4", 2, 6_000, 0.9), Wait(s(4)));
        assert_eq!(v("4", 2, 6_001, 0.0), HandOver);
        assert_eq!(v("1", 2, 9_000, 0.5), Wait(s(1)));
        assert_eq!(v("1", 2, 9_500, 0.0), HandOver);
        assert_eq!(v("1", 1, 10_000, 0.0), HandOver);
        assert_eq!(v("1", 1, 60_000, 0.0), HandOver);
        // Time spent in the tries counts: a try that took 9 s leaves 1 s.
        assert_eq!(v("2", 0, 9_000, 0.0), HandOver);
        // Whatever comes, every wait ends within the budget of the start,
        // each is at least what was asked, and no more than 3.
        let mut rng = fastrand::Rng::with_seed(39);
        for _ in 0..10_000 {
            let asked = rng.u64(0..40);
            let (mut retries, mut elapsed) = (0, Duration::ZERO);
            loop {
                elapsed += Duration::from_millis(rng.u64(0..3_000));
                let (h, path) = (h(&asked.to_string()), "/api/v1/pods");
                match verdict(
                    &Method::GET,
                    path,
                    TOO_MANY,
                    &h,
                    retries,
                    elapsed,
                    rng.f64(),
                ) {
                    Wait(w) => {
                        assert!(w >= s(asked.max(1)), "{w:?} for {asked}");
                        retries += 1;
                        elapsed += w;
                        assert!(elapsed <= WAIT_BUDGET, "{elapsed:?}");
                    }
                    HandOver => break,
                    Answer => panic!("a shed answer taken for another"),
                }
            }
            assert!(retries <= MAX_RETRIES, "{retries}");
        }
    }

    #[test]
    fn the_spread_never_collapses_onto_the_end_of_the_budget() {
        // Asked 8 s (APF sends it): 2 s left to spread over, and the waits
        // fill those 2 s evenly rather than piling up at 10 s.
        let h = headers(&[PLAIN, ("retry-after", "8")]);
        let waits: Vec<Duration> = (0..100)
            .map(|i| match first(&h, f64::from(i) / 100.0) {
                Wait(w) => w,
                other => panic!("{other:?}"),
            })
            .collect();
        let at_end = waits
            .iter()
            .filter(|w| **w >= Duration::from_millis(9_990))
            .count();
        assert_eq!(at_end, 0, "{waits:?}");
        assert_eq!(waits[0], Duration::from_secs(8));
        assert_eq!(waits[50], Duration::from_secs(9));
    }

    #[test]
    fn only_a_429_is_sent_again_and_only_three_times() {
        let h = headers(&[PLAIN, ("retry-after", "1")]);
        let v = |status, retries| {
            verdict(
                &Method::PATCH,
                NODE,
                status,
                &h,
                retries,
                Duration::ZERO,
                0.0,
            )
        };
        for status in [
            StatusCode::OK,
            StatusCode::CONFLICT,
            StatusCode::INTERNAL_SERVER_ERROR,
            StatusCode::SERVICE_UNAVAILABLE,
            StatusCode::GATEWAY_TIMEOUT,
        ] {
            assert_eq!(v(status, 0), Answer, "{status}");
        }
        for retries in 0..MAX_RETRIES {
            assert!(matches!(v(TOO_MANY, retries), Wait(_)));
        }
        assert_eq!(v(TOO_MANY, MAX_RETRIES), HandOver);
        assert_eq!(v(TOO_MANY, u32::MAX), HandOver);
    }

    #[test]
    fn an_eviction_is_the_callers_whatever_its_429_asks() {
        for (method, path, eviction) in [
            (Method::POST, "/api/v1/namespaces/ns/pods/p/eviction", true),
            (Method::POST, "/api/v1/namespaces/ns/pods/p/eviction/", true),
            (
                Method::POST,
                "/api/v1/namespaces/eviction/pods/eviction/eviction",
                true,
            ),
            (Method::GET, "/api/v1/namespaces/ns/pods/p/eviction", false),
            (Method::POST, "/api/v1/namespaces/ns/pods/eviction", false),
            (Method::POST, "/api/v1/namespaces/ns/pods", false),
            (Method::POST, "/api/v1/namespaces/ns/events", false),
            (Method::POST, "/eviction", false),
            (Method::POST, "", false),
        ] {
            assert_eq!(is_eviction(&method, path), eviction, "{method} {path}");
        }
        // A PDB being processed asks for 10 s, with a JSON Status.
        let h = headers(&[JSON, ("retry-after", "10")]);
        let path = "/api/v1/namespaces/ns/pods/p/eviction";
        let v = verdict(&Method::POST, path, TOO_MANY, &h, 0, Duration::ZERO, 0.0);
        assert_eq!(v, Answer);
    }

    #[test]
    fn an_answer_through_the_api_servers_proxy_is_not_the_api_servers() {
        for (path, proxied) in [
            ("/api/v1/namespaces/ns/pods/p:8080/proxy/healthz", true),
            ("/api/v1/namespaces/ns/pods/p/proxy", true),
            ("/api/v1/namespaces/ns/services/https:s:443/proxy/", true),
            ("/api/v1/nodes/n1/proxy/metrics", true),
            ("/apis/g.example/v1/namespaces/ns/things/t/proxy/x", true),
            ("/apis/g.example/v1/things/t/proxy", true),
            // Things named "proxy" are not the proxy.
            ("/api/v1/namespaces/proxy/pods", false),
            ("/api/v1/namespaces/proxy/pods/proxy", false),
            ("/api/v1/namespaces/proxy", false),
            ("/api/v1/namespaces/ns/status", false),
            ("/api/v1/nodes/proxy", false),
            ("/api/v1/nodes/proxy/status", false),
            ("/apis/proxy/v1/proxy", false),
            // What the agent sends.
            ("/api/v1/nodes/n1/status", false),
            ("/api/v1/namespaces/ns/pods/p/eviction", false),
            ("/api/v1/namespaces/ns/events", false),
            ("/apis/coordination.k8s.io/v1/namespaces/ns/leases/l", false),
            ("/api/v1/pods", false),
            ("/", false),
            ("", false),
            ("/healthz", false),
        ] {
            assert_eq!(is_proxied(path), proxied, "{path}");
        }
        let h = headers(&[PLAIN, ("retry-after", "1")]);
        let path = "/api/v1/nodes/n1/proxy/x";
        let v = verdict(&Method::GET, path, TOO_MANY, &h, 0, Duration::ZERO, 0.0);
        assert_eq!(v, Answer);
    }

    /// What a scripted peer saw: method, path and query, a header, body.
    type Seen = Arc<Mutex<Vec<(String, String, Option<String>, Vec<u8>)>>>;

    /// A client whose peer answers each request with the next of `answers`
    /// (status, Retry-After), and the requests it saw.
    fn scripted(answers: Vec<(u16, Option<&'static str>)>) -> (Client, Seen) {
        let seen: Seen = Arc::default();
        let answers = Arc::new(Mutex::new(answers.into_iter()));
        let log = seen.clone();
        let svc = tower::service_fn(move |req: Request<Body>| {
            let (answers, log) = (answers.clone(), log.clone());
            async move {
                let (parts, body) = req.into_parts();
                let body = body.collect_bytes().await.unwrap().to_vec();
                log.lock().unwrap().push((
                    parts.method.to_string(),
                    parts.uri.to_string(),
                    parts
                        .headers
                        .get("x-test")
                        .map(|v| v.to_str().unwrap().to_string()),
                    body,
                ));
                let (status, after) = answers.lock().unwrap().next().expect("an answer");
                let mut resp = Response::builder().status(status);
                if let Some(after) = after {
                    resp = resp.header(RETRY_AFTER, after);
                }
                Ok::<_, BoxError>(resp.body(Body::from(b"shed".to_vec())).unwrap())
            }
        });
        (Client::new(svc, "default"), seen)
    }

    fn patch() -> Request<Body> {
        Request::patch("/api/v1/nodes/n1/status?fieldManager=nodeguard")
            .header("x-test", "kept")
            .body(Body::from(b"{\"status\":{}}".to_vec()))
            .unwrap()
    }

    /// `inner` wrapped, with its metrics and stop token.
    fn wrapped(inner: Client) -> (Client, ShedMetrics, CancellationToken) {
        let (metrics, stop) = (ShedMetrics::default(), CancellationToken::new());
        (
            with_retry_after(inner, metrics.clone(), stop.clone()),
            metrics,
            stop,
        )
    }

    #[tokio::test(start_paused = true)]
    async fn the_same_request_goes_again_after_the_wait_and_its_answer_is_the_callers() {
        let (inner, seen) = scripted(vec![(429, Some("2")), (200, None)]);
        let (client, metrics, _stop) = wrapped(inner);
        let start = Instant::now();
        let resp = client.send(patch()).await.unwrap();
        let took = start.elapsed();
        assert_eq!(resp.status(), 200);
        assert!(
            took >= Duration::from_secs(2) && took < Duration::from_secs(4),
            "{took:?}"
        );
        assert_eq!((metrics.waited(), metrics.handed_over()), (1, 0));
        // The paused clock advances in whole milliseconds.
        assert!((metrics.wait_seconds() - took.as_secs_f64()).abs() < 0.002);
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 2);
        assert_eq!(seen[0], seen[1], "the request sent again is the same");
        assert_eq!(
            seen[1],
            (
                "PATCH".to_string(),
                "/api/v1/nodes/n1/status?fieldManager=nodeguard".to_string(),
                Some("kept".to_string()),
                b"{\"status\":{}}".to_vec()
            )
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_eviction_refused_goes_to_the_caller_at_once() {
        let (inner, seen) = scripted(vec![(429, Some("10"))]);
        let (client, metrics, _stop) = wrapped(inner);
        let start = Instant::now();
        let req = Request::post("/api/v1/namespaces/ns/pods/p/eviction")
            .body(Body::from(b"{}".to_vec()))
            .unwrap();
        let resp = client.send(req).await.unwrap();
        assert_eq!(resp.status(), 429);
        assert_eq!(start.elapsed(), Duration::ZERO);
        assert_eq!(seen.lock().unwrap().len(), 1);
        assert_eq!((metrics.waited(), metrics.handed_over()), (0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn after_three_retries_the_fourth_429_is_the_callers() {
        let (inner, seen) = scripted(vec![(429, Some("1")); 4]);
        let (client, metrics, _stop) = wrapped(inner);
        let start = Instant::now();
        let resp = client.send(patch()).await.unwrap();
        let took = start.elapsed();
        assert_eq!(resp.status(), 429);
        assert_eq!(seen.lock().unwrap().len(), 4);
        assert_eq!((metrics.waited(), metrics.handed_over()), (3, 1));
        assert!(
            took >= Duration::from_secs(3) && took < Duration::from_secs(6),
            "{took:?}"
        );
    }

    /// What `footprint` waits to see stop: each try without an answer, or
    /// answered 429 or 5xx. A 4xx other than 429 is the caller's business
    /// (a conflict, a refusal), not the API server's trouble.
    #[tokio::test(start_paused = true)]
    async fn troubles_count_each_try_the_api_server_did_not_serve() {
        let (inner, _seen) = scripted(vec![
            (200, None),
            (403, None),
            (404, None),
            (409, None),
            (500, None),
            (503, None),
            (429, Some("1")),
            (200, None),
        ]);
        let (client, metrics, _stop) = wrapped(inner);
        let mut got = Vec::new();
        for _ in 0..7 {
            got.push(client.send(patch()).await.unwrap().status().as_u16());
        }
        assert_eq!(got, [200, 403, 404, 409, 500, 503, 200]);
        assert_eq!(metrics.troubles(), 3, "500, 503 and the 429 sent again");

        let refused = tower::service_fn(|_req: Request<Body>| async {
            Err::<Response<Body>, BoxError>("connection refused".into())
        });
        let (client, metrics, _stop) = wrapped(Client::new(refused, "default"));
        assert!(client.send(patch()).await.is_err());
        assert!(client.send(patch()).await.is_err());
        assert_eq!(metrics.troubles(), 2, "each request without an answer");
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_cut_short_by_the_caller_is_not_counted() {
        let (inner, seen) = scripted(vec![(429, Some("5")), (200, None)]);
        let (client, metrics, _stop) = wrapped(inner);
        let call = tokio::time::timeout(Duration::from_secs(2), client.send(patch())).await;
        assert!(call.is_err(), "the caller's timeout ends the wait");
        tokio::time::sleep(Duration::from_secs(20)).await;
        assert_eq!(seen.lock().unwrap().len(), 1);
        assert_eq!((metrics.waited(), metrics.handed_over()), (0, 0));
        assert_eq!(metrics.wait_seconds(), 0.0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stopping_agent_gets_the_429_at_once_with_its_body() {
        let (inner, seen) = scripted(vec![(429, Some("5")), (429, Some("5"))]);
        let (client, metrics, stop) = wrapped(inner);
        let start = Instant::now();
        let call = tokio::spawn({
            let client = client.clone();
            async move { client.send(patch()).await }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        stop.cancel();
        let resp = call.await.unwrap().unwrap();
        assert_eq!(resp.status(), 429);
        assert_eq!(
            start.elapsed(),
            Duration::from_secs(1),
            "the wait ended with the stop"
        );
        assert_eq!(
            &resp.into_body().collect_bytes().await.unwrap()[..],
            b"shed"
        );
        // Once stopping, no wait starts.
        let resp = client.send(patch()).await.unwrap();
        assert_eq!(resp.status(), 429);
        assert_eq!(start.elapsed(), Duration::from_secs(1));
        assert_eq!(seen.lock().unwrap().len(), 2);
        assert_eq!((metrics.waited(), metrics.handed_over()), (0, 2));
    }

    #[test]
    fn the_metrics_have_their_standard_names() {
        let mut registry = Registry::default();
        let metrics = ShedMetrics::default();
        metrics.register(&mut registry);
        metrics.count("waited");
        metrics.count("handed_over");
        metrics.wait_seconds.inc_by(1.5);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for line in [
            "nodeguard_api_shed_responses_total{outcome=\"waited\"} 1",
            "nodeguard_api_shed_responses_total{outcome=\"handed_over\"} 1",
            "nodeguard_api_shed_wait_seconds_total 1.5",
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
    }
}
