//! A simulated fleet of interruptible GPU inference nodes on 127.0.0.1, used by `tongs demo`,
//! `tongs sim`, the tests and the benchmarks.
//!
//! Each node serves inference-like requests with a lognormal service time, a capacity (requests served at
//! once, like a GPU batch) and a bounded waiting line beyond which it sheds load with `503` +
//! `Retry-After`, as an inference server does. Responses are JSON or Server-Sent Event token streams;
//! `POST /v1/completions` and `POST /v1/chat/completions` answer as vLLM's OpenAI server does, with a
//! deterministic model whose every answer a client can predict (see `openai.rs`).
//! Healthy nodes also pause the way real inference servers do, when a fleet asks for it: a first-token
//! wait that grows with the prompt and the load ([`FirstToken`]), keep-alive comments meanwhile
//! (`comment_every`), and a stream preempted mid-answer and resumed after a pause ([`Preemption`]).
//! Nodes fail the ways real remote nodes fail (see [`InterruptionKind`]) on a fixed or seeded random
//! schedule, then recover. Everything listens on real sockets so a proxy in front of it meets real
//! resets, refusals and silences.
//!
//! A node with an `engine` ([`EngineSpec`]) serves its OpenAI paths as a continuous-batching server
//! such as vLLM does: `capacity` is the batch (vLLM's `max_num_seqs`), and the requests beyond it wait
//! in an unbounded line (no `queue` limit, no shedding). When a request gets its place in the batch,
//! its context (the prompt, or the messages' contents joined) is cut into blocks of `block_words`
//! words, each block's hash chaining the one before; its leading blocks already in the node's prefix
//! cache (an LRU of `cache_blocks` blocks) are not computed again, and the first token comes
//! `prefill_per_word` × the other words later (times a `slow` factor), after the node's usual
//! first-token wait; the rest at the node's pace. `GET /metrics` answers the engine's gauges and
//! counters in Prometheus text, named as vLLM, SGLang or TGI name them (`metrics`), and the node's
//! [`NodeStats`] count the same prefix queries and hits (see `engine.rs`). A node without an engine,
//! or whose engine's `metrics` is `none`, answers `GET /metrics` with 404. Like `/health`, `/metrics`
//! is not counted as a request, answers however full the batch is, and goes the way `/health` goes
//! in each interruption.

mod engine;
mod going;
mod node;
mod openai;
mod reply;
mod schedule;
mod socket;
mod stream;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

pub use engine::{PrefixCache, block_hashes};
pub use node::{Node, NodeStats};
pub use reply::sse_response;
pub use schedule::{
    Condition, Interruption, InterruptionKind, RandomInterruptions, lognormal, plan,
};

use crate::config::{ConfigError, HumanDuration, Problem, load_validated, parse_validated};

/// A fleet of simulated nodes (the file `tongs sim --config FILE` reads).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FleetConfig {
    /// Seed for service times and random interruptions: the same seed replays the same run.
    pub seed: u64,
    pub nodes: Vec<NodeSpec>,
}

/// One simulated node.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeSpec {
    pub name: String,
    /// Where the node listens; port 0 picks a free one.
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    #[serde(default)]
    pub service_time: ServiceTime,
    /// Requests served at once (a GPU batch; with an engine, its `max_num_seqs`).
    #[serde(default = "default_capacity")]
    pub capacity: usize,
    /// Requests allowed to wait for capacity; beyond that the node answers 503 with Retry-After. Not
    /// an engine's OpenAI requests: they wait without bound.
    #[serde(default = "default_queue")]
    pub queue: usize,
    /// `json` (one body after the service time) or `sse` (a token stream over the service time).
    /// A request with `Accept: text/event-stream` always gets a stream. The OpenAI paths follow the
    /// request's `stream` field instead.
    #[serde(default)]
    pub response: ResponseKind,
    /// Tokens in a streamed response. On the OpenAI paths, the `max_tokens` of a request that names
    /// none, and the pace of every stream: a token each service time × 0.9 / `tokens`.
    #[serde(default = "default_tokens")]
    pub tokens: u32,
    /// Report in-flight count and capacity in `x-sim-in-flight` / `x-sim-capacity` response headers.
    #[serde(default)]
    pub report_load: bool,
    /// Interruptions at fixed times after the fleet starts.
    #[serde(default)]
    pub interruptions: Vec<Interruption>,
    /// Interruptions at seeded random times.
    #[serde(default)]
    pub random_interruptions: Option<RandomInterruptions>,
    /// A wait before the first token that grows with the prompt and the load, as a real server's
    /// queueing and prefill do. None: the first token after a tenth of the service time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_token: Option<FirstToken>,
    /// Send an SSE comment (`: ping`) at once and then at this interval while a stream waits for its
    /// first token, as some servers and gateways do to keep idle connections open (vLLM does not).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comment_every: Option<HumanDuration>,
    /// Streams paused mid-answer, as vLLM pauses a sequence it preempts under KV-cache pressure and
    /// recomputes. None: no stream pauses.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preemption: Option<Preemption>,
    /// Serve the OpenAI paths as a continuous-batching engine does: an unbounded waiting line, a
    /// prefix cache, a prefill that grows with the words not cached, and `GET /metrics`. None: the
    /// OpenAI paths are admitted like any request, and `/metrics` answers 404.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<EngineSpec>,
    /// Tokens one streamed OpenAI chunk carries: 1, or more as vLLM's API server sends several in one
    /// chunk under load (what its engine made while the server lagged), so that counting chunks is
    /// not counting tokens.
    #[serde(default = "default_chunk_tokens")]
    pub chunk_tokens: u32,
}

fn default_chunk_tokens() -> u32 {
    1
}

fn default_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

fn default_capacity() -> usize {
    4
}

fn default_queue() -> usize {
    16
}

fn default_tokens() -> u32 {
    16
}

/// Mean and spread of a lognormal service time.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceTime {
    pub mean: HumanDuration,
    /// Standard deviation of the underlying normal; 0 = always the mean, 0.3 is a realistic spread.
    #[serde(default)]
    pub spread: f64,
}

impl Default for ServiceTime {
    fn default() -> Self {
        ServiceTime {
            mean: HumanDuration::from_millis(200),
            spread: 0.3,
        }
    }
}

/// How long a stream waits for its first token on a node that queues and prefills like a real one:
/// `wait + per_prompt_word × the prompt's words + per_in_flight × the other requests in flight on the
/// node`, drawn lognormal around that with `spread`, and multiplied by a `slow` interruption's factor.
///
/// A continued stream resends the answer so far as its prompt, so it waits longer than the stream it
/// continues: a proxy that takes that wait for a dead node cuts healthy streams.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FirstToken {
    /// The wait of an empty prompt on an idle node.
    pub wait: HumanDuration,
    /// More for each whitespace-separated word of the prompt (prefill grows with it).
    pub per_prompt_word: HumanDuration,
    /// More for each other request in flight on the node, waiting or served (a busy batch).
    pub per_in_flight: HumanDuration,
    /// Standard deviation of the underlying normal, as for the service time; 0 = always the sum.
    pub spread: f64,
}

/// Streams preempted mid-answer: with probability `chance + per_in_flight × the other requests in
/// flight on the node` (at most 1), a stream pauses once, after a token drawn uniformly among all but
/// its last, for `pause` (lognormal with `spread`), then goes on at its pace. The node stays healthy
/// meanwhile: heartbeats answer and other streams flow. A whole answer drawn preempted comes that much
/// later.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Preemption {
    /// Probability that a stream on an otherwise idle node is preempted, from 0 to 1.
    #[serde(default)]
    pub chance: f64,
    /// Added to `chance` for each other request in flight: preemption comes with load.
    #[serde(default)]
    pub per_in_flight: f64,
    /// How long a preempted stream pauses (its recompute).
    pub pause: HumanDuration,
    /// Standard deviation of the underlying normal of the pause; 0 = always `pause`.
    #[serde(default)]
    pub spread: f64,
}

/// A continuous-batching inference engine in a node, vLLM-like (see the module's documentation).
/// Every field has a default, so `engine: {}` is an engine.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineSpec {
    /// Words of a prefix-cache block (vLLM's `block_size`, in tokens there); 16.
    pub block_words: u32,
    /// Blocks the prefix cache holds, least recently used evicted first; 4096. 0: no prefix cache.
    pub cache_blocks: usize,
    /// The prefill of each word not in the prefix cache, before the first token; 1ms.
    pub prefill_per_word: HumanDuration,
    /// KV-cache blocks, of `block_words` words each: the denominator of the KV-cache usage, which
    /// counts the blocks of every running sequence's context and of the tokens it has streamed so far
    /// (a whole answer's tokens are not counted before it is done); 2048.
    pub kv_blocks: usize,
    /// The `model_name` label of the metrics; `sim`.
    pub model: String,
    /// How `GET /metrics` names what it reports; `vllm`.
    pub metrics: MetricsFlavour,
}

impl Default for EngineSpec {
    fn default() -> Self {
        EngineSpec {
            block_words: 16,
            cache_blocks: 4096,
            prefill_per_word: HumanDuration::from_millis(1),
            kv_blocks: 2048,
            model: "sim".to_owned(),
            metrics: MetricsFlavour::Vllm,
        }
    }
}

/// The metric names an engine's `GET /metrics` writes, as each server writes them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MetricsFlavour {
    /// vLLM's V1 engine: `vllm:num_requests_running`, `vllm:num_requests_waiting`,
    /// `vllm:kv_cache_usage_perc`, `vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total`
    /// (with their `_created` series), labelled `engine="0",model_name="…"`.
    #[default]
    Vllm,
    /// vLLM before 0.9.2: the same, labelled `model_name="…"` only, with `vllm:gpu_cache_usage_perc`
    /// for the KV-cache usage.
    VllmLegacy,
    /// SGLang: `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage`.
    Sglang,
    /// Text Generation Inference: `tgi_batch_current_size`, `tgi_queue_size`, unlabelled; no KV
    /// metric.
    Tgi,
    /// `none`: no metrics, `/metrics` answers 404.
    #[serde(rename = "none")]
    Off,
}

/// How a node answers an inference request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ResponseKind {
    #[default]
    Json,
    Sse,
}

impl NodeSpec {
    /// A node with defaults and the given name and mean service time.
    pub fn new(name: &str, mean: Duration) -> NodeSpec {
        NodeSpec {
            name: name.to_owned(),
            listen: default_listen(),
            service_time: ServiceTime {
                mean: HumanDuration(mean),
                spread: 0.3,
            },
            capacity: default_capacity(),
            queue: default_queue(),
            response: ResponseKind::Json,
            tokens: default_tokens(),
            report_load: false,
            interruptions: Vec::new(),
            random_interruptions: None,
            first_token: None,
            comment_every: None,
            preemption: None,
            engine: None,
            chunk_tokens: default_chunk_tokens(),
        }
    }
}

impl FleetConfig {
    pub fn load(path: &Path) -> Result<FleetConfig, ConfigError> {
        load_validated(path, FleetConfig::validate)
    }

    pub fn parse(text: &str, origin: &str) -> Result<FleetConfig, ConfigError> {
        parse_validated(text, origin, FleetConfig::validate)
    }

    pub fn validate(&self) -> Vec<Problem> {
        let mut problems = Vec::new();
        let mut problem = |field: String, message: &str| {
            problems.push(Problem {
                field,
                message: message.to_owned(),
            })
        };
        if self.nodes.is_empty() {
            problem("nodes".into(), "the fleet needs at least one node");
        }
        let mut names = HashSet::new();
        for (i, node) in self.nodes.iter().enumerate() {
            let at = |field: &str| format!("nodes[{i}].{field}");
            if node.name.trim().is_empty() {
                problem(at("name"), "must not be empty");
            } else if !names.insert(node.name.as_str()) {
                problem(at("name"), "is used by another node");
            }
            if node.service_time.mean.get().is_zero() {
                problem(at("service_time.mean"), "must be greater than zero");
            }
            if node.service_time.mean.get() > Duration::from_secs(3600) {
                problem(at("service_time.mean"), "must be at most 3600s");
            }
            if !(0.0..=3.0).contains(&node.service_time.spread) {
                problem(at("service_time.spread"), "must be between 0 and 3");
            }
            if node.capacity == 0 {
                problem(at("capacity"), "must be at least 1");
            }
            if node.tokens == 0 {
                problem(at("tokens"), "must be at least 1");
            }
            for (j, interruption) in node.interruptions.iter().enumerate() {
                // Times count from the fleet's start; a week bounds them well inside the clock's range.
                if interruption.at.get() > WEEK || interruption.duration.get() > WEEK {
                    problem(
                        at(&format!("interruptions[{j}]")),
                        "at and duration must be at most 604800s",
                    );
                }
                if interruption.duration.get().is_zero() {
                    problem(
                        at(&format!("interruptions[{j}].duration")),
                        "must be greater than zero",
                    );
                }
                if interruption.factor.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
                    problem(
                        at(&format!("interruptions[{j}].factor")),
                        "must be greater than zero",
                    );
                }
            }
            node.validate_pauses(&mut problem, &at);
            if let Some(engine) = &node.engine {
                if !(1..=4096).contains(&engine.block_words) {
                    problem(at("engine.block_words"), "must be from 1 to 4096");
                }
                if engine.kv_blocks == 0 {
                    problem(at("engine.kv_blocks"), "must be at least 1");
                }
                if engine.prefill_per_word.get() > Duration::from_secs(1) {
                    problem(at("engine.prefill_per_word"), "must be at most 1s");
                }
                if engine.model.trim().is_empty() {
                    problem(at("engine.model"), "must not be empty");
                }
            }
            if let Some(random) = &node.random_interruptions {
                if random.mean_interval.get() > WEEK || random.mean_duration.get() > WEEK {
                    problem(
                        at("random_interruptions"),
                        "mean_interval and mean_duration must be at most 604800s",
                    );
                }
                // Planned a day ahead at most: at one a second that is 86,400 entries per node.
                if random.mean_interval.get() < Duration::from_secs(1) {
                    problem(
                        at("random_interruptions.mean_interval"),
                        "must be at least 1s",
                    );
                }
                if random.kinds.is_empty() {
                    problem(
                        at("random_interruptions.kinds"),
                        "must name at least one kind",
                    );
                }
                if random.slow_factor.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
                    problem(
                        at("random_interruptions.slow_factor"),
                        "must be greater than zero",
                    );
                }
            }
        }
        problems
    }
}

impl NodeSpec {
    /// The problems of the pause keys, named by `at`.
    fn validate_pauses(
        &self,
        problem: &mut impl FnMut(String, &str),
        at: &impl Fn(&str) -> String,
    ) {
        let spread = |spread: f64| (0.0..=3.0).contains(&spread);
        if let Some(first) = &self.first_token {
            for (field, duration) in [
                ("wait", first.wait),
                ("per_prompt_word", first.per_prompt_word),
                ("per_in_flight", first.per_in_flight),
            ] {
                if duration.get() > HOUR {
                    problem(at(&format!("first_token.{field}")), "must be at most 3600s");
                }
            }
            if !spread(first.spread) {
                problem(at("first_token.spread"), "must be between 0 and 3");
            }
        }
        if let Some(every) = self.comment_every {
            // Zero would send comments without end and without a pause.
            if every.get() < Duration::from_millis(1) || every.get() > HOUR {
                problem(at("comment_every"), "must be from 1ms to 3600s");
            }
        }
        if let Some(preemption) = &self.preemption {
            let probability = |p: f64| (0.0..=1.0).contains(&p);
            if !probability(preemption.chance) {
                problem(at("preemption.chance"), "must be between 0 and 1");
            }
            if !probability(preemption.per_in_flight) {
                problem(at("preemption.per_in_flight"), "must be between 0 and 1");
            }
            if preemption.pause.get().is_zero() || preemption.pause.get() > HOUR {
                problem(
                    at("preemption.pause"),
                    "must be greater than zero and at most 3600s",
                );
            }
            if !spread(preemption.spread) {
                problem(at("preemption.spread"), "must be between 0 and 3");
            }
        }
    }
}

/// Longest first-token wait component or preemption pause a fleet file accepts.
const HOUR: Duration = Duration::from_secs(3600);

/// Longest interruption time or duration a fleet file accepts.
const WEEK: Duration = Duration::from_secs(7 * 24 * 3600);

/// A running fleet. Dropping it stops every node.
pub struct Fleet {
    nodes: Vec<Node>,
    started: Instant,
}

/// Each node's own stream of random numbers, derived from the fleet seed and its place.
fn node_seed(seed: u64, index: usize) -> u64 {
    seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(index as u64 + 1)
}

impl FleetConfig {
    /// Every node's interruptions up to `horizon`, fixed and random, as a run of this fleet meets
    /// them: a pure function of the configuration and its seed.
    pub fn planned(&self, horizon: Duration) -> Vec<Vec<Interruption>> {
        self.nodes
            .iter()
            .enumerate()
            .map(|(index, spec)| {
                plan(
                    &spec.interruptions,
                    spec.random_interruptions.as_ref(),
                    node_seed(self.seed, index),
                    horizon,
                )
            })
            .collect()
    }
}

impl Fleet {
    /// Starts every node; random interruptions are planned up to `horizon` after now
    /// ([`FleetConfig::planned`]).
    pub async fn start(config: &FleetConfig, horizon: Duration) -> std::io::Result<Fleet> {
        let started = Instant::now();
        let mut nodes = Vec::with_capacity(config.nodes.len());
        for (index, (spec, planned)) in config.nodes.iter().zip(config.planned(horizon)).enumerate()
        {
            let seed = node_seed(config.seed, index);
            nodes.push(Node::start(spec.clone(), seed, planned, started).await?);
        }
        Ok(Fleet { nodes, started })
    }

    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// The nodes' base URLs, in order.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(Node::url).collect()
    }

    /// When the fleet started (interruption times count from here).
    pub fn started(&self) -> Instant {
        self.started
    }

    /// Interruptions injected so far, over all nodes.
    pub fn interruptions_injected(&self) -> u64 {
        self.nodes.iter().map(|n| n.stats().interruptions).sum()
    }

    /// Inference requests that reached the nodes so far (every attempt a proxy sent), over all nodes.
    pub fn requests_received(&self) -> u64 {
        self.nodes.iter().map(|n| n.stats().received).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_fleet_file() {
        let text = r#"
seed: 42
nodes:
  - name: a100
    service_time: { mean: 50ms, spread: 0.2 }
    capacity: 8
    response: sse
    interruptions:
      - { kind: refuse, at: 10s, duration: 5s }
      - { kind: slow, at: 20s, duration: 5s, factor: 3 }
  - name: rtx3090
    random_interruptions: { mean_interval: 30s, mean_duration: 5s, kinds: [blackhole, gateway-503] }
    first_token: { wait: 600ms, per_prompt_word: 1ms, spread: 0.2 }
    comment_every: 250ms
    preemption: { chance: 0.1, pause: 3s }
"#;
        let fleet = FleetConfig::parse(text, "test").unwrap();
        assert_eq!(fleet.nodes.len(), 2);
        assert_eq!(fleet.nodes[0].response, ResponseKind::Sse);
        assert_eq!(fleet.nodes[0].interruptions[1].factor, 3.0);
        assert_eq!(fleet.nodes[1].capacity, 4);
        assert_eq!(
            fleet.nodes[1].random_interruptions.as_ref().unwrap().kinds,
            [InterruptionKind::Blackhole, InterruptionKind::Gateway503]
        );
        // The pauses: off unless set, their unset parts zero.
        assert_eq!(fleet.nodes[0].first_token, None);
        assert_eq!(fleet.nodes[0].comment_every, None);
        assert_eq!(fleet.nodes[0].preemption, None);
        let first = fleet.nodes[1].first_token.as_ref().unwrap();
        assert_eq!(first.wait, HumanDuration::from_millis(600));
        assert_eq!(first.per_in_flight, HumanDuration::default());
        assert_eq!(
            fleet.nodes[1].comment_every,
            Some(HumanDuration::from_millis(250))
        );
        let preemption = fleet.nodes[1].preemption.as_ref().unwrap();
        assert_eq!((preemption.chance, preemption.per_in_flight), (0.1, 0.0));
        assert_eq!(preemption.pause, HumanDuration::from_secs(3));
    }

    #[test]
    fn pause_problems_name_their_fields() {
        let text = concat!(
            "nodes:\n  - name: a\n    first_token: { wait: 2h, spread: 4 }\n",
            "    comment_every: 0s\n",
            "    preemption: { chance: 1.5, per_in_flight: -1, pause: 0s, spread: -1 }\n",
        );
        let err = FleetConfig::parse(text, "test").unwrap_err();
        let fields: Vec<_> = err.problems().iter().map(|p| p.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "nodes[0].first_token.wait",
                "nodes[0].first_token.spread",
                "nodes[0].comment_every",
                "nodes[0].preemption.chance",
                "nodes[0].preemption.per_in_flight",
                "nodes[0].preemption.pause",
                "nodes[0].preemption.spread",
            ]
        );
        let err = FleetConfig::parse(
            "nodes:\n  - name: a\n    preemption: { chance: 0.5 }\n",
            "t",
        )
        .unwrap_err();
        assert!(err.to_string().contains("pause"), "{err}");
    }

    #[test]
    fn fleet_problems_name_their_fields() {
        let text =
            "nodes:\n  - name: a\n    capacity: 0\n  - name: a\n    service_time: { mean: 0s }\n";
        let err = FleetConfig::parse(text, "test").unwrap_err();
        let fields: Vec<_> = err.problems().iter().map(|p| p.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "nodes[0].capacity",
                "nodes[1].name",
                "nodes[1].service_time.mean"
            ]
        );
        let err = FleetConfig::parse(
            "nodes:\n  - name: a\n    interruptions: [{ kind: melt, at: 1s, duration: 1s }]\n",
            "t",
        )
        .unwrap_err();
        assert!(
            err.problems()[0]
                .field
                .starts_with("nodes[0].interruptions[0]"),
            "{err}"
        );
    }

    #[test]
    fn engines_take_their_defaults_and_name_their_problems() {
        let text = concat!(
            "nodes:\n  - name: a\n    engine: {}\n",
            "  - name: b\n    engine: { block_words: 32, metrics: vllm-legacy }\n",
            "  - name: c\n    engine: { metrics: none, cache_blocks: 0 }\n",
        );
        let fleet = FleetConfig::parse(text, "test").unwrap();
        assert_eq!(fleet.nodes[0].engine, Some(EngineSpec::default()));
        let engine = EngineSpec::default();
        assert_eq!(
            (engine.block_words, engine.cache_blocks, engine.kv_blocks),
            (16, 4096, 2048)
        );
        assert_eq!(engine.prefill_per_word, HumanDuration::from_millis(1));
        assert_eq!(
            (engine.model.as_str(), engine.metrics),
            ("sim", MetricsFlavour::Vllm)
        );
        let b = fleet.nodes[1].engine.as_ref().unwrap();
        assert_eq!((b.block_words, b.metrics), (32, MetricsFlavour::VllmLegacy));
        let c = fleet.nodes[2].engine.as_ref().unwrap();
        assert_eq!((c.cache_blocks, c.metrics), (0, MetricsFlavour::Off));
        assert_eq!(fleet.nodes[0].capacity, 4);

        let text = concat!(
            "nodes:\n  - name: a\n",
            "    engine: { block_words: 0, kv_blocks: 0, prefill_per_word: 2s, model: \" \" }\n",
        );
        let err = FleetConfig::parse(text, "test").unwrap_err();
        let fields: Vec<_> = err.problems().iter().map(|p| p.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "nodes[0].engine.block_words",
                "nodes[0].engine.kv_blocks",
                "nodes[0].engine.prefill_per_word",
                "nodes[0].engine.model",
            ]
        );
        for bad in ["engine: { metrics: prometheus }", "engine: { batch: 8 }"] {
            let text = format!("nodes:\n  - name: a\n    {bad}\n");
            assert!(FleetConfig::parse(&text, "test").is_err(), "{bad}");
        }
    }
}
