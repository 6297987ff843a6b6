//! Tenants: who sent a request (the API key it presented names the tenant), and what the tenant may
//! take of the queue and of the fleet.
//!
//! A tenant is kept across reloads by name, so its in-flight and queued counts stay true while its
//! settings change. The set of tenants is fixed by the configuration (the keys file and
//! `auth.tenants`), so a plain map swapped whole on reload serves every lookup without a lock; nothing
//! is inserted per request, which is why no concurrent map is needed here.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::time::Instant;

use super::Priority;

/// What a tenant may take, from `auth.tenants` (defaults for a tenant listed only in the keys file).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TenantSettings {
    /// Its share of the queue against other tenants of the same priority.
    pub weight: u32,
    /// The priority of all its requests; the priority header is then ignored (a client cannot promote
    /// itself). `None`: the header decides.
    pub priority: Option<Priority>,
    /// Requests it may have waiting in queues at once (0: no cap of its own).
    pub max_queued: u64,
    /// Requests it may have in tongs at once, waiting or at an endpoint (0: no cap of its own).
    pub max_in_flight: u64,
}

impl Default for TenantSettings {
    fn default() -> Self {
        TenantSettings {
            weight: 1,
            priority: None,
            max_queued: 0,
            max_in_flight: 0,
        }
    }
}

/// Status classes a tenant's answers are counted by.
pub const TENANT_CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];

/// One tenant and its counts.
#[derive(Debug)]
pub struct Tenant {
    name: Arc<str>,
    settings: ArcSwap<TenantSettings>,
    queued: AtomicU64,
    in_flight: AtomicU64,
    /// Mean time its requests spend in tongs, µs (an EWMA): what a refusal for its in-flight cap
    /// computes `Retry-After` from.
    duration_us: AtomicU64,
    /// Answers by status class ([`TENANT_CLASSES`]).
    answers: [AtomicU64; 5],
    /// Refused for its own caps: queued, in flight.
    refused_queued: AtomicU64,
    refused_in_flight: AtomicU64,
}

impl Tenant {
    pub fn new(name: &str, settings: TenantSettings) -> Arc<Tenant> {
        Arc::new(Tenant {
            name: name.into(),
            settings: ArcSwap::from_pointee(settings),
            queued: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            duration_us: AtomicU64::new(0),
            answers: Default::default(),
            refused_queued: AtomicU64::new(0),
            refused_in_flight: AtomicU64::new(0),
        })
    }

    pub fn name(&self) -> &Arc<str> {
        &self.name
    }

    pub fn settings(&self) -> Arc<TenantSettings> {
        self.settings.load_full()
    }

    /// Takes reloaded settings; the counts stay.
    pub fn set_settings(&self, settings: TenantSettings) {
        if *self.settings.load_full() != settings {
            self.settings.store(Arc::new(settings));
        }
    }

    /// Requests waiting in queues now.
    pub fn queued(&self) -> u64 {
        self.queued.load(Ordering::Relaxed)
    }

    /// Requests in tongs now (waiting or at an endpoint).
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Answers so far, by status class ([`TENANT_CLASSES`] order).
    pub fn answers(&self) -> [u64; 5] {
        std::array::from_fn(|i| self.answers[i].load(Ordering::Relaxed))
    }

    /// Refusals for its own caps so far: (queued, in flight).
    pub fn refusals(&self) -> (u64, u64) {
        (
            self.refused_queued.load(Ordering::Relaxed),
            self.refused_in_flight.load(Ordering::Relaxed),
        )
    }

    /// A request of this tenant comes in: counted in flight until the guard goes (it lives in the
    /// response body), or refused with the seconds to wait when the tenant is at its cap.
    pub fn enter(self: &Arc<Self>) -> Result<InFlight, u64> {
        let cap = self.settings.load().max_in_flight;
        let taken = self
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |now| {
                (cap == 0 || now < cap).then_some(now + 1)
            });
        if taken.is_err() {
            self.refused_in_flight.fetch_add(1, Ordering::Relaxed);
            // Answered 429 at once: counted with its other answers.
            self.answers[3].fetch_add(1, Ordering::Relaxed);
            return Err(self.retry_after_in_flight(cap));
        }
        Ok(InFlight {
            tenant: Arc::clone(self),
            started: Instant::now(),
            status: 0,
        })
    }

    /// With `cap` requests in flight, each taking the tenant's mean time, one ends every
    /// `mean ÷ cap`: the wait before trying again, in whole seconds from 1 to 30.
    fn retry_after_in_flight(&self, cap: u64) -> u64 {
        let mean = Duration::from_micros(self.duration_us.load(Ordering::Relaxed));
        let per_slot = mean.as_secs_f64() / cap.max(1) as f64;
        (per_slot.ceil() as u64).clamp(1, 30)
    }

    /// Joins a queue unless the tenant already has its cap waiting.
    pub(super) fn join_queue(&self) -> bool {
        let cap = self.settings.load().max_queued;
        let joined = self
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |now| {
                (cap == 0 || now < cap).then_some(now + 1)
            })
            .is_ok();
        if !joined {
            self.refused_queued.fetch_add(1, Ordering::Relaxed);
        }
        joined
    }

    pub(super) fn leave_queue(&self) {
        let _ = self
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |now| {
                now.checked_sub(1)
            });
    }

    fn done(&self, took: Duration, status: u16) {
        let _ = self
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |now| {
                now.checked_sub(1)
            });
        let took = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        // EWMA with weight 1/8; the first sample sets it.
        let _ = self
            .duration_us
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |mean| {
                Some(if mean == 0 {
                    took
                } else {
                    mean - mean / 8 + took / 8
                })
            });
        if let Some(class) = (status / 100).checked_sub(1)
            && let Some(count) = self.answers.get(usize::from(class))
        {
            count.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// A tenant's request in tongs; dropped when its answer ends (a stream when it ends).
#[derive(Debug)]
pub struct InFlight {
    tenant: Arc<Tenant>,
    started: Instant,
    status: u16,
}

impl InFlight {
    /// The status the client is answered with, counted when the answer ends.
    pub fn answered(&mut self, status: u16) {
        self.status = status;
    }

    pub fn tenant(&self) -> &Arc<Tenant> {
        &self.tenant
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.tenant.done(self.started.elapsed(), self.status);
    }
}

/// Where a request waits: its priority, and the tenant whose share of the queue it takes.
#[derive(Clone, Debug)]
pub struct Place {
    pub priority: Priority,
    pub tenant: Option<Arc<Tenant>>,
}

impl Place {
    pub fn new(priority: Priority) -> Place {
        Place {
            priority,
            tenant: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_flight_is_capped_and_given_back_when_the_answer_ends() {
        let tenant = Tenant::new(
            "team-a",
            TenantSettings {
                max_in_flight: 2,
                ..TenantSettings::default()
            },
        );
        let mut first = tenant.enter().expect("one");
        let second = tenant.enter().expect("two");
        assert_eq!(tenant.enter().err(), Some(1), "at its cap: refused");
        assert_eq!(tenant.in_flight(), 2);
        first.answered(200);
        drop(first);
        assert_eq!(tenant.in_flight(), 1);
        let third = tenant.enter().expect("room again");
        drop((second, third));
        assert_eq!(tenant.in_flight(), 0);
        assert_eq!(tenant.answers()[1], 1, "one 2xx");
        assert_eq!(tenant.answers()[3], 1, "the refusal, a 4xx");
        assert_eq!(tenant.refusals(), (0, 1));
    }

    #[test]
    fn retry_after_follows_the_mean_time_per_slot() {
        let tenant = Tenant::new("t", TenantSettings::default());
        tenant.duration_us.store(40_000_000, Ordering::Relaxed);
        assert_eq!(tenant.retry_after_in_flight(4), 10, "40 s over 4 slots");
        assert_eq!(tenant.retry_after_in_flight(100), 1, "at least 1");
        tenant.duration_us.store(4_000_000_000, Ordering::Relaxed);
        assert_eq!(tenant.retry_after_in_flight(1), 30, "at most 30");
    }

    #[test]
    fn queued_is_capped_and_settings_change_without_losing_counts() {
        let tenant = Tenant::new(
            "t",
            TenantSettings {
                max_queued: 1,
                ..TenantSettings::default()
            },
        );
        assert!(tenant.join_queue());
        assert!(!tenant.join_queue());
        tenant.set_settings(TenantSettings {
            max_queued: 2,
            weight: 3,
            ..TenantSettings::default()
        });
        assert_eq!(tenant.queued(), 1);
        assert!(tenant.join_queue());
        tenant.leave_queue();
        tenant.leave_queue();
        tenant.leave_queue();
        assert_eq!(tenant.queued(), 0, "never below zero");
        assert_eq!(tenant.settings().weight, 3);
    }
}
