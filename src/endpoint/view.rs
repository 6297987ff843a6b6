//! What an endpoint is doing, as operators see it: /debug/endpoints, metrics and the status page.

use std::time::Duration;

use tokio::time::Instant;

use super::{Endpoint, ReadStatus, millis};
use crate::breaker::State;

/// What an endpoint is doing, for /debug/endpoints, metrics and the status page.
#[derive(Clone, Debug, serde::Serialize)]
pub struct EndpointView {
    pub url: String,
    pub source: &'static str,
    /// `namespace/name` of the pod behind the endpoint (discovered endpoints only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    pub weight: u32,
    /// The one word an operator needs first.
    pub state: EndpointState,
    pub healthy: bool,
    pub suspect: bool,
    pub draining: bool,
    /// Its source no longer lists it: shown only while requests or streams are still on it.
    pub removed: bool,
    pub cooling_down: bool,
    pub slow_start: bool,
    /// `closed`, `open` or `half-open`.
    pub breaker: &'static str,
    pub outstanding: u64,
    /// Concurrency limit (null: none): this replica's share where the limit is fixed.
    pub limit: Option<u64>,
    /// The pod's own cap on concurrent requests (its max-outstanding annotation), for all replicas
    /// together; this replica enforces its share of it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_outstanding: Option<u64>,
    /// What happened here, counted.
    #[serde(flatten)]
    pub counts: TallyView,
    /// How quickly it answers.
    #[serde(flatten)]
    pub timing: TimingView,
    /// Its last heartbeat.
    #[serde(flatten)]
    pub heartbeat: HeartbeatView,
    /// What its own metrics say of its load.
    pub signals: SignalsView,
}

/// What an endpoint's own metrics say of its load, in its view.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SignalsView {
    /// `unread` (not yet, or signals off), `read`, `absent` (the node serves no such metrics) or
    /// `failed` (the last read failed; the reading before it ages out).
    pub status: &'static str,
    /// The engine whose names were read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine: Option<&'static str>,
    /// Why it is absent or failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// Seconds since the last reading (null: none); the pick uses it while this is at most
    /// `signals.max_age`.
    pub age_s: Option<f64>,
    /// The reading is young enough to be used, and not frozen.
    pub fresh: bool,
    /// The engine's work counters did not move between its last two readings while it had requests
    /// (a wedged engine whose page still answers): its reading is not used.
    pub frozen: bool,
    /// tongs' estimate now, from the last reading: requests in the node, running or waiting, and
    /// waiting in its own queue; its batch as learned (0: not seen full yet); its KV cache in use.
    pub in_node: Option<u64>,
    pub waiting: Option<u64>,
    pub batch: Option<u64>,
    pub kv_cache: Option<f64>,
}

impl SignalsView {
    /// What `endpoint`'s own metrics say at `now_ms`; a reading older than `max_age` is not fresh.
    fn of(endpoint: &Endpoint, now_ms: u64, max_age: Duration) -> SignalsView {
        let status = endpoint.signals().status();
        let (engine, detail) = match &status {
            ReadStatus::Read(engine) => (Some(engine.as_str()), None),
            ReadStatus::Absent(why) | ReadStatus::Failed(why) => (None, Some(why.clone())),
            ReadStatus::Unread => (None, None),
        };
        let frozen = endpoint.signals().frozen();
        let last = endpoint
            .signals()
            .reading(now_ms, u64::MAX, endpoint.outstanding());
        let max_age_ms = u64::try_from(max_age.as_millis()).unwrap_or(u64::MAX);
        SignalsView {
            status: status.as_str(),
            engine,
            detail,
            age_s: last.map(|now| now.age_ms as f64 / 1000.0),
            fresh: !frozen && last.is_some_and(|now| max_age_ms > 0 && now.age_ms <= max_age_ms),
            frozen,
            in_node: last.map(|now| now.in_node),
            waiting: last.map(|now| now.waiting),
            batch: last.map(|now| now.batch),
            kv_cache: last.and_then(|now| now.cache),
        }
    }
}

/// An endpoint's counters, in its view (their names are the JSON's).
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct TallyView {
    pub requests: u64,
    pub failures: u64,
    pub ejections: u64,
    /// Attempts that stalled here (lost to a hedge, or waited far past the expected latency).
    pub stalls: u64,
    pub cooldowns: u64,
    /// Streams that broke here and were continued from their text: this node gave no token ids.
    pub continued_by_text: u64,
}

/// How quickly an endpoint answers, in its view.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct TimingView {
    /// Expected-latency estimate (time to first byte), ms; null before the first answer.
    pub latency_ms: Option<f64>,
    /// The adaptive limiter's unloaded latency, ms.
    pub unloaded_latency_ms: Option<f64>,
    /// What its streams' waits for their first tokens typically take (the opening, after the first
    /// chunk), ms, and how much they vary; null before one was timed.
    pub first_token_ms: Option<f64>,
    pub first_token_deviation_ms: Option<f64>,
    /// Its streams' typical gap between tokens, ms; null before one was seen.
    pub token_gap_ms: Option<f64>,
}

/// An endpoint's last heartbeat, in its view.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct HeartbeatView {
    /// Seconds since the last heartbeat ended (null: none yet), its duration and verdict.
    pub last_heartbeat_age_s: Option<f64>,
    pub last_heartbeat_ms: Option<f64>,
    pub last_heartbeat_ok: Option<bool>,
    /// The node said it is going (`x-tongs-drain` on its heartbeat answers), or its pod is being
    /// deleted: it drains.
    pub announced_drain: bool,
    /// Seconds left until it goes, as said (null: not going, or nobody said when).
    pub leaving_in_s: Option<f64>,
}

/// What an endpoint is doing, in the one word an operator needs first. When several hold, the first
/// that applies in this order names it: draining, unhealthy, stalled, ejected, probing, cooldown, suspect,
/// slow-start, healthy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum EndpointState {
    Healthy,
    SlowStart,
    Suspect,
    Cooldown,
    Probing,
    Ejected,
    /// Ejected because its requests stalled while its heartbeats passed (a gray failure).
    Stalled,
    Unhealthy,
    Draining,
}

impl EndpointState {
    /// Every state, in the order metrics list them.
    pub const ALL: [EndpointState; 9] = [
        EndpointState::Healthy,
        EndpointState::SlowStart,
        EndpointState::Suspect,
        EndpointState::Cooldown,
        EndpointState::Probing,
        EndpointState::Ejected,
        EndpointState::Stalled,
        EndpointState::Unhealthy,
        EndpointState::Draining,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            EndpointState::Healthy => "healthy",
            EndpointState::SlowStart => "slow-start",
            EndpointState::Suspect => "suspect",
            EndpointState::Cooldown => "cooldown",
            EndpointState::Probing => "probing",
            EndpointState::Ejected => "ejected",
            EndpointState::Stalled => "stalled",
            EndpointState::Unhealthy => "unhealthy",
            EndpointState::Draining => "draining",
        }
    }
}

impl Endpoint {
    /// A consistent-enough picture of the endpoint at `now` (each field read once, without locks but the
    /// breaker's and the limiter's).
    /// `signals_max_age` is how old a reading of its own metrics may be and still be used.
    pub fn view(
        &self,
        now: Instant,
        slow_start: Duration,
        signals_max_age: Duration,
    ) -> EndpointView {
        let now_ms = millis(now);
        let breaker_state = self.circuit().state();
        let breaker = match breaker_state {
            State::Closed { .. } => "closed",
            State::Open { .. } => "open",
            State::HalfOpen { .. } => "half-open",
        };
        let healthy = self.liveness().is_healthy();
        let suspect = self.liveness().is_suspect();
        let draining = !self.liveness().is_available();
        let cooling_down = self.load().cooling_down(now_ms);
        let window = u64::try_from(slow_start.as_millis()).unwrap_or(u64::MAX);
        let slow =
            window > 0 && self.effective_weight(now_ms, window) < u64::from(self.weight) * 1000;
        let state = if draining {
            EndpointState::Draining
        } else if !healthy {
            EndpointState::Unhealthy
        } else if self.circuit().is_stalled() && !matches!(breaker_state, State::Closed { .. }) {
            EndpointState::Stalled
        } else if let State::Open { .. } = breaker_state {
            EndpointState::Ejected
        } else if let State::HalfOpen { .. } = breaker_state {
            EndpointState::Probing
        } else if cooling_down {
            EndpointState::Cooldown
        } else if suspect {
            EndpointState::Suspect
        } else if slow {
            EndpointState::SlowStart
        } else {
            EndpointState::Healthy
        };
        let ms = |us: u64| (us > 0).then(|| us as f64 / 1000.0);
        let heartbeat = self.heartbeat().get();
        let opening = self.pace().opening();
        EndpointView {
            url: self.url().to_owned(),
            source: self.origin.source,
            pod: self.origin.pod.as_deref().map(str::to_owned),
            weight: self.weight,
            state,
            healthy,
            suspect,
            draining,
            removed: self.liveness().is_removed(),
            cooling_down,
            slow_start: slow,
            breaker,
            outstanding: self.outstanding(),
            limit: self.load().limit(),
            max_outstanding: self.origin.max_outstanding,
            counts: TallyView {
                requests: self.tally().requests(),
                failures: self.tally().failures(),
                ejections: self.tally().ejections(),
                stalls: self.tally().stalls(),
                cooldowns: self.tally().cooldowns(),
                continued_by_text: self.tally().continued_by_text(),
            },
            timing: TimingView {
                latency_ms: ms(self.latency().estimate_us()),
                unloaded_latency_ms: self.limits().unloaded_latency_us().and_then(ms),
                first_token_ms: opening.map(|typical| typical.mean.as_secs_f64() * 1000.0),
                first_token_deviation_ms: opening
                    .map(|typical| typical.deviation.as_secs_f64() * 1000.0),
                token_gap_ms: self
                    .pace()
                    .chunk_gap()
                    .map(|gap| gap.as_secs_f64() * 1000.0),
            },
            heartbeat: HeartbeatView {
                last_heartbeat_age_s: heartbeat
                    .map(|(at, _, _)| now_ms.saturating_sub(at) as f64 / 1000.0),
                last_heartbeat_ms: heartbeat.map(|(_, took, _)| took.as_secs_f64() * 1000.0),
                last_heartbeat_ok: heartbeat.map(|(_, _, ok)| ok),
                announced_drain: self.liveness().is_announced(),
                leaving_in_s: self
                    .notices()
                    .leaving_at_ms()
                    .map(|at| at.saturating_sub(now_ms) as f64 / 1000.0),
            },
            signals: SignalsView::of(self, now_ms, signals_max_age),
        }
    }
}
