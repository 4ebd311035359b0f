//! The probers: HTTP(S) GET, TCP connect, gRPC health (`grpc.health.v1`)
//! and exec. One shared client per kind, holding no connections between
//! probes (as the kubelet's probes do not).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::core::ProbeResult;
use crate::command::{CommandRoot, Ran, run_command};
use bytes::{Buf, BufMut, Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// What a probe observed: the verdict and a short human explanation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    pub result: ProbeResult,
    pub detail: String,
}

impl Outcome {
    fn success(detail: impl Into<String>) -> Self {
        Outcome {
            result: ProbeResult::Success,
            detail: detail.into(),
        }
    }
    fn failure(detail: impl Into<String>) -> Self {
        Outcome {
            result: ProbeResult::Failure,
            detail: detail.into(),
        }
    }
}

/// The prober itself could not run the probe (bad configuration, a missing
/// command): the result is dropped, not counted as a failure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProberError(pub String);

impl fmt::Display for ProberError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// How much of a response body or command output is kept.
pub const OUTPUT_LIMIT: usize = 1024;

/// One probe, resolved against its target.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    Http {
        url: String,
        headers: Vec<(String, String)>,
        status: (u16, u16),
        body_contains: Option<String>,
        insecure: bool,
    },
    Tcp {
        host: String,
        port: u16,
    },
    Grpc {
        host: String,
        port: u16,
        service: String,
    },
    Exec {
        command: Vec<String>,
    },
}

impl Action {
    /// A short description for messages: `GET http://127.0.0.1:10248/healthz`.
    pub fn describe(&self) -> String {
        match self {
            Action::Http { url, .. } => format!("GET {url}"),
            Action::Tcp { host, port } => format!("TCP {}", join_host_port(host, *port)),
            Action::Grpc {
                host,
                port,
                service,
            } => {
                format!(
                    "gRPC health {}{}",
                    join_host_port(host, *port),
                    if service.is_empty() {
                        String::new()
                    } else {
                        format!(" ({service})")
                    }
                )
            }
            Action::Exec { command } => format!("exec {}", command.join(" ")),
        }
    }
}

pub fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

type HttpsClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;

/// The shared probe clients.
#[derive(Clone)]
pub struct Probers {
    http: HttpsClient,
    http_insecure: HttpsClient,
    grpc: Client<HttpConnector, Full<Bytes>>,
    /// Where exec probes run (`--command-root`).
    command_root: CommandRoot,
}

impl fmt::Debug for Probers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Probers")
    }
}

fn https_client(config: rustls::ClientConfig) -> HttpsClient {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config)
        .https_or_http()
        .enable_http1()
        .wrap_connector(http);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(0)
        .build(connector)
}

impl Probers {
    pub fn new() -> Self {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls_native_certs::load_native_certs().certs {
            let _ = roots.add(cert);
        }
        let verifying = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .expect("ring supports the default protocol versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        let insecure = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .expect("ring supports the default protocol versions")
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NoVerify(provider)))
            .with_no_client_auth();
        let mut h2c = HttpConnector::new();
        h2c.set_nodelay(true);
        Probers {
            http: https_client(verifying),
            http_insecure: https_client(insecure),
            grpc: Client::builder(TokioExecutor::new())
                .http2_only(true)
                .pool_max_idle_per_host(0)
                .build(h2c),
            command_root: CommandRoot::default(),
        }
    }

    /// Exec probes run under `root` (`--command-root`).
    pub fn with_command_root(mut self, root: CommandRoot) -> Self {
        self.command_root = root;
        self
    }

    /// Runs `action` with `timeout`. A timeout is a failure.
    pub async fn run(&self, action: &Action, timeout: Duration) -> Result<Outcome, ProberError> {
        match tokio::time::timeout(timeout, self.run_inner(action, timeout)).await {
            Ok(r) => r,
            Err(_) => Ok(Outcome::failure(format!(
                "timed out after {}s",
                timeout.as_secs_f64()
            ))),
        }
    }

    async fn run_inner(&self, action: &Action, timeout: Duration) -> Result<Outcome, ProberError> {
        match action {
            Action::Http {
                url,
                headers,
                status,
                body_contains,
                insecure,
            } => {
                let client = if *insecure {
                    &self.http_insecure
                } else {
                    &self.http
                };
                http_get(client, url, headers, *status, body_contains.as_deref()).await
            }
            Action::Tcp { host, port } => Ok(tcp(host, *port).await),
            Action::Grpc {
                host,
                port,
                service,
            } => grpc_health(&self.grpc, host, *port, service).await,
            Action::Exec { command } => exec(command, timeout, &self.command_root).await,
        }
    }
}

impl Default for Probers {
    fn default() -> Self {
        Self::new()
    }
}

fn truncate(s: &str) -> String {
    crate::report::clip(s.trim(), OUTPUT_LIMIT)
}

async fn http_get(
    client: &HttpsClient,
    url: &str,
    headers: &[(String, String)],
    (min, max): (u16, u16),
    body_contains: Option<&str>,
) -> Result<Outcome, ProberError> {
    let mut req = hyper::Request::get(url)
        .header(
            "User-Agent",
            concat!("nodeguard-probe/", env!("CARGO_PKG_VERSION")),
        )
        .header("Accept", "*/*")
        .header("Connection", "close");
    for (k, v) in headers {
        req = req.header(k.as_str(), v.as_str());
    }
    let req = req
        .body(Full::new(Bytes::new()))
        .map_err(|e| ProberError(format!("invalid HTTP request for {url}: {e}")))?;
    let resp = match client.request(req).await {
        Ok(r) => r,
        Err(e) => {
            let mut msg = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(s) = source {
                msg = format!("{msg}: {s}");
                source = s.source();
            }
            return Ok(Outcome::failure(msg));
        }
    };
    let code = resp.status().as_u16();
    let needs_body = body_contains.is_some();
    let body = if needs_body {
        let mut collected = Vec::new();
        let mut body = resp.into_body();
        // Read at most 64 KiB: a probe is not a download.
        while let Some(frame) = body.frame().await {
            let Ok(frame) = frame else { break };
            if let Ok(data) = frame.into_data() {
                collected.extend_from_slice(&data);
                if collected.len() > 64 * 1024 {
                    break;
                }
            }
        }
        String::from_utf8_lossy(&collected).into_owned()
    } else {
        String::new()
    };
    if !(min..=max).contains(&code) {
        return Ok(Outcome::failure(format!(
            "HTTP {code} (expected {min}-{max})"
        )));
    }
    if let Some(want) = body_contains
        && !body.contains(want)
    {
        // Nothing of the body is reported (not even its length): it lands
        // in a NodeCondition or pod condition that anyone who reads nodes or
        // pods can see, and a probe may point at a node-local secret (a
        // metadata token). The match itself still is one bit about the body:
        // the chart's admission counts bodyContains as host access.
        return Ok(Outcome::failure(format!(
            "HTTP {code} but the body lacks {want:?}"
        )));
    }
    Ok(Outcome::success(format!("HTTP {code}")))
}

async fn tcp(host: &str, port: u16) -> Outcome {
    match tokio::net::TcpStream::connect(join_host_port(host, port)).await {
        Ok(_) => Outcome::success("connected"),
        Err(e) => Outcome::failure(e.to_string()),
    }
}

/// Protobuf of `HealthCheckRequest { string service = 1; }`, framed as a
/// gRPC message (uncompressed, 4-byte length).
pub fn grpc_health_request(service: &str) -> Bytes {
    let mut msg = BytesMut::new();
    if !service.is_empty() {
        msg.put_u8(0x0a);
        put_varint(&mut msg, service.len() as u64);
        msg.put_slice(service.as_bytes());
    }
    let mut framed = BytesMut::with_capacity(5 + msg.len());
    framed.put_u8(0);
    framed.put_u32(msg.len() as u32);
    framed.put_slice(&msg);
    framed.freeze()
}

fn put_varint(buf: &mut BytesMut, mut v: u64) {
    while v >= 0x80 {
        buf.put_u8((v as u8) | 0x80);
        v >>= 7;
    }
    buf.put_u8(v as u8);
}

fn get_varint(buf: &mut &[u8]) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        if buf.is_empty() {
            return None;
        }
        let b = buf.get_u8();
        v |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

/// `HealthCheckResponse.status` from a framed gRPC message: 0 UNKNOWN,
/// 1 SERVING, 2 NOT_SERVING, 3 SERVICE_UNKNOWN. Unknown fields are skipped.
pub fn grpc_health_status(framed: &[u8]) -> Option<u64> {
    if framed.len() < 5 || framed[0] != 0 {
        return None;
    }
    let len = u32::from_be_bytes([framed[1], framed[2], framed[3], framed[4]]) as usize;
    let mut msg = framed.get(5..5 + len)?;
    let mut status = 0;
    while !msg.is_empty() {
        let key = get_varint(&mut msg)?;
        match (key >> 3, key & 7) {
            (1, 0) => status = get_varint(&mut msg)?,
            (_, 0) => {
                get_varint(&mut msg)?;
            }
            (_, 2) => {
                let l = get_varint(&mut msg)? as usize;
                if msg.len() < l {
                    return None;
                }
                msg.advance(l);
            }
            (_, 1) => msg.advance(8.min(msg.len())),
            (_, 5) => msg.advance(4.min(msg.len())),
            _ => return None,
        }
    }
    Some(status)
}

async fn grpc_health(
    client: &Client<HttpConnector, Full<Bytes>>,
    host: &str,
    port: u16,
    service: &str,
) -> Result<Outcome, ProberError> {
    let url = format!(
        "http://{}/grpc.health.v1.Health/Check",
        join_host_port(host, port)
    );
    let req = hyper::Request::post(&url)
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(Full::new(grpc_health_request(service)))
        .map_err(|e| ProberError(format!("invalid gRPC request for {url}: {e}")))?;
    let resp = match client.request(req).await {
        Ok(r) => r,
        Err(e) => return Ok(Outcome::failure(format!("gRPC connection failed: {e}"))),
    };
    let http_status = resp.status();
    let grpc_status_header = resp
        .headers()
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let collected = match resp.into_body().collect().await {
        Ok(c) => c,
        Err(e) => return Ok(Outcome::failure(format!("gRPC response failed: {e}"))),
    };
    let trailers = collected.trailers().cloned();
    let body = collected.to_bytes();
    let grpc_status = trailers
        .as_ref()
        .and_then(|t| t.get("grpc-status"))
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or(grpc_status_header);
    if !http_status.is_success() {
        return Ok(Outcome::failure(format!("gRPC over HTTP {http_status}")));
    }
    match grpc_status.as_deref() {
        Some("0") => {}
        Some("12") => {
            return Ok(Outcome::failure(
                "the server does not implement grpc.health.v1",
            ));
        }
        Some("5") => {
            return Ok(Outcome::failure(format!(
                "service {service:?} is unknown to the server"
            )));
        }
        Some(code) => return Ok(Outcome::failure(format!("gRPC status {code}"))),
        None => return Ok(Outcome::failure("gRPC response without grpc-status")),
    }
    match grpc_health_status(&body) {
        Some(1) => Ok(Outcome::success("SERVING")),
        Some(2) => Ok(Outcome::failure("NOT_SERVING")),
        Some(3) => Ok(Outcome::failure("SERVICE_UNKNOWN")),
        Some(other) => Ok(Outcome::failure(format!("health status {other}"))),
        None => Ok(Outcome::failure("unreadable health response")),
    }
}

async fn exec(
    command: &[String],
    timeout: Duration,
    root: &CommandRoot,
) -> Result<Outcome, ProberError> {
    let ran = match run_command(command, timeout, root).await {
        Ok(ran) => ran,
        // Refused on the node: a failure the Node shows, not a dropped
        // result.
        Err(e @ crate::command::CommandError::Refused { .. }) => {
            return Ok(Outcome::failure(e.to_string()));
        }
        Err(e) => return Err(ProberError(e.to_string())),
    };
    match ran {
        Ran::TimedOut { .. } => Ok(Outcome::failure(format!(
            "timed out after {}s",
            timeout.as_secs_f64()
        ))),
        Ran::Exited {
            code: Some(0),
            output,
            ..
        } => Ok(Outcome::success(truncate(&output))),
        Ran::Exited { code, output, .. } => {
            let output = truncate(&output);
            let code = code
                .map(|c| format!("exit code {c}"))
                .unwrap_or_else(|| "killed by a signal".into());
            Ok(Outcome::failure(if output.is_empty() {
                code
            } else {
                format!("{code}: {output}")
            }))
        }
    }
}

/// Accepts any server certificate: only for probes that ask for it.
#[derive(Debug)]
struct NoVerify(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for NoVerify {
    fn verify_server_cert(
        &self,
        _end_entity: &rustls::pki_types::CertificateDer<'_>,
        _intermediates: &[rustls::pki_types::CertificateDer<'_>],
        _server_name: &rustls::pki_types::ServerName<'_>,
        _ocsp: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_messages_roundtrip() {
        assert_eq!(&grpc_health_request("")[..], &[0, 0, 0, 0, 0]);
        let r = grpc_health_request("svc");
        assert_eq!(&r[..], &[0, 0, 0, 0, 5, 0x0a, 3, b's', b'v', b'c']);
        // status = SERVING (field 1, varint 1)
        assert_eq!(grpc_health_status(&[0, 0, 0, 0, 2, 0x08, 1]), Some(1));
        assert_eq!(
            grpc_health_status(&[0, 0, 0, 0, 0]),
            Some(0),
            "default UNKNOWN"
        );
        // an unknown length-delimited field first, then status 2
        assert_eq!(
            grpc_health_status(&[0, 0, 0, 0, 6, 0x12, 2, b'h', b'i', 0x08, 2]),
            Some(2)
        );
        assert_eq!(
            grpc_health_status(&[1, 0, 0, 0, 0]),
            None,
            "compressed is refused"
        );
        assert_eq!(
            grpc_health_status(&[0, 0, 0, 0, 9, 0x08]),
            None,
            "truncated"
        );
    }

    #[test]
    fn descriptions_and_truncation() {
        assert_eq!(
            Action::Tcp {
                host: "::1".into(),
                port: 10256
            }
            .describe(),
            "TCP [::1]:10256"
        );
        assert_eq!(
            Action::Exec {
                command: vec!["/bin/true".into(), "x".into()]
            }
            .describe(),
            "exec /bin/true x"
        );
        let long = "é".repeat(2000);
        let t = truncate(&long);
        assert!(t.len() <= OUTPUT_LIMIT + "…".len() && t.ends_with('…'));
    }

    #[tokio::test]
    async fn tcp_and_exec_against_the_real_system() {
        let p = Probers::new();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let ok = p
            .run(
                &Action::Tcp {
                    host: "127.0.0.1".into(),
                    port,
                },
                Duration::from_secs(1),
            )
            .await
            .unwrap();
        assert_eq!(ok.result, ProbeResult::Success);
        drop(listener);
        let refused = p
            .run(
                &Action::Tcp {
                    host: "127.0.0.1".into(),
                    port,
                },
                Duration::from_secs(1),
            )
            .await
            .unwrap();
        assert_eq!(refused.result, ProbeResult::Failure);
        assert!(refused.detail.contains("refused"), "{}", refused.detail);

        let cmd = |c: &[&str]| Action::Exec {
            command: c.iter().map(|s| s.to_string()).collect(),
        };
        let out = p
            .run(&cmd(&["sh", "-c", "echo fine"]), Duration::from_secs(2))
            .await
            .unwrap();
        assert_eq!(
            (out.result, out.detail.as_str()),
            (ProbeResult::Success, "fine")
        );
        let out = p
            .run(
                &cmd(&["sh", "-c", "echo broken >&2; exit 3"]),
                Duration::from_secs(2),
            )
            .await
            .unwrap();
        assert_eq!(
            (out.result, out.detail.as_str()),
            (ProbeResult::Failure, "exit code 3: broken")
        );
        let out = p
            .run(&cmd(&["sleep", "5"]), Duration::from_millis(200))
            .await
            .unwrap();
        assert_eq!(out.result, ProbeResult::Failure);
        assert!(out.detail.contains("timed out"));
        let err = p
            .run(&cmd(&["/nonexistent/check"]), Duration::from_secs(1))
            .await
            .unwrap_err();
        assert!(err.0.contains("cannot run /nonexistent/check"), "{err}");
        let out = p
            .run(
                &cmd(&["sh", "-c", "head -c 5000 /dev/zero | tr '\\\\0' x"]),
                Duration::from_secs(2),
            )
            .await
            .unwrap();
        assert!(out.detail.len() <= OUTPUT_LIMIT + 3, "output truncated");
    }
}
