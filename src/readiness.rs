//! Whether this tongs should receive client traffic: what `/readyz` reports.
//!
//! A leaf: the server marks the drain, the admin port reads it, together with whether every pool's
//! endpoint sources have their first list in (`source::Sources::synced`).

use std::sync::atomic::{AtomicBool, Ordering};

/// What the readiness probe reports besides the sources.
#[derive(Debug, Default)]
pub struct Readiness {
    draining: AtomicBool,
}

impl Readiness {
    pub fn set_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    pub fn is_ready(&self) -> bool {
        !self.draining.load(Ordering::Relaxed)
    }
}
