//! The `pauses` scenario: healthy nodes that pause their streams as real inference servers do, and no
//! interruption at all, so every stream should reach its client whole.
//!
//! Four identical nodes stream chat completions of 60 tokens over about 2.7 s, sending the role chunk
//! at once and the first token after a wait (the prompt's prefill, growing a little with the prompt
//! and the node's load); the first-token wait is 0.3, 0.6, 1, 2 and 5 s in five variants, and in a
//! sixth (`preempt`) it is 0.6 s and streams are preempted mid-answer for about 3 s, more often
//! under load, as vLLM does under KV-cache pressure. Each variant runs from a cold start (a new user's
//! first minutes: nothing learnt yet) at 8 streams a second for `PAUSES_DURATION` (10 s).
//!
//! A stream is *whole* when it is a 200 whose chunks put together are exactly the text the simulated
//! model writes, with one final chunk, one `[DONE]` and one `id`. For tongs the table adds what it
//! did about the pauses, read from its metrics: continuations sent, stalls counted against nodes,
//! ejections, and pauses it left alone.

use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;
use tongs::config::HumanDuration;
use tongs::sim::{FirstToken, FleetConfig, NodeSpec, Preemption, ResponseKind};

use super::peers::{Handle, Running};
use super::support::stats::{latency_histogram, micros, quantile_ms};
use super::support::{self, lock};
use super::{Proxy, Scenario, Settings};

/// Tokens of every answer.
const TOKENS: u32 = 60;
/// Streams started per second.
const RATE: f64 = 8.0;
/// A client gives up after this long.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(60);

/// One fleet of the scenario: its name, the first-token wait, and whether streams are preempted.
#[derive(Clone, Copy, Debug)]
struct Variant {
    name: &'static str,
    first_token_ms: u64,
    preempt: bool,
}

const VARIANTS: [Variant; 6] = [
    Variant {
        name: "first token 0.3 s",
        first_token_ms: 300,
        preempt: false,
    },
    Variant {
        name: "first token 0.6 s",
        first_token_ms: 600,
        preempt: false,
    },
    Variant {
        name: "first token 1 s",
        first_token_ms: 1000,
        preempt: false,
    },
    Variant {
        name: "first token 2 s",
        first_token_ms: 2000,
        preempt: false,
    },
    Variant {
        name: "first token 5 s",
        first_token_ms: 5000,
        preempt: false,
    },
    Variant {
        name: "preempt 3 s, first token 0.6 s",
        first_token_ms: 600,
        preempt: true,
    },
];

/// The variant's fleet: four nodes serving 32 at once (far from full at this load), 60 tokens over
/// 2.7 s after the first-token wait.
fn fleet_config(variant: Variant, seed: u64) -> FleetConfig {
    let nodes = (1..=4)
        .map(|i| {
            let mut spec = NodeSpec::new(&format!("gpu-{i}"), Duration::from_secs(3));
            spec.service_time.spread = 0.0;
            spec.capacity = 32;
            spec.queue = 64;
            spec.response = ResponseKind::Sse;
            spec.tokens = TOKENS;
            spec.first_token = Some(FirstToken {
                wait: HumanDuration::from_millis(variant.first_token_ms),
                per_prompt_word: HumanDuration::from_millis(1),
                per_in_flight: HumanDuration::from_millis(10),
                spread: 0.2,
            });
            if variant.preempt {
                spec.preemption = Some(Preemption {
                    chance: 0.1,
                    per_in_flight: 0.02,
                    pause: HumanDuration::from_secs(3),
                    spread: 0.3,
                });
            }
            spec
        })
        .collect();
    FleetConfig { seed, nodes }
}

/// What one proxy did on one variant.
pub struct PauseRow {
    variant: &'static str,
    label: String,
    streams: u64,
    whole: u64,
    /// Failures by kind.
    failures: std::collections::BTreeMap<String, u64>,
    p50_ms: Option<f64>,
    p99_ms: Option<f64>,
    /// Longest gap between two chunks of any whole stream, ms.
    longest_gap_ms: f64,
    /// tongs' own counts: continuations sent, stalls, ejections, pauses left alone.
    tongs: Option<[f64; 4]>,
}

/// Runs every variant through every tongs contender and HAProxy among `settings.proxies`.
pub async fn rows(settings: &Settings) -> Result<Vec<PauseRow>> {
    let duration = settings.pauses_duration;
    let mut rows = Vec::new();
    for variant in VARIANTS {
        for &proxy in &settings.proxies {
            if !(proxy.is_tongs() || proxy == Proxy::Haproxy) || !proxy.runs_in(Scenario::Pauses) {
                continue;
            }
            let config = fleet_config(variant, settings.seed);
            let (fleet, running) = super::fleet_and_proxy(&config, proxy, settings).await?;
            eprintln!(
                "compare: pauses, {} through {} ({RATE} streams/s for {duration:?})",
                variant.name, running.label
            );
            let mut row = offer(&running, duration).await;
            row.variant = variant.name;
            if let Handle::Tongs(tongs) = &running.handle {
                let metrics = format!("http://{}/metrics", tongs.admin);
                row.tongs = Some([
                    summed(&metrics, "tongs_continuations_total", Some("continued")).await,
                    summed(&metrics, "tongs_endpoint_stalls_total", None).await,
                    summed(&metrics, "tongs_endpoint_ejections_total", None).await,
                    summed(&metrics, "tongs_stream_pauses_total", None).await,
                ]);
            }
            drop(running);
            super::support::fleet::wait_idle(&fleet, Duration::from_millis(50)).await;
            rows.push(row);
        }
    }
    Ok(rows)
}

/// The sum of every series of `name` (with `outcome="…"` equal to `outcome` when given).
async fn summed(metrics: &str, name: &str, outcome: Option<&str>) -> f64 {
    let Ok((_, text)) = support::get(metrics).await else {
        return f64::NAN;
    };
    text.lines()
        .filter(|line| {
            line.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter(|line| outcome.is_none_or(|o| line.contains(&format!("outcome=\"{o}\""))))
        .filter_map(|line| line.rsplit_once(' ')?.1.trim().parse::<f64>().ok())
        .sum()
}

type LoadClient = Client<HttpConnector, Full<Bytes>>;

/// What one client saw.
enum Seen {
    Whole {
        took: Duration,
        longest_gap: Duration,
    },
    Failed(String),
}

/// Offers `RATE` chat streams per second for `duration`, from a cold start, and tallies them.
async fn offer(running: &Running, duration: Duration) -> PauseRow {
    let client: LoadClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(1024)
        .build(HttpConnector::new());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let tasks = TaskTracker::new();
    let start = Instant::now();
    let interval = Duration::from_secs_f64(1.0 / RATE);
    let count = (duration.as_secs_f64() * RATE) as u64;
    for index in 0..count {
        tokio::time::sleep_until(start + interval.mul_f64(index as f64)).await;
        let (client, seen, url) = (client.clone(), Arc::clone(&seen), running.url.clone());
        tasks.spawn(async move {
            let outcome = tokio::time::timeout(CLIENT_TIMEOUT, chat(&client, &url, index))
                .await
                .unwrap_or_else(|_| Seen::Failed("client-timeout".into()));
            lock(&seen).push(outcome);
        });
    }
    tasks.close();
    tasks.wait().await;
    let seen = std::mem::take(&mut *lock(&seen));
    let mut latency = latency_histogram();
    let mut failures = std::collections::BTreeMap::new();
    let mut longest_gap = Duration::ZERO;
    for outcome in &seen {
        match outcome {
            Seen::Whole {
                took,
                longest_gap: gap,
            } => {
                latency.saturating_record(micros(*took));
                longest_gap = longest_gap.max(*gap);
            }
            Seen::Failed(kind) => *failures.entry(kind.clone()).or_insert(0) += 1,
        }
    }
    PauseRow {
        variant: "",
        label: running.label.clone(),
        streams: seen.len() as u64,
        whole: latency.len(),
        failures,
        p50_ms: quantile_ms(&latency, 0.5),
        p99_ms: quantile_ms(&latency, 0.99),
        longest_gap_ms: longest_gap.as_secs_f64() * 1000.0,
        tongs: None,
    }
}

/// Streams chat completion `index` (the model counts on from `index`) and checks it.
async fn chat(client: &LoadClient, url: &str, index: u64) -> Seen {
    let body = format!(
        r#"{{"model":"sim","stream":true,"max_tokens":{TOKENS},"messages":[{{"role":"user","content":"count on from {index}"}}]}}"#
    );
    let request = Request::post(format!("{url}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .expect("a valid request");
    let began = Instant::now();
    let Ok(response) = client.request(request).await else {
        return Seen::Failed("broken".into());
    };
    let status = response.status();
    let mut body = response.into_body();
    let mut text = Vec::new();
    let mut last = None::<Instant>;
    let mut longest_gap = Duration::ZERO;
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else {
            return Seen::Failed("broken".into());
        };
        if let Ok(data) = frame.into_data() {
            let now = Instant::now();
            if let Some(last) = last {
                longest_gap = longest_gap.max(now - last);
            }
            last = Some(now);
            text.extend_from_slice(&data);
        }
    }
    if status != 200 {
        return Seen::Failed(status.as_u16().to_string());
    }
    match check(index, &text) {
        Ok(()) => Seen::Whole {
            took: began.elapsed(),
            longest_gap,
        },
        Err(kind) => Seen::Failed(kind.into()),
    }
}

/// A whole chat stream: every event `data: {json}` or the one final `data: [DONE]`, one `id`, the
/// deltas' content exactly " index+1 … index+TOKENS", one `finish_reason`.
fn check(index: u64, body: &[u8]) -> Result<(), &'static str> {
    let text = std::str::from_utf8(body).map_err(|_| "inexact")?;
    let expected: String = (1..=u64::from(TOKENS))
        .map(|i| format!(" {}", index + i))
        .collect();
    let (mut content, mut id, mut finishes, mut done) = (String::new(), None, 0, false);
    for event in text.split("\n\n").filter(|event| !event.trim().is_empty()) {
        // SSE comments (a keep-alive) carry nothing.
        if event.starts_with(':') {
            continue;
        }
        let data = event.strip_prefix("data: ").ok_or("inexact")?;
        if done {
            return Err("inexact");
        }
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let chunk: Value = serde_json::from_str(data).map_err(|_| "inexact")?;
        let chunk_id = chunk["id"].as_str().map(str::to_owned);
        if id.is_none() {
            id = chunk_id;
        } else if chunk_id != id {
            return Err("inexact");
        }
        let choice = &chunk["choices"][0];
        content.push_str(choice["delta"]["content"].as_str().unwrap_or_default());
        finishes += usize::from(!choice["finish_reason"].is_null());
    }
    if !done {
        return Err("incomplete");
    }
    if content != expected || finishes != 1 {
        return Err("inexact");
    }
    Ok(())
}

/// The fleets, for the results' header.
pub fn describe() -> String {
    format!(
        "pauses: four nodes gpu-1…4, 32 at once, {TOKENS} tokens over 2.7 s after the first-token wait \
         (+1 ms a prompt word, +10 ms a request in flight, lognormal spread 0.2), role chunk at once; \
         preempt: 0.1 + 0.02 a request in flight of the streams pause ~3 s once; {RATE} streams/s from a \
         cold start"
    )
}

/// The pauses table.
pub fn table(rows: &[PauseRow]) -> String {
    let mut out = String::new();
    if rows.is_empty() {
        return out;
    }
    let _ = writeln!(
        out,
        "\nHealthy nodes that pause (`pauses`): a stream is whole when complete and exact; tongs' own counts \
         from its metrics.\n"
    );
    let _ = writeln!(
        out,
        "| fleet | proxy | streams | whole % | failures | p50 / p99 ms | longest gap ms | tongs: continued / stalls \
         / ejections / pauses left alone |"
    );
    let _ = writeln!(out, "| --- | --- | ---: | ---: | --- | ---: | ---: | --- |");
    for row in rows {
        let failures = if row.failures.is_empty() {
            "0".to_owned()
        } else {
            row.failures
                .iter()
                .map(|(kind, n)| format!("{n} {kind}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let ms = |v: Option<f64>| v.map_or("–".to_owned(), |v| format!("{v:.0}"));
        let tongs = row.tongs.map_or("–".to_owned(), |[c, s, e, p]| {
            format!("{c:.0} / {s:.0} / {e:.0} / {p:.0}")
        });
        let _ = writeln!(
            out,
            "| {} | {} | {} | {:.1} | {failures} | {} / {} | {:.0} | {tongs} |",
            row.variant,
            row.label,
            row.streams,
            100.0 * row.whole as f64 / row.streams.max(1) as f64,
            ms(row.p50_ms),
            ms(row.p99_ms),
            row.longest_gap_ms,
        );
    }
    out
}
