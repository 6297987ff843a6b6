//! A request's place in the queue: waiting for a wake, looking for a slot, going back to its place,
//! and passing on the wakes it cannot use, so capacity is never stranded.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::sync::oneshot;
use tokio::time::Instant;

use super::tenant::Tenant;
use super::{Entry, HEAD_RECHECK, Key, Priority, Queue, Wake};

/// A place in the queue. Dropping it leaves the queue (a client that went away), and passes on a wake
/// it received, so capacity is never stranded.
pub struct Ticket<'a> {
    pub(super) queue: &'a Queue,
    /// Counted in its tenant's queued requests until it goes.
    pub(super) tenant: Option<Arc<Tenant>>,
    pub(super) key: Key,
    pub(super) since: Instant,
    pub(super) woken: Option<oneshot::Receiver<Wake>>,
    pub(super) in_queue: bool,
    /// A wake was received (the entry was taken out of the queue by whoever woke it).
    pub(super) go: bool,
    /// Releases that came for this request while it looked, held until its next look is done, and
    /// passed on when it leaves or goes back to wait.
    pub(super) missed: u32,
}

/// What a wait came to.
#[derive(Debug, PartialEq, Eq)]
pub enum Waited {
    /// Capacity may be free: pick again, then [`Ticket::admitted`] or [`Ticket::requeue`].
    Go,
    /// The deadline passed.
    TimedOut,
    /// Displaced by a higher-priority arrival.
    Shed,
}

impl Ticket<'_> {
    pub fn priority(&self) -> Priority {
        self.key.0
    }

    /// Whether this request is first in line.
    pub fn is_head(&self) -> bool {
        self.in_queue && self.queue.is_head(self.key)
    }

    /// When the request joined the queue.
    pub fn since(&self) -> Instant {
        self.since
    }

    /// Waits for a wake or `until`. The head of the queue also returns [`Waited::Go`] every
    /// [`HEAD_RECHECK`] (still in the queue) to look for capacity that came back by the clock.
    pub async fn wait(&mut self, until: Instant) -> Waited {
        loop {
            let Some(woken) = self.woken.as_mut() else {
                return Waited::TimedOut;
            };
            let now = Instant::now();
            let head = self.in_queue && self.queue.is_head(self.key);
            let wake_at = if head {
                until.min(now + HEAD_RECHECK)
            } else {
                until
            };
            // Biased: a wake or displacement that already arrived wins over a deadline that passed.
            tokio::select! {
                biased;
                wake = woken => {
                    self.woken = None;
                    self.in_queue = false;
                    return match wake {
                        Ok(Wake::Go) => {
                            self.go = true;
                            Waited::Go
                        }
                        Ok(Wake::Shed) => Waited::Shed,
                        // The sender is only dropped with the entry, which happens only when
                        // the queue lets go of the request: treat it as a wake.
                        Err(_) => Waited::Go,
                    };
                }
                () = tokio::time::sleep_until(wake_at) => {
                    if Instant::now() >= until {
                        return Waited::TimedOut;
                    }
                    // Still first in line now: one ahead may have started looking meanwhile.
                    if head && self.queue.is_head(self.key) {
                        return Waited::Go;
                    }
                }
            }
        }
    }

    /// Whether the last wait ended with a wake from a release (not a look of the head's own).
    pub fn woken_by_release(&self) -> bool {
        self.go
    }

    /// After a wake this request could not use: passes it to the next in line (see
    /// [`Queue::wake_after`]). Call after [`Ticket::requeue`].
    pub fn pass_on(&self) {
        self.queue.wake_after(self.key);
    }

    /// The pick after a wake found nothing: back to the same place in line.
    pub fn requeue(&mut self) {
        if self.in_queue {
            return;
        }
        let (wake, woken) = oneshot::channel();
        let mut state = self.queue.lock();
        self.woken = Some(woken);
        self.go = false;
        if let Some(missed) = state.missed.remove(&self.key) {
            // A release came while this looked: look again at once, still first in line. Any more
            // that came stay with it until that look is done (passed on when it leaves, or when it
            // goes back to wait): handed down now, they would set the next in line looking beside
            // it, and whichever looked first would take a single freed slot out of turn (a wake
            // is "capacity may be free", and heartbeats and limit changes send them too).
            let _ = wake.send(Wake::Go);
            self.missed += missed - 1;
            return;
        }
        state.looking.remove(&self.key);
        state.entries.insert(
            self.key,
            Entry {
                wake,
                since: self.since,
            },
        );
        self.queue.waiting.fetch_add(1, Ordering::SeqCst);
        self.in_queue = true;
        drop(state);
        // It could not use what came free while it looked: those behind may.
        for _ in 0..std::mem::take(&mut self.missed) {
            self.queue.wake_after(self.key);
        }
    }

    /// The request got an endpoint: leave the queue, and count how long it waited.
    pub fn admitted(mut self) {
        self.leave();
        let waited = Instant::now().saturating_duration_since(self.since);
        let stats = &self.queue.stats;
        stats.admitted.fetch_add(1, Ordering::Relaxed);
        stats.wait_us.fetch_add(
            u64::try_from(waited.as_micros()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        let mut state = self.queue.lock();
        state.drain.record(Instant::now());
        state.clock = state.clock.max(self.key.1);
        drop(state);
        // Dropping passes the wake on: more capacity may have come free at once.
    }

    fn leave(&mut self) {
        let mut state = self.queue.lock();
        state.looking.remove(&self.key);
        // A release that came for this request while it looked goes to the next in line.
        self.missed += state.missed.remove(&self.key).unwrap_or(0);
        if self.in_queue {
            if state.entries.remove(&self.key).is_some() {
                self.queue.waiting.fetch_sub(1, Ordering::SeqCst);
            }
            self.in_queue = false;
            self.go = self.go || self.woken.as_mut().is_some_and(|w| w.try_recv().is_ok());
        }
        if state.entries.is_empty() && state.looking.is_empty() {
            state.drain.emptied(Instant::now());
            state.standing.emptied();
        }
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        self.leave();
        if let Some(tenant) = &self.tenant {
            tenant.leave_queue();
        }
        {
            // Nobody left in line: the tenants' finish times have nothing to be fair against.
            let mut state = self.queue.lock();
            if state.entries.is_empty() && state.looking.is_empty() {
                state.finish.clear();
            }
        }
        if self.go {
            self.queue.wake_one();
        }
        for _ in 0..std::mem::take(&mut self.missed) {
            self.queue.wake_one();
        }
    }
}
