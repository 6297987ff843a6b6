//! A healthy real fleet: answers pass whole and unchanged, the engines' own metrics are read, and
//! steady streaming load costs no cut, no continuation and no ejection, though a real server pauses.

use std::time::Duration;

use serde_json::Value;

use crate::client::{self, Api, Ask};
use crate::{all_healthy, fleet, support, tongs_for};

const LIMIT: Duration = Duration::from_secs(180);

/// Checks `got` is the whole uninterrupted answer `want`, saying which request it was.
pub fn assert_exact(what: &str, got: &client::Streamed, want: &(String, Vec<u32>), ask: &Ask) {
    assert!(
        got.whole(),
        "{what}: not a whole answer (status {}, done {}, error {:?}, finish {:?})",
        got.status,
        got.done,
        got.error,
        got.finish
    );
    assert_eq!(
        got.text, want.0,
        "{what}: the text differs from the greedy answer"
    );
    if ask.ids {
        assert_eq!(got.ids, want.1, "{what}: the token ids differ");
    } else {
        assert_eq!(
            got.chunks_with_ids, 0,
            "{what}: token ids the client did not ask for reached it"
        );
        for chunk in &got.chunks {
            assert!(
                chunk["prompt_token_ids"].is_null(),
                "{what}: prompt ids the client did not ask for: {chunk}"
            );
        }
    }
    if ask.usage {
        let usage = got.usage.as_ref().expect("usage asked and given");
        assert_eq!(
            usage["completion_tokens"],
            Value::from(want.1.len()),
            "{what}: usage counts {usage}, the answer has {} tokens",
            want.1.len()
        );
    }
    let first = &got.chunk_ids[0];
    assert!(
        got.chunk_ids.iter().all(|id| id == first),
        "{what}: chunks of several ids reached the client"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_chats_and_completions_pass_whole_and_unchanged() {
    let guard = fleet::fleet().await;
    let ports = guard.as_ref().unwrap().ports.clone();
    let proxy = tongs_for(&ports, "").await;
    all_healthy(&proxy, &ports).await;
    let base = format!("http://{}", proxy.addr);
    for (n, api) in [Api::Chat, Api::Completions, Api::Chat, Api::Completions]
        .into_iter()
        .enumerate()
    {
        let mut ask = Ask::new(api, format!("The story of the number {n} begins"), 120);
        ask.ids = n >= 2;
        let want = client::reference(&fleet::url(ports[n % ports.len()]), &ask).await;
        let got = client::stream(&base, &ask, LIMIT).await;
        assert_exact(&format!("{api:?} #{n}"), &got, &want, &ask);
    }
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engines_own_metrics_are_read_from_the_real_page() {
    let guard = fleet::fleet().await;
    let ports = guard.as_ref().unwrap().ports.clone();
    let proxy = tongs_for(&ports, "").await;
    all_healthy(&proxy, &ports).await;
    // Streams running on every node, so the page says something.
    let base = format!("http://{}", proxy.addr);
    let streams: Vec<_> = (0..6)
        .map(|n| {
            let base = base.clone();
            tokio::spawn(async move {
                let ask = Ask::new(Api::Chat, format!("metrics {n}"), 400);
                client::stream(&base, &ask, LIMIT).await
            })
        })
        .collect();
    let mut seen_running = false;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !seen_running && tokio::time::Instant::now() < deadline {
        for &port in &ports {
            let view = support::endpoint_view(&proxy, &fleet::url(port)).await;
            let signals = &view["signals"];
            if signals["status"] == "read" && signals["engine"] == "vllm" {
                seen_running |= signals["in_node"].as_u64().unwrap_or(0) > 0;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for stream in streams {
        assert!(stream.await.unwrap().whole());
    }
    assert!(
        seen_running,
        "no node's real /metrics was read as running a request while six streamed"
    );
    // The real page also has vllm:num_requests_waiting_by_reason, which starts like the waiting
    // gauge's name: read apart, a quiet node has none waiting.
    let (_, page) = client::get_text(&format!("{}/metrics", fleet::url(ports[0]))).await;
    assert!(
        page.contains("vllm:num_requests_running{"),
        "the real page names its gauges as tongs reads them:\n{}",
        &page[..page.len().min(2000)]
    );
    let load = tongs::engine::read_load(tongs::engine::Engine::Vllm, &page).expect("a reading");
    assert_eq!((load.running, load.waiting), (0, 0), "a quiet node");
    proxy.stop().await;
}

/// How long the healthy stretch runs (`TONGS_VLLM_HEALTHY_SECS`; 60 s by default, 300 s is the aim's
/// own stretch, run by the benchmark).
fn stretch() -> Duration {
    let secs = std::env::var("TONGS_VLLM_HEALTHY_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    Duration::from_secs(secs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healthy_fleet_under_steady_streaming_load_is_never_cut() {
    let guard = fleet::fleet().await;
    let ports = guard.as_ref().unwrap().ports.clone();
    let proxy = tongs_for(&ports, "").await;
    all_healthy(&proxy, &ports).await;
    let base = format!("http://{}", proxy.addr);
    let until = tokio::time::Instant::now() + stretch();
    // Nine clients, each streaming one answer after another: three a node, a busy 2-core machine.
    let clients: Vec<_> = (0..9)
        .map(|c| {
            let base = base.clone();
            tokio::spawn(async move {
                let mut results = Vec::new();
                let mut n = 0;
                while tokio::time::Instant::now() < until {
                    let api = if (c + n) % 2 == 0 {
                        Api::Chat
                    } else {
                        Api::Completions
                    };
                    let ask = Ask::new(api, format!("client {c} asks {n}"), 200);
                    results.push((ask.clone(), client::stream(&base, &ask, LIMIT).await));
                    n += 1;
                }
                results
            })
        })
        .collect();
    let mut all = Vec::new();
    for c in clients {
        all.extend(c.await.unwrap());
    }
    let cuts = support::sample(&proxy, "tongs_streams_cut_total").await;
    let continued =
        support::sample(&proxy, "tongs_continuations_total{outcome=\"continued\"}").await;
    let mut ejections = 0;
    for &port in &ports {
        let view = support::endpoint_view(&proxy, &fleet::url(port)).await;
        ejections += view["counts"]["ejections"].as_u64().unwrap_or(0);
    }
    let longest = all
        .iter()
        .map(|(_, s)| s.longest_pause)
        .max()
        .unwrap_or_default();
    eprintln!(
        "healthy stretch: {} streams, {cuts} cut, {continued} continued, {ejections} ejections, \
         longest pause {longest:?}",
        all.len()
    );
    let broken: Vec<_> = all.iter().filter(|(_, s)| !s.whole()).collect();
    assert!(
        broken.is_empty(),
        "streams not whole: {:?}",
        broken
            .iter()
            .map(|(a, s)| (&a.prompt, &s.error))
            .collect::<Vec<_>>()
    );
    assert_eq!(
        (cuts, continued, ejections),
        (0.0, 0.0, 0),
        "a healthy real fleet was taken for a broken one ({} streams)",
        all.len()
    );
    // And every answer is the one a node gives alone (greedy answers do not depend on the batch).
    let reference = fleet::url(ports[0]);
    for (ask, got) in all.iter().take(12) {
        let want = client::reference(&reference, ask).await;
        assert_exact(&ask.prompt, got, &want, ask);
    }
    proxy.stop().await;
}
