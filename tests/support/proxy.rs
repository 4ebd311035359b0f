//! A TCP proxy in front of the API server that can blackhole connections:
//! while frozen, bytes on every connection (open or new) are swallowed and
//! never forwarded, and a connection that was blackholed stays so after a
//! thaw, as behind a stateful firewall that lost its flow or a peer that
//! vanished without a reset. Only new connections forward again.
//!
//! It can also slow the API server down on the connections open now:
//! every byte the API server sends on them from then on reaches the client
//! that much later (in order), as from an API server slow to answer. New
//! connections are not slowed (their TLS handshake would take the delay
//! once more, a different thing to test).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Clone)]
pub struct BlackholeProxy {
    pub addr: SocketAddr,
    frozen: Arc<AtomicBool>,
    /// Each connection's delay (milliseconds each chunk from the API
    /// server is held).
    delays: Arc<std::sync::Mutex<Vec<std::sync::Weak<AtomicU64>>>>,
    /// Connections accepted so far.
    pub connections: Arc<AtomicU64>,
}

impl BlackholeProxy {
    /// A proxy in front of the test API server.
    pub async fn in_front_of_the_api_server() -> Self {
        let config = super::admin_config().await;
        let upstream = format!(
            "{}:{}",
            config.cluster_url.host().unwrap(),
            config.cluster_url.port_u16().unwrap()
        )
        .parse()
        .unwrap();
        Self::start(upstream).await
    }

    /// An admin client whose connections go through this proxy.
    pub async fn client(&self) -> kube::Client {
        let mut config = super::admin_config().await;
        config.cluster_url = format!("https://{}", self.addr).parse().unwrap();
        kube::Client::try_from(config).unwrap()
    }

    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let frozen = Arc::new(AtomicBool::new(false));
        let connections = Arc::new(AtomicU64::new(0));
        let delays: Arc<std::sync::Mutex<Vec<std::sync::Weak<AtomicU64>>>> = Default::default();
        let (f, c, d) = (frozen.clone(), connections.clone(), delays.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                c.fetch_add(1, Ordering::SeqCst);
                let Ok(server) = TcpStream::connect(upstream).await else {
                    continue;
                };
                let dead = Arc::new(AtomicBool::new(f.load(Ordering::SeqCst)));
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::spawn(pipe(cr, sw, f.clone(), dead.clone(), None));
                let delay = Arc::new(AtomicU64::new(0));
                d.lock().unwrap().push(Arc::downgrade(&delay));
                tokio::spawn(pipe(sr, cw, f.clone(), dead, Some(delay)));
            }
        });
        BlackholeProxy {
            addr,
            frozen,
            delays,
            connections,
        }
    }

    pub fn freeze(&self) {
        self.frozen.store(true, Ordering::SeqCst);
    }

    pub fn thaw(&self) {
        self.frozen.store(false, Ordering::SeqCst);
    }

    /// Holds what the API server sends from now on, on the connections
    /// open now, for `delay`.
    pub fn slow_down(&self, delay: std::time::Duration) {
        let mut delays = self.delays.lock().unwrap();
        delays.retain(|d| d.strong_count() > 0);
        for d in delays.iter().filter_map(std::sync::Weak::upgrade) {
            d.store(delay.as_millis() as u64, Ordering::SeqCst);
        }
    }
}

async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    to: tokio::net::tcp::OwnedWriteHalf,
    frozen: Arc<AtomicBool>,
    dead: Arc<AtomicBool>,
    delay_ms: Option<Arc<AtomicU64>>,
) {
    // Chunks go to the writer with the moment they may be sent.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    let writer = tokio::spawn(async move {
        let mut to = to;
        while let Some((at, chunk)) = rx.recv().await {
            tokio::time::sleep_until(at).await;
            if to.write_all(&chunk).await.is_err() {
                break;
            }
        }
    });
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if frozen.load(Ordering::SeqCst) {
            dead.store(true, Ordering::SeqCst);
        }
        if dead.load(Ordering::SeqCst) {
            continue; // swallowed; the socket stays open
        }
        let delay = delay_ms.as_ref().map_or(0, |d| d.load(Ordering::SeqCst));
        let at = tokio::time::Instant::now() + std::time::Duration::from_millis(delay);
        if tx.send((at, buf[..n].to_vec())).is_err() {
            break;
        }
    }
    // Keep a blackholed connection open: a vanished peer sends no FIN.
    if dead.load(Ordering::SeqCst) {
        std::future::pending::<()>().await;
    }
    // Otherwise what is queued goes out, then the write half closes.
    drop(tx);
    let _ = writer.await;
}
