//! The Prometheus text a simulated engine answers `GET /metrics` with (exposition format 0.0.4), in
//! the names, labels, help texts and number formats of the server it plays: vLLM and SGLang write
//! through Python's `prometheus_client` (floats such as `3.0` and `1.234567e+06`, a counter's
//! `_total` with its `_created` series), TGI through Rust's `metrics` exporter (bare numbers, no help).

use std::fmt::Write as _;

use crate::sim::MetricsFlavour;

/// The content type of the text.
pub(super) const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// What an engine reports at one moment.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Reading {
    /// Sequences in the batch.
    pub(super) running: usize,
    /// Requests waiting for a place in it.
    pub(super) waiting: usize,
    /// The share of KV-cache blocks in use, 0 to 1.
    pub(super) kv_usage: f64,
    /// Prompt words looked up in the prefix cache, and those found there.
    pub(super) prefix_queries: u64,
    pub(super) prefix_hits: u64,
    /// Tokens generated since the engine started.
    pub(super) generated: u64,
}

/// The text of `reading` in `flavour`, for the model `model`, the counters created at `created`
/// (Unix seconds); None for [`MetricsFlavour::Off`].
pub(super) fn exposition(
    flavour: MetricsFlavour,
    model: &str,
    created: f64,
    reading: &Reading,
) -> Option<String> {
    let mut out = String::new();
    let model = escape(model);
    let count = |n: usize| python_float(n as f64);
    match flavour {
        MetricsFlavour::Vllm | MetricsFlavour::VllmLegacy => {
            let (labels, running_help, kv) = if flavour == MetricsFlavour::Vllm {
                (
                    format!(r#"engine="0",model_name="{model}""#),
                    "Number of requests in model execution batches.",
                    (
                        "vllm:kv_cache_usage_perc",
                        "KV-cache usage. 1 means 100 percent usage.",
                    ),
                )
            } else {
                (
                    format!(r#"model_name="{model}""#),
                    "Number of requests currently running on GPU.",
                    (
                        "vllm:gpu_cache_usage_perc",
                        "GPU KV-cache usage. 1 means 100 percent usage.",
                    ),
                )
            };
            let gauges = [
                (
                    "vllm:num_requests_running",
                    running_help,
                    count(reading.running),
                ),
                (
                    "vllm:num_requests_waiting",
                    "Number of requests waiting to be processed.",
                    count(reading.waiting),
                ),
                (kv.0, kv.1, python_float(reading.kv_usage)),
            ];
            for (name, help, value) in gauges {
                family(&mut out, name, Some(help), "gauge", &labels, &value);
            }
            let counters = [
                (
                    "vllm:prefix_cache_queries",
                    "Prefix cache queries, in terms of number of queried tokens.",
                    reading.prefix_queries,
                ),
                (
                    "vllm:prefix_cache_hits",
                    "Prefix cache hits, in terms of number of cached tokens.",
                    reading.prefix_hits,
                ),
                (
                    "vllm:generation_tokens",
                    "Number of generation tokens processed.",
                    reading.generated,
                ),
            ];
            for (name, help, value) in counters {
                let total = format!("{name}_total");
                let value = python_float(value as f64);
                family(&mut out, &total, Some(help), "counter", &labels, &value);
                let created_name = format!("{name}_created");
                let created = python_float(created);
                family(
                    &mut out,
                    &created_name,
                    Some(help),
                    "gauge",
                    &labels,
                    &created,
                );
            }
        }
        MetricsFlavour::Sglang => {
            let labels = format!(r#"model_name="{model}""#);
            let gauges = [
                (
                    "sglang:num_running_reqs",
                    "The number of running requests",
                    count(reading.running),
                ),
                (
                    "sglang:num_queue_reqs",
                    "The number of requests in the waiting queue",
                    count(reading.waiting),
                ),
                (
                    "sglang:token_usage",
                    "The token usage",
                    python_float(reading.kv_usage),
                ),
            ];
            for (name, help, value) in gauges {
                family(&mut out, name, Some(help), "gauge", &labels, &value);
            }
        }
        MetricsFlavour::Tgi => {
            for (name, value) in [
                ("tgi_batch_current_size", reading.running),
                ("tgi_queue_size", reading.waiting),
            ] {
                family(&mut out, name, None, "gauge", "", &value.to_string());
            }
        }
        MetricsFlavour::Off => return None,
    }
    Some(out)
}

/// One metric family of one sample: its `# HELP` (if any) and `# TYPE` lines and the sample.
fn family(out: &mut String, name: &str, help: Option<&str>, kind: &str, labels: &str, value: &str) {
    if let Some(help) = help {
        let _ = writeln!(out, "# HELP {name} {help}");
    }
    let _ = writeln!(out, "# TYPE {name} {kind}");
    if labels.is_empty() {
        let _ = writeln!(out, "{name} {value}");
    } else {
        let _ = writeln!(out, "{name}{{{labels}}} {value}");
    }
}

/// A label value escaped for the text format: backslash, double quote and line feed.
fn escape(value: &str) -> String {
    value
        .replace('\\', r"\\")
        .replace('"', r#"\""#)
        .replace('\n', r"\n")
}

/// `value` as `prometheus_client` writes it (its `floatToGoString`): Python's `repr` of the float
/// (`3.0`, `0.125`, `1e-05`, `1e+16`), except that a positive value with more than six digits before
/// its point is written with an exponent (`1.234567e+06`; from ten digits on, Python's code writes
/// `e+010`, and so does this).
pub(super) fn python_float(value: f64) -> String {
    if value.is_nan() {
        return "NaN".to_owned();
    }
    if value.is_infinite() {
        return if value > 0.0 { "+Inf" } else { "-Inf" }.to_owned();
    }
    let repr = python_repr(value);
    match repr.find('.') {
        Some(dot) if value > 0.0 && dot > 6 => {
            let digits = format!("{}{}", &repr[1..dot], &repr[dot + 1..]);
            let mantissa = format!("{}.{digits}", &repr[..1]);
            let mantissa = mantissa.trim_end_matches(['0', '.']);
            format!("{mantissa}e+0{}", dot - 1)
        }
        _ => repr,
    }
}

/// Python's `repr` of a float: the shortest digits that read back as it, with an exponent below 1e-4
/// and from 1e16 (Rust's `Debug` makes the same choices), the exponent signed and of two digits at
/// least.
fn python_repr(value: f64) -> String {
    let debug = format!("{value:?}");
    let Some((mantissa, exponent)) = debug.split_once('e') else {
        return debug;
    };
    let (sign, digits) = match exponent.strip_prefix('-') {
        Some(digits) => ('-', digits),
        None => ('+', exponent),
    };
    format!("{mantissa}e{sign}{digits:0>2}")
}

#[cfg(test)]
mod tests {
    use super::*;

    const READING: Reading = Reading {
        running: 3,
        waiting: 12,
        kv_usage: 0.125,
        prefix_queries: 1_234_567,
        prefix_hits: 640,
        generated: 42,
    };

    #[test]
    fn floats_are_written_as_prometheus_client_writes_them() {
        for (value, written) in [
            (0.0, "0.0"),
            (3.0, "3.0"),
            (0.125, "0.125"),
            (0.1, "0.1"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (123456.0, "123456.0"),
            (1234567.0, "1.234567e+06"),
            (1000000.0, "1e+06"),
            (1.7769301736864316e9, "1.7769301736864316e+09"),
            (1e10, "1e+010"),
            (1e16, "1e+16"),
            (-2.5, "-2.5"),
            (f64::INFINITY, "+Inf"),
            (f64::NAN, "NaN"),
        ] {
            assert_eq!(python_float(value), written, "{value}");
        }
    }

    #[test]
    fn vllm_writes_its_v1_names_with_engine_and_model_labels() {
        let text = exposition(MetricsFlavour::Vllm, "sim", 1.75e9, &READING).unwrap();
        let expected = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="sim"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="sim"} 12.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="sim"} 0.125
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="sim"} 1.234567e+06
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="sim"} 1.75e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="sim"} 640.0
# HELP vllm:prefix_cache_hits_created Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_created gauge
vllm:prefix_cache_hits_created{engine="0",model_name="sim"} 1.75e+09
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="sim"} 42.0
# HELP vllm:generation_tokens_created Number of generation tokens processed.
# TYPE vllm:generation_tokens_created gauge
vllm:generation_tokens_created{engine="0",model_name="sim"} 1.75e+09
"#;
        assert_eq!(text, expected);
    }

    #[test]
    fn the_other_flavours_use_their_own_names() {
        let legacy = exposition(MetricsFlavour::VllmLegacy, "m", 0.0, &READING).unwrap();
        assert!(legacy.contains("\nvllm:gpu_cache_usage_perc{model_name=\"m\"} 0.125\n"));
        assert!(legacy.contains("\nvllm:num_requests_waiting{model_name=\"m\"} 12.0\n"));
        assert!(legacy.contains("\nvllm:prefix_cache_hits_total{model_name=\"m\"} 640.0\n"));
        assert!(!legacy.contains("kv_cache_usage_perc"));

        let sglang = exposition(MetricsFlavour::Sglang, "m", 0.0, &READING).unwrap();
        assert_eq!(
            sglang,
            "# HELP sglang:num_running_reqs The number of running requests\n\
             # TYPE sglang:num_running_reqs gauge\n\
             sglang:num_running_reqs{model_name=\"m\"} 3.0\n\
             # HELP sglang:num_queue_reqs The number of requests in the waiting queue\n\
             # TYPE sglang:num_queue_reqs gauge\n\
             sglang:num_queue_reqs{model_name=\"m\"} 12.0\n\
             # HELP sglang:token_usage The token usage\n\
             # TYPE sglang:token_usage gauge\n\
             sglang:token_usage{model_name=\"m\"} 0.125\n"
        );

        let tgi = exposition(MetricsFlavour::Tgi, "m", 0.0, &READING).unwrap();
        assert_eq!(
            tgi,
            "# TYPE tgi_batch_current_size gauge\ntgi_batch_current_size 3\n\
             # TYPE tgi_queue_size gauge\ntgi_queue_size 12\n"
        );

        assert_eq!(exposition(MetricsFlavour::Off, "m", 0.0, &READING), None);
        // A model name is escaped as a label value.
        let odd = exposition(MetricsFlavour::Sglang, "a\"b\\c", 0.0, &READING).unwrap();
        assert!(odd.contains(r#"{model_name="a\"b\\c"}"#), "{odd}");
    }
}
