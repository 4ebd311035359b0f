//! A TCP proxy in front of the API server that can blackhole connections:
//! while frozen, bytes on every connection (open or new) are swallowed and
//! never forwarded, and a connection that was blackholed stays so after a
//! thaw, as behind a stateful firewall that lost its flow or a peer that
//! vanished without a reset. Only new connections forward again.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Clone)]
pub struct BlackholeProxy {
    pub addr: SocketAddr,
    frozen: Arc<AtomicBool>,
    /// Connections accepted so far.
    pub connections: Arc<AtomicU64>,
}

impl BlackholeProxy {
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let frozen = Arc::new(AtomicBool::new(false));
        let connections = Arc::new(AtomicU64::new(0));
        let (f, c) = (frozen.clone(), connections.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                c.fetch_add(1, Ordering::SeqCst);
                let Ok(server) = TcpStream::connect(upstream).await else {
                    continue;
                };
                let dead = Arc::new(AtomicBool::new(f.load(Ordering::SeqCst)));
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::spawn(pipe(cr, sw, f.clone(), dead.clone()));
                tokio::spawn(pipe(sr, cw, f.clone(), dead));
            }
        });
        BlackholeProxy {
            addr,
            frozen,
            connections,
        }
    }

    pub fn freeze(&self) {
        self.frozen.store(true, Ordering::SeqCst);
    }

    pub fn thaw(&self) {
        self.frozen.store(false, Ordering::SeqCst);
    }
}

async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    frozen: Arc<AtomicBool>,
    dead: Arc<AtomicBool>,
) {
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
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    // Keep a blackholed connection open: a vanished peer sends no FIN.
    if dead.load(Ordering::SeqCst) {
        std::future::pending::<()>().await;
    }
}
