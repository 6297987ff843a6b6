//! One worker's kept-alive connections to the endpoints, and the requests sent over them; how a
//! connection is made (TCP, tailscaled's proxy, TLS) is the connector's business (`upstream`).
//!
//! Hand-written on hyper's connection API (`hyper::client::conn`) instead of hyper-util's pooled
//! client, because that client pays per request for what tongs never needs: a lazily built connect
//! future (cloning the connector) raced against every checkout, a boxed send, and for HTTP/1 a task
//! spawned per response to wait until its connection is ready again. On hyper's connections, tongs
//! spends about 10 % less CPU per request under `benches/load.sh` (`benches/RESULTS.md`). Here:
//! - each worker owns a `Connections`, used by its requests and heartbeats, all on its thread: the lock
//!   is not contended;
//! - an HTTP/1 connection goes back to its endpoint's idle list as soon as hyper is done with the
//!   message on it, at the latest when its response body ends: the guard lives in the body
//!   ([`ResponseBody`]); a body dropped before hyper read its end closes the connection;
//! - an HTTP/2 connection (an `https://` endpoint that offers h2 by ALPN) is shared by every request
//!   to that endpoint;
//! - a request refused by a reused connection before any of it was sent (the endpoint closed the
//!   idle connection as the request left) goes out again on another connection;
//! - idle connections are closed after `timeouts.idle` by a sweeper on the worker's runtime, at most
//!   `upstream.pool_max_idle_per_endpoint` kept per endpoint.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::FutureExt;
use http::header::{HOST, HeaderValue};
use http::uri::{Authority, Scheme, Uri};
use http::{Request, Response};
use hyper::body::{Body as _, Frame, Incoming, SizeHint};
use hyper::client::conn::{http1, http2};
use hyper_util::client::legacy::connect::Connection;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tower::Service;

use http_body_util::combinators::UnsyncBoxBody;

use super::BoxError;

/// The request body sent to an endpoint (the client's body, possibly wrapped in a size limit).
pub type UpstreamBody = UnsyncBoxBody<Bytes, BoxError>;

/// Why a request got no response from its endpoint.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// No connection could be made (TCP, tailscaled's proxy, or TLS).
    #[error("no connection to the endpoint")]
    Connect(#[source] BoxError),
    /// A connection was made, but the HTTP exchange on it failed before the response's head.
    #[error("the HTTP exchange with the endpoint failed")]
    Http(#[source] hyper::Error),
    /// The request's URI names no scheme or authority: a caller's bug, not the endpoint's.
    #[error("the request's URI names no endpoint")]
    NoEndpoint,
}

impl SendError {
    /// Whether no connection was made: nothing of the request reached the endpoint.
    pub fn is_connect(&self) -> bool {
        matches!(self, SendError::Connect(_))
    }
}

/// The connections of one worker, by endpoint, made by `C`.
pub struct Connections<C> {
    shared: Arc<Shared>,
    connector: C,
    h1: http1::Builder,
    h2: http2::Builder<TokioExecutor>,
}

/// What an HTTP/1 connection to a node reads into at a time, and so the largest answer head a node may
/// send (nginx's `proxy_buffer_size` is 4 or 8 KiB; a model server's heads are a few hundred bytes).
/// A fixed size, not hyper's default: that buffer starts at 8 KiB but doubles on every read that fills
/// it, up to about 400 KiB, and a replica behind on thousands of streams, whose nodes' events piled up
/// in the sockets, filled every read: the buffers grew and each event handed on kept its buffer alive.
/// 5,000 chat streams peaked at 839 MiB with it, 264 MiB without (`benches/RESULTS.md`, "Long
/// streams"). A long answer takes more reads of 8 KiB, as nginx's do.
const NODE_BUFFER_BYTES: usize = 8 * 1024;

struct Shared {
    idle: Mutex<HashMap<Key, Idle>>,
    idle_timeout: Duration,
    max_idle: usize,
    sweeping: AtomicBool,
}

/// An endpoint as its connections are keyed: scheme and authority.
#[derive(Clone, PartialEq, Eq, Hash)]
struct Key {
    scheme: Scheme,
    authority: Authority,
}

#[derive(Default)]
struct Idle {
    /// Free HTTP/1 connections, the most recently used last, each with when it was freed.
    h1: Vec<(http1::SendRequest<UpstreamBody>, Instant)>,
    /// The endpoint's HTTP/2 connection, shared, with when it was last used.
    h2: Option<(http2::SendRequest<UpstreamBody>, Instant)>,
}

enum Sender {
    H1(http1::SendRequest<UpstreamBody>),
    H2(http2::SendRequest<UpstreamBody>),
}

impl<C> Connections<C>
where
    C: Service<Uri> + Clone,
    C::Response: hyper::rt::Read + hyper::rt::Write + Connection + Unpin + Send + 'static,
    C::Error: Into<BoxError>,
{
    pub fn new(connector: C, idle_timeout: Duration, max_idle: usize) -> Connections<C> {
        let mut h2 = http2::Builder::new(TokioExecutor::new());
        h2.timer(TokioTimer::new());
        let mut h1 = http1::Builder::new();
        h1.read_buf_exact_size(Some(NODE_BUFFER_BYTES));
        Connections {
            shared: Arc::new(Shared {
                idle: Mutex::new(HashMap::new()),
                idle_timeout,
                max_idle,
                sweeping: AtomicBool::new(false),
            }),
            connector,
            h1,
            h2,
        }
    }

    /// Sends `request` to the endpoint its (absolute) URI names, over a free connection or a new one.
    pub async fn send(
        &self,
        mut request: Request<UpstreamBody>,
    ) -> Result<Response<ResponseBody>, SendError> {
        let (Some(scheme), Some(authority)) = (request.uri().scheme(), request.uri().authority())
        else {
            return Err(SendError::NoEndpoint);
        };
        let key = Key {
            scheme: scheme.clone(),
            authority: authority.clone(),
        };
        let path = request
            .uri()
            .path_and_query()
            .map_or_else(|| "/".parse().expect("a valid path"), Clone::clone);
        loop {
            let (sender, reused) = match self.shared.checkout(&key) {
                Some(sender) => (sender, true),
                None => (Box::pin(self.connect(&key)).await?, false),
            };
            match sender {
                Sender::H1(mut sender) => {
                    if !request.headers().contains_key(HOST) {
                        request.headers_mut().insert(HOST, host(&key)?);
                    }
                    *request.uri_mut() = Uri::from(path.clone());
                    match sender.try_send_request(request).await {
                        Ok(response) => {
                            let back = GiveBack {
                                sender,
                                key,
                                shared: Arc::downgrade(&self.shared),
                            };
                            let mut response =
                                response.map(|body| ResponseBody::new(body, Some(back)));
                            response.body_mut().give_back_if_free();
                            return Ok(response);
                        }
                        Err(mut err) => match err.take_message() {
                            Some(back) if reused => request = back,
                            _ => return Err(SendError::Http(err.into_error())),
                        },
                    }
                }
                Sender::H2(mut sender) => {
                    *request.uri_mut() = absolute(&key, &path)?;
                    match sender.try_send_request(request).await {
                        Ok(response) => {
                            return Ok(response.map(|body| ResponseBody::new(body, None)));
                        }
                        Err(mut err) => match err.take_message() {
                            Some(back) if reused => request = back,
                            _ => return Err(SendError::Http(err.into_error())),
                        },
                    }
                }
            }
        }
    }

    /// A new connection to `key`'s endpoint, HTTP/2 when TLS negotiated it, its task spawned on the
    /// current runtime. An HTTP/2 connection is also offered to the requests that follow.
    async fn connect(&self, key: &Key) -> Result<Sender, SendError> {
        let uri = absolute(key, &"/".parse().expect("a valid path"))?;
        let mut connector = self.connector.clone();
        let failed = |err: C::Error| SendError::Connect(err.into());
        std::future::poll_fn(|cx| connector.poll_ready(cx))
            .await
            .map_err(failed)?;
        let io = connector.call(uri).await.map_err(failed)?;
        if io.connected().is_negotiated_h2() {
            let (mut sender, connection) = self.h2.handshake(io).await.map_err(SendError::Http)?;
            tokio::spawn(connection.map(|ended| {
                if let Err(err) = ended {
                    tracing::debug!(error = %err, "HTTP/2 connection to an endpoint ended");
                }
            }));
            sender.ready().await.map_err(SendError::Http)?;
            self.shared.share_h2(key, &sender);
            Ok(Sender::H2(sender))
        } else {
            let (mut sender, connection) = self.h1.handshake(io).await.map_err(SendError::Http)?;
            // `map`, not an async block: the block would hold the connection twice (captured, then
            // awaited), a few KiB more per connection.
            tokio::spawn(connection.with_upgrades().map(|ended| {
                if let Err(err) = ended {
                    tracing::debug!(error = %err, "HTTP/1 connection to an endpoint ended");
                }
            }));
            sender.ready().await.map_err(SendError::Http)?;
            Ok(Sender::H1(sender))
        }
    }
}

/// `Host` for an HTTP/1 request that names none: the authority without a default port.
fn host(key: &Key) -> Result<HeaderValue, SendError> {
    let default = if key.scheme == Scheme::HTTPS { 443 } else { 80 };
    let value = match key.authority.port_u16() {
        Some(port) if port != default => key.authority.as_str(),
        _ => key.authority.host(),
    };
    HeaderValue::from_str(value).map_err(|_| SendError::NoEndpoint)
}

fn absolute(key: &Key, path: &http::uri::PathAndQuery) -> Result<Uri, SendError> {
    Uri::builder()
        .scheme(key.scheme.clone())
        .authority(key.authority.clone())
        .path_and_query(path.clone())
        .build()
        .map_err(|_| SendError::NoEndpoint)
}

impl Shared {
    /// A free connection to `key`'s endpoint: its HTTP/2 one, else its most recently freed HTTP/1
    /// one that is ready; closed ones are dropped on the way.
    fn checkout(&self, key: &Key) -> Option<Sender> {
        let mut idle = self.idle.lock().expect("pool lock");
        let entry = idle.get_mut(key)?;
        if let Some((sender, used)) = &mut entry.h2 {
            if sender.is_ready() {
                *used = Instant::now();
                return Some(Sender::H2(sender.clone()));
            }
            entry.h2 = None;
        }
        // A connection given back as its body ended may not have turned ready yet: it stays.
        let mut at = entry.h1.len();
        while at > 0 {
            at -= 1;
            let sender = &entry.h1[at].0;
            if sender.is_ready() {
                return Some(Sender::H1(entry.h1.remove(at).0));
            }
            if sender.is_closed() {
                entry.h1.remove(at);
            }
        }
        None
    }

    fn share_h2(self: &Arc<Self>, key: &Key, sender: &http2::SendRequest<UpstreamBody>) {
        if self.max_idle == 0 {
            return;
        }
        let mut idle = self.idle.lock().expect("pool lock");
        let entry = idle.entry(key.clone()).or_default();
        if entry
            .h2
            .as_ref()
            .is_none_or(|(shared, _)| !shared.is_ready())
        {
            entry.h2 = Some((sender.clone(), Instant::now()));
        }
        drop(idle);
        self.sweep_later();
    }

    fn give_back(self: &Arc<Self>, key: Key, sender: http1::SendRequest<UpstreamBody>) {
        if self.max_idle == 0 || sender.is_closed() {
            return;
        }
        let mut idle = self.idle.lock().expect("pool lock");
        let entry = idle.entry(key).or_default();
        if entry.h1.len() >= self.max_idle {
            return;
        }
        entry.h1.push((sender, Instant::now()));
        drop(idle);
        self.sweep_later();
    }

    /// Starts the sweeper the first time a connection is kept, on the runtime that made it.
    fn sweep_later(self: &Arc<Self>) {
        if self.sweeping.swap(true, Ordering::Relaxed) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.sweeping.store(false, Ordering::Relaxed);
            return;
        };
        let period = self.idle_timeout.max(Duration::from_millis(100));
        let shared = Arc::downgrade(self);
        runtime.spawn(sweep(shared, period));
    }

    /// Closes connections free for longer than the idle timeout, and forgets endpoints left with none.
    fn sweep(&self, now: Instant) {
        let mut idle = self.idle.lock().expect("pool lock");
        idle.retain(|_, entry| {
            entry.h1.retain(|(sender, since)| {
                !sender.is_closed() && now.duration_since(*since) < self.idle_timeout
            });
            if entry.h2.as_ref().is_some_and(|(sender, used)| {
                sender.is_closed() || now.duration_since(*used) >= self.idle_timeout
            }) {
                entry.h2 = None;
            }
            !entry.h1.is_empty() || entry.h2.is_some()
        });
    }
}

/// The sweeper: ends with the pool.
async fn sweep(shared: Weak<Shared>, period: Duration) {
    let mut ticks = tokio::time::interval(period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await;
    loop {
        ticks.tick().await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        shared.sweep(Instant::now());
    }
}

/// An HTTP/1 connection on its way back to the pool.
struct GiveBack {
    sender: http1::SendRequest<UpstreamBody>,
    key: Key,
    shared: Weak<Shared>,
}

/// An endpoint's response body. An HTTP/1 connection goes back to the pool once hyper is done with
/// the message on it (often before tongs has read the body: a short one comes with the head) or the
/// body has ended; a body dropped before hyper read its end takes its connection with it (hyper
/// closes it).
pub struct ResponseBody {
    inner: Incoming,
    back: Option<GiveBack>,
}

impl ResponseBody {
    fn new(inner: Incoming, back: Option<GiveBack>) -> ResponseBody {
        ResponseBody { inner, back }
    }

    /// Gives the connection back as soon as hyper is done with the message on it: a short body is
    /// often read whole (into this body's channel) with the head, before tongs reads any of it.
    fn give_back_if_free(&mut self) {
        if self
            .back
            .as_ref()
            .is_some_and(|back| back.sender.is_ready())
        {
            self.give_back();
        }
    }

    fn give_back(&mut self) {
        if let Some(GiveBack {
            sender,
            key,
            shared,
        }) = self.back.take()
            && let Some(shared) = shared.upgrade()
        {
            shared.give_back(key, sender);
        }
    }
}

/// A body with no connection to give back (HTTP/2, or made by a test's own client).
impl From<Incoming> for ResponseBody {
    fn from(inner: Incoming) -> ResponseBody {
        ResponseBody::new(inner, None)
    }
}

impl hyper::body::Body for ResponseBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => this.give_back(),
            Poll::Ready(Some(Ok(_))) if this.inner.is_end_stream() => this.give_back(),
            Poll::Ready(Some(Ok(_))) => this.give_back_if_free(),
            Poll::Ready(Some(Err(_))) => this.back = None,
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for ResponseBody {
    fn drop(&mut self) {
        // A body with nothing in it (a 204, a HEAD's answer) may never be polled; one hyper has read
        // whole may be dropped unread (a failed attempt's answer). Either leaves its connection free.
        if self.inner.is_end_stream() {
            self.give_back();
        } else {
            self.give_back_if_free();
        }
    }
}

impl std::fmt::Debug for ResponseBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseBody").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use http_body_util::combinators::BoxBody;
    use http_body_util::{BodyExt, Empty, Full, StreamBody};
    use hyper_rustls::HttpsConnector;
    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::rt::TokioIo;
    use tokio::net::TcpListener;

    use super::*;

    /// An HTTP/1.1 origin on a real socket, answering as [`answer`] does.
    /// Counts the connections it accepted and those still open.
    struct Origin {
        port: u16,
        accepted: Arc<AtomicUsize>,
        open: Arc<AtomicUsize>,
    }

    async fn origin() -> Origin {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = Arc::new(AtomicUsize::new(0));
        let open = Arc::new(AtomicUsize::new(0));
        let (counted, still) = (Arc::clone(&accepted), Arc::clone(&open));
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                counted.fetch_add(1, Ordering::SeqCst);
                still.fetch_add(1, Ordering::SeqCst);
                let still = Arc::clone(&still);
                tokio::spawn(async move {
                    let service =
                        hyper::service::service_fn(|request: Request<Incoming>| async move {
                            Ok::<_, std::convert::Infallible>(answer(request.uri().path()))
                        });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                    still.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        Origin {
            port,
            accepted,
            open,
        }
    }

    /// `/empty`: 204; `/stream`: `ok` in three chunks of a chunked body; `/slow`: a chunked body
    /// that never ends; anything else: `ok`.
    fn answer(path: &str) -> Response<BoxBody<Bytes, std::convert::Infallible>> {
        let mut response = Response::new(Full::new(Bytes::from_static(b"ok")).boxed());
        if path == "/empty" {
            *response.body_mut() = Full::default().boxed();
            *response.status_mut() = http::StatusCode::NO_CONTENT;
        } else if path == "/stream" {
            let chunks =
                ["o", "k", ""].map(|chunk| Ok(Frame::data(Bytes::from_static(chunk.as_bytes()))));
            *response.body_mut() = StreamBody::new(futures::stream::iter(chunks)).boxed();
        } else if path == "/slow" {
            let first = futures::stream::iter([Ok(Frame::data(Bytes::from_static(b"o")))]);
            let never = futures::stream::pending();
            *response.body_mut() = StreamBody::new(futures::StreamExt::chain(first, never)).boxed();
        }
        response
    }

    fn pool(idle_timeout: Duration, max_idle: usize) -> Connections<HttpsConnector<HttpConnector>> {
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(
                rustls::ClientConfig::builder_with_provider(Arc::new(
                    rustls::crypto::ring::default_provider(),
                ))
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(rustls::RootCertStore::empty())
                .with_no_client_auth(),
            )
            .https_or_http()
            .enable_all_versions()
            .wrap_connector(http);
        Connections::new(connector, idle_timeout, max_idle)
    }

    fn get(port: u16, path: &str) -> Request<UpstreamBody> {
        let body = Empty::new().map_err(|never| match never {}).boxed_unsync();
        let mut request = Request::new(body);
        *request.uri_mut() = format!("http://127.0.0.1:{port}{path}").parse().unwrap();
        request
    }

    fn idle_count<C>(pool: &Connections<C>) -> usize {
        let idle = pool.shared.idle.lock().unwrap();
        idle.values()
            .map(|idle| idle.h1.len() + usize::from(idle.h2.is_some()))
            .sum()
    }

    /// Whether hyper is done with the exchange behind `response`: its connection was given back
    /// already, or is ready for the next request.
    fn hyper_is_done(response: &Response<ResponseBody>) -> bool {
        let back = response.body().back.as_ref();
        back.is_none_or(|back| back.sender.is_ready())
    }

    /// Polls `done` every 10 ms until it holds or 10 s have passed.
    async fn eventually(what: &str, done: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(Instant::now() < deadline, "still not {what} after 10 s");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn a_connection_goes_back_when_its_body_ends_and_serves_the_next_request() {
        let origin = origin().await;
        let pool = pool(Duration::from_secs(90), 8);
        for path in ["/a", "/empty", "/b", "/empty", "/c"] {
            let response = pool.send(get(origin.port, path)).await.unwrap();
            if path == "/empty" {
                // Never polled: the body is empty, and dropping it frees the connection.
                assert_eq!(response.status(), 204);
                drop(response);
            } else {
                let body = response.into_body().collect().await.unwrap().to_bytes();
                assert_eq!(&body[..], b"ok");
            }
            assert_eq!(idle_count(&pool), 1, "after {path}");
        }
        assert_eq!(origin.accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn streamed_answers_free_their_connection_for_the_next_request_at_once() {
        let origin = origin().await;
        let pool = Arc::new(pool(Duration::from_secs(90), 8));
        let loops = (0..4).map(|_| {
            let pool = Arc::clone(&pool);
            let port = origin.port;
            tokio::spawn(async move {
                for _ in 0..50 {
                    let response = pool.send(get(port, "/stream")).await.unwrap();
                    let body = response.into_body().collect().await.unwrap().to_bytes();
                    assert_eq!(&body[..], b"ok");
                }
            })
        });
        for done in futures::future::join_all(loops).await {
            done.unwrap();
        }
        // Each of the 4 loops needs a connection of its own at most: none is opened because the
        // one just given back had not turned ready yet.
        let accepted = origin.accepted.load(Ordering::SeqCst);
        assert!(
            accepted <= 4,
            "{accepted} connections for 4 concurrent loops"
        );
    }

    #[tokio::test]
    async fn a_short_answer_frees_its_connection_before_its_body_is_read() {
        let origin = origin().await;
        let pool = pool(Duration::from_secs(90), 8);
        let first = pool.send(get(origin.port, "/a")).await.unwrap();
        // hyper reads a short body with its head; once its connection task has run, the
        // connection is free although nobody read the body yet.
        eventually("free", || hyper_is_done(&first)).await;
        let second = pool.send(get(origin.port, "/b")).await.unwrap();
        assert_eq!(origin.accepted.load(Ordering::SeqCst), 1);
        for response in [first, second] {
            let body = response.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(&body[..], b"ok");
        }
        // Dropped unread, but read whole by hyper: the connection stays.
        let unread = pool.send(get(origin.port, "/c")).await.unwrap();
        eventually("free", || hyper_is_done(&unread)).await;
        drop(unread);
        pool.send(get(origin.port, "/d")).await.unwrap();
        assert_eq!(origin.accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_body_dropped_before_its_end_takes_its_connection_with_it() {
        let origin = origin().await;
        let pool = pool(Duration::from_secs(90), 8);
        let response = pool.send(get(origin.port, "/slow")).await.unwrap();
        drop(response);
        assert_eq!(idle_count(&pool), 0);
        let response = pool.send(get(origin.port, "/b")).await.unwrap();
        response.into_body().collect().await.unwrap();
        assert_eq!(origin.accepted.load(Ordering::SeqCst), 2);
        eventually("closed", || origin.open.load(Ordering::SeqCst) == 1).await;
    }

    #[tokio::test]
    async fn concurrent_requests_use_connections_of_their_own_and_keep_at_most_the_limit() {
        let origin = origin().await;
        let pool = pool(Duration::from_secs(90), 2);
        let sends = (0..4).map(|_| pool.send(get(origin.port, "/a")));
        let responses = futures::future::join_all(sends).await;
        assert_eq!(origin.accepted.load(Ordering::SeqCst), 4);
        for response in responses {
            response.unwrap().into_body().collect().await.unwrap();
        }
        assert_eq!(idle_count(&pool), 2);
        eventually("closed", || origin.open.load(Ordering::SeqCst) == 2).await;
    }

    #[tokio::test]
    async fn idle_connections_close_after_the_idle_timeout() {
        let origin = origin().await;
        let pool = pool(Duration::from_millis(200), 8);
        let response = pool.send(get(origin.port, "/a")).await.unwrap();
        response.into_body().collect().await.unwrap();
        assert_eq!(idle_count(&pool), 1);
        eventually("swept", || idle_count(&pool) == 0).await;
        eventually("closed", || origin.open.load(Ordering::SeqCst) == 0).await;
        // The endpoint is still served, on a new connection.
        let response = pool.send(get(origin.port, "/a")).await.unwrap();
        response.into_body().collect().await.unwrap();
        assert_eq!(origin.accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_refused_connection_is_a_connect_error_and_a_relative_uri_no_endpoint() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        let pool = pool(Duration::from_secs(90), 8);
        let err = pool.send(get(port, "/a")).await.unwrap_err();
        assert!(err.is_connect(), "{err:?}");
        assert_eq!(crate::upstream::connect_cause(&err), "connection refused");

        let mut request = get(port, "/a");
        *request.uri_mut() = "/a".parse().unwrap();
        let err = pool.send(request).await.unwrap_err();
        assert!(matches!(err, SendError::NoEndpoint), "{err:?}");
    }
}
