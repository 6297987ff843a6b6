//! When a node's answer comes, token by token: the node's pace, and the pauses a healthy inference
//! server makes in it (a first-token wait, keep-alive comments meanwhile, a preemption); and the plain
//! SSE token stream that follows it.
//!
//! A request's [`TokenTiming`] is drawn once, when it is admitted, from the node's own seeded stream of
//! pause draws, kept apart from the service times' so that turning pauses on leaves every service time
//! of a seeded run as it was. A node without pause keys draws nothing and keeps its old pace exactly.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Response;
use http_body_util::BodyExt;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::node::{NodeShared, Serving, while_gray};
use super::reply::{EventFeed, SimBody, sse_response};
use super::schedule::lognormal;
use super::{NodeSpec, Preemption};

/// Longest first-token wait or pause a request is given, whatever its prompt, load and slow factor:
/// bounds the clock arithmetic (a day is far beyond any timeout a test or a proxy sets).
const LONGEST: Duration = Duration::from_secs(24 * 3600);

/// The keep-alive comment a stream sends while it waits for its first token (`comment_every`).
const COMMENT: &[u8] = b": ping\n\n";

/// When one request's tokens come.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct TokenTiming {
    /// From the answer's start to its first token.
    pub(super) first: Duration,
    /// Between two tokens.
    pub(super) gap: Duration,
    /// When a whole (not streamed) answer is ready: when a stream's last token would be.
    pub(super) whole: Duration,
    /// The node has a first-token wait, so a chat stream sends its role chunk at once, before the
    /// wait, as vLLM does; otherwise just before the first token (the old pace).
    pub(super) role_at_once: bool,
    /// Keep-alive comments while waiting for the first token.
    pub(super) comment_every: Option<Duration>,
    /// A preemption: after the token at this place in the stream (from 1), this pause.
    pub(super) preempted: Option<(u64, Duration)>,
}

/// What a request's timing depends on, read off the node when it is admitted.
pub(super) struct Load {
    pub(super) service_time: Duration,
    /// A `slow` interruption's factor (1 otherwise).
    pub(super) slow: f64,
    /// Other requests in flight on the node, waiting or served.
    pub(super) others: usize,
    /// Tokens the stream will send (where a preemption can fall).
    pub(super) tokens: u64,
    /// The prompt's whitespace-separated words.
    pub(super) words: u64,
    /// An engine's prefill of the words not in its prefix cache (zero on a node without an engine),
    /// before a `slow` factor: added to the first-token wait.
    pub(super) prefill: Duration,
}

impl TokenTiming {
    /// The timing of a request on a node of `spec`, pause draws taken from `rng`.
    pub(super) fn draw(spec: &NodeSpec, load: &Load, rng: &mut fastrand::Rng) -> TokenTiming {
        let (tenth, gap) = pace(load.service_time, spec.tokens);
        let first = match &spec.first_token {
            None => tenth,
            Some(first) => {
                let count = |n: u64| u32::try_from(n).unwrap_or(u32::MAX);
                let sum = first
                    .wait
                    .get()
                    .saturating_add(
                        first
                            .per_prompt_word
                            .get()
                            .saturating_mul(count(load.words)),
                    )
                    .saturating_add(
                        first
                            .per_in_flight
                            .get()
                            .saturating_mul(count(load.others as u64)),
                    )
                    .min(LONGEST);
                scaled(lognormal(rng, sum, first.spread), load.slow)
            }
        };
        let first = first.saturating_add(scaled(load.prefill, load.slow));
        let preempted = spec
            .preemption
            .as_ref()
            .and_then(|preemption| preempt(preemption, load, rng));
        let pause = preempted.map_or(Duration::ZERO, |(_, pause)| pause);
        TokenTiming {
            first,
            gap,
            whole: load
                .service_time
                .saturating_sub(tenth)
                .saturating_add(first)
                .saturating_add(pause),
            role_at_once: spec.first_token.is_some(),
            comment_every: spec.comment_every.map(|every| every.get()),
            preempted,
        }
    }

    /// The pause after the `sent`-th token: the preemption's, or none.
    pub(super) fn pause_after(&self, sent: u64) -> Duration {
        match self.preempted {
            Some((after, pause)) if after == sent => pause,
            _ => Duration::ZERO,
        }
    }
}

/// Whether a stream is preempted, and if so after which token and for how long. A stream of one token
/// has nothing after it to wait for, so it is never preempted.
fn preempt(
    preemption: &Preemption,
    load: &Load,
    rng: &mut fastrand::Rng,
) -> Option<(u64, Duration)> {
    let chance = (preemption.chance + preemption.per_in_flight * load.others as f64).min(1.0);
    if load.tokens < 2 || chance.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
        return None;
    }
    if rng.f64() >= chance {
        return None;
    }
    let after = rng.u64(1..load.tokens);
    let pause = lognormal(rng, preemption.pause.get(), preemption.spread).min(LONGEST);
    Some((after, pause))
}

/// `duration × factor`, at most [`LONGEST`] (a factor read from a fleet file is not bounded).
fn scaled(duration: Duration, factor: f64) -> Duration {
    Duration::try_from_secs_f64(duration.as_secs_f64() * factor)
        .unwrap_or(LONGEST)
        .min(LONGEST)
}

/// When a stream of `tokens` tokens over `service_time` sends its first token, and the gap between
/// the next ones: a tenth of the service time, then the rest spread evenly.
pub(super) fn pace(service_time: Duration, tokens: u32) -> (Duration, Duration) {
    let first = service_time.mul_f64(0.1);
    (first, service_time.saturating_sub(first) / tokens.max(1))
}

/// Waits `timing.first` for the first token; with keep-alive comments, sends one at once and then one
/// each interval meanwhile. False when the client went away.
pub(super) async fn before_first_token(events: &mpsc::Sender<Bytes>, timing: &TokenTiming) -> bool {
    let Some(every) = timing.comment_every else {
        return unless_gone(events, tokio::time::sleep(timing.first)).await;
    };
    let due = Instant::now() + timing.first;
    loop {
        if !send(events, Bytes::from_static(COMMENT)).await {
            return false;
        }
        let next = (Instant::now() + every).min(due);
        if !unless_gone(events, tokio::time::sleep_until(next)).await {
            return false;
        }
        if next >= due {
            return true;
        }
    }
}

/// Runs `wait` unless the client goes away first; false when it did.
pub(super) async fn unless_gone(
    events: &mpsc::Sender<Bytes>,
    wait: impl Future<Output = ()>,
) -> bool {
    tokio::select! {
        () = events.closed() => false,
        () = wait => true,
    }
}

/// Sends one event; false when the client has gone away.
pub(super) async fn send(events: &mpsc::Sender<Bytes>, event: Bytes) -> bool {
    events.send(event).await.is_ok()
}

/// Waits between the `sent`-th token and the next: the preemption's pause if it falls there, the gap,
/// then as long as the node is gray (a wedged worker has sent what it had; the rest waits for the node
/// to recover). False when the client went away.
pub(super) async fn before_next_token(
    events: &mpsc::Sender<Bytes>,
    timing: &TokenTiming,
    sent: u64,
    shared: &NodeShared,
) -> bool {
    let next = async {
        tokio::time::sleep(timing.pause_after(sent) + timing.gap).await;
        while_gray(shared).await;
    };
    unless_gone(events, next).await
}

/// An SSE token stream of the node's `tokens`, `data: {"node":...,"token":N}`, then `[DONE]`, at the
/// request's timing.
pub(super) fn stream_tokens(
    shared: Arc<NodeShared>,
    serving: Serving,
    timing: TokenTiming,
) -> Response<SimBody> {
    let (events, body) = EventFeed::new();
    let tokens = shared.spec.tokens;
    tokio::spawn(async move {
        if !before_first_token(&events, &timing).await {
            return; // the client (or the proxy) went away: stop generating
        }
        for token in 0..tokens {
            if token > 0 && !before_next_token(&events, &timing, u64::from(token), &shared).await {
                return;
            }
            let event = format!(
                "data: {{\"node\":\"{}\",\"token\":{token}}}\n\n",
                shared.spec.name
            );
            if !send(&events, Bytes::from(event)).await {
                return;
            }
        }
        if send(&events, Bytes::from_static(b"data: [DONE]\n\n")).await {
            serving.finish();
        }
    });
    sse_response(body.boxed())
}

/// The number of ASCII-whitespace-separated words in a request body: a plain request's prompt words.
pub(super) fn words(body: &[u8]) -> u64 {
    body.split(u8::is_ascii_whitespace)
        .filter(|word| !word.is_empty())
        .count() as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::HumanDuration;
    use crate::sim::FirstToken;

    fn load(others: usize, words: u64) -> Load {
        Load {
            service_time: Duration::from_millis(200),
            slow: 1.0,
            others,
            tokens: 16,
            words,
            prefill: Duration::ZERO,
        }
    }

    #[test]
    fn a_node_without_pauses_keeps_its_pace_and_draws_nothing() {
        let spec = NodeSpec::new("a", Duration::from_millis(200));
        let mut rng = fastrand::Rng::with_seed(7);
        let timing = TokenTiming::draw(&spec, &load(3, 100), &mut rng);
        let (first, gap) = pace(Duration::from_millis(200), 16);
        assert_eq!((timing.first, timing.gap), (first, gap));
        assert_eq!(timing.whole, Duration::from_millis(200));
        assert_eq!(timing.preempted, None);
        assert!(!timing.role_at_once);
        assert_eq!(rng.u64(..), fastrand::Rng::with_seed(7).u64(..));
    }

    #[test]
    fn the_first_token_waits_for_the_prompt_and_the_load() {
        let mut spec = NodeSpec::new("a", Duration::from_millis(200));
        spec.first_token = Some(FirstToken {
            wait: HumanDuration::from_millis(100),
            per_prompt_word: HumanDuration::from_millis(2),
            per_in_flight: HumanDuration::from_millis(50),
            spread: 0.0,
        });
        let mut rng = fastrand::Rng::with_seed(1);
        let timing = TokenTiming::draw(&spec, &load(3, 10), &mut rng);
        assert_eq!(timing.first, Duration::from_millis(100 + 20 + 150));
        // A whole answer: the wait, then the nine tenths of the service time the tokens take.
        assert_eq!(timing.whole, Duration::from_millis(270 + 180));
        assert!(timing.role_at_once);
        let slow = Load {
            slow: 2.0,
            ..load(0, 0)
        };
        assert_eq!(
            TokenTiming::draw(&spec, &slow, &mut rng).first,
            Duration::from_millis(200)
        );
        // A prompt of billions of words waits long, not forever, and does not overflow.
        let huge = load(usize::MAX, u64::MAX);
        assert_eq!(TokenTiming::draw(&spec, &huge, &mut rng).first, LONGEST);
    }

    #[test]
    fn an_engine_prefill_comes_before_the_first_token_slowed_like_it() {
        let spec = NodeSpec::new("a", Duration::from_millis(200));
        let mut rng = fastrand::Rng::with_seed(5);
        let prefilled = Load {
            prefill: Duration::from_millis(300),
            ..load(0, 300)
        };
        let timing = TokenTiming::draw(&spec, &prefilled, &mut rng);
        // The tenth of the service time, then the prefill; the tokens after at the node's pace.
        assert_eq!(timing.first, Duration::from_millis(20 + 300));
        assert_eq!(timing.gap, pace(Duration::from_millis(200), 16).1);
        assert_eq!(timing.whole, Duration::from_millis(200 + 300));
        let slow = Load {
            slow: 2.0,
            ..prefilled
        };
        // The service time a request gets is slowed already; the prefill is slowed here.
        assert_eq!(
            TokenTiming::draw(&spec, &slow, &mut rng).first,
            Duration::from_millis(20 + 600)
        );
    }

    #[test]
    fn preemption_comes_with_load_and_falls_before_the_last_token() {
        let mut spec = NodeSpec::new("a", Duration::from_millis(200));
        spec.preemption = Some(Preemption {
            chance: 0.0,
            per_in_flight: 0.5,
            pause: HumanDuration::from_millis(300),
            spread: 0.0,
        });
        let mut rng = fastrand::Rng::with_seed(3);
        for _ in 0..200 {
            assert_eq!(
                TokenTiming::draw(&spec, &load(0, 1), &mut rng).preempted,
                None
            );
            let timing = TokenTiming::draw(&spec, &load(2, 1), &mut rng);
            let (after, pause) = timing.preempted.expect("certain at 2 others");
            assert!((1..16).contains(&after), "{after}");
            assert_eq!(pause, Duration::from_millis(300));
            assert_eq!(timing.pause_after(after), pause);
            assert_eq!(timing.pause_after(after + 1), Duration::ZERO);
            assert_eq!(timing.whole, Duration::from_millis(500));
            let one = Load {
                tokens: 1,
                ..load(2, 1)
            };
            assert_eq!(TokenTiming::draw(&spec, &one, &mut rng).preempted, None);
        }
        // The same seed, the same draws.
        let draws = |seed| {
            let mut rng = fastrand::Rng::with_seed(seed);
            (0..20)
                .map(|_| TokenTiming::draw(&spec, &load(1, 1), &mut rng).preempted)
                .collect::<Vec<_>>()
        };
        assert_eq!(draws(9), draws(9));
        assert!(draws(9).iter().any(Option::is_some) && draws(9).iter().any(Option::is_none));
    }

    #[test]
    fn plain_prompt_words_are_split_on_ascii_whitespace() {
        assert_eq!(words(b"  one two\tthree\n"), 3);
        assert_eq!(words(b""), 0);
        assert_eq!(words(b"\xff\xfe x"), 2);
    }
}
