//! Shared helpers for the integration tests: a proxy on ephemeral ports, scriptable backends, clients,
//! one accept loop for every test server, and the fakes that stand in for services that cannot run
//! here: the Kubernetes API server ([`kube_api`]), the SaladCloud public API ([`salad_api`]) and a
//! Container Gateway that records the key it is sent ([`gateway`]).
//!
//! Everything runs over real sockets on 127.0.0.1 (or [::1]); nothing is mocked in-process.
//!
//! Each test binary (`tests/<area>/main.rs`) includes this folder with
//! `#[path = "../support/mod.rs"] mod support;`: Cargo compiles every test binary as a crate of its
//! own, and a module shared between them needs either that one path or a crate of its own.

#![allow(dead_code)]

pub mod gateway;
pub mod kube_api;
pub mod salad_api;
pub mod tls;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tongs::App;
use tongs::config::Config;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type TestBody = BoxBody<Bytes, BoxError>;

/// A proxy running in this process on ephemeral ports.
pub struct TestProxy {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub app_registry: Arc<tongs::registry::Registry>,
    pub app_queue: Arc<tongs::admission::Queue>,
    pub shutdown: CancellationToken,
    pub task: tokio::task::JoinHandle<()>,
}

impl TestProxy {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// Stops the proxy and waits for its drain to finish.
    pub async fn stop(self) {
        self.shutdown.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(30), self.task).await;
    }
}

/// Config text with the listeners on ephemeral loopback ports and the given endpoint URLs appended;
/// heartbeats and the reading of the nodes' metrics are off unless `extra_yaml` configures `health:` or
/// `signals:`.
pub fn config_with(extra_yaml: &str, endpoints: &[String]) -> Config {
    let mut text = String::from("listen: 127.0.0.1:0\nadmin: { listen: 127.0.0.1:0 }\n");
    // Heartbeats would add GET /health requests to every backend's count; tests that are about
    // heartbeats configure them themselves.
    if !extra_yaml.contains("health:") {
        text.push_str("health: { enabled: false }\n");
    }
    // The same for reading the nodes' own metrics (`GET /metrics`), for tests not about them.
    if !extra_yaml.contains("signals:") {
        text.push_str("signals: { enabled: false }\n");
    }
    text.push_str(extra_yaml);
    if !endpoints.is_empty() {
        text.push_str("\ndiscovery:\n  static:\n");
        for url in endpoints {
            text.push_str(&format!("    - url: {url}\n"));
        }
    }
    Config::parse(&text, "test").unwrap_or_else(|err| panic!("test config invalid: {err}\n{text}"))
}

/// Starts a proxy for `config`.
pub async fn start_proxy(config: Config) -> TestProxy {
    let app = App::bind(&config).await.expect("proxy binds");
    let addr = app.proxy_addr();
    let admin = app.admin_addr();
    let app_registry = app.registry();
    let app_queue = app.queue();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(app.run(shutdown.clone()));
    TestProxy {
        addr,
        admin,
        app_registry,
        app_queue,
        shutdown,
        task,
    }
}

/// Starts simulated GPU nodes (`tongs::sim`, standing in for real ones): `nodes` on the given seed,
/// with no interruption planned within the hour.
pub async fn sim_fleet(seed: u64, nodes: Vec<tongs::sim::NodeSpec>) -> tongs::sim::Fleet {
    let config = tongs::sim::FleetConfig { seed, nodes };
    tongs::sim::Fleet::start(&config, Duration::from_secs(3600))
        .await
        .expect("simulated nodes start")
}

/// `count` simulated nodes `node-0`, `node-1`, ... serving in `mean` on average, each as `tune` sets.
pub fn sim_nodes(
    count: usize,
    mean: Duration,
    tune: impl Fn(&mut tongs::sim::NodeSpec),
) -> Vec<tongs::sim::NodeSpec> {
    (0..count)
        .map(|i| {
            let mut spec = tongs::sim::NodeSpec::new(&format!("node-{i}"), mean);
            tune(&mut spec);
            spec
        })
        .collect()
}

/// `count` simulated nodes answering JSON in `mean` on average with a realistic spread (0.3), serving
/// `capacity` at once with up to `queue` more waiting inside, where only latency shows them.
pub fn json_nodes(
    count: usize,
    mean: Duration,
    capacity: usize,
    queue: usize,
) -> Vec<tongs::sim::NodeSpec> {
    sim_nodes(count, mean, |spec| {
        spec.service_time.spread = 0.3;
        spec.capacity = capacity;
        spec.queue = queue;
        spec.response = tongs::sim::ResponseKind::Json;
    })
}

/// Holds a backend's answers until the test lets them go: each waiter in [`Gate::pass`] needs one of
/// the permits [`Gate::release`] adds. Clones share the gate.
#[derive(Clone)]
pub struct Gate(Arc<tokio::sync::Semaphore>);

impl Default for Gate {
    /// Closed: nothing passes until [`Gate::release`].
    fn default() -> Gate {
        Gate(Arc::new(tokio::sync::Semaphore::new(0)))
    }
}

impl Gate {
    /// Waits for a permit and uses it up.
    pub async fn pass(&self) {
        if let Ok(permit) = self.0.acquire().await {
            permit.forget();
        }
    }

    /// Lets `count` more answers go.
    pub fn release(&self, count: usize) {
        self.0.add_permits(count);
    }
}

/// A backend on a real socket whose behaviour is the given handler.
pub struct Backend {
    pub addr: SocketAddr,
    stop: CancellationToken,
}

impl Backend {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Starts an HTTP/1.1 + h2c backend on `bind` (e.g. `127.0.0.1:0` or `[::1]:0`).
pub async fn backend_on<F, Fut>(bind: &str, handler: F) -> Backend
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<TestBody>> + Send + 'static,
{
    let listener = TcpListener::bind(bind).await.expect("backend binds");
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    serve_connections(listener, stop.clone(), move |stream, _peer| {
        serve_http(stream, Http::Auto, handler.clone())
    });
    Backend { addr, stop }
}

/// The accept loop of every test server: until `stop`, each connection accepted on `listener` goes,
/// with its peer's address, to `serve`, and the future that returns runs on a task of its own until it
/// ends or `stop`.
///
/// Every connection sends at once (`TCP_NODELAY`), as model servers' HTTP stacks do (Python's asyncio,
/// under uvicorn, sets it on every TCP connection) and as tongs' own listener does. Without it, Nagle's
/// algorithm holds a stream's first event behind its unacknowledged head until the proxy's delayed
/// ACK (40 ms on Linux): a first byte 40 ms late that no real node shows, which `balance::line` rightly
/// reads as a wait for a slot once the machine adds a few milliseconds of its own.
pub fn serve_connections<S, Fut>(listener: TcpListener, stop: CancellationToken, mut serve: S)
where
    S: FnMut(TcpStream, SocketAddr) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    tokio::spawn(async move {
        loop {
            let (stream, peer) = tokio::select! {
                () = stop.cancelled() => return,
                accepted = listener.accept() => match accepted { Ok(a) => a, Err(_) => continue },
            };
            let _ = stream.set_nodelay(true);
            let connection = serve(stream, peer);
            let stop = stop.clone();
            tokio::spawn(async move {
                tokio::select! {
                    () = connection => {}
                    () = stop.cancelled() => {}
                }
            });
        }
    });
}

/// Which HTTP a test server speaks on a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Http {
    /// HTTP/1.1 only, as the fakes of remote APIs.
    One,
    /// HTTP/2 only (after ALPN said `h2`).
    Two,
    /// HTTP/1.1 or h2c, whichever the client starts with; upgrades allowed.
    Auto,
}

/// Serves one connection with hyper, each request answered by `handler`, until the client leaves.
pub async fn serve_http<I, F, Fut, B>(io: I, http: Http, handler: F)
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    F: Fn(Request<Incoming>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Response<B>> + Send + 'static,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let service = service_fn(move |request| {
        let response = handler(request);
        async move { Ok::<_, Infallible>(response.await) }
    });
    let io = TokioIo::new(io);
    let _ = match http {
        Http::One => hyper::server::conn::http1::Builder::new()
            .serve_connection(io, service)
            .await
            .map_err(BoxError::from),
        Http::Two => hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .serve_connection(io, service)
            .await
            .map_err(BoxError::from),
        Http::Auto => {
            hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection_with_upgrades(io, service)
                .await
        }
    };
}

/// A server that accepts connections and never reads or writes a byte: a peer that hangs. It holds
/// every connection until dropped.
pub struct Silent {
    pub addr: SocketAddr,
    accepted: Arc<std::sync::atomic::AtomicUsize>,
    stop: CancellationToken,
}

impl Silent {
    pub async fn start() -> Silent {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("binds");
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let stop = CancellationToken::new();
        let counter = Arc::clone(&accepted);
        serve_connections(listener, stop.clone(), move |stream, _peer| {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            // Held open, unread, until the test ends.
            async move {
                std::future::pending::<()>().await;
                drop(stream)
            }
        });
        Silent {
            addr,
            accepted,
            stop,
        }
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> usize {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for Silent {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A free loopback port (bound, then released for a server to take, or for nothing to listen on).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// The URL of a loopback port nothing listens on: connections to it are refused.
pub fn closed_url() -> String {
    format!("http://127.0.0.1:{}", free_port())
}

/// Starts a backend on 127.0.0.1.
pub async fn backend<F, Fut>(handler: F) -> Backend
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<TestBody>> + Send + 'static,
{
    backend_on("127.0.0.1:0", handler).await
}

/// A backend that answers every request with `200` and the given text.
pub async fn text_backend(text: &'static str) -> Backend {
    backend(move |_request| async move { Response::new(full(text)) }).await
}

pub fn full(data: impl Into<Bytes>) -> TestBody {
    Full::new(data.into())
        .map_err(|never| match never {})
        .boxed()
}

/// A plain HTTP/1.1 client.
pub fn client() -> Client<HttpConnector, TestBody> {
    Client::builder(TokioExecutor::new()).build_http()
}

/// Longest any test exchange may take before the test fails instead of hanging.
pub const HANG: Duration = Duration::from_secs(30);

/// Sends `request` and returns the response's head and its body as text; a broken body or no answer
/// within [`HANG`] panics.
pub async fn exchange(request: Request<TestBody>) -> (http::response::Parts, String) {
    let target = request.uri().to_string();
    let exchange = async {
        let response = client()
            .request(request)
            .await
            .unwrap_or_else(|err| panic!("{target}: {err}"));
        let (head, body) = response.into_parts();
        let body = body.collect().await.expect("body").to_bytes();
        (head, String::from_utf8_lossy(&body).into_owned())
    };
    tokio::time::timeout(HANG, exchange)
        .await
        .unwrap_or_else(|_| panic!("{target}: no answer within {HANG:?}"))
}

/// Sends `request` and returns status and body text; a broken body or no answer within [`HANG`] panics.
pub async fn send(request: Request<TestBody>) -> (u16, String) {
    let (head, body) = exchange(request).await;
    (head.status.as_u16(), body)
}

/// The proxy's own JSON error in `body`: its `error` text (`error.message` in OpenAI's shape, which
/// paths under `/v1/` get) and `request_id`, both present and not empty.
pub fn proxy_error(body: &str) -> (String, String) {
    let json: serde_json::Value =
        serde_json::from_str(body).unwrap_or_else(|err| panic!("not JSON ({err}): {body}"));
    let error = match &json["error"] {
        serde_json::Value::Object(openai) => {
            assert!(openai["type"].is_string(), "no error type in {body}");
            openai["message"].as_str().unwrap_or_default()
        }
        text => text.as_str().unwrap_or_default(),
    };
    assert!(!error.is_empty(), "no error text in {body}");
    let request_id = json["request_id"].as_str().unwrap_or_default();
    assert!(!request_id.is_empty(), "no request_id in {body}");
    (error.to_owned(), request_id.to_owned())
}

/// Sends a GET and returns status and body text.
pub async fn get(url: &str) -> (u16, String) {
    send(Request::get(url).body(full("")).expect("a valid URL")).await
}

/// Polls `check` until it returns true or `limit` passes; panics with `what` on timeout.
pub async fn eventually(what: &str, limit: Duration, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + limit;
    while !check() {
        if tokio::time::Instant::now() > deadline {
            panic!("timed out after {limit:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Polls the async `check` until it returns true or `limit` passes; panics with `what` on timeout.
pub async fn eventually_async<F, Fut>(what: &str, limit: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    while !check().await {
        if tokio::time::Instant::now() > deadline {
            panic!("timed out after {limit:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The named program on `PATH`, or a failure saying how to get it.
pub fn require(program: &str) -> std::path::PathBuf {
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join(program))
        .find(|path| path.is_file())
        .unwrap_or_else(|| {
            panic!("{program} is missing: install Debian's {program} (scripts/test.sh does)")
        })
}

/// A directory of its own under the system temp dir, removed on drop.
pub struct TempDir(pub std::path::PathBuf);

impl TempDir {
    pub fn new(name: &str) -> TempDir {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or_default();
        let path = std::env::temp_dir().join(format!("{name}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&path).expect("temp dir");
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A `/metrics` page of a tongs with one pool, `default`, without that pool's label: the series as
/// tests of one fleet name them.
pub fn one_pool(text: &str) -> String {
    text.replace("{pool=\"default\",", "{")
        .replace("{pool=\"default\"}", "")
}

/// The value of one sample on the proxy's admin /metrics page (of its one pool, `default`: see
/// [`one_pool`]); panics when the series is absent (a default of 0 would hide a metric that is not
/// exported).
/// The endpoint at `url` as the proxy's /debug/endpoints gives it (null when it lists no such one).
pub async fn endpoint_view(proxy: &TestProxy, url: &str) -> serde_json::Value {
    endpoint_view_as(proxy, url, None).await
}

/// [`endpoint_view`], asked with the admin port's bearer `token`.
pub async fn endpoint_view_as(
    proxy: &TestProxy,
    url: &str,
    token: Option<&str>,
) -> serde_json::Value {
    let mut request = Request::get(format!("http://{}/debug/endpoints", proxy.admin));
    if let Some(token) = token {
        request = request.header("authorization", format!("Bearer {token}"));
    }
    let (_, body) = send(request.body(full("")).expect("a valid URL")).await;
    let json: serde_json::Value = serde_json::from_str(&body).unwrap();
    json["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["url"] == url)
        .cloned()
        .unwrap_or_default()
}

pub async fn sample(proxy: &TestProxy, series: &str) -> f64 {
    let (_, text) = get(&format!("http://{}/metrics", proxy.admin)).await;
    one_pool(&text)
        .lines()
        .find_map(|line| {
            let (name, value) = line.rsplit_once(' ')?;
            (name == series).then(|| value.parse().ok()).flatten()
        })
        .unwrap_or_else(|| panic!("no {series} in /metrics"))
}
