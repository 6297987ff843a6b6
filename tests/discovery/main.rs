//! Kubernetes pod discovery end to end: tongs' pod watcher (kube-rs's client and runtime watcher,
//! unchanged) against a fake API server on a real socket (`tests/support/kube_api/`), reached through a
//! kubeconfig file; the endpoints it finds are real backends and simulated GPU nodes on loopback
//! addresses other than 127.0.0.1 (interLink's placeholder podIP). tongs serves a loopback podIP only
//! where an `allow` range inside 127.0.0.0/8 names it, so these tests name one (`LOOPBACK_PODS`). Linux
//! routes all of 127.0.0.0/8 to `lo`, so 127.0.0.2, 127.0.0.3, ... are distinct hosts to bind.
//!
//! Covered: the fake itself against kube-rs's client (so the rest tests tongs, not the fake); every
//! address rule and their order; weight and max-outstanding annotations; allowlist refusals (counted,
//! logged once per pod, never sent traffic); selectors; pod lifecycle with requests in flight while a
//! pod leaves; `/readyz` before the first list; a dropped watch (resumed from its resourceVersion), a
//! compacted history and a server-expired watch (410 → re-list) with the endpoints in service while
//! lists fail; bookmarks; paged lists of thousands of pods; node self-registration; and the SaladCloud
//! API rule with write-back (`tests/support/salad_api.rs`), a fake of SaladCloud's public API.
//!
//! Nothing sleeps to wait: every wait polls a real outcome with a deadline.

#![forbid(unsafe_code)]

// The one path: shared with the other test binaries (see `tests/support/mod.rs`).
#[path = "../support/mod.rs"]
mod support;

use support::{kube_api, salad_api};

mod harness;

mod fake;
mod lifecycle;
mod pools;
mod process;
mod registration;
mod reload;
mod replicas;
mod rules;
mod salad;
mod watch_loss;
