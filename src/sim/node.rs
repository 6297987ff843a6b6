//! One simulated node: a listener, its connections, and an inference-like request handler whose
//! behaviour follows the node's current [`Condition`].
//!
//! How each interruption is made real on the socket:
//! - `refuse`: the listener is closed (new connects get ECONNREFUSED) and every open connection is reset
//!   (SO_LINGER 0, so the peer sees RST); the port is bound again on recovery.
//! - `blackhole`: connections are accepted but never read or answered, and in-flight requests stop where
//!   they are; on recovery those connections are reset, as a reallocated node would.
//! - `gateway-503`: every request, `/health` included, gets the gateway's HTML 503.
//! - `slow`: service times are multiplied by the interruption's factor.
//! - `gray`: `/health` answers and connections are accepted, but a request hangs before its answer and a
//!   stream stalls after its first chunk, until the node recovers (then they go on where they stopped).
//!
//! `POST /v1/completions` and `POST /v1/chat/completions` are admitted like any other request, then
//! answered as vLLM's OpenAI server would (see [`super::openai`]).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::openai;
use super::reply::{SimBody, full};
use super::schedule::{Interruption, InterruptionKind, lognormal};
use super::stream::{Load, TokenTiming, stream_tokens, words};
use super::{NodeSpec, ResponseKind};

/// What a node is doing right now.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Condition {
    Up,
    Interrupted { kind: InterruptionKind, factor: f64 },
}

impl Condition {
    pub fn kind(self) -> Option<InterruptionKind> {
        match self {
            Condition::Up => None,
            Condition::Interrupted { kind, .. } => Some(kind),
        }
    }

    pub fn label(self) -> &'static str {
        self.kind().map_or("up", InterruptionKind::as_str)
    }

    fn is(self, kind: InterruptionKind) -> bool {
        self.kind() == Some(kind)
    }

    fn slow_factor(self) -> f64 {
        match self {
            Condition::Interrupted {
                kind: InterruptionKind::Slow,
                factor,
            } => factor,
            _ => 1.0,
        }
    }
}

/// Counters of one node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeStats {
    /// Inference requests that reached the node (heartbeats not counted), answered or not.
    pub received: u64,
    /// Requests answered with a complete response.
    pub served: u64,
    /// Requests refused by the node's own load shedding (503 + Retry-After).
    pub shed: u64,
    /// Requests answered with the gateway's 503.
    pub gateway_503: u64,
    /// Requests being served or waiting for capacity.
    pub in_flight: usize,
    /// Most requests ever served at the same time.
    pub peak_concurrency: usize,
    /// Most requests ever at the node at the same time, waiting for capacity included: the
    /// concurrency a proxy in front actually sent.
    pub peak_in_flight: usize,
    /// Interruptions that have begun.
    pub interruptions: u64,
}

pub(super) struct NodeShared {
    pub(super) spec: NodeSpec,
    received: AtomicU64,
    capacity: Arc<Semaphore>,
    waiting: AtomicUsize,
    in_flight: AtomicUsize,
    peak_in_flight: AtomicUsize,
    serving: AtomicUsize,
    peak_concurrency: AtomicUsize,
    served: AtomicU64,
    shed: AtomicU64,
    gateway_503: AtomicU64,
    interruptions: AtomicU64,
    /// Numbers the OpenAI answers' ids.
    answers: AtomicU64,
    rng: Mutex<fastrand::Rng>,
    /// Draws of first-token waits and preemptions, apart from `rng` so that pauses leave the service
    /// times of a seeded run unchanged.
    pauses: Mutex<fastrand::Rng>,
    condition: watch::Sender<Condition>,
}

/// A running simulated node. Dropping it stops the node.
pub struct Node {
    shared: Arc<NodeShared>,
    addr: SocketAddr,
    stop: CancellationToken,
}

impl Drop for Node {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl Node {
    /// Binds the node and starts serving; `planned` interruptions count from `started`.
    pub async fn start(
        spec: NodeSpec,
        seed: u64,
        planned: Vec<Interruption>,
        started: Instant,
    ) -> std::io::Result<Node> {
        let listener = TcpListener::bind(spec.listen).await?;
        let addr = listener.local_addr()?;
        let (condition, _) = watch::channel(Condition::Up);
        let shared = Arc::new(NodeShared {
            capacity: Arc::new(Semaphore::new(spec.capacity)),
            received: AtomicU64::new(0),
            spec,
            waiting: AtomicUsize::new(0),
            in_flight: AtomicUsize::new(0),
            peak_in_flight: AtomicUsize::new(0),
            serving: AtomicUsize::new(0),
            peak_concurrency: AtomicUsize::new(0),
            served: AtomicU64::new(0),
            shed: AtomicU64::new(0),
            gateway_503: AtomicU64::new(0),
            interruptions: AtomicU64::new(0),
            answers: AtomicU64::new(0),
            rng: Mutex::new(fastrand::Rng::with_seed(seed)),
            pauses: Mutex::new(fastrand::Rng::with_seed(!seed)),
            condition,
        });
        let stop = CancellationToken::new();
        tokio::spawn(accept_loop(
            listener,
            addr,
            Arc::clone(&shared),
            stop.clone(),
        ));
        tokio::spawn(follow_schedule(
            planned,
            started,
            Arc::clone(&shared),
            stop.clone(),
        ));
        Ok(Node { shared, addr, stop })
    }

    pub fn name(&self) -> &str {
        &self.shared.spec.name
    }

    pub fn spec(&self) -> &NodeSpec {
        &self.shared.spec
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn condition(&self) -> Condition {
        *self.shared.condition.borrow()
    }

    /// Puts the node into `condition` now (tests and interactive use; schedules do the same).
    pub fn set_condition(&self, condition: Condition) {
        set_condition(&self.shared, condition);
    }

    pub fn stats(&self) -> NodeStats {
        let s = &self.shared;
        NodeStats {
            received: s.received.load(Ordering::Relaxed),
            served: s.served.load(Ordering::Relaxed),
            shed: s.shed.load(Ordering::Relaxed),
            gateway_503: s.gateway_503.load(Ordering::Relaxed),
            in_flight: s.in_flight.load(Ordering::Relaxed),
            peak_concurrency: s.peak_concurrency.load(Ordering::Relaxed),
            peak_in_flight: s.peak_in_flight.load(Ordering::Relaxed),
            interruptions: s.interruptions.load(Ordering::Relaxed),
        }
    }
}

impl NodeShared {
    /// The next number in this node's sequence of OpenAI answers (1, 2, ...).
    pub(super) fn next_answer(&self) -> u64 {
        self.answers.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// The timing of a request admitted now with `service_time`, whose stream has `tokens` tokens
    /// and whose prompt `words` words.
    pub(super) fn timing(&self, service_time: Duration, tokens: u64, words: u64) -> TokenTiming {
        let load = Load {
            service_time,
            slow: self.condition.borrow().slow_factor(),
            others: self.in_flight.load(Ordering::Relaxed).saturating_sub(1),
            tokens,
            words,
        };
        let mut rng = self
            .pauses
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        TokenTiming::draw(&self.spec, &load, &mut rng)
    }
}

fn set_condition(shared: &NodeShared, condition: Condition) {
    let previous = shared.condition.send_replace(condition);
    if previous == condition {
        return;
    }
    if condition != Condition::Up {
        shared.interruptions.fetch_add(1, Ordering::Relaxed);
    }
    tracing::debug!(node = %shared.spec.name, from = previous.label(), to = condition.label(), "sim node condition");
}

async fn follow_schedule(
    planned: Vec<Interruption>,
    started: Instant,
    shared: Arc<NodeShared>,
    stop: CancellationToken,
) {
    for interruption in planned {
        let begin = started + interruption.at.get();
        let end = begin + interruption.duration.get();
        let condition = Condition::Interrupted {
            kind: interruption.kind,
            factor: interruption.factor,
        };
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep_until(begin) => set_condition(&shared, condition),
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep_until(end) => set_condition(&shared, Condition::Up),
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    addr: SocketAddr,
    shared: Arc<NodeShared>,
    stop: CancellationToken,
) {
    let mut conditions = shared.condition.subscribe();
    let mut listener = Some(listener);
    loop {
        let refusing = conditions.borrow_and_update().is(InterruptionKind::Refuse);
        match (refusing, listener.as_ref()) {
            (true, Some(_)) => listener = None, // closing the socket is what makes connects fail
            (false, None) => match TcpListener::bind(addr).await {
                Ok(bound) => listener = Some(bound),
                Err(err) => {
                    tracing::debug!(%addr, error = %err, "sim node cannot rebind yet");
                    tokio::select! {
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep(Duration::from_millis(20)) => continue,
                    }
                }
            },
            _ => {}
        }
        let accepted = tokio::select! {
            () = stop.cancelled() => return,
            changed = conditions.changed() => {
                if changed.is_err() { return; }
                continue;
            }
            accepted = accept(listener.as_ref()) => accepted,
        };
        if let Ok((stream, _)) = accepted {
            tokio::spawn(connection(stream, Arc::clone(&shared), stop.clone()));
        }
    }
}

async fn accept(listener: Option<&TcpListener>) -> std::io::Result<(TcpStream, SocketAddr)> {
    match listener {
        Some(listener) => listener.accept().await,
        None => std::future::pending().await,
    }
}

/// Closes a connection with RST rather than FIN, as a vanished host's network would.
fn reset(twin: socket2::Socket) {
    let _ = twin.set_linger(Some(Duration::ZERO));
    drop(twin);
}

async fn connection(stream: TcpStream, shared: Arc<NodeShared>, stop: CancellationToken) {
    // A second handle on the same socket, so it can be reset while hyper owns the stream.
    let Ok(twin) = socket2::SockRef::from(&stream).try_clone() else {
        return;
    };
    let _ = stream.set_nodelay(true);
    let mut conditions = shared.condition.subscribe();
    // A handler cancels it to have this connection reset (the OpenAI answers' `x-sim-cut` hook).
    let reset_asked = CancellationToken::new();
    let service_shared = Arc::clone(&shared);
    let service_reset = reset_asked.clone();
    let service = service_fn(move |request| {
        let shared = Arc::clone(&service_shared);
        let reset = service_reset.clone();
        async move { Ok::<_, Infallible>(handle(request, shared, reset).await) }
    });
    let builder = auto::Builder::new(TokioExecutor::new());
    let connection = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(connection);
    loop {
        let current = *conditions.borrow_and_update();
        if current.is(InterruptionKind::Refuse) {
            return reset(twin);
        }
        if current.is(InterruptionKind::Blackhole) {
            // Stop reading and answering; keep the socket open until the node comes back, then reset.
            loop {
                tokio::select! {
                    () = stop.cancelled() => return reset(twin),
                    changed = conditions.changed() => {
                        if changed.is_err() || !conditions.borrow().is(InterruptionKind::Blackhole) {
                            return reset(twin);
                        }
                    }
                }
            }
        }
        tokio::select! {
            _ = &mut connection => return,
            () = stop.cancelled() => return reset(twin),
            () = reset_asked.cancelled() => return reset(twin),
            changed = conditions.changed() => if changed.is_err() { return reset(twin) },
        }
    }
}

/// Counts a request as in flight while alive.
struct InFlight(Arc<NodeShared>);

impl InFlight {
    fn new(shared: &Arc<NodeShared>) -> InFlight {
        let now = shared.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        shared.peak_in_flight.fetch_max(now, Ordering::Relaxed);
        InFlight(Arc::clone(shared))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A request holding one unit of the node's capacity.
pub(super) struct Serving {
    shared: Arc<NodeShared>,
    _permit: OwnedSemaphorePermit,
    _in_flight: InFlight,
}

impl Serving {
    fn new(shared: &Arc<NodeShared>, permit: OwnedSemaphorePermit, in_flight: InFlight) -> Serving {
        let now = shared.serving.fetch_add(1, Ordering::Relaxed) + 1;
        shared.peak_concurrency.fetch_max(now, Ordering::Relaxed);
        Serving {
            shared: Arc::clone(shared),
            _permit: permit,
            _in_flight: in_flight,
        }
    }

    /// Counts the request as served: its answer is complete.
    pub(super) fn finish(&self) {
        self.shared.served.fetch_add(1, Ordering::Relaxed);
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        self.shared.serving.fetch_sub(1, Ordering::Relaxed);
    }
}

fn gateway_503(shared: &NodeShared) -> Response<SimBody> {
    shared.gateway_503.fetch_add(1, Ordering::Relaxed);
    full(
        StatusCode::SERVICE_UNAVAILABLE,
        "text/html",
        "<html><body><h1>503 Service Unavailable</h1><p>No instance is ready to serve this request.</p></body></html>",
    )
}

fn wants_stream(headers: &http::HeaderMap, spec: &NodeSpec) -> bool {
    spec.response == ResponseKind::Sse
        || headers
            .get(header::ACCEPT)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.contains("text/event-stream"))
}

/// Answers one request; `reset` resets the request's connection when cancelled.
async fn handle(
    request: Request<Incoming>,
    shared: Arc<NodeShared>,
    reset: CancellationToken,
) -> Response<SimBody> {
    let condition = *shared.condition.borrow();
    if condition.is(InterruptionKind::Gateway503) {
        return gateway_503(&shared);
    }
    if request.uri().path() == "/health" {
        let body = format!(
            r#"{{"status":"ok","node":"{}","in_flight":{}}}"#,
            shared.spec.name,
            shared.in_flight.load(Ordering::Relaxed)
        );
        return full(StatusCode::OK, "application/json", body);
    }

    shared.received.fetch_add(1, Ordering::Relaxed);
    let in_flight = InFlight::new(&shared);
    let permit = match Arc::clone(&shared.capacity).try_acquire_owned() {
        Ok(permit) => permit,
        Err(_) => {
            // Full: wait in line if there is room, else shed like an overloaded inference server.
            if shared.waiting.fetch_add(1, Ordering::Relaxed) >= shared.spec.queue {
                shared.waiting.fetch_sub(1, Ordering::Relaxed);
                shared.shed.fetch_add(1, Ordering::Relaxed);
                let mut response = full(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "application/json",
                    r#"{"error":"node at capacity"}"#,
                );
                response
                    .headers_mut()
                    .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
                return response;
            }
            let permit = Arc::clone(&shared.capacity).acquire_owned().await;
            shared.waiting.fetch_sub(1, Ordering::Relaxed);
            match permit {
                Ok(permit) => permit,
                Err(_) => {
                    return full(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "text/plain",
                        "node stopping",
                    );
                }
            }
        }
    };
    let serving = Serving::new(&shared, permit, in_flight);
    let api = openai::ServedApi::route(request.method(), request.uri().path());
    let (head, body) = request.into_parts();
    // The prompt is read like a real server would, bounded so a huge body cannot exhaust memory.
    let body = match Limited::new(body, 16 << 20).collect().await {
        Ok(body) => body.to_bytes(),
        Err(_) => {
            return full(
                StatusCode::PAYLOAD_TOO_LARGE,
                "text/plain",
                "prompt too large",
            );
        }
    };
    let service_time = {
        let mut rng = shared
            .rng
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let sample = lognormal(
            &mut rng,
            shared.spec.service_time.mean.get(),
            shared.spec.service_time.spread,
        );
        sample.mul_f64(shared.condition.borrow().slow_factor())
    };
    let mut response = if let Some(api) = api {
        let admitted = openai::Admitted {
            shared: Arc::clone(&shared),
            serving,
            service_time,
            reset,
        };
        openai::answer(api, &head.headers, &body, admitted).await
    } else {
        // Counted only when a first-token wait may use them: a body can be 16 MB.
        let words = match shared.spec.first_token {
            Some(_) => words(&body),
            None => 0,
        };
        let timing = shared.timing(service_time, u64::from(shared.spec.tokens), words);
        if wants_stream(&head.headers, &shared.spec) {
            stream_tokens(Arc::clone(&shared), serving, timing)
        } else {
            tokio::time::sleep(timing.whole).await;
            while_gray(&shared).await;
            serving.finish();
            let body = format!(
                r#"{{"node":"{}","service_ms":{},"prompt_bytes":{},"tokens":{}}}"#,
                shared.spec.name,
                service_time.as_millis(),
                body.len(),
                shared.spec.tokens
            );
            full(StatusCode::OK, "application/json", body)
        }
    };
    if shared.spec.report_load {
        let headers = response.headers_mut();
        headers.insert(
            "x-sim-in-flight",
            shared.in_flight.load(Ordering::Relaxed).into(),
        );
        headers.insert("x-sim-capacity", shared.spec.capacity.into());
    }
    response.headers_mut().insert(
        "x-sim-node",
        header::HeaderValue::from_str(&shared.spec.name)
            .unwrap_or(header::HeaderValue::from_static("node")),
    );
    response
}

/// Waits while the node is in a gray failure (returns at once otherwise).
pub(super) async fn while_gray(shared: &NodeShared) {
    let mut conditions = shared.condition.subscribe();
    while conditions.borrow_and_update().is(InterruptionKind::Gray) {
        if conditions.changed().await.is_err() {
            return;
        }
    }
}
