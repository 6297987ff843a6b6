//! The `chat` and `saturate` scenarios: a fleet of continuous-batching engines, the simulator's
//! vLLM-like nodes (`engine` in a fleet file: a batch, a waiting line without bound, a prefix cache,
//! a prefill of the words it does not hold, vLLM's `/metrics`).
//!
//! Six nodes, a batch of 8 each: four answer 32 tokens in about 1 s, two in about 2 s (half speed);
//! before the first token each prefills the words of the context its prefix cache does not hold, 1 ms
//! a word. The fleet's capacity is Σ batch ÷ answer time, 40 requests a second.
//!
//! `chat`: multi-turn conversations, streamed chat completions. 24 system prompts of 250 to 400
//! words; each conversation picks one and has 3 to 6 turns, each turn sending the whole history
//! (system prompt, the user's messages, the answers so far, the new user message of 20 to 60 words),
//! the next turn 0.5 to 2 s after the answer. Conversations start at a fixed pace, 65 % of the
//! capacity in requests (4.5 turns each on average); everything is drawn from SEED. A request is
//! whole when its chunks put together are exactly the model's answer; its time to first token is to
//! the first chunk with content. The prefix-cache hit rate is the nodes' own counters (words found ÷
//! words looked up) over the whole run; "if sticky" replays the same requests, in the order they were
//! sent, on six caches of the same size with every conversation kept on one node.
//! `tongs-2-replicas` runs two tongs processes that share nothing in front of the fleet, a
//! conversation's turns alternating between them: turn 1 to the first, turn 2 to the second, ...
//!
//! `saturate`: the same fleet at 130 % of its capacity, streamed completions of distinct prompts;
//! engines never shed, so what a proxy does not hold waits inside the nodes: the largest waiting line
//! any node reached, and the time to the first byte.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use tokio::time::Instant;
use tokio_util::task::TaskTracker;
use tongs::sim::{EngineSpec, FleetConfig, PrefixCache, ResponseKind, block_hashes};

use super::peers::Running;
use super::support::stats::{latency_histogram, micros, quantile_ms};
use super::support::{fleet, lock};
use super::{Proxy, Scenario, Settings};

/// The engines: name, batch, mean time of a whole answer of [`TOKENS`] tokens in ms.
pub const NODES: [fleet::Node; 6] = [
    ("gpu-1", 8, 1000),
    ("gpu-2", 8, 1000),
    ("gpu-3", 8, 1000),
    ("gpu-4", 8, 1000),
    ("gpu-5", 8, 2000),
    ("gpu-6", 8, 2000),
];
/// Tokens of every answer.
pub const TOKENS: u32 = 32;
/// Lognormal spread of the answer times.
const SPREAD: f64 = 0.1;
/// A client gives up after this long.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(60);
const SYSTEM_PROMPTS: usize = 24;
/// Offered load as a share of the fleet's capacity.
const CHAT_LOAD: f64 = 0.65;
pub const SATURATE_LOAD: f64 = 1.3;
/// Turns of a conversation: 3 to 6, 4.5 on average.
const TURNS: std::ops::RangeInclusive<usize> = 3..=6;
const MEAN_TURNS: f64 = 4.5;

/// The proxies `scenario` compares (two tongs replicas in `chat` only).
fn compared(proxy: Proxy, scenario: Scenario) -> bool {
    matches!(
        proxy,
        Proxy::Tongs | Proxy::TongsOwnCounts | Proxy::TongsTwoReplicas | Proxy::Nginx
    ) && proxy.runs_in(scenario)
}

/// The engines' fleet.
pub fn fleet_config(seed: u64) -> FleetConfig {
    let mut config = fleet::config(seed, &NODES, SPREAD, 0, ResponseKind::Json);
    for node in &mut config.nodes {
        node.tokens = TOKENS;
        node.engine = Some(EngineSpec::default());
    }
    config
}

/// What one proxy did in one of these scenarios.
pub struct EngineRow {
    scenario: Scenario,
    label: String,
    requests: u64,
    whole: u64,
    failures: BTreeMap<String, u64>,
    /// Time to the first token (chat: the first chunk with content; saturate: the first byte), ms.
    first_p50: Option<f64>,
    first_p99: Option<f64>,
    /// Words found in the nodes' prefix caches ÷ words looked up, from their counters.
    hit_rate: Option<f64>,
    /// The same requests replayed with every conversation on one node.
    sticky_hit_rate: Option<f64>,
    /// The largest waiting line a node reached.
    max_waiting: usize,
    /// Requests each node received, in [`NODES`]' order.
    per_node: Vec<u64>,
}

/// Runs `scenario` (`chat` or `saturate`) through each of tongs, tongs-own-counts, tongs-2-replicas
/// (chat) and nginx among `settings.proxies`, each on a fresh fleet.
pub async fn rows(scenario: Scenario, settings: &Settings) -> Result<Vec<EngineRow>> {
    let mut rows = Vec::new();
    for &proxy in settings
        .proxies
        .iter()
        .filter(|&&proxy| compared(proxy, scenario))
    {
        let config = fleet_config(settings.seed);
        let capacity = fleet::capacity(&config);
        let (fleet, running) = super::fleet_and_proxy(&config, proxy, settings).await?;
        let received: Vec<u64> = fleet.nodes().iter().map(|n| n.stats().received).collect();
        let mut row = match scenario {
            Scenario::Chat => chat(&running, capacity, settings).await,
            _ => super::saturate::run(&running, capacity, settings).await,
        };
        row.scenario = scenario;
        row.label = running.label.clone();
        drop(running);
        fleet::wait_idle(&fleet, Duration::from_millis(50)).await;
        let stats: Vec<_> = fleet.nodes().iter().map(|node| node.stats()).collect();
        row.per_node = stats
            .iter()
            .zip(received)
            .map(|(stats, before)| stats.received - before)
            .collect();
        row.max_waiting = stats.iter().map(|s| s.max_waiting).max().unwrap_or(0);
        let queries: u64 = stats.iter().map(|s| s.prefix_queries).sum();
        let hits: u64 = stats.iter().map(|s| s.prefix_hits).sum();
        if scenario == Scenario::Chat {
            row.hit_rate = (queries > 0).then(|| hits as f64 / queries as f64);
        }
        rows.push(row);
    }
    Ok(rows)
}

impl EngineRow {
    pub fn new(seen: &[Result<Duration, String>]) -> EngineRow {
        let mut first = latency_histogram();
        let mut failures = BTreeMap::new();
        for outcome in seen {
            match outcome {
                Ok(took) => first.saturating_record(micros(*took)),
                Err(kind) => *failures.entry(kind.clone()).or_insert(0) += 1,
            }
        }
        EngineRow {
            scenario: Scenario::Chat,
            label: String::new(),
            requests: seen.len() as u64,
            whole: first.len(),
            failures,
            first_p50: quantile_ms(&first, 0.5),
            first_p99: quantile_ms(&first, 0.99),
            hit_rate: None,
            sticky_hit_rate: None,
            max_waiting: 0,
            per_node: Vec::new(),
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// The chat workload.

/// Words the prose is drawn from (no digits: the model counts on from the context's last integer,
/// so each answer goes on from the one before).
const VOCABULARY: [&str; 64] = [
    "the",
    "a",
    "model",
    "answer",
    "question",
    "report",
    "figure",
    "region",
    "node",
    "batch",
    "latency",
    "cache",
    "summary",
    "careful",
    "brief",
    "always",
    "never",
    "explain",
    "cite",
    "data",
    "user",
    "assistant",
    "system",
    "policy",
    "format",
    "list",
    "table",
    "source",
    "quote",
    "tone",
    "polite",
    "formal",
    "short",
    "detail",
    "step",
    "reason",
    "check",
    "verify",
    "claim",
    "number",
    "date",
    "name",
    "place",
    "request",
    "reply",
    "context",
    "history",
    "topic",
    "rule",
    "example",
    "markdown",
    "json",
    "code",
    "review",
    "error",
    "warning",
    "limit",
    "budget",
    "time",
    "team",
    "customer",
    "support",
    "ticket",
    "product",
];

fn prose(rng: &mut fastrand::Rng, words: usize) -> String {
    let mut text = String::new();
    for i in 0..words {
        if i > 0 {
            text.push(' ');
        }
        text.push_str(VOCABULARY[rng.usize(..VOCABULARY.len())]);
    }
    text
}

/// One conversation, planned: when it starts (from the load's start), its system prompt, and each
/// turn's user message and the pause after its answer.
struct Plan {
    at: Duration,
    system: usize,
    turns: Vec<(String, Duration)>,
}

/// The system prompts, and the conversations started at `rate` requests a second over `span`.
fn workload(seed: u64, rate: f64, span: Duration) -> (Vec<String>, Vec<Plan>) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let systems = (0..SYSTEM_PROMPTS)
        .map(|_| {
            let words = rng.usize(250..=400);
            prose(&mut rng, words)
        })
        .collect();
    let interval = Duration::from_secs_f64(MEAN_TURNS / rate);
    let count = (span.as_secs_f64() / interval.as_secs_f64()) as usize;
    let plans = (0..count)
        .map(|i| Plan {
            at: interval.mul_f64(i as f64),
            system: rng.usize(..SYSTEM_PROMPTS),
            turns: (0..rng.usize(TURNS))
                .map(|_| {
                    let words = rng.usize(20..=60);
                    let think = Duration::from_millis(rng.u64(500..=2000));
                    (prose(&mut rng, words), think)
                })
                .collect(),
        })
        .collect();
    (systems, plans)
}

/// One request of a conversation as sent.
struct Sent {
    at: Instant,
    conversation: usize,
    /// What the model reads: the messages' contents joined.
    context: String,
    /// Sent by a conversation that started in the measured window.
    recorded: bool,
    /// The time to its first token if it was whole, else the failure's kind.
    outcome: Result<Duration, String>,
}

type LoadClient = Client<HttpConnector, Full<Bytes>>;

pub fn client() -> LoadClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(4096)
        .build(connector)
}

/// Runs the conversations through `running` for the warm-up and the measured window, and waits for
/// every one to end.
async fn chat(running: &Running, capacity: f64, settings: &Settings) -> EngineRow {
    let rate = CHAT_LOAD * capacity;
    let (systems, plans) = workload(settings.seed, rate, settings.warmup + settings.duration);
    eprintln!(
        "compare: chat through {} ({} conversations, {rate:.0} req/s for {:?})",
        running.label,
        plans.len(),
        settings.duration
    );
    let systems = Arc::new(systems);
    let sent = Arc::new(Mutex::new(Vec::new()));
    let client = client();
    let tasks = TaskTracker::new();
    let start = Instant::now();
    for (conversation, plan) in plans.into_iter().enumerate() {
        tokio::time::sleep_until(start + plan.at).await;
        let recorded = plan.at >= settings.warmup;
        // Turn 1 to the first replica, turn 2 to the second, and so on (one URL but for
        // tongs-2-replicas).
        let (client, urls) = (client.clone(), running.urls.clone());
        let (systems, sent) = (Arc::clone(&systems), Arc::clone(&sent));
        tasks.spawn(async move {
            let mut messages = vec![json!({"role": "system", "content": systems[plan.system]})];
            for (turn, (user, think)) in plan.turns.into_iter().enumerate() {
                let url = &urls[turn % urls.len()];
                messages.push(json!({"role": "user", "content": user}));
                let context = messages
                    .iter()
                    .filter_map(|message| message["content"].as_str())
                    .collect::<Vec<_>>()
                    .join(" ");
                let answer = answer_to(&context);
                let at = Instant::now();
                let outcome = ask(&client, url, &messages, &answer).await;
                lock(&sent).push(Sent {
                    at,
                    conversation,
                    context,
                    recorded,
                    outcome,
                });
                // What the model answered when whole; what it should have, when not, so that every
                // proxy meets the same conversations.
                messages.push(json!({"role": "assistant", "content": answer}));
                tokio::time::sleep(think).await;
            }
        });
    }
    tasks.close();
    tasks.wait().await;
    let mut sent = std::mem::take(&mut *lock(&sent));
    sent.sort_by_key(|sent| sent.at);
    let seen: Vec<_> = sent
        .iter()
        .filter(|sent| sent.recorded)
        .map(|sent| sent.outcome.clone())
        .collect();
    let mut row = EngineRow::new(&seen);
    row.sticky_hit_rate = Some(sticky_hit_rate(&sent));
    row
}

/// The model's answer to `context`: it counts on from the context's last integer.
fn answer_to(context: &str) -> String {
    let start = context
        .split(|c: char| !c.is_ascii_digit())
        .rfind(|digits| !digits.is_empty())
        .and_then(|digits| digits.parse::<u64>().ok())
        .unwrap_or(0);
    (1..=u64::from(TOKENS))
        .map(|i| format!(" {}", start + i))
        .collect()
}

/// The hit rate of `sent` (in the order sent) replayed on six caches like the nodes', every
/// conversation on one node.
fn sticky_hit_rate(sent: &[Sent]) -> f64 {
    let spec = EngineSpec::default();
    let block_words = spec.block_words as usize;
    let mut caches = vec![PrefixCache::new(spec.cache_blocks); NODES.len()];
    let (mut queries, mut hits) = (0u64, 0u64);
    for sent in sent {
        let words = sent.context.split_whitespace().count();
        let blocks = block_hashes(&sent.context, block_words);
        let matched = caches[sent.conversation % NODES.len()].admit(&blocks);
        queries += words as u64;
        hits += (matched * block_words).min(words) as u64;
    }
    hits as f64 / queries.max(1) as f64
}

/// Sends one streamed chat completion of `messages` and checks its answer is `answer`: the time to
/// its first content, or the failure's kind.
async fn ask(
    client: &LoadClient,
    url: &str,
    messages: &[Value],
    answer: &str,
) -> Result<Duration, String> {
    let body = json!({
        "model": "sim",
        "stream": true,
        "max_tokens": TOKENS,
        "messages": messages,
    });
    let request = Request::post(format!("{url}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("a valid request");
    let read = |chunk: &Value| {
        chunk["choices"][0]["delta"]["content"]
            .as_str()
            .map(str::to_owned)
    };
    streamed(client, request, read, answer).await
}

/// Sends `request`, reads its event stream (each chunk's text read by `text`) and checks that the
/// texts put together are `expected`, ended by `[DONE]`: the time to the first text, or the
/// failure's kind. A client gives up after [`CLIENT_TIMEOUT`].
pub async fn streamed(
    client: &LoadClient,
    request: Request<Full<Bytes>>,
    text: impl Fn(&Value) -> Option<String>,
    expected: &str,
) -> Result<Duration, String> {
    let began = Instant::now();
    let exchange = async {
        let response = client
            .request(request)
            .await
            .map_err(|_| "broken".to_owned())?;
        let status = response.status();
        let mut body = response.into_body();
        let (mut pending, mut answer, mut first, mut done) =
            (Vec::new(), String::new(), None, false);
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|_| "broken".to_owned())?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            if status != StatusCode::OK {
                continue;
            }
            pending.extend_from_slice(&data);
            while let Some(end) = pending.windows(2).position(|pair| pair == b"\n\n") {
                let event: Vec<u8> = pending.drain(..end + 2).collect();
                let event = String::from_utf8_lossy(&event);
                let Some(data) = event.trim_end().strip_prefix("data: ") else {
                    continue; // a comment
                };
                if data == "[DONE]" {
                    done = true;
                    continue;
                }
                let chunk: Value = serde_json::from_str(data).map_err(|_| "inexact".to_owned())?;
                if let Some(piece) = text(&chunk).filter(|piece| !piece.is_empty()) {
                    first.get_or_insert_with(|| began.elapsed());
                    answer.push_str(&piece);
                }
            }
        }
        if status != StatusCode::OK {
            return Err(status.as_u16().to_string());
        }
        match (done, first) {
            (true, Some(first)) if answer == expected => Ok(first),
            (true, _) => Err("inexact".to_owned()),
            (false, _) => Err("incomplete".to_owned()),
        }
    };
    tokio::time::timeout(CLIENT_TIMEOUT, exchange)
        .await
        .unwrap_or_else(|_| Err("client-timeout".to_owned()))
}

// ---------------------------------------------------------------------------------------------------
// The report.

/// The fleet, for the results' header.
pub fn describe(seed: u64) -> String {
    let config = fleet_config(seed);
    let capacity = fleet::capacity(&config);
    let engine = EngineSpec::default();
    format!(
        "chat, saturate: engines {} (batch × time of a whole answer of {TOKENS} tokens, spread {SPREAD}; \
         prefill {} ms a word not in the prefix cache, blocks of {} words, {} cached; waiting line without \
         bound; vLLM metrics), capacity {capacity:.1} req/s; chat: {SYSTEM_PROMPTS} system prompts of 250–400 \
         words, conversations of 3–6 turns (user messages of 20–60 words, 0.5–2 s between turns) at {:.0} % \
         of capacity; saturate: streamed completions of distinct prompts at {:.0} %; client timeout {} s",
        fleet::describe(&config),
        engine.prefill_per_word.get().as_millis(),
        engine.block_words,
        engine.cache_blocks,
        CHAT_LOAD * 100.0,
        SATURATE_LOAD * 100.0,
        CLIENT_TIMEOUT.as_secs(),
    )
}

/// The engines' table.
pub fn table(rows: &[EngineRow]) -> String {
    let mut out = String::new();
    if rows.is_empty() {
        return out;
    }
    let _ = writeln!(
        out,
        "\nContinuous-batching engines (`chat`, `saturate`): the first token's time (chat: first content; \
         saturate: first byte), the nodes' own prefix-cache hit rate, and what reached each node \
         (gpu-5 and gpu-6 at half speed).\n"
    );
    let _ = writeln!(
        out,
        "| scenario | proxy | requests | whole % | failures | first token p50 / p99 ms | prefix hits % \
         | if sticky % | largest node queue | requests per node |"
    );
    let _ = writeln!(
        out,
        "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- |"
    );
    let ms = |v: Option<f64>| v.map_or("–".to_owned(), |v| format!("{v:.0}"));
    let percent = |v: Option<f64>| v.map_or("–".to_owned(), |v| format!("{:.1}", 100.0 * v));
    for row in rows {
        let failures = if row.failures.is_empty() {
            "0".to_owned()
        } else {
            super::support::stats::by_kind(&row.failures)
        };
        let per_node = row
            .per_node
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(" / ");
        let _ = writeln!(
            out,
            "| {} | {} | {} | {:.1} | {failures} | {} / {} | {} | {} | {} | {per_node} |",
            row.scenario.name(),
            row.label,
            row.requests,
            100.0 * row.whole as f64 / row.requests.max(1) as f64,
            ms(row.first_p50),
            ms(row.first_p99),
            percent(row.hit_rate),
            percent(row.sticky_hit_rate),
            row.max_waiting,
        );
    }
    out
}
