//! The queue where requests wait when no endpoint can take them: every endpoint at its concurrency
//! limit, cooling down, or none available yet.
//!
//! One queue for the process (all workers), ordered by priority and FIFO within a priority. A request
//! leaves it the moment an endpoint frees a slot: the slot's release wakes the first waiter
//! ([`Queue::wake_one`]), which picks again; if it gets a slot, it wakes the next in turn, in case more
//! capacity came free at once. Nothing polls, except that the waiter at the head of the queue looks
//! again every [`HEAD_RECHECK`], for capacity that returns by the clock rather than by a release (a
//! cooldown or an ejection ending, a heartbeat passing).
//!
//! Within a priority, tenants take turns (weighted fair queueing): each waiter's place is a virtual
//! finish time, its tenant's previous one (or the queue's virtual clock, if later) plus
//! `1 ÷ weight`, and the clock moves to the finish time of each request admitted (self-clocked fair
//! queueing). A tenant that floods the queue so waits behind its own requests, while another's next
//! request lines up just after the clock. Without tenants every request is the same one tenant's, and
//! the order is arrival order.
//!
//! Under sustained overload the queue keeps waits near `queue.target_wait`: once arrivals have
//! expected to wait longer for `queue.overload_after`, those expected past the target are refused at
//! once (see [`standing`]); a burst the fleet drains sooner still queues.
//!
//! A full queue answers at once. A higher-priority arrival displaces the newest waiter of the lowest
//! priority below its own. While the oldest waiter has waited longer than `shed_low_priority_after`,
//! low-priority arrivals are refused at once.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::config::QueueConfig;

mod drain;
mod kinds;
pub mod standing;
mod tenant;
mod ticket;
use drain::DrainMeter;
pub use kinds::{Priority, Refusal};
pub use standing::{Fleet, Outlook};
use standing::{Standing, Target};
pub use tenant::{InFlight, Place, TENANT_CLASSES, Tenant, TenantSettings};
pub use ticket::{Ticket, Waited};

/// How often the waiter at the head of the queue looks for capacity that came back by the clock.
pub const HEAD_RECHECK: Duration = Duration::from_millis(100);

/// Settings the queue reads; replaced whole on reload.
#[derive(Clone, Debug, PartialEq)]
pub struct QueueSettings {
    pub max_length: usize,
    pub max_wait: Duration,
    pub shed_after: Duration,
    /// The wait while the pool has no endpoint at all.
    pub max_wait_no_endpoints: Duration,
    /// The wait kept to under sustained overload (see [`standing`]).
    pub target: Target,
}

impl QueueSettings {
    pub fn from_config(config: &QueueConfig) -> QueueSettings {
        QueueSettings {
            max_length: config.max_length,
            max_wait: config.max_wait.get(),
            shed_after: config.shed_low_priority_after.get(),
            max_wait_no_endpoints: config
                .max_wait_no_endpoints
                .map_or(config.max_wait.get(), |wait| wait.get()),
            target: Target {
                wait: config.target_wait.get().min(config.max_wait.get()),
                after: config.overload_after.get(),
            },
        }
    }
}

impl Default for QueueSettings {
    fn default() -> Self {
        QueueSettings::from_config(&QueueConfig::default())
    }
}

/// Counters of the queue.
#[derive(Debug, Default)]
pub struct QueueStats {
    /// Requests that joined the queue.
    pub enqueued: AtomicU64,
    /// Requests that left it for an endpoint.
    pub admitted: AtomicU64,
    /// Total time admitted requests waited, in microseconds.
    pub wait_us: AtomicU64,
    /// Refusals by reason, in [`Refusal::ALL`] order.
    pub rejected: [AtomicU64; 6],
}

impl QueueStats {
    pub fn rejected(&self, reason: Refusal) -> u64 {
        self.rejected
            .get(reason as usize)
            .map_or(0, |count| count.load(Ordering::Relaxed))
    }
}

/// Position in the queue: priority first, then virtual finish time (see the module's doc), then
/// arrival order.
type Key = (Priority, u64, u64);

/// Virtual time one request of weight 1 takes; a tenant of weight `w` takes `FAIR_UNIT ÷ w`.
const FAIR_UNIT: u64 = 1 << 20;

/// What a waiter is told.
#[derive(Debug)]
enum Wake {
    /// Capacity came free: pick again.
    Go,
    /// Displaced by a higher-priority arrival.
    Shed,
}

struct Entry {
    wake: oneshot::Sender<Wake>,
    since: Instant,
}

struct State {
    entries: BTreeMap<Key, Entry>,
    /// Woken requests still deciding (looking for a slot): out of `entries`, yet still in line.
    looking: BTreeSet<Key>,
    /// Those of them a release came for while they looked: they look again before they wait, so a
    /// request ahead in line never loses a slot to one behind it that happened to be waiting.
    missed: BTreeMap<Key, u32>,
    next_seq: u64,
    /// The virtual clock: the finish time of the request admitted last.
    clock: u64,
    /// Each tenant's last finish time ([`State::nobody`] for requests without a tenant); emptied when
    /// the queue is.
    finish: HashMap<Arc<str>, u64>,
    /// The name requests without a tenant are queued under (made once, not per request).
    nobody: Arc<str>,
    settings: QueueSettings,
    drain: DrainMeter,
    standing: Standing,
}

impl State {
    /// The finish time a request of `place` joining now gets (and with `take`, keeps for its tenant).
    fn finish_time(&mut self, place: &Place, take: bool) -> u64 {
        let (name, weight) = match &place.tenant {
            Some(tenant) => (Arc::clone(tenant.name()), tenant.settings().weight),
            None => (Arc::clone(&self.nobody), 1),
        };
        let last = self.finish.get(&name).copied().unwrap_or(0);
        let finish = last.max(self.clock) + FAIR_UNIT / u64::from(weight.max(1));
        if take {
            self.finish.insert(name, finish);
        }
        finish
    }
}

/// The process-wide queue.
pub struct Queue {
    state: Mutex<State>,
    /// Entries in the queue, readable without the lock (a release checks it on every request).
    waiting: AtomicUsize,
    stats: QueueStats,
}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue")
            .field("waiting", &self.len())
            .finish_non_exhaustive()
    }
}

impl Default for Queue {
    fn default() -> Self {
        Queue::new(QueueSettings::default())
    }
}

impl Queue {
    pub fn new(settings: QueueSettings) -> Queue {
        Queue {
            state: Mutex::new(State {
                entries: BTreeMap::new(),
                looking: BTreeSet::new(),
                missed: BTreeMap::new(),
                next_seq: 0,
                clock: 0,
                finish: HashMap::new(),
                nobody: Arc::from(""),
                settings,
                drain: DrainMeter::new(),
                standing: Standing::default(),
            }),
            waiting: AtomicUsize::new(0),
            stats: QueueStats::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn set_settings(&self, settings: QueueSettings) {
        self.lock().settings = settings;
    }

    pub fn settings(&self) -> QueueSettings {
        self.lock().settings.clone()
    }

    /// Requests waiting right now.
    pub fn len(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn stats(&self) -> &QueueStats {
        &self.stats
    }

    /// Counts a refusal.
    pub fn count_rejection(&self, reason: Refusal) {
        if let Some(count) = self.stats.rejected.get(reason as usize) {
            count.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Joins the queue as a request of no tenant (see [`Queue::join_as`]).
    pub fn join(&self, priority: Priority) -> Result<Ticket<'_>, Refusal> {
        self.join_as(&Place::new(priority))
    }

    /// Joins the queue, or says at once why not.
    pub fn join_as(&self, place: &Place) -> Result<Ticket<'_>, Refusal> {
        let priority = place.priority;
        let now = Instant::now();
        let mut state = self.lock();
        let max_length = state.settings.max_length;
        if max_length == 0 {
            return Err(Refusal::QueueFull);
        }
        if priority == Priority::Low
            && let Some(oldest) = state.entries.values().map(|e| e.since).min()
            && now.saturating_duration_since(oldest) > state.settings.shed_after
        {
            return Err(Refusal::ShedLowPriority);
        }
        if let Some(tenant) = &place.tenant
            && !tenant.join_queue()
        {
            return Err(Refusal::TenantQueueFull);
        }
        if state.entries.len() >= max_length {
            // The last waiter of the lowest priority present makes room, if that is below ours: the
            // newest of the tenant furthest ahead of its share.
            match state.entries.last_key_value() {
                Some((&key, _)) if key.0 > priority => {
                    if let Some(victim) = state.entries.remove(&key) {
                        self.waiting.fetch_sub(1, Ordering::SeqCst);
                        let _ = victim.wake.send(Wake::Shed);
                    }
                }
                _ => {
                    if let Some(tenant) = &place.tenant {
                        tenant.leave_queue();
                    }
                    return Err(Refusal::QueueFull);
                }
            }
        }
        let key = (priority, state.finish_time(place, true), state.next_seq);
        state.next_seq += 1;
        let (wake, woken) = oneshot::channel();
        state.entries.insert(key, Entry { wake, since: now });
        state.drain.occupied(now);
        self.waiting.fetch_add(1, Ordering::SeqCst);
        self.stats.enqueued.fetch_add(1, Ordering::Relaxed);
        Ok(Ticket {
            queue: self,
            tenant: place.tenant.clone(),
            key,
            since: now,
            woken: Some(woken),
            in_queue: true,
            go: false,
            missed: 0,
        })
    }

    /// Capacity came free: the first waiter may pick again. Cheap when nobody waits.
    pub fn wake_one(&self) {
        if self.waiting.load(Ordering::SeqCst) == 0 {
            return;
        }
        let mut state = self.lock();
        // A request ahead of every waiter is looking already: the slot is its, once it looks again.
        if let Some(&first) = state.looking.first()
            && state
                .entries
                .first_key_value()
                .is_none_or(|(key, _)| first < *key)
        {
            *state.missed.entry(first).or_default() += 1;
            return;
        }
        while let Some((key, entry)) = state.entries.pop_first() {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            if entry.wake.send(Wake::Go).is_ok() {
                state.looking.insert(key);
                break;
            }
        }
    }

    /// Wakes the first waiter behind `key`: a woken request that could not use the slot (a retry that
    /// must not go back to the endpoint that freed it) hands the wake down the line.
    fn wake_after(&self, key: Key) {
        if self.waiting.load(Ordering::SeqCst) == 0 {
            return;
        }
        let mut state = self.lock();
        loop {
            let Some(next) = state
                .entries
                .range((std::ops::Bound::Excluded(key), std::ops::Bound::Unbounded))
                .next()
                .map(|(k, _)| *k)
            else {
                return;
            };
            if let Some(entry) = state.entries.remove(&next) {
                self.waiting.fetch_sub(1, Ordering::SeqCst);
                if entry.wake.send(Wake::Go).is_ok() {
                    state.looking.insert(next);
                    return;
                }
            }
        }
    }

    /// How long a request of `priority` joining now would wait, at the rate the queue has been draining:
    /// those ahead of it (its priority and higher) plus itself, over handoffs per second. `None` while
    /// nothing has drained lately (no basis for a guess).
    pub fn expected_wait(&self, place: &Place) -> Option<Duration> {
        let now = Instant::now();
        let mut state = self.lock();
        let rate = state.drain.rate(now);
        if rate <= 0.01 {
            return None;
        }
        let finish = state.finish_time(place, false);
        let ahead = state
            .entries
            .range(..(place.priority, finish, u64::MAX))
            .count() as f64;
        Some(Duration::from_secs_f64((ahead + 1.0) / rate))
    }

    /// What a request of `place` arriving now may expect: its wait at the rate the queue drains (see
    /// [`Queue::expected_wait`]), and whether the queue, standing above `target_wait`, refuses it
    /// (`fleet`: whether an endpoint is out, and whether the fleet said lately that it is full; see
    /// [`standing`]).
    pub fn outlook(&self, place: &Place, fleet: Fleet) -> Outlook {
        let expected = self.expected_wait(place);
        let mut state = self.lock();
        let target = state.settings.target;
        let overloaded = state
            .standing
            .arrival(Instant::now(), expected, target, fleet);
        Outlook {
            expected,
            overloaded,
        }
    }

    /// Whether the queue stands above `target_wait` (see [`standing`]).
    pub fn is_standing(&self) -> bool {
        self.lock().standing.is_standing()
    }

    /// Seconds a refused client should wait before trying again: how long the queue, at the rate it has
    /// been draining, takes to serve everyone ahead plus this client; `max_wait` when it is not draining.
    pub fn retry_after(&self) -> u64 {
        let now = Instant::now();
        let mut state = self.lock();
        let rate = state.drain.rate(now);
        let max = state.settings.max_wait.as_secs().max(1);
        if rate <= 0.01 {
            return max;
        }
        let ahead = state.entries.len() as f64 + 1.0;
        ((ahead / rate).ceil() as u64).clamp(1, max)
    }

    /// Whether `key` is first in line: first of those waiting, and behind none still looking.
    fn is_head(&self, key: Key) -> bool {
        let state = self.lock();
        state
            .entries
            .first_key_value()
            .is_some_and(|(first, _)| *first == key)
            && state.looking.first().is_none_or(|looking| key < *looking)
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn queue(max_length: usize) -> Queue {
        Queue::new(QueueSettings {
            max_length,
            max_wait: Duration::from_secs(10),
            shed_after: Duration::from_secs(1),
            max_wait_no_endpoints: Duration::from_secs(10),
            target: Target {
                wait: Duration::ZERO,
                after: Duration::ZERO,
            },
        })
    }

    #[test]
    fn priorities_parse_leniently() {
        let parse = |v: &'static str| Priority::from_header(Some(&HeaderValue::from_static(v)));
        assert_eq!(parse("high"), Priority::High);
        assert_eq!(parse("LOW"), Priority::Low);
        assert_eq!(parse("urgent"), Priority::Normal);
        assert_eq!(Priority::from_header(None), Priority::Normal);
    }

    /// A release that comes while the first in line is still looking (woken by a wake passed on, say)
    /// is its, not the next waiter's: it looks again at once instead of going back to wait.
    #[tokio::test]
    async fn a_release_during_a_look_stays_with_the_first_in_line() {
        let q = queue(10);
        let mut first = q.join(Priority::Normal).unwrap();
        let mut behind = q.join(Priority::Low).unwrap();
        q.wake_one();
        let until = Instant::now() + Duration::from_secs(1);
        assert_eq!(first.wait(until).await, Waited::Go);
        // It looks and finds nothing; meanwhile a slot frees.
        q.wake_one();
        assert!(
            behind.woken.as_mut().unwrap().try_recv().is_err(),
            "the waiter behind was not woken"
        );
        first.requeue();
        assert_eq!(
            first.wait(until).await,
            Waited::Go,
            "it looks again at once"
        );
        // It leaves without using that release: the waiter behind gets it.
        drop(first);
        assert_eq!(behind.wait(until).await, Waited::Go);
    }

    /// Whether `ticket` has no wake waiting for it.
    fn not_woken(ticket: &mut Ticket<'_>) -> bool {
        ticket
            .woken
            .as_mut()
            .is_some_and(|woken| woken.try_recv().is_err())
    }

    /// Two in line; the first woken, and while its look finds nothing, two wakes more (its slot
    /// freed, and a heartbeat's wake): it looks again at once, alone.
    async fn looking_again_after_two_wakes(q: &Queue, until: Instant) -> (Ticket<'_>, Ticket<'_>) {
        let mut first = q.join(Priority::Normal).unwrap();
        let mut behind = q.join(Priority::Normal).unwrap();
        q.wake_one();
        assert_eq!(first.wait(until).await, Waited::Go);
        q.wake_one();
        q.wake_one();
        first.requeue();
        assert!(not_woken(&mut behind), "the one behind looks beside it");
        assert_eq!(first.wait(until).await, Waited::Go, "it looks again");
        assert!(not_woken(&mut behind));
        (first, behind)
    }

    /// Wakes that come while the first in line looks stay with it until that look is done. Handed
    /// down at once, the second set the one behind looking beside it for one freed slot, and the
    /// quicker took it out of turn.
    #[tokio::test]
    async fn wakes_that_come_during_a_look_wait_for_it_to_end() {
        let q = queue(10);
        let until = Instant::now() + Duration::from_secs(1);
        // Its second look takes the slot: it leaves, and the wake it held goes to the one behind.
        let (mut first, mut behind) = looking_again_after_two_wakes(&q, until).await;
        first.go = false;
        first.admitted();
        assert_eq!(behind.wait(until).await, Waited::Go);
        drop(behind);
        // Its second look finds nothing either: back in line, first, and the one behind may look.
        let (mut first, mut behind) = looking_again_after_two_wakes(&q, until).await;
        first.requeue();
        assert!(first.is_head(), "it kept its place");
        assert_eq!(behind.wait(until).await, Waited::Go, "no wake stranded");
    }

    #[tokio::test]
    async fn wakes_in_priority_order_then_fifo() {
        let q = queue(10);
        let mut tickets = vec![
            ("low".to_owned(), q.join(Priority::Low).unwrap()),
            ("normal-1".to_owned(), q.join(Priority::Normal).unwrap()),
            ("normal-2".to_owned(), q.join(Priority::Normal).unwrap()),
            ("high".to_owned(), q.join(Priority::High).unwrap()),
        ];
        assert_eq!(q.len(), 4);
        assert_eq!(
            admit_in_order(&q, &mut tickets, 4),
            ["high", "normal-1", "normal-2", "low"]
        );
        assert_eq!(q.len(), 0);
    }

    fn tenant(name: &str, weight: u32) -> Place {
        Place {
            priority: Priority::Normal,
            tenant: Some(Tenant::new(
                name,
                TenantSettings {
                    weight,
                    ..TenantSettings::default()
                },
            )),
        }
    }

    /// Wakes the queue `n` times, each woken request admitted; their names in order.
    fn admit_in_order(q: &Queue, tickets: &mut Vec<(String, Ticket<'_>)>, n: usize) -> Vec<String> {
        let mut order = Vec::new();
        for _ in 0..n {
            q.wake_one();
            let woken = tickets.iter_mut().position(|(_, ticket)| {
                ticket
                    .woken
                    .as_mut()
                    .is_some_and(|woken| matches!(woken.try_recv(), Ok(Wake::Go)))
            });
            let (name, mut ticket) = tickets.remove(woken.expect("one woken"));
            order.push(name);
            // It took the slot: it passes no wake on.
            ticket.go = false;
            ticket.admitted();
        }
        order
    }

    #[tokio::test]
    async fn tenants_take_turns_by_weight_and_a_flood_waits_behind_itself() {
        let q = queue(100);
        let (a, b, c) = (tenant("a", 1), tenant("b", 1), tenant("c", 2));
        let mut tickets: Vec<(String, Ticket<'_>)> = Vec::new();
        for i in 1..=4 {
            tickets.push((format!("a{i}"), q.join_as(&a).unwrap()));
        }
        for i in 1..=2 {
            tickets.push((format!("b{i}"), q.join_as(&b).unwrap()));
        }
        assert_eq!(
            admit_in_order(&q, &mut tickets, 6),
            ["a1", "b1", "a2", "b2", "a3", "a4"],
            "b's requests do not wait behind a's flood"
        );

        // Weight 2 takes two turns to weight 1's.
        for i in 1..=2 {
            tickets.push((format!("a{i}"), q.join_as(&a).unwrap()));
        }
        for i in 1..=4 {
            tickets.push((format!("c{i}"), q.join_as(&c).unwrap()));
        }
        assert_eq!(
            admit_in_order(&q, &mut tickets, 6),
            ["c1", "a1", "c2", "c3", "a2", "c4"]
        );

        // A tenant arriving late starts at the clock, not ahead of those already served.
        for i in 1..=4 {
            tickets.push((format!("a{i}"), q.join_as(&a).unwrap()));
        }
        assert_eq!(admit_in_order(&q, &mut tickets, 2), ["a1", "a2"]);
        tickets.push(("b1".into(), q.join_as(&b).unwrap()));
        assert_eq!(admit_in_order(&q, &mut tickets, 3), ["a3", "b1", "a4"]);
        assert_eq!(q.len(), 0);
        for place in [&a, &b, &c] {
            assert_eq!(place.tenant.as_ref().unwrap().queued(), 0);
        }
    }

    #[tokio::test]
    async fn a_tenant_at_its_queue_cap_is_refused_and_leaves_room_for_others() {
        let q = queue(100);
        let capped = Place {
            priority: Priority::Normal,
            tenant: Some(Tenant::new(
                "capped",
                TenantSettings {
                    max_queued: 2,
                    ..TenantSettings::default()
                },
            )),
        };
        let first = q.join_as(&capped).unwrap();
        let _second = q.join_as(&capped).unwrap();
        assert_eq!(q.join_as(&capped).err(), Some(Refusal::TenantQueueFull));
        assert!(q.join_as(&tenant("other", 1)).is_ok());
        drop(first);
        assert!(q.join_as(&capped).is_ok(), "a place came free");
        let tenant = capped.tenant.as_ref().unwrap();
        assert_eq!(tenant.refusals(), (1, 0));
        // A full queue's refusal does not keep the tenant's count.
        let small = queue(1);
        let _held = small.join(Priority::Normal).unwrap();
        let before = tenant.queued();
        assert_eq!(small.join_as(&capped).err(), Some(Refusal::QueueFull));
        assert_eq!(tenant.queued(), before);
    }

    #[tokio::test]
    async fn full_queue_refuses_or_displaces_the_newest_lowest() {
        let q = queue(2);
        let mut low_old = q.join(Priority::Low).unwrap();
        let mut low_new = q.join(Priority::Low).unwrap();
        assert_eq!(q.join(Priority::Low).err(), Some(Refusal::QueueFull));
        let _high = q.join(Priority::High).unwrap();
        assert_eq!(q.len(), 2);
        let soon = Instant::now() + Duration::from_millis(50);
        assert_eq!(low_new.wait(soon).await, Waited::Shed);
        // The older low waiter is still there; it is not the head, so it just times out.
        assert_eq!(low_old.wait(soon).await, Waited::TimedOut);
        // A normal arrival displaces the remaining low one; then the queue holds high and normal only.
        let _normal = q.join(Priority::Normal).unwrap();
        assert_eq!(low_old.wait(soon).await, Waited::Shed);
        assert_eq!(q.join(Priority::Normal).err(), Some(Refusal::QueueFull));
    }

    #[tokio::test(start_paused = true)]
    async fn low_priority_is_shed_under_congestion() {
        let q = queue(10);
        let _waiting = q.join(Priority::Normal).unwrap();
        assert!(q.join(Priority::Low).is_ok(), "not congested yet");
        tokio::time::advance(Duration::from_millis(1500)).await;
        assert_eq!(q.join(Priority::Low).err(), Some(Refusal::ShedLowPriority));
        assert!(q.join(Priority::Normal).is_ok());
    }

    #[tokio::test]
    async fn a_dropped_ticket_leaves_and_passes_its_wake_on() {
        let q = queue(10);
        let first = q.join(Priority::Normal).unwrap();
        let mut second = q.join(Priority::Normal).unwrap();
        q.wake_one();
        assert_eq!(q.len(), 1);
        // The first waiter went away without using its wake: the second gets it.
        drop(first);
        let soon = Instant::now() + Duration::from_secs(1);
        assert_eq!(second.wait(soon).await, Waited::Go);
        assert_eq!(q.len(), 0);
        second.requeue();
        assert_eq!(q.len(), 1);
        drop(second);
        assert_eq!(q.len(), 0);
    }

    #[tokio::test]
    async fn a_wake_passed_on_goes_to_the_next_in_line_not_back() {
        let q = queue(10);
        let mut first = q.join(Priority::Normal).unwrap();
        let mut second = q.join(Priority::Normal).unwrap();
        q.wake_one();
        let soon = Instant::now() + Duration::from_secs(1);
        assert_eq!(first.wait(soon).await, Waited::Go);
        assert!(first.woken_by_release());
        first.requeue();
        first.pass_on();
        assert_eq!(
            second.wait(soon).await,
            Waited::Go,
            "the second got the wake"
        );
        assert!(first.is_head(), "the first kept its place");
        assert_eq!(q.len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn retry_after_follows_the_drain_rate() {
        let q = queue(1000);
        assert_eq!(q.retry_after(), 10, "not draining: max_wait");
        let mut waiting = Vec::new();
        for _ in 0..40 {
            waiting.push(q.join(Priority::Normal).unwrap());
        }
        // Five handoffs a second for four seconds.
        for _ in 0..20 {
            q.wake_one();
            let mut ticket = waiting.remove(0);
            assert_eq!(
                ticket.wait(Instant::now() + Duration::from_secs(1)).await,
                Waited::Go
            );
            ticket.go = false;
            ticket.admitted();
            tokio::time::advance(Duration::from_millis(200)).await;
        }
        // 20 waiting at about 5 per second: about 4 s.
        let estimate = q.retry_after();
        assert!((3..=6).contains(&estimate), "{estimate}");
    }

    /// A queue used now and then drains at the pace it hands off while someone waits, not over the
    /// time it stood empty: a request behind seven others is told it waits well under a second, as it
    /// will (measured over wall time: 8 ÷ 2 per second, 4 s, past a short `max_wait`).
    #[tokio::test(start_paused = true)]
    async fn the_drain_rate_counts_only_the_time_someone_waits() {
        let q = queue(1000);
        // Ten times over five seconds: one request waits 50 ms and is handed off, then nobody waits.
        for _ in 0..10 {
            let mut ticket = q.join(Priority::Normal).unwrap();
            tokio::time::advance(Duration::from_millis(50)).await;
            q.wake_one();
            assert_eq!(
                ticket.wait(Instant::now() + Duration::from_secs(1)).await,
                Waited::Go
            );
            ticket.go = false;
            ticket.admitted();
            tokio::time::advance(Duration::from_millis(450)).await;
        }
        let ahead: Vec<_> = (0..7).map(|_| q.join(Priority::Normal).unwrap()).collect();
        let wait = q.expected_wait(&Place::new(Priority::Normal)).unwrap();
        assert!(wait < Duration::from_secs(1), "{wait:?}");
        // A queue that holds them and hands nothing off for five seconds says so.
        for _ in 0..5 {
            tokio::time::advance(Duration::from_secs(1)).await;
            q.expected_wait(&Place::new(Priority::Normal));
        }
        let stuck = q.expected_wait(&Place::new(Priority::Normal)).unwrap();
        assert!(stuck > Duration::from_secs(10), "{stuck:?}");
        drop(ahead);
    }
}
