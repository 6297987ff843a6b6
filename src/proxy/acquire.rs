//! Finding an endpoint for an attempt: a pick among the endpoints not yet tried, and the queue while
//! none has room.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::attempt::Slot;
use super::retrying::Attempts;
use super::{Proxy, ProxySettings, millis_of};
use crate::admission::{Fleet, Place, Refusal, Waited};
use crate::balance::{self, PickContext, RequestKeys};
use crate::breaker::Admission;
use crate::endpoint::{Eligibility, Endpoint, EndpointId};

/// How long an endpoint's word that it is full counts as the fleet's (see
/// `admission::standing`): a few refusals' `Retry-After`, a few metrics readings.
const FULL_EVIDENCE: Duration = Duration::from_secs(5);

/// Endpoint ids a pick leaves out (no allocation; more than fit are not excluded).
#[derive(Clone, Copy, Default)]
pub(super) struct Exclude {
    ids: [EndpointId; 16],
    len: usize,
}

impl Exclude {
    pub fn push(&mut self, id: EndpointId) {
        if self.len < self.ids.len() {
            self.ids[self.len] = id;
            self.len += 1;
        }
    }

    pub fn as_slice(&self) -> &[EndpointId] {
        &self.ids[..self.len]
    }
}

/// The endpoints one request already tried, and those of them that only turned it away for being
/// busy.
#[derive(Default)]
pub(super) struct Tried {
    ids: Exclude,
    /// Busy endpoints with the requests of ours they held when they refused: such an endpoint may
    /// be tried again once it holds fewer, that is once it freed a slot (one that held none was paused
    /// for its `Retry-After`, which its eligibility already waits out). Empty (no allocation) unless a
    /// node pushed back.
    busy: Vec<(Arc<Endpoint>, u64)>,
    /// The next acquire waits in the queue before it looks.
    wait_first: bool,
    /// What the request carries for affinity (see `balance::affinity`): read once, and again from a
    /// continuation's body.
    pub keys: Option<Box<RequestKeys>>,
}

impl Tried {
    pub fn push(&mut self, id: EndpointId) {
        self.ids.push(id);
    }

    pub fn len(&self) -> usize {
        self.ids.len
    }

    /// The next attempt waits in the queue for a slot to free before it looks, as a new arrival
    /// would when the queue is not empty.
    pub fn wait_first(&mut self) {
        self.wait_first = true;
    }

    #[cfg(test)]
    pub fn waits_first(&self) -> bool {
        self.wait_first
    }

    /// `endpoint` turned the request away for being busy while it held `holding` other requests.
    pub fn mark_busy(&mut self, endpoint: &Arc<Endpoint>, holding: u64) {
        self.busy.retain(|(known, _)| known.id() != endpoint.id());
        self.busy.push((Arc::clone(endpoint), holding));
    }

    /// What a pick leaves out now: every endpoint tried, except busy ones that freed a slot since.
    fn exclusions(&self) -> Exclude {
        if self.busy.is_empty() {
            return self.ids;
        }
        let mut exclude = Exclude::default();
        for &id in self.ids.as_slice() {
            let freed = self
                .busy
                .iter()
                .any(|(busy, holding)| busy.id() == id && busy.outstanding() < (*holding).max(1));
            if !freed {
                exclude.push(id);
            }
        }
        exclude
    }

    /// Whether a busy endpoint that may free a slot is still up: worth waiting for.
    fn busy_may_free(&self) -> bool {
        self.busy.iter().any(|(busy, _)| {
            busy.liveness().is_available()
                && busy.liveness().is_healthy()
                && !busy.breaker().is_ejected()
        })
    }
}

/// What a pick found.
pub(super) enum Pick {
    Slot(Slot),
    /// Nothing now; capacity may come free.
    Wait,
    /// Nothing left to try for this request.
    Nowhere,
}

/// Why a request stops looking for an endpoint.
pub(super) enum Stop {
    Nowhere,
    Refused(Refusal),
}

impl Proxy {
    /// A slot on an endpoint not yet tried, waiting in the queue while none has one (and, after
    /// [`Tried::wait_first`], until a slot frees or the head's recheck, before the first look).
    ///
    /// A first attempt waits whenever nothing can take it (every endpoint full, cooling down, down, or
    /// none discovered yet). A retry waits only if some untried endpoint is up and merely full or cooling
    /// down; otherwise there is nowhere left to go. While others wait, a new request joins behind them
    /// rather than taking a slot that came free for the first in line.
    pub(super) async fn acquire(
        &self,
        settings: &ProxySettings,
        tried: &mut Tried,
        place: &Place,
        deadline: Instant,
        attempts: &mut Attempts,
    ) -> Result<Slot, Stop> {
        let wait_first = std::mem::take(&mut tried.wait_first);
        let queue = &self.queue;
        if queue.is_empty() && !wait_first {
            match self.pick(settings, tried) {
                Pick::Slot(slot) => return Ok(slot),
                Pick::Nowhere => return Err(Stop::Nowhere),
                Pick::Wait => {}
            }
        }
        attempts.release_answer();
        // A request the queue will not reach in time is told so now, not when its wait runs out.
        let joined = Instant::now();
        // A pool with no endpoint at all (scaling from zero) holds requests for its own wait.
        let queue_settings = queue.settings();
        let max_wait = if self.registry.snapshot().is_empty() {
            queue_settings.max_wait_no_endpoints
        } else {
            queue_settings.max_wait
        };
        if max_wait.is_zero() {
            return Err(Stop::Refused(Refusal::NoEndpoints));
        }
        let allowed = max_wait.saturating_sub(attempts.queued);
        let until = deadline.min(joined + allowed);
        // Under sustained overload, one the queue would keep past `queue.target_wait` is told now too.
        let outlook = queue.outlook(place, self.fleet());
        if outlook.overloaded {
            return Err(Stop::Refused(self.refusal(Refusal::Overloaded)));
        }
        if let Some(wait) = outlook.expected
            && Instant::now() + wait > until
        {
            return Err(Stop::Refused(self.refusal(Refusal::QueueFull)));
        }
        let mut ticket = match queue.join_as(place) {
            Ok(ticket) => ticket,
            Err(reason) => return Err(Stop::Refused(self.refusal(reason))),
        };
        let mut look = ticket.is_head() && !wait_first;
        let result = loop {
            if look {
                match self.pick(settings, tried) {
                    Pick::Slot(slot) => {
                        self.metrics.queue_wait(ticket.since().elapsed());
                        ticket.admitted();
                        break Ok(slot);
                    }
                    Pick::Nowhere => break Err(Stop::Nowhere),
                    Pick::Wait => {
                        let woken = ticket.woken_by_release();
                        ticket.requeue();
                        // A retry may have been woken by a slot on an endpoint it already tried: that
                        // slot is someone else's, so the wake goes down the line.
                        if woken && tried.len() > 0 {
                            ticket.pass_on();
                        }
                    }
                }
            }
            match ticket.wait(until).await {
                Waited::Go => look = true,
                Waited::TimedOut => break Err(Stop::Refused(self.refusal(Refusal::QueueTimeout))),
                Waited::Shed => break Err(Stop::Refused(Refusal::ShedLowPriority)),
            }
        };
        attempts.queued += joined.elapsed();
        result
    }

    /// Whether the fleet's capacity is known to be what holds requests back ([`Fleet::Full`]): an
    /// endpoint said lately that it is full (refused while busy, or saturated by its own metrics,
    /// within [`FULL_EVIDENCE`]), or the limits are the capacities someone told tongs (`static`, or
    /// every endpoint's own `max_outstanding`).
    ///
    /// Never while an endpoint is down, ejected or stalled ([`Fleet::Short`]): a fleet short of a
    /// node is an interruption, which passes (the node comes back, or is replaced), and its requests
    /// wait for it rather than being refused.
    fn fleet(&self) -> Fleet {
        let snapshot = self.registry.snapshot();
        if self.registry.counts().up() < snapshot.len() {
            return Fleet::Short;
        }
        let last = self.registry.counts().last_full_ms();
        let now_ms = crate::endpoint::millis(Instant::now());
        let full = (last != 0 && now_ms.saturating_sub(last) <= millis_of(FULL_EVIDENCE))
            || self.registry.limits().mode == crate::config::LimitMode::Static
            || (!snapshot.is_empty()
                && snapshot
                    .iter()
                    .all(|endpoint| endpoint.origin().max_outstanding.is_some()));
        if full { Fleet::Full } else { Fleet::Whole }
    }

    /// A queue refusal, named `no-endpoints` when the real cause is that no endpoint is up at all.
    fn refusal(&self, reason: Refusal) -> Refusal {
        let none_up = self.registry.counts().up() == 0;
        match reason {
            Refusal::QueueFull | Refusal::QueueTimeout | Refusal::Overloaded if none_up => {
                Refusal::NoEndpoints
            }
            other => other,
        }
    }

    /// A slot on an eligible endpoint not yet tried, or whether waiting may give one.
    ///
    /// Untried endpoints come first. An endpoint that turned this request away for being busy is
    /// offered again only when no untried one is left to take it or to wait for, and only once it
    /// freed a slot: every endpoint busy is "later", not "broken", so the request waits for the next
    /// free slot rather than failing with a busy node's refusal while capacity is about to free up.
    pub(super) fn pick(&self, settings: &ProxySettings, tried: &Tried) -> Pick {
        let now = Instant::now();
        let snapshot = self.registry.snapshot();
        let keys = tried
            .keys
            .as_deref()
            .map(|keys| (keys, self.prefix_index()));
        let mut ctx = self.pick_context(settings, now, keys);
        if let Some(slot) = self.slot_among(&snapshot, tried.ids, &mut ctx) {
            self.placed(tried, &slot);
            return Pick::Slot(slot);
        }
        // Nothing now. A first attempt waits for anything; a retry for an untried endpoint that is up
        // and merely full, cooling down or saturated by its own metrics, else for a busy one.
        if tried.len() == 0 {
            return Pick::Wait;
        }
        let now_ms = crate::endpoint::millis(now);
        let worth_waiting = snapshot.iter().any(|e| {
            !tried.ids.as_slice().contains(&e.id())
                && e.liveness().is_available()
                && e.liveness().is_healthy()
                && !e.breaker().is_ejected()
                && (e.load().limit().is_some_and(|l| e.outstanding() >= l)
                    || e.load().cooling_down(now_ms)
                    || balance::filtered_out(e, &ctx))
        });
        if worth_waiting {
            return Pick::Wait;
        }
        if tried.busy.is_empty() {
            return Pick::Nowhere;
        }
        if let Some(slot) = self.slot_among(&snapshot, tried.exclusions(), &mut ctx) {
            self.placed(tried, &slot);
            return Pick::Slot(slot);
        }
        if tried.busy_may_free() {
            Pick::Wait
        } else {
            Pick::Nowhere
        }
    }

    /// What a pick at `now` under `settings` needs besides the endpoints.
    fn pick_context<'p>(
        &self,
        settings: &'p ProxySettings,
        now: Instant,
        keys: Option<(&'p RequestKeys, &'p balance::PrefixIndex)>,
    ) -> PickContext<'p> {
        PickContext {
            now,
            slow_start_ms: millis_of(settings.balance.slow_start),
            ignore_health: false,
            pipeline: &settings.balance.pipeline,
            fleet_latency_us: self.fleet_latency_us(),
            latency_decay_ms: millis_of(settings.balance.latency_decay),
            signals_max_age_ms: self.signals_window(settings, now),
            keys,
            affinity: None,
        }
    }

    /// How old a node's own reading may be for the pick at `now`: `signals.max_age`, or 0 while no
    /// endpoint of the pool has a reading that young (no scorer then reads one, and the pick skips
    /// them).
    fn signals_window(&self, settings: &ProxySettings, now: Instant) -> u64 {
        let max_age = millis_of(settings.balance.signals_max_age);
        let last = self.registry.counts().last_reading_ms();
        if max_age == 0 || last == 0 || crate::endpoint::millis(now).saturating_sub(last) > max_age
        {
            0
        } else {
            max_age
        }
    }

    /// The request's prompt is sent to the slot's endpoint: it will hold the prompt's blocks.
    fn placed(&self, tried: &Tried, slot: &Slot) {
        if let Some(keys) = &tried.keys {
            self.prefix_index()
                .record(&keys.prompt.blocks, slot.outstanding.endpoint());
        }
    }

    /// A slot on an eligible endpoint outside `exclude`, claimed (with the breaker's probe when that is
    /// what is left).
    fn slot_among(
        &self,
        snapshot: &[Arc<Endpoint>],
        mut exclude: Exclude,
        ctx: &mut PickContext<'_>,
    ) -> Option<Slot> {
        for _ in 0..6 {
            let Some((endpoint, eligibility)) = balance::pick(snapshot, exclude.as_slice(), ctx)
            else {
                // Panic mode: when no endpoint passes its heartbeats, more likely tongs' own network or
                // the health path is broken than every node died at once, so heartbeats are ignored
                // (breakers still apply). Requests still fail fast if the nodes really are gone.
                if !ctx.ignore_health && self.registry.counts().healthy() == 0 {
                    ctx.ignore_health = true;
                    continue;
                }
                return None;
            };
            let probe = match eligibility {
                Eligibility::Yes => false,
                _ => match endpoint.breaker().admit(ctx.now) {
                    Admission::Admit => false,
                    Admission::Probe => true,
                    Admission::Reject => {
                        exclude.push(endpoint.id());
                        continue;
                    }
                },
            };
            // The pick saw room; another worker may have taken the last slot since.
            match endpoint.try_start_request() {
                Some(outstanding) => {
                    return Some(Slot {
                        outstanding,
                        probe,
                        span: None,
                    });
                }
                None => {
                    if probe {
                        endpoint.breaker().release_probe(ctx.now);
                    }
                    exclude.push(endpoint.id());
                }
            }
        }
        None
    }
}

/// What this replica's pick would do for a request, and why (`POST /debug/pick` on the admin port):
/// two replicas that answer alike place the request alike.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PickExplanation {
    /// The endpoint the pick would choose now (null: none has room; the request would wait).
    pub pick: Option<String>,
    /// The conversation's and the session's rendezvous homes among the endpoints that may take it.
    pub conversation_home: Option<String>,
    pub session_home: Option<String>,
    /// Endpoints this replica sent a prefix of the prompt to, with the share they hold.
    pub prefix_matches: Vec<(String, f64)>,
    /// Eligible endpoints the pipeline's filters keep out (saturated by their own metrics, or with
    /// a line at the load this request would make: `balance::line`).
    pub saturated: Vec<String>,
    /// The prompt's blocks, and whether it had a conversation and a session key.
    pub blocks: usize,
    pub conversation_key: bool,
    pub session_key: bool,
}

impl Proxy {
    /// What the pick would do for a request to `path` with `body` and `headers`, without sending it.
    pub fn explain(
        &self,
        path: &str,
        body: &bytes::Bytes,
        headers: &http::HeaderMap,
    ) -> PickExplanation {
        let settings = self.settings();
        let keys = super::request::affinity_keys(
            &settings,
            crate::openai::Api::of_path(path),
            Some(body),
            headers,
        );
        let snapshot = self.registry.snapshot();
        let ctx = self.pick_context(&settings, Instant::now(), None);
        let explained = balance::explain(
            &snapshot,
            &ctx,
            keys.as_deref().map(|keys| (keys, self.prefix_index())),
        );
        let url_of = |id: Option<EndpointId>| {
            id.and_then(|id| snapshot.iter().find(|e| e.id() == id))
                .map(|e| e.url().to_owned())
        };
        let prefix_matches = snapshot
            .iter()
            .filter_map(|e| {
                let share = explained.affinity.matches.share(e);
                (share > 0.0).then(|| (e.url().to_owned(), share))
            })
            .collect();
        PickExplanation {
            pick: explained.picked.map(|e| e.url().to_owned()),
            conversation_home: url_of(explained.affinity.conversation_home),
            session_home: url_of(explained.affinity.session_home),
            prefix_matches,
            saturated: explained
                .filtered
                .iter()
                .map(|e| e.url().to_owned())
                .collect(),
            blocks: keys.as_ref().map_or(0, |k| k.prompt.blocks.len()),
            conversation_key: keys
                .as_ref()
                .is_some_and(|k| k.prompt.conversation.is_some()),
            session_key: keys.as_ref().is_some_and(|k| k.session.is_some()),
        }
    }
}
