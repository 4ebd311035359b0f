//! The HTTP server: `/healthz`, `/livez`, `/readyz` and `/metrics`.
//!
//! The decision core is [`health`]; this module is the thin axum adapter.

pub mod backoff;
pub mod health;
pub mod metrics;
pub mod supervisor;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use health::{Health, HealthReport, LoopHandle};
pub use metrics::ServerMetrics;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(
        "cannot listen on {addr}: {source} (is another nodeguard or another program using the port? set --listen)"
    )]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("HTTP server failed: {0}")]
    Serve(#[source] std::io::Error),
}

#[derive(Clone)]
struct AppState {
    health: Health,
    registry: Arc<Registry>,
    metrics: ServerMetrics,
}

/// A bound, not yet serving, HTTP server.
pub struct Server {
    listener: TcpListener,
    router: Router,
}

impl Server {
    /// Binds `addr` (port 0 picks a free port; see [`Server::local_addr`]).
    pub async fn bind(
        addr: SocketAddr,
        health: Health,
        registry: Arc<Registry>,
        metrics: ServerMetrics,
    ) -> Result<Self, ServerError> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| ServerError::Bind { addr, source })?;
        Ok(Server {
            listener,
            router: router(health, registry, metrics),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// Serves until `shutdown` is cancelled, then finishes open requests.
    pub async fn serve(self, shutdown: CancellationToken) -> Result<(), ServerError> {
        axum::serve(self.listener, self.router)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await
            .map_err(ServerError::Serve)
    }
}

fn router(health: Health, registry: Arc<Registry>, metrics: ServerMetrics) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/livez", get(livez))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_handler))
        .with_state(AppState {
            health,
            registry,
            metrics,
        })
}

#[derive(Clone, Copy)]
enum Endpoint {
    Healthz,
    Livez,
    Readyz,
}

impl Endpoint {
    fn name(self) -> &'static str {
        match self {
            Endpoint::Healthz => "healthz",
            Endpoint::Livez => "livez",
            Endpoint::Readyz => "readyz",
        }
    }

    fn passes(self, r: &HealthReport) -> bool {
        match self {
            Endpoint::Healthz => r.healthy(),
            Endpoint::Livez => r.live,
            Endpoint::Readyz => r.ready,
        }
    }
}

fn health_response(state: &AppState, endpoint: Endpoint) -> Response {
    let report = state.health.report();
    let status = if endpoint.passes(&report) {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    state
        .metrics
        .health_requests
        .get_or_create(&metrics::HealthRequestLabels {
            endpoint: endpoint.name().into(),
            code: status.as_u16(),
        })
        .inc();
    let body = serde_json::to_string(&report).expect("a health report always serializes");
    (
        status,
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            ),
            (
                header::X_CONTENT_TYPE_OPTIONS,
                HeaderValue::from_static("nosniff"),
            ),
        ],
        body,
    )
        .into_response()
}

async fn healthz(State(s): State<AppState>) -> Response {
    health_response(&s, Endpoint::Healthz)
}

async fn livez(State(s): State<AppState>) -> Response {
    health_response(&s, Endpoint::Livez)
}

async fn readyz(State(s): State<AppState>) -> Response {
    health_response(&s, Endpoint::Readyz)
}

async fn metrics_handler(State(s): State<AppState>) -> Response {
    match metrics::encode(&s.registry) {
        Ok(text) => (
            StatusCode::OK,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static(
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                ),
            )],
            text,
        )
            .into_response(),
        Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            "metrics encoding failed\n",
        )
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;
    use http_body_util::BodyExt;
    use std::time::Duration;
    use tower::ServiceExt;

    async fn get(router: &Router, path: &str) -> (StatusCode, String) {
        let resp = router
            .clone()
            .oneshot(Request::get(path).body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = resp.status();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8(body.to_vec()).unwrap())
    }

    fn app(health: &Health) -> Router {
        let (registry, metrics) = metrics::new_registry(health);
        router(health.clone(), Arc::new(registry), metrics)
    }

    #[tokio::test(start_paused = true)]
    async fn endpoints_follow_the_registry() {
        let health = Health::new();
        let app = app(&health);
        let w = health.register("watch", Duration::from_secs(2));

        assert_eq!(
            get(&app, "/readyz").await.0,
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(get(&app, "/livez").await.0, StatusCode::OK);
        w.updated();
        assert_eq!(get(&app, "/readyz").await.0, StatusCode::OK);

        w.queued();
        tokio::time::advance(Duration::from_secs(2)).await;
        let (code, body) = get(&app, "/livez").await;
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["loops"]["watch"]["stuck"], true);
        assert_eq!(
            get(&app, "/healthz").await.0,
            StatusCode::SERVICE_UNAVAILABLE
        );
        w.updated();

        health.set_node_eligible("node", false, Some("being deleted".into()));
        let (code, body) = get(&app, "/healthz").await;
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["nodeEligible"], false);
        assert_eq!(get(&app, "/livez").await.0, StatusCode::OK);

        let (code, text) = get(&app, "/metrics").await;
        assert_eq!(code, StatusCode::OK);
        assert!(
            text.contains("nodeguard_health_requests_total{endpoint=\"livez\",code=\"503\"} 1"),
            "{text}"
        );
        assert_eq!(get(&app, "/nope").await.0, StatusCode::NOT_FOUND);
    }
}
