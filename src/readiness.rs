//! Whether this tongs should receive client traffic: what `/readyz` reports.
//!
//! A leaf: discovery marks the first sync, the server marks the drain, the admin port reads it.

use std::sync::atomic::{AtomicBool, Ordering};

/// What the readiness probe reports.
#[derive(Debug, Default)]
pub struct Readiness {
    synced: AtomicBool,
    draining: AtomicBool,
}

impl Readiness {
    pub fn set_synced(&self) {
        self.synced.store(true, Ordering::Relaxed);
    }

    pub fn set_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    pub fn is_ready(&self) -> bool {
        self.synced.load(Ordering::Relaxed) && !self.draining.load(Ordering::Relaxed)
    }
}
