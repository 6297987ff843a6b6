//! A node's continuous-batching inference engine, vLLM-like, behind its OpenAI paths (a node whose
//! spec has an `engine`, [`super::EngineSpec`]).
//!
//! A request is read first (a malformed one gets its `400` at once, holding nothing), then waits for
//! a place in the batch (`capacity` places, vLLM's `max_num_seqs`) in a first-come first-served line
//! without bound: the node's `queue` limit and its 503s do not apply. Once placed, the request's
//! context is looked up in the prefix cache ([`PrefixCache`], blocks of `block_words` words whose
//! hashes chain): the leading blocks found are *cached words*, the rest are prefilled at
//! `prefill_per_word` each before the first token, and every full block of the context is then held
//! as just used. The engine counts the words looked up (`prefix_queries`) and those found
//! (`prefix_hits`), as vLLM counts tokens in `vllm:prefix_cache_queries_total` and
//! `vllm:prefix_cache_hits_total`.
//!
//! KV-cache usage is the blocks the running sequences hold over `kv_blocks`, at most 1: a sequence
//! holds ⌈words ÷ `block_words`⌉ blocks of its context and of the tokens it has streamed so far (a
//! whole, unstreamed answer holds its context's alone until it is done). Nothing waits or is
//! preempted for want of KV blocks: the usage is reported, not enforced.
//!
//! `GET /metrics` writes these figures, with the batch's running and waiting counts, in the names of
//! the server the engine plays ([`super::MetricsFlavour`], see `exposition.rs`).

mod exposition;
mod prefix;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use tokio_util::sync::CancellationToken;

use super::EngineSpec;
use super::node::{InFlight, NodeShared, read_body, stopping};
use super::openai::{self, Admitted, ServedApi};
use super::reply::{SimBody, full};
pub use prefix::{PrefixCache, block_hashes};

/// The live state of one node's engine.
pub(super) struct Engine {
    spec: EngineSpec,
    cache: Mutex<PrefixCache>,
    /// Prompt words looked up in the prefix cache, and those found there.
    queries: AtomicU64,
    hits: AtomicU64,
    /// KV-cache blocks held by the running sequences.
    kv_held: AtomicU64,
    /// Tokens generated, and when that was last brought up to date: one a running sequence every
    /// [`TOKEN_MS`] while the engine works, none while it is wedged (gray), as vLLM's
    /// `vllm:generation_tokens_total` stands still when its engine stops.
    generated: Mutex<(Option<std::time::Instant>, u64)>,
    /// When the engine started, Unix seconds: its counters' `_created`.
    created: f64,
}

/// How often a running sequence makes a token, for the engine's work counter.
const TOKEN_MS: u128 = 10;

impl Engine {
    /// The tokens generated so far, brought up to date: `running` sequences made one each every
    /// [`TOKEN_MS`] since the last reading if the engine was `working` (not wedged).
    fn generated(&self, running: usize, working: bool) -> u64 {
        let now = std::time::Instant::now();
        let mut generated = self
            .generated
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(last) = generated.0
            && working
        {
            let steps = (now - last).as_millis() / TOKEN_MS;
            let made = u64::try_from(steps).unwrap_or(u64::MAX);
            generated.1 = generated
                .1
                .saturating_add(made.saturating_mul(running as u64));
        }
        generated.0 = Some(now);
        generated.1
    }

    pub(super) fn new(spec: EngineSpec) -> Engine {
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |since| since.as_secs_f64());
        Engine {
            cache: Mutex::new(PrefixCache::new(spec.cache_blocks)),
            spec,
            queries: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            kv_held: AtomicU64::new(0),
            generated: Mutex::new((None, 0)),
            created,
        }
    }

    fn block_words(&self) -> u64 {
        u64::from(self.spec.block_words.max(1))
    }

    /// Looks a context of `words` words up in the prefix cache as its request takes its place in
    /// the batch, and holds its blocks as just used; counts the query. The words found cached.
    fn admit(&self, context: &str, words: u64) -> u64 {
        let blocks = block_hashes(context, self.spec.block_words as usize);
        let matched = self
            .cache
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .admit(&blocks);
        let cached = (matched as u64 * self.block_words()).min(words);
        self.queries.fetch_add(words, Ordering::Relaxed);
        self.hits.fetch_add(cached, Ordering::Relaxed);
        cached
    }

    /// The prefill of `words` words not in the prefix cache (before a `slow` factor).
    fn prefill(&self, words: u64) -> Duration {
        let words = u32::try_from(words).unwrap_or(u32::MAX);
        self.spec.prefill_per_word.get().saturating_mul(words)
    }

    /// Prompt words looked up in the prefix cache so far, and those found there.
    pub(super) fn prefix_counts(&self) -> (u64, u64) {
        (
            self.queries.load(Ordering::Relaxed),
            self.hits.load(Ordering::Relaxed),
        )
    }

    /// The share of KV-cache blocks the running sequences hold, at most 1.
    fn kv_usage(&self) -> f64 {
        let held = self.kv_held.load(Ordering::Relaxed) as f64;
        (held / self.spec.kv_blocks.max(1) as f64).min(1.0)
    }

    /// The blocks `words` words fill, the last one partly.
    fn blocks(&self, words: u64) -> u64 {
        words.div_ceil(self.block_words())
    }
}

/// A sequence in the batch: its hold on the KV cache, given back when it is dropped.
pub(super) struct Sequence {
    engine: Arc<Engine>,
    words: u64,
    blocks: u64,
}

impl Sequence {
    fn new(engine: Arc<Engine>, words: u64) -> Sequence {
        let blocks = engine.blocks(words);
        engine.kv_held.fetch_add(blocks, Ordering::Relaxed);
        Sequence {
            engine,
            words,
            blocks,
        }
    }

    /// `words` more generated: the blocks they fill are held too.
    pub(super) fn grow(&mut self, words: u64) {
        self.words = self.words.saturating_add(words);
        let blocks = self.engine.blocks(self.words);
        if blocks > self.blocks {
            self.engine
                .kv_held
                .fetch_add(blocks - self.blocks, Ordering::Relaxed);
            self.blocks = blocks;
        }
    }
}

impl Drop for Sequence {
    fn drop(&mut self) {
        self.engine
            .kv_held
            .fetch_sub(self.blocks, Ordering::Relaxed);
    }
}

/// Answers an OpenAI request on a node with an engine: read, placed in the batch (waiting as long as
/// it takes), looked up in the prefix cache, then answered with the prefill of what was not cached
/// before the first token.
pub(super) async fn serve(
    api: ServedApi,
    request: Request<Incoming>,
    shared: Arc<NodeShared>,
    engine: Arc<Engine>,
    in_flight: InFlight,
    reset: CancellationToken,
) -> Response<SimBody> {
    let (head, body) = request.into_parts();
    let body = match read_body(body).await {
        Ok(body) => body,
        Err(refusal) => return refusal,
    };
    let parsed = match openai::read(api, &head.headers, &body, shared.spec.tokens) {
        Ok(parsed) => parsed,
        Err(message) => return openai::bad_request(&message),
    };
    drop(body);
    let Ok(serving) = shared.slot(in_flight, None).await else {
        return stopping();
    };
    let words = parsed.prompt_words();
    let cached = engine.admit(parsed.context(), words);
    let admitted = Admitted {
        service_time: shared.service_time(),
        prefill: engine.prefill(words - cached),
        sequence: Some(Sequence::new(Arc::clone(&engine), words)),
        shared,
        serving,
        reset,
    };
    openai::respond(parsed, admitted).await
}

/// The answer to `GET /metrics` on a node whose engine (if any) has `running` sequences in its batch
/// and `waiting` requests in line: its metrics, or 404 where there are none, as FastAPI answers.
pub(super) fn metrics(
    engine: Option<&Engine>,
    running: usize,
    waiting: usize,
    working: bool,
) -> Response<SimBody> {
    let text = engine.and_then(|engine| {
        let (prefix_queries, prefix_hits) = engine.prefix_counts();
        let reading = exposition::Reading {
            running,
            waiting,
            kv_usage: engine.kv_usage(),
            prefix_queries,
            prefix_hits,
            generated: engine.generated(running, working),
        };
        exposition::exposition(
            engine.spec.metrics,
            &engine.spec.model,
            engine.created,
            &reading,
        )
    });
    match text {
        Some(text) => full(StatusCode::OK, exposition::CONTENT_TYPE, text),
        None => full(
            StatusCode::NOT_FOUND,
            "application/json",
            r#"{"detail":"Not Found"}"#,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(block_words: u32, cache_blocks: usize, kv_blocks: usize) -> Arc<Engine> {
        Arc::new(Engine::new(EngineSpec {
            block_words,
            cache_blocks,
            kv_blocks,
            ..EngineSpec::default()
        }))
    }

    fn words(range: std::ops::Range<u32>) -> String {
        range.map(|i| format!("w{i} ")).collect()
    }

    #[test]
    fn hits_count_whole_leading_blocks_and_queries_every_word() {
        let engine = engine(4, 100, 100);
        // 10 words: two full blocks cached after this, the last two words in none.
        assert_eq!(engine.admit(&words(0..10), 10), 0);
        assert_eq!(engine.admit(&words(0..10), 10), 8);
        // The same 8 words and more: 8 found; then the same and a different 9th word: 8 again.
        assert_eq!(engine.admit(&words(0..30), 30), 8);
        assert_eq!(engine.admit(&(words(0..8) + "other"), 9), 8);
        assert_eq!(engine.prefix_counts(), (10 + 10 + 30 + 9, 8 + 8 + 8));
        // The prefill is of the words not found.
        assert_eq!(engine.prefill(22), Duration::from_millis(22));
        assert_eq!(
            engine.prefill(u64::MAX),
            Duration::from_millis(u64::from(u32::MAX))
        );
    }

    #[test]
    fn sequences_hold_kv_blocks_for_their_context_and_what_they_streamed() {
        let engine = engine(4, 100, 10);
        let mut first = Sequence::new(Arc::clone(&engine), 5); // 2 blocks
        assert_eq!(engine.kv_usage(), 0.2);
        first.grow(3); // 8 words: still 2
        assert_eq!(engine.kv_usage(), 0.2);
        first.grow(1); // 9 words: 3
        assert_eq!(engine.kv_usage(), 0.3);
        let second = Sequence::new(Arc::clone(&engine), 40); // 10 blocks: more than there are
        assert_eq!(engine.kv_usage(), 1.0);
        drop(second);
        assert_eq!(engine.kv_usage(), 0.3);
        drop(first);
        assert_eq!(engine.kv_usage(), 0.0);
    }

    /// A node of one place, its line limited to none: three streams sent straight to it at once all
    /// wait (none shed), `/metrics` sees one running and two waiting without being counted, and the
    /// third, sharing the first's prefix, is prefilled for its new words alone.
    #[tokio::test]
    async fn an_engine_node_queues_without_bound_and_reports_itself() {
        use crate::sim::{Fleet, FleetConfig, NodeSpec};
        use bytes::Bytes;
        use http_body_util::{BodyExt, Full};
        use hyper_util::client::legacy::Client;
        use hyper_util::rt::TokioExecutor;

        let mut spec = NodeSpec::new("e", Duration::from_millis(600));
        spec.service_time.spread = 0.0;
        spec.capacity = 1;
        spec.queue = 0;
        spec.tokens = 3;
        spec.engine = Some(EngineSpec {
            block_words: 2,
            prefill_per_word: crate::config::HumanDuration::from_millis(10),
            model: "m".into(),
            ..EngineSpec::default()
        });
        let config = FleetConfig {
            seed: 1,
            nodes: vec![spec],
        };
        let fleet = Fleet::start(&config, Duration::from_secs(60))
            .await
            .unwrap();
        let node = &fleet.nodes()[0];
        let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
        let post = |prompt: &'static str| {
            let request = Request::post(format!("{}/v1/completions", node.url()))
                .body(Full::new(Bytes::from(format!(
                    r#"{{"prompt":"{prompt}","stream":true}}"#
                ))))
                .unwrap();
            let client = client.clone();
            tokio::spawn(async move {
                let response = client.request(request).await.unwrap();
                let status = response.status();
                let body = response.into_body().collect().await.unwrap().to_bytes();
                (status, String::from_utf8_lossy(&body).into_owned())
            })
        };
        let get = |path: &str| {
            let client = client.clone();
            let uri: http::Uri = format!("{}{path}", node.url()).parse().unwrap();
            async move {
                let response = client.get(uri).await.unwrap();
                let status = response.status();
                let body = response.into_body().collect().await.unwrap().to_bytes();
                (status, String::from_utf8_lossy(&body).into_owned())
            }
        };
        let first = post("a b c d 1");
        tokio::time::sleep(Duration::from_millis(50)).await;
        let rest = [post("x y 1"), post("a b c d e f 1")];
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (status, text) = get("/metrics").await;
        assert_eq!(status, StatusCode::OK);
        assert!(
            text.contains("\nvllm:num_requests_running{engine=\"0\",model_name=\"m\"} 1.0\n"),
            "{text}"
        );
        assert!(
            text.contains("\nvllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 2.0\n"),
            "{text}"
        );
        // Five words and the first token (at 110 ms; the next at 290 ms), three blocks of two: 3 / 2048.
        assert!(
            text.contains(
                "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.00146484375\n"
            ),
            "{text}"
        );
        for answer in [first].into_iter().chain(rest) {
            let (status, body) = answer.await.unwrap();
            assert_eq!(status, StatusCode::OK);
            assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
        }
        let stats = node.stats();
        assert_eq!((stats.received, stats.served, stats.shed), (3, 3, 0));
        assert_eq!(stats.max_waiting, 2);
        // 5 + 3 + 7 words asked; the third found the first's two blocks (4 words).
        assert_eq!((stats.prefix_queries, stats.prefix_hits), (15, 4));
        let (_, text) = get("/metrics").await;
        assert!(text.contains("vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 4.0\n"));
        assert!(text.contains("vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.0\n"));
        assert_eq!(node.stats().received, 3);
    }

    /// A node without an engine has no metrics: 404, not counted as a request.
    #[tokio::test]
    async fn a_node_without_an_engine_answers_metrics_404() {
        use crate::sim::{Fleet, FleetConfig, NodeSpec};
        use http_body_util::Empty;
        use hyper_util::client::legacy::Client;
        use hyper_util::rt::TokioExecutor;

        let config = FleetConfig {
            seed: 1,
            nodes: vec![NodeSpec::new("plain", Duration::from_millis(10))],
        };
        let fleet = Fleet::start(&config, Duration::from_secs(60))
            .await
            .unwrap();
        let node = &fleet.nodes()[0];
        let client = Client::builder(TokioExecutor::new()).build_http::<Empty<bytes::Bytes>>();
        let uri: http::Uri = format!("{}/metrics", node.url()).parse().unwrap();
        let response = client.get(uri).await.unwrap();
        assert_eq!(response.status(), StatusCode::NOT_FOUND);
        assert_eq!(node.stats().received, 0);
    }
}
