//! A deadline on every API request the agent makes.
//!
//! kube's client has no read timeout by default, so a request on an
//! established connection that stops answering (a peer that vanished
//! without a reset, a proxy that stopped forwarding) waits forever, and the
//! loop that sent it with it. [`with_deadline`] wraps a client so that every
//! request gets its response within the deadline: for ordinary requests the
//! whole response (headers and body), for watches the response headers (a
//! watch's body is a stream that may rightly stay quiet for minutes; the
//! watcher's own idle timeout covers it). A request past its deadline fails
//! with [`DeadlineExceeded`], the connection it used is dropped, and the
//! caller's retry goes out on a new one.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use kube::Client;
use kube::client::Body;

/// The deadline of one API request, unless a loop asks for a shorter one.
pub const API_DEADLINE: Duration = Duration::from_secs(10);

/// The error of a request that did not complete within its deadline.
#[derive(Debug, thiserror::Error)]
#[error("the API server did not answer within {0:?} (request deadline)")]
pub struct DeadlineExceeded(pub Duration);

/// `client` with a deadline of `limit` on every request.
pub fn with_deadline(client: Client, limit: Duration) -> Client {
    let namespace = client.default_namespace().to_string();
    Client::new(
        Deadline {
            inner: client,
            limit,
        },
        namespace,
    )
}

#[derive(Clone)]
struct Deadline {
    inner: Client,
    limit: Duration,
}

fn is_watch(req: &Request<Body>) -> bool {
    req.uri()
        .query()
        .is_some_and(|q| q.split('&').any(|p| p == "watch=true" || p == "watch=1"))
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl tower_service::Service<Request<Body>> for Deadline {
    type Response = Response<Body>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, BoxError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let (client, limit) = (self.inner.clone(), self.limit);
        let watch = is_watch(&req);
        Box::pin(async move {
            let exchange = async {
                let response = client.send(req).await?;
                if watch {
                    return Ok(response);
                }
                let (parts, body) = response.into_parts();
                let bytes = body.collect_bytes().await?;
                Ok::<_, kube::Error>(Response::from_parts(parts, Body::from(bytes)))
            };
            match tokio::time::timeout(limit, exchange).await {
                Ok(Ok(response)) => Ok(response),
                Ok(Err(e)) => Err(Box::new(e) as BoxError),
                Err(_) => Err(
                    Box::new(kube::Error::Service(Box::new(DeadlineExceeded(limit)))) as BoxError,
                ),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watches_are_told_from_other_requests() {
        for (uri, want) in [
            (
                "/api/v1/nodes?fieldSelector=metadata.name%3Dn&watch=true",
                true,
            ),
            ("/api/v1/nodes?watch=1&resourceVersion=5", true),
            ("/api/v1/nodes?fieldSelector=metadata.name%3Dn", false),
            ("/api/v1/nodes/watch=true", false),
            ("/api/v1/nodes?allowWatchBookmarks=true", false),
        ] {
            let req = Request::get(uri).body(Body::empty()).unwrap();
            assert_eq!(is_watch(&req), want, "{uri}");
        }
    }
}
