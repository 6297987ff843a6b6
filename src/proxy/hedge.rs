//! Hedged attempts and stall detection: an attempt that has no answer by its hedge delay gets a
//! second attempt on another endpoint, and the first to commit wins (the other is dropped, which closes
//! its connection so its GPU stops). An attempt that loses to a hedge, or waits far past its
//! endpoint's expected time to first byte, counts as stalled there; stalls in a row while heartbeats
//! pass mark the endpoint stalled (see `breaker`), which moves its waiting requests elsewhere at once.
//!
//! tower's hedge middleware fires at a latency percentile of the whole service; here the delay is per
//! endpoint, from the same expected-latency estimate the balancer ranks by, so a fleet of fast and slow
//! GPUs is hedged fairly. Hedges are bounded twice: by their own budget (`hedge.max_extra_percent` of
//! the request rate) and by the retry budget they share with retries.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use http::Request;
use tokio::time::Instant;

use super::acquire::{Pick, Tried};
use super::attempt::{Attempt, Sending, Slot};
use super::request::Template;
use super::{Proxy, ProxySettings, WorkerPath};
use crate::endpoint::Endpoint;
use crate::retry::{FailureKind, ReplayBody};
use crate::trace::AttemptKind;
use crate::upstream::UpstreamBody;

/// One worker's allowance of hedges: every request deposits `hedge.max_extra_percent` hundredths of a
/// hedge, every hedge withdraws a whole one. Atomics, because the worker's requests run as separate
/// tasks on its thread.
#[derive(Debug, Default)]
pub struct HedgeBudget {
    /// Thousandths of a hedge.
    balance: AtomicU64,
}

/// What one hedge costs, in thousandths.
const HEDGE: u64 = 1000;
/// Hedges a quiet spell can save up for a burst.
const BURST: u64 = 10 * HEDGE;

impl HedgeBudget {
    /// A request arrived: `percent` of a hedge more may be spent.
    pub fn deposit(&self, percent: u32) {
        let add = u64::from(percent) * HEDGE / 100;
        let _ = self
            .balance
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |balance| {
                Some((balance + add).min(BURST))
            });
    }

    /// Takes one hedge, if the balance allows.
    pub fn withdraw(&self) -> bool {
        self.balance
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |balance| {
                balance.checked_sub(HEDGE)
            })
            .is_ok()
    }

    /// Gives back a hedge taken but not sent.
    fn refund(&self) {
        self.balance.fetch_add(HEDGE, Ordering::Relaxed);
    }
}

/// When an attempt started at `started` on an endpoint expected to answer in `expected` is hedged, and
/// when it counts as stalled. `own` is what the endpoint itself has shown (its latency estimate before
/// any decay; `None`: it never answered).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timing {
    pub started: Instant,
    pub hedge_at: Instant,
    pub stall_at: Instant,
}

impl Timing {
    pub fn new(
        settings: &ProxySettings,
        started: Instant,
        expected: Duration,
        own: Option<Duration>,
        hedging: Hedging,
    ) -> Timing {
        let hedge_after = expected
            .mul_f64(settings.hedge.after_multiplier)
            .max(settings.hedge.min_delay);
        // Never before twice the hedge delay: an attempt a hedge could still beat in time is not
        // judged yet. Judged by the node's own pace where it has one (an estimate drifting back to
        // the fleet's while the node is idle says nothing of how slow it is); a node that never
        // answered may simply be slower than the fleet (a smaller GPU, a longer prefill), so it is
        // not judged before `stream.first_token_idle`, the wait for first tokens not yet timed. The
        // hedge still comes at the fleet's pace.
        let judged = own.map_or(expected, |own| own.max(expected));
        let mut stall_after = judged
            .mul_f64(settings.stall_multiplier)
            .max(hedge_after * 2);
        if own.is_none() {
            stall_after = stall_after.max(settings.stream.first_token_idle);
        }
        let hedge_at = if hedging == Hedging::AtOnce {
            started
        } else {
            started + hedge_after
        };
        Timing {
            started,
            hedge_at,
            stall_at: started + stall_after,
        }
    }
}

/// Whether an attempt at `endpoint` started at `started` is alone in waiting: some endpoint answered
/// since it started (`last_answer`, ms on the endpoints' clock) but this one did not.
fn waiting_alone(last_answer: &AtomicU64, endpoint: &Endpoint, started: Instant) -> bool {
    let since = crate::endpoint::millis(started);
    last_answer.load(Ordering::Relaxed) > since && endpoint.latency().last_answer_ms() <= since
}

/// Whether such an attempt is a stall of its endpoint: alone in waiting, and the endpoint showed no
/// progress at all meanwhile, not even a token of a stream it holds. A node that goes on streaming to
/// others while a new request waits (its prefill, a queue behind a full KV cache) is busy, not hung.
fn stalled_alone(last_answer: &AtomicU64, endpoint: &Endpoint, started: Instant) -> bool {
    waiting_alone(last_answer, endpoint, started)
        && endpoint.pace().heard_ms() <= crate::endpoint::millis(started)
}

/// How often an attempt past its stall point with no second attempt beside it looks again: whether it
/// now waits alone, and for room elsewhere.
const STALLED_LOOK_AGAIN: Duration = Duration::from_millis(100);

/// What a second attempt beside a running one is paid from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Spend {
    /// A hedge: the hedge budget and the retry budget.
    Hedge,
    /// A planned move's second attempt, sent at once: the retry budget alone. Moves are bounded by
    /// the streams of the nodes that said they go, not by the request rate the hedge budget follows.
    Move,
    /// An attempt past its stall point with no hedge beside it: the retry budget alone.
    Retry,
}

/// Whether an attempt may get a second one beside it, and when.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Hedging {
    /// Never (the client opted out of retries): only its stall point is watched.
    Never,
    /// Once it has waited past its hedge delay.
    WhenLate,
    /// At once: a stream moving off a node that said it goes. The client waits for the new node's
    /// first token, and the move has time to spare, so it is sent to two nodes and the first to
    /// answer is kept: a node that queues it (full to its batch, which tongs may not know) or a slow
    /// prefill costs the client nothing while the other answers.
    AtOnce,
}

/// The attempt to run: its slot, its request, and whether and when it may be hedged.
pub(super) struct Race<'a> {
    pub slot: Slot,
    pub request: Request<UpstreamBody>,
    pub template: &'a Template,
    pub hedging: Hedging,
}

/// One race's own state: the first attempt's endpoint and timing, and what its stall point found;
/// and what a second attempt beside it is made from.
struct Racer<'a> {
    proxy: &'a Arc<Proxy>,
    settings: &'a ProxySettings,
    worker: &'a WorkerPath,
    template: &'a Template,
    body: &'a ReplayBody,
    /// The first attempt's endpoint.
    endpoint: Arc<Endpoint>,
    timing: Timing,
    /// A second attempt may be sent beside the first (the body is kept whole, the client allows it).
    replayable: bool,
    /// The first attempt reached its stall point.
    stalled: bool,
    /// It was found waiting alone there or since (and its stall counted, if it was one).
    found_alone: bool,
}

impl<'a> Racer<'a> {
    fn new(
        proxy: &'a Arc<Proxy>,
        sending: &'a Sending,
        worker: &'a WorkerPath,
        template: &'a Template,
        endpoint: &Arc<Endpoint>,
        hedging: Hedging,
    ) -> Racer<'a> {
        let settings = &*sending.settings;
        let started = Instant::now();
        let own = match endpoint.latency().estimate_us() {
            0 => None,
            us => Some(Duration::from_micros(us)),
        };
        // The endpoint's expected time to first byte (the fleet's while it has no estimate of its own).
        let expected = Duration::from_micros(endpoint.latency().estimate(
            crate::endpoint::millis(started),
            proxy.fleet_latency_us(),
            super::millis_of(settings.balance.latency_decay),
        ));
        Racer {
            proxy,
            settings,
            worker,
            template,
            body: &sending.body,
            endpoint: Arc::clone(endpoint),
            timing: Timing::new(settings, started, expected, own, hedging),
            replayable: hedging != Hedging::Never
                && settings.hedge.enabled
                && sending.body.is_buffered(),
            stalled: false,
            found_alone: false,
        }
    }

    /// The first attempt is past its stall point (and is looked at again every
    /// [`STALLED_LOOK_AGAIN`]): whether it waits alone now. Its stall is counted the first time.
    fn alone_past_stall_point(&mut self) -> bool {
        self.stalled = true;
        if self.found_alone {
            waiting_alone(&self.proxy.last_answer, &self.endpoint, self.timing.started)
        } else {
            self.found_alone =
                self.proxy
                    .stall_point(self.settings, &self.endpoint, self.timing.started);
            self.found_alone
        }
    }

    /// The first attempt reached its stall point while a second one runs beside it.
    fn reached_stall_point(&mut self) {
        self.stalled = true;
        self.proxy
            .stall_point(self.settings, &self.endpoint, self.timing.started);
    }

    /// A second attempt on an endpoint not yet tried, if one has room now, no request is queued
    /// for a slot, and the budgets `spend` names allow.
    fn second(&self, tried: &mut Tried, spend: Spend) -> Option<(Slot, Request<UpstreamBody>)> {
        let (proxy, worker) = (self.proxy, self.worker);
        let hedge = spend == Spend::Hedge;
        if !proxy.queue.is_empty() || (hedge && !worker.hedges.withdraw()) {
            return None;
        }
        let refund = || {
            if hedge {
                worker.hedges.refund();
            }
        };
        let Pick::Slot(mut slot) = proxy.pick(self.settings, tried) else {
            refund();
            return None;
        };
        // The retry budget is asked last: its withdrawal cannot be given back.
        let Some(attempt_body) = self.body.for_attempt().filter(|_| worker.budget.withdraw())
        else {
            refund();
            if slot.probe {
                slot.outstanding
                    .endpoint()
                    .breaker()
                    .release_probe(Instant::now());
            }
            return None;
        };
        let endpoint = Arc::clone(slot.outstanding.endpoint());
        tried.push(endpoint.id());
        proxy.stats.attempts.fetch_add(1, Ordering::Relaxed);
        let kind = match spend {
            Spend::Hedge => {
                tracing::debug!(endpoint = endpoint.url(), "hedging a slow attempt");
                AttemptKind::Hedge
            }
            Spend::Move => {
                tracing::debug!(endpoint = endpoint.url(), "a moving stream races two nodes");
                AttemptKind::Hedge
            }
            Spend::Retry => {
                proxy.stats.retries.count(FailureKind::Timeout);
                tracing::debug!(
                    endpoint = endpoint.url(),
                    "a stalled attempt gets a second one"
                );
                AttemptKind::Stalled
            }
        };
        if kind == AttemptKind::Hedge {
            proxy.stats.hedges.fetch_add(1, Ordering::Relaxed);
        }
        let request = self.template.build(&mut slot, attempt_body, kind);
        Some((slot, request))
    }

    /// The first attempt, which the second beat. Cancelled (its connection closed, so its GPU stops)
    /// — unless nothing else is finding out whether its endpoint is slow or hung: then it goes on by
    /// itself until it answers (slow: its latency teaches the endpoint's estimate, and the answer is
    /// dropped) or until its stall point (hung: a stall is counted), whichever comes first. Cancelling
    /// every beaten attempt would leave a node that merely slowed down no way to show it still works,
    /// and it would be taken for stalled. At most one such attempt runs per endpoint.
    fn beaten(&self, attempt: impl Future<Output = Attempt> + Send + 'static) {
        if self.stalled || !self.endpoint.circuit().begin_investigation() {
            return;
        }
        let endpoint = Arc::clone(&self.endpoint);
        let settings = self.settings.clone();
        let proxy = Arc::clone(self.proxy);
        let timing = self.timing;
        tokio::spawn(async move {
            tokio::select! {
                outcome = attempt => drop(outcome),
                () = tokio::time::sleep_until(timing.stall_at) => {
                    proxy.stall_point(&settings, &endpoint, timing.started);
                }
            }
            endpoint.circuit().end_investigation();
        });
    }
}

impl Proxy {
    /// An attempt at `endpoint` started at `started` reached its stall point. It is worth a second
    /// attempt elsewhere only if the rest of the fleet answered something since it started while this
    /// endpoint answered nothing: when every node is slow (a burst of long requests, say) none is
    /// better. It counts as a stall of the endpoint only if, besides, the endpoint showed no progress
    /// at all (see [`stalled_alone`]). Returns whether the attempt waits alone.
    fn stall_point(&self, settings: &ProxySettings, endpoint: &Endpoint, started: Instant) -> bool {
        if !waiting_alone(&self.last_answer, endpoint, started) {
            return false;
        }
        if stalled_alone(&self.last_answer, endpoint, started) {
            let may_eject = super::may_eject_stalled(&self.registry, settings.max_ejected_percent);
            endpoint
                .breaker()
                .record_stall(&settings.breaker, Instant::now(), may_eject);
        }
        true
    }

    /// Runs an attempt, hedged if it has no answer in time: the first to commit wins; when both fail,
    /// the later failure is the answer. A hedge's endpoint joins `tried`.
    pub(super) async fn race(
        self: &Arc<Self>,
        sending: &Sending,
        worker: &WorkerPath,
        tried: &mut Tried,
        race: Race<'_>,
    ) -> Attempt {
        let Race {
            slot,
            request,
            template,
            hedging,
        } = race;
        let endpoint = Arc::clone(slot.outstanding.endpoint());
        let mut racer = Racer::new(self, sending, worker, template, &endpoint, hedging);
        let timing = racer.timing;
        let mut may_hedge = racer.replayable;
        let mut first = Box::pin(Arc::clone(self).attempt(sending.clone(), request, slot));
        // One timer, set to the next moment that matters: the hedge, the stall point, then each look
        // again past it.
        let timer = tokio::time::sleep_until(timing.hedge_at);
        tokio::pin!(timer);
        let (second, spent) = loop {
            let wake = if may_hedge {
                timing.hedge_at.min(sending.deadline)
            } else if !racer.stalled {
                timing.stall_at
            } else if racer.replayable && Instant::now() < sending.deadline {
                (Instant::now() + STALLED_LOOK_AGAIN).min(sending.deadline)
            } else {
                return first.await;
            };
            timer.as_mut().reset(wake);
            tokio::select! {
                outcome = &mut first => return outcome,
                () = &mut timer => {
                    let spend = if std::mem::take(&mut may_hedge) {
                        if hedging == Hedging::AtOnce {
                            Spend::Move
                        } else {
                            Spend::Hedge
                        }
                    } else {
                        // Past its stall point and still unhedged (the hedge budget was spent, or
                        // no endpoint had room then): a second attempt elsewhere beside it, as a
                        // retry, once it waits alone. Looked at again and again until the deadline:
                        // the rest of the fleet may answer only later, and room beside it (a queue
                        // emptied, a slot freed, the retry budget refilled) may come later too; an
                        // attempt left to itself would wait for its node's ejection, which may
                        // never come.
                        if !racer.alone_past_stall_point() || !racer.replayable {
                            continue;
                        }
                        Spend::Retry
                    };
                    if let Some(second) = racer.second(tried, spend) {
                        break (second, spend);
                    }
                }
            }
        };
        let (slot, request) = second;
        let mut second = Box::pin(Arc::clone(self).attempt(sending.clone(), request, slot));
        let (mut first_done, mut second_done) = (false, false);
        loop {
            tokio::select! {
                outcome = &mut first, if !first_done => match outcome {
                    Attempt::Committed(committed) => return Attempt::Committed(committed),
                    Attempt::Failed(failure) if second_done => return Attempt::Failed(failure),
                    Attempt::Failed(_) => first_done = true,
                },
                outcome = &mut second, if !second_done => match outcome {
                    Attempt::Committed(committed) => {
                        if spent != Spend::Retry {
                            self.stats.hedges_won.fetch_add(1, Ordering::Relaxed);
                        }
                        if !first_done {
                            racer.beaten(first);
                        }
                        return Attempt::Committed(committed);
                    }
                    Attempt::Failed(failure) if first_done => return Attempt::Failed(failure),
                    Attempt::Failed(_) => second_done = true,
                },
                () = tokio::time::sleep_until(timing.stall_at), if !racer.stalled && !first_done => {
                    racer.reached_stall_point();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn the_budget_allows_its_share_of_requests_and_a_small_burst() {
        let budget = HedgeBudget::default();
        assert!(!budget.withdraw(), "nothing saved yet");
        for _ in 0..1000 {
            budget.deposit(10);
        }
        let burst = (0..100).filter(|_| budget.withdraw()).count();
        assert_eq!(burst, 10, "a quiet spell saves at most ten hedges");
        let mut hedged = 0;
        for _ in 0..1000 {
            budget.deposit(10);
            hedged += usize::from(budget.withdraw());
        }
        assert_eq!(hedged, 100, "one hedge per ten requests at 10 %");
        budget.deposit(0);
        assert!(!budget.withdraw());
    }

    #[tokio::test(start_paused = true)]
    async fn hedges_fire_at_a_multiple_of_the_expected_latency_and_never_before_the_floor() {
        let settings = ProxySettings::from_config(&Config::default());
        let now = Instant::now();
        let fast = Timing::new(&settings, now, ms(10), Some(ms(10)), Hedging::WhenLate);
        assert_eq!(fast.hedge_at - now, Duration::from_millis(250), "the floor");
        assert_eq!(
            fast.stall_at - now,
            Duration::from_millis(500),
            "twice the hedge delay"
        );
        let slow = Timing::new(&settings, now, ms(400), Some(ms(400)), Hedging::WhenLate);
        assert_eq!(
            slow.hedge_at - now,
            Duration::from_millis(1200),
            "3 x 400 ms"
        );
        assert_eq!(
            slow.stall_at - now,
            Duration::from_millis(2400),
            "6 x 400 ms, and twice the hedge delay"
        );
        // A node slower than the fleet, idle long enough that its estimate drifted back to the
        // fleet's: hedged at the fleet's pace, judged by its own.
        let drifted = Timing::new(&settings, now, ms(100), Some(ms(1000)), Hedging::WhenLate);
        assert_eq!(drifted.hedge_at - now, ms(300));
        assert_eq!(drifted.stall_at - now, ms(6000));
        // A node that never answered: hedged at the fleet's pace, not judged before
        // stream.first_token_idle (10 s).
        let new = Timing::new(&settings, now, ms(100), None, Hedging::WhenLate);
        assert_eq!(new.hedge_at - now, ms(300));
        assert_eq!(new.stall_at - now, Duration::from_secs(10));
        // A planned move races at once; its stall point is a late hedge's.
        let moving = Timing::new(&settings, now, ms(400), Some(ms(400)), Hedging::AtOnce);
        assert_eq!(moving.hedge_at, now);
        assert_eq!(moving.stall_at, slow.stall_at);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stall_counts_only_when_the_rest_of_the_fleet_answered_meanwhile() {
        let endpoint = Endpoint::new(
            1,
            "http://a:1",
            crate::config::EndpointUrl::parse("http://a:1").unwrap(),
            1,
        );
        let fleet = AtomicU64::new(0);
        // The millisecond clock starts at its first reading: read it before the start, as the proxy
        // has long before any attempt, or a test run alone would see the start as its epoch.
        crate::endpoint::millis(Instant::now());
        let started = Instant::now();
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(
            !stalled_alone(&fleet, &endpoint, started),
            "nobody answered"
        );
        let later = crate::endpoint::millis(Instant::now());
        fleet.store(later, Ordering::Relaxed);
        assert!(
            stalled_alone(&fleet, &endpoint, started),
            "others answered, it did not"
        );
        // A token of a stream it holds: it is busy, not hung, though this attempt waits alone.
        endpoint.pace().heard(later);
        assert!(
            !stalled_alone(&fleet, &endpoint, started),
            "it showed progress too"
        );
        assert!(
            waiting_alone(&fleet, &endpoint, started),
            "worth a second attempt"
        );
        endpoint
            .latency()
            .observe(Duration::from_millis(5), later, 10_000);
        assert!(!waiting_alone(&fleet, &endpoint, started), "it answered");
    }
}
