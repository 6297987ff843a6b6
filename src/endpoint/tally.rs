//! What happened at an endpoint, counted since it joined: for `/debug/endpoints`, the metrics and tests.

use std::sync::atomic::{AtomicU64, Ordering};

/// An endpoint's counters. Each only grows.
#[derive(Debug, Default)]
pub struct Tally {
    /// Requests ever sent here.
    pub(super) requests: AtomicU64,
    /// Requests here that failed at the endpoint (connect error, broken connection, timeout).
    pub(super) failures: AtomicU64,
    /// Times its breaker ejected it.
    pub(super) ejections: AtomicU64,
    /// Times heartbeats marked it unhealthy.
    pub(super) unhealthy_marks: AtomicU64,
    /// Times it asked for back-off.
    pub(super) cooldowns: AtomicU64,
    /// Attempts that stalled here.
    pub(super) stalls: AtomicU64,
    /// Streams that broke here and were continued from their text, this node having given no
    /// token ids.
    continued_by_text: AtomicU64,
}

impl Tally {
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    pub fn failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }

    pub fn ejections(&self) -> u64 {
        self.ejections.load(Ordering::Relaxed)
    }

    pub fn unhealthy_marks(&self) -> u64 {
        self.unhealthy_marks.load(Ordering::Relaxed)
    }

    pub fn cooldowns(&self) -> u64 {
        self.cooldowns.load(Ordering::Relaxed)
    }

    pub fn stalls(&self) -> u64 {
        self.stalls.load(Ordering::Relaxed)
    }

    pub fn continued_by_text(&self) -> u64 {
        self.continued_by_text.load(Ordering::Relaxed)
    }

    /// A stream that broke here was continued from its text.
    pub fn count_continued_by_text(&self) {
        self.continued_by_text.fetch_add(1, Ordering::Relaxed);
    }
}
