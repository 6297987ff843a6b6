//! Watching a committed stream: its idle limit, from its endpoint's typical gap between chunks, and
//! what a stall or a gone endpoint teaches the endpoint.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use http::HeaderValue;
use tokio::time::Instant;

use super::ProxySettings;
use super::attempt::Probe;
use crate::breaker::BreakerSettings;
use crate::endpoint::{Endpoint, Outstanding};
use crate::http::body::{Cut, GoneSignal, StreamGuard, Watch};
use crate::metrics::ProxyStats;
use crate::registry::Registry;

/// The idle limit a stream gets: `stream.idle_multiplier` × its typical gap between chunks, and at
/// least `stream.idle_min`. The typical gap is the endpoint's, or, before it has streamed anything, the
/// time its answer took to start (a first chunk comes after the prompt is read, so it is no shorter
/// than a gap between tokens).
pub fn idle_limit(settings: &IdleSettings, typical_gap: Option<Duration>) -> Duration {
    typical_gap
        .map_or(Duration::ZERO, |gap| gap.mul_f64(settings.multiplier))
        .max(settings.min)
}

/// `stream.*` as a stream reads it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct IdleSettings {
    pub multiplier: f64,
    pub min: Duration,
}

impl IdleSettings {
    /// A stream's idle settings; one that can be continued elsewhere has the lower floor.
    pub fn from(settings: &ProxySettings, continuable: bool) -> IdleSettings {
        IdleSettings {
            multiplier: settings.stream_idle_multiplier,
            min: if continuable {
                settings.continuation_idle_min
            } else {
                settings.stream_idle_min
            },
        }
    }
}

/// What a committed stream holds: the endpoint's slot, and what it needs to judge a stall.
struct Streamed {
    outstanding: Outstanding,
    registry: Arc<Registry>,
    stats: Arc<ProxyStats>,
    idle: IdleSettings,
    breaker: BreakerSettings,
    max_ejected_percent: u32,
    /// The request's id, so the cut can be matched with what became of the stream.
    request_id: HeaderValue,
    /// The breaker's half-open probe, when this stream is it, and when the stream was committed.
    probe: Option<(Probe, Instant)>,
}

impl Streamed {
    /// A probe that has streamed past its idle limit without stalling has shown the node works.
    fn judge_probe(&mut self, limit: Duration) {
        if let Some((_, since)) = &self.probe
            && since.elapsed() >= limit
            && let Some((probe, _)) = self.probe.take()
        {
            probe.succeeded(Instant::now());
        }
    }
}

impl StreamGuard for Streamed {
    fn chunk(&mut self, gap: Duration) -> Option<Duration> {
        let endpoint = self.outstanding.endpoint();
        endpoint.observe_chunk_gap(gap);
        let limit = idle_limit(&self.idle, endpoint.chunk_gap());
        self.judge_probe(limit);
        Some(limit)
    }

    fn gone(&mut self) -> Option<GoneSignal> {
        Some(gone(
            self.outstanding.endpoint(),
            &self.registry,
            self.probe.is_some(),
        ))
    }

    fn end(&mut self, complete: bool) {
        if let Some((probe, _)) = self.probe.take() {
            if complete {
                probe.succeeded(Instant::now());
            } else {
                probe.failed(&self.breaker, Instant::now());
            }
        }
    }

    fn cut(&mut self, why: Cut) {
        self.stats.streams_cut.fetch_add(1, Ordering::Relaxed);
        let endpoint = self.outstanding.endpoint();
        let request_id = self.request_id.to_str().unwrap_or_default();
        // What becomes of the stream is logged by whoever holds it: continued elsewhere (a streamed
        // OpenAI completion, see `continuation`), or ended as an error the client sees.
        match why {
            Cut::Idle(limit) => {
                tracing::warn!(
                    request_id,
                    endpoint = endpoint.url(),
                    idle_ms = limit.as_millis() as u64,
                    "stream stalled after it started; cut, and counted against the endpoint"
                );
                let may_eject = super::may_eject(&self.registry, self.max_ejected_percent);
                endpoint.record_stream_stall(&self.breaker, Instant::now(), may_eject);
            }
            Cut::Gone => {
                tracing::warn!(
                    request_id,
                    endpoint = endpoint.url(),
                    "endpoint declared gone while a stream ran; stream cut"
                );
            }
        }
    }
}

/// Resolves when `endpoint` is stalled, or declared unhealthy by heartbeats while some other endpoint
/// of `registry` is healthy: when none is, tongs' own network or the health path is more likely broken
/// than every node at once (panic mode), and streams that still flow are left alone. The half-open
/// probe of a stalled endpoint (`probe`) is the one stream that runs there while it is stalled: only
/// heartbeats end it early.
fn gone(endpoint: &Arc<Endpoint>, registry: &Arc<Registry>, probe: bool) -> GoneSignal {
    let mut signal = endpoint.gone_signal();
    let endpoint = Arc::clone(endpoint);
    let registry = Arc::clone(registry);
    Box::pin(async move {
        loop {
            let unhealthy = !endpoint.is_healthy() && registry.counts().healthy() > 0;
            if unhealthy || (endpoint.is_stalled() && !probe) {
                return;
            }
            if signal.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    })
}

/// How the stream of a committed answer on `outstanding`'s endpoint is watched; `first_byte` is how long
/// that answer took to start (none for a failure's own answer); `continuable`, whether a cut would be
/// continued elsewhere; `probe`, the breaker's half-open probe when this answer is it.
pub fn watch(
    settings: &ProxySettings,
    outstanding: Outstanding,
    (first_byte, continuable, probe): (Option<Duration>, bool, Option<Probe>),
    registry: &Arc<Registry>,
    stats: &Arc<ProxyStats>,
    request_id: &HeaderValue,
) -> Watch {
    let endpoint = Arc::clone(outstanding.endpoint());
    let idle = IdleSettings::from(settings, continuable);
    let limit = idle_limit(&idle, endpoint.chunk_gap().or(first_byte));
    Watch {
        guard: Box::new(Streamed {
            outstanding,
            registry: Arc::clone(registry),
            stats: Arc::clone(stats),
            idle,
            breaker: settings.breaker.clone(),
            max_ejected_percent: settings.max_ejected_percent,
            request_id: request_id.clone(),
            probe: probe.map(|probe| (probe, Instant::now())),
        }),
        idle: Some(limit),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_idle_limit_is_a_multiple_of_the_typical_gap_and_never_below_the_floor() {
        let idle = IdleSettings {
            multiplier: 10.0,
            min: Duration::from_secs(2),
        };
        assert_eq!(idle_limit(&idle, None), Duration::from_secs(2));
        assert_eq!(
            idle_limit(&idle, Some(Duration::from_millis(30))),
            Duration::from_secs(2)
        );
        assert_eq!(
            idle_limit(&idle, Some(Duration::from_millis(500))),
            Duration::from_secs(5)
        );
    }
}
