//! A real server that dies (`kill -9`: its port still accepts and its connections stay open and silent
//! for a second or more while it tears down) and one whose engine wedges (SIGSTOP of its engine core
//! and worker: `/health` still answers, `/metrics` freezes, a new stream gets its headers and no
//! byte). Every stream on them reaches its client whole, token for token the answer it would have had.

use std::time::Duration;

use crate::client::{self, Api, Ask, Streamed};
use crate::healthy::assert_exact;
use crate::{all_healthy, fleet, support, tongs_for};

const LIMIT: Duration = Duration::from_secs(240);

/// Starts `n` long streams through `base`, alternating the APIs, the odd ones asking for ids.
fn long_streams(base: &str, n: usize, tag: &str) -> Vec<(Ask, tokio::task::JoinHandle<Streamed>)> {
    (0..n)
        .map(|i| {
            let api = if i % 2 == 0 {
                Api::Chat
            } else {
                Api::Completions
            };
            let mut ask = Ask::new(api, format!("{tag} number {i} of the long answers"), 600);
            ask.ids = i % 4 == 1;
            let (base, asked) = (base.to_owned(), ask.clone());
            (
                ask,
                tokio::spawn(async move { client::stream(&base, &asked, LIMIT).await }),
            )
        })
        .collect()
}

/// The port whose endpoint holds the most of tongs' requests, once every node holds one.
async fn busiest(proxy: &support::TestProxy, ports: &[u16]) -> u16 {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let mut best = (0, ports[0]);
        let mut everywhere = true;
        for &port in ports {
            let held = support::endpoint_view(proxy, &fleet::url(port)).await["outstanding"]
                .as_u64()
                .unwrap_or(0);
            everywhere &= held > 0;
            if held > best.0 {
                best = (held, port);
            }
        }
        if everywhere {
            return best.1;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no stream on every node within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the streams have sent some tokens (a fault mid-way, not before the first token).
async fn some_tokens_out() {
    tokio::time::sleep(Duration::from_secs(2)).await;
}

async fn check_all(streams: Vec<(Ask, tokio::task::JoinHandle<Streamed>)>, reference: &str) {
    let mut longest = Duration::ZERO;
    for (n, (ask, stream)) in streams.into_iter().enumerate() {
        let got = stream.await.unwrap();
        longest = longest.max(got.longest_pause);
        let want = client::reference(reference, &ask).await;
        assert_exact(&format!("stream {n} ({:?})", ask.api), &got, &want, &ask);
    }
    eprintln!("longest pause a client saw: {longest:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_mid_stream_has_its_streams_continued_token_exact() {
    let guard = fleet::fleet().await;
    let ports = guard.as_ref().unwrap().ports.clone();
    let proxy = tongs_for(&ports, "").await;
    all_healthy(&proxy, &ports).await;
    let base = format!("http://{}", proxy.addr);
    let streams = long_streams(&base, 9, "killed");
    let victim = busiest(&proxy, &ports).await;
    some_tokens_out().await;
    fleet::vllm_sh_async(vec!["kill9".into(), victim.to_string()]).await;
    let reference = fleet::url(*ports.iter().find(|&&p| p != victim).unwrap());
    check_all(streams, &reference).await;
    let continued =
        support::sample(&proxy, "tongs_continuations_total{outcome=\"continued\"}").await;
    let by_text = support::sample(&proxy, "tongs_continuations_by_text_total").await;
    assert!(continued >= 1.0, "the killed node's streams were continued");
    assert_eq!(by_text, 0.0, "every continuation was by token ids");
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wedged_engine_has_its_streams_moved_and_takes_no_new_one() {
    let guard = fleet::fleet().await;
    let ports = guard.as_ref().unwrap().ports.clone();
    let proxy = tongs_for(&ports, "").await;
    all_healthy(&proxy, &ports).await;
    let base = format!("http://{}", proxy.addr);
    let streams = long_streams(&base, 9, "wedged");
    let victim = busiest(&proxy, &ports).await;
    some_tokens_out().await;
    fleet::vllm_sh_async(vec!["wedge".into(), victim.to_string()]).await;
    let reference = fleet::url(*ports.iter().find(|&&p| p != victim).unwrap());
    check_all(streams, &reference).await;
    // New streams while it is still wedged: none waits on it.
    let later = long_streams(&base, 4, "after the wedge");
    check_all(later, &reference).await;
    let view = support::endpoint_view(&proxy, &fleet::url(victim)).await;
    assert!(
        !view["signals"]["fresh"].as_bool().unwrap_or(true),
        "a wedged engine's frozen metrics are not fresh: {}",
        view["signals"]
    );
    fleet::vllm_sh_async(vec!["unwedge".into(), victim.to_string()]).await;
    // Back at low traffic: served again within a few heartbeats, without a burst to probe it.
    let url = fleet::url(victim);
    support::eventually_async(
        "the unwedged node in service again",
        Duration::from_secs(30),
        || async {
            let view = support::endpoint_view(&proxy, &url).await;
            view["state"] == "healthy" && view["breaker"] == "closed"
        },
    )
    .await;
    proxy.stop().await;
}
