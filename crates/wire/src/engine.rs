//! What a model server's own `/metrics` says of its load: requests running in its batch, requests
//! waiting in its queue, the share of its KV cache in use. Each engine names these its own way (see
//! [`Engine`]); the exposition is the Prometheus text format.
//!
//! A vLLM server's page is tens of kilobytes of histograms; each line is read only as far as its
//! metric's name unless it is one of the few wanted, so reading a page costs a scan of its lines.
//! Samples of one metric with different labels (one per model, per data-parallel engine) are summed
//! for the counts; the cache use is their largest.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Which model server an endpoint runs, for the names of its metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Engine {
    /// `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (older
    /// releases: `vllm:gpu_cache_usage_perc`).
    #[default]
    Vllm,
    /// `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage`.
    Sglang,
    /// Text Generation Inference: `tgi_batch_current_size`, `tgi_queue_size` (no cache use).
    Tgi,
}

impl Engine {
    pub const ALL: [Engine; 3] = [Engine::Vllm, Engine::Sglang, Engine::Tgi];

    pub fn as_str(self) -> &'static str {
        match self {
            Engine::Vllm => "vllm",
            Engine::Sglang => "sglang",
            Engine::Tgi => "tgi",
        }
    }

    /// The metric names: running, waiting, and the cache use's (first found wins).
    fn names(self) -> Names {
        match self {
            Engine::Vllm => Names {
                running: "vllm:num_requests_running",
                waiting: "vllm:num_requests_waiting",
                cache: &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
                // Engine steps (a prefill's chunks among them), tokens made, prompts read.
                progress: &[
                    "vllm:iteration_tokens_total_count",
                    "vllm:generation_tokens_total",
                    "vllm:prompt_tokens_total",
                ],
            },
            Engine::Sglang => Names {
                running: "sglang:num_running_reqs",
                waiting: "sglang:num_queue_reqs",
                cache: &["sglang:token_usage"],
                progress: &[
                    "sglang:generation_tokens_total",
                    "sglang:prompt_tokens_total",
                ],
            },
            Engine::Tgi => Names {
                running: "tgi_batch_current_size",
                waiting: "tgi_queue_size",
                cache: &[],
                // Forward passes of the batch.
                progress: &["tgi_batch_forward_duration_count"],
            },
        }
    }
}

impl fmt::Display for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An engine's name as a pod's label or annotation gives it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} names no engine; there are vllm, sglang, tgi")]
pub struct UnknownEngine(pub String);

impl FromStr for Engine {
    type Err = UnknownEngine;

    fn from_str(name: &str) -> Result<Engine, UnknownEngine> {
        Engine::ALL
            .into_iter()
            .find(|engine| engine.as_str().eq_ignore_ascii_case(name.trim()))
            .ok_or_else(|| UnknownEngine(name.to_owned()))
    }
}

struct Names {
    running: &'static str,
    waiting: &'static str,
    cache: &'static [&'static str],
    /// Counters that move whenever the engine works: summed, their total says whether it did.
    progress: &'static [&'static str],
}

/// One reading of a server's load.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineLoad {
    /// Requests in its batch.
    pub running: u32,
    /// Requests in its own queue.
    pub waiting: u32,
    /// Share of its KV cache in use, 0 to 1, when it says.
    pub cache: Option<f64>,
    /// The sum of its work counters (engine steps, tokens), when it has any: a page whose sum does
    /// not move while requests run there comes from a wedged engine.
    pub progress: Option<f64>,
}

/// Why a page gave no reading.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NoReading {
    #[error("the page has no {0} metric")]
    Missing(&'static str),
}

/// `engine`'s load as the exposition `page` gives it.
pub fn read_load(engine: Engine, page: &str) -> Result<EngineLoad, NoReading> {
    let names = engine.names();
    let (mut running, mut waiting, mut progress) = (None::<f64>, None::<f64>, None::<f64>);
    // The cache use by the place of its name in `names.cache`: the first name found wins.
    let mut cache: [Option<f64>; 2] = [None; 2];
    for line in page.lines() {
        let Some((name, value)) = sample(line) else {
            continue;
        };
        let add = |total: &mut Option<f64>| *total = Some(total.unwrap_or(0.0) + value);
        if name == names.running {
            add(&mut running);
        } else if name == names.waiting {
            add(&mut waiting);
        } else if names.progress.contains(&name) {
            add(&mut progress);
        } else if let Some(at) = names.cache.iter().position(|c| *c == name) {
            let fullest = &mut cache[at.min(1)];
            *fullest = Some(fullest.map_or(value, |v| v.max(value)));
        }
    }
    let count = |v: f64| v.round().min(f64::from(u32::MAX)) as u32;
    let running = running.ok_or(NoReading::Missing(names.running))?;
    let waiting = waiting.ok_or(NoReading::Missing(names.waiting))?;
    Ok(EngineLoad {
        running: count(running),
        waiting: count(waiting),
        cache: cache
            .into_iter()
            .flatten()
            .next()
            .map(|c| c.clamp(0.0, 1.0)),
        progress,
    })
}

/// A sample line's metric name and value, when it is one with a finite, non-negative value: `name`,
/// optionally `{labels}` (quoted values may hold `}` and escapes), whitespace, the value, and an
/// optional timestamp. Comments, blank lines and anything else are `None`.
///
/// Hand-written, not `prometheus-parse`: that crate's names are `\w+`, so it cannot read a name with a
/// `:`, which is every vLLM and SGLang metric (colons are valid in the format's names).
fn sample(line: &str) -> Option<(&str, f64)> {
    let line = line.trim_start();
    if line.starts_with('#') {
        return None;
    }
    let end = line.find(['{', ' ', '\t']).unwrap_or(line.len());
    let (name, mut rest) = line.split_at(end);
    if name.is_empty() {
        return None;
    }
    if rest.starts_with('{') {
        rest = &rest[labels_end(rest)?..];
    }
    let value = rest.split_ascii_whitespace().next()?;
    let value = match value {
        "NaN" | "+Inf" | "-Inf" | "Inf" => return None,
        number => number.parse::<f64>().ok()?,
    };
    (value.is_finite() && value >= 0.0).then_some((name, value))
}

/// Where the label set opening `text` ends (just past its `}`), skipping quoted values.
fn labels_end(text: &str) -> Option<usize> {
    let mut quoted = false;
    let mut escaped = false;
    for (at, c) in text.char_indices() {
        match (quoted, escaped, c) {
            (true, true, _) => escaped = false,
            (true, false, '\\') => escaped = true,
            (_, false, '"') => quoted = !quoted,
            (false, _, '}') => return Some(at + 1),
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = "\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine=\"0\",model_name=\"llama\"} 7.0
vllm:num_requests_running{engine=\"1\",model_name=\"llama\"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine=\"0\",model_name=\"llama\"} 3.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"llama\"} 0.42
vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"llama\"} 0.1
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le=\"0.001\",model_name=\"llama\"} 0.0
vllm:time_to_first_token_seconds_bucket{le=\"+Inf\",model_name=\"llama\"} 12.0
vllm:time_to_first_token_seconds_count{model_name=\"llama\"} 12.0
";

    #[test]
    fn vllm_counts_are_summed_over_engines_and_the_cache_is_the_fullest() {
        let load = read_load(Engine::Vllm, VLLM).unwrap();
        assert_eq!(load.running, 8);
        assert_eq!(load.waiting, 3);
        assert_eq!(load.cache, Some(0.42));
    }

    #[test]
    fn work_counters_sum_and_the_waiting_by_reason_gauge_is_not_the_waiting_one() {
        // As vLLM 0.32 writes them, one data-parallel engine each.
        let page = "\
vllm:num_requests_running{engine=\"0\",model_name=\"tiny\"} 2.0
vllm:num_requests_running{engine=\"1\",model_name=\"tiny\"} 3.0
vllm:num_requests_waiting{engine=\"0\",model_name=\"tiny\"} 1.0
vllm:num_requests_waiting_by_reason{engine=\"0\",model_name=\"tiny\",reason=\"capacity\"} 7.0
vllm:num_requests_waiting_by_reason{engine=\"0\",model_name=\"tiny\",reason=\"deferred\"} 5.0
vllm:generation_tokens_total{engine=\"0\",model_name=\"tiny\"} 100.0
vllm:generation_tokens_created{engine=\"0\",model_name=\"tiny\"} 1.7e9
vllm:prompt_tokens_total{engine=\"0\",model_name=\"tiny\"} 20.0
vllm:iteration_tokens_total_count{engine=\"0\",model_name=\"tiny\"} 30.0
vllm:iteration_tokens_total_sum{engine=\"0\",model_name=\"tiny\"} 120.0
";
        let load = read_load(Engine::Vllm, page).unwrap();
        assert_eq!((load.running, load.waiting), (5, 1));
        assert_eq!(load.progress, Some(150.0));
        let quiet = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n";
        assert_eq!(read_load(Engine::Vllm, quiet).unwrap().progress, None);
    }

    #[test]
    fn older_vllm_names_its_cache_otherwise() {
        let page = "vllm:num_requests_running 2\nvllm:num_requests_waiting 0\nvllm:gpu_cache_usage_perc 0.5\n";
        assert_eq!(
            read_load(Engine::Vllm, page).unwrap(),
            EngineLoad {
                running: 2,
                waiting: 0,
                cache: Some(0.5),
                progress: None,
            }
        );
    }

    #[test]
    fn sglang_and_tgi_by_their_own_names() {
        let sglang = "# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{model_name=\"m\"} 4\nsglang:num_queue_reqs{model_name=\"m\"} 9\nsglang:token_usage{model_name=\"m\"} 0.91\n";
        let load = read_load(Engine::Sglang, sglang).unwrap();
        assert_eq!((load.running, load.waiting, load.cache), (4, 9, Some(0.91)));
        let tgi = "tgi_batch_current_size 6\ntgi_queue_size 2\n";
        let load = read_load(Engine::Tgi, tgi).unwrap();
        assert_eq!((load.running, load.waiting, load.cache), (6, 2, None));
        // The wrong engine's names: a page without the metrics asked for.
        assert_eq!(
            read_load(Engine::Vllm, tgi),
            Err(NoReading::Missing("vllm:num_requests_running"))
        );
    }

    #[test]
    fn nonsense_values_are_not_load() {
        let page = "vllm:num_requests_running NaN\nvllm:num_requests_waiting -3\n";
        assert!(read_load(Engine::Vllm, page).is_err());
        let page = "vllm:num_requests_running 1e12\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 7\n";
        let load = read_load(Engine::Vllm, page).unwrap();
        assert_eq!((load.running, load.cache), (u32::MAX, Some(1.0)));
    }

    #[test]
    fn engines_are_named_as_pods_name_them() {
        assert_eq!("vLLM".parse::<Engine>(), Ok(Engine::Vllm));
        assert_eq!(" sglang ".parse::<Engine>(), Ok(Engine::Sglang));
        assert_eq!(
            "triton".parse::<Engine>().unwrap_err().to_string(),
            "\"triton\" names no engine; there are vllm, sglang, tgi"
        );
    }

    proptest::proptest! {
        #[test]
        fn any_page_is_read_without_panic(page in "[ -~\n]{0,300}") {
            let _ = read_load(Engine::Vllm, &page);
        }

        #[test]
        fn any_page_of_wanted_names_is_read_without_panic(
            lines in proptest::collection::vec(
                ("(vllm:num_requests_running|vllm:num_requests_waiting|# TYPE vllm:num_requests_waiting)",
                 "[ -~]{0,30}"), 0..6)
        ) {
            let page: String = lines.iter().map(|(name, rest)| format!("{name}{rest}\n")).collect();
            let _ = read_load(Engine::Vllm, &page);
        }
    }
}
