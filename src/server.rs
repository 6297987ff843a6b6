//! The client-facing listener: accept loop, per-connection tasks, graceful drain.
//!
//! HTTP/1.1 and HTTP/2 cleartext share one port (hyper-util's auto server sniffs the preface). The
//! server refuses oversized request heads with 431 and closes connections whose headers do not arrive
//! within `timeouts.header_read` (slowloris). On shutdown it stops accepting at once, lets every
//! in-flight request — streams and upgraded connections included — finish within the grace period, then
//! returns.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::proxy::Proxy;
use crate::proxy::WorkerPath;
use crate::readiness::Readiness;

/// A listener that could not be opened.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen for {what} on {addr}: {source}")]
pub struct BindError {
    pub what: String,
    pub addr: SocketAddr,
    pub source: std::io::Error,
}

/// Connection-level settings of the client-facing server.
#[derive(Clone, Debug)]
pub struct ServerSettings {
    pub header_read_timeout: Duration,
    pub max_header_bytes: usize,
    pub grace: Duration,
}

impl ServerSettings {
    pub fn from_config(config: &Config) -> Self {
        ServerSettings {
            header_read_timeout: config.timeouts.header_read.get(),
            max_header_bytes: config.limits.max_header_bytes,
            grace: config.shutdown.grace.get(),
        }
    }
}

fn builder(settings: &ServerSettings) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(settings.header_read_timeout)
        // The read buffer bounds the request head: a larger head is answered with 431.
        .max_buf_size(settings.max_header_bytes)
        .keep_alive(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(settings.max_header_bytes).unwrap_or(u32::MAX))
        .keep_alive_interval(Some(Duration::from_secs(30)))
        .keep_alive_timeout(Duration::from_secs(10));
    builder
}

/// Serves client connections until `shutdown` is cancelled, then drains within the grace period.
pub async fn serve(
    listener: TcpListener,
    proxy: Arc<Proxy>,
    worker: WorkerPath,
    settings: ServerSettings,
    readiness: Arc<Readiness>,
    shutdown: CancellationToken,
) {
    let builder = builder(&settings);
    let worker = Arc::new(worker);
    let graceful = GracefulShutdown::new();
    loop {
        let accepted = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, client) = match accepted {
            Ok(accepted) => accepted,
            Err(err) => {
                // Usually EMFILE or a connection reset before accept; back off briefly instead of spinning.
                tracing::warn!(error = %err, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        if let Err(err) = stream.set_nodelay(true) {
            tracing::debug!(error = %err, "set_nodelay failed");
        }
        let proxy = Arc::clone(&proxy);
        let worker = Arc::clone(&worker);
        let service = service_fn(move |request: hyper::Request<Incoming>| {
            let proxy = Arc::clone(&proxy);
            let worker = Arc::clone(&worker);
            async move { Ok::<_, Infallible>(proxy.handle(&worker, request, client).await) }
        });
        let builder = builder.clone();
        let watcher = graceful.watcher();
        let header_read_timeout = settings.header_read_timeout;
        tokio::spawn(async move {
            if let Err(why) = await_protocol(&stream, header_read_timeout).await {
                tracing::debug!(client = %client, why, "client connection closed before its first request");
                return;
            }
            let connection = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
            if let Err(err) = watcher.watch(connection).await {
                tracing::debug!(client = %client, error = %err, "client connection ended with an error");
            }
        });
    }
    // Unready first, so the Service stops sending new clients while the drain runs.
    readiness.set_draining();
    drop(listener);
    drain(graceful, &proxy, settings.grace).await;
}

/// The HTTP/2 connection preface; anything else is taken for HTTP/1.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Waits, within `limit`, until the client has sent enough to tell HTTP/1 from HTTP/2.
///
/// hyper-util's auto server reads up to 24 bytes to make that choice and puts no deadline on it, and
/// hyper's own header-read timeout only starts after it; without this bound a client that connects and
/// sends nothing (or half a preface) would hold a socket and a task forever.
async fn await_protocol(
    stream: &tokio::net::TcpStream,
    limit: Duration,
) -> Result<(), &'static str> {
    let mut buf = [0u8; H2_PREFACE.len()];
    let sniff = async {
        loop {
            let n = stream.peek(&mut buf).await.map_err(|_| "read error")?;
            if n == 0 {
                return Err("closed by the client");
            }
            if n == buf.len() || buf[..n] != H2_PREFACE[..n] {
                return Ok(());
            }
            // A partial HTTP/2 preface: peek returns at once while those bytes sit unread, so wait a little
            // for the rest instead of spinning.
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(limit, sniff)
        .await
        .unwrap_or(Err("no request head within timeouts.header_read"))
}

async fn drain(graceful: GracefulShutdown, proxy: &Proxy, grace: Duration) {
    let upgrades = proxy.upgrades();
    upgrades.close();
    tracing::info!(
        grace = %humantime::format_duration(grace),
        upgraded = upgrades.len(),
        "stopped accepting; draining in-flight requests"
    );
    let everything = async {
        graceful.shutdown().await;
        upgrades.wait().await;
    };
    match tokio::time::timeout(grace, everything).await {
        Ok(()) => tracing::info!("drained: every in-flight request finished"),
        Err(_) => tracing::warn!(
            upgraded = upgrades.len(),
            "grace period over; closing the connections still open"
        ),
    }
}

/// Binds a listener, with an error that names the address and what it was for.
pub async fn bind(addr: SocketAddr, what: &str) -> Result<TcpListener, BindError> {
    TcpListener::bind(addr).await.map_err(|source| BindError {
        what: what.to_owned(),
        addr,
        source,
    })
}

/// Binds `count` listening sockets on one address with SO_REUSEPORT, one per worker thread; the kernel
/// spreads new connections over them. Port 0 is resolved by the first bind and reused by the rest.
pub fn bind_workers(
    addr: SocketAddr,
    count: usize,
    what: &str,
) -> Result<Vec<std::net::TcpListener>, BindError> {
    let failed = |addr, source| BindError {
        what: what.to_owned(),
        addr,
        source,
    };
    let mut listeners = Vec::with_capacity(count);
    let mut addr = addr;
    for _ in 0..count.max(1) {
        let socket = socket2::Socket::new(
            socket2::Domain::for_address(addr),
            socket2::Type::STREAM,
            Some(socket2::Protocol::TCP),
        )
        .map_err(|err| failed(addr, err))?;
        socket
            .set_reuse_address(true)
            .map_err(|err| failed(addr, err))?;
        socket
            .set_reuse_port(true)
            .map_err(|err| failed(addr, err))?;
        socket
            .set_nonblocking(true)
            .map_err(|err| failed(addr, err))?;
        socket.bind(&addr.into()).map_err(|err| failed(addr, err))?;
        socket.listen(1024).map_err(|err| failed(addr, err))?;
        let listener: std::net::TcpListener = socket.into();
        addr = listener.local_addr().map_err(|err| failed(addr, err))?;
        listeners.push(listener);
    }
    Ok(listeners)
}

/// The address a listener is bound to (the real port when the configuration asked for port 0).
pub fn local_addr(listener: &TcpListener, configured: SocketAddr) -> SocketAddr {
    listener.local_addr().unwrap_or(configured)
}
