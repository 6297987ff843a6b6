//! Reading each model server's own load from its Prometheus metrics (`signals.*`): a loop per
//! endpoint, beside its heartbeats on the same worker and through the same connections (see
//! [`health::Senders`]), so a node behind a SaladCloud gateway or tailscaled's proxy is read through
//! the same transport its requests take, and reading it opens no connection of its own.
//!
//! Each loop reads `GET <signals.path>` every `signals.interval` (jittered), bounded by
//! `signals.timeout` and 4 MiB, and keeps the reading on the endpoint ([`EngineSignals`]). The metric
//! names are those of the endpoint's engine (its pod's or entry's, else `signals.engine`). A node that
//! answers 404, or whose page lacks the metrics, has none: it is asked again only after
//! `signals.absent_retry`. A failed read keeps the last reading, which ages out after
//! `signals.max_age`. A reading that finds a saturated node has room again wakes the pool's queue.
//!
//! Switching signals off on a reload forgets every reading at the loops' next round.

use std::sync::Arc;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{StatusCode, header};
use http_body_util::BodyExt;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{self as health, Senders};
use crate::config::SignalsConfig;
use crate::endpoint::{Endpoint, EngineSignals, ReadStatus, millis};
use crate::engine::{self, Engine, EngineLoad, NoReading};
use crate::registry::Registry;
use crate::upstream::UpstreamClient;

/// Largest metrics page read (vLLM's is tens of kilobytes).
const PAGE_MAX: usize = 4 << 20;

/// Runs the reading loops of every endpoint in the registry until `shutdown`.
pub async fn run(
    registry: Arc<Registry>,
    config: Arc<ArcSwap<SignalsConfig>>,
    senders: Senders,
    shutdown: CancellationToken,
) {
    health::follow(&registry, &shutdown, |endpoint, stop| {
        let (endpoint, config) = (Arc::clone(endpoint), Arc::clone(&config));
        senders.spawn(move |client| read_loop(endpoint, config, client, stop));
    })
    .await;
}

/// Why a read gave no reading.
#[derive(Debug)]
enum Unread {
    /// The node has no such metrics: asked again rarely.
    Absent(String),
    /// The read failed this time.
    Failed(String),
}

async fn read_loop(
    endpoint: Arc<Endpoint>,
    settings: Arc<ArcSwap<SignalsConfig>>,
    client: Arc<UpstreamClient>,
    stop: CancellationToken,
) {
    // The first read at a random point of the first interval, so a fleet found at once is not read in
    // one burst.
    let first = settings.load().interval.get().mul_f64(fastrand::f64());
    tokio::select! {
        () = stop.cancelled() => return,
        () = tokio::time::sleep(first) => {}
    }
    loop {
        let config = settings.load_full();
        let wait = if config.enabled {
            let engine = endpoint.origin().engine.unwrap_or(config.engine);
            match read(&endpoint, &config, &client, engine).await {
                Ok(load) => {
                    let now_ms = millis(Instant::now());
                    keep(&endpoint, &config, engine, load, now_ms);
                    health::jittered(config.interval.get(), 0.1)
                }
                Err(Unread::Absent(why)) => {
                    tracing::debug!(endpoint = endpoint.url(), why, "no model server metrics");
                    endpoint.signals().forget();
                    endpoint.signals().set_status(ReadStatus::Absent(why));
                    config.absent_retry.get()
                }
                Err(Unread::Failed(why)) => {
                    endpoint.signals().set_status(ReadStatus::Failed(why));
                    health::jittered(config.interval.get(), 0.1)
                }
            }
        } else {
            endpoint.signals().forget();
            endpoint.signals().set_status(ReadStatus::Unread);
            config.interval.get()
        };
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(wait) => {}
        }
    }
}

/// Keeps `load` on the endpoint; wakes the queue when the node had no room by its last reading and
/// has some by this one.
fn keep(
    endpoint: &Endpoint,
    config: &SignalsConfig,
    engine: Engine,
    load: EngineLoad,
    now_ms: u64,
) {
    let signals = endpoint.signals();
    let max_age = u64::try_from(config.max_age.get().as_millis()).unwrap_or(u64::MAX);
    let outstanding = endpoint.outstanding();
    let was = saturated(signals, config, now_ms, max_age, outstanding);
    signals.record(engine, load, outstanding, now_ms);
    endpoint.note_reading(now_ms);
    let is = saturated(signals, config, now_ms, max_age, outstanding);
    if is {
        endpoint.note_full(now_ms);
    } else if was {
        endpoint.wake_waiters();
    }
}

fn saturated(
    signals: &EngineSignals,
    config: &SignalsConfig,
    now_ms: u64,
    max_age_ms: u64,
    outstanding: u64,
) -> bool {
    signals
        .now(now_ms, max_age_ms, outstanding)
        .is_some_and(|now| crate::balance::Saturation::from_config(&config.saturation).holds(&now))
}

/// One read of the endpoint's metrics page.
async fn read(
    endpoint: &Endpoint,
    config: &SignalsConfig,
    client: &UpstreamClient,
    engine: Engine,
) -> Result<EngineLoad, Unread> {
    let Some(mut request) = health::request_to(endpoint, &config.path, Bytes::new()) else {
        return Err(Unread::Absent(format!("{} is no path here", config.path)));
    };
    request.headers_mut().insert(
        header::USER_AGENT,
        header::HeaderValue::from_static("tongs-signals"),
    );
    request.headers_mut().insert(
        header::ACCEPT,
        header::HeaderValue::from_static("text/plain"),
    );
    let exchange = async {
        let response = client
            .request(request)
            .await
            .map_err(|error| Unread::Failed(error.to_string()))?;
        let status = response.status();
        if matches!(
            status,
            StatusCode::NOT_FOUND | StatusCode::METHOD_NOT_ALLOWED | StatusCode::NOT_IMPLEMENTED
        ) {
            return Err(Unread::Absent(format!("{} answered {status}", config.path)));
        }
        if !status.is_success() {
            return Err(Unread::Failed(format!("{} answered {status}", config.path)));
        }
        let page = http_body_util::Limited::new(response.into_body(), PAGE_MAX)
            .collect()
            .await
            .map_err(|error| Unread::Failed(format!("reading the page: {error}")))?
            .to_bytes();
        Ok(page)
    };
    let page = match tokio::time::timeout(config.timeout.get(), exchange).await {
        Ok(page) => page?,
        Err(_) => {
            return Err(Unread::Failed(format!("no page within {}", config.timeout)));
        }
    };
    let text = String::from_utf8_lossy(&page);
    engine::read_load(engine, &text).map_err(|error| match error {
        NoReading::Missing(_) => Unread::Absent(error.to_string()),
    })
}
