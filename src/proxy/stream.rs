//! Watching a committed stream: when its silence is a stalled node, when a pause, and when nothing
//! yet; and what each teaches the endpoint.
//!
//! A stall is a node that stops, not a stream that pauses. A stream's silence is first measured
//! against what its node's streams normally do at that point (see [`crate::endpoint::Pace`]): the wait
//! for the first tokens (the opening) and the gaps between tokens are learnt apart, and a silence
//! within `stream.idle_multiplier` × the typical one (at least the floor) is nothing. Past it, the node
//! decides: silent too on every other stream since this one went quiet, it is stalled (the stream is
//! cut and continued, and the node counts a stall: `breaker.consecutive_stalls` of them eject it);
//! heard from meanwhile, it is serving, and this stream is paused (a preemption, a slow prefill under
//! load): left alone until it resumes, its node is ejected or declared gone on other evidence, or
//! `stream.pause_max`, and never counted against the node.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use http::HeaderValue;
use tokio::time::Instant;

use super::ProxySettings;
use super::attempt::Probe;
use crate::breaker::BreakerSettings;
use crate::endpoint::{Endpoint, OPENING_GAPS, Outstanding, Typical, millis};
use crate::http::body::{Cut, GoneSignal, Silence, StreamGuard, Watch};
use crate::metrics::ProxyStats;
use crate::registry::Registry;

/// `stream.*`: when a committed stream's silence is a stall, a pause, or nothing yet.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StreamSettings {
    pub idle_multiplier: f64,
    pub idle_min: Duration,
    pub first_token_idle: Duration,
    pub pause_max: Duration,
}

/// One stream's limits: `stream.*`, with the floor of a stream that can be continued elsewhere
/// (`continuation.idle_min`) where it is one.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct IdleSettings {
    pub multiplier: f64,
    pub min: Duration,
    pub first_token: Duration,
    pub pause_max: Duration,
    /// The most the floor is raised to for a node whose streams resumed from long gaps before
    /// (`stream.idle_min`).
    pub learned_max: Duration,
}

impl IdleSettings {
    /// A stream's idle settings; one that can be continued elsewhere has the lower floor.
    pub fn from(settings: &ProxySettings, continuable: bool) -> IdleSettings {
        let stream = &settings.stream;
        IdleSettings {
            multiplier: stream.idle_multiplier,
            min: if continuable {
                settings.continuation.idle_min
            } else {
                stream.idle_min
            },
            first_token: stream.first_token_idle,
            pause_max: stream.pause_max,
            learned_max: stream.idle_min,
        }
    }

    /// The floor on a node whose streams resumed from gaps as long as `longest` before: half as long
    /// again as that, so that a pause the node makes now and then (a real server under load stops
    /// every stream at once for most of a second) is not taken for a stall, up to `learned_max`.
    pub fn floor(&self, longest: Duration) -> Duration {
        self.min.max(longest.mul_f64(1.5).min(self.learned_max))
    }
}

/// The idle limit between tokens: far outside the typical gap ([`Typical::far`]), and at least the
/// floor. The typical gap is the endpoint's, or, before it has streamed past an opening, the time this
/// answer took to start (a first chunk comes after the prompt is read, so it is no shorter than a gap
/// between tokens).
pub fn idle_limit(settings: &IdleSettings, typical_gap: Option<Typical>) -> Duration {
    typical_gap
        .map_or(Duration::ZERO, |gap| gap.far(settings.multiplier))
        .max(settings.min)
}

/// The idle limit in a stream's opening, the wait for its first tokens: far outside what the node's
/// openings take ([`Typical::far`]), or `first_token` while none was timed; at least the floor, and
/// stretched by `prompt_factor`, how many times longer this request's prefill may be.
pub fn opening_limit(
    settings: &IdleSettings,
    typical: Option<Typical>,
    prompt_factor: f64,
) -> Duration {
    typical
        .map_or(settings.first_token, |typical| {
            typical.far(settings.multiplier)
        })
        .max(settings.min)
        .mul_f64(prompt_factor.max(1.0))
}

/// What a stream past its idle limit should do, given when it went quiet (`since_ms`), the node's last
/// sign of progress (`heard_ms`), the limit, the time now and `pause_max` (all ms on one clock).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SilenceVerdict {
    /// The node is silent too: stalled.
    Stalled,
    /// The node was heard from meanwhile: a pause; ask again in this many ms.
    Paused { again_in_ms: u64 },
    /// A pause past `pause_max`.
    TooLong,
}

/// Judges a silence past its limit (pure; times in ms). The node was heard from since the stream went
/// quiet and within the last `limit_ms`: it serves its other streams, so this one is paused, until
/// `pause_max_ms` of silence. Otherwise every stream of the node has been silent for at least the
/// limit: the node is stalled.
///
/// A silence already found to be a pause (`paused`) stays one until `pause_max_ms`, whether or not
/// the node goes quiet meanwhile: its other streams may simply have ended (a preempted sequence
/// outlives the batch it was pushed out of), and had they stopped instead, their own silences would
/// find the node stalled and its ejection would end this stream too.
pub fn judge(
    since_ms: u64,
    heard_ms: u64,
    now_ms: u64,
    (limit_ms, pause_max_ms): (u64, u64),
    paused: bool,
) -> SilenceVerdict {
    let silent = now_ms.saturating_sub(since_ms);
    if silent >= pause_max_ms {
        return SilenceVerdict::TooLong;
    }
    if paused {
        return SilenceVerdict::Paused {
            again_in_ms: (pause_max_ms - silent).max(1),
        };
    }
    let node_quiet = now_ms.saturating_sub(heard_ms);
    if heard_ms <= since_ms || node_quiet >= limit_ms {
        return SilenceVerdict::Stalled;
    }
    SilenceVerdict::Paused {
        again_in_ms: (limit_ms - node_quiet).min(pause_max_ms - silent).max(1),
    }
}

/// What a committed stream holds: the endpoint's slot, and what it needs to judge a silence.
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
    /// How long this answer took to start (the token gap's stand-in before the node has one).
    first_byte: Option<Duration>,
    /// The request's body, bytes: a longer prompt prefills longer.
    prompt_bytes: u64,
    /// Data chunks since the one that started the answer.
    chunks: u32,
    /// The longest gap tongs waited for in the opening so far (`None`: none was waited for, and an
    /// opening whose chunks were all there at once times nothing).
    opening_longest: Option<Duration>,
    /// This stream's current silence was already counted as a pause.
    paused: bool,
    /// A cut would be continued on another node (a streamed OpenAI completion with continuations
    /// left). One that cannot be is never cut for its node's stall alone ([`Streamed::silent`]).
    continuable: bool,
    /// This stream's current silence was already counted as a stall of its node, and the stream left
    /// open because it cannot be continued.
    stall_counted: bool,
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

    /// The stream's idle settings, their floor raised by the longest gap its node's streams resumed
    /// from.
    fn idle(&self) -> IdleSettings {
        let pace = self.outstanding.endpoint().pace();
        IdleSettings {
            min: self.idle.floor(pace.longest_gap(millis(Instant::now()))),
            ..self.idle
        }
    }

    /// How long the stream may be silent now, by its phase. A node whose own metrics froze while it
    /// had requests (a wedged engine) gets no more than the floor, in either phase.
    fn limit(&self) -> Duration {
        let endpoint = self.outstanding.endpoint();
        if endpoint.signals().frozen() {
            return self.idle().min;
        }
        if self.chunks < OPENING_GAPS {
            self.opening_limit()
        } else {
            let endpoint = self.outstanding.endpoint();
            let first_byte = self.first_byte.map(|mean| Typical {
                mean,
                deviation: Duration::ZERO,
            });
            idle_limit(&self.idle(), endpoint.pace().token_gap().or(first_byte))
        }
    }

    fn opening_limit(&self) -> Duration {
        let endpoint = self.outstanding.endpoint();
        opening_limit(
            &self.idle(),
            endpoint.pace().opening(),
            endpoint.pace().prompt_factor(self.prompt_bytes),
        )
    }

    /// How long the whole node must have been silent for this stream's silence to be a stall. A node
    /// with requests waiting for their first byte may be prefilling them, which on servers without
    /// chunked prefill stops every stream there for as long: that much silence is its opening's.
    fn node_limit(&self, limit: Duration) -> Duration {
        let endpoint = self.outstanding.endpoint();
        if self.chunks >= OPENING_GAPS
            && !endpoint.signals().frozen()
            && endpoint.latency().waiting_attempts() > 0
        {
            limit.max(self.opening_limit())
        } else {
            limit
        }
    }

    /// The opening is over (or the stream ended within it): one sample of it, if it timed anything.
    fn opened(&mut self) {
        if let Some(longest) = self.opening_longest.take() {
            self.outstanding
                .endpoint()
                .pace()
                .observe_opening(longest, self.prompt_bytes);
        }
    }
}

impl StreamGuard for Streamed {
    fn chunk(&mut self, waited: Option<Duration>) -> Option<Duration> {
        self.chunks = self.chunks.saturating_add(1);
        // The chunk that ends a pause says how long the pause was, not the node's pace between
        // tokens; in the opening it is the first token's wait under load, which is what it learns.
        let stall_ended = std::mem::take(&mut self.stall_counted);
        let was_paused = std::mem::take(&mut self.paused) || stall_ended;
        let endpoint = self.outstanding.endpoint();
        // A token is the node's progress, whether tongs waited for it or found it already there.
        endpoint.pace().heard(millis(Instant::now()));
        if let Some(gap) = waited {
            if self.chunks <= OPENING_GAPS {
                self.opening_longest = Some(self.opening_longest.unwrap_or_default().max(gap));
            } else if !was_paused {
                endpoint.pace().observe_chunk_gap(self.chunks, gap);
                endpoint
                    .pace()
                    .observe_resumed_gap(gap, millis(Instant::now()));
            }
        }
        if self.chunks == OPENING_GAPS {
            self.opened();
        }
        let limit = self.limit();
        self.judge_probe(limit);
        Some(limit)
    }

    fn silent(&mut self, since: Instant) -> Silence {
        let now = Instant::now();
        let silent = now.saturating_duration_since(since);
        let limit = self.limit();
        // The limit grew since the timer was set (the node's pace was learnt meanwhile).
        if silent < limit {
            return Silence::Until(since + limit);
        }
        let endpoint = self.outstanding.endpoint();
        let verdict = judge(
            millis(since),
            endpoint.pace().heard_ms(),
            millis(now),
            (
                super::millis_of(self.node_limit(limit)),
                super::millis_of(self.idle.pause_max),
            ),
            self.paused,
        );
        match verdict {
            SilenceVerdict::Stalled if self.continuable => Silence::Cut(Cut::Idle(silent)),
            // A stream that cannot be continued is lost if cut, and a stalled node may resume (a
            // worker back from a hang, a partition healed): its stall is counted, so the node takes
            // no new requests and is ejected like any stalled node, but the stream waits, as a pause
            // does, until it resumes, `stream.pause_max`, or heartbeats declare its node gone.
            SilenceVerdict::Stalled => {
                if !self.stall_counted {
                    self.stall_counted = true;
                    tracing::warn!(
                        request_id = self.request_id.to_str().unwrap_or_default(),
                        endpoint = endpoint.url(),
                        silent_ms = silent.as_millis() as u64,
                        chunks = self.chunks,
                        "stream and its node silent past what the node's streams normally take; \
                         counted as a stall of the node; the stream cannot be continued elsewhere, \
                         so it waits until stream.pause_max for its node to resume"
                    );
                    let may_eject =
                        super::may_eject_stalled(&self.registry, self.max_ejected_percent);
                    endpoint
                        .breaker()
                        .record_stream_stall(&self.breaker, now, may_eject);
                }
                Silence::Until(since + self.idle.pause_max)
            }
            SilenceVerdict::TooLong => Silence::Cut(Cut::Paused(silent)),
            SilenceVerdict::Paused { again_in_ms } => {
                if !self.paused {
                    self.paused = true;
                    self.stats.stream_pauses.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(
                        request_id = self.request_id.to_str().unwrap_or_default(),
                        endpoint = endpoint.url(),
                        silent_ms = silent.as_millis() as u64,
                        "stream paused while its node serves its other streams; left alone"
                    );
                }
                Silence::Until(now + Duration::from_millis(again_in_ms))
            }
        }
    }

    fn gone(&mut self) -> Option<GoneSignal> {
        Some(gone(
            self.outstanding.endpoint(),
            &self.registry,
            self.probe.is_some() || !self.continuable,
            self.continuable,
        ))
    }

    fn end(&mut self, complete: bool) {
        // A stream that ended within its opening still timed it (once: `opened` takes the sample).
        if complete && self.chunks < OPENING_GAPS {
            self.opened();
        }
        if let Some((probe, _)) = self.probe.take() {
            if complete {
                probe.succeeded(Instant::now());
            } else {
                probe.failed(&self.breaker, Instant::now());
            }
        }
    }

    fn cut(&mut self, why: Cut) {
        let endpoint = self.outstanding.endpoint();
        let request_id = self.request_id.to_str().unwrap_or_default();
        if why == Cut::Moved {
            self.stats.streams_moved.fetch_add(1, Ordering::Relaxed);
            tracing::info!(
                request_id,
                endpoint = endpoint.url(),
                chunks = self.chunks,
                "the stream's node said it is going; the stream moves to another before it does"
            );
            return;
        }
        self.stats.streams_cut.fetch_add(1, Ordering::Relaxed);
        // What becomes of the stream is logged by whoever holds it: continued elsewhere (a streamed
        // OpenAI completion, see `continuation`), or ended as an error the client sees.
        match why {
            Cut::Idle(silent) => {
                tracing::warn!(
                    request_id,
                    endpoint = endpoint.url(),
                    silent_ms = silent.as_millis() as u64,
                    chunks = self.chunks,
                    "stream and its node silent past what the node's streams normally take; cut, \
                     and counted as a stall of the node"
                );
                let may_eject = super::may_eject_stalled(&self.registry, self.max_ejected_percent);
                endpoint
                    .breaker()
                    .record_stream_stall(&self.breaker, Instant::now(), may_eject);
            }
            Cut::Paused(silent) if self.stall_counted => {
                tracing::warn!(
                    request_id,
                    endpoint = endpoint.url(),
                    silent_ms = silent.as_millis() as u64,
                    "stream silent past stream.pause_max on a stalled node that did not resume; cut"
                );
            }
            Cut::Paused(silent) => {
                tracing::warn!(
                    request_id,
                    endpoint = endpoint.url(),
                    silent_ms = silent.as_millis() as u64,
                    "stream paused past stream.pause_max while its node served its other streams; \
                     cut, not counted against the node"
                );
            }
            Cut::Gone => {
                tracing::warn!(
                    request_id,
                    endpoint = endpoint.url(),
                    "endpoint declared gone while a stream ran; stream cut"
                );
            }
            Cut::Moved => {}
        }
    }
}

/// Resolves when `endpoint` is stalled, or declared unhealthy by heartbeats while some other endpoint
/// of `registry` is healthy: when none is, tongs' own network or the health path is more likely broken
/// than every node at once (panic mode), and streams that still flow are left alone. Only heartbeats
/// end a stream early that outlives its node's stall (`outlives_stall`): the half-open probe of a
/// stalled endpoint, the one stream that runs there while it is stalled, and a stream that cannot be
/// continued elsewhere, which a cut would lose while the node may still resume.
///
/// A stream that can be continued elsewhere (`movable`) also moves when its node said it is going,
/// before it goes (see [`move_at`]): [`Cut::Moved`]. One that cannot is left to finish.
fn gone(
    endpoint: &Arc<Endpoint>,
    registry: &Arc<Registry>,
    outlives_stall: bool,
    movable: bool,
) -> GoneSignal {
    let mut signal = endpoint.gone_signal();
    let endpoint = Arc::clone(endpoint);
    let registry = Arc::clone(registry);
    Box::pin(async move {
        loop {
            let unhealthy = !endpoint.liveness().is_healthy() && registry.counts().healthy() > 0;
            if unhealthy || (endpoint.circuit().is_stalled() && !outlives_stall) {
                return Cut::Gone;
            }
            let changed = match movable.then(|| move_at(&endpoint)).flatten() {
                Some(at) if at <= Instant::now() => return Cut::Moved,
                Some(at) => tokio::select! {
                    changed = signal.changed() => changed,
                    () = tokio::time::sleep_until(at) => continue,
                },
                None => signal.changed().await,
            };
            if changed.is_err() {
                return std::future::pending().await;
            }
        }
    })
}

/// The least time before its node goes that a stream moves: a continuation's first token must come
/// before the node goes (see [`move_at`]).
const MOVE_MARGIN: Duration = Duration::from_secs(2);

/// When a stream on `endpoint` that can be continued elsewhere moves, once the node or its source said
/// it is going (`None` while nobody has, or only an operator drained it): before the time it said it has left by a margin, twice what its streams'
/// first tokens take (their mean plus four deviations; the continuation's prefill on a node like it)
/// and at least [`MOVE_MARGIN`]; at once when it did not say how long it has left. A stream that ends
/// before that never moves.
fn move_at(endpoint: &Endpoint) -> Option<Instant> {
    let goes = endpoint.notices().goes()?;
    let now = Instant::now();
    let Some(leaving_at_ms) = goes else {
        return Some(now);
    };
    let left = Duration::from_millis(leaving_at_ms.saturating_sub(crate::endpoint::millis(now)));
    let first_token = endpoint.pace().opening().map_or(Duration::ZERO, |typical| {
        typical.mean + typical.deviation * 4
    });
    let margin = (first_token * 2).max(MOVE_MARGIN);
    Some(now + left.saturating_sub(margin))
}

/// How the stream of a committed answer on `outstanding`'s endpoint is watched; `first_byte` is how long
/// that answer took to start (none for a failure's own answer); `continuable`, whether a cut would be
/// continued elsewhere; `probe`, the breaker's half-open probe when this answer is it; `prompt_bytes`,
/// the size of the request's body.
pub fn watch(
    settings: &ProxySettings,
    outstanding: Outstanding,
    (first_byte, continuable, probe, prompt_bytes): (Option<Duration>, bool, Option<Probe>, u64),
    registry: &Arc<Registry>,
    stats: &Arc<ProxyStats>,
    request_id: &HeaderValue,
) -> Watch {
    let streamed = Streamed {
        outstanding,
        registry: Arc::clone(registry),
        stats: Arc::clone(stats),
        idle: IdleSettings::from(settings, continuable),
        breaker: settings.breaker.clone(),
        max_ejected_percent: settings.max_ejected_percent,
        request_id: request_id.clone(),
        probe: probe.map(|probe| (probe, Instant::now())),
        first_byte,
        prompt_bytes,
        chunks: 0,
        opening_longest: None,
        paused: false,
        continuable,
        stall_counted: false,
    };
    let limit = streamed.limit();
    Watch {
        guard: Box::new(streamed),
        idle: Some(limit),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> IdleSettings {
        IdleSettings {
            multiplier: 10.0,
            min: Duration::from_secs(2),
            first_token: Duration::from_secs(10),
            pause_max: Duration::from_secs(30),
            learned_max: Duration::from_secs(2),
        }
    }

    #[test]
    fn the_floor_rises_with_the_gaps_a_node_resumed_from_up_to_the_streams_own() {
        let idle = IdleSettings {
            min: ms(1000),
            ..settings()
        };
        assert_eq!(idle.floor(Duration::ZERO), ms(1000));
        assert_eq!(
            idle.floor(ms(600)),
            ms(1000),
            "a usual pause is under the floor"
        );
        assert_eq!(idle.floor(ms(900)), ms(1350));
        assert_eq!(idle.floor(ms(5000)), ms(2000), "never past stream.idle_min");
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn the_idle_limit_is_a_multiple_of_the_typical_gap_and_never_below_the_floor() {
        let idle = settings();
        let gap = |mean, deviation| {
            Some(Typical {
                mean: ms(mean),
                deviation: ms(deviation),
            })
        };
        assert_eq!(idle_limit(&idle, None), Duration::from_secs(2));
        assert_eq!(idle_limit(&idle, gap(30, 5)), Duration::from_secs(2));
        assert_eq!(idle_limit(&idle, gap(500, 50)), Duration::from_secs(5));
        // Gaps that vary widely (tokens coalesced by a gateway) widen it past ten means.
        assert_eq!(idle_limit(&idle, gap(200, 800)), ms(3400));
    }

    #[test]
    fn the_opening_is_judged_by_the_nodes_own_first_token_waits() {
        let idle = settings();
        // Nothing timed yet: the generous default, stretched for a long prompt.
        assert_eq!(opening_limit(&idle, None, 1.0), Duration::from_secs(10));
        assert_eq!(opening_limit(&idle, None, 3.0), Duration::from_secs(30));
        // A node whose first tokens take 600 ms: ten of those, not its 40 ms token gaps.
        let steady = Typical {
            mean: ms(600),
            deviation: ms(100),
        };
        assert_eq!(opening_limit(&idle, Some(steady), 1.0), ms(6000));
        // A node whose first tokens come at once is held to the floor, as its token gaps are.
        let quick = Typical {
            mean: ms(5),
            deviation: ms(2),
        };
        assert_eq!(
            opening_limit(&idle, Some(quick), 1.0),
            Duration::from_secs(2)
        );
        // Widely varying waits (prompts of every length) widen the limit past ten means.
        let varied = Typical {
            mean: ms(200),
            deviation: ms(700),
        };
        assert_eq!(opening_limit(&idle, Some(varied), 1.0), ms(3000));
    }

    #[test]
    fn a_silent_stream_on_a_silent_node_is_a_stall() {
        // Quiet since 1,000; the node last heard at 900 (before), or never.
        assert_eq!(
            judge(1_000, 900, 3_000, (2_000, 30_000), false),
            SilenceVerdict::Stalled
        );
        assert_eq!(
            judge(1_000, 0, 3_000, (2_000, 30_000), false),
            SilenceVerdict::Stalled
        );
        // Heard once after the stream went quiet, then silent for the whole limit: stalled since.
        assert_eq!(
            judge(1_000, 1_500, 3_500, (2_000, 30_000), false),
            SilenceVerdict::Stalled
        );
    }

    #[test]
    fn a_silent_stream_on_a_node_that_serves_others_is_a_pause_until_pause_max() {
        // Heard 100 ms ago: a pause; asked again when the node would have been silent for the limit.
        assert_eq!(
            judge(1_000, 2_900, 3_000, (2_000, 30_000), false),
            SilenceVerdict::Paused { again_in_ms: 1_900 }
        );
        // Near pause_max, asked again right at it ...
        assert_eq!(
            judge(1_000, 30_900, 30_950, (2_000, 30_000), false),
            SilenceVerdict::Paused { again_in_ms: 50 }
        );
        // ... and past it, too long, however busy the node.
        assert_eq!(
            judge(1_000, 31_000, 31_000, (2_000, 30_000), false),
            SilenceVerdict::TooLong
        );
    }
}
