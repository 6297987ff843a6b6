//! Streams: what tongs costs per open long stream, against nginx, in the same run.
//!
//! `STREAMS` clients each hold one long Server-Sent Events stream on a connection of its own: one event
//! every `EVENT_GAP` for `STREAM_SECONDS`, so `STREAM_SECONDS / EVENT_GAP` events (tokens) a stream, 500
//! at the defaults. The streams start spread evenly over `RAMP`, so no proxy takes N connects at once.
//! Two kinds of stream, each run straight to the upstream (the baseline), then through tongs (the
//! release binary, its own process, defaults), then through nginx (`proxy_buffering off`, HTTP/1.1
//! upstream keepalive, `least_conn`, a worker per CPU: `support::NginxSse`, as `scale.rs` runs it):
//!
//! - `plain`: `GET /v1/stream?events=K`, events `data: {"n":17,"sent_us":…}`;
//! - `openai`: `POST /v1/chat/completions` with `{"model": "bench-model", "stream": true, "max_tokens": K,
//!   "messages": [...]}`, answered as vLLM streams a chat completion: a chunk opening the assistant's
//!   message, one `chat.completion.chunk` a token (`"delta":{"content":" 17"}`), the last with
//!   `"finish_reason":"length"`, then `data: [DONE]`. tongs relays such a stream as one it can continue
//!   on another node (`Continuable`, `Relay`: every chunk parsed, the text kept): a probe stream the
//!   upstream cuts after its second token must reach the client whole, continued on the other endpoint,
//!   and `tongs_continuations_total{outcome="continued"}` must count it, or the row fails.
//!
//! The upstream is this benchmark's own binary started again as a process of its own (`--upstream`), so
//! that the clients (one file descriptor a stream) and the upstream (one more) do not share one
//! process's open-file limit. It listens on 127.0.0.1 and 127.0.0.2 at one port, two endpoints for the
//! proxies (the continuation goes to an endpoint not yet tried), and stamps every event (but `[DONE]`)
//! with its send time, microseconds on the system clock, which the clients read again on arrival.
//!
//! Figures, one row per kind and path:
//! - memory per open stream: (the proxy's RSS in the middle of the window in which every stream is open
//!   − its idle RSS before the streams) ÷ N, and its peak RSS (nginx: master and workers summed);
//! - CPU per relayed event: the proxy's user + system time (`/proc/PID/stat`, every thread; nginx: master
//!   and workers) over that window ÷ the events the clients received in it; and the whole run's;
//! - the delay each event takes from the upstream's send to the client's read, p50 / p99 / max, directly
//!   and through each proxy, and what the proxy adds over the direct run at the same N;
//! - every stream must end cleanly with every event in order: failures are counted and the run marked.
//!
//! The window runs from two gaps after the last stream started to two gaps before the first one ends.
//! tongs holds two file descriptors a stream (the client's connection and the upstream's) in one
//! process, so the open-file limit sets the most streams it can take: a row that does not fit is not
//! run, and says why and where it stops; the bench's clients and the upstream need one a stream each.
//! The bench raises its soft limit to the hard one first (`prlimit`); its children inherit it.
//!
//!     cargo bench --bench streams
//!     STREAMS=5000 cargo bench --bench streams
//!     STREAM_SECONDS=40 RESULTS=/tmp/streams.md cargo bench --bench streams
//!
//! Environment:
//! - `STREAMS` (1000): concurrent streams;
//! - `STREAM_SECONDS` (20, or `20s`): each stream's length; at most 90 s (tongs' `timeouts.total` is
//!   100 s); 40 gives 1,000 tokens a stream at the default gap;
//! - `EVENT_GAP` (40, milliseconds, or `40ms`): time between two events of a stream;
//! - `RAMP` (a quarter of `STREAM_SECONDS`, at most 5 s; `3s`, `500ms`): the streams' starts spread over it;
//! - `KINDS` (`plain openai`): the kinds of stream to run;
//! - `RESULTS` (none): a file to write the report to as well;
//! - `TONGS_LOG`: a `RUST_LOG` filter for tongs, whose log then goes to `target/` (`support::TongsProcess`).
//!
//! Under `cargo test --all-targets` (no `--bench` argument) a smoke pass runs instead, whatever the
//! environment: 20 streams of 1 s, both kinds, every path; it fails if nginx is missing
//! (`bash scripts/test.sh` installs it), if a stream does not end cleanly, or if a figure is missing.

#![forbid(unsafe_code)]

#[path = "support/mod.rs"]
mod support;

use std::fmt::{self, Write as _};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail, ensure};
use bytes::Bytes;
use hdrhistogram::Histogram;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::channel::{Channel, Sender};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use support::stats::latency_histogram;
use support::{NginxSse, Process, TempDir, TongsProcess, Usage, mib, seconds};

/// The model the chat requests name.
const MODEL: &str = "bench-model";
/// A request header the upstream reads: break the connection right after this token (the probe).
const CUT_HEADER: &str = "x-bench-cut";
/// The first argument that makes this binary the upstream.
const UPSTREAM_ARG: &str = "--upstream";
/// The upstream's two endpoints share a port on these addresses.
const UPSTREAM_HOSTS: [[u8; 4]; 2] = [[127, 0, 0, 1], [127, 0, 0, 2]];
/// File descriptors a process holds besides its streams' (listeners, the runtime, logs, heartbeats).
const FD_MARGIN: u64 = 64;
/// Events (tokens) of a warm-up stream.
const WARM_TOKENS: u64 = 2;
/// The probe: tokens, and the one after which the upstream breaks the connection.
const PROBE_TOKENS: u64 = 4;
const PROBE_CUT: u64 = 2;
/// What opens a chat answer, and what ends its last token.
const ROLE: &str = r#""delta":{"role":"assistant","content":""}"#;
const LENGTH: &str = r#""finish_reason":"length""#;

// ---------------------------------------------------------------------------------------------------
// Settings.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Plain,
    OpenAi,
}

impl Kind {
    fn parse(name: &str) -> Result<Kind> {
        match name {
            "plain" => Ok(Kind::Plain),
            "openai" => Ok(Kind::OpenAi),
            _ => bail!("unknown kind of stream {name:?} (known: plain openai)"),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Plain => "plain",
            Kind::OpenAi => "openai",
        }
    }
}

struct Settings {
    smoke: bool,
    streams: usize,
    stream_time: Duration,
    gap: Duration,
    ramp: Duration,
    kinds: Vec<Kind>,
    results: Option<PathBuf>,
    /// Idle time before a row's idle figure, and between rows.
    settle: Duration,
}

impl Settings {
    fn from_env(smoke: bool) -> Result<Settings> {
        let settings = if smoke {
            Settings::smoke()
        } else {
            Settings::full()?
        };
        ensure!(settings.streams > 0, "STREAMS must be at least 1");
        ensure!(
            settings.gap >= Duration::from_millis(1) && settings.tokens() >= 2,
            "EVENT_GAP must be at least 1 ms and STREAM_SECONDS at least two of it"
        );
        ensure!(
            settings.ramp + settings.gap * 5 < settings.stream_time,
            "RAMP plus five EVENT_GAPs must be shorter than STREAM_SECONDS, so that every stream is open at once"
        );
        ensure!(
            settings.stream_time <= Duration::from_secs(90),
            "STREAM_SECONDS must be at most 90: tongs' timeouts.total (100 s) would end longer streams"
        );
        Ok(settings)
    }

    fn smoke() -> Settings {
        Settings {
            smoke: true,
            streams: 20,
            stream_time: Duration::from_secs(1),
            gap: Duration::from_millis(40),
            ramp: Duration::from_millis(200),
            kinds: vec![Kind::Plain, Kind::OpenAi],
            results: None,
            settle: Duration::from_millis(100),
        }
    }

    fn full() -> Result<Settings> {
        let stream_time = support::env_duration("STREAM_SECONDS", Duration::from_secs(20))?;
        let ramp = (stream_time / 4).min(Duration::from_secs(5));
        Ok(Settings {
            smoke: false,
            streams: support::env_number("STREAMS", 1000)?,
            stream_time,
            gap: env_gap()?,
            ramp: support::env_duration("RAMP", ramp)?,
            kinds: support::env_list("KINDS", "plain openai", Kind::parse)?,
            results: std::env::var("RESULTS")
                .ok()
                .filter(|path| !path.trim().is_empty())
                .map(PathBuf::from),
            settle: Duration::from_millis(500),
        })
    }

    /// Events a stream carries: tokens of a chat answer, events of a plain stream.
    fn tokens(&self) -> u64 {
        (self.stream_time.as_micros() / self.gap.as_micros().max(1)) as u64
    }

    /// The window in which every stream is open, for streams starting from `t0`: from two gaps after
    /// the last one started to two gaps before the first one ends; and its middle.
    fn window(&self, t0: Instant) -> (Instant, Instant, Instant) {
        let start = t0 + self.ramp + self.gap * 2;
        let first_end = t0 + self.gap * u32::try_from(self.tokens() - 1).unwrap_or(u32::MAX);
        let end = first_end - self.gap * 2;
        (start, start + (end - start) / 2, end)
    }

    /// How long a stream may take before the bench gives up on it: on a saturated machine its events
    /// queue up, and it ends well after its upstream's last send.
    fn stream_timeout(&self) -> Duration {
        self.ramp + self.stream_time * 2 + Duration::from_secs(60)
    }
}

/// `EVENT_GAP`: milliseconds, or a duration such as `40ms`.
fn env_gap() -> Result<Duration> {
    let default = Duration::from_millis(40);
    match std::env::var("EVENT_GAP") {
        Ok(text) => match text.trim().parse::<u64>() {
            Ok(millis) => Ok(Duration::from_millis(millis)),
            Err(_) => support::env_duration("EVENT_GAP", default),
        },
        Err(_) => Ok(default),
    }
}

// ---------------------------------------------------------------------------------------------------
// The clock and the events, as the upstream writes them and the clients read them.

/// Microseconds since the Unix epoch, on the system clock: the one clock the upstream (another
/// process) and the clients both read.
fn unix_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_micros() as u64)
}

/// Microseconds since `base_us`, the bench's start on [`unix_us`]'s clock.
fn clock_us(base_us: u64) -> u64 {
    unix_us().saturating_sub(base_us)
}

fn plain_event(n: u64, sent_us: u64) -> String {
    format!("data: {{\"n\":{n},\"sent_us\":{sent_us}}}\n\n")
}

/// One chunk of a streamed chat completion, as vLLM writes it, stamped with its send time.
fn chat_chunk(id: u64, created: u64, delta: &str, finish: &str, sent_us: u64) -> String {
    format!(
        "data: {{\"id\":\"chatcmpl-bench{id}\",\"object\":\"chat.completion.chunk\",\"created\":{created},\
         \"model\":\"{MODEL}\",\"choices\":[{{\"index\":0,{delta},\"finish_reason\":{finish}}}],\
         \"sent_us\":{sent_us}}}\n\n"
    )
}

/// The clients' chat request for `tokens` tokens, `model` first as clients send it.
fn chat_request(tokens: u64) -> String {
    format!(
        "{{\"model\":\"{MODEL}\",\"stream\":true,\"max_tokens\":{tokens},\"messages\":[{{\"role\":\"user\",\
         \"content\":\"Count from 1, one number a token.\"}}]}}"
    )
}

/// The number after `key` in an event, past an opening quote and spaces (`"content":" 17"` → 17).
fn number_after(text: &str, key: &str) -> Option<u64> {
    let rest = &text[text.find(key)? + key.len()..];
    let digits = rest.trim_start_matches(['"', ' ']);
    let end = digits
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(digits.len());
    digits[..end].parse().ok()
}

// ---------------------------------------------------------------------------------------------------
// The upstream: this binary again, a process of its own.

/// What one stream sends: one step a gap, the first at once.
enum Script {
    /// Events `n` = 0 .. events.
    Plain { events: u64 },
    /// A chat answer: the opening chunk, then tokens `first ..= last`, `[DONE]` with the last; the
    /// connection breaks after token `cut`.
    Chat {
        id: u64,
        created: u64,
        first: u64,
        last: u64,
        cut: Option<u64>,
    },
}

impl Script {
    fn steps(&self) -> u64 {
        match self {
            Script::Plain { events } => *events,
            Script::Chat { first, last, .. } => last + 2 - first,
        }
    }

    /// Step `step`'s text, stamped `sent_us`, and whether the connection breaks after it.
    fn step(&self, step: u64, sent_us: u64) -> (String, bool) {
        let (id, created, first, last, cut) = match *self {
            Script::Plain { .. } => return (plain_event(step, sent_us), false),
            Script::Chat {
                id,
                created,
                first,
                last,
                cut,
            } => (id, created, first, last, cut),
        };
        if step == 0 {
            return (chat_chunk(id, created, ROLE, "null", sent_us), false);
        }
        let token = first + step - 1;
        let delta = format!("\"delta\":{{\"content\":\" {token}\"}}");
        if token == last {
            let chunk = chat_chunk(id, created, &delta, "\"length\"", sent_us);
            return (chunk + "data: [DONE]\n\n", false);
        }
        let chunk = chat_chunk(id, created, &delta, "null", sent_us);
        (chunk, cut == Some(token))
    }
}

/// The upstream's state, shared by its connections.
struct Upstream {
    gap: Duration,
    base_us: u64,
    next_id: AtomicU64,
    open: AtomicU64,
    completed: AtomicU64,
    cut: AtomicU64,
}

type UpstreamBody = UnsyncBoxBody<Bytes, std::io::Error>;

/// The upstream's `main`: `--upstream PORT GAP_US BASE_US`.
fn upstream_main(args: &[String]) -> Result<()> {
    let number = |index: usize| -> Result<u64> {
        args.get(index)
            .and_then(|arg| arg.parse().ok())
            .with_context(|| format!("{UPSTREAM_ARG} PORT GAP_US BASE_US, got {args:?}"))
    };
    let port = u16::try_from(number(0)?)?;
    let shared = Arc::new(Upstream {
        gap: Duration::from_micros(number(1)?),
        base_us: number(2)?,
        next_id: AtomicU64::new(0),
        open: AtomicU64::new(0),
        completed: AtomicU64::new(0),
        cut: AtomicU64::new(0),
    });
    support::block_on(serve_upstream(port, shared))
}

async fn serve_upstream(port: u16, shared: Arc<Upstream>) -> Result<()> {
    let mut tasks = Vec::new();
    for host in UPSTREAM_HOSTS {
        let addr = SocketAddr::from((host, port));
        let listener = support::reuseport_listener(addr).context("the upstream's listener")?;
        tasks.push(tokio::spawn(accept(listener, Arc::clone(&shared))));
    }
    for task in tasks {
        task.await?;
    }
    Ok(())
}

async fn accept(listener: TcpListener, shared: Arc<Upstream>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let shared = Arc::clone(&shared);
        tokio::spawn(async move {
            let _ = stream.set_nodelay(true);
            let service = service_fn(move |request: Request<Incoming>| {
                let shared = Arc::clone(&shared);
                async move { Ok::<_, std::io::Error>(answer(request, shared).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn answer(request: Request<Incoming>, shared: Arc<Upstream>) -> Response<UpstreamBody> {
    let path = request.uri().path().to_owned();
    match (request.method().clone(), path.as_str()) {
        (Method::GET, "/health") => text(StatusCode::OK, "ok".into()),
        (Method::GET, "/stats") => text(StatusCode::OK, shared.stats()),
        (Method::GET, "/v1/models") => text(
            StatusCode::OK,
            format!(r#"{{"object":"list","data":[{{"id":"{MODEL}","object":"model"}}]}}"#),
        ),
        (Method::GET, "/v1/stream") => {
            let events = request
                .uri()
                .query()
                .and_then(|query| query.strip_prefix("events="))
                .and_then(|count| count.parse().ok())
                .unwrap_or(1);
            stream(shared, Script::Plain { events })
        }
        (Method::POST, "/v1/chat/completions") => chat(request, shared).await,
        _ => text(StatusCode::NOT_FOUND, "not found".into()),
    }
}

async fn chat(request: Request<Incoming>, shared: Arc<Upstream>) -> Response<UpstreamBody> {
    let cut = request
        .headers()
        .get(CUT_HEADER)
        .and_then(|value| value.to_str().ok()?.parse().ok());
    let Ok(body) = request.into_body().collect().await else {
        return text(StatusCode::BAD_REQUEST, "unreadable body".into());
    };
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    match chat_script(&body.to_bytes(), id, cut) {
        Some(script) => stream(shared, script),
        None => text(StatusCode::BAD_REQUEST, "not a chat request".into()),
    }
}

/// The answer to a chat request: `max_tokens` tokens, counted on from the last number of the text so far
/// when the request continues an assistant message (tongs' continuation after a cut, which is not cut
/// again), else from 1.
fn chat_script(body: &[u8], id: u64, cut: Option<u64>) -> Option<Script> {
    let request: serde_json::Value = serde_json::from_slice(body).ok()?;
    let count = request.get("max_tokens")?.as_u64()?;
    let last_message = request.get("messages")?.as_array()?.last()?;
    let done = if last_message["role"] == "assistant" {
        let text = last_message["content"].as_str()?;
        text.split_whitespace().last()?.parse().ok()?
    } else {
        0
    };
    Some(Script::Chat {
        id,
        created: unix_us() / 1_000_000,
        first: done + 1,
        last: done + count,
        cut: cut.filter(|_| done == 0),
    })
}

fn text(status: StatusCode, body: String) -> Response<UpstreamBody> {
    let body = Full::new(Bytes::from(body))
        .map_err(|never: std::convert::Infallible| -> std::io::Error { match never {} })
        .boxed_unsync();
    let mut response = Response::new(body);
    *response.status_mut() = status;
    response
}

fn stream(shared: Arc<Upstream>, script: Script) -> Response<UpstreamBody> {
    let (sender, body) = Channel::<Bytes, std::io::Error>::new(4);
    shared.open.fetch_add(1, Ordering::Relaxed);
    tokio::spawn(feed(shared, sender, script));
    tongs::sim::sse_response(body.boxed_unsync())
}

/// Sends `script`'s steps on time, each stamped as it goes.
async fn feed(shared: Arc<Upstream>, mut sender: Sender<Bytes, std::io::Error>, script: Script) {
    let start = Instant::now();
    for step in 0..script.steps() {
        let at = start + shared.gap * u32::try_from(step).unwrap_or(u32::MAX);
        tokio::time::sleep_until(at).await;
        let (event, cut) = script.step(step, clock_us(shared.base_us));
        if sender.send_data(Bytes::from(event)).await.is_err() {
            return shared.ended(&shared.cut);
        }
        if cut {
            // hyper drops what it has not yet written when a body fails: let the last event go first.
            tokio::time::sleep(shared.gap).await;
            sender.abort(std::io::Error::other("the bench cut this stream"));
            return shared.ended(&shared.cut);
        }
    }
    shared.ended(&shared.completed);
}

impl Upstream {
    fn ended(&self, outcome: &AtomicU64) {
        outcome.fetch_add(1, Ordering::Relaxed);
        self.open.fetch_sub(1, Ordering::Relaxed);
    }

    /// "open completed cut".
    fn stats(&self) -> String {
        let load = |count: &AtomicU64| count.load(Ordering::Relaxed);
        format!(
            "{} {} {}",
            load(&self.open),
            load(&self.completed),
            load(&self.cut)
        )
    }
}

/// The upstream as the bench sees it: the child process and its two endpoints.
struct UpstreamProcess {
    process: Process,
    addrs: Vec<SocketAddr>,
    _dir: TempDir,
}

/// What the upstream has sent: streams open now, sent whole, cut (by the bench, or a reader gone).
#[derive(Clone, Copy, Default)]
struct UpstreamStats {
    open: u64,
    completed: u64,
    cut: u64,
}

impl UpstreamProcess {
    fn start(settings: &Settings, base_us: u64) -> Result<UpstreamProcess> {
        let dir = TempDir::new("streams-upstream")?;
        let port = support::free_addr()?.port();
        let binary = std::env::current_exe().context("finding this benchmark's binary")?;
        let mut command = Command::new(binary);
        command.args([
            UPSTREAM_ARG.to_owned(),
            port.to_string(),
            settings.gap.as_micros().to_string(),
            base_us.to_string(),
        ]);
        let mut process = Process::spawn("the upstream", command, dir.path().join("upstream.log"))?;
        let addrs: Vec<SocketAddr> = UPSTREAM_HOSTS
            .iter()
            .map(|&host| SocketAddr::from((host, port)))
            .collect();
        for &addr in &addrs {
            process.wait_listening(addr, Duration::from_secs(10))?;
        }
        Ok(UpstreamProcess {
            process,
            addrs,
            _dir: dir,
        })
    }

    /// The upstream's counts; None when it does not answer.
    async fn stats(&self) -> Option<UpstreamStats> {
        let (_, text) = support::get(&format!("http://{}/stats", self.addrs[0]))
            .await
            .ok()?;
        let mut numbers = text.split_whitespace().map(str::parse::<u64>);
        Some(UpstreamStats {
            open: numbers.next()?.ok()?,
            completed: numbers.next()?.ok()?,
            cut: numbers.next()?.ok()?,
        })
    }
}

// ---------------------------------------------------------------------------------------------------
// The clients.

/// What every stream of a run adds to as it goes.
#[derive(Default)]
struct Live {
    /// Events received, all streams.
    events: AtomicU64,
    /// Streams whose answer has begun and not yet ended.
    open: AtomicU64,
}

/// Counts a stream open while it lives.
struct OpenGuard<'a>(&'a Live);

impl<'a> OpenGuard<'a> {
    fn new(live: &'a Live) -> OpenGuard<'a> {
        live.open.fetch_add(1, Ordering::Relaxed);
        OpenGuard(live)
    }
}

impl Drop for OpenGuard<'_> {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Where a run's streams go and what they ask for.
#[derive(Clone)]
struct Target {
    kind: Kind,
    /// Stream `i` connects to `addrs[i % len]`.
    addrs: Vec<SocketAddr>,
    tokens: u64,
    base_us: u64,
    timeout: Duration,
}

impl Target {
    fn with_tokens(&self, tokens: u64) -> Target {
        Target {
            tokens,
            ..self.clone()
        }
    }

    fn request(&self, cut: Option<u64>) -> Result<Request<Full<Bytes>>> {
        let builder = match self.kind {
            Kind::Plain => Request::get(format!("/v1/stream?events={}", self.tokens)),
            Kind::OpenAi => Request::post("/v1/chat/completions")
                .header(header::CONTENT_TYPE, "application/json"),
        };
        let mut builder = builder
            .header(header::HOST, "streams.bench")
            .header(header::ACCEPT, "text/event-stream");
        if let Some(token) = cut {
            builder = builder.header(CUT_HEADER, token.to_string());
        }
        let body = match self.kind {
            Kind::Plain => Bytes::new(),
            Kind::OpenAi => Bytes::from(chat_request(self.tokens)),
        };
        Ok(builder.body(Full::new(body))?)
    }
}

/// Reads one stream's events as they come, each checked against what the upstream sends.
struct Reader {
    kind: Kind,
    tokens: u64,
    /// The next event's number: `plain`'s `n`, or the next token (0: the chunk opening the message).
    next: u64,
    /// `[DONE]` came.
    done: bool,
    /// The delay of every stamped event, µs.
    delays: Vec<u32>,
}

impl Reader {
    fn new(kind: Kind, tokens: u64) -> Reader {
        Reader {
            kind,
            tokens,
            next: 0,
            done: false,
            delays: Vec::with_capacity(tokens as usize + 1),
        }
    }

    /// Reads the whole events at the start of `pending` (taking them out), received at `arrival_us`;
    /// returns how many there were.
    fn take(&mut self, pending: &mut Vec<u8>, arrival_us: u64) -> Result<u64> {
        let mut consumed = 0;
        let mut count = 0;
        while let Some(end) = pending[consumed..].windows(2).position(|w| w == b"\n\n") {
            let event = std::str::from_utf8(&pending[consumed..consumed + end])
                .context("an event that is not UTF-8")?;
            self.event(event, arrival_us)?;
            consumed += end + 2;
            count += 1;
        }
        pending.drain(..consumed);
        Ok(count)
    }

    fn event(&mut self, event: &str, arrival_us: u64) -> Result<()> {
        ensure!(!self.done, "an event after [DONE]: {event:?}");
        let data = event
            .strip_prefix("data: ")
            .with_context(|| format!("not a data event: {event:?}"))?;
        if data == "[DONE]" {
            ensure!(
                self.kind == Kind::OpenAi && self.next == self.tokens + 1,
                "[DONE] after {} of {} tokens",
                self.next.saturating_sub(1),
                self.tokens
            );
            self.done = true;
            return Ok(());
        }
        let number = match (self.kind, self.next) {
            (Kind::OpenAi, 0) => data.contains(ROLE).then_some(0),
            (Kind::OpenAi, _) => number_after(data, "\"content\":"),
            (Kind::Plain, _) => number_after(data, "\"n\":"),
        };
        ensure!(
            number == Some(self.next),
            "expected event {} of {}, got {data}",
            self.next,
            self.tokens
        );
        let last = self.kind == Kind::OpenAi && self.next == self.tokens;
        ensure!(
            !last || data.contains(LENGTH),
            "the last token's chunk does not end with finish_reason \"length\": {data}"
        );
        let sent_us =
            number_after(data, "\"sent_us\":").context("an event without its send time")?;
        let delay = arrival_us.saturating_sub(sent_us);
        self.delays.push(u32::try_from(delay).unwrap_or(u32::MAX));
        self.next += 1;
        Ok(())
    }

    fn finish(self) -> Result<Vec<u32>> {
        match self.kind {
            Kind::Plain => ensure!(
                self.next == self.tokens,
                "the stream ended after {} of {} events",
                self.next,
                self.tokens
            ),
            Kind::OpenAi => ensure!(
                self.done,
                "the stream ended after {} of {} tokens, without [DONE]",
                self.next.saturating_sub(1),
                self.tokens
            ),
        }
        Ok(self.delays)
    }
}

/// Stream `index` of a run, whole, within the target's time: the delay of each event, µs.
async fn one_stream(
    target: &Target,
    index: usize,
    live: &Live,
    cut: Option<u64>,
) -> Result<Vec<u32>> {
    let addr = target.addrs[index % target.addrs.len()];
    tokio::time::timeout(target.timeout, read_stream(target, addr, live, cut))
        .await
        .with_context(|| format!("no end within {}", seconds(target.timeout)))?
}

async fn read_stream(
    target: &Target,
    addr: SocketAddr,
    live: &Live,
    cut: Option<u64>,
) -> Result<Vec<u32>> {
    let stream = TcpStream::connect(addr)
        .await
        .with_context(|| format!("connect to {addr}"))?;
    stream.set_nodelay(true)?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .context("handshake")?;
    tokio::spawn(connection);
    let response = sender
        .send_request(target.request(cut)?)
        .await
        .context("request")?;
    ensure!(
        response.status() == StatusCode::OK,
        "status {}",
        response.status()
    );
    let _open = OpenGuard::new(live);
    let mut body = response.into_body();
    let mut reader = Reader::new(target.kind, target.tokens);
    let mut pending = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.context("the stream broke")?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let arrival_us = clock_us(target.base_us);
        pending.extend_from_slice(&data);
        let events = reader.take(&mut pending, arrival_us)?;
        live.events.fetch_add(events, Ordering::Relaxed);
    }
    ensure!(
        pending.is_empty(),
        "the stream ended inside an event: {:?}",
        String::from_utf8_lossy(&pending)
    );
    reader.finish()
}

type StreamTask = JoinHandle<Result<Vec<u32>>>;

/// Starts the run's streams, spread evenly over the ramp from `t0`.
fn start_streams(
    target: &Arc<Target>,
    live: &Arc<Live>,
    settings: &Settings,
    t0: Instant,
) -> Vec<StreamTask> {
    let streams = settings.streams;
    (0..streams)
        .map(|index| {
            let (target, live) = (Arc::clone(target), Arc::clone(live));
            let at = t0 + settings.ramp.mul_f64(index as f64 / streams as f64);
            tokio::spawn(async move {
                tokio::time::sleep_until(at).await;
                one_stream(&target, index, &live, None).await
            })
        })
        .collect()
}

/// How a run's streams ended.
struct Ended {
    clean: usize,
    failed: usize,
    /// The first few failures, for the report.
    failures: Vec<String>,
    /// Every event's delay, µs.
    delays: Histogram<u64>,
}

async fn collect(tasks: Vec<StreamTask>) -> Ended {
    let mut ended = Ended {
        clean: 0,
        failed: 0,
        failures: Vec::new(),
        delays: latency_histogram(),
    };
    for task in tasks {
        let outcome = match task.await {
            Ok(Ok(delays)) => Ok(delays),
            Ok(Err(err)) => Err(format!("{err:#}")),
            Err(err) => Err(err.to_string()),
        };
        match outcome {
            Ok(delays) => {
                ended.clean += 1;
                for delay in delays {
                    ended.delays.saturating_record(u64::from(delay).max(1));
                }
            }
            Err(why) => {
                ended.failed += 1;
                if ended.failures.len() < 5 {
                    ended.failures.push(why);
                }
            }
        }
    }
    ended
}

// ---------------------------------------------------------------------------------------------------
// The paths: straight to the upstream, through tongs, through nginx.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    Direct,
    Tongs,
    Nginx,
}

const PATHS: [Path; 3] = [Path::Direct, Path::Tongs, Path::Nginx];

/// A path ready for a row: the proxy running (none for the direct path).
struct Running {
    label: String,
    /// Where the clients connect.
    addrs: Vec<SocketAddr>,
    /// The proxy's processes (none for the direct path).
    pids: Vec<u32>,
    tongs: Option<TongsProcess>,
    _nginx: Option<NginxSse>,
}

/// What the bench shares between its rows.
struct Bench {
    settings: Settings,
    upstream: UpstreamProcess,
    nginx: PathBuf,
    base_us: u64,
}

impl Bench {
    fn target(&self, kind: Kind, addrs: &[SocketAddr]) -> Target {
        Target {
            kind,
            addrs: addrs.to_vec(),
            tokens: self.settings.tokens(),
            base_us: self.base_us,
            timeout: self.settings.stream_timeout(),
        }
    }

    async fn start(&self, path: Path) -> Result<Running> {
        let upstreams = &self.upstream.addrs;
        let running = match path {
            Path::Direct => Running {
                label: "direct (no proxy)".into(),
                addrs: upstreams.clone(),
                pids: Vec::new(),
                tongs: None,
                _nginx: None,
            },
            Path::Tongs => {
                let config =
                    support::static_discovery(upstreams.iter().map(|a| format!("http://{a}")));
                let tongs = TongsProcess::start(&config)
                    .await
                    .context("starting tongs")?;
                Running {
                    label: "tongs".into(),
                    addrs: vec![tongs.addr],
                    pids: tongs.process.pids(),
                    tongs: Some(tongs),
                    _nginx: None,
                }
            }
            Path::Nginx => {
                let streams = self.settings.streams;
                let nginx =
                    NginxSse::start(&self.nginx, upstreams, streams, "streams-nginx").await?;
                Running {
                    label: nginx.label.clone(),
                    addrs: vec![nginx.addr],
                    pids: nginx.process.pids(),
                    tongs: None,
                    _nginx: Some(nginx),
                }
            }
        };
        Ok(running)
    }
}

/// Why tongs cannot hold `streams` streams here: two file descriptors a stream in its one process.
fn tongs_shortfall(tongs: &TongsProcess, streams: usize) -> Option<String> {
    let pid = tongs.process.pid();
    let (soft, hard) = support::open_file_limits(pid)?;
    let idle = support::usage(&[pid]).fds;
    let need = idle + 2 * streams as u64 + FD_MARGIN;
    (need > soft).then(|| {
        format!(
            "not run: tongs would need about {need} file descriptors (two a stream: the client's connection and \
             the upstream's, in one process; {idle} open idle; {FD_MARGIN} to spare) and may open {soft} (hard \
             limit {hard}): it fits at most {} streams here",
            soft.saturating_sub(idle + FD_MARGIN) / 2
        )
    })
}

/// What tongs counted during a row: streams cut, continuations (every outcome), pauses, hedges.
#[derive(Clone, Copy, Default)]
struct TongsCounts {
    cut: f64,
    continuations: f64,
    pauses: f64,
    hedges: f64,
}

impl TongsCounts {
    async fn read(tongs: &TongsProcess) -> Result<TongsCounts> {
        let text = metrics(tongs).await?;
        Ok(TongsCounts {
            cut: sum_samples(&text, "tongs_streams_cut_total", ""),
            continuations: sum_samples(&text, "tongs_continuations_total", ""),
            pauses: sum_samples(&text, "tongs_stream_pauses_total", ""),
            hedges: sum_samples(&text, "tongs_hedges_total", ""),
        })
    }

    fn since(self, before: TongsCounts) -> TongsCounts {
        TongsCounts {
            cut: self.cut - before.cut,
            continuations: self.continuations - before.continuations,
            pauses: self.pauses - before.pauses,
            hedges: self.hedges - before.hedges,
        }
    }

    fn any(&self) -> bool {
        self.cut + self.continuations + self.pauses + self.hedges > 0.0
    }
}

/// tongs' Prometheus text.
async fn metrics(tongs: &TongsProcess) -> Result<String> {
    let (status, text) = support::get(&format!("http://{}/metrics", tongs.admin)).await?;
    ensure!(status == 200, "tongs' /metrics answered {status}");
    Ok(text)
}

/// The sum of the samples of `name` whose labels contain `label` (every one for "").
fn sum_samples(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let labels = series.strip_prefix(name)?;
            let wanted = labels.is_empty() || labels.starts_with('{');
            (wanted && labels.contains(label)).then(|| value.parse::<f64>().ok())?
        })
        .sum()
}

/// Shows that tongs relays the chat streams as continuable: a probe stream the upstream breaks after its
/// second token reaches the client whole, continued on the other endpoint, and
/// `tongs_continuations_total{outcome="continued"}` counts it.
async fn verify_continuable(tongs: &TongsProcess, target: &Target) -> Result<String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = metrics(tongs).await?;
        let ready = sum_samples(&text, "tongs_endpoints", "state=\"healthy\"")
            + sum_samples(&text, "tongs_endpoints", "state=\"slow-start\"");
        if ready >= 2.0 {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "tongs did not take both endpoints within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let continued =
        |text: &str| sum_samples(text, "tongs_continuations_total", "outcome=\"continued\"");
    let before = continued(&metrics(tongs).await?);
    let probe = target.with_tokens(PROBE_TOKENS);
    one_stream(&probe, 0, &Live::default(), Some(PROBE_CUT))
        .await
        .context("the continuation probe did not reach the client whole")?;
    let after = continued(&metrics(tongs).await?);
    ensure!(
        after == before + 1.0,
        "tongs did not continue the probe stream (tongs_continuations_total{{outcome=\"continued\"}} \
         {before} → {after}): it does not relay these chat streams as continuable"
    );
    Ok(format!(
        "tongs relays the `openai` streams as continuable: a probe stream of the same request ({PROBE_TOKENS} \
         tokens) that the upstream broke after token {PROBE_CUT} reached the client whole and in order, and \
         tongs_continuations_total{{outcome=\"continued\"}} went from {before} to {after} (read from its \
         /metrics before the idle figure)."
    ))
}

// ---------------------------------------------------------------------------------------------------
// One row: a kind of stream on a path.

/// What a row measured over the window in which every stream is open.
struct Window {
    length: Duration,
    /// The proxy's CPU time in it.
    cpu: Duration,
    /// Events the clients received in it.
    events: u64,
    /// The machine's CPUs' busy share in it (every process), percent.
    busy_percent: Option<f64>,
    /// The proxy's usage in its middle, and the streams open then at the upstream and at the clients.
    mid: Usage,
    upstream_open: Option<u64>,
    clients_open: u64,
}

struct Figures {
    streams: usize,
    ended: Ended,
    /// The proxy's usage before the streams and after them (nothing for the direct path).
    idle: Usage,
    end: Usage,
    window: Window,
    /// From before the first stream to after the last: the proxy's CPU, the events received.
    total_cpu: Duration,
    total_events: u64,
    /// The upstream's streams sent whole and cut during the row.
    upstream: Option<(u64, u64)>,
    tongs: Option<TongsCounts>,
    /// How tongs was shown to relay the streams as continuable.
    verified: Option<String>,
}

struct Row {
    kind: Kind,
    path: Path,
    label: String,
    /// The figures, or why there are none.
    outcome: Result<Figures, String>,
}

async fn row(bench: &Bench, kind: Kind, path: Path) -> Row {
    eprintln!(
        "streams: {} streams of {}, {path:?} …",
        bench.settings.streams,
        kind.name(),
    );
    let running = match bench.start(path).await {
        Ok(running) => running,
        Err(err) => {
            let label = format!("{path:?}").to_lowercase();
            let outcome = Err(format!("{err:#}"));
            return Row {
                kind,
                path,
                label,
                outcome,
            };
        }
    };
    let outcome = measure(bench, kind, &running)
        .await
        .map_err(|err| format!("{err:#}"));
    Row {
        kind,
        path,
        label: running.label.clone(),
        outcome,
    }
}

async fn measure(bench: &Bench, kind: Kind, running: &Running) -> Result<Figures> {
    let settings = &bench.settings;
    if let Some(why) = running
        .tongs
        .as_ref()
        .and_then(|tongs| tongs_shortfall(tongs, settings.streams))
    {
        bail!(why);
    }
    let target = Arc::new(bench.target(kind, &running.addrs));
    let verified = warm_up(running, kind, &target).await?;
    tokio::time::sleep(settings.settle).await;
    let idle = support::usage(&running.pids);
    let upstream_before = bench.upstream.stats().await;
    let tongs_before = match &running.tongs {
        Some(tongs) => Some(TongsCounts::read(tongs).await?),
        None => None,
    };
    let live = Arc::new(Live::default());
    let t0 = Instant::now() + Duration::from_millis(50);
    let tasks = start_streams(&target, &live, settings, t0);
    let window = observe(bench, &running.pids, &live, t0).await;
    let ended = collect(tasks).await;
    let end = support::usage(&running.pids);
    let upstream = match (upstream_before, bench.upstream.stats().await) {
        (Some(before), Some(after)) => {
            Some((after.completed - before.completed, after.cut - before.cut))
        }
        _ => None,
    };
    let tongs = match (&running.tongs, tongs_before) {
        (Some(tongs), Some(before)) => TongsCounts::read(tongs)
            .await
            .ok()
            .map(|after| after.since(before)),
        _ => None,
    };
    tokio::time::sleep(settings.settle).await;
    Ok(Figures {
        streams: settings.streams,
        ended,
        idle,
        end,
        window,
        total_cpu: end.cpu.saturating_sub(idle.cpu),
        total_events: live.events.load(Ordering::Relaxed),
        upstream,
        tongs,
        verified,
    })
}

/// Two short streams, so one-time set-up is in the idle figure; through tongs, for chat streams, the
/// continuation probe as well.
async fn warm_up(running: &Running, kind: Kind, target: &Target) -> Result<Option<String>> {
    let warm = target.with_tokens(WARM_TOKENS);
    for index in 0..2 {
        one_stream(&warm, index, &Live::default(), None)
            .await
            .with_context(|| format!("a warm-up stream through {}", running.label))?;
    }
    match (&running.tongs, kind) {
        (Some(tongs), Kind::OpenAi) => Ok(Some(verify_continuable(tongs, target).await?)),
        _ => Ok(None),
    }
}

/// A point in the window: when, the proxy's CPU, the events so far, the machine's CPU counters.
struct Mark {
    at: Instant,
    cpu: Duration,
    events: u64,
    machine: Option<(u64, u64)>,
}

impl Mark {
    fn take(pids: &[u32], live: &Live) -> Mark {
        Mark {
            at: Instant::now(),
            cpu: support::usage(pids).cpu,
            events: live.events.load(Ordering::Relaxed),
            machine: machine_cpu(),
        }
    }
}

/// The machine's CPU time, busy and in all, in clock ticks since boot (`/proc/stat`).
fn machine_cpu() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let fields: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .filter_map(|field| field.parse().ok())
        .collect();
    let total: u64 = fields.iter().take(8).sum();
    // idle and iowait are the 4th and 5th.
    let idle = fields.get(3)? + fields.get(4)?;
    Some((total - idle, total))
}

/// Samples the proxy over the window in which every stream is open.
async fn observe(bench: &Bench, pids: &[u32], live: &Live, t0: Instant) -> Window {
    let (start, mid, end) = bench.settings.window(t0);
    tokio::time::sleep_until(start).await;
    let first = Mark::take(pids, live);
    tokio::time::sleep_until(mid).await;
    let mid_usage = support::usage(pids);
    let clients_open = live.open.load(Ordering::Relaxed);
    let upstream_open = tokio::time::timeout_at(end, bench.upstream.stats())
        .await
        .ok()
        .flatten()
        .map(|stats| stats.open);
    tokio::time::sleep_until(end).await;
    let last = Mark::take(pids, live);
    let busy_percent = match (first.machine, last.machine) {
        (Some((busy0, total0)), Some((busy1, total1))) if total1 > total0 => {
            Some((busy1 - busy0) as f64 * 100.0 / (total1 - total0) as f64)
        }
        _ => None,
    };
    Window {
        length: last.at - first.at,
        cpu: last.cpu.saturating_sub(first.cpu),
        events: last.events - first.events,
        busy_percent,
        mid: mid_usage,
        upstream_open,
        clients_open,
    }
}

// ---------------------------------------------------------------------------------------------------
// The report.

impl Figures {
    fn per_stream_kib(&self) -> f64 {
        (self.window.mid.rss_kib as f64 - self.idle.rss_kib as f64) / self.streams as f64
    }

    /// The peak RSS (VmHWM), never below an RSS sampled (the kernel updates VmHWM lazily).
    fn peak_rss_kib(&self) -> u64 {
        let mid = &self.window.mid;
        self.end.peak_rss_kib.max(mid.peak_rss_kib).max(mid.rss_kib)
    }

    fn cpu_per_event_us(&self) -> f64 {
        self.window.cpu.as_secs_f64() * 1e6 / self.window.events.max(1) as f64
    }

    /// The delay at `quantile` (1.0: the largest), ms.
    fn delay_ms(&self, quantile: f64) -> f64 {
        let delays = &self.ended.delays;
        let us = if quantile >= 1.0 {
            delays.max()
        } else {
            delays.value_at_quantile(quantile)
        };
        us as f64 / 1000.0
    }

    fn all_open(&self) -> bool {
        self.window.clients_open == self.streams as u64
            && self
                .window
                .upstream_open
                .is_some_and(|open| open >= self.streams as u64)
    }
}

const QUANTILES: [f64; 3] = [0.5, 0.99, 1.0];

fn delays_cell(figures: &Figures) -> String {
    if figures.ended.delays.is_empty() {
        return "—".into();
    }
    let [p50, p99, max] = QUANTILES.map(|q| figures.delay_ms(q));
    format!("{p50:.3} / {p99:.3} / {max:.3}")
}

fn added_cell(figures: &Figures, direct: Option<&Figures>) -> String {
    match direct {
        Some(direct) if !figures.ended.delays.is_empty() && !direct.ended.delays.is_empty() => {
            let [p50, p99, max] = QUANTILES.map(|q| figures.delay_ms(q) - direct.delay_ms(q));
            format!("{p50:+.3} / {p99:+.3} / {max:+.3}")
        }
        _ => "—".into(),
    }
}

/// The cells of a measured row, from "ended cleanly" on.
fn cells(path: Path, figures: &Figures, direct: Option<&Figures>) -> Vec<String> {
    let busy = figures
        .window
        .busy_percent
        .map_or_else(|| "—".into(), |busy| format!("{busy:.0} %"));
    let mut ended = format!("{} / {}", figures.ended.clean, figures.streams);
    if figures.ended.failed > 0 {
        ended.push_str(&format!(" (**{} failed**)", figures.ended.failed));
    }
    let delays = [delays_cell(figures), added_cell(figures, direct), busy];
    if path == Path::Direct {
        let delays = [delays_cell(figures), "—".to_owned(), delays[2].clone()];
        let mut row = vec![ended];
        row.extend(std::iter::repeat_n("—".to_owned(), 9));
        row.extend(delays);
        return row;
    }
    let mut row = vec![
        ended,
        mib(figures.idle.rss_kib),
        mib(figures.window.mid.rss_kib),
        format!("{:.2} KiB", figures.per_stream_kib()),
        mib(figures.peak_rss_kib()),
        figures.window.events.to_string(),
        format!(
            "{:.2} s of {:.1} s",
            figures.window.cpu.as_secs_f64(),
            figures.window.length.as_secs_f64()
        ),
        format!("{:.2} µs", figures.cpu_per_event_us()),
        figures.total_events.to_string(),
        format!("{:.2} s", figures.total_cpu.as_secs_f64()),
    ];
    row.extend(delays);
    row
}

const COLUMNS: [&str; 15] = [
    "kind",
    "path",
    "streams ended cleanly",
    "idle RSS",
    "RSS, all open",
    "memory per open stream",
    "peak RSS",
    "events in window",
    "CPU in window",
    "CPU per event",
    "events, whole run",
    "CPU, whole run",
    "delay ms p50 / p99 / max",
    "added by the proxy ms p50 / p99 / max",
    "CPUs busy in window",
];

fn table(out: &mut String, rows: &[Row]) -> fmt::Result {
    writeln!(out, "| {} |", COLUMNS.join(" | "))?;
    let align: Vec<&str> = COLUMNS
        .iter()
        .enumerate()
        .map(|(i, _)| if i < 2 { "---" } else { "---:" })
        .collect();
    writeln!(out, "| {} |", align.join(" | "))?;
    for row in rows {
        let direct = rows
            .iter()
            .find(|other| other.kind == row.kind && other.path == Path::Direct)
            .and_then(|direct| direct.outcome.as_ref().ok());
        let cells = match &row.outcome {
            Ok(figures) => cells(row.path, figures, direct),
            Err(_) => {
                let mut cells = vec!["**not measured** (below)".to_owned()];
                cells.extend(std::iter::repeat_n("—".to_owned(), COLUMNS.len() - 3));
                cells
            }
        };
        writeln!(
            out,
            "| {} | {} | {} |",
            row.kind.name(),
            row.label,
            cells.join(" | ")
        )?;
    }
    Ok(())
}

/// What the run was: settings, machine, versions, limits.
fn preamble(out: &mut String, bench: &Bench, limits: Option<(u64, u64)>) -> fmt::Result {
    let settings = &bench.settings;
    let (start, _, end) = settings.window(Instant::now());
    writeln!(
        out,
        "## streams: {} concurrent long streams straight to the upstream, through tongs, through nginx\n",
        settings.streams
    )?;
    writeln!(out, "- date: {}", support::now_utc())?;
    writeln!(out, "- machine: {}, Linux {}", support::machine(), kernel())?;
    writeln!(
        out,
        "- versions: tongs {} (release binary, own process, defaults); {}; nginx running as {}",
        tongs_version(),
        nginx_version(bench),
        if is_root() {
            "root (its workers set their own open-file limit)"
        } else {
            "this user"
        },
    )?;
    writeln!(
        out,
        "- settings: STREAMS={}, STREAM_SECONDS={}, EVENT_GAP={} ms, {} events a stream, RAMP={}; one connection \
         a stream; measured window {} (from two gaps after the last start to two gaps before the first end)",
        settings.streams,
        settings.stream_time.as_secs_f64(),
        settings.gap.as_millis(),
        settings.tokens(),
        seconds(settings.ramp),
        seconds(end - start),
    )?;
    let limits = limits.map_or_else(
        || "unknown".into(),
        |(soft, hard)| format!("{soft} (hard {hard})"),
    );
    writeln!(
        out,
        "- open-file limit of every process here: {limits}; load average (1 min) at the start: {}\n",
        support::load_average()
    )
}

fn notes(out: &mut String, rows: &[Row], soft_limit: Option<u64>) -> fmt::Result {
    writeln!(out)?;
    for row in rows {
        let what = format!("{} through {}", row.kind.name(), row.label);
        let figures = match &row.outcome {
            Ok(figures) => figures,
            Err(why) => {
                writeln!(out, "- **{what}: not measured**: {why}")?;
                continue;
            }
        };
        row_notes(out, &what, row.path, figures, soft_limit)?;
    }
    comparisons(out, rows)?;
    verdict(out, rows)
}

fn row_notes(
    out: &mut String,
    what: &str,
    path: Path,
    figures: &Figures,
    soft_limit: Option<u64>,
) -> fmt::Result {
    if let Some(verified) = &figures.verified {
        writeln!(out, "- {verified}")?;
    }
    if figures.ended.failed > 0 {
        writeln!(
            out,
            "- **{what}: {} of {} streams failed**; the first: {}",
            figures.ended.failed,
            figures.streams,
            figures.ended.failures.join("; ")
        )?;
    }
    if !figures.all_open() {
        writeln!(
            out,
            "- {what}: in the middle of the window {} streams were open at the clients and {} at the upstream, \
             not all {}: the memory figure is of fewer streams",
            figures.window.clients_open,
            figures
                .window
                .upstream_open
                .map_or_else(|| "unknown".into(), |open| open.to_string()),
            figures.streams
        )?;
    }
    if let Some((_, cut)) = figures.upstream.filter(|&(_, cut)| cut > 0) {
        writeln!(
            out,
            "- {what}: the upstream saw {cut} streams go before their end"
        )?;
    }
    if let Some(counts) = figures.tongs.filter(TongsCounts::any) {
        writeln!(
            out,
            "- {what}: during the streams tongs cut {} streams, counted {} continuations, {} pauses, {} hedges",
            counts.cut, counts.continuations, counts.pauses, counts.hedges
        )?;
    }
    if path == Path::Tongs {
        let (idle, open) = (figures.idle.fds, figures.window.mid.fds);
        write!(
            out,
            "- {what}: tongs held {idle} file descriptors idle and {open} with the streams open ({:.2} a stream)",
            (open as f64 - idle as f64) / figures.streams as f64
        )?;
        if let Some(soft) = soft_limit {
            let most = soft.saturating_sub(idle + FD_MARGIN) / 2;
            write!(
                out,
                ": with {soft} allowed it fits at most about {most} streams here"
            )?;
        }
        writeln!(out)?;
    }
    Ok(())
}

/// `a / b` as "1.23×", or "—" when `b` is not positive.
fn ratio(a: f64, b: f64) -> String {
    if b > 0.0 {
        format!("{:.2}×", a / b)
    } else {
        "—".into()
    }
}

/// tongs against nginx, and tongs' `openai` against its `plain`.
fn comparisons(out: &mut String, rows: &[Row]) -> fmt::Result {
    let find = |kind: Kind, path: Path| {
        rows.iter()
            .find(|row| row.kind == kind && row.path == path)
            .and_then(|row| row.outcome.as_ref().ok())
    };
    for kind in [Kind::Plain, Kind::OpenAi] {
        if let (Some(tongs), Some(nginx)) = (find(kind, Path::Tongs), find(kind, Path::Nginx)) {
            writeln!(
                out,
                "- {}: tongs / nginx: memory per open stream {} ({:.2} / {:.2} KiB), CPU per event {} \
                 ({:.2} / {:.2} µs), p50 delay {:.3} / {:.3} ms",
                kind.name(),
                ratio(tongs.per_stream_kib(), nginx.per_stream_kib()),
                tongs.per_stream_kib(),
                nginx.per_stream_kib(),
                ratio(tongs.cpu_per_event_us(), nginx.cpu_per_event_us()),
                tongs.cpu_per_event_us(),
                nginx.cpu_per_event_us(),
                tongs.delay_ms(0.5),
                nginx.delay_ms(0.5),
            )?;
        }
    }
    if let (Some(plain), Some(openai)) = (
        find(Kind::Plain, Path::Tongs),
        find(Kind::OpenAi, Path::Tongs),
    ) {
        writeln!(
            out,
            "- tongs, openai − plain: memory per open stream {:+.2} KiB ({}), CPU per event {:+.2} µs ({}): \
             what the `openai` relay does besides passing the bytes on: parse every chunk, keep the text so far",
            openai.per_stream_kib() - plain.per_stream_kib(),
            ratio(openai.per_stream_kib(), plain.per_stream_kib()),
            openai.cpu_per_event_us() - plain.cpu_per_event_us(),
            ratio(openai.cpu_per_event_us(), plain.cpu_per_event_us()),
        )?;
    }
    Ok(())
}

fn verdict(out: &mut String, rows: &[Row]) -> fmt::Result {
    let failed: usize = rows
        .iter()
        .filter_map(|row| row.outcome.as_ref().ok())
        .map(|figures| figures.ended.failed)
        .sum();
    let unmeasured = rows.iter().filter(|row| row.outcome.is_err()).count();
    writeln!(
        out,
        "\nDelays are from the upstream's send to the client's read, both on the system clock (the upstream \
         is another process); \"added by the proxy\" is the row's figure less the direct run's of the same \
         kind. The machine's CPUs are shared by the clients, the upstream and the proxy: \"CPUs busy\" says \
         how loaded it was. nginx's RSS sums its master and workers (shared pages counted in each).\n"
    )?;
    match (failed, unmeasured) {
        (0, 0) => writeln!(
            out,
            "**Every stream ended cleanly with every event in order.**"
        ),
        _ => writeln!(
            out,
            "**This run is marked: {failed} streams failed, {unmeasured} rows were not measured.**"
        ),
    }
}

fn kernel() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map_or_else(|_| "unknown".into(), |text| text.trim().to_owned())
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|status| {
        status
            .lines()
            .find(|line| line.starts_with("Uid:"))
            .and_then(|line| line.split_whitespace().nth(2))
            == Some("0")
    })
}

/// "0.1.0 (3ed39f1, with uncommitted changes)".
fn tongs_version() -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .arg("-C")
            .arg(env!("CARGO_MANIFEST_DIR"))
            .args(args)
            .output()
            .ok()
            .filter(|out| out.status.success())
            .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    };
    let commit = git(&["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "commit unknown".into());
    let dirty = git(&["status", "--porcelain", "--untracked-files=no"])
        .is_some_and(|status| !status.is_empty());
    format!(
        "{} ({commit}{})",
        env!("CARGO_PKG_VERSION"),
        if dirty {
            ", with uncommitted changes"
        } else {
            ""
        }
    )
}

fn nginx_version(bench: &Bench) -> String {
    format!("nginx {}", support::program_version(&bench.nginx, "-v"))
}

// ---------------------------------------------------------------------------------------------------

/// Raises this process's soft open-file limit to its hard one (its children inherit it); the limits then.
fn raise_open_file_limit() -> Option<(u64, u64)> {
    let pid = std::process::id();
    let (soft, hard) = support::open_file_limits(pid)?;
    if soft < hard {
        let _ = Command::new("prlimit")
            .arg(format!("--pid={pid}"))
            .arg(format!("--nofile={hard}:{hard}"))
            .status();
    }
    support::open_file_limits(pid)
}

/// Fails when `pid` (the bench, or the upstream) cannot hold a descriptor a stream.
fn check_fds(who: &str, pid: u32, streams: usize) -> Result<()> {
    let Some((soft, hard)) = support::open_file_limits(pid) else {
        return Ok(());
    };
    let need = streams as u64 + FD_MARGIN;
    ensure!(
        need <= soft,
        "{who} needs about {need} file descriptors (one a stream, {FD_MARGIN} to spare) and may open {soft} \
         (hard limit {hard}): lower STREAMS to at most {}, or raise the limit",
        soft.saturating_sub(FD_MARGIN)
    );
    Ok(())
}

async fn run(settings: Settings) -> Result<()> {
    let nginx = support::find_program("nginx").context(
        "nginx is not installed (no `nginx` on PATH or in /usr/sbin): `bash scripts/test.sh` installs it, or \
         `apt-get install nginx`",
    )?;
    let limits = raise_open_file_limit();
    check_fds("the bench's clients", std::process::id(), settings.streams)?;
    let base_us = unix_us();
    let upstream = UpstreamProcess::start(&settings, base_us)?;
    check_fds("the upstream", upstream.process.pid(), settings.streams)?;
    let bench = Bench {
        settings,
        upstream,
        nginx,
        base_us,
    };
    let mut out = String::new();
    preamble(&mut out, &bench, limits)?;
    let started = Instant::now();
    let mut rows = Vec::new();
    for &kind in &bench.settings.kinds {
        for path in PATHS {
            rows.push(row(&bench, kind, path).await);
        }
    }
    table(&mut out, &rows)?;
    notes(&mut out, &rows, limits.map(|(soft, _)| soft))?;
    writeln!(
        out,
        "\nload average (1 min) at the end: {}; the streams took {}.",
        support::load_average(),
        seconds(started.elapsed())
    )?;
    print!("{out}");
    if let Some(path) = &bench.settings.results {
        std::fs::write(path, &out).with_context(|| format!("writing {}", path.display()))?;
        println!("\n(written to {})", path.display());
    }
    if bench.settings.smoke {
        check_smoke(&rows)?;
        println!("streams smoke pass: OK");
    }
    Ok(())
}

/// The smoke pass's checks: every row measured, every stream whole, every figure there; never timing.
fn check_smoke(rows: &[Row]) -> Result<()> {
    ensure!(rows.len() == 2 * PATHS.len(), "{} rows, not 6", rows.len());
    for row in rows {
        let what = format!("{} through {}", row.kind.name(), row.label);
        let figures = match &row.outcome {
            Ok(figures) => figures,
            Err(why) => bail!("{what}: not measured: {why}"),
        };
        ensure!(
            figures.ended.failed == 0 && figures.ended.clean == figures.streams,
            "{what}: {} of {} streams failed: {:?}",
            figures.ended.failed,
            figures.streams,
            figures.ended.failures
        );
        ensure!(!figures.ended.delays.is_empty(), "{what}: no delays");
        ensure!(
            figures.window.events > 0 && figures.total_events > 0,
            "{what}: no events in the window"
        );
        if row.path != Path::Direct {
            ensure!(
                figures.idle.rss_kib > 0
                    && figures.window.mid.rss_kib > 0
                    && figures.peak_rss_kib() > 0,
                "{what}: a memory figure is missing"
            );
        }
        if row.path == Path::Tongs && row.kind == Kind::OpenAi {
            ensure!(figures.verified.is_some(), "{what}: not shown continuable");
        }
    }
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some(UPSTREAM_ARG) {
        return upstream_main(&args[1..]);
    }
    let smoke = !support::benchmarking();
    let settings = Settings::from_env(smoke)?;
    if smoke {
        println!(
            "streams: smoke pass ({} streams of {}); the benchmark is `cargo bench --bench streams`",
            settings.streams,
            seconds(settings.stream_time)
        );
    }
    support::block_on(run(settings))
}
