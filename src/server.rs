//! The client-facing listener: accept loop, per-connection tasks, graceful drain.
//!
//! HTTP/1.1 and HTTP/2 cleartext share one port ([`sniff`] reads the preface). The
//! server refuses oversized request heads with 431 and closes connections whose headers do not arrive
//! within `timeouts.header_read` (slowloris). On shutdown it stops accepting at once, lets every
//! in-flight request — streams and upgraded connections included — finish within the grace period, then
//! returns.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Config;
use crate::http::ProxyBody;
use crate::proxy::WorkerPath;
use crate::readiness::Readiness;
use crate::route::Router;

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

/// The client port's connection builders, one per HTTP version.
///
/// hyper's own, not hyper-util's auto server: [`sniff`] has already read enough of the preface to
/// tell the versions apart, and the auto server would read it again and hand it to hyper in a short
/// first read, after which hyper wants another full 8 KiB free behind those bytes and doubles its
/// read buffer to 16 KiB: 8 KiB more for every client connection, idle keep-alive ones included
/// (`benches/RESULTS.md`, where an SSE stream's memory goes).
#[derive(Clone)]
struct Builders {
    http1: http1::Builder,
    http2: http2::Builder<TokioExecutor>,
}

fn builders(settings: &ServerSettings) -> Builders {
    let mut http1 = http1::Builder::new();
    http1
        .timer(TokioTimer::new())
        .header_read_timeout(settings.header_read_timeout)
        // The read buffer bounds the request head: a larger head is answered with 431.
        .max_buf_size(settings.max_header_bytes)
        .keep_alive(true);
    let mut http2 = http2::Builder::new(TokioExecutor::new());
    http2
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(settings.max_header_bytes).unwrap_or(u32::MAX))
        .keep_alive_interval(Some(Duration::from_secs(30)))
        .keep_alive_timeout(Duration::from_secs(10));
    Builders { http1, http2 }
}

impl Builders {
    /// Serves one sniffed connection with the HTTP version its preface named (upgrades allowed on
    /// HTTP/1) until it ends; once `closing` is cancelled, in-flight requests finish and no new one
    /// is read.
    async fn serve<S, B>(
        &self,
        stream: Prefixed<tokio::net::TcpStream>,
        service: S,
        closing: &CancellationToken,
    ) -> Result<(), hyper::Error>
    where
        S: hyper::service::HttpService<Incoming, ResBody = B> + Send + 'static,
        S::Future: Send + 'static,
        S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
        B: hyper::body::Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        if stream.is_http2() {
            let connection = self.http2.serve_connection(TokioIo::new(stream), service);
            until_drained(connection, closing, |c| c.graceful_shutdown()).await
        } else {
            let connection = self
                .http1
                .serve_connection(TokioIo::new(stream), service)
                .with_upgrades();
            until_drained(connection, closing, |c| c.graceful_shutdown()).await
        }
    }
}

/// The size of a request's head as a client sent it on HTTP/1: the request line, and each header as
/// `name: value` and its line end (HTTP/2's pseudo-headers stand for the request line).
fn head_size<B>(request: &hyper::Request<B>) -> usize {
    let line = request.method().as_str().len()
        + request
            .uri()
            .path_and_query()
            .map_or(1, |path| path.as_str().len())
        + request.uri().authority().map_or(0, |a| a.as_str().len())
        + " HTTP/1.1\r\n ".len();
    request.headers().iter().fold(line, |size, (name, value)| {
        size + name.as_str().len() + value.len() + 4
    })
}

/// 431 for a head over `limits.max_header_bytes`. hyper bounds only its read buffer, which grows in
/// steps and holds a head somewhat over the limit (and HTTP/2 only advertises the limit to the
/// client), so the limit the documentation promises is counted here, before anything else reads the
/// request.
fn head_too_large<B>(
    request: &hyper::Request<B>,
    limit: usize,
) -> Option<hyper::Response<ProxyBody>> {
    let size = head_size(request);
    if size <= limit {
        return None;
    }
    let request_id = crate::http::headers::request_id(request.headers());
    tracing::info!(
        size,
        limit,
        "request head over limits.max_header_bytes; answered 431"
    );
    Some(crate::http::ProxyError::HeadTooLarge { size, limit }.into_response(&request_id))
}

/// Runs `connection` to its end; once `closing` is cancelled, `shut_down` tells it to finish what is in
/// flight and read nothing new (hyper's two connection types each have their own `graceful_shutdown`).
async fn until_drained<C: Future>(
    connection: C,
    closing: &CancellationToken,
    shut_down: fn(Pin<&mut C>),
) -> C::Output {
    let mut connection = std::pin::pin!(connection);
    tokio::select! {
        ended = connection.as_mut() => return ended,
        () = closing.cancelled() => shut_down(connection.as_mut()),
    }
    connection.await
}

/// Serves client connections until `shutdown` is cancelled, then drains within the grace period.
pub async fn serve(
    listener: TcpListener,
    router: Arc<Router>,
    worker: WorkerPath,
    settings: ServerSettings,
    readiness: Arc<Readiness>,
    shutdown: CancellationToken,
) {
    let builders = builders(&settings);
    let worker = Arc::new(worker);
    // Cancelled when the drain starts; every connection task is tracked until it ends.
    let closing = CancellationToken::new();
    let connections = TaskTracker::new();
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
        let router = Arc::clone(&router);
        let worker = Arc::clone(&worker);
        // A plain hyper service, not a tower stack as on the admin port: the client port's path is
        // measured per request against nginx, and what tower-http's layers would do here (timeouts,
        // header limits, tracing) the request path does itself with no per-request boxing.
        let max_head = settings.max_header_bytes;
        let service = service_fn(move |request: hyper::Request<Incoming>| {
            let router = Arc::clone(&router);
            let worker = Arc::clone(&worker);
            async move {
                if let Some(refused) = head_too_large(&request, max_head) {
                    return Ok::<_, Infallible>(refused);
                }
                Ok(router.handle(&worker, request, client).await)
            }
        });
        let builders = builders.clone();
        let closing = closing.clone();
        let header_read_timeout = settings.header_read_timeout;
        connections.spawn(async move {
            // A connection still silent when the drain starts has no request to finish.
            let sniffed = tokio::select! {
                sniffed = sniff(stream, header_read_timeout) => sniffed,
                () = closing.cancelled() => Err("closed by the drain before its first request"),
            };
            let stream = match sniffed {
                Ok(stream) => stream,
                Err(why) => {
                    tracing::debug!(client = %client, why, "client connection closed before its first request");
                    return;
                }
            };
            if let Err(err) = builders.serve(stream, service, &closing).await {
                tracing::debug!(client = %client, error = %err, "client connection ended with an error");
            }
        });
    }
    // Unready first, so the Service stops sending new clients while the drain runs.
    readiness.set_draining();
    drop(listener);
    closing.cancel();
    connections.close();
    drain(&connections, &router, settings.grace).await;
}

/// The HTTP/2 connection preface; anything else is taken for HTTP/1.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Reads, within `limit`, until the client has sent enough to tell HTTP/1 from HTTP/2, and returns the
/// connection with those bytes put back in front ([`Prefixed::is_http2`] says which it was).
///
/// hyper's own header-read timeout only starts once hyper reads (and hyper-util's auto server, on the
/// admin port, reads up to 24 bytes to choose with no deadline); without this bound a client that
/// connects and sends nothing (or half a preface) would hold a socket and a task forever. The bytes are read out,
/// not peeked at: a peek returns at once while they sit unread, so waiting for the rest of a partial
/// preface would be a polling loop; a read sleeps until more arrives.
pub async fn sniff<I>(mut io: I, limit: Duration) -> Result<Prefixed<I>, &'static str>
where
    I: AsyncRead + Unpin,
{
    let mut head = [0u8; H2_PREFACE.len()];
    let read = async {
        let mut filled = 0;
        loop {
            let n = io
                .read(&mut head[filled..])
                .await
                .map_err(|_| "read error")?;
            if n == 0 {
                return Err("closed by the client");
            }
            filled += n;
            if filled == head.len() || head[..filled] != H2_PREFACE[..filled] {
                return Ok(filled);
            }
        }
    };
    let filled = tokio::time::timeout(limit, read)
        .await
        .unwrap_or(Err("no request head within timeouts.header_read"))?;
    Ok(Prefixed {
        head,
        start: 0,
        end: filled,
        io,
    })
}

/// A connection with the bytes [`sniff`] read from it put back in front of what it reads next.
///
/// hyper-util's auto server has the same thing (`Rewind`) but keeps it private; tokio's `Chain` only
/// reads, and joining a chained read half with the write half would cost a shared allocation per
/// connection. So this small wrapper is written out here.
#[derive(Debug)]
pub struct Prefixed<I> {
    head: [u8; H2_PREFACE.len()],
    /// The part of `head` not read yet.
    start: usize,
    end: usize,
    io: I,
}

impl<I> Prefixed<I> {
    /// Whether the client sent the whole HTTP/2 preface (anything else is HTTP/1).
    pub fn is_http2(&self) -> bool {
        self.head[..self.end] == *H2_PREFACE
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for Prefixed<I> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if this.start < this.end {
            let n = (this.end - this.start).min(buf.remaining());
            buf.put_slice(&this.head[this.start..this.start + n]);
            this.start += n;
            // And what follows, if it has arrived: the first read handing over only these bytes
            // would make hyper grow its read buffer (see `Builders`). Nothing yet, or an error, is
            // for the next read to find.
            if this.start == this.end && buf.remaining() > 0 {
                let _ = Pin::new(&mut this.io).poll_read(cx, buf);
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.io).poll_read(cx, buf)
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Prefixed<I> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

async fn drain(connections: &TaskTracker, router: &Router, grace: Duration) {
    let upgrades = router.upgrades();
    upgrades.close();
    tracing::info!(
        grace = %humantime::format_duration(grace),
        upgraded = upgrades.len(),
        "stopped accepting; draining in-flight requests"
    );
    let everything = async {
        connections.wait().await;
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
    // SO_REUSEPORT would let these sockets share the port with another process of the same user (a
    // second tongs started by mistake), which would then take half the connections. A plain bind first
    // fails if anyone listens there already.
    if addr.port() != 0 {
        let probe = socket2::Socket::new(
            socket2::Domain::for_address(addr),
            socket2::Type::STREAM,
            Some(socket2::Protocol::TCP),
        )
        .map_err(|err| failed(addr, err))?;
        probe
            .set_reuse_address(true)
            .map_err(|err| failed(addr, err))?;
        probe.bind(&addr.into()).map_err(|err| failed(addr, err))?;
    }
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

#[cfg(test)]
mod tests {
    use std::future::Future;

    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};
    use tokio::io::AsyncWriteExt;
    use tokio::net::{TcpListener, TcpStream};

    use super::*;

    #[test]
    fn a_port_another_process_listens_on_is_refused_even_with_reuse_port() {
        let first = bind_workers("127.0.0.1:0".parse().unwrap(), 2, "test").unwrap();
        let addr = first[0].local_addr().unwrap();
        let second = bind_workers(addr, 2, "test");
        assert!(second.is_err(), "a second set of listeners shared {addr}");
        drop(first);
        assert!(bind_workers(addr, 2, "test").is_ok(), "free again");
    }

    /// A connected pair: (the client's end, the server's accepted end).
    async fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        (client, server)
    }

    /// A client that stops inside the HTTP/2 preface costs one wakeup, not one every few
    /// milliseconds: the sniff is polled only when bytes arrive.
    #[tokio::test]
    async fn a_partial_preface_is_awaited_without_polling() {
        let (mut client, server) = pair().await;
        client.write_all(&H2_PREFACE[..10]).await.unwrap();
        let mut polls = 0u32;
        let mut sniff = std::pin::pin!(sniff(server, Duration::from_secs(10)));
        let counted = std::future::poll_fn(|cx| {
            polls += 1;
            sniff.as_mut().poll(cx)
        });
        // A hundred times the 5 ms a polling wait would sleep between looks.
        let waited = tokio::time::timeout(Duration::from_millis(500), counted).await;
        assert!(
            waited.is_err(),
            "the sniff waits for the rest of the preface"
        );
        assert!(
            polls <= 3,
            "the sniff was polled {polls} times while the client sent nothing"
        );

        // The rest arrives: the sniff ends, and every byte is there to read again, in order.
        client.write_all(&H2_PREFACE[10..]).await.unwrap();
        client.write_all(b"more").await.unwrap();
        let mut stream = tokio::time::timeout(Duration::from_secs(10), sniff)
            .await
            .expect("the sniff ends once the preface is complete")
            .expect("a complete preface");
        let mut replayed = vec![0u8; H2_PREFACE.len() + 4];
        stream.read_exact(&mut replayed).await.unwrap();
        assert_eq!(&replayed[..H2_PREFACE.len()], H2_PREFACE);
        assert_eq!(&replayed[H2_PREFACE.len()..], b"more");
    }

    #[tokio::test(start_paused = true)]
    async fn the_whole_sniff_is_bounded_by_header_read() {
        let (mut client, server) = pair().await;
        client.write_all(&H2_PREFACE[..10]).await.unwrap();
        let started = tokio::time::Instant::now();
        let outcome = sniff(server, Duration::from_secs(3)).await;
        assert_eq!(
            outcome.err(),
            Some("no request head within timeouts.header_read")
        );
        assert!(started.elapsed() >= Duration::from_secs(3));
    }

    /// Serves one connection the way [`serve`] does, answering every request with its HTTP version.
    async fn serve_one(stream: TcpStream) {
        let settings = ServerSettings {
            header_read_timeout: Duration::from_secs(10),
            max_header_bytes: 64 * 1024,
            grace: Duration::from_secs(1),
        };
        let stream = sniff(stream, settings.header_read_timeout).await.unwrap();
        let service = service_fn(|request: hyper::Request<Incoming>| async move {
            let version = format!("{:?}", request.version());
            Ok::<_, Infallible>(hyper::Response::new(Full::new(Bytes::from(version))))
        });
        let _ = builders(&settings)
            .serve(stream, service, &CancellationToken::new())
            .await;
    }

    /// Gives hyper's HTTP/2 client a connection whose preface the test has already sent by hand: the
    /// first 24 bytes the client writes are taken as written.
    struct PrefaceSent(TcpStream, usize);

    impl AsyncRead for PrefaceSent {
        fn poll_read(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<std::io::Result<()>> {
            Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
        }
    }

    impl AsyncWrite for PrefaceSent {
        fn poll_write(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<std::io::Result<usize>> {
            let this = self.get_mut();
            if this.1 > 0 {
                let skipped = this.1.min(buf.len());
                assert_eq!(
                    buf[..skipped],
                    H2_PREFACE[H2_PREFACE.len() - this.1..][..skipped]
                );
                this.1 -= skipped;
                return Poll::Ready(Ok(skipped));
            }
            Pin::new(&mut this.0).poll_write(cx, buf)
        }

        fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Pin::new(&mut self.get_mut().0).poll_flush(cx)
        }

        fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
        }
    }

    /// A pause the server sees: the first bytes arrive on their own, the rest later.
    async fn in_two_parts(client: &mut TcpStream, bytes: &[u8], at: usize) {
        client.write_all(&bytes[..at]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        client.write_all(&bytes[at..]).await.unwrap();
    }

    /// The first read after [`sniff`] hands over the sniffed bytes and what has arrived behind them in
    /// one go: hyper, given only the sniffed bytes first, grows its read buffer from 8 to 16 KiB.
    #[tokio::test]
    async fn the_first_read_after_the_sniff_carries_what_follows() {
        let (mut client, server) = tokio::io::duplex(4096);
        let request =
            b"POST /v1/completions HTTP/1.1\r\nhost: tongs\r\ncontent-length: 2\r\n\r\n{}";
        client.write_all(request).await.unwrap();
        let mut sniffed = sniff(server, Duration::from_secs(3)).await.unwrap();
        assert!(!sniffed.is_http2());
        let mut buf = vec![0u8; 1024];
        let n = sniffed.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], request.as_slice(), "one read, the whole request");

        // With nothing behind the sniffed bytes yet, they come alone and the rest follows later.
        let (mut client, server) = tokio::io::duplex(4096);
        client.write_all(H2_PREFACE).await.unwrap();
        let mut sniffed = sniff(server, Duration::from_secs(3)).await.unwrap();
        assert!(sniffed.is_http2());
        let n = sniffed.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], H2_PREFACE);
        client.write_all(b"rest").await.unwrap();
        let n = sniffed.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"rest");
    }

    #[tokio::test]
    async fn http2_is_served_after_a_preface_in_two_parts() {
        let (mut client, server) = pair().await;
        tokio::spawn(serve_one(server));
        in_two_parts(&mut client, H2_PREFACE, 10).await;
        let (mut sender, connection) = hyper::client::conn::http2::handshake::<_, _, Full<Bytes>>(
            TokioExecutor::new(),
            TokioIo::new(PrefaceSent(client, H2_PREFACE.len())),
        )
        .await
        .unwrap();
        tokio::spawn(connection);
        let request = hyper::Request::get("http://a/")
            .body(Full::default())
            .unwrap();
        let response = tokio::time::timeout(Duration::from_secs(10), sender.send_request(request))
            .await
            .unwrap()
            .unwrap();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, "HTTP/2.0");
    }

    #[tokio::test]
    async fn http1_is_served_after_a_first_byte_that_could_start_a_preface() {
        let (mut client, server) = pair().await;
        tokio::spawn(serve_one(server));
        // "P" begins both "POST" and the HTTP/2 preface.
        let request =
            b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
        in_two_parts(&mut client, request, 1).await;
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), client.read_to_end(&mut answer))
            .await
            .unwrap()
            .unwrap();
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.ends_with("HTTP/1.1"), "{answer}");
    }
}
