//! Picking an endpoint over a registry snapshot, as a pipeline: which endpoints may take this request
//! (filters), what each costs (scorers, weighted and combined), then the pick (the cheapest, or the
//! cheaper of two random choices at scale). The seams are in [`score`]; each scorer is a file of its
//! own: [`expected_latency`] (`balancer.policy: expected-latency`, the default) and
//! [`least_outstanding`].
//!
//! Only eligible endpoints are picked: below their limit, not draining, healthy and not suspect by
//! heartbeats (unless the caller is in panic mode), not cooling down after back-pressure, breaker closed
//! — or half-open with its one probe slot free, which the caller must then claim. Then the pipeline's
//! own filters are asked. When every endpoint is cooling down the pick finds none and the request waits
//! in the queue. Slow start scales a new or recovered endpoint's weight from 10 % to 100 % over the
//! configured window; scorers see the scaled weight.
//!
//! Small sets (up to [`FULL_SCAN_MAX`]) are scanned fully with a random tie-break, which is exact and
//! cheap. Larger sets use the power of two choices (Mitzenmacher, "The Power of Two Choices in Randomized
//! Load Balancing", 2001): two random eligible endpoints, keep the cheaper. That is O(1) at 10,000
//! endpoints and avoids the herd behaviour of an exact scan across many proxy replicas whose views lag.
//!
//! A pick never allocates: the exclusion set is a caller-owned slice (the endpoints a retry already tried),
//! and the pipeline is built when the configuration is applied.

pub mod score;

/// Declares each scorer's module and registers the scorer under its name: one line per scorer. The
/// registered scorers form an enum, so a pick calls each statically (and inlined), not through a
/// vtable: it scores every candidate.
macro_rules! scorers {
    ($($name:literal => $module:ident::$scorer:ident,)*) => {
        $(pub mod $module;)*

        /// One of the registered scorers.
        #[derive(Debug)]
        pub enum Registered {
            $($scorer($module::$scorer),)*
        }

        impl Registered {
            #[inline]
            pub fn cost(&self, sight: &Sight<'_>, ctx: &PickContext<'_>) -> Cost {
                match self {
                    $(Registered::$scorer(scorer) => scorer.cost(sight, ctx),)*
                }
            }

            pub fn name(&self) -> &'static str {
                match self {
                    $(Registered::$scorer(scorer) => scorer.name(),)*
                }
            }

            pub fn reads(&self) -> score::Reads {
                match self {
                    $(Registered::$scorer(scorer) => scorer.reads(),)*
                }
            }
        }

        /// Every scorer by name, and how to build it.
        pub const SCORERS: &[(&str, score::MakeScorer)] =
            &[$(($name, || Registered::$scorer(<$module::$scorer>::default()))),*];
    };
}

scorers! {
    "expected-latency" => expected_latency::ExpectedLatency,
    "least-outstanding" => least_outstanding::LeastOutstanding,
    "queue" => queue::Queue,
    "kv-cache" => kv_cache::KvCache,
    "prefix" => prefix::Prefix,
    "session" => session::Session,
}

pub mod affinity;
pub mod line;
pub mod saturation;
#[cfg(test)]
mod signal_tests;

use std::cmp::Ordering;
use std::sync::{Arc, LazyLock};

use tokio::time::Instant;

pub use affinity::{Affinity, PrefixIndex, RequestKeys};
pub use line::Unlined;
pub use saturation::{Saturation, Unsaturated};
pub use score::{Cost, Filter, Pipeline, Reads, Scorer, Sight, UnknownScorer, config_problems};

use crate::config::BalancePolicy;
use crate::endpoint::{Eligibility, Endpoint, EndpointId};

/// What a pick needs besides the endpoints.
#[derive(Clone, Copy, Debug)]
pub struct PickContext<'p> {
    pub now: Instant,
    /// Slow-start window in milliseconds (0: off).
    pub slow_start_ms: u64,
    /// Panic mode: every endpoint failed its heartbeats, so heartbeats are ignored.
    pub ignore_health: bool,
    /// The filters and scorers to pick with.
    pub pipeline: &'p Pipeline,
    /// The fleet's latency estimate in microseconds, for endpoints without one of their own.
    pub fleet_latency_us: u64,
    /// Time constant of the latency estimates, milliseconds.
    pub latency_decay_ms: u64,
    /// How old the nodes' own metrics may be and still count, milliseconds (0: signals off).
    pub signals_max_age_ms: u64,
    /// What the request carries for affinity, and the pool's prefix index.
    pub keys: Option<(&'p RequestKeys, &'p PrefixIndex)>,
    /// The request's affinity as this pick works it out (set by [`pick`] itself).
    pub affinity: Option<&'p Affinity>,
}

/// `least-outstanding`, for [`PickContext::at`].
static LEAST_OUTSTANDING: LazyLock<Pipeline> =
    LazyLock::new(|| Pipeline::for_policy(BalancePolicy::LeastOutstanding));

impl PickContext<'static> {
    /// A pick at `now` by outstanding requests alone, no slow start, heartbeats respected.
    pub fn at(now: Instant) -> PickContext<'static> {
        PickContext {
            now,
            slow_start_ms: 0,
            ignore_health: false,
            pipeline: &LEAST_OUTSTANDING,
            fleet_latency_us: 1000,
            latency_decay_ms: 10_000,
            signals_max_age_ms: 0,
            keys: None,
            affinity: None,
        }
    }
}

/// An eligible endpoint and how it may be used.
pub type Picked<'a> = (&'a Arc<Endpoint>, Eligibility);

/// Largest set scanned fully; above it, power of two choices.
pub const FULL_SCAN_MAX: usize = 32;

/// Random samples a two-choice pick draws before it falls back to a scan (when most endpoints are
/// excluded or unavailable, sampling alone could miss the few eligible ones).
const MAX_SAMPLES: usize = 8;

/// Picks the eligible endpoint the pipeline finds cheapest (see the module's doc), skipping those in
/// `exclude`. `None` when no endpoint is eligible.
pub fn pick<'a>(
    endpoints: &'a [Arc<Endpoint>],
    exclude: &[EndpointId],
    ctx: &PickContext<'_>,
) -> Option<Picked<'a>> {
    let now_ms = crate::endpoint::millis(ctx.now);
    // The request's homes and prefix matches, when a scorer reads them and the request has keys.
    let affinity;
    let mut with_affinity = *ctx;
    let ctx = match ctx.keys {
        Some((keys, index)) if ctx.pipeline.uses_affinity() && !keys.is_empty() => {
            affinity = resolve(endpoints, exclude, ctx, now_ms, keys, index);
            with_affinity.affinity = Some(&affinity);
            &with_affinity
        }
        _ => ctx,
    };
    // One scorer decides by its exact cost; several by their weighted product. Each way is its own
    // monomorphised scan, so the common case pays for no combination. Without signals or affinity,
    // every scorer but the plain one scores 1: that one decides alone.
    let plain = || {
        (ctx.affinity.is_none() && ctx.signals_max_age_ms == 0)
            .then(|| ctx.pipeline.plain())
            .flatten()
    };
    match ctx.pipeline.single().or_else(plain) {
        Some(scorer) => pick_by(
            endpoints,
            exclude,
            ctx,
            now_ms,
            |sight| scorer.cost(sight, ctx),
            Cost::cmp_exact,
        ),
        None => pick_by(
            endpoints,
            exclude,
            ctx,
            now_ms,
            |sight| ctx.pipeline.weighted_product(sight, ctx),
            |a: f64, b: f64| a.total_cmp(&b),
        ),
    }
}

/// Why a pick would choose what it chooses, for operators (`POST /debug/pick`): the request's
/// affinity, the endpoints the filters keep out, and the choice. Nothing is claimed.
#[derive(Clone, Debug)]
pub struct Explained<'a> {
    pub picked: Option<&'a Arc<Endpoint>>,
    pub affinity: Affinity,
    /// Eligible endpoints the pipeline's filters keep out (saturated ones).
    pub filtered: Vec<&'a Arc<Endpoint>>,
}

/// What [`pick`] would do for a request with `keys`, and why.
pub fn explain<'a>(
    endpoints: &'a [Arc<Endpoint>],
    ctx: &PickContext<'_>,
    keys: Option<(&RequestKeys, &PrefixIndex)>,
) -> Explained<'a> {
    let now_ms = crate::endpoint::millis(ctx.now);
    let affinity = match keys {
        Some((keys, index)) => resolve(endpoints, &[], ctx, now_ms, keys, index),
        None => Affinity::default(),
    };
    let with_affinity = PickContext {
        keys: None,
        affinity: Some(&affinity),
        ..*ctx
    };
    let picked = pick(endpoints, &[], &with_affinity).map(|(endpoint, _)| endpoint);
    let filtered = endpoints
        .iter()
        .filter(|e| {
            e.eligibility(now_ms, ctx.ignore_health) != Eligibility::No && !admitted(e, ctx, now_ms)
        })
        .collect();
    Explained {
        picked,
        affinity,
        filtered,
    }
}

/// The request's affinity over the endpoints that may take it: its prefix matches, and the
/// rendezvous homes of its conversation and session among the eligible endpoints the pipeline's
/// filters admit.
fn resolve(
    endpoints: &[Arc<Endpoint>],
    exclude: &[EndpointId],
    ctx: &PickContext<'_>,
    now_ms: u64,
    keys: &RequestKeys,
    index: &PrefixIndex,
) -> Affinity {
    let blocks = keys.prompt.blocks.len();
    let mut found = Affinity {
        matches: index.matches(&keys.prompt.blocks),
        opening_share: if blocks == 0 {
            0.0
        } else {
            keys.prompt.opening_blocks.min(blocks) as f64 / blocks as f64
        },
        ..Affinity::default()
    };
    let (conversation, session) = (keys.prompt.conversation, keys.session);
    if conversation.is_none() && session.is_none() {
        return found;
    }
    // Each key's best so far. An endpoint is asked whether it may take the request only when it
    // would be a key's new best (a few times in a scan, not once per endpoint), which gives the same
    // homes as asking every endpoint first.
    let mut best_conversation = (f64::NEG_INFINITY, None);
    let mut best_session = (f64::NEG_INFINITY, None);
    for endpoint in endpoints {
        let mut may_take: Option<bool> = None;
        let mut may = |endpoint: &Endpoint| {
            *may_take.get_or_insert_with(|| {
                !exclude.contains(&endpoint.id()) && admitted(endpoint, ctx, now_ms)
            })
        };
        for (key, best) in [
            (conversation, &mut best_conversation),
            (session, &mut best_session),
        ] {
            let Some(key) = key else { continue };
            let score = affinity::rendezvous(key, endpoint);
            if score > best.0 && may(endpoint) {
                *best = (score, Some(endpoint.id()));
            }
        }
    }
    found.conversation_home = best_conversation.1;
    found.session_home = best_session.1;
    found
}

/// Whether the endpoint could take a request now but the pipeline's filters keep it out (it is
/// saturated by its own metrics): a request may wait for it.
pub fn filtered_out(endpoint: &Endpoint, ctx: &PickContext<'_>) -> bool {
    let now_ms = crate::endpoint::millis(ctx.now);
    endpoint.eligibility(now_ms, ctx.ignore_health) != Eligibility::No
        && !ctx.pipeline.admits(&sight(endpoint, ctx, now_ms), ctx)
}

/// Whether the endpoint may take a request now: eligible, and admitted by the pipeline's filters.
fn admitted(endpoint: &Endpoint, ctx: &PickContext<'_>, now_ms: u64) -> bool {
    if endpoint.eligibility(now_ms, ctx.ignore_health) == Eligibility::No {
        return false;
    }
    ctx.pipeline.admits(&sight(endpoint, ctx, now_ms), ctx)
}

/// What the pick sees of an endpoint.
#[inline]
fn sight<'e>(endpoint: &'e Endpoint, ctx: &PickContext<'_>, now_ms: u64) -> Sight<'e> {
    let outstanding = endpoint.outstanding();
    let engine = endpoint
        .signals()
        .now(now_ms, ctx.signals_max_age_ms, outstanding);
    Sight {
        endpoint,
        now_ms,
        weight: endpoint.effective_weight(now_ms, ctx.slow_start_ms),
        outstanding,
        engine,
        load: engine.map_or(outstanding, |now| now.in_node.max(outstanding)),
    }
}

/// The pick, with `cost` giving each eligible candidate's cost and `order` comparing two.
fn pick_by<'a, K: Copy>(
    endpoints: &'a [Arc<Endpoint>],
    exclude: &[EndpointId],
    ctx: &PickContext<'_>,
    now_ms: u64,
    cost: impl Fn(&Sight<'_>) -> K,
    order: fn(K, K) -> Ordering,
) -> Option<Picked<'a>> {
    let scan = Scan {
        exclude,
        ctx,
        now_ms,
        cost,
        order,
    };
    if endpoints.len() <= FULL_SCAN_MAX {
        scan.full(endpoints)
    } else {
        scan.two_choices(endpoints)
    }
}

/// An eligible candidate and its cost.
struct Candidate<'a, K> {
    endpoint: &'a Arc<Endpoint>,
    eligibility: Eligibility,
    cost: K,
}

/// One pick's look over the endpoints.
struct Scan<'x, 'p, F, K> {
    exclude: &'x [EndpointId],
    ctx: &'x PickContext<'p>,
    now_ms: u64,
    cost: F,
    order: fn(K, K) -> Ordering,
}

impl<F: Fn(&Sight<'_>) -> K, K: Copy> Scan<'_, '_, F, K> {
    /// Filters, then scores, one endpoint.
    fn candidate<'a>(&self, endpoint: &'a Arc<Endpoint>) -> Option<Candidate<'a, K>> {
        if self.exclude.contains(&endpoint.id()) {
            return None;
        }
        let ctx = self.ctx;
        let eligibility = endpoint.eligibility(self.now_ms, ctx.ignore_health);
        if eligibility == Eligibility::No {
            return None;
        }
        let sight = sight(endpoint, ctx, self.now_ms);
        if !ctx.pipeline.admits(&sight, ctx) {
            return None;
        }
        Some(Candidate {
            endpoint,
            eligibility,
            cost: (self.cost)(&sight),
        })
    }

    fn full<'a>(&self, endpoints: &'a [Arc<Endpoint>]) -> Option<Picked<'a>> {
        let mut best: Option<Candidate<'a, K>> = None;
        let mut ties = 0u32;
        for endpoint in endpoints {
            let Some(candidate) = self.candidate(endpoint) else {
                continue;
            };
            match &best {
                Some(current) => match (self.order)(candidate.cost, current.cost) {
                    Ordering::Less => {
                        best = Some(candidate);
                        ties = 1;
                    }
                    Ordering::Equal => {
                        // Reservoir sampling: each of the k tied endpoints ends up chosen with
                        // probability 1/k.
                        ties += 1;
                        if fastrand::u32(..ties) == 0 {
                            best = Some(candidate);
                        }
                    }
                    Ordering::Greater => {}
                },
                None => {
                    best = Some(candidate);
                    ties = 1;
                }
            }
        }
        best.map(|c| (c.endpoint, c.eligibility))
    }

    fn two_choices<'a>(&self, endpoints: &'a [Arc<Endpoint>]) -> Option<Picked<'a>> {
        let mut first: Option<Candidate<'a, K>> = None;
        // The request's homes and best prefix match, when it has them, are always among the choices:
        // sampling alone would find them one time in thousands.
        if let Some(affinity) = self.ctx.affinity {
            let wanted = [
                affinity.session_home,
                affinity.conversation_home,
                affinity.matches.best().map(|m| m.endpoint),
            ];
            for id in wanted.into_iter().flatten() {
                let Some(endpoint) = endpoints.iter().find(|e| e.id() == id) else {
                    continue;
                };
                if let Some(candidate) = self.candidate(endpoint) {
                    first = Some(match first {
                        Some(chosen) if (self.order)(chosen.cost, candidate.cost).is_le() => chosen,
                        _ => candidate,
                    });
                }
            }
        }
        for _ in 0..MAX_SAMPLES {
            let endpoint = &endpoints[fastrand::usize(..endpoints.len())];
            let Some(second) = self.candidate(endpoint) else {
                continue;
            };
            match first {
                None => first = Some(second),
                Some(ref chosen) if chosen.endpoint.id() == second.endpoint.id() => {}
                Some(chosen) => {
                    let winner = match (self.order)(chosen.cost, second.cost) {
                        Ordering::Less => chosen,
                        Ordering::Greater => second,
                        Ordering::Equal if fastrand::bool() => chosen,
                        Ordering::Equal => second,
                    };
                    return Some((winner.endpoint, winner.eligibility));
                }
            }
        }
        self.full(endpoints)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::time::Duration;

    use crate::config::EndpointUrl;
    use crate::endpoint::Outstanding;

    fn ctx() -> PickContext<'static> {
        PickContext::at(Instant::now())
    }

    /// One endpoint of weight 1, for the scorers' own tests.
    pub(crate) fn endpoint(id: EndpointId) -> Endpoint {
        let url = format!("http://127.0.0.1:{}", 10_000 + id);
        Endpoint::new(id, &url, EndpointUrl::parse(&url).unwrap(), 1)
    }

    /// What a pick sees of `endpoint` holding `outstanding`, at weight 1, without signals.
    pub(crate) fn sight_of(endpoint: &Endpoint, outstanding: u64) -> Sight<'_> {
        Sight {
            endpoint,
            now_ms: 0,
            weight: 1000,
            outstanding,
            engine: None,
            load: outstanding,
        }
    }

    static EXPECTED_LATENCY: LazyLock<Pipeline> =
        LazyLock::new(|| Pipeline::for_policy(BalancePolicy::ExpectedLatency));

    fn fleet(weights: &[u32]) -> Vec<Arc<Endpoint>> {
        weights
            .iter()
            .enumerate()
            .map(|(i, &w)| {
                let url = format!("http://127.0.0.1:{}", 10_000 + i);
                let parsed = EndpointUrl::parse(&url).unwrap();
                Arc::new(Endpoint::new(i as u64, &url, parsed, w))
            })
            .collect()
    }

    /// Picks `n` requests in a row, each held open, and returns how many each endpoint got.
    fn hold(endpoints: &[Arc<Endpoint>], n: usize) -> (Vec<usize>, Vec<Outstanding>) {
        let mut counts = vec![0; endpoints.len()];
        let mut held = Vec::new();
        for _ in 0..n {
            let (chosen, _) = pick(endpoints, &[], &ctx()).unwrap();
            counts[chosen.id() as usize] += 1;
            held.push(chosen.start_request());
        }
        (counts, held)
    }

    #[test]
    fn empty_set_picks_nothing() {
        assert!(pick(&[], &[], &ctx()).is_none());
    }

    #[test]
    fn prefers_the_idle_endpoint() {
        let endpoints = fleet(&[1, 1, 1]);
        let _busy_a = endpoints[0].start_request();
        let _busy_b = endpoints[2].start_request();
        for _ in 0..50 {
            assert_eq!(pick(&endpoints, &[], &ctx()).unwrap().0.id(), 1);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_endpoint_that_stopped_answering_loses_its_share_as_its_silence_grows() {
        let endpoints = fleet(&[1, 1]);
        let now_ms = crate::endpoint::millis(Instant::now());
        for endpoint in &endpoints {
            endpoint
                .latency()
                .observe(Duration::from_millis(200), now_ms, 10_000);
        }
        let latency_ctx = || PickContext {
            pipeline: &EXPECTED_LATENCY,
            fleet_latency_us: 200_000,
            ..PickContext::at(Instant::now())
        };
        // Endpoint 0 holds one attempt that has not answered; endpoint 1 holds two that did.
        let _quiet = endpoints[0].start_request();
        let _waiting = endpoints[0].latency().start_waiting(Instant::now());
        let _answered = [endpoints[1].start_request(), endpoints[1].start_request()];
        assert_eq!(
            pick(&endpoints, &[], &latency_ctx()).unwrap().0.id(),
            0,
            "2 × 200 ms beats 3 × 200 ms while the wait is young"
        );
        tokio::time::advance(Duration::from_millis(700)).await;
        assert_eq!(
            pick(&endpoints, &[], &latency_ctx()).unwrap().0.id(),
            1,
            "700 ms of silence ranks it as a 700 ms endpoint: 2 × 700 ms > 3 × 200 ms"
        );
        let later = crate::endpoint::millis(Instant::now());
        endpoints[0]
            .latency()
            .observe(Duration::from_millis(150), later, 10_000);
        assert_eq!(
            pick(&endpoints, &[], &latency_ctx()).unwrap().0.id(),
            0,
            "an answer ends the silence"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_node_that_answers_many_at_once_keeps_its_share_until_it_slows() {
        let endpoints = fleet(&[1, 1]);
        let now_ms = crate::endpoint::millis(Instant::now());
        let ms = Duration::from_millis;
        let latency_ctx = || PickContext {
            pipeline: &EXPECTED_LATENCY,
            fleet_latency_us: 200_000,
            ..PickContext::at(Instant::now())
        };
        // Endpoint 0 is a batching GPU server: 100 ms whether it holds 1 or 8. Endpoint 1 takes 300 ms.
        for in_flight in 1..=8 {
            endpoints[0].latency().observe(ms(100), now_ms, 10_000);
            endpoints[0]
                .latency()
                .observe_at_load(ms(100), in_flight, now_ms, 10_000);
        }
        endpoints[1].latency().observe(ms(300), now_ms, 10_000);
        endpoints[1]
            .latency()
            .observe_at_load(ms(300), 1, now_ms, 10_000);
        // Tried just now (an endpoint idle and untried for the decay time is tried at once).
        drop(endpoints[1].latency().start_waiting(Instant::now()));
        let held: Vec<_> = (0..5).map(|_| endpoints[0].start_request()).collect();
        assert_eq!(
            pick(&endpoints, &[], &latency_ctx()).unwrap().0.id(),
            0,
            "at 6 in flight it still answers in 100 ms: better than an idle 300 ms node \
             (a single-worker model would say 600 ms)"
        );
        // Beyond the loads it was seen at, it is assumed to queue: at 26, 100 ms × 26 ÷ 8 = 325 ms.
        let more: Vec<_> = (0..20).map(|_| endpoints[0].start_request()).collect();
        assert_eq!(pick(&endpoints, &[], &latency_ctx()).unwrap().0.id(), 1);
        drop(more);
        // Seen slowing down at its current load (queueing inside), it loses its share.
        for _ in 0..8 {
            endpoints[0]
                .latency()
                .observe_at_load(ms(900), 6, now_ms, 10_000);
        }
        assert_eq!(pick(&endpoints, &[], &latency_ctx()).unwrap().0.id(), 1);
        drop(held);
    }

    #[test]
    fn spreads_held_requests_evenly() {
        let endpoints = fleet(&[1, 1, 1, 1]);
        let (counts, _held) = hold(&endpoints, 40);
        assert_eq!(counts, [10, 10, 10, 10]);
    }

    #[test]
    fn concurrent_load_follows_weights() {
        let endpoints = fleet(&[3, 1]);
        let (counts, _held) = hold(&endpoints, 40);
        // (o+1)/w keeps the two within one request of a 3:1 split.
        assert!((29..=31).contains(&counts[0]), "{counts:?}");
    }

    #[test]
    fn ties_are_broken_at_random() {
        let endpoints = fleet(&[1, 1, 1]);
        let mut seen = [0; 3];
        for _ in 0..300 {
            seen[pick(&endpoints, &[], &ctx()).unwrap().0.id() as usize] += 1;
        }
        assert!(seen.iter().all(|&c| c > 50), "{seen:?}");
    }

    #[test]
    fn exclusions_and_draining_are_skipped() {
        let endpoints = fleet(&[1, 1, 1]);
        endpoints[1].set_draining(true);
        for _ in 0..50 {
            assert_eq!(pick(&endpoints, &[0], &ctx()).unwrap().0.id(), 2);
        }
        assert!(pick(&endpoints, &[0, 2], &ctx()).is_none());
    }

    #[test]
    fn two_choices_at_scale_avoid_loaded_endpoints() {
        let endpoints = fleet(&vec![1; 1000]);
        // Load every endpoint but the first hundred: a two-choice pick lands on an idle one whenever one of
        // its two samples is idle, so far more often than the 10 % a random pick would.
        let _held: Vec<_> = endpoints[100..].iter().map(|e| e.start_request()).collect();
        let idle_hits = (0..2000)
            .filter(|_| pick(&endpoints, &[], &ctx()).unwrap().0.id() < 100)
            .count();
        assert!(idle_hits > 300, "{idle_hits}");
    }

    #[test]
    fn two_choices_find_the_last_eligible_endpoint() {
        let endpoints = fleet(&vec![1; 500]);
        let exclude: Vec<EndpointId> = (0..499).collect();
        for _ in 0..20 {
            assert_eq!(pick(&endpoints, &exclude, &ctx()).unwrap().0.id(), 499);
        }
    }

    #[test]
    fn unhealthy_suspect_and_cooling_endpoints_are_skipped_and_health_only_in_panic_mode() {
        let endpoints = fleet(&[1, 1, 1, 1]);
        let now = Instant::now();
        endpoints[0].set_healthy(false, now);
        endpoints[1].set_suspect(true);
        endpoints[2]
            .load()
            .cool_down(std::time::Duration::from_secs(10), now);
        for _ in 0..20 {
            assert_eq!(pick(&endpoints, &[], &ctx()).unwrap().0.id(), 3);
        }
        assert!(pick(&endpoints, &[3], &ctx()).is_none());
        let panic = PickContext {
            ignore_health: true,
            ..ctx()
        };
        let picked = pick(&endpoints, &[2, 3], &panic).unwrap().0.id();
        assert!(picked == 0 || picked == 1, "{picked}");
    }

    #[test]
    fn an_ejected_endpoint_is_skipped_then_offered_as_a_probe() {
        let endpoints = fleet(&[1, 1]);
        let now = Instant::now();
        let settings = crate::breaker::BreakerSettings::default();
        for _ in 0..settings.consecutive_failures {
            endpoints[0].breaker().record_failure(&settings, now, true);
        }
        assert!(endpoints[0].breaker().is_ejected());
        for _ in 0..20 {
            assert_eq!(pick(&endpoints, &[], &ctx()).unwrap().0.id(), 1);
        }
        // After the ejection time the endpoint is offered once more, as the breaker's probe.
        let later = PickContext::at(now + std::time::Duration::from_secs(10));
        let (endpoint, eligibility) = pick(&endpoints, &[1], &later).unwrap();
        assert_eq!((endpoint.id(), eligibility), (0, Eligibility::Probe));
    }

    #[test]
    fn slow_start_ramps_a_recovered_endpoint() {
        let endpoints = fleet(&[1, 1]);
        let window = 10_000;
        // Look long after creation; endpoints that start together do not ramp anyway.
        let now = Instant::now() + std::time::Duration::from_secs(60);
        endpoints[0].set_healthy(false, now);
        endpoints[0].set_healthy(true, now);
        let ramping = endpoints[0].effective_weight(crate::endpoint::millis(now), window);
        let steady = endpoints[1].effective_weight(crate::endpoint::millis(now), window);
        assert_eq!((ramping, steady), (100, 1000));
        let halfway = now + std::time::Duration::from_secs(5);
        assert_eq!(
            endpoints[0].effective_weight(crate::endpoint::millis(halfway), window),
            550
        );
        // Holding requests open: the ramping endpoint gets about a tenth of them.
        let ctx = PickContext {
            slow_start_ms: window,
            ..PickContext::at(now)
        };
        let mut held = Vec::new();
        let mut on_ramping = 0;
        for _ in 0..22 {
            let (chosen, _) = pick(&endpoints, &[], &ctx).unwrap();
            on_ramping += usize::from(chosen.id() == 0);
            held.push(chosen.start_request());
        }
        assert!((1..=3).contains(&on_ramping), "{on_ramping}");
    }

    /// Admits only endpoints with an odd id.
    #[derive(Debug)]
    struct OddOnly;

    impl Filter for OddOnly {
        fn name(&self) -> &'static str {
            "odd-only"
        }

        fn admits(&self, sight: &Sight<'_>, _ctx: &PickContext<'_>) -> bool {
            sight.endpoint.id() % 2 == 1
        }
    }

    #[test]
    fn a_pipelines_filters_keep_endpoints_out_of_every_pick() {
        let odd =
            Pipeline::for_policy(BalancePolicy::LeastOutstanding).with_filter(Box::new(OddOnly));
        let ctx = PickContext {
            pipeline: &odd,
            ..ctx()
        };
        // Scanned in full ...
        let few = fleet(&[1, 1, 1]);
        let _busy = few[1].start_request();
        for _ in 0..50 {
            assert_eq!(
                pick(&few, &[], &ctx).unwrap().0.id(),
                1,
                "the idle ones are even"
            );
        }
        assert!(pick(&few, &[1], &ctx).is_none());
        // ... and by two choices at scale.
        let many = fleet(&vec![1; 200]);
        for _ in 0..200 {
            assert_eq!(pick(&many, &[], &ctx).unwrap().0.id() % 2, 1);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn several_scorers_decide_by_their_weighted_sum() {
        let endpoints = fleet(&[1, 1]);
        let now_ms = crate::endpoint::millis(Instant::now());
        let ms = Duration::from_millis;
        // Endpoint 0 answers in 10 ms and holds two requests; endpoint 1 answers in 300 ms, idle.
        endpoints[0].latency().observe(ms(10), now_ms, 10_000);
        for in_flight in 1..=3 {
            endpoints[0]
                .latency()
                .observe_at_load(ms(10), in_flight, now_ms, 10_000);
        }
        endpoints[1].latency().observe(ms(300), now_ms, 10_000);
        endpoints[1]
            .latency()
            .observe_at_load(ms(300), 1, now_ms, 10_000);
        drop(endpoints[1].latency().start_waiting(Instant::now()));
        let _held = [endpoints[0].start_request(), endpoints[0].start_request()];
        let picked = |scorers: &[(&str, f64)]| {
            let pipeline = Pipeline::of(scorers).unwrap();
            let ctx = PickContext {
                pipeline: &pipeline,
                fleet_latency_us: 100_000,
                ..PickContext::at(Instant::now())
            };
            pick(&endpoints, &[], &ctx).unwrap().0.id()
        };
        assert_eq!(picked(&[("least-outstanding", 1.0)]), 1);
        assert_eq!(picked(&[("expected-latency", 1.0)]), 0);
        // Costs: least-outstanding 3 ÷ 1000 vs 1 ÷ 1000 (the weight is in thousandths); expected latency
        // in µs, 10,000 × 1.25 (two held, an eighth each) vs 300,000. Weighted, either can win.
        assert_eq!(
            picked(&[("least-outstanding", 1.0), ("expected-latency", 1.0)]),
            0
        );
        assert_eq!(
            picked(&[("least-outstanding", 1e9), ("expected-latency", 1.0)]),
            1
        );
    }
}
