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
use http::{Request, StatusCode};
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

type LoadClient = Client<HttpConnector, Full<Bytes>>;

/// Offers `rate` requests per second to `target` for `warmup` (not recorded) then `duration`
/// (recorded), waiting at most the client timeout for the last ones.
pub async fn offer(
    target: &str,
    rate: f64,
    warmup: Duration,
    duration: Duration,
    stream: bool,
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
        let request = build_request(target, index, stream);
        let (client, tally) = (client.clone(), Arc::clone(&tally));
        {
            let mut tally = lock(&tally);
            tally.offered += 1;
            tally.sent += u64::from(recorded);
        }
        tasks.spawn(async move {
            let began = Instant::now();
            let outcome =
                tokio::time::timeout(CLIENT_TIMEOUT, exchange(&client, request, index, stream))
                    .await
                    .unwrap_or_else(|_| Outcome::Failed("client-timeout".into()));
            if !recorded {
                return;
            }
            let took = micros(began.elapsed());
            let mut tally = lock(&tally);
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
    stream: bool,
) -> Outcome {
    let began = Instant::now();
    let response = match client.request(request).await {
        Ok(response) => response,
        Err(_) => return Outcome::Failed("broken".into()),
    };
    let status = response.status();
    let mut body = response.into_body();
    let mut first_byte = None;
    let mut last_chunk: Option<Instant> = None;
    let mut longest_gap = Duration::ZERO;
    let mut text = Vec::new();
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
                first_byte = Some(began.elapsed());
            }
            if !data.is_empty() {
                let now = Instant::now();
                if let Some(last) = last_chunk {
                    longest_gap = longest_gap.max(now.saturating_duration_since(last));
                }
                last_chunk = Some(now);
            }
            if text.len() < 64 * 1024 {
                text.extend_from_slice(&data);
            }
        }
    }
    if status == StatusCode::OK {
        // A success is the whole answer, exactly as the simulator's model writes it (it answers
        // `/v1/completions` as vLLM does), streamed or not.
        return match (check_completion(index, stream, &text), first_byte) {
            (Ok(()), Some(first_byte)) => Outcome::Succeeded {
                first_byte,
                longest_gap: stream.then_some(longest_gap),
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
    let text = String::from_utf8_lossy(&text);
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
