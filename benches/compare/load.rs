//! The load of the comparison: an open loop that records what each client saw, and wrk's closed loop
//! for throughput, read from its output.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use hdrhistogram::Histogram;
use http::{Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;
use tongs::demo::{AnswerFault, build_request, check_completion};

use super::support::lock;
use super::support::stats::{latency_histogram, micros};

/// A client gives up after this long.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(30);

/// Everything a client saw in one measured window.
pub struct Tally {
    /// Requests sent, warm-up included.
    pub offered: u64,
    pub sent: u64,
    pub succeeded: u64,
    /// Latency of successes to the end of the body, µs.
    pub latency: Histogram<u64>,
    /// Time to the first body byte of successes, µs.
    pub first_byte: Histogram<u64>,
    /// The proxy's own refusals (a 503 that no node sent) and how long they took, µs.
    pub rejected: Histogram<u64>,
    /// Every other failure, by kind.
    pub failures: BTreeMap<String, u64>,
    /// Streams that broke after their first chunk: from their last chunk to the break, µs.
    pub stall_end: Histogram<u64>,
    /// Each successful stream's longest gap between two consecutive body chunks, as the client saw
    /// them (a continuation's pause shows here).
    pub longest_gaps: Vec<Duration>,
    /// When the last success completed, from the start of the measured window.
    pub last_success: Duration,
    /// Each success as (sent, from the start of the measured window; took), both µs: where in the
    /// run a tail sits (written out with `SAMPLES`).
    pub samples: Vec<(u64, u64)>,
    /// Every recorded request, whatever became of it (written out with `SAMPLES`).
    pub records: Vec<Record>,
}

/// One recorded request as its client saw it.
pub struct Record {
    /// Sent, from the start of the measured window, µs.
    pub start: u64,
    /// To the end (or the failure), µs.
    pub took: u64,
    /// To the first body byte, µs, if one came.
    pub first_byte: Option<u64>,
    /// `whole`, `rejected` or the failure's kind.
    pub outcome: String,
    /// The node that answered, as its events name it (`"node":"…"`), if they do.
    pub node: Option<String>,
}

impl Tally {
    fn new() -> Tally {
        Tally {
            offered: 0,
            sent: 0,
            succeeded: 0,
            latency: latency_histogram(),
            first_byte: latency_histogram(),
            rejected: latency_histogram(),
            failures: BTreeMap::new(),
            stall_end: latency_histogram(),
            longest_gaps: Vec::new(),
            last_success: Duration::ZERO,
            samples: Vec::new(),
            records: Vec::new(),
        }
    }

    pub fn failed(&self) -> u64 {
        self.failures.values().sum()
    }
}

enum Outcome {
    Succeeded {
        first_byte: Duration,
        /// A stream's longest gap between two consecutive chunks.
        longest_gap: Option<Duration>,
    },
    Rejected,
    Failed(String),
    /// A stream that broke after its first chunk, this long after its last one.
    Broke {
        silent: Duration,
    },
}

/// What [`exchange`] saw besides the outcome: the first byte and the node that answered.
#[derive(Default)]
struct Seen {
    first_byte: Option<Duration>,
    node: Option<String>,
}

impl Seen {
    fn of(first_byte: Option<Duration>, text: &[u8]) -> Seen {
        const KEY: &[u8] = br#""node":""#;
        let node = text
            .windows(KEY.len())
            .position(|window| window == KEY)
            .and_then(|at| {
                let rest = &text[at + KEY.len()..];
                let end = rest.iter().position(|&b| b == b'"')?;
                Some(String::from_utf8_lossy(&rest[..end]).into_owned())
            });
        Seen { first_byte, node }
    }
}

type LoadClient = Client<HttpConnector, Full<Bytes>>;

/// What each request of the load asks for, and what answer counts as a success.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ask {
    /// `POST /v1/completions`, whole or streamed: the exact answer the simulated model writes
    /// ([`check_completion`]).
    Completion { stream: bool, tokens: u32 },
    /// A plain (non-OpenAI) SSE stream, `POST /generate` with `Accept: text/event-stream`: the node's
    /// own events `data: {"node":…,"token":N}` for N = 0 … `tokens` − 1 from one node, in order,
    /// then `data: [DONE]` (see [`check_plain`]). Nothing in it can be continued on another node.
    PlainStream { tokens: u32 },
}

impl Ask {
    fn streams(self) -> bool {
        match self {
            Ask::Completion { stream, .. } => stream,
            Ask::PlainStream { .. } => true,
        }
    }

    fn request(self, target: &str, index: u64) -> Request<Full<Bytes>> {
        match self {
            Ask::Completion { stream, tokens } => build_request(target, index, stream, tokens),
            Ask::PlainStream { .. } => Request::post(format!("{target}/generate"))
                .header(header::CONTENT_TYPE, "application/json")
                .header(header::ACCEPT, "text/event-stream")
                .body(Full::new(Bytes::from(format!(
                    r#"{{"prompt":"request {index}"}}"#
                ))))
                .expect("a valid request"),
        }
    }

    /// Whether `body`, the body of a 200, is the whole answer to request `index`.
    fn check(self, index: u64, body: &[u8]) -> Result<(), AnswerFault> {
        match self {
            Ask::Completion { stream, tokens } => check_completion(index, stream, tokens, body),
            Ask::PlainStream { tokens } => check_plain(tokens, body),
        }
    }
}

/// A whole plain stream: `tokens` events `data: {"node":"NAME","token":N}`, N from 0 in order, every
/// one from the same node, then one `data: [DONE]` and nothing after it. A stream that ends early
/// (or whose last event is cut) is incomplete; anything else out of place is inexact (a proxy that
/// spliced two nodes' streams, or repeated one).
pub fn check_plain(tokens: u32, body: &[u8]) -> Result<(), AnswerFault> {
    let inexact = |why: String| Err(AnswerFault::Inexact(why));
    let Ok(text) = std::str::from_utf8(body) else {
        return inexact("not UTF-8".into());
    };
    let text = text.replace("\r\n", "\n");
    let mut events: Vec<&str> = text.split("\n\n").collect();
    // What follows the last blank line: nothing in a stream that ended with a whole event.
    if events.pop().is_some_and(|tail| !tail.trim().is_empty()) {
        return Err(AnswerFault::Incomplete);
    }
    let mut node: Option<&str> = None;
    let mut next: u32 = 0;
    let mut done = false;
    for event in events {
        if event.starts_with(':') {
            continue; // a comment (keep-alive)
        }
        if done {
            return inexact(format!("{event:?} after [DONE]"));
        }
        let Some(data) = event.strip_prefix("data: ") else {
            return inexact(format!("event {event:?}"));
        };
        if data == "[DONE]" {
            if next != tokens {
                return inexact(format!("[DONE] after {next} of {tokens} tokens"));
            }
            done = true;
            continue;
        }
        // `{"node":"NAME","token":N}`, as the simulator writes it.
        let parsed = data
            .strip_prefix(r#"{"node":""#)
            .and_then(|rest| rest.split_once(r#"","token":"#))
            .and_then(|(name, rest)| Some((name, rest.strip_suffix('}')?.parse::<u32>().ok()?)));
        let Some((name, token)) = parsed else {
            return inexact(format!("data {data:?}"));
        };
        if *node.get_or_insert(name) != name {
            return inexact(format!(
                "token {token} from {name}, earlier ones from {node:?}"
            ));
        }
        if token != next {
            return inexact(format!("token {token} where {next} was due"));
        }
        next += 1;
    }
    if !done {
        return Err(AnswerFault::Incomplete);
    }
    Ok(())
}

/// Offers `rate` requests per second to `target` for `warmup` (not recorded) then `duration`
/// (recorded), waiting at most the client timeout for the last ones.
pub async fn offer(
    target: &str,
    rate: f64,
    warmup: Duration,
    duration: Duration,
    ask: Ask,
) -> Tally {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(Duration::from_secs(5)));
    let client: LoadClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(4096)
        .build(connector);
    let tally = Arc::new(Mutex::new(Tally::new()));
    let tasks = TaskTracker::new();
    let start = Instant::now();
    let window_start = start + warmup;
    let interval = Duration::from_secs_f64(1.0 / rate);
    let mut index: u64 = 0;
    loop {
        // Departures are fixed in advance: a slow answer never delays the next request.
        let due = start + interval.mul_f64(index as f64);
        let since = due.duration_since(start);
        if since >= warmup + duration {
            break;
        }
        tokio::time::sleep_until(due).await;
        let recorded = since >= warmup;
        let request = ask.request(target, index);
        let (client, tally) = (client.clone(), Arc::clone(&tally));
        {
            let mut tally = lock(&tally);
            tally.offered += 1;
            tally.sent += u64::from(recorded);
        }
        tasks.spawn(async move {
            let began = Instant::now();
            let (outcome, seen) =
                tokio::time::timeout(CLIENT_TIMEOUT, exchange(&client, request, index, ask))
                    .await
                    .unwrap_or_else(|_| {
                        (Outcome::Failed("client-timeout".into()), Seen::default())
                    });
            if !recorded {
                return;
            }
            let took = micros(began.elapsed());
            let mut tally = lock(&tally);
            let kind = match &outcome {
                Outcome::Succeeded { .. } => "whole".to_owned(),
                Outcome::Rejected => "rejected".to_owned(),
                Outcome::Failed(kind) => kind.clone(),
                Outcome::Broke { .. } => "broken".to_owned(),
            };
            tally.records.push(Record {
                start: micros(since - warmup),
                took,
                first_byte: seen.first_byte.map(micros),
                outcome: kind,
                node: seen.node,
            });
            match outcome {
                Outcome::Succeeded {
                    first_byte,
                    longest_gap,
                } => {
                    tally.succeeded += 1;
                    tally.longest_gaps.extend(longest_gap);
                    tally.last_success = tally.last_success.max(window_start.elapsed());
                    tally.latency.saturating_record(took);
                    tally.samples.push((micros(since - warmup), took));
                    tally.first_byte.saturating_record(micros(first_byte));
                }
                Outcome::Rejected => tally.rejected.saturating_record(took),
                Outcome::Failed(kind) => *tally.failures.entry(kind).or_default() += 1,
                Outcome::Broke { silent } => {
                    *tally.failures.entry("broken".into()).or_default() += 1;
                    tally.stall_end.saturating_record(micros(silent));
                }
            }
        });
        index += 1;
    }
    tasks.close();
    tasks.wait().await;
    std::mem::replace(&mut *lock(&tally), Tally::new())
}

/// Bodies the simulated nodes send with a 503: their own load shedding and the gateway's page. Any
/// other 503 was made by the proxy itself: a refusal.
const NODE_503_BODIES: [&str; 2] = ["node at capacity", "No instance is ready"];

/// Inexact answers described on stderr so far.
static INEXACT_SHOWN: AtomicU32 = AtomicU32::new(0);

/// Sends request `index` of the load and reads its answer: a success is a 200 with the exact answer
/// the simulated model writes ([`check_completion`]).
async fn exchange(
    client: &LoadClient,
    request: Request<Full<Bytes>>,
    index: u64,
    ask: Ask,
) -> (Outcome, Seen) {
    let began = Instant::now();
    let response = match client.request(request).await {
        Ok(response) => response,
        Err(_) => return (Outcome::Failed("broken".into()), Seen::default()),
    };
    let mut first_byte = None;
    let mut text = Vec::new();
    let outcome = answer(response, index, ask, began, &mut first_byte, &mut text).await;
    (outcome, Seen::of(first_byte, &text))
}

/// Reads the answer to request `index`, sent at `began`, into `text`, noting its `first_byte`.
async fn answer(
    response: http::Response<hyper::body::Incoming>,
    index: u64,
    ask: Ask,
    began: Instant,
    first_byte: &mut Option<Duration>,
    text: &mut Vec<u8>,
) -> Outcome {
    let status = response.status();
    let mut body = response.into_body();
    let mut last_chunk: Option<Instant> = None;
    let mut longest_gap = Duration::ZERO;
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else {
            return match last_chunk {
                Some(at) => Outcome::Broke {
                    silent: Instant::now().saturating_duration_since(at),
                },
                None => Outcome::Failed("broken".into()),
            };
        };
        if let Ok(data) = frame.into_data() {
            if first_byte.is_none() && !data.is_empty() {
                *first_byte = Some(began.elapsed());
            }
            if !data.is_empty() {
                let now = Instant::now();
                if let Some(last) = last_chunk {
                    longest_gap = longest_gap.max(now.saturating_duration_since(last));
                }
                last_chunk = Some(now);
            }
            // Enough for the longest answer asked for (announced's 400 tokens are about 70 KiB).
            if text.len() < 1024 * 1024 {
                text.extend_from_slice(&data);
            }
        }
    }
    if status == StatusCode::OK {
        // A success is the whole answer, exactly as the simulator writes it (it answers
        // `/v1/completions` as vLLM does), streamed or not.
        return match (ask.check(index, text), *first_byte) {
            (Ok(()), Some(first_byte)) => Outcome::Succeeded {
                first_byte,
                longest_gap: ask.streams().then_some(longest_gap),
            },
            (Err(AnswerFault::Inexact(why)), _) => {
                // A few for the log: what went wrong, not only that it did.
                if INEXACT_SHOWN.fetch_add(1, Ordering::Relaxed) < 10 {
                    eprintln!("compare: inexact answer to request {index}: {why}");
                }
                Outcome::Failed("inexact".into())
            }
            _ => Outcome::Failed("incomplete".into()),
        };
    }
    let text = String::from_utf8_lossy(text);
    if status == StatusCode::SERVICE_UNAVAILABLE
        && !NODE_503_BODIES.iter().any(|node| text.contains(node))
    {
        return Outcome::Rejected;
    }
    Outcome::Failed(status.as_u16().to_string())
}

/// What wrk printed, read.
pub struct Wrk {
    pub requests: u64,
    pub per_second: f64,
    pub p50: Option<f64>,
    pub p99: Option<f64>,
    pub max: Option<f64>,
    pub errors: u64,
}

fn parse_wrk(text: &str) -> Result<Wrk> {
    let to_ms = |value: &str| -> Option<f64> {
        let (number, factor) = if let Some(n) = value.strip_suffix("us") {
            (n, 0.001)
        } else if let Some(n) = value.strip_suffix("ms") {
            (n, 1.0)
        } else if let Some(n) = value.strip_suffix('s') {
            (n, 1000.0)
        } else if let Some(n) = value.strip_suffix('m') {
            (n, 60_000.0)
        } else {
            return None;
        };
        number.parse::<f64>().ok().map(|n| n * factor)
    };
    let mut wrk = Wrk {
        requests: 0,
        per_second: 0.0,
        p50: None,
        p99: None,
        max: None,
        errors: 0,
    };
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["Latency", _avg, _stdev, max, ..] => wrk.max = to_ms(max),
            ["50%", value] => wrk.p50 = to_ms(value),
            ["99%", value] => wrk.p99 = to_ms(value),
            [count, "requests", "in", ..] => wrk.requests = count.parse().unwrap_or(0),
            ["Requests/sec:", value] => wrk.per_second = value.parse().unwrap_or(0.0),
            ["Non-2xx", "or", "3xx", "responses:", count] => {
                wrk.errors += count.parse::<u64>().unwrap_or(0)
            }
            ["Socket", "errors:", rest @ ..] => {
                // "connect 0, read 0, write 0, timeout 0"
                wrk.errors += rest
                    .iter()
                    .filter_map(|word| word.trim_end_matches(',').parse::<u64>().ok())
                    .sum::<u64>();
            }
            _ => {}
        }
    }
    if wrk.requests == 0 {
        bail!("wrk reported no requests:\n{text}");
    }
    Ok(wrk)
}

pub async fn wrk(wrk: &Path, url: &str, duration: Duration, connections: u32) -> Result<Wrk> {
    let mut command = tokio::process::Command::new(wrk);
    command
        .arg("-t1")
        .arg(format!("-c{connections}"))
        .arg(format!("-d{}s", duration.as_secs().max(1)))
        .arg("--latency")
        .arg(format!("{url}/v1/ping"));
    let out = command.output().await.context("running wrk")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "wrk failed ({}): {}{}",
            out.status,
            text,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    parse_wrk(&text)
}
