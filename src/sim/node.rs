//! One simulated node: its state, its counters, and an inference-like request handler whose
//! behaviour follows the node's current [`Condition`]; its listener and connections are in
//! `socket.rs`.
//!
//! How each interruption is made real (the first two on the node's sockets):
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
//! answered as vLLM's OpenAI server would (see [`super::openai`]); on a node with an engine they wait
//! for the batch without bound instead, and `GET /metrics` answers as `/health` does, uncounted (see
//! [`super::engine`]).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::engine::{self, Engine};
use super::going::{follow_schedule, goes, set_condition, until};
use super::openai;
use super::reply::{SimBody, full};
use super::schedule::{Condition, Interruption, InterruptionKind, lognormal};
use super::socket;
use super::stream::{Load, TokenTiming, stream_tokens, words};
use super::{NodeSpec, ResponseKind};

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
    /// Most requests ever waiting for capacity at the same time (an engine's waiting queue).
    pub max_waiting: usize,
    /// An engine's prompt words looked up in its prefix cache (vLLM's prefix cache queries, in
    /// tokens there), and those found there (its hits); 0 on a node without an engine.
    pub prefix_queries: u64,
    pub prefix_hits: u64,
}

pub(super) struct NodeShared {
    pub(super) spec: NodeSpec,
    received: AtomicU64,
    capacity: Arc<Semaphore>,
    waiting: AtomicUsize,
    max_waiting: AtomicUsize,
    in_flight: AtomicUsize,
    peak_in_flight: AtomicUsize,
    serving: AtomicUsize,
    peak_concurrency: AtomicUsize,
    served: AtomicU64,
    shed: AtomicU64,
    gateway_503: AtomicU64,
    pub(super) interruptions: AtomicU64,
    /// Numbers the OpenAI answers' ids.
    answers: AtomicU64,
    rng: Mutex<fastrand::Rng>,
    /// Draws of first-token waits and preemptions, apart from `rng` so that pauses leave the service
    /// times of a seeded run unchanged.
    pauses: Mutex<fastrand::Rng>,
    pub(super) condition: watch::Sender<Condition>,
    /// When the node said it goes (see [`Node::announce_end`]): its heartbeat answers carry
    /// `x-tongs-drain` with the seconds left until then.
    pub(super) leaving_at: Mutex<Option<Instant>>,
    /// The continuous-batching engine of the OpenAI paths, if the node has one.
    pub(super) engine: Option<Arc<Engine>>,
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
            engine: spec
                .engine
                .clone()
                .map(|engine| Arc::new(Engine::new(engine))),
            spec,
            waiting: AtomicUsize::new(0),
            max_waiting: AtomicUsize::new(0),
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
            leaving_at: Mutex::new(None),
        });
        let stop = CancellationToken::new();
        tokio::spawn(socket::accept_loop(
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

    /// An announced interruption: from now on the node's heartbeat answers say it goes in `left`
    /// (`x-tongs-drain: <seconds left>`, as a node's shutdown hook has it say), and when `left` is over
    /// it goes (`refuse`: its connections reset) until its condition is set again.
    pub fn announce_end(&self, left: Duration) {
        let at = Instant::now() + left;
        *lock(&self.shared.leaving_at) = Some(at);
        let (shared, stop) = (Arc::clone(&self.shared), self.stop.clone());
        tokio::spawn(async move {
            if until(&stop, at).await {
                let refuse = InterruptionKind::Refuse;
                goes(
                    &shared,
                    Condition::Interrupted {
                        kind: refuse,
                        factor: 1.0,
                    },
                );
            }
        });
    }

    /// How long until the node goes, while it says it does (an announced end not yet reached).
    pub fn leaving_in(&self) -> Option<Duration> {
        lock(&self.shared.leaving_at).map(|at| at.saturating_duration_since(Instant::now()))
    }

    pub fn stats(&self) -> NodeStats {
        let s = &self.shared;
        let (prefix_queries, prefix_hits) = s.engine.as_ref().map_or((0, 0), |e| e.prefix_counts());
        NodeStats {
            received: s.received.load(Ordering::Relaxed),
            served: s.served.load(Ordering::Relaxed),
            shed: s.shed.load(Ordering::Relaxed),
            gateway_503: s.gateway_503.load(Ordering::Relaxed),
            in_flight: s.in_flight.load(Ordering::Relaxed),
            peak_concurrency: s.peak_concurrency.load(Ordering::Relaxed),
            peak_in_flight: s.peak_in_flight.load(Ordering::Relaxed),
            interruptions: s.interruptions.load(Ordering::Relaxed),
            max_waiting: s.max_waiting.load(Ordering::Relaxed),
            prefix_queries,
            prefix_hits,
        }
    }
}

impl NodeShared {
    /// The node's condition, now and as it changes.
    pub(super) fn conditions(&self) -> watch::Receiver<Condition> {
        self.condition.subscribe()
    }

    /// The next number in this node's sequence of OpenAI answers (1, 2, ...).
    pub(super) fn next_answer(&self) -> u64 {
        self.answers.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// The timing of a request admitted now with `service_time`, whose stream has `tokens` tokens,
    /// whose prompt `words` words, and whose engine's prefill (before a `slow` factor) `prefill`.
    pub(super) fn timing(
        &self,
        service_time: Duration,
        tokens: u64,
        words: u64,
        prefill: Duration,
    ) -> TokenTiming {
        let load = Load {
            service_time,
            slow: self.condition.borrow().slow_factor(),
            others: self.in_flight.load(Ordering::Relaxed).saturating_sub(1),
            tokens,
            words,
            prefill,
        };
        let mut rng = self
            .pauses
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        TokenTiming::draw(&self.spec, &load, &mut rng)
    }

    /// A service time drawn now: lognormal around the node's mean, times a `slow` factor.
    pub(super) fn service_time(&self) -> Duration {
        let mut rng = self
            .rng
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let sample = lognormal(
            &mut rng,
            self.spec.service_time.mean.get(),
            self.spec.service_time.spread,
        );
        sample.mul_f64(self.condition.borrow().slow_factor())
    }

    /// A unit of capacity for a request: at once if one is free, else after waiting in line, if
    /// fewer than `line` requests wait (without bound when None: an engine's waiting queue).
    pub(super) async fn slot(
        self: &Arc<Self>,
        in_flight: InFlight,
        line: Option<usize>,
    ) -> Result<Serving, NoSlot> {
        if let Ok(permit) = Arc::clone(&self.capacity).try_acquire_owned() {
            return Ok(Serving::new(self, permit, in_flight));
        }
        // Counted while it waits, however it ends: a client gone drops this future.
        let waiting = Waiting::new(&self.waiting);
        if line.is_some_and(|line| waiting.now > line) {
            return Err(NoSlot::LineFull);
        }
        self.max_waiting.fetch_max(waiting.now, Ordering::Relaxed);
        let permit = Arc::clone(&self.capacity).acquire_owned().await;
        drop(waiting);
        let permit = permit.map_err(|_| NoSlot::Stopping)?;
        Ok(Serving::new(self, permit, in_flight))
    }
}

/// Why a request got no unit of capacity.
pub(super) enum NoSlot {
    /// The waiting line is full.
    LineFull,
    /// The node is stopping.
    Stopping,
}

/// A request counted as waiting for capacity while alive.
struct Waiting<'a> {
    count: &'a AtomicUsize,
    /// Requests waiting, this one included, when it began to wait.
    now: usize,
}

impl Waiting<'_> {
    fn new(count: &AtomicUsize) -> Waiting<'_> {
        let now = count.fetch_add(1, Ordering::Relaxed) + 1;
        Waiting { count, now }
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.count.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A poisoned lock still holds a value a node can go on with.
pub(super) fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Counts a request as in flight while alive.
pub(super) struct InFlight(Arc<NodeShared>);

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
pub(super) async fn handle(
    request: Request<Incoming>,
    shared: Arc<NodeShared>,
    reset: CancellationToken,
) -> Response<SimBody> {
    let condition = *shared.condition.borrow();
    if condition.is(InterruptionKind::Gateway503) {
        return gateway_503(&shared);
    }
    match (request.method(), request.uri().path()) {
        (_, "/health") => {
            let body = format!(
                r#"{{"status":"ok","node":"{}","in_flight":{}}}"#,
                shared.spec.name,
                shared.in_flight.load(Ordering::Relaxed)
            );
            let mut response = full(StatusCode::OK, "application/json", body);
            if let Some(at) = *lock(&shared.leaving_at) {
                let left = at.saturating_duration_since(Instant::now()).as_secs_f64();
                if let Ok(value) = http::HeaderValue::from_str(&format!("{left:.1}")) {
                    response.headers_mut().insert("x-tongs-drain", value);
                }
            }
            return response;
        }
        (&Method::GET, "/metrics") => {
            let running = shared.serving.load(Ordering::Relaxed);
            let waiting = shared.waiting.load(Ordering::Relaxed);
            let working = !shared.condition.borrow().is(InterruptionKind::Gray);
            return engine::metrics(shared.engine.as_deref(), running, waiting, working);
        }
        _ => {}
    }

    shared.received.fetch_add(1, Ordering::Relaxed);
    let in_flight = InFlight::new(&shared);
    let api = openai::ServedApi::route(request.method(), request.uri().path());
    let mut response = match (api, &shared.engine) {
        (Some(api), Some(engine)) => {
            let engine = Arc::clone(engine);
            engine::serve(api, request, Arc::clone(&shared), engine, in_flight, reset).await
        }
        _ => match admit(api, request, &shared, in_flight, reset).await {
            Ok(response) => response,
            Err(refusal) => return refusal,
        },
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

/// Admits a request like any other (capacity, a bounded waiting line, shedding) and answers it; Err
/// when it is refused before it is served.
async fn admit(
    api: Option<openai::ServedApi>,
    request: Request<Incoming>,
    shared: &Arc<NodeShared>,
    in_flight: InFlight,
    reset: CancellationToken,
) -> Result<Response<SimBody>, Response<SimBody>> {
    // Full: wait in line if there is room, else shed like an overloaded inference server.
    let serving = match shared.slot(in_flight, Some(shared.spec.queue)).await {
        Ok(serving) => serving,
        Err(NoSlot::LineFull) => {
            shared.shed.fetch_add(1, Ordering::Relaxed);
            let mut response = full(
                StatusCode::SERVICE_UNAVAILABLE,
                "application/json",
                r#"{"error":"node at capacity"}"#,
            );
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
            return Err(response);
        }
        Err(NoSlot::Stopping) => return Err(stopping()),
    };
    let (head, body) = request.into_parts();
    let body = read_body(body).await?;
    let service_time = shared.service_time();
    if let Some(api) = api {
        let admitted = openai::Admitted {
            shared: Arc::clone(shared),
            serving,
            service_time,
            reset,
            prefill: Duration::ZERO,
            sequence: None,
        };
        return Ok(openai::answer(api, &head.headers, &body, admitted).await);
    }
    // Counted only when a first-token wait may use them: a body can be 16 MB.
    let words = match shared.spec.first_token {
        Some(_) => words(&body),
        None => 0,
    };
    let timing = shared.timing(
        service_time,
        u64::from(shared.spec.tokens),
        words,
        Duration::ZERO,
    );
    if wants_stream(&head.headers, &shared.spec) {
        return Ok(stream_tokens(Arc::clone(shared), serving, timing));
    }
    tokio::time::sleep(timing.whole).await;
    while_gray(shared).await;
    serving.finish();
    let body = format!(
        r#"{{"node":"{}","service_ms":{},"prompt_bytes":{},"tokens":{}}}"#,
        shared.spec.name,
        service_time.as_millis(),
        body.len(),
        shared.spec.tokens
    );
    Ok(full(StatusCode::OK, "application/json", body))
}

/// The answer to a request waiting for capacity when the node stops.
pub(super) fn stopping() -> Response<SimBody> {
    full(
        StatusCode::SERVICE_UNAVAILABLE,
        "text/plain",
        "node stopping",
    )
}

/// Reads a request's body as a real server reads the prompt, bounded so that a huge body cannot
/// exhaust memory; Err is the answer to a body over the bound.
pub(super) async fn read_body(body: Incoming) -> Result<Bytes, Response<SimBody>> {
    match Limited::new(body, 16 << 20).collect().await {
        Ok(body) => Ok(body.to_bytes()),
        Err(_) => Err(full(
            StatusCode::PAYLOAD_TOO_LARGE,
            "text/plain",
            "prompt too large",
        )),
    }
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
