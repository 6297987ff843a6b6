//! Heartbeats: one probe loop per endpoint, through the endpoint's own transport (plain or TLS).
//!
//! Each loop sends `GET <health.path>` every `health.interval` (jittered, so a large fleet is not probed in
//! lock-step); a probe passes on any 2xx within `health.timeout`. `unhealthy_threshold` failures in a row
//! mark the endpoint unhealthy — which takes it out of the pick and fails its waiting requests over to
//! other endpoints at once — and `healthy_threshold` passes bring it back (with slow start). While a
//! verdict is pending the loop probes every `health.fast_interval` instead (HAProxy's `fastinter`), so a
//! silent node is found in about interval + 2 × timeout rather than interval × threshold. A passing probe
//! also stands in for the breaker's half-open probe. A new endpoint is probed at once, and its second
//! heartbeat comes at a random point of the interval after that (see [`spread`]), so a fleet discovered
//! in one go is not probed in step afterwards.
//!
//! Every `health.models_interval` a passing heartbeat is followed by `GET /v1/models`, and the ids the
//! node lists are kept on the endpoint for tongs' own `/v1/models` (a failed read keeps the last ones).
//!
//! The loops follow the registry: new endpoints get a loop, removed ones lose theirs. Each loop runs on
//! a worker's thread and sends through that worker's own pool ([`Senders`]). Beside each, [`signals`]
//! reads the node's own metrics (its queue, its KV cache) the same way.

pub mod signals;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use arc_swap::ArcSwap;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Uri, header};
use http_body_util::{BodyExt, Full};
use tokio::runtime::Handle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::HealthConfig;
use crate::endpoint::{Announcer, Endpoint};
use crate::registry::Registry;
use crate::upstream::{UpstreamBody, UpstreamClient};

/// Where heartbeat loops run and send: on the workers, through their own connection pools.
///
/// Each endpoint is dealt to a worker in turn; its loop runs on that worker's runtime and sends
/// through that worker's pool, so the connection a heartbeat keeps alive is one the worker's requests
/// reuse. An idle endpoint then costs one connection, and one under traffic a connection per worker
/// rather than one more for heartbeats; to a SaladCloud gateway that is one TLS session fewer, and the
/// first request after a node joins finds a connection already open. The whole loop runs there, not
/// only the send: a loop here handing each heartbeat to a worker cost two cross-thread wake-ups per
/// heartbeat (46 % more CPU per heartbeat, `cargo bench --bench scale`). Without workers (none
/// started) the loops run on the caller's runtime with `own`, a client of its own. A worker that has
/// drained at shutdown takes its loops with it.
#[derive(Clone)]
pub struct Senders {
    workers: Arc<[(Handle, Arc<UpstreamClient>)]>,
    own: Arc<UpstreamClient>,
    next: Arc<AtomicUsize>,
}

impl Senders {
    pub fn new(own: UpstreamClient, workers: Vec<(Handle, Arc<UpstreamClient>)>) -> Senders {
        Senders {
            workers: workers.into(),
            own: Arc::new(own),
            next: Arc::default(),
        }
    }

    /// Starts `endpoint`'s heartbeat loop on the next worker.
    fn start(
        &self,
        endpoint: Arc<Endpoint>,
        settings: Arc<ArcSwap<HealthConfig>>,
        stop: CancellationToken,
    ) {
        self.spawn(move |client| probe_loop(endpoint, settings, client, stop));
    }

    /// Runs the loop `make` builds on the next worker, sending through that worker's pool (or, without
    /// workers, on the caller's runtime with a client of its own). Other per-endpoint loops (the model
    /// servers' metrics, `signals`) run beside the heartbeats this way, on the same connections.
    pub fn spawn<F, L>(&self, make: F)
    where
        F: FnOnce(Arc<UpstreamClient>) -> L,
        L: Future<Output = ()> + Send + 'static,
    {
        match self.workers.len() {
            0 => {
                tokio::spawn(make(Arc::clone(&self.own)));
            }
            count => {
                let at = self.next.fetch_add(1, Ordering::Relaxed) % count;
                let (runtime, client) = &self.workers[at];
                runtime.spawn(make(Arc::clone(client)));
            }
        }
    }
}

/// Runs the heartbeat loops of every endpoint in the registry until `shutdown`.
pub async fn run(
    registry: Arc<Registry>,
    config: Arc<ArcSwap<HealthConfig>>,
    senders: Senders,
    shutdown: CancellationToken,
) {
    // Switching heartbeats on or off takes a restart (a reload says so); the rest applies live.
    if !config.load().enabled {
        return;
    }
    follow(&registry, &shutdown, |endpoint, stop| {
        senders.start(Arc::clone(endpoint), Arc::clone(&config), stop);
    })
    .await;
}

/// Follows the registry until `shutdown`: `start` is called once for each endpoint that joins, with a
/// token cancelled when it leaves (or at shutdown), for a loop of its own.
pub async fn follow(
    registry: &Registry,
    shutdown: &CancellationToken,
    mut start: impl FnMut(&Arc<Endpoint>, CancellationToken),
) {
    let mut changes = registry.subscribe();
    // Endpoints by address. Every endpoint of `known` has a loop, which holds it, so no other
    // endpoint can have its address while it is known.
    let mut loops: HashMap<usize, CancellationToken> = HashMap::new();
    // The endpoints of the snapshot last followed, in its order. Addresses rather than the snapshot
    // itself: holding it would keep the registry from reusing it for the next one.
    let mut known: Vec<usize> = Vec::new();
    loop {
        let snapshot = registry.snapshot_full();
        let (left, joined) = difference(&known, &snapshot);
        for address in left {
            if let Some(stop) = loops.remove(&address) {
                stop.cancel();
            }
        }
        for endpoint in joined {
            if loops.contains_key(&address(endpoint)) {
                continue;
            }
            let stop = shutdown.child_token();
            loops.insert(address(endpoint), stop.clone());
            start(endpoint, stop);
        }
        known = snapshot.iter().map(address).collect();
        drop(snapshot);
        tokio::select! {
            () = shutdown.cancelled() => return,
            changed = changes.changed() => if changed.is_err() { return },
        }
    }
}

/// Who an endpoint is, for as long as it lives.
fn address(endpoint: &Arc<Endpoint>) -> usize {
    Arc::as_ptr(endpoint).addr()
}

/// The endpoints that left between two snapshots of one registry (by address) and those that
/// joined. The registry changes a snapshot in place, so only the places whose endpoint differs are
/// looked at: a pod event among thousands costs a comparison of addresses per endpoint, without
/// reading the endpoints themselves. One that moved into another's place is on both sides and counts
/// as neither.
fn difference<'a>(
    before: &[usize],
    after: &'a [Arc<Endpoint>],
) -> (Vec<usize>, Vec<&'a Arc<Endpoint>>) {
    let (mut left, mut joined) = (Vec::new(), Vec::new());
    for at in 0..before.len().max(after.len()) {
        match (before.get(at), after.get(at)) {
            (Some(was), Some(is)) if *was == address(is) => {}
            (was, is) => {
                left.extend(was);
                joined.extend(is);
            }
        }
    }
    let joined_at: HashSet<usize> = joined.iter().map(|e| address(e)).collect();
    let left_at: HashSet<usize> = left.iter().copied().collect();
    left.retain(|at| !joined_at.contains(at));
    joined.retain(|e| !left_at.contains(&address(e)));
    (left, joined)
}

/// `base` lengthened or shortened at random by up to `jitter` of itself.
pub(crate) fn jittered(base: Duration, jitter: f64) -> Duration {
    base.mul_f64(1.0 + jitter * (2.0 * fastrand::f64() - 1.0))
}

/// The first regular wait of a loop: uniform over a whole `interval`, ending where the longest
/// jittered wait ends (`1 + jitter` intervals), so no gap between heartbeats is ever longer than usual.
///
/// Endpoints that appear together (the static list at start, a pod list, a restart) are all probed
/// within `jitter × interval`; with only ±`jitter` per round after that, their phases drift apart
/// slowly, as a random walk, so they stay in step: with 10,000 endpoints the busiest 100 ms of the
/// first 20 s held 3× the mean (`cargo bench --bench scale`). One wait spread over a whole interval
/// puts each endpoint at an independent, uniform phase from the second heartbeat on.
fn spread(interval: Duration, jitter: f64) -> Duration {
    interval.mul_f64(1.0 + jitter - fastrand::f64())
}

/// Consecutive outcomes of one endpoint's heartbeats, and what they conclude.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Streak {
    passes: u32,
    failures: u32,
}

/// A change of verdict a heartbeat brought.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthVerdict {
    Healthy,
    Unhealthy,
}

impl Streak {
    /// Records one heartbeat of an endpoint currently `healthy`; returns a new verdict when thresholds
    /// are crossed.
    pub fn record(
        &mut self,
        passed: bool,
        healthy: bool,
        config: &HealthConfig,
    ) -> Option<HealthVerdict> {
        if passed {
            self.failures = 0;
            self.passes = self.passes.saturating_add(1);
            (!healthy && self.passes >= config.healthy_threshold).then_some(HealthVerdict::Healthy)
        } else {
            self.passes = 0;
            self.failures = self.failures.saturating_add(1);
            (healthy && self.failures >= config.unhealthy_threshold)
                .then_some(HealthVerdict::Unhealthy)
        }
    }

    /// Whether a verdict is pending (the next heartbeat should come sooner).
    pub fn changing(&self, healthy: bool) -> bool {
        (healthy && self.failures > 0) || (!healthy && self.passes > 0)
    }
}

async fn probe_loop(
    endpoint: Arc<Endpoint>,
    settings: Arc<ArcSwap<HealthConfig>>,
    client: Arc<UpstreamClient>,
    stop: CancellationToken,
) {
    // "At once", spread a little so a fleet discovered in one go is not probed in one burst.
    let first = {
        let config = settings.load();
        config
            .interval
            .get()
            .mul_f64(config.jitter * fastrand::f64())
    };
    tokio::select! {
        () = stop.cancelled() => return,
        () = tokio::time::sleep(first) => {}
    }
    let mut streak = Streak::default();
    let mut first_regular_wait = true;
    let mut models_read: Option<Instant> = None;
    loop {
        // Each round reads the settings in force, so a reload applies from the next heartbeat.
        let config = settings.load_full();
        let started = Instant::now();
        let beat = probe(&endpoint, &config, &client).await;
        let passed = beat.passed;
        let now = Instant::now();
        if beat.answered {
            endpoint.set_announced(Announcer::Heartbeat, beat.notice, now);
        }
        let every = config.models_interval.get();
        if passed
            && !every.is_zero()
            && models_read.is_none_or(|at| now.saturating_duration_since(at) >= every)
        {
            models_read = Some(now);
            // Apart from the loop, so a slow answer delays no heartbeat.
            let (endpoint, config, client) = (
                Arc::clone(&endpoint),
                Arc::clone(&config),
                Arc::clone(&client),
            );
            tokio::spawn(async move {
                if let Some(ids) = served_models(&endpoint, &config, &client).await {
                    endpoint.served_models().set(ids);
                }
            });
        }
        endpoint
            .heartbeat()
            .record(passed, now.saturating_duration_since(started), now);
        if passed {
            endpoint.breaker().heartbeat_passed(now);
        }
        let verdict = streak.record(passed, endpoint.liveness().is_healthy(), &config);
        endpoint.set_suspect(!passed && endpoint.liveness().is_healthy() && verdict.is_none());
        match verdict {
            Some(HealthVerdict::Healthy) => {
                endpoint.set_healthy(true, now);
            }
            Some(HealthVerdict::Unhealthy) => {
                endpoint.set_healthy(false, now);
            }
            None => {}
        }
        let wait = if streak.changing(endpoint.liveness().is_healthy()) {
            config.fast_interval.get()
        } else if std::mem::take(&mut first_regular_wait) {
            spread(config.interval.get(), config.jitter)
        } else {
            jittered(config.interval.get(), config.jitter)
        };
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(wait) => {}
        }
    }
}

/// The ids the endpoint's `GET /v1/models` lists (OpenAI's `{"data": [{"id": ...}]}`), within the
/// heartbeat's timeout and 1 MiB; `None` when it would not say.
async fn served_models(
    endpoint: &Endpoint,
    config: &HealthConfig,
    client: &UpstreamClient,
) -> Option<Vec<String>> {
    #[derive(serde::Deserialize)]
    struct List {
        data: Vec<Entry>,
    }
    #[derive(serde::Deserialize)]
    struct Entry {
        id: String,
    }
    let request = request_to(endpoint, "/v1/models", Bytes::new())?;
    let exchange = async {
        let response = client.request(request).await.ok()?;
        if !response.status().is_success() {
            return None;
        }
        let body = http_body_util::Limited::new(response.into_body(), 1 << 20)
            .collect()
            .await
            .ok()?
            .to_bytes();
        let list: List = serde_json::from_slice(&body).ok()?;
        Some(list.data.into_iter().map(|entry| entry.id).collect())
    };
    tokio::time::timeout(config.timeout.get(), exchange)
        .await
        .ok()
        .flatten()
}

/// What one heartbeat found.
struct Beat {
    /// The endpoint answered within the timeout with a passing status (any 2xx, or the deep heartbeat's
    /// `expected_status`), or with a drain notice: a node that says it is going is not failing.
    passed: bool,
    /// An answer came (in time): what it says of draining replaces what the node last said.
    answered: bool,
    /// The answer's drain notice, if it had one (see [`tongs_wire::header::drain_notice`]).
    notice: Option<Option<Duration>>,
}

/// One heartbeat.
async fn probe(endpoint: &Endpoint, config: &HealthConfig, client: &UpstreamClient) -> Beat {
    let silent = Beat {
        passed: false,
        answered: false,
        notice: None,
    };
    let Some(request) = heartbeat_request(endpoint, config) else {
        return silent;
    };
    let expected = config.request.as_ref().and_then(|r| r.expected_status);
    let exchange = async {
        let response = client.request(request).await.ok()?;
        let status = response.status();
        let notice = tongs_wire::header::drain_notice(response.headers());
        let passed = match expected {
            Some(expected) => status.as_u16() == expected,
            None => status.is_success(),
        };
        // Read the (small) body so the connection can be reused for the next heartbeat.
        response.into_body().collect().await.ok()?;
        Some(Beat {
            passed: passed || notice.is_some(),
            answered: true,
            notice,
        })
    };
    tokio::time::timeout(config.timeout.get(), exchange)
        .await
        .ok()
        .flatten()
        .unwrap_or(silent)
}

/// The heartbeat request for `endpoint`: `GET health.path`, or the deep heartbeat `health.request`.
/// `None` only for a configuration built in code that validation would have refused.
fn heartbeat_request(endpoint: &Endpoint, config: &HealthConfig) -> Option<Request<UpstreamBody>> {
    let deep = config.request.as_ref();
    let path = deep.map_or(config.path.as_str(), |r| r.path.as_str());
    let content = deep.map_or_else(Bytes::new, |r| Bytes::from(r.body.clone()));
    let mut request = request_to(endpoint, path, content)?;
    if let Some(deep) = deep {
        *request.method_mut() = http::Method::from_bytes(deep.method.as_bytes()).ok()?;
        for (name, value) in &deep.headers {
            request.headers_mut().insert(
                header::HeaderName::from_bytes(name.as_bytes()).ok()?,
                header::HeaderValue::from_str(value).ok()?,
            );
        }
    }
    Some(request)
}

/// A GET of `path` (under the endpoint's path prefix) with `content`, as heartbeats send it: the
/// endpoint's own `Host`, tongs' heartbeat user agent.
pub(crate) fn request_to(
    endpoint: &Endpoint,
    path: &str,
    content: Bytes,
) -> Option<Request<UpstreamBody>> {
    let uri = Uri::builder()
        .scheme(endpoint.address().scheme().clone())
        .authority(endpoint.address().authority().clone())
        .path_and_query(format!("{}{}", endpoint.address().path_prefix(), path))
        .build()
        .ok()?;
    let body: UpstreamBody = Full::new(content)
        .map_err(|never| match never {})
        .boxed_unsync();
    let mut request = Request::new(body);
    *request.uri_mut() = uri;
    request
        .headers_mut()
        .insert(header::HOST, endpoint.address().host_header().clone());
    request.headers_mut().insert(
        header::USER_AGENT,
        header::HeaderValue::from_static("tongs-heartbeat"),
    );
    Some(request)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_difference_of_two_snapshots_is_who_left_and_who_joined() {
        let registry = Registry::default();
        let spec = |url: &str| {
            crate::registry::EndpointSpec::new(
                url,
                crate::config::EndpointUrl::parse(url).unwrap(),
                1,
            )
        };
        let urls: Vec<String> = (0..6).map(|i| format!("http://10.0.0.{i}:80")).collect();
        registry.replace(urls.iter().map(|url| spec(url)).collect());
        let before = registry.snapshot_full();
        let addresses =
            |snapshot: &[Arc<Endpoint>]| snapshot.iter().map(address).collect::<Vec<_>>();
        let (left, joined) = difference(&[], &before);
        assert!(left.is_empty());
        assert_eq!(joined.len(), 6);
        // One leaves from the middle (the last takes its place), one joins at the end.
        registry.update_source(
            "static",
            &[urls[1].clone()],
            vec![spec("http://10.0.0.9:80")],
        );
        let after = registry.snapshot_full();
        let (left, joined) = difference(&addresses(&before), &after);
        assert_eq!(left, [address(&before[1])]);
        let joined: Vec<&str> = joined.iter().map(|e| e.url()).collect();
        assert_eq!(joined, ["http://10.0.0.9:80"]);
        // The same endpoints in another order: nothing changed.
        let reversed: Vec<_> = after.iter().rev().cloned().collect();
        let (left, joined) = difference(&addresses(&after), &reversed);
        assert!(left.is_empty() && joined.is_empty());
        assert_eq!(difference(&addresses(&after), &[]).0.len(), 6);
    }

    #[test]
    fn thresholds_decide_the_verdict() {
        let config = HealthConfig::default(); // 2 and 2
        let mut streak = Streak::default();
        assert_eq!(streak.record(false, true, &config), None);
        assert!(streak.changing(true), "one failure: probe again soon");
        assert_eq!(
            streak.record(true, true, &config),
            None,
            "a pass resets the failures"
        );
        assert!(!streak.changing(true));
        assert_eq!(streak.record(false, true, &config), None);
        assert_eq!(
            streak.record(false, true, &config),
            Some(HealthVerdict::Unhealthy)
        );
        assert_eq!(
            streak.record(false, false, &config),
            None,
            "already unhealthy"
        );
        assert!(!streak.changing(false));
        assert_eq!(streak.record(true, false, &config), None);
        assert!(streak.changing(false));
        assert_eq!(
            streak.record(true, false, &config),
            Some(HealthVerdict::Healthy)
        );
    }

    #[test]
    fn the_first_wait_spreads_over_a_whole_interval() {
        let interval = Duration::from_secs(2);
        let samples: Vec<Duration> = (0..1000).map(|_| spread(interval, 0.1)).collect();
        assert!(
            samples
                .iter()
                .all(|d| *d >= Duration::from_millis(200) && *d <= Duration::from_millis(2200))
        );
        // Every quarter of the interval gets its share, so phases end up uniform, not bunched.
        for quarter in 0..4 {
            let from = Duration::from_millis(200 + 500 * quarter);
            let to = from + Duration::from_millis(500);
            let hits = samples.iter().filter(|d| **d >= from && **d < to).count();
            assert!((150..=350).contains(&hits), "quarter {quarter}: {hits}");
        }
    }

    #[test]
    fn jitter_stays_within_bounds_and_varies() {
        let base = Duration::from_secs(2);
        let samples: Vec<Duration> = (0..200).map(|_| jittered(base, 0.1)).collect();
        assert!(
            samples
                .iter()
                .all(|d| *d >= Duration::from_millis(1800) && *d <= Duration::from_millis(2200))
        );
        assert!(samples.iter().any(|d| *d < Duration::from_millis(1950)));
        assert!(samples.iter().any(|d| *d > Duration::from_millis(2050)));
    }
}
