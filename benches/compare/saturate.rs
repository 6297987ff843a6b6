//! The `saturate` scenario's load (the fleet and the report are `chat.rs`'s): streamed completions of
//! distinct prompts, open loop at 130 % of the engines' capacity. Engines never shed: what a proxy
//! does not hold back waits in the nodes' own lines.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use serde_json::json;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use super::Settings;
use super::chat::{EngineRow, SATURATE_LOAD, TOKENS, client, streamed};
use super::peers::Running;
use super::support::lock;

/// Offers completions at 130 % of `capacity` through `running` for the warm-up and the measured
/// window; the row of those sent in the window.
pub async fn run(running: &Running, capacity: f64, settings: &Settings) -> EngineRow {
    let rate = SATURATE_LOAD * capacity;
    eprintln!(
        "compare: saturate through {} ({rate:.0} req/s for {:?})",
        running.label, settings.duration
    );
    let client = client();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let tasks = TaskTracker::new();
    let start = Instant::now();
    let interval = Duration::from_secs_f64(1.0 / rate);
    for index in 0u64.. {
        let since = interval.mul_f64(index as f64);
        if since >= settings.warmup + settings.duration {
            break;
        }
        tokio::time::sleep_until(start + since).await;
        let recorded = since >= settings.warmup;
        let (client, url, seen) = (client.clone(), running.url.clone(), Arc::clone(&seen));
        tasks.spawn(async move {
            // The model counts on from the prompt's last integer: the answer is index + 1 …
            let body = json!({
                "model": "sim",
                "prompt": format!("request {index}"),
                "max_tokens": TOKENS,
                "stream": true,
            });
            let request = Request::post(format!("{url}/v1/completions"))
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(body.to_string())))
                .expect("a valid request");
            let expected: String = (1..=u64::from(TOKENS))
                .map(|i| format!(" {}", index + i))
                .collect();
            let text =
                |chunk: &serde_json::Value| chunk["choices"][0]["text"].as_str().map(str::to_owned);
            let outcome = streamed(&client, request, text, &expected).await;
            if recorded {
                lock(&seen).push(outcome);
            }
        });
    }
    tasks.close();
    tasks.wait().await;
    let seen = std::mem::take(&mut *lock(&seen));
    EngineRow::new(&seen)
}
