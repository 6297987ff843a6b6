//! How loaded the endpoint is and may be: outstanding requests and the slots they hold, the
//! concurrency limit (static or adaptive), and back-off the endpoint asked for.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use std::time::Duration;

use tokio::time::Instant;

use super::{Endpoint, SlotFreed, millis};
use crate::config::LimitMode;
use crate::limit::{Learned, LimitSettings, Limiter};

impl Endpoint {
    pub fn outstanding(&self) -> u64 {
        self.outstanding.load(Ordering::Relaxed)
    }

    /// Counts a request as outstanding here until the returned guard is dropped, regardless of the
    /// limit (upgrades and tests; the request path uses [`Endpoint::try_start_request`]).
    pub fn start_request(self: &Arc<Self>) -> Outstanding {
        let in_flight = self.outstanding.fetch_add(1, Ordering::Relaxed) + 1;
        self.tally.requests.fetch_add(1, Ordering::Relaxed);
        Outstanding {
            endpoint: Arc::clone(self),
            in_flight,
            first_byte: None,
        }
    }

    /// Takes one of the endpoint's slots if it is below its concurrency limit. Exact under races: two
    /// workers cannot both take the last slot.
    pub fn try_start_request(self: &Arc<Self>) -> Option<Outstanding> {
        let limit = self.limit.load(Ordering::Relaxed);
        let mut current = self.outstanding.load(Ordering::SeqCst);
        loop {
            if current >= limit {
                return None;
            }
            match self.outstanding.compare_exchange_weak(
                current,
                current + 1,
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => break,
                Err(actual) => current = actual,
            }
        }
        self.tally.requests.fetch_add(1, Ordering::Relaxed);
        Some(Outstanding {
            endpoint: Arc::clone(self),
            in_flight: current + 1,
            first_byte: None,
        })
    }

    /// Lifts a hold whose time is over at `now_ms` (see [`LoadControl::limit_back_pressure`]).
    pub(super) fn lift_hold(&self, now_ms: u64) {
        let until = self.held_until.load(Ordering::Relaxed);
        if until != 0
            && now_ms >= until
            && self
                .held_until
                .compare_exchange(until, 0, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.load()
                .store_limit(self.limits.configured.load(Ordering::Relaxed));
        }
    }

    /// Its concurrency limit and the back-off it asked for (see [`LoadControl`]).
    pub fn load(&self) -> LoadControl<'_> {
        LoadControl { endpoint: self }
    }
}

/// The load concern of one endpoint, borrowed: its concurrency limit (static, adaptive or learned, and
/// a hold after a refusal), what wakes its waiters when a slot comes free, and back-off it asked for.
/// Off the pick's path, which reads the limit and the back-off through [`Endpoint::eligibility`].
#[derive(Clone, Copy, Debug)]
pub struct LoadControl<'a> {
    endpoint: &'a Endpoint,
}

impl LoadControl<'_> {
    /// The concurrency limit in force (`None`: unlimited).
    pub fn limit(&self) -> Option<u64> {
        match self.endpoint.limit.load(Ordering::Relaxed) {
            u64::MAX => None,
            limit => Some(limit),
        }
    }

    /// What to call when a slot comes free (set once, by the registry).
    pub fn set_slot_freed(&self, slot_freed: SlotFreed) {
        let _ = self.endpoint.limits.slot_freed.set(slot_freed);
    }

    /// Applies the limit settings (on creation and on reload). An adaptive limiter keeps what it learnt
    /// when only other settings changed.
    pub fn apply_limit(&self, settings: &LimitSettings, now: Instant) {
        self.endpoint.held_until.store(0, Ordering::Relaxed);
        let cap = self
            .endpoint
            .origin
            .max_outstanding
            .unwrap_or(u64::MAX)
            .max(1);
        self.endpoint
            .limits
            .cap
            .store(settings.share(cap), Ordering::Relaxed);
        let mut limiter = self.endpoint.limits.lock();
        let limit = match settings.mode {
            LimitMode::None => {
                // A node that refused keeps its profile across a reload: it is what tongs learnt of
                // the node, not a setting (and `min_limit`/`max_limit` bound only the modes that
                // name them).
                let kept = match limiter.take() {
                    Some(Learner::Refused(kept)) => Some(kept),
                    _ => None,
                };
                let limit = kept
                    .as_ref()
                    .and_then(Learned::limit)
                    .map_or(u64::MAX, u64::from);
                *limiter = kept.map(Learner::Refused);
                self.endpoint
                    .limits
                    .configured
                    .store(u64::MAX, Ordering::Relaxed);
                limit
            }
            LimitMode::Static => {
                *limiter = None;
                let limit = settings.share(u64::from(settings.initial));
                self.endpoint
                    .limits
                    .configured
                    .store(limit, Ordering::Relaxed);
                limit
            }
            LimitMode::Adaptive => {
                let state = match limiter.take() {
                    Some(Learner::Gradient(mut kept)) => {
                        kept.set_settings(*settings);
                        kept
                    }
                    _ => Limiter::new(*settings, millis(now)),
                };
                let limit = u64::from(state.limit());
                *limiter = Some(Learner::Gradient(state));
                limit
            }
            LimitMode::Learned => {
                let state = match limiter.take() {
                    Some(Learner::Profile(mut kept)) => {
                        kept.set_bounds(settings.min, settings.max);
                        kept
                    }
                    _ => Learned::new(settings.min, settings.max),
                };
                let limit = state.limit().map_or(u64::MAX, u64::from);
                *limiter = Some(Learner::Profile(state));
                self.endpoint
                    .limits
                    .configured
                    .store(u64::MAX, Ordering::Relaxed);
                limit
            }
        };
        self.store_limit(limit);
    }

    /// Feeds the adaptive or learned limit a committed request's time to first byte.
    pub fn observe_limit_sample(&self, sample: Duration, in_flight: u64, now: Instant) {
        let mut limiter = self.endpoint.limits.lock();
        if let Some(state) = limiter.as_mut() {
            let now_ms = millis(now);
            let limit = match state {
                Learner::Gradient(gradient) => {
                    u64::from(gradient.on_sample(sample, in_flight, now_ms))
                }
                Learner::Profile(profile) | Learner::Refused(profile) => {
                    let learned = profile.on_sample(sample, in_flight, now_ms);
                    // A node that reports its own queue says when it is full (the pick's saturation
                    // filter reads it): its latency profile is kept, not enforced. A continuous
                    // batching server's first token slows as its batch grows, which the profile
                    // would take for a line forming.
                    if self
                        .endpoint
                        .signals()
                        .now(now_ms, OWN_REPORT_MS, 0)
                        .is_some()
                    {
                        u64::MAX
                    } else {
                        if profile.is_full() {
                            self.endpoint.note_full(now_ms);
                        }
                        learned.map_or(u64::MAX, u64::from)
                    }
                }
            };
            drop(limiter);
            self.store_limit(limit);
        }
    }

    /// A committed request ended `after_first` after its first byte: what the learned limit counts a
    /// request's slot held for (see [`Learned::on_end`]).
    pub fn observe_end(&self, after_first: Duration) {
        if let Some(Learner::Profile(profile) | Learner::Refused(profile)) =
            self.endpoint.limits.lock().as_mut()
        {
            profile.on_end(after_first);
        }
    }

    /// The endpoint pushed back while it still served others of ours: the adaptive limit drops at
    /// once, the learned one is capped at what the node held. Without a limit configured, the node is
    /// held to what it held (at least one) for [`HOLD`], so requests beyond what it takes wait in
    /// tongs' queue, in order, instead of each finding out by a refusal; a node still at capacity
    /// when the hold lifts refuses again and is held again. And from its first refusal such a node
    /// keeps a learned profile ([`Learner::Refused`]): a server that refuses past a line of its own
    /// would otherwise be held to its batch *and* its line, and a request sent into that line waits
    /// there for a slot on that node alone, where in tongs' queue it would take the first slot free
    /// anywhere. Once the node refuses again after its hold lifted, the profile holds it to the batch
    /// its answers show; a node that never refuses (a model server with an unbounded queue, one that
    /// reports its own) never gets one. With a static limit, the hold alone.
    pub fn limit_back_pressure(&self, now: Instant) {
        // The refused request still counts as outstanding here; the node holds the others.
        let holding = self.endpoint.outstanding().saturating_sub(1);
        let mut limiter = self.endpoint.limits.lock();
        let configured = self.endpoint.limits.configured.load(Ordering::Relaxed);
        if limiter.is_none() && configured == u64::MAX {
            *limiter = Some(Learner::Refused(
                Learned::new(1, u32::MAX).refusals_kept(HOLD.as_millis() as u64),
            ));
        }
        let limit = match limiter.as_mut() {
            Some(Learner::Gradient(state)) => {
                u64::from(state.on_back_pressure(millis(now), holding))
            }
            Some(Learner::Profile(state) | Learner::Refused(state)) => state
                .on_back_pressure(holding, millis(now))
                .map_or(u64::MAX, u64::from),
            None => {
                let until = millis(now + HOLD).max(1);
                self.endpoint.held_until.store(until, Ordering::Relaxed);
                holding
                    .max(1)
                    .min(self.endpoint.limits.configured.load(Ordering::Relaxed))
            }
        };
        drop(limiter);
        self.store_limit(limit);
    }

    fn store_limit(&self, limit: u64) {
        let limit = limit.min(self.endpoint.limits.cap.load(Ordering::Relaxed));
        let old = self.endpoint.limit.swap(limit, Ordering::Relaxed);
        if limit > old
            && let Some(slot_freed) = self.endpoint.limits.slot_freed.get()
        {
            slot_freed.call();
        }
    }

    /// Back-pressure from the endpoint: no new requests for `pause` (it is not a failure).
    pub fn cool_down(&self, pause: Duration, now: Instant) {
        let until = millis(now + pause);
        self.endpoint
            .cooldown_until
            .fetch_max(until, Ordering::Relaxed);
        self.endpoint
            .tally
            .cooldowns
            .fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            endpoint = self.endpoint.url(),
            pause_ms = pause.as_millis() as u64,
            "endpoint asked for back-off"
        );
    }

    /// Back-pressure from an endpoint still serving others of ours: counted, not paused (the caller
    /// cuts an adaptive limit instead). Logged at debug: under standing overload it happens many times
    /// a second.
    pub fn pushed_back_while_busy(&self) {
        self.endpoint
            .tally
            .cooldowns
            .fetch_add(1, Ordering::Relaxed);
        self.endpoint.note_full(millis(Instant::now()));
        tracing::debug!(
            endpoint = self.endpoint.url(),
            "busy endpoint refused a request"
        );
    }

    /// Whether the endpoint asked for back-off that has not ended at `now_ms`.
    pub fn cooling_down(&self, now_ms: u64) -> bool {
        self.endpoint.cooldown_until.load(Ordering::Relaxed) > now_ms
    }
}

/// An endpoint's concurrency limit as the configuration, its pod and the adaptive limiter set it, off
/// the pick's path (the limit in force is the endpoint's own `limit`).
#[derive(Debug)]
pub struct LimitState {
    /// What learns the limit (only with `concurrency.limit: adaptive` or `learned`).
    pub(super) limiter: Mutex<Option<Learner>>,
    /// The limit the configuration sets without an adaptive limiter (`u64::MAX`: none).
    pub(super) configured: AtomicU64,
    /// A cap on the concurrency limit, whatever the mode says: this replica's share of a pod's own
    /// annotation (see [`crate::limit::LimitSettings::share`]).
    pub(super) cap: AtomicU64,
    /// Called when a slot here comes free (wakes whoever waits for one).
    pub(super) slot_freed: OnceLock<SlotFreed>,
}

impl LimitState {
    pub(super) fn new(cap: u64) -> LimitState {
        LimitState {
            limiter: Mutex::new(None),
            configured: AtomicU64::new(u64::MAX),
            cap: AtomicU64::new(cap),
            slot_freed: OnceLock::new(),
        }
    }

    /// The unloaded latency the adaptive limiter measured, or the learned limit's baseline, in
    /// microseconds, if there is one.
    pub fn unloaded_latency_us(&self) -> Option<u64> {
        self.lock()
            .as_ref()
            .map(|learner| match learner {
                Learner::Gradient(gradient) => gradient.unloaded_us(),
                Learner::Profile(profile) | Learner::Refused(profile) => profile.baseline_us(),
            })
            .filter(|&us| us > 0)
    }

    /// The capacity the learned limit found (`None`: none yet, or another mode).
    pub fn learned_capacity(&self) -> Option<u32> {
        match self.lock().as_ref() {
            Some(Learner::Profile(profile) | Learner::Refused(profile)) => {
                Some(profile.capacity()).filter(|&c| c > 0)
            }
            _ => None,
        }
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, Option<Learner>> {
        self.limiter
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// What learns an endpoint's limit.
#[derive(Debug)]
pub enum Learner {
    /// `concurrency.limit: adaptive`: a gradient against the unloaded latency (see [`Limiter`]).
    Gradient(Limiter),
    /// `concurrency.limit: learned`: the node's latency profile by load (see [`Learned`]).
    Profile(Learned),
    /// No limit configured, but the node refused while busy: the same profile, kept from that
    /// refusal on, with a refusal standing only as long as [`HOLD`], and holding the node only from
    /// its second spell of refusals (see [`LoadControl::limit_back_pressure`]).
    Refused(Learned),
}

/// A node whose own metrics were read this recently reports its own queue (see
/// [`LoadControl::observe_limit_sample`]).
const OWN_REPORT_MS: u64 = 5_000;

/// How long a node that refused while busy is held to what it held, without an adaptive limit.
pub const HOLD: Duration = Duration::from_secs(2);

/// RAII count of one in-flight request on an endpoint.
///
/// The proxy moves it into the response body (or the upgraded-connection task), so a request stays
/// outstanding until its body has ended or the client went away — not just until headers arrived, which
/// would undercount streamed token responses that last seconds.
#[derive(Debug)]
pub struct Outstanding {
    endpoint: Arc<Endpoint>,
    /// Requests outstanding on the endpoint when this one started, itself included.
    in_flight: u64,
    /// When its answer's first byte came (`None`: not committed).
    first_byte: Option<Instant>,
}

impl Outstanding {
    pub fn endpoint(&self) -> &Arc<Endpoint> {
        &self.endpoint
    }

    pub fn in_flight_at_start(&self) -> u64 {
        self.in_flight
    }

    /// The answer's first byte came at `at`: when it ends, the time since is what the request held
    /// its slot for beyond its first byte (see [`LoadControl::observe_end`]).
    pub fn first_byte_at(&mut self, at: Instant) {
        self.first_byte = Some(at);
    }
}

impl Drop for Outstanding {
    fn drop(&mut self) {
        // SeqCst on both sides of the hand-off (this decrement then the queue's waiting count; a joiner's
        // increment of that count then its look at this one): one of the two always sees the other.
        self.endpoint.outstanding.fetch_sub(1, Ordering::SeqCst);
        if let Some(at) = self.first_byte {
            self.endpoint
                .load()
                .observe_end(Instant::now().saturating_duration_since(at));
        }
        if let Some(slot_freed) = self.endpoint.limits.slot_freed.get() {
            slot_freed.call();
        }
    }
}
